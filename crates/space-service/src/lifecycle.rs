//! Lifecycle operations on an existing sandbox: destroy, pause, resume,
//! suspend. Each request is checked against the state machine at once (409),
//! recorded as a `pending` operation, and run as a task that holds the
//! sandbox's lifecycle lock, so operations on one sandbox never interleave.
//! Every operation has a deadline: one that passes it ends `failed`, and its
//! sandbox goes to `failed`, from which destroy always works.

use space_api::ErrorCode;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use space_api::{ApiError, Operation, OperationKind, OperationStatus, SandboxState};
use space_core::runtime::{RuntimeError, RuntimeStatus};
use space_core::{now_rfc3339, transition, SandboxEvent};
use tokio_util::sync::CancellationToken;

use super::{
    agent, error_chain, failpoint, failpoint_active, failpoint_hang, internal, lock, new_operation,
    Result, SandboxHandle, Service, ServiceError,
};

/// How long the agent may take to drop its connection before a checkpoint.
const QUIESCE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a restored sandbox's agent may take to dial back in, per attempt.
const RESTORE_CONNECT_TIMEOUT: Duration = Duration::from_secs(20);
/// Restores of one resume before it fails (the snapshot is kept either way).
const RESTORE_ATTEMPTS: u32 = 2;
/// How often a wake is tried when the sandbox does not take it, and how far apart.
const WAKE_ATTEMPTS: u32 = 5;
const WAKE_RETRY_AFTER: Duration = Duration::from_millis(300);
/// How long a restored agent gets before it is woken again.
const RESTORE_REWAKE_EVERY: Duration = Duration::from_secs(5);

/// Longest an operation of each kind may run before it is failed.
pub(crate) fn deadline(kind: OperationKind) -> Duration {
    match kind {
        // A create may have to build the debian template first.
        OperationKind::Create | OperationKind::Build => Duration::from_secs(20 * 60),
        OperationKind::Suspend => Duration::from_secs(5 * 60),
        OperationKind::Resume => Duration::from_secs(3 * 60),
        OperationKind::Destroy => Duration::from_secs(2 * 60),
        OperationKind::Pause => Duration::from_secs(60),
    }
}

fn request_event(kind: OperationKind) -> SandboxEvent {
    match kind {
        OperationKind::Pause => SandboxEvent::PauseRequested,
        OperationKind::Resume => SandboxEvent::ResumeRequested,
        OperationKind::Suspend => SandboxEvent::SuspendRequested,
        _ => SandboxEvent::DestroyRequested,
    }
}

fn conflict(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorCode::Conflict, e.to_string())
}

fn runtime_failed(e: &dyn std::error::Error) -> ApiError {
    ApiError::new(ErrorCode::RuntimeFailed, error_chain(e))
}

impl Service {
    /// Lets a quiesced agent dial again (see `Runtime::wake_agent`).
    ///
    /// Right after a restore the sandbox's control server may not answer yet (seen under
    /// load: "connection refused"), so a failed wake is tried again a few times.
    pub(crate) async fn wake_agent(&self, id: &str) {
        let mut last = None;
        for attempt in 0..WAKE_ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(WAKE_RETRY_AFTER).await;
            }
            match self.rt(id).wake_agent(id).await {
                Ok(()) => return,
                Err(e) => last = Some(error_chain(&e)),
            }
        }
        if let Some(e) = last {
            tracing::warn!(sandbox = %id, error = %e, "waking the agent failed");
        }
    }

    /// Logs what is known of a sandbox whose agent never dialled in: the runtime's view of
    /// it and the end of its console (the agent's own notes, runsc's or the guest kernel's),
    /// so that a rare failure leaves enough behind to be understood.
    pub(crate) async fn log_silent_agent(&self, id: &str, what: &str) {
        let status = match self.rt(id).status(id).await {
            Ok(s) => format!("{s:?}"),
            Err(e) => error_chain(&e),
        };
        let console = self
            .rt(id)
            .console_tail(&self.sandbox_dir(id))
            .unwrap_or_default();
        tracing::warn!(sandbox = %id, runtime_status = %status, console = %console, "{what}");
    }

    /// The deadline of an operation kind on this server.
    pub(crate) fn deadline(&self, kind: OperationKind) -> Duration {
        self.0
            .cfg
            .operation_timeout
            .unwrap_or_else(|| deadline(kind))
    }

    /// `DELETE /v1/sandboxes/{id}`.
    pub(super) fn destroy_sandbox(&self, id: &str) -> Result<Operation> {
        self.request_lifecycle(id, OperationKind::Destroy, None)
    }

    /// `POST /v1/sandboxes/{id}/pause`.
    pub(super) fn pause(&self, id: &str) -> Result<Operation> {
        self.request_lifecycle(id, OperationKind::Pause, None)
    }

    /// `POST /v1/sandboxes/{id}/resume`: from `paused` or `suspended`. A suspended one
    /// holds nothing of the host until it resumes: it must fit the server's capacity.
    pub(super) fn resume(&self, id: &str) -> Result<Operation> {
        if self.record(id)?.sandbox.state == SandboxState::Suspended {
            return self.admit_resident(|| self.request_lifecycle(id, OperationKind::Resume, None));
        }
        self.request_lifecycle(id, OperationKind::Resume, None)
    }

    /// `POST /v1/sandboxes/{id}/suspend`.
    pub(super) fn suspend(&self, id: &str) -> Result<Operation> {
        self.request_lifecycle(id, OperationKind::Suspend, None)
    }

    /// Checks, records and starts a lifecycle operation. `progress` is the
    /// first line of its progress (why it was started, for policy-driven ones).
    pub(crate) fn request_lifecycle(
        &self,
        id: &str,
        kind: OperationKind,
        progress: Option<&str>,
    ) -> Result<Operation> {
        let rec = self.record(id)?;
        transition(rec.sandbox.state, request_event(kind))?;
        let handle = self.handle(id);
        let op = {
            let mut unfinished = lock(&handle.ops);
            // One operation at a time; a destroy may queue behind another, but only one destroy.
            if let Some((other, other_kind)) = unfinished
                .iter()
                .find(|(_, k)| kind != OperationKind::Destroy || *k == OperationKind::Destroy)
            {
                return Err(ServiceError::Conflict(format!(
                    "sandbox {id} has a {other_kind} operation in progress ({other}); wait for it or cancel it"
                )));
            }
            let mut op = new_operation(kind, Some(id), &rec.sandbox.tenant);
            op.progress = progress.map(str::to_owned);
            self.0.store.insert_operation(&op)?;
            unfinished.push((op.id.clone(), kind));
            op
        };
        let cancel = CancellationToken::new();
        lock(&self.0.pending_ops).insert(op.id.clone(), cancel.clone());
        tracing::info!(sandbox = %id, operation = %op.id, %kind, "operation requested");
        let svc = self.clone();
        let op_id = op.id.clone();
        tokio::spawn(async move { svc.run_lifecycle(handle, op_id, kind, cancel).await });
        Ok(op)
    }

    pub(super) async fn run_lifecycle(
        &self,
        handle: Arc<SandboxHandle>,
        op_id: String,
        kind: OperationKind,
        cancel: CancellationToken,
    ) {
        let guard = tokio::select! {
            g = handle.lifecycle.lock() => Some(g),
            _ = cancel.cancelled() => None,
        };
        let started = lock(&self.0.pending_ops).remove(&op_id).is_some();
        if guard.is_none() || !started {
            lock(&handle.ops).retain(|(o, _)| *o != op_id);
            return; // Cancelled while pending: the canceller recorded it.
        }
        let steps = async {
            match kind {
                OperationKind::Destroy => self.destroy_steps(&handle, &op_id).await,
                OperationKind::Pause => self.pause_steps(&handle, &op_id).await,
                OperationKind::Resume => self.resume_steps(&handle, &op_id).await,
                OperationKind::Suspend => self.suspend_steps(&handle, &op_id).await,
                OperationKind::Create | OperationKind::Build => Err(ApiError::new(
                    ErrorCode::Internal,
                    "not a lifecycle operation on an existing sandbox",
                )),
            }
        };
        let limit = self.deadline(kind);
        let result = match tokio::time::timeout(limit, steps).await {
            Ok(r) => r,
            Err(_) => {
                let e = ApiError::new(
                    ErrorCode::TimedOut,
                    format!("the {kind} did not finish within {}s", limit.as_secs()),
                );
                self.fail_sandbox(&handle, &format!("{} failed: {}", kind, e.message))
                    .await;
                Err(e)
            }
        };
        if let Err(e) = &result {
            tracing::warn!(sandbox = %handle.id, operation = %op_id, %kind, error = %e.message, "operation failed");
        }
        // A success was recorded with the sandbox's new state (`complete`).
        if let Err(e) = result {
            self.sample_cost(&handle.id).await;
            let _ = self.finish_op(&op_id, Some(e));
        }
        lock(&handle.ops).retain(|(o, _)| *o != op_id);
        drop(guard);
    }

    /// Moves the sandbox along `event` and marks the operation running, in one write.
    fn begin(
        &self,
        id: &str,
        op_id: &str,
        event: SandboxEvent,
        progress: &str,
    ) -> Result<SandboxState, ApiError> {
        let (_, _, from) = self.modify_sandbox_and_op(id, op_id, |rec, op| {
            let from = rec.sandbox.state;
            rec.sandbox.state = transition(from, event).map_err(conflict)?;
            rec.sandbox.updated_at = now_rfc3339();
            op.status = OperationStatus::Running;
            op.progress = Some(progress.into());
            op.updated_at = now_rfc3339();
            Ok::<_, ApiError>(from)
        })?;
        Ok(from)
    }

    /// Applies `event` to the stored sandbox (and, with `f`, changes more of it).
    pub(crate) fn advance(
        &self,
        id: &str,
        event: SandboxEvent,
        f: impl Fn(&mut space_store::SandboxRecord),
    ) -> Result<(), ApiError> {
        self.modify_sandbox(id, |rec| {
            rec.sandbox.state = transition(rec.sandbox.state, event).map_err(conflict)?;
            rec.sandbox.updated_at = now_rfc3339();
            f(rec);
            Ok::<_, ApiError>(())
        })
        .map(drop)
    }

    /// Ends an operation's steps: moves the sandbox along `event` and marks the operation
    /// succeeded in one write, so nobody sees the new state beside a running operation
    /// (or the reverse). What the new state costs is sampled first.
    ///
    /// The operation also stops counting as the sandbox's unfinished one in that moment:
    /// a client that saw it succeed may ask for the next at once (it waits for this
    /// task's last steps behind the lifecycle lock, as `pending`).
    async fn complete(
        &self,
        handle: &SandboxHandle,
        op_id: &str,
        event: SandboxEvent,
        f: impl Fn(&mut space_store::SandboxRecord),
    ) -> Result<(), ApiError> {
        let id = &handle.id;
        let now = self.record(id).map_err(internal)?.sandbox.state;
        let to = transition(now, event).map_err(conflict)?;
        self.sample_cost_as(id, to).await;
        let mut unfinished = lock(&handle.ops);
        self.modify_sandbox_and_op(id, op_id, |rec, op| {
            rec.sandbox.state = transition(rec.sandbox.state, event).map_err(conflict)?;
            rec.sandbox.updated_at = now_rfc3339();
            f(rec);
            op.status = OperationStatus::Succeeded;
            op.progress = Some("done".into());
            op.updated_at = now_rfc3339();
            Ok::<_, ApiError>(())
        })?;
        unfinished.retain(|(o, _)| o != op_id);
        Ok(())
    }

    async fn destroy_steps(
        &self,
        handle: &Arc<SandboxHandle>,
        op_id: &str,
    ) -> Result<(), ApiError> {
        let id = &handle.id;
        let rec = self.record(id).map_err(internal)?;
        if rec.sandbox.state != SandboxState::Destroying {
            self.begin(
                id,
                op_id,
                SandboxEvent::DestroyRequested,
                "stopping the sandbox",
            )?;
        }
        failpoint("destroy:before_stop");
        // Record why commands end before their sessions notice the sandbox going.
        self.lose_commands(id, "the sandbox was destroyed");
        handle.closed.cancel();
        handle.stop_listener();
        let dir = self.sandbox_dir(id);
        let result = self.rt(id).destroy(id, &dir).await;
        if let Err(e) = result {
            let e = runtime_failed(&e);
            self.advance(id, SandboxEvent::Failed, |r| {
                r.sandbox.failure_reason = Some(format!("destroy failed: {}", e.message));
            })?;
            return Err(e);
        }
        let _ = space_store::offload(|| std::fs::remove_dir_all(self.snapshot_dir(id)));
        self.complete(handle, op_id, SandboxEvent::Destroyed, |r| {
            r.sandbox.destroyed_at = Some(now_rfc3339());
            r.snapshot_dir = None;
        })
        .await?;
        self.forget_handle(id);
        tracing::info!(sandbox = %id, operation = %op_id, "sandbox destroyed");
        Ok(())
    }

    async fn pause_steps(&self, handle: &Arc<SandboxHandle>, op_id: &str) -> Result<(), ApiError> {
        let id = &handle.id;
        {
            let _no_spawns = handle.spawns.write().await;
            self.begin(id, op_id, SandboxEvent::PauseRequested, "pausing")?;
        }
        failpoint("pause:before_runtime");
        failpoint_hang("pause:hang").await;
        let paused = self.rt(id).pause(id).await;
        failpoint("pause:after_runtime");
        match paused {
            Ok(()) => {
                self.complete(handle, op_id, SandboxEvent::Paused, |_| {})
                    .await
            }
            Err(e) => {
                let e = runtime_failed(&e);
                self.settle_after_failure(handle, SandboxEvent::PauseAborted, &e)
                    .await;
                Err(e)
            }
        }
    }

    async fn resume_steps(&self, handle: &Arc<SandboxHandle>, op_id: &str) -> Result<(), ApiError> {
        let id = &handle.id;
        let from = self.begin(id, op_id, SandboxEvent::ResumeRequested, "resuming")?;
        if from == SandboxState::Paused {
            return match self.rt(id).resume(id).await {
                Ok(()) => {
                    self.complete(handle, op_id, SandboxEvent::Resumed, |_| {})
                        .await
                }
                Err(e) => {
                    let e = runtime_failed(&e);
                    self.settle_after_failure(handle, SandboxEvent::ResumeAbortedToPaused, &e)
                        .await;
                    Err(e)
                }
            };
        }
        // From a snapshot: listen first, restore, wait for the agent to dial back in.
        let rec = self.record(id).map_err(internal)?;
        self.update_op(op_id, |op| {
            op.progress = Some("restoring the snapshot".into())
        })
        .map_err(internal)?;
        let image = self.snapshot_dir(id);
        // Seen rarely under load on gVisor: a restored agent that never dials back in (it
        // connected once and closed before its hello, then nothing, even on a fresh
        // socket). The snapshot is untouched by a restore, so the sandbox is stopped and
        // restored from it once more; each attempt gets its share of the deadline.
        let mut connected = Err(ApiError::new(
            ErrorCode::AgentTimeout,
            "the restored sandbox's agent did not connect in time",
        ));
        for attempt in 1..=RESTORE_ATTEMPTS {
            if attempt > 1 {
                tracing::warn!(sandbox = %id, attempt, "the restored agent never dialled in; stopping the sandbox and restoring the snapshot again");
                let _ = self.rt(id).stop(id, &self.sandbox_dir(id)).await;
                handle.drop_connection();
                self.update_op(op_id, |op| {
                    op.progress = Some(format!("restoring the snapshot (attempt {attempt})"))
                })
                .map_err(internal)?;
            }
            self.start_listener(handle, &rec).map_err(|e| {
                ApiError::new(ErrorCode::Internal, format!("listening for the agent: {e}"))
            })?;
            let restored = self
                .rt(id)
                .restore(id, &self.sandbox_dir(id), &image)
                .await
                .map_err(|e| runtime_failed(&e));
            failpoint("resume:after_restore");
            if let Err(e) = restored {
                connected = Err(e);
                break;
            }
            // The agent was quiesced before the checkpoint and holds until woken.
            self.wake_agent(id).await;
            self.update_op(op_id, |op| {
                op.progress = Some("waiting for the agent".into())
            })
            .map_err(internal)?;
            if attempt == 1 && failpoint_active("resume:first_agent_never_dials") {
                tracing::warn!(sandbox = %id, "failpoint: taking the first restore's agent as never dialling in");
                continue;
            }
            // The wake again every few seconds, in case one was lost.
            let mut rx = handle.agent.subscribe();
            let deadline = tokio::time::Instant::now() + RESTORE_CONNECT_TIMEOUT;
            while tokio::time::Instant::now() < deadline {
                let left = deadline - tokio::time::Instant::now();
                if agent::wait_connected(&mut rx, left.min(RESTORE_REWAKE_EVERY))
                    .await
                    .is_ok()
                {
                    connected = Ok(());
                    break;
                }
                // A restored sandbox that stopped by itself (its agent crashed: runsc's
                // restore bug) will not dial in however long it is waited for.
                if matches!(
                    self.rt(id).status(id).await,
                    Ok(RuntimeStatus::Stopped | RuntimeStatus::Missing)
                ) {
                    break;
                }
                tracing::warn!(sandbox = %id, "the restored agent has not dialled in yet; waking it again");
                // A wake that was lost (or sent before the sandbox could take it) would
                // keep the agent holding for its whole hold time: send it again.
                self.wake_agent(id).await;
            }
            if connected.is_ok() {
                break;
            }
            self.log_silent_agent(id, "the restored agent never dialled in")
                .await;
        }
        if let Err(e) = connected {
            // The snapshot is untouched: go back to `suspended` so the resume can be retried
            // (on the same socket).
            handle.drop_connection();
            let _ = self.rt(id).stop(id, &self.sandbox_dir(id)).await;
            self.advance(id, SandboxEvent::ResumeAbortedToSuspended, |_| {})?;
            return Err(e);
        }
        self.complete(handle, op_id, SandboxEvent::Resumed, |r| {
            r.snapshot_dir = None;
            r.sandbox.cost.snapshot_bytes = None;
        })
        .await?;
        // The snapshot has served its purpose; the live sandbox is the truth now.
        let _ = space_store::offload(|| std::fs::remove_dir_all(&image));
        self.spawn_monitor(handle);
        self.touch(id);
        Ok(())
    }

    async fn suspend_steps(
        &self,
        handle: &Arc<SandboxHandle>,
        op_id: &str,
    ) -> Result<(), ApiError> {
        let id = &handle.id;
        // Spawns in flight finish first: a checkpoint taken while the agent starts a
        // process can leave a command the restored agent believes is running forever.
        let from = {
            let _no_spawns = handle.spawns.write().await;
            self.begin(id, op_id, SandboxEvent::SuspendRequested, "suspending")?
        };
        if from == SandboxState::Paused {
            if let Err(e) = self.rt(id).resume(id).await {
                let e = runtime_failed(&e);
                self.settle_after_failure(handle, SandboxEvent::SuspendAborted, &e)
                    .await;
                return Err(e);
            }
        }
        // A checkpoint cannot save an open host socket: close ours, and have the agent
        // drop its end. Its commands keep running and their output stays buffered.
        // An agent that is still dialling in (just after a server restart) is waited
        // for first: a checkpoint taken while it connects would catch a half-open socket.
        self.update_op(op_id, |op| {
            op.progress = Some("disconnecting the agent".into())
        })
        .map_err(internal)?;
        let mut rx = handle.agent.subscribe();
        let conn = match agent::wait_connected(&mut rx, QUIESCE_TIMEOUT).await {
            Ok(conn) => conn,
            Err(_) => {
                let e = ApiError::new(
                    ErrorCode::AgentUnavailable,
                    format!(
                        "the sandbox's agent is not connected (waited {}s); the sandbox keeps running",
                        QUIESCE_TIMEOUT.as_secs()
                    ),
                );
                self.settle_after_failure(handle, SandboxEvent::SuspendAborted, &e)
                    .await;
                return Err(e);
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(2), conn.quiesce()).await;
        drop(conn);
        let gone = matches!(
            tokio::time::timeout(QUIESCE_TIMEOUT, rx.wait_for(|c| c.is_none())).await,
            Ok(Ok(_))
        );
        if !gone {
            let e = ApiError::new(
                ErrorCode::AgentBusy,
                "the agent did not let go of its connection; the sandbox keeps running",
            );
            let rec = self.record(id).map_err(internal)?;
            let _ = self.start_listener(handle, &rec);
            handle.drop_connection();
            self.wake_agent(id).await;
            self.advance(id, SandboxEvent::SuspendAborted, |_| {})?;
            return Err(e);
        }
        self.update_op(op_id, |op| {
            op.progress = Some("writing the snapshot".into())
        })
        .map_err(internal)?;
        failpoint("suspend:before_checkpoint");
        let image = self.snapshot_dir(id);
        if let Err(e) = self.checkpoint_tried_again(id, &image).await {
            let e = runtime_failed(&e);
            let status = self.rt(id).status(id).await.ok();
            if status == Some(RuntimeStatus::Running) {
                let rec = self.record(id).map_err(internal)?;
                let _ = self.start_listener(handle, &rec);
                self.wake_agent(id).await;
                self.advance(id, SandboxEvent::SuspendAborted, |_| {})?;
            } else {
                self.fail_sandbox(handle, &format!("suspend failed: {}", e.message))
                    .await;
            }
            return Err(e);
        }
        failpoint("suspend:after_checkpoint");
        let bytes = space_store::offload(|| space_runtime::dir_size(&image));
        self.complete(handle, op_id, SandboxEvent::Suspended, |r| {
            r.snapshot_dir = Some(image.to_string_lossy().into_owned());
            r.sandbox.cost.snapshot_bytes = Some(bytes);
            r.sandbox.cost.memory_bytes = None;
        })
        .await?;
        tracing::info!(sandbox = %id, operation = %op_id, snapshot_bytes = bytes, "sandbox suspended");
        Ok(())
    }

    /// Checkpoints a quiesced sandbox into `image`, once more when the first attempt failed
    /// and left it running: runsc (2024-07-29) now and then fails a save that the next
    /// attempt makes (`checkpoint failed: 25`, seen twice in CI, each time right after the
    /// sandbox's egress traffic). The agent is still quiet meanwhile; a partial image goes.
    /// `SPACE_FAILPOINT=suspend:checkpoint_fails_once` (test hooks) fails the first attempt.
    async fn checkpoint_tried_again(
        &self,
        id: &str,
        image: &Path,
    ) -> std::result::Result<(), RuntimeError> {
        let first = match failpoint_active("suspend:checkpoint_fails_once") {
            true => Err(RuntimeError::io(
                "checkpoint (failpoint suspend:checkpoint_fails_once)",
                std::io::Error::other("failed on purpose"),
            )),
            false => self.checkpoint_once(id, image).await,
        };
        let Err(e) = first else {
            return Ok(());
        };
        if self.rt(id).status(id).await.ok() != Some(RuntimeStatus::Running) {
            return Err(e);
        }
        tracing::warn!(sandbox = %id, error = %error_chain(&e), "the checkpoint failed and the sandbox runs on; trying once more");
        self.checkpoint_once(id, image).await
    }

    async fn checkpoint_once(
        &self,
        id: &str,
        image: &Path,
    ) -> std::result::Result<(), RuntimeError> {
        let _ = space_store::offload(|| std::fs::remove_dir_all(image));
        self.rt(id)
            .checkpoint(id, &self.sandbox_dir(id), image)
            .await
    }

    /// After a failed pause/resume/suspend: if the sandbox still runs as before,
    /// go back (`event`); otherwise it is `failed`.
    async fn settle_after_failure(
        &self,
        handle: &Arc<SandboxHandle>,
        event: SandboxEvent,
        e: &ApiError,
    ) {
        let expected = match event {
            SandboxEvent::ResumeAbortedToPaused => RuntimeStatus::Paused,
            _ => RuntimeStatus::Running,
        };
        if self.rt(&handle.id).status(&handle.id).await.ok() == Some(expected)
            && self.advance(&handle.id, event, |_| {}).is_ok()
        {
            return;
        }
        self.fail_sandbox(handle, &e.message).await;
    }

    /// `POST /v1/operations/{id}/cancel`: an operation that has not started can be
    /// cancelled; one that runs cannot (it says so).
    pub(super) fn cancel_operation(&self, id: &str) -> Result<Operation> {
        let op = self.operation(id)?;
        if op.status.is_terminal() {
            return Err(ServiceError::Conflict(format!(
                "operation {id} has already ended ({})",
                op.status
            )));
        }
        let Some(token) = lock(&self.0.pending_ops).remove(id) else {
            return Err(ServiceError::Conflict(format!(
                "operation {id} is {} and can no longer be cancelled: only a pending operation can",
                op.status
            )));
        };
        token.cancel();
        let cancelled = |op: &mut Operation| {
            op.status = OperationStatus::Cancelled;
            op.error = Some(ApiError::new(
                ErrorCode::Cancelled,
                "the operation was cancelled",
            ));
            op.updated_at = now_rfc3339();
        };
        let op = match (op.kind, op.sandbox_id.clone()) {
            (OperationKind::Create, Some(sb)) => {
                let (_, op, ()) = self.modify_sandbox_and_op(&sb, id, |rec, op| {
                    rec.sandbox.state = SandboxState::Destroyed;
                    rec.sandbox.failure_reason = Some("create cancelled".into());
                    rec.sandbox.destroyed_at = Some(now_rfc3339());
                    rec.sandbox.updated_at = now_rfc3339();
                    cancelled(op);
                    Ok::<_, ServiceError>(())
                })?;
                self.forget_handle(&sb);
                op
            }
            _ => {
                self.modify_operation(id, |op| {
                    cancelled(op);
                    Ok::<_, ServiceError>(())
                })?
                .0
            }
        };
        tracing::info!(operation = %id, kind = %op.kind, "operation cancelled");
        Ok(op)
    }
}
