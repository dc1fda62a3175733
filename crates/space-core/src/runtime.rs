//! The `Runtime` trait: what the service needs from an execution unit
//! (gVisor, microVMs). A runtime boots an isolated Linux whose
//! PID 1 is `space-agent` and gives the agent a way to dial the host's socket;
//! everything else goes through the agent. A runtime also runs template build
//! steps ([`BuildStep`]): a shell script on a copy of a layer whose result the
//! host takes back as the next layer.

use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;

/// What a runtime needs to boot one sandbox.
#[derive(Debug, Clone)]
pub struct SandboxSpec {
    pub id: String,
    /// The template's root filesystem; never written to.
    pub rootfs: PathBuf,
    /// A directory the runtime owns for this sandbox (bundle, writable layer, logs).
    pub state_dir: PathBuf,
    /// Host directory of the agent's socket and token, which the host writes; a sandbox
    /// sees it at `/.space/run` only through a read-only view (gVisor).
    pub run_dir: PathBuf,
    /// Host directory holding the server's `space-agent` binary. Never lent to a sandbox as
    /// is: gVisor gets a copy of its own (at `/.space/bin`), a microVM one in its initramfs.
    pub agent_dir: PathBuf,
    /// Environment of the agent process itself.
    pub agent_env: Vec<(String, String)>,
    pub vcpus: u32,
    pub memory_mib: u64,
    pub pids: u64,
    /// Size of the sandbox's writable layer, MiB; writes past it fail with ENOSPC
    /// inside the sandbox. 0 means no limit.
    pub disk_mib: u64,
    pub hostname: String,
    /// `None`: no network device but loopback. `Some`: one link to the host whose
    /// outbound traffic the host's firewall limits to `allow`.
    pub network: Option<EgressConfig>,
}

/// Where an egress sandbox may open connections to (already resolved and checked).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EgressConfig {
    pub allow: Vec<EgressAllow>,
}

/// One allowed destination: an IPv4 network and optionally one port (TCP and UDP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EgressAllow {
    pub addr: std::net::Ipv4Addr,
    pub prefix: u8,
    pub port: Option<u16>,
}

/// What a runtime reports about a sandbox it may or may not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuntimeStatus {
    Running,
    Paused,
    /// Known to the runtime but not running (crashed, exited).
    Stopped,
    /// Unknown to the runtime.
    Missing,
}

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("{tool} failed: {message}")]
    Tool { tool: String, message: String },
    #[error("runtime I/O failed while {context}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Unsupported(String),
    /// The sandbox's kernel never got as far as starting its agent (a guest that sat idle,
    /// or ran out of time, before its agent opened its link): booting it again may work.
    #[error("{0}")]
    BootStalled(String),
}

impl RuntimeError {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        RuntimeError::Io {
            context: context.into(),
            source,
        }
    }
}

/// Longest a single build step may run by default.
pub const DEFAULT_STEP_TIMEOUT: Duration = Duration::from_secs(15 * 60);

/// What each template build step may use: `vcpus` of CPU, `memory_mib` of memory, `pids`
/// processes, a disk of `disk_mib` for what it writes (on top of the layer it starts from),
/// and at most `step_timeout` of time. A build's imports and package downloads are bounded
/// by `disk_mib` too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BuildLimits {
    pub vcpus: u32,
    pub memory_mib: u64,
    pub pids: u64,
    pub disk_mib: u64,
    pub step_timeout: Duration,
}

impl Default for BuildLimits {
    fn default() -> Self {
        BuildLimits {
            vcpus: 2,
            memory_mib: 2048,
            pids: 1024,
            disk_mib: 8192,
            step_timeout: DEFAULT_STEP_TIMEOUT,
        }
    }
}

impl BuildLimits {
    pub fn disk_bytes(&self) -> u64 {
        self.disk_mib.saturating_mul(1 << 20)
    }

    /// The limits in words, for error messages.
    pub fn describe(&self) -> String {
        format!(
            "{} vCPUs, {} MiB of memory, {} processes, {} MiB of disk, {} s",
            self.vcpus,
            self.memory_mib,
            self.pids,
            self.disk_mib,
            self.step_timeout.as_secs()
        )
    }
}

/// Any error, boxed (what a [`PrepareRoot`] may fail with).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Host work on a build step's root directory before the step runs (for example, putting
/// the packages a step installs there). Runs on a blocking thread.
pub type PrepareRoot = Box<dyn FnOnce(&Path) -> Result<(), BoxError> + Send>;

/// One template build step for [`Runtime::run_build_step`]: `/bin/sh -c script` as root,
/// without a network, on a copy of `parent`, within `limits`. What it leaves becomes the
/// new layer at `rootfs`.
pub struct BuildStep<'a> {
    /// Names the step in what the runtime writes to `output` (`step 2/3`).
    pub label: String,
    /// The layer the step starts from; never written.
    pub parent: PathBuf,
    /// The new layer's root: an empty directory that the runtime fills with what the step
    /// left (its files only: the caller adds the mount points).
    pub rootfs: PathBuf,
    /// A private directory for the runtime's own files (disks, bundles), on the same
    /// filesystem as `rootfs`; the caller removes it, with whatever is mounted below it.
    pub work_dir: PathBuf,
    pub script: String,
    /// The complete environment of the step.
    pub env: Vec<(String, String)>,
    /// Working directory of the step (absolute).
    pub workdir: String,
    pub limits: BuildLimits,
    /// Host directory holding the server's `space-agent` (a microVM boots it).
    pub agent_dir: PathBuf,
    pub prepare: Option<PrepareRoot>,
    /// Receives the step's stdout and stderr as they come, and the runtime's own lines
    /// (`==> …`).
    pub output: &'a (dyn Fn(&[u8]) + Send + Sync),
}

/// A limit a failed build step ran into, when the runtime can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepLimit {
    Memory,
    Disk,
}

/// Why a build step did not make a layer.
#[derive(Debug, thiserror::Error)]
pub enum BuildStepError {
    /// It ran past `step_timeout` and was killed.
    #[error("the step ran past its timeout of {}s and was killed", .0.as_secs())]
    TimedOut(Duration),
    /// It ended unsuccessfully: `how` is "exited with code 3" or "ended with signal: 9 …".
    #[error("the step {how}")]
    Failed {
        how: String,
        limit: Option<StepLimit>,
    },
    /// It left more file data than it started with than its disk allows (sparse files
    /// count at their full size: every later copy of the layer may write them out).
    #[error("the step left {} MiB more file data than it started with", .grown_bytes >> 20)]
    TooLarge { grown_bytes: u64 },
    /// What it left cannot be taken into a layer (a tree too deep, say).
    #[error("the step left files that cannot be kept: {0}")]
    Unkeepable(String),
    #[error("preparing the step's root failed")]
    Prepare(#[source] BoxError),
    #[error("the step's runtime failed")]
    Runtime(#[from] RuntimeError),
}

/// One execution-unit driver. All methods are idempotent where that makes sense
/// (`destroy` of something already gone succeeds).
#[async_trait]
pub trait Runtime: Send + Sync + 'static {
    /// The name users pass as `runtime` (`gvisor`, `microvm`).
    fn name(&self) -> &'static str;
    /// Boots the sandbox; returns once its PID 1 has been started.
    async fn create(&self, spec: &SandboxSpec) -> Result<(), RuntimeError>;
    async fn pause(&self, id: &str) -> Result<(), RuntimeError>;
    async fn resume(&self, id: &str) -> Result<(), RuntimeError>;
    /// Stops everything of the sandbox but keeps its files (bundle, writable layer).
    async fn stop(&self, id: &str, state_dir: &std::path::Path) -> Result<(), RuntimeError>;
    /// Stops everything of the sandbox and removes what the runtime made for it.
    async fn destroy(&self, id: &str, state_dir: &std::path::Path) -> Result<(), RuntimeError>;
    async fn status(&self, id: &str) -> Result<RuntimeStatus, RuntimeError>;
    /// Ids of every sandbox the runtime knows about.
    async fn list(&self) -> Result<Vec<String>, RuntimeError>;
    /// Saves memory, processes and the writable layer to `image_dir`, then stops
    /// the sandbox and frees everything it held in memory. The sandbox's agent
    /// must have no open connection to the host.
    async fn checkpoint(
        &self,
        id: &str,
        state_dir: &std::path::Path,
        image_dir: &std::path::Path,
    ) -> Result<(), RuntimeError>;
    /// Whether `image_dir` holds a checkpoint this runtime finished writing, one that
    /// `restore` can start from (a checkpoint cut short by a crash does not count).
    fn snapshot_complete(&self, image_dir: &std::path::Path) -> bool;
    /// Starts the sandbox again from what `checkpoint` saved.
    async fn restore(
        &self,
        id: &str,
        state_dir: &std::path::Path,
        image_dir: &std::path::Path,
    ) -> Result<(), RuntimeError>;
    /// Resident memory of everything the sandbox runs on the host, if it runs.
    fn resident_bytes(&self, id: &str, state_dir: &std::path::Path) -> Option<u64>;
    /// Bytes the sandbox's writable layer takes on the host's disk, if known.
    fn disk_bytes(&self, _id: &str, _state_dir: &std::path::Path) -> Option<u64> {
        None
    }
    /// Tells the sandbox's agent that it may dial the host again after a quiesce (gVisor:
    /// SIGUSR1 to the agent); a no-op where a quiesce does not hold the agent.
    async fn wake_agent(&self, _id: &str) -> Result<(), RuntimeError> {
        Ok(())
    }
    /// The end of the sandbox's console (its agent's own notes and the runtime's), for the
    /// server's log when the sandbox misbehaves; `None` where the runtime keeps none. Text
    /// from inside the sandbox: bounded and printable, but untrusted.
    fn console_tail(&self, _state_dir: &std::path::Path) -> Option<String> {
        None
    }
    /// How long a connection to the sandbox's agent socket may take to say hello; `None`:
    /// the listener's own bound, short because anything in the sandbox can connect
    /// (gVisor). A runtime whose socket only its hypervisor dials can afford to wait for a
    /// guest slowed by load.
    fn agent_hello_timeout(&self) -> Option<std::time::Duration> {
        None
    }
    /// Why a sandbox that stopped by itself stopped, when the runtime can tell
    /// (asked before its remains are cleaned up).
    fn stop_reason(&self, _id: &str) -> Option<String> {
        None
    }
    /// Runs one template build step ([`BuildStep`]) in a sandbox of its own, with its limits,
    /// and fills `step.rootfs` with what it left. Everything the step ran, mounted or made
    /// outside `work_dir` is gone when this returns, whatever the outcome, and when the
    /// future is dropped.
    async fn run_build_step(&self, _step: BuildStep<'_>) -> Result<(), BuildStepError> {
        Err(RuntimeError::Unsupported(format!(
            "the {} runtime does not run template build steps",
            self.name()
        ))
        .into())
    }
    /// Removes what build steps of an earlier run of the server left behind (a killed
    /// server's build containers or VMs). Called at start, before any build.
    async fn remove_build_leftovers(&self) {}
}
