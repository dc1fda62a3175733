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
///
/// A new image is a copy of an empty filesystem of the same size that `formats` keeps
/// (made by `mkfs.ext4` the first time a size is asked for): copying its few MiB of
/// metadata is faster than formatting, and a create waits for it.
pub async fn ensure_mounted(
    image: &Path,
    mount_point: &Path,
    mib: u64,
    formats: &Path,
) -> Result<(), RuntimeError> {
    tokio::fs::create_dir_all(mount_point)
        .await
        .map_err(|e| RuntimeError::io(format!("creating {}", mount_point.display()), e))?;
    if mib == 0 {
        return Ok(());
    }
    if !image.exists() {
        let bytes = (mib + overhead_mib(mib)) << 20;
        let empty = empty_format(formats, bytes).await?;
        let (src, dst) = (empty, image.to_path_buf());
        tokio::task::spawn_blocking(move || copy_sparse(&src, &dst))
            .await
            .map_err(std::io::Error::other)
            .and_then(|r| r)
            .map_err(|e| RuntimeError::io(format!("creating {}", image.display()), e))?;
    }
    if !is_mounted(mount_point) {
        mount_loop(
            image,
            mount_point,
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        )
        .await?;
    }
    Ok(())
}

/// Mounts the ext4 filesystem in the file `image` at `mount_point` with `flags`, through a
/// loop device that goes when the mount does (autoclear), as `mount -o loop` does, but in
/// system calls: a `mount(8)` process took 12–20 ms of every create on a loaded 2-core
/// host, the calls 4–11 ms. Where the kernel has no `LOOP_CONFIGURE` (before Linux 5.8) or no
/// `/dev/loopN` node appears, `mount(8)` does it.
pub(crate) async fn mount_loop(
    image: &Path,
    mount_point: &Path,
    flags: libc::c_ulong,
) -> Result<(), RuntimeError> {
    let (file, point) = (image.to_path_buf(), mount_point.to_path_buf());
    let direct =
        match tokio::task::spawn_blocking(move || loop_mount_now(&file, &point, flags)).await {
            Ok(r) => r,
            Err(e) => Err(LoopError::Failed(std::io::Error::other(e))),
        };
    let unsupported = match direct {
        Ok(()) => return Ok(()),
        Err(LoopError::Unsupported(e)) => e,
        Err(LoopError::Failed(e)) => {
            return Err(RuntimeError::io(
                format!("mounting {} at {}", image.display(), mount_point.display()),
                e,
            ))
        }
    };
    tracing::debug!(error = %unsupported, "no loop device by system calls; using mount(8)");
    let mut options = String::from("loop");
    for (flag, name) in [
        (libc::MS_NOSUID, "nosuid"),
        (libc::MS_NODEV, "nodev"),
        (libc::MS_NOEXEC, "noexec"),
    ] {
        if flags & flag != 0 {
            options.push(',');
            options.push_str(name);
        }
    }
    tool(
        "mount",
        Command::new("mount")
            .args(["-t", "ext4", "-o", &options])
            .arg(image)
            .arg(mount_point),
    )
    .await
}

/// Why [`loop_mount_now`] did not mount: the host cannot do it this way, or the mount failed.
enum LoopError {
    Unsupported(std::io::Error),
    Failed(std::io::Error),
}

/// `<linux/loop.h>`: `LOOP_CTL_GET_FREE`, `LOOP_CONFIGURE`, `LO_FLAGS_AUTOCLEAR`.
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LO_FLAGS_AUTOCLEAR: u32 = 4;

/// `struct loop_config` of `<linux/loop.h>` (304 bytes), with its `struct loop_info64` laid out
/// in place: only the backing file and the flags are set here.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    /// `lo_device`, `lo_inode`, `lo_rdevice`, `lo_offset`, `lo_sizelimit`.
    info_u64: [u64; 5],
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    /// `lo_file_name`, `lo_crypt_name`, `lo_encrypt_key`.
    info_bytes: [u8; 160],
    lo_init: [u64; 2],
    reserved: [u64; 8],
}

/// How often a free loop device is asked for again when another mount took it first.
const LOOP_ATTEMPTS: usize = 16;

/// [`mount_loop`]'s system calls, on a blocking thread.
fn loop_mount_now(image: &Path, mount_point: &Path, flags: libc::c_ulong) -> Result<(), LoopError> {
    use std::os::fd::AsRawFd;
    let open_rw = |p: &Path| std::fs::OpenOptions::new().read(true).write(true).open(p);
    let control = open_rw(Path::new("/dev/loop-control")).map_err(LoopError::Unsupported)?;
    let backing = open_rw(image).map_err(LoopError::Failed)?;
    for _ in 0..LOOP_ATTEMPTS {
        // SAFETY: an ioctl without arguments on a descriptor owned here.
        let n = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE) };
        if n < 0 {
            return Err(LoopError::Unsupported(std::io::Error::last_os_error()));
        }
        let device = PathBuf::from(format!("/dev/loop{n}"));
        let dev = match open_rw(&device) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(LoopError::Unsupported(e))
            }
            Err(e) => return Err(LoopError::Failed(e)),
        };
        let config = LoopConfig {
            fd: backing.as_raw_fd() as u32,
            block_size: 0,
            info_u64: [0; 5],
            lo_number: 0,
            lo_encrypt_type: 0,
            lo_encrypt_key_size: 0,
            lo_flags: LO_FLAGS_AUTOCLEAR,
            info_bytes: [0; 160],
            lo_init: [0; 2],
            reserved: [0; 8],
        };
        // SAFETY: the ioctl reads a `struct loop_config`, which `LoopConfig` lays out.
        let rc = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CONFIGURE, &config) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                // Another mount configured this device between our two calls: ask again.
                Some(libc::EBUSY) => continue,
                Some(libc::EINVAL | libc::ENOTTY) => return Err(LoopError::Unsupported(e)),
                _ => return Err(LoopError::Failed(e)),
            }
        }
        // The mount holds the device from here; when the mount goes and the last descriptor
        // (`dev`, closed on return) is gone, autoclear frees it.
        return sys_mount(Some(&device), mount_point, Some("ext4"), flags, None)
            .map_err(LoopError::Failed);
    }
    Err(LoopError::Failed(std::io::Error::other(format!(
        "no free loop device in {LOOP_ATTEMPTS} tries"
    ))))
}

/// The empty filesystem of `bytes` in `formats`, formatted now if it is not there yet.
/// Only the server writes there; a sandbox only ever gets a copy.
async fn empty_format(formats: &Path, bytes: u64) -> Result<PathBuf, RuntimeError> {
    let path = formats.join(format!("ext4-{bytes}.img"));
    if path.exists() {
        return Ok(path);
    }
    std::fs::create_dir_all(formats)
        .map_err(|e| RuntimeError::io(format!("creating {}", formats.display()), e))?;
    // Concurrent first creates of one size each format their own and rename: the last wins,
    // and every one of them is whole.
    let tmp = crate::guest::temp_path(&path);
    let file = std::fs::File::create(&tmp)
        .map_err(|e| RuntimeError::io(format!("creating {}", tmp.display()), e))?;
    file.set_len(bytes)
        .map_err(|e| RuntimeError::io(format!("sizing {}", tmp.display()), e))?;
    drop(file);
    // No journal (the layer never outlives a crash of its sandbox), no reserved blocks.
    let made = tool(
        "mkfs.ext4",
        Command::new("mkfs.ext4")
            .args(["-q", "-F", "-O", "^has_journal", "-m", "0"])
            .args(["-E", "nodiscard,lazy_itable_init=1"])
            .arg(&tmp),
    )
    .await;
    if let Err(e) = made {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, &path)
        .map_err(|e| RuntimeError::io(format!("renaming {}", tmp.display()), e))?;
    Ok(path)
}

/// Copies `src` to a new file `dst` (written beside it, then renamed), holes kept as holes:
/// only the extents that hold data are read and written, by the kernel.
pub(crate) fn copy_sparse(src: &Path, dst: &Path) -> std::io::Result<()> {
    let tmp = dst.with_extension("img.tmp");
    let copied = copy_extents(src, &tmp).and_then(|()| std::fs::rename(&tmp, dst));
    if copied.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    copied
}

/// The data extents of `src` copied into a new file `tmp` of the same length, holes kept.
fn copy_extents(src: &Path, tmp: &Path) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;

    let from = std::fs::File::open(src)?;
    let len = from.metadata()?.len();
    let to = std::fs::File::create(tmp)?;
    to.set_len(len)?;
    let seek = |whence, at: u64| -> std::io::Result<Option<u64>> {
        let at = i64::try_from(at).map_err(std::io::Error::other)?;
        // SAFETY: plain lseek on a descriptor owned here.
        let got = unsafe { libc::lseek(from.as_raw_fd(), at, whence) };
        if got >= 0 {
            return Ok(Some(got as u64));
        }
        let e = std::io::Error::last_os_error();
        // ENXIO: no data at or after `at`.
        if e.raw_os_error() == Some(libc::ENXIO) {
            return Ok(None);
        }
        Err(e)
    };
    let mut at = 0;
    while at < len {
        let Some(data) = seek(libc::SEEK_DATA, at)? else {
            break;
        };
        let end = seek(libc::SEEK_HOLE, data)?.unwrap_or(len).min(len);
        let (mut off_in, mut off_out) = (data as i64, data as i64);
        let mut left = (end - data) as usize;
        while left > 0 {
            // SAFETY: both descriptors are owned here; the offsets are ours.
            let n = unsafe {
                libc::copy_file_range(
                    from.as_raw_fd(),
                    &mut off_in,
                    to.as_raw_fd(),
                    &mut off_out,
                    left,
                    0,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("{} ended early", src.display()),
                ));
            }
            left -= n as usize;
        }
        at = end;
    }
    Ok(())
}

/// Unmounts `mount_point` if it is mounted (lazily when it is busy).
pub async fn unmount(mount_point: &Path) -> Result<(), RuntimeError> {
    if !is_mounted(mount_point) {
        return Ok(());
    }
    let point = mount_point.to_path_buf();
    tokio::task::spawn_blocking(move || {
        umount(&point, 0).or_else(|_| umount(&point, libc::MNT_DETACH))
    })
    .await
    .map_err(std::io::Error::other)
    .and_then(|r| r)
    .map_err(|e| RuntimeError::io(format!("unmounting {}", mount_point.display()), e))
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
        let _ = umount(&p, libc::MNT_DETACH);
    }
}

/// `umount2(2)` of `path` with `flags`.
pub(crate) fn umount(path: &Path, flags: libc::c_int) -> std::io::Result<()> {
    let p = c_path(path)?;
    // SAFETY: a valid C string.
    if unsafe { libc::umount2(p.as_ptr(), flags) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `mount(2)`: `src` (a device, a directory to bind, or a name for the table) at `dst`.
pub(crate) fn sys_mount(
    src: Option<&Path>,
    dst: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> std::io::Result<()> {
    use std::ffi::CString;
    let src = src.map(c_path).transpose()?;
    let dst = c_path(dst)?;
    let fstype = fstype.map(CString::new).transpose()?;
    let data = data.map(CString::new).transpose()?;
    let ptr = |c: &Option<CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: valid C strings or null pointers, which mount(2) accepts for these arguments.
    let rc = unsafe {
        libc::mount(
            ptr(&src),
            dst.as_ptr(),
            ptr(&fstype),
            flags,
            ptr(&data).cast(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `p` as a C string (a path with a NUL in it is an error).
pub(crate) fn c_path(p: &Path) -> std::io::Result<std::ffi::CString> {
    std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).map_err(std::io::Error::other)
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
    match is_mount_root(path) {
        Some(root) => root,
        None => mount_points().contains(&canonical(path)),
    }
}

/// Whether `path` (its last symlink followed, as [`canonical`] does) is the root of a
/// mount, from `statx`'s mount-root attribute; `None` where the kernel does not say (before
/// Linux 5.8) or `statx` fails otherwise. Reading the whole mount table instead cost about
/// a tenth of the server's CPU in a burst of creates, and grows with the sandboxes: each
/// has five mounts, and the cost sampler asks about every sandbox's disk every 5 s.
fn is_mount_root(path: &Path) -> Option<bool> {
    let c = c_path(path).ok()?;
    // SAFETY: a zeroed plain-data out-parameter of the right type.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: a valid C string and out-parameter; statx writes nothing else.
    let r = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::AT_NO_AUTOMOUNT,
            0,
            &mut st,
        )
    };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        // Nothing is mounted where nothing is (a missing path, or a file named as a directory).
        return matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR)).then_some(false);
    }
    let bit = libc::STATX_ATTR_MOUNT_ROOT as u64;
    (st.stx_attributes_mask & bit != 0).then_some(st.stx_attributes & bit != 0)
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
    fn a_mount_point_is_known_as_the_mount_table_knows_it() {
        // SAFETY: plain syscall.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: mounting needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let at = |name: &str| dir.path().join(name);
        for d in ["tmpfs", "bind", "plain"] {
            std::fs::create_dir(at(d)).unwrap();
        }
        std::fs::write(at("file"), b"x").unwrap();
        std::os::unix::fs::symlink(at("tmpfs"), at("link")).unwrap();
        // Whatever way the test ends, nothing stays mounted.
        struct Unmount(Vec<PathBuf>);
        impl Drop for Unmount {
            fn drop(&mut self) {
                for p in &self.0 {
                    let _ = umount(p, libc::MNT_DETACH);
                }
            }
        }
        let _unmount = Unmount(vec![at("bind"), at("tmpfs")]);
        sys_mount(
            Some(Path::new("space-test")),
            &at("tmpfs"),
            Some("tmpfs"),
            0,
            Some("size=64k"),
        )
        .unwrap();
        // A bind of a directory of the same filesystem: same device as its parent.
        sys_mount(Some(&at("plain")), &at("bind"), None, libc::MS_BIND, None).unwrap();
        let cases = [
            ("tmpfs", true),
            ("bind", true),
            ("link", true),
            ("plain", false),
            ("file", false),
            ("missing", false),
            ("file/below", false),
        ];
        let check = |mounted: &[&str]| {
            for (name, _) in cases {
                let want = mounted.contains(&name);
                assert_eq!(is_mount_root(&at(name)), Some(want), "{name}");
                assert_eq!(is_mounted(&at(name)), want, "{name}");
                assert_eq!(
                    mount_points().contains(&canonical(&at(name))),
                    want,
                    "the mount table on {name}"
                );
            }
        };
        let mounted: Vec<&str> = cases.iter().filter(|c| c.1).map(|c| c.0).collect();
        check(&mounted);
        umount(&at("bind"), 0).unwrap();
        umount(&at("tmpfs"), 0).unwrap();
        check(&[]);
    }

    #[test]
    fn overhead_grows_with_the_quota() {
        assert_eq!(overhead_mib(64), 16);
        assert_eq!(overhead_mib(4096), 128);
    }

    #[test]
    fn a_sparse_copy_keeps_the_bytes_and_the_holes() {
        use std::io::{Seek, SeekFrom, Write};
        use std::os::unix::fs::MetadataExt;

        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("src.img"), dir.path().join("dst.img"));
        let mut f = std::fs::File::create(&src).unwrap();
        f.set_len(256 << 20).unwrap();
        // Data at the start, in the middle, and up to the very end.
        for (at, byte) in [(0u64, 1u8), (100 << 20, 2), ((256 << 20) - 4096, 3)] {
            f.seek(SeekFrom::Start(at)).unwrap();
            f.write_all(&vec![byte; 4096]).unwrap();
        }
        drop(f);
        copy_sparse(&src, &dst).unwrap();
        assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&dst).unwrap());
        let meta = std::fs::metadata(&dst).unwrap();
        assert_eq!(meta.len(), 256 << 20);
        // 12 KiB of data: far from the 256 MiB a dense copy would take.
        assert!(meta.blocks() * 512 < 1 << 20, "{} blocks", meta.blocks());
        assert!(!dir.path().join("dst.img.tmp").exists());
    }

    /// The backing files of the host's loop devices.
    fn loop_backing_files() -> Vec<PathBuf> {
        let Ok(devices) = std::fs::read_dir("/sys/block") else {
            return Vec::new();
        };
        devices
            .flatten()
            .filter_map(|d| std::fs::read_to_string(d.path().join("loop/backing_file")).ok())
            .map(|f| PathBuf::from(f.trim()))
            .collect()
    }

    #[tokio::test]
    async fn loop_mounts_made_at_once_each_get_a_device_that_goes_with_the_mount() {
        // SAFETY: plain syscall.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipping: mounts need root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let base = canonical(dir.path());
        let formats = base.join("formats");
        let disks: Vec<(PathBuf, PathBuf)> = (0..4)
            .map(|i| (base.join(format!("{i}.img")), base.join(format!("mnt{i}"))))
            .collect();
        // Four at once: they race for free loop devices and for the empty format.
        let mounted = futures::future::join_all(disks.iter().map(|(image, point)| {
            let formats = formats.clone();
            async move { ensure_mounted(image, point, 32, &formats).await }
        }))
        .await;
        assert!(mounted.iter().all(Result::is_ok), "{mounted:?}");
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        for (i, (image, point)) in disks.iter().enumerate() {
            assert!(is_mounted(point), "{}", point.display());
            let line = info
                .lines()
                .find(|l| l.split(' ').nth(4) == Some(point.to_str().unwrap()))
                .unwrap();
            let options = line.split(' ').nth(5).unwrap();
            for flag in ["nosuid", "nodev", "noexec"] {
                assert!(options.split(',').any(|o| o == flag), "{line}");
            }
            assert!(line.contains(" - ext4 /dev/loop"), "{line}");
            std::fs::write(point.join("f"), i.to_string()).unwrap();
            assert!(loop_backing_files().contains(image), "{}", image.display());
        }
        // Every mount sits on its own image: what one wrote is not in another.
        for (i, (_, point)) in disks.iter().enumerate() {
            assert_eq!(
                std::fs::read_to_string(point.join("f")).unwrap(),
                i.to_string()
            );
        }
        // On this host the system calls do it, not mount(8).
        let (image, point) = &disks[0];
        unmount(point).await.unwrap();
        let direct = loop_mount_now(image, point, libc::MS_NOSUID);
        assert!(
            direct.is_ok(),
            "{:?}",
            direct.err().map(|e| match e {
                LoopError::Unsupported(e) | LoopError::Failed(e) => e,
            })
        );
        assert_eq!(std::fs::read_to_string(point.join("f")).unwrap(), "0");
        unmount_below(&base).await.unwrap();
        assert!(mounts_below(&base).is_empty());
        // Autoclear: the loop devices went with their mounts.
        let images: Vec<&PathBuf> = disks.iter().map(|(image, _)| image).collect();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let left: Vec<PathBuf> = loop_backing_files()
                .into_iter()
                .filter(|f| images.contains(&f))
                .collect();
            if left.is_empty() {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "loop devices left: {left:?}"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}
