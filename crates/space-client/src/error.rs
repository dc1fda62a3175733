//! What a call to the server can fail with: one enum, so that a caller can tell
//! a refusal by the server (with its `{"error":{"code","message"}}`) from a
//! server it cannot reach and from an answer it cannot read.

use std::time::Duration;

use space_api::{ApiError, Operation};

/// Any boxed decoding failure (JSON, base64, an over-long line).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server URL given (or `SPACE_URL`) is not an `http(s)://` URL.
    #[error("invalid server URL {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },
    /// The token holds bytes an HTTP header cannot carry.
    #[error("the API token cannot be sent in an HTTP header")]
    InvalidToken,
    /// An id or name that no URL path can carry (empty, `.` or `..`).
    #[error("{segment:?} cannot be part of a URL path")]
    InvalidPathSegment { segment: String },
    /// The HTTP client could not be set up.
    #[error("setting up the HTTP client")]
    Setup(#[source] reqwest::Error),
    /// No answer: the server could not be reached, or the request could not be sent.
    #[error("cannot reach the space server at {url}")]
    Transport {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    /// The server took the request but gave no answer within the client's timeout
    /// (`ClientBuilder::timeout`): it may still carry the request out.
    #[error("the space server at {url} gave no answer within {after:?}")]
    TimedOut {
        url: String,
        after: Duration,
        #[source]
        source: reqwest::Error,
    },
    /// An answer that broke off before its end.
    #[error("the answer of the space server at {url} broke off")]
    Body {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    /// The server refused the request with its error body.
    #[error("{} ({}): {}", status_text(*.status), error_code(.error), .error.message)]
    Api {
        status: u16,
        error: ApiError,
        /// `Retry-After` in seconds, where the server gave one (429).
        retry_after: Option<u64>,
    },
    /// A failure status without our error body (a proxy, a gateway, an older server).
    #[error("{}: {body}", status_text(*.status))]
    Status { status: u16, body: String },
    /// An answer that is not what the API promises.
    #[error("unreadable {what}")]
    Decode {
        what: String,
        #[source]
        source: BoxError,
    },
    /// An answer past the bound the client reads.
    #[error("{what} is larger than {limit} bytes")]
    TooLarge { what: String, limit: u64 },
    /// An operation waited for ended, but not `succeeded`.
    #[error("operation {} {}: {}", .0.id, .0.status, operation_error(.0))]
    OperationFailed(Box<Operation>),
    /// An operation waited for had not ended when the wait's deadline passed.
    #[error("operation {} is still {} after {:?}", .operation.id, .operation.status, .waited)]
    OperationTimedOut {
        operation: Box<Operation>,
        waited: Duration,
    },
    /// The attach WebSocket could not be opened (a refusal by the server is `Api`).
    #[error("opening the WebSocket {url}")]
    WebSocket {
        url: String,
        #[source]
        source: Box<tokio_tungstenite::tungstenite::Error>,
    },
}

impl ClientError {
    /// The HTTP status of a refusal (`Api` or `Status`).
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. } | ClientError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The server's error body, when it sent one.
    pub fn api_error(&self) -> Option<&ApiError> {
        match self {
            ClientError::Api { error, .. } => Some(error),
            _ => None,
        }
    }

    /// `Retry-After` of a refusal, in seconds.
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            ClientError::Api { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// Whether the connection failed (before or during the answer): worth a retry.
    pub fn is_transport(&self) -> bool {
        matches!(
            self,
            ClientError::Transport { .. } | ClientError::TimedOut { .. } | ClientError::Body { .. }
        )
    }

    /// No answer within the client's timeout (`TimedOut`).
    pub fn is_timeout(&self) -> bool {
        matches!(self, ClientError::TimedOut { .. })
    }

    pub(crate) fn decode(what: impl Into<String>, source: impl Into<BoxError>) -> Self {
        ClientError::Decode {
            what: what.into(),
            source: source.into(),
        }
    }
}

/// The error code as its wire text (`not_found`, `conflict`, …).
pub fn error_code(e: &ApiError) -> String {
    e.code.as_str().to_string()
}

/// `404 Not Found`, as HTTP clients print a status.
pub fn status_text(status: u16) -> String {
    match http::StatusCode::from_u16(status) {
        Ok(s) => s.to_string(),
        Err(_) => status.to_string(),
    }
}

/// `code: message` of a failed operation, or that it gave none.
fn operation_error(op: &Operation) -> String {
    op.error
        .as_ref()
        .map(|e| format!("{}: {}", error_code(e), e.message))
        .unwrap_or_else(|| "no error given".into())
}
