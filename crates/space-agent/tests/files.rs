//! The file API of the real agent binary, run on the host with
//! `SPACE_AGENT_FILES_ROOT` pointing at a temporary directory: every endpoint,
//! and the ways a path or an archive could try to leave that root. The host's own
//! end of the protocol (`space_agent_host`) takes the agent's connection and makes
//! the requests.
//!
//! With `SPACE_AGENT_TEST_RUNSC` (a `runsc` binary) and `SPACE_AGENT_BIN` (a
//! static agent) set, the agent runs as PID 1 of a gVisor sandbox instead (root
//! only), its files root being the test directory bind-mounted into it; the
//! sandbox's root filesystem is `SPACE_AGENT_TEST_ROOTFS`, or an empty directory.

use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use bytes::Bytes;
use futures::StreamExt;
use http::{HeaderMap, Method, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use space_agent_host::{
    body_from_bytes, body_from_stream, testing, AgentConn, AgentError, DownloadFormat, UploadKind,
    Uploaded,
};
use space_api::{
    ErrorCode, FileInfo, FileListing, FileType, MkdirRequest, MoveRequest, UnpackStats,
};
use tokio::net::UnixListener;
use tokio::sync::mpsc;

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

    /// Accepts the agent's connection as the server does.
    async fn accept(&self) -> Conn {
        let (conn, hello) = within(
            "agent to connect",
            testing::accept(&self.listener, SANDBOX, &self.token),
        )
        .await
        .expect("accept the agent");
        assert_eq!(hello.token, self.token);
        Conn(conn)
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

/// The host's end of the agent connection: its typed calls, each within [`WAIT`].
#[derive(Clone)]
struct Conn(AgentConn);

/// A tar upload with the agent's defaults: not compressed, its own size limit.
const TAR: UploadKind = UploadKind::Tar {
    gzip: false,
    max_bytes: None,
};

/// Largest file these tests download.
const MAX_DOWNLOAD: usize = 64 << 20;

impl Conn {
    async fn upload(
        &self,
        path: &str,
        kind: UploadKind,
        data: impl Into<Bytes>,
    ) -> Result<Uploaded, AgentError> {
        let body = body_from_bytes(data);
        within(path, self.0.upload(path, kind, body)).await
    }

    /// Uploads a file with the agent's defaults (0644, root's).
    async fn put_file(&self, path: &str, data: impl Into<Bytes>) -> Result<FileInfo, AgentError> {
        within(path, self.0.write_file(path, data.into())).await
    }

    /// Uploads a file with its mode and owner.
    async fn put_file_as(
        &self,
        path: &str,
        (mode, uid, gid): (u32, u32, u32),
        data: impl Into<Bytes>,
    ) -> Result<FileInfo, AgentError> {
        let kind = UploadKind::File {
            mode: Some(mode),
            uid: Some(uid),
            gid: Some(gid),
        };
        match self.upload(path, kind, data).await? {
            Uploaded::File(info) => Ok(info),
            other => panic!("not a file's answer: {other:?}"),
        }
    }

    async fn put_tar_as(
        &self,
        path: &str,
        kind: UploadKind,
        data: impl Into<Bytes>,
    ) -> Result<UnpackStats, AgentError> {
        match self.upload(path, kind, data).await? {
            Uploaded::Archive(stats) => Ok(stats),
            other => panic!("not an archive's answer: {other:?}"),
        }
    }

    async fn put_tar(&self, path: &str, data: impl Into<Bytes>) -> Result<UnpackStats, AgentError> {
        self.put_tar_as(path, TAR, data).await
    }

    /// A file's bytes.
    async fn download(&self, path: &str) -> Result<Bytes, AgentError> {
        within(path, self.0.read_file(path, MAX_DOWNLOAD)).await
    }

    /// A tar of `path`, whole: a download the agent broke off is an error.
    async fn download_tar(&self, path: &str) -> Result<Vec<u8>, AgentError> {
        let (data, end) = self
            .download_as_far_as_it_goes(path, DownloadFormat::Tar)
            .await;
        end.map(|()| data)
    }

    /// A download's bytes as far as they came, and how it ended.
    async fn download_as_far_as_it_goes(
        &self,
        path: &str,
        format: DownloadFormat,
    ) -> (Vec<u8>, Result<(), AgentError>) {
        let mut download = match within(path, self.0.download(path, format)).await {
            Ok(d) => d,
            Err(e) => return (Vec::new(), Err(e)),
        };
        let mut data = Vec::new();
        while let Some(chunk) = within("download", download.body.next()).await {
            match chunk {
                Ok(c) => data.extend_from_slice(&c),
                Err(e) => return (data, Err(e)),
            }
        }
        (data, Ok(()))
    }

    async fn stat(&self, path: &str) -> Result<FileInfo, AgentError> {
        within(path, self.0.stat(path)).await
    }

    async fn list(&self, path: &str, depth: u32) -> Result<FileListing, AgentError> {
        within(path, self.0.list_files(path, Some(depth))).await
    }

    async fn mkdir(&self, req: MkdirRequest) -> Result<FileInfo, AgentError> {
        within(&req.path, self.0.mkdir(&req)).await
    }

    async fn move_file(
        &self,
        from: &str,
        to: &str,
        overwrite: bool,
    ) -> Result<FileInfo, AgentError> {
        let req = MoveRequest {
            from: from.into(),
            to: to.into(),
            overwrite: overwrite.then_some(true),
        };
        within(from, self.0.move_file(&req)).await
    }

    async fn delete(&self, path: &str, recursive: bool) -> Result<u64, AgentError> {
        within(path, self.0.remove(path, recursive))
            .await
            .map(|r| r.removed)
    }

    /// A request the typed calls do not make (malformed, unknown, or to see exactly what
    /// the agent answers), sent as it is.
    async fn raw(&self, method: Method, path_and_query: &str, body: impl Into<Bytes>) -> Reply {
        let resp = within(
            path_and_query,
            self.0.send_raw(method, path_and_query, None, body),
        )
        .await
        .expect("response");
        Reply::read(resp).await
    }
}

/// A tar unpacked with at most `max_bytes`.
fn limit(max_bytes: u64) -> UploadKind {
    UploadKind::Tar {
        gzip: false,
        max_bytes: Some(max_bytes),
    }
}

fn mkdir(path: &str) -> MkdirRequest {
    MkdirRequest {
        path: path.into(),
        ..MkdirRequest::default()
    }
}

trait Refused {
    /// Asserts that this is the agent's refusal with `status` and `code`; its message.
    fn refused(self, status: StatusCode, code: ErrorCode) -> String;
}

impl<T: std::fmt::Debug> Refused for Result<T, AgentError> {
    #[track_caller]
    fn refused(self, status: StatusCode, code: ErrorCode) -> String {
        match self {
            Err(AgentError::Refused {
                status: s,
                code: c,
                message,
            }) if (s, c) == (status, code) => message,
            other => panic!("expected a refusal with {status} {code}, got {other:?}"),
        }
    }
}

/// An answer as the agent sent it.
struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    trailers: Option<HeaderMap>,
}

impl Reply {
    async fn read(resp: http::Response<hyper::body::Incoming>) -> Reply {
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

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    /// Asserts the status (and the error code for errors); returns the JSON.
    #[track_caller]
    fn expect_answer(&self, status: StatusCode, code: Option<&str>) -> Value {
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
    let c = host.accept().await;
    let root = host.root.clone();

    // mkdir -p with mode and owner.
    let v = c
        .mkdir(MkdirRequest {
            path: "/home/u/a/b".into(),
            mode: Some(0o750),
            uid: Some(1000),
            gid: Some(1001),
        })
        .await
        .expect("mkdir");
    assert_eq!(v.kind, FileType::Dir);
    assert_eq!(v.path, "/home/u/a/b");
    assert_eq!(v.mode, 0o750);
    let md = std::fs::metadata(root.join("home/u/a/b")).expect("made");
    assert_eq!(
        (md.mode() & 0o7777, md.uid(), md.gid()),
        (0o750, 1000, 1001)
    );
    // Existing directory: fine. Existing file in the way: conflict.
    c.mkdir(mkdir("/home/u/a/b")).await.expect("mkdir again");
    std::fs::write(root.join("home/file"), b"x").expect("write");
    c.mkdir(mkdir("/home/file/sub"))
        .await
        .refused(StatusCode::CONFLICT, ErrorCode::Conflict);
    // A field the request does not have (the typed request cannot carry one).
    c.raw(
        Method::POST,
        "/v1/files/mkdir",
        json!({"path": "/x", "bogus": 1}).to_string(),
    )
    .await
    .expect_answer(StatusCode::BAD_REQUEST, Some("invalid_request"));

    // Upload with mode and owner; the answer and the disk agree.
    let v = c
        .put_file_as("/home/u/hello.txt", (0o640, 1000, 1002), "hello world")
        .await
        .expect("upload");
    assert_eq!(v.size, 11);
    assert_eq!(v.mode, 0o640);
    assert_eq!(v.uid, 1000);
    assert_eq!(v.name, "hello.txt");
    let md = std::fs::metadata(root.join("home/u/hello.txt")).expect("uploaded");
    assert_eq!(
        (md.mode() & 0o7777, md.uid(), md.gid()),
        (0o640, 1000, 1002)
    );
    // Defaults: 0644 root:root; overwriting replaces.
    c.put_file("/home/u/hello.txt", "bye")
        .await
        .expect("upload");
    let md = std::fs::metadata(root.join("home/u/hello.txt")).expect("uploaded");
    assert_eq!((md.mode() & 0o7777, md.uid(), md.gid()), (0o644, 0, 0));
    assert_eq!(read(root.join("home/u/hello.txt")), b"bye");
    let setuid = UploadKind::File {
        mode: Some(0o4755),
        uid: None,
        gid: None,
    };
    c.upload("/home/u/hello.txt", setuid, "bye")
        .await
        .expect("upload");
    assert_eq!(
        std::fs::metadata(root.join("home/u/hello.txt"))
            .expect("md")
            .mode()
            & 0o7777,
        0o4755
    );
    c.put_file("/nope/x", "x")
        .await
        .refused(StatusCode::NOT_FOUND, ErrorCode::NotFound);
    c.put_file("/home/u", "x")
        .await
        .refused(StatusCode::CONFLICT, ErrorCode::Conflict);
    // A mode that is not octal, and no path at all: requests the host never makes.
    c.raw(Method::PUT, "/v1/files?path=/home/u/m&mode=99", "x")
        .await
        .expect_answer(StatusCode::BAD_REQUEST, Some("invalid_request"));
    c.raw(Method::PUT, "/v1/files", "x")
        .await
        .expect_answer(StatusCode::BAD_REQUEST, Some("invalid_path"));
    c.put_file("relative", "x")
        .await
        .refused(StatusCode::BAD_REQUEST, ErrorCode::InvalidPath);
    // No temporary files left behind.
    let left: Vec<_> = std::fs::read_dir(root.join("home/u"))
        .expect("dir")
        .map(|e| e.expect("e").file_name())
        .collect();
    assert_eq!(left.len(), 2, "{left:?}");

    // Download: bytes and headers.
    c.put_file_as("/home/u/bin", (0o751, 7, 8), vec![0u8, 1, 2, 255])
        .await
        .expect("upload");
    let mut d = within("download", c.0.download("/home/u/bin", DownloadFormat::Raw))
        .await
        .expect("download");
    assert_eq!(
        (d.size, d.mode, d.uid, d.gid),
        (Some(4), Some(0o751), Some(7), Some(8))
    );
    let mut bytes = Vec::new();
    while let Some(chunk) = within("download", d.body.next()).await {
        bytes.extend_from_slice(&chunk.expect("download"));
    }
    assert_eq!(&bytes[..], &[0u8, 1, 2, 255]);
    // The headers as the agent wrote them.
    let r = Reply::read(
        within(
            "download",
            c.0.download_answer("/home/u/bin", DownloadFormat::Raw),
        )
        .await
        .expect("download"),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(&r.body[..], &[0u8, 1, 2, 255]);
    assert_eq!(r.headers["content-type"], "application/octet-stream");
    assert_eq!(r.headers["content-length"], "4");
    assert_eq!(r.headers["x-space-mode"], "0751");
    assert_eq!(r.headers["x-space-uid"], "7");
    assert_eq!(r.headers["x-space-gid"], "8");
    let message = c
        .download("/home/u")
        .await
        .refused(StatusCode::BAD_REQUEST, ErrorCode::NotAFile);
    assert!(message.contains("format=tar"), "{message}");
    c.download("/home/u/missing")
        .await
        .refused(StatusCode::NOT_FOUND, ErrorCode::NotFound);
    // A big file streams through intact.
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    c.put_file("/home/u/big", big.clone())
        .await
        .expect("upload");
    let got = c.download("/home/u/big").await.expect("download");
    assert!(got[..] == big[..], "big file round trip");
    c.delete("/home/u/big", false).await.expect("delete");

    // Stat: a link is a link.
    std::os::unix::fs::symlink("hello.txt", root.join("home/u/link")).expect("symlink");
    let v = c.stat("/home/u/link").await.expect("stat");
    assert_eq!(v.kind, FileType::Symlink);
    assert_eq!(v.link_target.as_deref(), Some("hello.txt"));
    let v = c.stat("//home/./u/hello.txt").await.expect("stat");
    assert_eq!(v.path, "/home/u/hello.txt");
    assert_eq!(v.kind, FileType::File);
    assert!(v.link_target.is_none());
    // ... and the answer has no such field at all.
    let r = c
        .raw(Method::GET, "/v1/files/stat?path=/home/u/hello.txt", "")
        .await;
    assert!(r
        .expect_answer(StatusCode::OK, None)
        .get("link_target")
        .is_none());
    let v = c.stat("/").await.expect("stat");
    assert_eq!(v.kind, FileType::Dir);
    c.stat("/home/nothing")
        .await
        .refused(StatusCode::NOT_FOUND, ErrorCode::NotFound);

    // List: depth-first, sorted, bounded depth.
    let v = c.list("/home", 1).await.expect("list");
    assert_eq!(v.path, "/home");
    assert!(!v.truncated);
    let names: Vec<&str> = v.entries.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(names, vec!["/home/file", "/home/u"]);
    let v = c.list("/home", 3).await.expect("list");
    let names: Vec<&str> = v.entries.iter().map(|e| e.path.as_str()).collect();
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
        .refused(StatusCode::BAD_REQUEST, ErrorCode::InvalidRequest);
    c.list("/home", 65)
        .await
        .refused(StatusCode::BAD_REQUEST, ErrorCode::InvalidRequest);

    // Move.
    c.move_file("/home/u/bin", "/home/u/hello.txt", false)
        .await
        .refused(StatusCode::CONFLICT, ErrorCode::Conflict);
    let v = c
        .move_file("/home/u/bin", "/home/u/hello.txt", true)
        .await
        .expect("move");
    assert_eq!(v.path, "/home/u/hello.txt");
    assert_eq!(v.size, 4);
    let v = c
        .move_file("/home/u/link", "/home/l2", false)
        .await
        .expect("move");
    assert_eq!(v.kind, FileType::Symlink);
    c.move_file("/home/u/none", "/home/z", false)
        .await
        .refused(StatusCode::NOT_FOUND, ErrorCode::NotFound);
    c.move_file("/home/u", "/home/u/a/inside", false)
        .await
        .refused(StatusCode::BAD_REQUEST, ErrorCode::InvalidRequest);

    // Delete.
    let message = c
        .delete("/home/u", false)
        .await
        .refused(StatusCode::CONFLICT, ErrorCode::Conflict);
    assert!(message.contains("recursive"), "{message}");
    assert_eq!(c.delete("/home/l2", false).await.expect("delete"), 1);
    assert!(
        root.join("home/u/hello.txt").exists(),
        "link removed, not its target"
    );
    assert_eq!(
        c.delete("/home/u", true).await.expect("delete"),
        4,
        "u, a, b, hello.txt"
    );
    assert!(!root.join("home/u").exists());
    c.delete("/", true)
        .await
        .refused(StatusCode::BAD_REQUEST, ErrorCode::InvalidPath);
    c.delete("/home/u", true)
        .await
        .refused(StatusCode::NOT_FOUND, ErrorCode::NotFound);
    assert!(root.exists());

    // Requests the host never makes.
    c.raw(Method::GET, "/v1/files/nothing", "")
        .await
        .expect_answer(StatusCode::NOT_FOUND, Some("not_found"));
    c.raw(Method::POST, "/v1/files?path=/x", "")
        .await
        .expect_answer(StatusCode::METHOD_NOT_ALLOWED, None);

    // The exact statuses of successes, which the typed calls do not show.
    c.raw(
        Method::POST,
        "/v1/files/mkdir",
        json!({"path": "/pin"}).to_string(),
    )
    .await
    .expect_answer(StatusCode::CREATED, None);
    c.raw(Method::PUT, "/v1/files?path=/pin/f", "f")
        .await
        .expect_answer(StatusCode::CREATED, None);
    c.raw(
        Method::PUT,
        "/v1/files?path=/pin/t&format=tar",
        Tar::new().file("g", b"g").build(),
    )
    .await
    .expect_answer(StatusCode::CREATED, None);
    c.raw(Method::GET, "/v1/files/stat?path=/pin/f", "")
        .await
        .expect_answer(StatusCode::OK, None);
    c.raw(Method::GET, "/v1/files/list?path=/pin&depth=1", "")
        .await
        .expect_answer(StatusCode::OK, None);
    c.raw(
        Method::POST,
        "/v1/files/move",
        json!({"from": "/pin/f", "to": "/pin/f2"}).to_string(),
    )
    .await
    .expect_answer(StatusCode::OK, None);
    c.raw(Method::DELETE, "/v1/files?path=/pin&recursive=true", "")
        .await
        .expect_answer(StatusCode::OK, None);
    host.assert_outside_empty();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tar_round_trip_keeps_modes_owners_times_and_links() {
    let host = Host::start();
    let c = host.accept().await;
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

    // The answer as the agent sent it: a tar, and no failure after the headers.
    let r = Reply::read(
        within("download", c.0.download_answer("/src", DownloadFormat::Tar))
            .await
            .expect("download"),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(r.headers["content-type"], "application/x-tar");
    assert!(r.trailers.is_none(), "{:?}", r.trailers);
    let tar = c.download_tar("/src").await.expect("download");
    let ms = members(&tar);
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
    let v = c.put_tar("/dst/x", tar.clone()).await.expect("upload");
    assert_eq!(v.entries, 9);
    assert_eq!(v.bytes, 5 + 10 + 4);
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
    let again = c.download_tar("/dst/x").await.expect("download");
    assert_eq!(members(&again), ms, "a second round trip is identical");

    // One file: one entry under its own name; gzip upload too.
    let one = c.download_tar("/src/sub/exe").await.expect("download");
    assert_eq!(names_of(&one), vec!["exe"]);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&one).expect("gzip");
    let gz = gz.finish().expect("gzip");
    let gzip = UploadKind::Tar {
        gzip: true,
        max_bytes: None,
    };
    c.put_tar_as("/gz", gzip, gz).await.expect("upload");
    assert_eq!(read(root.join("gz/exe")), b"#!/bin/sh\n");
    c.put_tar_as("/gz2", gzip, "not gzip")
        .await
        .refused(StatusCode::BAD_REQUEST, ErrorCode::InvalidRequest);
    assert!(
        !root.join("gz2").exists(),
        "a failed upload leaves no directory"
    );
    c.download_tar("/src/fifo")
        .await
        .refused(StatusCode::BAD_REQUEST, ErrorCode::NotAFile);
    c.download_tar("/missing")
        .await
        .refused(StatusCode::NOT_FOUND, ErrorCode::NotFound);
    host.assert_outside_empty();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dotdot_and_malformed_paths_are_refused() {
    let host = Host::start();
    let c = host.accept().await;
    std::fs::write(host.outside.join("secret"), b"s").expect("secret");
    for p in ["/../outside/secret", "/a/../../outside/secret", "/..", ".."] {
        c.download(p)
            .await
            .refused(StatusCode::BAD_REQUEST, ErrorCode::InvalidPath);
        c.put_file(p, "x")
            .await
            .refused(StatusCode::BAD_REQUEST, ErrorCode::InvalidPath);
        c.stat(p)
            .await
            .refused(StatusCode::BAD_REQUEST, ErrorCode::InvalidPath);
    }
    // NUL and invalid UTF-8 in the query (the latter a request the host never makes).
    c.stat("/a\0b")
        .await
        .refused(StatusCode::BAD_REQUEST, ErrorCode::InvalidPath);
    c.raw(Method::GET, "/v1/files/stat?path=/a%FFb", "")
        .await
        .expect_answer(StatusCode::BAD_REQUEST, Some("invalid_path"));
    c.raw(Method::GET, "/v1/files/list?path=/&depth=%FF", "")
        .await
        .expect_answer(StatusCode::BAD_REQUEST, Some("invalid_request"));
    std::fs::remove_file(host.outside.join("secret")).expect("rm");
    host.assert_outside_empty();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absolute_symlink_resolves_inside_the_root() {
    let host = Host::start();
    let c = host.accept().await;
    let root = host.root.clone();
    std::fs::create_dir_all(root.join("etc")).expect("etc");
    std::fs::create_dir_all(root.join("tmp")).expect("tmp");
    std::fs::write(root.join("etc/marker"), b"inside").expect("marker");
    std::os::unix::fs::symlink("/etc", root.join("tmp/x")).expect("symlink");

    let r = c.download("/tmp/x/marker").await.expect("download");
    assert_eq!(&r[..], b"inside");
    // The host's /etc is never read.
    assert!(Path::new("/etc/passwd").exists());
    c.download("/tmp/x/passwd")
        .await
        .refused(StatusCode::NOT_FOUND, ErrorCode::NotFound);
    c.download_tar("/tmp/x/passwd")
        .await
        .refused(StatusCode::NOT_FOUND, ErrorCode::NotFound);
    // ... nor written.
    let name = format!("space-agent-test-{}", std::process::id());
    c.put_file(&format!("/tmp/x/{name}"), "w")
        .await
        .expect("accepted");
    assert!(!Path::new("/etc").join(&name).exists());
    assert_eq!(read(root.join("etc").join(&name)), b"w");
    let v = c
        .put_tar("/tmp/x/t", Tar::new().file("f", b"tar").build())
        .await
        .expect("accepted");
    assert_eq!(v.entries, 1);
    assert!(!Path::new("/etc/t").exists());
    assert_eq!(read(root.join("etc/t/f")), b"tar");
    c.mkdir(mkdir(&format!("/tmp/x/{name}-d")))
        .await
        .expect("accepted");
    assert!(!Path::new("/etc").join(format!("{name}-d")).exists());
    assert!(root.join("etc").join(format!("{name}-d")).is_dir());
    // The tar of the link's target is the root's /etc.
    let r = c.download_tar("/tmp/x").await.expect("download");
    assert_eq!(
        names_of(&r),
        vec![
            "marker".to_string(),
            name.clone(),
            format!("{name}-d"),
            "t".into(),
            "t/f".into()
        ]
    );
    // Deleting through the link removes the link only.
    c.delete("/tmp/x", false).await.expect("accepted");
    assert!(root.join("etc/marker").exists());
    host.assert_outside_empty();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relative_symlink_dotdots_are_clamped_at_the_root() {
    let host = Host::start();
    let c = host.accept().await;
    let root = host.root.clone();
    std::fs::create_dir_all(root.join("a/b/c")).expect("dirs");
    std::fs::create_dir_all(root.join("outside")).expect("decoy");
    std::fs::write(root.join("outside/decoy"), b"root's own").expect("decoy");
    let up = "../".repeat(30);
    std::os::unix::fs::symlink(format!("{up}outside"), root.join("a/b/c/up")).expect("symlink");
    std::fs::write(host.outside.join("decoy"), b"host").expect("host decoy");

    let r = c.download("/a/b/c/up/decoy").await.expect("download");
    assert_eq!(&r[..], b"root's own");
    c.put_file("/a/b/c/up/new", "n").await.expect("accepted");
    assert_eq!(read(root.join("outside/new")), b"n");
    assert!(!host.outside.join("new").exists());
    // A loop is an error, not a hang.
    std::os::unix::fs::symlink("l2", root.join("l1")).expect("l1");
    std::os::unix::fs::symlink("l1", root.join("l2")).expect("l2");
    let v = c
        .download("/l1")
        .await
        .refused(StatusCode::BAD_REQUEST, ErrorCode::InvalidPath);
    assert!(v.contains("symbolic links"));
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
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0u32;
            while Instant::now() < deadline {
                // What came back: the bytes of a download, as far as it went, and how
                // the call ended.
                let (data, end) = match (n + t) % 5 {
                    0 => (
                        Vec::new(),
                        c.put_file("/work/d/up", "payload").await.map(drop),
                    ),
                    1 => {
                        c.download_as_far_as_it_goes("/work/d/f", DownloadFormat::Raw)
                            .await
                    }
                    2 => {
                        let tar = Tar::new().file("g", b"payload").build();
                        (Vec::new(), c.put_tar("/work/d/t", tar).await.map(drop))
                    }
                    3 => {
                        c.download_as_far_as_it_goes("/work/d", DownloadFormat::Tar)
                            .await
                    }
                    _ => (Vec::new(), c.delete("/work/d/up", false).await.map(drop)),
                };
                let download = matches!((n + t) % 5, 1 | 3);
                // A success, a refusal of the request, or a download the agent broke
                // off after its headers: its failure trailer, or (a file that changed
                // size under a raw download's content-length) a reset stream. Either is
                // an error, never a short success.
                let message = match end {
                    Ok(()) => String::new(),
                    Err(AgentError::Refused {
                        status, message, ..
                    }) => {
                        assert!(status.is_client_error(), "{status}: {message}");
                        message
                    }
                    Err(AgentError::Failed(message)) => message,
                    Err(AgentError::Broken(e)) if download => e.to_string(),
                    Err(e) => panic!("{e:?}"),
                };
                assert!(
                    !data.windows(7).any(|w| w == b"OUTSIDE") && !message.contains("OUTSIDE"),
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
    c.stat("/work").await.expect("accepted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tar_hard_links_stay_inside() {
    let host = Host::start();
    let c = host.accept().await;
    let root = host.root.clone();
    std::fs::write(root.join("existing"), b"pre-existing").expect("existing");
    std::fs::write(host.outside.join("target"), b"out").expect("target");

    let ok = Tar::new()
        .file("f", b"data")
        .link(tar::EntryType::Link, "sub/h", "f")
        .build();
    c.put_tar("/in", ok).await.expect("accepted");
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
            .put_tar("/bad", data)
            .await
            .refused(StatusCode::BAD_REQUEST, ErrorCode::UnsafeArchive);
        assert!(v.contains("\"h\""), "{what}: {v}");
        assert!(!root.join("bad").exists(), "{what}: cleaned up");
    }
    // A link to a file that exists in the directory but not in the archive.
    std::fs::create_dir_all(root.join("pre")).expect("pre");
    std::fs::write(root.join("pre/old"), b"old").expect("old");
    let data = Tar::new()
        .file("f", b"d")
        .link(tar::EntryType::Link, "h", "old")
        .build();
    c.put_tar("/pre", data)
        .await
        .refused(StatusCode::BAD_REQUEST, ErrorCode::UnsafeArchive);
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
    let c = host.accept().await;
    let root = host.root.clone();
    // A fifo nobody writes to: opening it for reading would block forever.
    mkfifo(&root.join("fifo"));
    let started = Instant::now();
    let v = c
        .download("/fifo")
        .await
        .refused(StatusCode::BAD_REQUEST, ErrorCode::NotAFile);
    assert!(v.contains("not a regular file"));
    assert!(started.elapsed() < Duration::from_secs(30));
    // A character device (we run as root in these tests; skip if mknod is refused).
    let null = root.join("null");
    let c_null = std::ffi::CString::new(null.as_os_str().as_bytes()).expect("path");
    // SAFETY: plain syscall with a NUL-terminated path.
    let made =
        unsafe { libc::mknod(c_null.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) } == 0;
    if made {
        c.download("/null")
            .await
            .refused(StatusCode::BAD_REQUEST, ErrorCode::NotAFile);
        std::os::unix::fs::symlink("/null", root.join("to-null")).expect("symlink");
        c.download("/to-null")
            .await
            .refused(StatusCode::BAD_REQUEST, ErrorCode::NotAFile);
    }
    // A tar of the directory skips them.
    std::fs::write(root.join("plain"), b"p").expect("plain");
    let r = c.download_tar("/").await.expect("download");
    let names = names_of(&r);
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
            .put_tar("/up", data)
            .await
            .refused(StatusCode::BAD_REQUEST, ErrorCode::UnsafeArchive);
        assert!(v.contains("\"dev\""), "{v}");
        assert!(!root.join("up").exists());
    }
    // Uploading over a fifo replaces it without opening it.
    c.put_file("/fifo", "now a file").await.expect("accepted");
    assert_eq!(read(root.join("fifo")), b"now a file");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tar_names_that_escape_are_refused() {
    let host = Host::start();
    let c = host.accept().await;
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
            .put_tar("/dst", data)
            .await
            .refused(StatusCode::BAD_REQUEST, ErrorCode::UnsafeArchive);
        let msg = v;
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
        .put_tar("/dst", data)
        .await
        .refused(StatusCode::BAD_REQUEST, ErrorCode::UnsafeArchive);
    assert!(v.contains("symbolic link"));
    assert!(!root.join("dst/l").exists(), "the link was removed again");
    // Nor is one that already exists below the target directory.
    std::os::unix::fs::symlink(&host.outside, root.join("dst/out")).expect("symlink");
    std::os::unix::fs::symlink("/", root.join("dst/top")).expect("symlink");
    for name in ["out/x", "top/x", "out/deep/x"] {
        let v = c
            .put_tar("/dst", Tar::new().file(name, b"evil").build())
            .await
            .refused(StatusCode::BAD_REQUEST, ErrorCode::UnsafeArchive);
        assert!(v.contains(name));
    }
    assert!(!root.join("x").exists());
    host.assert_outside_empty();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_beyond_limits_are_refused_and_removed() {
    let host = Host::start();
    let c = host.accept().await;
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
        .put_tar_as("/big", limit((2 << 20) + 10), data.clone())
        .await
        .refused(StatusCode::PAYLOAD_TOO_LARGE, ErrorCode::TooLarge);
    assert!(v.contains("d/3"), "{v}");
    assert!(!root.join("big").exists(), "everything removed");
    // The same archive fits without the limit.
    let v = c.put_tar("/big", data).await.expect("accepted");
    assert_eq!(v.bytes, 3 << 20);
    // An existing target directory stays, only the upload's files go.
    std::fs::create_dir_all(root.join("keep")).expect("keep");
    std::fs::write(root.join("keep/old"), b"old").expect("old");
    let data = Tar::new().file("new", &mib).file("new2", &mib).build();
    c.put_tar_as("/keep", limit(1048577), data)
        .await
        .refused(StatusCode::PAYLOAD_TOO_LARGE, ErrorCode::TooLarge);
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
    c.put_tar_as("/huge", limit(1048576), raw)
        .await
        .refused(StatusCode::PAYLOAD_TOO_LARGE, ErrorCode::TooLarge);
    assert!(!root.join("huge").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gzip_bomb_is_stopped_with_bounded_memory() {
    let host = Host::start();
    let c = host.accept().await;
    let root = host.root.clone();
    // 1 GiB of zeros in 16 MiB files, compressed on the fly as the agent reads.
    let (tx, mut rx) = mpsc::channel::<Bytes>(4);
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
    let body = body_from_stream(futures::stream::poll_fn(move |cx| {
        rx.poll_recv(cx).map(|b| b.map(Ok))
    }));
    let kind = UploadKind::Tar {
        gzip: true,
        max_bytes: Some(67108864),
    };
    let r = within("the upload", c.0.upload("/bomb", kind, body)).await;
    stop.store(true, Ordering::Relaxed);
    let v = r.refused(StatusCode::PAYLOAD_TOO_LARGE, ErrorCode::TooLarge);
    assert!(v.contains("bomb/"), "{v}");
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
    let c = host.accept().await;
    let root = host.root.clone();
    let c256 = format!("/{}", "a".repeat(256));
    c.put_file(&c256, "x")
        .await
        .refused(StatusCode::BAD_REQUEST, ErrorCode::InvalidPath);
    c.stat(&c256)
        .await
        .refused(StatusCode::BAD_REQUEST, ErrorCode::InvalidPath);
    let c255 = format!("/{}", "a".repeat(255));
    c.put_file(&c255, "x").await.expect("accepted");
    let long = "/abcdefgh".repeat(456);
    assert!(long.len() > 4096);
    c.stat(&long)
        .await
        .refused(StatusCode::BAD_REQUEST, ErrorCode::InvalidPath);
    c.mkdir(mkdir(&long))
        .await
        .refused(StatusCode::BAD_REQUEST, ErrorCode::InvalidPath);
    // In an archive: GNU long names up to the limits work, beyond them the upload fails.
    let ok_name = format!("{}/{}", "d".repeat(255), "f".repeat(255));
    c.put_tar("/t", Tar::new().file(&ok_name, b"ok").build())
        .await
        .expect("accepted");
    assert_eq!(read(root.join("t").join(&ok_name)), b"ok");
    let bad = Tar::new()
        .file("first", b"1")
        .file(&"x".repeat(256), b"x")
        .build();
    c.put_tar("/t2", bad)
        .await
        .refused(StatusCode::BAD_REQUEST, ErrorCode::InvalidPath);
    assert!(!root.join("t2").exists());
    let deep = format!("{}x", "abcdefgh/".repeat(460));
    let bad = Tar::new().file(&deep, b"x").build();
    c.put_tar("/t3", bad)
        .await
        .refused(StatusCode::BAD_REQUEST, ErrorCode::InvalidPath);
    assert!(!root.join("t3").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_utf8_names_round_trip() {
    let host = Host::start();
    let c = host.accept().await;
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
    c.put_tar("/u", data).await.expect("accepted");
    let on_disk = root.join("u").join(std::ffi::OsStr::from_bytes(raw_name));
    assert_eq!(read(&on_disk), b"raw");

    let v = c.list("/u/dir", 1).await.expect("accepted");
    let e = &v.entries[0];
    assert_eq!(e.name, "caf\u{fffd}.bin");
    assert_eq!(
        e.name_base64,
        Some(base64::engine::general_purpose::STANDARD.encode(b"caf\xff.bin"))
    );
    let v = c.list("/u", 1).await.expect("accepted");
    assert!(
        v.entries[0].name_base64.is_none(),
        "only for non-UTF-8 names"
    );
    // ... and the answer has no such field at all.
    let v = c
        .raw(Method::GET, "/v1/files/list?path=/u&depth=1", "")
        .await
        .expect_answer(StatusCode::OK, None);
    assert!(
        v["entries"][0].get("name_base64").is_none(),
        "only for non-UTF-8 names"
    );

    let r = c.download_tar("/u").await.expect("download");
    let ms = members(&r);
    assert_eq!(ms[1].0, raw_name);
    assert_eq!(ms[1].2, b"raw");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forbidden_areas_are_refused() {
    let host = Host::start();
    let c = host.accept().await;
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
        .refused(StatusCode::FORBIDDEN, ErrorCode::ForbiddenPath);
    c.stat("/proc")
        .await
        .refused(StatusCode::FORBIDDEN, ErrorCode::ForbiddenPath);
    c.put_file("/.space/run/token", "x")
        .await
        .refused(StatusCode::FORBIDDEN, ErrorCode::ForbiddenPath);
    assert_eq!(read(root.join(".space/run/token")), b"secret");
    c.download("/spacelink/token")
        .await
        .refused(StatusCode::FORBIDDEN, ErrorCode::ForbiddenPath);
    c.download("/devlink/null")
        .await
        .refused(StatusCode::FORBIDDEN, ErrorCode::ForbiddenPath);
    c.put_file("/devlink/x", "x")
        .await
        .refused(StatusCode::FORBIDDEN, ErrorCode::ForbiddenPath);
    c.delete("/sys", true)
        .await
        .refused(StatusCode::FORBIDDEN, ErrorCode::ForbiddenPath);
    c.move_file("/ok", "/dev/ok", false)
        .await
        .refused(StatusCode::FORBIDDEN, ErrorCode::ForbiddenPath);
    c.move_file("/proc/1", "/p", false)
        .await
        .refused(StatusCode::FORBIDDEN, ErrorCode::ForbiddenPath);
    c.mkdir(mkdir("/devlink/new"))
        .await
        .refused(StatusCode::FORBIDDEN, ErrorCode::ForbiddenPath);
    c.list("/proc", 1)
        .await
        .refused(StatusCode::FORBIDDEN, ErrorCode::ForbiddenPath);
    c.put_tar(
        "/",
        Tar::new().file("fine", b"f").file("dev/x", b"x").build(),
    )
    .await
    .refused(StatusCode::FORBIDDEN, ErrorCode::ForbiddenPath);
    assert!(!root.join("fine").exists() && !root.join("dev/x").exists());
    c.put_tar("/devlink", Tar::new().file("x", b"x").build())
        .await
        .refused(StatusCode::FORBIDDEN, ErrorCode::ForbiddenPath);
    // The links themselves may be looked at and removed.
    c.stat("/devlink").await.expect("accepted");
    // Listing and archiving / leave the areas out.
    let v = c.list("/", 2).await.expect("accepted");
    let names: Vec<&str> = v.entries.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(names, vec!["/devlink", "/ok", "/spacelink"]);
    let r = c.download_tar("/").await.expect("download");
    assert_eq!(names_of(&r), vec!["devlink", "ok", "spacelink"]);
    c.delete("/devlink", false).await.expect("accepted");
    assert!(root.join("dev/null").exists());
}
