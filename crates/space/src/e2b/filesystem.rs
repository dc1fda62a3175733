//! envd's `filesystem.Filesystem` service over the service's file calls (the agent
//! resolves every path inside the sandbox, never following a link out of it).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::Response;
use serde::Deserialize;
use serde_json::{json, Value};
use space_api::{FileType, MkdirRequest, MoveRequest};
use space_service::{FsEvent, FsEventKind, Tenant};

use super::connect::{self, RpcError};
use super::{basic_user, entry_info, envd_caller, resolve_path, E2bState, Watcher};

/// Watchers of one tenant at most (each also holds one of its open streams).
const MAX_WATCHERS_PER_TENANT: usize = 64;
/// A watcher nobody has read for this long is dropped.
const WATCHER_IDLE: Duration = Duration::from_secs(600);
/// How long a `WatchDir` stream waits between looks, and between keepalives.
const WATCH_WAIT: Duration = Duration::from_secs(15);

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct PathRequest {
    path: String,
    depth: Option<u32>,
    recursive: bool,
    include_entry: bool,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct MoveReq {
    source: String,
    destination: String,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct WatcherRequest {
    watcher_id: String,
}

/// `POST /filesystem.Filesystem/{method}`.
pub async fn call(
    State(st): State<E2bState>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let streaming = method == "WatchDir";
    let (tenant, sandbox) = match envd_caller(&st, &headers).await {
        Ok(c) => c,
        Err(r) => return r.into_response(),
    };
    if streaming {
        return match connect::read_single::<PathRequest>(&headers, body).await {
            Ok(req) => watch_stream(st, tenant, sandbox, &headers, req).await,
            Err(e) => connect::stream_error(e),
        };
    }
    connect::unary(unary(&st, &tenant, &sandbox, &method, &headers, body).await)
}

async fn unary(
    st: &E2bState,
    tenant: &Tenant,
    sandbox: &str,
    method: &str,
    headers: &HeaderMap,
    body: Body,
) -> Result<Value, RpcError> {
    let scope = st.service.for_tenant(tenant);
    let user = basic_user(headers)?;
    let user = user.as_deref();
    match method {
        "Stat" => {
            let req: PathRequest = connect::read_unary(headers, body).await?;
            let path = resolve_path(&req.path, user)?;
            let info = scope.stat_file(sandbox, &path).await?;
            Ok(json!({ "entry": entry_info(&info) }))
        }
        "ListDir" => {
            let req: PathRequest = connect::read_unary(headers, body).await?;
            let path = resolve_path(&req.path, user)?;
            let depth = req.depth.unwrap_or(1).max(1);
            let info = scope.stat_file(sandbox, &path).await?;
            if info.kind != FileType::Dir {
                return Err(RpcError::invalid(format!("{path} is not a directory")));
            }
            let listing = scope.list_files(sandbox, &path, Some(depth)).await?;
            let entries: Vec<Value> = listing.entries.iter().map(entry_info).collect();
            Ok(json!({ "entries": entries }))
        }
        "MakeDir" => {
            let req: PathRequest = connect::read_unary(headers, body).await?;
            let path = resolve_path(&req.path, user)?;
            if scope.stat_file(sandbox, &path).await.is_ok() {
                return Err(RpcError::new(
                    "already_exists",
                    format!("{} already exists", space_api::truncate(&path, 256)),
                ));
            }
            let info = scope
                .mkdir(
                    sandbox,
                    &MkdirRequest {
                        path,
                        ..Default::default()
                    },
                )
                .await?;
            Ok(json!({ "entry": entry_info(&info) }))
        }
        "Move" => {
            let req: MoveReq = connect::read_unary(headers, body).await?;
            let from = resolve_path(&req.source, user)?;
            let to = resolve_path(&req.destination, user)?;
            let info = scope
                .move_file(
                    sandbox,
                    &MoveRequest {
                        from,
                        to,
                        overwrite: Some(true),
                    },
                )
                .await?;
            Ok(json!({ "entry": entry_info(&info) }))
        }
        "Remove" => {
            let req: PathRequest = connect::read_unary(headers, body).await?;
            let path = resolve_path(&req.path, user)?;
            scope.remove_file(sandbox, &path, true).await?;
            Ok(json!({}))
        }
        "CreateWatcher" => {
            let req: PathRequest = connect::read_unary(headers, body).await?;
            let path = resolve_path(&req.path, user)?;
            create_watcher(st, tenant, sandbox, &path, req.recursive).await
        }
        "GetWatcherEvents" => {
            let req: WatcherRequest = connect::read_unary(headers, body).await?;
            let dir = watcher(st, tenant, sandbox, &req.watcher_id)?;
            let events = dir.lock().await.changes().await?;
            let events: Vec<Value> = events.iter().map(|e| event_json(e, true)).collect();
            Ok(json!({ "events": events }))
        }
        "RemoveWatcher" => {
            let req: WatcherRequest = connect::read_unary(headers, body).await?;
            watcher(st, tenant, sandbox, &req.watcher_id)?;
            lock(st).remove(&req.watcher_id);
            Ok(json!({}))
        }
        _ => Err(RpcError::new(
            "unimplemented",
            format!(
                "filesystem.Filesystem/{} is not a method",
                space_api::truncate(method, 64)
            ),
        )),
    }
}

fn lock(st: &E2bState) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Watcher>> {
    st.watchers.lock().unwrap_or_else(|e| e.into_inner())
}

async fn create_watcher(
    st: &E2bState,
    tenant: &Tenant,
    sandbox: &str,
    path: &str,
    recursive: bool,
) -> Result<Value, RpcError> {
    {
        let mut all = lock(st);
        all.retain(|_, w| w.used.elapsed() < WATCHER_IDLE);
        let mine = all.values().filter(|w| &w.tenant == tenant).count();
        if mine >= MAX_WATCHERS_PER_TENANT {
            return Err(RpcError::new(
                "resource_exhausted",
                format!("at most {MAX_WATCHERS_PER_TENANT} watchers at a time"),
            ));
        }
    }
    let dir = st
        .service
        .for_tenant(tenant)
        .watch_dir(sandbox, path, recursive)
        .await?;
    let id = space_core::new_id("watch");
    lock(st).insert(
        id.clone(),
        Watcher {
            tenant: tenant.clone(),
            sandbox: sandbox.to_string(),
            dir: Arc::new(tokio::sync::Mutex::new(dir)),
            used: Instant::now(),
        },
    );
    Ok(json!({ "watcherId": id }))
}

/// The caller's watcher of this sandbox, or the one 404 for any other id.
fn watcher(
    st: &E2bState,
    tenant: &Tenant,
    sandbox: &str,
    id: &str,
) -> Result<Arc<tokio::sync::Mutex<space_service::DirWatcher>>, RpcError> {
    let mut all = lock(st);
    all.retain(|_, w| w.used.elapsed() < WATCHER_IDLE);
    match all.get_mut(id) {
        Some(w) if &w.tenant == tenant && w.sandbox == sandbox => {
            w.used = Instant::now();
            Ok(w.dir.clone())
        }
        _ => Err(RpcError::not_found(format!(
            "no watcher {}",
            space_api::truncate(id, 64)
        ))),
    }
}

fn event_json(e: &FsEvent, include_entry: bool) -> Value {
    let kind = match e.kind {
        FsEventKind::Create => "EVENT_TYPE_CREATE",
        FsEventKind::Write => "EVENT_TYPE_WRITE",
        FsEventKind::Remove => "EVENT_TYPE_REMOVE",
        FsEventKind::Chmod => "EVENT_TYPE_CHMOD",
    };
    let mut v = json!({ "name": e.name, "type": kind });
    if let (true, Some(entry)) = (include_entry, &e.entry) {
        v["entry"] = entry_info(entry);
    }
    v
}

async fn watch_stream(
    st: E2bState,
    tenant: Tenant,
    sandbox: String,
    headers: &HeaderMap,
    req: PathRequest,
) -> Response {
    let user = match basic_user(headers) {
        Ok(u) => u,
        Err(e) => return connect::stream_error(e),
    };
    let path = match resolve_path(&req.path, user.as_deref()) {
        Ok(p) => p,
        Err(e) => return connect::stream_error(e),
    };
    let mut dir = match st
        .service
        .for_tenant(&tenant)
        .watch_dir(&sandbox, &path, req.recursive)
        .await
    {
        Ok(d) => d,
        Err(e) => return connect::stream_error(e.into()),
    };
    let (tx, resp) = connect::stream_response();
    tokio::spawn(async move {
        if !tx.send(json!({ "start": {} })).await {
            return;
        }
        let err = loop {
            let changes = tokio::select! {
                c = dir.next(WATCH_WAIT) => c,
                _ = tx.closed() => return,
            };
            match changes {
                Ok(c) if c.is_empty() => {
                    if !tx.send(json!({ "keepalive": {} })).await {
                        return;
                    }
                }
                Ok(c) => {
                    for e in &c {
                        if !tx
                            .send(json!({ "filesystem": event_json(e, req.include_entry) }))
                            .await
                        {
                            return;
                        }
                    }
                }
                Err(e) => break RpcError::from(e),
            }
        };
        tx.end(Some(err)).await;
    });
    resp
}
