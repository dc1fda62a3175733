//! `/v1/openapi.json` against the real server: a valid document, every documented
//! operation answered by a real route (not the "no such endpoint" fallback, not 405),
//! and the document as committed in `tests/snapshots/openapi.json`, so that an API
//! change shows up as a diff in review. `SPACE_UPDATE_SNAPSHOTS=1` rewrites the snapshot.
//! (That every route of the router is documented is the unit test in `api/openapi.rs`.)

mod common;

use common::TestServer;
use serde_json::Value;

/// A value of the right shape for a path parameter (well-formed ids, so the route's
/// own handler answers).
fn fill(path: &str) -> String {
    let mut out = String::new();
    let ops = path.starts_with("/v1/operations");
    for seg in path.split('/').skip(1) {
        out.push('/');
        out.push_str(match seg {
            "{id}" if ops => "op_aaaaaaaaaaaaaaaaaaaa",
            "{id}" => "sb_aaaaaaaaaaaaaaaaaaaa",
            "{cid}" => "cmd_aaaaaaaaaaaaaaaaaaaa",
            "{name}" => "no-such-template",
            s => s,
        });
    }
    out
}

#[tokio::test]
async fn document_is_served_and_every_operation_is_routed() {
    let s = TestServer::start().await;

    // Behind the bearer token like the rest of /v1.
    let anon = s
        .client()
        .http()
        .get(format!("{}/v1/openapi.json", s.url))
        .send()
        .await
        .expect("request");
    assert_eq!(anon.status(), 401);

    let resp = s
        .req(reqwest::Method::GET, "/v1/openapi.json")
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("application/json")
    );
    let doc: Value = resp.json().await.expect("the document is JSON");
    for key in ["openapi", "info", "paths", "components", "security", "tags"] {
        assert!(doc.get(key).is_some(), "no top-level {key}");
    }
    assert_eq!(doc["openapi"], "3.1.0");
    assert_eq!(
        doc["components"]["securitySchemes"]["bearer"]["type"],
        "http"
    );
    let paths = doc["paths"].as_object().expect("paths");
    assert!(paths.len() >= 25, "only {} paths", paths.len());

    let mut checked = 0;
    for (path, item) in paths {
        for (method, op) in item.as_object().expect("path item") {
            let url = fill(path);
            let m = reqwest::Method::from_bytes(method.to_uppercase().as_bytes()).expect("method");
            // Query parameters marked required get a harmless value.
            let required_path = op["parameters"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|p| p["in"] == "query" && p["required"] == true && p["name"] == "path");
            let url = if required_path {
                format!("{url}?path=/tmp")
            } else {
                url
            };
            let mut rb = s
                .req(m.clone(), &url)
                .timeout(std::time::Duration::from_secs(30));
            if op.get("requestBody").is_some() {
                rb = rb.header("content-type", "application/json").body("{}");
            }
            let resp = rb
                .send()
                .await
                .unwrap_or_else(|e| panic!("{method} {url}: {e}"));
            let status = resp.status().as_u16();
            // The event stream never ends: headers are enough.
            let body = if path == "/v1/events" {
                String::new()
            } else {
                resp.text().await.unwrap_or_default()
            };
            assert_ne!(
                status, 405,
                "{method} {path}: documented but the router has no such method"
            );
            assert!(
                !(status == 404 && body.contains("no such endpoint")),
                "{method} {path}: documented but not routed ({body})"
            );
            assert!(status < 500, "{method} {url}: {status} {body}");
            // Every status the server gave is one the document lists.
            let listed = op["responses"].as_object().expect("responses");
            assert!(
                listed.contains_key(&status.to_string()),
                "{method} {path}: answered {status}, the document lists {:?}",
                listed.keys().collect::<Vec<_>>()
            );
            checked += 1;
        }
    }
    assert!(checked >= 30, "checked only {checked} operations");

    // The committed snapshot, so that an API change is a visible diff.
    let snap_path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots/openapi.json");
    let pretty = serde_json::to_string_pretty(&doc).expect("pretty") + "\n";
    if std::env::var_os("SPACE_UPDATE_SNAPSHOTS").is_some() {
        std::fs::create_dir_all(snap_path.parent().expect("parent")).expect("mkdir");
        std::fs::write(&snap_path, &pretty).expect("write the snapshot");
    }
    let committed = std::fs::read_to_string(&snap_path).unwrap_or_default();
    let committed: Value = serde_json::from_str(&committed).unwrap_or(Value::Null);
    if committed != doc {
        let mut diff = Vec::new();
        json_diff("", &committed, &doc, &mut diff);
        panic!(
            "the OpenAPI document differs from {} in {} place(s):\n{}\n\
             If the API change is intended, run\n  SPACE_UPDATE_SNAPSHOTS=1 cargo test -p space --test openapi\n\
             and commit the snapshot.",
            snap_path.display(),
            diff.len(),
            diff.iter().take(20).cloned().collect::<Vec<_>>().join("\n")
        );
    }
}

/// Where two JSON values differ, as JSON pointers.
fn json_diff(at: &str, a: &Value, b: &Value, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for k in x.keys().chain(y.keys().filter(|k| !x.contains_key(*k))) {
                let p = format!("{at}/{}", k.replace('~', "~0").replace('/', "~1"));
                match (x.get(k), y.get(k)) {
                    (Some(u), Some(v)) => json_diff(&p, u, v, out),
                    (Some(_), None) => out.push(format!("  - {p} (removed)")),
                    (None, Some(_)) => out.push(format!("  + {p} (added)")),
                    (None, None) => {}
                }
            }
        }
        _ if a != b => out.push(format!(
            "  ~ {} : {} → {}",
            if at.is_empty() { "/" } else { at },
            short(a),
            short(b)
        )),
        _ => {}
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 80 {
        format!(
            "{}…",
            &s[..s.char_indices().nth(77).map_or(s.len(), |(i, _)| i)]
        )
    } else {
        s
    }
}
