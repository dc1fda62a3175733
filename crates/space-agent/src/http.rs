//! The agent's HTTP/2 endpoints (see [`space_agent::protocol`]): a thin parser
//! in front of [`Agent`].

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde::Serialize;
use space_agent::protocol::{
    AgentInfo, ErrorBody, Frame, FrameDecoder, SignalRequest, SpawnReply, SpawnRequest,
    MAX_JSON_BODY, PROTOCOL_VERSION,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::command::{self, AttachError, Cmd, Sink, Source};
use crate::pty::Pty;
use crate::reaper::{Reaper, SignalError};
use crate::spawn;
use crate::watch::{self, Watched};

pub type Body = BoxBody<Bytes, Infallible>;

/// Encoded frame parts waiting for h2 send capacity, per attach (an output frame is two:
/// its header and its data, see [`Frame::to_parts`]). Small, so output stays in the
/// retained queue (where acks can drop it) rather than here.
const ATTACH_QUEUE: usize = 4;

/// Longest timeout honoured; anything longer is the same as this.
const MAX_TIMEOUT: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// Everything the agent holds across host connections.
#[derive(Debug, Default)]
pub struct Agent {
    pub reaper: Arc<Reaper>,
    commands: Mutex<BTreeMap<String, Arc<Cmd>>>,
    /// Told to drop the host connection (before a checkpoint, which cannot save one).
    pub quiesce: tokio::sync::Notify,
    /// Told to drop the host connection and dial again at once, as after a broken link
    /// (only the `agent:drop` failpoint does).
    pub drop_link: tokio::sync::Notify,
    /// The value of `woken` when the host last quiesced the agent: until it changes (the
    /// host wakes the agent after the checkpoint's restore, or when the suspend is
    /// abandoned), the agent does not dial, so no connect is ever in flight while the
    /// sandbox is checkpointed (a restored connect left the agent unable to reach the
    /// host again).
    pub held_at: std::sync::Mutex<Option<u64>>,
    /// Counts the host's wake-ups (SIGUSR1).
    pub woken: tokio::sync::watch::Sender<u64>,
    /// On from a quiesce until the agent is woken (or its hold ends).
    pub quiet: Quiet,
    /// The epoll that commands' pipes are watched with (see [`crate::watch`]), made on
    /// first use, in the runtime.
    watch: std::sync::OnceLock<Arc<crate::watch::Reactor>>,
}

/// Whether the agent is quiesced. Meanwhile its own periodic work (the memory watch,
/// the polls of commands without a cgroup) stops, so that no thread of the agent is
/// running when the sandbox is checkpointed. (This came from reading restored agents'
/// crashes as threads saved while running; their cause was stale epoll events, see
/// [`crate::watch`]. A quiet agent is kept: it costs nothing while held.)
#[derive(Debug, Default)]
pub struct Quiet {
    on: std::sync::Mutex<bool>,
    cv: std::sync::Condvar,
    off: tokio::sync::Notify,
    entered: tokio::sync::Notify,
}

impl Quiet {
    pub fn set(&self, on: bool) {
        *self.on.lock().unwrap_or_else(|e| e.into_inner()) = on;
        self.cv.notify_all();
        if on {
            self.entered.notify_waiters();
        } else {
            self.off.notify_waiters();
        }
    }

    /// Sleeps for `pause` on the calling thread, or less when the agent is quiesced
    /// meanwhile.
    pub fn sleep_blocking(&self, pause: Duration) {
        let on = self.on.lock().unwrap_or_else(|e| e.into_inner());
        drop(
            self.cv
                .wait_timeout_while(on, pause, |on| !*on)
                .unwrap_or_else(|e| e.into_inner()),
        );
    }

    /// Sleeps like [`Self::sleep_blocking`], and wakes early too when `wake()` holds
    /// after a [`Self::nudge`].
    pub fn sleep_blocking_unless(&self, pause: Duration, wake: impl Fn() -> bool) {
        let on = self.on.lock().unwrap_or_else(|e| e.into_inner());
        drop(
            self.cv
                .wait_timeout_while(on, pause, |on| !*on && !wake())
                .unwrap_or_else(|e| e.into_inner()),
        );
    }

    /// Wakes the threads in [`Self::sleep_blocking_unless`] to look at their condition.
    pub fn nudge(&self) {
        let _on = self.on.lock().unwrap_or_else(|e| e.into_inner());
        self.cv.notify_all();
    }

    /// Waits until the agent is quiesced.
    pub async fn entered(&self) {
        self.entered.notified().await;
    }

    pub(crate) fn is_on(&self) -> bool {
        *self.on.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Blocks the calling thread while the agent is quiesced.
    pub fn wait_off_blocking(&self) {
        let on = self.on.lock().unwrap_or_else(|e| e.into_inner());
        drop(
            self.cv
                .wait_while(on, |on| *on)
                .unwrap_or_else(|e| e.into_inner()),
        );
    }

    /// Waits while the agent is quiesced (no timer runs meanwhile).
    pub async fn off(&self) {
        loop {
            let woken = self.off.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if !self.is_on() {
                return;
            }
            woken.await;
        }
    }
}

impl Agent {
    /// The epoll that commands' pipes are watched with. Call in the runtime.
    pub fn reactor(&self) -> std::io::Result<Arc<crate::watch::Reactor>> {
        if let Some(r) = self.watch.get() {
            return Ok(r.clone());
        }
        let r = crate::watch::Reactor::start()?;
        Ok(self.watch.get_or_init(|| r).clone())
    }

    fn commands(&self) -> MutexGuard<'_, BTreeMap<String, Arc<Cmd>>> {
        self.commands.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get(&self, id: &str) -> Option<Arc<Cmd>> {
        self.commands().get(id).cloned()
    }

    /// The command whose processes carry `tag` (see `tree`).
    pub fn command_with_tag(&self, tag: u64) -> Option<Arc<Cmd>> {
        self.commands()
            .values()
            .find(|c| c.tag() == Some(tag))
            .cloned()
    }

    /// Forgets an exited command; false if it still runs.
    fn forget(&self, cmd: &Arc<Cmd>) -> bool {
        if !cmd.exited() {
            return false;
        }
        let mut map = self.commands();
        if map.get(&cmd.id).is_some_and(|c| Arc::ptr_eq(c, cmd)) {
            map.remove(&cmd.id);
        }
        drop(map);
        cmd.forgotten.cancel();
        cmd.end_attach();
        true
    }
}

/// A response body fed by a channel of encoded frames.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|o| o.map(|b| Ok(http_body::Frame::data(b))))
    }
}

fn json<T: Serialize>(status: StatusCode, value: &T) -> Response<Body> {
    let body = serde_json::to_vec(value).unwrap_or_default();
    let mut r = Response::new(Full::new(Bytes::from(body)).boxed());
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response<Body> {
    json(status, &ErrorBody::new(code, message))
}

fn empty(status: StatusCode) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::new()).boxed());
    *r.status_mut() = status;
    r
}

fn not_found(id: &str) -> Response<Body> {
    error(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no command '{id}'"),
    )
}

fn method_not_allowed() -> Response<Body> {
    error(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "method not allowed",
    )
}

/// Reads a JSON body of at most [`MAX_JSON_BODY`] bytes.
async fn read_json<T: serde::de::DeserializeOwned>(body: Incoming) -> Result<T, Response<Body>> {
    let bytes = match Limited::new(body, MAX_JSON_BODY).collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return Err(error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                "request body too large",
            ))
        }
        Err(_) => {
            return Err(error(
                StatusCode::BAD_REQUEST,
                "bad_request",
                "could not read request body",
            ))
        }
    };
    serde_json::from_slice(&bytes).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("invalid JSON: {e}"),
        )
    })
}

/// Routes one request.
pub async fn handle(agent: Arc<Agent>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let segs: Vec<&str> = path
        .strip_prefix("/v1/")
        .map(|p| p.split('/').collect())
        .unwrap_or_default();
    let method = req.method().clone();
    if let Some(kind) = request_kind(&segs, &method) {
        if crate::failpoint::drop_before(kind) {
            // The connection goes before this is answered; the answer goes nowhere.
            agent.drop_link.notify_one();
            tokio::time::sleep(Duration::from_secs(1)).await;
            return error(StatusCode::SERVICE_UNAVAILABLE, "failpoint", "dropped");
        }
    }
    match (segs.as_slice(), method) {
        (["info"], Method::GET) => info(&agent),
        (["info"], _) => method_not_allowed(),
        (["quiesce"], Method::POST) => {
            // The connection is dropped right away; the host waits for that, not for this answer.
            let woken = *agent.woken.borrow();
            *agent.held_at.lock().unwrap_or_else(|e| e.into_inner()) = Some(woken);
            agent.quiet.set(true);
            agent.quiesce.notify_one();
            empty(StatusCode::NO_CONTENT)
        }
        (["quiesce"], _) => method_not_allowed(),
        (["commands"], Method::GET) => list(&agent),
        (["commands"], Method::POST) => spawn_command(agent, req.into_body()).await,
        (["commands"], _) => method_not_allowed(),
        (["commands", id], Method::DELETE) => delete(&agent, id),
        (["commands", _], _) => method_not_allowed(),
        (["commands", id, "attach"], Method::POST) => {
            let query = req.uri().query().unwrap_or("").to_string();
            attach(agent, id, &query, req.into_body())
        }
        (["commands", id, "signal"], Method::POST) => signal(&agent, id, req.into_body()).await,
        (["commands", _, "attach" | "signal"], _) => method_not_allowed(),
        (["files"], _) => crate::files::handle("", req).await,
        (["files", op], _) => crate::files::handle(op, req).await,
        _ => error(StatusCode::NOT_FOUND, "not_found", "no such endpoint"),
    }
}

/// What the `agent:drop` failpoint calls a request (see `failpoint`).
fn request_kind(segs: &[&str], method: &Method) -> Option<&'static str> {
    Some(match (segs, method) {
        (["commands", _, "signal"], &Method::POST) => "signal",
        (["files"], &Method::GET) => "download",
        (["files"], &Method::PUT) => "upload",
        (["files"], &Method::DELETE) => "remove",
        (["files", "list"], _) => "list",
        (["files", "stat"], _) => "stat",
        (["files", "mkdir"], _) => "mkdir",
        (["files", "move"], _) => "move",
        _ => return None,
    })
}

fn info(agent: &Agent) -> Response<Body> {
    json(
        StatusCode::OK,
        &AgentInfo {
            protocol: PROTOCOL_VERSION,
            agent_version: env!("CARGO_PKG_VERSION").to_string(),
            pid: std::process::id(),
            commands: agent.commands().len(),
        },
    )
}

fn list(agent: &Agent) -> Response<Body> {
    let cmds: Vec<Arc<Cmd>> = agent.commands().values().cloned().collect();
    let infos: Vec<_> = cmds.iter().map(|c| c.info()).collect();
    json(StatusCode::OK, &infos)
}

async fn spawn_command(agent: Arc<Agent>, body: Incoming) -> Response<Body> {
    let req: SpawnRequest = match read_json(body).await {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    if let Err(e) = req.validate() {
        return error(StatusCode::BAD_REQUEST, "bad_request", e.to_string());
    }
    if crate::failpoint::wedge_if_asked(&req.argv) {
        return error(StatusCode::CONFLICT, "failpoint", "the agent was wedged");
    }
    if crate::failpoint::arm_drop_if_asked(&req.argv) {
        return error(StatusCode::CONFLICT, "failpoint", "agent:drop is armed");
    }
    let cmd = Arc::new(Cmd::new(req.id.clone()));
    {
        let mut map = agent.commands();
        if map.contains_key(&req.id) {
            return error(
                StatusCode::CONFLICT,
                "conflict",
                format!("command '{}' already exists", req.id),
            );
        }
        map.insert(req.id.clone(), cmd.clone());
    }

    let argv0 = req.argv[0].clone();
    let timeout = req.timeout_ms.filter(|&ms| ms > 0);
    crate::oom::command_starting(&agent);
    let outcome = {
        let (agent, cmd) = (agent.clone(), cmd.clone());
        tokio::task::spawn_blocking(move || spawn::start(&agent.reaper, &cmd, &req)).await
    };
    let outcome = outcome.unwrap_or_else(|_| spawn::Outcome::Failed {
        code: 126,
        reason: "internal error while starting".into(),
    });

    match outcome {
        spawn::Outcome::Started {
            pid,
            stdin,
            stdout,
            stderr,
            pty,
        } => {
            let reactor = agent.reactor().ok();
            let watch =
                |fd: Option<OwnedFd>, interest| Watched::new(reactor.as_ref()?, fd?, interest).ok();
            let mut out = watch(stdout, watch::READ).map(Source::Pipe);
            let err = watch(stderr, watch::READ).map(Source::Pipe);
            if let Some(tx) = watch(stdin, watch::WRITE) {
                cmd.set_stdin(command::start_stdin_writer(&cmd, Sink::Pipe(tx)));
            }
            // Registering a fresh descriptor fails only if the runtime's epoll
            // does; the master is closed then, and the terminal hangs up
            // (SIGHUP), as when a terminal window is closed.
            let pty = pty.and_then(|fd| Pty::new(reactor.as_ref()?, fd).ok());
            if let Some(pty) = pty.map(Arc::new) {
                cmd.set_pty(pty.clone());
                cmd.set_stdin(command::start_stdin_writer(&cmd, Sink::Pty(pty.clone())));
                out = Some(Source::Pty(pty));
            }
            tokio::spawn(command::pump(cmd.clone(), out, err, agent.clone()));
            let after = timeout.map(|ms| Duration::from_millis(ms).min(MAX_TIMEOUT));
            tokio::spawn(lifetime(agent.clone(), cmd.clone(), after));
            json(StatusCode::OK, &SpawnReply { pid })
        }
        spawn::Outcome::Failed { code, reason } => {
            cmd.set_failed(&argv0, code, reason);
            json(StatusCode::OK, &SpawnReply { pid: 0 })
        }
    }
}

/// How long a command lasts. Without a timeout: until its main process has been
/// reaped (what it leaves running in the background is on its own). With one:
/// until every process it started has ended, or the timeout passes and all of
/// them are killed (then it is `timed_out`): a timeout bounds everything the
/// command started, also after its main process has exited.
async fn lifetime(agent: Arc<Agent>, cmd: Arc<Cmd>, timeout: Option<Duration>) {
    let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
    let expired = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(expired);
    let kill = || {
        let (agent, cmd) = (agent.clone(), cmd.clone());
        tokio::task::spawn_blocking(move || agent.reaper.kill_for_timeout(&cmd))
    };
    // When the timeout killed it: from then on what is left is killed again until
    // nothing is, for `DYING` at most.
    let mut killed: Option<tokio::time::Instant> = None;
    tokio::select! {
        _ = cmd.reaped.cancelled() => {}
        _ = &mut expired => {
            killed = Some(tokio::time::Instant::now());
            let _ = kill().await;
        }
    }
    if deadline.is_some() {
        // The rest of what it started, until it is gone or the deadline.
        loop {
            let check = {
                let (agent, cmd) = (agent.clone(), cmd.clone());
                tokio::task::spawn_blocking(move || agent.reaper.any_alive(&cmd))
            };
            // A check that scans a busy sandbox's /proc is slow; the deadline does not wait for it.
            let alive = if killed.is_none() {
                tokio::select! {
                    alive = check => alive.unwrap_or(false),
                    _ = &mut expired => {
                        killed = Some(tokio::time::Instant::now());
                        let _ = kill().await;
                        true
                    }
                }
            } else {
                check.await.unwrap_or(false)
            };
            if !alive {
                break;
            }
            match killed {
                Some(at) => {
                    let give_up = at + DYING;
                    if tokio::time::Instant::now() >= give_up {
                        note!(
                            "space-agent: processes of {} outlived its timeout's kill",
                            cmd.id
                        );
                        break;
                    }
                    tokio::select! {
                        _ = changed(&agent, &cmd) => {}
                        _ = tokio::time::sleep_until(give_up) => {}
                    }
                    // What outlived the kill (a fork bomb's newest children): again.
                    let _ = kill().await;
                }
                None => {
                    tokio::select! {
                        _ = changed(&agent, &cmd) => {}
                        _ = &mut expired => {
                            killed = Some(tokio::time::Instant::now());
                            let _ = kill().await;
                        }
                    }
                }
            }
        }
        if let Some(at) = killed {
            // Its main process is reaped by now, or very soon (SIGKILL).
            let _ = tokio::time::timeout_at(at + DYING, cmd.reaped.cancelled()).await;
        }
    }
    cmd.end();
}

/// How long the processes of a command whose timeout killed them may take to be
/// gone before the command is finished anyway (a process stuck in the kernel).
const DYING: Duration = Duration::from_secs(30);

/// Waits for a change in whether a command has processes left: its cgroup's
/// events where it has one; otherwise an orphan reaped by the agent, or a
/// second (a process that was not the agent's child ends without telling it).
async fn changed(agent: &Agent, cmd: &Cmd) {
    match cmd.group() {
        Some(group) => group.wait_empty().await,
        None => {
            tokio::select! {
                _ = agent.reaper.orphan_reaped.notified() => {}
                // A quiesce ends the pending sleep: the next wait has no timer.
                _ = agent.quiet.entered() => {}
                _ = async {
                    agent.quiet.off().await;
                    tokio::time::sleep(Duration::from_secs(1)).await
                } => {}
            }
        }
    }
}

fn delete(agent: &Agent, id: &str) -> Response<Body> {
    let Some(cmd) = agent.get(id) else {
        return not_found(id);
    };
    if agent.forget(&cmd) {
        empty(StatusCode::NO_CONTENT)
    } else {
        error(
            StatusCode::CONFLICT,
            "conflict",
            format!("command '{id}' is still running"),
        )
    }
}

async fn signal(agent: &Agent, id: &str, body: Incoming) -> Response<Body> {
    let Some(cmd) = agent.get(id) else {
        return not_found(id);
    };
    let req: SignalRequest = match read_json(body).await {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    if !(1..=64).contains(&req.signal) {
        return error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("invalid signal {}", req.signal),
        );
    }
    let reaper = agent.reaper.clone();
    let sig = req.signal;
    let result = tokio::task::spawn_blocking(move || reaper.signal(&cmd, sig))
        .await
        .unwrap_or_else(|e| Err(SignalError::Os(std::io::Error::other(e))));
    match result {
        Ok(()) => empty(StatusCode::NO_CONTENT),
        Err(SignalError::NotRunning) => error(
            StatusCode::CONFLICT,
            "conflict",
            format!("command '{id}' is not running"),
        ),
        Err(SignalError::Os(e)) if e.raw_os_error() == Some(libc::ESRCH) => error(
            StatusCode::CONFLICT,
            "conflict",
            format!("command '{id}' is not running"),
        ),
        Err(SignalError::Os(e)) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("kill: {}", spawn::describe(&e)),
        ),
    }
}

/// `stdout=N&stderr=M`; missing ones are 0.
fn parse_offsets(query: &str) -> Result<[u64; 2], String> {
    let mut offsets = [0u64; 2];
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let slot = match k {
            "stdout" => 0,
            "stderr" => 1,
            _ => continue,
        };
        offsets[slot] = v.parse().map_err(|_| format!("invalid offset {k}={v:?}"))?;
    }
    Ok(offsets)
}

/// Whether an attach asks for [`Frame::InputTaken`] reports (`input=1`).
fn reports_input(query: &str) -> bool {
    query.split('&').any(|p| p == "input=1")
}

fn attach(agent: Arc<Agent>, id: &str, query: &str, body: Incoming) -> Response<Body> {
    let Some(cmd) = agent.get(id) else {
        return not_found(id);
    };
    let offsets = match parse_offsets(query) {
        Ok(o) => o,
        Err(msg) => return error(StatusCode::BAD_REQUEST, "bad_request", msg),
    };
    let cancel = match cmd.begin_attach(offsets) {
        Ok(c) => c,
        Err(AttachError::Range { stream, base, end }) => {
            return error(
                StatusCode::RANGE_NOT_SATISFIABLE,
                "range_not_satisfiable",
                format!(
                    "{} offset must be between {base} and {end}",
                    command::stream_name(stream)
                ),
            )
        }
    };
    let (tx, rx) = mpsc::channel(ATTACH_QUEUE);
    tokio::spawn(command::send_output(
        cmd.clone(),
        offsets,
        reports_input(query),
        tx,
        cancel.clone(),
    ));
    tokio::spawn(read_host_frames(agent, cmd, body, cancel));
    let mut r = Response::new(BodyExt::boxed(ChannelBody(rx)));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/octet-stream"),
    );
    r
}

/// Applies the host's frames of one attach until its body ends, the attach is
/// superseded, or a frame is invalid (which closes the attach).
async fn read_host_frames(
    agent: Arc<Agent>,
    cmd: Arc<Cmd>,
    mut body: Incoming,
    cancel: CancellationToken,
) {
    let mut decoder = FrameDecoder::new();
    loop {
        let next = tokio::select! {
            f = body.frame() => f,
            _ = cancel.cancelled() => return,
        };
        let data = match next {
            Some(Ok(f)) => match f.into_data() {
                Ok(d) => d,
                Err(_) => continue,
            },
            // Body finished or connection gone: output may still flow.
            None | Some(Err(_)) => return,
        };
        decoder.push(&data);
        loop {
            if cancel.is_cancelled() {
                // Superseded: input still buffered here is sent again on the new attach
                // (by a host with input offsets).
                return;
            }
            let frame = match decoder.next_frame() {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => {
                    note!("space-agent: closing attach of {}: {e}", cmd.id);
                    cancel.cancel();
                    return;
                }
            };
            match frame {
                Frame::Ack { stdout, stderr } => cmd.ack(stdout, stderr),
                Frame::Stdin(_)
                | Frame::StdinEof
                | Frame::StdinAt { .. }
                | Frame::StdinEofAt(_)
                    if crate::failpoint::drop_before("stdin") =>
                {
                    // The link goes before this input is taken: a host with input offsets
                    // sends it again (one without loses it).
                    agent.drop_link.notify_one();
                    return;
                }
                // Input without offsets (a host from before them): taken where it comes.
                Frame::Stdin(data) => command::take_input(&cmd, None, Some(data), &cancel).await,
                Frame::StdinEof => command::take_input(&cmd, None, None, &cancel).await,
                Frame::StdinAt { offset, data } => {
                    command::take_input(&cmd, Some(offset), Some(data), &cancel).await;
                }
                Frame::StdinEofAt(offset) => {
                    command::take_input(&cmd, Some(offset), None, &cancel).await;
                }
                Frame::Resize(size) => {
                    // Awaited, so that input after a resize reaches the command after it.
                    let cmd = cmd.clone();
                    let _ = tokio::task::spawn_blocking(move || cmd.resize(size)).await;
                }
                Frame::Done => {
                    // Only an exited command can be forgotten; the host sends
                    // Done after the Exit frame, so anything else is ignored.
                    agent.forget(&cmd);
                }
                Frame::Stdout { .. }
                | Frame::Stderr { .. }
                | Frame::Exit(_)
                | Frame::InputTaken(_) => {
                    note!(
                        "space-agent: closing attach of {}: agent-only frame",
                        cmd.id
                    );
                    cancel.cancel();
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_reports_are_asked_with_input_1() {
        assert!(reports_input("stdout=0&stderr=0&input=1"));
        assert!(reports_input("input=1"));
        assert!(!reports_input("stdout=0&stderr=0"));
        assert!(!reports_input("input=0&xinput=1"));
    }

    #[test]
    fn offsets_parse() {
        assert_eq!(parse_offsets(""), Ok([0, 0]));
        assert_eq!(parse_offsets("stdout=5"), Ok([5, 0]));
        assert_eq!(parse_offsets("stderr=7&stdout=1&x=y"), Ok([1, 7]));
        assert!(parse_offsets("stdout=-1").is_err());
        assert!(parse_offsets("stdout").is_err());
    }
}
