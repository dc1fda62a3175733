//! Commands benchmark: our API against raw `runsc` doing the same work, in one run.
//!
//! 1. stdout throughput of a 256 MiB stream: `POST .../commands` of
//!    `head -c 268435456 /dev/zero` and its whole output read through
//!    `GET …/output?follow=true&stream=stdout` (NDJSON, base64 decoded by
//!    `space-client`, bytes counted and checked), timed from the POST to the result line,
//!    against `runsc exec <container> /bin/head -c 268435456 /dev/zero` with its
//!    stdout counted through a pipe. Extras: the same output read again without
//!    `follow` once the command has ended, and (raw only) `head` writing to
//!    `/dev/null` inside the sandbox, the floor of both sides.
//! 2. exec latency of `true` with 1, 10 and 50 concurrent clients, each making
//!    sequential calls: `POST .../commands {"argv":["true"],"wait":true}`
//!    against `runsc exec <container> /bin/true` processes; p50 and p95.
//!    Extras: calls per second, and the part of our latency that the agent
//!    itself reports (`result.duration_ms`, spawn to reap).
//!
//! The raw container runs the OCI bundle our server wrote for our sandbox,
//! with the global flags our gVisor driver uses. Our server keeps all output
//! (`--output-cap-mib 0`), so nothing of the stream is dropped. Run it with
//! `scripts/bench.sh` (which builds the agent and the busybox template first),
//! or `cargo bench -p space --bench commands` once they exist. Timings are
//! reported, never asserted; anything that functionally breaks panics.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "rawsc/mod.rs"]
mod rawsc;

use std::time::{Duration, Instant};

use common::TestServer;
use futures::StreamExt;
use rawsc::{
    bench_start, check_ours, check_raw, max, median, ms, one_side, p50_p95_rows, percentile, row,
    table_head, Raw,
};
use space_api::{Command, CommandState, CreateCommandRequest, ProcessResult};
use space_client::{Client, OutputItem, OutputQuery, OutputView, StdStream};

/// Bytes of the throughput stream.
const STREAM_BYTES: u64 = 256 << 20;
/// Bytes of the untimed warm-up stream, per side.
const WARMUP_STREAM_BYTES: u64 = 16 << 20;
/// Timed streams per side.
const STREAM_RUNS: usize = 3;
/// Concurrent clients of the latency runs.
const CLIENTS: [usize; 3] = [1, 10, 50];
/// Calls per concurrency level and side (split evenly over the clients).
const CALLS: usize = 200;
/// Processes a shell makes for the floor row (`/bin/true` in a loop).
const FLOOR_PROCS: u32 = 100;
/// Untimed `true` calls per side before the latency runs.
const EXEC_WARMUPS: usize = 5;
/// Longest one stream may take before the bench gives up.
const STREAM_LIMIT: Duration = Duration::from_secs(300);
/// The file the fast-writer stream `cat`s, in each side's sandbox.
const CAT_FILE: &str = "/tmp/space-bench-cat";

fn main() {
    let (rt, facts) = bench_start();
    let flags = rawsc::server_flags(&["--output-cap-mib", "0"]);
    let server = rt.block_on(TestServer::start_with(&flags));
    let c = rawsc::client_of(&server);

    // Our sandbox; its OCI bundle is the one the raw side runs.
    let ours = rt.block_on(rawsc::create_busybox(&c));
    let our_bundle = rawsc::our_bundle(&server, &ours);
    let raw = rawsc::raw_of(&server, &our_bundle);
    let rid = raw.start_new("main");

    rt.block_on(check_ours(&c, &ours));
    check_raw(&raw, &rid);

    // The raw side again, placed as our server places ours: on our sandbox's CPUs (the sides
    // run one after the other, never at once). `None` where ours is not pinned or the raw
    // cgroup has no cpuset.
    let raw_all_cpus = rawsc::cgroup_cpus(rawsc::RAW_CGROUP_PARENT, &rid);
    let pinned = rawsc::cgroup_cpus("space", &ours)
        .zip(raw_all_cpus.clone())
        .filter(|(o, all)| o != all)
        .map(|(o, all)| RawPin { ours: o, all });
    eprintln!(
        "bench: our sandbox runs on CPUs {:?}, the raw one on {:?}",
        rawsc::cgroup_cpus("space", &ours),
        raw_all_cpus
    );
    // Runs `f` with the raw container pinned to our sandbox's CPUs, then unpins it.
    let pinned_raw = |f: &mut dyn FnMut()| -> bool {
        let Some(p) = &pinned else { return false };
        if !rawsc::set_cgroup_cpus(rawsc::RAW_CGROUP_PARENT, &rid, &p.ours) {
            return false;
        }
        f();
        assert!(
            rawsc::set_cgroup_cpus(rawsc::RAW_CGROUP_PARENT, &rid, &p.all),
            "unpinning the raw container"
        );
        true
    };

    // 0. The floor: what making one process costs a sandbox, whoever asks for it. A shell in
    // the sandbox runs `/bin/true` FLOOR_PROCS times; the sandbox CPU charged, per process.
    let floor_script =
        format!("i=0; while [ $i -lt {FLOOR_PROCS} ]; do /bin/true; i=$((i+1)); done");
    let (done, o_floor) = rawsc::cpu_over("space", &ours, || {
        rt.block_on(rawsc::sh(&c, &ours, &floor_script))
    });
    assert_eq!(
        done.result.as_ref().and_then(|r| r.exit_code),
        Some(0),
        "{done:?}"
    );
    let o_floor = o_floor.map(|d| d / FLOOR_PROCS);
    let raw_floor = || {
        rawsc::cpu_over(rawsc::RAW_CGROUP_PARENT, &rid, || {
            raw.exec(&rid, &["/bin/sh", "-c", &floor_script])
        })
        .1
        .map(|d| d / FLOOR_PROCS)
    };
    let r_floor_cpu = raw_floor();
    let mut rp_floor_cpu = None;
    pinned_raw(&mut || rp_floor_cpu = raw_floor());

    // 1. stdout throughput, interleaved so that background load hits both sides alike.
    eprintln!(
        "bench: stdout {} MiB x{STREAM_RUNS} (each side, after a {} MiB warm-up)",
        STREAM_BYTES >> 20,
        WARMUP_STREAM_BYTES >> 20
    );
    let o_warm = rt.block_on(stream_ours(&c, &ours, WARMUP_STREAM_BYTES));
    let r_warm = stream_raw(&raw, &rid, WARMUP_STREAM_BYTES);
    eprintln!(
        "bench: warm-up stream: ours {:.1} ms, raw {:.1} ms",
        ms(o_warm.follow),
        ms(r_warm)
    );
    let mut o_follow = Vec::new();
    let mut o_plain = Vec::new();
    let mut o_raw = Vec::new();
    let mut r_stream = Vec::new();
    let mut rp_stream = Vec::new();
    // Sandbox CPU per streamed MiB, each side: steadier than MiB/s on a host whose speed
    // swings from run to run, and what bounds a 1-vCPU sandbox's stream.
    let mut o_cpu_mib = Vec::new();
    let mut r_cpu_mib = Vec::new();
    let per_mib = |cpu: Option<Duration>, streams: u64| {
        cpu.map(|d| d / u32::try_from(streams * (STREAM_BYTES >> 20)).unwrap())
    };
    for i in 0..STREAM_RUNS {
        let (o, o_cpu) = rawsc::cpu_over("space", &ours, || {
            rt.block_on(stream_ours(&c, &ours, STREAM_BYTES))
        });
        // Two commands streamed (followed as NDJSON, then as raw bytes); the re-read in
        // between runs nothing in the sandbox.
        o_cpu_mib.extend(per_mib(o_cpu, 2));
        let (r, r_cpu) = rawsc::cpu_over(rawsc::RAW_CGROUP_PARENT, &rid, || {
            stream_raw(&raw, &rid, STREAM_BYTES)
        });
        r_cpu_mib.extend(per_mib(r_cpu, 1));
        pinned_raw(&mut || rp_stream.push(stream_raw(&raw, &rid, STREAM_BYTES)));
        eprintln!(
            "bench: stream {i}: ours {:.0} MiB/s (format=raw {:.0} MiB/s, plain re-read {:.0} MiB/s), raw {:.0} MiB/s, raw pinned {}",
            mib_per_s(STREAM_BYTES, o.follow),
            mib_per_s(STREAM_BYTES, o.raw),
            mib_per_s(STREAM_BYTES, o.plain),
            mib_per_s(STREAM_BYTES, r),
            rp_stream.last().map_or("n/a".to_string(), |d| format!(
                "{:.0} MiB/s",
                mib_per_s(STREAM_BYTES, *d)
            ))
        );
        o_follow.push(o.follow);
        o_plain.push(o.plain);
        o_raw.push(o.raw);
        r_stream.push(r);
    }
    // 1b. A fast writer: `cat` of a file moves it in large writes (`sendfile`), so the
    // relay, not the writer, sets the pace. Followed as raw bytes, our fastest view.
    let make_file = format!("/bin/head -c {STREAM_BYTES} /dev/zero > {CAT_FILE}");
    let made = rt.block_on(rawsc::sh(&c, &ours, &make_file));
    assert_eq!(
        made.result.and_then(|r| r.exit_code),
        Some(0),
        "{make_file}"
    );
    raw.exec(&rid, &["/bin/sh", "-c", &make_file]);
    let mut o_cat = Vec::new();
    let mut r_cat = Vec::new();
    for i in 0..STREAM_RUNS {
        o_cat.push(rt.block_on(cat_ours(&c, &ours, STREAM_BYTES)));
        let (took, count) = raw.exec_count(&rid, &["/bin/cat", CAT_FILE]);
        assert_eq!(count, STREAM_BYTES, "raw cat of {rid}");
        r_cat.push(took);
        eprintln!(
            "bench: cat {i}: ours {:.0} MiB/s, raw {:.0} MiB/s",
            mib_per_s(STREAM_BYTES, o_cat[i]),
            mib_per_s(STREAM_BYTES, took)
        );
    }
    let floor_cmd = format!("/bin/head -c {STREAM_BYTES} /dev/zero > /dev/null");
    let (r_floor, _) = raw.exec(&rid, &["/bin/sh", "-c", &floor_cmd]);
    // The same bytes through one pipe between two processes in the sandbox: what any relay
    // by an in-sandbox process (as the agent is) pays before a byte leaves the sandbox.
    let hop_cmd = format!("/bin/head -c {STREAM_BYTES} /dev/zero | /bin/cat > /dev/null");
    let (r_hop, _) = raw.exec(&rid, &["/bin/sh", "-c", &hop_cmd]);
    rt.block_on(check_ours(&c, &ours));
    check_raw(&raw, &rid);

    // 2. exec latency of `true` at each concurrency (SPACE_BENCH_STREAM_ONLY=1 skips it).
    let levels_wanted: &[usize] = if std::env::var_os("SPACE_BENCH_STREAM_ONLY").is_some() {
        &[]
    } else {
        &CLIENTS
    };
    eprintln!("bench: exec true, {CALLS} calls at each of {levels_wanted:?} clients (each side)");
    let warm = latency_client(&server);
    for _ in 0..EXEC_WARMUPS {
        rt.block_on(timed_true(&warm, &ours));
        raw.exec(&rid, &["/bin/true"]);
    }
    // Each side's CPU quota (the same bundle's): with the CPU a call costs, the most calls
    // per second either side could make.
    let ours_quota = common::cgroup_cpu_quota("space", &ours);
    let raw_quota = common::cgroup_cpu_quota(rawsc::RAW_CGROUP_PARENT, &rid);
    let mut levels = Vec::new();
    for &clients in levels_wanted {
        let calls = CALLS.div_ceil(clients);
        // The CPU each side's sandbox is charged for (its cgroup, capped by its vCPU quota).
        let ((o, o_wall), o_cpu) = rawsc::cpu_over("space", &ours, || {
            let t0 = Instant::now();
            let o = rt.block_on(latency_ours(&server, &ours, clients, calls));
            (o, t0.elapsed())
        });
        let timed_raw = || {
            rawsc::cpu_over(rawsc::RAW_CGROUP_PARENT, &rid, || {
                let t0 = Instant::now();
                let r = latency_raw(&raw, &rid, clients, calls);
                (r, t0.elapsed())
            })
        };
        let ((r, r_wall), r_cpu) = timed_raw();
        let mut raw_pinned = None;
        pinned_raw(&mut || {
            let ((lat, wall), cpu) = timed_raw();
            raw_pinned = Some((lat, wall, cpu));
        });
        eprintln!(
            "bench: exec true, {clients} clients x {calls}: ours p50 {:.1} ms in {:.1} s, raw p50 {:.1} ms in {:.1} s",
            ms(percentile(&o.iter().map(|c| c.0).collect::<Vec<_>>(), 50)),
            o_wall.as_secs_f64(),
            ms(percentile(&r, 50)),
            r_wall.as_secs_f64()
        );
        levels.push(Level {
            clients,
            calls,
            ours: o.iter().map(|c| c.0).collect(),
            agent: o.iter().map(|c| c.1).collect(),
            raw: r,
            ours_wall: o_wall,
            raw_wall: r_wall,
            ours_cpu: o_cpu,
            raw_cpu: r_cpu,
            raw_pinned,
        });
    }
    rt.block_on(check_ours(&c, &ours));
    check_raw(&raw, &rid);

    // Clean up, then check that nothing of ours or the raw side is left running.
    let left = rawsc::teardown(&rt, server, &c, &ours, raw, &rid);
    rawsc::assert_nothing_left(&left, &rid);

    // The table.
    table_head("commands", &facts);
    let rate = |d: Duration| mib_per_s(STREAM_BYTES, d);
    let stream = format!("stdout {} MiB, MiB/s (n={STREAM_RUNS})", STREAM_BYTES >> 20);
    // The median time is the median rate; the slowest run is the lowest rate.
    row(
        &stream,
        "median",
        rate(median(&o_follow)),
        rate(median(&r_stream)),
        "MiB/s",
    );
    row(
        &stream,
        "min",
        rate(max(&o_follow)),
        rate(max(&r_stream)),
        "MiB/s",
    );
    let raw_stream = format!(
        "stdout {} MiB, format=raw, MiB/s (n={STREAM_RUNS})",
        STREAM_BYTES >> 20
    );
    row(
        &raw_stream,
        "median",
        rate(median(&o_raw)),
        rate(median(&r_stream)),
        "MiB/s",
    );
    row(
        &raw_stream,
        "min",
        rate(max(&o_raw)),
        rate(max(&r_stream)),
        "MiB/s",
    );
    let cat_stream = format!(
        "cat of a {} MiB file, format=raw, MiB/s (n={STREAM_RUNS})",
        STREAM_BYTES >> 20
    );
    row(
        &cat_stream,
        "median",
        rate(median(&o_cat)),
        rate(median(&r_cat)),
        "MiB/s",
    );
    row(
        &cat_stream,
        "min",
        rate(max(&o_cat)),
        rate(max(&r_cat)),
        "MiB/s",
    );
    if !o_cpu_mib.is_empty() && o_cpu_mib.len() == r_cpu_mib.len() {
        row(
            "  sandbox CPU per MiB streamed",
            "median",
            ms(median(&o_cpu_mib)),
            ms(median(&r_cpu_mib)),
            "ms",
        );
    }
    row(
        "  POST to result line (extra)",
        "median",
        ms(median(&o_follow)),
        ms(median(&r_stream)),
        "ms",
    );
    one_side(
        "  re-read after exit (extra)",
        "median",
        format!("{:.1} MiB/s", rate(median(&o_plain))),
        "n/a".into(),
    );
    one_side(
        "  head to /dev/null in sandbox (extra)",
        "n=1",
        "n/a".into(),
        format!("{:.1} MiB/s", rate(r_floor)),
    );
    one_side(
        "  head | cat in sandbox (extra)",
        "n=1",
        "n/a".into(),
        format!("{:.1} MiB/s", rate(r_hop)),
    );
    if let (Some(o), Some(r)) = (o_floor, r_floor_cpu) {
        row(
            "a shell's fork+exec of `true`, CPU",
            "mean",
            ms(o),
            ms(r),
            "ms",
        );
    }
    if let (Some(o), Some(r)) = (o_floor, rp_floor_cpu) {
        row("  the same, raw pinned (extra)", "mean", ms(o), ms(r), "ms");
    }
    if !rp_stream.is_empty() {
        row(
            "  stdout vs raw pinned (extra)",
            "median",
            rate(median(&o_follow)),
            rate(median(&rp_stream)),
            "MiB/s",
        );
        row(
            "  format=raw vs raw pinned (extra)",
            "median",
            rate(median(&o_raw)),
            rate(median(&rp_stream)),
            "MiB/s",
        );
    }
    for l in &levels {
        let clients = format!(
            "{} client{}",
            l.clients,
            if l.clients == 1 { "" } else { "s" }
        );
        let metric = format!("exec `true`, {clients} (n={})", l.clients * l.calls);
        p50_p95_rows(&metric, "p50", &l.ours, &l.raw);
        one_side(
            "  in the agent, duration_ms (extra)",
            "p50",
            format!("{:.1} ms", ms(percentile(&l.agent, 50))),
            "n/a".into(),
        );
        let n = (l.clients * l.calls) as f64;
        row(
            &format!("  calls/s, {clients} (extra)"),
            "",
            n / l.ours_wall.as_secs_f64(),
            n / l.raw_wall.as_secs_f64(),
            "/s",
        );
        if let (Some(o), Some(r)) = (l.ours_cpu, l.raw_cpu) {
            row(
                &format!("  sandbox CPU per call, {clients} (extra)"),
                "mean",
                ms(o) / n,
                ms(r) / n,
                "ms",
            );
            if let (Some(oq), Some(rq)) = (ours_quota, raw_quota) {
                row(
                    &format!("  calls/s its vCPU quota allows, {clients} (extra)"),
                    "",
                    oq * 1000.0 / (ms(o) / n),
                    rq * 1000.0 / (ms(r) / n),
                    "/s",
                );
            }
        }
        if let Some((lat, wall, cpu)) = &l.raw_pinned {
            row(
                "  p50 vs raw pinned (extra)",
                "p50",
                ms(percentile(&l.ours, 50)),
                ms(percentile(lat, 50)),
                "ms",
            );
            row(
                "  calls/s vs raw pinned (extra)",
                "",
                n / l.ours_wall.as_secs_f64(),
                n / wall.as_secs_f64(),
                "/s",
            );
            if let (Some(o), Some(r)) = (l.ours_cpu, cpu) {
                row(
                    "  CPU per call vs raw pinned (extra)",
                    "mean",
                    ms(o) / n,
                    ms(*r) / n,
                    "ms",
                );
            }
        }
    }
    println!(
        "notes: ratio = ours / raw (above 1 is better for MiB/s and calls/s, worse for ms). \
         ours stream = POST, then GET output?follow=true&stream=stdout from the POST's answer \
         until the result line, every chunk base64-decoded, its offset checked and its bytes \
         checked to be zero; format=raw = the same, another command, with \
         GET output?follow=true&stream=stdout&format=raw (bytes alone, each checked to be \
         zero) and then GET of the command for its result; the server keeps all output \
         (--output-cap-mib 0). raw stream = a \
         whole `runsc exec /bin/head` process, stdout counted through a pipe; cat of a file = \
         `/bin/cat` of a file of zeros made first in each sandbox (in large writes, so the \
         relay sets the pace): ours followed with format=raw as above, raw a whole \
         `runsc exec /bin/cat`; re-read = GET \
         output?stream=stdout without follow after the end; head to /dev/null = `runsc exec \
         /bin/sh -c 'head ... > /dev/null'`; head | cat = the same through one pipe in the \
         sandbox to `cat > /dev/null`, the toll of any relay by an in-sandbox process; sandbox CPU per MiB \
         streamed = the CPU charged to each side's sandbox cgroup over one run of the stream \
         (ours: the NDJSON and the format=raw command together), divided by the MiB \
         streamed. One untimed {} MiB warm-up stream and \
         {EXEC_WARMUPS} untimed `true` calls per side. ours exec = POST with wait:true from \
         each client on its own connection; raw exec = a whole `runsc exec /bin/true` process \
         per call; each client makes its calls one after another, ours at a level before raw; \
         in the agent = result.duration_ms, from the agent taking the spawn request to reaping \
         `true`; sandbox CPU per call = the CPU charged to each side's sandbox cgroup over \
         the level (Sentry, agent and `true` together), divided by the calls: with the \
         sandbox's vCPU quota it bounds the calls per second either side can reach: calls/s \
         its vCPU quota allows = the quota's CPUs (cpu.cfs_quota_us / cpu.cfs_period_us) x \
         1000 / that CPU per call in ms. \
         raw pinned = the raw container again, its cgroup's cpuset.cpus set to our sandbox's \
         (as our server places sandboxes; raw runsc does not), then set back; a shell's \
         fork+exec of `true` = the sandbox CPU charged while `sh -c` in the sandbox runs \
         `/bin/true` {FLOOR_PROCS} times (ours through POST with wait:true, raw through \
         `runsc exec`), divided by {FLOOR_PROCS}: what making one process costs the sandbox \
         whoever asks for it. `echo ok` checked on both sides after each part.",
        WARMUP_STREAM_BYTES >> 20
    );
}

/// The samples of one concurrency level.
struct Level {
    clients: usize,
    calls: usize,
    ours: Vec<Duration>,
    /// The agent's `duration_ms` of each of our calls.
    agent: Vec<Duration>,
    raw: Vec<Duration>,
    ours_wall: Duration,
    raw_wall: Duration,
    /// CPU charged to each side's sandbox cgroup over the level (`None`: not readable).
    ours_cpu: Option<Duration>,
    raw_cpu: Option<Duration>,
    /// The raw side again, pinned to our sandbox's CPUs: latencies, wall time, CPU.
    raw_pinned: Option<(Vec<Duration>, Duration, Option<Duration>)>,
}

/// Our sandbox's CPUs, and all the raw container's (to unpin it again).
struct RawPin {
    ours: String,
    all: String,
}

/// Timings of one of our streams.
struct OurStream {
    /// From the POST to the result line of the followed output.
    follow: Duration,
    /// A whole read of the output without `follow`, after the command ended.
    plain: Duration,
    /// Another command's output followed with `format=raw`, from the POST to its
    /// result read after the body's end.
    raw: Duration,
}

/// `head -c bytes /dev/zero` through our API, its stdout followed to the end
/// and then read again without `follow`.
async fn stream_ours(c: &Client, sb: &str, bytes: u64) -> OurStream {
    let req = CreateCommandRequest {
        argv: Some(vec![
            "head".into(),
            "-c".into(),
            bytes.to_string(),
            "/dev/zero".into(),
        ]),
        ..Default::default()
    };
    let t0 = Instant::now();
    let cmd = c.create_command(sb, &req).await.expect("POST commands");
    let (count, end) = read_output(c, &cmd, true).await;
    let follow = t0.elapsed();
    check_stream(&cmd, count, &end, bytes);

    let t0 = Instant::now();
    let (count, end) = read_output(c, &cmd, false).await;
    let plain = t0.elapsed();
    check_stream(&cmd, count, &end, bytes);

    // The same again, another command, followed as raw bytes (`format=raw`).
    let raw = raw_ours(c, sb, &req, bytes).await;
    OurStream { follow, plain, raw }
}

/// `cat` of [`CAT_FILE`] (`bytes` of zeros) through our API, followed as raw bytes.
async fn cat_ours(c: &Client, sb: &str, bytes: u64) -> Duration {
    let req = CreateCommandRequest {
        argv: Some(vec!["/bin/cat".into(), CAT_FILE.into()]),
        ..Default::default()
    };
    raw_ours(c, sb, &req, bytes).await
}

/// A command whose stdout is `bytes` of zeros, followed as raw bytes (`format=raw`), then
/// its result from `GET …/commands/{cid}`: the time from the POST to that result.
async fn raw_ours(c: &Client, sb: &str, req: &CreateCommandRequest, bytes: u64) -> Duration {
    let t0 = Instant::now();
    let cmd = c.create_command(sb, req).await.expect("POST commands");
    let count = read_raw(c, &cmd).await;
    let done = c
        .command(sb, &cmd.id, None)
        .await
        .expect("GET the command after its raw output");
    let took = t0.elapsed();
    let end = End {
        state: done.state,
        result: done.result,
    };
    check_stream(&cmd, count, &end, bytes);
    took
}

/// Follows one command's stdout as raw bytes to its end, checking they are zeros.
async fn read_raw(c: &Client, cmd: &Command) -> u64 {
    let what = format!("raw output of {}", cmd.id);
    let read = async {
        let q = OutputQuery {
            offset: 0,
            follow: true,
            view: OutputView::Stdout,
        };
        let mut body = c
            .command_output_raw(&cmd.sandbox_id, &cmd.id, &q)
            .await
            .expect("raw output request");
        let mut count = 0u64;
        while let Some(data) = body.next().await {
            let data = data.unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(
                data.iter().all(|b| *b == 0),
                "{what}: a non-zero byte near offset {count}"
            );
            count += data.len() as u64;
        }
        count
    };
    tokio::time::timeout(STREAM_LIMIT, read)
        .await
        .unwrap_or_else(|_| panic!("reading {what} took over {STREAM_LIMIT:?}"))
}

/// How a stream of ours ended: its state and result.
#[derive(Debug)]
struct End {
    state: CommandState,
    result: Option<ProcessResult>,
}

/// A whole stream counted `bytes` bytes and ended with a clean result.
fn check_stream(cmd: &Command, count: u64, end: &End, bytes: u64) {
    assert_eq!(count, bytes, "stream of {}: {end:?}", cmd.id);
    assert_eq!(end.state, CommandState::Exited, "{end:?}");
    let r = end.result.as_ref().expect("an exited command has a result");
    assert_eq!(r.exit_code, Some(0), "{end:?}");
    assert_eq!(r.stdout_bytes, bytes, "{end:?}");
    assert!(!r.output_truncated, "{end:?}");
}

/// Reads one command's stdout to its end: every chunk is stdout, starts where
/// the last one ended and is zeros. The byte count and the end.
async fn read_output(c: &Client, cmd: &Command, follow: bool) -> (u64, End) {
    let what = format!("output of {} (follow {follow})", cmd.id);
    let read = async {
        let q = OutputQuery {
            offset: 0,
            follow,
            view: OutputView::Stdout,
        };
        let mut output = c
            .command_output(&cmd.sandbox_id, &cmd.id, &q)
            .await
            .expect("output request");
        let mut count = 0u64;
        while let Some(item) = output.next().await {
            match item.unwrap_or_else(|e| panic!("{what}: {e}")) {
                OutputItem::Chunk {
                    stream,
                    offset,
                    data,
                } => {
                    assert_eq!(stream, StdStream::Stdout, "{what}: chunk of another stream");
                    assert_eq!(offset, count, "{what}: a gap or overlap in the output");
                    assert!(
                        data.iter().all(|b| *b == 0),
                        "{what}: a non-zero byte near offset {count}"
                    );
                    count += data.len() as u64;
                }
                OutputItem::End { state, result, .. } => return (count, End { state, result }),
            }
        }
        panic!("{what} ended without a result line")
    };
    tokio::time::timeout(STREAM_LIMIT, read)
        .await
        .unwrap_or_else(|_| panic!("reading {what} took over {STREAM_LIMIT:?}"))
}

/// `runsc exec /bin/head -c bytes /dev/zero`, stdout counted: timed.
fn stream_raw(raw: &Raw, id: &str, bytes: u64) -> Duration {
    let n = bytes.to_string();
    let (took, count) = raw.exec_count(id, &["/bin/head", "-c", &n, "/dev/zero"]);
    assert_eq!(count, bytes, "raw stream of {id}");
    took
}

/// A client of its own (its own connection, as separate users would have), with
/// the deadline the bench gives one call.
fn latency_client(s: &TestServer) -> Client {
    Client::builder(&s.url, common::TOKEN)
        .timeout(Duration::from_secs(120))
        .build()
        .expect("a client")
}

/// `clients` concurrent clients, each making `calls` `true` calls in turn:
/// the latency of every call.
async fn latency_ours(
    s: &TestServer,
    sb: &str,
    clients: usize,
    calls: usize,
) -> Vec<(Duration, Duration)> {
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let c = latency_client(s);
            let sb = sb.to_string();
            tokio::spawn(async move {
                let mut v = Vec::with_capacity(calls);
                for _ in 0..calls {
                    v.push(timed_true(&c, &sb).await);
                }
                v
            })
        })
        .collect();
    let mut all = Vec::with_capacity(clients * calls);
    for t in tasks {
        all.extend(t.await.expect("latency client"));
    }
    all
}

/// One `true` through our API with `wait:true`, timed; with the agent's
/// `duration_ms` of it.
async fn timed_true(c: &Client, sb: &str) -> (Duration, Duration) {
    let req = CreateCommandRequest {
        argv: Some(vec!["true".into()]),
        wait: Some(true),
        ..Default::default()
    };
    let start = Instant::now();
    let cmd = c.create_command(sb, &req).await;
    let took = start.elapsed();
    let cmd = cmd.unwrap_or_else(|e| panic!("POST commands: {e}"));
    assert_eq!(cmd.state, CommandState::Exited, "{cmd:?}");
    let r = cmd.result.as_ref().expect("an exited command has a result");
    assert_eq!(r.exit_code, Some(0), "{cmd:?}");
    (took, Duration::from_millis(r.duration_ms))
}

/// `clients` threads, each running `calls` `runsc exec /bin/true` in turn:
/// the latency of every call.
fn latency_raw(raw: &Raw, id: &str, clients: usize, calls: usize) -> Vec<Duration> {
    std::thread::scope(|scope| {
        let threads: Vec<_> = (0..clients)
            .map(|_| {
                scope.spawn(|| {
                    (0..calls)
                        .map(|_| raw.exec(id, &["/bin/true"]).0)
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        threads
            .into_iter()
            .flat_map(|t| t.join().expect("raw latency client"))
            .collect()
    })
}

fn mib_per_s(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / (1024.0 * 1024.0) / d.as_secs_f64()
}
