//! Warm pool benchmark: create to first result, against raw `runsc` doing the same work.
//!
//! - ours, from a pool: `POST /v1/sandboxes` that claims a ready pooled sandbox, then
//!   `POST …/commands {"argv":["true"],"wait":true}` until its result is back;
//! - ours, cold: the same with resources no pool matches (a sandbox boots);
//! - raw: `runsc create` + `runsc start` of the same bundle, then `runsc exec true`.
//!
//! Between timed creates the pool is let refill (untimed), so each timed one claims.
//! Run it with `scripts/bench.sh`, or `cargo bench -p space --bench pools` once the
//! agent and the busybox template exist. Timings are reported, never asserted.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "rawsc/mod.rs"]
mod rawsc;

use std::time::{Duration, Instant};

use common::TestServer;
use rawsc::{bench_start, p50_p95_rows, raw_of, table_head};
use space_api::{CreateSandboxRequest, OperationStatus, PoolSpec, Resources};
use space_client::Client;

/// Timed creates per side.
const CREATES: usize = 20;
const POOL_SIZE: u32 = 2;

fn main() {
    let (rt, facts) = bench_start();
    let server = rt.block_on(TestServer::start_with(&[
        "--pool-max-sandboxes",
        "4",
        "--pool-fills",
        "2",
    ]));
    let c = rawsc::client_of(&server);

    // Our long-lived sandbox: its bundle is what the raw side runs.
    let ours = rt.block_on(rawsc::create_busybox(&c));
    let raw = raw_of(&server, &rawsc::our_bundle(&server, &ours));
    let raw_main = raw.start_new("main");

    let pool = rt
        .block_on(c.set_pool(&PoolSpec {
            template: "busybox".into(),
            size: POOL_SIZE,
            ..Default::default()
        }))
        .expect("PUT /v1/pools");
    rt.block_on(wait_ready(&c, &pool.id, POOL_SIZE));

    eprintln!("bench: create to first result x{CREATES} (pool, cold, raw)");
    let (mut pooled, mut cold, mut raw_times) = (Vec::new(), Vec::new(), Vec::new());
    let (mut claims, mut raw_starts) = (Vec::new(), Vec::new());
    for i in 0..CREATES {
        rt.block_on(wait_ready(&c, &pool.id, POOL_SIZE));
        let (sb, took, claimed) = rt.block_on(first_result(&c, None));
        let claim = claimed.expect("a create with a ready pool did not claim");
        pooled.push(took);
        claims.push(claim);
        rt.block_on(rawsc::destroy_ours(&c, &server, &sb));

        // No pool has 256 MiB sandboxes: this one boots.
        let other = Resources {
            memory_mib: Some(256),
            ..Default::default()
        };
        let (sb, took, claimed) = rt.block_on(first_result(&c, Some(other)));
        assert!(claimed.is_none());
        cold.push(took);
        rt.block_on(rawsc::destroy_ours(&c, &server, &sb));

        let id = raw.id(&format!("c{i}"));
        raw.prepare(&id);
        let started = raw.create_start(&id);
        raw_times.push(started + raw.exec_true(&id));
        raw_starts.push(started);
        raw.delete(&id);
    }

    // The pool goes, and its sandboxes with it, before the teardown's leak checks.
    rt.block_on(c.delete_pool(&pool.id))
        .expect("DELETE the pool");
    let since = Instant::now();
    while std::fs::read_dir(server.data_dir().join("sandboxes"))
        .map(|d| d.count())
        .unwrap_or(0)
        > 1
    {
        assert!(
            since.elapsed() < Duration::from_secs(120),
            "pooled sandboxes stay"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    rawsc::teardown(&rt, server, &c, &ours, raw, &raw_main);

    table_head("pools", &facts);
    p50_p95_rows(
        &format!("create→first result, pool (n={CREATES})"),
        "p50",
        &pooled,
        &raw_times,
    );
    p50_p95_rows(
        "create answered: claim vs runsc start",
        "p50",
        &claims,
        &raw_starts,
    );
    p50_p95_rows(
        &format!("create→first result, cold (n={CREATES})"),
        "p50",
        &cold,
        &raw_times,
    );
    println!(
        "notes: ratio = ours / raw. ours = POST /v1/sandboxes (answered once claimed, or \
         long-polled until booted) + `true` with wait:true through the API; raw = runsc \
         create + start + a `runsc exec true` process, nothing pre-started."
    );
}

/// Creates a sandbox, runs `true` in it with `wait:true`: its id, the time to the
/// result, and the time to the create's answer when it claimed a pooled sandbox.
async fn first_result(
    c: &Client,
    resources: Option<Resources>,
) -> (String, Duration, Option<Duration>) {
    let req = CreateSandboxRequest {
        template: "busybox".into(),
        resources,
        ..Default::default()
    };
    let start = Instant::now();
    let mut op = c.create_sandbox(&req).await.expect("POST /v1/sandboxes");
    let claimed = (op.status == OperationStatus::Succeeded).then(|| start.elapsed());
    while op.status != OperationStatus::Succeeded {
        assert!(
            !op.status.is_terminal() && start.elapsed() < Duration::from_secs(120),
            "create failed: {op:?}"
        );
        op = c
            .operation(&op.id, Some(Duration::from_secs(30)))
            .await
            .expect("GET the create operation");
    }
    let sb = op.sandbox_id.expect("sandbox id");
    let cmd = c.run(&sb, &["true"]).await.expect("true");
    let took = start.elapsed();
    assert_eq!(cmd.result.and_then(|r| r.exit_code), Some(0));
    (sb, took, claimed)
}

async fn wait_ready(c: &Client, id: &str, ready: u32) {
    let since = Instant::now();
    loop {
        let pools = c.pools().await.expect("GET /v1/pools");
        let p = pools.iter().find(|p| p.id == id).expect("the pool");
        if p.ready >= ready {
            return;
        }
        assert!(since.elapsed() < Duration::from_secs(300), "{p:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
