//! A typed async client of the space HTTP API, v1: one method per route, the
//! `space-api` wire types in and out, and one error type ([`ClientError`]) that
//! keeps the server's `{"error":{"code","message"}}` apart from a server that
//! cannot be reached and from an answer that cannot be read.
//!
//! Shared by the CLI, the benchmarks and the tests. Streamed answers come as
//! streams: a command's output as [`OutputItem`]s, events as
//! [`space_api::Event`]s, file downloads and build logs as bytes. Every answer
//! read into memory is bounded ([`MAX_JSON_RESPONSE`], [`MAX_ERROR_BODY`], the
//! line bounds of the streams); nothing the server sends can make it panic.
//!
//! ```no_run
//! # async fn demo() -> Result<(), space_client::ClientError> {
//! let c = space_client::Client::from_env()?;
//! let req = space_api::CreateSandboxRequest { template: "busybox".into(), ..Default::default() };
//! let sb = c.create_sandbox_and_wait(&req, std::time::Duration::from_secs(600)).await?;
//! let cmd = c.run(&sb, &["echo", "hi"]).await?;
//! assert_eq!(cmd.stdout.as_deref(), Some("hi\n"));
//! c.destroy_sandbox_and_wait(&sb, std::time::Duration::from_secs(120)).await?;
//! # Ok(()) }
//! ```
//!
//! For requests the typed methods cannot make (raw or deliberately malformed
//! ones), [`Client::request`] gives a `reqwest::RequestBuilder` with the
//! credentials set, and [`Client::send_json`] / [`Client::send_ok`] read its
//! answer the way the typed methods do.

mod commands;
mod error;
mod files;
mod operations;
mod output;
mod pools;
mod sandboxes;
mod sse;
mod stream;
mod templates;

use std::time::Duration;

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::StreamExt;
use reqwest::header::{HeaderValue, AUTHORIZATION, RETRY_AFTER};
use reqwest::{Method, RequestBuilder, Response, Url};
use serde::de::DeserializeOwned;
use space_api::{ErrorBody, Health, RuntimeInfo, RuntimeList};

pub use commands::{AttachRequest, AttachSocket};
pub use error::{error_code, status_text, BoxError, ClientError};
pub use files::{Download, UploadOptions};
pub use output::{OutputItem, OutputQuery, OutputStream, OutputView, StdStream, MAX_OUTPUT_LINE};
/// The wire types, for callers that need only this crate.
pub use space_api as api;
pub use sse::{EventStream, EventsQuery, MAX_EVENT_BYTES};

/// `SPACE_URL` when it is not set.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7070";
/// `SPACE_TOKEN` when it is not set: the token `space serve --dev` accepts by default.
pub const DEV_TOKEN: &str = "space-dev-token";
/// Largest JSON answer read. A command with `wait:true` carries up to 1 MiB of
/// each stream inline, which JSON escaping can make several times larger.
pub const MAX_JSON_RESPONSE: u64 = 64 << 20;
/// Largest error body read; the rest is dropped.
pub const MAX_ERROR_BODY: usize = 64 << 10;

pub type Result<T, E = ClientError> = std::result::Result<T, E>;

/// An answer's body, piece by piece.
pub type ByteStream = BoxStream<'static, Result<Bytes>>;

/// A client of one server with one token. Cheap to clone (connections are shared).
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: Url,
    /// `base` as given, without a trailing `/`: what the escape hatch appends to.
    base_str: String,
    auth: HeaderValue,
    timeout: Option<Duration>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("base", &self.base_str)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// Sets up a [`Client`].
pub struct ClientBuilder {
    url: String,
    token: String,
    http: Option<reqwest::Client>,
    timeout: Option<Duration>,
}

impl ClientBuilder {
    /// Use this HTTP client (its connection pool, proxy and TLS settings).
    pub fn http(mut self, http: reqwest::Client) -> Self {
        self.http = Some(http);
        self
    }

    /// A deadline for each request whose answer is read whole (not for streams).
    /// It must be longer than any `wait` asked of the server.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    pub fn build(self) -> Result<Client> {
        let invalid = |reason: String| ClientError::InvalidUrl {
            url: self.url.clone(),
            reason,
        };
        let base_str = self.url.trim_end_matches('/').to_string();
        let base = Url::parse(&base_str).map_err(|e| invalid(e.to_string()))?;
        if !matches!(base.scheme(), "http" | "https") || base.cannot_be_a_base() {
            return Err(invalid("not an http:// or https:// URL".into()));
        }
        if base.query().is_some() || base.fragment().is_some() {
            return Err(invalid("a server URL has no query or fragment".into()));
        }
        let mut auth = HeaderValue::from_str(&format!("Bearer {}", self.token))
            .map_err(|_| ClientError::InvalidToken)?;
        auth.set_sensitive(true);
        let http = match self.http {
            Some(h) => h,
            // A kept-alive connection goes back unused for less than the server keeps it
            // (its head timeout, 10 s by default): a request sent on one the server is
            // closing at that moment would fail with nothing read.
            None => reqwest::Client::builder()
                .pool_idle_timeout(POOL_IDLE)
                .build()
                .map_err(ClientError::Setup)?,
        };
        Ok(Client {
            http,
            base,
            base_str,
            auth,
            timeout: self.timeout,
        })
    }
}

/// How long an idle kept-alive connection is reused.
pub const POOL_IDLE: std::time::Duration = std::time::Duration::from_secs(4);

impl Client {
    pub fn builder(url: impl Into<String>, token: impl Into<String>) -> ClientBuilder {
        ClientBuilder {
            url: url.into(),
            token: token.into(),
            http: None,
            timeout: None,
        }
    }

    /// A client of the server at `url` (`http://host:port`, optionally with a path
    /// prefix) with bearer token `token`.
    pub fn new(url: impl Into<String>, token: impl Into<String>) -> Result<Client> {
        Client::builder(url, token).build()
    }

    /// `SPACE_URL` (default [`DEFAULT_URL`]) and `SPACE_TOKEN` (default [`DEV_TOKEN`]).
    pub fn from_env() -> Result<Client> {
        let url = std::env::var("SPACE_URL").unwrap_or_else(|_| DEFAULT_URL.into());
        let token = std::env::var("SPACE_TOKEN").unwrap_or_else(|_| DEV_TOKEN.into());
        Client::new(url, token)
    }

    /// The server's URL, without a trailing `/`.
    pub fn base_url(&self) -> &str {
        &self.base_str
    }

    /// The underlying HTTP client.
    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    /// The escape hatch: a request to `base_url() + path` (`path` as given, query
    /// and all, not encoded) with the credentials and the client's timeout set.
    pub fn request(&self, method: Method, path: &str) -> RequestBuilder {
        let rb = self
            .http
            .request(method, format!("{}{}", self.base_str, path))
            .header(AUTHORIZATION, self.auth.clone());
        match self.timeout {
            Some(t) => rb.timeout(t),
            None => rb,
        }
    }

    /// Sends a request and reads its JSON answer (bounded); a failure status is
    /// [`ClientError::Api`] (or [`ClientError::Status`] without our error body).
    pub async fn send_json<T: DeserializeOwned>(&self, rb: RequestBuilder) -> Result<T> {
        let resp = self.send_ok(rb).await?;
        let what = format!("answer of {}", resp.url().path());
        let bytes = self.read_bounded(resp, MAX_JSON_RESPONSE, &what).await?;
        serde_json::from_slice(&bytes).map_err(|e| ClientError::decode(what, e))
    }

    /// Sends a request; the answer if its status is a success, else the error it carries.
    pub async fn send_ok(&self, rb: RequestBuilder) -> Result<Response> {
        let resp = rb.send().await.map_err(|e| self.transport(e))?;
        if resp.status().is_success() {
            Ok(resp)
        } else {
            Err(Self::error_of(resp).await)
        }
    }

    /// The error a failed answer carries: its `{"error":…}` body (read up to
    /// [`MAX_ERROR_BODY`]) and `Retry-After`, or its status and text.
    pub async fn error_of(mut resp: Response) -> ClientError {
        let status = resp.status().as_u16();
        let retry_after = resp
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse().ok());
        let mut body = Vec::new();
        // A body that breaks off is still worth showing as far as it came.
        while let Ok(Some(chunk)) = resp.chunk().await {
            let room = MAX_ERROR_BODY - body.len();
            body.extend_from_slice(&chunk[..chunk.len().min(room)]);
            if body.len() == MAX_ERROR_BODY {
                break;
            }
        }
        match serde_json::from_slice::<ErrorBody>(&body) {
            Ok(e) => ClientError::Api {
                status,
                error: e.error,
                retry_after,
            },
            Err(_) => ClientError::Status {
                status,
                body: String::from_utf8_lossy(&body).into_owned(),
            },
        }
    }

    /// A URL below the base: each segment percent-encoded, then the query pairs.
    /// An empty, `.` or `..` segment (an id given as `..`) is refused: a URL cannot
    /// carry it, and dropping it would address another resource.
    fn url(&self, segments: &[&str], query: &[(&str, String)]) -> Result<Url> {
        if let Some(bad) = segments.iter().find(|s| matches!(**s, "" | "." | "..")) {
            return Err(ClientError::InvalidPathSegment {
                segment: bad.to_string(),
            });
        }
        let mut url = self.base.clone();
        // Cannot fail: `build` refused URLs that cannot be a base.
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(segments);
        }
        if !query.is_empty() {
            let mut q = url.query_pairs_mut();
            for (k, v) in query {
                q.append_pair(k, v);
            }
        }
        Ok(url)
    }

    /// A request with the credentials; `timed` adds the client's timeout (never on
    /// streams, which last as long as they last).
    fn req(&self, method: Method, url: Url, timed: bool) -> RequestBuilder {
        let rb = self
            .http
            .request(method, url)
            .header(AUTHORIZATION, self.auth.clone());
        match self.timeout {
            Some(t) if timed => rb.timeout(t),
            _ => rb,
        }
    }

    /// `GET`/`DELETE`/… of `segments` with a JSON answer.
    async fn get_json<T: DeserializeOwned>(
        &self,
        method: Method,
        segments: &[&str],
        query: &[(&str, String)],
    ) -> Result<T> {
        let url = self.url(segments, query)?;
        self.send_json(self.req(method, url, true)).await
    }

    /// A JSON body to `segments`, with a JSON answer.
    async fn post_json<B: serde::Serialize + ?Sized, T: DeserializeOwned>(
        &self,
        segments: &[&str],
        body: &B,
    ) -> Result<T> {
        let url = self.url(segments, &[])?;
        self.send_json(self.req(Method::POST, url, true).json(body))
            .await
    }

    /// A streamed answer of `segments`.
    async fn get_stream(&self, segments: &[&str], query: &[(&str, String)]) -> Result<Response> {
        let url = self.url(segments, query)?;
        self.send_ok(self.req(Method::GET, url, false)).await
    }

    fn transport(&self, source: reqwest::Error) -> ClientError {
        let url = self.base_str.clone();
        match self.timeout {
            Some(after) if source.is_timeout() => ClientError::TimedOut { url, after, source },
            _ => ClientError::Transport { url, source },
        }
    }

    /// The answer's body as a stream of pieces.
    fn byte_stream(&self, resp: Response) -> ByteStream {
        let url = self.base_str.clone();
        resp.bytes_stream()
            .map(move |r| {
                r.map_err(|source| ClientError::Body {
                    url: url.clone(),
                    source,
                })
            })
            .boxed()
    }

    /// The whole body, refused past `limit` bytes (before reading when the length is declared).
    async fn read_bounded(&self, mut resp: Response, limit: u64, what: &str) -> Result<Vec<u8>> {
        let too_large = || ClientError::TooLarge {
            what: what.to_string(),
            limit,
        };
        if resp.content_length().is_some_and(|n| n > limit) {
            return Err(too_large());
        }
        let mut body = Vec::new();
        loop {
            match resp.chunk().await {
                Ok(Some(chunk)) => {
                    if (body.len() + chunk.len()) as u64 > limit {
                        return Err(too_large());
                    }
                    body.extend_from_slice(&chunk);
                }
                Ok(None) => return Ok(body),
                Err(source) => {
                    return Err(ClientError::Body {
                        url: self.base_str.clone(),
                        source,
                    })
                }
            }
        }
    }

    /// `GET /v1/runtimes`: the runtimes this server has and whether each works here.
    pub async fn runtimes(&self) -> Result<Vec<RuntimeInfo>> {
        let list: RuntimeList = self.get_json(Method::GET, &["v1", "runtimes"], &[]).await?;
        Ok(list.runtimes)
    }

    /// `GET /healthz` (needs no token; the client sends it anyway).
    pub async fn healthz(&self) -> Result<Health> {
        self.get_json(Method::GET, &["healthz"], &[]).await
    }

    /// `GET /v1/openapi.json`: the OpenAPI 3.1 document of the server.
    pub async fn openapi(&self) -> Result<serde_json::Value> {
        self.get_json(Method::GET, &["v1", "openapi.json"], &[])
            .await
    }
}

/// `30s`-style `wait` parameter: whole milliseconds, at least 1 ms when asked at all.
fn wait_param(wait: Duration) -> String {
    format!("{}ms", wait.as_millis())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_encode_each_segment_and_keep_a_path_prefix() {
        let c = Client::new("http://127.0.0.1:7070/", "t").unwrap();
        assert_eq!(c.base_url(), "http://127.0.0.1:7070");
        let u = c
            .url(&["v1", "sandboxes", "a/b?c#d", "x y%2F", "..."], &[])
            .unwrap();
        assert_eq!(
            u.as_str(),
            "http://127.0.0.1:7070/v1/sandboxes/a%2Fb%3Fc%23d/x%20y%252F/..."
        );
        for bad in ["", ".", ".."] {
            assert!(
                matches!(
                    c.url(&["v1", "sandboxes", bad], &[]),
                    Err(ClientError::InvalidPathSegment { .. })
                ),
                "{bad:?}"
            );
        }
        let c = Client::new("https://example.com/space", "t").unwrap();
        let u = c
            .url(
                &["v1", "templates", "t"],
                &[("path", "/a b&c=d".into()), ("wait", "5ms".into())],
            )
            .unwrap();
        assert_eq!(
            u.as_str(),
            "https://example.com/space/v1/templates/t?path=%2Fa+b%26c%3Dd&wait=5ms"
        );
    }

    #[test]
    fn bad_urls_and_tokens_are_refused_up_front() {
        for url in [
            "",
            "localhost:7070",
            "ftp://x",
            "http://x/?q=1",
            "data:text/plain,x",
        ] {
            assert!(
                matches!(Client::new(url, "t"), Err(ClientError::InvalidUrl { .. })),
                "{url}"
            );
        }
        assert!(matches!(
            Client::new("http://x", "a\nb"),
            Err(ClientError::InvalidToken)
        ));
        let dbg = format!("{:?}", Client::new("http://x", "secret-token").unwrap());
        assert!(!dbg.contains("secret-token"), "{dbg}");
    }

    #[test]
    fn errors_read_like_the_server_said_them() {
        let e = ClientError::Api {
            status: 404,
            error: space_api::ApiError::new(space_api::ErrorCode::NotFound, "no sandbox sb_x"),
            retry_after: None,
        };
        assert_eq!(e.to_string(), "404 Not Found (not_found): no sandbox sb_x");
        assert_eq!(e.status(), Some(404));
        let e = ClientError::Status {
            status: 502,
            body: "bad gateway".into(),
        };
        assert_eq!(e.to_string(), "502 Bad Gateway: bad gateway");
        assert_eq!(status_text(999), "999 <unknown status code>");
    }
}

#[cfg(test)]
mod answer_tests {
    use super::*;

    fn answer(status: u16, headers: &[(&str, &str)], body: Vec<u8>) -> Response {
        let mut b = http::Response::builder().status(status);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        Response::from(b.body(body).unwrap())
    }

    #[tokio::test]
    async fn an_error_body_becomes_api_with_retry_after() {
        let body = br#"{"error":{"code":"too_many_requests","message":"slow down"}}"#.to_vec();
        let e = Client::error_of(answer(429, &[("retry-after", "7")], body)).await;
        assert_eq!(e.status(), Some(429));
        assert_eq!(e.retry_after(), Some(7));
        assert_eq!(e.api_error().map(|a| a.message.as_str()), Some("slow down"));
        assert_eq!(
            e.to_string(),
            "429 Too Many Requests (too_many_requests): slow down"
        );
    }

    #[tokio::test]
    async fn other_error_bodies_are_kept_as_text_and_bounded() {
        let e = Client::error_of(answer(502, &[], b"<html>bad gateway</html>".to_vec())).await;
        assert!(
            matches!(&e, ClientError::Status { status: 502, body } if body == "<html>bad gateway</html>")
        );
        let e = Client::error_of(answer(500, &[], vec![b'x'; 10 * MAX_ERROR_BODY])).await;
        match e {
            ClientError::Status { body, .. } => assert_eq!(body.len(), MAX_ERROR_BODY),
            other => panic!("{other:?}"),
        }
        // An error envelope of another shape is not ours.
        let e = Client::error_of(answer(400, &[], br#"{"error":"nope"}"#.to_vec())).await;
        assert!(matches!(e, ClientError::Status { status: 400, .. }));
    }

    #[tokio::test]
    async fn bodies_past_the_bound_are_refused() {
        let c = Client::new("http://127.0.0.1:9", "t").unwrap();
        let ok = c
            .read_bounded(answer(200, &[], vec![1; 100]), 100, "x")
            .await;
        assert_eq!(ok.unwrap().len(), 100);
        let big = c
            .read_bounded(answer(200, &[], vec![1; 101]), 100, "x")
            .await;
        assert!(matches!(big, Err(ClientError::TooLarge { limit: 100, .. })));
    }

    #[tokio::test]
    async fn an_unreachable_server_is_a_transport_error() {
        // A port that was just free: bound, then closed again.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let url = format!("http://127.0.0.1:{port}");
        let c = Client::new(&url, "t").unwrap();
        let e = c.sandbox("sb_x").await.unwrap_err();
        assert!(e.is_transport(), "{e:?}");
        assert_eq!(
            e.to_string(),
            format!("cannot reach the space server at {url}")
        );
    }

    #[tokio::test]
    async fn a_server_that_never_answers_is_a_timeout_not_an_unreachable_one() {
        // Takes the connection and reads the request, but never answers.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let held = tokio::spawn(async move {
            let (conn, _) = listener.accept().await.unwrap();
            std::future::pending::<()>().await;
            drop(conn);
        });
        let after = Duration::from_millis(300);
        let c = Client::builder(&url, "t").timeout(after).build().unwrap();
        let e = c.sandbox("sb_x").await.unwrap_err();
        assert!(e.is_timeout() && e.is_transport(), "{e:?}");
        assert_eq!(
            e.to_string(),
            format!("the space server at {url} gave no answer within 300ms")
        );
        held.abort();
    }
}
