//! Boots the real microVM guest (scripts/build-guest.sh) under QEMU with TCG, as the microVM
//! driver does: the busybox template as an ext4 image under a larger qcow2 overlay, the
//! static agent appended to the initramfs, the agent's virtio-serial port connected to a Unix
//! socket this test listens on. Then it plays the host with the host's end of the protocol
//! (`space_agent_host`): handshake, HTTP/2, one command, a dropped connection the agent must
//! come back from, and a kill that must leave nothing.
//!
//! Skipped (with the reason printed) only when the guest files are not built.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use space_agent::protocol::{ExitStatus, Frame, SpawnRequest, PROTOCOL_VERSION};
use space_agent_host::testing::{self, AcceptError};
use space_agent_host::{AgentConn, HandshakeError};
use space_runtime::guest::{self, GuestFiles};
use space_runtime::template::TemplateStore;
use tokio::net::UnixListener;

const SANDBOX: &str = "sb_guesttest";
/// Boot under TCG takes ~5 s here; a loaded machine gets a generous margin.
const BOOT_WAIT: Duration = Duration::from_secs(40);
const WAIT: Duration = Duration::from_secs(20);
const BASE_MIB: u64 = 64;
const OVERLAY_MIB: u64 = 512;

async fn within<F: std::future::Future>(what: &str, limit: Duration, f: F) -> F::Output {
    match tokio::time::timeout(limit, f).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {limit:?} waiting for {what}"),
    }
}

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn guest_dir() -> PathBuf {
    std::env::var_os("SPACE_GUEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/guest"))
}

fn templates_dir() -> PathBuf {
    std::env::var_os("SPACE_TEST_TEMPLATES")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/space-test-templates"))
}

fn agent_binary() -> PathBuf {
    std::env::var_os("SPACE_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/x86_64-unknown-linux-gnu/release/space-agent"))
}

struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let mut random = [0u8; 8];
        getrandom::getrandom(&mut random).expect("random bytes");
        let hex: String = random.iter().map(|b| format!("{b:02x}")).collect();
        let path = std::env::temp_dir().join(format!("space-guest-test-{hex}"));
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Prints the guest's console when the test fails.
struct ConsoleOnPanic(PathBuf);

impl Drop for ConsoleOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let text = std::fs::read_to_string(&self.0).unwrap_or_default();
            eprintln!("guest console ({}):\n{text}", self.0.display());
        }
    }
}

/// The QEMU process this test started; killed (by its pid) on drop.
struct Vm(Child);

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn run_tool(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[derive(Debug, Default)]
struct Output {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    exit: Option<ExitStatus>,
}

/// Runs a shell script in the guest to its end.
async fn run(conn: &AgentConn, id: &str, script: &str) -> Output {
    let spawn = SpawnRequest {
        id: id.into(),
        argv: vec!["sh".into(), "-c".into(), script.into()],
        env: vec![("PATH".into(), "/usr/bin:/bin:/usr/sbin:/sbin".into())],
        secrets: Vec::new(),
        cwd: None,
        user: None,
        timeout_ms: None,
        stdin: false,
        pty: None,
    };
    within("spawn", WAIT, conn.spawn(&spawn))
        .await
        .expect("spawn");
    let mut attach = within("attach", WAIT, conn.attach(id, 0, 0))
        .await
        .expect("attach");
    let mut out = Output::default();
    while let Some(f) = within("attach frame", WAIT, attach.next_frame())
        .await
        .expect("agent frame")
    {
        match f {
            Frame::Stdout { data, .. } => out.stdout.extend_from_slice(&data),
            Frame::Stderr { data, .. } => out.stderr.extend_from_slice(&data),
            Frame::Exit(e) => out.exit = Some(e),
            other => panic!("unexpected frame {other:?}"),
        }
        let ack = Frame::Ack {
            stdout: out.stdout.len() as u64,
            stderr: out.stderr.len() as u64,
        };
        let _ = attach.send(ack).await;
    }
    let _ = attach.send(Frame::Done).await;
    out
}

/// Accepts the agent's next connection as the server does, and checks its hello.
async fn accept(listener: &UnixListener, token: &str, limit: Duration) -> AgentConn {
    within("the agent to connect", limit, async {
        loop {
            match testing::accept(listener, SANDBOX, token).await {
                Ok((conn, hello)) => {
                    assert_eq!(hello.protocol, PROTOCOL_VERSION);
                    assert_eq!(hello.sandbox_id, SANDBOX);
                    assert_eq!(hello.token, token);
                    return conn;
                }
                // QEMU connects before the guest has booted; the hello comes once the
                // agent runs. A connection QEMU gave up on (it reconnects): take the next.
                Err(AcceptError::Handshake(HandshakeError::Read(e))) => {
                    eprintln!("connection ended before a hello: {e}")
                }
                Err(e) => panic!("accepting the agent: {e:?}"),
            }
        }
    })
    .await
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn process_exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_boots_the_agent_grows_the_disk_and_survives_a_reconnect() {
    let files = match GuestFiles::find(&guest_dir()) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("SKIPPED: {e}");
            return;
        }
    };
    let agent = agent_binary();
    assert!(
        agent.is_file(),
        "{} is missing: build the static agent with scripts/build.sh",
        agent.display()
    );
    let store = TemplateStore::new(templates_dir()).expect("template store");
    let template = store
        .ensure("busybox", &|_line| {})
        .await
        .expect("busybox template");

    let dir = TempDir::new();
    let base = dir.0.join("base.ext4");
    let overlay = dir.0.join("overlay.qcow2");
    let initrd = dir.0.join("initramfs");
    let sock = dir.0.join("agent.sock");
    let console = dir.0.join("console.log");
    run_tool(
        Command::new("truncate")
            .arg(format!("-s{BASE_MIB}M"))
            .arg(&base),
    );
    run_tool(
        Command::new("mkfs.ext4")
            .args(["-q", "-F", "-d"])
            .arg(&template.rootfs)
            .arg(&base),
    );
    run_tool(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
            .arg(&base)
            .arg(&overlay)
            .arg(format!("{OVERLAY_MIB}M")),
    );
    let with_agent = dir.0.join("initramfs-agent");
    guest::initramfs_with_agent(&files.initramfs, &agent, &with_agent).expect("initramfs");
    let listener = UnixListener::bind(&sock).expect("bind");

    let mut token_bytes = [0u8; 16];
    getrandom::getrandom(&mut token_bytes).expect("random");
    let token: String = token_bytes.iter().map(|b| format!("{b:02x}")).collect();
    // The token travels in the initramfs, never on the command line.
    guest::initramfs_with_token(&with_agent, &token, &initrd).expect("token initramfs");
    let mut append =
        format!("console=ttyS0 quiet panic=-1 space.id={SANDBOX} space.pids=256 space.disk=1");
    if let Some(khz) = guest::host_tsc_khz() {
        append.push_str(&format!(" tsc_early_khz={khz}"));
    }
    let started = Instant::now();
    let child = Command::new("qemu-system-x86_64")
        .args(["-M", "microvm,accel=tcg", "-cpu", "max"])
        .args(["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"])
        .args(["-m", "256", "-smp", "1"])
        .arg("-kernel")
        .arg(&files.kernel)
        .arg("-initrd")
        .arg(&initrd)
        .arg("-append")
        .arg(&append)
        .arg("-drive")
        .arg(format!(
            "id=root,file={},format=qcow2,if=none",
            overlay.display()
        ))
        .args(["-device", "virtio-blk-device,drive=root"])
        .args(["-device", "virtio-serial-device"])
        .arg("-chardev")
        .arg(format!(
            "socket,id=agent,path={},server=off,reconnect=1",
            sock.display()
        ))
        .args(["-device", "virtserialport,chardev=agent,name=space.agent"])
        .arg("-serial")
        .arg(format!("file:{}", console.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start qemu-system-x86_64 (scripts/build-guest.sh installs it)");
    let mut vm = Vm(child);
    let _console_dump = ConsoleOnPanic(console.clone());
    let qemu_pid = vm.0.id();

    let console_text = || std::fs::read_to_string(&console).unwrap_or_default();
    let conn = tokio::select! {
        c = accept(&listener, &token, BOOT_WAIT) => c,
        _ = async {
            while let Ok(None) = vm.0.try_wait() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        } => panic!("QEMU exited before the agent said hello; console:\n{}", console_text()),
    };
    let boot = started.elapsed();
    println!(
        "boot to hello: {:.2} s (QEMU TCG, guest {})",
        boot.as_secs_f64(),
        files.version
    );

    let out = run(
        &conn,
        "cmd_1",
        "df -k / | tail -n 1; tr '\\0' ' ' </proc/1/cmdline; echo; \
             test ! -e /.space/run/token && echo token-gone; \
             mount | awk '{print $3}' | grep -x -E '/(proc|sys|dev|dev/pts|dev/shm|[.]space/bin)' \
               | sort -u | wc -l; \
             readlink /dev/virtio-ports/space.agent; hostname",
    )
    .await;
    let stdout = text(&out.stdout);
    assert_eq!(
        out.exit.as_ref().and_then(|e| e.exit_code),
        Some(0),
        "{stdout}\n{}\nconsole:\n{}",
        text(&out.stderr),
        console_text()
    );
    let lines: Vec<&str> = stdout.lines().collect();
    println!("guest said:\n{stdout}");
    // df -k: filesystem, 1K-blocks, used, available, use%, mount point.
    let total_kib: u64 = lines[0]
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("df output: {:?}", lines[0]));
    assert!(
        total_kib > (OVERLAY_MIB - 64) * 1024,
        "root filesystem not grown to the overlay's {OVERLAY_MIB} MiB: {total_kib} KiB"
    );
    // init starts it by its path below the new root, which the agent then moves onto /.
    assert!(
        lines[1].trim().ends_with("/.space/bin/space-agent"),
        "PID 1: {}",
        lines[1]
    );
    assert_eq!(lines[2], "token-gone");
    assert_eq!(lines[3].trim(), "6", "mounts: {stdout}");
    assert!(lines[4].starts_with("../vport"), "{}", lines[4]);
    assert_eq!(lines[5], SANDBOX);

    // A host that vanishes: the agent must notice and greet the next connection.
    let dropped = Instant::now();
    conn.close();
    drop(conn);
    let conn = accept(&listener, &token, WAIT).await;
    println!(
        "reconnected {:.2} s after the host dropped its connection",
        dropped.elapsed().as_secs_f64()
    );
    let out = run(&conn, "cmd_2", "echo again").await;
    assert_eq!(text(&out.stdout), "again\n");

    // An agent that drops the connection itself (quiesce, a keepalive timeout): QEMU keeps
    // the host's socket open, so the agent's next hello arrives on the old connection, where
    // HTTP/2 fails; the host drops it, QEMU connects again and the agent greets that.
    let quiesced = Instant::now();
    // The connection may end before the answer comes.
    let _ = within("quiesce", WAIT, conn.quiesce()).await;
    within("the old connection to fail", WAIT, conn.closed()).await;
    drop(conn);
    let conn = accept(&listener, &token, WAIT).await;
    println!(
        "after the agent dropped the connection, a new one {:.2} s later",
        quiesced.elapsed().as_secs_f64()
    );
    let out = run(&conn, "cmd_3", "echo back").await;
    assert_eq!(text(&out.stdout), "back\n");

    // Killing QEMU leaves nothing behind.
    conn.close();
    drop(conn);
    drop(vm);
    assert!(!process_exists(qemu_pid), "QEMU {qemu_pid} is still there");
    let dir_name = dir.0.to_string_lossy().into_owned();
    let leftovers: Vec<String> = std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| {
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            cmdline.contains(&dir_name).then_some(cmdline)
        })
        .collect();
    assert!(leftovers.is_empty(), "processes left: {leftovers:?}");
}
