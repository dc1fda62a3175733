//! File API benchmark: 1 GiB in and out of a sandbox through our API against
//! `tar` (or `cat`) piped through raw `runsc exec` into the same bundle, in one run.
//!
//! 1. a directory of 8 × 128 MiB files: `PUT …/files?path=/up&format=tar` with a
//!    tar stream packed on the fly, against `tar -c | runsc exec … tar -x`;
//!    then `GET …/files?path=/up&format=tar` with the stream counted, against
//!    `runsc exec … tar -c` counted through a pipe.
//! 2. one 1 GiB file: `PUT …/files?path=/big` (raw body) against
//!    `cat | runsc exec … sh -c 'cat > /big'`; `GET …/files?path=/big` against
//!    `runsc exec … cat /big`.
//!
//! Both sides write into the sandbox's writable layer; each run starts from an
//! empty target. Run it with `scripts/bench.sh`. Timings are reported, never
//! asserted; anything that functionally breaks panics.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "rawsc/mod.rs"]
mod rawsc;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::TestServer;
use futures::StreamExt;
use rawsc::{bench_start, check_ours, check_raw, median, row, sh, table_head, Raw};
use space_api::{CreateSandboxRequest, Resources};
use space_client::{Client, UploadOptions};

const FILES: usize = 8;
const FILE_BYTES: u64 = 128 << 20;
const TOTAL: u64 = FILES as u64 * FILE_BYTES;
const RUNS: usize = 2;

fn mib_per_s(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / (1 << 20) as f64 / d.as_secs_f64()
}

/// Deterministic, incompressible-enough content.
fn write_data(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir.join("tree")).expect("data dir");
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut buf = vec![0u8; 1 << 20];
    let mut fill = |buf: &mut [u8]| {
        for chunk in buf.chunks_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
        }
    };
    for i in 0..FILES {
        let mut f = std::fs::File::create(dir.join("tree").join(format!("part{i}"))).expect("file");
        for _ in 0..(FILE_BYTES >> 20) {
            fill(&mut buf);
            f.write_all(&buf).expect("write");
        }
    }
    let big = dir.join("big");
    let mut f = std::fs::File::create(&big).expect("big");
    for _ in 0..(TOTAL >> 20) {
        fill(&mut buf);
        f.write_all(&buf).expect("write");
    }
    big
}

/// A tar of `dir`, packed by a thread, as an upload body.
fn tar_body(dir: PathBuf) -> reqwest::Body {
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Vec<u8>>>(16);
    std::thread::spawn(move || {
        struct W(tokio::sync::mpsc::Sender<std::io::Result<Vec<u8>>>);
        impl Write for W {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0
                    .blocking_send(Ok(b.to_vec()))
                    .map_err(|_| std::io::Error::other("closed"))?;
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut b = tar::Builder::new(std::io::BufWriter::with_capacity(1 << 20, W(tx)));
        b.append_dir_all(".", &dir).expect("pack");
        b.into_inner().expect("finish").flush().expect("flush");
    });
    reqwest::Body::wrap_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
}

async fn ours_upload_tar(c: &Client, sb: &str, dir: &Path) -> Duration {
    let t0 = Instant::now();
    let r = c
        .upload_tar(sb, "/up", tar_body(dir.to_path_buf()), false)
        .await;
    let took = t0.elapsed();
    r.unwrap_or_else(|e| panic!("tar upload: {e}"));
    took
}

/// What [`ours_download`] fetches.
enum Fetch {
    /// A directory, as a tar.
    Tar(&'static str),
    File(&'static str),
}

async fn ours_download(c: &Client, sb: &str, what: Fetch) -> (Duration, u64) {
    let t0 = Instant::now();
    let mut stream = match what {
        Fetch::Tar(dir) => c.download_tar(sb, dir, false).await,
        Fetch::File(path) => c.download_file(sb, path).await.map(|d| d.body),
    }
    .unwrap_or_else(|e| panic!("download: {e}"));
    let mut n = 0u64;
    while let Some(chunk) = stream.next().await {
        n += chunk.expect("chunk").len() as u64;
    }
    (t0.elapsed(), n)
}

async fn ours_upload_file(c: &Client, sb: &str, file: &Path) -> Duration {
    let f = tokio::fs::File::open(file).await.expect("open");
    let opts = UploadOptions {
        content_length: Some(TOTAL),
        ..Default::default()
    };
    let t0 = Instant::now();
    let r = c
        .upload_file(
            sb,
            "/big",
            reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::with_capacity(f, 1 << 20)),
            &opts,
        )
        .await;
    let took = t0.elapsed();
    r.unwrap_or_else(|e| panic!("upload: {e}"));
    took
}

/// `producer | runsc exec <id> argv…`, timed from spawn to both exits.
fn raw_pipe_in(raw: &Raw, id: &str, mut producer: Command, argv: &[&str]) -> Duration {
    let t0 = Instant::now();
    let mut p = producer
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .expect("producer");
    let out = p.stdout.take().expect("producer stdout");
    let status = Command::new("runsc")
        .args(raw.short_globals())
        .arg("exec")
        .arg(id)
        .args(argv)
        .stdin(out)
        .stdout(Stdio::null())
        .status()
        .expect("runsc exec");
    assert!(p.wait().expect("producer").success());
    let took = t0.elapsed();
    assert!(status.success(), "runsc exec {argv:?}: {status}");
    took
}

fn main() {
    let (rt, facts) = bench_start();
    let data = tempfile::Builder::new()
        .prefix("spfb")
        .tempdir_in("/var/tmp")
        .expect("data dir");
    eprintln!("bench: writing {} MiB of test data twice", TOTAL >> 20);
    let big = write_data(data.path());
    let tree = data.path().join("tree");

    let flags = rawsc::server_flags(&["--max-upload-mib", "4096"]);
    let server = rt.block_on(TestServer::start_with(&flags));
    let c = rawsc::client_of(&server);
    let req = CreateSandboxRequest {
        template: "busybox".into(),
        resources: Some(Resources {
            disk_mib: Some(3072),
            memory_mib: Some(1024),
            ..Default::default()
        }),
        ..Default::default()
    };
    let ours = rt.block_on(rawsc::create_ours(&c, &req));
    let raw = rawsc::raw_of(&server, &rawsc::our_bundle(&server, &ours));
    let rid = raw.start_new("main");
    rt.block_on(check_ours(&c, &ours));
    check_raw(&raw, &rid);

    let mut o_up = Vec::new();
    let mut r_up = Vec::new();
    let mut o_down = Vec::new();
    let mut r_down = Vec::new();
    let mut o_fup = Vec::new();
    let mut r_fup = Vec::new();
    let mut o_fdown = Vec::new();
    let mut r_fdown = Vec::new();
    for i in 0..RUNS {
        rt.block_on(sh(&c, &ours, "rm -rf /up /big"));
        raw.exec(&rid, &["/bin/sh", "-c", "rm -rf /up /big; mkdir -p /up"]);

        let o = rt.block_on(ours_upload_tar(&c, &ours, &tree));
        let mut tar = Command::new("tar");
        tar.args(["-c", "-C"]).arg(&tree).arg(".");
        let r = raw_pipe_in(&raw, &rid, tar, &["/bin/tar", "-x", "-C", "/up"]);
        eprintln!(
            "bench: run {i}: tar upload ours {:.0} MiB/s, raw {:.0} MiB/s",
            mib_per_s(TOTAL, o),
            mib_per_s(TOTAL, r)
        );
        o_up.push(o);
        r_up.push(r);

        let (o, n) = rt.block_on(ours_download(&c, &ours, Fetch::Tar("/up")));
        assert!(n >= TOTAL, "tar download of {n} bytes");
        let (r, rn) = raw.exec_count(&rid, &["/bin/tar", "-c", "-C", "/up", "."]);
        assert!(rn >= TOTAL);
        eprintln!(
            "bench: run {i}: tar download ours {:.0} MiB/s, raw {:.0} MiB/s",
            mib_per_s(TOTAL, o),
            mib_per_s(TOTAL, r)
        );
        o_down.push(o);
        r_down.push(r);

        rt.block_on(sh(&c, &ours, "rm -rf /up"));
        raw.exec(&rid, &["/bin/sh", "-c", "rm -rf /up"]);

        let o = rt.block_on(ours_upload_file(&c, &ours, &big));
        let mut cat = Command::new("cat");
        cat.arg(&big);
        let r = raw_pipe_in(&raw, &rid, cat, &["/bin/sh", "-c", "cat > /big"]);
        o_fup.push(o);
        r_fup.push(r);
        let (o, n) = rt.block_on(ours_download(&c, &ours, Fetch::File("/big")));
        assert_eq!(n, TOTAL);
        let (r, rn) = raw.exec_count(&rid, &["/bin/cat", "/big"]);
        assert_eq!(rn, TOTAL);
        o_fdown.push(o);
        r_fdown.push(r);
        eprintln!(
            "bench: run {i}: file upload ours {:.0} MiB/s raw {:.0}; download ours {:.0} raw {:.0}",
            mib_per_s(TOTAL, o_fup[i]),
            mib_per_s(TOTAL, r_fup[i]),
            mib_per_s(TOTAL, o_fdown[i]),
            mib_per_s(TOTAL, r_fdown[i])
        );
    }
    // The data arrived intact: one file compared end to end.
    let sum_in = rt.block_on(sh(&c, &ours, "md5sum < /big")).stdout;
    let mut h = Command::new("md5sum")
        .stdin(std::fs::File::open(&big).expect("big"))
        .stdout(Stdio::piped())
        .spawn()
        .expect("md5sum");
    let mut local = String::new();
    h.stdout
        .take()
        .expect("stdout")
        .read_to_string(&mut local)
        .expect("md5");
    h.wait().expect("md5sum");
    assert_eq!(
        sum_in.as_deref().unwrap_or("").split_whitespace().next(),
        local.split_whitespace().next()
    );
    rt.block_on(check_ours(&c, &ours));
    check_raw(&raw, &rid);
    let left = rawsc::teardown(&rt, server, &c, &ours, raw, &rid);
    rawsc::assert_nothing_left(&left, &rid);

    table_head("files", &facts);
    let rate = |d: Duration| mib_per_s(TOTAL, d);
    for (metric, o, r) in [
        ("upload 1 GiB dir as tar, MiB/s", &o_up, &r_up),
        ("download 1 GiB dir as tar, MiB/s", &o_down, &r_down),
        ("upload one 1 GiB file, MiB/s", &o_fup, &r_fup),
        ("download one 1 GiB file, MiB/s", &o_fdown, &r_fdown),
    ] {
        row(
            &format!("{metric} (n={RUNS})"),
            "median",
            rate(median(o)),
            rate(median(r)),
            "MiB/s",
        );
    }
}
