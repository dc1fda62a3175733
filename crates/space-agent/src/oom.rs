//! The sandbox's memory limit under gVisor, enforced by the agent.
//!
//! gVisor enforces no memory limit inside a sandbox: its kernel (the Sentry) gives
//! the workload whatever it asks for until the host's memory cgroup of the sandbox
//! is full, and then the host's OOM killer ends the biggest process of the
//! *sandbox*: the workload's address space (harmless), or the Sentry itself (the
//! whole sandbox, its agent and every command are lost), whichever is bigger at
//! that moment — a memory bomb split over a few processes, or one that comes after
//! the Sentry has grown, takes the sandbox down.
//!
//! So the limit binds inside first: the gVisor driver tells gVisor `memory_mib` as
//! its MemTotal and sizes the host's cgroup above it (room for the Sentry's own
//! memory, see `space_runtime::gvisor`), and this module keeps the workload within
//! MemTotal by gVisor's own accounting (what `sysinfo(2)` reports, the same as
//! `/proc/meminfo`): when less than 1% of it is free it SIGKILLs the process with
//! the largest resident set (never the agent), as Linux's OOM killer would, and
//! marks that process's command `oom_killed`.
//!
//! It polls — gVisor offers no memory-pressure notification — on a thread of its
//! own, so a busy or stuck async runtime cannot delay it. Each poll is one
//! `sysinfo` call (20–50 µs in gVisor). The pause between polls is the time the
//! fastest allocation measured in a gVisor sandbox (about 1 GB/s for one thread;
//! 4 GB/s assumed) needs to use up what is free, between 2 and 100 ms, so the
//! workload can overshoot by a few MiB before it is stopped; the driver's room
//! for the Sentry covers that.
//!
//! Only a sandbox with something in it besides the agent is polled: one whose commands
//! have all ended and left no process (most sandboxes, most of the time) cannot grow, and
//! each poll wakes a thread, which costs gVisor about a millisecond of CPU (100 idle
//! sandboxes polled every 30 ms took more than the two cores of a small host). The watch
//! looks for other processes once a second while it polls, sleeps while there are none,
//! and a command about to start wakes it at once ([`command_starting`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::http::Agent;

/// Assumed fastest growth of the workload's memory, bytes per second.
const FASTEST_GROWTH: u64 = 4 << 30;
const MIN_PAUSE: Duration = Duration::from_millis(2);
const MAX_PAUSE: Duration = Duration::from_millis(100);
/// How long a killed process may take to exit (it is scheduled like any other; a
/// loaded host makes that slow), and then its memory to come back, before the next
/// victim is chosen: killing another before would kill for nothing. The memory of
/// 150 MiB came back in 10–20 ms on a quiet host; on a loaded one it took more than
/// 100 ms, and the next biggest process (a `sleep` beside the bomb) was killed for
/// nothing. So the watch waits up to a second for it, unless a process grows meanwhile
/// by more than a quarter of the floor: a second bomb, which is then the next victim
/// at once ([`wait_for_release`]).
const EXIT_WAIT: Duration = Duration::from_secs(5);
const RELEASE_WAIT: Duration = Duration::from_secs(1);
/// How often, while waiting for a release, the watch looks for a process that grows.
const GROWTH_CHECK: Duration = Duration::from_millis(5);
/// While it polls, how often the watch looks for processes besides the agent.
const IDLE_CHECK: Duration = Duration::from_secs(1);
/// How long an idle watch sleeps when no command starts (a safety net: every process
/// of the sandbox comes from a command, and a command's start wakes it).
const IDLE_SLEEP: Duration = Duration::from_secs(5);

/// Commands started so far (see [`command_starting`]).
static STARTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A command is about to start: an idle watch polls again at once.
pub fn command_starting(agent: &Agent) {
    STARTS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    agent.quiet.nudge();
}

/// No process but the agent: nothing in the sandbox can take memory. (`/proc` lists
/// processes, not their threads.) Unknown counts as busy.
fn only_the_agent() -> bool {
    let me = std::process::id().to_string();
    match std::fs::read_dir("/proc") {
        Ok(dir) => !dir.flatten().any(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.bytes().all(|b| b.is_ascii_digit()) && name != me.as_str()
        }),
        Err(_) => false,
    }
}

/// Total and free memory by the sandbox kernel's accounting, in bytes.
fn memory() -> Option<(u64, u64)> {
    // SAFETY: sysinfo fills in a plain struct.
    let mut si: libc::sysinfo = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out-pointer.
    if unsafe { libc::sysinfo(&mut si) } != 0 {
        return None;
    }
    let unit = u64::from(si.mem_unit.max(1));
    Some((
        si.totalram.saturating_mul(unit),
        si.freeram.saturating_mul(unit),
    ))
}

/// Starts the watch. Call once, as the init of a gVisor sandbox.
pub fn start(agent: Arc<Agent>) {
    let Some((total, _)) = memory().filter(|(t, _)| *t > 0) else {
        note!("space-agent: no memory total to keep commands within");
        return;
    };
    let spawned = std::thread::Builder::new()
        .name("space-oom".into())
        // It reads small files and sleeps: a small stack keeps the agent small.
        .stack_size(256 << 10)
        .spawn(move || watch(&agent, total));
    match spawned {
        Ok(_) => note!(
            "space-agent: commands kept within {} MiB of memory",
            total >> 20
        ),
        Err(e) => note!("space-agent: cannot start the memory watch: {e}"),
    }
}

fn watch(agent: &Agent, total: u64) {
    let floor = total / 100;
    let mut checked = Instant::now();
    loop {
        agent.quiet.wait_off_blocking();
        if checked.elapsed() >= IDLE_CHECK {
            // Taken before the look, so a command starting after it cuts the sleep short.
            let starts = STARTS.load(std::sync::atomic::Ordering::SeqCst);
            if only_the_agent() {
                agent.quiet.sleep_blocking_unless(IDLE_SLEEP, || {
                    STARTS.load(std::sync::atomic::Ordering::SeqCst) != starts
                });
            }
            checked = Instant::now();
            continue;
        }
        let free = memory().map_or(total, |(_, f)| f);
        if free <= floor {
            if let Some(victim) = biggest() {
                kill(agent, victim);
                let start = Instant::now();
                while start.elapsed() < EXIT_WAIT && resident_pages(victim).is_some_and(|r| r > 0) {
                    std::thread::sleep(MIN_PAUSE);
                }
                wait_for_release(
                    floor,
                    RELEASE_WAIT,
                    || memory().map(|(_, f)| f),
                    biggest_resident,
                );
                continue;
            }
        }
        let room = free.saturating_sub(floor);
        let pause = Duration::from_nanos(
            u64::try_from(u128::from(room) * 1_000_000_000 / u128::from(FASTEST_GROWTH))
                .unwrap_or(u64::MAX),
        );
        agent
            .quiet
            .sleep_blocking(pause.clamp(MIN_PAUSE, MAX_PAUSE));
    }
}

/// A process's resident set in pages (`None`: it is gone).
fn resident_pages(pid: i32) -> Option<u64> {
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    statm.split_whitespace().nth(1)?.parse().ok()
}

/// The pid of the process (other than the agent) with the largest resident set.
fn biggest() -> Option<i32> {
    biggest_resident().map(|(pid, _)| pid)
}

/// The process (other than the agent) with the largest resident set, and that set in
/// bytes.
fn biggest_resident() -> Option<(i32, u64)> {
    let me = i32::try_from(std::process::id()).unwrap_or(1);
    // SAFETY: a plain query.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    std::fs::read_dir("/proc")
        .ok()?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid != me)
        .filter_map(|pid| Some((resident_pages(pid)?, pid)))
        .filter(|&(resident, _)| resident > 0)
        .max()
        .map(|(pages, pid)| (pid, pages.saturating_mul(page)))
}

/// After a victim has exited: waits until free memory (`free`) is above `floor` again
/// (the victim's memory came back), or a process grows by more than a quarter of the
/// floor (`biggest`: the largest process and its resident bytes; a second bomb, to be
/// killed next), or `most` has passed. Whether a process grew.
fn wait_for_release(
    floor: u64,
    most: Duration,
    mut free: impl FnMut() -> Option<u64>,
    mut biggest: impl FnMut() -> Option<(i32, u64)>,
) -> bool {
    let start = Instant::now();
    let mut first_seen: std::collections::HashMap<i32, u64> = Default::default();
    while start.elapsed() < most {
        if free().is_none_or(|f| f > floor) {
            return false;
        }
        if let Some((pid, resident)) = biggest() {
            let was = *first_seen.entry(pid).or_insert(resident);
            if resident.saturating_sub(was) > floor / 4 {
                return true;
            }
        }
        std::thread::sleep(GROWTH_CHECK);
    }
    false
}

fn kill(agent: &Agent, pid: i32) {
    // Found before the kill: a dead process's limits are gone with it.
    let cmd = crate::tree::tag_of(pid).and_then(|tag| agent.command_with_tag(tag));
    // SAFETY: plain syscall.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    match cmd {
        Some(cmd) => {
            cmd.mark_oom_killed();
            note!(
                "space-agent: out of memory: killed process {pid} of command {}",
                cmd.id
            );
        }
        None => note!("space-agent: out of memory: killed process {pid}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_memory_and_resident_sets() {
        let (total, free) = memory().expect("sysinfo");
        assert!(total > 0 && free <= total);
        let me = i32::try_from(std::process::id()).unwrap();
        assert!(resident_pages(me).is_some_and(|r| r > 0));
        assert_eq!(resident_pages(i32::MAX), None);
        // Never the caller itself.
        assert_ne!(biggest(), Some(me));
    }

    const FLOOR: u64 = 4 << 20;
    const MOST: Duration = Duration::from_millis(300);

    #[test]
    fn after_a_kill_the_next_victim_waits_for_the_memory_to_come_back() {
        // The memory comes back after a while (slower than the old 100 ms wait): the
        // watch waits for it, and nothing else is killed for it.
        let mut polls = 0;
        let start = Instant::now();
        let grew = wait_for_release(
            FLOOR,
            Duration::from_secs(5),
            || {
                polls += 1;
                Some(if polls < 40 { FLOOR / 2 } else { FLOOR * 10 })
            },
            || Some((7, 100 << 10)),
        );
        assert!(!grew);
        assert!(start.elapsed() >= 39 * GROWTH_CHECK);
        assert!(start.elapsed() < Duration::from_secs(5));

        // It never comes back, and nothing grows: the next victim after `most`.
        let start = Instant::now();
        let grew = wait_for_release(FLOOR, MOST, || Some(0), || Some((7, 100 << 10)));
        assert!(!grew);
        assert!(start.elapsed() >= MOST);
    }

    #[test]
    fn after_a_kill_a_process_that_grows_is_the_next_victim_at_once() {
        // A second bomb: its resident set grows by more than a quarter of the floor.
        let mut resident = 1 << 20;
        let start = Instant::now();
        let grew = wait_for_release(
            FLOOR,
            Duration::from_secs(5),
            || Some(0),
            || {
                resident += 256 << 10;
                Some((9, resident))
            },
        );
        assert!(grew);
        assert!(start.elapsed() < Duration::from_secs(1));
        // Which process is biggest may change; each is measured against itself.
        let mut calls = 0u64;
        let grew = wait_for_release(
            FLOOR,
            MOST,
            || Some(0),
            || {
                calls += 1;
                Some((i32::try_from(calls % 2).unwrap(), 1 << 20))
            },
        );
        assert!(!grew);
    }
}
