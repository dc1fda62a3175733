//! The agent's file endpoints (`/v1/files…`, see [`space_agent::protocol`]):
//! HTTP glue in front of [`space_agent::fs`]. The filesystem work runs on
//! blocking threads; request and response bodies pass through small bounded
//! channels, so a transfer of any size holds only a few chunks in memory.

// Handlers return their error as the ready response; one per request, so its
// size does not matter.
#![allow(clippy::result_large_err)]

use std::convert::Infallible;
use std::io::{self, Read, Write};
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::{header, HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde::{Deserialize, Serialize};
use space_agent::fs::{self, Attrs, FsError, Limits, Root};
use space_agent::protocol::{ErrorBody, MAX_JSON_BODY};
use tokio::sync::mpsc;

use crate::http::Body;

/// Directory the file API is rooted at (tests point it at a temporary one).
const ROOT_ENV: &str = "SPACE_AGENT_FILES_ROOT";
/// Chunks in flight per body, each at most [`CHUNK`] (a file download's at most
/// [`FILE_CHUNK`]).
const QUEUE: usize = 4;
const CHUNK: usize = 256 * 1024;
/// A file download's read size. Under gVisor every read is a trap into the Sentry and
/// every chunk a wake-up of the connection's task: 1 MiB reads move a file about 1.5×
/// faster than 256 KiB ones (`dd` in a sandbox: 0.19 s against 0.12 s a GiB).
const FILE_CHUNK: usize = 1 << 20;
/// Trailer sent when a streamed download fails after its headers went out.
const ERROR_TRAILER: &str = "x-space-error";

static ROOT: OnceLock<Result<Arc<Root>, String>> = OnceLock::new();

fn root() -> Result<Arc<Root>, Response<Body>> {
    ROOT.get_or_init(|| {
        let dir = std::env::var(ROOT_ENV)
            .ok()
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| "/".into());
        Root::open(&dir)
            .and_then(|r| r.with_forbidden(fs::SANDBOX_FORBIDDEN))
            .map(Arc::new)
            .map_err(|e| format!("file API root {dir}: {}", e.message()))
    })
    .clone()
    .map_err(|m| error(StatusCode::INTERNAL_SERVER_ERROR, "internal", m))
}

fn json<T: Serialize>(status: StatusCode, value: &T) -> Response<Body> {
    let body = serde_json::to_vec(value).unwrap_or_default();
    let mut r = Response::new(Full::new(Bytes::from(body)).boxed());
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response<Body> {
    json(status, &ErrorBody::new(code, message))
}

fn fs_error(e: &FsError) -> Response<Body> {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    error(status, e.code(), e.message())
}

fn bad_request(message: impl Into<String>) -> Response<Body> {
    error(StatusCode::BAD_REQUEST, "invalid_request", message)
}

fn method_not_allowed() -> Response<Body> {
    error(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "method not allowed",
    )
}

/// Runs filesystem work on a blocking thread.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, FsError> + Send + 'static,
) -> Result<T, Response<Body>> {
    match tokio::task::spawn_blocking(f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(fs_error(&e)),
        Err(_) => Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "file operation failed unexpectedly",
        )),
    }
}

/// Routes `/v1/files` (`op` empty) and `/v1/files/{op}`.
pub async fn handle(op: &str, req: Request<Incoming>) -> Response<Body> {
    let root = match root() {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    let query = match Query::parse(req.uri().query().unwrap_or("")) {
        Ok(q) => q,
        Err(resp) => return resp,
    };
    let tar = match query.tar() {
        Ok(t) => t,
        Err(resp) => return resp,
    };
    let method = req.method().clone();
    let result = match (op, method) {
        ("", Method::GET) if tar => download_tar(root, query).await,
        ("", Method::GET) => download(root, query).await,
        ("", Method::PUT) if tar => upload_tar(root, query, req.into_body()).await,
        ("", Method::PUT) => upload(root, query, req.into_body()).await,
        ("", Method::DELETE) => remove(root, query).await,
        ("list", Method::GET) => list(root, query).await,
        ("stat", Method::GET) => stat(root, query).await,
        ("mkdir", Method::POST) => mkdir(root, req.into_body()).await,
        ("move", Method::POST) => rename(root, req.into_body()).await,
        ("" | "list" | "stat" | "mkdir" | "move", _) => Err(method_not_allowed()),
        _ => Err(error(
            StatusCode::NOT_FOUND,
            "not_found",
            "no such endpoint",
        )),
    };
    result.unwrap_or_else(|resp| resp)
}

/// The query parameters the file endpoints understand (others are ignored).
#[derive(Debug, Default)]
struct Query {
    path: Option<String>,
    format: Option<String>,
    gzip: bool,
    recursive: bool,
    max_bytes: Option<u64>,
    depth: Option<u32>,
    mode: Option<u32>,
    uid: Option<u32>,
    gid: Option<u32>,
}

impl Query {
    fn parse(query: &str) -> Result<Query, Response<Body>> {
        let mut q = Query::default();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = percent_decode(v).ok_or_else(|| {
                let code = if k == "path" {
                    "invalid_path"
                } else {
                    "invalid_request"
                };
                let msg = format!("query parameter {k} is not valid UTF-8");
                error(StatusCode::BAD_REQUEST, code, msg)
            })?;
            let num = |v: &str| -> Result<u64, Response<Body>> {
                v.parse()
                    .map_err(|_| bad_request(format!("invalid {k}={v:?}")))
            };
            let boolean = |v: &str| match v {
                "true" | "1" => Ok(true),
                "false" | "0" | "" => Ok(false),
                _ => Err(bad_request(format!("invalid {k}={v:?}"))),
            };
            let id = |v: &str| -> Result<u32, Response<Body>> {
                v.parse()
                    .map_err(|_| bad_request(format!("invalid {k}={v:?}")))
            };
            match k {
                "path" => q.path = Some(v),
                "format" => q.format = Some(v),
                "gzip" => q.gzip = boolean(&v)?,
                "recursive" => q.recursive = boolean(&v)?,
                "max_bytes" => q.max_bytes = Some(num(&v)?),
                "depth" => {
                    q.depth =
                        Some(u32::try_from(num(&v)?).map_err(|_| bad_request("depth too large"))?)
                }
                "mode" => {
                    q.mode = Some(
                        u32::from_str_radix(&v, 8)
                            .ok()
                            .filter(|m| *m <= 0o7777)
                            .ok_or_else(|| bad_request(format!("invalid mode {v:?} (octal)")))?,
                    )
                }
                "uid" => q.uid = Some(id(&v)?),
                "gid" => q.gid = Some(id(&v)?),
                _ => {}
            }
        }
        Ok(q)
    }

    fn path(&self) -> Result<String, Response<Body>> {
        self.path.clone().ok_or_else(|| {
            error(
                StatusCode::BAD_REQUEST,
                "invalid_path",
                "the path query parameter is required",
            )
        })
    }

    fn tar(&self) -> Result<bool, Response<Body>> {
        match self.format.as_deref() {
            None | Some("raw") => Ok(false),
            Some("tar") => Ok(true),
            Some(f) => Err(bad_request(format!("unknown format {f:?} (raw or tar)"))),
        }
    }
}

/// Decodes `%XX` escapes and `+` (a space, as in forms); `None` if not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
        match b[i] {
            b'%' if i + 2 < b.len() => match (hex(b[i + 1]), hex(b[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h * 16 + l);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

/// A request body read on a blocking thread.
struct BodyReader {
    rx: mpsc::Receiver<io::Result<Bytes>>,
    cur: Bytes,
    /// An error that arrived behind bytes still to be returned.
    failed: Option<io::Error>,
}

impl BodyReader {
    fn new(mut body: Incoming) -> BodyReader {
        let (tx, rx) = mpsc::channel(QUEUE);
        tokio::spawn(async move {
            while let Some(frame) = body.frame().await {
                let item = match frame {
                    Ok(f) => match f.into_data() {
                        Ok(d) if d.is_empty() => continue,
                        Ok(d) => Ok(d),
                        Err(_) => continue,
                    },
                    Err(e) => Err(io::Error::other(e)),
                };
                let failed = item.is_err();
                if tx.send(item).await.is_err() || failed {
                    return;
                }
            }
        });
        BodyReader {
            rx,
            cur: Bytes::new(),
            failed: None,
        }
    }
}

impl Read for BodyReader {
    /// Waits for the first bytes, then also takes what has already arrived behind them,
    /// up to `buf`'s size: a writer that falls behind catches up in a few large writes
    /// (each a trap into gVisor's Sentry) rather than one per HTTP/2 frame.
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        while self.cur.is_empty() {
            if let Some(e) = self.failed.take() {
                return Err(e);
            }
            match self.rx.blocking_recv() {
                Some(Ok(b)) => self.cur = b,
                Some(Err(e)) => return Err(e),
                None => return Ok(0),
            }
        }
        let mut n = 0;
        loop {
            let take = (buf.len() - n).min(self.cur.len());
            buf[n..n + take].copy_from_slice(&self.cur.split_to(take));
            n += take;
            if n == buf.len() {
                return Ok(n);
            }
            match self.rx.try_recv() {
                Ok(Ok(b)) => self.cur = b,
                // An error or the end is seen by the next read, after these bytes.
                Ok(Err(e)) => {
                    self.failed = Some(e);
                    return Ok(n);
                }
                Err(_) => return Ok(n),
            }
        }
    }
}

enum Chunk {
    Data(Bytes),
    Trailers(HeaderMap),
}

/// A response body fed from a blocking thread.
struct StreamBody(mpsc::Receiver<Chunk>);

impl http_body::Body for StreamBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|o| {
            o.map(|c| {
                Ok(match c {
                    Chunk::Data(b) => http_body::Frame::data(b),
                    Chunk::Trailers(t) => http_body::Frame::trailers(t),
                })
            })
        })
    }
}

/// Writes into a [`StreamBody`] in chunks; fails once the client is gone.
struct ChannelWriter {
    tx: mpsc::Sender<Chunk>,
    buf: BytesMut,
}

impl ChannelWriter {
    fn send(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let data = self.buf.split().freeze();
        self.tx
            .blocking_send(Chunk::Data(data))
            .map_err(|_| io::Error::from(io::ErrorKind::BrokenPipe))
    }

    /// Ends a stream that failed after its headers were sent: whatever is
    /// buffered, then (for archives) a block no tar reader accepts, then the
    /// error as a trailer.
    fn fail(mut self, e: &FsError, poison_tar: bool) {
        let _ = self.send();
        if poison_tar {
            let mut block = vec![0xffu8; 512];
            let msg = format!("space-agent: archive incomplete: {}", e.message());
            let n = msg.len().min(100);
            block[..n].copy_from_slice(&msg.as_bytes()[..n]);
            let _ = self.tx.blocking_send(Chunk::Data(Bytes::from(block)));
        }
        let body =
            serde_json::to_string(&ErrorBody::new(e.code(), e.message())).unwrap_or_default();
        if let Ok(v) = HeaderValue::from_str(&body) {
            let mut t = HeaderMap::new();
            t.insert(ERROR_TRAILER, v);
            let _ = self.tx.blocking_send(Chunk::Trailers(t));
        }
    }
}

impl Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(buf);
        if self.buf.len() >= CHUNK {
            self.send()?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send()
    }
}

fn stream_response(rx: mpsc::Receiver<Chunk>, content_type: &'static str) -> Response<Body> {
    let mut r = Response::new(BodyExt::boxed(StreamBody(rx)));
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

async fn download(root: Arc<Root>, q: Query) -> Result<Response<Body>, Response<Body>> {
    let path = q.path()?;
    let (mut file, info) = blocking(move || root.open_file(&path)).await?;
    let (tx, rx) = mpsc::channel(QUEUE);
    let size = info.size;
    tokio::task::spawn_blocking(move || {
        let w = ChannelWriter {
            tx,
            buf: BytesMut::new(),
        };
        let mut left = size;
        while left > 0 {
            let want = FILE_CHUNK.min(usize::try_from(left).unwrap_or(usize::MAX));
            // Read straight into the chunk that is sent: no zeroing, no second copy.
            let mut chunk = Vec::with_capacity(want);
            match (&mut file).take(want as u64).read_to_end(&mut chunk) {
                // The file shrank: the body ends short of its content-length.
                Ok(0) => break,
                Ok(n) => {
                    left -= n as u64;
                    if w.tx.blocking_send(Chunk::Data(Bytes::from(chunk))).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let e = FsError::Io {
                        context: "reading the file".into(),
                        source: e,
                    };
                    w.fail(&e, false);
                    return;
                }
            }
        }
    });
    let mut r = stream_response(rx, "application/octet-stream");
    let h = r.headers_mut();
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(size));
    h.insert(
        "x-space-mode",
        HeaderValue::from_str(&format!("{:04o}", info.mode))
            .unwrap_or(HeaderValue::from_static("0")),
    );
    h.insert("x-space-uid", HeaderValue::from(info.uid));
    h.insert("x-space-gid", HeaderValue::from(info.gid));
    Ok(r)
}

async fn download_tar(root: Arc<Root>, q: Query) -> Result<Response<Body>, Response<Body>> {
    let path = q.path()?;
    // Errors that can be known before streaming get a proper status.
    {
        let (root, path) = (root.clone(), path.clone());
        let info = blocking(move || root.stat_followed(&path)).await?;
        if !matches!(info.kind, fs::FileType::Dir | fs::FileType::File) {
            return Err(fs_error(&FsError::NotAFile(format!(
                "{} is neither a directory nor a regular file",
                info.path
            ))));
        }
    }
    let (tx, rx) = mpsc::channel(QUEUE);
    tokio::task::spawn_blocking(move || {
        let mut w = ChannelWriter {
            tx,
            buf: BytesMut::new(),
        };
        match root.pack_tar(&path, &mut w) {
            Ok(()) => {
                let _ = w.send();
            }
            Err(e) => w.fail(&e, true),
        }
    });
    Ok(stream_response(rx, "application/x-tar"))
}

async fn upload(
    root: Arc<Root>,
    q: Query,
    body: Incoming,
) -> Result<Response<Body>, Response<Body>> {
    let path = q.path()?;
    let attrs = Attrs {
        mode: q.mode.unwrap_or(Attrs::FILE.mode),
        uid: q.uid.unwrap_or(0),
        gid: q.gid.unwrap_or(0),
    };
    let reader = BodyReader::new(body);
    let info = blocking(move || root.write_file(&path, attrs, reader)).await?;
    Ok(json(StatusCode::CREATED, &info))
}

async fn upload_tar(
    root: Arc<Root>,
    q: Query,
    body: Incoming,
) -> Result<Response<Body>, Response<Body>> {
    let path = q.path()?;
    let limits = Limits {
        max_bytes: q.max_bytes.unwrap_or(Limits::default().max_bytes),
        ..Limits::default()
    };
    let reader = BodyReader::new(body);
    let gzip = q.gzip;
    let stats = blocking(move || {
        if gzip {
            root.unpack_tar_into(&path, flate2::read::GzDecoder::new(reader), &limits)
        } else {
            root.unpack_tar_into(&path, reader, &limits)
        }
    })
    .await?;
    Ok(json(StatusCode::CREATED, &stats))
}

#[derive(Serialize)]
struct Removed {
    removed: u64,
}

async fn remove(root: Arc<Root>, q: Query) -> Result<Response<Body>, Response<Body>> {
    let path = q.path()?;
    let recursive = q.recursive;
    let removed = blocking(move || root.remove(&path, recursive)).await?;
    Ok(json(StatusCode::OK, &Removed { removed }))
}

async fn list(root: Arc<Root>, q: Query) -> Result<Response<Body>, Response<Body>> {
    let path = q.path()?;
    let depth = q.depth.unwrap_or(1);
    let listing = blocking(move || root.list(&path, depth)).await?;
    Ok(json(StatusCode::OK, &listing))
}

async fn stat(root: Arc<Root>, q: Query) -> Result<Response<Body>, Response<Body>> {
    let path = q.path()?;
    let info = blocking(move || root.stat(&path)).await?;
    Ok(json(StatusCode::OK, &info))
}

/// `POST /v1/files/mkdir`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MkdirRequest {
    path: String,
    #[serde(default)]
    mode: Option<u32>,
    #[serde(default)]
    uid: Option<u32>,
    #[serde(default)]
    gid: Option<u32>,
}

/// `POST /v1/files/move`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MoveRequest {
    from: String,
    to: String,
    #[serde(default)]
    overwrite: bool,
}

async fn read_json<T: serde::de::DeserializeOwned>(body: Incoming) -> Result<T, Response<Body>> {
    let bytes = match Limited::new(body, MAX_JSON_BODY).collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return Err(error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                "request body too large",
            ))
        }
        Err(_) => return Err(bad_request("could not read request body")),
    };
    serde_json::from_slice(&bytes).map_err(|e| bad_request(format!("invalid JSON: {e}")))
}

async fn mkdir(root: Arc<Root>, body: Incoming) -> Result<Response<Body>, Response<Body>> {
    let req: MkdirRequest = read_json(body).await?;
    let mode = req.mode.unwrap_or(Attrs::DIR.mode);
    if mode > 0o7777 {
        return Err(bad_request(format!("invalid mode {mode}")));
    }
    let attrs = Attrs {
        mode,
        uid: req.uid.unwrap_or(0),
        gid: req.gid.unwrap_or(0),
    };
    let info = blocking(move || root.mkdir(&req.path, attrs)).await?;
    Ok(json(StatusCode::CREATED, &info))
}

async fn rename(root: Arc<Root>, body: Incoming) -> Result<Response<Body>, Response<Body>> {
    let req: MoveRequest = read_json(body).await?;
    let info = blocking(move || root.rename(&req.from, &req.to, req.overwrite)).await?;
    Ok(json(StatusCode::OK, &info))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reader(items: Vec<io::Result<&'static [u8]>>) -> BodyReader {
        let (tx, rx) = mpsc::channel(items.len().max(1));
        for item in items {
            tx.try_send(item.map(Bytes::from_static)).unwrap();
        }
        BodyReader {
            rx,
            cur: Bytes::new(),
            failed: None,
        }
    }

    #[test]
    fn a_body_read_takes_what_has_arrived_then_its_error_or_end() {
        // Frames already queued are joined into one read, up to the buffer's size.
        let mut r = reader(vec![Ok(b"ab"), Ok(b"cde"), Ok(b"fghij")]);
        let mut buf = [0u8; 8];
        assert_eq!(r.read(&mut buf).unwrap(), 8);
        assert_eq!(&buf, b"abcdefgh");
        assert_eq!(r.read(&mut buf).unwrap(), 2);
        assert_eq!(&buf[..2], b"ij");
        assert_eq!(r.read(&mut buf).unwrap(), 0, "the sender is gone: the end");

        // An error behind bytes comes after them, and only once they are read.
        let mut r = reader(vec![Ok(b"ab"), Err(io::Error::other("reset")), Ok(b"cd")]);
        assert_eq!(r.read(&mut buf).unwrap(), 2);
        assert_eq!(&buf[..2], b"ab");
        assert_eq!(r.read(&mut buf).unwrap_err().to_string(), "reset");
        assert_eq!(r.read(&mut [][..]).unwrap(), 0);
    }

    #[test]
    fn queries_decode() {
        assert_eq!(percent_decode("/a%20b+c%2B").as_deref(), Some("/a b c+"));
        assert_eq!(percent_decode("%").as_deref(), Some("%"));
        assert_eq!(percent_decode("%4").as_deref(), Some("%4"));
        assert_eq!(percent_decode("%zz").as_deref(), Some("%zz"));
        assert_eq!(percent_decode("%ff"), None);
        let q = Query::parse("path=%2Fx&mode=0755&uid=5&recursive=true&depth=3").unwrap();
        assert_eq!(q.path.as_deref(), Some("/x"));
        assert_eq!(q.mode, Some(0o755));
        assert_eq!(q.uid, Some(5));
        assert!(q.recursive);
        assert_eq!(q.depth, Some(3));
        assert!(Query::parse("mode=9").is_err());
        assert!(Query::parse("mode=17777").is_err());
    }
}
