//! The MCP server: space's tools for agents, on rmcp's streamable HTTP transport at
//! `/mcp` (authenticated like `/v1`), and over stdio through `space mcp` (which
//! carries each message to `/mcp`; see `mcp_stdio.rs`). Every tool acts through
//! `Service::for_tenant` with the caller's tenant, like every front door.
//!
//! Results are JSON (`structuredContent`, and the same as text). A tool that fails
//! for a reason the agent can act on (no such sandbox, a sandbox that is not
//! running, a limit) answers an error *result* with `{"error": {code, message}}`;
//! malformed arguments are protocol errors. Output is never returned whole when it
//! is large: at most [`MAX_TOOL_BYTES`] per stream, with `truncated` and the offset
//! to continue from.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use bytes::Bytes;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::tool::Extension;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, Implementation, ServerCapabilities, ServerConfig};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{schemars, tool, tool_handler, tool_router, ErrorData, ServerHandler};
use serde::Deserialize;
use serde_json::{json, Value};
use space_api::{
    CreateCommandRequest, CreateSandboxRequest, NetworkSpec, Operation, OperationStatus, Resources,
    Sandbox, SandboxState,
};
use space_service::files::{DownloadFormat, UploadKind, UploadStream};
use space_service::output::View;
use space_service::{CommandOutputQuery, OutputEvent, Service, ServiceError, Tenant};

/// The most bytes of one stream a tool result carries.
pub const MAX_TOOL_BYTES: usize = 16 << 10;
/// The most bytes `read_file` returns.
pub const MAX_FILE_BYTES: usize = 256 << 10;
/// The most bytes `write_file` takes.
pub const MAX_WRITE_BYTES: usize = 8 << 20;
/// How long a tool waits for a lifecycle operation before it answers with the operation.
const OP_WAIT: Duration = Duration::from_secs(300);

/// The tools, acting for the tenant of each request.
#[derive(Clone)]
pub struct SpaceMcp {
    service: Service,
    tool_router: ToolRouter<Self>,
}

/// The tenant `/mcp`'s authentication put on the request.
#[derive(Clone)]
pub struct McpTenant(pub Tenant);

/// The `/mcp` endpoint (streamable HTTP, stateless, JSON answers).
pub fn http_service(service: Service) -> StreamableHttpService<SpaceMcp, LocalSessionManager> {
    let config = StreamableHttpServerConfig::default()
        // One request, one answer: no session to keep, and a plain JSON body that the
        // stdio bridge (and any HTTP client) can read.
        .with_legacy_session_mode(false)
        .with_json_response(true)
        .with_sse_keep_alive(None)
        // A `write_file` of MAX_WRITE_BYTES, base64 in JSON, fits.
        .with_max_request_body_bytes(MAX_WRITE_BYTES * 3 / 2 + (64 << 10))
        // Every request carries the bearer token, which a page a browser was tricked
        // into loading does not have; the Host check is for unauthenticated servers.
        .disable_allowed_hosts();
    StreamableHttpService::new(
        move || Ok(SpaceMcp::new(service.clone())),
        LocalSessionManager::default().into(),
        config,
    )
}

/// `Authorization: Bearer …` on `/mcp`, as on `/v1`: the tenant goes on the request.
pub async fn auth(State(service): State<Service>, mut req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let principal = match presented.map(|p| service.authenticate(p)) {
        Some(Ok(Some(p))) => p,
        _ => {
            let body = json!({"error": {"code": "unauthorized", "message": "missing, wrong or revoked bearer token"}});
            return (axum::http::StatusCode::UNAUTHORIZED, axum::Json(body)).into_response();
        }
    };
    req.extensions_mut().insert(McpTenant(principal.tenant));
    next.run(req).await
}

type Parts = axum::http::request::Parts;

fn tenant_of(parts: &Parts) -> Result<Tenant, ErrorData> {
    parts
        .extensions
        .get::<McpTenant>()
        .map(|t| t.0.clone())
        .ok_or_else(|| ErrorData::invalid_request("not authenticated", None))
}

/// An error result the agent can act on.
fn failed(e: ServiceError) -> CallToolResult {
    let message = match &e {
        ServiceError::Store(_) | ServiceError::Internal(_) => {
            tracing::warn!(error = %space_service::error_chain(&e), "MCP tool failed");
            "internal error".to_string()
        }
        _ => e.to_string(),
    };
    CallToolResult::structured_error(json!({"error": {"code": e.code(), "message": message}}))
}

fn bad(message: impl Into<String>) -> CallToolResult {
    CallToolResult::structured_error(
        json!({"error": {"code": "invalid_request", "message": message.into()}}),
    )
}

fn done(r: Result<Value, ServiceError>) -> Result<CallToolResult, ErrorData> {
    Ok(match r {
        Ok(v) => CallToolResult::structured(v),
        Err(e) => failed(e),
    })
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxArgs {
    /// Template to start from (default `debian`; `list` them with GET /v1/templates).
    pub template: Option<String>,
    /// Labels to find it by later (`list_sandboxes`).
    pub labels: Option<BTreeMap<String, String>>,
    /// vcpus, memory_mib, disk_mib, pids (the server's defaults otherwise).
    pub resources: Option<ResourcesArgs>,
    /// `{"mode": "none"}` (default: no network) or `{"mode": "egress", "allow": ["pypi.org:443"]}`.
    pub network: Option<NetworkArgs>,
    /// Environment of every command in it.
    pub env: Option<BTreeMap<String, String>>,
    /// Destroy it after this many seconds.
    pub ttl_seconds: Option<u64>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ResourcesArgs {
    pub vcpus: Option<u32>,
    pub memory_mib: Option<u64>,
    pub disk_mib: Option<u64>,
    pub pids: Option<u64>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NetworkArgs {
    /// `none` or `egress`.
    pub mode: String,
    /// With `egress`: `HOST`, `IPv4` or `IPv4/PREFIX`, each optionally `:PORT`.
    pub allow: Option<Vec<String>>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListSandboxesArgs {
    /// Only sandboxes carrying all of these labels.
    pub labels: Option<BTreeMap<String, String>>,
    /// Include destroyed and failed ones (default false).
    pub include_ended: Option<bool>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SandboxArgs {
    pub sandbox_id: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CommandArgs {
    pub sandbox_id: String,
    /// The program and its arguments, run without a shell. Give this or `shell`.
    pub argv: Option<Vec<String>>,
    /// A script for `/bin/sh -c`. Give this or `argv`.
    pub shell: Option<String>,
    /// Working directory (absolute).
    pub cwd: Option<String>,
    pub env: Option<BTreeMap<String, String>>,
    /// Kill it (and everything it started) after this many seconds.
    pub timeout_seconds: Option<u64>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadOutputArgs {
    pub command_id: String,
    /// Byte offset in the stream to read from (0: the start; `next_offset` of the last read).
    pub offset: Option<u64>,
    /// `stdout`, `stderr` or `combined` (default).
    pub stream: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SignalArgs {
    pub command_id: String,
    /// A name (`TERM`, `KILL`, `INT`, `HUP`, …) or a number 1-64.
    pub signal: Value,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteFileArgs {
    pub sandbox_id: String,
    /// Absolute path; missing parent directories are made.
    pub path: String,
    /// The file's text. Give this or `content_base64`.
    pub content: Option<String>,
    /// The file's bytes, base64. Give this or `content`.
    pub content_base64: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PathArgs {
    pub sandbox_id: String,
    /// Absolute path inside the sandbox.
    pub path: String,
}

impl SpaceMcp {
    pub fn new(service: Service) -> Self {
        SpaceMcp {
            service,
            tool_router: Self::tool_router(),
        }
    }
}

impl SpaceMcp {
    /// A lifecycle action (destroy, suspend, resume) for the caller, waited on.
    async fn lifecycle(
        &self,
        parts: &Parts,
        act: impl FnOnce(space_service::TenantService<'_>) -> Result<Operation, ServiceError>,
    ) -> Result<CallToolResult, ErrorData> {
        let tenant = tenant_of(parts)?;
        let svc = &self.service;
        done(
            async {
                let op = act(svc.for_tenant(&tenant))?;
                finish(svc, &tenant, op).await
            }
            .await,
        )
    }
}

/// Waits for `op` to end; its sandbox as it then is.
async fn finish(svc: &Service, tenant: &Tenant, op: Operation) -> Result<Value, ServiceError> {
    let scope = svc.for_tenant(tenant);
    let deadline = tokio::time::Instant::now() + OP_WAIT;
    let mut op = op;
    while !op.status.is_terminal() {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return Ok(
                json!({"operation": op, "note": "still running; the sandbox shows its state in list_sandboxes"}),
            );
        }
        op = scope
            .get_operation(&op.id, left.min(Duration::from_secs(30)))
            .await?;
    }
    if op.status != OperationStatus::Succeeded {
        let e = op.error.clone().unwrap_or_else(|| {
            space_api::ApiError::new(space_api::ErrorCode::Internal, "the operation failed")
        });
        return Err(ServiceError::Api(e));
    }
    match &op.sandbox_id {
        Some(id) => Ok(summary(&scope.get_sandbox(id).await?)),
        None => Ok(json!({"operation": op})),
    }
}

fn summary(sb: &Sandbox) -> Value {
    json!({
        "sandbox_id": sb.id,
        "state": sb.state,
        "template": sb.template,
        "runtime": sb.runtime,
        "labels": sb.labels,
        "resources": sb.resources,
        "created_at": sb.created_at,
        "expires_at": sb.expires_at,
    })
}

/// At most `max` bytes of a command's output from `offset`, as text (or base64 when it
/// is not UTF-8), with where to continue.
async fn read_stream(
    svc: &Service,
    tenant: &Tenant,
    sandbox: &str,
    cid: &str,
    offset: u64,
    view: View,
    max: usize,
) -> Result<Value, ServiceError> {
    let q = CommandOutputQuery {
        offset,
        follow: false,
        view,
    };
    let mut rx = svc.for_tenant(tenant).command_output(sandbox, cid, q)?;
    let mut buf: Vec<u8> = Vec::new();
    let mut more = false;
    let mut ended = None;
    while let Some(ev) = rx.recv().await {
        match ev {
            OutputEvent::Chunk { data, .. } => {
                if buf.len() + data.len() > max {
                    buf.extend_from_slice(&data[..max - buf.len()]);
                    more = true;
                    break;
                }
                buf.extend_from_slice(&data);
            }
            OutputEvent::End(cmd) => {
                ended = Some(cmd);
                break;
            }
        }
    }
    // Text when it is UTF-8; a character cut at the end is left for the next read.
    let (body, used) = match std::str::from_utf8(&buf) {
        Ok(s) => (json!({"data": s}), buf.len()),
        Err(e) if e.error_len().is_none() && e.valid_up_to() > 0 => {
            let s = std::str::from_utf8(&buf[..e.valid_up_to()]).unwrap_or_default();
            more = true;
            (json!({"data": s}), e.valid_up_to())
        }
        Err(_) => (
            json!({"data_base64": base64::engine::general_purpose::STANDARD.encode(&buf)}),
            buf.len(),
        ),
    };
    let mut v = body;
    v["offset"] = json!(offset);
    v["next_offset"] = json!(offset + used as u64);
    v["truncated"] = json!(more);
    if more {
        v["note"] = json!(format!(
            "output cut at {max} bytes; call read_output with offset {} for more",
            offset + used as u64
        ));
    }
    if let (false, Some(cmd)) = (more, ended) {
        v["result"] = json!(cmd.result);
        v["state"] = json!(cmd.state);
    }
    Ok(v)
}

#[tool_router]
impl SpaceMcp {
    #[tool(
        description = "Create a sandbox (an isolated Linux machine) and wait until it runs. Returns its sandbox_id. Commands run as root; the network is off unless `network` allows hosts."
    )]
    async fn create_sandbox(
        &self,
        Parameters(a): Parameters<CreateSandboxArgs>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        let tenant = tenant_of(&parts)?;
        let req = CreateSandboxRequest {
            template: a.template.unwrap_or_else(|| "debian".into()),
            labels: a.labels,
            env: a.env,
            ttl_seconds: a.ttl_seconds,
            resources: a.resources.map(|r| Resources {
                vcpus: r.vcpus,
                memory_mib: r.memory_mib,
                disk_mib: r.disk_mib,
                pids: r.pids,
            }),
            network: a.network.map(|n| NetworkSpec {
                mode: n.mode,
                allow: n.allow,
                resolved: None,
            }),
            ..Default::default()
        };
        let svc = &self.service;
        done(
            async {
                let op = svc.for_tenant(&tenant).create_sandbox(req).await?;
                finish(svc, &tenant, op).await
            }
            .await,
        )
    }

    #[tool(
        description = "List your sandboxes (running, paused and suspended; `include_ended` adds destroyed and failed ones), optionally only those with all of `labels`."
    )]
    async fn list_sandboxes(
        &self,
        Parameters(a): Parameters<ListSandboxesArgs>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        let tenant = tenant_of(&parts)?;
        let labels: Vec<(String, String)> = a.labels.unwrap_or_default().into_iter().collect();
        let all = a.include_ended.unwrap_or(false);
        done(
            self.service
                .for_tenant(&tenant)
                .list_sandboxes(labels)
                .await
                .map(|list| {
                    let items: Vec<Value> = list
                        .iter()
                        .filter(|s| {
                            all || !matches!(
                                s.state,
                                SandboxState::Destroyed | SandboxState::Failed
                            )
                        })
                        .map(summary)
                        .collect();
                    json!({"sandboxes": items})
                }),
        )
    }

    #[tool(description = "Destroy a sandbox and everything in it; waits until it is gone.")]
    async fn destroy_sandbox(
        &self,
        Parameters(a): Parameters<SandboxArgs>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        self.lifecycle(&parts, |scope| scope.destroy_sandbox(&a.sandbox_id))
            .await
    }

    #[tool(
        description = "Suspend a sandbox to a snapshot on disk (frees its memory; its files and processes come back on resume_sandbox)."
    )]
    async fn suspend_sandbox(
        &self,
        Parameters(a): Parameters<SandboxArgs>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        self.lifecycle(&parts, |scope| scope.suspend(&a.sandbox_id))
            .await
    }

    #[tool(description = "Resume a paused or suspended sandbox; waits until it runs.")]
    async fn resume_sandbox(
        &self,
        Parameters(a): Parameters<SandboxArgs>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        self.lifecycle(&parts, |scope| scope.resume(&a.sandbox_id))
            .await
    }

    #[tool(
        description = "Run a command in a sandbox and wait for it to end. Returns exit_code (or signal, timed_out, oom_killed), stdout and stderr. Each stream comes back cut at 16 KiB with `truncated: true` and the offset to continue from with read_output."
    )]
    async fn run_command(
        &self,
        Parameters(a): Parameters<CommandArgs>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        let tenant = tenant_of(&parts)?;
        let sandbox = a.sandbox_id.clone();
        let req = match command_request(a, true) {
            Ok(r) => r,
            Err(m) => return Ok(bad(m)),
        };
        let svc = &self.service;
        done(
            async {
                let cmd = svc
                    .for_tenant(&tenant)
                    .create_command(&sandbox, req)
                    .await?;
                let out = read_stream(
                    svc,
                    &tenant,
                    &sandbox,
                    &cmd.id,
                    0,
                    View::Stdout,
                    MAX_TOOL_BYTES,
                )
                .await?;
                let err = read_stream(
                    svc,
                    &tenant,
                    &sandbox,
                    &cmd.id,
                    0,
                    View::Stderr,
                    MAX_TOOL_BYTES,
                )
                .await?;
                let r = cmd.result.clone().unwrap_or_default();
                Ok(json!({
                    "command_id": cmd.id,
                    "state": cmd.state,
                    "exit_code": r.exit_code,
                    "signal": r.signal,
                    "timed_out": r.timed_out,
                    "oom_killed": r.oom_killed,
                    "duration_ms": r.duration_ms,
                    "stdout": out,
                    "stderr": err,
                    "output_truncated_by_server": r.output_truncated,
                }))
            }
            .await,
        )
    }

    #[tool(
        description = "Start a command in a sandbox and return its command_id at once; read its output with read_output, stop it with send_signal."
    )]
    async fn start_command(
        &self,
        Parameters(a): Parameters<CommandArgs>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        let tenant = tenant_of(&parts)?;
        let sandbox = a.sandbox_id.clone();
        let req = match command_request(a, false) {
            Ok(r) => r,
            Err(m) => return Ok(bad(m)),
        };
        done(
            self.service
                .for_tenant(&tenant)
                .create_command(&sandbox, req)
                .await
                .map(|c| json!({"command_id": c.id, "sandbox_id": c.sandbox_id, "state": c.state, "pid": c.pid})),
        )
    }

    #[tool(
        description = "Read a command's output from a byte offset (at most 16 KiB a call; continue from next_offset). Once the command has ended and all output is read, `result` holds its exit code."
    )]
    async fn read_output(
        &self,
        Parameters(a): Parameters<ReadOutputArgs>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        let tenant = tenant_of(&parts)?;
        let view = match a.stream.as_deref() {
            None | Some("combined") => View::Combined,
            Some("stdout") => View::Stdout,
            Some("stderr") => View::Stderr,
            Some(_) => return Ok(bad("stream is stdout, stderr or combined")),
        };
        let svc = &self.service;
        done(
            async {
                let cmd = svc.for_tenant(&tenant).find_command(&a.command_id).await?;
                let mut v = read_stream(
                    svc,
                    &tenant,
                    &cmd.sandbox_id,
                    &cmd.id,
                    a.offset.unwrap_or(0),
                    view,
                    MAX_TOOL_BYTES,
                )
                .await?;
                v["command_id"] = json!(cmd.id);
                if v.get("state").is_none() {
                    v["state"] = json!(cmd.state);
                }
                Ok(v)
            }
            .await,
        )
    }

    #[tool(
        description = "Send a signal (TERM, KILL, INT, HUP, … or a number) to a running command and everything it started."
    )]
    async fn send_signal(
        &self,
        Parameters(a): Parameters<SignalArgs>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        let tenant = tenant_of(&parts)?;
        let Some(sig) = crate::api::parse_signal(&a.signal) else {
            return Ok(bad(
                "signal is a name such as TERM, KILL, INT, HUP, or a number 1-64",
            ));
        };
        let svc = &self.service;
        done(
            async {
                let scope = svc.for_tenant(&tenant);
                let cmd = scope.find_command(&a.command_id).await?;
                let cmd = scope.signal_command(&cmd.sandbox_id, &cmd.id, sig).await?;
                Ok(json!({"command_id": cmd.id, "state": cmd.state}))
            }
            .await,
        )
    }

    #[tool(
        description = "Write a file in a sandbox (text in `content`, or bytes in `content_base64`, at most 8 MiB); missing parent directories are made."
    )]
    async fn write_file(
        &self,
        Parameters(a): Parameters<WriteFileArgs>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        let tenant = tenant_of(&parts)?;
        let bytes = match (a.content, a.content_base64) {
            (Some(t), None) => Bytes::from(t),
            (None, Some(b)) => match base64::engine::general_purpose::STANDARD.decode(b.trim()) {
                Ok(v) => Bytes::from(v),
                Err(_) => return Ok(bad("content_base64 is not base64")),
            },
            _ => return Ok(bad("give exactly one of content and content_base64")),
        };
        if bytes.len() > MAX_WRITE_BYTES {
            return Ok(bad(format!(
                "at most {MAX_WRITE_BYTES} bytes per write_file"
            )));
        }
        let len = bytes.len() as u64;
        let body: UploadStream = Box::pin(futures::stream::once(async move { Ok(bytes) }));
        let kind = UploadKind::File {
            mode: None,
            uid: None,
            gid: None,
        };
        done(
            self.service
                .for_tenant(&tenant)
                .upload_file(&a.sandbox_id, &a.path, kind, true, Some(len), body)
                .await
                .map(|u| match u {
                    space_service::files::Uploaded::File(info) => json!({"written": info}),
                    space_service::files::Uploaded::Archive(stats) => json!({"written": stats}),
                }),
        )
    }

    #[tool(
        description = "Read a file from a sandbox: text, or `content_base64` when it is not UTF-8; at most 256 KiB (larger files come back cut, with `truncated: true`)."
    )]
    async fn read_file(
        &self,
        Parameters(a): Parameters<PathArgs>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        use futures::StreamExt;
        let tenant = tenant_of(&parts)?;
        let svc = &self.service;
        done(async {
            let d = svc
                .for_tenant(&tenant)
                .download_file(&a.sandbox_id, &a.path, DownloadFormat::Raw)
                .await?;
            let mut body = http_body_util::BodyDataStream::new(d.body);
            let mut buf = Vec::new();
            let mut truncated = false;
            while let Some(chunk) = body.next().await {
                let chunk = chunk.map_err(|e| ServiceError::Unavailable(format!("reading the file: {e}")))?;
                if buf.len() + chunk.len() > MAX_FILE_BYTES {
                    buf.extend_from_slice(&chunk[..MAX_FILE_BYTES - buf.len()]);
                    truncated = true;
                    break;
                }
                buf.extend_from_slice(&chunk);
            }
            let mut v = match String::from_utf8(buf) {
                Ok(s) => json!({"content": s}),
                Err(e) => json!({"content_base64": base64::engine::general_purpose::STANDARD.encode(e.as_bytes())}),
            };
            v["path"] = json!(a.path);
            v["size"] = json!(d.size);
            v["truncated"] = json!(truncated);
            Ok(v)
        }
        .await)
    }

    #[tool(
        description = "List a directory of a sandbox: name, type, size, mode and mtime of each entry."
    )]
    async fn list_files(
        &self,
        Parameters(a): Parameters<PathArgs>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        let tenant = tenant_of(&parts)?;
        done(
            self.service
                .for_tenant(&tenant)
                .list_files(&a.sandbox_id, &a.path, Some(1))
                .await
                .map(|l| json!(l)),
        )
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for SpaceMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("space", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "space runs code in isolated Linux sandboxes. create_sandbox, then run_command \
                 (or start_command + read_output), write_file/read_file/list_files, and \
                 destroy_sandbox when done. Output and files come back cut at a size limit with \
                 the offset to continue from.",
            )
    }
}

/// The service's command request from the tool's arguments.
fn command_request(a: CommandArgs, wait: bool) -> Result<CreateCommandRequest, String> {
    let (argv, shell) = match (a.argv, a.shell) {
        (Some(v), None) if !v.is_empty() => (Some(v), None),
        (None, Some(s)) if !s.is_empty() => (None, Some(s)),
        _ => return Err("give exactly one of argv (a non-empty list) and shell (a script)".into()),
    };
    Ok(CreateCommandRequest {
        argv,
        shell,
        cwd: a.cwd,
        env: a.env,
        timeout_seconds: a.timeout_seconds,
        wait: Some(wait),
        ..Default::default()
    })
}
