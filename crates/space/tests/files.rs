//! The file API against a real sandbox: upload, download, tar both ways, list,
//! stat, mkdir, move, remove; state rules; and one test per trick that must not
//! reach outside the sandbox. Real runsc, real agent, real HTTP.

mod common;

use std::io::Write;

use common::TestServer;
use futures::TryStreamExt;
use serde_json::{json, Value};

/// `PUT …/files?QUERY` with `body`.
async fn put(s: &TestServer, sb: &str, query: &str, body: Vec<u8>) -> (u16, Value) {
    let resp = s
        .req(
            reqwest::Method::PUT,
            &format!("/v1/sandboxes/{sb}/files?{query}"),
        )
        .body(body)
        .send()
        .await
        .expect("upload");
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap_or_default();
    (
        status,
        serde_json::from_str(&text).unwrap_or(json!({ "raw": text })),
    )
}

/// `GET …/files?QUERY`: status, headers, body.
async fn fetch(
    s: &TestServer,
    sb: &str,
    query: &str,
) -> (u16, reqwest::header::HeaderMap, Vec<u8>) {
    let resp = s
        .req(
            reqwest::Method::GET,
            &format!("/v1/sandboxes/{sb}/files?{query}"),
        )
        .send()
        .await
        .expect("download");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    (status, headers, resp.bytes().await.expect("body").to_vec())
}

fn enc(p: &str) -> String {
    p.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'/' | b'.' | b'-' | b'_' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A tar with the given entries: (name bytes, kind, data or link target, mode, uid).
enum Entry<'a> {
    File(&'a [u8], &'a [u8], u32, u64),
    Dir(&'a [u8], u32),
    Symlink(&'a [u8], &'a [u8]),
    HardLink(&'a [u8], &'a [u8]),
    CharDevice(&'a [u8]),
}

fn raw_name(header: &mut tar::Header, name: &[u8]) {
    // Write the name field directly: the tar crate refuses `..` and absolute
    // names, which is exactly what these tests need to send.
    let field = &mut header.as_old_mut().name;
    field.fill(0);
    field[..name.len()].copy_from_slice(name);
}

fn make_tar(entries: &[Entry]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_gnu();
        h.set_mtime(1_700_000_000);
        match e {
            Entry::File(name, data, mode, uid) => {
                raw_name(&mut h, name);
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(data.len() as u64);
                h.set_mode(*mode);
                h.set_uid(*uid);
                h.set_gid(*uid);
                h.set_cksum();
                b.append(&h, *data).expect("append");
            }
            Entry::Dir(name, mode) => {
                raw_name(&mut h, name);
                h.set_entry_type(tar::EntryType::Directory);
                h.set_size(0);
                h.set_mode(*mode);
                h.set_cksum();
                b.append(&h, &[][..]).expect("append");
            }
            Entry::Symlink(name, target) | Entry::HardLink(name, target) => {
                raw_name(&mut h, name);
                h.set_entry_type(if matches!(e, Entry::Symlink(..)) {
                    tar::EntryType::Symlink
                } else {
                    tar::EntryType::Link
                });
                h.set_size(0);
                h.set_mode(0o777);
                let link = &mut h.as_old_mut().linkname;
                link.fill(0);
                link[..target.len()].copy_from_slice(target);
                h.set_cksum();
                b.append(&h, &[][..]).expect("append");
            }
            Entry::CharDevice(name) => {
                raw_name(&mut h, name);
                h.set_entry_type(tar::EntryType::Char);
                h.set_size(0);
                h.set_mode(0o666);
                h.set_device_major(1).expect("major");
                h.set_device_minor(3).expect("minor");
                h.set_cksum();
                b.append(&h, &[][..]).expect("append");
            }
        }
    }
    b.into_inner().expect("tar")
}

/// Names and contents of the regular files in a tar.
fn tar_files(bytes: &[u8]) -> Vec<(Vec<u8>, Vec<u8>, u32, u64)> {
    let mut a = tar::Archive::new(bytes);
    let mut out = Vec::new();
    for e in a.entries().expect("entries") {
        let mut e = e.expect("entry");
        if e.header().entry_type() != tar::EntryType::Regular {
            continue;
        }
        let name = e.path_bytes().to_vec();
        let mode = e.header().mode().unwrap_or(0);
        let uid = e.header().uid().unwrap_or(0);
        let mut data = Vec::new();
        std::io::Read::read_to_end(&mut e, &mut data).expect("read");
        out.push((name, data, mode, uid));
    }
    out.sort();
    out
}

#[tokio::test]
async fn upload_download_stat_list_mkdir_move_remove() {
    let s = TestServer::start().await;
    let sb = s.create("busybox").await;
    let files = format!("/v1/sandboxes/{sb}/files");

    let (st, v) = s
        .post(
            &format!("{files}/mkdir"),
            json!({"path": "/work/a/b", "mode": 0o750}),
        )
        .await;
    assert_eq!(st, 201, "{v}");
    assert_eq!(v["type"], "dir");
    assert_eq!(v["mode"], 0o750);

    let (st, v) = put(
        &s,
        &sb,
        "path=/work/a/b/hello.txt&mode=0640&uid=1000&gid=1000",
        b"hello\n".to_vec(),
    )
    .await;
    assert_eq!(st, 201, "{v}");
    assert_eq!(v["size"], 6);
    // The sandbox sees the same file, mode and owner.
    let seen = s
        .sh(
            &sb,
            "cat /work/a/b/hello.txt; stat -c '%a %u %g' /work/a/b/hello.txt",
        )
        .await;
    assert_eq!(seen["stdout"], "hello\n640 1000 1000\n", "{seen}");

    let (st, v) = s
        .get(&format!("{files}/stat?path=/work/a/b/hello.txt"))
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        (v["type"].clone(), v["mode"].clone(), v["uid"].clone()),
        (json!("file"), json!(0o640), json!(1000))
    );

    let (st, h, body) = fetch(&s, &sb, "path=/work/a/b/hello.txt").await;
    assert_eq!(st, 200);
    assert_eq!(body, b"hello\n");
    assert_eq!(h["x-space-mode"], "0640");
    assert_eq!(h["x-space-uid"], "1000");

    // A file written by a command, read back.
    s.sh(
        &sb,
        "head -c 300000 /dev/urandom > /work/rand; md5sum /work/rand",
    )
    .await;
    let (_, _, rand) = fetch(&s, &sb, "path=/work/rand").await;
    assert_eq!(rand.len(), 300_000);
    let sum = s.sh(&sb, "md5sum < /work/rand").await["stdout"].clone();
    let (st, _) = put(&s, &sb, "path=/work/rand2", rand.clone()).await;
    assert_eq!(st, 201);
    assert_eq!(s.sh(&sb, "md5sum < /work/rand2").await["stdout"], sum);

    let (st, v) = s.get(&format!("{files}/list?path=/work&depth=3")).await;
    assert_eq!(st, 200, "{v}");
    let paths: Vec<&str> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap())
        .collect();
    for p in [
        "/work/a",
        "/work/a/b",
        "/work/a/b/hello.txt",
        "/work/rand",
        "/work/rand2",
    ] {
        assert!(paths.contains(&p), "{p} missing from {paths:?}");
    }
    let (_, v) = s.get(&format!("{files}/list?path=/work&depth=1")).await;
    assert!(
        v["entries"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["path"] != "/work/a/b"),
        "{v}"
    );

    let (st, v) = s
        .post(
            &format!("{files}/move"),
            json!({"from": "/work/rand2", "to": "/work/a/moved"}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let (st, v) = s
        .post(
            &format!("{files}/move"),
            json!({"from": "/work/rand", "to": "/work/a/moved"}),
        )
        .await;
    assert_eq!(st, 409, "an existing target needs overwrite: {v}");

    let (st, v) = s.delete(&format!("{files}?path=/work/a")).await;
    assert_eq!(st, 409, "a non-empty directory needs recursive: {v}");
    let (st, v) = s
        .delete(&format!("{files}?path=/work/a&recursive=true"))
        .await;
    assert_eq!(st, 200, "{v}");
    let (st, _) = s.get(&format!("{files}/stat?path=/work/a")).await;
    assert_eq!(st, 404);
    assert_eq!(s.sh(&sb, "ls /work").await["stdout"], "rand\n");
    s.destroy(&sb).await;
}

#[tokio::test]
async fn tar_round_trip_keeps_modes_owners_and_odd_names() {
    let s = TestServer::start().await;
    let sb = s.create("busybox").await;
    let tar = make_tar(&[
        Entry::Dir(b"proj", 0o755),
        Entry::File(b"proj/run.sh", b"#!/bin/sh\necho ran\n", 0o755, 1000),
        Entry::File(b"proj/secret", b"s3cr3t", 0o600, 1234),
        Entry::File(b"proj/caf\xff", b"latin1 name", 0o644, 0),
        Entry::Symlink(b"proj/link", b"run.sh"),
        Entry::HardLink(b"proj/hard", b"proj/secret"),
    ]);
    let (st, v) = put(&s, &sb, "path=/dst&format=tar", tar).await;
    assert_eq!(st, 201, "{v}");
    let out = s
        .sh(
            &sb,
            "/dst/proj/link; stat -c '%a %u' /dst/proj/secret /dst/proj/run.sh; cat /dst/proj/hard",
        )
        .await;
    assert_eq!(out["stdout"], "ran\n600 1234\n755 1000\ns3cr3t", "{out}");

    let (_, v) = s
        .get(&format!("/v1/sandboxes/{sb}/files/list?path=/dst/proj"))
        .await;
    let odd = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e.get("name_base64").is_some())
        .unwrap_or_else(|| panic!("no entry with name_base64: {v}"));
    assert_eq!(odd["name_base64"], "Y2Fm/w==");

    // A failure in the middle of a download cuts the response off with an error:
    // a tree deeper than the agent walks.
    s.sh(
        &sb,
        "cd /tmp && for i in $(seq 300); do mkdir d && cd d; done; echo x > f",
    )
    .await;
    // The client sees the connection end early: before the response head when the
    // failure comes fast, or in the middle of the body.
    match s.client().download_tar(&sb, "/tmp/d", false).await {
        Ok(body) => assert!(
            body.try_collect::<Vec<_>>().await.is_err(),
            "a cut-off tar must not read as complete"
        ),
        Err(e) => assert!(e.is_transport(), "{e}"),
    }

    let (st, h, body) = fetch(&s, &sb, "path=/dst&format=tar").await;
    assert_eq!(st, 200);
    assert_eq!(h["content-type"], "application/x-tar");
    let got = tar_files(&body);
    let names: Vec<&[u8]> = got.iter().map(|(n, ..)| n.as_slice()).collect();
    assert!(
        names.iter().any(|n| n.ends_with(b"proj/caf\xff")),
        "{names:?}"
    );
    let secret = got
        .iter()
        // The two names of one inode: one is stored as the file, the other as a link to it.
        .find(|(n, ..)| n.ends_with(b"proj/secret") || n.ends_with(b"proj/hard"))
        .expect("secret");
    assert_eq!(
        (secret.1.as_slice(), secret.2 & 0o7777, secret.3),
        (&b"s3cr3t"[..], 0o600, 1234)
    );
    s.destroy(&sb).await;
}

#[tokio::test]
async fn state_rules_and_work_while_commands_run() {
    let s = TestServer::start().await;
    let sb = s.create("busybox").await;
    let files = format!("/v1/sandboxes/{sb}/files");
    // A busy command does not get in the way.
    let (st, bg) = s
        .post(
            &format!("/v1/sandboxes/{sb}/commands"),
            json!({"shell": "while :; do echo tick >> /tmp/ticks; sleep 0.05; done"}),
        )
        .await;
    assert_eq!(st, 201, "{bg}");
    for i in 0..10 {
        let (st, _) = put(&s, &sb, &format!("path=/tmp/f{i}"), vec![b'x'; 1000]).await;
        assert_eq!(st, 201);
    }
    // The loop's first tick may come after the uploads (a microVM under TCG starts slowly).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let body = loop {
        let (st, _, body) = fetch(&s, &sb, "path=/tmp/ticks").await;
        if st == 200 && !body.is_empty() {
            break body;
        }
        // 404 or empty: the loop has not written its first tick yet (`>>` creates the file
        // before the write).
        assert!(
            (st == 404 || st == 200) && std::time::Instant::now() < deadline,
            "status {st}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert!(body.starts_with(b"tick\n"));

    let pause = s
        .post(&format!("/v1/sandboxes/{sb}/pause"), json!({}))
        .await;
    s.wait_op(pause.1["id"].as_str().unwrap()).await;
    let (st, v) = s.get(&format!("{files}/stat?path=/tmp/f1")).await;
    assert_eq!(st, 409, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("paused"),
        "{v}"
    );
    let (st, _) = put(&s, &sb, "path=/tmp/p", b"x".to_vec()).await;
    assert_eq!(st, 409);
    let resume = s
        .post(&format!("/v1/sandboxes/{sb}/resume"), json!({}))
        .await;
    s.wait_op(resume.1["id"].as_str().unwrap()).await;
    let (st, _) = s.get(&format!("{files}/stat?path=/tmp/f1")).await;
    assert_eq!(st, 200);

    let suspend = s
        .post(&format!("/v1/sandboxes/{sb}/suspend"), json!({}))
        .await;
    s.wait_op(suspend.1["id"].as_str().unwrap()).await;
    let (st, _, _) = fetch(&s, &sb, "path=/tmp/f1").await;
    assert_eq!(st, 409);
    let resume = s
        .post(&format!("/v1/sandboxes/{sb}/resume"), json!({}))
        .await;
    s.wait_op(resume.1["id"].as_str().unwrap()).await;
    let (st, _, body) = fetch(&s, &sb, "path=/tmp/f9").await;
    assert_eq!((st, body.len()), (200, 1000));

    // Unknown sandboxes and malformed requests change nothing.
    let (st, _) = s
        .get("/v1/sandboxes/sb_aaaaaaaaaaaaaaaaaaaa/files/stat?path=/")
        .await;
    assert_eq!(st, 404);
    for q in [
        "",
        "path=relative",
        "path=/x&bogus=1",
        "path=/x&mode=999",
        "path=/x&format=zip",
        "path=/x&max_bytes=5",
    ] {
        let (st, v) = put(&s, &sb, q, b"x".to_vec()).await;
        assert_eq!(st, 400, "{q}: {v}");
    }
    let (st, v) = s
        .post(
            &format!("{files}/mkdir"),
            json!({"path": "/x", "colour": 1}),
        )
        .await;
    assert_eq!(st, 400, "{v}");
    let (st, v) = s.get(&format!("{files}/list?path=/&depth=0")).await;
    assert_eq!(st, 400, "{v}");
    let (st, v) = s.delete(&format!("{files}?path=/&recursive=true")).await;
    assert_eq!(st, 400, "{v}");
    s.destroy(&sb).await;
}

/// What the agent's host directory (bind-mounted at /.space/run) holds.
fn run_dir_entries(s: &TestServer, sb: &str) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(s.data_dir().join("sandboxes").join(sb).join("run"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
    names.sort();
    names
}

#[tokio::test]
async fn paths_cannot_leave_the_sandbox() {
    let s = TestServer::start_with(&["--max-upload-mib", "8"]).await;
    let sb = s.create("busybox").await;
    let files = format!("/v1/sandboxes/{sb}/files");
    let before = run_dir_entries(&s, &sb);

    // `..`
    for p in ["/tmp/../etc/passwd", "/..", "/tmp/.."] {
        let (st, v) = s.get(&format!("{files}/stat?path={}", enc(p))).await;
        assert_eq!(st, 400, "{p}: {v}");
        assert_eq!(v["error"]["code"], "invalid_path");
    }
    // The agent's own directory, /proc, /sys, /dev, directly and through symlinks.
    s.sh(&sb, "ln -s /.space/run /tmp/run; ln -s /proc/self /tmp/self; ln -s ../../../../dev /tmp/d; ln -s /etc /tmp/etc").await;
    for p in [
        "/.space/run/token",
        "/proc/1/environ",
        "/sys/kernel",
        "/dev/null",
        "/tmp/run/agent.sock",
        "/tmp/self/environ",
        "/tmp/d/zero",
    ] {
        let (st, _, body) = fetch(&s, &sb, &format!("path={}", enc(p))).await;
        assert_eq!(st, 403, "{p}: {}", String::from_utf8_lossy(&body));
    }
    let (st, v) = put(&s, &sb, "path=/tmp/run/planted", b"x".to_vec()).await;
    assert_eq!(st, 403, "{v}");
    let (st, v) = s
        .post(&format!("{files}/mkdir"), json!({"path": "/tmp/run/dir"}))
        .await;
    assert_eq!(st, 403, "{v}");
    let (st, v) = s
        .post(
            &format!("{files}/move"),
            json!({"from": "/tmp/etc", "to": "/tmp/run/x"}),
        )
        .await;
    assert_eq!(st, 403, "{v}");

    // An absolute symlink resolves inside the sandbox: its /etc, not the host's.
    s.sh(&sb, "echo sandbox-hostname > /etc/hostname").await;
    let (st, _, body) = fetch(&s, &sb, "path=/tmp/etc/hostname").await;
    assert_eq!((st, body.as_slice()), (200, &b"sandbox-hostname\n"[..]));
    let (st, _) = put(&s, &sb, "path=/tmp/etc/via-link", b"inside".to_vec()).await;
    assert_eq!(st, 201);
    assert_eq!(s.sh(&sb, "cat /etc/via-link").await["stdout"], "inside");
    assert!(!std::path::Path::new("/etc/via-link").exists());

    // Device nodes and fifos are never opened.
    s.sh(&sb, "mkfifo /tmp/fifo").await;
    let (st, _, _) = fetch(&s, &sb, "path=/tmp/fifo").await;
    assert_eq!(st, 400);
    let (st, v) = put(&s, &sb, "path=/tmp/fifo", b"x".to_vec()).await;
    assert!(st == 400 || st == 409 || st == 201, "{v}");
    let kind = s.sh(&sb, "stat -c %F /tmp/fifo 2>&1").await;
    assert!(st == 201 || kind["stdout"] == "fifo\n", "{kind}");

    // Tar tricks: `../`, absolute names, a hard link out, a device node, a symlinked parent.
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "dotdot",
            make_tar(&[
                Entry::File(b"ok", b"1", 0o644, 0),
                Entry::File(b"../escape", b"x", 0o644, 0),
            ]),
        ),
        (
            "absolute",
            make_tar(&[Entry::File(b"/etc/abs", b"x", 0o644, 0)]),
        ),
        (
            "hardlink out",
            make_tar(&[Entry::HardLink(b"h", b"/etc/hostname")]),
        ),
        (
            "hardlink dotdot",
            make_tar(&[Entry::HardLink(b"h", b"../../etc/hostname")]),
        ),
        ("device", make_tar(&[Entry::CharDevice(b"null2")])),
        (
            "through symlink",
            make_tar(&[
                Entry::Symlink(b"l", b"/etc"),
                Entry::File(b"l/through", b"x", 0o644, 0),
            ]),
        ),
    ];
    for (what, tar) in cases {
        let (st, v) = put(&s, &sb, "path=/up&format=tar", tar).await;
        assert_eq!(st, 400, "{what}: {v}");
        let left = s
            .sh(
                &sb,
                "ls -A /up 2>/dev/null; ls /etc/abs /etc/through /escape 2>/dev/null",
            )
            .await;
        assert_eq!(left["stdout"], "", "{what} left {left}");
    }

    // Huge names.
    let long = format!("/tmp/{}", "n".repeat(256));
    let (st, _) = put(&s, &sb, &format!("path={long}"), b"x".to_vec()).await;
    assert_eq!(st, 400);
    let deep = "/d".repeat(2100);
    let (st, _) = s.get(&format!("{files}/stat?path={deep}")).await;
    assert_eq!(st, 400);

    // A giant upload: cut off at the limit, nothing left behind.
    // The server answers 413 as soon as it knows, without reading the rest: the
    // client may see the answer or, still writing, a closed connection.
    let oversized = |r: Result<reqwest::Response, reqwest::Error>| match r {
        Ok(resp) => assert_eq!(resp.status().as_u16(), 413),
        Err(e) => assert!(e.is_request(), "{e:?}"),
    };
    oversized(
        s.req(reqwest::Method::PUT, &format!("{files}?path=/tmp/giant"))
            .body(vec![0u8; 9 << 20])
            .send()
            .await,
    );
    oversized(
        s.req(reqwest::Method::PUT, &format!("{files}?path=/tmp/giant2"))
            .body(reqwest::Body::wrap_stream(futures::stream::iter(
                (0..20).map(|_| Ok::<_, std::io::Error>(vec![1u8; 1 << 20])),
            )))
            .send()
            .await,
    );
    // Under the limit still works.
    let (st, v) = put(&s, &sb, "path=/tmp/fits", vec![7u8; 7 << 20]).await;
    assert_eq!(st, 201, "{v}");
    let left = s
        .sh(&sb, "ls -A /tmp | grep -c -e giant -e space-upload")
        .await;
    assert_eq!(left["stdout"], "0\n", "{left}");

    // A tar bomb: 256 MiB of zeros in a few hundred KiB of gzip.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    {
        let mut b = tar::Builder::new(&mut gz);
        let mut h = tar::Header::new_gnu();
        h.set_size(256 << 20);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, "bomb", std::io::repeat(0).take_bytes(256 << 20))
            .expect("bomb");
        b.finish().expect("finish");
    }
    let bomb = gz.finish().expect("gzip");
    assert!(bomb.len() < 2 << 20);
    let (st, v) = put(&s, &sb, "path=/bomb&format=tar&gzip=true", bomb).await;
    assert_eq!(st, 413, "{v}");
    assert_eq!(
        s.sh(&sb, "ls -A /bomb 2>/dev/null | wc -l").await["stdout"],
        "0\n"
    );

    // Nothing of all this reached the host side of /.space/run.
    assert_eq!(run_dir_entries(&s, &sb), before);
    s.destroy(&sb).await;
}

trait TakeBytes: std::io::Read + Sized {
    fn take_bytes(self, n: u64) -> std::io::Take<Self> {
        std::io::Read::take(self, n)
    }
}
impl<R: std::io::Read> TakeBytes for R {}

#[tokio::test]
async fn a_symlink_swapped_in_during_uploads_never_leads_out() {
    let s = TestServer::start().await;
    let sb = s.create("busybox").await;
    let before = run_dir_entries(&s, &sb);
    // Inside: flip /tmp/race between a real directory and a symlink to the agent's dir.
    let (st, flip) = s
        .post(
            &format!("/v1/sandboxes/{sb}/commands"),
            json!({"shell": "while :; do rm -rf /tmp/race; mkdir /tmp/race; rm -rf /tmp/race; ln -s /.space/run /tmp/race; done"}),
        )
        .await;
    assert_eq!(st, 201, "{flip}");
    let mut statuses = std::collections::BTreeMap::new();
    for i in 0..60 {
        let (st, _) = put(
            &s,
            &sb,
            &format!("path=/tmp/race/f{i}"),
            b"payload".to_vec(),
        )
        .await;
        *statuses.entry(st).or_insert(0) += 1;
        let tar = make_tar(&[Entry::File(format!("t{i}").as_bytes(), b"x", 0o644, 0)]);
        let (st, _) = put(&s, &sb, "path=/tmp/race&format=tar", tar).await;
        *statuses.entry(st).or_insert(0) += 1;
        let (st, _, _) = fetch(&s, &sb, "path=/tmp/race/agent.sock").await;
        assert_ne!(st, 200);
        assert!(st < 500, "status {st}");
    }
    assert!(
        statuses
            .keys()
            .all(|st| [201, 400, 403, 404, 409].contains(st)),
        "{statuses:?}"
    );
    assert_eq!(run_dir_entries(&s, &sb), before, "{statuses:?}");
    let mut out = std::io::stderr();
    let _ = writeln!(out, "race statuses: {statuses:?}");
    s.destroy(&sb).await;
}

/// An upload makes the file's missing parent directories, as E2B and Daytona do;
/// `parents=false` refuses instead (404), and nothing is made.
#[tokio::test]
async fn uploads_make_missing_parents_unless_told_not_to() {
    let s = TestServer::start().await;
    let sb = s.create("busybox").await;
    let files = format!("/v1/sandboxes/{sb}/files");

    let (st, v) = put(
        &s,
        &sb,
        "path=/proj/src/deep/main.rs",
        b"fn main() {}\n".to_vec(),
    )
    .await;
    assert_eq!(st, 201, "{v}");
    assert_eq!(v["path"], "/proj/src/deep/main.rs");
    let (st, v) = s.get(&format!("{files}/stat?path=/proj/src/deep")).await;
    assert_eq!((st, v["type"].as_str()), (200, Some("dir")), "{v}");
    let (st, _, body) = fetch(&s, &sb, "path=/proj/src/deep/main.rs").await;
    assert_eq!((st, &body[..]), (200, &b"fn main() {}\n"[..]));

    // Told not to: a missing parent is a 404 and nothing is made.
    let (st, v) = put(
        &s,
        &sb,
        "path=/other/dir/x.txt&parents=false",
        b"x".to_vec(),
    )
    .await;
    assert_eq!(st, 404, "{v}");
    let (st, _) = s.get(&format!("{files}/stat?path=/other")).await;
    assert_eq!(st, 404, "parents=false made a directory");
    // An existing parent needs nothing made, either way.
    let (st, v) = put(&s, &sb, "path=/proj/top.txt&parents=false", b"t".to_vec()).await;
    assert_eq!(st, 201, "{v}");

    // A parent that is a file: a clear 4xx, and the file is untouched.
    let (st, v) = put(&s, &sb, "path=/proj/top.txt/under.txt", b"u".to_vec()).await;
    assert!((400..500).contains(&st), "{st} {v}");
    let (_, _, body) = fetch(&s, &sb, "path=/proj/top.txt").await;
    assert_eq!(body, b"t");
    // A symlinked parent resolves inside the sandbox, as every path of the file API.
    s.sh(&sb, "ln -s /etc /proj/link").await;
    let (st, v) = put(&s, &sb, "path=/proj/link/new/x.txt", b"x".to_vec()).await;
    assert_eq!(st, 201, "{v}");
    assert_eq!(s.sh(&sb, "cat /etc/new/x.txt").await["stdout"], "x");

    // parents is an upload parameter of single files only.
    let (st, v) = put(&s, &sb, "path=/proj&format=tar&parents=true", Vec::new()).await;
    assert_eq!(st, 400, "{v}");
    let (st, _, _) = fetch(&s, &sb, "path=/proj/top.txt&parents=true").await;
    assert_eq!(st, 400);
    s.destroy(&sb).await;
}
