//! For the protocol's own tests (feature `test-util`): what the typed calls never do.
//! The tests of the agent send requests the host never makes (malformed ones, unknown
//! endpoints) and play hosts that misbehave (one that never speaks HTTP/2 after its
//! hello). Everything here is the real protocol code: the handshake and the connection
//! are those of [`crate::listen`] and [`AgentConn::start`].

use bytes::Bytes;
use http::{Method, Response};
use hyper::body::Incoming;
use space_agent::protocol::Hello;
use tokio::net::{UnixListener, UnixStream};

use crate::conn::{body_from_bytes, encode, AgentConn};
use crate::error::AgentError;
use crate::files::DownloadFormat;
use crate::listen::{handshake, HandshakeError};

#[derive(Debug, thiserror::Error)]
pub enum AcceptError {
    #[error("accepting a connection failed")]
    Accept(#[source] std::io::Error),
    #[error("the handshake failed")]
    Handshake(#[source] HandshakeError),
    #[error("HTTP/2 on the connection failed")]
    Http2(#[source] AgentError),
}

impl AgentConn {
    /// Sends `method path_and_query` with `body` as it is and returns the answer,
    /// whatever its status; no deadline.
    pub async fn send_raw(
        &self,
        method: Method,
        path_and_query: &str,
        content_type: Option<&'static str>,
        body: impl Into<Bytes>,
    ) -> Result<Response<Incoming>, AgentError> {
        self.request(
            method,
            path_and_query,
            content_type,
            body_from_bytes(body),
            None,
        )
        .await
    }

    /// The request of [`AgentConn::download`], its answer returned as the agent sent it
    /// (status, headers, body and trailers unread): for the tests of what the typed call
    /// reads only in part (the exact header text, the content type, the trailers).
    pub async fn download_answer(
        &self,
        path: &str,
        format: DownloadFormat,
    ) -> Result<Response<Incoming>, AgentError> {
        let mut query = format!("/v1/files?path={}", encode(path));
        if format == DownloadFormat::Tar {
            query.push_str("&format=tar");
        }
        self.send_raw(Method::GET, &query, None, Bytes::new()).await
    }
}

/// Accepts the next connection on `listener` and runs the host's handshake on it;
/// the caller decides what follows the hello.
pub async fn accept_hello(
    listener: &UnixListener,
    sandbox_id: &str,
    token: &str,
) -> Result<(UnixStream, Hello), AcceptError> {
    let (mut stream, _) = listener.accept().await.map_err(AcceptError::Accept)?;
    let hello = handshake(&mut stream, sandbox_id, token)
        .await
        .map_err(AcceptError::Handshake)?;
    Ok((stream, hello))
}

/// Accepts the agent's next connection on `listener` as the server does: the handshake,
/// then HTTP/2.
pub async fn accept(
    listener: &UnixListener,
    sandbox_id: &str,
    token: &str,
) -> Result<(AgentConn, Hello), AcceptError> {
    let (stream, hello) = accept_hello(listener, sandbox_id, token).await?;
    let conn = AgentConn::start(stream, sandbox_id, &hello.agent_version)
        .await
        .map_err(AcceptError::Http2)?
        .with_features(&hello.features);
    Ok((conn, hello))
}
