//! kill -9 the server while sandboxes run and commands stream; on restart,
//! live sandboxes are re-adopted, vanished ones are `failed`, and no finished
//! output or result is lost.

mod common;

use common::{decode, TestServer};
use futures::StreamExt;
use serde_json::json;
use space_client::{OutputItem, OutputQuery, StdStream};

#[tokio::test]
async fn restart_after_kill9_readopts_and_loses_nothing() {
    let mut s = TestServer::start().await;
    let live = s.create("busybox").await;
    let doomed = s.create("busybox").await;

    // A finished command with output, and state on disk.
    let finished = s
        .sh(
            &live,
            "seq 1 20000; echo to-stderr >&2; echo data > /tmp/kept; exit 5",
        )
        .await;
    assert_eq!(finished["result"]["exit_code"], 5);
    let finished_id = finished["id"].as_str().unwrap().to_string();
    let expected_seq: String = (1..=20000).map(|i| format!("{i}\n")).collect();

    // A command that streams across the restart.
    let (st, streaming) = s
        .post(
            &format!("/v1/sandboxes/{live}/commands"),
            json!({"shell": "i=0; while [ $i -lt 40 ]; do echo tick $i; i=$((i+1)); sleep 0.1; done; exit 9"}),
        )
        .await;
    assert_eq!(st, 201);
    let streaming_id = streaming["id"].as_str().unwrap().to_string();
    // A command that is running in the sandbox that will vanish.
    let (st, orphan) = s
        .post(
            &format!("/v1/sandboxes/{doomed}/commands"),
            json!({"argv": ["sleep", "600"]}),
        )
        .await;
    assert_eq!(st, 201);
    let orphan_id = orphan["id"].as_str().unwrap().to_string();

    // A command that takes input before and after the restart. What the agent took before
    // (its output shows it) counts where the new server's input continues.
    let (st, reader) = s
        .post(
            &format!("/v1/sandboxes/{live}/commands"),
            json!({"argv": ["cat"], "stdin": true}),
        )
        .await;
    assert_eq!(st, 201);
    let reader_id = reader["id"].as_str().unwrap().to_string();
    s.client()
        .write_stdin(&live, &reader_id, "before\n", false)
        .await
        .expect("stdin");
    let mut echoed = s
        .client()
        .command_output(
            &live,
            &reader_id,
            &OutputQuery {
                follow: true,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert!(
        matches!(echoed.next().await, Some(Ok(OutputItem::Chunk { data, .. })) if data == b"before\n"),
        "cat echoed its input"
    );
    drop(echoed);

    // Let some output flow, then kill the server mid-stream.
    let follow = OutputQuery {
        follow: true,
        ..Default::default()
    };
    let mut output = s
        .client()
        .command_output(&live, &streaming_id, &follow)
        .await
        .unwrap();
    let first = output
        .next()
        .await
        .expect("some output before the kill")
        .unwrap();
    assert!(
        matches!(&first, OutputItem::Chunk { data, .. } if !data.is_empty()),
        "{first:?}"
    );
    s.kill9();
    drop(output);

    // While the server is down, one sandbox disappears behind its back: its runsc
    // container is deleted, or (microvm) its QEMU is killed.
    if std::env::var("SPACE_TEST_RUNTIME").as_deref() == Ok("microvm") {
        for (pid, args) in common::processes_mentioning(&doomed) {
            if args.contains("qemu-system") {
                // SAFETY: plain syscall on a pid we just found.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    } else {
        let root = s.runsc_root();
        let st = std::process::Command::new("runsc")
            .arg("--root")
            .arg(&root)
            .args(["delete", "--force", &doomed])
            .status()
            .unwrap();
        assert!(st.success());
    }

    s.kill_and_restart();

    // The live sandbox is re-adopted and usable.
    let (_, v) = s.get(&format!("/v1/sandboxes/{live}")).await;
    assert_eq!(v["state"], "running", "{v}");
    let cmd = s.sh(&live, "cat /tmp/kept").await;
    assert_eq!(cmd["stdout"], "data\n", "{cmd}");

    // The reader takes input again, after what it took before the restart, once.
    s.client()
        .write_stdin(&live, &reader_id, "after\n", true)
        .await
        .expect("stdin");
    let follow_all = OutputQuery {
        follow: true,
        ..Default::default()
    };
    let (chunks, end) = s.output(&live, &reader_id, follow_all).await;
    assert_eq!(decode(&chunks, None), b"before\nafter\n");
    assert_eq!(end.expect("result line").exit_code(), Some(0));

    // The vanished one is failed, with a reason, and its command is lost.
    let (_, v) = s.get(&format!("/v1/sandboxes/{doomed}")).await;
    assert_eq!(v["state"], "failed", "{v}");
    assert!(v["failure_reason"].as_str().unwrap().contains("vanished"));
    let (_, c) = s
        .get(&format!("/v1/sandboxes/{doomed}/commands/{orphan_id}"))
        .await;
    assert_eq!(c["state"], "lost", "{c}");

    // The finished command kept its whole output and its result.
    let (_, c) = s
        .get(&format!("/v1/sandboxes/{live}/commands/{finished_id}"))
        .await;
    assert_eq!(c["state"], "exited");
    assert_eq!(c["result"]["exit_code"], 5);
    let (chunks, end) = s.output(&live, &finished_id, OutputQuery::default()).await;
    assert_eq!(
        String::from_utf8(decode(&chunks, Some(StdStream::Stdout))).unwrap(),
        expected_seq
    );
    assert_eq!(decode(&chunks, Some(StdStream::Stderr)), b"to-stderr\n");
    assert_eq!(end.unwrap().exit_code(), Some(5));

    // The streaming command kept streaming into the same session, complete and in order.
    let (chunks, end) = s.output(&live, &streaming_id, follow).await;
    let want: String = (0..40).map(|i| format!("tick {i}\n")).collect();
    assert_eq!(String::from_utf8(decode(&chunks, None)).unwrap(), want);
    let end = end.expect("result line");
    assert_eq!(end.exit_code(), Some(9), "{end:?}");

    s.destroy(&live).await;
    let (st, op) = s.delete(&format!("/v1/sandboxes/{doomed}")).await;
    assert_eq!(st, 202);
    assert_eq!(
        s.wait_op(op["id"].as_str().unwrap()).await["status"],
        "succeeded"
    );
    s.assert_nothing_left(&doomed);
}

#[tokio::test]
async fn restart_finishes_a_destroy_and_fails_an_interrupted_create() {
    let mut s = TestServer::start().await;
    let sb = s.create("busybox").await;
    let (st, op) = s.delete(&format!("/v1/sandboxes/{sb}")).await;
    assert_eq!(st, 202);
    let destroy_op = op["id"].as_str().unwrap().to_string();
    // Kill at once: the destroy may be anywhere between requested and done.
    s.kill_and_restart();
    let op = s.wait_op(&destroy_op).await;
    assert_eq!(op["status"], "succeeded", "{op}");
    let (_, v) = s.get(&format!("/v1/sandboxes/{sb}")).await;
    assert_eq!(v["state"], "destroyed");
    s.assert_nothing_left(&sb);

    let (st, op) = s
        .post("/v1/sandboxes", json!({"template": "busybox"}))
        .await;
    assert_eq!(st, 202);
    let create_op = op["id"].as_str().unwrap().to_string();
    let created = op["sandbox_id"].as_str().unwrap().to_string();
    s.kill_and_restart();
    let op = s.wait_op(&create_op).await;
    let (_, v) = s.get(&format!("/v1/sandboxes/{created}")).await;
    // Either it finished before the kill, or it is failed and cleaned up: never stuck.
    match op["status"].as_str().unwrap() {
        "succeeded" => {
            assert_eq!(v["state"], "running", "{v}");
            s.destroy(&created).await;
        }
        "failed" => {
            assert_eq!(v["state"], "failed", "{v}");
            s.assert_nothing_left(&created);
        }
        other => panic!("create ended {other}: {op}"),
    }
}
