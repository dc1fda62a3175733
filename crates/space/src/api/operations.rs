//! `/v1/operations`.

use std::time::Duration;

use axum::extract::{Path, RawQuery, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use space_api::OperationList;

use super::{check_id, parse_query, parse_wait, AppState, HttpError};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GetQuery {
    wait: Option<String>,
}

pub async fn get(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> Response {
    if let Err(r) = check_id(&id, "op", "operation") {
        return r.into_response();
    }
    let q: GetQuery = match parse_query(q.as_deref()) {
        Ok(q) => q,
        Err(r) => return r.into_response(),
    };
    let wait = match q.wait.as_deref().map(parse_wait).transpose() {
        Ok(w) => w.unwrap_or(Duration::ZERO),
        Err(r) => return r.into_response(),
    };
    match st.service.wait_operation(&id, wait).await {
        Ok(op) => Json(op).into_response(),
        Err(e) => HttpError(e).into_response(),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    sandbox_id: Option<String>,
    limit: Option<usize>,
}

pub async fn list(State(st): State<AppState>, RawQuery(q): RawQuery) -> Response {
    let q: ListQuery = match parse_query(q.as_deref()) {
        Ok(q) => q,
        Err(r) => return r.into_response(),
    };
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    match st.service.list_operations(q.sandbox_id.as_deref(), limit) {
        Ok(operations) => Json(OperationList { operations }).into_response(),
        Err(e) => HttpError(e).into_response(),
    }
}

pub async fn cancel(State(st): State<AppState>, Path(id): Path<String>) -> Response {
    if let Err(r) = check_id(&id, "op", "operation") {
        return r.into_response();
    }
    match st.service.cancel_operation(&id) {
        Ok(op) => Json(op).into_response(),
        Err(e) => HttpError(e).into_response(),
    }
}
