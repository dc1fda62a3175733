//! Authentication and the early ownership answer of `/v1`.
//!
//! [`auth`] turns the bearer credential into a [`Principal`] (the service decides
//! what it stands for) and cuts off a streamed response once its key is revoked.
//! [`ownership`] answers 404 for an id the caller does not own before a body is
//! read, on the *decoded* path parameters of the matched route; the service
//! checks ownership again, authoritatively, on every action.

use axum::body::Body;
use axum::extract::{MatchedPath, RawPathParams, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use http_body::Body as _;
use space_api::ErrorCode;

use super::{error, AppState, HttpError};
use space_service::Tenant;

/// `Authorization: Bearer …` on every `/v1` route; puts the [`Principal`] and its
/// [`Tenant`] on the request.
pub async fn auth(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|v| v.trim().to_string())
        .or_else(|| websocket_bearer(req.headers()));
    let principal = match presented {
        Some(p) => match state.service.authenticate(&p) {
            Ok(t) => t,
            Err(e) => return HttpError(e).into_response(),
        },
        None => None,
    };
    let Some(principal) = principal else {
        let mut resp = error(
            StatusCode::UNAUTHORIZED,
            ErrorCode::Unauthorized,
            "missing, wrong or revoked bearer token",
        );
        resp.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
        return resp;
    };
    let revoked = state.service.revoked(&principal);
    req.extensions_mut().insert(principal.tenant.clone());
    req.extensions_mut().insert(principal);
    let resp = next.run(req).await;
    // A streamed body (events, followed output or logs) ends, cut off, once the key
    // that opened it is revoked. WebSocket sessions watch for it themselves.
    if resp.body().size_hint().exact().is_some() {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let stream = futures::stream::unfold(
        (body.into_data_stream(), Box::pin(revoked), false),
        |(mut body, mut revoked, done)| async move {
            if done {
                return None;
            }
            tokio::select! {
                biased;
                _ = &mut revoked => Some((
                    Err(axum::Error::new(std::io::Error::other("the API key was revoked"))),
                    (body, revoked, true),
                )),
                next = body.next() => next.map(|item| (item, (body, revoked, false))),
            }
        },
    );
    Response::from_parts(parts, Body::from_stream(stream))
}

/// The subprotocol prefix that carries a bearer token on a WebSocket handshake: a
/// browser cannot set `Authorization` there, and a token in the URL would end up in
/// logs and history. The client offers `space.attach.v1` and
/// `space.bearer.<base64url of the token, unpadded>`; the server answers with
/// `space.attach.v1` only, so the token is never echoed.
pub const WS_BEARER_PREFIX: &str = "space.bearer.";

/// The token of a [`WS_BEARER_PREFIX`] subprotocol, if a WebSocket upgrade offers one.
fn websocket_bearer(headers: &axum::http::HeaderMap) -> Option<String> {
    use base64::Engine as _;
    headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .find_map(|p| p.trim().strip_prefix(WS_BEARER_PREFIX))
        .and_then(|b| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(b)
                .ok()
        })
        .and_then(|b| String::from_utf8(b).ok())
}

/// Answers 404 for a sandbox, command, operation or template that is not the
/// caller's (or does not exist, or does not parse) before any handler reads a
/// body. Runs on the matched route with its decoded parameters, so no encoding of
/// an id can slip past it; the service checks again on every action.
pub async fn ownership(
    State(state): State<AppState>,
    matched: Option<MatchedPath>,
    params: Option<RawPathParams>,
    req: Request,
    next: Next,
) -> Response {
    let Some(tenant) = req.extensions().get::<Tenant>().cloned() else {
        return error(
            StatusCode::UNAUTHORIZED,
            ErrorCode::Unauthorized,
            "no tenant",
        );
    };
    let (Some(matched), Some(params)) = (matched, params) else {
        return next.run(req).await;
    };
    let route = matched
        .as_str()
        .strip_prefix("/v1")
        .unwrap_or(matched.as_str());
    let param = |name: &str| -> Option<String> {
        params
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| String::from(v))
    };
    let scope = state.service.for_tenant(&tenant);
    let checked = if route.starts_with("/sandboxes/:id") {
        match (param("id"), param("cid")) {
            (Some(id), Some(cid)) => scope.check_command(&id, &cid),
            (Some(id), None) => scope.check_sandbox(&id),
            _ => Ok(()),
        }
    } else if route.starts_with("/operations/:id") {
        param("id").map_or(Ok(()), |id| scope.check_operation(&id))
    } else if route.starts_with("/templates/:name") {
        param("name").map_or(Ok(()), |name| scope.check_template(&name))
    } else {
        Ok(())
    };
    match checked {
        Ok(()) => next.run(req).await,
        Err(e) => HttpError(e).into_response(),
    }
}
