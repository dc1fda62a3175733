//! `space mcp`: the MCP server over stdio, for agents that start their tools as
//! subprocesses. It carries each JSON-RPC message from stdin to the server's `/mcp`
//! (rmcp's streamable HTTP server, see `mcp.rs`) with the key it was given
//! (`SPACE_URL`, `SPACE_TOKEN`), and the answers back to stdout, one per line. The
//! tools run in the server, through the service, with that key's tenant; this
//! process holds no state and interprets nothing but the transport.

use std::sync::Arc;

use anyhow::Context;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, Mutex};

/// The longest message accepted from stdin (MCP's own messages are small; arguments
/// of `write_file` are at most 8 MiB before base64).
const MAX_LINE: usize = 16 << 20;

pub async fn run() -> anyhow::Result<i32> {
    let client = space_client::Client::from_env()?;
    let url = format!("{}/mcp", client.base_url());
    let token = std::env::var("SPACE_TOKEN").unwrap_or_else(|_| space_client::DEV_TOKEN.into());
    let http = client.http().clone();
    // The protocol version the client and server agreed on, sent on every later
    // request as the streamable HTTP transport requires.
    let version: Arc<Mutex<Option<String>>> = Arc::default();
    let (out_tx, mut out_rx) = mpsc::channel::<Value>(64);
    let writer = tokio::spawn(async move {
        let mut stdout = tokio::io::stdout();
        while let Some(v) = out_rx.recv().await {
            let mut line = serde_json::to_vec(&v).unwrap_or_default();
            line.push(b'\n');
            if stdout.write_all(&line).await.is_err() || stdout.flush().await.is_err() {
                break;
            }
        }
    });
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    let mut tasks = tokio::task::JoinSet::new();
    while let Some(line) = lines.next_line().await.context("reading stdin")? {
        if line.trim().is_empty() {
            continue;
        }
        if line.len() > MAX_LINE {
            tracing::warn!(
                len = line.len(),
                "dropped an MCP message over {MAX_LINE} bytes"
            );
            continue;
        }
        let msg: Value = match serde_json::from_str(&line) {
            Ok(v) => v,
            Err(e) => {
                let _ = out_tx
                    .send(serde_json::json!({"jsonrpc": "2.0", "id": null,
                        "error": {"code": -32700, "message": format!("parse error: {e}")}}))
                    .await;
                continue;
            }
        };
        let is_init = msg.get("method").and_then(Value::as_str) == Some("initialize");
        let (http, url, token, out, version) = (
            http.clone(),
            url.clone(),
            token.clone(),
            out_tx.clone(),
            version.clone(),
        );
        let send = async move {
            let id = msg.get("id").cloned();
            let answers = forward(&http, &url, &token, &version, &msg).await;
            match answers {
                Ok(list) => {
                    for a in list {
                        if is_init {
                            if let Some(v) =
                                a.pointer("/result/protocolVersion").and_then(Value::as_str)
                            {
                                *version.lock().await = Some(v.to_string());
                            }
                        }
                        let _ = out.send(a).await;
                    }
                }
                Err(e) => {
                    if let Some(id) = id {
                        let _ = out
                            .send(serde_json::json!({"jsonrpc": "2.0", "id": id,
                                "error": {"code": -32603, "message": format!("{e:#}")}}))
                            .await;
                    }
                }
            }
        };
        // The initialize exchange comes before everything else; the rest run side by side
        // (a long tool call does not hold up a cancellation or a ping).
        if is_init {
            send.await;
        } else {
            tasks.spawn(send);
        }
    }
    while tasks.join_next().await.is_some() {}
    drop(out_tx);
    let _ = writer.await;
    Ok(0)
}

/// Posts one message to `/mcp`; the messages of its answer (none for a notification).
async fn forward(
    http: &reqwest::Client,
    url: &str,
    token: &str,
    version: &Mutex<Option<String>>,
    msg: &Value,
) -> anyhow::Result<Vec<Value>> {
    let mut req = http
        .post(url)
        .bearer_auth(token)
        .header("accept", "application/json, text/event-stream")
        .json(msg);
    if let Some(v) = version.lock().await.as_deref() {
        req = req.header("mcp-protocol-version", v);
    }
    let resp = req.send().await.with_context(|| format!("POST {url}"))?;
    let status = resp.status();
    let ct = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let body = resp.bytes().await.context("reading the answer")?;
    if status == reqwest::StatusCode::ACCEPTED || body.is_empty() {
        return Ok(Vec::new());
    }
    if !status.is_success() {
        anyhow::bail!(
            "{url} answered {status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(500)])
        );
    }
    if ct.starts_with("text/event-stream") {
        // SSE: each event's `data:` lines hold one JSON-RPC message.
        let text = String::from_utf8_lossy(&body);
        let mut out = Vec::new();
        for event in text.split("\n\n") {
            let data: String = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(str::trim_start)
                .collect::<Vec<_>>()
                .join("\n");
            if let Ok(v) = serde_json::from_str::<Value>(&data) {
                out.push(v);
            }
        }
        return Ok(out);
    }
    match serde_json::from_slice::<Value>(&body).context("the answer is not JSON")? {
        Value::Array(list) => Ok(list),
        v => Ok(vec![v]),
    }
}
