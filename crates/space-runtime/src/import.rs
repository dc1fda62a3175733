//! Imports of host files into a template layer: tar archives (`tar:` bases, plain or
//! compressed) and OCI image layouts (`oci:` bases, layers applied with their whiteouts).
//!
//! Archives are untrusted even when an operator allowed their directory: they are unpacked
//! by the same hardened code the sandboxes' file API uses ([`space_agent::fs`]: one directory
//! descriptor at a time, no entry below a link, no `..` or absolute names, hard links only to
//! earlier files of the same archive, byte and entry limits), and OCI layers are merged with
//! [`crate::tree`], so a link a lower layer left is replaced, never followed. Device nodes
//! and fifos in an image are skipped: a sandbox's /dev comes from its runtime. A compressed
//! archive is decompressed by gzip in-process, or by `xz`, `zstd` or `bzip2` as a pure
//! filter process (the decompressor interprets no names).

use std::ffi::OsStr;
use std::fs::{self, File};
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};

use space_agent::fs::{FsError, Limits, Root};

use crate::template::{IoContext, TemplateError};
use crate::tree::{self, Dir};

/// Largest JSON document of an OCI layout (index, manifest) that is read.
const MAX_OCI_JSON: u64 = 4 << 20;
/// Most entries one import may create.
const MAX_IMPORT_ENTRIES: u64 = 2_000_000;

/// How much an import may write.
#[derive(Debug, Clone, Copy)]
pub struct ImportLimits {
    /// File bytes (what the layer will hold) at most.
    pub max_bytes: u64,
}

fn fail(name: &str, message: String) -> TemplateError {
    TemplateError::Build {
        name: name.to_owned(),
        message,
    }
}

fn unpack_limits(limits: ImportLimits) -> Limits {
    Limits {
        max_bytes: limits.max_bytes,
        max_entries: MAX_IMPORT_ENTRIES,
        same_owner: true,
        skip_special: true,
        ..Limits::default()
    }
}

/// A decompressing reader: in-process for gzip, a filter process for the rest.
struct Decompressed {
    reader: Box<dyn Read + Send>,
    child: Option<Child>,
}

impl Read for Decompressed {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.reader.read(buf)
    }
}

impl Drop for Decompressed {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Decompressed {
    /// Fails when a filter process did not end well (a corrupt stream, say).
    fn finish(mut self, what: &str) -> io::Result<()> {
        if let Some(mut c) = self.child.take() {
            let status = c.wait()?;
            if !status.success() {
                return Err(io::Error::other(format!(
                    "decompressing {what} failed ({status})"
                )));
            }
        }
        Ok(())
    }
}

/// Decompresses the archive `f` by its magic bytes.
fn open_archive(mut f: File) -> io::Result<Decompressed> {
    use std::io::{Seek, SeekFrom};
    let mut magic = [0u8; 6];
    let n = read_up_to(&mut f, &mut magic)?;
    f.seek(SeekFrom::Start(0))?;
    let magic = &magic[..n];
    let tool = if magic.starts_with(&[0x1f, 0x8b]) {
        return Ok(Decompressed {
            reader: Box::new(flate2::read::MultiGzDecoder::new(io::BufReader::new(f))),
            child: None,
        });
    } else if magic.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0]) {
        "xz"
    } else if magic.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        "zstd"
    } else if magic.starts_with(b"BZh") {
        "bzip2"
    } else {
        return Ok(Decompressed {
            reader: Box::new(io::BufReader::new(f)),
            child: None,
        });
    };
    let mut child = std::process::Command::new(tool)
        .args(["-d", "-c"])
        .stdin(f)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| io::Error::new(e.kind(), format!("running {tool} to decompress: {e}")))?;
    let out = child
        .stdout
        .take()
        .ok_or_else(|| io::Error::other(format!("{tool} has no output")))?;
    Ok(Decompressed {
        reader: Box::new(out),
        child: Some(child),
    })
}

fn read_up_to(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Unpacks the archive `file` (shown as `tar`) into the directory `into` (which may already
/// hold files: an entry replaces what is there, but never goes through a link).
fn unpack(
    name: &str,
    file: File,
    tar: &Path,
    into: &Path,
    limits: ImportLimits,
) -> Result<(), TemplateError> {
    let shown = tar.display();
    let root = Root::open(into).map_err(|e| fail(name, format!("{shown}: {}", e.message())))?;
    let mut data = open_archive(file).at("read", tar)?;
    let unpacked = root.unpack_tar(&mut data, &unpack_limits(limits));
    let finished = data.finish(&shown.to_string());
    match (unpacked, finished) {
        (Ok(_), Ok(())) => Ok(()),
        (Err(e), _) => Err(fail(name, format!("{shown}: {}", fs_message(&e)))),
        (Ok(_), Err(e)) => Err(fail(name, format!("{shown}: {e}"))),
    }
}

fn fs_message(e: &FsError) -> String {
    match e {
        FsError::TooLarge(m) => format!("{m} (the build's disk quota)"),
        e => e.message(),
    }
}

/// `tar:` bases: the archive unpacked into the empty layer.
pub fn import_tar(
    name: &str,
    tar: &Path,
    rootfs: &Path,
    limits: ImportLimits,
) -> Result<(), TemplateError> {
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(tar)
        .at("open", tar)?;
    unpack(name, file, tar, rootfs, limits)
}

/// Imports an OCI image layout: `index.json` → manifest → layers applied in order, with
/// `.wh.NAME` whiteouts (and `.wh..wh..opq` opaque directories) removing what lower layers had.
pub fn import_oci(
    name: &str,
    layout: &Path,
    rootfs: &Path,
    limits: ImportLimits,
) -> Result<(), TemplateError> {
    let err = |m: String| fail(name, format!("oci:{}: {m}", layout.display()));
    let layout_dir = Dir::open(layout).at("open", layout)?;
    let read_json = |rel: &[&str]| -> Result<serde_json::Value, TemplateError> {
        let (file, dirs) = rel.split_last().ok_or_else(|| err("empty path".into()))?;
        let shown = rel.join("/");
        let bytes = layout_dir
            .open_path(&dirs.join("/"))
            .and_then(|d| d.read_file(OsStr::new(file), MAX_OCI_JSON))
            .map_err(|e| err(format!("{shown}: {e}")))?
            .ok_or_else(|| err(format!("{shown} is not a regular file")))?;
        serde_json::from_slice(&bytes).map_err(|e| err(format!("{shown}: {e}")))
    };
    let blob = |digest: &serde_json::Value| -> Result<[String; 3], TemplateError> {
        let d = digest.as_str().unwrap_or_default();
        match d.split_once(':') {
            Some((alg @ ("sha256" | "sha512"), hexd))
                if !hexd.is_empty()
                    && hexd.len() <= 128
                    && hexd.bytes().all(|b| b.is_ascii_hexdigit()) =>
            {
                Ok(["blobs".into(), alg.into(), hexd.into()])
            }
            _ => Err(err(format!(
                "invalid digest {:?}",
                d.chars().take(100).collect::<String>()
            ))),
        }
    };
    fn as_refs(p: &[String; 3]) -> [&str; 3] {
        [p[0].as_str(), p[1].as_str(), p[2].as_str()]
    }
    let mut desc = read_json(&["index.json"])?["manifests"][0].clone();
    for _ in 0..2 {
        let media = desc["mediaType"].as_str().unwrap_or_default();
        if media.contains("image.index") || media.contains("manifest.list") {
            desc = read_json(&as_refs(&blob(&desc["digest"])?))?["manifests"][0].clone();
        }
    }
    if desc.is_null() {
        return Err(err("index.json lists no manifest".into()));
    }
    let manifest = read_json(&as_refs(&blob(&desc["digest"])?))?;
    let Some(layers) = manifest["layers"].as_array() else {
        return Err(err("the manifest has no layers".into()));
    };
    let Some(parent) = rootfs.parent() else {
        return Err(err("layer directory has no parent".into()));
    };
    let staging = parent.join("staging");
    let mut written = 0u64;
    for layer in layers {
        let rel = blob(&layer["digest"])?;
        // The blob is opened beneath the layout, never through a link in it.
        let dir = layout_dir
            .open_path(&format!("{}/{}", rel[0], rel[1]))
            .map_err(|e| err(format!("{}/{}: {e}", rel[0], rel[1])))?;
        let path: PathBuf = layout.join(rel.join("/"));
        let file = dir
            .open_file(OsStr::new(&rel[2]))
            .map_err(|e| err(format!("{}: {e}", rel.join("/"))))?;
        tree::remove_tree(&staging).at("remove", &staging)?;
        crate::template::make_dir(&staging, 0o755)?;
        let left = ImportLimits {
            max_bytes: limits.max_bytes.saturating_sub(written),
        };
        let applied = unpack(name, file, &path, &staging, left).and_then(|()| {
            written += crate::tree::Dir::open(&staging)
                .and_then(|d| file_bytes(&d))
                .at("measure", &staging)?;
            let src = Dir::open(&staging).at("open", &staging)?;
            let dst = Dir::open(rootfs).at("open", rootfs)?;
            merge_layer(&src, &dst, 1).at("merge a layer into", rootfs)
        });
        let removed = tree::remove_tree(&staging).at("remove", &staging);
        applied.and(removed)?;
    }
    Ok(())
}

/// Bytes of the regular files below `dir`.
fn file_bytes(dir: &Dir) -> io::Result<u64> {
    let mut n = 0u64;
    dir.walk(&mut |_, st, _| {
        if tree::kind(st) == libc::S_IFREG {
            n = n.saturating_add(st.st_size.max(0) as u64);
        }
        Ok(())
    })?;
    Ok(n)
}

/// Merges the extracted layer `src` into `dst` (both on one filesystem): whiteouts first
/// (they apply to the lower layers, not to this layer's own entries), then every entry is
/// moved into place; a directory merges into a directory, anything else replaces what was
/// there (a link a lower layer left included: it is removed, never followed).
fn merge_layer(src: &Dir, dst: &Dir, depth: usize) -> io::Result<()> {
    if depth > tree::MAX_DEPTH {
        return Err(io::Error::other(format!(
            "directories nested deeper than {} levels",
            tree::MAX_DEPTH
        )));
    }
    let mut rest = Vec::new();
    for n in src.names()? {
        let Some(hidden) = n.to_str().and_then(|s| s.strip_prefix(".wh.")) else {
            rest.push(n);
            continue;
        };
        if hidden == ".wh..opq" {
            dst.clear()?;
        } else if !hidden.is_empty() && hidden != "." && hidden != ".." && !hidden.contains('/') {
            dst.remove(OsStr::new(hidden))?;
        }
        src.remove(&n)?;
    }
    for n in rest {
        let Some(st) = src.lstat(&n)? else { continue };
        let existing = dst.lstat(&n)?;
        if tree::is_dir(&st) {
            if existing.as_ref().is_some_and(tree::is_dir) {
                dst.chown(&n, st.st_uid, st.st_gid)?;
                let to = dst.child(&n)?;
                to.chmod(st.st_mode)?;
                merge_layer(&src.child(&n)?, &to, depth + 1)?;
                continue;
            }
            strip_whiteouts(&src.child(&n)?, depth + 1)?;
        }
        if existing.is_some() {
            dst.remove(&n)?;
        }
        src.rename_to(&n, dst, &n)?;
    }
    Ok(())
}

/// Removes whiteout files from a directory tree that had nothing below it to hide.
fn strip_whiteouts(dir: &Dir, depth: usize) -> io::Result<()> {
    if depth > tree::MAX_DEPTH {
        return Err(io::Error::other(format!(
            "directories nested deeper than {} levels",
            tree::MAX_DEPTH
        )));
    }
    for n in dir.names()? {
        let Some(st) = dir.lstat(&n)? else { continue };
        if n.to_str().is_some_and(|s| s.starts_with(".wh.")) {
            dir.remove(&n)?;
        } else if tree::is_dir(&st) {
            strip_whiteouts(&dir.child(&n)?, depth + 1)?;
        }
    }
    Ok(())
}

/// A cheap fingerprint of a host file or tree (relative paths, types, modes, sizes, mtimes),
/// walked without following links.
pub fn fingerprint(path: &Path) -> Result<String, TemplateError> {
    use sha2::{Digest, Sha256};
    let m = fs::metadata(path).at("inspect", path)?;
    let line = |h: &mut Sha256, st: &libc::stat| {
        h.update(
            format!(
                "\0{}:{}:{}:{}\0",
                st.st_mode, st.st_size, st.st_mtime, st.st_mtime_nsec
            )
            .as_bytes(),
        );
    };
    let mut h = Sha256::new();
    if m.is_dir() {
        let dir = Dir::open(path).at("open", path)?;
        line(&mut h, &dir.stat().at("inspect", path)?);
        dir.walk(&mut |rel, st, _| {
            h.update(rel.as_os_str().as_encoded_bytes());
            line(&mut h, st);
            Ok(())
        })
        .at("inspect", path)?;
    } else {
        use std::os::unix::fs::MetadataExt;
        h.update(format!("{}:{}:{}:{}", m.mode(), m.len(), m.mtime(), m.mtime_nsec()).as_bytes());
    }
    Ok(crate::template::hex(&h.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn layers_replace_links_instead_of_following_them() {
        let base = std::env::temp_dir().join(format!("space-merge-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        let (root, upper, outside) = (base.join("root"), base.join("upper"), base.join("outside"));
        for d in [&root, &upper, &outside] {
            fs::create_dir_all(d).unwrap();
        }
        // The lower layer left `etc -> <outside>` and some files; the upper one writes etc/passwd,
        // hides `gone`, and makes `opq` opaque.
        symlink(&outside, root.join("etc")).unwrap();
        fs::write(root.join("gone"), "x").unwrap();
        fs::create_dir_all(root.join("opq/old")).unwrap();
        fs::create_dir_all(upper.join("etc")).unwrap();
        fs::write(upper.join("etc/passwd"), "root").unwrap();
        fs::write(upper.join(".wh.gone"), "").unwrap();
        fs::create_dir_all(upper.join("opq")).unwrap();
        fs::write(upper.join("opq/.wh..wh..opq"), "").unwrap();
        fs::write(upper.join("opq/new"), "n").unwrap();
        fs::create_dir_all(upper.join("fresh")).unwrap();
        fs::write(upper.join("fresh/.wh.nothing"), "").unwrap();
        // A whiteout naming a link to the outside removes the link, not what it points at.
        fs::write(outside.join("keep"), "k").unwrap();
        symlink(&outside, root.join("out")).unwrap();
        fs::create_dir_all(upper.join("out")).unwrap();
        fs::write(upper.join("out/.wh.keep"), "").unwrap();
        merge_layer(&Dir::open(&upper).unwrap(), &Dir::open(&root).unwrap(), 1).unwrap();
        assert_eq!(
            fs::read_dir(&outside).unwrap().count(),
            1,
            "wrote or removed outside the root"
        );
        assert_eq!(fs::read_to_string(root.join("etc/passwd")).unwrap(), "root");
        assert!(!fs::symlink_metadata(root.join("etc"))
            .unwrap()
            .file_type()
            .is_symlink());
        assert!(!root.join("gone").exists());
        assert!(!root.join("opq/old").exists() && root.join("opq/new").exists());
        assert!(root.join("fresh").is_dir() && !root.join("fresh/.wh.nothing").exists());
        assert!(outside.join("keep").exists());
        fs::remove_dir_all(&base).unwrap();
    }
}
