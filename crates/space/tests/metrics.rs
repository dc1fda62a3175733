//! `GET /metrics` (Prometheus text, the server's token only) moves when things happen,
//! and `--log-format json` writes one JSON object per log line. On gVisor.

mod common;

use std::collections::HashMap;

use common::{call_with, TestServer};
use reqwest::Method;
use serde_json::{json, Value};

/// Every sample of a scrape: `name{labels}` → value.
async fn scrape(s: &TestServer) -> HashMap<String, f64> {
    let resp = s
        .req(Method::GET, "/metrics")
        .send()
        .await
        .expect("GET /metrics");
    assert_eq!(resp.status(), 200);
    let ctype = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    assert!(ctype.starts_with("text/plain; version=0.0.4"), "{ctype}");
    let text = resp.text().await.unwrap();
    // Series are by route pattern: no id ever becomes a label.
    assert!(!text.contains("sb_"), "an id in a label:\n{text}");
    let mut samples = HashMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line}"));
        let v: f64 = value.parse().unwrap_or_else(|_| panic!("{line}"));
        samples.insert(series.to_string(), v);
    }
    for name in [
        "space_agent_connections_total",
        "space_agent_reconnects_total",
        "space_commands_started_total",
        "space_commands_running",
        "space_output_bytes_total{stream=\"stdout\"}",
        "space_streamed_bytes_total{what=\"output\"}",
        "space_streamed_bytes_total{what=\"download\"}",
    ] {
        assert!(samples.contains_key(name), "no {name} in\n{text}");
    }
    samples
}

fn get(m: &HashMap<String, f64>, series: &str) -> f64 {
    m.get(series).copied().unwrap_or(0.0)
}

/// How much `series` grew from `a` to `b`.
fn grew(a: &HashMap<String, f64>, b: &HashMap<String, f64>, series: &str) -> f64 {
    get(b, series) - get(a, series)
}

#[tokio::test]
async fn metrics_move_when_things_happen() {
    let s = TestServer::start_with(&["--log-format", "json"]).await;
    if !s.runtime_available("gvisor").await {
        return;
    }
    // The operator's only.
    let key = s.new_key("tenant-a");
    let (st, v) = call_with(&s.client_as(&key), Method::GET, "/metrics", None).await;
    assert_eq!(st, 403, "{v}");
    let st = reqwest::Client::new()
        .get(format!("{}/metrics", s.url))
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(st, 401);

    let before = scrape(&s).await;
    let sb = s
        .create_with(json!({"template": "busybox", "runtime": "gvisor"}))
        .await;
    let cmd = s
        .sh(&sb, "echo hello; echo oops >&2; echo data > /tmp/f")
        .await;
    assert_eq!(cmd["result"]["exit_code"], 0, "{cmd}");
    let cid = cmd["id"].as_str().unwrap();
    let (st, _) = s
        .get(&format!("/v1/sandboxes/{sb}/commands/{cid}/output"))
        .await;
    assert_eq!(st, 200);
    let body = s
        .req(
            Method::GET,
            &format!("/v1/sandboxes/{sb}/files?path=/tmp/f"),
        )
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(&body[..], b"data\n");
    // The E2B and MCP front doors are timed by their routes too.
    let http = reqwest::Client::new();
    let e2b = http
        .get(format!("{}/sandboxes", s.url))
        .header("X-API-Key", &key)
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(e2b, 200);
    let mcp = http
        .post(format!("{}/mcp", s.url))
        .bearer_auth(&key)
        .header("Accept", "application/json, text/event-stream")
        .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "ping"}))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16();
    let after = scrape(&s).await;
    let e2b_list =
        "space_http_request_duration_seconds_count{method=\"GET\",route=\"/sandboxes\",status=\"200\"}";
    assert_eq!(grew(&before, &after, e2b_list), 1.0, "{e2b_list}");
    let mcp_calls: f64 = after
        .iter()
        .filter(|(k, _)| {
            k.starts_with("space_http_request_duration_seconds_count{method=\"POST\",route=\"/mcp")
                && k.ends_with(&format!("status=\"{mcp}\"}}"))
        })
        .map(|(k, v)| v - before.get(k).copied().unwrap_or(0.0))
        .sum();
    assert_eq!(mcp_calls, 1.0, "POST /mcp ({mcp}) timed once");

    let post = "space_http_request_duration_seconds_count{method=\"POST\",route=\"/v1/sandboxes\",status=\"202\"}";
    assert!(grew(&before, &after, post) >= 1.0, "{post}");
    let get_sb = "space_http_request_duration_seconds_count{method=\"GET\",route=\"/v1/sandboxes/:id/commands/:cid/output\",status=\"200\"}";
    assert_eq!(grew(&before, &after, get_sb), 1.0, "{get_sb}");
    let bucket = "space_http_request_duration_seconds_bucket{method=\"POST\",route=\"/v1/sandboxes\",status=\"202\",le=\"+Inf\"}";
    assert_eq!(get(&after, bucket), get(&after, post));
    let created = "space_operation_duration_seconds_count{kind=\"create\",outcome=\"succeeded\"}";
    assert_eq!(grew(&before, &after, created), 1.0, "{created}");
    assert!(
        get(
            &after,
            "space_operation_duration_seconds_sum{kind=\"create\",outcome=\"succeeded\"}"
        ) > 0.0
    );
    let running = "space_sandboxes{state=\"running\",runtime=\"gvisor\",pooled=\"false\"}";
    assert_eq!(get(&after, running), 1.0, "{running}");
    assert_eq!(grew(&before, &after, "space_commands_started_total"), 1.0);
    assert_eq!(get(&after, "space_commands_running"), 0.0);
    assert!(grew(&before, &after, "space_agent_connections_total") >= 1.0);
    assert_eq!(
        grew(
            &before,
            &after,
            "space_output_bytes_total{stream=\"stdout\"}"
        ),
        6.0
    );
    assert_eq!(
        grew(
            &before,
            &after,
            "space_output_bytes_total{stream=\"stderr\"}"
        ),
        5.0
    );
    // The output read through the API (and once more inline, with wait:true: not a stream).
    assert_eq!(
        grew(
            &before,
            &after,
            "space_streamed_bytes_total{what=\"output\"}"
        ),
        11.0
    );
    assert_eq!(
        grew(
            &before,
            &after,
            "space_streamed_bytes_total{what=\"download\"}"
        ),
        5.0
    );

    // Streamed bytes are counted in the service, so the other front doors' reads count
    // too: MCP's read_output and read_file (no stream of their own in its answers).
    for (tool, args) in [
        ("read_output", json!({"command_id": cid})),
        ("read_file", json!({"sandbox_id": sb, "path": "/tmp/f"})),
    ] {
        let answer: Value = http
            .post(format!("{}/mcp", s.url))
            .bearer_auth(common::TOKEN)
            .header("Accept", "application/json, text/event-stream")
            .json(&json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                          "params": {"name": tool, "arguments": args}}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert!(
            answer["result"].is_object() && answer["result"]["isError"] != true,
            "{tool}: {answer}"
        );
    }
    let after_mcp = scrape(&s).await;
    for (series, bytes) in [
        ("space_streamed_bytes_total{what=\"output\"}", 11.0),
        ("space_streamed_bytes_total{what=\"download\"}", 5.0),
    ] {
        assert_eq!(
            grew(&after, &after_mcp, series),
            bytes,
            "{series} through MCP"
        );
    }

    // A suspend and resume: the restored agent dials the same listener again.
    for action in ["suspend", "resume"] {
        let (st, op) = s
            .post(&format!("/v1/sandboxes/{sb}/{action}"), json!({}))
            .await;
        assert_eq!(st, 202, "{op}");
        let op = s.wait_op(op["id"].as_str().unwrap()).await;
        assert_eq!(op["status"], "succeeded", "{op}");
    }
    // A long-running command shows as running.
    let (st, long) = s
        .post(
            &format!("/v1/sandboxes/{sb}/commands"),
            json!({"argv": ["sleep", "30"]}),
        )
        .await;
    assert_eq!(st, 201, "{long}");
    // A pool shows its size, even an empty one.
    let (st, pool) = s
        .call(
            Method::PUT,
            "/v1/pools",
            Some(json!({"template": "busybox", "size": 0})),
        )
        .await;
    assert_eq!(st, 200, "{pool}");
    let later = scrape(&s).await;
    assert!(grew(&after, &later, "space_agent_reconnects_total") >= 1.0);
    assert_eq!(get(&later, "space_commands_running"), 1.0);
    for kind in ["suspend", "resume"] {
        let series = format!(
            "space_operation_duration_seconds_count{{kind=\"{kind}\",outcome=\"succeeded\"}}"
        );
        assert_eq!(grew(&after, &later, &series), 1.0, "{series}");
    }
    let size = format!(
        "space_pool_size{{pool=\"{}\",template=\"busybox\"}}",
        pool["id"].as_str().unwrap()
    );
    assert_eq!(later.get(&size), Some(&0.0), "{size}");
    s.destroy(&sb).await;
    let last = scrape(&s).await;
    assert_eq!(
        grew(
            &later,
            &last,
            "space_operation_duration_seconds_count{kind=\"destroy\",outcome=\"succeeded\"}"
        ),
        1.0
    );
    assert_eq!(get(&last, running), 0.0);
    assert_eq!(get(&last, "space_commands_running"), 0.0);

    // Every log line is one JSON object; request lines carry their fields.
    let log = s.log();
    let mut requests = 0;
    for line in log.lines().filter(|l| l.starts_with('{')) {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(
            v["level"].is_string() && v["timestamp"].is_string(),
            "{line}"
        );
        if v["message"] == "request" {
            assert!(v["status"].is_u64() && v["path"].is_string(), "{line}");
            requests += 1;
        }
    }
    assert!(requests > 5, "{log}");
    // Text lines start with their timestamp; none is left.
    assert!(
        !log.lines().any(|l| l.starts_with("20")),
        "a log line that is not JSON:\n{log}"
    );
}
