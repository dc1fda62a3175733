//! The template store against the real tools: busybox-static, mmdebstrap, flock(1), chroot.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use space_runtime::template::{Template, TemplateError, TemplateStore};

/// A throwaway directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let mut random = [0u8; 8];
        getrandom::getrandom(&mut random).expect("random bytes");
        let hex: String = random.iter().map(|b| format!("{b:02x}")).collect();
        let path = std::env::temp_dir().join(format!("space-tpl-test-{tag}-{hex}"));
        fs::create_dir_all(&path).expect("create temp dir");
        Self(path)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir_all(&self.0) {
            eprintln!("cannot remove {}: {e}", self.0.display());
        }
    }
}

/// Collects progress lines.
#[derive(Clone, Default)]
struct Progress(Arc<Mutex<Vec<String>>>);

impl Progress {
    fn sink(&self) -> impl Fn(String) + Send + Sync + 'static {
        let lines = self.0.clone();
        move |line| lines.lock().unwrap().push(line)
    }
    fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
    fn built(&self, name: &str) -> bool {
        let prefix = format!("building {name}");
        self.lines().iter().any(|l| l.starts_with(&prefix))
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn mode(path: &Path) -> u32 {
    fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o7777
}

fn assert_empty_dir(path: &Path) {
    let meta = fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(meta.is_dir(), "{} is not a directory", path.display());
    let entries: Vec<_> = fs::read_dir(path)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(
        entries.is_empty(),
        "{} is not empty: {entries:?}",
        path.display()
    );
}

/// The mount points every template must have, empty (except /run, which Debian fills).
fn assert_mount_points(rootfs: &Path) {
    for dir in [
        ".space",
        ".space/bin",
        ".space/run",
        "proc",
        "dev",
        "sys",
        "tmp",
        "run",
    ] {
        let path = rootfs.join(dir);
        assert!(path.is_dir(), "missing mount point /{dir}");
        if dir != "run" && dir != ".space" {
            assert_empty_dir(&path);
        }
    }
    assert_eq!(mode(&rootfs.join("tmp")), 0o1777);
}

/// Runs `sh -c script` chrooted into `rootfs` and returns its stdout.
fn chroot(rootfs: &Path, shell: &str, script: &str) -> String {
    let out = Command::new("chroot")
        .arg(rootfs)
        .args([shell, "-c", script])
        .env_clear()
        .env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        )
        .stdin(Stdio::null())
        .output()
        .expect("run chroot");
    assert!(
        out.status.success(),
        "chroot {script:?} failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

fn leftover_build_dirs(root: &Path) -> Vec<String> {
    fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".build-"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busybox_builds_once_with_mount_points_and_applets() {
    let dir = TempDir::new("busybox");
    let store = TemplateStore::new(dir.path().join("templates")).unwrap();
    assert!(store.root().is_absolute());
    assert!(store.get("busybox").unwrap().is_none());

    let progress = Progress::default();
    let tpl = store.ensure("busybox", &progress.sink()).await.unwrap();
    assert!(progress.built("busybox"), "{:?}", progress.lines());

    assert_eq!(tpl.name, "busybox");
    assert!(tpl.version.starts_with("1-"), "{}", tpl.version);
    assert_eq!(tpl.rootfs, store.root().join("busybox/rootfs"));
    assert!(tpl.rootfs.is_absolute());
    assert!(tpl
        .env
        .iter()
        .any(|(k, v)| k == "PATH" && v.contains("/bin")));
    assert!(tpl.size_bytes > 500_000, "size {}", tpl.size_bytes);
    time::OffsetDateTime::parse(
        &tpl.created_at,
        &time::format_description::well_known::Rfc3339,
    )
    .expect("created_at is RFC 3339");
    assert!(store.root().join("busybox/template.json").is_file());
    assert!(leftover_build_dirs(store.root()).is_empty());

    let rootfs = &tpl.rootfs;
    assert_mount_points(rootfs);
    assert!(fs::metadata(rootfs.join("bin/busybox")).unwrap().is_file());
    for applet in [
        "sh", "env", "sleep", "cat", "head", "true", "id", "ls", "mkdir", "kill", "ps",
    ] {
        let link = rootfs.join("bin").join(applet);
        assert_eq!(
            fs::read_link(&link).unwrap_or_else(|e| panic!("/bin/{applet}: {e}")),
            Path::new("busybox")
        );
    }
    for dir in ["usr/bin", "sbin", "usr/sbin"] {
        assert!(rootfs.join(dir).is_dir(), "missing /{dir}");
    }
    let passwd = fs::read_to_string(rootfs.join("etc/passwd")).unwrap();
    assert!(passwd.contains("root:x:0:0:root:/root:/bin/sh\n"));
    assert!(passwd.contains("user:x:1000:1000:user:/home/user:/bin/sh\n"));
    let group = fs::read_to_string(rootfs.join("etc/group")).unwrap();
    assert!(group.contains("root:x:0:\n") && group.contains("user:x:1000:\n"));
    assert_eq!(mode(&rootfs.join("root")), 0o700);
    let home = fs::metadata(rootfs.join("home/user")).unwrap();
    assert_eq!((home.uid(), home.gid()), (1000, 1000));

    if is_root() {
        let out = chroot(
            rootfs,
            "/bin/sh",
            "id -u; id -un user; echo hello | head -n 1; ls /.space",
        );
        assert_eq!(out, "0\nuser\nhello\nbin\nrun\n");
    } else {
        eprintln!("not root: skipping the chroot check");
    }

    // A second ensure, from this store or a fresh one, finds the template and builds nothing.
    let again = Progress::default();
    assert_eq!(store.ensure("busybox", &again.sink()).await.unwrap(), tpl);
    let other = TemplateStore::new(store.root()).unwrap();
    assert_eq!(other.ensure("busybox", &again.sink()).await.unwrap(), tpl);
    assert!(again.lines().is_empty(), "{:?}", again.lines());
    assert_eq!(store.get("busybox").unwrap(), Some(tpl));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_ensure_builds_once() {
    let dir = TempDir::new("concurrent");
    let root = dir.path().join("templates");
    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    let tasks: Vec<_> = (0..2)
        .map(|_| {
            let store = TemplateStore::new(&root).unwrap();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                let progress = Progress::default();
                barrier.wait().await;
                let tpl = store.ensure("busybox", &progress.sink()).await;
                (tpl, progress)
            })
        })
        .collect();
    let mut results = Vec::new();
    for task in tasks {
        let (tpl, progress) = task.await.unwrap();
        results.push((tpl.unwrap(), progress));
    }
    let builds = results.iter().filter(|(_, p)| p.built("busybox")).count();
    assert_eq!(
        builds,
        1,
        "{:?}",
        results.iter().map(|(_, p)| p.lines()).collect::<Vec<_>>()
    );
    assert_eq!(results[0].0, results[1].0);
    assert!(leftover_build_dirs(&root).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_waits_for_a_lock_held_by_another_process() {
    let dir = TempDir::new("flock");
    let store = TemplateStore::new(dir.path()).unwrap();
    let lock = store.root().join(".busybox.lock");
    // flock(1) stands in for another server: it holds the lock until its stdin closes.
    let mut holder = Command::new("flock")
        .arg(&lock)
        .args(["sh", "-c", "echo locked; cat >/dev/null"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run flock");
    let mut stdout = std::io::BufReader::new(holder.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
    assert_eq!(line, "locked\n");

    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let waiter = {
        let store = store.clone();
        tokio::spawn(async move {
            let send = move |line: String| {
                let _ = tx.send(line);
            };
            store.ensure("busybox", &send).await
        })
    };
    let first = rx.recv().await.expect("a progress line");
    assert!(first.starts_with("waiting for another build"), "{first}");
    assert!(!waiter.is_finished());
    assert!(store.get("busybox").unwrap().is_none());

    drop(holder.stdin.take());
    assert!(holder.wait().unwrap().success());
    let tpl = waiter.await.unwrap().unwrap();
    assert!(tpl.rootfs.join("bin/busybox").is_file());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupted_builds_are_cleaned_up() {
    let dir = TempDir::new("stale");
    let store = TemplateStore::new(dir.path()).unwrap();
    let root = store.root();
    // A crashed build of busybox, a half-published busybox without metadata, and a build of
    // another template whose name starts the same way (which must be left alone).
    let stale = root.join(".build-busybox-0123456789abcdef");
    fs::create_dir_all(stale.join("rootfs/bin")).unwrap();
    fs::write(stale.join("rootfs/bin/junk"), "x").unwrap();
    fs::create_dir_all(root.join("busybox/rootfs")).unwrap();
    let foreign = root.join(".build-busybox-x-0123456789abcdef");
    fs::create_dir_all(&foreign).unwrap();

    assert!(store.get("busybox").unwrap().is_none());
    let tpl = store.ensure("busybox", &|_| {}).await.unwrap();
    assert!(!stale.exists());
    assert!(foreign.exists());
    assert!(tpl.rootfs.join("bin/sh").symlink_metadata().is_ok());
    assert_eq!(
        leftover_build_dirs(root),
        vec![".build-busybox-x-0123456789abcdef"]
    );
}

#[tokio::test]
async fn unknown_and_invalid_names_are_rejected() {
    let dir = TempDir::new("names");
    let store = TemplateStore::new(dir.path()).unwrap();
    assert!(matches!(
        store.get("nope"),
        Err(TemplateError::UnknownTemplate(n)) if n == "nope"
    ));
    let err = store.ensure("nope", &|_| {}).await.unwrap_err();
    assert!(matches!(err, TemplateError::UnknownTemplate(_)), "{err:?}");
    assert_eq!(err.to_string(), "unknown template \"nope\"");

    for bad in [
        "",
        "../etc",
        "Debian",
        "a/b",
        ".hidden",
        "-x",
        &"x".repeat(64),
    ] {
        assert!(
            matches!(store.get(bad), Err(TemplateError::InvalidName(_))),
            "get {bad:?}"
        );
        let err = store.ensure(bad, &|_| {}).await.unwrap_err();
        assert!(
            matches!(err, TemplateError::InvalidName(_)),
            "ensure {bad:?}: {err:?}"
        );
    }
    // Nothing was created for any of them (the layer cache is made, private, at start).
    let entries: Vec<String> = fs::read_dir(store.root())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != ".layers")
        .collect();
    assert!(entries.is_empty(), "{entries:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_shows_builtins_and_ready_templates() {
    let dir = TempDir::new("list");
    let store = TemplateStore::new(dir.path()).unwrap();
    assert_eq!(
        TemplateStore::BUILTIN,
        &["busybox", "debian", "code-interpreter"]
    );

    let list = store.list().unwrap();
    let names: Vec<_> = list.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(names, ["busybox", "code-interpreter", "debian"]);
    assert!(list
        .iter()
        .all(|i| i.builtin && !i.ready && i.template.is_none()));

    let busybox = store.ensure("busybox", &|_| {}).await.unwrap();

    // A template that is not built-in but ready on disk (as a snapshot-made template would be).
    let custom = Template {
        name: "custom".to_owned(),
        rootfs: PathBuf::from("/somewhere/else"),
        ..busybox.clone()
    };
    fs::create_dir_all(store.root().join("custom/rootfs")).unwrap();
    fs::write(
        store.root().join("custom/template.json"),
        serde_json::to_vec(&custom).unwrap(),
    )
    .unwrap();
    // A directory without metadata is not a template.
    fs::create_dir_all(store.root().join("unfinished/rootfs")).unwrap();

    let list = store.list().unwrap();
    let summary: Vec<_> = list
        .iter()
        .map(|i| (i.name.as_str(), i.ready, i.builtin))
        .collect();
    assert_eq!(
        summary,
        [
            ("busybox", true, true),
            ("code-interpreter", false, true),
            ("custom", true, false),
            ("debian", false, true)
        ]
    );
    assert_eq!(list[0].template.as_ref(), Some(&busybox));
    let got = store.get("custom").unwrap().expect("custom is ready");
    assert_eq!(got.rootfs, store.root().join("custom/rootfs"));
    assert!(matches!(
        store.get("unfinished"),
        Err(TemplateError::UnknownTemplate(_))
    ));
}

/// The real Debian build: about a minute and needs the Debian mirror.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debian_builds_with_python_and_user() {
    let dir = TempDir::new("debian");
    let store = TemplateStore::new(dir.path()).unwrap();
    let progress = Progress::default();
    let started = std::time::Instant::now();
    let result = store
        .ensure("debian", &|line: String| {
            eprintln!("debian: {line}");
            progress.sink()(line)
        })
        .await;
    let tpl = result.unwrap_or_else(|e| {
        let mut msg = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(cause) = source {
            msg.push_str(&format!(": {cause}"));
            source = cause.source();
        }
        panic!("debian build failed: {msg}")
    });
    eprintln!(
        "debian {} built in {:.1}s, {} MB",
        tpl.version,
        started.elapsed().as_secs_f64(),
        tpl.size_bytes / 1_000_000
    );
    assert!(progress.built("debian"));
    assert!(progress
        .lines()
        .iter()
        .any(|l| l.starts_with("mmdebstrap: ")));

    let rootfs = &tpl.rootfs;
    assert_mount_points(rootfs);
    assert!(rootfs.join("usr/bin/python3").exists());
    assert!(rootfs.join("usr/bin/git").exists());
    assert!(rootfs.join("usr/bin/curl").exists());
    assert!(tpl.env.contains(&("LANG".to_owned(), "C.UTF-8".to_owned())));
    let passwd = fs::read_to_string(rootfs.join("etc/passwd")).unwrap();
    assert!(passwd.contains("user:x:1000:1000:user:/home/user:/bin/bash\n"));
    let home = fs::metadata(rootfs.join("home/user")).unwrap();
    assert_eq!((home.uid(), home.gid()), (1000, 1000));
    assert!(rootfs.join("home/user/.bashrc").is_file());
    let lists: Vec<_> = fs::read_dir(rootfs.join("var/lib/apt/lists"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n != "lock" && n != "partial")
        .collect();
    assert!(lists.is_empty(), "apt lists left: {lists:?}");
    assert!(tpl.size_bytes < 400_000_000, "size {}", tpl.size_bytes);
    assert!(leftover_build_dirs(store.root()).is_empty());

    if is_root() {
        let out = chroot(
            rootfs,
            "/bin/bash",
            "id user; python3 -c 'print(6 * 7)'; \
             setpriv --reuid=1000 --regid=1000 --clear-groups bash -c 'id -u; test -w ~user && echo writable'",
        );
        assert_eq!(
            out,
            "uid=1000(user) gid=1000(user) groups=1000(user)\n42\n1000\nwritable\n"
        );
    } else {
        eprintln!("not root: skipping the chroot check");
    }
}

/// Pids of processes whose command line mentions `needle`.
fn processes_mentioning(needle: &str) -> Vec<u32> {
    let me = std::process::id();
    fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != me)
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(needle))
        })
        .collect()
}

/// Dropping `ensure` mid-build kills the build tool and everything it started, and leaves no mount.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_debian_build_leaves_no_process_or_mount() {
    let dir = TempDir::new("cancel");
    let store = TemplateStore::new(dir.path()).unwrap();
    let root = store.root().to_string_lossy().into_owned();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let build = {
        let store = store.clone();
        tokio::spawn(async move {
            let send = move |line: String| {
                let _ = tx.send(line);
            };
            store.ensure("debian", &send).await
        })
    };
    while let Some(line) = rx.recv().await {
        // By then apt and dpkg run under mmdebstrap, in a chroot with proc and sys mounted.
        if line.starts_with("mmdebstrap: ") && line.contains("installing") {
            break;
        }
    }
    assert!(
        !processes_mentioning(&root).is_empty(),
        "mmdebstrap is not running"
    );
    build.abort();
    assert!(build.await.unwrap_err().is_cancelled());

    // SIGKILL is asynchronous: give the kernel a bounded time to reap the group.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let left = processes_mentioning(&root);
        if left.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "processes left: {left:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&root), "mounts left under {root}");
    assert!(store.get("debian").unwrap().is_none());
}
