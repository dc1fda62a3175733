//! Lifecycle benchmark: our API against raw `runsc` doing the same work, in one run.
//!
//! 1. pause + resume: `POST .../pause` + `POST .../resume`, each long-polled
//!    until its operation succeeded, against `runsc pause` + `runsc resume`.
//! 2. suspend and resume from the snapshot: `POST .../suspend` and
//!    `POST .../resume` until they succeeded (the resume includes the agent
//!    dialing back in), against `runsc checkpoint` until the container is
//!    stopped + `runsc delete`, and `runsc restore --detach` until `runsc state`
//!    says running. Extra: resume-to-first-exec, the resume plus one `true`
//!    (ours through the API, raw a `runsc exec`).
//! 3. snapshot size: our `cost.snapshot_bytes` against the bytes of the raw
//!    checkpoint image.
//!
//! The raw container runs the OCI bundle our server wrote for our sandbox,
//! with the global flags our gVisor driver uses. Run it with `scripts/bench.sh`
//! (which builds the agent and the busybox template first), or
//! `cargo bench -p space --bench lifecycle` once they exist. Timings are
//! reported, never asserted; anything that functionally breaks panics.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "rawsc/mod.rs"]
mod rawsc;

use std::time::{Duration, Instant};

use common::TestServer;
use rawsc::{
    bench_start, check_ours, check_raw, max, median, ms, row, runsc_processes, table_head,
};
use space_api::{OperationStatus, Sandbox, SandboxState};
use space_client::Client;
use space_runtime::dir_size;

/// Timed iterations of each cycle, per side.
const N: usize = 5;
/// Untimed iterations of each cycle, per side, before the timed ones.
const WARMUPS: usize = 1;
/// Longest one of our operations may take before the bench gives up.
const OP_LIMIT: Duration = Duration::from_secs(300);

/// Timings of one side.
#[derive(Default)]
struct Side {
    pause: Vec<Duration>,
    resume: Vec<Duration>,
    pause_resume: Vec<Duration>,
    suspend: Vec<Duration>,
    restore: Vec<Duration>,
    restore_exec: Vec<Duration>,
    snapshot_bytes: Vec<u64>,
}

fn main() {
    let (rt, facts) = bench_start();
    let server = rt.block_on(TestServer::start());
    let c = rawsc::client_of(&server);

    // Our sandbox; its OCI bundle is the one the raw side runs.
    let ours = rt.block_on(rawsc::create_busybox(&c));
    let our_bundle = rawsc::our_bundle(&server, &ours);
    let our_snapshot = server.data_dir().join("snapshots").join(&ours);
    let raw = rawsc::raw_of(&server, &our_bundle);
    let rid = raw.start_new("main");

    rt.block_on(check_ours(&c, &ours));
    check_raw(&raw, &rid);

    let mut o = Side::default();
    let mut r = Side::default();
    // Things that did not break the bench but look wrong; printed with the table.
    let mut anomalies: Vec<String> = Vec::new();

    // 1. pause + resume, interleaved so that background load hits both sides alike.
    eprintln!("bench: pause+resume x{N} (each side, after {WARMUPS} warm-up)");
    for i in 0..WARMUPS + N {
        let p = rt.block_on(timed_op(&server, &c, &ours, Verb::Pause));
        rt.block_on(expect_state(&c, &ours, SandboxState::Paused));
        let q = rt.block_on(timed_op(&server, &c, &ours, Verb::Resume));
        rt.block_on(expect_state(&c, &ours, SandboxState::Running));
        rt.block_on(check_ours(&c, &ours));

        let rp = raw.pause(&rid);
        assert_eq!(raw.state(&rid).as_deref(), Some("paused"));
        let rq = raw.resume(&rid);
        assert_eq!(raw.state(&rid).as_deref(), Some("running"));
        check_raw(&raw, &rid);

        eprintln!(
            "bench: pause+resume {i}: ours {:.1} ms, raw {:.1} ms",
            ms(p + q),
            ms(rp + rq)
        );
        if i >= WARMUPS {
            o.pause.push(p);
            o.resume.push(q);
            o.pause_resume.push(p + q);
            r.pause.push(rp);
            r.resume.push(rq);
            r.pause_resume.push(rp + rq);
        }
    }

    // 2 and 3. suspend, snapshot size, resume from the snapshot, first exec.
    eprintln!("bench: suspend + resume from snapshot x{N} (each side, after {WARMUPS} warm-up)");
    for i in 0..WARMUPS + N {
        // Ours.
        let s = rt.block_on(timed_op(&server, &c, &ours, Verb::Suspend));
        let sb = rt.block_on(expect_state(&c, &ours, SandboxState::Suspended));
        let bytes = sb
            .cost
            .snapshot_bytes
            .unwrap_or_else(|| panic!("suspended without cost.snapshot_bytes: {sb:?}"));
        assert!(bytes > 0, "empty snapshot: {sb:?}");
        // Documented: a suspended sandbox holds no memory.
        assert_eq!(sb.cost.memory_bytes, Some(0), "{sb:?}");
        let on_disk = dir_size(&our_snapshot);
        if on_disk != bytes {
            anomalies.push(format!(
                "iteration {i}: cost.snapshot_bytes {bytes} but {} holds {on_disk} bytes",
                our_snapshot.display()
            ));
        }
        let needle = format!("--bundle={}", our_bundle.display());
        let left = runsc_processes(|a| a == needle);
        assert!(
            left.is_empty(),
            "runsc processes of suspended {ours} remain: {left:?}"
        );
        let t0 = Instant::now();
        let q = rt.block_on(timed_op(&server, &c, &ours, Verb::Resume));
        rt.block_on(run_true(&c, &ours));
        let qx = t0.elapsed();
        let sb = rt.block_on(expect_state(&c, &ours, SandboxState::Running));
        if let Some(n) = sb.cost.snapshot_bytes {
            anomalies.push(format!(
                "resumed sandbox still reports cost.snapshot_bytes {n}"
            ));
        }
        if our_snapshot.exists() {
            anomalies.push(format!(
                "iteration {i}: {} still exists after the resume",
                our_snapshot.display()
            ));
        }
        rt.block_on(check_ours(&c, &ours));

        // Raw.
        let rs = raw.checkpoint(&rid);
        assert_eq!(raw.state(&rid), None, "raw container left after checkpoint");
        let rbytes = dir_size(&raw.image(&rid));
        assert!(rbytes > 0, "empty raw checkpoint image");
        let rq = raw.restore(&rid);
        let (rx, _) = raw.exec(&rid, &["/bin/true"]);
        check_raw(&raw, &rid);

        eprintln!(
            "bench: suspend/resume {i}: ours {:.1}/{:.1} ms, raw {:.1}/{:.1} ms",
            ms(s),
            ms(q),
            ms(rs),
            ms(rq)
        );
        if i >= WARMUPS {
            o.suspend.push(s);
            o.restore.push(q);
            o.restore_exec.push(qx);
            o.snapshot_bytes.push(bytes);
            r.suspend.push(rs);
            r.restore.push(rq);
            r.restore_exec.push(rq + rx);
            r.snapshot_bytes.push(rbytes);
        }
    }

    // Clean up, then check that nothing of ours or the raw side is left running.
    let left = rawsc::teardown(&rt, server, &c, &ours, raw, &rid);
    rawsc::assert_nothing_left(&left, &rid);

    // The table.
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    table_head("lifecycle", &facts);
    let median_row = |metric: &str, ours: &[Duration], raw: &[Duration]| {
        row(metric, "median", ms(median(ours)), ms(median(raw)), "ms");
    };
    let times = |metric: String, ours: &[Duration], raw: &[Duration]| {
        median_row(&metric, ours, raw);
        row(&metric, "max", ms(max(ours)), ms(max(raw)), "ms");
    };
    times(
        format!("pause+resume (n={N})"),
        &o.pause_resume,
        &r.pause_resume,
    );
    median_row("  pause alone (extra)", &o.pause, &r.pause);
    median_row("  resume alone (extra)", &o.resume, &r.resume);
    times(format!("suspend (n={N})"), &o.suspend, &r.suspend);
    times(
        format!("resume from snapshot (n={N})"),
        &o.restore,
        &r.restore,
    );
    times(
        "resume-to-first-exec (extra)".into(),
        &o.restore_exec,
        &r.restore_exec,
    );
    let size = format!("snapshot size (n={N})");
    row(
        &size,
        "median",
        mib(median(&o.snapshot_bytes)),
        mib(median(&r.snapshot_bytes)),
        "MiB",
    );
    row(
        &size,
        "max",
        mib(max(&o.snapshot_bytes)),
        mib(max(&r.snapshot_bytes)),
        "MiB",
    );
    println!(
        "notes: ratio = ours / raw; {WARMUPS} untimed warm-up per cycle and side; `echo ok` \
         checked on both sides after every resume. ours = POST + long-poll of the operation \
         until succeeded; suspend also makes the agent drop its host connection and waits for \
         the runsc processes to exit, resume from snapshot also waits for the agent to dial \
         back in. raw suspend = checkpoint + state polls until stopped + delete; raw resume = \
         restore --detach + state polls until running; raw first exec = a whole `runsc exec \
         /bin/true`. The raw agent has no host to dial and retries."
    );
    if anomalies.is_empty() {
        println!("anomalies: none");
    } else {
        for a in &anomalies {
            println!("anomaly: {a}");
        }
    }
}

/// A lifecycle request of ours.
#[derive(Clone, Copy, Debug)]
enum Verb {
    Pause,
    Resume,
    Suspend,
}

/// `POST /v1/sandboxes/{sb}/{verb}` and long-poll until the operation succeeded.
async fn timed_op(s: &TestServer, c: &Client, sb: &str, verb: Verb) -> Duration {
    let start = Instant::now();
    let op = match verb {
        Verb::Pause => c.pause_sandbox(sb).await,
        Verb::Resume => c.resume_sandbox(sb).await,
        Verb::Suspend => c.suspend_sandbox(sb).await,
    }
    .unwrap_or_else(|e| panic!("{verb:?} of {sb}: {e}"));
    loop {
        let op = c
            .operation(&op.id, Some(Duration::from_secs(30)))
            .await
            .expect("GET the operation");
        match op.status {
            OperationStatus::Succeeded => return start.elapsed(),
            OperationStatus::Failed | OperationStatus::Cancelled => {
                panic!("{verb:?} of {sb} failed: {op:?}\n{}", s.log())
            }
            _ => assert!(
                start.elapsed() < OP_LIMIT,
                "{verb:?} of {sb} did not end: {op:?}"
            ),
        }
    }
}

/// The sandbox object, which must be in `state`.
async fn expect_state(c: &Client, sb: &str, state: SandboxState) -> Sandbox {
    let v = c.sandbox(sb).await.expect("GET the sandbox");
    assert_eq!(v.state, state, "{v:?}");
    v
}

/// One `true` through our API.
async fn run_true(c: &Client, sb: &str) {
    let cmd = c.run(sb, &["true"]).await.expect("true");
    assert_eq!(cmd.state, space_api::CommandState::Exited, "{cmd:?}");
    assert_eq!(
        cmd.result.as_ref().and_then(|r| r.exit_code),
        Some(0),
        "{cmd:?}"
    );
}
