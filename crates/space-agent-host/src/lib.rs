//! The host end of the agent protocol (`space_agent::protocol`): the Unix socket per
//! sandbox that the agent dials, the handshake that authenticates it, the HTTP/2
//! connection on it, and typed calls for everything the host asks of an agent (commands,
//! files, quiesce). Nobody outside this crate builds an agent URI.
//!
//! Everything read from the agent is hostile: handshake lines, JSON answers, error
//! bodies and headers are bounded, error codes count only when they are the API's own
//! ([`space_api::ErrorCode`]), and a protocol violation is an error, never a panic.
//!
//! Nothing waits on an agent forever: the connection is pinged while it is open (an
//! agent that stops answering is dropped), every call but the file calls has a deadline
//! ([`REQUEST_TIMEOUT`]), and the file calls end with the connection.

mod commands;
mod conn;
mod error;
mod files;
mod listen;
#[cfg(feature = "test-util")]
pub mod testing;

pub use commands::Attach;
pub use conn::{
    body_from_bytes, body_from_stream, AgentConn, HostBody, MAX_AGENT_ERROR, MAX_AGENT_JSON,
    PING_INTERVAL, PING_TIMEOUT, REQUEST_TIMEOUT,
};
pub use error::{AgentError, BodyError, Retry, MAX_ERROR_MESSAGE};
pub use files::{Download, DownloadBody, DownloadFormat, UploadKind, Uploaded, MAX_LISTING_JSON};
pub use listen::{
    call_again_on_break, connection_counts, handshake, listen, wait_connected, wait_reconnected,
    HandshakeError, HANDSHAKE_TIMEOUT, MAX_HANDSHAKES,
};
/// The protocol as this crate sees it: the agent's own tests reach it through here, since
/// their dev-dependency on this crate links a second copy of `space_agent`.
pub use space_agent::protocol;
