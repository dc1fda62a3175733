//! Pseudo-terminals for commands that ask for one: opening the pair, sizing
//! it, and the master side as a non-blocking reader and writer.
//!
//! The slave goes to the command as stdin, stdout and stderr (and becomes its
//! controlling terminal, see `spawn`); the agent keeps only the master.

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use space_agent::protocol::PtySize;

use crate::watch::{self, Reactor, Watched};

/// What a terminal's EOF character is when it cannot be read (`^D`).
const DEFAULT_EOF: u8 = 0x04;

/// The outcome of one read from the master.
pub enum PtyRead {
    Data(usize),
    /// The slave side is closed everywhere (EIO), or the read failed for good.
    Eof,
    /// Nothing to read right now.
    Again,
}

/// Opens a new terminal pair of `size`. Both ends close on exec; the caller
/// hands the slave to the child through its stdio.
pub fn open(size: PtySize) -> io::Result<(OwnedFd, OwnedFd)> {
    let flags = libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC;
    // gVisor and Docker-style /dev make /dev/ptmx a link to pts/ptmx; try the
    // devpts one too for a /dev that lacks the link.
    let mut master = None;
    let mut last_err = io::Error::from_raw_os_error(libc::ENOENT);
    for path in [c"/dev/ptmx", c"/dev/pts/ptmx"] {
        // SAFETY: a valid C string; the descriptor, if any, is owned below.
        let fd = unsafe { libc::open(path.as_ptr(), flags) };
        if fd >= 0 {
            // SAFETY: a fresh descriptor nothing else owns.
            master = Some(unsafe { OwnedFd::from_raw_fd(fd) });
            break;
        }
        last_err = io::Error::last_os_error();
    }
    let master = master.ok_or(last_err)?;
    // No grantpt: on devpts it has nothing to do that the agent does not do itself.
    // SAFETY: plain calls on a descriptor we own; `name` outlives them.
    let mut name = [0 as libc::c_char; 128];
    unsafe {
        if libc::unlockpt(master.as_raw_fd()) != 0 {
            return Err(io::Error::last_os_error());
        }
        let rc = libc::ptsname_r(master.as_raw_fd(), name.as_mut_ptr(), name.len());
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
    }
    // SAFETY: ptsname_r NUL-terminated `name`.
    let fd = unsafe { libc::open(name.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    let slave = unsafe { OwnedFd::from_raw_fd(fd) };
    set_size(master.as_fd(), size)?;
    // Line editing of UTF-8 (erase removes a whole character), as sshd sets it
    // for a UTF-8 client. Best effort: a terminal without it still works.
    // SAFETY: termios is plain data; the calls only read and write it.
    unsafe {
        let mut t = std::mem::zeroed::<libc::termios>();
        if libc::tcgetattr(slave.as_raw_fd(), &mut t) == 0 {
            t.c_iflag |= libc::IUTF8;
            libc::tcsetattr(slave.as_raw_fd(), libc::TCSANOW, &t);
        }
    }
    Ok((master, slave))
}

/// Sets the window size; the kernel sends SIGWINCH to the terminal's
/// foreground process group when it changes.
fn set_size(fd: std::os::fd::BorrowedFd<'_>, size: PtySize) -> io::Result<()> {
    let ws = libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one winsize from a valid pointer.
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &ws) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn classify(r: io::Result<usize>) -> PtyRead {
    match r {
        Ok(0) => PtyRead::Eof,
        Ok(n) => PtyRead::Data(n),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => PtyRead::Again,
        Err(e) if e.kind() == io::ErrorKind::Interrupted => PtyRead::Again,
        // EIO once every slave descriptor is closed: the normal end.
        Err(_) => PtyRead::Eof,
    }
}

/// The master side of a command's terminal, watched by the agent's own epoll (see
/// [`crate::watch`]: a restored epoll's stale events never reach it).
#[derive(Debug)]
pub struct Pty {
    fd: Watched,
}

impl Pty {
    /// Makes `master` non-blocking and watches it, for reads and writes.
    pub fn new(reactor: &Arc<Reactor>, master: OwnedFd) -> io::Result<Pty> {
        let fd = Watched::new(reactor, master, watch::READ | watch::WRITE)?;
        Ok(Pty { fd })
    }

    /// Waits until the master may have something to read.
    pub async fn readable(&self) -> io::Result<()> {
        self.fd.ready(watch::READ).await;
        Ok(())
    }

    /// One read after [`Pty::readable`]; readiness is cleared on `Again` (unless an event
    /// came meanwhile).
    pub fn try_read(&self, buf: &mut [u8]) -> PtyRead {
        classify(self.fd.try_io(watch::READ, |fd| watch::read(fd, buf)))
    }

    /// A read that ignores the readiness (for draining after the exit).
    pub fn read_now(&self, buf: &mut [u8]) -> PtyRead {
        classify(watch::read(self.fd.as_raw_fd(), buf))
    }

    /// Writes all of `data`, waiting while the terminal's input is full.
    pub async fn write_all(&self, data: &[u8]) -> io::Result<()> {
        self.fd.write_all(data).await
    }

    /// The character that makes a terminal read return end-of-file now.
    pub fn eof_char(&self) -> u8 {
        // SAFETY: termios is plain data that tcgetattr fills in.
        unsafe {
            let mut t = std::mem::zeroed::<libc::termios>();
            if libc::tcgetattr(self.fd.as_raw_fd(), &mut t) == 0 {
                let c = t.c_cc[libc::VEOF];
                // 0 is _POSIX_VDISABLE: no EOF character; ^D is as good as any.
                if c != 0 {
                    return c;
                }
            }
        }
        DEFAULT_EOF
    }

    /// Sets the window size. Linux then sends SIGWINCH to the terminal's
    /// foreground process group; gVisor does not (see [`Pty::kernel_signals_resize`]).
    pub fn resize(&self, size: PtySize) -> io::Result<()> {
        set_size(self.fd.as_fd(), size)
    }

    /// Whether the kernel knows the terminal's foreground process group from
    /// the master side, and so signals it on a resize itself (Linux). gVisor
    /// answers ENOTTY here, does not signal, and shows no `tpgid` in `/proc`.
    pub fn kernel_signals_resize(&self) -> bool {
        let mut pgrp: libc::pid_t = 0;
        // SAFETY: TIOCGPGRP writes one pid_t to a valid pointer.
        unsafe { libc::ioctl(self.fd.as_raw_fd(), libc::TIOCGPGRP, &mut pgrp) == 0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size_of(fd: &OwnedFd) -> (u16, u16) {
        // SAFETY: TIOCGWINSZ fills in one winsize.
        unsafe {
            let mut ws = std::mem::zeroed::<libc::winsize>();
            assert_eq!(libc::ioctl(fd.as_raw_fd(), libc::TIOCGWINSZ, &mut ws), 0);
            (ws.ws_row, ws.ws_col)
        }
    }

    #[tokio::test]
    async fn sized_pair_resize_eof_and_hangup() {
        let (master, slave) = open(PtySize { rows: 24, cols: 80 }).expect("open pty");
        assert_eq!(size_of(&slave), (24, 80));
        let reactor = Reactor::start().expect("reactor");
        let pty = Pty::new(&reactor, master).expect("register");
        assert_eq!(pty.eof_char(), 0x04);
        pty.resize(PtySize {
            rows: 50,
            cols: 132,
        })
        .expect("resize");
        assert_eq!(size_of(&slave), (50, 132));

        // Output written to the slave comes out of the master (with \n as \r\n).
        // SAFETY: writes from a valid buffer to a descriptor we own.
        let n = unsafe { libc::write(slave.as_raw_fd(), b"hi\n".as_ptr().cast(), 3) };
        assert_eq!(n, 3);
        let mut buf = [0u8; 16];
        let mut got = Vec::new();
        while got.len() < 4 {
            pty.readable().await.expect("readable");
            if let PtyRead::Data(n) = pty.try_read(&mut buf) {
                got.extend_from_slice(&buf[..n]);
            }
        }
        assert_eq!(got, b"hi\r\n");
        assert!(matches!(pty.read_now(&mut buf), PtyRead::Again));
        // With the slave closed everywhere the master reads its end.
        drop(slave);
        assert!(matches!(pty.read_now(&mut buf), PtyRead::Eof));
    }
}
