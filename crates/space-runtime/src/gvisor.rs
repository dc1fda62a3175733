//! The gVisor driver: one OCI bundle per sandbox, run by `runsc` with the
//! `systrap` platform, only loopback (unless egress, below), and the template's
//! root under a writable overlay whose upper layer lives in the sandbox's own
//! state directory (the template directory is never written).
//!
//! The container's PID 1 is `space-agent`. Every host path runsc gets is a host-side
//! read-only bind of a path of this sandbox alone ([`crate::lend`]): its own copy of the
//! agent (`/.space/bin`), its run directory (`/.space/run`: the agent's socket, and its token
//! until the host deletes it) and the template's root (under the overlay). `--host-uds=open`
//! lets the agent dial the host's socket through the read-only bind (connect(2) is not a
//! write). The agent's stdout and stderr (`console.log`) go to the sandbox's small log tmpfs.
//! The audit of every mount and flag is in docs/SECURITY.md ("What the host lends a sandbox").
//!
//! An egress sandbox (`SandboxSpec::network`) runs with `--network=sandbox` in the
//! network namespace [`crate::net`] made for it; runsc copies the link into gVisor's
//! own network stack, so the sandbox's packets leave through a veth into the host's
//! firewall.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::json;
use space_core::runtime::{
    BuildStep, BuildStepError, Runtime, RuntimeError, RuntimeStatus, SandboxSpec,
};
use tokio::process::Command;

mod step;

use crate::cpus::CpuPlacer;
use crate::lend::{self, Lent};
use crate::process::{self, tail_text, Backoff, Kill, CONSOLE_LOG};
use crate::{disk, net};

/// Where the agent binary's directory is mounted inside the sandbox.
pub const AGENT_DIR_IN_SANDBOX: &str = "/.space/bin";
/// Where the per-sandbox run directory is mounted inside the sandbox.
pub const RUN_DIR_IN_SANDBOX: &str = "/.space/run";
/// The capabilities of a sandbox's (and a build step's) processes: Docker's default set.
pub(crate) const DEFAULT_CAPS: [&str; 14] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];
/// How long a quiesced agent gets to be back asleep before its sandbox is checkpointed.
const CHECKPOINT_SETTLE: std::time::Duration = std::time::Duration::from_millis(300);
/// cgroup parent of every sandbox.
const CGROUP_PARENT: &str = "space";
/// What `runsc checkpoint` writes last into its image directory (memory, processes and the
/// writable layer).
const CHECKPOINT_FILE: &str = "checkpoint.img";

/// The vCPUs of a sandbox, from the CPU quota in its bundle (0 when it has none or the
/// bundle cannot be read: then it is not placed).
fn bundle_vcpus(state_dir: &Path) -> u32 {
    let Ok(text) = std::fs::read(state_dir.join("bundle").join("config.json")) else {
        return 0;
    };
    let Ok(config) = serde_json::from_slice::<serde_json::Value>(&text) else {
        return 0;
    };
    let cpu = &config["linux"]["resources"]["cpu"];
    match (cpu["quota"].as_u64(), cpu["period"].as_u64()) {
        (Some(q), Some(p)) if p > 0 => u32::try_from(q / p).unwrap_or(0),
        _ => 0,
    }
}

/// The `gvisor` runtime.
#[derive(Debug, Clone)]
pub struct GvisorRuntime {
    runsc: PathBuf,
    /// `runsc --root`: runsc's own state for every container of this server.
    state_root: PathBuf,
    /// `runsc --root` of template build steps.
    build_root: PathBuf,
    platform: String,
    /// Gives each sandbox CPUs of its own where `space serve --cpu-pinning` asks for it.
    cpus: CpuPlacer,
}

impl GvisorRuntime {
    pub fn new(runsc: PathBuf, state_root: PathBuf, build_root: PathBuf, platform: String) -> Self {
        GvisorRuntime {
            runsc,
            state_root,
            build_root,
            platform,
            cpus: CpuPlacer::new(false, CGROUP_PARENT),
        }
    }

    /// Whether sandboxes get CPUs of their own (off by default; see [`crate::cpus`]).
    pub fn with_cpu_pinning(mut self, on: bool) -> Self {
        self.cpus = CpuPlacer::new(on, CGROUP_PARENT);
        self
    }

    /// Places a created or restored sandbox on CPUs of its own, before its workload
    /// runs. Pinning is only faster, never needed: a failure is logged, not returned.
    fn place_on_cpus(&self, id: &str, vcpus: u32) {
        match self.cpus.place(id, vcpus) {
            Ok(Some(list)) => tracing::debug!(sandbox = id, cpus = %list, "placed on CPUs"),
            Ok(None) => {}
            Err(e) => tracing::warn!(sandbox = id, error = %e, "cannot place the sandbox on CPUs"),
        }
    }

    /// The empty filesystems new sandboxes' disks are copied from (`disk::ensure_mounted`):
    /// beside `runsc --root`, in the server's data directory.
    fn disk_formats(&self) -> PathBuf {
        self.state_root.with_file_name("disk-formats")
    }

    /// `runsc --root`, for tests and tools that want to look.
    pub fn state_root(&self) -> &Path {
        &self.state_root
    }

    fn command(&self, args: &[&str]) -> Command {
        self.command_net(args, false)
    }

    /// A runsc command; `networked`: the sandbox has an egress link (`--network=sandbox`).
    fn command_net(&self, args: &[&str], networked: bool) -> Command {
        let mut cmd = Command::new(&self.runsc);
        cmd.arg("--root").arg(&self.state_root);
        // runsc reads its global flags on every call, not only at create.
        cmd.arg(format!("--platform={}", self.platform))
            .arg(network_flag(networked))
            .arg("--host-uds=open");
        if networked {
            net::hide_proc_sys_net(&mut cmd);
        }
        cmd.args(args);
        cmd.stdin(Stdio::null());
        cmd.kill_on_drop(false);
        cmd
    }

    /// Runs a short runsc subcommand and returns its stdout.
    async fn run(&self, args: &[&str]) -> Result<Vec<u8>, RuntimeError> {
        self.run_net(args, false).await
    }

    async fn run_net(&self, args: &[&str], networked: bool) -> Result<Vec<u8>, RuntimeError> {
        let sub = args
            .iter()
            .find(|a| !a.starts_with('-'))
            .copied()
            .unwrap_or_default();
        process::run_tool(
            &format!("runsc {sub}"),
            &mut self.command_net(args, networked),
        )
        .await
    }

    /// The OCI runtime spec of a sandbox, whose host paths are the read-only binds of `lent`.
    fn oci_spec(&self, spec: &SandboxSpec, lent: &Lent) -> serde_json::Value {
        let caps = DEFAULT_CAPS;
        let env: Vec<String> = spec
            .agent_env
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let mut resources = serde_json::Map::new();
        if spec.vcpus > 0 {
            resources.insert(
                "cpu".into(),
                json!({"quota": i64::from(spec.vcpus) * 100_000, "period": 100_000}),
            );
        }
        if spec.memory_mib > 0 {
            // What runsc gives the cgroup it makes, and what it tells gVisor as MemTotal: the
            // agent keeps the workload within that (space_agent's `oom`). `create` then
            // raises the host cgroup to `host_memory_limit`, before the workload starts.
            let bytes = spec.memory_mib.saturating_mul(1 << 20);
            resources.insert("memory".into(), json!({"limit": bytes}));
        }
        if spec.pids > 0 {
            // The sandbox's own limit is enforced inside it (the agent sets RLIMIT_NPROC).
            // The host cgroup is only a safety net: the sentry needs ~70 host threads of
            // its own and about 1.5 per guest task, and it crashes (gVisor issue 2490)
            // rather than failing a fork when the host limit is reached.
            let host = spec.pids.saturating_mul(4).saturating_add(256);
            resources.insert("pids".into(), json!({"limit": host}));
        }
        // An egress sandbox joins the namespace holding its end of the link; runsc
        // (`--network=sandbox`) copies its address and route into gVisor's own stack.
        let netns = match &spec.network {
            Some(_) => json!({"type": "network", "path": format!(
                "{}/{}", net::NETNS_DIR, net::names(&spec.id, net::LinkKind::Veth).netns
            )}),
            None => json!({"type": "network"}),
        };
        json!({
            "ociVersion": "1.0.2",
            "process": {
                "terminal": false,
                "user": {"uid": 0, "gid": 0},
                "args": [format!("{AGENT_DIR_IN_SANDBOX}/space-agent")],
                "env": env,
                "cwd": "/",
                "capabilities": {
                    "bounding": caps, "effective": caps, "permitted": caps,
                },
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1_048_576, "soft": 1_048_576}],
                "noNewPrivileges": false
            },
            // Writable only through the overlay (`--overlay2`), whose upper layer is a file
            // on the sandbox's quota'd disk; the lower layer is the read-only bind.
            "root": {"path": lent.root, "readonly": false},
            "hostname": spec.hostname,
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
                 "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
                {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
                 "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
                {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
                 "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
                {"destination": "/sys", "type": "sysfs", "source": "sysfs",
                 "options": ["nosuid", "noexec", "nodev", "ro"]},
                // Read-only here too, but what holds is the host's read-only bind.
                {"destination": AGENT_DIR_IN_SANDBOX, "type": "bind",
                 "source": lent.bin, "options": ["bind", "ro", "nosuid", "nodev"]},
                {"destination": RUN_DIR_IN_SANDBOX, "type": "bind",
                 "source": lent.run, "options": ["bind", "ro", "nosuid", "nodev", "noexec"]}
            ],
            "linux": {
                "namespaces": [
                    {"type": "pid"}, netns, {"type": "ipc"},
                    {"type": "uts"}, {"type": "mount"}
                ],
                "resources": resources,
                "cgroupsPath": format!("/{CGROUP_PARENT}/{}", spec.id),
            }
        })
    }

    /// Raises the host memory cgroup of a created (or restored) sandbox to its
    /// [`host_memory_limit`], recorded in the state dir at create.
    fn raise_host_memory(id: &str, state_dir: &Path) -> Result<(), RuntimeError> {
        let Some(bytes) = std::fs::read_to_string(state_dir.join(HOST_MEMORY_FILE))
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok())
        else {
            return Ok(());
        };
        let [v1, v2] = memory_cgroup_dirs(id);
        let write = |path: PathBuf| {
            std::fs::write(&path, bytes.to_string())
                .map_err(|e| RuntimeError::io(format!("raising {}", path.display()), e))
        };
        if v1.join("memory.limit_in_bytes").exists() {
            // memory+swap may not be below memory: raise it first where the host counts swap.
            if v1.join("memory.memsw.limit_in_bytes").exists() {
                write(v1.join("memory.memsw.limit_in_bytes"))?;
            }
            write(v1.join("memory.limit_in_bytes"))
        } else if v2.join("memory.max").exists() {
            write(v2.join("memory.max"))
        } else {
            Ok(())
        }
    }

    /// Runs `runsc run --detach` or `runsc restore` for a sandbox. The sandbox inherits
    /// the command's stdio as the agent's stdout/stderr: a file, never a pipe (a
    /// pipe would keep the command from ever finishing, and would end the sandbox with
    /// the server). Root inside can write to it (`/proc/1/fd/1`), so the file is on the
    /// sandbox's log tmpfs ([`lend::mount_log`]): a flood fills that and nothing else.
    async fn launch(&self, state_dir: &Path, args: &[OsString]) -> Result<(), RuntimeError> {
        let overlay = state_dir.join("overlay");
        let networked = is_networked(state_dir);
        let mut cmd = Command::new(&self.runsc);
        if networked {
            net::hide_proc_sys_net(&mut cmd);
        }
        cmd.arg("--root")
            .arg(&self.state_root)
            .arg(format!("--platform={}", self.platform))
            .arg(network_flag(networked))
            .arg("--host-uds=open")
            .arg(format!("--overlay2=root:dir={}", overlay.display()))
            .arg("--cpu-num-from-quota");
        // For debugging runsc itself: its own logs, one set per sandbox and command.
        if let Some(dir) = std::env::var_os("SPACE_RUNSC_DEBUG_LOG") {
            let mut flag = OsString::from("--debug-log=");
            flag.push(dir);
            cmd.arg("--debug").arg(flag);
        }
        cmd.args(args);
        let (mut child, log) = process::launch(&mut cmd, state_dir, CONSOLE_LOG)?;
        let status = child
            .wait()
            .await
            .map_err(|e| RuntimeError::io(format!("running {}", self.runsc.display()), e))?;
        if !status.success() {
            return Err(RuntimeError::Tool {
                tool: format!(
                    "runsc {}",
                    args.first()
                        .map(|a| a.to_string_lossy())
                        .unwrap_or_default()
                ),
                message: log.tail(1000),
            });
        }
        Ok(())
    }

    /// Removes what runsc may leave behind after `delete`: cgroup directories.
    fn remove_cgroups(id: &str) {
        let Ok(controllers) = std::fs::read_dir("/sys/fs/cgroup") else {
            return;
        };
        for c in controllers.flatten() {
            let dir = c.path().join(CGROUP_PARENT).join(id);
            if dir.exists() {
                let _ = std::fs::remove_dir(&dir);
            }
        }
    }
}

#[async_trait]
impl Runtime for GvisorRuntime {
    fn name(&self) -> &'static str {
        "gvisor"
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<(), RuntimeError> {
        let bundle = spec.state_dir.join("bundle");
        let overlay = spec.state_dir.join("overlay");
        for dir in [&bundle, &self.state_root] {
            tokio::fs::create_dir_all(dir)
                .await
                .map_err(|e| RuntimeError::io(format!("creating {}", dir.display()), e))?;
        }
        // The writable layer lives on the sandbox's own quota'd filesystem. It and the lent
        // paths are made at once (neither needs the other), and both are waited for: a
        // failure of one must not leave the other still mounting after the create has ended.
        let (image, formats) = (spec.state_dir.join(disk::IMAGE_FILE), self.disk_formats());
        let disk = disk::ensure_mounted(&image, &overlay, spec.disk_mib, &formats);
        let (dir, agents, run, rootfs) = (
            spec.state_dir.clone(),
            spec.agent_dir.clone(),
            spec.run_dir.clone(),
            spec.rootfs.clone(),
        );
        let lend = blocking(move || Ok(lend::lend(&dir, &agents, &run, &rootfs)?));
        let (disk, lent) = tokio::join!(disk, lend);
        disk?;
        let lent = lent?;
        if let Some(cfg) = spec.network.clone() {
            let (id, dir) = (spec.id.clone(), spec.state_dir.clone());
            blocking(move || net::setup(&id, &dir, net::LinkKind::Veth, &cfg)).await?;
        }
        let config = serde_json::to_vec_pretty(&self.oci_spec(spec, &lent)).unwrap_or_default();
        tokio::fs::write(bundle.join("config.json"), config)
            .await
            .map_err(|e| RuntimeError::io("writing the OCI spec", e))?;

        if spec.memory_mib > 0 {
            let limit = host_memory_limit(spec.memory_mib, spec.pids);
            tokio::fs::write(spec.state_dir.join(HOST_MEMORY_FILE), limit.to_string())
                .await
                .map_err(|e| RuntimeError::io("writing the host memory limit", e))?;
        }
        // One runsc process creates and starts the sandbox (`run --detach`): a second one
        // for `start` cost every create another runsc start-up, about 10 ms of host CPU
        // (measured with 16 creates at once on a 2-core host).
        self.launch(
            &spec.state_dir,
            &[
                "run".into(),
                "--bundle".into(),
                bundle.into(),
                "--detach".into(),
                spec.id.clone().into(),
            ],
        )
        .await?;
        // As after a restore: before the create ends, so before any command can run. Until
        // then the host cgroup holds the sandbox to `memory_mib` (at least 64 MiB), far
        // above what gVisor and the agent use to boot (about 20 MiB).
        Self::raise_host_memory(&spec.id, &spec.state_dir)?;
        self.place_on_cpus(&spec.id, spec.vcpus);
        Ok(())
    }

    fn console_tail(&self, state_dir: &Path) -> Option<String> {
        Some(process::console_tail(state_dir, 2000))
    }

    async fn wake_agent(&self, id: &str) -> Result<(), RuntimeError> {
        self.run(&["kill", id, "USR1"]).await.map(|_| ())
    }

    async fn pause(&self, id: &str) -> Result<(), RuntimeError> {
        self.run(&["pause", id]).await.map(|_| ())
    }

    async fn resume(&self, id: &str) -> Result<(), RuntimeError> {
        self.run(&["resume", id]).await.map(|_| ())
    }

    async fn destroy(&self, id: &str, state_dir: &Path) -> Result<(), RuntimeError> {
        self.stop(id, state_dir).await?;
        let owned = id.to_owned();
        blocking(move || net::teardown(&owned)).await?;
        // Never remove through a mount: below the read-only binds are the template and
        // the server's own run directory.
        disk::ensure_nothing_mounted_below(state_dir)?;
        match tokio::fs::remove_dir_all(state_dir).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(RuntimeError::io(
                format!("removing {}", state_dir.display()),
                e,
            )),
        }
    }

    async fn stop(&self, id: &str, state_dir: &Path) -> Result<(), RuntimeError> {
        if self.status(id).await? != RuntimeStatus::Missing {
            // Either may fail when the container is already half gone; delete --force is what counts.
            let _ = self.run(&["kill", "--all", id, "KILL"]).await;
            if let Err(e) = self.run(&["delete", "--force", id]).await {
                if self.status(id).await? != RuntimeStatus::Missing {
                    return Err(e);
                }
            }
        }
        let bundle = format!("--bundle={}", state_dir.join("bundle").display());
        wait_for_processes_gone(&bundle).await?;
        Self::remove_cgroups(id);
        disk::unmount_below(state_dir).await?;
        Ok(())
    }

    async fn status(&self, id: &str) -> Result<RuntimeStatus, RuntimeError> {
        let out = self
            .command(&["state", id])
            .output()
            .await
            .map_err(|e| RuntimeError::io("running runsc state", e))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            if err.contains("does not exist") || err.contains("not found") {
                return Ok(RuntimeStatus::Missing);
            }
            return Err(RuntimeError::Tool {
                tool: "runsc state".into(),
                message: tail_text(&out.stderr, 1000),
            });
        }
        let state: serde_json::Value =
            serde_json::from_slice(&out.stdout).map_err(|e| RuntimeError::Tool {
                tool: "runsc state".into(),
                message: format!("unreadable output: {e}"),
            })?;
        Ok(match state.get("status").and_then(|s| s.as_str()) {
            Some("running") => RuntimeStatus::Running,
            Some("paused") => RuntimeStatus::Paused,
            _ => RuntimeStatus::Stopped,
        })
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
        let image = image_dir.to_string_lossy().into_owned();
        // The agent has just let go of its connection and stopped its periodic work (see
        // `space_agent`'s `Quiet`): a moment for its threads to be back asleep, since runsc
        // (systrap, 2024-07-29) was thought to save a thread caught running with registers it
        // cannot have had (those crashes were stale epoll events: `space_agent`'s `watch`).
        // Nothing outside the sandbox can see that they are.
        tokio::time::sleep(CHECKPOINT_SETTLE).await;
        self.run_net(
            &["checkpoint", "--image-path", &image, id],
            is_networked(state_dir),
        )
        .await?;
        // The sandbox stops by itself once its state is saved (a forced delete
        // would only race it); then release what is left of it.
        let mut backoff = Backoff::polling();
        let start = std::time::Instant::now();
        loop {
            match self.status(id).await? {
                RuntimeStatus::Missing => break,
                RuntimeStatus::Stopped => {
                    // runsc may call it stopped a moment before its sandbox process agrees.
                    if self.run(&["delete", id]).await.is_err() {
                        self.run(&["delete", "--force", id]).await?;
                    }
                    break;
                }
                _ if start.elapsed() > Duration::from_secs(10) => {
                    self.run(&["delete", "--force", id]).await?;
                    break;
                }
                _ => {}
            }
            backoff.wait().await;
        }
        let bundle = format!("--bundle={}", state_dir.join("bundle").display());
        wait_for_processes_gone(&bundle).await?;
        Self::remove_cgroups(id);
        // The restore runs this copy of the agent (the checkpoint's memory has it mapped).
        lend::sync_agent_copy(state_dir)
            .map_err(|e| RuntimeError::io("saving the sandbox's copy of the agent", e))?;
        // The snapshot holds the writable layer; its filesystem stays on disk, unmounted.
        disk::unmount_below(state_dir).await?;
        Ok(())
    }

    fn snapshot_complete(&self, image_dir: &Path) -> bool {
        std::fs::metadata(image_dir.join(CHECKPOINT_FILE)).is_ok_and(|m| m.len() > 0)
    }

    async fn restore(
        &self,
        id: &str,
        state_dir: &Path,
        image_dir: &Path,
    ) -> Result<(), RuntimeError> {
        // A container left over from a failed attempt would make the id clash.
        if self.status(id).await? != RuntimeStatus::Missing {
            let _ = self.run(&["delete", "--force", id]).await;
        }
        let bundle = state_dir.join("bundle");
        let image = state_dir.join(disk::IMAGE_FILE);
        if image.exists() {
            disk::ensure_mounted(&image, &state_dir.join("overlay"), 1, &self.disk_formats())
                .await?;
        }
        let dir = state_dir.to_path_buf();
        blocking(move || Ok(lend::relend(&dir)?)).await?;
        // runsc took the addresses off the namespace's end when it started: make the
        // link again, as it was, for the restored sandbox to copy.
        let (owned, dir) = (id.to_owned(), state_dir.to_path_buf());
        blocking(move || net::ensure(&owned, &dir)).await?;
        self.launch(
            state_dir,
            &[
                "restore".into(),
                "--image-path".into(),
                image_dir.into(),
                "--bundle".into(),
                bundle.into(),
                "--detach".into(),
                id.into(),
            ],
        )
        .await?;
        // runsc made the cgroup from the spec again; the CPUs are placed afresh, among
        // the sandboxes running now.
        Self::raise_host_memory(id, state_dir)?;
        self.place_on_cpus(id, bundle_vcpus(state_dir));
        Ok(())
    }

    async fn run_build_step(&self, step: BuildStep<'_>) -> Result<(), BuildStepError> {
        self.build_step(step).await
    }

    async fn remove_build_leftovers(&self) {
        self.remove_stale_build_containers().await
    }

    fn stop_reason(&self, id: &str) -> Option<String> {
        // The host's memory cgroup of the sandbox counts the OOM kills in it: the Sentry
        // holds the workload's memory (and the overlay's files), so a memory or inode
        // bomb past `memory_mib` ends the whole sandbox there.
        for dir in memory_cgroup_dirs(id) {
            let kills = std::fs::read_to_string(dir.join("memory.oom_control"))
                .or_else(|_| std::fs::read_to_string(dir.join("memory.events")))
                .ok()
                .and_then(|t| {
                    t.lines()
                        .find_map(|l| l.strip_prefix("oom_kill "))
                        .and_then(|n| n.trim().parse::<u64>().ok())
                });
            if kills.is_some_and(|n| n > 0) {
                return Some(
                    "out of memory: gVisor's own memory outgrew the room the host gives it \
                     beyond memory_mib and the host ended the sandbox (its kernel keeps state \
                     per file and per process: millions of files count there)"
                        .into(),
                );
            }
        }
        None
    }

    fn resident_bytes(&self, id: &str, state_dir: &Path) -> Option<u64> {
        // The sandbox's cgroup lists its host processes (the Sentry, the gofer and the
        // Sentry's stubs) without a walk through every process of the host, which the cost
        // sampler would otherwise make for each sandbox in turn. The walk remains for a
        // sandbox whose cgroup cannot be read.
        let mut pids = cgroup_processes(id);
        if pids.is_empty() {
            let bundle = format!("--bundle={}", state_dir.join("bundle").display());
            let roots = runsc_processes_matching(&bundle);
            if roots.is_empty() {
                return None;
            }
            pids = with_descendants(&roots);
        }
        Some(pids.iter().filter_map(|pid| vm_rss(*pid)).sum())
    }

    fn disk_bytes(&self, _id: &str, state_dir: &Path) -> Option<u64> {
        disk::used_bytes(&state_dir.join("overlay"))
            .or_else(|| disk::image_bytes(&state_dir.join(disk::IMAGE_FILE)))
    }

    async fn list(&self) -> Result<Vec<String>, RuntimeError> {
        if !self.state_root.exists() {
            return Ok(Vec::new());
        }
        let out = self.run(&["list", "--format=json"]).await?;
        let list: serde_json::Value =
            serde_json::from_slice(&out).map_err(|e| RuntimeError::Tool {
                tool: "runsc list".into(),
                message: format!("unreadable output: {e}"),
            })?;
        Ok(list
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|c| c.get("id").and_then(|i| i.as_str()).map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default())
    }
}

/// The state-dir file holding a sandbox's [`host_memory_limit`] (bytes), for restores.
const HOST_MEMORY_FILE: &str = "host-memory";

/// The host memory cgroup limit of a gVisor sandbox of `memory_mib` and `pids`.
///
/// gVisor enforces no memory limit itself: when the host cgroup is full, the host
/// kills the biggest process of the sandbox, which may be the Sentry (the whole
/// sandbox). So the workload is kept within `memory_mib` inside, by the agent, as
/// gVisor counts it; the host cgroup has room above that for what gVisor uses on the
/// host besides, measured here: the Sentry's and gofer's own memory and the agent's
/// reaction time (about 20 MiB idle, up to ~60 MiB over the limit while two memory
/// bombs race the agent: 64 MiB), and what gVisor keeps per process (a host "stub"
/// process each, pooled, and the Sentry's bookkeeping: it grows with the processes a
/// sandbox has had at once and stays, up to ~700 KiB per process slot: 768 KiB for each
/// of `pids`, 1024 when unlimited). Only memory the Sentry holds for other things
/// (millions of files, a fork storm left running) can still fill that room; then the
/// host ends the sandbox, and `stop_reason` says so.
pub fn host_memory_limit(memory_mib: u64, pids: u64) -> u64 {
    let pids = if pids == 0 { 1024 } else { pids };
    memory_mib
        .saturating_add(64)
        .saturating_mul(1 << 20)
        .saturating_add(pids.saturating_mul(768 << 10))
}

fn network_flag(networked: bool) -> &'static str {
    if networked {
        "--network=sandbox"
    } else {
        "--network=none"
    }
}

/// Whether the sandbox of `state_dir` has an egress link.
fn is_networked(state_dir: &Path) -> bool {
    state_dir.join(net::STATE_FILE).exists()
}

/// Runs blocking host work (network setup) off the async threads.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, RuntimeError> + Send + 'static,
) -> Result<T, RuntimeError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| RuntimeError::io("network setup", std::io::Error::other(e)))?
}

/// Pids of runsc processes (sandbox, gofer) whose command line contains `needle`.
/// Only processes named `runsc*` count: a CLI or a test that mentions the
/// sandbox id on its own command line is never mistaken for part of it.
pub fn runsc_processes_matching(needle: &str) -> Vec<i32> {
    let mut pids = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let mut args = cmdline.split(|b| *b == 0);
        let argv0 = args.next().unwrap_or_default();
        let name = argv0.rsplit(|b| *b == b'/').next().unwrap_or_default();
        if !name.starts_with(b"runsc") {
            continue;
        }
        if args.any(|a| a == needle.as_bytes()) {
            pids.push(pid);
        }
    }
    pids
}

/// Waits until no runsc process of the sandbox is left; SIGKILLs stragglers
/// after a grace period.
async fn wait_for_processes_gone(needle: &str) -> Result<(), RuntimeError> {
    process::wait_gone(
        || runsc_processes_matching(needle),
        Kill::Process,
        Duration::from_secs(3),
        Duration::from_secs(10),
    )
    .await
    .map_err(|pids| RuntimeError::Tool {
        tool: "runsc delete".into(),
        message: format!("processes {pids:?} of the sandbox did not exit"),
    })
}

/// The processes in sandbox `id`'s cgroup (v1's memory hierarchy, else the unified one):
/// runsc puts the sandbox, its gofer and every process they start there. Empty when the
/// cgroup does not exist or cannot be read.
pub fn cgroup_processes(id: &str) -> Vec<i32> {
    memory_cgroup_dirs(id)
        .iter()
        .find_map(|dir| std::fs::read_to_string(dir.join("cgroup.procs")).ok())
        .map(|t| parse_pids(&t))
        .unwrap_or_default()
}

/// Where sandbox `id`'s memory cgroup is: in cgroup v1's memory hierarchy, or in the
/// unified (v2) one.
fn memory_cgroup_dirs(id: &str) -> [PathBuf; 2] {
    ["/sys/fs/cgroup/memory", "/sys/fs/cgroup"]
        .map(|root| Path::new(root).join(CGROUP_PARENT).join(id))
}

/// The pids of a `cgroup.procs` file, one per line; anything else is skipped.
fn parse_pids(text: &str) -> Vec<i32> {
    text.lines()
        .filter_map(|l| l.trim().parse::<i32>().ok())
        .filter(|&p| p > 0)
        .collect()
}

/// `roots` and every process below them.
pub fn with_descendants(roots: &[i32]) -> Vec<i32> {
    let mut parent_of: Vec<(i32, i32)> = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for e in entries.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            // The ppid is the 2nd field after the parenthesised command name.
            let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
                continue;
            };
            let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
                continue;
            };
            if let Some(ppid) = rest.split_whitespace().nth(1).and_then(|p| p.parse().ok()) {
                parent_of.push((pid, ppid));
            }
        }
    }
    let mut all: Vec<i32> = roots.to_vec();
    let mut i = 0;
    while i < all.len() {
        let p = all[i];
        for (pid, ppid) in &parent_of {
            if *ppid == p && !all.contains(pid) {
                all.push(*pid);
            }
        }
        i += 1;
    }
    all
}

/// Resident set size of a process, in bytes.
pub fn vm_rss(pid: i32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_procs_are_read_as_pids() {
        assert_eq!(parse_pids("774\n778\n802\n"), vec![774, 778, 802]);
        assert_eq!(parse_pids(""), Vec::<i32>::new());
        assert_eq!(parse_pids("12\n\nx\n-3\n0\n 40 \n"), vec![12, 40]);
    }

    #[test]
    fn a_sandbox_without_a_cgroup_has_no_processes_there() {
        assert!(cgroup_processes("sb_no_such_sandbox_here").is_empty());
    }

    #[test]
    fn host_memory_leaves_room_for_gvisor() {
        assert_eq!(host_memory_limit(256, 256), (256 + 64 + 192) << 20);
        // Unlimited pids are counted as the default 1024.
        assert_eq!(host_memory_limit(512, 0), (512 + 64 + 768) << 20);
        assert!(host_memory_limit(u64::MAX, u64::MAX) > 0);
    }
}
