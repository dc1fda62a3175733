//! `/v1/operations`.

use std::time::Duration;

use axum::extract::{Path, RawQuery, State};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde::Deserialize;
use space_api::OperationList;

use super::tenancy::{operation_tenant, Tenant};
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

pub async fn list(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    RawQuery(q): RawQuery,
) -> Response {
    let q: ListQuery = match parse_query(q.as_deref()) {
        Ok(q) => q,
        Err(r) => return r.into_response(),
    };
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    // The caller's operations only; read past other tenants' to fill `limit`.
    let store = st.service.store();
    let r = st
        .service
        .list_operations(q.sandbox_id.as_deref(), 10_000)
        .and_then(|all| {
            let mut operations = Vec::new();
            for op in all {
                if operations.len() == limit {
                    break;
                }
                if operation_tenant(store, &op)? == tenant.as_str() {
                    operations.push(op);
                }
            }
            Ok(OperationList { operations })
        });
    respond(r)
}

pub async fn cancel(State(st): State<AppState>, Path(id): Path<String>) -> Response {
    if let Err(r) = check_id(&id, "op", "operation") {
        return r.into_response();
    }
    respond(st.service.cancel_operation(&id))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LogQuery {
    follow: Option<bool>,
}

/// `GET /v1/operations/{id}/log[?follow=true]`: a build's log as text; with `follow` the
/// response streams until the build has ended.
pub async fn log(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> Response {
    use axum::http::header;
    if let Err(r) = check_id(&id, "op", "operation") {
        return r.into_response();
    }
    let q: LogQuery = match parse_query(q.as_deref()) {
        Ok(q) => q,
        Err(r) => return r.into_response(),
    };
    match st.service.build_log_stream(&id, q.follow == Some(true)) {
        Ok(stream) => (
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            axum::body::Body::from_stream(stream),
        )
            .into_response(),
        Err(e) => super::HttpError(e).into_response(),
    }
}
