//! List benchmark: `GET /v1/sandboxes` with 100 running sandboxes (`SPACE_BENCH_LIST_SANDBOXES`), p50 and p99,
//! against `runsc list` of the very same containers (the raw tool's own listing of
//! what runs, read from its state directory) in the same run.
//!
//! Our listing decorates each sandbox with its cost (memory, disk, snapshot); the
//! figures come from the background sampler, so a list does no `/proc` scan and no
//! SQLite work on an async worker. Everything else the server does meanwhile (the
//! 100 sandboxes' agents, pings, cost sampling) is part of what is measured.
//!
//! Run it with `scripts/bench.sh`, or `cargo bench -p space --bench list` once the
//! agent and the busybox template exist. `SPACE_TEST_SERVER_BIN` runs another build
//! of the server (an older one, for a before-and-after figure) under the same bench.
//! Timings are reported, never asserted; anything that functionally breaks panics.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "rawsc/mod.rs"]
mod rawsc;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::TestServer;
use rawsc::{bench_start, ms, percentile, row, table_head};
use space_api::{CreateSandboxRequest, Resources};

/// Running sandboxes while the lists are timed, unless `SPACE_BENCH_LIST_SANDBOXES` says
/// otherwise: idle gVisor sandboxes cost the host CPU (the Sentry's timers, the agents'
/// pings), and on a 2-core host a hundred of them starve each other's agents.
const SANDBOXES_DEFAULT: usize = 100;
/// Creates in flight at once while filling the server.
const CREATE_BATCH: usize = 4;
/// Untimed lists before the timed ones.
const WARMUPS: usize = 10;
/// Timed `GET /v1/sandboxes` calls.
const LISTS: usize = 200;
/// Timed `runsc list` calls (each is a process start, so fewer).
const RAW_LISTS: usize = 50;

fn main() {
    let sandboxes: usize = std::env::var("SPACE_BENCH_LIST_SANDBOXES")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(SANDBOXES_DEFAULT);
    let (rt, facts) = bench_start();
    let server = rt.block_on(TestServer::start_with(&[
        "--tenant-max-sandboxes",
        "200",
        "--tenant-creates-per-minute",
        "1000",
        // 100 idle sandboxes are past a 2-core host's default capacity; this bench wants them.
        "--max-sandboxes",
        "0",
    ]));
    let c = rawsc::client_of(&server);

    eprintln!("bench: creating {sandboxes} sandboxes, {CREATE_BATCH} at a time");
    let req = CreateSandboxRequest {
        template: "busybox".into(),
        resources: Some(Resources {
            memory_mib: Some(64),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut ours = Vec::new();
    while ours.len() < sandboxes {
        let n = CREATE_BATCH.min(sandboxes - ours.len());
        let batch = rt.block_on(futures::future::join_all(
            (0..n).map(|_| rawsc::create_ours(&c, &req)),
        ));
        ours.extend(batch);
    }

    let listed = rt
        .block_on(c.list_sandboxes::<&str, &str>([]))
        .expect("list");
    let running = listed
        .iter()
        .filter(|s| s.state == space_api::SandboxState::Running)
        .count();
    assert_eq!(running, sandboxes, "every sandbox runs before the lists");

    eprintln!("bench: GET /v1/sandboxes x{LISTS} and runsc list x{RAW_LISTS}");
    for _ in 0..WARMUPS {
        rt.block_on(c.list_sandboxes::<&str, &str>([]))
            .expect("list");
    }
    let mut our_times = Vec::new();
    for _ in 0..LISTS {
        let t0 = Instant::now();
        let list = rt
            .block_on(c.list_sandboxes::<&str, &str>([]))
            .expect("list");
        our_times.push(t0.elapsed());
        assert_eq!(list.len(), sandboxes);
    }
    let root = server.data.path().join("runsc");
    let mut raw_times = Vec::new();
    for _ in 0..RAW_LISTS {
        raw_times.push(runsc_list(&root, sandboxes));
    }

    table_head(
        &format!("list ({sandboxes} running sandboxes; raw: runsc list of the same containers)"),
        &facts,
    );
    for (stat, p) in [("p50", 50), ("p99", 99)] {
        row(
            "GET /v1/sandboxes",
            stat,
            ms(percentile(&our_times, p)),
            ms(percentile(&raw_times, p)),
            "ms",
        );
    }

    eprintln!("bench: destroying {sandboxes} sandboxes");
    for batch in ours.chunks(8) {
        rt.block_on(futures::future::join_all(
            batch.iter().map(|sb| rawsc::destroy_ours(&c, &server, sb)),
        ));
    }
}

/// One `runsc --root ROOT list --format=json` of the server's containers, timed; it
/// must list every one of them.
fn runsc_list(root: &std::path::Path, sandboxes: usize) -> Duration {
    let t0 = Instant::now();
    let out = Command::new("runsc")
        .arg("--root")
        .arg(root)
        .args(["list", "--format=json"])
        .stdin(Stdio::null())
        .output()
        .expect("runsc list");
    let took = t0.elapsed();
    assert!(
        out.status.success(),
        "runsc list: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).expect("runsc list JSON");
    let n = list.as_array().map_or(0, Vec::len);
    assert!(n >= sandboxes, "runsc list shows {n} containers");
    took
}
