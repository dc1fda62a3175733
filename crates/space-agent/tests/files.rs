//! The file API of the real agent binary, run on the host with
//! `SPACE_AGENT_FILES_ROOT` pointing at a temporary directory: every endpoint,
//! and the ways a path or an archive could try to leave that root.
//!
//! With `SPACE_AGENT_TEST_RUNSC` (a `runsc` binary) and `SPACE_AGENT_BIN` (a
//! static agent) set, the agent runs as PID 1 of a gVisor sandbox instead (root
//! only), its files root being the test directory bind-mounted into it; the
//! sandbox's root filesystem is `SPACE_AGENT_TEST_ROOTFS`, or an empty directory.

use std::convert::Infallible;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use base64::Engine;
use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use space_agent::protocol::{self, Hello, HelloReply, PROTOCOL_VERSION};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixListener;
use tokio::sync::mpsc;

type Body = BoxBody<Bytes, Infallible>;

const WAIT: Duration = Duration::from_secs(20);
const SANDBOX: &str = "sbx_files";

async fn within<F: std::future::Future>(what: &str, f: F) -> F::Output {
    match tokio::time::timeout(WAIT, f).await {
        Ok(v) => v,
        Err(_) => panic!("timed out waiting for {what}"),
    }
}

struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "space-agent-files-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The agent under test, its files root and the host's listening socket.
struct Host {
    listener: UnixListener,
    agent: Child,
    token: String,
    /// The agent's files root.
    root: PathBuf,
    /// Beside the root, where nothing may ever appear.
    outside: PathBuf,
    /// runsc mode: the `runsc` command line (with `--root`) and the container id.
    sandbox: Option<(Vec<String>, String)>,
    _dir: TempDir,
}

impl Drop for Host {
    fn drop(&mut self) {
        if let Some((runsc, id)) = &self.sandbox {
            let _ = Command::new(&runsc[0])
                .args(&runsc[1..])
                .args(["delete", "--force", id])
                .status();
        }
        let _ = self.agent.kill();
        let _ = self.agent.wait();
    }
}

/// An OCI spec like the gVisor driver's: the agent as PID 1, the test
/// directory at `/.space/run`.
fn sandbox_spec(rootfs: &Path, bin: &Path, dir: &Path, env: &[(&str, String)]) -> Value {
    let caps = [
        "CAP_CHOWN",
        "CAP_DAC_OVERRIDE",
        "CAP_FSETID",
        "CAP_FOWNER",
        "CAP_MKNOD",
        "CAP_SETGID",
        "CAP_SETUID",
        "CAP_SETFCAP",
        "CAP_SETPCAP",
        "CAP_KILL",
    ];
    let bin_dir = bin.parent().expect("agent directory");
    let bin_name = bin
        .file_name()
        .and_then(|n| n.to_str())
        .expect("agent name");
    let env: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": [format!("/.space/bin/{bin_name}")],
            "env": env,
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "noNewPrivileges": false
        },
        "root": {"path": rootfs, "readonly": false},
        "hostname": "files-test",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/.space/bin", "type": "bind", "source": bin_dir,
             "options": ["rbind", "ro"]},
            {"destination": "/.space/run", "type": "bind", "source": dir,
             "options": ["rbind", "rw"]}
        ],
        "linux": {
            "namespaces": [
                {"type": "pid"}, {"type": "network"}, {"type": "ipc"},
                {"type": "uts"}, {"type": "mount"}
            ]
        }
    })
}

impl Host {
    fn start() -> Host {
        let dir = TempDir::new();
        let root = dir.0.join("root");
        let outside = dir.0.join("outside");
        std::fs::create_dir_all(&root).expect("root");
        std::fs::create_dir_all(&outside).expect("outside");
        let socket = dir.0.join("agent.sock");
        let token_file = dir.0.join("token");
        let token = format!("tok-{}", std::process::id());
        std::fs::write(&token_file, &token).expect("write token");
        let listener = UnixListener::bind(&socket).expect("bind socket");
        let bin = std::env::var_os("SPACE_AGENT_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_space-agent")));
        let (agent, sandbox) = match std::env::var("SPACE_AGENT_TEST_RUNSC").ok() {
            None => {
                let agent = Command::new(bin)
                    .env("SPACE_AGENT_SOCKET", &socket)
                    .env("SPACE_SANDBOX_ID", SANDBOX)
                    .env("SPACE_AGENT_TOKEN_FILE", &token_file)
                    .env("SPACE_AGENT_FILES_ROOT", &root)
                    .stdin(Stdio::null())
                    .spawn()
                    .expect("start agent");
                (agent, None)
            }
            Some(runsc) => {
                let rootfs = std::env::var_os("SPACE_AGENT_TEST_ROOTFS")
                    .map(PathBuf::from)
                    .unwrap_or_else(|| {
                        let empty = dir.0.join("rootfs");
                        std::fs::create_dir_all(&empty).expect("rootfs");
                        empty
                    });
                let id = dir
                    .0
                    .file_name()
                    .and_then(|n| n.to_str())
                    .expect("temp dir name")
                    .to_string();
                let bundle = dir.0.join("bundle");
                std::fs::create_dir_all(&bundle).expect("bundle dir");
                let env = [
                    ("SPACE_AGENT_SOCKET", "/.space/run/agent.sock".to_string()),
                    ("SPACE_SANDBOX_ID", SANDBOX.to_string()),
                    ("SPACE_AGENT_TOKEN_FILE", "/.space/run/token".to_string()),
                    ("SPACE_AGENT_FILES_ROOT", "/.space/run/root".to_string()),
                ];
                let spec = sandbox_spec(&rootfs, &bin, &dir.0, &env);
                std::fs::write(bundle.join("config.json"), spec.to_string()).expect("spec");
                let runsc = vec![
                    runsc,
                    format!("--root={}", dir.0.join("runsc").display()),
                    "--platform=systrap".into(),
                    "--network=none".into(),
                    "--host-uds=open".into(),
                ];
                let agent = Command::new(&runsc[0])
                    .args(&runsc[1..])
                    .args(["run", "--bundle"])
                    .arg(&bundle)
                    .arg(&id)
                    .stdin(Stdio::null())
                    .spawn()
                    .expect("start runsc");
                (agent, Some((runsc, id)))
            }
        };
        Host {
            listener,
            agent,
            token,
            root,
            outside,
            sandbox,
            _dir: dir,
        }
    }

    /// Accepts the agent's connection and speaks HTTP/2 on it.
    async fn accept(&self) -> Conn {
        let (mut stream, _) = within("agent to connect", self.listener.accept())
            .await
            .expect("accept");
        let line = within("hello", protocol::read_handshake_line(&mut stream))
            .await
            .expect("hello line");
        let hello: Hello = serde_json::from_slice(&line).expect("hello json");
        assert_eq!(hello.token, self.token);
        let reply = HelloReply {
            ok: true,
            protocol: PROTOCOL_VERSION,
            error: None,
        };
        let mut out = serde_json::to_vec(&reply).expect("json");
        out.push(b'\n');
        stream.write_all(&out).await.expect("write reply");
        let (send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .expect("h2 handshake");
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Conn { send }
    }

    /// Peak resident memory of the agent, in KiB.
    fn agent_peak_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.agent.id()))
            .expect("agent status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmHWM")
    }

    fn assert_outside_empty(&self) {
        let left: Vec<_> = std::fs::read_dir(&self.outside)
            .expect("outside")
            .map(|e| e.expect("entry").path())
            .collect();
        assert!(left.is_empty(), "written outside the root: {left:?}");
    }
}

/// A request body the test feeds chunk by chunk.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|o| o.map(|b| Ok(http_body::Frame::data(b))))
    }
}

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    trailers: Option<HeaderMap>,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    /// Asserts the status (and the error code for errors); returns the JSON.
    fn expect(&self, status: StatusCode, code: Option<&str>) -> Value {
        assert_eq!(
            self.status,
            status,
            "{}",
            String::from_utf8_lossy(&self.body)
        );
        let v = self.json();
        if let Some(code) = code {
            assert_eq!(v["error"]["code"], code, "{v}");
        }
        v
    }
}

#[derive(Clone)]
struct Conn {
    send: SendRequest<Body>,
}

/// Percent-encodes a path for a query string.
fn enc(p: &str) -> String {
    let mut s = String::new();
    for b in p.bytes() {
        if b.is_ascii_alphanumeric() || b"/-_.~".contains(&b) {
            s.push(b as char);
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s
}

impl Conn {
    async fn send(&mut self, method: Method, uri: &str, body: Body) -> Reply {
        let req = Request::builder()
            .method(method)
            .uri(format!("http://agent{uri}"))
            .body(body)
            .expect("request");
        within("ready", self.send.ready()).await.expect("ready");
        let resp = within(uri, self.send.send_request(req))
            .await
            .expect("response");
        let status = resp.status();
        let headers = resp.headers().clone();
        let collected = within("response body", resp.into_body().collect())
            .await
            .expect("body");
        let trailers = collected.trailers().cloned();
        Reply {
            status,
            headers,
            body: collected.to_bytes(),
            trailers,
        }
    }

    async fn call(&mut self, method: Method, uri: &str, body: impl Into<Bytes>) -> Reply {
        self.send(method, uri, Full::new(body.into()).boxed()).await
    }

    async fn get(&mut self, uri: &str) -> Reply {
        self.call(Method::GET, uri, Bytes::new()).await
    }

    async fn post(&mut self, uri: &str, v: Value) -> Reply {
        self.call(Method::POST, uri, v.to_string()).await
    }

    async fn put_file(&mut self, path: &str, extra: &str, data: impl Into<Bytes>) -> Reply {
        self.call(
            Method::PUT,
            &format!("/v1/files?path={}{extra}", enc(path)),
            data,
        )
        .await
    }

    async fn put_tar(&mut self, path: &str, extra: &str, data: impl Into<Bytes>) -> Reply {
        self.call(
            Method::PUT,
            &format!("/v1/files?path={}&format=tar{extra}", enc(path)),
            data,
        )
        .await
    }

    async fn download(&mut self, path: &str) -> Reply {
        self.get(&format!("/v1/files?path={}", enc(path))).await
    }

    async fn download_tar(&mut self, path: &str) -> Reply {
        self.get(&format!("/v1/files?path={}&format=tar", enc(path)))
            .await
    }

    async fn stat(&mut self, path: &str) -> Reply {
        self.get(&format!("/v1/files/stat?path={}", enc(path)))
            .await
    }

    async fn list(&mut self, path: &str, depth: u32) -> Reply {
        self.get(&format!("/v1/files/list?path={}&depth={depth}", enc(path)))
            .await
    }

    async fn delete(&mut self, path: &str, recursive: bool) -> Reply {
        self.call(
            Method::DELETE,
            &format!("/v1/files?path={}&recursive={recursive}", enc(path)),
            Bytes::new(),
        )
        .await
    }
}

// ---- archives ---------------------------------------------------------------

fn header(kind: tar::EntryType, size: u64, mode: u32) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_size(size);
    h.set_mode(mode);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(1_600_000_000);
    h
}

/// A tar builder for archives the tar crate would refuse to write.
struct Tar(tar::Builder<Vec<u8>>);

impl Tar {
    fn new() -> Tar {
        Tar(tar::Builder::new(Vec::new()))
    }

    fn file(mut self, name: &str, data: &[u8]) -> Tar {
        let mut h = header(tar::EntryType::Regular, data.len() as u64, 0o644);
        self.0.append_data(&mut h, name, data).expect("append");
        self
    }

    fn dir(mut self, name: &str) -> Tar {
        let mut h = header(tar::EntryType::Directory, 0, 0o755);
        self.0
            .append_data(&mut h, name, std::io::empty())
            .expect("append");
        self
    }

    fn link(mut self, kind: tar::EntryType, name: &str, target: &str) -> Tar {
        let mut h = header(kind, 0, 0o777);
        self.0.append_link(&mut h, name, target).expect("append");
        self
    }

    /// An entry with the name (and link name) written into the header as is.
    fn raw(mut self, kind: tar::EntryType, name: &[u8], link: &[u8], data: &[u8]) -> Tar {
        let mut h = header(kind, data.len() as u64, 0o644);
        let gnu = h.as_gnu_mut().expect("gnu");
        gnu.name[..name.len()].copy_from_slice(name);
        gnu.linkname[..link.len()].copy_from_slice(link);
        h.set_cksum();
        self.0.append(&h, data).expect("append");
        self
    }

    fn build(self) -> Vec<u8> {
        self.0.into_inner().expect("finish")
    }
}

/// (name bytes, entry type, data, mode, uid, gid, mtime) of each member.
type Member = (Vec<u8>, tar::EntryType, Vec<u8>, u32, u64, u64, u64);

fn members(data: &[u8]) -> Vec<Member> {
    let mut a = tar::Archive::new(data);
    a.entries()
        .expect("entries")
        .map(|e| {
            let mut e = e.expect("entry");
            let mut body = Vec::new();
            e.read_to_end(&mut body).expect("read");
            let h = e.header();
            let mut name = e.path_bytes().into_owned();
            if h.entry_type() == tar::EntryType::Symlink || h.entry_type() == tar::EntryType::Link {
                body = e.link_name_bytes().expect("link").into_owned();
            }
            if name.last() == Some(&b'/') {
                name.pop();
            }
            (
                name,
                h.entry_type(),
                body,
                h.mode().expect("mode"),
                h.uid().expect("uid"),
                h.gid().expect("gid"),
                h.mtime().expect("mtime"),
            )
        })
        .collect()
}

fn names_of(data: &[u8]) -> Vec<String> {
    members(data)
        .into_iter()
        .map(|m| String::from_utf8_lossy(&m.0).into_owned())
        .collect()
}

fn read(p: impl AsRef<Path>) -> Vec<u8> {
    std::fs::read(p.as_ref()).unwrap_or_else(|e| panic!("{}: {e}", p.as_ref().display()))
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).expect("path");
    // SAFETY: plain syscall with a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo");
}

// ---- tests ------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_endpoint() {
    let host = Host::start();
    let mut c = host.accept().await;
    let root = host.root.clone();

    // mkdir -p with mode and owner.
    let v = c
        .post(
            "/v1/files/mkdir",
            json!({"path": "/home/u/a/b", "mode": 0o750, "uid": 1000, "gid": 1001}),
        )
        .await
        .expect(StatusCode::CREATED, None);
    assert_eq!(v["type"], "dir");
    assert_eq!(v["path"], "/home/u/a/b");
    assert_eq!(v["mode"], 0o750);
    let md = std::fs::metadata(root.join("home/u/a/b")).expect("made");
    assert_eq!(
        (md.mode() & 0o7777, md.uid(), md.gid()),
        (0o750, 1000, 1001)
    );
    // Existing directory: fine. Existing file in the way: conflict.
    c.post("/v1/files/mkdir", json!({"path": "/home/u/a/b"}))
        .await
        .expect(StatusCode::CREATED, None);
    std::fs::write(root.join("home/file"), b"x").expect("write");
    c.post("/v1/files/mkdir", json!({"path": "/home/file/sub"}))
        .await
        .expect(StatusCode::CONFLICT, Some("conflict"));
    c.post("/v1/files/mkdir", json!({"path": "/x", "bogus": 1}))
        .await
        .expect(StatusCode::BAD_REQUEST, Some("invalid_request"));

    // Upload with mode and owner; the answer and the disk agree.
    let v = c
        .put_file(
            "/home/u/hello.txt",
            "&mode=0640&uid=1000&gid=1002",
            "hello world",
        )
        .await
        .expect(StatusCode::CREATED, None);
    assert_eq!(v["size"], 11);
    assert_eq!(v["mode"], 0o640);
    assert_eq!(v["uid"], 1000);
    assert_eq!(v["name"], "hello.txt");
    let md = std::fs::metadata(root.join("home/u/hello.txt")).expect("uploaded");
    assert_eq!(
        (md.mode() & 0o7777, md.uid(), md.gid()),
        (0o640, 1000, 1002)
    );
    // Defaults: 0644 root:root; overwriting replaces.
    c.put_file("/home/u/hello.txt", "", "bye")
        .await
        .expect(StatusCode::CREATED, None);
    let md = std::fs::metadata(root.join("home/u/hello.txt")).expect("uploaded");
    assert_eq!((md.mode() & 0o7777, md.uid(), md.gid()), (0o644, 0, 0));
    assert_eq!(read(root.join("home/u/hello.txt")), b"bye");
    c.put_file("/home/u/hello.txt", "&mode=4755", "bye")
        .await
        .expect(StatusCode::CREATED, None);
    assert_eq!(
        std::fs::metadata(root.join("home/u/hello.txt"))
            .expect("md")
            .mode()
            & 0o7777,
        0o4755
    );
    c.put_file("/nope/x", "", "x")
        .await
        .expect(StatusCode::NOT_FOUND, Some("not_found"));
    c.put_file("/home/u", "", "x")
        .await
        .expect(StatusCode::CONFLICT, Some("conflict"));
    c.put_file("/home/u/m", "&mode=99", "x")
        .await
        .expect(StatusCode::BAD_REQUEST, Some("invalid_request"));
    c.call(Method::PUT, "/v1/files", "x")
        .await
        .expect(StatusCode::BAD_REQUEST, Some("invalid_path"));
    c.put_file("relative", "", "x")
        .await
        .expect(StatusCode::BAD_REQUEST, Some("invalid_path"));
    // No temporary files left behind.
    let left: Vec<_> = std::fs::read_dir(root.join("home/u"))
        .expect("dir")
        .map(|e| e.expect("e").file_name())
        .collect();
    assert_eq!(left.len(), 2, "{left:?}");

    // Download: bytes and headers.
    c.put_file(
        "/home/u/bin",
        "&mode=0751&uid=7&gid=8",
        vec![0u8, 1, 2, 255],
    )
    .await
    .expect(StatusCode::CREATED, None);
    let r = c.download("/home/u/bin").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(&r.body[..], &[0u8, 1, 2, 255]);
    assert_eq!(r.headers["content-type"], "application/octet-stream");
    assert_eq!(r.headers["content-length"], "4");
    assert_eq!(r.headers["x-space-mode"], "0751");
    assert_eq!(r.headers["x-space-uid"], "7");
    assert_eq!(r.headers["x-space-gid"], "8");
    let v = c
        .download("/home/u")
        .await
        .expect(StatusCode::BAD_REQUEST, Some("not_a_file"));
    assert!(v["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("format=tar"));
    c.download("/home/u/missing")
        .await
        .expect(StatusCode::NOT_FOUND, Some("not_found"));
    // A big file streams through intact.
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    c.put_file("/home/u/big", "", big.clone())
        .await
        .expect(StatusCode::CREATED, None);
    let r = c.download("/home/u/big").await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.body[..] == big[..], "big file round trip");
    c.delete("/home/u/big", false)
        .await
        .expect(StatusCode::OK, None);

    // Stat: a link is a link.
    std::os::unix::fs::symlink("hello.txt", root.join("home/u/link")).expect("symlink");
    let v = c.stat("/home/u/link").await.expect(StatusCode::OK, None);
    assert_eq!(v["type"], "symlink");
    assert_eq!(v["link_target"], "hello.txt");
    let v = c
        .stat("//home/./u/hello.txt")
        .await
        .expect(StatusCode::OK, None);
    assert_eq!(v["path"], "/home/u/hello.txt");
    assert_eq!(v["type"], "file");
    assert!(v.get("link_target").is_none());
    let v = c.stat("/").await.expect(StatusCode::OK, None);
    assert_eq!(v["type"], "dir");
    c.stat("/home/nothing")
        .await
        .expect(StatusCode::NOT_FOUND, Some("not_found"));

    // List: depth-first, sorted, bounded depth.
    let v = c.list("/home", 1).await.expect(StatusCode::OK, None);
    assert_eq!(v["path"], "/home");
    assert_eq!(v["truncated"], false);
    let names: Vec<&str> = v["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| e["path"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(names, vec!["/home/file", "/home/u"]);
    let v = c.list("/home", 3).await.expect(StatusCode::OK, None);
    let names: Vec<&str> = v["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| e["path"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        names,
        vec![
            "/home/file",
            "/home/u",
            "/home/u/a",
            "/home/u/a/b",
            "/home/u/bin",
            "/home/u/hello.txt",
            "/home/u/link"
        ]
    );
    c.list("/home", 0)
        .await
        .expect(StatusCode::BAD_REQUEST, Some("invalid_request"));
    c.list("/home", 65)
        .await
        .expect(StatusCode::BAD_REQUEST, Some("invalid_request"));

    // Move.
    c.post(
        "/v1/files/move",
        json!({"from": "/home/u/bin", "to": "/home/u/hello.txt"}),
    )
    .await
    .expect(StatusCode::CONFLICT, Some("conflict"));
    let v = c
        .post(
            "/v1/files/move",
            json!({"from": "/home/u/bin", "to": "/home/u/hello.txt", "overwrite": true}),
        )
        .await
        .expect(StatusCode::OK, None);
    assert_eq!(v["path"], "/home/u/hello.txt");
    assert_eq!(v["size"], 4);
    let v = c
        .post(
            "/v1/files/move",
            json!({"from": "/home/u/link", "to": "/home/l2"}),
        )
        .await
        .expect(StatusCode::OK, None);
    assert_eq!(v["type"], "symlink");
    c.post(
        "/v1/files/move",
        json!({"from": "/home/u/none", "to": "/home/z"}),
    )
    .await
    .expect(StatusCode::NOT_FOUND, Some("not_found"));
    c.post(
        "/v1/files/move",
        json!({"from": "/home/u", "to": "/home/u/a/inside"}),
    )
    .await
    .expect(StatusCode::BAD_REQUEST, Some("invalid_request"));

    // Delete.
    let v = c
        .delete("/home/u", false)
        .await
        .expect(StatusCode::CONFLICT, Some("conflict"));
    assert!(v["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("recursive"));
    let v = c
        .delete("/home/l2", false)
        .await
        .expect(StatusCode::OK, None);
    assert_eq!(v["removed"], 1);
    assert!(
        root.join("home/u/hello.txt").exists(),
        "link removed, not its target"
    );
    let v = c.delete("/home/u", true).await.expect(StatusCode::OK, None);
    assert_eq!(v["removed"], 4, "u, a, b, hello.txt");
    assert!(!root.join("home/u").exists());
    c.delete("/", true)
        .await
        .expect(StatusCode::BAD_REQUEST, Some("invalid_path"));
    c.delete("/home/u", true)
        .await
        .expect(StatusCode::NOT_FOUND, Some("not_found"));
    assert!(root.exists());

    c.get("/v1/files/nothing")
        .await
        .expect(StatusCode::NOT_FOUND, Some("not_found"));
    c.call(Method::POST, "/v1/files?path=/x", "")
        .await
        .expect(StatusCode::METHOD_NOT_ALLOWED, None);
    host.assert_outside_empty();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tar_round_trip_keeps_modes_owners_times_and_links() {
    let host = Host::start();
    let mut c = host.accept().await;
    let root = host.root.clone();
    let src = root.join("src");
    std::fs::create_dir_all(src.join("sub/deeper")).expect("dirs");
    std::fs::write(src.join("a.txt"), b"alpha").expect("write");
    std::fs::write(src.join("sub/exe"), b"#!/bin/sh\n").expect("write");
    // chown clears setuid, so it comes first.
    std::os::unix::fs::chown(src.join("sub/exe"), Some(1234), Some(4321)).expect("chown");
    std::fs::set_permissions(src.join("sub/exe"), std::fs::Permissions::from_mode(0o4755))
        .expect("chmod");
    std::fs::set_permissions(
        src.join("sub/deeper"),
        std::fs::Permissions::from_mode(0o700),
    )
    .expect("chmod");
    std::os::unix::fs::symlink("../a.txt", src.join("sub/link")).expect("symlink");
    std::os::unix::fs::symlink("/etc/passwd", src.join("abs")).expect("symlink");
    std::fs::hard_link(src.join("a.txt"), src.join("sub/hard")).expect("hard link");
    mkfifo(&src.join("fifo"));
    let long = "n".repeat(200);
    std::fs::create_dir_all(src.join(&long)).expect("long dir");
    std::fs::write(src.join(&long).join(&long), b"long").expect("long file");

    let r = c.download_tar("/src").await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(r.headers["content-type"], "application/x-tar");
    assert!(r.trailers.is_none(), "{:?}", r.trailers);
    let ms = members(&r.body);
    let names: Vec<String> = ms
        .iter()
        .map(|m| String::from_utf8_lossy(&m.0).into_owned())
        .collect();
    let long_file = format!("{long}/{long}");
    assert_eq!(
        names,
        vec![
            "a.txt",
            "abs",
            long.as_str(),
            long_file.as_str(),
            "sub",
            "sub/deeper",
            "sub/exe",
            "sub/hard",
            "sub/link"
        ],
        "fifo skipped, sorted, long names kept"
    );
    let exe = ms.iter().find(|m| m.0 == b"sub/exe").expect("exe");
    assert_eq!((exe.3, exe.4, exe.5), (0o4755, 1234, 4321));
    let hard = ms.iter().find(|m| m.0 == b"sub/hard").expect("hard");
    assert_eq!(hard.1, tar::EntryType::Link);
    assert_eq!(hard.2, b"a.txt");
    let abs = ms.iter().find(|m| m.0 == b"abs").expect("abs");
    assert_eq!(
        (abs.1, &abs.2[..]),
        (tar::EntryType::Symlink, &b"/etc/passwd"[..])
    );
    let a_mtime = std::fs::metadata(src.join("a.txt")).expect("md").mtime() as u64;
    assert_eq!(ms[0].6, a_mtime);

    // Unpack it elsewhere: everything comes back the same.
    let v = c
        .put_tar("/dst/x", "", r.body.clone())
        .await
        .expect(StatusCode::CREATED, None);
    assert_eq!(v["entries"], 9);
    assert_eq!(v["bytes"], 5 + 10 + 4);
    let dst = root.join("dst/x");
    assert_eq!(read(dst.join("sub/link")), b"alpha");
    assert_eq!(
        std::fs::read_link(dst.join("abs")).expect("link"),
        Path::new("/etc/passwd")
    );
    let md = std::fs::metadata(dst.join("sub/exe")).expect("md");
    assert_eq!(
        (md.mode() & 0o7777, md.uid(), md.gid()),
        (0o4755, 1234, 4321)
    );
    assert_eq!(
        std::fs::metadata(dst.join("sub/deeper"))
            .expect("md")
            .mode()
            & 0o7777,
        0o700
    );
    assert_eq!(
        std::fs::metadata(dst.join("a.txt")).expect("md").mtime() as u64,
        a_mtime
    );
    assert_eq!(
        std::fs::metadata(dst.join("sub/hard")).expect("md").ino(),
        std::fs::metadata(dst.join("a.txt")).expect("md").ino()
    );
    assert_eq!(read(dst.join(&long).join(&long)), b"long");
    let again = c.download_tar("/dst/x").await;
    assert_eq!(members(&again.body), ms, "a second round trip is identical");

    // One file: one entry under its own name; gzip upload too.
    let one = c.download_tar("/src/sub/exe").await;
    assert_eq!(names_of(&one.body), vec!["exe"]);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&one.body).expect("gzip");
    let gz = gz.finish().expect("gzip");
    c.put_tar("/gz", "&gzip=true", gz)
        .await
        .expect(StatusCode::CREATED, None);
    assert_eq!(read(root.join("gz/exe")), b"#!/bin/sh\n");
    c.put_tar("/gz2", "&gzip=true", "not gzip")
        .await
        .expect(StatusCode::BAD_REQUEST, Some("invalid_request"));
    assert!(
        !root.join("gz2").exists(),
        "a failed upload leaves no directory"
    );
    c.download_tar("/src/fifo")
        .await
        .expect(StatusCode::BAD_REQUEST, Some("not_a_file"));
    c.download_tar("/missing")
        .await
        .expect(StatusCode::NOT_FOUND, Some("not_found"));
    host.assert_outside_empty();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dotdot_and_malformed_paths_are_refused() {
    let host = Host::start();
    let mut c = host.accept().await;
    std::fs::write(host.outside.join("secret"), b"s").expect("secret");
    for p in ["/../outside/secret", "/a/../../outside/secret", "/..", ".."] {
        c.download(p)
            .await
            .expect(StatusCode::BAD_REQUEST, Some("invalid_path"));
        c.put_file(p, "", "x")
            .await
            .expect(StatusCode::BAD_REQUEST, Some("invalid_path"));
        c.stat(p)
            .await
            .expect(StatusCode::BAD_REQUEST, Some("invalid_path"));
    }
    // NUL and invalid UTF-8 in the query.
    c.get("/v1/files/stat?path=/a%00b")
        .await
        .expect(StatusCode::BAD_REQUEST, Some("invalid_path"));
    c.get("/v1/files/stat?path=/a%FFb")
        .await
        .expect(StatusCode::BAD_REQUEST, Some("invalid_path"));
    c.get("/v1/files/list?path=/&depth=%FF")
        .await
        .expect(StatusCode::BAD_REQUEST, Some("invalid_request"));
    std::fs::remove_file(host.outside.join("secret")).expect("rm");
    host.assert_outside_empty();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absolute_symlink_resolves_inside_the_root() {
    let host = Host::start();
    let mut c = host.accept().await;
    let root = host.root.clone();
    std::fs::create_dir_all(root.join("etc")).expect("etc");
    std::fs::create_dir_all(root.join("tmp")).expect("tmp");
    std::fs::write(root.join("etc/marker"), b"inside").expect("marker");
    std::os::unix::fs::symlink("/etc", root.join("tmp/x")).expect("symlink");

    let r = c.download("/tmp/x/marker").await;
    assert_eq!((r.status, &r.body[..]), (StatusCode::OK, &b"inside"[..]));
    // The host's /etc is never read.
    assert!(Path::new("/etc/passwd").exists());
    c.download("/tmp/x/passwd")
        .await
        .expect(StatusCode::NOT_FOUND, Some("not_found"));
    c.download_tar("/tmp/x/passwd")
        .await
        .expect(StatusCode::NOT_FOUND, Some("not_found"));
    // ... nor written.
    let name = format!("space-agent-test-{}", std::process::id());
    c.put_file(&format!("/tmp/x/{name}"), "", "w")
        .await
        .expect(StatusCode::CREATED, None);
    assert!(!Path::new("/etc").join(&name).exists());
    assert_eq!(read(root.join("etc").join(&name)), b"w");
    let v = c
        .put_tar("/tmp/x/t", "", Tar::new().file("f", b"tar").build())
        .await
        .expect(StatusCode::CREATED, None);
    assert_eq!(v["entries"], 1);
    assert!(!Path::new("/etc/t").exists());
    assert_eq!(read(root.join("etc/t/f")), b"tar");
    c.post(
        "/v1/files/mkdir",
        json!({"path": format!("/tmp/x/{name}-d")}),
    )
    .await
    .expect(StatusCode::CREATED, None);
    assert!(!Path::new("/etc").join(format!("{name}-d")).exists());
    assert!(root.join("etc").join(format!("{name}-d")).is_dir());
    // The tar of the link's target is the root's /etc.
    let r = c.download_tar("/tmp/x").await;
    assert_eq!(
        names_of(&r.body),
        vec![
            "marker".to_string(),
            name.clone(),
            format!("{name}-d"),
            "t".into(),
            "t/f".into()
        ]
    );
    // Deleting through the link removes the link only.
    c.delete("/tmp/x", false).await.expect(StatusCode::OK, None);
    assert!(root.join("etc/marker").exists());
    host.assert_outside_empty();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relative_symlink_dotdots_are_clamped_at_the_root() {
    let host = Host::start();
    let mut c = host.accept().await;
    let root = host.root.clone();
    std::fs::create_dir_all(root.join("a/b/c")).expect("dirs");
    std::fs::create_dir_all(root.join("outside")).expect("decoy");
    std::fs::write(root.join("outside/decoy"), b"root's own").expect("decoy");
    let up = "../".repeat(30);
    std::os::unix::fs::symlink(format!("{up}outside"), root.join("a/b/c/up")).expect("symlink");
    std::fs::write(host.outside.join("decoy"), b"host").expect("host decoy");

    let r = c.download("/a/b/c/up/decoy").await;
    assert_eq!(
        (r.status, &r.body[..]),
        (StatusCode::OK, &b"root's own"[..])
    );
    c.put_file("/a/b/c/up/new", "", "n")
        .await
        .expect(StatusCode::CREATED, None);
    assert_eq!(read(root.join("outside/new")), b"n");
    assert!(!host.outside.join("new").exists());
    // A loop is an error, not a hang.
    std::os::unix::fs::symlink("l2", root.join("l1")).expect("l1");
    std::os::unix::fs::symlink("l1", root.join("l2")).expect("l2");
    let v = c
        .download("/l1")
        .await
        .expect(StatusCode::BAD_REQUEST, Some("invalid_path"));
    assert!(v["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("symbolic links"));
    std::fs::remove_file(host.outside.join("decoy")).expect("rm");
    host.assert_outside_empty();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn symlink_swapped_in_during_operations_never_escapes() {
    let host = Host::start();
    let c = host.accept().await;
    let root = host.root.clone();
    std::fs::create_dir_all(root.join("work/d")).expect("dirs");
    std::fs::write(root.join("work/d/f"), b"inside").expect("f");
    std::fs::write(host.outside.join("f"), b"OUTSIDE").expect("outside f");
    let outside = host.outside.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let swapper = {
        let (root, stop, outside) = (root.clone(), stop.clone(), outside.clone());
        std::thread::spawn(move || {
            let d = root.join("work/d");
            let rel = format!("{}{}", "../".repeat(20), outside.display());
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let _ = std::fs::remove_dir_all(&d).or_else(|_| std::fs::remove_file(&d));
                if i.is_multiple_of(2) {
                    let _ = std::os::unix::fs::symlink(&outside, &d);
                } else {
                    let _ = std::os::unix::fs::symlink(&rel, &d);
                }
                std::thread::yield_now();
                let _ = std::fs::remove_file(&d);
                let _ = std::fs::create_dir(&d);
                let _ = std::fs::write(d.join("f"), b"inside");
                i += 1;
            }
            i
        })
    };
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut tasks = Vec::new();
    for t in 0..4 {
        let mut c = c.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0u32;
            while Instant::now() < deadline {
                let r = match (n + t) % 5 {
                    0 => c.put_file("/work/d/up", "", "payload").await,
                    1 => c.download("/work/d/f").await,
                    2 => {
                        c.put_tar("/work/d/t", "", Tar::new().file("g", b"payload").build())
                            .await
                    }
                    3 => c.download_tar("/work/d").await,
                    _ => c.delete("/work/d/up", false).await,
                };
                assert!(
                    r.status.is_success() || r.status.is_client_error(),
                    "{}: {:?}",
                    r.status,
                    r.body
                );
                assert!(
                    !r.body.windows(7).any(|w| w == b"OUTSIDE"),
                    "read outside the root"
                );
                n += 1;
            }
            n
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.expect("task");
    }
    stop.store(true, Ordering::Relaxed);
    let swaps = swapper.join().expect("swapper");
    assert!(
        total > 20 && swaps > 20,
        "{total} operations, {swaps} swaps"
    );
    let left: Vec<_> = std::fs::read_dir(&outside)
        .expect("outside")
        .map(|e| e.expect("e").file_name())
        .collect();
    assert_eq!(
        left,
        vec![std::ffi::OsString::from("f")],
        "nothing new outside"
    );
    assert_eq!(read(outside.join("f")), b"OUTSIDE");
    // The agent is still fine.
    let mut c = c;
    c.stat("/work").await.expect(StatusCode::OK, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tar_hard_links_stay_inside() {
    let host = Host::start();
    let mut c = host.accept().await;
    let root = host.root.clone();
    std::fs::write(root.join("existing"), b"pre-existing").expect("existing");
    std::fs::write(host.outside.join("target"), b"out").expect("target");

    let ok = Tar::new()
        .file("f", b"data")
        .link(tar::EntryType::Link, "sub/h", "f")
        .build();
    c.put_tar("/in", "", ok)
        .await
        .expect(StatusCode::CREATED, None);
    assert_eq!(read(root.join("in/sub/h")), b"data");
    assert_eq!(
        std::fs::metadata(root.join("in/sub/h")).expect("md").ino(),
        std::fs::metadata(root.join("in/f")).expect("md").ino()
    );

    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "dotdot",
            Tar::new()
                .file("f", b"d")
                .raw(tar::EntryType::Link, b"h", b"../existing", b"")
                .build(),
        ),
        (
            "absolute",
            Tar::new()
                .file("f", b"d")
                .raw(tar::EntryType::Link, b"h", b"/existing", b"")
                .build(),
        ),
        (
            "outside path",
            Tar::new()
                .file("f", b"d")
                .raw(
                    tar::EntryType::Link,
                    b"h",
                    host.outside.join("target").as_os_str().as_bytes(),
                    b"",
                )
                .build(),
        ),
        (
            "not in archive",
            Tar::new()
                .file("f", b"d")
                .link(tar::EntryType::Link, "h", "../existing")
                .build(),
        ),
        (
            "later entry",
            Tar::new()
                .link(tar::EntryType::Link, "h", "f")
                .file("f", b"d")
                .build(),
        ),
    ];
    for (what, data) in cases {
        let v = c
            .put_tar("/bad", "", data)
            .await
            .expect(StatusCode::BAD_REQUEST, Some("unsafe_archive"));
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains("\"h\""),
            "{what}: {v}"
        );
        assert!(!root.join("bad").exists(), "{what}: cleaned up");
    }
    // A link to a file that exists in the directory but not in the archive.
    std::fs::create_dir_all(root.join("pre")).expect("pre");
    std::fs::write(root.join("pre/old"), b"old").expect("old");
    let data = Tar::new()
        .file("f", b"d")
        .link(tar::EntryType::Link, "h", "old")
        .build();
    c.put_tar("/pre", "", data)
        .await
        .expect(StatusCode::BAD_REQUEST, Some("unsafe_archive"));
    assert!(!root.join("pre/f").exists() && !root.join("pre/h").exists());
    assert_eq!(read(root.join("pre/old")), b"old");
    assert_eq!(
        std::fs::metadata(root.join("existing"))
            .expect("md")
            .nlink(),
        1
    );
    assert_eq!(
        std::fs::metadata(host.outside.join("target"))
            .expect("md")
            .nlink(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_and_fifos_are_refused() {
    let host = Host::start();
    let mut c = host.accept().await;
    let root = host.root.clone();
    // A fifo nobody writes to: opening it for reading would block forever.
    mkfifo(&root.join("fifo"));
    let started = Instant::now();
    let v = c
        .download("/fifo")
        .await
        .expect(StatusCode::BAD_REQUEST, Some("not_a_file"));
    assert!(v["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("not a regular file"));
    assert!(started.elapsed() < Duration::from_secs(5));
    // A character device (we run as root in these tests; skip if mknod is refused).
    let null = root.join("null");
    let c_null = std::ffi::CString::new(null.as_os_str().as_bytes()).expect("path");
    // SAFETY: plain syscall with a NUL-terminated path.
    let made =
        unsafe { libc::mknod(c_null.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) } == 0;
    if made {
        c.download("/null")
            .await
            .expect(StatusCode::BAD_REQUEST, Some("not_a_file"));
        std::os::unix::fs::symlink("/null", root.join("to-null")).expect("symlink");
        c.download("/to-null")
            .await
            .expect(StatusCode::BAD_REQUEST, Some("not_a_file"));
    }
    // A tar of the directory skips them.
    std::fs::write(root.join("plain"), b"p").expect("plain");
    let r = c.download_tar("/").await;
    let names = names_of(&r.body);
    assert!(names.contains(&"plain".to_string()), "{names:?}");
    assert!(!names.contains(&"fifo".to_string()) && !names.contains(&"null".to_string()));
    // Uploading one is refused, and nothing of the upload stays.
    for kind in [
        tar::EntryType::Char,
        tar::EntryType::Block,
        tar::EntryType::Fifo,
    ] {
        let data = Tar::new()
            .file("first", b"1")
            .raw(kind, b"dev", b"", b"")
            .build();
        let v = c
            .put_tar("/up", "", data)
            .await
            .expect(StatusCode::BAD_REQUEST, Some("unsafe_archive"));
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains("\"dev\""),
            "{v}"
        );
        assert!(!root.join("up").exists());
    }
    // Uploading over a fifo replaces it without opening it.
    c.put_file("/fifo", "", "now a file")
        .await
        .expect(StatusCode::CREATED, None);
    assert_eq!(read(root.join("fifo")), b"now a file");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tar_names_that_escape_are_refused() {
    let host = Host::start();
    let mut c = host.accept().await;
    let root = host.root.clone();
    std::fs::create_dir_all(root.join("dst")).expect("dst");
    let cases: Vec<(&[u8], &str)> = vec![
        (b"../x", "'..'"),
        (b"a/../../x", "'..'"),
        (b"/abs", "absolute"),
    ];
    for (name, why) in cases {
        let data = Tar::new()
            .dir("made/")
            .file("made/first", b"1")
            .raw(tar::EntryType::Regular, name, b"", b"evil")
            .build();
        let v = c
            .put_tar("/dst", "", data)
            .await
            .expect(StatusCode::BAD_REQUEST, Some("unsafe_archive"));
        let msg = v["error"]["message"].as_str().unwrap_or("").to_string();
        assert!(
            msg.contains(&String::from_utf8_lossy(name).to_string()) && msg.contains(why),
            "{msg}"
        );
        assert!(!root.join("dst/made").exists(), "cleaned up");
        assert!(!root.join("x").exists() && !root.join("abs").exists());
    }
    // A symlink in the archive pointing out is stored, never followed by later entries.
    let data = Tar::new()
        .link(tar::EntryType::Symlink, "l", "../../outside")
        .file("l/x", b"evil")
        .build();
    let v = c
        .put_tar("/dst", "", data)
        .await
        .expect(StatusCode::BAD_REQUEST, Some("unsafe_archive"));
    assert!(v["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("symbolic link"));
    assert!(!root.join("dst/l").exists(), "the link was removed again");
    // Nor is one that already exists below the target directory.
    std::os::unix::fs::symlink(&host.outside, root.join("dst/out")).expect("symlink");
    std::os::unix::fs::symlink("/", root.join("dst/top")).expect("symlink");
    for name in ["out/x", "top/x", "out/deep/x"] {
        let v = c
            .put_tar("/dst", "", Tar::new().file(name, b"evil").build())
            .await
            .expect(StatusCode::BAD_REQUEST, Some("unsafe_archive"));
        assert!(v["error"]["message"].as_str().unwrap_or("").contains(name));
    }
    assert!(!root.join("x").exists());
    host.assert_outside_empty();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_beyond_limits_are_refused_and_removed() {
    let host = Host::start();
    let mut c = host.accept().await;
    let root = host.root.clone();
    let mib = vec![7u8; 1 << 20];
    // Sum of files beyond max_bytes.
    let data = Tar::new()
        .dir("d/")
        .file("d/1", &mib)
        .file("d/2", &mib)
        .file("d/3", &mib)
        .build();
    let v = c
        .put_tar(
            "/big",
            &format!("&max_bytes={}", (2 << 20) + 10),
            data.clone(),
        )
        .await
        .expect(StatusCode::PAYLOAD_TOO_LARGE, Some("too_large"));
    assert!(
        v["error"]["message"].as_str().unwrap_or("").contains("d/3"),
        "{v}"
    );
    assert!(!root.join("big").exists(), "everything removed");
    // The same archive fits without the limit.
    let v = c
        .put_tar("/big", "", data)
        .await
        .expect(StatusCode::CREATED, None);
    assert_eq!(v["bytes"], 3 << 20);
    // An existing target directory stays, only the upload's files go.
    std::fs::create_dir_all(root.join("keep")).expect("keep");
    std::fs::write(root.join("keep/old"), b"old").expect("old");
    let data = Tar::new().file("new", &mib).file("new2", &mib).build();
    c.put_tar("/keep", "&max_bytes=1048577", data)
        .await
        .expect(StatusCode::PAYLOAD_TOO_LARGE, Some("too_large"));
    let left: Vec<_> = std::fs::read_dir(root.join("keep"))
        .expect("keep")
        .map(|e| e.expect("e").file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("old")]);
    // A header that claims far more than the limit is refused before any data.
    let mut h = header(tar::EntryType::Regular, 100 << 30, 0o644);
    h.set_path("huge").expect("path");
    h.set_cksum();
    let mut raw = h.as_bytes().to_vec();
    raw.extend_from_slice(&[0u8; 4096]);
    c.put_tar("/huge", "&max_bytes=1048576", raw)
        .await
        .expect(StatusCode::PAYLOAD_TOO_LARGE, Some("too_large"));
    assert!(!root.join("huge").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gzip_bomb_is_stopped_with_bounded_memory() {
    let host = Host::start();
    let mut c = host.accept().await;
    let root = host.root.clone();
    // 1 GiB of zeros in 16 MiB files, compressed on the fly as the agent reads.
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    // Sends unless the request is over; false once it is.
    let send = move |b: Bytes| -> bool {
        let mut b = b;
        loop {
            match tx.try_send(b) {
                Ok(()) => return true,
                Err(mpsc::error::TrySendError::Closed(_)) => return false,
                Err(mpsc::error::TrySendError::Full(back)) => {
                    if stopped.load(Ordering::Relaxed) {
                        return false;
                    }
                    b = back;
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    };
    let producer = std::thread::spawn(move || {
        let zeros = vec![0u8; 1 << 20];
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let mut tar = tar::Builder::new(Vec::new());
        for i in 0..64 {
            let mut h = header(tar::EntryType::Regular, 16 << 20, 0o644);
            h.set_path(format!("bomb/{i}")).expect("path");
            h.set_cksum();
            tar.get_mut().extend_from_slice(h.as_bytes());
            gz.write_all(tar.get_mut()).expect("gz");
            tar.get_mut().clear();
            for _ in 0..16 {
                gz.write_all(&zeros).expect("gz");
                let out = std::mem::take(gz.get_mut());
                if !out.is_empty() && !send(Bytes::from(out)) {
                    return i;
                }
            }
        }
        let out = gz.finish().expect("gz");
        send(Bytes::from(out));
        64
    });
    let r = c
        .send(
            Method::PUT,
            "/v1/files?path=/bomb&format=tar&gzip=true&max_bytes=67108864",
            ChannelBody(rx).boxed(),
        )
        .await;
    stop.store(true, Ordering::Relaxed);
    let v = r.expect(StatusCode::PAYLOAD_TOO_LARGE, Some("too_large"));
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("bomb/"),
        "{v}"
    );
    let files_written = producer.join().expect("producer");
    assert!(files_written < 64, "the agent stopped reading early");
    assert!(!root.join("bomb").exists(), "everything removed");
    // Under runsc the child is the sandbox, not the agent: measured on the host only.
    if host.sandbox.is_none() {
        let peak = host.agent_peak_kib();
        assert!(peak < 128 * 1024, "agent peak memory {peak} KiB");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_names_are_refused() {
    let host = Host::start();
    let mut c = host.accept().await;
    let root = host.root.clone();
    let c256 = format!("/{}", "a".repeat(256));
    c.put_file(&c256, "", "x")
        .await
        .expect(StatusCode::BAD_REQUEST, Some("invalid_path"));
    c.stat(&c256)
        .await
        .expect(StatusCode::BAD_REQUEST, Some("invalid_path"));
    let c255 = format!("/{}", "a".repeat(255));
    c.put_file(&c255, "", "x")
        .await
        .expect(StatusCode::CREATED, None);
    let long = "/abcdefgh".repeat(456);
    assert!(long.len() > 4096);
    c.stat(&long)
        .await
        .expect(StatusCode::BAD_REQUEST, Some("invalid_path"));
    c.post("/v1/files/mkdir", json!({"path": long}))
        .await
        .expect(StatusCode::BAD_REQUEST, Some("invalid_path"));
    // In an archive: GNU long names up to the limits work, beyond them the upload fails.
    let ok_name = format!("{}/{}", "d".repeat(255), "f".repeat(255));
    c.put_tar("/t", "", Tar::new().file(&ok_name, b"ok").build())
        .await
        .expect(StatusCode::CREATED, None);
    assert_eq!(read(root.join("t").join(&ok_name)), b"ok");
    let bad = Tar::new()
        .file("first", b"1")
        .file(&"x".repeat(256), b"x")
        .build();
    c.put_tar("/t2", "", bad)
        .await
        .expect(StatusCode::BAD_REQUEST, Some("invalid_path"));
    assert!(!root.join("t2").exists());
    let deep = format!("{}x", "abcdefgh/".repeat(460));
    let bad = Tar::new().file(&deep, b"x").build();
    c.put_tar("/t3", "", bad)
        .await
        .expect(StatusCode::BAD_REQUEST, Some("invalid_path"));
    assert!(!root.join("t3").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_utf8_names_round_trip() {
    let host = Host::start();
    let mut c = host.accept().await;
    let root = host.root.clone();
    let mut b = tar::Builder::new(Vec::new());
    let mut h = header(tar::EntryType::Regular, 3, 0o600);
    let raw_name: &[u8] = b"dir/caf\xff.bin";
    b.append_data(
        &mut h,
        Path::new(std::ffi::OsStr::from_bytes(raw_name)),
        &b"raw"[..],
    )
    .expect("append");
    let data = b.into_inner().expect("tar");
    c.put_tar("/u", "", data)
        .await
        .expect(StatusCode::CREATED, None);
    let on_disk = root.join("u").join(std::ffi::OsStr::from_bytes(raw_name));
    assert_eq!(read(&on_disk), b"raw");

    let v = c.list("/u/dir", 1).await.expect(StatusCode::OK, None);
    let e = &v["entries"][0];
    assert_eq!(e["name"], "caf\u{fffd}.bin");
    assert_eq!(
        e["name_base64"],
        base64::engine::general_purpose::STANDARD.encode(b"caf\xff.bin")
    );
    let v = c.list("/u", 1).await.expect(StatusCode::OK, None);
    assert!(
        v["entries"][0].get("name_base64").is_none(),
        "only for non-UTF-8 names"
    );

    let r = c.download_tar("/u").await;
    let ms = members(&r.body);
    assert_eq!(ms[1].0, raw_name);
    assert_eq!(ms[1].2, b"raw");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forbidden_areas_are_refused() {
    let host = Host::start();
    let mut c = host.accept().await;
    let root = host.root.clone();
    for d in ["proc/1", ".space/run", "sys/kernel", "dev"] {
        std::fs::create_dir_all(root.join(d)).expect("dir");
    }
    std::fs::write(root.join("proc/1/environ"), b"secret").expect("environ");
    std::fs::write(root.join(".space/run/token"), b"secret").expect("token");
    std::fs::write(root.join("dev/null"), b"").expect("null");
    std::os::unix::fs::symlink("/dev", root.join("devlink")).expect("symlink");
    std::os::unix::fs::symlink("../.space/run", root.join("spacelink")).expect("symlink");
    std::fs::write(root.join("ok"), b"ok").expect("ok");

    c.download("/proc/1/environ")
        .await
        .expect(StatusCode::FORBIDDEN, Some("forbidden_path"));
    c.stat("/proc")
        .await
        .expect(StatusCode::FORBIDDEN, Some("forbidden_path"));
    c.put_file("/.space/run/token", "", "x")
        .await
        .expect(StatusCode::FORBIDDEN, Some("forbidden_path"));
    assert_eq!(read(root.join(".space/run/token")), b"secret");
    c.download("/spacelink/token")
        .await
        .expect(StatusCode::FORBIDDEN, Some("forbidden_path"));
    c.download("/devlink/null")
        .await
        .expect(StatusCode::FORBIDDEN, Some("forbidden_path"));
    c.put_file("/devlink/x", "", "x")
        .await
        .expect(StatusCode::FORBIDDEN, Some("forbidden_path"));
    c.delete("/sys", true)
        .await
        .expect(StatusCode::FORBIDDEN, Some("forbidden_path"));
    c.post("/v1/files/move", json!({"from": "/ok", "to": "/dev/ok"}))
        .await
        .expect(StatusCode::FORBIDDEN, Some("forbidden_path"));
    c.post("/v1/files/move", json!({"from": "/proc/1", "to": "/p"}))
        .await
        .expect(StatusCode::FORBIDDEN, Some("forbidden_path"));
    c.post("/v1/files/mkdir", json!({"path": "/devlink/new"}))
        .await
        .expect(StatusCode::FORBIDDEN, Some("forbidden_path"));
    c.list("/proc", 1)
        .await
        .expect(StatusCode::FORBIDDEN, Some("forbidden_path"));
    c.put_tar(
        "/",
        "",
        Tar::new().file("fine", b"f").file("dev/x", b"x").build(),
    )
    .await
    .expect(StatusCode::FORBIDDEN, Some("forbidden_path"));
    assert!(!root.join("fine").exists() && !root.join("dev/x").exists());
    c.put_tar("/devlink", "", Tar::new().file("x", b"x").build())
        .await
        .expect(StatusCode::FORBIDDEN, Some("forbidden_path"));
    // The links themselves may be looked at and removed.
    c.stat("/devlink").await.expect(StatusCode::OK, None);
    // Listing and archiving / leave the areas out.
    let v = c.list("/", 2).await.expect(StatusCode::OK, None);
    let names: Vec<&str> = v["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| e["path"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(names, vec!["/devlink", "/ok", "/spacelink"]);
    let r = c.download_tar("/").await;
    assert_eq!(names_of(&r.body), vec!["devlink", "ok", "spacelink"]);
    c.delete("/devlink", false)
        .await
        .expect(StatusCode::OK, None);
    assert!(root.join("dev/null").exists());
}
