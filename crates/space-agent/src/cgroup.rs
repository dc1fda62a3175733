//! Commands run in cgroups of their own where the kernel lets us make them:
//! the microVM's guest, where the agent is the kernel's init.
//!
//! Why: `RLIMIT_NPROC` (the sandbox's `pids`) is not enforced for uid 0 by
//! Linux, so a root fork bomb in a microVM would run the guest out of memory,
//! and the guest's OOM killer could pick the agent. In the commands' cgroup
//! (`space-commands`), `pids.max` holds every command's tasks together, and
//! `memory.max` (the guest's memory less a reserve) makes a memory bomb an OOM
//! kill *inside* it, never of the agent, which stays outside (and has
//! `oom_score_adj` -1000).
//!
//! Each command gets a child of it, `space-commands/c<N>` ([`Group`]), which
//! everything the command starts stays in: `cgroup.kill` ends all of it in one
//! step (a fork bomb cannot outrun it, a double fork or `setsid` cannot leave
//! it), `cgroup.events` says when its last process is gone, and `memory.events`
//! counts the OOM kills among its processes.
//!
//! The hierarchy is mounted on `/sys/fs/cgroup` only while it is set up, then
//! detached: commands cannot mount it again (no `CAP_SYS_ADMIN`; in a user
//! namespace of their own, cgroup2 shows them only their own command's group),
//! so they cannot move out. The agent keeps descriptors of what it needs; each
//! command writes `0` to its group's `cgroup.procs` between fork and exec.
//!
//! Under gVisor the mount fails (its sandboxes lack `CAP_SYS_ADMIN`) and
//! nothing changes: there `RLIMIT_NPROC` holds for root as well, the host's
//! memory cgroup bounds the whole sandbox, and `tree` finds a command's
//! processes.

use std::ffi::{CStr, CString};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// Where the hierarchy is mounted while it is set up (the kernel provides the directory).
const MOUNT_POINT: &str = "/sys/fs/cgroup";
/// The commands' cgroup, below the root.
const GROUP: &str = "space-commands";
/// Where a command goes when a group of its own could not be made.
const SHARED: &str = "shared";
/// Memory kept out of the commands' reach for the agent and the kernel.
const RESERVE_MIB: u64 = 48;

/// The commands' cgroup, as a directory descriptor.
static COMMANDS: OnceLock<OwnedFd> = OnceLock::new();
/// `cgroup.procs` of the shared group, or -1.
static SHARED_PROCS: AtomicI32 = AtomicI32::new(-1);
static NEXT_GROUP: AtomicU64 = AtomicU64::new(1);
/// Groups of ended commands that still had processes (a command without a
/// timeout may leave daemons): removed once they are empty.
static LEFTOVERS: Mutex<Vec<CString>> = Mutex::new(Vec::new());
/// Groups made ahead of the commands that will take them, and the groups of
/// ended commands waiting to be removed: making and removing a cgroup with the
/// memory controller costs milliseconds in a TCG guest, so both happen on the
/// [`keeper`] thread, off the path from a spawn request to its exec.
static POOL: Mutex<Pool> = Mutex::new(Pool {
    ready: Vec::new(),
    ended: Vec::new(),
});
static POOL_WAKE: std::sync::Condvar = std::sync::Condvar::new();
/// How many groups the keeper keeps ready.
const READY_GROUPS: usize = 2;

struct Pool {
    ready: Vec<Group>,
    ended: Vec<CString>,
}

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
    let target = CString::new(MOUNT_POINT).map_err(|_| io::Error::other("NUL in a path"))?;
    let fstype = c"cgroup2";
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
    // Detached whatever happened: the descriptors (if any) keep what they need alive.
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
    std::fs::write(root.join("cgroup.subtree_control"), &enable)?;
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
    // The commands' own groups get the same controllers, so each has its
    // `memory.events` (its OOM kills); processes then live only in the leaves.
    std::fs::write(group.join("cgroup.subtree_control"), &enable)?;
    let shared = group.join(SHARED);
    match std::fs::create_dir(&shared) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let procs = std::fs::OpenOptions::new()
        .write(true)
        .open(shared.join("cgroup.procs"))?;
    let dir = std::fs::File::open(&group)?;
    // Kept open for the life of the agent.
    SHARED_PROCS.store(std::os::fd::IntoRawFd::into_raw_fd(procs), Ordering::SeqCst);
    let _ = COMMANDS.set(OwnedFd::from(dir));
    // The keeper sleeps while it has nothing to do, so it is no thread a
    // snapshot has to wait for.
    if let Err(e) = std::thread::Builder::new()
        .name("cgroups".into())
        .spawn(keeper)
    {
        note!("space-agent: no thread to make cgroups ahead ({e}); each spawn makes its own");
    }
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

/// In a child between fork and exec: joins the cgroup whose `cgroup.procs` is
/// `procs` (the shared one when it is -1, none where there are no cgroups) and
/// makes itself an ordinary OOM candidate again. Async-signal-safe.
pub fn enter(procs: RawFd) -> io::Result<()> {
    let fd = if procs >= 0 {
        procs
    } else {
        SHARED_PROCS.load(Ordering::Relaxed)
    };
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

/// The cgroup of one command.
#[derive(Debug)]
pub struct Group {
    name: CString,
    dir: OwnedFd,
    procs: OwnedFd,
}

fn open_at(dir: &OwnedFd, name: &CStr, flags: libc::c_int) -> io::Result<std::fs::File> {
    // SAFETY: a valid directory descriptor and C string; the new descriptor is ours.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just opened, owned by nobody else.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

fn read_at(dir: &OwnedFd, name: &CStr) -> io::Result<String> {
    let mut s = String::new();
    open_at(dir, name, libc::O_RDONLY)?.read_to_string(&mut s)?;
    Ok(s)
}

/// The value of `key` in a flat-keyed cgroup file (`populated 1`, `oom_kill 3`).
fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        if k == key {
            v.trim().parse().ok()
        } else {
            None
        }
    })
}

fn remove(name: &CStr) -> bool {
    let Some(parent) = COMMANDS.get() else {
        return true;
    };
    // SAFETY: a valid directory descriptor and C string.
    unsafe { libc::unlinkat(parent.as_raw_fd(), name.as_ptr(), libc::AT_REMOVEDIR) == 0 }
}

/// The keeper thread: keeps [`READY_GROUPS`] groups made, and removes the
/// groups of ended commands.
fn keeper() {
    loop {
        let (want, ended) = {
            let Ok(mut pool) = POOL.lock() else { return };
            while pool.ready.len() >= READY_GROUPS && pool.ended.is_empty() {
                pool = match POOL_WAKE.wait(pool) {
                    Ok(p) => p,
                    Err(_) => return,
                };
            }
            (
                READY_GROUPS.saturating_sub(pool.ready.len()),
                std::mem::take(&mut pool.ended),
            )
        };
        for name in ended {
            if !remove(&name) {
                if let Ok(mut left) = LEFTOVERS.lock() {
                    left.push(name);
                }
            }
        }
        // Groups that were left with processes are removed once those have ended.
        if let Ok(mut left) = LEFTOVERS.lock() {
            left.retain(|name| !remove(name));
        }
        let mut made = Vec::with_capacity(want);
        for _ in 0..want {
            match Group::make() {
                Some(g) => made.push(g),
                // Spawns make their own (and say why) until this works again.
                None => break,
            }
        }
        let short = made.len() < want;
        if let Ok(mut pool) = POOL.lock() {
            pool.ready.extend(made);
        }
        if short {
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
    }
}

impl Group {
    /// A new cgroup for one command; `None` where commands have no cgroups, or
    /// when it cannot be made (the command then joins the shared group, and its
    /// processes are found as under gVisor). Takes one the keeper made ahead
    /// when there is one.
    pub fn create() -> Option<Group> {
        COMMANDS.get()?;
        let ready = POOL.lock().ok().and_then(|mut pool| pool.ready.pop());
        POOL_WAKE.notify_one();
        ready.or_else(Group::make)
    }

    fn make() -> Option<Group> {
        let parent = COMMANDS.get()?;
        let n = NEXT_GROUP.fetch_add(1, Ordering::Relaxed);
        let name = CString::new(format!("c{n}")).ok()?;
        // SAFETY: a valid directory descriptor and C string.
        if unsafe { libc::mkdirat(parent.as_raw_fd(), name.as_ptr(), 0o755) } != 0 {
            note!(
                "space-agent: cannot make a cgroup for a command: {}",
                io::Error::last_os_error()
            );
            return None;
        }
        let made = (|| {
            let dir = OwnedFd::from(open_at(parent, &name, libc::O_RDONLY | libc::O_DIRECTORY)?);
            let procs = OwnedFd::from(open_at(&dir, c"cgroup.procs", libc::O_WRONLY)?);
            Ok::<_, io::Error>((dir, procs))
        })();
        match made {
            Ok((dir, procs)) => Some(Group { name, dir, procs }),
            Err(e) => {
                note!("space-agent: cannot open a command's cgroup: {e}");
                remove(&name);
                None
            }
        }
    }

    /// `cgroup.procs`, for [`enter`].
    pub fn procs_fd(&self) -> RawFd {
        self.procs.as_raw_fd()
    }

    /// SIGKILLs every process in the group, now and any forked meanwhile.
    pub fn kill(&self) -> io::Result<()> {
        open_at(&self.dir, c"cgroup.kill", libc::O_WRONLY)?.write_all(b"1")
    }

    /// Whether any process is left in the group (an unreadable file counts as
    /// empty: nothing could be waited for).
    pub fn populated(&self) -> bool {
        read_at(&self.dir, c"cgroup.events")
            .ok()
            .and_then(|t| keyed(&t, "populated"))
            .is_some_and(|n| n > 0)
    }

    /// How many of its processes the kernel's OOM killer ended.
    pub fn oom_kills(&self) -> u64 {
        read_at(&self.dir, c"memory.events")
            .ok()
            .and_then(|t| keyed(&t, "oom_kill"))
            .unwrap_or(0)
    }

    /// The processes in the group.
    pub fn pids(&self) -> Vec<i32> {
        read_at(&self.dir, c"cgroup.procs")
            .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    }

    /// Waits until the group has no process left (the kernel notifies changes of
    /// `cgroup.events` as priority data).
    pub async fn wait_empty(&self) {
        use tokio::io::unix::AsyncFd;
        use tokio::io::Interest;
        let Ok(file) = open_at(&self.dir, c"cgroup.events", libc::O_RDONLY) else {
            return;
        };
        // SAFETY: the File owns its descriptor, open and unchanged while the AsyncFd holds it.
        let Ok(events) = (unsafe { AsyncFd::register_with_interest(file, Interest::PRIORITY) })
        else {
            return;
        };
        loop {
            let mut buf = [0u8; 128];
            let text = match std::os::unix::fs::FileExt::read_at(events.get_ref(), &mut buf, 0) {
                Ok(n) => String::from_utf8_lossy(&buf[..n]).into_owned(),
                Err(_) => return,
            };
            if keyed(&text, "populated") != Some(1) {
                return;
            }
            match events.ready(Interest::PRIORITY).await {
                Ok(mut guard) => guard.clear_ready(),
                Err(_) => return,
            }
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // The keeper removes it later (a group is only removable once empty).
        if let Ok(mut pool) = POOL.lock() {
            pool.ended.push(self.name.clone());
            POOL_WAKE.notify_one();
            return;
        }
        if !remove(&self.name) {
            if let Ok(mut left) = LEFTOVERS.lock() {
                left.push(self.name.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_keyed_files() {
        assert_eq!(keyed("populated 1\nfrozen 0\n", "populated"), Some(1));
        assert_eq!(keyed("populated 0\nfrozen 0\n", "frozen"), Some(0));
        let events = "low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\noom_group_kill 0\n";
        assert_eq!(keyed(events, "oom_kill"), Some(2));
        assert_eq!(keyed(events, "oom"), Some(2));
        assert_eq!(keyed(events, "nope"), None);
        assert_eq!(keyed("populated x\n", "populated"), None);
    }
}
