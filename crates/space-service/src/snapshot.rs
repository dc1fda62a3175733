//! `POST /v1/sandboxes/{id}/snapshot-template {name}`: a sandbox's current
//! filesystem becomes the next version of a template.
//!
//! The agent packs the sandbox's root (without /proc, /sys, /dev and /.space) as a
//! tar; the server unpacks that untrusted stream with `space_agent::fs` (one
//! directory descriptor at a time, no link followed out, no device nodes) into a
//! fresh layer of the template store, which then publishes it as a version. The
//! copy is taken live: the sandbox keeps running, so files that change during the
//! copy are caught at some point of their change.
//!
//! What the host writes is bounded by what the sandbox could hold: its template's
//! files plus its disk quota, sparse files counted at their full size (a sandbox
//! with a 64 MiB disk can hold a 100 GiB sparse file, and the copy carries its
//! zeros). Past that the snapshot fails and nothing is kept.

use space_agent_host::{self as agent, DownloadFormat};
use space_api::ErrorCode;
use space_api::{ApiError, Operation, OperationKind, OperationStatus, SandboxState};
use space_runtime::template::{DefaultResources, Template, TemplateError};

use super::{error_chain, new_operation, Result, Service, ServiceError};
use crate::ChannelReader;

/// Most a template made from a sandbox may hold.
const MAX_SNAPSHOT_BYTES: u64 = 64 << 30;
const MAX_SNAPSHOT_ENTRIES: u64 = 2_000_000;

impl Service {
    pub(super) fn snapshot_template(&self, sandbox_id: &str, name: &str) -> Result<Operation> {
        let rec = self.record(sandbox_id)?;
        if rec.sandbox.state != SandboxState::Running {
            return Err(ServiceError::Conflict(format!(
                "sandbox {sandbox_id} is {}: a template can be made from a running sandbox only",
                rec.sandbox.state
            )));
        }
        match self.0.templates.get(name) {
            Err(TemplateError::InvalidName(_)) => {
                return Err(ServiceError::BadRequest(format!(
                    "invalid template name {:?}: use 1 to 63 of a-z, 0-9, '.', '_' and '-'",
                    super::truncate(name, 80)
                )))
            }
            Ok(_) if space_runtime::template::TemplateStore::BUILTIN.contains(&name) => {
                return Err(ServiceError::Conflict(format!(
                    "{name} is a built-in template; choose another name"
                )))
            }
            _ => {}
        }
        let mut op = new_operation(OperationKind::Build, Some(sandbox_id), &rec.sandbox.tenant);
        op.template = Some(name.to_owned());
        self.0.store.insert_operation(&op)?;
        tracing::info!(sandbox = %sandbox_id, operation = %op.id, template = %name, "snapshot-template requested");
        let svc = self.clone();
        let (op_id, sb, name) = (op.id.clone(), sandbox_id.to_owned(), name.to_owned());
        tokio::spawn(async move {
            let result = svc.run_snapshot(&op_id, &sb, &name).await;
            let error = match result {
                Ok(t) => {
                    let _ = svc.update_op(&op_id, |op| {
                        op.status = OperationStatus::Succeeded;
                        op.progress = Some(format!("published {} {}", t.name, t.version));
                    });
                    return;
                }
                Err(e) => e,
            };
            tracing::warn!(operation = %op_id, error = %error.message, "snapshot-template failed");
            let _ = svc.finish_op(&op_id, Some(error));
        });
        Ok(op)
    }

    async fn run_snapshot(
        &self,
        op_id: &str,
        sandbox_id: &str,
        name: &str,
    ) -> std::result::Result<Template, ApiError> {
        let internal = |e: ServiceError| ApiError::new(ErrorCode::Internal, e.to_string());
        self.update_op(op_id, |op| {
            op.status = OperationStatus::Running;
            op.progress = Some("copying the sandbox's files".into());
        })
        .map_err(internal)?;
        let rec = self.record(sandbox_id).map_err(internal)?;
        let handle = self
            .live_handle(sandbox_id)
            .ok_or_else(|| ApiError::new(ErrorCode::Conflict, "the sandbox is not running"))?;
        let mut rx = handle.agent.subscribe();
        let conn = agent::wait_connected(&mut rx, std::time::Duration::from_secs(20))
            .await
            .map_err(|e| ApiError::new(ErrorCode::Unavailable, e.to_string()))?;
        let download = conn.download("/", DownloadFormat::Tar).await.map_err(|e| {
            match super::files::agent_failure(e) {
                ServiceError::Api(e) => ApiError::new(
                    ErrorCode::AgentError,
                    format!("the sandbox's agent refused the copy: {}", e.message),
                ),
                e => ApiError::new(ErrorCode::Unavailable, e.to_string()),
            }
        })?;
        self.touch(sandbox_id);

        // The download feeds a blocking unpacker through a small queue (bounded memory);
        // an error trailer from the agent, or a broken stream, fails the reader.
        let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Vec<u8>>>(8);
        let mut body = download.body;
        let pump = tokio::spawn(async move {
            use futures::StreamExt;
            while let Some(item) = body.next().await {
                let item = item.map(|data| data.to_vec()).map_err(|e| {
                    std::io::Error::other(format!("the copy failed: {}", error_chain(&e)))
                });
                let failed = item.is_err();
                if tx.send(item).await.is_err() || failed {
                    return;
                }
            }
        });
        let key: String = format!("snapshot:{op_id}")
            .bytes()
            .map(|b| format!("{b:02x}"))
            .collect();
        let r = &rec.sandbox.resources;
        let meta = Template {
            name: name.to_owned(),
            version: String::new(),
            rootfs: Default::default(),
            env: rec.template_env.clone(),
            workdir: rec.template_workdir.clone(),
            user: rec.template_user.clone(),
            size_bytes: 0,
            created_at: String::new(),
            layer: None,
            resources: Some(DefaultResources {
                vcpus: r.vcpus,
                memory_mib: r.memory_mib,
                disk_mib: r.disk_mib,
                pids: r.pids,
            }),
            start: None,
            base: Some(format!("sandbox:{sandbox_id}")),
        };
        let lower = {
            let rootfs = std::path::PathBuf::from(&rec.rootfs);
            tokio::task::spawn_blocking(move || space_runtime::tree::apparent_size(&rootfs))
                .await
                .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?
                .map_err(|e| {
                    ApiError::new(ErrorCode::Internal, format!("measuring the template: {e}"))
                })?
        };
        let quota = r.disk_mib.unwrap_or(0).saturating_mul(1 << 20);
        let max_bytes = lower.saturating_add(quota).min(MAX_SNAPSHOT_BYTES);
        let too_large = format!(
            "the sandbox's files add up to more than {} MiB, what it can hold: its template ({} MiB) plus its disk quota ({} MiB); sparse files count at their full size",
            max_bytes >> 20,
            lower >> 20,
            quota >> 20
        );
        let fill = move |rootfs: &std::path::Path| {
            let root = space_agent::fs::Root::open(rootfs).map_err(|e| TemplateError::Build {
                name: "snapshot".into(),
                message: e.message(),
            })?;
            let limits = space_agent::fs::Limits {
                max_bytes,
                max_entries: MAX_SNAPSHOT_ENTRIES,
                ..Default::default()
            };
            root.unpack_tar(ChannelReader::new(rx), &limits)
                .map(|_| ())
                .map_err(|e| TemplateError::Build {
                    name: "snapshot".into(),
                    message: match e {
                        space_agent::fs::FsError::TooLarge(_) => too_large,
                        e => format!("unpacking the sandbox's files: {}", e.message()),
                    },
                })
        };
        let published = self.0.templates.publish_rootfs(&key, fill, meta).await;
        pump.abort();
        let (template, _) =
            published.map_err(|e| ApiError::new(ErrorCode::SnapshotFailed, error_chain(&e)))?;
        tracing::info!(sandbox = %sandbox_id, template = %template.name, version = %template.version, "template made from a sandbox");
        Ok(template)
    }
}
