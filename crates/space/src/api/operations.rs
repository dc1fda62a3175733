//! `/v1/operations`.

use std::time::Duration;

use axum::extract::{Path, RawQuery, State};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde::Deserialize;
use space_api::OperationList;

use super::{parse_query, parse_wait, respond, AppState};
use crate::service::Tenant;

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
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    respond(
        st.service
            .for_tenant(&tenant)
            .list_operations(q.sandbox_id.as_deref(), limit)
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
    use axum::http::{header, StatusCode};
    let q: LogQuery = match parse_query(q.as_deref()) {
        Ok(q) => q,
        Err(r) => return r.into_response(),
    };
    let scope = st.service.for_tenant(&tenant);
    let path = match scope.build_log(&id) {
        Ok(p) => p,
        Err(e) => return super::HttpError(e).into_response(),
    };
    let text = [(header::CONTENT_TYPE, "text/plain; charset=utf-8")];
    if q.follow != Some(true) {
        return match tokio::fs::read(&path).await {
            Ok(bytes) => (text, bytes).into_response(),
            Err(e) => super::error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                format!("reading the log: {e}"),
            ),
        };
    }
    let hold = match scope.admit_stream() {
        Ok(p) => p,
        Err(e) => return super::HttpError(e).into_response(),
    };
    let svc = st.service.clone();
    // (file, offset, finished): read what is there; once the operation has ended, read the
    // rest and stop.
    let stream = futures::stream::unfold((None::<tokio::fs::File>, false), move |(file, done)| {
        let svc = svc.clone();
        let path = path.clone();
        let id = id.clone();
        let tenant = tenant.clone();
        let _hold = &hold;
        async move {
            use tokio::io::AsyncReadExt;
            if done {
                return None;
            }
            let mut file = match file {
                Some(f) => f,
                None => tokio::fs::File::open(&path).await.ok()?,
            };
            let mut events = svc.subscribe_events();
            loop {
                let ended = svc.for_tenant(&tenant).operation_ended(&id).unwrap_or(true);
                let mut buf = vec![0u8; 64 * 1024];
                let n = file.read(&mut buf).await.ok()?;
                if n > 0 {
                    buf.truncate(n);
                    return Some((
                        Ok::<_, std::io::Error>(bytes::Bytes::from(buf)),
                        (Some(file), false),
                    ));
                }
                if ended {
                    return None;
                }
                // Output has no event of its own: wake on any event, or poll.
                let _ = tokio::time::timeout(Duration::from_millis(250), events.changed()).await;
            }
        }
    });
    (text, axum::body::Body::from_stream(stream)).into_response()
}
