//! Disk quotas: each sandbox's writable layer is bounded by `disk_mib`; filling it
//! gives ENOSPC inside and never more than the quota on the host. Real runsc.

mod common;

use common::TestServer;
use serde_json::{json, Value};

/// The sandbox's writable layer on the host: gVisor's ext4 image, or the microVM's
/// qcow2 overlay.
fn disk_image(s: &TestServer, sb: &str) -> std::path::PathBuf {
    let dir = s.data_dir().join("sandboxes").join(sb);
    ["disk.img", "disk.qcow2"]
        .iter()
        .map(|f| dir.join(f))
        .find(|p| p.exists())
        .unwrap_or_else(|| dir.join("disk.img"))
}

/// Bytes the (sparse) image really takes on the host.
fn allocated(path: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).expect("disk image").blocks() * 512
}

async fn op_ok(s: &TestServer, resp: (u16, Value)) {
    let (st, op) = resp;
    assert_eq!(st, 202, "{op}");
    let done = s.wait_op(op["id"].as_str().unwrap()).await;
    assert_eq!(done["status"], "succeeded", "{done}\n{}", s.log());
}

#[tokio::test]
async fn filling_the_disk_gives_enospc_inside_and_stays_within_the_quota() {
    let s = TestServer::start().await;
    let sb = s
        .create_with(json!({"template": "busybox", "resources": {"disk_mib": 64}}))
        .await;
    let neighbour = s.create("busybox").await;
    let (_, v) = s.get(&format!("/v1/sandboxes/{sb}")).await;
    assert_eq!(v["resources"]["disk_mib"], 64, "{v}");

    // 200 MiB into a 64 MiB disk: the writer gets ENOSPC, the sandbox lives on.
    let fill = s
        .sh(
            &sb,
            "dd if=/dev/zero of=/big bs=1M count=200; echo rc=$?; echo more > /small; echo small=$?",
        )
        .await;
    let out = format!("{}{}", fill["stdout"], fill["stderr"]);
    assert!(out.contains("No space left on device"), "{fill}");
    assert!(fill["stdout"].as_str().unwrap().contains("rc=1"), "{fill}");
    let host = allocated(&disk_image(&s, &sb));
    assert!(
        host <= (64 + 16 + 8) << 20,
        "the image takes {host} bytes on the host"
    );
    let (_, v) = s.get(&format!("/v1/sandboxes/{sb}")).await;
    let used = v["cost"]["disk_bytes"].as_u64().expect("disk_bytes");
    assert!(used > 32 << 20, "{v}");

    // Freeing space makes room again; the neighbour never noticed.
    let again = s
        .sh(
            &sb,
            "rm /big && dd if=/dev/zero of=/f bs=1M count=8 2>/dev/null && echo ok",
        )
        .await;
    assert_eq!(again["stdout"], "ok\n", "{again}");
    let n = s
        .sh(
            &neighbour,
            "dd if=/dev/zero of=/n bs=1M count=100 2>/dev/null && echo ok",
        )
        .await;
    assert_eq!(n["stdout"], "ok\n", "{n}");

    s.destroy(&sb).await;
    s.destroy(&neighbour).await;
}

#[tokio::test]
async fn the_quota_and_the_files_survive_suspend_and_resume() {
    let s = TestServer::start().await;
    let sb = s
        .create_with(json!({"template": "busybox", "resources": {"disk_mib": 64}}))
        .await;
    let w = s
        .sh(
            &sb,
            "dd if=/dev/urandom of=/data bs=1M count=10 2>/dev/null; md5sum /data",
        )
        .await;
    let sum = w["stdout"].as_str().unwrap().to_string();
    for _ in 0..2 {
        op_ok(
            &s,
            s.post(&format!("/v1/sandboxes/{sb}/suspend"), json!({}))
                .await,
        )
        .await;
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        assert!(!mounts.contains(&sb), "a suspended sandbox keeps no mount");
        let (_, v) = s.get(&format!("/v1/sandboxes/{sb}")).await;
        assert!(v["cost"]["disk_bytes"].as_u64().is_some(), "{v}");
        op_ok(
            &s,
            s.post(&format!("/v1/sandboxes/{sb}/resume"), json!({}))
                .await,
        )
        .await;
        assert_eq!(s.sh(&sb, "md5sum /data").await["stdout"], sum.as_str());
    }
    let fill = s
        .sh(
            &sb,
            "dd if=/dev/zero of=/big bs=1M count=200 2>&1; echo rc=$?",
        )
        .await;
    assert!(
        fill["stdout"].as_str().unwrap().contains("No space left"),
        "{fill}"
    );
    s.destroy(&sb).await;
}

#[tokio::test]
async fn disk_sizes_out_of_range_are_refused() {
    let s = TestServer::start().await;
    for bad in [json!(1), json!(0), json!(1u64 << 40), json!("big")] {
        let (st, v) = s
            .post(
                "/v1/sandboxes",
                json!({"template": "busybox", "resources": {"disk_mib": bad}}),
            )
            .await;
        assert_eq!(st, 400, "{bad}: {v}");
    }
    let (_, list) = s.get("/v1/sandboxes").await;
    assert_eq!(
        list["sandboxes"].as_array().map(Vec::len),
        Some(0),
        "{list}"
    );
}
