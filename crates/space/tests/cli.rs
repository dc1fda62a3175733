//! The CLI against a real server: `space sandbox`, `space ops`, `space exec`.

mod common;

use std::process::Command;

use common::{TestServer, TOKEN};

fn space(s: &TestServer, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_space"))
        .args(args)
        .env("SPACE_URL", &s.url)
        .env("SPACE_TOKEN", TOKEN)
        .output()
        .expect("run space")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[tokio::test]
async fn cli_sandbox_ops_and_exec() {
    let s = TestServer::start().await;
    let out = space(
        &s,
        &[
            "sandbox",
            "create",
            "--template",
            "busybox",
            "--label",
            "who=cli",
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let sb = text(&out.stdout).trim().to_string();
    assert!(sb.starts_with("sb_"), "{sb}");

    let out = space(&s, &["sandbox", "ls", "--label", "who=cli"]);
    assert!(text(&out.stdout).contains(&sb));
    let out = space(&s, &["sandbox", "get", &sb]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["state"], "running");

    // exec streams stdout and stderr separately and exits with the command's code.
    let out = space(
        &s,
        &[
            "exec",
            &sb,
            "--",
            "sh",
            "-c",
            "echo hi; echo oops >&2; exit 7",
        ],
    );
    assert_eq!(out.status.code(), Some(7));
    assert_eq!(text(&out.stdout), "hi\n");
    assert_eq!(text(&out.stderr), "oops\n");
    let out = space(
        &s,
        &["exec", &sb, "--env", "X=1", "--", "sh", "-c", "echo $X"],
    );
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(text(&out.stdout), "1\n");
    // -i sends this process's stdin, end of input included.
    let mut child = Command::new(env!("CARGO_BIN_EXE_space"))
        .args(["exec", "-i", &sb, "--", "sh", "-c", "cat; echo after-eof"])
        .env("SPACE_URL", &s.url)
        .env("SPACE_TOKEN", TOKEN)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut input = child.stdin.take().unwrap();
        input.write_all(b"line one\nline two\n").unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(text(&out.stdout), "line one\nline two\nafter-eof\n");
    // Killed by a signal: 128 + signal, like a shell.
    let out = space(&s, &["exec", &sb, "--", "sh", "-c", "kill -9 $$"]);
    assert_eq!(out.status.code(), Some(137));

    // ops get / wait on the create operation.
    let (_, ops) = s.get(&format!("/v1/operations?sandbox_id={sb}")).await;
    let op = ops["operations"][0]["id"].as_str().unwrap().to_string();
    let out = space(&s, &["ops", "get", &op]);
    assert!(text(&out.stdout).contains("succeeded"));
    let out = space(&s, &["ops", "wait", &op]);
    assert!(out.status.success());

    // Lifecycle verbs wait for their operation and say where the sandbox ended up.
    for (verb, state) in [
        ("suspend", "suspended"),
        ("resume", "running"),
        ("pause", "paused"),
        ("resume", "running"),
    ] {
        let out = space(&s, &["sandbox", verb, &sb]);
        assert!(out.status.success(), "{verb}: {}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains(&format!("is {state}")),
            "{}",
            text(&out.stderr)
        );
    }
    let out = space(&s, &["sandbox", "keepalive", &sb, "--ttl", "600"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["expires_at"].is_string(), "{v}");
    let out = space(&s, &["sandbox", "resume", &sb]);
    assert!(
        !out.status.success(),
        "resuming a running sandbox must fail"
    );
    assert!(
        text(&out.stderr).contains("cannot resume"),
        "{}",
        text(&out.stderr)
    );

    // `space events` replays history as JSON lines.
    let mut events = Command::new(env!("CARGO_BIN_EXE_space"))
        .args(["events", "--after", "0"])
        .env("SPACE_URL", &s.url)
        .env("SPACE_TOKEN", TOKEN)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = events.stdout.take().unwrap();
    let wanted = sb.clone();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout).lines() {
            let v: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
            if v["object"]["id"] == wanted.as_str() && v["object"]["state"] == "suspended" {
                return true;
            }
        }
        false
    });
    let seen = tokio::task::spawn_blocking(move || reader.join().unwrap());
    let seen = tokio::time::timeout(std::time::Duration::from_secs(20), seen).await;
    let _ = events.kill();
    let _ = events.wait();
    assert!(
        matches!(seen, Ok(Ok(true))),
        "space events did not show the suspend"
    );

    let out = space(&s, &["sandbox", "rm", &sb]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    s.assert_nothing_left(&sb);

    // Errors are readable and fail the command.
    let out = space(&s, &["sandbox", "get", "sb_aaaaaaaaaaaaaaaaaaaa"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("no sandbox"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn dev_mode_refuses_a_non_loopback_address() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_space"))
        .args(["serve", "--dev", "--listen", "0.0.0.0:0", "--data-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("loopback"),
        "{}",
        text(&out.stderr)
    );
    // Without --dev a real token is required.
    let out = Command::new(env!("CARGO_BIN_EXE_space"))
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path())
        .env_remove("SPACE_API_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("SPACE_API_TOKEN"),
        "{}",
        text(&out.stderr)
    );
}
