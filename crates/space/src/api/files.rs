//! `/v1/sandboxes/{id}/files…`: upload, download, list, stat, mkdir, remove, move.
//!
//! The work happens inside the sandbox (the agent resolves every path there, see
//! `space_agent::fs`), and the rules (paths, limits, the sandbox's state) are the
//! service's (`space_service::files`). This layer parses the request strictly, calls
//! the service, and renders the answer with a fixed set of headers; an upload's body
//! is read here and handed on as a stream.

use axum::body::Body;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use bytes::Bytes;
use futures::StreamExt;
use serde::Deserialize;
use space_api::{ErrorCode, MkdirRequest, MoveRequest};
use space_service::files::{BodyError, DownloadFormat, UploadKind, UploadStream, Uploaded};
use space_service::Tenant;

use super::{parse_query, respond, respond_with, ApiJson, AppState, HttpError, Reject};

/// Query of `GET/PUT/DELETE …/files`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileQuery {
    path: String,
    #[serde(default)]
    format: Option<String>,
    #[serde(default)]
    mode: Option<String>,
    #[serde(default)]
    uid: Option<u32>,
    #[serde(default)]
    gid: Option<u32>,
    #[serde(default)]
    recursive: Option<bool>,
    #[serde(default)]
    gzip: Option<bool>,
    /// Uploads: make missing parent directories (default true).
    #[serde(default)]
    parents: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    path: String,
    #[serde(default)]
    depth: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StatQuery {
    path: String,
}

fn bad(code: ErrorCode, message: impl Into<String>) -> Reject {
    Reject::new(StatusCode::BAD_REQUEST, code, message)
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

/// Octal permission bits such as `0644` (the service checks the value).
fn parse_mode(m: &Option<String>) -> Result<Option<u32>, Reject> {
    let Some(m) = m else { return Ok(None) };
    match u32::from_str_radix(m, 8) {
        Ok(v) if (3..=5).contains(&m.len()) && m.bytes().all(|b| (b'0'..=b'7').contains(&b)) => {
            Ok(Some(v))
        }
        _ => Err(bad(
            ErrorCode::InvalidQuery,
            "mode must be octal permission bits such as 0644",
        )),
    }
}

/// What is read and dropped of a client's upload after the service stopped reading it
/// (the agent answered early, or the upload passed the limit), so that the client gets
/// to read the answer instead of a reset connection.
const DRAIN_MAX: u64 = 64 << 20;
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(10);

/// The client's body as the service's upload stream, and the task that reads it: once
/// the service stops reading, the task reads what the client still sends, boundedly, and
/// drops it.
fn client_body(body: Body) -> (UploadStream, tokio::task::JoinHandle<()>) {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, BodyError>>(4);
    let pump = tokio::spawn(async move {
        let mut stream = body.into_data_stream();
        while let Some(chunk) = stream.next().await {
            let item = chunk.map_err(|e| BodyError::from(format!("reading the upload: {e}")));
            let failed = item.is_err();
            if tx.send(item).await.is_err() || failed {
                break;
            }
        }
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
    (
        Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)),
        pump,
    )
}

fn declared_length(req: &Request) -> Option<u64> {
    req.headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// `GET …/files?path=P[&format=tar]`.
pub async fn download(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> Response {
    let run = async {
        let q: FileQuery = parse_query(q.as_deref())?;
        let tar = check_format(&q.format)?;
        if q.mode.is_some()
            || q.uid.is_some()
            || q.gid.is_some()
            || q.recursive.is_some()
            || q.parents.is_some()
        {
            return Err(bad(
                ErrorCode::InvalidQuery,
                "mode, uid, gid, parents and recursive apply to uploads and removals only",
            ));
        }
        if q.gzip.is_some() {
            return Err(bad(
                ErrorCode::InvalidQuery,
                "gzip applies to format=tar uploads; downloads are plain tar",
            ));
        }
        Ok((q.path, tar))
    };
    let (path, tar) = match run.await {
        Ok(v) => v,
        Err(r) => return r.into_response(),
    };
    let format = if tar {
        DownloadFormat::Tar
    } else {
        DownloadFormat::Raw
    };
    let d = match st
        .service
        .for_tenant(&tenant)
        .download_file(&id, &path, format)
        .await
    {
        Ok(d) => d,
        Err(e) => return HttpError(e).into_response(),
    };
    let mut out = Response::builder().status(StatusCode::OK).header(
        header::CONTENT_TYPE,
        if tar {
            "application/x-tar"
        } else {
            "application/octet-stream"
        },
    );
    if let Some(n) = d.size {
        out = out.header(header::CONTENT_LENGTH, n);
    }
    if let Some(m) = d.mode {
        out = out.header("x-space-mode", format!("{m:04o}"));
    }
    if let Some(u) = d.uid {
        out = out.header("x-space-uid", u);
    }
    if let Some(g) = d.gid {
        out = out.header("x-space-gid", g);
    }
    // A download that fails mid-way ends the client's response with an error, never
    // as if it were complete.
    out.body(Body::new(d.body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// `PUT …/files?path=P[&mode=&uid=&gid=]` (raw) or `&format=tar[&gzip=true]`.
pub async fn upload(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
    req: Request,
) -> Response {
    let parsed = (|| {
        let q: FileQuery = parse_query(q.as_deref())?;
        let tar = check_format(&q.format)?;
        let mode = parse_mode(&q.mode)?;
        if q.recursive.is_some() {
            return Err(bad(
                ErrorCode::InvalidQuery,
                "recursive is not an upload parameter",
            ));
        }
        if tar && q.parents.is_some() {
            return Err(bad(
                ErrorCode::InvalidQuery,
                "parents applies to single-file uploads; a tar's directory is always made",
            ));
        }
        let kind = if tar {
            if mode.is_some() || q.uid.is_some() || q.gid.is_some() {
                return Err(bad(
                    ErrorCode::InvalidQuery,
                    "mode, uid and gid apply to single-file uploads; a tar carries its own",
                ));
            }
            UploadKind::Tar {
                gzip: q.gzip.unwrap_or(false),
                max_bytes: None,
            }
        } else {
            if q.gzip.is_some() {
                return Err(bad(
                    ErrorCode::InvalidQuery,
                    "gzip applies to format=tar uploads",
                ));
            }
            UploadKind::File {
                mode,
                uid: q.uid,
                gid: q.gid,
            }
        };
        Ok((q.path, kind, q.parents.unwrap_or(true)))
    })();
    let (path, kind, parents) = match parsed {
        Ok(v) => v,
        Err(r) => return r.into_response(),
    };
    let declared = declared_length(&req);
    let (body, pump) = client_body(req.into_body());
    let result = st
        .service
        .for_tenant(&tenant)
        .upload_file(&id, &path, kind, parents, declared, body)
        .await;
    // The answer goes out once the client's body has been read to its end (bounded).
    let _ = pump.await;
    match result {
        Ok(Uploaded::File(info)) => respond_with(StatusCode::CREATED, Ok(info)),
        Ok(Uploaded::Archive(stats)) => respond_with(StatusCode::CREATED, Ok(stats)),
        Err(e) => HttpError(e).into_response(),
    }
}

/// `DELETE …/files?path=P[&recursive=true]`.
pub async fn remove(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> Response {
    let q: FileQuery = match parse_query(q.as_deref()) {
        Ok(q) => q,
        Err(r) => return r.into_response(),
    };
    if q.format.is_some()
        || q.mode.is_some()
        || q.uid.is_some()
        || q.gid.is_some()
        || q.gzip.is_some()
        || q.parents.is_some()
    {
        return bad(
            ErrorCode::InvalidQuery,
            "a removal takes path and recursive only",
        )
        .into_response();
    }
    respond(
        st.service
            .for_tenant(&tenant)
            .remove_file(&id, &q.path, q.recursive.unwrap_or(false))
            .await,
    )
}

/// `GET …/files/list?path=P&depth=N`.
pub async fn list(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> Response {
    let q: ListQuery = match parse_query(q.as_deref()) {
        Ok(q) => q,
        Err(r) => return r.into_response(),
    };
    respond(
        st.service
            .for_tenant(&tenant)
            .list_files(&id, &q.path, q.depth)
            .await,
    )
}

/// `GET …/files/stat?path=P`.
pub async fn stat(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> Response {
    let q: StatQuery = match parse_query(q.as_deref()) {
        Ok(q) => q,
        Err(r) => return r.into_response(),
    };
    respond(st.service.for_tenant(&tenant).stat_file(&id, &q.path).await)
}

/// `POST …/files/mkdir {path, mode?, uid?, gid?}` (like `mkdir -p`).
pub async fn mkdir(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<MkdirRequest>,
) -> Response {
    respond_with(
        StatusCode::CREATED,
        st.service.for_tenant(&tenant).mkdir(&id, &body).await,
    )
}

/// `POST …/files/move {from, to, overwrite?}`.
pub async fn rename(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<MoveRequest>,
) -> Response {
    respond(st.service.for_tenant(&tenant).move_file(&id, &body).await)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_are_octal() {
        assert_eq!(parse_mode(&Some("0644".into())).ok(), Some(Some(0o644)));
        assert_eq!(parse_mode(&Some("755".into())).ok(), Some(Some(0o755)));
        assert_eq!(parse_mode(&Some("04755".into())).ok(), Some(Some(0o4755)));
        assert!(parse_mode(&Some("0888".into())).is_err());
        assert!(parse_mode(&Some("rwx".into())).is_err());
        assert!(parse_mode(&Some("64".into())).is_err());
        assert!(parse_mode(&Some("+644".into())).is_err());
        assert_eq!(parse_mode(&None).ok(), Some(None));
    }
}
