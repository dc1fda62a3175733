//! What the host lends a sandbox: made so that the sandbox cannot write to any of it by any
//! route, and so that no host path is lent to two sandboxes.
//!
//! gVisor reaches host files only through the paths of its OCI spec (the root and the bind
//! mounts) and `--overlay2`'s directory. A read-only flag in the spec lives inside the
//! sandbox, where root in a new user namespace lifts it (`unshare -Urm` then `mount -o
//! remount,rw`), and the gofer then writes for it. So every host path handed to runsc is a
//! read-only bind mount made by the host, in the host's mount namespace, of a path that
//! belongs to this sandbox alone; the host kernel refuses every write through it (`EROFS`),
//! whatever the sandbox's own mount table says and whichever process (gofer or sentry) tries:
//!
//! ```text
//! <state_dir>/agent/space-agent  this sandbox's own copy of the agent: no inode, and so no
//!                                page cache, is shared with another sandbox
//! <state_dir>/ro/bin             read-only bind of agent/             -> /.space/bin
//! <state_dir>/ro/run             read-only bind of the run directory  -> /.space/run
//! <state_dir>/ro/root            read-only bind of the template root  -> / (under the overlay)
//! <state_dir>/log/               a tmpfs of LOG_BYTES: console.log (and QEMU's qemu.log)
//! <state_dir>/lent.json          where root and run came from, for a restore
//! ```
//!
//! The host keeps writable paths of its own where it needs them (the run directory, where it
//! binds the agent's socket and writes and deletes the token).
//!
//! The logs: whatever a sandbox can print to (the agent's stdout and stderr under gVisor, the
//! serial console of a microVM) goes to a file on a small tmpfs of the sandbox's own, so that
//! guest root writing to it forever fills `LOG_BYTES` of memory and nothing of the host's disk.
//!
//! Mounts outlive the process: [`crate::disk::unmount_below`] of the state directory removes
//! them on stop, checkpoint and destroy and after a crash; [`lend`] and [`relend`] make them
//! on create and restore.

use std::io;
use std::path::{Path, PathBuf};

use space_core::runtime::RuntimeError;

use crate::disk::{sys_mount, umount};

/// The agent's file name, in the server's agent directory and in a sandbox's copy of it.
pub const AGENT_FILE: &str = "space-agent";
/// A sandbox's copy of the agent directory, in its state directory.
pub const AGENT_DIR: &str = "agent";
/// The read-only binds handed to the runtime, in the state directory.
pub const RO_DIR: &str = "ro";
/// The sandbox's log tmpfs, in the state directory.
pub const LOG_DIR: &str = "log";
/// Size of the log tmpfs: room for a boot's messages and a failure's last words.
pub const LOG_BYTES: u64 = 1 << 20;
/// Where `lend` wrote down its sources.
const RECORD_FILE: &str = "lent.json";

/// The read-only paths a runtime hands to its sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lent {
    /// The sandbox's copy of the agent directory (`/.space/bin`).
    pub bin: PathBuf,
    /// The run directory (`/.space/run`: the agent's socket, and its token until the host
    /// deletes it).
    pub run: PathBuf,
    /// The template's root directory.
    pub root: PathBuf,
}

impl Lent {
    /// Where the binds of the sandbox of `state_dir` are.
    pub fn at(state_dir: &Path) -> Lent {
        let ro = state_dir.join(RO_DIR);
        Lent {
            bin: ro.join("bin"),
            run: ro.join("run"),
            root: ro.join("root"),
        }
    }
}

/// The sources of a sandbox's binds, kept for its restore.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Record {
    rootfs: PathBuf,
    run_dir: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum LendError {
    #[error("copying the agent from {0}")]
    CopyAgent(PathBuf, #[source] io::Error),
    #[error("writing {0}")]
    Record(PathBuf, #[source] io::Error),
    #[error("reading {0} (a sandbox suspended by an older server cannot be resumed)")]
    ReadRecord(PathBuf, #[source] io::Error),
    #[error("bind-mounting {src} read-only at {dst}")]
    Bind {
        src: PathBuf,
        dst: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("mounting the log tmpfs at {0}")]
    Log(PathBuf, #[source] io::Error),
}

impl From<LendError> for RuntimeError {
    fn from(e: LendError) -> Self {
        let context = e.to_string();
        let source = match e {
            LendError::CopyAgent(_, s)
            | LendError::Record(_, s)
            | LendError::ReadRecord(_, s)
            | LendError::Bind { source: s, .. }
            | LendError::Log(_, s) => s,
        };
        RuntimeError::io(context, source)
    }
}

/// On create: copies the agent from `agent_dir` into the sandbox's state directory, writes
/// down the sources, and makes the read-only binds.
pub fn lend(
    state_dir: &Path,
    agent_dir: &Path,
    run_dir: &Path,
    rootfs: &Path,
) -> Result<Lent, LendError> {
    let copy = state_dir.join(AGENT_DIR);
    let src = agent_dir.join(AGENT_FILE);
    copy_agent(&src, &copy).map_err(|e| LendError::CopyAgent(src, e))?;
    let record = Record {
        rootfs: rootfs.to_path_buf(),
        run_dir: run_dir.to_path_buf(),
    };
    let path = state_dir.join(RECORD_FILE);
    write_atomic(&path, &serde_json::to_vec(&record).unwrap_or_default())
        .map_err(|e| LendError::Record(path, e))?;
    bind_all(state_dir, &record)
}

/// On restore: the read-only binds again, from what [`lend`] wrote down. The agent's copy is
/// the one the sandbox ran (and the checkpoint knows).
pub fn relend(state_dir: &Path) -> Result<Lent, LendError> {
    let path = state_dir.join(RECORD_FILE);
    let record: Record = std::fs::read(&path)
        .and_then(|b| serde_json::from_slice(&b).map_err(io::Error::other))
        .map_err(|e| LendError::ReadRecord(path, e))?;
    bind_all(state_dir, &record)
}

/// Makes the sandbox's copy of the agent durable (a suspended sandbox is restored with it,
/// possibly after a host crash).
pub fn sync_agent_copy(state_dir: &Path) -> io::Result<()> {
    std::fs::File::open(state_dir.join(AGENT_DIR).join(AGENT_FILE))?.sync_all()
}

fn bind_all(state_dir: &Path, record: &Record) -> Result<Lent, LendError> {
    let lent = Lent::at(state_dir);
    let flags = libc::MS_NOSUID | libc::MS_NODEV;
    // The agent and the root hold what the sandbox executes: no MS_NOEXEC there.
    for (src, dst, extra) in [
        (state_dir.join(AGENT_DIR), &lent.bin, 0),
        (record.run_dir.clone(), &lent.run, libc::MS_NOEXEC),
        (record.rootfs.clone(), &lent.root, 0),
    ] {
        bind_read_only(&src, dst, flags | extra).map_err(|source| LendError::Bind {
            src,
            dst: dst.clone(),
            source,
        })?;
    }
    Ok(lent)
}

/// Mounts the sandbox's log tmpfs (when it is not mounted yet) and returns its path.
pub fn mount_log(state_dir: &Path) -> Result<PathBuf, LendError> {
    let dir = state_dir.join(LOG_DIR);
    let made = (|| {
        std::fs::create_dir_all(&dir)?;
        if crate::disk::is_mounted(&dir) {
            return Ok(());
        }
        let options = format!("size={LOG_BYTES},nr_inodes=16,mode=0700");
        sys_mount(
            Some(Path::new("space-log")),
            &dir,
            Some("tmpfs"),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            Some(&options),
        )
    })();
    made.map_err(|e| LendError::Log(dir.clone(), e))?;
    Ok(dir)
}

/// `dst` becomes a read-only view of `src` (with `flags`), in the host's mount table. A
/// mount already at `dst` (left by a crash) goes first, so that what is there is known.
fn bind_read_only(src: &Path, dst: &Path, flags: libc::c_ulong) -> io::Result<()> {
    std::fs::create_dir_all(dst)?;
    while crate::disk::is_mounted(dst) {
        umount(dst, libc::MNT_DETACH)?;
    }
    // Not recursive: nothing mounted below `src` is lent.
    sys_mount(Some(src), dst, None, libc::MS_BIND, None)?;
    // A bind takes its flags from a remount of the new mount alone.
    let ro = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | flags;
    if let Err(e) = sys_mount(None, dst, None, ro, None) {
        let _ = umount(dst, libc::MNT_DETACH);
        return Err(e);
    }
    Ok(())
}

/// Copies the agent binary into `dir` (a new file, renamed into place).
fn copy_agent(src: &Path, dir: &Path) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let dst = dir.join(AGENT_FILE);
    let tmp = dir.join(format!(".{AGENT_FILE}.tmp"));
    let _ = std::fs::remove_file(&tmp);
    std::fs::copy(src, &tmp)?;
    std::fs::rename(&tmp, &dst)
}

fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> bool {
        // SAFETY: plain syscall.
        unsafe { libc::geteuid() == 0 }
    }

    #[test]
    fn lent_paths_are_read_only_binds_of_the_sandboxes_own_copies() {
        if !root() {
            eprintln!("skipping: mounts need root");
            return;
        }
        let base = std::env::temp_dir().join(format!("space-lend-{}", std::process::id()));
        let (agents, run, rootfs, state) = (
            base.join("agents"),
            base.join("state/run"),
            base.join("rootfs"),
            base.join("state"),
        );
        for d in [&agents, &run, &rootfs] {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::write(agents.join(AGENT_FILE), b"agent").unwrap();
        std::fs::write(rootfs.join("file"), b"root").unwrap();

        let lent = lend(&state, &agents, &run, &rootfs).unwrap();
        let log = mount_log(&state).unwrap();
        assert_eq!(std::fs::read(lent.bin.join(AGENT_FILE)).unwrap(), b"agent");
        // The host writes through its own path and the sandbox's view shows it.
        std::fs::write(run.join("token"), b"t").unwrap();
        assert_eq!(std::fs::read(lent.run.join("token")).unwrap(), b"t");
        for p in [
            lent.bin.join(AGENT_FILE),
            lent.bin.join("new"),
            lent.run.join("new"),
            lent.root.join("file"),
        ] {
            let e = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(&p)
                .unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{}", p.display());
        }
        // Not the server's agent: a copy of its own.
        use std::os::unix::fs::MetadataExt;
        let ino = |p: &Path| std::fs::metadata(p).unwrap().ino();
        assert_ne!(
            ino(&agents.join(AGENT_FILE)),
            ino(&lent.bin.join(AGENT_FILE))
        );
        // The log is bounded.
        let big = vec![0u8; 2 * LOG_BYTES as usize];
        let e = std::fs::write(log.join("console.log"), &big).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));

        // A restore binds again from the record.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(crate::disk::unmount_below(&state)).unwrap();
        assert!(!crate::disk::is_mounted(&lent.bin));
        assert!(!crate::disk::is_mounted(&log));
        assert_eq!(relend(&state).unwrap(), lent);
        assert_eq!(std::fs::read(lent.root.join("file")).unwrap(), b"root");
        rt.block_on(crate::disk::unmount_below(&state)).unwrap();
        for p in [&lent.bin, &lent.run, &lent.root] {
            assert!(!crate::disk::is_mounted(p));
        }
        std::fs::remove_dir_all(&base).unwrap();
    }
}
