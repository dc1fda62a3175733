//! The harness both tar targets share: unpack into a fresh root and check that
//! nothing outside it changed, that the limits held, and that a failed unpack
//! left nothing behind.

use std::io::Read;
use std::path::{Path, PathBuf};

use space_agent::fs::{Limits, Root};

/// Symbolic links in the seeds point here; it must stay empty.
pub const ESCAPE: &str = "/tmp/space-fuzz-escape";
const MAX_BYTES: u64 = 1 << 20;
const MAX_ENTRIES: u64 = 1000;

fn base() -> PathBuf {
    std::env::temp_dir().join(format!("space-fuzz-tar-{}", std::process::id()))
}

/// Removes this process's scratch dir (and the escape dir, if still empty) when
/// libFuzzer exits.
extern "C" fn remove_scratch() {
    let _ = std::fs::remove_dir_all(base());
    let _ = std::fs::remove_dir(ESCAPE);
}

fn walk(dir: &Path, out: &mut Vec<(PathBuf, std::fs::Metadata)>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if let Ok(md) = std::fs::symlink_metadata(&p) {
            let is_dir = md.is_dir();
            out.push((p.clone(), md));
            if is_dir {
                walk(&p, out);
            }
        }
    }
}

pub fn check(archive: impl Read) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: registers a plain function with no captured state.
    ONCE.call_once(|| unsafe {
        libc::atexit(remove_scratch);
    });
    let base = base();
    let root_dir = base.join("root");
    let outside = base.join("outside");
    let _ = std::fs::remove_dir_all(&root_dir);
    std::fs::create_dir_all(&root_dir).expect("root");
    std::fs::create_dir_all(&outside).expect("outside");
    std::fs::write(outside.join("sentinel"), b"keep").expect("sentinel");
    std::fs::create_dir_all(ESCAPE).expect("escape dir");

    let root = Root::open(&root_dir).expect("open root");
    let limits = Limits {
        max_bytes: MAX_BYTES,
        max_entries: MAX_ENTRIES,
        ..Limits::default()
    };
    let result = root.unpack_tar_into("/dest", archive, &limits);

    let mut around = Vec::new();
    walk(&base, &mut around);
    let outside_now: Vec<PathBuf> = around
        .iter()
        .filter(|(p, _)| !p.starts_with(&root_dir))
        .map(|(p, _)| p.clone())
        .collect();
    let mut expected = vec![outside.clone(), outside.join("sentinel")];
    let mut got = outside_now.clone();
    expected.sort();
    got.sort();
    assert_eq!(got, expected, "something appeared next to the root");
    assert_eq!(
        std::fs::read(outside.join("sentinel")).ok().as_deref(),
        Some(&b"keep"[..])
    );
    assert_eq!(
        std::fs::read_dir(ESCAPE).map(|d| d.count()).unwrap_or(0),
        0,
        "wrote through a link"
    );

    let mut inside = Vec::new();
    walk(&root_dir, &mut inside);
    match result {
        Ok(stats) => {
            assert!(stats.bytes <= MAX_BYTES && stats.entries <= MAX_ENTRIES);
            let bytes: u64 = inside
                .iter()
                .filter(|(_, m)| m.is_file())
                .map(|(_, m)| m.len())
                .sum();
            assert!(bytes <= MAX_BYTES, "{bytes} bytes extracted");
            assert!(
                inside
                    .iter()
                    .all(|(_, m)| m.is_file() || m.is_dir() || m.file_type().is_symlink()),
                "a device, fifo or socket was created"
            );
        }
        Err(e) => {
            assert!((400..600).contains(&e.status()));
            assert!(inside.is_empty(), "a failed unpack left {inside:?}");
        }
    }
}
