//! The code interpreter through `/v1`: contexts in a `code-interpreter` sandbox, with
//! real Jupyter kernels (Debian's ipykernel), pandas and matplotlib.

mod common;

use base64::Engine;
use common::TestServer;
use serde_json::{json, Value};

/// Runs `code` in `ctx`; the status and every NDJSON event.
async fn execute(s: &TestServer, sb: &str, ctx: &str, body: Value) -> (u16, Vec<Value>) {
    let resp = s
        .req(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{sb}/contexts/{ctx}/execute"),
        )
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    if status != 200 {
        return (
            status,
            vec![serde_json::from_str(&text).unwrap_or(json!(text))],
        );
    }
    let events = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect();
    (status, events)
}

/// Runs `code` and checks the stream is well formed: ends with exactly one `end`.
async fn run(s: &TestServer, sb: &str, ctx: &str, code: &str) -> Vec<Value> {
    let (st, events) = execute(s, sb, ctx, json!({ "code": code })).await;
    assert_eq!(st, 200, "{events:?}");
    let last = events
        .last()
        .unwrap_or_else(|| panic!("no events for {code}"));
    assert_eq!(last["type"], "end", "{events:?}");
    assert_eq!(
        events.iter().filter(|e| e["type"] == "end").count(),
        1,
        "{events:?}"
    );
    events
}

fn of_type<'a>(events: &'a [Value], t: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["type"] == t).collect()
}

fn stdout(events: &[Value]) -> String {
    of_type(events, "stdout")
        .iter()
        .map(|e| e["text"].as_str().unwrap())
        .collect()
}

/// `text` without ANSI colour sequences.
fn plain(text: &str) -> String {
    let mut out = String::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Starts `code` (which runs for an hour), drops the response at once, checks that
/// the recording command ends, and runs `then` in the same context.
async fn abandon_then_run(
    s: &TestServer,
    sb: &str,
    ctx: &str,
    code: &str,
    then: &str,
) -> Vec<Value> {
    let resp = s
        .req(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{sb}/contexts/{ctx}/execute"),
        )
        .json(&json!({"code": code, "timeout_seconds": 3600}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let cmd = resp.headers()["x-space-command-id"]
        .to_str()
        .unwrap()
        .to_string();
    let (_, c) = s.get(&format!("/v1/sandboxes/{sb}/commands/{cmd}")).await;
    assert_eq!(c["state"], "running", "{c}");
    drop(resp);
    let (_, c) = s
        .get(&format!("/v1/sandboxes/{sb}/commands/{cmd}?wait=60s"))
        .await;
    assert_ne!(c["state"], "running", "{c}");
    let (st, ev) = execute(s, sb, ctx, json!({"code": then, "timeout_seconds": 120})).await;
    assert_eq!(st, 200, "{ev:?}");
    ev
}

async fn new_context(s: &TestServer, sb: &str, body: Value) -> String {
    let (st, ctx) = s.post(&format!("/v1/sandboxes/{sb}/contexts"), body).await;
    assert_eq!(st, 201, "{ctx}");
    ctx["id"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn python_and_bash_contexts_with_rich_results() {
    let s = TestServer::start().await;
    let sb = s.create("code-interpreter").await;
    let py = new_context(&s, &sb, json!({})).await;
    let (_, list) = s.get(&format!("/v1/sandboxes/{sb}/contexts")).await;
    assert_eq!(list["contexts"][0]["id"], py.as_str(), "{list}");
    assert_eq!(list["contexts"][0]["language"], "python", "{list}");
    // Commands run as root by default, so the home is root's.
    assert_eq!(list["contexts"][0]["cwd"], "/root", "{list}");

    // Output, the main result, and the variables carry over.
    let ev = run(&s, &sb, &py, "x = 41\nprint('hi')\nx + 1").await;
    assert_eq!(stdout(&ev), "hi\n", "{ev:?}");
    let results = of_type(&ev, "result");
    assert_eq!(results.len(), 1, "{ev:?}");
    assert_eq!(results[0]["text"], "42");
    assert_eq!(results[0]["is_main_result"], true);
    let end = ev.last().unwrap();
    assert_eq!(end["execution_count"], 1, "{end}");
    // The execution was recorded as a command: its output replays the same events.
    let cmd = end["command_id"].as_str().unwrap();
    let (_, c) = s
        .get(&format!("/v1/sandboxes/{sb}/commands/{cmd}?wait=30s"))
        .await;
    assert_eq!(c["state"], "exited", "{c}");
    let (chunks, _) = s.output(&sb, cmd, Default::default()).await;
    let replay = String::from_utf8(common::decode(&chunks, None)).unwrap();
    assert!(replay.contains("\"hi\\n\""), "{replay}");
    assert!(replay.contains("\"42\""), "{replay}");

    let ev = run(&s, &sb, &py, "x += 1\nx").await;
    assert_eq!(of_type(&ev, "result")[0]["text"], "42", "{ev:?}");

    // A matplotlib chart: a PNG that decodes.
    let ev = run(
        &s,
        &sb,
        &py,
        "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('t')\nplt.show()",
    )
    .await;
    let png = of_type(&ev, "result")
        .iter()
        .find_map(|r| r["png"].as_str())
        .unwrap_or_else(|| panic!("no png in {ev:?}"))
        .to_string();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(png.trim())
        .unwrap();
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert!(bytes.len() > 1000);
    // Without plt.show(), as in a notebook: the figure is the cell's output all the same.
    let ev = run(&s, &sb, &py, "plt.figure()\nplt.bar(['a', 'b'], [1, 2])").await;
    let pngs = of_type(&ev, "result")
        .iter()
        .filter(|r| r["png"].is_string())
        .count();
    assert_eq!(pngs, 1, "{ev:?}");

    // A DataFrame: text and HTML.
    let ev = run(
        &s,
        &sb,
        &py,
        "import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})",
    )
    .await;
    let r = of_type(&ev, "result")[0];
    assert!(r["text"].as_str().unwrap().contains('a'), "{r}");
    assert!(r["html"].as_str().unwrap().contains("<table"), "{r}");

    // An exception: its name, value and traceback; the context goes on.
    let ev = run(&s, &sb, &py, "def f():\n    return 1 / 0\nf()").await;
    let err = of_type(&ev, "error");
    assert_eq!(err.len(), 1, "{ev:?}");
    assert_eq!(err[0]["name"], "ZeroDivisionError");
    assert_eq!(err[0]["value"], "division by zero");
    // Jupyter's traceback, colours and all (as E2B's): the lines are there under them.
    let tb = plain(err[0]["traceback"].as_str().unwrap());
    assert!(
        tb.contains("ZeroDivisionError") && tb.contains("return 1 / 0"),
        "{tb}"
    );

    // A timeout interrupts the kernel; the context and its variables stay.
    let (st, ev) = execute(
        &s,
        &sb,
        &py,
        json!({"code": "while True: pass", "timeout_seconds": 2}),
    )
    .await;
    assert_eq!(st, 200);
    let err = of_type(&ev, "error");
    assert_eq!(err[0]["name"], "TimeoutError", "{ev:?}");
    assert_eq!(ev.last().unwrap()["type"], "end");
    let ev = run(&s, &sb, &py, "x").await;
    assert_eq!(of_type(&ev, "result")[0]["text"], "42", "{ev:?}");

    // Variables for one execution only.
    let (_, ev) = execute(
        &s,
        &sb,
        &py,
        json!({"code": "import os\nos.environ.get('GREETING')", "env": {"GREETING": "hi there"}}),
    )
    .await;
    assert_eq!(of_type(&ev, "result")[0]["text"], "'hi there'", "{ev:?}");
    let ev = run(&s, &sb, &py, "print(os.environ.get('GREETING'))").await;
    assert_eq!(stdout(&ev), "None\n", "{ev:?}");

    // A caller that goes away interrupts its execution: the context is free again at
    // once (it would wait an hour otherwise), and its variables stay.
    let ev = abandon_then_run(
        &s,
        &sb,
        &py,
        "import time\nwhile True: time.sleep(0.1)",
        "x",
    )
    .await;
    assert_eq!(of_type(&ev, "result")[0]["text"], "42", "{ev:?}");

    // Two contexts share nothing.
    let other = new_context(&s, &sb, json!({"language": "python", "cwd": "/tmp"})).await;
    let ev = run(&s, &sb, &other, "import os\nprint(os.getcwd())\nx").await;
    assert_eq!(stdout(&ev), "/tmp\n");
    assert_eq!(of_type(&ev, "error")[0]["name"], "NameError", "{ev:?}");

    // Bash: state carries over, a failing line is an error, a timeout interrupts.
    let sh = new_context(&s, &sb, json!({"language": "bash"})).await;
    let ev = run(&s, &sb, &sh, "N=7; cd /tmp; echo out; echo err >&2").await;
    assert_eq!(stdout(&ev), "out\n");
    assert_eq!(of_type(&ev, "stderr")[0]["text"], "err\n");
    let ev = run(&s, &sb, &sh, "echo $N $PWD; false").await;
    assert_eq!(stdout(&ev), "7 /tmp\n");
    assert_eq!(of_type(&ev, "error")[0]["name"], "ExitCode", "{ev:?}");
    let (_, ev) = execute(
        &s,
        &sb,
        &sh,
        json!({"code": "sleep 60", "timeout_seconds": 1}),
    )
    .await;
    assert_eq!(of_type(&ev, "error")[0]["name"], "TimeoutError", "{ev:?}");
    let ev = run(&s, &sb, &sh, "echo $N").await;
    assert_eq!(stdout(&ev), "7\n");
    let (_, ev) = execute(
        &s,
        &sb,
        &sh,
        json!({"code": "echo \"$N $ONLY\"; N=8", "env": {"ONLY": "once", "N": "9"}}),
    )
    .await;
    assert_eq!(stdout(&ev), "9 once\n", "{ev:?}");
    // Put back after: what the code set to a variable of the request is undone too.
    let ev = run(&s, &sb, &sh, "echo \"$N ${ONLY-unset}\"").await;
    assert_eq!(stdout(&ev), "7 unset\n", "{ev:?}");

    let ev = abandon_then_run(&s, &sb, &sh, "sleep 3600", "echo $N").await;
    assert_eq!(stdout(&ev), "7\n");

    // Restart: a fresh kernel. Delete: gone.
    let (st, v) = s
        .post(
            &format!("/v1/sandboxes/{sb}/contexts/{py}/restart"),
            json!({}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let ev = run(&s, &sb, &py, "x").await;
    assert_eq!(of_type(&ev, "error")[0]["name"], "NameError", "{ev:?}");
    let (st, _) = s
        .delete(&format!("/v1/sandboxes/{sb}/contexts/{other}"))
        .await;
    assert_eq!(st, 200);
    let (_, list) = s.get(&format!("/v1/sandboxes/{sb}/contexts")).await;
    let ids: Vec<&str> = list["contexts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [py.as_str(), sh.as_str()], "{list}");

    // Bad input: a clear 4xx, nothing changed.
    let (st, _) = execute(&s, &sb, &other, json!({"code": "1"})).await;
    assert_eq!(st, 404);
    let (st, _) = execute(&s, &sb, "ctx_../../x", json!({"code": "1"})).await;
    assert_eq!(st, 404);
    let (st, v) = execute(&s, &sb, &py, json!({"code": "1", "timeout_seconds": 0})).await;
    assert_eq!(st, 400, "{v:?}");
    let (st, _) = execute(&s, &sb, &py, json!({"cell": "1"})).await;
    assert_eq!(st, 400);
    let big = "#".repeat(2 << 20);
    let (st, _) = execute(&s, &sb, &py, json!({ "code": big })).await;
    assert_eq!(st, 413);
    for body in [
        json!({"language": "cobol"}),
        json!({"cwd": "relative"}),
        json!({"cwd": "/no/such/dir"}),
        json!({"language": "python", "extra": 1}),
    ] {
        let (st, v) = s
            .post(&format!("/v1/sandboxes/{sb}/contexts"), body.clone())
            .await;
        assert_eq!(st, 400, "{body} -> {v}");
    }
    let (_, list) = s.get(&format!("/v1/sandboxes/{sb}/contexts")).await;
    assert_eq!(list["contexts"].as_array().unwrap().len(), 2, "{list}");
    // Another tenant sees no sandbox, so no contexts.
    let key = s.new_key("other");
    let resp = s
        .client_as(&key)
        .http()
        .get(format!("{}/v1/sandboxes/{sb}/contexts", s.url))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 404);

    s.destroy(&sb).await;
}

/// Suspend and resume, several times, each right after a request: a request is a short
/// command whose output pipes the agent lets go of as it ends, just before the checkpoint.
/// runsc restored such deleted epoll registrations, and the agent crashed or hung at its
/// first wake after about one restore in three (see `space-agent`'s `watch`).
#[tokio::test]
async fn a_context_survives_suspend_and_resume() {
    let s = TestServer::start().await;
    let sb = s.create("code-interpreter").await;
    let py = new_context(&s, &sb, json!({})).await;
    run(
        &s,
        &sb,
        &py,
        "import numpy as np\nkept = np.arange(5).sum()",
    )
    .await;
    for cycle in 0..4 {
        // Each execution after a resume answers, without an error: a restored kernel
        // that never answers ends in a `TimeoutError` here, said with its cycle.
        let ev = run(&s, &sb, &py, &format!("kept += {cycle}")).await;
        assert!(
            of_type(&ev, "error").is_empty(),
            "cycle {cycle}: {ev:?}\n{}",
            s.log()
        );
        for action in ["suspend", "resume"] {
            let (st, op) = s
                .post(&format!("/v1/sandboxes/{sb}/{action}"), json!({}))
                .await;
            assert_eq!(st, 202, "{op}");
            let op = s.wait_op(op["id"].as_str().unwrap()).await;
            assert_eq!(
                op["status"],
                "succeeded",
                "cycle {cycle}: {op}\n{}",
                s.log()
            );
        }
    }
    let ev = run(&s, &sb, &py, "int(kept)").await;
    let result = of_type(&ev, "result");
    assert!(
        result.first().is_some_and(|r| r["text"] == "16"),
        "{ev:?}\n{}",
        s.log()
    );
    s.destroy(&sb).await;
}

/// An interrupt can land where it stops nothing: before the code started (bash's own
/// trap, an idle kernel), or in code that catches it. The execution is interrupted again
/// until it ends, so an abandoned execution still frees its context with its state kept,
/// rather than running on until the context is restarted and its variables lost.
#[tokio::test]
async fn an_interrupt_that_does_not_stop_the_code_is_sent_again() {
    let s = TestServer::start().await;
    let sb = s.create("code-interpreter").await;

    let py = new_context(&s, &sb, json!({})).await;
    run(&s, &sb, &py, "kept = 5").await;
    let ev = abandon_then_run(
        &s,
        &sb,
        &py,
        "import time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    pass\ntime.sleep(3600)",
        "kept",
    )
    .await;
    assert_eq!(of_type(&ev, "result")[0]["text"], "5", "{ev:?}");

    // bash: the first interrupt ends a `wait` (the trap runs, bash goes on), and the
    // program started after it needs another.
    let sh = new_context(&s, &sb, json!({"language": "bash"})).await;
    run(&s, &sb, &sh, "N=7").await;
    let ev = abandon_then_run(
        &s,
        &sb,
        &sh,
        "sleep 60 & p=$!; wait $p; kill $p; sleep 3600",
        "echo $N",
    )
    .await;
    assert_eq!(stdout(&ev), "7\n", "{ev:?}");
    let ev = run(
        &s,
        &sb,
        &sh,
        "for c in /proc/[0-9]*/comm; do [ \"$(cat $c 2>/dev/null)\" = sleep ] && echo $c; done; echo end",
    )
    .await;
    assert_eq!(stdout(&ev), "end\n", "a sleep is left: {ev:?}");
    s.destroy(&sb).await;
}

#[tokio::test]
async fn a_sandbox_without_the_interpreter_or_jupyter_says_so() {
    let s = TestServer::start().await;
    let sb = s.create("busybox").await;
    let (st, v) = s
        .post(&format!("/v1/sandboxes/{sb}/contexts"), json!({}))
        .await;
    assert_eq!(st, 409, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("code-interpreter template"),
        "{v}"
    );
    s.destroy(&sb).await;

    // Plain debian has python3 but no Jupyter: a Python context says so, and a bash
    // context (bash is there) works.
    let sb = s.create("debian").await;
    let (st, v) = s
        .post(&format!("/v1/sandboxes/{sb}/contexts"), json!({}))
        .await;
    assert_eq!(st, 409, "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("no Jupyter kernel"), "{v}");
    let sh = new_context(&s, &sb, json!({"language": "bash"})).await;
    let ev = run(&s, &sb, &sh, "echo $((6 * 7))").await;
    assert_eq!(stdout(&ev), "42\n", "{ev:?}");
    s.destroy(&sb).await;
}
