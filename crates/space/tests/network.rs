//! Network isolation with an egress allowlist, on both runtimes.
//!
//! The test builds a small "internet" on the host: a network namespace attached by a
//! veth (`10.77.0.1/30` host side, `10.77.0.2` far side), holding the documentation
//! addresses 203.0.113.10, 203.0.113.20, 198.51.100.10 and 169.254.169.254 (routed from
//! the host, so the metadata address is reachable from the host and blocked only by
//! the sandbox's rules), with an HTTP server on ports 80 and 8081 answering which
//! address was asked. The host also listens on 0.0.0.0 and 127.0.0.1. From inside
//! sandboxes (busybox `wget`/`nc`) only the allowlist may answer. A hosts file given
//! to the server (`SPACE_EGRESS_HOSTS_FILE`) names 203.0.113.10 `api.space-test.example`.
//!
//! A runtime the server reports as unavailable is skipped with a printed reason, or
//! fails the test when named in `SPACE_TEST_REQUIRE_RUNTIMES` (as in conformance.rs).
//! The fixture is host-wide (fixed names, a host route to each of its addresses), so the
//! tests of every process take an `flock` on it in turn.

mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::TestServer;
use serde_json::{json, Value};
use space_runtime::net;

const INET_NS: &str = "space-test-inet";
const INET_IF: &str = "sptinet0";
const ALLOWED_IP: &str = "203.0.113.10";
const ALLOWED_NAME: &str = "api.space-test.example";
const OTHER_IP: &str = "203.0.113.20";
const PORT_NET_IP: &str = "198.51.100.10";
const METADATA_IP: &str = "169.254.169.254";
const PRIVATE_IP: &str = "10.77.0.2";
const LOCK: &str = "/run/space-net-test.lock";

fn sh(cmd: &str) -> (bool, String) {
    let out = Command::new("sh").arg("-c").arg(cmd).output().expect("sh");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn must(cmd: &str) {
    let (ok, out) = sh(cmd);
    assert!(ok, "{cmd}: {out}");
}

/// The fake internet; removed on drop (also when the test fails).
struct Inet {
    _lock: std::fs::File,
    stop: Arc<AtomicBool>,
    host_port: u16,
    loopback_port: u16,
    hosts_file: tempfile::NamedTempFile,
    _listeners: Vec<TcpListener>,
}

/// The fixture's addresses, each routed from the host alone (a /32): a route for a whole
/// documentation range would also catch any real service the host reaches in it (on some
/// machines the package registries' proxy is in 203.0.113.0/24), and cut it off while the
/// fixture exists, or for good if a killed test leaves the route behind.
const FAR_IPS: [&str; 4] = [ALLOWED_IP, OTHER_IP, PORT_NET_IP, METADATA_IP];

fn remove_inet() {
    for ip in FAR_IPS {
        let _ = sh(&format!(
            "ip route del {ip}/32 via {PRIVATE_IP} 2>/dev/null"
        ));
    }
    let _ = sh(&format!("ip link del {INET_IF} 2>/dev/null"));
    let _ = sh(&format!("ip netns del {INET_NS} 2>/dev/null"));
}

/// Answers every connection with `hello from <the address it was made to>`.
fn serve(listener: TcpListener, stop: Arc<AtomicBool>) {
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            if stop.load(Ordering::SeqCst) {
                return;
            }
            let Ok(mut c) = conn else { continue };
            let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
            let mut buf = [0u8; 1024];
            let _ = c.read(&mut buf);
            let local = c.local_addr().map(|a| a.to_string()).unwrap_or_default();
            let body = format!("hello from {local}\n");
            let _ = write!(
                c,
                "HTTP/1.0 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
}

impl Inet {
    fn start() -> Inet {
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(LOCK)
            .expect("lock file");
        // SAFETY: flock on a descriptor we own; released when it closes.
        assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
        remove_inet();
        must(&format!("ip netns add {INET_NS}"));
        must(&format!(
            "ip link add {INET_IF} type veth peer name eth0 netns {INET_NS}"
        ));
        must(&format!(
            "ip addr add 10.77.0.1/30 dev {INET_IF} && ip link set {INET_IF} up"
        ));
        let n = format!("ip -n {INET_NS}");
        must(&format!(
            "{n} link set lo up && {n} addr add {PRIVATE_IP}/30 dev eth0 && {n} link set eth0 up \
             && {n} route add default via 10.77.0.1"
        ));
        for ip in FAR_IPS {
            must(&format!("{n} addr add {ip}/32 dev lo"));
            must(&format!(
                "ip route add {ip}/32 via {PRIVATE_IP} dev {INET_IF}"
            ));
        }
        let stop = Arc::new(AtomicBool::new(false));
        // The far side's servers: a thread that joined the namespace makes the sockets.
        let far: Vec<TcpListener> = std::thread::spawn(|| {
            let ns = std::fs::File::open(format!("/run/netns/{INET_NS}")).expect("netns");
            // SAFETY: this thread only; it ends right after.
            assert_eq!(
                unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) },
                0
            );
            [80u16, 8081]
                .iter()
                .map(|p| TcpListener::bind(("0.0.0.0", *p)).expect("bind in the fake internet"))
                .collect()
        })
        .join()
        .expect("listeners");
        let host = TcpListener::bind("0.0.0.0:0").expect("bind 0.0.0.0");
        let loopback = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1");
        let host_port = host.local_addr().unwrap().port();
        let loopback_port = loopback.local_addr().unwrap().port();
        let mut keep = Vec::new();
        for l in far.into_iter().chain([host, loopback]) {
            keep.push(l.try_clone().expect("clone listener"));
            serve(l, stop.clone());
        }
        let mut hosts_file = tempfile::NamedTempFile::new().expect("hosts file");
        writeln!(hosts_file, "{ALLOWED_IP} {ALLOWED_NAME}").unwrap();
        Inet {
            _lock: lock,
            stop,
            host_port,
            loopback_port,
            hosts_file,
            _listeners: keep,
        }
    }
}

impl Drop for Inet {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accepting threads so they see the flag.
        for l in &self._listeners {
            if let Ok(a) = l.local_addr() {
                let target = if a.ip().is_unspecified() {
                    if a.port() == 80 || a.port() == 8081 {
                        format!("{ALLOWED_IP}:{}", a.port())
                    } else {
                        format!("127.0.0.1:{}", a.port())
                    }
                } else {
                    a.to_string()
                };
                if let Ok(addr) = target.parse() {
                    let _ = TcpStream::connect_timeout(&addr, Duration::from_secs(1));
                }
            }
        }
        remove_inet();
    }
}

/// The server, or `None` (with the reason printed) when `runtime` is not available here.
async fn server(runtime: &str, inet: &Inet) -> Option<TestServer> {
    let hosts = inet.hosts_file.path().to_string_lossy().into_owned();
    let s = TestServer::start_with_env(&[], &[(net::HOSTS_FILE_ENV, &hosts)]).await;
    s.runtime_available(runtime).await.then_some(s)
}

/// Removes the network objects of sandboxes a failed test leaves behind.
struct NetGuard(Vec<String>);

impl Drop for NetGuard {
    fn drop(&mut self) {
        for id in &self.0 {
            let _ = net::teardown(id);
        }
    }
}

/// Every probe of `probes` (name, URL), fetched at once inside the sandbox with busybox
/// `wget` under `timeout` (its own `-T` crashes under gVisor); name → the answer's first
/// line, or `FAIL`.
async fn probe(s: &TestServer, sb: &str, probes: &[(&str, String)]) -> Vec<(String, String)> {
    let mut script = String::from(
        "p() { if timeout 4 wget -q -O /tmp/probe.$1 \"$2\" 2>/dev/null; then echo \"$1 $(head -n1 /tmp/probe.$1)\"; else echo \"$1 FAIL\"; fi; }\n",
    );
    for (name, url) in probes {
        script.push_str(&format!("p {name} {url} &\n"));
    }
    script.push_str("wait\n");
    let out = s.sh(sb, &script).await;
    let text = out["stdout"].as_str().unwrap_or_default().to_string();
    let mut got: Vec<(String, String)> = text
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    got.sort();
    assert_eq!(got.len(), probes.len(), "{out}");
    got
}

fn answer<'a>(got: &'a [(String, String)], name: &str) -> &'a str {
    got.iter()
        .find(|(n, _)| n == name)
        .map(|(_, a)| a.as_str())
        .unwrap_or("missing")
}

fn assert_allowed_only(got: &[(String, String)], allowed: &[(&str, &str)]) {
    for (name, answer_is) in got {
        match allowed.iter().find(|(n, _)| n == name) {
            Some((_, want)) => assert_eq!(answer_is, want, "{name} should answer: {got:?}"),
            None => assert_eq!(answer_is, "FAIL", "{name} should be unreachable: {got:?}"),
        }
    }
}

/// The sandbox's IPv4 address and gateway, as it sees them.
async fn link_of(s: &TestServer, sb: &str) -> (String, String) {
    let out = s
        .sh(
            sb,
            "ip -4 -o addr show dev eth0 | awk '{print $4}' | cut -d/ -f1; ip route | awk '/^default/ {print $3}'",
        )
        .await;
    let text = out["stdout"].as_str().unwrap_or_default();
    let mut lines = text.lines();
    let ip = lines.next().unwrap_or_default().to_string();
    let gw = lines.next().unwrap_or_default().to_string();
    assert!(
        ip.parse::<Ipv4Addr>().is_ok() && gw.parse::<Ipv4Addr>().is_ok(),
        "{out}"
    );
    (ip, gw)
}

async fn create(s: &TestServer, rt: &str, network: Value) -> String {
    s.create_with(json!({"template": "busybox", "runtime": rt, "network": network}))
        .await
}

async fn op_ok(s: &TestServer, resp: (u16, Value)) {
    let (st, op) = resp;
    assert_eq!(st, 202, "{op}");
    let done = s.wait_op(op["id"].as_str().unwrap()).await;
    assert_eq!(done["status"], "succeeded", "{done}\n{}", s.log());
}

fn assert_no_network_left(sb: &str) {
    let left = net::leftovers(sb);
    assert!(left.is_empty(), "network objects of {sb} remain: {left:?}");
    let (_, netns) = sh("ip netns list");
    assert!(!netns.contains(sb), "netns of {sb} remains: {netns}");
    let (_, rules) = sh("iptables-save; ip6tables-save");
    assert!(
        !rules.contains(&format!("space:{sb}")),
        "rules of {sb} remain"
    );
    for kind in [net::LinkKind::Veth, net::LinkKind::Tap] {
        let n = net::names(sb, kind);
        let (_, links) = sh("ip -o link");
        assert!(!links.contains(&n.host_if), "link {} remains", n.host_if);
        assert!(!rules.contains(&n.chain), "chain {} remains", n.chain);
    }
}

async fn egress_allowlist_is_enforced_outside_the_sandbox(rt: &str) {
    let inet = Inet::start();
    let Some(mut s) = server(rt, &inet).await else {
        return;
    };
    // The routes exist: from the host every server answers, metadata and private included.
    for addr in [
        format!("{ALLOWED_IP}:80"),
        format!("{OTHER_IP}:80"),
        format!("{METADATA_IP}:80"),
        format!("{PRIVATE_IP}:80"),
    ] {
        TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(2))
            .unwrap_or_else(|e| panic!("the host cannot reach {addr}: {e}"));
    }
    let mut guard = NetGuard(Vec::new());
    let allow = json!({"mode": "egress", "allow": [ALLOWED_NAME, "198.51.100.0/24:8081"]});
    let a = create(&s, rt, allow.clone()).await;
    guard.0.push(a.clone());
    let b = create(&s, rt, json!({"mode": "egress", "allow": [OTHER_IP]})).await;
    guard.0.push(b.clone());
    let none = create(&s, rt, json!({"mode": "none"})).await;

    // The stored spec says what the allowlist resolved to.
    let (_, v) = s.get(&format!("/v1/sandboxes/{a}")).await;
    assert_eq!(v["network"]["mode"], "egress", "{v}");
    let resolved = v["network"]["resolved"]
        .as_array()
        .expect("resolved")
        .clone();
    assert_eq!(resolved.len(), 2, "{v}");
    assert_eq!(resolved[0]["cidr"], format!("{ALLOWED_IP}/32"), "{v}");
    assert_eq!(resolved[0]["host"], ALLOWED_NAME, "{v}");
    assert_eq!(resolved[1]["cidr"], "198.51.100.0/24", "{v}");
    assert_eq!(resolved[1]["port"], 8081, "{v}");

    // Mode none: loopback only.
    let out = s
        .sh(&none, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")
        .await;
    assert_eq!(out["stdout"], "lo\n", "{out}");

    let (a_ip, gw) = link_of(&s, &a).await;
    let (b_ip, _) = link_of(&s, &b).await;
    assert_ne!(a_ip, b_ip);
    // A neighbour listening on its own address.
    // A neighbour answering one HTTP request on its own address.
    s.sh(
        &b,
        "(printf 'HTTP/1.0 200 OK\\r\\nContent-Length: 10\\r\\n\\r\\nneighbour\\n' | nc -l -p 8080 >/dev/null 2>&1 &) ; true",
    )
    .await;
    let host_ip = net::host_addresses()
        .into_iter()
        .find(|ip| !ip.is_loopback() && !ip.is_private() && !ip.is_link_local())
        .map(|ip| ip.to_string());
    let api_port = s
        .url
        .rsplit(':')
        .next()
        .unwrap()
        .trim_end_matches('/')
        .to_string();
    let (hp, lp) = (inet.host_port, inet.loopback_port);
    let mut probes = vec![
        ("byname", format!("http://{ALLOWED_NAME}/")),
        ("allowed", format!("http://{ALLOWED_IP}/")),
        ("port_allowed", format!("http://{PORT_NET_IP}:8081/")),
        ("port_other", format!("http://{PORT_NET_IP}/")),
        ("other", format!("http://{OTHER_IP}/")),
        ("metadata", format!("http://{METADATA_IP}/")),
        ("private", format!("http://{PRIVATE_IP}/")),
        ("gateway", format!("http://{gw}:{hp}/")),
        ("gateway_loopback", format!("http://{gw}:{lp}/")),
        ("gateway_api", format!("http://{gw}:{api_port}/healthz")),
        ("host_link", format!("http://10.77.0.1:{hp}/")),
        ("neighbour", format!("http://{b_ip}:8080/")),
        ("neighbour_gw", format!("http://{gw}:8080/")),
    ];
    if let Some(h) = &host_ip {
        probes.push(("host_addr", format!("http://{h}:{hp}/")));
    }
    let allowed = [
        ("byname", "hello from 203.0.113.10:80"),
        ("allowed", "hello from 203.0.113.10:80"),
        ("port_allowed", "hello from 198.51.100.10:8081"),
    ];
    let got = probe(&s, &a, &probes).await;
    assert_allowed_only(&got, &allowed);
    // The hostname came from /etc/hosts, not DNS.
    let out = s.sh(&a, "grep space-test /etc/hosts").await;
    assert_eq!(
        out["stdout"],
        format!("{ALLOWED_IP}\t{ALLOWED_NAME}\n"),
        "{out}"
    );
    // The neighbour was listening all along (its one answer was still there to take).
    let out = s
        .sh(&b, &format!("timeout 4 wget -q -O- http://{b_ip}:8080/"))
        .await;
    assert_eq!(out["stdout"], "neighbour\n", "{out}");
    // B's own allowlist works for B and is nothing to A.
    let got_b = probe(
        &s,
        &b,
        &[
            ("other", format!("http://{OTHER_IP}/")),
            ("allowed", format!("http://{ALLOWED_IP}/")),
        ],
    )
    .await;
    assert_eq!(answer(&got_b, "other"), "hello from 203.0.113.20:80");
    assert_eq!(answer(&got_b, "allowed"), "FAIL");

    let short: Vec<(&str, String)> = probes
        .iter()
        .filter(|(n, _)| ["allowed", "other", "metadata", "gateway"].contains(n))
        .cloned()
        .collect();
    // Suspend and resume keep the link and the rules.
    op_ok(
        &s,
        s.post(&format!("/v1/sandboxes/{a}/suspend"), json!({}))
            .await,
    )
    .await;
    op_ok(
        &s,
        s.post(&format!("/v1/sandboxes/{a}/resume"), json!({}))
            .await,
    )
    .await;
    assert_eq!(link_of(&s, &a).await.0, a_ip);
    let got = probe(&s, &a, &short).await;
    assert_allowed_only(&got, &allowed);
    // Pause too.
    op_ok(
        &s,
        s.post(&format!("/v1/sandboxes/{a}/pause"), json!({})).await,
    )
    .await;
    op_ok(
        &s,
        s.post(&format!("/v1/sandboxes/{a}/resume"), json!({}))
            .await,
    )
    .await;
    let got = probe(&s, &a, &short).await;
    assert_allowed_only(&got, &allowed);

    // A killed server comes back to the same rules; B vanishes while it is down (its
    // runsc container deleted, its QEMU killed), and its network goes with it at restart.
    s.kill9();
    if rt == "microvm" {
        for (pid, args) in common::processes_mentioning(&b) {
            if args.contains("qemu-system") {
                // SAFETY: plain syscall on a pid we just found.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    } else {
        let st = Command::new("runsc")
            .arg("--root")
            .arg(s.runsc_root())
            .args(["delete", "--force", &b])
            .status()
            .unwrap();
        assert!(st.success());
    }
    assert!(!net::leftovers(&b).is_empty());
    s.restart();
    s.wait_state(&a, "running", Duration::from_secs(60)).await;
    s.wait_state(&b, "failed", Duration::from_secs(60)).await;
    assert_no_network_left(&b);
    let got = probe(&s, &a, &short).await;
    assert_allowed_only(&got, &allowed);

    for sb in [&a, &b, &none] {
        s.destroy(sb).await;
        assert_no_network_left(sb);
    }
}

async fn invalid_network_specs_are_refused_and_nothing_is_created(rt: &str) {
    let inet = Inet::start();
    let Some(s) = server(rt, &inet).await else {
        return;
    };
    let own = net::host_addresses()
        .into_iter()
        .find(|ip| !ip.is_loopback())
        .map(|ip| ip.to_string())
        .unwrap_or_else(|| "127.0.0.1".into());
    let many: Vec<String> = (0..65).map(|i| format!("203.0.113.{i}")).collect();
    let cases = [
        (json!({"mode": "egress"}), "needs network.allow"),
        (json!({"mode": "egress", "allow": []}), "empty"),
        (json!({"mode": "egress", "allow": many}), "at most 64"),
        (
            json!({"mode": "egress", "allow": ["10.1.2.3"]}),
            "never reachable",
        ),
        (
            json!({"mode": "egress", "allow": [METADATA_IP]}),
            "never reachable",
        ),
        (
            json!({"mode": "egress", "allow": ["0.0.0.0/0"]}),
            "never reachable",
        ),
        (
            json!({"mode": "egress", "allow": ["localhost"]}),
            "never reachable",
        ),
        (
            json!({"mode": "egress", "allow": [own]}),
            "never reachable|host",
        ),
        (json!({"mode": "egress", "allow": ["2001:db8::1"]}), "IPv6"),
        (
            json!({"mode": "egress", "allow": ["no-such-host.invalid"]}),
            "does not resolve",
        ),
        (
            json!({"mode": "egress", "allow": ["203.0.113.0/33"]}),
            "prefix",
        ),
        (
            json!({"mode": "egress", "allow": ["203.0.113.1:http"]}),
            "port",
        ),
        (
            json!({"mode": "egress", "allow": ["203.0.113.10"], "ports": [1]}),
            "unknown field",
        ),
        (
            json!({"mode": "egress", "allow": ["203.0.113.10"], "resolved": []}),
            "set by the server",
        ),
        (
            json!({"mode": "none", "allow": ["203.0.113.10"]}),
            "needs network.mode",
        ),
        (json!({"mode": "bridge"}), "not supported"),
    ];
    for (network, why) in cases {
        let (st, v) = s
            .post(
                "/v1/sandboxes",
                json!({"template": "busybox", "runtime": rt, "network": network}),
            )
            .await;
        assert_eq!(st, 400, "{network}: {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(
            why.split('|').any(|w| msg.contains(w)),
            "{network}: {msg:?} should say {why:?}"
        );
    }
    let (_, list) = s.get("/v1/sandboxes").await;
    let n = list["sandboxes"]
        .as_array()
        .or(list.as_array())
        .map(|a| a.len())
        .unwrap_or(0);
    assert_eq!(n, 0, "{list}");
    let (_, ns) = sh("ip netns list");
    assert!(!ns.contains("space-sb_"), "{ns}");
}

/// A warm pool of egress sandboxes boots them reaching nothing; a create that claims one
/// gets its own allowlist (and hosts lines) at the claim, and the next claim its own.
async fn a_claimed_pool_sandbox_gets_the_creates_allowlist(rt: &str) {
    let inet = Inet::start();
    let hosts = inet.hosts_file.path().to_string_lossy().into_owned();
    let s = TestServer::start_with_env(
        &["--pool-max-sandboxes", "1"],
        &[(net::HOSTS_FILE_ENV, &hosts)],
    )
    .await;
    if !s.runtime_available(rt).await {
        return;
    }
    let (st, pool) = s
        .call(
            reqwest::Method::PUT,
            "/v1/pools",
            Some(json!({"template": "busybox", "runtime": rt, "size": 1, "network": "egress"})),
        )
        .await;
    assert_eq!(st, 200, "{pool}");
    let pool_id = pool["id"].as_str().unwrap().to_string();
    let wait_ready = || async {
        let since = std::time::Instant::now();
        loop {
            let (_, v) = s.get("/v1/pools").await;
            if v["pools"][0]["ready"] == 1 {
                return;
            }
            assert!(
                since.elapsed() < Duration::from_secs(300),
                "{v}\n{}",
                s.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    let mut guard = NetGuard(Vec::new());
    let probes = [
        ("byname", format!("http://{ALLOWED_NAME}/")),
        ("allowed", format!("http://{ALLOWED_IP}/")),
        ("other", format!("http://{OTHER_IP}/")),
        ("metadata", format!("http://{METADATA_IP}/")),
    ];
    for (allow, answers) in [
        (
            json!([ALLOWED_NAME]),
            vec![
                ("byname", "hello from 203.0.113.10:80"),
                ("allowed", "hello from 203.0.113.10:80"),
            ],
        ),
        (
            json!([OTHER_IP]),
            vec![("other", "hello from 203.0.113.20:80")],
        ),
    ] {
        wait_ready().await;
        let body = json!({"template": "busybox", "runtime": rt,
                          "network": {"mode": "egress", "allow": allow}});
        let (st, op) = s.post("/v1/sandboxes", body).await;
        assert_eq!(st, 202, "{op}");
        assert_eq!(op["status"], "succeeded", "not claimed from the pool: {op}");
        let sb = op["sandbox_id"].as_str().unwrap().to_string();
        guard.0.push(sb.clone());
        let got = probe(&s, &sb, &probes).await;
        assert_allowed_only(&got, &answers);
        let (_, v) = s.get(&format!("/v1/sandboxes/{sb}")).await;
        assert_eq!(v["network"]["allow"], allow, "{v}");
        s.destroy(&sb).await;
        assert_no_network_left(&sb);
    }
    let (st, _) = s.delete(&format!("/v1/pools/{pool_id}")).await;
    assert_eq!(st, 204);
    // The last refill goes too, with its network.
    let refills: Vec<String> = std::fs::read_dir(s.data_dir().join("sandboxes"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|id| !guard.0.contains(id))
        .collect();
    assert_eq!(refills.len(), 1, "{refills:?}");
    guard.0.push(refills[0].clone());
    let since = std::time::Instant::now();
    while s.data_dir().join("sandboxes").join(&refills[0]).exists() {
        assert!(since.elapsed() < Duration::from_secs(120), "{refills:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_no_network_left(&refills[0]);
}

/// A create whose agent connection breaks while the allowlist's names are written into
/// its `/etc/hosts` (`SPACE_FAILPOINT=agent:drop:download`: the agent drops its connection
/// at its first file read, the create's read of `/etc/hosts`, and dials again) still
/// succeeds: the write is made again on the next connection, and the names are there once.
async fn a_create_whose_agent_redials_while_its_hosts_are_written_succeeds(rt: &str) {
    let inet = Inet::start();
    let hosts = inet.hosts_file.path().to_string_lossy().into_owned();
    let s = TestServer::start_with_env(
        &[],
        &[
            (net::HOSTS_FILE_ENV, &hosts),
            ("SPACE_FAILPOINT", "agent:drop:download"),
        ],
    )
    .await;
    if !s.runtime_available(rt).await {
        return;
    }
    let mut guard = NetGuard(Vec::new());
    let sb = create(&s, rt, json!({"mode": "egress", "allow": [ALLOWED_NAME]})).await;
    guard.0.push(sb.clone());
    let log = s.log();
    assert_eq!(
        log.lines()
            .filter(|l| l.contains("making it again on the next one")
                && l.contains("call=hosts went_out=true "))
            .count(),
        1,
        "the agent did not drop its connection at the read of /etc/hosts (an agent built \
         without its test hooks does not: FEATURES=test-hooks scripts/build.sh)\n{log}"
    );
    let out = s.sh(&sb, "grep space-test /etc/hosts").await;
    assert_eq!(
        out["stdout"],
        format!("{ALLOWED_IP}\t{ALLOWED_NAME}\n"),
        "{out}"
    );
    let got = probe(&s, &sb, &[("byname", format!("http://{ALLOWED_NAME}/"))]).await;
    assert_allowed_only(&got, &[("byname", "hello from 203.0.113.10:80")]);
    s.destroy(&sb).await;
    assert_no_network_left(&sb);
}

macro_rules! on_both_runtimes {
    ($($case:ident),+ $(,)?) => {
        mod gvisor {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() { super::$case("gvisor").await })+
        }
        mod microvm {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() { super::$case("microvm").await })+
        }
    };
}

on_both_runtimes!(
    egress_allowlist_is_enforced_outside_the_sandbox,
    a_claimed_pool_sandbox_gets_the_creates_allowlist,
    invalid_network_specs_are_refused_and_nothing_is_created,
    a_create_whose_agent_redials_while_its_hosts_are_written_succeeds,
);
