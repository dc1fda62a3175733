//! The agent's link to the host over a virtio-serial port (the microVM runtime).
//!
//! The host side is a QEMU `virtserialport` whose chardev is a Unix socket the host server
//! listens on. Linux's virtio_console tells the guest whether the host end is connected:
//! while it is not, `poll` reports `POLLHUP`, `read` returns 0 (end of file) and `write`
//! would block. So "dialling" is opening the port and waiting until the host is there, and
//! a vanished host shows up as end of file (or `POLLHUP` on a blocked write), after which
//! the agent closes the port and dials again: a reconnecting host gets a fresh handshake.
//!
//! The other direction is not symmetric: when the agent closes the port (an HTTP/2 error,
//! a keepalive timeout, `/v1/quiesce`), QEMU keeps its socket to the host open, and the
//! agent's next Hello arrives on the host's old connection. A host must therefore drop the
//! connection on any protocol error; QEMU (`reconnect`) then connects again and the agent,
//! which retries its handshake every `HANDSHAKE_TIMEOUT`, greets the new connection.
//!
//! tokio keeps a descriptor's "closed" readiness forever once epoll reported a hangup, so
//! a port is registered with tokio only once the host is there (until then its state is
//! polled, see [`HOST_POLL`]), and any hangup seen afterwards ends the connection: a port
//! is never reused across host connections.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Readiness is edge-triggered; a missed edge costs at most this long.
const RECHECK: Duration = Duration::from_secs(1);
/// How often a port waiting for its host looks again. epoll reports the hangup on every
/// wait while the host is away, so there is no wakeup to wait for; the host (QEMU's
/// `reconnect`) takes a second or more anyway.
const HOST_POLL: Duration = Duration::from_millis(25);

/// An open virtio-serial port.
pub struct Port {
    fd: AsyncFd<OwnedFd>,
}

impl Port {
    /// Opens the port at `path` and waits until the host end is connected.
    pub async fn connect(path: &str) -> io::Result<Port> {
        let fd = Port::open(path)?;
        while !host_connected(&fd)? {
            tokio::time::sleep(HOST_POLL).await;
        }
        // SAFETY: the OwnedFd stays open, and the same descriptor, for as long as the AsyncFd
        // owns it.
        let fd = unsafe { AsyncFd::register(fd) }?;
        Ok(Port { fd })
    }

    fn open(path: &str) -> io::Result<OwnedFd> {
        let c_path = std::ffi::CString::new(path)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "port path has a NUL"))?;
        // SAFETY: a valid C string; the flags ask for a new descriptor we then own.
        let raw = unsafe {
            libc::open(
                c_path.as_ptr(),
                libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY,
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(raw) })
    }

    fn revents(&self) -> io::Result<libc::c_short> {
        revents(self.fd.get_ref())
    }

    /// Waits until the host has sent something, without consuming it; false when the host
    /// went away first.
    pub async fn host_spoke(&self) -> bool {
        loop {
            let guard = tokio::time::timeout(RECHECK, self.fd.readable()).await;
            match self.revents() {
                Ok(r) if r & libc::POLLIN != 0 && r & libc::POLLHUP == 0 => return true,
                Ok(r) if r & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 => return false,
                Ok(_) => {}
                Err(_) => return false,
            }
            match guard {
                Ok(Ok(guard)) if guard.ready().is_read_closed() => return false,
                Ok(Ok(mut guard)) => guard.clear_ready(),
                Ok(Err(_)) => return false,
                Err(_) => {}
            }
        }
    }

    fn hung_up(&self) -> bool {
        matches!(self.revents(), Ok(r) if r & (libc::POLLHUP | libc::POLLERR) != 0)
    }
}

/// What `poll` says about the port right now.
fn revents(fd: &OwnedFd) -> io::Result<libc::c_short> {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN | libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one pollfd we own; a zero timeout never blocks.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(pfd.revents)
}

/// Whether the host end is connected: no hangup, and writable.
fn host_connected(fd: &OwnedFd) -> io::Result<bool> {
    let r = revents(fd)?;
    Ok(r & libc::POLLHUP == 0 && r & libc::POLLOUT != 0)
}

impl AsyncRead for Port {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.fd.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            let result = guard.try_io(|fd| {
                // SAFETY: writes at most `unfilled.len()` bytes into memory we borrow mutably.
                let n = unsafe {
                    libc::read(
                        fd.get_ref().as_raw_fd(),
                        unfilled.as_mut_ptr().cast(),
                        unfilled.len(),
                    )
                };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match result {
                // 0 is end of file: the host end is not connected (any more).
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                // The host hung up and came back before we read the end of file: this
                // connection is over all the same (and the readiness would never clear).
                Err(_would_block) if guard.ready().is_read_closed() => return Poll::Ready(Ok(())),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for Port {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.fd.poll_write_ready(cx))?;
            let result = guard.try_io(|fd| {
                // SAFETY: reads `data.len()` bytes from a slice we borrow.
                let n = unsafe {
                    libc::write(fd.get_ref().as_raw_fd(), data.as_ptr().cast(), data.len())
                };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match result {
                Ok(Ok(n)) => return Poll::Ready(Ok(n)),
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                // A write blocks while the host end is away; that is a broken pipe to us.
                Err(_would_block) if guard.ready().is_write_closed() || self.hung_up() => {
                    return Poll::Ready(Err(io::Error::from(io::ErrorKind::BrokenPipe)))
                }
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
