//! Warm pools (`/v1/pools`, `space pool`): an operator keeps ready sandboxes; a
//! matching create claims one, with its own env, labels, secrets and TTL, and nothing
//! of the pool's; a sandbox is never handed out twice; the pool refills, survives a
//! restart, and counts against no tenant. On gVisor (real runsc).

mod common;

use std::collections::HashSet;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{call_with, TestServer};
use reqwest::Method;
use serde_json::{json, Value};

/// Long enough for a loaded 2-core machine to boot a few sandboxes one at a time.
const FILL_WITHIN: Duration = Duration::from_secs(180);

/// Ids of the sandboxes runsc runs for this server.
fn running(s: &TestServer) -> HashSet<String> {
    let out = Command::new("runsc")
        .arg("--root")
        .arg(s.runsc_root())
        .args(["list", "--quiet"])
        .output()
        .expect("runsc list");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// Waits until nothing of the pooled sandboxes `ids` is left (no tenant sees them, so
/// there is no operation to wait on), then checks it thoroughly.
async fn wait_gone(s: &TestServer, ids: &HashSet<String>) {
    let since = Instant::now();
    for id in ids {
        while s.data_dir().join("sandboxes").join(id).exists()
            || !common::processes_mentioning(id).is_empty()
        {
            assert!(since.elapsed() < Duration::from_secs(120), "{id} stays");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        s.assert_nothing_left(id);
    }
}

async fn pools(s: &TestServer) -> Vec<Value> {
    let (st, v) = s.get("/v1/pools").await;
    assert_eq!(st, 200, "{v}");
    v["pools"].as_array().unwrap().clone()
}

async fn put_pool(s: &TestServer, body: Value) -> (u16, Value) {
    s.call(Method::PUT, "/v1/pools", Some(body)).await
}

/// Waits until the pool `id` has `ready` sandboxes ready and none booting.
async fn wait_ready(s: &TestServer, id: &str, ready: u64) -> Value {
    let since = Instant::now();
    loop {
        let pool = pools(s)
            .await
            .into_iter()
            .find(|p| p["id"] == id)
            .unwrap_or_else(|| panic!("no pool {id}"));
        if pool["ready"] == ready && pool["starting"] == 0 {
            return pool;
        }
        assert!(
            since.elapsed() < FILL_WITHIN,
            "pool never reached {ready} ready: {pool}\n{}",
            s.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The sandboxes of `key`'s tenant, by id.
async fn ids_of(s: &TestServer, key: &str) -> Vec<String> {
    let (st, v) = call_with(&s.client_as(key), Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(st, 200, "{v}");
    v["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|sb| sb["state"] != "destroyed")
        .map(|sb| sb["id"].as_str().unwrap().to_string())
        .collect()
}

async fn destroy_as(s: &TestServer, key: &str, id: &str) {
    let c = s.client_as(key);
    let op = c.destroy_sandbox(id).await.expect("destroy");
    let op = c
        .wait_operation(&op.id, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(op.status, space_api::OperationStatus::Succeeded, "{op:?}");
}

#[tokio::test]
async fn a_pool_hands_out_ready_sandboxes_once_each_with_the_creates_settings() {
    let mut s =
        TestServer::start_with(&["--pool-max-sandboxes", "4", "--tenant-max-sandboxes", "3"]).await;
    if !s.runtime_available("gvisor").await {
        return;
    }
    let (alpha, beta) = (s.new_key("alpha"), s.new_key("beta"));

    // Pools are the operator's: a tenant's key may neither see nor change them.
    let ac = s.client_as(&alpha);
    for (method, body) in [
        (Method::GET, None),
        (Method::PUT, Some(json!({"template": "busybox", "size": 1}))),
    ] {
        let (st, v) = call_with(&ac, method, "/v1/pools", body).await;
        assert_eq!(st, 403, "{v}");
        assert_eq!(v["error"]["code"], "forbidden", "{v}");
    }
    let (st, v) = call_with(&ac, Method::DELETE, "/v1/pools/pool_0123456789abcdef", None).await;
    assert_eq!(st, 403, "{v}");

    // Bad input: a clear 4xx, and nothing changes.
    for (body, status, says) in [
        (
            json!({"template": "no-such", "size": 1}),
            404,
            "unknown template",
        ),
        (json!({"template": "busybox", "size": 5}), 400, "at most 4"),
        (
            json!({"template": "busybox", "size": 1, "network": "bridge"}),
            400,
            "network",
        ),
        (
            json!({"template": "busybox", "size": 1, "runtime": "nope"}),
            400,
            "nope",
        ),
        (
            json!({"template": "busybox", "size": 1, "resources": {"memory_mib": 1}}),
            400,
            "memory_mib",
        ),
        (
            json!({"template": "busybox", "size": 1, "colour": "red"}),
            400,
            "colour",
        ),
        (
            json!({"template": "busybox", "size": -1}),
            400,
            "invalid request body",
        ),
    ] {
        let (st, v) = put_pool(&s, body.clone()).await;
        assert_eq!(st, status, "{body}: {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(says), "{body}: {v}");
    }
    assert!(pools(&s).await.is_empty());
    let (st, v) = s.delete("/v1/pools/pool_0123456789abcdef").await;
    assert_eq!(st, 404, "{v}");

    // A pool of two.
    let (st, pool) = put_pool(&s, json!({"template": "busybox", "size": 2})).await;
    assert_eq!(st, 200, "{pool}");
    let pool_id = pool["id"].as_str().unwrap().to_string();
    assert!(pool_id.starts_with("pool_"), "{pool}");
    assert_eq!(pool["network"], "none");
    assert!(pool["resources"]["memory_mib"].as_u64().is_some(), "{pool}");
    wait_ready(&s, &pool_id, 2).await;
    let pooled = running(&s);
    assert_eq!(pooled.len(), 2, "{pooled:?}");
    // Pooled sandboxes belong to no tenant.
    assert!(ids_of(&s, &alpha).await.is_empty());
    assert!(ids_of(&s, common::TOKEN).await.is_empty());

    // A matching create claims one: already running, with its own settings.
    let create = json!({
        "template": "busybox",
        "env": {"GREETING": "hello"},
        "secrets": {"API_TOKEN": "s3cret"},
        "labels": {"task": "t1"},
        "ttl_seconds": 600,
    });
    let (st, op) = call_with(&ac, Method::POST, "/v1/sandboxes", Some(create.clone())).await;
    assert_eq!(st, 202, "{op}");
    assert_eq!(op["status"], "succeeded", "a claim is done at once: {op}");
    let sb = op["sandbox_id"].as_str().unwrap().to_string();
    assert!(pooled.contains(&sb), "{sb} is not one of {pooled:?}");
    let (_, got) = call_with(&ac, Method::GET, &format!("/v1/sandboxes/{sb}"), None).await;
    assert_eq!(got["state"], "running", "{got}");
    assert_eq!(got["labels"]["task"], "t1", "{got}");
    assert_eq!(got["secret_names"], json!(["API_TOKEN"]), "{got}");
    assert_eq!(got["ttl_seconds"], 600, "{got}");
    assert!(got["expires_at"].is_string(), "{got}");
    // Nothing of its time in the pool: one operation (this create), no command.
    let (_, ops) = call_with(
        &ac,
        Method::GET,
        &format!("/v1/operations?sandbox_id={sb}"),
        None,
    )
    .await;
    let ops = ops["operations"].as_array().unwrap();
    assert_eq!(ops.len(), 1, "{ops:?}");
    assert_eq!(ops[0]["id"], op["id"]);
    let (_, cmds) = call_with(
        &ac,
        Method::GET,
        &format!("/v1/sandboxes/{sb}/commands"),
        None,
    )
    .await;
    assert_eq!(cmds["commands"], json!([]), "{cmds}");
    let (st, out) = call_with(
        &ac,
        Method::POST,
        &format!("/v1/sandboxes/{sb}/commands"),
        Some(json!({"shell": "echo $GREETING $API_TOKEN; ps -o pid=,comm=", "wait": true})),
    )
    .await;
    assert_eq!(st, 201, "{out}");
    let stdout = out["stdout"].as_str().unwrap();
    assert!(stdout.starts_with("hello s3cret\n"), "{out}");
    // Only the agent (pid 1), this shell and its ps run: no process of the pool's.
    for line in stdout.lines().skip(1) {
        let (pid, comm) = line.trim().split_once(' ').unwrap_or((line.trim(), ""));
        assert!(
            pid == "1" || ["sh", "ps"].contains(&comm.trim()),
            "a process that is not the tenant's: {line:?} in {out}"
        );
    }
    // The other tenant cannot see it; it counts against alpha only.
    let (st, _) = call_with(
        &s.client_as(&beta),
        Method::GET,
        &format!("/v1/sandboxes/{sb}"),
        None,
    )
    .await;
    assert_eq!(st, 404);
    assert_eq!(ids_of(&s, &alpha).await, vec![sb.clone()]);

    // The pool refills, and counts the claim.
    let pool = wait_ready(&s, &pool_id, 2).await;
    assert_eq!(pool["claims"], 1, "{pool}");
    let refilled: HashSet<String> = running(&s)
        .difference(&HashSet::from([sb.clone()]))
        .cloned()
        .collect();
    assert_eq!(refilled.len(), 2);
    assert!(!refilled.contains(&sb));

    // A create that does not match (other resources) boots its own.
    let (st, op2) = call_with(
        &ac,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"template": "busybox", "resources": {"memory_mib": 256}})),
    )
    .await;
    assert_eq!(st, 202, "{op2}");
    assert_ne!(op2["status"], "succeeded", "{op2}");
    let own = op2["sandbox_id"].as_str().unwrap().to_string();
    assert!(!refilled.contains(&own));
    ac.wait_operation(op2["id"].as_str().unwrap(), Duration::from_secs(180))
        .await
        .unwrap();
    destroy_as(&s, &alpha, &own).await;
    destroy_as(&s, &alpha, &sb).await;
    s.assert_nothing_left(&sb);

    // Many creates at once, by four tenants (three sandboxes each at most): every one
    // is a sandbox or a clear 429, and no sandbox is handed out twice.
    wait_ready(&s, &pool_id, 2).await;
    let before = running(&s);
    let keys: Vec<String> = ["c1", "c2", "c3", "c4"]
        .iter()
        .map(|t| s.new_key(t))
        .collect();
    let mut tasks = Vec::new();
    for key in &keys {
        for _ in 0..8 {
            let c = s.client_as(key);
            let key = key.clone();
            tasks.push(tokio::spawn(async move {
                let (st, v) = call_with(
                    &c,
                    Method::POST,
                    "/v1/sandboxes",
                    Some(json!({"template": "busybox"})),
                )
                .await;
                (key, st, v)
            }));
        }
    }
    let mut got: Vec<(String, String, String)> = Vec::new();
    for t in tasks {
        let (key, st, v) = t.await.unwrap();
        match st {
            202 => got.push((
                key,
                v["sandbox_id"].as_str().unwrap().to_string(),
                v["id"].as_str().unwrap().to_string(),
            )),
            429 => {}
            other => panic!("a create answered {other}: {v}"),
        }
    }
    let ids: HashSet<&String> = got.iter().map(|(_, id, _)| id).collect();
    assert_eq!(
        ids.len(),
        got.len(),
        "a sandbox was handed out twice: {got:?}"
    );
    assert_eq!(got.len(), 12, "three per tenant: {got:?}");
    let claimed: Vec<&String> = ids
        .iter()
        .copied()
        .filter(|id| before.contains(*id))
        .collect();
    assert!(claimed.len() <= 2, "{claimed:?} of {before:?}");
    for (key, _, op) in &got {
        let c = s.client_as(key);
        let op = c
            .wait_operation(op, Duration::from_secs(180))
            .await
            .unwrap();
        assert_eq!(op.status, space_api::OperationStatus::Succeeded, "{op:?}");
        assert_eq!(ids_of(&s, key).await.len(), 3);
    }
    for (key, id, _) in &got {
        destroy_as(&s, key, id).await;
    }

    // The pool survives a restart: its sandboxes are adopted again and still claimable.
    let pool = wait_ready(&s, &pool_id, 2).await;
    let before = running(&s);
    s.kill_and_restart();
    let after = wait_ready(&s, &pool_id, 2).await;
    assert_eq!(after["size"], 2, "{after} (was {pool})");
    assert_eq!(running(&s), before, "the pooled sandboxes were not adopted");
    let (st, op) = call_with(
        &s.client_as(&alpha),
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"template": "busybox"})),
    )
    .await;
    assert_eq!(st, 202, "{op}");
    assert_eq!(op["status"], "succeeded", "{op}");
    let sb = op["sandbox_id"].as_str().unwrap().to_string();
    assert!(before.contains(&sb));
    let r = s.client_as(&alpha).run(&sb, &["true"]).await.unwrap();
    assert_eq!(r.result.unwrap().exit_code, Some(0));
    destroy_as(&s, &alpha, &sb).await;

    // Size 0 empties it; removing it leaves nothing behind.
    wait_ready(&s, &pool_id, 2).await;
    let last = running(&s);
    let (st, v) = put_pool(&s, json!({"template": "busybox", "size": 0})).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["id"], pool_id.as_str());
    wait_ready(&s, &pool_id, 0).await;
    let (st, _) = s.delete(&format!("/v1/pools/{pool_id}")).await;
    assert_eq!(st, 204);
    assert!(pools(&s).await.is_empty());
    wait_gone(&s, &last).await;
    assert!(running(&s).is_empty());
}

/// `space pool set|ls|rm` drive the same API.
#[tokio::test]
async fn the_cli_sets_lists_and_removes_pools() {
    let s = TestServer::start_with(&["--pool-max-sandboxes", "2"]).await;
    if !s.runtime_available("gvisor").await {
        return;
    }
    let space = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_space"))
            .args(args)
            .env("SPACE_URL", &s.url)
            .env("SPACE_TOKEN", common::TOKEN)
            .output()
            .expect("run space");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, out, err) = space(&[
        "pool",
        "set",
        "busybox",
        "--size",
        "1",
        "--memory-mib",
        "128",
    ]);
    assert!(ok, "{err}");
    let pool: Value = serde_json::from_str(&out).unwrap();
    let id = pool["id"].as_str().unwrap().to_string();
    assert_eq!(pool["resources"]["memory_mib"], 128);
    wait_ready(&s, &id, 1).await;
    let (ok, out, err) = space(&["pool", "ls"]);
    assert!(ok, "{err}");
    let line = out
        .lines()
        .find(|l| l.starts_with(&id))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        line.contains("busybox") && line.contains("128 MiB"),
        "{line}"
    );
    let (ok, _, err) = space(&[
        "pool",
        "set",
        "busybox",
        "--size",
        "3",
        "--memory-mib",
        "128",
    ]);
    assert!(!ok && err.contains("at most 2"), "{err}");
    let pooled = running(&s);
    let (ok, _, err) = space(&["pool", "rm", &id]);
    assert!(ok, "{err}");
    let (ok, _, err) = space(&["pool", "rm", &id]);
    assert!(!ok && err.contains("no pool"), "{err}");
    wait_gone(&s, &pooled).await;
}
