//! The template store: read-only root filesystems on local disk that sandboxes use as their lower layer.
//!
//! Layout under the store root:
//!
//! ```text
//! <root>/<name>/rootfs/          the root filesystem (never written after the build)
//! <root>/<name>/template.json    metadata; its presence means the template is ready
//! <root>/.<name>.lock            flock(2) held while <name> is being built
//! <root>/.build-<name>-<hex>/    a build in progress (or a crashed one, removed by the next build)
//! ```
//!
//! Templates built from recipes ([`crate::build`]) are immutable and versioned:
//!
//! ```text
//! <root>/<name>/current                     the current version (`v3`), replaced atomically
//! <root>/<name>/versions/<v>/template.json  one version's metadata; its rootfs is a layer
//! <root>/.layers/<sha256>/rootfs/           an immutable, content-addressed layer (the build cache)
//! <root>/.layers/.<sha256>.lock             flock(2) held while that layer is being built
//! <root>/.layers/.tmp-<sha256>-<hex>/       a layer being built (removed if the build dies)
//! ```
//!
//! The built-in templates keep the flat layout above (one version, rebuilt when missing).
//!
//! A build happens entirely inside a private `.build-…` directory, which is renamed into place only
//! after its metadata and contents are on disk. A reader therefore sees either no template or a
//! complete one, and two processes sharing a root serialise their builds on the lock file.
//!
//! Every template contains the empty mount points the container runtime needs (`/.space`,
//! `/.space/bin`, `/.space/run`, `/proc`, `/dev`, `/sys`, `/tmp`, `/run`), so the runtime never
//! has to create anything inside a template.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::tree::{self, Dir};

/// Bumped whenever a built-in recipe changes, so stored templates are told apart from new ones.
const RECIPE_VERSION: &str = "1";
const METADATA_FILE: &str = "template.json";
const ROOTFS_DIR: &str = "rootfs";
const BUILD_PREFIX: &str = ".build-";
const CURRENT_FILE: &str = "current";
const VERSIONS_DIR: &str = "versions";
const LAYERS_DIR: &str = ".layers";
/// Hex digits in the random suffix of a build directory.
const BUILD_SUFFIX_LEN: usize = 16;

const HOST_BUSYBOX: &str = "/bin/busybox";
const DEBIAN_SUITE: &str = "bookworm";
const DEBIAN_MIRROR: &str = "http://deb.debian.org/debian";
const DEBIAN_PACKAGES: &str = "bash,python3,coreutils,procps,git,curl,ca-certificates";
/// The built-in template for code contexts: `debian` plus Jupyter's kernel, numpy,
/// pandas and matplotlib ([`CODE_INTERPRETER_PACKAGES`]). The execution service itself
/// comes from the server with each call (`space_service::interpreter`), so it always
/// matches the server, in this template or any other with the same packages.
pub const CODE_INTERPRETER: &str = "code-interpreter";
/// Debian's packages for Python kernels, tables and charts.
const CODE_INTERPRETER_PACKAGES: [&str; 5] = [
    "python3-ipykernel",
    "python3-jupyter-client",
    "python3-numpy",
    "python3-pandas",
    "python3-matplotlib",
];
/// An mmdebstrap run that has not finished by then is stuck (usually on the network).
const DEBIAN_BUILD_TIMEOUT: Duration = Duration::from_secs(20 * 60);
/// Lines of tool output kept for the error message of a failed build.
const OUTPUT_TAIL_LINES: usize = 20;
/// Tool output is passed to `progress` at most this often.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(500);

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

const USER_NAME: &str = "user";
const USER_ID: u32 = 1000;
const USER_HOME: &str = "home/user";

/// Busybox applets the platform itself relies on; a build without one of them fails.
const REQUIRED_APPLETS: &[&str] = &[
    "sh", "env", "sleep", "cat", "head", "true", "id", "ls", "mkdir", "kill", "ps",
];

/// Directories (relative to the rootfs) with their modes that every template has.
const MOUNT_POINTS: &[(&str, u32)] = &[
    (".space", 0o755),
    (".space/bin", 0o755),
    (".space/run", 0o755),
    ("proc", 0o755),
    ("dev", 0o755),
    ("sys", 0o755),
    ("tmp", 0o1777),
    ("run", 0o755),
];

/// What went wrong in the template store.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("unknown template {0:?}")]
    UnknownTemplate(String),
    #[error(
        "invalid template name {0:?}: use 1 to 63 of a-z, 0-9, '.', '_' and '-', starting with a letter or digit"
    )]
    InvalidName(String),
    #[error("building template {name} failed: {message}")]
    Build { name: String, message: String },
    #[error("template {name} has unreadable metadata in {}", path.display())]
    Metadata {
        name: String,
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("cannot {action} {}", path.display())]
    Fs {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("template store I/O failed")]
    Io(#[from] io::Error),
    #[error("template {0:?} is built in: it cannot be deleted or rebuilt from a recipe")]
    Builtin(String),
}

/// Default resources of new sandboxes of a template (each one optional).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DefaultResources {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids: Option<u64>,
}

/// A command started in every new sandbox of a template once it runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartSpec {
    /// Run by `/bin/sh -c` as a background command.
    pub run: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<ReadySpec>,
}

/// A check run every 200 ms after the start command until it exits 0.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadySpec {
    pub run: String,
    /// Default 30.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<u64>,
}

/// A ready template: a root filesystem directory and how to run processes in it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Template {
    pub name: String,
    /// `<recipe version>-<content id>`; fixed once the template is built.
    pub version: String,
    /// Absolute path of the root filesystem: `<root>/<name>/rootfs`.
    pub rootfs: PathBuf,
    pub env: Vec<(String, String)>,
    /// Working directory of new processes; `None` means the home directory of `user`.
    pub workdir: Option<String>,
    /// User new processes run as; `None` means root.
    pub user: Option<String>,
    /// Disk usage of the rootfs (like `du`), measured at build time.
    pub size_bytes: u64,
    /// When the build finished, RFC 3339 UTC.
    pub created_at: String,
    /// The layer (under `<root>/.layers/`) that is the rootfs of a recipe-built version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<String>,
    /// Default resources of new sandboxes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<DefaultResources>,
    /// Started in every new sandbox once it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<StartSpec>,
    /// What the template was built from (`busybox`, `template:NAME`, …); `None` for built-ins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<String>,
}

/// One entry of [`TemplateStore::list`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateInfo {
    pub name: String,
    pub ready: bool,
    pub builtin: bool,
    pub template: Option<Template>,
    /// Every version on disk, oldest first (a built-in has at most its one).
    pub versions: Vec<String>,
}

/// Templates on local disk under one root directory; see the module documentation for the layout.
#[derive(Debug, Clone)]
pub struct TemplateStore {
    root: PathBuf,
}

impl TemplateStore {
    /// Templates this store knows how to build.
    pub const BUILTIN: &'static [&'static str] = &["busybox", "debian", CODE_INTERPRETER];

    /// Opens the store at `root`, creating the directory if needed.
    pub fn new(root: impl Into<PathBuf>) -> Result<Self, TemplateError> {
        let root = root.into();
        // Layers hold whatever tenants put in their templates, setuid root binaries included:
        // no other host user may reach them.
        tree::private_dir(&root).at("create", &root)?;
        let root = fs::canonicalize(&root).at("resolve", &root)?;
        let layers = root.join(LAYERS_DIR);
        tree::private_dir(&layers).at("create", &layers)?;
        Ok(Self { root })
    }

    /// The (absolute) root directory of the store.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The ready template `name`, `None` if it is built-in but not built yet.
    pub fn get(&self, name: &str) -> Result<Option<Template>, TemplateError> {
        validate_name(name)?;
        match self.load(name)? {
            Some(template) => Ok(Some(template)),
            None if is_builtin(name) => Ok(None),
            None => Err(TemplateError::UnknownTemplate(name.to_owned())),
        }
    }

    /// Every built-in template (built or not) and every other ready template on disk, sorted by name.
    pub fn list(&self) -> Result<Vec<TemplateInfo>, TemplateError> {
        let mut names: Vec<String> = Self::BUILTIN.iter().map(|n| (*n).to_owned()).collect();
        for entry in fs::read_dir(&self.root).at("list", &self.root)? {
            let entry = entry.at("list", &self.root)?;
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            if validate_name(&name).is_ok()
                && !is_builtin(&name)
                && (entry.path().join(METADATA_FILE).exists()
                    || entry.path().join(CURRENT_FILE).exists())
            {
                names.push(name);
            }
        }
        names.sort();
        let mut infos = Vec::with_capacity(names.len());
        for name in names {
            let template = match self.load(&name) {
                Ok(t) => t,
                // One damaged template must not hide the others; `ensure` rebuilds a damaged built-in.
                Err(e) => {
                    tracing::warn!(template = %name, error = %ErrorChain(&e), "skipping unreadable template");
                    None
                }
            };
            let builtin = is_builtin(&name);
            if template.is_none() && !builtin {
                continue;
            }
            let versions = if self.root.join(&name).join(CURRENT_FILE).exists() {
                self.versions(&name)?
            } else {
                template.iter().map(|t| t.version.clone()).collect()
            };
            infos.push(TemplateInfo {
                versions,
                ready: template.is_some(),
                builtin,
                template,
                name,
            });
        }
        Ok(infos)
    }

    /// The ready template `name`, building it first if it is a built-in that is not built yet.
    ///
    /// Builds are serialised per name across threads and processes by an flock on
    /// `<root>/.<name>.lock`; a caller that finds a build in progress waits for it and returns its
    /// result. `progress` receives short human-readable lines while building or waiting.
    pub async fn ensure(
        &self,
        name: &str,
        progress: &(dyn Fn(String) + Send + Sync),
    ) -> Result<Template, TemplateError> {
        validate_name(name)?;
        match self.load(name) {
            Ok(Some(template)) => return Ok(template),
            Ok(None) if !is_builtin(name) => {
                return Err(TemplateError::UnknownTemplate(name.to_owned()))
            }
            Ok(None) => {}
            Err(e) if is_builtin(name) => {
                tracing::warn!(template = name, error = %ErrorChain(&e), "rebuilding template with unreadable metadata");
            }
            Err(e) => return Err(e),
        }

        let lock = match BuildLock::try_acquire(&self.root, name)? {
            Some(lock) => lock,
            None => {
                progress(format!("waiting for another build of {name} to finish"));
                BuildLock::acquire(&self.root, name).await?
            }
        };

        // Whoever held the lock before us may have finished the job.
        match self.load(name) {
            Ok(Some(template)) => return Ok(template),
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(template = name, error = %ErrorChain(&e), "rebuilding template with unreadable metadata")
            }
        }

        let started = Instant::now();
        let template = self.build(name, progress).await?;
        tracing::info!(
            template = name,
            version = %template.version,
            size_bytes = template.size_bytes,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "template built"
        );
        progress(format!(
            "built {name} {} ({} MB) in {:.1}s",
            template.version,
            template.size_bytes / 1_000_000,
            started.elapsed().as_secs_f64()
        ));
        drop(lock);
        Ok(template)
    }

    /// The current version of `name`: `<root>/<name>/current` → its version, or the flat
    /// `<root>/<name>/template.json` of a built-in; `None` if neither exists.
    fn load(&self, name: &str) -> Result<Option<Template>, TemplateError> {
        let current = self.root.join(name).join(CURRENT_FILE);
        match fs::read_to_string(&current) {
            Ok(version) => return self.load_version(name, version.trim()).map(Some),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).at("read", &current),
        }
        let path = self.root.join(name).join(METADATA_FILE);
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).at("read", &path),
        };
        let mut template: Template =
            serde_json::from_slice(&bytes).map_err(|source| TemplateError::Metadata {
                name: name.to_owned(),
                path: path.clone(),
                source,
            })?;
        // The directory is the truth: the store root may have moved since the build.
        template.name = name.to_owned();
        template.rootfs = self.root.join(name).join(ROOTFS_DIR);
        Ok(Some(template))
    }

    /// Version `version` of recipe-built template `name`.
    pub fn load_version(&self, name: &str, version: &str) -> Result<Template, TemplateError> {
        validate_name(name)?;
        if !is_version(version) {
            return Err(TemplateError::UnknownTemplate(format!("{name}@{version}")));
        }
        let path = self
            .root
            .join(name)
            .join(VERSIONS_DIR)
            .join(version)
            .join(METADATA_FILE);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(TemplateError::UnknownTemplate(format!("{name}@{version}")))
            }
            Err(e) => return Err(e).at("read", &path),
        };
        let mut template: Template =
            serde_json::from_slice(&bytes).map_err(|source| TemplateError::Metadata {
                name: name.to_owned(),
                path: path.clone(),
                source,
            })?;
        template.name = name.to_owned();
        template.version = version.to_owned();
        if let Some(layer) = &template.layer {
            template.rootfs = self.layers_dir().join(layer).join(ROOTFS_DIR);
        }
        Ok(template)
    }

    /// The versions of recipe-built template `name`, oldest first.
    pub fn versions(&self, name: &str) -> Result<Vec<String>, TemplateError> {
        let dir = self.root.join(name).join(VERSIONS_DIR);
        let entries = match fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e).at("list", &dir),
        };
        let mut versions: Vec<(u64, String)> = Vec::new();
        for entry in entries {
            let entry = entry.at("list", &dir)?;
            if let Some(v) = entry.file_name().to_str() {
                if let (true, Ok(n)) = (is_version(v), v[1..].parse::<u64>()) {
                    if entry.path().join(METADATA_FILE).exists() {
                        versions.push((n, v.to_owned()));
                    }
                }
            }
        }
        versions.sort();
        Ok(versions.into_iter().map(|(_, v)| v).collect())
    }

    /// `<root>/.layers`: the content-addressed layer cache of recipe builds.
    pub fn layers_dir(&self) -> PathBuf {
        self.root.join(LAYERS_DIR)
    }

    /// Publishes `template` (built from a recipe, its rootfs the layer `template.layer`) as the
    /// next version of `template.name` and makes it current. If the current version has the same
    /// layer and settings, nothing is written and that version is returned (`false`).
    pub async fn publish_version(
        &self,
        mut template: Template,
    ) -> Result<(Template, bool), TemplateError> {
        let name = template.name.clone();
        validate_name(&name)?;
        if is_builtin(&name) {
            return Err(TemplateError::Builtin(name));
        }
        let _lock = BuildLock::acquire(&self.root, &name).await?;
        if let Some(current) = self.load(&name)? {
            let same = |a: &Template, b: &Template| {
                a.layer == b.layer
                    && a.rootfs == b.rootfs
                    && a.env == b.env
                    && a.workdir == b.workdir
                    && a.user == b.user
                    && a.resources == b.resources
                    && a.start == b.start
            };
            if same(&current, &template) {
                return Ok((current, false));
            }
        }
        let store = self.clone();
        blocking(&name.clone(), move || {
            let versions = store.versions(&name)?;
            let next = versions
                .last()
                .and_then(|v| v[1..].parse::<u64>().ok())
                .unwrap_or(0)
                + 1;
            let version = format!("v{next}");
            let summary = summarize(&template.rootfs)?;
            template.version = version.clone();
            template.size_bytes = summary.size_bytes;
            template.created_at = time::OffsetDateTime::now_utc()
                .format(&time::format_description::well_known::Rfc3339)
                .map_err(|e| TemplateError::Io(io::Error::other(e)))?;
            let versions_dir = store.root.join(&name).join(VERSIONS_DIR);
            fs::create_dir_all(&versions_dir).at("create", &versions_dir)?;
            let tmp = versions_dir.join(format!(".tmp-{version}"));
            if tmp.exists() {
                remove_tree(&tmp)?;
            }
            fs::create_dir(&tmp).at("create", &tmp)?;
            let json = serde_json::to_vec_pretty(&template).map_err(|e| TemplateError::Build {
                name: name.clone(),
                message: format!("cannot encode metadata: {e}"),
            })?;
            write_atomic(&tmp.join(METADATA_FILE), &json)?;
            let dir = versions_dir.join(&version);
            fs::rename(&tmp, &dir).at("publish", &dir)?;
            fsync_dir(&versions_dir)?;
            write_atomic(
                &store.root.join(&name).join(CURRENT_FILE),
                version.as_bytes(),
            )?;
            Ok((template, true))
        })
        .await
    }

    /// Publishes the next version of `name` from a root filesystem that `fill` writes into an
    /// empty directory (a sandbox's files, say): it becomes the new layer `key` (refused if one
    /// of that key exists), gets the template's mount points and network files, then
    /// [`TemplateStore::publish_version`] with `meta`'s settings. A failed `fill` leaves nothing.
    pub async fn publish_rootfs<F>(
        &self,
        key: &str,
        fill: F,
        meta: Template,
    ) -> Result<(Template, bool), TemplateError>
    where
        F: FnOnce(&Path) -> Result<(), TemplateError> + Send + 'static,
    {
        let name = meta.name.clone();
        validate_name(&name)?;
        if is_builtin(&name) {
            return Err(TemplateError::Builtin(name));
        }
        if key.is_empty() || !key.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(TemplateError::Build {
                name,
                message: format!("invalid layer key {key:?}"),
            });
        }
        let layers = self.layers_dir();
        let dir = layers.join(key);
        // Held while the layer is half-made, so no other server sharing the cache takes its
        // directory for a killed build's leftover.
        fs::create_dir_all(&layers).at("create", &layers)?;
        let lock = BuildLock::acquire(&layers, key).await?;
        let (k, n) = (key.to_owned(), name.clone());
        let rootfs = blocking(&name, move || {
            fs::create_dir_all(&layers).at("create", &layers)?;
            if dir.exists() {
                return Err(TemplateError::Build {
                    name: n,
                    message: format!("layer {k} exists already"),
                });
            }
            let mut random = [0u8; 8];
            getrandom::getrandom(&mut random)
                .map_err(|e| TemplateError::Io(io::Error::other(e.to_string())))?;
            let tmp = layers.join(format!(".tmp-{k}-{}", hex(&random)));
            make_dir(&tmp, 0o755)?;
            let rootfs = tmp.join(ROOTFS_DIR);
            let filled = make_dir(&rootfs, 0o755)
                .and_then(|()| fill(&rootfs))
                .and_then(|()| add_mount_points(&rootfs))
                .and_then(|()| write_network_files(&rootfs))
                .and_then(|()| {
                    let meta = serde_json::json!({ "key": k, "template": n, "what": "import" });
                    write_atomic(&tmp.join("layer.json"), meta.to_string().as_bytes())
                });
            if let Err(e) = filled {
                let _ = remove_tree(&tmp);
                return Err(e);
            }
            fs::rename(&tmp, &dir).at("publish", &dir)?;
            fsync_dir(&layers)?;
            Ok(dir.join(ROOTFS_DIR))
        })
        .await?;
        drop(lock);
        self.publish_version(Template {
            rootfs,
            layer: Some(key.to_owned()),
            ..meta
        })
        .await
    }

    /// Removes recipe-built template `name` with all its versions (its layers stay in the
    /// cache). Built-ins are refused. The caller checks that no sandbox uses it.
    pub async fn delete(&self, name: &str) -> Result<(), TemplateError> {
        validate_name(name)?;
        if is_builtin(name) {
            return Err(TemplateError::Builtin(name.to_owned()));
        }
        let lock = BuildLock::acquire(&self.root, name).await?;
        let dir = self.root.join(name);
        if !dir.join(CURRENT_FILE).exists() && !dir.join(METADATA_FILE).exists() {
            // Asking to delete a name that is not there leaves no lock file for it either.
            lock.remove(&self.root, name)?;
            return Err(TemplateError::UnknownTemplate(name.to_owned()));
        }
        let root = self.root.clone();
        let owned = name.to_owned();
        blocking(name, move || {
            let mut random = [0u8; 8];
            getrandom::getrandom(&mut random)
                .map_err(|e| TemplateError::Io(io::Error::other(e.to_string())))?;
            let doomed = root.join(format!(".deleted-{owned}-{}", hex(&random)));
            fs::rename(root.join(&owned), &doomed).at("remove", &doomed)?;
            fsync_dir(&root)?;
            remove_tree(&doomed)?;
            lock.remove(&root, &owned)
        })
        .await
    }

    /// Builds built-in `name`. The caller holds its build lock.
    async fn build(
        &self,
        name: &str,
        progress: &(dyn Fn(String) + Send + Sync),
    ) -> Result<Template, TemplateError> {
        let root = self.root.clone();
        let owned = name.to_owned();
        let build_dir = blocking(name, move || prepare_build_dir(&root, &owned)).await?;

        let result = self.build_in(name, &build_dir, progress).await;
        if result.is_err() {
            let dir = build_dir.clone();
            let cleanup = tokio::task::spawn_blocking(move || remove_tree(&dir)).await;
            if let Ok(Err(e)) = cleanup {
                tracing::warn!(template = name, error = %ErrorChain(&e), "cannot remove failed build");
            }
        }
        result
    }

    async fn build_in(
        &self,
        name: &str,
        build_dir: &Path,
        progress: &(dyn Fn(String) + Send + Sync),
    ) -> Result<Template, TemplateError> {
        let rootfs = build_dir.join(ROOTFS_DIR);
        let (env, workdir, user) = match name {
            "busybox" => {
                progress("building busybox from the host's static busybox".to_owned());
                let rootfs = rootfs.clone();
                blocking(name, move || build_busybox(&rootfs)).await?;
                (
                    vec![("PATH".to_owned(), DEFAULT_PATH.to_owned())],
                    None,
                    None,
                )
            }
            "debian" | CODE_INTERPRETER => {
                let (packages, size) = match name {
                    "debian" => (Vec::new(), ""),
                    _ => (
                        CODE_INTERPRETER_PACKAGES.map(str::to_owned).to_vec(),
                        ": about 1.5 minutes and 1.4 GB",
                    ),
                };
                let extra: String = packages.iter().map(|p| format!(",{p}")).collect();
                progress(format!(
                    "building {name} with mmdebstrap ({DEBIAN_SUITE}, {DEBIAN_PACKAGES}{extra}){size}"
                ));
                run_mmdebstrap(name, &rootfs, &packages, progress).await?;
                progress(format!("finishing {name}: adding user, cleaning caches"));
                let rootfs = rootfs.clone();
                blocking(name, move || finish_debian(&rootfs)).await?;
                let env = vec![
                    ("PATH".to_owned(), DEFAULT_PATH.to_owned()),
                    ("LANG".to_owned(), "C.UTF-8".to_owned()),
                ];
                (env, None, None)
            }
            _ => return Err(TemplateError::UnknownTemplate(name.to_owned())),
        };

        progress(format!("measuring and publishing {name}"));
        let root = self.root.clone();
        let build_dir = build_dir.to_owned();
        let name = name.to_owned();
        let err_name = name.clone();
        blocking(&err_name, move || {
            publish(&root, &name, &build_dir, env, workdir, user)
        })
        .await
    }
}

/// Checks `name` against `[a-z0-9][a-z0-9._-]{0,62}`.
pub(crate) fn validate_name(name: &str) -> Result<(), TemplateError> {
    let bytes = name.as_bytes();
    let ok = !bytes.is_empty()
        && bytes.len() <= 63
        && (bytes[0].is_ascii_lowercase() || bytes[0].is_ascii_digit())
        && bytes.iter().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
        });
    if ok {
        Ok(())
    } else {
        Err(TemplateError::InvalidName(name.to_owned()))
    }
}

/// `v<digits>`.
fn is_version(v: &str) -> bool {
    v.len() > 1 && v.len() <= 20 && v.starts_with('v') && v[1..].bytes().all(|b| b.is_ascii_digit())
}

pub(crate) fn is_builtin(name: &str) -> bool {
    TemplateStore::BUILTIN.contains(&name)
}

/// Runs blocking filesystem work off the async runtime.
pub(crate) async fn blocking<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> Result<T, TemplateError> + Send + 'static,
) -> Result<T, TemplateError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| TemplateError::Build {
            name: name.to_owned(),
            message: format!("build task failed: {e}"),
        })?
}

/// Exclusive flock on `<root>/.<name>.lock`, released on drop (or when the process dies).
pub(crate) struct BuildLock {
    _file: File,
}

impl BuildLock {
    pub(crate) fn open(root: &Path, name: &str) -> Result<File, TemplateError> {
        let path = root.join(format!(".{name}.lock"));
        // std opens with O_CLOEXEC, so build tools never inherit (and keep holding) the lock.
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .open(&path)
            .at("open lock file", &path)
    }

    pub(crate) fn try_acquire(root: &Path, name: &str) -> Result<Option<Self>, TemplateError> {
        loop {
            let file = Self::open(root, name)?;
            if !flock(&file, libc::LOCK_EX | libc::LOCK_NB)? {
                return Ok(None);
            }
            if Self::still_at(&file, root, name) {
                return Ok(Some(Self { _file: file }));
            }
        }
    }

    pub(crate) async fn acquire(root: &Path, name: &str) -> Result<Self, TemplateError> {
        loop {
            let file = Self::open(root, name)?;
            // If this future is dropped, the blocking thread still gets the lock and then drops it with the file.
            let file = tokio::task::spawn_blocking(move || {
                flock(&file, libc::LOCK_EX)?;
                Ok::<_, TemplateError>(file)
            })
            .await
            .map_err(|e| TemplateError::Io(io::Error::other(e)))??;
            if Self::still_at(&file, root, name) {
                return Ok(Self { _file: file });
            }
        }
    }

    /// Whether the locked file is still the one at the lock's path: a delete removes the
    /// lock file while it holds it, and whoever waited on the removed one opens the new.
    fn still_at(file: &File, root: &Path, name: &str) -> bool {
        use std::os::unix::fs::MetadataExt;
        match (
            file.metadata(),
            fs::metadata(root.join(format!(".{name}.lock"))),
        ) {
            (Ok(held), Ok(now)) => held.dev() == now.dev() && held.ino() == now.ino(),
            _ => false,
        }
    }

    /// Removes the lock file, held: the name leaves nothing behind once deleted.
    fn remove(self, root: &Path, name: &str) -> Result<(), TemplateError> {
        let path = root.join(format!(".{name}.lock"));
        match fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e).at("remove lock file", &path),
            _ => Ok(()),
        }
    }
}

/// flock(2), retried on EINTR. Returns false if `LOCK_NB` was given and the lock is held elsewhere.
fn flock(file: &File, op: libc::c_int) -> Result<bool, TemplateError> {
    use std::os::fd::AsRawFd;
    loop {
        // SAFETY: the descriptor is owned by `file`, which outlives the call.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(true);
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EWOULDBLOCK) if op & libc::LOCK_NB != 0 => return Ok(false),
            _ => return Err(TemplateError::Io(err)),
        }
    }
}

/// Under the build lock: removes leftovers of earlier crashed builds of `name` (and a `<name>`
/// directory without metadata) and creates a fresh `.build-<name>-<hex>` directory.
fn prepare_build_dir(root: &Path, name: &str) -> Result<PathBuf, TemplateError> {
    for entry in fs::read_dir(root).at("list", root)? {
        let entry = entry.at("list", root)?;
        if is_build_dir_of(&entry.file_name(), name) {
            let path = entry.path();
            tracing::info!(template = name, path = %path.display(), "removing an interrupted build");
            if let Err(e) = remove_tree(&path) {
                // A build killed a moment ago may still have processes writing into it; the next build retries.
                tracing::warn!(template = name, error = %ErrorChain(&e), "cannot remove an interrupted build");
            }
        }
    }
    let final_dir = root.join(name);
    if final_dir.exists() {
        // Not ready (no readable metadata, checked by the caller under the lock): not a template.
        remove_tree(&final_dir)?;
    }

    let mut random = [0u8; BUILD_SUFFIX_LEN / 2];
    getrandom::getrandom(&mut random).map_err(|e| {
        TemplateError::Io(match e.raw_os_error() {
            Some(code) => io::Error::from_raw_os_error(code),
            None => io::Error::other(e.to_string()),
        })
    })?;
    let dir = root.join(format!("{BUILD_PREFIX}{name}-{}", hex(&random)));
    fs::create_dir(&dir).at("create", &dir)?;
    Ok(dir)
}

/// Whether `file_name` is exactly `.build-<name>-<16 hex digits>` (so `.build-a-b-…` is not `a`'s).
fn is_build_dir_of(file_name: &OsStr, name: &str) -> bool {
    let Some(rest) = file_name
        .to_str()
        .and_then(|f| f.strip_prefix(BUILD_PREFIX))
    else {
        return false;
    };
    let Some(suffix) = rest.strip_prefix(name).and_then(|r| r.strip_prefix('-')) else {
        return false;
    };
    suffix.len() == BUILD_SUFFIX_LEN && suffix.bytes().all(|b| b.is_ascii_hexdigit())
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Measures the finished rootfs, writes its metadata, syncs everything and renames the build into place.
fn publish(
    root: &Path,
    name: &str,
    build_dir: &Path,
    env: Vec<(String, String)>,
    workdir: Option<String>,
    user: Option<String>,
) -> Result<Template, TemplateError> {
    let rootfs = build_dir.join(ROOTFS_DIR);
    let summary = summarize(&rootfs)?;
    let created_at = time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .map_err(|e| TemplateError::Io(io::Error::other(e)))?;
    let template = Template {
        name: name.to_owned(),
        version: format!("{RECIPE_VERSION}-{:012x}", summary.content_id >> 16),
        rootfs: root.join(name).join(ROOTFS_DIR),
        env,
        workdir,
        user,
        size_bytes: summary.size_bytes,
        created_at,
        layer: None,
        resources: None,
        start: None,
        base: None,
    };
    let json = serde_json::to_vec_pretty(&template).map_err(|e| TemplateError::Build {
        name: name.to_owned(),
        message: format!("cannot encode metadata: {e}"),
    })?;
    write_atomic(&build_dir.join(METADATA_FILE), &json)?;

    // One syncfs flushes the whole rootfs: far cheaper than fsyncing thousands of files one by one.
    let dir = File::open(build_dir).at("open", build_dir)?;
    {
        use std::os::fd::AsRawFd;
        // SAFETY: the descriptor is owned by `dir`, which outlives the call.
        if unsafe { libc::syncfs(dir.as_raw_fd()) } != 0 {
            return Err(io::Error::last_os_error()).at("sync", build_dir);
        }
    }
    let final_dir = root.join(name);
    fs::rename(build_dir, &final_dir).at("publish", &final_dir)?;
    fsync_dir(root)?;
    Ok(template)
}

/// Writes `path` via a temporary file, fsync and rename, so readers see the old or the new content.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TemplateError> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut file = File::create(&tmp).at("create", &tmp)?;
    file.write_all(bytes).at("write", &tmp)?;
    file.sync_all().at("sync", &tmp)?;
    drop(file);
    fs::rename(&tmp, path).at("rename", path)?;
    if let Some(parent) = path.parent() {
        fsync_dir(parent)?;
    }
    Ok(())
}

pub(crate) fn fsync_dir(dir: &Path) -> Result<(), TemplateError> {
    File::open(dir).and_then(|d| d.sync_all()).at("sync", dir)
}

pub(crate) struct Summary {
    pub(crate) size_bytes: u64,
    pub(crate) content_id: u64,
}

/// Disk usage (hard links counted once, like `du`) and a fingerprint of the tree: names, types,
/// modes, owners, sizes and link targets, walked in sorted order. Timestamps are left out, so
/// identical builds get the same id; file contents are left out to keep this fast.
pub(crate) fn summarize(rootfs: &Path) -> Result<Summary, TemplateError> {
    let dir = Dir::open(rootfs).at("open", rootfs)?;
    let meta = dir.stat().at("inspect", rootfs)?;
    let mut seen = HashSet::new();
    seen.insert((meta.st_dev, meta.st_ino));
    let mut size = meta.st_blocks.max(0) as u64 * 512;
    let mut hash = Fnv::new();
    dir.walk(&mut |rel, st, parent| {
        if seen.insert((st.st_dev, st.st_ino)) {
            size += st.st_blocks.max(0) as u64 * 512;
        }
        hash.write(rel.as_os_str().as_bytes());
        hash.write(&st.st_mode.to_le_bytes());
        hash.write(&st.st_uid.to_le_bytes());
        hash.write(&st.st_gid.to_le_bytes());
        match tree::kind(st) {
            libc::S_IFREG => hash.write(&(st.st_size.max(0) as u64).to_le_bytes()),
            libc::S_IFLNK => {
                let name = rel.file_name().unwrap_or_default();
                hash.write(&parent.read_link(name)?);
            }
            libc::S_IFDIR => {}
            _ => hash.write(&st.st_rdev.to_le_bytes()),
        }
        hash.write(&[0]);
        Ok(())
    })
    .at("measure", rootfs)?;
    Ok(Summary {
        size_bytes: size,
        content_id: hash.finish(),
    })
}

/// FNV-1a, 64 bit: enough to tell builds apart, not a security boundary.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// Removes a directory tree without following a link in it or crossing into another
/// filesystem (a mount left behind by a killed build tool must not take the host's /dev or
/// /proc with it); see [`tree::remove_tree`].
pub(crate) fn remove_tree(path: &Path) -> Result<(), TemplateError> {
    tree::remove_tree(path).at("remove", path)
}

/// Creates `path` (and missing parents) and sets its mode exactly, whatever the umask.
pub(crate) fn make_dir(path: &Path, mode: u32) -> Result<(), TemplateError> {
    fs::create_dir_all(path).at("create", path)?;
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).at("set mode of", path)
}

pub(crate) fn write_file(path: &Path, content: &str, mode: u32) -> Result<(), TemplateError> {
    fs::write(path, content).at("write", path)?;
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).at("set mode of", path)
}

pub(crate) fn chown(path: &Path, uid: u32, gid: u32) -> Result<(), TemplateError> {
    std::os::unix::fs::lchown(path, Some(uid), Some(gid)).at("change owner of", path)
}

/// Creates the mount points every template needs, leaving /proc, /sys, /dev and /tmp empty.
/// `rootfs` may hold anything a tenant left there: whatever is in a mount point's place (a
/// link to a host directory, say) is replaced, never followed.
pub(crate) fn add_mount_points(rootfs: &Path) -> Result<(), TemplateError> {
    let root = Dir::open(rootfs).at("open", rootfs)?;
    for (rel, mode) in MOUNT_POINTS {
        let path = rootfs.join(rel);
        let (parent, name) = match rel.rsplit_once('/') {
            Some((parent, name)) => (root.open_path(parent).at("open", &path)?, name),
            None => (root.open_path("").at("open", rootfs)?, *rel),
        };
        let dir = parent
            .ensure_dir_mode(OsStr::new(name), *mode)
            .at("create", &path)?;
        if matches!(*rel, "proc" | "sys" | "dev" | "tmp") {
            dir.clear().at("empty", &path)?;
        }
    }
    Ok(())
}

/// Network configuration belongs to the sandbox, not to the template (or to the host that
/// built it). Whatever a tenant left at `/etc` or at these files (links, hard links,
/// directories) is replaced, never written through.
pub(crate) fn write_network_files(rootfs: &Path) -> Result<(), TemplateError> {
    let etc_path = rootfs.join("etc");
    let etc = Dir::open(rootfs)
        .and_then(|root| root.ensure_dir(OsStr::new("etc"), 0o755))
        .at("create", &etc_path)?;
    for (file, content) in [
        (
            "hosts",
            "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n",
        ),
        ("hostname", "localhost\n"),
        ("resolv.conf", ""),
    ] {
        etc.write_file(OsStr::new(file), content.as_bytes(), 0o644)
            .at("write", &etc_path.join(file))?;
    }
    Ok(())
}

fn build_busybox(rootfs: &Path) -> Result<(), TemplateError> {
    let fail = |message: String| TemplateError::Build {
        name: "busybox".to_owned(),
        message,
    };
    let host = Path::new(HOST_BUSYBOX);
    if !host.exists() {
        return Err(fail(format!(
            "{HOST_BUSYBOX} not found: run scripts/setup.sh (installs busybox-static)"
        )));
    }
    let elf = fs::read(host).at("read", host)?;
    match elf_has_interpreter(&elf) {
        Some(false) => {}
        Some(true) => {
            return Err(fail(format!(
                "{HOST_BUSYBOX} is dynamically linked and would not run inside the template: install busybox-static"
            )))
        }
        None => return Err(fail(format!("{HOST_BUSYBOX} is not a 64-bit ELF executable"))),
    }
    let output = std::process::Command::new(host)
        .arg("--list")
        .stdin(Stdio::null())
        .output()
        .at("run", host)?;
    if !output.status.success() {
        return Err(fail(format!(
            "`{HOST_BUSYBOX} --list` failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    let applets: Vec<&str> = std::str::from_utf8(&output.stdout)
        .map_err(|_| fail(format!("`{HOST_BUSYBOX} --list` printed non-UTF-8 names")))?
        .lines()
        .map(str::trim)
        .filter(|a| !a.is_empty() && *a != "busybox" && !a.contains('/') && *a != "." && *a != "..")
        .collect();
    let missing: Vec<&str> = REQUIRED_APPLETS
        .iter()
        .copied()
        .filter(|r| !applets.contains(r))
        .collect();
    if !missing.is_empty() {
        return Err(fail(format!(
            "{HOST_BUSYBOX} lacks applets {}",
            missing.join(", ")
        )));
    }

    make_dir(rootfs, 0o755)?;
    for dir in [
        "bin", "sbin", "usr", "usr/bin", "usr/sbin", "etc", "var", "var/tmp",
    ] {
        make_dir(
            &rootfs.join(dir),
            if dir == "var/tmp" { 0o1777 } else { 0o755 },
        )?;
    }
    let bin = rootfs.join("bin");
    let target = bin.join("busybox");
    fs::write(&target, &elf).at("write", &target)?;
    fs::set_permissions(&target, fs::Permissions::from_mode(0o755)).at("set mode of", &target)?;
    for applet in applets {
        let link = bin.join(applet);
        std::os::unix::fs::symlink("busybox", &link).at("create link", &link)?;
    }

    let etc = rootfs.join("etc");
    write_file(
        &etc.join("passwd"),
        &format!("root:x:0:0:root:/root:/bin/sh\n{USER_NAME}:x:{USER_ID}:{USER_ID}:{USER_NAME}:/{USER_HOME}:/bin/sh\n"),
        0o644,
    )?;
    write_file(
        &etc.join("group"),
        &format!("root:x:0:\n{USER_NAME}:x:{USER_ID}:\n"),
        0o644,
    )?;
    write_network_files(rootfs)?;
    make_dir(&rootfs.join("root"), 0o700)?;
    make_dir(&rootfs.join("home"), 0o755)?;
    let home = rootfs.join(USER_HOME);
    make_dir(&home, 0o755)?;
    chown(&home, USER_ID, USER_ID)?;
    add_mount_points(rootfs)
}

/// Whether a 64-bit little-endian ELF image asks for a program interpreter (is dynamically
/// linked); `None` if it is not such an image.
fn elf_has_interpreter(elf: &[u8]) -> Option<bool> {
    const PT_INTERP: u32 = 3;
    if elf.len() < 64 || &elf[..4] != b"\x7fELF" || elf[4] != 2 || elf[5] != 1 {
        return None;
    }
    let u16_at = |o: usize| Some(u16::from_le_bytes(elf.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(elf.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(elf.get(o..o + 8)?.try_into().ok()?));
    let phoff = usize::try_from(u64_at(0x20)?).ok()?;
    let phentsize = usize::from(u16_at(0x36)?);
    let phnum = usize::from(u16_at(0x38)?);
    for i in 0..phnum {
        let offset = phoff.checked_add(i.checked_mul(phentsize)?)?;
        if u32_at(offset)? == PT_INTERP {
            return Some(true);
        }
    }
    Some(false)
}

/// Finds the build tool `program` in `PATH`, or says how to install it.
pub(crate) fn find_tool(name: &str, program: &str, hint: &str) -> Result<PathBuf, TemplateError> {
    find_in_path(&std::env::var_os("PATH").unwrap_or_default(), program).ok_or_else(|| {
        TemplateError::Build {
            name: name.to_owned(),
            message: format!("{program} not found: {hint}"),
        }
    })
}

fn find_in_path(path: &OsStr, program: &str) -> Option<PathBuf> {
    std::env::split_paths(path)
        .map(|dir| dir.join(program))
        .find(|candidate| {
            fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Runs mmdebstrap into `rootfs`, passing its output to `progress` (rate-limited).
pub(crate) async fn run_mmdebstrap(
    name: &str,
    rootfs: &Path,
    extra_packages: &[String],
    progress: &(dyn Fn(String) + Send + Sync),
) -> Result<(), TemplateError> {
    let fail = |message: String| TemplateError::Build {
        name: name.to_owned(),
        message,
    };
    let mmdebstrap = find_tool(name, "mmdebstrap", "run scripts/setup.sh")?;
    let unshare = find_tool(name, "unshare", "run scripts/setup.sh (util-linux)")?;

    // A private mount namespace: whatever mmdebstrap mounts inside the chroot (proc, sys, dev)
    // disappears with it even if it is killed, instead of staying mounted under the store.
    let mut cmd = tokio::process::Command::new(unshare);
    cmd.args(["--mount", "--propagation", "private", "--"])
        .arg(&mmdebstrap)
        .args([
            "--variant=minbase",
            &format!(
                "--include={DEBIAN_PACKAGES}{}",
                extra_packages
                    .iter()
                    .map(|p| format!(",{p}"))
                    .collect::<String>()
            ),
            // Documentation and translations are a third of a minimal system and no use in a sandbox.
            "--dpkgopt=path-exclude=/usr/share/man/*",
            "--dpkgopt=path-exclude=/usr/share/doc/*",
            "--dpkgopt=path-include=/usr/share/doc/*/copyright",
            "--dpkgopt=path-exclude=/usr/share/info/*",
            "--dpkgopt=path-exclude=/usr/share/locale/*",
            DEBIAN_SUITE,
        ])
        .arg(rootfs)
        .arg(DEBIAN_MIRROR)
        .env("LC_ALL", "C.UTF-8")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = cmd.spawn().at("run", &mmdebstrap)?;
    let mut group = crate::process::KillGroupOnDrop::new(&child);

    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let mut tail = std::collections::VecDeque::with_capacity(OUTPUT_TAIL_LINES);
    let mut last_progress: Option<Instant> = None;
    let run = async {
        let mut out = stdout.map(|s| BufReader::new(s).lines());
        let mut err = stderr.map(|s| BufReader::new(s).lines());
        while out.is_some() || err.is_some() {
            let line = tokio::select! {
                line = async { out.as_mut()?.next_line().await.transpose() }, if out.is_some() => {
                    if line.is_none() { out = None; }
                    line
                }
                line = async { err.as_mut()?.next_line().await.transpose() }, if err.is_some() => {
                    if line.is_none() { err = None; }
                    line
                }
            };
            let Some(line) = line else { continue };
            let line = line.at("read output of", &mmdebstrap)?;
            let line = line.trim_end();
            if line.is_empty() {
                continue;
            }
            let line: String = line.chars().take(300).collect();
            tracing::debug!(template = name, line = %line, "mmdebstrap");
            if !matches!(last_progress, Some(t) if t.elapsed() < PROGRESS_INTERVAL) {
                last_progress = Some(Instant::now());
                progress(format!("mmdebstrap: {line}"));
            }
            if tail.len() == OUTPUT_TAIL_LINES {
                tail.pop_front();
            }
            tail.push_back(line);
        }
        child.wait().await.at("wait for", &mmdebstrap)
    };
    let status = match tokio::time::timeout(DEBIAN_BUILD_TIMEOUT, run).await {
        Ok(status) => status?,
        Err(_) => {
            return Err(fail(format!(
                "mmdebstrap did not finish within {} minutes",
                DEBIAN_BUILD_TIMEOUT.as_secs() / 60
            )))
        }
    };
    // Sweep anything the tool left running in its group (an agent, a stuck dpkg).
    group.kill_now();
    if !status.success() {
        let tail: Vec<String> = tail.into_iter().collect();
        return Err(fail(format!(
            "mmdebstrap exited with {status}; last output:\n{}",
            tail.join("\n")
        )));
    }
    Ok(())
}

/// Adds the unprivileged user, resets host-specific files, empties caches and adds the mount points.
pub(crate) fn finish_debian(rootfs: &Path) -> Result<(), TemplateError> {
    add_user(rootfs)?;
    write_network_files(rootfs)?;
    // apt's indexes and downloaded packages are rebuilt by `apt-get update` whenever needed.
    let root = Dir::open(rootfs).at("open", rootfs)?;
    for rel in [
        "var/lib/apt/lists",
        "var/cache/apt/archives",
        "var/cache/apt",
    ] {
        let Ok(dir) = root.open_path(rel) else {
            continue;
        };
        let path = rootfs.join(rel);
        for name in dir.names().at("list", &path)? {
            let keep = matches!(name.to_str(), Some("partial" | "lock" | "archives"));
            let is_file = dir
                .lstat(&name)
                .at("inspect", &path)?
                .is_some_and(|st| tree::kind(&st) == libc::S_IFREG);
            if !keep && is_file {
                dir.remove(&name).at("remove", &path.join(&name))?;
            }
        }
    }
    add_mount_points(rootfs)
}

/// Adds `user` (uid/gid 1000, home /home/user, bash) by editing the account files directly,
/// which needs neither network nor a chroot.
fn add_user(rootfs: &Path) -> Result<(), TemplateError> {
    let etc_path = rootfs.join("etc");
    let root = Dir::open(rootfs).at("open", rootfs)?;
    let etc = root.open_path("etc").at("open", &etc_path)?;
    let fail = |message: String| TemplateError::Build {
        name: "debian".to_owned(),
        message,
    };
    const MAX_ACCOUNT_FILE: u64 = 16 << 20;
    let passwd = etc
        .read_file(OsStr::new("passwd"), MAX_ACCOUNT_FILE)
        .at("read", &etc_path.join("passwd"))?
        .ok_or_else(|| fail("the base system has no /etc/passwd".into()))?;
    let passwd = String::from_utf8_lossy(&passwd);
    let uid = USER_ID.to_string();
    let taken = passwd.lines().any(|l| {
        let mut fields = l.split(':');
        fields.next() == Some(USER_NAME) || fields.nth(1) == Some(uid.as_str())
    });
    if taken {
        return Err(fail(format!(
            "the base system already has user {USER_NAME} or uid {USER_ID}"
        )));
    }
    let days = time::OffsetDateTime::now_utc().unix_timestamp() / 86_400;
    let append = |file: &str, line: String, mode: u32| -> Result<(), TemplateError> {
        let path = etc_path.join(file);
        let name = OsStr::new(file);
        let mut content = etc
            .read_file(name, MAX_ACCOUNT_FILE)
            .at("read", &path)?
            .unwrap_or_default();
        if !content.is_empty() && !content.ends_with(b"\n") {
            content.push(b'\n');
        }
        content.extend_from_slice(line.as_bytes());
        content.push(b'\n');
        let meta = etc.lstat(name).at("inspect", &path)?;
        let mode = meta.map_or(mode, |m| m.st_mode & 0o7777);
        etc.write_file(name, &content, mode).at("write", &path)?;
        if let Some(m) = meta {
            etc.chown(name, m.st_uid, m.st_gid)
                .at("change owner of", &path)?;
        }
        Ok(())
    };
    append(
        "passwd",
        format!("{USER_NAME}:x:{USER_ID}:{USER_ID}:{USER_NAME}:/{USER_HOME}:/bin/bash"),
        0o644,
    )?;
    append("group", format!("{USER_NAME}:x:{USER_ID}:"), 0o644)?;
    // `*`: no password, so no password login; sudo-less root access is the runtime's business.
    append(
        "shadow",
        format!("{USER_NAME}:*:{days}:0:99999:7:::"),
        0o640,
    )?;
    append("gshadow", format!("{USER_NAME}:!::"), 0o640)?;

    let home_path = rootfs.join(USER_HOME);
    let home = root
        .ensure_path(USER_HOME, 0o755)
        .at("create", &home_path)?;
    root.open_path("home")
        .and_then(|h| h.chown(OsStr::new("user"), USER_ID, USER_ID))
        .at("change owner of", &home_path)?;
    if let Ok(skel) = etc.open_path("skel") {
        for name in skel.names().at("list", &etc_path.join("skel"))? {
            let Some(data) = skel
                .read_file(&name, MAX_ACCOUNT_FILE)
                .at("read", &etc_path.join("skel").join(&name))?
            else {
                continue;
            };
            let to = home_path.join(&name);
            home.write_file(&name, &data, 0o644).at("copy", &to)?;
            home.chown(&name, USER_ID, USER_ID)
                .at("change owner of", &to)?;
        }
    }
    Ok(())
}

/// Adds the path (and what was being done to it) to an I/O error.
pub(crate) trait IoContext<T> {
    fn at(self, action: &'static str, path: &Path) -> Result<T, TemplateError>;
}

impl<T> IoContext<T> for Result<T, io::Error> {
    fn at(self, action: &'static str, path: &Path) -> Result<T, TemplateError> {
        self.map_err(|source| TemplateError::Fs {
            action,
            path: path.to_owned(),
            source,
        })
    }
}

/// Displays an error with its causes, for log lines.
pub(crate) struct ErrorChain<'a>(pub(crate) &'a dyn std::error::Error);

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            write!(f, ": {cause}")?;
            source = cause.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A holder that removes the lock file (a delete) hands over cleanly: whoever waited
    /// on the removed file takes the new one, and the lock stays exclusive.
    #[tokio::test]
    async fn a_lock_removed_by_its_holder_is_taken_afresh() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let first = BuildLock::acquire(&root, "t").await.unwrap();
        let waiter = {
            let root = root.clone();
            tokio::spawn(async move { BuildLock::acquire(&root, "t").await.unwrap() })
        };
        // The waiter has the old file open and blocks on it.
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert!(!waiter.is_finished());
        first.remove(&root, "t").unwrap();
        assert!(!root.join(".t.lock").exists());
        let second = tokio::time::timeout(std::time::Duration::from_secs(10), waiter)
            .await
            .expect("the waiter gets the lock")
            .unwrap();
        // It holds the file now at the path, so nobody else gets it.
        assert!(BuildLock::still_at(&second._file, &root, "t"));
        assert!(BuildLock::try_acquire(&root, "t").unwrap().is_none());
        drop(second);
        assert!(BuildLock::try_acquire(&root, "t").unwrap().is_some());
    }

    #[test]
    fn names() {
        for ok in [
            "busybox",
            "debian",
            "a",
            "0",
            "py3.12",
            "my_tpl-2",
            &"a".repeat(63),
        ] {
            assert!(validate_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "-a",
            ".a",
            "_a",
            "A",
            "a/b",
            "..",
            "a b",
            "deb\u{e9}",
            &"a".repeat(64),
        ] {
            assert!(
                matches!(validate_name(bad), Err(TemplateError::InvalidName(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn build_dir_names_belong_to_one_template() {
        let hex16 = "0123456789abcdef";
        assert!(is_build_dir_of(
            OsStr::new(&format!(".build-a-{hex16}")),
            "a"
        ));
        assert!(!is_build_dir_of(
            OsStr::new(&format!(".build-a-b-{hex16}")),
            "a"
        ));
        assert!(is_build_dir_of(
            OsStr::new(&format!(".build-a-b-{hex16}")),
            "a-b"
        ));
        assert!(!is_build_dir_of(OsStr::new(".build-a-0123"), "a"));
        assert!(!is_build_dir_of(OsStr::new("a"), "a"));
    }

    #[test]
    fn elf_interpreter_detection() {
        assert_eq!(elf_has_interpreter(b"#!/bin/sh\n"), None);
        if let Ok(sh) = fs::read("/bin/sh") {
            // Debian's dash is dynamically linked.
            assert_eq!(elf_has_interpreter(&sh), Some(true));
        }
    }

    #[test]
    fn missing_tool_says_how_to_install_it() {
        assert!(find_in_path(OsStr::new("/usr/bin:/bin"), "sh").is_some());
        assert!(find_in_path(OsStr::new(""), "sh").is_none());
        let err = find_tool("debian", "no-such-tool-xyz", "run scripts/setup.sh").unwrap_err();
        assert_eq!(
            err.to_string(),
            "building template debian failed: no-such-tool-xyz not found: run scripts/setup.sh"
        );
    }

    #[test]
    fn errors_do_not_repeat_their_cause() {
        let err = Err::<(), _>(io::Error::from(io::ErrorKind::NotFound))
            .at("read", Path::new("/x"))
            .unwrap_err();
        assert_eq!(err.to_string(), "cannot read /x");
        assert!(ErrorChain(&err).to_string().starts_with("cannot read /x: "));
    }
}
