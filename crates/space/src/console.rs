//! The web console: static files built from `console/` by `build.rs` and embedded in
//! the binary. `/` is the page; `/assets/{name}` its script and styles. The page talks
//! to `/v1` like any client, with the key the user typed, so it sees exactly what that
//! key's tenant sees. Nothing here needs authentication: the files hold no data.

use axum::extract::Path;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

include!(concat!(env!("OUT_DIR"), "/console_assets.rs"));

/// Scripts and styles only from this server, no frames, no plugins. xterm.js sets
/// styles of its own at run time, hence `'unsafe-inline'` for styles (never scripts).
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
    connect-src 'self'; img-src 'self' data: blob:; font-src 'self' data:; \
    frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/", get(|| async { asset("index.html") }))
        .route(
            "/assets/:name",
            get(|Path(name): Path<String>| async move { asset(&name) }),
        )
}

fn asset(name: &str) -> Response {
    let Some((_, kind, bytes)) = ASSETS.iter().find(|(n, _, _)| *n == name) else {
        return crate::api::error(
            StatusCode::NOT_FOUND,
            space_api::ErrorCode::NotFound,
            "no such console file",
        );
    };
    let mut resp = (*bytes).into_response();
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    resp
}
