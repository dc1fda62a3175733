//! Restart: bring the store in line with what really runs, before serving.
//!
//! Every sandbox ends up in a real state and every operation ends
//! `succeeded` or `failed`. Live sandboxes are re-adopted (their agents dial
//! back in, their command sessions resume from the stored offsets); vanished
//! ones are `failed`; half-done operations are finished or rolled back
//! according to what the runtime says; leftovers nobody owns are removed.

use space_api::ErrorCode;
use space_api::{ApiError, OperationKind, OperationStatus, SandboxState};
use space_core::runtime::RuntimeStatus;
use space_core::SandboxEvent;
use space_store::SandboxRecord;

use super::{lock, new_operation, Service};

impl Service {
    pub(crate) async fn reconcile(&self) -> anyhow::Result<()> {
        // What each interrupted operation's sandbox turned out to be decides how it ends.
        let mut outcome: Vec<(String, Option<ApiError>)> = Vec::new();
        let interrupted = |what: &str| {
            Some(ApiError::new(
                ErrorCode::Interrupted,
                format!("the server restarted during the {what}; it did not happen"),
            ))
        };
        let unfinished = self.0.store.unfinished_operations()?;
        let op_of = |sb: &str| {
            unfinished
                .iter()
                .filter(|o| o.sandbox_id.as_deref() == Some(sb))
                .map(|o| o.id.clone())
                .collect::<Vec<_>>()
        };

        for rec in self.0.store.list_sandboxes()? {
            let id = rec.sandbox.id.clone();
            let status = match rec.sandbox.state {
                SandboxState::Destroyed | SandboxState::Failed => None,
                _ => Some(
                    self.rt(&id)
                        .status(&id)
                        .await
                        .unwrap_or(RuntimeStatus::Missing),
                ),
            };
            let live = matches!(status, Some(RuntimeStatus::Running | RuntimeStatus::Paused));
            let image = self.snapshot_dir(&id);
            match rec.sandbox.state {
                SandboxState::Destroyed => {}
                SandboxState::Failed => self.lose_commands(&id, "the sandbox failed"),
                SandboxState::Creating => {
                    let handle = self.handle(&id);
                    self.fail_sandbox(
                        &handle,
                        "the server restarted while the sandbox was being created",
                    )
                    .await;
                    for op in op_of(&id) {
                        outcome.push((op, interrupted("create")));
                    }
                }
                // Destroys are finished below, after everything else is settled.
                SandboxState::Destroying => {}
                SandboxState::Pausing | SandboxState::Resuming | SandboxState::Suspending
                    if live =>
                {
                    // The runtime says where it got to.
                    let paused = status == Some(RuntimeStatus::Paused);
                    let (event, ok) = match (rec.sandbox.state, paused) {
                        (SandboxState::Pausing, true) => (SandboxEvent::Paused, true),
                        (SandboxState::Pausing, false) => (SandboxEvent::PauseAborted, false),
                        (SandboxState::Resuming, false) => (SandboxEvent::Resumed, true),
                        (SandboxState::Resuming, true) => {
                            (SandboxEvent::ResumeAbortedToPaused, false)
                        }
                        // Still running: the checkpoint did not happen.
                        _ => (SandboxEvent::SuspendAborted, false),
                    };
                    let _ = self.advance(&id, event, |r| {
                        if event == SandboxEvent::Resumed {
                            r.snapshot_dir = None;
                        }
                    });
                    if event == SandboxEvent::SuspendAborted && paused {
                        let _ = self.rt(&id).resume(&id).await;
                    }
                    self.adopt(&self.record(&id)?)?;
                    let what = rec.sandbox.state.to_string();
                    for op in op_of(&id) {
                        outcome.push((op, if ok { None } else { interrupted(&what) }));
                    }
                }
                SandboxState::Suspending | SandboxState::Resuming | SandboxState::Suspended
                    if self.rt(&id).snapshot_complete(&image) =>
                {
                    // The sandbox is on disk: a finished suspend, or a resume that did not start.
                    let _ = self.rt(&id).stop(&id, &self.sandbox_dir(&id)).await;
                    let was = rec.sandbox.state;
                    let bytes = space_runtime::dir_size(&image);
                    let event = match was {
                        SandboxState::Suspending => Some(SandboxEvent::Suspended),
                        SandboxState::Resuming => Some(SandboxEvent::ResumeAbortedToSuspended),
                        _ => None,
                    };
                    if let Some(event) = event {
                        let _ = self.advance(&id, event, |r| {
                            r.snapshot_dir = Some(image.to_string_lossy().into_owned());
                            r.sandbox.cost.snapshot_bytes = Some(bytes);
                        });
                    }
                    self.adopt(&self.record(&id)?)?;
                    for op in op_of(&id) {
                        let ok = was == SandboxState::Suspending;
                        outcome.push((op, if ok { None } else { interrupted("resume") }));
                    }
                }
                SandboxState::Running | SandboxState::Paused if live => {
                    let mut rec = rec.clone();
                    rec.sandbox.state = if status == Some(RuntimeStatus::Running) {
                        SandboxState::Running
                    } else {
                        SandboxState::Paused
                    };
                    // Nothing else runs yet: this write cannot lose a race.
                    self.0.store.update_sandbox(&mut rec)?;
                    self.adopt(&rec)?;
                    for op in op_of(&id) {
                        outcome.push((op, interrupted("operation")));
                    }
                }
                state => {
                    let handle = self.handle(&id);
                    let reason = if state == SandboxState::Suspended {
                        "its snapshot is missing"
                    } else {
                        "the sandbox vanished while the server was down"
                    };
                    tracing::warn!(sandbox = %id, %state, reason, "sandbox lost");
                    self.fail_sandbox(&handle, reason).await;
                    for op in op_of(&id) {
                        outcome.push((op, interrupted(&state.to_string())));
                    }
                }
            }
        }

        // Unfinished operations: destroys run to the end; the rest end as decided above.
        for op in &unfinished {
            let sandbox = op.sandbox_id.as_deref().and_then(|s| self.record(s).ok());
            if op.kind == OperationKind::Destroy {
                match sandbox {
                    Some(rec) if rec.sandbox.state != SandboxState::Destroyed => {
                        self.redo_destroy(&rec, Some(op.id.clone())).await?;
                    }
                    _ => {
                        self.finish_op(&op.id, None)?;
                    }
                }
                continue;
            }
            let decided = outcome.iter().find(|(o, _)| *o == op.id);
            let error = match decided {
                Some((_, e)) => e.clone(),
                None => interrupted(&op.kind.to_string()),
            };
            // An operation that never started (pending) did not happen at all.
            let error = if op.status == OperationStatus::Pending {
                interrupted(&op.kind.to_string())
            } else {
                error
            };
            self.finish_op(&op.id, error)?;
        }
        // A sandbox left `destroying` without an operation is finished too.
        for rec in self.0.store.list_sandboxes()? {
            if rec.sandbox.state == SandboxState::Destroying {
                self.redo_destroy(&rec, None).await?;
            }
        }

        // Leftovers nobody owns: containers and directories of sandboxes not live here.
        let live: Vec<String> = lock(&self.0.sandboxes).keys().cloned().collect();
        for rt in self.0.runtimes.available() {
            for cid in rt.list().await.unwrap_or_default() {
                if !live.contains(&cid) {
                    tracing::warn!(sandbox = %cid, runtime = rt.name(), "removing a leftover sandbox");
                    let _ = rt.destroy(&cid, &self.sandbox_dir(&cid)).await;
                }
            }
        }
        for dir in ["sandboxes", "snapshots"] {
            if let Ok(entries) = std::fs::read_dir(self.0.cfg.data_dir.join(dir)) {
                for e in entries.flatten() {
                    let name = e.file_name().to_string_lossy().into_owned();
                    if !live.contains(&name) {
                        // A crash may have left its disk and its read-only binds mounted
                        // there; never remove through one (the template is below a bind).
                        let path = e.path();
                        let _ = space_runtime::disk::unmount_below(&path).await;
                        if space_runtime::disk::ensure_nothing_mounted_below(&path).is_ok() {
                            let _ = std::fs::remove_dir_all(&path);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Runs a destroy to the end during reconcile (with its operation, or a new one).
    async fn redo_destroy(&self, rec: &SandboxRecord, op: Option<String>) -> anyhow::Result<()> {
        let op_id = match op {
            Some(o) => o,
            None => {
                let op = new_operation(
                    OperationKind::Destroy,
                    Some(&rec.sandbox.id),
                    &rec.sandbox.tenant,
                );
                self.0.store.insert_operation(&op)?;
                op.id
            }
        };
        let handle = self.handle(&rec.sandbox.id);
        lock(&handle.ops).push((op_id.clone(), OperationKind::Destroy));
        let token = tokio_util::sync::CancellationToken::new();
        lock(&self.0.pending_ops).insert(op_id.clone(), token.clone());
        self.run_lifecycle(handle, op_id, OperationKind::Destroy, token)
            .await;
        Ok(())
    }

    /// Takes over a sandbox that outlived the server: running, paused or suspended.
    pub(crate) fn adopt(&self, rec: &SandboxRecord) -> anyhow::Result<()> {
        let handle = self.handle(&rec.sandbox.id);
        if rec.sandbox.state != SandboxState::Suspended {
            self.start_listener(&handle, rec)?;
            self.spawn_monitor(&handle);
            // A server that died between a quiesce and its checkpoint left the agent holding.
            // The wake holds the lifecycle lock: a suspend asked for meanwhile quiesces the
            // agent only after it, so the wake cannot end that quiesce's hold and have the
            // agent dial in while it is checkpointed.
            if rec.sandbox.state == SandboxState::Running {
                let (svc, handle) = (self.clone(), handle.clone());
                tokio::spawn(async move {
                    let _lifecycle = handle.lifecycle.lock().await;
                    svc.wake_agent(&handle.id).await
                });
            }
            tracing::info!(sandbox = %rec.sandbox.id, "re-adopting sandbox; waiting for its agent");
        }
        // Sessions wait for the agent (now, or after a resume) and re-attach from their offsets.
        for cmd in self.0.store.list_commands(&rec.sandbox.id)? {
            if !cmd.state.is_terminal() {
                self.resume_command_session(&handle, cmd);
            }
        }
        Ok(())
    }
}
