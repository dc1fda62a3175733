//! The microVM driver against real QEMU (TCG on these hosts), the real guest of
//! `scripts/build-guest.sh` (`target/guest`, or `SPACE_GUEST_DIR`) and the static agent
//! (`target/x86_64-unknown-linux-gnu/release/space-agent`, or `SPACE_AGENT_BIN`). Without the
//! guest files or QEMU a test says why and returns: `scripts/setup.sh` builds them.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use space_core::runtime::{Runtime, RuntimeStatus, SandboxSpec};
use space_runtime::microvm::qmp::Qmp;
use space_runtime::microvm::{Accel, AccelChoice, MicrovmConfig, MicrovmRuntime, MEMORY_FILE};
use space_runtime::template::TemplateStore;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

/// How long a TCG guest may take from launch to the agent's hello (slow, loaded CI hosts).
const HELLO_TIMEOUT: Duration = Duration::from_secs(90);

/// A throwaway directory with a short path (Unix sockets live in it), removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        let mut random = [0u8; 4];
        getrandom::getrandom(&mut random).expect("random bytes");
        let hex: String = random.iter().map(|b| format!("{b:02x}")).collect();
        let path = PathBuf::from(format!("/tmp/mvt-{hex}"));
        fs::create_dir_all(&path).expect("create temp dir");
        Self(path)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir_all(&self.0) {
            eprintln!("cannot remove {}: {e}", self.0.display());
        }
    }
}

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The guest directory and the agent binary, or why the test cannot run.
fn guest() -> Result<(PathBuf, PathBuf), String> {
    let dir = std::env::var_os("SPACE_GUEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/guest"));
    for f in ["vmlinuz", "initramfs.cpio.gz", "VERSION"] {
        if !dir.join(f).is_file() {
            return Err(format!(
                "{} is missing (scripts/build-guest.sh builds it)",
                dir.join(f).display()
            ));
        }
    }
    let agent = std::env::var_os("SPACE_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/x86_64-unknown-linux-gnu/release/space-agent"));
    if !agent.is_file() {
        return Err(format!(
            "{} is missing (scripts/build.sh builds it)",
            agent.display()
        ));
    }
    let qemu_ok = std::process::Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !qemu_ok {
        return Err("qemu-system-x86_64 is not installed".into());
    }
    Ok((dir.canonicalize().unwrap(), agent.canonicalize().unwrap()))
}

/// The template the tests boot (busybox unless `SPACE_TEST_MICROVM_TEMPLATE` says).
async fn template() -> PathBuf {
    let root = std::env::var_os("SPACE_TEST_TEMPLATES")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/space-test-templates"));
    let store = TemplateStore::new(root).unwrap();
    // SPACE_TEST_MICROVM_TEMPLATE=debian runs the same tests on a Debian root.
    let name = std::env::var("SPACE_TEST_MICROVM_TEMPLATE").unwrap_or_else(|_| "busybox".into());
    store.ensure(&name, &|_| {}).await.unwrap().rootfs
}

/// One sandbox's host side: the runtime, its spec and the agent's listening socket.
struct Vm {
    _guard: KillOnDrop,
    rt: MicrovmRuntime,
    spec: SandboxSpec,
    listener: UnixListener,
    token: String,
    _dir: TempDir,
}

async fn vm(tag: &str, disk_mib: u64) -> Option<Vm> {
    let (guest_dir, agent) = match guest() {
        Ok(g) => g,
        Err(why) => {
            eprintln!("skipping: {why}");
            return None;
        }
    };
    let dir = TempDir::new();
    let mut cfg = MicrovmConfig::new(guest_dir, dir.path().join("mv"));
    cfg.accel = AccelChoice::Auto;
    let rt = MicrovmRuntime::new(cfg).unwrap();
    let id = format!("sb_{tag}");
    let run_dir = dir.path().join("run");
    fs::create_dir_all(&run_dir).unwrap();
    let token = "0123456789abcdef0123456789abcdef".to_string();
    fs::write(run_dir.join("token"), &token).unwrap();
    let listener = UnixListener::bind(run_dir.join("agent.sock")).unwrap();
    let spec = SandboxSpec {
        id: id.clone(),
        rootfs: template().await,
        state_dir: dir.path().join("sb"),
        run_dir,
        agent_dir: agent.parent().unwrap().to_path_buf(),
        agent_env: vec![
            ("SPACE_SANDBOX_ID".into(), id.clone()),
            ("SPACE_AGENT_TOKEN_FILE".into(), "/.space/run/token".into()),
            ("SPACE_PIDS_LIMIT".into(), "256".into()),
        ],
        vcpus: 1,
        memory_mib: 256,
        pids: 256,
        disk_mib,
        hostname: id.replace('_', "-"),
        network: None,
    };
    Some(Vm {
        _guard: KillOnDrop(dir.path().join("sb")),
        rt,
        spec,
        listener,
        token,
        _dir: dir,
    })
}

/// SIGKILLs what QEMU of the sandbox is left when a test fails half-way (declared first in
/// [`Vm`], so it runs before its directory is removed).
struct KillOnDrop(PathBuf);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for pid in qemu_processes(&self.0) {
            // SAFETY: a plain syscall on a pid whose command line names this test's directory.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// Accepts connections until one carries the agent's hello; answers `ok` and returns the
/// connection (kept open, as the service keeps it) and the hello.
async fn accept_hello(vm: &Vm) -> (UnixStream, Value) {
    let deadline = Instant::now() + HELLO_TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let (stream, _) = tokio::time::timeout(left, vm.listener.accept())
            .await
            .unwrap_or_else(|_| panic!("no agent connection: {}", console(vm)))
            .unwrap();
        let mut reader = BufReader::new(stream);
        let mut line = Vec::new();
        let left = deadline.saturating_duration_since(Instant::now());
        let read = tokio::time::timeout(left, async {
            let mut limited = (&mut reader).take(4096);
            limited.read_until(b'\n', &mut line).await
        })
        .await
        .unwrap_or_else(|_| panic!("no hello from the agent: {}", console(vm)));
        if !matches!(read, Ok(n) if n > 0 && line.ends_with(b"\n")) {
            // QEMU connected and went away (or reconnected): wait for the next connection.
            continue;
        }
        let hello: Value = serde_json::from_slice(&line).expect("hello is JSON");
        let mut stream = reader.into_inner();
        stream
            .write_all(b"{\"ok\":true,\"protocol\":1}\n")
            .await
            .unwrap();
        return (stream, hello);
    }
}

use tokio::io::AsyncReadExt;

fn console(vm: &Vm) -> String {
    let log = fs::read(vm.spec.state_dir.join("log/console.log")).unwrap_or_default();
    let start = log.len().saturating_sub(3000);
    format!("console:\n{}", String::from_utf8_lossy(&log[start..]))
}

/// Pids of QEMU processes started for `state_dir` (its pid file on their command line).
fn qemu_processes(state_dir: &Path) -> Vec<i32> {
    let needle = state_dir.join("qemu.pid");
    let mut pids = Vec::new();
    for e in fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(cmdline) = fs::read(e.path().join("cmdline")) else {
            continue;
        };
        if cmdline
            .split(|b| *b == 0)
            .any(|a| a == needle.as_os_str().as_encoded_bytes())
        {
            pids.push(pid);
        }
    }
    pids
}

fn assert_nothing_left(vm: &Vm) {
    assert!(
        qemu_processes(&vm.spec.state_dir).is_empty(),
        "QEMU left running"
    );
    assert!(!vm.spec.state_dir.exists(), "state dir left behind");
    let marker = vm.rt.config().state_root.join(&vm.spec.id);
    assert!(fs::symlink_metadata(marker).is_err(), "marker left behind");
}

#[test]
fn accel_detection_says_tcg_on_nested_pvm() {
    if Path::new("/sys/module/kvm_pvm").exists() {
        assert_eq!(Accel::detect(), Accel::Tcg);
        assert!(space_runtime::microvm::kvm_usable().is_err());
    } else {
        eprintln!("no kvm_pvm here: detected {}", Accel::detect());
    }
    // Forcing KVM where it cannot run fails at construction, before anything else.
    if space_runtime::microvm::kvm_usable().is_err() {
        let dir = TempDir::new();
        let mut cfg = MicrovmConfig::new(dir.path().join("guest"), dir.path().join("mv"));
        cfg.accel = AccelChoice::Kvm;
        let err = MicrovmRuntime::new(cfg).unwrap_err();
        assert!(err.to_string().contains("accel=kvm"), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_boot_pause_checkpoint_restore_destroy() {
    let Some(vm) = vm("life", 0).await else {
        return;
    };
    let rt = &vm.rt;
    let id = vm.spec.id.as_str();
    let state = vm.spec.state_dir.clone();
    assert_eq!(rt.status(id).await.unwrap(), RuntimeStatus::Missing);

    let t = Instant::now();
    rt.create(&vm.spec).await.unwrap();
    let created = t.elapsed();
    let (conn, hello) = accept_hello(&vm).await;
    let booted = t.elapsed();
    eprintln!(
        "create {created:?}, agent hello after {booted:?} (accel {})",
        rt.accel()
    );
    assert_eq!(hello["sandbox_id"], id);
    assert_eq!(hello["token"], vm.token.as_str());
    assert_eq!(rt.status(id).await.unwrap(), RuntimeStatus::Running);
    assert_eq!(rt.list().await.unwrap(), vec![id.to_string()]);
    let again = rt.create(&vm.spec).await.unwrap_err();
    assert!(again.to_string().contains("already runs"), "{again}");
    // QEMU has a process group of its own: signals to the server's group never reach it.
    let pids = qemu_processes(&state);
    assert_eq!(pids.len(), 1, "{pids:?}");
    // SAFETY: plain syscalls without preconditions.
    unsafe {
        assert_eq!(libc::getpgid(pids[0]), pids[0]);
        assert_ne!(libc::getpgid(pids[0]), libc::getpgid(0));
    }
    let rss = rt.resident_bytes(id, &state).expect("QEMU's RSS");
    let disk = rt.disk_bytes(id, &state).expect("overlay size");
    eprintln!("rss {} MiB, overlay {} KiB", rss >> 20, disk >> 10);
    assert!(rss > 1 << 20);

    let t = Instant::now();
    rt.pause(id).await.unwrap();
    let paused = t.elapsed();
    assert_eq!(rt.status(id).await.unwrap(), RuntimeStatus::Paused);
    let t = Instant::now();
    rt.resume(id).await.unwrap();
    eprintln!("pause {paused:?}, resume {:?}", t.elapsed());
    assert_eq!(rt.status(id).await.unwrap(), RuntimeStatus::Running);

    // A new driver on the same directories (a restarted server) finds the VM by itself.
    let again = MicrovmRuntime::new(rt.config().clone()).unwrap();
    assert_eq!(again.status(id).await.unwrap(), RuntimeStatus::Running);
    assert_eq!(again.list().await.unwrap(), vec![id.to_string()]);
    drop(again);

    let image = vm._dir.path().join("snap");
    let t = Instant::now();
    rt.checkpoint(id, &state, &image).await.unwrap();
    let memory = fs::metadata(image.join(MEMORY_FILE)).expect("memory file");
    eprintln!(
        "checkpoint {:?}, memory file {} MiB",
        t.elapsed(),
        memory.len() >> 20
    );
    assert!(memory.len() > 0);
    assert!(
        qemu_processes(&state).is_empty(),
        "QEMU still runs after checkpoint"
    );
    assert_eq!(rt.status(id).await.unwrap(), RuntimeStatus::Stopped);
    assert!(rt.list().await.unwrap().is_empty());
    assert!(state.join("disk.qcow2").is_file(), "the disk stays");
    // The host's end of the old connection sees QEMU go.
    let mut rest = Vec::new();
    let mut conn = conn;
    let _ = tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut rest)).await;

    let t = Instant::now();
    rt.restore(id, &state, &image).await.unwrap();
    let restored = t.elapsed();
    assert_eq!(rt.status(id).await.unwrap(), RuntimeStatus::Running);
    let (_conn, hello) = accept_hello(&vm).await;
    eprintln!(
        "restore {restored:?}, agent hello again after {:?}",
        t.elapsed()
    );
    assert_eq!(hello["sandbox_id"], id);

    // Stop keeps the files; destroy removes everything; both are idempotent.
    rt.stop(id, &state).await.unwrap();
    assert!(qemu_processes(&state).is_empty());
    assert!(state.join("disk.qcow2").is_file());
    assert_eq!(rt.status(id).await.unwrap(), RuntimeStatus::Stopped);
    rt.stop(id, &state).await.unwrap();
    rt.destroy(id, &state).await.unwrap();
    rt.destroy(id, &state).await.unwrap();
    assert_eq!(rt.status(id).await.unwrap(), RuntimeStatus::Missing);
    assert_nothing_left(&vm);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_quota_is_the_device_size_and_a_killed_vm_is_stopped() {
    let Some(vm) = vm("disk", 300).await else {
        return;
    };
    let rt = &vm.rt;
    let id = vm.spec.id.as_str();
    let state = vm.spec.state_dir.clone();
    rt.create(&vm.spec).await.unwrap();
    let mut images: Vec<_> = fs::read_dir(&rt.config().images_dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "ext4"))
        .collect();
    // The template's image (the shorter name), and beside it its copy grown to the quota's
    // size on the host.
    images.sort_by_key(|p| p.as_os_str().len());
    assert_eq!(images.len(), 2, "{images:?}");
    let base_mib = fs::metadata(&images[0]).unwrap().len() >> 20;
    let mut qmp = Qmp::connect(&state.join("qmp.sock"), Duration::from_secs(10))
        .await
        .unwrap();
    let blocks = qmp.execute("query-block", None).await.unwrap();
    let root = blocks
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["device"] == "root" || b["qdev"].as_str().is_some())
        .expect("the root disk");
    // The image's own free space counts against the quota: the overlay adds the rest.
    let free_mib = space_runtime::microvm::image::ext4_free_mib(&images[0])
        .await
        .expect("dumpe2fs reads the image");
    let size = root["inserted"]["image"]["virtual-size"].as_u64().unwrap();
    let size_mib = (base_mib - free_mib + 300).max(base_mib);
    assert_eq!(size, size_mib << 20);
    let stem = images[0].file_stem().unwrap().to_str().unwrap();
    let grown = images[0].with_file_name(format!("{stem}-{size_mib}m.ext4"));
    assert_eq!(images[1], grown);
    assert_eq!(fs::metadata(&grown).unwrap().len(), size_mib << 20);
    assert_eq!(
        root["inserted"]["image"]["backing-image"]["filename"].as_str(),
        grown.to_str(),
        "the overlay is over the grown copy: {root}"
    );
    // Nothing is left for the guest to grow: the kernel command line does not ask it to.
    let launch = fs::read_to_string(state.join("launch.json")).unwrap();
    assert!(!launch.contains("space.disk=1"), "{launch}");
    // Status has a monitor of its own: it answers while the main one is busy.
    let t = Instant::now();
    assert_eq!(rt.status(id).await.unwrap(), RuntimeStatus::Running);
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "status waited for QMP"
    );
    drop(qmp);
    // The agent says hello once the guest has booted.
    let (_conn, hello) = accept_hello(&vm).await;
    assert_eq!(hello["sandbox_id"], id);

    // A QEMU that dies under the driver (here: killed) leaves a stopped sandbox.
    let pids = qemu_processes(&state);
    assert_eq!(pids.len(), 1, "{pids:?}");
    // SAFETY: plain syscall on the QEMU this test started.
    unsafe { libc::kill(pids[0], libc::SIGKILL) };
    let t = Instant::now();
    while rt.status(id).await.unwrap() != RuntimeStatus::Stopped {
        assert!(t.elapsed() < Duration::from_secs(60), "still not stopped");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(rt.list().await.unwrap().is_empty());
    assert!(rt.resident_bytes(id, &state).is_none());
    rt.destroy(id, &state).await.unwrap();
    assert_nothing_left(&vm);
}

#[tokio::test]
async fn unknown_sandboxes_and_bad_paths() {
    let Ok((guest_dir, _)) = guest() else {
        eprintln!("skipping: no guest");
        return;
    };
    let dir = TempDir::new();
    let rt = MicrovmRuntime::new(MicrovmConfig::new(guest_dir, dir.path().join("mv"))).unwrap();
    assert_eq!(rt.status("sb_nope").await.unwrap(), RuntimeStatus::Missing);
    rt.destroy("sb_nope", &dir.path().join("nope"))
        .await
        .unwrap();
    rt.stop("sb_nope", &dir.path().join("nope")).await.unwrap();
    assert!(rt.pause("sb_nope").await.is_err());
    assert!(rt.status("../x").await.is_err());
    assert!(rt.list().await.unwrap().is_empty());

    // A run directory too deep for a Unix socket path is refused before anything starts.
    let deep = dir.path().join("d".repeat(100));
    fs::create_dir_all(&deep).unwrap();
    fs::write(deep.join("token"), "abc").unwrap();
    let spec = SandboxSpec {
        id: "sb_deep".into(),
        rootfs: template().await,
        state_dir: dir.path().join("sb"),
        run_dir: deep,
        agent_dir: dir.path().to_path_buf(),
        agent_env: Vec::new(),
        vcpus: 1,
        memory_mib: 128,
        pids: 0,
        disk_mib: 0,
        hostname: "sb-deep".into(),
        network: None,
    };
    let err = rt.create(&spec).await.unwrap_err();
    assert!(err.to_string().contains("Unix socket"), "{err}");
    assert!(qemu_processes(&spec.state_dir).is_empty());
    rt.destroy("sb_deep", &spec.state_dir).await.unwrap();
    assert!(!spec.state_dir.exists());
}
