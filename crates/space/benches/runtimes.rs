//! Runtimes benchmark: gvisor and microvm side by side through our API, each
//! against its raw tool doing the same work in the same run.
//!
//! 1. boot to agent ready: `POST /v1/sandboxes` to the create operation's success,
//!    per runtime; raw: `runsc create+start` of our sandbox's bundle (gvisor), and
//!    `qemu-system-x86_64` with our VM's own machine, accelerator, CPU, memory,
//!    kernel and initramfs booting to the kernel's "Run /init" line (microvm).
//! 2. suspend + resume: `POST …/suspend` and `…/resume` to their operations'
//!    success, and the snapshot's size (`cost.snapshot_bytes`).
//! 3. exec round trip: `POST …/commands {"argv":["true"],"wait":true}`, p50/p95;
//!    raw `runsc exec … /bin/true` for gvisor.
//!
//! Timings are printed, never asserted. Needs the guest files (scripts/setup.sh).

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "rawsc/mod.rs"]
mod rawsc;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::TestServer;
use rawsc::{bench_start, median, ms, percentile};
use space_api::{CreateCommandRequest, CreateSandboxRequest};
use space_client::Client;

const BOOTS: usize = 3;
const CYCLES: usize = 2;
const EXECS: usize = 30;

async fn timed_create(c: &Client, runtime: &str) -> (String, Duration) {
    let req = CreateSandboxRequest {
        template: "busybox".into(),
        runtime: Some(runtime.into()),
        ..Default::default()
    };
    let t0 = Instant::now();
    let sb = rawsc::create_ours(c, &req).await;
    (sb, t0.elapsed())
}

/// Suspend or resume.
#[derive(Clone, Copy, Debug)]
enum Verb {
    Suspend,
    Resume,
}

async fn timed_op(c: &Client, sb: &str, verb: Verb) -> Duration {
    let t0 = Instant::now();
    let op = match verb {
        Verb::Suspend => c.suspend_sandbox(sb).await,
        Verb::Resume => c.resume_sandbox(sb).await,
    }
    .unwrap_or_else(|e| panic!("{verb:?} of {sb}: {e}"));
    c.wait_operation_succeeded(&op.id, rawsc::OUR_OP_LIMIT)
        .await
        .unwrap_or_else(|e| panic!("{verb:?} of {sb}: {e}"));
    t0.elapsed()
}

async fn exec_true(c: &Client, sb: &str) -> Duration {
    let req = CreateCommandRequest {
        argv: Some(vec!["true".into()]),
        wait: Some(true),
        ..Default::default()
    };
    let t0 = Instant::now();
    let cmd = c.create_command(sb, &req).await;
    let took = t0.elapsed();
    let cmd = cmd.unwrap_or_else(|e| panic!("POST commands: {e}"));
    assert_eq!(
        cmd.result.as_ref().and_then(|r| r.exit_code),
        Some(0),
        "{cmd:?}"
    );
    took
}

/// The argv of the QEMU process running sandbox `sb`.
fn qemu_argv(sb: &str) -> Vec<String> {
    for (pid, _) in common::processes_mentioning(sb) {
        let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let argv: Vec<String> = raw
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if argv.first().is_some_and(|a| a.contains("qemu-system")) {
            return argv;
        }
    }
    panic!("no QEMU process of {sb}");
}

/// Raw QEMU: our VM's machine, accelerator, CPU, memory, kernel and initramfs, the
/// serial console on a pipe, timed from spawn to the kernel starting /init.
fn raw_qemu_boot(ours: &[String]) -> Duration {
    let value = |flag: &str| {
        let i = ours
            .iter()
            .position(|a| a == flag)
            .unwrap_or_else(|| panic!("{flag} in {ours:?}"));
        ours[i + 1].clone()
    };
    let append = value("-append");
    let cmdline: Vec<&str> = append
        .split(' ')
        .filter(|p| *p != "quiet" && !p.starts_with("space."))
        .collect();
    let mut child = Command::new(&ours[0])
        .args([
            "-M",
            &value("-M"),
            "-accel",
            &value("-accel"),
            "-cpu",
            &value("-cpu"),
        ])
        .args(["-m", &value("-m"), "-smp", "1"])
        .args([
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
        ])
        .args(["-serial", "stdio"])
        .args(["-kernel", &value("-kernel"), "-initrd", &value("-initrd")])
        .args(["-append", &cmdline.join(" ")])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("qemu-system-x86_64");
    let t0 = Instant::now();
    let out = child.stdout.take().expect("serial");
    let mut reached = None;
    for line in BufReader::new(out).lines() {
        let Ok(line) = line else { break };
        if line.contains("Run /init as init process") {
            reached = Some(t0.elapsed());
            break;
        }
        if t0.elapsed() > Duration::from_secs(120) {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    reached.expect("the raw VM never reached /init")
}

fn main() {
    let (rt, facts) = bench_start();
    let server = rt.block_on(TestServer::start());
    let c = rawsc::client_of(&server);
    let runtimes = rt.block_on(c.runtimes()).expect("GET /v1/runtimes");
    let microvm = runtimes
        .iter()
        .find(|r| r.name == "microvm")
        .unwrap_or_else(|| panic!("no microvm runtime in {runtimes:?}"));
    assert!(microvm.available, "microvm unavailable: {microvm:?}");
    let accel = microvm.accelerator.clone().unwrap_or_else(|| "?".into());

    let mut boot = std::collections::BTreeMap::<&str, Vec<Duration>>::new();
    let mut suspend = std::collections::BTreeMap::<&str, Vec<Duration>>::new();
    let mut resume = std::collections::BTreeMap::<&str, Vec<Duration>>::new();
    let mut snap_bytes = std::collections::BTreeMap::<&str, u64>::new();
    let mut exec = std::collections::BTreeMap::<&str, Vec<Duration>>::new();
    let mut raw_qemu = Vec::new();
    let mut raw_runsc = Vec::new();
    let mut raw_exec = Vec::new();

    for runtime in ["gvisor", "microvm"] {
        eprintln!("bench: {runtime}: {BOOTS} boots, {CYCLES} suspend/resume cycles, {EXECS} execs");
        let mut keep = None;
        for i in 0..BOOTS {
            let (sb, took) = rt.block_on(timed_create(&c, runtime));
            boot.entry(runtime).or_default().push(took);
            if i + 1 < BOOTS {
                rt.block_on(rawsc::destroy_ours(&c, &server, &sb));
            } else {
                keep = Some(sb);
            }
        }
        let sb = keep.expect("a sandbox");
        for _ in 0..EXECS {
            let d = rt.block_on(exec_true(&c, &sb));
            exec.entry(runtime).or_default().push(d);
        }
        if runtime == "microvm" {
            let argv = qemu_argv(&sb);
            for _ in 0..BOOTS {
                raw_qemu.push(raw_qemu_boot(&argv));
            }
        } else {
            let raw = rawsc::raw_of(&server, &rawsc::our_bundle(&server, &sb));
            for i in 0..BOOTS {
                let id = raw.id(&format!("boot{i}"));
                raw.prepare(&id);
                raw_runsc.push(raw.create_start(&id));
                if i + 1 == BOOTS {
                    for _ in 0..EXECS {
                        raw_exec.push(raw.exec_true(&id));
                    }
                }
                raw.delete(&id);
            }
        }
        for _ in 0..CYCLES {
            let s = rt.block_on(timed_op(&c, &sb, Verb::Suspend));
            suspend.entry(runtime).or_default().push(s);
            let v = rt.block_on(c.sandbox(&sb)).expect("GET the sandbox");
            snap_bytes.insert(runtime, v.cost.snapshot_bytes.unwrap_or(0));
            let r = rt.block_on(timed_op(&c, &sb, Verb::Resume));
            resume.entry(runtime).or_default().push(r);
            rt.block_on(rawsc::check_ours(&c, &sb));
        }
        rt.block_on(rawsc::destroy_ours(&c, &server, &sb));
    }
    drop(server);

    println!();
    println!("space runtimes benchmark: gvisor and microvm ({accel}) through our API, beside raw tools, same run");
    println!("machine: {facts}");
    println!(
        "{:<34} {:>11} {:>12} {:>13} {:>14} {:>9}",
        "metric (median)", "gvisor", "raw runsc", "microvm", "raw qemu", "vm/qemu"
    );
    let m = |v: &[Duration]| ms(median(v));
    let g = m(&boot["gvisor"]);
    let v = m(&boot["microvm"]);
    let q = m(&raw_qemu);
    println!(
        "{:<34} {:>8.1} ms {:>9.1} ms {:>10.1} ms {:>11.1} ms {:>8.2}x",
        format!("boot to agent ready (n={BOOTS})"),
        g,
        m(&raw_runsc),
        v,
        q,
        v / q
    );
    println!(
        "{:<34} {:>11} {:>12} {:>13} {:>14}",
        "  (raw qemu: to the kernel's /init)", "", "", "", ""
    );
    for (metric, map) in [
        ("suspend (n=2)", &suspend),
        ("resume from snapshot (n=2)", &resume),
    ] {
        println!(
            "{:<34} {:>8.1} ms {:>12} {:>10.1} ms {:>14}",
            metric,
            m(&map["gvisor"]),
            "",
            m(&map["microvm"]),
            ""
        );
    }
    println!(
        "{:<34} {:>8.1} MB {:>12} {:>10.1} MB {:>14}",
        "snapshot size",
        snap_bytes["gvisor"] as f64 / 1e6,
        "",
        snap_bytes["microvm"] as f64 / 1e6,
        ""
    );
    for p in [50, 95] {
        println!(
            "{:<34} {:>8.1} ms {:>9.1} ms {:>10.1} ms {:>14}",
            format!("exec `true` p{p} (n={EXECS})"),
            ms(percentile(&exec["gvisor"], p)),
            ms(percentile(&raw_exec, p)),
            ms(percentile(&exec["microvm"], p)),
            "n/a"
        );
    }
}
