//! E2B benchmark: `commands.run("true")` through the real Python E2B SDK, the same
//! command (`/bin/bash -l -c true`, what the SDK asks envd to run) through `/v1`, and
//! `runsc exec` of it in a raw container of the same bundle, in one run, interleaved
//! in batches so that background load hits all three alike.
//!
//! Needs the pinned SDK (`scripts/test-clients.sh`), the agent and the debian template
//! (`scripts/bench.sh` makes them). Timings are reported, never asserted.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "rawsc/mod.rs"]
mod rawsc;

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::TestServer;
use rawsc::{bench_start, p50_p95_rows, raw_of, table_head};
use space_api::{CommandState, CreateCommandRequest};
use space_client::Client;

/// Batches, and round trips per side in each.
const BATCHES: usize = 10;
const PER_BATCH: usize = 20;
/// The command the SDK's `commands.run("true")` starts.
const ARGV: [&str; 4] = ["/bin/bash", "-l", "-c", "true"];

fn main() {
    let (rt, facts) = bench_start();
    let server = rt.block_on(TestServer::start());
    let c = rawsc::client_of(&server);

    let clients = std::env::var_os("SPACE_E2B_CLIENTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/test-clients")
        });
    let python = clients.join("venv/bin/python");
    assert!(
        python.exists(),
        "run scripts/test-clients.sh first (no {})",
        python.display()
    );
    let mut sdk = Command::new(&python)
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/e2b/run_true.py"))
        .env_remove("E2B_DEBUG")
        .env("E2B_API_URL", server.url.as_str())
        .env("E2B_SANDBOX_URL", server.url.as_str())
        .env("E2B_API_KEY", common::TOKEN)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the Python SDK");
    let mut to_sdk = sdk.stdin.take().unwrap();
    let mut from_sdk = BufReader::new(sdk.stdout.take().unwrap()).lines();
    let mut answer = || -> serde_json::Value {
        let line = from_sdk.next().expect("the SDK answered").expect("a line");
        serde_json::from_str(&line).expect("JSON from the SDK")
    };
    let ours = answer()["sandbox"]
        .as_str()
        .expect("the sandbox id")
        .to_string();

    let raw = raw_of(&server, &rawsc::our_bundle(&server, &ours));
    let raw_main = raw.start_new("main");

    eprintln!(
        "bench: `true` x{} per side, in {BATCHES} batches (after warm-ups)",
        BATCHES * PER_BATCH
    );
    let (mut sdk_times, mut v1_times, mut raw_times) = (Vec::new(), Vec::new(), Vec::new());
    for batch in 0..=BATCHES {
        writeln!(to_sdk, "run {PER_BATCH}").unwrap();
        let times: Vec<Duration> = answer()["times"]
            .as_array()
            .expect("times")
            .iter()
            .map(|t| Duration::from_secs_f64(t.as_f64().unwrap()))
            .collect();
        let v1: Vec<Duration> = (0..PER_BATCH)
            .map(|_| rt.block_on(timed_v1(&c, &ours)))
            .collect();
        let rawt: Vec<Duration> = (0..PER_BATCH)
            .map(|_| raw.exec(&raw_main, &ARGV).0)
            .collect();
        // The first batch warms all three up.
        if batch > 0 {
            sdk_times.extend(times);
            v1_times.extend(v1);
            raw_times.extend(rawt);
        }
    }
    drop(to_sdk);
    let status = sdk.wait().expect("the SDK exits");
    assert!(status.success(), "the SDK side failed: {status}");

    rawsc::teardown(&rt, server, &c, &ours, raw, &raw_main);

    let n = BATCHES * PER_BATCH;
    table_head("e2b", &facts);
    p50_p95_rows(
        &format!("Python SDK commands.run(\"true\") (n={n})"),
        "p50",
        &sdk_times,
        &raw_times,
    );
    p50_p95_rows(
        &format!("/v1 commands, wait:true (n={n})"),
        "p50",
        &v1_times,
        &raw_times,
    );
    println!(
        "notes: ratio = ours / raw runsc exec of `{}` in a raw container of the same bundle \
         (a whole runsc process per call); the SDK side is the pinned e2b Python SDK over HTTP/1.1, \
         one Start stream per call.",
        ARGV.join(" ")
    );
}

/// `POST /v1/sandboxes/{sb}/commands {"argv": ARGV, "wait": true}`, timed.
async fn timed_v1(c: &Client, sb: &str) -> Duration {
    let req = CreateCommandRequest {
        argv: Some(ARGV.iter().map(|s| s.to_string()).collect()),
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
