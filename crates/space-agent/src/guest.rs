//! What the agent does first as the kernel's init in a microVM guest: it enters
//! the sandbox's root filesystem without taking the kernel's own root along, and
//! closes the kernel's usermode helpers.
//!
//! Why: a Linux kernel runs programs by path as root with every capability — the
//! modprobe helper for `request_module` (any unknown socket family, binary format or
//! device number makes one), `/sbin/request-key`, a `|` core_pattern, the uevent
//! helper, poweroff and reboot commands, cgroup v1 release agents, firmware files —
//! and it resolves those paths in the root of *its own* threads, which share one
//! `fs_struct` (`init_fs`) with PID 1 from boot. A `switch_root` (a chroot of PID 1)
//! moves that root too, into the sandbox's filesystem, where root can plant any of
//! those programs and get back everything the agent takes from commands.
//!
//! So PID 1 first gives itself an `fs_struct` of its own (`unshare(CLONE_FS)`, while
//! it is still one thread), then empties the initramfs, moves the sandbox's root
//! over it and chroots — into its own copy only. The kernel's threads keep the
//! initramfs root, now empty: whatever path a helper names, there is nothing there to
//! run, and nothing in the sandbox can reach it (the sandbox's root is mounted on top
//! of it, `..` stops there, and `/proc/<kernel thread>/root` needs more capabilities
//! than commands have). Then the helper settings are closed as well, for defence in
//! depth: an empty modprobe path (request_module does nothing), `modules_disabled`,
//! a plain core_pattern, no uevent helper, no poweroff command, and helpers' capability
//! bounding set emptied. `masks` then makes `/proc/sys` read-only.

use std::ffi::CString;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Why the guest could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    #[error("{step}")]
    Root {
        step: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("kernel setting {path}")]
    Setting {
        path: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("kernel setting {path} reads {got:?} after writing {want:?}")]
    Unchanged {
        path: &'static str,
        want: &'static str,
        got: String,
    },
}

fn c(path: &Path) -> Result<CString, GuestError> {
    CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| GuestError::Root {
        step: "a path holds NUL",
        source: io::ErrorKind::InvalidInput.into(),
    })
}

fn check(step: &'static str, rc: libc::c_int) -> Result<(), GuestError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(GuestError::Root {
            step,
            source: io::Error::last_os_error(),
        })
    }
}

/// Finishes the root `/init` mounted at `new_root`, in system calls where a shell would
/// start a process a step (each costs a TCG guest milliseconds of its boot): `/dev`,
/// `/proc` and `/sys` moved into it, a fresh `/dev/pts` and `/dev/shm`, the `/dev` links,
/// `/tmp` world-writable and sticky, the loopback interface up and the host name set.
/// Call as the guest's init, before [`enter_root`].
pub fn finish_root(new_root: &Path, hostname: &str) -> Result<(), GuestError> {
    for d in ["dev", "proc", "sys", "tmp"] {
        let dir = new_root.join(d);
        if !dir.is_dir() {
            std::fs::create_dir_all(&dir).map_err(|source| GuestError::Root {
                step: "create /dev, /proc, /sys or /tmp in the root filesystem",
                source,
            })?;
        }
    }
    // Best effort, as before: a root whose /tmp cannot change keeps its mode.
    let _ = std::fs::set_permissions(
        new_root.join("tmp"),
        std::os::unix::fs::PermissionsExt::from_mode(0o1777),
    );
    for (from, step) in [
        ("/dev", "move /dev into the root"),
        ("/proc", "move /proc into the root"),
        ("/sys", "move /sys into the root"),
    ] {
        let to = new_root.join(&from[1..]);
        mount(Path::new(from), &to, None, libc::MS_MOVE, None, step)?;
    }
    let dev = new_root.join("dev");
    for d in ["pts", "shm"] {
        std::fs::create_dir_all(dev.join(d)).map_err(|source| GuestError::Root {
            step: "create /dev/pts or /dev/shm",
            source,
        })?;
    }
    mount(
        Path::new("devpts"),
        &dev.join("pts"),
        Some("devpts"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620,gid=5"),
        "mount /dev/pts",
    )?;
    mount(
        Path::new("shm"),
        &dev.join("shm"),
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        Some("mode=1777"),
        "mount /dev/shm",
    )?;
    for (name, target) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        let link = dev.join(name);
        // devtmpfs has a ptmx device of its own; the new instance's is the one to use.
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(target, &link).map_err(|source| GuestError::Root {
            step: "link /dev/ptmx, /dev/fd and /dev/std*",
            source,
        })?;
    }
    // Best effort, as before: a guest without them still runs commands.
    let _ = loopback_up();
    // SAFETY: a valid buffer of the length passed.
    let _ = unsafe { libc::sethostname(hostname.as_ptr().cast(), hostname.len()) };
    Ok(())
}

/// `mount(2)`, its failure named by `step`.
fn mount(
    source: &Path,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
    step: &'static str,
) -> Result<(), GuestError> {
    let source = c(source)?;
    let target = c(target)?;
    let text = |s: Option<&str>| {
        s.map(|s| {
            CString::new(s).map_err(|_| GuestError::Root {
                step,
                source: io::ErrorKind::InvalidInput.into(),
            })
        })
        .transpose()
    };
    let (fstype, data) = (text(fstype)?, text(data)?);
    // SAFETY: valid C strings or null; plain syscall.
    check(step, unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            flags,
            data.as_ref()
                .map_or(std::ptr::null(), |s| s.as_ptr().cast()),
        )
    })
}

/// Brings `lo` up, as `ip link set lo up` does.
fn loopback_up() -> io::Result<()> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: plain syscall; the descriptor is owned from here on.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ifreq is plain data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: a valid socket and ifreq for these requests.
    unsafe {
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) < 0 {
            return Err(io::Error::last_os_error());
        }
        req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Makes `new_root` (a mount point in the initramfs) the root of PID 1, and only
/// of PID 1 and what it starts. Call first thing in `main`, while the process
/// has one thread (a thread's `unshare(CLONE_FS)` would leave the others behind).
pub fn enter_root(new_root: &Path) -> Result<(), GuestError> {
    // SAFETY: plain syscall.
    check("unshare(CLONE_FS)", unsafe {
        libc::unshare(libc::CLONE_FS)
    })?;
    let target = c(new_root)?;
    // SAFETY: valid C string; plain syscall.
    check("chdir to the new root", unsafe {
        libc::chdir(target.as_ptr())
    })?;
    // What the initramfs held (busybox, modules, init) goes: the kernel's threads look
    // for helpers in this directory, and must find nothing there. Mount points (the
    // new root, and anything else on another device) are left alone.
    let root_dev = std::fs::symlink_metadata("/")
        .map_err(|source| GuestError::Root {
            step: "stat /",
            source,
        })?
        .dev();
    empty_dir(Path::new("/"), root_dev);
    // SAFETY: valid C strings; plain syscalls, as switch_root makes them.
    unsafe {
        check(
            "move the new root onto /",
            libc::mount(
                c".".as_ptr(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_MOVE,
                std::ptr::null(),
            ),
        )?;
        check("chroot into the new root", libc::chroot(c".".as_ptr()))?;
        check("chdir to /", libc::chdir(c"/".as_ptr()))?;
    }
    Ok(())
}

/// Removes everything below `dir` that is on device `dev` (not crossing mount points).
/// Best effort: what cannot be removed stays (and is reported).
fn empty_dir(dir: &Path, dev: u64) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.dev() != dev {
            continue;
        }
        let removed = if meta.is_dir() {
            empty_dir(&path, dev);
            std::fs::remove_dir(&path)
        } else {
            std::fs::remove_file(&path)
        };
        if let Err(e) = removed {
            // The new root's mount point is busy by design; anything else is worth a line.
            if e.raw_os_error() != Some(libc::EBUSY) {
                note!(
                    "space-agent: cannot remove {} from the initramfs: {e}",
                    path.display()
                );
            }
        }
    }
}

/// The kernel's helper settings and what the agent sets them to. A setting the
/// kernel does not have is skipped.
const HELPER_SETTINGS: &[(&str, &str)] = &[
    // request_module returns at once without running anything (Linux >= 5.8).
    ("/proc/sys/kernel/modprobe", ""),
    // No module can be loaded any more (one-way); the guest's are loaded by init.
    ("/proc/sys/kernel/modules_disabled", "1"),
    // Core dumps go to a file in the crashing process's directory, never to a pipe.
    ("/proc/sys/kernel/core_pattern", "core"),
    ("/proc/sys/kernel/hotplug", ""),
    ("/sys/kernel/uevent_helper", ""),
    ("/proc/sys/kernel/poweroff_cmd", ""),
    // Whatever helper still runs gets no capability at all.
    ("/proc/sys/kernel/usermodehelper/bset", "0 0"),
    ("/proc/sys/kernel/usermodehelper/inheritable", "0 0"),
    // No kexec of another kernel, no magic SysRq keys.
    ("/proc/sys/kernel/kexec_load_disabled", "1"),
    ("/proc/sys/kernel/sysrq", "0"),
];

/// Closes the kernel's usermode helpers (see the module doc) and checks each
/// setting reads back as written. Call as the guest's init, after [`enter_root`]
/// and before any command starts.
pub fn close_helpers() -> Result<(), GuestError> {
    for &(path, value) in HELPER_SETTINGS {
        // Never O_CREAT: a setting this kernel lacks is simply not there.
        let written = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .and_then(|mut f| std::io::Write::write_all(&mut f, format!("{value}\n").as_bytes()));
        match written {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(source) => return Err(GuestError::Setting { path, source }),
        }
        let got =
            std::fs::read_to_string(path).map_err(|source| GuestError::Setting { path, source })?;
        if normalise(&got) != normalise(value) {
            return Err(GuestError::Unchanged {
                path,
                want: value,
                got: got.trim_end().to_string(),
            });
        }
    }
    Ok(())
}

/// A setting's text as words (the kernel prints some with tabs, some with a newline).
fn normalise(s: &str) -> Vec<&str> {
    s.split_whitespace().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_compare_by_words() {
        assert_eq!(normalise("0\t0\n"), normalise("0 0"));
        assert_eq!(normalise("\n"), normalise(""));
        assert_ne!(normalise("|/tmp/x %p\n"), normalise("core"));
    }

    #[test]
    fn empties_a_tree_on_one_device_only() {
        let dir = std::env::temp_dir().join(format!("space-guest-test-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("a/b")).unwrap();
        std::fs::write(dir.join("a/b/f"), "x").unwrap();
        std::fs::write(dir.join("g"), "y").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.join("l")).unwrap();
        let dev = std::fs::symlink_metadata(&dir).unwrap().dev();
        empty_dir(&dir, dev);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        // Another device's files are left alone (nothing is removed at all here).
        std::fs::write(dir.join("h"), "z").unwrap();
        empty_dir(&dir, dev.wrapping_add(1));
        assert!(dir.join("h").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
