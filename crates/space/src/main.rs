//! `space`: the server (`space serve`) and the CLI that talks to it over HTTP.

mod api;
mod cli;
mod cli_files;
mod console;
mod doctor;
mod e2b;
mod keys;
mod listen;
mod mcp;
mod mcp_stdio;
use space_service as service;
mod tty;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use space_runtime::gvisor::GvisorRuntime;

#[derive(Parser)]
#[command(
    name = "space",
    version,
    about = "Sandboxed Platform for Agentic Code Execution"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the server.
    Serve(Box<ServeArgs>),
    /// Manage sandboxes.
    #[command(subcommand)]
    Sandbox(cli::SandboxCmd),
    /// Look at operations.
    #[command(subcommand)]
    Ops(cli::OpsCmd),
    /// Run a command in a sandbox, stream its output, exit with its exit code.
    Exec(cli::ExecArgs),
    /// List templates.
    Templates,
    /// Build, list and delete templates.
    #[command(subcommand)]
    Template(cli::TemplateCmd),
    /// Warm pools: ready sandboxes a matching create claims (the server's token only).
    #[command(subcommand)]
    Pool(cli::PoolCmd),
    /// Follow the server's events (sandbox and operation changes) as JSON lines.
    Events {
        /// Replay from after this event id (0: all retained history).
        #[arg(long)]
        after: Option<i64>,
    },
    /// Copy a file or directory into or out of a sandbox: `space cp ./app sb_…:/app`,
    /// `space cp sb_…:/var/log/app.log .`.
    Cp { src: String, dst: String },
    /// List a directory in a sandbox: `space ls sb_…:/etc`.
    Ls {
        target: String,
        /// How many levels to descend.
        #[arg(long, short, default_value_t = 1)]
        depth: u32,
    },
    /// Check this host: runsc, KVM, QEMU and the guest, cgroups, loop devices, disk, tools.
    Doctor {
        #[arg(long, default_value = "runsc")]
        runsc: PathBuf,
        #[arg(long, env = "SPACE_DATA_DIR", default_value = "/var/lib/space")]
        data_dir: PathBuf,
        #[arg(long, env = "SPACE_GUEST_DIR")]
        guest_dir: Option<PathBuf>,
    },
    /// Local administration that needs no server.
    #[command(subcommand)]
    Admin(AdminCmd),
    /// API keys of tenants: create (printed once), list, revoke. Works on the data dir.
    #[command(subcommand)]
    Keys(keys::KeysCmd),
    /// Per-tenant limits. Works on the data dir.
    #[command(subcommand)]
    Tenants(keys::TenantsCmd),
    /// The MCP server over stdio (for agents that start tools as subprocesses): carries
    /// each message to the server's `/mcp` with `SPACE_URL` and `SPACE_TOKEN`.
    Mcp,
}

#[derive(Subcommand)]
enum AdminCmd {
    /// Build a built-in template into the template directory if it is not there yet.
    PrepareTemplate {
        name: String,
        #[arg(long, env = "SPACE_DATA_DIR", default_value = "/var/lib/space")]
        data_dir: PathBuf,
        #[arg(long)]
        templates_dir: Option<PathBuf>,
    },
}

#[derive(Parser, Debug)]
struct ServeArgs {
    /// Address to listen on; port 0 picks a free one (the chosen address is printed).
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// Where everything the server keeps lives.
    #[arg(long, env = "SPACE_DATA_DIR", default_value = "/var/lib/space")]
    data_dir: PathBuf,
    /// Template cache (default: DATA_DIR/templates). Several servers may share one.
    #[arg(long, env = "SPACE_TEMPLATES_DIR")]
    templates_dir: Option<PathBuf>,
    /// Development mode: accept the token in SPACE_DEV_TOKEN (default `space-dev-token`); loopback only.
    #[arg(long)]
    dev: bool,
    /// The static space-agent binary (default: next to this executable).
    #[arg(long, env = "SPACE_AGENT_BIN")]
    agent_bin: Option<PathBuf>,
    /// The runsc binary.
    #[arg(long, env = "SPACE_RUNSC", default_value = "runsc")]
    runsc: PathBuf,
    /// gVisor platform.
    #[arg(long, default_value = "systrap")]
    platform: String,
    /// Give each gVisor sandbox with fewer vCPUs than the host has CPUs that many CPUs of
    /// its own, the least used ones (its cpuset cgroup): its threads then wake each other on
    /// one CPU, which on a nested host is much cheaper. Off by default: see docs/RUNTIMES.md,
    /// CPU placement.
    #[arg(long)]
    cpu_pinning: bool,
    /// Sandboxes free to run on any CPU: the default; kept so that scripts written when
    /// pinning was the default still start (it wins over `--cpu-pinning`).
    #[arg(long, hide = true)]
    no_cpu_pinning: bool,
    /// Creates that may boot at the same time; more wait as `pending`. Default: 4 per CPU
    /// the server may use, from 4 to 32.
    #[arg(long)]
    max_concurrent_creates: Option<usize>,
    /// Default vCPUs of a sandbox (E2B's default too). A vCPU is a CPU quota, not a
    /// reservation: an idle gVisor sandbox costs the same either way (it sees at least 2
    /// CPUs); a TCG microVM's second vCPU costs a little host CPU even idle.
    #[arg(long, default_value_t = 2)]
    default_vcpus: u32,
    /// Default memory of a sandbox, MiB.
    #[arg(long, default_value_t = 512)]
    default_memory_mib: u64,
    /// Default size of a sandbox's writable layer, MiB (its disk quota).
    #[arg(long, default_value_t = 4096)]
    default_disk_mib: u64,
    /// Largest file upload through the file API, MiB (a tar upload: what it extracts to).
    #[arg(long, default_value_t = 16384)]
    max_upload_mib: u64,
    /// The template E2B's `base` stands for (the E2B-compatible API, docs/E2B.md).
    #[arg(long, default_value = "debian")]
    e2b_template: String,
    /// Guest kernel and initramfs of the microvm runtime (scripts/build-guest.sh makes them;
    /// default: `guest/` beside the target dir of this executable, else DATA_DIR/guest).
    #[arg(long, env = "SPACE_GUEST_DIR")]
    guest_dir: Option<PathBuf>,
    /// Accelerator of the microvm runtime: auto (KVM where it really runs standard guests,
    /// else TCG), kvm or tcg.
    #[arg(long, default_value = "auto")]
    microvm_accel: String,
    /// Runtime of sandboxes that ask for none: gvisor or microvm.
    #[arg(long, default_value = "gvisor")]
    default_runtime: String,
    /// Default process limit of a sandbox.
    #[arg(long, default_value_t = 1024)]
    default_pids: u64,
    /// How long records and command output of destroyed sandboxes are kept.
    #[arg(long, default_value_t = 7 * 24 * 3600)]
    retention_seconds: u64,
    /// One deadline (seconds) for every operation instead of the per-kind defaults
    /// (create 1200, suspend 300, resume 180, destroy 120, pause 60).
    #[arg(long)]
    operation_timeout_seconds: Option<u64>,
    /// Timeout of a command whose request gives none (0: no timeout).
    #[arg(long, default_value_t = 0)]
    default_command_timeout_seconds: u64,
    /// Longest command timeout a request may ask for (0: no maximum).
    #[arg(long, default_value_t = 0)]
    max_command_timeout_seconds: u64,
    /// Output kept per stream of each command, MiB; past it the head is dropped and the
    /// result says output_truncated (0: keep everything).
    #[arg(long, default_value_t = 64)]
    output_cap_mib: u64,
    /// Output all the commands of one sandbox may keep on the host together, MiB: running
    /// commands share it, and past it the output of finished commands goes, oldest first
    /// (0: no budget).
    #[arg(long, default_value_t = 1024)]
    sandbox_output_mib: u64,
    /// A host directory that template recipes may import from (`dir:`, `tar:`, `oci:` bases);
    /// repeatable. None by default: such recipes are refused.
    #[arg(long = "template-import-dir")]
    template_import_dirs: Vec<PathBuf>,
    /// CPU quota of each template build step, in vCPUs.
    #[arg(long, default_value_t = 2)]
    build_vcpus: u32,
    /// Memory of each template build step, MiB.
    #[arg(long, default_value_t = 2048)]
    build_memory_mib: u64,
    /// Processes of each template build step.
    #[arg(long, default_value_t = 1024)]
    build_pids: u64,
    /// Disk of each template build step for what it writes, MiB; also the most an import or
    /// a package download of a build may bring in.
    #[arg(long, default_value_t = 8192)]
    build_disk_mib: u64,
    /// Longest a template build step may run, seconds; past it the step is killed and the
    /// build fails.
    #[arg(long, default_value_t = 900)]
    build_step_timeout_seconds: u64,
    /// Runtime of template build steps: gvisor or microvm (default: gvisor where runsc is
    /// installed, else microvm).
    #[arg(long)]
    build_runtime: Option<String>,
    /// Most vCPUs a sandbox may ask for.
    #[arg(long, default_value_t = 8)]
    max_vcpus: u32,
    /// Most memory a sandbox may ask for, MiB.
    #[arg(long, default_value_t = 16384)]
    max_memory_mib: u64,
    /// Largest disk quota a sandbox may ask for, MiB.
    #[arg(long, default_value_t = 65536)]
    max_disk_mib: u64,
    /// Most processes a sandbox may ask for.
    #[arg(long, default_value_t = 32768)]
    max_pids: u64,
    /// Sandboxes one tenant may have that are not destroyed or failed (429 past it).
    #[arg(long, default_value_t = 100)]
    tenant_max_sandboxes: u64,
    /// Commands one tenant may have running at once (429 past it).
    #[arg(long, default_value_t = 256)]
    tenant_max_running_commands: u64,
    /// Sandbox creates one tenant may ask for per minute (429 + Retry-After past it).
    #[arg(long, default_value_t = 120)]
    tenant_creates_per_minute: u64,
    /// Commands one sandbox may have running at once (429 past it).
    #[arg(long, default_value_t = 64)]
    max_commands_per_sandbox: u64,
    /// Long-lived responses one tenant may hold open at once: event streams, followed
    /// output and build logs, attached terminals (429 past it).
    #[arg(long, default_value_t = 64)]
    tenant_max_streams: u64,
    /// Template builds one tenant may have running or waiting at once (429 past it).
    #[arg(long, default_value_t = 4)]
    tenant_max_builds: u64,
    /// Large request bodies (file uploads, recipes) one tenant may send at once (429 past it).
    #[arg(long, default_value_t = 8)]
    tenant_max_uploads: u64,
    /// Seconds a client has to send a request head (on a new or kept-alive connection).
    #[arg(long, default_value_t = 10)]
    header_read_timeout_seconds: u64,
    /// Seconds a request body may stall between two chunks before the request fails.
    #[arg(long, default_value_t = 60)]
    body_idle_timeout_seconds: u64,
    /// Connections one client address may hold open (past it: 429, closed at once).
    #[arg(long, default_value_t = 256)]
    max_connections_per_ip: usize,
    /// Log lines as text, or as one JSON object per line (`json`).
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Sandboxes all warm pools may hold together (`space pool set`, docs/POOLS.md).
    #[arg(long, default_value_t = 16)]
    pool_max_sandboxes: u64,
    /// Pooled sandboxes that may boot at once, server-wide (they share the create slots).
    #[arg(long, default_value_t = 1)]
    pool_fills: usize,
    /// Resident sandboxes (all but suspended ones; pooled ones included) this server runs
    /// at most; past it a create or a resume from suspended gets 429. Default: 16 per CPU
    /// (an idle gVisor sandbox costs about 3% of a core); 0: no cap.
    #[arg(long)]
    max_sandboxes: Option<u64>,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.command {
        Cmd::Serve(args) => {
            init_tracing(args.log_format);
            rt.block_on(serve(*args))
        }
        Cmd::Admin(AdminCmd::PrepareTemplate {
            name,
            data_dir,
            templates_dir,
        }) => {
            init_tracing(LogFormat::Text);
            rt.block_on(async {
                let dir = templates_dir.unwrap_or_else(|| data_dir.join("templates"));
                let store = space_runtime::template::TemplateStore::new(dir)?;
                let t = store
                    .ensure(&name, &|line: String| eprintln!("{line}"))
                    .await?;
                println!("{} {} {}", t.name, t.version, t.rootfs.display());
                Ok(())
            })
        }
        Cmd::Doctor {
            runsc,
            data_dir,
            guest_dir,
        } => {
            let runsc = if runsc.components().count() > 1 {
                runsc
            } else {
                which(&runsc).unwrap_or(runsc)
            };
            let guest_dir = guest_dir.unwrap_or_else(|| default_guest_dir(&data_dir));
            std::process::exit(doctor::run(&runsc, &data_dir, &guest_dir))
        }
        Cmd::Keys(c) => exit_with(keys::keys(c).map(|()| 0)),
        Cmd::Mcp => exit_with(rt.block_on(mcp_stdio::run())),
        Cmd::Tenants(c) => exit_with(keys::tenants(c).map(|()| 0)),
        Cmd::Cp { src, dst } => exit_with(rt.block_on(cli_files::cp(&src, &dst))),
        Cmd::Ls { target, depth } => exit_with(rt.block_on(cli_files::ls(&target, depth))),
        other => match rt.block_on(cli::run(other.into_client())) {
            Ok(code) => std::process::exit(code),
            Err(e) => {
                eprintln!("space: {e:#}");
                std::process::exit(1);
            }
        },
    }
}

impl Cmd {
    fn into_client(self) -> cli::ClientCmd {
        match self {
            Cmd::Sandbox(c) => cli::ClientCmd::Sandbox(c),
            Cmd::Ops(c) => cli::ClientCmd::Ops(c),
            Cmd::Exec(a) => cli::ClientCmd::Exec(a),
            Cmd::Templates => cli::ClientCmd::Templates,
            Cmd::Template(c) => cli::ClientCmd::Template(c),
            Cmd::Pool(c) => cli::ClientCmd::Pool(c),
            Cmd::Events { after } => cli::ClientCmd::Events { after },
            Cmd::Serve(_)
            | Cmd::Admin(_)
            | Cmd::Cp { .. }
            | Cmd::Ls { .. }
            | Cmd::Doctor { .. }
            | Cmd::Keys(_)
            | Cmd::Mcp
            | Cmd::Tenants(_) => {
                unreachable!("handled in main")
            }
        }
    }
}

/// gVisor always; the microVM runtime where its guest files and QEMU are there.
fn runtimes(
    args: &ServeArgs,
    gvisor: GvisorRuntime,
) -> anyhow::Result<service::runtimes::Runtimes> {
    use service::runtimes::{RuntimeEntry, Runtimes};
    use space_runtime::microvm::{MicrovmConfig, MicrovmRuntime};
    let accel: space_runtime::microvm::AccelChoice = args
        .microvm_accel
        .parse()
        .map_err(|e| anyhow::anyhow!("--microvm-accel: {e}"))?;
    let guest_dir = args
        .guest_dir
        .clone()
        .unwrap_or_else(|| default_guest_dir(&args.data_dir));
    let mut cfg = MicrovmConfig::new(guest_dir, args.data_dir.join("microvm"));
    cfg.accel = accel;
    let microvm = match which(&cfg.qemu) {
        None => Err(format!(
            "{} is not installed (scripts/setup.sh installs qemu-system-x86)",
            cfg.qemu.display()
        )),
        Some(_) => MicrovmRuntime::new(cfg).map_err(|e| e.to_string()),
    };
    if accel == space_runtime::microvm::AccelChoice::Kvm {
        if let Err(why) = &microvm {
            anyhow::bail!("--microvm-accel kvm: {why}");
        }
    }
    match &microvm {
        Ok(m) => tracing::info!(accelerator = %m.accel(), "microvm runtime available"),
        Err(why) => tracing::warn!(reason = %why, "microvm runtime unavailable"),
    }
    let accelerator = microvm.as_ref().ok().map(|m| m.accel().to_string());
    let platform = args.platform.clone();
    let mut entries = vec![
        RuntimeEntry {
            name: "gvisor",
            accelerator: Some(platform),
            runtime: Ok(Arc::new(gvisor)),
        },
        RuntimeEntry {
            name: "microvm",
            accelerator,
            runtime: microvm.map(|m| Arc::new(m) as Arc<dyn space_core::runtime::Runtime>),
        },
    ];
    // The default runtime first.
    if let Some(i) = entries.iter().position(|e| e.name == args.default_runtime) {
        entries.swap(0, i);
    } else {
        anyhow::bail!(
            "--default-runtime {:?}: use gvisor or microvm",
            args.default_runtime
        );
    }
    if let Err(why) = &entries[0].runtime {
        anyhow::bail!("--default-runtime {}: {why}", entries[0].name);
    }
    Runtimes::new(entries)
}

/// The runtime of template build steps: `--build-runtime`, which must be available; by
/// default gVisor where runsc is installed, else the microVM runtime where it is available.
fn build_runtime(
    args: &ServeArgs,
    runtimes: &service::runtimes::Runtimes,
) -> anyhow::Result<String> {
    let name = match &args.build_runtime {
        Some(name) => name.clone(),
        None if which(&args.runsc).is_none() && runtimes.get("microvm").is_ok() => {
            "microvm".to_owned()
        }
        None => "gvisor".to_owned(),
    };
    if !matches!(name.as_str(), "gvisor" | "microvm") {
        anyhow::bail!("--build-runtime {name:?}: use gvisor or microvm");
    }
    if args.build_runtime.is_some() {
        if let Err(why) = runtimes.get(&name) {
            anyhow::bail!("--build-runtime {name}: {why}");
        }
    }
    tracing::info!(runtime = %name, "template build steps run on this runtime");
    Ok(name)
}

/// Whether the data dir's database holds a key that is not revoked.
fn has_api_keys(data_dir: &Path) -> bool {
    let db = data_dir.join("space.db");
    db.exists()
        && space_store::SqliteStore::open(&db)
            .and_then(|s| s.list_api_keys(None))
            .is_ok_and(|keys| keys.iter().any(|k| k.revoked_at.is_none()))
}

/// `guest/` beside the target dir of this executable when it holds a kernel (a build
/// tree), else DATA_DIR/guest.
fn default_guest_dir(data_dir: &Path) -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join("../guest")))
        .filter(|d| d.join(space_runtime::microvm::GUEST_KERNEL).exists())
        .unwrap_or_else(|| data_dir.join("guest"))
}

/// `cmd` as found on PATH (or as given, when it has a slash).
fn which(cmd: &Path) -> Option<PathBuf> {
    if cmd.components().count() > 1 {
        return cmd.is_file().then(|| cmd.to_path_buf());
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(cmd))
            .find(|p| p.is_file())
    })
}

fn exit_with(r: anyhow::Result<i32>) -> ! {
    match r {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("space: {e:#}");
            std::process::exit(1);
        }
    }
}

/// `--log-format`: lines for people, or one JSON object per line for a log pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SPACE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => fmt
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        LogFormat::Json => fmt.json().flatten_event(true).with_ansi(false).init(),
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    // Every sandbox, agent connection, stream and client holds descriptors.
    let (soft, hard) = doctor::raise_nofile();
    tracing::info!(soft, hard, "open file limit (RLIMIT_NOFILE)");
    if space_service::TEST_HOOKS {
        tracing::warn!("this build has the test hooks in (the `test-hooks` feature): failpoints and SPACE_EGRESS_HOSTS_FILE are read; do not use it in production");
    }
    let token: Option<String> = if args.dev {
        if !args.listen.ip().is_loopback() {
            bail!(
                "--dev refuses to listen on {}: dev mode accepts a well-known token, so it only listens on loopback",
                args.listen
            );
        }
        let token = std::env::var("SPACE_DEV_TOKEN").unwrap_or_else(|_| "space-dev-token".into());
        eprintln!("################################################################");
        eprintln!("# WARNING: space is running in DEV MODE.                       #");
        eprintln!("# Anyone on this machine with the dev token can run code here. #");
        eprintln!("# Do not use --dev in production.                              #");
        eprintln!("################################################################");
        Some(token)
    } else {
        match std::env::var("SPACE_API_TOKEN") {
            Ok(t) if t.len() >= 16 => Some(t),
            Ok(_) => bail!("SPACE_API_TOKEN must be at least 16 characters"),
            // Keys only: fine once there is a key to use.
            Err(_) if has_api_keys(&args.data_dir) => None,
            Err(_) => bail!(
                "set SPACE_API_TOKEN (at least 16 characters), make a key with \
                 `space keys create --tenant NAME`, or run with --dev"
            ),
        }
    };

    for (what, default, max) in [
        (
            "vcpus",
            u64::from(args.default_vcpus),
            u64::from(args.max_vcpus),
        ),
        ("memory-mib", args.default_memory_mib, args.max_memory_mib),
        ("disk-mib", args.default_disk_mib, args.max_disk_mib),
        ("pids", args.default_pids, args.max_pids),
    ] {
        if default > max {
            bail!("--default-{what} {default} is above --max-{what} {max}");
        }
    }
    let agent_bin = match args.agent_bin.clone() {
        Some(p) => p,
        None => default_agent_bin()?,
    };
    let agent_dir = args.data_dir.join("agent");
    install_agent(&agent_bin, &agent_dir)
        .with_context(|| format!("installing the agent from {}", agent_bin.display()))?;

    let runtime = GvisorRuntime::new(
        args.runsc.clone(),
        args.data_dir.join("runsc"),
        args.data_dir.join("build-runsc"),
        args.platform.clone(),
    )
    .with_cpu_pinning(args.cpu_pinning && !args.no_cpu_pinning);
    let runtimes = runtimes(&args, runtime)?;
    let build_runtime = build_runtime(&args, &runtimes)?;
    let cfg = service::Config {
        data_dir: args.data_dir.clone(),
        templates_dir: args
            .templates_dir
            .clone()
            .unwrap_or_else(|| args.data_dir.join("templates")),
        agent_dir,
        max_concurrent_creates: args
            .max_concurrent_creates
            .unwrap_or_else(default_max_concurrent_creates),
        default_resources: space_api::Resources {
            vcpus: Some(args.default_vcpus),
            memory_mib: Some(args.default_memory_mib),
            disk_mib: Some(args.default_disk_mib),
            pids: Some(args.default_pids),
        },
        max_resources: space_api::Resources {
            vcpus: Some(args.max_vcpus),
            memory_mib: Some(args.max_memory_mib),
            disk_mib: Some(args.max_disk_mib),
            pids: Some(args.max_pids),
        },
        retention: std::time::Duration::from_secs(args.retention_seconds),
        operation_timeout: args
            .operation_timeout_seconds
            .map(std::time::Duration::from_secs),
        default_command_timeout_seconds: args.default_command_timeout_seconds,
        max_command_timeout_seconds: args.max_command_timeout_seconds,
        output_cap_bytes: args.output_cap_mib.saturating_mul(1 << 20),
        sandbox_output_budget_bytes: args.sandbox_output_mib.saturating_mul(1 << 20),
        template_import_dirs: args.template_import_dirs.clone(),
        build_limits: space_runtime::build::BuildLimits {
            vcpus: args.build_vcpus.max(1),
            memory_mib: args.build_memory_mib.max(64),
            pids: args.build_pids.max(16),
            disk_mib: args.build_disk_mib.max(16),
            step_timeout: std::time::Duration::from_secs(args.build_step_timeout_seconds.max(1)),
        },
        build_runtime,
        max_upload_bytes: args.max_upload_mib.saturating_mul(1 << 20),
        server_token: token,
        limits: service::Limits {
            max_sandboxes: args.tenant_max_sandboxes,
            max_running_commands: args.tenant_max_running_commands,
            creates_per_minute: args.tenant_creates_per_minute,
            max_commands_per_sandbox: args.max_commands_per_sandbox,
            max_streams: args.tenant_max_streams,
            max_builds: args.tenant_max_builds,
            max_uploads: args.tenant_max_uploads,
        },
        pool_max_sandboxes: args.pool_max_sandboxes,
        pool_fills: args.pool_fills,
        max_sandboxes: args.max_sandboxes.unwrap_or_else(default_max_sandboxes),
    };
    let service = service::Service::start(cfg, runtimes)
        .await
        .context("starting the service")?;
    let e2b = e2b::E2bState::new(service.clone(), &args.e2b_template);
    let mcp = axum::Router::new()
        .nest_service("/mcp", mcp::http_service(service.clone()))
        .layer(axum::middleware::from_fn_with_state(
            service.clone(),
            mcp::auth,
        ));
    let app = api::router(api::AppState { service }, e2b::router(e2b).merge(mcp));
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    let addr = listener.local_addr()?;
    // Tests and scripts read this line to find an ephemeral port.
    println!("space listening on http://{addr}");
    tracing::info!(%addr, data_dir = %args.data_dir.display(), "serving");
    let shutdown = async {
        shutdown_signal().await;
        tracing::info!("shutting down: finishing requests for up to 5 s");
    };
    let bounds = listen::Bounds {
        header_read_timeout: std::time::Duration::from_secs(
            args.header_read_timeout_seconds.max(1),
        ),
        body_idle_timeout: std::time::Duration::from_secs(args.body_idle_timeout_seconds.max(1)),
        max_connections_per_ip: args.max_connections_per_ip.max(1),
    };
    listen::serve(listener, app, bounds, shutdown).await;
    tracing::info!("stopped; sandboxes keep running and are re-adopted on the next start");
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
}

/// `space-agent` next to this executable, or the static build in the same target dir.
fn default_agent_bin() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("executable has no directory")?;
    let candidates = [
        dir.join("space-agent"),
        dir.join("../x86_64-unknown-linux-gnu/release/space-agent"),
        dir.join("../../x86_64-unknown-linux-gnu/release/space-agent"),
    ];
    for c in &candidates {
        if c.is_file() && is_static_elf(c).unwrap_or(false) {
            return Ok(c.clone());
        }
    }
    bail!(
        "no static space-agent binary found next to {}; build it with scripts/build.sh or pass --agent-bin",
        exe.display()
    )
}

/// Copies the agent into the data dir (atomically) so sandboxes never see a half-written binary.
fn install_agent(src: &Path, dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if !is_static_elf(src)? {
        bail!(
            "{} is not a statically linked ELF executable; the agent must run in any template",
            src.display()
        );
    }
    std::fs::create_dir_all(dir)?;
    let dst = dir.join("space-agent");
    let new = std::fs::read(src)?;
    if std::fs::read(&dst).ok().as_deref() == Some(&new[..]) {
        return Ok(());
    }
    let tmp = dir.join(format!(".space-agent.{}", std::process::id()));
    std::fs::write(&tmp, &new)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
    std::fs::File::open(&tmp)?.sync_all()?;
    std::fs::rename(&tmp, &dst)?;
    Ok(())
}

/// Whether `path` is a 64-bit ELF executable without a program interpreter.
fn is_static_elf(path: &Path) -> anyhow::Result<bool> {
    let data = std::fs::read(path)?;
    if data.len() < 64 || &data[..4] != b"\x7fELF" || data[4] != 2 {
        return Ok(false);
    }
    let u16_at = |o: usize| u16::from_le_bytes([data[o], data[o + 1]]) as usize;
    let mut off = [0u8; 8];
    off.copy_from_slice(&data[0x20..0x28]);
    let phoff = usize::try_from(u64::from_le_bytes(off))?;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    for i in 0..phnum {
        let o = phoff + i * phentsize;
        if o + 4 > data.len() {
            return Ok(false);
        }
        let p_type = u32::from_le_bytes([data[o], data[o + 1], data[o + 2], data[o + 3]]);
        if p_type == 3 {
            return Ok(false); // PT_INTERP: dynamically linked
        }
    }
    Ok(true)
}

/// `--max-concurrent-creates` when it is not given: 4 per CPU the server may use, from 4 to
/// 32. A boot spends much of its time waiting on runsc's own processes handing work to each
/// other, so fewer creates than that leave CPUs idle in a burst: 16 creates at once, each to
/// a first result, took 1.05-1.25x raw runsc's time on a 2-core host with 4 slots, and
/// 0.92-1.14x with 8 (hand runs, each beside raw runsc as `benches/creates.rs` runs it).
fn default_max_concurrent_creates() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    (4 * cpus).clamp(4, 32)
}

/// `--max-sandboxes` when it is not given: 16 per CPU the server may use.
fn default_max_sandboxes() -> u64 {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    16 * cpus as u64
}
