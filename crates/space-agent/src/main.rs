//! `space-agent`: PID 1 inside a sandbox.
//!
//! It dials the host (a Unix socket under gVisor, the virtio-serial port named by
//! `SPACE_AGENT_PORT` in a microVM), introduces itself with a [`Hello`] line and,
//! once accepted, serves HTTP/2 on that connection (the agent is the server).
//! When the connection ends it dials again; commands and their unacknowledged
//! output live in [`http::Agent`] and survive reconnects.

/// A line on the agent's stderr, the sandbox's console. Unlike `eprintln!`, a failed write
/// is ignored rather than a panic: the console is a small bounded file that anything in
/// the sandbox can fill (`/proc/1/fd/2`), and a full console must not end the agent.
/// One write per line: stderr is unbuffered, and a line formatted straight onto it is a
/// write for each of its pieces, each a system call that gVisor makes expensive.
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let mut line = format!($($arg)*);
        line.push('\n');
        let _ = std::io::stderr().write_all(line.as_bytes());
    }};
}

mod cgroup;
mod command;
mod failpoint;
mod files;
mod guest;
mod http;
mod masks;
mod oom;
mod port;
mod pty;
mod reaper;
mod relay;
mod spawn;
mod tree;
mod users;
mod vfork;
mod watch;

use std::convert::Infallible;
use std::future::Future;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http2;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use space_agent::protocol::{self, Hello, HelloReply, PROTOCOL_VERSION};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::signal::unix::{signal, SignalKind};

use crate::http::Agent;
use crate::port::Port;

const DEFAULT_SOCKET: &str = "/.space/run/agent.sock";
const DEFAULT_TOKEN_FILE: &str = "/.space/run/token";
const BACKOFF_MIN: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_millis(100);
/// Longest a quiesced agent waits to be woken before it dials again anyway (a server that
/// died between the quiesce and the checkpoint never wakes it).
const HOLD_MAX: Duration = Duration::from_secs(120);
/// Wait after the host refused the handshake.
const REFUSED_RETRY: Duration = Duration::from_secs(1);
/// A host that accepts but never answers the handshake is dropped after this.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// A quiet host connection is pinged this often, and dropped when a ping goes
/// unanswered for `KEEPALIVE_TIMEOUT`: a host that died without the hangup
/// reaching us (seen under gVisor's host sockets) must not keep us from
/// dialling its successor.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(3);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(6);

/// How the agent reaches the host.
enum Transport {
    /// A Unix stream socket the agent connects to (`SPACE_AGENT_SOCKET`).
    Socket(String),
    /// A virtio-serial port the agent opens (`SPACE_AGENT_PORT`).
    Port(String),
}

struct Config {
    transport: Transport,
    sandbox_id: String,
    token: String,
}

impl Config {
    fn from_env() -> Result<Config, String> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let transport = match var("SPACE_AGENT_PORT") {
            Some(port) => Transport::Port(port),
            None => Transport::Socket(
                var("SPACE_AGENT_SOCKET").unwrap_or_else(|| DEFAULT_SOCKET.into()),
            ),
        };
        let sandbox_id = var("SPACE_SANDBOX_ID").ok_or("SPACE_SANDBOX_ID is not set")?;
        let token_file = var("SPACE_AGENT_TOKEN_FILE").unwrap_or_else(|| DEFAULT_TOKEN_FILE.into());
        let mut raw = std::fs::read(&token_file)
            .map_err(|e| format!("cannot read token file {token_file}: {e}"))?;
        let token = String::from_utf8_lossy(&raw).trim().to_string();
        // Kept once, in `Config` (every reconnect presents it); no other copy lingers.
        raw.fill(0);
        std::hint::black_box(&raw);
        // The token is only for us: nothing the sandbox runs should read it. Under gVisor
        // this fails (the run directory is a read-only bind) and the host deletes the file
        // once it accepts our hello; in a microVM the directory is the guest's own tmpfs.
        let _ = std::fs::remove_file(&token_file);
        if token.is_empty() {
            return Err(format!("token file {token_file} is empty"));
        }
        if let Some(limit) = var("SPACE_PIDS_LIMIT") {
            let limit = limit
                .parse::<u64>()
                .map_err(|_| format!("SPACE_PIDS_LIMIT {limit:?} is not a number"))?;
            crate::spawn::set_tasks_limit(limit);
        }
        Ok(Config {
            transport,
            sandbox_id,
            token,
        })
    }
}

fn main() -> ExitCode {
    // A command in the sandbox may run this binary as a relay (see `relay`); nothing of
    // the agent's own start-up happens then.
    let mut args = std::env::args_os().skip(1);
    if args.next().is_some_and(|a| a == "relay") {
        return relay::main(args);
    }
    failpoint::stall_if_asked();
    keep_freed_memory();
    // Before the token is read: a non-dumpable process's memory (and, under Linux, its
    // environment, descriptors and other /proc files; gVisor checks only memory and ptrace)
    // is closed to every process without CAP_SYS_PTRACE, root included, and commands never
    // have that capability (spawn::KEPT_CAPABILITIES). Children are dumpable again after
    // their exec.
    // SAFETY: plain syscall.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        note!(
            "space-agent: cannot make itself non-dumpable: {}",
            std::io::Error::last_os_error()
        );
        return ExitCode::from(2);
    }
    // A microVM's init hands over the root it mounted; the switch must happen while this
    // process has one thread (see `guest`), so before the async runtime exists.
    let microvm_init = std::process::id() == 1 && std::env::var_os("SPACE_NEW_ROOT").is_some();
    if microvm_init {
        let new_root = std::env::var_os("SPACE_NEW_ROOT").unwrap_or_default();
        let new_root = std::path::Path::new(&new_root);
        let hostname = std::env::var("SPACE_HOSTNAME").unwrap_or_default();
        let set_up = guest::finish_root(new_root, &hostname)
            .and_then(|()| guest::enter_root(new_root))
            .and_then(|()| guest::close_helpers());
        if let Err(e) = set_up {
            // Fail closed: a guest whose kernel would run a planted helper as root must
            // not run commands. (The init's console line ends the boot with a reason.)
            note!("space-agent: cannot set up the guest: {}", error_chain(&e));
            return ExitCode::from(2);
        }
    }
    let cfg = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            note!("space-agent: {e}");
            return ExitCode::from(2);
        }
    };
    // Before any other thread exists: the bounding set is per thread, and threads made
    // later (the runtime's, which start commands) inherit it.
    if let Err(e) = spawn::narrow_bounding_set_once() {
        // Each command narrows its own then (and fails if it cannot).
        note!("space-agent: cannot narrow the capability bounding set: {e}");
    }
    // One thread runs every task (blocking work goes to `spawn_blocking`'s threads). With a
    // worker per CPU, each chunk of output crossed threads on its way from a command's pipe
    // to the host socket and each ack crossed back: futex and epoll calls that gVisor makes
    // expensive. On one thread a streamed MiB cost the sandbox about 1.4 ms of CPU instead
    // of 2.3 (`benches/commands.rs`, `cat` of a file), and a sandbox's vCPUs are for its
    // commands anyway.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            note!("space-agent: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    runtime.block_on(run(cfg))
}

/// Largest allocation the agent's heap serves itself rather than through its own `mmap`:
/// above every output chunk (`protocol::MAX_DATA_CHUNK`) and file chunk the agent makes.
const MMAP_THRESHOLD: libc::c_int = 4 << 20;
/// Free memory at the top of a heap that is kept rather than given back to the kernel.
const TRIM_THRESHOLD: libc::c_int = 16 << 20;

/// Makes the allocator keep freed memory for reuse. A streamed output moves through the
/// agent in chunks of a few hundred KiB, each allocated and freed again once the host acks
/// it. With glibc's defaults the heap's top gave those pages back over and over (its trim
/// threshold adapts to about twice a chunk), and every chunk then touched fresh pages: a
/// page fault each 4 KiB, which gVisor makes expensive. Keeping up to [`TRIM_THRESHOLD`]
/// cut the sandbox CPU a streamed MiB costs from 1.53× raw `runsc exec`'s to 1.27×
/// (`benches/commands.rs`). Called before any thread exists.
fn keep_freed_memory() {
    // SAFETY: mallopt only sets the allocator's parameters; no other thread allocates yet.
    let ok = unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    };
    if !ok {
        note!("space-agent: the allocator kept its defaults (mallopt failed)");
    }
}

/// An error and its causes on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

async fn run(cfg: Config) -> ExitCode {
    let mut memory_confined = false;
    if std::process::id() != 1 {
        // Outside a sandbox, orphans of our commands come to us as they would to PID 1.
        // SAFETY: plain syscall.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    } else {
        // Only as a sandbox's init: never touch the cgroups of a host we are tested on.
        cgroup::protect_agent();
        match cgroup::setup(spawn::tasks_limit()) {
            cgroup::Setup::Confined { pids, memory_bytes } => {
                memory_confined = memory_bytes.is_some();
                note!(
                    "space-agent: commands run in cgroups (pids.max {pids}, memory.max {})",
                    memory_bytes.map_or("unset".to_string(), |b| format!("{} MiB", b >> 20))
                )
            }
            cgroup::Setup::Unavailable(why) => {
                note!("space-agent: no cgroup for commands ({why}); RLIMIT_NPROC only")
            }
        }
        // After the cgroup, which mounts below /sys. All or nothing per path. Only in a
        // microVM: under gVisor every mount fails (its /proc/sys and /sys are its own and
        // read-only), and a boot would pay a dozen system calls to learn that.
        if microvm_guest() {
            let problems = masks::apply();
            if !problems.is_empty() {
                note!(
                    "space-agent: kernel knobs left as they are: {}",
                    problems.join("; ")
                );
            }
        }
    }
    let agent = Arc::new(Agent::default());
    // Registered before any spawn, so no SIGCHLD is missed.
    let sigchld = match signal(SignalKind::child()) {
        Ok(s) => s,
        Err(e) => {
            note!("space-agent: cannot handle SIGCHLD: {e}");
            return ExitCode::from(2);
        }
    };
    tokio::spawn(reaper::run(agent.reaper.clone(), sigchld));
    // The host wakes a quiesced agent with SIGUSR1 (`runsc kill ID USR1`).
    match signal(SignalKind::user_defined1()) {
        Ok(mut usr1) => {
            let agent = agent.clone();
            tokio::spawn(async move {
                while usr1.recv().await.is_some() {
                    agent.woken.send_modify(|n| *n = n.wrapping_add(1));
                    agent.quiet.set(false);
                }
            });
        }
        Err(e) => {
            note!("space-agent: cannot handle SIGUSR1 (a quiesce holds for {HOLD_MAX:?}): {e}")
        }
    }
    // The sandbox's kernel does not keep commands within its memory (gVisor): the agent
    // does. Its thread starts once the host has accepted the agent: no command runs before
    // that, and a boot's first hello does not wait for a thread to be made.
    let memory_watch =
        (std::process::id() == 1 && !memory_confined && !microvm_guest()).then(|| {
            let agent = agent.clone();
            move || oom::start(agent)
        });

    dial_loop(&cfg, agent, memory_watch).await;
    ExitCode::SUCCESS
}

/// Whether this is a microVM guest's agent (its kernel enforces commands' memory there).
fn microvm_guest() -> bool {
    std::env::var_os("SPACE_AGENT_PORT").is_some()
}

/// A byte stream to the host that the handshake and HTTP/2 run over.
trait HostLink: AsyncRead + AsyncWrite + Unpin + Send + Sized + 'static {
    /// Waits until the host has sent something (without consuming it); false when
    /// the connection ended first.
    fn host_spoke(&self) -> impl Future<Output = bool> + Send;

    /// Reads the host's handshake reply, one line, and nothing after it (the host's
    /// HTTP/2 follows at once).
    fn read_reply_line(&mut self) -> impl Future<Output = std::io::Result<Vec<u8>>> + Send {
        protocol::read_handshake_line(self)
    }
}

impl HostLink for UnixStream {
    fn host_spoke(&self) -> impl Future<Output = bool> + Send {
        socket_host_spoke(self)
    }

    fn read_reply_line(&mut self) -> impl Future<Output = std::io::Result<Vec<u8>>> + Send {
        socket_read_line(self)
    }
}

impl HostLink for Port {
    fn host_spoke(&self) -> impl Future<Output = bool> + Send {
        Port::host_spoke(self)
    }
}

async fn dial_loop(cfg: &Config, agent: Arc<Agent>, accepted: Option<impl FnOnce()>) {
    match &cfg.transport {
        Transport::Socket(path) => {
            let dial = || connect_socket(path);
            serve_host(cfg, agent, path, true, dial, accepted).await
        }
        // A microVM's port is saved with the VM; nothing to hold there.
        Transport::Port(path) => {
            serve_host(cfg, agent, path, false, || Port::connect(path), accepted).await
        }
    }
}

/// Connects to the host's socket at `path`. A Unix socket's connect completes in the call
/// (or fails: `EAGAIN` when the host's backlog is full), and then nothing is waited for:
/// [`UnixStream::connect`] would still wait for the socket to poll writable, a round trip
/// through gVisor's host-socket notifier that cost a boot 1-2 ms. Only a connect that says
/// it is in progress is waited for.
async fn connect_socket(path: &str) -> std::io::Result<UnixStream> {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: sockaddr_un is plain data.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_bytes();
    // One byte stays for the terminating NUL.
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a usable socket path",
        ));
    }
    for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    // SAFETY: plain syscall; the descriptor is owned below.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor just made and owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    // SAFETY: `addr` is a valid sockaddr_un of at least `len` bytes.
    let r = unsafe {
        libc::connect(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            (&addr as *const libc::sockaddr_un).cast(),
            len as libc::socklen_t,
        )
    };
    let in_progress = r != 0;
    if in_progress {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(e);
        }
    }
    let stream = UnixStream::from_std(std::os::unix::net::UnixStream::from(fd))?;
    if in_progress {
        stream.writable().await?;
        if let Some(e) = stream.take_error()? {
            return Err(e);
        }
    }
    Ok(stream)
}

/// Waits, after a quiesce, until the host wakes the agent (or [`HOLD_MAX`] passes).
async fn hold_after_quiesce(agent: &Agent) {
    let held_at = agent
        .held_at
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    let Some(at) = held_at else { return };
    let mut rx = agent.woken.subscribe();
    if tokio::time::timeout(HOLD_MAX, rx.wait_for(|n| *n != at))
        .await
        .is_err()
    {
        note!("space-agent: quiesced for {HOLD_MAX:?} and not woken; dialling again");
    }
    agent.quiet.set(false);
}

/// Dials the host forever; serves each accepted connection until it ends. With `hold`,
/// a quiesce keeps the agent from dialling until the host wakes it.
/// `accepted` runs once, after the host first accepts the agent's hello.
async fn serve_host<S, D, F>(
    cfg: &Config,
    agent: Arc<Agent>,
    target: &str,
    hold: bool,
    dial: D,
    mut accepted: Option<impl FnOnce()>,
) where
    S: HostLink,
    D: Fn() -> F,
    F: Future<Output = std::io::Result<S>>,
{
    let mut backoff = BACKOFF_MIN;
    let mut quiet = false;
    loop {
        if hold {
            hold_after_quiesce(&agent).await;
        } else {
            agent
                .held_at
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            agent.quiet.set(false);
        }
        // A connect that never completes (a host socket whose other side is stuck) must
        // not stop the dialling either.
        let dialled = tokio::time::timeout(HANDSHAKE_TIMEOUT, dial())
            .await
            .unwrap_or_else(|_| {
                Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "connecting timed out",
                ))
            });
        let mut stream = match dialled {
            Ok(s) => s,
            Err(e) => {
                if !quiet {
                    note!("space-agent: cannot connect to {target}: {e}; retrying");
                    quiet = true;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
                continue;
            }
        };
        if failpoint::silent() {
            note!("space-agent: failpoint agent:silent: connected, saying nothing");
            let _held = stream;
            loop {
                std::future::pending::<()>().await;
            }
        }
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(&mut stream, cfg)).await {
            Ok(Ok(reply)) if reply.ok => {
                backoff = BACKOFF_MIN;
                quiet = false;
                if let Some(f) = accepted.take() {
                    f();
                }
                // The host speaks first (the HTTP/2 preface); one that does not is gone.
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, stream.host_spoke()).await {
                    Ok(true) => serve(stream, agent.clone()).await,
                    _ => note!("space-agent: host said nothing after the handshake"),
                }
            }
            Ok(Ok(reply)) => {
                note!(
                    "space-agent: host refused the handshake (protocol {}): {}",
                    reply.protocol,
                    reply.error.as_deref().unwrap_or("no reason given")
                );
                tokio::time::sleep(REFUSED_RETRY).await;
            }
            Ok(Err(e)) => {
                note!("space-agent: handshake failed: {e}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
            Err(_) => {
                note!("space-agent: handshake timed out");
            }
        }
    }
}

async fn handshake<S: HostLink>(stream: &mut S, cfg: &Config) -> std::io::Result<HelloReply> {
    let hello = Hello {
        protocol: PROTOCOL_VERSION,
        sandbox_id: cfg.sandbox_id.clone(),
        token: cfg.token.clone(),
        agent_version: env!("CARGO_PKG_VERSION").to_string(),
        features: match failpoint::no_features() {
            true => Vec::new(),
            false => vec![protocol::FEATURE_INPUT_OFFSETS.to_string()],
        },
    };
    let mut line = serde_json::to_vec(&hello)?;
    line.push(b'\n');
    let written = stream.write_all(&line).await;
    // The line holds the token: wipe it (`hello`'s copy goes with it below).
    line.fill(0);
    std::hint::black_box(&line);
    let mut hello = hello;
    // SAFETY: zero bytes keep the string valid UTF-8.
    unsafe { hello.token.as_bytes_mut().fill(0) };
    written?;
    let reply = stream.read_reply_line().await?;
    serde_json::from_slice(&reply)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Reads one line from `stream` with two system calls rather than one per byte: it looks
/// at what has arrived ([`socket_peek`]) and then reads exactly the line. A line that has
/// not wholly arrived yet is read a byte at a time, as before.
async fn socket_read_line(stream: &mut UnixStream) -> std::io::Result<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut seen = vec![0u8; protocol::MAX_HANDSHAKE_BYTES];
    let peeked = socket_peek(stream, &mut seen).await?;
    match seen[..peeked].iter().position(|&b| b == b'\n') {
        Some(end) => {
            let mut line = vec![0u8; end + 1];
            stream.read_exact(&mut line).await?;
            line.pop();
            Ok(line)
        }
        None => protocol::read_handshake_line(stream).await,
    }
}

/// Waits until the host has sent something (without consuming it); false when
/// the connection ended first.
async fn socket_host_spoke(stream: &UnixStream) -> bool {
    matches!(socket_peek(stream, &mut [0u8; 1]).await, Ok(n) if n > 0)
}

/// Waits until `stream` has something to read and copies what has arrived, up to
/// `buf.len()` bytes, into `buf` without consuming it: how many (0 at the end).
async fn socket_peek(stream: &UnixStream, buf: &mut [u8]) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    loop {
        stream.readable().await?;
        let peeked = stream.try_io(tokio::io::Interest::READABLE, || {
            // SAFETY: a buffer we own, of the length given, on a socket we own.
            let n = unsafe {
                libc::recv(
                    stream.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                )
            };
            if n < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        });
        match peeked {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            r => return r,
        }
    }
}

async fn serve<S: HostLink>(stream: S, agent: Arc<Agent>) {
    let watcher = agent.clone();
    let service = service_fn(move |req| {
        let agent = agent.clone();
        async move { Ok::<_, Infallible>(http::handle(agent, req).await) }
    });
    let mut builder = http2::Builder::new(TokioExecutor::new());
    builder
        .initial_stream_window_size(4 << 20)
        .initial_connection_window_size(16 << 20)
        .max_frame_size(1 << 20)
        .max_concurrent_streams(1024)
        .timer(TokioTimer::new())
        .keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT);
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        r = conn => if let Err(e) = r {
            note!("space-agent: host connection ended: {e}");
        },
        // Dropping the connection closes the socket; commands and their output are kept.
        _ = watcher.quiesce.notified() => {}
        _ = watcher.drop_link.notified() => note!("space-agent: dropping the host connection (failpoint agent:drop)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn a_reply_line_is_read_alone_and_what_follows_it_stays() {
        let (mut host, mut agent) = UnixStream::pair().unwrap();
        // The reply and the host's HTTP/2 preface can arrive in one read.
        host.write_all(b"{\"ok\":true}\nPRI * HTTP/2.0")
            .await
            .unwrap();
        assert_eq!(
            socket_read_line(&mut agent).await.unwrap(),
            b"{\"ok\":true}"
        );
        drop(host);
        let mut rest = Vec::new();
        agent.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b"PRI * HTTP/2.0");
    }

    #[tokio::test]
    async fn a_line_that_arrives_in_pieces_is_read_whole() {
        let (mut host, mut agent) = UnixStream::pair().unwrap();
        let writer = tokio::spawn(async move {
            host.write_all(b"{\"ok\":").await.unwrap();
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            host.write_all(b"true}\nX").await.unwrap();
            host
        });
        assert_eq!(
            socket_read_line(&mut agent).await.unwrap(),
            b"{\"ok\":true}"
        );
        drop(writer.await.unwrap());
        let mut rest = Vec::new();
        agent.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b"X");
    }

    #[tokio::test]
    async fn a_line_without_its_end_is_refused() {
        let (mut host, mut agent) = UnixStream::pair().unwrap();
        host.write_all(&vec![b'x'; protocol::MAX_HANDSHAKE_BYTES + 10])
            .await
            .unwrap();
        let e = socket_read_line(&mut agent).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        // A connection that ends before its line is an error too, not an empty line.
        let (host, mut agent) = UnixStream::pair().unwrap();
        drop(host);
        assert!(socket_read_line(&mut agent).await.is_err());
        let (host, agent) = UnixStream::pair().unwrap();
        drop(host);
        assert!(!socket_host_spoke(&agent).await);
    }

    #[tokio::test]
    async fn the_host_socket_is_dialled_or_a_clear_error_comes_back() {
        let dir = std::env::temp_dir().join(format!("space-agent-dial-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("agent.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let path = path.to_str().unwrap().to_string();
        let mut dialled = connect_socket(&path).await.unwrap();
        let (mut accepted, _) = listener.accept().await.unwrap();
        dialled.write_all(b"hi").await.unwrap();
        let mut got = [0u8; 2];
        accepted.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hi");
        drop(listener);
        std::fs::remove_file(&path).unwrap();
        let gone = connect_socket(&path).await.unwrap_err();
        assert_eq!(gone.kind(), std::io::ErrorKind::NotFound);
        for bad in [String::new(), "x".repeat(200), "a\0b".into()] {
            let e = connect_socket(&bad).await.unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{bad:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
