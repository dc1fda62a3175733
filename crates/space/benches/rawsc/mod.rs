//! Raw `runsc` containers for the benches: the same OCI bundle our server
//! wrote, the same global flags as `space-runtime`'s gVisor driver, but no
//! server. Included by `#[path]` from a bench (copied from `core.rs`, plus
//! pause/resume, checkpoint/restore and a counted-stdout exec).
#![allow(dead_code)]

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// cgroup parent of the raw containers (ours use `space`).
pub const RAW_CGROUP_PARENT: &str = "space-bench";
/// Platform as `space-runtime`'s gVisor driver passes it.
pub const PLATFORM: &str = "systrap";
/// Longest a raw container may take to reach a state.
const STATE_LIMIT: Duration = Duration::from_secs(30);

/// Raw runsc containers of a bench: one runsc root, one bundle per container.
pub struct Raw {
    dir: tempfile::TempDir,
    pub root: PathBuf,
    agent_dir: PathBuf,
    config: Value,
}

impl Raw {
    pub fn new(config: &Value, agent: &Path) -> Raw {
        let dir = tempfile::Builder::new()
            .prefix("spb")
            .tempdir_in("/tmp")
            .expect("tempdir");
        let root = dir.path().join("root");
        let agent_dir = dir.path().join("agent");
        for d in [&root, &agent_dir] {
            std::fs::create_dir_all(d).expect("raw dirs");
        }
        std::fs::copy(agent, agent_dir.join("space-agent")).expect("copying the agent");
        Raw {
            dir,
            root,
            agent_dir,
            config: config.clone(),
        }
    }

    /// A container id unique to this process (cgroup names are machine-wide).
    pub fn id(&self, name: &str) -> String {
        format!("b{}-{name}", std::process::id())
    }

    pub fn cdir(&self, id: &str) -> PathBuf {
        self.dir.path().join("c").join(id)
    }

    pub fn bundle(&self, id: &str) -> PathBuf {
        self.cdir(id).join("bundle")
    }

    /// Where the checkpoint image of a container goes (removed with the container).
    pub fn image(&self, id: &str) -> PathBuf {
        self.cdir(id).join("image")
    }

    /// Our config.json with its own cgroup, run dir (holding a fresh agent
    /// token) and agent dir; everything else — root.path at the template
    /// rootfs, mounts, resources, process — as our server wrote it.
    pub fn prepare(&self, id: &str) {
        let c = self.cdir(id);
        let run = c.join("run");
        for d in [self.bundle(id), c.join("overlay"), run.clone()] {
            std::fs::create_dir_all(&d).expect("raw container dirs");
        }
        std::fs::write(run.join("token"), "raw-bench-token\n").expect("token");
        let mut config = self.config.clone();
        config["linux"]["cgroupsPath"] = json!(format!("/{RAW_CGROUP_PARENT}/{id}"));
        for m in config["mounts"].as_array_mut().expect("mounts") {
            match m["destination"].as_str() {
                Some("/.space/run") => m["source"] = json!(run),
                Some("/.space/bin") => m["source"] = json!(self.agent_dir),
                _ => {}
            }
        }
        std::fs::write(
            self.bundle(id).join("config.json"),
            serde_json::to_vec_pretty(&config).expect("config"),
        )
        .expect("writing config.json");
    }

    /// The global flags our driver gives `runsc create`, `start` and `restore`.
    pub fn globals(&self, id: &str) -> Vec<OsString> {
        vec![
            "--root".into(),
            self.root.clone().into(),
            format!("--platform={PLATFORM}").into(),
            "--network=none".into(),
            "--host-uds=open".into(),
            format!(
                "--overlay2=root:dir={}",
                self.cdir(id).join("overlay").display()
            )
            .into(),
            "--cpu-num-from-quota".into(),
        ]
    }

    /// The global flags our driver gives every other runsc call.
    pub fn short_globals(&self) -> Vec<OsString> {
        vec![
            "--root".into(),
            self.root.clone().into(),
            format!("--platform={PLATFORM}").into(),
            "--network=none".into(),
            "--host-uds=open".into(),
        ]
    }

    /// A short runsc subcommand with the short global flags.
    fn runsc(&self, args: &[&str]) -> Output {
        Command::new("runsc")
            .args(self.short_globals())
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("running runsc {args:?}: {e}"))
    }

    /// Like [`Raw::runsc`], panicking unless it succeeds.
    fn runsc_ok(&self, args: &[&str]) -> Output {
        let out = self.runsc(args);
        assert!(
            out.status.success(),
            "runsc {args:?}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// `runsc create` (or `restore`) with the full global flags, the sandbox
    /// inheriting a console file as stdio, as our driver's `launch`.
    fn launch(&self, id: &str, args: &[OsString]) {
        let console_path = self.cdir(id).join("console.log");
        let console = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&console_path)
            .expect("console log");
        let console_err = console.try_clone().expect("console log");
        let status = Command::new("runsc")
            .args(self.globals(id))
            .args(args)
            .stdin(Stdio::null())
            .stdout(console)
            .stderr(console_err)
            .process_group(0)
            .status()
            .expect("running runsc");
        if !status.success() {
            panic!(
                "runsc {args:?}: {status}\n{}",
                std::fs::read_to_string(&console_path).unwrap_or_default()
            );
        }
    }

    /// `runsc create` + `runsc start`, timed together.
    pub fn create_start(&self, id: &str) -> Duration {
        let t0 = Instant::now();
        self.launch(
            id,
            &[
                "create".into(),
                "--bundle".into(),
                self.bundle(id).into(),
                id.into(),
            ],
        );
        let out = Command::new("runsc")
            .args(self.globals(id))
            .arg("start")
            .arg(id)
            .stdin(Stdio::null())
            .output()
            .expect("running runsc start");
        let took = t0.elapsed();
        assert!(
            out.status.success(),
            "runsc start {id}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(self.cdir(id).join("console.log")).unwrap_or_default()
        );
        took
    }

    /// `runsc pause`, timed.
    pub fn pause(&self, id: &str) -> Duration {
        let t0 = Instant::now();
        self.runsc_ok(&["pause", id]);
        t0.elapsed()
    }

    /// `runsc resume` (of a paused container), timed.
    pub fn resume(&self, id: &str) -> Duration {
        let t0 = Instant::now();
        self.runsc_ok(&["resume", id]);
        t0.elapsed()
    }

    /// `status` of `runsc state`, `None` once the container does not exist.
    pub fn state(&self, id: &str) -> Option<String> {
        let out = self.runsc(&["state", id]);
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                err.contains("does not exist") || err.contains("not found"),
                "runsc state {id}: {err}"
            );
            return None;
        }
        let state: Value = serde_json::from_slice(&out.stdout).expect("runsc state JSON");
        Some(state["status"].as_str().unwrap_or("?").to_string())
    }

    /// Polls `runsc state` (5 ms doubling to 50 ms, as our driver) until `done`
    /// says so; the state it ended at.
    fn poll_state(
        &self,
        id: &str,
        what: &str,
        done: impl Fn(Option<&str>) -> bool,
    ) -> Option<String> {
        let t0 = Instant::now();
        let mut delay = Duration::from_millis(5);
        loop {
            let state = self.state(id);
            if done(state.as_deref()) {
                return state;
            }
            assert!(
                t0.elapsed() < STATE_LIMIT,
                "raw container {id} did not become {what}; it is {state:?}"
            );
            std::thread::sleep(delay);
            delay = (delay * 2).min(Duration::from_millis(50));
        }
    }

    /// `runsc checkpoint --image-path IMAGE id` until the container is
    /// `stopped`, then `runsc delete`: timed. Then (untimed) waits for its
    /// processes to exit and removes its cgroups. The image dir is emptied first.
    pub fn checkpoint(&self, id: &str) -> Duration {
        let image = self.image(id);
        let _ = std::fs::remove_dir_all(&image);
        std::fs::create_dir_all(&image).expect("raw image dir");
        let image = image.to_string_lossy().into_owned();
        let t0 = Instant::now();
        self.runsc_ok(&["checkpoint", "--image-path", &image, id]);
        let state = self.poll_state(id, "stopped", |s| matches!(s, None | Some("stopped")));
        if state.is_some() {
            self.runsc_ok(&["delete", id]);
        }
        let took = t0.elapsed();
        self.wait_processes_gone(id);
        remove_cgroups(id);
        took
    }

    /// `runsc restore --image-path IMAGE --bundle B --detach id` with the full
    /// global flags, until `runsc state` says `running`: timed.
    pub fn restore(&self, id: &str) -> Duration {
        let t0 = Instant::now();
        self.launch(
            id,
            &[
                "restore".into(),
                "--image-path".into(),
                self.image(id).into(),
                "--bundle".into(),
                self.bundle(id).into(),
                "--detach".into(),
                id.into(),
            ],
        );
        self.poll_state(id, "running", |s| s == Some("running"));
        t0.elapsed()
    }

    /// `runsc exec <id> argv...`, timed, with its stdout; panics unless it succeeds.
    pub fn exec(&self, id: &str, argv: &[&str]) -> (Duration, String) {
        let mut args = vec!["exec", id];
        args.extend_from_slice(argv);
        let t0 = Instant::now();
        let out = self.runsc_ok(&args);
        (
            t0.elapsed(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    }

    /// `runsc exec <id> argv...` with its stdout read through a pipe and
    /// counted (never kept), timed from spawn to exit; panics unless it succeeds.
    pub fn exec_count(&self, id: &str, argv: &[&str]) -> (Duration, u64) {
        use std::io::Read;
        // stderr to a file, so that a chatty runsc never blocks on a full pipe.
        let err_path = self.cdir(id).join("exec-count.err");
        let err = std::fs::File::create(&err_path).expect("exec stderr file");
        let t0 = Instant::now();
        let mut child = Command::new("runsc")
            .args(self.short_globals())
            .arg("exec")
            .arg(id)
            .args(argv)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("running runsc exec {argv:?}: {e}"));
        let mut stdout = child.stdout.take().expect("runsc exec stdout");
        let mut buf = vec![0u8; 1 << 20];
        let mut count = 0u64;
        loop {
            match stdout.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => count += n as u64,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => panic!("reading runsc exec {argv:?} stdout: {e}"),
            }
        }
        let status = child.wait().expect("waiting for runsc exec");
        let took = t0.elapsed();
        assert!(
            status.success(),
            "runsc exec {id} {argv:?}: {status}\n{}",
            std::fs::read_to_string(&err_path).unwrap_or_default()
        );
        (took, count)
    }

    /// Waits until no runsc process of this container's bundle is left.
    pub fn wait_processes_gone(&self, id: &str) {
        let needle = format!("--bundle={}", self.bundle(id).display());
        let t0 = Instant::now();
        while !runsc_processes(|a| a == needle).is_empty() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "processes of raw container {id} did not exit"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `runsc delete --force`, wait for its processes, remove its cgroups and files.
    pub fn delete(&self, id: &str) {
        let out = self.runsc(&["delete", "--force", id]);
        assert!(
            out.status.success(),
            "runsc delete --force {id}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.wait_processes_gone(id);
        remove_cgroups(id);
        std::fs::remove_dir_all(self.cdir(id)).expect("removing raw container dir");
    }
}

impl Drop for Raw {
    /// Whatever a panic left behind: containers, cgroups (the temp dir goes with `dir`).
    fn drop(&mut self) {
        if let Ok(out) = Command::new("runsc")
            .args(self.short_globals())
            .args(["list", "--quiet"])
            .stdin(Stdio::null())
            .output()
        {
            for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = Command::new("runsc")
                    .args(self.short_globals())
                    .args(["delete", "--force", id])
                    .stdin(Stdio::null())
                    .output();
                remove_cgroups(id);
            }
        }
        for c in cgroup_dirs() {
            let _ = std::fs::remove_dir(c.join(RAW_CGROUP_PARENT));
        }
    }
}

/// `/sys/fs/cgroup` and each v1 controller under it.
pub fn cgroup_dirs() -> Vec<PathBuf> {
    let base = PathBuf::from("/sys/fs/cgroup");
    let mut dirs = vec![base.clone()];
    dirs.extend(
        std::fs::read_dir(&base)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_dir()),
    );
    dirs
}

pub fn remove_cgroups(id: &str) {
    for c in cgroup_dirs() {
        let _ = std::fs::remove_dir(c.join(RAW_CGROUP_PARENT).join(id));
    }
}

/// Pids of processes whose argv0 is `runsc*` and one of whose arguments matches.
pub fn runsc_processes(matches: impl Fn(&str) -> bool) -> Vec<i32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let mut args = cmdline.split(|b| *b == 0);
        let argv0 = args.next().unwrap_or_default();
        let name = argv0.rsplit(|b| *b == b'/').next().unwrap_or_default();
        if !name.starts_with(b"runsc") {
            continue;
        }
        if args.any(|a| matches(&String::from_utf8_lossy(a))) {
            pids.push(pid);
        }
    }
    pids
}

/// Total bytes of the regular files under `dir` (as the server's `dir_size`).
pub fn dir_size(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) => total += m.len(),
                Err(_) => {}
            }
        }
    }
    total
}

/// Panics if a runsc process mentioning any of these roots is still running.
pub fn assert_no_runsc_left(roots: &[&Path]) {
    let t0 = Instant::now();
    loop {
        let left: Vec<i32> = roots
            .iter()
            .flat_map(|r| {
                let r = r.display().to_string();
                runsc_processes(move |a| a.contains(&r))
            })
            .collect();
        if left.is_empty() {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "runsc processes of the bench remain: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn machine_facts() -> String {
    let runsc = Command::new("runsc")
        .arg("--version")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("?")
                .to_string()
        })
        .unwrap_or_else(|e| panic!("runsc --version: {e}"));
    let nproc = Command::new("nproc")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|_| "?".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "{runsc}, nproc {nproc}, kernel {}, platform {PLATFORM}",
        kernel.trim()
    )
}
