//! Who is asking, what they may see, and how much they may ask for.
//!
//! Every `/v1` request carries a bearer key. The server's own token
//! (`SPACE_API_TOKEN`, or the dev token) is tenant `default`; a key made by
//! `space keys create --tenant T` is tenant `T` (the store keeps its SHA-256
//! only). Everything under `/v1/sandboxes/{id}` and `/v1/operations/{id}` is
//! checked against the caller's tenant *before* the handler runs, so a route
//! added later is covered too: another tenant's id answers exactly like an
//! id that does not exist (404). Lists and the event stream are filtered.
//!
//! Limits per tenant (server flags, overridable per tenant with
//! `space tenants limits`): sandboxes that are not destroyed or failed,
//! running commands, and a create rate; over any of them the answer is 429
//! (with `Retry-After` for the rate). Per sandbox: running commands.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use space_api::{Operation, SandboxState, DEFAULT_TENANT};
use space_store::{ApiKey, Store};

use super::{error, AppState, HttpError};
use crate::service::{Service, ServiceError};

/// Prefix of every API key, so a leaked one is easy to recognise (and to scan for).
pub const KEY_PREFIX: &str = "spk_";

/// The caller's tenant, put on every authenticated request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant(pub Arc<str>);

impl Tenant {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Server-wide defaults of the per-tenant and per-sandbox limits.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Sandboxes of one tenant that are not destroyed or failed.
    pub max_sandboxes: u64,
    /// Commands of one tenant that have not ended.
    pub max_running_commands: u64,
    /// Sandbox creates one tenant may ask for per minute (burst: the same number).
    pub creates_per_minute: u64,
    /// Commands of one sandbox that have not ended.
    pub max_commands_per_sandbox: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_sandboxes: 100,
            max_running_commands: 256,
            creates_per_minute: 120,
            max_commands_per_sandbox: 64,
        }
    }
}

/// A token bucket: `capacity` tokens, refilled at `capacity` per minute.
struct Bucket {
    tokens: f64,
    at: Instant,
}

pub struct Tenancy {
    /// The server's own token (tenant `default`); `None` accepts API keys only.
    server_token: Option<String>,
    limits: Limits,
    buckets: Mutex<HashMap<String, Bucket>>,
    /// Sandbox creates of one tenant run one at a time through the count check.
    create_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl Tenancy {
    pub fn new(server_token: Option<String>, limits: Limits) -> Tenancy {
        Tenancy {
            server_token,
            limits,
            buckets: Mutex::new(HashMap::new()),
            create_locks: Mutex::new(HashMap::new()),
        }
    }

    /// The tenant a presented bearer credential stands for.
    fn authenticate(&self, store: &Store, presented: &str) -> Result<Option<Tenant>, ServiceError> {
        if let Some(t) = &self.server_token {
            if constant_time_eq(presented.as_bytes(), t.as_bytes()) {
                return Ok(Some(Tenant(DEFAULT_TENANT.into())));
            }
        }
        if !presented.starts_with(KEY_PREFIX) || presented.len() > 128 {
            return Ok(None);
        }
        Ok(store
            .tenant_for_key_hash(&key_hash(presented))?
            .map(|t| Tenant(t.into())))
    }

    fn limits_for(&self, store: &Store, tenant: &Tenant) -> Result<Limits, ServiceError> {
        let o = store.tenant_limits(tenant.as_str())?;
        let d = &self.limits;
        Ok(Limits {
            max_sandboxes: o.max_sandboxes.unwrap_or(d.max_sandboxes),
            max_running_commands: o.max_running_commands.unwrap_or(d.max_running_commands),
            creates_per_minute: o.creates_per_minute.unwrap_or(d.creates_per_minute),
            max_commands_per_sandbox: d.max_commands_per_sandbox,
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
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
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

    fn create_lock(&self, tenant: &Tenant) -> Arc<tokio::sync::Mutex<()>> {
        self.create_locks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(tenant.as_str().to_string())
            .or_default()
            .clone()
    }

    /// Runs `create` if `tenant` is under its sandbox count and create rate.
    /// The count check and the create happen under one per-tenant lock, so
    /// concurrent creates cannot overshoot the limit.
    pub async fn admit_create<T>(
        &self,
        service: &Service,
        tenant: &Tenant,
        create: impl FnOnce() -> crate::service::Result<T>,
    ) -> crate::service::Result<T> {
        let lock = self.create_lock(tenant);
        let _held = lock.lock().await;
        let limits = self.limits_for(service.store(), tenant)?;
        let live = service
            .store()
            .list_sandboxes()?
            .iter()
            .filter(|r| r.sandbox.tenant == tenant.as_str())
            .filter(|r| {
                !matches!(
                    r.sandbox.state,
                    SandboxState::Destroyed | SandboxState::Failed
                )
            })
            .count() as u64;
        if live >= limits.max_sandboxes {
            return Err(ServiceError::TooMany {
                message: format!(
                    "tenant {} has {live} sandboxes, its limit is {}: destroy one first",
                    tenant.as_str(),
                    limits.max_sandboxes
                ),
                retry_after: None,
            });
        }
        self.take_create_token(tenant, limits.creates_per_minute)?;
        create()
    }

    /// Refuses a new command in `sandbox_id` when the sandbox or the tenant
    /// has too many that have not ended.
    pub fn admit_command(
        &self,
        service: &Service,
        tenant: &Tenant,
        sandbox_id: &str,
    ) -> crate::service::Result<()> {
        let store = service.store();
        let limits = self.limits_for(store, tenant)?;
        let open = store.unfinished_commands()?;
        let here = open.iter().filter(|c| c.sandbox_id == sandbox_id).count() as u64;
        if here >= limits.max_commands_per_sandbox {
            return Err(ServiceError::TooMany {
                message: format!(
                    "sandbox {sandbox_id} has {here} commands running, the limit is {}",
                    limits.max_commands_per_sandbox
                ),
                retry_after: None,
            });
        }
        let mut owners: HashMap<&str, bool> = HashMap::new();
        let mut mine = 0u64;
        for c in &open {
            let is_mine = match owners.get(c.sandbox_id.as_str()) {
                Some(v) => *v,
                None => {
                    let v =
                        sandbox_tenant(store, &c.sandbox_id)?.as_deref() == Some(tenant.as_str());
                    owners.insert(&c.sandbox_id, v);
                    v
                }
            };
            mine += u64::from(is_mine);
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

fn sandbox_tenant(store: &Store, id: &str) -> Result<Option<String>, ServiceError> {
    Ok(store.get_sandbox(id)?.map(|r| r.sandbox.tenant))
}

/// The tenant an operation belongs to: its sandbox's, or for a template build
/// the template's owner. Records from before tenants belong to `default`.
pub fn operation_tenant(store: &Store, op: &Operation) -> Result<String, ServiceError> {
    if let Some(sb) = &op.sandbox_id {
        return Ok(sandbox_tenant(store, sb)?.unwrap_or_else(|| DEFAULT_TENANT.into()));
    }
    if let Some(t) = &op.template {
        return Ok(template_tenant(store, t)?.unwrap_or_else(|| DEFAULT_TENANT.into()));
    }
    Ok(DEFAULT_TENANT.into())
}

/// Built-in templates belong to everyone (`None`); any other template to the
/// tenant that built it (or `default`, for one built before tenants).
pub fn template_tenant(store: &Store, name: &str) -> Result<Option<String>, ServiceError> {
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
pub fn template_visible(store: &Store, tenant: &Tenant, name: &str) -> Result<bool, ServiceError> {
    Ok(template_tenant(store, name)?.is_none_or(|t| t == tenant.as_str()))
}

/// `Authorization: Bearer …` on every `/v1` route; puts the [`Tenant`] on the request.
pub async fn auth(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let tenant = match presented {
        Some(p) => match state.tenancy.authenticate(state.service.store(), p) {
            Ok(t) => t,
            Err(e) => return HttpError(e).into_response(),
        },
        None => None,
    };
    let Some(tenant) = tenant else {
        let mut resp = error(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing, wrong or revoked bearer token",
        );
        resp.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            "Bearer".parse().expect("static header"),
        );
        return resp;
    };
    req.extensions_mut().insert(tenant);
    next.run(req).await
}

/// Answers 404 for another tenant's sandbox, operation or template before
/// any handler sees the request.
pub async fn ownership(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Some(tenant) = req.extensions().get::<Tenant>().cloned() else {
        return error(StatusCode::UNAUTHORIZED, "unauthorized", "no tenant");
    };
    match foreign(&state, &tenant, req.method(), req.uri().path()) {
        Ok(None) => next.run(req).await,
        Ok(Some(message)) => error(StatusCode::NOT_FOUND, "not_found", message),
        Err(e) => HttpError(e).into_response(),
    }
}

/// `Some(404 message)` when the path names something of another tenant.
fn foreign(
    state: &AppState,
    tenant: &Tenant,
    method: &Method,
    path: &str,
) -> Result<Option<String>, ServiceError> {
    let store = state.service.store();
    let path = path.strip_prefix("/v1").unwrap_or(path);
    let mut parts = path.trim_start_matches('/').split('/');
    let (kind, id) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let short = crate::service::truncate(id, 64);
    match kind {
        "sandboxes" if space_core::is_valid_id(id, "sb") => {
            let owner = sandbox_tenant(store, id)?;
            Ok(owner
                .filter(|o| o != tenant.as_str())
                .map(|_| format!("no sandbox {short}")))
        }
        "operations" if space_core::is_valid_id(id, "op") => {
            let Some(op) = store.get_operation(id)? else {
                return Ok(None);
            };
            Ok((operation_tenant(store, &op)? != tenant.as_str())
                .then(|| format!("no operation {short}")))
        }
        "templates" if !id.is_empty() && method == Method::DELETE => {
            Ok((!template_visible(store, tenant, id)?)
                .then(|| format!("unknown template {short:?}")))
        }
        _ => Ok(None),
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
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
        let me = Tenant("a".into());
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
        t.take_create_token(&Tenant("b".into()), 3).unwrap();
        assert!(t.take_create_token(&me, 0).is_err());
    }
}
