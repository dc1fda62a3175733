//! Policies over time: TTL, idle timeout, keepalive, activity, what a
//! sandbox's state costs, and purging the records of destroyed sandboxes.
//!
//! A sandbox is *idle* when nobody has used it through the API (commands,
//! output, signals, keepalive — merely reading the sandbox object does not
//! count) for `idle_timeout_seconds` **and** no command is running in it. A
//! command that runs for hours keeps its sandbox alive; the timer starts when
//! the last command ends.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use space_api::{KeepaliveRequest, OnIdle, OperationKind, Sandbox, SandboxState};
use space_core::format_time;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use super::{lock, Result, Service, ServiceError};

/// How often the policies are checked.
const TICK: Duration = Duration::from_secs(1);
/// Activity is written to the store at most this often per sandbox.
const PERSIST_EVERY: Duration = Duration::from_secs(2);
/// Bounds on the lifetimes a request may ask for.
pub(crate) const MAX_TTL_SECONDS: u64 = 365 * 24 * 3600;

/// When a sandbox was last used.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Activity {
    at: OffsetDateTime,
    persisted: OffsetDateTime,
    /// When a keepalive last became an event: a keepalive storm writes at most one
    /// event per sandbox per [`KEEPALIVE_EVENT_EVERY`].
    evented: OffsetDateTime,
}

/// How often every managed sandbox's cost is sampled.
const COST_SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// Keepalives of one sandbox become an event at most this often.
const KEEPALIVE_EVENT_EVERY: Duration = Duration::from_secs(10);

pub(crate) fn parse_time(s: &str) -> Option<OffsetDateTime> {
    OffsetDateTime::parse(s, &Rfc3339).ok()
}

fn plus(t: OffsetDateTime, secs: u64) -> OffsetDateTime {
    t + time::Duration::seconds(i64::try_from(secs).unwrap_or(i64::MAX / 2))
}

impl Service {
    /// Records activity on a sandbox now.
    pub(crate) fn touch(&self, id: &str) {
        let now = OffsetDateTime::now_utc();
        let persist = {
            let mut map = lock(&self.0.activity);
            let entry = map.entry(id.to_string()).or_insert(Activity {
                at: now,
                persisted: OffsetDateTime::UNIX_EPOCH,
                evented: OffsetDateTime::UNIX_EPOCH,
            });
            entry.at = now;
            let due = now - entry.persisted >= PERSIST_EVERY;
            if due {
                entry.persisted = now;
            }
            due
        };
        if persist {
            // One field set in place: never a read-modify-write of the whole sandbox.
            let _ = self
                .0
                .store
                .set_sandbox_times(id, &format_time(now), None, false);
        }
    }

    /// When the sandbox was last used, from memory or (after a restart) the store.
    fn last_active(&self, sb: &Sandbox) -> Option<OffsetDateTime> {
        let mem = lock(&self.0.activity).get(&sb.id).map(|a| a.at);
        let stored = sb.last_active_at.as_deref().and_then(parse_time);
        match (mem, stored) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }

    /// `POST /v1/sandboxes/{id}/keepalive`.
    pub(super) fn keepalive(&self, id: &str, req: KeepaliveRequest) -> Result<Sandbox> {
        let rec = self.record(id)?;
        let refused = || {
            ServiceError::Conflict(format!(
                "sandbox {id} is {}: there is nothing to keep alive",
                rec.sandbox.state
            ))
        };
        if matches!(
            rec.sandbox.state,
            SandboxState::Destroying | SandboxState::Destroyed | SandboxState::Failed
        ) {
            return Err(refused());
        }
        if let Some(ttl) = req.ttl_seconds {
            check_lifetime("ttl_seconds", ttl)?;
        }
        let now = OffsetDateTime::now_utc();
        let ttl = req.ttl_seconds.or(rec.sandbox.ttl_seconds);
        let expires = ttl.map(|ttl| format_time(plus(now, ttl)));
        // A storm of keepalives writes a handful of events, not one full document each.
        let event = {
            let mut map = lock(&self.0.activity);
            let entry = map.entry(id.to_string()).or_insert(Activity {
                at: now,
                persisted: now,
                evented: OffsetDateTime::UNIX_EPOCH,
            });
            entry.at = now;
            entry.persisted = now;
            let due = req
                .ttl_seconds
                .is_some_and(|t| Some(t) != rec.sandbox.ttl_seconds)
                || now - entry.evented >= KEEPALIVE_EVENT_EVERY;
            if due {
                entry.evented = now;
            }
            due
        };
        let set = self.0.store.set_sandbox_times(
            id,
            &format_time(now),
            expires.as_deref().zip(ttl),
            event,
        )?;
        if !set {
            // It began to be destroyed (or failed) since it was read.
            let rec = self.record(id)?;
            return Err(ServiceError::Conflict(format!(
                "sandbox {id} is {}: there is nothing to keep alive",
                rec.sandbox.state
            )));
        }
        Ok(self.decorate(self.record(id)?.sandbox))
    }

    /// Sandbox events' objects with what [`Self::decorate`] computes, as of their delivery:
    /// the stored object carries no cost. Other objects are left as they are. A sandbox's
    /// disk is read once per batch however many of its events the batch holds (a client that
    /// replays a long history costs one `statfs` per sandbox, not per event).
    pub(crate) fn decorate_events(&self, events: &mut [space_api::Event]) {
        let mut disk: HashMap<String, Option<u64>> = HashMap::new();
        for event in events.iter_mut().filter(|e| e.kind == "sandbox") {
            let Ok(sb) = serde_json::from_value::<Sandbox>(event.object.clone()) else {
                continue;
            };
            let sb = self.decorate_with(sb, |id, dir| {
                *disk
                    .entry(id.to_string())
                    .or_insert_with(|| self.rt(id).disk_bytes(id, dir))
            });
            if let Ok(v) = serde_json::to_value(sb) {
                event.object = v;
            }
        }
    }

    /// Fills in what is computed rather than stored: cost and the idle deadline.
    /// Memory comes from the last sample (a request never scans `/proc`); disk is one
    /// `statfs` of the sandbox's own filesystem. Blocking: call it off the async threads.
    pub(crate) fn decorate(&self, sb: Sandbox) -> Sandbox {
        self.decorate_with(sb, |id, dir| self.rt(id).disk_bytes(id, dir))
    }

    /// [`Self::decorate`], with `disk` reading what sandbox `id`'s directory `dir` takes.
    fn decorate_with(
        &self,
        mut sb: Sandbox,
        mut disk: impl FnMut(&str, &std::path::Path) -> Option<u64>,
    ) -> Sandbox {
        let sampled = lock(&self.0.costs).get(&sb.id).cloned().unwrap_or_default();
        let dir = self.sandbox_dir(&sb.id);
        match sb.state {
            SandboxState::Running | SandboxState::Paused | SandboxState::Pausing => {
                sb.cost.memory_bytes = sampled.memory_bytes;
                sb.cost.snapshot_bytes = None;
                sb.cost.disk_bytes = disk(&sb.id, &dir);
            }
            SandboxState::Suspended => {
                sb.cost.memory_bytes = Some(0);
                sb.cost.disk_bytes = disk(&sb.id, &dir);
            }
            _ => sb.cost.memory_bytes = None,
        }
        if let Some(t) = self.last_active(&sb) {
            sb.last_active_at = Some(format_time(t));
        }
        sb.idle_expires_at = match (sb.state, sb.idle_timeout_seconds) {
            (SandboxState::Running, Some(idle)) if self.running_commands(&sb.id) == 0 => {
                self.last_active(&sb).map(|t| format_time(plus(t, idle)))
            }
            _ => None,
        };
        sb
    }

    /// Samples what a sandbox's state costs now (memory from `/proc`, disk from its
    /// filesystem), off the async threads. Lifecycle operations sample before they
    /// succeed; [`Self::spawn_cost_sampler`] keeps every sample fresh.
    pub(crate) async fn sample_cost(&self, id: &str) {
        let svc = self.clone();
        let id = id.to_string();
        let _ = tokio::task::spawn_blocking(move || svc.sample_cost_now(&id)).await;
    }

    /// Samples what sandbox `id` costs in `state`, the state it is about to be recorded in.
    pub(crate) async fn sample_cost_as(&self, id: &str, state: SandboxState) {
        let svc = self.clone();
        let id = id.to_string();
        let _ = tokio::task::spawn_blocking(move || svc.sample_cost_in(&id, state)).await;
    }

    fn sample_cost_now(&self, id: &str) {
        let Ok(rec) = self.record(id) else {
            lock(&self.0.costs).remove(id);
            return;
        };
        self.sample_cost_in(id, rec.sandbox.state);
    }

    fn sample_cost_in(&self, id: &str, state: SandboxState) {
        let dir = self.sandbox_dir(id);
        let rt = self.rt(id);
        let cost = match state {
            SandboxState::Running | SandboxState::Paused | SandboxState::Pausing => {
                space_api::Cost {
                    memory_bytes: rt.resident_bytes(id, &dir),
                    snapshot_bytes: None,
                    disk_bytes: rt.disk_bytes(id, &dir),
                }
            }
            SandboxState::Suspended => space_api::Cost {
                memory_bytes: Some(0),
                snapshot_bytes: None,
                disk_bytes: rt.disk_bytes(id, &dir),
            },
            _ => {
                lock(&self.0.costs).remove(id);
                return;
            }
        };
        lock(&self.0.costs).insert(id.to_string(), cost);
    }

    /// Starts the task that samples every managed sandbox's cost every [`COST_SAMPLE_EVERY`].
    pub(crate) fn spawn_cost_sampler(&self) {
        let svc = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(COST_SAMPLE_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let ids: Vec<String> = lock(&svc.0.sandboxes).keys().cloned().collect();
                let s = svc.clone();
                let _ = tokio::task::spawn_blocking(move || {
                    lock(&s.0.costs).retain(|id, _| ids.contains(id));
                    for id in &ids {
                        s.sample_cost_now(id);
                    }
                })
                .await;
            }
        });
    }

    /// Starts the task that applies TTLs, idle timeouts and retention.
    pub(crate) fn spawn_reaper(&self) {
        let svc = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(TICK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                svc.reap_once();
                svc.enforce_output_budgets().await;
            }
        });
    }

    /// Keeps every sandbox whose output budget is due a check within it: the output of
    /// its finished commands goes, oldest first (their results then say
    /// `output_truncated`). Running commands keep to their share by themselves.
    async fn enforce_output_budgets(&self) {
        let due: Vec<Arc<super::SandboxHandle>> = lock(&self.0.sandboxes)
            .values()
            .filter(|h| {
                h.output_due
                    .swap(false, std::sync::atomic::Ordering::Relaxed)
            })
            .cloned()
            .collect();
        for h in due {
            let svc = self.clone();
            let _ = tokio::task::spawn_blocking(move || svc.enforce_output_budget(&h)).await;
        }
    }

    fn enforce_output_budget(&self, h: &super::SandboxHandle) {
        let limit = h.output.limit();
        if limit == 0 {
            return;
        }
        let root = self.outputs_root().join(&h.id);
        let Ok(commands) = self.0.store.list_commands(&h.id) else {
            return;
        };
        let mut total: u64 = commands
            .iter()
            .map(|c| super::output::disk_usage(&root.join(&c.id)))
            .sum();
        for cmd in commands.into_iter().filter(|c| c.state.is_terminal()) {
            if total <= limit {
                break;
            }
            match super::output::drop_all(&root.join(&cmd.id)) {
                Ok(0) => {}
                Ok(freed) => {
                    total = total.saturating_sub(freed);
                    let _ = self.modify_command(&h.id, &cmd.id, |c| {
                        Ok::<_, ServiceError>(c.result.as_mut().map(|r| {
                            r.output_truncated = true;
                        }))
                    });
                    tracing::info!(sandbox = %h.id, command = %cmd.id, freed, "output budget: dropped a finished command's output");
                }
                Err(e) => {
                    tracing::warn!(sandbox = %h.id, command = %cmd.id, error = %e, "dropping output")
                }
            }
        }
    }

    /// Releases whatever a failed sandbox may still hold (its runtime already let go
    /// when it failed) and purges its records and output.
    fn spawn_purge_failed(&self, id: String) {
        {
            let mut purging = lock(&self.0.purging);
            if !purging.insert(id.clone()) {
                return;
            }
        }
        let svc = self.clone();
        tokio::spawn(async move {
            let handle = svc.handle(&id);
            let _lifecycle = handle.lifecycle.lock().await;
            let still_failed = svc
                .record(&id)
                .is_ok_and(|r| r.sandbox.state == SandboxState::Failed);
            if still_failed {
                tracing::info!(sandbox = %id, "purging the records of a failed sandbox");
                let cleaned = svc.rt(&id).destroy(&id, &svc.sandbox_dir(&id)).await;
                let _ = tokio::fs::remove_dir_all(svc.snapshot_dir(&id)).await;
                // Output first, records last: once the sandbox answers 404, nothing of
                // it is left on disk.
                if cleaned.is_ok() {
                    let _ = tokio::fs::remove_dir_all(svc.outputs_root().join(&id)).await;
                    if svc.0.store.purge_sandbox(&id).is_ok() {
                        lock(&svc.0.activity).remove(&id);
                    }
                }
            }
            drop(_lifecycle);
            svc.forget_handle(&id);
            lock(&svc.0.purging).remove(&id);
        });
    }

    /// One pass of the policies: TTLs, idle timeouts, retention of destroyed and failed
    /// records, old events. The reaper runs it every [`TICK`]; unit tests call it directly.
    pub(crate) fn reap_once(&self) {
        let Ok(records) = self.0.store.list_sandboxes() else {
            return;
        };
        let now = OffsetDateTime::now_utc();
        let retention =
            time::Duration::try_from(self.0.cfg.retention).unwrap_or(time::Duration::MAX);
        for rec in records {
            let sb = &rec.sandbox;
            match sb.state {
                SandboxState::Destroyed => {
                    let gone = sb.destroyed_at.as_deref().and_then(parse_time);
                    if gone.is_some_and(|t| now - t > retention) {
                        tracing::info!(sandbox = %sb.id, "purging the records of a destroyed sandbox");
                        // Output first, records last: once the sandbox answers 404,
                        // nothing of it is left on disk (its retention is over either way).
                        let _ = std::fs::remove_dir_all(self.outputs_root().join(&sb.id));
                        if self.0.store.purge_sandbox(&sb.id).is_ok() {
                            lock(&self.0.activity).remove(&sb.id);
                        }
                    }
                    continue;
                }
                SandboxState::Failed => {
                    // A failed sandbox holds records and output (and counts against its
                    // tenant's sandboxes) until it is destroyed, or until retention ends.
                    let failed = parse_time(&sb.updated_at);
                    if failed.is_some_and(|t| now - t > retention) {
                        self.spawn_purge_failed(sb.id.clone());
                        continue;
                    }
                }
                SandboxState::Destroying => continue,
                _ => {}
            }
            let expired = sb
                .expires_at
                .as_deref()
                .and_then(parse_time)
                .is_some_and(|t| now >= t);
            if expired {
                if self
                    .request_lifecycle(&sb.id, OperationKind::Destroy, Some("ttl expired"))
                    .is_ok()
                {
                    tracing::info!(sandbox = %sb.id, "ttl expired: destroying");
                }
                continue;
            }
            let Some(idle) = sb.idle_timeout_seconds else {
                continue;
            };
            if sb.state != SandboxState::Running || self.running_commands(&sb.id) > 0 {
                continue;
            }
            let Some(last) = self.last_active(sb) else {
                continue;
            };
            if now >= plus(last, idle) {
                let (kind, what) = match sb.on_idle.unwrap_or(OnIdle::Suspend) {
                    OnIdle::Suspend => (OperationKind::Suspend, "suspending"),
                    OnIdle::Destroy => (OperationKind::Destroy, "destroying"),
                };
                let why = format!("idle for {idle}s");
                if self.request_lifecycle(&sb.id, kind, Some(&why)).is_ok() {
                    tracing::info!(sandbox = %sb.id, idle, "idle timeout: {what}");
                }
            }
        }
        if let Ok(cutoff) = (now - retention).format(&Rfc3339) {
            let _ = self.0.store.purge_events_before(&cutoff);
        }
    }
}

/// TTLs and idle timeouts are whole seconds from 1 s to a year.
pub(crate) fn check_lifetime(name: &str, secs: u64) -> Result<()> {
    if secs == 0 || secs > MAX_TTL_SECONDS {
        return Err(ServiceError::BadRequest(format!(
            "{name} must be between 1 and {MAX_TTL_SECONDS}"
        )));
    }
    Ok(())
}

/// `created_at + ttl` for a new sandbox.
pub(crate) fn expiry(ttl: Option<u64>) -> Option<String> {
    ttl.map(|t| format_time(plus(OffsetDateTime::now_utc(), t)))
}

impl Service {
    /// Watches the id of the newest event.
    pub fn subscribe_events(&self) -> tokio::sync::watch::Receiver<i64> {
        self.0.store.subscribe_events()
    }
}
