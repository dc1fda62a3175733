//! What the benches share. Raw `runsc` containers: the same OCI bundle our
//! server wrote, the same global flags as `space-runtime`'s gVisor driver, but
//! no server. Also the bench setup and teardown around our server (started by
//! the test harness, asked everything through `space-client`), the statistics
//! and the table printing. Included by `#[path]` from each bench, next to
//! `mod common` (`../tests/common/mod.rs`).
#![allow(dead_code)]

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use space_api::{CreateSandboxRequest, SandboxState};
use space_client::Client;

use crate::common::{self, TestServer};

/// Longest a create or destroy of ours may take before the bench gives up.
pub const OUR_OP_LIMIT: Duration = Duration::from_secs(600);

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

    /// The global flags our driver gives `runsc create`, `start` and `restore`:
    /// the short ones, then the overlay and CPU ones.
    pub fn globals(&self, id: &str) -> Vec<OsString> {
        let mut flags = self.short_globals();
        flags.extend([
            format!(
                "--overlay2=root:dir={}",
                self.cdir(id).join("overlay").display()
            )
            .into(),
            "--cpu-num-from-quota".into(),
        ]);
        flags
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
        assert_ok(&out, format_args!("runsc {args:?}"));
        out
    }

    /// `runsc create` (or `restore`) with the full global flags, the sandbox
    /// inheriting a console file as stdio, as our driver's `launch`: the
    /// command (not yet run) and the console's path.
    fn launch_command(&self, id: &str, args: &[OsString]) -> (Command, PathBuf) {
        let console_path = self.cdir(id).join("console.log");
        let console = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&console_path)
            .expect("console log");
        let console_err = console.try_clone().expect("console log");
        let mut cmd = Command::new("runsc");
        cmd.args(self.globals(id))
            .args(args)
            .stdin(Stdio::null())
            .stdout(console)
            .stderr(console_err)
            .process_group(0);
        (cmd, console_path)
    }

    /// Runs a [`Raw::launch_command`], panicking unless it succeeds.
    fn run_launch(mut cmd: Command, console_path: &Path, args: &[OsString]) {
        let status = cmd.status().expect("running runsc");
        if !status.success() {
            panic!(
                "runsc {args:?}: {status}\n{}",
                std::fs::read_to_string(console_path).unwrap_or_default()
            );
        }
    }

    /// `runsc create` + `runsc start`, timed together (both commands are set
    /// up, and the console opened, before the clock starts).
    pub fn create_start(&self, id: &str) -> Duration {
        let args: [OsString; 4] = [
            "create".into(),
            "--bundle".into(),
            self.bundle(id).into(),
            id.into(),
        ];
        let (create, console_path) = self.launch_command(id, &args);
        let mut start = Command::new("runsc");
        start
            .args(self.globals(id))
            .arg("start")
            .arg(id)
            .stdin(Stdio::null());
        let t0 = Instant::now();
        Self::run_launch(create, &console_path, &args);
        let out = start.output().expect("running runsc start");
        let took = t0.elapsed();
        assert!(
            out.status.success(),
            "runsc start {id}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(&console_path).unwrap_or_default()
        );
        took
    }

    /// A fresh container `name`, prepared, created and started: its id.
    pub fn start_new(&self, name: &str) -> String {
        let id = self.id(name);
        self.prepare(&id);
        self.create_start(&id);
        id
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
            self.runsc_ok(&["delete", "--force", id]);
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
        let args: [OsString; 7] = [
            "restore".into(),
            "--image-path".into(),
            self.image(id).into(),
            "--bundle".into(),
            self.bundle(id).into(),
            "--detach".into(),
            id.into(),
        ];
        let (cmd, console_path) = self.launch_command(id, &args);
        Self::run_launch(cmd, &console_path, &args);
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

    /// `runsc exec <id> /bin/true` with stdout to /dev/null, timed; panics
    /// unless it succeeds.
    pub fn exec_true(&self, id: &str) -> Duration {
        let mut cmd = Command::new("runsc");
        cmd.args(self.short_globals())
            .arg("exec")
            .arg(id)
            .arg("/bin/true")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let t0 = Instant::now();
        let out = cmd.output().expect("running runsc exec");
        let took = t0.elapsed();
        assert_ok(&out, format_args!("runsc exec {id} /bin/true"));
        took
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

/// Panics unless `out` (of `what`) succeeded, with its status and stderr.
fn assert_ok(out: &Output, what: std::fmt::Arguments) {
    assert!(
        out.status.success(),
        "{what}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
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

/// Runs `f`; what it returned and the CPU charged to the container cgroup `parent/id`
/// meanwhile (`None` where the cgroup's CPU cannot be read).
pub fn cpu_over<T>(parent: &str, id: &str, f: impl FnOnce() -> T) -> (T, Option<Duration>) {
    let before = cgroup_cpu(parent, id);
    let out = f();
    let spent = cgroup_cpu(parent, id)
        .zip(before)
        .map(|(after, before)| after - before);
    (out, spent)
}

/// CPU time charged so far to the container cgroup `parent/id` (cgroup v1's cpuacct, or
/// v2's `cpu.stat`): what a sandbox spends, its Sentry and its processes together.
pub fn cgroup_cpu(parent: &str, id: &str) -> Option<Duration> {
    let base = PathBuf::from("/sys/fs/cgroup");
    if let Ok(ns) = std::fs::read_to_string(
        base.join("cpuacct")
            .join(parent)
            .join(id)
            .join("cpuacct.usage"),
    ) {
        return ns.trim().parse().ok().map(Duration::from_nanos);
    }
    let stat = std::fs::read_to_string(base.join(parent).join(id).join("cpu.stat")).ok()?;
    stat.lines()
        .find_map(|l| l.strip_prefix("usage_usec "))
        .and_then(|v| v.trim().parse().ok())
        .map(Duration::from_micros)
}

/// The `cpuset.cpus` file of the container cgroup `parent/id` (v1's cpuset controller, or
/// v2's unified tree where the controller is delegated); `None` where there is none.
fn cpuset_file(parent: &str, id: &str) -> Option<PathBuf> {
    let f = space_runtime::cpus::cpuset_parent(parent)
        .join(id)
        .join("cpuset.cpus");
    f.exists().then_some(f)
}

/// The CPUs the container cgroup `parent/id` may run on, as its `cpuset.cpus` says
/// (`None` where it has no cpuset).
pub fn cgroup_cpus(parent: &str, id: &str) -> Option<String> {
    let text = std::fs::read_to_string(cpuset_file(parent, id)?).ok()?;
    Some(text.trim().to_string()).filter(|t| !t.is_empty())
}

/// Sets the CPUs of the container cgroup `parent/id` (a `cpuset.cpus` list such as `0` or
/// `0-1`); whether it took. Tasks already in the cgroup move with it.
pub fn set_cgroup_cpus(parent: &str, id: &str, cpus: &str) -> bool {
    cpuset_file(parent, id).is_some_and(|f| std::fs::write(f, cpus).is_ok())
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

/// Checks that the busybox template exists, then the bench's tokio runtime
/// and the machine facts (printed to stderr).
pub fn bench_start() -> (tokio::runtime::Runtime, String) {
    let templates = common::templates_dir();
    assert!(
        templates.join("busybox").join("template.json").is_file(),
        "no busybox template in {}; run scripts/bench.sh (or `space admin prepare-template busybox --templates-dir {}`)",
        templates.display(),
        templates.display()
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");

    let facts = machine_facts();
    eprintln!("bench: {facts}");
    (rt, facts)
}

/// `flags` for the bench's server, with `--cpu-pinning` added when `SPACE_BENCH_CPU_PINNING`
/// is set (the server's own default leaves sandboxes free to run on any CPU). Says which.
pub fn server_flags<'a>(flags: &[&'a str]) -> Vec<&'a str> {
    let mut all = flags.to_vec();
    if std::env::var_os("SPACE_BENCH_CPU_PINNING").is_some() {
        all.push("--cpu-pinning");
    }
    eprintln!("bench: our server runs with {all:?}");
    all
}

/// A client of the bench's server: its own connections, the harness's token, and
/// the harness's per-request deadline.
pub fn client_of(server: &TestServer) -> Client {
    Client::builder(&server.url, common::TOKEN)
        .timeout(Duration::from_secs(600))
        .build()
        .expect("a client of the bench's server")
}

/// Creates one of our sandboxes and waits until it runs: its id.
pub async fn create_ours(c: &Client, req: &CreateSandboxRequest) -> String {
    c.create_sandbox_and_wait(req, OUR_OP_LIMIT)
        .await
        .unwrap_or_else(|e| panic!("creating {req:?}: {e}"))
}

/// A busybox sandbox of ours on the default runtime (gVisor: what the raw side runs).
pub async fn create_busybox(c: &Client) -> String {
    let req = CreateSandboxRequest {
        template: "busybox".into(),
        ..Default::default()
    };
    create_ours(c, &req).await
}

/// Destroys one of our sandboxes, waits, and checks that nothing of it is left.
pub async fn destroy_ours(c: &Client, server: &TestServer, sb: &str) {
    c.destroy_sandbox_and_wait(sb, OUR_OP_LIMIT)
        .await
        .unwrap_or_else(|e| panic!("destroying {sb}: {e}"));
    let state = c.sandbox(sb).await.expect("the destroyed sandbox").state;
    assert_eq!(state, SandboxState::Destroyed, "{sb}");
    server.assert_nothing_left(sb);
}

/// `sh -c script` in our sandbox with `wait:true` (its exit code unchecked).
pub async fn sh(c: &Client, sb: &str, script: &str) -> space_api::Command {
    c.run(sb, &["/bin/sh", "-c", script])
        .await
        .unwrap_or_else(|e| panic!("sh -c {script:?} in {sb}: {e}"))
}

/// The OCI bundle dir of our sandbox `ours`.
pub fn our_bundle(server: &TestServer, ours: &str) -> PathBuf {
    server
        .data_dir()
        .join("sandboxes")
        .join(ours)
        .join("bundle")
}

/// The raw side of a bench: raw containers of our sandbox's bundle
/// (`our_bundle`) with our server's agent.
pub fn raw_of(server: &TestServer, our_bundle: &Path) -> Raw {
    let config: Value = serde_json::from_slice(
        &std::fs::read(our_bundle.join("config.json")).expect("reading our config.json"),
    )
    .expect("our config.json is JSON");
    Raw::new(
        &config,
        &server.data_dir().join("agent").join("space-agent"),
    )
}

/// What [`teardown`] leaves to check.
pub struct Leftovers {
    pub raw_root: PathBuf,
    pub data_dir: PathBuf,
}

/// Destroys our sandbox and deletes the raw container, drops both sides, then
/// checks that no runsc process of either is left running.
pub fn teardown(
    rt: &tokio::runtime::Runtime,
    server: TestServer,
    c: &Client,
    ours: &str,
    raw: Raw,
    rid: &str,
) -> Leftovers {
    rt.block_on(destroy_ours(c, &server, ours));
    raw.delete(rid);
    let server_root = server.runsc_root();
    let raw_root = raw.root.clone();
    let data_dir = server.data_dir().to_path_buf();
    drop(raw);
    drop(server);
    assert_no_runsc_left(&[&server_root, &raw_root]);
    Leftovers { raw_root, data_dir }
}

/// Panics if the raw runsc root, our data dir or the raw container's cgroups remain.
pub fn assert_nothing_left(left: &Leftovers, rid: &str) {
    for d in [&left.raw_root, &left.data_dir] {
        assert!(!d.exists(), "{} remains", d.display());
    }
    for c in cgroup_dirs() {
        let cg = c.join(RAW_CGROUP_PARENT).join(rid);
        assert!(!cg.exists(), "raw cgroup {} remains", cg.display());
    }
}

/// Our sandbox still runs commands: `echo ok` through the API.
pub async fn check_ours(c: &Client, sb: &str) {
    let cmd = c
        .run(sb, &["echo", "ok"])
        .await
        .unwrap_or_else(|e| panic!("echo ok in {sb}: {e}"));
    assert_eq!(
        cmd.result.as_ref().and_then(|r| r.exit_code),
        Some(0),
        "{cmd:?}"
    );
    assert_eq!(cmd.stdout.as_deref(), Some("ok\n"), "{cmd:?}");
}

/// The raw container still runs commands: `runsc exec echo ok`.
pub fn check_raw(raw: &Raw, id: &str) {
    let (_, out) = raw.exec(id, &["/bin/echo", "ok"]);
    assert_eq!(out, "ok\n", "raw {id}");
}

/// Nearest-rank percentile.
pub fn percentile(samples: &[Duration], p: usize) -> Duration {
    let mut v = samples.to_vec();
    v.sort();
    let rank = (p * v.len()).div_ceil(100).max(1);
    v[rank - 1]
}

/// Lower median (nearest rank).
pub fn median<T: Ord + Copy>(v: &[T]) -> T {
    let mut v = v.to_vec();
    v.sort();
    v[(v.len() - 1) / 2]
}

pub fn max<T: Ord + Copy>(v: &[T]) -> T {
    *v.iter().max().expect("samples")
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The title, machine and column lines of a bench's table.
pub fn table_head(bench: &str, facts: &str) {
    println!();
    println!("space {bench} benchmark: ours vs raw runsc, same bundle, same run");
    println!("machine: {facts}");
    println!(
        "{:<38} {:<7} {:>12} {:>14} {:>8}",
        "metric", "stat", "ours", "raw runsc", "ratio"
    );
}

/// A table row with both sides and their ratio.
pub fn row(metric: &str, stat: &str, ours: f64, raw: f64, unit: &str) {
    println!(
        "{:<38} {:<7} {:>12} {:>14} {:>7.2}x",
        metric,
        stat,
        format!("{ours:.1} {unit}"),
        format!("{raw:.1} {unit}"),
        ours / raw
    );
}

/// A table row without a ratio (a side may be `n/a`).
pub fn one_side(metric: &str, stat: &str, ours: String, raw: String) {
    println!("{metric:<38} {stat:<7} {ours:>12} {raw:>14}");
}

/// Two rows of latencies in ms: the p50 (labelled `p50`) and the p95.
pub fn p50_p95_rows(metric: &str, p50: &str, ours: &[Duration], raw: &[Duration]) {
    row(
        metric,
        p50,
        ms(percentile(ours, 50)),
        ms(percentile(raw, 50)),
        "ms",
    );
    row(
        metric,
        "p95",
        ms(percentile(ours, 95)),
        ms(percentile(raw, 95)),
        "ms",
    );
}
