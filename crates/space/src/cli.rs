//! The CLI: subcommands that talk HTTP to a running server (`SPACE_URL`, `SPACE_TOKEN`)
//! through `space_client::Client`; this module owns only their output and exit codes.

use std::io::Write;
use std::time::Duration;

use anyhow::{bail, Context};
use base64::Engine;
use clap::{Args, Subcommand};
use futures::StreamExt;
use serde_json::Value;
use space_api::{
    CommandState, CreateCommandRequest, CreateSandboxRequest, Operation, OperationStatus,
    ProcessResult, Resources,
};
use space_client::{status_text, Client, ClientError, EventsQuery, OutputItem, OutputQuery};

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

/// `space pool …`: warm pools (the server's own token only).
#[derive(Subcommand)]
pub enum PoolCmd {
    /// Create a pool, or set its size: `space pool set debian --size 4`.
    Set {
        template: String,
        /// Ready sandboxes to keep (0 keeps the pool, empty).
        #[arg(long)]
        size: u32,
        #[arg(long)]
        runtime: Option<String>,
        #[arg(long)]
        vcpus: Option<u32>,
        #[arg(long)]
        memory_mib: Option<u64>,
        #[arg(long)]
        disk_mib: Option<u64>,
        #[arg(long)]
        pids: Option<u64>,
        /// `none` (default) or `egress` (a create's allowlist is applied when it claims).
        #[arg(long)]
        network: Option<String>,
    },
    /// List pools with their ready and booting sandboxes.
    Ls,
    /// Remove a pool (its sandboxes are destroyed): `space pool rm pool_…`.
    Rm { id: String },
}

pub enum ClientCmd {
    Template(TemplateCmd),
    Pool(PoolCmd),
    Sandbox(SandboxCmd),
    Ops(OpsCmd),
    Exec(ExecArgs),
    Templates,
    /// Follow server-sent events; `after` replays from an event id.
    Events {
        after: Option<i64>,
    },
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

/// `operation op_… failed: code: message` unless the operation succeeded.
fn op_outcome(op: &Operation) -> anyhow::Result<()> {
    match op.status {
        OperationStatus::Succeeded => Ok(()),
        _ => Err(ClientError::OperationFailed(Box::new(op.clone())).into()),
    }
}

/// Runs a client command; returns the process exit code.
pub async fn run(cmd: ClientCmd) -> anyhow::Result<i32> {
    let c = Client::from_env()?;
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
            let op = c.create_sandbox(&req).await?;
            if no_wait {
                print_json(&op)?;
                return Ok(0);
            }
            let sb = op.sandbox_id.clone().unwrap_or_default();
            eprintln!("creating {sb} (operation {})…", op.id);
            let op = c.wait_operation(&op.id, Duration::from_secs(3600)).await?;
            op_outcome(&op)?;
            println!("{sb}");
        }
        ClientCmd::Sandbox(SandboxCmd::Ls { labels }) => {
            let sandboxes = c.list_sandboxes(key_values(&labels, "label")?).await?;
            println!(
                "{:<25} {:<11} {:<10} {:<8} CREATED",
                "ID", "STATE", "TEMPLATE", "RUNTIME"
            );
            for s in sandboxes {
                println!(
                    "{:<25} {:<11} {:<10} {:<8} {}",
                    s.id, s.state, s.template, s.runtime, s.created_at
                );
            }
        }
        ClientCmd::Sandbox(SandboxCmd::Get { id }) => {
            print_json(&c.sandbox(&id).await?)?;
        }
        ClientCmd::Sandbox(SandboxCmd::Rm { id, no_wait }) => {
            let op = c.destroy_sandbox(&id).await?;
            if no_wait {
                print_json(&op)?;
                return Ok(0);
            }
            let op = c.wait_operation(&op.id, Duration::from_secs(600)).await?;
            op_outcome(&op)?;
            eprintln!("destroyed {id}");
        }
        ClientCmd::Sandbox(SandboxCmd::Pause { id, no_wait }) => {
            lifecycle(&c, &id, Verb::Pause, no_wait).await?;
        }
        ClientCmd::Sandbox(SandboxCmd::Resume { id, no_wait }) => {
            lifecycle(&c, &id, Verb::Resume, no_wait).await?;
        }
        ClientCmd::Sandbox(SandboxCmd::Suspend { id, no_wait }) => {
            lifecycle(&c, &id, Verb::Suspend, no_wait).await?;
        }
        ClientCmd::Sandbox(SandboxCmd::Keepalive { id, ttl }) => {
            print_json(&c.keepalive(&id, ttl).await?)?;
        }
        ClientCmd::Events { after } => return events(&c, after).await,
        ClientCmd::Ops(OpsCmd::Get { id }) => {
            print_json(&c.operation(&id, None).await?)?;
        }
        ClientCmd::Ops(OpsCmd::Wait { id, timeout }) => {
            let op = c.wait_operation(&id, Duration::from_secs(timeout)).await?;
            print_json(&op)?;
            return Ok(if op.status == OperationStatus::Succeeded {
                0
            } else {
                1
            });
        }
        ClientCmd::Pool(cmd) => return pool(&c, cmd).await,
        ClientCmd::Templates => {
            let templates = c.templates().await?;
            println!("{:<18} {:<6} {:<8} SIZE", "NAME", "READY", "BUILTIN");
            for t in templates {
                println!(
                    "{:<18} {:<6} {:<8} {}",
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

/// A lifecycle verb of `space sandbox`.
#[derive(Clone, Copy)]
enum Verb {
    Pause,
    Resume,
    Suspend,
}

/// `space sandbox pause|resume|suspend`.
async fn lifecycle(c: &Client, id: &str, verb: Verb, no_wait: bool) -> anyhow::Result<()> {
    let op = match verb {
        Verb::Pause => c.pause_sandbox(id).await?,
        Verb::Resume => c.resume_sandbox(id).await?,
        Verb::Suspend => c.suspend_sandbox(id).await?,
    };
    if no_wait {
        return print_json(&op);
    }
    let op = c.wait_operation(&op.id, Duration::from_secs(600)).await?;
    op_outcome(&op)?;
    let sb = c.sandbox(id).await?;
    eprintln!("{id} is {}", sb.state);
    Ok(())
}

/// `space events`: one JSON line per event, resuming after a dropped connection.
async fn events(c: &Client, after: Option<i64>) -> anyhow::Result<i32> {
    let mut last = after;
    let mut failures = 0u32;
    loop {
        let q = EventsQuery {
            after: None,
            last_event_id: last,
        };
        match c.events(&q).await {
            Ok(mut stream) => {
                failures = 0;
                while let Some(item) = stream.next().await {
                    let event = match item {
                        Ok(e) => e,
                        // The connection broke: reconnect after the last event seen.
                        Err(e) if e.is_transport() => break,
                        Err(e) => return Err(e.into()),
                    };
                    // A closed stdout (`space events | head`) ends us quietly.
                    let line = serde_json::to_string(&event)?;
                    let mut out = std::io::stdout().lock();
                    if writeln!(out, "{line}").and_then(|_| out.flush()).is_err() {
                        return Ok(0);
                    }
                    last = Some(event.id);
                }
            }
            Err(e) => {
                if let Some(status) = e.status() {
                    bail!("reading events failed: {}", status_text(status));
                }
                if !e.is_transport() {
                    return Err(e.into());
                }
                if failures > 30 {
                    return Err(e).context("lost the connection to the server");
                }
            }
        }
        failures += 1;
        tokio::time::sleep(Duration::from_millis(200 * u64::from(failures.min(10)))).await;
    }
}

/// `space exec`: start the command, stream its output live (resuming from the
/// last offset if the connection drops), exit with its exit code.
async fn exec(c: &Client, args: ExecArgs) -> anyhow::Result<i32> {
    let req = CreateCommandRequest {
        argv: Some(args.argv),
        env: Some(key_values(&args.env, "env")?),
        cwd: args.cwd,
        user: args.user,
        timeout_seconds: args.timeout,
        ..Default::default()
    };
    if args.tty || args.interactive {
        return crate::tty::exec_attached(c, &args.sandbox, req, args.tty).await;
    }
    let cmd = c.create_command(&args.sandbox, &req).await?;
    let mut offset = 0u64;
    let mut failures = 0u32;
    let stdout = std::io::stdout();
    let stderr = std::io::stderr();
    loop {
        let q = OutputQuery {
            offset,
            follow: true,
            view: space_client::OutputView::Combined,
        };
        let mut output = match c.command_output(&cmd.sandbox_id, &cmd.id, &q).await {
            Ok(s) => s,
            Err(e) if e.is_transport() => {
                failures += 1;
                if failures > 30 {
                    return Err(e).context("lost the connection to the server");
                }
                tokio::time::sleep(Duration::from_millis(200 * u64::from(failures.min(10)))).await;
                continue;
            }
            Err(e) => return Err(output_failed(e)),
        };
        while let Some(item) = output.next().await {
            match item {
                Ok(OutputItem::Chunk {
                    stream,
                    offset: at,
                    data,
                }) => {
                    failures = 0;
                    if stream == space_client::StdStream::Stderr {
                        let mut e = stderr.lock();
                        e.write_all(&data)?;
                        e.flush()?;
                    } else {
                        let mut o = stdout.lock();
                        o.write_all(&data)?;
                        o.flush()?;
                    }
                    offset = at + data.len() as u64;
                }
                Ok(OutputItem::End {
                    state,
                    result,
                    lost_reason,
                }) => return Ok(exit_code_of(state, result.as_ref(), lost_reason.as_deref())),
                Err(e) if e.is_transport() => break,
                Err(e) => return Err(e.into()),
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

/// A refused output request says which status refused it.
fn output_failed(e: ClientError) -> anyhow::Error {
    match e.status() {
        Some(status) => anyhow::anyhow!("reading output failed: {}", status_text(status)),
        None => e.into(),
    }
}

/// The shell's convention: the exit code, or 128 + the signal that killed it.
fn exit_code_of(state: CommandState, result: Option<&ProcessResult>, lost: Option<&str>) -> i32 {
    if let Some(r) = result {
        if let Some(code) = r.exit_code {
            return code;
        }
        if let Some(sig) = r.signal {
            return 128i32.saturating_add(sig);
        }
    }
    eprintln!(
        "space: command ended {state}: {}",
        lost.unwrap_or("no result")
    );
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
    match cmd {
        TemplateCmd::Build { file, no_wait } => {
            let recipe = recipe_json(&file)?;
            let op = c.build_template(&recipe).await?;
            if no_wait {
                print_json(&op)?;
                return Ok(0);
            }
            eprintln!(
                "building {} (operation {})…",
                op.template.as_deref().unwrap_or_default(),
                op.id
            );
            // The log, live, until the build ends (a build without one goes on to the wait).
            match c.build_log(&op.id, true).await {
                Ok(mut body) => {
                    let mut out = std::io::stdout();
                    while let Some(chunk) = body.next().await {
                        out.write_all(&chunk?)?;
                        out.flush()?;
                    }
                }
                Err(e) if e.status().is_some() => {}
                Err(e) => return Err(e.into()),
            }
            let op = c.wait_operation(&op.id, Duration::from_secs(3600)).await?;
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
            let templates = c.templates().await?;
            println!(
                "{:<20} {:<8} {:<8} {:<10} {:<21} BASE",
                "NAME", "VERSION", "BUILTIN", "SIZE", "CREATED"
            );
            for t in templates {
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
            c.delete_template(&name).await?;
            eprintln!("deleted {name}");
            Ok(0)
        }
    }
}

async fn pool(c: &Client, cmd: PoolCmd) -> anyhow::Result<i32> {
    match cmd {
        PoolCmd::Set {
            template,
            size,
            runtime,
            vcpus,
            memory_mib,
            disk_mib,
            pids,
            network,
        } => {
            let any =
                vcpus.is_some() || memory_mib.is_some() || pids.is_some() || disk_mib.is_some();
            let spec = space_api::PoolSpec {
                template,
                size,
                runtime,
                resources: any.then_some(Resources {
                    vcpus,
                    memory_mib,
                    disk_mib,
                    pids,
                }),
                network,
            };
            print_json(&c.set_pool(&spec).await?)?;
        }
        PoolCmd::Ls => {
            println!(
                "{:<22} {:<12} {:<8} {:<7} {:>4} {:>5} {:>8} {:>6}  RESOURCES",
                "ID", "TEMPLATE", "RUNTIME", "NETWORK", "SIZE", "READY", "STARTING", "CLAIMS"
            );
            for p in c.pools().await? {
                let r = &p.resources;
                println!(
                    "{:<22} {:<12} {:<8} {:<7} {:>4} {:>5} {:>8} {:>6}  {} vcpu, {} MiB, {} MiB disk{}",
                    p.id,
                    p.template,
                    p.runtime,
                    p.network,
                    p.size,
                    p.ready,
                    p.starting,
                    p.claims,
                    r.vcpus.unwrap_or(0),
                    r.memory_mib.unwrap_or(0),
                    r.disk_mib.unwrap_or(0),
                    p.last_error
                        .map(|e| format!("  (last error: {e})"))
                        .unwrap_or_default(),
                );
            }
        }
        PoolCmd::Rm { id } => {
            c.delete_pool(&id).await?;
            eprintln!("removed {id}");
        }
    }
    Ok(0)
}
