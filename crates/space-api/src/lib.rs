//! Wire types of the space HTTP API, v1: request bodies (which reject unknown
//! fields), resources as the server returns them, and the error envelope.
//! Shared by the server, the CLI and the tests. Field names are fixed by
//! `DESIGN.md` §2: add fields, rename none.

use std::collections::BTreeMap;

pub use schemars;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `{"error":{"code","message"}}`, the body of every error response.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct ErrorBody {
    pub error: ApiError,
}

/// An error: a stable, machine-readable `code` and a human-readable `message`. The same
/// shape is the body of every error response (`{"error": …}`) and a failed operation's
/// `error`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
        }
    }
}

/// The longest prefix of `s` that fits in `max` bytes and ends on a character boundary:
/// how untrusted or long text (a name, an agent's message) is bounded before it goes into an
/// error message or a log line.
pub fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

macro_rules! string_enum {
    ($(#[$m:meta])* $name:ident { $($variant:ident => $s:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
        pub enum $name { $(#[serde(rename = $s)] $variant),+ }
        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];
            pub fn as_str(self) -> &'static str { match self { $($name::$variant => $s),+ } }
            pub fn parse(s: &str) -> Option<Self> { match s { $($s => Some($name::$variant),)+ _ => None } }
        }
        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { f.pad(self.as_str()) }
        }
    };
}

string_enum!(
    /// Every error code the API answers with, in an error response and in a failed
    /// operation. Codes are stable: clients may match on them; new ones may be added.
    ///
    /// Request errors: `invalid_request` (400, the body or a value is wrong),
    /// `invalid_json` (400), `invalid_query` (400), `invalid_header` (400), `invalid_path`
    /// (400, a file path), `invalid_signal` (400), `unauthorized` (401), `forbidden` (403),
    /// `not_found` (404: also another tenant's object), `method_not_allowed` (405),
    /// `conflict` (409: the object's state forbids it now), `invalid_transition` (409: the
    /// sandbox's state machine forbids it), `body_too_large` and `too_large` (413: the
    /// request body; an upload past `--max-upload-mib`), `unsupported_media_type` (415),
    /// `too_many_requests` (429: a limit; see `Retry-After`), `internal` (500),
    /// `agent_error` (502: the sandbox's agent answered something unusable), `unavailable`
    /// (503: the sandbox's agent is not reachable now; retry), `agent_timeout` (504 for a
    /// request; in an operation: the agent did not connect in time).
    ///
    /// File API errors (from inside the sandbox): `not_a_file` (400: a directory where a
    /// file was meant, or the other way round), `forbidden_path` (403: `/.space`, `/proc`,
    /// `/sys`, `/dev`, also through links), `unsafe_archive` (400: a tar entry that would
    /// leave its directory), `no_space` (507: the sandbox's disk is full).
    ///
    /// Operation errors: `timed_out` (past the operation's deadline), `cancelled`,
    /// `agent_unavailable`, `agent_busy` (a suspend could not take the agent's connection),
    /// `template_unavailable`, `runtime_unavailable`, `runtime_failed`, `start_failed` (a
    /// template's start command or ready check failed), `snapshot_failed`, `build_failed`,
    /// `network_failed`, `interrupted` (the server stopped in the middle).
    ErrorCode {
        InvalidRequest => "invalid_request",
        InvalidJson => "invalid_json",
        InvalidQuery => "invalid_query",
        InvalidHeader => "invalid_header",
        InvalidPath => "invalid_path",
        InvalidSignal => "invalid_signal",
        Unauthorized => "unauthorized",
        Forbidden => "forbidden",
        NotFound => "not_found",
        MethodNotAllowed => "method_not_allowed",
        Conflict => "conflict",
        InvalidTransition => "invalid_transition",
        BodyTooLarge => "body_too_large",
        TooLarge => "too_large",
        UnsupportedMediaType => "unsupported_media_type",
        TooManyRequests => "too_many_requests",
        Internal => "internal",
        AgentError => "agent_error",
        Unavailable => "unavailable",
        AgentTimeout => "agent_timeout",
        NotAFile => "not_a_file",
        ForbiddenPath => "forbidden_path",
        UnsafeArchive => "unsafe_archive",
        NoSpace => "no_space",
        TimedOut => "timed_out",
        Cancelled => "cancelled",
        AgentUnavailable => "agent_unavailable",
        AgentBusy => "agent_busy",
        TemplateUnavailable => "template_unavailable",
        RuntimeUnavailable => "runtime_unavailable",
        RuntimeFailed => "runtime_failed",
        StartFailed => "start_failed",
        SnapshotFailed => "snapshot_failed",
        BuildFailed => "build_failed",
        NetworkFailed => "network_failed",
        Interrupted => "interrupted",
    }
);

impl ErrorCode {
    /// The HTTP status a response with this code has (the list above). Codes that
    /// only fail operations have the status they would have as an answer.
    pub fn http_status(self) -> u16 {
        use ErrorCode::*;
        match self {
            InvalidRequest | InvalidJson | InvalidQuery | InvalidHeader | InvalidPath
            | InvalidSignal | NotAFile | UnsafeArchive | TemplateUnavailable => 400,
            Unauthorized => 401,
            Forbidden | ForbiddenPath => 403,
            NotFound => 404,
            MethodNotAllowed => 405,
            Conflict | InvalidTransition | AgentBusy | Cancelled => 409,
            BodyTooLarge | TooLarge => 413,
            UnsupportedMediaType => 415,
            TooManyRequests => 429,
            Internal | RuntimeFailed | StartFailed | SnapshotFailed | BuildFailed
            | NetworkFailed | Interrupted => 500,
            AgentError => 502,
            Unavailable | AgentUnavailable | RuntimeUnavailable => 503,
            AgentTimeout | TimedOut => 504,
            NoSpace => 507,
        }
    }
}

string_enum!(
    /// Lifecycle state of a sandbox (`DESIGN.md` §1).
    SandboxState {
        Creating => "creating",
        Running => "running",
        Pausing => "pausing",
        Paused => "paused",
        Resuming => "resuming",
        Suspending => "suspending",
        Suspended => "suspended",
        Destroying => "destroying",
        Destroyed => "destroyed",
        Failed => "failed",
    }
);

string_enum!(
    /// What an operation does.
    OperationKind {
        Create => "create",
        Pause => "pause",
        Resume => "resume",
        Suspend => "suspend",
        Destroy => "destroy",
        Build => "build",
    }
);

string_enum!(
    /// Progress of an operation.
    OperationStatus {
        Pending => "pending",
        Running => "running",
        Succeeded => "succeeded",
        Failed => "failed",
        Cancelled => "cancelled",
    }
);

string_enum!(
    /// State of a command session.
    CommandState {
        Starting => "starting",
        Running => "running",
        Exited => "exited",
        Killed => "killed",
        TimedOut => "timed_out",
        Lost => "lost",
    }
);

impl SandboxState {
    /// States a sandbox never leaves.
    pub fn is_terminal(self) -> bool {
        matches!(self, SandboxState::Destroyed)
    }
}

impl OperationStatus {
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            OperationStatus::Succeeded | OperationStatus::Failed | OperationStatus::Cancelled
        )
    }
}

impl CommandState {
    pub fn is_terminal(self) -> bool {
        !matches!(self, CommandState::Starting | CommandState::Running)
    }
}

/// Resources of a sandbox. In requests every field is optional; in responses all are set.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Resources {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids: Option<u64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NetworkSpec {
    /// `none` (default): loopback only. `egress`: outbound connections to the
    /// `allow` list only, enforced by the host's firewall outside the sandbox.
    pub mode: String,
    /// With `egress`: up to 64 entries, each `HOST`, `IPv4` or `IPv4/PREFIX`, optionally
    /// followed by `:PORT` (TCP and UDP to that port only). Hostnames are resolved on the
    /// host at create. Private, loopback, link-local, multicast and the host's own
    /// addresses are refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow: Option<Vec<String>>,
    /// Set by the server (never in a request): what `allow` resolved to at create; a
    /// restart or resume re-applies exactly these.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved: Option<Vec<EgressRule>>,
}

/// One resolved allowlist entry: the network a sandbox may open connections to.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EgressRule {
    /// The `allow` entry this came from.
    pub entry: String,
    /// `a.b.c.d/n`.
    pub cidr: String,
    /// Only this destination port (TCP and UDP); `null`: every port.
    #[serde(default)]
    pub port: Option<u16>,
    /// The hostname it was resolved from (it goes into the sandbox's `/etc/hosts`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
}

/// `POST /v1/sandboxes`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxRequest {
    pub template: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<BTreeMap<String, String>>,
    /// Environment variables every command gets that the API never returns (only their
    /// names, in `secret_names`), that no log line, event or template holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Resources>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_seconds: Option<u64>,
    /// `suspend` (default) or `destroy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_idle: Option<OnIdle>,
}

/// `PUT /v1/pools`: keep `size` ready sandboxes of a template (server token only).
/// A pool is one template, runtime, set of resources and network mode; putting the
/// same four again changes its size (0 keeps the pool, empty).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    pub template: String,
    pub size: u32,
    /// Default: the server's default runtime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
    /// As in a create: unset fields come from the template, then the server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Resources>,
    /// `none` (default) or `egress`: the network mode its sandboxes boot with. A create
    /// asking for `egress` gets its allowlist applied when it claims one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<String>,
}

/// A warm pool: ready sandboxes that a matching create claims instead of booting one.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct Pool {
    /// `pool_` and a digest of template, runtime, resources and network.
    pub id: String,
    pub template: String,
    pub runtime: String,
    /// Every field set: a create matches when its own resolve to the same.
    pub resources: Resources,
    pub network: String,
    pub size: u32,
    /// Sandboxes running and free to claim now.
    pub ready: u32,
    /// Sandboxes the pool is booting.
    pub starting: u32,
    /// Creates that claimed one of its sandboxes since the server started.
    pub claims: u64,
    /// Why its last fill failed, while it keeps failing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    pub created_at: String,
    pub updated_at: String,
}

/// Who the caller's credential stands for (`GET /v1/whoami`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct Whoami {
    /// The tenant whose objects the credential sees.
    pub tenant: String,
    /// The API key's id (`null` for the server's own token); never the key.
    pub key_id: Option<String>,
    /// The server's own token: it alone manages pools and reads `/metrics`.
    pub operator: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct PoolList {
    pub pools: Vec<Pool>,
}

/// `POST /v1/sandboxes/{id}/keepalive`: counts as activity; with `ttl_seconds`
/// the TTL restarts from now with that length (default: the sandbox's own TTL).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KeepaliveRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
}

/// One server-sent event: a sandbox or an operation as it is after a change.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct Event {
    /// Increasing; resume with `Last-Event-ID` or `?after=`.
    pub id: i64,
    /// `sandbox` or `operation`.
    #[serde(rename = "type")]
    pub kind: String,
    pub created_at: String,
    pub object: serde_json::Value,
}

/// A sandbox as the API returns it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct Sandbox {
    pub id: String,
    /// How many changes of it the store has recorded: every stored change increments it
    /// (writes are compare-and-swap on it, so none is ever lost). Two reads with the same
    /// version saw the same object.
    #[serde(default)]
    pub version: u64,
    /// The tenant it belongs to (the API key's tenant; `default` for the
    /// server's own token and dev mode).
    #[serde(default = "default_tenant")]
    pub tenant: String,
    pub state: SandboxState,
    pub template: String,
    pub template_version: String,
    pub runtime: String,
    /// What isolates it: the gVisor platform (`systrap`), or the microVM's accelerator
    /// (`kvm`, or `tcg`: software emulation, not a security boundary).
    #[serde(default)]
    pub accelerator: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub resources: Resources,
    pub env: BTreeMap<String, String>,
    /// Names of the sandbox's secrets (their values are never returned).
    #[serde(default)]
    pub secret_names: Vec<String>,
    pub network: NetworkSpec,
    pub created_at: String,
    pub updated_at: String,
    /// When the TTL destroys it (`null`: no TTL).
    pub expires_at: Option<String>,
    /// Why the sandbox is `failed`.
    pub failure_reason: Option<String>,
    /// Last API request on the sandbox or end of a command in it.
    #[serde(default)]
    pub last_active_at: Option<String>,
    #[serde(default)]
    pub ttl_seconds: Option<u64>,
    #[serde(default)]
    pub idle_timeout_seconds: Option<u64>,
    /// What happens when the idle timeout passes: `suspend` or `destroy`.
    #[serde(default)]
    pub on_idle: Option<OnIdle>,
    /// When the idle timeout would act if nothing happens before (`null`: no idle timeout,
    /// or a command is running).
    #[serde(default)]
    pub idle_expires_at: Option<String>,
    /// What the sandbox's current state costs.
    #[serde(default)]
    pub cost: Cost,
    #[serde(default)]
    pub destroyed_at: Option<String>,
}

/// The tenant of the server's own token (`SPACE_API_TOKEN`, dev mode), and of
/// everything made before tenants existed.
pub const DEFAULT_TENANT: &str = "default";

fn default_tenant() -> String {
    DEFAULT_TENANT.to_string()
}

/// What a sandbox's state costs: resident memory while running or paused,
/// snapshot bytes on disk while suspended. Writable-layer bytes always.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct Cost {
    pub memory_bytes: Option<u64>,
    pub snapshot_bytes: Option<u64>,
    pub disk_bytes: Option<u64>,
}

string_enum!(
    /// What the idle timeout does.
    OnIdle {
        Suspend => "suspend",
        Destroy => "destroy",
    }
);

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct SandboxList {
    pub sandboxes: Vec<Sandbox>,
}

/// The progress of one asynchronous request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct Operation {
    pub id: String,
    /// How many changes of it the store has recorded: every stored change increments it
    /// (writes are compare-and-swap on it, so none is ever lost). Two reads with the same
    /// version saw the same object.
    #[serde(default)]
    pub version: u64,
    pub kind: OperationKind,
    pub status: OperationStatus,
    pub sandbox_id: Option<String>,
    /// The tenant the operation belongs to (its sandbox's, or a build's builder).
    #[serde(default = "default_tenant")]
    pub tenant: String,
    /// The template a `build` operation builds (`null` for other kinds).
    #[serde(default)]
    pub template: Option<String>,
    pub error: Option<ApiError>,
    /// A short human-readable line about what the operation is doing.
    pub progress: Option<String>,
    pub created_at: String,
    pub updated_at: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct OperationList {
    pub operations: Vec<Operation>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PtySize {
    pub rows: u16,
    pub cols: u16,
}

/// `POST /v1/sandboxes/{id}/commands`: exactly one of `argv` and `shell`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateCommandRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    /// Run through `/bin/sh -c`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shell: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<BTreeMap<String, String>>,
    /// Secret environment variables of this command only, over the sandbox's secrets and
    /// its env; never returned (only their names, in `secret_names`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait: Option<bool>,
}

/// How a command ended.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct ProcessResult {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub oom_killed: bool,
    pub duration_ms: u64,
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    pub output_truncated: bool,
}

/// A command session.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct Command {
    pub id: String,
    /// How many changes of it the store has recorded: every stored change increments it
    /// (writes are compare-and-swap on it, so none is ever lost). Two reads with the same
    /// version saw the same object.
    #[serde(default)]
    pub version: u64,
    pub sandbox_id: String,
    pub state: CommandState,
    /// Its process id inside the sandbox, once started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    pub argv: Vec<String>,
    pub cwd: Option<String>,
    pub user: Option<String>,
    /// Names of the secrets it runs with, the sandbox's and its own (values never returned).
    #[serde(default)]
    pub secret_names: Vec<String>,
    /// Whether it takes input through `POST …/stdin` or the attach WebSocket.
    #[serde(default)]
    pub stdin: bool,
    /// The pseudo-terminal it runs on, if any.
    #[serde(default)]
    pub pty: Option<PtySize>,
    /// The timeout it runs under (`null`: none).
    #[serde(default)]
    pub timeout_seconds: Option<u64>,
    pub created_at: String,
    pub ended_at: Option<String>,
    /// `null` until the command ends.
    pub result: Option<ProcessResult>,
    /// Why the command is `lost`.
    pub lost_reason: Option<String>,
    /// Where to read the output (NDJSON).
    pub output_url: String,
    /// With `wait:true`: the output as text (lossy UTF-8, capped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr: Option<String>,
    /// With `wait:true`: whether `stdout`/`stderr` were cut at the inline cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inline_truncated: Option<bool>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct CommandList {
    pub commands: Vec<Command>,
}

/// One line of the NDJSON output stream: raw bytes, base64 in `data`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct OutputChunk {
    /// `stdout` or `stderr`.
    pub stream: String,
    /// Position of the first byte of `data` in the view that was asked for
    /// (`stdout`, `stderr`, or both interleaved in arrival order).
    pub offset: u64,
    pub data: String,
}

/// The last line of a finished command's output stream.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct OutputEnd {
    pub result: ProcessResult,
    pub state: CommandState,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct Template {
    pub name: String,
    pub ready: bool,
    pub builtin: bool,
    /// The current version.
    pub version: Option<String>,
    pub size_bytes: Option<u64>,
    pub created_at: Option<String>,
    /// Every version on disk, oldest first.
    #[serde(default)]
    pub versions: Vec<String>,
    /// What a recipe-built template was built from (`null` for built-ins).
    #[serde(default)]
    pub base: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct TemplateList {
    pub templates: Vec<Template>,
}

// ---------------------------------------------------------------------------
// Bodies the server parses with its own structs today, and what the sandbox's
// agent answers for file requests (the server relays it as it comes). Here so
// that a client can speak them typed; field names as on the wire.
// ---------------------------------------------------------------------------

/// `POST /v1/sandboxes/{id}/snapshot-template`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SnapshotTemplateRequest {
    /// The template whose next version the sandbox's files become.
    pub name: String,
}

/// A signal as a request names it: a number (1-64) or a name (`TERM`, `SIGKILL`, …).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(untagged)]
pub enum Signal {
    Number(i32),
    Name(String),
}

impl From<i32> for Signal {
    fn from(n: i32) -> Self {
        Signal::Number(n)
    }
}

impl From<&str> for Signal {
    fn from(name: &str) -> Self {
        Signal::Name(name.to_string())
    }
}

/// `POST /v1/sandboxes/{id}/commands/{cid}/signal`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    pub signal: Signal,
}

/// `POST /v1/sandboxes/{id}/files/mkdir` (like `mkdir -p`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MkdirRequest {
    pub path: String,
    /// Permission bits (default `0o755`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
}

/// `POST /v1/sandboxes/{id}/files/move`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MoveRequest {
    pub from: String,
    pub to: String,
    /// Replace `to` if it exists (default: 409 instead).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overwrite: Option<bool>,
}

/// Kind of a file inside a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum FileType {
    File,
    Dir,
    Symlink,
    /// Devices, fifos, sockets, and any kind a newer server names.
    #[serde(other)]
    Other,
}

impl FileType {
    pub fn as_str(self) -> &'static str {
        match self {
            FileType::File => "file",
            FileType::Dir => "dir",
            FileType::Symlink => "symlink",
            FileType::Other => "other",
        }
    }
}

impl std::fmt::Display for FileType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

/// One file inside a sandbox: `GET …/files/stat`, an upload, `mkdir`, `move`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct FileInfo {
    /// Absolute path inside the sandbox (lossy UTF-8 when a name is not UTF-8).
    pub path: String,
    /// Last component; `/` for the root.
    pub name: String,
    #[serde(rename = "type")]
    pub kind: FileType,
    pub size: u64,
    /// Permission bits, setuid/setgid/sticky included.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Modification time, Unix seconds.
    #[serde(default)]
    pub mtime: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_target: Option<String>,
    /// The raw name, base64, when it is not valid UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name_base64: Option<String>,
    /// The raw link target, base64, when it is not valid UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_target_base64: Option<String>,
}

/// `GET …/files/list`: the entries below a path.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct FileListing {
    pub path: String,
    pub entries: Vec<FileInfo>,
    /// The listing stopped at the agent's entry limit.
    #[serde(default)]
    pub truncated: bool,
}

/// What a tar upload (`PUT …/files?format=tar`) wrote.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct UnpackStats {
    pub entries: u64,
    pub bytes: u64,
}

/// `DELETE …/files`: how many entries went.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct Removed {
    pub removed: u64,
}

/// One runtime of the server (`GET /v1/runtimes`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct RuntimeInfo {
    /// `gvisor` or `microvm`.
    pub name: String,
    pub available: bool,
    /// Whether sandboxes that name no runtime get this one.
    pub default: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accelerator: Option<String>,
    /// Why it is unavailable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct RuntimeList {
    pub runtimes: Vec<RuntimeInfo>,
}

/// `GET /healthz`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct Health {
    pub status: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_types_newer_servers_name_are_other() {
        let t: FileType = serde_json::from_str("\"dir\"").unwrap();
        assert_eq!(t, FileType::Dir);
        let t: FileType = serde_json::from_str("\"whiteout\"").unwrap();
        assert_eq!(t, FileType::Other);
        assert_eq!(
            serde_json::to_string(&FileType::Symlink).unwrap(),
            "\"symlink\""
        );
    }

    #[test]
    fn signals_are_numbers_or_names() {
        let r = SignalRequest { signal: 9.into() };
        assert_eq!(serde_json::to_string(&r).unwrap(), r#"{"signal":9}"#);
        let r = SignalRequest {
            signal: "TERM".into(),
        };
        assert_eq!(serde_json::to_string(&r).unwrap(), r#"{"signal":"TERM"}"#);
        let back: SignalRequest = serde_json::from_str(r#"{"signal":"KILL"}"#).unwrap();
        assert_eq!(back.signal, Signal::Name("KILL".into()));
    }
}

/// `POST /v1/sandboxes/{id}/contexts`: a stateful code context in a sandbox of the
/// `code-interpreter` template.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateContextRequest {
    /// `python` (a Jupyter kernel; the default) or `bash` (a persistent shell).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub language: Option<String>,
    /// The context's working directory; the user's home by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

/// A code context: variables, imports and the working directory persist from one
/// execution to the next.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct CodeContext {
    pub id: String,
    pub language: String,
    pub cwd: String,
}

/// `GET /v1/sandboxes/{id}/contexts`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct ContextList {
    pub contexts: Vec<CodeContext>,
}

/// `POST /v1/sandboxes/{id}/contexts/{ctx}/execute`: answered with an NDJSON stream of
/// `stdout`, `stderr`, `result`, `error` and a final `end` line.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecuteRequest {
    pub code: String,
    /// Past it the kernel is interrupted (the context stays usable); 300 by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<u64>,
    /// Environment variables for this execution only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<BTreeMap<String, String>>,
}
