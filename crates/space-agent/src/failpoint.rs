//! Test hooks of the agent: compiled in only with the `test-hooks` feature (the test
//! suite's build), and even then off unless the agent's own environment has
//! `SPACE_FAILPOINT` (a server started with `SPACE_FAILPOINT=agent:…` passes it on;
//! nothing a sandbox runs can set it).
//!
//! `agent:wedge`: asked to run `space-failpoint wedge SECONDS`, the agent stops
//! answering anything (every worker thread blocks) for SECONDS, or for good with 0:
//! how tests show that the host notices a stuck agent and that no request waits on it.
//!
//! `agent:silent`: the agent connects to the host and never says hello, as a guest that
//! stalls after opening its link would: how tests show that a create whose agent never
//! dials in boots the sandbox again.

use std::time::{Duration, Instant};

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

/// Whether the agent is to stay silent on its host connections (`agent:silent`).
pub fn silent() -> bool {
    active("agent:silent")
}

fn block(until: Option<Instant>) {
    match until {
        Some(t) => std::thread::sleep(t.saturating_duration_since(Instant::now())),
        None => loop {
            std::thread::park();
        },
    }
}
