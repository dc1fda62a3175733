//! The microVM guest on disk: the kernel and initramfs `scripts/build-guest.sh` builds, and
//! the per-boot initramfs that carries the agent.
//!
//! The guest's `/init` (`scripts/guest/init.sh`) expects the agent at `/space-agent`. The host
//! does not rebuild the initramfs for that: the kernel unpacks concatenated archives, so
//! [`initramfs_with_agent`] appends a small uncompressed newc archive holding the agent to
//! the built (gzip-compressed) one.

use std::fs::{self, File};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

/// Name of the agent inside the initramfs.
pub const AGENT_PATH_IN_INITRAMFS: &str = "space-agent";
/// Name of the agent's token inside a sandbox's own initramfs ([`initramfs_with_token`]).
pub const TOKEN_PATH_IN_INITRAMFS: &str = "space-token";
/// The guest files in a directory built by `scripts/build-guest.sh`.
pub const KERNEL_FILE: &str = "vmlinuz";
pub const INITRAMFS_FILE: &str = "initramfs.cpio.gz";
pub const VERSION_FILE: &str = "VERSION";

/// The kernel and base initramfs of the microVM guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestFiles {
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    /// The first line of `VERSION`: `<kernel package>=<version> <hash of the initramfs inputs>`.
    pub version: String,
}

impl GuestFiles {
    /// The guest files in `dir`, or an error that says how to build them.
    pub fn find(dir: &Path) -> Result<GuestFiles, String> {
        let hint = || {
            format!(
                "build them with `scripts/build-guest.sh {}` (scripts/setup.sh does)",
                dir.display()
            )
        };
        let file = |name: &str| -> Result<PathBuf, String> {
            let path = dir.join(name);
            match fs::metadata(&path) {
                Ok(m) if m.is_file() && m.len() > 0 => Ok(path),
                Ok(_) => Err(format!(
                    "microVM guest file {} is empty or not a file; {}",
                    path.display(),
                    hint()
                )),
                Err(e) => Err(format!(
                    "microVM guest file {} is missing ({e}); {}",
                    path.display(),
                    hint()
                )),
            }
        };
        let kernel = file(KERNEL_FILE)?;
        let initramfs = file(INITRAMFS_FILE)?;
        let version_path = file(VERSION_FILE)?;
        let version = fs::read_to_string(&version_path)
            .map_err(|e| format!("cannot read {}: {e}; {}", version_path.display(), hint()))?
            .lines()
            .next()
            .unwrap_or_default()
            .trim()
            .to_string();
        if version.is_empty() {
            return Err(format!("{} is empty; {}", version_path.display(), hint()));
        }
        Ok(GuestFiles {
            kernel,
            initramfs,
            version,
        })
    }
}

/// The host's TSC frequency in kHz (rounded to whole MHz), measured against the monotonic
/// clock; `None` where there is no usable TSC.
///
/// Under TCG the guest reads the host's TSC, and Debian's kernel calibrates it against the
/// emulated PIT, which fails now and then on a busy host (measured: 3 boots in 8); the
/// kernel then waits for timer ticks that never come and hangs before `/init`. A driver
/// using TCG passes `tsc_early_khz=<this>` on the kernel command line, which skips that
/// calibration (0 hangs in 10 boots).
pub fn host_tsc_khz() -> Option<u64> {
    #[cfg(target_arch = "x86_64")]
    {
        let sample = || {
            let start = std::time::Instant::now();
            // SAFETY: rdtsc has no preconditions on x86-64.
            let t0 = unsafe { core::arch::x86_64::_rdtsc() };
            std::thread::sleep(std::time::Duration::from_millis(25));
            // SAFETY: as above.
            let t1 = unsafe { core::arch::x86_64::_rdtsc() };
            let nanos = start.elapsed().as_nanos() as u64;
            let ticks = u128::from(t1.checked_sub(t0)?);
            u64::try_from(ticks * 1_000_000 / u128::from(nanos.max(1))).ok()
        };
        // The lower of two samples: a preemption between the two reads only inflates one.
        let khz = sample()?.min(sample()?);
        let mhz = (khz + 500) / 1000;
        (mhz >= 100).then_some(mhz * 1000)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// Writes `out`: the bytes of `base`, zero padding to a 4-byte boundary (the kernel looks
/// for a following archive only at such an offset), then an uncompressed newc archive with
/// `/space-agent` (the bytes of `agent`, mode 0755) and the trailer. Atomic: `out` is
/// either the complete new file or untouched.
pub fn initramfs_with_agent(base: &Path, agent: &Path, out: &Path) -> io::Result<()> {
    let tmp = temp_path(out);
    let result = write_initramfs(base, agent, &tmp).and_then(|()| fs::rename(&tmp, out));
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Writes a sandbox's own initramfs to `out` (mode 0600): the bytes of `base` (an initramfs
/// with the agent), padding, then a newc archive with `/space-token` (mode 0600) holding
/// `token`. This keeps the token off the kernel command line (`/proc/cmdline` in the guest,
/// QEMU's argv on the host); the guest's `/init` hands it to the agent, which deletes it.
/// Returns where the token's bytes are in `out`, for [`scrub_token`]. Atomic like
/// [`initramfs_with_agent`]; a copy-on-write or in-kernel copy where the filesystem has one.
pub fn initramfs_with_token(base: &Path, token: &str, out: &Path) -> io::Result<u64> {
    use std::os::unix::fs::PermissionsExt;
    let tmp = temp_path(out);
    let result = (|| {
        let base_len = fs::copy(base, &tmp)?;
        // Private before the token goes in.
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o600))?;
        let size = u32::try_from(token.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "token too long"))?;
        let mut w = fs::OpenOptions::new().append(true).open(&tmp)?;
        let pad = pad4(base_len as usize);
        let mut archive = vec![0u8; pad];
        let header = write_newc_header(&mut archive, TOKEN_PATH_IN_INITRAMFS, 0o100_600, 1, size)?;
        let token_at = base_len + (pad + header) as u64;
        archive.extend_from_slice(token.as_bytes());
        let written = header + token.len();
        archive.extend_from_slice(&[0u8; 4][..pad4(written)]);
        write_newc_trailer(&mut archive, written + pad4(written))?;
        w.write_all(&archive)?;
        w.sync_all()?;
        fs::rename(&tmp, out)?;
        Ok(token_at)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Overwrites the `len` token bytes at `at` of a sandbox's initramfs with `0` characters,
/// in place (the file keeps its size and stays a valid archive), once the guest has read it.
pub fn scrub_token(path: &Path, at: u64, len: usize) -> io::Result<()> {
    use std::io::{Seek, SeekFrom};
    let mut f = fs::OpenOptions::new().write(true).open(path)?;
    f.seek(SeekFrom::Start(at))?;
    f.write_all(&vec![b'0'; len])?;
    f.sync_all()
}

/// A name beside `out` for writing it before a rename: distinct between concurrent writers.
pub(crate) fn temp_path(out: &Path) -> PathBuf {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "initramfs".into());
    let mut random = [0u8; 6];
    // A fixed suffix is fine too: collisions only matter between concurrent writers.
    let _ = getrandom::getrandom(&mut random);
    let hex: String = random.iter().map(|b| format!("{b:02x}")).collect();
    out.with_file_name(format!(".{name}.{hex}.tmp"))
}

fn write_initramfs(base: &Path, agent: &Path, tmp: &Path) -> io::Result<()> {
    let file = File::create(tmp)?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    let base_len = io::copy(&mut File::open(base)?, &mut w)?;
    w.write_all(&[0u8; 4][..pad4(base_len as usize)])?;

    let agent_file = File::open(agent)?;
    let size = agent_file.metadata()?.len();
    let size32 = u32::try_from(size).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is too large for a cpio archive", agent.display()),
        )
    })?;
    let mut written = write_newc_header(&mut w, AGENT_PATH_IN_INITRAMFS, 0o100_755, 1, size32)?;
    let copied = io::copy(&mut agent_file.take(size), &mut w)?;
    if copied != size {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("{} shrank while it was copied", agent.display()),
        ));
    }
    written += copied as usize;
    w.write_all(&[0u8; 4][..pad4(written)])?;
    written += pad4(written);
    write_newc_trailer(&mut w, written)?;
    let file = w.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()
}

/// Zero bytes that bring `len` to a multiple of 4.
fn pad4(len: usize) -> usize {
    (4 - len % 4) % 4
}

/// Writes one newc ("070701") header and its name, padded; returns the bytes written
/// (always a multiple of 4).
fn write_newc_header(
    w: &mut impl Write,
    name: &str,
    mode: u32,
    ino: u32,
    size: u32,
) -> io::Result<usize> {
    let namesize = name.len() + 1;
    let fields: [u32; 13] = [
        ino,
        mode,
        0,                                    // uid
        0,                                    // gid
        1,                                    // nlink
        0,                                    // mtime
        size,                                 // filesize
        0,                                    // devmajor
        0,                                    // devminor
        0,                                    // rdevmajor
        0,                                    // rdevminor
        u32::try_from(namesize).unwrap_or(0), // namesize, NUL included
        0,                                    // check
    ];
    let mut header = String::with_capacity(110 + namesize);
    header.push_str("070701");
    for f in fields {
        header.push_str(&format!("{f:08x}"));
    }
    header.push_str(name);
    header.push('\0');
    let len = header.len();
    w.write_all(header.as_bytes())?;
    w.write_all(&[0u8; 4][..pad4(len)])?;
    Ok(len + pad4(len))
}

/// Writes the trailer after `written` bytes of archive and rounds the archive up to 512
/// bytes as cpio(1) does (the kernel skips zero padding).
fn write_newc_trailer(w: &mut impl Write, written: usize) -> io::Result<()> {
    let n = write_newc_header(w, "TRAILER!!!", 0, 0, 0)?;
    let end = (written + n) % 512;
    if end != 0 {
        w.write_all(&vec![0u8; 512 - end])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Entry {
        name: String,
        mode: u32,
        nlink: u32,
        data: Vec<u8>,
    }

    /// A strict newc reader: every header, name and data aligned as the kernel expects.
    fn parse_newc(mut buf: &[u8], start: usize) -> Vec<Entry> {
        let mut offset = start;
        let mut entries = Vec::new();
        loop {
            assert_eq!(offset % 4, 0, "header at unaligned offset {offset}");
            assert!(buf.len() >= 110, "truncated header");
            assert_eq!(&buf[..6], b"070701", "bad magic at {offset}");
            let field = |i: usize| {
                let s = std::str::from_utf8(&buf[6 + i * 8..14 + i * 8]).unwrap();
                u32::from_str_radix(s, 16).unwrap()
            };
            let mode = field(1);
            let nlink = field(4);
            let size = field(6) as usize;
            let namesize = field(11) as usize;
            let name_end = 110 + namesize;
            assert_eq!(buf[name_end - 1], 0, "name not NUL-terminated");
            let name = String::from_utf8(buf[110..name_end - 1].to_vec()).unwrap();
            let data_start = name_end + pad4(offset + name_end);
            let data = buf[data_start..data_start + size].to_vec();
            let next = data_start + size + pad4(offset + data_start + size);
            offset += next;
            buf = &buf[next..];
            if name == "TRAILER!!!" {
                assert!(buf.iter().all(|&b| b == 0), "junk after the trailer");
                return entries;
            }
            entries.push(Entry {
                name,
                mode,
                nlink,
                data,
            });
        }
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let mut random = [0u8; 8];
        getrandom::getrandom(&mut random).unwrap();
        let hex: String = random.iter().map(|b| format!("{b:02x}")).collect();
        let dir = std::env::temp_dir().join(format!("space-guest-{tag}-{hex}"));
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn check(base_len: usize, agent_len: usize) {
        let dir = temp_dir("cpio");
        let base: Vec<u8> = (0..base_len).map(|i| (i % 251) as u8 | 1).collect();
        let agent: Vec<u8> = (0..agent_len).map(|i| (i * 7 % 256) as u8).collect();
        fs::write(dir.join("base"), &base).unwrap();
        fs::write(dir.join("agent"), &agent).unwrap();
        let out = dir.join("out");
        initramfs_with_agent(&dir.join("base"), &dir.join("agent"), &out).unwrap();
        let bytes = fs::read(&out).unwrap();
        assert_eq!(&bytes[..base_len], &base[..]);
        let start = base_len + pad4(base_len);
        assert!(bytes[base_len..start].iter().all(|&b| b == 0));
        assert_eq!((bytes.len() - start) % 512, 0, "archive not rounded to 512");
        let entries = parse_newc(&bytes[start..], start);
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].name, "space-agent");
        assert_eq!(entries[0].mode, 0o100_755);
        assert_eq!(entries[0].nlink, 1);
        assert!(entries[0].data == agent, "agent bytes differ");
        // Nothing but `out` is left behind.
        let mut names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["agent", "base", "out"]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn appended_archive_parses_back_at_every_alignment() {
        for base_len in [0, 1, 2, 3, 4, 511, 4097] {
            for agent_len in [0, 1, 3, 4, 5, 1000, 70_001] {
                check(base_len, agent_len);
            }
        }
    }

    #[test]
    fn rewrite_replaces_and_failure_leaves_the_old_file() {
        let dir = temp_dir("replace");
        fs::write(dir.join("base"), b"base").unwrap();
        fs::write(dir.join("agent"), b"agent-1").unwrap();
        let out = dir.join("out");
        initramfs_with_agent(&dir.join("base"), &dir.join("agent"), &out).unwrap();
        fs::write(dir.join("agent"), b"agent-2").unwrap();
        initramfs_with_agent(&dir.join("base"), &dir.join("agent"), &out).unwrap();
        let bytes = fs::read(&out).unwrap();
        let entries = parse_newc(&bytes[4..], 4);
        assert_eq!(entries[0].data, b"agent-2");

        let err = initramfs_with_agent(&dir.join("base"), &dir.join("missing"), &out);
        assert_eq!(err.unwrap_err().kind(), io::ErrorKind::NotFound);
        assert_eq!(fs::read(&out).unwrap(), bytes, "a failed write touched out");
        let count = fs::read_dir(&dir).unwrap().count();
        assert_eq!(count, 3, "a temporary file was left behind");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn token_archive_is_private_and_scrubbed_in_place() {
        use std::os::unix::fs::PermissionsExt;
        let dir = temp_dir("token");
        for base_len in [0usize, 1, 4, 513] {
            let base: Vec<u8> = (0..base_len).map(|i| (i % 251) as u8 | 1).collect();
            fs::write(dir.join("base"), &base).unwrap();
            let out = dir.join("out");
            let token = "tok-abc_123";
            let at = initramfs_with_token(&dir.join("base"), token, &out).unwrap();
            assert_eq!(
                fs::metadata(&out).unwrap().permissions().mode() & 0o777,
                0o600
            );
            let bytes = fs::read(&out).unwrap();
            assert_eq!(&bytes[..base_len], &base[..]);
            let start = base_len + pad4(base_len);
            let entries = parse_newc(&bytes[start..], start);
            assert_eq!(entries.len(), 1);
            assert_eq!(entries[0].name, "space-token");
            assert_eq!(entries[0].mode, 0o100_600);
            assert_eq!(entries[0].data, token.as_bytes());
            assert_eq!(
                &bytes[at as usize..at as usize + token.len()],
                token.as_bytes()
            );

            scrub_token(&out, at, token.len()).unwrap();
            let scrubbed = fs::read(&out).unwrap();
            assert_eq!(scrubbed.len(), bytes.len());
            let entries = parse_newc(&scrubbed[start..], start);
            assert_eq!(entries[0].data, vec![b'0'; token.len()]);
            assert!(!scrubbed.windows(token.len()).any(|w| w == token.as_bytes()));
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn host_tsc_is_measured() {
        if let Some(khz) = host_tsc_khz() {
            assert!((100_000..20_000_000).contains(&khz), "{khz} kHz");
            assert_eq!(khz % 1000, 0);
        }
    }

    #[test]
    fn find_names_the_build_script() {
        let dir = temp_dir("find");
        let err = GuestFiles::find(&dir).unwrap_err();
        assert!(err.contains("vmlinuz"), "{err}");
        assert!(err.contains("scripts/build-guest.sh"), "{err}");
        fs::write(dir.join("vmlinuz"), b"k").unwrap();
        fs::write(dir.join("initramfs.cpio.gz"), b"i").unwrap();
        let err = GuestFiles::find(&dir).unwrap_err();
        assert!(err.contains("VERSION"), "{err}");
        fs::write(dir.join("VERSION"), b"linux-image-x=1 abc\n").unwrap();
        let files = GuestFiles::find(&dir).unwrap();
        assert_eq!(files.kernel, dir.join("vmlinuz"));
        assert_eq!(files.initramfs, dir.join("initramfs.cpio.gz"));
        assert_eq!(files.version, "linux-image-x=1 abc");
        fs::remove_dir_all(&dir).unwrap();
    }
}
