//! `space keys …` and `space tenants …`: local administration of API keys and
//! per-tenant limits, straight on the server's database (no server needed;
//! a running server sees the change on its next request).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Subcommand;
use space_store::{SqliteStore, TenantLimits};

use space_service::tenancy::{new_key, valid_tenant};

#[derive(Subcommand, Debug)]
pub enum KeysCmd {
    /// Make a key for a tenant; it is printed once and only its hash is kept.
    Create {
        #[arg(long)]
        tenant: String,
        /// A note to recognise the key by.
        #[arg(long, default_value = "")]
        name: String,
        #[arg(long, env = "SPACE_DATA_DIR", default_value = "/var/lib/space")]
        data_dir: PathBuf,
    },
    /// List keys (never the keys themselves).
    Ls {
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long, env = "SPACE_DATA_DIR", default_value = "/var/lib/space")]
        data_dir: PathBuf,
    },
    /// Revoke a key by its id; requests with it fail from now on.
    Revoke {
        id: String,
        #[arg(long, env = "SPACE_DATA_DIR", default_value = "/var/lib/space")]
        data_dir: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
pub enum TenantsCmd {
    /// Show a tenant's own limits, setting those given (unset ones use the server's flags).
    Limits {
        tenant: String,
        #[arg(long)]
        max_sandboxes: Option<u64>,
        #[arg(long)]
        max_running_commands: Option<u64>,
        #[arg(long)]
        creates_per_minute: Option<u64>,
        /// Forget this tenant's own limits.
        #[arg(long)]
        reset: bool,
        #[arg(long, env = "SPACE_DATA_DIR", default_value = "/var/lib/space")]
        data_dir: PathBuf,
    },
}

fn open(data_dir: &Path) -> anyhow::Result<SqliteStore> {
    space_runtime::tree::private_dir(data_dir)
        .with_context(|| format!("creating {}", data_dir.display()))?;
    SqliteStore::open(&data_dir.join("space.db"))
        .with_context(|| format!("opening the database in {}", data_dir.display()))
}

fn check_tenant(t: &str) -> anyhow::Result<()> {
    if !valid_tenant(t) {
        bail!("invalid tenant {t:?}: 1-63 of a-z 0-9 - _, starting with a letter or digit");
    }
    Ok(())
}

pub fn keys(cmd: KeysCmd) -> anyhow::Result<()> {
    match cmd {
        KeysCmd::Create {
            tenant,
            name,
            data_dir,
        } => {
            check_tenant(&tenant)?;
            if name.len() > 200 || name.chars().any(char::is_control) {
                bail!("--name: at most 200 printable characters");
            }
            let store = open(&data_dir)?;
            let (rec, hash, key) = new_key(&tenant, &name);
            store.insert_api_key(&rec, &hash)?;
            eprintln!(
                "key {} for tenant {} (shown once; keep it secret):",
                rec.id, rec.tenant
            );
            println!("{key}");
        }
        KeysCmd::Ls { tenant, data_dir } => {
            let store = open(&data_dir)?;
            println!(
                "{:<30} {:<20} {:<26} {:<26} NAME",
                "ID", "TENANT", "CREATED", "REVOKED"
            );
            for k in store.list_api_keys(tenant.as_deref())? {
                println!(
                    "{:<30} {:<20} {:<26} {:<26} {}",
                    k.id,
                    k.tenant,
                    k.created_at,
                    k.revoked_at.as_deref().unwrap_or("-"),
                    k.name
                );
            }
        }
        KeysCmd::Revoke { id, data_dir } => {
            let store = open(&data_dir)?;
            if !store.revoke_api_key(&id, &space_core::now_rfc3339())? {
                bail!("no live key {id:?}");
            }
            eprintln!("revoked {id}");
        }
    }
    Ok(())
}

pub fn tenants(cmd: TenantsCmd) -> anyhow::Result<()> {
    let TenantsCmd::Limits {
        tenant,
        max_sandboxes,
        max_running_commands,
        creates_per_minute,
        reset,
        data_dir,
    } = cmd;
    check_tenant(&tenant)?;
    let store = open(&data_dir)?;
    let mut l = if reset {
        TenantLimits::default()
    } else {
        store.tenant_limits(&tenant)?
    };
    if max_sandboxes.is_some() {
        l.max_sandboxes = max_sandboxes;
    }
    if max_running_commands.is_some() {
        l.max_running_commands = max_running_commands;
    }
    if creates_per_minute.is_some() {
        l.creates_per_minute = creates_per_minute;
    }
    store.set_tenant_limits(&tenant, &l)?;
    let show = |v: Option<u64>| v.map_or("server default".to_string(), |v| v.to_string());
    println!("tenant {tenant}");
    println!("  max_sandboxes        {}", show(l.max_sandboxes));
    println!("  max_running_commands {}", show(l.max_running_commands));
    println!("  creates_per_minute   {}", show(l.creates_per_minute));
    Ok(())
}
