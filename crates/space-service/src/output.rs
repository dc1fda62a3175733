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
//!
//! The index is bounded too: consecutive chunks of one stream share a record,
//! and past [`index_cap`] the head of the index is dropped the same way (with the
//! output it described). A sandbox's commands share an [`OutputBudget`]: running
//! commands split it, and the service drops the output of finished commands,
//! oldest first, to keep the sandbox within it.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use space_agent::protocol::Stream;

const RECORD_LEN: u64 = 24;

/// Granularity of dropping the head of a capped stream.
const DROP_STEP: u64 = 1 << 20;
/// Granularity of dropping the head of the index, in records.
const INDEX_DROP_STEP: u64 = DROP_STEP / RECORD_LEN;
/// The most one record may describe (consecutive chunks of a stream are merged).
const MAX_RECORD_LEN: u32 = 1 << 30;

/// A stream's bytes are handed to the disk in steps of this size as they come in...
const WRITEBACK_STEP: u64 = 4 << 20;
/// ...and once they are this far behind the end of the stream, written and out of the
/// page cache: live readers, who read right behind the writer, still find them there.
///
/// A page-cache page a long stream fills is otherwise a fresh page each 4 KiB, and on a
/// host that hands free memory back to its hypervisor (free page reporting, as on these
/// VMs) the first touch of each costs a fault outside the guest: appending ran at about
/// 370 MiB/s and 2.7–3.1 ms of CPU per MiB, the server's largest cost per streamed byte.
/// Pages given back here are reused by the next writes at once: 1.8–1.9 GiB/s and
/// 0.4 ms/MiB, disk writeback included (`benches/commands.rs` measures the stream).
const CACHE_BEHIND: u64 = 16 << 20;

/// The bytes of index kept for a command whose streams keep `cap` bytes each:
/// an eighth of that, at least 1 MiB (0: no cap).
pub fn index_cap(cap: u64) -> u64 {
    if cap == 0 {
        0
    } else {
        (cap / 8).max(DROP_STEP)
    }
}

/// What the commands of one sandbox may keep on the host, together.
#[derive(Debug)]
pub struct OutputBudget {
    /// Bytes; 0: no budget.
    limit: u64,
    /// Writers open now: running commands share the budget.
    writers: std::sync::atomic::AtomicU64,
    /// Bytes written since the service last checked the sandbox's total.
    unchecked: std::sync::atomic::AtomicU64,
}

impl OutputBudget {
    pub fn new(limit: u64) -> std::sync::Arc<OutputBudget> {
        std::sync::Arc::new(OutputBudget {
            limit,
            writers: Default::default(),
            unchecked: Default::default(),
        })
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The per-stream cap of each running command: its share of the budget.
    fn share(&self) -> u64 {
        use std::sync::atomic::Ordering;
        let n = self.writers.load(Ordering::Relaxed).max(1);
        (self.limit / (2 * n)).max(2 * DROP_STEP)
    }

    /// Counts `n` bytes written; true when the sandbox's total is due a check.
    fn charge(&self, n: u64) -> bool {
        use std::sync::atomic::Ordering;
        if self.limit == 0 {
            return false;
        }
        let step = (self.limit / 8).max(DROP_STEP);
        let before = self.unchecked.fetch_add(n, Ordering::Relaxed);
        if before + n >= step {
            self.unchecked.store(0, Ordering::Relaxed);
            return true;
        }
        false
    }
}

/// Offsets per view below which a live reader lags so far that the cap may soon drop
/// what it has not read ([`OutputWriter::hold_line`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HoldLine {
    pub stdout: u64,
    pub stderr: u64,
    pub combined: u64,
}

impl HoldLine {
    /// The line in `view`.
    pub fn of(&self, view: View) -> u64 {
        match view {
            View::Stdout => self.stdout,
            View::Stderr => self.stderr,
            View::Combined => self.combined,
        }
    }
}

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

/// What the output cap has dropped: the first kept offset of each stream, and the
/// first kept index record.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Bases {
    stdout: u64,
    stderr: u64,
    index: u64,
}

fn read_bases(dir: &Path) -> Bases {
    let Ok(b) = std::fs::read(dir.join("bases")) else {
        return Bases::default();
    };
    let at = |i: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[i..i + 8]);
        u64::from_le_bytes(a)
    };
    match b.len() {
        16 => Bases {
            stdout: at(0),
            stderr: at(8),
            index: 0,
        },
        24 => Bases {
            stdout: at(0),
            stderr: at(8),
            index: at(16),
        },
        _ => Bases::default(),
    }
}

fn write_bases(dir: &Path, b: Bases) -> io::Result<()> {
    let tmp = dir.join("bases.tmp");
    let mut bytes = Vec::with_capacity(24);
    bytes.extend_from_slice(&b.stdout.to_le_bytes());
    bytes.extend_from_slice(&b.stderr.to_le_bytes());
    bytes.extend_from_slice(&b.index.to_le_bytes());
    std::fs::write(&tmp, bytes)?;
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
    /// Records in the index file (including dropped ones, which are holes).
    records: u64,
    /// The last record, which a chunk of the same stream extends.
    last: Option<Record>,
    first_record: u64,
    progress: OutputProgress,
    /// Bytes kept per stream; 0 keeps everything (up to the budget's share).
    cap: u64,
    budget: Option<std::sync::Arc<OutputBudget>>,
    /// Per stream (stdout, stderr): the offset up to which writeback has been started
    /// (a multiple of [`WRITEBACK_STEP`]).
    written_back: [u64; 2],
}

impl Drop for OutputWriter {
    fn drop(&mut self) {
        if let Some(b) = &self.budget {
            b.writers.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

impl OutputWriter {
    /// Opens the output of a command, creating it or recovering it after a crash.
    /// Each stream keeps its last `cap` bytes (0: all), and no more than its share
    /// of the sandbox's `budget`.
    pub fn open(
        dir: &Path,
        cap: u64,
        budget: Option<std::sync::Arc<OutputBudget>>,
    ) -> io::Result<OutputWriter> {
        std::fs::create_dir_all(dir)?;
        let open = |name: &str| {
            OpenOptions::new()
                .create(true)
                .read(true)
                .append(true)
                .open(dir.join(name))
        };
        let (stdout, stderr) = (open("stdout")?, open("stderr")?);
        // The index is written at explicit offsets (its last record is extended in place).
        let index = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(dir.join("index"))?;
        // Drop a torn index record; the last record says how much is stored.
        let records = index.metadata()?.len() / RECORD_LEN;
        index.set_len(records * RECORD_LEN)?;
        let bases = read_bases(dir);
        let first_record = bases.index.min(records);
        let last = match records > first_record {
            true => Some(record_at(&index, records - 1)?),
            false => None,
        };
        let mut progress = OutputProgress::default();
        if let Some(r) = last {
            let (out, err) = r.stream_ends();
            progress.stdout = out;
            progress.stderr = err;
        }
        stdout.set_len(progress.stdout)?;
        stderr.set_len(progress.stderr)?;
        progress.stdout_base = bases.stdout.min(progress.stdout);
        progress.stderr_base = bases.stderr.min(progress.stderr);
        if let Some(b) = &budget {
            b.writers.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(OutputWriter {
            dir: dir.to_path_buf(),
            stdout,
            stderr,
            index,
            records,
            last,
            first_record,
            progress,
            cap,
            budget,
            written_back: [
                progress.stdout / WRITEBACK_STEP * WRITEBACK_STEP,
                progress.stderr / WRITEBACK_STEP * WRITEBACK_STEP,
            ],
        })
    }

    pub fn progress(&self) -> OutputProgress {
        self.progress
    }

    /// Appends a chunk of one stream. `Ok(true)` when the sandbox's output budget is
    /// due a check (see [`OutputBudget`]).
    pub fn append(&mut self, stream: Stream, data: &[u8]) -> io::Result<bool> {
        if data.is_empty() {
            return Ok(false);
        }
        let len = u32::try_from(data.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "chunk too large"))?;
        let (file, stream_offset) = match stream {
            Stream::Stdout => (&mut self.stdout, self.progress.stdout),
            Stream::Stderr => (&mut self.stderr, self.progress.stderr),
        };
        file.write_all(data)?;
        // The bytes are written before the record that makes them count.
        match self.last {
            Some(mut r) if r.stream == stream && r.len.saturating_add(len) <= MAX_RECORD_LEN => {
                r.len += len;
                self.index
                    .write_all_at(&r.encode(), (self.records - 1) * RECORD_LEN)?;
                self.last = Some(r);
            }
            _ => {
                let r = Record {
                    combined_offset: self.progress.combined(),
                    stream_offset,
                    len,
                    stream,
                };
                self.index
                    .write_all_at(&r.encode(), self.records * RECORD_LEN)?;
                self.records += 1;
                self.last = Some(r);
            }
        }
        match stream {
            Stream::Stdout => self.progress.stdout += u64::from(len),
            Stream::Stderr => self.progress.stderr += u64::from(len),
        }
        self.release_cache(stream);
        self.enforce_cap()?;
        Ok(self
            .budget
            .as_ref()
            .is_some_and(|b| b.charge(u64::from(len))))
    }

    /// Starts the writeback of each whole [`WRITEBACK_STEP`] of `stream` that is complete,
    /// and drops from the page cache the step that is now [`CACHE_BEHIND`] behind the end
    /// (waiting for its writeback, started long before, to finish). Only advice to the
    /// kernel: a failure changes nothing stored, and is ignored.
    fn release_cache(&mut self, stream: Stream) {
        let (file, end, i) = match stream {
            Stream::Stdout => (&self.stdout, self.progress.stdout, 0),
            Stream::Stderr => (&self.stderr, self.progress.stderr, 1),
        };
        let fd = file.as_raw_fd();
        let step = WRITEBACK_STEP as libc::off64_t;
        while end - self.written_back[i] >= WRITEBACK_STEP {
            let from = self.written_back[i];
            self.written_back[i] += WRITEBACK_STEP;
            // SAFETY: advisory calls on a descriptor this writer owns; no memory is passed.
            unsafe {
                libc::sync_file_range(fd, from as libc::off64_t, step, libc::SYNC_FILE_RANGE_WRITE);
            }
            let Some(old) = from.checked_sub(CACHE_BEHIND) else {
                continue;
            };
            // SAFETY: as above.
            unsafe {
                libc::sync_file_range(
                    fd,
                    old as libc::off64_t,
                    step,
                    libc::SYNC_FILE_RANGE_WAIT_BEFORE
                        | libc::SYNC_FILE_RANGE_WRITE
                        | libc::SYNC_FILE_RANGE_WAIT_AFTER,
                );
                libc::posix_fadvise(fd, old as libc::off_t, step, libc::POSIX_FADV_DONTNEED);
            }
        }
    }

    /// The bytes each stream keeps now (0: everything): the cap, and the command's share
    /// of the sandbox's budget.
    pub fn keeps(&self) -> u64 {
        self.effective_cap()
    }

    /// Where, in each view, a reader is more than half of what is kept behind the end:
    /// half the bytes each stream keeps ([`Self::keeps`]), or half the records the index
    /// keeps, whichever is nearer the end. Tiny writes that alternate between the two
    /// streams make one index record each, so the index can reach its cap long before
    /// the bytes reach theirs, and its trim drops their output too. `None` when
    /// everything is kept.
    pub fn hold_line(&self) -> io::Result<Option<HoldLine>> {
        let cap = self.effective_cap();
        if cap == 0 {
            return Ok(None);
        }
        let p = self.progress;
        let half = cap / 2;
        let mut line = HoldLine {
            stdout: p.stdout.saturating_sub(half),
            stderr: p.stderr.saturating_sub(half),
            combined: p.combined().saturating_sub(half),
        };
        let half_records = ((index_cap(cap) / RECORD_LEN) / 2).max(1);
        if self.records.saturating_sub(self.first_record) > half_records {
            let r = record_at(&self.index, self.records - half_records)?;
            let (out, err) = r.stream_starts();
            line.stdout = line.stdout.max(out);
            line.stderr = line.stderr.max(err);
            line.combined = line.combined.max(r.combined_offset);
        }
        Ok(Some(line))
    }

    /// The bytes each stream keeps: the cap, and the command's share of the budget.
    fn effective_cap(&self) -> u64 {
        let share = self
            .budget
            .as_ref()
            .filter(|b| b.limit > 0)
            .map(|b| b.share());
        match (self.cap, share) {
            (0, None) => 0,
            (0, Some(s)) => s,
            (c, None) => c,
            (c, Some(s)) => c.min(s),
        }
    }

    /// Drops the head of a stream that has grown past the cap by a whole step, and the
    /// head of an index that has grown past its own cap (with the output it described).
    fn enforce_cap(&mut self) -> io::Result<()> {
        let cap = self.effective_cap();
        if cap == 0 {
            return Ok(());
        }
        let p = self.progress;
        let want = |len: u64, base: u64| {
            let keep_from = len.saturating_sub(cap) / DROP_STEP * DROP_STEP;
            (keep_from > base).then_some(keep_from)
        };
        let mut out = want(p.stdout, p.stdout_base).unwrap_or(p.stdout_base);
        let mut err = want(p.stderr, p.stderr_base).unwrap_or(p.stderr_base);
        let mut first = self.first_record;
        let max_records = (index_cap(cap) / RECORD_LEN).max(1);
        if self.records - first > max_records + INDEX_DROP_STEP {
            first = self.records - max_records;
            // Output before the first kept record can no longer be placed in the
            // combined view: it goes with its records.
            let (o, e) = record_at(&self.index, first)?.stream_starts();
            out = out.max(o);
            err = err.max(e);
        }
        if (out, err, first) == (p.stdout_base, p.stderr_base, self.first_record) {
            return Ok(());
        }
        // Readers learn the new bases before the bytes disappear.
        write_bases(
            &self.dir,
            Bases {
                stdout: out,
                stderr: err,
                index: first,
            },
        )?;
        punch(&self.stdout, p.stdout_base, out)?;
        punch(&self.stderr, p.stderr_base, err)?;
        punch(
            &self.index,
            self.first_record * RECORD_LEN,
            first * RECORD_LEN,
        )?;
        self.progress.stdout_base = out;
        self.progress.stderr_base = err;
        self.first_record = first;
        Ok(())
    }
}

/// Drops all the stored output of a finished command (the service does this, oldest
/// first, to keep a sandbox within its output budget). Offsets stay valid; readers get
/// nothing. Returns the bytes freed.
pub fn drop_all(dir: &Path) -> io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let usage = disk_usage(dir);
    let len = |n: &str| std::fs::metadata(dir.join(n)).map(|m| m.len()).unwrap_or(0);
    let records = len("index") / RECORD_LEN;
    write_bases(
        dir,
        Bases {
            stdout: len("stdout"),
            stderr: len("stderr"),
            index: records,
        },
    )?;
    for name in ["stdout", "stderr", "index"] {
        if let Ok(f) = OpenOptions::new().write(true).open(dir.join(name)) {
            let size = f.metadata()?.size();
            punch(&f, 0, size)?;
        }
    }
    Ok(usage.saturating_sub(disk_usage(dir)))
}

/// Bytes a command's output takes on disk (allocated blocks: holes are free).
pub fn disk_usage(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.blocks() * 512)
        .sum()
}

fn record_at(index: &File, i: u64) -> io::Result<Record> {
    let mut b = [0u8; RECORD_LEN as usize];
    index.read_exact_at(&mut b, i * RECORD_LEN)?;
    Ok(Record::decode(&b))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Record {
    combined_offset: u64,
    stream_offset: u64,
    len: u32,
    stream: Stream,
}

impl Record {
    /// Where each stream stood when this record began: (stdout, stderr).
    fn stream_starts(&self) -> (u64, u64) {
        let other = self.combined_offset.saturating_sub(self.stream_offset);
        match self.stream {
            Stream::Stdout => (self.stream_offset, other),
            Stream::Stderr => (other, self.stream_offset),
        }
    }

    /// Where each stream stands after this record: (stdout, stderr).
    fn stream_ends(&self) -> (u64, u64) {
        let (out, err) = self.stream_starts();
        match self.stream {
            Stream::Stdout => (out + u64::from(self.len), err),
            Stream::Stderr => (out, err + u64::from(self.len)),
        }
    }

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
    OutputReader::new(dir).read(view, offset, upto, max)
}

/// A reader of one command's output that keeps its files open from one read to the
/// next: a follower reads again each time more has arrived.
#[derive(Debug)]
pub struct OutputReader {
    dir: PathBuf,
    /// `stdout`, `stderr`, `index`, opened as first needed.
    files: [Option<File>; 3],
}

impl OutputReader {
    pub fn new(dir: &Path) -> OutputReader {
        OutputReader {
            dir: dir.to_path_buf(),
            files: [None, None, None],
        }
    }

    /// File `slot` (0 stdout, 1 stderr, 2 index); `None` while it does not exist.
    fn file(&mut self, slot: usize) -> io::Result<Option<&File>> {
        if self.files[slot].is_none() {
            let name = ["stdout", "stderr", "index"][slot];
            match File::open(self.dir.join(name)) {
                Ok(f) => self.files[slot] = Some(f),
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        Ok(self.files[slot].as_ref())
    }

    /// As [`read_pieces`].
    pub fn read(
        &mut self,
        view: View,
        offset: u64,
        upto: u64,
        max: usize,
    ) -> io::Result<Vec<Piece>> {
        let bases = read_bases(&self.dir);
        let offset = match view {
            View::Stdout => offset.max(bases.stdout),
            View::Stderr => offset.max(bases.stderr),
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
                let (slot, stream) = if view == View::Stdout {
                    (0, Stream::Stdout)
                } else {
                    (1, Stream::Stderr)
                };
                let Some(f) = self.file(slot)? else {
                    return Ok(Vec::new());
                };
                let data = read_at(f, offset, want)?;
                drop_behind(f, offset, data.len());
                Ok(vec![Piece {
                    stream,
                    offset,
                    data,
                }])
            }
            View::Combined => self.read_combined(offset, want, bases),
        }
    }

    fn read_combined(&mut self, offset: u64, want: usize, bases: Bases) -> io::Result<Vec<Piece>> {
        let Some(index) = self.file(2)? else {
            return Ok(Vec::new());
        };
        let index = index.try_clone()?;
        let count = index.metadata()?.len() / RECORD_LEN;
        let record_at = |i: u64| record_at(&index, i);
        // Binary search among the kept records: the last one starting at or before `offset`.
        let (mut lo, mut hi) = (bases.index.min(count), count);
        let first = lo;
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if record_at(mid)?.combined_offset <= offset {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let mut i = lo.saturating_sub(1).max(first);
        let mut pieces = Vec::new();
        let mut remaining = want;
        // What was read of each stream's file, given up to `drop_behind` once at the end.
        let mut spans: [Option<(u64, u64)>; 2] = [None, None];
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
                bases.stderr
            } else {
                bases.stdout
            };
            skip = skip.max(base.saturating_sub(r.stream_offset));
            if skip >= u64::from(r.len) {
                continue;
            }
            let take = usize::try_from(u64::from(r.len) - skip)
                .unwrap_or(usize::MAX)
                .min(remaining);
            let slot = usize::from(r.stream == Stream::Stderr);
            let Some(f) = self.file(slot)? else {
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    "an output file the index refers to is missing",
                ));
            };
            let mut data = vec![0u8; take];
            let at = r.stream_offset + skip;
            f.read_exact_at(&mut data, at)?;
            let span = &mut spans[slot];
            *span = Some(span.map_or((at, at + take as u64), |(from, to)| {
                (from.min(at), to.max(at + take as u64))
            }));
            pieces.push(Piece {
                stream: r.stream,
                offset: r.combined_offset + skip,
                data,
            });
            remaining -= take;
        }
        for (slot, span) in spans.into_iter().enumerate() {
            if let (Some((from, to)), Some(f)) = (span, self.files[slot].as_ref()) {
                drop_behind(f, from, usize::try_from(to - from).unwrap_or(usize::MAX));
            }
        }
        Ok(pieces)
    }
}

/// After a read of `len` bytes at `offset`: drops from the page cache those of them that
/// are [`CACHE_BEHIND`] or more behind the file's end, where the writer already dropped
/// them (see [`OutputWriter`]): a reader of old output then reuses its own pages, as the
/// writer does, rather than filling fresh ones. Only advice; errors are ignored.
fn drop_behind(f: &File, offset: u64, len: usize) {
    let Ok(m) = f.metadata() else { return };
    let to = (offset + len as u64).min(m.len().saturating_sub(CACHE_BEHIND));
    if to > offset {
        // SAFETY: advice on a descriptor the reader owns; no memory is passed.
        unsafe {
            libc::posix_fadvise(
                f.as_raw_fd(),
                offset as libc::off_t,
                (to - offset) as libc::off_t,
                libc::POSIX_FADV_DONTNEED,
            )
        };
    }
}

/// Up to `len` bytes of `f` from `offset`: fewer where the file ends first.
fn read_at(f: &File, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut data = vec![0u8; len];
    let mut got = 0;
    while got < len {
        match f.read_at(&mut data[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    data.truncate(got);
    Ok(data)
}

/// The stored lengths of a command's output, from its files.
pub fn stored_progress(dir: &Path) -> OutputProgress {
    let len = |n: &str| std::fs::metadata(dir.join(n)).map(|m| m.len()).unwrap_or(0);
    let bases = read_bases(dir);
    OutputProgress {
        stdout: len("stdout"),
        stderr: len("stderr"),
        done: false,
        stdout_base: bases.stdout,
        stderr_base: bases.stderr,
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
        let mut w = OutputWriter::open(dir.path(), 0, None).unwrap();
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
        let mut w = OutputWriter::open(dir.path(), 2 << 20, None).unwrap();
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
        let w = OutputWriter::open(dir.path(), 2 << 20, None).unwrap();
        assert_eq!(w.progress().stdout_base, p.stdout_base);
    }

    #[test]
    fn the_hold_line_is_half_of_what_is_kept_in_bytes_or_in_index_records() {
        let dir = tempfile::tempdir().unwrap();
        // Nothing is dropped without a cap, so nobody is held for.
        let mut w = OutputWriter::open(dir.path(), 0, None).unwrap();
        w.append(Stream::Stdout, b"x").unwrap();
        assert_eq!(w.hold_line().unwrap(), None);

        // Bytes: half the cap behind each end.
        let dir = tempfile::tempdir().unwrap();
        let cap = 2 << 20;
        let mut w = OutputWriter::open(dir.path(), cap, None).unwrap();
        w.append(Stream::Stdout, &vec![b'o'; 3 << 20]).unwrap();
        w.append(Stream::Stderr, &[b'e'; 100]).unwrap();
        let line = w.hold_line().unwrap().unwrap();
        assert_eq!(
            (line.stdout, line.stderr, line.combined),
            ((3 << 20) - (1 << 20), 0, (3 << 20) + 100 - (1 << 20))
        );

        // Records: one-byte writes that alternate between the streams make a record
        // each. The index keeps 1 MiB of them (43690) and trims its head once it holds
        // a step (as many again) more, long before the bytes reach the cap; so the line
        // is half the records kept behind the newest.
        let dir = tempfile::tempdir().unwrap();
        let mut w = OutputWriter::open(dir.path(), cap, None).unwrap();
        let write = |w: &mut OutputWriter, from: u64, to: u64| {
            for i in from..to {
                let stream = [Stream::Stdout, Stream::Stderr][(i % 2) as usize];
                w.append(stream, b"x").unwrap();
            }
        };
        let kept = index_cap(cap) / RECORD_LEN;
        let (half, n) = (kept / 2, 2 * kept);
        write(&mut w, 0, n);
        assert!(!w.progress().truncated(), "nothing trimmed yet");
        let line = w.hold_line().unwrap().unwrap();
        let at = n - half;
        assert_eq!(
            (line.combined, line.stdout, line.stderr),
            (at, at.div_ceil(2), at / 2)
        );
        // The trim comes with the next record. A reader at the line still finds all its
        // bytes after it, and after as many records again; one far behind finds a gap.
        write(&mut w, n, n + half);
        let p = w.progress();
        assert!(p.truncated());
        let end = p.combined();
        let got = read_pieces(dir.path(), View::Combined, at, end, usize::MAX).unwrap();
        assert_eq!(got[0].offset, at);
        assert_eq!(
            got.iter().map(|p| p.data.len() as u64).sum::<u64>(),
            end - at
        );
        let behind = read_pieces(dir.path(), View::Combined, 0, end, usize::MAX).unwrap();
        assert!(
            behind[0].offset > 0 && behind[0].offset <= at,
            "{}",
            behind[0].offset
        );
    }

    /// Pages of the first `len` bytes of `file` in the page cache.
    fn resident_pages(file: &File, len: usize) -> usize {
        // SAFETY: a read-only shared map of `len` bytes of a file that long or longer, only
        // given to mincore and unmapped before returning.
        unsafe {
            let map = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            );
            assert_ne!(map, libc::MAP_FAILED);
            let mut pages = vec![0u8; len.div_ceil(4096)];
            assert_eq!(libc::mincore(map, len, pages.as_mut_ptr()), 0);
            libc::munmap(map, len);
            pages.iter().filter(|p| *p & 1 == 1).count()
        }
    }

    #[test]
    fn a_long_stream_leaves_the_page_cache_behind_it_and_its_bytes_intact() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = OutputWriter::open(dir.path(), 0, None).unwrap();
        // 40 MiB in 256 KiB chunks, each byte telling its offset; a line of stderr between.
        let total: u64 = 40 << 20;
        let byte_at = |o: u64| (o % 251) as u8;
        let mut off = 0u64;
        while off < total {
            let chunk: Vec<u8> = (off..off + (256 << 10)).map(byte_at).collect();
            w.append(Stream::Stdout, &chunk).unwrap();
            off += chunk.len() as u64;
            if off.is_multiple_of(8 << 20) {
                w.append(Stream::Stderr, b"progress\n").unwrap();
            }
        }
        let path = dir.path().join("stdout");
        // The first steps are out of the page cache (on a filesystem that has one of its
        // own: on tmpfs the cache is the storage, and the advice does nothing).
        let file = File::open(&path).unwrap();
        // SAFETY: statfs into a zeroed struct of the right type.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::fstatfs(file.as_raw_fd(), &mut fs) }, 0);
        if fs.f_type != libc::TMPFS_MAGIC {
            let head = (total - CACHE_BEHIND - WRITEBACK_STEP) as usize;
            let resident = resident_pages(&file, head);
            assert_eq!(resident, 0, "pages of the first {head} bytes still cached");
        }
        // Every byte reads back, in each view, from the disk where it is no longer cached.
        let mut got = Vec::new();
        let mut at = 0;
        while at < total {
            for piece in read_pieces(dir.path(), View::Stdout, at, total, 4 << 20).unwrap() {
                assert_eq!(piece.offset, at);
                at += piece.data.len() as u64;
                got.extend(piece.data);
            }
        }
        assert!(got.iter().enumerate().all(|(i, b)| *b == byte_at(i as u64)));
        // Reading it back did not leave it cached either.
        if fs.f_type != libc::TMPFS_MAGIC {
            assert_eq!(resident_pages(&file, (total - CACHE_BEHIND) as usize), 0);
        }
        let p = w.progress();
        // The combined view reads it all from the disk again, and leaves its head uncached too.
        let all = read_pieces(dir.path(), View::Combined, 0, p.combined(), usize::MAX).unwrap();
        if fs.f_type != libc::TMPFS_MAGIC {
            assert_eq!(resident_pages(&file, (total - CACHE_BEHIND) as usize), 0);
        }
        assert_eq!(all.len(), 10, "5 runs of stdout, 5 lines of stderr");
        assert_eq!(all[1].data, b"progress\n");
        // A reopen (after a crash) goes on where the stream ended.
        drop(w);
        let mut w = OutputWriter::open(dir.path(), 0, None).unwrap();
        w.append(Stream::Stdout, b"more").unwrap();
        assert_eq!(w.progress().stdout, total + 4);
    }

    #[test]
    fn recovery_cuts_unindexed_bytes() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut w = OutputWriter::open(dir.path(), 0, None).unwrap();
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
        let mut w = OutputWriter::open(dir.path(), 0, None).unwrap();
        assert_eq!(w.progress().stdout, 3);
        w.append(Stream::Stdout, b"def").unwrap();
        assert_eq!(std::fs::read(dir.path().join("stdout")).unwrap(), b"abcdef");
        let got = read_pieces(dir.path(), View::Combined, 0, 6, usize::MAX).unwrap();
        // Consecutive chunks of one stream share an index record.
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].data, b"abcdef");
    }

    #[test]
    fn the_index_is_bounded_however_the_output_is_chopped() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let cap = 2 << 20;
        let mut w = OutputWriter::open(dir.path(), cap, None).unwrap();
        // One byte at a time, alternating streams: one record per byte.
        let n = 300_000u64;
        for i in 0..n {
            let stream = if i % 2 == 0 {
                Stream::Stdout
            } else {
                Stream::Stderr
            };
            w.append(stream, b"x").unwrap();
        }
        let p = w.progress();
        assert_eq!(p.combined(), n);
        assert!(p.truncated());
        let index_blocks = std::fs::metadata(dir.path().join("index"))
            .unwrap()
            .blocks()
            * 512;
        assert!(
            index_blocks <= index_cap(cap) + 2 * DROP_STEP,
            "{index_blocks} bytes of index on disk"
        );
        // What is kept reads back in order, from the first kept record on.
        let all = read_pieces(dir.path(), View::Combined, 0, n, usize::MAX).unwrap();
        let kept: u64 = all.iter().map(|p| p.data.len() as u64).sum();
        assert!(kept > 0 && kept < n, "{kept}");
        assert_eq!(all.last().unwrap().offset + 1, n);
        for w in all.windows(2) {
            assert_eq!(w[0].offset + w[0].data.len() as u64, w[1].offset);
        }
        // A reopen agrees.
        drop(w);
        let w = OutputWriter::open(dir.path(), cap, None).unwrap();
        assert_eq!(w.progress(), p);
    }

    #[test]
    fn running_commands_share_the_budget_and_drop_all_frees_a_finished_one() {
        use std::os::unix::fs::MetadataExt;
        let root = tempfile::tempdir().unwrap();
        let budget = OutputBudget::new(8 << 20);
        let chunk = vec![7u8; 64 * 1024];
        let mut writers: Vec<OutputWriter> = (0..4)
            .map(|i| {
                OutputWriter::open(&root.path().join(i.to_string()), 0, Some(budget.clone()))
                    .unwrap()
            })
            .collect();
        let mut due = false;
        for _ in 0..200 {
            for w in writers.iter_mut() {
                due |= w.append(Stream::Stdout, &chunk).unwrap();
            }
        }
        assert!(due, "the budget never asked for a check");
        let used: u64 = (0..4)
            .map(|i| disk_usage(&root.path().join(i.to_string())))
            .sum();
        // Four writers of 12.5 MiB each kept about their share of 8 MiB.
        assert!(used <= (8 << 20) + 4 * 2 * DROP_STEP + (1 << 20), "{used}");
        drop(writers);
        let dir = root.path().join("0");
        let freed = drop_all(&dir).unwrap();
        assert!(freed > 0);
        let blocks = std::fs::metadata(dir.join("stdout")).unwrap().blocks();
        assert_eq!(blocks, 0);
        let len = std::fs::metadata(dir.join("stdout")).unwrap().len();
        assert!(read_pieces(&dir, View::Combined, 0, len, usize::MAX)
            .unwrap()
            .is_empty());
        assert!(read_pieces(&dir, View::Stdout, 0, len, usize::MAX)
            .unwrap()
            .is_empty());
    }
}
