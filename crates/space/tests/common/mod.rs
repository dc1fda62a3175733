//! Test harness: starts the real `space` binary on an ephemeral port with a
//! throwaway data dir, talks HTTP to it, and checks that nothing leaked.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

pub const TOKEN: &str = "test-token-0123456789";

/// The template cache shared by all tests (built once by scripts/test.sh).
pub fn templates_dir() -> PathBuf {
    std::env::var_os("SPACE_TEST_TEMPLATES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/space-test-templates")
        })
}

pub struct TestServer {
    child: Option<Child>,
    pub url: String,
    pub data: tempfile::TempDir,
    pub http: reqwest::Client,
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
            http: reqwest::Client::new(),
            extra_args: extra.iter().map(|s| s.to_string()).collect(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        s.spawn();
        s
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

    /// Waits (on the event stream) until the sandbox reaches `state`; panics after `limit`.
    pub async fn wait_state(&self, sb: &str, state: &str, limit: Duration) -> Value {
        let fut = async {
            let mut resp = self
                .req(reqwest::Method::GET, "/v1/events?after=0")
                .send()
                .await
                .expect("events");
            assert_eq!(resp.status(), 200);
            let mut buf = Vec::new();
            loop {
                let chunk = resp
                    .chunk()
                    .await
                    .expect("event chunk")
                    .expect("stream ended");
                buf.extend_from_slice(&chunk);
                while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
                    let frame: Vec<u8> = buf.drain(..pos + 2).collect();
                    let text = String::from_utf8_lossy(&frame);
                    for line in text.lines() {
                        if let Some(data) = line.strip_prefix("data: ") {
                            let ev: Value = serde_json::from_str(data).expect("event json");
                            if ev["type"] == "sandbox"
                                && ev["object"]["id"] == sb
                                && ev["object"]["state"] == state
                            {
                                return ev;
                            }
                        }
                    }
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

    pub fn data_dir(&self) -> &Path {
        self.data.path()
    }

    pub fn runsc_root(&self) -> PathBuf {
        self.data.path().join("runsc")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.data.path().join("server.log")).unwrap_or_default()
    }

    pub fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{}", self.url, path))
            .bearer_auth(TOKEN)
            .timeout(Duration::from_secs(600))
    }

    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut rb = self.req(method, path);
        if let Some(b) = body {
            rb = rb.json(&b);
        }
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
        let (st, v) = self.get("/v1/runtimes").await;
        assert_eq!(st, 200, "{v}");
        let entry = v["runtimes"]
            .as_array()
            .and_then(|a| a.iter().find(|r| r["name"] == runtime).cloned())
            .unwrap_or_else(|| panic!("no runtime {runtime} in {v}"));
        if entry["available"] == true {
            return true;
        }
        let required = std::env::var("SPACE_TEST_REQUIRE_RUNTIMES").unwrap_or_default();
        assert!(
            !required.split(',').any(|r| r == runtime),
            "runtime {runtime} is required but unavailable: {entry}"
        );
        eprintln!(
            "skipping: runtime {runtime} is unavailable here: {}",
            entry["reason"]
        );
        false
    }

    /// Waits for an operation to end and returns it.
    pub async fn wait_op(&self, op_id: &str) -> Value {
        for _ in 0..40 {
            let (status, op) = self.get(&format!("/v1/operations/{op_id}?wait=30s")).await;
            assert_eq!(status, 200, "{op}");
            let st = op["status"].as_str().unwrap_or_default();
            if ["succeeded", "failed", "cancelled"].contains(&st) {
                return op;
            }
        }
        panic!("operation {op_id} did not end");
    }

    /// Creates a sandbox and waits until it runs.
    pub async fn create(&self, template: &str) -> String {
        self.create_with(json!({ "template": template })).await
    }

    /// Creates a sandbox and waits for it. `SPACE_TEST_RUNTIME` (e.g. `microvm`) runs
    /// the sandboxes of a suite on another runtime when the body names none.
    pub async fn create_with(&self, mut body: Value) -> String {
        if let (Ok(rt), Some(obj)) = (std::env::var("SPACE_TEST_RUNTIME"), body.as_object_mut()) {
            obj.entry("runtime").or_insert(json!(rt));
        }
        let (status, op) = self.post("/v1/sandboxes", body).await;
        assert_eq!(status, 202, "{op}");
        assert_eq!(op["kind"], "create");
        let op = self.wait_op(op["id"].as_str().unwrap()).await;
        assert_eq!(
            op["status"],
            "succeeded",
            "create failed: {op}\n{}",
            self.log()
        );
        op["sandbox_id"].as_str().unwrap().to_string()
    }

    /// Runs a command with `wait:true` and returns the command with its output.
    pub async fn run(&self, sb: &str, argv: &[&str]) -> Value {
        let (status, cmd) = self
            .post(
                &format!("/v1/sandboxes/{sb}/commands"),
                json!({ "argv": argv, "wait": true }),
            )
            .await;
        assert_eq!(status, 201, "{cmd}");
        cmd
    }

    pub async fn sh(&self, sb: &str, script: &str) -> Value {
        self.run(sb, &["/bin/sh", "-c", script]).await
    }

    /// Destroys a sandbox, waits, and checks that nothing of it is left.
    pub async fn destroy(&self, sb: &str) {
        let (status, op) = self.delete(&format!("/v1/sandboxes/{sb}")).await;
        assert_eq!(status, 202, "{op}");
        let op = self.wait_op(op["id"].as_str().unwrap()).await;
        assert_eq!(op["status"], "succeeded", "{op}");
        let (_, s) = self.get(&format!("/v1/sandboxes/{sb}")).await;
        assert_eq!(s["state"], "destroyed");
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

    /// The whole NDJSON output of a command (following until its end).
    pub async fn output(&self, sb: &str, cmd: &str, query: &str) -> (Vec<Value>, Option<Value>) {
        let resp = self
            .req(
                reqwest::Method::GET,
                &format!("/v1/sandboxes/{sb}/commands/{cmd}/output?{query}"),
            )
            .send()
            .await
            .expect("output");
        assert_eq!(resp.status(), 200);
        let body = resp.bytes().await.expect("output body");
        let mut chunks = Vec::new();
        let mut end = None;
        for line in body.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            let v: Value = serde_json::from_slice(line).expect("ndjson line");
            if v.get("data").is_some() {
                chunks.push(v);
            } else {
                end = Some(v);
            }
        }
        (chunks, end)
    }
}

/// Concatenated, decoded data of output chunks of one stream (or all when `None`).
pub fn decode(chunks: &[Value], stream: Option<&str>) -> Vec<u8> {
    use base64::Engine;
    let mut out = Vec::new();
    for c in chunks {
        if stream.is_none_or(|s| c["stream"] == s) {
            out.extend(
                base64::engine::general_purpose::STANDARD
                    .decode(c["data"].as_str().unwrap())
                    .unwrap(),
            );
        }
    }
    out
}

pub fn processes_mentioning(needle: &str) -> Vec<(i32, String)> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) {
            let s = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            if s.contains(needle) {
                found.push((pid, s));
            }
        }
    }
    found
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
