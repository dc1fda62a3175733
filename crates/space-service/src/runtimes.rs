//! The runtimes a server can run sandboxes on, and why one is unavailable.
//!
//! Each sandbox records its runtime by name; every lifecycle call goes to that
//! runtime. A runtime that is not available on this host (no guest kernel, no
//! QEMU, …) is still listed, with the reason, so `GET /v1/runtimes` and a create
//! that asks for it can say what to fix.

use std::sync::Arc;

use async_trait::async_trait;
use serde::Serialize;
use space_core::runtime::{Runtime, RuntimeError, RuntimeStatus, SandboxSpec};

use super::Service;

/// One runtime of this server.
pub struct RuntimeEntry {
    pub name: &'static str,
    /// What isolates a sandbox: the gVisor platform, or the microVM's accelerator.
    pub accelerator: Option<String>,
    /// `Err(reason)` when it cannot run here.
    pub runtime: Result<Arc<dyn Runtime>, String>,
}

/// Every runtime of this server; the first available one is the default.
pub struct Runtimes {
    pub entries: Vec<RuntimeEntry>,
    pub default: &'static str,
}

/// `GET /v1/runtimes` entry.
#[derive(Debug, Serialize)]
pub struct RuntimeInfo {
    pub name: &'static str,
    pub available: bool,
    pub default: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accelerator: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl Runtimes {
    pub fn new(entries: Vec<RuntimeEntry>) -> anyhow::Result<Runtimes> {
        let default = entries
            .iter()
            .find(|e| e.runtime.is_ok())
            .map(|e| e.name)
            .ok_or_else(|| anyhow::anyhow!("no runtime is available on this host"))?;
        Ok(Runtimes { entries, default })
    }

    fn entry(&self, name: &str) -> Option<&RuntimeEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// The runtime `name`, or why there is none.
    pub fn get(&self, name: &str) -> Result<&Arc<dyn Runtime>, String> {
        match self.entry(name) {
            Some(e) => e
                .runtime
                .as_ref()
                .map_err(|why| format!("runtime {name:?} is not available on this server: {why}")),
            None => Err(format!(
                "unknown runtime {name:?}: this server has {}",
                self.entries
                    .iter()
                    .map(|e| format!("{:?}", e.name))
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        }
    }

    pub fn accelerator(&self, name: &str) -> Option<String> {
        self.entry(name).and_then(|e| e.accelerator.clone())
    }

    /// Every available runtime.
    pub fn available(&self) -> impl Iterator<Item = &Arc<dyn Runtime>> {
        self.entries.iter().filter_map(|e| e.runtime.as_ref().ok())
    }

    pub fn info(&self) -> Vec<RuntimeInfo> {
        self.entries
            .iter()
            .map(|e| RuntimeInfo {
                name: e.name,
                available: e.runtime.is_ok(),
                default: e.name == self.default,
                accelerator: e.accelerator.clone(),
                reason: e.runtime.as_ref().err().cloned(),
            })
            .collect()
    }
}

impl Service {
    /// The runtime sandbox `id` runs on (the default for unknown ids). A runtime that
    /// is gone from this server answers every call with why.
    pub(crate) fn rt(&self, id: &str) -> Arc<dyn Runtime> {
        let name = self
            .0
            .store
            .get_sandbox(id)
            .ok()
            .flatten()
            .map(|r| r.sandbox.runtime)
            .unwrap_or_else(|| self.0.runtimes.default.to_string());
        match self.0.runtimes.get(&name) {
            Ok(rt) => rt.clone(),
            Err(why) => Arc::new(Unavailable(why)),
        }
    }

    pub fn runtimes_info(&self) -> Vec<RuntimeInfo> {
        self.0.runtimes.info()
    }
}

/// Stands in for a runtime this server does not have (any more): every call fails
/// with the reason, and status says the sandbox is gone, so it ends `failed`.
struct Unavailable(String);

#[async_trait]
impl Runtime for Unavailable {
    fn name(&self) -> &'static str {
        "unavailable"
    }
    async fn create(&self, _: &SandboxSpec) -> Result<(), RuntimeError> {
        Err(RuntimeError::Unsupported(self.0.clone()))
    }
    async fn pause(&self, _: &str) -> Result<(), RuntimeError> {
        Err(RuntimeError::Unsupported(self.0.clone()))
    }
    async fn resume(&self, _: &str) -> Result<(), RuntimeError> {
        Err(RuntimeError::Unsupported(self.0.clone()))
    }
    /// Destroy must always work: what is left of the sandbox here goes; whatever its
    /// runtime still runs cannot be reached from this server, which says so.
    async fn stop(&self, id: &str, _: &std::path::Path) -> Result<(), RuntimeError> {
        tracing::warn!(sandbox = %id, reason = %self.0, "cannot stop: its runtime is unavailable");
        Ok(())
    }
    async fn destroy(&self, id: &str, dir: &std::path::Path) -> Result<(), RuntimeError> {
        tracing::warn!(sandbox = %id, reason = %self.0, "destroying the records only: its runtime is unavailable");
        let _ = space_runtime::disk::unmount_below(dir).await;
        match tokio::fs::remove_dir_all(dir).await {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(RuntimeError::io(format!("removing {}", dir.display()), e))
            }
            _ => Ok(()),
        }
    }
    async fn status(&self, _: &str) -> Result<RuntimeStatus, RuntimeError> {
        Ok(RuntimeStatus::Missing)
    }
    async fn list(&self) -> Result<Vec<String>, RuntimeError> {
        Ok(Vec::new())
    }
    async fn checkpoint(
        &self,
        _: &str,
        _: &std::path::Path,
        _: &std::path::Path,
    ) -> Result<(), RuntimeError> {
        Err(RuntimeError::Unsupported(self.0.clone()))
    }
    fn snapshot_complete(&self, _: &std::path::Path) -> bool {
        false
    }
    async fn restore(
        &self,
        _: &str,
        _: &std::path::Path,
        _: &std::path::Path,
    ) -> Result<(), RuntimeError> {
        Err(RuntimeError::Unsupported(self.0.clone()))
    }
    fn resident_bytes(&self, _: &str, _: &std::path::Path) -> Option<u64> {
        None
    }
}
