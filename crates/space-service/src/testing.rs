//! Test doubles for the service's unit tests: a recording fake [`Runtime`] and a test
//! bed (an in-memory store that logs its writes, a throwaway data directory, records
//! seeded directly).
//!
//! The fake starts no process and touches no file: it records every call in order,
//! keeps the status it reports per sandbox (what a real driver would now say), and
//! can be told to fail a kind of call or to hold it until the test lets it go.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use space_api::{
    Command, CommandState, Event, Operation, OperationKind, OperationStatus, Resources, Sandbox,
    SandboxState,
};
use space_core::runtime::{Runtime, RuntimeError, RuntimeStatus, SandboxSpec};
use space_core::{new_id, new_token, now_rfc3339};
use space_store::{ApiKey, SandboxRecord, SqliteStore, Store, StoreError, TenantLimits};
use tokio::sync::{watch, Semaphore};

use super::runtimes::{RuntimeEntry, Runtimes};
use super::{lock, new_operation, Config, Limits, Service};

/// The runtime name the fake is registered under.
pub(crate) const FAKE: &str = "fake";

/// A kind of [`Runtime`] call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Op {
    Create,
    Pause,
    Resume,
    Stop,
    Destroy,
    Status,
    List,
    Checkpoint,
    SnapshotComplete,
    Restore,
    WakeAgent,
    RemoveBuildLeftovers,
}

impl Op {
    /// Calls that only ask; the monitor and reconcile make them at will.
    fn is_query(self) -> bool {
        matches!(self, Op::Status | Op::List | Op::SnapshotComplete)
    }
}

/// One recorded call: what, and on which sandbox (or image directory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Call {
    pub op: Op,
    pub id: String,
}

#[derive(Default)]
struct State {
    calls: Vec<Call>,
    status: HashMap<String, RuntimeStatus>,
    /// Kinds of call that fail, with the message they fail with.
    failing: HashMap<Op, String>,
    /// Kinds of call that wait for the test to let them go.
    held: HashMap<Op, Arc<Semaphore>>,
    /// Image directories holding a checkpoint `restore` can start from.
    snapshots: HashSet<PathBuf>,
}

/// A recording fake [`Runtime`].
pub(crate) struct FakeRuntime {
    state: Mutex<State>,
    /// The number of calls recorded so far (tests wait on it).
    recorded: watch::Sender<usize>,
}

impl FakeRuntime {
    pub(crate) fn new() -> Arc<FakeRuntime> {
        Arc::new(FakeRuntime {
            state: Mutex::new(State::default()),
            recorded: watch::channel(0).0,
        })
    }

    /// What `status(id)` says from now on.
    pub(crate) fn set_status(&self, id: &str, status: RuntimeStatus) {
        lock(&self.state).status.insert(id.to_string(), status);
    }

    pub(crate) fn status_of(&self, id: &str) -> RuntimeStatus {
        lock(&self.state)
            .status
            .get(id)
            .copied()
            .unwrap_or(RuntimeStatus::Missing)
    }

    /// Every call of kind `op` fails from now on (after being recorded), changing nothing.
    pub(crate) fn fail(&self, op: Op, message: &str) {
        lock(&self.state).failing.insert(op, message.to_string());
    }

    /// Every call of kind `op` waits (after being recorded) until [`Self::release`].
    pub(crate) fn hold(&self, op: Op) {
        lock(&self.state)
            .held
            .insert(op, Arc::new(Semaphore::new(0)));
    }

    /// Lets the held calls of kind `op` go on, and every later one.
    pub(crate) fn release(&self, op: Op) {
        if let Some(gate) = lock(&self.state).held.remove(&op) {
            gate.add_permits(Semaphore::MAX_PERMITS);
        }
    }

    /// `image_dir` holds a complete checkpoint.
    pub(crate) fn add_snapshot(&self, image_dir: &Path) {
        lock(&self.state).snapshots.insert(image_dir.to_path_buf());
    }

    /// Every call so far, in order.
    pub(crate) fn calls(&self) -> Vec<Call> {
        lock(&self.state).calls.clone()
    }

    /// The calls on `id` that act (queries left out), in order.
    pub(crate) fn actions(&self, id: &str) -> Vec<Op> {
        lock(&self.state)
            .calls
            .iter()
            .filter(|c| c.id == id && !c.op.is_query())
            .map(|c| c.op)
            .collect()
    }

    /// How many calls of kind `op` were made on `id`.
    pub(crate) fn count(&self, op: Op, id: &str) -> usize {
        lock(&self.state)
            .calls
            .iter()
            .filter(|c| c.op == op && c.id == id)
            .count()
    }

    /// Waits until a call of kind `op` on `id` has been recorded (at most 5 s).
    pub(crate) async fn called(&self, op: Op, id: &str) {
        let mut rx = self.recorded.subscribe();
        let seen = tokio::time::timeout(
            Duration::from_secs(5),
            rx.wait_for(|_| self.count(op, id) > 0),
        )
        .await;
        assert!(
            matches!(seen, Ok(Ok(_))),
            "no {op:?} call on {id}; calls: {:?}",
            self.calls()
        );
    }

    /// Records a call; then fails it, or holds it, as told.
    async fn call(&self, op: Op, id: &str) -> Result<(), RuntimeError> {
        let (gate, failing) = {
            let mut st = lock(&self.state);
            st.calls.push(Call {
                op,
                id: id.to_string(),
            });
            (st.held.get(&op).cloned(), st.failing.get(&op).cloned())
        };
        self.recorded.send_modify(|n| *n += 1);
        if let Some(gate) = gate {
            let _ = gate.acquire().await;
        }
        match failing {
            Some(message) => Err(RuntimeError::Tool {
                tool: "fake".into(),
                message,
            }),
            None => Ok(()),
        }
    }

    fn record_query(&self, op: Op, id: &str) {
        lock(&self.state).calls.push(Call {
            op,
            id: id.to_string(),
        });
        self.recorded.send_modify(|n| *n += 1);
    }
}

#[async_trait]
impl Runtime for FakeRuntime {
    fn name(&self) -> &'static str {
        FAKE
    }
    async fn create(&self, spec: &SandboxSpec) -> Result<(), RuntimeError> {
        self.call(Op::Create, &spec.id).await?;
        self.set_status(&spec.id, RuntimeStatus::Running);
        Ok(())
    }
    async fn pause(&self, id: &str) -> Result<(), RuntimeError> {
        self.call(Op::Pause, id).await?;
        self.set_status(id, RuntimeStatus::Paused);
        Ok(())
    }
    async fn resume(&self, id: &str) -> Result<(), RuntimeError> {
        self.call(Op::Resume, id).await?;
        self.set_status(id, RuntimeStatus::Running);
        Ok(())
    }
    async fn stop(&self, id: &str, _: &Path) -> Result<(), RuntimeError> {
        self.call(Op::Stop, id).await?;
        lock(&self.state).status.remove(id);
        Ok(())
    }
    async fn destroy(&self, id: &str, _: &Path) -> Result<(), RuntimeError> {
        self.call(Op::Destroy, id).await?;
        lock(&self.state).status.remove(id);
        Ok(())
    }
    async fn status(&self, id: &str) -> Result<RuntimeStatus, RuntimeError> {
        self.record_query(Op::Status, id);
        Ok(self.status_of(id))
    }
    async fn list(&self) -> Result<Vec<String>, RuntimeError> {
        self.record_query(Op::List, "");
        let mut ids: Vec<String> = lock(&self.state).status.keys().cloned().collect();
        ids.sort();
        Ok(ids)
    }
    async fn checkpoint(&self, id: &str, _: &Path, image_dir: &Path) -> Result<(), RuntimeError> {
        self.call(Op::Checkpoint, id).await?;
        let mut st = lock(&self.state);
        st.snapshots.insert(image_dir.to_path_buf());
        st.status.remove(id);
        Ok(())
    }
    fn snapshot_complete(&self, image_dir: &Path) -> bool {
        self.record_query(Op::SnapshotComplete, &image_dir.to_string_lossy());
        lock(&self.state).snapshots.contains(image_dir)
    }
    async fn restore(&self, id: &str, _: &Path, _: &Path) -> Result<(), RuntimeError> {
        self.call(Op::Restore, id).await?;
        self.set_status(id, RuntimeStatus::Running);
        Ok(())
    }
    fn resident_bytes(&self, _: &str, _: &Path) -> Option<u64> {
        None
    }
    async fn wake_agent(&self, id: &str) -> Result<(), RuntimeError> {
        self.call(Op::WakeAgent, id).await
    }
    async fn remove_build_leftovers(&self) {
        let _ = self.call(Op::RemoveBuildLeftovers, "").await;
    }
}

/// A throwaway service: an in-memory store, a temporary data directory and the fake
/// runtime. Seed records first, then [`TestBed::start`] (which reconciles them).
pub(crate) struct TestBed {
    pub dir: tempfile::TempDir,
    pub store: Arc<LoggingStore>,
    pub fake: Arc<FakeRuntime>,
}

impl TestBed {
    pub(crate) fn new() -> TestBed {
        TestBed {
            dir: tempfile::tempdir().expect("a temporary directory"),
            store: Arc::new(LoggingStore::new()),
            fake: FakeRuntime::new(),
        }
    }

    pub(crate) fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    pub(crate) fn config(&self) -> Config {
        Config {
            data_dir: self.data_dir(),
            templates_dir: self.dir.path().join("templates"),
            agent_dir: self.dir.path().join("agent"),
            max_concurrent_creates: 2,
            default_resources: Resources::default(),
            max_resources: Resources::default(),
            retention: Duration::from_secs(3600),
            operation_timeout: None,
            default_command_timeout_seconds: 0,
            max_command_timeout_seconds: 0,
            output_cap_bytes: 0,
            sandbox_output_budget_bytes: 0,
            template_import_dirs: Vec::new(),
            build_limits: Default::default(),
            build_runtime: FAKE.into(),
            max_upload_bytes: 1 << 20,
            server_token: None,
            limits: Limits::default(),
            pool_max_sandboxes: 16,
            pool_fills: 2,
            max_sandboxes: 0,
        }
    }

    /// Starts the service on the seeded store (reconciling it), with the default config.
    pub(crate) async fn start(&self) -> Service {
        self.start_with(|_| {}).await
    }

    pub(crate) async fn start_with(&self, tweak: impl FnOnce(&mut Config)) -> Service {
        let mut cfg = self.config();
        tweak(&mut cfg);
        let fake: Arc<dyn Runtime> = self.fake.clone();
        let runtimes = Runtimes::new(vec![RuntimeEntry {
            name: FAKE,
            accelerator: None,
            runtime: Ok(fake),
        }])
        .expect("the fake runtime is available");
        let store: Arc<dyn Store> = self.store.clone();
        Service::start_with_store(cfg, store, runtimes)
            .await
            .expect("the service starts")
    }

    /// A built template `name` on disk (metadata and an empty root), as a build leaves it.
    pub(crate) fn add_template(&self, name: &str) {
        let dir = self.dir.path().join("templates").join(name);
        std::fs::create_dir_all(dir.join("rootfs")).expect("template dir");
        let meta = serde_json::json!({
            "name": name,
            "version": "v1-test",
            "rootfs": dir.join("rootfs"),
            "env": [],
            "workdir": null,
            "user": null,
            "size_bytes": 0,
            "created_at": now_rfc3339(),
        });
        std::fs::write(dir.join("template.json"), meta.to_string()).expect("template.json");
    }

    /// Stores a sandbox of tenant `default` in `state` (its create operation
    /// succeeded), with its run directory, as a server that ran it would have left it.
    /// The fake runtime says it runs (or is paused) when the record says so.
    pub(crate) fn seed(&self, state: SandboxState) -> SandboxRecord {
        self.seed_with(state, |_| {})
    }

    pub(crate) fn seed_with(
        &self,
        state: SandboxState,
        f: impl FnOnce(&mut SandboxRecord),
    ) -> SandboxRecord {
        let now = now_rfc3339();
        let id = new_id("sb");
        let mut rec = SandboxRecord {
            sandbox: Sandbox {
                id: id.clone(),
                version: 0,
                tenant: space_api::DEFAULT_TENANT.into(),
                state,
                template: "busybox".into(),
                template_version: "v1-test".into(),
                runtime: FAKE.into(),
                accelerator: None,
                labels: Default::default(),
                resources: Resources::default(),
                env: Default::default(),
                secret_names: Vec::new(),
                network: Default::default(),
                created_at: now.clone(),
                updated_at: now.clone(),
                expires_at: None,
                failure_reason: None,
                last_active_at: Some(now),
                ttl_seconds: None,
                idle_timeout_seconds: None,
                on_idle: None,
                idle_expires_at: None,
                cost: Default::default(),
                destroyed_at: None,
            },
            agent_token: new_token(),
            rootfs: String::new(),
            template_env: Vec::new(),
            template_user: None,
            template_workdir: None,
            snapshot_dir: None,
            secrets: Default::default(),
        };
        f(&mut rec);
        let mut op = new_operation(OperationKind::Create, Some(&id), &rec.sandbox.tenant);
        op.status = OperationStatus::Succeeded;
        self.store
            .insert_sandbox(&rec, &op)
            .expect("seeding a sandbox");
        std::fs::create_dir_all(self.data_dir().join("sandboxes").join(&id).join("run"))
            .expect("the sandbox's run dir");
        match rec.sandbox.state {
            SandboxState::Running => self.fake.set_status(&id, RuntimeStatus::Running),
            SandboxState::Paused => self.fake.set_status(&id, RuntimeStatus::Paused),
            _ => {}
        }
        self.sandbox(&id)
    }

    /// Stores an operation of `kind` (on sandbox `sb`, if any), in `status`.
    pub(crate) fn seed_op(
        &self,
        sb: Option<&str>,
        kind: OperationKind,
        status: OperationStatus,
    ) -> Operation {
        let mut op = new_operation(kind, sb, space_api::DEFAULT_TENANT);
        op.status = status;
        self.store
            .insert_operation(&op)
            .expect("seeding an operation");
        self.operation(&op.id)
    }

    /// Stores a command of sandbox `sb` in `state`.
    pub(crate) fn seed_command(&self, sb: &str, state: CommandState) -> Command {
        let id = new_id("cmd");
        let cmd = Command {
            id: id.clone(),
            version: 0,
            sandbox_id: sb.to_string(),
            state,
            pid: None,
            argv: vec!["sleep".into(), "1000".into()],
            cwd: None,
            user: None,
            secret_names: Vec::new(),
            stdin: false,
            pty: None,
            timeout_seconds: None,
            created_at: now_rfc3339(),
            ended_at: None,
            result: None,
            lost_reason: None,
            output_url: format!("/v1/sandboxes/{sb}/commands/{id}/output"),
            stdout: None,
            stderr: None,
            inline_truncated: None,
        };
        self.store
            .insert_command(space_api::DEFAULT_TENANT, &cmd)
            .expect("seeding a command");
        cmd
    }

    pub(crate) fn commands(&self, sb: &str) -> Vec<Command> {
        self.store.list_commands(sb).expect("listing commands")
    }

    pub(crate) fn sandbox(&self, id: &str) -> SandboxRecord {
        self.store
            .get_sandbox(id)
            .expect("reading a sandbox")
            .expect("the sandbox exists")
    }

    pub(crate) fn operation(&self, id: &str) -> Operation {
        self.store
            .get_operation(id)
            .expect("reading an operation")
            .expect("the operation exists")
    }

    /// Every operation of sandbox `sb`, oldest first.
    pub(crate) fn operations(&self, sb: &str) -> Vec<Operation> {
        let mut ops = self
            .store
            .list_operations(space_api::DEFAULT_TENANT, Some(sb), 1000)
            .expect("listing operations");
        ops.reverse();
        ops
    }

    /// The states the events recorded for sandbox `sb`, and the statuses for its
    /// operation `op`, in one sequence (`"sandbox:running"`, `"operation:succeeded"`).
    pub(crate) fn history(&self, sb: &str, op: &str) -> Vec<String> {
        self.store
            .events_after(space_api::DEFAULT_TENANT, 0, 10_000)
            .expect("reading events")
            .into_iter()
            .filter(|e| e.object["id"] == sb || e.object["id"] == op)
            .map(|e| {
                let what = if e.kind == "sandbox" {
                    "state"
                } else {
                    "status"
                };
                format!("{}:{}", e.kind, e.object[what].as_str().unwrap_or("?"))
            })
            .collect()
    }
}

/// One write to the store: the method, and the ids it wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Write {
    pub what: &'static str,
    pub ids: Vec<String>,
}

/// An in-memory [`SqliteStore`] that logs every write made through the [`Store`]
/// trait, so a test can tell one transaction from two, and "nothing stored" from
/// "nothing changed".
pub(crate) struct LoggingStore {
    inner: SqliteStore,
    writes: Mutex<Vec<Write>>,
}

impl LoggingStore {
    pub(crate) fn new() -> LoggingStore {
        LoggingStore {
            inner: SqliteStore::open_in_memory().expect("an in-memory store"),
            writes: Mutex::new(Vec::new()),
        }
    }

    fn log<T>(
        &self,
        what: &'static str,
        ids: &[&str],
        r: Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        if r.is_ok() {
            lock(&self.writes).push(Write {
                what,
                ids: ids.iter().map(|s| s.to_string()).collect(),
            });
        }
        r
    }

    /// Every successful write of records so far, in order (the reaper's purge of old
    /// events, which runs on its own clock, left out).
    pub(crate) fn writes(&self) -> Vec<Write> {
        lock(&self.writes)
            .iter()
            .filter(|w| w.what != "purge_events_before")
            .cloned()
            .collect()
    }

    /// The successful writes that touched `id`, in order.
    pub(crate) fn writes_on(&self, id: &str) -> Vec<&'static str> {
        lock(&self.writes)
            .iter()
            .filter(|w| w.ids.iter().any(|i| i == id))
            .map(|w| w.what)
            .collect()
    }
}

impl Store for LoggingStore {
    fn subscribe_events(&self) -> watch::Receiver<i64> {
        self.inner.subscribe_events()
    }
    fn events_after(
        &self,
        tenant: &str,
        after: i64,
        limit: usize,
    ) -> Result<Vec<Event>, StoreError> {
        self.inner.events_after(tenant, after, limit)
    }
    fn purge_sandbox(&self, id: &str) -> Result<(), StoreError> {
        self.log("purge_sandbox", &[id], self.inner.purge_sandbox(id))
    }
    fn purge_events_before(&self, before: &str) -> Result<usize, StoreError> {
        self.log(
            "purge_events_before",
            &[],
            self.inner.purge_events_before(before),
        )
    }
    fn insert_sandbox(&self, rec: &SandboxRecord, op: &Operation) -> Result<(), StoreError> {
        let r = self.inner.insert_sandbox(rec, op);
        self.log("insert_sandbox", &[&rec.sandbox.id, &op.id], r)
    }
    fn update_sandbox(&self, rec: &mut SandboxRecord) -> Result<(), StoreError> {
        let r = self.inner.update_sandbox(rec);
        self.log("update_sandbox", &[&rec.sandbox.id], r)
    }
    fn set_sandbox_times(
        &self,
        id: &str,
        last_active_at: &str,
        expiry: Option<(&str, u64)>,
        event: bool,
    ) -> Result<bool, StoreError> {
        let r = self
            .inner
            .set_sandbox_times(id, last_active_at, expiry, event);
        self.log("set_sandbox_times", &[id], r)
    }
    fn update_sandbox_and_op(
        &self,
        rec: &mut SandboxRecord,
        op: &mut Operation,
    ) -> Result<(), StoreError> {
        let r = self.inner.update_sandbox_and_op(rec, op);
        self.log("update_sandbox_and_op", &[&rec.sandbox.id, &op.id], r)
    }
    fn get_sandbox(&self, id: &str) -> Result<Option<SandboxRecord>, StoreError> {
        self.inner.get_sandbox(id)
    }
    fn list_sandboxes(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        self.inner.list_sandboxes()
    }
    fn list_tenant_sandboxes(&self, tenant: &str) -> Result<Vec<SandboxRecord>, StoreError> {
        self.inner.list_tenant_sandboxes(tenant)
    }
    fn count_tenant_sandboxes(&self, tenant: &str) -> Result<u64, StoreError> {
        self.inner.count_tenant_sandboxes(tenant)
    }
    fn count_resident_sandboxes(&self) -> Result<u64, StoreError> {
        self.inner.count_resident_sandboxes()
    }
    fn insert_operation(&self, op: &Operation) -> Result<(), StoreError> {
        let ids = [op.id.as_str(), op.sandbox_id.as_deref().unwrap_or_default()];
        self.log("insert_operation", &ids, self.inner.insert_operation(op))
    }
    fn update_operation(&self, op: &mut Operation) -> Result<(), StoreError> {
        let r = self.inner.update_operation(op);
        self.log("update_operation", &[&op.id], r)
    }
    fn get_operation(&self, id: &str) -> Result<Option<Operation>, StoreError> {
        self.inner.get_operation(id)
    }
    fn list_operations(
        &self,
        tenant: &str,
        sandbox_id: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Operation>, StoreError> {
        self.inner.list_operations(tenant, sandbox_id, limit)
    }
    fn count_unfinished_builds(&self, tenant: &str) -> Result<u64, StoreError> {
        self.inner.count_unfinished_builds(tenant)
    }
    fn unfinished_operations(&self) -> Result<Vec<Operation>, StoreError> {
        self.inner.unfinished_operations()
    }
    fn insert_command(&self, tenant: &str, cmd: &Command) -> Result<(), StoreError> {
        let r = self.inner.insert_command(tenant, cmd);
        self.log("insert_command", &[&cmd.id, &cmd.sandbox_id], r)
    }
    fn update_command(&self, cmd: &mut Command) -> Result<(), StoreError> {
        let r = self.inner.update_command(cmd);
        self.log("update_command", &[&cmd.id, &cmd.sandbox_id], r)
    }
    fn get_command(&self, sandbox_id: &str, id: &str) -> Result<Option<Command>, StoreError> {
        self.inner.get_command(sandbox_id, id)
    }
    fn list_commands(&self, sandbox_id: &str) -> Result<Vec<Command>, StoreError> {
        self.inner.list_commands(sandbox_id)
    }
    fn unfinished_commands(&self) -> Result<Vec<Command>, StoreError> {
        self.inner.unfinished_commands()
    }
    fn count_unfinished_commands(
        &self,
        tenant: &str,
        sandbox_id: &str,
    ) -> Result<(u64, u64), StoreError> {
        self.inner.count_unfinished_commands(tenant, sandbox_id)
    }
    fn insert_api_key(&self, key: &ApiKey, hash: &str) -> Result<(), StoreError> {
        self.log(
            "insert_api_key",
            &[&key.id],
            self.inner.insert_api_key(key, hash),
        )
    }
    fn tenant_for_key_hash(&self, hash: &str) -> Result<Option<String>, StoreError> {
        self.inner.tenant_for_key_hash(hash)
    }
    fn key_for_hash(&self, hash: &str) -> Result<Option<(String, String)>, StoreError> {
        self.inner.key_for_hash(hash)
    }
    fn command_sandbox(&self, id: &str) -> Result<Option<String>, StoreError> {
        self.inner.command_sandbox(id)
    }
    fn insert_access_token(
        &self,
        hash: &str,
        sandbox_id: &str,
        tenant: &str,
        keep: usize,
    ) -> Result<(), StoreError> {
        self.inner
            .insert_access_token(hash, sandbox_id, tenant, keep)
    }
    fn access_token(&self, hash: &str) -> Result<Option<(String, String)>, StoreError> {
        self.inner.access_token(hash)
    }
    fn revoked_key_ids(&self) -> Result<Vec<String>, StoreError> {
        self.inner.revoked_key_ids()
    }
    fn list_api_keys(&self, tenant: Option<&str>) -> Result<Vec<ApiKey>, StoreError> {
        self.inner.list_api_keys(tenant)
    }
    fn revoke_api_key(&self, id: &str, now: &str) -> Result<bool, StoreError> {
        self.log("revoke_api_key", &[id], self.inner.revoke_api_key(id, now))
    }
    fn tenant_limits(&self, tenant: &str) -> Result<TenantLimits, StoreError> {
        self.inner.tenant_limits(tenant)
    }
    fn set_tenant_limits(&self, tenant: &str, l: &TenantLimits) -> Result<(), StoreError> {
        self.log(
            "set_tenant_limits",
            &[tenant],
            self.inner.set_tenant_limits(tenant, l),
        )
    }
    fn template_owner(&self, name: &str) -> Result<Option<String>, StoreError> {
        self.inner.template_owner(name)
    }
    fn claim_template(&self, name: &str, tenant: &str) -> Result<bool, StoreError> {
        self.log(
            "claim_template",
            &[name],
            self.inner.claim_template(name, tenant),
        )
    }
    fn release_template(&self, name: &str) -> Result<(), StoreError> {
        self.log(
            "release_template",
            &[name],
            self.inner.release_template(name),
        )
    }
    fn list_pools(&self) -> Result<Vec<space_api::Pool>, StoreError> {
        self.inner.list_pools()
    }
    fn put_pool(&self, pool: &space_api::Pool) -> Result<(), StoreError> {
        self.log("put_pool", &[&pool.id], self.inner.put_pool(pool))
    }
    fn delete_pool(&self, id: &str) -> Result<bool, StoreError> {
        self.log("delete_pool", &[id], self.inner.delete_pool(id))
    }
    fn claim_sandbox(
        &self,
        rec: &mut SandboxRecord,
        from: &str,
        op: &Operation,
    ) -> Result<(), StoreError> {
        let ids = [rec.sandbox.id.clone(), op.id.clone()];
        let r = self.inner.claim_sandbox(rec, from, op);
        self.log("claim_sandbox", &[&ids[0], &ids[1]], r)
    }
}
