//! The host end of the agent protocol: a Unix socket per sandbox that the
//! agent dials, the handshake that authenticates it, and an HTTP/2 client on
//! the accepted connection. Everything read from the agent is hostile: lines
//! and bodies are bounded, and a protocol violation drops the connection.
//!
//! Anything inside a gVisor sandbox can connect to its socket, so what a sandbox can make
//! the server hold is bounded: one agent connection at a time (an authenticated newcomer,
//! which only the agent can be, since the token lives in its memory alone, replaces the
//! old one: a reconnecting agent always gets in), and at most [`MAX_HANDSHAKES`]
//! connections that have not said hello yet, each closed after [`HANDSHAKE_TIMEOUT`] or
//! when a newer one needs its place.
//!
//! Nothing waits on an agent forever: the connection is pinged while it is
//! open (an agent that stops answering is dropped, and the sandbox's monitor
//! fails the sandbox if it does not dial back in), and every request has a
//! deadline for its answer.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::future::{AbortHandle, Abortable};
use futures::stream::FuturesUnordered;
use http::{Method, Request, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame as BodyFrame, Incoming};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use serde::de::DeserializeOwned;
use serde::Serialize;
use space_agent::protocol::{self, ErrorBody, Hello, HelloReply};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixListener;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

/// Why a streamed request body to the agent ended early; the agent sees the
/// stream reset and discards what it got.
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;
pub type HostBody = UnsyncBoxBody<Bytes, BodyError>;

/// Numbers every agent connection of this process, so a new one is never
/// mistaken for an old one (even across listeners of the same sandbox).
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// How long a freshly accepted connection may take to say hello.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections of one sandbox in their handshake at once. The agent needs one; more only
/// come from something else in the sandbox. The oldest makes room for a new one: the agent
/// sends its hello as it connects, so its handshake ends as soon as it is accepted, and a
/// flood of silent connections only makes it dial again.
const MAX_HANDSHAKES: usize = 4;
/// The token's file in the run directory: the host deletes it once the agent's hello is
/// accepted (the agent cannot: the run directory is a read-only bind in its sandbox).
const TOKEN_FILE: &str = "token";
/// HTTP/2 flow-control windows and largest frame the host accepts from the agent.
const H2_STREAM_WINDOW: u32 = 4 << 20;
const H2_CONNECTION_WINDOW: u32 = 16 << 20;
const H2_MAX_FRAME: u32 = 1 << 20;
/// Largest JSON response accepted from an agent.
const MAX_AGENT_JSON: usize = 4 << 20;
/// An HTTP/2 ping goes to the agent this often, idle or not; one unanswered for
/// `PING_TIMEOUT` drops the connection. Generous: a TCG microVM under load is slow,
/// and a connection dropped for nothing costs only a reconnect.
const PING_INTERVAL: Duration = Duration::from_secs(10);
const PING_TIMEOUT: Duration = Duration::from_secs(20);
/// How long the agent may take to answer a request (its headers; a JSON answer
/// in full), file transfers aside. Spawning is the slowest: a fork and exec in a
/// loaded sandbox.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("the sandbox's agent is not connected")]
    NotConnected,
    #[error("the connection to the agent failed")]
    Connection(#[source] hyper::Error),
    #[error("the agent answered {status}: {message}")]
    Status { status: StatusCode, message: String },
    #[error("the agent sent an invalid response: {0}")]
    Protocol(String),
    #[error("the sandbox's agent did not answer within {}s", .0.as_secs())]
    Timeout(Duration),
}

/// One live, authenticated connection to a sandbox's agent.
#[derive(Clone)]
pub struct AgentConn {
    sender: SendRequest<HostBody>,
    pub generation: u64,
    /// Cancelling it closes the connection.
    close: tokio_util::sync::CancellationToken,
}

impl std::fmt::Debug for AgentConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentConn")
            .field("generation", &self.generation)
            .finish()
    }
}

impl AgentConn {
    /// Closes the connection now; the agent will dial again.
    pub fn close(&self) {
        self.close.cancel();
    }

    /// Sends one request as is; the caller reads the streamed response. No deadline:
    /// an upload's answer comes after its last byte, however large. The connection's
    /// pings bound it: an agent that stops answering them ends the request with an error.
    pub async fn send(
        &self,
        req: Request<HostBody>,
    ) -> Result<http::Response<Incoming>, AgentError> {
        let mut sender = self.sender.clone();
        sender.ready().await.map_err(AgentError::Connection)?;
        sender
            .send_request(req)
            .await
            .map_err(AgentError::Connection)
    }

    /// [`Self::send`] for a request whose answer (its headers) must come within
    /// [`REQUEST_TIMEOUT`]: everything but file transfers.
    async fn send_bounded(
        &self,
        req: Request<HostBody>,
    ) -> Result<http::Response<Incoming>, AgentError> {
        tokio::time::timeout(REQUEST_TIMEOUT, self.send(req))
            .await
            .unwrap_or(Err(AgentError::Timeout(REQUEST_TIMEOUT)))
    }

    /// A JSON request; non-2xx answers become [`AgentError::Status`].
    pub async fn json<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&impl Serialize>,
    ) -> Result<T, AgentError> {
        let bytes = match body {
            Some(b) => Bytes::from(serde_json::to_vec(b).unwrap_or_default()),
            None => Bytes::new(),
        };
        let req = Request::builder()
            .method(method)
            .uri(format!("http://agent{path}"))
            .header("content-type", "application/json")
            .body(
                Full::new(bytes)
                    .map_err(|never| match never {})
                    .boxed_unsync(),
            )
            .map_err(|e| AgentError::Protocol(e.to_string()))?;
        let resp = self.send_bounded(req).await?;
        let status = resp.status();
        let body = tokio::time::timeout(
            REQUEST_TIMEOUT,
            Limited::new(resp.into_body(), MAX_AGENT_JSON).collect(),
        )
        .await
        .map_err(|_| AgentError::Timeout(REQUEST_TIMEOUT))?
        .map_err(|e| AgentError::Protocol(format!("reading the response: {e}")))?
        .to_bytes();
        if !status.is_success() {
            let message = serde_json::from_slice::<ErrorBody>(&body)
                .map(|b| b.error.message)
                .unwrap_or_else(|_| String::from_utf8_lossy(&body[..body.len().min(200)]).into());
            return Err(AgentError::Status { status, message });
        }
        if body.is_empty() {
            return serde_json::from_slice(b"null")
                .map_err(|e| AgentError::Protocol(e.to_string()));
        }
        serde_json::from_slice(&body).map_err(|e| AgentError::Protocol(e.to_string()))
    }

    /// Opens the full-duplex attach stream of a command from the given offsets.
    /// Returns the sender for host frames and the body carrying agent frames.
    pub async fn attach(
        &self,
        command_id: &str,
        stdout: u64,
        stderr: u64,
    ) -> Result<(mpsc::Sender<Bytes>, Incoming), AgentError> {
        let (tx, rx) = mpsc::channel::<Bytes>(16);
        let stream = ReceiverStream::new(rx).map(|b| Ok::<_, BodyError>(BodyFrame::data(b)));
        let body = StreamBody::new(stream).boxed_unsync();
        let req = Request::builder()
            .method(Method::POST)
            .uri(format!(
                "http://agent/v1/commands/{command_id}/attach?stdout={stdout}&stderr={stderr}"
            ))
            .body(body)
            .map_err(|e| AgentError::Protocol(e.to_string()))?;
        let resp = self.send_bounded(req).await?;
        let status = resp.status();
        if !status.is_success() {
            let body = tokio::time::timeout(
                REQUEST_TIMEOUT,
                Limited::new(resp.into_body(), 64 * 1024).collect(),
            )
            .await
            .ok()
            .and_then(|r| r.ok())
            .map(|c| c.to_bytes())
            .unwrap_or_default();
            let message = serde_json::from_slice::<ErrorBody>(&body)
                .map(|b| b.error.message)
                .unwrap_or_default();
            return Err(AgentError::Status { status, message });
        }
        Ok((tx, resp.into_body()))
    }
}

/// Accepts the agent's connections on `socket` for as long as the returned
/// task runs, publishing the current connection on `conn`. Handshakes in progress end
/// with the task; an established connection outlives it (a listener is replaced while
/// the agent stays connected).
pub fn listen(
    sandbox_id: String,
    token: String,
    socket: &Path,
    conn: watch::Sender<Option<AgentConn>>,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    // Bind beside it and rename over it: the path never stops existing, because an
    // agent that saw it missing would be told so by gVisor's cache from then on.
    let tmp = socket.with_extension(format!("sock.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp)?;
    if let Err(e) = std::fs::rename(&tmp, socket) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    let token_file = socket.with_file_name(TOKEN_FILE);
    Ok(tokio::spawn(async move {
        // The handshakes run inside this task, so that a connection it drops is closed at
        // once, before the next one is accepted: the bound holds at every moment.
        let mut handshakes = FuturesUnordered::new();
        let mut oldest_first: VecDeque<(u64, AbortHandle)> = VecDeque::new();
        let mut next = 0u64;
        // Connections without a hello are the sandbox's doing: their log lines are
        // rate-limited (the 1st, 2nd, 4th, 8th, ...).
        let mut failed = 0u64;
        loop {
            tokio::select! {
                biased;
                Some(done) = handshakes.next(), if !handshakes.is_empty() => {
                    // Err: dropped for a newer connection (its socket is closed now).
                    if let Ok((n, outcome)) = done {
                        oldest_first.retain(|(i, _)| *i != n);
                        match outcome {
                            Ok(stream) => accepted_agent(stream, &sandbox_id, &token_file, &conn),
                            Err(reason) => {
                                failed += 1;
                                if failed.is_power_of_two() {
                                    tracing::warn!(sandbox = %sandbox_id, %reason, failed, "agent connection without a valid hello");
                                }
                            }
                        }
                    }
                }
                accepted = listener.accept() => {
                    let stream = match accepted {
                        Ok((s, _)) => s,
                        Err(e) => {
                            tracing::warn!(sandbox = %sandbox_id, error = %e, "accepting an agent connection failed");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    };
                    if oldest_first.len() >= MAX_HANDSHAKES {
                        if let Some((_, oldest)) = oldest_first.pop_front() {
                            oldest.abort();
                            failed += 1;
                            if failed.is_power_of_two() {
                                tracing::warn!(sandbox = %sandbox_id, failed, "too many agent connections without a hello; closing the oldest");
                            }
                        }
                    }
                    let (handle, registration) = AbortHandle::new_pair();
                    next += 1;
                    oldest_first.push_back((next, handle));
                    let (n, id, token) = (next, sandbox_id.clone(), token.clone());
                    handshakes.push(Abortable::new(
                        async move {
                            let outcome =
                                tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(stream, &id, &token))
                                    .await
                                    .unwrap_or_else(|_| Err("the handshake timed out".to_string()));
                            (n, outcome)
                        },
                        registration,
                    ));
                }
            }
        }
    }))
}

/// An agent that said hello: its token file goes, and its connection is served.
fn accepted_agent(
    stream: tokio::net::UnixStream,
    sandbox_id: &str,
    token_file: &Path,
    conn: &watch::Sender<Option<AgentConn>>,
) {
    // The agent has read it and keeps it in memory; nothing else may.
    if let Err(e) = std::fs::remove_file(token_file) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(sandbox = %sandbox_id, error = %e, "cannot delete the agent's token file");
        }
    }
    let gen = GENERATION.fetch_add(1, Ordering::SeqCst) + 1;
    let (id, conn) = (sandbox_id.to_owned(), conn.clone());
    // A task of its own: the connection outlives the listener.
    tokio::spawn(async move { serve_connection(stream, &id, gen, conn).await });
}

async fn handshake(
    mut stream: tokio::net::UnixStream,
    sandbox_id: &str,
    token: &str,
) -> Result<tokio::net::UnixStream, String> {
    let line = protocol::read_handshake_line(&mut stream)
        .await
        .map_err(|e| format!("reading hello: {e}"))?;
    let hello: Hello =
        serde_json::from_slice(&line).map_err(|e| format!("malformed hello: {e}"))?;
    let refusal = if hello.protocol != protocol::PROTOCOL_VERSION {
        Some(format!(
            "protocol {} is not supported (want {})",
            hello.protocol,
            protocol::PROTOCOL_VERSION
        ))
    } else if hello.sandbox_id != sandbox_id || !constant_time_eq(&hello.token, token) {
        Some("wrong sandbox id or token".to_string())
    } else {
        None
    };
    let reply = HelloReply {
        ok: refusal.is_none(),
        protocol: protocol::PROTOCOL_VERSION,
        error: refusal.clone(),
    };
    let mut line = serde_json::to_vec(&reply).unwrap_or_default();
    line.push(b'\n');
    stream
        .write_all(&line)
        .await
        .map_err(|e| format!("writing hello reply: {e}"))?;
    match refusal {
        Some(r) => Err(r),
        None => Ok(stream),
    }
}

async fn serve_connection(
    stream: tokio::net::UnixStream,
    sandbox_id: &str,
    generation: u64,
    conn: watch::Sender<Option<AgentConn>>,
) {
    // Big windows and frames: every frame is a syscall or two on each side, and
    // inside gVisor syscalls are what a transfer costs.
    let (sender, connection) = match hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(H2_STREAM_WINDOW)
        .initial_connection_window_size(H2_CONNECTION_WINDOW)
        .max_frame_size(H2_MAX_FRAME)
        .timer(TokioTimer::new())
        .keep_alive_interval(PING_INTERVAL)
        .keep_alive_timeout(PING_TIMEOUT)
        .keep_alive_while_idle(true)
        .handshake(TokioIo::new(stream))
        .await
    {
        Ok(pair) => pair,
        Err(e) => {
            tracing::warn!(sandbox = %sandbox_id, error = %e, "HTTP/2 handshake with the agent failed");
            return;
        }
    };
    tracing::info!(sandbox = %sandbox_id, generation, "agent connected");
    let close = tokio_util::sync::CancellationToken::new();
    // One connection at a time: the agent dialled again, so the old one is dead to it.
    let old = conn.send_replace(Some(AgentConn {
        sender,
        generation,
        close: close.clone(),
    }));
    if let Some(old) = old {
        tracing::info!(sandbox = %sandbox_id, generation = old.generation, "closing the agent's previous connection");
        old.close();
    }
    tokio::select! {
        r = connection => match r {
            Err(e) => tracing::info!(sandbox = %sandbox_id, generation, error = %e, "agent connection ended"),
            Ok(()) => tracing::info!(sandbox = %sandbox_id, generation, "agent connection closed"),
        },
        _ = close.cancelled() => {
            tracing::info!(sandbox = %sandbox_id, generation, "agent connection closed by the server");
        }
    }
    conn.send_if_modified(|current| match current {
        Some(c) if c.generation == generation => {
            *current = None;
            true
        }
        _ => false,
    });
}

fn constant_time_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Waits for a connection on `rx`, at most `timeout`.
pub async fn wait_connected(
    rx: &mut watch::Receiver<Option<AgentConn>>,
    timeout: Duration,
) -> Result<AgentConn, AgentError> {
    let wait = rx.wait_for(|c| c.is_some());
    match tokio::time::timeout(timeout, wait).await {
        Ok(Ok(c)) => c.clone().ok_or(AgentError::NotConnected),
        _ => Err(AgentError::NotConnected),
    }
}
