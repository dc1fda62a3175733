//! The v1 API end to end: real server, real runsc, real SQLite.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::{decode, TestServer, TOKEN};
use serde_json::{json, Value};
use space_client::api::{CommandState, ErrorCode};
use space_client::{OutputQuery, OutputView, StdStream};

#[tokio::test]
async fn python_on_debian_prints_42() {
    let s = TestServer::start().await;
    let sb = s.create("debian").await;
    let cmd = s.run(&sb, &["python3", "-c", "print(6*7)"]).await;
    assert_eq!(cmd["state"], "exited", "{cmd}");
    assert_eq!(cmd["result"]["exit_code"], 0);
    assert_eq!(cmd["stdout"], "42\n");
    assert_eq!(cmd["result"]["stdout_bytes"], 3);
    s.destroy(&sb).await;
}

#[tokio::test]
async fn exit_codes_signals_and_env() {
    let s = TestServer::start().await;
    let sb = s
        .create_with(json!({"template": "busybox", "env": {"SB_VAR": "from-sandbox"}}))
        .await;

    let cmd = s.sh(&sb, "exit 3").await;
    assert_eq!(cmd["state"], "exited");
    assert_eq!(cmd["result"]["exit_code"], 3);
    assert_eq!(cmd["result"]["signal"], Value::Null);

    // Killed by a signal: reported as the signal, not as an exit code.
    let cmd = s.sh(&sb, "kill -9 $$").await;
    assert_eq!(cmd["state"], "killed", "{cmd}");
    assert_eq!(cmd["result"]["signal"], 9);
    assert_eq!(cmd["result"]["exit_code"], Value::Null);

    // A signal sent through the API reaches the command.
    let (st, cmd) = s
        .post(
            &format!("/v1/sandboxes/{sb}/commands"),
            json!({"argv": ["sleep", "300"]}),
        )
        .await;
    assert_eq!(st, 201, "{cmd}");
    assert_eq!(cmd["state"], "running");
    let cid = cmd["id"].as_str().unwrap();
    let (st, _) = s
        .post(
            &format!("/v1/sandboxes/{sb}/commands/{cid}/signal"),
            json!({"signal": "TERM"}),
        )
        .await;
    assert_eq!(st, 200);
    let (_, cmd) = s
        .get(&format!("/v1/sandboxes/{sb}/commands/{cid}?wait=30s"))
        .await;
    assert_eq!(cmd["state"], "killed", "{cmd}");
    assert_eq!(cmd["result"]["signal"], 15);

    // stdout and stderr stay apart; env, cwd and user are applied.
    let (st, cmd) = s
        .post(
            &format!("/v1/sandboxes/{sb}/commands"),
            json!({
                "shell": "echo out; echo err >&2; echo $SB_VAR $CMD_VAR; pwd; id -u; id -G",
                "env": {"CMD_VAR": "from-command"},
                "cwd": "/tmp",
                "user": "user",
                "wait": true
            }),
        )
        .await;
    assert_eq!(st, 201, "{cmd}");
    assert_eq!(
        cmd["stdout"],
        "out\nfrom-sandbox from-command\n/tmp\n1000\n1000\n"
    );
    assert_eq!(cmd["stderr"], "err\n");

    // Commands get the signals the agent changed back at their defaults: a writer whose
    // reader has gone ends by SIGPIPE (128 + 13), as in any shell (an ignored SIGPIPE
    // would reach `yes`, whose write would fail: 1).
    let cmd = s
        .run(
            &sb,
            &["sh", "-c", "{ yes; echo $? >&2; } | head -c1 >/dev/null"],
        )
        .await;
    assert_eq!(cmd["stderr"], "141\n", "{cmd}");

    // A program that does not exist: exit 127 and a message, like a shell.
    let cmd = s.run(&sb, &["/no/such/program"]).await;
    assert_eq!(cmd["result"]["exit_code"], 127, "{cmd}");
    assert!(cmd["stderr"].as_str().unwrap().contains("/no/such/program"));

    // A timeout kills the command and says so.
    let (st, cmd) = s
        .post(
            &format!("/v1/sandboxes/{sb}/commands"),
            json!({"argv": ["sleep", "300"], "timeout_seconds": 1, "wait": true}),
        )
        .await;
    assert_eq!(st, 201);
    assert_eq!(cmd["state"], "timed_out", "{cmd}");
    assert_eq!(cmd["result"]["timed_out"], true);

    let (_, list) = s.get(&format!("/v1/sandboxes/{sb}/commands")).await;
    assert_eq!(list["commands"].as_array().unwrap().len(), 7);
    s.destroy(&sb).await;
}

/// Everything under `dir` with its type, size, mode and mtime.
fn tree_fingerprint(dir: &Path) -> BTreeMap<String, String> {
    use std::os::unix::fs::MetadataExt;
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            let rel = e.path().strip_prefix(dir).unwrap().display().to_string();
            out.insert(
                rel,
                format!(
                    "{:o} {} {} {}",
                    m.mode(),
                    m.len(),
                    m.mtime(),
                    m.mtime_nsec()
                ),
            );
            if m.is_dir() {
                stack.push(e.path());
            }
        }
    }
    out
}

#[tokio::test]
async fn writes_stay_in_their_sandbox_and_the_template_is_untouched() {
    let s = TestServer::start().await;
    let rootfs = common::templates_dir().join("busybox/rootfs");
    let a = s.create("busybox").await;
    let before = tree_fingerprint(&rootfs);
    let b = s.create("busybox").await;

    // Files and directories persist across commands; cwd can point into them.
    let cmd = s
        .sh(
            &a,
            "mkdir -p /work/dir && echo hello > /work/dir/f && echo etc >> /etc/passwd",
        )
        .await;
    assert_eq!(cmd["result"]["exit_code"], 0, "{cmd}");
    let (_, cmd) = s
        .post(
            &format!("/v1/sandboxes/{a}/commands"),
            json!({"shell": "pwd; cat f", "cwd": "/work/dir", "wait": true}),
        )
        .await;
    assert_eq!(cmd["stdout"], "/work/dir\nhello\n", "{cmd}");

    // The other sandbox from the same template sees none of it.
    let cmd = s
        .sh(
            &b,
            "ls /work 2>&1; grep -c etc /etc/passwd; echo b > /tmp/only-b",
        )
        .await;
    assert!(
        cmd["stdout"].as_str().unwrap().contains("No such file"),
        "{cmd}"
    );
    let cmd = s.sh(&a, "cat /tmp/only-b").await;
    assert_ne!(cmd["result"]["exit_code"], 0);

    s.destroy(&a).await;
    s.destroy(&b).await;
    assert_eq!(before, tree_fingerprint(&rootfs), "the template changed");
}

#[tokio::test]
async fn a_mebibyte_of_stdout_arrives_complete_and_replays_from_any_offset() {
    let s = TestServer::start().await;
    let sb = s.create("busybox").await;
    // 1 MiB of numbered lines, then a marker on stderr.
    let script =
        "i=0; while [ $i -lt 16384 ]; do printf '%063d\\n' $i; i=$((i+1)); done; echo done >&2";
    let cmd = s.sh(&sb, script).await;
    assert_eq!(cmd["result"]["exit_code"], 0, "{cmd}");
    let expected: Vec<u8> = (0..16384)
        .flat_map(|i| format!("{i:063}\n").into_bytes())
        .collect();
    assert_eq!(expected.len(), 1 << 20);
    assert_eq!(cmd["result"]["stdout_bytes"], 1 << 20);
    assert_eq!(cmd["stdout"].as_str().unwrap().as_bytes(), &expected[..]);
    let cid = cmd["id"].as_str().unwrap();

    let stdout = OutputQuery {
        view: OutputView::Stdout,
        ..Default::default()
    };
    let (chunks, end) = s.output(&sb, cid, stdout).await;
    assert_eq!(decode(&chunks, None), expected);
    assert_eq!(end.unwrap().exit_code(), Some(0));

    for offset in [0usize, 1, 65_535, 65_536, 777_777, (1 << 20) - 1, 1 << 20] {
        let q = OutputQuery {
            offset: offset as u64,
            ..stdout
        };
        let (chunks, _) = s.output(&sb, cid, q).await;
        assert_eq!(
            decode(&chunks, None),
            &expected[offset..],
            "offset {offset}"
        );
        if let Some(first) = chunks.first() {
            assert_eq!(first.offset, offset as u64);
        }
    }

    // The combined view: both streams interleaved in the order the agent read them
    // (two pipes: that order is not the order the shell wrote in), each stream intact,
    // and any offset into it replays exactly.
    let (chunks, _) = s.output(&sb, cid, OutputQuery::default()).await;
    assert_eq!(decode(&chunks, Some(StdStream::Stdout)), expected);
    assert_eq!(decode(&chunks, Some(StdStream::Stderr)), b"done\n");
    let all = decode(&chunks, None);
    assert_eq!(all.len(), expected.len() + 5);
    let err_at = chunks
        .iter()
        .find(|c| c.stream == StdStream::Stderr)
        .map(|c| c.offset)
        .unwrap() as usize;
    let q = OutputQuery {
        offset: err_at as u64 + 2,
        ..Default::default()
    };
    let (chunks, _) = s.output(&sb, cid, q).await;
    assert_eq!(decode(&chunks, None), &all[err_at + 2..]);
    assert_eq!(decode(&chunks, Some(StdStream::Stderr)), b"ne\n");
    s.destroy(&sb).await;
}

#[tokio::test]
async fn output_streams_live_with_follow() {
    let s = TestServer::start().await;
    let sb = s.create("busybox").await;
    let (st, cmd) = s
        .post(
            &format!("/v1/sandboxes/{sb}/commands"),
            json!({"shell": "for i in 1 2 3 4 5; do echo line $i; sleep 0.2; done; exit 4"}),
        )
        .await;
    assert_eq!(st, 201);
    let cid = cmd["id"].as_str().unwrap();
    let follow = OutputQuery {
        follow: true,
        ..Default::default()
    };
    let (chunks, end) = s.output(&sb, cid, follow).await;
    assert_eq!(
        String::from_utf8(decode(&chunks, Some(StdStream::Stdout))).unwrap(),
        "line 1\nline 2\nline 3\nline 4\nline 5\n"
    );
    let end = end.expect("a result line");
    assert_eq!(end.exit_code(), Some(4));
    assert_eq!(end.state, CommandState::Exited);
    s.destroy(&sb).await;
}

#[tokio::test]
async fn a_command_running_at_destroy_ends_lost() {
    let s = TestServer::start().await;
    let sb = s.create("busybox").await;
    let (st, cmd) = s
        .post(
            &format!("/v1/sandboxes/{sb}/commands"),
            json!({"argv": ["sleep", "600"]}),
        )
        .await;
    assert_eq!(st, 201);
    let cid = cmd["id"].as_str().unwrap().to_string();
    s.destroy(&sb).await;
    let (st, cmd) = s.get(&format!("/v1/sandboxes/{sb}/commands/{cid}")).await;
    assert_eq!(st, 200);
    assert_eq!(cmd["state"], "lost", "{cmd}");
    assert_eq!(cmd["result"], Value::Null);
    assert!(cmd["lost_reason"].as_str().unwrap().contains("destroyed"));
}

#[tokio::test]
async fn bad_input_gets_a_clear_error_and_changes_nothing() {
    let s = TestServer::start().await;
    let sb = s.create("busybox").await;
    let count = |s: &TestServer| {
        let c = s.client().clone();
        async move {
            let all = std::iter::empty::<(&str, &str)>();
            c.list_sandboxes(all).await.unwrap().len()
        }
    };
    let before = count(&s).await;

    let raw = |body: &'static str| {
        s.req(reqwest::Method::POST, "/v1/sandboxes")
            .header("content-type", "application/json")
            .body(body)
    };
    for (body, want) in [
        ("{not json", 400),
        (r#"{"template":"busybox","bogus":1}"#, 400),
        (r#"{"template":"no-such-template"}"#, 404),
        (r#"{"template":"busybox","runtime":"docker"}"#, 400),
        (r#"{"template":"busybox","resources":{"vcpus":0}}"#, 400),
        (r#"{"template":"busybox","env":{"A=B":"c"}}"#, 400),
        (r#"{"template":"../../etc"}"#, 404),
    ] {
        let resp = raw(body).send().await.unwrap();
        assert_eq!(resp.status().as_u16(), want, "{body}");
        let v: Value = resp.json().await.unwrap();
        assert!(v["error"]["code"].is_string(), "{v}");
        assert!(!v["error"]["message"].as_str().unwrap().is_empty(), "{v}");
    }

    // Oversized body: refused from its declared length, before it is read.
    {
        use std::io::{Read, Write};
        let addr = s.url.trim_start_matches("http://");
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        write!(
            c,
            "POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{{\"template\":\"",
            4 << 20
        )
        .unwrap();
        c.write_all(&vec![b'x'; 64 * 1024]).unwrap();
        let mut head = [0u8; 12];
        c.read_exact(&mut head).unwrap();
        assert_eq!(&head, b"HTTP/1.1 413", "{}", String::from_utf8_lossy(&head));
    }
    // An oversize body without a declared length (chunked) is cut off at the limit.
    let big = futures::stream::iter(
        (0..40).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b' '; 64 * 1024]))),
    );
    // A client of its own: the server closes this connection after the 413.
    let resp = s
        .client_as(TOKEN)
        .request(reqwest::Method::POST, "/v1/sandboxes")
        .header("content-type", "application/json")
        .body(reqwest::Body::wrap_stream(big))
        .send()
        .await;
    if let Ok(resp) = resp {
        assert_eq!(resp.status().as_u16(), 413);
    }

    // Wrong or missing token.
    let all = std::iter::empty::<(&str, &str)>();
    let e = s.client_as("wrong").list_sandboxes(all).await.unwrap_err();
    assert_eq!(e.status(), Some(401), "{e}");
    assert_eq!(e.api_error().map(|a| a.code), Some(ErrorCode::Unauthorized));
    let resp = s
        .client()
        .http()
        .get(format!("{}/v1/sandboxes", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["code"], "unauthorized");

    // Unknown sandbox, operation and command.
    let (st, v) = s.get("/v1/sandboxes/sb_aaaaaaaaaaaaaaaaaaaa").await;
    assert_eq!(st, 404, "{v}");
    let (st, _) = s.get("/v1/sandboxes/not-an-id").await;
    assert_eq!(st, 404);
    let (st, _) = s.delete("/v1/sandboxes/sb_aaaaaaaaaaaaaaaaaaaa").await;
    assert_eq!(st, 404);
    let (st, _) = s.get("/v1/operations/op_aaaaaaaaaaaaaaaaaaaa").await;
    assert_eq!(st, 404);
    let (st, _) = s
        .get(&format!(
            "/v1/sandboxes/{sb}/commands/cmd_aaaaaaaaaaaaaaaaaaaa"
        ))
        .await;
    assert_eq!(st, 404);

    // Bad commands.
    for body in [
        json!({}),
        json!({"argv": []}),
        json!({"argv": ["true"], "shell": "true"}),
        json!({"argv": ["true"], "nope": 1}),
        json!({"argv": ["a\u{0}b"]}),
    ] {
        let (st, v) = s
            .post(&format!("/v1/sandboxes/{sb}/commands"), body.clone())
            .await;
        assert_eq!(st, 400, "{body} -> {v}");
    }
    let (st, _) = s
        .get(&format!(
            "/v1/sandboxes/{sb}/commands/cmd_aaaaaaaaaaaaaaaaaaaa/output?offset=-1"
        ))
        .await;
    assert!(st == 400 || st == 404);
    // A bad wait on an operation the caller has (an unknown one is 404 before anything else).
    let (_, ops) = s.get(&format!("/v1/operations?sandbox_id={sb}")).await;
    let op = ops["operations"][0]["id"].as_str().unwrap().to_string();
    let (st, _) = s.get(&format!("/v1/operations/{op}?wait=forever")).await;
    assert_eq!(st, 400);
    let (st, _) = s
        .get("/v1/operations/op_aaaaaaaaaaaaaaaaaaaa?wait=forever")
        .await;
    assert_eq!(st, 404);

    // Illegal transitions: 409 with the reason.
    let (st, v) = s
        .post(&format!("/v1/sandboxes/{sb}/resume"), json!({}))
        .await;
    assert_eq!(st, 409, "{v}");
    assert_eq!(
        v["error"]["message"],
        "cannot resume a sandbox that is running"
    );
    let (_, list) = s.get(&format!("/v1/sandboxes/{sb}/commands")).await;
    assert!(list["commands"].as_array().unwrap().is_empty(), "{list}");
    assert_eq!(count(&s).await, before);

    s.destroy(&sb).await;
    let (st, v) = s.delete(&format!("/v1/sandboxes/{sb}")).await;
    assert_eq!(st, 409, "{v}");
    let (st, _) = s
        .post(
            &format!("/v1/sandboxes/{sb}/commands"),
            json!({"argv": ["true"]}),
        )
        .await;
    assert_eq!(st, 409);
}

#[tokio::test]
async fn pause_and_resume_keep_the_sandbox() {
    let s = TestServer::start().await;
    let sb = s.create("busybox").await;
    s.sh(&sb, "echo kept > /tmp/f").await;
    let (st, op) = s
        .post(&format!("/v1/sandboxes/{sb}/pause"), json!({}))
        .await;
    assert_eq!(st, 202);
    assert_eq!(
        s.wait_op(op["id"].as_str().unwrap()).await["status"],
        "succeeded"
    );
    let (_, v) = s.get(&format!("/v1/sandboxes/{sb}")).await;
    assert_eq!(v["state"], "paused");
    let (st, _) = s
        .post(
            &format!("/v1/sandboxes/{sb}/commands"),
            json!({"argv": ["true"]}),
        )
        .await;
    assert_eq!(st, 409);
    let (st, op) = s
        .post(&format!("/v1/sandboxes/{sb}/resume"), json!({}))
        .await;
    assert_eq!(st, 202);
    assert_eq!(
        s.wait_op(op["id"].as_str().unwrap()).await["status"],
        "succeeded"
    );
    assert_eq!(s.sh(&sb, "cat /tmp/f").await["stdout"], "kept\n");
    s.destroy(&sb).await;
}

#[tokio::test]
async fn operations_list_wait_and_cancel_a_pending_create() {
    // One create at a time: the later ones wait as `pending`.
    let s = TestServer::start_with(&["--max-concurrent-creates", "1"]).await;
    let mut ops = Vec::new();
    for _ in 0..4 {
        let (st, op) = s
            .post("/v1/sandboxes", json!({"template": "busybox"}))
            .await;
        assert_eq!(st, 202);
        assert_eq!(op["status"], "pending");
        ops.push(op);
    }
    let last = ops.last().unwrap();
    let last_id = last["id"].as_str().unwrap();
    let (st, cancelled) = s
        .post(&format!("/v1/operations/{last_id}/cancel"), json!({}))
        .await;
    assert_eq!(st, 200, "{cancelled}");
    assert_eq!(cancelled["status"], "cancelled");
    let sb_cancelled = last["sandbox_id"].as_str().unwrap();
    let (_, v) = s.get(&format!("/v1/sandboxes/{sb_cancelled}")).await;
    assert_eq!(v["state"], "destroyed");

    let mut sandboxes = Vec::new();
    for op in &ops[..3] {
        let done = s.wait_op(op["id"].as_str().unwrap()).await;
        assert_eq!(done["status"], "succeeded", "{done}");
        sandboxes.push(done["sandbox_id"].as_str().unwrap().to_string());
    }
    // A finished operation cannot be cancelled.
    let first = ops[0]["id"].as_str().unwrap();
    let (st, _) = s
        .post(&format!("/v1/operations/{first}/cancel"), json!({}))
        .await;
    assert_eq!(st, 409);

    let (st, list) = s.get("/v1/operations?limit=100").await;
    assert_eq!(st, 200);
    assert_eq!(list["operations"].as_array().unwrap().len(), 4);
    let (_, list) = s
        .get(&format!("/v1/operations?sandbox_id={}", sandboxes[0]))
        .await;
    assert_eq!(list["operations"].as_array().unwrap().len(), 1);

    // Labels filter the sandbox list.
    let labelled = s
        .create_with(json!({"template": "busybox", "labels": {"team": "red"}}))
        .await;
    let (_, list) = s.get("/v1/sandboxes?label=team=red").await;
    let ids: Vec<&str> = list["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec![labelled.as_str()]);

    let (_, templates) = s.get("/v1/templates").await;
    let names: Vec<&str> = templates["templates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"busybox") && names.contains(&"debian"));

    for sb in sandboxes.iter().chain([&labelled]) {
        s.destroy(sb).await;
    }
    s.assert_nothing_left(sb_cancelled);
}

/// A sandbox created without `resources` gets the server's defaults (2 vCPUs, as E2B's),
/// and they are enforced: the CPUs the sandbox sees, and its host CPU quota.
#[tokio::test]
async fn default_resources_are_applied() {
    let s = TestServer::start().await;
    let sb = s.create_with(json!({"template": "busybox"})).await;
    let (_, v) = s.get(&format!("/v1/sandboxes/{sb}")).await;
    assert_eq!(
        v["resources"],
        json!({"vcpus": 2, "memory_mib": 512, "disk_mib": 4096, "pids": 1024}),
        "{v}"
    );
    assert_eq!(s.sh(&sb, "nproc").await["stdout"], "2\n");
    // The quota on the host, where gVisor's is its cgroup's: 2 CPUs' worth of every
    // period (cgroup v1 or v2).
    if v["runtime"] == "gvisor" {
        assert_cpu_quota(&sb, 2.0);
    }
    s.destroy(&sb).await;
    s.assert_nothing_left(&sb);
}

/// Asserts that gVisor sandbox `sb`'s host cgroup allows `cpus` CPUs' worth of each period.
fn assert_cpu_quota(sb: &str, cpus: f64) {
    assert_eq!(common::cgroup_cpu_quota("space", sb), Some(cpus), "{sb}");
}

#[tokio::test]
async fn resources_are_applied() {
    let s = TestServer::start().await;
    let sb = s
        .create_with(json!({
            "template": "busybox",
            "resources": {"vcpus": 1, "memory_mib": 256, "pids": 64}
        }))
        .await;
    let (_, v) = s.get(&format!("/v1/sandboxes/{sb}")).await;
    // Fewer vCPUs than the default (2), as asked.
    assert_eq!(v["resources"]["vcpus"], 1);
    assert_eq!(v["resources"]["memory_mib"], 256);
    // gVisor shows a sandbox at least 2 CPUs whatever its quota (runsc's
    // `--cpu-num-from-quota` rounds up to 2): the quota is what holds it to 1.
    let seen = if v["runtime"] == "gvisor" {
        assert_cpu_quota(&sb, 1.0);
        "2"
    } else {
        "1"
    };
    let cmd = s.sh(&sb, "nproc; grep MemTotal /proc/meminfo").await;
    let out = cmd["stdout"].as_str().unwrap();
    assert!(out.starts_with(&format!("{seen}\n")), "{out}");
    let kib: u64 = out
        .split_whitespace()
        .nth(2)
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(kib <= 256 * 1024, "MemTotal {kib} KiB");
    // The pids limit holds inside the sandbox: forks fail with EAGAIN at the limit,
    // and the sandbox itself stays healthy.
    let (st, cmd) = s
        .post(
            &format!("/v1/sandboxes/{sb}/commands"),
            json!({
                "shell": "i=0; while [ $i -lt 100 ]; do sleep 60 & i=$((i+1)); echo $i; done",
                "user": "user",
                "wait": true
            }),
        )
        .await;
    assert_eq!(st, 201, "{cmd}");
    let started: u32 = cmd["stdout"]
        .as_str()
        .unwrap()
        .lines()
        .last()
        .and_then(|l| l.parse().ok())
        .unwrap_or(0);
    assert!(
        started > 10 && started <= 64,
        "{started} sleepers started: {cmd}"
    );
    assert!(cmd["stderr"].as_str().unwrap().contains("fork"), "{cmd}");
    assert_eq!(s.sh(&sb, "echo alive").await["stdout"], "alive\n");
    s.destroy(&sb).await;
}

#[tokio::test]
async fn the_agent_socket_refuses_impostors() {
    use std::io::{BufRead, BufReader, Write};
    let s = TestServer::start().await;
    let sb = s.create("busybox").await;
    let sock = s
        .data_dir()
        .join("sandboxes")
        .join(&sb)
        .join("run/agent.sock");

    // The right sandbox id with a wrong token is refused.
    let mut c = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    let hello = json!({"protocol": 1, "sandbox_id": sb, "token": "wrong", "agent_version": "x"});
    writeln!(c, "{hello}").unwrap();
    let mut line = String::new();
    BufReader::new(&c).read_line(&mut line).unwrap();
    let reply: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(reply["ok"], false, "{reply}");

    // An endless line of garbage is cut off, not buffered.
    let mut c = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    let junk = vec![b'x'; 64 * 1024];
    let mut refused = false;
    for _ in 0..64 {
        if c.write_all(&junk).is_err() {
            refused = true;
            break;
        }
    }
    assert!(refused, "a 4 MiB handshake line was accepted");

    // The real agent's connection is untouched.
    let cmd = s.sh(&sb, "echo still-fine").await;
    assert_eq!(cmd["stdout"], "still-fine\n");
    s.destroy(&sb).await;
}

/// The sandboxes' cpuset cgroup parent on this host (v1's cpuset hierarchy, or v2).
fn cpuset_parent() -> std::path::PathBuf {
    space_runtime::cpus::cpuset_parent("space")
}

/// The CPUs a cpuset cgroup file lists.
fn cpus_in(file: &Path) -> Vec<usize> {
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    space_runtime::cpus::parse_list(&text)
}

/// The CPUs a sandbox's cgroup lets it run on.
fn sandbox_cpus(sb: &str) -> Vec<usize> {
    cpus_in(&cpuset_parent().join(sb).join("cpuset.cpus"))
}

/// Each sandbox with fewer vCPUs than the host has CPUs gets CPUs of its own, the least
/// used ones, with `--cpu-pinning`; a suspended one is placed again when it resumes; a
/// server without it (the default), `--no-cpu-pinning` (which wins) and a sandbox as large
/// as the host leave it free.
#[tokio::test]
async fn sandboxes_get_cpus_of_their_own() {
    let s = TestServer::start_with(&["--cpu-pinning"]).await;
    let a = s
        .create_with(json!({"template": "busybox", "resources": {"vcpus": 1}}))
        .await;
    let b = s
        .create_with(json!({"template": "busybox", "resources": {"vcpus": 1}}))
        .await;
    // What the sandboxes may use (the parent exists once one sandbox does). Which CPUs
    // they get depends on what else runs (other tests here): the spread itself is shown
    // by `space_runtime::cpus`'s tests.
    let file = if cpuset_parent().join("cpuset.cpus.effective").exists() {
        "cpuset.cpus.effective"
    } else {
        "cpuset.cpus"
    };
    let host = cpus_in(&cpuset_parent().join(file)).len();
    for sb in [&a, &b] {
        let cpus = sandbox_cpus(sb);
        assert_eq!(
            cpus.len(),
            if host >= 2 { 1 } else { host },
            "{sb}: {cpus:?}"
        );
    }
    assert_eq!(s.sh(&a, "echo ok").await["stdout"], "ok\n");
    assert_eq!(s.sh(&b, "echo ok").await["stdout"], "ok\n");

    // Suspended and resumed (a restore): placed again, still running commands.
    for action in ["suspend", "resume"] {
        let (st, op) = s
            .post(&format!("/v1/sandboxes/{a}/{action}"), json!({}))
            .await;
        assert_eq!(st, 202, "{op}");
        let op = s.wait_op(op["id"].as_str().unwrap()).await;
        assert_eq!(op["status"], "succeeded", "{op}");
    }
    if host >= 2 {
        assert_eq!(sandbox_cpus(&a).len(), 1, "not placed after a restore");
    }
    assert_eq!(s.sh(&a, "echo back").await["stdout"], "back\n");

    // As many vCPUs as the host has CPUs: nothing to choose.
    let all = s
        .create_with(json!({"template": "busybox", "resources": {"vcpus": host}}))
        .await;
    assert_eq!(sandbox_cpus(&all).len(), host);
    for sb in [&a, &b, &all] {
        s.destroy(sb).await;
        s.assert_nothing_left(sb);
    }

    drop(s);

    // Pinning off, by default or by the old flag (which wins): a small sandbox may run anywhere.
    for flags in [&[][..], &["--cpu-pinning", "--no-cpu-pinning"][..]] {
        let s = TestServer::start_with(flags).await;
        let c = s
            .create_with(json!({"template": "busybox", "resources": {"vcpus": 1}}))
            .await;
        assert_eq!(sandbox_cpus(&c).len(), host, "{flags:?}");
        assert_eq!(s.sh(&c, "echo free").await["stdout"], "free\n");
        s.destroy(&c).await;
        s.assert_nothing_left(&c);
    }
}
