//! envd's `process.Process` service over space commands: a process is a command
//! (visible in `/v1`, its output durable and replayable), its pid the command's pid
//! inside the sandbox.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::Response;
use base64::Engine;
use bytes::Bytes;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use space_agent::protocol::Stream;
use space_api::{Command, CreateCommandRequest, PtySize};
use space_service::output::View;
use space_service::{CommandOutputQuery, OutputEvent, Service, Tenant, MAX_STDIN_WRITE};

use super::connect::{self, RpcError, StreamTx};
use super::{basic_user, envd_caller, home_of, E2bState};

/// How often a stream says it is alive when the client does not say.
const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(30);

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct ProcessConfig {
    cmd: String,
    args: Vec<String>,
    envs: BTreeMap<String, String>,
    cwd: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Pty {
    size: Option<PtySizeMsg>,
}

#[derive(Deserialize, Default, Clone, Copy)]
#[serde(default)]
struct PtySizeMsg {
    cols: u32,
    rows: u32,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct StartRequest {
    process: ProcessConfig,
    pty: Option<Pty>,
    tag: Option<String>,
    stdin: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Selector {
    pid: Option<u32>,
    tag: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Selected {
    process: Option<Selector>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Input {
    stdin: Option<String>,
    pty: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct SendInputRequest {
    process: Option<Selector>,
    input: Option<Input>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct SendSignalRequest {
    process: Option<Selector>,
    signal: Value,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct UpdateRequest {
    process: Option<Selector>,
    pty: Option<Pty>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct StreamInputRequest {
    start: Option<Selected>,
    data: Option<SendInputRequest>,
    keepalive: Option<Value>,
}

/// `POST /process.Process/{method}`.
pub async fn call(
    State(st): State<E2bState>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let (tenant, sandbox) = match envd_caller(&st, &headers).await {
        Ok(c) => c,
        Err(r) => return r.into_response(),
    };
    let cx = Cx {
        svc: st.service.clone(),
        tenant,
        sandbox,
    };
    match method.as_str() {
        "Start" => match connect::read_single::<StartRequest>(&headers, body).await {
            Ok(req) => start(cx, &headers, req).await,
            Err(e) => connect::stream_error(e),
        },
        "Connect" => match connect::read_single::<Selected>(&headers, body).await {
            Ok(req) => reconnect(cx, &headers, req).await,
            Err(e) => connect::stream_error(e),
        },
        "StreamInput" => stream_input(cx, &headers, body).await,
        _ => connect::unary(unary(cx, &method, &headers, body).await),
    }
}

struct Cx {
    svc: Service,
    tenant: Tenant,
    sandbox: String,
}

impl Cx {
    async fn select(&self, sel: Option<&Selector>) -> Result<Command, RpcError> {
        let Some(sel) = sel else {
            return Err(RpcError::invalid("process (a pid or a tag) is required"));
        };
        let scope = self.svc.for_tenant(&self.tenant);
        match (sel.pid, &sel.tag) {
            (Some(pid), _) => Ok(scope.command_by_pid(&self.sandbox, pid).await?),
            (None, Some(tag)) => Err(RpcError::not_found(format!(
                "no process tagged {:?}",
                space_api::truncate(tag, 64)
            ))),
            (None, None) => Err(RpcError::invalid("process (a pid or a tag) is required")),
        }
    }

    /// The selected process, which must still run.
    async fn running(&self, sel: Option<&Selector>) -> Result<Command, RpcError> {
        let cmd = self.select(sel).await?;
        if cmd.result.is_some() || cmd.state.is_terminal() {
            return Err(RpcError::not_found(format!(
                "process {} has ended",
                cmd.pid.unwrap_or(0)
            )));
        }
        Ok(cmd)
    }
}

async fn unary(cx: Cx, method: &str, headers: &HeaderMap, body: Body) -> Result<Value, RpcError> {
    let scope = cx.svc.for_tenant(&cx.tenant);
    match method {
        "List" => {
            let _: Value = connect::read_unary(headers, body).await?;
            let processes: Vec<Value> = scope
                .list_commands(&cx.sandbox)?
                .iter()
                .filter(|c| c.result.is_none() && !c.state.is_terminal())
                .filter_map(|c| {
                    let pid = c.pid?;
                    let (cmd, args) = c.argv.split_first()?;
                    let mut config = json!({ "cmd": cmd, "args": args, "envs": {} });
                    if let Some(cwd) = &c.cwd {
                        config["cwd"] = json!(cwd);
                    }
                    Some(json!({ "config": config, "pid": pid }))
                })
                .collect();
            Ok(json!({ "processes": processes }))
        }
        "SendSignal" => {
            let req: SendSignalRequest = connect::read_unary(headers, body).await?;
            let signal = match &req.signal {
                Value::String(s) if s == "SIGNAL_SIGKILL" => libc::SIGKILL,
                Value::String(s) if s == "SIGNAL_SIGTERM" => libc::SIGTERM,
                Value::Number(n) if n.as_i64() == Some(9) => libc::SIGKILL,
                Value::Number(n) if n.as_i64() == Some(15) => libc::SIGTERM,
                _ => {
                    return Err(RpcError::invalid(
                        "signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM",
                    ))
                }
            };
            let cmd = cx.running(req.process.as_ref()).await?;
            scope.signal_command(&cx.sandbox, &cmd.id, signal).await?;
            Ok(json!({}))
        }
        "SendInput" => {
            let req: SendInputRequest = connect::read_unary(headers, body).await?;
            let data = input_bytes(req.input.as_ref())?;
            let cmd = cx.running(req.process.as_ref()).await?;
            scope.write_stdin(&cx.sandbox, &cmd.id, data, false).await?;
            Ok(json!({}))
        }
        "CloseStdin" => {
            let req: Selected = connect::read_unary(headers, body).await?;
            let cmd = cx.running(req.process.as_ref()).await?;
            if cmd.pty.is_some() {
                return Err(RpcError::new(
                    "failed_precondition",
                    "a terminal's input cannot be closed; send Ctrl-D (0x04) instead",
                ));
            }
            scope
                .write_stdin(&cx.sandbox, &cmd.id, Bytes::new(), true)
                .await?;
            Ok(json!({}))
        }
        "Update" => {
            let req: UpdateRequest = connect::read_unary(headers, body).await?;
            let cmd = cx.running(req.process.as_ref()).await?;
            if let Some(size) = req.pty.and_then(|p| p.size) {
                let (rows, cols) = pty_dims(size)?;
                scope.resize(&cx.sandbox, &cmd.id, rows, cols).await?;
            }
            Ok(json!({}))
        }
        _ => Err(RpcError::new(
            "unimplemented",
            format!(
                "process.Process/{} is not a method",
                space_api::truncate(method, 64)
            ),
        )),
    }
}

fn pty_dims(size: PtySizeMsg) -> Result<(u16, u16), RpcError> {
    let ok = |n: u32| u16::try_from(n).ok().filter(|n| (1..=1000).contains(n));
    match (ok(size.rows), ok(size.cols)) {
        (Some(r), Some(c)) => Ok((r, c)),
        _ => Err(RpcError::invalid("pty rows and cols must be 1-1000")),
    }
}

fn input_bytes(input: Option<&Input>) -> Result<Bytes, RpcError> {
    let b64 = input
        .and_then(|i| i.stdin.as_deref().or(i.pty.as_deref()))
        .ok_or_else(|| RpcError::invalid("input (stdin or pty bytes) is required"))?;
    if b64.len() > MAX_STDIN_WRITE * 4 / 3 + 8 {
        return Err(RpcError::new(
            "resource_exhausted",
            format!("at most {MAX_STDIN_WRITE} bytes of input per message"),
        ));
    }
    let engine = &base64::engine::general_purpose::STANDARD;
    engine
        .decode(b64)
        .or_else(|_| base64::engine::general_purpose::URL_SAFE.decode(b64))
        .map(Bytes::from)
        .map_err(|_| RpcError::invalid("input is not base64"))
}

fn keepalive_interval(headers: &HeaderMap) -> Duration {
    headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map(|s| Duration::from_secs(s.clamp(1, 300)))
        .unwrap_or(DEFAULT_KEEPALIVE)
}

async fn start(cx: Cx, headers: &HeaderMap, req: StartRequest) -> Response {
    let user = match basic_user(headers) {
        Ok(u) => u,
        Err(e) => return connect::stream_error(e),
    };
    // envd kills a process at the call's deadline; so does its command here.
    let deadline = match connect::deadline(headers) {
        Ok(d) => d,
        Err(e) => return connect::stream_error(e),
    };
    // The command outlives the call's deadline by a second: the client hears
    // `deadline_exceeded` (the SDKs' timeout error) first, and the process dies right after.
    let timeout = deadline.map(|d| d.as_millis().div_ceil(1000) as u64 + 1);
    if req.process.cmd.is_empty() {
        return connect::stream_error(RpcError::invalid("process.cmd is required"));
    }
    let pty = match req.pty.as_ref() {
        Some(p) => match pty_dims(p.size.unwrap_or(PtySizeMsg { cols: 80, rows: 24 })) {
            Ok((rows, cols)) => Some(PtySize { rows, cols }),
            Err(e) => return connect::stream_error(e),
        },
        None => None,
    };
    if req.tag.is_some() {
        tracing::debug!("process tags are not kept");
    }
    // envd starts a process in its user's home unless told otherwise, so that relative
    // paths mean the same to a command and to the file calls; likewise here, when the
    // template has that home.
    let cwd = match req.process.cwd.filter(|c| !c.is_empty()) {
        Some(c) => Some(c),
        None => {
            let home = home_of(user.as_deref());
            let scope = cx.svc.for_tenant(&cx.tenant);
            match scope.stat_file(&cx.sandbox, &home).await {
                Ok(f) if f.kind == space_api::FileType::Dir => Some(home),
                _ => None,
            }
        }
    };
    let mut argv = vec![req.process.cmd];
    argv.extend(req.process.args);
    let create = CreateCommandRequest {
        argv: Some(argv),
        env: (!req.process.envs.is_empty()).then_some(req.process.envs),
        cwd,
        user,
        // envd's default, for clients that predate the field, is an open stdin.
        stdin: Some(req.stdin.unwrap_or(true) || pty.is_some()),
        pty,
        timeout_seconds: timeout,
        wait: Some(false),
        ..Default::default()
    };
    let cmd = match cx
        .svc
        .for_tenant(&cx.tenant)
        .create_command(&cx.sandbox, create)
        .await
    {
        Ok(c) => c,
        Err(e) => return connect::stream_error(e.into()),
    };
    follow(cx, cmd, keepalive_interval(headers), deadline)
}

async fn reconnect(cx: Cx, headers: &HeaderMap, req: Selected) -> Response {
    let deadline = match connect::deadline(headers) {
        Ok(d) => d,
        Err(e) => return connect::stream_error(e),
    };
    match cx.select(req.process.as_ref()).await {
        Ok(cmd) => follow(cx, cmd, keepalive_interval(headers), deadline),
        Err(e) => connect::stream_error(e),
    }
}

/// Streams a command as envd's process events: `start`, its output from the first
/// byte, keepalives, and `end`. The command runs on when the client goes; at the
/// client's deadline the stream ends with `deadline_exceeded`.
fn follow(cx: Cx, cmd: Command, keepalive: Duration, deadline: Option<Duration>) -> Response {
    let (tx, resp) = connect::stream_response();
    tokio::spawn(async move {
        let pumped = match deadline {
            Some(d) => tokio::time::timeout(d, pump(&cx, &cmd, &tx, keepalive))
                .await
                .unwrap_or_else(|_| {
                    Err(RpcError::new(
                        "deadline_exceeded",
                        "the call's deadline (Connect-Timeout-Ms) passed",
                    ))
                }),
            None => pump(&cx, &cmd, &tx, keepalive).await,
        };
        tx.end(pumped.err()).await;
    });
    resp
}

async fn pump(cx: &Cx, cmd: &Command, tx: &StreamTx, keepalive: Duration) -> Result<(), RpcError> {
    let pid = cmd.pid.unwrap_or(0);
    if !tx
        .send(json!({ "event": { "start": { "pid": pid } } }))
        .await
    {
        return Ok(());
    }
    let mut rx = cx.svc.for_tenant(&cx.tenant).command_output(
        &cx.sandbox,
        &cmd.id,
        CommandOutputQuery {
            offset: 0,
            follow: true,
            view: View::Combined,
        },
    )?;
    let field = |s: Stream| match (cmd.pty.is_some(), s) {
        (true, _) => "pty",
        (false, Stream::Stdout) => "stdout",
        (false, Stream::Stderr) => "stderr",
    };
    let b64 = &base64::engine::general_purpose::STANDARD;
    let mut ticks = tokio::time::interval(keepalive);
    ticks.tick().await;
    loop {
        let ev = tokio::select! {
            ev = rx.recv() => ev,
            _ = ticks.tick() => {
                if !tx.send(json!({ "event": { "keepalive": {} } })).await {
                    return Ok(());
                }
                continue;
            }
            _ = tx.closed() => return Ok(()),
        };
        match ev {
            Some(OutputEvent::Chunk { stream, data, .. }) => {
                for part in data.chunks(64 << 10) {
                    let v = json!({ "event": { "data": { field(stream): b64.encode(part) } } });
                    if !tx.send(v).await {
                        return Ok(());
                    }
                }
            }
            Some(OutputEvent::End(done)) => {
                tx.send(json!({ "event": { "end": end_event(&done) } }))
                    .await;
                return Ok(());
            }
            None => {
                return Err(RpcError::new(
                    "unavailable",
                    "the command's output ended before its result",
                ))
            }
        }
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => "killed",
        libc::SIGTERM => "terminated",
        libc::SIGINT => "interrupt",
        libc::SIGHUP => "hangup",
        libc::SIGSEGV => "segmentation fault",
        libc::SIGABRT => "aborted",
        libc::SIGPIPE => "broken pipe",
        _ => "signal",
    }
}

/// envd's `EndEvent`, as Go's `ProcessState` would fill it.
fn end_event(cmd: &Command) -> Value {
    let Some(r) = &cmd.result else {
        let why = cmd
            .lost_reason
            .clone()
            .unwrap_or_else(|| "the command was lost".into());
        return json!({ "exitCode": -1, "exited": false, "status": "lost", "error": why });
    };
    let mut v = match (r.exit_code, r.signal) {
        (Some(code), _) => json!({
            "exitCode": code, "exited": true, "status": format!("exit status {code}")
        }),
        (None, Some(sig)) => json!({
            "exitCode": -1, "exited": false, "status": format!("signal: {}", signal_name(sig))
        }),
        (None, None) => json!({ "exitCode": -1, "exited": false, "status": "unknown" }),
    };
    if r.timed_out {
        v["error"] = json!("the command ran past its timeout and was killed");
    } else if r.oom_killed {
        v["error"] = json!("the command ran out of memory and was killed");
    }
    v
}

async fn stream_input(cx: Cx, headers: &HeaderMap, body: Body) -> Response {
    // A client stream is answered once it has ended, with one message and the end. No
    // answer goes out before: a client that saw one would stop sending.
    let messages = match connect::read_stream::<StreamInputRequest>(headers, body) {
        Ok(m) => m,
        Err(e) => return connect::stream_error(e),
    };
    match feed(&cx, messages).await {
        Ok(()) => connect::stream_reply(json!({})),
        Err(e) => connect::stream_error(e),
    }
}

async fn feed(
    cx: &Cx,
    messages: impl futures::Stream<Item = Result<StreamInputRequest, RpcError>>,
) -> Result<(), RpcError> {
    futures::pin_mut!(messages);
    let mut target: Option<Command> = None;
    while let Some(msg) = messages.next().await {
        let msg = msg?;
        if let Some(start) = msg.start {
            target = Some(cx.running(start.process.as_ref()).await?);
        } else if let Some(data) = msg.data {
            let Some(cmd) = &target else {
                return Err(RpcError::invalid("the first message must be start"));
            };
            let bytes = input_bytes(data.input.as_ref())?;
            cx.svc
                .for_tenant(&cx.tenant)
                .write_stdin(&cx.sandbox, &cmd.id, bytes, false)
                .await?;
        } else if msg.keepalive.is_none() {
            return Err(RpcError::invalid("a message is start, data or keepalive"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use space_api::{CommandState, ProcessResult};

    fn cmd(result: Option<ProcessResult>) -> Command {
        serde_json::from_value(json!({
            "id": "cmd_x", "sandbox_id": "sb_x", "state": "exited", "argv": ["true"],
            "cwd": null, "user": null, "created_at": "", "ended_at": null, "result": result,
            "lost_reason": null, "output_url": ""
        }))
        .unwrap()
    }

    #[test]
    fn ends_read_like_gos_process_state() {
        let r = ProcessResult {
            exit_code: Some(3),
            ..Default::default()
        };
        let v = end_event(&cmd(Some(r)));
        assert_eq!(
            v,
            json!({"exitCode": 3, "exited": true, "status": "exit status 3"})
        );
        let r = ProcessResult {
            signal: Some(9),
            timed_out: true,
            ..Default::default()
        };
        let v = end_event(&cmd(Some(r)));
        assert_eq!(v["status"], "signal: killed");
        assert_eq!(v["exitCode"], -1);
        assert!(v["error"].is_string());
        let mut lost = cmd(None);
        lost.state = CommandState::Lost;
        assert_eq!(end_event(&lost)["status"], "lost");
    }

    #[test]
    fn input_is_bounded_base64() {
        let i = Input {
            stdin: Some("aGk=".into()),
            pty: None,
        };
        assert_eq!(&input_bytes(Some(&i)).unwrap()[..], b"hi");
        assert!(input_bytes(None).is_err());
        let big = Input {
            stdin: Some("A".repeat(MAX_STDIN_WRITE * 2)),
            pty: None,
        };
        assert_eq!(
            input_bytes(Some(&big)).unwrap_err().code,
            "resource_exhausted"
        );
    }
}
