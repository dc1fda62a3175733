//! Turning a [`SpawnRequest`] into a running process: user, environment,
//! working directory, `PATH` lookup, terminal, and the child-side set-up (own
//! session, controlling terminal, default signals, the tag that `tree` finds
//! its processes by, dropped privileges) that std's `Command` does not do.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use space_agent::protocol::SpawnRequest;

use crate::command::Cmd;
use crate::reaper::Reaper;
use crate::{pty, tree, users, vfork};

/// `TERM` of a command on a terminal when its environment has none.
const DEFAULT_TERM: &str = "xterm-256color";

/// `PATH` when the request's environment has none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Exit code of a command whose program was not found.
const NOT_FOUND: i32 = 127;

/// Most tasks (processes and threads) per user that commands may have; 0 = no limit.
/// Enforced inside the sandbox with RLIMIT_NPROC, which fails `fork` with EAGAIN,
/// rather than with the host's pids cgroup, whose limit would crash the sandbox kernel.
static TASKS_LIMIT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Sets the limit applied to every command started from now on.
pub fn set_tasks_limit(limit: u64) {
    TASKS_LIMIT.store(limit, std::sync::atomic::Ordering::Relaxed);
}

/// The limit set by [`set_tasks_limit`] (0: none).
pub fn tasks_limit() -> u64 {
    TASKS_LIMIT.load(std::sync::atomic::Ordering::Relaxed)
}
/// Exit code of a command whose program could not be run for another reason.
const CANNOT_RUN: i32 = 126;

/// What came of a spawn.
#[derive(Debug)]
pub enum Outcome {
    Started {
        pid: u32,
        stdin: Option<OwnedFd>,
        stdout: Option<OwnedFd>,
        stderr: Option<OwnedFd>,
        /// The terminal's master, for a command on a terminal (which has no pipes).
        pty: Option<OwnedFd>,
    },
    /// The program could not be started; the command ends with `code`.
    Failed { code: i32, reason: String },
}

fn failed(code: i32, reason: impl Into<String>) -> Outcome {
    Outcome::Failed {
        code,
        reason: reason.into(),
    }
}

/// An OS error as its plain description, without std's "(os error N)".
pub fn describe(e: &io::Error) -> String {
    let s = e.to_string();
    match e.raw_os_error() {
        Some(n) => s
            .strip_suffix(&format!(" (os error {n})"))
            .map(str::to_string)
            .unwrap_or(s),
        None => s,
    }
}

/// Where `argv0` is, as `execve` would find it: a path with a `/` as given
/// (relative to `cwd`), otherwise the first executable file of that name in `path`.
fn find_program(argv0: &str, path: &str, cwd: &Path) -> Result<PathBuf, (i32, String)> {
    if argv0.contains('/') {
        let p = cwd.join(argv0);
        return match std::fs::metadata(&p) {
            Ok(_) => Ok(p),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Err((NOT_FOUND, describe(&e))),
            // Let exec report anything else precisely.
            Err(_) => Ok(p),
        };
    }
    let mut denied = false;
    for dir in path.split(':') {
        let dir = if dir.is_empty() { "." } else { dir };
        let candidate = cwd.join(dir).join(argv0);
        match std::fs::metadata(&candidate) {
            Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => return Ok(candidate),
            Ok(m) if m.is_file() => denied = true,
            _ => {}
        }
    }
    if denied {
        Err((CANNOT_RUN, "Permission denied".into()))
    } else {
        Err((NOT_FOUND, "command not found".into()))
    }
}

/// Starts the process for `cmd`. Blocking (reads files, forks): run it off the runtime.
pub fn start(reaper: &Reaper, cmd: &Arc<Cmd>, req: &SpawnRequest) -> Outcome {
    let ident = match users::lookup(req.user.as_deref()) {
        Ok(i) => i,
        Err(reason) => return failed(CANNOT_RUN, reason),
    };

    // Secrets last: the command's environment takes the last value of a name.
    let mut env = req.env.clone();
    env.extend(req.secrets.iter().cloned());
    if !env.iter().any(|(k, _)| k == "HOME") {
        env.push(("HOME".into(), ident.home.clone()));
    }
    if req.pty.is_some() && !env.iter().any(|(k, _)| k == "TERM") {
        env.push(("TERM".into(), DEFAULT_TERM.into()));
    }
    let last = |name: &str| {
        env.iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let home = last("HOME").unwrap_or_else(|| ident.home.clone());
    let path = last("PATH").unwrap_or_else(|| DEFAULT_PATH.to_string());

    let cwd = match &req.cwd {
        Some(c) => {
            let p = Path::new("/").join(c);
            match std::fs::metadata(&p) {
                Ok(m) if m.is_dir() => p,
                Ok(_) => {
                    return failed(
                        CANNOT_RUN,
                        format!("working directory '{c}': Not a directory"),
                    )
                }
                Err(e) => {
                    return failed(
                        CANNOT_RUN,
                        format!("working directory '{c}': {}", describe(&e)),
                    )
                }
            }
        }
        None => {
            let h = Path::new("/").join(&home);
            if h.is_dir() {
                h
            } else {
                PathBuf::from("/")
            }
        }
    };
    let Ok(cwd_c) = CString::new(cwd.as_os_str().as_bytes()) else {
        return failed(CANNOT_RUN, "working directory contains NUL");
    };

    let argv0 = &req.argv[0];
    let program = match find_program(argv0, &path, &cwd) {
        Ok(p) => p,
        Err((code, reason)) => return failed(code, reason),
    };

    // Everything the child needs is made here, before the clone: it may not allocate.
    let Ok(program_c) = CString::new(program.as_os_str().as_bytes()) else {
        return failed(CANNOT_RUN, "the program's path contains NUL");
    };
    let Ok(argv) = vfork::cstrings(req.argv.iter().map(|a| a.as_bytes().to_vec())) else {
        return failed(CANNOT_RUN, "an argument contains NUL");
    };
    // One value per name, the last given (as std's `Command::envs` does), sorted.
    let env: std::collections::BTreeMap<&str, &str> =
        env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let Ok(envp) = vfork::cstrings(env.iter().map(|(k, v)| format!("{k}={v}").into_bytes())) else {
        return failed(CANNOT_RUN, "the environment contains NUL");
    };
    let (argv_p, envp_p) = (vfork::pointers(&argv), vfork::pointers(&envp));

    // The parent's ends, and the child's (closed here once it has them).
    let mut master = None;
    let (mut stdin, mut stdout, mut stderr) = (None, None, None);
    let child_ends: [OwnedFd; 3];
    if let Some(size) = req.pty {
        let (m, slave) = match pty::open(size) {
            Ok(pair) => pair,
            Err(e) => {
                return failed(
                    CANNOT_RUN,
                    format!("cannot open a terminal: {}", describe(&e)),
                )
            }
        };
        if ident.uid != 0 {
            // The user owns their terminal, as after a login; best effort, the
            // command has it open either way.
            // SAFETY: plain syscall on a descriptor we own.
            unsafe { libc::fchown(slave.as_raw_fd(), ident.uid, libc::gid_t::MAX) };
        }
        let (Ok(a), Ok(b)) = (slave.try_clone(), slave.try_clone()) else {
            return failed(CANNOT_RUN, "cannot open a terminal: out of descriptors");
        };
        child_ends = [a, b, slave];
        master = Some(m);
    } else {
        let made = (|| -> io::Result<[OwnedFd; 3]> {
            let input = if req.stdin {
                let (r, w) = pipe()?;
                stdin = Some(w);
                r
            } else {
                OwnedFd::from(std::fs::File::open("/dev/null")?)
            };
            let (r, w) = output_pipe()?;
            stdout = Some(r);
            let out = w;
            let (r, w) = output_pipe()?;
            stderr = Some(r);
            Ok([input, out, w])
        })();
        child_ends = match made {
            Ok(ends) => ends,
            Err(e) => return failed(CANNOT_RUN, format!("cannot make pipes: {}", describe(&e))),
        };
    }
    let on_pty = master.is_some();
    let tag = tree::new_tag();
    cmd.set_tag(tag);
    // Where commands get cgroups (a microVM), one of its own, which nothing it starts can leave.
    let procs = match crate::cgroup::Group::create() {
        Some(group) => {
            let fd = group.procs_fd();
            cmd.set_group(group);
            fd
        }
        None => -1,
    };

    // In the child, in order, after its descriptors are in place; plain syscalls only.
    let (uid, gid) = (ident.uid, ident.gid);
    let tasks_limit = TASKS_LIMIT.load(std::sync::atomic::Ordering::Relaxed);
    // SAFETY: plain syscalls.
    let change_ident =
        unsafe { libc::geteuid() == 0 || libc::geteuid() != uid || libc::getegid() != gid };
    let setup = move || -> io::Result<()> {
        // SAFETY: plain syscalls on values made before the clone; nothing allocates.
        unsafe {
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            // While still root: the cgroup's files are root's.
            crate::cgroup::enter(procs)?;
            // The terminal is our stdin by now; a session leader without a
            // controlling terminal takes it with this.
            if on_pty && libc::ioctl(0, libc::TIOCSCTTY, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            if let Some(tag) = tag {
                tree::apply_tag(tag);
            }
            if tasks_limit > 0 {
                let lim = libc::rlimit {
                    rlim_cur: tasks_limit,
                    rlim_max: tasks_limit,
                };
                if libc::setrlimit(libc::RLIMIT_NPROC, &lim) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            // Before the user change: dropping needs CAP_SETPCAP, which it takes away.
            drop_capabilities()?;
            if change_ident {
                // The system calls themselves, not libc's wrappers: those change every
                // thread of the process, which libc knows from the agent's memory (the
                // agent's threads, not this child's), signalling each of them in turn.
                // This child is one thread; the calls change it alone.
                let groups = [gid];
                if libc::syscall(libc::SYS_setgroups, 1, groups.as_ptr()) != 0
                    || libc::syscall(libc::SYS_setgid, gid) != 0
                    || libc::syscall(libc::SYS_setuid, uid) != 0
                {
                    return Err(io::Error::last_os_error());
                }
            }
            if libc::chdir(cwd_c.as_ptr()) != 0 {
                return Err(io::Error::last_os_error());
            }
            // Last: every handler is the default by now (see `vfork`).
            let mut set = std::mem::MaybeUninit::<libc::sigset_t>::zeroed();
            libc::sigemptyset(set.as_mut_ptr());
            libc::pthread_sigmask(libc::SIG_SETMASK, set.as_ptr(), std::ptr::null_mut());
            Ok(())
        }
    };
    let stdio = [
        child_ends[0].as_raw_fd(),
        child_ends[1].as_raw_fd(),
        child_ends[2].as_raw_fd(),
    ];
    let spawned = reaper.spawn_with(cmd, || {
        // SAFETY: `setup` only makes syscalls; the arrays and strings outlive the call.
        unsafe { vfork::spawn(&program_c, &argv_p, &envp_p, stdio, &setup) }
    });
    // Our copies of the child's ends go now: a pipe (or the terminal's master) reads
    // end of file or EIO once only the command and its children hold the other end.
    drop(child_ends);
    match spawned {
        Ok(pid) => Outcome::Started {
            pid,
            stdin,
            stdout,
            stderr,
            pty: master,
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => failed(NOT_FOUND, describe(&e)),
        Err(e) => failed(CANNOT_RUN, describe(&e)),
    }
}

/// What an output pipe holds: room for the output a busy command writes while the pump
/// gathers it (see `command::COALESCE`), so the writer does not stall meanwhile.
/// Linux's default limit for an unprivileged resize (`fs.pipe-max-size`).
const OUTPUT_PIPE_BYTES: i32 = 1 << 20;

/// A pipe for a command's output: [`pipe`], made [`OUTPUT_PIPE_BYTES`] large where the
/// kernel lets it (the default size otherwise; the pipe works either way).
fn output_pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let (r, w) = pipe()?;
    // SAFETY: fcntl on a descriptor owned here; a failure leaves the pipe as it was.
    unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, OUTPUT_PIPE_BYTES) };
    Ok((r, w))
}

/// A pipe, both ends close-on-exec: (read, write).
fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    use std::os::fd::FromRawFd;
    let mut fds = [0; 2];
    // SAFETY: plain syscall filling a two-element array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just made and are owned here.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// The only capabilities a command may have, even as root: the set a gVisor sandbox is
/// given (its OCI spec, the same as Docker's default), so a command can do the same on
/// both runtimes. What root commands commonly use stays: chown, file ownership and modes
/// (`CAP_DAC_OVERRIDE`, `CAP_FOWNER`, `CAP_FSETID`), setuid/setgid (apt-get's sandbox user,
/// su), binding low ports, chroot, mknod, raw sockets, kill. Everything else goes, notably
/// `CAP_SYS_PTRACE` (ptrace, `/proc/<pid>/mem`, `environ` and `fd` of a non-dumpable
/// process such as the agent), `CAP_SYS_ADMIN` (mounts — the commands' cgroup could be
/// remounted and left —, BPF, perf, and much else), `CAP_SYS_MODULE`, `CAP_SYS_RAWIO`
/// (`/dev/mem`, `/proc/kcore`, I/O ports), `CAP_SYS_BOOT` (`kexec_load`), `CAP_SYS_RESOURCE`
/// (raising the process limit's hard value), `CAP_NET_ADMIN`, `CAP_SYS_TIME`, `CAP_PERFMON`
/// and `CAP_BPF`. In a microVM the agent is the kernel's init with every capability, so
/// this is what keeps them from commands there.
pub const KEPT_CAPABILITIES: &[u32] = &[
    0,  // CAP_CHOWN
    1,  // CAP_DAC_OVERRIDE
    3,  // CAP_FOWNER
    4,  // CAP_FSETID
    5,  // CAP_KILL
    6,  // CAP_SETGID
    7,  // CAP_SETUID
    8,  // CAP_SETPCAP
    10, // CAP_NET_BIND_SERVICE
    13, // CAP_NET_RAW
    18, // CAP_SYS_CHROOT
    27, // CAP_MKNOD
    29, // CAP_AUDIT_WRITE
    31, // CAP_SETFCAP
];

/// The agent narrowed its own bounding set at start (see [`narrow_bounding_set`]): every
/// child inherits that, and skips the walk over every capability (two system calls each,
/// which gVisor makes costly, on every command).
static BOUNDING_NARROWED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Takes all but [`KEPT_CAPABILITIES`] out of this process's bounding set. Allocation-free.
fn narrow_bounding_set() -> io::Result<()> {
    for cap in 0u32..64 {
        if KEPT_CAPABILITIES.contains(&cap) {
            continue;
        }
        // SAFETY: plain prctl calls with integer arguments.
        let present = unsafe { libc::prctl(libc::PR_CAPBSET_READ, cap as libc::c_ulong, 0, 0, 0) };
        // < 0: past the last capability this kernel knows; nothing can hold those.
        if present < 0 {
            break;
        }
        if present == 1
            && unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) } != 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Narrows the agent's bounding set, for itself and every command it starts from now on.
/// The agent's own effective and permitted capabilities stay as they are (the bounding set
/// only limits what an `exec` can gain); its commands start with the narrow set already.
pub fn narrow_bounding_set_once() -> io::Result<()> {
    narrow_bounding_set()?;
    BOUNDING_NARROWED.store(true, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// In a child before `exec`: takes all but [`KEPT_CAPABILITIES`] out of the bounding set (so no
/// file capability or setuid-root binary brings them back), empties the inheritable and
/// ambient sets (which `exec` of a root program would otherwise add back in). A capability
/// that is in the bounding set and cannot be dropped fails the command rather than leaving
/// it with more than it should have. Allocation-free.
fn drop_capabilities() -> io::Result<()> {
    if !BOUNDING_NARROWED.load(std::sync::atomic::Ordering::Relaxed) {
        narrow_bounding_set()?;
    }
    // SAFETY: a plain prctl call. EINVAL: a kernel without ambient capabilities has none to clear.
    if unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    } != 0
        && io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL)
    {
        return Err(io::Error::last_os_error());
    }
    #[repr(C)]
    struct CapHeader {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct CapData {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    let mut header = CapHeader {
        version: VERSION_3,
        pid: 0,
    };
    let mut data = [CapData {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: header and two data structs, as capget/capset v3 expect.
    unsafe {
        if libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) != 0 {
            return Err(io::Error::last_os_error());
        }
        if data.iter().any(|d| d.inheritable != 0) {
            for d in data.iter_mut() {
                d.inheritable = 0;
            }
            if libc::syscall(libc::SYS_capset, &header, data.as_ptr()) != 0 {
                return Err(io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_programs_like_exec() {
        let root = Path::new("/");
        assert_eq!(
            find_program("sh", DEFAULT_PATH, root).map(|p| p.is_absolute()),
            Ok(true)
        );
        assert_eq!(
            find_program("no-such-program-xyz", DEFAULT_PATH, root).map_err(|e| e.0),
            Err(NOT_FOUND)
        );
        assert_eq!(
            find_program("/no/such/file", DEFAULT_PATH, root).map_err(|e| e.0),
            Err(NOT_FOUND)
        );
        // Not executable: found but refused.
        assert_eq!(
            find_program("passwd", "/etc", root).map_err(|e| e.0),
            Err(CANNOT_RUN)
        );
        assert_eq!(
            find_program("bin/sh", "", Path::new("/usr")).map(|p| p.is_absolute()),
            Ok(true)
        );
    }

    #[test]
    fn describes_os_errors_plainly() {
        let e = io::Error::from_raw_os_error(libc::ENOENT);
        assert_eq!(describe(&e), "No such file or directory");
    }
}
