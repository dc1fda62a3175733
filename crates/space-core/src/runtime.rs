//! The `Runtime` trait: what the service needs from an execution unit
//! (gVisor today, microVMs next). A runtime boots an isolated Linux whose
//! PID 1 is `space-agent` and gives the agent a way to dial the host's socket;
//! everything else goes through the agent.

use std::path::PathBuf;

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
}

impl RuntimeError {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        RuntimeError::Io {
            context: context.into(),
            source,
        }
    }
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
    /// Why a sandbox that stopped by itself stopped, when the runtime can tell
    /// (asked before its remains are cleaned up).
    fn stop_reason(&self, _id: &str) -> Option<String> {
        None
    }
}
