//! Placing gVisor sandboxes on host CPUs.
//!
//! A sandbox with fewer vCPUs than the host has CPUs gets that many CPUs of its own in its
//! cpuset cgroup: the ones the fewest live sandboxes are placed on. Its CPU quota is the
//! same either way; what changes is where its threads run. The Sentry, the agent and a
//! command hand work to each other by waking threads, and a wake-up that crosses to another
//! CPU costs far more than one on the same CPU: on a nested-virtualisation host, where an idle
//! vCPU sleeps in the hypervisor, measured here, a 1-vCPU sandbox spent about 40 % less CPU
//! streaming a command's stdout and ran about 50 % more `true` commands a second once its
//! threads shared one CPU (`docs/RUNTIMES.md`).
//!
//! The placement is read back from the cgroups themselves (`cpuset.cpus` of every sandbox),
//! so it needs no state of its own, holds across a server restart and counts adopted and
//! restored sandboxes alike. A sandbox that is not placed (pinning off, or as many vCPUs as
//! the host has CPUs) counts on every CPU, which changes no choice.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Places sandboxes; cheap to clone (one lock for every clone).
#[derive(Debug, Clone)]
pub struct CpuPlacer {
    enabled: bool,
    /// The cgroup directory holding one directory per sandbox (cgroup v1's cpuset
    /// hierarchy, or the v2 unified one).
    parent: PathBuf,
    /// Held from reading the placement to writing a new one, so two sandboxes started at
    /// once do not both take the least used CPU.
    lock: Arc<Mutex<()>>,
}

impl CpuPlacer {
    /// `parent`: the sandboxes' cgroup parent's name (`space`).
    pub fn new(enabled: bool, parent: &str) -> Self {
        CpuPlacer::at(enabled, cpuset_parent(parent))
    }

    /// A placer over the cgroup directory `parent` (tests point it at a plain directory).
    pub fn at(enabled: bool, parent: PathBuf) -> Self {
        CpuPlacer {
            enabled,
            parent,
            lock: Arc::new(Mutex::new(())),
        }
    }

    /// Gives the sandbox `id`, whose cgroup exists, `vcpus` CPUs of its own among those
    /// this process may use. `Ok(None)`: not placed (pinning is off, `vcpus` is 0, it
    /// would take every CPU, or its cgroup has no cpuset). `Ok(Some(list))`: the CPUs written, as in `cpuset.cpus`.
    pub fn place(&self, id: &str, vcpus: u32) -> io::Result<Option<String>> {
        let allowed = allowed_cpus()?;
        let want = usize::try_from(vcpus).unwrap_or(usize::MAX);
        if !self.enabled || want == 0 || want >= allowed.len() {
            return Ok(None);
        }
        let cpus_file = self.parent.join(id).join("cpuset.cpus");
        if !cpus_file.exists() {
            // No cpuset controller for this cgroup (a v2 host that does not delegate it).
            return Ok(None);
        }
        let _held = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let counts = self.counts(id, &allowed);
        // The least used CPUs, the lower number first among equals.
        let mut order: Vec<usize> = (0..allowed.len()).collect();
        order.sort_by_key(|&i| (counts[i], allowed[i]));
        let mut chosen: Vec<usize> = order[..want].iter().map(|&i| allowed[i]).collect();
        chosen.sort_unstable();
        let list = format_list(&chosen);
        std::fs::write(&cpus_file, &list)?;
        Ok(Some(list))
    }

    /// How many other sandboxes each of `allowed` holds.
    fn counts(&self, id: &str, allowed: &[usize]) -> Vec<u32> {
        let mut counts = vec![0u32; allowed.len()];
        let Ok(dir) = std::fs::read_dir(&self.parent) else {
            return counts;
        };
        for entry in dir.flatten() {
            if entry.file_name() == id || !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let Ok(text) = std::fs::read_to_string(entry.path().join("cpuset.cpus")) else {
                continue;
            };
            for cpu in parse_list(&text) {
                if let Some(i) = allowed.iter().position(|&a| a == cpu) {
                    counts[i] = counts[i].saturating_add(1);
                }
            }
        }
        counts
    }
}

/// The directory of the cgroup parent named `parent` (`space`) in the hierarchy that has the
/// cpuset controller: cgroup v1's cpuset one, or else the v2 unified one.
pub fn cpuset_parent(parent: &str) -> PathBuf {
    let v1 = Path::new("/sys/fs/cgroup/cpuset");
    if v1.is_dir() {
        v1.join(parent)
    } else {
        Path::new("/sys/fs/cgroup").join(parent)
    }
}

/// The CPUs this process may run on, in increasing order.
fn allowed_cpus() -> io::Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is a valid, empty set, filled in by the kernel.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t of the size passed.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    let max = 8 * std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: CPU_ISSET reads the set within its size (`max` bits).
    Ok((0..max)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// A kernel CPU list (`0-3,8,10-11`) as numbers; what does not parse is skipped, and a
/// range is bounded (a cgroup file is not trusted to be sane).
pub fn parse_list(text: &str) -> Vec<usize> {
    const MAX_CPU: usize = 1 << 14;
    let mut out = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.trim().parse::<usize>(), b.trim().parse::<usize>()),
            None => (part.trim().parse::<usize>(), part.trim().parse::<usize>()),
        };
        if let (Ok(a), Ok(b)) = (a, b) {
            out.extend(a.min(MAX_CPU)..=b.min(MAX_CPU));
        }
    }
    out
}

/// Sorted CPU numbers as a kernel CPU list, ranges folded (`[0, 1, 2, 5]` → `0-2,5`).
fn format_list(cpus: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let start = cpus[i];
        let mut end = start;
        while i + 1 < cpus.len() && cpus[i + 1] == end + 1 {
            i += 1;
            end = cpus[i];
        }
        parts.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_and_fold() {
        assert_eq!(parse_list("0-2,5\n"), vec![0, 1, 2, 5]);
        assert_eq!(parse_list(""), Vec::<usize>::new());
        assert_eq!(parse_list("x,3,-,7-6"), vec![3]);
        assert_eq!(parse_list("0-99999999").len(), (1 << 14) + 1);
        assert_eq!(format_list(&[0, 1, 2, 5]), "0-2,5");
        assert_eq!(format_list(&[3]), "3");
        assert_eq!(format_list(&[]), "");
    }

    /// Sandboxes are spread over the least used CPUs, counted from what the cgroups say.
    #[test]
    fn sandboxes_go_to_the_least_used_cpus() {
        let allowed = allowed_cpus().expect("affinity");
        let dir = tempfile::tempdir().expect("tempdir");
        let placer = CpuPlacer::at(true, dir.path().to_path_buf());
        let all = format_list(&allowed);
        let make = |id: &str, cpus: &str| {
            std::fs::create_dir(dir.path().join(id)).expect("mkdir");
            std::fs::write(dir.path().join(id).join("cpuset.cpus"), cpus).expect("write");
        };
        if allowed.len() < 2 {
            make("a", &all);
            assert_eq!(
                placer.place("a", 1).expect("place"),
                None,
                "one CPU: nothing to place"
            );
            return;
        }
        // Every CPU gets one sandbox before any gets a second.
        for (n, id) in ["a", "b", "c", "d"].into_iter().enumerate() {
            make(id, &all);
            let got = placer.place(id, 1).expect("place").expect("placed");
            assert_eq!(got, allowed[n % allowed.len()].to_string(), "sandbox {id}");
            let written = std::fs::read_to_string(dir.path().join(id).join("cpuset.cpus"));
            assert_eq!(written.expect("read"), got);
        }
        // As many vCPUs as CPUs, or none: left as it is.
        make("e", &all);
        assert_eq!(
            placer.place("e", allowed.len() as u32).expect("place"),
            None
        );
        assert_eq!(placer.place("e", 0).expect("place"), None);
        // Off: nothing placed.
        let off = CpuPlacer::at(false, dir.path().to_path_buf());
        make("f", &all);
        assert_eq!(off.place("f", 1).expect("place"), None);
        assert_eq!(
            std::fs::read_to_string(dir.path().join("f").join("cpuset.cpus")).expect("read"),
            all
        );
    }
}
