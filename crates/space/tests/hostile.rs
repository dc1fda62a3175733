//! The hostile-workload suite: a sandbox that tries to hurt the host, its
//! neighbours or the server, on every runtime. Each case asserts (a) that the
//! hostile thing failed or was confined, by something observable (an exit
//! status, an errno, a host file or setting that did not change, a limit hit),
//! and (b) that the rest stayed healthy: the server answers `/healthz`, a
//! neighbour sandbox (created first, in the same server) still runs `echo ok`,
//! and the victim either still works or failed cleanly with a reason. Every
//! sandbox ends with a destroy that checks nothing of it is left.
//!
//! Like `conformance.rs`, each group runs once per runtime (`…::gvisor::…`,
//! `…::microvm::…`); an unavailable runtime is skipped with a printed reason
//! unless `SPACE_TEST_REQUIRE_RUNTIMES` names it. Syscall-level probes come from
//! `hostile/probe.c`, built static on the host and uploaded into the sandbox.
//! Each passing case prints `hostile: <case> passed on <runtime>`.
//! What each case shows, and where the runtimes differ, is in docs/SECURITY.md.

#[path = "hostile/api.rs"]
mod api;
mod common;
#[path = "hostile/storage.rs"]
mod storage;

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use common::TestServer;
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;

/// Cases that load the host's CPUs (bombs, floods, spinners, build steps) run one at a
/// time: on a 2-core machine two of them at once starve every other sandbox for minutes,
/// and the suite's health checks would time out on the load rather than on a defect.
static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Held for the whole of a heavy case.
async fn heavy() -> tokio::sync::MutexGuard<'static, ()> {
    HEAVY.lock().await
}

/// Where a sandbox's probe binary lives.
const PROBE: &str = "/tmp/probe";
/// A generous answer deadline for health checks (a TCG microVM under load is slow).
const HEALTH_DEADLINE: Duration = Duration::from_secs(180);

/// The probe, built once per test binary.
fn probe_binary() -> &'static [u8] {
    static BIN: OnceLock<Vec<u8>> = OnceLock::new();
    BIN.get_or_init(|| {
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/hostile/probe.c");
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("probe");
        let st = std::process::Command::new("gcc")
            .args(["-static", "-O1", "-pthread", "-o"])
            .arg(&out)
            .arg(&src)
            .status()
            .expect("gcc (the hostile suite builds its probe with gcc -static)");
        assert!(st.success(), "building {}", src.display());
        std::fs::read(&out).expect("probe binary")
    })
}

/// Random hex, for markers nobody could guess.
fn random_hex() -> String {
    let mut b = [0u8; 12];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .expect("urandom");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

struct Hostile {
    s: TestServer,
    rt: &'static str,
    neighbour: String,
    /// A secret in the server's environment and in a host file.
    marker: String,
    host_file: PathBuf,
}

impl Drop for Hostile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.host_file);
    }
}

/// The server (with a marker in its environment) and a neighbour sandbox, or
/// `None` when `rt` is unavailable here.
async fn setup(rt: &'static str, extra: &[&str]) -> Option<Hostile> {
    let mut s = TestServer::start_with(extra).await;
    if !s.runtime_available(rt).await {
        return None;
    }
    let marker = format!("spacehostile{}", random_hex());
    s.env = vec![("SPACE_HOSTILE_SECRET".into(), marker.clone())];
    s.kill_and_restart();
    let host_file = PathBuf::from(format!("/tmp/{marker}"));
    std::fs::write(&host_file, &marker).expect("host marker file");
    let mut h = Hostile {
        s,
        rt,
        neighbour: String::new(),
        marker,
        host_file,
    };
    h.neighbour = h.create(json!({})).await;
    Some(h)
}

impl Hostile {
    async fn create(&self, mut body: Value) -> String {
        body["runtime"] = json!(self.rt);
        body["template"] = json!("busybox");
        let sb = self.s.create_with(body).await;
        let (_, v) = self.s.get(&format!("/v1/sandboxes/{sb}")).await;
        assert_eq!(v["runtime"], self.rt, "{v}");
        sb
    }

    /// A sandbox with the probe uploaded.
    async fn victim(&self, body: Value) -> String {
        let sb = self.create(body).await;
        self.upload(&sb, PROBE, probe_binary().to_vec(), "0755")
            .await;
        sb
    }

    /// An upload is made once by the server (its body goes out as it comes), so one whose
    /// agent connection broke under it is a 503 that changed nothing, and the API says to
    /// make it again: a starved TCG guest's agent can miss its keepalive and dial in again.
    async fn upload(&self, sb: &str, path: &str, data: Vec<u8>, mode: &str) {
        for attempt in 1..=3 {
            let resp = self
                .s
                .req(
                    reqwest::Method::PUT,
                    &format!("/v1/sandboxes/{sb}/files?path={path}&mode={mode}"),
                )
                .body(data.clone())
                .send()
                .await
                .expect("upload");
            let status = resp.status().as_u16();
            if status == 503 && attempt < 3 {
                let text = resp.text().await.unwrap_or_default();
                eprintln!(
                    "NOTE [{}] upload {path} to {sb}: 503, asking again: {text}",
                    self.rt
                );
                continue;
            }
            assert_eq!(status, 201, "upload {path}");
            return;
        }
    }

    /// Runs a command (wait:true); the status and the command.
    async fn try_cmd(&self, sb: &str, body: Value) -> (u16, Value) {
        self.s
            .post(&format!("/v1/sandboxes/{sb}/commands"), body)
            .await
    }

    async fn sh(&self, sb: &str, script: &str) -> Value {
        self.s.sh(sb, script).await
    }

    /// stdout of a shell script, which must exit 0.
    async fn sh_ok(&self, sb: &str, script: &str) -> String {
        let out = self.s.sh(sb, script).await;
        assert_eq!(out["result"]["exit_code"], 0, "{script}: {out}");
        out["stdout"].as_str().unwrap_or_default().to_string()
    }

    /// The probe's report line for one case.
    async fn probe(&self, sb: &str, args: &[&str]) -> String {
        let mut argv = vec![PROBE];
        argv.extend_from_slice(args);
        let out = self.s.run(sb, &argv).await;
        let text = format!(
            "{}{}",
            out["stdout"].as_str().unwrap_or_default(),
            out["stderr"].as_str().unwrap_or_default()
        );
        eprintln!("[{}] probe {args:?}: {}", self.rt, text.trim());
        text
    }

    /// The server answers, the neighbour runs `echo ok`, and the victim (if any)
    /// either still works (`true`) or has failed with a reason (`false`).
    async fn healthy(&self, case: &str, victim: Option<&str>) -> bool {
        let (st, v) = self.s.get("/healthz").await;
        assert_eq!(st, 200, "{case}: /healthz: {v}");
        if !self.echo(case, &self.neighbour).await {
            let (_, v) = self
                .s
                .get(&format!("/v1/sandboxes/{}", self.neighbour))
                .await;
            panic!("{case}: the neighbour failed: {v}");
        }
        let mut alive = true;
        if let Some(sb) = victim {
            if !self.echo(case, sb).await {
                let (_, v) = self.s.get(&format!("/v1/sandboxes/{sb}")).await;
                let reason = v["failure_reason"].as_str().unwrap_or_default();
                assert!(!reason.is_empty(), "{case}: failed without a reason: {v}");
                eprintln!("[{}] {case}: the victim failed cleanly: {reason}", self.rt);
                alive = false;
            }
        }
        eprintln!("hostile: {case} passed on {}", self.rt);
        alive
    }

    /// `echo ok` in `sb` within the health deadline: `true` when it answers, `false`
    /// when the sandbox is `failed`. A sandbox whose agent is briefly away (a
    /// starved agent misses its keepalive and dials in again) is asked again, and
    /// that is printed; anything else, or no answer by the deadline, fails the test.
    async fn echo(&self, case: &str, sb: &str) -> bool {
        let deadline = tokio::time::Instant::now() + HEALTH_DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let answer = tokio::time::timeout(
                left,
                self.try_cmd(sb, json!({"argv": ["echo", "ok"], "wait": true})),
            )
            .await;
            match answer {
                Ok((201, out)) if out["stdout"] == "ok\n" => return true,
                Ok((503, out)) => {
                    eprintln!(
                        "NOTE [{}] {case}: {sb} answered 503, asking again: {out}",
                        self.rt
                    );
                }
                other => {
                    let (_, v) = self.s.get(&format!("/v1/sandboxes/{sb}")).await;
                    if v["state"] == "failed" {
                        return false;
                    }
                    panic!("{case}: {sb} neither works nor failed: {other:?}; {v}");
                }
            }
            let (_, v) = self.s.get(&format!("/v1/sandboxes/{sb}")).await;
            if v["state"] == "failed" {
                return false;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{case}: {sb} did not answer within {HEALTH_DEADLINE:?}: {v}"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// `healthy`, then a fresh victim if the old one is gone.
    async fn next_victim(&self, case: &str, sb: String, body: &Value) -> String {
        if self.healthy(case, Some(&sb)).await {
            sb
        } else {
            self.s.destroy(&sb).await;
            self.victim(body.clone()).await
        }
    }

    async fn finish(self, victims: &[&str]) {
        for sb in victims {
            self.s.destroy(sb).await;
        }
        self.s.destroy(&self.neighbour).await;
    }

    /// ids and states of every sandbox.
    async fn snapshot(&self) -> BTreeSet<(String, String)> {
        let (st, v) = self.s.get("/v1/sandboxes").await;
        assert_eq!(st, 200, "{v}");
        v["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                (
                    s["id"].as_str().unwrap().to_string(),
                    s["state"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }

    /// A raw request: status and body text. A hung request fails the test.
    async fn raw(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Vec<u8>>,
        content_type: Option<&str>,
    ) -> (u16, String) {
        // A connection of its own: the server closes one after refusing a body it
        // did not read, and a pooled one could be reused just as it closes.
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()
            .unwrap();
        let client = space_client::Client::builder(&self.s.url, common::TOKEN)
            .http(http)
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap();
        let mut rb = client.request(method.clone(), path);
        if let Some(ct) = content_type {
            rb = rb.header("content-type", ct);
        }
        if let Some(b) = body {
            rb = rb.body(b);
        }
        match rb.send().await {
            Ok(resp) => {
                let st = resp.status().as_u16();
                let text = resp.text().await.unwrap_or_default();
                (st, text)
            }
            // The server may answer 413 and close while a big body is still going out.
            Err(e) if !e.is_timeout() => (0, format!("connection closed: {e}")),
            Err(e) => panic!("{method} {path}: no answer: {e}"),
        }
    }

    /// Asserts a clear 4xx (or, for an oversized body, a closed connection) with a JSON error.
    async fn expect_4xx(
        &self,
        what: &str,
        method: reqwest::Method,
        path: &str,
        body: Option<Vec<u8>>,
        want: &[u16],
    ) {
        let (st, text) = self.raw(method, path, body, Some("application/json")).await;
        if st == 0 {
            assert!(want.contains(&413), "{what}: {text}");
            return;
        }
        assert!(
            want.contains(&st),
            "{what}: status {st}, wanted one of {want:?}: {}",
            truncated(&text)
        );
        let v: Value = serde_json::from_str(&text)
            .unwrap_or_else(|_| panic!("{what}: error body is not JSON: {}", truncated(&text)));
        assert!(v["error"]["message"].is_string(), "{what}: {v}");
    }
}

fn truncated(s: &str) -> String {
    s.chars().take(300).collect()
}

fn vm_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|k| k.parse().ok())
        .unwrap()
}

/// A command's final state (it must end within `limit`).
async fn wait_cmd(h: &Hostile, sb: &str, cid: &str, limit: Duration) -> Value {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let (st, c) =
            h.s.get(&format!("/v1/sandboxes/{sb}/commands/{cid}?wait=30s"))
                .await;
        assert_eq!(st, 200, "{c}");
        if !c["result"].is_null() || c["state"] == "lost" {
            return c;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "command {cid} still runs: {c}"
        );
    }
}

async fn start_cmd(h: &Hostile, sb: &str, body: Value) -> String {
    let (st, c) = h.try_cmd(sb, body).await;
    assert_eq!(st, 201, "{c}");
    c["id"].as_str().unwrap().to_string()
}

/// How many processes (other than the agent and this `ps`) the sandbox has.
/// Kernel threads (a microVM's; PID 2 and its children) do not count.
async fn process_count(h: &Hostile, sb: &str) -> usize {
    let ps = h
        .sh_ok(
            sb,
            "ps -o pid,ppid,comm | awk -v me=$$ 'NR > 1 && $1 != 1 && $1 != 2 && $2 != 2 && $1 != me && $2 != me'",
        )
        .await;
    if !ps.is_empty() {
        eprintln!("[{}] processes in {sb}: {ps}", h.rt);
    }
    ps.lines().count()
}

// ───────────────────────────── resource abuse ─────────────────────────────

const RESOURCE_BOX: &str =
    r#"{"resources": {"vcpus": 2, "memory_mib": 256, "disk_mib": 128, "pids": 256}}"#;

async fn resource_abuse(rt: &'static str) {
    let _heavy = heavy().await;
    let Some(h) = setup(rt, &["--output-cap-mib", "16"]).await else {
        return;
    };
    let body: Value = serde_json::from_str(RESOURCE_BOX).unwrap();
    let mut v = h.victim(body.clone()).await;

    // Memory bomb: the process is killed (the guest kernel's OOM killer in the commands'
    // cgroup of a microVM; under gVisor the agent, before the host's cgroup, sized above
    // memory_mib, would have to kill the Sentry) and says so; the sandbox stays.
    let out = h
        .try_cmd(
            &v,
            json!({"shell": "awk 'BEGIN { s = \"xxxxxxxxxxxxxxxx\"; while (1) s = s s }'", "timeout_seconds": 120, "wait": true}),
        )
        .await;
    assert_eq!(out.0, 201, "{:?}", out.1);
    let r = &out.1["result"];
    assert_eq!(r["oom_killed"], true, "memory bomb: {}", out.1);
    assert_ne!(
        r["timed_out"], true,
        "memory bomb ran to its timeout: {}",
        out.1
    );
    assert!(
        h.healthy("memory_bomb", Some(&v)).await,
        "the memory bomb took the sandbox down"
    );

    // Disk fill: ENOSPC, then the space comes back.
    let fill = h
        .sh(
            &v,
            "dd if=/dev/zero of=/fill bs=1M count=1024 2>&1; echo rc=$?",
        )
        .await;
    let text = fill["stdout"].as_str().unwrap();
    assert!(text.contains("No space left"), "{fill}");
    assert!(!text.contains("rc=0"), "{fill}");
    h.sh_ok(&v, "rm /fill && echo small > /after && cat /after")
        .await;
    v = h.next_victim("disk_fill", v, &body).await;

    // Inode exhaustion: empty files until the filesystem says no (ENOSPC), or until
    // the sandbox's memory limit stops its kernel (gVisor keeps the overlay's inodes in
    // the sentry's memory, so its cgroup OOM-kills the whole sandbox, which then
    // reads `failed` with a reason). Either way the host and the neighbour are fine.
    let text = h.probe(&v, &["files", "/manyfiles", "3000000"]).await;
    if text.contains("files: err 28") || text.contains("files: err 12") {
        let (st, c) = h
            .try_cmd(
                &v,
                json!({"shell": "rm -rf /manyfiles", "timeout_seconds": 300, "wait": true}),
            )
            .await;
        assert_eq!(st, 201, "{c}");
        assert!(
            h.healthy("inode_exhaustion", Some(&v)).await,
            "the victim died after ENOSPC"
        );
    } else {
        assert!(!text.contains("files: ok"), "3000000 files fit: {text}");
        assert!(
            !h.healthy("inode_exhaustion", Some(&v)).await,
            "the file bomb ended without an error and the sandbox works: {text}"
        );
        assert_eq!(rt, "gvisor", "an inode bomb took a microVM down: {text}");
        let (_, sb) = h.s.get(&format!("/v1/sandboxes/{v}")).await;
        assert!(
            sb["failure_reason"]
                .as_str()
                .unwrap_or_default()
                .starts_with("out of memory"),
            "the reason says what happened: {sb}"
        );
        h.s.destroy(&v).await;
        v = h.victim(body.clone()).await;
    }

    // Output flood: the stored output is capped and the server's memory stays bounded.
    let pid = h.s.pid().unwrap();
    let flood_mib = if rt == "microvm" { 256 } else { 1024 };
    let cid = start_cmd(
        &h,
        &v,
        json!({"shell": format!("dd if=/dev/zero bs=1M count={flood_mib} 2>/dev/null; echo END")}),
    )
    .await;
    let c = wait_cmd(&h, &v, &cid, Duration::from_secs(900)).await;
    assert_eq!(c["result"]["exit_code"], 0, "{c}");
    assert_eq!(c["result"]["stdout_bytes"], (flood_mib << 20) + 4, "{c}");
    assert_eq!(c["result"]["output_truncated"], true, "{c}");
    let file =
        h.s.data_dir()
            .join("outputs")
            .join(&v)
            .join(&cid)
            .join("stdout");
    let on_disk = std::fs::metadata(&file).unwrap().blocks() * 512;
    assert!(
        on_disk <= 18 << 20,
        "{on_disk} bytes on disk for a 16 MiB cap"
    );
    let hwm = vm_kib(pid, "VmHWM:");
    eprintln!("[{rt}] server peak RSS after a {flood_mib} MiB flood: {hwm} KiB");
    assert!(hwm < 500 * 1024, "server peak RSS {hwm} KiB");
    v = h.next_victim("output_flood", v, &body).await;

    // CPU spin on every vCPU: the neighbour still answers while it runs.
    let spin = start_cmd(
        &h,
        &v,
        json!({"shell": "for i in 1 2 3 4; do (while :; do :; done) & done; wait"}),
    )
    .await;
    h.sh_ok(&v, "sleep 1").await;
    h.healthy("cpu_spin (during)", Some(&v)).await;
    let (st, r) =
        h.s.post(
            &format!("/v1/sandboxes/{v}/commands/{spin}/signal"),
            json!({"signal": "KILL"}),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    let c = wait_cmd(&h, &v, &spin, Duration::from_secs(60)).await;
    assert_eq!(c["result"]["signal"], 9, "{c}");
    v = h.next_victim("cpu_spin", v, &body).await;
    assert_eq!(process_count(&h, &v).await, 0, "spinners left");

    // Escape from a command timeout: double fork, setsid, ignored TERM/HUP, own process group.
    let out = h
        .try_cmd(
            &v,
            json!({
                "shell": "trap '' TERM HUP; (setsid sh -c 'trap \"\" TERM HUP; sleep 1001' &); (sh -c 'sleep 1002 & ' &); setsid sleep 1003 & nohup sleep 1004 >/dev/null 2>&1 & sleep 1000",
                "timeout_seconds": 2, "wait": true
            }),
        )
        .await;
    assert_eq!(out.1["result"]["timed_out"], true, "{}", out.1);
    let left = h.sh(&v, "ps -o comm | grep -c '^sleep' || true").await;
    assert_eq!(left["stdout"], "0\n", "escaped the timeout: {left}");
    v = h.next_victim("timeout_escape", v, &body).await;

    // A command that closes stdout and stderr and keeps running is still running,
    // and a kill ends it (its heartbeat stops).
    let cid = start_cmd(
        &h,
        &v,
        json!({"argv": [PROBE, "close_stdout_and_run", "/tmp/beat"]}),
    )
    .await;
    h.sh_ok(&v, "while [ ! -s /tmp/beat ]; do sleep 0.1; done; sleep 1")
        .await;
    let (_, c) = h.s.get(&format!("/v1/sandboxes/{v}/commands/{cid}")).await;
    assert_eq!(c["state"], "running", "closed output is not an exit: {c}");
    let (st, r) =
        h.s.post(
            &format!("/v1/sandboxes/{v}/commands/{cid}/signal"),
            json!({"signal": "KILL"}),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    let c = wait_cmd(&h, &v, &cid, Duration::from_secs(60)).await;
    assert_eq!(c["result"]["signal"], 9, "{c}");
    let beat = h
        .sh_ok(
            &v,
            "a=$(cat /tmp/beat); sleep 1; b=$(cat /tmp/beat); [ \"$a\" = \"$b\" ] && echo stopped",
        )
        .await;
    assert_eq!(beat, "stopped\n");
    v = h.next_victim("closed_stdout", v, &body).await;

    // Zombies: 200 unreaped children; once their parent exits, PID 1 reaps them.
    let out = h.s.run(&v, &[PROBE, "zombies", "200", "1"]).await;
    assert_eq!(out["result"]["exit_code"], 0, "{out}");
    assert!(
        out["stdout"].as_str().unwrap().contains("made 200"),
        "{out}"
    );
    let z = h
        .sh(&v, "sleep 0.5; ps -o stat | grep -c '^Z' || true")
        .await;
    assert_eq!(z["stdout"], "0\n", "zombies left: {z}");
    v = h.next_victim("zombies", v, &body).await;

    h.finish(&[&v]).await;
}

// ─────────────────────── the pids limit: fork and thread bombs ───────────────────────

async fn pids_bombs(rt: &'static str) {
    let _heavy = heavy().await;
    let Some(h) = setup(rt, &[]).await else {
        return;
    };
    // Fork bomb (in a sandbox of its own, pids 64): the pids limit stops it, the
    // timeout ends it, nothing of it stays; or, if the sandbox's agent is starved
    // for good, the sandbox fails with a reason. Either way within a bounded time.
    let bomb_box = json!({"resources": {"vcpus": 2, "memory_mib": 256, "pids": 64}});
    let bomb = h.victim(bomb_box.clone()).await;
    let cid = start_cmd(
        &h,
        &bomb,
        json!({"shell": "b() { b | b & }; b; sleep 1000", "timeout_seconds": 15}),
    )
    .await;
    let c = wait_cmd(&h, &bomb, &cid, Duration::from_secs(120)).await;
    if c["result"].is_null() {
        assert_eq!(c["state"], "lost", "{c}");
        assert!(
            !h.healthy("fork_bomb", Some(&bomb)).await,
            "lost, yet the sandbox works: {c}"
        );
        eprintln!(
            "FINDING [{rt}]: the fork bomb took the sandbox down: {}",
            c["lost_reason"]
        );
    } else {
        assert_eq!(c["result"]["timed_out"], true, "fork bomb: {c}");
        if h.healthy("fork_bomb", Some(&bomb)).await {
            assert!(process_count(&h, &bomb).await <= 2, "fork bomb leftovers");
        }
    }
    h.s.destroy(&bomb).await;

    // Threads bomb: pthread_create fails at the limit.
    let v = h
        .victim(json!({"resources": {"vcpus": 2, "memory_mib": 256, "pids": 256}}))
        .await;
    let (st, out) = h
        .try_cmd(
            &v,
            json!({"argv": [PROBE, "threads", "100000"], "timeout_seconds": 60, "wait": true}),
        )
        .await;
    assert_eq!(st, 201, "{out}");
    let text = out["stdout"].as_str().unwrap_or_default().to_string();
    eprintln!("[{rt}] threads bomb: {text} {}", out["result"]);
    assert!(
        text.contains("threads: err"),
        "threads bomb was not stopped by pids=256: {out}"
    );
    let made: u64 = text
        .split("made ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(u64::MAX);
    assert!(made <= 256, "{made} threads with pids=256: {text}");
    h.healthy("threads_bomb", Some(&v)).await;
    h.s.destroy(&v).await;

    h.finish(&[]).await;
}

// ─────────────────────────────── host probes ───────────────────────────────

/// Files and settings of the host that a sandbox must not change.
fn host_settings() -> Vec<(String, String)> {
    [
        "/proc/sys/kernel/core_pattern",
        "/proc/sys/kernel/sysrq",
        "/proc/sys/kernel/hostname",
        "/proc/sys/kernel/modprobe",
        "/proc/sys/vm/overcommit_memory",
        "/sys/kernel/uevent_helper",
        "/proc/modules",
    ]
    .iter()
    .map(|p| {
        (
            p.to_string(),
            std::fs::read_to_string(p).unwrap_or_default(),
        )
    })
    .collect()
}

/// The host's mount points.
fn host_mounts() -> BTreeSet<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
        .collect()
}

async fn host_probes(rt: &'static str) {
    let Some(h) = setup(rt, &[]).await else {
        return;
    };
    let gvisor = rt == "gvisor";
    let body = json!({});
    let mut v = h.victim(body.clone()).await;
    let settings = host_settings();

    // Host files: a marker file on the host and the host's /etc/shadow are not visible.
    let out = h.sh(&v, &format!("cat {}", h.host_file.display())).await;
    assert_ne!(out["result"]["exit_code"], 0, "{out}");
    // Every regular file once (a symlink is not followed: busybox's `grep -r` reads
    // /bin/busybox through each of its ~270 links, minutes under TCG), hidden ones and
    // /dev/shm included. A file the sandbox writes itself shows that the search works.
    let found = h
        .sh(
            &v,
            &format!(
                "echo {m} > /tmp/.self; \
                 find / \\( -path /proc -o -path /sys -o -path /dev \\) -prune -o -type f \
                   -exec grep -lF {m} {{}} + 2>/dev/null; \
                 find /dev/shm -type f -exec grep -lF {m} {{}} + 2>/dev/null; \
                 rm -f /tmp/.self",
                m = h.marker
            ),
        )
        .await;
    assert_eq!(
        found["stdout"], "/tmp/.self\n",
        "the host marker is inside, or the search does not work: {found}"
    );
    let host_shadow = std::fs::read_to_string("/etc/shadow").unwrap_or_default();
    let inside = h.sh(&v, "cat /etc/shadow 2>/dev/null").await;
    assert!(
        !host_shadow.is_empty() && inside["stdout"] != host_shadow.as_str(),
        "the host's /etc/shadow is readable inside"
    );
    v = h.next_victim("host_files", v, &body).await;

    // /proc/<pid>/root of every process leads to the sandbox's root, not the host's.
    let out = h
        .sh(
            &v,
            &format!("for p in /proc/[0-9]*; do cat $p/root{f} $p/root/../../..{f} $p/cwd/../../..{f} 2>/dev/null; done; ls /proc/self/root/", f = h.host_file.display()),
        )
        .await;
    let text = out["stdout"].as_str().unwrap();
    assert!(!text.contains(&h.marker), "{out}");
    assert!(text.contains("bin"), "{out}");
    v = h.next_victim("proc_root_traversal", v, &body).await;

    // /proc and /sys: no host kernel memory, no host kernel settings.
    let out = h
        .sh(
            &v,
            "[ \"$(head -c 4096 /proc/kcore 2>/dev/null | wc -c)\" -gt 0 ] && echo kcore-readable; \
             echo '|/tmp/evil %p' > /proc/sys/kernel/core_pattern 2>&1; \
             echo 1 > /proc/sys/kernel/sysrq 2>&1; echo 3 > /proc/sys/vm/drop_caches 2>&1; \
             echo 2 > /proc/sys/vm/overcommit_memory 2>&1; \
             echo /tmp/evil > /sys/kernel/uevent_helper 2>&1; \
             echo /tmp/evil > /proc/sys/kernel/modprobe 2>&1; \
             ls /sys/kernel 2>&1 | head -5; \
             grep -l evil /proc/sys/kernel/core_pattern /proc/sys/kernel/modprobe \
               /sys/kernel/uevent_helper 2>/dev/null | sed 's/^/CHANGED /'; true",
        )
        .await;
    eprintln!("[{rt}] proc/sys writes: {}", out["stdout"]);
    // Not even the sandbox's own kernel takes them (a microVM's guest kernel would run the
    // `|` core_pattern or modprobe program as root with every capability).
    let text = out["stdout"].as_str().unwrap();
    assert!(!text.contains("kcore-readable"), "{out}");
    assert!(!text.contains("CHANGED"), "{out}");
    assert_eq!(host_settings(), settings, "a host kernel setting changed");
    v = h.next_victim("proc_sys_writes", v, &body).await;

    // cgroups: whatever the sandbox writes, its host cgroup limits stay.
    let host_cg: Vec<(PathBuf, String)> = std::fs::read_dir("/sys/fs/cgroup")
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|c| {
            let dir = c.path().join("space").join(&v);
            std::fs::read_dir(&dir)
                .into_iter()
                .flatten()
                .flatten()
                .map(|f| f.path())
                .filter(|p| {
                    let n = p.file_name().unwrap().to_string_lossy().into_owned();
                    n.ends_with("limit_in_bytes")
                        || n == "pids.max"
                        || n == "cpu.cfs_quota_us"
                        || n == "cpuset.cpus"
                })
                .collect::<Vec<_>>()
        })
        .map(|p| {
            let s = std::fs::read_to_string(&p).unwrap_or_default();
            (p, s)
        })
        .collect();
    let out = h
        .sh(
            &v,
            "for f in $(find /sys/fs/cgroup -name 'memory.limit_in_bytes' -o -name pids.max -o -name memory.max -o -name cgroup.procs 2>/dev/null); do echo -1 > $f 2>/dev/null && echo wrote $f; done; \
             mkdir /sys/fs/cgroup/evil 2>&1; mount -t cgroup -o memory none /mnt 2>&1; echo 1 > /mnt/release_agent 2>&1; true",
        )
        .await;
    eprintln!("[{rt}] cgroup writes: {}", out["stdout"]);
    for (p, before) in &host_cg {
        assert_eq!(
            &std::fs::read_to_string(p).unwrap_or_default(),
            before,
            "{}",
            p.display()
        );
    }
    v = h.next_victim("cgroup_writes", v, &body).await;

    // mount, umount, unshare, chroot: nothing reaches the host's mount table or files.
    let mounts = host_mounts();
    let mut lines = Vec::new();
    for args in [
        vec!["mount_tmpfs", "/mnt"],
        vec!["unshare_user"],
        vec!["unshare_mnt_net"],
        vec!["chroot_escape", h.host_file.to_str().unwrap()],
    ] {
        lines.push(h.probe(&v, &args).await);
    }
    let escape = lines.last().unwrap();
    assert!(
        escape.contains("chroot_escape: err 2 ") || escape.contains("chroot: err"),
        "chroot escape opened the host file: {escape}"
    );
    let out = h.sh(&v, "umount -l / 2>&1; umount /.space/run 2>&1; mount -t proc proc /mnt 2>&1; cat /mnt/1/cmdline 2>&1 | tr '\\0' ' '; true").await;
    assert!(
        !out["stdout"].as_str().unwrap().contains("space serve"),
        "{out}"
    );
    let new: Vec<_> = host_mounts().difference(&mounts).cloned().collect();
    assert!(
        !new.iter().any(|m| m == "/mnt" || m == "/"),
        "a mount reached the host: {new:?}"
    );
    v = h.next_victim("mount_unshare_chroot", v, &body).await;

    // ptrace of PID 1 (the agent): refused, or confined to the sandbox's own agent,
    // which keeps working after the detach.
    let text = h.probe(&v, &["ptrace1"]).await;
    assert!(text.contains("ptrace1:"), "{text}");
    v = h.next_victim("ptrace_agent", v, &body).await;
    h.sh_ok(&v, "echo after ptrace").await;

    // Raw and packet sockets: refused under gVisor; in a microVM they see only `lo`.
    let raw = h.probe(&v, &["raw_inet"]).await;
    let packet = h.probe(&v, &["packet"]).await;
    if gvisor {
        assert!(raw.contains("raw_inet: err"), "{raw}");
        assert!(packet.contains("packet: err"), "{packet}");
    }
    let devs = h
        .sh_ok(&v, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")
        .await;
    assert_eq!(devs, "lo\n");
    v = h.next_victim("raw_packet_sockets", v, &body).await;

    // Network `none`: host loopback services, the API port, the host's address and
    // the metadata IP are unreachable.
    let local = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let any = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    local.set_nonblocking(true).unwrap();
    any.set_nonblocking(true).unwrap();
    let lport = local.local_addr().unwrap().port().to_string();
    let aport = any.local_addr().unwrap().port().to_string();
    let api_port =
        h.s.url
            .rsplit(':')
            .next()
            .unwrap()
            .trim_end_matches('/')
            .to_string();
    let host_ip = std::process::Command::new("hostname")
        .arg("-I")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .next()
                .map(str::to_string)
        })
        .unwrap_or_else(|| "10.0.2.2".into());
    for (ip, port) in [
        ("127.0.0.1", lport.as_str()),
        ("127.0.0.1", api_port.as_str()),
        (host_ip.as_str(), aport.as_str()),
        (host_ip.as_str(), api_port.as_str()),
        ("10.0.2.2", aport.as_str()),
        ("169.254.169.254", "80"),
    ] {
        let text = h.probe(&v, &["connect", ip, port]).await;
        assert!(
            text.contains("connect: err"),
            "{ip}:{port} reachable: {text}"
        );
    }
    let wget = h
        .sh(
            &v,
            &format!("wget -q -T 3 -O - http://127.0.0.1:{api_port}/healthz 2>&1; echo rc=$?"),
        )
        .await;
    assert!(
        !wget["stdout"].as_str().unwrap().contains("\"ok\""),
        "{wget}"
    );
    assert!(
        local.accept().is_err() && any.accept().is_err(),
        "a connection reached the host"
    );
    v = h.next_victim("host_network", v, &body).await;

    // Signals to host processes: a host `sleep` and the server survive kill -9 of their pids.
    let mut host_sleep = std::process::Command::new("sleep")
        .arg("600")
        .spawn()
        .unwrap();
    let spid = host_sleep.id().to_string();
    let server_pid = h.s.pid().unwrap().to_string();
    h.probe(&v, &["kill", &spid]).await;
    h.probe(&v, &["kill", &server_pid]).await;
    h.sh(&v, &format!("kill -9 {spid} {server_pid} -1 2>&1; true"))
        .await;
    assert!(
        host_sleep.try_wait().unwrap().is_none(),
        "the host process died"
    );
    host_sleep.kill().unwrap();
    host_sleep.wait().unwrap();
    v = h.next_victim("kill_host_pids", v, &body).await;

    // Kernel modules: a (junk) module is refused; the host's module list is unchanged.
    let text = h.probe(&v, &["init_module"]).await;
    assert!(text.contains("init_module: err"), "{text}");
    v = h.next_victim("kernel_module", v, &body).await;

    // Device nodes: /dev/mem made by hand is refused under gVisor (in a microVM it is
    // the guest's own memory).
    let text = h.probe(&v, &["mknod", "/tmp/mem", "1", "1"]).await;
    if gvisor {
        assert!(!text.contains("mknod: ok"), "{text}");
    }
    let text = h.probe(&v, &["open_by_handle"]).await;
    if gvisor {
        assert!(text.contains("open_by_handle: err"), "{text}");
    }
    v = h.next_victim("mknod_and_handles", v, &body).await;

    // keyctl, bpf, perf_event_open: a key never reaches the host's keyrings; gVisor
    // refuses bpf and system-wide perf.
    let key = h.probe(&v, &["keyctl", &h.marker]).await;
    let bpf = h.probe(&v, &["bpf"]).await;
    let perf = h.probe(&v, &["perf"]).await;
    let keys = std::fs::read_to_string("/proc/keys").unwrap_or_default();
    assert!(!keys.contains(&h.marker), "the key is on the host: {key}");
    if gvisor {
        assert!(bpf.contains("bpf: err"), "{bpf}");
        assert!(perf.contains("perf: err"), "{perf}");
    }
    v = h.next_victim("keyctl_bpf_perf", v, &body).await;

    // Hostname and clock: the host's stay.
    let host_name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let name = format!("evil{}", &h.marker[12..20]);
    h.probe(&v, &["sethostname", &name]).await;
    let t = h.probe(&v, &["settime"]).await;
    if gvisor {
        assert!(t.contains("settime: err"), "{t}");
    }
    assert_eq!(
        std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap(),
        host_name
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(now > 1_700_000_000, "the host clock moved: {now}");
    v = h.next_victim("hostname_and_clock", v, &body).await;

    // The agent's token is nowhere a command can read it.
    let store = space_store::SqliteStore::open(&h.s.data_dir().join("space.db")).unwrap();
    let token = store.get_sandbox(&v).unwrap().unwrap().agent_token;
    let out = h
        .sh(
            &v,
            "cat /proc/1/environ /proc/1/cmdline /proc/cmdline /proc/*/environ 2>/dev/null; \
             ls -la /.space/run 2>&1; cat /.space/run/* 2>/dev/null; \
             cat /proc/1/task/*/environ 2>/dev/null; true",
        )
        .await;
    let text = out["stdout"].as_str().unwrap();
    if text.contains(&token) {
        let wheres = h
            .sh(&v, &format!("grep -l {token} /proc/cmdline /proc/1/environ /proc/1/cmdline /.space/run/* 2>/dev/null; true"))
            .await;
        panic!(
            "[{rt}] the agent token is readable inside the sandbox, in: {}",
            wheres["stdout"]
        );
    }
    v = h.next_victim("agent_token", v, &body).await;

    // The server's environment (a marker variable) is nowhere inside.
    let out = h
        .sh(
            &v,
            "env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; true",
        )
        .await;
    assert!(
        !out["stdout"].as_str().unwrap().contains(&h.marker),
        "{out}"
    );
    assert!(!out["stdout"]
        .as_str()
        .unwrap()
        .contains("SPACE_HOSTILE_SECRET"));
    v = h.next_victim("server_env", v, &body).await;

    // Crashing the sandbox's kernel (sysrq `c`, panic on oops): refused on both runtimes
    // (gVisor has no sysrq-trigger; the microVM's agent made it and /proc/sys read-only),
    // so the victim keeps working.
    let out = h
        .sh(
            &v,
            "echo c > /proc/sysrq-trigger 2>&1; echo 1 > /proc/sys/kernel/panic 2>&1; echo rc=$?",
        )
        .await;
    eprintln!("[{rt}] sysrq crash: {out}");
    let (st, echo) = tokio::time::timeout(
        Duration::from_secs(60),
        h.try_cmd(&v, json!({"argv": ["echo", "ok"], "wait": true})),
    )
    .await
    .unwrap_or((0, Value::Null));
    assert_eq!((st, echo["stdout"].as_str()), (201, Some("ok\n")), "{echo}");
    let (_, sb) = h.s.get(&format!("/v1/sandboxes/{v}")).await;
    assert_eq!(sb["state"], "running", "{sb}");
    v = h.next_victim("guest_kernel_crash", v, &body).await;

    assert_eq!(host_settings(), settings, "a host kernel setting changed");
    h.finish(&[&v]).await;
}

// ─────────────────────────────── API abuse ───────────────────────────────

/// A tar with a symlink entry and then a file written through it.
fn tar_through_symlink(link: &str, target: &str) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut hd = tar::Header::new_gnu();
    hd.set_entry_type(tar::EntryType::Symlink);
    hd.set_size(0);
    hd.set_mode(0o777);
    b.append_link(&mut hd, link, target).unwrap();
    let data = b"pwned";
    let mut hd = tar::Header::new_gnu();
    hd.set_size(data.len() as u64);
    hd.set_mode(0o644);
    hd.set_entry_type(tar::EntryType::Regular);
    b.append_data(&mut hd, format!("{link}/pwn"), &data[..])
        .unwrap();
    let mut hd = tar::Header::new_gnu();
    hd.set_entry_type(tar::EntryType::Link);
    hd.set_size(0);
    b.append_link(&mut hd, "hard", "/proc/1/environ").unwrap();
    b.into_inner().unwrap()
}

async fn api_abuse(rt: &'static str) {
    let Some(h) = setup(rt, &[]).await else {
        return;
    };
    let v = h.victim(json!({})).await;
    let files = format!("/v1/sandboxes/{v}/files");
    let cmds = format!("/v1/sandboxes/{v}/commands");
    let before = h.snapshot().await;
    let get = reqwest::Method::GET;
    let post = reqwest::Method::POST;
    let put = reqwest::Method::PUT;

    // Symlinks to the host-looking places and /proc, used through every file call.
    h.sh_ok(
        &v,
        &format!(
            "ln -s /proc/1/root /tmp/r1; ln -s /proc/self/cwd /tmp/r2; ln -s {} /tmp/hostfile; ln -s /.space /tmp/dotspace; mkdir -p /tmp/d",
            h.host_file.display()
        ),
    )
    .await;
    for p in [
        "/tmp/r1/.space/run/agent.sock",
        "/tmp/r2/proc/1/environ",
        "/tmp/dotspace/run/x",
    ] {
        let (st, t) = h
            .raw(get.clone(), &format!("{files}?path={p}"), None, None)
            .await;
        assert!((400..500).contains(&st), "{p}: {st} {t}");
    }
    let (st, t) = h
        .raw(
            get.clone(),
            &format!("{files}?path=/tmp/hostfile"),
            None,
            None,
        )
        .await;
    assert_eq!(st, 404, "an absolute symlink to a host path: {t}");
    assert!(!t.contains(&h.marker));
    for (from, to) in [
        ("/tmp/d", "/tmp/dotspace/run/d"),
        ("/tmp/dotspace/run/agent.sock", "/tmp/stolen"),
    ] {
        let (st, t) = h
            .raw(
                post.clone(),
                &format!("{files}/move"),
                Some(json!({"from": from, "to": to}).to_string().into_bytes()),
                Some("application/json"),
            )
            .await;
        assert!((400..500).contains(&st), "move {from} {to}: {st} {t}");
    }
    let (st, t) = h
        .raw(
            post.clone(),
            &format!("{files}/mkdir"),
            Some(
                json!({"path": "/tmp/r1/proc/sys/evil"})
                    .to_string()
                    .into_bytes(),
            ),
            Some("application/json"),
        )
        .await;
    assert!((400..500).contains(&st), "mkdir through /proc: {st} {t}");
    h.healthy("file_api_symlinks", Some(&v)).await;

    // Tar: a symlink entry and a file through it; a hard link to /proc/1/environ.
    for (link, target) in [
        ("l1", "/.space/run"),
        ("l2", "/proc/1/root/.space/run"),
        ("l3", "/proc/sys/kernel"),
    ] {
        let (st, t) = h
            .raw(
                put.clone(),
                &format!("{files}?path=/tmp/x{link}&format=tar"),
                Some(tar_through_symlink(link, target)),
                None,
            )
            .await;
        assert!((400..500).contains(&st), "tar via {target}: {st} {t}");
    }
    let out = h
        .sh(&v, "ls /.space/run; cat /proc/sys/kernel/hostname")
        .await;
    assert!(!out["stdout"].as_str().unwrap().contains("pwn"), "{out}");
    let run_dir = h.s.data_dir().join("sandboxes").join(&v).join("run");
    assert!(
        !run_dir.join("pwn").exists(),
        "a tar entry reached the host run dir"
    );
    h.healthy("tar_symlink_then_write", Some(&v)).await;

    // Oversized JSON bodies: 413, at every JSON endpoint.
    let big = |mib: usize| {
        let mut b = br#"{"name":"x","template":"busybox","labels":{"a":""#.to_vec();
        b.extend(std::iter::repeat_n(b'x', mib << 20));
        b.extend(br#""}}"#);
        b
    };
    // Recipes may carry files inline, so their limit is 32 MiB.
    for (m, p, mib) in [
        (post.clone(), "/v1/sandboxes".to_string(), 2),
        (post.clone(), cmds.clone(), 2),
        (post.clone(), "/v1/templates".to_string(), 40),
        (post.clone(), format!("{files}/mkdir"), 2),
        (post.clone(), format!("{files}/move"), 2),
        (post.clone(), format!("/v1/sandboxes/{v}/keepalive"), 2),
        (
            post.clone(),
            format!("{cmds}/cmd_aaaaaaaaaaaaaaaaaaaa/signal"),
            2,
        ),
    ] {
        h.expect_4xx(&format!("oversized {p}"), m, &p, Some(big(mib)), &[413])
            .await;
    }
    assert_eq!(h.snapshot().await, before);
    h.healthy("oversized_json", Some(&v)).await;

    // Deeply nested JSON: refused, no stack overflow.
    let deep = format!("{}{}", "[".repeat(200_000), "]".repeat(200_000)).into_bytes();
    let deep_obj = {
        let mut s = String::from(r#"{"template":"busybox","labels":"#);
        s.push_str(&r#"{"a":"#.repeat(100_000));
        s.push('1');
        s.push_str(&"}".repeat(100_001));
        s.into_bytes()
    };
    for p in [
        "/v1/sandboxes".to_string(),
        cmds.clone(),
        "/v1/templates".into(),
        format!("{files}/move"),
    ] {
        h.expect_4xx(
            &format!("deep {p}"),
            post.clone(),
            &p,
            Some(deep.clone()),
            &[400, 413, 422],
        )
        .await;
        h.expect_4xx(
            &format!("deep object {p}"),
            post.clone(),
            &p,
            Some(deep_obj.clone()),
            &[400, 413, 422],
        )
        .await;
    }
    assert_eq!(h.snapshot().await, before);
    h.healthy("deeply_nested_json", Some(&v)).await;

    // Huge strings: argv, env, labels, paths, ids, signal names.
    let long = "y".repeat(300_000);
    let many_args: Vec<String> = (0..5000).map(|i| i.to_string()).collect();
    let many_env: serde_json::Map<String, Value> =
        (0..2000).map(|i| (format!("V{i}"), json!("x"))).collect();
    let many_labels: serde_json::Map<String, Value> =
        (0..5000).map(|i| (format!("l{i}"), json!("x"))).collect();
    for (what, b) in [
        ("argv element", json!({"argv": ["echo", long]})),
        ("argv count", json!({"argv": many_args})),
        ("env value", json!({"argv": ["true"], "env": {"A": long}})),
        ("env count", json!({"argv": ["true"], "env": many_env})),
        ("cwd", json!({"argv": ["true"], "cwd": long})),
        ("user", json!({"argv": ["true"], "user": long})),
        ("argv NUL", json!({"argv": ["echo", "a\u{0}b"]})),
    ] {
        h.expect_4xx(
            what,
            post.clone(),
            &cmds,
            Some(b.to_string().into_bytes()),
            &[400, 413, 422],
        )
        .await;
    }
    for (what, b) in [
        (
            "label value",
            json!({"template": "busybox", "labels": {"a": long}}),
        ),
        (
            "label count",
            json!({"template": "busybox", "labels": many_labels}),
        ),
        (
            "label key",
            json!({"template": "busybox", "labels": {long.clone(): "x"}}),
        ),
        ("template name", json!({"template": long})),
        (
            "runtime name",
            json!({"template": "busybox", "runtime": long}),
        ),
        (
            "sandbox env",
            json!({"template": "busybox", "env": {"A": long}}),
        ),
    ] {
        h.expect_4xx(
            what,
            post.clone(),
            "/v1/sandboxes",
            Some(b.to_string().into_bytes()),
            &[400, 404, 413, 422],
        )
        .await;
    }
    let long_path = format!("/{}", "a/".repeat(3000));
    let long_id = "sb_".to_string() + &"z".repeat(20_000);
    for (what, p) in [
        ("path", format!("{files}?path={long_path}")),
        (
            "path component",
            format!("{files}/stat?path=/{}", "c".repeat(300)),
        ),
        ("sandbox id", format!("/v1/sandboxes/{long_id}")),
        ("command id", format!("{cmds}/cmd_{}", "q".repeat(20_000))),
        (
            "operation id",
            format!("/v1/operations/op_{}", "q".repeat(20_000)),
        ),
        (
            "label filter",
            format!("/v1/sandboxes?label={}", "k".repeat(20_000)),
        ),
    ] {
        h.expect_4xx(what, get.clone(), &p, None, &[400, 404, 414, 431])
            .await;
    }
    let sig_cmd = start_cmd(&h, &v, json!({"argv": ["sleep", "1000"]})).await;
    for sig in [
        json!(long),
        json!(-1),
        json!(65),
        json!(u64::MAX),
        json!("SIGNOPE"),
        json!([1]),
    ] {
        h.expect_4xx(
            "signal",
            post.clone(),
            &format!("{cmds}/{sig_cmd}/signal"),
            Some(json!({"signal": sig}).to_string().into_bytes()),
            &[400, 422],
        )
        .await;
    }
    assert_eq!(h.snapshot().await, before);
    h.healthy("huge_strings", Some(&v)).await;

    // Invalid UTF-8 in bodies, query strings and ids.
    let mut bad = br#"{"argv":["echo",""#.to_vec();
    bad.extend([0xff, 0xfe, 0xc3]);
    bad.extend(br#""]}"#);
    h.expect_4xx(
        "utf8 argv",
        post.clone(),
        &cmds,
        Some(bad.clone()),
        &[400, 422],
    )
    .await;
    h.expect_4xx(
        "lone surrogate",
        post.clone(),
        &cmds,
        Some(br#"{"argv":["echo","\ud800"]}"#.to_vec()),
        &[400, 422],
    )
    .await;
    h.expect_4xx(
        "utf8 create",
        post.clone(),
        "/v1/sandboxes",
        Some(bad),
        &[400, 422],
    )
    .await;
    for p in [
        format!("{files}?path=/tmp/%FF%FE"),
        format!("{files}/stat?path=/tmp/%C3"),
    ] {
        h.expect_4xx(&format!("utf8 {p}"), get.clone(), &p, None, &[400, 404])
            .await;
    }
    // A label filter decodes lossily: it matches nothing.
    let (st, text) = h
        .raw(get.clone(), "/v1/sandboxes?label=%FF=%FE", None, None)
        .await;
    assert!(
        st == 400 || (st == 200 && text.contains(r#""sandboxes":[]"#)),
        "{st} {text}"
    );
    // Invalid UTF-8 in a path segment is refused by axum's `Path` extractor before
    // our handlers run: a 400 in our JSON error form all the same.
    for p in [
        "/v1/sandboxes/sb_%FF%FE".to_string(),
        format!("{cmds}/cmd_%FF"),
    ] {
        let (st, text) = h.raw(get.clone(), &p, None, None).await;
        assert_eq!(st, 400, "utf8 {p}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
        assert_eq!(v["error"]["code"], "invalid_request", "{text}");
    }
    h.expect_4xx(
        "not json",
        post.clone(),
        &cmds,
        Some(b"\x00\x01garbage".to_vec()),
        &[400, 415, 422],
    )
    .await;
    assert_eq!(h.snapshot().await, before);
    h.healthy("invalid_utf8", Some(&v)).await;

    // Absurd numbers: resources, TTLs, timeouts, pty sizes, modes and owners.
    for (what, b) in [
        (
            "vcpus",
            json!({"template": "busybox", "resources": {"vcpus": u32::MAX}}),
        ),
        (
            "memory",
            json!({"template": "busybox", "resources": {"memory_mib": u64::MAX}}),
        ),
        (
            "disk",
            json!({"template": "busybox", "resources": {"disk_mib": u64::MAX}}),
        ),
        (
            "pids",
            json!({"template": "busybox", "resources": {"pids": u64::MAX}}),
        ),
        (
            "zero memory",
            json!({"template": "busybox", "resources": {"memory_mib": 0}}),
        ),
        (
            "negative vcpus",
            json!({"template": "busybox", "resources": {"vcpus": -1}}),
        ),
        (
            "float vcpus",
            json!({"template": "busybox", "resources": {"vcpus": 1.5}}),
        ),
        (
            "huge vcpus",
            json!({"template": "busybox", "resources": {"vcpus": 1e30}}),
        ),
        (
            "ttl",
            json!({"template": "busybox", "ttl_seconds": u64::MAX}),
        ),
        (
            "idle",
            json!({"template": "busybox", "idle_timeout_seconds": u64::MAX}),
        ),
    ] {
        h.expect_4xx(
            what,
            post.clone(),
            "/v1/sandboxes",
            Some(b.to_string().into_bytes()),
            &[400, 422],
        )
        .await;
    }
    for (what, b) in [
        (
            "timeout",
            json!({"argv": ["true"], "timeout_seconds": u64::MAX}),
        ),
        (
            "timeout float",
            json!({"argv": ["true"], "timeout_seconds": 1e20}),
        ),
        (
            "timeout negative",
            json!({"argv": ["true"], "timeout_seconds": -1}),
        ),
        (
            "pty",
            json!({"argv": ["true"], "pty": {"rows": 65535, "cols": 65535}}),
        ),
        (
            "pty overflow",
            json!({"argv": ["true"], "pty": {"rows": 70000, "cols": 1}}),
        ),
    ] {
        h.expect_4xx(
            what,
            post.clone(),
            &cmds,
            Some(b.to_string().into_bytes()),
            &[400, 422],
        )
        .await;
    }
    for (what, b) in [
        ("mkdir mode", json!({"path": "/tmp/m", "mode": u64::MAX})),
        ("mkdir uid", json!({"path": "/tmp/m", "uid": -1})),
    ] {
        h.expect_4xx(
            what,
            post.clone(),
            &format!("{files}/mkdir"),
            Some(b.to_string().into_bytes()),
            &[400, 422],
        )
        .await;
    }
    h.expect_4xx(
        "ttl keepalive",
        post.clone(),
        &format!("/v1/sandboxes/{v}/keepalive"),
        Some(json!({"ttl_seconds": u64::MAX}).to_string().into_bytes()),
        &[400, 422],
    )
    .await;
    assert_eq!(h.snapshot().await, before);
    h.healthy("absurd_numbers", Some(&v)).await;

    // Negative and overflowing query values.
    let (st, c) = h
        .try_cmd(&v, json!({"argv": ["echo", "hi"], "wait": true}))
        .await;
    assert_eq!(st, 201, "{c}");
    let done = c["id"].as_str().unwrap().to_string();
    for q in [
        format!("{cmds}/{done}/output?offset=-1"),
        format!("{cmds}/{done}/output?offset=18446744073709551616"),
        format!("{cmds}/{done}/output?offset=1e3"),
        format!("{cmds}/{done}/output?follow=maybe"),
        format!("{cmds}/{done}/output?stream=all"),
        format!("{cmds}/{done}?wait=-5s"),
        format!("{cmds}/{done}?wait=99999999999999999999999s"),
        format!("{cmds}/{done}?wait=1x"),
        format!("{files}/list?path=/tmp&depth=-1"),
        format!("{files}/list?path=/tmp&depth=4294967296"),
        format!("{files}/list?path=/tmp&depth=0"),
        format!("{files}?path=/tmp/q&uid=-1"),
        "/v1/operations?limit=-1".to_string(),
        "/v1/events?after=-99999999999999999999999".to_string(),
        format!("{cmds}/{done}/output?offset=1&offset=2"),
        format!("{files}?path=/tmp&unknown=1"),
    ] {
        h.expect_4xx(&q, get.clone(), &q, None, &[400]).await;
    }
    // An offset past the end is not an error, just nothing.
    let (st, text) = h
        .raw(
            get.clone(),
            &format!("{cmds}/{done}/output?offset={}", u64::MAX),
            None,
            None,
        )
        .await;
    assert!(st == 200 || st == 400 || st == 416, "{st} {text}");
    assert!(!text.contains("\"data\""), "{text}");
    assert_eq!(h.snapshot().await, before);
    h.healthy("negative_and_overflowing_queries", Some(&v))
        .await;

    // WebSocket garbage: bad controls, input to a non-interactive command, an
    // oversized message, and a plain GET without the upgrade.
    let (st, text) = h
        .raw(get.clone(), &format!("{cmds}/{sig_cmd}/attach"), None, None)
        .await;
    assert!(
        (400..500).contains(&st),
        "attach without upgrade: {st} {text}"
    );
    let cat = start_cmd(&h, &v, json!({"argv": ["cat"], "stdin": true})).await;
    for cid in [&cat, &sig_cmd] {
        let mut ws = h.s.client().attach(&v, cid, None).await.expect("attach");
        for m in [
            Message::Text("not json".into()),
            Message::Text(r#"{"type":"resize","rows":-1,"cols":99999999}"#.into()),
            Message::Text(r#"{"type":"signal","signal":"NOPE"}"#.into()),
            Message::Text(r#"{"type":"bogus"}"#.into()),
            Message::Text("[".repeat(100_000)),
            Message::Binary(vec![0xff; 1000]),
            Message::Binary(vec![0; 2 << 20]),
        ] {
            if ws.send(m).await.is_err() {
                break;
            }
        }
        // The server answers (an error or a close), it does not hang.
        let _ = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(Ok(m)) = ws.next().await {
                if m.is_close() {
                    break;
                }
            }
        })
        .await;
    }
    let (_, c) = h.s.get(&format!("{cmds}/{sig_cmd}")).await;
    assert!(
        c["state"] == "running",
        "garbage on attach changed a command: {c}"
    );
    assert_eq!(h.snapshot().await, before);
    h.healthy("websocket_garbage", Some(&v)).await;

    // Thousands of commands at once in one sandbox: past the per-sandbox limit of
    // running commands each gets a 429 with the reason; none is a 5xx or hangs.
    for cid in [&cat, &sig_cmd] {
        h.s.post(&format!("{cmds}/{cid}/signal"), json!({"signal": "KILL"}))
            .await;
        wait_cmd(&h, &v, cid, Duration::from_secs(60)).await;
    }
    let n = if rt == "microvm" { 300 } else { 1500 };
    let answers: Vec<(u16, Value)> = futures::stream::iter(0..n)
        .map(|_| {
            let cmds = cmds.clone();
            let h = &h;
            async move { h.s.post(&cmds, json!({"argv": ["sleep", "600"]})).await }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    let started: Vec<String> = answers
        .iter()
        .filter(|(st, _)| *st == 201)
        .map(|(_, c)| c["id"].as_str().unwrap().to_string())
        .collect();
    let limited: Vec<&Value> = answers
        .iter()
        .filter(|(st, _)| *st == 429)
        .map(|(_, v)| v)
        .collect();
    eprintln!(
        "[{rt}] {n} commands at once: {} started, {} refused with 429",
        started.len(),
        limited.len()
    );
    assert_eq!(
        started.len() + limited.len(),
        n,
        "a 5xx or hang: {answers:?}"
    );
    // Exactly the limit: the check and the insert of each create are one step.
    assert_eq!(
        started.len(),
        64,
        "commands running at once in one sandbox whose limit is 64"
    );
    assert!(
        limited.iter().all(|v| v["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("limit")),
        "{limited:?}"
    );
    h.healthy("thousands_of_commands (during)", None).await;
    for cid in &started {
        let (st, r) =
            h.s.post(&format!("{cmds}/{cid}/signal"), json!({"signal": "KILL"}))
                .await;
        assert_eq!(st, 200, "{r}");
    }
    for cid in &started {
        wait_cmd(&h, &v, cid, Duration::from_secs(120)).await;
    }
    assert_eq!(h.snapshot().await, before);
    h.healthy("thousands_of_commands", Some(&v)).await;

    h.finish(&[&v]).await;
}

// ──────────── tenant trees on the host: templates (issue 11, points 3, 4, 5, 10) ────────────
//
// Everything here is about what the *host* does with a tree a tenant filled (a sandbox
// turned into a template, a recipe's files, steps and imports): it never follows a link the
// tenant made, never lets tenant content become a setuid file another host user can reach,
// and never stores more than the tenant's quota allows.

/// Type, mode, size, content (or link target) of every entry below `dir`, never following a
/// link: what "the host tree is untouched" compares.
fn host_tree(dir: &std::path::Path) -> BTreeSet<(String, u32, u64, Vec<u8>)> {
    fn walk(dir: &std::path::Path, rel: &str, out: &mut BTreeSet<(String, u32, u64, Vec<u8>)>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let path = e.path();
            let name = format!("{rel}/{}", e.file_name().to_string_lossy());
            let m = std::fs::symlink_metadata(&path).unwrap();
            let content = if m.file_type().is_symlink() {
                std::fs::read_link(&path)
                    .unwrap()
                    .into_os_string()
                    .into_encoded_bytes()
            } else if m.is_file() {
                std::fs::read(&path).unwrap()
            } else {
                Vec::new()
            };
            out.insert((name.clone(), m.mode(), m.len(), content));
            if m.is_dir() {
                walk(&path, &name, out);
            }
        }
    }
    let mut out = BTreeSet::new();
    let m = std::fs::symlink_metadata(dir).unwrap();
    out.insert((".".into(), m.mode(), 0, Vec::new()));
    walk(dir, "", &mut out);
    out
}

/// A host directory with the files `snapshot-template` used to write (and a few more), for
/// links made inside a sandbox to point at.
fn decoy_dir(marker: &str) -> tempfile::TempDir {
    let d = tempfile::Builder::new()
        .prefix("space-decoy")
        .tempdir_in("/tmp")
        .unwrap();
    for f in ["hosts", "hostname", "resolv.conf", "passwd"] {
        std::fs::write(d.path().join(f), format!("decoy {f} {marker}\n")).unwrap();
    }
    for sub in ["run", "bin", "tmp"] {
        std::fs::create_dir(d.path().join(sub)).unwrap();
        std::fs::write(d.path().join(sub).join("keep"), marker).unwrap();
    }
    d
}

/// The host directory of the current version of recipe-built template `name`.
fn template_rootfs(name: &str) -> PathBuf {
    let dir = common::templates_dir().join(name);
    let v = std::fs::read_to_string(dir.join("current")).unwrap();
    let meta: Value = serde_json::from_slice(
        &std::fs::read(dir.join("versions").join(v.trim()).join("template.json")).unwrap(),
    )
    .unwrap();
    common::templates_dir()
        .join(".layers")
        .join(meta["layer"].as_str().unwrap())
        .join("rootfs")
}

/// Whether an unprivileged host user (nobody) can reach `path` at all.
fn nobody_can_reach(path: &std::path::Path) -> bool {
    let out = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg("stat")
        .arg(path)
        .output()
        .expect("setpriv (util-linux)");
    out.status.success()
}

/// `POST …/snapshot-template` and the finished operation.
async fn snapshot_op(h: &Hostile, sb: &str, name: &str) -> Value {
    let (st, op) =
        h.s.post(
            &format!("/v1/sandboxes/{sb}/snapshot-template"),
            json!({ "name": name }),
        )
        .await;
    assert_eq!(st, 202, "{op}");
    h.s.wait_op(op["id"].as_str().unwrap()).await
}

/// Deletes template `name` and the cached layers its builds made (the cache is shared by
/// every test server; these layers hold this run's markers, so nothing else uses them).
async fn delete_template(h: &Hostile, name: &str) {
    let resp =
        h.s.req(reqwest::Method::DELETE, &format!("/v1/templates/{name}"))
            .send()
            .await
            .unwrap();
    assert_eq!(resp.status(), 204, "{}", resp.text().await.unwrap());
    remove_layers_of(name);
}

fn remove_layers_of(name: &str) {
    let layers = common::templates_dir().join(".layers");
    for e in std::fs::read_dir(&layers).into_iter().flatten().flatten() {
        let Ok(meta) = std::fs::read(e.path().join("layer.json")) else {
            continue;
        };
        let meta: Value = serde_json::from_slice(&meta).unwrap_or_default();
        if meta["template"] == name {
            std::fs::remove_dir_all(e.path()).unwrap();
            let lock = layers.join(format!(".{}.lock", e.file_name().to_string_lossy()));
            let _ = std::fs::remove_file(lock);
        }
    }
    let _ = std::fs::remove_file(common::templates_dir().join(format!(".{name}.lock")));
}

/// Whether a build holds the lock of layer `key` (another test's build in progress, in the
/// shared cache).
fn layer_locked(key: &str) -> bool {
    use std::os::fd::AsRawFd;
    let lock = common::templates_dir()
        .join(".layers")
        .join(format!(".{key}.lock"));
    let Ok(f) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(lock)
    else {
        return false;
    };
    // SAFETY: a valid descriptor owned by `f`.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) != 0 }
}

/// The layer key of a `.tmp-<key>-<hex>` name (or a path inside one).
fn tmp_key(name: &str) -> Option<&str> {
    let rest = &name[name.find(".tmp-")? + 5..];
    Some(rest.split_once('-')?.0)
}

/// No half-made layer (`.tmp-…`) and no step disk mounted in one is left in the shared layer
/// cache: what is there and not locked by a build in progress is a leftover.
fn assert_no_partial_layers(since: &BTreeSet<String>) {
    let layers = common::templates_dir().join(".layers");
    let now: BTreeSet<String> = std::fs::read_dir(&layers)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp-"))
        .collect();
    let left: Vec<_> = now
        .difference(since)
        .filter(|n| !tmp_key(n).is_some_and(layer_locked))
        .collect();
    assert!(left.is_empty(), "half-made layers remain: {left:?}");
    let prefix = layers.join(".tmp-").to_string_lossy().into_owned();
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    for line in mounts.lines() {
        let Some(point) = line.split(' ').nth(4) else {
            continue;
        };
        if point.starts_with(&prefix) {
            assert!(
                tmp_key(point).is_some_and(layer_locked),
                "a step's disk is still mounted at {point}"
            );
        }
    }
}

fn partial_layers() -> BTreeSet<String> {
    std::fs::read_dir(common::templates_dir().join(".layers"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp-"))
        .collect()
}

/// `snapshot-template` of a sandbox whose tree is full of traps for the host: its /etc (and
/// /run) are links to a host directory (the reproduction), /etc's files are links to host
/// files or hard links to other files, a loop keeps swapping a link in for /etc/hosts, and
/// there are devices, a fifo, a socket, setuid/setgid root binaries and awkward names. The
/// host directory and file stay exactly as they were; the template holds a real /etc with
/// the sandbox's network files, none of the special files, and its setuid binary is out of
/// reach of other host users. A sparse file far past the sandbox's disk quota fails the
/// snapshot clearly instead of filling the host.
async fn snapshot_traps(rt: &'static str) {
    let Some(h) = setup(rt, &[]).await else {
        return;
    };
    let decoy = decoy_dir(&h.marker);
    let d = decoy.path().display().to_string();
    let hf = h.host_file.display().to_string();
    let host_before = (
        host_tree(decoy.path()),
        std::fs::read(&h.host_file).unwrap(),
    );
    let busybox_len = std::fs::metadata(common::templates_dir().join("busybox/rootfs/bin/busybox"))
        .unwrap()
        .len();
    let partial = partial_layers();
    let body = json!({"resources": {"disk_mib": 64}});
    let v = h.victim(body.clone()).await;
    let name = format!("hostile-snap-{}", &h.marker[12..24]);

    // Round 1: /etc is a real directory whose files are traps, swapped while the copy runs.
    h.sh_ok(
        &v,
        &format!(
            "set -e; mkdir -p /data; cd /data
             ln -s {hf} host-file-link; ln -s {d} host-dir-link; ln -s {d}/hosts etc-hosts-link
             echo hard > f; ln f hard
             mkfifo fifo; mknod null c 1 3 || true; {PROBE} unix_socket /data/sock || true
             cp /bin/busybox suid; chmod 6755 suid; cp /bin/busybox sgid; chmod 2755 sgid
             # (not a hard link to /bin/busybox itself: gVisor's overlay copies the running
             # shell's binary up for that, and every later exec of it crashes)
             touch ... 'new
line' \"$(printf '\\377')\" ' lead' '\\back'
             rm -f /etc/hosts /etc/hostname /etc/resolv.conf
             ln -s {d}/hosts /etc/hosts; ln -s {hf} /etc/hostname; ln suid /etc/resolv.conf
             (while :; do ln -sfn {d}/passwd /etc/hosts.new && mv -f /etc/hosts.new /etc/hosts;
                          echo f > /etc/hosts.new && mv -f /etc/hosts.new /etc/hosts; done) \
               >/dev/null 2>&1 </dev/null &
             echo started"
        ),
    )
    .await;
    let op = snapshot_op(&h, &v, &name).await;
    assert_eq!(op["status"], "succeeded", "{op}");
    assert_eq!(
        (
            host_tree(decoy.path()),
            std::fs::read(&h.host_file).unwrap()
        ),
        host_before,
        "the host directory or file changed"
    );
    let root = template_rootfs(&name);
    let etc = std::fs::symlink_metadata(root.join("etc")).unwrap();
    assert!(etc.is_dir(), "the template's /etc is a directory");
    for (f, want) in [("hostname", "localhost\n"), ("resolv.conf", "")] {
        let m = std::fs::symlink_metadata(root.join("etc").join(f)).unwrap();
        assert!(
            m.is_file() && m.nlink() == 1,
            "/etc/{f} is a fresh file: {m:?}"
        );
        assert_eq!(
            std::fs::read_to_string(root.join("etc").join(f)).unwrap(),
            want
        );
    }
    assert!(std::fs::read_to_string(root.join("etc/hosts"))
        .unwrap()
        .contains("localhost"));
    assert_eq!(
        std::fs::metadata(root.join("data/suid")).unwrap().len(),
        busybox_len,
        "the file hard-linked to /etc/resolv.conf was not written through"
    );
    for special in ["fifo", "null", "sock"] {
        assert!(
            std::fs::symlink_metadata(root.join("data").join(special)).is_err(),
            "/data/{special} is in the template"
        );
    }
    assert_eq!(
        std::fs::read_link(root.join("data/host-file-link")).unwrap(),
        h.host_file,
        "a link stays a link, never followed"
    );
    for f in ["suid", "sgid"] {
        let path = root.join("data").join(f);
        assert!(
            !nobody_can_reach(&path),
            "another host user can reach the setuid/setgid file {}",
            path.display()
        );
    }
    // A sandbox of the template sees its own files.
    let child =
        h.s.create_with(json!({"template": name, "runtime": rt}))
            .await;
    let out = h
        .sh_ok(
            &child,
            "cat /etc/hostname; cat /data/hard; ls /data | wc -l",
        )
        .await;
    assert!(out.starts_with("localhost\nhard\n"), "{out}");
    h.s.destroy(&child).await;
    h.healthy("snapshot_links_in_etc", Some(&v)).await;

    // Round 2, the reproduction: /etc and /run are links to host directories.
    h.sh_ok(
        &v,
        &format!(
            "kill %1 2>/dev/null; rm -rf /etc && ln -s {d} /etc; rm -rf /run && ln -s {d}/run /run; echo ok"
        ),
    )
    .await;
    let op = snapshot_op(&h, &v, &name).await;
    assert_eq!(op["status"], "succeeded", "{op}");
    assert_eq!(
        (
            host_tree(decoy.path()),
            std::fs::read(&h.host_file).unwrap()
        ),
        host_before,
        "the host directory or file changed"
    );
    let root = template_rootfs(&name);
    for dir in ["etc", "run"] {
        assert!(
            std::fs::symlink_metadata(root.join(dir)).unwrap().is_dir(),
            "/{dir} is a real directory in the template"
        );
    }
    assert_eq!(
        std::fs::read_to_string(root.join("etc/hostname")).unwrap(),
        "localhost\n"
    );
    h.healthy("snapshot_etc_is_a_host_link", Some(&v)).await;

    // Round 3: a sparse file far past the disk quota fails the snapshot, and nothing is left.
    let big = h.victim(body).await;
    h.sh_ok(
        &big,
        "dd if=/dev/zero of=/sparse bs=1 count=0 seek=100G 2>&1 && ls -l /sparse",
    )
    .await;
    let op = snapshot_op(&h, &big, &format!("{name}-sparse")).await;
    assert_eq!(op["status"], "failed", "{op}");
    let msg = op["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("disk quota"), "the error says why: {op}");
    assert!(
        !common::templates_dir()
            .join(format!("{name}-sparse"))
            .exists(),
        "no template was made"
    );
    assert_no_partial_layers(&partial);
    h.healthy("snapshot_sparse_past_quota", Some(&big)).await;

    delete_template(&h, &name).await;
    h.finish(&[&v, &big]).await;
}

/// Template builds: hostile steps, recipe files, imports and Debian packages. Builds run in
/// gVisor whatever the sandbox runtime, so these run once.
mod template_builds {
    use super::*;
    use common::TestServer;

    /// Posts a recipe (202) and waits for the build; the operation and its log.
    async fn build(s: &TestServer, recipe: Value) -> (Value, String) {
        let (status, op) = s.post("/v1/templates", recipe.clone()).await;
        assert_eq!(status, 202, "{op}");
        let id = op["id"].as_str().unwrap().to_string();
        let op = s.wait_op(&id).await;
        (op, log(s, &id, false).await)
    }

    async fn log(s: &TestServer, op: &str, follow: bool) -> String {
        let resp = s
            .req(
                reqwest::Method::GET,
                &format!("/v1/operations/{op}/log?follow={follow}"),
            )
            .send()
            .await
            .expect("log");
        assert_eq!(resp.status(), 200);
        resp.text().await.expect("log text")
    }

    async fn delete(s: &TestServer, name: &str) {
        let resp = s
            .req(reqwest::Method::DELETE, &format!("/v1/templates/{name}"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 204, "{}", resp.text().await.unwrap());
        remove_layers_of(name);
    }

    /// No build container, process, mount, cgroup or half-made layer of this server's builds
    /// is left; `containers` are the build containers its logs named.
    fn assert_no_build_left(s: &TestServer, partial: &BTreeSet<String>, containers: &[String]) {
        let root = s.data_dir().join("build-runsc");
        let out = std::process::Command::new("runsc")
            .arg("--root")
            .arg(&root)
            .args(["list", "--quiet"])
            .output()
            .expect("runsc list");
        let list = String::from_utf8_lossy(&out.stdout);
        assert!(list.trim().is_empty(), "build containers remain: {list}");
        let procs = common::processes_mentioning(&root.to_string_lossy());
        assert!(procs.is_empty(), "build processes remain: {procs:?}");
        for id in containers {
            assert!(common::processes_mentioning(id).is_empty(), "{id} runs");
            for c in std::fs::read_dir("/sys/fs/cgroup")
                .into_iter()
                .flatten()
                .flatten()
            {
                let cg = c.path().join("space-build").join(id);
                assert!(!cg.exists(), "cgroup {} remains", cg.display());
            }
        }
        assert_no_partial_layers(partial);
    }

    /// The build containers a log names.
    fn containers(log: &str) -> Vec<String> {
        log.lines()
            .filter_map(|l| l.strip_prefix("==> container "))
            .filter_map(|l| l.split_whitespace().next())
            .map(str::to_owned)
            .collect()
    }

    /// Steps that fork-bomb, eat memory, fill the disk, run forever or flood their output:
    /// each build fails with an error naming the limit (or, for output, its log is capped)
    /// within the step's timeout, the server stays small and healthy, and nothing is left.
    #[tokio::test]
    async fn build_steps_are_bounded() {
        let _heavy = super::heavy().await;
        let s = TestServer::start_with(&[
            "--build-memory-mib",
            "256",
            "--build-pids",
            "64",
            "--build-disk-mib",
            "64",
            "--build-step-timeout-seconds",
            "20",
            "--output-cap-mib",
            "4",
        ])
        .await;
        if !s.runtime_available("gvisor").await {
            return;
        }
        let nonce = random_hex();
        let partial = partial_layers();
        let awk = r#"awk 'BEGIN { s = "xxxxxxxxxxxxxxxx"; while (1) s = s s }'"#;
        let cases: [(&str, &str, &[&str]); 6] = [
            (
                "fork_bomb",
                "b() { b | b & }; b; sleep 100000",
                &["timeout of 20s"],
            ),
            (
                "memory_bomb",
                awk,
                &["out of memory", "memory limit of 256 MiB", "timeout of 20s"],
            ),
            (
                "disk_fill",
                "dd if=/dev/zero of=/fill bs=1M count=1000",
                &["disk of 64 MiB is full"],
            ),
            ("runs_forever", "sleep 100000", &["timeout of 20s"]),
            (
                "sparse_file",
                "dd if=/dev/zero of=/sparse bs=1 count=0 seek=100G",
                &["sparse files count at their full size"],
            ),
            (
                "deep_tree",
                "cd /tmp && mkdir -p /deep && cd /deep && for i in $(seq 400); do mkdir d && cd d; done",
                &["deeper than 256 levels"],
            ),
        ];
        for (case, script, want) in cases {
            let name = format!("hostile-{}-{}", case.replace('_', "-"), &nonce[..12]);
            let (op, log) = build(
                &s,
                json!({"name": name, "base": "busybox",
                       "steps": [{"run": format!("echo {nonce}; {script}")}]}),
            )
            .await;
            assert_eq!(op["status"], "failed", "{case}: {op}\n{log}");
            let msg = op["error"]["message"].as_str().unwrap_or_default();
            assert!(
                want.iter().any(|w| msg.contains(w) || log.contains(w)),
                "{case}: the error names the limit: {msg}"
            );
            assert!(msg.contains("a step may use"), "{case}: {msg}");
            assert!(!common::templates_dir().join(&name).exists());
            assert_no_build_left(&s, &partial, &containers(&log));
            remove_layers_of(&name);
            let (st, _) = s.get("/healthz").await;
            assert_eq!(st, 200);
            eprintln!("hostile: build_{case} passed");
        }

        // 400 MB of output (a server of its own: it takes longer than the timeout above): the
        // host keeps the last 4 MiB of it, and readers get that tail with a note of what was
        // dropped, streamed (the server stays small).
        drop(s);
        let s = TestServer::start_with(&["--output-cap-mib", "4"]).await;
        let name = format!("hostile-flood-{}", &nonce[..12]);
        let (op, log) = build(
            &s,
            json!({"name": name, "base": "busybox", "steps": [{"run": format!(
                "yes xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx | head -c 400000000; echo end-{nonce}"
            )}]}),
        )
        .await;
        assert_eq!(op["status"], "succeeded", "{op}");
        let path = s
            .data_dir()
            .join("builds")
            .join(format!("{}.log", op["id"].as_str().unwrap()));
        let on_disk = std::fs::metadata(&path).unwrap().blocks() * 512;
        assert!(
            on_disk <= 8 << 20,
            "the log takes {on_disk} bytes on the host"
        );
        for follow in [false, true] {
            let text = super::template_builds::log(&s, op["id"].as_str().unwrap(), follow).await;
            assert!(text.len() <= 6 << 20, "{} bytes", text.len());
            assert!(text.starts_with("[space: "), "{}", truncated(&text));
            assert!(text.contains(&format!("end-{nonce}\n")));
        }
        assert!(log.contains("published"));
        let peak = vm_kib(s.pid().unwrap(), "VmHWM");
        assert!(peak < 200 * 1024, "server peak RSS {peak} KiB");
        delete(&s, &name).await;
        assert_no_build_left(&s, &partial, &containers(&log));
        eprintln!("hostile: build_output_flood passed");
    }

    /// A tar member written raw (the tar crate refuses to build `..` or absolute names).
    fn raw_member(
        b: &mut tar::Builder<Vec<u8>>,
        name: &str,
        kind: tar::EntryType,
        link: Option<&str>,
        mode: u32,
        data: &[u8],
    ) {
        let mut h = tar::Header::new_gnu();
        {
            let gnu = h.as_gnu_mut().unwrap();
            gnu.name[..name.len()].copy_from_slice(name.as_bytes());
            if let Some(l) = link {
                gnu.linkname[..l.len()].copy_from_slice(l.as_bytes());
            }
        }
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_size(data.len() as u64);
        if matches!(kind, tar::EntryType::Char | tar::EntryType::Block) {
            h.set_device_major(1).unwrap();
            h.set_device_minor(3).unwrap();
        }
        h.set_cksum();
        b.append(&h, data).unwrap();
    }

    fn no_special_files(root: &std::path::Path) {
        for e in walk(root) {
            let m = std::fs::symlink_metadata(&e).unwrap();
            let t = m.file_type();
            use std::os::unix::fs::FileTypeExt;
            assert!(
                !(t.is_char_device() || t.is_block_device() || t.is_fifo() || t.is_socket()),
                "{} is a device, fifo or socket on the host",
                e.display()
            );
        }
    }

    fn walk(root: &std::path::Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                let m = std::fs::symlink_metadata(e.path()).unwrap();
                if m.is_dir() {
                    stack.push(e.path());
                }
                out.push(e.path());
            }
        }
        out
    }

    /// Recipes whose trees are traps for the host: a step that makes the mount points and
    /// /etc links to a host directory (and setuid files, devices, fifos), recipe `files`
    /// written through links, `tar:` imports with `..`, absolute names, entries below a link,
    /// hard links out, devices and setuid files (plain and gzip), an `oci:` layout whose
    /// layers leave links to the host and whiteouts through them or whose blob is a link to a
    /// host file, and a `dir:` import holding links, a fifo, a device and a setuid binary. The
    /// host directory and file stay exactly as they were, refused archives fail the build and
    /// leave nothing, and what is imported holds no device node and no setuid file another
    /// host user can reach.
    #[tokio::test]
    async fn recipe_trees_stay_in_their_layer() {
        let import = tempfile::Builder::new()
            .prefix("space-import")
            .tempdir_in("/tmp")
            .unwrap();
        let s = TestServer::start_with(&["--template-import-dir", import.path().to_str().unwrap()])
            .await;
        if !s.runtime_available("gvisor").await {
            return;
        }
        let nonce = random_hex();
        let decoy = decoy_dir(&nonce);
        let d = decoy.path().display().to_string();
        let host_file = PathBuf::from(format!("/tmp/spacehostile{nonce}"));
        std::fs::write(&host_file, &nonce).unwrap();
        // Removed however the test ends.
        let _remove = RemoveOnDrop(host_file.clone());
        let hf = host_file.display().to_string();
        let before = (host_tree(decoy.path()), std::fs::read(&host_file).unwrap());
        let untouched = |what: &str| {
            assert_eq!(
                (host_tree(decoy.path()), std::fs::read(&host_file).unwrap()),
                before,
                "{what}: the host directory or file changed"
            );
        };
        let partial = partial_layers();
        let mut names = Vec::new();

        // A step leaves links where the host adds mount points, and traps in /etc.
        let a = format!("hostile-tree-a-{}", &nonce[..12]);
        let (op, log) = build(
            &s,
            json!({"name": a, "base": "busybox", "steps": [{"run": format!(
                "echo {nonce}; rm -rf /.space /tmp /run /dev /sys
                 ln -s {d} /.space; ln -s {d} /tmp; ln -s {d}/run /run; ln -s {hf} /dev; ln -s {d} /sys
                 ln -s {d} /etc/hostdir; ln -s {hf} /etc/hostfile; mkdir -p /opt; ln -s {d} /opt/link
                 cp /bin/busybox /suid; chmod 6755 /suid; mknod /cdev c 1 3 || true; mkfifo /fifo"
            )}]}),
        )
        .await;
        assert_eq!(op["status"], "succeeded", "{op}\n{log}");
        names.push(a.clone());
        untouched("step links");
        let root = template_rootfs(&a);
        for dir in [
            ".space",
            ".space/bin",
            ".space/run",
            "tmp",
            "run",
            "dev",
            "sys",
        ] {
            assert!(
                std::fs::symlink_metadata(root.join(dir)).unwrap().is_dir(),
                "/{dir} is a real directory"
            );
        }
        no_special_files(&root);
        assert!(!nobody_can_reach(&root.join("suid")));

        // Recipe files through those links land inside the layer.
        let b = format!("hostile-tree-b-{}", &nonce[..12]);
        let file = |path: &str| json!({"path": path, "content": "planted", "mode": 0o4755});
        let (op, log) = build(
            &s,
            json!({"name": b, "base": format!("template:{a}"), "files": [
                file("/opt/link/planted"), file("/etc/hostfile"), file("/etc/hostdir/hosts"),
                file("/tmp/planted"), file("/.space/planted")
            ]}),
        )
        .await;
        assert_eq!(op["status"], "succeeded", "{op}\n{log}");
        names.push(b.clone());
        untouched("recipe files");
        let root = template_rootfs(&b);
        let inside = |p: &str| root.join(p.trim_start_matches('/'));
        assert!(inside(&format!("{d}/planted")).is_file());
        assert!(inside(&hf).is_file());
        assert!(!nobody_can_reach(&inside(&hf)));

        // tar: refused archives fail and leave nothing; devices are skipped.
        let tars: Vec<(&str, Vec<u8>, bool)> = {
            use tar::EntryType as T;
            let mut v = Vec::new();
            let mut t = tar::Builder::new(Vec::new());
            raw_member(
                &mut t,
                &format!("../escape-{nonce}"),
                T::Regular,
                None,
                0o644,
                b"x",
            );
            v.push(("dotdot", t.into_inner().unwrap(), false));
            let mut t = tar::Builder::new(Vec::new());
            raw_member(
                &mut t,
                &format!("/tmp/abs-{nonce}"),
                T::Regular,
                None,
                0o644,
                b"x",
            );
            v.push(("absolute", t.into_inner().unwrap(), false));
            let mut t = tar::Builder::new(Vec::new());
            raw_member(&mut t, "link", T::Symlink, Some(&d), 0o777, b"");
            raw_member(&mut t, "link/hosts", T::Regular, None, 0o644, b"planted");
            v.push(("below_a_link", t.into_inner().unwrap(), false));
            let mut t = tar::Builder::new(Vec::new());
            raw_member(&mut t, "hard", T::Link, Some(&hf[1..]), 0o644, b"");
            v.push(("hard_link_out", t.into_inner().unwrap(), false));
            let mut t = tar::Builder::new(Vec::new());
            raw_member(&mut t, "bin/", T::Directory, None, 0o755, b"");
            raw_member(&mut t, "bin/suid", T::Regular, None, 0o6755, b"#!/bin/sh\n");
            raw_member(&mut t, "dev-null", T::Char, None, 0o666, b"");
            raw_member(&mut t, "fifo", T::Fifo, None, 0o644, b"");
            raw_member(&mut t, "host-link", T::Symlink, Some(&hf), 0o777, b"");
            v.push(("devices_and_setuid", t.into_inner().unwrap(), true));
            v
        };
        for (case, data, ok) in tars {
            for gz in [false, true] {
                let path = import.path().join(format!("{case}-{gz}.tar"));
                let data = if gz {
                    let mut e =
                        flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                    std::io::Write::write_all(&mut e, &data).unwrap();
                    e.finish().unwrap()
                } else {
                    data.clone()
                };
                std::fs::write(&path, data).unwrap();
                let name = format!(
                    "hostile-tar-{}-{gz}-{}",
                    case.replace('_', "-"),
                    &nonce[..8]
                );
                let (op, log) = build(
                    &s,
                    json!({"name": name, "base": format!("tar:{}", path.display())}),
                )
                .await;
                untouched(case);
                assert!(!PathBuf::from(format!("/tmp/escape-{nonce}")).exists());
                assert!(!PathBuf::from(format!("/tmp/abs-{nonce}")).exists());
                if ok {
                    assert_eq!(op["status"], "succeeded", "{case}: {op}\n{log}");
                    let root = template_rootfs(&name);
                    no_special_files(&root);
                    assert!(!nobody_can_reach(&root.join("bin/suid")));
                    names.push(name);
                } else {
                    assert_eq!(op["status"], "failed", "{case}: {op}\n{log}");
                    assert!(!common::templates_dir().join(&name).exists());
                    remove_layers_of(&name);
                }
            }
            eprintln!("hostile: tar_import_{case} passed");
        }

        // oci: the lower layer leaves links to the host; the upper writes and whites out
        // through them. A blob that is a link to a host file is refused.
        let work = import.path().join("oci-work");
        let layout = import.path().join("layout");
        let mut layers = Vec::new();
        for (i, members) in [
            vec![
                ("etc", tar::EntryType::Symlink, Some(d.as_str())),
                ("data", tar::EntryType::Symlink, Some(d.as_str())),
                ("out", tar::EntryType::Symlink, Some(d.as_str())),
            ],
            vec![
                ("etc/", tar::EntryType::Directory, None),
                ("etc/hosts", tar::EntryType::Regular, None),
                ("data/", tar::EntryType::Directory, None),
                ("data/.wh..wh..opq", tar::EntryType::Regular, None),
                ("out/", tar::EntryType::Directory, None),
                ("out/.wh.hosts", tar::EntryType::Regular, None),
                (".wh.nothing", tar::EntryType::Regular, None),
            ],
        ]
        .into_iter()
        .enumerate()
        {
            let mut t = tar::Builder::new(Vec::new());
            for (name, kind, link) in members {
                let mode = if kind == tar::EntryType::Directory {
                    0o755
                } else {
                    0o644
                };
                raw_member(&mut t, name, kind, link, mode, b"");
            }
            std::fs::create_dir_all(&work).unwrap();
            let file = work.join(format!("l{i}.tar"));
            std::fs::write(&file, t.into_inner().unwrap()).unwrap();
            layers.push(oci_blob(
                &layout,
                "application/vnd.oci.image.layer.v1.tar",
                &file,
            ));
        }
        let make_layout = |layers: &[Value]| {
            let config = work.join("config.json");
            std::fs::write(&config, r#"{"architecture":"amd64","os":"linux"}"#).unwrap();
            let config = oci_blob(&layout, "application/vnd.oci.image.config.v1+json", &config);
            let manifest = work.join("manifest.json");
            std::fs::write(
                &manifest,
                json!({"schemaVersion": 2, "config": config, "layers": layers}).to_string(),
            )
            .unwrap();
            let manifest = oci_blob(
                &layout,
                "application/vnd.oci.image.manifest.v1+json",
                &manifest,
            );
            std::fs::write(
                layout.join("index.json"),
                json!({"schemaVersion": 2, "manifests": [manifest]}).to_string(),
            )
            .unwrap();
        };
        make_layout(&layers);
        let name = format!("hostile-oci-{}", &nonce[..12]);
        let (op, log) = build(
            &s,
            json!({"name": name, "base": format!("oci:{}", layout.display())}),
        )
        .await;
        assert_eq!(op["status"], "succeeded", "{op}\n{log}");
        untouched("oci layers");
        let root = template_rootfs(&name);
        for dir in ["etc", "data", "out"] {
            assert!(
                std::fs::symlink_metadata(root.join(dir)).unwrap().is_dir(),
                "/{dir}"
            );
        }
        names.push(name);
        // The first layer's blob becomes a link to a host tar.
        let evil = work.join("evil.tar");
        let mut t = tar::Builder::new(Vec::new());
        raw_member(&mut t, "evil", tar::EntryType::Regular, None, 0o644, b"x");
        std::fs::write(&evil, t.into_inner().unwrap()).unwrap();
        let digest = layers[0]["digest"]
            .as_str()
            .unwrap()
            .trim_start_matches("sha256:");
        let blob_path = layout.join("blobs/sha256").join(digest);
        std::fs::remove_file(&blob_path).unwrap();
        std::os::unix::fs::symlink(&evil, &blob_path).unwrap();
        let name = format!("hostile-oci-link-{}", &nonce[..12]);
        let (op, log) = build(
            &s,
            json!({"name": name, "base": format!("oci:{}", layout.display())}),
        )
        .await;
        assert_eq!(op["status"], "failed", "{op}\n{log}");
        remove_layers_of(&name);
        eprintln!("hostile: oci_import passed");

        // dir: links stay links; fifos, devices and sockets are dropped; setuid is unreachable.
        let src = import.path().join("root");
        std::fs::create_dir_all(src.join("bin")).unwrap();
        std::fs::copy("/bin/busybox", src.join("bin/busybox")).unwrap();
        std::fs::set_permissions(
            src.join("bin/busybox"),
            std::os::unix::fs::PermissionsExt::from_mode(0o6755),
        )
        .unwrap();
        std::os::unix::fs::symlink(&d, src.join("host-dir")).unwrap();
        std::os::unix::fs::symlink(&hf, src.join("host-file")).unwrap();
        for (what, args) in [("fifo", vec!["p"]), ("dev", vec!["c", "1", "3"])] {
            let st = std::process::Command::new("mknod")
                .arg(src.join(what))
                .args(args)
                .status()
                .unwrap();
            assert!(st.success());
        }
        let name = format!("hostile-dir-{}", &nonce[..12]);
        let (op, log) = build(
            &s,
            json!({"name": name, "base": format!("dir:{}", src.display())}),
        )
        .await;
        assert_eq!(op["status"], "succeeded", "{op}\n{log}");
        untouched("dir import");
        let root = template_rootfs(&name);
        no_special_files(&root);
        assert!(!nobody_can_reach(&root.join("bin/busybox")));
        assert_eq!(
            std::fs::read_link(root.join("host-file")).unwrap(),
            host_file
        );
        names.push(name);
        eprintln!("hostile: dir_import passed");

        for name in names.iter().rev() {
            delete(&s, name).await;
        }
        assert_no_build_left(&s, &partial, &[]);
        let _ = std::fs::remove_file(&host_file);
        let (st, _) = s.get("/healthz").await;
        assert_eq!(st, 200);
        eprintln!("hostile: recipe_trees passed");
    }

    /// Writes `file` as a blob of the OCI layout and returns its descriptor.
    fn oci_blob(layout: &std::path::Path, media: &str, file: &std::path::Path) -> Value {
        let out = std::process::Command::new("sha256sum")
            .arg(file)
            .output()
            .unwrap();
        let digest = String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .next()
            .unwrap()
            .to_string();
        let dir = layout.join("blobs/sha256");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(file, dir.join(&digest)).unwrap();
        json!({"mediaType": media, "digest": format!("sha256:{digest}"),
               "size": std::fs::metadata(file).unwrap().len()})
    }

    /// sha256 of a host file, or "" when it does not exist.
    fn digest(path: &str) -> String {
        let out = std::process::Command::new("sha256sum")
            .arg(path)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string()
    }

    /// Host processes whose command line mentions one of `needles`, as long as `stop` is
    /// false.
    fn watch_processes(
        needles: &'static [&'static str],
        stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ) -> std::thread::JoinHandle<BTreeSet<String>> {
        std::thread::spawn(move || {
            let mut seen = BTreeSet::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // The host's apt resolving and downloading names the package; nothing that
                // installs it (dpkg, a maintainer script, adduser) may.
                let found = needles.iter().flat_map(|n| common::processes_mentioning(n));
                for (_, cmdline) in found {
                    let downloads = cmdline.contains("apt-get")
                        && (cmdline.contains("--download-only")
                            || cmdline.contains("--print-uris"));
                    if !downloads {
                        seen.insert(cmdline);
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            seen
        })
    }

    /// `debian:bookworm` with a package whose maintainer script adds a system user
    /// (uuid-runtime's postinst runs adduser for `uuidd`): the build succeeds, the package
    /// works in a sandbox of the template and its user is there, and nothing of the package
    /// ran on the host — no process of the host ever mentions it during the build, and the
    /// host's account files and package database are unchanged.
    #[tokio::test]
    async fn debian_packages_install_inside_gvisor() {
        let s = TestServer::start().await;
        if !s.runtime_available("gvisor").await {
            return;
        }
        let nonce = random_hex();
        let partial = partial_layers();
        // The base (the built-in debian, made by mmdebstrap from the mirror alone) first.
        let base = format!("hostile-deb-base-{}", &nonce[..12]);
        let (op, log) = build(&s, json!({"name": base, "base": "debian:bookworm"})).await;
        assert_eq!(op["status"], "succeeded", "{op}\n{log}");
        // The packages layer is keyed by the base and the package list only: make sure this
        // build installs them instead of finding an earlier run's layer.
        let layers = common::templates_dir().join(".layers");
        for e in std::fs::read_dir(&layers).into_iter().flatten().flatten() {
            let meta: Value = std::fs::read(e.path().join("layer.json"))
                .ok()
                .and_then(|m| serde_json::from_slice(&m).ok())
                .unwrap_or_default();
            if meta["what"]
                .as_str()
                .is_some_and(|w| w.contains("uuid-runtime"))
            {
                std::fs::remove_dir_all(e.path()).unwrap();
            }
        }
        let host = [
            "/etc/passwd",
            "/etc/group",
            "/etc/shadow",
            "/var/lib/dpkg/status",
        ];
        let before: Vec<String> = host.iter().map(|p| digest(p)).collect();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let watcher = watch_processes(&["uuid-runtime", "uuidd"], stop.clone());
        let name = format!("hostile-deb-{}", &nonce[..12]);
        let (op, log) = build(
            &s,
            json!({"name": name, "base": "debian:bookworm", "packages": ["uuid-runtime"],
                   "steps": [{"run": format!("echo {nonce}")}]}),
        )
        .await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let seen = watcher.join().unwrap();
        assert!(
            seen.is_empty(),
            "package processes ran on the host: {seen:?}"
        );
        assert_eq!(op["status"], "succeeded", "{op}\n{log}");
        assert!(
            log.contains("packages uuid-runtime")
                && !log.contains("packages uuid-runtime [cached]"),
            "the packages were installed by this build: {log}"
        );
        let after: Vec<String> = host.iter().map(|p| digest(p)).collect();
        assert_eq!(
            before, after,
            "the host's account files or package database changed"
        );
        let sb = s
            .create_with(json!({"template": name, "runtime": "gvisor"}))
            .await;
        let out = s
            .sh(&sb, "uuidgen | wc -c; grep -c '^uuidd:' /etc/passwd; dpkg-query -W -f '${Status}' uuid-runtime")
            .await;
        assert_eq!(out["result"]["exit_code"], 0, "{out}");
        assert_eq!(
            out["stdout"], "37\n1\ninstall ok installed",
            "the package works and its postinst ran in the template: {out}"
        );
        s.destroy(&sb).await;
        delete(&s, &name).await;
        delete(&s, &base).await;
        assert_no_build_left(&s, &partial, &containers(&log));
        eprintln!("hostile: debian_packages_inside_gvisor passed");
    }

    /// The data dir is 0700 and the database with its WAL and SHM files 0600 — also when they
    /// were not at start —, the template store and its layer cache 0700, build logs 0600.
    #[tokio::test]
    async fn data_dir_and_database_are_private() {
        use std::os::unix::fs::PermissionsExt;
        let mut s = TestServer::start().await;
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().mode() & 0o7777;
        let data = s.data_dir().to_owned();
        std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).unwrap();
        for f in ["space.db", "space.db-wal", "space.db-shm"] {
            let _ = std::fs::set_permissions(data.join(f), std::fs::Permissions::from_mode(0o644));
        }
        s.kill_and_restart();
        let (st, _) = s.get("/v1/sandboxes").await;
        assert_eq!(st, 200);
        assert_eq!(mode(&data), 0o700, "DATA_DIR");
        for f in ["space.db", "space.db-wal", "space.db-shm"] {
            assert_eq!(mode(&data.join(f)), 0o600, "{f}");
        }
        for dir in [
            common::templates_dir(),
            common::templates_dir().join(".layers"),
        ] {
            assert_eq!(mode(&dir), 0o700, "{}", dir.display());
        }
        let name = format!("hostile-modes-{}", &random_hex()[..12]);
        let (op, _) = build(
            &s,
            json!({"name": name, "base": "busybox", "files": [{"path": "/x", "content": "x"}]}),
        )
        .await;
        assert_eq!(op["status"], "succeeded", "{op}");
        let log = data
            .join("builds")
            .join(format!("{}.log", op["id"].as_str().unwrap()));
        assert_eq!(mode(&log), 0o600, "build log");
        delete(&s, &name).await;
        eprintln!("hostile: data_dir_private passed");
    }
}

// ═══════════════ what the host lends a sandbox (issue 11, points 1, 4 and 5) ═══════════════
//
// Three cases, on both runtimes:
// - `lent_files`: every route a root command has to the host files that back its sandbox
//   (the agent binary, the run directory, the template's root): remounts, binds, moves,
//   overlays, new mounts of the same filesystem, O_RDWR opens through /proc/self/fd,
//   truncation, new files of every kind. Each attack must fail, or land only in the
//   sandbox's own copy-on-write view: the host's files do not change, a neighbour and
//   another tenant's sandbox still see the genuine agent, and so does a sandbox created
//   afterwards. No process of the sandbox holds a host file open for writing outside the
//   sandbox's own writable layer and its bounded log directory.
// - `host_disk_floods`: the console (PID 1's stdout/stderr, /dev/console, /dev/kmsg, the
//   serial port) and the run directory flooded as root: the host's sandbox directory grows
//   by at most a small bound outside the quota'd disk, which stays within its quota.
// - `agent_socket_flood`: hundreds of half-open connections to the agent's socket from
//   inside: the server holds a bounded number of descriptors for them, the real agent keeps
//   working, and gets back in after a server restart while the flood goes on.

/// Largest file hashed by content in a host digest; bigger ones (template disk images)
/// are compared by size and change times, which any write moves.
const DIGEST_HASH_MAX: u64 = 8 << 20;

fn sha256_hex(data: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What the host paths hold, entry by entry (symlinks not followed): type, mode, size and
/// the content's hash (or the change times of big files).
fn host_digest(paths: &[PathBuf]) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    let mut stack: Vec<PathBuf> = paths.to_vec();
    while let Some(p) = stack.pop() {
        let Ok(m) = std::fs::symlink_metadata(&p) else {
            out.insert(p.display().to_string(), "missing".to_string());
            continue;
        };
        let what = if m.is_dir() {
            for e in std::fs::read_dir(&p).into_iter().flatten().flatten() {
                stack.push(e.path());
            }
            format!("dir {:o}", m.mode())
        } else if m.is_file() && m.len() <= DIGEST_HASH_MAX {
            let data = std::fs::read(&p).unwrap_or_default();
            format!("file {:o} {} {}", m.mode(), m.len(), sha256_hex(&data))
        } else {
            format!(
                "{:?} {:o} {} {}.{} {}.{}",
                m.file_type(),
                m.mode(),
                m.len(),
                m.mtime(),
                m.mtime_nsec(),
                m.ctime(),
                m.ctime_nsec()
            )
        };
        out.insert(p.display().to_string(), what);
    }
    out
}

/// The entries of two digests that differ.
fn digest_diff(
    a: &std::collections::BTreeMap<String, String>,
    b: &std::collections::BTreeMap<String, String>,
) -> Vec<String> {
    let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| format!("{k}: {:?} -> {:?}", a.get(k), b.get(k)))
        .collect()
}

/// The host files behind a sandbox that it must never change: the server's agent, and the
/// sandbox's root, agent and guest files as its runtime lends them (read from the OCI
/// spec, or QEMU's argument list). Its run directory is checked apart ([`run_dir_extras`]).
fn lent_paths(h: &Hostile, sb: &str) -> Vec<PathBuf> {
    let data = h.s.data_dir();
    let state = data.join("sandboxes").join(sb);
    let mut paths = vec![data.join("agent")];
    if h.rt == "gvisor" {
        let spec: Value = serde_json::from_slice(
            &std::fs::read(state.join("bundle/config.json")).expect("the sandbox's OCI spec"),
        )
        .expect("OCI spec JSON");
        paths.push(PathBuf::from(spec["root"]["path"].as_str().unwrap()));
        for m in spec["mounts"].as_array().unwrap() {
            if m["type"] == "bind" && m["destination"] != "/.space/run" {
                paths.push(PathBuf::from(m["source"].as_str().unwrap()));
            }
        }
    } else {
        let args: Vec<String> = serde_json::from_slice(
            &std::fs::read(state.join("launch.json")).expect("the microVM's launch.json"),
        )
        .expect("launch.json");
        for flag in ["-kernel", "-initrd"] {
            let i = args.iter().position(|a| a == flag).unwrap();
            paths.push(PathBuf::from(&args[i + 1]));
        }
        // The template's disk image (every qcow2 overlay's backing file) and the cached
        // initramfs with the agent.
        paths.push(data.join("microvm/images"));
    }
    paths
}

/// Entries of a sandbox's host run directory other than the agent's socket.
fn run_dir_extras(h: &Hostile, sb: &str) -> Vec<String> {
    let dir = h.s.data_dir().join("sandboxes").join(sb).join("run");
    std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "agent.sock")
        .collect()
}

/// Checks, from inside a sandbox, that it sees only the genuine agent in /.space/bin and
/// nothing but the socket in /.space/run. Returns what is wrong.
const GENUINE_AGENT: &str = "ls -A /.space/bin | tr '\\n' ' '; echo '|'; \
     sha256sum /.space/bin/space-agent | cut -d' ' -f1; echo '|'; ls -A /.space/run | tr '\\n' ' '";

fn genuine_agent_problems(out: &Value, agent_sha: &str) -> Vec<String> {
    let text = out["stdout"].as_str().unwrap_or_default();
    let parts: Vec<&str> = text.split('|').map(str::trim).collect();
    let mut problems = Vec::new();
    if parts.len() != 3 {
        return vec![format!("unreadable answer: {out}")];
    }
    if parts[0] != "space-agent" {
        problems.push(format!("/.space/bin holds {:?}", parts[0]));
    }
    if parts[1] != agent_sha {
        problems.push(format!(
            "/.space/bin/space-agent is {:?}, not the server's",
            parts[1]
        ));
    }
    if parts[2].split_whitespace().any(|n| n != "agent.sock") {
        problems.push(format!("/.space/run holds {:?}", parts[2]));
    }
    problems
}

/// `space keys create --tenant T` on the server's data dir; the key it prints.
fn tenant_key(s: &TestServer, tenant: &str) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_space"))
        .args(["keys", "create", "--tenant", tenant, "--name", "hostile"])
        .arg("--data-dir")
        .arg(s.data_dir())
        .output()
        .expect("space keys create");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// A request as another tenant (`key`): status and body.
async fn call_as(
    h: &Hostile,
    key: &str,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    common::call_with(&h.s.client_as(key), method, path, body).await
}

/// How long a create or destroy as another tenant may take.
const OPERATION_LIMIT: Duration = Duration::from_secs(1200);

/// A running busybox sandbox of `key`'s tenant.
async fn create_as(h: &Hostile, key: &str) -> String {
    let req = space_client::api::CreateSandboxRequest {
        template: "busybox".into(),
        runtime: Some(h.rt.into()),
        ..Default::default()
    };
    h.s.client_as(key)
        .create_sandbox_and_wait(&req, OPERATION_LIMIT)
        .await
        .unwrap_or_else(|e| panic!("create as another tenant: {e}"))
}

async fn destroy_as(h: &Hostile, key: &str, sb: &str) {
    h.s.client_as(key)
        .destroy_sandbox_and_wait(sb, OPERATION_LIMIT)
        .await
        .unwrap_or_else(|e| panic!("destroy {sb} as another tenant: {e}"));
    h.s.assert_nothing_left(sb);
}

/// Pids of the host processes that make up a sandbox (runsc's sandbox and gofer, or QEMU).
fn sandbox_processes(sb: &str) -> Vec<i32> {
    common::processes_mentioning(sb)
        .into_iter()
        .filter(|(_, cmd)| {
            let argv0 = cmd.split(' ').next().unwrap_or_default();
            let name = argv0.rsplit('/').next().unwrap_or_default();
            name.starts_with("runsc") || name.starts_with("qemu")
        })
        .map(|(pid, _)| pid)
        .collect()
}

/// Regular host files that a sandbox's processes hold open for writing, other than its own
/// writable layer (gVisor's overlay filestore, the microVM's qcow2 disk), its bounded log
/// directory, QEMU's pid file and anonymous memory.
fn writable_host_files(h: &Hostile, sb: &str) -> Vec<String> {
    let state = h.s.data_dir().join("sandboxes").join(sb);
    // QEMU holds its pid file open (and locked): a pid, written once, by QEMU.
    let allowed = [
        state.join("overlay/"),
        state.join("log/"),
        state.join("disk.qcow2"),
        state.join("qemu.pid"),
    ];
    let mut found = Vec::new();
    for pid in sandbox_processes(sb) {
        for e in std::fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let fd = e.file_name().to_string_lossy().into_owned();
            let flags = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}"))
                .unwrap_or_default()
                .lines()
                .find_map(|l| l.strip_prefix("flags:"))
                .and_then(|f| u32::from_str_radix(f.trim(), 8).ok())
                .unwrap_or(0);
            if flags & 3 == 0 {
                continue; // O_RDONLY
            }
            let Ok(target) = std::fs::read_link(e.path()) else {
                continue;
            };
            let target = target.to_string_lossy().into_owned();
            if !std::fs::metadata(e.path()).is_ok_and(|m| m.is_file())
                || target.starts_with("/memfd:")
                || allowed
                    .iter()
                    .any(|a| target.starts_with(&*a.to_string_lossy()))
            {
                continue;
            }
            found.push(format!("pid {pid} fd {fd}: {target}"));
        }
    }
    found
}

/// Whether `sb` (of `key`'s tenant, or the dev tenant's) still runs a command.
async fn answers_as(h: &Hostile, key: Option<&str>, sb: &str) -> bool {
    let path = format!("/v1/sandboxes/{sb}/commands");
    let body = json!({"argv": ["true"], "wait": true});
    let (st, out) = match key {
        Some(k) => call_as(h, k, reqwest::Method::POST, &path, Some(body)).await,
        None => h.s.post(&path, body).await,
    };
    st == 201 && out["result"]["exit_code"] == 0
}

/// What `sb` sees in /.space, as `key`'s tenant (or the dev tenant's); what is wrong.
async fn agent_seen_as(h: &Hostile, key: Option<&str>, sb: &str, agent_sha: &str) -> Vec<String> {
    let path = format!("/v1/sandboxes/{sb}/commands");
    let body = json!({"shell": GENUINE_AGENT, "wait": true});
    let (st, out) = match key {
        Some(k) => call_as(h, k, reqwest::Method::POST, &path, Some(body)).await,
        None => h.s.post(&path, body).await,
    };
    if st != 201 {
        return vec![format!("no answer ({st}): {out}")];
    }
    genuine_agent_problems(&out, agent_sha)
}

async fn lent_files(rt: &'static str) {
    let Some(mut h) = setup(rt, &[]).await else {
        return;
    };
    let gvisor = rt == "gvisor";
    let other_key = tenant_key(&h.s, "other");
    let mut other = create_as(&h, &other_key).await;
    let mut v = h.victim(json!({})).await;
    let master = h.s.data_dir().join("agent/space-agent");
    let agent_bytes = std::fs::read(&master).unwrap();
    let agent_sha = sha256_hex(&agent_bytes);
    let mut lent = lent_paths(&h, &v);
    eprintln!("[{rt}] host paths lent to {v}: {lent:?}");
    let mut baseline = host_digest(&lent);
    let mut breaches: Vec<String> = Vec::new();
    let writable = writable_host_files(&h, &v);
    if !writable.is_empty() {
        breaches.push(format!("host files open for writing: {writable:?}"));
    }

    // Each attack is a root shell script; `$P userns CMD` is `unshare -Urm CMD` (root of a
    // user namespace with a mount namespace of its own: CAP_SYS_ADMIN over its mounts).
    let attacks: &[(&str, &str)] = &[
        (
            "unshare_remount (the reproduction)",
            "unshare -Urm sh -c 'mount -o remount,rw /.space/bin && touch /.space/bin/x'",
        ),
        (
            "remount_rw",
            "$P userns sh -c 'for d in /.space/bin /.space/run /; do $P remount_rw $d; \
               mount -o remount,rw $d; echo x >$d/x-remount; mkdir $d/xd-remount; done; \
               $P openrw /.space/bin/space-agent; $P truncate /.space/bin/space-agent; \
               cp /bin/busybox /.space/bin/space-agent; echo x >/.space/run/token'",
        ),
        (
            "bind_elsewhere_then_remount",
            "$P userns sh -c 'mkdir -p /tmp/m; for d in /.space/bin /.space/run /; do \
               mount --bind $d /tmp/m && { $P remount_rw /tmp/m; mount -o remount,rw /tmp/m; \
               echo x >/tmp/m/x-bind; $P openrw /tmp/m/space-agent; \
               $P openrw /tmp/m/etc/passwd; umount /tmp/m; }; done'",
        ),
        (
            "mount_move",
            "$P userns sh -c 'mkdir -p /tmp/m /tmp/n; mount --move /.space/bin /tmp/m && \
               { $P remount_rw /tmp/m; echo x >/tmp/m/x-move; $P openrw /tmp/m/space-agent; }; \
               mount --move /.space/run /tmp/n && { $P remount_rw /tmp/n; echo x >/tmp/n/x-move; }'",
        ),
        (
            "overlay_over_bin",
            "$P userns sh -c 'mkdir -p /tmp/u /tmp/w; mount -t overlay overlay \
               -o lowerdir=/.space/bin,upperdir=/tmp/u,workdir=/tmp/w /.space/bin && \
               { echo x >/.space/bin/x-overlay; $P openrw /.space/bin/space-agent; }; \
               mkdir -p /tmp/u2 /tmp/w2; mount -t overlay overlay \
               -o lowerdir=/.space/run,upperdir=/tmp/u2,workdir=/tmp/w2 /.space/run && \
               echo x >/.space/run/x-overlay'",
        ),
        (
            "new_mount_of_the_same_filesystem",
            // The source, type and options of each mount, mounted again read-write.
            "$P userns sh -c 'mkdir -p /tmp/m; for d in /.space/bin /.space/run /; do \
               set -- $(grep \" $d \" /proc/mounts | tail -n1); \
               o=$(echo \"$4\" | sed \"s/^ro,//; s/,ro,/,/; s/^ro$//\"); \
               mount -t \"$3\" -o \"rw${o:+,$o}\" \"$1\" /tmp/m && { echo x >/tmp/m/x-new; \
               $P openrw /tmp/m/space-agent; $P openrw /tmp/m/etc/passwd; umount /tmp/m; }; done; \
               mount /dev/vda /tmp/m 2>/dev/null && { echo x >/tmp/m/x-vda; umount /tmp/m; }; true'",
        ),
        (
            "open_rdwr",
            "for f in /.space/bin/space-agent /proc/1/exe /etc/passwd; do $P openrw $f; \
               $P fdreopen $f; done; $P truncate /.space/bin/space-agent; \
               $P userns sh -c '$P remount_rw /.space/bin; $P remount_rw /; \
               for f in /.space/bin/space-agent /proc/1/exe /etc/passwd; do \
               $P openrw $f; $P fdreopen $f; done; $P truncate /.space/bin/space-agent'",
        ),
        (
            "run_dir_writes",
            "cd /.space/run; dd if=/dev/zero of=fill bs=1M count=200; mkdir d; mkfifo f; \
               $P bind_unix s; touch t; ln -s / l; ln agent.sock hard; \
               $P userns sh -c '$P remount_rw /.space/run; mount -o remount,rw /.space/run; \
               dd if=/dev/zero of=/.space/run/fill2 bs=1M count=200; mkdir /.space/run/d2; \
               mkfifo /.space/run/f2; $P bind_unix /.space/run/s2; mv /.space/run/agent.sock /.space/run/moved'",
        ),
    ];
    for (name, script) in attacks {
        let script = format!("export P={PROBE}; {script}; true");
        let (st, out) = h
            .try_cmd(
                &v,
                json!({"shell": script, "timeout_seconds": 120, "wait": true}),
            )
            .await;
        eprintln!(
            "[{rt}] {name} ({st}): {} {}",
            out["stdout"].as_str().unwrap_or_default().trim(),
            out["stderr"].as_str().unwrap_or_default().trim()
        );
        let before = breaches.len();
        if st != 201 || out["result"].is_null() {
            breaches.push(format!("{name}: the victim stopped answering: {out}"));
        }
        let now = host_digest(&lent);
        let diff = digest_diff(&baseline, &now);
        if !diff.is_empty() {
            breaches.push(format!("{name}: host files changed: {diff:?}"));
        }
        let extras = run_dir_extras(&h, &v);
        if !extras.is_empty() {
            breaches.push(format!("{name}: the host run dir holds {extras:?}"));
        }
        for p in agent_seen_as(&h, None, &h.neighbour, &agent_sha).await {
            breaches.push(format!("{name}: the neighbour: {p}"));
        }
        for p in agent_seen_as(&h, Some(&other_key), &other, &agent_sha).await {
            breaches.push(format!("{name}: another tenant's sandbox: {p}"));
        }
        if breaches.len() > before {
            // Only where an attack got through: undo it, so that each attack is judged on
            // its own (the server's agent back, dead sandboxes replaced).
            std::fs::write(&master, &agent_bytes).unwrap();
            for e in std::fs::read_dir(master.parent().unwrap())
                .unwrap()
                .flatten()
            {
                if e.file_name() != "space-agent" {
                    let _ = std::fs::remove_dir_all(e.path())
                        .or_else(|_| std::fs::remove_file(e.path()));
                }
            }
            let run = h.s.data_dir().join("sandboxes").join(&v).join("run");
            for extra in run_dir_extras(&h, &v) {
                let p = run.join(extra);
                let _ = std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p));
            }
            if !answers_as(&h, None, &v).await {
                v = h.victim(json!({})).await;
            }
            lent = lent_paths(&h, &v);
            baseline = host_digest(&lent);
            if !answers_as(&h, None, &h.neighbour).await {
                h.neighbour = h.create(json!({})).await;
            }
            if !answers_as(&h, Some(&other_key), &other).await {
                other = create_as(&h, &other_key).await;
            }
        }
    }
    if breaches.is_empty() {
        h.healthy("lent_files", Some(&v)).await;
    }
    // A sandbox made afterwards runs the genuine agent.
    let (st, op) =
        h.s.post(
            "/v1/sandboxes",
            json!({"template": "busybox", "runtime": rt}),
        )
        .await;
    assert_eq!(st, 202, "{op}");
    let op = h.s.wait_op(op["id"].as_str().unwrap()).await;
    let after = op["sandbox_id"].as_str().unwrap().to_string();
    if op["status"] == "succeeded" {
        for p in agent_seen_as(&h, None, &after, &agent_sha).await {
            breaches.push(format!("a sandbox created afterwards: {p}"));
        }
        let writable = writable_host_files(&h, &after);
        if !writable.is_empty() {
            breaches.push(format!(
                "host files open for writing afterwards: {writable:?}"
            ));
        }
        if gvisor {
            // No host path is lent to two sandboxes.
            let (a, b) = (lent_paths(&h, &v), lent_paths(&h, &after));
            let shared: Vec<&PathBuf> = a[1..].iter().filter(|p| b[1..].contains(p)).collect();
            if !shared.is_empty() {
                breaches.push(format!("host paths lent to two sandboxes: {shared:?}"));
            }
        }
    } else {
        breaches.push(format!("a sandbox created afterwards did not start: {op}"));
    }
    assert!(
        breaches.is_empty(),
        "[{rt}] {} breaches:\n{}",
        breaches.len(),
        breaches.join("\n")
    );
    h.s.destroy(&after).await;
    destroy_as(&h, &other_key, &other).await;
    h.finish(&[&v]).await;
}

/// Bytes a sandbox's directory takes on the host outside its disk image, its writable
/// layer's mount and what it borrows read-only, and the disk image's own bytes.
fn host_bytes(h: &Hostile, sb: &str) -> (u64, u64) {
    let state = h.s.data_dir().join("sandboxes").join(sb);
    let (mut other, mut disk) = (0, 0);
    let mut stack = vec![state.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            let Ok(m) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            let name = e.file_name();
            if d == state && (name == "overlay" || name == "ro") {
                continue;
            }
            if d == state && (name == "disk.img" || name == "disk.qcow2") {
                disk += m.blocks() * 512;
            } else if m.is_dir() {
                stack.push(p);
            } else {
                other += m.blocks() * 512;
            }
        }
    }
    (other, disk)
}

async fn host_disk_floods(rt: &'static str) {
    let _heavy = heavy().await;
    let Some(h) = setup(rt, &[]).await else {
        return;
    };
    let disk_mib = 64;
    let body = json!({"resources": {"disk_mib": disk_mib}});
    let v = h.victim(body).await;
    let (before, _) = host_bytes(&h, &v);
    // 300 MiB at most into each, 20 s of large writes and 10 s of lines at most (a TCG
    // serial port is slow: about 1 MiB in 30 s, which is all the host keeps of a console,
    // `space_runtime::lend::LOG_BYTES`; under KVM the same seconds write far more).
    let floods = [
        "/proc/1/fd/1",
        "/proc/1/fd/2",
        "/dev/console",
        "/dev/kmsg",
        "/dev/ttyS0",
        "/dev/hvc0",
        "/.space/run/fill",
    ];
    // A device that does not exist is skipped: a write would make a file in the sandbox's
    // own /dev (its memory).
    for target in floods {
        let script = format!(
            "case {target} in /dev/*) [ -e {target} ] || {{ echo no {target}; exit 0; }};; esac; \
             timeout 20 dd if=/dev/zero of={target} bs=64k count=4800 2>&1 | tail -n1; \
             timeout 10 sh -c 'yes AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA >{target}' 2>&1 | tail -n1; true"
        );
        let body = json!({"shell": script, "timeout_seconds": 120, "wait": true});
        // A starved agent may miss its keepalive during the previous flood and dial in
        // again: a 503 is asked again (as `echo` does).
        let mut out = h.try_cmd(&v, body.clone()).await;
        for _ in 0..30 {
            if out.0 != 503 {
                break;
            }
            eprintln!("NOTE [{rt}] {target}: 503, asking again: {}", out.1);
            tokio::time::sleep(Duration::from_secs(1)).await;
            out = h.try_cmd(&v, body.clone()).await;
        }
        assert_eq!(out.0, 201, "{target}: {}", out.1);
        let (now, disk) = host_bytes(&h, &v);
        eprintln!(
            "[{rt}] flood {target}: {}; host bytes outside the disk {before} -> {now}, disk {disk}",
            out.1["stdout"]
                .as_str()
                .unwrap_or_default()
                .trim()
                .replace('\n', " / ")
        );
        assert!(
            now <= before + (2 << 20),
            "flooding {target} grew the host's sandbox directory from {before} to {now} bytes"
        );
        // The image: the quota, ext4's own room (1/32, at least 16 MiB) and a qcow2's metadata.
        assert!(
            disk <= (disk_mib + 16 + 8) << 20
                || !h.rt.eq("gvisor") && disk <= (disk_mib + 256) << 20,
            "the disk image takes {disk} bytes for a quota of {disk_mib} MiB"
        );
    }
    // The same through a user namespace that lifted the run directory's read-only flag.
    let out = h
        .sh(
            &v,
            &format!(
                "{PROBE} userns sh -c '{PROBE} remount_rw /.space/run; \
                 dd if=/dev/zero of=/.space/run/fill2 bs=1M count=200 2>&1 | tail -n1'; true"
            ),
        )
        .await;
    let (now, _) = host_bytes(&h, &v);
    eprintln!(
        "[{rt}] flood through a remount: {}; {before} -> {now}",
        out["stdout"]
    );
    assert!(now <= before + (2 << 20), "{before} -> {now} bytes: {out}");
    assert!(
        run_dir_extras(&h, &v).is_empty(),
        "{:?}",
        run_dir_extras(&h, &v)
    );
    h.healthy("host_disk_floods", Some(&v)).await;
    h.finish(&[&v]).await;
}

/// Descriptors the server process holds on sockets bound at `socket` (its listener, and
/// the connections it accepted there, which /proc/net/unix names by the listener's path,
/// bound beside `socket` and renamed). An accepted socket lives in the network namespace
/// of the side that connected: under gVisor, runsc's gofer's.
fn server_fds_on(pid: u32, sb: &str, socket: &std::path::Path) -> usize {
    let prefix = socket.to_string_lossy().into_owned();
    let mut views = vec!["/proc/self/net/unix".to_string()];
    views.extend(
        sandbox_processes(sb)
            .iter()
            .map(|p| format!("/proc/{p}/net/unix")),
    );
    let inodes: BTreeSet<String> = views
        .iter()
        .flat_map(|v| {
            std::fs::read_to_string(v)
                .unwrap_or_default()
                .lines()
                .filter_map(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    (f.len() >= 8 && f[7].starts_with(&prefix)).then(|| f[6].to_string())
                })
                .collect::<Vec<_>>()
        })
        .collect();
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|t| {
            t.to_string_lossy()
                .strip_prefix("socket:[")
                .and_then(|r| r.strip_suffix(']'))
                .map(str::to_string)
        })
        .filter(|i| inodes.contains(i))
        .count()
}

/// The most descriptors the server may hold for one sandbox's agent socket: its listener,
/// the live connection, 4 handshakes in progress, and one just accepted in the place of
/// the oldest of those.
const MAX_AGENT_SOCKET_FDS: usize = 7;

async fn agent_socket_flood(rt: &'static str) {
    if rt != "gvisor" {
        // A microVM's agent talks over a virtio-serial port: QEMU holds the one connection
        // to the host's socket, and nothing in the guest can open another.
        eprintln!("[{rt}] agent_socket_flood: no host socket inside a microVM");
        return;
    }
    let Some(mut h) = setup(rt, &[]).await else {
        return;
    };
    let v = h.victim(json!({})).await;
    let socket =
        h.s.data_dir()
            .join("sandboxes")
            .join(&v)
            .join("run/agent.sock");
    let alone = server_fds_on(h.s.pid().unwrap(), &v, &socket);
    assert_eq!(alone, 2, "the listener and the agent's connection");
    let holder = start_cmd(
        &h,
        &v,
        json!({"shell": format!("{PROBE} hold_unix /.space/run/agent.sock 200 600 >/tmp/hold.out 2>&1")}),
    )
    .await;
    let made = h
        .sh_ok(
            &v,
            "while ! grep -q made /tmp/hold.out; do sleep 0.1; done; cat /tmp/hold.out",
        )
        .await;
    eprintln!("[{rt}] {}", made.trim());
    // While they are held (and redialled as the server closes them): a bounded number of
    // descriptors, and the agent answers.
    let mut most = 0;
    for _ in 0..10 {
        most = most.max(server_fds_on(h.s.pid().unwrap(), &v, &socket));
        assert!(h.echo("agent_socket_flood", &v).await, "the victim failed");
    }
    eprintln!("[{rt}] server descriptors on the agent socket during the flood: at most {most}");
    assert!(
        most <= MAX_AGENT_SOCKET_FDS,
        "the server held {most} descriptors for one agent socket"
    );
    // A server restart while the flood goes on: the agent gets back in.
    h.s.kill_and_restart();
    h.healthy("agent_socket_flood (after a restart)", Some(&v))
        .await;
    let mut most = 0;
    for _ in 0..10 {
        most = most.max(server_fds_on(h.s.pid().unwrap(), &v, &socket));
        assert!(h.echo("agent_socket_flood", &v).await, "the victim failed");
    }
    assert!(
        most <= MAX_AGENT_SOCKET_FDS,
        "after the restart: {most} descriptors"
    );
    let (st, r) =
        h.s.post(
            &format!("/v1/sandboxes/{v}/commands/{holder}/signal"),
            json!({"signal": "KILL"}),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    wait_cmd(&h, &v, &holder, Duration::from_secs(60)).await;
    h.healthy("agent_socket_flood", Some(&v)).await;
    h.finish(&[&v]).await;
}

// ───────────── issue 11, points 6 and 7: runaway commands, memory, a stuck agent, kernel helpers ─────────────
//
// Point 6: a memory bomb kills a process, never the sandbox (20 repeats, several shapes);
// a timeout ends everything a command started, even after its main process exited, and
// says so (`timed_out`, never a clean exit); nothing waits forever on a stuck agent.
// Point 7: no program planted by root inside a microVM is ever run by its kernel as a
// usermode helper (modprobe, request-key, core_pattern pipes, uevent helpers, ...).

/// How long a request may take before the test calls it hung (a loaded TCG microVM is slow).
const ANSWER_DEADLINE: Duration = Duration::from_secs(180);

/// A request that must be answered (any status) within [`ANSWER_DEADLINE`].
async fn answered(h: &Hostile, what: &str, sb: &str, body: Value) -> (u16, Value) {
    match tokio::time::timeout(ANSWER_DEADLINE, h.try_cmd(sb, body)).await {
        Ok(answer) => answer,
        Err(_) => {
            let (_, v) = h.s.get(&format!("/v1/sandboxes/{sb}")).await;
            panic!("{what}: no answer within {ANSWER_DEADLINE:?}; the sandbox is {v}")
        }
    }
}

/// Memory bombs in a sandbox of 256 MiB, 20 times, in shapes that put the memory where a
/// host kill would pick the wrong process: one process, two at once, and one after many
/// processes came and went (which grows gVisor's own kernel). Each time the bomb's
/// command ends with its process killed (`oom_killed`, or a clear non-zero exit), a
/// `sleep` started before it still runs, the agent answers, and the sandbox stays.
async fn memory_bombs(rt: &'static str) {
    let _heavy = heavy().await;
    let Some(h) = setup(rt, &[]).await else {
        return;
    };
    let v = h
        .victim(json!({"resources": {"vcpus": 2, "memory_mib": 256, "pids": 256}}))
        .await;
    let sleeper = start_cmd(&h, &v, json!({"argv": ["sleep", "100000"]})).await;
    let bomb = "awk 'BEGIN { s = \"x\"; while (1) s = s s }'";
    // 20 repeats where the failure was intermittent: gVisor, whose Sentry the host's memcg
    // sometimes killed. A microVM's own kernel kills the bomb the same way every time, and
    // each repeat costs a TCG guest about 15 s of both cores: each of the three shapes
    // twice there.
    let repeats = if rt == "gvisor" { 20 } else { 6 };
    let mut oom_killed = 0;
    for i in 0..repeats {
        let script = match i % 3 {
            0 => bomb.to_string(),
            1 => format!("{bomb} & {bomb}"),
            _ => format!("for i in $(seq 1 150); do sleep 3 & done; wait; {bomb}"),
        };
        let (st, out) = answered(
            &h,
            "memory bomb",
            &v,
            json!({"shell": script, "timeout_seconds": 600, "wait": true}),
        )
        .await;
        assert_eq!(st, 201, "repeat {i}: {out}");
        let r = &out["result"];
        assert!(
            !r.is_null(),
            "repeat {i}: the bomb took the sandbox down: {out}; {}",
            h.s.get(&format!("/v1/sandboxes/{v}")).await.1
        );
        assert!(
            r["oom_killed"] == true || r["signal"] == 9 || r["exit_code"].as_i64() != Some(0),
            "repeat {i}: the bomb ended cleanly: {out}"
        );
        assert_ne!(
            r["timed_out"], true,
            "repeat {i}: ran to its timeout: {out}"
        );
        if r["oom_killed"] == true {
            oom_killed += 1;
        }
        let (_, s) =
            h.s.get(&format!("/v1/sandboxes/{v}/commands/{sleeper}"))
                .await;
        assert_eq!(
            s["state"], "running",
            "repeat {i}: the sleep beside it: {s}"
        );
        let (st, ok) = answered(
            &h,
            "echo after a memory bomb",
            &v,
            json!({"argv": ["echo", "ok"], "wait": true}),
        )
        .await;
        assert_eq!(
            (st, ok["stdout"].as_str()),
            (201, Some("ok\n")),
            "repeat {i}: {ok}"
        );
    }
    eprintln!("[{rt}] memory bombs: {oom_killed} of {repeats} said oom_killed");
    assert!(oom_killed > 0, "no bomb was reported as oom_killed");
    assert_eq!(
        h.sh_ok(&v, "ps -o args | grep -c '^sleep 100000'").await,
        "1\n"
    );
    h.s.post(
        &format!("/v1/sandboxes/{v}/commands/{sleeper}/signal"),
        json!({"signal": "KILL"}),
    )
    .await;
    wait_cmd(&h, &v, &sleeper, Duration::from_secs(60)).await;
    h.healthy("memory_bombs", Some(&v)).await;
    h.finish(&[&v]).await;
}

/// Commands that outlive their main process or leave it: a timeout ends all of it and
/// says `timed_out`; afterwards nothing of it runs and new commands start.
async fn runaway_commands(rt: &'static str) {
    let _heavy = heavy().await;
    let Some(h) = setup(rt, &[]).await else {
        return;
    };
    let body = json!({"resources": {"vcpus": 2, "memory_mib": 256, "pids": 128}});
    let v = h.victim(body.clone()).await;

    // A fork bomb whose first shell returns at once (the classic `:(){ :|:& };:`). Its
    // shells exit at their first failed fork, so it may die out by itself (quickly under
    // gVisor): either it ended so before its timeout or the timeout killed all of it, and
    // nothing of it is left.
    let (st, out) = answered(
        &h,
        "fork bomb",
        &v,
        json!({"shell": "b() { b | b & }; b", "timeout_seconds": 15, "wait": true}),
    )
    .await;
    assert_eq!(st, 201, "{out}");
    eprintln!("[{rt}] classic fork bomb: {}", out["result"]);
    assert!(!out["result"].is_null(), "fork bomb: {out}");
    assert_eq!(process_count(&h, &v).await, 0, "fork bomb leftovers");
    // One whose processes fork forever whatever fails, started in the background by a
    // shell that exits at once: only the timeout ends it, and it says so.
    let (st, out) = answered(
        &h,
        "persistent fork bomb",
        &v,
        json!({"shell": format!("{PROBE} forkbomb & exit 0"), "timeout_seconds": 15, "wait": true}),
    )
    .await;
    assert_eq!(st, 201, "{out}");
    assert_eq!(out["state"], "timed_out", "fork bomb: {out}");
    assert_eq!(out["result"]["timed_out"], true, "fork bomb: {out}");
    assert_ne!(
        out["result"]["exit_code"], 0,
        "a timed-out bomb exited 0: {out}"
    );
    assert_eq!(process_count(&h, &v).await, 0, "fork bomb leftovers");
    h.sh_ok(&v, "echo after the bomb").await;

    // Escapees whose parent exits before the timeout: setsid, a double fork, nohup.
    let (st, out) = answered(
        &h,
        "escapees",
        &v,
        json!({
            "shell": "setsid sh -c 'sleep 1001' & (sh -c 'sleep 1002 &' &); nohup sleep 1003 >/dev/null 2>&1 & exit 0",
            "timeout_seconds": 3, "wait": true
        }),
    )
    .await;
    assert_eq!(st, 201, "{out}");
    assert_eq!(out["result"]["timed_out"], true, "escapees: {out}");
    assert_ne!(out["result"]["exit_code"], 0, "escapees: {out}");
    let left = h
        .sh(&v, "ps -o args | grep -c '^sleep 100[123]' || true")
        .await;
    assert_eq!(left["stdout"], "0\n", "escaped the timeout: {left}");

    // A command whose processes all end before its timeout ends then, as it exited.
    let out = h
        .try_cmd(
            &v,
            json!({"shell": "(sleep 1; echo late) & echo early", "timeout_seconds": 60, "wait": true}),
        )
        .await
        .1;
    assert_eq!(out["result"]["exit_code"], 0, "{out}");
    assert_eq!(out["result"]["timed_out"], false, "{out}");
    assert_eq!(out["stdout"], "early\nlate\n", "{out}");

    // With every process slot taken, a command still gets a clear answer, and so does
    // one whose program cannot be run; neither stays `starting`.
    let filler = start_cmd(
        &h,
        &v,
        json!({"shell": "while :; do sleep 1000 & done", "timeout_seconds": 30}),
    )
    .await;
    let (st, out) = answered(
        &h,
        "a command with the pids limit reached",
        &v,
        json!({"shell": "echo started; sleep 1 & wait", "wait": true}),
    )
    .await;
    assert_eq!(st, 201, "{out}");
    assert!(!out["result"].is_null(), "{out}");
    eprintln!("[{rt}] with pids exhausted: {}", out["result"]);
    let (st, out) = answered(
        &h,
        "a program that cannot run",
        &v,
        json!({"argv": ["/no/such/program"], "wait": true}),
    )
    .await;
    assert_eq!(st, 201, "{out}");
    assert_eq!(out["result"]["exit_code"], 127, "{out}");
    let (_, list) = h.s.get(&format!("/v1/sandboxes/{v}/commands")).await;
    assert!(
        list["commands"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["state"] != "starting"),
        "{list}"
    );
    let c = wait_cmd(&h, &v, &filler, Duration::from_secs(300)).await;
    assert_eq!(c["result"]["timed_out"], true, "{c}");
    assert_eq!(
        process_count(&h, &v).await,
        0,
        "the filler's sleeps are left"
    );
    h.healthy("runaway_commands", Some(&v)).await;
    h.finish(&[&v]).await;
}

/// An agent that stops answering (`SPACE_FAILPOINT=agent:wedge`: the agent blocks every
/// worker thread when it is asked to run `space-failpoint wedge SECONDS`). Requests get
/// an answer within a bound; a wedge that lasts fails the sandbox with a reason and its
/// commands end `lost`; a wedge that passes leaves the sandbox and its commands running.
async fn unresponsive_agent(rt: &'static str) {
    let Some(mut h) = setup(rt, &[]).await else {
        return;
    };
    h.s.env
        .push(("SPACE_FAILPOINT".into(), "agent:wedge".into()));
    h.s.kill_and_restart();

    // A wedge that passes: 25 s, so that the server's pings (every 10 s, 20 s to answer)
    // may or may not have dropped the connection by then, and a dropped one comes back
    // well within the 30 s the server waits for it.
    let v = h.victim(json!({})).await;
    let sleeper = start_cmd(&h, &v, json!({"argv": ["sleep", "100000"]})).await;
    let (st, out) = answered(
        &h,
        "a request that wedges the agent",
        &v,
        json!({"argv": ["space-failpoint", "wedge", "25"]}),
    )
    .await;
    eprintln!("[{rt}] wedging request: {st} {out}");
    let (st, out) = answered(
        &h,
        "a command while the agent is wedged",
        &v,
        json!({"argv": ["echo", "ok"], "wait": true}),
    )
    .await;
    eprintln!("[{rt}] a command during the wedge: {st} {out}");
    assert!(
        h.healthy("agent_wedged_briefly", Some(&v)).await,
        "the sandbox failed"
    );
    let (_, s) =
        h.s.get(&format!("/v1/sandboxes/{v}/commands/{sleeper}"))
            .await;
    assert_eq!(s["state"], "running", "{s}");

    // A wedge that lasts.
    let w = h.victim(json!({})).await;
    let sleeper = start_cmd(&h, &w, json!({"argv": ["sleep", "100000"]})).await;
    let (st, out) = answered(
        &h,
        "a request that wedges the agent for good",
        &w,
        json!({"argv": ["space-failpoint", "wedge", "0"]}),
    )
    .await;
    eprintln!("[{rt}] wedging request: {st} {out}");
    let (st, out) = answered(
        &h,
        "a command to a wedged agent",
        &w,
        json!({"argv": ["echo", "ok"], "wait": true}),
    )
    .await;
    eprintln!("[{rt}] a command to the wedged agent: {st} {out}");
    assert_ne!(
        out["stdout"], "ok\n",
        "a wedged agent ran a command (an agent built without its test hooks does: \
         FEATURES=test-hooks scripts/build.sh): {out}"
    );
    let failed = h.s.wait_state(&w, "failed", ANSWER_DEADLINE).await;
    let reason = failed.object["failure_reason"].as_str().unwrap_or_default();
    assert!(reason.contains("agent"), "{failed:?}");
    let c = wait_cmd(&h, &w, &sleeper, Duration::from_secs(60)).await;
    assert_eq!(c["state"], "lost", "{c}");
    h.healthy("agent_wedged", None).await;
    h.finish(&[&v, &w]).await;
}

/// Root in a sandbox plants a helper program wherever a kernel looks for one, then makes
/// the kernel want it (module autoloading through socket families, netlink protocols,
/// unknown binary formats and character devices; request_key with a callout; a crash
/// with a core_pattern pipe; uevents) and tries to point the helper sysctls at it. The
/// helper never runs (it would leave a marker in the sandbox and on the console), the
/// sysctl writes are refused, and in a microVM they read back as the agent set them.
async fn usermode_helpers(rt: &'static str) {
    let Some(h) = setup(rt, &[]).await else {
        return;
    };
    let v = h.victim(json!({})).await;
    let marker = format!("helper{}", random_hex());
    let helper = format!(
        "#!/bin/sh\necho \"{marker} $0 $*\" >> /helper-ran\necho \"{marker} $0\" > /dev/console\n"
    );
    h.upload(&v, "/tmp/helper", helper.into_bytes(), "0755")
        .await;
    h.sh_ok(
        &v,
        "mkdir -p /sbin /usr/sbin /usr/lib/udev && \
         for p in /sbin/modprobe /usr/sbin/modprobe /sbin/request-key /usr/sbin/request-key \
                  /sbin/hotplug /sbin/poweroff /sbin/reboot /sbin/bridge-stp /usr/lib/udev/helper; do \
           rm -f $p; cp /tmp/helper $p; done",
    )
    .await;

    // Module autoloading: unloaded socket families, a netlink protocol, a binary format.
    for (family, ty, proto) in [
        ("3", "2", "0"),   // AF_AX25, the reported one
        ("4", "2", "0"),   // AF_IPX
        ("5", "2", "0"),   // AF_APPLETALK
        ("9", "5", "0"),   // AF_X25
        ("21", "5", "0"),  // AF_RDS
        ("33", "2", "0"),  // AF_RXRPC
        ("16", "3", "29"), // AF_NETLINK, an unregistered protocol
    ] {
        h.probe(&v, &["socket", family, ty, proto]).await;
    }
    h.sh(
        &v,
        "printf '\\001\\002\\003\\004junk' > /tmp/weird && chmod +x /tmp/weird && /tmp/weird; \
         mknod /tmp/cdev c 250 0 && cat /tmp/cdev; true",
    )
    .await;
    // request-key with a callout.
    h.probe(&v, &["request_key", "user", "space:test", "callout-info"])
        .await;
    // The sysctls that name helpers, and a crash that would use a core_pattern pipe.
    let writes = h
        .sh(
            &v,
            "for f in kernel/modprobe kernel/core_pattern kernel/poweroff_cmd kernel/hotplug; do \
               echo '|/tmp/helper' > /proc/sys/$f 2>/dev/null && echo wrote $f; done; \
             echo 0 > /proc/sys/kernel/modules_disabled 2>/dev/null && echo wrote modules_disabled; \
             echo '4294967295 4294967295' > /proc/sys/kernel/usermodehelper/bset 2>/dev/null && echo wrote bset; \
             echo /tmp/helper > /sys/kernel/uevent_helper 2>/dev/null && echo wrote uevent_helper; \
             for u in /sys/class/mem/null/uevent /sys/devices/virtual/mem/null/uevent; do \
               echo add > $u 2>/dev/null && echo wrote $u; done; \
             sh -c 'ulimit -c unlimited; kill -SEGV $$'; true",
        )
        .await;
    eprintln!("[{rt}] helper sysctl writes: {}", writes["stdout"]);
    assert_eq!(
        writes["stdout"], "",
        "a helper setting was writable: {writes}"
    );

    // Module loads happen asynchronously; give the kernel's helpers time to have run.
    h.sh_ok(&v, "sleep 3").await;
    let ran = h.sh(&v, "cat /helper-ran 2>/dev/null; true").await;
    assert_eq!(ran["stdout"], "", "a planted helper ran: {ran}");
    let console = std::fs::read_to_string(
        h.s.data_dir()
            .join("sandboxes")
            .join(&v)
            .join("console.log"),
    )
    .unwrap_or_default();
    assert!(
        !console.contains(&marker),
        "a planted helper ran: {console}"
    );
    if rt == "microvm" {
        let values = h
            .sh_ok(
                &v,
                "cd /proc/sys/kernel && for f in modprobe modules_disabled core_pattern poweroff_cmd usermodehelper/bset usermodehelper/inheritable; do \
                   printf '%s=%s\\n' $f \"$(cat $f)\"; done; \
                 printf 'uevent_helper=%s\\n' \"$(cat /sys/kernel/uevent_helper 2>/dev/null)\"",
            )
            .await;
        eprintln!("[{rt}] helper settings: {values}");
        let values = values.replace('\t', " ");
        for want in [
            "modprobe=\n",
            "modules_disabled=1\n",
            "core_pattern=core\n",
            "poweroff_cmd=\n",
            "usermodehelper/bset=0 0\n",
            "usermodehelper/inheritable=0 0\n",
            "uevent_helper=\n",
        ] {
            assert!(values.contains(want), "want {want:?} in {values}");
        }
    }
    h.healthy("usermode_helpers", Some(&v)).await;
    h.finish(&[&v]).await;
}

macro_rules! hostile {
    ($($case:ident),* $(,)?) => {
        mod gvisor {
            $(
                #[tokio::test]
                async fn $case() {
                    super::$case("gvisor").await;
                }
            )*
        }
        mod microvm {
            $(
                #[tokio::test]
                async fn $case() {
                    super::$case("microvm").await;
                }
            )*
        }
    };
}

hostile!(
    resource_abuse,
    pids_bombs,
    host_probes,
    api_abuse,
    snapshot_traps,
    lent_files,
    host_disk_floods,
    agent_socket_flood,
    // issue 11, points 6 and 7
    memory_bombs,
    runaway_commands,
    unresponsive_agent,
    usermode_helpers,
);

/// Removes a host file when dropped (a test's own marker, whatever way the test ends).
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
