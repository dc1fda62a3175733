//! `GET /v1/openapi.json`: the OpenAPI 3.1 document of the HTTP API.
//!
//! Built from the code, not written by hand: the schemas of request and response
//! bodies come from the wire types in `space_api` (derived with `schemars`, so
//! `deny_unknown_fields` becomes `additionalProperties: false`), and the paths from
//! [`ROUTES`], a table that mirrors `router()` in `api/mod.rs`. A test reads the
//! router's source and checks both lists hold the same (method, path) pairs, and the
//! integration test `tests/openapi.rs` sends every documented request to the real
//! server and checks none of them falls through to the "no such endpoint" fallback.

use std::sync::OnceLock;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use space_api::schemars::generate::SchemaSettings;
use space_api::schemars::{JsonSchema, SchemaGenerator};

use super::MAX_JSON_BODY;

/// `GET /v1/openapi.json`. The document is built once, on first request.
pub async fn document() -> Response {
    static DOC: OnceLock<bytes::Bytes> = OnceLock::new();
    let body = DOC.get_or_init(|| {
        bytes::Bytes::from(serde_json::to_vec_pretty(&build()).unwrap_or_default())
    });
    ([(header::CONTENT_TYPE, "application/json")], body.clone()).into_response()
}

/// How a request body is described.
#[derive(Clone, Copy)]
enum Body {
    None,
    /// JSON, required, of this schema (see [`Schemas`]).
    Json(fn(&mut SchemaGenerator) -> Value),
    /// JSON, optional (an empty body is accepted).
    OptionalJson(fn(&mut SchemaGenerator) -> Value),
    /// Raw bytes.
    Octets,
}

/// What a successful response carries.
#[derive(Clone, Copy)]
enum Ok {
    Json(u16, fn(&mut SchemaGenerator) -> Value),
    /// A body of one of these media types (the first is the default).
    Media(u16, &'static [&'static str]),
    Empty(u16),
    /// `101 Switching Protocols` to a WebSocket.
    Upgrade,
}

/// One documented operation. `path` uses axum's `:param` syntax so it compares
/// directly with the router; the document shows `{param}`.
struct Route {
    method: &'static str,
    path: &'static str,
    operation_id: &'static str,
    tag: &'static str,
    summary: &'static str,
    /// Query parameters by name (see [`query_param`]).
    query: &'static [&'static str],
    body: Body,
    ok: Ok,
    /// Error statuses besides 401 (every `/v1` route) and 500.
    errors: &'static [u16],
    /// `false` only for `/healthz`.
    auth: bool,
}

fn s<T: JsonSchema>(g: &mut SchemaGenerator) -> Value {
    g.subschema_for::<T>().to_value()
}

const ID: &[u16] = &[404];
const ID_Q: &[u16] = &[400, 404];
const ID_BODY: &[u16] = &[400, 404, 409, 413];
const ID_STATE: &[u16] = &[404, 409];
const FILES: &[u16] = &[400, 404, 409, 502, 503, 507];

/// Every route of `router()`, in its order.
const ROUTES: &[Route] = &[
    Route { method: "get", path: "/healthz", operation_id: "health", tag: "server", summary: "Liveness", query: &[], body: Body::None, ok: Ok::Json(200, health), errors: &[], auth: false },
    Route { method: "post", path: "/v1/sandboxes", operation_id: "createSandbox", tag: "sandboxes", summary: "Create a sandbox (202 + a `create` operation)", query: &[], body: Body::Json(s::<space_api::CreateSandboxRequest>), ok: Ok::Json(202, s::<space_api::Operation>), errors: &[400, 404, 409, 413, 429, 503], auth: true },
    Route { method: "get", path: "/v1/sandboxes", operation_id: "listSandboxes", tag: "sandboxes", summary: "List sandboxes, optionally by label", query: &["label"], body: Body::None, ok: Ok::Json(200, s::<space_api::SandboxList>), errors: &[400], auth: true },
    Route { method: "get", path: "/v1/sandboxes/:id", operation_id: "getSandbox", tag: "sandboxes", summary: "Get a sandbox", query: &[], body: Body::None, ok: Ok::Json(200, s::<space_api::Sandbox>), errors: ID, auth: true },
    Route { method: "delete", path: "/v1/sandboxes/:id", operation_id: "destroySandbox", tag: "sandboxes", summary: "Destroy a sandbox (202 + a `destroy` operation)", query: &[], body: Body::None, ok: Ok::Json(202, s::<space_api::Operation>), errors: ID_STATE, auth: true },
    Route { method: "post", path: "/v1/sandboxes/:id/pause", operation_id: "pauseSandbox", tag: "sandboxes", summary: "Pause a running sandbox (kept in memory)", query: &[], body: Body::None, ok: Ok::Json(202, s::<space_api::Operation>), errors: ID_STATE, auth: true },
    Route { method: "post", path: "/v1/sandboxes/:id/resume", operation_id: "resumeSandbox", tag: "sandboxes", summary: "Resume a paused or suspended sandbox", query: &[], body: Body::None, ok: Ok::Json(202, s::<space_api::Operation>), errors: &[404, 409, 429], auth: true },
    Route { method: "post", path: "/v1/sandboxes/:id/suspend", operation_id: "suspendSandbox", tag: "sandboxes", summary: "Suspend a sandbox to disk", query: &[], body: Body::None, ok: Ok::Json(202, s::<space_api::Operation>), errors: ID_STATE, auth: true },
    Route { method: "post", path: "/v1/sandboxes/:id/keepalive", operation_id: "keepaliveSandbox", tag: "sandboxes", summary: "Count as activity; optionally restart the TTL", query: &[], body: Body::OptionalJson(s::<space_api::KeepaliveRequest>), ok: Ok::Json(200, s::<space_api::Sandbox>), errors: ID_BODY, auth: true },
    Route { method: "post", path: "/v1/sandboxes/:id/snapshot-template", operation_id: "snapshotTemplate", tag: "sandboxes", summary: "Save a running sandbox's filesystem as a template (202 + a `build` operation)", query: &[], body: Body::Json(snapshot_template_request), ok: Ok::Json(202, s::<space_api::Operation>), errors: &[400, 404, 409, 413, 429], auth: true },
    Route { method: "post", path: "/v1/sandboxes/:id/commands", operation_id: "createCommand", tag: "commands", summary: "Start a command; with `wait:true` the response carries its result and output", query: &[], body: Body::Json(s::<space_api::CreateCommandRequest>), ok: Ok::Json(201, s::<space_api::Command>), errors: &[400, 404, 409, 413, 429, 503], auth: true },
    Route { method: "get", path: "/v1/sandboxes/:id/commands", operation_id: "listCommands", tag: "commands", summary: "List a sandbox's commands", query: &[], body: Body::None, ok: Ok::Json(200, s::<space_api::CommandList>), errors: ID, auth: true },
    Route { method: "get", path: "/v1/sandboxes/:id/commands/:cid", operation_id: "getCommand", tag: "commands", summary: "Get a command; `wait` long-polls until it ends", query: &["wait"], body: Body::None, ok: Ok::Json(200, s::<space_api::Command>), errors: ID_Q, auth: true },
    Route { method: "get", path: "/v1/sandboxes/:id/commands/:cid/output", operation_id: "commandOutput", tag: "commands", summary: "NDJSON stream of `{stream, offset, data}` chunks (data base64), then `{result, state}`; `format=raw`: the view's bytes alone", query: &["offset", "follow", "stream", "format@output"], body: Body::None, ok: Ok::Media(200, &["application/x-ndjson", "application/octet-stream"]), errors: &[400, 404, 429], auth: true },
    Route { method: "post", path: "/v1/sandboxes/:id/commands/:cid/signal", operation_id: "signalCommand", tag: "commands", summary: "Send a signal to a command", query: &[], body: Body::Json(signal_request), ok: Ok::Json(200, s::<space_api::Command>), errors: ID_BODY, auth: true },
    Route { method: "post", path: "/v1/sandboxes/:id/commands/:cid/stdin", operation_id: "commandStdin", tag: "commands", summary: "Write the raw body to a command's stdin (`eof=true` closes it after)", query: &["eof"], body: Body::Octets, ok: Ok::Empty(204), errors: ID_BODY, auth: true },
    Route { method: "get", path: "/v1/sandboxes/:id/commands/:cid/attach", operation_id: "attachCommand", tag: "commands", summary: "WebSocket: binary frames are stdin / stream-tagged output, text frames JSON controls", query: &["offset"], body: Body::None, ok: Ok::Upgrade, errors: &[400, 404, 426], auth: true },
    Route { method: "get", path: "/v1/sandboxes/:id/files", operation_id: "downloadFile", tag: "files", summary: "Download a file (raw) or a directory (`format=tar`)", query: &["path", "format"], body: Body::None, ok: Ok::Media(200, &["application/octet-stream", "application/x-tar"]), errors: FILES, auth: true },
    Route { method: "put", path: "/v1/sandboxes/:id/files", operation_id: "uploadFile", tag: "files", summary: "Upload a file (raw body) or unpack a tar (`format=tar`, `gzip=true`)", query: &["path", "format", "gzip", "mode", "uid", "gid", "parents"], body: Body::Octets, ok: Ok::Json(201, file_result), errors: &[400, 404, 409, 413, 429, 502, 503, 507], auth: true },
    Route { method: "delete", path: "/v1/sandboxes/:id/files", operation_id: "removeFile", tag: "files", summary: "Remove a file or (with `recursive=true`) a directory tree", query: &["path", "recursive"], body: Body::None, ok: Ok::Json(200, file_result), errors: FILES, auth: true },
    Route { method: "post", path: "/v1/sandboxes/:id/contexts", operation_id: "createContext", tag: "contexts", summary: "Start a code context (a Python kernel or a bash) in a code-interpreter sandbox", query: &[], body: Body::Json(s::<space_api::CreateContextRequest>), ok: Ok::Json(201, s::<space_api::CodeContext>), errors: &[400, 404, 409, 413, 429, 503], auth: true },
    Route { method: "get", path: "/v1/sandboxes/:id/contexts", operation_id: "listContexts", tag: "contexts", summary: "List a sandbox's code contexts", query: &[], body: Body::None, ok: Ok::Json(200, s::<space_api::ContextList>), errors: &[404, 409, 429, 503], auth: true },
    Route { method: "delete", path: "/v1/sandboxes/:id/contexts/:ctx", operation_id: "deleteContext", tag: "contexts", summary: "Stop a code context", query: &[], body: Body::None, ok: Ok::Json(200, s::<space_api::CodeContext>), errors: &[404, 409, 429, 503], auth: true },
    Route { method: "post", path: "/v1/sandboxes/:id/contexts/:ctx/restart", operation_id: "restartContext", tag: "contexts", summary: "Restart a code context's kernel (its state is lost)", query: &[], body: Body::None, ok: Ok::Json(200, s::<space_api::CodeContext>), errors: &[404, 409, 429, 503], auth: true },
    Route { method: "post", path: "/v1/sandboxes/:id/contexts/:ctx/execute", operation_id: "executeCode", tag: "contexts", summary: "Run code in a context: NDJSON of `stdout`, `stderr`, `result` (a MIME bundle), `error`, then `end` with the recording command's id", query: &[], body: Body::Json(s::<space_api::ExecuteRequest>), ok: Ok::Media(200, &["application/x-ndjson"]), errors: &[400, 404, 409, 413, 429, 503], auth: true },
    Route { method: "get", path: "/v1/sandboxes/:id/files/list", operation_id: "listFiles", tag: "files", summary: "List a directory", query: &["path", "depth"], body: Body::None, ok: Ok::Json(200, file_result), errors: FILES, auth: true },
    Route { method: "get", path: "/v1/sandboxes/:id/files/stat", operation_id: "statFile", tag: "files", summary: "Stat a path", query: &["path"], body: Body::None, ok: Ok::Json(200, file_result), errors: FILES, auth: true },
    Route { method: "post", path: "/v1/sandboxes/:id/files/mkdir", operation_id: "mkdir", tag: "files", summary: "Create a directory and its parents", query: &[], body: Body::Json(mkdir_request), ok: Ok::Json(201, file_result), errors: &[400, 404, 409, 413, 502, 503, 507], auth: true },
    Route { method: "post", path: "/v1/sandboxes/:id/files/move", operation_id: "moveFile", tag: "files", summary: "Move or rename a path", query: &[], body: Body::Json(move_request), ok: Ok::Json(200, file_result), errors: &[400, 404, 409, 413, 502, 503, 507], auth: true },
    Route { method: "get", path: "/v1/operations", operation_id: "listOperations", tag: "operations", summary: "List operations, newest first", query: &["sandbox_id", "limit"], body: Body::None, ok: Ok::Json(200, s::<space_api::OperationList>), errors: &[400], auth: true },
    Route { method: "get", path: "/v1/operations/:id", operation_id: "getOperation", tag: "operations", summary: "Get an operation; `wait` long-polls until it ends", query: &["wait"], body: Body::None, ok: Ok::Json(200, s::<space_api::Operation>), errors: ID_Q, auth: true },
    Route { method: "post", path: "/v1/operations/:id/cancel", operation_id: "cancelOperation", tag: "operations", summary: "Cancel a pending or running operation", query: &[], body: Body::None, ok: Ok::Json(200, s::<space_api::Operation>), errors: ID_STATE, auth: true },
    Route { method: "get", path: "/v1/templates", operation_id: "listTemplates", tag: "templates", summary: "List templates", query: &[], body: Body::None, ok: Ok::Json(200, s::<space_api::TemplateList>), errors: &[], auth: true },
    Route { method: "post", path: "/v1/templates", operation_id: "buildTemplate", tag: "templates", summary: "Build a template from a recipe (202 + a `build` operation)", query: &[], body: Body::Json(recipe), ok: Ok::Json(202, s::<space_api::Operation>), errors: &[400, 409, 413, 429, 503], auth: true },
    Route { method: "delete", path: "/v1/templates/:name", operation_id: "deleteTemplate", tag: "templates", summary: "Delete a built template (409 if built in or in use)", query: &[], body: Body::None, ok: Ok::Empty(204), errors: &[400, 404, 409], auth: true },
    Route { method: "get", path: "/v1/operations/:id/log", operation_id: "operationLog", tag: "operations", summary: "A build's log as text; `follow=true` streams until it ends", query: &["follow"], body: Body::None, ok: Ok::Media(200, &["text/plain"]), errors: &[400, 404, 429], auth: true },
    Route { method: "get", path: "/v1/events", operation_id: "events", tag: "server", summary: "Server-sent events of sandbox and operation changes (`Last-Event-ID` or `after` resumes)", query: &["after"], body: Body::None, ok: Ok::Media(200, &["text/event-stream"]), errors: &[400, 429], auth: true },
    Route { method: "get", path: "/v1/pools", operation_id: "listPools", tag: "pools", summary: "Warm pools, with their ready and booting sandboxes (the server's token only)", query: &[], body: Body::None, ok: Ok::Json(200, s::<space_api::PoolList>), errors: &[403], auth: true },
    Route { method: "put", path: "/v1/pools", operation_id: "setPool", tag: "pools", summary: "Create a warm pool or set its size (the server's token only)", query: &[], body: Body::Json(s::<space_api::PoolSpec>), ok: Ok::Json(200, s::<space_api::Pool>), errors: &[400, 403, 404, 413], auth: true },
    Route { method: "delete", path: "/v1/pools/:id", operation_id: "deletePool", tag: "pools", summary: "Remove a warm pool; its sandboxes are destroyed (the server's token only)", query: &[], body: Body::None, ok: Ok::Empty(204), errors: &[403, 404], auth: true },
    Route { method: "get", path: "/metrics", operation_id: "metrics", tag: "server", summary: "Prometheus metrics in the text format (the server's token only)", query: &[], body: Body::None, ok: Ok::Media(200, &["text/plain"]), errors: &[403], auth: true },
    Route { method: "get", path: "/v1/whoami", operation_id: "whoami", tag: "server", summary: "The tenant of the caller's credential, its key id, and whether it is the server's own token", query: &[], body: Body::None, ok: Ok::Json(200, s::<space_api::Whoami>), errors: &[], auth: true },
    Route { method: "get", path: "/v1/runtimes", operation_id: "listRuntimes", tag: "server", summary: "The runtimes this server has and whether each works here", query: &[], body: Body::None, ok: Ok::Json(200, runtimes), errors: &[], auth: true },
    Route { method: "get", path: "/v1/openapi.json", operation_id: "openapi", tag: "server", summary: "This document", query: &[], body: Body::None, ok: Ok::Json(200, any_object), errors: &[], auth: true },
];

const ID_PATTERN_LEN: usize = 20;

/// A path parameter's schema: ids are a prefix, `_` and 20 base32 characters
/// (anything else is a 404 before the store is asked).
fn path_param(name: &str, path: &str) -> Value {
    let (schema, description) = match name {
        "id" if path.starts_with("/v1/operations") => (id_schema("op"), "Operation id"),
        "id" if path.starts_with("/v1/pools") => (
            json!({"type": "string", "pattern": "^pool_[0-9a-f]{16}$"}),
            "Pool id",
        ),
        "id" => (id_schema("sb"), "Sandbox id"),
        "cid" => (id_schema("cmd"), "Command id"),
        "ctx" => (
            json!({"type": "string", "pattern": "^ctx_[0-9a-f]{16}$"}),
            "Code context id",
        ),
        "name" => (
            json!({"type": "string", "minLength": 1, "maxLength": 255}),
            "Template name",
        ),
        _ => (json!({"type": "string"}), ""),
    };
    json!({"name": name, "in": "path", "required": true, "description": description, "schema": schema})
}

fn id_schema(prefix: &str) -> Value {
    json!({"type": "string", "pattern": format!("^{prefix}_[a-z2-7]{{{ID_PATTERN_LEN}}}$")})
}

fn query_param(name: &str) -> Value {
    let (schema, required, description) = match name {
        "label" => (
            json!({"type": "string"}),
            false,
            "`key=value` filters, comma-separated; all must match",
        ),
        "wait" => (
            json!({"type": "string", "pattern": "^[0-9]+(ms|s|m)?$"}),
            false,
            "Long-poll up to this long (`30s`, `500ms`, `2m`, plain seconds; at most 10 minutes)",
        ),
        "offset" => (
            json!({"type": "integer", "format": "uint64", "minimum": 0}),
            false,
            "First byte to send, in the chosen view",
        ),
        "follow" => (
            json!({"type": "boolean"}),
            false,
            "Keep streaming until the command or build ends",
        ),
        "stream" => (
            json!({"type": "string", "enum": ["combined", "stdout", "stderr"]}),
            false,
            "Which output (default `combined`)",
        ),
        "eof" => (
            json!({"type": "boolean"}),
            false,
            "Close stdin after these bytes",
        ),
        "path" => (
            json!({"type": "string", "pattern": "^/", "maxLength": 4096}),
            true,
            "Absolute path inside the sandbox: no `..`, no NUL, components at most 255 bytes",
        ),
        "format" => (
            json!({"type": "string", "enum": ["raw", "tar"]}),
            false,
            "`tar` for a directory",
        ),
        "format@output" => (
            json!({"type": "string", "enum": ["ndjson", "raw"]}),
            false,
            "`raw`: the view's bytes alone, no framing (the result is then `GET …/commands/{cid}`)",
        ),
        "gzip" => (
            json!({"type": "boolean"}),
            false,
            "The tar is gzip-compressed (format=tar only)",
        ),
        "mode" => (
            json!({"type": "string", "pattern": "^[0-7]{3,5}$"}),
            false,
            "Octal permission bits, at most 07777",
        ),
        "uid" | "gid" => (
            json!({"type": "integer", "format": "uint32", "minimum": 0, "maximum": u32::MAX}),
            false,
            "Owner inside the sandbox",
        ),
        "recursive" => (
            json!({"type": "boolean"}),
            false,
            "Remove a directory and everything under it",
        ),
        "parents" => (
            json!({"type": "boolean"}),
            false,
            "Make a file's missing parent directories (default true; `false` answers 404 instead)",
        ),
        "depth" => (
            json!({"type": "integer", "minimum": 1, "maximum": 64}),
            false,
            "Levels to list (default 1)",
        ),
        "sandbox_id" => (
            json!({"type": "string"}),
            false,
            "Only this sandbox's operations",
        ),
        "limit" => (
            json!({"type": "integer", "minimum": 0}),
            false,
            "At most this many (default 100; clamped to 1-1000)",
        ),
        "after" => (
            json!({"type": "integer", "format": "int64"}),
            false,
            "Replay retained events after this id (`0`: all)",
        ),
        _ => (json!({"type": "string"}), false, ""),
    };
    // `name@route`: a parameter whose schema differs on one route.
    let shown = name.split('@').next().unwrap_or(name);
    let mut p = json!({"name": shown, "in": "query", "required": required, "description": description, "schema": schema});
    if let Some(e) = query_example(name) {
        p["example"] = e;
    }
    p
}

/// A working request body per operation: documentation, and what schemathesis's
/// examples phase sends first (so its later phases reach a live sandbox).
fn body_example(operation_id: &str) -> Option<Value> {
    Some(match operation_id {
        "createSandbox" => {
            json!({"template": "busybox", "ttl_seconds": 600, "labels": {"team": "a"}})
        }
        "keepaliveSandbox" => json!({"ttl_seconds": 600}),
        "snapshotTemplate" => json!({"name": "my-snapshot"}),
        "createCommand" => json!({"argv": ["echo", "hello"], "wait": true}),
        "signalCommand" => json!({"signal": "TERM"}),
        "mkdir" => json!({"path": "/tmp/new-dir", "mode": 493}),
        "moveFile" => json!({"from": "/tmp/new-dir", "to": "/tmp/moved-dir"}),
        "buildTemplate" => json!({"name": "tools", "base": "busybox",
            "files": [{"path": "/etc/motd", "content": "hello\n"}]}),
        _ => return None,
    })
}

/// A working value per query parameter.
fn query_example(name: &str) -> Option<Value> {
    Some(match name {
        "label" => json!("team=a"),
        "wait" => json!("1s"),
        "offset" => json!(0),
        "stream" => json!("combined"),
        "path" => json!("/tmp"),
        "format" => json!("raw"),
        "mode" => json!("0644"),
        "depth" => json!(2),
        "limit" => json!(10),
        "after" => json!(0),
        _ => return None,
    })
}

fn health(_: &mut SchemaGenerator) -> Value {
    json!({"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}})
}

fn any_object(_: &mut SchemaGenerator) -> Value {
    json!({"type": "object"})
}

/// What the sandbox's agent answers for file requests: a `FileInfo`, a listing,
/// `{removed}` or the unpack statistics; relayed as they come.
fn file_result(_: &mut SchemaGenerator) -> Value {
    json!({"type": "object"})
}

fn runtimes(_: &mut SchemaGenerator) -> Value {
    json!({
        "type": "object",
        "required": ["runtimes"],
        "properties": {"runtimes": {"type": "array", "items": {
            "type": "object",
            "required": ["name", "available", "default"],
            "properties": {
                "name": {"type": "string"},
                "available": {"type": "boolean"},
                "default": {"type": "boolean"},
                "accelerator": {"type": "string"},
                "reason": {"type": "string"},
            },
        }}},
    })
}

fn snapshot_template_request(_: &mut SchemaGenerator) -> Value {
    json!({
        "type": "object", "additionalProperties": false, "required": ["name"],
        "properties": {"name": {"type": "string"}},
    })
}

fn signal_request(_: &mut SchemaGenerator) -> Value {
    json!({
        "type": "object", "additionalProperties": false, "required": ["signal"],
        "properties": {"signal": {
            "description": "A number 1-64, or a name such as TERM, SIGKILL, INT, HUP",
            "oneOf": [{"type": "integer", "minimum": 1, "maximum": 64}, {"type": "string"}],
        }},
    })
}

fn mkdir_request(_: &mut SchemaGenerator) -> Value {
    json!({
        "type": "object", "additionalProperties": false, "required": ["path"],
        "properties": {
            "path": {"type": "string"},
            "mode": {"type": ["integer", "null"], "minimum": 0, "maximum": 4095},
            "uid": {"type": ["integer", "null"], "format": "uint32", "minimum": 0},
            "gid": {"type": ["integer", "null"], "format": "uint32", "minimum": 0},
        },
    })
}

fn move_request(_: &mut SchemaGenerator) -> Value {
    json!({
        "type": "object", "additionalProperties": false, "required": ["from", "to"],
        "properties": {
            "from": {"type": "string"},
            "to": {"type": "string"},
            "overwrite": {"type": ["boolean", "null"]},
        },
    })
}

/// `space_runtime::build::Recipe` (a runtime type, so described here).
fn recipe(_: &mut SchemaGenerator) -> Value {
    json!({
        "type": "object", "additionalProperties": false, "required": ["name", "base"],
        "properties": {
            "name": {"type": "string"},
            "base": {"type": "string", "description": "`busybox`, `debian:bookworm`, `template:NAME`, `dir:PATH`, `tar:PATH` or `oci:PATH`"},
            "packages": {"type": "array", "items": {"type": "string"}},
            "files": {"type": "array", "items": {"type": "object", "required": ["path"], "properties": {
                "path": {"type": "string"}, "content": {"type": "string"}, "content_base64": {"type": "string"},
                "mode": {"type": "integer"}, "uid": {"type": "integer"}, "gid": {"type": "integer"},
            }}},
            "steps": {"type": "array", "items": {"type": "object", "required": ["run"], "properties": {"run": {"type": "string"}}}},
            "env": {"type": "object", "additionalProperties": {"type": "string"}},
            "workdir": {"type": "string"},
            "user": {"type": "string"},
            "resources": {"type": "object"},
            "start": {"type": "object"},
        },
    })
}

fn status_text(code: u16) -> &'static str {
    match code {
        101 => "Switching to a WebSocket",
        200 => "OK",
        201 => "Created",
        202 => "Accepted: the work continues in the returned operation",
        204 => "Done, no body",
        400 => "Invalid request (body, query or header)",
        401 => "Missing or wrong bearer token",
        404 => "No such sandbox, command, operation, template or path",
        409 => "Conflict with the current state",
        413 => "Body too large",
        426 => "Not a WebSocket upgrade",
        429 => "Too many: the tenant's rate or concurrency limit (see `Retry-After`)",
        500 => "Internal error",
        502 => "The sandbox's agent failed",
        503 => "Unavailable (runtime or agent not reachable)",
        507 => "No space left in the sandbox",
        _ => "",
    }
}

/// Paths as the document writes them: `:id` → `{id}`.
fn openapi_path(axum_path: &str) -> String {
    axum_path
        .split('/')
        .map(|seg| match seg.strip_prefix(':') {
            Some(name) => format!("{{{name}}}"),
            None => seg.to_string(),
        })
        .collect::<Vec<_>>()
        .join("/")
}

fn operation(route: &Route, g: &mut SchemaGenerator) -> Value {
    let error_ref = json!({"$ref": "#/components/schemas/ErrorBody"});
    let mut op = Map::new();
    op.insert("operationId".into(), route.operation_id.into());
    op.insert("tags".into(), json!([route.tag]));
    op.insert("summary".into(), route.summary.into());
    let mut params: Vec<Value> = route
        .path
        .split('/')
        .filter_map(|seg| seg.strip_prefix(':'))
        .map(|name| path_param(name, route.path))
        .collect();
    params.extend(route.query.iter().map(|q| query_param(q)));
    if route.path == "/v1/events" {
        params.push(json!({"name": "Last-Event-ID", "in": "header", "required": false,
            "description": "Resume after this event id", "schema": {"type": "string", "pattern": "^[0-9]+$"}}));
    }
    if !params.is_empty() {
        op.insert("parameters".into(), Value::Array(params));
    }
    match route.body {
        Body::None => {}
        Body::Json(f) | Body::OptionalJson(f) => {
            let mut media = json!({ "schema": f(g) });
            if let Some(e) = body_example(route.operation_id) {
                media["example"] = e;
            }
            op.insert(
                "requestBody".into(),
                json!({
                    "required": matches!(route.body, Body::Json(_)),
                    "description": format!("JSON, at most {MAX_JSON_BODY} bytes; unknown fields are refused"),
                    "content": {"application/json": media},
                }),
            );
        }
        Body::Octets => {
            op.insert(
                "requestBody".into(),
                json!({"required": false, "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}),
            );
        }
    }
    let mut responses = Map::new();
    match route.ok {
        Ok::Json(code, f) => {
            responses.insert(
                code.to_string(),
                json!({"description": status_text(code), "content": {"application/json": {"schema": f(g)}}}),
            );
        }
        Ok::Media(code, media) => {
            let mut content = Map::new();
            for (i, m) in media.iter().enumerate() {
                let schema = if i == 0 {
                    json!({"type": "string"})
                } else {
                    json!({"type": "string", "format": "binary"})
                };
                content.insert((*m).into(), json!({ "schema": schema }));
            }
            responses.insert(
                code.to_string(),
                json!({"description": status_text(code), "content": content}),
            );
        }
        Ok::Empty(code) => {
            responses.insert(code.to_string(), json!({"description": status_text(code)}));
        }
        Ok::Upgrade => {
            responses.insert("101".into(), json!({"description": status_text(101)}));
        }
    }
    let mut errors: Vec<u16> = route.errors.to_vec();
    if route.auth {
        errors.push(401);
    }
    errors.push(500);
    errors.sort_unstable();
    errors.dedup();
    for code in errors {
        let mut content = Map::new();
        content.insert("application/json".into(), json!({"schema": error_ref}));
        if matches!(route.ok, Ok::Upgrade) && (code == 400 || code == 426) {
            // axum's WebSocket extractor answers a plain request in plain text.
            content.insert("text/plain".into(), json!({"schema": {"type": "string"}}));
        }
        responses.insert(
            code.to_string(),
            json!({"description": status_text(code), "content": content}),
        );
    }
    op.insert("responses".into(), Value::Object(responses));
    if !route.auth {
        op.insert("security".into(), json!([]));
    }
    Value::Object(op)
}

/// The whole document.
pub fn build() -> Value {
    let mut g = SchemaSettings::draft2020_12()
        .with(|s| s.definitions_path = "/components/schemas".into())
        .into_generator();
    let _ = g.subschema_for::<space_api::ErrorBody>();
    let mut paths = Map::new();
    for route in ROUTES {
        let op = operation(route, &mut g);
        let entry = paths
            .entry(openapi_path(route.path))
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(m) = entry {
            m.insert(route.method.into(), op);
        }
    }
    let schemas = g.take_definitions(true);
    let tags: Vec<Value> = [
        "sandboxes",
        "commands",
        "files",
        "operations",
        "templates",
        "pools",
        "server",
    ]
    .iter()
    .map(|t| json!({ "name": t }))
    .collect();
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "space",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Sandboxes (gVisor and microVM) over HTTP. Errors are `{\"error\":{\"code\",\"message\"}}`.",
        },
        "servers": [{"url": "/"}],
        "security": [{"bearer": []}],
        "tags": tags,
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// Every (method, axum path) the table documents.
    pub fn documented_routes() -> Vec<(String, String)> {
        ROUTES
            .iter()
            .map(|r| (r.method.to_string(), r.path.to_string()))
            .collect()
    }

    /// The (method, path) pairs `router()` registers, read from its source: every
    /// `.route("PATH", …)` call and the method routers (`get(…)`, `.post(…)`, …) at the
    /// top level of its second argument; routes of the `let v1 = …;` router get `/v1`.
    fn router_routes() -> BTreeSet<(String, String)> {
        let src = include_str!("mod.rs");
        let start = src.find("pub fn router(").expect("router() in mod.rs");
        let src = &src[start..];
        let v1_start = src.find("let v1 = ").expect("the v1 router");
        let v1_end = v1_start + src[v1_start..].find(";\n").expect("end of the v1 router");
        let end = src.find("\n}\n").expect("end of router()");
        let mut out = BTreeSet::new();
        let mut from = 0;
        while let Some(i) = src[from..end].find(".route(") {
            let at = from + i;
            from = at + ".route(".len();
            let args = &src[from..end];
            let q1 = args.find('"').expect("route path");
            let q2 = args[q1 + 1..].find('"').expect("route path end") + q1 + 1;
            let path = &args[q1 + 1..q2];
            let full = if (v1_start..v1_end).contains(&at) {
                format!("/v1{path}")
            } else {
                path.to_string()
            };
            // The method routers at depth 1 of the call's arguments.
            let mut depth = 1usize;
            let mut ident = String::new();
            for &b in &args.as_bytes()[q2 + 1..] {
                match b {
                    b'(' => {
                        let name = ident.rsplit("::").next().unwrap_or("");
                        if depth == 1
                            && ["get", "post", "put", "delete", "patch", "head"].contains(&name)
                        {
                            out.insert((name.to_string(), full.clone()));
                        }
                        depth += 1;
                        ident.clear();
                    }
                    b')' => {
                        depth -= 1;
                        ident.clear();
                        if depth == 0 {
                            break;
                        }
                    }
                    b if b.is_ascii_alphanumeric() || b == b'_' || b == b':' => {
                        ident.push(b as char)
                    }
                    _ => ident.clear(),
                }
            }
        }
        out
    }

    #[test]
    fn document_matches_router() {
        let routes = router_routes();
        let documented: BTreeSet<_> = documented_routes().into_iter().collect();
        let missing: Vec<_> = routes.difference(&documented).collect();
        let extra: Vec<_> = documented.difference(&routes).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "api/openapi.rs ROUTES and router() differ:\n  in the router, not documented: \
             {missing:?}\n  documented, not in the router: {extra:?}"
        );
        assert!(routes.len() >= 30, "parsed only {} routes", routes.len());
    }

    #[test]
    fn document_is_well_formed() {
        let doc = build();
        let text = serde_json::to_string(&doc).expect("serialises");
        let back: Value = serde_json::from_str(&text).expect("valid JSON");
        for key in ["openapi", "info", "paths", "components", "security"] {
            assert!(back.get(key).is_some(), "missing top-level {key}");
        }
        assert_eq!(back["openapi"], "3.1.0");
        assert_eq!(
            back["components"]["securitySchemes"]["bearer"]["scheme"],
            "bearer"
        );
        // Every $ref points at a schema the document has.
        let schemas = back["components"]["schemas"].as_object().expect("schemas");
        let mut refs = Vec::new();
        collect_refs(&back, &mut refs);
        assert!(!refs.is_empty());
        for r in refs {
            let name = r
                .strip_prefix("#/components/schemas/")
                .unwrap_or_else(|| panic!("ref {r}"));
            assert!(schemas.contains_key(name), "dangling $ref {r}");
        }
        // Request bodies refuse unknown fields, as the server does.
        for name in [
            "CreateSandboxRequest",
            "CreateCommandRequest",
            "Resources",
            "KeepaliveRequest",
        ] {
            assert_eq!(
                schemas[name]["additionalProperties"],
                Value::Bool(false),
                "{name} should refuse unknown fields"
            );
        }
        assert_eq!(
            schemas["ErrorBody"]["properties"]["error"]["$ref"],
            "#/components/schemas/ApiError"
        );
        // operationIds are unique.
        let mut ids = BTreeSet::new();
        for r in ROUTES {
            assert!(
                ids.insert(r.operation_id),
                "duplicate operationId {}",
                r.operation_id
            );
        }
    }

    fn collect_refs(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for (k, v) in m {
                    if k == "$ref" {
                        if let Some(s) = v.as_str() {
                            out.push(s.to_string());
                        }
                    } else {
                        collect_refs(v, out);
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|v| collect_refs(v, out)),
            _ => {}
        }
    }
}
