//! Warm pools: ready sandboxes that a matching create claims instead of booting one.
//!
//! An operator keeps `size` sandboxes of a template, runtime, set of resources and
//! network mode running (`PUT /v1/pools`, `space pool set`). They are ordinary
//! sandboxes of the reserved tenant [`POOL_TENANT`], which no key can name, so they
//! count against no tenant and show in no tenant's lists, and a restarted server
//! re-adopts them like any other (reconcile).
//!
//! A create whose template, runtime, resolved resources and network mode match a pool
//! (and whose template is still at the version the pooled sandbox booted) claims the
//! oldest ready one: the create's env, labels, secrets, TTL, idle timeout and egress
//! allowlist are applied, and the operations, commands and access tokens of its time in
//! the pool are deleted, all in one store transaction ([`Store::claim_sandbox`]). The
//! answer is an operation that has already succeeded. Claims, and the filler's
//! decisions to destroy, are serialised by one lock and re-checked by the store's
//! compare-and-swap, so a sandbox is never handed out twice, nor destroyed once handed out.
//!
//! The filler refills every pool in the background: at most `pool_fills` sandboxes
//! boot at once server-wide (through the same create slots as tenants' creates), pools
//! hold at most `pool_max_sandboxes` together, and a pool whose fills fail waits
//! [`FAIL_BACKOFF`] before it tries again (its `last_error` says why). Pooled sandboxes
//! of a pool that is gone or resized down, of a template rebuilt since, or that failed,
//! are destroyed.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use space_api::{
    CreateCommandRequest, CreateSandboxRequest, NetworkSpec, Operation, OperationKind,
    OperationStatus, Pool, PoolSpec, SandboxState,
};
use space_core::now_rfc3339;
use space_store::{SandboxRecord, StoreError};

use super::{lock, network, new_operation, Principal, Result, Service, ServiceError};

/// The tenant pooled sandboxes belong to until claimed. Tenant names start with a
/// letter or digit, so no key or token can stand for it.
pub const POOL_TENANT: &str = "_pool";
/// How often the filler looks at the pools when nothing wakes it.
const FILL_TICK: Duration = Duration::from_secs(1);
/// How long a pool whose fill failed waits before it boots again.
const FAIL_BACKOFF: Duration = Duration::from_secs(30);
/// How long after a claim a pool that still has a ready sandbox waits before it boots the
/// replacement: a boot takes both cores of a small host for a moment, and the claimed
/// sandbox's first commands, which its tenant is waiting for, come in that moment. A pool
/// left with nothing ready boots at once.
const REFILL_DELAY: Duration = Duration::from_millis(300);

/// What the pools know beyond the store.
#[derive(Default)]
pub(crate) struct Pools {
    /// Held by a claim and by the filler while it decides what to destroy.
    claim: tokio::sync::Mutex<()>,
    /// Wakes the filler at once (a claim, a changed pool).
    wake: tokio::sync::Notify,
    stats: std::sync::Mutex<HashMap<String, PoolStats>>,
    /// Pooled sandboxes whose warm-up command has run: only these are handed out.
    warmed: std::sync::Mutex<HashSet<String>>,
    /// Pooled sandboxes whose warm-up runs now.
    warming: std::sync::Mutex<HashSet<String>>,
}

#[derive(Default)]
struct PoolStats {
    claims: u64,
    claimed_at: Option<Instant>,
    last_error: Option<String>,
    failed_at: Option<Instant>,
}

/// The identity of a pool: what a create must resolve to, to claim from it.
fn pool_id(
    template: &str,
    runtime: &str,
    resources: &space_api::Resources,
    network: &str,
) -> String {
    let key = serde_json::json!([template, runtime, resources, network]).to_string();
    let digest = Sha256::digest(key.as_bytes());
    let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("pool_{hex}")
}

/// Whether the sandbox `rec` is (or would be) one of `pool`'s.
fn matches(pool: &Pool, rec: &SandboxRecord) -> bool {
    let sb = &rec.sandbox;
    sb.template == pool.template
        && sb.runtime == pool.runtime
        && sb.resources == pool.resources
        && sb.network.mode == pool.network
}

fn live(state: SandboxState) -> bool {
    matches!(state, SandboxState::Creating | SandboxState::Running)
}

impl Service {
    /// Pools are the operator's: only the server's own token may see or change them.
    fn operator(who: &Principal) -> Result<()> {
        if who.is_server() {
            Ok(())
        } else {
            Err(ServiceError::Forbidden(
                "warm pools are the operator's: only the server's token (SPACE_API_TOKEN, or \
                 the dev token) may see or change them"
                    .into(),
            ))
        }
    }

    /// `PUT /v1/pools` for `who` (the operator only).
    pub fn set_pool_as(&self, who: &Principal, spec: PoolSpec) -> Result<Pool> {
        Self::operator(who)?;
        self.put_pool(spec)
    }

    /// `GET /v1/pools` for `who` (the operator only).
    pub fn pools_as(&self, who: &Principal) -> Result<Vec<Pool>> {
        Self::operator(who)?;
        self.list_pools()
    }

    /// `DELETE /v1/pools/{id}` for `who` (the operator only).
    pub fn remove_pool_as(&self, who: &Principal, id: &str) -> Result<()> {
        Self::operator(who)?;
        self.delete_pool(id)
    }

    /// `PUT /v1/pools`: creates the pool of `spec`'s template, runtime, resources and
    /// network, or sets its size.
    pub(crate) fn put_pool(&self, spec: PoolSpec) -> Result<Pool> {
        let template = spec.template.trim().to_string();
        let tpl = self.find_template(&template)?;
        let runtime = self.resolve_runtime(spec.runtime.as_deref())?;
        let network = spec.network.clone().unwrap_or_else(|| "none".into());
        if network != "none" && network != "egress" {
            return Err(ServiceError::BadRequest(format!(
                "network {:?} is not a pool's network: \"none\" or \"egress\" (a create's \
                 allowlist is applied when it claims)",
                super::truncate(&network, 32)
            )));
        }
        let resources = self.resolve_resources(
            spec.resources.as_ref(),
            tpl.as_ref().and_then(|t| t.resources.as_ref()),
        )?;
        let id = pool_id(&template, &runtime, &resources, &network);
        let pools = self.0.store.list_pools()?;
        let others: u64 = pools
            .iter()
            .filter(|p| p.id != id)
            .map(|p| u64::from(p.size))
            .sum();
        let cap = self.0.cfg.pool_max_sandboxes;
        if others + u64::from(spec.size) > cap {
            return Err(ServiceError::BadRequest(format!(
                "pools may hold {cap} sandboxes together (--pool-max-sandboxes); the other \
                 pools hold {others}, so this one may have at most {}",
                cap.saturating_sub(others)
            )));
        }
        let now = now_rfc3339();
        let pool = match pools.into_iter().find(|p| p.id == id) {
            Some(mut p) => {
                p.size = spec.size;
                p.updated_at = now;
                p
            }
            None => Pool {
                id,
                template,
                runtime,
                resources,
                network,
                size: spec.size,
                ready: 0,
                starting: 0,
                claims: 0,
                last_error: None,
                created_at: now.clone(),
                updated_at: now,
            },
        };
        self.0.store.put_pool(&pool)?;
        // A new size is a new start: no backoff from an earlier failure.
        if let Some(s) = lock(&self.0.pools.stats).get_mut(&pool.id) {
            s.failed_at = None;
        }
        self.0.pools.wake.notify_one();
        tracing::info!(pool = %pool.id, template = %pool.template, size = pool.size, "pool set");
        Ok(self.pool_view(pool))
    }

    /// `GET /v1/pools`.
    pub(crate) fn list_pools(&self) -> Result<Vec<Pool>> {
        let pools = self.0.store.list_pools()?;
        let members = self.0.store.list_tenant_sandboxes(POOL_TENANT)?;
        Ok(pools
            .into_iter()
            .map(|p| self.pool_view_with(p, &members))
            .collect())
    }

    /// `DELETE /v1/pools/{id}`: the pool goes; its sandboxes are destroyed.
    pub(crate) fn delete_pool(&self, id: &str) -> Result<()> {
        if !self.0.store.delete_pool(id)? {
            return Err(ServiceError::NotFound(format!(
                "no pool {:?}",
                super::truncate(id, 64)
            )));
        }
        lock(&self.0.pools.stats).remove(id);
        self.0.pools.wake.notify_one();
        tracing::info!(pool = %id, "pool removed");
        Ok(())
    }

    fn pool_view(&self, pool: Pool) -> Pool {
        let members = self
            .0
            .store
            .list_tenant_sandboxes(POOL_TENANT)
            .unwrap_or_default();
        self.pool_view_with(pool, &members)
    }

    /// `pool` with its counts as they are now.
    fn pool_view_with(&self, mut pool: Pool, members: &[SandboxRecord]) -> Pool {
        let mine = members.iter().filter(|r| matches(&pool, r));
        let (mut ready, mut starting) = (0, 0);
        for r in mine {
            match r.sandbox.state {
                SandboxState::Running if self.claimable(r) => ready += 1,
                // Booting, or warming up.
                SandboxState::Creating => starting += 1,
                SandboxState::Running if !lock(&self.0.pools.warmed).contains(&r.sandbox.id) => {
                    starting += 1
                }
                _ => {}
            }
        }
        pool.ready = ready;
        pool.starting = starting;
        if let Some(s) = lock(&self.0.pools.stats).get(&pool.id) {
            pool.claims = s.claims;
            pool.last_error = s.last_error.clone();
        }
        pool
    }

    /// Whether the pooled sandbox `rec` could be handed out now: running, warmed up, its
    /// agent connected, no lifecycle operation on it.
    fn claimable(&self, rec: &SandboxRecord) -> bool {
        rec.sandbox.state == SandboxState::Running
            && lock(&self.0.pools.warmed).contains(&rec.sandbox.id)
            && self
                .live_handle(&rec.sandbox.id)
                .is_some_and(|h| h.agent.borrow().is_some() && lock(&h.ops).is_empty())
    }

    /// Hands a ready pooled sandbox matching `rec` (a create, validated and resolved) to
    /// its tenant with `rec`'s settings; `None` when no pool has one (the create then
    /// boots one).
    pub(crate) async fn claim_pooled(&self, rec: &SandboxRecord) -> Option<Operation> {
        if rec.sandbox.tenant == POOL_TENANT || rec.sandbox.template_version.is_empty() {
            return None;
        }
        let pools = self.0.store.list_pools().ok()?;
        let pool = pools.into_iter().find(|p| p.size > 0 && matches(p, rec))?;
        let _claiming = self.0.pools.claim.lock().await;
        let candidates: Vec<SandboxRecord> = self
            .0
            .store
            .list_tenant_sandboxes(POOL_TENANT)
            .ok()?
            .into_iter()
            .filter(|c| {
                matches(&pool, c)
                    && c.sandbox.template_version == rec.sandbox.template_version
                    && self.claimable(c)
            })
            .collect();
        let started = std::time::Instant::now();
        for cand in candidates {
            let id = cand.sandbox.id.clone();
            match self.claim_one(cand, rec).await {
                Ok(op) => {
                    self.0
                        .metrics
                        .operation_ended("create", "claimed", started.elapsed());
                    {
                        let mut stats = lock(&self.0.pools.stats);
                        let s = stats.entry(pool.id.clone()).or_default();
                        s.claims += 1;
                        s.claimed_at = Some(Instant::now());
                    }
                    // The filler looks again once the claim has settled (REFILL_DELAY).
                    let svc = self.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(REFILL_DELAY).await;
                        svc.0.pools.wake.notify_one();
                    });
                    tracing::info!(sandbox = %id, pool = %pool.id, tenant = %rec.sandbox.tenant, operation = %op.id, "claimed from the pool");
                    return Some(op);
                }
                Err(e) => {
                    tracing::warn!(sandbox = %id, pool = %pool.id, error = %e, "a pooled sandbox could not be claimed: destroying it");
                    let _ = self.destroy_sandbox(&id);
                }
            }
        }
        None
    }

    /// Applies `want`'s settings to the pooled sandbox `cand` and moves it to `want`'s
    /// tenant. Errors leave the sandbox the pool's (the caller destroys it).
    async fn claim_one(&self, cand: SandboxRecord, want: &SandboxRecord) -> Result<Operation> {
        let id = cand.sandbox.id.clone();
        // The egress allowlist goes on first: no moment where the tenant's sandbox
        // reaches what the pool's (drop everything) did not.
        if let Some(cfg) = network::egress_config(&want.sandbox.network) {
            let dir = self.sandbox_dir(&id);
            let sid = id.clone();
            tokio::task::spawn_blocking(move || {
                space_runtime::net::set_allowlist(&sid, &dir, &cfg)
            })
            .await
            .map_err(|e| ServiceError::Internal(e.to_string()))?
            .map_err(|e| ServiceError::Internal(format!("applying the allowlist: {e}")))?;
            let mut rx = self
                .live_handle(&id)
                .map(|h| h.agent.subscribe())
                .ok_or_else(|| ServiceError::Internal("its agent went away".into()))?;
            network::write_hosts(&mut rx, &want.sandbox.network)
                .await
                .map_err(|e| ServiceError::Internal(e.message))?;
        }
        let now = now_rfc3339();
        let mut claimed = cand;
        let (sb, w) = (&mut claimed.sandbox, &want.sandbox);
        sb.tenant = w.tenant.clone();
        sb.labels = w.labels.clone();
        sb.env = w.env.clone();
        sb.secret_names = w.secret_names.clone();
        sb.network = w.network.clone();
        sb.created_at = now.clone();
        sb.updated_at = now.clone();
        sb.last_active_at = Some(now.clone());
        sb.expires_at = w.expires_at.clone();
        sb.ttl_seconds = w.ttl_seconds;
        sb.idle_timeout_seconds = w.idle_timeout_seconds;
        sb.on_idle = w.on_idle;
        sb.idle_expires_at = None;
        sb.cost = Default::default();
        claimed.secrets = want.secrets.clone();
        let mut op = new_operation(OperationKind::Create, Some(&id), &w.tenant);
        op.status = OperationStatus::Succeeded;
        op.progress = Some("ready (from a warm pool)".into());
        self.0
            .store
            .claim_sandbox(&mut claimed, POOL_TENANT, &op)
            .map_err(|e| match e {
                StoreError::Conflict { .. } => ServiceError::Conflict(e.to_string()),
                e => e.into(),
            })?;
        // Output its time in the pool left on the host goes with its commands' records.
        let _ = std::fs::remove_dir_all(self.outputs_root().join(&id));
        lock(&self.0.pools.warmed).remove(&id);
        lock(&self.0.costs).remove(&id);
        self.touch(&id);
        Ok(op)
    }

    /// Runs one `true` in the pooled sandbox `id` (once), so that a claim's first
    /// command does not pay for the first exec of the sandbox; it is claimable after.
    /// Its command record and output go at the claim with everything else of the pool's.
    fn warm_up(&self, id: &str) {
        if lock(&self.0.pools.warmed).contains(id) || !lock(&self.0.pools.warming).insert(id.into())
        {
            return;
        }
        let (svc, id) = (self.clone(), id.to_string());
        tokio::spawn(async move {
            let req = CreateCommandRequest {
                argv: Some(vec!["true".into()]),
                wait: Some(true),
                timeout_seconds: Some(30),
                ..Default::default()
            };
            if let Err(e) = svc.create_command(&id, req).await {
                // Claimable all the same: a claim's own first command then pays for it.
                tracing::info!(sandbox = %id, error = %e, "the warm-up of a pooled sandbox failed");
            }
            lock(&svc.0.pools.warmed).insert(id.clone());
            lock(&svc.0.pools.warming).remove(&id);
            svc.0.pools.wake.notify_one();
        });
    }

    /// Starts the task that keeps every pool at its size.
    pub(crate) fn spawn_pool_filler(&self) {
        let svc = self.clone();
        tokio::spawn(async move {
            loop {
                svc.fill_pools_once().await;
                let _ = tokio::time::timeout(FILL_TICK, svc.0.pools.wake.notified()).await;
            }
        });
    }

    /// One pass of the filler: destroys what no pool should hold, boots what pools lack.
    pub(crate) async fn fill_pools_once(&self) {
        let Ok(pools) = self.0.store.list_pools() else {
            return;
        };
        let _deciding = self.0.pools.claim.lock().await;
        let Ok(members) = self.0.store.list_tenant_sandboxes(POOL_TENANT) else {
            return;
        };
        let mut keep: HashMap<&str, Vec<&SandboxRecord>> = HashMap::new();
        for rec in &members {
            let sb = &rec.sandbox;
            if matches!(sb.state, SandboxState::Destroyed | SandboxState::Destroying) {
                continue;
            }
            let pool = pools.iter().find(|p| matches(p, rec));
            let stale = pool.is_some_and(|p| {
                sb.state == SandboxState::Running
                    && self
                        .0
                        .templates
                        .get(&p.template)
                        .ok()
                        .flatten()
                        .is_some_and(|t| t.version != sb.template_version)
            });
            let why = match (pool, sb.state) {
                (None, _) => Some("its pool is gone"),
                (Some(p), SandboxState::Failed) => {
                    let reason = sb.failure_reason.clone().unwrap_or_default();
                    let mut stats = lock(&self.0.pools.stats);
                    let s = stats.entry(p.id.clone()).or_default();
                    s.last_error = Some(reason);
                    s.failed_at = Some(Instant::now());
                    Some("it failed")
                }
                _ if stale => Some("its template was rebuilt"),
                (Some(_), state) if !live(state) => Some("it is not running"),
                (Some(p), _) => {
                    keep.entry(p.id.as_str()).or_default().push(rec);
                    None
                }
            };
            if let Some(why) = why {
                tracing::info!(sandbox = %sb.id, "destroying a pooled sandbox: {why}");
                lock(&self.0.pools.warmed).remove(&sb.id);
                let _ = self.destroy_sandbox(&sb.id);
            } else if sb.state == SandboxState::Running {
                self.warm_up(&sb.id);
            }
        }
        let mut booting = members
            .iter()
            .filter(|r| r.sandbox.state == SandboxState::Creating)
            .count();
        let fills = self.0.cfg.pool_fills.max(1);
        for pool in &pools {
            let mine = keep.remove(pool.id.as_str()).unwrap_or_default();
            let have = mine.len();
            let size = pool.size as usize;
            if have > size {
                // The newest go first; the oldest are the most settled.
                for rec in mine.iter().rev().take(have - size) {
                    if rec.sandbox.state == SandboxState::Running {
                        tracing::info!(sandbox = %rec.sandbox.id, pool = %pool.id, "destroying a pooled sandbox: the pool is smaller now");
                        let _ = self.destroy_sandbox(&rec.sandbox.id);
                    }
                }
                continue;
            }
            let backing_off = lock(&self.0.pools.stats)
                .get(&pool.id)
                .and_then(|s| s.failed_at)
                .is_some_and(|t| t.elapsed() < FAIL_BACKOFF);
            if backing_off {
                continue;
            }
            let settling = lock(&self.0.pools.stats)
                .get(&pool.id)
                .and_then(|s| s.claimed_at)
                .is_some_and(|t| t.elapsed() < REFILL_DELAY);
            if settling
                && mine
                    .iter()
                    .any(|r| r.sandbox.state == SandboxState::Running)
            {
                continue;
            }
            if have == size
                && mine
                    .iter()
                    .all(|r| r.sandbox.state == SandboxState::Running)
            {
                if let Some(s) = lock(&self.0.pools.stats).get_mut(&pool.id) {
                    s.last_error = None;
                }
            }
            for _ in have..size {
                if booting >= fills {
                    break;
                }
                let started = self
                    .prepare_create(POOL_TENANT, pool_request(pool))
                    .and_then(|mut rec| {
                        // Egress sandboxes of a pool boot with an empty allowlist: they
                        // reach nothing until a claim applies the create's own.
                        if pool.network == "egress" {
                            rec.sandbox.network = NetworkSpec {
                                mode: "egress".into(),
                                allow: Some(Vec::new()),
                                resolved: Some(Vec::new()),
                            };
                        }
                        self.admit_resident(|| self.start_create(rec))
                    });
                match started {
                    Ok(op) => {
                        booting += 1;
                        tracing::info!(pool = %pool.id, operation = %op.id, "filling the pool");
                    }
                    // The server is full: the next pass tries again, no back-off.
                    Err(e @ ServiceError::TooMany { .. }) => {
                        lock(&self.0.pools.stats)
                            .entry(pool.id.clone())
                            .or_default()
                            .last_error = Some(e.to_string());
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(pool = %pool.id, error = %e, "cannot fill the pool");
                        let mut stats = lock(&self.0.pools.stats);
                        let s = stats.entry(pool.id.clone()).or_default();
                        s.last_error = Some(e.to_string());
                        s.failed_at = Some(Instant::now());
                        break;
                    }
                }
            }
        }
    }
}

/// The create that boots one of `pool`'s sandboxes.
fn pool_request(pool: &Pool) -> CreateSandboxRequest {
    CreateSandboxRequest {
        template: pool.template.clone(),
        runtime: Some(pool.runtime.clone()),
        resources: Some(pool.resources.clone()),
        ..Default::default()
    }
}
