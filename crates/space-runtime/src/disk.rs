//! Disk quotas for sandboxes' writable layers.
//!
//! A sandbox's writable layer lives in a directory of its own (gVisor keeps its
//! overlay's upper layer in a file there). That directory is the mount point of a
//! small ext4 filesystem in a sparse image file of the quota's size, so a sandbox
//! that fills its disk gets `ENOSPC` inside and the host disk never holds more than
//! the image. gVisor turns the full filesystem into `ENOSPC` for the writer and
//! keeps running (checked on runsc 2024-07-29).
//!
//! Mounts are the one thing here that outlives the process, so every way out
//! (stop, destroy, checkpoint, a restart's clean-up) unmounts; [`unmount_below`]
//! removes whatever a crash left under a directory.

use std::path::{Path, PathBuf};

use space_core::runtime::RuntimeError;
use tokio::process::Command;

/// Image file of a sandbox's disk, in its state directory.
pub const IMAGE_FILE: &str = "disk.img";

/// Room ext4 takes for itself (inode tables, bitmaps); added so a quota of N MiB
/// leaves about N MiB for the sandbox.
fn overhead_mib(mib: u64) -> u64 {
    (mib / 32).max(16)
}

/// Makes sure `mount_point` is the sandbox's quota'd filesystem: creates the image
/// (sparse, `mib` MiB plus overhead) when there is none, then mounts it when it is
/// not mounted. `mib == 0` means no quota: the directory is a plain directory.
pub async fn ensure_mounted(
    image: &Path,
    mount_point: &Path,
    mib: u64,
) -> Result<(), RuntimeError> {
    tokio::fs::create_dir_all(mount_point)
        .await
        .map_err(|e| RuntimeError::io(format!("creating {}", mount_point.display()), e))?;
    if mib == 0 {
        return Ok(());
    }
    if !image.exists() {
        let tmp = image.with_extension("img.tmp");
        let bytes = (mib + overhead_mib(mib)) << 20;
        let file = std::fs::File::create(&tmp)
            .map_err(|e| RuntimeError::io(format!("creating {}", tmp.display()), e))?;
        file.set_len(bytes)
            .map_err(|e| RuntimeError::io(format!("sizing {}", tmp.display()), e))?;
        drop(file);
        // No journal (the layer never outlives a crash of its sandbox), no reserved blocks.
        tool(
            "mkfs.ext4",
            Command::new("mkfs.ext4")
                .args(["-q", "-F", "-O", "^has_journal", "-m", "0"])
                .args(["-E", "nodiscard,lazy_itable_init=1"])
                .arg(&tmp),
        )
        .await?;
        std::fs::rename(&tmp, image)
            .map_err(|e| RuntimeError::io(format!("renaming {}", tmp.display()), e))?;
    }
    if !is_mounted(mount_point) {
        tool(
            "mount",
            Command::new("mount")
                .args(["-t", "ext4", "-o", "loop,nosuid,nodev,noexec"])
                .arg(image)
                .arg(mount_point),
        )
        .await?;
    }
    Ok(())
}

/// Unmounts `mount_point` if it is mounted (lazily when it is busy).
pub async fn unmount(mount_point: &Path) -> Result<(), RuntimeError> {
    if !is_mounted(mount_point) {
        return Ok(());
    }
    if tool("umount", Command::new("umount").arg(mount_point))
        .await
        .is_err()
    {
        tool("umount", Command::new("umount").arg("-l").arg(mount_point)).await?;
    }
    Ok(())
}

/// Unmounts every mount at or below `dir`, deepest first.
pub async fn unmount_below(dir: &Path) -> Result<(), RuntimeError> {
    let dir = &canonical(dir);
    let mut points: Vec<PathBuf> = mount_points()
        .into_iter()
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in points {
        unmount(&p).await?;
    }
    Ok(())
}

/// Unmounts every mount at or below `dir`, deepest first, lazily (a busy mount cannot keep a
/// clean-up from going on) and without waiting on an async runtime: for `Drop`s and blocking
/// threads.
pub(crate) fn detach_below(dir: &Path) {
    let mut points = mounts_below(dir);
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in points {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&p)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// Every mount point at or below `dir`.
pub(crate) fn mounts_below(dir: &Path) -> Vec<PathBuf> {
    let dir = &canonical(dir);
    mount_points()
        .into_iter()
        .filter(|p| p.starts_with(dir))
        .collect()
}

/// Fails when anything is still mounted at or below `dir` (before removing it).
pub fn ensure_nothing_mounted_below(dir: &Path) -> Result<(), RuntimeError> {
    let left = mounts_below(dir);
    if left.is_empty() {
        return Ok(());
    }
    Err(RuntimeError::Tool {
        tool: "umount".into(),
        message: format!("still mounted below {}: {left:?}", dir.display()),
    })
}

/// Bytes in use on the filesystem mounted at `mount_point` (none when it is not a mount).
pub fn used_bytes(mount_point: &Path) -> Option<u64> {
    if !is_mounted(mount_point) {
        return None;
    }
    let path = std::ffi::CString::new(mount_point.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: a valid C string and a zeroed out-parameter of the right type.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return None;
    }
    let used = st.f_blocks.saturating_sub(st.f_bfree);
    Some(used.saturating_mul(st.f_frsize))
}

/// Blocks the image file really takes on the host (it is sparse).
pub fn image_bytes(image: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(image).ok().map(|m| m.blocks() * 512)
}

/// Whether `path` is a mount point of this mount namespace.
pub fn is_mounted(path: &Path) -> bool {
    let path = canonical(path);
    mount_points().contains(&path)
}

/// `path` as the mount table names it: mountinfo has absolute paths without symlinks, and
/// a data directory given as `./data` or through a symlink must still find its mounts.
fn canonical(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

/// Every mount point, from /proc/self/mountinfo (octal escapes decoded).
fn mount_points() -> Vec<PathBuf> {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    info.lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape(p)))
        .collect()
}

/// Decodes mountinfo's `\ooo` escapes (space, tab, newline, backslash).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

async fn tool(name: &str, cmd: &mut Command) -> Result<(), RuntimeError> {
    crate::process::run_tool(name, cmd).await.map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_decoded() {
        assert_eq!(unescape(r"/a\040b\134c"), "/a b\\c");
        assert_eq!(unescape(r"/plain"), "/plain");
        assert_eq!(unescape(r"/short\04"), r"/short\04");
        assert_eq!(unescape(r"/bad\089"), r"/bad\089");
    }

    #[test]
    fn overhead_grows_with_the_quota() {
        assert_eq!(overhead_mib(64), 16);
        assert_eq!(overhead_mib(4096), 128);
    }
}
