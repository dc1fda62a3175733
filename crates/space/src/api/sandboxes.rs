//! `/v1/sandboxes`.

use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde::Deserialize;
use space_api::ErrorCode;
use space_api::{CreateSandboxRequest, SandboxList};

use super::{error, parse_query, respond, respond_with, ApiJson, AppState};
use space_service::Tenant;

pub async fn create(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    ApiJson(req): ApiJson<CreateSandboxRequest>,
) -> Response {
    let r = st.service.for_tenant(&tenant).create_sandbox(req).await;
    respond_with(StatusCode::ACCEPTED, r)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    /// `k=v`; several may be given as a comma-separated list.
    label: Option<String>,
}

pub async fn list(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    RawQuery(q): RawQuery,
) -> Response {
    let q: ListQuery = match parse_query(q.as_deref()) {
        Ok(q) => q,
        Err(r) => return r.into_response(),
    };
    let mut labels = Vec::new();
    for pair in q
        .label
        .iter()
        .flat_map(|l| l.split(','))
        .filter(|p| !p.is_empty())
    {
        match pair.split_once('=') {
            Some((k, v)) => labels.push((k.to_string(), v.to_string())),
            None => {
                return error(
                    StatusCode::BAD_REQUEST,
                    ErrorCode::InvalidQuery,
                    "label filters look like label=key=value",
                )
            }
        }
    }
    respond(
        st.service
            .for_tenant(&tenant)
            .list_sandboxes(labels)
            .await
            .map(|sandboxes| SandboxList { sandboxes }),
    )
}

pub async fn get(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Response {
    respond(st.service.for_tenant(&tenant).get_sandbox(&id).await)
}

pub async fn destroy(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Response {
    accepted(st.service.for_tenant(&tenant).destroy_sandbox(&id))
}

pub async fn pause(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Response {
    accepted(st.service.for_tenant(&tenant).pause(&id))
}

/// `POST /v1/sandboxes/{id}/snapshot-template {name}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotTemplateRequest {
    name: String,
}

pub async fn snapshot_template(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<SnapshotTemplateRequest>,
) -> Response {
    accepted(
        st.service
            .for_tenant(&tenant)
            .snapshot_template(&id, &req.name)
            .await,
    )
}

pub async fn resume(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Response {
    accepted(st.service.for_tenant(&tenant).resume(&id))
}

pub async fn suspend(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Response {
    accepted(st.service.for_tenant(&tenant).suspend(&id))
}

fn accepted(r: space_service::Result<space_api::Operation>) -> Response {
    respond_with(StatusCode::ACCEPTED, r)
}

pub async fn keepalive(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    body: axum::body::Body,
) -> Response {
    // Our limit and error format, not axum's plain-text 413 (a `Bytes` extractor's).
    let Ok(body) = axum::body::to_bytes(body, super::MAX_JSON_BODY).await else {
        return error(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::BodyTooLarge,
            format!("request body larger than {} bytes", super::MAX_JSON_BODY),
        );
    };
    // The body is optional: an empty one means "just count this as activity".
    let req: space_api::KeepaliveRequest = if body.iter().all(u8::is_ascii_whitespace) {
        Default::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(r) => r,
            Err(e) => {
                return error(
                    StatusCode::BAD_REQUEST,
                    ErrorCode::InvalidJson,
                    format!("invalid request body: {e}"),
                )
            }
        }
    };
    respond(st.service.for_tenant(&tenant).keepalive(&id, req))
}
