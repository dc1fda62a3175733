//! The per-sandbox Unix socket the agent dials, and the handshake that authenticates it.
//!
//! Anything inside a gVisor sandbox can connect to its socket, so what a sandbox can make
//! the server hold is bounded: one agent connection at a time (an authenticated newcomer,
//! which only the agent can be, since the token lives in its memory alone, replaces the
//! old one: a reconnecting agent always gets in), and at most [`MAX_HANDSHAKES`]
//! connections that have not said hello yet, each closed after its hello timeout
//! ([`HANDSHAKE_TIMEOUT`] unless the runtime says otherwise) or when a newer one needs its
//! place.

use std::collections::VecDeque;
use std::path::Path;
use std::time::Duration;

use futures::future::{AbortHandle, Abortable};
use futures::stream::FuturesUnordered;
use space_agent::protocol::{self, Hello, HelloReply};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::StreamExt;

use crate::conn::AgentConn;
use crate::error::{AgentError, Retry};

/// How long a freshly accepted connection may take to say hello, where anything in the
/// sandbox can connect (gVisor). A runtime whose socket only its hypervisor dials gives
/// its own ([`listen`]'s `hello_timeout`).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections of one sandbox in their handshake at once. The agent needs one; more only
/// come from something else in the sandbox. The oldest makes room for a new one: the agent
/// sends its hello as it connects, so its handshake ends as soon as it is accepted, and a
/// flood of silent connections only makes it dial again.
pub const MAX_HANDSHAKES: usize = 4;
/// The token's file in the run directory: the host deletes it once the agent's hello is
/// accepted (the agent cannot: the run directory is a read-only bind in its sandbox).
const TOKEN_FILE: &str = "token";

/// Why a connection was not taken as the agent's.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The connection ended, or sent too long a line, before its hello.
    #[error("reading the hello failed")]
    Read(#[source] std::io::Error),
    #[error("the hello is not valid: {0}")]
    Malformed(String),
    /// Refused (and told so): another protocol version, or the wrong sandbox or token.
    #[error("hello refused: {0}")]
    Refused(String),
    #[error("writing the hello reply failed")]
    Write(#[source] std::io::Error),
    #[error("the handshake timed out")]
    Timeout,
}

/// Reads the agent's hello from `stream` and answers it: accepted only with this
/// protocol version, `sandbox_id` and `token` (compared in constant time). Returns the
/// hello; the stream then carries HTTP/2 ([`AgentConn::start`]).
pub async fn handshake<S>(
    stream: &mut S,
    sandbox_id: &str,
    token: &str,
) -> Result<Hello, HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let line = protocol::read_handshake_line(stream)
        .await
        .map_err(HandshakeError::Read)?;
    let hello: Hello =
        serde_json::from_slice(&line).map_err(|e| HandshakeError::Malformed(e.to_string()))?;
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
        .map_err(HandshakeError::Write)?;
    match refusal {
        Some(r) => Err(HandshakeError::Refused(r)),
        None => Ok(hello),
    }
}

/// Agent connections accepted by every listener of this process, and those of them
/// that replaced an earlier connection of the same sandbox (see [`connection_counts`]).
static CONNECTIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static RECONNECTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// (connections, reconnects) accepted so far by this process's listeners.
pub fn connection_counts() -> (u64, u64) {
    (
        CONNECTIONS.load(std::sync::atomic::Ordering::Relaxed),
        RECONNECTS.load(std::sync::atomic::Ordering::Relaxed),
    )
}

/// Accepts the agent's connections on `socket` for as long as the returned task runs,
/// publishing the current connection on `conn`. Handshakes in progress end with the
/// task; an established connection outlives it (a listener is replaced while the agent
/// stays connected). The `token` file beside the socket is deleted once an agent's hello
/// is accepted. A connection that has not said hello within `hello_timeout` is closed.
pub fn listen(
    sandbox_id: String,
    token: String,
    socket: &Path,
    conn: watch::Sender<Option<AgentConn>>,
    hello_timeout: Duration,
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
        // Agents that said hello to this listener: past the first, each is a reconnect.
        let mut hellos = 0u64;
        loop {
            tokio::select! {
                biased;
                Some(done) = handshakes.next(), if !handshakes.is_empty() => {
                    // Err: dropped for a newer connection (its socket is closed now).
                    if let Ok((n, outcome)) = done {
                        oldest_first.retain(|(i, _)| *i != n);
                        match outcome {
                            Ok((stream, hello)) => {
                                hellos += 1;
                                CONNECTIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                if hellos > 1 {
                                    RECONNECTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                }
                                accepted_agent(stream, hello, &sandbox_id, &token_file, &conn)
                            }
                            Err(reason) => {
                                failed += 1;
                                if failed.is_power_of_two() {
                                    tracing::warn!(sandbox = %sandbox_id, reason = %error_chain(&reason), failed, "agent connection without a valid hello");
                                }
                            }
                        }
                    }
                }
                accepted = listener.accept() => {
                    let mut stream = match accepted {
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
                                tokio::time::timeout(hello_timeout, handshake(&mut stream, &id, &token))
                                    .await
                                    .unwrap_or(Err(HandshakeError::Timeout))
                                    .map(|hello| (stream, hello));
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
    hello: Hello,
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
    let (id, conn) = (sandbox_id.to_owned(), conn.clone());
    // A task of its own: the connection outlives the listener.
    tokio::spawn(async move { serve_connection(stream, &hello, &id, conn).await });
}

async fn serve_connection(
    stream: tokio::net::UnixStream,
    hello: &Hello,
    sandbox_id: &str,
    conn: watch::Sender<Option<AgentConn>>,
) {
    let agent = match AgentConn::start(stream, sandbox_id, &hello.agent_version).await {
        Ok(c) => c.with_features(&hello.features),
        Err(e) => {
            tracing::warn!(sandbox = %sandbox_id, error = %error_chain(&e), "HTTP/2 handshake with the agent failed");
            return;
        }
    };
    let generation = agent.generation();
    tracing::info!(sandbox = %sandbox_id, generation, agent_version = %agent.agent_version(), "agent connected");
    // One connection at a time: the agent dialled again, so the old one is dead to it.
    if let Some(old) = conn.send_replace(Some(agent.clone())) {
        tracing::info!(sandbox = %sandbox_id, generation = old.generation(), "closing the agent's previous connection");
        old.close();
    }
    agent.closed().await;
    conn.send_if_modified(|current| match current {
        Some(c) if c.generation() == generation => {
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

/// Waits for a connection on `rx`, at most `timeout`. One that has ended is not taken,
/// even before the server has let it go: the agent's next one is on its way.
pub async fn wait_connected(
    rx: &mut watch::Receiver<Option<AgentConn>>,
    timeout: Duration,
) -> Result<AgentConn, AgentError> {
    let wait = rx.wait_for(|c| c.as_ref().is_some_and(|c| !c.is_closed()));
    match tokio::time::timeout(timeout, wait).await {
        Ok(Ok(c)) => c.clone().ok_or(AgentError::NotConnected),
        _ => Err(AgentError::NotConnected),
    }
}

/// Waits for a connection on `rx` other than the one numbered `generation` (the agent's
/// next connection after that one broke), at most `timeout`.
pub async fn wait_reconnected(
    rx: &mut watch::Receiver<Option<AgentConn>>,
    generation: u64,
    timeout: Duration,
) -> Result<AgentConn, AgentError> {
    let wait = rx.wait_for(|c| c.as_ref().is_some_and(|c| c.generation() != generation));
    match tokio::time::timeout(timeout, wait).await {
        Ok(Ok(c)) => c.clone().ok_or(AgentError::NotConnected),
        _ => Err(AgentError::NotConnected),
    }
}

/// Makes a one-shot call (`call`, named `name` in the log) on the connection `rx` holds,
/// waiting at most `timeout` for one; when the connection fails under it in a way `retry`
/// allows ([`AgentError::may_retry`]), once more on the agent's next connection (at most
/// `timeout` again). An agent whose connection broke (its host stalled past its pings,
/// or a link that dropped) dials again within milliseconds: a caller should not hear
/// of that. Without a next connection, the first failure is the answer.
///
/// The log line of a call made again names the call and whether the first one went out
/// (`went_out=false`: the connection had ended before it was sent, which any call may
/// meet just after a break, before the server has taken the connection down).
pub async fn call_again_on_break<T, F, Fut>(
    rx: &mut watch::Receiver<Option<AgentConn>>,
    timeout: Duration,
    retry: Retry,
    name: &'static str,
    mut call: F,
) -> Result<T, AgentError>
where
    F: FnMut(AgentConn) -> Fut,
    Fut: std::future::Future<Output = Result<T, AgentError>>,
{
    let conn = wait_connected(rx, timeout).await?;
    let generation = conn.generation();
    match call(conn).await {
        Err(e) if e.may_retry(retry) => {
            let went_out = !matches!(e, AgentError::NotSent(_));
            tracing::info!(generation, call = %name, went_out, error = %error_chain(&e), "an agent call failed with its connection; making it again on the next one");
            match wait_reconnected(rx, generation, timeout).await {
                Ok(next) => call(next).await,
                Err(_) => Err(e),
            }
        }
        r => r,
    }
}

/// `e` and its sources, for a log line.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
    use std::sync::Arc;
    use tokio::io::AsyncReadExt;

    async fn hello_exchange(hello: &[u8]) -> (Result<Hello, HandshakeError>, Vec<u8>) {
        let (mut host, mut agent) = tokio::io::duplex(8192);
        agent.write_all(hello).await.unwrap();
        agent.shutdown().await.unwrap();
        let r = handshake(&mut host, "sb_1", "tok").await;
        drop(host);
        let mut reply = Vec::new();
        agent.read_to_end(&mut reply).await.unwrap();
        (r, reply)
    }

    fn hello(protocol: u32, id: &str, token: &str) -> Vec<u8> {
        let mut v = serde_json::to_vec(&Hello {
            protocol,
            sandbox_id: id.into(),
            token: token.into(),
            agent_version: "1".into(),
            features: Vec::new(),
        })
        .unwrap();
        v.push(b'\n');
        v
    }

    fn reply(bytes: &[u8]) -> HelloReply {
        assert_eq!(bytes.last(), Some(&b'\n'));
        serde_json::from_slice(&bytes[..bytes.len() - 1]).unwrap()
    }

    #[tokio::test]
    async fn the_right_hello_is_accepted() {
        let (r, out) = hello_exchange(&hello(protocol::PROTOCOL_VERSION, "sb_1", "tok")).await;
        assert_eq!(r.unwrap().agent_version, "1");
        assert!(reply(&out).ok);
    }

    #[tokio::test]
    async fn a_wrong_hello_is_refused_and_told() {
        for h in [
            hello(protocol::PROTOCOL_VERSION, "sb_2", "tok"),
            hello(protocol::PROTOCOL_VERSION, "sb_1", "tok2"),
            hello(protocol::PROTOCOL_VERSION, "sb_1", "to"),
            hello(protocol::PROTOCOL_VERSION + 1, "sb_1", "tok"),
        ] {
            let (r, out) = hello_exchange(&h).await;
            assert!(matches!(r, Err(HandshakeError::Refused(_))), "{r:?}");
            let reply = reply(&out);
            assert!(!reply.ok && reply.error.is_some());
        }
    }

    #[tokio::test]
    async fn garbage_gets_no_answer() {
        let (r, out) = hello_exchange(b"not json\n").await;
        assert!(matches!(r, Err(HandshakeError::Malformed(_))), "{r:?}");
        assert!(out.is_empty());
        // A line past the bound, and a connection that ends before its newline.
        let (r, _) = hello_exchange(&vec![b'x'; protocol::MAX_HANDSHAKE_BYTES + 1]).await;
        assert!(matches!(r, Err(HandshakeError::Read(_))), "{r:?}");
        let (r, _) = hello_exchange(b"{\"protocol\":1").await;
        assert!(matches!(r, Err(HandshakeError::Read(_))), "{r:?}");
    }

    /// An agent on `io`, served by real HTTP/2: it counts the requests it gets and
    /// answers each 204, or, with `breaks`, drops the connection at its first request
    /// without answering (as an agent whose link broke under a call).
    fn fake_agent(io: tokio::io::DuplexStream, breaks: bool) -> Arc<AtomicUsize> {
        use hyper_util::rt::{TokioExecutor, TokioIo};
        let served = Arc::new(AtomicUsize::new(0));
        let (drop_tx, mut drop_rx) = tokio::sync::mpsc::channel::<()>(1);
        let count = served.clone();
        let svc = hyper::service::service_fn(move |_req| {
            let (count, drop_tx) = (count.clone(), drop_tx.clone());
            async move {
                count.fetch_add(1, AtomicOrdering::SeqCst);
                if breaks {
                    let _ = drop_tx.send(()).await;
                    std::future::pending::<()>().await;
                }
                let empty = http_body_util::Empty::<bytes::Bytes>::new();
                Ok::<_, std::convert::Infallible>(
                    http::Response::builder().status(204).body(empty).unwrap(),
                )
            }
        });
        let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .serve_connection(TokioIo::new(io), svc);
        tokio::spawn(async move {
            tokio::select! {
                _ = conn => {}
                _ = drop_rx.recv() => {}
            }
        });
        served
    }

    /// A host connection to a [`fake_agent`].
    async fn connected(breaks: bool) -> (AgentConn, Arc<AtomicUsize>) {
        let (host, agent) = tokio::io::duplex(1 << 16);
        let served = fake_agent(agent, breaks);
        let conn = AgentConn::start(host, "sb_1", "test").await.unwrap();
        (conn, served)
    }

    /// What the listener does: once `first` has ended, the agent's next connection.
    fn redial_after(tx: watch::Sender<Option<AgentConn>>, first: AgentConn, next: AgentConn) {
        tokio::spawn(async move {
            first.closed().await;
            tx.send_replace(Some(next));
            // The sender lives as long as the test needs it.
            std::future::pending::<()>().await;
        });
    }

    const WAIT: Duration = Duration::from_secs(10);

    /// A signal through [`call_again_on_break`], made on `first` and, when the agent
    /// dials again after `first` ended, on `next`.
    async fn signal_across(
        first: AgentConn,
        next: AgentConn,
        retry: Retry,
    ) -> Result<(), AgentError> {
        let (tx, mut rx) = watch::channel(Some(first.clone()));
        redial_after(tx, first, next);
        call_again_on_break(&mut rx, WAIT, retry, "signal", |c| async move {
            c.signal("cmd_1", 9).await
        })
        .await
    }

    #[tokio::test]
    async fn a_call_whose_connection_breaks_is_made_again_on_the_next_when_it_may_be() {
        // Repeatable (a signal): sent again on the next connection, and answered there.
        let (first, first_served) = connected(true).await;
        let (next, next_served) = connected(false).await;
        let r = signal_across(first, next, Retry::Repeatable).await;
        assert!(r.is_ok(), "{r:?}");
        assert_eq!(first_served.load(AtomicOrdering::SeqCst), 1);
        assert_eq!(next_served.load(AtomicOrdering::SeqCst), 1);

        // IfNotSent (a rename): the first agent got it, so it is not made again; the
        // caller hears of the break.
        let (first, first_served) = connected(true).await;
        let (next, next_served) = connected(false).await;
        let r = signal_across(first, next, Retry::IfNotSent).await;
        assert!(matches!(r, Err(AgentError::Connection(_))), "{r:?}");
        assert_eq!(first_served.load(AtomicOrdering::SeqCst), 1);
        assert_eq!(next_served.load(AtomicOrdering::SeqCst), 0);
    }

    #[tokio::test]
    async fn a_call_that_never_went_out_is_made_on_the_next_connection_whatever_it_is() {
        // The connection has ended by the time the call is made: nothing went out.
        let (first, first_served) = connected(false).await;
        first.close();
        first.closed().await;
        let alone = first.signal("cmd_1", 9).await;
        assert!(matches!(alone, Err(AgentError::NotSent(_))), "{alone:?}");
        assert!(alone.unwrap_err().may_retry(Retry::IfNotSent));
        // One that ended is not taken, though the listener has not let it go yet.
        let (_tx, mut rx) = watch::channel(Some(first.clone()));
        let r = wait_connected(&mut rx, Duration::from_millis(300)).await;
        assert!(matches!(r, Err(AgentError::NotConnected)), "{r:?}");

        // It ends between being taken and the call going out: made on the next one.
        let (first, first_served_too) = connected(false).await;
        let (next, next_served) = connected(false).await;
        let (tx, mut rx) = watch::channel(Some(first.clone()));
        redial_after(tx, first.clone(), next);
        let ends = first.generation();
        let r = call_again_on_break(&mut rx, WAIT, Retry::IfNotSent, "signal", |c| async move {
            if c.generation() == ends {
                c.close();
                c.closed().await;
            }
            c.signal("cmd_1", 9).await
        })
        .await;
        assert!(r.is_ok(), "{r:?}");
        assert_eq!(first_served.load(AtomicOrdering::SeqCst), 0);
        assert_eq!(first_served_too.load(AtomicOrdering::SeqCst), 0);
        assert_eq!(next_served.load(AtomicOrdering::SeqCst), 1);
    }

    #[tokio::test]
    async fn without_a_next_connection_the_first_failure_is_the_answer() {
        let (first, _) = connected(true).await;
        let (_tx, mut rx) = watch::channel(Some(first));
        let r = call_again_on_break(
            &mut rx,
            Duration::from_millis(300),
            Retry::Repeatable,
            "signal",
            |c| async move { c.signal("cmd_1", 9).await },
        )
        .await;
        assert!(matches!(r, Err(AgentError::Connection(_))), "{r:?}");
        // An answer, a refusal or silence is never a reason to ask again.
        assert!(!AgentError::Timeout(WAIT).may_retry(Retry::Repeatable));
        assert!(!AgentError::NotConnected.may_retry(Retry::Repeatable));
        assert!(!AgentError::Protocol("x".into()).may_retry(Retry::Repeatable));
    }

    #[test]
    fn tokens_compare_by_content() {
        assert!(constant_time_eq("abc", "abc"));
        assert!(!constant_time_eq("abc", "abd"));
        assert!(!constant_time_eq("abc", "ab"));
    }
}
