//! The file API: requests that the sandbox's agent carries out inside the
//! sandbox, where every path resolves (see `space_agent::fs`). The host checks
//! the sandbox's state, bounds what it forwards and relays the answer; it never
//! touches the sandbox's files itself.

use std::time::Duration;

use http::{Method, Request, Response};
use hyper::body::Incoming;
use space_api::SandboxState;

use super::agent::{self, AgentError, HostBody};
use super::{Service, ServiceError};

/// How long a file request waits for a (re)connecting agent.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);

impl Service {
    /// Sends `method path_and_query` (an agent `/v1/files…` URI the API layer
    /// built from validated parts) with `body` to the sandbox's agent and returns
    /// its streamed answer, whatever its status.
    pub(super) async fn files_request(
        &self,
        sandbox_id: &str,
        method: Method,
        path_and_query: &str,
        content_type: Option<&str>,
        body: HostBody,
    ) -> Result<Response<Incoming>, ServiceError> {
        let rec = self.record(sandbox_id)?;
        match rec.sandbox.state {
            SandboxState::Running => {}
            SandboxState::Paused | SandboxState::Pausing => {
                return Err(ServiceError::Conflict(format!(
                    "sandbox {sandbox_id} is paused: its files can be reached again once it is resumed"
                )))
            }
            SandboxState::Suspended | SandboxState::Suspending => {
                return Err(ServiceError::Conflict(format!(
                    "sandbox {sandbox_id} is suspended: resume it to reach its files"
                )))
            }
            state => {
                return Err(ServiceError::Conflict(format!(
                    "sandbox {sandbox_id} is {state}: its files cannot be reached"
                )))
            }
        }
        self.touch(sandbox_id);
        let handle = self.live_handle(sandbox_id).ok_or_else(|| {
            ServiceError::Conflict(format!("sandbox {sandbox_id} is not running"))
        })?;
        let mut rx = handle.agent.subscribe();
        let conn = agent::wait_connected(&mut rx, CONNECT_TIMEOUT).await?;
        let mut req = Request::builder()
            .method(method)
            .uri(format!("http://agent{path_and_query}"));
        if let Some(ct) = content_type {
            req = req.header(http::header::CONTENT_TYPE, ct);
        }
        let req = req
            .body(body)
            .map_err(|e| ServiceError::BadRequest(format!("invalid file request: {e}")))?;
        let resp = conn.send(req).await.map_err(|e| match e {
            AgentError::NotConnected => ServiceError::Unavailable(e.to_string()),
            other => ServiceError::Unavailable(format!(
                "the file request to the sandbox's agent failed: {}",
                super::error_chain(&other)
            )),
        })?;
        self.touch(sandbox_id);
        Ok(resp)
    }
}
