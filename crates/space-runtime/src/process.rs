//! Host processes of the drivers: what gVisor's runsc, the microVM's QEMU and the build steps
//! share about the processes they start and stop.
//!
//! - [`launch`]: a long-lived process (a sandbox's runsc, a VM's QEMU) in a process group of
//!   its own (a signal to the server's group must not reach sandboxes, and sandboxes outlive a
//!   restart of the server) whose stdout and stderr go to a file on the sandbox's log tmpfs
//!   ([`crate::lend::mount_log`]): a flood fills that and nothing else. [`LaunchLog`] then
//!   quotes what that launch wrote, for its error.
//! - [`run_tool`]: a short host tool run to its end, its stderr's tail as the error.
//! - [`wait_gone`]: waits until processes are gone, SIGKILLs them past a grace period and
//!   gives up past a limit.
//! - [`Backoff`]: the doubling waits of every poll (a state, a socket, a migration).
//! - [`tail_text`]: the last bytes of a tool's output as text.
//! - [`KillGroupOnDrop`]: a tool's process group dies with the future that ran it.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use space_core::runtime::RuntimeError;
use tokio::process::{Child, Command};

/// Doubling waits between polls: `first`, `2 × first`, … up to `max` each.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    delay: Duration,
    max: Duration,
}

impl Backoff {
    pub(crate) fn new(first: Duration, max: Duration) -> Backoff {
        Backoff { delay: first, max }
    }

    /// The waits of most polls here: 5 ms doubling to 50 ms.
    pub(crate) fn polling() -> Backoff {
        Backoff::new(Duration::from_millis(5), Duration::from_millis(50))
    }

    /// Sleeps the current delay, then doubles it (up to the maximum).
    pub(crate) async fn wait(&mut self) {
        tokio::time::sleep(self.delay).await;
        self.delay = (self.delay * 2).min(self.max);
    }
}

/// Where a launched process writes, and how much was there before it started.
#[derive(Debug)]
pub(crate) struct LaunchLog {
    path: PathBuf,
    start: u64,
}

impl LaunchLog {
    /// The last `max` bytes of what the process wrote since its launch, as text.
    pub(crate) fn tail(&self, max: usize) -> String {
        let log = std::fs::read(&self.path).unwrap_or_default();
        let start = usize::try_from(self.start).unwrap_or(0).min(log.len());
        tail_text(&log[start..], max)
    }
}

/// Starts `cmd` in a process group of its own, stdin from /dev/null and its stdout and stderr
/// appended to `log_name` on the log tmpfs of `state_dir` (mounted here when it is not yet).
/// The child is not killed on drop: the caller decides whether it outlives the server.
pub(crate) fn launch(
    cmd: &mut Command,
    state_dir: &Path,
    log_name: &str,
) -> Result<(Child, LaunchLog), RuntimeError> {
    let path = crate::lend::mount_log(state_dir)?.join(log_name);
    let opening = |e| RuntimeError::io(format!("opening {log_name}"), e);
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(opening)?;
    let start = out.metadata().map(|m| m.len()).unwrap_or(0);
    let err = out.try_clone().map_err(opening)?;
    let program = cmd.as_std().get_program().to_string_lossy().into_owned();
    let child = cmd
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .kill_on_drop(false)
        .spawn()
        .map_err(|e| RuntimeError::io(format!("running {program}"), e))?;
    Ok((child, LaunchLog { path, start }))
}

/// Runs a short host tool to its end and returns its stdout; a failure is a
/// [`RuntimeError::Tool`] named `tool` with the tail of its stderr.
pub(crate) async fn run_tool(tool: &str, cmd: &mut Command) -> Result<Vec<u8>, RuntimeError> {
    let program = cmd.as_std().get_program().to_string_lossy().into_owned();
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| RuntimeError::io(format!("running {program}"), e))?;
    if out.status.success() {
        return Ok(out.stdout);
    }
    let mut message = tail_text(&out.stderr, 1000);
    if message.is_empty() {
        message = format!("exited with {}", out.status);
    }
    Err(RuntimeError::Tool {
        tool: tool.to_owned(),
        message,
    })
}

/// How [`wait_gone`] kills what outlives the grace period.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kill {
    /// Each process.
    Process,
    /// Each process and its whole process group (a group leader with helpers of its own).
    Group,
}

/// Waits until `living()` names no process; past `grace` SIGKILLs (once) those it names, and
/// past `limit` gives up with the pids still there. Polls back off from 2 ms to 100 ms.
pub(crate) async fn wait_gone(
    mut living: impl FnMut() -> Vec<i32>,
    kill: Kill,
    grace: Duration,
    limit: Duration,
) -> Result<(), Vec<i32>> {
    let start = Instant::now();
    let mut backoff = Backoff::new(Duration::from_millis(2), Duration::from_millis(100));
    let mut killed = false;
    loop {
        let pids = living();
        if pids.is_empty() {
            return Ok(());
        }
        if !killed && start.elapsed() > grace {
            for pid in &pids {
                sigkill(*pid, kill);
            }
            killed = true;
        }
        if start.elapsed() > limit {
            return Err(pids);
        }
        backoff.wait().await;
    }
}

fn sigkill(pid: i32, kill: Kill) {
    if pid <= 1 {
        return;
    }
    // SAFETY: plain syscalls on a pid the caller just found alive; a stale one gets ESRCH.
    unsafe {
        if kill == Kill::Group {
            let pgid = libc::getpgid(pid);
            if pgid > 1 {
                libc::kill(-pgid, libc::SIGKILL);
            }
        }
        libc::kill(pid, libc::SIGKILL);
    }
}

/// The last `max` bytes of a tool's output as trimmed text.
pub(crate) fn tail_text(bytes: &[u8], max: usize) -> String {
    let start = bytes.len().saturating_sub(max);
    String::from_utf8_lossy(&bytes[start..]).trim().to_string()
}

/// The file in a sandbox's log tmpfs ([`crate::lend::LOG_DIR`]) that takes its PID 1's
/// console: the agent's own notes, and the runtime's (runsc's, QEMU's serial port).
pub(crate) const CONSOLE_LOG: &str = "console.log";

/// The end of a sandbox's console, for logs and error messages. The bytes come from inside
/// the sandbox: printable text only, at most `max` bytes of it.
pub(crate) fn console_tail(state_dir: &Path, max: usize) -> String {
    let log =
        std::fs::read(state_dir.join(crate::lend::LOG_DIR).join(CONSOLE_LOG)).unwrap_or_default();
    tail_text(&log, max)
        .chars()
        .map(|c| if c.is_control() && c != '\n' { '?' } else { c })
        .collect()
}

/// Watches whether a process (a VM's monitor: QEMU) is doing anything, from the scheduler's
/// own counts in `/proc/PID/task/*/schedstat`: the time its threads ran, and the time they
/// were ready to run but waited for a CPU. A guest that boots keeps its vCPU thread running
/// or waiting for a CPU, however loaded the host; a guest whose kernel waits for something
/// that never comes leaves it asleep (an idle guest costs QEMU about 2% of a CPU). Starved is
/// never idle here, because waiting for a CPU counts, and neither is a thread blocked on the
/// host's disk (state `D`).
pub(crate) struct Activity {
    pid: i32,
    /// The last sample: when, and the threads' running plus waiting nanoseconds then.
    last: Option<(std::time::Instant, u64)>,
    idle_since: Option<std::time::Instant>,
}

/// Shortest interval a sample is judged over.
const ACTIVITY_INTERVAL: Duration = Duration::from_secs(1);
/// Below this share of an interval spent running or waiting to run, the process was idle.
const IDLE_SHARE: f64 = 0.1;

impl Activity {
    pub(crate) fn new(pid: i32) -> Activity {
        Activity {
            pid,
            last: None,
            idle_since: None,
        }
    }

    /// Takes a sample (at most one a second counts) and says how long the process has been
    /// idle without a break; zero while it is busy or cannot be read.
    pub(crate) fn idle_for(&mut self) -> Duration {
        let now = std::time::Instant::now();
        if self
            .last
            .is_some_and(|(at, _)| now.duration_since(at) < ACTIVITY_INTERVAL)
        {
            return self.idle_since.map_or(Duration::ZERO, |t| now - t);
        }
        let Some(sample) = sample(self.pid) else {
            self.last = None;
            self.idle_since = None;
            return Duration::ZERO;
        };
        let idle_from = match self.last {
            Some((at, before)) => {
                let span = now.duration_since(at).as_nanos() as f64;
                let busy = sample.ran.saturating_add(sample.waited);
                let quiet = (busy.saturating_sub(before) as f64) < span * IDLE_SHARE;
                (quiet && !sample.blocked).then_some(at)
            }
            None => None,
        };
        self.last = Some((now, sample.ran.saturating_add(sample.waited)));
        match idle_from {
            // An idle stretch counts from the start of its first idle interval.
            Some(at) => now - *self.idle_since.get_or_insert(at),
            None => {
                self.idle_since = None;
                Duration::ZERO
            }
        }
    }

    /// How much CPU time the process has used in all.
    pub(crate) fn cpu_time(&self) -> Option<Duration> {
        sample(self.pid).map(|s| Duration::from_nanos(s.ran))
    }
}

/// What the scheduler says of a process's threads together.
struct Sample {
    /// Nanoseconds they ran.
    ran: u64,
    /// Nanoseconds they were ready to run and waited for a CPU.
    waited: u64,
    /// Whether one of them is blocked in the host's kernel (`D`, as on a disk read).
    blocked: bool,
}

/// `pid`'s [`Sample`]; `None` when the process is gone or unreadable.
fn sample(pid: i32) -> Option<Sample> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut sample = Sample {
        ran: 0,
        waited: 0,
        blocked: false,
    };
    let mut any = false;
    for task in tasks.flatten() {
        let dir = task.path();
        let Ok(schedstat) = std::fs::read_to_string(dir.join("schedstat")) else {
            continue;
        };
        let mut fields = schedstat.split_whitespace().map(str::parse::<u64>);
        let (Some(Ok(ran)), Some(Ok(waited))) = (fields.next(), fields.next()) else {
            continue;
        };
        sample.ran = sample.ran.saturating_add(ran);
        sample.waited = sample.waited.saturating_add(waited);
        any = true;
        let stat = std::fs::read_to_string(dir.join("stat")).unwrap_or_default();
        sample.blocked |= stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
            == Some("D");
    }
    any.then_some(sample)
}

/// Kills a process group when dropped, so a cancelled future leaves nothing of a tool (apt,
/// dpkg) running behind it.
pub(crate) struct KillGroupOnDrop(Option<libc::pid_t>);

impl KillGroupOnDrop {
    /// Guards the group `child` leads (spawned with `process_group(0)`).
    pub(crate) fn new(child: &Child) -> KillGroupOnDrop {
        KillGroupOnDrop(child.id().and_then(|id| libc::pid_t::try_from(id).ok()))
    }

    pub(crate) fn kill_now(&mut self) {
        if let Some(pgid) = self.0.take().filter(|p| *p > 1) {
            // SAFETY: plain syscall; the group is the one the child leads.
            unsafe {
                libc::kill(-pgid, libc::SIGKILL);
            }
        }
    }
}

impl Drop for KillGroupOnDrop {
    fn drop(&mut self) {
        self.kill_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tails_are_bounded_and_trimmed() {
        assert_eq!(tail_text(b"  hello \n", 100), "hello");
        assert_eq!(tail_text(b"abcdef", 3), "def");
        assert_eq!(tail_text(&[0xff, b'a'], 1), "a");
    }

    #[tokio::test]
    async fn stragglers_are_killed_after_the_grace_period() {
        let mut child = Command::new("sleep")
            .arg("1000")
            .process_group(0)
            .spawn()
            .expect("sleep");
        let pid = i32::try_from(child.id().expect("pid")).expect("pid");
        let alive = || {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let state = stat
                .rfind(')')
                .and_then(|i| stat[i + 1..].split_whitespace().next());
            if matches!(state, None | Some("Z" | "X")) {
                vec![]
            } else {
                vec![pid]
            }
        };
        let gone = wait_gone(
            alive,
            Kill::Group,
            Duration::from_millis(50),
            Duration::from_secs(20),
        )
        .await;
        assert_eq!(gone, Ok(()));
        let status = child.wait().await.expect("wait");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
    }

    #[test]
    fn a_sleeping_process_is_idle_and_a_spinning_one_is_not() {
        let spawn = |script: &str| {
            std::process::Command::new("sh")
                .args(["-c", script])
                .spawn()
                .expect("sh")
        };
        let mut asleep = spawn("exec sleep 1000");
        let mut spinning = spawn("while :; do :; done");
        let pid = |c: &std::process::Child| i32::try_from(c.id()).expect("pid");
        let (mut a, mut b) = (Activity::new(pid(&asleep)), Activity::new(pid(&spinning)));
        let (mut idle_a, mut idle_b) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..3 {
            idle_a = a.idle_for();
            idle_b = b.idle_for();
            std::thread::sleep(ACTIVITY_INTERVAL + Duration::from_millis(100));
        }
        let cpu_b = b.cpu_time();
        for c in [&mut asleep, &mut spinning] {
            c.kill().expect("kill");
            c.wait().expect("wait");
        }
        // Two whole intervals asleep; a spinning process runs or waits to, so is never idle.
        assert!(idle_a >= 2 * ACTIVITY_INTERVAL, "{idle_a:?}");
        assert_eq!(idle_b, Duration::ZERO);
        assert!(cpu_b.is_some_and(|t| t > Duration::ZERO), "{cpu_b:?}");
        // A process that is gone is never idle.
        assert_eq!(a.idle_for(), Duration::ZERO);
    }

    #[tokio::test]
    async fn a_launch_log_holds_only_its_own_output() {
        let dir = std::env::temp_dir().join(format!("space-launch-{}", std::process::id()));
        let log_dir = dir.join(crate::lend::LOG_DIR);
        std::fs::create_dir_all(&log_dir).unwrap();
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipping: the log tmpfs needs root");
            std::fs::remove_dir_all(&dir).unwrap();
            return;
        }
        for word in ["first", "second"] {
            let (mut child, log) = launch(
                Command::new("sh").args(["-c", &format!("echo {word}; echo {word}-err >&2")]),
                &dir,
                "tool.log",
            )
            .expect("launch");
            assert!(child.wait().await.unwrap().success());
            assert_eq!(log.tail(1000), format!("{word}\n{word}-err"));
        }
        crate::disk::unmount_below(&dir).await.unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
