//! The Connect protocol as envd speaks it: the JSON codec over HTTP/1.1.
//!
//! - Unary: `POST /<pkg>.<Service>/<Method>`, `application/json` both ways; an error
//!   is an HTTP status with `{"code": "<snake_case>", "message"}`.
//! - Streams: `application/connect+json` bodies of envelopes `[flags u8][len u32 BE][json]`;
//!   a server stream ends with a flag-`0x02` envelope holding `{}` or `{"error": …}`.

use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::{Buf, Bytes, BytesMut};
use futures::{Stream, StreamExt};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use space_api::ErrorCode;
use space_service::ServiceError;
use tokio::sync::mpsc;

/// Largest message a client may send (a unary body or one envelope).
pub const MAX_MESSAGE: usize = 2 << 20;
/// The content type of a stream.
pub const STREAM_TYPE: &str = "application/connect+json";
const FLAG_COMPRESSED: u8 = 0x01;
const FLAG_END: u8 = 0x02;

/// A Connect error: a code from the protocol's fixed set and a message.
#[derive(Debug, Clone)]
pub struct RpcError {
    pub code: &'static str,
    pub message: String,
}

impl RpcError {
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new("invalid_argument", message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new("not_found", message)
    }

    /// The HTTP status of a unary error (the Connect spec's table).
    pub fn status(&self) -> StatusCode {
        let s = match self.code {
            "canceled" => 499,
            "invalid_argument" | "failed_precondition" | "out_of_range" => 400,
            "deadline_exceeded" => 504,
            "not_found" => 404,
            "already_exists" | "aborted" => 409,
            "permission_denied" => 403,
            "resource_exhausted" => 429,
            "unimplemented" => 501,
            "unavailable" => 503,
            "unauthenticated" => 401,
            _ => 500,
        };
        StatusCode::from_u16(s).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    fn json(&self) -> Value {
        json!({ "code": self.code, "message": self.message })
    }
}

impl From<ServiceError> for RpcError {
    fn from(e: ServiceError) -> Self {
        let code = match e.code() {
            ErrorCode::NotFound => "not_found",
            ErrorCode::Unauthorized => "unauthenticated",
            ErrorCode::Forbidden | ErrorCode::ForbiddenPath => "permission_denied",
            ErrorCode::TooManyRequests
            | ErrorCode::BodyTooLarge
            | ErrorCode::TooLarge
            | ErrorCode::NoSpace => "resource_exhausted",
            ErrorCode::Conflict | ErrorCode::InvalidTransition => "failed_precondition",
            ErrorCode::AgentTimeout | ErrorCode::TimedOut => "deadline_exceeded",
            ErrorCode::Unavailable
            | ErrorCode::AgentUnavailable
            | ErrorCode::RuntimeUnavailable
            | ErrorCode::AgentBusy => "unavailable",
            c if c.http_status() == 400 => "invalid_argument",
            _ => "internal",
        };
        let message = match &e {
            ServiceError::Store(_) | ServiceError::Internal(_) => {
                tracing::warn!(error = %space_service::error_chain(&e), "envd call failed");
                "internal error".to_string()
            }
            _ => e.to_string(),
        };
        RpcError::new(code, message)
    }
}

impl IntoResponse for RpcError {
    fn into_response(self) -> Response {
        (self.status(), axum::Json(self.json())).into_response()
    }
}

/// A unary answer.
pub fn unary(r: Result<Value, RpcError>) -> Response {
    match r {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Reads a body of at most [`MAX_MESSAGE`] bytes.
async fn read_body(body: Body) -> Result<Bytes, RpcError> {
    axum::body::to_bytes(body, MAX_MESSAGE)
        .await
        .map_err(|_| RpcError::new("resource_exhausted", "message too large or body unreadable"))
}

fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, RpcError> {
    let bytes = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        bytes
    };
    serde_json::from_slice(bytes)
        .map_err(|e| RpcError::invalid(format!("bad request message: {e}")))
}

/// The message of a unary call (`application/json`).
pub async fn read_unary<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: Body,
) -> Result<T, RpcError> {
    let ct = content_type(headers);
    if ct != "application/json" {
        return Err(RpcError::invalid(format!(
            "unary calls take application/json (the JSON codec), not {ct:?}"
        )));
    }
    if headers
        .get("content-encoding")
        .is_some_and(|v| v != "identity")
    {
        return Err(RpcError::new(
            "unimplemented",
            "compressed requests are not supported",
        ));
    }
    decode(&read_body(body).await?)
}

fn content_type(headers: &HeaderMap) -> String {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
        .unwrap_or_default()
}

fn check_stream_type(headers: &HeaderMap) -> Result<(), RpcError> {
    let ct = content_type(headers);
    if ct != STREAM_TYPE {
        return Err(RpcError::invalid(format!(
            "streaming calls take {STREAM_TYPE}, not {ct:?}"
        )));
    }
    Ok(())
}

/// The one message of a server-streaming call.
pub async fn read_single<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: Body,
) -> Result<T, RpcError> {
    check_stream_type(headers)?;
    let mut buf = BytesMut::from(&read_body(body).await?[..]);
    match next_envelope(&mut buf)? {
        Some((_, msg)) => decode(&msg),
        None => Err(RpcError::invalid("the request holds no message")),
    }
}

/// Takes one whole envelope off the front of `buf`.
fn next_envelope(buf: &mut BytesMut) -> Result<Option<(u8, Bytes)>, RpcError> {
    if buf.len() < 5 {
        return Ok(None);
    }
    let flags = buf[0];
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if len > MAX_MESSAGE {
        return Err(RpcError::new("resource_exhausted", "message too large"));
    }
    if flags & FLAG_COMPRESSED != 0 {
        return Err(RpcError::new(
            "unimplemented",
            "compressed messages are not supported",
        ));
    }
    if buf.len() < 5 + len {
        return Ok(None);
    }
    buf.advance(5);
    Ok(Some((flags, buf.split_to(len).freeze())))
}

/// The messages of a client stream, decoded as they arrive.
pub fn read_stream<T: DeserializeOwned + Send + 'static>(
    headers: &HeaderMap,
    body: Body,
) -> Result<impl Stream<Item = Result<T, RpcError>> + Send, RpcError> {
    check_stream_type(headers)?;
    let state = (body.into_data_stream(), BytesMut::new(), false);
    Ok(futures::stream::unfold(
        state,
        |(mut body, mut buf, done)| async move {
            if done {
                return None;
            }
            loop {
                match next_envelope(&mut buf) {
                    Err(e) => return Some((Err(e), (body, buf, true))),
                    Ok(Some((flags, msg))) => {
                        if flags & FLAG_END != 0 {
                            return None;
                        }
                        return Some((decode(&msg), (body, buf, false)));
                    }
                    Ok(None) => {}
                }
                match body.next().await {
                    Some(Ok(chunk)) => buf.extend_from_slice(&chunk),
                    Some(Err(e)) => {
                        return Some((
                            Err(RpcError::new(
                                "canceled",
                                format!("the request body broke: {e}"),
                            )),
                            (body, buf, true),
                        ))
                    }
                    None if buf.is_empty() => return None,
                    None => {
                        return Some((
                            Err(RpcError::invalid("the request ends inside a message")),
                            (body, buf, true),
                        ))
                    }
                }
            }
        },
    ))
}

fn envelope(flags: u8, v: &Value) -> Bytes {
    let body = serde_json::to_vec(v).unwrap_or_else(|_| b"{}".to_vec());
    let mut out = BytesMut::with_capacity(5 + body.len());
    out.extend_from_slice(&[flags]);
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out.freeze()
}

/// The sending half of a server stream.
pub struct StreamTx(mpsc::Sender<Bytes>);

impl StreamTx {
    /// Sends one message; `false` once the client is gone.
    pub async fn send(&self, v: Value) -> bool {
        self.0.send(envelope(0, &v)).await.is_ok()
    }

    /// Ends the stream, with an error or without.
    pub async fn end(self, err: Option<RpcError>) {
        let v = match err {
            Some(e) => json!({ "error": e.json() }),
            None => json!({}),
        };
        let _ = self.0.send(envelope(FLAG_END, &v)).await;
    }

    /// Resolves when the client has gone.
    pub async fn closed(&self) {
        self.0.closed().await
    }
}

/// A server-stream response fed by the returned sender.
pub fn stream_response() -> (StreamTx, Response) {
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let body = Body::from_stream(
        tokio_stream::wrappers::ReceiverStream::new(rx).map(Ok::<_, std::convert::Infallible>),
    );
    let resp = Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, STREAM_TYPE)
        .header(header::CACHE_CONTROL, "no-store")
        .body(body)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    (StreamTx(tx), resp)
}

/// A whole stream of one message and a clean end (a client stream's answer).
pub fn stream_reply(v: Value) -> Response {
    let mut body = BytesMut::new();
    body.extend_from_slice(&envelope(0, &v));
    body.extend_from_slice(&envelope(FLAG_END, &json!({})));
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, STREAM_TYPE)
        .body(Body::from(body.freeze()))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// A stream that is only an error (the call failed before its first message).
pub fn stream_error(e: RpcError) -> Response {
    let body = Body::from(envelope(FLAG_END, &json!({ "error": e.json() })));
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, STREAM_TYPE)
        .body(body)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// The client's deadline (`Connect-Timeout-Ms`), if it set one.
pub fn deadline(headers: &HeaderMap) -> Result<Option<Duration>, RpcError> {
    match headers.get("connect-timeout-ms") {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .filter(|ms| *ms <= 1 << 40)
            .map(|ms| (ms > 0).then(|| Duration::from_millis(ms)))
            .ok_or_else(|| {
                RpcError::invalid("Connect-Timeout-Ms must be a number of milliseconds")
            }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_come_apart_whole_or_not_at_all() {
        let e = envelope(0, &json!({"a": 1}));
        let mut buf = BytesMut::from(&e[..3]);
        assert!(next_envelope(&mut buf).unwrap().is_none());
        let mut buf = BytesMut::from(&e[..]);
        buf.extend_from_slice(&envelope(FLAG_END, &json!({}))[..]);
        let (f, m) = next_envelope(&mut buf).unwrap().unwrap();
        assert_eq!((f, &m[..]), (0, &br#"{"a":1}"#[..]));
        let (f, _) = next_envelope(&mut buf).unwrap().unwrap();
        assert_eq!(f, FLAG_END);
        assert!(buf.is_empty());
    }

    #[test]
    fn a_huge_or_compressed_envelope_is_refused_before_it_is_read() {
        let mut buf = BytesMut::from(&[0u8, 0xff, 0xff, 0xff, 0xff][..]);
        assert_eq!(
            next_envelope(&mut buf).unwrap_err().code,
            "resource_exhausted"
        );
        let mut buf = BytesMut::from(&[FLAG_COMPRESSED, 0, 0, 0, 0][..]);
        assert_eq!(next_envelope(&mut buf).unwrap_err().code, "unimplemented");
    }

    #[test]
    fn service_errors_keep_their_meaning() {
        let e: RpcError = ServiceError::NotFound("x".into()).into();
        assert_eq!((e.code, e.status()), ("not_found", StatusCode::NOT_FOUND));
        let e: RpcError = ServiceError::BadRequest("x".into()).into();
        assert_eq!(e.code, "invalid_argument");
    }
}
