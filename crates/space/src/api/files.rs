//! `/v1/sandboxes/{id}/files…`: upload, download, list, stat, mkdir, remove, move.
//!
//! The work happens inside the sandbox (the agent resolves every path there, see
//! `space_agent::fs`). This layer checks the request strictly, rebuilds the agent
//! request from the checked parts only, bounds uploads, and relays the answer
//! with a fixed set of headers.

use axum::body::Body;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{header, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use serde::{Deserialize, Serialize};
use space_api::ErrorCode;

use super::{error, parse_query, ApiJson, AppState, HttpError, Reject};
use axum::Extension;
use space_service::agent::{BodyError, HostBody};
use space_service::Tenant;

/// Longest path accepted (Linux's PATH_MAX).
const MAX_PATH: usize = 4096;
/// Longest path component (NAME_MAX).
const MAX_NAME: usize = 255;
/// Deepest listing.
const MAX_DEPTH: u32 = 64;

/// Query of `GET/PUT/DELETE …/files`.
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct FileQuery {
    path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    format: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    uid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    recursive: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gzip: Option<bool>,
    /// Set by the server (never taken from the client): the extraction limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_bytes: Option<u64>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    depth: Option<u32>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct StatQuery {
    path: String,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MkdirRequest {
    path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    mode: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    uid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gid: Option<u32>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MoveRequest {
    from: String,
    to: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    overwrite: Option<bool>,
}

fn bad(code: ErrorCode, message: impl Into<String>) -> Reject {
    Reject::new(StatusCode::BAD_REQUEST, code, message)
}

/// A path the sandbox could resolve: absolute, bounded, no NUL, no `..`.
fn check_path(what: &str, p: &str) -> Result<(), Reject> {
    if !p.starts_with('/') {
        return Err(bad(
            ErrorCode::InvalidPath,
            format!("{what} must be an absolute path inside the sandbox"),
        ));
    }
    if p.len() > MAX_PATH {
        return Err(bad(
            ErrorCode::InvalidPath,
            format!("{what} is longer than {MAX_PATH} bytes"),
        ));
    }
    if p.contains('\0') {
        return Err(bad(
            ErrorCode::InvalidPath,
            format!("{what} contains a NUL byte"),
        ));
    }
    for c in p.split('/') {
        if c == ".." {
            return Err(bad(
                ErrorCode::InvalidPath,
                format!("{what} must not contain '..' components"),
            ));
        }
        if c.len() > MAX_NAME {
            return Err(bad(
                ErrorCode::InvalidPath,
                format!("{what} has a component longer than {MAX_NAME} bytes"),
            ));
        }
    }
    Ok(())
}

fn check_format(f: &Option<String>) -> Result<bool, Reject> {
    match f.as_deref() {
        None | Some("raw") => Ok(false),
        Some("tar") => Ok(true),
        Some(other) => Err(bad(
            ErrorCode::InvalidQuery,
            format!(
                "unknown format {:?}: use raw or tar",
                space_service::truncate(other, 32)
            ),
        )),
    }
}

fn check_mode(m: &Option<String>) -> Result<(), Reject> {
    if let Some(m) = m {
        let ok = (3..=5).contains(&m.len())
            && m.bytes().all(|b| (b'0'..=b'7').contains(&b))
            && u32::from_str_radix(m, 8).is_ok_and(|v| v <= 0o7777);
        if !ok {
            return Err(bad(
                ErrorCode::InvalidQuery,
                "mode must be octal permission bits such as 0644",
            ));
        }
    }
    Ok(())
}

fn agent_uri<T: Serialize>(suffix: &str, query: &T) -> Result<String, Reject> {
    let q = serde_urlencoded::to_string(query)
        .map_err(|e| bad(ErrorCode::InvalidQuery, format!("invalid query: {e}")))?;
    Ok(format!("/v1/files{suffix}?{q}"))
}

fn empty() -> HostBody {
    Full::new(Bytes::new())
        .map_err(|never| match never {})
        .boxed_unsync()
}

fn json_body<T: Serialize>(v: &T) -> HostBody {
    Full::new(Bytes::from(serde_json::to_vec(v).unwrap_or_default()))
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// What the client gets back: the agent's status (2xx, 4xx, 507; anything else
/// is a bad gateway), its body streamed, and only headers we set ourselves.
/// The largest error body read from an agent.
const MAX_AGENT_ERROR: usize = 64 << 10;

/// The agent's error answer as ours: its code only if it is one of ours (an agent in a
/// sandbox is not trusted to say anything else), its message bounded.
async fn agent_error(resp: http::Response<hyper::body::Incoming>) -> Response {
    let status = resp.status();
    let body = http_body_util::Limited::new(resp.into_body(), MAX_AGENT_ERROR)
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let parsed: Option<space_agent::protocol::ErrorBody> = serde_json::from_slice(&body).ok();
    match parsed.and_then(|e| ErrorCode::parse(&e.error.code).map(|c| (c, e.error.message))) {
        Some((code, message)) => error(
            status,
            code,
            space_service::truncate(&message, 4096).to_string(),
        ),
        None => error(
            StatusCode::BAD_GATEWAY,
            ErrorCode::AgentError,
            format!("the sandbox's agent answered {status} without a usable error"),
        ),
    }
}

async fn relay(
    resp: http::Response<hyper::body::Incoming>,
    content_type: &'static str,
) -> Response {
    let status = resp.status();
    if status.is_client_error() || status == StatusCode::INSUFFICIENT_STORAGE {
        return agent_error(resp).await;
    }
    if !status.is_success() {
        return error(
            StatusCode::BAD_GATEWAY,
            ErrorCode::AgentError,
            format!("the sandbox's agent answered {status}"),
        );
    }
    let mut out = Response::builder().status(status);
    let json = content_type == "application/json";
    out = out.header(
        header::CONTENT_TYPE,
        if json {
            "application/json"
        } else {
            content_type
        },
    );
    for name in [
        "content-length",
        "x-space-mode",
        "x-space-uid",
        "x-space-gid",
    ] {
        if let Some(v) = resp.headers().get(name) {
            if v.len() <= 24 && v.as_bytes().iter().all(u8::is_ascii_digit) {
                out = out.header(name, v.clone());
            }
        }
    }
    // An agent that fails mid-transfer says so in an `x-space-error` trailer: the
    // client's response is cut off with an error then, never ended as if complete.
    let frames = http_body_util::BodyStream::new(resp.into_body()).map(|r| match r {
        Ok(frame) => match frame.trailers_ref().and_then(|t| t.get("x-space-error")) {
            Some(e) => Err(BodyError::from(format!(
                "the sandbox's agent failed mid-transfer: {}",
                String::from_utf8_lossy(&e.as_bytes()[..e.len().min(512)])
            ))),
            None => Ok(frame),
        },
        Err(e) => Err(BodyError::from(e)),
    });
    out.body(Body::new(StreamBody::new(frames)))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// An upload on its way from the client to the agent.
struct Upload {
    /// What the agent reads.
    body: HostBody,
    /// Set once the client sent more than the limit.
    exceeded: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Reads the client's body into `body`; once the agent stops reading (it answered
    /// early, say with 413), reads what the client still sends, boundedly, and drops it.
    pump: tokio::task::JoinHandle<()>,
}

/// What is read and dropped of a client's upload after the agent answered early, so that
/// the client gets to read the answer instead of a reset connection.
const DRAIN_MAX: u64 = 64 << 20;
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(10);

/// Streams the client's upload to the agent, cutting it off (and answering 413)
/// once it passes `max` bytes.
fn bounded_upload(body: Body, max: u64) -> Upload {
    use std::sync::atomic::{AtomicBool, Ordering};
    let exceeded = std::sync::Arc::new(AtomicBool::new(false));
    let flag = exceeded.clone();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BodyError>>(4);
    let pump = tokio::spawn(async move {
        let mut stream = body.into_data_stream();
        let mut seen: u64 = 0;
        while let Some(chunk) = stream.next().await {
            let item = match chunk {
                Ok(b) => {
                    seen += b.len() as u64;
                    if seen > max {
                        flag.store(true, Ordering::SeqCst);
                        Err(BodyError::from(format!("upload larger than {max} bytes")))
                    } else {
                        Ok(Frame::data(b))
                    }
                }
                Err(e) => Err(BodyError::from(format!("reading the upload: {e}"))),
            };
            let failed = item.is_err();
            if tx.send(item).await.is_err() || failed {
                break;
            }
        }
        // The agent has answered (or the upload failed): drop what the client still sends.
        let mut drained: u64 = 0;
        let _ = tokio::time::timeout(DRAIN_TIME, async {
            while let Some(Ok(b)) = stream.next().await {
                drained += b.len() as u64;
                if drained > DRAIN_MAX {
                    break;
                }
            }
        })
        .await;
    });
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
    Upload {
        body: BodyExt::boxed_unsync(StreamBody::new(stream)),
        exceeded,
        pump,
    }
}

fn too_large(max: u64) -> Response {
    error(
        StatusCode::PAYLOAD_TOO_LARGE,
        ErrorCode::TooLarge,
        format!("upload larger than {max} bytes (the server's --max-upload-mib)"),
    )
}

async fn forward(
    st: &AppState,
    tenant: &Tenant,
    id: &str,
    method: Method,
    uri: &str,
    content_type: Option<&str>,
    body: HostBody,
) -> Result<http::Response<hyper::body::Incoming>, Response> {
    st.service
        .for_tenant(tenant)
        .files_request(id, method, uri, content_type, body)
        .await
        .map_err(|e| HttpError(e).into_response())
}

/// `GET …/files?path=P[&format=tar]`.
pub async fn download(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> Response {
    let run = async {
        let q: FileQuery = parse_query(q.as_deref()).map_err(IntoResponse::into_response)?;
        check_path("path", &q.path).map_err(IntoResponse::into_response)?;
        let tar = check_format(&q.format).map_err(IntoResponse::into_response)?;
        if q.mode.is_some() || q.uid.is_some() || q.gid.is_some() || q.recursive.is_some() {
            return Err(bad(
                ErrorCode::InvalidQuery,
                "mode, uid, gid and recursive apply to uploads and removals only",
            )
            .into_response());
        }
        let query = FileQuery {
            path: q.path,
            format: tar.then(|| "tar".into()),
            gzip: q.gzip,
            ..Default::default()
        };
        let uri = agent_uri("", &query).map_err(IntoResponse::into_response)?;
        let resp = forward(&st, &tenant, &id, Method::GET, &uri, None, empty()).await?;
        Ok(relay(
            resp,
            if tar {
                "application/x-tar"
            } else {
                "application/octet-stream"
            },
        )
        .await)
    };
    run.await.unwrap_or_else(|r: Response| r)
}

/// `PUT …/files?path=P[&mode=&uid=&gid=]` (raw) or `&format=tar[&gzip=true]`.
pub async fn upload(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
    req: Request,
) -> Response {
    let max = st.service.max_upload_bytes();
    let run = async {
        let q: FileQuery = parse_query(q.as_deref()).map_err(IntoResponse::into_response)?;
        check_path("path", &q.path).map_err(IntoResponse::into_response)?;
        let tar = check_format(&q.format).map_err(IntoResponse::into_response)?;
        check_mode(&q.mode).map_err(IntoResponse::into_response)?;
        if q.recursive.is_some() || q.max_bytes.is_some() {
            return Err(bad(
                ErrorCode::InvalidQuery,
                "recursive and max_bytes are not upload parameters",
            )
            .into_response());
        }
        if q.gzip.is_some() && !tar {
            return Err(bad(
                ErrorCode::InvalidQuery,
                "gzip applies to format=tar uploads",
            )
            .into_response());
        }
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > max) {
            return Err(too_large(max));
        }
        let query = FileQuery {
            path: q.path,
            format: tar.then(|| "tar".into()),
            mode: q.mode,
            uid: q.uid,
            gid: q.gid,
            gzip: q.gzip,
            max_bytes: tar.then_some(max),
            recursive: None,
        };
        let uri = agent_uri("", &query).map_err(IntoResponse::into_response)?;
        // One of the tenant's uploads in flight, held until the agent has answered.
        let _upload = st
            .service
            .for_tenant(&tenant)
            .admit_upload()
            .map_err(|e| HttpError(e).into_response())?;
        let Upload {
            body,
            exceeded,
            pump,
        } = bounded_upload(req.into_body(), max);
        let result = forward(
            &st,
            &tenant,
            &id,
            Method::PUT,
            &uri,
            Some("application/octet-stream"),
            body,
        )
        .await;
        // The answer goes out once the client's body has been read to its end (bounded).
        let _ = pump.await;
        if exceeded.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(too_large(max));
        }
        let resp = result?;
        if exceeded.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(too_large(max));
        }
        Ok(relay(resp, "application/json").await)
    };
    run.await.unwrap_or_else(|r: Response| r)
}

/// `DELETE …/files?path=P[&recursive=true]`.
pub async fn remove(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> Response {
    let run = async {
        let q: FileQuery = parse_query(q.as_deref()).map_err(IntoResponse::into_response)?;
        check_path("path", &q.path).map_err(IntoResponse::into_response)?;
        if q.path.split('/').all(|c| c.is_empty() || c == ".") {
            return Err(bad(
                ErrorCode::InvalidPath,
                "refusing to remove the root directory",
            )
            .into_response());
        }
        if q.format.is_some() || q.mode.is_some() || q.uid.is_some() || q.gid.is_some() {
            return Err(bad(
                ErrorCode::InvalidQuery,
                "a removal takes path and recursive only",
            )
            .into_response());
        }
        let query = FileQuery {
            path: q.path,
            recursive: q.recursive,
            ..Default::default()
        };
        let uri = agent_uri("", &query).map_err(IntoResponse::into_response)?;
        let resp = forward(&st, &tenant, &id, Method::DELETE, &uri, None, empty()).await?;
        Ok(relay(resp, "application/json").await)
    };
    run.await.unwrap_or_else(|r: Response| r)
}

/// `GET …/files/list?path=P&depth=N`.
pub async fn list(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> Response {
    let run = async {
        let q: ListQuery = parse_query(q.as_deref()).map_err(IntoResponse::into_response)?;
        check_path("path", &q.path).map_err(IntoResponse::into_response)?;
        if q.depth.is_some_and(|d| d == 0 || d > MAX_DEPTH) {
            return Err(bad(
                ErrorCode::InvalidQuery,
                format!("depth must be between 1 and {MAX_DEPTH}"),
            )
            .into_response());
        }
        let uri = agent_uri("/list", &q).map_err(IntoResponse::into_response)?;
        let resp = forward(&st, &tenant, &id, Method::GET, &uri, None, empty()).await?;
        Ok(relay(resp, "application/json").await)
    };
    run.await.unwrap_or_else(|r: Response| r)
}

/// `GET …/files/stat?path=P`.
pub async fn stat(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> Response {
    let run = async {
        let q: StatQuery = parse_query(q.as_deref()).map_err(IntoResponse::into_response)?;
        check_path("path", &q.path).map_err(IntoResponse::into_response)?;
        let uri = agent_uri("/stat", &q).map_err(IntoResponse::into_response)?;
        let resp = forward(&st, &tenant, &id, Method::GET, &uri, None, empty()).await?;
        Ok(relay(resp, "application/json").await)
    };
    run.await.unwrap_or_else(|r: Response| r)
}

/// `POST …/files/mkdir {path, mode?, uid?, gid?}` (like `mkdir -p`).
pub async fn mkdir(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<MkdirRequest>,
) -> Response {
    let run = async {
        check_path("path", &body.path).map_err(IntoResponse::into_response)?;
        if body.mode.is_some_and(|m| m > 0o7777) {
            return Err(bad(
                ErrorCode::InvalidRequest,
                "mode must be at most 0o7777 (4095)",
            )
            .into_response());
        }
        let resp = forward(
            &st,
            &tenant,
            &id,
            Method::POST,
            "/v1/files/mkdir",
            Some("application/json"),
            json_body(&body),
        )
        .await?;
        Ok(relay(resp, "application/json").await)
    };
    run.await.unwrap_or_else(|r: Response| r)
}

/// `POST …/files/move {from, to, overwrite?}`.
pub async fn rename(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<MoveRequest>,
) -> Response {
    let run = async {
        check_path("from", &body.from).map_err(IntoResponse::into_response)?;
        check_path("to", &body.to).map_err(IntoResponse::into_response)?;
        let resp = forward(
            &st,
            &tenant,
            &id,
            Method::POST,
            "/v1/files/move",
            Some("application/json"),
            json_body(&body),
        )
        .await?;
        Ok(relay(resp, "application/json").await)
    };
    run.await.unwrap_or_else(|r: Response| r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_checked() {
        assert!(check_path("path", "/a/b").is_ok());
        assert!(check_path("path", "/").is_ok());
        assert!(check_path("path", "a/b").is_err());
        assert!(check_path("path", "").is_err());
        assert!(check_path("path", "/a/../b").is_err());
        assert!(check_path("path", "/..").is_err());
        assert!(check_path("path", "/a\0b").is_err());
        assert!(check_path("path", &format!("/{}", "x".repeat(256))).is_err());
        assert!(check_path("path", &"/x".repeat(2049)).is_err());
        assert!(check_path("path", "/a/..b/c").is_ok());
    }

    #[test]
    fn modes_are_octal() {
        assert!(check_mode(&Some("0644".into())).is_ok());
        assert!(check_mode(&Some("755".into())).is_ok());
        assert!(check_mode(&Some("04755".into())).is_ok());
        assert!(check_mode(&Some("0888".into())).is_err());
        assert!(check_mode(&Some("rwx".into())).is_err());
        assert!(check_mode(&Some("17777".into())).is_err());
        assert!(check_mode(&None).is_ok());
    }

    #[test]
    fn agent_requests_are_rebuilt_and_encoded() {
        let q = FileQuery {
            path: "/a b&c=d".into(),
            format: Some("tar".into()),
            max_bytes: Some(5),
            ..Default::default()
        };
        assert_eq!(
            agent_uri("", &q).ok().as_deref(),
            Some("/v1/files?path=%2Fa+b%26c%3Dd&format=tar&max_bytes=5")
        );
    }
}
