//! The E2B-compatible front door: E2B's control plane (`/v2/sandboxes`, …) and its
//! in-sandbox daemon's API (envd: Connect RPCs, `/files`, `/health`) on the same
//! listener as `/v1`, so the unmodified E2B SDKs work with `E2B_API_URL` and
//! `E2B_SANDBOX_URL` pointing here. Every call goes through the tenant-scoped
//! service, like `/v1`'s: ownership, limits, quotas and file safety are checked
//! there. See docs/E2B.md for what maps to what.

mod connect;
mod control;
mod files;
mod filesystem;
mod interpreter;
mod process;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use base64::Engine;
use serde_json::{json, Value};
use space_api::{FileInfo, FileType, SandboxState};
use space_service::{DirWatcher, Service, Tenant};

use crate::api::AppState;
use connect::RpcError;

/// The envd version reported to the SDKs: what this front door implements (streamed
/// and gzip octet-stream uploads arrived in 0.5.7; file metadata in 0.6.2 does not).
pub const ENVD_VERSION: &str = "0.5.7";

/// State of the E2B front door: the service, and the open non-streaming watchers.
#[derive(Clone)]
pub struct E2bState {
    pub service: Service,
    /// The template `base` (E2B's default) stands for.
    pub default_template: Arc<str>,
    watchers: Arc<Mutex<HashMap<String, Watcher>>>,
}

struct Watcher {
    tenant: Tenant,
    sandbox: String,
    dir: Arc<tokio::sync::Mutex<DirWatcher>>,
    used: Instant,
}

impl E2bState {
    pub fn new(service: Service, default_template: &str) -> Self {
        E2bState {
            service,
            default_template: default_template.into(),
            watchers: Arc::default(),
        }
    }
}

pub fn router(state: E2bState) -> Router<AppState> {
    let envd = Router::new()
        .route("/health", get(files::health))
        // An upload is bounded by the service (--max-upload-mib), not by axum's 2 MB
        // default for buffered bodies (which multipart parsing would apply).
        .route(
            "/files",
            get(files::download)
                .post(files::upload)
                .layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route("/process.Process/:method", post(process::call))
        .route("/filesystem.Filesystem/:method", post(filesystem::call))
        // The code interpreter (port 49999 at E2B).
        .route("/execute", post(interpreter::execute))
        .route(
            "/contexts",
            post(interpreter::create).get(interpreter::list),
        )
        .route("/contexts/:ctx", axum::routing::delete(interpreter::delete))
        .route("/contexts/:ctx/restart", post(interpreter::restart));
    let control = Router::new()
        .route("/v2/sandboxes", post(control::create).get(control::list_v2))
        .route("/sandboxes", post(control::create).get(control::list_v1))
        .route(
            "/sandboxes/:id",
            get(control::get_info).delete(control::kill),
        )
        .route("/v2/sandboxes/:id/connect", post(control::connect))
        .route("/sandboxes/:id/connect", post(control::connect))
        .route("/sandboxes/:id/resume", post(control::resume))
        .route("/sandboxes/:id/timeout", post(control::set_timeout))
        .route("/sandboxes/:id/refreshes", post(control::refresh))
        .route("/sandboxes/:id/pause", post(control::pause))
        .route("/sandboxes/:id/metrics", get(control::metrics));
    envd.merge(control).with_state(state)
}

/// An error of the E2B control plane or of envd's plain HTTP routes:
/// `{"code": <status>, "message"}`.
#[derive(Debug)]
pub(crate) struct E2bError {
    pub status: StatusCode,
    pub message: String,
}

impl E2bError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        E2bError {
            status,
            message: message.into(),
        }
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let body = json!({ "code": self.status.as_u16(), "message": self.message });
        (self.status, axum::Json(body)).into_response()
    }
}

/// Why an envd request is refused before it reaches the service.
pub(crate) enum Refused {
    /// Missing or wrong token: 401.
    Token(RpcError),
    /// The sandbox is gone or not running: 502 with `{"code": 502, "message"}`, which is
    /// how E2B's proxy answers for a sandbox it cannot reach (the SDKs' `is_running()`
    /// reads "was not found" as a killed sandbox).
    Unreachable(String),
}

impl Refused {
    pub(crate) fn into_response(self) -> Response {
        match self {
            Refused::Token(e) => e.into_response(),
            Refused::Unreachable(message) => {
                let body = json!({ "code": 502, "message": message });
                (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response()
            }
        }
    }
}

/// Who an envd request acts for: the sandbox in `E2b-Sandbox-Id` and the tenant its
/// `X-Access-Token` was issued to (the service checks it; 401 otherwise), once the
/// sandbox is known to run.
pub(crate) async fn envd_caller(
    st: &E2bState,
    headers: &HeaderMap,
) -> Result<(Tenant, String), Refused> {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let Some(sandbox) = header("e2b-sandbox-id")
        .map(str::trim)
        .filter(|s| !s.is_empty())
    else {
        return Err(Refused::Token(RpcError::new(
            "unauthenticated",
            "an E2b-Sandbox-Id header names the sandbox",
        )));
    };
    // The code interpreter's SDK sends the same token as a traffic token on some routes.
    let token = header("x-access-token").or_else(|| header("e2b-traffic-access-token"));
    let tenant = st
        .service
        .authenticate_access_token(sandbox, token)
        .await
        .map_err(|e| Refused::Token(e.into()))?;
    let gone = || Refused::Unreachable(format!("The sandbox {sandbox} was not found"));
    match st.service.for_tenant(&tenant).get_sandbox(sandbox).await {
        Ok(sb) => match sb.state {
            SandboxState::Running => Ok((tenant, sandbox.to_string())),
            SandboxState::Destroying | SandboxState::Destroyed | SandboxState::Failed => {
                Err(gone())
            }
            state => Err(Refused::Unreachable(format!(
                "The sandbox {sandbox} is {state}, not running; connect resumes a paused sandbox"
            ))),
        },
        Err(_) => Err(gone()),
    }
}

/// The user envd requests name: `Authorization: Basic base64(user:)` (the SDKs), or
/// `username` in the query of `/files`.
pub(crate) fn basic_user(headers: &HeaderMap) -> Result<Option<String>, RpcError> {
    let Some(v) = headers.get(axum::http::header::AUTHORIZATION) else {
        return Ok(None);
    };
    let bad = || RpcError::invalid("Authorization must be Basic base64(user:)");
    let v = v.to_str().map_err(|_| bad())?;
    let Some(b64) = v.strip_prefix("Basic ") else {
        return Err(bad());
    };
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|_| bad())?;
    let raw = String::from_utf8(raw).map_err(|_| bad())?;
    let user = raw.split(':').next().unwrap_or("").trim();
    Ok((!user.is_empty()).then(|| user.to_string()))
}

/// Home directory of `user`, where envd resolves relative paths.
pub(crate) fn home_of(user: Option<&str>) -> String {
    match user {
        None | Some("root") => "/root".into(),
        Some(u) => format!("/home/{u}"),
    }
}

/// `path` made absolute the way envd does: relative to the user's home, `~` too.
pub(crate) fn resolve_path(path: &str, user: Option<&str>) -> Result<String, RpcError> {
    if path.is_empty() {
        return Err(RpcError::invalid("path is empty"));
    }
    if path.starts_with('/') {
        return Ok(path.to_string());
    }
    let home = home_of(user);
    let rest = path.strip_prefix('~').map(|r| r.trim_start_matches('/'));
    Ok(match rest {
        Some("") => home,
        Some(r) => format!("{home}/{r}"),
        None => format!("{home}/{path}"),
    })
}

fn permissions_string(kind: FileType, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        FileType::Dir => 'd',
        FileType::Symlink => 'L',
        _ => '-',
    });
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

fn owner_name(id: u32) -> String {
    match id {
        0 => "root".into(),
        n => n.to_string(),
    }
}

fn file_type_name(kind: FileType) -> &'static str {
    match kind {
        FileType::File => "FILE_TYPE_FILE",
        FileType::Dir => "FILE_TYPE_DIRECTORY",
        FileType::Symlink => "FILE_TYPE_SYMLINK",
        _ => "FILE_TYPE_UNSPECIFIED",
    }
}

/// A file as envd's `EntryInfo` in protobuf JSON (int64 as a string, enums by name).
pub(crate) fn entry_info(f: &FileInfo) -> Value {
    let modified = time::OffsetDateTime::from_unix_timestamp(f.mtime)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| "1970-01-01T00:00:00Z".into());
    let mut v = json!({
        "name": f.name,
        "type": file_type_name(f.kind),
        "path": f.path,
        "size": f.size.to_string(),
        "mode": f.mode & 0o7777 | kind_bits(f.kind),
        "permissions": permissions_string(f.kind, f.mode),
        "owner": owner_name(f.uid),
        "group": owner_name(f.gid),
        "modifiedTime": modified,
    });
    if let Some(t) = &f.link_target {
        v["symlinkTarget"] = json!(t);
    }
    v
}

/// Go's `os.FileMode` type bits, which envd's `mode` carries.
fn kind_bits(kind: FileType) -> u32 {
    match kind {
        FileType::Dir => 1 << 31,
        FileType::Symlink => 1 << 27,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_resolve_in_the_users_home() {
        assert_eq!(resolve_path("a/b", None).unwrap(), "/root/a/b");
        assert_eq!(resolve_path("~", Some("user")).unwrap(), "/home/user");
        assert_eq!(resolve_path("~/x", Some("user")).unwrap(), "/home/user/x");
        assert_eq!(resolve_path("/etc", Some("user")).unwrap(), "/etc");
        assert!(resolve_path("", None).is_err());
    }

    #[test]
    fn basic_auth_names_the_user() {
        let mut h = HeaderMap::new();
        assert_eq!(basic_user(&h).unwrap(), None);
        h.insert("authorization", "Basic cm9vdDo=".parse().unwrap());
        assert_eq!(basic_user(&h).unwrap().as_deref(), Some("root"));
        h.insert("authorization", "Bearer x".parse().unwrap());
        assert!(basic_user(&h).is_err());
    }

    #[test]
    fn permissions_read_like_ls() {
        assert_eq!(permissions_string(FileType::Dir, 0o755), "drwxr-xr-x");
        assert_eq!(permissions_string(FileType::File, 0o640), "-rw-r-----");
    }
}
