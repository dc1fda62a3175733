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

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};

use base64::Engine;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use space_agent::fs::{Attrs, Root};

use crate::debian;
use crate::import::{self, ImportLimits};
use crate::template::{
    add_mount_points, blocking, fsync_dir, hex, is_builtin, make_dir, remove_tree, validate_name,
    write_atomic, BuildLock, DefaultResources, IoContext, StartSpec, Template, TemplateError,
    TemplateStore,
};
use crate::tree::Dir;

use space_core::runtime::{BoxError, BuildStep, BuildStepError, PrepareRoot, Runtime, StepLimit};
pub use space_core::runtime::{BuildLimits, DEFAULT_STEP_TIMEOUT};

/// Largest recipe body the server accepts (files are inlined in it).
pub const MAX_RECIPE_BYTES: usize = 32 << 20;
/// Bumped when the way layers are made changes, so old cache entries are not reused.
const LAYER_FORMAT: &str = "1";
const MAX_FILES: usize = 1000;
const MAX_STEPS: usize = 100;
const MAX_SCRIPT_BYTES: usize = 64 * 1024;
const MAX_PACKAGES: usize = 200;
const MAX_ENV: usize = 256;
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

use space_api::truncate as cut;

/// The build log of one build. The server copies every step's output into it, and it keeps
/// at most its last `cap` bytes: past that its head is dropped in whole MiB (the blocks are
/// freed with `FALLOC_FL_PUNCH_HOLE`, so offsets never change) and readers start where the
/// kept part begins ([`log_data_start`]).
pub struct BuildLog {
    file: File,
    path: PathBuf,
    /// Bytes kept (0: all).
    cap: u64,
    /// Serialises appends with the drops of the head.
    state: Mutex<LogState>,
}

#[derive(Default)]
struct LogState {
    /// The log's length (only this process writes it).
    len: u64,
    /// Everything before this offset has been dropped.
    dropped_to: u64,
    /// Dropping failed (a filesystem without hole punching): later output is discarded.
    full: bool,
}

/// The head of a capped log is dropped in these units.
const LOG_DROP_UNIT: u64 = 1 << 20;

impl BuildLog {
    /// Creates (or appends to) the log at `path` (mode 0600), keeping its last `cap` bytes.
    pub fn create(path: &Path, cap: u64) -> io::Result<BuildLog> {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir)?;
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(path)?;
        let len = file.metadata()?.len();
        let dropped_to = log_data_start(&file).min(len);
        Ok(BuildLog {
            file,
            path: path.to_owned(),
            cap,
            state: Mutex::new(LogState {
                len,
                dropped_to,
                full: false,
            }),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn line(&self, line: &str) {
        self.append(format!("{line}\n").as_bytes());
    }

    /// Appends `data`, then drops the head if the log has grown past its cap.
    pub fn append(&self, data: &[u8]) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.full || (&self.file).write_all(data).is_err() {
            return;
        }
        st.len += data.len() as u64;
        let len = st.len;
        if self.cap == 0 {
            return;
        }
        if len.saturating_sub(st.dropped_to) <= self.cap.saturating_add(LOG_DROP_UNIT) {
            return;
        }
        let to = (len - self.cap) / LOG_DROP_UNIT * LOG_DROP_UNIT;
        if to <= st.dropped_to {
            return;
        }
        use std::os::fd::AsRawFd;
        // SAFETY: a valid descriptor; the range lies within the file.
        let r = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                st.dropped_to as libc::off_t,
                (to - st.dropped_to) as libc::off_t,
            )
        };
        if r == 0 {
            st.dropped_to = to;
        } else {
            st.full = true;
            let _ = (&self.file).write_all(
                format!(
                    "\n==> the build log reached {} MiB and its head cannot be dropped here: later output is left out\n",
                    self.cap >> 20
                )
                .as_bytes(),
            );
        }
    }

    /// The last lines of the log.
    pub fn tail(&self) -> String {
        tail_of(&self.path, LOG_TAIL_LINES)
    }
}

/// Where the kept part of a log starts: past the head a capped [`BuildLog`] dropped (its
/// first data byte), 0 when nothing was dropped.
pub fn log_data_start(file: &File) -> u64 {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid descriptor.
    let off = unsafe { libc::lseek(file.as_raw_fd(), 0, libc::SEEK_DATA) };
    if off >= 0 {
        return off as u64;
    }
    // ENXIO: no data at all (empty, or all of it dropped).
    file.metadata().map(|m| m.len()).unwrap_or(0)
}

/// The last `lines` lines of a file (reading at most its last 64 KiB).
pub fn tail_of(path: &Path, lines: usize) -> String {
    let Ok(mut f) = File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len
        .saturating_sub(64 * 1024)
        .max(log_data_start(&f).min(len));
    let _ = f.seek(SeekFrom::Start(start));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Runs recipe builds: the runtime that runs their steps and what each step may use.
#[derive(Clone)]
pub struct Builder {
    /// Runs every build step ([`Runtime::run_build_step`]).
    pub runtime: Arc<dyn Runtime>,
    /// The server's agent directory (a microVM step boots that agent).
    pub agent_dir: PathBuf,
    pub limits: BuildLimits,
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
        let mut packages = r.packages.clone().unwrap_or_default();
        packages.sort();
        packages.dedup();
        let total = 1
            + usize::from(!packages.is_empty())
            + usize::from(!recipe.files.is_empty())
            + steps.len();
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
        let import_limits = ImportLimits {
            max_bytes: self.limits.disk_bytes(),
        };

        // Step 1: the base.
        let base_label = format!("base {}", r.base);
        let mut layer = match &recipe.base {
            Base::Busybox | Base::Template(_) | Base::Debian => {
                // A Debian base is the built-in debian template, made by mmdebstrap with no
                // input from the recipe; the recipe's packages are installed by a step.
                let base_name = match &recipe.base {
                    Base::Template(n) => n.as_str(),
                    Base::Debian => "debian",
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
            Base::Dir(p) | Base::Tar(p) | Base::Oci(p) => {
                let kind = match &recipe.base {
                    Base::Dir(_) => "dir",
                    Base::Tar(_) => "tar",
                    _ => "oci",
                };
                let src = p.clone();
                let print = blocking(name, move || import::fingerprint(&src)).await?;
                let path = p.to_string_lossy().into_owned();
                let key = cache_key(&[LAYER_FORMAT, kind, &path, &print]);
                let src = p.clone();
                let owned = name.to_owned();
                self.layer(
                    name,
                    &layers,
                    key,
                    None,
                    false,
                    1,
                    &base_label,
                    &announce,
                    log,
                    |rootfs| async move {
                        blocking(&owned.clone(), move || {
                            match kind {
                                "dir" => {
                                    run_tool(
                                        &owned,
                                        std::process::Command::new("cp")
                                            .args(["-a", "--reflink=auto", "--"])
                                            .arg(src.join("."))
                                            .arg(&rootfs),
                                    )?;
                                    remove_special_files(&rootfs)?;
                                }
                                "tar" => import::import_tar(&owned, &src, &rootfs, import_limits)?,
                                _ => import::import_oci(&owned, &src, &rootfs, import_limits)?,
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
        if !packages.is_empty() {
            n += 1;
            let key = cache_key(&[LAYER_FORMAT, &layer.key, "packages", &packages.join(",")]);
            let what = format!("packages {}", cut(&packages.join(" "), 200));
            let this = n;
            let parent = layer.rootfs.clone();
            layer = self
                .layer(
                    name,
                    &layers,
                    key,
                    Some(&layer),
                    false,
                    n,
                    &what,
                    &announce,
                    log,
                    |rootfs| {
                        self.install_packages(name, this, total, parent, rootfs, &packages, log)
                    },
                )
                .await?;
        }

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
                    true,
                    n,
                    &what,
                    &announce,
                    log,
                    |rootfs| async move {
                        blocking(&owned.clone(), move || write_files(&owned, &rootfs, &files)).await
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
            let parent = layer.rootfs.clone();
            layer = self
                .layer(
                    name,
                    &layers,
                    key,
                    Some(&layer),
                    false,
                    n,
                    &what,
                    &announce,
                    log,
                    |rootfs| {
                        self.run_step(
                            name, this, total, parent, rootfs, &step.run, &env, &workdir, log, None,
                        )
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

    /// The layer `key`: from the cache, or built by `make` under the layer's lock in a fresh
    /// directory (a copy of `parent` when `copy_parent`, else empty) and renamed into place.
    #[allow(clippy::too_many_arguments)]
    async fn layer<F, Fut>(
        &self,
        name: &str,
        layers: &Path,
        key: String,
        parent: Option<&Layer>,
        copy_parent: bool,
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
            let copy = parent.filter(|_| copy_parent).map(|p| p.rootfs.clone());
            blocking(&key.clone(), move || {
                prepare_layer_dir(&layers, &key, copy.as_deref())
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

    /// Installs Debian `packages` into a copy of `parent` (the built-in debian) without
    /// running anything of them on the host: the host's apt, with a private state directory
    /// and the base's own package database and keys, resolves and downloads the .debs (and the
    /// indexes that vouch for them) — apt runs nothing from a package to do that — and a build
    /// step, inside gVisor without a network, installs them with `apt-get --no-download`, so
    /// every maintainer script runs in the sandbox with the step's limits.
    #[allow(clippy::too_many_arguments)]
    async fn install_packages(
        &self,
        name: &str,
        n: usize,
        total: usize,
        parent: PathBuf,
        rootfs: PathBuf,
        packages: &[String],
        log: &BuildLog,
    ) -> Result<(), TemplateError> {
        let Some(tmp) = rootfs.parent().map(Path::to_owned) else {
            return Err(TemplateError::Build {
                name: name.to_owned(),
                message: "layer directory has no parent".into(),
            });
        };
        let apt = tmp.join("apt");
        log.line(&format!(
            "==> downloading {} and what they depend on (nothing of them runs on the host)",
            packages.join(" ")
        ));
        debian::download(name, &parent, &apt, packages, self.limits.disk_bytes(), log).await?;
        let apt2 = apt.clone();
        let prepare: PrepareRoot =
            Box::new(move |root: &Path| debian::stage(&apt2, root).map_err(BoxError::from));
        let script = debian::install_script(packages);
        let env = vec![
            ("PATH".to_owned(), DEFAULT_PATH.to_owned()),
            ("DEBIAN_FRONTEND".to_owned(), "noninteractive".to_owned()),
            ("LANG".to_owned(), "C.UTF-8".to_owned()),
        ];
        let r = self
            .run_step(
                name,
                n,
                total,
                parent,
                rootfs,
                &script,
                &env,
                "/",
                log,
                Some(prepare),
            )
            .await;
        let removed = blocking(name, move || remove_tree(&apt)).await;
        r.and(removed)
    }

    /// Runs one step on a copy of `parent` in the build runtime (a sandbox of its own with
    /// the build's limits), which leaves what the step made in `rootfs`, the new layer.
    #[allow(clippy::too_many_arguments)]
    async fn run_step(
        &self,
        name: &str,
        n: usize,
        total: usize,
        parent: PathBuf,
        rootfs: PathBuf,
        script: &str,
        env: &[(String, String)],
        workdir: &str,
        log: &BuildLog,
        prepare: Option<PrepareRoot>,
    ) -> Result<(), TemplateError> {
        let Some(tmp) = rootfs.parent().map(Path::to_owned) else {
            return Err(TemplateError::Build {
                name: name.to_owned(),
                message: "layer directory has no parent".into(),
            });
        };
        // The runtime's own files; whatever it leaves there is not part of the layer.
        let work_dir = tmp.join("work");
        make_dir(&work_dir, 0o700)?;
        let output = |data: &[u8]| log.append(data);
        let step = BuildStep {
            label: format!("step {n}/{total}"),
            parent,
            rootfs: rootfs.clone(),
            work_dir: work_dir.clone(),
            script: script.to_owned(),
            env: env.to_vec(),
            workdir: workdir.to_owned(),
            limits: self.limits,
            agent_dir: self.agent_dir.clone(),
            prepare,
            output: &output,
        };
        let ran = self.runtime.run_build_step(step).await;
        if let Err(e) = ran {
            return Err(self.step_failed(name, n, total, script, log, e));
        }
        blocking(name, move || {
            crate::disk::detach_below(&work_dir);
            remove_tree(&work_dir)?;
            add_mount_points(&rootfs)
        })
        .await
    }

    /// The error of a failed step, in the build's terms (and a line in its log).
    fn step_failed(
        &self,
        name: &str,
        n: usize,
        total: usize,
        script: &str,
        log: &BuildLog,
        e: BuildStepError,
    ) -> TemplateError {
        let fail = |message: String| TemplateError::Build {
            name: name.to_owned(),
            message,
        };
        let limits = self.limits.describe();
        match e {
            BuildStepError::TimedOut(limit) => {
                log.line(&format!(
                    "==> step {n}/{total} killed: it ran past its timeout of {}s",
                    limit.as_secs()
                ));
                fail(format!(
                    "step {n}/{total} did not finish within its timeout of {}s and was killed; a step may use {limits}; last lines of the build log:\n{}",
                    limit.as_secs(),
                    log.tail()
                ))
            }
            BuildStepError::Failed { how, limit } => {
                let why = match limit {
                    Some(StepLimit::Memory) => format!(
                        " (it ran out of its memory limit of {} MiB)",
                        self.limits.memory_mib
                    ),
                    Some(StepLimit::Disk) => {
                        format!(" (its disk of {} MiB is full)", self.limits.disk_mib)
                    }
                    None => String::new(),
                };
                log.line(&format!("==> step {n}/{total} failed: {how}{why}"));
                fail(format!(
                    "step {n}/{total} (`{}`) {how}{why}; a step may use {limits}; last lines of the build log:\n{}",
                    cut(&one_line(script), 100),
                    log.tail()
                ))
            }
            BuildStepError::TooLarge { grown_bytes } => {
                let line = format!(
                    "step {n}/{total} left {} MiB more file data than it started with, more than its disk of {} MiB (sparse files count at their full size)",
                    grown_bytes >> 20,
                    self.limits.disk_mib
                );
                log.line(&format!("==> {line}"));
                fail(format!("{line}; a step may use {limits}"))
            }
            BuildStepError::Unkeepable(message) => {
                let line = format!("step {n}/{total} left files that cannot be kept: {message}");
                log.line(&format!("==> {line}"));
                fail(format!("{line}; a step may use {limits}"))
            }
            BuildStepError::Prepare(e) => match e.downcast::<TemplateError>() {
                Ok(e) => *e,
                Err(e) => fail(format!("preparing step {n}/{total}: {}", chain(e.as_ref()))),
            },
            BuildStepError::Runtime(e) => {
                let line = format!("step {n}/{total} could not run: {}", chain(&e));
                log.line(&format!("==> {line}"));
                fail(line)
            }
        }
    }
}

/// Removes device nodes, fifos and sockets from an imported tree: a sandbox's /dev comes
/// from its runtime, and the host keeps no device node a tenant chose.
fn remove_special_files(rootfs: &Path) -> Result<(), TemplateError> {
    let dir = Dir::open(rootfs).at("open", rootfs)?;
    let mut doomed: Vec<PathBuf> = Vec::new();
    dir.walk(&mut |rel, st, _| {
        if !matches!(
            crate::tree::kind(st),
            libc::S_IFREG | libc::S_IFDIR | libc::S_IFLNK
        ) {
            doomed.push(rel.to_owned());
        }
        Ok(())
    })
    .at("inspect", rootfs)?;
    for rel in doomed {
        let parent = rel.parent().map(|p| p.to_string_lossy().into_owned());
        let name = rel.file_name().unwrap_or_default();
        dir.open_path(parent.as_deref().unwrap_or(""))
            .and_then(|d| d.remove(name))
            .at("remove", &rootfs.join(&rel))?;
    }
    Ok(())
}

/// Writes the recipe's files into `rootfs`, resolving each path inside the layer as a chroot
/// would (links followed, but never out of it), one directory descriptor at a time.
fn write_files(name: &str, rootfs: &Path, files: &[FileEntry]) -> Result<(), TemplateError> {
    let fail = |path: &str, m: String| TemplateError::Build {
        name: name.to_owned(),
        message: format!("file {path}: {m}"),
    };
    let root = Root::open(rootfs).map_err(|e| fail("/", e.message()))?;
    for f in files {
        if let Some((parent, _)) = f.path.rsplit_once('/') {
            if !parent.is_empty() {
                root.mkdir(parent, Attrs::DIR)
                    .map_err(|e| fail(&f.path, e.message()))?;
            }
        }
        let attrs = Attrs {
            mode: f.mode,
            uid: f.uid,
            gid: f.gid,
        };
        root.write_file(&f.path, attrs, &f.content[..])
            .map_err(|e| fail(&f.path, e.message()))?;
    }
    Ok(())
}

/// Removes a half-built layer directory unless forgotten.
struct RemoveOnDrop(Option<PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            crate::disk::detach_below(&p);
            if let Err(e) = remove_tree(&p) {
                tracing::warn!(path = %p.display(), error = %e, "cannot remove a failed layer build");
            }
        }
    }
}

/// Under the layer's lock: removes leftovers of crashed builds of `key` (their step disks
/// unmounted first) and makes a fresh `.tmp-<key>-<hex>/rootfs`, a copy of `parent` or empty.
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
            crate::disk::detach_below(&entry.path());
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

/// Removes what builds of a killed server left in the layer cache: half-made layers whose
/// lock nobody holds (another server sharing the cache may be building one), with their
/// step disks unmounted.
pub fn sweep_abandoned_layers(store: &TemplateStore) {
    let layers = store.layers_dir();
    let Ok(entries) = fs::read_dir(&layers) else {
        return;
    };
    for e in entries.flatten() {
        let file_name = e.file_name();
        let Some(rest) = file_name.to_str().and_then(|n| n.strip_prefix(".tmp-")) else {
            continue;
        };
        let Some((key, _)) = rest.rsplit_once('-') else {
            continue;
        };
        let Ok(Some(_lock)) = BuildLock::try_acquire(&layers, key) else {
            continue;
        };
        tracing::warn!(path = %e.path().display(), "removing a layer a killed build left half-made");
        crate::disk::detach_below(&e.path());
        if let Err(err) = remove_tree(&e.path()) {
            tracing::warn!(path = %e.path().display(), error = %err, "cannot remove a half-made layer");
        }
    }
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

/// An error and its causes, one after the other.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn one_line(s: &str) -> String {
    let s = s.trim().replace('\n', " ⏎ ");
    cut(&s, 120).to_owned()
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
        let base = std::env::temp_dir().join(format!("space-root-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        let (root, outside) = (base.join("root"), base.join("outside"));
        fs::create_dir_all(root.join("usr/bin")).unwrap();
        fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink("/usr/bin", root.join("bin")).unwrap();
        std::os::unix::fs::symlink("../../../../etc", root.join("usr/escape")).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("host")).unwrap();
        let file = |path: &str| FileEntry {
            path: path.into(),
            content: b"x".to_vec(),
            sha256: String::new(),
            mode: 0o4755,
            uid: 0,
            gid: 0,
        };
        write_files(
            "t",
            &root,
            &[
                file("/bin/tool"),
                file("/usr/escape/passwd"),
                file("/host/x"),
            ],
        )
        .unwrap();
        assert!(root.join("usr/bin/tool").is_file());
        assert!(
            root.join("etc/passwd").is_file(),
            "an escaping link stays inside"
        );
        assert!(
            fs::read_dir(&outside).unwrap().next().is_none(),
            "wrote outside"
        );
        assert!(root
            .join(outside.strip_prefix("/").unwrap())
            .join("x")
            .is_file());
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn capped_logs_keep_their_tail() {
        let dir = std::env::temp_dir().join(format!("space-log-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let log = BuildLog::create(&dir.join("op.log"), 2 << 20).unwrap();
        let line = format!("{}\n", "a".repeat(1023));
        for _ in 0..6400 {
            log.append(line.as_bytes());
        }
        log.line("last line");
        let f = File::open(log.path()).unwrap();
        let len = f.metadata().unwrap().len();
        let start = log_data_start(&f);
        assert!(start > 0 && len - start <= 3 << 20, "{start} {len}");
        use std::os::unix::fs::MetadataExt;
        assert!(
            f.metadata().unwrap().blocks() * 512 <= 4 << 20,
            "the head is freed"
        );
        assert!(log.tail().ends_with("\nlast line"), "the tail is kept");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn keys_depend_on_every_part() {
        assert_ne!(cache_key(&["a", "bc"]), cache_key(&["ab", "c"]));
        assert_eq!(cache_key(&["a"]), cache_key(&["a"]));
    }
}
