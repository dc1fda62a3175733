//! Directory watches: what changed under a directory of a sandbox, found by
//! comparing its listings (through the agent, like every file call), so a watch
//! works the same on every runtime and survives a pause or a suspend.
//!
//! A change between two looks is reported once: a file written twice is one
//! `Write`, and one created and removed again is not seen at all. A rename is a
//! `Remove` of the old name and a `Create` of the new one.

use std::collections::BTreeMap;
use std::time::Duration;

use space_api::{FileInfo, FileType};

use super::scope::TenantService;
use super::tenancy::{Permit, Tenant};
use super::{Result, Service, ServiceError};

/// How often a waiting watch looks again.
const POLL: Duration = Duration::from_millis(200);
/// How deep a recursive watch looks.
const RECURSIVE_DEPTH: u32 = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsEventKind {
    Create,
    Write,
    Remove,
    Chmod,
}

/// One change under a watched directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsEvent {
    pub kind: FsEventKind,
    /// The entry's path relative to the watched directory (`sub/file` for a
    /// recursive watch).
    pub name: String,
    /// The entry as it is now (`None` once removed).
    pub entry: Option<FileInfo>,
}

/// A watch of one directory; holds one of the tenant's open streams while it lives.
pub struct DirWatcher {
    svc: Service,
    tenant: Tenant,
    sandbox: String,
    path: String,
    depth: u32,
    seen: BTreeMap<String, FileInfo>,
    _permit: Permit,
}

impl TenantService<'_> {
    /// Starts watching directory `path` of sandbox `id` (its subdirectories too with
    /// `recursive`). 404 when it does not exist, 400 when it is not a directory.
    pub async fn watch_dir(&self, id: &str, path: &str, recursive: bool) -> Result<DirWatcher> {
        let info = self.stat_file(id, path).await?;
        if info.kind != FileType::Dir {
            return Err(ServiceError::BadRequest(format!(
                "{} is not a directory",
                super::truncate(path, 256)
            )));
        }
        let (svc, tenant) = self.parts();
        let permit = svc.admit_stream(tenant)?;
        let mut w = DirWatcher {
            svc: svc.clone(),
            tenant: tenant.clone(),
            sandbox: id.to_string(),
            path: info.path,
            depth: if recursive { RECURSIVE_DEPTH } else { 1 },
            seen: BTreeMap::new(),
            _permit: permit,
        };
        w.seen = w.look().await?;
        Ok(w)
    }
}

impl DirWatcher {
    /// The sandbox it watches.
    pub fn sandbox_id(&self) -> &str {
        &self.sandbox
    }

    async fn look(&self) -> Result<BTreeMap<String, FileInfo>> {
        let listing = self
            .svc
            .for_tenant(&self.tenant)
            .list_files(&self.sandbox, &self.path, Some(self.depth))
            .await?;
        let prefix = format!("{}/", self.path.trim_end_matches('/'));
        Ok(listing
            .entries
            .into_iter()
            .filter_map(|e| {
                let rel = e.path.strip_prefix(&prefix)?.to_string();
                Some((rel, e))
            })
            .collect())
    }

    /// The changes since the last call (or the start), at once.
    pub async fn changes(&mut self) -> Result<Vec<FsEvent>> {
        let now = self.look().await?;
        let mut out = Vec::new();
        for (name, e) in &now {
            match self.seen.get(name) {
                None => out.push(FsEvent {
                    kind: FsEventKind::Create,
                    name: name.clone(),
                    entry: Some(e.clone()),
                }),
                Some(old) => {
                    if old.size != e.size || old.mtime != e.mtime || old.kind != e.kind {
                        out.push(FsEvent {
                            kind: FsEventKind::Write,
                            name: name.clone(),
                            entry: Some(e.clone()),
                        });
                    }
                    if old.mode != e.mode {
                        out.push(FsEvent {
                            kind: FsEventKind::Chmod,
                            name: name.clone(),
                            entry: Some(e.clone()),
                        });
                    }
                }
            }
        }
        for name in self.seen.keys() {
            if !now.contains_key(name) {
                out.push(FsEvent {
                    kind: FsEventKind::Remove,
                    name: name.clone(),
                    entry: None,
                });
            }
        }
        self.seen = now;
        Ok(out)
    }

    /// Waits up to `wait` for changes; an empty answer means none came.
    pub async fn next(&mut self, wait: Duration) -> Result<Vec<FsEvent>> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let changes = self.changes().await?;
            if !changes.is_empty() || tokio::time::Instant::now() + POLL > deadline {
                return Ok(changes);
            }
            tokio::time::sleep(POLL).await;
        }
    }
}
