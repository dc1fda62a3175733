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
#[path = "rawsc/mod.rs"]
mod rawsc;

use std::path::Path;
use std::time::{Duration, Instant};

use common::TestServer;
use rawsc::{bench_start, one_side, p50_p95_rows, raw_of, row, runsc_processes, table_head};
use space_api::{CommandState, CreateCommandRequest, CreateSandboxRequest, OperationStatus};
use space_client::Client;

/// Timed creates per side.
const CREATES: usize = 10;
/// Untimed `true` round trips per side before the timed ones.
const EXEC_WARMUPS: usize = 5;
/// Timed `true` round trips per side.
const EXECS: usize = 200;

fn main() {
    let (rt, facts) = bench_start();
    let server = rt.block_on(TestServer::start());
    let c = rawsc::client_of(&server);

    // Our long-lived sandbox (also the warm-up of our create path). Its OCI
    // bundle is the one the raw side runs.
    let ours = rt.block_on(rawsc::create_busybox(&c));
    let our_bundle = rawsc::our_bundle(&server, &ours);
    let raw = raw_of(&server, &our_bundle);

    // The raw long-lived sandbox (also the warm-up of the raw create path).
    let raw_main = raw.start_new("main");

    // 1. create-to-ready, interleaved so that background load hits both sides alike.
    eprintln!("bench: create-to-ready x{CREATES} (each side)");
    let mut ours_create = Vec::new();
    let mut raw_create = Vec::new();
    for i in 0..CREATES {
        let (sb, took) = rt.block_on(timed_create(&server, &c));
        ours_create.push(took);
        rt.block_on(rawsc::destroy_ours(&c, &server, &sb));

        let id = raw.id(&format!("c{i}"));
        raw.prepare(&id);
        raw_create.push(raw.create_start(&id));
        raw.delete(&id);
    }

    // 2. the `true` round trip.
    eprintln!("bench: exec true x{EXECS} (each side, after {EXEC_WARMUPS} warm-ups)");
    for _ in 0..EXEC_WARMUPS {
        rt.block_on(timed_true(&c, &ours));
        raw.exec_true(&raw_main);
    }
    let mut ours_exec = Vec::new();
    let mut raw_exec = Vec::new();
    for _ in 0..EXECS {
        ours_exec.push(rt.block_on(timed_true(&c, &ours)));
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
    let cmd = rt
        .block_on(c.run(&ours, &["cat", "/proc/1/status"]))
        .expect("cat /proc/1/status");
    assert_eq!(
        cmd.result.as_ref().and_then(|r| r.exit_code),
        Some(0),
        "{cmd:?}"
    );
    let ours_agent_kb = vm_rss_kb(cmd.stdout.as_deref().unwrap_or_default());
    let raw_agent_kb = vm_rss_kb(&raw.exec(&raw_main, &["/bin/cat", "/proc/1/status"]).1);

    // Clean up, then check that nothing of ours or the raw side is left running.
    rawsc::teardown(&rt, server, &c, &ours, raw, &raw_main);

    // The table.
    let mib = |kb: u64| kb as f64 / 1024.0;
    table_head("core", &facts);
    p50_p95_rows(
        &format!("create-to-ready (n={CREATES})"),
        "median",
        &ours_create,
        &raw_create,
    );
    p50_p95_rows(
        &format!("exec `true` round trip (n={EXECS})"),
        "p50",
        &ours_exec,
        &raw_exec,
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
        (o, r) => one_side(
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
async fn timed_create(s: &TestServer, c: &Client) -> (String, Duration) {
    let req = CreateSandboxRequest {
        template: "busybox".into(),
        ..Default::default()
    };
    let start = Instant::now();
    let op = c.create_sandbox(&req).await.expect("POST /v1/sandboxes");
    loop {
        let op = c
            .operation(&op.id, Some(Duration::from_secs(30)))
            .await
            .expect("GET the create operation");
        match op.status {
            OperationStatus::Succeeded => {
                let took = start.elapsed();
                let sb = op.sandbox_id.expect("sandbox id");
                return (sb, took);
            }
            OperationStatus::Failed | OperationStatus::Cancelled => {
                panic!("create failed: {op:?}\n{}", s.log())
            }
            _ => assert!(
                start.elapsed() < Duration::from_secs(120),
                "create did not end: {op:?}"
            ),
        }
    }
}

/// One `true` through our API.
async fn timed_true(c: &Client, sb: &str) -> Duration {
    let req = CreateCommandRequest {
        argv: Some(vec!["true".into()]),
        wait: Some(true),
        ..Default::default()
    };
    let start = Instant::now();
    let cmd = c.create_command(sb, &req).await;
    let took = start.elapsed();
    let cmd = cmd.expect("POST commands");
    assert_eq!(cmd.state, CommandState::Exited, "{cmd:?}");
    assert_eq!(
        cmd.result.as_ref().and_then(|r| r.exit_code),
        Some(0),
        "{cmd:?}"
    );
    took
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
