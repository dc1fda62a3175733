//! Typed calls for files inside the sandbox (the agent resolves every path there; see
//! `space_agent::fs`): upload, download, list, stat, mkdir, move, remove.
//!
//! These calls have no deadline of their own: a transfer takes as long as its size, and
//! the connection's pings end a call whose agent stopped answering. What the agent sends
//! back is bounded: JSON answers by size, a download's headers by parsing them strictly.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, Method};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::BodyExt;
use serde::Serialize;
use space_api::{FileInfo, FileListing, MkdirRequest, MoveRequest, Removed, UnpackStats};

use crate::conn::{
    body_from_bytes, encode, parse_json, read_bounded, success, AgentConn, HostBody, MAX_AGENT_JSON,
};
use crate::error::{AgentError, BodyError, MAX_ERROR_MESSAGE};

/// Largest listing accepted from an agent: its 10 000 entries at about 3 KiB each.
pub const MAX_LISTING_JSON: usize = 32 << 20;
/// The trailer in which the agent reports a download that failed after its headers.
const ERROR_TRAILER: &str = "x-space-error";
/// Longest header value from the agent that is looked at.
const MAX_HEADER_VALUE: usize = 24;

/// What an upload writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UploadKind {
    /// The body is the file's bytes, written atomically; permission bits (default
    /// `0o644`) and owner (default root).
    File {
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
    },
    /// The body is a tar (gzip-compressed with `gzip`) unpacked into the directory,
    /// which is created like `mkdir -p`; at most `max_bytes` unpacked (the agent's
    /// default otherwise).
    Tar { gzip: bool, max_bytes: Option<u64> },
}

/// What an upload wrote: a file, or the entries of an archive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Uploaded {
    File(FileInfo),
    Archive(UnpackStats),
}

/// What a download sends: a file's bytes, or a tar of a directory (or of one file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DownloadFormat {
    Raw,
    Tar,
}

/// A download under way: what the agent said about the file (raw downloads), and its
/// bytes as a stream.
#[derive(Debug)]
pub struct Download {
    /// The file's size (its bytes end short of it if the file shrank meanwhile).
    pub size: Option<u64>,
    /// Permission bits (`& 0o7777`).
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub body: DownloadBody,
}

impl AgentConn {
    /// Writes `body` at `path` (see [`UploadKind`]); the answer comes after its last byte.
    pub async fn upload(
        &self,
        path: &str,
        kind: UploadKind,
        body: HostBody,
    ) -> Result<Uploaded, AgentError> {
        let mut query = format!("/v1/files?path={}", encode(path));
        match kind {
            UploadKind::File { mode, uid, gid } => {
                if let Some(m) = mode {
                    if m > 0o7777 {
                        return Err(AgentError::Request(format!("mode {m:o} is not 0-7777")));
                    }
                    query.push_str(&format!("&mode={m:04o}"));
                }
                if let Some(u) = uid {
                    query.push_str(&format!("&uid={u}"));
                }
                if let Some(g) = gid {
                    query.push_str(&format!("&gid={g}"));
                }
            }
            UploadKind::Tar { gzip, max_bytes } => {
                query.push_str("&format=tar");
                if gzip {
                    query.push_str("&gzip=true");
                }
                if let Some(max) = max_bytes {
                    query.push_str(&format!("&max_bytes={max}"));
                }
            }
        }
        let resp = self
            .request(
                Method::PUT,
                &query,
                Some("application/octet-stream"),
                body,
                None,
            )
            .await?;
        let resp = success(resp).await?;
        let bytes = read_bounded(resp.into_body(), MAX_AGENT_JSON, None).await?;
        match kind {
            UploadKind::File { .. } => parse_json(&bytes).map(Uploaded::File),
            UploadKind::Tar { .. } => parse_json(&bytes).map(Uploaded::Archive),
        }
    }

    /// Writes a small file whole (`0o644`, root's).
    pub async fn write_file(&self, path: &str, bytes: Bytes) -> Result<FileInfo, AgentError> {
        let kind = UploadKind::File {
            mode: None,
            uid: None,
            gid: None,
        };
        match self.upload(path, kind, body_from_bytes(bytes)).await? {
            Uploaded::File(info) => Ok(info),
            Uploaded::Archive(_) => Err(AgentError::Protocol("not a file's answer".into())),
        }
    }

    /// Starts a download of `path`: its headers are in, its bytes stream.
    pub async fn download(
        &self,
        path: &str,
        format: DownloadFormat,
    ) -> Result<Download, AgentError> {
        let mut query = format!("/v1/files?path={}", encode(path));
        if format == DownloadFormat::Tar {
            query.push_str("&format=tar");
        }
        let resp = self
            .request(
                Method::GET,
                &query,
                None,
                body_from_bytes(Bytes::new()),
                None,
            )
            .await?;
        let resp = success(resp).await?;
        let headers = resp.headers();
        let (size, mode, uid, gid) = match format {
            DownloadFormat::Raw => (
                header_number(headers, http::header::CONTENT_LENGTH.as_str(), 10),
                header_number(headers, "x-space-mode", 8).filter(|m| *m <= 0o7777),
                header_number(headers, "x-space-uid", 10).and_then(|v| u32::try_from(v).ok()),
                header_number(headers, "x-space-gid", 10).and_then(|v| u32::try_from(v).ok()),
            ),
            DownloadFormat::Tar => (None, None, None, None),
        };
        Ok(Download {
            size,
            mode: mode.and_then(|m| u32::try_from(m).ok()),
            uid,
            gid,
            body: DownloadBody::new(resp.into_body().map_err(BodyError::from).boxed_unsync()),
        })
    }

    /// A whole small file, at most `max` bytes (more is an error).
    pub async fn read_file(&self, path: &str, max: usize) -> Result<Bytes, AgentError> {
        let download = self.download(path, DownloadFormat::Raw).await?;
        read_bounded(download.body, max, None)
            .await
            .map_err(|e| match e {
                // The body's own errors (a failure trailer) say more than the reading.
                AgentError::Broken(inner) => match inner.downcast::<AgentError>() {
                    Ok(e) => *e,
                    Err(inner) => AgentError::Broken(inner),
                },
                e => e,
            })
    }

    /// The entries below `path`, depth-first, `depth` levels (1 when `None`).
    pub async fn list_files(
        &self,
        path: &str,
        depth: Option<u32>,
    ) -> Result<FileListing, AgentError> {
        let mut query = format!("/v1/files/list?path={}", encode(path));
        if let Some(d) = depth {
            query.push_str(&format!("&depth={d}"));
        }
        self.call(Method::GET, &query, None::<&()>, MAX_LISTING_JSON, None)
            .await
    }

    /// What `path` is; a final symbolic link itself.
    pub async fn stat(&self, path: &str) -> Result<FileInfo, AgentError> {
        let query = format!("/v1/files/stat?path={}", encode(path));
        self.call(Method::GET, &query, None::<&()>, MAX_AGENT_JSON, None)
            .await
    }

    /// Creates a directory and its parents (`mkdir -p`).
    pub async fn mkdir(&self, req: &MkdirRequest) -> Result<FileInfo, AgentError> {
        self.call(
            Method::POST,
            "/v1/files/mkdir",
            Some(req),
            MAX_AGENT_JSON,
            None,
        )
        .await
    }

    /// Moves `from` to `to`; the answer is what `to` is then.
    pub async fn move_file(&self, req: &MoveRequest) -> Result<FileInfo, AgentError> {
        self.call(
            Method::POST,
            "/v1/files/move",
            Some(req),
            MAX_AGENT_JSON,
            None,
        )
        .await
    }

    /// Removes `path` (a directory's tree too with `recursive`).
    pub async fn remove(&self, path: &str, recursive: bool) -> Result<Removed, AgentError> {
        let mut query = format!("/v1/files?path={}", encode(path));
        if recursive {
            query.push_str("&recursive=true");
        }
        self.call(Method::DELETE, &query, None::<&()>, MAX_AGENT_JSON, None)
            .await
    }
}

/// A number in a header of the agent's, strictly: digits of `radix` only, short.
fn header_number(headers: &HeaderMap, name: &str, radix: u32) -> Option<u64> {
    let v = headers.get(name)?.to_str().ok()?;
    if v.is_empty() || v.len() > MAX_HEADER_VALUE || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    u64::from_str_radix(v, radix).ok()
}

/// A download's bytes. An agent that fails after the headers went out says so in a
/// trailer: that, or a broken stream, is an error item, never a quiet end, so that a
/// broken download cannot pass for a short, complete one. Nothing comes after an error.
pub struct DownloadBody {
    inner: UnsyncBoxBody<Bytes, BodyError>,
    done: bool,
    /// Told the length of each piece of data as it passes (see [`DownloadBody::observed`]).
    observer: Option<Box<dyn Fn(usize) + Send>>,
}

impl std::fmt::Debug for DownloadBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DownloadBody")
            .field("done", &self.done)
            .finish()
    }
}

impl DownloadBody {
    pub(crate) fn new(inner: UnsyncBoxBody<Bytes, BodyError>) -> DownloadBody {
        DownloadBody {
            inner,
            done: false,
            observer: None,
        }
    }

    /// The same body, telling `f` the length of each piece of data it yields (a metric
    /// of bytes sent, whichever front door sends them).
    pub fn observed(mut self, f: impl Fn(usize) + Send + 'static) -> DownloadBody {
        self.observer = Some(Box::new(f));
        self
    }
}

impl futures::Stream for DownloadBody {
    type Item = Result<Bytes, AgentError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        use http_body::Body;
        loop {
            if self.done {
                return Poll::Ready(None);
            }
            let frame = match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(f) => f,
            };
            match frame {
                None => {
                    self.done = true;
                    return Poll::Ready(None);
                }
                Some(Err(e)) => {
                    self.done = true;
                    return Poll::Ready(Some(Err(AgentError::Broken(e))));
                }
                Some(Ok(f)) => match f.into_data() {
                    Ok(data) => {
                        if let Some(observe) = &self.observer {
                            observe(data.len());
                        }
                        return Poll::Ready(Some(Ok(data)));
                    }
                    Err(f) => {
                        let Some(e) = f.trailers_ref().and_then(|t| t.get(ERROR_TRAILER)) else {
                            continue;
                        };
                        self.done = true;
                        let shown = &e.as_bytes()[..e.len().min(MAX_ERROR_MESSAGE)];
                        return Poll::Ready(Some(Err(AgentError::Failed(
                            String::from_utf8_lossy(shown).into_owned(),
                        ))));
                    }
                },
            }
        }
    }
}

/// A [`DownloadBody`] is a body too (its errors boxed), to read with the body tools.
impl http_body::Body for DownloadBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BodyError>>> {
        use futures::Stream;
        self.poll_next(cx).map(|o| {
            o.map(|r| {
                r.map(http_body::Frame::data)
                    .map_err(|e| Box::new(e) as BodyError)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use http_body_util::StreamBody;
    use hyper::body::Frame;

    fn body_of(frames: Vec<Result<Frame<Bytes>, BodyError>>) -> DownloadBody {
        DownloadBody::new(StreamBody::new(futures::stream::iter(frames)).boxed_unsync())
    }

    async fn items(body: DownloadBody) -> Vec<Result<Bytes, AgentError>> {
        StreamExt::collect(body).await
    }

    fn trailer(name: &'static str, value: &[u8]) -> Frame<Bytes> {
        let mut t = HeaderMap::new();
        t.insert(name, http::HeaderValue::from_bytes(value).unwrap());
        Frame::trailers(t)
    }

    #[tokio::test]
    async fn a_failure_trailer_is_an_error_after_the_data() {
        let items = items(body_of(vec![
            Ok(Frame::data(Bytes::from_static(b"abc"))),
            Ok(trailer(
                ERROR_TRAILER,
                br#"{"error":{"code":"internal","message":"EIO"}}"#,
            )),
            Ok(Frame::data(Bytes::from_static(b"never"))),
        ]))
        .await;
        assert_eq!(items.len(), 2, "{items:?}");
        assert!(matches!(&items[0], Ok(b) if &b[..] == b"abc"));
        assert!(matches!(&items[1], Err(AgentError::Failed(m)) if m.contains("EIO")));
    }

    #[tokio::test]
    async fn other_trailers_are_passed_over() {
        let items = items(body_of(vec![
            Ok(Frame::data(Bytes::from_static(b"a"))),
            Ok(trailer("x-other", b"1")),
        ]))
        .await;
        assert_eq!(items.len(), 1);
        assert!(items[0].is_ok());
    }

    #[tokio::test]
    async fn a_break_is_an_error_and_the_end() {
        let items = items(body_of(vec![
            Ok(Frame::data(Bytes::from_static(b"a"))),
            Err("reset".into()),
            Ok(Frame::data(Bytes::from_static(b"b"))),
        ]))
        .await;
        assert_eq!(items.len(), 2);
        assert!(matches!(&items[1], Err(AgentError::Broken(_))));
    }

    #[tokio::test]
    async fn a_long_trailer_is_cut() {
        let long = vec![b'x'; 8000];
        let items = items(body_of(vec![Ok(trailer(ERROR_TRAILER, &long))])).await;
        assert!(matches!(&items[0], Err(AgentError::Failed(m)) if m.len() == MAX_ERROR_MESSAGE));
    }

    #[tokio::test]
    async fn reading_it_whole_keeps_the_failure() {
        let body = body_of(vec![
            Ok(Frame::data(Bytes::from_static(b"abc"))),
            Ok(trailer(ERROR_TRAILER, b"disk")),
        ]);
        match read_bounded(body, 100, None).await {
            Err(AgentError::Broken(e)) => {
                assert!(matches!(
                    e.downcast_ref::<AgentError>(),
                    Some(AgentError::Failed(_))
                ))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn download_headers_are_read_strictly() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("content-length", "12"),
            ("x-space-mode", "0751"),
            ("x-space-uid", "7"),
            ("x-space-gid", "-1"),
            ("x-space-other", "1"),
        ] {
            h.insert(k, http::HeaderValue::from_static(v));
        }
        assert_eq!(header_number(&h, "content-length", 10), Some(12));
        assert_eq!(header_number(&h, "x-space-mode", 8), Some(0o751));
        assert_eq!(header_number(&h, "x-space-uid", 10), Some(7));
        assert_eq!(header_number(&h, "x-space-gid", 10), None);
        assert_eq!(header_number(&h, "x-space-missing", 10), None);
        h.insert("x-space-mode", http::HeaderValue::from_static("0999"));
        assert_eq!(header_number(&h, "x-space-mode", 8), None);
        h.insert(
            "content-length",
            http::HeaderValue::from_static("1234567890123456789012345"),
        );
        assert_eq!(header_number(&h, "content-length", 10), None);
    }
}
