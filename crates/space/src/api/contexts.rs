//! `/v1/sandboxes/{id}/contexts`: stateful code contexts (the code interpreter).

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use bytes::Bytes;
use space_api::{ContextList, CreateContextRequest, ExecuteRequest};
use space_service::Tenant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

use super::{respond, respond_with, ApiJson, AppState, HttpError};

pub async fn create(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<CreateContextRequest>,
) -> Response {
    let r = st
        .service
        .for_tenant(&tenant)
        .create_context(&id, req)
        .await;
    respond_with(StatusCode::CREATED, r)
}

pub async fn list(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Response {
    let r = st.service.for_tenant(&tenant).list_contexts(&id).await;
    respond(r.map(|contexts| ContextList { contexts }))
}

pub async fn delete(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path((id, ctx)): Path<(String, String)>,
) -> Response {
    respond(
        st.service
            .for_tenant(&tenant)
            .delete_context(&id, &ctx)
            .await,
    )
}

pub async fn restart(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path((id, ctx)): Path<(String, String)>,
) -> Response {
    respond(
        st.service
            .for_tenant(&tenant)
            .restart_context(&id, &ctx)
            .await,
    )
}

/// NDJSON, one event a line, as the execution produces them.
pub async fn execute(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path((id, ctx)): Path<(String, String)>,
    ApiJson(req): ApiJson<ExecuteRequest>,
) -> Response {
    let run = match st.service.for_tenant(&tenant).execute(&id, &ctx, req).await {
        Ok(run) => run,
        Err(e) => return HttpError(e).into_response(),
    };
    let lines = ReceiverStream::new(run.events).map(|ev| {
        let mut line = serde_json::to_vec(&ev).unwrap_or_default();
        line.push(b'\n');
        Ok::<_, std::convert::Infallible>(Bytes::from(line))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .header("x-space-command-id", run.command_id)
        .body(Body::from_stream(lines))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}
