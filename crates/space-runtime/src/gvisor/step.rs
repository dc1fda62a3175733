//! Template build steps under gVisor: `runsc run --network=none --overlay2=none` on an OCI
//! bundle whose writable root is a disk of the step's own (a sparse ext4 image of the parent
//! layer's size plus the build's disk quota, mounted `nodev,nosuid` and filled with a copy of
//! the parent), with the build's limits (CPU quota, memory limit and a host pids cgroup under
//! `space-build/<id>`, `RLIMIT_NPROC`, a timeout). Its stdout and stderr come through pipes to
//! the caller's `output`. A guard kills and deletes the container on every path (error,
//! timeout, a dropped future). When the step has ended, its files may not have grown by more
//! than the disk quota (sparse files count at their full size); they are copied (`cp -a`,
//! never following a link) into the new layer, and the disk is unmounted and deleted.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use space_core::runtime::{BuildLimits, BuildStep, BuildStepError, RuntimeError, StepLimit};
use tokio::process::Command;

use super::GvisorRuntime;
use crate::process::run_tool;
use crate::tree::Dir;

/// The cgroup parent of build containers.
const BUILD_CGROUP: &str = "space-build";

impl GvisorRuntime {
    pub(super) async fn build_step(&self, step: BuildStep<'_>) -> Result<(), BuildStepError> {
        let output = step.output;
        let line = |l: String| output(format!("{l}\n").as_bytes());
        let step_root = step.work_dir.join("step");
        let disk = StepDisk::create(&step.work_dir, &step.parent, &step_root, step.limits).await?;
        if let Some(prepare) = step.prepare {
            let root = step_root.clone();
            tokio::task::spawn_blocking(move || prepare(&root))
                .await
                .map_err(|e| RuntimeError::io("preparing the step", std::io::Error::other(e)))?
                .map_err(BuildStepError::Prepare)?;
        }
        let bundle = step.work_dir.join("bundle");
        std::fs::create_dir(&bundle).map_err(|e| io_err("creating", &bundle, e))?;
        let mut random = [0u8; 8];
        getrandom::getrandom(&mut random)
            .map_err(|e| RuntimeError::io("random", std::io::Error::other(e.to_string())))?;
        let id = format!("spacebuild-{}", crate::template::hex(&random));
        let spec = step_spec(
            &step_root,
            &step.script,
            &step.env,
            &step.workdir,
            &step.limits,
            &id,
        );
        let config = bundle.join("config.json");
        fs::write(&config, spec.to_string()).map_err(|e| io_err("writing", &config, e))?;
        fs::create_dir_all(&self.build_root)
            .map_err(|e| io_err("creating", &self.build_root, e))?;

        let mut cmd = Command::new(&self.runsc);
        cmd.arg("--root")
            .arg(&self.build_root)
            .arg(format!("--platform={}", self.platform))
            .args(["--network=none", "--overlay2=none", "--cpu-num-from-quota"])
            .arg("run")
            .arg("--bundle")
            .arg(&bundle)
            .arg(&id)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let guard = Container {
            runsc: self.runsc.clone(),
            root: self.build_root.clone(),
            id: id.clone(),
        };
        // Made here, so runsc joins it and leaves it behind: its OOM count says afterwards
        // whether the host killed the step for memory.
        let memcg = memory_cgroup(&id);
        if let Some(dir) = &memcg {
            let _ = fs::create_dir_all(dir);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| RuntimeError::io(format!("running {}", self.runsc.display()), e))?;
        line(format!("==> container {id} runs {}", step.label));
        // The step's output reaches the caller's log, which caps it.
        let copy = |pipe: Option<Box<dyn tokio::io::AsyncRead + Unpin + Send>>| async move {
            use tokio::io::AsyncReadExt;
            let Some(mut pipe) = pipe else { return };
            let mut buf = vec![0u8; 1 << 20];
            while let Ok(n) = pipe.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                output(&buf[..n]);
            }
        };
        let out = child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn tokio::io::AsyncRead + Unpin + Send>);
        let err = child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn tokio::io::AsyncRead + Unpin + Send>);
        let limit = step.limits.step_timeout;
        let status = tokio::time::timeout(limit, async {
            let mut copying = std::pin::pin!(async { tokio::join!(copy(out), copy(err)) });
            let mut copied = false;
            let status = loop {
                tokio::select! {
                    s = child.wait() => break s,
                    _ = &mut copying, if !copied => copied = true,
                }
            };
            // What is still in the pipes; a process that kept them open does not hold the build.
            if !copied {
                let _ = tokio::time::timeout(Duration::from_secs(10), copying).await;
            }
            status
        })
        .await;
        let oom = memcg.as_deref().is_some_and(oom_kills);
        drop(guard); // kill + delete the container on every path (also when this future is dropped)
        let _ = fs::remove_dir_all(&bundle);
        let status = match status {
            Ok(s) => s.map_err(|e| RuntimeError::io("waiting for runsc", e))?,
            Err(_) => return Err(BuildStepError::TimedOut(limit)),
        };
        if !status.success() {
            let how = match status.code() {
                Some(code) => format!("exited with code {code}"),
                None => format!("ended with {status}"),
            };
            let limit = if oom {
                Some(StepLimit::Memory)
            } else if disk.is_full() {
                Some(StepLimit::Disk)
            } else {
                None
            };
            return Err(BuildStepError::Failed { how, limit });
        }
        // Holes count: a sparse file takes no room on the step's disk, but every later copy
        // of the layer (a snapshot of a sandbox, a microVM's disk image) may write it out.
        let (parent, root) = (step.parent.clone(), step_root.clone());
        let measured = tokio::task::spawn_blocking(move || {
            let before = crate::tree::apparent_size(&parent)
                .map_err(|e| BuildStepError::from(io_err("measuring", &parent, e)))?;
            let after = crate::tree::apparent_size(&root)
                .map_err(|e| BuildStepError::Unkeepable(e.to_string()))?;
            Ok::<_, BuildStepError>((before, after))
        })
        .await
        .map_err(|e| RuntimeError::io("measuring the step", std::io::Error::other(e)))??;
        let (before, after) = measured;
        if after.saturating_sub(before) > step.limits.disk_bytes() {
            return Err(BuildStepError::TooLarge {
                grown_bytes: after - before,
            });
        }
        // Nothing runs in the step's root any more: a plain copy that never follows a link
        // (cp -a) into the fresh layer directory.
        run_tool(
            "cp",
            Command::new("cp")
                .args(["-a", "--"])
                .arg(step_root.join("."))
                .arg(&step.rootfs),
        )
        .await?;
        disk.remove().await;
        Ok(())
    }

    /// Removes build containers that a killed server left running (and their cgroups).
    pub(super) async fn remove_stale_build_containers(&self) {
        if !self.build_root.exists() {
            return;
        }
        let runsc = |args: &[&str]| {
            let mut cmd = Command::new(&self.runsc);
            cmd.arg("--root").arg(&self.build_root).args(args);
            cmd.stdin(Stdio::null());
            cmd
        };
        let Ok(out) = runsc(&["list", "--quiet"]).output().await else {
            return;
        };
        for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            tracing::warn!(
                container = id,
                "removing a build container left by an earlier run"
            );
            let _ = runsc(&["delete", "--force", id]).output().await;
            remove_build_cgroups(id);
        }
    }
}

fn io_err(action: &str, path: &Path, e: std::io::Error) -> RuntimeError {
    RuntimeError::io(format!("{action} {}", path.display()), e)
}

/// The OCI spec of a build step: the step's disk as a writable root, root user, no network,
/// the build's CPU, memory and process limits.
fn step_spec(
    rootfs: &Path,
    script: &str,
    env: &[(String, String)],
    workdir: &str,
    limits: &BuildLimits,
    id: &str,
) -> serde_json::Value {
    let caps = super::DEFAULT_CAPS;
    let mut env: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    if !env.iter().any(|e| e.starts_with("HOME=")) {
        env.push("HOME=/root".to_owned());
    }
    let pids = limits.pids.max(16);
    serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": ["/bin/sh", "-c", script],
            "env": env,
            "cwd": workdir,
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            // gVisor enforces RLIMIT_NPROC for root without CAP_SYS_RESOURCE; a fork bomb
            // then fails its forks instead of crashing the sentry at the host's pids limit.
            "rlimits": [
                {"type": "RLIMIT_NOFILE", "hard": 1_048_576, "soft": 1_048_576},
                {"type": "RLIMIT_NPROC", "hard": pids, "soft": pids}
            ],
            "noNewPrivileges": false
        },
        "root": {"path": rootfs, "readonly": false},
        "hostname": "build",
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
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "nodev", "mode=1777", "size=65536k"]}
        ],
        "linux": {
            "namespaces": [
                {"type": "pid"}, {"type": "network"}, {"type": "ipc"},
                {"type": "uts"}, {"type": "mount"}
            ],
            "resources": {
                "cpu": {"quota": i64::from(limits.vcpus.max(1)) * 100_000, "period": 100_000},
                "memory": {"limit": limits.memory_mib.saturating_mul(1 << 20)},
                // A safety net for the sentry's own threads (see gvisor.rs).
                "pids": {"limit": pids.saturating_mul(4).saturating_add(256)}
            },
            "cgroupsPath": format!("/{BUILD_CGROUP}/{id}")
        }
    })
}

/// A build container: killed and deleted when dropped, whatever happened.
struct Container {
    runsc: PathBuf,
    root: PathBuf,
    id: String,
}

impl Drop for Container {
    fn drop(&mut self) {
        for args in [
            vec!["kill", self.id.as_str(), "KILL"],
            vec!["delete", "--force", self.id.as_str()],
        ] {
            let _ = std::process::Command::new(&self.runsc)
                .arg("--root")
                .arg(&self.root)
                .args(&args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        remove_build_cgroups(&self.id);
    }
}

/// The memory cgroup of build container `id` (cgroup v1 or v2), where it is mounted.
fn memory_cgroup(id: &str) -> Option<PathBuf> {
    let v1 = Path::new("/sys/fs/cgroup/memory");
    let base = if v1.is_dir() {
        v1.to_owned()
    } else if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        PathBuf::from("/sys/fs/cgroup")
    } else {
        return None;
    };
    Some(base.join(BUILD_CGROUP).join(id))
}

/// Whether the kernel killed a process of the memory cgroup `dir` for memory.
fn oom_kills(dir: &Path) -> bool {
    ["memory.oom_control", "memory.events"].iter().any(|f| {
        fs::read_to_string(dir.join(f)).is_ok_and(|t| {
            t.lines().any(|l| {
                l.strip_prefix("oom_kill ")
                    .and_then(|n| n.trim().parse::<u64>().ok())
                    .is_some_and(|n| n > 0)
            })
        })
    })
}

/// Removes the cgroup directories runsc may leave behind for build container `id`.
fn remove_build_cgroups(id: &str) {
    let Ok(controllers) = fs::read_dir("/sys/fs/cgroup") else {
        return;
    };
    for c in controllers.flatten() {
        let _ = fs::remove_dir(c.path().join(BUILD_CGROUP).join(id));
    }
}

/// The disk a build step writes to: a sparse ext4 image sized to the layer it starts from
/// plus the build's disk quota, mounted (nodev, nosuid) at the step's root, which starts as a
/// copy of the parent layer. Unmounted and deleted on every path.
struct StepDisk {
    image: PathBuf,
    mount_point: PathBuf,
    armed: bool,
}

impl StepDisk {
    async fn create(
        work_dir: &Path,
        parent: &Path,
        mount_point: &Path,
        limits: BuildLimits,
    ) -> Result<StepDisk, RuntimeError> {
        let image = work_dir.join("disk.img");
        let (parent2, image2) = (parent.to_owned(), image.clone());
        let inodes = tokio::task::spawn_blocking(move || {
            let (bytes, inodes) = usage(&parent2).map_err(|e| io_err("measuring", &parent2, e))?;
            let mib = (bytes >> 20) + limits.disk_mib;
            // Room for ext4 itself; inodes for what the parent has and a generous share of
            // the quota (one per 16 KiB).
            let size = (mib + (mib / 16).max(16)) << 20;
            File::create(&image2)
                .and_then(|f| f.set_len(size))
                .map_err(|e| io_err("creating", &image2, e))?;
            Ok::<_, RuntimeError>(inodes + (limits.disk_mib * 64).max(16_384))
        })
        .await
        .map_err(|e| RuntimeError::io("sizing the step's disk", std::io::Error::other(e)))??;
        let mut disk = StepDisk {
            image: image.clone(),
            mount_point: mount_point.to_owned(),
            armed: true,
        };
        let made = async {
            run_tool(
                "mkfs.ext4",
                Command::new("mkfs.ext4")
                    .args(["-q", "-F", "-O", "^has_journal", "-m", "0", "-N"])
                    .arg(inodes.to_string())
                    .args(["-E", "nodiscard,lazy_itable_init=1"])
                    .arg(&image),
            )
            .await?;
            fs::create_dir(mount_point).map_err(|e| io_err("creating", mount_point, e))?;
            crate::disk::mount_loop(&image, mount_point, libc::MS_NODEV | libc::MS_NOSUID).await?;
            // mkfs's lost+found would end up in the template.
            let lost = mount_point.join("lost+found");
            fs::remove_dir(&lost).map_err(|e| io_err("removing", &lost, e))?;
            run_tool(
                "cp",
                Command::new("cp")
                    .args(["-a", "--"])
                    .arg(parent.join("."))
                    .arg(mount_point),
            )
            .await
        }
        .await;
        if let Err(e) = made {
            disk.release();
            return Err(e);
        }
        Ok(disk)
    }

    /// Whether the step filled its disk.
    fn is_full(&self) -> bool {
        let Ok(path) = std::ffi::CString::new(self.mount_point.as_os_str().as_encoded_bytes())
        else {
            return false;
        };
        // SAFETY: a valid C string and a zeroed out-parameter of the right type.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
            return false;
        }
        st.f_bavail.saturating_mul(st.f_frsize) < 1 << 20 || st.f_favail == 0
    }

    async fn remove(mut self) {
        let _ = tokio::task::spawn_blocking(move || self.release()).await;
    }

    fn release(&mut self) {
        if !std::mem::take(&mut self.armed) {
            return;
        }
        crate::disk::detach_below(&self.mount_point);
        let _ = fs::remove_dir(&self.mount_point);
        let _ = fs::remove_file(&self.image);
    }
}

impl Drop for StepDisk {
    fn drop(&mut self) {
        self.release();
    }
}

/// Disk blocks (hard links counted once) and entries of a layer.
fn usage(rootfs: &Path) -> std::io::Result<(u64, u64)> {
    let dir = Dir::open(rootfs)?;
    let mut seen = std::collections::HashSet::new();
    let (mut bytes, mut entries) = (0u64, 1u64);
    dir.walk(&mut |_, st, _| {
        entries += 1;
        if seen.insert((st.st_dev, st.st_ino)) {
            bytes = bytes.saturating_add(st.st_blocks.max(0) as u64 * 512);
        }
        Ok(())
    })?;
    Ok((bytes, entries))
}
