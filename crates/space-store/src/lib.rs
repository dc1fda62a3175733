//! space's durable state: sandboxes, operations and commands in SQLite (WAL).
//!
//! Each row keeps the API object as a JSON document plus the columns we query
//! by. Every write is one transaction, so a crash leaves either the old or the
//! new version of an object, never half of one.

use std::path::Path;
use std::sync::{Mutex, MutexGuard};

use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};
use space_api::{Command, Event, Operation, Pool, Sandbox};

mod pools;
mod tenants;
pub use tenants::{ApiKey, TenantLimits};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error")]
    Sqlite(#[from] rusqlite::Error),
    #[error("stored document is corrupt")]
    Corrupt(#[from] serde_json::Error),
    #[error("database schema version {0} is newer than this server understands")]
    TooNew(i64),
    /// A compare-and-swap write lost: the object changed since it was read (or is gone).
    /// Read it again and decide again; nothing was written.
    #[error("{what} {id} changed since version {version} was read")]
    Conflict {
        what: &'static str,
        id: String,
        version: u64,
    },
    #[error("cannot make {} private", path.display())]
    Permissions {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A sandbox plus what only the server may see.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SandboxRecord {
    pub sandbox: Sandbox,
    /// Secret the agent presents when it dials in.
    pub agent_token: String,
    /// The template root this sandbox runs on.
    pub rootfs: String,
    /// Environment from the template, applied under the sandbox's own env.
    pub template_env: Vec<(String, String)>,
    pub template_user: Option<String>,
    pub template_workdir: Option<String>,
    /// Where the snapshot of a suspended sandbox is.
    #[serde(default)]
    pub snapshot_dir: Option<String>,
    /// The sandbox's secrets (`sandbox.secret_names` has their names): given to every
    /// command, never part of an API response or an event.
    #[serde(default)]
    pub secrets: std::collections::BTreeMap<String, String>,
}

const MIGRATIONS: &[&str] = &[
    // 1: initial schema.
    "CREATE TABLE sandboxes (
        id TEXT PRIMARY KEY,
        state TEXT NOT NULL,
        created_at TEXT NOT NULL,
        doc TEXT NOT NULL
    );
    CREATE TABLE operations (
        id TEXT PRIMARY KEY,
        sandbox_id TEXT,
        kind TEXT NOT NULL,
        status TEXT NOT NULL,
        created_at TEXT NOT NULL,
        doc TEXT NOT NULL
    );
    CREATE INDEX operations_sandbox ON operations(sandbox_id);
    CREATE INDEX operations_status ON operations(status);
    CREATE TABLE commands (
        id TEXT PRIMARY KEY,
        sandbox_id TEXT NOT NULL,
        state TEXT NOT NULL,
        created_at TEXT NOT NULL,
        doc TEXT NOT NULL
    );
    CREATE INDEX commands_sandbox ON commands(sandbox_id, created_at);
    CREATE INDEX commands_state ON commands(state);",
    // 2: the event log behind GET /v1/events.
    "CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        kind TEXT NOT NULL,
        object_id TEXT NOT NULL,
        created_at TEXT NOT NULL,
        doc TEXT NOT NULL
    );
    CREATE INDEX events_created ON events(created_at);",
    // 3: tenants: API keys (hashed), per-tenant limits, template ownership.
    "CREATE TABLE api_keys (
        id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        hash TEXT NOT NULL UNIQUE,
        name TEXT NOT NULL DEFAULT '',
        created_at TEXT NOT NULL,
        revoked_at TEXT
    );
    CREATE INDEX api_keys_tenant ON api_keys(tenant);
    CREATE TABLE tenants (
        name TEXT PRIMARY KEY,
        max_sandboxes INTEGER,
        max_running_commands INTEGER,
        creates_per_minute INTEGER
    );
    CREATE TABLE template_owners (
        name TEXT PRIMARY KEY,
        tenant TEXT NOT NULL
    );",
    // 4: the tenant as a column of every object and event, so that every list, count
    // and event stream is filtered in SQL and costs only the caller's own rows.
    "ALTER TABLE sandboxes ADD COLUMN tenant TEXT NOT NULL DEFAULT 'default';
    UPDATE sandboxes SET tenant = COALESCE(json_extract(doc, '$.sandbox.tenant'), 'default');
    CREATE INDEX sandboxes_tenant ON sandboxes(tenant, created_at);
    ALTER TABLE operations ADD COLUMN tenant TEXT NOT NULL DEFAULT 'default';
    UPDATE operations SET tenant = COALESCE(
        (SELECT s.tenant FROM sandboxes s WHERE s.id = operations.sandbox_id),
        (SELECT o.tenant FROM template_owners o WHERE o.name = json_extract(operations.doc, '$.template')),
        'default');
    CREATE INDEX operations_tenant ON operations(tenant, created_at);
    CREATE INDEX operations_tenant_kind ON operations(tenant, kind, status);
    ALTER TABLE commands ADD COLUMN tenant TEXT NOT NULL DEFAULT 'default';
    UPDATE commands SET tenant = COALESCE(
        (SELECT s.tenant FROM sandboxes s WHERE s.id = commands.sandbox_id), 'default');
    CREATE INDEX commands_tenant_state ON commands(tenant, state);
    CREATE INDEX commands_sandbox_state ON commands(sandbox_id, state);
    ALTER TABLE events ADD COLUMN tenant TEXT NOT NULL DEFAULT 'default';
    UPDATE events SET tenant = COALESCE(
        CASE kind WHEN 'sandbox' THEN json_extract(doc, '$.tenant') END,
        (SELECT s.tenant FROM sandboxes s WHERE s.id = json_extract(events.doc, '$.sandbox_id')),
        (SELECT o.tenant FROM template_owners o WHERE o.name = json_extract(events.doc, '$.template')),
        'default');
    CREATE INDEX events_tenant ON events(tenant, id);",
    // 5: versions, for compare-and-swap writes: an update names the version it read.
    "ALTER TABLE sandboxes ADD COLUMN version INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE operations ADD COLUMN version INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE commands ADD COLUMN version INTEGER NOT NULL DEFAULT 0;",
    // 6: per-sandbox access tokens (hashed), which the E2B-compatible envd API takes.
    "CREATE TABLE access_tokens (
        hash TEXT PRIMARY KEY,
        sandbox_id TEXT NOT NULL,
        tenant TEXT NOT NULL,
        created_at TEXT NOT NULL
    );
    CREATE INDEX access_tokens_sandbox ON access_tokens(sandbox_id, created_at);",
    // 7: warm pools (their sandboxes are rows of the service's pool tenant).
    "CREATE TABLE pools (
        id TEXT PRIMARY KEY,
        created_at TEXT NOT NULL,
        doc TEXT NOT NULL
    );",
];

/// The SQLite store (one connection, WAL). Each call is one transaction, run off the
/// async worker threads (see [`offload`]).
pub struct SqliteStore {
    conn: Mutex<Connection>,
    /// The id of the newest event; changes wake event streams and long-polls.
    latest_event: tokio::sync::watch::Sender<i64>,
}

/// Everything the service keeps durable, behind one trait so that another database can
/// replace SQLite (a PostgreSQL implementation is the multi-host plan: docs/MULTIHOST.md).
/// Nothing in it is SQLite's: objects go in and out as the wire types (plus
/// [`SandboxRecord`]), lists and counts are per tenant, and every update of a sandbox,
/// operation or command is compare-and-swap on the version it was read at
/// ([`StoreError::Conflict`] when someone else wrote first).
pub trait Store: Send + Sync {
    /// Watches the id of the newest event.
    fn subscribe_events(&self) -> tokio::sync::watch::Receiver<i64>;
    /// Events of `tenant` with an id above `after`, oldest first, at most `limit`.
    fn events_after(
        &self,
        tenant: &str,
        after: i64,
        limit: usize,
    ) -> Result<Vec<Event>, StoreError>;
    /// Deletes a destroyed sandbox's records: its operations, commands and the sandbox row.
    fn purge_sandbox(&self, id: &str) -> Result<(), StoreError>;
    /// Deletes events older than `before` (RFC 3339).
    fn purge_events_before(&self, before: &str) -> Result<usize, StoreError>;
    /// Inserts a new sandbox and the operation creating it, atomically.
    fn insert_sandbox(&self, rec: &SandboxRecord, op: &Operation) -> Result<(), StoreError>;
    /// Writes `rec` if the stored sandbox is still at `rec.sandbox.version` (else
    /// [`StoreError::Conflict`], nothing written); on success `rec` has the new version.
    fn update_sandbox(&self, rec: &mut SandboxRecord) -> Result<(), StoreError>;
    /// Sets a sandbox's activity time (and, for a keepalive, its expiry and TTL) in place,
    /// without reading and writing back the whole document, so it can never undo a state
    /// change made meanwhile. Nothing is set on a sandbox that is being destroyed, is
    /// destroyed or failed; `false` then. With `event`, the sandbox as it now is becomes
    /// an event.
    fn set_sandbox_times(
        &self,
        id: &str,
        last_active_at: &str,
        expiry: Option<(&str, u64)>,
        event: bool,
    ) -> Result<bool, StoreError>;
    /// Updates a sandbox and an operation in one transaction, each compare-and-swap on
    /// the version it carries: both are written, or neither.
    fn update_sandbox_and_op(
        &self,
        rec: &mut SandboxRecord,
        op: &mut Operation,
    ) -> Result<(), StoreError>;
    fn get_sandbox(&self, id: &str) -> Result<Option<SandboxRecord>, StoreError>;
    /// Every sandbox, oldest first (server-side policies and reconcile).
    fn list_sandboxes(&self) -> Result<Vec<SandboxRecord>, StoreError>;
    /// The sandboxes of one tenant, oldest first.
    fn list_tenant_sandboxes(&self, tenant: &str) -> Result<Vec<SandboxRecord>, StoreError>;
    /// How many sandboxes of `tenant` are not destroyed (failed ones count: they hold
    /// records and output until they are destroyed or purged).
    fn count_tenant_sandboxes(&self, tenant: &str) -> Result<u64, StoreError>;
    /// How many sandboxes of every tenant (pooled ones included) hold the host's memory
    /// and CPU: all but the suspended (unless a resume of it is under way), the destroyed
    /// and the failed.
    fn count_resident_sandboxes(&self) -> Result<u64, StoreError>;
    fn insert_operation(&self, op: &Operation) -> Result<(), StoreError>;
    /// Writes `op` if the stored operation is still at `op.version` (else
    /// [`StoreError::Conflict`]); on success `op` has the new version.
    fn update_operation(&self, op: &mut Operation) -> Result<(), StoreError>;
    fn get_operation(&self, id: &str) -> Result<Option<Operation>, StoreError>;
    /// Operations of `tenant` newest first, optionally of one sandbox, at most `limit`.
    fn list_operations(
        &self,
        tenant: &str,
        sandbox_id: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Operation>, StoreError>;
    /// Build operations of `tenant` that have not ended.
    fn count_unfinished_builds(&self, tenant: &str) -> Result<u64, StoreError>;
    /// Operations that have not ended, oldest first.
    fn unfinished_operations(&self) -> Result<Vec<Operation>, StoreError>;
    /// Stores a new command of a sandbox of `tenant`.
    fn insert_command(&self, tenant: &str, cmd: &Command) -> Result<(), StoreError>;
    /// Writes `cmd` if the stored command is still at `cmd.version` (else
    /// [`StoreError::Conflict`]); on success `cmd` has the new version.
    fn update_command(&self, cmd: &mut Command) -> Result<(), StoreError>;
    fn get_command(&self, sandbox_id: &str, id: &str) -> Result<Option<Command>, StoreError>;
    /// The sandbox of command `id` (ids are unique across sandboxes).
    fn command_sandbox(&self, id: &str) -> Result<Option<String>, StoreError>;
    /// Commands of a sandbox, oldest first.
    fn list_commands(&self, sandbox_id: &str) -> Result<Vec<Command>, StoreError>;
    /// Commands that have not ended, in any sandbox.
    fn unfinished_commands(&self) -> Result<Vec<Command>, StoreError>;
    /// How many commands have not ended: of `tenant`, and of the sandbox `sandbox_id`.
    fn count_unfinished_commands(
        &self,
        tenant: &str,
        sandbox_id: &str,
    ) -> Result<(u64, u64), StoreError>;
    fn insert_api_key(&self, key: &ApiKey, hash: &str) -> Result<(), StoreError>;
    /// The tenant of the live (not revoked) key with this hash.
    fn tenant_for_key_hash(&self, hash: &str) -> Result<Option<String>, StoreError>;
    /// The id and tenant of the live (not revoked) key with this hash.
    fn key_for_hash(&self, hash: &str) -> Result<Option<(String, String)>, StoreError>;
    /// Stores the hash of a new access token of a sandbox, keeping only the sandbox's
    /// `keep` newest tokens.
    fn insert_access_token(
        &self,
        hash: &str,
        sandbox_id: &str,
        tenant: &str,
        keep: usize,
    ) -> Result<(), StoreError>;
    /// The sandbox and tenant of the access token with this hash.
    fn access_token(&self, hash: &str) -> Result<Option<(String, String)>, StoreError>;
    /// Ids of every revoked key (`space keys revoke` writes the database directly, so a
    /// running server learns of revocations by reading them).
    fn revoked_key_ids(&self) -> Result<Vec<String>, StoreError>;
    /// Every key, oldest first; of one tenant when `tenant` is set.
    fn list_api_keys(&self, tenant: Option<&str>) -> Result<Vec<ApiKey>, StoreError>;
    /// Revokes a key; `false` when there is no live key with that id.
    fn revoke_api_key(&self, id: &str, now: &str) -> Result<bool, StoreError>;
    fn tenant_limits(&self, tenant: &str) -> Result<TenantLimits, StoreError>;
    fn set_tenant_limits(&self, tenant: &str, l: &TenantLimits) -> Result<(), StoreError>;
    /// The tenant that built the template `name` (`None`: built-in, or built
    /// before tenants existed).
    fn template_owner(&self, name: &str) -> Result<Option<String>, StoreError>;
    /// Claims `name` for `tenant`; `false` when another tenant owns it.
    fn claim_template(&self, name: &str, tenant: &str) -> Result<bool, StoreError>;
    fn release_template(&self, name: &str) -> Result<(), StoreError>;
    /// Every warm pool, oldest first.
    fn list_pools(&self) -> Result<Vec<Pool>, StoreError>;
    /// Stores a pool (new, or changed under its id).
    fn put_pool(&self, pool: &Pool) -> Result<(), StoreError>;
    /// Removes a pool; `false` when there is none with that id.
    fn delete_pool(&self, id: &str) -> Result<bool, StoreError>;
    /// Moves the pooled sandbox `rec` (read at its version, still of tenant `from`) to
    /// the tenant and settings `rec` now has, with `op` as its create, in one
    /// compare-and-swap transaction; what its time in the pool left in the store
    /// (operations, commands, access tokens) goes.
    fn claim_sandbox(
        &self,
        rec: &mut SandboxRecord,
        from: &str,
        op: &Operation,
    ) -> Result<(), StoreError>;
}

impl Store for SqliteStore {
    fn subscribe_events(&self) -> tokio::sync::watch::Receiver<i64> {
        offload(|| SqliteStore::subscribe_events(self))
    }

    fn events_after(
        &self,
        tenant: &str,
        after: i64,
        limit: usize,
    ) -> Result<Vec<Event>, StoreError> {
        offload(|| SqliteStore::events_after(self, tenant, after, limit))
    }

    fn purge_sandbox(&self, id: &str) -> Result<(), StoreError> {
        offload(|| SqliteStore::purge_sandbox(self, id))
    }

    fn purge_events_before(&self, before: &str) -> Result<usize, StoreError> {
        offload(|| SqliteStore::purge_events_before(self, before))
    }

    fn insert_sandbox(&self, rec: &SandboxRecord, op: &Operation) -> Result<(), StoreError> {
        offload(|| SqliteStore::insert_sandbox(self, rec, op))
    }

    fn update_sandbox(&self, rec: &mut SandboxRecord) -> Result<(), StoreError> {
        offload(|| SqliteStore::update_sandbox(self, rec))
    }

    fn set_sandbox_times(
        &self,
        id: &str,
        last_active_at: &str,
        expiry: Option<(&str, u64)>,
        event: bool,
    ) -> Result<bool, StoreError> {
        offload(|| SqliteStore::set_sandbox_times(self, id, last_active_at, expiry, event))
    }

    fn update_sandbox_and_op(
        &self,
        rec: &mut SandboxRecord,
        op: &mut Operation,
    ) -> Result<(), StoreError> {
        offload(|| SqliteStore::update_sandbox_and_op(self, rec, op))
    }

    fn get_sandbox(&self, id: &str) -> Result<Option<SandboxRecord>, StoreError> {
        offload(|| SqliteStore::get_sandbox(self, id))
    }

    fn list_sandboxes(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        offload(|| SqliteStore::list_sandboxes(self))
    }

    fn list_tenant_sandboxes(&self, tenant: &str) -> Result<Vec<SandboxRecord>, StoreError> {
        offload(|| SqliteStore::list_tenant_sandboxes(self, tenant))
    }

    fn count_tenant_sandboxes(&self, tenant: &str) -> Result<u64, StoreError> {
        offload(|| SqliteStore::count_tenant_sandboxes(self, tenant))
    }

    fn count_resident_sandboxes(&self) -> Result<u64, StoreError> {
        offload(|| SqliteStore::count_resident_sandboxes(self))
    }

    fn insert_operation(&self, op: &Operation) -> Result<(), StoreError> {
        offload(|| SqliteStore::insert_operation(self, op))
    }

    fn update_operation(&self, op: &mut Operation) -> Result<(), StoreError> {
        offload(|| SqliteStore::update_operation(self, op))
    }

    fn get_operation(&self, id: &str) -> Result<Option<Operation>, StoreError> {
        offload(|| SqliteStore::get_operation(self, id))
    }

    fn list_operations(
        &self,
        tenant: &str,
        sandbox_id: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Operation>, StoreError> {
        offload(|| SqliteStore::list_operations(self, tenant, sandbox_id, limit))
    }

    fn count_unfinished_builds(&self, tenant: &str) -> Result<u64, StoreError> {
        offload(|| SqliteStore::count_unfinished_builds(self, tenant))
    }

    fn unfinished_operations(&self) -> Result<Vec<Operation>, StoreError> {
        offload(|| SqliteStore::unfinished_operations(self))
    }

    fn insert_command(&self, tenant: &str, cmd: &Command) -> Result<(), StoreError> {
        offload(|| SqliteStore::insert_command(self, tenant, cmd))
    }

    fn update_command(&self, cmd: &mut Command) -> Result<(), StoreError> {
        offload(|| SqliteStore::update_command(self, cmd))
    }

    fn get_command(&self, sandbox_id: &str, id: &str) -> Result<Option<Command>, StoreError> {
        offload(|| SqliteStore::get_command(self, sandbox_id, id))
    }

    fn command_sandbox(&self, id: &str) -> Result<Option<String>, StoreError> {
        offload(|| SqliteStore::command_sandbox(self, id))
    }

    fn list_commands(&self, sandbox_id: &str) -> Result<Vec<Command>, StoreError> {
        offload(|| SqliteStore::list_commands(self, sandbox_id))
    }

    fn unfinished_commands(&self) -> Result<Vec<Command>, StoreError> {
        offload(|| SqliteStore::unfinished_commands(self))
    }

    fn count_unfinished_commands(
        &self,
        tenant: &str,
        sandbox_id: &str,
    ) -> Result<(u64, u64), StoreError> {
        offload(|| SqliteStore::count_unfinished_commands(self, tenant, sandbox_id))
    }

    fn insert_api_key(&self, key: &ApiKey, hash: &str) -> Result<(), StoreError> {
        offload(|| SqliteStore::insert_api_key(self, key, hash))
    }

    fn tenant_for_key_hash(&self, hash: &str) -> Result<Option<String>, StoreError> {
        offload(|| SqliteStore::tenant_for_key_hash(self, hash))
    }

    fn insert_access_token(
        &self,
        hash: &str,
        sandbox_id: &str,
        tenant: &str,
        keep: usize,
    ) -> Result<(), StoreError> {
        offload(|| SqliteStore::insert_access_token(self, hash, sandbox_id, tenant, keep))
    }

    fn access_token(&self, hash: &str) -> Result<Option<(String, String)>, StoreError> {
        offload(|| SqliteStore::access_token(self, hash))
    }

    fn key_for_hash(&self, hash: &str) -> Result<Option<(String, String)>, StoreError> {
        offload(|| SqliteStore::key_for_hash(self, hash))
    }

    fn revoked_key_ids(&self) -> Result<Vec<String>, StoreError> {
        offload(|| SqliteStore::revoked_key_ids(self))
    }

    fn list_api_keys(&self, tenant: Option<&str>) -> Result<Vec<ApiKey>, StoreError> {
        offload(|| SqliteStore::list_api_keys(self, tenant))
    }

    fn revoke_api_key(&self, id: &str, now: &str) -> Result<bool, StoreError> {
        offload(|| SqliteStore::revoke_api_key(self, id, now))
    }

    fn tenant_limits(&self, tenant: &str) -> Result<TenantLimits, StoreError> {
        offload(|| SqliteStore::tenant_limits(self, tenant))
    }

    fn set_tenant_limits(&self, tenant: &str, l: &TenantLimits) -> Result<(), StoreError> {
        offload(|| SqliteStore::set_tenant_limits(self, tenant, l))
    }

    fn template_owner(&self, name: &str) -> Result<Option<String>, StoreError> {
        offload(|| SqliteStore::template_owner(self, name))
    }

    fn claim_template(&self, name: &str, tenant: &str) -> Result<bool, StoreError> {
        offload(|| SqliteStore::claim_template(self, name, tenant))
    }

    fn release_template(&self, name: &str) -> Result<(), StoreError> {
        offload(|| SqliteStore::release_template(self, name))
    }

    fn list_pools(&self) -> Result<Vec<Pool>, StoreError> {
        offload(|| SqliteStore::list_pools(self))
    }

    fn put_pool(&self, pool: &Pool) -> Result<(), StoreError> {
        offload(|| SqliteStore::put_pool(self, pool))
    }

    fn delete_pool(&self, id: &str) -> Result<bool, StoreError> {
        offload(|| SqliteStore::delete_pool(self, id))
    }

    fn claim_sandbox(
        &self,
        rec: &mut SandboxRecord,
        from: &str,
        op: &Operation,
    ) -> Result<(), StoreError> {
        offload(|| SqliteStore::claim_sandbox(self, rec, from, op))
    }
}

/// Runs blocking database work off the async worker threads: on a multi-threaded tokio
/// runtime, through `block_in_place` (the worker hands its other tasks to another thread
/// first); elsewhere (a blocking thread, a plain thread, a current-thread runtime) as is.
pub fn offload<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

/// The database holds key hashes, tenants' secrets and agent tokens: only its owner may
/// read it. The file is created (or fixed) as 0600 before SQLite opens it, whatever the
/// umask, and SQLite gives its `-wal` and `-shm` files the database file's mode; existing
/// ones are fixed too.
fn make_private(path: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let private = std::fs::Permissions::from_mode(0o600);
    let err = |path: &Path| {
        let path = path.to_owned();
        move |source| StoreError::Permissions { path, source }
    };
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(err(path))?;
    f.set_permissions(private.clone()).map_err(err(path))?;
    for suffix in ["-wal", "-shm", "-journal"] {
        let mut p = path.as_os_str().to_owned();
        p.push(suffix);
        let p = std::path::PathBuf::from(p);
        match std::fs::set_permissions(&p, private.clone()) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(err(&p)(e)),
            _ => {}
        }
    }
    Ok(())
}

impl SqliteStore {
    /// Opens (creating if needed) the database at `path` and runs migrations.
    pub fn open(path: &Path) -> Result<SqliteStore, StoreError> {
        make_private(path)?;
        let conn = Connection::open(path)?;
        Self::init(conn)
    }

    /// An in-memory store, for unit tests.
    pub fn open_in_memory() -> Result<SqliteStore, StoreError> {
        Self::init(Connection::open_in_memory()?)
    }

    fn init(mut conn: Connection) -> Result<SqliteStore, StoreError> {
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        // WAL + NORMAL: a committed transaction survives a killed process;
        // only a power loss can take the last few.
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        let known = MIGRATIONS.len() as i64;
        if version > known {
            return Err(StoreError::TooNew(version));
        }
        for (i, sql) in MIGRATIONS.iter().enumerate().skip(version as usize) {
            let tx = conn.transaction()?;
            tx.execute_batch(sql)?;
            tx.pragma_update(None, "user_version", (i + 1) as i64)?;
            tx.commit()?;
        }
        let latest: i64 =
            conn.query_row("SELECT COALESCE(MAX(id), 0) FROM events", [], |r| r.get(0))?;
        Ok(SqliteStore {
            conn: Mutex::new(conn),
            latest_event: tokio::sync::watch::channel(latest).0,
        })
    }

    /// Watches the id of the newest event.
    pub fn subscribe_events(&self) -> tokio::sync::watch::Receiver<i64> {
        self.latest_event.subscribe()
    }

    fn published(&self, id: Option<i64>) {
        if let Some(id) = id {
            self.latest_event.send_modify(|v| *v = (*v).max(id));
        }
    }

    /// Events of `tenant` with an id above `after`, oldest first, at most `limit`.
    pub fn events_after(
        &self,
        tenant: &str,
        after: i64,
        limit: usize,
    ) -> Result<Vec<Event>, StoreError> {
        let conn = self.conn();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows: Vec<(i64, String, String, String)> = conn
            .prepare_cached(
                "SELECT id, kind, created_at, doc FROM events
                 WHERE tenant = ?1 AND id > ?2 ORDER BY id LIMIT ?3",
            )?
            .query_map(params![tenant, after, limit], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
            })?
            .collect::<Result<_, _>>()?;
        rows.into_iter()
            .map(|(id, kind, created_at, doc)| {
                Ok(Event {
                    id,
                    kind,
                    created_at,
                    object: serde_json::from_str(&doc)?,
                })
            })
            .collect()
    }

    /// Deletes a destroyed sandbox's records: its operations, commands and the sandbox row.
    pub fn purge_sandbox(&self, id: &str) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        tx.execute("DELETE FROM commands WHERE sandbox_id = ?1", [id])?;
        tx.execute("DELETE FROM access_tokens WHERE sandbox_id = ?1", [id])?;
        tx.execute("DELETE FROM operations WHERE sandbox_id = ?1", [id])?;
        tx.execute("DELETE FROM sandboxes WHERE id = ?1", [id])?;
        tx.commit()?;
        Ok(())
    }

    /// Deletes events older than `before` (RFC 3339).
    pub fn purge_events_before(&self, before: &str) -> Result<usize, StoreError> {
        Ok(self
            .conn()
            .execute("DELETE FROM events WHERE created_at < ?1", [before])?)
    }

    fn conn(&self) -> MutexGuard<'_, Connection> {
        // A panic while holding the lock cannot leave SQLite inconsistent
        // (transactions roll back), so a poisoned lock is still usable.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    // ---- sandboxes ----

    /// Inserts a new sandbox and the operation creating it, atomically.
    pub fn insert_sandbox(&self, rec: &SandboxRecord, op: &Operation) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        tx.execute(
            "INSERT INTO sandboxes (id, tenant, state, created_at, doc)
             VALUES (?1, ?2, ?3, ?4, ?5)",
            params![
                rec.sandbox.id,
                rec.sandbox.tenant,
                rec.sandbox.state.as_str(),
                rec.sandbox.created_at,
                serde_json::to_string(rec)?
            ],
        )?;
        insert_op(&tx, op)?;
        sandbox_event(&tx, rec)?;
        let id = op_event(&tx, op)?;
        tx.commit()?;
        self.published(Some(id));
        Ok(())
    }

    /// Writes `rec` if the stored sandbox is still at `rec.sandbox.version` (else
    /// [`StoreError::Conflict`], nothing written); on success `rec` has the new version.
    pub fn update_sandbox(&self, rec: &mut SandboxRecord) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        cas_sandbox(&tx, rec)?;
        let id = sandbox_event(&tx, rec)?;
        tx.commit()?;
        self.published(Some(id));
        Ok(())
    }

    /// Sets a sandbox's activity time (and, for a keepalive, its expiry and TTL) in place,
    /// without reading and writing back the whole document, so it can never undo a state
    /// change made meanwhile. Nothing is set on a sandbox that is being destroyed, is
    /// destroyed or failed; `false` then. With `event`, the sandbox as it now is becomes
    /// an event.
    pub fn set_sandbox_times(
        &self,
        id: &str,
        last_active_at: &str,
        expiry: Option<(&str, u64)>,
        event: bool,
    ) -> Result<bool, StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let live = "state NOT IN ('destroying', 'destroyed', 'failed')";
        let n = match expiry {
            None => tx.execute(
                &format!(
                    "UPDATE sandboxes SET version = version + 1,
                         doc = json_set(doc, '$.sandbox.last_active_at', ?2)
                     WHERE id = ?1 AND {live}"
                ),
                params![id, last_active_at],
            )?,
            Some((expires_at, ttl)) => tx.execute(
                &format!(
                    "UPDATE sandboxes SET version = version + 1, doc = json_set(doc,
                         '$.sandbox.last_active_at', ?2,
                         '$.sandbox.expires_at', ?3,
                         '$.sandbox.ttl_seconds', ?4,
                         '$.sandbox.updated_at', ?2)
                     WHERE id = ?1 AND {live}"
                ),
                params![
                    id,
                    last_active_at,
                    expires_at,
                    i64::try_from(ttl).unwrap_or(i64::MAX)
                ],
            )?,
        };
        let mut published = None;
        if n == 1 && event {
            let row: (i64, String) = tx.query_row(
                "SELECT version, doc FROM sandboxes WHERE id = ?1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )?;
            let rec = sandbox_from_row(row)?;
            published = Some(sandbox_event(&tx, &rec)?);
        }
        tx.commit()?;
        self.published(published);
        Ok(n == 1)
    }

    /// Updates a sandbox and an operation in one transaction, each compare-and-swap on
    /// the version it carries: both are written, or neither.
    pub fn update_sandbox_and_op(
        &self,
        rec: &mut SandboxRecord,
        op: &mut Operation,
    ) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        cas_sandbox(&tx, rec)?;
        cas_op(&tx, op)?;
        sandbox_event(&tx, rec)?;
        let id = op_event(&tx, op)?;
        tx.commit()?;
        self.published(Some(id));
        Ok(())
    }

    pub fn get_sandbox(&self, id: &str) -> Result<Option<SandboxRecord>, StoreError> {
        let row: Option<(i64, String)> = self
            .conn()
            .prepare_cached("SELECT version, doc FROM sandboxes WHERE id = ?1")?
            .query_row([id], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?;
        row.map(sandbox_from_row).transpose()
    }

    /// Every sandbox, oldest first (server-side policies and reconcile).
    pub fn list_sandboxes(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        let conn = self.conn();
        let mut stmt =
            conn.prepare_cached("SELECT version, doc FROM sandboxes ORDER BY created_at, rowid")?;
        let rows = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<Result<Vec<(i64, String)>, _>>()?;
        rows.into_iter().map(sandbox_from_row).collect()
    }

    /// The sandboxes of one tenant, oldest first.
    pub fn list_tenant_sandboxes(&self, tenant: &str) -> Result<Vec<SandboxRecord>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(
            "SELECT version, doc FROM sandboxes WHERE tenant = ?1 ORDER BY created_at, rowid",
        )?;
        let rows = stmt
            .query_map([tenant], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<Result<Vec<(i64, String)>, _>>()?;
        rows.into_iter().map(sandbox_from_row).collect()
    }

    /// How many sandboxes of `tenant` are not destroyed (failed ones count: they hold
    /// records and output until they are destroyed or purged).
    pub fn count_tenant_sandboxes(&self, tenant: &str) -> Result<u64, StoreError> {
        let n: i64 = self.conn().query_row(
            "SELECT COUNT(*) FROM sandboxes WHERE tenant = ?1 AND state != 'destroyed'",
            [tenant],
            |r| r.get(0),
        )?;
        Ok(n as u64)
    }

    /// See [`Store::count_resident_sandboxes`].
    pub fn count_resident_sandboxes(&self) -> Result<u64, StoreError> {
        let n: i64 = self.conn().query_row(
            "SELECT COUNT(*) FROM sandboxes s
             WHERE s.state NOT IN ('suspended', 'destroyed', 'failed')
                OR (s.state = 'suspended' AND EXISTS (
                    SELECT 1 FROM operations o WHERE o.sandbox_id = s.id
                    AND o.kind = 'resume' AND o.status IN ('pending', 'running')))",
            [],
            |r| r.get(0),
        )?;
        Ok(n as u64)
    }

    // ---- operations ----

    pub fn insert_operation(&self, op: &Operation) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        insert_op(&tx, op)?;
        let id = op_event(&tx, op)?;
        tx.commit()?;
        self.published(Some(id));
        Ok(())
    }

    /// Writes `op` if the stored operation is still at `op.version` (else
    /// [`StoreError::Conflict`]); on success `op` has the new version.
    pub fn update_operation(&self, op: &mut Operation) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        cas_op(&tx, op)?;
        let id = op_event(&tx, op)?;
        tx.commit()?;
        self.published(Some(id));
        Ok(())
    }

    pub fn get_operation(&self, id: &str) -> Result<Option<Operation>, StoreError> {
        let row: Option<(String, i64, String)> = self
            .conn()
            .prepare_cached("SELECT tenant, version, doc FROM operations WHERE id = ?1")?
            .query_row([id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .optional()?;
        row.map(operation_from_row).transpose()
    }

    /// Operations of `tenant` newest first, optionally of one sandbox, at most `limit`.
    pub fn list_operations(
        &self,
        tenant: &str,
        sandbox_id: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Operation>, StoreError> {
        let conn = self.conn();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows: Vec<(String, i64, String)> = conn
            .prepare_cached(
                "SELECT tenant, version, doc FROM operations
                 WHERE tenant = ?1 AND (?2 IS NULL OR sandbox_id = ?2)
                 ORDER BY created_at DESC, rowid DESC LIMIT ?3",
            )?
            .query_map(params![tenant, sandbox_id, limit], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })?
            .collect::<Result<_, _>>()?;
        rows.into_iter().map(operation_from_row).collect()
    }

    /// Build operations of `tenant` that have not ended.
    pub fn count_unfinished_builds(&self, tenant: &str) -> Result<u64, StoreError> {
        let n: i64 = self.conn().query_row(
            "SELECT COUNT(*) FROM operations
             WHERE tenant = ?1 AND kind = 'build' AND status IN ('pending', 'running')",
            [tenant],
            |r| r.get(0),
        )?;
        Ok(n as u64)
    }

    /// Operations that have not ended, oldest first.
    pub fn unfinished_operations(&self) -> Result<Vec<Operation>, StoreError> {
        let conn = self.conn();
        let rows: Vec<(String, i64, String)> = conn
            .prepare_cached(
                "SELECT tenant, version, doc FROM operations WHERE status IN ('pending', 'running')
                 ORDER BY created_at, rowid",
            )?
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
            .collect::<Result<_, _>>()?;
        rows.into_iter().map(operation_from_row).collect()
    }

    // ---- commands ----

    /// Stores a new command of a sandbox of `tenant`.
    pub fn insert_command(&self, tenant: &str, cmd: &Command) -> Result<(), StoreError> {
        self.conn().execute(
            "INSERT INTO commands (id, tenant, sandbox_id, state, created_at, doc)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![
                cmd.id,
                tenant,
                cmd.sandbox_id,
                cmd.state.as_str(),
                cmd.created_at,
                serde_json::to_string(&stored_command(cmd))?
            ],
        )?;
        Ok(())
    }

    /// Writes `cmd` if the stored command is still at `cmd.version` (else
    /// [`StoreError::Conflict`]); on success `cmd` has the new version.
    pub fn update_command(&self, cmd: &mut Command) -> Result<(), StoreError> {
        let read = cmd.version;
        cmd.version = read + 1;
        let n = self
            .conn()
            .prepare_cached(
                "UPDATE commands SET state = ?2, doc = ?3, version = version + 1
                 WHERE id = ?1 AND version = ?4",
            )?
            .execute(params![
                cmd.id,
                cmd.state.as_str(),
                serde_json::to_string(&stored_command(cmd))?,
                read as i64
            ])?;
        if n != 1 {
            cmd.version = read;
            return Err(StoreError::Conflict {
                what: "command",
                id: cmd.id.clone(),
                version: read,
            });
        }
        Ok(())
    }

    pub fn command_sandbox(&self, id: &str) -> Result<Option<String>, StoreError> {
        Ok(self
            .conn()
            .prepare_cached("SELECT sandbox_id FROM commands WHERE id = ?1")?
            .query_row([id], |r| r.get(0))
            .optional()?)
    }

    pub fn get_command(&self, sandbox_id: &str, id: &str) -> Result<Option<Command>, StoreError> {
        let row: Option<(i64, String)> = self
            .conn()
            .prepare_cached("SELECT version, doc FROM commands WHERE id = ?1 AND sandbox_id = ?2")?
            .query_row([id, sandbox_id], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?;
        row.map(command_from_row).transpose()
    }

    /// Commands of a sandbox, oldest first.
    pub fn list_commands(&self, sandbox_id: &str) -> Result<Vec<Command>, StoreError> {
        let conn = self.conn();
        let rows: Vec<(i64, String)> = conn
            .prepare_cached(
                "SELECT version, doc FROM commands WHERE sandbox_id = ?1 ORDER BY created_at, rowid",
            )?
            .query_map([sandbox_id], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<Result<_, _>>()?;
        rows.into_iter().map(command_from_row).collect()
    }

    /// Commands that have not ended, in any sandbox.
    pub fn unfinished_commands(&self) -> Result<Vec<Command>, StoreError> {
        let conn = self.conn();
        let rows: Vec<(i64, String)> = conn
            .prepare_cached(
                "SELECT version, doc FROM commands WHERE state IN ('starting', 'running')
                 ORDER BY created_at, rowid",
            )?
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<Result<_, _>>()?;
        rows.into_iter().map(command_from_row).collect()
    }

    /// How many commands have not ended: of `tenant`, and of the sandbox `sandbox_id`.
    pub fn count_unfinished_commands(
        &self,
        tenant: &str,
        sandbox_id: &str,
    ) -> Result<(u64, u64), StoreError> {
        let conn = self.conn();
        let of_tenant: i64 = conn.query_row(
            "SELECT COUNT(*) FROM commands WHERE tenant = ?1 AND state IN ('starting', 'running')",
            [tenant],
            |r| r.get(0),
        )?;
        let of_sandbox: i64 = conn.query_row(
            "SELECT COUNT(*) FROM commands
             WHERE sandbox_id = ?1 AND state IN ('starting', 'running')",
            [sandbox_id],
            |r| r.get(0),
        )?;
        Ok((of_tenant as u64, of_sandbox as u64))
    }
}

/// An operation row: the tenant column is the truth (documents written before
/// operations had a tenant field say `default`).
fn operation_from_row(
    (tenant, version, doc): (String, i64, String),
) -> Result<Operation, StoreError> {
    let mut op: Operation = serde_json::from_str(&doc)?;
    op.tenant = tenant;
    op.version = version as u64;
    Ok(op)
}

/// A sandbox row: the version column is the truth.
fn sandbox_from_row((version, doc): (i64, String)) -> Result<SandboxRecord, StoreError> {
    let mut rec: SandboxRecord = serde_json::from_str(&doc)?;
    rec.sandbox.version = version as u64;
    Ok(rec)
}

/// A command row: the version column is the truth.
fn command_from_row((version, doc): (i64, String)) -> Result<Command, StoreError> {
    let mut cmd: Command = serde_json::from_str(&doc)?;
    cmd.version = version as u64;
    Ok(cmd)
}

/// Compare-and-swap of a sandbox row; bumps `rec`'s version.
fn cas_sandbox(conn: &Connection, rec: &mut SandboxRecord) -> Result<(), StoreError> {
    let read = rec.sandbox.version;
    rec.sandbox.version = read + 1;
    let n = conn
        .prepare_cached(
            "UPDATE sandboxes SET state = ?2, doc = ?3, version = version + 1
             WHERE id = ?1 AND version = ?4",
        )?
        .execute(params![
            rec.sandbox.id,
            rec.sandbox.state.as_str(),
            serde_json::to_string(rec)?,
            read as i64
        ])?;
    if n != 1 {
        rec.sandbox.version = read;
        return Err(StoreError::Conflict {
            what: "sandbox",
            id: rec.sandbox.id.clone(),
            version: read,
        });
    }
    Ok(())
}

/// Compare-and-swap of an operation row; bumps `op`'s version.
fn cas_op(conn: &Connection, op: &mut Operation) -> Result<(), StoreError> {
    let read = op.version;
    op.version = read + 1;
    let n = conn
        .prepare_cached(
            "UPDATE operations SET status = ?2, doc = ?3, version = version + 1
             WHERE id = ?1 AND version = ?4",
        )?
        .execute(params![
            op.id,
            op.status.as_str(),
            serde_json::to_string(op)?,
            read as i64
        ])?;
    if n != 1 {
        op.version = read;
        return Err(StoreError::Conflict {
            what: "operation",
            id: op.id.clone(),
            version: read,
        });
    }
    Ok(())
}

/// Inline output is a view of the output files, never stored.
fn stored_command(cmd: &Command) -> Command {
    Command {
        stdout: None,
        stderr: None,
        inline_truncated: None,
        ..cmd.clone()
    }
}

/// Appends an event of `tenant`; returns its id.
fn event(
    conn: &Connection,
    tenant: &str,
    kind: &str,
    object_id: &str,
    object: &impl Serialize,
) -> Result<i64, StoreError> {
    conn.prepare_cached(
        "INSERT INTO events (tenant, kind, object_id, created_at, doc) VALUES (?1, ?2, ?3, ?4, ?5)",
    )?
    .execute(params![
        tenant,
        kind,
        object_id,
        space_core::now_rfc3339(),
        serde_json::to_string(object)?
    ])?;
    Ok(conn.last_insert_rowid())
}

fn sandbox_event(conn: &Connection, rec: &SandboxRecord) -> Result<i64, StoreError> {
    event(
        conn,
        &rec.sandbox.tenant,
        "sandbox",
        &rec.sandbox.id,
        &rec.sandbox,
    )
}

fn op_event(conn: &Connection, op: &Operation) -> Result<i64, StoreError> {
    event(conn, &op.tenant, "operation", &op.id, op)
}

fn insert_op(conn: &Connection, op: &Operation) -> Result<(), StoreError> {
    conn.execute(
        "INSERT INTO operations (id, tenant, sandbox_id, kind, status, created_at, doc)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        params![
            op.id,
            op.tenant,
            op.sandbox_id,
            op.kind.as_str(),
            op.status.as_str(),
            op.created_at,
            serde_json::to_string(op)?
        ],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use space_api::*;

    fn sandbox(id: &str) -> SandboxRecord {
        SandboxRecord {
            sandbox: Sandbox {
                id: id.into(),
                version: 0,
                tenant: "default".into(),
                state: SandboxState::Creating,
                template: "busybox".into(),
                template_version: "1".into(),
                runtime: "gvisor".into(),
                accelerator: None,
                labels: Default::default(),
                resources: Resources::default(),
                env: Default::default(),
                secret_names: vec![],
                network: NetworkSpec {
                    mode: "none".into(),
                    ..Default::default()
                },
                created_at: space_core::now_rfc3339(),
                updated_at: space_core::now_rfc3339(),
                expires_at: None,
                failure_reason: None,
                last_active_at: None,
                ttl_seconds: None,
                idle_timeout_seconds: None,
                on_idle: None,
                idle_expires_at: None,
                cost: Default::default(),
                destroyed_at: None,
            },
            agent_token: "t".into(),
            rootfs: "/x".into(),
            template_env: vec![],
            template_user: None,
            template_workdir: None,
            snapshot_dir: None,
            secrets: Default::default(),
        }
    }

    fn op(id: &str, sb: &str) -> Operation {
        Operation {
            id: id.into(),
            version: 0,
            kind: OperationKind::Create,
            status: OperationStatus::Pending,
            sandbox_id: Some(sb.into()),
            tenant: "default".into(),
            template: None,
            error: None,
            progress: None,
            created_at: space_core::now_rfc3339(),
            updated_at: space_core::now_rfc3339(),
        }
    }

    #[test]
    fn sandbox_and_operation_roundtrip() {
        let s = SqliteStore::open_in_memory().unwrap();
        let mut rec = sandbox("sb_1");
        let mut o = op("op_1", "sb_1");
        s.insert_sandbox(&rec, &o).unwrap();
        assert_eq!(s.get_sandbox("sb_1").unwrap(), Some(rec.clone()));
        assert_eq!(s.unfinished_operations().unwrap(), vec![o.clone()]);
        rec.sandbox.state = SandboxState::Running;
        o.status = OperationStatus::Succeeded;
        s.update_sandbox_and_op(&mut rec, &mut o).unwrap();
        assert_eq!((rec.sandbox.version, o.version), (1, 1));
        assert_eq!(
            s.get_sandbox("sb_1").unwrap().unwrap().sandbox.state,
            SandboxState::Running
        );
        assert!(s.unfinished_operations().unwrap().is_empty());
        assert_eq!(
            s.list_operations("default", Some("sb_1"), 10).unwrap(),
            vec![o]
        );
        assert!(s.get_sandbox("sb_2").unwrap().is_none());
    }

    /// Records made in the same millisecond list in the order they were made, whatever
    /// their (random) ids: a sandbox's destroy never lists before its create.
    #[test]
    fn ties_in_time_list_in_the_order_they_were_made() {
        let s = SqliteStore::open_in_memory().unwrap();
        let at = "2026-01-01T00:00:00.000Z";
        // Ids that sort the other way round from the order they are made in.
        let ids = ["z", "m", "a"];
        for id in ids {
            let mut rec = sandbox(&format!("sb_{id}"));
            rec.sandbox.created_at = at.into();
            let mut o = op(&format!("op_{id}"), "sb_z");
            o.created_at = at.into();
            if id == "z" {
                s.insert_sandbox(&rec, &o).unwrap();
            } else {
                s.insert_sandbox(&rec, &op(&format!("op_sb_{id}"), &rec.sandbox.id))
                    .unwrap();
                s.insert_operation(&o).unwrap();
            }
            let c: Command = serde_json::from_value(serde_json::json!({
                "id": format!("cmd_{id}"), "sandbox_id": "sb_z", "state": "running",
                "argv": ["true"], "cwd": null, "user": null, "created_at": at,
                "ended_at": null, "result": null, "lost_reason": null, "output_url": "",
            }))
            .unwrap();
            s.insert_command("default", &c).unwrap();
        }
        let sandboxes: Vec<String> = s
            .list_sandboxes()
            .unwrap()
            .into_iter()
            .map(|r| r.sandbox.id)
            .collect();
        assert_eq!(sandboxes, ["sb_z", "sb_m", "sb_a"]);
        let ops: Vec<String> = s
            .list_operations("default", Some("sb_z"), 10)
            .unwrap()
            .into_iter()
            .map(|o| o.id)
            .collect();
        assert_eq!(ops, ["op_a", "op_m", "op_z"], "newest first");
        let commands: Vec<String> = s
            .list_commands("sb_z")
            .unwrap()
            .into_iter()
            .map(|c| c.id)
            .collect();
        assert_eq!(commands, ["cmd_z", "cmd_m", "cmd_a"]);
    }

    #[test]
    fn a_write_from_a_stale_read_is_refused_and_changes_nothing() {
        let s = SqliteStore::open_in_memory().unwrap();
        let (rec, o) = (sandbox("sb_1"), op("op_1", "sb_1"));
        s.insert_sandbox(&rec, &o).unwrap();
        let mut first = s.get_sandbox("sb_1").unwrap().unwrap();
        let mut second = first.clone();
        first.sandbox.state = SandboxState::Running;
        s.update_sandbox(&mut first).unwrap();
        assert_eq!(first.sandbox.version, 1);
        // The second writer read version 0: it loses, and the first's change stays.
        second.sandbox.state = SandboxState::Failed;
        let err = s.update_sandbox(&mut second).unwrap_err();
        assert!(
            matches!(err, StoreError::Conflict { version: 0, .. }),
            "{err:?}"
        );
        assert_eq!(second.sandbox.version, 0);
        let now = s.get_sandbox("sb_1").unwrap().unwrap();
        assert_eq!(
            (now.sandbox.state, now.sandbox.version),
            (SandboxState::Running, 1)
        );
        // A write of a sandbox and an operation is all or nothing.
        let mut stale_op = s.get_operation("op_1").unwrap().unwrap();
        let mut fresh = now.clone();
        let mut op_now = stale_op.clone();
        op_now.status = OperationStatus::Running;
        s.update_operation(&mut op_now).unwrap();
        stale_op.status = OperationStatus::Failed;
        fresh.sandbox.state = SandboxState::Failed;
        assert!(s.update_sandbox_and_op(&mut fresh, &mut stale_op).is_err());
        assert_eq!(
            s.get_sandbox("sb_1").unwrap().unwrap().sandbox.state,
            SandboxState::Running
        );
        // Bookkeeping writes in place count as changes too.
        assert!(s
            .set_sandbox_times("sb_1", "2026-01-01T00:00:00Z", None, false)
            .unwrap());
        assert_eq!(s.get_sandbox("sb_1").unwrap().unwrap().sandbox.version, 2);
        let mut stale = now;
        assert!(s.update_sandbox(&mut stale).is_err());
    }

    #[test]
    fn duplicate_sandbox_is_rejected_atomically() {
        let s = SqliteStore::open_in_memory().unwrap();
        s.insert_sandbox(&sandbox("sb_1"), &op("op_1", "sb_1"))
            .unwrap();
        assert!(s
            .insert_sandbox(&sandbox("sb_1"), &op("op_2", "sb_1"))
            .is_err());
        // The operation of the failed insert was rolled back with it.
        assert!(s.get_operation("op_2").unwrap().is_none());
    }

    #[test]
    fn every_change_is_an_event_in_order() {
        let s = SqliteStore::open_in_memory().unwrap();
        let mut rx = s.subscribe_events();
        let mut rec = sandbox("sb_1");
        s.insert_sandbox(&rec, &op("op_1", "sb_1")).unwrap();
        rec.sandbox.state = SandboxState::Running;
        s.update_sandbox(&mut rec).unwrap();
        assert!(rx.has_changed().unwrap());
        let events = s.events_after("default", 0, 10).unwrap();
        let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
        assert_eq!(kinds, ["sandbox", "operation", "sandbox"]);
        assert_eq!(events[2].object["state"], "running");
        // The agent token never reaches an event.
        assert!(events[0].object.get("agent_token").is_none());
        assert_eq!(*rx.borrow_and_update(), events[2].id);
        assert_eq!(
            s.events_after("default", events[1].id, 10).unwrap().len(),
            1
        );
        s.purge_sandbox("sb_1").unwrap();
        assert!(s.get_sandbox("sb_1").unwrap().is_none());
        assert!(s.get_operation("op_1").unwrap().is_none());
    }

    #[test]
    fn reopen_keeps_data_and_schema() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("space.db");
        {
            let s = SqliteStore::open(&path).unwrap();
            s.insert_sandbox(&sandbox("sb_1"), &op("op_1", "sb_1"))
                .unwrap();
        }
        let s = SqliteStore::open(&path).unwrap();
        assert_eq!(s.list_sandboxes().unwrap().len(), 1);
    }
}
