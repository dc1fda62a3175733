//! `/v1/sandboxes`: create, list, get, destroy, pause, resume, suspend,
//! keepalive, snapshot-template.

use std::time::Duration;

use reqwest::Method;
use space_api::{
    CreateSandboxRequest, KeepaliveRequest, Operation, Sandbox, SandboxList,
    SnapshotTemplateRequest,
};

use crate::{Client, ClientError, Result};

impl Client {
    /// `POST /v1/sandboxes`: the `create` operation (the sandbox id is its `sandbox_id`).
    pub async fn create_sandbox(&self, req: &CreateSandboxRequest) -> Result<Operation> {
        self.post_json(&["v1", "sandboxes"], req).await
    }

    /// Creates a sandbox and waits until it runs: its id. The operation's end other
    /// than `succeeded` is [`ClientError::OperationFailed`]; not ending within
    /// `timeout`, [`ClientError::OperationTimedOut`].
    pub async fn create_sandbox_and_wait(
        &self,
        req: &CreateSandboxRequest,
        timeout: Duration,
    ) -> Result<String> {
        let op = self.create_sandbox(req).await?;
        let op = self.wait_operation_succeeded(&op.id, timeout).await?;
        op.sandbox_id.ok_or_else(|| {
            ClientError::decode(
                "create operation",
                format!("operation {} names no sandbox", op.id),
            )
        })
    }

    /// `GET /v1/sandboxes[?label=k=v,…]`: the caller's sandboxes with every label given.
    pub async fn list_sandboxes<K, V>(
        &self,
        labels: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Vec<Sandbox>>
    where
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let filter = labels
            .into_iter()
            .map(|(k, v)| format!("{}={}", k.as_ref(), v.as_ref()))
            .collect::<Vec<_>>()
            .join(",");
        let query = if filter.is_empty() {
            vec![]
        } else {
            vec![("label", filter)]
        };
        let list: SandboxList = self
            .get_json(Method::GET, &["v1", "sandboxes"], &query)
            .await?;
        Ok(list.sandboxes)
    }

    /// `GET /v1/sandboxes/{id}`.
    pub async fn sandbox(&self, id: &str) -> Result<Sandbox> {
        self.get_json(Method::GET, &["v1", "sandboxes", id], &[])
            .await
    }

    /// `DELETE /v1/sandboxes/{id}`: the `destroy` operation.
    pub async fn destroy_sandbox(&self, id: &str) -> Result<Operation> {
        self.get_json(Method::DELETE, &["v1", "sandboxes", id], &[])
            .await
    }

    /// Destroys a sandbox and waits until it is gone (errors as
    /// [`Client::create_sandbox_and_wait`]): the operation.
    pub async fn destroy_sandbox_and_wait(&self, id: &str, timeout: Duration) -> Result<Operation> {
        let op = self.destroy_sandbox(id).await?;
        self.wait_operation_succeeded(&op.id, timeout).await
    }

    /// `POST /v1/sandboxes/{id}/pause`: the `pause` operation.
    pub async fn pause_sandbox(&self, id: &str) -> Result<Operation> {
        self.lifecycle(id, "pause").await
    }

    /// `POST /v1/sandboxes/{id}/resume`: the `resume` operation.
    pub async fn resume_sandbox(&self, id: &str) -> Result<Operation> {
        self.lifecycle(id, "resume").await
    }

    /// `POST /v1/sandboxes/{id}/suspend`: the `suspend` operation.
    pub async fn suspend_sandbox(&self, id: &str) -> Result<Operation> {
        self.lifecycle(id, "suspend").await
    }

    async fn lifecycle(&self, id: &str, verb: &str) -> Result<Operation> {
        self.get_json(Method::POST, &["v1", "sandboxes", id, verb], &[])
            .await
    }

    /// `POST /v1/sandboxes/{id}/keepalive`: counts as activity; with `ttl_seconds`
    /// the TTL restarts from now with that length. The sandbox after it.
    pub async fn keepalive(&self, id: &str, ttl_seconds: Option<u64>) -> Result<Sandbox> {
        self.post_json(
            &["v1", "sandboxes", id, "keepalive"],
            &KeepaliveRequest { ttl_seconds },
        )
        .await
    }

    /// `POST /v1/sandboxes/{id}/snapshot-template`: the `build` operation that makes
    /// the sandbox's files the next version of template `name`.
    pub async fn snapshot_template(&self, id: &str, name: &str) -> Result<Operation> {
        self.post_json(
            &["v1", "sandboxes", id, "snapshot-template"],
            &SnapshotTemplateRequest { name: name.into() },
        )
        .await
    }
}
