//! `/v1/templates`: list, build from a recipe (an operation), delete.

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use space_api::TemplateList;
use space_runtime::build::{Recipe, MAX_RECIPE_BYTES};

use super::{error, respond, respond_with, AppState, HttpError};

pub async fn list(State(st): State<AppState>) -> Response {
    respond(
        st.service
            .list_templates()
            .map(|templates| TemplateList { templates }),
    )
}

/// `POST /v1/templates`: a recipe (JSON, unknown fields refused, at most `MAX_RECIPE_BYTES`:
/// files are inlined) → 202 + a `build` operation.
pub async fn build(State(st): State<AppState>, req: Request) -> Response {
    let too_large = || {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
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
    let body: Body = req.into_body();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_RECIPE_BYTES).await else {
        return too_large();
    };
    let recipe: Recipe = match serde_json::from_slice(&bytes) {
        Ok(r) => r,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_json",
                format!("invalid recipe: {e}"),
            )
        }
    };
    respond_with(StatusCode::ACCEPTED, st.service.build_template(recipe))
}

/// `DELETE /v1/templates/{name}`: 204, 404 unknown, 409 built in or in use.
pub async fn delete(State(st): State<AppState>, Path(name): Path<String>) -> Response {
    match st.service.delete_template(&name).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => HttpError(e).into_response(),
    }
}
