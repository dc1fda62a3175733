//! `/v1/pools`: warm pools, the operator's (the server's own token) only.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use space_api::{PoolList, PoolSpec};
use space_service::Principal;

use super::{respond, respond_with, ApiJson, AppState, HttpError};

/// `GET /v1/pools`: every pool with its ready and booting sandboxes.
pub async fn list(State(st): State<AppState>, Extension(who): Extension<Principal>) -> Response {
    respond(st.service.pools_as(&who).map(|pools| PoolList { pools }))
}

/// `PUT /v1/pools`: creates a pool or sets its size (200 with the pool).
pub async fn put(
    State(st): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiJson(spec): ApiJson<PoolSpec>,
) -> Response {
    respond_with(StatusCode::OK, st.service.set_pool_as(&who, spec))
}

/// `DELETE /v1/pools/{id}`: 204; its sandboxes are destroyed in the background.
pub async fn delete(
    State(st): State<AppState>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> Response {
    match st.service.remove_pool_as(&who, &id) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => HttpError(e).into_response(),
    }
}
