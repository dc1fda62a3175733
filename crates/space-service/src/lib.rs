//! The service core of space: sandboxes, operations, commands and templates, independent
//! of any front door. The v1 HTTP API (and the E2B API and MCP server that come next) act
//! only through [`Service::for_tenant`] (`scope.rs`): one method per action, typed
//! requests and results, errors with a stable [`space_api::ErrorCode`]. Tenancy, limits,
//! template ownership and every safety rule live here, so every front door gets them.
//!
//! Every state change is written to the store before it is acted on. Lifecycle
//! requests become operations that run as tasks, serialised per sandbox by a
//! lifecycle lock. On start, [`Service::start`] reconciles the store with what
//! really runs: live sandboxes are re-adopted (their agents dial back in),
//! vanished ones are marked `failed`, half-done operations are finished or failed.

mod chan;
mod commands;
pub mod files;
mod input;
pub mod interpreter;
mod lifecycle;
mod metrics;
mod network;
pub mod output;
mod pools;
pub use pools::POOL_TENANT;
mod reconcile;
mod retention;
pub mod runtimes;
mod scope;
pub use scope::{EventFeed, TenantService, ACCESS_TOKEN_PREFIX, MAX_STDIN_WRITE};
mod dirwatch;
pub use dirwatch::{DirWatcher, FsEvent, FsEventKind};
mod snapshot;
mod templates;
pub mod tenancy;
#[cfg(test)]
mod testing;
#[cfg(test)]
mod tests;

use space_api::ErrorCode;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use space_api::{
    ApiError, CreateSandboxRequest, Operation, OperationKind, OperationStatus, Resources, Sandbox,
    SandboxState,
};
use space_core::runtime::{RuntimeError, RuntimeStatus, SandboxSpec};
use space_core::{new_id, new_token, now_rfc3339, transition, InvalidTransition, SandboxEvent};
use space_runtime::template::{TemplateError, TemplateStore};
use space_store::{SandboxRecord, SqliteStore, Store, StoreError};
use tokio::sync::{watch, Semaphore};
use tokio_util::sync::CancellationToken;

pub use chan::ChannelReader;
pub use commands::{CommandOutputQuery, OutputEvent};
use retention::Activity;
use space_agent_host::{self as agent, AgentConn, AgentError};
pub use tenancy::{Limits, Principal, Tenant};

/// How often a compare-and-swap write is tried again after losing to another writer.
const CAS_ATTEMPTS: usize = 32;
/// How long a booted sandbox's agent may take to dial in.
const AGENT_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// Boots a create tries before it gives up on an agent that never starts.
const CREATE_ATTEMPTS: u32 = 2;
/// How long a re-adopted sandbox's agent may take to dial back in after a restart.
const READOPT_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a boot of a sandbox being created gave it no agent, when booting again may mend it.
struct NotStarted {
    /// In a few words, for the create's progress ("booting the sandbox again (attempt 2: …)").
    what: &'static str,
    /// All that is known, for the log and the create's error.
    detail: String,
}

/// Everything the service needs to know at start.
#[derive(Debug, Clone)]
pub struct Config {
    pub data_dir: PathBuf,
    pub templates_dir: PathBuf,
    /// Directory holding the static `space-agent` binary to mount into sandboxes.
    pub agent_dir: PathBuf,
    pub max_concurrent_creates: usize,
    pub default_resources: Resources,
    /// The most a sandbox may ask for (every field set).
    pub max_resources: Resources,
    /// How long records of destroyed sandboxes (and their command output) are kept.
    pub retention: Duration,
    /// One deadline for every operation kind instead of the built-in ones.
    pub operation_timeout: Option<Duration>,
    /// Command timeout when a request gives none (0: none).
    pub default_command_timeout_seconds: u64,
    /// Longest command timeout a request may ask for (0: no maximum, and "none" is allowed).
    pub max_command_timeout_seconds: u64,
    /// Output kept per stream of a command; past it the head is dropped (0: keep all).
    pub output_cap_bytes: u64,
    /// Output all the commands of one sandbox may keep together (0: no budget): running
    /// commands share it, finished ones lose their output oldest first past it.
    pub sandbox_output_budget_bytes: u64,
    /// Host directories that `dir:`/`tar:`/`oci:` template bases may read from (none: refused).
    pub template_import_dirs: Vec<PathBuf>,
    /// What each template build step may use (the build's disk quota also bounds imports
    /// and package downloads).
    pub build_limits: space_runtime::build::BuildLimits,
    /// The runtime that runs template build steps (`gvisor` or `microvm`).
    pub build_runtime: String,
    /// Largest file upload (raw bytes, or what a tar upload extracts to).
    pub max_upload_bytes: u64,
    /// The server's own token (tenant `default`); `None`: API keys only.
    pub server_token: Option<String>,
    /// Per-tenant and per-sandbox limits (defaults; some overridable per tenant).
    pub limits: Limits,
    /// Sandboxes all warm pools may hold together.
    pub pool_max_sandboxes: u64,
    /// Pooled sandboxes that may boot at once (server-wide).
    pub pool_fills: usize,
    /// Resident sandboxes (all but suspended, destroyed and failed; pooled ones included)
    /// this server runs at most: past it a create that no pool serves, or the resume of a
    /// suspended sandbox, is refused with 429. 0: no cap.
    pub max_sandboxes: u64,
}

/// What went wrong, in terms an API caller can act on.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Conflict(String),
    #[error(transparent)]
    InvalidTransition(#[from] InvalidTransition),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Forbidden(String),
    /// A limit was reached (HTTP 429); `retry_after` seconds, when waiting helps.
    #[error("{message}")]
    TooMany {
        message: String,
        retry_after: Option<u64>,
    },
    #[error("storage failed")]
    Store(#[from] StoreError),
    #[error("internal error: {0}")]
    Internal(String),
    /// An error with a code of its own (a file path, an upload past the limit, what the
    /// sandbox's agent refused); its HTTP status is the code's.
    #[error("{}", .0.message)]
    Api(ApiError),
}

impl ServiceError {
    /// The stable code a client sees for this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            ServiceError::NotFound(_) => ErrorCode::NotFound,
            ServiceError::BadRequest(_) => ErrorCode::InvalidRequest,
            ServiceError::Conflict(_) => ErrorCode::Conflict,
            ServiceError::InvalidTransition(_) => ErrorCode::InvalidTransition,
            ServiceError::Unavailable(_) => ErrorCode::Unavailable,
            ServiceError::Forbidden(_) => ErrorCode::Forbidden,
            ServiceError::TooMany { .. } => ErrorCode::TooManyRequests,
            ServiceError::Store(_) | ServiceError::Internal(_) => ErrorCode::Internal,
            ServiceError::Api(e) => e.code,
        }
    }
}

pub type Result<T, E = ServiceError> = std::result::Result<T, E>;

/// A sandbox the server is actively managing.
pub(crate) struct SandboxHandle {
    pub id: String,
    /// Serialises lifecycle operations on this sandbox.
    lifecycle: tokio::sync::Mutex<()>,
    /// The current agent connection, if any.
    pub agent: watch::Sender<Option<AgentConn>>,
    /// Cancelled when the sandbox is being destroyed or has failed: command sessions end `lost`.
    pub closed: CancellationToken,
    listener: Mutex<Option<(tokio::task::JoinHandle<()>, PathBuf)>>,
    /// Unfinished lifecycle operations on this sandbox.
    ops: Mutex<Vec<(String, OperationKind)>>,
    /// What its commands' output may keep on the host, together.
    pub output: Arc<output::OutputBudget>,
    /// Held (shared) by a command from the check that the sandbox runs until the agent
    /// has answered its spawn; held (exclusive) by pause and suspend while they move the
    /// sandbox out of `running`, so no spawn is ever in flight across a freeze or a
    /// checkpoint.
    pub spawns: Arc<tokio::sync::RwLock<()>>,
    /// Set when the output budget is due a check (the reaper does it).
    output_due: std::sync::atomic::AtomicBool,
}

impl SandboxHandle {
    /// Marks the output budget as due a check when `due`.
    pub(crate) fn note_output(&self, due: bool) {
        if due {
            self.output_due
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn new(id: &str, output_budget: u64) -> Arc<SandboxHandle> {
        Arc::new(SandboxHandle {
            id: id.to_string(),
            lifecycle: tokio::sync::Mutex::new(()),
            agent: watch::channel(None).0,
            closed: CancellationToken::new(),
            listener: Mutex::new(None),
            ops: Mutex::new(Vec::new()),
            output: output::OutputBudget::new(output_budget),
            spawns: Arc::new(tokio::sync::RwLock::new(())),
            output_due: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Stops accepting agent connections, closes the current one and removes the socket.
    fn stop_listener(&self) {
        if let Some(socket) = self.stop_listener_keep_connection() {
            let _ = std::fs::remove_file(socket);
        }
        self.drop_connection();
    }

    /// Stops accepting agent connections; the current one stays. The socket file
    /// stays too: a dialling agent then gets "connection refused". Were the file
    /// gone, gVisor would remember that the path does not exist (a negative dentry)
    /// and the agent would never see the socket that a later listener binds there.
    fn stop_listener_keep_connection(&self) -> Option<PathBuf> {
        let (task, socket) = lock(&self.listener).take()?;
        task.abort();
        Some(socket)
    }

    /// Closes the current agent connection, if any.
    fn drop_connection(&self) {
        if let Some(conn) = self.agent.send_replace(None) {
            conn.close();
        }
    }
}

pub(crate) struct Inner {
    pub cfg: Config,
    pub store: Arc<dyn Store>,
    pub runtimes: runtimes::Runtimes,
    pub templates: TemplateStore,
    sandboxes: Mutex<HashMap<String, Arc<SandboxHandle>>>,
    /// Held while a create or a resume is checked against `max_sandboxes` and recorded.
    capacity: Mutex<()>,
    pub commands: commands::Registry,
    /// Last activity per sandbox (API requests on it, commands ending).
    activity: Mutex<HashMap<String, Activity>>,
    create_slots: Semaphore,
    /// Operations still pending, with the token that cancels them.
    pending_ops: Mutex<HashMap<String, CancellationToken>>,
    /// Held from a command's admission check until its record is stored, so
    /// concurrent creates cannot overshoot a command limit.
    command_admission: Mutex<()>,
    tenancy: tenancy::Tenancy,
    /// Failed sandboxes whose records retention is purging now.
    purging: Mutex<std::collections::HashSet<String>>,
    /// The last sampled cost of each managed sandbox (see `retention.rs`).
    costs: Mutex<HashMap<String, space_api::Cost>>,
    /// Warm pools (see `pools.rs`).
    pools: pools::Pools,
    metrics: metrics::Metrics,
}

/// The service. Cheap to clone.
#[derive(Clone)]
pub struct Service(pub(crate) Arc<Inner>);

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Service {
    /// Opens the store (`DATA_DIR/space.db`) and reconciles it with what really runs.
    pub async fn start(cfg: Config, runtimes: runtimes::Runtimes) -> anyhow::Result<Service> {
        // Secrets, agent tokens and tenants' files live here: no other host user may enter.
        space_runtime::tree::private_dir(&cfg.data_dir)?;
        let store: Arc<dyn Store> = Arc::new(SqliteStore::open(&cfg.data_dir.join("space.db"))?);
        Self::start_with_store(cfg, store, runtimes).await
    }

    /// [`Self::start`] on a store the caller opened (another database, or an in-memory
    /// one in tests): reconciles it with what really runs before anything is served.
    pub async fn start_with_store(
        cfg: Config,
        store: Arc<dyn Store>,
        runtimes: runtimes::Runtimes,
    ) -> anyhow::Result<Service> {
        space_runtime::tree::private_dir(&cfg.data_dir)?;
        std::fs::create_dir_all(cfg.data_dir.join("sandboxes"))?;
        std::fs::create_dir_all(cfg.data_dir.join("outputs"))?;
        std::fs::create_dir_all(cfg.data_dir.join("snapshots"))?;
        let templates = TemplateStore::new(cfg.templates_dir.clone())?;
        let slots = cfg.max_concurrent_creates.max(1);
        let tenancy = tenancy::Tenancy::new(cfg.server_token.clone(), cfg.limits.clone());
        let svc = Service(Arc::new(Inner {
            cfg,
            store,
            runtimes,
            templates,
            sandboxes: Mutex::new(HashMap::new()),
            capacity: Mutex::new(()),
            commands: commands::Registry::default(),
            activity: Mutex::new(HashMap::new()),
            create_slots: Semaphore::new(slots),
            pending_ops: Mutex::new(HashMap::new()),
            command_admission: Mutex::new(()),
            tenancy,
            purging: Mutex::new(std::collections::HashSet::new()),
            costs: Mutex::new(HashMap::new()),
            pools: pools::Pools::default(),
            metrics: metrics::Metrics::default(),
        }));
        svc.reconcile().await?;
        svc.remove_build_leftovers().await;
        let templates = svc.0.templates.clone();
        tokio::task::spawn_blocking(move || {
            space_runtime::build::sweep_abandoned_layers(&templates)
        })
        .await?;
        svc.spawn_reaper();
        svc.spawn_revocation_watch();
        svc.spawn_cost_sampler();
        svc.spawn_pool_filler();
        Ok(svc)
    }

    /// The runtime new sandboxes get when they ask for none.
    pub fn runtime_name(&self) -> &'static str {
        self.0.runtimes.default
    }

    fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.0.cfg.data_dir.join("sandboxes").join(id)
    }

    /// Where a suspended sandbox's snapshot lives.
    fn snapshot_dir(&self, id: &str) -> PathBuf {
        self.0.cfg.data_dir.join("snapshots").join(id)
    }

    pub(crate) fn outputs_root(&self) -> PathBuf {
        self.0.cfg.data_dir.join("outputs")
    }

    fn handle(&self, id: &str) -> Arc<SandboxHandle> {
        lock(&self.0.sandboxes)
            .entry(id.to_string())
            .or_insert_with(|| SandboxHandle::new(id, self.0.cfg.sandbox_output_budget_bytes))
            .clone()
    }

    pub(crate) fn live_handle(&self, id: &str) -> Option<Arc<SandboxHandle>> {
        lock(&self.0.sandboxes).get(id).cloned()
    }

    fn forget_handle(&self, id: &str) {
        lock(&self.0.sandboxes).remove(id);
    }

    // ---- sandboxes ----

    /// `POST /v1/sandboxes`, first half: the record a create request stands for,
    /// validated and resolved, not stored. [`Self::claim_pooled`] or
    /// [`Self::start_create`] takes it from there.
    pub(crate) fn prepare_create(
        &self,
        tenant: &str,
        req: CreateSandboxRequest,
    ) -> Result<SandboxRecord> {
        let template_name = req.template.trim().to_string();
        let runtime = self.resolve_runtime(req.runtime.as_deref())?;
        let accelerator = self.0.runtimes.accelerator(&runtime);
        // Hostnames of an egress allowlist resolve here, once; the stored result is what
        // every boot and restore of the sandbox enforces.
        let network = network::resolve(req.network.as_ref())?;
        if let Some(ttl) = req.ttl_seconds {
            retention::check_lifetime("ttl_seconds", ttl)?;
        }
        if let Some(idle) = req.idle_timeout_seconds {
            retention::check_lifetime("idle_timeout_seconds", idle)?;
        }
        if req.on_idle.is_some() && req.idle_timeout_seconds.is_none() {
            return Err(ServiceError::BadRequest(
                "on_idle needs idle_timeout_seconds".into(),
            ));
        }
        let env = req.env.clone().unwrap_or_default();
        validate_env(&env)?;
        let secrets = req.secrets.clone().unwrap_or_default();
        commands::validate_secrets(&secrets)?;
        let labels = req.labels.clone().unwrap_or_default();
        validate_labels(&labels)?;
        let template = self.find_template(&template_name)?;
        let resources = self.resolve_resources(
            req.resources.as_ref(),
            template.as_ref().and_then(|t| t.resources.as_ref()),
        )?;

        let now = now_rfc3339();
        let id = new_id("sb");
        let rec = SandboxRecord {
            sandbox: Sandbox {
                id: id.clone(),
                version: 0,
                tenant: tenant.to_string(),
                state: SandboxState::Creating,
                template: template_name.clone(),
                template_version: template
                    .as_ref()
                    .map(|t| t.version.clone())
                    .unwrap_or_default(),
                runtime,
                accelerator,
                labels,
                resources,
                env,
                secret_names: secrets.keys().cloned().collect(),
                network,
                created_at: now.clone(),
                updated_at: now.clone(),
                expires_at: retention::expiry(req.ttl_seconds),
                failure_reason: None,
                last_active_at: Some(now.clone()),
                ttl_seconds: req.ttl_seconds,
                idle_timeout_seconds: req.idle_timeout_seconds,
                on_idle: req
                    .idle_timeout_seconds
                    .map(|_| req.on_idle.unwrap_or(space_api::OnIdle::Suspend)),
                idle_expires_at: None,
                cost: Default::default(),
                destroyed_at: None,
            },
            agent_token: new_token(),
            rootfs: template
                .as_ref()
                .map(|t| t.rootfs.to_string_lossy().into_owned())
                .unwrap_or_default(),
            template_env: template.as_ref().map(|t| t.env.clone()).unwrap_or_default(),
            template_user: template.as_ref().and_then(|t| t.user.clone()),
            template_workdir: template.as_ref().and_then(|t| t.workdir.clone()),
            snapshot_dir: None,
            secrets,
        };
        Ok(rec)
    }

    /// The runtime asked for (default: the server's), if this server has it (400 if not).
    pub(crate) fn resolve_runtime(&self, asked: Option<&str>) -> Result<String> {
        let runtime = asked.unwrap_or(self.runtime_name()).to_string();
        self.0
            .runtimes
            .get(&runtime)
            .map_err(ServiceError::BadRequest)?;
        Ok(runtime)
    }

    /// The template `name` (`None`: a built-in not built yet); 404 for an unknown or
    /// invalid name.
    pub(crate) fn find_template(
        &self,
        name: &str,
    ) -> Result<Option<space_runtime::template::Template>> {
        match self.0.templates.get(name) {
            Ok(t) => Ok(t),
            Err(TemplateError::UnknownTemplate(_)) | Err(TemplateError::InvalidName(_)) => Err(
                ServiceError::NotFound(format!("unknown template {:?}", truncate(name, 64))),
            ),
            Err(e) => Err(ServiceError::Internal(format!("template store: {e}"))),
        }
    }

    /// Stores the prepared `rec` and starts booting it.
    pub(crate) fn start_create(&self, rec: SandboxRecord) -> Result<Operation> {
        let (id, tenant) = (&rec.sandbox.id, &rec.sandbox.tenant);
        let template_name = &rec.sandbox.template;
        let op = new_operation(OperationKind::Create, Some(id), tenant);
        self.0.store.insert_sandbox(&rec, &op)?;
        let cancel = CancellationToken::new();
        lock(&self.0.pending_ops).insert(op.id.clone(), cancel.clone());
        let handle = self.handle(id);
        tracing::info!(sandbox = %id, operation = %op.id, template = %template_name, "create requested");
        let svc = self.clone();
        let op_id = op.id.clone();
        tokio::spawn(async move { svc.run_create(handle, op_id, cancel).await });
        Ok(op)
    }

    /// The request's resources, else the template's defaults, else the server's.
    fn resolve_resources(
        &self,
        req: Option<&Resources>,
        tpl: Option<&space_runtime::template::DefaultResources>,
    ) -> Result<Resources> {
        let d = &self.0.cfg.default_resources;
        let r = Resources {
            vcpus: req
                .and_then(|r| r.vcpus)
                .or(tpl.and_then(|t| t.vcpus))
                .or(d.vcpus),
            memory_mib: req
                .and_then(|r| r.memory_mib)
                .or(tpl.and_then(|t| t.memory_mib))
                .or(d.memory_mib),
            disk_mib: req
                .and_then(|r| r.disk_mib)
                .or(tpl.and_then(|t| t.disk_mib))
                .or(d.disk_mib),
            pids: req
                .and_then(|r| r.pids)
                .or(tpl.and_then(|t| t.pids))
                .or(d.pids),
        };
        let check = |name: &str, v: Option<u64>, lo: u64, hi: u64| match v {
            Some(v) if v < lo || v > hi => Err(ServiceError::BadRequest(format!(
                "resources.{name} must be between {lo} and {hi}, got {v}"
            ))),
            _ => Ok(()),
        };
        let m = &self.0.cfg.max_resources;
        check(
            "vcpus",
            r.vcpus.map(u64::from),
            1,
            m.vcpus.map_or(64, u64::from),
        )?;
        check(
            "memory_mib",
            r.memory_mib,
            64,
            m.memory_mib.unwrap_or(1 << 20),
        )?;
        check("disk_mib", r.disk_mib, 64, m.disk_mib.unwrap_or(1 << 24))?;
        check("pids", r.pids, 16, m.pids.unwrap_or(1 << 22))?;
        Ok(r)
    }

    async fn run_create(
        &self,
        handle: Arc<SandboxHandle>,
        op_id: String,
        cancel: CancellationToken,
    ) {
        // Wait for a create slot; the operation is `pending` meanwhile and can be cancelled.
        let permit = tokio::select! {
            p = self.0.create_slots.acquire() => p.ok(),
            _ = cancel.cancelled() => None,
        };
        if lock(&self.0.pending_ops).remove(&op_id).is_none() || permit.is_none() {
            return; // Cancelled: the canceller recorded everything.
        }
        let _lifecycle = handle.lifecycle.lock().await;
        let limit = self.deadline(OperationKind::Create);
        let result = match tokio::time::timeout(limit, self.create_steps(&handle, &op_id)).await {
            Ok(r) => r,
            Err(_) => Err(ApiError::new(
                ErrorCode::TimedOut,
                format!("the create did not finish within {}s", limit.as_secs()),
            )),
        };
        drop(permit);
        match result {
            Ok(()) => {}
            Err(e) => {
                tracing::warn!(sandbox = %handle.id, operation = %op_id, error = %e.message, "create failed");
                self.fail_sandbox(&handle, &e.message).await;
                let _ = self.finish_op(&op_id, Some(e));
            }
        }
    }

    async fn create_steps(&self, handle: &Arc<SandboxHandle>, op_id: &str) -> Result<(), ApiError> {
        let id = &handle.id;
        self.update_op(op_id, |op| {
            op.status = OperationStatus::Running;
            op.progress = Some("preparing the template".into());
        })
        .map_err(internal)?;
        let template_name = self.record(id).map_err(internal)?.sandbox.template;
        let progress_svc = self.clone();
        let progress_op = op_id.to_string();
        let progress = move |line: String| {
            let _ = progress_svc.update_op(&progress_op, |op| op.progress = Some(line.clone()));
        };
        let template = self
            .0
            .templates
            .ensure(&template_name, &progress)
            .await
            .map_err(|e| ApiError::new(ErrorCode::TemplateUnavailable, e.to_string()))?;
        // Read again after the wait: the write must not undo what happened meanwhile.
        let rec = self
            .modify_sandbox(id, |rec| {
                rec.sandbox.template_version = template.version.clone();
                rec.rootfs = template.rootfs.to_string_lossy().into_owned();
                rec.template_env = template.env.clone();
                rec.template_user = template.user.clone();
                rec.template_workdir = template.workdir.clone();
                Ok::<_, ApiError>(())
            })?
            .0;

        // Seen rarely under load with TCG microVMs: a guest whose agent opened its link to
        // the host and then said nothing, not even its own timeouts' notes, for as long as it
        // was waited for. A sandbox being created holds nothing yet, so it is destroyed and
        // booted once more; what the first boot showed is logged.
        // Also seen rarely: a TCG guest whose kernel stopped early in its start, so that its
        // agent never ran (the runtime reports `BootStalled`). It is booted once more too.
        let mut attempt = 1;
        let mut last = None;
        loop {
            let progress = match &last {
                None => "booting the sandbox".to_string(),
                Some(NotStarted { what, .. }) => {
                    format!("booting the sandbox again (attempt {attempt}: {what})")
                }
            };
            self.update_op(op_id, |op| op.progress = Some(progress.clone()))
                .map_err(internal)?;
            let not_started = match self
                .boot(handle, op_id, &rec, &template.rootfs, attempt)
                .await?
            {
                Ok(_) => break,
                Err(not_started) => not_started,
            };
            if attempt == CREATE_ATTEMPTS {
                return Err(ApiError::new(
                    ErrorCode::AgentTimeout,
                    format!(
                        "the sandbox's agent did not start in any of {CREATE_ATTEMPTS} boots; the last: {}",
                        not_started.detail
                    ),
                ));
            }
            tracing::warn!(sandbox = %id, attempt, detail = %not_started.detail, "a created sandbox: {}; destroying it and booting it again", not_started.what);
            last = Some(not_started);
            handle.stop_listener();
            self.rt(id)
                .destroy(id, &self.sandbox_dir(id))
                .await
                .map_err(|e| ApiError::new(ErrorCode::RuntimeFailed, error_chain(&e)))?;
            attempt += 1;
        }
        // On the connection the boot found, or after a break on the agent's next one.
        network::write_hosts(&mut handle.agent.subscribe(), &rec.sandbox.network).await?;
        let ready = |rec: &mut SandboxRecord| -> Result<(), ApiError> {
            rec.sandbox.state = transition(rec.sandbox.state, SandboxEvent::Ready)
                .map_err(|e| ApiError::new(ErrorCode::Conflict, e.to_string()))?;
            rec.sandbox.updated_at = now_rfc3339();
            Ok(())
        };
        // A template's start command runs once the sandbox runs; the create waits for it.
        let ready_now = match &template.start {
            Some(start) => {
                self.modify_sandbox(id, ready)?;
                self.spawn_monitor(handle);
                self.run_template_start(id, op_id, start).await?;
                false
            }
            None => true,
        };
        self.sample_cost(id).await;
        self.modify_sandbox_and_op(id, op_id, |rec, op| {
            if ready_now {
                ready(rec)?;
            }
            // A lifetime counts from when the sandbox can be used: a create slowed by load
            // (or a long start command) does not eat into it.
            rec.sandbox.expires_at = retention::expiry(rec.sandbox.ttl_seconds);
            rec.sandbox.last_active_at = Some(now_rfc3339());
            op.status = OperationStatus::Succeeded;
            op.progress = Some("ready".into());
            op.updated_at = now_rfc3339();
            Ok::<_, ApiError>(())
        })?;
        if template.start.is_none() {
            self.spawn_monitor(handle);
        }
        tracing::info!(sandbox = %id, operation = %op_id, "sandbox running");
        Ok(())
    }

    /// Boots a sandbox being created (attempt `attempt`) and waits for its agent: its
    /// connection, or why it has none that booting again may mend: the runtime says its boot
    /// stalled, or its agent did not dial in within [`AGENT_CONNECT_TIMEOUT`].
    async fn boot(
        &self,
        handle: &Arc<SandboxHandle>,
        op_id: &str,
        rec: &SandboxRecord,
        rootfs: &std::path::Path,
        attempt: u32,
    ) -> Result<Result<AgentConn, NotStarted>, ApiError> {
        let id = &handle.id;
        let dir = self.sandbox_dir(id);
        let run_dir = dir.join("run");
        std::fs::create_dir_all(&run_dir).map_err(|e| {
            ApiError::new(
                ErrorCode::Internal,
                format!("creating {}: {e}", run_dir.display()),
            )
        })?;
        write_secret(&run_dir.join("token"), &rec.agent_token).map_err(|e| {
            ApiError::new(ErrorCode::Internal, format!("writing the agent token: {e}"))
        })?;
        self.start_listener(handle, rec).map_err(|e| {
            ApiError::new(ErrorCode::Internal, format!("listening for the agent: {e}"))
        })?;
        let spec = SandboxSpec {
            id: id.clone(),
            rootfs: rootfs.to_path_buf(),
            state_dir: dir.clone(),
            run_dir,
            agent_dir: self.0.cfg.agent_dir.clone(),
            agent_env: vec![
                ("SPACE_SANDBOX_ID".into(), id.clone()),
                ("SPACE_AGENT_SOCKET".into(), "/.space/run/agent.sock".into()),
                ("SPACE_AGENT_TOKEN_FILE".into(), "/.space/run/token".into()),
                ("PATH".into(), "/usr/sbin:/usr/bin:/sbin:/bin".into()),
                (
                    "SPACE_PIDS_LIMIT".into(),
                    rec.sandbox.resources.pids.unwrap_or(0).to_string(),
                ),
            ]
            .into_iter()
            .chain(
                if attempt == 1 && failpoint_active("create:first_agent_silent") {
                    Some(("SPACE_FAILPOINT".to_string(), "agent:silent".to_string()))
                } else if attempt == 1 && failpoint_active("create:first_boot_stalls") {
                    Some(("SPACE_FAILPOINT".to_string(), "agent:stall".to_string()))
                } else {
                    agent_failpoint()
                },
            )
            .collect(),
            vcpus: rec.sandbox.resources.vcpus.unwrap_or(0),
            memory_mib: rec.sandbox.resources.memory_mib.unwrap_or(0),
            pids: rec.sandbox.resources.pids.unwrap_or(0),
            disk_mib: rec.sandbox.resources.disk_mib.unwrap_or(0),
            hostname: id.replace('_', "-"),
            network: network::egress_config(&rec.sandbox.network),
        };
        let created = self
            .0
            .runtimes
            .get(&rec.sandbox.runtime)
            .map_err(|why| ApiError::new(ErrorCode::RuntimeUnavailable, why))?
            .create(&spec)
            .await;
        match created {
            Ok(()) => {}
            Err(RuntimeError::BootStalled(detail)) => {
                return Ok(Err(NotStarted {
                    what: "its boot stalled",
                    detail,
                }))
            }
            Err(e) => return Err(ApiError::new(ErrorCode::RuntimeFailed, error_chain(&e))),
        }
        failpoint("create:after_boot");
        self.update_op(op_id, |op| {
            op.progress = Some("waiting for the agent".into())
        })
        .map_err(internal)?;
        let mut rx = handle.agent.subscribe();
        match agent::wait_connected(&mut rx, AGENT_CONNECT_TIMEOUT).await {
            Ok(conn) => Ok(Ok(conn)),
            Err(_) => {
                self.log_silent_agent(id, "a created sandbox's agent never dialled in")
                    .await;
                Ok(Err(NotStarted {
                    what: "its agent did not dial in",
                    detail: format!(
                        "its agent did not connect within {}s",
                        AGENT_CONNECT_TIMEOUT.as_secs()
                    ),
                }))
            }
        }
    }

    fn start_listener(
        &self,
        handle: &Arc<SandboxHandle>,
        rec: &SandboxRecord,
    ) -> std::io::Result<()> {
        // One socket for the sandbox's whole life in this server: a restored gVisor
        // sandbox may still know the socket file it dialled before its checkpoint, so a
        // listener bound anew (another inode at the same path) is one it may never reach.
        // The quiesce hold, not a closed listener, keeps the agent from dialling while
        // it is checkpointed.
        if lock(&handle.listener)
            .as_ref()
            .is_some_and(|(task, _)| !task.is_finished())
        {
            return Ok(());
        }
        let socket = self.sandbox_dir(&handle.id).join("run").join("agent.sock");
        if socket.as_os_str().len() >= 108 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "socket path {} is too long for a Unix socket: use a shorter --data-dir",
                    socket.display()
                ),
            ));
        }
        let task = agent::listen(
            handle.id.clone(),
            rec.agent_token.clone(),
            &socket,
            handle.agent.clone(),
            self.rt(&handle.id)
                .agent_hello_timeout()
                .unwrap_or(agent::HANDSHAKE_TIMEOUT),
        )?;
        if let Some((old, _)) = lock(&handle.listener).replace((task, socket)) {
            old.abort();
        }
        Ok(())
    }

    fn spawn_monitor(&self, handle: &Arc<SandboxHandle>) {
        let svc = self.clone();
        let handle = handle.clone();
        tokio::spawn(async move { svc.monitor(handle).await });
    }

    /// Watches a sandbox's agent connection. When it is missing for long, or
    /// when it drops and the runtime says the sandbox is no longer there, the
    /// sandbox is `failed` and its commands `lost`: nothing waits forever. A
    /// connected agent is health-checked by the connection itself (HTTP/2 pings,
    /// `agent::PING_TIMEOUT`): one that stops answering is dropped, and must dial
    /// back in within `READOPT_TIMEOUT`.
    async fn monitor(&self, handle: Arc<SandboxHandle>) {
        let mut rx = handle.agent.subscribe();
        let mut was_connected = false;
        loop {
            // Until the agent is connected, check every 200 ms that the sandbox still exists.
            let start = tokio::time::Instant::now();
            loop {
                let connected = tokio::select! {
                    r = tokio::time::timeout(Duration::from_millis(200), rx.wait_for(|c| c.is_some())) => match r {
                        Ok(Ok(_)) => true,
                        Ok(Err(_)) => return,
                        Err(_) => false,
                    },
                    _ = handle.closed.cancelled() => return,
                };
                if connected {
                    break;
                }
                let reason = match self.rt(&handle.id).status(&handle.id).await {
                    Ok(RuntimeStatus::Stopped) | Ok(RuntimeStatus::Missing) => Some(
                        self.rt(&handle.id)
                            .stop_reason(&handle.id)
                            .unwrap_or_else(|| {
                                "the sandbox stopped unexpectedly (its kernel or agent exited)"
                                    .into()
                            }),
                    ),
                    // A paused sandbox's agent cannot dial in; that is fine.
                    Ok(RuntimeStatus::Paused) => None,
                    _ if start.elapsed() > READOPT_TIMEOUT && was_connected => Some(format!(
                        "the sandbox's agent stopped answering and did not come back within {}s",
                        READOPT_TIMEOUT.as_secs()
                    )),
                    _ if start.elapsed() > READOPT_TIMEOUT => {
                        Some("the sandbox's agent did not connect in time".to_string())
                    }
                    _ => None,
                };
                if let Some(reason) = reason {
                    let _lifecycle = handle.lifecycle.lock().await;
                    let live = self.record(&handle.id).is_ok_and(|r| {
                        matches!(
                            r.sandbox.state,
                            SandboxState::Running | SandboxState::Paused
                        )
                    });
                    // Look again under the lock: a lifecycle operation may have changed things.
                    if handle.agent.borrow().is_some() {
                        continue;
                    }
                    if live && !handle.closed.is_cancelled() {
                        tracing::warn!(sandbox = %handle.id, %reason, "sandbox failed");
                        self.fail_sandbox(&handle, &reason).await;
                    }
                    return;
                }
            }
            // Connected: wait for the connection to go away.
            was_connected = true;
            tokio::select! {
                r = rx.wait_for(|c| c.is_none()) => if r.is_err() { return },
                _ = handle.closed.cancelled() => return,
            }
        }
    }

    /// Marks a sandbox failed and releases everything it holds.
    async fn fail_sandbox(&self, handle: &Arc<SandboxHandle>, reason: &str) {
        self.lose_commands(&handle.id, &format!("the sandbox failed: {reason}"));
        handle.closed.cancel();
        handle.stop_listener();
        if let Err(e) = self
            .rt(&handle.id)
            .destroy(&handle.id, &self.sandbox_dir(&handle.id))
            .await
        {
            tracing::error!(sandbox = %handle.id, error = %error_chain(&e), "cleaning up a failed sandbox failed");
        }
        let failed = self.modify_sandbox(&handle.id, |rec| {
            rec.sandbox.state = transition(rec.sandbox.state, SandboxEvent::Failed)?;
            rec.sandbox.failure_reason = Some(reason.to_string());
            rec.sandbox.updated_at = now_rfc3339();
            Ok::<_, ServiceError>(())
        });
        if let Err(e) = failed {
            tracing::debug!(sandbox = %handle.id, error = %e, "not marked failed");
        }
        self.forget_handle(&handle.id);
    }

    pub fn max_upload_bytes(&self) -> u64 {
        self.0.cfg.max_upload_bytes
    }

    pub(crate) fn record(&self, id: &str) -> Result<SandboxRecord> {
        self.0
            .store
            .get_sandbox(id)?
            .ok_or_else(|| ServiceError::NotFound(format!("no sandbox {id}")))
    }

    /// The sandboxes of `tenant`, optionally only those carrying all of `labels`.
    pub(crate) fn list_sandboxes(
        &self,
        tenant: &str,
        labels: &[(String, String)],
    ) -> Result<Vec<Sandbox>> {
        Ok(self
            .0
            .store
            .list_tenant_sandboxes(tenant)?
            .into_iter()
            .map(|r| r.sandbox)
            .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(v)))
            .map(|s| self.decorate(s))
            .collect())
    }

    // ---- operations ----

    pub(crate) fn operation(&self, id: &str) -> Result<Operation> {
        self.0
            .store
            .get_operation(id)?
            .ok_or_else(|| ServiceError::NotFound(format!("no operation {id}")))
    }

    /// The operation once it has ended, or as it is after `wait`.
    pub(crate) async fn wait_operation(&self, id: &str, wait: Duration) -> Result<Operation> {
        let mut rx = self.0.store.subscribe_events();
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            rx.borrow_and_update();
            let op = self.operation(id)?;
            if op.status.is_terminal() || wait.is_zero() {
                return Ok(op);
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => continue,
                _ => return self.operation(id),
            }
        }
    }

    fn update_op(&self, id: &str, f: impl Fn(&mut Operation)) -> Result<Operation> {
        self.modify_operation(id, |op| {
            f(op);
            op.updated_at = now_rfc3339();
            Ok::<_, ServiceError>(())
        })
        .map(|(op, ())| op)
    }

    /// Reads sandbox `id`, lets `f` change it and writes it back, compare-and-swap on the
    /// version read: when another writer came first, reads again and asks `f` again, so
    /// no write ever undoes another. `f` refusing (an `Err`) writes nothing.
    pub(crate) fn modify_sandbox<T, E: From<ServiceError>>(
        &self,
        id: &str,
        mut f: impl FnMut(&mut SandboxRecord) -> std::result::Result<T, E>,
    ) -> std::result::Result<(SandboxRecord, T), E> {
        for _ in 0..CAS_ATTEMPTS {
            let mut rec = self.record(id)?;
            let out = f(&mut rec)?;
            match self.0.store.update_sandbox(&mut rec) {
                Ok(()) => return Ok((rec, out)),
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(ServiceError::from(e).into()),
            }
        }
        Err(ServiceError::Conflict(format!("sandbox {id} kept changing under this write")).into())
    }

    /// [`Self::modify_sandbox`] for an operation.
    pub(crate) fn modify_operation<T, E: From<ServiceError>>(
        &self,
        id: &str,
        mut f: impl FnMut(&mut Operation) -> std::result::Result<T, E>,
    ) -> std::result::Result<(Operation, T), E> {
        for _ in 0..CAS_ATTEMPTS {
            let mut op = self.operation(id)?;
            let ended = op.status.is_terminal();
            let out = f(&mut op)?;
            match self.0.store.update_operation(&mut op) {
                Ok(()) => {
                    self.note_op_end(ended, &op);
                    return Ok((op, out));
                }
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(ServiceError::from(e).into()),
            }
        }
        Err(ServiceError::Conflict(format!("operation {id} kept changing under this write")).into())
    }

    /// [`Self::modify_sandbox`] for a sandbox and an operation written together.
    pub(crate) fn modify_sandbox_and_op<T, E: From<ServiceError>>(
        &self,
        id: &str,
        op_id: &str,
        mut f: impl FnMut(&mut SandboxRecord, &mut Operation) -> std::result::Result<T, E>,
    ) -> std::result::Result<(SandboxRecord, Operation, T), E> {
        for _ in 0..CAS_ATTEMPTS {
            let mut rec = self.record(id)?;
            let mut op = self.operation(op_id)?;
            let ended = op.status.is_terminal();
            let out = f(&mut rec, &mut op)?;
            match self.0.store.update_sandbox_and_op(&mut rec, &mut op) {
                Ok(()) => {
                    self.note_op_end(ended, &op);
                    return Ok((rec, op, out));
                }
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(ServiceError::from(e).into()),
            }
        }
        Err(ServiceError::Conflict(format!("sandbox {id} kept changing under this write")).into())
    }

    /// Counts an operation that a write just ended (`ended`: whether it had before).
    fn note_op_end(&self, ended: bool, op: &Operation) {
        if ended || !op.status.is_terminal() {
            return;
        }
        let took = retention::parse_time(&op.created_at)
            .map(|t| time::OffsetDateTime::now_utc() - t)
            .and_then(|d| std::time::Duration::try_from(d).ok())
            .unwrap_or_default();
        self.0
            .metrics
            .operation_ended(op.kind.as_str(), op.status.as_str(), took);
    }

    fn finish_op(&self, id: &str, error: Option<ApiError>) -> Result<Operation> {
        self.update_op(id, |op| {
            op.status = if error.is_some() {
                OperationStatus::Failed
            } else {
                OperationStatus::Succeeded
            };
            if error.is_none() {
                op.progress = Some("done".into());
            }
            op.error = error.clone();
        })
    }
}

/// Whether the test hooks (failpoints, extra egress names) are compiled in: only with
/// the `test-hooks` feature, which the test suite's build turns on and a production
/// build leaves off.
pub const TEST_HOOKS: bool = cfg!(feature = "test-hooks");

/// The failpoint the environment names (`SPACE_FAILPOINT`); never one without the
/// `test-hooks` feature.
fn failpoint_named() -> Option<String> {
    if TEST_HOOKS {
        std::env::var("SPACE_FAILPOINT").ok()
    } else {
        None
    }
}

/// Test hook: with `SPACE_FAILPOINT=<name>` the server kills itself (SIGKILL)
/// at that point, so tests can crash it in the middle of an operation.
pub(crate) fn failpoint(name: &str) {
    if failpoint_named().is_some_and(|v| v == name) {
        tracing::warn!(failpoint = name, "failpoint reached: killing the server");
        // SAFETY: plain syscalls on our own pid.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}

/// Test hook: a `SPACE_FAILPOINT=agent:<name>` of the server is the agent's (see
/// `space_agent`'s `failpoint` module), passed to every sandbox it creates.
fn agent_failpoint() -> Option<(String, String)> {
    failpoint_named()
        .filter(|v| {
            v.starts_with("agent:")
                && v.len() <= 64
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b":_-".contains(&b))
        })
        .map(|v| ("SPACE_FAILPOINT".to_string(), v))
}

/// Test hook: whether `SPACE_FAILPOINT=<name>` is set (for failpoints that change a path).
pub(crate) fn failpoint_active(name: &str) -> bool {
    failpoint_named().is_some_and(|v| v == name)
}

/// Test hook: with `SPACE_FAILPOINT=<name>` the operation hangs here forever,
/// so tests can see a stuck operation reach its deadline.
pub(crate) async fn failpoint_hang(name: &str) {
    if failpoint_named().is_some_and(|v| v == name) {
        tracing::warn!(failpoint = name, "failpoint reached: hanging");
        std::future::pending::<()>().await;
    }
}

fn new_operation(kind: OperationKind, sandbox_id: Option<&str>, tenant: &str) -> Operation {
    let now = now_rfc3339();
    Operation {
        id: new_id("op"),
        version: 0,
        kind,
        status: OperationStatus::Pending,
        sandbox_id: sandbox_id.map(str::to_owned),
        tenant: tenant.to_owned(),
        template: None,
        error: None,
        progress: None,
        created_at: now.clone(),
        updated_at: now,
    }
}

impl From<ServiceError> for ApiError {
    fn from(e: ServiceError) -> Self {
        internal(e)
    }
}

fn internal(e: impl Into<ServiceError>) -> ApiError {
    ApiError::new(ErrorCode::Internal, error_chain(&e.into()))
}

/// An error and its causes on one line.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// Writes the agent's token for a boot to read (0600). Not synced: it is read once, by the
/// boot that follows, and a host crash before then ends that boot too (the store keeps the
/// token). An fsync here held an async worker on the disk for about a millisecond a create.
fn write_secret(path: &std::path::Path, secret: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(secret.as_bytes())
}

/// Bounds shared by sandbox and command environments.
pub(crate) fn validate_env(env: &BTreeMap<String, String>) -> Result<()> {
    if env.len() > 1024 {
        return Err(ServiceError::BadRequest(
            "at most 1024 environment variables".into(),
        ));
    }
    let mut total = 0usize;
    for (k, v) in env {
        let valid_name = !k.is_empty()
            && k.len() <= 256
            && !k.contains('=')
            && !k.contains('\0')
            && !k.bytes().next().is_some_and(|b| b.is_ascii_digit());
        if !valid_name {
            return Err(ServiceError::BadRequest(format!(
                "invalid environment variable name {:?}",
                truncate(k, 64)
            )));
        }
        if v.contains('\0') {
            return Err(ServiceError::BadRequest(format!(
                "environment variable {k} contains a NUL byte"
            )));
        }
        total += k.len() + v.len();
    }
    if total > 256 * 1024 {
        return Err(ServiceError::BadRequest(
            "environment larger than 256 KiB".into(),
        ));
    }
    Ok(())
}

fn validate_labels(labels: &BTreeMap<String, String>) -> Result<()> {
    if labels.len() > 64 {
        return Err(ServiceError::BadRequest("at most 64 labels".into()));
    }
    for (k, v) in labels {
        let ok_key = !k.is_empty()
            && k.len() <= 63
            && k.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_./".contains(&b));
        if !ok_key || v.len() > 256 || v.contains('\0') {
            return Err(ServiceError::BadRequest(format!(
                "invalid label {:?}: keys are 1-63 characters of [A-Za-z0-9-_./], values at most 256 bytes",
                truncate(k, 64)
            )));
        }
    }
    Ok(())
}

pub use space_api::truncate;

impl From<AgentError> for ServiceError {
    /// The agent away or not answering is a 503 the caller may retry, never a hang; what
    /// it refused keeps the refusal's code when that is one of the API's.
    fn from(e: AgentError) -> Self {
        files::agent_failure(e)
    }
}

impl From<RuntimeError> for ServiceError {
    fn from(e: RuntimeError) -> Self {
        ServiceError::Internal(error_chain(&e))
    }
}

#[cfg(test)]
mod test_hooks {
    use super::*;

    /// `scripts/test.sh` runs this without the feature (a production build) and with it.
    #[test]
    fn failpoints_are_read_only_with_the_test_hooks_feature() {
        std::env::set_var("SPACE_FAILPOINT", "agent:wedge");
        assert_eq!(failpoint_named().is_some(), TEST_HOOKS);
        assert_eq!(failpoint_active("agent:wedge"), TEST_HOOKS);
        assert_eq!(agent_failpoint().is_some(), TEST_HOOKS);
        std::env::remove_var("SPACE_FAILPOINT");
    }
}
