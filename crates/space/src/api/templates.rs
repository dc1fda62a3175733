//! `/v1/templates`: list, build from a recipe (an operation), delete.

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use space_api::ErrorCode;
use space_api::TemplateList;
use space_runtime::build::{Recipe, MAX_RECIPE_BYTES};

use super::{error, respond, respond_with, AppState, HttpError};
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

/// `POST /v1/templates`: a recipe (JSON, unknown fields refused, at most `MAX_RECIPE_BYTES`:
/// files are inlined) → 202 + a `build` operation.
pub async fn build(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    req: Request,
) -> Response {
    let too_large = || {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::BodyTooLarge,
            format!("recipe larger than {MAX_RECIPE_BYTES} bytes"),
        )
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_RECIPE_BYTES as u64) {
        return too_large();
    }
    let scope = st.service.for_tenant(&tenant);
    // A recipe may be large (files are inlined): one of the tenant's uploads in flight.
    let _upload = match scope.admit_upload() {
        Ok(p) => p,
        Err(e) => return HttpError(e).into_response(),
    };
    let body: Body = req.into_body();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_RECIPE_BYTES).await else {
        return too_large();
    };
    let recipe: Recipe = match serde_json::from_slice(&bytes) {
        Ok(r) => r,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                ErrorCode::InvalidJson,
                format!("invalid recipe: {e}"),
            )
        }
    };
    respond_with(StatusCode::ACCEPTED, scope.build_template(recipe).await)
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
