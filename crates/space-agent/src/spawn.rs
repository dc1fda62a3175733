//! Turning a [`SpawnRequest`] into a running process: user, environment,
//! working directory, `PATH` lookup, terminal, and the child-side set-up (own
//! session, controlling terminal, default signals, the tag that `tree` finds
//! its processes by, dropped privileges) that std's `Command` does not do.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;

use space_agent::protocol::SpawnRequest;

use crate::command::Cmd;
use crate::reaper::Reaper;
use crate::{pty, tree, users};

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

    let mut c = std::process::Command::new(&program);
    c.arg0(argv0).args(&req.argv[1..]).env_clear().envs(env);
    let mut master = None;
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
        c.stdin(Stdio::from(a))
            .stdout(Stdio::from(b))
            .stderr(Stdio::from(slave));
        master = Some(m);
    } else {
        c.stdin(if req.stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
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

    // std changes uid/gid and the directory before pre_exec closures run, and
    // would leave supplementary groups empty; do all of it here instead, in order.
    // SAFETY: plain syscalls only; the closure allocates nothing.
    let (uid, gid) = (ident.uid, ident.gid);
    let tasks_limit = TASKS_LIMIT.load(std::sync::atomic::Ordering::Relaxed);
    let change_ident =
        unsafe { libc::geteuid() == 0 || libc::geteuid() != uid || libc::getegid() != gid };
    unsafe {
        c.pre_exec(move || {
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            // While still root: the cgroup's files are root's.
            crate::cgroup::enter(procs)?;
            // std has made the terminal our stdin by now; a session leader
            // without a controlling terminal takes it with this.
            if on_pty && libc::ioctl(0, libc::TIOCSCTTY, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            if let Some(tag) = tag {
                tree::apply_tag(tag);
            }
            let mut set = std::mem::MaybeUninit::<libc::sigset_t>::zeroed();
            libc::sigemptyset(set.as_mut_ptr());
            libc::pthread_sigmask(libc::SIG_SETMASK, set.as_ptr(), std::ptr::null_mut());
            for sig in 1..=64 {
                if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                    // Fails harmlessly for the signals libc reserves.
                    libc::signal(sig, libc::SIG_DFL);
                }
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
                let groups = [gid];
                if libc::setgroups(1, groups.as_ptr()) != 0
                    || libc::setgid(gid) != 0
                    || libc::setuid(uid) != 0
                {
                    return Err(io::Error::last_os_error());
                }
            }
            if libc::chdir(cwd_c.as_ptr()) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }

    // `c` holds our copies of the terminal's slave until this returns: the
    // master reads EIO once only the command and its children have it open.
    match reaper.spawn(&mut c, cmd) {
        Ok(mut child) => Outcome::Started {
            pid: child.id(),
            stdin: child.stdin.take().map(OwnedFd::from),
            stdout: child.stdout.take().map(OwnedFd::from),
            stderr: child.stderr.take().map(OwnedFd::from),
            pty: master,
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => failed(NOT_FOUND, describe(&e)),
        Err(e) => failed(CANNOT_RUN, describe(&e)),
    }
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

/// In a child before `exec`: takes all but [`KEPT_CAPABILITIES`] out of the bounding set (so no
/// file capability or setuid-root binary brings them back), empties the inheritable and
/// ambient sets (which `exec` of a root program would otherwise add back in). A capability
/// that is in the bounding set and cannot be dropped fails the command rather than leaving
/// it with more than it should have. Allocation-free.
fn drop_capabilities() -> io::Result<()> {
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
    // SAFETY: as above. EINVAL: a kernel without ambient capabilities has none to clear.
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
