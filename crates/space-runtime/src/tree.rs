//! Host-side work inside directory trees that a tenant filled: template layers (a sandbox's
//! files, a build step's output, an import) and whatever the host adds to or removes from them.
//!
//! The host works as root, so a symbolic link left in such a tree must never be followed,
//! and nothing the host writes may land anywhere but where it meant. Every access here
//! starts from a directory descriptor and goes one component at a time with `O_NOFOLLOW`;
//! names are created with `O_EXCL`; a link, a file where a directory belongs, or a directory
//! where a file belongs is removed and replaced, never written through. (Paths the host
//! made itself — the layer directory, the store root — are trusted up to their last
//! component.)
//!
//! Walks hold one descriptor per level and stop at [`MAX_DEPTH`] (a tree deeper than that
//! cannot be measured or copied, and the build that made it fails). Removal has no depth
//! limit: directories below [`MAX_DEPTH`] are first moved up to the top of the removal, so a
//! tenant cannot make a tree the host is unable to delete. Removal never crosses into
//! another filesystem.

use std::ffi::{CStr, CString, OsStr, OsString};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Deepest directory nesting a walk descends into (the agent packs no deeper either).
pub const MAX_DEPTH: usize = space_agent::fs::MAX_WALK_DEPTH;

/// The file type bits of a `stat`.
pub fn kind(st: &libc::stat) -> libc::mode_t {
    st.st_mode & libc::S_IFMT
}

pub fn is_dir(st: &libc::stat) -> bool {
    kind(st) == libc::S_IFDIR
}

fn cstr(name: &OsStr) -> io::Result<CString> {
    if name.is_empty() || name == "." || name == ".." || name.as_bytes().contains(&b'/') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} is not a single file name"),
        ));
    }
    CString::new(name.as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn openat(dir: BorrowedFd<'_>, name: &CStr, flags: libc::c_int, mode: u32) -> io::Result<OwnedFd> {
    loop {
        // SAFETY: a valid descriptor and a NUL-terminated name.
        let fd = unsafe {
            libc::openat(
                dir.as_raw_fd(),
                name.as_ptr(),
                flags | libc::O_CLOEXEC | libc::O_NOFOLLOW,
                mode as libc::c_uint,
            )
        };
        if fd >= 0 {
            // SAFETY: a fresh descriptor that nothing else owns.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn fstat(fd: BorrowedFd<'_>) -> io::Result<libc::stat> {
    // SAFETY: a zeroed plain-old-data struct that the kernel fills in.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor and pointer.
    cvt(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
    Ok(st)
}

const DIR_FLAGS: libc::c_int = libc::O_RDONLY | libc::O_DIRECTORY;

/// A directory inside (or the top of) a tenant-filled tree, held by a descriptor.
#[derive(Debug)]
pub struct Dir {
    fd: OwnedFd,
}

impl AsFd for Dir {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Dir {
    /// Opens `path`, a directory the host made (its parents are trusted); a link as its last
    /// component is refused.
    pub fn open(path: &Path) -> io::Result<Dir> {
        let c = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: a NUL-terminated path.
        let fd = unsafe { libc::open(c.as_ptr(), DIR_FLAGS | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor that nothing else owns.
        Ok(Dir {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    pub fn stat(&self) -> io::Result<libc::stat> {
        fstat(self.fd.as_fd())
    }

    /// The entry `name` itself (a link is reported as one); `None` when there is none.
    pub fn lstat(&self, name: &OsStr) -> io::Result<Option<libc::stat>> {
        let c = cstr(name)?;
        // SAFETY: as in fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a valid descriptor, name and pointer.
        let r = unsafe {
            libc::fstatat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                &mut st,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        match cvt(r) {
            Ok(_) => Ok(Some(st)),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The directory `name` (never a link to one).
    pub fn child(&self, name: &OsStr) -> io::Result<Dir> {
        Ok(Dir {
            fd: openat(self.fd.as_fd(), &cstr(name)?, DIR_FLAGS, 0)?,
        })
    }

    /// The directory at `rel` (components separated by `/`; no `..`), reached without
    /// following any link.
    pub fn open_path(&self, rel: &str) -> io::Result<Dir> {
        let mut cur = Dir {
            fd: self.fd.try_clone()?,
        };
        for comp in rel.split('/').filter(|c| !c.is_empty() && *c != ".") {
            cur = cur.child(OsStr::new(comp))?;
        }
        Ok(cur)
    }

    /// The names in the directory (not `.` and `..`), sorted.
    pub fn names(&self) -> io::Result<Vec<OsString>> {
        let fd = openat(self.fd.as_fd(), c".", DIR_FLAGS, 0)?;
        let raw = std::os::fd::IntoRawFd::into_raw_fd(fd);
        // SAFETY: `raw` is a directory descriptor we own; closedir closes it.
        let dp = unsafe { libc::fdopendir(raw) };
        if dp.is_null() {
            let e = io::Error::last_os_error();
            // SAFETY: fdopendir failed, so the descriptor is still ours.
            unsafe { libc::close(raw) };
            return Err(e);
        }
        let mut names = Vec::new();
        let result = loop {
            // SAFETY: errno is thread-local.
            unsafe { *libc::__errno_location() = 0 };
            // SAFETY: `dp` is an open directory stream.
            let ent = unsafe { libc::readdir64(dp) };
            if ent.is_null() {
                // SAFETY: as above.
                let errno = unsafe { *libc::__errno_location() };
                break if errno == 0 {
                    Ok(())
                } else {
                    Err(io::Error::from_raw_os_error(errno))
                };
            }
            // SAFETY: d_name is NUL-terminated within the entry.
            let name = unsafe { CStr::from_ptr((*ent).d_name.as_ptr()) }.to_bytes();
            if name != b"." && name != b".." {
                names.push(OsString::from_vec(name.to_vec()));
            }
        };
        // SAFETY: `dp` is open and not used after this.
        unsafe { libc::closedir(dp) };
        result?;
        names.sort();
        Ok(names)
    }

    /// Sets the mode (permission bits, setuid included) of the directory itself.
    pub fn chmod(&self, mode: u32) -> io::Result<()> {
        // SAFETY: a valid descriptor.
        cvt(unsafe { libc::fchmod(self.fd.as_raw_fd(), (mode & 0o7777) as libc::mode_t) }).map(drop)
    }

    /// Sets the owner of the entry `name` (a link itself, not what it points at).
    pub fn chown(&self, name: &OsStr, uid: u32, gid: u32) -> io::Result<()> {
        let c = cstr(name)?;
        // SAFETY: a valid descriptor and name.
        cvt(unsafe {
            libc::fchownat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                uid,
                gid,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        })
        .map(drop)
    }

    /// `name` as a directory: an existing one is kept (with its contents and mode),
    /// anything else there is removed first and a fresh directory of `mode` made.
    pub fn ensure_dir(&self, name: &OsStr, mode: u32) -> io::Result<Dir> {
        match self.lstat(name)? {
            Some(st) if is_dir(&st) => return self.child(name),
            Some(_) => self.remove(name)?,
            None => {}
        }
        self.make_dir(name, mode)
    }

    /// Like [`Dir::ensure_dir`], but the directory gets exactly `mode` even when it existed.
    pub fn ensure_dir_mode(&self, name: &OsStr, mode: u32) -> io::Result<Dir> {
        let d = self.ensure_dir(name, mode)?;
        d.chmod(mode)?;
        Ok(d)
    }

    /// `rel` (several components) as a directory, each missing or non-directory component
    /// replaced by a fresh directory of `mode`.
    pub fn ensure_path(&self, rel: &str, mode: u32) -> io::Result<Dir> {
        let mut cur = Dir {
            fd: self.fd.try_clone()?,
        };
        for comp in rel.split('/').filter(|c| !c.is_empty() && *c != ".") {
            cur = cur.ensure_dir(OsStr::new(comp), mode)?;
        }
        Ok(cur)
    }

    /// A new, empty directory `name` with exactly `mode` (whatever the umask), owned by root.
    pub fn make_dir(&self, name: &OsStr, mode: u32) -> io::Result<Dir> {
        let c = cstr(name)?;
        // SAFETY: a valid descriptor and name.
        cvt(unsafe { libc::mkdirat(self.fd.as_raw_fd(), c.as_ptr(), 0o700) })?;
        let d = self.child(name)?;
        d.chmod(mode)?;
        Ok(d)
    }

    /// Writes `name` afresh: whatever was there — a link, a file hard-linked elsewhere, a
    /// directory — is removed, and a new root-owned file of `mode` is created in its place.
    pub fn write_file(&self, name: &OsStr, data: &[u8], mode: u32) -> io::Result<()> {
        let mut f = self.create_file(name, mode)?;
        f.write_all(data)
    }

    /// A new, empty root-owned file `name` of `mode`, replacing whatever was there.
    pub fn create_file(&self, name: &OsStr, mode: u32) -> io::Result<File> {
        if self.lstat(name)?.is_some() {
            self.remove(name)?;
        }
        let fd = openat(
            self.fd.as_fd(),
            &cstr(name)?,
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
            0o600,
        )?;
        // SAFETY: a valid descriptor.
        cvt(unsafe { libc::fchmod(fd.as_raw_fd(), (mode & 0o7777) as libc::mode_t) })?;
        Ok(File::from(fd))
    }

    /// The contents of the regular file `name` (a link, a fifo or a device is `None`), at
    /// most `max` bytes (more is an error).
    pub fn read_file(&self, name: &OsStr, max: u64) -> io::Result<Option<Vec<u8>>> {
        let fd = match openat(
            self.fd.as_fd(),
            &cstr(name)?,
            libc::O_RDONLY | libc::O_NONBLOCK,
            0,
        ) {
            Ok(fd) => fd,
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ELOOP)) => {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        let st = fstat(fd.as_fd())?;
        if kind(&st) != libc::S_IFREG {
            return Ok(None);
        }
        let mut out = Vec::new();
        File::from(fd).take(max + 1).read_to_end(&mut out)?;
        if out.len() as u64 > max {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{name:?} is larger than {max} bytes"),
            ));
        }
        Ok(Some(out))
    }

    /// Opens the regular file `name` for reading (a link, a fifo or a device is refused
    /// without being opened for I/O).
    pub fn open_file(&self, name: &OsStr) -> io::Result<File> {
        let fd = openat(
            self.fd.as_fd(),
            &cstr(name)?,
            libc::O_RDONLY | libc::O_NONBLOCK,
            0,
        )?;
        if kind(&fstat(fd.as_fd())?) != libc::S_IFREG {
            return Err(io::Error::other(format!("{name:?} is not a regular file")));
        }
        Ok(File::from(fd))
    }

    /// The target of the link `name`.
    pub fn read_link(&self, name: &OsStr) -> io::Result<Vec<u8>> {
        let c = cstr(name)?;
        let mut buf = vec![0u8; 4097];
        // SAFETY: the buffer is as long as we say.
        let n = unsafe {
            libc::readlinkat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let n = n as usize;
        if n >= buf.len() {
            return Err(io::Error::from_raw_os_error(libc::ENAMETOOLONG));
        }
        buf.truncate(n);
        Ok(buf)
    }

    /// Removes the entry `name`, a whole directory tree included; nothing there is fine.
    pub fn remove(&self, name: &OsStr) -> io::Result<()> {
        let c = cstr(name)?;
        let Some(st) = self.lstat(name)? else {
            return Ok(());
        };
        if is_dir(&st) {
            let own = self.stat()?;
            if st.st_dev != own.st_dev {
                return Err(mount_point(name));
            }
            self.child(name)?.clear()?;
        }
        let flags = if is_dir(&st) { libc::AT_REMOVEDIR } else { 0 };
        // SAFETY: a valid descriptor and name.
        match cvt(unsafe { libc::unlinkat(self.fd.as_raw_fd(), c.as_ptr(), flags) }) {
            Err(e) if e.raw_os_error() != Some(libc::ENOENT) => Err(e),
            _ => Ok(()),
        }
    }

    /// Removes everything in the directory (not the directory itself).
    pub fn clear(&self) -> io::Result<()> {
        let dev = self.stat()?.st_dev;
        // Each pass removes what lies within MAX_DEPTH and moves deeper directories up here;
        // a tree of any depth is gone after depth / MAX_DEPTH passes.
        loop {
            let mut moved = false;
            self.clear_level(self, dev, 1, &mut moved)?;
            if !moved {
                return Ok(());
            }
        }
    }

    fn clear_level(&self, top: &Dir, dev: u64, depth: usize, moved: &mut bool) -> io::Result<()> {
        for name in self.names()? {
            let Some(st) = self.lstat(&name)? else {
                continue;
            };
            let c = cstr(&name)?;
            if is_dir(&st) {
                if st.st_dev != dev {
                    return Err(mount_point(&name));
                }
                if depth >= MAX_DEPTH {
                    self.move_up(&c, top)?;
                    *moved = true;
                    continue;
                }
                self.child(&name)?.clear_level(top, dev, depth + 1, moved)?;
            }
            let flags = if is_dir(&st) { libc::AT_REMOVEDIR } else { 0 };
            // SAFETY: a valid descriptor and name.
            match cvt(unsafe { libc::unlinkat(self.fd.as_raw_fd(), c.as_ptr(), flags) }) {
                Err(e) if e.raw_os_error() != Some(libc::ENOENT) => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }

    fn move_up(&self, name: &CStr, top: &Dir) -> io::Result<()> {
        static N: AtomicU64 = AtomicU64::new(0);
        loop {
            let to = CString::new(format!(
                ".space-removing-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ))
            .map_err(io::Error::other)?;
            // SAFETY: valid descriptors and names; renameat2 through syscall() since older
            // glibc lacks the wrapper.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_renameat2,
                    self.fd.as_raw_fd(),
                    name.as_ptr(),
                    top.fd.as_raw_fd(),
                    to.as_ptr(),
                    libc::RENAME_NOREPLACE,
                )
            };
            if r == 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Err(e);
            }
        }
    }

    /// Moves the entry `from` here to `to` in `dir` (same filesystem), replacing a
    /// non-directory there.
    pub fn rename_to(&self, from: &OsStr, dir: &Dir, to: &OsStr) -> io::Result<()> {
        let (f, t) = (cstr(from)?, cstr(to)?);
        // SAFETY: valid descriptors and names.
        cvt(unsafe {
            libc::renameat(
                self.fd.as_raw_fd(),
                f.as_ptr(),
                dir.fd.as_raw_fd(),
                t.as_ptr(),
            )
        })
        .map(drop)
    }

    /// Visits every entry below the directory, depth first in name order, never following
    /// a link: `visit(relative path, its lstat, the directory holding it)`. Fails on a tree
    /// deeper than [`MAX_DEPTH`].
    pub fn walk(
        &self,
        visit: &mut dyn FnMut(&Path, &libc::stat, &Dir) -> io::Result<()>,
    ) -> io::Result<()> {
        self.walk_in(&mut PathBuf::new(), 1, visit)
    }

    fn walk_in(
        &self,
        rel: &mut PathBuf,
        depth: usize,
        visit: &mut dyn FnMut(&Path, &libc::stat, &Dir) -> io::Result<()>,
    ) -> io::Result<()> {
        if depth > MAX_DEPTH {
            let shown: String = rel.to_string_lossy().chars().take(80).collect();
            return Err(io::Error::other(format!(
                "directories nested deeper than {MAX_DEPTH} levels (at {shown}…)"
            )));
        }
        for name in self.names()? {
            let Some(st) = self.lstat(&name)? else {
                continue;
            };
            rel.push(&name);
            let r = visit(rel, &st, self).and_then(|()| {
                if is_dir(&st) {
                    self.child(&name)?.walk_in(rel, depth + 1, visit)
                } else {
                    Ok(())
                }
            });
            rel.pop();
            r?;
        }
        Ok(())
    }
}

fn mount_point(name: &OsStr) -> io::Error {
    io::Error::other(format!(
        "{name:?} is the mount point of another filesystem; not removing it"
    ))
}

/// Bytes of the regular files below the directory `path`, holes included (what a copy that
/// does not keep holes writes), never following a link.
pub fn apparent_size(path: &Path) -> io::Result<u64> {
    let mut total = 0u64;
    Dir::open(path)?.walk(&mut |_, st, _| {
        if kind(st) == libc::S_IFREG {
            total = total.saturating_add(st.st_size.max(0) as u64);
        }
        Ok(())
    })?;
    Ok(total)
}

/// Removes `path` (a tree a tenant may have filled) without following any link in it and
/// without crossing into another filesystem. Its parent is trusted; a missing path is fine.
pub fn remove_tree(path: &Path) -> io::Result<()> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io::Error::other(format!(
            "refusing to remove {}",
            path.display()
        )));
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    match Dir::open(parent) {
        Ok(dir) => dir.remove(name),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Makes `path` (and missing parents) a directory only root can enter: mode 0700 whatever
/// the umask, also when it existed with another mode. For the directories that hold
/// tenants' content and secrets (the data dir, the template store), which the operator
/// names: a link there is followed.
pub fn private_dir(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, MetadataExt};

    struct Tmp(PathBuf);

    impl Tmp {
        fn new(tag: &str) -> Tmp {
            static N: AtomicU64 = AtomicU64::new(0);
            let p = std::env::temp_dir().join(format!(
                "space-tree-{tag}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            Tmp(p)
        }
    }

    impl Drop for Tmp {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn links_are_replaced_never_followed() {
        let t = Tmp::new("links");
        let (root, outside) = (t.0.join("root"), t.0.join("outside"));
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("hosts"), "host").unwrap();
        symlink(&outside, root.join("etc")).unwrap();
        symlink(outside.join("hosts"), root.join("file")).unwrap();
        let dir = Dir::open(&root).unwrap();
        assert!(dir.open_path("etc").is_err(), "a link is not a directory");
        let etc = dir.ensure_dir(OsStr::new("etc"), 0o755).unwrap();
        etc.write_file(OsStr::new("hosts"), b"mine", 0o644).unwrap();
        dir.write_file(OsStr::new("file"), b"mine", 0o600).unwrap();
        assert_eq!(
            std::fs::read_to_string(outside.join("hosts")).unwrap(),
            "host"
        );
        assert!(std::fs::symlink_metadata(root.join("etc"))
            .unwrap()
            .is_dir());
        assert_eq!(
            std::fs::read_to_string(root.join("etc/hosts")).unwrap(),
            "mine"
        );
        let m = std::fs::symlink_metadata(root.join("file")).unwrap();
        assert!(m.is_file() && m.mode() & 0o7777 == 0o600);
        // A hard link is replaced, not written through.
        std::fs::write(root.join("a"), "a").unwrap();
        std::fs::hard_link(root.join("a"), root.join("b")).unwrap();
        dir.write_file(OsStr::new("b"), b"b", 0o644).unwrap();
        assert_eq!(std::fs::read_to_string(root.join("a")).unwrap(), "a");
        assert_eq!(dir.read_file(OsStr::new("etc"), 10).unwrap(), None);
        assert!(dir.read_file(OsStr::new("b"), 0).is_err());
        // Removal of a link to a directory removes the link only.
        symlink(&outside, root.join("l")).unwrap();
        dir.remove(OsStr::new("l")).unwrap();
        assert!(outside.join("hosts").exists());
        for bad in ["..", ".", "a/b", ""] {
            assert!(dir.lstat(OsStr::new(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn removal_has_no_depth_limit_and_stays_on_its_filesystem() {
        let t = Tmp::new("deep");
        let mut p = t.0.join("top");
        for _ in 0..(MAX_DEPTH * 2 + 3) {
            p.push("d");
        }
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(p.join("f"), "x").unwrap();
        symlink("/etc", p.join("etc")).unwrap();
        let dir = Dir::open(&t.0.join("top")).unwrap();
        let mut n = 0;
        let walked = dir.walk(&mut |_, _, _| {
            n += 1;
            Ok(())
        });
        assert!(walked.is_err(), "walks are bounded");
        remove_tree(&t.0.join("top")).unwrap();
        assert!(!t.0.join("top").exists());
        assert!(Path::new("/etc/passwd").exists());
        remove_tree(&t.0.join("missing")).unwrap();
    }

    #[test]
    fn private_dirs_are_0700_whatever_they_were() {
        let t = Tmp::new("private");
        let d = t.0.join("a/b");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        private_dir(&d).unwrap();
        assert_eq!(std::fs::metadata(&d).unwrap().mode() & 0o7777, 0o700);
        private_dir(&t.0.join("c")).unwrap();
        assert_eq!(
            std::fs::metadata(t.0.join("c")).unwrap().mode() & 0o7777,
            0o700
        );
    }
}
