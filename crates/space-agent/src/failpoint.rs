//! Test hooks of the agent: compiled in only with the `test-hooks` feature (the test
//! suite's build), and even then off unless the agent's own environment has
//! `SPACE_FAILPOINT` (a server started with `SPACE_FAILPOINT=agent:…` passes it on;
//! nothing a sandbox runs can set it).
//!
//! `agent:wedge`: asked to run `space-failpoint wedge SECONDS`, the agent stops
//! answering anything (every worker thread blocks) for SECONDS, or for good with 0:
//! how tests show that the host notices a stuck agent and that no request waits on it.
//!
//! `agent:drop`: asked to run `space-failpoint drop-before KIND`, the agent drops its
//! host connection the next time the host asks it for KIND (`signal`, or a file call:
//! `download`, `upload`, `list`, `stat`, `mkdir`, `move`, `remove`; or `stdin`: the next
//! input frame of an attach), before acting on it, and dials again as after any break: how tests show that a call whose connection
//! broke under it is made again on the next one, or answered 503 having changed nothing.
//! `agent:drop:KIND` arms it from the start, for calls the host makes before any command
//! could (a create's own, such as its write of `/etc/hosts`).
//!
//! `agent:silent`: the agent connects to the host and never says hello, as a guest that
//! stalls after opening its link would: how tests show that a create whose agent never
//! dials in boots the sandbox again.
//!
//! `agent:stall`: the agent sleeps for good before it does anything, as in a guest whose
//! boot stalls before its agent runs: how tests show that such a create boots again.
//!
//! `agent:no-features`: the agent's hello names no features, as an agent from before
//! them (a sandbox that outlived an upgrade of the server) does.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The kind of request `agent:drop` waits for, once armed.
static DROP_BEFORE: Mutex<Option<String>> = Mutex::new(None);
/// The kinds `agent:drop` knows.
const DROP_KINDS: &[&str] = &[
    "signal", "download", "upload", "list", "stat", "mkdir", "move", "remove", "stdin",
];

#[cfg(feature = "test-hooks")]
fn active(name: &str) -> bool {
    std::env::var("SPACE_FAILPOINT").is_ok_and(|v| v == name)
}

#[cfg(not(feature = "test-hooks"))]
fn active(_name: &str) -> bool {
    false
}

/// Whether `argv` asks for the wedge and the failpoint is on; if so, wedges (and, for
/// a limited wedge, returns once it is over).
pub fn wedge_if_asked(argv: &[String]) -> bool {
    let [program, what, seconds] = argv else {
        return false;
    };
    if program != "space-failpoint" || what != "wedge" || !active("agent:wedge") {
        return false;
    }
    let seconds: u64 = seconds.parse().unwrap_or(0);
    note!("space-agent: failpoint agent:wedge: not answering for {seconds}s (0: for good)");
    let until = (seconds > 0).then(|| Instant::now() + Duration::from_secs(seconds));
    // More blocked tasks than there are worker threads: every worker ends up in one,
    // so nothing else (the host connection, its pings, the reaper) runs meanwhile.
    for _ in 0..64 {
        tokio::spawn(async move { block(until) });
    }
    block(until);
    true
}

/// Whether `argv` arms `agent:drop` (`space-failpoint drop-before KIND`) and the
/// failpoint is on; if so, arms it.
pub fn arm_drop_if_asked(argv: &[String]) -> bool {
    let [program, what, kind] = argv else {
        return false;
    };
    if program != "space-failpoint"
        || what != "drop-before"
        || !DROP_KINDS.contains(&kind.as_str())
        || !active("agent:drop")
    {
        return false;
    }
    note!("space-agent: failpoint agent:drop: dropping the host connection before the next {kind}");
    *DROP_BEFORE.lock().unwrap_or_else(|e| e.into_inner()) = Some(kind.clone());
    true
}

/// Whether a request of `kind` is the one `agent:drop` was armed for (it then disarms).
pub fn drop_before(kind: &str) -> bool {
    static FROM_START: std::sync::Once = std::sync::Once::new();
    let mut armed = DROP_BEFORE.lock().unwrap_or_else(|e| e.into_inner());
    FROM_START.call_once(|| {
        if let Some(k) = DROP_KINDS
            .iter()
            .find(|k| active(&format!("agent:drop:{k}")))
        {
            *armed = Some(k.to_string());
        }
    });
    let on = active("agent:drop") || active(&format!("agent:drop:{kind}"));
    if armed.as_deref() == Some(kind) && on {
        *armed = None;
        note!("space-agent: failpoint agent:drop: dropping the host connection before a {kind}");
        return true;
    }
    false
}

/// Whether the agent is to stay silent on its host connections (`agent:silent`).
pub fn silent() -> bool {
    active("agent:silent")
}

/// With `agent:stall`, never returns: the agent sleeps before it does anything else, as in
/// a guest whose boot stalled before its agent ran: how tests show that a create whose boot
/// stalls boots the sandbox again.
pub fn stall_if_asked() {
    if active("agent:stall") {
        note!("space-agent: failpoint agent:stall: stalling before the host link");
        block(None);
    }
}

/// Whether the agent is to name no features in its hello (`agent:no-features`), as one
/// from before them: how tests show that a host still serves such an agent the old way.
pub fn no_features() -> bool {
    active("agent:no-features")
}

fn block(until: Option<Instant>) {
    match until {
        Some(t) => std::thread::sleep(t.saturating_duration_since(Instant::now())),
        None => loop {
            std::thread::park();
        },
    }
}
