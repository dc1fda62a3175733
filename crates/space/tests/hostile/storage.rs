//! Hostile output against host storage (issue 11, points 4 and 5): what a sandbox's
//! commands make the host keep is bounded however it is written: the index of tiny
//! alternating chunks, and the total of many commands in one sandbox. Host-side
//! accounting does not depend on the runtime; these run on gVisor.

use std::time::Duration;

use serde_json::{json, Value};
use space_client::OutputQuery;

use super::common::TestServer;

/// Bytes a directory tree takes on disk (allocated blocks: punched holes are free).
fn disk_usage(dir: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    for e in entries.flatten() {
        let Ok(m) = e.metadata() else { continue };
        total += m.blocks() * 512;
        if m.is_dir() {
            total += disk_usage(&e.path());
        }
    }
    total
}

async fn wait_ended(s: &TestServer, sb: &str, cid: &str) -> Value {
    for _ in 0..60 {
        let (st, c) = s
            .get(&format!("/v1/sandboxes/{sb}/commands/{cid}?wait=30s"))
            .await;
        assert_eq!(st, 200, "{c}");
        if c["result"].is_object() || c["state"] == "lost" {
            return c;
        }
    }
    panic!("command {cid} did not end");
}

/// One byte at a time, alternating stdout and stderr: the index of the output (one
/// record per chunk) is capped like the output itself.
#[tokio::test]
async fn tiny_alternating_chunks_cannot_grow_the_index() {
    let _heavy = super::heavy().await;
    let s = TestServer::start_with(&["--output-cap-mib", "2"]).await;
    if !s.runtime_available("gvisor").await {
        return;
    }
    let sb = s
        .create_with(json!({"template": "busybox", "runtime": "gvisor"}))
        .await;
    let script = "awk 'BEGIN { for (i = 0; i < 600000; i++) { printf \"o\"; fflush(); \
                  printf \"e\" > \"/dev/stderr\"; fflush(\"/dev/stderr\") } }'";
    let (st, c) = s
        .post(
            &format!("/v1/sandboxes/{sb}/commands"),
            json!({"shell": script, "timeout_seconds": 600}),
        )
        .await;
    assert_eq!(st, 201, "{c}");
    let cid = c["id"].as_str().unwrap().to_string();
    let c = wait_ended(&s, &sb, &cid).await;
    assert_eq!(c["result"]["exit_code"], 0, "{c}");
    let dir = s.data_dir().join("outputs").join(&sb).join(&cid);
    let index = std::fs::metadata(dir.join("index")).unwrap().len();
    let used = disk_usage(&dir);
    eprintln!(
        "hostile: 1200000 one-byte chunks: index file {index} bytes long, {used} bytes on disk for the command"
    );
    // An index of at most 1 MiB (+1 MiB of rounding) and the output it still places:
    // never 24 bytes per chunk (that would be tens of MB here).
    assert!(used <= 5 << 20, "{used} bytes on disk for 1.2 MB of output");
    // What is kept replays in order and ends with the command's last bytes.
    let (chunks, end) = s.output(&sb, &cid, OutputQuery::default()).await;
    assert!(end.is_some());
    let mut next = None;
    for ch in &chunks {
        if let Some(n) = next {
            assert_eq!(ch.offset, n, "a gap or overlap in the replay");
        }
        next = Some(ch.offset + ch.data.len() as u64);
    }
    assert_eq!(next, Some(1_200_000));
    s.destroy(&sb).await;
    eprintln!("hostile: tiny_alternating_chunks passed on gvisor");
}

/// Many commands in one sandbox: together they keep at most the sandbox's output
/// budget; finished commands lose their output oldest first (and say so), running ones
/// share the budget, the newest output stays whole.
#[tokio::test]
async fn a_sandboxs_commands_share_one_output_budget() {
    let s = TestServer::start_with(&["--output-cap-mib", "4", "--sandbox-output-mib", "8"]).await;
    if !s.runtime_available("gvisor").await {
        return;
    }
    let sb = s
        .create_with(json!({"template": "busybox", "runtime": "gvisor"}))
        .await;
    let root = s.data_dir().join("outputs").join(&sb);
    let mut finished = Vec::new();
    for _ in 0..6 {
        let (st, c) = s
            .post(
                &format!("/v1/sandboxes/{sb}/commands"),
                json!({"shell": "head -c 4000000 /dev/urandom", "wait": true}),
            )
            .await;
        assert_eq!(st, 201, "{c}");
        finished.push(c["id"].as_str().unwrap().to_string());
    }
    // Four at once, 16 MB each: more than the whole budget.
    let mut running = Vec::new();
    for _ in 0..4 {
        let (st, c) = s
            .post(
                &format!("/v1/sandboxes/{sb}/commands"),
                json!({"shell": "head -c 16000000 /dev/urandom"}),
            )
            .await;
        assert_eq!(st, 201, "{c}");
        running.push(c["id"].as_str().unwrap().to_string());
    }
    for cid in &running {
        wait_ended(&s, &sb, cid).await;
    }
    // The server checks the budget every second: wait for it to have caught up.
    let limit: u64 = (8 << 20) + (12 << 20);
    let mut used = disk_usage(&root);
    for _ in 0..100 {
        if used <= limit {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        used = disk_usage(&root);
    }
    eprintln!("hostile: 88 MB of output from 10 commands: {used} bytes kept for the sandbox");
    assert!(
        used <= limit,
        "{used} bytes kept for a sandbox whose budget is 8 MiB"
    );
    // The oldest finished commands say their output was dropped.
    let (_, first) = s
        .get(&format!("/v1/sandboxes/{sb}/commands/{}", finished[0]))
        .await;
    assert_eq!(first["result"]["output_truncated"], true, "{first}");
    // Nothing of it is readable, and nothing pretends to be.
    let (chunks, end) = s.output(&sb, &finished[0], OutputQuery::default()).await;
    assert!(chunks.is_empty());
    assert!(end.unwrap().result.unwrap().output_truncated);
    s.destroy(&sb).await;
    eprintln!("hostile: output_budget passed on gvisor");
}
