//! Property tests of the tar upload unpacker (`space_agent::fs::Root::unpack_tar_into`),
//! which takes an archive straight from an API client. For random and mutated
//! archives, plain and gzip-compressed: no panic, nothing written outside the
//! root (not through `..`, absolute names, symbolic or hard links), the byte and
//! entry limits hold, a failed unpack leaves nothing behind, and a well-formed
//! archive (ours from `pack_tar`, or `tar::Builder`'s) unpacks to what it holds.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use proptest::prelude::*;
use space_agent::fs::{Limits, Root};

const MAX_BYTES: u64 = 4096;
const MAX_ENTRIES: u64 = 12;

/// A scratch layout: `outer/root` is the sandbox's root, `outer/outside` and
/// `escape` (an absolute path elsewhere) must never change.
struct Scratch {
    outer: PathBuf,
    escape: PathBuf,
}

impl Scratch {
    fn new() -> Scratch {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let base =
            std::env::temp_dir().join(format!("space-proptest-tar-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let outer = base.join("outer");
        let escape = base.join("escape");
        std::fs::create_dir_all(outer.join("root")).unwrap();
        std::fs::create_dir_all(outer.join("outside")).unwrap();
        std::fs::write(outer.join("outside/sentinel"), b"keep").unwrap();
        std::fs::create_dir_all(&escape).unwrap();
        Scratch { outer, escape }
    }

    fn root(&self) -> PathBuf {
        self.outer.join("root")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(base) = self.outer.parent() {
            let _ = std::fs::remove_dir_all(base);
        }
    }
}

/// Every path under `dir` (not following links) with its type, size and content
/// digest; `skip` is left out.
fn snapshot(dir: &Path, skip: Option<&Path>) -> BTreeMap<PathBuf, (char, u64, Vec<u8>)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            if Some(p.as_path()) == skip {
                continue;
            }
            let md = std::fs::symlink_metadata(&p).unwrap();
            let ft = md.file_type();
            let rel = p.strip_prefix(dir).unwrap().to_path_buf();
            if ft.is_dir() {
                out.insert(rel, ('d', 0, Vec::new()));
                stack.push(p);
            } else if ft.is_symlink() {
                let t = std::fs::read_link(&p).unwrap();
                out.insert(rel, ('l', 0, t.into_os_string().into_encoded_bytes()));
            } else if ft.is_file() {
                let mut data = Vec::new();
                std::fs::File::open(&p)
                    .unwrap()
                    .read_to_end(&mut data)
                    .unwrap();
                out.insert(rel, ('f', md.size(), data));
            } else {
                let kind = if ft.is_fifo() { 'p' } else { 'o' };
                out.insert(rel, (kind, 0, Vec::new()));
            }
        }
    }
    out
}

#[derive(Debug, Clone)]
enum Kind {
    File(Vec<u8>),
    Dir,
    Symlink(String),
    HardLink(String),
    Fifo,
    CharDev,
    /// A GNU long-name record, then a file under that name.
    LongName(Vec<u8>),
    /// A PAX header naming the path, then a file.
    PaxPath(Vec<u8>),
}

#[derive(Debug, Clone)]
struct Entry {
    name: String,
    kind: Kind,
    mode: u32,
    uid: u64,
}

fn component() -> impl Strategy<Value = String> {
    prop_oneof![
        24 => prop::sample::select(vec!["a", "b", "c", "d"]).prop_map(String::from),
        1 => Just("..".to_string()),
        1 => Just(".".to_string()),
        1 => Just(String::new()),
        1 => Just("outside".to_string()),
        1 => "[a-z\u{80}-\u{10ffff}]{1,3}",
    ]
}

fn name() -> impl Strategy<Value = String> {
    // Mostly benign names, so that the dangerous ones meet a populated tree.
    (
        prop::bool::weighted(0.1),
        proptest::collection::vec(component(), 1..4),
    )
        .prop_map(|(abs, comps)| {
            let joined = comps.join("/");
            if abs {
                format!("/{joined}")
            } else {
                joined
            }
        })
}

/// Stands for the scratch's `escape` directory (an absolute path outside the root).
const ESCAPE: &str = "@ESCAPE@";

fn link_target() -> impl Strategy<Value = String> {
    prop_oneof![
        name(),
        Just(ESCAPE.to_string()),
        Just(format!("{ESCAPE}/x")),
        Just("../outside".to_string()),
        Just("../../outside/sentinel".to_string()),
        Just("/".to_string()),
    ]
}

fn data() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => proptest::collection::vec(any::<u8>(), 0..64),
        1 => (0usize..3000).prop_map(|n| vec![b'x'; n]),
    ]
}

fn entry() -> impl Strategy<Value = Entry> {
    let kind = prop_oneof![
        12 => data().prop_map(Kind::File),
        6 => Just(Kind::Dir),
        6 => link_target().prop_map(Kind::Symlink),
        3 => link_target().prop_map(Kind::HardLink),
        1 => Just(Kind::Fifo),
        1 => Just(Kind::CharDev),
        2 => name().prop_map(|n| Kind::LongName(format!("{n}{}", "/z".repeat(60)).into_bytes())),
        2 => name().prop_map(|n| Kind::PaxPath(n.into_bytes())),
    ];
    (
        name(),
        kind,
        prop_oneof![Just(0o644u32), Just(0o755), Just(0o4755), any::<u32>()],
        0u64..70_000,
    )
        .prop_map(|(name, kind, mode, uid)| Entry {
            name,
            kind,
            mode,
            uid,
        })
}

fn push_record(
    out: &mut Vec<u8>,
    ty: tar::EntryType,
    name: &[u8],
    link: &[u8],
    data: &[u8],
    mode: u32,
    uid: u64,
) {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(ty);
    h.set_size(data.len() as u64);
    h.set_mode(mode);
    h.set_uid(uid);
    h.set_gid(uid);
    h.set_mtime(1_700_000_000);
    {
        let g = h.as_gnu_mut().unwrap();
        let n = name.len().min(100);
        g.name = [0; 100];
        g.name[..n].copy_from_slice(&name[..n]);
        let l = link.len().min(100);
        g.linkname = [0; 100];
        g.linkname[..l].copy_from_slice(&link[..l]);
    }
    h.set_cksum();
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(data);
    let pad = (512 - data.len() % 512) % 512;
    out.resize(out.len() + pad, 0);
}

fn build_tar(entries: &[Entry], escape: &Path) -> Vec<u8> {
    let escape = escape.to_string_lossy();
    let mut out = Vec::new();
    for e in entries {
        let name = e.name.as_bytes();
        match &e.kind {
            Kind::File(d) => push_record(
                &mut out,
                tar::EntryType::Regular,
                name,
                b"",
                d,
                e.mode,
                e.uid,
            ),
            Kind::Dir => push_record(
                &mut out,
                tar::EntryType::Directory,
                name,
                b"",
                b"",
                e.mode,
                e.uid,
            ),
            Kind::Symlink(t) => {
                let t = t.replace(ESCAPE, &escape);
                push_record(
                    &mut out,
                    tar::EntryType::Symlink,
                    name,
                    t.as_bytes(),
                    b"",
                    e.mode,
                    e.uid,
                )
            }
            Kind::HardLink(t) => {
                let t = t.replace(ESCAPE, &escape);
                push_record(
                    &mut out,
                    tar::EntryType::Link,
                    name,
                    t.as_bytes(),
                    b"",
                    e.mode,
                    e.uid,
                )
            }
            Kind::Fifo => push_record(
                &mut out,
                tar::EntryType::Fifo,
                name,
                b"",
                b"",
                e.mode,
                e.uid,
            ),
            Kind::CharDev => push_record(
                &mut out,
                tar::EntryType::Char,
                name,
                b"",
                b"",
                e.mode,
                e.uid,
            ),
            Kind::LongName(long) => {
                let mut l = long.clone();
                l.push(0);
                push_record(
                    &mut out,
                    tar::EntryType::GNULongName,
                    b"././@LongLink",
                    b"",
                    &l,
                    0o644,
                    0,
                );
                push_record(
                    &mut out,
                    tar::EntryType::Regular,
                    name,
                    b"",
                    b"long",
                    e.mode,
                    e.uid,
                );
            }
            Kind::PaxPath(p) => {
                let mut rec = Vec::new();
                let body_len = " path=".len() + p.len() + 1;
                // The record length counts its own digits.
                let mut len = body_len + 1;
                while len != body_len + len.to_string().len() {
                    len = body_len + len.to_string().len();
                }
                rec.extend_from_slice(format!("{len} path=").as_bytes());
                rec.extend_from_slice(p);
                rec.push(b'\n');
                push_record(
                    &mut out,
                    tar::EntryType::XHeader,
                    b"pax",
                    b"",
                    &rec,
                    0o644,
                    0,
                );
                push_record(
                    &mut out,
                    tar::EntryType::Regular,
                    name,
                    b"",
                    b"pax",
                    e.mode,
                    e.uid,
                );
            }
        }
    }
    out.extend_from_slice(&[0u8; 1024]);
    out
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(data).unwrap();
    enc.finish().unwrap()
}

fn limits() -> Limits {
    Limits {
        max_bytes: MAX_BYTES,
        max_entries: MAX_ENTRIES,
        ..Limits::default()
    }
}

/// Unpacks `archive` (gzip-compressed if `gz`) into `/dest` of the scratch root
/// and checks containment, limits and cleanup. Returns whether it succeeded.
fn check_unpack(
    s: &Scratch,
    archive: &[u8],
    gz: bool,
    preexisting: bool,
) -> Result<bool, TestCaseError> {
    if preexisting {
        std::fs::create_dir_all(s.root().join("dest/keep")).unwrap();
        std::fs::write(s.root().join("dest/keep/f"), b"old").unwrap();
    }
    let outer_before = snapshot(&s.outer, Some(&s.root()));
    let root_before = snapshot(&s.root(), None);
    let root = Root::open(s.root()).unwrap();
    let result = if gz {
        root.unpack_tar_into("/dest", flate2::read::GzDecoder::new(archive), &limits())
    } else {
        root.unpack_tar_into("/dest", archive, &limits())
    };
    // Containment: nothing outside the root changed.
    prop_assert_eq!(
        snapshot(&s.outer, Some(&s.root())),
        outer_before,
        "outside the root changed"
    );
    prop_assert!(
        snapshot(&s.escape, None).is_empty(),
        "wrote through a link to an outside path"
    );
    let after = snapshot(&s.root(), None);
    match result {
        Ok(stats) => {
            prop_assert!(stats.bytes <= MAX_BYTES);
            prop_assert!(stats.entries <= MAX_ENTRIES);
            // Hard links share their data: each inode counts once.
            let mut inodes = std::collections::HashSet::new();
            let file_bytes: u64 = after
                .iter()
                .filter(|(p, _)| !root_before.contains_key(*p))
                .filter(|(_, (k, _, _))| *k == 'f')
                .filter(|(p, _)| {
                    let md = std::fs::symlink_metadata(s.root().join(p)).unwrap();
                    inodes.insert((md.dev(), md.ino()))
                })
                .map(|(_, (_, n, _))| n)
                .sum();
            prop_assert!(file_bytes <= MAX_BYTES, "{} bytes extracted", file_bytes);
            prop_assert!(
                after.values().all(|(k, _, _)| matches!(k, 'd' | 'f' | 'l')),
                "a device or fifo was created"
            );
            // What was there before is still there.
            for p in root_before.keys() {
                prop_assert!(after.contains_key(p), "{:?} was removed", p);
            }
            Ok(true)
        }
        Err(e) => {
            prop_assert!((400..600).contains(&e.status()), "{e:?}");
            prop_assert_eq!(
                after,
                root_before,
                "a failed unpack ({}) left something behind",
                e.message()
            );
            Ok(false)
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 160, ..ProptestConfig::default() })]

    #[test]
    fn random_archives_stay_inside(entries in proptest::collection::vec(entry(), 0..10),
                                   gz in any::<bool>(), pre in any::<bool>()) {
        let s = Scratch::new();
        let tar = build_tar(&entries, &s.escape);
        let archive = if gz { gzip(&tar) } else { tar };
        check_unpack(&s, &archive, gz, pre)?;
    }

    #[test]
    fn mutated_archives_stay_inside(entries in proptest::collection::vec(entry(), 1..6),
                                    flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..12),
                                    cut in proptest::option::of(any::<prop::sample::Index>()),
                                    gz in any::<bool>(), mutate_gz in any::<bool>()) {
        let s = Scratch::new();
        let mut tar = build_tar(&entries, &s.escape);
        if !(gz && mutate_gz) {
            for (i, b) in &flips {
                let i = i.index(tar.len());
                tar[i] ^= b | 1;
            }
        }
        let mut archive = if gz { gzip(&tar) } else { tar };
        if gz && mutate_gz {
            for (i, b) in &flips {
                let i = i.index(archive.len());
                archive[i] ^= b | 1;
            }
        }
        if let Some(c) = cut {
            let n = c.index(archive.len() + 1);
            archive.truncate(n);
        }
        check_unpack(&s, &archive, gz, false)?;
    }

    #[test]
    fn arbitrary_bytes_are_refused_cleanly(bytes in proptest::collection::vec(any::<u8>(), 0..3000), gz in any::<bool>()) {
        check_unpack(&Scratch::new(), &bytes, gz, false)?;
    }

    /// A well-formed archive of safe names (tar::Builder's) unpacks to exactly what it
    /// holds, and packing that tree with `pack_tar` and unpacking it again gives the same.
    #[test]
    fn well_formed_archives_round_trip(files in proptest::collection::btree_map("[a-c]{1,2}(/[a-c]{1,2}){0,2}", proptest::collection::vec(any::<u8>(), 0..200), 1..6)) {
        // Drop names that are a prefix directory of another (a file cannot also be a dir).
        let names: Vec<&String> = files.keys().collect();
        let files: BTreeMap<String, Vec<u8>> = files.iter()
            .filter(|(n, _)| !names.iter().any(|m| m.starts_with(&format!("{n}/"))))
            .map(|(n, d)| (n.clone(), d.clone()))
            .collect();
        let mut b = tar::Builder::new(Vec::new());
        for (n, d) in &files {
            let mut h = tar::Header::new_gnu();
            h.set_size(d.len() as u64);
            h.set_mode(0o644);
            h.set_entry_type(tar::EntryType::Regular);
            h.set_cksum();
            b.append_data(&mut h, n, d.as_slice()).unwrap();
        }
        let tar = b.into_inner().unwrap();
        let s = Scratch::new();
        let root = Root::open(s.root()).unwrap();
        let stats = root.unpack_tar_into("/dest", tar.as_slice(), &Limits::default()).unwrap();
        prop_assert_eq!(stats.bytes, files.values().map(|d| d.len() as u64).sum::<u64>());
        for (n, d) in &files {
            prop_assert_eq!(&std::fs::read(s.root().join("dest").join(n)).unwrap(), d);
        }
        // Our own writer → our reader.
        let mut packed = Vec::new();
        root.pack_tar("/dest", &mut packed).unwrap();
        let s2 = Scratch::new();
        let root2 = Root::open(s2.root()).unwrap();
        root2.unpack_tar_into("/copy", packed.as_slice(), &Limits::default()).unwrap();
        prop_assert_eq!(snapshot(&s.root().join("dest"), None), snapshot(&s2.root().join("copy"), None));
    }
}
