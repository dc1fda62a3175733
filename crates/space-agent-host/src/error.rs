//! What a call to the agent can end in, and how an agent's error answer becomes one.

use std::time::Duration;

use http::StatusCode;
use space_agent::protocol::ErrorBody;
use space_api::ErrorCode;

/// Why a request body to (or a streamed answer from) the agent ended early.
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// Longest message kept from an agent's error answer.
pub const MAX_ERROR_MESSAGE: usize = 4096;
/// What is shown of an error answer that is not the protocol's error JSON.
const MAX_UNPARSED_MESSAGE: usize = 200;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("the sandbox's agent is not connected")]
    NotConnected,
    #[error("the connection to the agent failed")]
    Connection(#[source] hyper::Error),
    /// The connection had ended before the request went out: the agent never saw it.
    #[error("the connection to the agent had ended before the request went out")]
    NotSent(#[source] hyper::Error),
    #[error("the sandbox's agent did not answer within {}s", .0.as_secs())]
    Timeout(Duration),
    /// The agent answered with an error status. `code` is the agent's code when it is one
    /// of the API's codes, else [`ErrorCode::AgentError`]: an agent in a sandbox is not
    /// trusted to say anything else. `message` is bounded ([`MAX_ERROR_MESSAGE`]).
    #[error("the agent answered {status}: {message}")]
    Refused {
        status: StatusCode,
        code: ErrorCode,
        message: String,
    },
    #[error("the agent sent an invalid response: {0}")]
    Protocol(String),
    /// A streamed answer ended with the agent's own error (its `x-space-error` trailer):
    /// what came before it is incomplete.
    #[error("the sandbox's agent failed mid-transfer: {0}")]
    Failed(String),
    /// A streamed answer broke off (the connection, or an end inside a frame).
    #[error("the transfer from the agent broke off")]
    Broken(#[source] BodyError),
    /// A request that cannot be put on the wire (an argument no URI can carry).
    #[error("invalid request to the agent: {0}")]
    Request(String),
}

impl AgentError {
    /// The status the agent answered with, when it refused the request.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            AgentError::Refused { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Whether the agent is away or not answering (a caller may retry later), as opposed
    /// to an answer it gave.
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            AgentError::NotConnected
                | AgentError::Timeout(_)
                | AgentError::Connection(_)
                | AgentError::NotSent(_)
        )
    }

    /// Whether a call that failed so may be made again on the agent's next connection:
    /// one that never went out always; a [`Retry::Repeatable`] one also after its
    /// connection broke under it (the agent may or may not have acted on it). Never
    /// after the agent's answer, a refusal, or its silence ([`AgentError::Timeout`]: an
    /// agent that does not answer is not helped by asking again).
    pub fn may_retry(&self, retry: Retry) -> bool {
        match self {
            AgentError::NotSent(_) => true,
            AgentError::Connection(_) => retry == Retry::Repeatable,
            _ => false,
        }
    }
}

/// Whether a one-shot call to the agent may be made twice (see [`AgentError::may_retry`]
/// and [`crate::call_again_on_break`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Made twice, it does what it does once: a read, a `mkdir -p`, a signal (a
    /// standard signal still pending is not delivered twice, and one a process handled
    /// in between is the same as a client sending it again).
    Repeatable,
    /// Only if it never went out: a rename, a removal (made again after it was done, it
    /// would answer "not found" for what it did).
    IfNotSent,
}

/// The typed error for an error answer: `status` and the (already bounded) `body`.
pub(crate) fn refusal(status: StatusCode, body: &[u8]) -> AgentError {
    match serde_json::from_slice::<ErrorBody>(body) {
        Ok(b) => AgentError::Refused {
            status,
            code: ErrorCode::parse(&b.error.code).unwrap_or(ErrorCode::AgentError),
            message: truncate(&b.error.message, MAX_ERROR_MESSAGE).to_owned(),
        },
        Err(_) => AgentError::Refused {
            status,
            code: ErrorCode::AgentError,
            message: String::from_utf8_lossy(&body[..body.len().min(MAX_UNPARSED_MESSAGE)])
                .into_owned(),
        },
    }
}

pub(crate) use space_api::truncate;

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(status: u16, body: &[u8]) -> (StatusCode, ErrorCode, String) {
        match refusal(StatusCode::from_u16(status).unwrap(), body) {
            AgentError::Refused {
                status,
                code,
                message,
            } => (status, code, message),
            other => panic!("not a refusal: {other:?}"),
        }
    }

    #[test]
    fn an_agent_code_counts_only_when_it_is_one_of_ours() {
        let (status, code, message) = refused(
            404,
            br#"{"error":{"code":"not_found","message":"no such file"}}"#,
        );
        assert_eq!(
            (status.as_u16(), code, message.as_str()),
            (404, ErrorCode::NotFound, "no such file")
        );
        let (_, code, message) =
            refused(507, br#"{"error":{"code":"no_space","message":"quota"}}"#);
        assert_eq!((code, message.as_str()), (ErrorCode::NoSpace, "quota"));
        // Codes the API does not have (the agent's own `bad_request`, anything invented).
        for c in ["bad_request", "made_up", "", "NOT_FOUND"] {
            let body = format!(r#"{{"error":{{"code":"{c}","message":"m"}}}}"#);
            let (_, code, message) = refused(400, body.as_bytes());
            assert_eq!(
                (code, message.as_str()),
                (ErrorCode::AgentError, "m"),
                "{c}"
            );
        }
    }

    #[test]
    fn what_is_not_the_error_json_is_kept_short() {
        let (status, code, message) = refused(500, b"plain text");
        assert_eq!(
            (status.as_u16(), code, message.as_str()),
            (500, ErrorCode::AgentError, "plain text")
        );
        let (_, code, message) = refused(400, &[b'x'; 10_000]);
        assert_eq!((code, message.len()), (ErrorCode::AgentError, 200));
        let (_, _, message) = refused(400, &[0xff; 300]);
        assert!(message.chars().all(|c| c == '\u{fffd}'));
        let (_, code, message) = refused(400, b"");
        assert_eq!((code, message.as_str()), (ErrorCode::AgentError, ""));
        // Valid JSON of another shape.
        let (_, code, _) = refused(400, br#"{"error":"text"}"#);
        assert_eq!(code, ErrorCode::AgentError);
    }

    #[test]
    fn long_messages_are_cut_at_a_character() {
        let long = "é".repeat(5000);
        let body = serde_json::to_vec(&ErrorBody::new("conflict", long)).unwrap();
        let (_, code, message) = refused(409, &body);
        assert_eq!(code, ErrorCode::Conflict);
        assert!(message.len() <= MAX_ERROR_MESSAGE && message.len() >= MAX_ERROR_MESSAGE - 1);
        assert!(message.chars().all(|c| c == 'é'));
    }
}
