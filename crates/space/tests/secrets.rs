//! Secrets, and what must never reach a sandbox or leave it: on every runtime (as in
//! `conformance.rs`: a `…_gvisor` and a `…_microvm` test of each case; an unavailable
//! runtime is skipped with a printed reason, a failure under `SPACE_TEST_REQUIRE_RUNTIMES`).
//!
//! - Sandbox and command secrets reach the command's environment (the command's over the
//!   sandbox's, both over `env`), are shown only as `secret_names`, and are in no API
//!   response, event, server log line or template made from the sandbox; the sandbox's
//!   survive a killed server.
//! - The agent's token is unreadable inside: not in a file, not on the kernel command line,
//!   not in the agent's environment, memory or descriptors (`/proc/1/…`, the agent is not
//!   dumpable), and commands, root included, lack the capabilities that would get around
//!   that. On the host it is in no process's argv (QEMU's included).
//! - Nothing of the host gets in: neither a marker variable in the server's environment
//!   nor the server's API token is in a command's environment, any process's environment
//!   inside, or a file under /etc /root /tmp /.space.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{TestServer, TOKEN};
use serde_json::{json, Value};

/// The server (with `marker` in its environment), or `None` when `runtime` is unavailable.
async fn server(runtime: &str, marker: &str) -> Option<TestServer> {
    let mut s = TestServer::start().await;
    if !s.runtime_available(runtime).await {
        return None;
    }
    s.env
        .push(("SPACE_TEST_HOST_MARKER".into(), marker.to_string()));
    s.kill_and_restart();
    Some(s)
}

fn random_hex(n: usize) -> String {
    use std::io::Read;
    let mut b = vec![0u8; n];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .expect("random");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// `POST …/commands` with `wait:true`; asserts 201.
async fn command(s: &TestServer, sb: &str, body: Value) -> Value {
    let mut body = body;
    body["wait"] = json!(true);
    let (st, c) = s.post(&format!("/v1/sandboxes/{sb}/commands"), body).await;
    assert_eq!(st, 201, "{c}");
    c
}

/// The command's JSON without its output (which may echo what the command printed).
fn without_output(c: &Value) -> String {
    let mut c = c.clone();
    if let Some(o) = c.as_object_mut() {
        o.remove("stdout");
        o.remove("stderr");
    }
    c.to_string()
}

/// The agent token of this server's sandbox, read from the store's files (the server's
/// SQLite database and its write-ahead log hold the record as JSON text).
fn agent_token(s: &TestServer) -> String {
    let mut bytes = Vec::new();
    for f in ["space.db", "space.db-wal"] {
        bytes.extend(std::fs::read(s.data_dir().join(f)).unwrap_or_default());
    }
    let text = String::from_utf8_lossy(&bytes);
    let key = "\"agent_token\":\"";
    let start = text.find(key).expect("an agent token in the store") + key.len();
    let token: String = text[start..].chars().take_while(|&c| c != '"').collect();
    assert!(token.len() >= 16, "agent token {token:?}");
    token
}

/// Every regular file under `dir` (links not followed).
fn files_under(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let Ok(t) = e.file_type() else { continue };
        if t.is_dir() {
            files_under(&e.path(), out);
        } else if t.is_file() {
            out.push(e.path());
        }
    }
}

fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

/// Every retained event, as text: the history replay of `GET /v1/events?after=0`, read
/// until the stream has been quiet for a while (it stays open for live events).
async fn events_text(s: &TestServer) -> String {
    let mut resp = s
        .req(reqwest::Method::GET, "/v1/events?after=0")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut text = Vec::new();
    while let Ok(Ok(Some(chunk))) = tokio::time::timeout(Duration::from_secs(2), resp.chunk()).await
    {
        text.extend_from_slice(&chunk);
    }
    let text = String::from_utf8_lossy(&text).into_owned();
    assert!(
        text.contains("\"type\":\"sandbox\"") || text.contains("sandbox"),
        "{text}"
    );
    text
}

/// Capability sets of a command, from /proc/self/status (`CapBnd` etc. → bits).
fn caps(status: &str, which: &str) -> u64 {
    let line = status
        .lines()
        .find(|l| l.starts_with(which))
        .unwrap_or_else(|| panic!("no {which} in {status}"));
    u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap()
}

const CAP_SYS_MODULE: u32 = 16;
const CAP_SYS_RAWIO: u32 = 17;
const CAP_SYS_PTRACE: u32 = 19;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_SYS_BOOT: u32 = 22;
const CAP_CHOWN: u32 = 0;
const CAP_SETUID: u32 = 7;

async fn secrets_reach_commands_and_nothing_else(rt: &str) {
    let marker = format!("hostmarker{}", random_hex(12));
    let Some(mut s) = server(rt, &marker).await else {
        return;
    };
    let sb_secret = format!("sbsecret{}", random_hex(16));
    let shared_sb = format!("sharedsb{}", random_hex(16));
    let cmd_secret = format!("cmdsecret{}", random_hex(16));
    let shared_cmd = format!("sharedcmd{}", random_hex(16));
    let values = [&sb_secret, &shared_sb, &cmd_secret, &shared_cmd];

    // Bad secrets: 400, nothing created, and the message never holds a value.
    let long = "x".repeat(64 * 1024 + 1);
    let many: serde_json::Map<String, Value> =
        (0..129).map(|i| (format!("S{i}"), json!("v"))).collect();
    for bad in [
        json!({"1X": sb_secret}),
        json!({"A-B": sb_secret}),
        json!({"A=B": sb_secret}),
        json!({"": sb_secret}),
        json!({"A": format!("{sb_secret}\u{0}")}),
        json!({"A": long}),
        Value::Object(many),
        json!({"A": 5}),
        json!(["A"]),
    ] {
        let (st, v) = s
            .post(
                "/v1/sandboxes",
                json!({"template": "busybox", "runtime": rt, "secrets": bad}),
            )
            .await;
        assert_eq!(st, 400, "{bad}: {v}");
        assert!(!v.to_string().contains(&sb_secret), "{v}");
    }
    let (_, list) = s.get("/v1/sandboxes").await;
    assert_eq!(list["sandboxes"], json!([]), "{list}");

    let sb = s
        .create_with(json!({
            "template": "busybox",
            "runtime": rt,
            "env": {"PLAIN": "plain", "SHARED": "from-env"},
            "secrets": {"SB_SECRET": sb_secret, "SHARED": shared_sb},
        }))
        .await;
    let (_, v) = s.get(&format!("/v1/sandboxes/{sb}")).await;
    assert_eq!(v["runtime"], rt, "{v}");
    assert_eq!(v["secret_names"], json!(["SB_SECRET", "SHARED"]), "{v}");
    assert!(v.get("secrets").is_none(), "{v}");
    for val in values {
        assert!(!v.to_string().contains(val.as_str()), "{v}");
    }

    // The sandbox's secrets reach every command, over env; the command's over both.
    // (Upper-cased on the way out: the output is the command's own, not checked for leaks.)
    let c = command(
        &s,
        &sb,
        json!({"shell": "echo $PLAIN $SB_SECRET $SHARED ${CMD_SECRET:-none} | tr a-z A-Z"}),
    )
    .await;
    assert_eq!(
        c["stdout"].as_str().unwrap(),
        format!(
            "PLAIN {} {} NONE\n",
            sb_secret.to_uppercase(),
            shared_sb.to_uppercase()
        ),
        "{c}"
    );
    assert_eq!(c["secret_names"], json!(["SB_SECRET", "SHARED"]), "{c}");
    let c = command(
        &s,
        &sb,
        json!({
            "shell": "echo $SB_SECRET $SHARED $CMD_SECRET | tr a-z A-Z",
            "env": {"SHARED": "from-command-env", "CMD_SECRET": "from-command-env"},
            "secrets": {"CMD_SECRET": cmd_secret, "SHARED": shared_cmd},
        }),
    )
    .await;
    assert_eq!(
        c["stdout"].as_str().unwrap(),
        format!(
            "{} {} {}\n",
            sb_secret.to_uppercase(),
            shared_cmd.to_uppercase(),
            cmd_secret.to_uppercase()
        ),
        "{c}"
    );
    assert_eq!(
        c["secret_names"],
        json!(["CMD_SECRET", "SB_SECRET", "SHARED"]),
        "{c}"
    );
    let cid = c["id"].as_str().unwrap().to_string();
    for val in values {
        assert!(!without_output(&c).contains(val.as_str()), "{c}");
    }
    // A command's secrets are its own.
    let c = command(&s, &sb, json!({"shell": "echo ${CMD_SECRET:-unset}"})).await;
    assert_eq!(c["stdout"], "unset\n", "{c}");

    // Bad command secrets: 400, nothing run.
    for bad in [json!({"9": "x"}), json!({"A B": "x"}), json!({"A": 1})] {
        let (st, v) = s
            .post(
                &format!("/v1/sandboxes/{sb}/commands"),
                json!({"argv": ["true"], "secrets": bad}),
            )
            .await;
        assert_eq!(st, 400, "{bad}: {v}");
    }

    // Stored commands (one, and the list) hold names only.
    let (_, one) = s.get(&format!("/v1/sandboxes/{sb}/commands/{cid}")).await;
    assert_eq!(
        one["secret_names"],
        json!(["CMD_SECRET", "SB_SECRET", "SHARED"])
    );
    let (_, all) = s.get(&format!("/v1/sandboxes/{sb}/commands")).await;
    let (_, sandboxes) = s.get("/v1/sandboxes").await;
    for text in [one.to_string(), all.to_string(), sandboxes.to_string()] {
        for val in values {
            assert!(!text.contains(val.as_str()), "{text}");
        }
    }

    // A template made from the sandbox holds no secret (nothing wrote one to a file).
    let name = format!("secrets-{}", random_hex(6));
    let (st, op) = s
        .post(
            &format!("/v1/sandboxes/{sb}/snapshot-template"),
            json!({ "name": name }),
        )
        .await;
    assert_eq!(st, 202, "{op}");
    let op = s.wait_op(op["id"].as_str().unwrap()).await;
    assert_eq!(op["status"], "succeeded", "{op}\n{}", s.log());
    let templates = common::templates_dir();
    let mut files = Vec::new();
    files_under(&templates.join(&name), &mut files);
    let mut layers = Vec::new();
    for e in std::fs::read_dir(templates.join(".layers"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let meta: Value = std::fs::read(e.path().join("layer.json"))
            .ok()
            .and_then(|m| serde_json::from_slice(&m).ok())
            .unwrap_or_default();
        if meta["template"] == name.as_str() {
            files_under(&e.path(), &mut files);
            layers.push(e.path());
        }
    }
    assert!(!layers.is_empty(), "no layer of {name} found");
    for f in &files {
        let bytes = std::fs::read(f).unwrap_or_default();
        for val in values {
            assert!(!contains(&bytes, val), "{} holds a secret", f.display());
        }
    }
    let resp = s
        .req(reqwest::Method::DELETE, &format!("/v1/templates/{name}"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 204);
    for l in layers {
        let _ = std::fs::remove_dir_all(&l);
        let lock = templates.join(".layers").join(format!(
            ".{}.lock",
            l.file_name().unwrap().to_string_lossy()
        ));
        let _ = std::fs::remove_file(lock);
    }
    let _ = std::fs::remove_file(templates.join(format!(".{name}.lock")));

    // The sandbox's secrets survive a killed server.
    s.kill_and_restart();
    s.wait_state(&sb, "running", Duration::from_secs(120)).await;
    let c = command(&s, &sb, json!({"shell": "echo $SB_SECRET | tr a-z A-Z"})).await;
    assert_eq!(
        c["stdout"].as_str().unwrap(),
        format!("{}\n", sb_secret.to_uppercase()),
        "{c}\n{}",
        s.log()
    );

    // And a suspend and resume (a restored agent presents the token it holds in memory).
    for action in ["suspend", "resume"] {
        let (st, op) = s
            .post(&format!("/v1/sandboxes/{sb}/{action}"), json!({}))
            .await;
        assert_eq!(st, 202, "{op}");
        let op = s.wait_op(op["id"].as_str().unwrap()).await;
        assert_eq!(op["status"], "succeeded", "{action}: {op}\n{}", s.log());
    }
    let c = command(&s, &sb, json!({"shell": "echo $SB_SECRET | tr a-z A-Z"})).await;
    assert_eq!(
        c["stdout"].as_str().unwrap(),
        format!("{}\n", sb_secret.to_uppercase()),
        "{c}\n{}",
        s.log()
    );

    // No secret in any event, nor in the server's log.
    let events = events_text(&s).await;
    let log = s.log();
    for val in values {
        assert!(!events.contains(val.as_str()), "an event holds a secret");
        assert!(
            !log.contains(val.as_str()),
            "the server log holds a secret:\n{log}"
        );
    }
    s.destroy(&sb).await;
}

async fn nothing_of_the_host_or_the_agent_is_readable_inside(rt: &str) {
    let marker = format!("hostmarker{}", random_hex(12));
    let Some(s) = server(rt, &marker).await else {
        return;
    };
    let sb = s
        .create_with(json!({"template": "busybox", "runtime": rt}))
        .await;
    let token = agent_token(&s);

    // On the host: no process shows the agent's token in its argv (QEMU's included), and
    // what a microVM keeps on disk holds it no more once the guest is up.
    assert_eq!(common::processes_mentioning(&token), vec![]);
    // Only the server's store keeps it (the agent must be known after a restart). Disk
    // images are left out: sparse, gigabytes to read, and never written by the host.
    let mut files = Vec::new();
    files_under(s.data_dir(), &mut files);
    for f in &files {
        let name = f.file_name().unwrap().to_string_lossy();
        let size = std::fs::metadata(f).map(|m| m.len()).unwrap_or(0);
        if name.starts_with("space.db") || name == "server.log" || size > 256 << 20 {
            continue;
        }
        let bytes = std::fs::read(f).unwrap_or_default();
        assert!(!contains(&bytes, &token), "{} holds the token", f.display());
    }

    // As root, inside: the agent's token file is gone, its memory and its connection to the
    // host cannot be opened. In a microVM (Linux: the agent is not dumpable) its environment,
    // maps, auxv and every descriptor are closed too; gVisor checks only attach-mode access
    // (memory, ptrace) against a non-dumpable process, so there the environment (which holds
    // no secret: checked below) and the descriptors that are not sockets stay readable.
    let mut probe = String::from(
        "(exec 3</proc/1/mem) 2>/dev/null && echo 'opened /proc/1/mem'; \
         for fd in /proc/1/fd/*; do case \"$(readlink $fd 2>/dev/null)\" in \
           socket:*) (exec 3<>$fd) 2>/dev/null && echo \"opened socket $fd\";; esac; done; \
         [ -e /.space/run/token ] && echo 'token file'; ",
    );
    if rt == "microvm" {
        // Nor can it reach what QEMU handed the guest at boot (the initramfs holds the
        // token): no fw_cfg files, no physical memory, no I/O ports.
        probe.push_str(
            "ls /sys/firmware/qemu_fw_cfg >/dev/null 2>&1 && echo 'fw_cfg in sysfs'; \
             for f in /dev/mem /dev/port /proc/kcore; do \
               [ \"$(dd if=$f bs=1 count=1 2>/dev/null | wc -c)\" -gt 0 ] && echo \"read $f\"; done; \
             for f in /proc/1/environ /proc/1/maps /proc/1/auxv; do \
               (exec 3<$f) 2>/dev/null && echo \"opened $f\"; done; \
             for fd in /proc/1/fd/*; do \
               readlink $fd >/dev/null 2>&1 && echo \"followed $fd\"; \
               (exec 3<$fd) 2>/dev/null && echo \"opened $fd\"; done; ",
        );
    }
    probe.push_str("echo done");
    let c = command(&s, &sb, json!({"shell": probe})).await;
    assert_eq!(c["stdout"], "done\n", "{c}");
    let c = command(&s, &sb, json!({"shell": probe, "user": "1000"})).await;
    assert_eq!(c["stdout"], "done\n", "{c}");

    // A root command's capabilities: no way around the agent being non-dumpable, while
    // what root commands commonly use stays.
    let c = command(
        &s,
        &sb,
        json!({"shell": "id -u; grep ^Cap /proc/self/status"}),
    )
    .await;
    let out = c["stdout"].as_str().unwrap();
    assert!(out.starts_with("0\n"), "{c}");
    for set in ["CapBnd", "CapPrm", "CapEff", "CapInh"] {
        let bits = caps(out, set);
        for cap in [
            CAP_SYS_PTRACE,
            CAP_SYS_ADMIN,
            CAP_SYS_MODULE,
            CAP_SYS_RAWIO,
            CAP_SYS_BOOT,
        ] {
            assert_eq!(bits & (1 << cap), 0, "{set} has capability {cap}: {out}");
        }
    }
    assert_eq!(caps(out, "CapInh"), 0, "{out}");
    // gVisor's set (Docker's default) on both runtimes, nothing more; runsc also withholds
    // CAP_NET_RAW unless it is started with --net-raw.
    let kept: u64 = [0u32, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 27, 29, 31]
        .iter()
        .map(|c| 1u64 << c)
        .sum();
    let net_raw = 1u64 << 13;
    for set in ["CapBnd", "CapEff"] {
        let bits = caps(out, set);
        assert_eq!(bits & !kept, 0, "{set} has more than the kept set: {out}");
        assert_eq!(
            bits | net_raw,
            kept,
            "{set} lacks part of the kept set: {out}"
        );
    }
    for cap in [CAP_CHOWN, CAP_SETUID] {
        assert_ne!(caps(out, "CapEff") & (1 << cap), 0, "{out}");
    }
    let c = command(
        &s,
        &sb,
        json!({"shell": "touch /tmp/o && chown 1000:1000 /tmp/o && stat -c %u /tmp/o && rm /tmp/o"}),
    )
    .await;
    assert_eq!(c["stdout"], "1000\n", "{c}");

    // Everything a command can read of the kernel's and processes' command lines and
    // environments: no token, no marker of the host's environment.
    let c = command(
        &s,
        &sb,
        json!({"shell": "env; cat /proc/cmdline; for p in /proc/[0-9]*; do cat $p/cmdline $p/environ; echo; done 2>/dev/null; true"}),
    )
    .await;
    let seen = c["stdout"].as_str().unwrap();
    assert!(seen.contains("PATH="), "{c}");
    for (what, needle) in [
        ("agent token", &token),
        ("API token", &TOKEN.to_string()),
        ("host marker", &marker),
    ] {
        assert!(
            !seen.contains(needle.as_str()),
            "the {what} is visible inside:\n{seen}"
        );
    }
    // Nor in a file under /etc /root /tmp /.space (the needles travel in this command's
    // environment, which no file holds).
    let c = command(
        &s,
        &sb,
        json!({
            "shell": "grep -rlF -e \"$N1\" -e \"$N2\" -e \"$N3\" /etc /root /tmp /.space 2>/dev/null; echo done",
            "env": {"N1": token, "N2": TOKEN, "N3": marker},
        }),
    )
    .await;
    assert_eq!(c["stdout"], "done\n", "{c}");

    // Neither token is in the server's log or its events.
    let events = events_text(&s).await;
    let log = s.log();
    assert!(
        !log.contains(&token),
        "the server log holds the agent token"
    );
    assert!(!log.contains(TOKEN), "the server log holds the API token");
    assert!(!events.contains(&token), "an event holds the agent token");
    assert!(!events.contains(TOKEN), "an event holds the API token");
    s.destroy(&sb).await;
}

macro_rules! on_every_runtime {
    ($($case:ident),+ $(,)?) => {
        mod gvisor {
            $(
                #[tokio::test]
                async fn $case() {
                    super::$case("gvisor").await
                }
            )+
        }
        mod microvm {
            $(
                #[tokio::test]
                async fn $case() {
                    super::$case("microvm").await
                }
            )+
        }
    };
}

on_every_runtime!(
    secrets_reach_commands_and_nothing_else,
    nothing_of_the_host_or_the_agent_is_readable_inside,
);
