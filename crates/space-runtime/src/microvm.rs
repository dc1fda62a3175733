//! The microVM driver: one QEMU `-M microvm` virtual machine per sandbox, with hardware KVM
//! where it is usable and TCG (software emulation) elsewhere. **TCG is not a security
//! boundary**: the guest runs in QEMU's own process, so a QEMU bug is a host compromise.
//!
//! A sandbox's VM boots the guest kernel and initramfs of `guest_dir` (built by
//! `scripts/build-guest.sh`, the agent appended by [`crate::guest::initramfs_with_agent`]),
//! whose `/init` mounts the first virtio-blk disk as the root and becomes `space-agent`. The
//! disk is a qcow2 overlay in the sandbox's state directory on top of a cached ext4 image of
//! the template ([`image`]); its virtual size is the sandbox's disk quota. The agent's byte
//! stream is a virtio-serial port named `space.agent` whose host end is a Unix socket client
//! of `run_dir/agent.sock` (the same server socket as for gVisor), redialling when the
//! server restarts. QEMU dials only once the guest is ready for the host: it starts pointed
//! at a socket nobody listens on and is switched over (`chardev-change`) when the booting
//! guest's agent opened the port, or when a restored guest saw the old host go (see
//! `reattach_agent`), so the agent always begins a connection with a fresh hello. Without
//! egress there is no network device at all; an egress sandbox has one virtio-net NIC on a
//! tap of its own ([`crate::net`]), configured by `/init` from `space.net=` on the command line.
//!
//! QEMU runs in its own process group (it outlives a restart of the server; not
//! `-daemonize`, which forks after the seccomp filter forbids it), with a pid file and a QMP
//! socket in the sandbox's state directory:
//!
//! ```text
//! <state_dir>/disk.qcow2    the sandbox's disk (kept by stop and checkpoint)
//! <state_dir>/launch.json   QEMU's argument list (0600), for restore
//! <state_dir>/initramfs.cpio the guest's initramfs with the agent and the agent's token
//!                           (0600; the token is overwritten once the guest has read it)
//! <state_dir>/qemu.pid      QEMU's pid while it runs
//! <state_dir>/qmp.sock      QMP, for lifecycle operations
//! <state_dir>/status.sock   QMP, for status and stop (never behind a long operation)
//! <state_dir>/log/          a tmpfs of `lend::LOG_BYTES`, mounted while QEMU runs:
//!   console.log             the guest's serial console
//!   qemu.log                QEMU's own messages (stdout and stderr)
//! <state_dir>/detached.sock never exists: where the agent's port points while off the host
//! <state_root>/<id>         symlink to <state_dir>: how id-only calls find a sandbox
//! <image_dir>/memory        a checkpoint's memory and device state (QEMU migration stream)
//! ```
//!
//! What the guest can make the host store: its disk (the qcow2 overlay, at most its virtual
//! size, the quota, plus qcow2's metadata), its serial console and QEMU's messages (the log
//! tmpfs: full is full), and a checkpoint's memory file (the VM's RAM and device state).
//! Everything else QEMU opens is read-only: the template's image (the overlay's backing file,
//! shared by the sandboxes of a template, which QEMU opens read-only), the kernel and the
//! initramfs (read into guest memory at boot). The agent runs from the initramfs, in guest
//! memory. No host directory is visible to the guest. The audit is in docs/SECURITY.md.
//!
//! What is QEMU-specific (the command line, QMP) stays in small private functions and the
//! [`qmp`] module, so a Firecracker driver can reuse the rest (see `docs/FIRECRACKER.md`).

pub mod image;
pub mod qmp;
mod step;

use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde_json::{json, Value};
use space_core::runtime::{
    BuildStep, BuildStepError, Runtime, RuntimeError, RuntimeStatus, SandboxSpec,
};
use tokio::process::Command;

use qmp::{Qmp, QmpError};

use crate::net;
use crate::process::{self, Backoff, Kill, CONSOLE_LOG};

/// Files of the guest directory.
pub const GUEST_KERNEL: &str = "vmlinuz";
pub const GUEST_INITRAMFS: &str = "initramfs.cpio.gz";
pub const GUEST_VERSION: &str = "VERSION";

/// Files in a sandbox's state directory.
const DISK_FILE: &str = "disk.qcow2";
/// The sandbox's own initramfs: the shared one plus an archive with the agent's token.
const INITRAMFS_FILE: &str = "initramfs.cpio";
const LAUNCH_FILE: &str = "launch.json";
const PID_FILE: &str = "qemu.pid";
const QMP_SOCKET: &str = "qmp.sock";
/// A second QMP monitor for `status` and `stop`: a QMP socket serves one client at a time,
/// and these must not wait behind a long checkpoint.
const STATUS_SOCKET: &str = "status.sock";
const QEMU_LOG: &str = "qemu.log";
/// The memory file of a checkpoint, in its image directory.
pub const MEMORY_FILE: &str = "memory";
/// The agent's socket in the run directory (the host listens, QEMU dials).
const AGENT_SOCKET: &str = "agent.sock";
/// Device id of the agent's port (QEMU names it in `VSERPORT_CHANGE` events).
const AGENT_PORT_ID: &str = "agentport";
/// How long a booting guest may take to start its agent. TCG on a loaded host: 15 s seen, and
/// over 120 s once, with four microVMs of the hostile suite booting beside the conformance
/// suite's on 2 CPUs. A guest that has not started its agent by then has stalled
/// (`RuntimeError::BootStalled`), as has one that sat idle for [`BOOT_IDLE_LIMIT`] before.
const AGENT_OPEN_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a booting guest may sit idle before its agent opened its port (see
/// [`process::Activity`]): then it is waiting for something that will not come, and the
/// boot has stalled. Booting it again is the caller's to decide (`RuntimeError::BootStalled`).
/// Seen rarely in CI runs with TCG: a guest whose console stopped early in its kernel's start
/// and whose agent never opened its port in 300 s. A guest that boots keeps QEMU running or
/// waiting for a CPU, however slowly it goes on a loaded host.
const BOOT_IDLE_LIMIT: Duration = Duration::from_secs(30);
/// How long the guest's agent may take to say hello once QEMU connected its port to the
/// host's socket. Only QEMU dials that socket, one connection at a time, so there is nothing
/// to bound. gVisor's 5 s dropped a silent TCG guest's connection every 5 s in the CI runs
/// that failed, and each drop is a hangup and a new connection that a slow guest must handle.
pub(crate) const HELLO_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a restored guest may take to notice that the host went away.
const AGENT_HANGUP_TIMEOUT: Duration = Duration::from_secs(10);
/// Where a VM's agent port points until the guest is ready for the host (nobody listens).
const DETACHED_SOCKET: &str = "detached.sock";
const AGENT_CHARDEV_PREFIX: &str = "socket,id=agent,";
/// How often QEMU dials the host's agent socket while it is not connected.
const AGENT_RECONNECT_MS: u64 = 200;

/// Defaults when the spec leaves a resource at 0.
const DEFAULT_MEMORY_MIB: u64 = 512;
const DEFAULT_DISK_MIB: u64 = 1024;
/// Longest Unix socket path (sun_path, with its terminating NUL).
const MAX_SOCKET_PATH: usize = 107;
/// Bound on a single QMP exchange.
const QMP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a booting VM may take to report `running` over QMP.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long saving or loading a checkpoint may take.
const MIGRATE_TIMEOUT: Duration = Duration::from_secs(300);
/// Grace after `quit` before the process group gets SIGKILL.
const QUIT_GRACE: Duration = Duration::from_secs(3);

/// How guest instructions run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// Hardware virtualization: the VM is an isolation boundary.
    Kvm,
    /// QEMU's software emulation: slower, and **not** a security boundary.
    Tcg,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }

    /// KVM when it can run a standard guest, TCG otherwise.
    pub fn detect() -> Accel {
        match kvm_usable() {
            Ok(()) => Accel::Kvm,
            Err(_) => Accel::Tcg,
        }
    }
}

impl std::fmt::Display for Accel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `accel` setting: detect, or force one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AccelChoice {
    #[default]
    Auto,
    Kvm,
    Tcg,
}

impl std::str::FromStr for AccelChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(AccelChoice::Auto),
            "kvm" => Ok(AccelChoice::Kvm),
            "tcg" => Ok(AccelChoice::Tcg),
            other => Err(format!("accel must be auto, kvm or tcg, not {other:?}")),
        }
    }
}

/// Why KVM cannot run our guests here, if it cannot: /dev/kvm must open read-write and speak
/// API version 12, and must not be nested PVM (`kvm_pvm`), which cannot run a standard guest.
pub fn kvm_usable() -> Result<(), String> {
    use std::os::fd::AsRawFd;
    if Path::new("/sys/module/kvm_pvm").exists() {
        return Err(
            "/dev/kvm is nested PVM (kvm_pvm is loaded), which cannot run a standard guest".into(),
        );
    }
    let kvm = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .map_err(|e| format!("cannot open /dev/kvm read-write: {e}"))?;
    const KVM_GET_API_VERSION: libc::c_ulong = 0xAE00;
    // SAFETY: an argument-less ioctl on a descriptor we own.
    let version = unsafe { libc::ioctl(kvm.as_raw_fd(), KVM_GET_API_VERSION, 0) };
    if version != 12 {
        return Err(format!("/dev/kvm answers API version {version}, not 12"));
    }
    Ok(())
}

/// Settings of the microVM driver.
#[derive(Debug, Clone)]
pub struct MicrovmConfig {
    /// `qemu-system-x86_64`.
    pub qemu: PathBuf,
    /// `qemu-img`.
    pub qemu_img: PathBuf,
    /// Holds `vmlinuz`, `initramfs.cpio.gz` and `VERSION`.
    pub guest_dir: PathBuf,
    /// Cache of template disk images and initramfs-with-agent files (driver-owned).
    pub images_dir: PathBuf,
    /// Driver-owned directory of per-sandbox markers.
    pub state_root: PathBuf,
    pub accel: AccelChoice,
}

impl MicrovmConfig {
    /// Defaults: the tools from `PATH`, caches under `dir`, the accelerator detected.
    pub fn new(guest_dir: impl Into<PathBuf>, dir: impl Into<PathBuf>) -> Self {
        let dir = dir.into();
        MicrovmConfig {
            qemu: "qemu-system-x86_64".into(),
            qemu_img: "qemu-img".into(),
            guest_dir: guest_dir.into(),
            images_dir: dir.join("images"),
            state_root: dir.join("vms"),
            accel: AccelChoice::Auto,
        }
    }
}

/// The `microvm` runtime.
#[derive(Debug, Clone)]
pub struct MicrovmRuntime {
    cfg: MicrovmConfig,
    accel: Accel,
    /// Extra kernel arguments for TCG: the TSC's frequency (the host's, which TCG passes
    /// through), without which the guest cannot calibrate its clock and hangs at boot.
    tcg_cmdline: String,
}

impl MicrovmRuntime {
    /// Checks the guest files and the accelerator; forcing `kvm` where it is unusable fails.
    pub fn new(cfg: MicrovmConfig) -> Result<Self, RuntimeError> {
        let accel = match cfg.accel {
            AccelChoice::Auto => Accel::detect(),
            AccelChoice::Tcg => Accel::Tcg,
            AccelChoice::Kvm => {
                kvm_usable()
                    .map_err(|why| RuntimeError::Unsupported(format!("accel=kvm: {why}")))?;
                Accel::Kvm
            }
        };
        for file in [GUEST_KERNEL, GUEST_INITRAMFS, GUEST_VERSION] {
            let path = cfg.guest_dir.join(file);
            if !path.is_file() {
                return Err(RuntimeError::Unsupported(format!(
                    "microVM guest file {} is missing (run scripts/build-guest.sh)",
                    path.display()
                )));
            }
        }
        for dir in [&cfg.images_dir, &cfg.state_root] {
            std::fs::create_dir_all(dir)
                .map_err(|e| RuntimeError::io(format!("creating {}", dir.display()), e))?;
        }
        let tcg_cmdline = match accel {
            Accel::Tcg => host_tsc_khz()
                .map(|khz| format!(" tsc_early_khz={khz} tsc=reliable"))
                .unwrap_or_default(),
            Accel::Kvm => String::new(),
        };
        if accel == Accel::Tcg {
            tracing::warn!(
                "WARNING: the microvm runtime uses TCG (software emulation): TCG is not a security boundary"
            );
        }
        Ok(MicrovmRuntime {
            cfg,
            accel,
            tcg_cmdline,
        })
    }

    /// The accelerator every VM of this driver uses.
    pub fn accel(&self) -> Accel {
        self.accel
    }

    pub fn config(&self) -> &MicrovmConfig {
        &self.cfg
    }

    fn marker(&self, id: &str) -> Result<PathBuf, RuntimeError> {
        check_id(id)?;
        Ok(self.cfg.state_root.join(id))
    }

    /// The state directory of a sandbox this driver knows.
    fn state_dir_of(&self, id: &str) -> Result<Option<PathBuf>, RuntimeError> {
        match std::fs::read_link(self.marker(id)?) {
            Ok(p) => Ok(Some(p)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(RuntimeError::io(format!("reading the marker of {id}"), e)),
        }
    }

    fn set_marker(&self, id: &str, state_dir: &Path) -> Result<(), RuntimeError> {
        let marker = self.marker(id)?;
        if std::fs::read_link(&marker).ok().as_deref() == Some(state_dir) {
            return Ok(());
        }
        let tmp = marker.with_file_name(format!(".{id}.tmp"));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(state_dir, &tmp)
            .and_then(|()| std::fs::rename(&tmp, &marker))
            .map_err(|e| RuntimeError::io(format!("writing the marker of {id}"), e))
    }

    /// QMP session with the VM of `id`, which must be running.
    async fn qmp(&self, id: &str) -> Result<Qmp, RuntimeError> {
        let Some(dir) = self.state_dir_of(id)? else {
            return Err(RuntimeError::Tool {
                tool: "qemu".into(),
                message: format!("no microVM {id}"),
            });
        };
        Qmp::connect(&dir.join(QMP_SOCKET), QMP_TIMEOUT)
            .await
            .map_err(|e| qmp_failed(id, e))
    }

    /// Boots (or, with `incoming`, restores) the VM described by `state_dir/launch.json`,
    /// and returns once QEMU is up and QMP answers.
    async fn launch(
        &self,
        id: &str,
        state_dir: &Path,
        incoming: Option<&Path>,
    ) -> Result<Qmp, RuntimeError> {
        let launch = std::fs::read(state_dir.join(LAUNCH_FILE))
            .map_err(|e| RuntimeError::io("reading launch.json", e))?;
        let mut args: Vec<OsString> = serde_json::from_slice::<Vec<String>>(&launch)
            .map_err(|e| RuntimeError::Tool {
                tool: "qemu".into(),
                message: format!("unreadable launch.json: {e}"),
            })?
            .into_iter()
            .map(OsString::from)
            .collect();
        // The agent's port starts off the host (a socket nobody listens on) and is connected
        // only when the guest is ready for it: at boot once the agent opened the port
        // ([`wait_agent_open`]), after a restore once the guest saw the host go
        // ([`reattach_agent`]). The host's server never holds a connection nobody answers.
        let detached = state_dir.join(DETACHED_SOCKET);
        check_socket_path(&detached)?;
        for a in args.iter_mut() {
            if a.to_string_lossy().starts_with(AGENT_CHARDEV_PREFIX) {
                *a = agent_chardev(&detached).into();
            }
        }
        if let Some(memory) = incoming {
            check_qemu_path(memory)?;
            // Stay stopped after the load: the driver says `cont` once it is complete.
            args.push("-S".into());
            args.push("-incoming".into());
            args.push(format!("file:{}", memory.display()).into());
        }
        for stale in [PID_FILE, QMP_SOCKET, STATUS_SOCKET] {
            let _ = std::fs::remove_file(state_dir.join(stale));
        }
        // Its own process group: it outlives the server, and no signal to the server's
        // group reaches it. Not -daemonize: that needs fork after seccomp is on.
        let (mut child, log) = process::launch(
            Command::new(&self.cfg.qemu).args(&args),
            state_dir,
            QEMU_LOG,
        )?;
        let qmp_socket = state_dir.join(QMP_SOCKET);
        let start = Instant::now();
        let mut backoff = Backoff::new(Duration::from_millis(2), Duration::from_millis(50));
        let qmp = loop {
            if let Some(status) = child
                .try_wait()
                .map_err(|e| RuntimeError::io("waiting for qemu", e))?
            {
                let log = log.tail(1000);
                return Err(RuntimeError::Tool {
                    tool: "qemu".into(),
                    message: if log.is_empty() {
                        format!("microVM {id}: QEMU exited with {status}")
                    } else {
                        format!("microVM {id}: {log}")
                    },
                });
            }
            if qmp_socket.exists() {
                if let Ok(qmp) = Qmp::connect(&qmp_socket, QMP_TIMEOUT).await {
                    break qmp;
                }
            }
            if start.elapsed() > START_TIMEOUT {
                let _ = child.start_kill();
                return Err(RuntimeError::Tool {
                    tool: "qemu".into(),
                    message: format!("microVM {id}: no QMP socket after {START_TIMEOUT:?}"),
                });
            }
            backoff.wait().await;
        };
        // Reap it when it exits, while this server runs (init does after a restart).
        tokio::spawn(async move {
            let _ = child.wait().await;
        });
        Ok(qmp)
    }

    /// Waits until QEMU reports one of `want`; fails if the VM stops existing or does not get
    /// there in `timeout`.
    async fn wait_status(
        &self,
        id: &str,
        qmp: &mut Qmp,
        want: &[&str],
        timeout: Duration,
    ) -> Result<String, RuntimeError> {
        let start = Instant::now();
        let mut backoff = Backoff::new(Duration::from_millis(5), Duration::from_millis(100));
        loop {
            let status = match query_status(qmp).await {
                Ok(status) => status,
                // A starved monitor (see `wait_agent_open`): `timeout` decides.
                Err(QmpError::Timeout(_)) if start.elapsed() <= timeout => {
                    tracing::info!(sandbox = %id, "QMP did not answer in time; asking again");
                    continue;
                }
                Err(e) => return Err(qmp_failed(id, e)),
            };
            if want.contains(&status.as_str()) {
                return Ok(status);
            }
            if matches!(
                status.as_str(),
                "shutdown" | "internal-error" | "guest-panicked" | "io-error"
            ) {
                return Err(RuntimeError::Tool {
                    tool: "qemu".into(),
                    message: format!("microVM {id} is {status}"),
                });
            }
            if start.elapsed() > timeout {
                return Err(RuntimeError::Tool {
                    tool: "qemu".into(),
                    message: format!("microVM {id} still {status} after {timeout:?}"),
                });
            }
            backoff.wait().await;
        }
    }

    /// The QEMU argument list of a sandbox; with `grow_disk` the guest grows its root
    /// filesystem to the disk's size as it boots.
    fn qemu_args(
        &self,
        spec: &SandboxSpec,
        initramfs: &Path,
        grow_disk: bool,
    ) -> Result<Vec<String>, RuntimeError> {
        let state = &spec.state_dir;
        let agent_socket = spec.run_dir.join(AGENT_SOCKET);
        let qmp_socket = state.join(QMP_SOCKET);
        let status_socket = state.join(STATUS_SOCKET);
        for socket in [&agent_socket, &qmp_socket, &status_socket] {
            check_socket_path(socket)?;
        }
        let kernel = self.cfg.guest_dir.join(GUEST_KERNEL);
        let disk = state.join(DISK_FILE);
        for path in [
            &kernel,
            initramfs,
            &disk,
            &agent_socket,
            &qmp_socket,
            &status_socket,
            &state.join(crate::lend::LOG_DIR).join(CONSOLE_LOG),
        ] {
            check_qemu_path(path)?;
        }
        for (what, value) in [
            ("id", spec.id.as_str()),
            ("hostname", spec.hostname.as_str()),
        ] {
            if value.is_empty()
                || value.len() > 255
                || !value
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            {
                return Err(RuntimeError::Unsupported(format!(
                    "the sandbox's {what} cannot go on a kernel command line"
                )));
            }
        }
        let vcpus = spec.vcpus.max(1);
        let memory = guest_ram_mib(if spec.memory_mib == 0 {
            DEFAULT_MEMORY_MIB
        } else {
            spec.memory_mib
        });
        let mut cmdline = format!(
            "console=ttyS0 quiet panic=-1 space.id={} space.pids={} space.hostname={}",
            spec.id, spec.pids, spec.hostname
        );
        if grow_disk {
            cmdline.push_str(" space.disk=1");
        }
        // A test failpoint of the agent (only ever set by the server; see space_agent's
        // failpoint module): the guest's init passes it on.
        if let Some((_, fp)) = spec.agent_env.iter().find(|(k, _)| k == "SPACE_FAILPOINT") {
            if fp
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b":_-".contains(&b))
            {
                cmdline.push_str(&format!(" space.failpoint={fp}"));
            }
        }
        let (accel, cpu) = match self.accel {
            Accel::Kvm => ("kvm".to_owned(), "host"),
            Accel::Tcg => {
                cmdline.push_str(&self.tcg_cmdline);
                // One thread per vCPU (MTTCG) only pays with more than one vCPU.
                let thread = if vcpus > 1 { "multi" } else { "single" };
                (format!("tcg,thread={thread}"), "max")
            }
        };
        let p = |p: &Path| p.display().to_string();
        let mut args: Vec<String> = vec![
            "-name".into(),
            format!("space-{}", spec.id),
            "-M".into(),
            "microvm".into(),
            "-accel".into(),
            accel,
            "-cpu".into(),
            cpu.into(),
            "-m".into(),
            format!("{memory}M"),
            "-smp".into(),
            vcpus.to_string(),
            "-nodefaults".into(),
            "-no-user-config".into(),
            "-display".into(),
            "none".into(),
            "-no-reboot".into(),
            "-pidfile".into(),
            p(&state.join(PID_FILE)),
            "-qmp".into(),
            format!("unix:{},server=on,wait=off", p(&qmp_socket)),
            "-qmp".into(),
            format!("unix:{},server=on,wait=off", p(&status_socket)),
            // Guest root can write to its serial port forever: the file is on the sandbox's
            // log tmpfs, so a flood fills that (QEMU then drops the bytes) and no disk. A
            // file rather than a `ringbuf` chardev: a file outlives QEMU, and a guest's last
            // words (a panic, which ends QEMU: -no-reboot) are what an error message needs.
            "-chardev".into(),
            format!(
                "file,id=console,path={},append=on",
                p(&state.join(crate::lend::LOG_DIR).join(CONSOLE_LOG))
            ),
            "-serial".into(),
            "chardev:console".into(),
            "-kernel".into(),
            p(&kernel),
            "-initrd".into(),
            p(initramfs),
            "-append".into(),
            cmdline,
            "-drive".into(),
            format!(
                "id=root,file={},format=qcow2,if=none,discard=unmap",
                p(&disk)
            ),
            "-device".into(),
            "virtio-blk-device,drive=root".into(),
            "-device".into(),
            "virtio-serial-device".into(),
            "-chardev".into(),
            agent_chardev(&agent_socket),
            "-device".into(),
            format!("virtserialport,chardev=agent,name=space.agent,id={AGENT_PORT_ID}"),
        ];
        // Seccomp: no new privileges, no spawning (a checkpoint writes to a file: no `exec:`).
        args.extend([
            "-sandbox".into(),
            "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny".into(),
        ]);
        Ok(args)
    }

    /// Boots `spec`'s VM on a disk over `base` (an ext4 image of its root, never written):
    /// returns once the guest's agent opened its port and QEMU dials the host's socket.
    /// A `shared_base` (a template's cached image) is grown to the disk's size once, on the
    /// host ([`image::grown_image`]); a private one (a build step's, used once) is grown by
    /// the guest as it boots.
    async fn boot(
        &self,
        spec: &SandboxSpec,
        base: &Path,
        shared_base: bool,
    ) -> Result<(), RuntimeError> {
        let state = &spec.state_dir;
        check_id(&spec.id)?;
        check_socket_path(&spec.run_dir.join(AGENT_SOCKET))?;
        check_socket_path(&state.join(QMP_SOCKET))?;
        check_socket_path(&state.join(STATUS_SOCKET))?;
        if let Some(pid) = qemu_pid(state) {
            return Err(RuntimeError::Tool {
                tool: "qemu".into(),
                message: format!("microVM {} already runs (QEMU {pid})", spec.id),
            });
        }
        tokio::fs::create_dir_all(state)
            .await
            .map_err(|e| RuntimeError::io(format!("creating {}", state.display()), e))?;
        let token_path = spec.run_dir.join("token");
        let token = std::fs::read_to_string(&token_path)
            .map_err(|e| RuntimeError::io(format!("reading {}", token_path.display()), e))?
            .trim()
            .to_owned();
        let agent = spec.agent_dir.join("space-agent");
        let shared = image::initramfs(&self.cfg.images_dir, &self.cfg.guest_dir, &agent).await?;
        // The token goes in the sandbox's own initramfs, not on the kernel command line
        // (the guest's /proc/cmdline, QEMU's argv on the host).
        let initramfs = state.join(INITRAMFS_FILE);
        let token_at = {
            let (shared, out, token) = (shared.clone(), initramfs.clone(), token.clone());
            tokio::task::spawn_blocking(move || {
                crate::guest::initramfs_with_token(&shared, &token, &out)
            })
            .await
            .map_err(|e| RuntimeError::io("writing the initramfs", std::io::Error::other(e)))?
            .map_err(|e| RuntimeError::io(format!("writing {}", initramfs.display()), e))?
        };
        // Only the initramfs (and the server's store) hold it now, as under gVisor, where the
        // agent deletes this file through the bind mount.
        let _ = std::fs::remove_file(&token_path);
        let base_mib = std::fs::metadata(base)
            .map_err(|e| RuntimeError::io(format!("reading {}", base.display()), e))?
            .len()
            .div_ceil(1 << 20);
        let disk_mib = if spec.disk_mib == 0 {
            DEFAULT_DISK_MIB
        } else {
            spec.disk_mib
        };
        check_qemu_path(base)?;
        let disk = state.join(DISK_FILE);
        // A new disk over a shared image is an overlay of that image already grown to the
        // quota's size, so the guest has nothing to grow. An existing disk (made by an earlier
        // server) and a private image still need the guest's resize2fs.
        let grow_in_guest = if disk.exists() {
            true
        } else {
            // What the guest can write is the image's own free space plus the growth, so the
            // growth makes up the rest of the quota.
            let free_mib = image::ext4_free_mib(base).await.unwrap_or(0);
            let size_mib = (base_mib.saturating_sub(free_mib) + disk_mib).max(base_mib);
            let backing = if shared_base {
                image::grown_image(base, size_mib).await?
            } else {
                base.to_path_buf()
            };
            check_qemu_path(&backing)?;
            image::overlay(&self.cfg.qemu_img, &backing, &disk, size_mib).await?;
            backing == base
        };
        let args = self.qemu_args(spec, &initramfs, grow_in_guest)?;
        // An egress sandbox: a tap of its own on the host, a virtio-net NIC in the guest,
        // and its address on the kernel command line (the guest's /init configures it).
        let args = match spec.network.clone() {
            Some(cfg) => {
                let (id, dir) = (spec.id.clone(), state.to_path_buf());
                let link = crate::gvisor::blocking(move || {
                    net::setup(&id, &dir, net::LinkKind::Tap, &cfg)
                })
                .await?;
                with_nic(args, &link)
            }
            None => args,
        };
        write_private(
            &state.join(LAUNCH_FILE),
            &serde_json::to_vec(&args).unwrap_or_default(),
        )?;
        self.set_marker(&spec.id, state)?;
        let agent_socket = agent_socket_of(state)?;
        let started = async {
            let mut qmp = self.launch(&spec.id, state, None).await?;
            self.wait_status(&spec.id, &mut qmp, &["running"], START_TIMEOUT)
                .await?;
            let mut activity = qemu_pid(state).map(process::Activity::new);
            let stall = wait_agent_open(&mut qmp, activity.as_mut())
                .await
                .map_err(|e| RuntimeError::Tool {
                    tool: "qemu".into(),
                    message: format!(
                        "microVM {}: the guest's agent did not open its port ({e}); console: {}",
                        spec.id,
                        process::console_tail(state, 600)
                    ),
                })?;
            if let Some(stall) = stall {
                let cpu = activity
                    .as_ref()
                    .and_then(process::Activity::cpu_time)
                    .map_or_else(
                        || "unknown".to_string(),
                        |t| format!("{:.1}s", t.as_secs_f64()),
                    );
                return Err(RuntimeError::BootStalled(format!(
                    "microVM {}: {stall} (QEMU used {cpu} of CPU; {}); console: {}",
                    spec.id,
                    vcpu_state(&mut qmp).await,
                    process::console_tail(state, 600)
                )));
            }
            attach_agent(&mut qmp, &agent_socket)
                .await
                .map_err(|e| qmp_failed(&spec.id, e))
        }
        .await;
        if let Err(e) = started {
            // Nothing of a failed boot keeps running.
            let _ = self.kill_vm(&spec.id, state).await;
            return Err(e);
        }
        // The guest has unpacked it (its agent runs): the copy on disk need not hold the
        // token any more. Same size, so a restore from a checkpoint boots from it unchanged.
        if let Err(e) = crate::guest::scrub_token(&initramfs, token_at, token.len()) {
            tracing::warn!(sandbox = %spec.id, error = %e, "cannot scrub the token from the initramfs");
        }
        tracing::info!(sandbox = %spec.id, accel = %self.accel, "microVM started");
        Ok(())
    }

    /// Ends the VM of `state_dir` if it runs: `quit` over QMP, then SIGKILL to its process
    /// group after a grace period. Leaves the disk and launch.json.
    async fn kill_vm(&self, id: &str, state_dir: &Path) -> Result<(), RuntimeError> {
        if let Some(pid) = qemu_pid(state_dir) {
            let status_socket = state_dir.join(STATUS_SOCKET);
            if let Ok(mut qmp) = Qmp::connect(&status_socket, Duration::from_secs(2)).await {
                // QEMU may close the connection before it answers.
                let _ = qmp.execute("quit", None).await;
            }
            wait_gone(id, pid, state_dir).await?;
        }
        for stale in [PID_FILE, QMP_SOCKET, STATUS_SOCKET] {
            let _ = std::fs::remove_file(state_dir.join(stale));
        }
        crate::disk::unmount_below(state_dir).await
    }
}

#[async_trait]
impl Runtime for MicrovmRuntime {
    fn name(&self) -> &'static str {
        "microvm"
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<(), RuntimeError> {
        check_id(&spec.id)?;
        let base = image::rootfs_image(&self.cfg.images_dir, &spec.rootfs).await?;
        self.boot(spec, &base, true).await
    }

    async fn pause(&self, id: &str) -> Result<(), RuntimeError> {
        let mut qmp = self.qmp(id).await?;
        qmp.execute("stop", None)
            .await
            .map_err(|e| qmp_failed(id, e))?;
        Ok(())
    }

    async fn resume(&self, id: &str) -> Result<(), RuntimeError> {
        let mut qmp = self.qmp(id).await?;
        qmp.execute("cont", None)
            .await
            .map_err(|e| qmp_failed(id, e))?;
        Ok(())
    }

    async fn stop(&self, id: &str, state_dir: &Path) -> Result<(), RuntimeError> {
        check_id(id)?;
        self.kill_vm(id, state_dir).await
    }

    async fn destroy(&self, id: &str, state_dir: &Path) -> Result<(), RuntimeError> {
        self.stop(id, state_dir).await?;
        let owned = id.to_owned();
        crate::gvisor::blocking(move || net::teardown(&owned)).await?;
        crate::disk::ensure_nothing_mounted_below(state_dir)?;
        match tokio::fs::remove_dir_all(state_dir).await {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(RuntimeError::io(
                    format!("removing {}", state_dir.display()),
                    e,
                ));
            }
        }
        match std::fs::remove_file(self.marker(id)?) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(RuntimeError::io(format!("removing the marker of {id}"), e)),
        }
    }

    async fn status(&self, id: &str) -> Result<RuntimeStatus, RuntimeError> {
        let Some(dir) = self.state_dir_of(id)? else {
            return Ok(RuntimeStatus::Missing);
        };
        if !dir.join(LAUNCH_FILE).exists() {
            return Ok(RuntimeStatus::Missing);
        }
        if qemu_pid(&dir).is_none() {
            // Known (its disk is here) but not running: stopped, checkpointed, or its QEMU
            // died (a guest panic ends it too: -no-reboot).
            return Ok(RuntimeStatus::Stopped);
        }
        let queried = async {
            let mut qmp = Qmp::connect(&dir.join(STATUS_SOCKET), QMP_TIMEOUT).await?;
            query_status(&mut qmp).await
        }
        .await;
        let status = match queried {
            Ok(status) => status,
            Err(e) => {
                // It may be dying while we ask: its sockets close before the process is gone.
                let start = Instant::now();
                while start.elapsed() < Duration::from_secs(1) {
                    if qemu_pid(&dir).is_none() {
                        return Ok(RuntimeStatus::Stopped);
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                return Err(qmp_failed(id, e));
            }
        };
        Ok(match status.as_str() {
            "running" => RuntimeStatus::Running,
            "paused" | "inmigrate" | "postmigrate" | "prelaunch" | "finish-migrate"
            | "suspended" | "save-vm" | "restore-vm" | "debug" | "colo" => RuntimeStatus::Paused,
            _ => RuntimeStatus::Stopped,
        })
    }

    async fn list(&self) -> Result<Vec<String>, RuntimeError> {
        let entries = match std::fs::read_dir(&self.cfg.state_root) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(RuntimeError::io("listing microVMs", e)),
        };
        let mut ids = Vec::new();
        for e in entries.flatten() {
            let Some(id) = e.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            // Build VMs are no sandbox (see `step`).
            if id.starts_with('.') || id.starts_with(step::BUILD_PREFIX) {
                continue;
            }
            if let Ok(dir) = std::fs::read_link(e.path()) {
                if qemu_pid(&dir).is_some() {
                    ids.push(id);
                }
            }
        }
        ids.sort();
        Ok(ids)
    }

    async fn checkpoint(
        &self,
        id: &str,
        state_dir: &Path,
        image_dir: &Path,
    ) -> Result<(), RuntimeError> {
        tokio::fs::create_dir_all(image_dir)
            .await
            .map_err(|e| RuntimeError::io(format!("creating {}", image_dir.display()), e))?;
        let memory = image_dir.join(MEMORY_FILE);
        let tmp = image_dir.join(format!("{MEMORY_FILE}.tmp"));
        check_qemu_path(&tmp)?;
        let _ = std::fs::remove_file(&tmp);
        let mut qmp = self.qmp(id).await?;
        let saved = async {
            qmp.execute("stop", None).await?;
            // The default bandwidth cap (128 MiB/s) is for live migration over a network.
            qmp.execute(
                "migrate-set-parameters",
                Some(json!({"max-bandwidth": 64u64 << 30})),
            )
            .await?;
            qmp.execute(
                "migrate",
                Some(json!({"uri": format!("file:{}", tmp.display())})),
            )
            .await?;
            wait_migration(&mut qmp, "saving").await
        }
        .await;
        if let Err(e) = saved {
            let _ = std::fs::remove_file(&tmp);
            // The VM is whole still; leave it paused as the service may resume it.
            return Err(qmp_failed(id, e));
        }
        let synced = std::fs::File::open(&tmp).and_then(|f| f.sync_all());
        synced
            .and_then(|()| std::fs::rename(&tmp, &memory))
            .map_err(|e| RuntimeError::io("finishing the memory file", e))?;
        // The memory is safe on disk: end QEMU (the disk stays in state_dir).
        let _ = qmp.execute("quit", None).await;
        drop(qmp);
        self.kill_vm(id, state_dir).await
    }

    fn snapshot_complete(&self, image_dir: &Path) -> bool {
        // Written under another name and renamed into place when complete.
        std::fs::metadata(image_dir.join(MEMORY_FILE)).is_ok_and(|m| m.len() > 0)
    }

    async fn restore(
        &self,
        id: &str,
        state_dir: &Path,
        image_dir: &Path,
    ) -> Result<(), RuntimeError> {
        let memory = image_dir.join(MEMORY_FILE);
        if !memory.is_file() {
            return Err(RuntimeError::Tool {
                tool: "qemu".into(),
                message: format!("no checkpoint in {}", image_dir.display()),
            });
        }
        // A VM left over from a failed attempt would hold the disk.
        self.kill_vm(id, state_dir).await?;
        self.set_marker(id, state_dir)?;
        // The tap is there still unless the host lost it; the guest keeps its address.
        let (owned, dir) = (id.to_owned(), state_dir.to_path_buf());
        crate::gvisor::blocking(move || net::ensure(&owned, &dir)).await?;
        let restored = async {
            let mut qmp = self.launch(id, state_dir, Some(&memory)).await?;
            let agent_socket = agent_socket_of(state_dir)?;
            let loaded = async {
                wait_migration(&mut qmp, "loading").await?;
                qmp.execute("cont", None).await?;
                reattach_agent(&mut qmp, &agent_socket).await
            }
            .await;
            loaded.map_err(|e| qmp_failed(id, e))?;
            self.wait_status(id, &mut qmp, &["running"], START_TIMEOUT)
                .await
        }
        .await;
        if let Err(e) = restored {
            let _ = self.kill_vm(id, state_dir).await;
            return Err(e);
        }
        Ok(())
    }

    async fn run_build_step(&self, step: BuildStep<'_>) -> Result<(), BuildStepError> {
        self.build_step(step).await
    }

    async fn remove_build_leftovers(&self) {
        self.remove_build_vms().await;
    }

    fn console_tail(&self, state_dir: &Path) -> Option<String> {
        Some(process::console_tail(state_dir, 2000))
    }

    fn agent_hello_timeout(&self) -> Option<Duration> {
        Some(HELLO_TIMEOUT)
    }

    fn resident_bytes(&self, _id: &str, state_dir: &Path) -> Option<u64> {
        qemu_pid(state_dir).and_then(crate::gvisor::vm_rss)
    }

    fn disk_bytes(&self, _id: &str, state_dir: &Path) -> Option<u64> {
        crate::disk::image_bytes(&state_dir.join(DISK_FILE))
    }
}

/// The RAM QEMU gives a guest that may use `mib`. A guest of exactly 2 GiB never boots
/// (seen with QEMU 10.0's microvm under TCG, which puts the initrd at the very end of that
/// RAM: the guest's virtio queues read garbage, "Guest says index … is available"). With
/// 1 MiB more it boots, as does every other size tried (512 MiB to 4 GiB).
fn guest_ram_mib(mib: u64) -> u64 {
    if mib == 2048 {
        mib + 1
    } else {
        mib
    }
}

/// QEMU arguments plus a virtio-net NIC on the sandbox's tap, and the guest's
/// address (`space.net=ADDR/PREFIX,GATEWAY`) on its kernel command line.
fn with_nic(mut args: Vec<String>, link: &net::NetState) -> Vec<String> {
    if let Some(i) = args.iter().position(|a| a == "-append") {
        if let Some(cmdline) = args.get_mut(i + 1) {
            cmdline.push_str(&format!(
                " space.net={}/{},{}",
                link.guest_ip, link.prefix, link.host_ip
            ));
        }
    }
    args.extend([
        "-netdev".into(),
        format!(
            "tap,id=net0,ifname={},script=no,downscript=no",
            link.host_if
        ),
        "-device".into(),
        format!("virtio-net-device,netdev=net0,mac={}", link.guest_mac()),
    ]);
    args
}

/// The `-chardev` of the agent's port: a client of the host's socket that redials.
fn agent_chardev(socket: &Path) -> String {
    format!(
        "{AGENT_CHARDEV_PREFIX}path={},reconnect-ms={AGENT_RECONNECT_MS}",
        socket.display()
    )
}

/// The host's agent socket a sandbox was launched with (from launch.json).
fn agent_socket_of(state_dir: &Path) -> Result<String, RuntimeError> {
    let launch = std::fs::read(state_dir.join(LAUNCH_FILE))
        .map_err(|e| RuntimeError::io("reading launch.json", e))?;
    let args: Vec<String> = serde_json::from_slice(&launch).unwrap_or_default();
    args.iter()
        .find_map(|a| a.strip_prefix(AGENT_CHARDEV_PREFIX))
        .and_then(|rest| rest.strip_prefix("path="))
        .and_then(|rest| rest.split(',').next())
        .map(str::to_owned)
        .ok_or_else(|| RuntimeError::Tool {
            tool: "qemu".into(),
            message: "launch.json has no agent chardev".into(),
        })
}

/// Waits until the booting guest's agent opens its port (`None`), or says why it gave up
/// waiting: QEMU sat idle for [`BOOT_IDLE_LIMIT`] (watched through `activity`), or
/// [`AGENT_OPEN_TIMEOUT`] passed. A guest whose /init fails powers off, which ends QEMU: an
/// error here.
async fn wait_agent_open(
    qmp: &mut Qmp,
    mut activity: Option<&mut process::Activity>,
) -> Result<Option<String>, QmpError> {
    let start = Instant::now();
    let mut backoff = Backoff::polling();
    loop {
        match agent_port_open(qmp).await {
            Ok(true) => return Ok(None),
            Ok(false) => {}
            // The monitor shares QEMU's main loop with the guest's devices: a TCG guest on
            // a loaded or stalled host can keep it from answering past one exchange's bound
            // while its boot goes on (one CI run here: one of the host's CPUs stuck for
            // 31 s, and two booting microVMs failed on this). The bounds below decide; the
            // session skips the late reply.
            Err(QmpError::Timeout(t)) => {
                tracing::info!(waited = ?start.elapsed(), "QMP did not answer within {t:?} while the guest boots; asking again");
            }
            Err(e) => return Err(e),
        }
        let idle = activity.as_mut().map_or(Duration::ZERO, |a| a.idle_for());
        if idle >= BOOT_IDLE_LIMIT {
            return Ok(Some(format!(
                "the guest sat idle for {}s before its agent opened its port",
                idle.as_secs()
            )));
        }
        if start.elapsed() > AGENT_OPEN_TIMEOUT {
            return Ok(Some(format!(
                "the guest's agent did not open its port within {}s",
                AGENT_OPEN_TIMEOUT.as_secs()
            )));
        }
        backoff.wait().await;
    }
}

/// Where the guest's first vCPU is, for the log of a boot that stalled: its instruction
/// pointer and whether it is halted, from QEMU's `info registers`; or why that is unknown.
async fn vcpu_state(qmp: &mut Qmp) -> String {
    let registers = qmp
        .execute(
            "human-monitor-command",
            Some(json!({"command-line": "info registers"})),
        )
        .await;
    let text = match registers {
        Ok(Value::String(text)) => text,
        Ok(other) => return format!("vCPU state unknown: {other}"),
        Err(e) => return format!("vCPU state unknown: {e}"),
    };
    let wanted: Vec<&str> = text
        .split_whitespace()
        .filter(|w| w.starts_with("RIP=") || w.starts_with("HLT="))
        .take(2)
        .collect();
    if wanted.is_empty() {
        "vCPU state unknown".to_string()
    } else {
        format!("vCPU {}", wanted.join(" "))
    }
}

/// Whether the guest has the agent's port open (QEMU's `frontend-open` of its chardev).
async fn agent_port_open(qmp: &mut Qmp) -> Result<bool, QmpError> {
    let chardevs = qmp.execute("query-chardev", None).await?;
    Ok(chardevs.as_array().is_some_and(|list| {
        list.iter().any(|c| {
            c.get("label").and_then(Value::as_str) == Some("agent")
                && c.get("frontend-open").and_then(Value::as_bool) == Some(true)
        })
    }))
}

/// Connects a restored guest's agent port to the host so that its agent starts afresh.
///
/// The snapshot remembers the host as connected, and the guest's agent is in the middle of
/// its old session. A restored VM starts with the port off the host, so after `cont` the
/// guest is told the host went away (virtio-serial's port-open control event) and its agent
/// hangs up: it closes the port. Only then is the port connected to the host's socket; the
/// agent sees the host come back and says hello, as after a restart of the server.
/// Connecting at once would race: the guest could see "gone" and "back" in one batch and
/// carry its old session on to the new connection.
///
/// The close shows as the port's `frontend-open` going false, or, when the agent reopens
/// the port faster than we poll, as a second `VSERPORT_CHANGE` event: QEMU replays the
/// guest's open after the load (the first), and rate-limits the events of a port to one a
/// second, keeping the latest, so a close and a reopen arrive as one more event a second on.
async fn reattach_agent(qmp: &mut Qmp, socket: &str) -> Result<(), QmpError> {
    let is_port_change = |e: &Value| {
        e.get("event").and_then(Value::as_str) == Some("VSERPORT_CHANGE")
            && e["data"]["id"] == AGENT_PORT_ID
    };
    let start = Instant::now();
    let mut changes = 0;
    loop {
        let open = agent_port_open(qmp).await?;
        changes += qmp.take_events(is_port_change);
        if !open || changes >= 2 {
            break;
        }
        if start.elapsed() > AGENT_HANGUP_TIMEOUT {
            tracing::warn!("a restored guest kept its agent port open; connecting it anyway");
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    attach_agent(qmp, socket).await
}

/// Points the agent's port at `socket` (QEMU drops the old connection and dials the new).
async fn attach_agent(qmp: &mut Qmp, socket: &str) -> Result<(), QmpError> {
    qmp.execute(
        "chardev-change",
        Some(json!({
            "id": "agent",
            "backend": {"type": "socket", "data": {
                "addr": {"type": "unix", "data": {"path": socket}},
                "server": false,
                "reconnect-ms": AGENT_RECONNECT_MS,
            }},
        })),
    )
    .await
    .map(|_| ())
}

/// `query-status`'s `status`.
async fn query_status(qmp: &mut Qmp) -> Result<String, QmpError> {
    let ret = qmp.execute("query-status", None).await?;
    Ok(ret
        .get("status")
        .and_then(Value::as_str)
        .unwrap_or("unknown")
        .chars()
        .take(64)
        .collect())
}

/// Polls `query-migrate` until the migration (outgoing or incoming) completed.
async fn wait_migration(qmp: &mut Qmp, what: &str) -> Result<(), QmpError> {
    let start = Instant::now();
    let mut backoff = Backoff::new(Duration::from_millis(2), Duration::from_millis(50));
    loop {
        let ret = qmp.execute("query-migrate", None).await?;
        match ret.get("status").and_then(Value::as_str) {
            Some("completed") => return Ok(()),
            Some(s @ ("failed" | "cancelled" | "cancelling")) => {
                let desc = ret
                    .get("error-desc")
                    .and_then(Value::as_str)
                    .unwrap_or("no reason given");
                return Err(QmpError::Command {
                    command: "migrate".into(),
                    class: s.to_owned(),
                    desc: format!(
                        "{what} the checkpoint: {}",
                        desc.chars().take(500).collect::<String>()
                    ),
                });
            }
            _ => {}
        }
        if start.elapsed() > MIGRATE_TIMEOUT {
            return Err(QmpError::Timeout(MIGRATE_TIMEOUT));
        }
        backoff.wait().await;
    }
}

/// The pid of the QEMU of `state_dir` if it is alive. The pid file alone is not trusted (a
/// pid is reused after a crash): the process must be QEMU started with this very pid file.
fn qemu_pid(state_dir: &Path) -> Option<i32> {
    let pid_file = state_dir.join(PID_FILE);
    let pid: i32 = std::fs::read_to_string(&pid_file)
        .ok()?
        .trim()
        .parse()
        .ok()?;
    if pid <= 0 {
        return None;
    }
    is_our_qemu(pid, &pid_file).then_some(pid)
}

fn is_our_qemu(pid: i32, pid_file: &Path) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // A zombie is gone for our purposes.
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().next());
    if matches!(state, Some("Z" | "X")) {
        return false;
    }
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let want = pid_file.as_os_str().as_encoded_bytes();
    let mut args = cmdline.split(|b| *b == 0);
    let mut prev_was_flag = false;
    args.any(|a| {
        let hit = prev_was_flag && a == want;
        prev_was_flag = a == b"-pidfile";
        hit
    })
}

/// Waits until QEMU `pid` is gone; SIGKILLs its process group after [`QUIT_GRACE`].
async fn wait_gone(id: &str, pid: i32, state_dir: &Path) -> Result<(), RuntimeError> {
    let pid_file = state_dir.join(PID_FILE);
    let living = || {
        if is_our_qemu(pid, &pid_file) {
            vec![pid]
        } else {
            vec![]
        }
    };
    process::wait_gone(
        living,
        Kill::Group,
        QUIT_GRACE,
        QUIT_GRACE + Duration::from_secs(10),
    )
    .await
    .map_err(|_| RuntimeError::Tool {
        tool: "qemu".into(),
        message: format!("QEMU {pid} of microVM {id} did not exit"),
    })
}

/// The host's TSC frequency in kHz ([`crate::guest::host_tsc_khz`]): TCG hands the guest
/// the host's TSC, and a guest told its rate neither hangs calibrating it against the emulated
/// PIT nor drifts. Only with a constant-rate TSC (else `tsc=reliable` would be a lie).
fn host_tsc_khz() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    if !info.contains(" constant_tsc") {
        return None;
    }
    crate::guest::host_tsc_khz()
}

/// Sandbox ids name files of the driver: plain names only.
fn check_id(id: &str) -> Result<(), RuntimeError> {
    if id.is_empty()
        || id.len() > 64
        || id.starts_with('.')
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        return Err(RuntimeError::Unsupported(format!(
            "invalid sandbox id {id:?}"
        )));
    }
    Ok(())
}

/// A Unix socket path must fit `sun_path`.
fn check_socket_path(path: &Path) -> Result<(), RuntimeError> {
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(RuntimeError::Unsupported(format!(
            "socket path {} is {len} bytes, more than the {MAX_SOCKET_PATH} a Unix socket allows; use a shorter data directory",
            path.display()
        )));
    }
    Ok(())
}

/// Paths go into QEMU option strings, where `,` separates options: refuse what would be
/// misparsed rather than escape it.
fn check_qemu_path(path: &Path) -> Result<(), RuntimeError> {
    let s = path.to_str().ok_or_else(|| {
        RuntimeError::Unsupported(format!("path {} is not UTF-8", path.display()))
    })?;
    if !path.is_absolute() || s.bytes().any(|b| b == b',' || b.is_ascii_control()) {
        return Err(RuntimeError::Unsupported(format!(
            "path {s:?} cannot be passed to QEMU (relative, or has ',' or control characters)"
        )));
    }
    Ok(())
}

fn write_private(path: &Path, bytes: &[u8]) -> Result<(), RuntimeError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let written = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| {
            f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
            f.write_all(bytes)?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    written.map_err(|e| RuntimeError::io(format!("writing {}", path.display()), e))
}

fn qmp_failed(id: &str, e: QmpError) -> RuntimeError {
    RuntimeError::Tool {
        tool: "qemu qmp".into(),
        message: format!("microVM {id}: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tsc_rate_is_measured_where_it_is_constant() {
        let khz = host_tsc_khz();
        eprintln!("host TSC: {khz:?} kHz");
        let constant =
            std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|i| i.contains(" constant_tsc"));
        assert_eq!(khz.is_some(), constant && cfg!(target_arch = "x86_64"));
    }

    #[test]
    fn no_guest_gets_exactly_two_gib() {
        assert_eq!(guest_ram_mib(2048), 2049);
        for mib in [256, 512, 1024, 2047, 2049, 4096] {
            assert_eq!(guest_ram_mib(mib), mib);
        }
    }

    #[test]
    fn accel_choice_parses() {
        assert_eq!("auto".parse::<AccelChoice>(), Ok(AccelChoice::Auto));
        assert_eq!("tcg".parse::<AccelChoice>(), Ok(AccelChoice::Tcg));
        assert!("hvf".parse::<AccelChoice>().is_err());
    }

    #[test]
    fn paths_qemu_would_misparse_are_refused() {
        assert!(check_qemu_path(Path::new("/a/b.qcow2")).is_ok());
        assert!(check_qemu_path(Path::new("/a,b")).is_err());
        assert!(check_qemu_path(Path::new("rel")).is_err());
        assert!(check_socket_path(&Path::new("/").join("x".repeat(120))).is_err());
        assert!(check_id("sb_1").is_ok());
        assert!(check_id("../x").is_err());
        assert!(check_id(".x").is_err());
    }
}
