//! `/v1/sandboxes/{id}/commands`.

use space_api::ErrorCode;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, RawQuery, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use bytes::Bytes;
use serde::Deserialize;
use space_agent::protocol::Stream;
use space_api::{CommandList, CreateCommandRequest, OutputEnd};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

use super::{error, parse_query, parse_wait, respond, respond_with, ApiJson, AppState, HttpError};
use axum::Extension;
use space_service::output::View;
use space_service::{CommandOutputQuery, OutputEvent, Principal, Tenant};

pub async fn create(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<CreateCommandRequest>,
) -> Response {
    respond_with(
        StatusCode::CREATED,
        st.service
            .for_tenant(&tenant)
            .create_command(&id, req)
            .await,
    )
}

pub async fn list(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Response {
    respond(
        st.service
            .for_tenant(&tenant)
            .list_commands(&id)
            .map(|commands| CommandList { commands }),
    )
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GetQuery {
    wait: Option<String>,
}

pub async fn get(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path((id, cid)): Path<(String, String)>,
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
            .get_command(&id, &cid, wait)
            .await,
    )
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OutputQuery {
    offset: Option<u64>,
    follow: Option<bool>,
    /// `stdout`, `stderr` or `combined` (default).
    stream: Option<String>,
    /// `ndjson` (default) or `raw`: the view's bytes alone, as they are.
    format: Option<String>,
}

pub async fn output(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path((id, cid)): Path<(String, String)>,
    RawQuery(q): RawQuery,
) -> Response {
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
                ErrorCode::InvalidQuery,
                "stream must be stdout, stderr or combined",
            )
        }
    };
    let raw = match q.format.as_deref() {
        None | Some("ndjson") => false,
        Some("raw") => true,
        Some(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                ErrorCode::InvalidQuery,
                "format must be ndjson or raw",
            )
        }
    };
    let query = CommandOutputQuery {
        offset: q.offset.unwrap_or(0),
        follow: q.follow.unwrap_or(false),
        view,
    };
    let rx = match st
        .service
        .for_tenant(&tenant)
        .command_output(&id, &cid, query)
    {
        Ok(rx) => rx,
        Err(e) => return HttpError(e).into_response(),
    };
    // Raw: the bytes only, no framing to encode or decode; the body ends where the
    // NDJSON would have sent its result line (`GET …/commands/{cid}` then has it).
    let (kind, body) = if raw {
        let stream = ReceiverStream::new(rx).filter_map(|ev| match ev {
            OutputEvent::Chunk { data, .. } => Some(Ok::<_, std::convert::Infallible>(data)),
            OutputEvent::End(_) => None,
        });
        ("application/octet-stream", Body::from_stream(stream))
    } else {
        let stream =
            ReceiverStream::new(rx).map(|ev| Ok::<_, std::convert::Infallible>(ndjson_line(ev)));
        ("application/x-ndjson", Body::from_stream(stream))
    };
    Response::builder()
        .header(header::CONTENT_TYPE, kind)
        .header(header::CACHE_CONTROL, "no-store")
        .body(body)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignalBody {
    /// A number, or a name like `TERM`, `SIGKILL`.
    signal: serde_json::Value,
}

pub async fn signal(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path((id, cid)): Path<(String, String)>,
    ApiJson(body): ApiJson<SignalBody>,
) -> Response {
    let Some(sig) = parse_signal(&body.signal) else {
        return error(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidSignal,
            "signal must be a number 1-64 or a name such as TERM, KILL, INT, HUP, QUIT, USR1, USR2, STOP, CONT",
        );
    };
    respond(
        st.service
            .for_tenant(&tenant)
            .signal_command(&id, &cid, sig)
            .await,
    )
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

/// One NDJSON line: a chunk (`{stream, offset, data}`) or the end (`{"result", "state"}`).
fn ndjson_line(ev: OutputEvent) -> Bytes {
    let v = match ev {
        // An `OutputChunk`, written straight into one buffer: no intermediate value,
        // no escaping pass over base64 (which has nothing to escape).
        OutputEvent::Chunk {
            stream,
            offset,
            data,
        } => {
            let mut line = String::with_capacity(data.len().div_ceil(3) * 4 + 64);
            line.push_str("{\"stream\":\"");
            line.push_str(stream_name(stream));
            line.push_str("\",\"offset\":");
            line.push_str(&offset.to_string());
            line.push_str(",\"data\":\"");
            base64::engine::general_purpose::STANDARD.encode_string(&data, &mut line);
            line.push_str("\"}\n");
            return Bytes::from(line);
        }
        OutputEvent::End(cmd) => match cmd.result.clone() {
            Some(result) => serde_json::to_value(OutputEnd {
                result,
                state: cmd.state,
            })
            .unwrap_or_default(),
            None => serde_json::json!({
                "result": null, "state": cmd.state, "lost_reason": cmd.lost_reason
            }),
        },
    };
    let mut line = serde_json::to_vec(&v).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

fn stream_name(s: Stream) -> &'static str {
    match s {
        Stream::Stdout => "stdout",
        Stream::Stderr => "stderr",
    }
}

/// Largest body of one `POST …/stdin`.
const MAX_STDIN_BODY: usize = space_service::MAX_STDIN_WRITE;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StdinQuery {
    /// Close the command's stdin after these bytes.
    eof: Option<bool>,
}

/// `POST …/commands/{cid}/stdin`: the raw body goes to the command's stdin.
pub async fn stdin(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path((id, cid)): Path<(String, String)>,
    RawQuery(q): RawQuery,
    body: axum::body::Body,
) -> Response {
    let q: StdinQuery = match parse_query(q.as_deref()) {
        Ok(q) => q,
        Err(r) => return r.into_response(),
    };
    let Ok(data) = axum::body::to_bytes(body, MAX_STDIN_BODY).await else {
        return error(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::BodyTooLarge,
            format!("at most {MAX_STDIN_BODY} bytes of stdin per request"),
        );
    };
    match st
        .service
        .for_tenant(&tenant)
        .write_stdin(&id, &cid, data, q.eof.unwrap_or(false))
        .await
    {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => HttpError(e).into_response(),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AttachQuery {
    /// Replay output from this offset of the combined view (default: 0).
    offset: Option<u64>,
}

/// A control message from an attach client (text frames).
#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
enum Control {
    Resize { rows: u16, cols: u16 },
    Eof,
    Signal { signal: serde_json::Value },
}

/// The subprotocol a browser offers (with its token, see `auth::WS_BEARER_PREFIX`)
/// and gets back; clients that set `Authorization` need not offer any.
const ATTACH_PROTOCOL: &str = "space.attach.v1";

/// `GET …/commands/{cid}/attach`: a WebSocket carrying input, output and resize.
///
/// Server → client: binary messages whose first byte is the stream (1 stdout, 2
/// stderr) followed by the bytes; at the end one text message
/// `{"type":"exit","state","result"}`, then close. Client → server: binary
/// messages are stdin bytes; text messages are JSON controls
/// `{"type":"resize","rows","cols"}`, `{"type":"eof"}`, `{"type":"signal","signal"}`.
pub async fn attach(
    ws: WebSocketUpgrade,
    State(st): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path((id, cid)): Path<(String, String)>,
    RawQuery(q): RawQuery,
) -> Response {
    let q: AttachQuery = match parse_query(q.as_deref()) {
        Ok(q) => q,
        Err(r) => return r.into_response(),
    };
    let query = CommandOutputQuery {
        offset: q.offset.unwrap_or(0),
        follow: true,
        view: View::Combined,
    };
    let output = match st
        .service
        .for_tenant(&principal.tenant)
        .command_output(&id, &cid, query)
    {
        Ok(rx) => rx,
        Err(e) => return HttpError(e).into_response(),
    };
    let svc = st.service.clone();
    ws.max_message_size(MAX_STDIN_BODY)
        .protocols([ATTACH_PROTOCOL])
        .on_upgrade(move |socket| attach_session(svc, principal, id, cid, socket, output))
}

async fn attach_session(
    svc: space_service::Service,
    principal: Principal,
    id: String,
    cid: String,
    socket: WebSocket,
    mut output: tokio::sync::mpsc::Receiver<OutputEvent>,
) {
    use futures::SinkExt;
    let (mut sink, mut input) = futures::StreamExt::split(socket);
    let revoked = svc.revoked(&principal);
    tokio::pin!(revoked);
    let svc = svc.for_tenant(&principal.tenant);
    loop {
        tokio::select! {
            _ = &mut revoked => {
                let msg = serde_json::json!({"type": "error", "message": "the API key was revoked"});
                let _ = sink.send(Message::Text(msg.to_string())).await;
                let _ = sink.send(Message::Close(None)).await;
                return;
            }
            ev = output.recv() => match ev {
                Some(OutputEvent::Chunk { stream, data, .. }) => {
                    let mut msg = Vec::with_capacity(data.len() + 1);
                    msg.push(if stream == Stream::Stdout { 1 } else { 2 });
                    msg.extend_from_slice(&data);
                    if sink.send(Message::Binary(msg)).await.is_err() {
                        return;
                    }
                }
                Some(OutputEvent::End(cmd)) => {
                    let end = serde_json::json!({
                        "type": "exit", "state": cmd.state, "result": cmd.result,
                        "lost_reason": cmd.lost_reason,
                    });
                    let _ = sink.send(Message::Text(end.to_string())).await;
                    let _ = sink.send(Message::Close(None)).await;
                    return;
                }
                None => {
                    let _ = sink.send(Message::Close(None)).await;
                    return;
                }
            },
            msg = futures::StreamExt::next(&mut input) => {
                let result = match msg {
                    Some(Ok(Message::Binary(data))) => {
                        svc.write_stdin(&id, &cid, Bytes::from(data), false).await
                    }
                    Some(Ok(Message::Text(text))) => match serde_json::from_str::<Control>(&text) {
                        Ok(Control::Resize { rows, cols }) => svc.resize(&id, &cid, rows, cols).await,
                        Ok(Control::Eof) => svc.write_stdin(&id, &cid, Bytes::new(), true).await,
                        Ok(Control::Signal { signal }) => match parse_signal(&signal) {
                            Some(sig) => svc.signal_command(&id, &cid, sig).await.map(|_| ()),
                            None => Err(space_service::ServiceError::BadRequest("unknown signal".into())),
                        },
                        Err(e) => Err(space_service::ServiceError::BadRequest(format!("bad control message: {e}"))),
                    },
                    Some(Ok(Message::Close(_))) | None => return,
                    Some(Ok(_)) => Ok(()),
                    Some(Err(_)) => return,
                };
                if let Err(e) = result {
                    let msg = serde_json::json!({"type": "error", "message": e.to_string()});
                    if sink.send(Message::Text(msg.to_string())).await.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hand-written chunk line is exactly an `OutputChunk`, for either stream,
    /// any offset and any bytes (empty, not UTF-8, a base64 tail of one or two).
    #[test]
    fn a_chunk_line_is_an_output_chunk() {
        for (stream, offset, data) in [
            (Stream::Stdout, 0, Vec::new()),
            (Stream::Stderr, u64::MAX, vec![0xff, 0, b'"', b'\\', b'\n']),
            (Stream::Stdout, 7, b"a".to_vec()),
            (Stream::Stdout, 1 << 40, (0..=255u8).collect()),
        ] {
            let line = ndjson_line(OutputEvent::Chunk {
                stream,
                offset,
                data: Bytes::from(data.clone()),
            });
            assert_eq!(line.last(), Some(&b'\n'));
            assert_eq!(line.iter().filter(|b| **b == b'\n').count(), 1);
            let got: space_api::OutputChunk = serde_json::from_slice(&line).unwrap();
            assert_eq!(got.stream, stream_name(stream));
            assert_eq!(got.offset, offset);
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(&got.data)
                .unwrap();
            assert_eq!(bytes, data);
        }
    }
}
