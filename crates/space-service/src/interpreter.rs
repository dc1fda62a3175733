//! Code contexts: stateful Python (Jupyter) and bash sessions in a sandbox of the
//! `code-interpreter` template, for every front door.
//!
//! The execution service inside the sandbox (`interpreter.py serve`, beside this file)
//! owns the contexts and listens on a Unix socket there. Each request here is an
//! ordinary command of the tenant's, `space-agent relay` (the agent's binary, in every
//! sandbox), that sends one JSON request to the service and prints its NDJSON events:
//! so an execution is admitted, limited, recorded and replayable like any command, and
//! its output never bypasses the sandbox's output quota. The service is started on
//! first use as a command of its own; its code comes from this server on that
//! command's stdin, never from the sandbox's files, so it always matches the server,
//! and any template with Debian's `python3-ipykernel` works.
//!
//! Everything the service prints is untrusted: each line is parsed with a bound on its
//! size, and only JSON objects with a string `type` go on.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use serde_json::{json, Value};
use space_api::{
    ApiError, CodeContext, Command, CreateCommandRequest, CreateContextRequest, ErrorCode,
    ExecuteRequest,
};
use tokio::sync::mpsc;

use super::output::View;
use super::scope::{TenantService, MAX_STDIN_WRITE};
use super::{CommandOutputQuery, OutputEvent, Result, ServiceError};

/// The execution service. Its command reads it from stdin, so its argv (what command
/// listings show) stays one line.
const INTERPRETER_PY: &str = include_str!("interpreter.py");
/// `python3 -c` of the service: the program is all of stdin.
const SERVE_BOOT: &str = "import sys; exec(compile(sys.stdin.read(), 'space-interpreter', 'exec'))";
/// Where the service listens (interpreter.py's `SOCKET`).
const SOCKET: &str = "/tmp/.space-interpreter/sock";
/// The agent's binary in every sandbox: a request's client is `space-agent relay`.
const AGENT: &str = "/.space/bin/space-agent";

/// Largest cell: the request travels as the client's stdin, one write.
pub const MAX_CODE_BYTES: usize = MAX_STDIN_WRITE - 8192;
/// An execution's timeout when the request names none.
pub const DEFAULT_EXECUTE_TIMEOUT: u64 = 300;
/// The longest timeout an execution may ask for.
pub const MAX_EXECUTE_TIMEOUT: u64 = 24 * 3600;
/// Longest line of events accepted from the sandbox (a chart is a few hundred KiB).
const MAX_EVENT_LINE: usize = 32 << 20;
/// What the relay exits with when the service is not running (nothing listens).
const NOT_RUNNING: i32 = 75;
/// How long a client waits for a service that is starting (kernels start in seconds).
const START_WAIT_SECONDS: u64 = 60;
/// Time a context request (create, restart) may take beyond its own work.
const REQUEST_SLACK_SECONDS: u64 = 120;

/// One execution under way: the command that records it, and its events.
pub struct Execution {
    pub command_id: String,
    pub events: mpsc::Receiver<Value>,
}

fn no_interpreter() -> ServiceError {
    ServiceError::Conflict(
        "this sandbox has no code interpreter: create it from the code-interpreter template".into(),
    )
}

/// A `failed` event as the error it names.
fn failed(event: &Value) -> ServiceError {
    let message = event["message"]
        .as_str()
        .map(|m| super::truncate(m, 500).to_string())
        .unwrap_or_else(|| "the code interpreter failed".into());
    match event["code"].as_str() {
        Some("not_found") => ServiceError::NotFound(message),
        Some("invalid_request") => ServiceError::BadRequest(message),
        Some("unavailable") => ServiceError::Conflict(message),
        _ => ServiceError::Internal(format!("code interpreter: {message}")),
    }
}

fn validate_context_id(ctx: &str) -> Result<()> {
    let ok = ctx.len() > 4
        && ctx.len() <= 64
        && ctx.starts_with("ctx_")
        && ctx[4..].bytes().all(|b| b.is_ascii_alphanumeric());
    match ok {
        true => Ok(()),
        false => Err(ServiceError::NotFound(format!(
            "no context {}",
            super::truncate(ctx, 64)
        ))),
    }
}

/// Splits a command's stdout into event lines; bounded.
#[derive(Default)]
struct Lines {
    buf: BytesMut,
    /// Dropping the rest of a line that was too long.
    skipping: bool,
}

impl Lines {
    /// The complete events in `data`; an over-long line becomes an `error` event.
    fn push(&mut self, data: &[u8], out: &mut Vec<Value>) {
        for piece in data.split_inclusive(|b| *b == b'\n') {
            let whole = piece.ends_with(b"\n");
            if self.skipping {
                self.skipping = !whole;
                continue;
            }
            if self.buf.len() + piece.len() > MAX_EVENT_LINE {
                self.buf.clear();
                self.skipping = !whole;
                out.push(json!({
                    "type": "error",
                    "name": "OutputTooLarge",
                    "value": format!("an output of more than {MAX_EVENT_LINE} bytes was dropped"),
                    "traceback": "",
                }));
                continue;
            }
            self.buf.extend_from_slice(piece);
            if whole {
                let line = self.buf.split();
                if let Ok(v) = serde_json::from_slice::<Value>(&line) {
                    if v.is_object() && v["type"].is_string() {
                        out.push(v);
                    }
                }
            }
        }
    }
}

impl TenantService<'_> {
    /// Runs one request through the sandbox's execution service, starting it if it is
    /// not running. Returns the command, its first event (read to see whether the
    /// service was there), and the rest as they come; the channel ends with the command.
    async fn interpreter_call(
        &self,
        id: &str,
        request: &Value,
        timeout: u64,
    ) -> Result<(Command, Option<Value>, mpsc::Receiver<Value>)> {
        let body = Bytes::from(format!("{request}\n"));
        let mut service: Option<String> = None;
        loop {
            let wait = if service.is_some() {
                START_WAIT_SECONDS
            } else {
                0
            };
            let (cmd, mut events) = self.interpreter_try(id, &body, timeout, wait).await?;
            let first = match &service {
                None => events.recv().await,
                // A service that ends while its first client waits never listened: no
                // need to wait out the client.
                Some(started) => tokio::select! {
                    first = events.recv() => first,
                    ended = self.get_command(id, started, Duration::from_secs(wait)) => {
                        if ended.is_ok_and(|c| c.result.is_some()) {
                            let _ = self.signal_command(id, &cmd.id, libc::SIGKILL).await;
                            return Err(self.service_failed(id, started).await);
                        }
                        events.recv().await
                    }
                },
            };
            let not_running = first
                .as_ref()
                .is_some_and(|ev| ev["type"] == "__exit" && ev["exit_code"] == NOT_RUNNING);
            match (not_running, &service) {
                (false, _) => return Ok((cmd, first, events)),
                (true, None) => service = Some(self.start_interpreter(id).await?),
                (true, Some(started)) => return Err(self.service_failed(id, started).await),
            }
        }
    }

    /// Starts the execution service as a command of its own (a second one exits at
    /// once: the service holds a lock): its command's id.
    async fn start_interpreter(&self, id: &str) -> Result<String> {
        let req = CreateCommandRequest {
            argv: Some(vec![
                "python3".into(),
                "-I".into(),
                "-c".into(),
                SERVE_BOOT.into(),
                "serve".into(),
            ]),
            stdin: Some(true),
            ..Default::default()
        };
        let cmd = self.create_command(id, req).await?;
        if let Some(126 | 127) = cmd.result.as_ref().and_then(|r| r.exit_code) {
            return Err(no_interpreter());
        }
        let program = Bytes::from_static(INTERPRETER_PY.as_bytes());
        if self.write_stdin(id, &cmd.id, program, true).await.is_err() {
            let ended = self
                .get_command(id, &cmd.id, Duration::from_secs(5))
                .await?;
            if let Some(126 | 127) = ended.result.and_then(|r| r.exit_code) {
                return Err(no_interpreter());
            }
        }
        Ok(cmd.id)
    }

    /// Why a service that was started never listened.
    async fn service_failed(&self, id: &str, service: &str) -> ServiceError {
        let why = match self.get_command(id, service, Duration::ZERO).await {
            Ok(cmd) => match cmd.result.and_then(|r| r.exit_code) {
                Some(126 | 127) => return no_interpreter(),
                Some(code) => format!("its command {service} ended with exit code {code}"),
                None => format!("its command {service} runs but does not listen"),
            },
            Err(e) => e.to_string(),
        };
        ServiceError::Unavailable(format!(
            "the code interpreter's service did not start: {why}; the command's output says why"
        ))
    }

    /// One client command: `wait` is how long it waits for the service's socket. The
    /// channel carries the events, then `{"type": "__exit", "exit_code"}` (ours).
    async fn interpreter_try(
        &self,
        id: &str,
        body: &Bytes,
        timeout: u64,
        wait: u64,
    ) -> Result<(Command, mpsc::Receiver<Value>)> {
        let req = CreateCommandRequest {
            argv: Some(vec![
                AGENT.into(),
                "relay".into(),
                SOCKET.into(),
                wait.to_string(),
            ]),
            stdin: Some(true),
            timeout_seconds: Some(timeout.saturating_add(wait + REQUEST_SLACK_SECONDS)),
            ..Default::default()
        };
        let cmd = self.create_command(id, req).await?;
        if let Err(e) = self.write_stdin(id, &cmd.id, body.clone(), true).await {
            // A client that could not start has ended already.
            let ended = self
                .get_command(id, &cmd.id, Duration::from_secs(5))
                .await?;
            let code = ended.result.and_then(|r| r.exit_code);
            return Err(match code {
                Some(126 | 127) => no_interpreter(),
                _ => e,
            });
        }
        let q = CommandOutputQuery {
            offset: 0,
            follow: true,
            view: View::Stdout,
        };
        let mut output = self.command_output(id, &cmd.id, q)?;
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            let mut lines = Lines::default();
            let mut out = Vec::new();
            while let Some(item) = output.recv().await {
                match item {
                    OutputEvent::Chunk { data, .. } => {
                        lines.push(&data, &mut out);
                        for ev in out.drain(..) {
                            if tx.send(ev).await.is_err() {
                                return;
                            }
                        }
                    }
                    OutputEvent::End(cmd) => {
                        let r = cmd.result.unwrap_or_default();
                        let _ = tx
                            .send(json!({
                                "type": "__exit",
                                "exit_code": r.exit_code,
                                "timed_out": r.timed_out,
                                "state": cmd.state,
                            }))
                            .await;
                        return;
                    }
                }
            }
        });
        Ok((cmd, rx))
    }

    /// A request whose answer is one event of type `want`.
    async fn interpreter_answer(&self, id: &str, request: Value, want: &str) -> Result<Value> {
        let (_, first, mut events) = self
            .interpreter_call(id, &request, REQUEST_SLACK_SECONDS)
            .await?;
        let mut next = first;
        while let Some(ev) = next {
            match ev["type"].as_str() {
                Some(t) if t == want => return Ok(ev),
                Some("failed") => return Err(failed(&ev)),
                Some("__exit") if missing(&ev) => return Err(no_interpreter()),
                Some("__exit") => break,
                _ => {}
            }
            next = events.recv().await;
        }
        Err(ServiceError::Internal(
            "the code interpreter ended without an answer".into(),
        ))
    }

    /// `POST /v1/sandboxes/{id}/contexts`.
    pub async fn create_context(&self, id: &str, req: CreateContextRequest) -> Result<CodeContext> {
        self.sandbox(id)?;
        let language = req.language.unwrap_or_else(|| "python".into());
        check_language(&language)?;
        if let Some(cwd) = &req.cwd {
            check_cwd(cwd)?;
        }
        let ev = self
            .interpreter_answer(
                id,
                json!({"op": "create", "language": language, "cwd": req.cwd}),
                "context",
            )
            .await?;
        context_of(&ev)
    }

    /// `GET /v1/sandboxes/{id}/contexts`.
    pub async fn list_contexts(&self, id: &str) -> Result<Vec<CodeContext>> {
        self.sandbox(id)?;
        let ev = self
            .interpreter_answer(id, json!({"op": "list"}), "contexts")
            .await?;
        ev["contexts"]
            .as_array()
            .map(|all| all.iter().map(context_of).collect())
            .unwrap_or_else(|| Ok(Vec::new()))
    }

    /// `DELETE /v1/sandboxes/{id}/contexts/{ctx}`: its kernel stops.
    pub async fn delete_context(&self, id: &str, ctx: &str) -> Result<CodeContext> {
        self.sandbox(id)?;
        validate_context_id(ctx)?;
        let ev = self
            .interpreter_answer(id, json!({"op": "delete", "id": ctx}), "context")
            .await?;
        context_of(&ev)
    }

    /// `POST /v1/sandboxes/{id}/contexts/{ctx}/restart`: a fresh kernel, its state gone.
    pub async fn restart_context(&self, id: &str, ctx: &str) -> Result<CodeContext> {
        self.sandbox(id)?;
        validate_context_id(ctx)?;
        let ev = self
            .interpreter_answer(id, json!({"op": "restart", "id": ctx}), "context")
            .await?;
        context_of(&ev)
    }

    /// `POST /v1/sandboxes/{id}/contexts/{ctx}/execute`: the events as they come. An
    /// unknown context is a 404 before anything streams. The final `end` names the
    /// command that recorded the execution.
    pub async fn execute(&self, id: &str, ctx: &str, req: ExecuteRequest) -> Result<Execution> {
        self.sandbox(id)?;
        validate_context_id(ctx)?;
        self.execute_in(id, json!({ "id": ctx }), req).await
    }

    /// An execution in the default context of `language` (made on first use), as
    /// E2B's `run_code` without a context does.
    /// `cwd` is the default context's directory when this call makes it.
    pub async fn execute_default(
        &self,
        id: &str,
        language: &str,
        cwd: Option<&str>,
        req: ExecuteRequest,
    ) -> Result<Execution> {
        self.sandbox(id)?;
        check_language(language)?;
        if let Some(cwd) = cwd {
            check_cwd(cwd)?;
        }
        self.execute_in(id, json!({ "language": language, "cwd": cwd }), req)
            .await
    }

    async fn execute_in(&self, id: &str, target: Value, req: ExecuteRequest) -> Result<Execution> {
        if req.code.len() > MAX_CODE_BYTES {
            return Err(ServiceError::Api(ApiError::new(
                ErrorCode::BodyTooLarge,
                format!("code is limited to {MAX_CODE_BYTES} bytes"),
            )));
        }
        let timeout = req.timeout_seconds.unwrap_or(DEFAULT_EXECUTE_TIMEOUT);
        if timeout == 0 || timeout > MAX_EXECUTE_TIMEOUT {
            return Err(ServiceError::BadRequest(format!(
                "timeout_seconds must be 1 to {MAX_EXECUTE_TIMEOUT}"
            )));
        }
        let env = req.env.unwrap_or_default();
        for (k, v) in &env {
            let name_ok = !k.is_empty()
                && !k.starts_with(|c: char| c.is_ascii_digit())
                && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
            if !name_ok || v.contains('\0') {
                return Err(ServiceError::BadRequest(format!(
                    "env: {:?} is not a variable name with a value",
                    super::truncate(k, 64)
                )));
            }
        }
        let mut request =
            json!({"op": "execute", "code": req.code, "timeout": timeout, "env": env});
        if let (Some(r), Some(t)) = (request.as_object_mut(), target.as_object()) {
            r.extend(t.clone());
        }
        let (cmd, first, mut events) = self.interpreter_call(id, &request, timeout).await?;
        // The service accepts (or refuses) before the code runs: errors are statuses.
        let first = match first {
            Some(ev) if ev["type"] == "accepted" => None,
            Some(ev) if ev["type"] == "failed" => return Err(failed(&ev)),
            Some(ev) if missing(&ev) => return Err(no_interpreter()),
            other => other,
        };
        let (tx, rx) = mpsc::channel(64);
        let command_id = cmd.id.clone();
        let started = std::time::Instant::now();
        let owned = self.owned();
        let sandbox = id.to_string();
        tokio::spawn(async move {
            let mut gone = false;
            let mut next = match first {
                Some(ev) => Some(ev),
                None => tokio::select! {
                    ev = events.recv() => ev,
                    () = tx.closed() => {
                        gone = true;
                        None
                    }
                },
            };
            while let Some(mut ev) = next {
                let out = match ev["type"].as_str() {
                    Some("end") => {
                        ev["command_id"] = json!(command_id);
                        let _ = tx.send(ev).await;
                        return;
                    }
                    Some("__exit") => {
                        // The command ended without the service's `end`: a timeout of
                        // the command itself, a kill, or the sandbox went away.
                        let why = match ev["timed_out"].as_bool() {
                            Some(true) => "the execution's command ran past its timeout",
                            _ => "the execution ended before the code interpreter finished it",
                        };
                        let lost = json!({"type": "error", "name": "ExecutionLost",
                            "value": why, "traceback": ""});
                        let end = json!({"type": "end", "execution_count": null,
                            "duration_ms": started.elapsed().as_millis() as u64,
                            "command_id": command_id});
                        let _ = tx.send(lost).await;
                        let _ = tx.send(end).await;
                        return;
                    }
                    Some("failed") => json!({"type": "error", "name": "InterpreterError",
                        "value": ev["message"], "traceback": ""}),
                    _ => ev,
                };
                if tx.send(out).await.is_err() {
                    gone = true;
                    break;
                }
                // A silent execution must notice its reader leave too.
                next = tokio::select! {
                    ev = events.recv() => ev,
                    () = tx.closed() => {
                        gone = true;
                        break;
                    }
                };
            }
            if gone {
                // Nobody reads any more: end the client, and the service interrupts
                // the code when it sees the client go.
                let scope = owned.scoped();
                let _ = scope
                    .signal_command(&sandbox, &command_id, libc::SIGKILL)
                    .await;
            }
        });
        Ok(Execution {
            command_id: cmd.id,
            events: rx,
        })
    }
}

fn check_cwd(cwd: &str) -> Result<()> {
    match cwd.starts_with('/') && cwd.len() <= 4096 && !cwd.contains('\0') {
        true => Ok(()),
        false => Err(ServiceError::BadRequest(
            "cwd must be an absolute path".into(),
        )),
    }
}

fn check_language(language: &str) -> Result<()> {
    match language {
        "python" | "bash" => Ok(()),
        other => Err(ServiceError::BadRequest(format!(
            "language must be python or bash, not {:?}",
            super::truncate(other, 64)
        ))),
    }
}

/// Whether a relay's exit says the sandbox has no interpreter: the service's command
/// could not run `python3`, so nothing ever listened.
fn missing(exit: &Value) -> bool {
    matches!(exit["exit_code"].as_i64(), Some(126 | 127))
}

fn context_of(ev: &Value) -> Result<CodeContext> {
    let field = |k: &str| {
        ev[k]
            .as_str()
            .map(|s| super::truncate(s, 4096).to_string())
            .ok_or_else(|| {
                ServiceError::Internal(format!("code interpreter: a context without {k}"))
            })
    };
    Ok(CodeContext {
        id: field("id")?,
        language: field("language")?,
        cwd: field("cwd")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_lines_are_bounded_and_only_objects_with_a_type_pass() {
        let mut lines = Lines::default();
        let mut out = Vec::new();
        lines.push(b"{\"type\":\"stdout\",\"te", &mut out);
        assert!(out.is_empty());
        lines.push(
            b"xt\":\"a\"}\nnot json\n[1]\n{\"no\":1}\n{\"type\":\"end\"}\n",
            &mut out,
        );
        assert_eq!(out.len(), 2, "{out:?}");
        assert_eq!(out[0]["text"], "a");
        assert_eq!(out[1]["type"], "end");
        out.clear();
        let big = vec![b'x'; MAX_EVENT_LINE + 1];
        lines.push(&big, &mut out);
        lines.push(b"still the long line\n{\"type\":\"end\"}\n", &mut out);
        assert_eq!(out.len(), 2, "{out:?}");
        assert_eq!(out[0]["name"], "OutputTooLarge");
        assert_eq!(out[1]["type"], "end");
    }

    #[test]
    fn context_ids_are_checked_before_they_reach_a_sandbox() {
        assert!(validate_context_id("ctx_0123abcd").is_ok());
        for bad in [
            "",
            "ctx_",
            "../x",
            "ctx_a/b",
            "ctx_a\"}",
            &"ctx_a".repeat(20),
        ] {
            assert!(validate_context_id(bad).is_err(), "{bad}");
        }
    }
}
