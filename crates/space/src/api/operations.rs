//! `/v1/operations`.

use std::time::Duration;

use axum::extract::{Path, RawQuery, State};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use space_api::OperationList;

use super::{check_id, parse_query, parse_wait, respond, AppState};

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
    respond(st.service.wait_operation(&id, wait).await)
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
    respond(
        st.service
            .list_operations(q.sandbox_id.as_deref(), limit)
            .map(|operations| OperationList { operations }),
    )
}

pub async fn cancel(State(st): State<AppState>, Path(id): Path<String>) -> Response {
    if let Err(r) = check_id(&id, "op", "operation") {
        return r.into_response();
    }
    respond(st.service.cancel_operation(&id))
}
