//! The host ⇄ agent protocol, version 1.
//!
//! Transport: the agent dials a Unix stream socket that the host bind-mounts
//! into the sandbox. It sends one [`Hello`] line (JSON, at most
//! [`MAX_HANDSHAKE_BYTES`]) and reads one [`HelloReply`] line. After an `ok`
//! reply the same connection carries HTTP/2, with the **agent as the server**
//! and the host as the client, so the host can open many concurrent streams.
//!
//! Agent endpoints (all JSON unless said otherwise):
//! - `GET  /v1/info` → [`AgentInfo`]
//! - `GET  /v1/commands` → `Vec<`[`CommandInfo`]`>`: every command the agent still holds
//! - `POST /v1/commands` with a [`SpawnRequest`] → [`SpawnReply`]. A program that cannot be
//!   started is not a protocol error: the command ends at once with exit code 127 (not found) or
//!   126 (not executable) and a message on its stderr.
//! - `POST /v1/commands/{id}/attach?stdout=N&stderr=M[&input=1]` — full duplex. The response
//!   body is a stream of agent frames ([`Frame::Stdout`], [`Frame::Stderr`], then one
//!   [`Frame::Exit`]), starting at the given offsets; the request body is a stream of host
//!   frames ([`Frame::Ack`], [`Frame::Stdin`], [`Frame::StdinEof`], [`Frame::Done`],
//!   [`Frame::Resize`]). With `input=1` (to an agent whose hello names
//!   [`FEATURE_INPUT_OFFSETS`]) the response starts with [`Frame::InputTaken`], and has
//!   another whenever the agent takes more input, always before the Exit; input then comes
//!   as [`Frame::StdinAt`] and [`Frame::StdinEofAt`].
//! - `POST /v1/commands/{id}/signal` with a [`SignalRequest`]: signals the command's process
//!   group and its processes that left it (`setsid`, daemons); SIGKILL kills all of them.
//!   Processes a command leaves behind once its main process has exited are not signalled.
//! - `DELETE /v1/commands/{id}`: forget an exited command (same as [`Frame::Done`]).
//! - `POST /v1/quiesce`: drop the host connection now (a checkpoint cannot save an open
//!   host socket); the agent keeps its commands and dials again with backoff.
//!
//! File endpoints (implemented with [`crate::fs`]; the host's public
//! `/v1/sandboxes/{id}/files…` API forwards path suffix, query and body verbatim).
//! Every `path` is absolute, UTF-8, at most 4096 bytes (components 255), without `..`,
//! percent-encoded in the query (`+` is a space). Paths resolve inside the files root
//! (`/`, or `SPACE_AGENT_FILES_ROOT`): symbolic links are followed by descriptor, absolute
//! targets restart at that root and `..` stops there. `/.space`, `/proc`, `/sys` and `/dev`
//! are refused (403 `forbidden_path`) however they are reached, and left out of lists and
//! archives. stat, list, delete and move act on a final link itself; the others follow it.
//! - `GET /v1/files/stat?path=P` → [`crate::fs::FileInfo`] (`path`, `name`, `type`
//!   (`file|dir|symlink|other`), `size`, `mode` (`& 0o7777`), `uid`, `gid`, `mtime`,
//!   `link_target`?, `name_base64`? when the name is not UTF-8).
//! - `GET /v1/files/list?path=P&depth=N` (1..=64, default 1) → [`crate::fs::Listing`]
//!   `{path, entries, truncated}`: depth-first, sorted by name, at most 10 000 entries,
//!   links never followed; a non-directory lists as itself.
//! - `GET /v1/files?path=P` → the bytes of a regular file (`application/octet-stream`,
//!   `content-length`, `x-space-mode` (octal), `x-space-uid`, `x-space-gid`). A directory, device,
//!   fifo or socket → 400 `not_a_file`.
//! - `GET /v1/files?path=P&format=tar` → an uncompressed tar (`application/x-tar`): a
//!   directory's contents relative to it, or one entry for a file; modes, owners, mtimes,
//!   links and hard links kept; devices, fifos and sockets skipped. An error after the
//!   headers went out ends the archive with a block no tar reader accepts and an
//!   `x-space-error` trailer holding the error JSON.
//! - `PUT /v1/files?path=P[&mode=0644][&uid=0][&gid=0]` with the bytes → 201 + `FileInfo`.
//!   Atomic (temporary file in the same directory, then rename); the parent must exist.
//! - `PUT /v1/files?path=DIR&format=tar[&gzip=true][&max_bytes=N]` with a tar → 201 +
//!   `{entries, bytes}`. DIR is created like `mkdir -p`. Files, directories, links and
//!   hard links to earlier files of the archive; devices, fifos, `..`, absolute names and
//!   entries below a symbolic link → 400 `unsafe_archive`; more than `max_bytes` (default
//!   8 GiB) or 200 000 entries → 413 `too_large`. A failed upload removes what it created.
//! - `DELETE /v1/files?path=P[&recursive=true]` → `{"removed": n}`; a non-empty directory
//!   without `recursive` → 409; `/` → 400.
//! - `POST /v1/files/mkdir` `{path, mode? (493), uid?, gid?}` → 201 + `FileInfo` (`mkdir -p`).
//! - `POST /v1/files/move` `{from, to, overwrite? (false)}` → 200 + `FileInfo` of `to`;
//!   an existing `to` without `overwrite` → 409.
//!
//! File errors: 400 `invalid_path`/`invalid_request`/`not_a_file`/`unsafe_archive`,
//! 403 `forbidden_path`, 404 `not_found`, 409 `conflict`, 413 `too_large`, 507 `no_space`
//! (the sandbox's disk quota), 500 `internal`.
//!
//! Errors are `{"error":{"code","message"}}` ([`ErrorBody`]) with a 4xx/5xx status.
//!
//! Output is never dropped: the agent keeps every byte the host has not acknowledged
//! (at most [`RETAIN_MAX_BYTES`] per stream; past that it stops reading the command's pipe,
//! which blocks the writer exactly as a full pipe would). A reconnecting host resumes with
//! `attach?stdout=N&stderr=M`, where N and M are what it has durably stored.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};

/// Version of this protocol; sent in the handshake, a mismatch is refused.
pub const PROTOCOL_VERSION: u32 = 1;
/// Largest handshake line (either direction), newline included.
pub const MAX_HANDSHAKE_BYTES: usize = 4096;
/// Largest frame payload either side accepts.
pub const MAX_FRAME_PAYLOAD: usize = 1 << 20;
/// Largest data chunk the agent puts in one output frame.
pub const MAX_DATA_CHUNK: usize = 512 * 1024;
/// Unacknowledged output the agent keeps per stream before it stops reading the pipe.
pub const RETAIN_MAX_BYTES: usize = 1 << 20;
/// Largest JSON request body accepted by the agent.
pub const MAX_JSON_BODY: usize = 1 << 20;
/// Bounds on a spawn request.
pub const MAX_ARGV: usize = 4096;
pub const MAX_ENV: usize = 4096;
pub const MAX_ARG_BYTES: usize = 256 * 1024;
/// Length of a frame header: one type byte and a big-endian u32 length.
pub const FRAME_HEADER_LEN: usize = 5;

/// First line the agent sends after connecting.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Hello {
    pub protocol: u32,
    pub sandbox_id: String,
    pub token: String,
    pub agent_version: String,
    /// What this agent can do beyond version 1 ([`FEATURE_INPUT_OFFSETS`]); a host uses
    /// only what both sides know, so either side may be the older.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub features: Vec<String>,
}

/// [`Hello::features`]: the agent takes input as [`Frame::StdinAt`] and
/// [`Frame::StdinEofAt`] and reports how much it has taken ([`Frame::InputTaken`], first
/// on an attach asked with `input=1`), so a host resends exactly what a broken link lost.
pub const FEATURE_INPUT_OFFSETS: &str = "input-offsets";

/// The host's answer to [`Hello`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct HelloReply {
    pub ok: bool,
    pub protocol: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `GET /v1/info`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AgentInfo {
    pub protocol: u32,
    pub agent_version: String,
    pub pid: u32,
    pub commands: usize,
}

/// `POST /v1/commands`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SpawnRequest {
    /// Host-assigned command id (`cmd_…`); unique per sandbox.
    pub id: String,
    /// Program and arguments; `argv[0]` is looked up in `PATH` if it has no `/`.
    pub argv: Vec<String>,
    /// The complete environment of the command. The agent adds only `HOME` when it
    /// is absent, and `TERM=xterm-256color` on a terminal when `TERM` is absent.
    pub env: Vec<(String, String)>,
    /// Secret variables, set over `env` (a name in both takes the secret's value). Apart
    /// from `env` so the host never records them with the command.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<(String, String)>,
    /// Working directory; the user's home (or `/`) when absent.
    #[serde(default)]
    pub cwd: Option<String>,
    /// `name`, `uid` or `uid:gid`; root when absent.
    #[serde(default)]
    pub user: Option<String>,
    /// Kill every process of the command (its process group and the processes that
    /// left it) with SIGKILL after this long; no limit when absent or 0.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Give the command a stdin pipe fed by [`Frame::Stdin`]; `/dev/null` otherwise.
    /// Ignored with `pty`: the terminal is the command's stdin and always takes input.
    #[serde(default)]
    pub stdin: bool,
    /// Run the command on a new pseudo-terminal of this size (it becomes the
    /// controlling terminal of the command's session). Its output, stdout and
    /// stderr together, comes as [`Frame::Stdout`]; [`Frame::Stdin`] writes to it
    /// and [`Frame::Resize`] resizes it (its foreground process group gets SIGWINCH).
    /// [`Frame::StdinEof`] types the terminal's EOF character (^D) rather than closing it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySize>,
}

/// Rows and columns of a pseudo-terminal.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct PtySize {
    pub rows: u16,
    pub cols: u16,
}

/// Why a [`SpawnRequest`] is refused before anything is started.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpawnRequestError {
    #[error("argv must not be empty")]
    EmptyArgv,
    #[error("too many arguments or environment variables")]
    TooMany,
    #[error("argument, variable or path too long")]
    TooLong,
    #[error("strings must not contain NUL bytes")]
    Nul,
    #[error("environment variable names must be non-empty and must not contain '='")]
    BadEnvName,
    #[error("command id must be 1-64 characters of [A-Za-z0-9_-]")]
    BadId,
}

impl SpawnRequest {
    /// Checks the bounds every spawn request must respect.
    pub fn validate(&self) -> Result<(), SpawnRequestError> {
        if !valid_id(&self.id) {
            return Err(SpawnRequestError::BadId);
        }
        if self.argv.is_empty() || self.argv[0].is_empty() {
            return Err(SpawnRequestError::EmptyArgv);
        }
        if self.argv.len() > MAX_ARGV || self.env.len() + self.secrets.len() > MAX_ENV {
            return Err(SpawnRequestError::TooMany);
        }
        let mut total = 0usize;
        let strings = self
            .argv
            .iter()
            .chain(self.env.iter().flat_map(|(k, v)| [k, v]))
            .chain(self.secrets.iter().flat_map(|(k, v)| [k, v]))
            .chain(self.cwd.iter())
            .chain(self.user.iter());
        for s in strings {
            if s.as_bytes().contains(&0) {
                return Err(SpawnRequestError::Nul);
            }
            total = total.saturating_add(s.len());
        }
        if total > MAX_JSON_BODY {
            return Err(SpawnRequestError::TooLong);
        }
        if self.argv.iter().any(|a| a.len() > MAX_ARG_BYTES) {
            return Err(SpawnRequestError::TooLong);
        }
        if self
            .env
            .iter()
            .chain(self.secrets.iter())
            .any(|(k, _)| k.is_empty() || k.contains('='))
        {
            return Err(SpawnRequestError::BadEnvName);
        }
        Ok(())
    }
}

/// Whether `id` is an acceptable command or sandbox id on the wire.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Answer to a successful spawn.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SpawnReply {
    /// Pid inside the sandbox; 0 when the program could not be started.
    pub pid: u32,
}

/// `POST /v1/commands/{id}/signal`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SignalRequest {
    pub signal: i32,
}

/// One entry of `GET /v1/commands`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct CommandInfo {
    pub id: String,
    pub pid: u32,
    /// `None` while the command runs.
    pub exit: Option<ExitStatus>,
    /// Lowest offset still retained per stream (what an attach may start from).
    pub stdout_base: u64,
    pub stderr_base: u64,
    /// Bytes produced so far per stream.
    pub stdout_end: u64,
    pub stderr_end: u64,
}

/// How a command ended, as the agent saw it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExitStatus {
    /// Exit code when it exited normally.
    pub exit_code: Option<i32>,
    /// Signal number when a signal ended it.
    pub signal: Option<i32>,
    /// The agent killed it because its timeout passed: every process it started
    /// was killed, and then `signal` is SIGKILL, whatever its main process returned.
    pub timed_out: bool,
    /// One of its processes was killed for using up the sandbox's memory (the
    /// kernel's OOM killer in a microVM, the agent under gVisor).
    #[serde(default)]
    pub oom_killed: bool,
    /// From spawn to exit.
    pub duration_ms: u64,
    /// Set when the program could not be started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `{"error":{"code","message"}}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ErrorDetail {
    pub code: String,
    pub message: String,
}

impl ErrorBody {
    pub fn new(code: impl Into<String>, message: impl Into<String>) -> Self {
        ErrorBody {
            error: ErrorDetail {
                code: code.into(),
                message: message.into(),
            },
        }
    }
}

/// Which output stream a data frame belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stream {
    Stdout,
    Stderr,
}

/// A frame inside an attach stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Agent → host: output bytes that start at `offset` of the stream.
    Stdout {
        offset: u64,
        data: Bytes,
    },
    Stderr {
        offset: u64,
        data: Bytes,
    },
    /// Agent → host: the command ended and all of its output was sent.
    Exit(ExitStatus),
    /// Host → agent: everything below these offsets is stored; the agent may drop it.
    Ack {
        stdout: u64,
        stderr: u64,
    },
    /// Host → agent: bytes for the command's stdin.
    Stdin(Bytes),
    /// Host → agent: close the command's stdin (on a terminal: type its EOF character).
    StdinEof,
    /// Host → agent: the result is stored; forget the command.
    Done,
    /// Host → agent: resize the command's pseudo-terminal (ignored without one).
    Resize(PtySize),
    /// Host → agent: input at `offset` of the command's input, where each stdin byte and
    /// each end-of-file is one position ([`FEATURE_INPUT_OFFSETS`]). What the agent has
    /// taken already is skipped; an offset past it means the positions between are lost,
    /// and the agent's count jumps over them.
    StdinAt {
        offset: u64,
        data: Bytes,
    },
    /// Host → agent: [`Frame::StdinEof`] at `offset` of the command's input.
    StdinEofAt(u64),
    /// Agent → host: the command's input below this position is taken (queued for the
    /// command, or dropped because it no longer reads it); the host may forget it.
    InputTaken(u64),
}

const T_STDOUT: u8 = 1;
const T_STDERR: u8 = 2;
const T_EXIT: u8 = 3;
const T_INPUT_TAKEN: u8 = 4;
const T_ACK: u8 = 16;
const T_STDIN: u8 = 17;
const T_STDIN_EOF: u8 = 18;
const T_DONE: u8 = 19;
const T_RESIZE: u8 = 20;
const T_STDIN_AT: u8 = 21;
const T_STDIN_EOF_AT: u8 = 22;

/// A frame that could not be decoded. The connection that sent it is not trusted further.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("unknown frame type {0}")]
    UnknownType(u8),
    #[error("frame payload of {0} bytes exceeds the limit")]
    TooLarge(usize),
    #[error("malformed frame of type {0}")]
    Malformed(u8),
}

impl Frame {
    /// Appends the encoded frame to `out`.
    pub fn encode(&self, out: &mut BytesMut) {
        if let Frame::Stdout { data, .. } | Frame::Stderr { data, .. } = self {
            out.reserve(FRAME_HEADER_LEN + 8 + data.len());
        }
        if let Some(data) = self.output_head(out) {
            out.put_slice(data);
            return;
        }
        match self {
            // Written whole above.
            Frame::Stdout { .. } | Frame::Stderr { .. } => {}
            Frame::Exit(status) => {
                // Serialising a plain struct cannot fail.
                let json = serde_json::to_vec(status).unwrap_or_default();
                header(out, T_EXIT, json.len());
                out.put_slice(&json);
            }
            Frame::Ack { stdout, stderr } => {
                header(out, T_ACK, 16);
                out.put_u64(*stdout);
                out.put_u64(*stderr);
            }
            Frame::Stdin(data) => {
                header(out, T_STDIN, data.len());
                out.put_slice(data);
            }
            Frame::StdinEof => header(out, T_STDIN_EOF, 0),
            Frame::Done => header(out, T_DONE, 0),
            Frame::Resize(size) => {
                header(out, T_RESIZE, 4);
                out.put_u16(size.rows);
                out.put_u16(size.cols);
            }
            Frame::StdinAt { offset, data } => {
                header(out, T_STDIN_AT, 8 + data.len());
                out.put_u64(*offset);
                out.put_slice(data);
            }
            Frame::StdinEofAt(offset) => {
                header(out, T_STDIN_EOF_AT, 8);
                out.put_u64(*offset);
            }
            Frame::InputTaken(upto) => {
                header(out, T_INPUT_TAKEN, 8);
                out.put_u64(*upto);
            }
        }
    }

    /// Appends an output frame's header (type, length and offset) to `out` and returns its
    /// data; `None` (and nothing appended) for any other frame.
    fn output_head(&self, out: &mut BytesMut) -> Option<&Bytes> {
        let (t, offset, data) = match self {
            Frame::Stdout { offset, data } => (T_STDOUT, offset, data),
            Frame::Stderr { offset, data } => (T_STDERR, offset, data),
            _ => return None,
        };
        header(out, t, 8 + data.len());
        out.put_u64(*offset);
        Some(data)
    }

    /// The frame as buffers to send one after the other: an output frame's data is not
    /// copied, it follows its header as a second buffer.
    pub fn to_parts(&self) -> (Bytes, Option<Bytes>) {
        let mut head = BytesMut::with_capacity(FRAME_HEADER_LEN + 8);
        match self.output_head(&mut head) {
            Some(data) => (head.freeze(), Some(data.clone())),
            None => (self.to_bytes(), None),
        }
    }

    /// The frame as one buffer.
    pub fn to_bytes(&self) -> Bytes {
        let mut out = BytesMut::new();
        self.encode(&mut out);
        out.freeze()
    }
}

/// Appends a frame's type and payload length.
fn header(out: &mut BytesMut, t: u8, len: usize) {
    out.put_u8(t);
    // Payloads are bounded by MAX_FRAME_PAYLOAD, far below u32::MAX.
    out.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
}

/// Incremental decoder: feed bytes with [`FrameDecoder::push_bytes`] (or
/// [`FrameDecoder::push`]), take frames with [`FrameDecoder::next_frame`]. Never buffers
/// more than one frame plus one chunk. A chunk of at least [`KEEP_CHUNK_FROM`] bytes is kept as
/// it came, and a payload that lies within it comes out as a slice of it, not a copy (an
/// output frame's data travels as a chunk of its own, after its header). Smaller chunks are
/// copied together, so a peer that sends its bytes one at a time makes no more pieces to
/// hold than one that sends them whole.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    /// Kept chunks, each of at least [`KEEP_CHUNK_FROM`] bytes or followed by one that is.
    chunks: std::collections::VecDeque<Bytes>,
    /// Small chunks copied together; they come after `chunks`.
    tail: BytesMut,
    /// Bytes in `chunks` and `tail`.
    len: usize,
}

/// Chunks this large are kept as they came rather than copied (see [`FrameDecoder`]).
pub const KEEP_CHUNK_FROM: usize = 4096;

impl FrameDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds a copy of `data`.
    pub fn push(&mut self, data: &[u8]) {
        self.len += data.len();
        self.tail.extend_from_slice(data);
    }

    /// Feeds `data`, without copying it where it is [`KEEP_CHUNK_FROM`] bytes or more.
    pub fn push_bytes(&mut self, data: Bytes) {
        if data.len() < KEEP_CHUNK_FROM {
            return self.push(&data);
        }
        if !self.tail.is_empty() {
            self.chunks.push_back(self.tail.split().freeze());
        }
        self.len += data.len();
        self.chunks.push_back(data);
    }

    /// Bytes waiting that do not yet make a whole frame.
    pub fn pending(&self) -> usize {
        self.len
    }

    /// The first `N` bytes waiting, without taking them; `len` must be at least `N`.
    fn peek<const N: usize>(&self) -> [u8; N] {
        let mut out = [0u8; N];
        let mut at = 0;
        for c in self.chunks.iter().map(|c| &c[..]).chain([&self.tail[..]]) {
            let k = (N - at).min(c.len());
            out[at..at + k].copy_from_slice(&c[..k]);
            at += k;
            if at == N {
                break;
            }
        }
        out
    }

    /// Takes the first `n` bytes waiting (`len` must be at least `n`): a slice of the first
    /// piece where it holds them all, else a copy gathered across pieces.
    fn take(&mut self, n: usize) -> Bytes {
        self.len -= n;
        match self.chunks.front_mut() {
            None => return self.tail.split_to(n.min(self.tail.len())).freeze(),
            Some(front) if front.len() >= n => {
                let out = front.split_to(n);
                if front.is_empty() {
                    self.chunks.pop_front();
                }
                return out;
            }
            Some(_) => {}
        }
        let mut out = BytesMut::with_capacity(n);
        while out.len() < n {
            let want = n - out.len();
            let Some(front) = self.chunks.front_mut() else {
                let k = want.min(self.tail.len());
                out.extend_from_slice(&self.tail.split_to(k));
                break;
            };
            let k = want.min(front.len());
            out.extend_from_slice(&front[..k]);
            front.advance(k);
            if front.is_empty() {
                self.chunks.pop_front();
            }
        }
        out.freeze()
    }

    /// The next whole frame, `Ok(None)` when more bytes are needed.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        if self.len < FRAME_HEADER_LEN {
            return Ok(None);
        }
        let [t, l0, l1, l2, l3] = self.peek::<FRAME_HEADER_LEN>();
        let len = u32::from_be_bytes([l0, l1, l2, l3]) as usize;
        if !matches!(
            t,
            T_STDOUT
                | T_STDERR
                | T_EXIT
                | T_INPUT_TAKEN
                | T_ACK
                | T_STDIN
                | T_STDIN_EOF
                | T_DONE
                | T_RESIZE
                | T_STDIN_AT
                | T_STDIN_EOF_AT
        ) {
            return Err(FrameError::UnknownType(t));
        }
        if len > MAX_FRAME_PAYLOAD {
            return Err(FrameError::TooLarge(len));
        }
        if self.len < FRAME_HEADER_LEN + len {
            return Ok(None);
        }
        self.take(FRAME_HEADER_LEN);
        if matches!(t, T_STDOUT | T_STDERR) {
            if len < 8 {
                self.take(len);
                return Err(FrameError::Malformed(t));
            }
            // The offset and the data apart, so that data sent as a chunk of its own
            // comes out as that chunk.
            let offset = self.take(8).get_u64();
            let data = self.take(len - 8);
            return Ok(Some(if t == T_STDOUT {
                Frame::Stdout { offset, data }
            } else {
                Frame::Stderr { offset, data }
            }));
        }
        let mut payload = self.take(len);
        let frame = match t {
            T_EXIT => {
                Frame::Exit(serde_json::from_slice(&payload).map_err(|_| FrameError::Malformed(t))?)
            }
            T_ACK => {
                if payload.len() != 16 {
                    return Err(FrameError::Malformed(t));
                }
                Frame::Ack {
                    stdout: payload.get_u64(),
                    stderr: payload.get_u64(),
                }
            }
            T_STDIN => Frame::Stdin(payload),
            T_STDIN_AT => {
                if payload.len() < 8 {
                    return Err(FrameError::Malformed(t));
                }
                let offset = payload.get_u64();
                Frame::StdinAt {
                    offset,
                    data: payload,
                }
            }
            T_STDIN_EOF_AT | T_INPUT_TAKEN => {
                if payload.len() != 8 {
                    return Err(FrameError::Malformed(t));
                }
                let at = payload.get_u64();
                if t == T_STDIN_EOF_AT {
                    Frame::StdinEofAt(at)
                } else {
                    Frame::InputTaken(at)
                }
            }
            T_RESIZE => {
                if payload.len() != 4 {
                    return Err(FrameError::Malformed(t));
                }
                Frame::Resize(PtySize {
                    rows: payload.get_u16(),
                    cols: payload.get_u16(),
                })
            }
            T_STDIN_EOF | T_DONE if !payload.is_empty() => return Err(FrameError::Malformed(t)),
            T_STDIN_EOF => Frame::StdinEof,
            _ => Frame::Done,
        };
        Ok(Some(frame))
    }
}

/// Reads one `\n`-terminated line of at most [`MAX_HANDSHAKE_BYTES`] without
/// reading past it (the bytes after it belong to HTTP/2).
pub async fn read_handshake_line<R>(r: &mut R) -> std::io::Result<Vec<u8>>
where
    R: tokio::io::AsyncRead + Unpin,
{
    use tokio::io::AsyncReadExt;
    let mut line = Vec::with_capacity(256);
    loop {
        let b = r.read_u8().await?;
        if b == b'\n' {
            return Ok(line);
        }
        line.push(b);
        if line.len() >= MAX_HANDSHAKE_BYTES {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "handshake line too long",
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(f: Frame) {
        let bytes = f.to_bytes();
        let mut d = FrameDecoder::new();
        // Feed one byte at a time: a decoder must cope with any split.
        for (i, b) in bytes.iter().enumerate() {
            d.push(&[*b]);
            let got = d.next_frame().unwrap();
            if i + 1 < bytes.len() {
                assert_eq!(got, None);
            } else {
                assert_eq!(got, Some(f.clone()));
            }
        }
    }

    #[test]
    fn frames_roundtrip() {
        roundtrip(Frame::Stdout {
            offset: 7,
            data: Bytes::from_static(b"hello"),
        });
        roundtrip(Frame::Stderr {
            offset: u64::MAX,
            data: Bytes::new(),
        });
        roundtrip(Frame::Exit(ExitStatus {
            exit_code: Some(3),
            signal: None,
            timed_out: false,
            oom_killed: true,
            duration_ms: 12,
            error: None,
        }));
        roundtrip(Frame::Ack {
            stdout: 1,
            stderr: 2,
        });
        roundtrip(Frame::Stdin(Bytes::from_static(b"x")));
        roundtrip(Frame::StdinEof);
        roundtrip(Frame::StdinAt {
            offset: 1 << 40,
            data: Bytes::from_static(b"typed"),
        });
        roundtrip(Frame::StdinAt {
            offset: 0,
            data: Bytes::new(),
        });
        roundtrip(Frame::StdinEofAt(9));
        roundtrip(Frame::InputTaken(u64::MAX));
        roundtrip(Frame::Done);
        roundtrip(Frame::Resize(PtySize { rows: 24, cols: 80 }));
    }

    #[test]
    fn frames_sent_in_parts_decode_as_sent_and_their_data_is_not_copied() {
        let frames = [
            Frame::Stdout {
                offset: 7,
                data: Bytes::from(vec![5u8; 300_000]),
            },
            Frame::Stderr {
                offset: 1 << 40,
                data: Bytes::from(vec![6u8; KEEP_CHUNK_FROM]),
            },
            // Small data is copied (see below), and decodes all the same.
            Frame::Stderr {
                offset: 3,
                data: Bytes::from_static(b"err"),
            },
            Frame::Stdout {
                offset: 9,
                data: Bytes::new(),
            },
            Frame::Ack {
                stdout: 1,
                stderr: 2,
            },
            Frame::StdinEof,
        ];
        let mut d = FrameDecoder::new();
        let mut sent = Vec::new();
        for f in &frames {
            let (head, data) = f.to_parts();
            // The parts are the frame's one-buffer encoding.
            let mut joined = head.to_vec();
            joined.extend_from_slice(data.as_deref().unwrap_or_default());
            assert_eq!(joined, f.to_bytes().to_vec(), "{f:?}");
            d.push_bytes(head);
            if let Some(data) = data {
                sent.push(data.as_ptr());
                d.push_bytes(data);
            }
        }
        for f in &frames {
            let got = d.next_frame().unwrap().unwrap();
            assert_eq!(&got, f);
            if let Frame::Stdout { data, .. } | Frame::Stderr { data, .. } = &got {
                if data.len() >= KEEP_CHUNK_FROM {
                    assert!(
                        sent.contains(&data.as_ptr()),
                        "the data of {f:?} was copied"
                    );
                }
            }
        }
        assert_eq!(d.next_frame(), Ok(None));
        assert_eq!(d.pending(), 0);

        // Two whole frames in one chunk, then a frame split inside its offset: each decoded
        // once all of it is there, the split one gathered.
        let a = Frame::Stdout {
            offset: 1,
            data: Bytes::from_static(b"ab"),
        };
        let b = Frame::Stderr {
            offset: 3,
            data: Bytes::from_static(b"cd"),
        };
        let mut both = a.to_bytes().to_vec();
        both.extend_from_slice(&b.to_bytes());
        let c = b.to_bytes();
        let mut d = FrameDecoder::new();
        d.push_bytes(Bytes::from(both));
        d.push_bytes(c.slice(..9));
        assert_eq!(d.next_frame(), Ok(Some(a)));
        assert_eq!(d.next_frame(), Ok(Some(b.clone())));
        assert_eq!(d.next_frame(), Ok(None));
        assert_eq!(d.pending(), 9);
        d.push_bytes(c.slice(9..));
        assert_eq!(d.next_frame(), Ok(Some(b)));
        assert_eq!(d.pending(), 0);
    }

    #[test]
    fn a_frame_sent_a_byte_at_a_time_is_held_in_few_pieces() {
        // The largest frame a peer may send, in one-byte chunks: the decoder holds what it
        // has not decoded yet in one buffer, not in a million pieces.
        let f = Frame::Stdout {
            offset: 0,
            data: Bytes::from(vec![1u8; MAX_FRAME_PAYLOAD - 8]),
        };
        let bytes = f.to_bytes();
        let mut d = FrameDecoder::new();
        for i in 0..bytes.len() {
            d.push_bytes(bytes.slice(i..i + 1));
            assert!(d.chunks.is_empty(), "a one-byte chunk was kept apart");
        }
        assert_eq!(d.next_frame(), Ok(Some(f)));
        assert_eq!(d.pending(), 0);
        // Small and large chunks mixed: each kept piece is large or followed by one that is.
        let mut d = FrameDecoder::new();
        for i in 0..100 {
            d.push_bytes(Bytes::from(vec![0u8; 1 + i % 3]));
            d.push_bytes(Bytes::from(vec![0u8; KEEP_CHUNK_FROM]));
        }
        assert!(d.chunks.len() <= 200);
        let kept: Vec<usize> = d.chunks.iter().map(Bytes::len).collect();
        for w in kept.windows(2) {
            assert!(w[0] >= KEEP_CHUNK_FROM || w[1] >= KEEP_CHUNK_FROM, "{w:?}");
        }
    }

    #[test]
    fn hostile_frames_are_rejected() {
        let mut d = FrameDecoder::new();
        d.push(&[99, 0, 0, 0, 0]);
        assert_eq!(d.next_frame(), Err(FrameError::UnknownType(99)));

        let mut d = FrameDecoder::new();
        d.push(&[T_STDOUT, 0xff, 0xff, 0xff, 0xff]);
        assert!(matches!(d.next_frame(), Err(FrameError::TooLarge(_))));

        let mut d = FrameDecoder::new();
        d.push(&[T_STDOUT, 0, 0, 0, 3, 1, 2, 3]);
        assert_eq!(d.next_frame(), Err(FrameError::Malformed(T_STDOUT)));

        let mut d = FrameDecoder::new();
        d.push(&[T_EXIT, 0, 0, 0, 2, b'{', b'x']);
        assert_eq!(d.next_frame(), Err(FrameError::Malformed(T_EXIT)));

        let mut d = FrameDecoder::new();
        d.push(&[T_ACK, 0, 0, 0, 1, 0]);
        assert_eq!(d.next_frame(), Err(FrameError::Malformed(T_ACK)));

        // Input frames: an offset is 8 bytes, and a position nothing else.
        for (t, payload) in [
            (T_STDIN_AT, &[0u8; 7][..]),
            (T_STDIN_EOF_AT, &[0u8; 9][..]),
            (T_STDIN_EOF_AT, &[][..]),
            (T_INPUT_TAKEN, &[0u8; 4][..]),
        ] {
            let mut d = FrameDecoder::new();
            d.push(&[t, 0, 0, 0, payload.len() as u8]);
            d.push(payload);
            assert_eq!(d.next_frame(), Err(FrameError::Malformed(t)), "type {t}");
        }
    }

    #[test]
    fn spawn_request_bounds() {
        let ok = SpawnRequest {
            id: "cmd_1".into(),
            argv: vec!["true".into()],
            env: vec![("A".into(), "b".into())],
            secrets: vec![("S".into(), "v".into())],
            cwd: None,
            user: None,
            timeout_ms: None,
            stdin: false,
            pty: None,
        };
        assert_eq!(ok.validate(), Ok(()));
        let mut bad = ok.clone();
        bad.argv.clear();
        assert_eq!(bad.validate(), Err(SpawnRequestError::EmptyArgv));
        let mut bad = ok.clone();
        bad.argv.push("a\0b".into());
        assert_eq!(bad.validate(), Err(SpawnRequestError::Nul));
        let mut bad = ok.clone();
        bad.env.push(("A=B".into(), "c".into()));
        assert_eq!(bad.validate(), Err(SpawnRequestError::BadEnvName));
        let mut bad = ok.clone();
        bad.secrets.push(("S=T".into(), "c".into()));
        assert_eq!(bad.validate(), Err(SpawnRequestError::BadEnvName));
        let mut bad = ok.clone();
        bad.secrets.push(("T".into(), "c\0d".into()));
        assert_eq!(bad.validate(), Err(SpawnRequestError::Nul));
        let mut bad = ok;
        bad.id = "../x".into();
        assert_eq!(bad.validate(), Err(SpawnRequestError::BadId));
    }
}
