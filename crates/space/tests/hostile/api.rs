//! Hostile tenants at the API (issue 11, point 2): another tenant's ids in every
//! encoding on every route, and revoked keys holding streams open. These do not
//! depend on the runtime; they run on gVisor.

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use futures::stream::BoxStream;
use futures::StreamExt;
use reqwest::Method;
use serde_json::{json, Value};
use space_client::api::CreateSandboxRequest;
use space_client::{ClientError, EventsQuery, OutputQuery};

use super::common::TestServer;

/// How long an operation of these tests may take.
const OPERATION_LIMIT: Duration = Duration::from_secs(1200);

/// Revokes every key of `tenant`.
fn revoke_keys(s: &TestServer, tenant: &str) {
    let ls = Command::new(env!("CARGO_BIN_EXE_space"))
        .args(["keys", "ls", "--data-dir"])
        .arg(s.data_dir())
        .output()
        .expect("space keys ls");
    let ls = String::from_utf8(ls.stdout).unwrap();
    for line in ls
        .lines()
        .filter(|l| l.split_whitespace().nth(1) == Some(tenant))
    {
        let id = line.split_whitespace().next().unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_space"))
            .args(["keys", "revoke", id, "--data-dir"])
            .arg(s.data_dir())
            .output()
            .expect("space keys revoke");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// `key`'s request on `path` as given (ids in any spelling): the raw status and JSON.
async fn call(
    s: &TestServer,
    key: &str,
    method: Method,
    path: &str,
    body: Option<Body>,
) -> (u16, Value) {
    let mut rb = s
        .client_as(key)
        .request(method, path)
        .timeout(Duration::from_secs(120));
    match body {
        Some(Body::Json(v)) => rb = rb.json(&v),
        Some(Body::Raw(b)) => rb = rb.body(b),
        None => {}
    }
    let resp = rb.send().await.expect("request");
    let status = resp.status().as_u16();
    let bytes = resp.bytes().await.unwrap_or_default();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

#[derive(Clone)]
enum Body {
    Json(Value),
    Raw(Vec<u8>),
}

/// Waits for `key`'s operation to end: the operation, as JSON.
async fn wait_op(s: &TestServer, key: &str, op: &str) -> Value {
    let done = s
        .client_as(key)
        .wait_operation(op, OPERATION_LIMIT)
        .await
        .unwrap_or_else(|e| panic!("operation {op}: {e}"));
    assert!(done.status.is_terminal(), "operation {op} did not end");
    serde_json::to_value(done).unwrap()
}

/// A sandbox of `key`'s tenant (`body`: the create request), running.
async fn sandbox_as(s: &TestServer, key: &str, body: Value) -> String {
    let req: CreateSandboxRequest = serde_json::from_value(body).unwrap();
    s.client_as(key)
        .create_sandbox_and_wait(&req, OPERATION_LIMIT)
        .await
        .unwrap_or_else(|e| panic!("create as {key}: {e}"))
}

async fn destroy_as(s: &TestServer, key: &str, sb: &str) {
    s.client_as(key)
        .destroy_sandbox_and_wait(sb, OPERATION_LIMIT)
        .await
        .unwrap_or_else(|e| panic!("destroy {sb}: {e}"));
    s.assert_nothing_left(sb);
}

/// Every spelling of `id` that a decoder could turn back into it, or that a sloppy
/// check could take for it.
fn spellings(id: &str) -> Vec<String> {
    let enc = |b: u8| format!("%{b:02X}");
    let bytes = id.as_bytes();
    let mut v = vec![
        // Every byte percent-encoded, upper and lower case hex.
        bytes.iter().map(|b| enc(*b)).collect::<String>(),
        bytes
            .iter()
            .map(|b| format!("%{b:02x}"))
            .collect::<String>(),
        // Partly encoded: the first byte (the audit's `%73b_…`), the separator, the last.
        format!("{}{}", enc(bytes[0]), &id[1..]),
        id.replacen('_', "%5F", 1),
        format!("{}{}", &id[..id.len() - 1], enc(bytes[id.len() - 1])),
        // Double-encoded.
        format!("%25{:02X}{}", bytes[0], &id[1..]),
        // Case variants.
        id.to_uppercase(),
        format!("{}{}", id[..1].to_uppercase(), &id[1..]),
        // Padding and junk a lenient parser might trim.
        format!("{id}%20"),
        format!("%20{id}"),
        format!("{id}%00"),
        format!("{id}%2F"),
        format!("{id};x"),
    ];
    v.sort();
    v.dedup();
    v
}

/// A request on `route` (an OpenAPI path) that would change something of the
/// owner's if it went through.
fn request_for(method: &str, route: &str, nonce: &str) -> (String, Option<Body>) {
    let json = |v: Value| Some(Body::Json(v));
    let tail = route.rsplit('/').next().unwrap_or_default();
    match (method, tail) {
        ("post", "commands") => (
            String::new(),
            json(json!({"argv": ["touch", format!("/tmp/pwned-{nonce}")]})),
        ),
        ("post", "signal") => (String::new(), json(json!({"signal": "KILL"}))),
        ("post", "stdin") => (String::new(), Some(Body::Raw(b"pwned\n".to_vec()))),
        ("post", "snapshot-template") => (
            String::new(),
            json(json!({"name": format!("stolen-{nonce}")})),
        ),
        ("post", "keepalive") => (String::new(), json(json!({"ttl_seconds": 99999}))),
        ("post", "mkdir") => (
            String::new(),
            json(json!({"path": format!("/tmp/pwned-{nonce}")})),
        ),
        ("post", "move") => (
            String::new(),
            json(json!({"from": "/tmp/marker", "to": format!("/tmp/pwned-{nonce}")})),
        ),
        ("put", "files") => (
            format!("?path=/tmp/pwned-{nonce}"),
            Some(Body::Raw(b"pwned".to_vec())),
        ),
        (_, "files") => ("?path=/tmp/marker".into(), None),
        (_, "list") => ("?path=/tmp".into(), None),
        (_, "stat") => ("?path=/tmp/marker".into(), None),
        (_, "output") => ("?offset=0".into(), None),
        _ => (String::new(), None),
    }
}

/// Every route of the served OpenAPI document (itself checked against the router both
/// ways), with a path parameter, × every spelling of the owner's ids: another tenant
/// gets the same 404 as for an id that does not exist, and nothing of the owner's changes.
#[tokio::test]
async fn another_tenants_ids_in_every_spelling_are_not_found_on_every_route() {
    let s = TestServer::start().await;
    if !s.runtime_available("gvisor").await {
        return;
    }
    let (alice, mallory) = (s.new_key("alice"), s.new_key("mallory"));
    let sb = sandbox_as(
        &s,
        &alice,
        json!({"template": "busybox", "ttl_seconds": 3600}),
    )
    .await;
    let (st, cmd) = call(
        &s,
        &alice,
        Method::POST,
        &format!("/v1/sandboxes/{sb}/commands"),
        Some(Body::Json(
            json!({"shell": "echo marker > /tmp/marker; cat", "stdin": true}),
        )),
    )
    .await;
    assert_eq!(st, 201, "{cmd}");
    let cid = cmd["id"].as_str().unwrap().to_string();
    let tpl = format!("alice-tpl-{}", &sb[3..11]);
    let (st, build) = call(
        &s,
        &alice,
        Method::POST,
        "/v1/templates",
        Some(Body::Json(json!({"name": tpl, "base": "busybox",
            "files": [{"path": "/etc/alice", "content": "mine"}]}))),
    )
    .await;
    assert_eq!(st, 202, "{build}");
    let build_op = build["id"].as_str().unwrap().to_string();
    assert_eq!(wait_op(&s, &alice, &build_op).await["status"], "succeeded");

    let before_sb = call(
        &s,
        &alice,
        Method::GET,
        &format!("/v1/sandboxes/{sb}"),
        None,
    )
    .await
    .1;
    let before_ops = call(&s, &alice, Method::GET, "/v1/operations?limit=1000", None)
        .await
        .1;
    let doc: Value = call(&s, &alice, Method::GET, "/v1/openapi.json", None)
        .await
        .1;

    // The decoder is real: the owner reaches her sandbox through a partly encoded id.
    let partly = format!("%73{}", &sb[1..]);
    let (st, v) = call(
        &s,
        &alice,
        Method::GET,
        &format!("/v1/sandboxes/{partly}"),
        None,
    )
    .await;
    assert_eq!((st, v["id"].as_str()), (200, Some(sb.as_str())), "{v}");

    // What an id that does not exist gets: the answer every foreign spelling must match.
    let unknown = call(
        &s,
        &mallory,
        Method::GET,
        "/v1/sandboxes/sb_aaaaaaaaaaaaaaaaaaaa",
        None,
    )
    .await;
    assert_eq!(unknown.0, 404);
    assert_eq!(unknown.1["error"]["code"], "not_found");

    let mut routes = 0;
    let mut requests = 0;
    let nonce = &sb[3..11];
    for (path, item) in doc["paths"].as_object().expect("paths") {
        if !path.contains('{') {
            continue;
        }
        for method in item.as_object().unwrap().keys() {
            let Ok(m) = Method::from_bytes(method.to_uppercase().as_bytes()) else {
                continue;
            };
            routes += 1;
            let (query, body) = request_for(method, path, nonce);
            let fill = |id: &str, cid: &str, name: &str| {
                path.replace("{id}", id)
                    .replace("{cid}", cid)
                    .replace("{name}", name)
            };
            let own_id = if path.starts_with("/v1/operations") {
                &build_op
            } else {
                &sb
            };
            // The exact ids, then each parameter respelt on its own, then all of them.
            let mut paths = vec![
                fill(own_id, &cid, &tpl),
                format!("{}/", fill(own_id, &cid, &tpl)),
            ];
            for v in spellings(own_id) {
                paths.push(fill(&v, &cid, &tpl));
            }
            if path.contains("{cid}") {
                for v in spellings(&cid) {
                    paths.push(fill(own_id, &v, &tpl));
                }
            }
            if path.contains("{name}") {
                for v in spellings(&tpl) {
                    paths.push(fill(own_id, &cid, &v));
                }
            }
            // The operator's routes (warm pools) hold no tenant's objects: a tenant's key
            // gets 403 whatever id it names (404 where the spelling matches no route), so
            // no spelling tells it anything.
            let operators = path.starts_with("/v1/pools");
            for p in paths {
                requests += 1;
                let (st, v) = call(
                    &s,
                    &mallory,
                    m.clone(),
                    &format!("{p}{query}"),
                    body.clone(),
                )
                .await;
                if operators && st == 403 {
                    assert_eq!(v["error"]["code"], "forbidden", "{method} {p}: {v}");
                    continue;
                }
                assert_eq!(st, 404, "{method} {p}{query} as another tenant: {v}");
                assert_eq!(v["error"]["code"], "not_found", "{method} {p}: {v}");
            }
        }
    }
    assert!(
        routes >= 25,
        "only {routes} routes with parameters in the OpenAPI document"
    );
    eprintln!("hostile: {requests} requests on {routes} routes as another tenant, all 404");

    // Nothing of the owner's changed.
    let after_sb = call(
        &s,
        &alice,
        Method::GET,
        &format!("/v1/sandboxes/{sb}"),
        None,
    )
    .await
    .1;
    for field in ["state", "expires_at", "ttl_seconds", "labels"] {
        assert_eq!(before_sb[field], after_sb[field], "{field}");
    }
    let after_ops = call(&s, &alice, Method::GET, "/v1/operations?limit=1000", None)
        .await
        .1;
    assert_eq!(before_ops["operations"], after_ops["operations"]);
    let (_, cmds) = call(
        &s,
        &alice,
        Method::GET,
        &format!("/v1/sandboxes/{sb}/commands"),
        None,
    )
    .await;
    let ids: Vec<&str> = cmds["commands"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [cid.as_str()], "another tenant started a command");
    assert_eq!(
        cmds["commands"][0]["state"], "running",
        "another tenant signalled it"
    );
    let (_, out) = call(
        &s,
        &alice,
        Method::GET,
        &format!("/v1/sandboxes/{sb}/commands/{cid}/output"),
        None,
    )
    .await;
    assert!(
        out.is_null() || !out.to_string().contains("cHduZWQ"),
        "stdin from another tenant reached it"
    );
    let (_, ls) = call(
        &s,
        &alice,
        Method::GET,
        &format!("/v1/sandboxes/{sb}/files/list?path=/tmp"),
        None,
    )
    .await;
    let names: BTreeSet<&str> = ls["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert!(names.contains("marker"), "{ls}");
    assert!(
        !names.iter().any(|n| n.contains("pwned")),
        "another tenant wrote files: {names:?}"
    );
    let (_, tpls) = call(&s, &alice, Method::GET, "/v1/templates", None).await;
    assert!(tpls["templates"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["name"] == tpl.as_str()));
    let (_, theirs) = call(&s, &mallory, Method::GET, "/v1/templates", None).await;
    assert!(!theirs.to_string().contains(&tpl) && !theirs.to_string().contains("stolen"));
    let (_, theirs) = call(&s, &mallory, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(theirs["sandboxes"], json!([]));

    call(
        &s,
        &alice,
        Method::POST,
        &format!("/v1/sandboxes/{sb}/commands/{cid}/signal"),
        Some(Body::Json(json!({"signal": "KILL"}))),
    )
    .await;
    destroy_as(&s, &alice, &sb).await;
    let (st, _) = call(
        &s,
        &alice,
        Method::DELETE,
        &format!("/v1/templates/{tpl}"),
        None,
    )
    .await;
    assert_eq!(st, 204);
    eprintln!("hostile: ids_in_every_spelling passed on gvisor");
}

/// Revoking a key ends, within seconds, every stream it opened: server-sent events,
/// followed command output, a followed build log and an attached WebSocket.
#[tokio::test]
async fn a_revoked_key_loses_its_open_streams() {
    let s = TestServer::start().await;
    if !s.runtime_available("gvisor").await {
        return;
    }
    let key = s.new_key("leaver");
    let sb = sandbox_as(&s, &key, json!({"template": "busybox"})).await;
    let (st, cmd) = call(
        &s,
        &key,
        Method::POST,
        &format!("/v1/sandboxes/{sb}/commands"),
        Some(Body::Json(
            json!({"shell": "while true; do echo tick; sleep 1; done", "stdin": true}),
        )),
    )
    .await;
    assert_eq!(st, 201, "{cmd}");
    let cid = cmd["id"].as_str().unwrap().to_string();
    let (st, build) = call(
        &s,
        &key,
        Method::POST,
        "/v1/templates",
        Some(Body::Json(
            json!({"name": format!("leaver-{}", &sb[3..11]), "base": "busybox",
            "steps": [{"run": "echo building; sleep 20"}]}),
        )),
    )
    .await;
    assert_eq!(st, 202, "{build}");
    let build_op = build["id"].as_str().unwrap().to_string();

    // Each stream as a stream of "something arrived" (or an error).
    let c = s.client_as(&key);
    let events = c
        .events(&EventsQuery {
            after: Some(0),
            ..Default::default()
        })
        .await
        .expect("events");
    let follow = OutputQuery {
        follow: true,
        ..Default::default()
    };
    let output = c.command_output(&sb, &cid, &follow).await.expect("output");
    let log = c.build_log(&build_op, true).await.expect("build log");
    let mut streams: Vec<(&str, BoxStream<'static, Result<(), ClientError>>)> = vec![
        ("events", events.map(|r| r.map(drop)).boxed()),
        ("output", output.map(|r| r.map(drop)).boxed()),
        ("build log", log.map(|r| r.map(drop)).boxed()),
    ];
    // Each stream is live: it delivers something before the revocation.
    for (what, st) in streams.iter_mut() {
        let first = tokio::time::timeout(Duration::from_secs(60), st.next()).await;
        assert!(matches!(first, Ok(Some(Ok(_)))), "{what} delivered nothing");
    }
    let mut ws = c.attach(&sb, &cid, None).await.expect("attach");
    assert!(matches!(
        tokio::time::timeout(Duration::from_secs(30), ws.next()).await,
        Ok(Some(Ok(_)))
    ));

    revoke_keys(&s, "leaver");
    // Within seconds every stream ends (an error or the end of the body).
    let deadline = Duration::from_secs(15);
    for (what, mut st) in streams {
        let ended = tokio::time::timeout(deadline, async {
            loop {
                match st.next().await {
                    Some(Ok(_)) => continue,
                    _ => return,
                }
            }
        })
        .await;
        assert!(
            ended.is_ok(),
            "the {what} stream stayed open after its key was revoked"
        );
    }
    let ended = tokio::time::timeout(deadline, async {
        loop {
            match ws.next().await {
                Some(Ok(m)) if !m.is_close() => continue,
                _ => return,
            }
        }
    })
    .await;
    assert!(
        ended.is_ok(),
        "the attach WebSocket stayed open after its key was revoked"
    );
    // And nothing new can be opened with it.
    let (st, _) = call(&s, &key, Method::GET, "/v1/events", None).await;
    assert_eq!(st, 401);

    // Clean up with a new key of the same tenant.
    let key = s.new_key("leaver");
    let built = wait_op(&s, &key, &build_op).await;
    destroy_as(&s, &key, &sb).await;
    if let Some(name) = built["template"].as_str() {
        call(
            &s,
            &key,
            Method::DELETE,
            &format!("/v1/templates/{name}"),
            None,
        )
        .await;
    }
    eprintln!("hostile: revoked_key_streams passed on gvisor");
}

/// Slow clients (issue 11, point 5): a flood of connections that send half a request
/// head is capped per address and dropped after the head timeout; a body that stalls
/// ends its request; the server keeps answering and holds no descriptor for any of them
/// afterwards. The server also raised its open-file limit at start.
#[tokio::test]
async fn slow_clients_are_capped_and_dropped() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = TestServer::start_with(&[
        "--header-read-timeout-seconds",
        "2",
        "--body-idle-timeout-seconds",
        "2",
        "--max-connections-per-ip",
        "100",
    ])
    .await;
    let pid = s.pid().expect("server pid");
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files");
    let nums: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    let (soft, hard) = (nums[0], nums[1]);
    assert!(
        soft >= 65_536 || soft == hard,
        "the server did not raise RLIMIT_NOFILE: {line}"
    );
    let fds = || {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .count()
    };
    let baseline = fds();

    let addr = s.url.trim_start_matches("http://").to_string();
    let started = std::time::Instant::now();
    let mut conns = Vec::new();
    for _ in 0..1500 {
        let mut c = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        let _ = c
            .write_all(b"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: Bea")
            .await;
        conns.push(c);
    }
    // While they are all open, the server holds at most its per-address limit of them.
    let held = fds().saturating_sub(baseline);
    assert!(
        held <= 100 + 8,
        "the server holds {held} descriptors for one address"
    );
    // Every one of them is answered or closed by the server, within a bound: those past
    // the address's limit at once with a 429, the others when their head times out.
    let mut refused = 0;
    let mut dropped = 0;
    for mut c in conns {
        let mut buf = Vec::new();
        let r = tokio::time::timeout(Duration::from_secs(60), c.read_to_end(&mut buf)).await;
        assert!(r.is_ok(), "a half-open connection was held for a minute");
        if String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 429") {
            refused += 1;
        } else {
            dropped += 1;
        }
    }
    eprintln!(
        "hostile: 1500 half heads: {held} held at once, {refused} refused at once (429), \
         {dropped} dropped after the head timeout, all gone after {:?}",
        started.elapsed()
    );
    assert!(
        refused > 0 && dropped > 0,
        "{refused} refused, {dropped} dropped"
    );

    // A body that stalls mid-way ends its request.
    let mut c = tokio::net::TcpStream::connect(&addr).await.unwrap();
    c.write_all(
        format!(
            "POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\
             Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{{\"template\":",
            super::common::TOKEN
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(60), c.read_to_end(&mut buf)).await;
    assert!(r.is_ok(), "a stalled body held its request for a minute");
    let text = String::from_utf8_lossy(&buf);
    assert!(!text.starts_with("HTTP/1.1 2"), "{text}");

    // The server still answers, and holds no more descriptors than before.
    s.client().healthz().await.expect("healthz");
    let mut now = fds();
    for _ in 0..50 {
        if now <= baseline + 8 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        now = fds();
    }
    assert!(
        now <= baseline + 8,
        "descriptors: {baseline} before, {now} after"
    );
    eprintln!("hostile: slow_clients passed");
}

/// Egress (issue 11, point 9): every cloud's metadata and wire-server addresses are
/// refused, by address or by a name that resolves to them, and a refusal never tells
/// the tenant what a name resolved to on the host. Nothing is created.
#[tokio::test]
async fn cloud_metadata_addresses_are_refused_without_echoing_names() {
    let hosts = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        hosts.path(),
        "169.254.169.254 imds.test\n168.63.129.16 wire.test\n100.100.100.200 ali.test\n\
         10.20.30.40 inner.test\n",
    )
    .unwrap();
    let s = TestServer::start_with_env(
        &[],
        &[("SPACE_EGRESS_HOSTS_FILE", hosts.path().to_str().unwrap())],
    )
    .await;
    let names = ["imds.test", "wire.test", "ali.test", "inner.test"];
    let addresses = [
        "169.254.169.254",
        "169.254.170.2",
        "168.63.129.16",
        "168.63.129.16:80",
        "168.63.0.0/16",
        "100.100.100.200",
        "fd00:ec2::254",
        "[fd00:ec2::254]:80",
        "fd20:ce::254",
        "::ffff:169.254.169.254",
    ];
    let mut refusals: BTreeSet<String> = BTreeSet::new();
    for entry in names.iter().chain(addresses.iter()) {
        let (st, v) = s
            .post(
                "/v1/sandboxes",
                json!({"template": "busybox", "network": {"mode": "egress", "allow": [entry]}}),
            )
            .await;
        assert_eq!(st, 400, "{entry}: {v}");
        let msg = v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(msg.contains("never reachable"), "{entry}: {msg}");
        if names.contains(entry) {
            for leaked in ["169.254", "168.63", "100.100", "10.20"] {
                assert!(!msg.contains(leaked), "{entry}: the refusal says {msg:?}");
            }
            // Nothing tells one refused name from another: not even which range.
            refusals.insert(msg.replace(entry, "NAME"));
        }
    }
    assert_eq!(refusals.len(), 1, "{refusals:?}");
    let (_, list) = s.get("/v1/sandboxes").await;
    assert_eq!(
        list["sandboxes"],
        json!([]),
        "a refused create left a sandbox"
    );
    eprintln!("hostile: cloud_metadata_egress passed");
}

/// How long a let-go slot may take to come back before the test calls it lost.
const SLOT_BACK_WITHIN: Duration = Duration::from_secs(60);

/// Per-tenant caps (issue 11, point 5): open streams, template builds and large bodies
/// in flight are each bounded per tenant (429 with the reason), other tenants are not
/// affected, and a slot comes back when it is let go.
#[tokio::test]
async fn a_tenant_cannot_hold_more_than_its_share_open() {
    use tokio::io::AsyncWriteExt;
    let s = TestServer::start_with(&[
        "--tenant-max-streams",
        "3",
        "--tenant-max-builds",
        "1",
        "--tenant-max-uploads",
        "1",
    ])
    .await;
    if !s.runtime_available("gvisor").await {
        return;
    }
    let (greedy, other) = (s.new_key("greedy"), s.new_key("other"));
    let (greedy_c, other_c) = (s.client_as(&greedy), s.client_as(&other));
    let open = |c: &space_client::Client| {
        let c = c.clone();
        async move { c.events(&EventsQuery::default()).await }
    };
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(open(&greedy_c).await.unwrap());
    }
    let e = open(&greedy_c).await.err().expect("a fourth stream");
    assert_eq!(e.status(), Some(429), "{e}");
    let msg = &e.api_error().expect("an error body").message;
    assert!(msg.contains("limit is 3"), "{e}");
    // Another tenant has its own streams; a closed stream gives its slot back.
    drop(open(&other_c).await.unwrap());
    drop(held.pop());
    // The server notices the closed stream on its own time: a loaded machine (CI) may
    // take a few seconds.
    let mut ok = false;
    let since = std::time::Instant::now();
    while since.elapsed() < SLOT_BACK_WITHIN {
        match open(&greedy_c).await {
            Ok(stream) => {
                held.push(stream);
                ok = true;
                break;
            }
            Err(e) => assert_eq!(e.status(), Some(429), "{e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok, "a closed stream never gave its slot back");
    drop(held);

    // One build at a time. The names are this run's own: templates live in the test
    // cache that every test server shares.
    let (greedy_a, greedy_b, other_a) = (
        format!("greedy-a-{}", std::process::id()),
        format!("greedy-b-{}", std::process::id()),
        format!("other-a-{}", std::process::id()),
    );
    // The step is this run's own too: a cached layer would end the build at once.
    let step = format!("sleep 15 # {}", std::process::id());
    let recipe =
        |name: &str| json!({"name": name, "base": "busybox", "steps": [{"run": step.clone()}]});
    let (st, b1) = call(
        &s,
        &greedy,
        Method::POST,
        "/v1/templates",
        Some(Body::Json(recipe(&greedy_a))),
    )
    .await;
    assert_eq!(st, 202, "{b1}");
    let (st, v) = call(
        &s,
        &greedy,
        Method::POST,
        "/v1/templates",
        Some(Body::Json(recipe(&greedy_b))),
    )
    .await;
    assert_eq!(st, 429, "{v}");
    let (st, b3) = call(
        &s,
        &other,
        Method::POST,
        "/v1/templates",
        Some(Body::Json(recipe(&other_a))),
    )
    .await;
    assert_eq!(st, 202, "{b3}");
    // The refused build claimed nothing: the name is still free.
    let (_, tpls) = call(&s, &greedy, Method::GET, "/v1/templates", None).await;
    assert!(!tpls.to_string().contains(&greedy_b));

    // One large body at a time: an upload whose body trickles holds the slot.
    let sb = sandbox_as(&s, &greedy, json!({"template": "busybox"})).await;
    let addr = s.url.trim_start_matches("http://").to_string();
    let slow_head = format!(
        "PUT /v1/sandboxes/{sb}/files?path=/tmp/slow HTTP/1.1\r\nHost: x\r\n\
         Authorization: Bearer {greedy}\r\nContent-Length: 1000\r\n\r\nabc"
    );
    // A refused upload is answered once its body has been read (up to 10 s of
    // draining): a slow one that lost the race to a fast one says so only then.
    let open_slow = || async {
        let mut slow = tokio::net::TcpStream::connect(&addr).await.unwrap();
        slow.write_all(slow_head.as_bytes()).await.unwrap();
        // Time for it to reach the server and take the slot before the fast one asks.
        tokio::time::sleep(Duration::from_millis(500)).await;
        slow
    };
    let mut slow = open_slow().await;
    let mut refused = false;
    let since = std::time::Instant::now();
    while since.elapsed() < SLOT_BACK_WITHIN * 2 {
        let (st, v) = call(
            &s,
            &greedy,
            Method::PUT,
            &format!("/v1/sandboxes/{sb}/files?path=/tmp/fast"),
            Some(Body::Raw(b"x".to_vec())),
        )
        .await;
        if st == 429 {
            assert!(
                v["error"]["message"].as_str().unwrap().contains("uploads"),
                "{v}"
            );
            refused = true;
            break;
        }
        // The slow upload had not reached the server yet, or the fast one held the
        // slot when it did: then the slow one is answered 429 (after the drain) and
        // holds nothing, and a new one tries again.
        assert_eq!(st, 201, "{v}");
        let mut answer = [0u8; 512];
        let answered = tokio::time::timeout(
            Duration::from_secs(15),
            tokio::io::AsyncReadExt::read(&mut slow, &mut answer),
        )
        .await;
        if let Ok(n) = answered {
            let n = n.unwrap_or(0);
            assert!(
                String::from_utf8_lossy(&answer[..n]).starts_with("HTTP/1.1 429"),
                "the slow upload was answered: {}",
                String::from_utf8_lossy(&answer[..n])
            );
            slow = open_slow().await;
        }
        // Not answered: it holds the slot now, and the next fast one is refused.
    }
    assert!(
        refused,
        "a second upload went through while the first held the slot"
    );
    slow.write_all(&[b'x'; 997]).await.unwrap();
    drop(slow);
    let mut ok = false;
    let since = std::time::Instant::now();
    while since.elapsed() < SLOT_BACK_WITHIN {
        let (st, _) = call(
            &s,
            &greedy,
            Method::PUT,
            &format!("/v1/sandboxes/{sb}/files?path=/tmp/fast"),
            Some(Body::Raw(b"x".to_vec())),
        )
        .await;
        if st == 201 {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok, "the upload slot never came back");
    for (key, b) in [(&greedy, &b1), (&other, &b3)] {
        wait_op(&s, key, b["id"].as_str().unwrap()).await;
    }
    destroy_as(&s, &greedy, &sb).await;
    for (key, name) in [(&greedy, &greedy_a), (&other, &other_a)] {
        call(
            &s,
            key,
            Method::DELETE,
            &format!("/v1/templates/{name}"),
            None,
        )
        .await;
    }
    eprintln!("hostile: per_tenant_caps passed on gvisor");
}
