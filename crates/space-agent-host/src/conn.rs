//! One authenticated connection to an agent: HTTP/2 with the host as the client, pinged
//! while it is open, and the request plumbing every typed call shares (deadlines, bounded
//! reads of answers, error answers made typed).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame as BodyFrame, Incoming};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::CancellationToken;

use crate::error::{refusal, AgentError, BodyError};

/// A request body for the agent. Build one with [`HostBody::from`] (bytes) or
/// [`body_from_stream`].
pub type HostBody = UnsyncBoxBody<Bytes, BodyError>;

/// Numbers every agent connection of this process, so a new one is never mistaken for
/// an old one (even across listeners of the same sandbox).
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// HTTP/2 flow-control windows and largest frame the host accepts from the agent.
const H2_STREAM_WINDOW: u32 = 4 << 20;
const H2_CONNECTION_WINDOW: u32 = 16 << 20;
const H2_MAX_FRAME: u32 = 1 << 20;
/// An HTTP/2 ping goes to the agent this often, idle or not; one unanswered for
/// `PING_TIMEOUT` drops the connection. Generous: a TCG microVM under load is slow,
/// and a connection dropped for nothing costs only a reconnect.
pub const PING_INTERVAL: Duration = Duration::from_secs(10);
pub const PING_TIMEOUT: Duration = Duration::from_secs(20);
/// How long the agent may take to answer a request (its headers; a JSON answer in full),
/// file calls aside. Spawning is the slowest: a fork and exec in a loaded sandbox.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest JSON answer accepted from an agent (file listings aside).
pub const MAX_AGENT_JSON: usize = 4 << 20;
/// Largest error answer read from an agent.
pub const MAX_AGENT_ERROR: usize = 64 << 10;

/// A body of `bytes`.
pub fn body_from_bytes(bytes: impl Into<Bytes>) -> HostBody {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// A body streamed from `stream`; an error item resets the request (the agent sees
/// the stream end abnormally and discards what it got).
pub fn body_from_stream<S>(stream: S) -> HostBody
where
    S: futures::Stream<Item = Result<Bytes, BodyError>> + Send + 'static,
{
    use futures::StreamExt;
    StreamBody::new(stream.map(|r| r.map(BodyFrame::data))).boxed_unsync()
}

/// One live, authenticated connection to a sandbox's agent. Clones share it.
#[derive(Clone)]
pub struct AgentConn {
    sender: SendRequest<HostBody>,
    generation: u64,
    agent_version: Arc<str>,
    /// The agent takes input with offsets and reports what it took
    /// ([`space_agent::protocol::FEATURE_INPUT_OFFSETS`]).
    input_offsets: bool,
    /// Cancelling it closes the connection.
    close: CancellationToken,
    /// Cancelled once the connection has ended, however it ended.
    ended: CancellationToken,
}

impl std::fmt::Debug for AgentConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentConn")
            .field("generation", &self.generation)
            .finish()
    }
}

impl AgentConn {
    /// Speaks HTTP/2 (host as the client) on `io`, an agent's connection after its
    /// accepted hello, and serves the connection in a task of its own. `sandbox_id`
    /// names it in logs.
    pub async fn start<IO>(
        io: IO,
        sandbox_id: &str,
        agent_version: &str,
    ) -> Result<AgentConn, AgentError>
    where
        IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        // Big windows and frames: every frame is a syscall or two on each side, and
        // inside gVisor syscalls are what a transfer costs.
        let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .initial_stream_window_size(H2_STREAM_WINDOW)
            .initial_connection_window_size(H2_CONNECTION_WINDOW)
            .max_frame_size(H2_MAX_FRAME)
            .timer(TokioTimer::new())
            .keep_alive_interval(PING_INTERVAL)
            .keep_alive_timeout(PING_TIMEOUT)
            .keep_alive_while_idle(true)
            .handshake(TokioIo::new(io))
            .await
            .map_err(AgentError::Connection)?;
        let generation = GENERATION.fetch_add(1, Ordering::SeqCst) + 1;
        let conn = AgentConn {
            sender,
            generation,
            // Bounded: the hello line it came in is.
            agent_version: Arc::from(crate::error::truncate(agent_version, 128)),
            input_offsets: false,
            close: CancellationToken::new(),
            ended: CancellationToken::new(),
        };
        let (close, ended, id) = (
            conn.close.clone(),
            conn.ended.clone(),
            sandbox_id.to_owned(),
        );
        tokio::spawn(async move {
            tokio::select! {
                r = connection => match r {
                    Err(e) => tracing::info!(sandbox = %id, generation, error = %e, "agent connection ended"),
                    Ok(()) => tracing::info!(sandbox = %id, generation, "agent connection closed"),
                },
                _ = close.cancelled() => {
                    tracing::info!(sandbox = %id, generation, "agent connection closed by the server");
                }
            }
            ended.cancel();
        });
        Ok(conn)
    }

    /// Numbers the connections of this process: a later connection has a larger one.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The version the agent gave in its hello (at most 128 bytes).
    pub fn agent_version(&self) -> &str {
        &self.agent_version
    }

    /// Takes note of the features the agent named in its hello; unknown ones are ignored.
    pub fn with_features(mut self, features: &[String]) -> AgentConn {
        self.input_offsets = features
            .iter()
            .any(|f| f == space_agent::protocol::FEATURE_INPUT_OFFSETS);
        self
    }

    /// Whether the agent takes input with offsets and reports what it took
    /// ([`AgentConn::attach_with_input`]); agents from before it do not.
    pub fn input_offsets(&self) -> bool {
        self.input_offsets
    }

    /// Closes the connection now, as a crashing host would; the agent will dial again.
    pub fn close(&self) {
        self.close.cancel();
    }

    /// Waits until the connection has ended (closed by either side, or failed).
    pub async fn closed(&self) {
        self.ended.cancelled().await
    }

    /// Whether the connection has ended.
    pub fn is_closed(&self) -> bool {
        self.ended.is_cancelled()
    }

    /// Sends one request as is; the caller reads the streamed answer. No deadline: an
    /// upload's answer comes after its last byte, however large. The connection's pings
    /// bound it: an agent that stops answering them ends the request with an error.
    pub(crate) async fn send(
        &self,
        req: Request<HostBody>,
    ) -> Result<Response<Incoming>, AgentError> {
        let mut sender = self.sender.clone();
        // Either failure before the request went out says so (`NotSent`): the caller may
        // then make it again on the next connection, whatever it is.
        sender.ready().await.map_err(AgentError::NotSent)?;
        sender.try_send_request(req).await.map_err(|mut e| {
            if e.take_message().is_some() {
                AgentError::NotSent(e.into_error())
            } else {
                AgentError::Connection(e.into_error())
            }
        })
    }

    /// [`Self::send`] for `method uri` with `body`, its answer's headers within `deadline`
    /// when there is one.
    pub(crate) async fn request(
        &self,
        method: Method,
        path_and_query: &str,
        content_type: Option<&'static str>,
        body: HostBody,
        deadline: Option<Duration>,
    ) -> Result<Response<Incoming>, AgentError> {
        let mut req = Request::builder()
            .method(method)
            .uri(format!("http://agent{path_and_query}"));
        if let Some(ct) = content_type {
            req = req.header(http::header::CONTENT_TYPE, ct);
        }
        let req = req
            .body(body)
            .map_err(|e| AgentError::Request(e.to_string()))?;
        match deadline {
            None => self.send(req).await,
            Some(d) => tokio::time::timeout(d, self.send(req))
                .await
                .unwrap_or(Err(AgentError::Timeout(d))),
        }
    }

    /// A call whose answer is JSON: `T` from a 2xx answer of at most `max` bytes, a
    /// [`AgentError::Refused`] from any other. With `deadline`, the whole answer must
    /// come within it.
    pub(crate) async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path_and_query: &str,
        body: Option<&impl Serialize>,
        max: usize,
        deadline: Option<Duration>,
    ) -> Result<T, AgentError> {
        let (content_type, body) = match body {
            Some(b) => (
                Some("application/json"),
                body_from_bytes(
                    serde_json::to_vec(b).map_err(|e| AgentError::Request(e.to_string()))?,
                ),
            ),
            None => (None, body_from_bytes(Bytes::new())),
        };
        let resp = self
            .request(method, path_and_query, content_type, body, deadline)
            .await?;
        let resp = success(resp).await?;
        let bytes = read_bounded(resp.into_body(), max, deadline).await?;
        parse_json(&bytes)
    }
}

/// The answer itself when it is a success; its error, read boundedly, as a
/// [`AgentError::Refused`] when not.
pub(crate) async fn success(resp: Response<Incoming>) -> Result<Response<Incoming>, AgentError> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    // What cannot be read of it in time or in size is left out: the status still counts.
    let body = read_bounded(resp.into_body(), MAX_AGENT_ERROR, Some(REQUEST_TIMEOUT))
        .await
        .unwrap_or_default();
    Err(refusal(status, &body))
}

/// All of `body`, at most `max` bytes, within `deadline` if there is one.
pub(crate) async fn read_bounded<B>(
    body: B,
    max: usize,
    deadline: Option<Duration>,
) -> Result<Bytes, AgentError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BodyError>,
{
    let read = Limited::new(body, max).collect();
    let collected = match deadline {
        None => read.await,
        Some(d) => tokio::time::timeout(d, read)
            .await
            .map_err(|_| AgentError::Timeout(d))?,
    };
    match collected {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(AgentError::Protocol(format!(
            "its answer is larger than {max} bytes"
        ))),
        Err(e) => Err(AgentError::Broken(e)),
    }
}

/// `T` from a JSON answer; an empty answer reads as `null`.
pub(crate) fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, AgentError> {
    let bytes = if bytes.is_empty() { b"null" } else { bytes };
    serde_json::from_slice(bytes).map_err(|e| AgentError::Protocol(e.to_string()))
}

/// Percent-encodes `s` for a URI path segment or query value: everything but the
/// unreserved characters (the agent reads `+` as a space, so it is encoded too).
pub(crate) fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Percent-encodes a path segment: as [`encode`], `/` included.
pub(crate) fn encode_segment(s: &str) -> String {
    encode(s).replace('/', "%2F")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_encoded_for_the_agents_decoder() {
        assert_eq!(encode("/a b&c=d+e%f"), "/a%20b%26c%3Dd%2Be%25f");
        assert_eq!(encode("/é"), "/%C3%A9");
        assert_eq!(encode("/x?y#z"), "/x%3Fy%23z");
        assert_eq!(encode_segment("../a/b"), "..%2Fa%2Fb");
        assert_eq!(encode_segment("cmd_1-x"), "cmd_1-x");
    }

    #[tokio::test]
    async fn reads_are_bounded_in_size() {
        let body = Full::new(Bytes::from(vec![b'x'; 100]));
        assert_eq!(read_bounded(body, 100, None).await.unwrap().len(), 100);
        let body = Full::new(Bytes::from(vec![b'x'; 101]));
        assert!(matches!(
            read_bounded(body, 100, None).await,
            Err(AgentError::Protocol(_))
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn reads_are_bounded_in_time() {
        // A body that never ends.
        let body = StreamBody::new(futures::stream::pending::<
            Result<BodyFrame<Bytes>, BodyError>,
        >());
        let r = read_bounded(body, 100, Some(Duration::from_secs(3))).await;
        assert!(matches!(r, Err(AgentError::Timeout(d)) if d.as_secs() == 3));
    }

    #[tokio::test]
    async fn a_body_that_breaks_is_an_error() {
        let items: Vec<Result<BodyFrame<Bytes>, BodyError>> = vec![
            Ok(BodyFrame::data(Bytes::from_static(b"ab"))),
            Err("reset".into()),
        ];
        let body = StreamBody::new(futures::stream::iter(items));
        assert!(matches!(
            read_bounded(body, 100, None).await,
            Err(AgentError::Broken(_))
        ));
    }

    #[test]
    fn json_answers() {
        assert_eq!(parse_json::<Option<u32>>(b"").unwrap(), None);
        assert_eq!(parse_json::<u32>(b"7").unwrap(), 7);
        assert!(matches!(
            parse_json::<u32>(b"{"),
            Err(AgentError::Protocol(_))
        ));
    }
}
