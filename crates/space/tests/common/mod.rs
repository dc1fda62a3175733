//! Test harness: starts the real `space` binary on an ephemeral port with a
//! throwaway data dir, talks to it through the typed client (`space_client`, the one
//! the CLI and the benches use), and checks that nothing leaked.
//!
//! `get`/`post`/`delete`/`call` give the raw status and JSON of any request (through
//! the client's escape hatch, [`space_client::Client::request`]), for tests whose
//! subject is the wire: statuses, error bodies, malformed input. The helpers above
//! them (`create`, `run`, `destroy`, `wait_op`, `output`, `wait_state`, …) make typed
//! calls; [`TestServer::client`] gives the client itself.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use futures::StreamExt;
use serde_json::{json, Value};
use space_client::api::{
    CommandState, CreateSandboxRequest, Event, OperationKind, ProcessResult, SandboxState,
};
use space_client::{Client, EventsQuery, OutputItem, OutputQuery, StdStream};

pub const TOKEN: &str = "test-token-0123456789";

/// Deadline of one request whose answer is read whole: longer than any `wait` a test
/// asks of the server.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);
/// How long an operation may take before a test gives up on it (a template build or
/// a microVM under TCG on a loaded host is slow).
const OPERATION_LIMIT: Duration = Duration::from_secs(1200);

/// The template cache shared by all tests (built once by scripts/test.sh).
pub fn templates_dir() -> PathBuf {
    std::env::var_os("SPACE_TEST_TEMPLATES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/space-test-templates")
        })
}

/// A client of `url` with bearer token `token` and the tests' request deadline.
pub fn client_of(url: &str, token: &str) -> Client {
    Client::builder(url, token)
        .timeout(REQUEST_TIMEOUT)
        .build()
        .expect("a client of the test server")
}

/// Sends a request and reads its answer as `(status, JSON)`: `Null` for an empty
/// body, a JSON string for a body that is not JSON.
pub async fn send_raw(rb: reqwest::RequestBuilder) -> (u16, Value) {
    let resp = rb.send().await.expect("request");
    let status = resp.status().as_u16();
    let bytes = resp.bytes().await.expect("body");
    let v = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
    };
    (status, v)
}

/// `method path` with `body` as JSON through `client`'s escape hatch: the raw answer.
pub async fn call_with(
    client: &Client,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut rb = client.request(method, path);
    if let Some(b) = body {
        rb = rb.json(&b);
    }
    send_raw(rb).await
}

/// A typed value as JSON, for assertions that index into it.
fn json_of<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).expect("API types serialize")
}

/// One chunk of a command's output.
#[derive(Debug, Clone)]
pub struct Chunk {
    pub stream: StdStream,
    /// Its position in the view that was read.
    pub offset: u64,
    pub data: Vec<u8>,
}

/// The end of a command's output.
#[derive(Debug, Clone)]
pub struct End {
    pub state: CommandState,
    /// `None` for a `lost` command.
    pub result: Option<ProcessResult>,
    pub lost_reason: Option<String>,
}

impl End {
    /// The exit code (`None` when killed by a signal, or lost).
    pub fn exit_code(&self) -> Option<i32> {
        self.result.as_ref().and_then(|r| r.exit_code)
    }
}

pub struct TestServer {
    child: Option<Child>,
    pub url: String,
    pub data: tempfile::TempDir,
    /// The client of the running server (made anew at each start: the port changes).
    client: Option<Client>,
    extra_args: Vec<String>,
    /// Extra environment for the next start (cleared by `clear_env`).
    pub env: Vec<(String, String)>,
}

impl TestServer {
    pub async fn start() -> TestServer {
        Self::start_with(&[]).await
    }

    pub async fn start_with(extra: &[&str]) -> TestServer {
        Self::start_with_env(extra, &[]).await
    }

    /// A server started with extra arguments and extra environment.
    pub async fn start_with_env(extra: &[&str], env: &[(&str, &str)]) -> TestServer {
        let data = tempfile::Builder::new()
            .prefix("sp")
            .tempdir_in("/tmp")
            .expect("tempdir");
        let mut s = TestServer {
            child: None,
            url: String::new(),
            data,
            client: None,
            extra_args: extra.iter().map(|s| s.to_string()).collect(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        s.spawn();
        s
    }

    /// The typed client of the server, with the server's own token.
    pub fn client(&self) -> &Client {
        self.client.as_ref().expect("the server was started")
    }

    /// A client of the server with another token (an API key).
    pub fn client_as(&self, token: &str) -> Client {
        client_of(&self.url, token)
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.data.path().join("server.log"))
            .expect("log");
        // A bench may run another build of the server (a before-and-after figure).
        let bin = std::env::var_os("SPACE_TEST_SERVER_BIN")
            .unwrap_or_else(|| env!("CARGO_BIN_EXE_space").into());
        let mut cmd = Command::new(bin);
        cmd.arg("serve")
            .arg("--dev")
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--data-dir")
            .arg(self.data.path())
            .arg("--templates-dir")
            .arg(templates_dir())
            .args(&self.extra_args)
            .env("SPACE_DEV_TOKEN", TOKEN)
            .env("SPACE_LOG", "info")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log);
        // If the test process dies, the server goes with it.
        // SAFETY: prctl is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().expect("start space serve");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let url = loop {
            match lines.next() {
                Some(Ok(line)) => {
                    if let Some(u) = line.strip_prefix("space listening on ") {
                        break u.to_string();
                    }
                }
                _ => {
                    let log = std::fs::read_to_string(self.data.path().join("server.log"))
                        .unwrap_or_default();
                    panic!("server exited before listening:\n{log}");
                }
            }
        };
        // Keep draining stdout so the server never blocks on it.
        std::thread::spawn(move || for _ in lines {});
        self.client = Some(client_of(&url, TOKEN));
        self.url = url;
        self.child = Some(child);
    }

    /// kill -9 the server, then start it again on the same data dir.
    pub fn kill_and_restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    /// Starts the server again (same data dir) after it died by itself.
    pub fn restart(&mut self) {
        self.spawn();
    }

    /// Waits until the server process exits by itself (a failpoint killed it).
    /// Waits for the server to die by itself (a failpoint); panics after five minutes.
    pub fn wait_exit(&mut self) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        let started = std::time::Instant::now();
        loop {
            if let Some(status) = c.try_wait().expect("wait for the server") {
                assert!(!status.success(), "the server exited cleanly: {status}");
                return;
            }
            if started.elapsed() > Duration::from_secs(300) {
                self.child = Some(c);
                panic!("the server did not exit within 5 minutes\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits (on the event stream) until the sandbox reaches `state`: that event.
    /// Panics after `limit`.
    pub async fn wait_state(&self, sb: &str, state: &str, limit: Duration) -> Event {
        let fut = async {
            let q = EventsQuery {
                after: Some(0),
                ..Default::default()
            };
            let mut events = self.client().events(&q).await.expect("events");
            loop {
                let ev = events
                    .next()
                    .await
                    .expect("the event stream ended")
                    .expect("an event");
                if ev.kind == "sandbox" && ev.object["id"] == sb && ev.object["state"] == state {
                    return ev;
                }
            }
        };
        match tokio::time::timeout(limit, fut).await {
            Ok(v) => v,
            Err(_) => {
                let (_, now) = self.get(&format!("/v1/sandboxes/{sb}")).await;
                panic!("{sb} did not become {state} within {limit:?}; it is {now}")
            }
        }
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The server's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// `space keys create --tenant T` on the server's data dir: the key it prints.
    pub fn new_key(&self, tenant: &str) -> String {
        let out = Command::new(env!("CARGO_BIN_EXE_space"))
            .args([
                "keys",
                "create",
                "--tenant",
                tenant,
                "--name",
                "test",
                "--data-dir",
            ])
            .arg(self.data_dir())
            .output()
            .expect("space keys create");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let key = String::from_utf8(out.stdout).unwrap().trim().to_string();
        assert!(key.starts_with("spk_"), "{key}");
        key
    }

    pub fn data_dir(&self) -> &Path {
        self.data.path()
    }

    pub fn runsc_root(&self) -> PathBuf {
        self.data.path().join("runsc")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.data.path().join("server.log")).unwrap_or_default()
    }

    /// A request to `path` with the credentials: the client's escape hatch, for
    /// requests the typed calls do not make (raw bodies, odd headers, streams read by hand).
    pub fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.client().request(method, path)
    }

    /// The raw status and JSON answer of `method path` (with `body` as JSON).
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        call_with(self.client(), method, path, body).await
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        self.call(reqwest::Method::GET, path, None).await
    }

    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.call(reqwest::Method::POST, path, Some(body)).await
    }

    pub async fn delete(&self, path: &str) -> (u16, Value) {
        self.call(reqwest::Method::DELETE, path, None).await
    }

    /// Whether this server offers `runtime`. When it does not, the reason is printed, and
    /// the test fails instead if `SPACE_TEST_REQUIRE_RUNTIMES` names the runtime.
    pub async fn runtime_available(&self, runtime: &str) -> bool {
        let runtimes = self.client().runtimes().await.expect("GET /v1/runtimes");
        let entry = runtimes
            .iter()
            .find(|r| r.name == runtime)
            .unwrap_or_else(|| panic!("no runtime {runtime} in {runtimes:?}"));
        if entry.available {
            return true;
        }
        let required = std::env::var("SPACE_TEST_REQUIRE_RUNTIMES").unwrap_or_default();
        assert!(
            !required.split(',').any(|r| r == runtime),
            "runtime {runtime} is required but unavailable: {entry:?}"
        );
        eprintln!(
            "skipping: runtime {runtime} is unavailable here: {}",
            entry.reason.as_deref().unwrap_or("no reason given")
        );
        false
    }

    /// Waits for an operation to end and returns it (as JSON).
    pub async fn wait_op(&self, op_id: &str) -> Value {
        let op = self
            .client()
            .wait_operation(op_id, OPERATION_LIMIT)
            .await
            .unwrap_or_else(|e| panic!("waiting for operation {op_id}: {e}"));
        assert!(
            op.status.is_terminal(),
            "operation {op_id} did not end within {OPERATION_LIMIT:?}: {op:?}"
        );
        json_of(&op)
    }

    /// Creates a sandbox and waits until it runs.
    pub async fn create(&self, template: &str) -> String {
        self.create_with(json!({ "template": template })).await
    }

    /// Creates a sandbox (`body`: a `POST /v1/sandboxes` request) and waits for it.
    /// `SPACE_TEST_RUNTIME` (e.g. `microvm`) runs the sandboxes of a suite on another
    /// runtime when the body names none.
    pub async fn create_with(&self, mut body: Value) -> String {
        if let (Ok(rt), Some(obj)) = (std::env::var("SPACE_TEST_RUNTIME"), body.as_object_mut()) {
            obj.entry("runtime").or_insert(json!(rt));
        }
        let req: CreateSandboxRequest = serde_json::from_value(body.clone())
            .unwrap_or_else(|e| panic!("not a create request: {e}: {body}"));
        let op = self
            .client()
            .create_sandbox(&req)
            .await
            .unwrap_or_else(|e| panic!("create {body}: {e}"));
        assert_eq!(op.kind, OperationKind::Create, "{op:?}");
        let op = self.wait_op(&op.id).await;
        assert_eq!(
            op["status"],
            "succeeded",
            "create failed: {op}\n{}",
            self.log()
        );
        op["sandbox_id"].as_str().unwrap().to_string()
    }

    /// Runs a command with `wait:true` and returns the command with its output (as JSON).
    pub async fn run(&self, sb: &str, argv: &[&str]) -> Value {
        let cmd = self
            .client()
            .run(sb, argv)
            .await
            .unwrap_or_else(|e| panic!("running {argv:?} in {sb}: {e}"));
        json_of(&cmd)
    }

    pub async fn sh(&self, sb: &str, script: &str) -> Value {
        self.run(sb, &["/bin/sh", "-c", script]).await
    }

    /// Destroys a sandbox, waits, and checks that nothing of it is left.
    pub async fn destroy(&self, sb: &str) {
        let op = self
            .client()
            .destroy_sandbox(sb)
            .await
            .unwrap_or_else(|e| panic!("destroy {sb}: {e}"));
        assert_eq!(op.kind, OperationKind::Destroy, "{op:?}");
        let op = self.wait_op(&op.id).await;
        assert_eq!(op["status"], "succeeded", "{op}");
        let s = self
            .client()
            .sandbox(sb)
            .await
            .expect("the destroyed sandbox");
        assert_eq!(s.state, SandboxState::Destroyed);
        self.assert_nothing_left(sb);
    }

    /// No runsc container, process, mount, socket, cgroup or directory of `sb`.
    pub fn assert_nothing_left(&self, sb: &str) {
        let list = Command::new("runsc")
            .arg("--root")
            .arg(self.runsc_root())
            .args(["list", "--quiet"])
            .output()
            .expect("runsc list");
        let list = String::from_utf8_lossy(&list.stdout);
        assert!(!list.contains(sb), "runsc still lists {sb}: {list}");
        let procs = processes_mentioning(sb);
        assert!(procs.is_empty(), "processes of {sb} remain: {procs:?}");
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        assert!(!mounts.contains(sb), "a mount of {sb} remains");
        let dir = self.data.path().join("sandboxes").join(sb);
        assert!(!dir.exists(), "{} remains", dir.display());
        for c in std::fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
        {
            let cg = c.path().join("space").join(sb);
            assert!(!cg.exists(), "cgroup {} remains", cg.display());
        }
        let unix = std::fs::read_to_string("/proc/net/unix").unwrap_or_default();
        assert!(!unix.contains(sb), "a socket of {sb} remains");
    }

    /// A command's output as `q` asks for it: its chunks, and its end when the output
    /// reached it (with `follow`, or for a command that has ended).
    pub async fn output(&self, sb: &str, cmd: &str, q: OutputQuery) -> (Vec<Chunk>, Option<End>) {
        let mut items = self
            .client()
            .command_output(sb, cmd, &q)
            .await
            .unwrap_or_else(|e| panic!("output of {cmd}: {e}"));
        let mut chunks = Vec::new();
        while let Some(item) = items.next().await {
            match item.unwrap_or_else(|e| panic!("output of {cmd}: {e}")) {
                OutputItem::Chunk {
                    stream,
                    offset,
                    data,
                } => chunks.push(Chunk {
                    stream,
                    offset,
                    data,
                }),
                OutputItem::End {
                    state,
                    result,
                    lost_reason,
                } => {
                    let end = End {
                        state,
                        result,
                        lost_reason,
                    };
                    return (chunks, Some(end));
                }
            }
        }
        (chunks, None)
    }
}

/// Concatenated data of output chunks of one stream (or all when `None`).
pub fn decode(chunks: &[Chunk], stream: Option<StdStream>) -> Vec<u8> {
    chunks
        .iter()
        .filter(|c| stream.is_none_or(|s| c.stream == s))
        .flat_map(|c| c.data.iter().copied())
        .collect()
}

/// Processes whose command line contains `needle`, with their command lines.
pub fn processes_mentioning(needle: &str) -> Vec<(i32, String)> {
    processes_where(|_, cmdline| String::from_utf8_lossy(cmdline).contains(needle))
}

/// Processes whose environment holds `needle` (`NAME=value`), with their command lines:
/// what a client script and everything it started inherited.
pub fn processes_with_env(needle: &str) -> Vec<(i32, String)> {
    processes_where(|pid, _| {
        std::fs::read(format!("/proc/{pid}/environ"))
            .is_ok_and(|env| env.split(|b| *b == 0).any(|v| v == needle.as_bytes()))
    })
}

/// Processes for which `matches(pid, cmdline)` holds, with their command lines.
fn processes_where(matches: impl Fn(i32, &[u8]) -> bool) -> Vec<(i32, String)> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) {
            if matches(pid, &cmdline) {
                found.push((pid, String::from_utf8_lossy(&cmdline).replace('\0', " ")));
            }
        }
    }
    found
}

/// Runs a client script (an SDK's, a browser's) to its end and prints what it wrote;
/// panics with that, and with `context()`, unless it succeeded.
pub fn run_script_checked(cmd: &mut Command, name: &str, context: impl FnOnce() -> String) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {name}: {e}"));
    let text = format!(
        "{}\n{}\n{name} ended: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        out.status
    );
    println!("--- {name}\n{text}");
    assert!(
        out.status.success(),
        "{name} failed:\n{text}\n{}",
        context()
    );
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.log();
            let tail: String = log
                .lines()
                .rev()
                .take(60)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n");
            eprintln!("---- server log (tail) ----\n{tail}\n----");
            // And what each sandbox's agent said.
            for e in std::fs::read_dir(self.data.path().join("sandboxes"))
                .into_iter()
                .flatten()
                .flatten()
            {
                let log =
                    std::fs::read_to_string(e.path().join("log/console.log")).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(20).collect();
                eprintln!(
                    "---- agent console of {} ----\n{}",
                    e.file_name().to_string_lossy(),
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
        }
        self.kill9();
        // A failed test must not leak sandboxes: remove whatever runsc still has.
        let root = self.runsc_root();
        if let Ok(out) = Command::new("runsc")
            .arg("--root")
            .arg(&root)
            .args(["list", "--quiet"])
            .output()
        {
            for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = Command::new("runsc")
                    .arg("--root")
                    .arg(&root)
                    .args(["delete", "--force", id])
                    .status();
                for c in std::fs::read_dir("/sys/fs/cgroup")
                    .into_iter()
                    .flatten()
                    .flatten()
                {
                    let _ = std::fs::remove_dir(c.path().join("space").join(id));
                }
            }
        }
        // Nor microVMs: their QEMU runs in its own process group, outliving the server.
        let data = self.data.path().to_string_lossy().into_owned();
        for (pid, args) in processes_mentioning(&data) {
            if args.contains("qemu-system") {
                // SAFETY: plain syscall on a pid found just now.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        // Nor leave sandbox disks mounted (the data dir could not be removed).
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        for point in mounts.lines().filter_map(|l| l.split(' ').nth(4)) {
            if point.starts_with(&data) {
                let _ = Command::new("umount").arg("-l").arg(point).status();
            }
        }
    }
}

/// The CPUs the container cgroup `parent/id` may use at most, by its CPU quota (cgroup
/// v1's `cpu.cfs_quota_us` over `cpu.cfs_period_us`, or v2's `cpu.max`); `None` without one.
pub fn cgroup_cpu_quota(parent: &str, id: &str) -> Option<f64> {
    let base = PathBuf::from("/sys/fs/cgroup");
    let v1 = base.join("cpu").join(parent).join(id);
    let read = |name: &str| -> Option<f64> {
        std::fs::read_to_string(v1.join(name))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    if let (Some(quota), Some(period)) = (read("cpu.cfs_quota_us"), read("cpu.cfs_period_us")) {
        return (quota > 0.0 && period > 0.0).then(|| quota / period);
    }
    let max = std::fs::read_to_string(base.join(parent).join(id).join("cpu.max")).ok()?;
    let mut fields = max.split_whitespace();
    let quota: f64 = fields.next()?.parse().ok()?;
    let period: f64 = fields.next()?.parse().ok()?;
    (period > 0.0).then(|| quota / period)
}
