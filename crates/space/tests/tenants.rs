//! Tenants: API keys (`space keys`), isolation between tenants (404 for
//! another tenant's ids), and the per-tenant and per-sandbox limits (429).

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::TestServer;
use reqwest::Method;
use serde_json::{json, Value};

fn space(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_space"))
        .args(args)
        .output()
        .expect("run space")
}

/// `space keys create --tenant T` on the server's data dir; the key it prints.
fn new_key(s: &TestServer, tenant: &str) -> String {
    let out = space(&[
        "keys",
        "create",
        "--tenant",
        tenant,
        "--name",
        "test",
        "--data-dir",
        s.data_dir().to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let key = String::from_utf8(out.stdout).unwrap().trim().to_string();
    assert!(key.starts_with("spk_"), "{key}");
    key
}

struct Reply {
    status: u16,
    body: Value,
    retry_after: Option<String>,
}

/// The raw answer to `key`'s request (statuses and `Retry-After` are what these
/// tests are about).
async fn call(s: &TestServer, key: &str, method: Method, path: &str, body: Option<Value>) -> Reply {
    let mut rb = s
        .client_as(key)
        .request(method, path)
        .timeout(Duration::from_secs(120));
    if let Some(b) = body {
        rb = rb.json(&b);
    }
    let resp = rb.send().await.expect("request");
    let status = resp.status().as_u16();
    let retry_after = resp
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string());
    let bytes = resp.bytes().await.unwrap();
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Reply {
        status,
        body,
        retry_after,
    }
}

async fn create_as(s: &TestServer, key: &str, body: Value) -> Reply {
    call(s, key, Method::POST, "/v1/sandboxes", Some(body)).await
}

/// Creates a busybox sandbox as `key`'s tenant and waits until it runs.
async fn running_sandbox(s: &TestServer, key: &str) -> String {
    let r = create_as(s, key, json!({"template": "busybox"})).await;
    assert_eq!(r.status, 202, "{}", r.body);
    let op = succeeded(s, key, &r.body).await;
    op["sandbox_id"].as_str().unwrap().to_string()
}

/// Waits, as `key`'s tenant, until the operation `op` succeeds (panics if it fails).
async fn succeeded(s: &TestServer, key: &str, op: &Value) -> Value {
    let op = op["id"].as_str().unwrap();
    for _ in 0..20 {
        let r = call(
            s,
            key,
            Method::GET,
            &format!("/v1/operations/{op}?wait=30s"),
            None,
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        match r.body["status"].as_str().unwrap() {
            "succeeded" => return r.body,
            "failed" | "cancelled" => panic!("operation failed: {}", r.body),
            _ => {}
        }
    }
    panic!("operation {op} did not finish");
}

async fn destroy_as(s: &TestServer, key: &str, sb: &str) {
    let r = call(s, key, Method::DELETE, &format!("/v1/sandboxes/{sb}"), None).await;
    assert_eq!(r.status, 202, "{}", r.body);
    let op = r.body["id"].as_str().unwrap().to_string();
    for _ in 0..20 {
        let r = call(
            s,
            key,
            Method::GET,
            &format!("/v1/operations/{op}?wait=30s"),
            None,
        )
        .await;
        if r.body["status"] == "succeeded" {
            s.assert_nothing_left(sb);
            return;
        }
    }
    panic!("destroy of {sb} did not finish");
}

/// Every way to reach another tenant's sandbox, its commands, files and
/// operations answers like an id that does not exist; nothing changes.
#[tokio::test]
async fn another_tenants_ids_are_not_found_and_lists_are_filtered() {
    let s = TestServer::start().await;
    let acme = new_key(&s, "acme");
    let beta = new_key(&s, "beta");

    let sb = running_sandbox(&s, &acme).await;
    let r = call(
        &s,
        &acme,
        Method::POST,
        &format!("/v1/sandboxes/{sb}/commands"),
        Some(json!({"argv": ["sh", "-c", "echo hi > /tmp/f"], "wait": true})),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.body);
    let cmd = r.body["id"].as_str().unwrap().to_string();
    let ops = call(
        &s,
        &acme,
        Method::GET,
        &format!("/v1/operations?sandbox_id={sb}"),
        None,
    )
    .await;
    let op = ops.body["operations"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        call(&s, &acme, Method::GET, &format!("/v1/sandboxes/{sb}"), None)
            .await
            .body["tenant"],
        "acme"
    );

    // The same requests for an id that does not exist, to compare with.
    let ghost_sb = "sb_0000000000000000000000";
    let ghost_op = "op_0000000000000000000000";
    let probes: Vec<(Method, String, Option<Value>)> = vec![
        (Method::GET, format!("/v1/sandboxes/{sb}"), None),
        (Method::DELETE, format!("/v1/sandboxes/{sb}"), None),
        (Method::POST, format!("/v1/sandboxes/{sb}/pause"), None),
        (Method::POST, format!("/v1/sandboxes/{sb}/suspend"), None),
        (Method::POST, format!("/v1/sandboxes/{sb}/resume"), None),
        (Method::POST, format!("/v1/sandboxes/{sb}/keepalive"), None),
        (
            Method::POST,
            format!("/v1/sandboxes/{sb}/snapshot-template"),
            Some(json!({"name": "stolen"})),
        ),
        (Method::GET, format!("/v1/sandboxes/{sb}/commands"), None),
        (
            Method::POST,
            format!("/v1/sandboxes/{sb}/commands"),
            Some(json!({"argv": ["true"]})),
        ),
        (
            Method::GET,
            format!("/v1/sandboxes/{sb}/commands/{cmd}"),
            None,
        ),
        (
            Method::GET,
            format!("/v1/sandboxes/{sb}/commands/{cmd}/output"),
            None,
        ),
        (
            Method::POST,
            format!("/v1/sandboxes/{sb}/commands/{cmd}/signal"),
            Some(json!({"signal": "KILL"})),
        ),
        (
            Method::POST,
            format!("/v1/sandboxes/{sb}/commands/{cmd}/stdin"),
            Some(json!({"data": "x"})),
        ),
        (
            Method::GET,
            format!("/v1/sandboxes/{sb}/files?path=/tmp/f"),
            None,
        ),
        (
            Method::GET,
            format!("/v1/sandboxes/{sb}/files/list?path=/"),
            None,
        ),
        (
            Method::GET,
            format!("/v1/sandboxes/{sb}/files/stat?path=/tmp/f"),
            None,
        ),
        (
            Method::DELETE,
            format!("/v1/sandboxes/{sb}/files?path=/tmp/f"),
            None,
        ),
        (Method::GET, format!("/v1/operations/{op}"), None),
        (Method::POST, format!("/v1/operations/{op}/cancel"), None),
        (Method::GET, format!("/v1/operations/{op}/log"), None),
    ];
    for (m, path, body) in probes {
        let r = call(&s, &beta, m.clone(), &path, body.clone()).await;
        assert_eq!(r.status, 404, "{m} {path} as another tenant: {}", r.body);
        let ghost = path.replace(&sb, ghost_sb).replace(&op, ghost_op);
        let g = call(&s, &beta, m.clone(), &ghost, body).await;
        assert_eq!(g.status, 404, "{m} {ghost}: {}", g.body);
        // Same code, same message shape: nothing tells "exists, not yours" apart.
        assert_eq!(
            r.body["error"]["code"], g.body["error"]["code"],
            "{m} {path}"
        );
        assert_eq!(
            r.body["error"]["message"]
                .as_str()
                .unwrap()
                .replace(&sb, "ID")
                .replace(&op, "ID"),
            g.body["error"]["message"]
                .as_str()
                .unwrap()
                .replace(ghost_sb, "ID")
                .replace(ghost_op, "ID"),
            "{m} {path}"
        );
    }
    // Nothing changed: the sandbox still runs, its file is there, its command was not signalled.
    let r = call(&s, &acme, Method::GET, &format!("/v1/sandboxes/{sb}"), None).await;
    assert_eq!(r.body["state"], "running");
    let r = call(
        &s,
        &acme,
        Method::GET,
        &format!("/v1/sandboxes/{sb}/files?path=/tmp/f"),
        None,
    )
    .await;
    assert_eq!(r.status, 200);
    let r = call(
        &s,
        &acme,
        Method::GET,
        &format!("/v1/sandboxes/{sb}/commands"),
        None,
    )
    .await;
    assert_eq!(r.body["commands"].as_array().unwrap().len(), 1);

    // Lists: each tenant sees its own only.
    let list = |r: Reply, field: &str| -> Vec<String> {
        r.body[field]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["id"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(
        list(
            call(&s, &acme, Method::GET, "/v1/sandboxes", None).await,
            "sandboxes"
        ),
        vec![sb.clone()]
    );
    assert!(list(
        call(&s, &beta, Method::GET, "/v1/sandboxes", None).await,
        "sandboxes"
    )
    .is_empty());
    assert!(list(
        call(&s, &beta, Method::GET, "/v1/operations", None).await,
        "operations"
    )
    .is_empty());
    assert!(list(
        call(
            &s,
            &beta,
            Method::GET,
            &format!("/v1/operations?sandbox_id={sb}"),
            None
        )
        .await,
        "operations"
    )
    .is_empty());
    assert!(list(
        call(&s, &acme, Method::GET, "/v1/operations", None).await,
        "operations"
    )
    .contains(&op));
    // The server's own token is tenant `default`: it does not see acme's either.
    assert!(s.get("/v1/sandboxes").await.1["sandboxes"]
        .as_array()
        .unwrap()
        .is_empty());

    // Events: beta's replay of all history has none of acme's objects.
    let beta_events = replay_events(&s, &beta).await;
    assert!(!beta_events.contains(&sb), "{beta_events}");
    let acme_events = replay_events(&s, &acme).await;
    assert!(acme_events.contains(&sb));

    destroy_as(&s, &acme, &sb).await;
}

/// All retained events (`?after=0`) a tenant's stream replays within a short read.
async fn replay_events(s: &TestServer, key: &str) -> String {
    let mut resp = s
        .client_as(key)
        .request(Method::GET, "/v1/events?after=0")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut text = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while let Ok(Ok(Some(chunk))) = tokio::time::timeout_at(deadline, resp.chunk()).await {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    text
}

#[tokio::test]
async fn templates_belong_to_the_tenant_that_built_them() {
    let s = TestServer::start().await;
    let acme = new_key(&s, "acme");
    let beta = new_key(&s, "beta");
    // The template cache is shared by every test server: a name of this run only.
    let name = format!(
        "acme-tools-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
            % 1_000_000_000
    );
    let name = name.as_str();
    let recipe = json!({"name": name, "base": "busybox",
        "files": [{"path": "/etc/acme", "content": "acme\n"}]});
    let r = call(
        &s,
        &acme,
        Method::POST,
        "/v1/templates",
        Some(recipe.clone()),
    )
    .await;
    assert_eq!(r.status, 202, "{}", r.body);
    let op = r.body["id"].as_str().unwrap().to_string();
    let done = call(
        &s,
        &acme,
        Method::GET,
        &format!("/v1/operations/{op}?wait=120s"),
        None,
    )
    .await;
    assert_eq!(done.body["status"], "succeeded", "{}", done.body);
    // The build operation is acme's.
    assert_eq!(
        call(
            &s,
            &beta,
            Method::GET,
            &format!("/v1/operations/{op}"),
            None
        )
        .await
        .status,
        404
    );

    let names = |r: Reply| -> Vec<String> {
        r.body["templates"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap().to_string())
            .collect()
    };
    let seen_by_acme = names(call(&s, &acme, Method::GET, "/v1/templates", None).await);
    assert!(
        seen_by_acme.contains(&name.to_string()) && seen_by_acme.contains(&"busybox".to_string())
    );
    let seen_by_beta = names(call(&s, &beta, Method::GET, "/v1/templates", None).await);
    assert!(
        !seen_by_beta.contains(&name.to_string()) && seen_by_beta.contains(&"busybox".to_string())
    );

    // beta can neither use, build on, delete nor take over the name.
    let r = create_as(&s, &beta, json!({"template": name})).await;
    assert_eq!(r.status, 404, "{}", r.body);
    let r = call(
        &s,
        &beta,
        Method::POST,
        "/v1/templates",
        Some(json!({"name": format!("{name}-b"), "base": format!("template:{name}")})),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    let r = call(
        &s,
        &beta,
        Method::DELETE,
        &format!("/v1/templates/{name}"),
        None,
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.body);
    let r = call(
        &s,
        &beta,
        Method::POST,
        "/v1/templates",
        Some(json!({"name": name, "base": "busybox"})),
    )
    .await;
    assert_eq!(r.status, 409, "{}", r.body);
    assert!(beta_sees_no_sandboxes(&s, &beta).await);

    // acme deletes it; then the name is free for anyone.
    let r = call(
        &s,
        &acme,
        Method::DELETE,
        &format!("/v1/templates/{name}"),
        None,
    )
    .await;
    assert_eq!(r.status, 204, "{}", r.body);
    let r = call(
        &s,
        &beta,
        Method::POST,
        "/v1/templates",
        Some(json!({"name": name, "base": "busybox"})),
    )
    .await;
    assert_eq!(r.status, 202, "{}", r.body);
    let op = r.body["id"].as_str().unwrap().to_string();
    let done = call(
        &s,
        &beta,
        Method::GET,
        &format!("/v1/operations/{op}?wait=120s"),
        None,
    )
    .await;
    assert_eq!(done.body["status"], "succeeded", "{}", done.body);
    assert!(
        !names(call(&s, &acme, Method::GET, "/v1/templates", None).await)
            .contains(&name.to_string())
    );
    // Nothing of this test stays in the shared cache.
    let r = call(
        &s,
        &beta,
        Method::DELETE,
        &format!("/v1/templates/{name}"),
        None,
    )
    .await;
    assert_eq!(r.status, 204, "{}", r.body);
}
async fn beta_sees_no_sandboxes(s: &TestServer, key: &str) -> bool {
    call(s, key, Method::GET, "/v1/sandboxes", None).await.body["sandboxes"]
        .as_array()
        .unwrap()
        .is_empty()
}

/// Keys are stored hashed, never logged, and stop working the moment they are revoked.
#[tokio::test]
async fn keys_are_hashed_revocable_and_never_logged() {
    let s = TestServer::start().await;
    let key = new_key(&s, "acme");
    assert_eq!(
        call(&s, &key, Method::GET, "/v1/sandboxes", None)
            .await
            .status,
        200
    );
    // Wrong, truncated or made-up keys: 401.
    for bad in [&key[..key.len() - 1], "spk_nope", "", &format!("{key}x")] {
        let r = call(&s, bad, Method::GET, "/v1/sandboxes", None).await;
        assert_eq!(r.status, 401, "{bad}");
    }
    let ls = space(&["keys", "ls", "--data-dir", s.data_dir().to_str().unwrap()]);
    let ls = String::from_utf8(ls.stdout).unwrap();
    assert!(ls.contains("acme") && !ls.contains(&key), "{ls}");
    let id = ls
        .lines()
        .find(|l| l.contains("acme"))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_string();
    let out = space(&[
        "keys",
        "revoke",
        &id,
        "--data-dir",
        s.data_dir().to_str().unwrap(),
    ]);
    assert!(out.status.success());
    let r = call(&s, &key, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(r.status, 401, "{}", r.body);
    // Revoking twice, or an unknown id, is an error that changes nothing.
    assert!(!space(&[
        "keys",
        "revoke",
        &id,
        "--data-dir",
        s.data_dir().to_str().unwrap()
    ])
    .status
    .success());
    // Bad tenant names are refused.
    for bad in ["", "Acme", "a/b", "-x"] {
        let out = space(&[
            "keys",
            "create",
            "--tenant",
            bad,
            "--data-dir",
            s.data_dir().to_str().unwrap(),
        ]);
        assert!(!out.status.success(), "{bad}");
    }
    // The key is in neither the database nor the log.
    let secret = &key["spk_".len()..];
    for f in ["space.db", "space.db-wal", "server.log"] {
        let p = s.data_dir().join(f);
        if let Ok(bytes) = std::fs::read(&p) {
            assert!(
                !String::from_utf8_lossy(&bytes).contains(secret),
                "the key is in {f}"
            );
        }
    }
}

/// Without SPACE_API_TOKEN and without --dev the server serves API keys only.
#[tokio::test]
async fn a_server_can_run_on_keys_alone() {
    let dir = tempfile::Builder::new()
        .prefix("sp")
        .tempdir_in("/tmp")
        .unwrap();
    let data = dir.path().to_str().unwrap();
    // No key yet: refuses to start, saying what to do.
    let out = Command::new(env!("CARGO_BIN_EXE_space"))
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir", data])
        .env_remove("SPACE_API_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("space keys create"));
    let key = {
        let out = space(&["keys", "create", "--tenant", "solo", "--data-dir", data]);
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_space"))
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir", data])
        .args(["--templates-dir", common::templates_dir().to_str().unwrap()])
        .env_remove("SPACE_API_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
    let url = loop {
        let line = lines.next().expect("server output").unwrap();
        if let Some(u) = line.strip_prefix("space listening on ") {
            break u.to_string();
        }
    };
    let all = || std::iter::empty::<(&str, &str)>();
    common::client_of(&url, &key)
        .list_sandboxes(all())
        .await
        .unwrap();
    for bad in ["space-dev-token", "", "test-token-0123456789"] {
        let e = common::client_of(&url, bad)
            .list_sandboxes(all())
            .await
            .unwrap_err();
        assert_eq!(e.status(), Some(401), "{bad}: {e}");
    }
    child.kill().unwrap();
    child.wait().unwrap();
}

/// The server's own capacity (`--max-sandboxes`): resident sandboxes of every tenant
/// count, pooled ones too; past it a create and the resume of a suspended sandbox get 429
/// with a Retry-After and change nothing; suspending or destroying one makes room.
#[tokio::test]
async fn server_capacity_answers_429_and_frees_up_again() {
    let s = TestServer::start_with(&["--max-sandboxes", "2"]).await;
    if !s.runtime_available("gvisor").await {
        return;
    }
    let (a, b) = (new_key(&s, "cap-a"), new_key(&s, "cap-b"));
    let sb_a = running_sandbox(&s, &a).await;
    let sb_b = running_sandbox(&s, &b).await;
    let count = |key: &str| {
        let (s, key) = (&s, key.to_string());
        async move {
            let r = call(s, &key, Method::GET, "/v1/sandboxes", None).await;
            r.body["sandboxes"].as_array().map_or(0, Vec::len)
        }
    };
    // Full, for either tenant, though each is far below its own limit.
    for key in [&a, &b] {
        let r = create_as(&s, key, json!({"template": "busybox"})).await;
        assert_eq!(r.status, 429, "{}", r.body);
        assert_eq!(r.body["error"]["code"], "too_many_requests");
        assert!(
            r.body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("--max-sandboxes"),
            "{}",
            r.body
        );
        assert_eq!(r.retry_after.as_deref(), Some("5"));
    }
    assert_eq!(
        (count(&a).await, count(&b).await),
        (1, 1),
        "a refusal made nothing"
    );

    // A suspended sandbox holds no room: a create fits again; its resume then does not.
    let act = |action: &'static str| {
        let (s, a, path) = (&s, &a, format!("/v1/sandboxes/{sb_a}/{action}"));
        async move { call(s, a, Method::POST, &path, None).await }
    };
    let r = act("suspend").await;
    assert_eq!(r.status, 202, "{}", r.body);
    succeeded(&s, &a, &r.body).await;
    let sb_b2 = running_sandbox(&s, &b).await;
    let r = act("resume").await;
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.retry_after.as_deref(), Some("5"));
    let r = call(&s, &a, Method::GET, &format!("/v1/sandboxes/{sb_a}"), None).await;
    assert_eq!(r.body["state"], "suspended", "{}", r.body);

    // Destroying one makes room for the resume.
    destroy_as(&s, &b, &sb_b2).await;
    let r = act("resume").await;
    assert_eq!(r.status, 202, "{}", r.body);
    succeeded(&s, &a, &r.body).await;
    destroy_as(&s, &a, &sb_a).await;
    destroy_as(&s, &b, &sb_b).await;
}

/// Per-tenant sandbox count and create rate, per-sandbox and per-tenant running commands.
#[tokio::test]
async fn limits_answer_429_and_free_up_again() {
    let s = TestServer::start_with(&["--max-commands-per-sandbox", "2"]).await;
    let key = new_key(&s, "small");
    let data = s.data_dir().to_str().unwrap().to_string();
    let limits = |args: &[&str]| {
        let mut a = vec!["tenants", "limits", "small", "--data-dir", &data];
        a.extend_from_slice(args);
        let out = space(&a);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    limits(&["--max-sandboxes", "1"]);

    let sb = running_sandbox(&s, &key).await;
    let r = create_as(&s, &key, json!({"template": "busybox"})).await;
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.body["error"]["code"], "too_many_requests");
    assert!(r.retry_after.is_none());
    // Another tenant is not affected by small's limit.
    let other = new_key(&s, "other");
    let r = create_as(&s, &other, json!({"template": "nonexistent-template"})).await;
    assert_eq!(r.status, 404, "{}", r.body);

    // Running commands per sandbox: 2 (the server flag).
    let path = format!("/v1/sandboxes/{sb}/commands");
    let start = |argv: Value| call(&s, &key, Method::POST, &path, Some(json!({"argv": argv})));
    let a = start(json!(["sleep", "300"])).await;
    let b = start(json!(["sleep", "300"])).await;
    assert_eq!((a.status, b.status), (201, 201));
    let c = start(json!(["true"])).await;
    assert_eq!(c.status, 429, "{}", c.body);
    let kill = |id: String| {
        let s = &s;
        let key = &key;
        let sb = &sb;
        async move {
            let r = call(
                s,
                key,
                Method::POST,
                &format!("/v1/sandboxes/{sb}/commands/{id}/signal"),
                Some(json!({"signal": "KILL"})),
            )
            .await;
            assert!(r.status < 300, "{}", r.body);
            let r = call(
                s,
                key,
                Method::GET,
                &format!("/v1/sandboxes/{sb}/commands/{id}?wait=30s"),
                None,
            )
            .await;
            assert_eq!(r.body["state"], "killed", "{}", r.body);
        }
    };
    kill(a.body["id"].as_str().unwrap().to_string()).await;
    // One slot free again.
    let d = start(json!(["true"])).await;
    assert_eq!(d.status, 201, "{}", d.body);

    // Running commands per tenant: 1, while b still runs.
    limits(&["--max-running-commands", "1"]);
    let e = start(json!(["true"])).await;
    assert_eq!(e.status, 429, "{}", e.body);
    kill(b.body["id"].as_str().unwrap().to_string()).await;
    // `d` (`true`) has ended by now.
    let r = call(
        &s,
        &key,
        Method::GET,
        &format!(
            "/v1/sandboxes/{sb}/commands/{}?wait=30s",
            d.body["id"].as_str().unwrap()
        ),
        None,
    )
    .await;
    assert_eq!(r.body["state"], "exited");
    let f = start(json!(["true"])).await;
    assert_eq!(f.status, 201, "{}", f.body);

    // Create rate: 2 per minute; the count limit out of the way.
    destroy_as(&s, &key, &sb).await;
    limits(&["--max-sandboxes", "100", "--creates-per-minute", "2"]);
    // The bucket shrinks to the new rate at once.
    let bad = json!({"template": "no-such-template"});
    // Refused creates count too: the rate is of asking, not of succeeding.
    assert_eq!(create_as(&s, &key, bad.clone()).await.status, 404);
    assert_eq!(create_as(&s, &key, bad.clone()).await.status, 404);
    let r = create_as(&s, &key, bad.clone()).await;
    assert_eq!(r.status, 429, "{}", r.body);
    let wait: u64 = r.retry_after.expect("Retry-After").parse().unwrap();
    assert!((1..=60).contains(&wait), "{wait}");
    // The server's own token is another tenant, with its own bucket.
    assert_eq!(s.post("/v1/sandboxes", bad).await.0, 404);
}

/// The most a sandbox may ask for is the operator's choice; asking for more is a 400
/// that creates nothing.
#[tokio::test]
async fn sandbox_resources_are_capped_by_the_server() {
    let s = TestServer::start_with(&[
        "--max-vcpus",
        "2",
        "--max-memory-mib",
        "1024",
        "--max-pids",
        "4096",
        "--max-disk-mib",
        "4096",
    ])
    .await;
    for (res, field) in [
        (json!({"vcpus": 3}), "vcpus"),
        (json!({"memory_mib": 2048}), "memory_mib"),
        (json!({"pids": 5000}), "pids"),
        (json!({"disk_mib": 8192}), "disk_mib"),
    ] {
        let (status, body) = s
            .post(
                "/v1/sandboxes",
                json!({"template": "busybox", "resources": res}),
            )
            .await;
        assert_eq!(status, 400, "{body}");
        assert!(
            body["error"]["message"].as_str().unwrap().contains(field),
            "{body}"
        );
    }
    assert!(s.get("/v1/sandboxes").await.1["sandboxes"]
        .as_array()
        .unwrap()
        .is_empty());
    // A default above the maximum is refused at start.
    let dir = tempfile::Builder::new()
        .prefix("sp")
        .tempdir_in("/tmp")
        .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_space"))
        .args([
            "serve",
            "--dev",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            dir.path().to_str().unwrap(),
        ])
        .args(["--default-vcpus", "4", "--max-vcpus", "2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--max-vcpus"));
}

/// `GET /v1/whoami`: the tenant of the credential, its key id (the one `space keys ls`
/// shows, never the key), and whether it is the server's own token; a revoked key and
/// no key get a 401 there too.
#[tokio::test]
async fn whoami_names_the_tenant_of_the_credential() {
    let s = TestServer::start().await;
    let (status, me) = s.get("/v1/whoami").await;
    assert_eq!(status, 200, "{me}");
    assert_eq!(
        me,
        json!({"tenant": "default", "key_id": null, "operator": true})
    );
    let key = new_key(&s, "acme");
    let r = call(&s, &key, Method::GET, "/v1/whoami", None).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let me = r.body;
    assert_eq!(me["tenant"], "acme");
    assert_eq!(me["operator"], false);
    assert!(!me.to_string().contains(&key), "whoami shows the key: {me}");
    let id = me["key_id"].as_str().expect("a key id").to_string();
    let data = s.data_dir().to_str().unwrap();
    let ls = space(&["keys", "ls", "--data-dir", data]);
    let ls = String::from_utf8(ls.stdout).unwrap();
    assert!(
        ls.lines().any(|l| l.split_whitespace().next() == Some(&id)),
        "{id} is not in {ls}"
    );
    assert!(space(&["keys", "revoke", &id, "--data-dir", data])
        .status
        .success());
    let r = call(&s, &key, Method::GET, "/v1/whoami", None).await;
    assert_eq!(r.status, 401, "{}", r.body);
    let r = reqwest::get(format!("{}/v1/whoami", s.url)).await.unwrap();
    assert_eq!(r.status(), 401);
}
