//! Disk images of the microVM driver: one ext4 image per template rootfs (made once, cached,
//! shared read-only by every sandbox as the backing file of its qcow2 overlay), the overlay
//! itself, and the guest's initramfs with the agent appended (cached per agent binary).
//!
//! Cache entries are made under an flock(2) in a temporary file and renamed into place, so a
//! reader sees a whole image or none, and two servers sharing the cache build each once.
//! Entries are never changed once made (their key names everything they were made from).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use space_core::runtime::RuntimeError;
use tokio::process::Command;

use crate::process::run_tool;

/// Room added to a template's size for the image: filesystem metadata and the journal.
const IMAGE_SLACK_MIB: u64 = 64;
/// Bytes per inode in a fresh image (mke2fs's default for ordinary filesystems).
const BYTES_PER_INODE: u64 = 16 * 1024;

/// Makes (once) the ext4 image of a template's root directory and returns its path.
pub async fn rootfs_image(images_dir: &Path, rootfs: &Path) -> Result<PathBuf, RuntimeError> {
    let key = rootfs_key(rootfs)?;
    let image = images_dir.join(format!("rootfs-{key}.ext4"));
    if image.is_file() {
        return Ok(image);
    }
    let lock_path = images_dir.join(format!(".rootfs-{key}.lock"));
    let made = made_once(&image, &lock_path, |tmp| async move {
        make_image(rootfs, &tmp).await
    })
    .await?;
    if let Some(mib) = made {
        tracing::info!(image = %image.display(), rootfs = %rootfs.display(), mib, "made a template disk image");
    }
    Ok(image)
}

/// Makes `path` once: unless it exists, `make` writes a temporary file under the lock at
/// `lock_path` (so concurrent callers make it once), which is then fsynced and renamed to
/// `path`, or removed when `make` fails. What `make` returned, when this call made it.
async fn made_once<T, F>(
    path: &Path,
    lock_path: &Path,
    make: impl FnOnce(PathBuf) -> F,
) -> Result<Option<T>, RuntimeError>
where
    F: std::future::Future<Output = Result<T, RuntimeError>>,
{
    if path.is_file() {
        return Ok(None);
    }
    let _lock = lock(lock_path).await?;
    if path.is_file() {
        return Ok(None);
    }
    let tmp = temp_path(path);
    match make(tmp.clone()).await {
        Ok(made) => {
            finish(&tmp, path)?;
            Ok(Some(made))
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// `image` grown to `size_mib` MiB: a sparse copy whose ext4 the host's `resize2fs` has grown
/// to fill it, made once per image and size and kept beside the image. A guest booted on an
/// overlay of it has nothing to grow (under TCG the guest's own `resize2fs` took about 0.15 s
/// of every boot). `image` itself when it is already that big.
pub async fn grown_image(image: &Path, size_mib: u64) -> Result<PathBuf, RuntimeError> {
    let len = std::fs::metadata(image)
        .map_err(|e| RuntimeError::io(format!("reading {}", image.display()), e))?
        .len();
    if size_mib.saturating_mul(1 << 20) <= len {
        return Ok(image.to_path_buf());
    }
    let stem = image.file_stem().and_then(|s| s.to_str()).ok_or_else(|| {
        RuntimeError::io(
            format!("naming a copy of {}", image.display()),
            std::io::ErrorKind::InvalidInput.into(),
        )
    })?;
    let grown = image.with_file_name(format!("{stem}-{size_mib}m.ext4"));
    let lock_path = image.with_file_name(format!(".{stem}-{size_mib}m.lock"));
    let made = made_once(&grown, &lock_path, |tmp| async move {
        let from = image.to_path_buf();
        tokio::task::spawn_blocking({
            let tmp = tmp.clone();
            move || {
                crate::disk::copy_sparse(&from, &tmp)?;
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&tmp)?
                    .set_len(size_mib << 20)
            }
        })
        .await
        .map_err(std::io::Error::other)
        .and_then(|r| r)
        .map_err(|e| RuntimeError::io(format!("copying {}", image.display()), e))?;
        // The copy was never mounted: resize2fs may grow it without a check first.
        run_tool("resize2fs", Command::new("resize2fs").arg("-f").arg(&tmp)).await?;
        Ok(())
    })
    .await?;
    if made.is_some() {
        tracing::info!(image = %grown.display(), size_mib, "grew a template disk image");
    }
    Ok(grown)
}

/// Makes an ext4 image of `rootfs` at `out` (not cached: a build step's own disk, removed
/// with the step). Returns its size in MiB.
pub async fn private_image(rootfs: &Path, out: &Path) -> Result<u64, RuntimeError> {
    make_image(rootfs, out).await
}

/// Writes the ext4 image of `rootfs` to `out` (removed again when that fails); its size
/// in MiB.
async fn make_image(rootfs: &Path, out: &Path) -> Result<u64, RuntimeError> {
    let root = rootfs.to_path_buf();
    let (bytes, inodes) = tokio::task::spawn_blocking(move || tree_usage(&root))
        .await
        .map_err(|e| RuntimeError::io("measuring the template", std::io::Error::other(e)))?;
    let mib = image_mib(bytes);
    // Enough inodes for the template and for what sandboxes add; resize2fs in the guest
    // keeps the per-group ratio when it grows the filesystem.
    let inodes = ((mib << 20) / BYTES_PER_INODE).max(inodes + inodes / 3 + 2048);
    let made = run_tool(
        "mkfs.ext4",
        Command::new("mkfs.ext4")
            .args([
                "-q",
                "-F",
                "-L",
                "space-root",
                "-b",
                "4096",
                "-I",
                "256",
                "-m",
                "0",
            ])
            .arg("-N")
            .arg(inodes.to_string())
            .arg("-d")
            .arg(rootfs)
            .arg(out)
            .arg(format!("{mib}M")),
    )
    .await;
    if let Err(e) = made {
        let _ = std::fs::remove_file(out);
        return Err(e);
    }
    Ok(mib)
}

/// Makes the per-sandbox qcow2 overlay of `image`, `size_mib` MiB virtual (the sandbox's disk).
pub async fn overlay(
    qemu_img: &Path,
    image: &Path,
    overlay: &Path,
    size_mib: u64,
) -> Result<(), RuntimeError> {
    let tmp = temp_path(overlay);
    let made = run_tool(
        "qemu-img create",
        Command::new(qemu_img)
            .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
            .arg(image)
            .arg(&tmp)
            .arg(format!("{size_mib}M")),
    )
    .await;
    if let Err(e) = made {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, overlay)
        .map_err(|e| RuntimeError::io(format!("renaming {}", tmp.display()), e))
}

/// The guest's initramfs with `agent` appended (made once per guest and agent binary).
pub async fn initramfs(
    images_dir: &Path,
    guest_dir: &Path,
    agent: &Path,
) -> Result<PathBuf, RuntimeError> {
    let base = guest_dir.join(super::GUEST_INITRAMFS);
    let mut h = Sha256::new();
    for path in [
        &base,
        &guest_dir.join(super::GUEST_VERSION),
        &agent.to_path_buf(),
    ] {
        let m = std::fs::metadata(path)
            .map_err(|e| RuntimeError::io(format!("reading {}", path.display()), e))?;
        h.update(path.as_os_str().as_encoded_bytes());
        h.update([0]);
        h.update(m.dev().to_le_bytes());
        h.update(m.ino().to_le_bytes());
        h.update(m.size().to_le_bytes());
        h.update(m.mtime().to_le_bytes());
        h.update(m.mtime_nsec().to_le_bytes());
    }
    let key = hex16(&h.finalize());
    let out = images_dir.join(format!("initramfs-{key}.cpio.gz"));
    if out.is_file() {
        return Ok(out);
    }
    let _lock = lock(&images_dir.join(format!(".initramfs-{key}.lock"))).await?;
    if out.is_file() {
        return Ok(out);
    }
    // Atomic by itself (temporary file, then rename).
    let (b, a, o) = (base.clone(), agent.to_path_buf(), out.clone());
    let made = tokio::task::spawn_blocking(move || crate::guest::initramfs_with_agent(&b, &a, &o))
        .await
        .map_err(|e| RuntimeError::io("appending the agent", std::io::Error::other(e)))?;
    made.map_err(|e| {
        RuntimeError::io(
            format!("appending {} to {}", agent.display(), base.display()),
            e,
        )
    })?;
    Ok(out)
}

/// Key of a template rootfs: its path and the identity of what says it is complete
/// (`../template.json`), or of the directory itself for a layer without one. Templates are
/// immutable, so a rebuilt template gets a new key.
fn rootfs_key(rootfs: &Path) -> Result<String, RuntimeError> {
    let dir = std::fs::metadata(rootfs)
        .map_err(|e| RuntimeError::io(format!("reading {}", rootfs.display()), e))?;
    if !dir.is_dir() {
        return Err(RuntimeError::Unsupported(format!(
            "template rootfs {} is not a directory",
            rootfs.display()
        )));
    }
    let meta = rootfs
        .parent()
        .map(|p| p.join("template.json"))
        .and_then(|p| std::fs::metadata(p).ok());
    let mut h = Sha256::new();
    h.update(rootfs.as_os_str().as_encoded_bytes());
    h.update([0]);
    match meta {
        Some(m) => {
            h.update(b"template.json");
            h.update(m.ino().to_le_bytes());
            h.update(m.size().to_le_bytes());
            h.update(m.mtime().to_le_bytes());
            h.update(m.mtime_nsec().to_le_bytes());
        }
        None => {
            h.update(b"dir");
            h.update(dir.dev().to_le_bytes());
            h.update(dir.ino().to_le_bytes());
            h.update(dir.mtime().to_le_bytes());
            h.update(dir.mtime_nsec().to_le_bytes());
        }
    }
    Ok(hex16(&h.finalize()))
}

/// Free space of the ext4 filesystem in `image`, MiB (from its superblock; `None` when
/// `dumpe2fs` cannot tell).
pub async fn ext4_free_mib(image: &Path) -> Option<u64> {
    let out = tokio::process::Command::new("dumpe2fs")
        .arg("-h")
        .arg(image)
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .await
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let field = |name: &str| -> Option<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
    };
    let free = field("Free blocks:")?;
    let block = field("Block size:")?;
    Some(free.saturating_mul(block) >> 20)
}

/// Image size for a tree of `bytes`: 1.2 × its size plus 64 MiB, in whole MiB.
pub fn image_mib(bytes: u64) -> u64 {
    let mib = bytes.div_ceil(1 << 20);
    mib + mib.div_ceil(5) + IMAGE_SLACK_MIB
}

/// Allocated bytes (hard links once) and inode count of a directory tree; symlinks not followed.
fn tree_usage(root: &Path) -> (u64, u64) {
    let mut seen = std::collections::HashSet::new();
    let (mut bytes, mut inodes) = (0u64, 0u64);
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(m) = e.metadata() else { continue };
            if m.nlink() > 1 && !m.is_dir() && !seen.insert((m.dev(), m.ino())) {
                continue;
            }
            inodes += 1;
            // ext4 rounds every file up to its 4 KiB block.
            bytes += (m.blocks() * 512).max(m.len().next_multiple_of(4096));
            if m.is_dir() {
                stack.push(e.path());
            }
        }
    }
    (bytes, inodes)
}

/// A held flock(2); released when dropped (the descriptor closes).
struct Lock(#[allow(dead_code)] std::fs::File);

async fn lock(path: &Path) -> Result<Lock, RuntimeError> {
    use std::os::fd::AsRawFd;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| RuntimeError::io(format!("opening {}", path.display()), e))?;
    let ctx = format!("locking {}", path.display());
    tokio::task::spawn_blocking(move || {
        // SAFETY: flock on a descriptor we own; blocks this pool thread until it is ours.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Lock(file))
    })
    .await
    .map_err(|e| RuntimeError::io(ctx.clone(), std::io::Error::other(e)))?
    .map_err(|e| RuntimeError::io(ctx, e))
}

fn temp_path(path: &Path) -> PathBuf {
    let mut random = [0u8; 6];
    let _ = getrandom::getrandom(&mut random);
    let hex: String = random.iter().map(|b| format!("{b:02x}")).collect();
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{hex}"));
    path.with_file_name(name)
}

/// fsyncs `tmp` and renames it to `path`.
fn finish(tmp: &Path, path: &Path) -> Result<(), RuntimeError> {
    let synced = std::fs::File::open(tmp).and_then(|f| f.sync_all());
    if let Err(e) = synced.and_then(|()| std::fs::rename(tmp, path)) {
        let _ = std::fs::remove_file(tmp);
        return Err(RuntimeError::io(format!("finishing {}", path.display()), e));
    }
    Ok(())
}

fn hex16(digest: &[u8]) -> String {
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_grown_image_fills_its_size_and_is_made_once() {
        let dir = std::env::temp_dir().join(format!("space-grown-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("tree")).unwrap();
        std::fs::write(dir.join("tree/hello"), "hi").unwrap();
        let base = dir.join("rootfs-test.ext4");
        make_image(&dir.join("tree"), &base).await.unwrap();
        let base_len = std::fs::metadata(&base).unwrap().len();
        let blocks = |image: &Path| {
            let out = std::process::Command::new("dumpe2fs")
                .arg("-h")
                .arg(image)
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            text.lines()
                .find_map(|l| l.strip_prefix("Block count:"))
                .map(|v| v.trim().parse::<u64>().unwrap())
                .unwrap()
        };

        // Not bigger than the image: the image itself.
        assert_eq!(grown_image(&base, base_len >> 20).await.unwrap(), base);
        let size_mib = (base_len >> 20) + 100;
        let grown = grown_image(&base, size_mib).await.unwrap();
        assert_eq!(grown, dir.join(format!("rootfs-test-{size_mib}m.ext4")));
        assert_eq!(std::fs::metadata(&grown).unwrap().len(), size_mib << 20);
        assert_eq!(
            blocks(&grown),
            (size_mib << 20) / 4096,
            "the filesystem fills it"
        );
        assert_eq!(
            blocks(&base),
            base_len / 4096,
            "the image is left as it was"
        );
        let made = std::fs::metadata(&grown).unwrap().modified().unwrap();
        assert_eq!(grown_image(&base, size_mib).await.unwrap(), grown);
        assert_eq!(std::fs::metadata(&grown).unwrap().modified().unwrap(), made);
        // No temporary file is left beside them.
        let mut names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| !n.starts_with('.'))
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                format!("rootfs-test-{size_mib}m.ext4"),
                "rootfs-test.ext4".into(),
                "tree".into()
            ]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn image_is_a_fifth_larger_plus_slack() {
        assert_eq!(image_mib(0), 64);
        assert_eq!(image_mib(1), 66);
        assert_eq!(image_mib(100 << 20), 184);
    }
}
