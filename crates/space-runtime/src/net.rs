//! Egress networking of a sandbox (`network.mode = "egress"`): the allowlist's
//! validation and resolution, and everything on the host that enforces it.
//!
//! Each egress sandbox gets one point-to-point link to the host on its own /30 out
//! of [`LINK_NET`]: a veth pair whose far end lives in a network namespace of its own
//! (gVisor copies that end into its user-space network stack), or a tap device that
//! QEMU attaches to a virtio-net device (microVM). Enforcement is in the host kernel,
//! keyed on the host-side interface, never inside the sandbox:
//!
//! - `filter INPUT → SPACE-INPUT`: everything from the interface to the host itself is
//!   dropped (the gateway address, the host's other addresses, its loopback services).
//! - `filter FORWARD → SPACE-FORWARD`: replies to the interface (conntrack
//!   ESTABLISHED,RELATED) pass, anything else new towards it is dropped; traffic from
//!   it goes to the sandbox's own chain `SPACE-E-<hash>`: spoofed sources and the
//!   never-reachable ranges ([`BLOCKED`]) are dropped first, then the allowlist is
//!   accepted, then the rest is dropped.
//! - `nat POSTROUTING → SPACE-POSTROUTING`: the sandbox's address is masqueraded.
//! - IPv6 is disabled on both ends and dropped by ip6tables on the interface.
//!
//! The three global chains and their jumps (position 1 of their parent) are shared by
//! every `space serve` on the host and created idempotently; every per-sandbox rule
//! carries the comment `space:<sandbox id>` and is removed by that tag only, so a server
//! only ever touches sandboxes it knows. Setup and teardown of all servers on a host are
//! serialised by an `flock` on [`LOCK_FILE`].
//!
//! What a link looks like is kept in `network.json` in the sandbox's state directory,
//! so a restore (gVisor restore, QEMU `-incoming`) re-creates the same link with the
//! same addresses (a microVM guest keeps its address in its memory image).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr, ToSocketAddrs};
use std::path::Path;
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};
use sha2::Digest;
use space_core::runtime::{EgressAllow, EgressConfig, RuntimeError};

/// The links of egress sandboxes are carved out of this /16, one /30 each.
pub const LINK_NET: (Ipv4Addr, u8) = (Ipv4Addr::new(10, 213, 0, 0), 16);
/// Serialises network setup and teardown of every server on the host.
pub const LOCK_FILE: &str = "/run/space-net.lock";
/// Where `ip netns` keeps named network namespaces.
pub const NETNS_DIR: &str = "/run/netns";
/// The state of a sandbox's link, in its state directory.
pub const STATE_FILE: &str = "network.json";
/// Most entries an allowlist may have, and most rules they may resolve to.
pub const MAX_ENTRIES: usize = 64;
pub const MAX_RULES: usize = 256;
/// A hosts(5) file consulted before the system resolver when an allowlist names a
/// host (an operator's private view of names; the tests use it).
pub const HOSTS_FILE_ENV: &str = "SPACE_EGRESS_HOSTS_FILE";

/// Destinations no sandbox may ever reach, whatever its allowlist says.
pub const BLOCKED: &[(Ipv4Addr, u8, &str)] = &[
    (Ipv4Addr::new(0, 0, 0, 0), 8, "\"this network\""),
    (Ipv4Addr::new(10, 0, 0, 0), 8, "private"),
    (
        Ipv4Addr::new(100, 64, 0, 0),
        10,
        "shared (carrier-grade NAT)",
    ),
    (Ipv4Addr::new(127, 0, 0, 0), 8, "loopback"),
    (
        Ipv4Addr::new(169, 254, 0, 0),
        16,
        "link-local (cloud metadata)",
    ),
    (Ipv4Addr::new(172, 16, 0, 0), 12, "private"),
    (Ipv4Addr::new(192, 168, 0, 0), 16, "private"),
    (Ipv4Addr::new(192, 0, 0, 0), 24, "IETF protocol assignments"),
    (Ipv4Addr::new(224, 0, 0, 0), 4, "multicast"),
    (Ipv4Addr::new(240, 0, 0, 0), 4, "reserved"),
    (Ipv4Addr::new(255, 255, 255, 255), 32, "broadcast"),
    // Cloud metadata and wire servers outside the ranges above. (Most clouds answer at
    // 169.254.169.254, or elsewhere in link-local: AWS ECS 169.254.170.2, Tencent
    // 169.254.0.23, the AWS resolver and time server at 169.254.169.253/.123.)
    (
        Ipv4Addr::new(168, 63, 129, 16),
        32,
        "Azure's wire server (cloud metadata)",
    ),
    (
        Ipv4Addr::new(100, 100, 100, 200),
        32,
        "Alibaba Cloud's metadata server",
    ),
];

/// IPv6 destinations no sandbox may ever reach. Egress is IPv4 only today (every IPv6
/// entry is refused, and the firewall drops all IPv6); these are refused by name so that
/// the list is already right when IPv6 comes: the clouds' IPv6 metadata servers, and the
/// ranges that would reach the host or a private network.
pub const BLOCKED_V6: &[(std::net::Ipv6Addr, u8, &str)] = &[
    (
        std::net::Ipv6Addr::new(0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0),
        32,
        "AWS's IPv6 metadata, resolver and time servers (fd00:ec2::254, ::253, ::123)",
    ),
    (
        std::net::Ipv6Addr::new(0xfd20, 0x00ce, 0, 0, 0, 0, 0, 0x254),
        128,
        "Google Cloud's IPv6 metadata server",
    ),
    (
        std::net::Ipv6Addr::new(0xfc00, 0, 0, 0, 0, 0, 0, 0),
        7,
        "unique local (private)",
    ),
    (
        std::net::Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0),
        10,
        "link-local",
    ),
    (
        std::net::Ipv6Addr::new(0xff00, 0, 0, 0, 0, 0, 0, 0),
        8,
        "multicast",
    ),
    (
        std::net::Ipv6Addr::UNSPECIFIED,
        96,
        "loopback, unspecified and IPv4-compatible",
    ),
    (
        std::net::Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0, 0),
        96,
        "IPv4-mapped (checked as IPv4)",
    ),
    (
        std::net::Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, 0, 0),
        96,
        "NAT64",
    ),
];

/// Why an IPv6 destination may not be allowed: always (egress is IPv4 only), with the
/// reason a metadata or private address would also have.
fn refusal_v6(addr: std::net::Ipv6Addr) -> String {
    let bits = u128::from(addr);
    for (net, p, what) in BLOCKED_V6 {
        let m = if *p == 0 {
            0
        } else {
            u128::MAX << (128 - u32::from(*p))
        };
        if bits & m == u128::from(*net) & m {
            return format!(
                "{addr} is {what}, which is never reachable (and IPv6 is not supported yet)"
            );
        }
    }
    "IPv6 is not supported yet".into()
}

/// One checked allowlist entry, resolved to one network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// The entry as given.
    pub entry: String,
    pub addr: Ipv4Addr,
    pub prefix: u8,
    pub port: Option<u16>,
    /// The hostname, when the entry named one.
    pub host: Option<String>,
}

impl Resolved {
    pub fn cidr(&self) -> String {
        format!("{}/{}", self.addr, self.prefix)
    }

    pub fn allow(&self) -> EgressAllow {
        EgressAllow {
            addr: self.addr,
            prefix: self.prefix,
            port: self.port,
        }
    }
}

fn mask(prefix: u8) -> u32 {
    if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix))
    }
}

/// Whether two IPv4 networks share an address.
fn overlaps(a: Ipv4Addr, ap: u8, b: Ipv4Addr, bp: u8) -> bool {
    let m = mask(ap.min(bp));
    (u32::from(a) & m) == (u32::from(b) & m)
}

/// Why `addr/prefix` may not be allowed, if it may not.
fn refusal(addr: Ipv4Addr, prefix: u8, host_addrs: &[Ipv4Addr]) -> Option<String> {
    for (net, p, what) in BLOCKED {
        if overlaps(addr, prefix, *net, *p) {
            return Some(format!(
                "it covers {net}/{p} ({what}), which is never reachable"
            ));
        }
    }
    for own in host_addrs {
        if overlaps(addr, prefix, *own, 32) {
            return Some(format!("it covers {own}, an address of the host"));
        }
    }
    None
}

/// Checks and resolves an allowlist; the error is a message for a 400.
pub fn resolve_allowlist(entries: &[String]) -> Result<Vec<Resolved>, String> {
    if entries.is_empty() {
        return Err("network.allow is empty: egress needs at least one entry".into());
    }
    if entries.len() > MAX_ENTRIES {
        return Err(format!(
            "network.allow has {} entries; at most {MAX_ENTRIES} are allowed",
            entries.len()
        ));
    }
    let host_addrs = host_addresses();
    // Test hook: extra names for tests that cannot use DNS (the `test-hooks` feature).
    let extra_hosts = cfg!(feature = "test-hooks")
        .then(|| std::env::var_os(HOSTS_FILE_ENV))
        .flatten()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .map(|text| parse_hosts(&text))
        .unwrap_or_default();
    let mut out = Vec::new();
    for raw in entries {
        let bad = |why: String| format!("network.allow entry {raw:?}: {why}");
        let entry = raw.trim();
        if entry.is_empty() || entry.len() > 270 {
            return Err(bad(
                "must be a hostname, an IPv4 address or an IPv4 CIDR".into()
            ));
        }
        if entry.contains('[') || entry.matches(':').count() > 1 {
            let bare = entry
                .trim_start_matches('[')
                .split(']')
                .next()
                .unwrap_or_default()
                .split('/')
                .next()
                .unwrap_or_default();
            return Err(bad(match bare.parse::<std::net::Ipv6Addr>() {
                Ok(a) => refusal_v6(a),
                Err(_) => "IPv6 is not supported yet".into(),
            }));
        }
        let (target, port) = match entry.rsplit_once(':') {
            Some((t, p)) => {
                let port = p
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p > 0)
                    .ok_or_else(|| bad(format!("{p:?} is not a port (1-65535)")))?;
                (t, Some(port))
            }
            None => (entry, None),
        };
        let push = |out: &mut Vec<Resolved>, addr, prefix, host: Option<String>| {
            if let Some(why) = refusal(addr, prefix, &host_addrs) {
                // A name's addresses are the host's view of its network: never echoed.
                let what = match &host {
                    Some(h) => format!(
                        "{h} resolves to an address that is never reachable from a sandbox \
                         (private, loopback, link-local, cloud metadata or the host's own)"
                    ),
                    None => why,
                };
                return Err(bad(what));
            }
            out.push(Resolved {
                entry: raw.clone(),
                addr,
                prefix,
                port,
                host,
            });
            Ok(())
        };
        if let Some((a, p)) = target.split_once('/') {
            if let Ok(v6) = a.parse::<std::net::Ipv6Addr>() {
                return Err(bad(refusal_v6(v6)));
            }
            let addr: Ipv4Addr = a
                .parse()
                .map_err(|_| bad(format!("{a:?} is not an IPv4 address")))?;
            let prefix = p
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= 32)
                .ok_or_else(|| bad(format!("{p:?} is not a prefix length (0-32)")))?;
            if u32::from(addr) & !mask(prefix) != 0 {
                let net = Ipv4Addr::from(u32::from(addr) & mask(prefix));
                return Err(bad(format!(
                    "host bits are set (the network is {net}/{prefix})"
                )));
            }
            push(&mut out, addr, prefix, None)?;
        } else if let Ok(ip) = target.parse::<IpAddr>() {
            match ip {
                IpAddr::V4(addr) => push(&mut out, addr, 32, None)?,
                IpAddr::V6(v6) => return Err(bad(refusal_v6(v6))),
            }
        } else {
            let host = target.trim_end_matches('.').to_ascii_lowercase();
            if !valid_hostname(&host) {
                return Err(bad(
                    "must be a hostname, an IPv4 address or an IPv4 CIDR".into()
                ));
            }
            let addrs = match extra_hosts.get(&host) {
                Some(a) => a.clone(),
                None => resolve(&host),
            };
            if addrs.is_empty() {
                return Err(bad(format!(
                    "{host} does not resolve to an IPv4 address on the host"
                )));
            }
            for addr in addrs {
                push(&mut out, addr, 32, Some(host.clone()))?;
            }
        }
        if out.len() > MAX_RULES {
            return Err(format!(
                "network.allow resolves to more than {MAX_RULES} addresses"
            ));
        }
    }
    Ok(out)
}

fn valid_hostname(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 253
        && h.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
        // All digits and dots would be a malformed address, not a name.
        && !h.bytes().all(|b| b.is_ascii_digit() || b == b'.')
}

/// IPv4 addresses of `host` from the system resolver, sorted, without duplicates.
fn resolve(host: &str) -> Vec<Ipv4Addr> {
    let mut v: Vec<Ipv4Addr> = (host, 0)
        .to_socket_addrs()
        .map(|it| {
            it.filter_map(|a| match a.ip() {
                IpAddr::V4(v4) => Some(v4),
                IpAddr::V6(_) => None,
            })
            .collect()
        })
        .unwrap_or_default();
    v.sort();
    v.dedup();
    v
}

/// Name → IPv4 addresses of a hosts(5) file.
fn parse_hosts(text: &str) -> BTreeMap<String, Vec<Ipv4Addr>> {
    let mut map: BTreeMap<String, Vec<Ipv4Addr>> = BTreeMap::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or_default();
        let mut words = line.split_whitespace();
        let Some(Ok(addr)) = words.next().map(str::parse::<Ipv4Addr>) else {
            continue;
        };
        for name in words {
            map.entry(name.trim_end_matches('.').to_ascii_lowercase())
                .or_default()
                .push(addr);
        }
    }
    map
}

/// Every IPv4 address configured on the host (any interface).
pub fn host_addresses() -> Vec<Ipv4Addr> {
    let mut out = Vec::new();
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list we walk read-only and free once.
    unsafe {
        if libc::getifaddrs(&mut ifap) != 0 {
            return out;
        }
        let mut p = ifap;
        while !p.is_null() {
            let a = (*p).ifa_addr;
            if !a.is_null() && i32::from((*a).sa_family) == libc::AF_INET {
                let sin = a.cast::<libc::sockaddr_in>();
                out.push(Ipv4Addr::from(u32::from_be((*sin).sin_addr.s_addr)));
            }
            p = (*p).ifa_next;
        }
        libc::freeifaddrs(ifap);
    }
    out
}

/// `/etc/hosts` lines for the hostnames of an allowlist.
pub fn hosts_lines(rules: &[Resolved]) -> String {
    let mut by_name: BTreeMap<&str, Vec<Ipv4Addr>> = BTreeMap::new();
    for r in rules {
        if let Some(h) = &r.host {
            let v = by_name.entry(h).or_default();
            if !v.contains(&r.addr) {
                v.push(r.addr);
            }
        }
    }
    let mut s = String::new();
    for (name, addrs) in by_name {
        for a in addrs {
            s.push_str(&format!("{a}\t{name}\n"));
        }
    }
    s
}

// ---- the host side --------------------------------------------------------------------

/// Which kind of link a sandbox has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LinkKind {
    /// A veth pair; the sandbox's end (`eth0`) in the namespace [`Names::netns`].
    Veth,
    /// A persistent tap device QEMU opens by name.
    Tap,
}

/// Host names of one sandbox's network objects, all derived from its id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    pub netns: String,
    /// Host end of the veth, or the tap.
    pub host_if: String,
    /// The sandbox's own filter chain.
    pub chain: String,
    /// The comment on every rule of the sandbox.
    pub tag: String,
}

pub fn names(id: &str, kind: LinkKind) -> Names {
    let digest = sha2::Sha256::digest(id.as_bytes());
    let hex: String = digest[..5].iter().map(|b| format!("{b:02x}")).collect();
    let prefix = match kind {
        LinkKind::Veth => "spv",
        LinkKind::Tap => "spt",
    };
    Names {
        netns: format!("space-{id}"),
        host_if: format!("{prefix}{hex}"),
        chain: format!("SPACE-E-{hex}"),
        tag: format!("space:{id}"),
    }
}

/// A sandbox's link as set up; kept in [`STATE_FILE`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetState {
    pub kind: LinkKind,
    pub host_if: String,
    /// Network namespace (veth only).
    pub netns: Option<String>,
    pub host_ip: Ipv4Addr,
    pub guest_ip: Ipv4Addr,
    pub prefix: u8,
    pub allow: Vec<EgressAllow>,
}

impl NetState {
    /// The MAC address of the guest's NIC (microVM), stable per sandbox.
    pub fn guest_mac(&self) -> String {
        let d = sha2::Sha256::digest(self.host_if.as_bytes());
        format!("52:54:00:{:02x}:{:02x}:{:02x}", d[0], d[1], d[2])
    }

    /// The MAC address of the host's end, stable per sandbox (locally administered).
    pub fn host_mac(&self) -> String {
        let d = sha2::Sha256::digest(format!("host:{}", self.host_if).as_bytes());
        format!(
            "02:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            d[0], d[1], d[2], d[3], d[4]
        )
    }

    /// Path of its network namespace (veth only).
    pub fn netns_path(&self) -> Option<String> {
        self.netns.as_ref().map(|n| format!("{NETNS_DIR}/{n}"))
    }
}

fn net_err(what: impl Into<String>, message: impl Into<String>) -> RuntimeError {
    RuntimeError::Tool {
        tool: what.into(),
        message: message.into(),
    }
}

/// Runs a host tool; fails with its stderr.
fn run(prog: &str, args: &[&str]) -> Result<(), RuntimeError> {
    run_input(prog, args, None).map(|_| ())
}

fn run_input(prog: &str, args: &[&str], input: Option<&str>) -> Result<String, RuntimeError> {
    let mut cmd = Command::new(prog);
    cmd.args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| RuntimeError::io(format!("running {prog}"), e))?;
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        stdin
            .write_all(text.as_bytes())
            .map_err(|e| RuntimeError::io(format!("writing to {prog}"), e))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| RuntimeError::io(format!("running {prog}"), e))?;
    if !out.status.success() {
        return Err(net_err(
            format!("{prog} {}", args.join(" ")),
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Holds the host-wide network lock while alive.
struct HostLock(std::fs::File);

impl HostLock {
    fn take() -> Result<HostLock, RuntimeError> {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(LOCK_FILE)
            .map_err(|e| RuntimeError::io(format!("opening {LOCK_FILE}"), e))?;
        use std::os::fd::AsRawFd;
        // SAFETY: flock on a descriptor we own; released when the file is closed.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(RuntimeError::io(
                format!("locking {LOCK_FILE}"),
                std::io::Error::last_os_error(),
            ));
        }
        Ok(HostLock(f))
    }
}

impl Drop for HostLock {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: as above.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// The global chains and their jumps, shared by every server of the host.
const GLOBAL: &[(&str, &str, &str, &str)] = &[
    ("iptables", "filter", "SPACE-INPUT", "INPUT"),
    ("iptables", "filter", "SPACE-FORWARD", "FORWARD"),
    ("iptables", "nat", "SPACE-POSTROUTING", "POSTROUTING"),
    ("ip6tables", "filter", "SPACE-INPUT", "INPUT"),
    ("ip6tables", "filter", "SPACE-FORWARD", "FORWARD"),
];

fn ensure_global() -> Result<(), RuntimeError> {
    for (tool, table, chain, parent) in GLOBAL {
        if run(tool, &["-w", "-t", table, "-n", "-L", chain]).is_err() {
            if let Err(e) = run(tool, &["-w", "-t", table, "-N", chain]) {
                // Another server may have made it meanwhile (outside our lock: an old one).
                if run(tool, &["-w", "-t", table, "-n", "-L", chain]).is_err() {
                    return Err(e);
                }
            }
        }
        if run(tool, &["-w", "-t", table, "-C", parent, "-j", chain]).is_err() {
            run(tool, &["-w", "-t", table, "-I", parent, "1", "-j", chain])?;
        }
    }
    let fwd = "/proc/sys/net/ipv4/ip_forward";
    if std::fs::read_to_string(fwd)
        .map(|s| s.trim() != "1")
        .unwrap_or(true)
    {
        std::fs::write(fwd, "1").map_err(|e| RuntimeError::io("enabling ip_forward", e))?;
    }
    Ok(())
}

fn disable_ipv6(ifname: &str) {
    let _ = std::fs::write(
        format!("/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6"),
        "1",
    );
}

/// A free /30 of [`LINK_NET`], starting the search at a place derived from the id.
fn allocate(id: &str) -> Result<(Ipv4Addr, Ipv4Addr), RuntimeError> {
    let used: Vec<Ipv4Addr> = host_addresses()
        .into_iter()
        .filter(|a| overlaps(*a, 32, LINK_NET.0, LINK_NET.1))
        .collect();
    let slots = 1u32 << (32 - u32::from(LINK_NET.1) - 2);
    let d = sha2::Sha256::digest(id.as_bytes());
    let start = u32::from_be_bytes([d[0], d[1], d[2], d[3]]) % slots;
    for i in 0..slots {
        let slot = (start + i) % slots;
        let base = u32::from(LINK_NET.0) + slot * 4;
        if slot == 0
            || used
                .iter()
                .any(|a| overlaps(*a, 32, Ipv4Addr::from(base), 30))
        {
            continue;
        }
        return Ok((Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2)));
    }
    Err(net_err(
        "network",
        format!("no free /30 left in {}/{}", LINK_NET.0, LINK_NET.1),
    ))
}

/// Sets up (or, with a `network.json` in `state_dir`, re-creates with the same
/// addresses) the link and the rules of a sandbox, and records them there.
/// Whatever the sandbox had before is removed first.
pub fn setup(
    id: &str,
    state_dir: &Path,
    kind: LinkKind,
    cfg: &EgressConfig,
) -> Result<NetState, RuntimeError> {
    let _lock = HostLock::take()?;
    let previous = load(state_dir)?;
    teardown_locked(id)?;
    ensure_global()?;
    let n = names(id, kind);
    let (host_ip, guest_ip) = match &previous {
        Some(p) if p.kind == kind => (p.host_ip, p.guest_ip),
        _ => allocate(id)?,
    };
    let state = NetState {
        kind,
        host_if: n.host_if.clone(),
        netns: (kind == LinkKind::Veth).then(|| n.netns.clone()),
        host_ip,
        guest_ip,
        prefix: 30,
        allow: cfg.allow.clone(),
    };
    let made = make_link(&state).and_then(|()| add_rules(id, &state));
    if let Err(e) = made {
        let _ = teardown_locked(id);
        return Err(e);
    }
    let bytes = serde_json::to_vec_pretty(&state).unwrap_or_default();
    let tmp = state_dir.join(format!("{STATE_FILE}.tmp"));
    std::fs::create_dir_all(state_dir)
        .and_then(|()| std::fs::write(&tmp, bytes))
        .and_then(|()| std::fs::rename(&tmp, state_dir.join(STATE_FILE)))
        .map_err(|e| RuntimeError::io("writing network.json", e))?;
    Ok(state)
}

/// Replaces the allowlist of a sandbox that has a link (a warm pool's sandbox, booted
/// with an empty one, when a create claims it): its own chain is declared again in one
/// `iptables-restore` batch, which flushes and refills it atomically, so no packet ever
/// meets a half-written list. The new list is recorded for restores.
pub fn set_allowlist(
    id: &str,
    state_dir: &Path,
    cfg: &EgressConfig,
) -> Result<NetState, RuntimeError> {
    let _lock = HostLock::take()?;
    let mut state = load(state_dir)?
        .ok_or_else(|| net_err("network", "the sandbox has no network link".to_string()))?;
    state.allow = cfg.allow.clone();
    let chain = names(id, state.kind).chain;
    let (filter, _, _) = rules(id, &state);
    let own = format!("-A {chain} ");
    let batch: String = filter
        .lines()
        .filter(|l| {
            l.starts_with('*') || l.starts_with(':') || l.starts_with(&own) || *l == "COMMIT"
        })
        .map(|l| {
            // Flushed explicitly too: not every iptables-restore flushes a declared chain.
            if l.starts_with(':') {
                format!("{l}\n-F {chain}\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    run_input("iptables-restore", &["-w", "--noflush"], Some(&batch))?;
    let bytes = serde_json::to_vec_pretty(&state).unwrap_or_default();
    let tmp = state_dir.join(format!("{STATE_FILE}.tmp"));
    std::fs::write(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, state_dir.join(STATE_FILE)))
        .map_err(|e| RuntimeError::io("writing network.json", e))?;
    Ok(state)
}

/// Re-creates the link and rules recorded in `state_dir`, if any (before a restore).
pub fn ensure(id: &str, state_dir: &Path) -> Result<Option<NetState>, RuntimeError> {
    let Some(prev) = load(state_dir)? else {
        return Ok(None);
    };
    let cfg = EgressConfig {
        allow: prev.allow.clone(),
    };
    setup(id, state_dir, prev.kind, &cfg).map(Some)
}

/// The link recorded in `state_dir`, if the sandbox has one.
pub fn load(state_dir: &Path) -> Result<Option<NetState>, RuntimeError> {
    match std::fs::read(state_dir.join(STATE_FILE)) {
        Ok(b) => serde_json::from_slice(&b)
            .map(Some)
            .map_err(|e| net_err("network", format!("unreadable network.json: {e}"))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(RuntimeError::io("reading network.json", e)),
    }
}

fn make_link(s: &NetState) -> Result<(), RuntimeError> {
    let host_cidr = format!("{}/{}", s.host_ip, s.prefix);
    let guest_cidr = format!("{}/{}", s.guest_ip, s.prefix);
    let host_ip = s.host_ip.to_string();
    match (s.kind, &s.netns) {
        (LinkKind::Veth, Some(ns)) => {
            run("ip", &["netns", "add", ns])?;
            // The sandbox's end is born with IPv6 off.
            run(
                "ip",
                &[
                    "netns",
                    "exec",
                    ns,
                    "sysctl",
                    "-q",
                    "-w",
                    "net.ipv6.conf.all.disable_ipv6=1",
                    "net.ipv6.conf.default.disable_ipv6=1",
                ],
            )?;
            run(
                "ip",
                &[
                    "link", "add", &s.host_if, "type", "veth", "peer", "name", "eth0", "netns", ns,
                ],
            )?;
            run("ip", &["-n", ns, "link", "set", "lo", "up"])?;
            run("ip", &["-n", ns, "addr", "add", &guest_cidr, "dev", "eth0"])?;
            run("ip", &["-n", ns, "link", "set", "eth0", "up"])?;
            run(
                "ip",
                &[
                    "-n", ns, "route", "add", "default", "via", &host_ip, "dev", "eth0",
                ],
            )?;
        }
        _ => {
            run("ip", &["tuntap", "add", "dev", &s.host_if, "mode", "tap"])?;
        }
    }
    // A stable address: a restored guest still has the host's in its ARP cache.
    run(
        "ip",
        &["link", "set", "dev", &s.host_if, "address", &s.host_mac()],
    )?;
    disable_ipv6(&s.host_if);
    let conf = format!("/proc/sys/net/ipv4/conf/{}", s.host_if);
    // Strict reverse-path filtering: a spoofed source is dropped on arrival.
    let _ = std::fs::write(format!("{conf}/rp_filter"), "1");
    let _ = std::fs::write(format!("{conf}/route_localnet"), "0");
    let _ = std::fs::write(format!("{conf}/accept_local"), "0");
    run("ip", &["addr", "add", &host_cidr, "dev", &s.host_if])?;
    run("ip", &["link", "set", &s.host_if, "up"])?;
    Ok(())
}

/// The iptables-restore batches (IPv4 filter, IPv4 nat, IPv6 filter) of a sandbox.
pub fn rules(id: &str, s: &NetState) -> (String, String, String) {
    let n = names(id, s.kind);
    let (ifn, tag, chain) = (&s.host_if, &n.tag, &n.chain);
    let c = format!("-m comment --comment {tag}");
    let mut f = String::from("*filter\n");
    f.push_str(&format!(":{chain} - [0:0]\n"));
    f.push_str(&format!("-A SPACE-INPUT -i {ifn} {c} -j DROP\n"));
    f.push_str(&format!(
        "-A SPACE-FORWARD -o {ifn} -m conntrack --ctstate RELATED,ESTABLISHED {c} -j ACCEPT\n"
    ));
    f.push_str(&format!("-A SPACE-FORWARD -o {ifn} {c} -j DROP\n"));
    f.push_str(&format!("-A SPACE-FORWARD -i {ifn} {c} -j {chain}\n"));
    f.push_str(&format!("-A {chain} ! -s {}/32 {c} -j DROP\n", s.guest_ip));
    for (net, p, _) in BLOCKED {
        f.push_str(&format!("-A {chain} -d {net}/{p} {c} -j DROP\n"));
    }
    for a in &s.allow {
        let d = format!("-d {}/{}", a.addr, a.prefix);
        match a.port {
            Some(port) => {
                for proto in ["tcp", "udp"] {
                    f.push_str(&format!(
                        "-A {chain} {d} -p {proto} -m {proto} --dport {port} {c} -j ACCEPT\n"
                    ));
                }
            }
            None => f.push_str(&format!("-A {chain} {d} {c} -j ACCEPT\n")),
        }
    }
    f.push_str(&format!("-A {chain} {c} -j DROP\nCOMMIT\n"));
    let nat = format!(
        "*nat\n-A SPACE-POSTROUTING -s {}/32 {c} -j MASQUERADE\nCOMMIT\n",
        s.guest_ip
    );
    let v6 = format!(
        "*filter\n-A SPACE-INPUT -i {ifn} {c} -j DROP\n-A SPACE-FORWARD -i {ifn} {c} -j DROP\n-A SPACE-FORWARD -o {ifn} {c} -j DROP\nCOMMIT\n"
    );
    (f, nat, v6)
}

fn add_rules(id: &str, s: &NetState) -> Result<(), RuntimeError> {
    let (f, nat, v6) = rules(id, s);
    run_input("iptables-restore", &["-w", "--noflush"], Some(&f))?;
    run_input("iptables-restore", &["-w", "--noflush"], Some(&nat))?;
    run_input("ip6tables-restore", &["-w", "--noflush"], Some(&v6))?;
    Ok(())
}

/// Removes every network object of the sandbox: its rules (found by their tag), its
/// chain, its links and its namespace. Idempotent; the state file stays.
pub fn teardown(id: &str) -> Result<(), RuntimeError> {
    let _lock = match HostLock::take() {
        Ok(l) => l,
        // Without the lock (no /run to write to) there can be nothing of ours to remove.
        Err(_) if leftovers(id).is_empty() => return Ok(()),
        Err(e) => return Err(e),
    };
    teardown_locked(id)
}

fn teardown_locked(id: &str) -> Result<(), RuntimeError> {
    let mut first_err = None;
    let mut note = |r: Result<(), RuntimeError>| {
        if let Err(e) = r {
            first_err.get_or_insert(e);
        }
    };
    for (save, tool, table) in [
        ("iptables-save", "iptables", "filter"),
        ("iptables-save", "iptables", "nat"),
        ("ip6tables-save", "ip6tables", "filter"),
    ] {
        for args in tagged_rules(save, table, id) {
            let mut a: Vec<&str> = vec!["-w", "-t", table, "-D"];
            a.extend(args.iter().map(String::as_str));
            note(run(tool, &a));
        }
    }
    for kind in [LinkKind::Veth, LinkKind::Tap] {
        let n = names(id, kind);
        if kind == LinkKind::Veth && run("iptables", &["-w", "-n", "-L", &n.chain]).is_ok() {
            note(run("iptables", &["-w", "-F", &n.chain]));
            note(run("iptables", &["-w", "-X", &n.chain]));
        }
        if Path::new("/sys/class/net").join(&n.host_if).exists() {
            note(run("ip", &["link", "del", &n.host_if]));
        }
    }
    let ns = names(id, LinkKind::Veth).netns;
    if Path::new(NETNS_DIR).join(&ns).exists() {
        note(run("ip", &["netns", "del", &ns]));
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The rules of `table` whose comment is exactly the sandbox's tag, as the
/// arguments after `-A`.
fn tagged_rules(save: &str, table: &str, id: &str) -> Vec<Vec<String>> {
    let tag = format!("space:{id}");
    let Ok(out) = run_input(save, &["-t", table], None) else {
        return Vec::new();
    };
    out.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("-A ")?;
            let words: Vec<String> = rest
                .split_whitespace()
                .map(|w| w.trim_matches('"').to_string())
                .collect();
            let tagged = words.windows(2).any(|w| w[0] == "--comment" && w[1] == tag);
            tagged.then_some(words)
        })
        .collect()
}

/// Whether anything of the sandbox is left on the host (rules, links, namespace).
pub fn leftovers(id: &str) -> Vec<String> {
    let mut left = Vec::new();
    for (save, table) in [
        ("iptables-save", "filter"),
        ("iptables-save", "nat"),
        ("ip6tables-save", "filter"),
    ] {
        for r in tagged_rules(save, table, id) {
            left.push(format!("{save} -t {table}: -A {}", r.join(" ")));
        }
    }
    for kind in [LinkKind::Veth, LinkKind::Tap] {
        let n = names(id, kind);
        if Path::new("/sys/class/net").join(&n.host_if).exists() {
            left.push(format!("link {}", n.host_if));
        }
    }
    let ns = names(id, LinkKind::Veth).netns;
    if Path::new(NETNS_DIR).join(&ns).exists() {
        left.push(format!("netns {ns}"));
    }
    left
}

/// Runs runsc so that it accepts a sandbox network namespace on kernels where
/// `net.core.rmem_default` is per namespace (Linux 6.13+): runsc 2024's check for
/// "the root namespace" is whether that sysctl exists. The command gets a mount
/// namespace of its own (slave: the host's later mounts still reach it) whose
/// `/proc/sys/net` is an empty tmpfs; nothing else of its view changes.
pub fn hide_proc_sys_net(cmd: &mut tokio::process::Command) {
    // SAFETY: only async-signal-safe syscalls between fork and exec, on static strings.
    unsafe {
        cmd.pre_exec(|| {
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let root = c"/".as_ptr();
            if libc::mount(
                std::ptr::null(),
                root,
                std::ptr::null(),
                libc::MS_SLAVE | libc::MS_REC,
                std::ptr::null(),
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            if libc::mount(
                c"space-net".as_ptr(),
                c"/proc/sys/net".as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                c"size=4k,mode=0555".as_ptr().cast(),
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(e: &str) -> Result<Vec<Resolved>, String> {
        resolve_allowlist(&[e.to_string()])
    }

    #[test]
    fn public_addresses_and_networks_are_accepted() {
        let r = one("203.0.113.7").unwrap();
        assert_eq!(
            (r[0].addr, r[0].prefix, r[0].port),
            (Ipv4Addr::new(203, 0, 113, 7), 32, None)
        );
        let r = one("198.51.100.0/24:443").unwrap();
        assert_eq!(
            (r[0].cidr(), r[0].port),
            ("198.51.100.0/24".into(), Some(443))
        );
    }

    #[test]
    fn never_reachable_ranges_are_refused() {
        for e in [
            "10.1.2.3",
            "127.0.0.1",
            "169.254.169.254",
            "172.20.0.0/16",
            "192.168.1.1:80",
            "100.64.0.1",
            "0.0.0.0/0",
            "224.0.0.1",
            "255.255.255.255",
            "192.0.0.8",
            "240.0.0.0/4",
            "localhost",
            "168.63.129.16",
            "168.63.129.16:80",
            "168.63.129.0/24",
            "100.100.100.200",
            "fd00:ec2::254",
            "[fd00:ec2::254]:80",
            "fd20:ce::254",
            "::ffff:169.254.169.254",
            "fe80::1",
        ] {
            let err = one(e).unwrap_err();
            assert!(
                err.contains("never reachable") || err.contains("of the host"),
                "{e}: {err}"
            );
        }
        // A name's addresses are never echoed.
        let err = one("localhost").unwrap_err();
        assert!(!err.contains("127.0.0.1"), "{err}");
    }

    #[test]
    fn malformed_entries_are_refused_with_a_reason() {
        for (e, why) in [
            ("::1", "IPv6"),
            ("2001:db8::1", "IPv6"),
            ("[2001:db8::1]:80", "IPv6"),
            ("2001:db8::/32", "IPv6"),
            ("203.0.113.7/33", "prefix"),
            ("203.0.113.7/24", "host bits"),
            ("203.0.113.7:0", "port"),
            ("203.0.113.7:99999", "port"),
            ("a b", "hostname"),
            ("-x.example", "hostname"),
            ("1.2.3", "hostname"),
            ("", "hostname"),
            ("no-such-host.invalid", "does not resolve"),
        ] {
            let err = one(e).unwrap_err();
            assert!(err.contains(why), "{e}: {err}");
        }
        assert!(resolve_allowlist(&[]).unwrap_err().contains("empty"));
        let many: Vec<String> = (0..65).map(|i| format!("203.0.113.{i}")).collect();
        assert!(resolve_allowlist(&many).unwrap_err().contains("at most 64"));
    }

    #[test]
    fn overlap_is_symmetric_and_exact() {
        let a = Ipv4Addr::new(10, 0, 0, 0);
        assert!(overlaps(a, 8, Ipv4Addr::new(10, 9, 9, 9), 32));
        assert!(overlaps(Ipv4Addr::new(10, 9, 9, 9), 32, a, 8));
        assert!(!overlaps(Ipv4Addr::new(11, 0, 0, 0), 8, a, 8));
        assert!(overlaps(Ipv4Addr::new(0, 0, 0, 0), 0, a, 8));
    }

    #[test]
    fn hosts_files_parse_and_names_are_short_enough() {
        let m = parse_hosts("# c\n203.0.113.9 api.example  Other.example.\n::1 v6\n");
        assert_eq!(m["api.example"], vec![Ipv4Addr::new(203, 0, 113, 9)]);
        assert_eq!(m["other.example"], vec![Ipv4Addr::new(203, 0, 113, 9)]);
        assert!(!m.contains_key("v6"));
        let n = names("sb_0123456789abcdefghij", LinkKind::Veth);
        assert!(n.host_if.len() <= 15 && n.chain.len() <= 28, "{n:?}");
        assert_ne!(
            n.host_if,
            names("sb_0123456789abcdefghij", LinkKind::Tap).host_if
        );
    }

    #[test]
    fn rules_drop_blocked_ranges_before_the_allowlist() {
        let s = NetState {
            kind: LinkKind::Veth,
            host_if: "spvx".into(),
            netns: Some("space-x".into()),
            host_ip: Ipv4Addr::new(10, 213, 0, 5),
            guest_ip: Ipv4Addr::new(10, 213, 0, 6),
            prefix: 30,
            allow: vec![EgressAllow {
                addr: Ipv4Addr::new(203, 0, 113, 0),
                prefix: 24,
                port: Some(80),
            }],
        };
        let (f, nat, v6) = rules("sb_x", &s);
        let blocked = f.find("-d 169.254.0.0/16").unwrap();
        let allowed = f.find("-d 203.0.113.0/24 -p tcp").unwrap();
        assert!(blocked < allowed, "{f}");
        assert!(f.trim_end().ends_with("-j DROP\nCOMMIT"), "{f}");
        assert!(nat.contains("-s 10.213.0.6/32"), "{nat}");
        assert!(v6.contains("-i spvx"), "{v6}");
        assert!(f
            .lines()
            .filter(|l| l.starts_with("-A"))
            .all(|l| l.contains("space:sb_x")));
    }
}
