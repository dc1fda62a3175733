//! Code interpreter benchmark: ours (a context in a `code-interpreter` sandbox, through
//! `/v1`) against a Jupyter kernel on the host driven by `jupyter_client`, in one run.
//!
//! - first result of `1+1` in a fresh sandbox: create, a context, the execution, until
//!   its `end` (cold: the sandbox boots; pool: a warm pooled sandbox is claimed);
//!   local: kernel start to the result;
//! - per-cell latency of `x += 1` in one context: request to `end`; local: execute to
//!   idle.
//!
//! Needs the `code-interpreter` template and Debian's python3-ipykernel and
//! python3-jupyter-client on the host (scripts/bench.sh installs them). Timings are
//! reported, never asserted.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "rawsc/mod.rs"]
mod rawsc;

use std::process::Command;
use std::time::{Duration, Instant};

use common::TestServer;
use rawsc::{ms, percentile};
use serde_json::{json, Value};
use space_api::{CreateSandboxRequest, PoolSpec};
use space_client::Client;

/// Fresh sandboxes timed per side (each boots a kernel: seconds).
const FIRSTS: usize = 3;
/// `x += 1` cells timed.
const CELLS: usize = 40;
const TEMPLATE: &str = "code-interpreter";

fn main() {
    let templates = common::templates_dir();
    assert!(
        templates.join(TEMPLATE).join("template.json").is_file(),
        "no {TEMPLATE} template in {}; run scripts/bench.sh",
        templates.display()
    );
    let (rt, facts) = rawsc::bench_start();

    // The local kernel first, alone on the machine.
    eprintln!("bench: local kernel x{FIRSTS}");
    let mut local_cold = Vec::new();
    let mut local_cells = Vec::new();
    for _ in 0..FIRSTS {
        let v = local_kernel();
        local_cold.push(Duration::from_secs_f64(
            v["cold_ms"].as_f64().unwrap() / 1000.0,
        ));
        for c in v["cells_ms"].as_array().unwrap() {
            local_cells.push(Duration::from_secs_f64(c.as_f64().unwrap() / 1000.0));
        }
    }

    let server = rt.block_on(TestServer::start_with(&[
        "--pool-max-sandboxes",
        "2",
        "--pool-fills",
        "1",
    ]));
    let c = rawsc::client_of(&server);

    eprintln!("bench: cold first results x{FIRSTS}");
    let mut cold = Vec::new();
    for _ in 0..FIRSTS {
        let (sb, took) = rt.block_on(first_result(&server, &c));
        cold.push(took);
        rt.block_on(rawsc::destroy_ours(&c, &server, &sb));
    }

    eprintln!("bench: pooled first results x{FIRSTS}");
    let pool = rt
        .block_on(c.set_pool(&PoolSpec {
            template: TEMPLATE.into(),
            size: 1,
            ..Default::default()
        }))
        .expect("PUT /v1/pools");
    let mut pooled = Vec::new();
    for _ in 0..FIRSTS {
        rt.block_on(wait_ready(&c, &pool.id));
        let (sb, took) = rt.block_on(first_result(&server, &c));
        pooled.push(took);
        rt.block_on(rawsc::destroy_ours(&c, &server, &sb));
    }
    rt.block_on(c.delete_pool(&pool.id))
        .expect("DELETE the pool");

    eprintln!("bench: {CELLS} cells of x += 1");
    let (sb, _) = rt.block_on(first_result(&server, &c));
    let ctx = rt.block_on(context(&server, &sb));
    rt.block_on(execute(&server, &sb, &ctx, "x = 0"));
    let mut cells = Vec::new();
    for _ in 0..CELLS {
        let t = Instant::now();
        rt.block_on(execute(&server, &sb, &ctx, "x += 1"));
        cells.push(t.elapsed());
    }
    let ev = rt.block_on(execute(&server, &sb, &ctx, "x"));
    assert!(ev.contains(&format!("\"text\":\"{CELLS}\"")), "{ev}");
    rt.block_on(rawsc::destroy_ours(&c, &server, &sb));

    // The pool's sandboxes go before the server does.
    let since = Instant::now();
    while std::fs::read_dir(server.data_dir().join("sandboxes"))
        .map(|d| d.count())
        .unwrap_or(0)
        > 0
    {
        assert!(
            since.elapsed() < Duration::from_secs(120),
            "pooled sandboxes stay"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let root = server.runsc_root();
    drop(server);
    rawsc::assert_no_runsc_left(&[&root]);

    println!();
    println!(
        "space interpreter benchmark: ours vs a local Jupyter kernel (jupyter_client), same run"
    );
    println!("machine: {facts}");
    println!(
        "{:<40} {:<5} {:>12} {:>14} {:>8}",
        "metric", "stat", "ours", "local kernel", "ratio"
    );
    let row = |metric: &str, stat: &str, ours: Duration, local: Duration| {
        println!(
            "{:<40} {:<5} {:>10.1}ms {:>12.1}ms {:>7.2}x",
            metric,
            stat,
            ms(ours),
            ms(local),
            ms(ours) / ms(local).max(0.001)
        );
    };
    row(
        &format!("1+1 first result, cold (n={FIRSTS})"),
        "p50",
        percentile(&cold, 50),
        percentile(&local_cold, 50),
    );
    row(
        &format!("1+1 first result, pool (n={FIRSTS})"),
        "p50",
        percentile(&pooled, 50),
        percentile(&local_cold, 50),
    );
    for p in [50, 95] {
        row(
            &format!("x += 1 per cell (n={CELLS})"),
            &format!("p{p}"),
            percentile(&cells, p),
            percentile(&local_cells, p),
        );
    }
    println!(
        "notes: ratio = ours / local. first result: ours = POST /v1/sandboxes until running \
         + POST contexts + execute `1+1` to its end; local = KernelManager.start_kernel to the \
         result. A pooled sandbox is booted, but its kernel starts at the first context (a \
         claimed sandbox carries nothing of the pool's). Per cell: ours = one execute request \
         (a command in the sandbox) to its end; local = execute to idle."
    );
}

/// Runs the host kernel script with Debian's python3.
fn local_kernel() -> Value {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/benches/interpreter/local_kernel.py"
    );
    let out = Command::new("/usr/bin/python3")
        .arg(script)
        .arg(CELLS.to_string())
        // The kernelspec runs `python3`: Debian's, which has ipykernel.
        .env("PATH", "/usr/bin:/bin")
        .output()
        .expect("run /usr/bin/python3");
    assert!(
        out.status.success(),
        "local_kernel.py failed (scripts/bench.sh installs python3-ipykernel): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("local_kernel.py's JSON")
}

/// A new sandbox to the result of `1+1` in a new context: its id and the time.
async fn first_result(s: &TestServer, c: &Client) -> (String, Duration) {
    let start = Instant::now();
    let req = CreateSandboxRequest {
        template: TEMPLATE.into(),
        ..Default::default()
    };
    let sb = rawsc::create_ours(c, &req).await;
    let ctx = context(s, &sb).await;
    let ev = execute(s, &sb, &ctx, "1+1").await;
    let took = start.elapsed();
    assert!(ev.contains("\"text\":\"2\""), "{ev}");
    (sb, took)
}

async fn context(s: &TestServer, sb: &str) -> String {
    let (st, v) = s
        .post(&format!("/v1/sandboxes/{sb}/contexts"), json!({}))
        .await;
    assert_eq!(st, 201, "{v}");
    v["id"].as_str().unwrap().to_string()
}

/// Executes `code`; the whole NDJSON answer.
async fn execute(s: &TestServer, sb: &str, ctx: &str, code: &str) -> String {
    let resp = s
        .req(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{sb}/contexts/{ctx}/execute"),
        )
        .json(&json!({ "code": code }))
        .send()
        .await
        .expect("execute");
    assert_eq!(resp.status().as_u16(), 200);
    let text = resp.text().await.expect("the execution's events");
    assert!(text.contains("\"type\":\"end\""), "{text}");
    text
}

async fn wait_ready(c: &Client, id: &str) {
    let since = Instant::now();
    loop {
        let pools = c.pools().await.expect("GET /v1/pools");
        let p = pools.iter().find(|p| p.id == id).expect("the pool");
        if p.ready >= 1 {
            return;
        }
        assert!(since.elapsed() < Duration::from_secs(300), "{p:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
