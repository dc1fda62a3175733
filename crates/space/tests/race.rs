//! The store cannot lose an update: one sandbox is hammered with keepalives, reads,
//! commands and file calls while it is paused, resumed, suspended and resumed 50
//! times. After every step the stored state equals what runsc reports, no hammering
//! call gets a server error, and the event log holds every transition of the sandbox
//! and of each operation, in order, with nothing lost.
//!
//! runsc (2024-07-29, systrap) now and then writes a checkpoint that never restores
//! (docs/SECURITY.md, known gaps). Such a resume must fail cleanly: `agent_timeout`,
//! the sandbox `suspended` again and runsc holding nothing. The test checks exactly
//! that, counts it (at most [`MAX_RESTORE_FAILURES`]), and goes on with a new sandbox.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::TestServer;
use futures::StreamExt;
use serde_json::{json, Value};
use space_client::{ClientError, EventsQuery};

const CYCLES: usize = 50;
/// Resumes from a snapshot that may fail with runsc's restore bug in one run. Under the
/// test's own hammering on a loaded 2-core host it showed 3 of 50 (twice in a row);
/// every one must still be a clean failure, which is what this test is about.
const MAX_RESTORE_FAILURES: usize = 6;

/// What runsc says of the sandbox: `running`, `paused`, … or `missing`.
fn runsc_state(s: &TestServer, id: &str) -> String {
    let out = std::process::Command::new("runsc")
        .arg("--root")
        .arg(s.runsc_root())
        .args(["state", id])
        .output()
        .expect("runsc state");
    if !out.status.success() {
        return "missing".into();
    }
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    v["status"].as_str().unwrap_or("unknown").to_string()
}

/// Runs a lifecycle request and waits for its operation to end.
async fn run_step(s: &TestServer, sb: &str, verb: &str) -> Value {
    let (st, op) = s
        .post(&format!("/v1/sandboxes/{sb}/{verb}"), json!({}))
        .await;
    assert_eq!(st, 202, "{verb}: {op}");
    s.wait_op(op["id"].as_str().unwrap()).await
}

/// Runs a lifecycle request and waits for its operation to succeed.
async fn step(s: &TestServer, sb: &str, verb: &str) {
    let op = run_step(s, sb, verb).await;
    assert_eq!(op["status"], "succeeded", "{verb}: {op}\n{}", s.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lifecycle_under_fire_loses_no_update_and_no_event() {
    let s = TestServer::start().await;
    if !s.runtime_available("gvisor").await {
        return;
    }
    // Every event from the start, collected as it comes.
    let events = Arc::new(Mutex::new(Vec::<Value>::new()));
    let q = EventsQuery {
        after: Some(0),
        ..Default::default()
    };
    let mut stream = s.client().events(&q).await.expect("events");
    let collector = {
        let events = events.clone();
        tokio::spawn(async move {
            while let Some(Ok(ev)) = stream.next().await {
                events
                    .lock()
                    .unwrap()
                    .push(serde_json::to_value(ev).unwrap());
            }
        })
    };

    let create = json!({"template": "busybox", "runtime": "gvisor", "ttl_seconds": 3600});
    let mut sb = s.create_with(create.clone()).await;
    // What each sandbox's event log must hold, built as the steps go.
    let mut want: Vec<(String, Vec<&str>)> = vec![(sb.clone(), vec!["creating", "running"])];
    let mut failed_resumes: Vec<String> = Vec::new();
    // The sandbox the hammer aims at (a new one after a restore that runsc cannot do).
    let target = Arc::new(Mutex::new(sb.clone()));

    // The hammer: four clients, each counting what it got back: `Ok`, or the status
    // of a refusal (0: no answer, or one that did not read as the API promises).
    let stop = Arc::new(AtomicBool::new(false));
    let statuses = Arc::new(Mutex::new(Vec::<(&'static str, Result<(), u16>)>::new()));
    let mut hammers = Vec::new();
    for kind in ["keepalive", "get", "exec", "stat"] {
        let client = space_client::Client::builder(&s.url, common::TOKEN)
            .timeout(Duration::from_secs(120))
            .build()
            .unwrap();
        let (stop, statuses, target) = (stop.clone(), statuses.clone(), target.clone());
        hammers.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let sb = target.lock().unwrap().clone();
                let started = std::time::Instant::now();
                let r: Result<(), ClientError> = match kind {
                    "keepalive" => client.keepalive(&sb, Some(3600)).await.map(drop),
                    "get" => client.sandbox(&sb).await.map(drop),
                    "exec" => client.run(&sb, &["true"]).await.map(drop),
                    _ => client.stat_file(&sb, "/tmp").await.map(drop),
                };
                let st = r.map_err(|e| {
                    if e.status().is_none() {
                        eprintln!("race: {kind} failed after {:?}: {e}", started.elapsed());
                    }
                    e.status().unwrap_or(0)
                });
                statuses.lock().unwrap().push((kind, st));
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }));
    }

    let check = |sb: &str, want: &str, runsc: &[&str]| {
        let s = &s;
        let sb = sb.to_string();
        let want = want.to_string();
        let runsc: Vec<String> = runsc.iter().map(|x| x.to_string()).collect();
        async move {
            let (_, v) = s.get(&format!("/v1/sandboxes/{sb}")).await;
            assert_eq!(v["state"], want.as_str(), "stored: {v}");
            let rt = runsc_state(s, &sb);
            assert!(runsc.contains(&rt), "stored {want}, runsc says {rt}");
        }
    };
    for i in 0..CYCLES {
        step(&s, &sb, "pause").await;
        check(&sb, "paused", &["paused"]).await;
        step(&s, &sb, "resume").await;
        check(&sb, "running", &["running"]).await;
        step(&s, &sb, "suspend").await;
        check(&sb, "suspended", &["missing"]).await;
        let mine = &mut want.last_mut().unwrap().1;
        mine.extend([
            "pausing",
            "paused",
            "resuming",
            "running",
            "suspending",
            "suspended",
        ]);
        let resumed = run_step(&s, &sb, "resume").await;
        if resumed["status"] == "failed" && resumed["error"]["code"] == "agent_timeout" {
            // runsc's restore bug: a clean failure, then a new sandbox.
            eprintln!("race: cycle {i}: the snapshot did not restore: {resumed}");
            check(&sb, "suspended", &["missing"]).await;
            failed_resumes.push(resumed["id"].as_str().unwrap().to_string());
            assert!(
                failed_resumes.len() <= MAX_RESTORE_FAILURES,
                "{} snapshots did not restore\n{}",
                failed_resumes.len(),
                s.log()
            );
            mine.extend(["resuming", "suspended", "destroying", "destroyed"]);
            s.destroy(&sb).await;
            sb = s.create_with(create.clone()).await;
            *target.lock().unwrap() = sb.clone();
            want.push((sb.clone(), vec!["creating", "running"]));
            continue;
        }
        assert_eq!(
            resumed["status"],
            "succeeded",
            "resume: {resumed}\n{}",
            s.log()
        );
        check(&sb, "running", &["running"]).await;
        mine.extend(["resuming", "running"]);
        if i % 10 == 9 {
            eprintln!("race: {} cycles", i + 1);
        }
    }
    eprintln!(
        "race: {} of {CYCLES} resumes from a snapshot hit runsc's restore bug",
        failed_resumes.len()
    );
    stop.store(true, Ordering::Relaxed);
    for h in hammers {
        h.await.unwrap();
    }

    // No hammering call got a server error or hung; each kind got through sometimes.
    let statuses = statuses.lock().unwrap().clone();
    for kind in ["keepalive", "get", "exec", "stat"] {
        let mine: Vec<Result<(), u16>> = statuses
            .iter()
            .filter(|(k, _)| *k == kind)
            .map(|(_, s)| *s)
            .collect();
        assert!(mine.iter().any(Result::is_ok), "{kind}: {mine:?}");
        let bad: Vec<u16> = mine
            .iter()
            .filter_map(|s| s.err())
            .filter(|s| *s != 409 && *s != 503)
            .collect();
        assert!(bad.is_empty(), "{kind} got {bad:?}");
        eprintln!("race: {kind}: {} calls", mine.len());
    }

    // The event log: every state of the sandbox in order, and each operation's.
    let (_, final_sb) = s.get(&format!("/v1/sandboxes/{sb}")).await;
    s.destroy(&sb).await;
    let mut waited = 0;
    loop {
        let done = events.lock().unwrap().iter().any(|e| {
            e["type"] == "sandbox"
                && e["object"]["id"] == sb.as_str()
                && e["object"]["state"] == "destroyed"
        });
        if done || waited > 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        waited += 1;
    }
    collector.abort();
    let events = events.lock().unwrap().clone();
    want.last_mut()
        .unwrap()
        .1
        .extend(["destroying", "destroyed"]);
    let mut ops: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for (id, want) in &want {
        let mut states: Vec<String> = Vec::new();
        for e in &events {
            let o = &e["object"];
            if e["type"] == "sandbox" && o["id"] == id.as_str() {
                let st = o["state"].as_str().unwrap().to_string();
                if states.last() != Some(&st) {
                    states.push(st);
                }
            }
            if e["type"] == "operation" && o["sandbox_id"] == id.as_str() {
                let st = o["status"].as_str().unwrap().to_string();
                let seq = ops
                    .entry(o["id"].as_str().unwrap().to_string())
                    .or_default();
                if seq.last() != Some(&st) {
                    seq.push(st);
                }
            }
        }
        assert_eq!(&states, want, "the transitions of {id} in the event log");
    }
    // Per sandbox: its create, its destroy, and four operations a cycle.
    assert_eq!(
        ops.len(),
        2 * want.len() + 4 * CYCLES,
        "operations in the event log"
    );
    for (id, seq) in &ops {
        let end = if failed_resumes.contains(id) {
            "failed"
        } else {
            "succeeded"
        };
        assert_eq!(seq.last().map(String::as_str), Some(end), "{id}: {seq:?}");
        assert!(seq.contains(&"running".to_string()), "{id}: {seq:?}");
    }
    // The keepalives were not undone by the lifecycle, nor it by them.
    assert_eq!(final_sb["ttl_seconds"], 3600, "{final_sb}");
    assert!(final_sb["expires_at"].is_string(), "{final_sb}");
}
