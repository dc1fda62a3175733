//! Extra Debian packages of a `debian:bookworm` recipe, installed without running anything of
//! them on the host.
//!
//! Maintainer scripts are programs from the package: run as root on the host (as
//! `mmdebstrap --include` does, in a chroot), they could do anything there. So the host only
//! *downloads*: its own apt, with a private configuration and state directory (nothing of the
//! host's apt setup is read or changed), the base layer's package database as the status to
//! resolve against and the base's archive keys to verify the indexes, resolves the packages
//! and fetches the .debs. Downloading runs nothing from a package. The .debs and the verified
//! indexes that vouch for their hashes are then put into the step's root, and a build step —
//! inside gVisor, without a network, with the build's limits — installs them with
//! `apt-get --no-download`, so every maintainer script runs in the sandbox.

use std::ffi::OsStr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use crate::build::BuildLog;
use crate::template::{IoContext, TemplateError};
use crate::tree::Dir;

/// The archive the built-in debian template is made from (its `/etc/apt/sources.list`).
const SOURCES: &str = "deb http://deb.debian.org/debian bookworm main\n";
/// Resolving and downloading that takes longer is stuck (on the network, usually).
const DOWNLOAD_TIMEOUT: Duration = Duration::from_secs(10 * 60);

fn fail(name: &str, message: String) -> TemplateError {
    TemplateError::Build {
        name: name.to_owned(),
        message,
    }
}

/// Resolves `packages` against the base layer `base` and downloads them (with everything they
/// need that the base lacks) into `apt` (a fresh directory the host owns), refusing a set
/// larger than `max_bytes`.
pub(crate) async fn download(
    name: &str,
    base: &Path,
    apt: &Path,
    packages: &[String],
    max_bytes: u64,
    log: &BuildLog,
) -> Result<(), TemplateError> {
    let apt_get = crate::template::find_tool(name, "apt-get", "install apt on the host")?;
    for dir in [
        "etc/parts",
        "etc/prefs",
        "state",
        "lists/partial",
        "cache/archives/partial",
        "log",
    ] {
        crate::template::make_dir(&apt.join(dir), 0o700)?;
    }
    let d = apt.display();
    let b = base.display();
    let conf = format!(
        "Dir::Etc::main \"/dev/null\";
Dir::Etc::parts \"{d}/etc/parts\";
Dir::Etc::sourcelist \"{d}/sources.list\";
Dir::Etc::sourceparts \"{d}/etc/parts\";
Dir::Etc::preferences \"/dev/null\";
Dir::Etc::preferencesparts \"{d}/etc/prefs\";
Dir::Etc::trusted \"/dev/null\";
Dir::Etc::trustedparts \"{b}/etc/apt/trusted.gpg.d\";
Dir::State \"{d}/state\";
Dir::State::lists \"{d}/lists\";
Dir::State::status \"{b}/var/lib/dpkg/status\";
Dir::Cache \"{d}/cache\";
Dir::Cache::archives \"{d}/cache/archives\";
Dir::Log \"{d}/log\";
APT::Architecture \"amd64\";
APT::Architectures {{ \"amd64\"; }};
APT::Install-Recommends \"false\";
APT::Sandbox::User \"root\";
Debug::NoLocking \"true\";
Acquire::GzipIndexes \"true\";
Acquire::CompressionTypes::Order {{ \"gz\"; }};
Acquire::Languages \"none\";
"
    );
    crate::template::write_atomic(&apt.join("apt.conf"), conf.as_bytes())?;
    crate::template::write_atomic(&apt.join("sources.list"), SOURCES.as_bytes())?;

    let run = |args: Vec<&str>| {
        let mut cmd = tokio::process::Command::new(&apt_get);
        cmd.args(["-q", "-y"])
            .args(args)
            .env("APT_CONFIG", apt.join("apt.conf"))
            .env("LC_ALL", "C.UTF-8")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .current_dir(apt)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        cmd
    };
    let mut install = vec!["install"];
    install.extend(packages.iter().map(String::as_str));
    let work = async {
        let out = output(name, run(vec!["update"]), log).await?;
        if !out.status.success() {
            return Err(fail(
                name,
                format!("apt-get update failed: {}", tail(&out.stderr)),
            ));
        }
        let mut print = install.clone();
        print.insert(0, "--print-uris");
        let out = output(name, run(print), log).await?;
        if !out.status.success() {
            return Err(fail(
                name,
                format!("resolving the packages failed: {}", tail(&out.stderr)),
            ));
        }
        let bytes = download_size(&String::from_utf8_lossy(&out.stdout));
        if bytes > max_bytes {
            return Err(fail(
                name,
                format!(
                    "the packages and what they depend on are {} MiB, more than the build's disk quota of {} MiB",
                    bytes >> 20,
                    max_bytes >> 20
                ),
            ));
        }
        let mut fetch = install.clone();
        fetch.insert(0, "--download-only");
        let out = output(name, run(fetch), log).await?;
        if !out.status.success() {
            return Err(fail(
                name,
                format!("downloading the packages failed: {}", tail(&out.stderr)),
            ));
        }
        Ok(())
    };
    match tokio::time::timeout(DOWNLOAD_TIMEOUT, work).await {
        Ok(r) => r,
        Err(_) => Err(fail(
            name,
            format!(
                "downloading the packages did not finish within {} minutes",
                DOWNLOAD_TIMEOUT.as_secs() / 60
            ),
        )),
    }
}

/// Runs apt-get to completion, its output appended to the build log.
async fn output(
    name: &str,
    mut cmd: tokio::process::Command,
    log: &BuildLog,
) -> Result<std::process::Output, TemplateError> {
    let out = cmd
        .output()
        .await
        .map_err(|e| fail(name, format!("running apt-get: {e}")))?;
    log.append(&out.stderr);
    Ok(out)
}

fn tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text.lines().rev().take(10).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join("\n")
}

/// The bytes `apt-get --print-uris install` would download: the third field of each
/// `'URL' FILE SIZE HASH` line.
fn download_size(print_uris: &str) -> u64 {
    print_uris
        .lines()
        .filter(|l| l.starts_with('\''))
        .filter_map(|l| l.split_whitespace().nth(2)?.parse::<u64>().ok())
        .fold(0u64, u64::saturating_add)
}

/// Puts the downloaded .debs and indexes from `apt` into the step's root `root` (the base
/// layer's copy), where `apt-get --no-download` finds them.
pub(crate) fn stage(apt: &Path, root: &Path) -> Result<(), TemplateError> {
    let dst = Dir::open(root).at("open", root)?;
    for (from, to) in [
        ("lists", "var/lib/apt/lists"),
        ("cache/archives", "var/cache/apt/archives"),
    ] {
        let src_path = apt.join(from);
        let src = Dir::open(&src_path).at("open", &src_path)?;
        let into = dst.ensure_path(to, 0o755).at("create", &root.join(to))?;
        into.ensure_dir(OsStr::new("partial"), 0o700)
            .at("create", &root.join(to).join("partial"))?;
        for file in src.names().at("list", &src_path)? {
            let Some(st) = src.lstat(&file).at("inspect", &src_path)? else {
                continue;
            };
            if crate::tree::kind(&st) != libc::S_IFREG {
                continue;
            }
            let mut input = src.open_file(&file).at("read", &src_path.join(&file))?;
            let to_path = root.join(to).join(&file);
            let mut out = into.create_file(&file, 0o644).at("create", &to_path)?;
            std::io::copy(&mut input, &mut out).at("copy", &to_path)?;
        }
    }
    Ok(())
}

/// The build step that installs the staged packages inside gVisor, then leaves the layer as
/// clean as the base (no indexes, no .debs).
pub(crate) fn install_script(packages: &[String]) -> String {
    // Package names are checked by recipe validation: letters, digits and `+-.:` only.
    format!(
        "set -e\n\
         apt-get -q -y --no-download --no-install-recommends -o Dpkg::Use-Pty=0 install {}\n\
         apt-get clean\n\
         find /var/lib/apt/lists -maxdepth 1 -type f ! -name lock -delete\n",
        packages.join(" ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn download_size_sums_print_uris_lines() {
        let out = "Reading package lists...\n\
                   'http://deb.debian.org/debian/pool/main/j/jq/jq_1.6_amd64.deb' jq_1.6_amd64.deb 64000 SHA256:ab\n\
                   'http://deb.debian.org/debian/pool/main/o/onig/libonig5.deb' libonig5.deb 188000 SHA256:cd\n\
                   'garbage' x notanumber\n";
        assert_eq!(download_size(out), 252_000);
        assert_eq!(download_size(""), 0);
    }

    #[test]
    fn the_install_step_never_downloads() {
        let s = install_script(&["jq".into(), "uuid-runtime".into()]);
        assert!(s.contains("--no-download"));
        assert!(s.contains("install jq uuid-runtime\n"));
    }
}
