//! The HTTP layer: a thin parser in front of [`space_service::Service`].
//! Each handler turns a request into one service call; errors become
//! `{"error":{"code","message"}}` with the right status.

mod auth;
mod commands;
pub(crate) use commands::parse_signal;
mod contexts;
mod events;
mod files;
mod openapi;
mod operations;
mod pools;
mod sandboxes;
mod templates;

use space_api::ErrorCode;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{FromRequest, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use space_api::{ApiError, ErrorBody};

use space_service::{error_chain, Service, ServiceError};

/// Largest request body accepted on JSON endpoints.
pub const MAX_JSON_BODY: usize = 1 << 20;
/// Longest long-poll a client may ask for.
const MAX_WAIT: Duration = Duration::from_secs(600);

#[derive(Clone)]
pub struct AppState {
    pub service: Service,
}

/// The whole HTTP surface: `/v1`, and `extra` (the E2B-compatible routes) beside it
/// under the same logging and error shaping.
pub fn router(state: AppState, extra: Router<AppState>) -> Router {
    let v1 = Router::new()
        .route("/sandboxes", post(sandboxes::create).get(sandboxes::list))
        .route(
            "/sandboxes/:id",
            get(sandboxes::get).delete(sandboxes::destroy),
        )
        .route("/sandboxes/:id/pause", post(sandboxes::pause))
        .route("/sandboxes/:id/resume", post(sandboxes::resume))
        .route("/sandboxes/:id/suspend", post(sandboxes::suspend))
        .route("/sandboxes/:id/keepalive", post(sandboxes::keepalive))
        .route(
            "/sandboxes/:id/snapshot-template",
            post(sandboxes::snapshot_template),
        )
        .route(
            "/sandboxes/:id/commands",
            post(commands::create).get(commands::list),
        )
        .route("/sandboxes/:id/commands/:cid", get(commands::get))
        .route("/sandboxes/:id/commands/:cid/output", get(commands::output))
        .route(
            "/sandboxes/:id/commands/:cid/signal",
            post(commands::signal),
        )
        .route("/sandboxes/:id/commands/:cid/stdin", post(commands::stdin))
        .route("/sandboxes/:id/commands/:cid/attach", get(commands::attach))
        .route(
            "/sandboxes/:id/files",
            get(files::download)
                .put(files::upload)
                .delete(files::remove),
        )
        .route(
            "/sandboxes/:id/contexts",
            post(contexts::create).get(contexts::list),
        )
        .route(
            "/sandboxes/:id/contexts/:ctx",
            axum::routing::delete(contexts::delete),
        )
        .route(
            "/sandboxes/:id/contexts/:ctx/restart",
            post(contexts::restart),
        )
        .route(
            "/sandboxes/:id/contexts/:ctx/execute",
            post(contexts::execute),
        )
        .route("/sandboxes/:id/files/list", get(files::list))
        .route("/sandboxes/:id/files/stat", get(files::stat))
        .route("/sandboxes/:id/files/mkdir", post(files::mkdir))
        .route("/sandboxes/:id/files/move", post(files::rename))
        .route("/operations", get(operations::list))
        .route("/operations/:id", get(operations::get))
        .route("/operations/:id/cancel", post(operations::cancel))
        .route("/templates", get(templates::list).post(templates::build))
        .route("/templates/:name", axum::routing::delete(templates::delete))
        .route("/operations/:id/log", get(operations::log))
        .route("/events", get(events::stream))
        .route("/pools", get(pools::list).put(pools::put))
        .route("/pools/:id", axum::routing::delete(pools::delete))
        .route("/openapi.json", get(openapi::document))
        .route(
            "/whoami",
            get(
                |axum::Extension(p): axum::Extension<space_service::Principal>| async move {
                    Json(p.whoami())
                },
            ),
        )
        .route(
            "/runtimes",
            get(|State(st): State<AppState>| async move {
                Json(serde_json::json!({ "runtimes": st.service.runtimes_info() }))
            }),
        )
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::ownership,
        ))
        .route_layer(middleware::from_fn_with_state(state.clone(), observe))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), auth::auth));
    let metrics = Router::new()
        .route("/metrics", get(metrics))
        .layer(middleware::from_fn_with_state(state.clone(), auth::auth));
    Router::new()
        .route(
            "/healthz",
            get(|| async { Json(serde_json::json!({"status": "ok"})) }),
        )
        .nest("/v1", v1)
        .merge(metrics)
        .merge(crate::console::router())
        .merge(extra.route_layer(middleware::from_fn_with_state(state.clone(), observe)))
        .fallback(not_found)
        .with_state(state)
        .layer(middleware::from_fn(json_rejections))
        .layer(middleware::from_fn(log_request))
}

async fn not_found() -> Response {
    error(
        StatusCode::NOT_FOUND,
        ErrorCode::NotFound,
        "no such endpoint",
    )
}

/// Errors that axum's own extractors answer in plain text (a path segment that is not
/// UTF-8, a WebSocket request without an upgrade, …) in our `{"error":{…}}` form too.
async fn json_rejections(req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    let status = resp.status();
    let plain = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/plain"));
    if !(status.is_client_error() || status.is_server_error()) || !plain {
        return resp;
    }
    let text = match axum::body::to_bytes(resp.into_body(), 4096).await {
        Ok(b) => String::from_utf8_lossy(&b).into_owned(),
        Err(_) => String::new(),
    };
    let code = match status {
        StatusCode::NOT_FOUND => ErrorCode::NotFound,
        StatusCode::METHOD_NOT_ALLOWED => ErrorCode::MethodNotAllowed,
        StatusCode::PAYLOAD_TOO_LARGE => ErrorCode::BodyTooLarge,
        StatusCode::UNSUPPORTED_MEDIA_TYPE => ErrorCode::UnsupportedMediaType,
        s if s.is_server_error() => ErrorCode::Internal,
        _ => ErrorCode::InvalidRequest,
    };
    let message = if text.trim().is_empty() {
        status.canonical_reason().unwrap_or("error").to_string()
    } else {
        space_service::truncate(text.trim(), 500).to_string()
    };
    error(status, code, message)
}

/// One structured log line per request.
/// Times a request by its matched route (ids never make new series): `/v1`'s, and the
/// E2B and MCP routes beside it.
async fn observe(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map(|m| m.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    // Inside a nested router the matched path may or may not carry the prefix.
    let route = if req.uri().path().starts_with("/v1/") && !route.starts_with("/v1/") {
        format!("/v1{route}")
    } else {
        route
    };
    let start = std::time::Instant::now();
    let resp = next.run(req).await;
    st.service.observe_request(
        method.as_str(),
        &route,
        resp.status().as_u16(),
        start.elapsed(),
    );
    resp
}

/// `GET /metrics`: Prometheus text, the server's token only.
async fn metrics(
    State(st): State<AppState>,
    axum::Extension(who): axum::Extension<space_service::Principal>,
) -> Response {
    match st.service.metrics_text_as(&who) {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(e) => HttpError(e).into_response(),
    }
}

async fn log_request(req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let start = std::time::Instant::now();
    let resp = next.run(req).await;
    tracing::info!(
        %method,
        path = %space_service::truncate(&path, 200),
        status = resp.status().as_u16(),
        ms = start.elapsed().as_millis() as u64,
        "request"
    );
    resp
}

pub fn error(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> Response {
    (
        status,
        Json(ErrorBody {
            error: ApiError::new(code, message),
        }),
    )
        .into_response()
}

/// A service error as an HTTP response.
pub struct HttpError(pub ServiceError);

impl From<ServiceError> for HttpError {
    fn from(e: ServiceError) -> Self {
        HttpError(e)
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let code = self.0.code();
        let status =
            StatusCode::from_u16(code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        if code == ErrorCode::Internal {
            tracing::error!(error = %error_chain(&self.0), "internal error");
        }
        let message = match &self.0 {
            ServiceError::Store(_) => "internal storage error".to_string(),
            e => e.to_string(),
        };
        let mut resp = error(status, code, message);
        if let ServiceError::TooMany {
            retry_after: Some(s),
            ..
        } = &self.0
        {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from(*s));
        }
        resp
    }
}

/// `200` with `v` as JSON, or the error as its response.
pub fn respond<T: serde::Serialize>(r: space_service::Result<T>) -> Response {
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => HttpError(e).into_response(),
    }
}

/// Like [`respond`], with another success status (`201`, `202`).
pub fn respond_with<T: serde::Serialize>(
    status: StatusCode,
    r: space_service::Result<T>,
) -> Response {
    match r {
        Ok(v) => (status, Json(v)).into_response(),
        Err(e) => HttpError(e).into_response(),
    }
}

/// A JSON body: bounded (413), strictly parsed (400 naming the problem).
pub struct ApiJson<T>(pub T);

#[axum::async_trait]
impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = Response;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Self::Rejection> {
        let too_large = || {
            error(
                StatusCode::PAYLOAD_TOO_LARGE,
                ErrorCode::BodyTooLarge,
                format!("request body larger than {MAX_JSON_BODY} bytes"),
            )
        };
        // Refuse a declared oversize body before reading any of it.
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > MAX_JSON_BODY as u64) {
            return Err(too_large());
        }
        let body: Body = req.into_body();
        let bytes = axum::body::to_bytes(body, MAX_JSON_BODY)
            .await
            .map_err(|_| too_large())?;
        let value = serde_json::from_slice(&bytes).map_err(|e| {
            error(
                StatusCode::BAD_REQUEST,
                ErrorCode::InvalidJson,
                format!("invalid request body: {e}"),
            )
        })?;
        Ok(ApiJson(value))
    }
}

/// A request refused before it reached the service.
pub struct Reject {
    status: StatusCode,
    code: ErrorCode,
    message: String,
}

impl Reject {
    pub fn new(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> Self {
        Reject {
            status,
            code,
            message: message.into(),
        }
    }
}

impl IntoResponse for Reject {
    fn into_response(self) -> Response {
        error(self.status, self.code, self.message)
    }
}

/// Query parameters into `T`, with a 400 in our error format.
pub fn parse_query<T: DeserializeOwned>(raw: Option<&str>) -> Result<T, Reject> {
    serde_urlencoded::from_str(raw.unwrap_or("")).map_err(|e| Reject {
        status: StatusCode::BAD_REQUEST,
        code: ErrorCode::InvalidQuery,
        message: format!("invalid query: {e}"),
    })
}

/// `30s`, `500ms`, `2m` or plain seconds, at most [`MAX_WAIT`].
pub fn parse_wait(s: &str) -> Result<Duration, Reject> {
    let bad = || Reject {
        status: StatusCode::BAD_REQUEST,
        code: ErrorCode::InvalidQuery,
        message: format!(
            "invalid wait {:?}: use e.g. 30s, 500ms or 2m",
            space_service::truncate(s, 32)
        ),
    };
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => (&s[..i], &s[i..]),
        None => (s, "s"),
    };
    let n: u64 = num.parse().map_err(|_| bad())?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.saturating_mul(60)),
        _ => return Err(bad()),
    };
    Ok(d.min(MAX_WAIT))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_parsing() {
        assert_eq!(parse_wait("30s").ok(), Some(Duration::from_secs(30)));
        assert_eq!(parse_wait("250ms").ok(), Some(Duration::from_millis(250)));
        assert_eq!(parse_wait("2m").ok(), Some(Duration::from_secs(120)));
        assert_eq!(parse_wait("5").ok(), Some(Duration::from_secs(5)));
        assert_eq!(parse_wait("99999m").ok(), Some(MAX_WAIT));
        assert!(parse_wait("abc").is_err());
        assert!(parse_wait("5h").is_err());
        assert!(parse_wait("").is_err());
    }
}
