//! `space doctor`: what this host can run, and what to fix. Local checks only
//! (no server needed); exit status 1 when something space needs is missing.

use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Level {
    Ok,
    Warn,
    Fail,
}

struct Report {
    worst: Level,
}

impl Report {
    fn line(&mut self, level: Level, what: &str, detail: impl AsRef<str>) {
        let tag = match level {
            Level::Ok => "ok  ",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        };
        println!("{tag}  {what:<12} {}", detail.as_ref());
        if level == Level::Fail || (level == Level::Warn && self.worst == Level::Ok) {
            self.worst = level;
        }
    }
}

/// First line of `cmd args…`'s output, if it runs.
fn first_line(cmd: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new(cmd).args(args).output().ok()?;
    let text = if out.stdout.is_empty() {
        out.stderr
    } else {
        out.stdout
    };
    String::from_utf8_lossy(&text)
        .lines()
        .next()
        .map(|l| l.trim().to_string())
}

fn on_path(name: &str) -> Option<PathBuf> {
    crate::which(Path::new(name))
}

/// Descriptors `space serve` wants: every sandbox, agent connection, stream and
/// client holds some.
pub const WANTED_NOFILE: u64 = 65_536;

/// Raises the soft `RLIMIT_NOFILE` to the hard one (and the hard one to
/// [`WANTED_NOFILE`] when it is lower and we may); returns (soft, hard) after.
pub fn raise_nofile() -> (u64, u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return (0, 0);
        }
        let want = lim.rlim_max.max(WANTED_NOFILE as libc::rlim_t);
        let raised = libc::rlimit {
            rlim_cur: want,
            rlim_max: want,
        };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) != 0 {
            let soft = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            libc::setrlimit(libc::RLIMIT_NOFILE, &soft);
        }
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
    }
    (lim.rlim_cur, lim.rlim_max)
}

/// Runs every check; returns the process exit code.
pub fn run(runsc: &Path, data_dir: &Path, guest_dir: &Path) -> i32 {
    let mut r = Report { worst: Level::Ok };

    // Open files: what `space serve` will be able to raise its limit to.
    let (soft, hard) = raise_nofile();
    if soft >= WANTED_NOFILE {
        r.line(
            Level::Ok,
            "nofile",
            format!("RLIMIT_NOFILE {soft} (hard {hard}): space serve raises its soft limit to this at start"),
        );
    } else {
        r.line(
            Level::Warn,
            "nofile",
            format!(
                "RLIMIT_NOFILE can only reach {soft} (hard {hard}); space serve wants {WANTED_NOFILE}: \
                 raise the hard limit (LimitNOFILE= in its systemd unit, or ulimit -Hn)"
            ),
        );
    }

    // gVisor.
    match first_line(runsc, &["--version"]) {
        Some(v) if v.starts_with("runsc version") => {
            let date = v.rsplit('~').next().unwrap_or("").get(..8).unwrap_or("");
            if date >= "20230101" {
                r.line(Level::Ok, "runsc", format!("{v} (systrap platform)"));
            } else {
                r.line(
                    Level::Warn,
                    "runsc",
                    format!("{v}: older than 2023, no systrap platform; install runsc from bookworm-backports (scripts/setup.sh)"),
                );
            }
        }
        _ => r.line(
            Level::Fail,
            "runsc",
            format!(
                "{} not found or not runnable: install runsc from bookworm-backports (scripts/setup.sh)",
                runsc.display()
            ),
        ),
    }

    // KVM, for the microVM runtime.
    let pvm = Path::new("/sys/module/kvm_pvm").exists();
    match (
        Path::new("/dev/kvm").exists(),
        pvm,
        space_runtime::microvm::kvm_usable(),
    ) {
        (_, _, Ok(())) => r.line(Level::Ok, "kvm", "usable: microVMs run with accel=kvm"),
        (true, true, _) => r.line(
            Level::Warn,
            "kvm",
            "nested PVM (kvm_pvm): standard guests do not run under it; microVMs use TCG, which is not a security boundary",
        ),
        (true, false, Err(why)) => r.line(
            Level::Warn,
            "kvm",
            format!("/dev/kvm is not usable ({why}); microVMs use TCG, which is not a security boundary"),
        ),
        (false, _, _) => r.line(
            Level::Warn,
            "kvm",
            "no /dev/kvm; microVMs use TCG, which is not a security boundary",
        ),
    }

    // QEMU and the guest.
    match on_path("qemu-system-x86_64") {
        Some(q) => r.line(
            Level::Ok,
            "qemu",
            first_line(&q, &["--version"]).unwrap_or_else(|| "found".into()),
        ),
        None => r.line(
            Level::Warn,
            "qemu",
            "qemu-system-x86_64 not found: the microvm runtime is unavailable (scripts/setup.sh installs it)",
        ),
    }
    let kernel = guest_dir.join(space_runtime::microvm::GUEST_KERNEL);
    if kernel.is_file() {
        let version =
            std::fs::read_to_string(guest_dir.join(space_runtime::microvm::GUEST_VERSION))
                .unwrap_or_default();
        r.line(
            Level::Ok,
            "guest",
            format!(
                "{} ({})",
                guest_dir.display(),
                version.split_whitespace().next().unwrap_or("?")
            ),
        );
    } else {
        r.line(
            Level::Warn,
            "guest",
            format!(
                "no guest kernel in {}: run scripts/build-guest.sh {}",
                guest_dir.display(),
                guest_dir.display()
            ),
        );
    }

    // cgroups: runsc needs cpu, memory and pids.
    let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    let controllers: Vec<String> = if v2 {
        std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_string)
            .collect()
    } else {
        std::fs::read_dir("/sys/fs/cgroup")
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    let missing: Vec<&str> = ["cpu", "memory", "pids"]
        .into_iter()
        .filter(|c| {
            !controllers
                .iter()
                .any(|x| x == c || x.split(',').any(|p| p == *c))
        })
        .collect();
    if missing.is_empty() {
        r.line(
            Level::Ok,
            "cgroups",
            format!("{} with cpu, memory, pids", if v2 { "v2" } else { "v1" }),
        );
    } else {
        r.line(
            Level::Fail,
            "cgroups",
            format!("missing controllers: {}", missing.join(", ")),
        );
    }

    // Disk quotas need loop devices and ext4 tools.
    if Path::new("/dev/loop-control").exists() && on_path("mkfs.ext4").is_some() {
        r.line(
            Level::Ok,
            "loop",
            "loop devices and mkfs.ext4: per-sandbox disk quotas work",
        );
    } else {
        r.line(
            Level::Fail,
            "loop",
            "no /dev/loop-control or mkfs.ext4: sandbox disk quotas cannot be mounted (install e2fsprogs; run on a host with loop devices)",
        );
    }
    let filesystems = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    let has = |fs: &str| {
        filesystems
            .lines()
            .any(|l| l.split_whitespace().last() == Some(fs))
    };
    r.line(
        if has("overlay") {
            Level::Ok
        } else {
            Level::Warn
        },
        "overlay",
        if has("overlay") {
            "overlayfs available"
        } else {
            "no overlayfs in this kernel"
        },
    );
    if has("btrfs") {
        r.line(Level::Ok, "btrfs", "available (not needed)");
    }
    r.line(
        if Path::new("/dev/net/tun").exists() {
            Level::Ok
        } else {
            Level::Warn
        },
        "tun",
        if Path::new("/dev/net/tun").exists() {
            "/dev/net/tun present"
        } else {
            "no /dev/net/tun: network modes other than none will not work"
        },
    );

    // Disk space where the data lives.
    let probe = std::iter::successors(Some(data_dir), |p| p.parent())
        .find(|p| p.exists())
        .unwrap_or(Path::new("/"));
    match free_bytes(probe) {
        Some(free) if free < 5 << 30 => r.line(
            Level::Warn,
            "disk",
            format!(
                "{} GiB free at {}: sandboxes, snapshots and templates need more",
                free >> 30,
                probe.display()
            ),
        ),
        Some(free) => r.line(
            Level::Ok,
            "disk",
            format!("{} GiB free at {}", free >> 30, probe.display()),
        ),
        None => r.line(
            Level::Warn,
            "disk",
            format!("cannot tell the free space at {}", probe.display()),
        ),
    }

    // Template tools.
    for (tool, why) in [
        (
            "mmdebstrap",
            "the debian template and debian:bookworm recipes",
        ),
        ("busybox", "the busybox template and the microVM initramfs"),
    ] {
        match on_path(tool) {
            Some(_) => r.line(Level::Ok, tool, format!("found ({why})")),
            None => r.line(
                Level::Warn,
                tool,
                format!("not found: needed for {why} (scripts/setup.sh)"),
            ),
        }
    }
    // Egress networking (network.mode "egress"): iptables with the nft backend, ip, sysctl.
    let missing: Vec<&str> = [
        "iptables",
        "iptables-restore",
        "ip6tables-restore",
        "ip",
        "sysctl",
    ]
    .into_iter()
    .filter(|t| on_path(t).is_none())
    .collect();
    if !missing.is_empty() {
        r.line(
            Level::Warn,
            "egress",
            format!(
                "{} not found: sandboxes with network.mode \"egress\" cannot start (scripts/setup.sh)",
                missing.join(", ")
            ),
        );
    } else {
        let v = first_line(Path::new("iptables"), &["--version"]).unwrap_or_default();
        let forward = std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward")
            .map(|s| s.trim() == "1")
            .unwrap_or(false);
        let note = if forward {
            "ip_forward is on"
        } else {
            "ip_forward is off; the first egress sandbox turns it on"
        };
        if v.contains("nf_tables") {
            r.line(Level::Ok, "egress", format!("{v}; {note}"));
        } else {
            r.line(
                Level::Warn,
                "egress",
                format!("{v}: the nf_tables backend is the one tested; {note}"),
            );
        }
    }
    if unsafe { libc::geteuid() } != 0 {
        r.line(
            Level::Fail,
            "root",
            "space serve needs root (runsc, cgroups, loop mounts)",
        );
    }

    match r.worst {
        Level::Fail => {
            println!("space doctor: something space needs is missing (FAIL above)");
            1
        }
        Level::Warn => {
            println!("space doctor: usable, with warnings");
            0
        }
        Level::Ok => {
            println!("space doctor: all good");
            0
        }
    }
}

fn free_bytes(path: &Path) -> Option<u64> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: a valid C string and a zeroed out-parameter of the right type.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}
