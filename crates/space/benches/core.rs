//! Core benchmark: our API against raw `runsc` doing the same work, in one run.
//!
//! 1. create-to-ready: `POST /v1/sandboxes` + long-poll of the operation until it
//!    succeeded, against `runsc create` + `runsc start` of the same OCI bundle.
//! 2. the `true` round trip: `POST .../commands {"argv":["true"],"wait":true}`
//!    against `runsc exec <container> /bin/true`.
//! 3. idle RSS: summed VmRSS of every host process of one idle sandbox (runsc
//!    sandbox, gofer and their systrap stubs), ours against a raw one.
//!
//! Run it with `scripts/bench.sh` (which builds the agent and the busybox
//! template first), or `cargo bench -p space --bench core` once they exist.
//! Timings are reported, never asserted; anything that functionally breaks panics.

#[path = "../tests/common/mod.rs"]
mod common;

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::TestServer;
use serde_json::{json, Value};

/// Timed creates per side.
const CREATES: usize = 10;
/// Untimed `true` round trips per side before the timed ones.
const EXEC_WARMUPS: usize = 5;
/// Timed `true` round trips per side.
const EXECS: usize = 200;
/// cgroup parent of the raw containers (ours use `space`).
const RAW_CGROUP_PARENT: &str = "space-bench";
/// Platform and global flags exactly as `space-runtime`'s gVisor driver passes them.
const PLATFORM: &str = "systrap";

fn main() {
    let templates = common::templates_dir();
    assert!(
        templates.join("busybox").join("template.json").is_file(),
        "no busybox template in {}; run scripts/bench.sh (or `space admin prepare-template busybox --templates-dir {}`)",
        templates.display(),
        templates.display()
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");

    let facts = machine_facts();
    eprintln!("bench: {facts}");
    let server = rt.block_on(TestServer::start());

    // Our long-lived sandbox (also the warm-up of our create path). Its OCI
    // bundle is the one the raw side runs.
    let ours = rt.block_on(server.create("busybox"));
    let our_bundle = server
        .data_dir()
        .join("sandboxes")
        .join(&ours)
        .join("bundle");
    let config: Value = serde_json::from_slice(
        &std::fs::read(our_bundle.join("config.json")).expect("reading our config.json"),
    )
    .expect("our config.json is JSON");
    let raw = Raw::new(
        &config,
        &server.data_dir().join("agent").join("space-agent"),
    );

    // The raw long-lived sandbox (also the warm-up of the raw create path).
    let raw_main = raw.id("main");
    raw.prepare(&raw_main);
    raw.create_start(&raw_main);

    // 1. create-to-ready, interleaved so that background load hits both sides alike.
    eprintln!("bench: create-to-ready x{CREATES} (each side)");
    let mut ours_create = Vec::new();
    let mut raw_create = Vec::new();
    for i in 0..CREATES {
        let (sb, took) = rt.block_on(timed_create(&server));
        ours_create.push(took);
        rt.block_on(server.destroy(&sb));

        let id = raw.id(&format!("c{i}"));
        raw.prepare(&id);
        raw_create.push(raw.create_start(&id));
        raw.delete(&id);
    }

    // 2. the `true` round trip.
    eprintln!("bench: exec true x{EXECS} (each side, after {EXEC_WARMUPS} warm-ups)");
    for _ in 0..EXEC_WARMUPS {
        rt.block_on(timed_true(&server, &ours));
        raw.exec_true(&raw_main);
    }
    let mut ours_exec = Vec::new();
    let mut raw_exec = Vec::new();
    for _ in 0..EXECS {
        ours_exec.push(rt.block_on(timed_true(&server, &ours)));
        raw_exec.push(raw.exec_true(&raw_main));
    }

    // 3. idle RSS, once both sandboxes are quiet.
    eprintln!("bench: waiting for both sandboxes to go quiet");
    let raw_bundle = raw.bundle(&raw_main);
    let quiet = wait_quiet(&[&our_bundle, &raw_bundle]);
    let ours_mem = sandbox_memory(&our_bundle);
    let raw_mem = sandbox_memory(&raw_bundle);
    let idle_cpu = idle_cpu_ms_per_s(&[&our_bundle, &raw_bundle], Duration::from_secs(3));
    assert!(
        ours_mem.runsc >= 2,
        "expected runsc-sandbox and runsc-gofer of {ours}, found {}",
        ours_mem.runsc
    );
    assert!(
        raw_mem.runsc >= 2,
        "expected runsc-sandbox and runsc-gofer of {raw_main}, found {}",
        raw_mem.runsc
    );
    // The agent (PID 1) as the sandbox's own kernel sees it; read after the host figures.
    let cmd = rt.block_on(server.run(&ours, &["cat", "/proc/1/status"]));
    assert_eq!(cmd["result"]["exit_code"], 0, "{cmd}");
    let ours_agent_kb = vm_rss_kb(cmd["stdout"].as_str().unwrap_or_default());
    let raw_agent_kb = vm_rss_kb(&raw.exec_output(&raw_main, &["/bin/cat", "/proc/1/status"]));

    // Clean up, then check that nothing of ours or the raw side is left running.
    rt.block_on(server.destroy(&ours));
    raw.delete(&raw_main);
    let server_root = server.runsc_root();
    let raw_root = raw.root.clone();
    drop(raw);
    drop(server);
    assert_no_runsc_left(&[&server_root, &raw_root]);

    // The table.
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let mib = |kb: u64| kb as f64 / 1024.0;
    println!();
    println!("space core benchmark: ours vs raw runsc, same bundle, same run");
    println!("machine: {facts}");
    println!(
        "{:<38} {:<7} {:>12} {:>14} {:>8}",
        "metric", "stat", "ours", "raw runsc", "ratio"
    );
    let row = |metric: &str, stat: &str, ours: f64, raw: f64, unit: &str| {
        println!(
            "{:<38} {:<7} {:>12} {:>14} {:>7.2}x",
            metric,
            stat,
            format!("{ours:.1} {unit}"),
            format!("{raw:.1} {unit}"),
            ours / raw
        );
    };
    let create_metric = format!("create-to-ready (n={CREATES})");
    row(
        &create_metric,
        "median",
        ms(percentile(&ours_create, 50)),
        ms(percentile(&raw_create, 50)),
        "ms",
    );
    row(
        &create_metric,
        "p95",
        ms(percentile(&ours_create, 95)),
        ms(percentile(&raw_create, 95)),
        "ms",
    );
    let exec_metric = format!("exec `true` round trip (n={EXECS})");
    row(
        &exec_metric,
        "p50",
        ms(percentile(&ours_exec, 50)),
        ms(percentile(&raw_exec, 50)),
        "ms",
    );
    row(
        &exec_metric,
        "p95",
        ms(percentile(&ours_exec, 95)),
        ms(percentile(&raw_exec, 95)),
        "ms",
    );
    row(
        &format!(
            "idle RSS, sum VmRSS ({}/{} procs)",
            ours_mem.procs, raw_mem.procs
        ),
        "",
        mib(ours_mem.rss_kb),
        mib(raw_mem.rss_kb),
        "MiB",
    );
    row(
        "idle PSS, sum Pss (extra)",
        "",
        mib(ours_mem.pss_kb),
        mib(raw_mem.pss_kb),
        "MiB",
    );
    row(
        "idle CPU of host processes (extra)",
        "",
        idle_cpu[0],
        idle_cpu[1],
        "ms/s",
    );
    match (ours_agent_kb, raw_agent_kb) {
        (Some(o), Some(r)) => row("agent VmRSS in sandbox (extra)", "", mib(o), mib(r), "MiB"),
        (o, r) => println!(
            "{:<38} {:<7} {:>12} {:>14}",
            "agent VmRSS in sandbox (extra)",
            "",
            o.map_or("n/a".into(), |k| format!("{:.1} MiB", mib(k))),
            r.map_or("n/a".into(), |k| format!("{:.1} MiB", mib(k))),
        ),
    }
    println!(
        "notes: ratio = ours / raw. raw create = runsc create + start only (ours also waits for the \
         agent to connect); raw exec = a whole `runsc exec` process per call; idle = {}; \
         the raw agent has no host to dial and retries every 500 ms.",
        if quiet {
            "under 10% CPU and RSS within 1% for 1 s"
        } else {
            "NOT quiet after 15 s, measured anyway"
        }
    );
}

/// `POST /v1/sandboxes` and long-poll until the operation succeeded.
async fn timed_create(s: &TestServer) -> (String, Duration) {
    let start = Instant::now();
    let (status, op) = s
        .post("/v1/sandboxes", json!({ "template": "busybox" }))
        .await;
    assert_eq!(status, 202, "{op}");
    let op_id = op["id"].as_str().expect("operation id").to_string();
    loop {
        let (status, op) = s.get(&format!("/v1/operations/{op_id}?wait=30s")).await;
        assert_eq!(status, 200, "{op}");
        match op["status"].as_str().unwrap_or_default() {
            "succeeded" => {
                let took = start.elapsed();
                let sb = op["sandbox_id"].as_str().expect("sandbox id").to_string();
                return (sb, took);
            }
            "failed" | "cancelled" => panic!("create failed: {op}\n{}", s.log()),
            _ => assert!(
                start.elapsed() < Duration::from_secs(120),
                "create did not end: {op}"
            ),
        }
    }
}

/// One `true` through our API.
async fn timed_true(s: &TestServer, sb: &str) -> Duration {
    let start = Instant::now();
    let (status, cmd) = s
        .post(
            &format!("/v1/sandboxes/{sb}/commands"),
            json!({ "argv": ["true"], "wait": true }),
        )
        .await;
    let took = start.elapsed();
    assert_eq!(status, 201, "{cmd}");
    assert_eq!(cmd["state"], "exited", "{cmd}");
    assert_eq!(cmd["result"]["exit_code"], 0, "{cmd}");
    took
}

/// Raw runsc containers of the bench: one runsc root, one bundle per container.
struct Raw {
    dir: tempfile::TempDir,
    root: PathBuf,
    agent_dir: PathBuf,
    config: Value,
}

impl Raw {
    fn new(config: &Value, agent: &Path) -> Raw {
        let dir = tempfile::Builder::new()
            .prefix("spb")
            .tempdir_in("/tmp")
            .expect("tempdir");
        let root = dir.path().join("root");
        let agent_dir = dir.path().join("agent");
        for d in [&root, &agent_dir] {
            std::fs::create_dir_all(d).expect("raw dirs");
        }
        std::fs::copy(agent, agent_dir.join("space-agent")).expect("copying the agent");
        Raw {
            dir,
            root,
            agent_dir,
            config: config.clone(),
        }
    }

    /// A container id unique to this process (cgroup names are machine-wide).
    fn id(&self, name: &str) -> String {
        format!("b{}-{name}", std::process::id())
    }

    fn cdir(&self, id: &str) -> PathBuf {
        self.dir.path().join("c").join(id)
    }

    fn bundle(&self, id: &str) -> PathBuf {
        self.cdir(id).join("bundle")
    }

    /// Our config.json with its own cgroup, run dir (holding a fresh agent
    /// token) and agent dir; everything else — root.path at the template
    /// rootfs, mounts, resources, process — as our server wrote it.
    fn prepare(&self, id: &str) {
        let c = self.cdir(id);
        let run = c.join("run");
        for d in [self.bundle(id), c.join("overlay"), run.clone()] {
            std::fs::create_dir_all(&d).expect("raw container dirs");
        }
        std::fs::write(run.join("token"), "raw-bench-token\n").expect("token");
        let mut config = self.config.clone();
        config["linux"]["cgroupsPath"] = json!(format!("/{RAW_CGROUP_PARENT}/{id}"));
        for m in config["mounts"].as_array_mut().expect("mounts") {
            match m["destination"].as_str() {
                Some("/.space/run") => m["source"] = json!(run),
                Some("/.space/bin") => m["source"] = json!(self.agent_dir),
                _ => {}
            }
        }
        std::fs::write(
            self.bundle(id).join("config.json"),
            serde_json::to_vec_pretty(&config).expect("config"),
        )
        .expect("writing config.json");
    }

    /// The global flags our driver gives `runsc` (create and start).
    fn globals(&self, id: &str) -> Vec<OsString> {
        vec![
            "--root".into(),
            self.root.clone().into(),
            format!("--platform={PLATFORM}").into(),
            "--network=none".into(),
            "--host-uds=open".into(),
            format!(
                "--overlay2=root:dir={}",
                self.cdir(id).join("overlay").display()
            )
            .into(),
            "--cpu-num-from-quota".into(),
        ]
    }

    /// The global flags our driver gives every other runsc call.
    fn short_globals(&self) -> Vec<OsString> {
        vec![
            "--root".into(),
            self.root.clone().into(),
            format!("--platform={PLATFORM}").into(),
            "--network=none".into(),
            "--host-uds=open".into(),
        ]
    }

    /// `runsc create` + `runsc start`, timed together.
    fn create_start(&self, id: &str) -> Duration {
        // The sandbox inherits create's stdio: a file, never a pipe.
        let console_path = self.cdir(id).join("console.log");
        let console = std::fs::File::create(&console_path).expect("console log");
        let console_err = console.try_clone().expect("console log");
        let mut create = Command::new("runsc");
        create
            .args(self.globals(id))
            .arg("create")
            .arg("--bundle")
            .arg(self.bundle(id))
            .arg(id)
            .stdin(Stdio::null())
            .stdout(console)
            .stderr(console_err)
            .process_group(0);
        let mut start = Command::new("runsc");
        start
            .args(self.globals(id))
            .arg("start")
            .arg(id)
            .stdin(Stdio::null());
        let t0 = Instant::now();
        let status = create.status().expect("running runsc create");
        if !status.success() {
            panic!(
                "runsc create {id}: {status}\n{}",
                std::fs::read_to_string(&console_path).unwrap_or_default()
            );
        }
        let out = start.output().expect("running runsc start");
        let took = t0.elapsed();
        assert!(
            out.status.success(),
            "runsc start {id}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(&console_path).unwrap_or_default()
        );
        took
    }

    /// `runsc exec <id> /bin/true`, timed.
    fn exec_true(&self, id: &str) -> Duration {
        let mut cmd = Command::new("runsc");
        cmd.args(self.short_globals())
            .arg("exec")
            .arg(id)
            .arg("/bin/true")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let t0 = Instant::now();
        let out = cmd.output().expect("running runsc exec");
        let took = t0.elapsed();
        assert!(
            out.status.success(),
            "runsc exec {id} /bin/true: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        took
    }

    fn exec_output(&self, id: &str, argv: &[&str]) -> String {
        let out = Command::new("runsc")
            .args(self.short_globals())
            .arg("exec")
            .arg(id)
            .args(argv)
            .stdin(Stdio::null())
            .output()
            .expect("running runsc exec");
        assert!(
            out.status.success(),
            "runsc exec {id} {argv:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `runsc delete --force`, wait for its processes, remove its cgroups and files.
    fn delete(&self, id: &str) {
        let out = Command::new("runsc")
            .args(self.short_globals())
            .args(["delete", "--force", id])
            .stdin(Stdio::null())
            .output()
            .expect("running runsc delete");
        assert!(
            out.status.success(),
            "runsc delete --force {id}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let needle = format!("--bundle={}", self.bundle(id).display());
        let t0 = Instant::now();
        while !runsc_processes(|a| a == needle).is_empty() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "processes of raw container {id} did not exit"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        remove_cgroups(id);
        std::fs::remove_dir_all(self.cdir(id)).expect("removing raw container dir");
    }
}

impl Drop for Raw {
    /// Whatever a panic left behind: containers, cgroups (the temp dir goes with `dir`).
    fn drop(&mut self) {
        if let Ok(out) = Command::new("runsc")
            .args(self.short_globals())
            .args(["list", "--quiet"])
            .stdin(Stdio::null())
            .output()
        {
            for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = Command::new("runsc")
                    .args(self.short_globals())
                    .args(["delete", "--force", id])
                    .stdin(Stdio::null())
                    .output();
                remove_cgroups(id);
            }
        }
        for c in cgroup_dirs() {
            let _ = std::fs::remove_dir(c.join(RAW_CGROUP_PARENT));
        }
    }
}

/// `/sys/fs/cgroup` and each v1 controller under it.
fn cgroup_dirs() -> Vec<PathBuf> {
    let base = PathBuf::from("/sys/fs/cgroup");
    let mut dirs = vec![base.clone()];
    dirs.extend(
        std::fs::read_dir(&base)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_dir()),
    );
    dirs
}

fn remove_cgroups(id: &str) {
    for c in cgroup_dirs() {
        let _ = std::fs::remove_dir(c.join(RAW_CGROUP_PARENT).join(id));
    }
}

/// Pids of processes whose argv0 is `runsc*` and one of whose arguments matches.
fn runsc_processes(matches: impl Fn(&str) -> bool) -> Vec<i32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let mut args = cmdline.split(|b| *b == 0);
        let argv0 = args.next().unwrap_or_default();
        let name = argv0.rsplit(|b| *b == b'/').next().unwrap_or_default();
        if !name.starts_with(b"runsc") {
            continue;
        }
        if args.any(|a| matches(&String::from_utf8_lossy(a))) {
            pids.push(pid);
        }
    }
    pids
}

/// `pid -> ppid` of every process.
fn parents() -> Vec<(i32, i32)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // The fields after the parenthesised command name: state, ppid, ...
        if let Some(ppid) = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse().ok())
        {
            out.push((pid, ppid));
        }
    }
    out
}

/// The runsc processes of the sandbox with this bundle and all their descendants.
fn sandbox_pids(bundle: &Path) -> (usize, Vec<i32>) {
    let needle = format!("--bundle={}", bundle.display());
    let roots = runsc_processes(|a| a == needle);
    let tree = parents();
    let mut all = roots.clone();
    let mut i = 0;
    while i < all.len() {
        let p = all[i];
        for (child, parent) in &tree {
            if *parent == p && !all.contains(child) {
                all.push(*child);
            }
        }
        i += 1;
    }
    (roots.len(), all)
}

/// A `kB` field of a /proc status-like text.
fn kb_field(text: &str, field: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

fn vm_rss_kb(status: &str) -> Option<u64> {
    kb_field(status, "VmRSS:")
}

struct Memory {
    runsc: usize,
    procs: usize,
    rss_kb: u64,
    pss_kb: u64,
}

fn sandbox_memory(bundle: &Path) -> Memory {
    let (runsc, pids) = sandbox_pids(bundle);
    let mut m = Memory {
        runsc,
        procs: 0,
        rss_kb: 0,
        pss_kb: 0,
    };
    for pid in pids {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue;
        };
        m.procs += 1;
        m.rss_kb += vm_rss_kb(&status).unwrap_or(0);
        let rollup =
            std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
        m.pss_kb += kb_field(&rollup, "Pss:").unwrap_or(0);
    }
    m
}

/// CPU ticks (user + system) of the sandbox's processes.
fn cpu_ticks(bundle: &Path) -> u64 {
    sandbox_pids(bundle)
        .1
        .iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .filter_map(|stat| {
            let rest = stat.rsplit_once(')')?.1.to_string();
            let f: Vec<&str> = rest.split_whitespace().collect();
            // utime and stime are fields 14 and 15 of stat; `rest` starts at field 3.
            Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
        })
        .sum()
}

/// Clock ticks per second of /proc/*/stat times.
fn clk_tck() -> u64 {
    // SAFETY: plain libc call without pointers.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(t).ok().filter(|t| *t > 0).unwrap_or(100)
}

/// Waits until, over one second, each sandbox used under 10% of a CPU (an idle
/// gVisor sentry is not at zero) and its summed RSS moved by less than 1%.
/// False after 15 s.
fn wait_quiet(bundles: &[&Path]) -> bool {
    std::thread::sleep(Duration::from_secs(1));
    let sample = || {
        bundles
            .iter()
            .map(|b| (cpu_ticks(b), sandbox_memory(b).rss_kb))
            .collect::<Vec<_>>()
    };
    let max_ticks = clk_tck() / 10;
    let t0 = Instant::now();
    let mut before = sample();
    while t0.elapsed() < Duration::from_secs(15) {
        std::thread::sleep(Duration::from_secs(1));
        let now = sample();
        let quiet = before.iter().zip(&now).all(|((c0, r0), (c1, r1))| {
            c1.saturating_sub(*c0) <= max_ticks && r0.abs_diff(*r1) * 100 <= (*r0).max(1)
        });
        if quiet {
            return true;
        }
        before = now;
    }
    false
}

/// CPU of each sandbox's host processes over `window`, in ms per second.
fn idle_cpu_ms_per_s(bundles: &[&Path], window: Duration) -> Vec<f64> {
    let before: Vec<u64> = bundles.iter().map(|b| cpu_ticks(b)).collect();
    let t0 = Instant::now();
    std::thread::sleep(window);
    let secs = t0.elapsed().as_secs_f64();
    let ms_per_tick = 1000.0 / clk_tck() as f64;
    bundles
        .iter()
        .zip(before)
        .map(|(b, t)| cpu_ticks(b).saturating_sub(t) as f64 * ms_per_tick / secs)
        .collect()
}

/// Nearest-rank percentile.
fn percentile(samples: &[Duration], p: usize) -> Duration {
    let mut v = samples.to_vec();
    v.sort();
    let rank = (p * v.len()).div_ceil(100).max(1);
    v[rank - 1]
}

/// Panics if a runsc process of any of these roots is still running.
fn assert_no_runsc_left(roots: &[&Path]) {
    let t0 = Instant::now();
    loop {
        let left: Vec<i32> = roots
            .iter()
            .flat_map(|r| {
                let r = r.display().to_string();
                runsc_processes(move |a| a.contains(&r))
            })
            .collect();
        if left.is_empty() {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "runsc processes of the bench remain: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn machine_facts() -> String {
    let runsc = Command::new("runsc")
        .arg("--version")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("?")
                .to_string()
        })
        .unwrap_or_else(|e| panic!("runsc --version: {e}"));
    let nproc = Command::new("nproc")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|_| "?".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "{runsc}, nproc {nproc}, kernel {}, platform {PLATFORM}",
        kernel.trim()
    )
}
