//! The MCP server (`/mcp` and `space mcp`) through the official Python MCP client,
//! pinned and installed by `scripts/test-clients.sh`: every tool, its errors,
//! another tenant's ids, on both transports (tests/mcp/mcp_client.py).

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::TestServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_tool_over_stdio_and_http_with_the_official_client() {
    let s = match std::env::var("SPACE_TEST_RUNTIME") {
        Ok(rt) => TestServer::start_with(&["--default-runtime", &rt]).await,
        Err(_) => TestServer::start().await,
    };
    let (a, b) = (s.new_key("mcp-a"), s.new_key("mcp-b"));
    let clients = std::env::var_os("SPACE_TEST_CLIENTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/test-clients")
        });
    let python = clients.join("venv/bin/python");
    assert!(
        python.exists(),
        "no {}: run scripts/test-clients.sh (scripts/test.sh does)",
        python.display()
    );
    let out = Command::new(python)
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/mcp/mcp_client.py"))
        .env("SPACE_URL", &s.url)
        .env("SPACE_TOKEN", &a)
        .env("SPACE_OTHER_TOKEN", &b)
        .env("SPACE_BIN", env!("CARGO_BIN_EXE_space"))
        .env("SPACE_TEMPLATE", "busybox")
        .output()
        .expect("run the MCP client");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(
        out.status.success(),
        "the MCP client failed:\n{text}\n--- server log:\n{}",
        s.log()
    );
    // Everything it made is gone, and left nothing behind.
    for key in [&a, &b] {
        let c = s.client_as(key);
        let (status, v) = common::call_with(&c, reqwest::Method::GET, "/v1/sandboxes", None).await;
        assert_eq!(status, 200, "{v}");
        for sb in v["sandboxes"].as_array().unwrap() {
            let id = sb["id"].as_str().unwrap();
            assert_eq!(sb["state"], "destroyed", "{id} was left {}", sb["state"]);
            s.assert_nothing_left(id);
        }
    }
}
