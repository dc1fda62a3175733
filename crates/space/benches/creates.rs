//! Creates at once: wall time of many creates that each end in a first result, against raw
//! `runsc` doing the same work in parallel; then a burst past what is sensible, to show
//! that each create either succeeds or is refused with a clear 429, and none fails or hangs.
//!
//! - One at a time (`ONE_BY_ONE` of each, interleaved): ours = one `POST /v1/sandboxes`
//!   (busybox, gVisor) long-polled until running, then `true` with `wait:true`; raw =
//!   `runsc create` + `runsc start` of our bundle, then a `runsc exec true` process. Time from
//!   the request to the result, each sandbox destroyed before the next.
//! - 16 at once (`ROUNDS` rounds, interleaved with raw): ours = 16 concurrent
//!   `POST /v1/sandboxes` (busybox, gVisor), each long-polled until running, then
//!   `true` with `wait:true`; raw = 16 threads each doing `runsc create` + `runsc start`
//!   of our bundle and a `runsc exec true` process. Wall time from the first request to
//!   the last result.
//! - 100 at once, 128 MiB each: ours only, counted by outcome.
//!
//! Run it with `scripts/bench.sh`, or `cargo bench -p space --bench creates` once the agent
//! and the busybox template exist. Timings are reported, never asserted.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "rawsc/mod.rs"]
mod rawsc;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::TestServer;
use rawsc::{bench_start, median, ms, one_side, raw_of, row, table_head};
use space_api::{CreateSandboxRequest, OperationStatus, Resources};
use space_client::{Client, ClientError};

const ONE_BY_ONE: usize = 10;
const AT_ONCE: usize = 16;
const ROUNDS: usize = 3;
const BURST: usize = 100;
/// Longest a create of the burst may take before it counts as hung.
const HANG: Duration = Duration::from_secs(600);

fn main() {
    let (rt, facts) = bench_start();
    let server = rt.block_on(TestServer::start_with(&[
        "--tenant-creates-per-minute",
        "100000",
        "--tenant-max-sandboxes",
        "1000",
    ]));
    let c = rawsc::client_of(&server);
    let ours = rt.block_on(rawsc::create_busybox(&c));
    let raw = raw_of(&server, &rawsc::our_bundle(&server, &ours));
    let raw_main = raw.start_new("main");

    eprintln!("bench: one create at a time to a first result x{ONE_BY_ONE} (each side)");
    let (mut o_one, mut r_one) = (Vec::new(), Vec::new());
    for i in 0..ONE_BY_ONE {
        let (id, took) = rt
            .block_on(first_result(&c, None))
            .unwrap_or_else(|e| panic!("a create on its own: {e}"));
        rt.block_on(rawsc::destroy_ours(&c, &server, &id));
        o_one.push(took);

        let id = raw.id(&format!("s{i:03}"));
        raw.prepare(&id);
        let t0 = Instant::now();
        raw.create_start(&id);
        raw.exec_true(&id);
        r_one.push(t0.elapsed());
        raw.delete(&id);
    }

    eprintln!("bench: {AT_ONCE} creates at once to a first result x{ROUNDS} (each side)");
    let (mut o_wall, mut r_wall) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let t0 = Instant::now();
        let made = rt.block_on(futures::future::join_all(
            (0..AT_ONCE).map(|_| first_result(&c, None)),
        ));
        let wall = t0.elapsed();
        let ids: Vec<String> = made
            .into_iter()
            .map(|r| r.unwrap_or_else(|e| panic!("a create of {AT_ONCE} at once: {e}")))
            .map(|(id, _)| id)
            .collect();
        for id in &ids {
            rt.block_on(rawsc::destroy_ours(&c, &server, id));
        }
        o_wall.push(wall);

        let ids: Vec<String> = (0..AT_ONCE)
            // Equal lengths: runsc takes an id that prefixes another as ambiguous.
            .map(|i| raw.id(&format!("r{round}n{i:03}")))
            .collect();
        for id in &ids {
            raw.prepare(id);
        }
        let t0 = Instant::now();
        std::thread::scope(|s| {
            for id in &ids {
                let raw = &raw;
                s.spawn(move || {
                    raw.create_start(id);
                    raw.exec_true(id);
                });
            }
        });
        let wall_raw = t0.elapsed();
        for id in &ids {
            raw.delete(id);
        }
        r_wall.push(wall_raw);
        eprintln!(
            "bench: round {round}: ours {:.0} ms, raw {:.0} ms",
            ms(wall),
            ms(wall_raw)
        );
    }

    eprintln!("bench: {BURST} creates at once, 128 MiB each (ours)");
    let small = Resources {
        memory_mib: Some(128),
        ..Default::default()
    };
    let t0 = Instant::now();
    let burst = rt.block_on(futures::future::join_all(
        (0..BURST).map(|_| first_result(&c, Some(small.clone()))),
    ));
    let burst_wall = t0.elapsed();
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    let mut took = Vec::new();
    for r in &burst {
        let key = match r {
            Ok((_, t)) => {
                took.push(*t);
                "succeeded".to_string()
            }
            Err(e) => e.clone(),
        };
        *outcomes.entry(key).or_default() += 1;
    }
    for (id, _) in burst.iter().flatten() {
        rt.block_on(rawsc::destroy_ours(&c, &server, id));
    }
    rawsc::teardown(&rt, server, &c, &ours, raw, &raw_main);

    table_head("creates", &facts);
    row(
        "one at a time, to a first result",
        "p50",
        ms(median(&o_one)),
        ms(median(&r_one)),
        "ms",
    );
    row(
        &format!("{AT_ONCE} at once, wall to last result"),
        "median",
        ms(median(&o_wall)),
        ms(median(&r_wall)),
        "ms",
    );
    row(
        &format!("{AT_ONCE} at once, wall to last result"),
        "max",
        ms(rawsc::max(&o_wall)),
        ms(rawsc::max(&r_wall)),
        "ms",
    );
    one_side(
        &format!("{BURST} at once (128 MiB): wall"),
        "",
        format!("{:.0} ms", ms(burst_wall)),
        "n/a".into(),
    );
    if !took.is_empty() {
        one_side(
            &format!("{BURST} at once: to a first result"),
            "p50",
            format!("{:.0} ms", ms(rawsc::percentile(&took, 50))),
            "n/a".into(),
        );
        one_side(
            &format!("{BURST} at once: to a first result"),
            "max",
            format!("{:.0} ms", ms(rawsc::max(&took))),
            "n/a".into(),
        );
    }
    for (outcome, n) in &outcomes {
        println!("  {BURST} at once: {n} {outcome}");
    }
    println!(
        "notes: ratio = ours / raw (above 1 is slower). ours = POST /v1/sandboxes (one at a \
         time, or concurrent), each long-polled until running, then `true` with wait:true; \
         raw = runsc create + start of our bundle, then a `runsc exec true` process (at once: \
         one thread per sandbox). \
         The burst counts each create's outcome: succeeded, refused (the HTTP status and \
         error code), failed (the operation's error) or hung (no result in {} s).",
        HANG.as_secs()
    );
}

/// Creates a sandbox and runs `true` in it: its id and the time to the result, or what
/// came instead (a refusal, a failed create, a hang), in a few words.
async fn first_result(
    c: &Client,
    resources: Option<Resources>,
) -> Result<(String, Duration), String> {
    let req = CreateSandboxRequest {
        template: "busybox".into(),
        resources,
        ..Default::default()
    };
    let start = Instant::now();
    let mut op = c.create_sandbox(&req).await.map_err(|e| match e {
        ClientError::Api { status, error, .. } => format!("refused {status} {:?}", error.code),
        e => format!("refused: {e}"),
    })?;
    while op.status != OperationStatus::Succeeded {
        if op.status.is_terminal() {
            let why = op
                .error
                .map(|e| format!("{:?}", e.code))
                .unwrap_or_default();
            return Err(format!("failed {why}"));
        }
        if start.elapsed() > HANG {
            return Err("hung".into());
        }
        op = c
            .operation(&op.id, Some(Duration::from_secs(30)))
            .await
            .map_err(|e| format!("GET the operation: {e}"))?;
    }
    let sb = op.sandbox_id.ok_or("no sandbox id")?;
    let cmd = c
        .run(&sb, &["true"])
        .await
        .map_err(|e| format!("true: {e}"))?;
    if cmd.result.and_then(|r| r.exit_code) != Some(0) {
        return Err("true did not exit 0".into());
    }
    Ok((sb, start.elapsed()))
}
