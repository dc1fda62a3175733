//! Template build steps in a microVM of their own, for hosts without gVisor.
//!
//! The step's VM boots like a sandbox's ([`MicrovmRuntime::boot`]) on a private ext4 image of
//! the parent layer (or of a copy that `prepare` changed), with the build's limits as its
//! size: vCPUs, memory, the agent's process limit, and a disk of the parent's size plus the
//! build's disk quota. It has no network device. The host plays the server's part with the
//! host end of the agent protocol ([`space_agent_host`]): it listens on a socket of its own,
//! runs `/bin/sh -c script` as root through the agent, streams its output to the caller, and
//! kills it at the step timeout.
//!
//! What the step left comes out the way every file download does: the agent packs the
//! guest's root as a tar (never `/proc`, `/sys`, `/dev` or `/.space`; no devices, fifos or
//! sockets), and the host unpacks it into the new layer with the hardened unpacker, at most
//! the parent's bytes plus the disk quota. The host never mounts a filesystem the guest
//! wrote. `/tmp` is not kept (under gVisor a step's `/tmp` is a tmpfs): the layer gets the
//! parent's.
//!
//! A guard kills the VM and removes its directory on every path (error, timeout, a dropped
//! future); [`MicrovmRuntime::remove_build_vms`] removes what a killed server left.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::{Buf, Bytes};
use futures::StreamExt;
use space_agent::fs::{FsError, Limits, Root};
use space_agent_host::protocol::{ExitStatus, Frame, SpawnRequest};
use space_agent_host::{AgentConn, AgentError, DownloadFormat};
use space_core::runtime::{
    BuildStep, BuildStepError, Runtime, RuntimeError, SandboxSpec, StepLimit,
};
use tokio::process::Command;

use super::MicrovmRuntime;
use crate::process::run_tool;

/// Ids of build VMs start with this; [`Runtime::list`](space_core::runtime::Runtime::list)
/// leaves them out (they are no sandbox).
pub(super) const BUILD_PREFIX: &str = "spacebuild-";
/// How long a booted guest's agent may take to dial in (TCG on a loaded host is slow).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(120);
/// Bound on taking the step's files out of the VM.
const COLLECT_TIMEOUT: Duration = Duration::from_secs(1800);
/// Bound on the small commands the host runs in the VM itself (`df`).
const PROBE_TIMEOUT: Duration = Duration::from_secs(30);
/// Archive members at most in what a step leaves (as for an imported image).
const MAX_ENTRIES: u64 = 2_000_000;

impl MicrovmRuntime {
    pub(super) async fn build_step(&self, step: BuildStep<'_>) -> Result<(), BuildStepError> {
        let BuildStep {
            label,
            parent,
            rootfs,
            work_dir,
            script,
            env,
            workdir,
            limits,
            agent_dir,
            prepare,
            output,
        } = step;
        let line = |l: String| output(format!("{l}\n").as_bytes());

        // The root the step starts from: the parent layer, or a copy `prepare` changes.
        let base = match prepare {
            None => parent.clone(),
            Some(prepare) => {
                let copy = work_dir.join("base");
                copy_tree(&parent, &copy).await?;
                let root = copy.clone();
                tokio::task::spawn_blocking(move || prepare(&root))
                    .await
                    .map_err(|e| RuntimeError::io("preparing the step", std::io::Error::other(e)))?
                    .map_err(BuildStepError::Prepare)?;
                copy
            }
        };
        let image = work_dir.join("root.ext4");
        super::image::private_image(&base, &image).await?;

        let id = format!("{BUILD_PREFIX}{}", random_hex(8)?);
        let vm = BuildVm::new(self.clone(), &id)?;
        let token = random_hex(32)?;
        write_private(&vm.run_dir().join("token"), token.as_bytes())?;
        let (tx, mut rx) = tokio::sync::watch::channel(None);
        let listener = space_agent_host::listen(
            id.clone(),
            token,
            &vm.run_dir().join(super::AGENT_SOCKET),
            tx,
            super::HELLO_TIMEOUT,
        )
        .map_err(|e| RuntimeError::io("listening for the build VM's agent", e))?;
        let _listener = AbortOnDrop(listener);
        let spec = SandboxSpec {
            id: id.clone(),
            rootfs: base.clone(),
            state_dir: vm.state_dir(),
            run_dir: vm.run_dir(),
            agent_dir,
            agent_env: Vec::new(),
            vcpus: limits.vcpus.max(1),
            memory_mib: limits.memory_mib,
            pids: limits.pids,
            disk_mib: limits.disk_mib,
            hostname: "build".into(),
            network: None,
        };
        self.boot(&spec, &image, false).await?;
        let conn = space_agent_host::wait_connected(&mut rx, CONNECT_TIMEOUT)
            .await
            .map_err(|_| RuntimeError::Tool {
                tool: "space-agent".into(),
                message: format!(
                    "the build VM's agent did not dial in within {}s; console: {}",
                    CONNECT_TIMEOUT.as_secs(),
                    crate::process::console_tail(&vm.state_dir(), 600)
                ),
            })?;
        line(format!("==> microVM {id} runs {label}"));

        let mut env = env;
        if !env.iter().any(|(k, _)| k == "HOME") {
            env.push(("HOME".into(), "/root".into()));
        }
        let spawn = SpawnRequest {
            id: "step".into(),
            argv: vec!["/bin/sh".into(), "-c".into(), script],
            env,
            secrets: Vec::new(),
            cwd: Some(workdir),
            user: None,
            timeout_ms: None,
            stdin: false,
            pty: None,
        };
        let ran = tokio::time::timeout(limits.step_timeout, run(&conn, &spawn, output)).await;
        let exit = match ran {
            Err(_) => return Err(BuildStepError::TimedOut(limits.step_timeout)),
            Ok(r) => r.map_err(|e| agent_failed("running the step", &e))?,
        };
        if let Some(error) = &exit.error {
            return Err(BuildStepError::Failed {
                how: format!("could not start: {error}"),
                limit: None,
            });
        }
        if exit.exit_code != Some(0) {
            let how = match (exit.exit_code, exit.signal) {
                (Some(code), _) => format!("exited with code {code}"),
                (None, Some(sig)) => format!("ended with signal: {sig}"),
                (None, None) => "ended without an exit status".into(),
            };
            let limit = if exit.oom_killed {
                Some(StepLimit::Memory)
            } else if disk_full(&conn).await {
                Some(StepLimit::Disk)
            } else {
                None
            };
            return Err(BuildStepError::Failed { how, limit });
        }

        // What the step left, from the agent's archive of the guest's root.
        let (parent2, base2) = (parent.clone(), base.clone());
        let before = tokio::task::spawn_blocking(move || {
            crate::tree::apparent_size(&parent2).map_err(|e| io_err("measuring", &parent2, e))
        })
        .await
        .map_err(|e| RuntimeError::io("measuring the step", std::io::Error::other(e)))??;
        let max_bytes = before.saturating_add(limits.disk_bytes());
        let collected =
            tokio::time::timeout(COLLECT_TIMEOUT, collect(&conn, &rootfs, max_bytes)).await;
        match collected {
            Err(_) => {
                return Err(RuntimeError::Tool {
                    tool: "space-agent".into(),
                    message: format!(
                        "taking the step's files out of the VM took over {}s",
                        COLLECT_TIMEOUT.as_secs()
                    ),
                }
                .into())
            }
            Ok(Err(Collect::TooLarge)) => {
                return Err(BuildStepError::TooLarge {
                    grown_bytes: limits.disk_bytes().saturating_add(1),
                })
            }
            Ok(Err(Collect::Failed(e))) => return Err(e),
            Ok(Ok(())) => {}
        }
        drop(conn);
        vm.remove().await;
        let root = rootfs.clone();
        tokio::task::spawn_blocking(move || finish_layer(&root, &base2, &parent))
            .await
            .map_err(|e| RuntimeError::io("finishing the layer", std::io::Error::other(e)))??;
        // Holes count, as for gVisor's steps: every later copy of the layer may write them out.
        let after = tokio::task::spawn_blocking(move || crate::tree::apparent_size(&rootfs))
            .await
            .map_err(|e| RuntimeError::io("measuring the step", std::io::Error::other(e)))?
            .map_err(|e| BuildStepError::Unkeepable(e.to_string()))?;
        if after.saturating_sub(before) > limits.disk_bytes() {
            return Err(BuildStepError::TooLarge {
                grown_bytes: after - before,
            });
        }
        let _ = std::fs::remove_file(&image);
        Ok(())
    }

    /// Removes build VMs that a killed server left running, with their directories.
    pub(super) async fn remove_build_vms(&self) {
        let Ok(entries) = std::fs::read_dir(&self.cfg.state_root) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(id) = name.strip_prefix('.') else {
                continue;
            };
            if !id.starts_with(BUILD_PREFIX) || super::check_id(id).is_err() {
                continue;
            }
            tracing::warn!(vm = id, "removing a build VM left by an earlier run");
            if let Ok(vm) = BuildVm::existing(self.clone(), id) {
                vm.remove().await;
            }
        }
    }
}

/// Runs the step's command to its end: its output goes to `output` as it comes.
async fn run(
    conn: &AgentConn,
    spawn: &SpawnRequest,
    output: &(dyn Fn(&[u8]) + Send + Sync),
) -> Result<ExitStatus, AgentError> {
    conn.spawn(spawn).await?;
    let mut attach = conn.attach(&spawn.id, 0, 0).await?;
    // Host frames go through the sender (an `Attach` is not shared across an await).
    let host = attach.host_frames();
    let (mut stdout, mut stderr) = (0u64, 0u64);
    while let Some(frame) = attach.next_frame().await? {
        match frame {
            Frame::Stdout { data, .. } => {
                stdout += data.len() as u64;
                output(&data);
            }
            Frame::Stderr { data, .. } => {
                stderr += data.len() as u64;
                output(&data);
            }
            Frame::Exit(exit) => return Ok(exit),
            _ => continue,
        }
        // The agent keeps what is not acknowledged; tell it what arrived.
        if let Some(host) = &host {
            let _ = host.send(Frame::Ack { stdout, stderr }.to_bytes()).await;
        }
    }
    Err(AgentError::NotConnected)
}

/// Whether the guest's root filesystem is (nearly) full: `df -P /` in the VM.
async fn disk_full(conn: &AgentConn) -> bool {
    let probe = SpawnRequest {
        id: "df".into(),
        argv: vec!["df".into(), "-P".into(), "/".into()],
        env: vec![("PATH".into(), "/usr/sbin:/usr/bin:/sbin:/bin".into())],
        secrets: Vec::new(),
        cwd: None,
        user: None,
        timeout_ms: None,
        stdin: false,
        pty: None,
    };
    let out = std::sync::Mutex::new(Vec::new());
    let collect = |data: &[u8]| {
        let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
        if out.len() < 4096 {
            out.extend_from_slice(data);
        }
    };
    let Ok(Ok(exit)) = tokio::time::timeout(PROBE_TIMEOUT, run(conn, &probe, &collect)).await
    else {
        return false;
    };
    let text =
        String::from_utf8_lossy(&out.into_inner().unwrap_or_else(|e| e.into_inner())).into_owned();
    exit.exit_code == Some(0) && df_says_full(&text)
}

/// `df -P` output: the last line's fourth column, available KiB, under 1 MiB.
fn df_says_full(text: &str) -> bool {
    text.lines()
        .last()
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|kib| kib.parse::<u64>().ok())
        .is_some_and(|kib| kib < 1024)
}

/// Why the step's files could not be taken out.
enum Collect {
    /// More file data than the parent's plus the disk quota.
    TooLarge,
    Failed(BuildStepError),
}

/// Unpacks the agent's tar of the guest's root into `rootfs`, at most `max_bytes` of files.
async fn collect(conn: &AgentConn, rootfs: &Path, max_bytes: u64) -> Result<(), Collect> {
    let download = conn
        .download("/", DownloadFormat::Tar)
        .await
        .map_err(|e| Collect::Failed(agent_failed("packing the step's files", &e)))?;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, String>>(16);
    let root = rootfs.to_path_buf();
    let unpack = tokio::task::spawn_blocking(move || {
        let root = Root::open(&root)?;
        let limits = Limits {
            max_bytes,
            max_entries: MAX_ENTRIES,
            same_owner: true,
            skip_special: true,
            ..Limits::default()
        };
        root.unpack_tar(
            ChunkReader {
                rx,
                chunk: Bytes::new(),
            },
            &limits,
        )
    });
    let mut body = download.body;
    while let Some(chunk) = body.next().await {
        let failed = chunk.is_err();
        if tx.send(chunk.map_err(|e| e.to_string())).await.is_err() || failed {
            break;
        }
    }
    drop(tx);
    match unpack.await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(FsError::TooLarge(_))) => Err(Collect::TooLarge),
        Ok(Err(e)) => Err(Collect::Failed(BuildStepError::Unkeepable(e.message()))),
        Err(e) => Err(Collect::Failed(
            RuntimeError::io("unpacking the step's files", std::io::Error::other(e)).into(),
        )),
    }
}

/// A blocking reader over the chunks an async task sends it.
struct ChunkReader {
    rx: tokio::sync::mpsc::Receiver<Result<Bytes, String>>,
    chunk: Bytes,
}

impl Read for ChunkReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.chunk.is_empty() {
            match self.rx.blocking_recv() {
                Some(Ok(b)) => self.chunk = b,
                Some(Err(e)) => return Err(std::io::Error::other(e)),
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.chunk.len());
        buf[..n].copy_from_slice(&self.chunk[..n]);
        self.chunk.advance(n);
        Ok(n)
    }
}

/// What the guest's boot put on its root that a layer does not keep: `lost+found` (made
/// with the image) unless the parent had one, and `/tmp`, which gets the step's base's.
fn finish_layer(rootfs: &Path, base: &Path, parent: &Path) -> Result<(), BuildStepError> {
    let lost = rootfs.join("lost+found");
    if !parent.join("lost+found").exists() && lost.symlink_metadata().is_ok() {
        crate::tree::remove_tree(&lost).map_err(|e| io_err("removing", &lost, e))?;
    }
    let tmp = rootfs.join("tmp");
    if tmp.symlink_metadata().is_ok_and(|m| m.is_dir()) {
        crate::tree::remove_tree(&tmp).map_err(|e| io_err("removing", &tmp, e))?;
        let from = base.join("tmp");
        if from.symlink_metadata().is_ok_and(|m| m.is_dir()) {
            let out = std::process::Command::new("cp")
                .args(["-a", "--"])
                .arg(&from)
                .arg(&tmp)
                .output()
                .map_err(|e| io_err("copying", &from, e))?;
            if !out.status.success() {
                return Err(BuildStepError::Unkeepable(format!(
                    "copying /tmp: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )));
            }
        }
    }
    Ok(())
}

/// `cp -a` of a layer (never following a link) into a new directory.
async fn copy_tree(from: &Path, to: &Path) -> Result<(), RuntimeError> {
    std::fs::create_dir(to).map_err(|e| io_err("creating", to, e))?;
    run_tool(
        "cp",
        Command::new("cp")
            .args(["-a", "--"])
            .arg(from.join("."))
            .arg(to),
    )
    .await
    .map(drop)
}

fn agent_failed(what: &str, e: &AgentError) -> BuildStepError {
    RuntimeError::Tool {
        tool: "space-agent".into(),
        message: format!("{what}: {e}"),
    }
    .into()
}

fn io_err(action: &str, path: &Path, e: std::io::Error) -> RuntimeError {
    RuntimeError::io(format!("{action} {}", path.display()), e)
}

fn random_hex(bytes: usize) -> Result<String, RuntimeError> {
    let mut random = vec![0u8; bytes];
    getrandom::getrandom(&mut random)
        .map_err(|e| RuntimeError::io("random", std::io::Error::other(e.to_string())))?;
    Ok(crate::template::hex(&random))
}

fn write_private(path: &Path, bytes: &[u8]) -> Result<(), RuntimeError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(bytes))
        .map_err(|e| io_err("writing", path, e))
}

/// Aborts a task when dropped (the build VM's listener).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A build VM's directory in the driver's state root (`.<id>/`, short enough for the
/// sockets in it): `vm/` is its state directory, `run/` holds the agent's socket and token.
/// Dropped without [`BuildVm::remove`], it kills QEMU's process group and removes all that.
struct BuildVm {
    rt: MicrovmRuntime,
    id: String,
    dir: PathBuf,
    armed: bool,
}

impl BuildVm {
    fn new(rt: MicrovmRuntime, id: &str) -> Result<BuildVm, RuntimeError> {
        let vm = BuildVm::existing(rt, id)?;
        for d in [vm.dir.clone(), vm.state_dir(), vm.run_dir()] {
            std::fs::create_dir(&d).map_err(|e| io_err("creating", &d, e))?;
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| io_err("restricting", &d, e))?;
        }
        Ok(vm)
    }

    fn existing(rt: MicrovmRuntime, id: &str) -> Result<BuildVm, RuntimeError> {
        super::check_id(id)?;
        let dir = rt.cfg.state_root.join(format!(".{id}"));
        Ok(BuildVm {
            rt,
            id: id.to_owned(),
            dir,
            armed: true,
        })
    }

    fn state_dir(&self) -> PathBuf {
        self.dir.join("vm")
    }

    fn run_dir(&self) -> PathBuf {
        self.dir.join("run")
    }

    /// Ends the VM (QMP `quit`, then SIGKILL) and removes its marker and directory.
    async fn remove(mut self) {
        self.armed = false;
        let state = self.state_dir();
        if let Err(e) = Runtime::destroy(&self.rt, &self.id, &state).await {
            tracing::warn!(vm = %self.id, error = %e, "removing a build VM");
        }
        let dir = self.dir.clone();
        let _ = tokio::task::spawn_blocking(move || {
            crate::disk::detach_below(&dir);
            crate::tree::remove_tree(&dir)
        })
        .await;
    }
}

impl Drop for BuildVm {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let state = self.state_dir();
        if let Some(pid) = super::qemu_pid(&state) {
            // SAFETY: plain kill(2) calls; QEMU leads its own process group.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
                libc::kill(pid, libc::SIGKILL);
            }
        }
        let _ = std::fs::remove_file(self.rt.cfg.state_root.join(&self.id));
        crate::disk::detach_below(&self.dir);
        let _ = crate::tree::remove_tree(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn df_output_is_read_for_free_space() {
        let full = "Filesystem 1024-blocks Used Available Capacity Mounted on\n\
                    /dev/root 100000 99600 400 100% /\n";
        let roomy = "Filesystem 1024-blocks Used Available Capacity Mounted on\n\
                     /dev/root 100000 50000 50000 50% /\n";
        assert!(df_says_full(full));
        assert!(!df_says_full(roomy));
        assert!(!df_says_full(""));
        assert!(!df_says_full("garbage\nmore garbage"));
    }
}
