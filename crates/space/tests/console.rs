//! The web console: its files as the server serves them, the browser's way to
//! authenticate the attach WebSocket, and the whole console driven in a real
//! headless Chromium (`tests/console/console.py`, Playwright for Python, installed
//! by scripts/test-clients.sh). Screenshots of every page land in
//! `target/console-screenshots/`.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use base64::Engine as _;
use common::TestServer;
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::{self, client::IntoClientRequest, Message};

fn repo_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `/` and its two assets, with the headers that keep the page to itself; nothing
/// else is served from there, and no path escapes the embedded set.
#[tokio::test]
async fn the_console_is_served_with_its_security_headers() {
    let s = TestServer::start().await;
    let http = reqwest::Client::new();
    let page = http.get(format!("{}/", s.url)).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let h = page.headers().clone();
    assert_eq!(h["content-type"], "text/html; charset=utf-8");
    let csp = h["content-security-policy"].to_str().unwrap();
    assert!(csp.contains("script-src 'self'"), "{csp}");
    assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
    assert!(!csp.contains("unsafe-eval"), "{csp}");
    assert_eq!(h["x-content-type-options"], "nosniff");
    assert_eq!(h["x-frame-options"], "DENY");
    assert_eq!(h["referrer-policy"], "no-referrer");
    let html = page.text().await.unwrap();
    for (asset, kind) in [
        ("app.js", "text/javascript; charset=utf-8"),
        ("app.css", "text/css; charset=utf-8"),
    ] {
        assert!(html.contains(&format!("/assets/{asset}")), "{html}");
        let r = http
            .get(format!("{}/assets/{asset}", s.url))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{asset}");
        assert_eq!(r.headers()["content-type"], kind);
        assert!(r.bytes().await.unwrap().len() > 1000, "{asset} is empty");
    }
    // The bundle carries xterm.js, built from npm's package, not a placeholder.
    let js = http
        .get(format!("{}/assets/app.js", s.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(js.contains("xterm"), "app.js has no xterm.js");
    for path in [
        "/assets/nope.js",
        "/assets/..%2fCargo.toml",
        "/assets/%2e%2e%2fbuild.rs",
        "/assets/",
        "/index.html/x",
    ] {
        let r = http.get(format!("{}{path}", s.url)).send().await.unwrap();
        assert_eq!(r.status(), 404, "{path}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "not_found", "{path}: {v}");
    }
    let r = http.post(format!("{}/", s.url)).send().await.unwrap();
    assert_eq!(r.status(), 405);
}

/// A browser cannot set `Authorization` on a WebSocket, so the attach socket also
/// takes the key as a subprotocol (`space.bearer.<base64url>`) and answers with
/// `space.attach.v1` alone: the key is never echoed, never in a URL. A wrong key,
/// another tenant's key, or a malformed one get no socket.
#[tokio::test]
async fn attach_takes_the_key_as_a_websocket_subprotocol() {
    let s = TestServer::start().await;
    let key = s.new_key("console-a");
    let other = s.new_key("console-b");
    let a = s.client_as(&key);
    let (status, op) = common::call_with(
        &a,
        reqwest::Method::POST,
        "/v1/sandboxes",
        Some(json!({"template": "busybox"})),
    )
    .await;
    assert_eq!(status, 202, "{op}");
    let (_, op) = common::call_with(
        &a,
        reqwest::Method::GET,
        &format!("/v1/operations/{}?wait=120s", op["id"].as_str().unwrap()),
        None,
    )
    .await;
    assert_eq!(op["status"], "succeeded", "{op}");
    let sb = op["sandbox_id"].as_str().unwrap().to_string();
    let (status, cmd) = common::call_with(
        &a,
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{sb}/commands"),
        Some(json!({"shell": "cat", "stdin": true})),
    )
    .await;
    assert!(status == 200 || status == 201 || status == 202, "{cmd}");
    let cid = cmd["id"].as_str().unwrap().to_string();
    let url = format!(
        "{}/v1/sandboxes/{sb}/commands/{cid}/attach",
        s.url.replacen("http", "ws", 1)
    );
    let b64 = |t: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(t);
    let connect = |protocols: String| {
        let mut req = url.clone().into_client_request().unwrap();
        req.headers_mut()
            .insert("sec-websocket-protocol", protocols.parse().unwrap());
        tokio_tungstenite::connect_async(req)
    };

    // Refused: a wrong key, another tenant's key, a key that is not base64, none.
    for (protocols, want) in [
        (
            format!("space.attach.v1, space.bearer.{}", b64("wrong")),
            401,
        ),
        (
            format!("space.attach.v1, space.bearer.{}", b64(&other)),
            404,
        ),
        ("space.attach.v1, space.bearer.%%%".to_string(), 401),
        ("space.attach.v1".to_string(), 401),
    ] {
        match connect(protocols.clone()).await {
            Err(tungstenite::Error::Http(resp)) => {
                assert_eq!(resp.status().as_u16(), want, "{protocols}")
            }
            other => panic!("{protocols}: {:?}", other.map(|_| ())),
        }
    }

    let (mut ws, resp) = connect(format!("space.attach.v1, space.bearer.{}", b64(&key)))
        .await
        .expect("attach with the key as a subprotocol");
    assert_eq!(resp.headers()["sec-websocket-protocol"], "space.attach.v1");
    ws.send(Message::Binary(b"through the subprotocol\n".to_vec()))
        .await
        .unwrap();
    ws.send(Message::Text(json!({"type": "eof"}).to_string()))
        .await
        .unwrap();
    let mut out = Vec::new();
    let exit = loop {
        let msg = tokio::time::timeout(Duration::from_secs(60), ws.next())
            .await
            .expect("output in time")
            .expect("the socket stays open until the exit")
            .unwrap();
        match msg {
            Message::Binary(b) if b.first() == Some(&1) => out.extend_from_slice(&b[1..]),
            Message::Text(t) => break serde_json::from_str::<Value>(&t).unwrap(),
            _ => {}
        }
    };
    assert_eq!(out, b"through the subprotocol\n");
    assert_eq!(exit["result"]["exit_code"], 0, "{exit}");
    // The key does not reach the log.
    assert!(!s.log().contains(&b64(&key)), "the log has the encoded key");
    let op = a.destroy_sandbox(&sb).await.unwrap();
    let op = a
        .wait_operation(&op.id, Duration::from_secs(120))
        .await
        .unwrap();
    assert!(op.status.is_terminal(), "{op:?}");
    s.assert_nothing_left(&sb);
}

/// The console in a real headless Chromium, as one user of tenant A with tenant B
/// beside: log in (and a wrong key), the live list, filters, the terminal, files up
/// and down, commands replayed from an offset, suspend and resume from the buttons,
/// the other pages, destroy, log out. See tests/console/console.py.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_in_chromium() {
    let s = TestServer::start().await;
    let (a, b) = (s.new_key("console-a"), s.new_key("console-b"));
    let doomed = s.new_key("console-revoked");
    let python = repo_dir().join("target/test-clients/venv/bin/python");
    assert!(
        python.exists(),
        "Playwright is not installed in {}: run scripts/test-clients.sh (scripts/test.sh does)",
        python.display()
    );
    let shots = repo_dir().join("target/console-screenshots");
    let _ = std::fs::remove_dir_all(&shots);
    std::fs::create_dir_all(&shots).unwrap();
    // Every process of the run (Python, Chromium and its helpers) inherits this, so
    // any left behind is found by its environment.
    let marker = format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let mut cmd = Command::new(&python);
    cmd.arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/console/console.py"))
        .env("SPACE_CONSOLE_TEST_RUN", &marker)
        .env("SPACE_URL", &s.url)
        .env("SPACE_KEY", &a)
        .env("SPACE_OTHER_KEY", &b)
        .env("SPACE_TEMPLATE", "busybox")
        .env("SPACE_SCREENSHOTS", &shots)
        .env("SPACE_SERVER_TOKEN", common::TOKEN)
        .env("SPACE_REVOKE_KEY", &doomed)
        .env("SPACE_BIN", env!("CARGO_BIN_EXE_space"))
        .env("SPACE_DATA_DIR", s.data_dir())
        .env("PYTHONFAULTHANDLER", "1");
    common::run_script_checked(&mut cmd, "console.py", || {
        format!("screenshots in {}", shots.display())
    });
    let needle = format!("SPACE_CONSOLE_TEST_RUN={marker}");
    let left = common::processes_with_env(&needle);
    assert!(left.is_empty(), "the browser left processes: {left:?}");
    // Every sandbox the script made is gone, and left nothing behind.
    for key in [&a, &b] {
        let (status, v) = common::call_with(
            &s.client_as(key),
            reqwest::Method::GET,
            "/v1/sandboxes",
            None,
        )
        .await;
        assert_eq!(status, 200, "{v}");
        for sb in v["sandboxes"].as_array().unwrap() {
            let id = sb["id"].as_str().unwrap();
            assert_eq!(sb["state"], "destroyed", "sandbox {id} was left behind");
            s.assert_nothing_left(id);
        }
    }
    for page in [
        "login",
        "sandboxes",
        "sandbox",
        "terminal",
        "files",
        "commands",
        "templates",
        "pools-operator",
        "revoked",
        "operations",
        "pools",
    ] {
        assert!(
            shots.join(format!("{page}.png")).exists(),
            "no screenshot of {page}"
        );
    }
}
