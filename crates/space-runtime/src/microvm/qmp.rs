//! A small QMP (QEMU Machine Protocol) client: the greeting, `qmp_capabilities`, then one
//! command at a time, each tagged with an id. Events that arrive in between are skipped.
//!
//! A command that timed out leaves the session usable: its late reply is skipped by its
//! id, and a line cut off by the timeout is finished by the next read. QEMU's monitor runs
//! in its main loop, which a TCG guest on a loaded host can starve for seconds.
//!
//! QEMU runs the guest, so what it says is treated as untrusted-ish input: every line is
//! bounded ([`MAX_LINE`]), every read has a deadline, and a reply must carry the id asked for.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

/// Longest QMP line accepted (a `query-*` answer of this driver is well under a KiB).
pub const MAX_LINE: usize = 64 * 1024;
/// Messages skipped while waiting for one reply (events, mostly).
const MAX_SKIPPED: usize = 1024;
/// Events kept for [`Qmp::wait_event`]; older ones are dropped.
const MAX_EVENTS: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("QMP I/O failed while {context}")]
    Io {
        context: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("QMP connection closed by QEMU")]
    Closed,
    #[error("QMP line longer than {MAX_LINE} bytes")]
    TooLong,
    #[error("QMP sent something that is not a JSON object: {0}")]
    Invalid(String),
    #[error("QMP did not answer within {0:?}")]
    Timeout(Duration),
    #[error("QMP command {command} failed: {class}: {desc}")]
    Command {
        command: String,
        class: String,
        desc: String,
    },
}

/// One QMP session on a Unix socket.
pub struct Qmp {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    next_id: u64,
    timeout: Duration,
    events: std::collections::VecDeque<Value>,
    /// The start of a line whose read was cut off (a timeout): the next read goes on.
    partial: Vec<u8>,
}

impl Qmp {
    /// Connects, reads the greeting and leaves capabilities negotiation mode.
    /// `timeout` bounds each step here and each later command.
    pub async fn connect(path: &Path, timeout: Duration) -> Result<Qmp, QmpError> {
        let stream = tokio::time::timeout(timeout, UnixStream::connect(path))
            .await
            .map_err(|_| QmpError::Timeout(timeout))?
            .map_err(|source| QmpError::Io {
                context: "connecting",
                source,
            })?;
        let (r, w) = stream.into_split();
        let mut qmp = Qmp {
            reader: BufReader::with_capacity(8192, r),
            writer: w,
            next_id: 1,
            timeout,
            events: std::collections::VecDeque::new(),
            partial: Vec::new(),
        };
        let greeting = qmp.read_message().await?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Invalid("no QMP greeting".into()));
        }
        qmp.execute("qmp_capabilities", None).await?;
        Ok(qmp)
    }

    /// Runs one command and returns its `return` value.
    pub async fn execute(
        &mut self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Value, QmpError> {
        let id = self.next_id;
        self.next_id += 1;
        let mut msg = json!({"execute": command, "id": id});
        if let Some(args) = arguments {
            msg["arguments"] = args;
        }
        let mut line = serde_json::to_vec(&msg).map_err(|e| QmpError::Invalid(e.to_string()))?;
        line.push(b'\n');
        tokio::time::timeout(self.timeout, self.writer.write_all(&line))
            .await
            .map_err(|_| QmpError::Timeout(self.timeout))?
            .map_err(|source| QmpError::Io {
                context: "sending a command",
                source,
            })?;
        for _ in 0..MAX_SKIPPED {
            let reply = self.read_message().await?;
            if reply.get("event").is_some() {
                self.keep_event(reply);
                continue;
            }
            match reply.get("id").and_then(Value::as_u64) {
                Some(i) if i == id => {}
                // The late reply of an earlier command of ours, which timed out.
                Some(i) if i < id => continue,
                // A reply to someone else's command cannot happen on our own connection.
                _ => return Err(QmpError::Invalid(format!("reply without our id {id}"))),
            }
            if let Some(ret) = reply.get("return") {
                return Ok(ret.clone());
            }
            if let Some(err) = reply.get("error") {
                let field = |k: &str| {
                    err.get(k)
                        .and_then(Value::as_str)
                        .unwrap_or("?")
                        .chars()
                        .take(500)
                        .collect::<String>()
                };
                return Err(QmpError::Command {
                    command: command.to_owned(),
                    class: field("class"),
                    desc: field("desc"),
                });
            }
            return Err(QmpError::Invalid(
                "reply with neither return nor error".into(),
            ));
        }
        Err(QmpError::Invalid(format!(
            "more than {MAX_SKIPPED} events before the reply"
        )))
    }

    fn keep_event(&mut self, event: Value) {
        if self.events.len() == MAX_EVENTS {
            self.events.pop_front();
        }
        self.events.push_back(event);
    }

    /// Removes the events seen so far that `matches` accepts and returns how many there were.
    pub fn take_events(&mut self, matches: impl Fn(&Value) -> bool) -> usize {
        let before = self.events.len();
        self.events.retain(|e| !matches(e));
        before - self.events.len()
    }

    /// Reads one newline-terminated JSON object, at most [`MAX_LINE`] bytes.
    async fn read_message(&mut self) -> Result<Value, QmpError> {
        let timeout = self.timeout;
        let read = read_bounded_line(&mut self.reader, &mut self.partial);
        let line = tokio::time::timeout(timeout, read)
            .await
            .map_err(|_| QmpError::Timeout(timeout))??;
        let value: Value =
            serde_json::from_slice(&line).map_err(|e| QmpError::Invalid(e.to_string()))?;
        if !value.is_object() {
            return Err(QmpError::Invalid("not an object".into()));
        }
        Ok(value)
    }
}

/// One line without its newline; never buffers more than [`MAX_LINE`] bytes. The line is
/// gathered in `line`, so a read that is cut off (dropped) loses nothing: the next call
/// with the same `line` goes on from where it stopped.
async fn read_bounded_line<R: tokio::io::AsyncBufRead + Unpin>(
    reader: &mut R,
    line: &mut Vec<u8>,
) -> Result<Vec<u8>, QmpError> {
    loop {
        let buf = reader.fill_buf().await.map_err(|source| QmpError::Io {
            context: "reading",
            source,
        })?;
        if buf.is_empty() {
            return Err(QmpError::Closed);
        }
        let (take, done) = match buf.iter().position(|b| *b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        if line.len() + take > MAX_LINE + 1 {
            line.clear();
            return Err(QmpError::TooLong);
        }
        line.extend_from_slice(&buf[..take]);
        reader.consume(take);
        if done {
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            return Ok(std::mem::take(line));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[tokio::test]
    async fn lines_are_bounded() {
        let mut line = Vec::new();
        let mut ok: &[u8] = b"{\"a\":1}\r\nrest";
        assert_eq!(
            read_bounded_line(&mut ok, &mut line).await.unwrap(),
            b"{\"a\":1}"
        );
        assert!(line.is_empty());
        let long = vec![b'x'; MAX_LINE + 10];
        let mut r: &[u8] = &long;
        assert!(matches!(
            read_bounded_line(&mut r, &mut line).await,
            Err(QmpError::TooLong)
        ));
        let mut eof: &[u8] = b"{\"partial\"";
        assert!(matches!(
            read_bounded_line(&mut eof, &mut Vec::new()).await,
            Err(QmpError::Closed)
        ));
    }

    /// A socket for a fake QEMU, in a directory of its own: the directory, the socket's
    /// path and its listener.
    fn fake_qemu(name: &str) -> (PathBuf, PathBuf, tokio::net::UnixListener) {
        let dir = std::env::temp_dir().join(format!("qmp-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("q.sock");
        let _ = std::fs::remove_file(&path);
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        (dir, path, listener)
    }

    /// The fake QEMU's side of a session's start: accepts the client, greets it and answers
    /// its `qmp_capabilities` (id 1).
    async fn greet(
        listener: tokio::net::UnixListener,
    ) -> (BufReader<OwnedReadHalf>, OwnedWriteHalf) {
        let (s, _) = listener.accept().await.unwrap();
        let (r, mut w) = s.into_split();
        let mut r = BufReader::new(r);
        w.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n")
            .await
            .unwrap();
        let mut line = String::new();
        r.read_line(&mut line).await.unwrap();
        assert!(line.contains("qmp_capabilities"), "{line}");
        w.write_all(b"{\"return\": {}, \"id\": 1}\n").await.unwrap();
        (r, w)
    }

    #[tokio::test]
    async fn a_session_skips_events_and_matches_ids() {
        let (dir, path, listener) = fake_qemu("ids");
        let server = tokio::spawn(async move {
            let (mut r, mut w) = greet(listener).await;
            let mut line = String::new();
            r.read_line(&mut line).await.unwrap();
            assert!(line.contains("query-status"));
            w.write_all(b"{\"event\": \"STOP\", \"data\": {}}\n")
                .await
                .unwrap();
            w.write_all(b"{\"return\": {\"status\": \"paused\"}, \"id\": 2}\n")
                .await
                .unwrap();
            line.clear();
            r.read_line(&mut line).await.unwrap();
            w.write_all(
                b"{\"error\": {\"class\": \"GenericError\", \"desc\": \"no\"}, \"id\": 3}\n",
            )
            .await
            .unwrap();
        });
        let mut qmp = Qmp::connect(&path, Duration::from_secs(5)).await.unwrap();
        let status = qmp.execute("query-status", None).await.unwrap();
        assert_eq!(status["status"], "paused");
        let err = qmp.execute("cont", None).await.unwrap_err();
        assert!(err.to_string().contains("GenericError: no"), "{err}");
        server.await.unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_command_that_timed_out_leaves_the_session_usable() {
        let (dir, path, listener) = fake_qemu("late");
        let server = tokio::spawn(async move {
            let (mut r, mut w) = greet(listener).await;
            let mut line = String::new();
            r.read_line(&mut line).await.unwrap();
            assert!(line.contains("query-chardev"), "{line}");
            // Half of the reply, then a stall past the client's bound (a starved main
            // loop), then the rest of it.
            w.write_all(b"{\"return\": [], ").await.unwrap();
            tokio::time::sleep(Duration::from_millis(600)).await;
            w.write_all(b"\"id\": 2}\n").await.unwrap();
            line.clear();
            r.read_line(&mut line).await.unwrap();
            assert!(line.contains("query-status"), "{line}");
            w.write_all(b"{\"return\": {\"status\": \"running\"}, \"id\": 3}\n")
                .await
                .unwrap();
        });
        let mut qmp = Qmp::connect(&path, Duration::from_millis(300))
            .await
            .unwrap();
        let late = qmp.execute("query-chardev", None).await;
        assert!(matches!(late, Err(QmpError::Timeout(_))), "{late:?}");
        // Its reply, finished late, is passed over for the next command's.
        tokio::time::sleep(Duration::from_millis(400)).await;
        let status = qmp.execute("query-status", None).await.unwrap();
        assert_eq!(status["status"], "running");
        server.await.unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
