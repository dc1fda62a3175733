//! envd's plain HTTP routes: `GET /health`, and `GET`/`POST /files` (download; upload as
//! multipart or as an octet-stream body, gzip-compressed or not). Errors are
//! `{"code": <status>, "message"}`, as envd's.

use axum::body::Body;
use axum::extract::{FromRequest, Multipart, RawQuery, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::TryStreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use space_service::files::{BodyError, DownloadFormat, UploadKind, UploadStream, Uploaded};
use space_service::{ServiceError, Tenant};

use super::connect::RpcError;
use super::{envd_caller, resolve_path, E2bError, E2bState};

/// Files one multipart upload may carry.
const MAX_PARTS: usize = 1000;

#[derive(Deserialize, Default)]
#[serde(default)]
struct FilesQuery {
    path: Option<String>,
    username: Option<String>,
}

/// An envd HTTP error.
fn fail(status: StatusCode, message: impl Into<String>) -> E2bError {
    E2bError::new(status, message)
}

fn from_rpc(e: RpcError) -> E2bError {
    fail(e.status(), e.message)
}

/// `GET /health`: 204 while the sandbox runs; 502 "was not found" once it is gone
/// (what the SDKs' `is_running()` reads), 401 without its token.
pub async fn health(State(st): State<E2bState>, headers: HeaderMap) -> Response {
    match envd_caller(&st, &headers).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(r) => r.into_response(),
    }
}

fn parse_query(raw: Option<&str>) -> Result<FilesQuery, E2bError> {
    serde_urlencoded::from_str(raw.unwrap_or(""))
        .map_err(|e| fail(StatusCode::BAD_REQUEST, format!("bad query: {e}")))
}

/// `GET /files?path=P[&username=U]`: the file's bytes.
pub async fn download(
    State(st): State<E2bState>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> Response {
    let (tenant, sandbox) = match envd_caller(&st, &headers).await {
        Ok(c) => c,
        Err(r) => return r.into_response(),
    };
    let q = match parse_query(q.as_deref()) {
        Ok(q) => q,
        Err(r) => return r.into_response(),
    };
    let Some(path) = q.path else {
        return fail(StatusCode::BAD_REQUEST, "path is required").into_response();
    };
    let path = match resolve_path(&path, q.username.as_deref()) {
        Ok(p) => p,
        Err(e) => return from_rpc(e).into_response(),
    };
    let d = match st
        .service
        .for_tenant(&tenant)
        .download_file(&sandbox, &path, DownloadFormat::Raw)
        .await
    {
        Ok(d) => d,
        Err(e) => return service_error(e).into_response(),
    };
    let mut out = Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/octet-stream");
    if let Some(n) = d.size {
        out = out.header(header::CONTENT_LENGTH, n);
    }
    let name = path.rsplit('/').next().unwrap_or("file").replace('"', "");
    out = out.header(
        header::CONTENT_DISPOSITION,
        format!("attachment; filename=\"{name}\""),
    );
    out.body(Body::new(d.body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// A service error as envd's JSON error, with the status its code has.
fn service_error(e: ServiceError) -> E2bError {
    let status =
        StatusCode::from_u16(e.code().http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    fail(status, RpcError::from(e).message)
}

/// `POST /files[?path=P][&username=U]`: a multipart body (each `file` part named by
/// its filename, or by `path` when there is one part), or an octet-stream body
/// (`path` required; `Content-Encoding: gzip` allowed). Missing parent directories
/// are made. The answer lists what was written.
pub async fn upload(State(st): State<E2bState>, RawQuery(q): RawQuery, req: Request) -> Response {
    let (tenant, sandbox) = match envd_caller(&st, req.headers()).await {
        Ok(c) => c,
        Err(r) => return r.into_response(),
    };
    let q = match parse_query(q.as_deref()) {
        Ok(q) => q,
        Err(r) => return r.into_response(),
    };
    let ct = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let up = Upload {
        st: &st,
        tenant: &tenant,
        sandbox: &sandbox,
        user: q.username.as_deref(),
    };
    let written = if ct.starts_with("multipart/form-data") {
        up.multipart(q.path.as_deref(), req).await
    } else if ct.is_empty() || ct.starts_with("application/octet-stream") {
        up.octets(q.path.as_deref(), req).await
    } else {
        Err(fail(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "uploads are multipart/form-data or application/octet-stream",
        ))
    };
    match written {
        Ok(list) => (StatusCode::OK, axum::Json(Value::Array(list))).into_response(),
        Err(r) => r.into_response(),
    }
}

struct Upload<'a> {
    st: &'a E2bState,
    tenant: &'a Tenant,
    sandbox: &'a str,
    user: Option<&'a str>,
}

impl Upload<'_> {
    async fn write(
        &self,
        path: &str,
        declared: Option<u64>,
        body: UploadStream,
    ) -> Result<Value, E2bError> {
        let path = resolve_path(path, self.user).map_err(from_rpc)?;
        let kind = UploadKind::File {
            mode: None,
            uid: None,
            gid: None,
        };
        match self
            .st
            .service
            .for_tenant(self.tenant)
            .upload_file(self.sandbox, &path, kind, true, declared, body)
            .await
        {
            Ok(Uploaded::File(info)) => Ok(json!({
                "name": info.name, "type": "file", "path": info.path
            })),
            Ok(Uploaded::Archive(_)) => Ok(json!({ "name": "", "type": "file", "path": path })),
            Err(e) => Err(service_error(e)),
        }
    }

    async fn octets(&self, path: Option<&str>, req: Request) -> Result<Vec<Value>, E2bError> {
        let Some(path) = path else {
            return Err(fail(StatusCode::BAD_REQUEST, "path is required"));
        };
        let gzip = match req
            .headers()
            .get(header::CONTENT_ENCODING)
            .and_then(|v| v.to_str().ok())
        {
            None | Some("identity") => false,
            Some("gzip") => true,
            Some(_) => {
                return Err(fail(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "Content-Encoding must be gzip or identity",
                ))
            }
        };
        let declared = (!gzip)
            .then(|| {
                req.headers()
                    .get(header::CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<u64>().ok())
            })
            .flatten();
        let raw = req
            .into_body()
            .into_data_stream()
            .map_err(|e| std::io::Error::other(e.to_string()));
        let body: UploadStream = if gzip {
            let reader = tokio_util::io::StreamReader::new(raw);
            let decoder = async_compression::tokio::bufread::GzipDecoder::new(reader);
            Box::pin(
                tokio_util::io::ReaderStream::new(decoder)
                    .map_err(|e| BodyError::from(format!("reading the gzip upload: {e}"))),
            )
        } else {
            Box::pin(raw.map_err(|e| BodyError::from(format!("reading the upload: {e}"))))
        };
        Ok(vec![self.write(path, declared, body).await?])
    }

    async fn multipart(&self, path: Option<&str>, req: Request) -> Result<Vec<Value>, E2bError> {
        let mut form = Multipart::from_request(req, &())
            .await
            .map_err(|e| fail(StatusCode::BAD_REQUEST, e.body_text()))?;
        let mut out = Vec::new();
        loop {
            let field = match form.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => return Err(fail(StatusCode::BAD_REQUEST, e.body_text())),
            };
            if out.len() >= MAX_PARTS {
                return Err(fail(
                    StatusCode::BAD_REQUEST,
                    format!("at most {MAX_PARTS} files per upload"),
                ));
            }
            let name = field.file_name().map(str::to_string);
            let target = match (path, name) {
                (Some(p), _) if out.is_empty() => p.to_string(),
                (_, Some(n)) if !n.is_empty() => n,
                _ => {
                    return Err(fail(
                        StatusCode::BAD_REQUEST,
                        "each part names its file (its filename), or the query names one path",
                    ))
                }
            };
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, BodyError>>(4);
            let body: UploadStream = Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx));
            // The part is read here and handed on; the service writes it meanwhile.
            let feed = async move {
                let mut field = field;
                loop {
                    match field.chunk().await {
                        Ok(Some(b)) => {
                            if tx.send(Ok(b)).await.is_err() {
                                return;
                            }
                        }
                        Ok(None) => return,
                        Err(e) => {
                            let _ = tx
                                .send(Err(BodyError::from(format!("reading the upload: {e}"))))
                                .await;
                            return;
                        }
                    }
                }
            };
            let (written, ()) = tokio::join!(self.write(&target, None, body), feed);
            out.push(written?);
        }
        if out.is_empty() {
            return Err(fail(StatusCode::BAD_REQUEST, "the form holds no file"));
        }
        Ok(out)
    }
}
