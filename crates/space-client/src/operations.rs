//! `/v1/operations`: get (long-poll), wait with a deadline, list, cancel, the
//! build log.

use std::time::Duration;

use reqwest::Method;
use space_api::{Operation, OperationList, OperationStatus};
use tokio::time::Instant;

use crate::{wait_param, ByteStream, Client, ClientError, Result};

/// Longest single long-poll asked of the server while waiting; the server caps
/// a `wait` at 10 minutes, and a shorter one keeps each request well inside any
/// proxy's idle timeout.
const POLL: Duration = Duration::from_secs(30);

impl Client {
    /// `GET /v1/operations/{id}[?wait=…]`: with `wait`, the server answers when the
    /// operation ends or the wait passes, whichever is first.
    pub async fn operation(&self, id: &str, wait: Option<Duration>) -> Result<Operation> {
        let query: Vec<(&str, String)> =
            wait.map(|w| ("wait", wait_param(w))).into_iter().collect();
        self.get_json(Method::GET, &["v1", "operations", id], &query)
            .await
    }

    /// Long-polls until the operation has ended or `timeout` has passed: the
    /// operation as last seen (check its `status`).
    pub async fn wait_operation(&self, id: &str, timeout: Duration) -> Result<Operation> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let op = self.operation(id, Some(left.min(POLL))).await?;
            if op.status.is_terminal() || Instant::now() >= deadline {
                return Ok(op);
            }
        }
    }

    /// Like [`Client::wait_operation`], but only `succeeded` is `Ok`: another end is
    /// [`ClientError::OperationFailed`], no end by `timeout`
    /// [`ClientError::OperationTimedOut`].
    pub async fn wait_operation_succeeded(&self, id: &str, timeout: Duration) -> Result<Operation> {
        let op = self.wait_operation(id, timeout).await?;
        match op.status {
            OperationStatus::Succeeded => Ok(op),
            s if s.is_terminal() => Err(ClientError::OperationFailed(Box::new(op))),
            _ => Err(ClientError::OperationTimedOut {
                operation: Box::new(op),
                waited: timeout,
            }),
        }
    }

    /// `GET /v1/operations[?sandbox_id=&limit=]`: newest first (the server's
    /// default limit is 100, at most 1000).
    pub async fn list_operations(
        &self,
        sandbox_id: Option<&str>,
        limit: Option<usize>,
    ) -> Result<Vec<Operation>> {
        let mut query = Vec::new();
        if let Some(sb) = sandbox_id {
            query.push(("sandbox_id", sb.to_string()));
        }
        if let Some(n) = limit {
            query.push(("limit", n.to_string()));
        }
        let list: OperationList = self
            .get_json(Method::GET, &["v1", "operations"], &query)
            .await?;
        Ok(list.operations)
    }

    /// `POST /v1/operations/{id}/cancel`: the operation, `cancelled` (409 once it runs).
    pub async fn cancel_operation(&self, id: &str) -> Result<Operation> {
        self.get_json(Method::POST, &["v1", "operations", id, "cancel"], &[])
            .await
    }

    /// `GET /v1/operations/{id}/log[?follow=true]`: a build's log as it is, or
    /// (`follow`) streamed until the build ends.
    pub async fn build_log(&self, id: &str, follow: bool) -> Result<ByteStream> {
        let query: Vec<(&str, String)> = if follow {
            vec![("follow", "true".into())]
        } else {
            vec![]
        };
        let resp = self
            .get_stream(&["v1", "operations", id, "log"], &query)
            .await?;
        Ok(self.byte_stream(resp))
    }
}
