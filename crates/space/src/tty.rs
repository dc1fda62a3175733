//! `space exec -t` / `-i`: an attached command over the attach WebSocket.
//! With `-t` the command runs on a pseudo-terminal and this terminal goes raw
//! (restored on every way out), so arrow keys, Ctrl-C and full-screen programs
//! behave as over ssh; window size changes follow (SIGWINCH).

use std::io::Write;

use anyhow::{bail, Context};
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use space_api::{CreateCommandRequest, PtySize};
use space_client::Client;
use tokio::io::AsyncReadExt;
use tokio_tungstenite::tungstenite::Message;

/// Puts a terminal in raw mode and restores it when dropped.
struct RawMode {
    fd: i32,
    saved: libc::termios,
}

impl RawMode {
    fn enter(fd: i32) -> Option<RawMode> {
        // SAFETY: termios calls on a descriptor we were given; the struct is plain data.
        unsafe {
            if libc::isatty(fd) != 1 {
                return None;
            }
            let mut t: libc::termios = std::mem::zeroed();
            if libc::tcgetattr(fd, &mut t) != 0 {
                return None;
            }
            let saved = t;
            libc::cfmakeraw(&mut t);
            if libc::tcsetattr(fd, libc::TCSANOW, &t) != 0 {
                return None;
            }
            Some(RawMode { fd, saved })
        }
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        // SAFETY: restores the attributes read in `enter`.
        unsafe {
            libc::tcsetattr(self.fd, libc::TCSANOW, &self.saved);
        }
    }
}

/// The size of the terminal on `fd`, if it is one.
fn window_size(fd: i32) -> Option<PtySize> {
    // SAFETY: TIOCGWINSZ fills a plain struct.
    unsafe {
        let mut ws: libc::winsize = std::mem::zeroed();
        if libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) != 0 || ws.ws_row == 0 {
            return None;
        }
        Some(PtySize {
            rows: ws.ws_row,
            cols: ws.ws_col,
        })
    }
}

pub async fn exec_attached(
    c: &Client,
    sandbox: &str,
    mut req: CreateCommandRequest,
    tty: bool,
) -> anyhow::Result<i32> {
    req.stdin = Some(true);
    // The size the sandbox's terminal was last told of.
    let mut sent_size = None;
    if tty {
        req.pty = Some(window_size(0).unwrap_or(PtySize { rows: 24, cols: 80 }));
        sent_size = req.pty.as_ref().map(|p| (p.rows, p.cols));
        let term = std::env::var("TERM").unwrap_or_else(|_| "xterm-256color".into());
        req.env
            .get_or_insert_with(Default::default)
            .entry("TERM".into())
            .or_insert(term);
    }
    let cmd = c.create_command(sandbox, &req).await?;
    let ws = c
        .attach(&cmd.sandbox_id, &cmd.id, None)
        .await
        .context("attaching to the command")?;
    let (mut sink, mut source) = ws.split();

    let raw = if tty { RawMode::enter(0) } else { None };
    let mut winch = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change())?;
    let mut stdin = tokio::io::stdin();
    let mut buf = vec![0u8; 16 * 1024];
    let mut stdin_open = true;
    let code = loop {
        tokio::select! {
            // A resize goes before the keys typed after it, as over ssh: SIGWINCH first, and
            // the size checked again before each piece of input, because the signal and the
            // keys can be ready at once (a `stty size` typed right after a resize must see it).
            biased;
            _ = winch.recv(), if tty => {
                send_resize(&mut sink, &mut sent_size).await?;
            }
            n = stdin.read(&mut buf), if stdin_open => match n {
                Ok(0) | Err(_) => {
                    stdin_open = false;
                    sink.send(Message::Text(json!({"type": "eof"}).to_string())).await?;
                }
                Ok(n) => {
                    if tty {
                        send_resize(&mut sink, &mut sent_size).await?;
                    }
                    sink.send(Message::Binary(buf[..n].to_vec())).await?
                }
            },
            msg = source.next() => match msg {
                Some(Ok(Message::Binary(b))) if !b.is_empty() => {
                    let data = &b[1..];
                    if b[0] == 2 {
                        let mut e = std::io::stderr().lock();
                        e.write_all(data)?;
                        e.flush()?;
                    } else {
                        let mut o = std::io::stdout().lock();
                        o.write_all(data)?;
                        o.flush()?;
                    }
                }
                Some(Ok(Message::Text(t))) => {
                    let v: Value = serde_json::from_str(&t).unwrap_or(Value::Null);
                    if v["type"] == "exit" {
                        break exit_code(&v);
                    }
                    if v["type"] == "error" {
                        drop(raw);
                        bail!("{}", v["message"].as_str().unwrap_or("attach error"));
                    }
                }
                Some(Ok(Message::Close(_))) | None => break 255,
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    drop(raw);
                    return Err(e).context("the attach connection broke");
                }
            },
        }
    };
    drop(raw);
    Ok(code)
}

/// Tells the sandbox's terminal the local window's size, if it changed since `sent`.
async fn send_resize<S>(sink: &mut S, sent: &mut Option<(u16, u16)>) -> anyhow::Result<()>
where
    S: futures::Sink<Message> + Unpin,
    S::Error: std::error::Error + Send + Sync + 'static,
{
    let Some(size) = window_size(0) else {
        return Ok(());
    };
    if *sent == Some((size.rows, size.cols)) {
        return Ok(());
    }
    let msg = json!({"type": "resize", "rows": size.rows, "cols": size.cols});
    sink.send(Message::Text(msg.to_string())).await?;
    *sent = Some((size.rows, size.cols));
    Ok(())
}

fn exit_code(end: &Value) -> i32 {
    let r = &end["result"];
    if let Some(c) = r["exit_code"].as_i64() {
        return c as i32;
    }
    if let Some(s) = r["signal"].as_i64() {
        return 128i32.saturating_add(i32::try_from(s).unwrap_or(i32::MAX));
    }
    eprintln!(
        "space: command ended {}: {}",
        end["state"].as_str().unwrap_or("unknown"),
        end["lost_reason"].as_str().unwrap_or("no result")
    );
    255
}
