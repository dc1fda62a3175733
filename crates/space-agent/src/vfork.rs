//! Starting a process without copying the agent's address space: `clone` with
//! `CLONE_VM | CLONE_VFORK`, as `posix_spawn` does. The child shares the agent's memory
//! and runs on a stack of its own until it calls `execve`; the calling thread waits
//! meanwhile. A plain `fork` of the multi-threaded agent copies its whole address space,
//! which gVisor does under one lock: concurrent commands then start one after another.
//!
//! The child only makes syscalls (no allocation, no lock), with every signal blocked
//! until it has put every handler the agent changed back to the default, so nothing of
//! the agent's runs in it. A failure before or at `execve` is handed back through shared
//! memory (the errno), the child exits, and the caller reaps it.
//!
//! Every system call costs a gVisor sandbox a trap into its kernel, and the child's are
//! on every command's path: it resets only the signals the agent changed
//! ([`changed_signals`]), not all 64.

use std::ffi::{c_int, c_void, CStr, CString};
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::OnceLock;

/// The child's stack. Set-up code only: syscalls and small frames.
const STACK: usize = 256 << 10;

/// What the child needs, in memory it shares with the caller.
struct Child<'a> {
    program: &'a CStr,
    argv: *const *const libc::c_char,
    /// `/bin/sh PROGRAM ARGS…`: what runs a file that is no executable format the
    /// kernel knows (a script without `#!`), as `execvp` and shells do.
    sh_argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    /// Descriptors that become the child's 0, 1 and 2 (`-1`: left as they are).
    stdio: [RawFd; 3],
    /// The child-side set-up (session, terminal, limits, identity, directory); only
    /// syscalls.
    setup: &'a (dyn Fn() -> io::Result<()> + Sync),
    /// The signals to put back to the default ([`changed_signals`]), a bit each.
    reset: u64,
    /// The errno of a failure in the child; 0 when it reached the new program.
    error: AtomicI32,
}

/// The signals whose disposition the agent changed (bit `sig - 1` for each): a
/// handler (which must not run in a child that shares the agent's memory) or "ignore"
/// (which `execve` would pass on: a command must get `SIGPIPE` as usual). Read once, at
/// the first spawn: the agent sets its dispositions at start (Rust's runtime ignores
/// `SIGPIPE` and handles `SIGSEGV` and `SIGBUS`, `main` asks tokio for `SIGCHLD` and
/// `SIGUSR1`) and changes none later. Should one be added later anyway, all it could do
/// is run in a child between the unblocking and the `execve`: tokio's handler only
/// records the signal and wakes the agent, which then finds nothing to do.
fn changed_signals() -> u64 {
    static CHANGED: OnceLock<u64> = OnceLock::new();
    *CHANGED.get_or_init(|| {
        let mut mask = 0u64;
        for sig in 1..=64 {
            let mut old = KernelSigaction::default();
            // SAFETY: reads the disposition only (no new action) into `old`.
            let read = unsafe { rt_sigaction(sig, std::ptr::null(), &mut old) };
            if read == 0 && old.handler != libc::SIG_DFL {
                mask |= 1 << (sig - 1);
            }
        }
        mask
    })
}

/// The kernel's `struct sigaction` (x86-64), for `rt_sigaction` itself: libc's
/// `sigaction` refuses the two signals it keeps for its threads (32 and 33), which a
/// parent may still have set to "ignore" for the agent to inherit.
#[repr(C)]
#[derive(Default)]
struct KernelSigaction {
    handler: libc::sighandler_t,
    flags: libc::c_ulong,
    restorer: usize,
    mask: u64,
}

/// `rt_sigaction(sig, new, old)`, the system call: 0 or -1 (errno set).
///
/// # Safety
/// `new` and `old` are null or valid.
unsafe fn rt_sigaction(sig: c_int, new: *const KernelSigaction, old: *mut KernelSigaction) -> i64 {
    // SAFETY: the caller's pointers; the size is the kernel's signal set's.
    unsafe { libc::syscall(libc::SYS_rt_sigaction, sig, new, old, 8usize) }
}

/// Starts `program` with `argv` and `envp` (each `NULL`-terminated arrays of C
/// strings), `stdio` as its standard descriptors, after `setup` has run in the child.
/// Its pid, or the error of the set-up or of `execve` (the failed child is reaped).
///
/// # Safety
/// `setup` must be async-signal-safe and allocation-free: it runs in a child that
/// shares the caller's memory, between `clone` and `execve`.
pub unsafe fn spawn(
    program: &CStr,
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
    stdio: [RawFd; 3],
    setup: &(dyn Fn() -> io::Result<()> + Sync),
) -> io::Result<u32> {
    debug_assert!(argv.last().is_some_and(|p| p.is_null()));
    debug_assert!(envp.last().is_some_and(|p| p.is_null()));
    let sh_argv: Vec<*const libc::c_char> = [c"/bin/sh".as_ptr(), program.as_ptr()]
        .into_iter()
        .chain(argv.iter().skip(1).copied())
        .collect();
    let child = Child {
        program,
        argv: argv.as_ptr(),
        sh_argv: sh_argv.as_ptr(),
        envp: envp.as_ptr(),
        stdio,
        setup,
        reset: changed_signals(),
        error: AtomicI32::new(0),
    };
    let mut stack = vec![0u8; STACK];
    // The stack grows down from its (16-byte aligned) top.
    let top = (stack.as_mut_ptr() as usize + STACK) & !15;
    let mut all = std::mem::MaybeUninit::<libc::sigset_t>::zeroed();
    let mut old = std::mem::MaybeUninit::<libc::sigset_t>::zeroed();
    // SAFETY: signal masks of this thread; a clone whose child runs `run_child` on its
    // own stack with `child`, both alive until it has exec'd or exited (CLONE_VFORK).
    let (pid, clone_error) = unsafe {
        // Every signal blocked across the clone: none may run an agent handler in the child.
        libc::sigfillset(all.as_mut_ptr());
        libc::pthread_sigmask(libc::SIG_SETMASK, all.as_ptr(), old.as_mut_ptr());
        let pid = libc::clone(
            run_child,
            top as *mut c_void,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            &child as *const Child<'_> as *mut c_void,
        );
        let clone_error = io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, old.as_ptr(), std::ptr::null_mut());
        (pid, clone_error)
    };
    drop(stack);
    if pid < 0 {
        return Err(clone_error);
    }
    match child.error.load(Ordering::SeqCst) {
        0 => Ok(pid as u32),
        errno => {
            let mut status = 0;
            // SAFETY: reaps our own child, which has exited.
            while unsafe { libc::waitpid(pid, &mut status, 0) } < 0
                && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)
            {}
            Err(io::Error::from_raw_os_error(errno))
        }
    }
}

extern "C" fn run_child(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the caller's `Child`, alive until this process execs or exits
    // (CLONE_VFORK holds the caller until then).
    let child = unsafe { &*(arg as *const Child<'_>) };
    let fail = |e: io::Error| -> c_int {
        child
            .error
            .store(e.raw_os_error().unwrap_or(libc::EINVAL), Ordering::SeqCst);
        // SAFETY: leaves without running anything of the caller's (no atexit, no flush).
        unsafe { libc::_exit(127) }
    };
    // SAFETY: plain syscalls on descriptors and memory the caller keeps alive.
    unsafe {
        // Handlers back to the default while everything is still blocked; the set-up
        // unblocks (its handlers were copied, not shared: no CLONE_SIGHAND).
        let default = KernelSigaction::default();
        for sig in 1..=64 {
            if child.reset & (1 << (sig - 1)) != 0 {
                rt_sigaction(sig, &default, std::ptr::null_mut());
            }
        }
        for (target, &fd) in child.stdio.iter().enumerate() {
            let target = target as c_int;
            if fd < 0 {
                continue;
            }
            if fd == target {
                // Already in place: only keep it across the exec.
                let flags = libc::fcntl(fd, libc::F_GETFD);
                if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                    return fail(io::Error::last_os_error());
                }
            } else if libc::dup2(fd, target) < 0 {
                return fail(io::Error::last_os_error());
            }
        }
        if let Err(e) = (child.setup)() {
            return fail(e);
        }
        libc::execve(child.program.as_ptr(), child.argv, child.envp);
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENOEXEC) {
            libc::execve(c"/bin/sh".as_ptr(), child.sh_argv, child.envp);
            // No shell to run it with: the original error says more.
        }
        fail(e)
    }
}

/// C strings of `items`, or the first that holds a NUL.
pub fn cstrings<I, S>(items: I) -> Result<Vec<CString>, S>
where
    I: IntoIterator<Item = S>,
    S: Into<Vec<u8>> + Clone,
{
    items
        .into_iter()
        .map(|s| CString::new(s.clone()).map_err(|_| s))
        .collect()
}

/// The `NULL`-terminated pointer array of `strings` (valid while they are).
pub fn pointers(strings: &[CString]) -> Vec<*const libc::c_char> {
    strings
        .iter()
        .map(|s| s.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect()
}
