//! Templates: builds from recipes (a `build` operation with a log file), listing, deleting,
//! and a template's start command in each new sandbox.

use space_api::ErrorCode;
use std::path::PathBuf;
use std::time::Duration;

use space_api::{
    ApiError, CreateCommandRequest, Operation, OperationKind, OperationStatus, SandboxState,
};
use space_core::now_rfc3339;
use space_runtime::build::{self, Base, BuildLog, Builder, Recipe, RecipeError, ValidRecipe};
use space_runtime::template::{StartSpec, TemplateError};

use super::{error_chain, new_operation, Result, Service, ServiceError};

/// How often a template's ready check runs.
const READY_INTERVAL: Duration = Duration::from_millis(200);
const DEFAULT_READY_TIMEOUT_SECONDS: u64 = 30;
/// Lines of the start command's output in a `start_failed` error.
const START_TAIL_LINES: usize = 20;

impl Service {
    /// Where the build log of operation `op_id` is kept.
    pub(super) fn build_log_path(&self, op_id: &str) -> PathBuf {
        self.0
            .cfg
            .data_dir
            .join("builds")
            .join(format!("{op_id}.log"))
    }

    /// `GET /v1/operations/{id}/log`: the build log of `op_id` as a stream of bytes, read
    /// a chunk at a time (never whole into memory), from where its kept part starts (a
    /// capped log says how much of its head was dropped); with `follow`, until the build has
    /// ended.
    pub(super) fn build_log_stream(
        &self,
        op_id: &str,
        follow: bool,
    ) -> Result<impl futures::Stream<Item = std::io::Result<bytes::Bytes>> + Send + 'static> {
        self.operation(op_id)?;
        let path = self.build_log_path(op_id);
        let file = match std::fs::File::open(&path) {
            Ok(f) => std::sync::Arc::new(f),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ServiceError::NotFound(format!(
                    "operation {op_id} has no log (only template builds have one)"
                )))
            }
            Err(e) => return Err(ServiceError::Internal(format!("opening the log: {e}"))),
        };
        let svc = self.clone();
        let id = op_id.to_owned();
        let cap_mib = self.0.cfg.output_cap_bytes >> 20;
        Ok(futures::stream::unfold(
            (0u64, false),
            move |(pos, done)| {
                let (svc, id, file) = (svc.clone(), id.clone(), file.clone());
                async move {
                    if done {
                        return None;
                    }
                    let mut events = svc.subscribe_events();
                    loop {
                        // Looked at before reading, so what was written before the end is read.
                        let ended = !follow
                            || svc
                                .operation(&id)
                                .map(|op| op.status.is_terminal())
                                .unwrap_or(true);
                        let f = file.clone();
                        let read = tokio::task::spawn_blocking(move || read_log_chunk(&f, pos))
                            .await
                            .map_err(std::io::Error::other)
                            .and_then(|r| r);
                        match read {
                            Err(e) => return Some((Err(e), (pos, true))),
                            Ok(LogChunk::Dropped(start)) => {
                                let note = format!(
                                    "[space: {} bytes at the head of this log were dropped; it keeps its last {cap_mib} MiB]\n",
                                    start - pos
                                );
                                return Some((Ok(bytes::Bytes::from(note)), (start, false)));
                            }
                            Ok(LogChunk::Data(data)) => {
                                let next = pos + data.len() as u64;
                                return Some((Ok(bytes::Bytes::from(data)), (next, false)));
                            }
                            Ok(LogChunk::End) if ended => return None,
                            Ok(LogChunk::End) => {}
                        }
                        // Output has no event of its own: wake on any event, or poll.
                        let _ = tokio::time::timeout(Duration::from_millis(250), events.changed())
                            .await;
                    }
                }
            },
        ))
    }

    /// `POST /v1/templates`: checks the recipe and starts a `build` operation.
    pub(super) fn build_template(&self, tenant: &str, recipe: Recipe) -> Result<Operation> {
        let recipe =
            build::validate(recipe, &self.0.cfg.template_import_dirs).map_err(|e| match e {
                RecipeError::Invalid(m) => ServiceError::BadRequest(m),
                RecipeError::Forbidden(m) => ServiceError::Forbidden(m),
            })?;
        if let Base::Template(base) = &recipe.base {
            match self.0.templates.get(base) {
                Ok(_) => {}
                Err(TemplateError::UnknownTemplate(_) | TemplateError::InvalidName(_)) => {
                    return Err(ServiceError::BadRequest(format!(
                        "unknown base template {base:?}"
                    )))
                }
                Err(e) => return Err(ServiceError::Internal(error_chain(&e))),
            }
        }
        let mut op = new_operation(OperationKind::Build, None, tenant);
        op.template = Some(recipe.name().to_owned());
        let log = BuildLog::create(&self.build_log_path(&op.id), self.0.cfg.output_cap_bytes)
            .map_err(|e| ServiceError::Internal(format!("creating the build log: {e}")))?;
        self.0.store.insert_operation(&op)?;
        tracing::info!(operation = %op.id, template = %recipe.name(), base = %recipe.recipe.base, "template build requested");
        let svc = self.clone();
        let op_id = op.id.clone();
        tokio::spawn(async move { svc.run_build(op_id, recipe, log).await });
        Ok(op)
    }

    async fn run_build(&self, op_id: String, recipe: ValidRecipe, log: BuildLog) {
        let _ = self.update_op(&op_id, |op| {
            op.status = OperationStatus::Running;
            op.progress = Some("starting the build".into());
        });
        log.line(&format!(
            "==> building template {} from {}",
            recipe.name(),
            recipe.recipe.base
        ));
        let runtime = match self.0.runtimes.get(&self.0.cfg.build_runtime) {
            Ok(rt) => rt.clone(),
            Err(why) => {
                let error = ApiError::new(
                    ErrorCode::BuildFailed,
                    format!(
                        "template builds run on the {} runtime: {why}",
                        self.0.cfg.build_runtime
                    ),
                );
                log.line(&format!("==> build failed: {}", error.message));
                let _ = self.finish_op(&op_id, Some(error));
                return;
            }
        };
        let builder = Builder {
            runtime,
            agent_dir: self.0.cfg.agent_dir.clone(),
            limits: self.0.cfg.build_limits,
        };
        let progress = |line: String| {
            let _ = self.update_op(&op_id, |op| op.progress = Some(line.clone()));
        };
        let limit = self.deadline(OperationKind::Build);
        let result = tokio::time::timeout(
            limit,
            builder.build(&self.0.templates, &recipe, &log, &progress),
        )
        .await;
        let error = match result {
            Ok(Ok((template, new))) => {
                tracing::info!(operation = %op_id, template = %template.name, version = %template.version, new, "template built");
                let _ = self.update_op(&op_id, |op| {
                    op.status = OperationStatus::Succeeded;
                    op.progress = Some(if new {
                        format!("built {} {}", template.name, template.version)
                    } else {
                        format!("unchanged: {} {}", template.name, template.version)
                    });
                });
                return;
            }
            Ok(Err(e)) => ApiError::new(ErrorCode::BuildFailed, error_chain(&e)),
            Err(_) => ApiError::new(
                ErrorCode::TimedOut,
                format!(
                    "the build did not finish within {}s; last lines of the build log:\n{}",
                    limit.as_secs(),
                    log.tail()
                ),
            ),
        };
        log.line(&format!("==> build failed: {}", error.message));
        tracing::warn!(operation = %op_id, error = %error.message, "template build failed");
        let _ = self.finish_op(&op_id, Some(error));
    }

    /// Removes what builds of a killed server left running: build containers and VMs, on
    /// every runtime (the build runtime may have been another one then). Reconcile has failed
    /// their operations; their half-built layers are removed by [`build::sweep_abandoned_layers`].
    pub(super) async fn remove_build_leftovers(&self) {
        for rt in self.0.runtimes.available() {
            rt.remove_build_leftovers().await;
        }
    }

    /// `GET /v1/templates`.
    pub(super) fn list_templates(&self) -> Result<Vec<space_api::Template>> {
        let list = self
            .0
            .templates
            .list()
            .map_err(|e| ServiceError::Internal(error_chain(&e)))?;
        Ok(list
            .into_iter()
            .map(|t| space_api::Template {
                name: t.name,
                ready: t.ready,
                builtin: t.builtin,
                version: t.template.as_ref().map(|x| x.version.clone()),
                size_bytes: t.template.as_ref().map(|x| x.size_bytes),
                created_at: t.template.as_ref().map(|x| x.created_at.clone()),
                base: t.template.as_ref().and_then(|x| x.base.clone()),
                versions: t.versions,
            })
            .collect())
    }

    /// `DELETE /v1/templates/{name}`: every version, unless a sandbox that is not destroyed
    /// uses one (409). Built-in templates are refused (409).
    pub(super) async fn delete_template(&self, name: &str) -> Result<()> {
        let not_found = || ServiceError::NotFound(format!("no template {name:?}"));
        match self.0.templates.get(name) {
            Ok(_) => {}
            Err(TemplateError::UnknownTemplate(_) | TemplateError::InvalidName(_)) => {
                return Err(not_found())
            }
            Err(e) => return Err(ServiceError::Internal(error_chain(&e))),
        }
        if space_runtime::template::TemplateStore::BUILTIN.contains(&name) {
            return Err(ServiceError::Conflict(format!(
                "template {name} is built in and cannot be deleted"
            )));
        }
        if let Some(user) = self
            .0
            .store
            .list_sandboxes()?
            .into_iter()
            .find(|r| r.sandbox.template == name && r.sandbox.state != SandboxState::Destroyed)
        {
            return Err(ServiceError::Conflict(format!(
                "template {name} is in use by sandbox {} ({}, version {}): destroy it first",
                user.sandbox.id, user.sandbox.state, user.sandbox.template_version
            )));
        }
        match self.0.templates.delete(name).await {
            Ok(()) => {
                tracing::info!(template = name, "template deleted");
                Ok(())
            }
            Err(TemplateError::UnknownTemplate(_)) => Err(not_found()),
            Err(TemplateError::Builtin(_)) => Err(ServiceError::Conflict(format!(
                "template {name} is built in and cannot be deleted"
            ))),
            Err(e) => Err(ServiceError::Internal(error_chain(&e))),
        }
    }

    /// Starts a template's start command in a running sandbox and waits for its ready check.
    pub(super) async fn run_template_start(
        &self,
        sandbox_id: &str,
        op_id: &str,
        start: &StartSpec,
    ) -> Result<(), ApiError> {
        let failed = |m: String| ApiError::new(ErrorCode::StartFailed, m);
        let _ = self.update_op(op_id, |op| {
            op.progress = Some("starting the template's start command".into())
        });
        let cmd = self
            .create_command(
                sandbox_id,
                CreateCommandRequest {
                    shell: Some(start.run.clone()),
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| failed(format!("the start command could not start: {e}")))?;
        let Some(ready) = &start.ready else {
            return Ok(());
        };
        let timeout = ready
            .timeout_seconds
            .unwrap_or(DEFAULT_READY_TIMEOUT_SECONDS);
        let _ = self.update_op(op_id, |op| {
            op.progress = Some(format!(
                "waiting for the ready check (up to {timeout}s): {}",
                super::truncate(&ready.run, 100)
            ))
        });
        let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout);
        let mut last;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let check = self
                .create_command(
                    sandbox_id,
                    CreateCommandRequest {
                        shell: Some(ready.run.clone()),
                        wait: Some(true),
                        timeout_seconds: Some(left.as_secs().max(1)),
                        ..Default::default()
                    },
                )
                .await;
            match check {
                Ok(c) if c.result.as_ref().is_some_and(|r| r.exit_code == Some(0)) => {
                    let _ = self.update_op(op_id, |op| {
                        op.progress = Some("the ready check passed".into())
                    });
                    return Ok(());
                }
                Ok(c) => {
                    last = format!(
                        "{}{}",
                        c.stdout.unwrap_or_default(),
                        c.stderr.unwrap_or_default()
                    )
                }
                Err(e) => last = e.to_string(),
            }
            if tokio::time::Instant::now() + READY_INTERVAL >= deadline {
                break;
            }
            tokio::time::sleep(READY_INTERVAL).await;
        }
        let dir = self.outputs_root().join(sandbox_id).join(&cmd.id);
        let out = build::tail_of(&dir.join("stdout"), START_TAIL_LINES);
        let err = build::tail_of(&dir.join("stderr"), START_TAIL_LINES);
        Err(failed(format!(
            "the ready check `{}` did not pass within {timeout}s (at {}); last check said: {}\nstart command stdout (tail):\n{out}\nstderr (tail):\n{err}",
            super::truncate(&ready.run, 200),
            now_rfc3339(),
            super::truncate(last.trim(), 1000),
        )))
    }
}

enum LogChunk {
    /// The head up to this offset was dropped (the log is capped).
    Dropped(u64),
    Data(Vec<u8>),
    /// Nothing more for now.
    End,
}

/// The next piece of a build log from `pos`.
fn read_log_chunk(file: &std::fs::File, pos: u64) -> std::io::Result<LogChunk> {
    use std::os::unix::fs::FileExt;
    let start = build::log_data_start(file);
    let len = file.metadata()?.len();
    if pos < start.min(len) {
        return Ok(LogChunk::Dropped(start.min(len)));
    }
    let mut buf = vec![0u8; 64 * 1024];
    let n = file.read_at(&mut buf, pos)?;
    if n == 0 {
        return Ok(LogChunk::End);
    }
    buf.truncate(n);
    Ok(LogChunk::Data(buf))
}
