//! `space cp` and `space ls`: the file API from the command line.
//!
//! `space cp LOCAL SANDBOX:PATH` uploads a file (raw, keeping its mode) or a
//! directory (as a tar stream; PATH becomes a copy of it). `space cp
//! SANDBOX:PATH LOCAL` downloads a file, or a directory as a tar unpacked into
//! LOCAL without ever following a link out of it. Nothing is held in memory:
//! both directions stream.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use futures::StreamExt;
use space_api::FileType;
use space_client::{Client, UploadOptions};
use tokio::io::AsyncWriteExt;

/// `SANDBOX:PATH`, or a local path.
enum Place {
    Sandbox { id: String, path: String },
    Local(PathBuf),
}

fn place(s: &str) -> Place {
    match s.split_once(':') {
        Some((id, path)) if id.starts_with("sb_") && path.starts_with('/') => Place::Sandbox {
            id: id.to_string(),
            path: path.to_string(),
        },
        _ => Place::Local(PathBuf::from(s)),
    }
}

/// `space cp SRC DST`.
pub async fn cp(src: &str, dst: &str) -> anyhow::Result<i32> {
    let c = Client::from_env()?;
    match (place(src), place(dst)) {
        (Place::Local(local), Place::Sandbox { id, path }) => upload(&c, &local, &id, &path).await,
        (Place::Sandbox { id, path }, Place::Local(local)) => {
            download(&c, &id, &path, &local).await
        }
        (Place::Local(_), Place::Local(_)) => {
            bail!("one side of `space cp` must be SANDBOX:/PATH (e.g. sb_…:/tmp/file)")
        }
        (Place::Sandbox { .. }, Place::Sandbox { .. }) => {
            bail!("copying between sandboxes is not supported; copy through a local path")
        }
    }?;
    Ok(0)
}

async fn upload(c: &Client, local: &Path, id: &str, path: &str) -> anyhow::Result<()> {
    let meta = std::fs::metadata(local).with_context(|| format!("reading {}", local.display()))?;
    if meta.is_file() {
        let mode = meta.permissions().mode() & 0o7777;
        let file = tokio::fs::File::open(local)
            .await
            .with_context(|| format!("opening {}", local.display()))?;
        let body = reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::new(file));
        let opts = UploadOptions {
            mode: Some(mode),
            content_length: Some(meta.len()),
            ..Default::default()
        };
        c.upload_file(id, path, body, &opts).await?;
        eprintln!("{} → {id}:{path} ({} bytes)", local.display(), meta.len());
        return Ok(());
    }
    if !meta.is_dir() {
        bail!("{} is neither a file nor a directory", local.display());
    }
    // A tar of the directory, written by a blocking thread into a bounded pipe.
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Vec<u8>>>(8);
    let dir = local.to_path_buf();
    let writer = tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        let mut b = tar::Builder::new(ChannelWriter(tx.clone()));
        b.follow_symlinks(false);
        b.mode(tar::HeaderMode::Complete);
        let result = b.append_dir_all(".", &dir).and_then(|_| b.finish());
        if let Err(e) = &result {
            let _ = tx.blocking_send(Err(std::io::Error::new(e.kind(), e.to_string())));
        }
        result.with_context(|| format!("packing {}", dir.display()))
    });
    let body = reqwest::Body::wrap_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    let stats = c.upload_tar(id, path, body, false).await;
    // A failed pack is the cause of whatever the server then said.
    writer.await??;
    let stats = stats?;
    eprintln!(
        "{} → {id}:{path} ({} entries, {} bytes)",
        local.display(),
        stats.entries,
        stats.bytes
    );
    Ok(())
}

/// Feeds tar output into the upload stream.
struct ChannelWriter(tokio::sync::mpsc::Sender<std::io::Result<Vec<u8>>>);

impl std::io::Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .blocking_send(Ok(buf.to_vec()))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "upload ended"))?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

async fn download(c: &Client, id: &str, path: &str, local: &Path) -> anyhow::Result<()> {
    let info = c.stat_file(id, path).await?;
    if info.kind == FileType::Dir {
        let mut stream = c.download_tar(id, path, false).await?;
        std::fs::create_dir_all(local).with_context(|| format!("creating {}", local.display()))?;
        let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Vec<u8>>>(8);
        let dst = local.to_path_buf();
        let unpack = tokio::task::spawn_blocking(move || -> anyhow::Result<u64> {
            let mut a = tar::Archive::new(space_service::ChannelReader::new(rx));
            a.set_preserve_permissions(true);
            a.set_overwrite(true);
            let mut n = 0;
            for entry in a.entries()? {
                let mut entry = entry?;
                // `unpack_in` refuses names that leave `dst`, and links that would lead out of it.
                if !entry.unpack_in(&dst)? {
                    bail!(
                        "the sandbox sent an entry outside the target: {}",
                        String::from_utf8_lossy(&entry.path_bytes())
                    );
                }
                n += 1;
            }
            Ok(n)
        });
        while let Some(chunk) = stream.next().await {
            let item = chunk
                .map(|c| c.to_vec())
                .map_err(|e| std::io::Error::other(format!("reading the download: {}", chain(&e))));
            let failed = item.is_err();
            if tx.send(item).await.is_err() || failed {
                break;
            }
        }
        drop(tx);
        let n = unpack.await??;
        eprintln!("{id}:{path} → {} ({n} entries)", local.display());
        return Ok(());
    }
    if info.kind != FileType::File {
        bail!("{path} is a {}, not a file or directory", info.kind);
    }
    let target = if local.is_dir() {
        let name = Path::new(path)
            .file_name()
            .context("the sandbox path has no file name")?;
        local.join(name)
    } else {
        local.to_path_buf()
    };
    let mut stream = c.download_file(id, path).await?.body;
    let tmp = target.with_extension("space-partial");
    let mut file = tokio::fs::File::create(&tmp)
        .await
        .with_context(|| format!("creating {}", tmp.display()))?;
    let mut n = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.context("reading the download")?;
        n += chunk.len() as u64;
        file.write_all(&chunk).await?;
    }
    file.flush().await?;
    drop(file);
    if n != info.size {
        let _ = std::fs::remove_file(&tmp);
        bail!(
            "{path} changed during the download ({n} bytes, expected {})",
            info.size
        );
    }
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(info.mode & 0o777))?;
    std::fs::rename(&tmp, &target)?;
    eprintln!("{id}:{path} → {} ({n} bytes)", target.display());
    Ok(())
}

/// An error and its causes on one line, as `space: …` prints them.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(&format!(": {c}"));
        cause = c.source();
    }
    s
}

/// `space ls SANDBOX:PATH`.
pub async fn ls(target: &str, depth: u32) -> anyhow::Result<i32> {
    let Place::Sandbox { id, path } = place(target) else {
        bail!("usage: space ls SANDBOX:/PATH");
    };
    let c = Client::from_env()?;
    let list = c.list_files(&id, &path, Some(depth)).await?;
    for e in &list.entries {
        let kind = match e.kind {
            FileType::Dir => 'd',
            FileType::Symlink => 'l',
            FileType::File => '-',
            FileType::Other => '?',
        };
        let link = e
            .link_target
            .as_deref()
            .map(|t| format!(" -> {t}"))
            .unwrap_or_default();
        println!(
            "{kind}{:04o} {:>5}:{:<5} {:>12} {}{link}",
            e.mode, e.uid, e.gid, e.size, e.path
        );
    }
    if list.truncated {
        eprintln!("(listing truncated)");
    }
    Ok(0)
}
