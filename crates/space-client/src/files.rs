//! `/v1/sandboxes/{id}/files…`: upload (a file, or a tar unpacked into a
//! directory), download (streamed), list, stat, mkdir, move, remove. Bodies
//! stream both ways: nothing of a file is held in memory here.

use reqwest::header::CONTENT_LENGTH;
use reqwest::Method;
use space_api::{FileInfo, FileListing, MkdirRequest, MoveRequest, Removed, UnpackStats};

use crate::{ByteStream, Client, Result};

/// How an uploaded file is written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UploadOptions {
    /// Permission bits (default `0644`).
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// The body's length, sent as `Content-Length` (a streamed body has none of its
    /// own); the server refuses a declared oversize upload before reading it.
    pub content_length: Option<u64>,
}

/// A file being downloaded: what the server said about it, and its bytes.
pub struct Download {
    /// `Content-Length`: the file's size.
    pub size: Option<u64>,
    /// `x-space-mode` (permission bits), `x-space-uid`, `x-space-gid`.
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// The bytes; an error item means the transfer broke (never a short file that
    /// looks complete).
    pub body: ByteStream,
}

impl Client {
    /// `PUT …/files?path=P[&mode=&uid=&gid=]`: writes the body to `path` (atomically).
    pub async fn upload_file(
        &self,
        sb: &str,
        path: &str,
        body: impl Into<reqwest::Body>,
        opts: &UploadOptions,
    ) -> Result<FileInfo> {
        let mut query = vec![("path", path.to_string())];
        if let Some(m) = opts.mode {
            query.push(("mode", format!("{m:04o}")));
        }
        if let Some(u) = opts.uid {
            query.push(("uid", u.to_string()));
        }
        if let Some(g) = opts.gid {
            query.push(("gid", g.to_string()));
        }
        let url = self.url(&["v1", "sandboxes", sb, "files"], &query)?;
        let mut rb = self.req(Method::PUT, url, false).body(body);
        if let Some(n) = opts.content_length {
            rb = rb.header(CONTENT_LENGTH, n);
        }
        self.send_json(rb).await
    }

    /// `PUT …/files?path=DIR&format=tar[&gzip=true]`: unpacks a tar (a gzip'd one
    /// with `gzip`) into `dir`.
    pub async fn upload_tar(
        &self,
        sb: &str,
        dir: &str,
        tar: impl Into<reqwest::Body>,
        gzip: bool,
    ) -> Result<UnpackStats> {
        let mut query = vec![("path", dir.to_string()), ("format", "tar".to_string())];
        if gzip {
            query.push(("gzip", "true".into()));
        }
        let url = self.url(&["v1", "sandboxes", sb, "files"], &query)?;
        self.send_json(self.req(Method::PUT, url, false).body(tar))
            .await
    }

    /// `GET …/files?path=P`: a file's bytes, streamed.
    pub async fn download_file(&self, sb: &str, path: &str) -> Result<Download> {
        let resp = self
            .get_stream(
                &["v1", "sandboxes", sb, "files"],
                &[("path", path.to_string())],
            )
            .await?;
        let header = |name: &str, radix: u32| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| u32::from_str_radix(v, radix).ok())
        };
        let (mode, uid, gid) = (
            header("x-space-mode", 8),
            header("x-space-uid", 10),
            header("x-space-gid", 10),
        );
        Ok(Download {
            size: resp.content_length(),
            mode,
            uid,
            gid,
            body: self.byte_stream(resp),
        })
    }

    /// `GET …/files?path=DIR&format=tar[&gzip=true]`: a tar of a directory, streamed.
    pub async fn download_tar(&self, sb: &str, dir: &str, gzip: bool) -> Result<ByteStream> {
        let mut query = vec![("path", dir.to_string()), ("format", "tar".to_string())];
        if gzip {
            query.push(("gzip", "true".into()));
        }
        let resp = self
            .get_stream(&["v1", "sandboxes", sb, "files"], &query)
            .await?;
        Ok(self.byte_stream(resp))
    }

    /// `GET …/files/list?path=P[&depth=N]` (depth 1 to 64, default 1).
    pub async fn list_files(
        &self,
        sb: &str,
        path: &str,
        depth: Option<u32>,
    ) -> Result<FileListing> {
        let mut query = vec![("path", path.to_string())];
        if let Some(d) = depth {
            query.push(("depth", d.to_string()));
        }
        self.get_json(
            Method::GET,
            &["v1", "sandboxes", sb, "files", "list"],
            &query,
        )
        .await
    }

    /// `GET …/files/stat?path=P`.
    pub async fn stat_file(&self, sb: &str, path: &str) -> Result<FileInfo> {
        self.get_json(
            Method::GET,
            &["v1", "sandboxes", sb, "files", "stat"],
            &[("path", path.to_string())],
        )
        .await
    }

    /// `POST …/files/mkdir` (like `mkdir -p`): the directory.
    pub async fn mkdir(&self, sb: &str, req: &MkdirRequest) -> Result<FileInfo> {
        self.post_json(&["v1", "sandboxes", sb, "files", "mkdir"], req)
            .await
    }

    /// `POST …/files/move`: what is at `to` now.
    pub async fn move_file(&self, sb: &str, req: &MoveRequest) -> Result<FileInfo> {
        self.post_json(&["v1", "sandboxes", sb, "files", "move"], req)
            .await
    }

    /// `DELETE …/files?path=P[&recursive=true]`: how many entries went.
    pub async fn remove_file(&self, sb: &str, path: &str, recursive: bool) -> Result<Removed> {
        let mut query = vec![("path", path.to_string())];
        if recursive {
            query.push(("recursive", "true".into()));
        }
        self.get_json(Method::DELETE, &["v1", "sandboxes", sb, "files"], &query)
            .await
    }
}
