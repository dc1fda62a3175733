//! The HTTP listener: hyper's HTTP/1.1 server with the bounds a server that faces
//! untrusted clients needs, which `axum::serve` does not set.
//!
//! - A request head must arrive within [`Bounds::header_read_timeout`] of the
//!   connection's start (or of the previous response, on a kept-alive connection);
//!   a client that sends half a head and stalls is dropped.
//! - A request body that stalls for [`Bounds::body_idle_timeout`] between two chunks
//!   ends the request with an error.
//! - One client address holds at most [`Bounds::max_connections_per_ip`]
//!   connections; past it a new connection gets a fixed `429` and is closed at
//!   once, without reading anything.
//! - Accept errors (out of file descriptors) back off instead of spinning.
//! - A response given without reading the request's body to its end (a 401, a 404, a
//!   413 from the declared length) says `Connection: close`. hyper closes such a
//!   connection anyway once the unread body is not already buffered; without the header
//!   a keep-alive client sends its next request on a connection about to close and
//!   gets no answer at all.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tower::ServiceExt;

/// What a client may hold.
#[derive(Debug, Clone)]
pub struct Bounds {
    pub header_read_timeout: Duration,
    pub body_idle_timeout: Duration,
    pub max_connections_per_ip: usize,
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds {
            header_read_timeout: Duration::from_secs(10),
            body_idle_timeout: Duration::from_secs(60),
            max_connections_per_ip: 256,
        }
    }
}

/// Connections per client address.
#[derive(Default)]
struct PerIp(Mutex<HashMap<IpAddr, usize>>);

struct Held {
    table: Arc<PerIp>,
    ip: IpAddr,
}

impl PerIp {
    fn hold(table: &Arc<PerIp>, ip: IpAddr, max: usize) -> Option<Held> {
        let mut map = table.0.lock().unwrap_or_else(|p| p.into_inner());
        let n = map.entry(ip).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Held {
            table: table.clone(),
            ip,
        })
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut map = self.table.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = map.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.ip);
            }
        }
    }
}

/// The answer to a connection past its address's limit, written without reading.
fn too_many(max: usize) -> Bytes {
    let body = serde_json::json!({"error": {
        "code": "too_many_requests",
        "message": format!("too many connections from this address: the limit is {max}"),
    }})
    .to_string();
    Bytes::from(format!(
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    ))
}

/// Refused connections closed gracefully at once (the others are closed outright).
const REFUSALS_IN_FLIGHT: usize = 4;

/// How long a shutdown waits for requests in flight.
const DRAIN: Duration = Duration::from_secs(5);

/// Serves `app` on `listener` until `shutdown` resolves, then gives the requests in
/// flight up to [`DRAIN`] to finish.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    bounds: Bounds,
    shutdown: impl Future<Output = ()>,
) {
    let per_ip = Arc::new(PerIp::default());
    let refusal = too_many(bounds.max_connections_per_ip);
    let refusing = Arc::new(tokio::sync::Semaphore::new(REFUSALS_IN_FLIGHT));
    let tracker = tokio_util::task::TaskTracker::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(bounds.header_read_timeout);
    let builder = Arc::new(builder);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // EMFILE/ENFILE: others must let go of descriptors first.
                    tracing::warn!(error = %e, "accepting a connection failed; backing off");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let Some(held) = PerIp::hold(&per_ip, peer.ip(), bounds.max_connections_per_ip) else {
            // Refusals hold descriptors too: a few at a time get a graceful close, the
            // rest the answer written at once (it fits in the socket's buffer) and an
            // immediate close, so a flood never holds more than the cap plus these.
            match refusing.clone().try_acquire_owned() {
                Ok(slot) => {
                    let refusal = refusal.clone();
                    tokio::spawn(async move {
                        let _slot = slot;
                        let mut stream = stream;
                        let _ = tokio::time::timeout(
                            Duration::from_secs(2),
                            stream.write_all(&refusal),
                        )
                        .await;
                        let _ = stream.shutdown().await;
                    });
                }
                Err(_) => {
                    let _ = stream.try_write(&refusal);
                }
            }
            continue;
        };
        let app = app.clone();
        let builder = builder.clone();
        let idle = bounds.body_idle_timeout;
        tracker.spawn(async move {
            let _held = held;
            let service = hyper::service::service_fn(move |req: http::Request<Incoming>| {
                let unread = Arc::new(AtomicBool::new(false));
                let req =
                    req.map(|b| Body::new(Unread::new(IdleTimeout::new(b, idle), unread.clone())));
                let app = app.clone();
                async move {
                    let mut resp = app.oneshot(req).await.unwrap_or_else(|e| match e {});
                    if unread.load(Ordering::Acquire) {
                        resp.headers_mut().insert(
                            http::header::CONNECTION,
                            http::HeaderValue::from_static("close"),
                        );
                    }
                    Ok::<_, Infallible>(resp)
                }
            });
            let _ = builder
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades()
                .await;
        });
    }
    tracker.close();
    let _ = tokio::time::timeout(DRAIN, tracker.wait()).await;
}

/// A request body that fails when no chunk arrives for `idle` while the server waits
/// for one. Time the server spends not reading (a slow agent pushing back on an upload)
/// does not count: the clock starts when a read finds nothing there.
struct IdleTimeout<B> {
    inner: B,
    idle: Duration,
    sleep: Pin<Box<tokio::time::Sleep>>,
    /// Whether the last poll found nothing (the clock runs).
    waiting: bool,
}

impl<B> IdleTimeout<B> {
    fn new(inner: B, idle: Duration) -> IdleTimeout<B> {
        IdleTimeout {
            inner,
            idle,
            sleep: Box::pin(tokio::time::sleep(idle)),
            waiting: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("the request body stalled for {0:?}")]
struct BodyStalled(Duration);

impl<B> http_body::Body for IdleTimeout<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                this.waiting = false;
                Poll::Ready(frame.map(|f| f.map_err(Into::into)))
            }
            Poll::Pending => {
                if !this.waiting {
                    this.waiting = true;
                    let deadline = tokio::time::Instant::now() + this.idle;
                    this.sleep.as_mut().reset(deadline);
                }
                match this.sleep.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyStalled(this.idle))))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request body that, dropped before its end, raises `flag`. Only a dropped body
/// counts: one still read by a streaming handler after its response is under way is
/// not abandoned.
struct Unread<B: http_body::Body> {
    inner: B,
    ended: bool,
    flag: Arc<AtomicBool>,
}

impl<B: http_body::Body> Unread<B> {
    fn new(inner: B, flag: Arc<AtomicBool>) -> Unread<B> {
        let ended = inner.is_end_stream();
        Unread { inner, ended, flag }
    }
}

impl<B: http_body::Body> Drop for Unread<B> {
    fn drop(&mut self) {
        if !self.ended && !self.inner.is_end_stream() {
            self.flag.store(true, Ordering::Release);
        }
    }
}

impl<B> http_body::Body for Unread<B>
where
    B: http_body::Body + Unpin,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let frame = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None) = frame {
            self.ended = true;
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod idle_tests {
    use super::*;
    use http_body_util::BodyExt;

    type Chunk = Result<Frame<Bytes>, std::convert::Infallible>;

    fn body(
        rx: tokio::sync::mpsc::Receiver<Chunk>,
    ) -> IdleTimeout<http_body_util::StreamBody<tokio_stream::wrappers::ReceiverStream<Chunk>>>
    {
        IdleTimeout::new(
            http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)),
            Duration::from_secs(2),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn time_the_server_does_not_read_is_not_a_stall() {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut b = body(rx);
        tx.send(Ok(Frame::data(Bytes::from_static(b"a"))))
            .await
            .unwrap();
        assert!(b.frame().await.unwrap().is_ok());
        // The server is busy elsewhere (a slow agent) for longer than the limit, and the
        // client, held back meanwhile, needs a moment to send again once it is read.
        tokio::time::sleep(Duration::from_secs(10)).await;
        let send_later = |tx: tokio::sync::mpsc::Sender<Chunk>, after_ms| {
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(after_ms)).await;
                tx.send(Ok(Frame::data(Bytes::from_static(b"b"))))
                    .await
                    .unwrap();
                tx
            })
        };
        let sender = send_later(tx, 1500);
        assert!(b.frame().await.unwrap().is_ok());
        let tx = sender.await.unwrap();
        // The clock starts at each read that finds nothing.
        let sender = send_later(tx, 1900);
        assert!(b.frame().await.unwrap().is_ok());
        let _tx = sender.await.unwrap();
        // A client that sends nothing for the limit while the server waits ends the body.
        let e = b.frame().await.unwrap().unwrap_err();
        assert!(e.to_string().contains("stalled"), "{e}");
    }
}

#[cfg(test)]
mod unread_tests {
    use super::*;
    use axum::routing::post;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Serves a route that answers without reading the body and one that reads it.
    async fn server() -> std::net::SocketAddr {
        let app = Router::new()
            .route(
                "/early",
                post(|| async { (http::StatusCode::UNAUTHORIZED, "no") }),
            )
            .route(
                "/read",
                post(|body: Bytes| async move { format!("{}", body.len()) }),
            );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve(
            listener,
            app,
            Bounds::default(),
            std::future::pending(),
        ));
        addr
    }

    /// Reads one response head and its `content-length` body off `c`.
    async fn response(c: &mut tokio::net::TcpStream) -> String {
        let mut got = Vec::new();
        let mut byte = [0u8; 1];
        while !got.ends_with(b"\r\n\r\n") {
            assert_eq!(c.read(&mut byte).await.unwrap(), 1, "closed mid-head");
            got.push(byte[0]);
        }
        let head = String::from_utf8(got).unwrap().to_ascii_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .map_or(0, |v| v.trim().parse().unwrap());
        let mut body = vec![0u8; len];
        c.read_exact(&mut body).await.unwrap();
        head
    }

    #[tokio::test]
    async fn a_response_that_leaves_the_body_unread_closes_the_connection() {
        let addr = server().await;
        // The head first and the body a moment later, as a client with separate writes
        // may send them: the answer comes before the body is there.
        for path in ["/early", "/read"] {
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            let head = format!("POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n");
            c.write_all(head.as_bytes()).await.unwrap();
            if path == "/early" {
                let head = response(&mut c).await;
                assert!(head.starts_with("http/1.1 401"), "{head}");
                assert!(head.contains("connection: close"), "{head}");
                let _ = c.write_all(b"{}").await;
                // The server closes it; nothing more comes.
                let mut rest = Vec::new();
                let _ = c.read_to_end(&mut rest).await;
                assert!(rest.is_empty(), "{}", String::from_utf8_lossy(&rest));
                continue;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            c.write_all(b"{}").await.unwrap();
            // A body read to its end keeps the connection for the next request.
            let head = response(&mut c).await;
            assert!(head.starts_with("http/1.1 200"), "{head}");
            assert!(!head.contains("connection: close"), "{head}");
            c.write_all(b"POST /read HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx")
                .await
                .unwrap();
            let head = response(&mut c).await;
            assert!(head.starts_with("http/1.1 200"), "{head}");
        }
        // No body at all: nothing is left unread, so nothing closes.
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        for _ in 0..2 {
            c.write_all(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
                .await
                .unwrap();
            let head = response(&mut c).await;
            assert!(head.starts_with("http/1.1 401"), "{head}");
            assert!(!head.contains("connection: close"), "{head}");
        }
    }
}
