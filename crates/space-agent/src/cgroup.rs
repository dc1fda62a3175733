//! Commands run in a cgroup of their own where the kernel lets us make one:
//! the microVM's guest, where the agent is the kernel's init.
//!
//! Why: `RLIMIT_NPROC` (the sandbox's `pids`) is not enforced for uid 0 by
//! Linux, so a root fork bomb in a microVM would run the guest out of memory,
//! and the guest's OOM killer could pick the agent. In the cgroup, `pids.max`
//! holds every command's tasks together, and `memory.max` (the guest's memory
//! less a reserve) makes a memory bomb an OOM kill *inside* the cgroup, never
//! of the agent, which stays outside it (and has `oom_score_adj` -1000).
//!
//! The hierarchy is mounted on `/sys/fs/cgroup` only while it is set up, then
//! detached: commands cannot mount it again (no `CAP_SYS_ADMIN`), so they
//! cannot move themselves out. The agent keeps one open descriptor of the
//! cgroup's `cgroup.procs`; each command writes `0` to it between fork and exec.
//!
//! Under gVisor the mount fails (its sandboxes lack `CAP_SYS_ADMIN`) and
//! nothing changes: there `RLIMIT_NPROC` holds for root as well and the host's
//! memory cgroup bounds the whole sandbox.

use std::ffi::CString;
use std::io;
use std::sync::atomic::{AtomicI32, Ordering};

/// Where the hierarchy is mounted while it is set up (the kernel provides the directory).
const MOUNT_POINT: &str = "/sys/fs/cgroup";
/// The commands' cgroup, below the root.
const GROUP: &str = "space-commands";
/// Memory kept out of the commands' reach for the agent and the kernel.
const RESERVE_MIB: u64 = 48;

/// `cgroup.procs` of the commands' cgroup, or -1.
static PROCS: AtomicI32 = AtomicI32::new(-1);

/// What [`setup`] did, for the agent's log.
#[derive(Debug)]
pub enum Setup {
    Confined {
        pids: u64,
        memory_bytes: Option<u64>,
    },
    Unavailable(String),
}

/// Makes the commands' cgroup with `pids` tasks at most (0: no limit). Call once,
/// before any command starts.
pub fn setup(pids: u64) -> Setup {
    match try_setup(pids) {
        Ok(s) => s,
        Err(e) => Setup::Unavailable(e.to_string()),
    }
}

fn try_setup(pids: u64) -> io::Result<Setup> {
    let target = CString::new(MOUNT_POINT).expect("no NUL");
    let fstype = CString::new("cgroup2").expect("no NUL");
    // SAFETY: valid C strings; a plain syscall.
    let rc = unsafe {
        libc::mount(
            fstype.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let result = configure(pids);
    // Detached whatever happened: the descriptor (if any) keeps what it needs alive.
    // SAFETY: valid C string; a plain syscall.
    unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    result
}

fn configure(pids: u64) -> io::Result<Setup> {
    let root = std::path::Path::new(MOUNT_POINT);
    let controllers = std::fs::read_to_string(root.join("cgroup.controllers"))?;
    let has = |c: &str| controllers.split_whitespace().any(|x| x == c);
    if !has("pids") {
        return Err(io::Error::other("the kernel has no pids controller"));
    }
    let mut enable = String::from("+pids");
    if has("memory") {
        enable.push_str(" +memory");
    }
    std::fs::write(root.join("cgroup.subtree_control"), enable)?;
    let group = root.join(GROUP);
    match std::fs::create_dir(&group) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let max = if pids == 0 {
        "max".to_string()
    } else {
        pids.to_string()
    };
    std::fs::write(group.join("pids.max"), max)?;
    let memory_bytes = if has("memory") {
        match mem_total_bytes() {
            Some(total) if total > 2 * (RESERVE_MIB << 20) => {
                let limit = total - (RESERVE_MIB << 20);
                std::fs::write(group.join("memory.max"), limit.to_string())?;
                // Swap would only make a memory bomb slow instead of stopped.
                let _ = std::fs::write(group.join("memory.swap.max"), "0");
                Some(limit)
            }
            _ => None,
        }
    } else {
        None
    };
    let procs = CString::new(
        group
            .join("cgroup.procs")
            .into_os_string()
            .into_encoded_bytes(),
    )
    .map_err(|_| io::Error::other("NUL in a path"))?;
    // SAFETY: valid C string; the descriptor is ours from here on.
    let fd = unsafe { libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    PROCS.store(fd, Ordering::SeqCst);
    Ok(Setup::Confined { pids, memory_bytes })
}

fn mem_total_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Keeps the agent out of the OOM killer's choices (commands get 0 back in [`enter`]).
pub fn protect_agent() {
    let _ = std::fs::write("/proc/self/oom_score_adj", "-1000");
}

/// In a child between fork and exec: joins the commands' cgroup (if there is
/// one) and makes itself an ordinary OOM candidate again. Async-signal-safe.
pub fn enter() -> io::Result<()> {
    let fd = PROCS.load(Ordering::Relaxed);
    if fd >= 0 {
        // SAFETY: a descriptor we own; a static buffer.
        if unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) } != 1 {
            return Err(io::Error::last_os_error());
        }
    }
    // SAFETY: a static C string; plain syscalls.
    unsafe {
        let adj = libc::open(
            c"/proc/self/oom_score_adj".as_ptr(),
            libc::O_WRONLY | libc::O_CLOEXEC,
        );
        if adj >= 0 {
            libc::write(adj, b"0".as_ptr().cast(), 1);
            libc::close(adj);
        }
    }
    Ok(())
}
