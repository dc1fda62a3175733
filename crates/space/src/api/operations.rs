//! `/v1/operations`.

use std::time::Duration;

use axum::extract::{Path, RawQuery, State};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde::Deserialize;
use space_api::OperationList;

use super::{parse_query, parse_wait, respond, AppState};
use space_service::Tenant;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GetQuery {
    wait: Option<String>,
}

pub async fn get(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> Response {
    let q: GetQuery = match parse_query(q.as_deref()) {
        Ok(q) => q,
        Err(r) => return r.into_response(),
    };
    let wait = match q.wait.as_deref().map(parse_wait).transpose() {
        Ok(w) => w.unwrap_or(Duration::ZERO),
        Err(r) => return r.into_response(),
    };
    respond(
        st.service
            .for_tenant(&tenant)
            .get_operation(&id, wait)
            .await,
    )
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
    respond(
        st.service
            .for_tenant(&tenant)
            .list_operations(q.sandbox_id.as_deref(), q.limit)
            .map(|operations| OperationList { operations }),
    )
}

pub async fn cancel(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Response {
    respond(st.service.for_tenant(&tenant).cancel_operation(&id))
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
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> Response {
    use axum::http::header;
    let q: LogQuery = match parse_query(q.as_deref()) {
        Ok(q) => q,
        Err(r) => return r.into_response(),
    };
    match st
        .service
        .for_tenant(&tenant)
        .build_log(&id, q.follow == Some(true))
    {
        Ok(stream) => (
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            axum::body::Body::from_stream(stream),
        )
            .into_response(),
        Err(e) => super::HttpError(e).into_response(),
    }
}
