//! Command output on the host: what a command printed, appended to files as
//! it arrives, so it can be replayed from any offset after a reconnect or a
//! server restart.
//!
//! Per command directory: `stdout`, `stderr` (raw bytes) and `index`, one
//! fixed-size record per chunk in arrival order. A chunk's bytes are written
//! before its index record, so the index is the truth: on recovery the data
//! files are cut back to what the index covers and the agent resends the rest.
//!
//! Output is capped per stream: past the cap, the head of the stream is
//! dropped (its disk blocks freed with `FALLOC_FL_PUNCH_HOLE`, so offsets never
//! change) and only the last `cap` bytes (rounded to 1 MiB) are kept. The first
//! kept offset of each stream (its *base*) is in `bases`, written before the
//! punch, so readers skip what is gone and never see the hole.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use space_agent::protocol::Stream;

const RECORD_LEN: u64 = 24;

/// Granularity of dropping the head of a capped stream.
const DROP_STEP: u64 = 1 << 20;

/// How much has been stored so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutputProgress {
    pub stdout: u64,
    pub stderr: u64,
    /// The command has ended and its result is stored: nothing more will come.
    pub done: bool,
    /// Bytes dropped from the head of each stream by the output cap.
    pub stdout_base: u64,
    pub stderr_base: u64,
}

impl OutputProgress {
    pub fn combined(&self) -> u64 {
        self.stdout + self.stderr
    }

    /// Whether the cap has dropped anything.
    pub fn truncated(&self) -> bool {
        self.stdout_base > 0 || self.stderr_base > 0
    }
}

/// The first kept offset of each stream.
fn read_bases(dir: &Path) -> (u64, u64) {
    let Ok(b) = std::fs::read(dir.join("bases")) else {
        return (0, 0);
    };
    if b.len() != 16 {
        return (0, 0);
    }
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    let out = u64::from_le_bytes(a);
    a.copy_from_slice(&b[8..]);
    (out, u64::from_le_bytes(a))
}

fn write_bases(dir: &Path, stdout: u64, stderr: u64) -> io::Result<()> {
    let tmp = dir.join("bases.tmp");
    let mut b = Vec::with_capacity(16);
    b.extend_from_slice(&stdout.to_le_bytes());
    b.extend_from_slice(&stderr.to_le_bytes());
    std::fs::write(&tmp, b)?;
    std::fs::rename(tmp, dir.join("bases"))
}

/// Frees the disk blocks of `[from, to)` in `f`, keeping its size and offsets.
fn punch(f: &File, from: u64, to: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    if to <= from {
        return Ok(());
    }
    let (Ok(off), Ok(len)) = (i64::try_from(from), i64::try_from(to - from)) else {
        return Ok(());
    };
    // SAFETY: a plain syscall on a file descriptor we own.
    let r = unsafe {
        libc::fallocate(
            f.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off,
            len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The single writer of one command's output.
#[derive(Debug)]
pub struct OutputWriter {
    dir: std::path::PathBuf,
    stdout: File,
    stderr: File,
    index: File,
    progress: OutputProgress,
    /// Bytes kept per stream; 0 keeps everything.
    cap: u64,
}

impl OutputWriter {
    /// Opens the output of a command, creating it or recovering it after a crash.
    /// Each stream keeps its last `cap` bytes (0: all).
    pub fn open(dir: &Path, cap: u64) -> io::Result<OutputWriter> {
        std::fs::create_dir_all(dir)?;
        let open = |name: &str| {
            OpenOptions::new()
                .create(true)
                .read(true)
                .append(true)
                .open(dir.join(name))
        };
        let (stdout, stderr, index) = (open("stdout")?, open("stderr")?, open("index")?);
        // Drop a torn index record, then recount from the index.
        let whole = index.metadata()?.len() / RECORD_LEN * RECORD_LEN;
        index.set_len(whole)?;
        let mut progress = OutputProgress::default();
        let mut reader = io::BufReader::new(File::open(dir.join("index"))?);
        let mut rec = [0u8; RECORD_LEN as usize];
        for _ in 0..whole / RECORD_LEN {
            reader.read_exact(&mut rec)?;
            let r = Record::decode(&rec);
            match r.stream {
                Stream::Stdout => progress.stdout += u64::from(r.len),
                Stream::Stderr => progress.stderr += u64::from(r.len),
            }
        }
        stdout.set_len(progress.stdout)?;
        stderr.set_len(progress.stderr)?;
        let (stdout_base, stderr_base) = read_bases(dir);
        progress.stdout_base = stdout_base.min(progress.stdout);
        progress.stderr_base = stderr_base.min(progress.stderr);
        Ok(OutputWriter {
            dir: dir.to_path_buf(),
            stdout,
            stderr,
            index,
            progress,
            cap,
        })
    }

    pub fn progress(&self) -> OutputProgress {
        self.progress
    }

    /// Appends a chunk of one stream.
    pub fn append(&mut self, stream: Stream, data: &[u8]) -> io::Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let len = u32::try_from(data.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "chunk too large"))?;
        let (file, stream_offset) = match stream {
            Stream::Stdout => (&mut self.stdout, self.progress.stdout),
            Stream::Stderr => (&mut self.stderr, self.progress.stderr),
        };
        file.write_all(data)?;
        let rec = Record {
            combined_offset: self.progress.combined(),
            stream_offset,
            len,
            stream,
        };
        self.index.write_all(&rec.encode())?;
        match stream {
            Stream::Stdout => self.progress.stdout += u64::from(len),
            Stream::Stderr => self.progress.stderr += u64::from(len),
        }
        self.enforce_cap()
    }

    /// Drops the head of a stream that has grown past the cap by a whole step.
    fn enforce_cap(&mut self) -> io::Result<()> {
        if self.cap == 0 {
            return Ok(());
        }
        let p = self.progress;
        let want = |len: u64, base: u64| {
            let keep_from = len.saturating_sub(self.cap) / DROP_STEP * DROP_STEP;
            (keep_from > base).then_some(keep_from)
        };
        let new_out = want(p.stdout, p.stdout_base);
        let new_err = want(p.stderr, p.stderr_base);
        if new_out.is_none() && new_err.is_none() {
            return Ok(());
        }
        let (out, err) = (
            new_out.unwrap_or(p.stdout_base),
            new_err.unwrap_or(p.stderr_base),
        );
        // Readers learn the new bases before the bytes disappear.
        write_bases(&self.dir, out, err)?;
        punch(&self.stdout, p.stdout_base, out)?;
        punch(&self.stderr, p.stderr_base, err)?;
        self.progress.stdout_base = out;
        self.progress.stderr_base = err;
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Record {
    combined_offset: u64,
    stream_offset: u64,
    len: u32,
    stream: Stream,
}

impl Record {
    fn encode(&self) -> [u8; RECORD_LEN as usize] {
        let mut b = [0u8; RECORD_LEN as usize];
        b[0..8].copy_from_slice(&self.combined_offset.to_le_bytes());
        b[8..16].copy_from_slice(&self.stream_offset.to_le_bytes());
        b[16..20].copy_from_slice(&self.len.to_le_bytes());
        b[20] = match self.stream {
            Stream::Stdout => 1,
            Stream::Stderr => 2,
        };
        b
    }

    fn decode(b: &[u8; RECORD_LEN as usize]) -> Record {
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        Record {
            combined_offset: u64_at(0),
            stream_offset: u64_at(8),
            len: u32::from_le_bytes([b[16], b[17], b[18], b[19]]),
            stream: if b[20] == 2 {
                Stream::Stderr
            } else {
                Stream::Stdout
            },
        }
    }
}

/// Which bytes a reader wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum View {
    Stdout,
    Stderr,
    /// Both streams interleaved in arrival order.
    Combined,
}

/// A piece of output for a reader: `offset` is its position in the view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    pub stream: Stream,
    pub offset: u64,
    pub data: Vec<u8>,
}

/// Reads output of the command in `dir` from `offset` in `view`, up to `upto`
/// (the stored length of that view: bytes past it may not be final yet) and
/// at most `max` bytes in all.
pub fn read_pieces(
    dir: &Path,
    view: View,
    offset: u64,
    upto: u64,
    max: usize,
) -> io::Result<Vec<Piece>> {
    let (stdout_base, stderr_base) = read_bases(dir);
    let offset = match view {
        View::Stdout => offset.max(stdout_base),
        View::Stderr => offset.max(stderr_base),
        View::Combined => offset,
    };
    if offset >= upto {
        return Ok(Vec::new());
    }
    let want = usize::try_from(upto - offset)
        .unwrap_or(usize::MAX)
        .min(max);
    match view {
        View::Stdout | View::Stderr => {
            let (name, stream) = if view == View::Stdout {
                ("stdout", Stream::Stdout)
            } else {
                ("stderr", Stream::Stderr)
            };
            let data = read_at(&dir.join(name), offset, want)?;
            Ok(vec![Piece {
                stream,
                offset,
                data,
            }])
        }
        View::Combined => read_combined(dir, offset, want, (stdout_base, stderr_base)),
    }
}

fn read_at(path: &Path, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    f.seek(SeekFrom::Start(offset))?;
    let mut data = Vec::with_capacity(len.min(1 << 20));
    f.take(len as u64).read_to_end(&mut data)?;
    Ok(data)
}

fn read_combined(
    dir: &Path,
    offset: u64,
    want: usize,
    bases: (u64, u64),
) -> io::Result<Vec<Piece>> {
    let index = match File::open(dir.join("index")) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let count = index.metadata()?.len() / RECORD_LEN;
    let record_at = |i: u64| -> io::Result<Record> {
        let mut b = [0u8; RECORD_LEN as usize];
        index.read_exact_at(&mut b, i * RECORD_LEN)?;
        Ok(Record::decode(&b))
    };
    // Binary search: the last record starting at or before `offset`.
    let (mut lo, mut hi) = (0u64, count);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if record_at(mid)?.combined_offset <= offset {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    let mut i = lo.saturating_sub(1);
    let mut pieces = Vec::new();
    let mut remaining = want;
    let mut files: [Option<File>; 2] = [None, None];
    while i < count && remaining > 0 {
        let r = record_at(i)?;
        i += 1;
        let end = r.combined_offset + u64::from(r.len);
        if end <= offset {
            continue;
        }
        let mut skip = offset.saturating_sub(r.combined_offset);
        // Skip what the cap dropped from this record's stream.
        let base = if r.stream == Stream::Stderr {
            bases.1
        } else {
            bases.0
        };
        skip = skip.max(base.saturating_sub(r.stream_offset));
        if skip >= u64::from(r.len) {
            continue;
        }
        let take = usize::try_from(u64::from(r.len) - skip)
            .unwrap_or(usize::MAX)
            .min(remaining);
        let slot = usize::from(r.stream == Stream::Stderr);
        if files[slot].is_none() {
            let name = if slot == 0 { "stdout" } else { "stderr" };
            files[slot] = Some(File::open(dir.join(name))?);
        }
        let mut data = vec![0u8; take];
        if let Some(f) = &files[slot] {
            f.read_exact_at(&mut data, r.stream_offset + skip)?;
        }
        pieces.push(Piece {
            stream: r.stream,
            offset: r.combined_offset + skip,
            data,
        });
        remaining -= take;
    }
    Ok(pieces)
}

/// The stored lengths of a command's output, from its files.
pub fn stored_progress(dir: &Path) -> OutputProgress {
    let len = |n: &str| std::fs::metadata(dir.join(n)).map(|m| m.len()).unwrap_or(0);
    let (stdout_base, stderr_base) = read_bases(dir);
    OutputProgress {
        stdout: len("stdout"),
        stderr: len("stderr"),
        done: false,
        stdout_base,
        stderr_base,
    }
}

/// Where a command's output lives under the data directory.
pub fn command_dir(outputs_root: &Path, sandbox_id: &str, command_id: &str) -> PathBuf {
    outputs_root.join(sandbox_id).join(command_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn combined_view_is_arrival_order_and_offsets_are_exact() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = OutputWriter::open(dir.path(), 0).unwrap();
        w.append(Stream::Stdout, b"hello ").unwrap();
        w.append(Stream::Stderr, b"oops ").unwrap();
        w.append(Stream::Stdout, b"world").unwrap();
        let p = w.progress();
        assert_eq!((p.stdout, p.stderr, p.combined()), (11, 5, 16));

        let all = read_pieces(dir.path(), View::Combined, 0, 16, usize::MAX).unwrap();
        let text: Vec<u8> = all.iter().flat_map(|p| p.data.clone()).collect();
        assert_eq!(text, b"hello oops world");
        assert_eq!(all[1].stream, Stream::Stderr);
        assert_eq!(all[1].offset, 6);

        for start in 0..16u64 {
            let got: Vec<u8> = read_pieces(dir.path(), View::Combined, start, 16, usize::MAX)
                .unwrap()
                .iter()
                .flat_map(|p| p.data.clone())
                .collect();
            assert_eq!(got, &b"hello oops world"[start as usize..]);
        }
        let out = read_pieces(dir.path(), View::Stdout, 3, 11, 4).unwrap();
        assert_eq!(out[0].data, b"lo w");
    }

    #[test]
    fn the_cap_keeps_the_tail_and_frees_the_head() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let mut w = OutputWriter::open(dir.path(), 2 << 20).unwrap();
        let chunk: Vec<u8> = (0..=255u8).cycle().take(64 * 1024).collect();
        for _ in 0..160 {
            w.append(Stream::Stdout, &chunk).unwrap();
        }
        w.append(Stream::Stderr, b"tail").unwrap();
        let p = w.progress();
        assert_eq!(p.stdout, 160 * 64 * 1024);
        assert!(p.truncated());
        assert!(p.stdout - p.stdout_base >= 2 << 20);
        assert!(p.stdout - p.stdout_base < 3 << 20);
        // The dropped head no longer takes disk space.
        let blocks = std::fs::metadata(dir.path().join("stdout"))
            .unwrap()
            .blocks()
            * 512;
        assert!(blocks <= 4 << 20, "{blocks} bytes on disk");
        // Readers start at the base, in both views, and never see zeros from the hole.
        let got = read_pieces(dir.path(), View::Stdout, 0, p.stdout, usize::MAX).unwrap();
        assert_eq!(got[0].offset, p.stdout_base);
        let all = read_pieces(dir.path(), View::Combined, 0, p.combined(), usize::MAX).unwrap();
        let bytes: Vec<u8> = all.iter().flat_map(|x| x.data.clone()).collect();
        assert_eq!(bytes.len() as u64, p.stdout - p.stdout_base + 4);
        assert_eq!(&bytes[..4], &chunk[..4]);
        assert!(bytes.ends_with(b"tail"));
        // A reopen (after a crash) knows the bases.
        drop(w);
        let w = OutputWriter::open(dir.path(), 2 << 20).unwrap();
        assert_eq!(w.progress().stdout_base, p.stdout_base);
    }

    #[test]
    fn recovery_cuts_unindexed_bytes() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut w = OutputWriter::open(dir.path(), 0).unwrap();
            w.append(Stream::Stdout, b"abc").unwrap();
        }
        // A crash after the data write but before the index record, plus a torn record.
        OpenOptions::new()
            .append(true)
            .open(dir.path().join("stdout"))
            .unwrap()
            .write_all(b"zzz")
            .unwrap();
        OpenOptions::new()
            .append(true)
            .open(dir.path().join("index"))
            .unwrap()
            .write_all(&[1, 2, 3])
            .unwrap();
        let mut w = OutputWriter::open(dir.path(), 0).unwrap();
        assert_eq!(w.progress().stdout, 3);
        w.append(Stream::Stdout, b"def").unwrap();
        assert_eq!(std::fs::read(dir.path().join("stdout")).unwrap(), b"abcdef");
        let got = read_pieces(dir.path(), View::Combined, 0, 6, usize::MAX).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[1].data, b"def");
    }
}
