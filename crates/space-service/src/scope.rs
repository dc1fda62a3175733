//! The service as one tenant sees it: every action a front door may take.
//!
//! A front door (the v1 HTTP API, and the E2B API and MCP server that come
//! next) authenticates a [`Principal`](super::tenancy::Principal), then calls
//! [`Service::for_tenant`] and one method per action. Each method checks
//! ownership *here*, on the decoded id of what it acts on: another tenant's
//! sandbox, operation, command or template, an id that does not parse, and one
//! that does not exist all answer the same 404, and nothing is changed. The
//! unscoped methods of [`Service`] are private to the service module.

use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use space_api::{
    ApiError, Command, CreateCommandRequest, CreateSandboxRequest, ErrorCode, Event, FileInfo,
    FileListing, KeepaliveRequest, MkdirRequest, MoveRequest, Operation, Removed, Sandbox,
    Template,
};
use space_runtime::build::{Recipe, MAX_RECIPE_BYTES};
use space_store::SandboxRecord;
use tokio::sync::mpsc;

use super::files::{Download, DownloadFormat, UploadKind, UploadStream, Uploaded};
use super::tenancy::{template_visible, Permit, Tenant};
use super::{truncate, CommandOutputQuery, OutputEvent, Result, Service, ServiceError};

/// How many access tokens a sandbox keeps (each E2B create or connect issues one).
pub const ACCESS_TOKENS_KEPT: usize = 32;
/// What every access token starts with.
pub const ACCESS_TOKEN_PREFIX: &str = "sat_";

/// Largest stdin write one call may carry.
pub const MAX_STDIN_WRITE: usize = 1 << 20;

/// The service, acting for one tenant. Cheap; make one per request.
#[derive(Clone, Copy)]
pub struct TenantService<'a> {
    svc: &'a Service,
    tenant: &'a Tenant,
}

impl Service {
    /// Everything `tenant` may do, with ownership checked on every call.
    pub fn for_tenant<'a>(&'a self, tenant: &'a Tenant) -> TenantService<'a> {
        TenantService { svc: self, tenant }
    }
}

fn no_sandbox(id: &str) -> ServiceError {
    ServiceError::NotFound(format!("no sandbox {}", truncate(id, 64)))
}

fn no_operation(id: &str) -> ServiceError {
    ServiceError::NotFound(format!("no operation {}", truncate(id, 64)))
}

fn no_template(name: &str) -> ServiceError {
    ServiceError::NotFound(format!("no template {:?}", truncate(name, 64)))
}

/// A [`TenantService`] that owns its parts, to move into a blocking task.
pub(super) struct Owned {
    svc: Service,
    tenant: Tenant,
}

impl Owned {
    pub(super) fn scoped(&self) -> TenantService<'_> {
        self.svc.for_tenant(&self.tenant)
    }
}

/// Runs store reads and filesystem work off the async threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ServiceError::Internal(format!("a blocking task failed: {e}")))?
}

impl<'a> TenantService<'a> {
    pub(crate) fn parts(&self) -> (&'a Service, &'a Tenant) {
        (self.svc, self.tenant)
    }

    pub(super) fn owned(&self) -> Owned {
        Owned {
            svc: self.svc.clone(),
            tenant: self.tenant.clone(),
        }
    }

    /// The caller's sandbox `id`, or the one 404 for unknown, foreign and malformed ids.
    pub(super) fn sandbox(&self, id: &str) -> Result<SandboxRecord> {
        if !space_core::is_valid_id(id, "sb") {
            return Err(no_sandbox(id));
        }
        match self.svc.0.store.get_sandbox(id)? {
            Some(rec) if rec.sandbox.tenant == self.tenant.as_str() => Ok(rec),
            _ => Err(no_sandbox(id)),
        }
    }

    /// The caller's sandbox `id` and a well-formed command id in it.
    fn command(&self, id: &str, cid: &str) -> Result<SandboxRecord> {
        let rec = self.sandbox(id)?;
        if !space_core::is_valid_id(cid, "cmd") {
            return Err(ServiceError::NotFound(format!(
                "no command {} in sandbox {id}",
                truncate(cid, 64)
            )));
        }
        Ok(rec)
    }

    /// The caller's operation `id`.
    fn operation(&self, id: &str) -> Result<Operation> {
        if !space_core::is_valid_id(id, "op") {
            return Err(no_operation(id));
        }
        match self.svc.0.store.get_operation(id)? {
            Some(op) if op.tenant == self.tenant.as_str() => Ok(op),
            _ => Err(no_operation(id)),
        }
    }

    /// Whether the caller may see and use the template `name` (built in, or its own).
    fn template_visible(&self, name: &str) -> Result<bool> {
        template_visible(self.svc.0.store.as_ref(), self.tenant, name)
    }

    /// 404 unless `id` is the caller's sandbox.
    pub fn check_sandbox(&self, id: &str) -> Result<()> {
        self.sandbox(id).map(drop)
    }

    /// 404 unless `id` is the caller's sandbox and `cid` could be a command in it.
    pub fn check_command(&self, id: &str, cid: &str) -> Result<()> {
        self.command(id, cid).map(drop)
    }

    /// 404 unless `id` is the caller's operation.
    pub fn check_operation(&self, id: &str) -> Result<()> {
        self.operation(id).map(drop)
    }

    /// 404 unless the caller may see the template `name`.
    pub fn check_template(&self, name: &str) -> Result<()> {
        match self.template_visible(name)? {
            true => Ok(()),
            false => Err(no_template(name)),
        }
    }

    // ---- sandboxes ----

    /// `POST /v1/sandboxes`: admitted against the tenant's sandbox count and create rate.
    pub async fn create_sandbox(&self, req: CreateSandboxRequest) -> Result<Operation> {
        self.svc
            .admit_create(self.tenant, || async {
                // Another tenant's template is as unknown as one that does not exist.
                let name = req.template.trim();
                if !self.template_visible(name)? {
                    return Err(ServiceError::NotFound(format!(
                        "unknown template {:?}",
                        truncate(name, 64)
                    )));
                }
                let rec = self.svc.prepare_create(self.tenant.as_str(), req)?;
                // A warm pool's ready sandbox, when one matches; else one boots.
                if let Some(op) = self.svc.claim_pooled(&rec).await {
                    return Ok(op);
                }
                // A claim above adds nothing resident; a boot must fit the server.
                self.svc.admit_resident(|| self.svc.start_create(rec))
            })
            .await
    }

    pub async fn get_sandbox(&self, id: &str) -> Result<Sandbox> {
        let (scope, id) = (self.owned(), id.to_string());
        blocking(move || {
            let rec = scope.scoped().sandbox(&id)?;
            Ok(scope.svc.decorate(rec.sandbox))
        })
        .await
    }

    /// The tenant's sandboxes, optionally only those carrying all of `labels`.
    pub async fn list_sandboxes(&self, labels: Vec<(String, String)>) -> Result<Vec<Sandbox>> {
        let scope = self.owned();
        blocking(move || scope.svc.list_sandboxes(scope.tenant.as_str(), &labels)).await
    }

    pub fn destroy_sandbox(&self, id: &str) -> Result<Operation> {
        self.sandbox(id)?;
        self.svc.destroy_sandbox(id)
    }

    pub fn pause(&self, id: &str) -> Result<Operation> {
        self.sandbox(id)?;
        self.svc.pause(id)
    }

    pub fn resume(&self, id: &str) -> Result<Operation> {
        self.sandbox(id)?;
        self.svc.resume(id)
    }

    pub fn suspend(&self, id: &str) -> Result<Operation> {
        self.sandbox(id)?;
        self.svc.suspend(id)
    }

    pub fn keepalive(&self, id: &str, req: KeepaliveRequest) -> Result<Sandbox> {
        self.sandbox(id)?;
        self.svc.keepalive(id, req)
    }

    /// `POST /v1/sandboxes/{id}/snapshot-template {name}`: the name becomes the tenant's.
    pub async fn snapshot_template(&self, id: &str, name: &str) -> Result<Operation> {
        self.sandbox(id)?;
        self.svc
            .admit_build(self.tenant, || {
                let claimed = self.svc.claim_template(self.tenant, name)?;
                let r = self.svc.snapshot_template(id, name);
                if r.is_err() && claimed {
                    self.svc.unclaim_template(name);
                }
                r
            })
            .await
    }

    // ---- commands ----

    /// `POST /v1/sandboxes/{id}/commands`: admitted against the sandbox's and the
    /// tenant's running commands.
    pub async fn create_command(&self, id: &str, req: CreateCommandRequest) -> Result<Command> {
        self.sandbox(id)?;
        let tenant = self.tenant;
        self.svc
            .create_command_admitted(id, req, || self.svc.admit_command(tenant, id))
            .await
    }

    pub fn list_commands(&self, id: &str) -> Result<Vec<Command>> {
        self.sandbox(id)?;
        self.svc.list_commands(id)
    }

    /// The command once it has ended, or as it is after `wait`.
    pub async fn get_command(&self, id: &str, cid: &str, wait: Duration) -> Result<Command> {
        self.command(id, cid)?;
        self.svc.wait_command(id, cid, Some(wait)).await
    }

    pub async fn signal_command(&self, id: &str, cid: &str, signal: i32) -> Result<Command> {
        self.command(id, cid)?;
        self.svc.signal_command(id, cid, signal).await
    }

    /// A command's output from an offset; a followed one counts as an open stream.
    pub fn command_output(
        &self,
        id: &str,
        cid: &str,
        q: CommandOutputQuery,
    ) -> Result<mpsc::Receiver<OutputEvent>> {
        self.command(id, cid)?;
        let permit = match q.follow {
            true => Some(self.svc.admit_stream(self.tenant)?),
            false => None,
        };
        self.svc.command_output(id, cid, q, permit)
    }

    /// At most [`MAX_STDIN_WRITE`] bytes per call (413 past it), for every front door.
    pub async fn write_stdin(&self, id: &str, cid: &str, data: Bytes, eof: bool) -> Result<()> {
        self.command(id, cid)?;
        if data.len() > MAX_STDIN_WRITE {
            return Err(ServiceError::Api(ApiError::new(
                ErrorCode::BodyTooLarge,
                format!("at most {MAX_STDIN_WRITE} bytes of stdin per request"),
            )));
        }
        self.svc.write_stdin(id, cid, data, eof).await
    }

    pub async fn resize(&self, id: &str, cid: &str, rows: u16, cols: u16) -> Result<()> {
        self.command(id, cid)?;
        self.svc.resize(id, cid, rows, cols).await
    }

    /// The command whose process is `pid` in sandbox `id`: the running one, else the
    /// newest that had it (pids are reused).
    pub async fn command_by_pid(&self, id: &str, pid: u32) -> Result<Command> {
        let (scope, id) = (self.owned(), id.to_string());
        blocking(move || {
            let mut cmds = scope.scoped().list_commands(&id)?;
            cmds.retain(|c| c.pid == Some(pid));
            cmds.sort_by(|a, b| {
                (a.result.is_none(), &a.created_at).cmp(&(b.result.is_none(), &b.created_at))
            });
            cmds.pop()
                .ok_or_else(|| ServiceError::NotFound(format!("no process {pid} in sandbox {id}")))
        })
        .await
    }

    /// The caller's command `cid`, found by its id alone (command ids are unique); the
    /// one 404 for another tenant's, a malformed and an unknown id.
    pub async fn find_command(&self, cid: &str) -> Result<Command> {
        let (scope, cid) = (self.owned(), cid.to_string());
        blocking(move || {
            let missing = || ServiceError::NotFound(format!("no command {}", truncate(&cid, 64)));
            if !space_core::is_valid_id(&cid, "cmd") {
                return Err(missing());
            }
            let sandbox = scope
                .svc
                .0
                .store
                .command_sandbox(&cid)?
                .ok_or_else(missing)?;
            scope.scoped().sandbox(&sandbox).map_err(|_| missing())?;
            scope
                .svc
                .0
                .store
                .get_command(&sandbox, &cid)?
                .ok_or_else(missing)
        })
        .await
    }

    // ---- access tokens ----

    /// A new random token that authenticates requests to sandbox `id` alone, as this
    /// tenant (the E2B-compatible envd API takes it). Only its hash is stored; a sandbox
    /// keeps its [`ACCESS_TOKENS_KEPT`] newest, and loses them all with its records.
    pub async fn issue_access_token(&self, id: &str) -> Result<String> {
        let (scope, id) = (self.owned(), id.to_string());
        blocking(move || {
            scope.scoped().sandbox(&id)?;
            let token = format!("{ACCESS_TOKEN_PREFIX}{}", space_core::new_token());
            scope.svc.0.store.insert_access_token(
                &super::tenancy::key_hash(&token),
                &id,
                scope.tenant.as_str(),
                ACCESS_TOKENS_KEPT,
            )?;
            Ok(token)
        })
        .await
    }

    // ---- files ----

    /// `path`'s bytes, or a tar of it, as a stream (see [`Download`]).
    pub async fn download_file(
        &self,
        id: &str,
        path: &str,
        format: DownloadFormat,
    ) -> Result<Download> {
        self.sandbox(id)?;
        self.svc.download_file(id, path, format).await
    }

    /// Writes `body` at `path` (see [`UploadKind`]): at most the server's upload limit
    /// (`declared`: the length the caller announced, refused early when over it), one
    /// of the tenant's uploads in flight meanwhile. With `parents`, a file's missing
    /// parent directories are made first (as E2B and Daytona do); without, a missing
    /// parent is a 404.
    pub async fn upload_file(
        &self,
        id: &str,
        path: &str,
        kind: UploadKind,
        parents: bool,
        declared: Option<u64>,
        body: UploadStream,
    ) -> Result<Uploaded> {
        self.sandbox(id)?;
        self.svc
            .upload_file(self.tenant, id, path, kind, parents, declared, body)
            .await
    }

    pub async fn list_files(
        &self,
        id: &str,
        path: &str,
        depth: Option<u32>,
    ) -> Result<FileListing> {
        self.sandbox(id)?;
        self.svc.list_files(id, path, depth).await
    }

    pub async fn stat_file(&self, id: &str, path: &str) -> Result<FileInfo> {
        self.sandbox(id)?;
        self.svc.stat_file(id, path).await
    }

    /// Creates a directory and its parents (`mkdir -p`).
    pub async fn mkdir(&self, id: &str, req: &MkdirRequest) -> Result<FileInfo> {
        self.sandbox(id)?;
        self.svc.mkdir(id, req).await
    }

    pub async fn move_file(&self, id: &str, req: &MoveRequest) -> Result<FileInfo> {
        self.sandbox(id)?;
        self.svc.move_file(id, req).await
    }

    /// Removes `path` (a directory's tree with `recursive`); never the root.
    pub async fn remove_file(&self, id: &str, path: &str, recursive: bool) -> Result<Removed> {
        self.sandbox(id)?;
        self.svc.remove_file(id, path, recursive).await
    }

    // ---- operations ----

    /// The operation once it has ended, or as it is after `wait`.
    pub async fn get_operation(&self, id: &str, wait: Duration) -> Result<Operation> {
        self.operation(id)?;
        self.svc.wait_operation(id, wait).await
    }

    /// The tenant's operations, newest first, optionally of one of its sandboxes.
    /// The caller's operations, newest first: `limit` of them (default 100, at most 1000).
    pub fn list_operations(
        &self,
        sandbox_id: Option<&str>,
        limit: Option<usize>,
    ) -> Result<Vec<Operation>> {
        let limit = limit.unwrap_or(100).clamp(1, 1000);
        Ok(self
            .svc
            .0
            .store
            .list_operations(self.tenant.as_str(), sandbox_id, limit)?)
    }

    pub fn cancel_operation(&self, id: &str) -> Result<Operation> {
        self.operation(id)?;
        self.svc.cancel_operation(id)
    }

    /// A build operation's log as a byte stream; a followed one counts as an open stream.
    pub fn build_log(
        &self,
        id: &str,
        follow: bool,
    ) -> Result<impl futures::Stream<Item = std::io::Result<Bytes>> + Send + 'static> {
        self.operation(id)?;
        let hold = match follow {
            true => Some(self.svc.admit_stream(self.tenant)?),
            false => None,
        };
        let stream = self.svc.build_log_stream(id, follow)?;
        // The slot is held for as long as the stream is.
        Ok(futures::StreamExt::map(stream, move |chunk| {
            let _held = &hold;
            chunk
        }))
    }

    // ---- templates ----

    /// Built-in templates and the tenant's own.
    pub fn list_templates(&self) -> Result<Vec<Template>> {
        let mut visible = Vec::new();
        for t in self.svc.list_templates()? {
            if self.template_visible(&t.name)? {
                visible.push(t);
            }
        }
        Ok(visible)
    }

    /// `POST /v1/templates` with the recipe as JSON bytes, read here: at most
    /// `MAX_RECIPE_BYTES` (files are inlined, so a recipe may be large), one of the
    /// tenant's uploads in flight while it is read and checked.
    pub async fn build_template_json(
        &self,
        declared: Option<u64>,
        mut body: UploadStream,
    ) -> Result<Operation> {
        let too_large = || {
            ServiceError::Api(ApiError::new(
                ErrorCode::BodyTooLarge,
                format!("recipe larger than {MAX_RECIPE_BYTES} bytes"),
            ))
        };
        if declared.is_some_and(|n| n > MAX_RECIPE_BYTES as u64) {
            return Err(too_large());
        }
        let _upload = self.svc.admit_upload(self.tenant)?;
        let mut bytes = Vec::new();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| {
                ServiceError::BadRequest(format!("reading the recipe: {}", super::error_chain(&*e)))
            })?;
            if bytes.len() + chunk.len() > MAX_RECIPE_BYTES {
                return Err(too_large());
            }
            bytes.extend_from_slice(&chunk);
        }
        let recipe: Recipe = serde_json::from_slice(&bytes).map_err(|e| {
            ServiceError::Api(ApiError::new(
                ErrorCode::InvalidJson,
                format!("invalid recipe: {e}"),
            ))
        })?;
        self.build_template(recipe).await
    }

    /// `POST /v1/templates`: the recipe's name becomes the tenant's.
    pub async fn build_template(&self, recipe: Recipe) -> Result<Operation> {
        if let Some(base) = recipe.base.strip_prefix("template:") {
            if !self.template_visible(base)? {
                return Err(ServiceError::BadRequest(format!(
                    "unknown base template {:?}",
                    truncate(base, 64)
                )));
            }
        }
        self.svc
            .admit_build(self.tenant, || {
                let name = recipe.name.clone();
                let claimed = self.svc.claim_template(self.tenant, &name)?;
                let r = self.svc.build_template(self.tenant.as_str(), recipe);
                if r.is_err() && claimed {
                    self.svc.unclaim_template(&name);
                }
                r
            })
            .await
    }

    /// `DELETE /v1/templates/{name}`: the tenant's own templates only.
    pub async fn delete_template(&self, name: &str) -> Result<()> {
        if !self.template_visible(name)? {
            return Err(no_template(name));
        }
        self.svc.delete_template(name).await.map_err(|e| match e {
            ServiceError::NotFound(_) => no_template(name),
            e => e,
        })?;
        self.svc.unclaim_template(name);
        Ok(())
    }

    // ---- events ----

    /// The tenant's events after `after`, oldest first, at most `limit`.
    /// The tenant's event feed after event `after` (`None`: from now on). It holds one of the
    /// tenant's stream slots for as long as it lives (429 past the tenant's limit).
    pub fn event_feed(&self, after: Option<i64>) -> Result<EventFeed> {
        let permit = self.svc.admit_stream(self.tenant)?;
        let mut latest = self.svc.subscribe_events();
        let after = after.unwrap_or_else(|| *latest.borrow_and_update());
        Ok(EventFeed {
            svc: self.svc.clone(),
            tenant: self.tenant.clone(),
            latest,
            after,
            _permit: permit,
        })
    }

    pub fn events_after(&self, after: i64, limit: usize) -> Result<Vec<Event>> {
        Ok(self
            .svc
            .0
            .store
            .events_after(self.tenant.as_str(), after, limit)?)
    }
}

/// A tenant's events as they happen (see [`TenantService::event_feed`]).
pub struct EventFeed {
    svc: Service,
    tenant: Tenant,
    latest: tokio::sync::watch::Receiver<i64>,
    after: i64,
    _permit: Permit,
}

impl EventFeed {
    /// The next events, at most `limit`, in order; waits up to `idle` for one (empty: none
    /// came). Cancel-safe: an event is passed over only once it has been returned.
    pub async fn next(&mut self, limit: usize, idle: Duration) -> Result<Vec<Event>> {
        let deadline = tokio::time::Instant::now() + idle;
        loop {
            self.latest.borrow_and_update();
            let mut events = self
                .svc
                .for_tenant(&self.tenant)
                .events_after(self.after, limit)?;
            if let Some(last) = events.last().map(|e| e.id) {
                // Costs read the sandbox's filesystem: off the async threads. The feed
                // moves past these events only once they are returned (cancel-safe).
                let svc = self.svc.clone();
                let events = tokio::task::spawn_blocking(move || {
                    svc.decorate_events(&mut events);
                    events
                })
                .await
                .map_err(|e| ServiceError::Internal(format!("decorating events: {e}")))?;
                self.after = last;
                return Ok(events);
            }
            tokio::select! {
                changed = self.latest.changed() => if changed.is_err() {
                    return Err(ServiceError::Unavailable("the server is stopping".into()));
                },
                _ = tokio::time::sleep_until(deadline) => return Ok(Vec::new()),
            }
        }
    }
}
