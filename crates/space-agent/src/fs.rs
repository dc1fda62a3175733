//! Files under a root directory, reached only through directory descriptors.
//!
//! This module owns the sandbox file API's filesystem work: resolving an API
//! path inside a [`Root`], stat and list, raw download and atomic upload, tar
//! packing and bounded tar unpacking, recursive removal, `mkdir -p` and move.
//! It is synchronous (std + libc) so that the agent runs it on blocking threads
//! and the host can reuse it, e.g. to unpack an untrusted tar into a directory:
//! `fs::Root::open(dir)?.unpack_tar(reader, &fs::Limits::default())`.
//!
//! Path safety: every lookup is an `openat` walk from a descriptor of the root,
//! one component at a time with `O_NOFOLLOW`. A symbolic link is read and its
//! target spliced into the remaining components; absolute targets restart at
//! the root and `..` is clamped there (a logical stack of descriptors, never
//! `openat("..")`). Because each step starts from a descriptor, a link swapped in
//! during an operation cannot lead outside the root; at worst the operation fails.
//! Forbidden areas ([`SANDBOX_FORBIDDEN`] in the agent) are checked on the
//! resolved logical path, so a link pointing into them is refused too.

use std::collections::hash_map::RandomState;
use std::collections::{HashSet, VecDeque};
use std::ffi::{CStr, CString, OsStr};
use std::fs::File;
use std::hash::BuildHasher;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use base64::Engine;
use serde::{Deserialize, Serialize};

/// Longest API path and longest tar entry name, in bytes.
pub const MAX_PATH_BYTES: usize = 4096;
/// Longest single path component, in bytes.
pub const MAX_NAME_BYTES: usize = 255;
/// Symbolic links followed while resolving one path.
pub const MAX_SYMLINK_HOPS: usize = 40;
/// Deepest `list` walk.
pub const MAX_LIST_DEPTH: u32 = 64;
/// Most entries one `list` returns.
pub const MAX_LIST_ENTRIES: usize = 10_000;
/// Deepest directory nesting that tar packing and recursive removal descend
/// into (each level holds a descriptor).
pub const MAX_WALK_DEPTH: usize = 256;
/// Longest symlink target accepted or read.
const MAX_LINK_TARGET: usize = 4096;
/// Largest PAX extended header read into memory.
const MAX_PAX_BYTES: u64 = 1 << 20;
/// The areas of a sandbox's root the file API never touches.
pub const SANDBOX_FORBIDDEN: &[&str] = &["/.space", "/proc", "/sys", "/dev"];

const CHUNK: usize = 64 * 1024;
/// The write size of a file upload. Under gVisor each write is a trap into the Sentry
/// and a write to the host: 1 MiB writes store a file about 1.2-1.8× faster than 64 KiB
/// ones (`dd` in a sandbox). Archive entries keep [`CHUNK`]: most are small.
const FILE_CHUNK: usize = 1 << 20;

/// What went wrong, named for the HTTP answer it becomes ([`FsError::status`], [`FsError::code`]).
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("{0}")]
    InvalidPath(String),
    #[error("{0}")]
    InvalidRequest(String),
    #[error("{0}")]
    NotAFile(String),
    #[error("{0}")]
    UnsafeArchive(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    TooLarge(String),
    #[error("{0}")]
    NoSpace(String),
    #[error("{context}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
}

impl FsError {
    /// The HTTP status this error is answered with.
    pub fn status(&self) -> u16 {
        match self {
            FsError::InvalidPath(_)
            | FsError::InvalidRequest(_)
            | FsError::NotAFile(_)
            | FsError::UnsafeArchive(_) => 400,
            FsError::Forbidden(_) => 403,
            FsError::NotFound(_) => 404,
            FsError::Conflict(_) => 409,
            FsError::TooLarge(_) => 413,
            FsError::NoSpace(_) => 507,
            FsError::Io { .. } => 500,
        }
    }

    /// The machine-readable error code.
    pub fn code(&self) -> &'static str {
        match self {
            FsError::InvalidPath(_) => "invalid_path",
            FsError::InvalidRequest(_) => "invalid_request",
            FsError::NotAFile(_) => "not_a_file",
            FsError::UnsafeArchive(_) => "unsafe_archive",
            FsError::Forbidden(_) => "forbidden_path",
            FsError::NotFound(_) => "not_found",
            FsError::Conflict(_) => "conflict",
            FsError::TooLarge(_) => "too_large",
            FsError::NoSpace(_) => "no_space",
            FsError::Io { .. } => "internal",
        }
    }

    /// The message for a client: the error and its cause.
    pub fn message(&self) -> String {
        match self {
            FsError::Io { context, source } => format!("{context}: {source}"),
            other => other.to_string(),
        }
    }

    /// The same error, its message prefixed (e.g. with the tar entry that failed).
    fn prefixed(self, prefix: &str) -> FsError {
        let p = |m: String| format!("{prefix}{m}");
        match self {
            FsError::InvalidPath(m) => FsError::InvalidPath(p(m)),
            FsError::InvalidRequest(m) => FsError::InvalidRequest(p(m)),
            FsError::NotAFile(m) => FsError::NotAFile(p(m)),
            FsError::UnsafeArchive(m) => FsError::UnsafeArchive(p(m)),
            FsError::Forbidden(m) => FsError::Forbidden(p(m)),
            FsError::NotFound(m) => FsError::NotFound(p(m)),
            FsError::Conflict(m) => FsError::Conflict(p(m)),
            FsError::TooLarge(m) => FsError::TooLarge(p(m)),
            FsError::NoSpace(m) => FsError::NoSpace(p(m)),
            FsError::Io { context, source } => FsError::Io {
                context: p(context),
                source,
            },
        }
    }
}

/// Maps an OS error on `what` to the error the client sees.
fn os_err(what: &str, e: io::Error) -> FsError {
    match e.raw_os_error() {
        Some(libc::ENOENT) => FsError::NotFound(format!("{what}: no such file or directory")),
        Some(libc::ENOTDIR) => FsError::NotFound(format!("{what}: a component is not a directory")),
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => {
            FsError::NoSpace(format!("{what}: no space left (disk quota reached)"))
        }
        Some(libc::EEXIST) => FsError::Conflict(format!("{what}: already exists")),
        Some(libc::ENOTEMPTY) => FsError::Conflict(format!("{what}: directory not empty")),
        Some(libc::EISDIR) => FsError::Conflict(format!("{what}: is a directory")),
        Some(libc::EBUSY) => FsError::Conflict(format!("{what}: busy (a mount point?)")),
        Some(libc::ELOOP) => FsError::Conflict(format!(
            "{what}: changed during the operation (now a symbolic link)"
        )),
        Some(libc::ENAMETOOLONG) => FsError::InvalidPath(format!("{what}: name too long")),
        Some(libc::EACCES) | Some(libc::EPERM) => {
            FsError::Forbidden(format!("{what}: permission denied"))
        }
        Some(libc::EROFS) => FsError::Forbidden(format!("{what}: read-only file system")),
        Some(libc::EFBIG) => FsError::TooLarge(format!("{what}: file too large")),
        Some(libc::EXDEV) => {
            FsError::InvalidRequest(format!("{what}: cannot move across file systems"))
        }
        Some(libc::EINVAL) => FsError::InvalidRequest(format!("{what}: invalid argument")),
        _ => FsError::Io {
            context: what.to_string(),
            source: e,
        },
    }
}

/// Kind of a file, as the API names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FileType {
    File,
    Dir,
    Symlink,
    Other,
}

/// What the API says about one file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileInfo {
    /// Absolute path inside the root (lossy UTF-8 when a name is not UTF-8).
    pub path: String,
    /// Last component (lossy UTF-8; see `name_base64`); `/` for the root.
    pub name: String,
    #[serde(rename = "type")]
    pub kind: FileType,
    pub size: u64,
    /// Permission bits, setuid/setgid/sticky included.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Modification time, Unix seconds.
    pub mtime: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_target: Option<String>,
    /// The raw name, base64, when it is not valid UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name_base64: Option<String>,
    /// The raw link target, base64, when it is not valid UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_target_base64: Option<String>,
}

/// `list`: the entries below a path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Listing {
    pub path: String,
    pub entries: Vec<FileInfo>,
    pub truncated: bool,
}

/// Owner and permissions of something the API creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attrs {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

impl Attrs {
    pub const FILE: Attrs = Attrs {
        mode: 0o644,
        uid: 0,
        gid: 0,
    };
    pub const DIR: Attrs = Attrs {
        mode: 0o755,
        uid: 0,
        gid: 0,
    };
}

/// Bounds on one tar unpack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Extracted bytes (file contents) at most.
    pub max_bytes: u64,
    /// Archive members at most.
    pub max_entries: u64,
    /// Sum of all entry names at most (what the unpacker remembers for cleanup).
    pub max_name_bytes: u64,
    /// Apply the archive's uid/gid (and setuid/setgid bits); otherwise files
    /// belong to the caller and those bits are dropped.
    pub same_owner: bool,
    /// Skip device nodes and fifos instead of refusing the archive (imported images may
    /// carry /dev entries; a sandbox gets its /dev from the runtime).
    pub skip_special: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_bytes: 8 << 30,
            max_entries: 200_000,
            max_name_bytes: 64 << 20,
            same_owner: true,
            skip_special: false,
        }
    }
}

/// What one unpack wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnpackStats {
    pub entries: u64,
    pub bytes: u64,
}

/// Splits an API path into its components: absolute, UTF-8, no NUL, at most
/// [`MAX_PATH_BYTES`], components at most [`MAX_NAME_BYTES`], no `..`; `.` and
/// repeated slashes are dropped.
pub fn parse_path(path: &str) -> Result<Vec<String>, FsError> {
    if !path.starts_with('/') {
        return Err(FsError::InvalidPath(format!(
            "path {path:?} must be absolute"
        )));
    }
    if path.len() > MAX_PATH_BYTES {
        return Err(FsError::InvalidPath(format!(
            "path is longer than {MAX_PATH_BYTES} bytes"
        )));
    }
    if path.contains('\0') {
        return Err(FsError::InvalidPath("path contains a NUL byte".into()));
    }
    let mut comps = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                return Err(FsError::InvalidPath(format!(
                    "path {path:?} must not contain '..'"
                )))
            }
            c if c.len() > MAX_NAME_BYTES => {
                return Err(FsError::InvalidPath(format!(
                    "a path component is longer than {MAX_NAME_BYTES} bytes"
                )))
            }
            c => comps.push(c.to_string()),
        }
    }
    Ok(comps)
}

fn display(comps: &[Vec<u8>]) -> String {
    if comps.is_empty() {
        return "/".into();
    }
    let mut s = String::new();
    for c in comps {
        s.push('/');
        s.push_str(&String::from_utf8_lossy(c));
    }
    s
}

fn api_display(comps: &[String]) -> String {
    if comps.is_empty() {
        "/".into()
    } else {
        format!("/{}", comps.join("/"))
    }
}

// ---- syscalls ---------------------------------------------------------------

fn cstring(name: &[u8]) -> Result<CString, FsError> {
    CString::new(name).map_err(|_| FsError::InvalidPath("a name contains a NUL byte".into()))
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
        // SAFETY: valid descriptor and NUL-terminated name.
        let fd = unsafe {
            libc::openat(
                dir.as_raw_fd(),
                name.as_ptr(),
                flags | libc::O_CLOEXEC,
                mode as libc::c_uint,
            )
        };
        if fd >= 0 {
            // SAFETY: a fresh descriptor we own.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

const O_PATH_NOFOLLOW: libc::c_int = libc::O_PATH | libc::O_NOFOLLOW;
const O_DIR_READ: libc::c_int = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW;

fn fstat(fd: BorrowedFd<'_>) -> io::Result<libc::stat> {
    // SAFETY: zeroed plain-old-data struct filled by the kernel.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid descriptor and pointer.
    cvt(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
    Ok(st)
}

fn lstatat(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<libc::stat> {
    // SAFETY: as in fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid descriptor, name and pointer.
    cvt(unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            name.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    })?;
    Ok(st)
}

fn lstat_opt(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<Option<libc::stat>> {
    match lstatat(dir, name) {
        Ok(st) => Ok(Some(st)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

fn readlinkat(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; MAX_LINK_TARGET + 1];
    // SAFETY: the buffer is as long as we say.
    let n = unsafe {
        libc::readlinkat(
            dir.as_raw_fd(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let n = n as usize;
    if n > MAX_LINK_TARGET {
        return Err(io::Error::from_raw_os_error(libc::ENAMETOOLONG));
    }
    buf.truncate(n);
    Ok(buf)
}

fn mkdirat(dir: BorrowedFd<'_>, name: &CStr, mode: u32) -> io::Result<()> {
    // SAFETY: valid descriptor and name.
    cvt(unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), mode as libc::mode_t) }).map(drop)
}

fn unlinkat(dir: BorrowedFd<'_>, name: &CStr, is_dir: bool) -> io::Result<()> {
    let flags = if is_dir { libc::AT_REMOVEDIR } else { 0 };
    // SAFETY: valid descriptor and name.
    cvt(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), flags) }).map(drop)
}

fn renameat(
    from_dir: BorrowedFd<'_>,
    from: &CStr,
    to_dir: BorrowedFd<'_>,
    to: &CStr,
) -> io::Result<()> {
    // SAFETY: valid descriptors and names.
    cvt(unsafe {
        libc::renameat(
            from_dir.as_raw_fd(),
            from.as_ptr(),
            to_dir.as_raw_fd(),
            to.as_ptr(),
        )
    })
    .map(drop)
}

fn renameat_noreplace(
    from_dir: BorrowedFd<'_>,
    from: &CStr,
    to_dir: BorrowedFd<'_>,
    to: &CStr,
) -> io::Result<()> {
    // SAFETY: valid descriptors and names; renameat2 through syscall() since
    // older glibc lacks the wrapper.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            from_dir.as_raw_fd(),
            from.as_ptr(),
            to_dir.as_raw_fd(),
            to.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn fchownat_nofollow(dir: BorrowedFd<'_>, name: &CStr, uid: u32, gid: u32) -> io::Result<()> {
    // SAFETY: valid descriptor and name.
    cvt(unsafe {
        libc::fchownat(
            dir.as_raw_fd(),
            name.as_ptr(),
            uid,
            gid,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    })
    .map(drop)
}

fn fchown(fd: BorrowedFd<'_>, uid: u32, gid: u32) -> io::Result<()> {
    // SAFETY: valid descriptor.
    cvt(unsafe { libc::fchown(fd.as_raw_fd(), uid, gid) }).map(drop)
}

fn fchmod(fd: BorrowedFd<'_>, mode: u32) -> io::Result<()> {
    // SAFETY: valid descriptor.
    cvt(unsafe { libc::fchmod(fd.as_raw_fd(), mode as libc::mode_t) }).map(drop)
}

fn times(mtime: i64) -> [libc::timespec; 2] {
    [
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
        libc::timespec {
            tv_sec: mtime as libc::time_t,
            tv_nsec: 0,
        },
    ]
}

fn futimens(fd: BorrowedFd<'_>, mtime: i64) -> io::Result<()> {
    let t = times(mtime);
    // SAFETY: valid descriptor and a two-element array.
    cvt(unsafe { libc::futimens(fd.as_raw_fd(), t.as_ptr()) }).map(drop)
}

fn lutimensat(dir: BorrowedFd<'_>, name: &CStr, mtime: i64) -> io::Result<()> {
    let t = times(mtime);
    // SAFETY: valid descriptor, name and array.
    cvt(unsafe {
        libc::utimensat(
            dir.as_raw_fd(),
            name.as_ptr(),
            t.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    })
    .map(drop)
}

/// The names in a directory (not `.`/`..`), sorted.
fn read_names(dir: BorrowedFd<'_>) -> io::Result<Vec<Vec<u8>>> {
    let fd = openat(dir, c".", libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
    let raw = fd.into_raw_fd();
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
            names.push(name.to_vec());
        }
    };
    // SAFETY: `dp` is open and not used after this.
    unsafe { libc::closedir(dp) };
    result?;
    names.sort();
    Ok(names)
}

fn file_type(st: &libc::stat) -> FileType {
    match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => FileType::File,
        libc::S_IFDIR => FileType::Dir,
        libc::S_IFLNK => FileType::Symlink,
        _ => FileType::Other,
    }
}

fn is_type(st: &libc::stat, t: libc::mode_t) -> bool {
    st.st_mode & libc::S_IFMT == t
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn file_info(path: String, name: &[u8], st: &libc::stat, link: Option<&[u8]>) -> FileInfo {
    let utf8 = std::str::from_utf8(name).is_ok();
    let link_utf8 = link.is_none_or(|l| std::str::from_utf8(l).is_ok());
    FileInfo {
        path,
        name: String::from_utf8_lossy(name).into_owned(),
        kind: file_type(st),
        size: st.st_size.max(0) as u64,
        mode: st.st_mode & 0o7777,
        uid: st.st_uid,
        gid: st.st_gid,
        mtime: st.st_mtime,
        link_target: link.map(|l| String::from_utf8_lossy(l).into_owned()),
        name_base64: (!utf8).then(|| b64(name)),
        link_target_base64: if link_utf8 { None } else { link.map(b64) },
    }
}

/// Where a resolved path leads: `name` in the directory `dir`, or the root itself.
struct Target {
    dir: OwnedFd,
    /// `None` for the root.
    name: Option<CString>,
    /// The resolved logical path, final component included.
    logical: Vec<Vec<u8>>,
    /// lstat of the final component; `None` when it does not exist.
    st: Option<libc::stat>,
}

impl Target {
    fn name_bytes(&self) -> &[u8] {
        self.name.as_deref().map_or(b"/", CStr::to_bytes)
    }

    /// Opens the target itself (never following a link there).
    fn open(&self, flags: libc::c_int) -> io::Result<OwnedFd> {
        match &self.name {
            Some(n) => openat(self.dir.as_fd(), n, flags | libc::O_NOFOLLOW, 0),
            None => openat(self.dir.as_fd(), c".", flags, 0),
        }
    }
}

fn dup(fd: BorrowedFd<'_>) -> Result<OwnedFd, FsError> {
    fd.try_clone_to_owned()
        .map_err(|e| os_err("duplicating a descriptor", e))
}

/// How [`Root::resolve`] treats the final component and missing directories.
#[derive(Clone, Copy)]
struct Resolve {
    follow_last: bool,
    /// Create missing intermediate directories with these attributes.
    mkdirs: Option<Attrs>,
}

/// Opens a directory child without following links, for walks.
fn open_child_dir(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<OwnedFd> {
    openat(dir, name, O_DIR_READ, 0)
}

/// Creates a directory with exactly these attributes (mkdir's mode is masked by the umask).
fn make_dir(dir: BorrowedFd<'_>, name: &CStr, attrs: Attrs) -> io::Result<()> {
    mkdirat(dir, name, 0o700)?;
    let fd = open_child_dir(dir, name)?;
    fchown(fd.as_fd(), attrs.uid, attrs.gid)?;
    fchmod(fd.as_fd(), attrs.mode & 0o7777)
}

/// A directory tree whose every access stays inside it.
#[derive(Debug)]
pub struct Root {
    fd: OwnedFd,
    forbidden: Vec<Vec<Vec<u8>>>,
}

impl Root {
    /// Opens `path` (a directory) as the root.
    pub fn open(path: impl AsRef<Path>) -> Result<Root, FsError> {
        let path = path.as_ref();
        let c = cstring(path.as_os_str().as_bytes())?;
        // SAFETY: NUL-terminated path.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(os_err(
                &format!("opening {}", path.display()),
                io::Error::last_os_error(),
            ));
        }
        Ok(Root {
            // SAFETY: a fresh descriptor we own.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            forbidden: Vec::new(),
        })
    }

    /// Refuses every path at or below these areas (absolute paths inside the
    /// root), however it is reached; walks skip them.
    pub fn with_forbidden(mut self, areas: &[&str]) -> Result<Root, FsError> {
        for a in areas {
            let comps = parse_path(a)?;
            self.forbidden
                .push(comps.into_iter().map(String::into_bytes).collect());
        }
        Ok(self)
    }

    fn is_forbidden(&self, logical: &[Vec<u8>]) -> bool {
        self.forbidden
            .iter()
            .any(|f| !f.is_empty() && logical.len() >= f.len() && logical[..f.len()] == f[..])
    }

    fn check_forbidden(&self, logical: &[Vec<u8>]) -> Result<(), FsError> {
        if self.is_forbidden(logical) {
            return Err(FsError::Forbidden(format!(
                "{} is not accessible through the file API",
                display(logical)
            )));
        }
        Ok(())
    }

    fn root_target(&self) -> Result<Target, FsError> {
        Ok(Target {
            dir: dup(self.fd.as_fd())?,
            name: None,
            logical: Vec::new(),
            st: Some(fstat(self.fd.as_fd()).map_err(|e| os_err("/", e))?),
        })
    }

    /// Resolves API path components inside the root (see the module docs).
    fn resolve(&self, comps: &[String], how: Resolve) -> Result<Target, FsError> {
        let shown = api_display(comps);
        let mut remaining: VecDeque<Vec<u8>> =
            comps.iter().map(|c| c.as_bytes().to_vec()).collect();
        let mut stack: Vec<(Vec<u8>, OwnedFd)> = Vec::new();
        let mut hops = 0usize;
        let logical_of = |stack: &[(Vec<u8>, OwnedFd)], comp: &[u8]| -> Vec<Vec<u8>> {
            let mut l: Vec<Vec<u8>> = stack.iter().map(|(n, _)| n.clone()).collect();
            l.push(comp.to_vec());
            l
        };
        while let Some(comp) = remaining.pop_front() {
            if comp.is_empty() || comp == b"." {
                continue;
            }
            if comp == b".." {
                stack.pop();
                continue;
            }
            if comp.len() > MAX_NAME_BYTES {
                return Err(FsError::InvalidPath(format!(
                    "{shown}: a component is longer than {MAX_NAME_BYTES} bytes"
                )));
            }
            let is_last = remaining.is_empty();
            let logical = logical_of(&stack, &comp);
            self.check_forbidden(&logical)?;
            let cur = stack.last().map_or(self.fd.as_fd(), |(_, fd)| fd.as_fd());
            let name = cstring(&comp)?;
            if is_last && !how.follow_last {
                let st = lstat_opt(cur, &name).map_err(|e| os_err(&shown, e))?;
                return Ok(Target {
                    dir: dup(cur)?,
                    name: Some(name),
                    logical,
                    st,
                });
            }
            let fd = match openat(cur, &name, O_PATH_NOFOLLOW, 0) {
                Ok(fd) => fd,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                    if is_last {
                        return Ok(Target {
                            dir: dup(cur)?,
                            name: Some(name),
                            logical,
                            st: None,
                        });
                    }
                    let Some(attrs) = how.mkdirs else {
                        return Err(FsError::NotFound(format!(
                            "{shown}: {} does not exist",
                            display(&logical)
                        )));
                    };
                    match make_dir(cur, &name, attrs) {
                        Ok(()) => {}
                        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
                        Err(e) => return Err(os_err(&display(&logical), e)),
                    }
                    // Look again at what is there now; bounded like link hops.
                    hops += 1;
                    if hops > MAX_SYMLINK_HOPS {
                        return Err(FsError::Conflict(format!(
                            "{shown}: kept changing during the operation"
                        )));
                    }
                    remaining.push_front(comp);
                    continue;
                }
                Err(e) => return Err(os_err(&shown, e)),
            };
            let st = fstat(fd.as_fd()).map_err(|e| os_err(&shown, e))?;
            if is_type(&st, libc::S_IFLNK) {
                hops += 1;
                if hops > MAX_SYMLINK_HOPS {
                    return Err(FsError::InvalidPath(format!(
                        "{shown}: too many levels of symbolic links"
                    )));
                }
                let target = match readlinkat(cur, &name) {
                    Ok(t) => t,
                    // It stopped being a link since we opened it: look again.
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                        remaining.push_front(comp);
                        continue;
                    }
                    Err(e) => return Err(os_err(&shown, e)),
                };
                if target.is_empty() {
                    return Err(FsError::NotFound(format!(
                        "{shown}: {} is an empty symbolic link",
                        display(&logical)
                    )));
                }
                if target[0] == b'/' {
                    stack.clear();
                }
                for part in target.split(|&b| b == b'/').rev() {
                    remaining.push_front(part.to_vec());
                }
                continue;
            }
            if is_last {
                return Ok(Target {
                    dir: dup(cur)?,
                    name: Some(name),
                    logical,
                    st: Some(st),
                });
            }
            if !is_type(&st, libc::S_IFDIR) {
                let msg = format!("{shown}: {} is not a directory", display(&logical));
                return Err(if how.mkdirs.is_some() {
                    FsError::Conflict(msg)
                } else {
                    FsError::NotFound(msg)
                });
            }
            stack.push((comp, fd));
        }
        // The path ended on a directory reached through a link, `.` or `..`.
        match stack.pop() {
            None => self.root_target(),
            Some((comp, fd)) => {
                let logical = logical_of(&stack, &comp);
                let parent = stack.last().map_or(self.fd.as_fd(), |(_, fd)| fd.as_fd());
                Ok(Target {
                    dir: dup(parent)?,
                    name: Some(cstring(&comp)?),
                    logical,
                    st: Some(fstat(fd.as_fd()).map_err(|e| os_err(&shown, e))?),
                })
            }
        }
    }

    fn resolve_path(
        &self,
        path: &str,
        follow_last: bool,
    ) -> Result<(Vec<String>, Target), FsError> {
        let comps = parse_path(path)?;
        let t = self.resolve(
            &comps,
            Resolve {
                follow_last,
                mkdirs: None,
            },
        )?;
        Ok((comps, t))
    }

    fn info_of(&self, shown: String, t: &Target) -> Result<FileInfo, FsError> {
        let st =
            t.st.ok_or_else(|| FsError::NotFound(format!("{shown}: no such file or directory")))?;
        let link = match (&t.name, is_type(&st, libc::S_IFLNK)) {
            (Some(n), true) => Some(readlinkat(t.dir.as_fd(), n).map_err(|e| os_err(&shown, e))?),
            _ => None,
        };
        Ok(file_info(shown, t.name_bytes(), &st, link.as_deref()))
    }

    /// `stat`: the path itself (a symbolic link is reported as one).
    pub fn stat(&self, path: &str) -> Result<FileInfo, FsError> {
        let (comps, t) = self.resolve_path(path, false)?;
        self.info_of(api_display(&comps), &t)
    }

    /// Like [`Root::stat`] but following a final symbolic link (inside the root).
    pub fn stat_followed(&self, path: &str) -> Result<FileInfo, FsError> {
        let (comps, t) = self.resolve_path(path, true)?;
        self.info_of(api_display(&comps), &t)
    }

    /// `list`: depth-first, sorted by name per directory, never following links;
    /// at most [`MAX_LIST_ENTRIES`]. The path itself is not followed either: a
    /// file (or link) lists as itself.
    pub fn list(&self, path: &str, depth: u32) -> Result<Listing, FsError> {
        if !(1..=MAX_LIST_DEPTH).contains(&depth) {
            return Err(FsError::InvalidRequest(format!(
                "depth must be between 1 and {MAX_LIST_DEPTH}"
            )));
        }
        let (comps, t) = self.resolve_path(path, false)?;
        let shown = api_display(&comps);
        let info = self.info_of(shown.clone(), &t)?;
        let mut listing = Listing {
            path: shown.clone(),
            entries: Vec::new(),
            truncated: false,
        };
        if info.kind != FileType::Dir {
            listing.entries.push(info);
            return Ok(listing);
        }
        let dir = t
            .open(libc::O_PATH | libc::O_DIRECTORY)
            .map_err(|e| os_err(&shown, e))?;
        let mut logical = t.logical.clone();
        self.list_dir(dir.as_fd(), &shown, &mut logical, depth, &mut listing);
        Ok(listing)
    }

    fn list_dir(
        &self,
        dir: BorrowedFd<'_>,
        prefix: &str,
        logical: &mut Vec<Vec<u8>>,
        depth: u32,
        out: &mut Listing,
    ) {
        // A directory that vanished or cannot be read lists as empty.
        let Ok(names) = read_names(dir) else { return };
        for name in names {
            if out.truncated {
                return;
            }
            logical.push(name);
            let name = logical.last().cloned().unwrap_or_default();
            if !self.is_forbidden(logical) {
                self.list_one(dir, prefix, &name, logical, depth, out);
            }
            logical.pop();
        }
    }

    fn list_one(
        &self,
        dir: BorrowedFd<'_>,
        prefix: &str,
        name: &[u8],
        logical: &mut Vec<Vec<u8>>,
        depth: u32,
        out: &mut Listing,
    ) {
        let Ok(c) = cstring(name) else { return };
        let Ok(st) = lstatat(dir, &c) else { return };
        if out.entries.len() >= MAX_LIST_ENTRIES {
            out.truncated = true;
            return;
        }
        let path = if prefix == "/" {
            format!("/{}", String::from_utf8_lossy(name))
        } else {
            format!("{prefix}/{}", String::from_utf8_lossy(name))
        };
        let link = if is_type(&st, libc::S_IFLNK) {
            readlinkat(dir, &c).ok()
        } else {
            None
        };
        out.entries
            .push(file_info(path.clone(), name, &st, link.as_deref()));
        if depth > 1 && is_type(&st, libc::S_IFDIR) {
            if let Ok(child) = openat(dir, &c, O_PATH_NOFOLLOW | libc::O_DIRECTORY, 0) {
                self.list_dir(child.as_fd(), &path, logical, depth - 1, out);
            }
        }
    }

    /// Opens a regular file for reading (following links inside the root).
    /// Directories, devices, fifos and sockets are refused without being opened
    /// for I/O.
    pub fn open_file(&self, path: &str) -> Result<(File, FileInfo), FsError> {
        let (comps, t) = self.resolve_path(path, true)?;
        let shown = api_display(&comps);
        let info = self.info_of(shown.clone(), &t)?;
        match info.kind {
            FileType::File => {}
            FileType::Dir => {
                return Err(FsError::NotAFile(format!(
                    "{shown} is a directory; download it with format=tar"
                )))
            }
            _ => return Err(FsError::NotAFile(format!("{shown} is not a regular file"))),
        }
        let fd = t
            .open(libc::O_RDONLY | libc::O_NONBLOCK)
            .map_err(|e| os_err(&shown, e))?;
        let st = fstat(fd.as_fd()).map_err(|e| os_err(&shown, e))?;
        if !is_type(&st, libc::S_IFREG) {
            return Err(FsError::NotAFile(format!("{shown} is not a regular file")));
        }
        let info = file_info(shown, t.name_bytes(), &st, None);
        Ok((File::from(fd), info))
    }

    /// Writes `data` to `path` atomically: a temporary file in the same
    /// directory, owner and mode set, then renamed over the path. Links are
    /// followed inside the root; the parent directory must exist.
    pub fn write_file(
        &self,
        path: &str,
        attrs: Attrs,
        data: impl Read,
    ) -> Result<FileInfo, FsError> {
        let (comps, t) = self.resolve_path(path, true)?;
        let shown = api_display(&comps);
        let Some(name) = &t.name else {
            return Err(FsError::Conflict("/ is a directory".into()));
        };
        if t.st.is_some_and(|st| is_type(&st, libc::S_IFDIR)) {
            return Err(FsError::Conflict(format!("{shown} is a directory")));
        }
        let dir = t.dir.as_fd();
        let (tmp_name, file) = create_temp(dir).map_err(|e| os_err(&shown, e))?;
        let result = (|| {
            let mut file = file;
            copy_all(data, &mut file, u64::MAX, &shown, FILE_CHUNK)?;
            fchown(file.as_fd(), attrs.uid, attrs.gid).map_err(|e| os_err(&shown, e))?;
            fchmod(file.as_fd(), attrs.mode & 0o7777).map_err(|e| os_err(&shown, e))?;
            renameat(dir, &tmp_name, dir, name).map_err(|e| os_err(&shown, e))?;
            let st = fstat(file.as_fd()).map_err(|e| os_err(&shown, e))?;
            Ok(file_info(shown.clone(), t.name_bytes(), &st, None))
        })();
        if result.is_err() {
            let _ = unlinkat(dir, &tmp_name, false);
        }
        result
    }

    /// `mkdir -p` (following links inside the root): missing directories are
    /// created with `attrs` (intermediate ones with mode 0755); an existing
    /// directory is fine, an existing non-directory is a conflict.
    pub fn mkdir(&self, path: &str, attrs: Attrs) -> Result<FileInfo, FsError> {
        let comps = parse_path(path)?;
        let shown = api_display(&comps);
        let t = self.mkdir_target(&comps, attrs)?;
        self.info_of(shown, &t)
    }

    fn mkdir_target(&self, comps: &[String], attrs: Attrs) -> Result<Target, FsError> {
        let shown = api_display(comps);
        let how = Resolve {
            follow_last: true,
            mkdirs: Some(Attrs {
                mode: 0o755,
                ..attrs
            }),
        };
        for _ in 0..MAX_SYMLINK_HOPS {
            let t = self.resolve(comps, how)?;
            match (&t.name, t.st) {
                (_, Some(st)) if is_type(&st, libc::S_IFDIR) => return Ok(t),
                (_, Some(_)) => {
                    return Err(FsError::Conflict(format!(
                        "{shown} exists and is not a directory"
                    )))
                }
                (Some(name), None) => match make_dir(t.dir.as_fd(), name, attrs) {
                    Ok(()) => return self.resolve(comps, how),
                    // Someone made it meanwhile: look again.
                    Err(e) if e.raw_os_error() == Some(libc::EEXIST) => continue,
                    Err(e) => return Err(os_err(&shown, e)),
                },
                (None, None) => return Err(FsError::NotFound(shown)),
            }
        }
        Err(FsError::Conflict(format!(
            "{shown} kept changing during the operation"
        )))
    }

    /// Removes `path` (never following a link there); a directory needs
    /// `recursive` unless it is empty. Returns how many entries were removed.
    pub fn remove(&self, path: &str, recursive: bool) -> Result<u64, FsError> {
        let (comps, t) = self.resolve_path(path, false)?;
        let shown = api_display(&comps);
        let Some(name) = &t.name else {
            return Err(FsError::InvalidPath("refusing to remove /".into()));
        };
        let st =
            t.st.ok_or_else(|| FsError::NotFound(format!("{shown}: no such file or directory")))?;
        if !is_type(&st, libc::S_IFDIR) {
            unlinkat(t.dir.as_fd(), name, false).map_err(|e| os_err(&shown, e))?;
            return Ok(1);
        }
        if !recursive {
            return match unlinkat(t.dir.as_fd(), name, true) {
                Ok(()) => Ok(1),
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTEMPTY | libc::EEXIST)) => {
                    Err(FsError::Conflict(format!(
                        "{shown} is a non-empty directory; use recursive=true"
                    )))
                }
                Err(e) => Err(os_err(&shown, e)),
            };
        }
        let dir = open_child_dir(t.dir.as_fd(), name).map_err(|e| os_err(&shown, e))?;
        let mut logical = t.logical.clone();
        let n = self.remove_contents(dir.as_fd(), &shown, &mut logical, 1)?;
        drop(dir);
        match unlinkat(t.dir.as_fd(), name, true) {
            Ok(()) => Ok(n + 1),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(n),
            Err(e) => Err(os_err(&shown, e)),
        }
    }

    fn remove_contents(
        &self,
        dir: BorrowedFd<'_>,
        shown: &str,
        logical: &mut Vec<Vec<u8>>,
        depth: usize,
    ) -> Result<u64, FsError> {
        if depth > MAX_WALK_DEPTH {
            return Err(FsError::InvalidRequest(format!(
                "{shown}: directory tree deeper than {MAX_WALK_DEPTH} levels"
            )));
        }
        let names = read_names(dir).map_err(|e| os_err(shown, e))?;
        let mut n = 0u64;
        for name in names {
            logical.push(name);
            let result = self.remove_one(dir, shown, logical, depth);
            logical.pop();
            n += result?;
        }
        Ok(n)
    }

    fn remove_one(
        &self,
        dir: BorrowedFd<'_>,
        shown: &str,
        logical: &mut Vec<Vec<u8>>,
        depth: usize,
    ) -> Result<u64, FsError> {
        self.check_forbidden(logical)?;
        let here = display(logical);
        let c = cstring(logical.last().map(Vec::as_slice).unwrap_or_default())?;
        let Some(st) = lstat_opt(dir, &c).map_err(|e| os_err(&here, e))? else {
            return Ok(0);
        };
        let mut n = 0;
        if is_type(&st, libc::S_IFDIR) {
            match open_child_dir(dir, &c) {
                Ok(child) => n += self.remove_contents(child.as_fd(), shown, logical, depth + 1)?,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(0),
                Err(e) => return Err(os_err(&here, e)),
            }
        }
        match unlinkat(dir, &c, is_type(&st, libc::S_IFDIR)) {
            Ok(()) => Ok(n + 1),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(n),
            Err(e) => Err(os_err(&here, e)),
        }
    }

    /// Moves `from` to `to` (neither final component followed). Without
    /// `overwrite` an existing `to` is a conflict.
    pub fn rename(&self, from: &str, to: &str, overwrite: bool) -> Result<FileInfo, FsError> {
        let (_, f) = self.resolve_path(from, false)?;
        let (to_comps, t) = self.resolve_path(to, false)?;
        let (Some(fname), Some(tname)) = (&f.name, &t.name) else {
            return Err(FsError::InvalidPath("cannot move / or onto /".into()));
        };
        if f.st.is_none() {
            return Err(FsError::NotFound(format!(
                "{from}: no such file or directory"
            )));
        }
        let shown = api_display(&to_comps);
        let (fdir, tdir) = (f.dir.as_fd(), t.dir.as_fd());
        let moved = if overwrite {
            renameat(fdir, fname, tdir, tname)
        } else {
            match renameat_noreplace(fdir, fname, tdir, tname) {
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EINVAL)) => {
                    // No RENAME_NOREPLACE here: check, then rename.
                    match lstat_opt(tdir, tname) {
                        Ok(Some(_)) => Err(io::Error::from_raw_os_error(libc::EEXIST)),
                        Ok(None) => renameat(fdir, fname, tdir, tname),
                        Err(e) => Err(e),
                    }
                }
                other => other,
            }
        };
        moved.map_err(|e| match e.raw_os_error() {
            Some(libc::EEXIST) if !overwrite => {
                FsError::Conflict(format!("{shown} already exists; use overwrite=true"))
            }
            Some(libc::EEXIST | libc::ENOTEMPTY) => {
                FsError::Conflict(format!("{shown} is a non-empty directory"))
            }
            Some(libc::ENOTDIR | libc::EISDIR) => FsError::Conflict(format!(
                "cannot replace {shown}: a directory and a non-directory"
            )),
            Some(libc::EINVAL) => {
                FsError::InvalidRequest(format!("cannot move {from} into itself"))
            }
            _ => os_err(&shown, e),
        })?;
        let st = lstatat(tdir, tname).map_err(|e| os_err(&shown, e))?;
        let link = if is_type(&st, libc::S_IFLNK) {
            readlinkat(tdir, tname).ok()
        } else {
            None
        };
        Ok(file_info(shown, tname.to_bytes(), &st, link.as_deref()))
    }

    /// Writes an uncompressed tar of `path` (following a final link inside the
    /// root) to `out`: a directory's contents with names relative to it, or one
    /// entry for a file. Links inside are stored as links, hard links as hard
    /// links; devices, fifos, sockets and forbidden areas are skipped. On an
    /// error the archive is left without its end marker.
    pub fn pack_tar<W: Write>(&self, path: &str, out: W) -> Result<(), FsError> {
        let (comps, t) = self.resolve_path(path, true)?;
        let shown = api_display(&comps);
        let st =
            t.st.ok_or_else(|| FsError::NotFound(format!("{shown}: no such file or directory")))?;
        let mut b = tar::Builder::new(Poison {
            inner: out,
            poisoned: false,
        });
        let mut packer = Packer {
            root: self,
            links: std::collections::HashMap::new(),
        };
        let result = if is_type(&st, libc::S_IFDIR) {
            match t.open(libc::O_PATH | libc::O_DIRECTORY) {
                Ok(dir) => {
                    let mut logical = t.logical.clone();
                    packer.dir(&mut b, dir.as_fd(), &mut Vec::new(), &mut logical, 1)
                }
                Err(e) => Err(os_err(&shown, e)),
            }
        } else if is_type(&st, libc::S_IFREG) {
            let name = t.name_bytes().to_vec();
            packer.entry(&mut b, t.dir.as_fd(), &name, &name, &st)
        } else {
            Err(FsError::NotAFile(format!(
                "{shown} is neither a directory nor a regular file"
            )))
        };
        let result = result.and_then(|()| {
            b.finish()
                .and_then(|()| b.get_mut().inner.flush())
                .map_err(|e| os_err("writing the archive", e))
        });
        if result.is_err() {
            // Dropping the builder would write the end marker: an archive cut
            // short must not look complete.
            b.get_mut().poisoned = true;
        }
        result
    }

    /// Unpacks a tar into the root itself (see [`Root::unpack_tar_into`]).
    pub fn unpack_tar(&self, data: impl Read, limits: &Limits) -> Result<UnpackStats, FsError> {
        self.unpack_tar_into("/", data, limits)
    }

    /// Unpacks an untrusted tar into `dir` (created like `mkdir -p`). Regular
    /// files, directories, symbolic links and hard links to earlier files of the
    /// same archive; anything else, absolute names, `..`, and entries below a
    /// symbolic link are refused. On failure everything this unpack created is
    /// removed again and the error names the entry.
    pub fn unpack_tar_into(
        &self,
        dir: &str,
        data: impl Read,
        limits: &Limits,
    ) -> Result<UnpackStats, FsError> {
        let comps = parse_path(dir)?;
        let shown = api_display(&comps);
        let existed = self
            .resolve(
                &comps,
                Resolve {
                    follow_last: true,
                    mkdirs: None,
                },
            )
            .ok()
            .is_some_and(|t| t.st.is_some());
        let t = self.mkdir_target(&comps, Attrs::DIR)?;
        let base = t
            .open(libc::O_PATH | libc::O_DIRECTORY)
            .map_err(|e| os_err(&shown, e))?;
        let mut u = Unpacker {
            root: self,
            base,
            base_logical: t.logical.clone(),
            limits: *limits,
            created: Vec::new(),
            name_bytes: 0,
            files: HashSet::new(),
            hasher: RandomState::new(),
            dirs: Vec::new(),
            stats: UnpackStats {
                entries: 0,
                bytes: 0,
            },
            cache: None,
        };
        match u.run(data) {
            Ok(stats) => Ok(stats),
            Err(e) => {
                u.cleanup();
                if !existed {
                    if let Some(name) = &t.name {
                        let _ = unlinkat(t.dir.as_fd(), name, true);
                    }
                }
                Err(e)
            }
        }
    }
}

/// A writer that fails once poisoned.
struct Poison<W> {
    inner: W,
    poisoned: bool,
}

impl<W: Write> Write for Poison<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.poisoned {
            return Err(io::Error::other("archive abandoned"));
        }
        self.inner.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.poisoned {
            return Ok(());
        }
        self.inner.flush()
    }
}

/// Copies `from` to `to` through a buffer of `chunk` bytes, at most `limit` bytes (more is
/// [`FsError::TooLarge`]).
fn copy_all(
    mut from: impl Read,
    to: &mut File,
    limit: u64,
    shown: &str,
    chunk: usize,
) -> Result<u64, FsError> {
    let mut buf = vec![0u8; chunk];
    let mut total = 0u64;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(FsError::InvalidRequest(format!(
                    "{shown}: reading the upload failed: {e}"
                )))
            }
        };
        total += n as u64;
        if total > limit {
            return Err(FsError::TooLarge(format!(
                "{shown}: more than {limit} bytes"
            )));
        }
        to.write_all(&buf[..n]).map_err(|e| os_err(shown, e))?;
    }
}

fn create_temp(dir: BorrowedFd<'_>) -> io::Result<(CString, File)> {
    static N: AtomicU64 = AtomicU64::new(0);
    for _ in 0..100 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!(
            ".space-upload-{}-{}-{nanos}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let c = CString::new(name).map_err(io::Error::other)?;
        match openat(
            dir,
            &c,
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
            0o600,
        ) {
            Ok(fd) => return Ok((c, File::from(fd))),
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::from_raw_os_error(libc::EEXIST))
}

/// Reads exactly `left` bytes: zeros when the file shrank, nothing past `left` when it grew.
struct Exact<R> {
    inner: R,
    left: u64,
}

impl<R: Read> Read for Exact<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 || buf.is_empty() {
            return Ok(0);
        }
        let want = buf.len().min(self.left.min(usize::MAX as u64) as usize);
        let n = match self.inner.read(&mut buf[..want]) {
            Ok(0) => {
                buf[..want].fill(0);
                want
            }
            Ok(n) => n,
            Err(e) => return Err(e),
        };
        self.left -= n as u64;
        Ok(n)
    }
}

struct Packer<'a> {
    root: &'a Root,
    /// (device, inode) → archive name of files with several links.
    links: std::collections::HashMap<(u64, u64), Vec<u8>>,
}

impl Packer<'_> {
    fn dir<W: Write>(
        &mut self,
        b: &mut tar::Builder<W>,
        dir: BorrowedFd<'_>,
        rel: &mut Vec<u8>,
        logical: &mut Vec<Vec<u8>>,
        depth: usize,
    ) -> Result<(), FsError> {
        if depth > MAX_WALK_DEPTH {
            return Err(FsError::InvalidRequest(format!(
                "{}: directory tree deeper than {MAX_WALK_DEPTH} levels",
                display(logical)
            )));
        }
        let names = read_names(dir).map_err(|e| os_err(&display(logical), e))?;
        for name in names {
            logical.push(name.clone());
            let r = self.child(b, dir, rel, &name, logical, depth);
            logical.pop();
            r?;
        }
        Ok(())
    }

    fn child<W: Write>(
        &mut self,
        b: &mut tar::Builder<W>,
        dir: BorrowedFd<'_>,
        rel: &mut Vec<u8>,
        name: &[u8],
        logical: &mut Vec<Vec<u8>>,
        depth: usize,
    ) -> Result<(), FsError> {
        if self.root.is_forbidden(logical) {
            return Ok(());
        }
        let c = cstring(name)?;
        let Some(st) = lstat_opt(dir, &c).map_err(|e| os_err(&display(logical), e))? else {
            return Ok(());
        };
        let len = rel.len();
        if !rel.is_empty() {
            rel.push(b'/');
        }
        rel.extend_from_slice(name);
        let r = (|| {
            self.entry(b, dir, name, rel, &st)?;
            if is_type(&st, libc::S_IFDIR) {
                match openat(dir, &c, O_PATH_NOFOLLOW | libc::O_DIRECTORY, 0) {
                    Ok(child) => self.dir(b, child.as_fd(), rel, logical, depth + 1)?,
                    // Gone or replaced since we looked: skip it.
                    Err(e)
                        if matches!(
                            e.raw_os_error(),
                            Some(libc::ENOENT | libc::ENOTDIR | libc::ELOOP)
                        ) => {}
                    Err(e) => return Err(os_err(&display(logical), e)),
                }
            }
            Ok(())
        })();
        rel.truncate(len);
        r
    }

    /// One archive member for `name` in `dir`, stored as `rel`.
    fn entry<W: Write>(
        &mut self,
        b: &mut tar::Builder<W>,
        dir: BorrowedFd<'_>,
        name: &[u8],
        rel: &[u8],
        st: &libc::stat,
    ) -> Result<(), FsError> {
        let shown = String::from_utf8_lossy(rel).into_owned();
        let werr = |e: io::Error| os_err("writing the archive", e);
        let mut h = tar::Header::new_gnu();
        h.set_mode(st.st_mode & 0o7777);
        h.set_uid(u64::from(st.st_uid));
        h.set_gid(u64::from(st.st_gid));
        h.set_mtime(st.st_mtime.max(0) as u64);
        h.set_size(0);
        let path = Path::new(OsStr::from_bytes(rel));
        let c = cstring(name)?;
        match st.st_mode & libc::S_IFMT {
            libc::S_IFDIR => {
                h.set_entry_type(tar::EntryType::Directory);
                b.append_data(&mut h, path, io::empty()).map_err(werr)
            }
            libc::S_IFLNK => {
                let target = match readlinkat(dir, &c) {
                    Ok(t) => t,
                    Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EINVAL)) => {
                        return Ok(())
                    }
                    Err(e) => return Err(os_err(&shown, e)),
                };
                h.set_entry_type(tar::EntryType::Symlink);
                b.append_link(&mut h, path, Path::new(OsStr::from_bytes(&target)))
                    .map_err(werr)
            }
            libc::S_IFREG => {
                if st.st_nlink > 1 {
                    let key = (st.st_dev, st.st_ino);
                    if let Some(first) = self.links.get(&key) {
                        h.set_entry_type(tar::EntryType::Link);
                        return b
                            .append_link(&mut h, path, Path::new(OsStr::from_bytes(first)))
                            .map_err(werr);
                    }
                    self.links.insert(key, rel.to_vec());
                }
                let fd = match openat(
                    dir,
                    &c,
                    libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK,
                    0,
                ) {
                    Ok(fd) => fd,
                    Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ELOOP)) => {
                        return Ok(())
                    }
                    Err(e) => return Err(os_err(&shown, e)),
                };
                let fst = fstat(fd.as_fd()).map_err(|e| os_err(&shown, e))?;
                if !is_type(&fst, libc::S_IFREG) {
                    return Ok(());
                }
                let size = fst.st_size.max(0) as u64;
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(size);
                // Big reads: each one is a syscall, and inside gVisor those are what cost.
                let data = io::BufReader::with_capacity(
                    1 << 20,
                    Exact {
                        inner: File::from(fd),
                        left: size,
                    },
                );
                b.append_data(&mut h, path, data).map_err(werr)
            }
            // Devices, fifos and sockets have no place in an archive of files.
            _ => Ok(()),
        }
    }
}

/// What kind of member an archive entry is.
enum Kind {
    File,
    Dir,
    Symlink(Vec<u8>),
    HardLink(Vec<Vec<u8>>),
}

struct Unpacker<'a> {
    root: &'a Root,
    base: OwnedFd,
    base_logical: Vec<Vec<u8>>,
    limits: Limits,
    /// What this unpack created, in order: relative components, is a directory.
    created: Vec<(Vec<Vec<u8>>, bool)>,
    name_bytes: u64,
    /// Hashes of the regular files written (hard links may only point at these).
    files: HashSet<u64>,
    hasher: RandomState,
    /// Directory metadata, applied at the end (children change mtimes).
    dirs: Vec<(Vec<Vec<u8>>, Attrs, i64)>,
    stats: UnpackStats,
    /// The last parent directory used.
    cache: Option<(Vec<Vec<u8>>, OwnedFd)>,
}

/// Splits an archive name into safe relative components.
fn entry_components(name: &[u8], what: &str) -> Result<Vec<Vec<u8>>, FsError> {
    if name.len() > MAX_PATH_BYTES {
        return Err(FsError::InvalidPath(format!(
            "{what} is longer than {MAX_PATH_BYTES} bytes"
        )));
    }
    if name.contains(&0) {
        return Err(FsError::UnsafeArchive(format!(
            "{what} contains a NUL byte"
        )));
    }
    if name.first() == Some(&b'/') {
        return Err(FsError::UnsafeArchive(format!("{what} is absolute")));
    }
    let mut comps = Vec::new();
    for c in name.split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => {
                return Err(FsError::UnsafeArchive(format!(
                    "{what} contains a '..' component"
                )))
            }
            c if c.len() > MAX_NAME_BYTES => {
                return Err(FsError::InvalidPath(format!(
                    "{what} has a component longer than {MAX_NAME_BYTES} bytes"
                )))
            }
            c => comps.push(c.to_vec()),
        }
    }
    Ok(comps)
}

/// Reads an extension member's data, at most `max` bytes.
fn read_bounded(r: &mut impl Read, size: u64, max: u64, what: &str) -> Result<Vec<u8>, FsError> {
    if size > max {
        return Err(FsError::UnsafeArchive(format!(
            "{what} of {size} bytes is too large"
        )));
    }
    let mut v = Vec::with_capacity(size as usize);
    r.take(max)
        .read_to_end(&mut v)
        .map_err(|e| FsError::InvalidRequest(format!("reading the archive: {e}")))?;
    while v.last() == Some(&0) {
        v.pop();
    }
    Ok(v)
}

/// Key/value records of a PAX extended header.
type PaxRecords = Vec<(Vec<u8>, Vec<u8>)>;

fn pax_records(data: &[u8]) -> Result<PaxRecords, FsError> {
    let mut out = Vec::new();
    for ext in tar::PaxExtensions::new(data) {
        let ext = ext.map_err(|_| FsError::UnsafeArchive("malformed PAX header".into()))?;
        out.push((ext.key_bytes().to_vec(), ext.value_bytes().to_vec()));
    }
    Ok(out)
}

impl Unpacker<'_> {
    fn run(&mut self, data: impl Read) -> Result<UnpackStats, FsError> {
        let mut archive = tar::Archive::new(data);
        let entries = archive
            .entries()
            .map_err(|e| FsError::InvalidRequest(format!("reading the archive: {e}")))?
            .raw(true);
        let mut long_name: Option<Vec<u8>> = None;
        let mut long_link: Option<Vec<u8>> = None;
        let mut pax: Option<PaxRecords> = None;
        for entry in entries {
            let mut entry = entry.map_err(|e| {
                FsError::InvalidRequest(format!(
                    "reading the archive after {} entries: {e}",
                    self.stats.entries
                ))
            })?;
            let ty = entry.header().entry_type();
            let size = entry.size();
            match ty {
                tar::EntryType::GNULongName => {
                    if size > MAX_PATH_BYTES as u64 + 1 {
                        return Err(FsError::InvalidPath(format!(
                            "entry {}: a name is longer than {MAX_PATH_BYTES} bytes",
                            self.stats.entries + 1
                        )));
                    }
                    long_name = Some(read_bounded(
                        &mut entry,
                        size,
                        MAX_PATH_BYTES as u64 + 1,
                        "a long name",
                    )?);
                    continue;
                }
                tar::EntryType::GNULongLink => {
                    long_link = Some(read_bounded(
                        &mut entry,
                        size,
                        MAX_LINK_TARGET as u64 + 1,
                        "a long link name",
                    )?);
                    continue;
                }
                tar::EntryType::XHeader => {
                    let data = read_bounded(&mut entry, size, MAX_PAX_BYTES, "a PAX header")?;
                    pax = Some(pax_records(&data)?);
                    continue;
                }
                tar::EntryType::XGlobalHeader => continue,
                _ => {}
            }
            self.stats.entries += 1;
            if self.stats.entries > self.limits.max_entries {
                return Err(FsError::TooLarge(format!(
                    "the archive has more than {} entries",
                    self.limits.max_entries
                )));
            }
            let pax = pax.take().unwrap_or_default();
            let pax_get = |k: &[u8]| pax.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone());
            let name = long_name
                .take()
                .or_else(|| pax_get(b"path"))
                .unwrap_or_else(|| entry.path_bytes().into_owned());
            let link = long_link
                .take()
                .or_else(|| pax_get(b"linkpath"))
                .or_else(|| entry.link_name_bytes().map(|l| l.into_owned()));
            let shown = String::from_utf8_lossy(&name).into_owned();
            let prefix = format!("entry {shown:?}: ");
            let r = (|| {
                let pax_num = |k: &[u8]| -> Result<Option<u64>, FsError> {
                    match pax_get(k) {
                        None => Ok(None),
                        Some(v) => {
                            let s = String::from_utf8_lossy(&v);
                            let int = s.split('.').next().unwrap_or("");
                            int.parse()
                                .map(Some)
                                .map_err(|_| FsError::UnsafeArchive("malformed PAX number".into()))
                        }
                    }
                };
                if let Some(s) = pax_num(b"size")? {
                    if s != size {
                        return Err(FsError::UnsafeArchive(
                            "PAX size disagrees with the header".into(),
                        ));
                    }
                }
                // Numeric fields some writers leave empty read as 0 (mode: 0644).
                let h = entry.header();
                let mut attrs = Attrs {
                    mode: h.mode().unwrap_or(0o644) & 0o7777,
                    uid: pax_num(b"uid")?.unwrap_or_else(|| h.uid().unwrap_or(0)) as u32,
                    gid: pax_num(b"gid")?.unwrap_or_else(|| h.gid().unwrap_or(0)) as u32,
                };
                let mtime = pax_num(b"mtime")?.unwrap_or_else(|| h.mtime().unwrap_or(0));
                let mtime = i64::try_from(mtime).unwrap_or(i64::MAX);
                if !self.limits.same_owner {
                    attrs.uid = 0;
                    attrs.gid = 0;
                    attrs.mode &= 0o1777;
                }
                let kind = match ty {
                    tar::EntryType::Regular | tar::EntryType::Continuous => Kind::File,
                    tar::EntryType::Directory => Kind::Dir,
                    tar::EntryType::Symlink => {
                        let target = link.ok_or_else(|| {
                            FsError::UnsafeArchive("symbolic link without a target".into())
                        })?;
                        if target.is_empty()
                            || target.len() > MAX_LINK_TARGET
                            || target.contains(&0)
                        {
                            return Err(FsError::UnsafeArchive(
                                "invalid symbolic link target".into(),
                            ));
                        }
                        Kind::Symlink(target)
                    }
                    tar::EntryType::Link => {
                        let target = link.ok_or_else(|| {
                            FsError::UnsafeArchive("hard link without a target".into())
                        })?;
                        Kind::HardLink(entry_components(&target, "the hard link target")?)
                    }
                    tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo
                        if self.limits.skip_special =>
                    {
                        return Ok(())
                    }
                    tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo => {
                        return Err(FsError::UnsafeArchive(
                            "device nodes and fifos are not allowed".into(),
                        ))
                    }
                    other => {
                        return Err(FsError::UnsafeArchive(format!(
                            "unsupported entry type {:?}",
                            other.as_byte() as char
                        )))
                    }
                };
                let comps = entry_components(&name, "the name")?;
                self.one(comps, kind, attrs, mtime, &mut entry, size)
            })();
            r.map_err(|e| e.prefixed(&prefix))?;
        }
        self.finish_dirs()?;
        Ok(self.stats)
    }

    fn hash(&self, comps: &[Vec<u8>]) -> u64 {
        self.hasher.hash_one(comps)
    }

    /// Counts names kept in memory against [`Limits::max_name_bytes`].
    fn charge(&mut self, comps: &[Vec<u8>]) -> Result<(), FsError> {
        self.name_bytes += comps.iter().map(|c| c.len() as u64 + 1).sum::<u64>();
        if self.name_bytes > self.limits.max_name_bytes {
            return Err(FsError::TooLarge(
                "the archive's names are too long in total".into(),
            ));
        }
        Ok(())
    }

    fn remember(&mut self, comps: &[Vec<u8>], is_dir: bool) -> Result<(), FsError> {
        self.charge(comps)?;
        self.created.push((comps.to_vec(), is_dir));
        Ok(())
    }

    /// Opens the directory `comps` below the base, creating missing ones and
    /// never following a link.
    fn parent(&mut self, comps: &[Vec<u8>], create: bool) -> Result<OwnedFd, FsError> {
        if let Some((c, fd)) = &self.cache {
            if c[..] == comps[..] {
                return dup(fd.as_fd());
            }
        }
        let mut cur = dup(self.base.as_fd())?;
        for (i, comp) in comps.iter().enumerate() {
            let name = cstring(comp)?;
            let here = String::from_utf8_lossy(&comps[..=i].join(&b'/')).into_owned();
            let fd = match openat(cur.as_fd(), &name, O_PATH_NOFOLLOW, 0) {
                Ok(fd) => fd,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) && create => {
                    self.remember(&comps[..=i], true)?;
                    make_dir(cur.as_fd(), &name, Attrs::DIR).map_err(|e| os_err(&here, e))?;
                    openat(cur.as_fd(), &name, O_PATH_NOFOLLOW, 0).map_err(|e| os_err(&here, e))?
                }
                Err(e) => return Err(os_err(&here, e)),
            };
            let st = fstat(fd.as_fd()).map_err(|e| os_err(&here, e))?;
            if is_type(&st, libc::S_IFLNK) {
                return Err(FsError::UnsafeArchive(format!(
                    "{here} is a symbolic link; extraction never follows one"
                )));
            }
            if !is_type(&st, libc::S_IFDIR) {
                return Err(FsError::Conflict(format!("{here} is not a directory")));
            }
            cur = fd;
        }
        self.cache = Some((comps.to_vec(), dup(cur.as_fd())?));
        Ok(cur)
    }

    fn one(
        &mut self,
        comps: Vec<Vec<u8>>,
        kind: Kind,
        attrs: Attrs,
        mtime: i64,
        data: &mut impl Read,
        size: u64,
    ) -> Result<(), FsError> {
        let Some((last, parents)) = comps.split_last() else {
            // `.` or `./`: the target directory itself; left as it is.
            return Ok(());
        };
        let mut logical = self.base_logical.clone();
        logical.extend(comps.iter().cloned());
        self.root.check_forbidden(&logical)?;
        let dir = self.parent(parents, true)?;
        let dir = dir.as_fd();
        let name = cstring(last)?;
        let here = "the target";
        let existing = lstat_opt(dir, &name).map_err(|e| os_err(here, e))?;
        let existing_dir = existing.is_some_and(|st| is_type(&st, libc::S_IFDIR));
        if !matches!(kind, Kind::Dir) {
            if existing_dir {
                return Err(FsError::Conflict("a directory is in the way".into()));
            }
            if existing.is_some() {
                unlinkat(dir, &name, false).map_err(|e| os_err(here, e))?;
            }
        }
        match kind {
            Kind::Dir => {
                if existing.is_some() && !existing_dir {
                    return Err(FsError::Conflict("exists and is not a directory".into()));
                }
                if existing.is_none() {
                    self.remember(&comps, true)?;
                    make_dir(dir, &name, Attrs::DIR).map_err(|e| os_err(here, e))?;
                }
                self.charge(&comps)?;
                self.dirs.push((comps, attrs, mtime));
            }
            Kind::File => {
                if self.stats.bytes.saturating_add(size) > self.limits.max_bytes {
                    return Err(FsError::TooLarge(format!(
                        "the archive holds more than {} bytes",
                        self.limits.max_bytes
                    )));
                }
                self.remember(&comps, false)?;
                let fd = openat(
                    dir,
                    &name,
                    libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
                    0o600,
                )
                .map_err(|e| os_err(here, e))?;
                let mut file = File::from(fd);
                let left = self.limits.max_bytes - self.stats.bytes;
                let n = copy_all(data.take(size), &mut file, left, here, CHUNK).map_err(
                    |e| match e {
                        FsError::InvalidRequest(m) => FsError::InvalidRequest(
                            m.replace("reading the upload failed", "reading the archive failed"),
                        ),
                        e => e,
                    },
                )?;
                if n != size {
                    return Err(FsError::InvalidRequest("the archive ends early".into()));
                }
                self.stats.bytes += n;
                fchown(file.as_fd(), attrs.uid, attrs.gid).map_err(|e| os_err(here, e))?;
                fchmod(file.as_fd(), attrs.mode).map_err(|e| os_err(here, e))?;
                futimens(file.as_fd(), mtime).map_err(|e| os_err(here, e))?;
                let h = self.hash(&comps);
                self.files.insert(h);
            }
            Kind::Symlink(target) => {
                self.remember(&comps, false)?;
                let t = cstring(&target)?;
                // SAFETY: valid descriptor and names.
                cvt(unsafe { libc::symlinkat(t.as_ptr(), dir.as_raw_fd(), name.as_ptr()) })
                    .map_err(|e| os_err(here, e))?;
                fchownat_nofollow(dir, &name, attrs.uid, attrs.gid).map_err(|e| os_err(here, e))?;
                lutimensat(dir, &name, mtime).map_err(|e| os_err(here, e))?;
            }
            Kind::HardLink(target) => {
                let Some((tlast, tparents)) = target.split_last() else {
                    return Err(FsError::UnsafeArchive("empty hard link target".into()));
                };
                if !self.files.contains(&self.hash(&target)) {
                    return Err(FsError::UnsafeArchive(
                        "a hard link must point at an earlier file of the same archive".into(),
                    ));
                }
                let tdir = self.parent(tparents, false)?;
                let tname = cstring(tlast)?;
                let tst =
                    lstatat(tdir.as_fd(), &tname).map_err(|e| os_err("the link target", e))?;
                if !is_type(&tst, libc::S_IFREG) {
                    return Err(FsError::UnsafeArchive(
                        "a hard link must point at a regular file".into(),
                    ));
                }
                self.remember(&comps, false)?;
                // SAFETY: valid descriptors and names; flags 0 never follows a link.
                cvt(unsafe {
                    libc::linkat(
                        tdir.as_raw_fd(),
                        tname.as_ptr(),
                        dir.as_raw_fd(),
                        name.as_ptr(),
                        0,
                    )
                })
                .map_err(|e| os_err(here, e))?;
                // gVisor's overlay (runsc 2024-07-29) resets the owner of a file it
                // makes a hard link to; give the inode its owner back.
                fchownat_nofollow(dir, &name, tst.st_uid, tst.st_gid)
                    .map_err(|e| os_err(here, e))?;
            }
        }
        Ok(())
    }

    fn finish_dirs(&mut self) -> Result<(), FsError> {
        let dirs = std::mem::take(&mut self.dirs);
        for (comps, attrs, mtime) in dirs.into_iter().rev() {
            let shown = String::from_utf8_lossy(&comps.join(&b'/')).into_owned();
            let r = (|| {
                let Some((last, parents)) = comps.split_last() else {
                    return Ok(());
                };
                let dir = self.parent(parents, false)?;
                let fd = open_child_dir(dir.as_fd(), &cstring(last)?)
                    .map_err(|e| os_err("the directory", e))?;
                fchown(fd.as_fd(), attrs.uid, attrs.gid).map_err(|e| os_err("chown", e))?;
                fchmod(fd.as_fd(), attrs.mode).map_err(|e| os_err("chmod", e))?;
                futimens(fd.as_fd(), mtime).map_err(|e| os_err("utimens", e))
            })();
            r.map_err(|e| e.prefixed(&format!("entry {shown:?}: ")))?;
        }
        Ok(())
    }

    /// Best effort: removes what this unpack created, newest first.
    fn cleanup(&mut self) {
        self.cache = None;
        let created = std::mem::take(&mut self.created);
        for (comps, is_dir) in created.into_iter().rev() {
            let Some((last, parents)) = comps.split_last() else {
                continue;
            };
            let Ok(dir) = self.parent(parents, false) else {
                continue;
            };
            let Ok(name) = cstring(last) else { continue };
            let _ = unlinkat(dir.as_fd(), &name, is_dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    struct Tmp(std::path::PathBuf);

    impl Tmp {
        fn new(tag: &str) -> Tmp {
            static N: AtomicU64 = AtomicU64::new(0);
            let p = std::env::temp_dir().join(format!(
                "space-fs-unit-{tag}-{}-{}",
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
    fn paths_are_validated() {
        assert_eq!(parse_path("/a//b/./c/").unwrap(), vec!["a", "b", "c"]);
        assert!(parse_path("/").unwrap().is_empty());
        assert!(matches!(parse_path("a"), Err(FsError::InvalidPath(_))));
        assert!(matches!(
            parse_path("/a/../b"),
            Err(FsError::InvalidPath(_))
        ));
        assert!(matches!(parse_path("/a\0b"), Err(FsError::InvalidPath(_))));
        assert!(matches!(
            parse_path(&format!("/{}", "x".repeat(256))),
            Err(FsError::InvalidPath(_))
        ));
        assert!(parse_path(&format!("/{}", "x".repeat(255))).is_ok());
        let long = "/abc".repeat(1025);
        assert!(matches!(parse_path(&long), Err(FsError::InvalidPath(_))));
    }

    #[test]
    fn os_errors_map_to_api_errors() {
        let e = |n| os_err("x", io::Error::from_raw_os_error(n));
        assert_eq!(e(libc::ENOSPC).status(), 507);
        assert_eq!(e(libc::EDQUOT).code(), "no_space");
        assert_eq!(e(libc::ENOENT).status(), 404);
        assert_eq!(e(libc::EEXIST).status(), 409);
        assert_eq!(e(libc::EACCES).code(), "forbidden_path");
        assert_eq!(e(libc::EIO).status(), 500);
        assert!(e(libc::EIO).message().contains("x: "));
    }

    #[test]
    fn links_resolve_inside_the_root() {
        let t = Tmp::new("links");
        let r = &t.0;
        std::fs::create_dir_all(r.join("etc")).unwrap();
        std::fs::write(r.join("etc/marker"), b"inside").unwrap();
        std::fs::create_dir_all(r.join("tmp/deep/er")).unwrap();
        symlink("/etc", r.join("tmp/abs")).unwrap();
        symlink("../../../../../../../etc", r.join("tmp/deep/er/rel")).unwrap();
        symlink("loop2", r.join("loop1")).unwrap();
        symlink("loop1", r.join("loop2")).unwrap();
        symlink("/", r.join("tmp/top")).unwrap();
        let root = Root::open(r).unwrap();

        let (mut f, _) = root.open_file("/tmp/abs/marker").unwrap();
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        assert_eq!(s, "inside");
        let (mut f, _) = root.open_file("/tmp/deep/er/rel/marker").unwrap();
        s.clear();
        f.read_to_string(&mut s).unwrap();
        assert_eq!(s, "inside");
        // The host's /etc/passwd is never reached.
        assert!(matches!(
            root.open_file("/tmp/abs/passwd"),
            Err(FsError::NotFound(_))
        ));
        assert_eq!(root.stat("/tmp/abs").unwrap().kind, FileType::Symlink);
        assert_eq!(
            root.stat("/tmp/abs").unwrap().link_target.as_deref(),
            Some("/etc")
        );
        assert_eq!(root.stat_followed("/tmp/abs").unwrap().kind, FileType::Dir);
        assert_eq!(root.stat_followed("/tmp/top").unwrap().kind, FileType::Dir);
        match root.open_file("/loop1") {
            Err(FsError::InvalidPath(m)) => assert!(m.contains("too many levels"), "{m}"),
            other => panic!("{other:?}"),
        }
        // A write through an absolute link lands inside the root.
        root.write_file("/tmp/abs/new", Attrs::FILE, &b"x"[..])
            .unwrap();
        assert!(r.join("etc/new").exists());
    }

    #[test]
    fn forbidden_areas_are_refused_however_reached() {
        let t = Tmp::new("forbidden");
        let r = &t.0;
        std::fs::create_dir_all(r.join("proc/1")).unwrap();
        std::fs::create_dir_all(r.join("dev")).unwrap();
        std::fs::write(r.join("dev/null"), b"").unwrap();
        symlink("/dev/null", r.join("devnull")).unwrap();
        symlink("../proc", r.join("p")).unwrap();
        let root = Root::open(r)
            .unwrap()
            .with_forbidden(SANDBOX_FORBIDDEN)
            .unwrap();
        assert!(matches!(root.stat("/proc"), Err(FsError::Forbidden(_))));
        assert!(matches!(
            root.open_file("/devnull"),
            Err(FsError::Forbidden(_))
        ));
        assert!(matches!(root.list("/p/1", 1), Err(FsError::Forbidden(_))));
        // The link itself may be looked at.
        assert_eq!(root.stat("/devnull").unwrap().kind, FileType::Symlink);
        let names: Vec<String> = root
            .list("/", 1)
            .unwrap()
            .entries
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert_eq!(names, vec!["devnull", "p"]);
    }

    #[test]
    fn unpack_refuses_escapes() {
        let t = Tmp::new("unpack");
        std::fs::create_dir_all(t.0.join("out")).unwrap();
        let root = Root::open(&t.0).unwrap();
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(1);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_mode(0o644);
        b.append_data(&mut h, "ok", &b"1"[..]).unwrap();
        // `..` written raw: the tar crate refuses to build it.
        let mut h = tar::Header::new_gnu();
        h.as_gnu_mut().unwrap().name[..4].copy_from_slice(b"../x");
        h.set_size(0);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        b.append(&h, io::empty()).unwrap();
        let data = b.into_inner().unwrap();
        let err = root
            .unpack_tar_into("/out", &data[..], &Limits::default())
            .unwrap_err();
        assert!(matches!(err, FsError::UnsafeArchive(_)), "{err:?}");
        assert!(err.message().contains("../x"), "{}", err.message());
        assert!(!t.0.join("out/ok").exists(), "cleanup");
        assert!(!t.0.join("x").exists());
    }
}
