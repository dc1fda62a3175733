//! One command the agent runs: its retained output, its exit, its stdin, and
//! the tasks that move bytes between its pipes (or its terminal) and the host.
//!
//! Output is kept per stream as chunks tagged with an arrival sequence number, so
//! an attach can replay both streams in the order they were read while acks drop
//! each stream's acknowledged prefix independently.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use space_agent::protocol::{
    CommandInfo, ExitStatus, Frame, PtySize, Stream, MAX_DATA_CHUNK, RETAIN_MAX_BYTES,
};
use tokio::sync::{mpsc, watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::pty::{Pty, PtyRead};
use crate::watch::Watched;

/// Stdin bytes the agent queues for a command that is not reading them yet.
/// Acks travel behind stdin in the same request body, so this must be well above
/// what the host can have in flight, or a command that echoes its input could
/// stall with its output unacknowledged.
const STDIN_QUEUE_BYTES: usize = 8 << 20;

/// After the main process exits, at most this much more is read from each pipe
/// (what it left in the pipe, plus whatever background children add meanwhile).
const DRAIN_LIMIT: usize = 4 << 20;

/// After a read of [`COALESCE_FROM`] or more that emptied a pipe, the pump lets this pass
/// before it reads again, so a busy stream travels in chunks near [`MAX_DATA_CHUNK`] rather
/// than in its writer's small writes: every chunk costs the agent several system calls
/// (which gVisor makes expensive) and a frame and an ack on the host link. The first bytes
/// after a quiet spell still go out at once, and a command's end cuts the wait short.
/// 8 ms and 256 KiB chunks cost the sandbox a fifth less CPU per byte streamed than 2 ms and
/// 64 KiB did (`benches/commands.rs`); a busy stream is at most this much later.
const COALESCE: std::time::Duration = std::time::Duration::from_millis(8);
/// Only a read at least this large counts as busy: small writes (a line at a time) keep
/// going out as they come, in the order they came on stdout and stderr together.
const COALESCE_FROM: usize = 2048;

#[derive(Debug)]
struct Chunk {
    seq: u64,
    offset: u64,
    data: Bytes,
}

impl Chunk {
    fn end(&self) -> u64 {
        self.offset + self.data.len() as u64
    }
}

/// The unacknowledged output of one stream.
#[derive(Debug, Default)]
struct Retained {
    chunks: VecDeque<Chunk>,
    /// Bytes produced so far.
    end: u64,
    /// Bytes held in `chunks`.
    bytes: usize,
}

impl Retained {
    /// Lowest offset still held.
    fn base(&self) -> u64 {
        self.chunks.front().map_or(self.end, |c| c.offset)
    }

    fn room(&self) -> usize {
        RETAIN_MAX_BYTES.saturating_sub(self.bytes)
    }

    fn push(&mut self, seq: u64, data: Bytes) {
        let offset = self.end;
        self.end += data.len() as u64;
        self.bytes += data.len();
        self.chunks.push_back(Chunk { seq, offset, data });
    }

    /// Drops chunks wholly below `upto`; whether any was dropped.
    fn ack(&mut self, upto: u64) -> bool {
        let mut dropped = false;
        while self.chunks.front().is_some_and(|c| c.end() <= upto) {
            if let Some(c) = self.chunks.pop_front() {
                self.bytes -= c.data.len();
                dropped = true;
            }
        }
        dropped
    }

    /// The first chunk holding bytes at or after `cursor`.
    fn next_from(&self, cursor: u64) -> Option<&Chunk> {
        let i = self.chunks.partition_point(|c| c.end() <= cursor);
        self.chunks.get(i)
    }
}

/// One entry of a command's stdin queue.
#[derive(Debug)]
struct Input {
    what: InputKind,
    /// Its share of the queue's budget, released once it is written.
    _permit: OwnedSemaphorePermit,
}

#[derive(Debug)]
enum InputKind {
    Data(Bytes),
    /// A terminal's end-of-file: its EOF character (a pipe is closed instead).
    Eof,
}

/// Where stdin bytes for a command go: an unbounded queue whose bytes are
/// bounded by a semaphore, drained by the command's stdin writer task.
#[derive(Debug, Clone)]
pub struct StdinHandle {
    tx: mpsc::UnboundedSender<Input>,
    budget: Arc<Semaphore>,
}

impl StdinHandle {
    /// Queues `data`, waiting while the queue is full. Errors are ignored: a
    /// command that closed its stdin just does not get the bytes.
    pub async fn send(&self, data: Bytes) {
        let n = u32::try_from(data.len()).unwrap_or(u32::MAX);
        if let Ok(permit) = self.budget.clone().acquire_many_owned(n).await {
            let _ = self.tx.send(Input {
                what: InputKind::Data(data),
                _permit: permit,
            });
        }
    }

    /// Queues a terminal's end-of-file behind the bytes already queued.
    pub async fn send_eof(&self) {
        if let Ok(permit) = self.budget.clone().acquire_many_owned(1).await {
            let _ = self.tx.send(Input {
                what: InputKind::Eof,
                _permit: permit,
            });
        }
    }
}

/// Where a command's output comes from: a pipe per stream, or its terminal
/// (stdout and stderr together, reported as stdout).
#[derive(Debug)]
pub enum Source {
    Pipe(Watched),
    Pty(Arc<Pty>),
    /// A pipe out of the agent's epoll (see [`unregister`]), non-blocking: polled
    /// every [`COALESCE`] until it is registered again.
    Parked(std::os::fd::OwnedFd),
}

impl Source {
    async fn readable(&self) -> std::io::Result<()> {
        match self {
            Source::Pipe(p) => {
                p.ready(crate::watch::READ).await;
                Ok(())
            }
            Source::Pty(p) => p.readable().await,
            Source::Parked(_) => {
                tokio::time::sleep(COALESCE).await;
                Ok(())
            }
        }
    }

    fn try_read(&self, buf: &mut [u8]) -> Read {
        match self {
            Source::Pipe(p) => try_read(p, buf),
            Source::Pty(p) => p.try_read(buf).into(),
            Source::Parked(fd) => read_fd(fd, buf),
        }
    }

    fn read_now(&self, buf: &mut [u8]) -> Read {
        match self {
            Source::Pipe(p) => read_fd(p, buf),
            Source::Pty(p) => p.read_now(buf).into(),
            Source::Parked(fd) => read_fd(fd, buf),
        }
    }
}

/// Where a command's stdin queue is written to.
#[derive(Debug)]
pub enum Sink {
    Pipe(Watched),
    Pty(Arc<Pty>),
}

#[derive(Debug, Default)]
struct State {
    /// 0 until started, and for good when the program could not be started.
    pid: u32,
    streams: [Retained; 2],
    next_seq: u64,
    /// Raw `waitpid` status once the main process has been reaped.
    wait_status: Option<i32>,
    reaped_at: Option<Instant>,
    /// When the command was over (see [`Cmd::ended`]).
    ended_at: Option<Instant>,
    timed_out: bool,
    /// One of its processes was killed for using up the sandbox's memory.
    oom_killed: bool,
    /// Set once the process has exited and its output has all been read.
    exit: Option<ExitStatus>,
    attach_cancel: Option<CancellationToken>,
    stdin: Option<StdinHandle>,
    /// The command's terminal, until its output has all been read.
    pty: Option<Arc<Pty>>,
    /// The `RLIMIT_RSS` tag its processes carry (see `tree`).
    tag: Option<u64>,
    /// Process groups of its processes that a kill found (see `tree::kill_all`).
    known_groups: Vec<i32>,
    /// Positions of its input taken so far: each stdin byte and each end-of-file is one
    /// (see [`Frame::StdinAt`]).
    input_taken: u64,
}

impl State {
    fn push(&mut self, s: usize, data: Bytes) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.streams[s].push(seq, data);
    }

    fn exited(&self) -> bool {
        self.exit.is_some() || self.wait_status.is_some()
    }

    /// The next output frame for an attach at `cursor`, advancing it.
    fn next_frame(&self, cursor: &mut [u64; 2]) -> Option<Frame> {
        for (c, r) in cursor.iter_mut().zip(&self.streams) {
            // Someone acknowledged past this attach: the host has those bytes.
            *c = (*c).max(r.base());
        }
        let a = self.streams[0].next_from(cursor[0]);
        let b = self.streams[1].next_from(cursor[1]);
        let (s, chunk) = match (a, b) {
            (Some(a), Some(b)) if b.seq < a.seq => (1, b),
            (Some(a), _) => (0, a),
            (None, Some(b)) => (1, b),
            (None, None) => return None,
        };
        let start = cursor[s].max(chunk.offset);
        let skip = usize::try_from(start - chunk.offset).unwrap_or(usize::MAX);
        let data = chunk.data.slice(skip.min(chunk.data.len())..);
        cursor[s] = chunk.end();
        Some(if s == 0 {
            Frame::Stdout {
                offset: start,
                data,
            }
        } else {
            Frame::Stderr {
                offset: start,
                data,
            }
        })
    }
}

/// Why an attach was refused.
#[derive(Debug)]
pub enum AttachError {
    /// An offset is below what is retained or above what was produced.
    Range { stream: Stream, base: u64, end: u64 },
}

/// One command.
#[derive(Debug)]
pub struct Cmd {
    pub id: String,
    started: Instant,
    state: Mutex<State>,
    /// Bumped on every change an attach may be waiting for.
    changed: watch::Sender<u64>,
    /// Woken when an ack frees retention space.
    space: Notify,
    /// Cancelled once the main process has been reaped (or never started).
    pub reaped: CancellationToken,
    /// Cancelled once the command is over: its main process has been reaped and,
    /// for a command with a timeout, every process it started has ended or been
    /// killed (see `http::lifetime`). Its output is then drained and it finishes.
    pub ended: CancellationToken,
    /// Its cgroup, where commands get one (a microVM).
    group: std::sync::OnceLock<crate::cgroup::Group>,
    /// Cancelled when the host forgets the command: its tasks stop.
    pub forgotten: CancellationToken,
    /// Held while input is taken, so that an attach that supersedes another takes its
    /// input after whatever the old one was taking (see [`take_input`]).
    input_gate: tokio::sync::Mutex<()>,
}

impl Cmd {
    pub fn new(id: String) -> Self {
        Cmd {
            id,
            started: Instant::now(),
            state: Mutex::default(),
            changed: watch::Sender::new(0),
            space: Notify::new(),
            reaped: CancellationToken::new(),
            ended: CancellationToken::new(),
            group: std::sync::OnceLock::new(),
            forgotten: CancellationToken::new(),
            input_gate: tokio::sync::Mutex::new(()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    pub fn set_pid(&self, pid: u32) {
        self.lock().pid = pid;
    }

    /// Whether the main process has exited (or was never started).
    pub fn exited(&self) -> bool {
        self.lock().exited()
    }

    /// Whether the process is started and not yet reaped; only meaningful while
    /// the reaper lock is held, which keeps the pid from being reaped meanwhile.
    pub fn running_pid(&self) -> Option<u32> {
        let st = self.lock();
        (st.pid != 0 && !st.exited()).then_some(st.pid)
    }

    /// The main process's pid (0: never started), reaped or not.
    pub fn pid(&self) -> u32 {
        self.lock().pid
    }

    pub fn set_group(&self, group: crate::cgroup::Group) {
        let _ = self.group.set(group);
    }

    pub fn group(&self) -> Option<&crate::cgroup::Group> {
        self.group.get()
    }

    pub fn set_tag(&self, tag: Option<u64>) {
        self.lock().tag = tag;
    }

    pub fn tag(&self) -> Option<u64> {
        self.lock().tag
    }

    pub fn known_groups(&self) -> Vec<i32> {
        self.lock().known_groups.clone()
    }

    pub fn set_known_groups(&self, groups: Vec<i32>) {
        self.lock().known_groups = groups;
    }

    pub fn set_pty(&self, pty: Arc<Pty>) {
        self.lock().pty = Some(pty);
    }

    /// Resizes the command's terminal; nothing without one (or once it has ended).
    /// Blocking where the kernel leaves SIGWINCH to us (scans `/proc`).
    pub fn resize(&self, size: PtySize) {
        let (pty, root) = {
            let st = self.lock();
            (
                st.pty.clone(),
                (st.pid != 0 && !st.exited()).then_some(st.pid),
            )
        };
        let Some(pty) = pty else { return };
        // Fails only for a terminal already gone: nothing to resize then.
        if pty.resize(size).is_err() || pty.kernel_signals_resize() {
            return;
        }
        // Not knowing the foreground group, tell every group of the session;
        // SIGWINCH is ignored by default, so the others at most redraw.
        if let Some(root) = root.and_then(|p| i32::try_from(p).ok()) {
            crate::tree::signal_session_groups(root, libc::SIGWINCH);
        }
    }

    pub fn mark_timed_out(&self) {
        self.lock().timed_out = true;
    }

    pub fn mark_oom_killed(&self) {
        self.lock().oom_killed = true;
    }

    /// The command is over: its output is drained next, and then it finishes.
    pub fn end(&self) {
        self.lock().ended_at.get_or_insert_with(Instant::now);
        self.ended.cancel();
    }

    /// Called by the reaper with the raw wait status.
    pub fn on_reaped(&self, status: i32) {
        {
            let mut st = self.lock();
            st.wait_status = Some(status);
            st.reaped_at = Some(Instant::now());
        }
        self.reaped.cancel();
        self.bump();
    }

    /// The program could not be started: the command ends at once with `code`
    /// and one line on stderr.
    pub fn set_failed(&self, argv0: &str, code: i32, reason: String) {
        {
            let mut st = self.lock();
            let line = format!("space-agent: cannot run '{argv0}': {reason}\n");
            st.push(1, Bytes::from(line));
            st.exit = Some(ExitStatus {
                exit_code: Some(code),
                signal: None,
                timed_out: false,
                oom_killed: false,
                duration_ms: millis(self.started.elapsed()),
                error: Some(reason),
            });
        }
        self.reaped.cancel();
        self.ended.cancel();
        self.bump();
    }

    pub fn set_stdin(&self, h: StdinHandle) {
        self.lock().stdin = Some(h);
    }

    pub fn stdin(&self) -> Option<StdinHandle> {
        self.lock().stdin.clone()
    }

    /// The host's end of stdin. For a pipe: drops our end of the queue, and the
    /// writer closes the pipe once the queued bytes are written. A terminal is not
    /// closed (it is the command's stdout too); it gets its EOF character, as from
    /// a user pressing ^D, which is returned here to be queued.
    pub fn end_stdin(&self) -> Option<StdinHandle> {
        let mut st = self.lock();
        if st.pty.is_some() {
            st.stdin.clone()
        } else {
            st.stdin = None;
            None
        }
    }

    /// Counts `n` more positions of input as taken, for the attach to report.
    pub fn note_input_taken(&self, n: u64) {
        if n > 0 {
            let mut st = self.lock();
            st.input_taken = st.input_taken.saturating_add(n);
            drop(st);
            self.bump();
        }
    }

    pub fn ack(&self, stdout: u64, stderr: u64) {
        let dropped = {
            let mut st = self.lock();
            let a = st.streams[0].ack(stdout);
            let b = st.streams[1].ack(stderr);
            a || b
        };
        if dropped {
            self.space.notify_one();
        }
    }

    pub fn info(&self) -> CommandInfo {
        let st = self.lock();
        CommandInfo {
            id: self.id.clone(),
            pid: st.pid,
            exit: st.exit.clone(),
            stdout_base: st.streams[0].base(),
            stderr_base: st.streams[1].base(),
            stdout_end: st.streams[0].end,
            stderr_end: st.streams[1].end,
        }
    }

    /// Starts an attach at the given offsets: checks them, supersedes any
    /// earlier attach and returns the token that ends the new one.
    pub fn begin_attach(&self, offsets: [u64; 2]) -> Result<CancellationToken, AttachError> {
        let mut st = self.lock();
        for (s, stream) in [Stream::Stdout, Stream::Stderr].into_iter().enumerate() {
            let r = &st.streams[s];
            if offsets[s] < r.base() || offsets[s] > r.end {
                return Err(AttachError::Range {
                    stream,
                    base: r.base(),
                    end: r.end,
                });
            }
        }
        if let Some(old) = st.attach_cancel.take() {
            old.cancel();
        }
        let token = CancellationToken::new();
        st.attach_cancel = Some(token.clone());
        Ok(token)
    }

    /// Cancels the current attach, if any.
    pub fn end_attach(&self) {
        if let Some(old) = self.lock().attach_cancel.take() {
            old.cancel();
        }
    }

    fn rooms(&self) -> [usize; 2] {
        let st = self.lock();
        [st.streams[0].room(), st.streams[1].room()]
    }

    fn push(&self, s: usize, data: Bytes) {
        self.lock().push(s, data);
        self.bump();
    }

    /// The process was reaped and its pipes are drained: the command is finished.
    fn finish(&self) {
        {
            let mut st = self.lock();
            if st.exit.is_some() {
                return;
            }
            if st.pty.take().is_some() {
                // Stops the terminal's writer, so the master closes once the
                // pump lets go of it too: what remains on the slave side (background
                // children) then reads EOF and writes EIO rather than blocking.
                st.stdin = None;
            }
            let (exit_code, signal) = match st.wait_status {
                // Its timeout killed what was left of it, if not its main process: it did
                // not end cleanly, whatever that process returned.
                _ if st.timed_out => (None, Some(libc::SIGKILL)),
                Some(status) if libc::WIFEXITED(status) => (Some(libc::WEXITSTATUS(status)), None),
                Some(status) if libc::WIFSIGNALED(status) => (None, Some(libc::WTERMSIG(status))),
                // Never reaped (it could not be waited for): no exit to report.
                _ => (None, Some(libc::SIGKILL)),
            };
            let oom_killed = st.oom_killed || self.group().is_some_and(|g| g.oom_kills() > 0);
            // A command with a timeout lasts until the last of its processes ended.
            let end = st.ended_at.or(st.reaped_at).unwrap_or_else(Instant::now);
            st.exit = Some(ExitStatus {
                exit_code,
                signal,
                timed_out: st.timed_out,
                oom_killed,
                duration_ms: millis(end.saturating_duration_since(self.started)),
                error: None,
            });
        }
        self.bump();
    }
}

fn millis(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Creates the stdin queue for a command and starts its writer.
pub fn start_stdin_writer(cmd: &Arc<Cmd>, sink: Sink) -> StdinHandle {
    let (tx, rx) = mpsc::unbounded_channel();
    let handle = StdinHandle {
        tx,
        budget: Arc::new(Semaphore::new(STDIN_QUEUE_BYTES)),
    };
    tokio::spawn(stdin_writer(sink, rx, cmd.forgotten.clone()));
    handle
}

async fn write_input(sink: &mut Sink, input: &InputKind) -> std::io::Result<()> {
    match (sink, input) {
        (Sink::Pipe(p), InputKind::Data(data)) => p.write_all(data).await,
        (Sink::Pty(p), InputKind::Data(data)) => p.write_all(data).await,
        (Sink::Pty(p), InputKind::Eof) => p.write_all(&[p.eof_char()]).await,
        // Pipes are closed by dropping the queue; an EOF is never queued for one.
        (Sink::Pipe(_), InputKind::Eof) => Err(std::io::ErrorKind::BrokenPipe.into()),
    }
}

async fn stdin_writer(
    mut sink: Sink,
    mut rx: mpsc::UnboundedReceiver<Input>,
    forgotten: CancellationToken,
) {
    loop {
        let msg = tokio::select! {
            m = rx.recv() => m,
            _ = forgotten.cancelled() => None,
        };
        // The permit is released once the bytes are written.
        let Some(input) = msg else { return };
        let r = tokio::select! {
            r = write_input(&mut sink, &input.what) => r,
            _ = forgotten.cancelled() => return,
        };
        if r.is_err() {
            // The command closed its stdin; later bytes are dropped with `rx`.
            return;
        }
    }
}

enum Read {
    Data(usize),
    Eof,
    Again,
}

impl From<PtyRead> for Read {
    fn from(r: PtyRead) -> Read {
        match r {
            PtyRead::Data(n) => Read::Data(n),
            PtyRead::Eof => Read::Eof,
            PtyRead::Again => Read::Again,
        }
    }
}

fn try_read(p: &Watched, buf: &mut [u8]) -> Read {
    match p.try_io(crate::watch::READ, |fd| crate::watch::read(fd, buf)) {
        Ok(0) => Read::Eof,
        Ok(n) => Read::Data(n),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Read::Again,
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Read::Again,
        Err(_) => Read::Eof,
    }
}

/// A read that does not consult tokio's readiness (which a pipe registered a
/// moment ago has not got yet): after the exit, what is in the pipe is all
/// there is to wait for.
fn read_fd(p: &impl std::os::fd::AsRawFd, buf: &mut [u8]) -> Read {
    loop {
        match crate::watch::read(p.as_raw_fd(), buf) {
            Ok(0) => return Read::Eof,
            Ok(n) => return Read::Data(n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Read::Again,
            Err(_) => return Read::Eof,
        }
    }
}

async fn readable(p: Option<&Source>) -> std::io::Result<()> {
    match p {
        Some(p) => p.readable().await,
        None => std::future::pending().await,
    }
}

/// Moves a command's output from its pipes (or terminal) into its retained queue
/// until the command has ended (see [`Cmd::ended`]) and they are drained, then finishes it.
///
/// While the agent is quiesced (`quiet`: a checkpoint may be taken) the pump reads
/// nothing: no thread of the agent wakes for a command's output, and a command that
/// writes blocks on a full pipe, asleep in the kernel, where a checkpoint saves it right
/// (see [`crate::http::Quiet`]). Nothing is lost: the pipe keeps it until the agent is woken.
pub async fn pump(
    cmd: Arc<Cmd>,
    stdout: Option<Source>,
    stderr: Option<Source>,
    agent: Arc<crate::http::Agent>,
) {
    let quiet = &agent.quiet;
    let mut pipes = [stdout, stderr];
    let mut arena = ReadArena::default();
    // The last read emptied its pipe.
    let mut emptied = false;

    // While the command runs: read whatever arrives, as retention allows.
    while !cmd.ended.is_cancelled() {
        if quiet.is_on() {
            park_while_quiet(&mut pipes, &agent).await;
            continue;
        }
        if std::mem::take(&mut emptied) {
            // Let more output gather first (the pipes are large enough that a writer
            // does not stall meanwhile, see `spawn::OUTPUT_PIPE_BYTES`), with the pipes
            // out of the agent's epoll: registered, every small write would wake a
            // thread of the agent for nothing, which costs gVisor a context switch each.
            unregister(&mut pipes);
            let forgotten = tokio::select! {
                _ = tokio::time::sleep(COALESCE) => false,
                _ = cmd.ended.cancelled() => false,
                _ = cmd.forgotten.cancelled() => true,
                _ = quiet.entered() => false,
            };
            if forgotten {
                return;
            }
            register(&mut pipes, &agent);
        }
        let room = cmd.rooms();
        let blocked = (0..2).any(|s| pipes[s].is_some() && room[s] == 0);
        let ready = tokio::select! {
            r = readable(pipes[0].as_ref()), if pipes[0].is_some() && room[0] > 0 => Some((0, r)),
            r = readable(pipes[1].as_ref()), if pipes[1].is_some() && room[1] > 0 => Some((1, r)),
            _ = cmd.space.notified(), if blocked => None,
            _ = cmd.ended.cancelled() => None,
            _ = cmd.forgotten.cancelled() => return,
            _ = quiet.entered() => None,
        };
        let Some((s, r)) = ready else { continue };
        let (read, asked) = match (&pipes[s], r) {
            (Some(p), Ok(())) => {
                let into = arena.space(room[s].min(MAX_DATA_CHUNK));
                (p.try_read(into), into.len())
            }
            _ => (Read::Eof, 0),
        };
        match read {
            Read::Data(n) => {
                cmd.push(s, arena.take(n, asked));
                emptied = n < asked && n >= COALESCE_FROM;
            }
            Read::Eof => pipes[s] = None,
            Read::Again => {}
        }
    }

    // The command is over: take what is already in the pipes, without waiting
    // for background children that may hold them open.
    quiet.off().await;
    for (s, slot) in pipes.iter_mut().enumerate() {
        let Some(p) = slot.take() else { continue };
        let mut drained = 0usize;
        while drained < DRAIN_LIMIT {
            let room = cmd.rooms()[s];
            if room == 0 {
                tokio::select! {
                    _ = cmd.space.notified() => continue,
                    _ = cmd.forgotten.cancelled() => return,
                }
            }
            let into = arena.space(room.min(MAX_DATA_CHUNK).min(DRAIN_LIMIT - drained));
            let asked = into.len();
            match p.read_now(into) {
                Read::Data(n) => {
                    cmd.push(s, arena.take(n, asked));
                    drained += n;
                }
                Read::Eof | Read::Again => break,
            }
        }
    }
    cmd.finish();
}

/// What the pump reads a command's output into. Each read's bytes are split off it and
/// kept as they are (no copy on their way to the host); a new arena is made when the last
/// is used up. A command's first arena is small ([`ARENA_FIRST`]); once a read fills what
/// it asked for (a busy stream) arenas are [`ARENA_BYTES`], so a read can take a whole
/// [`MAX_DATA_CHUNK`]. A kept chunk holds its arena's memory until it is acknowledged, so a
/// command holds at most its retained bytes and one arena more.
#[derive(Default)]
struct ReadArena {
    buf: BytesMut,
    busy: bool,
}

/// A command's first arena: most commands write less than this in all.
const ARENA_FIRST: usize = 64 << 10;
/// Arenas of a busy stream: two whole chunks each.
const ARENA_BYTES: usize = 2 * MAX_DATA_CHUNK;

impl ReadArena {
    /// Room for a read of at most `ask` bytes (less where the arena has less left).
    fn space(&mut self, ask: usize) -> &mut [u8] {
        if self.buf.is_empty() {
            let size = if self.busy { ARENA_BYTES } else { ARENA_FIRST };
            self.buf = BytesMut::zeroed(size);
        }
        let n = ask.min(self.buf.len());
        &mut self.buf[..n]
    }

    /// The `n` bytes a read of `asked` put at the start of [`ReadArena::space`].
    fn take(&mut self, n: usize, asked: usize) -> Bytes {
        if n == asked {
            self.busy = true;
        }
        self.buf.split_to(n).freeze()
    }
}

/// Takes a command's pipes out of the agent's epoll until the agent is woken: output
/// arriving meanwhile wakes no thread of the agent while the sandbox may be checkpointed.
/// An event that a restored epoll reports for the deleted registration names a serial
/// number no pipe has any more and is dropped (see [`crate::watch`]). A terminal stays
/// registered (its master is shared with the stdin writer) and is only not read.
async fn park_while_quiet(pipes: &mut [Option<Source>; 2], agent: &crate::http::Agent) {
    unregister(pipes);
    agent.quiet.off().await;
    register(pipes, agent);
}

/// Takes the pipes among `pipes` out of the agent's epoll (a terminal stays).
fn unregister(pipes: &mut [Option<Source>; 2]) {
    for slot in pipes.iter_mut() {
        if let Some(Source::Pipe(p)) = slot.take_if(|s| matches!(s, Source::Pipe(_))) {
            *slot = Some(Source::Parked(p.into_fd()));
        }
    }
}

/// Puts pipes taken out by [`unregister`] back; data already in a pipe is reported at
/// once. A pipe the epoll does not take back (out of room) stays parked, polled,
/// its output intact.
fn register(pipes: &mut [Option<Source>; 2], agent: &crate::http::Agent) {
    let Ok(reactor) = agent.reactor() else { return };
    for slot in pipes.iter_mut() {
        if let Some(Source::Parked(fd)) = slot.take_if(|s| matches!(s, Source::Parked(_))) {
            // A spare: a failed registration closes the descriptor it was given.
            let spare = fd.try_clone();
            *slot = match (Watched::new(&reactor, fd, crate::watch::READ), spare) {
                (Ok(p), _) => Some(Source::Pipe(p)),
                (Err(e), Ok(spare)) => {
                    note!("space-agent: an output pipe stays polled: {e}");
                    Some(Source::Parked(spare))
                }
                // Neither: the descriptor is gone, as at end of file.
                (Err(_), Err(_)) => None,
            };
        }
    }
}

/// Sends a command's output from `cursor` on, then its exit, as encoded frames
/// into `tx`, until done, superseded (`cancel`) or the receiver is gone.
pub async fn send_output(
    cmd: Arc<Cmd>,
    mut cursor: [u64; 2],
    report_input: bool,
    tx: mpsc::Sender<Bytes>,
    cancel: CancellationToken,
) {
    enum Step {
        Send(Frame),
        Last(Frame),
        Wait,
    }
    let mut changed = cmd.changed.subscribe();
    // The input taken that this attach last reported; the first frame reports it.
    let mut reported = None;
    loop {
        changed.borrow_and_update();
        let step = {
            let st = cmd.lock();
            if report_input && reported != Some(st.input_taken) {
                // Before any Exit: the host hears of all the input taken before the end.
                reported = Some(st.input_taken);
                Step::Send(Frame::InputTaken(st.input_taken))
            } else {
                match st.next_frame(&mut cursor) {
                    Some(f) => Step::Send(f),
                    None => match &st.exit {
                        Some(exit)
                            if cursor[0] >= st.streams[0].end && cursor[1] >= st.streams[1].end =>
                        {
                            Step::Last(Frame::Exit(exit.clone()))
                        }
                        _ => Step::Wait,
                    },
                }
            }
        };
        match step {
            Step::Send(f) | Step::Last(f) if cancel.is_cancelled() => {
                drop(f);
                return;
            }
            Step::Send(f) => {
                let (head, data) = f.to_parts();
                for part in std::iter::once(head).chain(data) {
                    tokio::select! {
                        r = tx.send(part) => if r.is_err() { return },
                        _ = cancel.cancelled() => return,
                    }
                }
            }
            Step::Last(f) => {
                tokio::select! {
                    _ = tx.send(f.to_bytes()) => {},
                    _ = cancel.cancelled() => {},
                }
                return;
            }
            Step::Wait => {
                tokio::select! {
                    r = changed.changed() => if r.is_err() { return },
                    _ = tx.closed() => return,
                    _ = cancel.cancelled() => return,
                }
            }
        }
    }
}

/// Takes input at `offset` of `cmd`'s input (`data`, or an end-of-file for `None`; with no
/// offset, a host's from before offsets, wherever the input is): queues it for the command
/// (or drops it where the command no longer reads its stdin) and counts it taken. What was
/// taken already is skipped, so a host that resends after a break delivers each position
/// once. An offset past what was taken is a gap: input the host no longer has (it cannot
/// happen unless this agent lost input it had reported taken); the count jumps over it, so
/// that what follows is taken rather than refused for ever. Nothing is taken when `cancel`
/// fires first.
pub async fn take_input(
    cmd: &Arc<Cmd>,
    offset: Option<u64>,
    data: Option<Bytes>,
    cancel: &CancellationToken,
) {
    let _gate = tokio::select! {
        g = cmd.input_gate.lock() => g,
        _ = cancel.cancelled() => return,
    };
    let taken = cmd.lock().input_taken;
    let offset = offset.unwrap_or(taken);
    if offset > taken {
        note!(
            "space-agent: input of {} resumes at {offset}, after {taken}: {} lost",
            cmd.id,
            offset - taken
        );
        cmd.note_input_taken(offset - taken);
    }
    let skip = taken.saturating_sub(offset);
    match data {
        Some(data) => {
            let skip = usize::try_from(skip).unwrap_or(usize::MAX);
            if skip >= data.len() {
                return;
            }
            let data = data.slice(skip..);
            let n = data.len() as u64;
            if let Some(stdin) = cmd.stdin() {
                tokio::select! {
                    _ = stdin.send(data) => {}
                    _ = cancel.cancelled() => return,
                }
            }
            cmd.note_input_taken(n);
        }
        None if skip > 0 => {}
        None => {
            if let Some(stdin) = cmd.end_stdin() {
                tokio::select! {
                    _ = stdin.send_eof() => {}
                    _ = cancel.cancelled() => return,
                }
            }
            cmd.note_input_taken(1);
        }
    }
}

/// Stream an attach offset or ack refers to.
pub fn stream_name(s: Stream) -> &'static str {
    match s {
        Stream::Stdout => "stdout",
        Stream::Stderr => "stderr",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_read_arena_hands_out_what_was_read_and_grows_for_a_busy_stream() {
        let mut a = ReadArena::default();
        // A command's first reads share a small arena.
        let room = a.space(MAX_DATA_CHUNK);
        assert_eq!(room.len(), ARENA_FIRST);
        room[..3].copy_from_slice(b"one");
        let asked = room.len();
        let one = a.take(3, asked);
        let room = a.space(MAX_DATA_CHUNK);
        assert_eq!(room.len(), ARENA_FIRST - 3);
        room[..3].copy_from_slice(b"two");
        let asked = room.len();
        let two = a.take(3, asked);
        assert_eq!((&one[..], &two[..]), (&b"one"[..], &b"two"[..]));
        // A read that fills what it asked for marks the stream busy: once this arena is
        // used up, the next is large enough for whole chunks.
        let room = a.space(MAX_DATA_CHUNK);
        room.fill(7);
        let asked = room.len();
        let rest = a.take(asked, asked);
        assert!(rest.iter().all(|b| *b == 7));
        let room = a.space(MAX_DATA_CHUNK);
        assert_eq!(room.len(), MAX_DATA_CHUNK);
        let room = a.space(100);
        assert_eq!(room.len(), 100, "never more than asked");
        room.copy_from_slice(&[9; 100]);
        let nine = a.take(100, 100);
        // What was handed out before is untouched by later reads.
        assert_eq!((&one[..], &two[..]), (&b"one"[..], &b"two"[..]));
        assert!(rest.iter().all(|b| *b == 7));
        assert_eq!(&nine[..], &[9; 100][..]);
    }

    fn data(f: &Frame) -> (u8, u64, Vec<u8>) {
        match f {
            Frame::Stdout { offset, data } => (1, *offset, data.to_vec()),
            Frame::Stderr { offset, data } => (2, *offset, data.to_vec()),
            _ => panic!("not a data frame"),
        }
    }

    #[test]
    fn frames_follow_arrival_order_and_slice() {
        let mut st = State::default();
        st.push(0, Bytes::from_static(b"abc"));
        st.push(1, Bytes::from_static(b"XY"));
        st.push(0, Bytes::from_static(b"def"));
        let mut cur = [1, 0];
        let got: Vec<_> = std::iter::from_fn(|| st.next_frame(&mut cur))
            .map(|f| data(&f))
            .collect();
        assert_eq!(
            got,
            vec![
                (1, 1, b"bc".to_vec()),
                (2, 0, b"XY".to_vec()),
                (1, 3, b"def".to_vec())
            ]
        );
        assert_eq!(cur, [6, 2]);
    }

    #[test]
    fn acks_drop_whole_chunks_per_stream() {
        let mut st = State::default();
        st.push(0, Bytes::from_static(b"abc"));
        st.push(1, Bytes::from_static(b"XY"));
        st.push(0, Bytes::from_static(b"def"));
        assert!(st.streams[0].ack(4));
        assert_eq!(st.streams[0].base(), 3);
        assert_eq!(st.streams[0].bytes, 3);
        assert!(!st.streams[1].ack(1));
        assert!(st.streams[1].ack(100));
        assert_eq!(st.streams[1].base(), 2);
        // A cursor below what is retained jumps to it.
        let mut cur = [0, 0];
        let f = st.next_frame(&mut cur).map(|f| data(&f));
        assert_eq!(f, Some((1, 3, b"def".to_vec())));
        assert_eq!(st.next_frame(&mut cur), None);
    }
}
