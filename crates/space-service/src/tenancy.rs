//! Who is asking, what they may see, and how much they may ask for.
//!
//! Every front door (the v1 HTTP API today; the E2B API and MCP next) turns a
//! presented credential into a [`Principal`] with [`Service::authenticate`] and
//! then acts only through [`Service::for_tenant`] (see `scope.rs`), which
//! checks ownership on the decoded id of everything it acts on. The rules live
//! here, not in a front door.
//!
//! The server's own token (`SPACE_API_TOKEN`, or the dev token) is tenant
//! `default`; a key made by `space keys create --tenant T` is tenant `T` (the
//! store keeps its SHA-256 only). A revoked key stops working on the next
//! request, and the streams it opened end within [`REVOCATION_POLL`] (see
//! [`Service::revoked`]).
//!
//! Limits per tenant (server flags, some overridable per tenant with
//! `space tenants limits`): sandboxes that are not destroyed, running commands,
//! a create rate, open streams, template builds and large request bodies in
//! flight; over any of them the answer is 429 (with `Retry-After` for the
//! rate). Per sandbox: running commands.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use space_api::DEFAULT_TENANT;
use space_store::{ApiKey, Store};
use tokio::sync::watch;

use super::{lock, Service, ServiceError};

/// Prefix of every API key, so a leaked one is easy to recognise (and to scan for).
pub const KEY_PREFIX: &str = "spk_";
/// How often the server looks for revoked keys (`space keys revoke` writes the
/// database directly, not through the server).
pub const REVOCATION_POLL: Duration = Duration::from_secs(1);

/// A tenant name, as authenticated.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Tenant(Arc<str>);

impl Tenant {
    pub fn new(name: &str) -> Tenant {
        Tenant(name.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Who is asking: a tenant, and the key that proved it (none for the server's own token).
#[derive(Debug, Clone)]
pub struct Principal {
    pub tenant: Tenant,
    key_id: Option<Arc<str>>,
}

impl Principal {
    /// Whether this is the server's own token (the operator), not a tenant's key.
    pub fn is_server(&self) -> bool {
        self.key_id.is_none()
    }

    /// The id of the API key (`None` for the server's own token).
    pub fn key_id(&self) -> Option<&str> {
        self.key_id.as_deref()
    }

    /// What the caller may know about itself (`GET /v1/whoami`).
    pub fn whoami(&self) -> space_api::Whoami {
        space_api::Whoami {
            tenant: self.tenant.as_str().to_string(),
            key_id: self.key_id().map(str::to_string),
            operator: self.is_server(),
        }
    }

    /// The server's own token.
    pub fn server() -> Principal {
        Principal {
            tenant: Tenant::new(DEFAULT_TENANT),
            key_id: None,
        }
    }
}

/// Server-wide defaults of the per-tenant and per-sandbox limits.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Sandboxes of one tenant that are not destroyed (failed ones count).
    pub max_sandboxes: u64,
    /// Commands of one tenant that have not ended.
    pub max_running_commands: u64,
    /// Sandbox creates one tenant may ask for per minute (burst: the same number).
    pub creates_per_minute: u64,
    /// Commands of one sandbox that have not ended.
    pub max_commands_per_sandbox: u64,
    /// Long-lived responses one tenant may hold open: event streams, followed output
    /// and build logs, attached terminals.
    pub max_streams: u64,
    /// Template builds (recipes and snapshot-template) of one tenant not yet ended.
    pub max_builds: u64,
    /// Large request bodies (file uploads, recipes) one tenant may send at once.
    pub max_uploads: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_sandboxes: 100,
            max_running_commands: 256,
            creates_per_minute: 120,
            max_commands_per_sandbox: 64,
            max_streams: 64,
            max_builds: 4,
            max_uploads: 8,
        }
    }
}

/// A token bucket: `capacity` tokens, refilled at `capacity` per minute.
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Counted things a tenant holds open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Held {
    Stream,
    Upload,
}

pub(crate) struct Tenancy {
    /// The server's own token (tenant `default`); `None` accepts API keys only.
    server_token: Option<String>,
    limits: Limits,
    buckets: Mutex<HashMap<String, Bucket>>,
    /// Sandbox creates (and builds) of one tenant run one at a time through their count check.
    create_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    held: Arc<Mutex<HashMap<(String, Held), u64>>>,
    /// Ids of revoked keys, refreshed every [`REVOCATION_POLL`].
    revoked: watch::Sender<Arc<HashSet<String>>>,
}

/// A slot of something counted per tenant; given back when dropped.
pub struct Permit {
    held: Arc<Mutex<HashMap<(String, Held), u64>>>,
    key: (String, Held),
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut held = lock(&self.held);
        if let Some(n) = held.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.key);
            }
        }
    }
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit").field("key", &self.key).finish()
    }
}

impl Tenancy {
    pub(crate) fn new(server_token: Option<String>, limits: Limits) -> Tenancy {
        Tenancy {
            server_token,
            limits,
            buckets: Mutex::new(HashMap::new()),
            create_locks: Mutex::new(HashMap::new()),
            held: Arc::new(Mutex::new(HashMap::new())),
            revoked: watch::channel(Arc::new(HashSet::new())).0,
        }
    }

    pub(crate) fn limits_for(
        &self,
        store: &dyn Store,
        tenant: &Tenant,
    ) -> Result<Limits, ServiceError> {
        let o = store.tenant_limits(tenant.as_str())?;
        let d = &self.limits;
        Ok(Limits {
            max_sandboxes: o.max_sandboxes.unwrap_or(d.max_sandboxes),
            max_running_commands: o.max_running_commands.unwrap_or(d.max_running_commands),
            creates_per_minute: o.creates_per_minute.unwrap_or(d.creates_per_minute),
            ..d.clone()
        })
    }

    /// Takes one create token of `tenant`, or says how long until there is one.
    fn take_create_token(&self, tenant: &Tenant, per_minute: u64) -> Result<(), ServiceError> {
        if per_minute == 0 {
            return Err(ServiceError::TooMany {
                message: format!("tenant {} may not create sandboxes", tenant.as_str()),
                retry_after: None,
            });
        }
        let capacity = per_minute as f64;
        let rate = capacity / 60.0;
        let now = Instant::now();
        let mut buckets = lock(&self.buckets);
        let b = buckets
            .entry(tenant.as_str().to_string())
            .or_insert(Bucket {
                tokens: capacity,
                at: now,
            });
        b.tokens = (b.tokens + now.duration_since(b.at).as_secs_f64() * rate).min(capacity);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            return Ok(());
        }
        let wait = ((1.0 - b.tokens) / rate).ceil().max(1.0) as u64;
        Err(ServiceError::TooMany {
            message: format!(
                "tenant {} is creating sandboxes faster than {per_minute} per minute; retry in {wait} s",
                tenant.as_str()
            ),
            retry_after: Some(wait),
        })
    }

    /// The lock a tenant's creates and builds take around their count check.
    pub(crate) fn create_lock(&self, tenant: &Tenant) -> Arc<tokio::sync::Mutex<()>> {
        lock(&self.create_locks)
            .entry(tenant.as_str().to_string())
            .or_default()
            .clone()
    }

    fn hold(&self, tenant: &Tenant, what: Held, max: u64) -> Result<Permit, ServiceError> {
        let key = (tenant.as_str().to_string(), what);
        let mut held = lock(&self.held);
        let n = held.entry(key.clone()).or_insert(0);
        if *n >= max {
            let (noun, advice) = match what {
                Held::Stream => (
                    "open streams (events, followed output or logs, attached terminals)",
                    "close one first",
                ),
                Held::Upload => (
                    "uploads in flight (files, recipes)",
                    "wait for one to finish",
                ),
            };
            return Err(ServiceError::TooMany {
                message: format!(
                    "tenant {} has {n} {noun}, its limit is {max}: {advice}",
                    tenant.as_str()
                ),
                retry_after: Some(1),
            });
        }
        *n += 1;
        Ok(Permit {
            held: self.held.clone(),
            key,
        })
    }
}

/// The stored form of a key.
pub fn key_hash(key: &str) -> String {
    let d = Sha256::digest(key.as_bytes());
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// A new key for `tenant`: the record to store, its hash, and the key itself
/// (shown once, never stored).
pub fn new_key(tenant: &str, name: &str) -> (ApiKey, String, String) {
    let key = format!("{KEY_PREFIX}{}", space_core::new_token());
    let rec = ApiKey {
        id: space_core::new_id("key"),
        tenant: tenant.to_string(),
        name: name.to_string(),
        created_at: space_core::now_rfc3339(),
        revoked_at: None,
    };
    let hash = key_hash(&key);
    (rec, hash, key)
}

/// Tenant names: 1–63 of `a-z 0-9 - _`, starting with a letter or digit.
pub fn valid_tenant(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-' || *c == b'_')
}

/// Built-in templates belong to everyone (`None`); any other template to the
/// tenant that built it (or `default`, for one built before tenants).
pub(crate) fn template_tenant(
    store: &dyn Store,
    name: &str,
) -> Result<Option<String>, ServiceError> {
    if space_runtime::template::TemplateStore::BUILTIN.contains(&name) {
        return Ok(None);
    }
    Ok(Some(
        store
            .template_owner(name)?
            .unwrap_or_else(|| DEFAULT_TENANT.into()),
    ))
}

/// Whether `tenant` may see and use the template `name`.
pub(crate) fn template_visible(
    store: &dyn Store,
    tenant: &Tenant,
    name: &str,
) -> Result<bool, ServiceError> {
    Ok(template_tenant(store, name)?.is_none_or(|t| t == tenant.as_str()))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Service {
    /// The principal a presented bearer credential stands for; `None` for a missing,
    /// wrong or revoked one.
    pub fn authenticate(&self, presented: &str) -> Result<Option<Principal>, ServiceError> {
        let tenancy = &self.0.tenancy;
        if let Some(t) = &tenancy.server_token {
            if constant_time_eq(presented.as_bytes(), t.as_bytes()) {
                return Ok(Some(Principal::server()));
            }
        }
        if !presented.starts_with(KEY_PREFIX) || presented.len() > 128 {
            return Ok(None);
        }
        Ok(self
            .0
            .store
            .key_for_hash(&key_hash(presented))?
            .map(|(id, tenant)| Principal {
                tenant: Tenant::new(&tenant),
                key_id: Some(id.into()),
            }))
    }

    /// The tenant a sandbox access token (see
    /// [`TenantService::issue_access_token`](crate::TenantService::issue_access_token))
    /// acts for, when it is one of `sandbox_id`'s; 401 otherwise, alike for a missing,
    /// wrong or another sandbox's token. Found by its hash: nothing compares the
    /// presented secret byte by byte.
    pub async fn authenticate_access_token(
        &self,
        sandbox_id: &str,
        presented: Option<&str>,
    ) -> Result<Tenant, ServiceError> {
        let refused = || {
            ServiceError::Api(space_api::ApiError::new(
                space_api::ErrorCode::Unauthorized,
                "missing or wrong access token for this sandbox",
            ))
        };
        let Some(presented) = presented.map(str::trim) else {
            return Err(refused());
        };
        if !presented.starts_with(crate::scope::ACCESS_TOKEN_PREFIX) || presented.len() > 128 {
            return Err(refused());
        }
        let (hash, store) = (key_hash(presented), self.0.store.clone());
        let found = tokio::task::spawn_blocking(move || store.access_token(&hash))
            .await
            .map_err(|e| ServiceError::Internal(e.to_string()))??;
        match found {
            Some((sb, tenant)) if constant_time_eq(sb.as_bytes(), sandbox_id.as_bytes()) => {
                Ok(Tenant::new(&tenant))
            }
            _ => Err(refused()),
        }
    }

    /// Resolves once the key behind `principal` has been revoked (never, for the
    /// server's own token). Streams select on it so that revoking a key ends them.
    pub fn revoked(&self, principal: &Principal) -> impl std::future::Future<Output = ()> + Send {
        let mut rx = self.0.tenancy.revoked.subscribe();
        let key = principal.key_id.clone();
        async move {
            let Some(key) = key else {
                return std::future::pending().await;
            };
            loop {
                if rx.borrow_and_update().contains(key.as_ref()) {
                    return;
                }
                if rx.changed().await.is_err() {
                    return std::future::pending().await;
                }
            }
        }
    }

    /// Starts the task that learns of revoked keys.
    pub(crate) fn spawn_revocation_watch(&self) {
        let svc = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(REVOCATION_POLL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let store = svc.clone();
                let ids = tokio::task::spawn_blocking(move || store.0.store.revoked_key_ids())
                    .await
                    .ok()
                    .and_then(Result::ok);
                let Some(ids) = ids else { continue };
                let ids: HashSet<String> = ids.into_iter().collect();
                svc.0.tenancy.revoked.send_if_modified(|cur| {
                    if **cur == ids {
                        return false;
                    }
                    *cur = Arc::new(ids);
                    true
                });
            }
        });
    }

    /// A slot for one long-lived response of `tenant` (429 past its limit).
    pub(crate) fn admit_stream(&self, tenant: &Tenant) -> Result<Permit, ServiceError> {
        let t = &self.0.tenancy;
        t.hold(tenant, Held::Stream, t.limits.max_streams)
    }

    /// A slot for one large request body of `tenant` in flight (429 past its limit).
    pub(crate) fn admit_upload(&self, tenant: &Tenant) -> Result<Permit, ServiceError> {
        let t = &self.0.tenancy;
        t.hold(tenant, Held::Upload, t.limits.max_uploads)
    }

    /// Runs `create` if `tenant` is under its sandbox count and create rate. The
    /// count check and the create happen under one per-tenant lock, so concurrent
    /// creates cannot overshoot the limit.
    pub(crate) async fn admit_create<T, F>(
        &self,
        tenant: &Tenant,
        create: impl FnOnce() -> F,
    ) -> super::Result<T>
    where
        F: std::future::Future<Output = super::Result<T>>,
    {
        let tenancy = &self.0.tenancy;
        let lock = tenancy.create_lock(tenant);
        let _held = lock.lock().await;
        let limits = tenancy.limits_for(self.0.store.as_ref(), tenant)?;
        let live = self.0.store.count_tenant_sandboxes(tenant.as_str())?;
        if live >= limits.max_sandboxes {
            return Err(ServiceError::TooMany {
                message: format!(
                    "tenant {} has {live} sandboxes that are not destroyed (failed ones count \
                     until they are destroyed), its limit is {}: destroy one first",
                    tenant.as_str(),
                    limits.max_sandboxes
                ),
                retry_after: None,
            });
        }
        tenancy.take_create_token(tenant, limits.creates_per_minute)?;
        create().await
    }

    /// Runs `record` (which makes one more sandbox resident: a create's record, a resume's
    /// operation) if the server runs fewer resident sandboxes than `max_sandboxes`; the
    /// count and the record happen under one lock, so concurrent calls cannot overshoot.
    pub(crate) fn admit_resident<T>(
        &self,
        record: impl FnOnce() -> super::Result<T>,
    ) -> super::Result<T> {
        let max = self.0.cfg.max_sandboxes;
        if max == 0 {
            return record();
        }
        let _held = lock(&self.0.capacity);
        let resident = self.0.store.count_resident_sandboxes()?;
        if resident >= max {
            return Err(ServiceError::TooMany {
                message: format!(
                    "this server runs {resident} sandboxes, its capacity is {max} \
                     (--max-sandboxes): retry later, or suspend or destroy one"
                ),
                retry_after: Some(5),
            });
        }
        record()
    }

    /// Runs `start` (which records a build operation) if `tenant` has fewer unfinished
    /// builds than its limit; the check and the record happen under one lock.
    pub(crate) async fn admit_build<T>(
        &self,
        tenant: &Tenant,
        start: impl FnOnce() -> super::Result<T>,
    ) -> super::Result<T> {
        let tenancy = &self.0.tenancy;
        let lock = tenancy.create_lock(tenant);
        let _held = lock.lock().await;
        let max = tenancy.limits.max_builds;
        let open = self.0.store.count_unfinished_builds(tenant.as_str())?;
        if open >= max {
            return Err(ServiceError::TooMany {
                message: format!(
                    "tenant {} has {open} template builds running, its limit is {max}: wait for one to end",
                    tenant.as_str()
                ),
                retry_after: Some(5),
            });
        }
        start()
    }

    /// Refuses a new command in `sandbox_id` when the sandbox or the tenant
    /// has too many that have not ended.
    pub(crate) fn admit_command(&self, tenant: &Tenant, sandbox_id: &str) -> super::Result<()> {
        let store = &self.0.store;
        let limits = self.0.tenancy.limits_for(store.as_ref(), tenant)?;
        let (mine, here) = store.count_unfinished_commands(tenant.as_str(), sandbox_id)?;
        if here >= limits.max_commands_per_sandbox {
            return Err(ServiceError::TooMany {
                message: format!(
                    "sandbox {sandbox_id} has {here} commands running, the limit is {}",
                    limits.max_commands_per_sandbox
                ),
                retry_after: None,
            });
        }
        if mine >= limits.max_running_commands {
            return Err(ServiceError::TooMany {
                message: format!(
                    "tenant {} has {mine} commands running, its limit is {}",
                    tenant.as_str(),
                    limits.max_running_commands
                ),
                retry_after: None,
            });
        }
        Ok(())
    }

    /// Makes `name` the tenant's template name (a name is one tenant's until its
    /// template is deleted): 409 when another tenant's template has it. `Ok(true)`
    /// when this call made the claim (undo it with [`Self::unclaim_template`] if the
    /// build is refused).
    pub(crate) fn claim_template(&self, tenant: &Tenant, name: &str) -> super::Result<bool> {
        let store = &self.0.store;
        let taken = || {
            ServiceError::Conflict(format!(
                "the template name {:?} is taken: choose another",
                super::truncate(name, 64)
            ))
        };
        // Built-in names are refused by the build itself, with its own message.
        if template_tenant(store.as_ref(), name)?.is_none() {
            return Ok(false);
        }
        match store.template_owner(name)? {
            Some(owner) if owner == tenant.as_str() => Ok(false),
            Some(_) => Err(taken()),
            None => {
                // A template built before tenants existed belongs to `default`.
                let exists = self.list_templates()?.iter().any(|t| t.name == name);
                if exists && tenant.as_str() != DEFAULT_TENANT {
                    return Err(taken());
                }
                match store.claim_template(name, tenant.as_str())? {
                    true => Ok(!exists),
                    false => Err(taken()),
                }
            }
        }
    }

    /// Gives back a name claimed for a build that was refused before it started.
    pub(crate) fn unclaim_template(&self, name: &str) {
        if let Err(e) = self.0.store.release_template(name) {
            tracing::warn!(error = %e, "releasing a template name");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_names() {
        for ok in ["acme", "a", "team-1", "x_y", "0abc"] {
            assert!(valid_tenant(ok), "{ok}");
        }
        for bad in ["", "-a", "A", "a b", "a/b", "é", &"a".repeat(64)] {
            assert!(!valid_tenant(bad), "{bad}");
        }
    }

    #[test]
    fn keys_are_random_and_hashed() {
        let (rec, hash, key) = new_key("acme", "ci");
        let (_, hash2, key2) = new_key("acme", "ci");
        assert!(key.starts_with(KEY_PREFIX));
        assert_ne!(key, key2);
        assert_ne!(hash, hash2);
        assert_eq!(hash, key_hash(&key));
        assert!(!hash.contains(&key[KEY_PREFIX.len()..]));
        assert_eq!(rec.tenant, "acme");
    }

    #[test]
    fn create_rate_refills_and_says_when() {
        let t = Tenancy::new(None, Limits::default());
        let me = Tenant::new("a");
        for _ in 0..3 {
            t.take_create_token(&me, 3).unwrap();
        }
        match t.take_create_token(&me, 3) {
            Err(ServiceError::TooMany {
                retry_after: Some(s),
                ..
            }) => assert!((1..=20).contains(&s), "{s}"),
            other => panic!("{other:?}"),
        }
        // Another tenant has its own bucket.
        t.take_create_token(&Tenant::new("b"), 3).unwrap();
        assert!(t.take_create_token(&me, 0).is_err());
    }

    #[test]
    fn held_slots_are_counted_per_tenant_and_given_back() {
        let t = Tenancy::new(None, Limits::default());
        let (a, b) = (Tenant::new("a"), Tenant::new("b"));
        let first = t.hold(&a, Held::Stream, 2).unwrap();
        let _second = t.hold(&a, Held::Stream, 2).unwrap();
        assert!(matches!(
            t.hold(&a, Held::Stream, 2),
            Err(ServiceError::TooMany { .. })
        ));
        // Another tenant, and another kind, have their own counts.
        let _other = t.hold(&b, Held::Stream, 2).unwrap();
        let _upload = t.hold(&a, Held::Upload, 2).unwrap();
        drop(first);
        let _again = t.hold(&a, Held::Stream, 2).unwrap();
    }
}
