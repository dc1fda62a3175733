//! `space-agent relay SOCKET [WAIT_SECONDS]`: a command's stdio joined to a Unix socket
//! in the sandbox, for services the host reaches through commands (the code
//! interpreter's execution service).
//!
//! It reads its stdin to the end, connects to `SOCKET` (retrying for up to
//! `WAIT_SECONDS` while nothing listens there), sends what it read, and copies what the
//! socket sends to its stdout until the socket ends. Its end of the socket stays open
//! meanwhile: killing the relay is how a caller says it has gone. Exit status: 0 once
//! the socket ended, [`NOT_LISTENING`] when nothing listened in time, 2 on bad
//! arguments, 1 on any other failure (on stderr).
//!
//! A static binary starts in a millisecond even under gVisor, where a Python client
//! took 40–60 ms per call before it sent a byte. It runs with the command's user and
//! capabilities, like any program in the sandbox: it can reach only what that user can.

use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Exit status when nothing listens on the socket (`EX_TEMPFAIL`).
pub const NOT_LISTENING: u8 = 75;
/// Most bytes of stdin sent.
const MAX_REQUEST: u64 = 16 << 20;
/// Wait between connection attempts.
const RETRY: Duration = Duration::from_millis(20);

pub fn main(mut args: impl Iterator<Item = OsString>) -> ExitCode {
    let Some(path) = args.next() else {
        return usage();
    };
    let wait = match args
        .next()
        .map(|w| w.into_string().map(|w| w.parse::<u64>()))
    {
        None => 0,
        Some(Ok(Ok(w))) => w,
        _ => return usage(),
    };
    if args.next().is_some() {
        return usage();
    }
    let mut request = Vec::new();
    if let Err(e) = io::stdin().take(MAX_REQUEST).read_to_end(&mut request) {
        note!("space-agent relay: reading stdin: {e}");
        return ExitCode::from(1);
    }
    let Some(mut socket) = connect(std::path::Path::new(&path), Duration::from_secs(wait)) else {
        return ExitCode::from(NOT_LISTENING);
    };
    match copy(&mut socket, &request, &mut io::stdout().lock()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            note!("space-agent relay: {e}");
            ExitCode::from(1)
        }
    }
}

/// The socket at `path`, retried for up to `wait` while nothing listens.
fn connect(path: &std::path::Path, wait: Duration) -> Option<UnixStream> {
    let deadline = Instant::now() + wait;
    loop {
        match UnixStream::connect(path) {
            Ok(s) => return Some(s),
            Err(_) if Instant::now() < deadline => std::thread::sleep(RETRY),
            Err(_) => return None,
        }
    }
}

/// Sends `request`, then copies the socket to `out` (flushed as it comes) to its end.
fn copy(socket: &mut UnixStream, request: &[u8], out: &mut impl Write) -> io::Result<()> {
    socket.write_all(request)?;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match socket.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        out.write_all(&buf[..n])?;
        out.flush()?;
    }
}

fn usage() -> ExitCode {
    note!("usage: space-agent relay SOCKET [WAIT_SECONDS]");
    ExitCode::from(2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relay_sends_its_request_copies_the_answer_and_waits_for_a_listener() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sock");
        assert!(
            connect(&path, Duration::ZERO).is_none(),
            "nothing listens yet"
        );
        let bind_later = {
            let path = path.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
                let (mut c, _) = listener.accept().unwrap();
                let mut got = [0u8; 5];
                c.read_exact(&mut got).unwrap();
                c.write_all(b"answer to ").unwrap();
                c.write_all(&got).unwrap();
                // The relay's end stays open until the service closes.
                let mut more = [0u8; 1];
                assert_eq!(
                    c.set_read_timeout(Some(Duration::from_millis(100)))
                        .and_then(|()| c.read(&mut more))
                        .map_err(|e| e.kind()),
                    Err(io::ErrorKind::WouldBlock)
                );
            })
        };
        let mut socket = connect(&path, Duration::from_secs(10)).expect("a listener in time");
        let mut out = Vec::new();
        copy(&mut socket, b"hello", &mut out).unwrap();
        bind_later.join().unwrap();
        assert_eq!(out, b"answer to hello");
    }
}
