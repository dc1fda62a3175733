//! Policies over time: TTL, idle timeout, keepalive, activity, what a
//! sandbox's state costs, and purging the records of destroyed sandboxes.
//!
//! A sandbox is *idle* when nobody has used it through the API (commands,
//! output, signals, keepalive — merely reading the sandbox object does not
//! count) for `idle_timeout_seconds` **and** no command is running in it. A
//! command that runs for hours keeps its sandbox alive; the timer starts when
//! the last command ends.

use std::time::Duration;

use space_api::{KeepaliveRequest, OnIdle, OperationKind, Sandbox, SandboxState};
use space_core::{format_time, now_rfc3339};
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
}

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
            });
            entry.at = now;
            let due = now - entry.persisted >= PERSIST_EVERY;
            if due {
                entry.persisted = now;
            }
            due
        };
        if persist {
            if let Ok(mut rec) = self.record(id) {
                rec.sandbox.last_active_at = Some(format_time(now));
                let _ = self.0.store.touch_sandbox(&rec);
            }
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
    pub fn keepalive(&self, id: &str, req: KeepaliveRequest) -> Result<Sandbox> {
        let mut rec = self.record(id)?;
        if matches!(
            rec.sandbox.state,
            SandboxState::Destroying | SandboxState::Destroyed | SandboxState::Failed
        ) {
            return Err(ServiceError::Conflict(format!(
                "sandbox {id} is {}: there is nothing to keep alive",
                rec.sandbox.state
            )));
        }
        if let Some(ttl) = req.ttl_seconds {
            check_lifetime("ttl_seconds", ttl)?;
            rec.sandbox.ttl_seconds = Some(ttl);
        }
        let now = OffsetDateTime::now_utc();
        if let Some(ttl) = rec.sandbox.ttl_seconds {
            rec.sandbox.expires_at = Some(format_time(plus(now, ttl)));
        }
        rec.sandbox.last_active_at = Some(format_time(now));
        rec.sandbox.updated_at = now_rfc3339();
        self.0.store.update_sandbox(&rec)?;
        self.touch(id);
        Ok(self.decorate(rec.sandbox))
    }

    /// Fills in what is computed rather than stored: cost and the idle deadline.
    pub(crate) fn decorate(&self, mut sb: Sandbox) -> Sandbox {
        let dir = self.sandbox_dir(&sb.id);
        match sb.state {
            SandboxState::Running | SandboxState::Paused | SandboxState::Pausing => {
                sb.cost.memory_bytes = self.rt(&sb.id).resident_bytes(&sb.id, &dir);
                sb.cost.snapshot_bytes = None;
                sb.cost.disk_bytes = self.rt(&sb.id).disk_bytes(&sb.id, &dir);
            }
            SandboxState::Suspended => {
                sb.cost.memory_bytes = Some(0);
                sb.cost.disk_bytes = self.rt(&sb.id).disk_bytes(&sb.id, &dir);
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

    /// Starts the task that applies TTLs, idle timeouts and retention.
    pub(crate) fn spawn_reaper(&self) {
        let svc = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(TICK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                svc.reap_once();
            }
        });
    }

    fn reap_once(&self) {
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
                        if self.0.store.purge_sandbox(&sb.id).is_ok() {
                            let _ = std::fs::remove_dir_all(self.outputs_root().join(&sb.id));
                            lock(&self.0.activity).remove(&sb.id);
                        }
                    }
                    continue;
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
    /// Events after `after`, oldest first (the log behind `GET /v1/events`).
    pub fn events_after(&self, after: i64, limit: usize) -> Result<Vec<space_api::Event>> {
        Ok(self.0.store.events_after(after, limit)?)
    }

    /// Watches the id of the newest event.
    pub fn subscribe_events(&self) -> tokio::sync::watch::Receiver<i64> {
        self.0.store.subscribe_events()
    }
}
