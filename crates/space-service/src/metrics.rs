//! Prometheus metrics (`GET /metrics`, the server's token only), in the text exposition
//! format, written by hand: counters and histograms are atomics recorded where things
//! happen; gauges (sandboxes by state, pools, running commands) are read from the store
//! when scraped, so they are never out of step with it.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `space_http_request_duration_seconds` | histogram | `method`, `route` (the matched route), `status` |
//! | `space_operation_duration_seconds` | histogram | `kind`, `outcome` (`succeeded`, `failed`, `cancelled`, `claimed`) |
//! | `space_sandboxes` | gauge | `state`, `runtime` (pooled ones included, `pooled="true"`) |
//! | `space_pool_size`, `space_pool_ready`, `space_pool_starting` | gauge | `pool`, `template` |
//! | `space_pool_claims_total` | counter | `pool`, `template` |
//! | `space_agent_connections_total`, `space_agent_reconnects_total` | counter | — |
//! | `space_commands_started_total` | counter | — |
//! | `space_commands_running` | gauge | — |
//! | `space_output_bytes_total` | counter | `stream` (`stdout`, `stderr`): command output stored |
//! | `space_streamed_bytes_total` | counter | `what` (`output`, `download`): bytes sent to clients |

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

use super::{lock, pools::POOL_TENANT, Principal, Result, Service, ServiceError};

/// Upper bounds of the histogram buckets, seconds.
const BUCKETS: [f64; 14] = [
    0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0,
];

#[derive(Default)]
struct Histogram {
    /// Per bucket (not cumulative); the last one is +Inf.
    counts: [u64; BUCKETS.len() + 1],
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, secs: f64) {
        let i = BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(BUCKETS.len());
        self.counts[i] += 1;
        self.sum += secs;
        self.count += 1;
    }

    fn write(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (i, b) in BUCKETS.iter().enumerate() {
            cumulative += self.counts[i];
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

/// What the service counts as it works.
#[derive(Default)]
pub(crate) struct Metrics {
    http: Mutex<BTreeMap<(String, String, u16), Histogram>>,
    operations: Mutex<BTreeMap<(String, String), Histogram>>,
    pub commands_started: AtomicU64,
    streamed_output: AtomicU64,
    streamed_download: AtomicU64,
}

/// A label value as the exposition format wants it.
fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Metrics {
    pub(crate) fn operation_ended(&self, kind: &str, outcome: &str, took: Duration) {
        lock(&self.operations)
            .entry((kind.to_string(), outcome.to_string()))
            .or_default()
            .observe(took.as_secs_f64());
    }
}

/// Command output stored on the host, by stream (process-wide: the output pumps count
/// where they write).
static STDOUT_BYTES: AtomicU64 = AtomicU64::new(0);
static STDERR_BYTES: AtomicU64 = AtomicU64::new(0);

pub(crate) fn output_stored(stdout: bool, bytes: usize) {
    let c = if stdout { &STDOUT_BYTES } else { &STDERR_BYTES };
    c.fetch_add(bytes as u64, Relaxed);
}

impl Service {
    /// Records one answered HTTP request of a front door (`route`: the matched route
    /// pattern, never the raw path, so ids do not make new series).
    pub fn observe_request(&self, method: &str, route: &str, status: u16, took: Duration) {
        lock(&self.0.metrics.http)
            .entry((method.to_string(), route.to_string(), status))
            .or_default()
            .observe(took.as_secs_f64());
    }

    /// Counts bytes sent to a client: command output (`download` false) or a file
    /// download.
    pub fn observe_streamed(&self, download: bool, bytes: usize) {
        let c = if download {
            &self.0.metrics.streamed_download
        } else {
            &self.0.metrics.streamed_output
        };
        c.fetch_add(bytes as u64, Relaxed);
    }

    /// `GET /metrics` for `who`: the operator's (the server's own token) only.
    pub fn metrics_text_as(&self, who: &Principal) -> Result<String> {
        if !who.is_server() {
            return Err(ServiceError::Forbidden(
                "metrics are the operator's: only the server's token may read them".into(),
            ));
        }
        Ok(self.metrics_text())
    }

    fn metrics_text(&self) -> String {
        let m = &self.0.metrics;
        let mut out = String::with_capacity(16 << 10);
        let head = |out: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };

        let name = "space_http_request_duration_seconds";
        head(
            &mut out,
            name,
            "histogram",
            "Time to answer an HTTP request (to its head), by matched route.",
        );
        for ((method, route, status), h) in lock(&m.http).iter() {
            let labels = format!(
                "method=\"{}\",route=\"{}\",status=\"{status}\"",
                esc(method),
                esc(route)
            );
            h.write(&mut out, name, &labels);
        }

        let name = "space_operation_duration_seconds";
        head(
            &mut out,
            name,
            "histogram",
            "Time from an operation's request to its end, by kind and outcome.",
        );
        for ((kind, outcome), h) in lock(&m.operations).iter() {
            h.write(
                &mut out,
                name,
                &format!("kind=\"{kind}\",outcome=\"{outcome}\""),
            );
        }

        let name = "space_sandboxes";
        head(
            &mut out,
            name,
            "gauge",
            "Sandboxes by state and runtime (pooled: not yet claimed).",
        );
        let mut states: BTreeMap<(String, String, bool), u64> = BTreeMap::new();
        for rec in self.0.store.list_sandboxes().unwrap_or_default() {
            let sb = &rec.sandbox;
            *states
                .entry((
                    sb.state.as_str().to_string(),
                    sb.runtime.clone(),
                    sb.tenant == POOL_TENANT,
                ))
                .or_default() += 1;
        }
        for ((state, runtime, pooled), n) in &states {
            let _ = writeln!(
                out,
                "{name}{{state=\"{state}\",runtime=\"{}\",pooled=\"{pooled}\"}} {n}",
                esc(runtime)
            );
        }

        let pools = self.list_pools().unwrap_or_default();
        for (metric, kind, help) in [
            (
                "space_pool_size",
                "gauge",
                "Ready sandboxes a warm pool keeps.",
            ),
            (
                "space_pool_ready",
                "gauge",
                "A warm pool's sandboxes ready to claim.",
            ),
            (
                "space_pool_starting",
                "gauge",
                "A warm pool's sandboxes booting.",
            ),
            (
                "space_pool_claims_total",
                "counter",
                "Creates that claimed a pooled sandbox since the server started.",
            ),
        ] {
            head(&mut out, metric, kind, help);
            for p in &pools {
                let v = match metric {
                    "space_pool_size" => u64::from(p.size),
                    "space_pool_ready" => u64::from(p.ready),
                    "space_pool_starting" => u64::from(p.starting),
                    _ => p.claims,
                };
                let _ = writeln!(
                    out,
                    "{metric}{{pool=\"{}\",template=\"{}\"}} {v}",
                    p.id,
                    esc(&p.template)
                );
            }
        }

        let (connections, reconnects) = space_agent_host::connection_counts();
        let running = self
            .0
            .store
            .unfinished_commands()
            .map(|c| c.len() as u64)
            .unwrap_or(0);
        for (metric, kind, help, v) in [
            (
                "space_agent_connections_total",
                "counter",
                "Agent connections accepted (first ones and reconnects).",
                connections,
            ),
            (
                "space_agent_reconnects_total",
                "counter",
                "Agent connections that replaced an earlier one of the same sandbox.",
                reconnects,
            ),
            (
                "space_commands_started_total",
                "counter",
                "Commands started.",
                m.commands_started.load(Relaxed),
            ),
            (
                "space_commands_running",
                "gauge",
                "Commands that have not ended.",
                running,
            ),
        ] {
            head(&mut out, metric, kind, help);
            let _ = writeln!(out, "{metric} {v}");
        }
        let name = "space_output_bytes_total";
        head(
            &mut out,
            name,
            "counter",
            "Command output stored on the host, by stream.",
        );
        let _ = writeln!(
            out,
            "{name}{{stream=\"stdout\"}} {}",
            STDOUT_BYTES.load(Relaxed)
        );
        let _ = writeln!(
            out,
            "{name}{{stream=\"stderr\"}} {}",
            STDERR_BYTES.load(Relaxed)
        );
        let name = "space_streamed_bytes_total";
        head(
            &mut out,
            name,
            "counter",
            "Bytes sent to clients: command output and file downloads.",
        );
        let _ = writeln!(
            out,
            "{name}{{what=\"output\"}} {}",
            m.streamed_output.load(Relaxed)
        );
        let _ = writeln!(
            out,
            "{name}{{what=\"download\"}} {}",
            m.streamed_download.load(Relaxed)
        );
        out
    }
}
