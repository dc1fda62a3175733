//! Finding every process of a command, including those that left its process
//! group: a child that calls `setsid()`, or a daemon that double-forks and is
//! re-parented to the agent.
//!
//! gVisor lets the agent mount no cgroup (it lacks CAP_SYS_ADMIN), so a command
//! is recognised in `/proc` by three marks, any of which makes a process a member:
//! - **ancestry**: the command's main process and everything below it, while the
//!   parents in between are alive;
//! - **group and session**: processes whose process group or session is the main
//!   process's (the agent starts each command in a session of its own);
//! - **a tag**: every command runs with its own `RLIMIT_RSS` hard limit, a value
//!   near 2^62 (bytes, so in effect unlimited, and the limit has had no effect in
//!   Linux since 2.4; gVisor does not enforce it either). Limits are inherited
//!   through `fork`, `exec`, `setsid`, `setuid` and re-parenting, cannot be raised
//!   again without CAP_SYS_RESOURCE, and are readable by anyone in
//!   `/proc/<pid>/limits`. (gVisor refuses to set `RLIMIT_RTTIME`, and
//!   `/proc/<pid>/environ` needs ptrace rights over processes of other users.)
//!
//! Members are searched only among the agent's own descendants (as PID 1 or a
//! child subreaper it inherits every orphan), so an agent run outside a sandbox
//! never touches anything it did not start.
//!
//! Limits: a process that lowers its own `RLIMIT_RSS` hard limit (`ulimit -H -m`,
//! `prlimit --rss`) *and* has left the session and lost its ancestry escapes; a pid
//! can be reused between the scan and the `kill` (pids are not recycled that fast
//! in practice, and the caller holds the reaper lock, so no child of the agent is
//! reaped meanwhile). Where the kernel gives commands cgroups (a microVM), the
//! agent uses those instead (`cgroup::Group`), which no process can leave.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};

/// Tags are `TAG_BASE + n`, one `n` per command.
const TAG_BASE: u64 = 1 << 62;
/// A kill rescans until a pass finds no member alive. A killed process forks no
/// more, so a fork bomb racing the scans runs out within a few passes; this only
/// bounds a process that takes long to die (one stuck in the sandbox's kernel).
const KILL_GIVE_UP: std::time::Duration = std::time::Duration::from_secs(10);

static NEXT_TAG: AtomicU64 = AtomicU64::new(1);

/// A new tag for a command, or `None` when the agent's own hard limit is below
/// it (the limit can only be lowered, so the command could not take it).
pub fn new_tag() -> Option<u64> {
    let tag = TAG_BASE + NEXT_TAG.fetch_add(1, Ordering::Relaxed);
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills in a valid struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_RSS, &mut lim) } != 0 || lim.rlim_max < tag {
        return None;
    }
    Some(tag)
}

/// Applies `tag` to the calling process. Runs between fork and exec: no allocation.
pub fn apply_tag(tag: u64) {
    let lim = libc::rlimit {
        rlim_cur: tag,
        rlim_max: tag,
    };
    // SAFETY: plain syscall. Failure only loses the tag; the other marks remain.
    unsafe { libc::setrlimit(libc::RLIMIT_RSS, &lim) };
}

/// What a command is recognised by.
#[derive(Debug, Clone, Copy)]
pub struct Marks {
    /// The main process (its pid is also its process group and session id).
    pub root: i32,
    /// Whether the main process is not reaped yet: only then does a process with
    /// its pid count (the group and session ids stay taken while any member uses them).
    pub root_alive: bool,
    pub tag: Option<u64>,
}

/// One process, from `/proc/<pid>/stat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stat {
    pid: i32,
    ppid: i32,
    pgid: i32,
    sid: i32,
    /// Start time in clock ticks since boot: with the pid, names one process.
    start: u64,
    /// Dead already (zombie or dying): nothing to signal.
    dead: bool,
}

/// Parses `/proc/<pid>/stat`: `pid (comm) state ppid pgrp session … starttime …`.
/// `comm` may hold spaces and parentheses, so fields are counted from the last `)`.
fn parse_stat(text: &str) -> Option<Stat> {
    let (head, rest) = text.rsplit_once(')')?;
    let pid = head.split_once(" (")?.0.trim().parse().ok()?;
    // Fields from 3 (state) on; starttime is field 22.
    let f: Vec<&str> = rest.split_ascii_whitespace().collect();
    if f.len() < 20 {
        return None;
    }
    Some(Stat {
        pid,
        ppid: f[1].parse().ok()?,
        pgid: f[2].parse().ok()?,
        sid: f[3].parse().ok()?,
        start: f[19].parse().ok()?,
        dead: matches!(f[0], "Z" | "X" | "x"),
    })
}

/// The hard `RLIMIT_RSS` from `/proc/<pid>/limits` (`u64::MAX` for unlimited).
fn parse_rss_hard_limit(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("Max resident set"))?;
    let mut f = line["Max resident set".len()..].split_ascii_whitespace();
    let _soft = f.next()?;
    match f.next()? {
        "unlimited" => Some(u64::MAX),
        v => v.parse().ok(),
    }
}

fn read_stat(pid: i32) -> Option<Stat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// The command tag a process carries, if any.
pub fn tag_of(pid: i32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/limits"))
        .ok()
        .and_then(|t| parse_rss_hard_limit(&t))
        .filter(|&t| t > TAG_BASE && t != u64::MAX)
}

fn has_tag(pid: i32, tag: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/limits"))
        .ok()
        .and_then(|t| parse_rss_hard_limit(&t))
        == Some(tag)
}

fn all_processes() -> Vec<Stat> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(read_stat)
        .collect()
}

/// The live members of a command among `procs`, which must hold `me` (the agent)
/// and its descendants; `tagged` says whether a pid carries the command's tag.
fn members<'a>(procs: &'a [Stat], me: i32, m: Marks, tagged: impl Fn(i32) -> bool) -> Vec<Stat> {
    let mut children: HashMap<i32, Vec<&'a Stat>> = HashMap::new();
    for p in procs {
        children.entry(p.ppid).or_default().push(p);
    }
    // Every process below (and including) those in `from`.
    let below = |from: Vec<&'a Stat>| {
        let mut out = Vec::new();
        let mut stack = from;
        while let Some(p) = stack.pop() {
            out.push(p);
            if let Some(c) = children.get(&p.pid) {
                stack.extend(c.iter().copied());
            }
        }
        out
    };
    // Only the agent's own descendants are candidates.
    let candidates = below(children.get(&me).cloned().unwrap_or_default());

    let marked: Vec<&Stat> = candidates
        .into_iter()
        .filter(|p| {
            (m.root_alive && p.pid == m.root)
                || p.pgid == m.root
                || p.sid == m.root
                || m.tag.is_some() && tagged(p.pid)
        })
        .collect();
    let all = below(marked);
    let mut seen = HashSet::new();
    all.into_iter()
        .filter(|p| !p.dead && p.pid != me && seen.insert(p.pid))
        .copied()
        .collect()
}

/// As PID 1 (where every process is the agent's descendant): kills each process
/// that carries one of the command's own marks (group, session, tag, or a group in
/// `known`) as the walk through /proc meets it, its whole group with it, and adds
/// the group to `known`. In a sandbox whose CPUs a fork bomb keeps busy, a walk
/// through /proc takes seconds; killing as it goes frees them at the first member
/// of a group. What only ancestry ties to the command is left to [`scan`].
fn kill_as_found(m: Marks, known: &mut Vec<i32>) -> usize {
    let me = i32::try_from(std::process::id()).unwrap_or(1);
    if me != 1 {
        return 0;
    }
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut n = 0;
    for pid in dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok()) {
        let Some(p) = read_stat(pid) else { continue };
        if p.dead || p.pid == me {
            continue;
        }
        let member = (m.root_alive && p.pid == m.root)
            || p.pgid == m.root
            || p.sid == m.root
            || known.contains(&p.pgid)
            || m.tag.is_some_and(|t| has_tag(p.pid, t));
        if !member {
            continue;
        }
        n += 1;
        if p.pgid > 1 && p.pgid != me && !known.contains(&p.pgid) {
            known.push(p.pgid);
            // SAFETY: plain syscall.
            unsafe { libc::kill(-p.pgid, libc::SIGKILL) };
        }
        // SAFETY: plain syscall.
        unsafe { libc::kill(p.pid, libc::SIGKILL) };
    }
    n
}

fn scan(m: Marks) -> Vec<Stat> {
    let me = i32::try_from(std::process::id()).unwrap_or(1);
    let tag = m.tag.unwrap_or(0);
    members(&all_processes(), me, m, |pid| has_tag(pid, tag))
}

/// SIGKILLs every process of the command, rescanning until a pass finds none
/// alive; how many it found alive at first. The caller holds the reaper lock, so
/// the main process is not reaped meanwhile (and its pid, group and session ids
/// stay taken).
/// `known` holds process groups of the command seen by earlier kills; groups found
/// now are added to it.
pub fn kill_all(m: Marks, known: &mut Vec<i32>) -> usize {
    let start = std::time::Instant::now();
    // The main process's group first, before the scan: one call, and in a sandbox
    // whose CPUs a fork bomb keeps busy, a scan of /proc takes seconds (measured: 12 s
    // under gVisor with 128 processes forking), while the bomb's processes, which stay
    // in their parent's group, all die with this. Whatever left the group is found
    // below by its other marks. (Stopping processes instead would not hold them:
    // stopped members of an orphaned process group, which every command's is, are
    // continued by the kernel.)
    let mut alive_groups = 0;
    for &pgid in std::iter::once(&m.root).chain(known.iter()) {
        // SAFETY: plain syscall; ESRCH when the group is gone.
        if pgid > 1 && unsafe { libc::kill(-pgid, libc::SIGKILL) } == 0 {
            alive_groups += 1;
        }
    }
    let as_found = kill_as_found(m, known);
    let mut found = scan(m);
    let first = found.len().max(as_found) + alive_groups;
    let mut killed = HashSet::new();
    loop {
        // Whole process groups first, one call each: the kernel signals every member
        // at once, so a fork bomb (whose children stay in their parent's group) cannot
        // refill the group faster than a scan of /proc finds them. A member's group
        // holds only processes of its session, so only the command's own.
        known.extend(
            found
                .iter()
                .map(|p| p.pgid)
                .filter(|&g| g > 1 && g != m.root),
        );
        known.sort_unstable();
        known.dedup();
        for &pgid in std::iter::once(&m.root).chain(known.iter()) {
            // SAFETY: plain syscall; ESRCH for a group that is gone.
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
        }
        if m.root_alive {
            // SAFETY: as above (the main process, in case it left its group).
            unsafe { libc::kill(m.root, libc::SIGKILL) };
        }
        let mut new = false;
        for p in &found {
            if killed.insert((p.pid, p.start)) {
                new = true;
                // SAFETY: plain syscall.
                unsafe { libc::kill(p.pid, libc::SIGKILL) };
            }
        }
        if !new {
            // Only killed processes are left, listed until they have exited; nothing
            // tells the agent when a process that is not its child has: look again shortly.
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        found = scan(m);
        if found.is_empty() || start.elapsed() >= KILL_GIVE_UP {
            return first;
        }
    }
}

/// Whether any process of the command is alive. A live process group of the main
/// process, or one of `known` (see [`kill_all`]), answers without a scan of /proc.
pub fn any_alive(m: Marks, known: &[i32]) -> bool {
    // SAFETY: plain syscall (signal 0 only checks).
    let group_alive = |g: i32| g > 1 && unsafe { libc::kill(-g, 0) } == 0;
    m.root_alive
        || group_alive(m.root)
        || known.iter().any(|&g| group_alive(g))
        || !scan(m).is_empty()
}

/// The command's live processes outside its process group, to be signalled
/// one by one. Call it before signalling the group (see [`kill_all`]).
pub fn escaped(m: Marks) -> Vec<i32> {
    scan(m)
        .into_iter()
        .filter(|p| p.pgid != m.root)
        .map(|p| p.pid)
        .collect()
}

/// Sends `sig` to every process group of the session `sid` (a command's main
/// process leads its session).
pub fn signal_session_groups(sid: i32, sig: i32) {
    let me = i32::try_from(std::process::id()).unwrap_or(1);
    let mut groups: Vec<i32> = all_processes()
        .into_iter()
        .filter(|p| p.sid == sid && !p.dead && p.pid != me)
        .map(|p| p.pgid)
        .collect();
    groups.sort_unstable();
    groups.dedup();
    for pgid in groups {
        // SAFETY: plain syscall.
        unsafe { libc::kill(-pgid, sig) };
    }
}

/// Sends `sig` to each of `pids`.
pub fn signal_each(pids: &[i32], sig: i32) {
    for &pid in pids {
        // SAFETY: plain syscall.
        unsafe { libc::kill(pid, sig) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_awkward_names() {
        let s = "42 (a) b (c)) S 7 42 40 0 -1 4194560 1 2 3 4 5 6 7 8 20 0 1 0 12345 0 0";
        assert_eq!(
            parse_stat(s),
            Some(Stat {
                pid: 42,
                ppid: 7,
                pgid: 42,
                sid: 40,
                start: 12345,
                dead: false
            })
        );
        let z = "9 (sh) Z 1 9 9 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 77 0 0";
        assert!(parse_stat(z).is_some_and(|s| s.dead && s.start == 77));
        assert_eq!(parse_stat("9 (sh) S 1 9"), None);
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn parses_rss_limit() {
        let t = "Limit                     Soft Limit           Hard Limit           Units     \n\
                 Max cpu time              unlimited            unlimited            seconds   \n\
                 Max resident set          4611686018427387905  4611686018427387906  bytes     \n";
        assert_eq!(parse_rss_hard_limit(t), Some(4611686018427387906));
        let t = "Max resident set          unlimited            unlimited            bytes\n";
        assert_eq!(parse_rss_hard_limit(t), Some(u64::MAX));
        assert_eq!(parse_rss_hard_limit("Max cpu time 1 2 s\n"), None);
    }

    fn p(pid: i32, ppid: i32, pgid: i32, sid: i32) -> Stat {
        Stat {
            pid,
            ppid,
            pgid,
            sid,
            start: 0,
            dead: false,
        }
    }

    #[test]
    fn members_by_ancestry_group_session_and_tag() {
        let me = 1;
        let procs = vec![
            p(1, 0, 1, 1),
            // The command (root 10) and a child that stayed in its group.
            p(10, 1, 10, 10),
            p(11, 10, 10, 10),
            // A child that called setsid: found by ancestry, with its child.
            p(12, 10, 12, 12),
            p(13, 12, 12, 12),
            // Orphans re-parented to the agent: one still in the session, one
            // that left it but carries the tag, and its child.
            p(20, 1, 20, 10),
            p(30, 1, 30, 30),
            p(31, 30, 30, 30),
            // Another command, and its orphan.
            p(40, 1, 40, 40),
            p(41, 1, 41, 41),
            // Not below the agent at all (e.g. `runsc exec`), though it has the group id.
            p(50, 0, 10, 10),
        ];
        let m = Marks {
            root: 10,
            root_alive: true,
            tag: Some(7),
        };
        let mut got: Vec<i32> = members(&procs, me, m, |pid| pid == 30)
            .iter()
            .map(|p| p.pid)
            .collect();
        got.sort_unstable();
        assert_eq!(got, vec![10, 11, 12, 13, 20, 30, 31]);

        // Without a tag the re-parented daemon is lost.
        let m = Marks {
            root: 10,
            root_alive: true,
            tag: None,
        };
        let got = members(&procs, me, m, |_| true);
        assert!(got.iter().all(|p| p.pid != 30));

        // Once the main process is reaped its pid may be reused: only its group,
        // session and tag count then.
        let gone = Marks {
            root: 10,
            root_alive: false,
            tag: None,
        };
        let procs_reused = vec![p(1, 0, 1, 1), p(10, 1, 12, 12), p(11, 1, 10, 10)];
        let got: Vec<i32> = members(&procs_reused, me, gone, |_| false)
            .iter()
            .map(|p| p.pid)
            .collect();
        assert_eq!(got, vec![11]);

        // Dead processes are not members.
        let mut procs = procs;
        procs[2].dead = true;
        let got = members(&procs, me, m, |_| false);
        assert!(got.iter().all(|p| p.pid != 11));
    }
}
