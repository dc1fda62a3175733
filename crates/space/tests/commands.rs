//! Command sessions: stdin, the attach WebSocket, signals, timeouts,
//! background processes and concurrency. Real runsc, real HTTP.

mod common;

use std::time::Duration;

use common::{decode, TestServer};
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use space_client::api::{CommandState, CreateCommandRequest};
use space_client::{AttachSocket, OutputQuery, OutputView, StdStream};
use tokio_tungstenite::tungstenite::Message;

async fn start(s: &TestServer, sb: &str, body: Value) -> String {
    let (st, cmd) = s.post(&format!("/v1/sandboxes/{sb}/commands"), body).await;
    assert_eq!(st, 201, "{cmd}");
    cmd["id"].as_str().unwrap().to_string()
}

async fn stdin(s: &TestServer, sb: &str, cid: &str, data: &'static str, eof: bool) -> u16 {
    s.req(
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{sb}/commands/{cid}/stdin?eof={eof}"),
    )
    .body(data)
    .send()
    .await
    .unwrap()
    .status()
    .as_u16()
}

#[tokio::test]
async fn stdin_through_post_with_eof() {
    let s = TestServer::start().await;
    let sb = s.create("busybox").await;
    let cid = start(&s, &sb, json!({"argv": ["cat"], "stdin": true})).await;
    assert_eq!(stdin(&s, &sb, &cid, "hello\n", false).await, 204);
    assert_eq!(stdin(&s, &sb, &cid, "world", true).await, 204);
    let (_, cmd) = s
        .get(&format!("/v1/sandboxes/{sb}/commands/{cid}?wait=30s"))
        .await;
    assert_eq!(cmd["state"], "exited", "{cmd}");
    assert_eq!(cmd["stdin"], true);
    let (chunks, _) = s.output(&sb, &cid, OutputQuery::default()).await;
    assert_eq!(decode(&chunks, Some(StdStream::Stdout)), b"hello\nworld");
    // Too late now, and never for a command without stdin.
    assert_eq!(stdin(&s, &sb, &cid, "x", false).await, 409);
    let other = start(&s, &sb, json!({"argv": ["sleep", "30"]})).await;
    assert_eq!(stdin(&s, &sb, &other, "x", false).await, 409);
    s.destroy(&sb).await;
}

/// Input for a command that ends as it arrives is taken (204) or refused as too late
/// (409), never left waiting for an agent that will not attach again (that was a 503
/// after 20 s).
#[tokio::test]
async fn stdin_racing_the_end_of_a_command_gets_an_answer() {
    let s = TestServer::start().await;
    let sb = s.create("busybox").await;
    for _ in 0..10 {
        let cid = start(&s, &sb, json!({"argv": ["true"], "stdin": true})).await;
        let st = stdin(&s, &sb, &cid, "x", true).await;
        assert!(st == 204 || st == 409, "stdin to an ending command: {st}");
    }
    s.destroy(&sb).await;
}

/// Connects to a command's attach WebSocket.
async fn attach(s: &TestServer, sb: &str, cid: &str) -> AttachSocket {
    s.client().attach(sb, cid, None).await.expect("attach")
}

/// Reads output from the socket until the exit message; returns (stdout, stderr, exit).
async fn read_until_exit(ws: &mut AttachSocket) -> (Vec<u8>, Vec<u8>, Value) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(30), ws.next())
            .await
            .expect("attach output in time")
            .expect("socket open")
            .expect("message");
        match msg {
            Message::Binary(b) => match b.first() {
                Some(1) => out.extend_from_slice(&b[1..]),
                Some(2) => err.extend_from_slice(&b[1..]),
                _ => panic!("bad frame"),
            },
            Message::Text(t) => {
                let v: Value = serde_json::from_str(&t).unwrap();
                if v["type"] == "exit" {
                    return (out, err, v);
                }
                panic!("unexpected message {v}");
            }
            _ => {}
        }
    }
}

#[tokio::test]
async fn attach_websocket_carries_stdin_output_and_eof() {
    let s = TestServer::start().await;
    let sb = s.create("busybox").await;
    let cid = start(
        &s,
        &sb,
        json!({"shell": "echo started; cat; echo bye >&2; exit 5", "stdin": true}),
    )
    .await;
    let mut ws = attach(&s, &sb, &cid).await;
    ws.send(Message::Binary(b"typed input\n".to_vec()))
        .await
        .unwrap();
    ws.send(Message::Text(json!({"type": "eof"}).to_string()))
        .await
        .unwrap();
    let (out, err, exit) = read_until_exit(&mut ws).await;
    assert_eq!(String::from_utf8(out).unwrap(), "started\ntyped input\n");
    assert_eq!(err, b"bye\n");
    assert_eq!(exit["result"]["exit_code"], 5, "{exit}");
    // Bad control messages get an error message, not a dropped socket or a crash.
    let cid = start(&s, &sb, json!({"argv": ["cat"], "stdin": true})).await;
    let mut ws = attach(&s, &sb, &cid).await;
    ws.send(Message::Text("{\"type\":\"bogus\"}".into()))
        .await
        .unwrap();
    let msg = ws.next().await.unwrap().unwrap();
    let v: Value = serde_json::from_str(msg.to_text().unwrap()).unwrap();
    assert_eq!(v["type"], "error", "{v}");
    ws.send(Message::Text(
        json!({"type": "signal", "signal": "KILL"}).to_string(),
    ))
    .await
    .unwrap();
    let (_, _, exit) = read_until_exit(&mut ws).await;
    assert_eq!(exit["result"]["signal"], 9, "{exit}");
    s.destroy(&sb).await;
}

#[tokio::test]
async fn a_background_server_keeps_running_and_can_be_killed_later() {
    let s = TestServer::start().await;
    let sb = s.create("debian").await;
    let server = start(
        &s,
        &sb,
        json!({"shell": "echo serving; exec python3 -u -m http.server 8000 --bind 127.0.0.1"}),
    )
    .await;
    // It is reachable from another command while it runs.
    let fetch = "for i in $(seq 1 50); do curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/ && exit 0; sleep 0.2; done; exit 1";
    let cmd = s.sh(&sb, fetch).await;
    assert!(cmd["stdout"].as_str().unwrap().ends_with("200"), "{cmd}");
    let (_, list) = s.get(&format!("/v1/sandboxes/{sb}/commands")).await;
    let running: Vec<&Value> = list["commands"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["state"] == "running")
        .collect();
    assert_eq!(running.len(), 1);
    assert_eq!(running[0]["id"], server.as_str());
    // Its log keeps flowing into its session (the request was logged on stderr).
    let (chunks, _) = s.output(&sb, &server, OutputQuery::default()).await;
    let text = String::from_utf8_lossy(&decode(&chunks, None)).into_owned();
    assert!(
        text.contains("serving") && text.contains("GET / HTTP"),
        "{text}"
    );
    let (st, _) = s
        .post(
            &format!("/v1/sandboxes/{sb}/commands/{server}/signal"),
            json!({"signal": "TERM"}),
        )
        .await;
    assert_eq!(st, 200);
    let (_, cmd) = s
        .get(&format!("/v1/sandboxes/{sb}/commands/{server}?wait=30s"))
        .await;
    assert!(
        cmd["state"] == "killed" || cmd["state"] == "exited",
        "{cmd}"
    );
    s.destroy(&sb).await;
}

#[tokio::test]
async fn fifty_concurrent_commands_stream_independently() {
    let s = TestServer::start().await;
    let sb = s.create("busybox").await;
    let other = s.create("busybox").await;
    let mut tasks = Vec::new();
    for i in 0..50 {
        // A client of its own each: fifty connections, not one pool.
        let (client, sb) = (
            s.client_as(common::TOKEN),
            if i % 10 == 0 {
                other.clone()
            } else {
                sb.clone()
            },
        );
        tasks.push(tokio::spawn(async move {
            let script = format!(
                "for j in 1 2 3 4 5; do echo $j-{i}; echo e$j-{i} >&2; sleep 0.1; done; exit {}",
                i % 7
            );
            let req = CreateCommandRequest {
                shell: Some(script),
                wait: Some(true),
                ..Default::default()
            };
            let cmd = client.create_command(&sb, &req).await.unwrap();
            (i, cmd)
        }));
    }
    for t in tasks {
        let (i, cmd) = t.await.unwrap();
        let want: String = (1..=5).map(|j| format!("{j}-{i}\n")).collect();
        let want_err: String = (1..=5).map(|j| format!("e{j}-{i}\n")).collect();
        assert_eq!(cmd.stdout.as_deref(), Some(want.as_str()), "{cmd:?}");
        assert_eq!(cmd.stderr.as_deref(), Some(want_err.as_str()), "{cmd:?}");
        let result = cmd.result.as_ref().expect("an ended command");
        assert_eq!(result.exit_code, Some(i % 7), "{cmd:?}");
    }
    s.destroy(&sb).await;
    s.destroy(&other).await;
}

#[tokio::test]
async fn timeout_defaults_and_maximum_are_configurable() {
    let s = TestServer::start_with(&[
        "--default-command-timeout-seconds",
        "1",
        "--max-command-timeout-seconds",
        "60",
    ])
    .await;
    let sb = s.create("busybox").await;
    // The default applies when the request gives none.
    let cmd = s.run(&sb, &["sleep", "30"]).await;
    assert_eq!(cmd["state"], "timed_out", "{cmd}");
    assert_eq!(cmd["timeout_seconds"], 1);
    for bad in [0, 61] {
        let (st, v) = s
            .post(
                &format!("/v1/sandboxes/{sb}/commands"),
                json!({"argv": ["true"], "timeout_seconds": bad}),
            )
            .await;
        assert_eq!(st, 400, "{bad}: {v}");
    }
    s.destroy(&sb).await;
}

fn vm_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap()
}

#[tokio::test]
async fn an_output_flood_is_capped_keeps_its_tail_and_stalls_nobody() {
    use std::os::unix::fs::MetadataExt;
    let s = TestServer::start_with(&["--output-cap-mib", "4"]).await;
    let flood_sb = s.create("busybox").await;
    let calm_sb = s.create("busybox").await;
    let rss_before = vm_rss_kib(s.pid().unwrap());
    // 200 MB of binary with no newlines, then a marker at the very end.
    let flood = start(
        &s,
        &flood_sb,
        json!({"shell": "head -c 200000000 /dev/urandom; printf END-OF-FLOOD"}),
    )
    .await;
    // Meanwhile other commands, here and in another sandbox, run normally.
    for sb in [&calm_sb, &flood_sb] {
        let cmd = s.sh(sb, "seq 1 1000 | tail -n 1").await;
        assert_eq!(cmd["stdout"], "1000\n", "{cmd}");
    }
    let (_, cmd) = s
        .get(&format!(
            "/v1/sandboxes/{flood_sb}/commands/{flood}?wait=300s"
        ))
        .await;
    assert_eq!(cmd["state"], "exited", "{cmd}");
    let result = &cmd["result"];
    assert_eq!(result["stdout_bytes"], 200_000_012u64, "{cmd}");
    assert_eq!(result["output_truncated"], true);
    // Only the tail is kept, on disk too.
    let file = s
        .data_dir()
        .join("outputs")
        .join(&flood_sb)
        .join(&flood)
        .join("stdout");
    let on_disk = std::fs::metadata(&file).unwrap().blocks() * 512;
    assert!(
        on_disk <= 6 << 20,
        "{on_disk} bytes on disk for a 4 MiB cap"
    );
    let stdout = OutputQuery {
        view: OutputView::Stdout,
        ..Default::default()
    };
    let (chunks, end) = s.output(&flood_sb, &flood, stdout).await;
    let first = chunks[0].offset;
    let tail = decode(&chunks, None);
    assert!(
        first >= 200_000_012 - (5 << 20),
        "first kept offset {first}"
    );
    assert_eq!(first + tail.len() as u64, 200_000_012);
    assert!(tail.ends_with(b"END-OF-FLOOD"));
    let end = end.expect("the end of the output");
    assert_eq!(end.state, CommandState::Exited);
    assert!(end.result.expect("a result").output_truncated);
    // Neither did the agent's (PID 1 in the sandbox).
    let agent = s.sh(&flood_sb, "grep VmRSS /proc/1/status").await;
    let agent_kib: u64 = agent["stdout"]
        .as_str()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .and_then(|k| k.parse().ok())
        .unwrap();
    assert!(
        agent_kib < 64 * 1024,
        "agent RSS {agent_kib} KiB after the flood"
    );
    // The server's memory did not follow the flood.
    let rss_after = vm_rss_kib(s.pid().unwrap());
    assert!(
        rss_after < rss_before + 100 * 1024,
        "server RSS grew from {rss_before} KiB to {rss_after} KiB"
    );
    s.destroy(&flood_sb).await;
    s.destroy(&calm_sb).await;
}

/// Reads from an attach socket until the stdout seen so far contains `want`.
/// What `seq 1 n` prints.
fn seq_output(n: u64) -> Vec<u8> {
    (1..=n)
        .map(|i| format!("{i}\n"))
        .collect::<String>()
        .into_bytes()
}

/// Reads a `format=raw` body more slowly than a sandbox writes: a pause every 128 KiB.
async fn read_slowly(mut resp: reqwest::Response) -> Vec<u8> {
    assert_eq!(resp.status(), 200);
    let (mut body, mut since_pause) = (Vec::new(), 0);
    while let Some(c) = resp.chunk().await.unwrap() {
        body.extend_from_slice(&c);
        since_pause += c.len();
        if since_pause >= 128 << 10 {
            since_pause = 0;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    body
}

#[tokio::test]
async fn slow_followers_lose_nothing_to_the_cap_and_a_stalled_one_holds_nothing_back() {
    let s = TestServer::start_with(&["--output-cap-mib", "4"]).await;
    let sb = s.create("busybox").await;
    let follow = |cid: &str, view: &str| {
        s.req(
            reqwest::Method::GET,
            &format!(
                "/v1/sandboxes/{sb}/commands/{cid}/output?format=raw&follow=true&stream={view}"
            ),
        )
        .send()
    };
    // About 16.6 MB on each stream, four times the cap, written as fast as the sandbox can;
    // one follower reads stdout and another the combined view, each slower than the writer.
    let n = 2_500_000;
    let seq = seq_output(n);
    // It writes once a line comes on stdin, sent when both followers are answered: a
    // follower that comes after the cap dropped output cannot get it back.
    let cid = start(
        &s,
        &sb,
        json!({"shell": format!("head -n 1 >/dev/null; seq 1 {n}; seq 1 {n} >&2"), "stdin": true}),
    )
    .await;
    let raw_stdout = follow(&cid, "stdout").await.unwrap();
    let q = OutputQuery {
        offset: 0,
        follow: true,
        view: OutputView::Combined,
    };
    let mut items = s.client().command_output(&sb, &cid, &q).await.unwrap();
    assert_eq!(stdin(&s, &sb, &cid, "go\n", true).await, 204);
    // The combined view as NDJSON, read as slowly: its offsets show any gap, and arrival
    // order may interleave the two streams where one command ends and the next begins.
    let combined = async {
        let (mut out, mut err, mut since_pause) = (Vec::new(), Vec::new(), 0);
        while let Some(item) = items.next().await {
            match item.unwrap() {
                space_client::OutputItem::Chunk {
                    stream,
                    offset,
                    data,
                } => {
                    assert_eq!(
                        offset,
                        (out.len() + err.len()) as u64,
                        "a gap in the output"
                    );
                    since_pause += data.len();
                    match stream {
                        StdStream::Stdout => out.extend_from_slice(&data),
                        StdStream::Stderr => err.extend_from_slice(&data),
                    }
                    if since_pause >= 128 << 10 {
                        since_pause = 0;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
                space_client::OutputItem::End { state, .. } => {
                    assert_eq!(state, CommandState::Exited);
                    return (out, err);
                }
            }
        }
        panic!("the combined output ended without the command's end");
    };
    let (stdout, (out, err)) = tokio::join!(read_slowly(raw_stdout), combined);
    assert_eq!(stdout.len(), seq.len(), "the stdout follower lost bytes");
    assert!(stdout == seq, "the stdout follower got other bytes");
    assert!(
        out == seq,
        "the combined follower's stdout: {} bytes",
        out.len()
    );
    assert!(
        err == seq,
        "the combined follower's stderr: {} bytes",
        err.len()
    );
    // The cap still kept only the tail on the host.
    let (_, cmd) = s.get(&format!("/v1/sandboxes/{sb}/commands/{cid}")).await;
    assert_eq!(cmd["state"], "exited", "{cmd}");
    assert_eq!(cmd["result"]["stdout_bytes"], seq.len() as u64, "{cmd}");
    assert_eq!(cmd["result"]["output_truncated"], true, "{cmd}");

    // A follower that stops reading holds the command back only for a while: it ends.
    let cid = start(
        &s,
        &sb,
        json!({"shell": format!("head -n 1 >/dev/null; seq 1 {n}"), "stdin": true}),
    )
    .await;
    let stalled = follow(&cid, "stdout").await.unwrap();
    assert_eq!(stalled.status(), 200);
    assert_eq!(stdin(&s, &sb, &cid, "go\n", true).await, 204);
    let (_, cmd) = s
        .get(&format!("/v1/sandboxes/{sb}/commands/{cid}?wait=300s"))
        .await;
    assert_eq!(cmd["state"], "exited", "{cmd}");
    assert_eq!(cmd["result"]["stdout_bytes"], seq.len() as u64, "{cmd}");
    drop(stalled);
    s.destroy(&sb).await;
}

async fn read_until(ws: &mut AttachSocket, seen: &mut String, want: &str) {
    while !seen.contains(want) {
        let msg = tokio::time::timeout(Duration::from_secs(20), ws.next())
            .await
            .unwrap_or_else(|_| panic!("no {want:?} in {seen:?}"))
            .expect("socket open")
            .expect("message");
        match msg {
            Message::Binary(b) if !b.is_empty() => seen.push_str(&String::from_utf8_lossy(&b[1..])),
            Message::Text(t) => {
                panic!("unexpected message {t} while waiting for {want:?} in {seen:?}")
            }
            _ => {}
        }
    }
}

#[tokio::test]
async fn pty_commands_get_a_terminal_that_follows_resizes_and_ctrl_c() {
    let s = TestServer::start().await;
    let sb = s.create("busybox").await;
    let cid = start(
        &s,
        &sb,
        json!({"argv": ["sh"], "pty": {"rows": 24, "cols": 80}}),
    )
    .await;
    let (_, cmd) = s.get(&format!("/v1/sandboxes/{sb}/commands/{cid}")).await;
    assert_eq!(cmd["pty"]["rows"], 24);
    let mut ws = attach(&s, &sb, &cid).await;
    let mut seen = String::new();
    ws.send(Message::Binary(b"stty size; tty; echo T=$TERM\n".to_vec()))
        .await
        .unwrap();
    read_until(&mut ws, &mut seen, "24 80").await;
    read_until(&mut ws, &mut seen, "/dev/pts/").await;
    read_until(&mut ws, &mut seen, "T=xterm").await;
    ws.send(Message::Text(
        json!({"type": "resize", "rows": 40, "cols": 100}).to_string(),
    ))
    .await
    .unwrap();
    ws.send(Message::Binary(b"stty size\n".to_vec()))
        .await
        .unwrap();
    read_until(&mut ws, &mut seen, "40 100").await;
    // Ctrl-C interrupts the foreground program, not the shell.
    ws.send(Message::Binary(b"sleep 300; echo slept\n".to_vec()))
        .await
        .unwrap();
    // ^C typed before the shell started `sleep` would just be input; wait for it.
    let running =
        "for i in $(seq 1 200); do ps | grep -q '[s]leep 300' && exit 0; sleep 0.05; done; exit 1";
    assert_eq!(s.sh(&sb, running).await["result"]["exit_code"], 0);
    ws.send(Message::Binary(vec![3])).await.unwrap();
    ws.send(Message::Binary(b"echo after-ctrl-c\n".to_vec()))
        .await
        .unwrap();
    read_until(&mut ws, &mut seen, "after-ctrl-c\r\n").await;
    assert!(!seen.contains("\r\nslept\r\n"), "{seen}");
    ws.send(Message::Binary(b"exit 3\n".to_vec()))
        .await
        .unwrap();
    let (_, _, exit) = read_until_exit(&mut ws).await;
    assert_eq!(exit["result"]["exit_code"], 3, "{exit}");
    s.destroy(&sb).await;
}

#[tokio::test]
async fn timeouts_and_kills_reach_setsid_descendants() {
    let s = TestServer::start().await;
    let sb = s.create("busybox").await;
    // A daemon that leaves the command's session and process group.
    let (st, cmd) = s
        .post(
            &format!("/v1/sandboxes/{sb}/commands"),
            json!({
                "shell": "setsid sh -c 'sleep 301' & sleep 302",
                "timeout_seconds": 1,
                "wait": true
            }),
        )
        .await;
    assert_eq!(st, 201);
    assert_eq!(cmd["state"], "timed_out", "{cmd}");
    assert_eq!(cmd["result"]["timed_out"], true);
    let left = s.sh(&sb, "ps | grep -c '[s]leep 30[12]'").await;
    assert_eq!(left["stdout"], "0\n", "{left}");
    // The same for a KILL sent through the API.
    let cid = start(
        &s,
        &sb,
        json!({"shell": "setsid sh -c 'sleep 303' & sleep 304"}),
    )
    .await;
    let wait_up =
        "for i in $(seq 1 100); do ps | grep -q '[s]leep 303' && exit 0; sleep 0.05; done; exit 1";
    assert_eq!(s.sh(&sb, wait_up).await["result"]["exit_code"], 0);
    let (st, _) = s
        .post(
            &format!("/v1/sandboxes/{sb}/commands/{cid}/signal"),
            json!({"signal": "KILL"}),
        )
        .await;
    assert_eq!(st, 200);
    let (_, cmd) = s
        .get(&format!("/v1/sandboxes/{sb}/commands/{cid}?wait=30s"))
        .await;
    assert_eq!(cmd["state"], "killed", "{cmd}");
    let left = s.sh(&sb, "ps | grep -c '[s]leep 30[34]'").await;
    assert_eq!(left["stdout"], "0\n", "{left}");
    // A command that just exits leaves its background children running (nohup-style).
    let cmd = s.sh(&sb, "setsid sh -c 'sleep 305' & echo started").await;
    assert_eq!(cmd["state"], "exited");
    let alive = s.sh(&sb, "ps | grep -c '[s]leep 305'").await;
    assert_eq!(alive["stdout"], "1\n", "{alive}");
    s.destroy(&sb).await;
}

/// `format=raw`: a view's bytes alone, exactly as written (not UTF-8 included), from
/// any offset, followed while the command runs; the command then has the result.
/// A format that is neither raw nor ndjson is a 400.
#[tokio::test]
async fn output_format_raw_is_the_bytes_alone() {
    let s = TestServer::start().await;
    let sb = s.create("busybox").await;
    let raw = |cid: &str, q: &str| {
        let req = s.req(
            reqwest::Method::GET,
            &format!("/v1/sandboxes/{sb}/commands/{cid}/output?format=raw&{q}"),
        );
        async move {
            let r = req.send().await.unwrap();
            let status = r.status().as_u16();
            let kind = r
                .headers()
                .get("content-type")
                .map(|v| v.to_str().unwrap().to_string());
            (status, kind, r.bytes().await.unwrap().to_vec())
        }
    };
    // Followed from the start while the command still runs.
    let cid = start(
        &s,
        &sb,
        json!({"shell": "printf 'a\\377\\000b'; printf 'err' >&2; sleep 1; printf 'c\\n'"}),
    )
    .await;
    let (status, kind, body) = raw(&cid, "follow=true&stream=stdout").await;
    assert_eq!(status, 200);
    assert_eq!(kind.as_deref(), Some("application/octet-stream"));
    assert_eq!(body, b"a\xff\x00bc\n");
    let (st, cmd) = s.get(&format!("/v1/sandboxes/{sb}/commands/{cid}")).await;
    assert_eq!(st, 200);
    assert_eq!(cmd["result"]["exit_code"], 0, "{cmd}");
    // The other views, and an offset into one.
    assert_eq!(raw(&cid, "stream=stderr").await.2, b"err");
    let combined = raw(&cid, "stream=combined").await.2;
    assert_eq!(combined.len(), 9, "{combined:?}");
    assert_eq!(raw(&cid, "stream=stdout&offset=3").await.2, b"bc\n");
    assert_eq!(raw(&cid, "stream=stdout&offset=99").await.2, b"");
    // NDJSON is still the default, and says the same bytes.
    let (chunks, end) = s
        .output(
            &sb,
            &cid,
            space_client::OutputQuery {
                offset: 0,
                follow: false,
                view: space_client::OutputView::Stdout,
            },
        )
        .await;
    assert_eq!(decode(&chunks, None), b"a\xff\x00bc\n");
    assert!(end.is_some());
    for bad in ["format=json", "format=", "format=RAW"] {
        let (st, v) = s
            .get(&format!("/v1/sandboxes/{sb}/commands/{cid}/output?{bad}"))
            .await;
        assert_eq!(st, 400, "{bad}: {v}");
        assert_eq!(v["error"]["code"], "invalid_query", "{bad}: {v}");
    }
    s.destroy(&sb).await;
}

/// A command's output as it comes (`format=raw`, followed), for waiting on.
struct Output {
    resp: reqwest::Response,
    seen: String,
}

impl Output {
    async fn follow(s: &TestServer, sb: &str, cid: &str) -> Output {
        let path = format!("/v1/sandboxes/{sb}/commands/{cid}/output?format=raw&follow=true");
        let resp = s.req(reqwest::Method::GET, &path).send().await.unwrap();
        Output {
            resp,
            seen: String::new(),
        }
    }

    /// Reads until the output so far contains `text` (60 s at most).
    async fn until(&mut self, text: &str) {
        while !self.seen.contains(text) {
            let chunk = tokio::time::timeout(Duration::from_secs(60), self.resp.chunk())
                .await
                .unwrap_or_else(|_| panic!("no {text:?} in 60 s: {:?}", self.seen))
                .unwrap()
                .unwrap_or_else(|| panic!("the output ended without {text:?}: {:?}", self.seen));
            self.seen.push_str(&String::from_utf8_lossy(&chunk));
        }
    }
}

/// Arms `agent:drop` (the server runs with `SPACE_FAILPOINT=agent:drop`): the agent drops
/// its host connection when the next request of `kind` comes, before acting on it.
async fn arm_drop(s: &TestServer, sb: &str, kind: &str) {
    let (st, out) = s
        .post(
            &format!("/v1/sandboxes/{sb}/commands"),
            json!({"argv": ["space-failpoint", "drop-before", kind]}),
        )
        .await;
    assert!(
        st == 400 && out.to_string().contains("agent:drop is armed"),
        "arming agent:drop before a {kind} (an agent built without its test hooks \
         cannot: FEATURES=test-hooks scripts/build.sh): {st} {out}"
    );
}

/// Input whose agent link breaks under it (`agent:drop` armed before a `stdin`: the
/// agent drops its connection when the next input frame comes, before taking it) was
/// answered 204, and arrives once: the session resends what the agent had not taken on
/// the next connection, and the agent skips what it had. On a pipe the end-of-file
/// closes it once; on a terminal each ^D is typed once, and the lines around it in order.
#[tokio::test]
async fn input_whose_agent_link_breaks_arrives_once() {
    let s = TestServer::start_with_env(&[], &[("SPACE_FAILPOINT", "agent:drop")]).await;
    let sb = s.create("busybox").await;
    let links = || s.log().matches("agent connected").count();
    let result = |cid: String| {
        let s = &s;
        let sb = &sb;
        async move {
            let (st, cmd) = s
                .get(&format!("/v1/sandboxes/{sb}/commands/{cid}?wait=60s"))
                .await;
            assert_eq!(st, 200, "{cmd}");
            let (chunks, _) = s.output(sb, &cid, OutputQuery::default()).await;
            let out = String::from_utf8_lossy(&decode(&chunks, None)).into_owned();
            assert_eq!(cmd["state"], "exited", "{cmd}\n{out:?}");
            (cmd, out)
        }
    };

    // A pipe: a line before, a line whose link breaks, a line after, then an end-of-file
    // whose link breaks too. Each break is armed once the input before it has come
    // through, so that the arming call does not itself cross the previous break.
    let before = links();
    let cid = start(&s, &sb, json!({"argv": ["cat"], "stdin": true})).await;
    let mut out = Output::follow(&s, &sb, &cid).await;
    assert_eq!(stdin(&s, &sb, &cid, "one\n", false).await, 204);
    out.until("one\n").await;
    arm_drop(&s, &sb, "stdin").await;
    assert_eq!(stdin(&s, &sb, &cid, "two\n", false).await, 204);
    assert_eq!(stdin(&s, &sb, &cid, "three\n", false).await, 204);
    out.until("three\n").await;
    arm_drop(&s, &sb, "stdin").await;
    assert_eq!(stdin(&s, &sb, &cid, "", true).await, 204);
    let (cmd, out) = result(cid).await;
    assert_eq!(cmd["result"]["exit_code"], 0, "{cmd}");
    assert_eq!(out, "one\ntwo\nthree\n");
    assert!(links() >= before + 2, "the link did not break twice");

    // A terminal, where an end-of-file is typed (^D) and may come more than once: two
    // `cat`s in turn, the first ended by the ^D whose link breaks, the second by the next
    // (sent once the first has ended: gVisor's terminal may merge a ^D with input that
    // follows it before its reader wakes). A ^D typed twice would end the second before
    // "y"; one lost would leave the first running.
    let cid = start(
        &s,
        &sb,
        json!({"argv": ["sh", "-c", "cat; echo mid; cat; echo done"], "pty": {"rows": 24, "cols": 80}}),
    )
    .await;
    let mut seen = Output::follow(&s, &sb, &cid).await;
    assert_eq!(stdin(&s, &sb, &cid, "x\n", false).await, 204);
    // The terminal's echo, then cat's copy.
    seen.until("x\r\nx\r\n").await;
    arm_drop(&s, &sb, "stdin").await;
    assert_eq!(stdin(&s, &sb, &cid, "", true).await, 204);
    seen.until("mid\r\n").await;
    assert_eq!(stdin(&s, &sb, &cid, "y\n", true).await, 204);
    let (cmd, out) = result(cid).await;
    assert_eq!(cmd["result"]["exit_code"], 0, "{cmd}");
    assert!(out.starts_with("x\r\nx\r\n"), "{out:?}");
    assert!(out.ends_with("mid\r\ny\r\ny\r\ndone\r\n"), "{out:?}");
    assert!(links() >= before + 3, "the link did not break under the ^D");
    s.destroy(&sb).await;
}

/// An agent from before input offsets (`agent:no-features`: its hello names none, as a
/// sandbox that outlived an upgrade of the server) still gets input, the old way: bytes
/// and an end-of-file, on a pipe and on a terminal.
#[tokio::test]
async fn an_agent_from_before_input_offsets_still_gets_input() {
    let s = TestServer::start_with_env(&[], &[("SPACE_FAILPOINT", "agent:no-features")]).await;
    let sb = s.create("busybox").await;
    // A pipe gets the bytes, then is closed; a terminal echoes them, and its ^D ends cat.
    let cases = [
        (json!({"argv": ["cat"], "stdin": true}), "old\nway\n"),
        (
            json!({"argv": ["cat"], "pty": {"rows": 24, "cols": 80}}),
            "old\r\nold\r\nway\r\nway\r\n",
        ),
    ];
    for (spawn, expected) in cases {
        let cid = start(&s, &sb, spawn).await;
        assert_eq!(stdin(&s, &sb, &cid, "old\n", false).await, 204);
        assert_eq!(stdin(&s, &sb, &cid, "way\n", true).await, 204);
        let all = OutputQuery {
            follow: true,
            ..Default::default()
        };
        let (chunks, end) = s.output(&sb, &cid, all).await;
        // The terminal's echo and cat's copy may interleave.
        let lines = |t: &str| {
            let mut l: Vec<String> = t.split_inclusive('\n').map(str::to_owned).collect();
            l.sort();
            l
        };
        let out = String::from_utf8_lossy(&decode(&chunks, None)).into_owned();
        assert_eq!(lines(&out), lines(expected), "{out:?}");
        assert_eq!(end.expect("result line").exit_code(), Some(0));
    }
    s.destroy(&sb).await;
}

/// A one-shot call whose agent connection breaks under it (`SPACE_FAILPOINT=agent:drop`:
/// armed by `space-failpoint drop-before KIND`, the agent drops its host connection when
/// the next KIND request comes, before acting on it, and dials again). A call that does
/// the same when made twice (a signal, a read, `mkdir -p`) is made again on the next
/// connection and answered as usual; one that does not (a rename, a removal, an upload)
/// is a 503 that changed nothing, and works when the client makes it again. A KILL that
/// came while the agent was redialling was a 503 (hostile `resource_abuse`, in CI).
#[tokio::test]
async fn calls_whose_agent_connection_breaks_are_made_again_or_change_nothing() {
    let s = TestServer::start_with_env(&[], &[("SPACE_FAILPOINT", "agent:drop")]).await;
    let sb = s.create("busybox").await;
    let files = format!("/v1/sandboxes/{sb}/files");
    let arm = |kind: &'static str| arm_drop(&s, &sb, kind);
    // The server logs each call it makes again, with its name and whether the first one
    // went out (a call that came just after a break may meet the ended connection before
    // the server let it go: not sent, made again, whatever it is).
    let again = |call: &str, went_out: bool| {
        let tag = format!("call={call} went_out={went_out} ");
        s.log()
            .lines()
            .filter(|l| l.contains("making it again on the next one") && l.contains(&tag))
            .count()
    };
    let send = |method: reqwest::Method, path: String, body: Option<Vec<u8>>| {
        let mut r = s.req(method, &path);
        if let Some(b) = body {
            r = r.body(b);
        }
        async move {
            let resp = r.send().await.unwrap();
            let st = resp.status().as_u16();
            (st, resp.bytes().await.unwrap().to_vec())
        }
    };
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();

    // A KILL.
    let cid = start(&s, &sb, json!({"argv": ["sleep", "600"]})).await;
    arm("signal").await;
    let (st, out) = s
        .post(
            &format!("/v1/sandboxes/{sb}/commands/{cid}/signal"),
            json!({"signal": "KILL"}),
        )
        .await;
    assert_eq!(st, 200, "{out}");
    let (_, cmd) = s
        .get(&format!("/v1/sandboxes/{sb}/commands/{cid}?wait=30s"))
        .await;
    assert_eq!(cmd["state"], "killed", "{cmd}");
    assert_eq!(again("signal", true), 1, "the KILL was not sent again");

    // Reads and `mkdir -p`: answered as if nothing broke.
    let up = send(
        reqwest::Method::PUT,
        format!("{files}?path=/tmp/d/a.txt&parents=true"),
        Some(b"hello".to_vec()),
    )
    .await;
    assert_eq!(up.0, 201, "{}", text(&up.1));
    arm("stat").await;
    let (st, info) = s.get(&format!("{files}/stat?path=/tmp/d/a.txt")).await;
    assert_eq!((st, info["size"].as_u64()), (200, Some(5)), "{info}");
    arm("list").await;
    let (st, listing) = s.get(&format!("{files}/list?path=/tmp/d")).await;
    assert_eq!(st, 200, "{listing}");
    assert!(listing.to_string().contains("a.txt"), "{listing}");
    arm("download").await;
    let (st, body) = send(
        reqwest::Method::GET,
        format!("{files}?path=/tmp/d/a.txt"),
        None,
    )
    .await;
    assert_eq!((st, text(&body).as_str()), (200, "hello"));
    arm("mkdir").await;
    let (st, out) = s
        .post(&format!("{files}/mkdir"), json!({"path": "/tmp/d/e/f"}))
        .await;
    assert_eq!(st, 201, "{out}");
    for call in ["stat", "list", "download", "mkdir"] {
        assert!(again(call, true) >= 1, "a {call} was not made again");
    }

    // A rename, a removal, an upload: a 503 that changed nothing; then they work.
    let exists = |path: &'static str| {
        let s = &s;
        let files = &files;
        async move { s.get(&format!("{files}/stat?path={path}")).await.0 == 200 }
    };
    let mv = json!({"from": "/tmp/d/a.txt", "to": "/tmp/d/b.txt"});
    arm("move").await;
    let (st, out) = s.post(&format!("{files}/move"), mv.clone()).await;
    assert_eq!(st, 503, "{out}");
    assert!(exists("/tmp/d/a.txt").await && !exists("/tmp/d/b.txt").await);
    let (st, out) = s.post(&format!("{files}/move"), mv).await;
    assert_eq!(st, 200, "{out}");
    assert!(!exists("/tmp/d/a.txt").await && exists("/tmp/d/b.txt").await);

    arm("remove").await;
    let (st, out) = s.delete(&format!("{files}?path=/tmp/d/b.txt")).await;
    assert_eq!(st, 503, "{out}");
    assert!(exists("/tmp/d/b.txt").await);
    let (st, out) = s.delete(&format!("{files}?path=/tmp/d/b.txt")).await;
    assert_eq!(st, 200, "{out}");
    assert!(!exists("/tmp/d/b.txt").await);

    arm("upload").await;
    let put = || {
        send(
            reqwest::Method::PUT,
            format!("{files}?path=/tmp/d/c.txt"),
            Some(vec![b'x'; 100_000]),
        )
    };
    let (st, body) = put().await;
    assert_eq!(st, 503, "{}", text(&body));
    assert!(!exists("/tmp/d/c.txt").await);
    let (st, body) = put().await;
    assert_eq!(st, 201, "{}", text(&body));
    for call in ["move", "remove"] {
        assert_eq!(
            again(call, true),
            0,
            "a {call}, which may not be made twice, was"
        );
    }
    // The sandbox is as it was: its next command runs.
    let out = s.sh(&sb, "echo still-here").await;
    assert_eq!(out["stdout"], "still-here\n", "{out}");
    s.destroy(&sb).await;
}
