//! Kernel knobs that commands must not turn, where the agent is the kernel's
//! init (the microVM guest): `/proc/sys`, `/sys` and a few `/proc` files become
//! read-only or masked, as container runtimes do. Commands cannot undo it
//! (remounting needs `CAP_SYS_ADMIN`, which they never have).
//!
//! Why it matters in a guest: root may write a sysctl without any capability,
//! and some sysctls hand the kernel a program to run as root with every
//! capability (`kernel.core_pattern` with a `|`, `kernel.modprobe`,
//! `/sys/kernel/uevent_helper`): a way back to what the agent took away.
//! `/proc/sysrq-trigger` would let any root command crash or reboot the guest.
//!
//! Under gVisor these mounts fail (no `CAP_SYS_ADMIN`) and nothing changes:
//! gVisor's own `/proc/sys` and `/sys` are not the host's and are read-only.

use std::ffi::CString;
use std::io;

/// Made read-only (bind-mounted onto themselves, then remounted).
const READ_ONLY: &[&str] = &[
    "/proc/sys",
    "/proc/sysrq-trigger",
    "/proc/irq",
    "/proc/bus",
    "/sys",
];
/// Hidden behind `/dev/null`.
const MASKED: &[&str] = &[
    "/proc/kcore",
    "/proc/timer_list",
    "/proc/sched_debug",
    "/proc/keys",
];

fn c(path: &str) -> CString {
    CString::new(path).expect("no NUL")
}

fn bind_read_only(path: &str) -> io::Result<()> {
    let p = c(path);
    // SAFETY: valid C strings; plain syscalls.
    unsafe {
        if libc::mount(
            p.as_ptr(),
            p.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND | libc::MS_REC,
            std::ptr::null(),
        ) != 0
        {
            return Err(io::Error::last_os_error());
        }
        let flags = libc::MS_BIND
            | libc::MS_REMOUNT
            | libc::MS_RDONLY
            | libc::MS_NOSUID
            | libc::MS_NODEV
            | libc::MS_NOEXEC;
        if libc::mount(
            std::ptr::null(),
            p.as_ptr(),
            std::ptr::null(),
            flags,
            std::ptr::null(),
        ) != 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

fn mask(path: &str) -> io::Result<()> {
    let (null, p) = (c("/dev/null"), c(path));
    // SAFETY: valid C strings; a plain syscall.
    if unsafe {
        libc::mount(
            null.as_ptr(),
            p.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    } != 0
    {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Applies the masks; what could not be done, one line each (a path that does
/// not exist on this kernel is skipped silently). Call once, as PID 1, before
/// any command starts.
pub fn apply() -> Vec<String> {
    let mut problems = Vec::new();
    for path in READ_ONLY {
        if std::path::Path::new(path).exists() {
            if let Err(e) = bind_read_only(path) {
                problems.push(format!("{path} read-only: {e}"));
            }
        }
    }
    for path in MASKED {
        if std::path::Path::new(path).exists() {
            if let Err(e) = mask(path) {
                problems.push(format!("{path} masked: {e}"));
            }
        }
    }
    problems
}
