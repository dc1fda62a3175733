//! The one place that waits for children. As PID 1 the agent inherits every
//! orphan in the sandbox, so it reaps with `waitpid(-1)` on each SIGCHLD; exits of
//! our commands go to their [`Cmd`], anything else is just reaped.
//!
//! Spawns run without the lock (in parallel); a child that exits before its pid
//! is registered is left a zombie until its spawner registers it and reaps again
//! (`in_flight`). A pid that is signalled under the lock cannot be reaped (and so
//! reused) meanwhile.
//!
//! Signals reach the whole command, not only its process group: its cgroup where
//! it has one, else see `tree` for how processes that left it (`setsid`, daemons)
//! are found.

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::signal::unix::Signal;

use crate::command::Cmd;
use crate::tree;

#[derive(Debug, Default)]
pub struct Reaper {
    pids: Mutex<HashMap<i32, Arc<Cmd>>>,
    /// Spawns between their fork and the registration of the new pid. While there
    /// are any, an exited child nobody knows may be one of theirs: it is left as a
    /// zombie (its pid stays taken) until the spawner registers and reaps again.
    in_flight: std::sync::atomic::AtomicUsize,
    /// Notified when a process that is no command's main process was reaped: an
    /// orphan the agent inherited, which may have been a command's last process.
    pub orphan_reaped: tokio::sync::Notify,
}

/// Why a signal was not delivered.
#[derive(Debug)]
pub enum SignalError {
    /// The command has exited or never started.
    NotRunning,
    Os(io::Error),
}

impl Reaper {
    fn lock(&self) -> MutexGuard<'_, HashMap<i32, Arc<Cmd>>> {
        self.pids.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `start` (a spawn for `cmd`, returning its pid) and registers the pid before
    /// the reaper can see it exit.
    ///
    /// Spawns run without the lock, so they go in parallel; `in_flight` keeps the reaper
    /// from taking a child's exit before its pid is registered.
    pub fn spawn_with(
        &self,
        cmd: &Arc<Cmd>,
        start: impl FnOnce() -> io::Result<u32>,
    ) -> io::Result<u32> {
        use std::sync::atomic::Ordering::SeqCst;
        self.in_flight.fetch_add(1, SeqCst);
        let spawned = start();
        if let Ok(pid) = &spawned {
            cmd.set_pid(*pid);
            if let Ok(pid) = i32::try_from(*pid) {
                self.lock().insert(pid, cmd.clone());
            }
        }
        self.in_flight.fetch_sub(1, SeqCst);
        self.reap();
        spawned
    }

    /// Reaps every child that has exited (see `in_flight` for the one exception).
    pub fn reap(&self) {
        let mut pids = self.lock();
        loop {
            // Look at the next exited child without reaping it yet.
            // SAFETY: siginfo_t is plain data; waitid fills it.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: plain syscall with a valid out-pointer.
            let r = unsafe {
                libc::waitid(
                    libc::P_ALL,
                    0,
                    &mut info,
                    libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
                )
            };
            if r < 0 {
                if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                break; // ECHILD: no children at all.
            }
            // SAFETY: waitid with WEXITED filled in a child's pid (or left 0).
            let pid = unsafe { info.si_pid() };
            if pid <= 0 {
                break; // Children left, none exited.
            }
            let known = pids.contains_key(&pid);
            if !known && self.in_flight.load(std::sync::atomic::Ordering::SeqCst) > 0 {
                // Maybe a command not registered yet: its spawner reaps after registering.
                break;
            }
            let mut status = 0;
            // SAFETY: plain syscall with a valid out-pointer.
            let got = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if got == pid {
                match pids.remove(&pid) {
                    Some(cmd) => cmd.on_reaped(status),
                    None => self.orphan_reaped.notify_waiters(),
                }
                continue;
            }
            if got < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            break;
        }
    }

    /// Sends `sig` to the command's process group (to the process alone if the
    /// group is gone), then to the command's processes outside the group. SIGKILL
    /// kills every process of the command. Blocking (scans `/proc`).
    pub fn signal(&self, cmd: &Cmd, sig: i32) -> Result<(), SignalError> {
        let _pids = self.lock();
        let pid = cmd.running_pid().ok_or(SignalError::NotRunning)?;
        let pid = i32::try_from(pid).map_err(|_| SignalError::NotRunning)?;
        if sig == libc::SIGKILL {
            kill_everything(cmd);
            return Ok(());
        }
        let escaped: Vec<i32> = match cmd.group() {
            Some(group) => {
                // SAFETY: plain syscall.
                let pgid_of = |p: i32| unsafe { libc::getpgid(p) };
                group
                    .pids()
                    .into_iter()
                    .filter(|&p| pgid_of(p) != pid)
                    .collect()
            }
            None => tree::escaped(marks(cmd, true)),
        };
        // SAFETY: plain syscalls. The pid is ours and unreaped (we hold the lock).
        let result = if unsafe { libc::kill(-pid, sig) } == 0 {
            Ok(())
        } else {
            let group_err = io::Error::last_os_error();
            if group_err.raw_os_error() != Some(libc::ESRCH) {
                return Err(SignalError::Os(group_err));
            }
            // SAFETY: as above.
            if unsafe { libc::kill(pid, sig) } == 0 {
                Ok(())
            } else {
                Err(SignalError::Os(io::Error::last_os_error()))
            }
        };
        tree::signal_each(&escaped, sig);
        result
    }

    /// A command's timeout passed: kills everything it started, whether or not its
    /// main process still runs, and marks it timed out if anything was left to kill.
    /// Blocking (may scan `/proc`).
    pub fn kill_for_timeout(&self, cmd: &Cmd) {
        let _pids = self.lock();
        if kill_everything(cmd) {
            cmd.mark_timed_out();
        }
    }

    /// Whether any process the command started is alive. Blocking (may scan `/proc`).
    pub fn any_alive(&self, cmd: &Cmd) -> bool {
        match cmd.group() {
            Some(group) => group.populated(),
            // Without the lock: a check only reads, and a kill must not wait for it.
            None => tree::any_alive(marks(cmd, cmd.running_pid().is_some()), &cmd.known_groups()),
        }
    }
}

/// What `tree` recognises a command's processes by.
fn marks(cmd: &Cmd, root_alive: bool) -> tree::Marks {
    tree::Marks {
        root: i32::try_from(cmd.pid()).unwrap_or(0),
        root_alive,
        tag: cmd.tag(),
    }
}

/// SIGKILLs every process of the command; whether any was alive. The caller
/// holds the reaper lock.
fn kill_everything(cmd: &Cmd) -> bool {
    let root_alive = cmd.running_pid().is_some();
    if let Some(group) = cmd.group() {
        let alive = group.populated();
        if let Err(e) = group.kill() {
            note!("space-agent: cgroup.kill of {} failed: {e}", cmd.id);
        }
        return alive || root_alive;
    }
    if cmd.pid() == 0 {
        return false;
    }
    let mut known = cmd.known_groups();
    let found = tree::kill_all(marks(cmd, root_alive), &mut known);
    cmd.set_known_groups(known);
    found > 0 || root_alive
}

/// Reaps once now (children may have exited before the handler existed: in a microVM,
/// those of the init that ran before the agent), then on every SIGCHLD. `sigchld` must be
/// created before the first spawn. Later reaps run on a blocking thread: the lock they take
/// may be held by a kill that scans `/proc`, and no async worker may wait for that. The first
/// runs here, at the agent's start, when no command (so no kill) exists yet: a boot does not
/// wait for a blocking thread to be made.
pub async fn run(reaper: Arc<Reaper>, mut sigchld: Signal) {
    reaper.reap();
    while sigchld.recv().await.is_some() {
        let r = reaper.clone();
        let _ = tokio::task::spawn_blocking(move || r.reap()).await;
    }
}
