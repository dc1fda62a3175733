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
            "--runtime",
            "gvisor",
            "--disk-mib",
            "256",
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

/// Text on the tmux pane.
fn pane(session: &str) -> String {
    let out = Command::new("tmux")
        .args(["capture-pane", "-p", "-t", session])
        .output()
        .unwrap();
    text(&out.stdout)
}

/// Waits until the pane shows `want`.
async fn pane_shows(session: &str, want: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !pane(session).contains(want) {
        assert!(
            std::time::Instant::now() < deadline,
            "pane never showed {want:?}:\n{}",
            pane(session)
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Waits until the pane's last non-empty line is `want` (trailing spaces aside).
async fn last_line_is(session: &str, want: &str) {
    last_line_is_one_of(session, &[want]).await;
}

/// Waits until the pane's last non-empty line is one of `wants` (trailing spaces aside).
async fn last_line_is_one_of(session: &str, wants: &[&str]) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let p = pane(session);
        let last = p.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
        if wants.contains(&last.trim_end()) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the pane's last line never became one of {wants:?}:\n{p}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

fn keys(session: &str, keys: &[&str]) {
    let st = Command::new("tmux")
        .args(["send-keys", "-t", session])
        .args(keys)
        .status()
        .unwrap();
    assert!(st.success());
}

/// The recorded output of the sandbox's `sh` command, escaped: what the terminal was sent,
/// to tell a drawing quirk from lost bytes when a pane looks wrong.
async fn printed(s: &TestServer, sb: &str) -> String {
    let (_, list) = s.get(&format!("/v1/sandboxes/{sb}/commands")).await;
    let Some(id) = list["commands"].as_array().and_then(|all| {
        all.iter()
            .find(|c| c["argv"] == serde_json::json!(["sh"]))
            .and_then(|c| c["id"].as_str())
    }) else {
        return format!("no sh command in {list}");
    };
    let (chunks, _) = s.output(sb, id, Default::default()).await;
    format!("{:?}", text(&common::decode(&chunks, None)))
}

/// [`pane_shows`], with what the sandbox's terminal printed when it fails.
async fn shows(s: &TestServer, sb: &str, session: &str, want: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !pane(session).contains(want) {
        if std::time::Instant::now() > deadline {
            panic!(
                "pane never showed {want:?}:\n{}\n---- what the terminal in the sandbox printed ----\n{}",
                pane(session),
                printed(s, sb).await
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn exec_tty_behaves_like_ssh() {
    let s = TestServer::start().await;
    let sb = s.create("busybox").await;
    let session = format!("space-test-{}", std::process::id());
    let exit_file = s.data_dir().join("tty-exit");
    let script = format!(
        "SPACE_URL={} SPACE_TOKEN={TOKEN} {} exec -t {sb} -- sh; echo $? > {}",
        s.url,
        env!("CARGO_BIN_EXE_space"),
        exit_file.display()
    );
    let st = Command::new("tmux")
        .args([
            "new-session",
            "-d",
            "-s",
            &session,
            "-x",
            "100",
            "-y",
            "30",
            &script,
        ])
        .status()
        .unwrap();
    assert!(st.success());
    keys(&session, &["stty size", "Enter"]);
    pane_shows(&session, "30 100").await;
    // Ctrl-C reaches the program in the sandbox, and the shell survives it.
    keys(&session, &["sleep 300", "Enter"]);
    // ^C typed before the shell started `sleep` would just be input; wait for it.
    let running =
        "for i in $(seq 1 200); do ps | grep -q '[s]leep 300' && exit 0; sleep 0.05; done; exit 1";
    assert_eq!(s.sh(&sb, running).await["result"]["exit_code"], 0);
    keys(&session, &["C-c"]);
    // Each line is typed once the shell shows its prompt again: busybox's line editor
    // may drop what was typed ahead while it was not reading (like any raw-mode shell).
    // A terminal echoes the ^C after it has signalled the foreground job (Linux's n_tty
    // does, in that order), so with more than one CPU (a 2-vCPU microVM) the shell's
    // newline may come before the echo, which then starts the prompt's line ("^C~ #").
    last_line_is_one_of(&session, &["~ #", "^C~ #"]).await;
    keys(&session, &["echo still-here", "Enter"]);
    pane_shows(&session, "still-here\n").await;
    last_line_is(&session, "~ #").await;
    // Arrow keys: up recalls the last command line in the sandbox's shell. The line
    // prints something new each run, so its second run shows up however busybox redraws.
    keys(&session, &["n=$((n+1)); echo recall-$n", "Enter"]);
    shows(&s, &sb, &session, "recall-1\n").await;
    last_line_is(&session, "~ #").await;
    keys(&session, &["Up"]);
    last_line_is(&session, "~ # n=$((n+1)); echo recall-$n").await;
    keys(&session, &["Enter"]);
    shows(&s, &sb, &session, "recall-2\n").await;
    // The window size follows, growing and shrinking. tmux sets the pane's size in its own
    // time after `resize-window` (it may write keys sent next before it), so the line is
    // typed again until the size shows; the client sends a size it sees change before the
    // keys that follow.
    for (rows, cols) in [(40, 120), (25, 90), (50, 132)] {
        let st = Command::new("tmux")
            .args(["resize-window", "-t", &session])
            .args(["-x", &cols.to_string(), "-y", &rows.to_string()])
            .status()
            .unwrap();
        assert!(st.success());
        let want = format!("{rows} {cols}\n");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            last_line_is(&session, "~ #").await;
            keys(&session, &["clear; stty size", "Enter"]);
            let tried = std::time::Instant::now();
            while !pane(&session).contains(&want)
                && tried.elapsed() < std::time::Duration::from_secs(3)
            {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            if pane(&session).contains(&want) {
                break;
            }
            if std::time::Instant::now() > deadline {
                shows(&s, &sb, &session, &want).await;
            }
        }
    }
    keys(&session, &["exit 7", "Enter"]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !exit_file.exists() {
        assert!(std::time::Instant::now() < deadline, "{}", pane(&session));
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let _ = Command::new("tmux")
        .args(["kill-session", "-t", &session])
        .status();
    assert_eq!(std::fs::read_to_string(&exit_file).unwrap().trim(), "7");
    s.destroy(&sb).await;
}

#[tokio::test]
async fn cli_cp_and_ls() {
    use std::os::unix::fs::PermissionsExt;
    let s = TestServer::start().await;
    let sb = s.create("busybox").await;
    let local = tempfile::tempdir().expect("tempdir");
    let src = local.path().join("src");
    std::fs::create_dir_all(src.join("sub")).unwrap();
    std::fs::write(src.join("run.sh"), "#!/bin/sh\necho from-cp\n").unwrap();
    std::fs::set_permissions(src.join("run.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(src.join("sub/data"), vec![42u8; 100_000]).unwrap();
    std::os::unix::fs::symlink("run.sh", src.join("link")).unwrap();

    // A directory in, and what the sandbox sees of it.
    let to = format!("{sb}:/app");
    let out = space(&s, &["cp", src.to_str().unwrap(), &to]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        s.sh(&sb, "/app/link; wc -c < /app/sub/data").await["stdout"],
        "from-cp\n100000\n"
    );

    let out = space(&s, &["ls", &to, "--depth", "2"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let listing = text(&out.stdout);
    for want in [
        "-0755",
        "/app/run.sh",
        "/app/sub/data",
        "/app/link -> run.sh",
    ] {
        assert!(listing.contains(want), "{want} not in:\n{listing}");
    }

    // A single file in, keeping its mode; then files and the directory back out.
    let out = space(
        &s,
        &[
            "cp",
            src.join("run.sh").to_str().unwrap(),
            &format!("{sb}:/tmp/one.sh"),
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(s.sh(&sb, "stat -c %a /tmp/one.sh").await["stdout"], "755\n");
    s.sh(&sb, "echo made-inside > /tmp/inside.txt").await;
    let back = local.path().join("back");
    std::fs::create_dir(&back).unwrap();
    let out = space(
        &s,
        &[
            "cp",
            &format!("{sb}:/tmp/inside.txt"),
            back.to_str().unwrap(),
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        std::fs::read_to_string(back.join("inside.txt")).unwrap(),
        "made-inside\n"
    );
    let out = space(&s, &["cp", &to, back.join("app").to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        std::fs::read(back.join("app/sub/data")).unwrap(),
        vec![42u8; 100_000]
    );
    assert_eq!(
        std::fs::read_link(back.join("app/link")).unwrap().to_str(),
        Some("run.sh")
    );

    // Errors are clear and exit non-zero.
    let out = space(&s, &["cp", &format!("{sb}:/nope"), back.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("not_found"),
        "{}",
        text(&out.stderr)
    );
    let out = space(&s, &["cp", "a", "b"]);
    assert!(!out.status.success());
    s.destroy(&sb).await;
}

#[test]
fn doctor_checks_the_host_and_fails_on_what_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let doctor = |runsc: &str| {
        Command::new(env!("CARGO_BIN_EXE_space"))
            .args(["doctor", "--runsc", runsc, "--data-dir"])
            .arg(dir.path())
            .output()
            .unwrap()
    };
    // This host has what the test suite needs: nothing fails.
    let out = doctor("runsc");
    let report = text(&out.stdout);
    assert!(out.status.success(), "{report}");
    for check in [
        "runsc", "kvm", "qemu", "guest", "cgroups", "loop", "overlay", "tun", "disk",
    ] {
        assert!(
            report
                .lines()
                .any(|l| l.split_whitespace().nth(1) == Some(check)),
            "no {check} line in:\n{report}"
        );
    }
    assert!(!report.contains("FAIL"), "{report}");
    // A missing runsc is a failure with the fix named.
    let out = doctor("/nonexistent/runsc");
    let report = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{report}");
    let line = report
        .lines()
        .find(|l| l.starts_with("FAIL"))
        .unwrap_or_default();
    assert!(
        line.contains("runsc") && line.contains("scripts/setup.sh"),
        "{report}"
    );
}
