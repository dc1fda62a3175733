//! The CLI: subcommands that talk HTTP to a running server (`SPACE_URL`, `SPACE_TOKEN`).

use std::io::Write;
use std::time::Duration;

use anyhow::{bail, Context};
use base64::Engine;
use clap::{Args, Subcommand};
use futures::StreamExt;
use serde::de::DeserializeOwned;
use serde_json::Value;
use space_api::{
    Command, CreateCommandRequest, CreateSandboxRequest, ErrorBody, Operation, OperationStatus,
    Resources, Sandbox, SandboxList, TemplateList,
};

#[derive(Subcommand)]
pub enum SandboxCmd {
    /// Create a sandbox and wait until it is running; prints its id.
    Create {
        #[arg(long, short, default_value = "debian")]
        template: String,
        /// KEY=VALUE, repeatable.
        #[arg(long = "label", short)]
        labels: Vec<String>,
        /// KEY=VALUE, repeatable.
        #[arg(long = "env", short)]
        env: Vec<String>,
        #[arg(long)]
        vcpus: Option<u32>,
        #[arg(long)]
        memory_mib: Option<u64>,
        #[arg(long)]
        pids: Option<u64>,
        /// Disk quota of the writable layer, MiB.
        #[arg(long)]
        disk_mib: Option<u64>,
        /// `gvisor` or `microvm` (default: the server's).
        #[arg(long)]
        runtime: Option<String>,
        /// Print the operation and return at once.
        #[arg(long)]
        no_wait: bool,
    },
    /// List sandboxes.
    Ls {
        /// KEY=VALUE filter, repeatable.
        #[arg(long = "label", short)]
        labels: Vec<String>,
    },
    /// Show one sandbox as JSON.
    Get { id: String },
    /// Pause a sandbox (stays in memory; fast resume).
    Pause {
        id: String,
        #[arg(long)]
        no_wait: bool,
    },
    /// Resume a paused or suspended sandbox.
    Resume {
        id: String,
        #[arg(long)]
        no_wait: bool,
    },
    /// Suspend a sandbox to a snapshot on disk (frees its memory).
    Suspend {
        id: String,
        #[arg(long)]
        no_wait: bool,
    },
    /// Count as activity now (idle timer) and restart the TTL.
    Keepalive {
        id: String,
        /// New TTL from now, in seconds.
        #[arg(long)]
        ttl: Option<u64>,
    },
    /// Destroy a sandbox and wait until it is gone.
    Rm {
        id: String,
        #[arg(long)]
        no_wait: bool,
    },
}

#[derive(Subcommand)]
pub enum OpsCmd {
    /// Show an operation as JSON.
    Get { id: String },
    /// Wait until an operation ends; exits 1 unless it succeeded.
    Wait {
        id: String,
        /// Seconds to wait at most.
        #[arg(long, default_value_t = 600)]
        timeout: u64,
    },
}

#[derive(Args)]
pub struct ExecArgs {
    pub sandbox: String,
    /// KEY=VALUE, repeatable.
    #[arg(long = "env", short)]
    pub env: Vec<String>,
    #[arg(long)]
    pub cwd: Option<String>,
    #[arg(long, short)]
    pub user: Option<String>,
    /// Kill the command after this many seconds.
    #[arg(long)]
    pub timeout: Option<u64>,
    /// Send this terminal's input to the command (until end of input).
    #[arg(long, short)]
    pub interactive: bool,
    /// Run the command on a pseudo-terminal, this terminal in raw mode (like ssh -t).
    #[arg(long, short)]
    pub tty: bool,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required = true)]
    pub argv: Vec<String>,
}

pub enum ClientCmd {
    Template(TemplateCmd),
    Sandbox(SandboxCmd),
    Ops(OpsCmd),
    Exec(ExecArgs),
    Templates,
    /// Follow server-sent events; `after` replays from an event id.
    Events {
        after: Option<i64>,
    },
}

pub(crate) struct Client {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl Client {
    pub(crate) fn from_env() -> anyhow::Result<Client> {
        let base = std::env::var("SPACE_URL").unwrap_or_else(|_| "http://127.0.0.1:7070".into());
        let token = std::env::var("SPACE_TOKEN").unwrap_or_else(|_| "space-dev-token".into());
        Ok(Client {
            http: reqwest::Client::builder().build()?,
            base: base.trim_end_matches('/').to_string(),
            token,
        })
    }

    pub(crate) fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{}", self.base, path))
            .bearer_auth(&self.token)
    }

    pub(crate) async fn send<T: DeserializeOwned>(
        &self,
        rb: reqwest::RequestBuilder,
    ) -> anyhow::Result<T> {
        let resp = rb
            .send()
            .await
            .with_context(|| format!("cannot reach the space server at {}", self.base))?;
        let status = resp.status();
        let bytes = resp.bytes().await?;
        if !status.is_success() {
            match serde_json::from_slice::<ErrorBody>(&bytes) {
                Ok(e) => bail!("{} ({}): {}", status, e.error.code, e.error.message),
                Err(_) => bail!("{}: {}", status, String::from_utf8_lossy(&bytes)),
            }
        }
        Ok(serde_json::from_slice(&bytes)?)
    }

    async fn wait_op(&self, id: &str, timeout: Duration) -> anyhow::Result<Operation> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let op: Operation = self
                .send(self.req(
                    reqwest::Method::GET,
                    &format!("/v1/operations/{id}?wait=30s"),
                ))
                .await?;
            if op.status.is_terminal() || tokio::time::Instant::now() >= deadline {
                return Ok(op);
            }
        }
    }
}

fn key_values(
    items: &[String],
    what: &str,
) -> anyhow::Result<std::collections::BTreeMap<String, String>> {
    items
        .iter()
        .map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .with_context(|| format!("{what} {kv:?} is not KEY=VALUE"))
        })
        .collect()
}

fn print_json(v: &impl serde::Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

fn op_outcome(op: &Operation) -> anyhow::Result<()> {
    match op.status {
        OperationStatus::Succeeded => Ok(()),
        _ => {
            let msg = op
                .error
                .as_ref()
                .map(|e| format!("{}: {}", e.code, e.message))
                .unwrap_or_else(|| "no error given".into());
            bail!("operation {} {}: {}", op.id, op.status, msg)
        }
    }
}

/// Runs a client command; returns the process exit code.
pub async fn run(cmd: ClientCmd) -> anyhow::Result<i32> {
    let c = Client::from_env()?;
    use reqwest::Method as M;
    match cmd {
        ClientCmd::Sandbox(SandboxCmd::Create {
            template,
            labels,
            env,
            vcpus,
            memory_mib,
            pids,
            disk_mib,
            runtime,
            no_wait,
        }) => {
            let any =
                vcpus.is_some() || memory_mib.is_some() || pids.is_some() || disk_mib.is_some();
            let resources = any.then_some(Resources {
                vcpus,
                memory_mib,
                disk_mib,
                pids,
            });
            let req = CreateSandboxRequest {
                template,
                runtime,
                labels: Some(key_values(&labels, "label")?),
                env: Some(key_values(&env, "env")?),
                resources,
                ..Default::default()
            };
            let op: Operation = c.send(c.req(M::POST, "/v1/sandboxes").json(&req)).await?;
            if no_wait {
                print_json(&op)?;
                return Ok(0);
            }
            let sb = op.sandbox_id.clone().unwrap_or_default();
            eprintln!("creating {sb} (operation {})…", op.id);
            let op = c.wait_op(&op.id, Duration::from_secs(3600)).await?;
            op_outcome(&op)?;
            println!("{sb}");
        }
        ClientCmd::Sandbox(SandboxCmd::Ls { labels }) => {
            let filter = key_values(&labels, "label")?
                .into_iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(",");
            let mut rb = c.req(M::GET, "/v1/sandboxes");
            if !filter.is_empty() {
                rb = rb.query(&[("label", filter)]);
            }
            let list: SandboxList = c.send(rb).await?;
            println!(
                "{:<25} {:<11} {:<10} {:<8} CREATED",
                "ID", "STATE", "TEMPLATE", "RUNTIME"
            );
            for s in list.sandboxes {
                println!(
                    "{:<25} {:<11} {:<10} {:<8} {}",
                    s.id, s.state, s.template, s.runtime, s.created_at
                );
            }
        }
        ClientCmd::Sandbox(SandboxCmd::Get { id }) => {
            let sb: Sandbox = c
                .send(c.req(M::GET, &format!("/v1/sandboxes/{id}")))
                .await?;
            print_json(&sb)?;
        }
        ClientCmd::Sandbox(SandboxCmd::Rm { id, no_wait }) => {
            let op: Operation = c
                .send(c.req(M::DELETE, &format!("/v1/sandboxes/{id}")))
                .await?;
            if no_wait {
                print_json(&op)?;
                return Ok(0);
            }
            let op = c.wait_op(&op.id, Duration::from_secs(600)).await?;
            op_outcome(&op)?;
            eprintln!("destroyed {id}");
        }
        ClientCmd::Sandbox(SandboxCmd::Pause { id, no_wait }) => {
            lifecycle(&c, &id, "pause", no_wait).await?;
        }
        ClientCmd::Sandbox(SandboxCmd::Resume { id, no_wait }) => {
            lifecycle(&c, &id, "resume", no_wait).await?;
        }
        ClientCmd::Sandbox(SandboxCmd::Suspend { id, no_wait }) => {
            lifecycle(&c, &id, "suspend", no_wait).await?;
        }
        ClientCmd::Sandbox(SandboxCmd::Keepalive { id, ttl }) => {
            let body = serde_json::json!({ "ttl_seconds": ttl });
            let body = if ttl.is_some() {
                body
            } else {
                serde_json::json!({})
            };
            let sb: Sandbox = c
                .send(
                    c.req(M::POST, &format!("/v1/sandboxes/{id}/keepalive"))
                        .json(&body),
                )
                .await?;
            print_json(&sb)?;
        }
        ClientCmd::Events { after } => return events(&c, after).await,
        ClientCmd::Ops(OpsCmd::Get { id }) => {
            let op: Operation = c
                .send(c.req(M::GET, &format!("/v1/operations/{id}")))
                .await?;
            print_json(&op)?;
        }
        ClientCmd::Ops(OpsCmd::Wait { id, timeout }) => {
            let op = c.wait_op(&id, Duration::from_secs(timeout)).await?;
            print_json(&op)?;
            return Ok(if op.status == OperationStatus::Succeeded {
                0
            } else {
                1
            });
        }
        ClientCmd::Templates => {
            let list: TemplateList = c.send(c.req(M::GET, "/v1/templates")).await?;
            println!("{:<12} {:<6} {:<8} SIZE", "NAME", "READY", "BUILTIN");
            for t in list.templates {
                println!(
                    "{:<12} {:<6} {:<8} {}",
                    t.name,
                    t.ready,
                    t.builtin,
                    t.size_bytes
                        .map(|b| format!("{} MiB", b >> 20))
                        .unwrap_or_default()
                );
            }
        }
        ClientCmd::Exec(args) => return exec(&c, args).await,
        ClientCmd::Template(t) => return template_cmd(&c, t).await,
    }
    Ok(0)
}

/// `space sandbox pause|resume|suspend`.
async fn lifecycle(c: &Client, id: &str, verb: &str, no_wait: bool) -> anyhow::Result<()> {
    let op: Operation = c
        .send(c.req(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/{verb}")))
        .await?;
    if no_wait {
        return print_json(&op);
    }
    let op = c.wait_op(&op.id, Duration::from_secs(600)).await?;
    op_outcome(&op)?;
    let sb: Sandbox = c
        .send(c.req(reqwest::Method::GET, &format!("/v1/sandboxes/{id}")))
        .await?;
    eprintln!("{id} is {}", sb.state);
    Ok(())
}

/// `space events`: one JSON line per event, resuming after a dropped connection.
async fn events(c: &Client, after: Option<i64>) -> anyhow::Result<i32> {
    let mut last = after;
    let mut failures = 0u32;
    loop {
        let mut rb = c.req(reqwest::Method::GET, "/v1/events");
        if let Some(id) = last {
            rb = rb.header("last-event-id", id.to_string());
        }
        match rb.send().await {
            Ok(resp) if resp.status().is_success() => {
                let mut body = resp.bytes_stream();
                let mut buf: Vec<u8> = Vec::new();
                while let Some(Ok(chunk)) = body.next().await {
                    failures = 0;
                    buf.extend_from_slice(&chunk);
                    while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
                        let frame: Vec<u8> = buf.drain(..pos + 2).collect();
                        for line in String::from_utf8_lossy(&frame).lines() {
                            if let Some(data) = line.strip_prefix("data: ") {
                                // A closed stdout (`space events | head`) ends us quietly.
                                let mut out = std::io::stdout().lock();
                                if writeln!(out, "{data}").and_then(|_| out.flush()).is_err() {
                                    return Ok(0);
                                }
                                if let Ok(v) = serde_json::from_str::<Value>(data) {
                                    last = v.get("id").and_then(Value::as_i64).or(last);
                                }
                            }
                        }
                    }
                }
            }
            Ok(resp) => bail!("reading events failed: {}", resp.status()),
            Err(e) if failures > 30 => return Err(e).context("lost the connection to the server"),
            Err(_) => {}
        }
        failures += 1;
        tokio::time::sleep(Duration::from_millis(200 * u64::from(failures.min(10)))).await;
    }
}

/// `space exec`: start the command, stream its output live (resuming from the
/// last offset if the connection drops), exit with its exit code.
async fn exec(c: &Client, args: ExecArgs) -> anyhow::Result<i32> {
    if args.tty || args.interactive {
        return crate::tty::exec_attached(
            &c.base,
            &c.token,
            &c.http,
            &args.sandbox,
            CreateCommandRequest {
                argv: Some(args.argv),
                env: Some(key_values(&args.env, "env")?),
                cwd: args.cwd,
                user: args.user,
                timeout_seconds: args.timeout,
                ..Default::default()
            },
            args.tty,
        )
        .await;
    }
    let req = CreateCommandRequest {
        argv: Some(args.argv),
        env: Some(key_values(&args.env, "env")?),
        cwd: args.cwd,
        user: args.user,
        timeout_seconds: args.timeout,
        ..Default::default()
    };
    let cmd: Command = c
        .send(
            c.req(
                reqwest::Method::POST,
                &format!("/v1/sandboxes/{}/commands", args.sandbox),
            )
            .json(&req),
        )
        .await?;
    let mut offset = 0u64;
    let mut failures = 0u32;
    let stdout = std::io::stdout();
    let stderr = std::io::stderr();
    loop {
        let url = format!(
            "{}?follow=true&stream=combined&offset={offset}",
            cmd.output_url
        );
        let resp = match c.req(reqwest::Method::GET, &url).send().await {
            Ok(r) if r.status().is_success() => r,
            Ok(r) => bail!("reading output failed: {}", r.status()),
            Err(e) => {
                failures += 1;
                if failures > 30 {
                    return Err(e).context("lost the connection to the server");
                }
                tokio::time::sleep(Duration::from_millis(200 * u64::from(failures.min(10)))).await;
                continue;
            }
        };
        let mut body = resp.bytes_stream();
        let mut buf: Vec<u8> = Vec::new();
        while let Some(chunk) = body.next().await {
            let Ok(chunk) = chunk else { break };
            failures = 0;
            buf.extend_from_slice(&chunk);
            while let Some(nl) = buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = buf.drain(..=nl).collect();
                let v: Value = serde_json::from_slice(&line).context("unreadable output line")?;
                if let Some(data) = v.get("data").and_then(Value::as_str) {
                    let bytes = base64::engine::general_purpose::STANDARD.decode(data)?;
                    if v.get("stream").and_then(Value::as_str) == Some("stderr") {
                        let mut e = stderr.lock();
                        e.write_all(&bytes)?;
                        e.flush()?;
                    } else {
                        let mut o = stdout.lock();
                        o.write_all(&bytes)?;
                        o.flush()?;
                    }
                    offset = v.get("offset").and_then(Value::as_u64).unwrap_or(offset)
                        + bytes.len() as u64;
                } else if v.get("result").is_some() || v.get("state").is_some() {
                    return Ok(exit_code_of(&v));
                }
            }
        }
        // The stream ended without a result: the server went away; resume.
        failures += 1;
        if failures > 30 {
            bail!("the output stream kept ending before the command did");
        }
        tokio::time::sleep(Duration::from_millis(200 * u64::from(failures.min(10)))).await;
    }
}

fn exit_code_of(end: &Value) -> i32 {
    let result = end.get("result").unwrap_or(&Value::Null);
    if let Some(code) = result.get("exit_code").and_then(Value::as_i64) {
        return code as i32;
    }
    if let Some(sig) = result.get("signal").and_then(Value::as_i64) {
        return 128 + sig as i32;
    }
    let state = end
        .get("state")
        .and_then(Value::as_str)
        .unwrap_or("unknown");
    let reason = end
        .get("lost_reason")
        .and_then(Value::as_str)
        .unwrap_or("no result");
    eprintln!("space: command ended {state}: {reason}");
    255
}

#[derive(Subcommand)]
pub enum TemplateCmd {
    /// Build a template from a recipe (TOML; the fields of `POST /v1/templates`, and `files`
    /// entries may say `src = "path"`, read relative to the recipe). Prints the build log.
    Build {
        #[arg(long, short = 'f')]
        file: std::path::PathBuf,
        /// Print the operation and return at once.
        #[arg(long)]
        no_wait: bool,
    },
    /// List templates with their current version.
    Ls,
    /// Delete a template (every version); refused while a sandbox uses it.
    Rm { name: String },
}

/// A TOML recipe as the JSON the server takes: `src` files are read and inlined.
fn recipe_json(path: &std::path::Path) -> anyhow::Result<Value> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the recipe {}", path.display()))?;
    let recipe: toml::Value =
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let mut recipe = serde_json::to_value(recipe)?;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    if let Some(files) = recipe.get_mut("files").and_then(Value::as_array_mut) {
        for f in files {
            let Some(obj) = f.as_object_mut() else {
                continue;
            };
            if let Some(src) = obj.remove("src") {
                let src = src.as_str().context("files[].src must be a string")?;
                if obj.contains_key("content") || obj.contains_key("content_base64") {
                    bail!("file {src}: give src or content, not both");
                }
                let bytes = std::fs::read(dir.join(src))
                    .with_context(|| format!("reading {}", dir.join(src).display()))?;
                obj.insert(
                    "content_base64".into(),
                    base64::engine::general_purpose::STANDARD
                        .encode(bytes)
                        .into(),
                );
            }
        }
    }
    Ok(recipe)
}

/// `space template …`.
async fn template_cmd(c: &Client, cmd: TemplateCmd) -> anyhow::Result<i32> {
    use reqwest::Method as M;
    match cmd {
        TemplateCmd::Build { file, no_wait } => {
            let recipe = recipe_json(&file)?;
            let op: Operation = c
                .send(c.req(M::POST, "/v1/templates").json(&recipe))
                .await?;
            if no_wait {
                print_json(&op)?;
                return Ok(0);
            }
            eprintln!(
                "building {} (operation {})…",
                op.template.as_deref().unwrap_or_default(),
                op.id
            );
            // The log, live, until the build ends.
            let resp = c
                .req(M::GET, &format!("/v1/operations/{}/log?follow=true", op.id))
                .send()
                .await?;
            if resp.status().is_success() {
                let mut body = resp.bytes_stream();
                let mut out = std::io::stdout();
                while let Some(chunk) = body.next().await {
                    out.write_all(&chunk?)?;
                    out.flush()?;
                }
            }
            let op = c.wait_op(&op.id, Duration::from_secs(3600)).await?;
            match op_outcome(&op) {
                Ok(()) => {
                    eprintln!("{}", op.progress.unwrap_or_default());
                    Ok(0)
                }
                Err(e) => {
                    eprintln!("space: {e:#}");
                    Ok(1)
                }
            }
        }
        TemplateCmd::Ls => {
            let list: TemplateList = c.send(c.req(M::GET, "/v1/templates")).await?;
            println!(
                "{:<20} {:<8} {:<8} {:<10} {:<21} BASE",
                "NAME", "VERSION", "BUILTIN", "SIZE", "CREATED"
            );
            for t in list.templates {
                println!(
                    "{:<20} {:<8} {:<8} {:<10} {:<21} {}",
                    t.name,
                    t.version.as_deref().unwrap_or("-"),
                    t.builtin,
                    t.size_bytes
                        .map(|b| format!("{} MiB", b >> 20))
                        .unwrap_or_else(|| "-".into()),
                    t.created_at.as_deref().unwrap_or("-"),
                    t.base.as_deref().unwrap_or("-"),
                );
            }
            Ok(0)
        }
        TemplateCmd::Rm { name } => {
            let resp = c
                .req(M::DELETE, &format!("/v1/templates/{name}"))
                .send()
                .await
                .with_context(|| format!("cannot reach the space server at {}", c.base))?;
            let status = resp.status();
            if !status.is_success() {
                let bytes = resp.bytes().await?;
                match serde_json::from_slice::<ErrorBody>(&bytes) {
                    Ok(e) => bail!("{} ({}): {}", status, e.error.code, e.error.message),
                    Err(_) => bail!("{}: {}", status, String::from_utf8_lossy(&bytes)),
                }
            }
            eprintln!("deleted {name}");
            Ok(0)
        }
    }
}
