//! Command sessions: start a command through the agent, pump its output into
//! the output files (acknowledging what is stored so the agent can drop it),
//! record how it ended, and serve its output to readers from any offset.
//!
//! A session survives agent reconnects and server restarts: it re-attaches
//! from the offsets it has stored. It ends `lost` (never as a success) when
//! the sandbox goes away or the agent no longer knows the command.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use space_agent::protocol::{ExitStatus, Frame, SpawnRequest, Stream};
use space_api::{
    Command, CommandState, CreateCommandRequest, ProcessResult, PtySize, SandboxState,
};
use space_core::{new_id, now_rfc3339};
use tokio::sync::{mpsc, watch};

use super::input::InputLog;
use super::output::{self, HoldLine, OutputProgress, OutputWriter, View};
use super::{lock, validate_env, SandboxHandle, Service, ServiceError};
use space_agent_host::{self as agent, AgentConn, AgentError, Attach, Retry};

/// How long a new command waits for the sandbox's agent to be connected.
const SPAWN_CONNECT_TIMEOUT: Duration = Duration::from_secs(20);
/// Inline output cap per stream for `wait:true`.
const INLINE_OUTPUT_MAX: usize = 1 << 20;
/// Data per NDJSON line.
const STREAM_PIECE_MAX: usize = 64 * 1024;
/// Most bytes a reader of stored output reads at once (then sent in pieces of
/// [`STREAM_PIECE_MAX`]): a follower that fell behind catches up in few reads.
const READ_AHEAD_MAX: usize = 1 << 20;
/// Upper bound on `timeout_seconds`.
const MAX_TIMEOUT_SECONDS: u64 = 7 * 24 * 3600;
/// A live follower that has not moved for this long no longer holds its command back
/// (see [`Followers`]): a client that stopped reading cannot stall a command for ever.
const FOLLOWER_STALL: Duration = Duration::from_secs(10);

/// A command whose session is live in this process.
pub(crate) struct CommandHandle {
    pub sandbox_id: String,
    pub progress: watch::Sender<OutputProgress>,
    /// Whether it takes input (started with `stdin` or `pty`).
    pub interactive: bool,
    /// Host frames (stdin, resize) for the current attach stream, while attached.
    pub host_frames: watch::Sender<Option<mpsc::Sender<Bytes>>>,
    /// Whether its agent takes input with offsets: `None` until the first attach. With
    /// them, input goes through `input`; without, straight into `host_frames`.
    pub input_offsets: watch::Sender<Option<bool>>,
    /// Its input not yet taken by the agent (see [`InputLog`]).
    pub input: watch::Sender<InputLog>,
    /// Its live followers, which the session waits for before the output cap would
    /// drop what they have not read yet.
    pub followers: Followers,
}

/// The live followers of one command and how far each has read.
///
/// The output cap keeps only the tail of a stream, so a follower slower than its writer
/// would lose what the cap drops before it reads it. Instead, while a follower that is
/// still moving lags more than half of what is kept behind (the bytes of the cap, or the
/// records of the index: [`OutputWriter::hold_line`]), the session withholds its
/// acknowledgements: the agent then keeps at most [`RETAIN_MAX_BYTES`] per stream
/// unacknowledged and stops reading the command's pipe, and the command waits on its
/// writes, as it would writing to a slow pipe. A follower that has not moved for
/// [`FOLLOWER_STALL`] holds nothing back.
///
/// [`RETAIN_MAX_BYTES`]: space_agent::protocol::RETAIN_MAX_BYTES
#[derive(Default)]
pub(crate) struct Followers {
    by_id: Mutex<HashMap<u64, Follower>>,
    next_id: std::sync::atomic::AtomicU64,
    moved: tokio::sync::Notify,
}

struct Follower {
    view: View,
    /// Offset in its view of the next byte it will send.
    offset: u64,
    moved_at: tokio::time::Instant,
}

/// A registered follower; it leaves the command when dropped.
struct FollowerMark {
    ch: Arc<CommandHandle>,
    id: u64,
}

impl FollowerMark {
    fn join(ch: Arc<CommandHandle>, view: View, offset: u64) -> FollowerMark {
        let f = &ch.followers;
        let id = f.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let follower = Follower {
            view,
            offset,
            moved_at: tokio::time::Instant::now(),
        };
        lock(&f.by_id).insert(id, follower);
        FollowerMark { ch, id }
    }

    /// Records that everything before `offset` was sent.
    fn moved_to(&self, offset: u64) {
        let f = &self.ch.followers;
        if let Some(me) = lock(&f.by_id).get_mut(&self.id) {
            if offset > me.offset {
                me.offset = offset;
                me.moved_at = tokio::time::Instant::now();
            }
        }
        f.moved.notify_waiters();
    }
}

impl Drop for FollowerMark {
    fn drop(&mut self) {
        let f = &self.ch.followers;
        lock(&f.by_id).remove(&self.id);
        f.moved.notify_waiters();
    }
}

impl Followers {
    /// Whether any follower is registered.
    fn any(&self) -> bool {
        !lock(&self.by_id).is_empty()
    }

    /// When the session may stop waiting for the followers that hold it back now (the
    /// soonest of their stall deadlines), or `None` when none does: none is below `line`
    /// in its view while still moving.
    fn holding(&self, line: &HoldLine) -> Option<tokio::time::Instant> {
        let now = tokio::time::Instant::now();
        lock(&self.by_id)
            .values()
            .filter(|f| f.offset < line.of(f.view))
            .map(|f| f.moved_at + FOLLOWER_STALL)
            .filter(|deadline| *deadline > now)
            .min()
    }

    /// Waits until no follower holds the session back (see [`Followers::holding`]).
    async fn released(&self, line: HoldLine) {
        loop {
            let moved = self.moved.notified();
            tokio::pin!(moved);
            moved.as_mut().enable();
            let Some(deadline) = self.holding(&line) else {
                return;
            };
            tokio::select! {
                _ = moved => {}
                _ = tokio::time::sleep_until(deadline) => {}
            }
        }
    }
}

fn view_end(p: &OutputProgress, view: View) -> u64 {
    match view {
        View::Stdout => p.stdout,
        View::Stderr => p.stderr,
        View::Combined => p.combined(),
    }
}

#[derive(Default)]
pub(crate) struct Registry {
    live: Mutex<HashMap<String, Arc<CommandHandle>>>,
    /// Serialises the move of a command into a terminal state.
    finalize: Mutex<()>,
}

/// `GET …/output` parameters.
#[derive(Debug, Clone, Copy)]
pub struct CommandOutputQuery {
    pub offset: u64,
    pub follow: bool,
    pub view: View,
}

/// How a session ended.
enum Outcome {
    Ended(ExitStatus),
    Lost(String),
}

enum PumpEnd {
    Exit(ExitStatus, mpsc::Sender<Bytes>),
    /// The connection broke: try again on the next one.
    Disconnected,
    /// The sandbox is going away.
    Closed,
    /// The agent broke the protocol or storing failed: give up on this command.
    Fatal(String),
}

impl Service {
    /// A command of the server's own (a template's start command): no admission.
    pub(super) async fn create_command(
        &self,
        sandbox_id: &str,
        req: CreateCommandRequest,
    ) -> Result<Command, ServiceError> {
        self.create_command_admitted(sandbox_id, req, || Ok(()))
            .await
    }

    /// [`Self::create_command`], with `admit` (a limit check against the stored
    /// commands) run under one server-wide lock together with storing the new
    /// command: checks of concurrent creates see each other's commands.
    pub(super) async fn create_command_admitted(
        &self,
        sandbox_id: &str,
        req: CreateCommandRequest,
        admit: impl FnOnce() -> Result<(), ServiceError>,
    ) -> Result<Command, ServiceError> {
        let argv = match (req.argv, req.shell) {
            (Some(argv), None) => argv,
            (None, Some(shell)) => vec!["/bin/sh".into(), "-c".into(), shell],
            _ => {
                return Err(ServiceError::BadRequest(
                    "give exactly one of argv and shell".into(),
                ))
            }
        };
        if argv.is_empty() || argv[0].is_empty() {
            return Err(ServiceError::BadRequest("argv must not be empty".into()));
        }
        if let Some(p) = &req.pty {
            if p.rows == 0 || p.cols == 0 || p.rows > 1000 || p.cols > 1000 {
                return Err(ServiceError::BadRequest(
                    "pty rows and cols must be between 1 and 1000".into(),
                ));
            }
        }
        let pty = req.pty.clone();
        let interactive = req.stdin == Some(true) || pty.is_some();
        let max = self.0.cfg.max_command_timeout_seconds;
        let timeout = req
            .timeout_seconds
            .unwrap_or(self.0.cfg.default_command_timeout_seconds);
        if max > 0 && (timeout == 0 || timeout > max) {
            return Err(ServiceError::BadRequest(format!(
                "timeout_seconds must be between 1 and {max} on this server"
            )));
        }
        if timeout > MAX_TIMEOUT_SECONDS {
            return Err(ServiceError::BadRequest(format!(
                "timeout_seconds must be at most {MAX_TIMEOUT_SECONDS}"
            )));
        }
        let cmd_env = req.env.unwrap_or_default();
        validate_env(&cmd_env)?;
        let cmd_secrets = req.secrets.unwrap_or_default();
        validate_secrets(&cmd_secrets)?;
        for (what, v) in [("cwd", &req.cwd), ("user", &req.user)] {
            if v.as_ref()
                .is_some_and(|v| v.is_empty() || v.len() > 4096 || v.contains('\0'))
            {
                return Err(ServiceError::BadRequest(format!("invalid {what}")));
            }
        }

        let not_running = |state: SandboxState| {
            ServiceError::Conflict(format!(
                "sandbox {sandbox_id} is {state}: commands run only in a running sandbox"
            ))
        };
        let Some(handle) = self.live_handle(sandbox_id) else {
            return Err(not_running(self.record(sandbox_id)?.sandbox.state));
        };
        // From the state check until the agent has answered the spawn: no pause or
        // suspend may begin (they wait for this, bounded by the spawn's own timeouts).
        let no_freeze = handle.spawns.clone().read_owned().await;
        let rec = self.record(sandbox_id)?;
        self.touch(sandbox_id);
        if rec.sandbox.state != SandboxState::Running {
            return Err(not_running(rec.sandbox.state));
        }

        // Template env, then the sandbox's, then the command's.
        let mut env: BTreeMap<String, String> = rec.template_env.iter().cloned().collect();
        env.extend(rec.sandbox.env.clone());
        env.extend(cmd_env);
        // The sandbox's secrets, then the command's: over any env of the same name (the
        // agent puts them last). They travel apart from `env` so no record of it holds them.
        let mut secrets = rec.secrets.clone();
        secrets.extend(cmd_secrets);
        let secret_names: Vec<String> = secrets.keys().cloned().collect();
        let user = req.user.clone().or(rec.template_user.clone());
        let cwd = req.cwd.clone().or(rec.template_workdir.clone());
        let id = new_id("cmd");
        let spawn = SpawnRequest {
            id: id.clone(),
            argv: argv.clone(),
            env: env.into_iter().collect(),
            secrets: secrets.into_iter().collect(),
            cwd: cwd.clone(),
            user: user.clone(),
            timeout_ms: (timeout > 0).then(|| timeout * 1000),
            stdin: interactive,
            pty: pty
                .as_ref()
                .map(|p: &PtySize| space_agent::protocol::PtySize {
                    rows: p.rows,
                    cols: p.cols,
                }),
        };
        spawn
            .validate()
            .map_err(|e| ServiceError::BadRequest(e.to_string()))?;

        let cmd = Command {
            id: id.clone(),
            version: 0,
            sandbox_id: sandbox_id.to_string(),
            state: CommandState::Starting,
            pid: None,
            argv,
            cwd,
            user,
            secret_names,
            stdin: interactive,
            pty,
            timeout_seconds: (timeout > 0).then_some(timeout),
            created_at: now_rfc3339(),
            ended_at: None,
            result: None,
            lost_reason: None,
            output_url: format!("/v1/sandboxes/{sandbox_id}/commands/{id}/output"),
            stdout: None,
            stderr: None,
            inline_truncated: None,
        };
        let dir = self.command_dir(sandbox_id, &id);
        let writer = {
            // No await from the check to the insert: the lock is held across neither.
            let _admission = lock(&self.0.command_admission);
            admit()?;
            let writer = OutputWriter::open(
                &dir,
                self.0.cfg.output_cap_bytes,
                Some(handle.output.clone()),
            )
            .map_err(|e| ServiceError::Internal(format!("creating output files: {e}")))?;
            self.0.store.insert_command(&rec.sandbox.tenant, &cmd)?;
            writer
        };
        let ch = self.register_command(sandbox_id, &id, writer.progress(), interactive);

        // Started in a task of its own: a client that hangs up mid-request must not
        // leave the command half-started.
        let svc = self.clone();
        tokio::spawn(async move {
            let started = svc.start_command(handle, ch, writer, cmd, spawn).await;
            drop(no_freeze);
            started
        })
        .await
        .map_err(|e| ServiceError::Internal(format!("starting the command: {e}")))??;

        if req.wait == Some(true) {
            let mut done = self.wait_command(sandbox_id, &id, None).await?;
            let (stdout, out_cut) = read_inline(&dir.join("stdout"));
            let (stderr, err_cut) = read_inline(&dir.join("stderr"));
            done.stdout = Some(stdout);
            done.stderr = Some(stderr);
            done.inline_truncated = Some(out_cut || err_cut);
            return Ok(done);
        }
        self.get_command(sandbox_id, &id)
    }

    /// Sends the spawn request and starts the command's session.
    async fn start_command(
        &self,
        handle: Arc<SandboxHandle>,
        ch: Arc<CommandHandle>,
        writer: OutputWriter,
        cmd: Command,
        spawn: SpawnRequest,
    ) -> Result<(), ServiceError> {
        let sandbox_id = cmd.sandbox_id.clone();
        let id = cmd.id.clone();
        let mut rx = handle.agent.subscribe();
        // A spawn whose answer was lost (the connection broke, or the agent did not answer
        // in time) is sent once more, on the next connection: the agent answers 409 for
        // an id it already has, so the command never starts twice, and one that never
        // reached it is not reported `lost` for a reconnect.
        let mut broken: Option<u64> = None;
        let mut pid = None;
        for attempt in 0..2 {
            let conn = match broken {
                Some(gen) => agent::wait_reconnected(&mut rx, gen, SPAWN_CONNECT_TIMEOUT).await,
                None => agent::wait_connected(&mut rx, SPAWN_CONNECT_TIMEOUT).await,
            };
            let conn = match conn {
                Ok(c) => c,
                Err(e) if attempt == 0 => {
                    self.finalize_command(&sandbox_id, &id, Outcome::Lost(e.to_string()));
                    return Err(e.into());
                }
                // The first attempt may have started it; the session finds out.
                Err(_) => break,
            };
            match conn.spawn(&spawn).await {
                Ok(reply) => {
                    pid = (reply.pid != 0).then_some(reply.pid);
                    break;
                }
                Err(AgentError::Refused { status, .. })
                    if attempt > 0 && status == StatusCode::CONFLICT =>
                {
                    break
                }
                Err(AgentError::Refused {
                    status, message, ..
                }) if status.is_client_error() => {
                    self.finalize_command(
                        &sandbox_id,
                        &id,
                        Outcome::Lost(format!("the agent refused the command: {message}")),
                    );
                    return Err(ServiceError::BadRequest(message));
                }
                Err(e) => {
                    tracing::warn!(command = %id, attempt, error = %super::error_chain(&e), "spawn request failed");
                    // After a timeout the same connection is asked again; after a break, the next.
                    broken = match e {
                        AgentError::Timeout(_) => Some(u64::MAX),
                        _ => Some(conn.generation()),
                    };
                }
            }
        }
        // Unless it has ended meanwhile (its session may already have finalized it).
        self.modify_command(&sandbox_id, &id, |c| {
            Ok::<_, ServiceError>(
                (c.state == CommandState::Starting || c.pid != pid).then(|| {
                    if c.state == CommandState::Starting {
                        c.state = CommandState::Running;
                    }
                    c.pid = c.pid.or(pid);
                }),
            )
        })?;
        tracing::info!(sandbox = %&sandbox_id, command = %id, "command started");
        self.0
            .metrics
            .commands_started
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.spawn_session(handle, ch, writer, sandbox_id, id);

        Ok(())
    }

    fn command_dir(&self, sandbox_id: &str, id: &str) -> PathBuf {
        output::command_dir(&self.outputs_root(), sandbox_id, id)
    }

    pub(crate) fn register_command(
        &self,
        sandbox_id: &str,
        id: &str,
        progress: OutputProgress,
        interactive: bool,
    ) -> Arc<CommandHandle> {
        let ch = Arc::new(CommandHandle {
            sandbox_id: sandbox_id.to_string(),
            progress: watch::channel(progress).0,
            interactive,
            host_frames: watch::channel(None).0,
            input_offsets: watch::channel(None).0,
            input: watch::channel(InputLog::default()).0,
            followers: Followers::default(),
        });
        lock(&self.0.commands.live).insert(id.to_string(), ch.clone());
        ch
    }

    /// Restarts the session of a command that was running when the server stopped.
    pub(crate) fn resume_command_session(&self, handle: &Arc<SandboxHandle>, cmd: Command) {
        let dir = self.command_dir(&cmd.sandbox_id, &cmd.id);
        match OutputWriter::open(
            &dir,
            self.0.cfg.output_cap_bytes,
            Some(handle.output.clone()),
        ) {
            Ok(writer) => {
                let ch = self.register_command(
                    &cmd.sandbox_id,
                    &cmd.id,
                    writer.progress(),
                    cmd.stdin || cmd.pty.is_some(),
                );
                self.spawn_session(handle.clone(), ch, writer, cmd.sandbox_id, cmd.id);
            }
            Err(e) => self.finalize_command(
                &cmd.sandbox_id,
                &cmd.id,
                Outcome::Lost(format!("its output files could not be opened: {e}")),
            ),
        }
    }

    fn spawn_session(
        &self,
        handle: Arc<SandboxHandle>,
        ch: Arc<CommandHandle>,
        writer: OutputWriter,
        sandbox_id: String,
        id: String,
    ) {
        let svc = self.clone();
        tokio::spawn(async move {
            let (outcome, done_tx) = session(&handle, &ch, writer, &id).await;
            ch.input.send_modify(InputLog::close);
            svc.finalize_command(&sandbox_id, &id, outcome);
            if let Some(tx) = done_tx {
                // The result is stored: the agent may forget the command.
                let _ = tx.send(Frame::Done.to_bytes()).await;
            }
        });
    }

    /// Reads command `id`, lets `f` change it (`Ok(None)`: leave it as it is) and writes it
    /// back compare-and-swap, reading again after a lost race. `None`: nothing written.
    pub(crate) fn modify_command<T, E: From<ServiceError>>(
        &self,
        sandbox_id: &str,
        id: &str,
        mut f: impl FnMut(&mut Command) -> Result<Option<T>, E>,
    ) -> Result<Option<T>, E> {
        for _ in 0..32 {
            let Some(mut cmd) = self
                .0
                .store
                .get_command(sandbox_id, id)
                .map_err(ServiceError::from)?
            else {
                return Ok(None);
            };
            let Some(out) = f(&mut cmd)? else {
                return Ok(None);
            };
            match self.0.store.update_command(&mut cmd) {
                Ok(()) => return Ok(Some(out)),
                Err(space_store::StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(ServiceError::from(e).into()),
            }
        }
        Err(ServiceError::Conflict(format!("command {id} kept changing under this write")).into())
    }

    /// Moves a command into its terminal state, once.
    fn finalize_command(&self, sandbox_id: &str, id: &str, outcome: Outcome) {
        let reg = &self.0.commands;
        let _guard = lock(&reg.finalize);
        // Taken out of the live map only after the result is stored (below), so a
        // waiter never finds neither a live command nor an ended one.
        let live = lock(&reg.live).get(id).cloned();
        let progress = live
            .as_ref()
            .map(|c| *c.progress.borrow())
            .unwrap_or_else(|| output::stored_progress(&self.command_dir(sandbox_id, id)));
        let ended = self.modify_command(sandbox_id, id, |cmd| {
            if cmd.state.is_terminal() {
                return Ok::<_, ServiceError>(None);
            }
            {
                let now = now_rfc3339();
                match &outcome {
                    Outcome::Ended(st) => {
                        cmd.state = if st.timed_out {
                            CommandState::TimedOut
                        } else if st.signal.is_some() {
                            CommandState::Killed
                        } else {
                            CommandState::Exited
                        };
                        cmd.result = Some(ProcessResult {
                            exit_code: st.exit_code,
                            signal: st.signal,
                            timed_out: st.timed_out,
                            oom_killed: st.oom_killed,
                            duration_ms: st.duration_ms,
                            stdout_bytes: progress.stdout,
                            stderr_bytes: progress.stderr,
                            output_truncated: progress.truncated(),
                        });
                    }
                    Outcome::Lost(reason) => {
                        cmd.state = CommandState::Lost;
                        cmd.lost_reason = Some(reason.clone());
                    }
                }
                cmd.ended_at = Some(now);
            }
            Ok(Some(cmd.state))
        });
        match ended {
            Ok(Some(state)) => {
                tracing::info!(sandbox = %sandbox_id, command = %id, %state, "command ended")
            }
            Ok(None) => {}
            Err(e) => {
                tracing::error!(command = %id, error = %super::error_chain(&e), "storing a command result failed")
            }
        }
        lock(&reg.live).remove(id);
        if let Some(ch) = live {
            ch.progress.send_modify(|p| p.done = true);
        }
        drop(_guard);
        // A finished command's output may now go to keep the sandbox within its budget.
        if let Some(h) = self.live_handle(sandbox_id) {
            h.note_output(true);
        }
        // The end of a command is activity: the idle timer starts now.
        self.touch(sandbox_id);
    }

    /// Commands of a sandbox that are running in this process.
    pub(crate) fn running_commands(&self, sandbox_id: &str) -> usize {
        lock(&self.0.commands.live)
            .values()
            .filter(|c| c.sandbox_id == sandbox_id && !c.progress.borrow().done)
            .count()
    }

    /// Ends every unfinished command of a sandbox as `lost`.
    pub(crate) fn lose_commands(&self, sandbox_id: &str, reason: &str) {
        let Ok(cmds) = self.0.store.list_commands(sandbox_id) else {
            return;
        };
        for cmd in cmds.into_iter().filter(|c| !c.state.is_terminal()) {
            self.finalize_command(sandbox_id, &cmd.id, Outcome::Lost(reason.to_string()));
        }
    }

    pub(super) fn get_command(&self, sandbox_id: &str, id: &str) -> Result<Command, ServiceError> {
        self.record(sandbox_id)?;
        self.0.store.get_command(sandbox_id, id)?.ok_or_else(|| {
            ServiceError::NotFound(format!("no command {id} in sandbox {sandbox_id}"))
        })
    }

    pub(super) fn list_commands(&self, sandbox_id: &str) -> Result<Vec<Command>, ServiceError> {
        self.record(sandbox_id)?;
        self.touch(sandbox_id);
        Ok(self.0.store.list_commands(sandbox_id)?)
    }

    /// The command once it has ended, or as it is when `wait` runs out (`None`: no limit).
    pub(super) async fn wait_command(
        &self,
        sandbox_id: &str,
        id: &str,
        wait: Option<Duration>,
    ) -> Result<Command, ServiceError> {
        // Read the row and the live entry together, against a concurrent finalize.
        let (cmd, live) = {
            let _guard = lock(&self.0.commands.finalize);
            let cmd = self.get_command(sandbox_id, id)?;
            (cmd, lock(&self.0.commands.live).get(id).cloned())
        };
        self.touch(sandbox_id);
        if cmd.state.is_terminal() {
            return Ok(cmd);
        }
        if let Some(ch) = live {
            let mut rx = ch.progress.subscribe();
            let done = rx.wait_for(|p| p.done);
            match wait {
                Some(w) => {
                    let _ = tokio::time::timeout(w, done).await;
                }
                None => {
                    let _ = done.await;
                }
            }
        }
        self.get_command(sandbox_id, id)
    }

    /// `POST …/commands/{cid}/signal`.
    pub(super) async fn signal_command(
        &self,
        sandbox_id: &str,
        id: &str,
        signal: i32,
    ) -> Result<Command, ServiceError> {
        let cmd = self.get_command(sandbox_id, id)?;
        if cmd.state.is_terminal() {
            return Err(ServiceError::Conflict(format!(
                "command {id} has already ended ({})",
                cmd.state
            )));
        }
        let handle = self.live_handle(sandbox_id).ok_or_else(|| {
            ServiceError::Conflict(format!("sandbox {sandbox_id} is not running"))
        })?;
        let mut rx = handle.agent.subscribe();
        // Sent again on the agent's next connection if its connection broke under it: a
        // KILL must not fail because the agent was redialling.
        let sent = agent::call_again_on_break(
            &mut rx,
            SPAWN_CONNECT_TIMEOUT,
            Retry::Repeatable,
            "signal",
            |c| async move { c.signal(id, signal).await },
        )
        .await;
        match sent {
            Ok(()) => {}
            Err(AgentError::Refused { status, .. }) if status == StatusCode::CONFLICT => {}
            Err(AgentError::Refused {
                status, message, ..
            }) if status.is_client_error() => return Err(ServiceError::BadRequest(message)),
            Err(e) => return Err(e.into()),
        }
        self.get_command(sandbox_id, id)
    }

    /// The output of a command from an offset, as events: chunks, then (once the
    /// command has ended and everything was sent) its end. With `follow`, waits for more.
    /// `hold` (a stream slot of the tenant) is kept until the reader goes away.
    pub(super) fn command_output(
        &self,
        sandbox_id: &str,
        id: &str,
        q: CommandOutputQuery,
        hold: Option<super::tenancy::Permit>,
    ) -> Result<mpsc::Receiver<OutputEvent>, ServiceError> {
        self.get_command(sandbox_id, id)?;
        self.touch(sandbox_id);
        let dir = self.command_dir(sandbox_id, id);
        let live = lock(&self.0.commands.live).get(id).cloned();
        let (tx, rx) = mpsc::channel::<OutputEvent>(8);
        let svc = self.clone();
        let (sandbox_id, id) = (sandbox_id.to_string(), id.to_string());
        let progress_rx = live.as_ref().map(|ch| ch.progress.subscribe());
        // A live follower holds its command back rather than lose output to the cap, from
        // before its caller gets the stream.
        let mark = live
            .filter(|_| q.follow)
            .map(|ch| FollowerMark::join(ch, q.view, q.offset));
        tokio::spawn(async move {
            let _hold = hold;
            let mut progress_rx = progress_rx;
            let mut offset = q.offset;
            // Its files stay open between reads (`None` while a read has it).
            let mut reader = Some(output::OutputReader::new(&dir));
            loop {
                // Read the progress *before* the data so that `done` means "all of it".
                let progress = match &mut progress_rx {
                    Some(rx) => *rx.borrow_and_update(),
                    None => {
                        let terminal = svc
                            .0
                            .store
                            .get_command(&sandbox_id, &id)
                            .ok()
                            .flatten()
                            .is_some_and(|c| c.state.is_terminal());
                        OutputProgress {
                            done: terminal,
                            ..output::stored_progress(&dir)
                        }
                    }
                };
                let upto = view_end(&progress, q.view);
                while offset < upto {
                    let Some(mut r) = reader.take() else { return };
                    let (view, off) = (q.view, offset);
                    let pieces = tokio::task::spawn_blocking(move || {
                        let pieces = r.read(view, off, upto, READ_AHEAD_MAX);
                        (r, pieces)
                    })
                    .await
                    .map(|(r, pieces)| {
                        reader = Some(r);
                        pieces
                    });
                    let pieces = match pieces {
                        Ok(Ok(p)) if !p.is_empty() => p,
                        // Everything left below `upto` was dropped by the output cap.
                        Ok(Ok(_)) => {
                            offset = upto;
                            if let Some(mark) = &mark {
                                mark.moved_to(offset);
                            }
                            break;
                        }
                        _ => return,
                    };
                    for piece in pieces {
                        let next = piece.offset + piece.data.len() as u64;
                        let data = Bytes::from(piece.data);
                        for start in (0..data.len()).step_by(STREAM_PIECE_MAX) {
                            let part =
                                data.slice(start..(start + STREAM_PIECE_MAX).min(data.len()));
                            let len = part.len();
                            let chunk = OutputEvent::Chunk {
                                stream: piece.stream,
                                offset: piece.offset + start as u64,
                                data: part,
                            };
                            if tx.send(chunk).await.is_err() {
                                return;
                            }
                            // Counted here, so every front door's output streams are.
                            svc.observe_streamed(false, len);
                            if let Some(mark) = &mark {
                                mark.moved_to(piece.offset + (start + len) as u64);
                            }
                        }
                        offset = next;
                    }
                }
                if progress.done {
                    if let Ok(Some(cmd)) = svc.0.store.get_command(&sandbox_id, &id) {
                        let _ = tx.send(OutputEvent::End(Box::new(cmd))).await;
                    }
                    return;
                }
                if !q.follow {
                    return;
                }
                match &mut progress_rx {
                    Some(rx) => {
                        tokio::select! {
                            r = rx.changed() => if r.is_err() { progress_rx = None; },
                            _ = tx.closed() => return,
                        }
                    }
                    // Not live here and not ended: nothing more will come in this process.
                    None => return,
                }
            }
        });
        Ok(rx)
    }

    /// `POST …/stdin`: writes to a command started with `stdin` or `pty`.
    pub(super) async fn write_stdin(
        &self,
        sandbox_id: &str,
        id: &str,
        data: Bytes,
        eof: bool,
    ) -> Result<(), ServiceError> {
        let ch = self.interactive_handle(sandbox_id, id)?;
        if input_with_offsets(&ch, id).await? {
            return append_input(&ch, id, data, eof).await;
        }
        let mut frames: Vec<Bytes> = data
            .chunks(STREAM_PIECE_MAX)
            .map(|c| Frame::Stdin(Bytes::copy_from_slice(c)).to_bytes())
            .collect();
        if eof {
            frames.push(Frame::StdinEof.to_bytes());
        }
        self.send_host_frames(&ch, id, frames).await
    }

    /// Resizes the pseudo-terminal of a `pty` command.
    pub(super) async fn resize(
        &self,
        sandbox_id: &str,
        id: &str,
        rows: u16,
        cols: u16,
    ) -> Result<(), ServiceError> {
        if rows == 0 || cols == 0 || rows > 1000 || cols > 1000 {
            return Err(ServiceError::BadRequest(
                "rows and cols must be between 1 and 1000".into(),
            ));
        }
        let ch = self.interactive_handle(sandbox_id, id)?;
        let frame = Frame::Resize(space_agent::protocol::PtySize { rows, cols }).to_bytes();
        self.send_host_frames(&ch, id, vec![frame]).await
    }

    fn interactive_handle(
        &self,
        sandbox_id: &str,
        id: &str,
    ) -> Result<Arc<CommandHandle>, ServiceError> {
        let cmd = self.get_command(sandbox_id, id)?;
        self.touch(sandbox_id);
        if cmd.state.is_terminal() {
            return Err(ServiceError::Conflict(format!(
                "command {id} has already ended ({})",
                cmd.state
            )));
        }
        let ch = lock(&self.0.commands.live)
            .get(id)
            .cloned()
            .ok_or_else(|| {
                ServiceError::Conflict(format!("command {id} is not running on this server"))
            })?;
        if !ch.interactive {
            return Err(ServiceError::Conflict(format!(
                "command {id} was not started with stdin or pty"
            )));
        }
        Ok(ch)
    }

    async fn send_host_frames(
        &self,
        ch: &CommandHandle,
        id: &str,
        frames: Vec<Bytes>,
    ) -> Result<(), ServiceError> {
        // A command that just started, or whose agent is reconnecting, gets a moment; one
        // that ends meanwhile is answered at once (it ended between the check and now).
        let mut rx = ch.host_frames.subscribe();
        let mut progress = ch.progress.subscribe();
        let ended = || ServiceError::Conflict(format!("command {id} has already ended"));
        let tx = tokio::select! {
            t = tokio::time::timeout(SPAWN_CONNECT_TIMEOUT, rx.wait_for(|t| t.is_some())) => match t {
                Ok(Ok(t)) => t.clone(),
                _ => None,
            },
            _ = progress.wait_for(|p| p.done) => return Err(ended()),
        }
        .ok_or_else(|| {
            if ch.progress.borrow().done {
                return ended();
            }
            ServiceError::Unavailable(format!(
                "command {id} is not connected to its agent right now; retry"
            ))
        })?;
        for f in frames {
            // Bounded: a command that does not read its input fills the agent's queue
            // (8 MiB) and then this one; the caller hears so instead of waiting.
            match tokio::time::timeout(agent::REQUEST_TIMEOUT, tx.send(f)).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => {
                    return Err(ServiceError::Unavailable(format!(
                        "the connection to command {id}'s agent broke; retry"
                    )))
                }
                Err(_) => {
                    return Err(ServiceError::Unavailable(format!(
                        "command {id} is not taking input (its queue is full); retry"
                    )))
                }
            }
        }
        Ok(())
    }
}

/// Whether the agent of `ch` takes input with offsets (known from the session's first
/// attach). A command that just started, or whose agent is reconnecting for the first
/// time, gets a moment, as in [`Service::send_host_frames`].
async fn input_with_offsets(ch: &CommandHandle, id: &str) -> Result<bool, ServiceError> {
    let mut known = ch.input_offsets.subscribe();
    let mut progress = ch.progress.subscribe();
    let ended = || ServiceError::Conflict(format!("command {id} has already ended"));
    tokio::select! {
        k = tokio::time::timeout(SPAWN_CONNECT_TIMEOUT, known.wait_for(|k| k.is_some())) => match k {
            Ok(Ok(k)) => Ok(k.unwrap_or(false)),
            _ if ch.progress.borrow().done => Err(ended()),
            _ => Err(ServiceError::Unavailable(format!(
                "command {id} is not connected to its agent right now; retry"
            ))),
        },
        _ = progress.wait_for(|p| p.done) => Err(ended()),
    }
}

/// Appends a write to the command's input log, all of it or nothing, waiting for room
/// while the agent has not taken enough ([`agent::REQUEST_TIMEOUT`] at most, then a 503
/// that appended nothing). The session sends it, again after a break where it must.
async fn append_input(
    ch: &CommandHandle,
    id: &str,
    data: Bytes,
    eof: bool,
) -> Result<(), ServiceError> {
    let ended = || ServiceError::Conflict(format!("command {id} has already ended"));
    let mut log = ch.input.subscribe();
    let wait = async {
        loop {
            log.borrow_and_update();
            if ch.progress.borrow().done {
                return Err(ended());
            }
            let mut appended = false;
            ch.input.send_if_modified(|l| {
                appended = l.append(&data, eof);
                appended
            });
            if appended {
                return Ok(());
            }
            if log.borrow().is_closed() || log.changed().await.is_err() {
                return Err(ended());
            }
        }
    };
    tokio::time::timeout(agent::REQUEST_TIMEOUT, wait)
        .await
        .unwrap_or_else(|_| {
            Err(ServiceError::Unavailable(format!(
                "command {id} is not taking input (its queue is full); retry"
            )))
        })
}

/// What an output reader gets.
#[derive(Debug)]
pub enum OutputEvent {
    /// Bytes of one stream; `offset` is their position in the view asked for.
    Chunk {
        stream: Stream,
        offset: u64,
        data: Bytes,
    },
    /// The command as it ended (after every byte was sent).
    End(Box<Command>),
}

fn read_inline(path: &std::path::Path) -> (String, bool) {
    use std::io::Read;
    let Ok(f) = std::fs::File::open(path) else {
        return (String::new(), false);
    };
    let total = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut buf = Vec::new();
    let _ = f.take(INLINE_OUTPUT_MAX as u64).read_to_end(&mut buf);
    (
        String::from_utf8_lossy(&buf).into_owned(),
        total > INLINE_OUTPUT_MAX as u64,
    )
}

/// Drives one command until it ends or is lost; returns the sender to tell
/// the agent it may forget the command once the result is stored.
async fn session(
    sb: &SandboxHandle,
    ch: &CommandHandle,
    mut writer: OutputWriter,
    id: &str,
) -> (Outcome, Option<mpsc::Sender<Bytes>>) {
    let mut rx = sb.agent.subscribe();
    loop {
        let conn: AgentConn = tokio::select! {
            c = rx.wait_for(|c| c.is_some()) => match c.ok().and_then(|c| c.clone()) {
                Some(c) => c,
                None => return (Outcome::Lost("the sandbox's agent connection went away".into()), None),
            },
            _ = sb.closed.cancelled() => return (Outcome::Lost("the sandbox went away".into()), None),
        };
        let p = writer.progress();
        let with_input = conn.input_offsets();
        ch.input_offsets.send_replace(Some(with_input));
        let attached = match with_input {
            true => conn.attach_with_input(id, p.stdout, p.stderr).await,
            false => conn.attach(id, p.stdout, p.stderr).await,
        };
        let end = match attached {
            Ok(attach) => match attach.host_frames() {
                Some(tx) => {
                    ch.host_frames.send_replace(Some(tx.clone()));
                    let end = pump(attach, tx, &mut writer, ch, sb).await;
                    ch.host_frames.send_replace(None);
                    end
                }
                None => PumpEnd::Disconnected,
            },
            Err(AgentError::Refused { status, .. }) if status == StatusCode::NOT_FOUND => {
                return (
                    Outcome::Lost("the agent does not know this command any more".into()),
                    None,
                );
            }
            Err(AgentError::Refused {
                status, message, ..
            }) if status.is_client_error() => {
                return (
                    Outcome::Lost(format!("the agent refused to resume the output: {message}")),
                    None,
                );
            }
            Err(_) => PumpEnd::Disconnected,
        };
        match end {
            PumpEnd::Exit(status, tx) => return (Outcome::Ended(status), Some(tx)),
            PumpEnd::Closed => return (Outcome::Lost("the sandbox went away".into()), None),
            PumpEnd::Fatal(reason) => return (Outcome::Lost(reason), None),
            PumpEnd::Disconnected => {
                // Wait for the next connection (not the broken one) or the end of the sandbox.
                let gen = conn.generation();
                tokio::select! {
                    _ = rx.wait_for(|c| c.as_ref().map(|c| c.generation()) != Some(gen)) => {}
                    _ = sb.closed.cancelled() => return (Outcome::Lost("the sandbox went away".into()), None),
                }
            }
        }
    }
}

async fn pump(
    mut attach: Attach,
    tx: mpsc::Sender<Bytes>,
    writer: &mut OutputWriter,
    ch: &CommandHandle,
    sb: &SandboxHandle,
) -> PumpEnd {
    // Progress not acknowledged yet because a follower lags (see [`Followers`]), and the
    // line that follower must pass.
    let mut held: Option<(OutputProgress, HoldLine)> = None;
    // Sends the command's input, from where the agent's first report says it stopped.
    let mut input_sender: Option<AbortOnDrop> = None;
    loop {
        // All cancel-safe: nothing read is lost when another branch wins.
        let first = tokio::select! {
            f = attach.next_frame() => f,
            _ = sb.closed.cancelled() => return PumpEnd::Closed,
            _ = release(ch, held.map(|(_, line)| line)) => {
                if let Some((p, _)) = held.take() {
                    if tx.send(ack(&p)).await.is_err() {
                        return PumpEnd::Disconnected;
                    }
                }
                continue;
            }
        };
        let mut next = match first {
            Ok(Some(f)) => Some(f),
            Ok(None) => return PumpEnd::Disconnected,
            Err(AgentError::Protocol(e)) => {
                return PumpEnd::Fatal(format!("the agent broke the protocol: {e}"))
            }
            Err(_) => return PumpEnd::Disconnected,
        };
        // Every frame that has arrived is stored before one acknowledgement covers them.
        let mut wrote = false;
        while let Some(frame) = next.take() {
            match frame {
                Frame::Stdout { offset, data } => {
                    match append_checked(writer, Stream::Stdout, offset, &data) {
                        Ok(due) => sb.note_output(due),
                        Err(e) => return PumpEnd::Fatal(e),
                    }
                    wrote = true;
                }
                Frame::Stderr { offset, data } => {
                    match append_checked(writer, Stream::Stderr, offset, &data) {
                        Ok(due) => sb.note_output(due),
                        Err(e) => return PumpEnd::Fatal(e),
                    }
                    wrote = true;
                }
                Frame::InputTaken(upto) => {
                    let mut lie = None;
                    ch.input.send_if_modified(|log| {
                        log.take(upto).unwrap_or_else(|e| {
                            lie = Some(e);
                            false
                        })
                    });
                    if let Some(e) = lie {
                        return PumpEnd::Fatal(format!("the agent broke the protocol: {e}"));
                    }
                    if input_sender.is_none() {
                        input_sender = Some(AbortOnDrop(tokio::spawn(send_input(
                            ch.input.subscribe(),
                            tx.clone(),
                            upto,
                        ))));
                    }
                }
                Frame::Exit(status) => {
                    if wrote {
                        ch.progress.send_replace(OutputProgress {
                            done: false,
                            ..writer.progress()
                        });
                    }
                    return PumpEnd::Exit(status, tx);
                }
                _ => {
                    return PumpEnd::Fatal("the agent sent a host-only frame".into());
                }
            }
            next = match attach.buffered_frame() {
                Ok(f) => f,
                Err(e) => return PumpEnd::Fatal(format!("the agent broke the protocol: {e}")),
            };
        }
        if wrote {
            let p = writer.progress();
            ch.progress
                .send_replace(OutputProgress { done: false, ..p });
            // Frames keep being read and stored while the ack is held: the agent sends at
            // most its retained bytes past the last ack, and an unread HTTP/2 stream would
            // hold the connection's window, which the sandbox's other streams share.
            held = None;
            let line = match ch.followers.any() {
                true => writer.hold_line().ok().flatten(),
                false => None,
            };
            if let Some(line) = line.filter(|l| ch.followers.holding(l).is_some()) {
                held = Some((p, line));
            } else if tx.send(ack(&p)).await.is_err() {
                return PumpEnd::Disconnected;
            }
        }
    }
}

/// Sends a command's input to the agent on one attach, from position `from` on, as it
/// is written (see [`InputLog`]); ends with the attach.
async fn send_input(mut log: watch::Receiver<InputLog>, tx: mpsc::Sender<Bytes>, mut from: u64) {
    loop {
        let (frames, next) = log.borrow_and_update().frames_from(from);
        if frames.is_empty() {
            if log.changed().await.is_err() {
                return;
            }
            continue;
        }
        for f in frames {
            if tx.send(f.to_bytes()).await.is_err() {
                return;
            }
        }
        from = next;
    }
}

/// A task that is aborted when this is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn ack(p: &OutputProgress) -> Bytes {
    Frame::Ack {
        stdout: p.stdout,
        stderr: p.stderr,
    }
    .to_bytes()
}

/// Resolves when a held acknowledgement may go to the agent: no follower is below
/// `line` in its view any more, or those that are have stalled. Never resolves when
/// nothing is held.
async fn release(ch: &CommandHandle, line: Option<HoldLine>) {
    match line {
        Some(line) => ch.followers.released(line).await,
        None => std::future::pending().await,
    }
}

/// Appends a chunk after checking it continues the stream exactly.
/// `Ok(true)`: the sandbox's output budget is due a check.
fn append_checked(
    writer: &mut OutputWriter,
    stream: Stream,
    offset: u64,
    data: &[u8],
) -> Result<bool, String> {
    let p = writer.progress();
    let expected = match stream {
        Stream::Stdout => p.stdout,
        Stream::Stderr => p.stderr,
    };
    if offset != expected {
        return Err(format!(
            "the agent sent {stream:?} at offset {offset}, expected {expected}"
        ));
    }
    // File writes (and the index's fsync-free appends) off the async worker threads.
    let due = space_store::offload(|| writer.append(stream, data))
        .map_err(|e| format!("storing the output failed: {e}"))?;
    super::metrics::output_stored(stream == Stream::Stdout, data.len());
    Ok(due)
}

/// Most secrets of a sandbox or a command, and their bounds.
const MAX_SECRETS: usize = 128;
const MAX_SECRET_NAME: usize = 256;
const MAX_SECRET_VALUE: usize = 64 * 1024;
const MAX_SECRETS_BYTES: usize = 256 * 1024;

/// Secrets are environment variables with portable names (`[A-Za-z_][A-Za-z0-9_]*`),
/// bounded in number and size. Errors name the variable, never its value.
pub(crate) fn validate_secrets(secrets: &BTreeMap<String, String>) -> Result<(), ServiceError> {
    if secrets.len() > MAX_SECRETS {
        return Err(ServiceError::BadRequest(format!(
            "at most {MAX_SECRETS} secrets"
        )));
    }
    let mut total = 0usize;
    for (name, value) in secrets {
        let mut bytes = name.bytes();
        let valid = name.len() <= MAX_SECRET_NAME
            && bytes
                .next()
                .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
            && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !valid {
            let shown: String = name.chars().take(64).collect();
            return Err(ServiceError::BadRequest(format!(
                "invalid secret name {shown:?}: names are [A-Za-z_][A-Za-z0-9_]*, at most {MAX_SECRET_NAME} bytes"
            )));
        }
        if value.contains('\0') {
            return Err(ServiceError::BadRequest(format!(
                "secret {name} contains a NUL byte"
            )));
        }
        if value.len() > MAX_SECRET_VALUE {
            return Err(ServiceError::BadRequest(format!(
                "secret {name} is larger than {} KiB",
                MAX_SECRET_VALUE / 1024
            )));
        }
        total += name.len() + value.len();
    }
    if total > MAX_SECRETS_BYTES {
        return Err(ServiceError::BadRequest(format!(
            "secrets larger than {} KiB in all",
            MAX_SECRETS_BYTES / 1024
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle() -> Arc<CommandHandle> {
        Arc::new(CommandHandle {
            sandbox_id: "sb".into(),
            progress: watch::channel(OutputProgress::default()).0,
            interactive: false,
            host_frames: watch::channel(None).0,
            input_offsets: watch::channel(None).0,
            input: watch::channel(InputLog::default()).0,
            followers: Followers::default(),
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_lagging_follower_holds_until_it_catches_up_stalls_or_leaves() {
        let ch = handle();
        // Ends at stdout 100, stderr 50, combined 150; lagging more than 10 holds.
        let line = HoldLine {
            stdout: 90,
            stderr: 40,
            combined: 140,
        };
        // Nobody follows: nothing holds.
        assert!(ch.followers.holding(&line).is_none());
        // Each view lags by its own measure: stdout 100 - 95, stderr 50 - 0, combined 150 - 95.
        let out = FollowerMark::join(ch.clone(), View::Stdout, 95);
        assert!(ch.followers.holding(&line).is_none());
        let err = FollowerMark::join(ch.clone(), View::Stderr, 0);
        assert!(ch.followers.holding(&line).is_some());
        err.moved_to(45);
        assert!(ch.followers.holding(&line).is_none());
        let both = FollowerMark::join(ch.clone(), View::Combined, 95);
        assert!(ch.followers.holding(&line).is_some());
        // Moving backwards is not moving.
        both.moved_to(10);
        // Released once it catches up...
        let released = tokio::spawn({
            let ch = ch.clone();
            async move { ch.followers.released(line).await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!released.is_finished());
        both.moved_to(140);
        released.await.unwrap();
        drop(both);
        // ... or when it leaves ...
        let gone = FollowerMark::join(ch.clone(), View::Combined, 95);
        assert!(ch.followers.holding(&line).is_some());
        let released = tokio::spawn({
            let ch = ch.clone();
            async move { ch.followers.released(line).await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!released.is_finished());
        drop(gone);
        released.await.unwrap();
        // ... or once it has not moved for FOLLOWER_STALL, until it moves again.
        let slow = FollowerMark::join(ch.clone(), View::Stdout, 0);
        let start = tokio::time::Instant::now();
        ch.followers.released(line).await;
        assert_eq!(start.elapsed(), FOLLOWER_STALL);
        assert!(ch.followers.holding(&line).is_none());
        slow.moved_to(1);
        assert!(ch.followers.holding(&line).is_some());
        drop((out, err, slow));
        assert!(ch.followers.holding(&line).is_none());
    }
}
