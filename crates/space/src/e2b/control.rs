//! E2B's control plane: create, connect, list, get, kill, pause, timeouts and metrics,
//! authenticated by `X-API-KEY` (a space API key, or the server's token). Errors are
//! `{"code": <status>, "message"}`; each call answers the exact status the SDKs expect.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};
use space_api::{
    CreateSandboxRequest, KeepaliveRequest, OnIdle, Operation, OperationStatus, Sandbox,
    SandboxState,
};
use space_runtime::template::CODE_INTERPRETER;
use space_service::{ServiceError, Tenant};

use super::{E2bError, E2bState, ENVD_VERSION};

/// E2B's default timeout when a create names none.
const DEFAULT_TIMEOUT: u64 = 15;
/// Longest timeout accepted (E2B's own cap for its top plan).
const MAX_TIMEOUT: u64 = 24 * 3600;
/// How long a create, pause or resume may take before the call gives up waiting (the
/// operation goes on; its sandbox shows up in lists).
const OP_WAIT: Duration = Duration::from_secs(300);
/// Largest page of a list.
const MAX_LIMIT: usize = 100;
/// What `clientID` says: there is one host.
const CLIENT_ID: &str = "space";

fn fail(status: StatusCode, message: impl Into<String>) -> E2bError {
    E2bError::new(status, message)
}

pub(crate) fn service_error(e: ServiceError) -> E2bError {
    let status =
        StatusCode::from_u16(e.code().http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let message = match &e {
        ServiceError::Store(_) | ServiceError::Internal(_) => {
            tracing::warn!(error = %space_service::error_chain(&e), "E2B call failed");
            "internal error".to_string()
        }
        _ => e.to_string(),
    };
    fail(status, message)
}

/// The tenant behind `X-API-KEY` (or `Authorization: Bearer`, which E2B's CLI sends).
fn caller(st: &E2bState, headers: &HeaderMap) -> Result<Tenant, E2bError> {
    let key = headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .or_else(|| {
            headers
                .get(axum::http::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
        })
        .map(str::trim);
    let principal = match key {
        Some(k) => st.service.authenticate(k).map_err(service_error)?,
        None => None,
    };
    principal.map(|p| p.tenant).ok_or_else(|| {
        fail(
            StatusCode::UNAUTHORIZED,
            "missing, wrong or revoked X-API-KEY",
        )
    })
}

async fn json_body(body: Body) -> Result<Value, E2bError> {
    let bytes = axum::body::to_bytes(body, crate::api::MAX_JSON_BODY)
        .await
        .map_err(|_| fail(StatusCode::PAYLOAD_TOO_LARGE, "body too large"))?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(json!({}));
    }
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(fail(StatusCode::BAD_REQUEST, "the body is a JSON object")),
        Err(e) => Err(fail(StatusCode::BAD_REQUEST, format!("invalid JSON: {e}"))),
    }
}

fn timeout_of(v: &Value, field: &str) -> Result<Option<u64>, E2bError> {
    match v.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(t) => match t.as_u64() {
            Some(n) if (1..=MAX_TIMEOUT).contains(&n) => Ok(Some(n)),
            _ => Err(fail(
                StatusCode::BAD_REQUEST,
                format!("{field} must be a number of seconds, 1-{MAX_TIMEOUT}"),
            )),
        },
    }
}

fn string_map(v: &Value, field: &str) -> Result<Option<BTreeMap<String, String>>, E2bError> {
    match v.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                _ => Err(fail(
                    StatusCode::BAD_REQUEST,
                    format!("{field} values are strings"),
                )),
            })
            .collect::<Result<BTreeMap<_, _>, _>>()
            .map(|m| (!m.is_empty()).then_some(m)),
        Some(_) => Err(fail(
            StatusCode::BAD_REQUEST,
            format!("{field} is an object of strings"),
        )),
    }
}

/// E2B's two states: what can run commands now, and what a connect resumes.
fn e2b_state(s: SandboxState) -> Option<&'static str> {
    match s {
        SandboxState::Creating | SandboxState::Running | SandboxState::Resuming => Some("running"),
        SandboxState::Pausing
        | SandboxState::Paused
        | SandboxState::Suspending
        | SandboxState::Suspended => Some("paused"),
        SandboxState::Destroying | SandboxState::Destroyed | SandboxState::Failed => None,
    }
}

fn not_found(id: &str) -> E2bError {
    fail(
        StatusCode::NOT_FOUND,
        format!("sandbox {} not found", space_api::truncate(id, 64)),
    )
}

/// The caller's live sandbox `id` (a destroyed or failed one is as gone as an unknown).
async fn live(st: &E2bState, tenant: &Tenant, id: &str) -> Result<Sandbox, E2bError> {
    match st.service.for_tenant(tenant).get_sandbox(id).await {
        Ok(sb) if e2b_state(sb.state).is_some() => Ok(sb),
        Ok(_) => Err(not_found(id)),
        Err(e) => Err(service_error(e)),
    }
}

/// Waits for an operation to end; its error, if it failed.
async fn finish(st: &E2bState, tenant: &Tenant, op: Operation) -> Result<(), E2bError> {
    let mut op = op;
    let deadline = tokio::time::Instant::now() + OP_WAIT;
    while !op.status.is_terminal() {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return Err(fail(
                StatusCode::GATEWAY_TIMEOUT,
                format!("operation {} is still running", op.id),
            ));
        }
        op = st
            .service
            .for_tenant(tenant)
            .get_operation(&op.id, left.min(Duration::from_secs(30)))
            .await
            .map_err(service_error)?;
    }
    match op.status {
        OperationStatus::Succeeded => Ok(()),
        _ => {
            let (status, message) = match &op.error {
                Some(e) => (
                    StatusCode::from_u16(e.code.http_status())
                        .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                    e.message.clone(),
                ),
                None => (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the operation failed".into(),
                ),
            };
            Err(fail(status, message))
        }
    }
}

fn rfc3339_or_far(t: Option<&str>) -> String {
    t.map(str::to_string)
        .unwrap_or_else(|| "9999-12-31T23:59:59Z".to_string())
}

/// What E2B's `Sandbox`, `SandboxDetail` and `ListedSandbox` have in common.
fn describe(sb: &Sandbox, template: &str) -> Value {
    let end = sb.expires_at.as_deref().or(sb.idle_expires_at.as_deref());
    json!({
        "templateID": template,
        "sandboxID": sb.id,
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "startedAt": sb.created_at,
        "endAt": rfc3339_or_far(end),
        "cpuCount": sb.resources.vcpus.unwrap_or(1),
        "memoryMB": sb.resources.memory_mib.unwrap_or(0),
        "diskSizeMB": sb.resources.disk_mib.unwrap_or(0),
        "state": e2b_state(sb.state).unwrap_or("running"),
        "metadata": sb.labels,
    })
}

/// The template name E2B clients know a sandbox by.
fn template_of(st: &E2bState, sb: &Sandbox) -> String {
    if sb.template == *st.default_template {
        "base".to_string()
    } else if sb.template == CODE_INTERPRETER {
        E2B_CODE_INTERPRETER.to_string()
    } else {
        sb.template.clone()
    }
}

/// The default template of E2B's code interpreter SDK; ours is `code-interpreter`.
const E2B_CODE_INTERPRETER: &str = "code-interpreter-v1";

/// The answer to a create or a connect: the sandbox and a new envd access token.
async fn created(st: &E2bState, tenant: &Tenant, sb: &Sandbox, status: StatusCode) -> Response {
    let token = match st
        .service
        .for_tenant(tenant)
        .issue_access_token(&sb.id)
        .await
    {
        Ok(t) => t,
        Err(e) => return service_error(e).into_response(),
    };
    let template = template_of(st, sb);
    let body = json!({
        "templateID": template,
        "sandboxID": sb.id,
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": token,
        // The code interpreter's SDK authenticates its context routes with this one.
        "trafficAccessToken": token,
        "domain": Value::Null,
    });
    (status, axum::Json(body)).into_response()
}

/// `POST /v2/sandboxes` (and `/sandboxes`): 201 once the sandbox runs.
pub async fn create(State(st): State<E2bState>, headers: HeaderMap, body: Body) -> Response {
    let tenant = match caller(&st, &headers) {
        Ok(t) => t,
        Err(r) => return r.into_response(),
    };
    let run = async {
        let v = json_body(body).await?;
        let template = match v.get("templateID") {
            Some(Value::String(t)) if !t.trim().is_empty() => t.trim().to_string(),
            _ => return Err(fail(StatusCode::BAD_REQUEST, "templateID is required")),
        };
        let template = match template.as_str() {
            "base" => st.default_template.to_string(),
            E2B_CODE_INTERPRETER => CODE_INTERPRETER.to_string(),
            t => t.to_string(),
        };
        let timeout = timeout_of(&v, "timeout")?.unwrap_or(DEFAULT_TIMEOUT);
        let auto_pause = match v.get("autoPause") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(fail(StatusCode::BAD_REQUEST, "autoPause is a boolean")),
        };
        let mut req = CreateSandboxRequest {
            template,
            env: string_map(&v, "envVars")?,
            labels: string_map(&v, "metadata")?,
            ..Default::default()
        };
        if auto_pause {
            // E2B pauses at the timeout instead of killing; here, idleness suspends.
            req.idle_timeout_seconds = Some(timeout);
            req.on_idle = Some(OnIdle::Suspend);
        } else {
            req.ttl_seconds = Some(timeout);
        }
        let scope = st.service.for_tenant(&tenant);
        let op = scope.create_sandbox(req).await.map_err(service_error)?;
        let id = op.sandbox_id.clone().unwrap_or_default();
        finish(&st, &tenant, op).await?;
        let sb = scope.get_sandbox(&id).await.map_err(service_error)?;
        Ok(created(&st, &tenant, &sb, StatusCode::CREATED).await)
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v2/sandboxes/{id}/connect {timeout}`: resumes a paused sandbox (201) or
/// extends a running one's timeout (200); either way a fresh access token.
pub async fn connect(
    State(st): State<E2bState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let tenant = match caller(&st, &headers) {
        Ok(t) => t,
        Err(r) => return r.into_response(),
    };
    let run = async {
        let v = json_body(body).await?;
        let timeout = timeout_of(&v, "timeout")?;
        let sb = live(&st, &tenant, &id).await?;
        let status = resume_if_paused(&st, &tenant, &sb).await?;
        extend(&st, &tenant, &sb, timeout)?;
        let sb = live(&st, &tenant, &id).await?;
        Ok::<_, E2bError>(created(&st, &tenant, &sb, status).await)
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

/// `POST /sandboxes/{id}/resume` (older SDKs): 201, or 409 when it is not paused.
pub async fn resume(
    State(st): State<E2bState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let tenant = match caller(&st, &headers) {
        Ok(t) => t,
        Err(r) => return r.into_response(),
    };
    let run = async {
        let v = json_body(body).await?;
        let timeout = timeout_of(&v, "timeout")?;
        let sb = live(&st, &tenant, &id).await?;
        if e2b_state(sb.state) != Some("paused") {
            return Err(fail(
                StatusCode::CONFLICT,
                format!("sandbox {id} is not paused"),
            ));
        }
        resume_if_paused(&st, &tenant, &sb).await?;
        extend(&st, &tenant, &sb, timeout)?;
        let sb = live(&st, &tenant, &id).await?;
        Ok(created(&st, &tenant, &sb, StatusCode::CREATED).await)
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

/// Brings a paused (or suspended) sandbox back; 201 if it did, 200 if it ran.
async fn resume_if_paused(
    st: &E2bState,
    tenant: &Tenant,
    sb: &Sandbox,
) -> Result<StatusCode, E2bError> {
    let scope = st.service.for_tenant(tenant);
    let mut state = sb.state;
    let mut resumed = false;
    // A pause, suspend or resume under way (another client's connect) ends first; a
    // resume that loses the race to another one waits for that one.
    let deadline = tokio::time::Instant::now() + OP_WAIT;
    loop {
        match state {
            SandboxState::Running => {
                return Ok(if resumed {
                    StatusCode::CREATED
                } else {
                    StatusCode::OK
                })
            }
            SandboxState::Paused | SandboxState::Suspended => match scope.resume(&sb.id) {
                Ok(op) => {
                    finish(st, tenant, op).await?;
                    resumed = true;
                }
                Err(ServiceError::InvalidTransition(_) | ServiceError::Conflict(_)) => {}
                Err(e) => return Err(service_error(e)),
            },
            _ => {}
        }
        if tokio::time::Instant::now() > deadline {
            return Err(fail(
                StatusCode::CONFLICT,
                format!("sandbox {} is busy", sb.id),
            ));
        }
        if !resumed {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        state = live(st, tenant, &sb.id).await?.state;
    }
}

/// Restarts the sandbox's clock: a TTL becomes `timeout` from now; a sandbox that
/// suspends when idle (E2B's auto-pause) has no TTL, and the call counts as activity.
fn extend(
    st: &E2bState,
    tenant: &Tenant,
    sb: &Sandbox,
    timeout: Option<u64>,
) -> Result<(), E2bError> {
    let ttl_seconds = timeout.filter(|_| sb.ttl_seconds.is_some());
    st.service
        .for_tenant(tenant)
        .keepalive(&sb.id, KeepaliveRequest { ttl_seconds })
        .map(|_| ())
        .map_err(service_error)
}

/// `GET /sandboxes/{id}`.
pub async fn get_info(
    State(st): State<E2bState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let tenant = match caller(&st, &headers) {
        Ok(t) => t,
        Err(r) => return r.into_response(),
    };
    match live(&st, &tenant, &id).await {
        Ok(sb) => axum::Json(describe(&sb, &template_of(&st, &sb))).into_response(),
        Err(r) => r.into_response(),
    }
}

/// `DELETE /sandboxes/{id}`: 204 once it is being destroyed, 404 when unknown.
pub async fn kill(
    State(st): State<E2bState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let tenant = match caller(&st, &headers) {
        Ok(t) => t,
        Err(r) => return r.into_response(),
    };
    if let Err(r) = live(&st, &tenant, &id).await {
        return r.into_response();
    }
    match st.service.for_tenant(&tenant).destroy_sandbox(&id) {
        Ok(op) => match finish(&st, &tenant, op).await {
            Ok(()) => StatusCode::NO_CONTENT.into_response(),
            Err(r) => r.into_response(),
        },
        Err(e) => service_error(e).into_response(),
    }
}

/// `POST /sandboxes/{id}/timeout {timeout}`: 204.
pub async fn set_timeout(
    State(st): State<E2bState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let tenant = match caller(&st, &headers) {
        Ok(t) => t,
        Err(r) => return r.into_response(),
    };
    let run = async {
        let v = json_body(body).await?;
        let Some(timeout) = timeout_of(&v, "timeout")? else {
            return Err(fail(StatusCode::BAD_REQUEST, "timeout is required"));
        };
        let sb = live(&st, &tenant, &id).await?;
        extend(&st, &tenant, &sb, Some(timeout))?;
        Ok::<_, E2bError>(StatusCode::NO_CONTENT.into_response())
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

/// `POST /sandboxes/{id}/refreshes {duration}`: 204 (older SDKs' keepalive).
pub async fn refresh(
    State(st): State<E2bState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let tenant = match caller(&st, &headers) {
        Ok(t) => t,
        Err(r) => return r.into_response(),
    };
    let run = async {
        let v = json_body(body).await?;
        let timeout = timeout_of(&v, "duration")?;
        let sb = live(&st, &tenant, &id).await?;
        extend(&st, &tenant, &sb, timeout)?;
        Ok::<_, E2bError>(StatusCode::NO_CONTENT.into_response())
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

/// `POST /sandboxes/{id}/pause`: suspends it (a durable snapshot that survives a
/// restart of the server); 204, or 409 when it is already paused.
pub async fn pause(
    State(st): State<E2bState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let tenant = match caller(&st, &headers) {
        Ok(t) => t,
        Err(r) => return r.into_response(),
    };
    let run = async {
        let sb = live(&st, &tenant, &id).await?;
        if e2b_state(sb.state) == Some("paused") {
            return Err(fail(
                StatusCode::CONFLICT,
                format!("sandbox {id} is already paused"),
            ));
        }
        let op = st
            .service
            .for_tenant(&tenant)
            .suspend(&id)
            .map_err(service_error)?;
        finish(&st, &tenant, op).await?;
        Ok::<_, E2bError>(StatusCode::NO_CONTENT.into_response())
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

/// `GET /sandboxes/{id}/metrics`: one sample of what the host measures.
pub async fn metrics(
    State(st): State<E2bState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let tenant = match caller(&st, &headers) {
        Ok(t) => t,
        Err(r) => return r.into_response(),
    };
    let sb = match live(&st, &tenant, &id).await {
        Ok(sb) => sb,
        Err(r) => return r.into_response(),
    };
    let now = time::OffsetDateTime::now_utc();
    let mib = 1024 * 1024;
    let sample = json!({
        "timestamp": now.format(&time::format_description::well_known::Rfc3339).unwrap_or_default(),
        "timestampUnix": now.unix_timestamp(),
        "cpuCount": sb.resources.vcpus.unwrap_or(1),
        // CPU use is not sampled per sandbox yet.
        "cpuUsedPct": 0.0,
        "memUsed": sb.cost.memory_bytes.unwrap_or(0),
        "memTotal": sb.resources.memory_mib.unwrap_or(0) * mib,
        "memCache": 0,
        "diskUsed": sb.cost.disk_bytes.unwrap_or(0),
        "diskTotal": sb.resources.disk_mib.unwrap_or(0) * mib,
    });
    axum::Json(json!([sample])).into_response()
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct ListQuery {
    metadata: Option<String>,
    state: Option<String>,
    limit: Option<usize>,
    next_token: Option<String>,
    template: Option<String>,
    order: Option<String>,
    started_after: Option<String>,
}

/// The pairs of a `metadata` filter: `k=v&k2=v2`, each side percent-encoded (the
/// SDKs encode them once more inside the query string).
fn metadata_filter(raw: &str) -> Result<Vec<(String, String)>, E2bError> {
    let bad = || fail(StatusCode::BAD_REQUEST, "metadata is k=v pairs joined by &");
    let pairs: Vec<(String, String)> = serde_urlencoded::from_str(raw).map_err(|_| bad())?;
    pairs
        .into_iter()
        .map(|(k, v)| {
            let dec = |s: &str| {
                serde_urlencoded::from_str::<Vec<(String, String)>>(&format!(
                    "x={}",
                    s.replace('+', "%2B")
                ))
                .ok()
                .and_then(|mut p| p.pop())
                .map(|(_, v)| v)
            };
            match (dec(&k), dec(&v)) {
                (Some(k), Some(v)) if !k.is_empty() => Ok((k, v)),
                _ => Err(bad()),
            }
        })
        .collect()
}

async fn list(st: &E2bState, headers: &HeaderMap, raw: Option<&str>, paged: bool) -> Response {
    let tenant = match caller(st, headers) {
        Ok(t) => t,
        Err(r) => return r.into_response(),
    };
    let run = async {
        let q: ListQuery = serde_urlencoded::from_str(raw.unwrap_or(""))
            .map_err(|e| fail(StatusCode::BAD_REQUEST, format!("bad query: {e}")))?;
        let labels = match q.metadata.as_deref() {
            Some(m) if !m.is_empty() => metadata_filter(m)?,
            _ => Vec::new(),
        };
        let states: Vec<String> = match q.state.as_deref() {
            Some(s) if !s.is_empty() => s.split(',').map(|s| s.trim().to_string()).collect(),
            _ => vec!["running".into(), "paused".into()],
        };
        if let Some(bad) = states.iter().find(|s| *s != "running" && *s != "paused") {
            return Err(fail(
                StatusCode::BAD_REQUEST,
                format!(
                    "unknown state {:?}: running or paused",
                    space_api::truncate(bad, 32)
                ),
            ));
        }
        // Past the largest page, a page of the largest size (E2B's own cap).
        let limit = match q.limit {
            None => MAX_LIMIT,
            Some(0) => return Err(fail(StatusCode::BAD_REQUEST, "limit is at least 1")),
            Some(n) => n.min(MAX_LIMIT),
        };
        let desc = match q.order.as_deref() {
            None | Some("asc") => false,
            Some("desc") => true,
            Some(_) => return Err(fail(StatusCode::BAD_REQUEST, "order is asc or desc")),
        };
        let mut all: Vec<Sandbox> = st
            .service
            .for_tenant(&tenant)
            .list_sandboxes(labels)
            .await
            .map_err(service_error)?
            .into_iter()
            .filter(|sb| e2b_state(sb.state).is_some_and(|s| states.iter().any(|w| w == s)))
            .filter(|sb| {
                q.template
                    .as_deref()
                    .is_none_or(|t| template_of(st, sb) == t || sb.template == t)
            })
            .filter(|sb| {
                q.started_after
                    .as_deref()
                    .is_none_or(|after| sb.created_at.as_str() > after)
            })
            .collect();
        // A stable order, so a page token (the last id seen) picks up where it left.
        all.sort_by(|a, b| (&a.created_at, &a.id).cmp(&(&b.created_at, &b.id)));
        if desc {
            all.reverse();
        }
        let start = match q.next_token.as_deref().filter(|t| !t.is_empty()) {
            None => 0,
            Some(t) => match all.iter().position(|sb| sb.id == t) {
                Some(i) => i + 1,
                // The marker is gone (destroyed): start after where it sorted.
                None => all
                    .iter()
                    .position(|sb| {
                        if desc {
                            sb.id.as_str() < t
                        } else {
                            sb.id.as_str() > t
                        }
                    })
                    .unwrap_or(all.len()),
            },
        };
        let page: Vec<&Sandbox> = all.iter().skip(start).take(limit).collect();
        let more = start + page.len() < all.len();
        let body: Vec<Value> = page
            .iter()
            .map(|sb| describe(sb, &template_of(st, sb)))
            .collect();
        let mut resp = axum::Json(Value::Array(body)).into_response();
        if paged && more {
            if let Some(last) = page.last() {
                if let Ok(v) = HeaderValue::from_str(&last.id) {
                    resp.headers_mut().insert("x-next-token", v);
                }
            }
        }
        Ok(resp)
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

/// `GET /v2/sandboxes?metadata=&state=&limit=&nextToken=`: a page; the next one's token
/// in `x-next-token`.
pub async fn list_v2(
    State(st): State<E2bState>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> Response {
    list(&st, &headers, q.as_deref(), true).await
}

/// `GET /sandboxes?metadata=`: running sandboxes, unpaged (older SDKs).
pub async fn list_v1(
    State(st): State<E2bState>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> Response {
    list(&st, &headers, q.as_deref(), false).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_filters_are_decoded_twice() {
        // What the Python SDK sends for {"a b": "c&d"}, after the query's own decoding.
        let got = metadata_filter("a%2520b=c%2526d&x=1").unwrap();
        assert_eq!(
            got,
            vec![("a b".into(), "c&d".into()), ("x".into(), "1".into())]
        );
        assert!(metadata_filter("=v").is_err());
    }

    #[test]
    fn only_running_and_paused_are_e2b_states() {
        assert_eq!(e2b_state(SandboxState::Suspended), Some("paused"));
        assert_eq!(e2b_state(SandboxState::Creating), Some("running"));
        assert_eq!(e2b_state(SandboxState::Destroyed), None);
        assert_eq!(e2b_state(SandboxState::Failed), None);
    }
}
