//! `GET /v1/events`: server-sent events for every sandbox and operation change.
//!
//! Each event carries its id; a client that reconnects with `Last-Event-ID`
//! (or `?after=N`) gets every retained event after that one, then live ones.
//! Without either it gets only new events; `?after=0` replays all retained history.

use space_api::ErrorCode;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use bytes::Bytes;
use serde::Deserialize;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

use super::{error, parse_query, AppState};
use space_service::Tenant;

/// Events read from the store per batch.
const BATCH: usize = 500;
/// A comment line this often keeps proxies and clients from timing out.
const HEARTBEAT: Duration = Duration::from_secs(15);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Query {
    after: Option<i64>,
}

pub async fn stream(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> Response {
    let q: Query = match parse_query(q.as_deref()) {
        Ok(q) => q,
        Err(r) => return r.into_response(),
    };
    let last_event_id = match headers.get("last-event-id").map(|v| v.to_str()) {
        None => None,
        Some(Ok(v)) => match v.trim().parse::<i64>() {
            Ok(n) => Some(n),
            Err(_) => {
                return error(
                    StatusCode::BAD_REQUEST,
                    ErrorCode::InvalidHeader,
                    "Last-Event-ID must be an event id",
                )
            }
        },
        Some(Err(_)) => {
            return error(
                StatusCode::BAD_REQUEST,
                ErrorCode::InvalidHeader,
                "Last-Event-ID must be an event id",
            )
        }
    };
    let mut feed = match st
        .service
        .for_tenant(&tenant)
        .event_feed(last_event_id.or(q.after))
    {
        Ok(feed) => feed,
        Err(e) => return super::HttpError(e).into_response(),
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        // Tell the client how long to wait before reconnecting.
        if tx
            .send(Bytes::from_static(b"retry: 1000\n\n"))
            .await
            .is_err()
        {
            return;
        }
        loop {
            let events = tokio::select! {
                events = feed.next(BATCH, HEARTBEAT) => match events {
                    Ok(events) => events,
                    Err(_) => return,
                },
                // A client that went away gives its stream slot back at once.
                _ = tx.closed() => return,
            };
            if events.is_empty() {
                if tx
                    .send(Bytes::from_static(b": keepalive\n\n"))
                    .await
                    .is_err()
                {
                    return;
                }
                continue;
            }
            for e in events {
                let data = serde_json::to_string(&e).unwrap_or_default();
                let frame = format!("id: {}\nevent: {}\ndata: {}\n\n", e.id, e.kind, data);
                if tx.send(Bytes::from(frame)).await.is_err() {
                    return;
                }
            }
        }
    });
    let body = Body::from_stream(ReceiverStream::new(rx).map(Ok::<_, std::convert::Infallible>));
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-store")
        .body(body)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}
