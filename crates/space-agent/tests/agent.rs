//! Runs the real agent binary as a child process and plays the host: listens on
//! the socket and takes the agent's connections with the host's own end of the
//! protocol (`space_agent_host`), whose typed calls make the requests.
//!
//! With `SPACE_AGENT_TEST_RUNSC` (a `runsc` binary) and `SPACE_AGENT_TEST_ROOTFS`
//! (a root filesystem, e.g. a Debian template) set, and `SPACE_AGENT_BIN` naming a
//! static agent, the agent runs as PID 1 of a gVisor sandbox instead, as in
//! production (root only). Tests only name paths inside their temporary
//! directory, which the sandbox sees at [`Host::guest_dir`].

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
// Not `space_agent::protocol`: space-agent-host was built against its own build of this
// crate, whose protocol types are the ones its calls take and return.
use space_agent_host::protocol::{
    AgentInfo, CommandInfo, ExitStatus, Frame, Hello, PtySize, SpawnReply, SpawnRequest,
    SpawnRequestError, MAX_DATA_CHUNK, PROTOCOL_VERSION, RETAIN_MAX_BYTES,
};
use space_agent_host::{testing, AgentConn, AgentError};
use tokio::io::AsyncReadExt;
use tokio::net::{UnixListener, UnixStream};

/// Longest any single wait in these tests may take before the test fails.
const WAIT: Duration = Duration::from_secs(20);
const SANDBOX: &str = "sbx_test";

async fn within<F: std::future::Future>(what: &str, f: F) -> F::Output {
    match tokio::time::timeout(WAIT, f).await {
        Ok(v) => v,
        Err(_) => panic!("timed out waiting for {what}"),
    }
}

struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "space-agent-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The agent under test and the host's listening socket.
struct Host {
    listener: UnixListener,
    agent: Child,
    token: String,
    token_file: PathBuf,
    dir: TempDir,
    /// `dir` as the agent and its commands see it.
    guest_dir: PathBuf,
    /// runsc mode: the `runsc` command line (with `--root`) and the container id.
    sandbox: Option<(Vec<String>, String)>,
}

impl Drop for Host {
    fn drop(&mut self) {
        match &self.sandbox {
            Some((runsc, id)) => {
                let _ = Command::new(&runsc[0])
                    .args(&runsc[1..])
                    .args(["delete", "--force", id])
                    .status();
            }
            // Whatever the agent's commands left running (its orphans would
            // outlive it, re-parented to the host's init).
            None => kill_descendants(self.agent.id()),
        }
        let _ = self.agent.kill();
        let _ = self.agent.wait();
    }
}

/// SIGKILLs every descendant of `pid` (a test process's view of `/proc`).
fn kill_descendants(pid: u32) {
    let stat = |p: &str| -> Option<(u32, u32)> {
        let text = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
        let (head, rest) = text.rsplit_once(')')?;
        let pid = head.split_once(" (")?.0.parse().ok()?;
        let ppid = rest.split_ascii_whitespace().nth(1)?.parse().ok()?;
        Some((pid, ppid))
    };
    for _ in 0..10 {
        let procs: Vec<(u32, u32)> = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .filter_map(|e| stat(e.ok()?.file_name().to_str()?))
            .collect();
        let mut found = vec![pid];
        let mut i = 0;
        while i < found.len() {
            let parent = found[i];
            found.extend(procs.iter().filter(|p| p.1 == parent).map(|p| p.0));
            i += 1;
        }
        if found.len() == 1 {
            return;
        }
        for p in &found[1..] {
            // SAFETY: plain syscall.
            unsafe { libc::kill(*p as i32, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Host {
    fn start() -> Host {
        let dir = TempDir::new();
        let runsc = std::env::var("SPACE_AGENT_TEST_RUNSC").ok();
        let guest_dir = if runsc.is_some() {
            PathBuf::from("/.space/run")
        } else {
            dir.0.clone()
        };
        let socket = dir.0.join("agent.sock");
        let token_file = dir.0.join("token");
        let token = format!("tok-{}", std::process::id());
        std::fs::write(&token_file, format!("  {token}\n")).expect("write token");
        let listener = UnixListener::bind(&socket).expect("bind socket");
        // SPACE_AGENT_BIN runs the suite against another build (e.g. the static release one).
        let bin = std::env::var_os("SPACE_AGENT_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_space-agent")));
        let env = [
            ("SPACE_AGENT_SOCKET", guest_dir.join("agent.sock")),
            ("SPACE_SANDBOX_ID", PathBuf::from(SANDBOX)),
            ("SPACE_AGENT_TOKEN_FILE", guest_dir.join("token")),
        ];
        let (agent, sandbox) = match runsc {
            None => {
                let agent = Command::new(bin)
                    .envs(env)
                    .stdin(Stdio::null())
                    .spawn()
                    .expect("start agent");
                (agent, None)
            }
            Some(runsc) => {
                let rootfs = std::env::var("SPACE_AGENT_TEST_ROOTFS")
                    .expect("SPACE_AGENT_TEST_ROOTFS with SPACE_AGENT_TEST_RUNSC");
                let id = dir
                    .0
                    .file_name()
                    .and_then(|n| n.to_str())
                    .expect("temp dir name")
                    .to_string();
                let bundle = dir.0.join("bundle");
                std::fs::create_dir_all(&bundle).expect("bundle dir");
                let spec = sandbox_spec(&rootfs, &bin, &dir.0, &env);
                std::fs::write(bundle.join("config.json"), spec.to_string()).expect("spec");
                let runsc = vec![
                    runsc,
                    format!("--root={}", dir.0.join("runsc").display()),
                    "--platform=systrap".into(),
                    "--network=none".into(),
                    "--host-uds=open".into(),
                    "--overlay2=root:memory".into(),
                ];
                let agent = Command::new(&runsc[0])
                    .args(&runsc[1..])
                    .args(["run", "--bundle"])
                    .arg(&bundle)
                    .arg(&id)
                    .stdin(Stdio::null())
                    .spawn()
                    .expect("start runsc");
                (agent, Some((runsc, id)))
            }
        };
        Host {
            listener,
            agent,
            token,
            token_file,
            dir,
            guest_dir,
            sandbox,
        }
    }

    /// Accepts the agent's next connection as the server does, and checks its hello.
    async fn accept(&self) -> Conn {
        let (conn, hello) = within(
            "agent to connect",
            testing::accept(&self.listener, SANDBOX, &self.token),
        )
        .await
        .expect("accept the agent");
        self.check_hello(&hello);
        Conn(conn)
    }

    /// Accepts the agent's next connection and completes the handshake, no more.
    async fn accept_hello(&self) -> (UnixStream, Hello) {
        let (stream, hello) = within(
            "agent to connect",
            testing::accept_hello(&self.listener, SANDBOX, &self.token),
        )
        .await
        .expect("accept the agent's hello");
        self.check_hello(&hello);
        (stream, hello)
    }

    fn check_hello(&self, hello: &Hello) {
        assert_eq!(hello.protocol, PROTOCOL_VERSION);
        assert_eq!(hello.sandbox_id, SANDBOX);
        assert_eq!(hello.token, self.token);
        assert!(!hello.agent_version.is_empty());
    }
}

/// An OCI spec like the gVisor driver's: the agent as PID 1 with the same
/// capabilities and /dev, the test directory at `/.space/run`.
fn sandbox_spec(
    rootfs: &str,
    bin: &std::path::Path,
    dir: &std::path::Path,
    env: &[(&str, PathBuf)],
) -> Value {
    let caps = [
        "CAP_CHOWN",
        "CAP_DAC_OVERRIDE",
        "CAP_FSETID",
        "CAP_FOWNER",
        "CAP_MKNOD",
        "CAP_NET_RAW",
        "CAP_SETGID",
        "CAP_SETUID",
        "CAP_SETFCAP",
        "CAP_SETPCAP",
        "CAP_NET_BIND_SERVICE",
        "CAP_SYS_CHROOT",
        "CAP_KILL",
        "CAP_AUDIT_WRITE",
    ];
    let bin_dir = bin.parent().expect("agent directory");
    let bin_name = bin
        .file_name()
        .and_then(|n| n.to_str())
        .expect("agent name");
    let env: Vec<String> = env
        .iter()
        .map(|(k, v)| format!("{k}={}", v.display()))
        .collect();
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": [format!("/.space/bin/{bin_name}")],
            "env": env,
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "noNewPrivileges": false
        },
        "root": {"path": rootfs, "readonly": false},
        "hostname": "agent-test",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/.space/bin", "type": "bind", "source": bin_dir,
             "options": ["rbind", "ro"]},
            {"destination": "/.space/run", "type": "bind", "source": dir,
             "options": ["rbind", "rw"]}
        ],
        "linux": {
            "namespaces": [
                {"type": "pid"}, {"type": "network"}, {"type": "ipc"},
                {"type": "uts"}, {"type": "mount"}
            ]
        }
    })
}

/// The host's end of one agent connection, the test's checks around its typed calls.
struct Conn(AgentConn);

impl Conn {
    /// Closes the connection as a crashing host would.
    fn drop_connection(self) {
        self.0.close();
    }

    async fn try_spawn(&self, req: Value) -> Result<SpawnReply, AgentError> {
        let req: SpawnRequest = serde_json::from_value(req).expect("a spawn request");
        within("spawn", self.0.spawn(&req)).await
    }

    async fn spawn(&self, req: Value) -> u32 {
        self.try_spawn(req).await.expect("spawn").pid
    }

    async fn commands(&self) -> Vec<CommandInfo> {
        within("the command list", self.0.commands())
            .await
            .expect("command list")
    }

    async fn command(&self, id: &str) -> Option<CommandInfo> {
        self.commands().await.into_iter().find(|c| c.id == id)
    }

    async fn signal(&self, id: &str, signal: i32) -> Result<(), AgentError> {
        within("signal", self.0.signal(id, signal)).await
    }

    async fn forget(&self, id: &str) -> Result<(), AgentError> {
        within("forget", self.0.forget(id)).await
    }

    /// A request sent as it is (one the host never makes, or one whose exact status is
    /// checked); its status and body.
    async fn raw(&self, method: Method, path: &str, body: Option<Value>) -> (StatusCode, Bytes) {
        let body = body.map(|v| v.to_string()).unwrap_or_default();
        let resp = within(
            path,
            self.0
                .send_raw(method, path, Some("application/json"), body),
        )
        .await
        .expect("response");
        let status = resp.status();
        let bytes = within("response body", resp.into_body().collect())
            .await
            .expect("body")
            .to_bytes();
        (status, bytes)
    }

    /// Polls the command list until `pred` holds for `id`.
    async fn wait_for(&self, id: &str, what: &str, pred: impl Fn(Option<&CommandInfo>) -> bool) {
        let deadline = Instant::now() + WAIT;
        loop {
            let info = self.command(id).await;
            if pred(info.as_ref()) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {info:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn try_attach(&self, id: &str, stdout: u64, stderr: u64) -> Result<Attach, AgentError> {
        let inner = within("attach", self.0.attach(id, stdout, stderr)).await?;
        Ok(Attach {
            inner,
            cursor: [stdout, stderr],
        })
    }

    /// An attach whose agent reports the input it takes (its first frame says how much).
    async fn attach_with_input(&self, id: &str, stdout: u64, stderr: u64) -> Attach {
        let inner = within("attach", self.0.attach_with_input(id, stdout, stderr))
            .await
            .expect("attach with input");
        Attach {
            inner,
            cursor: [stdout, stderr],
        }
    }

    async fn attach(&self, id: &str, stdout: u64, stderr: u64) -> Attach {
        match self.try_attach(id, stdout, stderr).await {
            Ok(a) => a,
            Err(e) => panic!("attach {id}: {e:?}"),
        }
    }
}

/// Asserts that `r` is the agent's refusal with `status`; returns its message.
#[track_caller]
fn refused<T: std::fmt::Debug>(r: Result<T, AgentError>, status: StatusCode) -> String {
    match r {
        Err(AgentError::Refused {
            status: s, message, ..
        }) if s == status => message,
        other => panic!("expected a refusal with {status}, got {other:?}"),
    }
}

#[derive(Debug, Default)]
struct Output {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    exit: Option<ExitStatus>,
}

/// An attach stream, checked as it is read.
struct Attach {
    inner: space_agent_host::Attach,
    /// Next expected offset per stream: frames must be contiguous.
    cursor: [u64; 2],
}

impl Attach {
    async fn send(&self, f: Frame) {
        within("send frame", self.inner.send(f))
            .await
            .expect("send frame");
    }

    fn close_body(&mut self) {
        self.inner.close_host_frames();
    }

    /// The next frame, or `None` when the response ended (at a frame boundary: an end
    /// inside a frame, like a malformed frame, is an error).
    async fn next(&mut self) -> Option<Frame> {
        let f = within("attach frame", self.inner.next_frame())
            .await
            .expect("agent frame");
        match &f {
            Some(Frame::Stdout { offset, data }) => {
                assert_eq!(*offset, self.cursor[0], "stdout offsets are contiguous");
                assert!(data.len() <= MAX_DATA_CHUNK);
                self.cursor[0] += data.len() as u64;
            }
            Some(Frame::Stderr { offset, data }) => {
                assert_eq!(*offset, self.cursor[1], "stderr offsets are contiguous");
                assert!(data.len() <= MAX_DATA_CHUNK);
                self.cursor[1] += data.len() as u64;
            }
            _ => {}
        }
        f
    }

    /// Everything up to the end of the response; with `ack`, acknowledges as it goes.
    async fn collect(&mut self, ack: bool) -> Output {
        let mut out = Output::default();
        while let Some(f) = self.next().await {
            match f {
                Frame::Stdout { data, .. } => out.stdout.extend_from_slice(&data),
                Frame::Stderr { data, .. } => out.stderr.extend_from_slice(&data),
                Frame::Exit(e) => {
                    assert!(out.exit.is_none(), "one exit frame");
                    out.exit = Some(e);
                    continue;
                }
                other => panic!("unexpected frame {other:?}"),
            }
            assert!(out.exit.is_none(), "output after the exit frame");
            if ack {
                self.ack().await;
            }
        }
        out
    }

    async fn ack(&self) {
        self.send(Frame::Ack {
            stdout: self.cursor[0],
            stderr: self.cursor[1],
        })
        .await;
    }
}

fn sh(id: &str, script: &str) -> Value {
    json!({"id": id, "argv": ["sh", "-c", script], "env": [["PATH", "/usr/bin:/bin"]]})
}

/// A command on a new `rows`x`cols` terminal.
fn on_pty(id: &str, argv: &[&str], rows: u16, cols: u16) -> Value {
    json!({
        "id": id,
        "argv": argv,
        "env": [["PATH", "/usr/bin:/bin"]],
        "pty": {"rows": rows, "cols": cols}
    })
}

/// Runs a shell script to its end and returns what it printed and how it ended.
async fn run(conn: &Conn, id: &str, script: &str) -> Output {
    conn.spawn(sh(id, script)).await;
    conn.attach(id, 0, 0).await.collect(true).await
}

/// Whether `pid` (as the agent sees it) is a live process, asked from inside.
async fn alive(conn: &Conn, id: &str, pid: u32) -> bool {
    let script = format!("grep -q '^State:[[:space:]]*[^Z]' /proc/{pid}/status");
    run(conn, id, &script).await.exit.and_then(|e| e.exit_code) == Some(0)
}

/// Whether `pid` is gone (and reaped) within a few seconds, asked from inside.
async fn gone(conn: &Conn, id: &str, pid: u32) -> bool {
    let script = format!(
        "i=0; while [ -e /proc/{pid} ] && [ $i -lt 1000 ]; do sleep 0.01; i=$((i+1)); done; [ ! -e /proc/{pid} ]"
    );
    run(conn, id, &script).await.exit.and_then(|e| e.exit_code) == Some(0)
}

/// A pid a command wrote to `name` in the test directory.
fn read_pid(host: &Host, name: &str) -> u32 {
    let path = host.dir.0.join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (the process never started?)", path.display()));
    text.trim()
        .parse()
        .unwrap_or_else(|_| panic!("{}: not a pid: {text:?}", path.display()))
}

impl Attach {
    /// Reads stdout (acknowledging it) into `out` until it contains `needle`.
    async fn read_until(&mut self, out: &mut Vec<u8>, needle: &str) {
        while !String::from_utf8_lossy(out).contains(needle) {
            match self.next().await {
                Some(Frame::Stdout { data, .. }) => out.extend_from_slice(&data),
                other => panic!(
                    "waiting for {needle:?} after {:?}: got {other:?}",
                    String::from_utf8_lossy(out)
                ),
            }
            self.ack().await;
        }
    }
}

/// Terminal output with the terminal's `\r\n` line ends made plain.
fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).replace("\r\n", "\n")
}

#[tokio::test]
async fn runs_a_command_and_reports_output_and_exit() {
    let host = Host::start();
    let conn = host.accept().await;
    assert!(
        !host.token_file.exists(),
        "the agent deletes its token file"
    );

    let info = within("info", conn.0.info()).await.expect("info");
    assert_eq!(info.protocol, PROTOCOL_VERSION);
    assert_eq!(info.commands, 0);

    let pid = conn
        .spawn(sh("cmd_1", "echo hi; echo err >&2; exit 3"))
        .await;
    assert!(pid > 0);
    let mut a = conn.attach("cmd_1", 0, 0).await;
    let out = a.collect(false).await;
    assert_eq!(out.stdout, b"hi\n");
    assert_eq!(out.stderr, b"err\n");
    let exit = out.exit.expect("exit frame");
    assert_eq!(exit.exit_code, Some(3));
    assert_eq!(exit.signal, None);
    assert!(!exit.timed_out);
    assert_eq!(exit.error, None);

    let info = conn.command("cmd_1").await.expect("listed");
    assert_eq!((info.pid, info.stdout_end, info.stderr_end), (pid, 3, 4));
    assert_eq!(info.exit.as_ref().and_then(|e| e.exit_code), Some(3));

    // The same id again is a conflict; bad requests are refused with a JSON error.
    refused(
        conn.try_spawn(sh("cmd_1", "true")).await,
        StatusCode::CONFLICT,
    );
    let message = refused(
        conn.try_spawn(json!({"id": "x", "argv": [], "env": []}))
            .await,
        StatusCode::BAD_REQUEST,
    );
    // The message out of the agent's error JSON (an answer that is not that JSON would
    // show as its raw text).
    assert_eq!(message, SpawnRequestError::EmptyArgv.to_string());
    // Requests the host never makes.
    let (status, body) = conn
        .raw(
            Method::POST,
            "/v1/commands",
            Some(json!({"nonsense": true})),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let err: space_agent_host::protocol::ErrorBody =
        serde_json::from_slice(&body).expect("error body");
    assert!(!err.error.message.is_empty());
    let (status, _) = conn.raw(Method::GET, "/v1/nowhere", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = conn.raw(Method::PUT, "/v1/commands", None).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    let (status, _) = conn
        .raw(Method::POST, "/v1/commands/nope/attach", None)
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    refused(
        conn.try_attach("nope", 0, 0).await.map(drop),
        StatusCode::NOT_FOUND,
    );

    // Done (after the exit) makes the agent forget the command.
    a.send(Frame::Done).await;
    a.close_body();
    conn.wait_for("cmd_1", "the command to be forgotten", |c| c.is_none())
        .await;

    // The exact statuses of successes, which the typed calls do not show.
    let (status, _) = conn.raw(Method::GET, "/v1/info", None).await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = conn
        .raw(Method::POST, "/v1/commands", Some(sh("cmd_2", "true")))
        .await;
    assert_eq!(status, StatusCode::OK, "{body:?}");
    let (status, _) = conn.raw(Method::GET, "/v1/commands", None).await;
    assert_eq!(status, StatusCode::OK);
    let attach = within(
        "attach",
        conn.0.send_raw(
            Method::POST,
            "/v1/commands/cmd_2/attach?stdout=0&stderr=0",
            None,
            Bytes::new(),
        ),
    )
    .await
    .expect("attach");
    assert_eq!(attach.status(), StatusCode::OK);
    drop(attach);
    conn.wait_for("cmd_2", "the command to exit", |c| {
        c.is_some_and(|c| c.exit.is_some())
    })
    .await;
    let (status, _) = conn.raw(Method::DELETE, "/v1/commands/cmd_2", None).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
}

#[tokio::test]
async fn environment_user_and_directory() {
    let host = Host::start();
    let conn = host.accept().await;

    conn.spawn(json!({"id": "env", "argv": ["env"], "env": [["A", "b"]]}))
        .await;
    let out = conn.attach("env", 0, 0).await.collect(true).await;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "A=b\nHOME=/root\n");
    assert_eq!(out.exit.and_then(|e| e.exit_code), Some(0));

    conn.spawn(json!({"id": "cwd", "argv": ["pwd"], "env": [], "cwd": "/tmp"}))
        .await;
    let out = conn.attach("cwd", 0, 0).await.collect(true).await;
    assert_eq!(out.stdout, b"/tmp\n");

    // SAFETY: plain syscall.
    if unsafe { libc::geteuid() } == 0 {
        let script = "id -u; id -g; id -G; echo $HOME; pwd";
        let mut req = sh("user", script);
        req["user"] = json!("nobody");
        conn.spawn(req).await;
        let out = conn.attach("user", 0, 0).await.collect(true).await;
        // nobody's home does not exist: it starts in /.
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "65534\n65534\n65534\n/nonexistent\n/\n"
        );
        let mut req = sh("user2", "id -u; id -G");
        req["user"] = json!("1234:4321");
        conn.spawn(req).await;
        let out = conn.attach("user2", 0, 0).await.collect(true).await;
        assert_eq!(String::from_utf8_lossy(&out.stdout), "1234\n4321\n");
    }
}

#[tokio::test]
async fn commands_start_with_every_signal_at_its_default() {
    let host = Host::start();
    let conn = host.accept().await;
    // The agent ignores SIGPIPE and handles SIGCHLD, SIGUSR1, SIGSEGV and SIGBUS; none of
    // that reaches a command, nor the mask it spawns with. `cat` itself changes nothing.
    // Twice: the first spawn reads which signals the agent changed, the next reuses that.
    for id in ["sig1", "sig2"] {
        conn.spawn(json!({"id": id, "argv": ["cat", "/proc/self/status"], "env": []}))
            .await;
        let out = conn.attach(id, 0, 0).await.collect(true).await;
        let status = String::from_utf8_lossy(&out.stdout);
        for field in ["SigBlk", "SigIgn", "SigCgt"] {
            let line = status
                .lines()
                .find(|l| l.starts_with(&format!("{field}:")))
                .unwrap_or_else(|| panic!("no {field} in {status}"));
            assert_eq!(
                line.split_whitespace().nth(1),
                Some("0000000000000000"),
                "{line}"
            );
        }
    }
    // A pipe whose reader has gone ends its writer by SIGPIPE (128 + 13), as in any
    // shell; an ignored SIGPIPE would pass on to `yes`, which would fail its write (1).
    let out = run(&conn, "pipe", "{ yes; echo $? >&2; } | head -c1 >/dev/null").await;
    assert_eq!(String::from_utf8_lossy(&out.stderr).trim(), "141");
}

#[tokio::test]
async fn secrets_over_env_and_no_way_into_the_agent() {
    let host = Host::start();
    let conn = host.accept().await;

    // Secrets come after env: a name in both has the secret's value.
    conn.spawn(json!({
        "id": "secrets",
        "argv": ["env"],
        "env": [["A", "from-env"], ["B", "b"]],
        "secrets": [["A", "from-secret"], ["S", "s"]],
    }))
    .await;
    let out = conn.attach("secrets", 0, 0).await.collect(true).await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "A=from-secret\nB=b\nHOME=/root\nS=s\n"
    );
    refused(
        conn.try_spawn(
            json!({"id": "bad", "argv": ["true"], "env": [], "secrets": [["A=B", "x"]]}),
        )
        .await,
        StatusCode::BAD_REQUEST,
    );

    // SAFETY: plain syscall.
    if unsafe { libc::geteuid() } == 0 {
        // Root commands lack what reads another process's memory, and the agent is not
        // dumpable: its environment, memory and descriptors are closed to them.
        let info: AgentInfo = within("info", conn.0.info()).await.expect("info");
        let script = format!(
            "grep -E '^Cap(Bnd|Inh|Eff)' /proc/self/status; \
             cat /proc/{0}/environ >/dev/null 2>&1 && echo read-environ; \
             (exec 3</proc/{0}/mem) 2>/dev/null && echo opened-mem; \
             for f in /proc/{0}/fd/*; do readlink $f >/dev/null 2>&1 && echo followed-fd; \
               (exec 3<$f) 2>/dev/null && echo opened-fd; done; \
             ls /proc/{0}/fd | grep -q . && echo listed-fds; true",
            info.pid
        );
        let out = run(&conn, "caps", &script).await;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let set = |name: &str| {
            let line = text.lines().find(|l| l.starts_with(name)).expect(name);
            u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap()
        };
        for cap in [16, 17, 19, 21, 22] {
            assert_eq!(set("CapBnd") & (1 << cap), 0, "capability {cap}: {text}");
            assert_eq!(set("CapEff") & (1 << cap), 0, "capability {cap}: {text}");
        }
        assert_eq!(set("CapInh"), 0, "{text}");
        assert_ne!(set("CapEff") & 1, 0, "CAP_CHOWN stays: {text}");
        // Root may list the agent's descriptor numbers (its /proc files are root's, and
        // Linux checks only that), never follow one. gVisor checks non-dumpable processes
        // only for memory and ptrace access: there the rest stays readable.
        let leaks: &[&str] = if std::env::var_os("SPACE_AGENT_TEST_RUNSC").is_some() {
            &["opened-mem"]
        } else {
            &["read-environ", "opened-mem", "followed-fd", "opened-fd"]
        };
        for leak in leaks {
            assert!(!text.contains(leak), "{leak}: {text}");
        }
    }
}

#[tokio::test]
async fn signals_supersede_and_delete() {
    let host = Host::start();
    let conn = host.accept().await;
    let pid = conn
        .spawn(json!({"id": "sleeper", "argv": ["sleep", "30"], "env": []}))
        .await;
    assert!(pid > 0);

    // A second attach ends the first one's response (without an exit frame).
    let mut first = conn.attach("sleeper", 0, 0).await;
    let mut second = conn.attach("sleeper", 0, 0).await;
    let out = first.collect(false).await;
    assert!(out.exit.is_none() && out.stdout.is_empty());

    // Running commands are not forgotten.
    refused(conn.forget("sleeper").await, StatusCode::CONFLICT);
    refused(conn.signal("sleeper", 0).await, StatusCode::BAD_REQUEST);
    conn.signal("sleeper", 9).await.expect("signal");

    let exit = second.collect(false).await.exit.expect("exit");
    assert_eq!(exit.signal, Some(9));
    assert_eq!(exit.exit_code, None);
    assert!(!exit.timed_out);

    refused(conn.signal("sleeper", 9).await, StatusCode::CONFLICT);
    conn.forget("sleeper").await.expect("forget");
    refused(conn.forget("sleeper").await, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn timeout_kills_the_process_group() {
    let host = Host::start();
    let conn = host.accept().await;
    let mut req = sh("slow", "sleep 30");
    req["timeout_ms"] = json!(200);
    let started = Instant::now();
    conn.spawn(req).await;
    let exit = conn
        .attach("slow", 0, 0)
        .await
        .collect(true)
        .await
        .exit
        .expect("exit");
    assert!(exit.timed_out);
    assert_eq!(exit.signal, Some(9));
    assert!(exit.duration_ms >= 200, "{exit:?}");
    // The sleep in the group was killed too, or the exit would have waited 30 s.
    assert!(started.elapsed() < Duration::from_secs(20));
}

#[tokio::test]
async fn programs_that_cannot_start() {
    let host = Host::start();
    let conn = host.accept().await;

    let pid = conn
        .spawn(json!({"id": "nf", "argv": ["no-such-program-xyz", "a"], "env": []}))
        .await;
    assert_eq!(pid, 0);
    let out = conn.attach("nf", 0, 0).await.collect(true).await;
    let exit = out.exit.expect("exit");
    assert_eq!(exit.exit_code, Some(127));
    assert!(exit.error.is_some());
    let msg = String::from_utf8_lossy(&out.stderr);
    assert!(
        msg.starts_with("space-agent: cannot run 'no-such-program-xyz': ") && msg.ends_with('\n'),
        "{msg}"
    );

    conn.spawn(json!({"id": "cwd", "argv": ["true"], "env": [], "cwd": "/no/such/dir"}))
        .await;
    let exit = conn
        .attach("cwd", 0, 0)
        .await
        .collect(true)
        .await
        .exit
        .expect("exit");
    assert_eq!(exit.exit_code, Some(126));

    conn.spawn(json!({"id": "user", "argv": ["true"], "env": [], "user": "no-such-user"}))
        .await;
    let exit = conn
        .attach("user", 0, 0)
        .await
        .collect(true)
        .await
        .exit
        .expect("exit");
    assert_eq!(exit.exit_code, Some(126));

    conn.spawn(json!({"id": "noexec", "argv": ["/etc/passwd"], "env": []}))
        .await;
    let exit = conn
        .attach("noexec", 0, 0)
        .await
        .collect(true)
        .await
        .exit
        .expect("exit");
    assert_eq!(exit.exit_code, Some(126));

    // An executable script without `#!` runs with /bin/sh, as execvp and shells run it.
    let script = std::env::temp_dir().join(format!("space-agent-plain-{}.sh", std::process::id()));
    std::fs::write(&script, "echo plain \"$1\"\n").unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    conn.spawn(json!({"id": "plain", "argv": [script.to_str().unwrap(), "arg"], "env": []}))
        .await;
    let out = conn.attach("plain", 0, 0).await.collect(true).await;
    assert_eq!(out.exit.expect("exit").exit_code, Some(0));
    let _ = std::fs::remove_file(&script);
    assert_eq!(text(&out.stdout), "plain arg\n");
}

/// Reads `a` until the agent reports input taken up to `upto`; returns the stdout seen.
/// Exits, or reports past `upto`, fail.
async fn until_taken(a: &mut Attach, upto: u64) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        match a.next().await {
            Some(Frame::Stdout { data, .. }) => out.extend_from_slice(&data),
            Some(Frame::InputTaken(n)) if n == upto => return out,
            Some(Frame::InputTaken(n)) if n < upto => {}
            other => panic!("waiting for input taken up to {upto}: {other:?}"),
        }
        a.ack().await;
    }
}

/// Input with offsets (`input-offsets`): each attach starts with how much input the agent
/// has taken, and a host that resends from anywhere below that (after a break) delivers
/// each byte and each end-of-file once. Input past what was taken (a gap) is taken, the gap
/// counted lost.
#[tokio::test]
async fn input_with_offsets_is_taken_once_however_often_it_is_sent() {
    let host = Host::start();
    let conn = host.accept().await;
    assert!(
        conn.0.input_offsets(),
        "the agent names input-offsets in its hello"
    );
    conn.spawn(json!({"id": "cat", "argv": ["cat"], "env": [], "stdin": true}))
        .await;
    let mut a = conn.attach_with_input("cat", 0, 0).await;
    assert_eq!(a.next().await, Some(Frame::InputTaken(0)), "first frame");
    a.send(Frame::StdinAt {
        offset: 0,
        data: Bytes::from_static(b"hello "),
    })
    .await;
    let mut out = until_taken(&mut a, 6).await;

    // A new attach (as after a break) hears where input stopped, and a host that resends
    // more than that gets only the new part taken.
    let mut a = conn.attach_with_input("cat", a.cursor[0], 0).await;
    assert_eq!(a.next().await, Some(Frame::InputTaken(6)), "first frame");
    for (offset, data) in [(0, &b"hello world"[..]), (6, b"world"), (3, b"lo w")] {
        a.send(Frame::StdinAt {
            offset,
            data: Bytes::from_static(data),
        })
        .await;
    }
    out.extend(until_taken(&mut a, 11).await);
    // An end-of-file is a position too: sent twice, it is taken once.
    a.send(Frame::StdinEofAt(11)).await;
    a.send(Frame::StdinEofAt(11)).await;
    let mut exit = None;
    while let Some(f) = a.next().await {
        match f {
            Frame::Stdout { data, .. } => out.extend_from_slice(&data),
            Frame::InputTaken(n) => assert_eq!(n, 12, "the end-of-file, once"),
            Frame::Exit(e) => exit = Some(e),
            other => panic!("{other:?}"),
        }
        a.ack().await;
    }
    assert_eq!(String::from_utf8_lossy(&out), "hello world");
    assert_eq!(exit.and_then(|e| e.exit_code), Some(0));

    // A gap: input at 5 when nothing was taken (a host that no longer has positions 0..5).
    // They are counted lost, and what follows is taken.
    conn.spawn(json!({"id": "cat2", "argv": ["cat"], "env": [], "stdin": true}))
        .await;
    let mut a = conn.attach_with_input("cat2", 0, 0).await;
    assert_eq!(a.next().await, Some(Frame::InputTaken(0)));
    a.send(Frame::StdinAt {
        offset: 5,
        data: Bytes::from_static(b"ok"),
    })
    .await;
    a.send(Frame::StdinEofAt(7)).await;
    let mut out = Vec::new();
    let mut taken = Vec::new();
    while let Some(f) = a.next().await {
        match f {
            Frame::Stdout { data, .. } => out.extend_from_slice(&data),
            Frame::InputTaken(n) => taken.push(n),
            Frame::Exit(_) => {}
            other => panic!("{other:?}"),
        }
        a.ack().await;
    }
    assert_eq!(out, b"ok");
    assert_eq!(taken.last(), Some(&8), "{taken:?}");
}

#[tokio::test]
async fn stdin_is_fed_from_frames() {
    let host = Host::start();
    let conn = host.accept().await;
    conn.spawn(json!({"id": "cat", "argv": ["cat"], "env": [], "stdin": true}))
        .await;
    let mut a = conn.attach("cat", 0, 0).await;
    a.send(Frame::Stdin(Bytes::from_static(b"hello "))).await;
    a.send(Frame::Stdin(Bytes::from_static(b"world"))).await;
    a.send(Frame::StdinEof).await;
    let out = a.collect(true).await;
    assert_eq!(out.stdout, b"hello world");
    assert_eq!(out.exit.and_then(|e| e.exit_code), Some(0));

    // Far more than the retention bound through `cat`, with acks behind the stdin
    // in the same request body: must neither stall nor lose a byte.
    conn.spawn(json!({"id": "bigcat", "argv": ["cat"], "env": [], "stdin": true}))
        .await;
    let mut a = conn.attach("bigcat", 0, 0).await;
    let tx = a.inner.host_frames().expect("body open");
    const TOTAL: usize = 6 << 20;
    let writer = tokio::spawn(async move {
        let mut sent = 0usize;
        let mut i = 0u8;
        while sent < TOTAL {
            let chunk: Vec<u8> = (0..32 * 1024).map(|j| i.wrapping_add(j as u8)).collect();
            i = i.wrapping_add(1);
            sent += chunk.len();
            tx.send(Frame::Stdin(Bytes::from(chunk)).to_bytes())
                .await
                .expect("stdin");
        }
        tx.send(Frame::StdinEof.to_bytes()).await.expect("eof");
    });
    let out = a.collect(true).await;
    within("stdin writer", writer).await.expect("writer");
    assert_eq!(out.stdout.len(), TOTAL);
    let mut expected = Vec::with_capacity(TOTAL);
    let mut i = 0u8;
    while expected.len() < TOTAL {
        expected.extend((0..32 * 1024).map(|j| i.wrapping_add(j as u8)));
        i = i.wrapping_add(1);
    }
    assert!(out.stdout == expected, "cat echoed the bytes exactly");
    assert_eq!(out.exit.and_then(|e| e.exit_code), Some(0));
}

#[tokio::test]
async fn unacknowledged_output_is_bounded_and_never_lost() {
    let host = Host::start();
    let conn = host.accept().await;
    const TOTAL: u64 = 5_000_000;
    conn.spawn(
        json!({"id": "big", "argv": ["head", "-c", TOTAL.to_string(), "/dev/zero"], "env": []}),
    )
    .await;
    let mut a = conn.attach("big", 0, 0).await;

    // Without acks the agent stops at the retention bound.
    let mut got = Vec::new();
    while (got.len() as u64) < RETAIN_MAX_BYTES as u64 {
        match a.next().await {
            Some(Frame::Stdout { data, .. }) => got.extend_from_slice(&data),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(got.len(), RETAIN_MAX_BYTES);
    let info = conn.command("big").await.expect("listed");
    assert_eq!(info.stdout_end, RETAIN_MAX_BYTES as u64);
    assert!(info.exit.is_none());
    // The only way to observe that nothing more is read is to give it a moment.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let info = conn.command("big").await.expect("listed");
    assert_eq!(info.stdout_end, RETAIN_MAX_BYTES as u64, "reading stopped");
    assert_eq!(info.stdout_base, 0);

    // Acknowledging lets the rest through, exactly.
    a.ack().await;
    let out = a.collect(true).await;
    got.extend_from_slice(&out.stdout);
    assert_eq!(got.len() as u64, TOTAL);
    assert!(got.iter().all(|&b| b == 0));
    assert_eq!(out.exit.and_then(|e| e.exit_code), Some(0));
    let info = conn.command("big").await.expect("listed");
    assert_eq!(info.stdout_end, TOTAL);
}

#[tokio::test]
async fn output_survives_a_reconnect() {
    let host = Host::start();
    let conn = host.accept().await;
    let trigger = host.dir.0.join("go");
    let script = format!(
        "printf first; while [ ! -e {} ]; do sleep 0.01; done; printf second; printf third >&2",
        host.guest_dir.join("go").display()
    );
    conn.spawn(sh("resume", &script)).await;
    let mut a = conn.attach("resume", 0, 0).await;
    let mut got = Vec::new();
    while got.len() < 5 {
        match a.next().await {
            Some(Frame::Stdout { data, .. }) => got.extend_from_slice(&data),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(got, b"first");
    a.ack().await;
    conn.wait_for("resume", "the ack", |c| {
        c.is_some_and(|c| c.stdout_base == 5)
    })
    .await;

    // The host goes away while the command runs; output keeps accumulating.
    drop(a);
    conn.drop_connection();
    std::fs::write(&trigger, b"").expect("trigger");

    let conn = host.accept().await;
    conn.wait_for("resume", "the command to finish", |c| {
        c.is_some_and(|c| c.exit.is_some())
    })
    .await;
    for (so, se) in [(0, 0), (100, 0), (5, 9)] {
        refused(
            conn.try_attach("resume", so, se).await.map(drop),
            StatusCode::RANGE_NOT_SATISFIABLE,
        );
    }
    let out = conn.attach("resume", 5, 0).await.collect(false).await;
    assert_eq!(out.stdout, b"second");
    assert_eq!(out.stderr, b"third");
    assert_eq!(out.exit.and_then(|e| e.exit_code), Some(0));

    // Offsets inside a chunk get exactly the bytes from there on.
    let out = conn.attach("resume", 8, 2).await.collect(false).await;
    assert_eq!(out.stdout, b"ond");
    assert_eq!(out.stderr, b"ird");
    assert!(out.exit.is_some());
}

#[tokio::test]
async fn background_children_do_not_hold_a_command_and_orphans_are_reaped() {
    let host = Host::start();
    let conn = host.accept().await;
    conn.spawn(sh("bg", "sleep 30 & echo $!")).await;
    let started = Instant::now();
    let out = conn.attach("bg", 0, 0).await.collect(true).await;
    assert!(started.elapsed() < Duration::from_secs(20));
    assert_eq!(out.exit.and_then(|e| e.exit_code), Some(0));
    let bg: u32 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("background pid");

    // The orphaned sleep now belongs to the agent (PID 1 in a sandbox, a
    // subreaper here). Kill it from inside, as the pids are the agent's, and
    // check that it does not stay a zombie (a zombie keeps its /proc entry).
    let script = format!(
        "kill -9 {bg}; i=0; while [ -e /proc/{bg} ] && [ $i -lt 1000 ]; do sleep 0.01; i=$((i+1)); done; [ ! -e /proc/{bg} ]"
    );
    conn.spawn(sh("reap", &script)).await;
    let out = conn.attach("reap", 0, 0).await.collect(true).await;
    assert_eq!(
        out.exit.and_then(|e| e.exit_code),
        Some(0),
        "orphan {bg} was reaped"
    );
}

#[tokio::test]
async fn commands_on_a_terminal() {
    let host = Host::start();
    let conn = host.accept().await;
    let script = "tty; stty size; echo $TERM";
    conn.spawn(on_pty("tty", &["sh", "-c", script], 24, 80))
        .await;
    let out = conn.attach("tty", 0, 0).await.collect(true).await;
    let got = text(&out.stdout);
    let lines: Vec<&str> = got.lines().collect();
    assert_eq!(lines.len(), 3, "{got:?}");
    assert!(lines[0].starts_with("/dev/pts/"), "{got:?}");
    assert_eq!(lines[1..], ["24 80", "xterm-256color"]);
    assert!(out.stderr.is_empty(), "a terminal's stderr is its stdout");
    assert_eq!(out.exit.and_then(|e| e.exit_code), Some(0));

    // The request's TERM wins; stderr comes on the terminal too.
    let mut req = on_pty("term", &["sh", "-c", "echo $TERM >&2; exit 4"], 10, 20);
    req["env"] = json!([["PATH", "/usr/bin:/bin"], ["TERM", "vt100"]]);
    conn.spawn(req).await;
    let out = conn.attach("term", 0, 0).await.collect(true).await;
    assert_eq!(text(&out.stdout), "vt100\n");
    assert!(out.stderr.is_empty());
    assert_eq!(out.exit.and_then(|e| e.exit_code), Some(4));

    // SAFETY: plain syscall.
    if unsafe { libc::geteuid() } == 0 {
        // Another user gets the terminal as its controlling one (^C reaches
        // it), and owns it. (gVisor cannot open /dev/tty, so no `</dev/tty`.)
        let script = "id -u; [ -O \"$(tty)\" ] && echo owner; stty size; exec sleep 100";
        let mut req = on_pty("user", &["sh", "-c", script], 5, 6);
        req["user"] = json!("nobody");
        conn.spawn(req).await;
        let mut a = conn.attach("user", 0, 0).await;
        let mut out = Vec::new();
        a.read_until(&mut out, "5 6\r\n").await;
        a.send(Frame::Stdin(Bytes::from_static(b"\x03"))).await;
        let rest = a.collect(true).await;
        out.extend_from_slice(&rest.stdout);
        assert!(
            text(&out).starts_with("65534\nowner\n5 6\n"),
            "{:?}",
            text(&out)
        );
        assert_eq!(rest.exit.and_then(|e| e.signal), Some(libc::SIGINT));
    }
}

#[tokio::test]
async fn a_terminal_is_resized() {
    let host = Host::start();
    let conn = host.accept().await;
    let script = "trap 'stty size' WINCH; echo ready; while true; do sleep 0.1; done";
    conn.spawn(on_pty("winch", &["sh", "-c", script], 24, 80))
        .await;
    let mut a = conn.attach("winch", 0, 0).await;
    let mut out = Vec::new();
    a.read_until(&mut out, "ready\r\n").await;
    a.send(Frame::Resize(PtySize {
        rows: 40,
        cols: 100,
    }))
    .await;
    a.read_until(&mut out, "40 100\r\n").await;
    conn.signal("winch", 9).await.expect("signal");
    assert_eq!(a.collect(true).await.exit.and_then(|e| e.signal), Some(9));

    // Without a terminal a resize is ignored.
    conn.spawn(json!({"id": "cat", "argv": ["cat"], "env": [], "stdin": true}))
        .await;
    let mut a = conn.attach("cat", 0, 0).await;
    a.send(Frame::Resize(PtySize { rows: 1, cols: 1 })).await;
    a.send(Frame::Stdin(Bytes::from_static(b"x"))).await;
    a.send(Frame::StdinEof).await;
    let out = a.collect(true).await;
    assert_eq!(out.stdout, b"x");
    assert_eq!(out.exit.and_then(|e| e.exit_code), Some(0));
}

#[tokio::test]
async fn terminal_input_echo_eof_and_interrupt() {
    let host = Host::start();
    let conn = host.accept().await;
    conn.spawn(on_pty("cat", &["cat"], 24, 80)).await;
    let mut a = conn.attach("cat", 0, 0).await;
    a.send(Frame::Stdin(Bytes::from_static(b"hello\n"))).await;
    let mut out = Vec::new();
    // The terminal's echo, then cat's copy.
    a.read_until(&mut out, "hello\r\nhello\r\n").await;
    // End of input on a terminal is its EOF character, which ends cat.
    a.send(Frame::StdinEof).await;
    let rest = a.collect(true).await;
    assert_eq!(rest.exit.and_then(|e| e.exit_code), Some(0));

    // ^C interrupts the terminal's foreground process.
    conn.spawn(on_pty("sleep", &["sleep", "100"], 24, 80)).await;
    let mut a = conn.attach("sleep", 0, 0).await;
    a.send(Frame::Stdin(Bytes::from_static(b"\x03"))).await;
    let exit = a.collect(true).await.exit.expect("exit");
    assert_eq!(exit.signal, Some(libc::SIGINT), "{exit:?}");
}

#[tokio::test]
async fn timeout_kills_processes_that_left_the_group() {
    let host = Host::start();
    let conn = host.accept().await;
    let d = host.guest_dir.display();
    // One daemon in a new session under a live parent, and one double-forked
    // into a new session and re-parented to the agent.
    let script = format!(
        "setsid sh -c 'sleep 300 & echo $! > {d}/a; wait' & \
         (setsid sh -c 'sleep 300 & echo $! > {d}/b; wait' &); \
         sleep 300"
    );
    let mut req = sh("slow", &script);
    req["timeout_ms"] = json!(1000);
    conn.spawn(req).await;
    let exit = conn
        .attach("slow", 0, 0)
        .await
        .collect(true)
        .await
        .exit
        .expect("exit");
    assert!(exit.timed_out, "{exit:?}");
    assert_eq!(exit.signal, Some(9));
    for name in ["a", "b"] {
        let pid = read_pid(&host, name);
        assert!(gone(&conn, "check", pid).await, "{name}: {pid} survived");
        conn.forget("check").await.expect("forget");
    }
}

#[tokio::test]
async fn signals_reach_processes_that_left_the_group() {
    let host = Host::start();
    let conn = host.accept().await;
    let d = host.guest_dir.display();
    for (id, sig) in [("kill", libc::SIGKILL), ("term", libc::SIGTERM)] {
        let script =
            format!("setsid sh -c 'sleep 300 & echo $! > {d}/{id}; echo ready; wait' & wait");
        conn.spawn(sh(id, &script)).await;
        let mut a = conn.attach(id, 0, 0).await;
        a.read_until(&mut Vec::new(), "ready\n").await;
        conn.signal(id, sig).await.expect("signal");
        let exit = a.collect(true).await.exit.expect("exit");
        assert_eq!(exit.signal, Some(sig), "{exit:?}");
        assert!(!exit.timed_out);
        let pid = read_pid(&host, id);
        let check = format!("check-{id}");
        assert!(gone(&conn, &check, pid).await, "{id}: {pid} survived");
    }
}

#[tokio::test]
async fn a_command_that_exits_leaves_its_daemons_running() {
    let host = Host::start();
    let conn = host.accept().await;
    let out = run(&conn, "bg", "setsid sleep 300 & echo $!").await;
    assert_eq!(out.exit.and_then(|e| e.exit_code), Some(0));
    let pid: u32 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("daemon pid");
    assert!(alive(&conn, "alive", pid).await, "{pid} was killed");
    let out = run(&conn, "kill", &format!("kill -9 {pid}")).await;
    assert_eq!(out.exit.and_then(|e| e.exit_code), Some(0));
    assert!(gone(&conn, "gone", pid).await, "{pid} survived");
}

#[tokio::test]
async fn a_host_that_never_speaks_http2_is_dropped() {
    // It answers the hello and then says nothing more.
    let host = Host::start();
    let (mut silent, _) = host.accept_hello().await;
    let conn = host.accept().await;
    let mut sink = Vec::new();
    within(
        "the silent connection to close",
        silent.read_to_end(&mut sink),
    )
    .await
    .expect("read");
    let out = run(&conn, "after", "echo still-here").await;
    assert_eq!(out.stdout, b"still-here\n");
}

#[tokio::test]
async fn a_host_that_stops_answering_is_dropped_and_the_agent_dials_again() {
    // A host that vanished without the hangup reaching the agent looks like this:
    // the connection stays open and nothing answers, not even HTTP/2 pings.
    let host = Host::start();
    let (agent_side, hello) = host.accept_hello().await;
    let (near, far) = UnixStream::pair().expect("pair");
    let (freeze, frozen) = tokio::sync::oneshot::channel::<()>();
    let proxy = tokio::spawn(async move {
        let (mut a, mut b) = (agent_side, far);
        tokio::select! {
            _ = tokio::io::copy_bidirectional(&mut a, &mut b) => {}
            _ = frozen => {}
        }
        a
    });
    let first = Conn(
        AgentConn::start(near, SANDBOX, &hello.agent_version)
            .await
            .expect("h2 handshake"),
    );
    let out = run(&first, "before", "echo hello").await;
    assert_eq!(out.stdout, b"hello\n");

    // Freeze: the agent's end stays open, nothing reads or writes it.
    freeze.send(()).expect("freeze");
    let mut silent = proxy.await.expect("proxy");
    let conn = host.accept().await;
    let mut sink = Vec::new();
    within(
        "the frozen connection to close",
        silent.read_to_end(&mut sink),
    )
    .await
    .expect("read");
    let out = run(&conn, "after", "echo still-here").await;
    assert_eq!(out.stdout, b"still-here\n");
}
