//! `/v1/sandboxes/{id}/commands`.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, RawQuery, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use space_api::{CommandList, CreateCommandRequest};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

use super::{check_id, error, parse_query, parse_wait, ApiJson, AppState, HttpError};
use crate::service::output::View;
use crate::service::CommandOutputQuery;

pub async fn create(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<CreateCommandRequest>,
) -> Response {
    if let Err(r) = check_id(&id, "sb", "sandbox") {
        return r.into_response();
    }
    match st.service.create_command(&id, req).await {
        Ok(cmd) => (StatusCode::CREATED, Json(cmd)).into_response(),
        Err(e) => HttpError(e).into_response(),
    }
}

pub async fn list(State(st): State<AppState>, Path(id): Path<String>) -> Response {
    if let Err(r) = check_id(&id, "sb", "sandbox") {
        return r.into_response();
    }
    match st.service.list_commands(&id) {
        Ok(commands) => Json(CommandList { commands }).into_response(),
        Err(e) => HttpError(e).into_response(),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GetQuery {
    wait: Option<String>,
}

pub async fn get(
    State(st): State<AppState>,
    Path((id, cid)): Path<(String, String)>,
    RawQuery(q): RawQuery,
) -> Response {
    if let Err(r) = check_id(&id, "sb", "sandbox").and(check_id(&cid, "cmd", "command")) {
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
    match st.service.wait_command(&id, &cid, Some(wait)).await {
        Ok(cmd) => Json(cmd).into_response(),
        Err(e) => HttpError(e).into_response(),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OutputQuery {
    offset: Option<u64>,
    follow: Option<bool>,
    /// `stdout`, `stderr` or `combined` (default).
    stream: Option<String>,
}

pub async fn output(
    State(st): State<AppState>,
    Path((id, cid)): Path<(String, String)>,
    RawQuery(q): RawQuery,
) -> Response {
    if let Err(r) = check_id(&id, "sb", "sandbox").and(check_id(&cid, "cmd", "command")) {
        return r.into_response();
    }
    let q: OutputQuery = match parse_query(q.as_deref()) {
        Ok(q) => q,
        Err(r) => return r.into_response(),
    };
    let view = match q.stream.as_deref() {
        None | Some("combined") => View::Combined,
        Some("stdout") => View::Stdout,
        Some("stderr") => View::Stderr,
        Some(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_query",
                "stream must be stdout, stderr or combined",
            )
        }
    };
    let query = CommandOutputQuery {
        offset: q.offset.unwrap_or(0),
        follow: q.follow.unwrap_or(false),
        view,
    };
    match st.service.command_output(&id, &cid, query) {
        Ok(rx) => {
            let stream = ReceiverStream::new(rx).map(Ok::<_, std::convert::Infallible>);
            Response::builder()
                .header(header::CONTENT_TYPE, "application/x-ndjson")
                .header(header::CACHE_CONTROL, "no-store")
                .body(Body::from_stream(stream))
                .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
        }
        Err(e) => HttpError(e).into_response(),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignalBody {
    /// A number, or a name like `TERM`, `SIGKILL`.
    signal: serde_json::Value,
}

pub async fn signal(
    State(st): State<AppState>,
    Path((id, cid)): Path<(String, String)>,
    ApiJson(body): ApiJson<SignalBody>,
) -> Response {
    if let Err(r) = check_id(&id, "sb", "sandbox").and(check_id(&cid, "cmd", "command")) {
        return r.into_response();
    }
    let Some(sig) = parse_signal(&body.signal) else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_signal",
            "signal must be a number 1-64 or a name such as TERM, KILL, INT, HUP, QUIT, USR1, USR2, STOP, CONT",
        );
    };
    match st.service.signal_command(&id, &cid, sig).await {
        Ok(cmd) => Json(cmd).into_response(),
        Err(e) => HttpError(e).into_response(),
    }
}

pub fn parse_signal(v: &serde_json::Value) -> Option<i32> {
    if let Some(n) = v.as_i64() {
        return (1..=64).contains(&n).then_some(n as i32);
    }
    let name = v.as_str()?.trim().to_ascii_uppercase();
    let name = name.strip_prefix("SIG").unwrap_or(&name);
    Some(match name {
        "HUP" => libc::SIGHUP,
        "INT" => libc::SIGINT,
        "QUIT" => libc::SIGQUIT,
        "KILL" => libc::SIGKILL,
        "USR1" => libc::SIGUSR1,
        "USR2" => libc::SIGUSR2,
        "TERM" => libc::SIGTERM,
        "STOP" => libc::SIGSTOP,
        "CONT" => libc::SIGCONT,
        "ALRM" => libc::SIGALRM,
        "WINCH" => libc::SIGWINCH,
        _ => return None,
    })
}
