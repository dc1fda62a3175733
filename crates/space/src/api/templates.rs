//! `/v1/templates`: list, build from a recipe (an operation), delete.

use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use futures::StreamExt;
use space_api::TemplateList;

use super::{respond, respond_with, AppState, HttpError};
use space_service::Tenant;

/// Built-in templates and the caller's own.
pub async fn list(State(st): State<AppState>, Extension(tenant): Extension<Tenant>) -> Response {
    respond(
        st.service
            .for_tenant(&tenant)
            .list_templates()
            .map(|templates| TemplateList { templates }),
    )
}

/// `POST /v1/templates`: a recipe (JSON, unknown fields refused, at most
/// `MAX_RECIPE_BYTES`: files are inlined) → 202 + a `build` operation. The service reads
/// and checks the body.
pub async fn build(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    req: Request,
) -> Response {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let body = req
        .into_body()
        .into_data_stream()
        .map(|r| r.map_err(|e| Box::new(e) as space_service::files::BodyError));
    respond_with(
        StatusCode::ACCEPTED,
        st.service
            .for_tenant(&tenant)
            .build_template_json(declared, Box::pin(body))
            .await,
    )
}

/// `DELETE /v1/templates/{name}`: 204, 404 unknown (or another tenant's), 409 built in or in use.
pub async fn delete(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(name): Path<String>,
) -> Response {
    match st.service.for_tenant(&tenant).delete_template(&name).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => HttpError(e).into_response(),
    }
}
