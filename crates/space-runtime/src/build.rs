//! Template builds from recipes: a base, files and shell steps, each one an immutable layer.
//!
//! Every layer is keyed by the SHA-256 of its parent's key and the canonical JSON of its own
//! input (for host imports also a cheap fingerprint of the source: paths, sizes, mtimes), and
//! lives under `<templates root>/.layers/<key>/rootfs`. A layer starts as a copy of its parent
//! (`cp -a --reflink=auto`), is built in a private `.tmp-<key>-<hex>` directory under an flock
//! on `.<key>.lock`, and is renamed into place only when complete: a rebuild finds every
//! unchanged layer already there, two builds of one layer run one after the other, and a
//! crash leaves no half layer. Steps run inside gVisor (`runsc run`, no network, the layer copy
//! as a writable root) as root, with the recipe's env and workdir; their output goes to the
//! build log. The finished top layer becomes a new version of the template
//! ([`TemplateStore::publish_version`]).

use std::collections::{BTreeMap, VecDeque};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use base64::Engine;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::template::{
    add_mount_points, blocking, chown, finish_debian, fsync_dir, hex, is_builtin, make_dir,
    remove_tree, run_mmdebstrap, validate_name, write_atomic, BuildLock, DefaultResources,
    IoContext, StartSpec, Template, TemplateError, TemplateStore,
};

/// Largest recipe body the server accepts (files are inlined in it).
pub const MAX_RECIPE_BYTES: usize = 32 << 20;
/// Bumped when the way layers are made changes, so old cache entries are not reused.
const LAYER_FORMAT: &str = "1";
const MAX_FILES: usize = 1000;
const MAX_STEPS: usize = 100;
const MAX_SCRIPT_BYTES: usize = 64 * 1024;
const MAX_PACKAGES: usize = 200;
const MAX_ENV: usize = 256;
/// Longest a single step may run.
pub const DEFAULT_STEP_TIMEOUT: Duration = Duration::from_secs(15 * 60);
/// Longest a ready check may be given.
const MAX_READY_TIMEOUT: u64 = 3600;
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
const DEBIAN_BASE: &str = "debian:bookworm";
const LOG_TAIL_LINES: usize = 20;

/// `POST /v1/templates`: how to build a template.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    pub name: String,
    /// `busybox`, `debian:bookworm`, `template:NAME`, `dir:PATH`, `tar:PATH` or `oci:PATH`.
    pub base: String,
    /// Extra Debian packages (only with `debian:bookworm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub packages: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files: Option<Vec<RecipeFile>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<Vec<RecipeStep>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<DefaultResources>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<StartSpec>,
}

/// A file written into the template (after the base, before the steps).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecipeFile {
    /// Absolute path inside the template.
    pub path: String,
    /// UTF-8 content.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Binary content, base64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_base64: Option<String>,
    /// Default 0644.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
}

/// One shell step, run by `/bin/sh -c` as root inside a gVisor sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecipeStep {
    pub run: String,
}

/// What a recipe builds on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Base {
    /// The built-in `busybox` template.
    Busybox,
    /// `mmdebstrap --variant=minbase` like the built-in debian, plus the recipe's packages.
    Debian,
    /// The current version of another template.
    Template(String),
    Dir(PathBuf),
    Tar(PathBuf),
    Oci(PathBuf),
}

/// A recipe that was refused.
#[derive(Debug, thiserror::Error)]
pub enum RecipeError {
    #[error("{0}")]
    Invalid(String),
    /// A host path outside the allowed import directories (or imports are off).
    #[error("{0}")]
    Forbidden(String),
}

/// A checked recipe, ready to build.
#[derive(Debug, Clone)]
pub struct ValidRecipe {
    pub recipe: Recipe,
    pub base: Base,
    files: Vec<FileEntry>,
}

#[derive(Debug, Clone, Serialize)]
struct FileEntry {
    path: String,
    #[serde(skip)]
    content: Vec<u8>,
    /// In the cache key instead of the content itself.
    sha256: String,
    mode: u32,
    uid: u32,
    gid: u32,
}

impl ValidRecipe {
    pub fn name(&self) -> &str {
        &self.recipe.name
    }
}

/// Checks a recipe: names, sizes, paths, and that host paths lie under one of `import_dirs`.
pub fn validate(recipe: Recipe, import_dirs: &[PathBuf]) -> Result<ValidRecipe, RecipeError> {
    let bad = |m: String| Err(RecipeError::Invalid(m));
    validate_name(&recipe.name).map_err(|e| RecipeError::Invalid(e.to_string()))?;
    if is_builtin(&recipe.name) {
        return bad(format!(
            "template {:?} is built in: choose another name",
            recipe.name
        ));
    }
    let base = match recipe.base.split_once(':') {
        None if recipe.base == "busybox" => Base::Busybox,
        Some(_) if recipe.base == DEBIAN_BASE => Base::Debian,
        Some(("template", name)) => {
            validate_name(name).map_err(|e| RecipeError::Invalid(format!("base: {e}")))?;
            if name == recipe.name {
                return bad("a template cannot be its own base".into());
            }
            Base::Template(name.to_owned())
        }
        Some(("dir", p)) => Base::Dir(import_path("dir", p, import_dirs)?),
        Some(("tar", p)) => Base::Tar(import_path("tar", p, import_dirs)?),
        Some(("oci", p)) => Base::Oci(import_path("oci", p, import_dirs)?),
        _ => {
            return bad(format!(
                "invalid base {:?}: use busybox, {DEBIAN_BASE}, template:NAME, dir:PATH, tar:PATH or oci:PATH",
                cut(&recipe.base, 200)
            ))
        }
    };
    if let Some(packages) = &recipe.packages {
        if base != Base::Debian && !packages.is_empty() {
            return bad(format!("packages need the {DEBIAN_BASE} base"));
        }
        if packages.len() > MAX_PACKAGES {
            return bad(format!("at most {MAX_PACKAGES} packages"));
        }
        for p in packages {
            let ok = !p.is_empty()
                && p.len() <= 100
                && p.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
                && p.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+-.:".contains(&b));
            if !ok {
                return bad(format!("invalid package name {:?}", cut(p, 100)));
            }
        }
    }
    let mut files = Vec::new();
    let recipe_files = recipe.files.as_deref().unwrap_or_default();
    if recipe_files.len() > MAX_FILES {
        return bad(format!("at most {MAX_FILES} files"));
    }
    for f in recipe_files {
        check_abs_path("files[].path", &f.path)?;
        let content = match (&f.content, &f.content_base64) {
            (Some(_), Some(_)) => {
                return bad(format!(
                    "file {}: give content or content_base64, not both",
                    cut(&f.path, 200)
                ))
            }
            (Some(c), None) => c.as_bytes().to_vec(),
            (None, Some(b)) => base64::engine::general_purpose::STANDARD
                .decode(b)
                .map_err(|e| {
                    RecipeError::Invalid(format!(
                        "file {}: invalid content_base64: {e}",
                        cut(&f.path, 200)
                    ))
                })?,
            (None, None) => Vec::new(),
        };
        let mode = f.mode.unwrap_or(0o644);
        if mode > 0o7777 {
            return bad(format!("file {}: mode above 07777", cut(&f.path, 200)));
        }
        files.push(FileEntry {
            path: f.path.clone(),
            sha256: hex(&Sha256::digest(&content)),
            content,
            mode,
            uid: f.uid.unwrap_or(0),
            gid: f.gid.unwrap_or(0),
        });
    }
    let steps = recipe.steps.as_deref().unwrap_or_default();
    if steps.len() > MAX_STEPS {
        return bad(format!("at most {MAX_STEPS} steps"));
    }
    for (i, s) in steps.iter().enumerate() {
        check_script(&format!("steps[{i}].run"), &s.run)?;
    }
    if let Some(env) = &recipe.env {
        if env.len() > MAX_ENV {
            return bad(format!("at most {MAX_ENV} environment variables"));
        }
        for (k, v) in env {
            let ok = !k.is_empty()
                && k.len() <= 256
                && !k.contains(['=', '\0'])
                && !k.as_bytes()[0].is_ascii_digit()
                && v.len() <= 32 * 1024
                && !v.contains('\0');
            if !ok {
                return bad(format!("invalid environment variable {:?}", cut(k, 64)));
            }
        }
    }
    if let Some(w) = &recipe.workdir {
        check_abs_path("workdir", w)?;
    }
    if let Some(u) = &recipe.user {
        let ok = !u.is_empty()
            && u.len() <= 32
            && u.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b));
        if !ok {
            return bad(format!("invalid user {:?}", cut(u, 64)));
        }
    }
    if let Some(r) = &recipe.resources {
        // The same bounds as a sandbox request, so the defaults never make a create fail.
        for (what, v, lo, hi) in [
            ("vcpus", r.vcpus.map(u64::from), 1, 64),
            ("memory_mib", r.memory_mib, 64, 1 << 20),
            ("disk_mib", r.disk_mib, 64, 1 << 24),
            ("pids", r.pids, 16, 1 << 22),
        ] {
            if v.is_some_and(|v| v < lo || v > hi) {
                return bad(format!("resources.{what} must be between {lo} and {hi}"));
            }
        }
    }
    if let Some(start) = &recipe.start {
        check_script("start.run", &start.run)?;
        if let Some(ready) = &start.ready {
            check_script("start.ready.run", &ready.run)?;
            if ready
                .timeout_seconds
                .is_some_and(|t| t == 0 || t > MAX_READY_TIMEOUT)
            {
                return bad(format!(
                    "start.ready.timeout_seconds must be between 1 and {MAX_READY_TIMEOUT}"
                ));
            }
        }
    }
    Ok(ValidRecipe {
        recipe,
        base,
        files,
    })
}

fn check_script(what: &str, s: &str) -> Result<(), RecipeError> {
    if s.trim().is_empty() || s.len() > MAX_SCRIPT_BYTES || s.contains('\0') {
        return Err(RecipeError::Invalid(format!(
            "{what} must be 1 to {MAX_SCRIPT_BYTES} bytes without NUL"
        )));
    }
    Ok(())
}

fn check_abs_path(what: &str, p: &str) -> Result<(), RecipeError> {
    let ok = p.starts_with('/')
        && p.len() <= 4096
        && !p.contains('\0')
        && Path::new(p)
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
        && Path::new(p).components().count() > 1;
    if ok {
        Ok(())
    } else {
        Err(RecipeError::Invalid(format!(
            "{what} {:?} must be an absolute path without '..' (and not /)",
            cut(p, 200)
        )))
    }
}

/// A host path to import from: absolute, and (after resolving links) under an import directory.
fn import_path(kind: &str, raw: &str, import_dirs: &[PathBuf]) -> Result<PathBuf, RecipeError> {
    if import_dirs.is_empty() {
        return Err(RecipeError::Forbidden(format!(
            "{kind}: bases read host paths, which this server does not allow: start it with --template-import-dir DIR"
        )));
    }
    let path = Path::new(raw);
    if !path.is_absolute() || raw.contains('\0') || raw.len() > 4096 {
        return Err(RecipeError::Invalid(format!(
            "{kind}: needs an absolute path, got {:?}",
            cut(raw, 200)
        )));
    }
    let dirs: Vec<PathBuf> = import_dirs
        .iter()
        .map(|d| fs::canonicalize(d).unwrap_or_else(|_| d.clone()))
        .collect();
    let forbidden = || {
        RecipeError::Forbidden(format!(
            "{kind}:{} is not under any --template-import-dir",
            cut(raw, 200)
        ))
    };
    match fs::canonicalize(path) {
        Ok(canon) if dirs.iter().any(|d| canon.starts_with(d)) => Ok(canon),
        Ok(_) => Err(forbidden()),
        // Say whether it exists only for paths inside the allowed directories.
        Err(_)
            if path.components().any(|c| c == Component::ParentDir)
                || !dirs.iter().any(|d| path.starts_with(d)) =>
        {
            Err(forbidden())
        }
        Err(e) => Err(RecipeError::Invalid(format!(
            "{kind}:{}: {e}",
            cut(raw, 200)
        ))),
    }
}

fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The build log of one build: a file that step output is appended to directly.
pub struct BuildLog {
    file: File,
    path: PathBuf,
}

impl BuildLog {
    pub fn create(path: &Path) -> io::Result<BuildLog> {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir)?;
        }
        // O_APPEND: runsc reopens its stdio, and appends keep writers from overwriting each other.
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o644)
            .open(path)?;
        Ok(BuildLog {
            file,
            path: path.to_owned(),
        })
    }

    pub fn line(&self, line: &str) {
        let _ = (&self.file).write_all(format!("{line}\n").as_bytes());
    }

    /// The last lines of the log.
    pub fn tail(&self) -> String {
        tail_of(&self.path, LOG_TAIL_LINES)
    }
}

/// The last `lines` lines of a file (reading at most its last 64 KiB).
pub fn tail_of(path: &Path, lines: usize) -> String {
    let Ok(mut f) = File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Runs recipe builds: where runsc is and how long a step may take.
#[derive(Debug, Clone)]
pub struct Builder {
    pub runsc: PathBuf,
    /// `runsc --root` for build containers.
    pub runsc_root: PathBuf,
    pub platform: String,
    pub step_timeout: Duration,
}

/// A layer: its cache key and its root filesystem.
struct Layer {
    key: String,
    rootfs: PathBuf,
    /// False for a base that is another template's rootfs outside the layer cache.
    in_cache: bool,
}

impl Builder {
    /// Builds `recipe` into a new version of its template (or returns the current version when
    /// nothing changed: `false`). Progress lines go to `progress`, everything to `log`.
    pub async fn build(
        &self,
        store: &TemplateStore,
        recipe: &ValidRecipe,
        log: &BuildLog,
        progress: &(dyn Fn(String) + Send + Sync),
    ) -> Result<(Template, bool), TemplateError> {
        let r = &recipe.recipe;
        let name = r.name.as_str();
        let steps = r.steps.as_deref().unwrap_or_default();
        let total = 1 + usize::from(!recipe.files.is_empty()) + steps.len();
        let layers = store.layers_dir();
        fs::create_dir_all(&layers).at("create", &layers)?;
        let announce = |n: usize, what: &str, cached: bool| {
            let line = format!(
                "step {n}/{total}: {what}{}",
                if cached { " [cached]" } else { "" }
            );
            log.line(&format!("==> {line}"));
            progress(line);
        };
        let mut env: Vec<(String, String)> = r
            .env
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect::<Vec<_>>();
        if !env.iter().any(|(k, _)| k == "PATH") {
            env.insert(0, ("PATH".to_owned(), DEFAULT_PATH.to_owned()));
        }
        let workdir = r.workdir.clone().unwrap_or_else(|| "/".to_owned());

        // Step 1: the base.
        let base_label = format!("base {}", r.base);
        let mut layer = match &recipe.base {
            Base::Busybox | Base::Template(_) => {
                let base_name = match &recipe.base {
                    Base::Template(n) => n.as_str(),
                    _ => "busybox",
                };
                let t = store
                    .ensure(base_name, &|line: String| log.line(&line))
                    .await?;
                announce(1, &format!("{base_label} ({})", t.version), true);
                match &t.layer {
                    Some(key) => Layer {
                        key: key.clone(),
                        rootfs: t.rootfs.clone(),
                        in_cache: true,
                    },
                    None => Layer {
                        key: cache_key(&["builtin", base_name, &t.version]),
                        rootfs: t.rootfs.clone(),
                        in_cache: false,
                    },
                }
            }
            Base::Debian => {
                let mut packages = r.packages.clone().unwrap_or_default();
                packages.sort();
                packages.dedup();
                let key = cache_key(&[LAYER_FORMAT, DEBIAN_BASE, &packages.join(",")]);
                self.layer(
                    name,
                    &layers,
                    key,
                    None,
                    1,
                    &base_label,
                    &announce,
                    log,
                    |rootfs| {
                        let name = name.to_owned();
                        async move {
                            run_mmdebstrap(&name, &rootfs, &packages, &|l| {
                                log.line(&l);
                                progress(format!("step 1/{total}: {l}"));
                            })
                            .await?;
                            blocking(&name, move || finish_debian(&rootfs)).await
                        }
                    },
                )
                .await?
            }
            Base::Dir(p) | Base::Tar(p) | Base::Oci(p) => {
                let kind = match &recipe.base {
                    Base::Dir(_) => "dir",
                    Base::Tar(_) => "tar",
                    _ => "oci",
                };
                let src = p.clone();
                let print = blocking(name, move || fingerprint(&src)).await?;
                let path = p.to_string_lossy().into_owned();
                let key = cache_key(&[LAYER_FORMAT, kind, &path, &print]);
                let src = p.clone();
                let owned = name.to_owned();
                self.layer(
                    name,
                    &layers,
                    key,
                    None,
                    1,
                    &base_label,
                    &announce,
                    log,
                    |rootfs| async move {
                        blocking(&owned.clone(), move || {
                            match kind {
                                "dir" => run_tool(
                                    &owned,
                                    std::process::Command::new("cp")
                                        .args(["-a", "--reflink=auto", "--"])
                                        .arg(src.join("."))
                                        .arg(&rootfs),
                                )?,
                                "tar" => extract_tar(&owned, &src, &rootfs)?,
                                _ => import_oci(&owned, &src, &rootfs)?,
                            }
                            add_mount_points(&rootfs)
                        })
                        .await
                    },
                )
                .await?
            }
        };

        let mut n = 1;
        if !recipe.files.is_empty() {
            n += 1;
            let input = serde_json::to_string(&recipe.files).unwrap_or_default();
            let key = cache_key(&[LAYER_FORMAT, &layer.key, "files", &input]);
            let files = recipe.files.clone();
            let what = format!("files ({})", files.len());
            let owned = name.to_owned();
            layer = self
                .layer(
                    name,
                    &layers,
                    key,
                    Some(&layer),
                    n,
                    &what,
                    &announce,
                    log,
                    |rootfs| async move {
                        blocking(&owned.clone(), move || {
                            for f in &files {
                                write_in_root(&owned, &rootfs, f)?;
                            }
                            Ok(())
                        })
                        .await
                    },
                )
                .await?;
        }

        for step in steps {
            n += 1;
            let input = serde_json::json!({"run": step.run, "env": env, "workdir": workdir});
            let key = cache_key(&[LAYER_FORMAT, &layer.key, "run", &input.to_string()]);
            let what = format!("run: {}", one_line(&step.run));
            let this = n;
            layer = self
                .layer(
                    name,
                    &layers,
                    key,
                    Some(&layer),
                    n,
                    &what,
                    &announce,
                    log,
                    |rootfs| {
                        self.run_step(name, this, total, rootfs, &step.run, &env, &workdir, log)
                    },
                )
                .await?;
        }

        let template = Template {
            name: name.to_owned(),
            version: String::new(),
            rootfs: layer.rootfs.clone(),
            env,
            workdir: r.workdir.clone(),
            user: r.user.clone(),
            size_bytes: 0,
            created_at: String::new(),
            layer: layer.in_cache.then(|| layer.key.clone()),
            resources: r.resources.clone(),
            start: r.start.clone(),
            base: Some(r.base.clone()),
        };
        let (template, new) = store.publish_version(template).await?;
        let line = if new {
            format!("published {name} {}", template.version)
        } else {
            format!("unchanged: {name} stays at {}", template.version)
        };
        log.line(&format!("==> {line}"));
        progress(line);
        Ok((template, new))
    }

    /// The layer `key`: from the cache, or built by `make` in a copy of `parent` (or an empty
    /// directory) under the layer's lock and renamed into place.
    #[allow(clippy::too_many_arguments)]
    async fn layer<F, Fut>(
        &self,
        name: &str,
        layers: &Path,
        key: String,
        parent: Option<&Layer>,
        n: usize,
        what: &str,
        announce: &(dyn Fn(usize, &str, bool) + Send + Sync),
        log: &BuildLog,
        make: F,
    ) -> Result<Layer, TemplateError>
    where
        F: FnOnce(PathBuf) -> Fut,
        Fut: std::future::Future<Output = Result<(), TemplateError>>,
    {
        let dir = layers.join(&key);
        let ready = |dir: &Path| Layer {
            key: key.clone(),
            rootfs: dir.join("rootfs"),
            in_cache: true,
        };
        if dir.exists() {
            announce(n, what, true);
            return Ok(ready(&dir));
        }
        let lock = match BuildLock::try_acquire(layers, &key)? {
            Some(l) => l,
            None => {
                log.line("waiting for another build of the same layer");
                BuildLock::acquire(layers, &key).await?
            }
        };
        if dir.exists() {
            announce(n, what, true);
            return Ok(ready(&dir));
        }
        announce(n, what, false);
        let tmp = {
            let layers = layers.to_owned();
            let key = key.clone();
            let parent = parent.map(|p| p.rootfs.clone());
            blocking(&key.clone(), move || {
                prepare_layer_dir(&layers, &key, parent.as_deref())
            })
            .await?
        };
        let guard = RemoveOnDrop(Some(tmp.clone()));
        make(tmp.join("rootfs")).await?;
        let meta = serde_json::json!({
            "key": key,
            "parent": parent.map(|p| p.key.clone()),
            // Which build made it (layers are shared by key; this is for people and tests).
            "template": name,
            "what": what,
            "created_at": time::OffsetDateTime::now_utc()
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default(),
        });
        {
            let dir = dir.clone();
            let layers = layers.to_owned();
            let tmp = tmp.clone();
            blocking(&key.clone(), move || {
                write_atomic(&tmp.join("layer.json"), meta.to_string().as_bytes())?;
                syncfs(&tmp)?;
                fs::rename(&tmp, &dir).at("publish", &dir)?;
                fsync_dir(&layers)
            })
            .await?;
        }
        std::mem::forget(guard);
        drop(lock);
        Ok(ready(&dir))
    }

    /// Runs one step in a gVisor sandbox whose writable root is `rootfs`.
    #[allow(clippy::too_many_arguments)]
    async fn run_step(
        &self,
        name: &str,
        n: usize,
        total: usize,
        rootfs: PathBuf,
        script: &str,
        env: &[(String, String)],
        workdir: &str,
        log: &BuildLog,
    ) -> Result<(), TemplateError> {
        let fail = |message: String| TemplateError::Build {
            name: name.to_owned(),
            message,
        };
        let Some(tmp) = rootfs.parent().map(Path::to_owned) else {
            return Err(fail("layer directory has no parent".into()));
        };
        let bundle = tmp.join("bundle");
        make_dir(&bundle, 0o700)?;
        let mut random = [0u8; 8];
        getrandom::getrandom(&mut random).map_err(|e| fail(format!("random: {e}")))?;
        let id = format!("spacebuild-{}", hex(&random));
        let spec = step_spec(&rootfs, script, env, workdir);
        let config = bundle.join("config.json");
        fs::write(&config, spec.to_string()).at("write", &config)?;
        fs::create_dir_all(&self.runsc_root).at("create", &self.runsc_root)?;

        let out = log.file.try_clone().at("open", &log.path)?;
        let err = log.file.try_clone().at("open", &log.path)?;
        let mut cmd = tokio::process::Command::new(&self.runsc);
        cmd.arg("--root")
            .arg(&self.runsc_root)
            .arg(format!("--platform={}", self.platform))
            .args(["--network=none", "--overlay2=none", "--ignore-cgroups"])
            .arg("run")
            .arg("--bundle")
            .arg(&bundle)
            .arg(&id)
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .process_group(0)
            .kill_on_drop(true);
        let guard = Container {
            runsc: self.runsc.clone(),
            root: self.runsc_root.clone(),
            id: id.clone(),
        };
        let mut child = cmd.spawn().at("run", &self.runsc)?;
        let status = tokio::time::timeout(self.step_timeout, child.wait()).await;
        drop(guard); // kill + delete the container on every path (also when this future is dropped)
        let _ = fs::remove_dir_all(&bundle);
        let status = match status {
            Ok(s) => s.at("wait for", &self.runsc)?,
            Err(_) => {
                return Err(fail(format!(
                    "step {n}/{total} did not finish within {}s; last lines of the build log:\n{}",
                    self.step_timeout.as_secs(),
                    log.tail()
                )))
            }
        };
        if !status.success() {
            let how = match status.code() {
                Some(code) => format!("exited with code {code}"),
                None => format!("ended with {status}"),
            };
            log.line(&format!("==> step {n}/{total} failed: {how}"));
            return Err(fail(format!(
                "step {n}/{total} (`{}`) {how}; last lines of the build log:\n{}",
                cut(&one_line(script), 100),
                log.tail()
            )));
        }
        let rootfs2 = rootfs.clone();
        blocking(name, move || add_mount_points(&rootfs2)).await
    }
}

/// The OCI spec of a build step: the layer copy as a writable root, root user, no network.
fn step_spec(
    rootfs: &Path,
    script: &str,
    env: &[(String, String)],
    workdir: &str,
) -> serde_json::Value {
    let caps = [
        "CAP_CHOWN",
        "CAP_DAC_OVERRIDE",
        "CAP_FSETID",
        "CAP_FOWNER",
        "CAP_MKNOD",
        "CAP_NET_RAW",
        "CAP_SETGID",
        "CAP_SETUID",
        "CAP_SETFCAP",
        "CAP_SETPCAP",
        "CAP_NET_BIND_SERVICE",
        "CAP_SYS_CHROOT",
        "CAP_KILL",
        "CAP_AUDIT_WRITE",
    ];
    let mut env: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    if !env.iter().any(|e| e.starts_with("HOME=")) {
        env.push("HOME=/root".to_owned());
    }
    serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": ["/bin/sh", "-c", script],
            "env": env,
            "cwd": workdir,
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1_048_576, "soft": 1_048_576}],
            "noNewPrivileges": false
        },
        "root": {"path": rootfs, "readonly": false},
        "hostname": "build",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "nodev", "mode=1777"]}
        ],
        "linux": {
            "namespaces": [
                {"type": "pid"}, {"type": "network"}, {"type": "ipc"},
                {"type": "uts"}, {"type": "mount"}
            ]
        }
    })
}

/// A build container: killed and deleted when dropped, whatever happened.
struct Container {
    runsc: PathBuf,
    root: PathBuf,
    id: String,
}

impl Drop for Container {
    fn drop(&mut self) {
        for args in [
            vec!["kill", self.id.as_str(), "KILL"],
            vec!["delete", "--force", self.id.as_str()],
        ] {
            let _ = std::process::Command::new(&self.runsc)
                .arg("--root")
                .arg(&self.root)
                .args(&args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// Removes a half-built layer directory unless forgotten.
struct RemoveOnDrop(Option<PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            if let Err(e) = remove_tree(&p) {
                tracing::warn!(path = %p.display(), error = %e, "cannot remove a failed layer build");
            }
        }
    }
}

/// Under the layer's lock: removes leftovers of crashed builds of `key` and makes a fresh
/// `.tmp-<key>-<hex>/rootfs`, a copy of `parent` or empty.
fn prepare_layer_dir(
    layers: &Path,
    key: &str,
    parent: Option<&Path>,
) -> Result<PathBuf, TemplateError> {
    let prefix = format!(".tmp-{key}-");
    for entry in fs::read_dir(layers).at("list", layers)? {
        let entry = entry.at("list", layers)?;
        if entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(&prefix))
        {
            let _ = remove_tree(&entry.path());
        }
    }
    let mut random = [0u8; 8];
    getrandom::getrandom(&mut random)
        .map_err(|e| TemplateError::Io(io::Error::other(e.to_string())))?;
    let tmp = layers.join(format!("{prefix}{}", hex(&random)));
    fs::create_dir(&tmp).at("create", &tmp)?;
    let rootfs = tmp.join("rootfs");
    match parent {
        Some(parent) => {
            let r = run_tool(
                key,
                std::process::Command::new("cp")
                    .args(["-a", "--reflink=auto", "--"])
                    .arg(parent)
                    .arg(&rootfs),
            );
            if let Err(e) = r {
                let _ = remove_tree(&tmp);
                return Err(e);
            }
        }
        None => make_dir(&rootfs, 0o755)?,
    }
    Ok(tmp)
}

/// Runs a host tool to completion; its stderr tail is the error.
fn run_tool(name: &str, cmd: &mut std::process::Command) -> Result<(), TemplateError> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .at("run", Path::new(&program))?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let tail: Vec<&str> = err.lines().rev().take(10).collect();
    Err(TemplateError::Build {
        name: name.to_owned(),
        message: format!(
            "{program} failed ({}): {}",
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        ),
    })
}

fn syncfs(dir: &Path) -> Result<(), TemplateError> {
    use std::os::fd::AsRawFd;
    let f = File::open(dir).at("open", dir)?;
    // SAFETY: the descriptor is owned by `f`, which outlives the call.
    if unsafe { libc::syncfs(f.as_raw_fd()) } != 0 {
        return Err(io::Error::last_os_error()).at("sync", dir);
    }
    Ok(())
}

fn cache_key(parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p.as_bytes());
    }
    hex(&h.finalize())
}

fn one_line(s: &str) -> String {
    let s = s.trim().replace('\n', " ⏎ ");
    cut(&s, 120).to_owned()
}

/// A cheap fingerprint of a host file or tree: relative paths, types, modes, sizes and mtimes.
fn fingerprint(path: &Path) -> Result<String, TemplateError> {
    fn walk(dir: &Path, rel: &Path, h: &mut Sha256) -> Result<(), TemplateError> {
        let mut names = fs::read_dir(dir)
            .at("list", dir)?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<Result<Vec<_>, _>>()
            .at("list", dir)?;
        names.sort();
        for name in names {
            let path = dir.join(&name);
            let rel = rel.join(&name);
            let m = fs::symlink_metadata(&path).at("inspect", &path)?;
            h.update(rel.to_string_lossy().as_bytes());
            h.update(
                format!(
                    "\0{}:{}:{}:{}\0",
                    m.mode(),
                    m.len(),
                    m.mtime(),
                    m.mtime_nsec()
                )
                .as_bytes(),
            );
            if m.is_dir() {
                walk(&path, &rel, h)?;
            }
        }
        Ok(())
    }
    let m = fs::metadata(path).at("inspect", path)?;
    let mut h = Sha256::new();
    h.update(format!("{}:{}:{}:{}", m.mode(), m.len(), m.mtime(), m.mtime_nsec()).as_bytes());
    if m.is_dir() {
        walk(path, Path::new(""), &mut h)?;
    }
    Ok(hex(&h.finalize()))
}

/// Resolves `rel` (a path inside `root`) the way the sandbox would see it, following symbolic
/// links but never leaving `root`; missing directories on the way are created. Returns the
/// host path of the parent directory and the final name.
fn resolve_in_root(root: &Path, rel: &str) -> Result<(PathBuf, String), String> {
    let mut parts: Vec<String> = rel
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .map(str::to_owned)
        .collect();
    let last = parts.pop().ok_or("empty path")?;
    let mut queue: VecDeque<String> = parts.into();
    let mut cur: Vec<String> = Vec::new();
    let mut hops = 0;
    while let Some(c) = queue.pop_front() {
        if c == ".." {
            cur.pop();
            continue;
        }
        let mut candidate = root.to_owned();
        candidate.extend(&cur);
        candidate.push(&c);
        match fs::symlink_metadata(&candidate) {
            Ok(m) if m.file_type().is_symlink() => {
                hops += 1;
                if hops > 40 {
                    return Err("too many levels of symbolic links".into());
                }
                let target = fs::read_link(&candidate).map_err(|e| e.to_string())?;
                let target = target.to_string_lossy().into_owned();
                if target.starts_with('/') {
                    cur.clear();
                }
                for (i, t) in target
                    .split('/')
                    .filter(|c| !c.is_empty() && *c != ".")
                    .enumerate()
                {
                    queue.insert(i, t.to_owned());
                }
            }
            Ok(m) if m.is_dir() => cur.push(c),
            Ok(_) => return Err(format!("{c} is not a directory")),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::create_dir(&candidate).map_err(|e| e.to_string())?;
                fs::set_permissions(&candidate, fs::Permissions::from_mode(0o755))
                    .map_err(|e| e.to_string())?;
                cur.push(c);
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    let mut dir = root.to_owned();
    dir.extend(&cur);
    Ok((dir, last))
}

/// Writes one recipe file into `rootfs` without following links out of it.
fn write_in_root(name: &str, rootfs: &Path, f: &FileEntry) -> Result<(), TemplateError> {
    let fail = |m: String| TemplateError::Build {
        name: name.to_owned(),
        message: format!("file {}: {m}", f.path),
    };
    let (dir, file) = resolve_in_root(rootfs, &f.path).map_err(fail)?;
    if file == ".." {
        return Err(fail("invalid name".into()));
    }
    let path = dir.join(&file);
    if let Ok(m) = fs::symlink_metadata(&path) {
        if m.is_dir() {
            return Err(fail("is a directory in the base".into()));
        }
        fs::remove_file(&path).at("remove", &path)?;
    }
    let mut out = OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(0o600)
        .open(&path)
        .at("create", &path)?;
    out.write_all(&f.content).at("write", &path)?;
    drop(out);
    chown(&path, f.uid, f.gid)?;
    fs::set_permissions(&path, fs::Permissions::from_mode(f.mode)).at("set mode of", &path)
}

fn extract_tar(name: &str, tar: &Path, rootfs: &Path) -> Result<(), TemplateError> {
    run_tool(
        name,
        std::process::Command::new("tar")
            .args(["--numeric-owner", "--same-owner", "-xpf"])
            .arg(tar)
            .arg("-C")
            .arg(rootfs),
    )
}

/// Imports an OCI image layout: `index.json` → manifest → layers applied in order, with
/// `.wh.NAME` whiteouts (and `.wh..wh..opq` opaque directories) removing what lower layers had.
fn import_oci(name: &str, layout: &Path, rootfs: &Path) -> Result<(), TemplateError> {
    let fail = |m: String| TemplateError::Build {
        name: name.to_owned(),
        message: format!("oci:{}: {m}", layout.display()),
    };
    let read_json = |path: &Path| -> Result<serde_json::Value, TemplateError> {
        let bytes = fs::read(path).at("read", path)?;
        if bytes.len() > 4 << 20 {
            return Err(fail(format!("{} is too large", path.display())));
        }
        serde_json::from_slice(&bytes).map_err(|e| fail(format!("{}: {e}", path.display())))
    };
    let blob = |digest: &serde_json::Value| -> Result<PathBuf, TemplateError> {
        let d = digest.as_str().unwrap_or_default();
        match d.split_once(':') {
            Some((alg @ ("sha256" | "sha512"), hexd))
                if !hexd.is_empty() && hexd.bytes().all(|b| b.is_ascii_hexdigit()) =>
            {
                Ok(layout.join("blobs").join(alg).join(hexd))
            }
            _ => Err(fail(format!("invalid digest {:?}", cut(d, 100)))),
        }
    };
    let mut desc = read_json(&layout.join("index.json"))?["manifests"][0].clone();
    for _ in 0..2 {
        let media = desc["mediaType"].as_str().unwrap_or_default();
        if media.contains("image.index") || media.contains("manifest.list") {
            desc = read_json(&blob(&desc["digest"])?)?["manifests"][0].clone();
        }
    }
    if desc.is_null() {
        return Err(fail("index.json lists no manifest".into()));
    }
    let manifest = read_json(&blob(&desc["digest"])?)?;
    let Some(layers) = manifest["layers"].as_array() else {
        return Err(fail("the manifest has no layers".into()));
    };
    for layer in layers {
        let path = blob(&layer["digest"])?;
        apply_layer(name, &path, rootfs)?;
    }
    Ok(())
}

/// Applies one (possibly compressed) layer tarball on top of `rootfs`. The tarball is extracted
/// into an empty staging directory first (so GNU tar's own guards against `..` and links apply),
/// then merged: whiteouts remove what the lower layers had, and every entry is moved into place
/// under parents that the merge has made real directories, so a symlink that a lower layer left
/// (`etc -> /etc`) is replaced, never followed out of the root.
fn apply_layer(name: &str, tar: &Path, rootfs: &Path) -> Result<(), TemplateError> {
    let Some(parent) = rootfs.parent() else {
        return Err(TemplateError::Build {
            name: name.to_owned(),
            message: "layer directory has no parent".into(),
        });
    };
    let staging = parent.join("staging");
    if fs::symlink_metadata(&staging).is_ok() {
        remove_tree(&staging)?;
    }
    make_dir(&staging, 0o755)?;
    extract_tar(name, tar, &staging)?;
    let merged = merge_layer(&staging, rootfs);
    let removed = remove_tree(&staging);
    merged.and(removed)
}

/// Merges the extracted layer `src` (a real directory) into `dst` (a real directory).
fn merge_layer(src: &Path, dst: &Path) -> Result<(), TemplateError> {
    let mut names = fs::read_dir(src)
        .at("list", src)?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<Vec<_>, _>>()
        .at("list", src)?;
    names.sort();
    // Whiteouts first: they apply to the lower layers, not to this layer's own entries.
    let mut rest = Vec::new();
    for n in names {
        let Some(hidden) = n.to_str().and_then(|s| s.strip_prefix(".wh.")) else {
            rest.push(n);
            continue;
        };
        if hidden == ".wh..opq" {
            for e in fs::read_dir(dst).at("list", dst)? {
                remove_tree(&e.at("list", dst)?.path())?;
            }
        } else if !hidden.is_empty() && hidden != "." && hidden != ".." && !hidden.contains('/') {
            remove_tree(&dst.join(hidden))?;
        }
        remove_tree(&src.join(&n))?;
    }
    for n in rest {
        let from = src.join(&n);
        let to = dst.join(&n);
        let meta = fs::symlink_metadata(&from).at("inspect", &from)?;
        let existing = match fs::symlink_metadata(&to) {
            Ok(m) => Some(m),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(e).at("inspect", &to),
        };
        if meta.is_dir() {
            if existing.as_ref().is_some_and(|m| m.is_dir()) {
                chown(&to, meta.uid(), meta.gid())?;
                fs::set_permissions(&to, fs::Permissions::from_mode(meta.mode() & 0o7777))
                    .at("set mode of", &to)?;
                merge_layer(&from, &to)?;
                continue;
            }
            strip_whiteouts(&from)?;
        }
        if existing.is_some() {
            remove_tree(&to)?;
        }
        fs::rename(&from, &to).at("move into place", &to)?;
    }
    Ok(())
}

/// Removes whiteout files from a directory tree that had nothing below it to hide.
fn strip_whiteouts(dir: &Path) -> Result<(), TemplateError> {
    for e in fs::read_dir(dir).at("list", dir)? {
        let e = e.at("list", dir)?;
        let path = e.path();
        if e.file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(".wh."))
        {
            remove_tree(&path)?;
        } else if e.file_type().at("inspect", &path)?.is_dir() {
            strip_whiteouts(&path)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recipe(json: serde_json::Value) -> Result<ValidRecipe, RecipeError> {
        validate(serde_json::from_value(json).unwrap(), &[])
    }

    #[test]
    fn recipes_are_checked() {
        assert!(recipe(serde_json::json!({"name": "a", "base": "busybox"})).is_ok());
        for bad in [
            serde_json::json!({"name": "A", "base": "busybox"}),
            serde_json::json!({"name": "busybox", "base": "busybox"}),
            serde_json::json!({"name": "a", "base": "alpine"}),
            serde_json::json!({"name": "a", "base": "busybox", "packages": ["vim"]}),
            serde_json::json!({"name": "a", "base": "busybox", "files": [{"path": "rel"}]}),
            serde_json::json!({"name": "a", "base": "busybox", "files": [{"path": "/a/../b"}]}),
            serde_json::json!({"name": "a", "base": "busybox", "steps": [{"run": " "}]}),
            serde_json::json!({"name": "a", "base": "template:a"}),
            serde_json::json!({"name": "a", "base": "busybox", "resources": {"vcpus": 0}}),
        ] {
            assert!(
                matches!(recipe(bad.clone()), Err(RecipeError::Invalid(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            recipe(serde_json::json!({"name": "a", "base": "dir:/tmp"})),
            Err(RecipeError::Forbidden(m)) if m.contains("--template-import-dir")
        ));
        assert!(serde_json::from_value::<Recipe>(
            serde_json::json!({"name": "a", "base": "busybox", "x": 1})
        )
        .is_err());
    }

    #[test]
    fn import_paths_stay_under_the_import_dirs() {
        let dir = std::env::temp_dir().join(format!("space-import-{}", std::process::id()));
        fs::create_dir_all(dir.join("ok")).unwrap();
        let dirs = [dir.clone()];
        assert!(import_path("dir", dir.join("ok").to_str().unwrap(), &dirs).is_ok());
        assert!(matches!(
            import_path("dir", "/etc", &dirs),
            Err(RecipeError::Forbidden(_))
        ));
        assert!(matches!(
            import_path("dir", &format!("{}/ok/../../etc", dir.display()), &dirs),
            Err(RecipeError::Forbidden(_))
        ));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn files_never_leave_the_root() {
        let root = std::env::temp_dir().join(format!("space-root-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(root.join("usr/bin")).unwrap();
        std::os::unix::fs::symlink("/usr/bin", root.join("bin")).unwrap();
        std::os::unix::fs::symlink("../../../../etc", root.join("usr/escape")).unwrap();
        let (dir, name) = resolve_in_root(&root, "/bin/tool").unwrap();
        assert_eq!(dir, root.join("usr/bin"));
        assert_eq!(name, "tool");
        let (dir, _) = resolve_in_root(&root, "/usr/escape/passwd").unwrap();
        assert_eq!(dir, root.join("etc"));
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn layers_replace_links_instead_of_following_them() {
        let base = std::env::temp_dir().join(format!("space-merge-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        let (root, upper, outside) = (base.join("root"), base.join("upper"), base.join("outside"));
        for d in [&root, &upper, &outside] {
            fs::create_dir_all(d).unwrap();
        }
        // The lower layer left `etc -> <outside>` and some files; the upper one writes etc/passwd,
        // hides `gone`, and makes `opq` opaque.
        std::os::unix::fs::symlink(&outside, root.join("etc")).unwrap();
        fs::write(root.join("gone"), "x").unwrap();
        fs::create_dir_all(root.join("opq/old")).unwrap();
        fs::create_dir_all(upper.join("etc")).unwrap();
        fs::write(upper.join("etc/passwd"), "root").unwrap();
        fs::write(upper.join(".wh.gone"), "").unwrap();
        fs::create_dir_all(upper.join("opq")).unwrap();
        fs::write(upper.join("opq/.wh..wh..opq"), "").unwrap();
        fs::write(upper.join("opq/new"), "n").unwrap();
        fs::create_dir_all(upper.join("fresh")).unwrap();
        fs::write(upper.join("fresh/.wh.nothing"), "").unwrap();
        merge_layer(&upper, &root).unwrap();
        assert!(
            fs::read_dir(&outside).unwrap().next().is_none(),
            "wrote outside the root"
        );
        assert_eq!(fs::read_to_string(root.join("etc/passwd")).unwrap(), "root");
        assert!(!fs::symlink_metadata(root.join("etc"))
            .unwrap()
            .file_type()
            .is_symlink());
        assert!(!root.join("gone").exists());
        assert!(!root.join("opq/old").exists() && root.join("opq/new").exists());
        assert!(root.join("fresh").is_dir() && !root.join("fresh/.wh.nothing").exists());
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn keys_depend_on_every_part() {
        assert_ne!(cache_key(&["a", "bc"]), cache_key(&["ab", "c"]));
        assert_eq!(cache_key(&["a"]), cache_key(&["a"]));
    }
}
