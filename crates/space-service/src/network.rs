//! The `network` of a sandbox: a create request's spec is checked and its allowlist
//! resolved here (hostnames on the host, at create, once); the runtime enforces the
//! stored result (`space_runtime::net`) and re-applies exactly it on every restore.
//! Hostnames of the allowlist reach the sandbox as lines of its `/etc/hosts`, written
//! through the agent once it is up (there is no DNS: a resolver is just another
//! address, reachable only if allowed).

use bytes::Bytes;
use space_api::ErrorCode;
use space_api::{ApiError, EgressRule, NetworkSpec};
use space_core::runtime::{EgressAllow, EgressConfig};
use space_runtime::net;

use space_agent_host::{self as agent, AgentConn, AgentError, Retry};

use super::{error_chain, ServiceError};

/// Largest `/etc/hosts` the host reads back from a sandbox to extend it.
const MAX_HOSTS_FILE: usize = 64 << 10;

/// The network spec to store for a create request; a 400 for anything invalid.
pub(crate) fn resolve(req: Option<&NetworkSpec>) -> Result<NetworkSpec, ServiceError> {
    let bad = |m: String| Err(ServiceError::BadRequest(m));
    let Some(n) = req else {
        return Ok(NetworkSpec {
            mode: "none".into(),
            ..Default::default()
        });
    };
    if n.resolved.is_some() {
        return bad("network.resolved is set by the server; give network.allow".into());
    }
    match n.mode.as_str() {
        "none" if n.allow.is_some() => bad("network.allow needs network.mode \"egress\"".into()),
        "none" => Ok(NetworkSpec {
            mode: "none".into(),
            ..Default::default()
        }),
        "egress" => {
            let Some(allow) = &n.allow else {
                return bad("network.mode \"egress\" needs network.allow".into());
            };
            // Name lookups may wait on DNS: keep them off the other requests' way.
            let lookup = || net::resolve_allowlist(allow);
            let multi_thread = tokio::runtime::Handle::try_current()
                .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
            let resolved = if multi_thread {
                tokio::task::block_in_place(lookup)
            } else {
                lookup()
            }
            .map_err(ServiceError::BadRequest)?;
            Ok(NetworkSpec {
                mode: "egress".into(),
                allow: Some(allow.clone()),
                resolved: Some(
                    resolved
                        .iter()
                        .map(|r| EgressRule {
                            entry: r.entry.clone(),
                            cidr: r.cidr(),
                            port: r.port,
                            host: r.host.clone(),
                        })
                        .collect(),
                ),
            })
        }
        other => bad(format!(
            "network.mode {other:?} is not supported: \"none\" or \"egress\""
        )),
    }
}

fn parse_cidr(cidr: &str) -> Option<(std::net::Ipv4Addr, u8)> {
    let (a, p) = cidr.split_once('/')?;
    Some((a.parse().ok()?, p.parse().ok().filter(|p| *p <= 32)?))
}

/// What the runtime enforces for a stored spec (`None`: no network but loopback).
pub(crate) fn egress_config(n: &NetworkSpec) -> Option<EgressConfig> {
    if n.mode != "egress" {
        return None;
    }
    let allow = n
        .resolved
        .iter()
        .flatten()
        .filter_map(|r| {
            let (addr, prefix) = parse_cidr(&r.cidr)?;
            Some(EgressAllow {
                addr,
                prefix,
                port: r.port,
            })
        })
        .collect();
    Some(EgressConfig { allow })
}

/// The comment above the lines [`write_hosts`] adds.
const HOSTS_MARK: &str = "# space: the hostnames of network.allow, as resolved at create\n";

/// Adds the allowlist's hostnames to the sandbox's `/etc/hosts` (once, at create, or at
/// a pool's claim), on the agent connection `rx` holds. A connection that breaks under
/// it (the agent dials again) does not fail the create: it is done again on the next
/// one, and a file that already has the lines is left as it is.
pub(crate) async fn write_hosts(
    rx: &mut tokio::sync::watch::Receiver<Option<AgentConn>>,
    n: &NetworkSpec,
) -> Result<(), ApiError> {
    let mut lines = String::new();
    for r in n.resolved.iter().flatten() {
        if let (Some(host), Some((addr, 32))) = (&r.host, parse_cidr(&r.cidr)) {
            let line = format!("{addr}\t{host}\n");
            if !lines.contains(&line) {
                lines.push_str(&line);
            }
        }
    }
    if lines.is_empty() {
        return Ok(());
    }
    let lines = lines.as_str();
    agent::call_again_on_break(
        rx,
        super::files::CONNECT_TIMEOUT,
        Retry::Repeatable,
        "hosts",
        |conn| async move { add_hosts(&conn, lines).await },
    )
    .await
    .map_err(|e| {
        ApiError::new(
            ErrorCode::NetworkFailed,
            format!(
                "adding the allowlist's names to /etc/hosts: {}",
                error_chain(&e)
            ),
        )
    })
}

/// Appends `lines` under [`HOSTS_MARK`] to `/etc/hosts`, unless that very block is there
/// already (a write whose answer was lost): made twice, the same as once. (A template
/// made from a sandbox may carry another allowlist's block: this one still goes in.)
async fn add_hosts(conn: &AgentConn, lines: &str) -> Result<(), AgentError> {
    let mut text = match conn.read_file("/etc/hosts", MAX_HOSTS_FILE).await {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        // None yet (or none the agent will read): start one.
        Err(AgentError::Refused { .. }) => "127.0.0.1\tlocalhost\n".to_string(),
        Err(e) => return Err(e),
    };
    let block = format!("{HOSTS_MARK}{lines}");
    if text.contains(&block) {
        return Ok(());
    }
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(&block);
    conn.write_file("/etc/hosts", Bytes::from(text)).await?;
    Ok(())
}
