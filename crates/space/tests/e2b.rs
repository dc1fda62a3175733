//! The E2B-compatible API (docs/E2B.md), tested two ways against the real server:
//! - the real E2B SDKs, pinned (Python `e2b` sync and async, the JS `e2b` package under
//!   node), installed by `scripts/test-clients.sh` into `target/test-clients`, running the
//!   scripts in `tests/e2b/` as an application would, with only the three environment
//!   variables set;
//! - raw HTTP for what the SDKs cannot show: that an E2B process is a `/v1` command
//!   with replayable output, that a paused sandbox survives a restart, and how the
//!   envd routes treat bad tokens, bad envelopes and other tenants.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::TestServer;
use serde_json::{json, Value};

/// A server whose sandboxes run on `SPACE_TEST_RUNTIME` (E2B's create names no runtime,
/// so the server's default decides).
async fn server() -> TestServer {
    match std::env::var("SPACE_TEST_RUNTIME") {
        Ok(rt) => TestServer::start_with(&["--default-runtime", &rt]).await,
        Err(_) => TestServer::start().await,
    }
}

fn clients_dir() -> PathBuf {
    std::env::var_os("SPACE_E2B_CLIENTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/test-clients")
        })
}

fn scripts_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/e2b")
}

/// Runs one SDK script against `s` as tenant `key`; panics with its output on failure.
fn run_script(s: &TestServer, key: &str, other_key: &str, program: &str, script: &str) {
    let clients = clients_dir();
    assert!(
        clients.join("venv/bin/python").exists() && clients.join("node/node_modules/e2b").exists(),
        "the E2B SDKs are not installed in {}: run scripts/test-clients.sh (scripts/test.sh does)",
        clients.display()
    );
    let program = match program {
        "python" => clients.join("venv/bin/python"),
        p => PathBuf::from(p),
    };
    let mut cmd = Command::new(program);
    cmd.arg(scripts_dir().join(script))
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_DOMAIN")
        .env("E2B_API_URL", &s.url)
        .env("E2B_SANDBOX_URL", &s.url)
        .env("E2B_API_KEY", key)
        .env("SPACE_OTHER_KEY", other_key)
        .env("SPACE_TEMPLATE", "base")
        .env("E2B_NODE_MODULES", clients.join("node/node_modules"))
        // A crash in the interpreter (not an exception) still says where it was.
        .env("PYTHONFAULTHANDLER", "1");
    common::run_script_checked(&mut cmd, script, || {
        format!("--- server log:\n{}", tail(&s.log()))
    });
}

fn tail(s: &str) -> &str {
    let start = s.len().saturating_sub(20_000);
    let start = (start..s.len())
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(0);
    &s[start..]
}

/// Every sandbox tenant `key` ever had is destroyed and left nothing behind.
async fn assert_all_gone(s: &TestServer, key: &str) {
    let c = s.client_as(key);
    let (status, v) = common::call_with(&c, reqwest::Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(status, 200, "{v}");
    for sb in v["sandboxes"].as_array().unwrap() {
        let id = sb["id"].as_str().unwrap();
        let state = sb["state"].as_str().unwrap();
        assert!(
            state == "destroyed" || state == "failed",
            "sandbox {id} was left {state}"
        );
        if state == "destroyed" {
            s.assert_nothing_left(id);
        }
    }
}

struct E2b {
    http: reqwest::Client,
    url: String,
    key: String,
}

impl E2b {
    fn new(s: &TestServer, key: &str) -> E2b {
        E2b {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(300))
                .build()
                .unwrap(),
            url: s.url.clone(),
            key: key.to_string(),
        }
    }

    async fn control(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut rb = self
            .http
            .request(method, format!("{}{path}", self.url))
            .header("X-API-KEY", &self.key);
        if let Some(b) = body {
            rb = rb.json(&b);
        }
        common::send_raw(rb).await
    }

    /// `POST /v2/sandboxes`: (id, envd token).
    async fn create(&self, body: Value) -> (String, String) {
        let (status, v) = self
            .control(reqwest::Method::POST, "/v2/sandboxes", Some(body))
            .await;
        assert_eq!(status, 201, "{v}");
        assert!(v["envdVersion"].as_str().unwrap() >= "0.1.0", "{v}");
        (
            v["sandboxID"].as_str().unwrap().to_string(),
            v["envdAccessToken"].as_str().unwrap().to_string(),
        )
    }

    async fn unary(
        &self,
        sb: &str,
        token: Option<&str>,
        method: &str,
        body: Value,
    ) -> (u16, Value) {
        let mut rb = self
            .http
            .post(format!("{}/{method}", self.url))
            .header("E2b-Sandbox-Id", sb)
            .header("E2b-Sandbox-Port", "49983")
            .json(&body);
        if let Some(t) = token {
            rb = rb.header("X-Access-Token", t);
        }
        common::send_raw(rb).await
    }

    /// A server-streaming call: its messages and its end message.
    async fn stream(
        &self,
        sb: &str,
        token: &str,
        method: &str,
        body: Value,
    ) -> (Vec<Value>, Value) {
        let msg = serde_json::to_vec(&body).unwrap();
        let mut env = vec![0u8];
        env.extend_from_slice(&(msg.len() as u32).to_be_bytes());
        env.extend_from_slice(&msg);
        let resp = self
            .http
            .post(format!("{}/{method}", self.url))
            .header("E2b-Sandbox-Id", sb)
            .header("X-Access-Token", token)
            .header("Content-Type", "application/connect+json")
            .body(env)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["content-type"], "application/connect+json");
        let bytes = resp.bytes().await.unwrap();
        let (mut msgs, mut i) = (Vec::new(), 0);
        while i + 5 <= bytes.len() {
            let flags = bytes[i];
            let len = u32::from_be_bytes(bytes[i + 1..i + 5].try_into().unwrap()) as usize;
            let v: Value = serde_json::from_slice(&bytes[i + 5..i + 5 + len]).unwrap();
            i += 5 + len;
            if flags & 2 != 0 {
                assert_eq!(i, bytes.len(), "the end message is the last");
                return (msgs, v);
            }
            msgs.push(v);
        }
        panic!("the stream ended without its end message: {msgs:?}");
    }
}

fn b64(s: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(s)
}

fn unb64(s: &str) -> Vec<u8> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.decode(s).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sync_sdk() {
    let s = server().await;
    let (a, b) = (s.new_key("e2b-a"), s.new_key("e2b-b"));
    run_script(&s, &a, &b, "python", "sdk_sync.py");
    assert_all_gone(&s, &a).await;
    assert_all_gone(&s, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_async_sdk() {
    let s = server().await;
    let (a, b) = (s.new_key("e2b-a"), s.new_key("e2b-b"));
    run_script(&s, &a, &b, "python", "sdk_async.py");
    assert_all_gone(&s, &a).await;
    assert_all_gone(&s, &b).await;
}

/// E2B's code interpreter SDK on its default template (code-interpreter-v1, our
/// code-interpreter), sync and async.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_code_interpreter_sdk() {
    if std::env::var("SPACE_TEST_RUNTIME").is_ok_and(|rt| rt != "gvisor") {
        // The template is 1.4 GB: its microVM disk image is not built in the microVM pass.
        return;
    }
    let s = server().await;
    let (a, b) = (s.new_key("e2b-a"), s.new_key("e2b-b"));
    run_script(&s, &a, &b, "python", "code_interpreter.py");
    assert_all_gone(&s, &a).await;
}

/// The JS code interpreter SDK (`@e2b/code-interpreter`) on the same default template.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn js_code_interpreter_sdk() {
    if std::env::var("SPACE_TEST_RUNTIME").is_ok_and(|rt| rt != "gvisor") {
        return; // as python_code_interpreter_sdk
    }
    let s = server().await;
    let (a, b) = (s.new_key("e2b-a"), s.new_key("e2b-b"));
    run_script(&s, &a, &b, "node", "code_interpreter.mjs");
    assert_all_gone(&s, &a).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn js_sdk() {
    let s = server().await;
    let (a, b) = (s.new_key("e2b-a"), s.new_key("e2b-b"));
    run_script(&s, &a, &b, "node", "sdk.mjs");
    assert_all_gone(&s, &a).await;
    assert_all_gone(&s, &b).await;
}

/// An E2B process is a space command: listed in `/v1` with its pid, its output
/// replayable there; and envd's errors are Connect's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_e2b_process_is_a_v1_command() {
    let s = server().await;
    let key = s.new_key("e2b-a");
    let e = E2b::new(&s, &key);
    let (sb, token) = e
        .create(json!({"templateID": "base", "timeout": 300}))
        .await;

    let start = json!({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo out; echo err >&2; exit 7"], "envs": {}}, "stdin": false});
    let (msgs, end) = e.stream(&sb, &token, "process.Process/Start", start).await;
    assert_eq!(end, json!({}), "{msgs:?}");
    let pid = msgs[0]["event"]["start"]["pid"]
        .as_u64()
        .expect("start comes first");
    assert!(pid > 0);
    let mut out = Vec::new();
    for m in &msgs[1..] {
        if let Some(d) = m["event"]["data"]["stdout"].as_str() {
            out.extend(unb64(d));
        }
    }
    assert_eq!(out, b"out\n");
    let last = &msgs.last().unwrap()["event"]["end"];
    assert_eq!(last["exitCode"], 7, "{last}");
    assert_eq!(last["exited"], true);
    assert_eq!(last["status"], "exit status 7");

    // The same command through /v1: its pid, its result, its output.
    let c = s.client_as(&key);
    let (_, list) = common::call_with(
        &c,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{sb}/commands"),
        None,
    )
    .await;
    let cmd = list["commands"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["pid"] == pid)
        .expect("the E2B process is a /v1 command")
        .clone();
    assert_eq!(
        cmd["argv"],
        json!(["/bin/bash", "-l", "-c", "echo out; echo err >&2; exit 7"])
    );
    assert_eq!(cmd["result"]["exit_code"], 7);
    let cid = cmd["id"].as_str().unwrap();
    let ndjson = e
        .http
        .get(format!(
            "{}/v1/sandboxes/{sb}/commands/{cid}/output?stream=stderr",
            s.url
        ))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let err: Vec<u8> = ndjson
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["data"].as_str().map(unb64))
        .flatten()
        .collect();
    assert_eq!(err, b"err\n", "{ndjson}");

    // Without a cwd a process starts in its user's home, where relative file paths lead.
    let start = json!({"process": {"cmd": "/bin/sh", "args": ["-c", "pwd; echo rel > rel.txt"]}, "stdin": false});
    let (msgs, _) = e.stream(&sb, &token, "process.Process/Start", start).await;
    let out: Vec<u8> = msgs
        .iter()
        .filter_map(|m| m["event"]["data"]["stdout"].as_str())
        .flat_map(unb64)
        .collect();
    assert_eq!(out, b"/root\n");
    let (st, v) = e
        .unary(
            &sb,
            Some(&token),
            "filesystem.Filesystem/Stat",
            json!({"path": "rel.txt"}),
        )
        .await;
    assert_eq!(
        (st, v["entry"]["path"].as_str()),
        (200, Some("/root/rel.txt")),
        "{v}"
    );

    // Connect replays a finished process whole.
    let (msgs, _) = e
        .stream(
            &sb,
            &token,
            "process.Process/Connect",
            json!({"process": {"pid": pid}}),
        )
        .await;
    assert_eq!(msgs[0]["event"]["start"]["pid"], pid);
    assert_eq!(msgs.last().unwrap()["event"]["end"]["exitCode"], 7);

    // Input, signals and lists on a running one.
    let start = json!({"process": {"cmd": "cat"}, "stdin": true});
    let stream = {
        let e = E2b::new(&s, &key);
        let (sb, token) = (sb.clone(), token.clone());
        tokio::spawn(async move { e.stream(&sb, &token, "process.Process/Start", start).await })
    };
    let cat_pid = loop {
        let (st, v) = e
            .unary(&sb, Some(&token), "process.Process/List", json!({}))
            .await;
        assert_eq!(st, 200, "{v}");
        if let Some(p) = v["processes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["config"]["cmd"] == "cat")
        {
            break p["pid"].as_u64().unwrap();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let input = json!({"process": {"pid": cat_pid}, "input": {"stdin": b64("meow\n")}});
    let (st, v) = e
        .unary(&sb, Some(&token), "process.Process/SendInput", input)
        .await;
    assert_eq!(st, 200, "{v}");
    let (st, v) = e
        .unary(
            &sb,
            Some(&token),
            "process.Process/CloseStdin",
            json!({"process": {"pid": cat_pid}}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let (msgs, end) = stream.await.unwrap();
    assert_eq!(end, json!({}));
    let said: Vec<u8> = msgs
        .iter()
        .filter_map(|m| m["event"]["data"]["stdout"].as_str())
        .flat_map(unb64)
        .collect();
    assert_eq!(said, b"meow\n");
    assert_eq!(msgs.last().unwrap()["event"]["end"]["exitCode"], 0);

    // An ended process cannot be signalled: not_found, which the SDKs read as "false".
    let sig = json!({"process": {"pid": cat_pid}, "signal": "SIGNAL_SIGKILL"});
    let (st, v) = e
        .unary(&sb, Some(&token), "process.Process/SendSignal", sig)
        .await;
    assert_eq!((st, v["code"].as_str()), (404, Some("not_found")), "{v}");

    // Bad input: a clear Connect error, nothing started.
    let before = common::call_with(
        &c,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{sb}/commands"),
        None,
    )
    .await
    .1["commands"]
        .as_array()
        .unwrap()
        .len();
    let (st, v) = e
        .unary(
            &sb,
            Some(&token),
            "process.Process/SendInput",
            json!({"process": {"pid": cat_pid}, "input": {"stdin": "***"}}),
        )
        .await;
    assert_eq!(
        (st, v["code"].as_str()),
        (400, Some("invalid_argument")),
        "{v}"
    );
    let (st, v) = e
        .unary(&sb, Some(&token), "process.Process/Nope", json!({}))
        .await;
    assert_eq!(
        (st, v["code"].as_str()),
        (501, Some("unimplemented")),
        "{v}"
    );
    let (msgs, end) = e
        .stream(
            &sb,
            &token,
            "process.Process/Start",
            json!({"process": {"cmd": ""}}),
        )
        .await;
    assert!(msgs.is_empty());
    assert_eq!(end["error"]["code"], "invalid_argument", "{end}");
    let raw = e
        .http
        .post(format!("{}/process.Process/Start", s.url))
        .header("E2b-Sandbox-Id", &sb)
        .header("X-Access-Token", &token)
        .header("Content-Type", "application/connect+json")
        .body(vec![0u8, 0xff, 0xff, 0xff, 0xff, 1, 2])
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status(), 200);
    let after = common::call_with(
        &c,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{sb}/commands"),
        None,
    )
    .await
    .1["commands"]
        .as_array()
        .unwrap()
        .len();
    assert_eq!(before, after, "a refused Start started nothing");

    let (st, _) = e
        .control(reqwest::Method::DELETE, &format!("/sandboxes/{sb}"), None)
        .await;
    assert_eq!(st, 204);
    let (st, v) = e
        .control(reqwest::Method::DELETE, &format!("/sandboxes/{sb}"), None)
        .await;
    assert_eq!(st, 404, "{v}");
    assert_eq!(v["code"], 404);
    s.assert_nothing_left(&sb);
}

/// Access tokens: bound to one sandbox and its tenant; missing, wrong, another
/// sandbox's and a killed sandbox's tokens all get 401, on every envd route.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envd_tokens_open_one_sandbox_only() {
    let s = server().await;
    let (ka, kb) = (s.new_key("e2b-a"), s.new_key("e2b-b"));
    let (a, b) = (E2b::new(&s, &ka), E2b::new(&s, &kb));
    // A timeout as the SDKs send one: without it E2B's default of 15 s applies, and on
    // a loaded TCG host the second create alone can outlast the first sandbox's.
    let (sa, ta) = a
        .create(json!({"templateID": "base", "timeout": 300}))
        .await;
    let (sb, tb) = b
        .create(json!({"templateID": "base", "timeout": 300}))
        .await;

    let list = json!({});
    let (st, v) = a
        .unary(&sa, Some(&ta), "process.Process/List", list.clone())
        .await;
    assert_eq!(st, 200, "{v}");
    for (sandbox, token) in [
        (&sa, None),
        (&sa, Some("wrong")),
        (&sa, Some("sat_wrongwrongwrongwrongwrongwrong")),
        (&sa, Some(tb.as_str())),
        (&sb, Some(ta.as_str())),
    ] {
        for method in ["process.Process/List", "filesystem.Filesystem/Stat"] {
            let (st, v) = a.unary(sandbox, token, method, json!({"path": "/"})).await;
            assert_eq!(
                (st, v["code"].as_str()),
                (401, Some("unauthenticated")),
                "{method} {token:?}: {v}"
            );
        }
        let mut rb = a
            .http
            .get(format!("{}/files?path=/etc/hostname", s.url))
            .header("E2b-Sandbox-Id", sandbox.as_str());
        if let Some(t) = token {
            rb = rb.header("X-Access-Token", t);
        }
        assert_eq!(rb.send().await.unwrap().status(), 401);
    }
    // Percent-encoded and padded variants of the id are not the sandbox either.
    let encoded = format!("%73{}", &sa[1..]);
    for id in [encoded.as_str(), &format!(" {sa}x"), &sa.to_uppercase()] {
        let (st, _) = a
            .unary(id, Some(&ta), "process.Process/List", json!({}))
            .await;
        assert_eq!(st, 401, "{id}");
    }
    // A connect issues another token; both work.
    let (st, v) = a
        .control(
            reqwest::Method::POST,
            &format!("/v2/sandboxes/{sa}/connect"),
            Some(json!({"timeout": 60})),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let t2 = v["envdAccessToken"].as_str().unwrap();
    assert_ne!(t2, ta);
    assert_eq!(
        a.unary(&sa, Some(t2), "process.Process/List", list.clone())
            .await
            .0,
        200
    );
    assert_eq!(
        a.unary(&sa, Some(&ta), "process.Process/List", list.clone())
            .await
            .0,
        200
    );
    // Another tenant's key sees no such sandbox on the control plane.
    for (m, path) in [
        (reqwest::Method::GET, format!("/sandboxes/{sa}")),
        (reqwest::Method::DELETE, format!("/sandboxes/{sa}")),
        (reqwest::Method::POST, format!("/sandboxes/{sa}/pause")),
        (reqwest::Method::POST, format!("/v2/sandboxes/{sa}/connect")),
        (reqwest::Method::GET, format!("/sandboxes/{sa}/metrics")),
    ] {
        let (st, v) = b
            .control(m.clone(), &path, Some(json!({"timeout": 10})))
            .await;
        assert_eq!(st, 404, "{m} {path}: {v}");
    }
    // No key, or a wrong one: 401 with E2B's error body.
    let (st, v) = E2b {
        key: "nope".into(),
        ..E2b::new(&s, "")
    }
    .control(reqwest::Method::GET, "/v2/sandboxes", None)
    .await;
    assert_eq!((st, v["code"].as_u64()), (401, Some(401)), "{v}");

    // Health: 204 with the token, 401 without.
    let health = |token: Option<&str>| {
        let mut rb = a
            .http
            .get(format!("{}/health", s.url))
            .header("E2b-Sandbox-Id", sa.as_str());
        if let Some(t) = token {
            rb = rb.header("X-Access-Token", t);
        }
        rb.send()
    };
    assert_eq!(health(Some(&ta)).await.unwrap().status(), 204);
    assert_eq!(health(Some("wrong")).await.unwrap().status(), 401);

    // A killed sandbox: its tokens reach nothing, and envd's routes say it was not
    // found (502, as E2B's proxy does; the SDKs' is_running() reads it as false).
    assert_eq!(
        a.control(reqwest::Method::DELETE, &format!("/sandboxes/{sa}"), None)
            .await
            .0,
        204
    );
    let (st, v) = a.unary(&sa, Some(&ta), "process.Process/List", list).await;
    assert_eq!(st, 502, "{v}");
    assert!(
        v["message"].as_str().unwrap().contains("was not found"),
        "{v}"
    );
    assert_eq!(health(Some(&ta)).await.unwrap().status(), 502);
    assert_eq!(
        b.control(reqwest::Method::DELETE, &format!("/sandboxes/{sb}"), None)
            .await
            .0,
        204
    );
    s.assert_nothing_left(&sa);
    s.assert_nothing_left(&sb);
}

/// A paused E2B sandbox is a suspended space sandbox: it survives a restart of the
/// server, and a connect brings back its files and processes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_sandbox_survives_a_restart() {
    let mut s = server().await;
    let key = s.new_key("e2b-a");
    let e = E2b::new(&s, &key);
    let (sb, token) = e
        .create(json!({"templateID": "base", "timeout": 600, "metadata": {"k": "v"}}))
        .await;
    let up = e
        .http
        .post(format!("{}/files?path=/root/deep/er/note.txt", s.url))
        .header("E2b-Sandbox-Id", &sb)
        .header("X-Access-Token", &token)
        .header("Content-Type", "application/octet-stream")
        .body("kept")
        .send()
        .await
        .unwrap();
    assert_eq!(up.status(), 200);
    let written: Value = up.json().await.unwrap();
    assert_eq!(written[0]["path"], "/root/deep/er/note.txt");

    let (st, v) = e
        .control(
            reqwest::Method::POST,
            &format!("/sandboxes/{sb}/pause"),
            None,
        )
        .await;
    assert_eq!(st, 204, "{v}");
    let (st, v) = e
        .control(
            reqwest::Method::POST,
            &format!("/sandboxes/{sb}/pause"),
            None,
        )
        .await;
    assert_eq!(st, 409, "{v}");
    let (_, info) = e
        .control(reqwest::Method::GET, &format!("/sandboxes/{sb}"), None)
        .await;
    assert_eq!(info["state"], "paused");
    let (_, page) = e
        .control(reqwest::Method::GET, "/v2/sandboxes?state=paused", None)
        .await;
    assert!(page
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x["sandboxID"] == sb.as_str()));

    // The server dies (kill -9) and starts again on the same data dir.
    s.kill_and_restart();
    let e = E2b::new(&s, &key);
    let (_, info) = e
        .control(reqwest::Method::GET, &format!("/sandboxes/{sb}"), None)
        .await;
    assert_eq!(info["state"], "paused", "{info}");
    assert_eq!(info["metadata"], json!({"k": "v"}));
    let (st, v) = e
        .control(
            reqwest::Method::POST,
            &format!("/v2/sandboxes/{sb}/connect"),
            Some(json!({"timeout": 60})),
        )
        .await;
    assert_eq!(st, 201, "{v}");
    let token = v["envdAccessToken"].as_str().unwrap();
    let got = e
        .http
        .get(format!("{}/files?path=/root/deep/er/note.txt", s.url))
        .header("E2b-Sandbox-Id", &sb)
        .header("X-Access-Token", token)
        .send()
        .await
        .unwrap();
    assert_eq!(got.status(), 200);
    assert_eq!(got.text().await.unwrap(), "kept");
    let missing = e
        .http
        .get(format!("{}/files?path=/root/nope", s.url))
        .header("E2b-Sandbox-Id", &sb)
        .header("X-Access-Token", token)
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    let v: Value = missing.json().await.unwrap();
    assert_eq!(v["code"], 404);

    assert_eq!(
        e.control(reqwest::Method::DELETE, &format!("/sandboxes/{sb}"), None)
            .await
            .0,
        204
    );
    s.assert_nothing_left(&sb);

    // Two clients connecting to the same paused sandbox at once: both get it running.
    let (race, _) = e
        .create(json!({"templateID": "base", "timeout": 300}))
        .await;
    let (st, v) = e
        .control(
            reqwest::Method::POST,
            &format!("/sandboxes/{race}/pause"),
            None,
        )
        .await;
    assert_eq!(st, 204, "{v}");
    let path = format!("/v2/sandboxes/{race}/connect");
    let body = Some(json!({"timeout": 60}));
    let (one, two) = tokio::join!(
        e.control(reqwest::Method::POST, &path, body.clone()),
        e.control(reqwest::Method::POST, &path, body.clone()),
    );
    let mut statuses = [one.0, two.0];
    statuses.sort();
    assert!(
        statuses == [200, 201] || statuses == [201, 201],
        "{one:?} {two:?}"
    );
    let (_, info) = e
        .control(reqwest::Method::GET, &format!("/sandboxes/{race}"), None)
        .await;
    assert_eq!(info["state"], "running");
    let (st, _) = e
        .control(reqwest::Method::DELETE, &format!("/sandboxes/{race}"), None)
        .await;
    assert_eq!(st, 204);
    s.assert_nothing_left(&race);

    // autoPause: no TTL; idleness suspends it instead. A connect leaves it that way.
    let (ap, _) = e
        .create(json!({"templateID": "base", "timeout": 120, "autoPause": true}))
        .await;
    let c = s.client_as(&key);
    let (_, v) = common::call_with(
        &c,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{ap}"),
        None,
    )
    .await;
    assert_eq!(v["ttl_seconds"], Value::Null, "{v}");
    assert_eq!(v["idle_timeout_seconds"], 120, "{v}");
    assert_eq!(v["on_idle"], "suspend", "{v}");
    let (st, _) = e
        .control(
            reqwest::Method::POST,
            &format!("/v2/sandboxes/{ap}/connect"),
            Some(json!({"timeout": 30})),
        )
        .await;
    assert_eq!(st, 200);
    let (_, v) = common::call_with(
        &c,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{ap}"),
        None,
    )
    .await;
    assert_eq!(
        v["ttl_seconds"],
        Value::Null,
        "a connect gave an auto-pause sandbox a TTL: {v}"
    );
    // Bad creates change nothing: no template, a bad timeout, bad metadata.
    for bad in [
        json!({}),
        json!({"templateID": "base", "timeout": -1}),
        json!({"templateID": "base", "timeout": "x"}),
        json!({"templateID": "base", "metadata": {"k": 1}}),
        json!({"templateID": "base", "metadata": {"bad key!": "v"}}),
        json!({"templateID": "nope-no-such-template"}),
        json!({"templateID": "base", "envVars": ["A=1"]}),
    ] {
        let (st, v) = e
            .control(reqwest::Method::POST, "/v2/sandboxes", Some(bad.clone()))
            .await;
        assert!((400..500).contains(&st), "{bad}: {st} {v}");
        assert!(v["code"].is_u64() && v["message"].is_string(), "{v}");
    }
    let (_, list) = common::call_with(&c, reqwest::Method::GET, "/v1/sandboxes", None).await;
    let live = list["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| x["state"] != "destroyed")
        .count();
    assert_eq!(live, 1, "a refused create made a sandbox: {list}");
    let (st, _) = e
        .control(reqwest::Method::DELETE, &format!("/sandboxes/{ap}"), None)
        .await;
    assert_eq!(st, 204);
    s.assert_nothing_left(&ap);
}
