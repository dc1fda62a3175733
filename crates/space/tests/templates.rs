//! Template builds from recipes, end to end: real server, real runsc (steps run in gVisor),
//! busybox bases so it stays fast. Every recipe carries a nonce so the shared layer cache
//! never hides a build from a test; every test deletes its templates and checks that no
//! build container, sandbox or template directory is left.

mod common;

use std::path::Path;
use std::process::Command;

use common::{TestServer, TOKEN};
use futures::StreamExt;
use serde_json::{json, Value};

/// A name and a nonce unique to this test run.
fn unique(prefix: &str) -> (String, String) {
    let mut b = [0u8; 6];
    getrandom(&mut b);
    let nonce: String = b.iter().map(|x| format!("{x:02x}")).collect();
    (format!("{prefix}-{nonce}"), nonce)
}

fn getrandom(buf: &mut [u8]) {
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .expect("random");
}

/// Posts a recipe (expecting 202) and waits for the build; returns the operation and its log.
async fn build(s: &TestServer, recipe: Value) -> (Value, String) {
    let (status, op) = s.post("/v1/templates", recipe.clone()).await;
    assert_eq!(status, 202, "{op}");
    assert_eq!(op["kind"], "build");
    assert_eq!(op["sandbox_id"], Value::Null);
    assert_eq!(op["template"], recipe["name"]);
    let id = op["id"].as_str().unwrap().to_string();
    let op = s.wait_op(&id).await;
    (op, log(s, &id, false).await)
}

async fn log(s: &TestServer, op: &str, follow: bool) -> String {
    let resp = s
        .req(
            reqwest::Method::GET,
            &format!("/v1/operations/{op}/log?follow={follow}"),
        )
        .send()
        .await
        .expect("log");
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    resp.text().await.expect("log text")
}

/// The `==> step …` lines of a build log.
fn step_lines(log: &str) -> Vec<&str> {
    log.lines().filter(|l| l.starts_with("==> step")).collect()
}

async fn template(s: &TestServer, name: &str) -> Option<Value> {
    let (status, list) = s.get("/v1/templates").await;
    assert_eq!(status, 200);
    list["templates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == name)
        .cloned()
}

async fn delete_template(s: &TestServer, name: &str) {
    let resp = s
        .req(reqwest::Method::DELETE, &format!("/v1/templates/{name}"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 204, "{}", resp.text().await.unwrap());
    assert!(template(s, name).await.is_none());
    assert!(!common::templates_dir().join(name).exists());
    let lock = common::templates_dir().join(format!(".{name}.lock"));
    assert!(!lock.exists(), "{} is left", lock.display());
}

/// Removes the cached layers that builds of `names` made (their keys hold this run's nonces, so
/// no other test uses them), keeping the shared template cache from growing run after run.
fn remove_layers_of(names: &[&str]) {
    let layers = common::templates_dir().join(".layers");
    for e in std::fs::read_dir(&layers).into_iter().flatten().flatten() {
        let Ok(meta) = std::fs::read(e.path().join("layer.json")) else {
            continue;
        };
        let meta: Value = serde_json::from_slice(&meta).unwrap_or_default();
        if names.iter().any(|n| meta["template"] == *n) {
            std::fs::remove_dir_all(e.path()).unwrap();
            let lock = layers.join(format!(".{}.lock", e.file_name().to_string_lossy()));
            let _ = std::fs::remove_file(lock);
        }
    }
    for n in names {
        let _ = std::fs::remove_file(common::templates_dir().join(format!(".{n}.lock")));
    }
}

/// No build container or its processes, and no half-built layer of this server's builds.
fn assert_no_build_left(s: &TestServer) {
    let root = s.data_dir().join("build-runsc");
    let out = Command::new("runsc")
        .arg("--root")
        .arg(&root)
        .args(["list", "--quiet"])
        .output()
        .expect("runsc list");
    let list = String::from_utf8_lossy(&out.stdout);
    assert!(list.trim().is_empty(), "build containers remain: {list}");
    let procs: Vec<_> = common::processes_mentioning(&root.to_string_lossy());
    assert!(procs.is_empty(), "build processes remain: {procs:?}");
}

async fn sh_out(s: &TestServer, sb: &str, script: &str) -> String {
    let cmd = s.sh(sb, script).await;
    assert_eq!(cmd["result"]["exit_code"], 0, "{cmd}");
    cmd["stdout"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn build_cache_versions_and_delete() {
    let s = TestServer::start().await;
    let (name, nonce) = unique("tpl");
    let recipe = |step2: &str, hello: &str| {
        json!({
            "name": name,
            "base": "busybox",
            "files": [
                {"path": "/opt/app/hello.txt", "content": format!("{hello} {nonce}\n")},
                {"path": "/opt/app/bin.dat", "content_base64": "AAEC/w==", "mode": 0o600, "uid": 1000, "gid": 1000}
            ],
            "steps": [
                {"run": "echo step-one-output; cat hello.txt > /opt/app/copied.txt"},
                {"run": step2}
            ],
            "env": {"GREETING": "hi-from-recipe"},
            "workdir": "/opt/app",
            "user": "user",
            "resources": {"memory_mib": 256}
        })
    };

    // First build: every layer is built; step output lands in the log.
    let (status, op) = s
        .post(
            "/v1/templates",
            recipe("echo v1 > /opt/app/version", "hello"),
        )
        .await;
    assert_eq!(status, 202, "{op}");
    let op_id = op["id"].as_str().unwrap().to_string();
    let followed = log(&s, &op_id, true).await; // streams until the build ends
    let op = s.wait_op(&op_id).await;
    assert_eq!(op["status"], "succeeded", "{op}\n{followed}");
    assert!(
        followed.lines().any(|l| l == "step-one-output"),
        "{followed}"
    );
    assert!(followed.contains("published"), "{followed}");
    let steps = step_lines(&followed);
    assert_eq!(steps.len(), 4, "{followed}");
    assert!(steps[0].contains("step 1/4: base busybox"), "{followed}");
    for line in &steps[1..] {
        assert!(!line.contains("[cached]"), "{followed}");
    }
    assert!(steps[2].contains("step 3/4: run: echo step-one-output"));
    let t = template(&s, &name).await.expect("listed");
    assert_eq!(t["version"], "v1");
    assert_eq!(t["versions"], json!(["v1"]));
    assert_eq!(t["builtin"], false);
    assert_eq!(t["base"], "busybox");
    assert!(t["size_bytes"].as_u64().unwrap() > 0);

    // A sandbox of it sees the files, the step's work, the env and the workdir.
    let old = s.create(&name).await;
    let (_, sb) = s.get(&format!("/v1/sandboxes/{old}")).await;
    assert_eq!(sb["template_version"], "v1");
    assert_eq!(
        sb["resources"]["memory_mib"], 256,
        "template default resources"
    );
    let out = sh_out(
        &s,
        &old,
        "pwd; id -u; echo $GREETING; cat copied.txt version; stat -c '%a %u %s' bin.dat",
    )
    .await;
    assert_eq!(
        out,
        format!("/opt/app\n1000\nhi-from-recipe\nhello {nonce}\nv1\n600 1000 4\n")
    );

    // Unchanged: every layer cached, no new version.
    let (op, log2) = build(&s, recipe("echo v1 > /opt/app/version", "hello")).await;
    assert_eq!(op["status"], "succeeded", "{op}");
    assert!(
        op["progress"].as_str().unwrap().starts_with("unchanged"),
        "{op}"
    );
    let steps = step_lines(&log2);
    assert_eq!(steps.len(), 4, "{log2}");
    assert!(steps.iter().all(|l| l.ends_with("[cached]")), "{log2}");
    assert!(!log2.lines().any(|l| l == "step-one-output"), "{log2}");
    assert_eq!(template(&s, &name).await.unwrap()["version"], "v1");

    // Step 2 changed: base, files and step 1 cached, step 2 rebuilt → v2.
    let (op, log3) = build(&s, recipe("echo v2 > /opt/app/version", "hello")).await;
    assert_eq!(op["status"], "succeeded", "{op}\n{log3}");
    let steps = step_lines(&log3);
    assert!(steps[..3].iter().all(|l| l.ends_with("[cached]")), "{log3}");
    assert!(!steps[3].ends_with("[cached]"), "{log3}");
    let t = template(&s, &name).await.unwrap();
    assert_eq!(t["version"], "v2");
    assert_eq!(t["versions"], json!(["v1", "v2"]));

    // The old sandbox keeps v1; a new one gets v2.
    let new = s.create(&name).await;
    let (_, sb) = s.get(&format!("/v1/sandboxes/{new}")).await;
    assert_eq!(sb["template_version"], "v2");
    assert_eq!(sh_out(&s, &old, "cat version").await, "v1\n");
    assert_eq!(sh_out(&s, &new, "cat version").await, "v2\n");

    // A template built on it (template:NAME) starts from its current version.
    let (child, _) = unique("child");
    let (op, clog) = build(
        &s,
        json!({"name": child, "base": format!("template:{name}"),
               "steps": [{"run": "cat /opt/app/version > /from-parent"}]}),
    )
    .await;
    assert_eq!(op["status"], "succeeded", "{op}\n{clog}");
    let sb = s.create(&child).await;
    assert_eq!(sh_out(&s, &sb, "cat /from-parent").await, "v2\n");
    s.destroy(&sb).await;
    delete_template(&s, &child).await;

    // In use → 409 naming the sandbox; once destroyed, delete works.
    let (status, err) = s.delete(&format!("/v1/templates/{name}")).await;
    assert_eq!(status, 409, "{err}");
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(msg.contains(&old) || msg.contains(&new), "{msg}");
    s.destroy(&old).await;
    s.destroy(&new).await;
    delete_template(&s, &name).await;
    let (status, _) = s.delete(&format!("/v1/templates/{name}")).await;
    assert_eq!(status, 404);
    assert!(!common::templates_dir()
        .join(format!(".{name}.lock"))
        .exists());
    let (status, err) = s.delete("/v1/templates/busybox").await;
    assert_eq!(status, 409, "built-ins stay: {err}");
    assert_no_build_left(&s);
    remove_layers_of(&[&name, &child]);
}

#[tokio::test]
async fn concurrent_builds_of_one_recipe_build_each_layer_once() {
    let s = TestServer::start().await;
    let (name, nonce) = unique("conc");
    let recipe = json!({"name": name, "base": "busybox", "steps": [
        {"run": format!("echo {nonce} > /n; sleep 1")},
        {"run": "echo second-step"}
    ]});
    let (a, b) = tokio::join!(build(&s, recipe.clone()), build(&s, recipe.clone()));
    for (op, log) in [&a, &b] {
        assert_eq!(op["status"], "succeeded", "{op}\n{log}");
    }
    // Whatever the interleaving, each layer was built by exactly one of the two builds.
    for step in ["step 2/3", "step 3/3"] {
        let built = [&a.1, &b.1]
            .iter()
            .flat_map(|l| step_lines(l))
            .filter(|l| l.contains(step) && !l.ends_with("[cached]"))
            .count();
        assert_eq!(built, 1, "{step}:\n{}\n---\n{}", a.1, b.1);
    }
    let t = template(&s, &name).await.unwrap();
    assert_eq!(t["versions"], json!(["v1"]), "one version: {t}");
    delete_template(&s, &name).await;
    remove_layers_of(&[&name]);
    assert_no_build_left(&s);
}

#[tokio::test]
async fn a_server_killed_mid_build_leaves_no_container_and_no_layer() {
    let mut s = TestServer::start().await;
    let (name, nonce) = unique("crash");
    let (status, op) = s
        .post(
            "/v1/templates",
            json!({"name": name, "base": "busybox", "steps": [
                {"run": format!("echo {nonce} > /n; echo step-running; sleep 300")}
            ]}),
        )
        .await;
    assert_eq!(status, 202, "{op}");
    let op_id = op["id"].as_str().unwrap().to_string();
    // Follow the log until the step runs inside its container.
    let mut log = s.client().build_log(&op_id, true).await.unwrap();
    let mut seen = String::new();
    while !seen.contains("step-running\n") {
        let chunk = log.next().await.expect("log ended early").unwrap();
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    drop(log);
    s.kill_and_restart();
    let op = s.wait_op(&op_id).await;
    assert_eq!(op["status"], "failed", "{op}");
    assert!(template(&s, &name).await.is_none());
    // The restarted server removed the container; its runsc processes go with it.
    let root = s.data_dir().join("build-runsc");
    for _ in 0..100 {
        if common::processes_mentioning(&root.to_string_lossy()).is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_no_build_left(&s);
    // The half-built layer was never published; remove it (the next build of it would).
    let layers = common::templates_dir().join(".layers");
    for e in std::fs::read_dir(&layers).unwrap().flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if std::fs::read_to_string(e.path().join("rootfs/n")).is_ok_and(|c| c.contains(&nonce)) {
            assert!(
                n.starts_with(".tmp-"),
                "a layer with the step's work was published: {n}"
            );
            std::fs::remove_dir_all(e.path()).unwrap();
        }
    }
}

#[tokio::test]
async fn failing_step_fails_the_build_with_its_log() {
    let s = TestServer::start().await;
    let (name, nonce) = unique("fail");
    let (op, log) = build(
        &s,
        json!({"name": name, "base": "busybox", "steps": [
            {"run": format!("echo ok {nonce}")},
            {"run": "echo about-to-fail; echo oops >&2; exit 7"},
            {"run": "echo never"}
        ]}),
    )
    .await;
    assert_eq!(op["status"], "failed", "{op}");
    assert_eq!(op["error"]["code"], "build_failed");
    let msg = op["error"]["message"].as_str().unwrap();
    assert!(msg.contains("step 3/4"), "{msg}");
    assert!(msg.contains("exited with code 7"), "{msg}");
    assert!(msg.contains("oops"), "the log tail: {msg}");
    assert!(
        log.contains("about-to-fail") && log.contains("oops"),
        "{log}"
    );
    assert!(!log.contains("never"), "{log}");
    assert!(template(&s, &name).await.is_none(), "nothing published");
    assert!(!common::templates_dir().join(&name).exists());
    // No half layer stays behind.
    let layers = common::templates_dir().join(".layers");
    for e in std::fs::read_dir(&layers).unwrap().flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if n.starts_with(".tmp-") {
            // Another test's build may be in flight; ours are gone once the op failed.
            assert!(
                !e.path().join("rootfs/never").exists(),
                "half layer {n} left"
            );
        }
    }
    assert_no_build_left(&s);
    remove_layers_of(&[&name]);
}

#[tokio::test]
async fn bad_recipes_are_refused_and_create_nothing() {
    let s = TestServer::start().await;
    let (name, _) = unique("bad");
    let (_, before) = s.get("/v1/operations?limit=1000").await;
    for (body, code) in [
        (json!({"name": name, "base": "busybox", "bogus": 1}), 400),
        (json!({"name": "Bad_Name", "base": "busybox"}), 400),
        (json!({"name": "../x", "base": "busybox"}), 400),
        (json!({"name": name, "base": "alpine:3"}), 400),
        (
            json!({"name": name, "base": "busybox", "packages": ["vim"]}),
            400,
        ),
        (
            json!({"name": name, "base": "template:no-such-template-xyz"}),
            400,
        ),
        (json!({"name": "busybox", "base": "busybox"}), 400),
        (
            json!({"name": name, "base": "busybox", "files": [{"path": "relative"}]}),
            400,
        ),
        (
            json!({"name": name, "base": "busybox", "files": [{"path": "/a", "contents": "x"}]}),
            400,
        ),
        (
            json!({"name": name, "base": "busybox", "steps": [{"run": ""}]}),
            400,
        ),
        (
            json!({"name": name, "base": "busybox", "start": {"run": "x", "ready": {"run": "y", "timeout_seconds": 0}}}),
            400,
        ),
        // Host paths without --template-import-dir: 403 naming the flag.
        (json!({"name": name, "base": "dir:/tmp"}), 403),
    ] {
        let (status, err) = s.post("/v1/templates", body.clone()).await;
        assert_eq!(status, code, "{body} → {err}");
        if code == 403 {
            assert!(
                err["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("--template-import-dir"),
                "{err}"
            );
        }
    }
    let resp = s
        .req(reqwest::Method::POST, "/v1/templates")
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let (_, after) = s.get("/v1/operations?limit=1000").await;
    assert_eq!(before, after, "no operation was created");
    assert!(template(&s, &name).await.is_none());
    assert!(!common::templates_dir().join(&name).exists());
}

/// A tiny root filesystem: the host's static busybox as /bin/sh, and a marker file.
fn tiny_root(dir: &Path, marker: &str) {
    std::fs::create_dir_all(dir.join("bin")).unwrap();
    std::fs::create_dir_all(dir.join("data")).unwrap();
    std::fs::copy("/bin/busybox", dir.join("bin/busybox")).unwrap();
    for applet in ["sh", "cat", "ls", "test"] {
        std::os::unix::fs::symlink("busybox", dir.join("bin").join(applet)).unwrap();
    }
    std::fs::write(dir.join("data/marker"), marker).unwrap();
}

#[tokio::test]
async fn dir_and_tar_bases_from_the_import_dir() {
    let import = tempfile::Builder::new()
        .prefix("space-import")
        .tempdir_in("/tmp")
        .unwrap();
    let s =
        TestServer::start_with(&["--template-import-dir", import.path().to_str().unwrap()]).await;
    let (name, nonce) = unique("imp");
    let root = import.path().join("root");
    tiny_root(&root, &nonce);
    let tar = import.path().join("root.tar");
    let st = Command::new("tar")
        .arg("-cf")
        .arg(&tar)
        .arg("-C")
        .arg(&root)
        .arg(".")
        .status()
        .unwrap();
    assert!(st.success());

    for (kind, path) in [("dir", &root), ("tar", &tar)] {
        let tname = format!("{name}-{kind}");
        let (op, log) = build(
            &s,
            json!({"name": tname, "base": format!("{kind}:{}", path.display()),
                   "steps": [{"run": "cat /data/marker > /data/seen"}]}),
        )
        .await;
        assert_eq!(op["status"], "succeeded", "{op}\n{log}");
        let sb = s.create(&tname).await;
        let cmd = s.run(&sb, &["/bin/cat", "/data/seen"]).await;
        assert_eq!(cmd["stdout"], nonce.as_str(), "{cmd}");
        s.destroy(&sb).await;
        delete_template(&s, &tname).await;
    }

    // Outside the import dir (directly, or through a link or '..'): 403, nothing created.
    std::os::unix::fs::symlink("/etc", import.path().join("etc-link")).unwrap();
    for path in [
        "/etc".to_string(),
        format!("{}/etc-link", import.path().display()),
        format!("{}/../", import.path().display()),
    ] {
        let (status, err) = s
            .post(
                "/v1/templates",
                json!({"name": name, "base": format!("dir:{path}")}),
            )
            .await;
        assert_eq!(status, 403, "{path}: {err}");
    }
    let (status, err) = s
        .post(
            "/v1/templates",
            json!({"name": name, "base": "tar:relative/path.tar"}),
        )
        .await;
    assert_eq!(status, 400, "{err}");
    assert!(template(&s, &name).await.is_none());
    assert_no_build_left(&s);
    remove_layers_of(&[&format!("{name}-dir"), &format!("{name}-tar")]);
}

fn sha256_file(path: &Path) -> String {
    let out = Command::new("sha256sum").arg(path).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// Writes `content` as a blob of the layout and returns its descriptor.
fn blob(layout: &Path, media: &str, file: &Path) -> Value {
    let digest = sha256_file(file);
    let dir = layout.join("blobs/sha256");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(file, dir.join(&digest)).unwrap();
    json!({"mediaType": media, "digest": format!("sha256:{digest}"),
           "size": std::fs::metadata(file).unwrap().len()})
}

#[tokio::test]
async fn oci_layout_layers_and_whiteouts() {
    let import = tempfile::Builder::new()
        .prefix("space-oci")
        .tempdir_in("/tmp")
        .unwrap();
    let s =
        TestServer::start_with(&["--template-import-dir", import.path().to_str().unwrap()]).await;
    let (name, nonce) = unique("oci");
    let work = import.path().join("work");
    // Layer 1: busybox, data/keep, data/gone, data/dir/old.
    let l1 = work.join("l1");
    tiny_root(&l1, &nonce);
    std::fs::write(l1.join("data/keep"), "keep").unwrap();
    std::fs::write(l1.join("data/gone"), "gone").unwrap();
    std::fs::create_dir_all(l1.join("data/dir")).unwrap();
    std::fs::write(l1.join("data/dir/old"), "old").unwrap();
    // Layer 2: whiteout of data/gone, opaque data/dir with a fresh file, and data/new.
    let l2 = work.join("l2");
    std::fs::create_dir_all(l2.join("data/dir")).unwrap();
    std::fs::write(l2.join("data/.wh.gone"), "").unwrap();
    std::fs::write(l2.join("data/dir/.wh..wh..opq"), "").unwrap();
    std::fs::write(l2.join("data/dir/fresh"), "fresh").unwrap();
    std::fs::write(l2.join("data/new"), "new").unwrap();

    let layout = import.path().join("layout");
    std::fs::create_dir_all(&layout).unwrap();
    let mut layers = Vec::new();
    for l in ["l1", "l2"] {
        let tgz = work.join(format!("{l}.tar.gz"));
        let st = Command::new("tar")
            .arg("-czf")
            .arg(&tgz)
            .arg("-C")
            .arg(work.join(l))
            .arg(".")
            .status()
            .unwrap();
        assert!(st.success());
        layers.push(blob(
            &layout,
            "application/vnd.oci.image.layer.v1.tar+gzip",
            &tgz,
        ));
    }
    let config = work.join("config.json");
    std::fs::write(
        &config,
        r#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#,
    )
    .unwrap();
    let config = blob(&layout, "application/vnd.oci.image.config.v1+json", &config);
    let manifest = work.join("manifest.json");
    std::fs::write(
        &manifest,
        json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
               "config": config, "layers": layers})
        .to_string(),
    )
    .unwrap();
    let manifest = blob(
        &layout,
        "application/vnd.oci.image.manifest.v1+json",
        &manifest,
    );
    std::fs::write(
        layout.join("index.json"),
        json!({"schemaVersion": 2, "manifests": [manifest]}).to_string(),
    )
    .unwrap();
    std::fs::write(
        layout.join("oci-layout"),
        r#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .unwrap();

    let (op, log) = build(
        &s,
        json!({"name": name, "base": format!("oci:{}", layout.display())}),
    )
    .await;
    assert_eq!(op["status"], "succeeded", "{op}\n{log}");
    let sb = s.create(&name).await;
    let cmd = s.run(&sb, &["/bin/ls", "-a", "/data", "/data/dir"]).await;
    assert_eq!(
        cmd["stdout"], "/data:\n.\n..\ndir\nkeep\nmarker\nnew\n\n/data/dir:\n.\n..\nfresh\n",
        "{cmd}"
    );
    s.destroy(&sb).await;
    delete_template(&s, &name).await;
    assert_no_build_left(&s);
    remove_layers_of(&[&name]);
}

#[tokio::test]
async fn start_command_and_ready_check() {
    let s = TestServer::start().await;
    let (name, nonce) = unique("start");
    let (op, log) = build(
        &s,
        json!({"name": name, "base": "busybox",
               "files": [{"path": "/etc/nonce", "content": nonce}],
               "start": {"run": "sleep 1; echo up > /tmp/ready-marker; exec sleep 1000",
                         "ready": {"run": "test -f /tmp/ready-marker"}}}),
    )
    .await;
    assert_eq!(op["status"], "succeeded", "{op}\n{log}");
    // The create ends only once the ready check passed.
    let sb = s.create(&name).await;
    let cmd = s.sh(&sb, "cat /tmp/ready-marker").await;
    assert_eq!(cmd["stdout"], "up\n", "{cmd}");
    let (_, cmds) = s.get(&format!("/v1/sandboxes/{sb}/commands")).await;
    let start = cmds["commands"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| {
            c["argv"][2]
                .as_str()
                .unwrap_or_default()
                .contains("ready-marker; exec")
        })
        .cloned()
        .expect("the start command is a command of the sandbox");
    assert_eq!(start["state"], "running", "{start}");
    s.destroy(&sb).await;

    // A ready check that never passes: the create fails with start_failed.
    let (bad, _) = unique("never");
    let (op, log) = build(
        &s,
        json!({"name": bad, "base": "busybox",
               "files": [{"path": "/etc/nonce", "content": nonce}],
               "start": {"run": "echo starting-up; exec sleep 1000",
                         "ready": {"run": "false", "timeout_seconds": 1}}}),
    )
    .await;
    assert_eq!(op["status"], "succeeded", "{op}\n{log}");
    let (status, op) = s.post("/v1/sandboxes", json!({"template": bad})).await;
    assert_eq!(status, 202, "{op}");
    let sb = op["sandbox_id"].as_str().unwrap().to_string();
    let op = s.wait_op(op["id"].as_str().unwrap()).await;
    assert_eq!(op["status"], "failed", "{op}");
    assert_eq!(op["error"]["code"], "start_failed", "{op}");
    let msg = op["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("starting-up"),
        "the start command's output: {msg}"
    );
    let (_, rec) = s.get(&format!("/v1/sandboxes/{sb}")).await;
    assert_eq!(rec["state"], "failed", "{rec}");
    s.destroy(&sb).await;
    delete_template(&s, &name).await;
    delete_template(&s, &bad).await;
    remove_layers_of(&[&name, &bad]);
    assert_no_build_left(&s);
}

#[tokio::test]
async fn cli_template_build_ls_rm() {
    let s = TestServer::start().await;
    let (name, nonce) = unique("cli");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("payload.bin"), [0u8, 1, 2, 255]).unwrap();
    std::fs::write(
        dir.path().join("recipe.toml"),
        format!(
            r#"name = "{name}"
base = "busybox"
workdir = "/srv"

[env]
NONCE = "{nonce}"

[[files]]
path = "/srv/payload.bin"
src = "payload.bin"

[[steps]]
run = "echo cli-step-ran; wc -c < /srv/payload.bin > /srv/size"
"#
        ),
    )
    .unwrap();
    let cli = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_space"))
            .args(args)
            .env("SPACE_URL", &s.url)
            .env("SPACE_TOKEN", TOKEN)
            .output()
            .expect("run the CLI")
    };
    let recipe = dir.path().join("recipe.toml");
    let out = cli(&["template", "build", "-f", recipe.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("cli-step-ran"),
        "the log is printed: {stdout}"
    );
    let out = cli(&["template", "ls"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains(&name));

    let sb = s.create(&name).await;
    assert_eq!(
        sh_out(&s, &sb, "cat size; echo $NONCE").await,
        format!("4\n{nonce}\n")
    );
    s.destroy(&sb).await;

    // A failing build exits non-zero.
    std::fs::write(
        &recipe,
        format!(
            "name = \"{name}\"\nbase = \"busybox\"\n[[steps]]\nrun = \"echo {nonce}; exit 3\"\n"
        ),
    )
    .unwrap();
    let out = cli(&["template", "build", "-f", recipe.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("exited with code 3"));

    let out = cli(&["template", "rm", &name]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(template(&s, &name).await.is_none());
    assert_no_build_left(&s);
    remove_layers_of(&[&name]);
}

/// `POST path {name}` and a wait for the operation to succeed.
async fn snapshot(s: &TestServer, path: &str, name: &str) -> Value {
    let (st, op) = s.post(path, json!({ "name": name })).await;
    assert_eq!(st, 202, "{op}");
    assert_eq!(op["kind"], "build");
    let op = s.wait_op(op["id"].as_str().unwrap()).await;
    assert_eq!(op["status"], "succeeded", "{op}");
    op
}

#[tokio::test]
async fn snapshot_template_turns_a_sandbox_into_a_new_version() {
    let s = TestServer::start().await;
    let (name, _) = unique("snap");
    let sb = s.create("busybox").await;
    sh_out(
        &s,
        &sb,
        "mkdir -p /data/sub && echo one > /data/sub/f && chmod 600 /data/sub/f && chown 1000:1000 /data/sub/f \
         && ln -s sub/f /data/link && echo tmp > /tmp/scratch",
    )
    .await;

    // Bad requests change nothing.
    let path = format!("/v1/sandboxes/{sb}/snapshot-template");
    for (body, want) in [
        (json!({"name": "Bad Name!"}), 400),
        (json!({"name": "busybox"}), 409),
        (json!({"name": name, "colour": 1}), 400),
        (json!({}), 400),
    ] {
        let (st, v) = s.post(&path, body.clone()).await;
        assert_eq!(st, want, "{body}: {v}");
    }
    let (st, _) = s
        .post(
            "/v1/sandboxes/sb_aaaaaaaaaaaaaaaaaaaa/snapshot-template",
            json!({"name": name}),
        )
        .await;
    assert_eq!(st, 404);
    assert!(template(&s, &name).await.is_none());

    snapshot(&s, &path, &name).await;
    let t = template(&s, &name).await.expect("the new template");
    assert_eq!(t["version"], "v1", "{t}");
    assert_eq!(t["base"], format!("sandbox:{sb}"), "{t}");

    // A sandbox of it has the files, modes, owners and links; /proc and the agent work.
    let child = s.create(&name).await;
    let out = sh_out(
        &s,
        &child,
        "cat /data/link; stat -c '%a %u' /data/sub/f; cat /tmp/scratch 2>/dev/null; ls /proc/self/exe >/dev/null && echo proc-ok",
    )
    .await;
    assert_eq!(
        out, "one\n600 1000\nproc-ok\n",
        "/tmp is a mount point, emptied"
    );

    // Change the source, snapshot again: v2; the child of v1 is unaffected.
    sh_out(&s, &sb, "echo two > /data/sub/f").await;
    snapshot(&s, &path, &name).await;
    assert_eq!(template(&s, &name).await.unwrap()["version"], "v2");
    let child2 = s.create(&name).await;
    assert_eq!(sh_out(&s, &child2, "cat /data/sub/f").await, "two\n");
    assert_eq!(sh_out(&s, &child, "cat /data/sub/f").await, "one\n");

    // A paused sandbox cannot be copied.
    let (_, op) = s
        .post(&format!("/v1/sandboxes/{sb}/pause"), json!({}))
        .await;
    s.wait_op(op["id"].as_str().unwrap()).await;
    let (st, v) = s.post(&path, json!({ "name": name })).await;
    assert_eq!(st, 409, "{v}");

    for id in [&sb, &child, &child2] {
        s.destroy(id).await;
    }
    delete_template(&s, &name).await;
    remove_layers_of(&[&name]);
}

#[tokio::test]
async fn debian_base_with_extra_packages() {
    // mmdebstrap from Debian's mirror, like the built-in debian template (the suite's set-up
    // builds that one too, so the mirror is reachable wherever this runs).
    let s = TestServer::start().await;
    let (name, nonce) = unique("deb");
    let (op, log) = build(
        &s,
        json!({
            "name": name,
            "base": "debian:bookworm",
            "packages": ["jq"],
            "steps": [{"run": format!("echo '{{\"n\":\"{nonce}\"}}' | jq -r .n > /opt-nonce")}]
        }),
    )
    .await;
    assert_eq!(op["status"], "succeeded", "{op}\n{log}");
    let sb = s.create(&name).await;
    let out = sh_out(
        &s,
        &sb,
        "cat /opt-nonce; jq --version; python3 -c 'print(6*7)'",
    )
    .await;
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some(nonce.as_str()), "{out}");
    assert!(lines.next().is_some_and(|l| l.starts_with("jq-")), "{out}");
    assert_eq!(lines.next(), Some("42"), "{out}");
    s.destroy(&sb).await;
    delete_template(&s, &name).await;
    remove_layers_of(&[&name]);
    assert_no_build_left(&s);
}

/// No build VM of this server is left: no QEMU process of its build VMs' directories, no
/// directory or marker of one.
fn assert_no_build_vm_left(s: &TestServer) {
    let vms = s.data_dir().join("microvm/vms");
    let procs = common::processes_mentioning(&vms.join(".spacebuild-").to_string_lossy());
    assert!(procs.is_empty(), "build VM processes remain: {procs:?}");
    let left: Vec<String> = std::fs::read_dir(&vms)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("spacebuild-"))
        .collect();
    assert!(left.is_empty(), "build VM files remain: {left:?}");
}

/// A server whose template build steps run in microVMs (`--build-runtime microvm`), or `None`
/// when the microVM runtime is not available here (a failure where it is required).
async fn microvm_builder(extra: &[&str]) -> Option<TestServer> {
    {
        let probe = TestServer::start().await;
        if !probe.runtime_available("microvm").await {
            return None;
        }
    }
    let mut args = vec!["--build-runtime", "microvm"];
    args.extend_from_slice(extra);
    Some(TestServer::start_with(&args).await)
}

/// Issue 12, point 5: a host without gVisor builds templates in microVMs. The step's files
/// come out with their owners, modes, links and hard links; `/tmp` is not kept, as under
/// gVisor; a failing step fails the build with its log; nothing of the VMs is left.
#[tokio::test]
async fn build_steps_run_in_microvms() {
    let Some(s) = microvm_builder(&[]).await else {
        return;
    };
    let (name, nonce) = unique("vmbuild");
    let (op, log) = build(
        &s,
        json!({"name": name, "base": "busybox", "steps": [
            {"run": format!("mkdir -p /opt/app && echo {nonce} > /opt/app/data && chown 1234:5678 /opt/app/data && chmod 640 /opt/app/data")},
            {"run": "ln -s data /opt/app/link && ln /opt/app/data /opt/app/hard && chmod 4755 /bin/busybox; echo scratch > /tmp/scratch; uname -r; echo to-stderr >&2"},
            {"run": "test \"$(pwd)\" = /etc && test \"$HOME\" = /root && test \"$BUILT_WITH\" = microvm && echo step-env-ok"}
        ], "env": {"BUILT_WITH": "microvm"}, "workdir": "/etc"}),
    )
    .await;
    assert_eq!(op["status"], "succeeded", "{op}\n{log}");
    assert!(log.contains("==> microVM spacebuild-"), "{log}");
    assert!(
        log.contains("to-stderr") && log.contains("step-env-ok"),
        "{log}"
    );
    assert_no_build_vm_left(&s);

    // The template runs where sandboxes run (gVisor here), with what the steps left.
    let sb = s.create_with(json!({"template": name})).await;
    let out = sh_out(
        &s,
        &sb,
        "cat /opt/app/data; stat -c '%u:%g %a' /opt/app/data; readlink /opt/app/link; \
         stat -c '%h' /opt/app/hard; stat -c '%a' /bin/busybox; ls -A /tmp; \
         test -e /lost+found && echo lost+found; echo end",
    )
    .await;
    assert_eq!(
        out,
        format!("{nonce}\n1234:5678 640\ndata\n2\n4755\nend\n"),
        "the layer's files"
    );
    s.destroy(&sb).await;

    // A failing step: its exit code and log tail, nothing published, no VM left.
    let (bad, _) = unique("vmfail");
    let (op, log) = build(
        &s,
        json!({"name": bad, "base": "busybox", "steps": [
            {"run": format!("echo about-to-fail {nonce}; echo oops >&2; exit 7")}
        ]}),
    )
    .await;
    assert_eq!(op["status"], "failed", "{op}");
    assert_eq!(op["error"]["code"], "build_failed");
    let msg = op["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("exited with code 7") && msg.contains("oops"),
        "{msg}"
    );
    assert!(log.contains("about-to-fail"), "{log}");
    assert!(template(&s, &bad).await.is_none());
    assert_no_build_vm_left(&s);

    delete_template(&s, &name).await;
    remove_layers_of(&[&name, &bad]);
}

/// The build limits hold in a microVM too: a step past its timeout is killed, a step that
/// leaves more than the disk quota fails (sparse files count), and each leaves nothing.
#[tokio::test]
async fn microvm_build_steps_keep_their_limits() {
    let Some(s) = microvm_builder(&[
        "--build-step-timeout-seconds",
        "20",
        "--build-disk-mib",
        "64",
    ])
    .await
    else {
        return;
    };
    let (slow, nonce) = unique("vmslow");
    let (op, _) = build(
        &s,
        json!({"name": slow, "base": "busybox", "steps": [
            {"run": format!("echo {nonce}; sleep 600")}
        ]}),
    )
    .await;
    assert_eq!(op["status"], "failed", "{op}");
    let msg = op["error"]["message"].as_str().unwrap();
    assert!(msg.contains("timeout"), "{msg}");
    assert_no_build_vm_left(&s);

    let (big, nonce) = unique("vmbig");
    let (op, log) = build(
        &s,
        json!({"name": big, "base": "busybox", "steps": [
            {"run": format!("echo {nonce}; truncate -s 1G /sparse")}
        ]}),
    )
    .await;
    assert_eq!(op["status"], "failed", "{op}\n{log}");
    let msg = op["error"]["message"].as_str().unwrap();
    assert!(msg.contains("MiB more file data"), "{msg}");
    assert!(template(&s, &big).await.is_none());
    assert_no_build_vm_left(&s);
    remove_layers_of(&[&slow, &big]);
}

/// A server killed in the middle of a microVM build step: the restarted server removes the
/// VM (its QEMU outlives the server) and fails the build.
#[tokio::test]
async fn a_server_killed_mid_microvm_build_leaves_no_vm() {
    let Some(mut s) = microvm_builder(&[]).await else {
        return;
    };
    let (name, nonce) = unique("vmcrash");
    let (status, op) = s
        .post(
            "/v1/templates",
            json!({"name": name, "base": "busybox", "steps": [
                {"run": format!("echo {nonce}; echo step-running; sleep 600")}
            ]}),
        )
        .await;
    assert_eq!(status, 202, "{op}");
    let op_id = op["id"].as_str().unwrap().to_string();
    let mut log = s.client().build_log(&op_id, true).await.unwrap();
    let mut seen = String::new();
    while !seen.contains("step-running\n") {
        let chunk = log.next().await.expect("log ended early").unwrap();
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    drop(log);
    let vms = s.data_dir().join("microvm/vms");
    assert!(
        !common::processes_mentioning(&vms.join(".spacebuild-").to_string_lossy()).is_empty(),
        "the step's VM runs"
    );
    s.kill_and_restart();
    let op = s.wait_op(&op_id).await;
    assert_eq!(op["status"], "failed", "{op}");
    assert!(template(&s, &name).await.is_none());
    assert_no_build_vm_left(&s);
    remove_layers_of(&[&name]);
}
