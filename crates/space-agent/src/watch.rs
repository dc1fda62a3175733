//! Readiness of commands' pipes and terminals through an epoll instance of the agent's own, whose event
//! data is a serial number that is never reused and is looked up before it is used.
//!
//! Why not tokio's own registration: runsc (2024-07-29) restores, now and then, epoll
//! registrations that were deleted before the checkpoint (`EPOLL_CTL_DEL`, then `close`),
//! and the restored epoll reports them with their old data. tokio's data is the address
//! of the registration's state, freed at the deregistration: such an event made the
//! restored agent walk freed memory, and it crashed or hung at its first wake. A pipe is
//! deregistered whenever a command's output ends and whenever the agent is quiesced, so
//! about one restore in three of a code-interpreter sandbox (whose requests are short
//! commands) was lost that way. Here such an event names a serial number no pipe has any
//! more, and is dropped.
//!
//! The instance itself is registered with tokio once and never closed.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

/// What a wait is for.
pub const READ: u32 = libc::EPOLLIN as u32;
pub const WRITE: u32 = libc::EPOLLOUT as u32;
/// Reported whatever was asked: a hang-up or an error ends every wait.
const ALWAYS: u32 = (libc::EPOLLHUP | libc::EPOLLERR | libc::EPOLLRDHUP) as u32;
/// Events read per `epoll_wait`.
const BATCH: usize = 64;

/// The events a pipe got since its readiness was last cleared (low 32 bits) and a count of
/// deliveries (high 32 bits), so that a clear made after a read cannot drop an event that
/// came meanwhile.
#[derive(Default)]
struct Slot {
    state: AtomicU64,
    changed: Notify,
}

impl Slot {
    fn deliver(&self, events: u32) {
        let _ = self
            .state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                Some(((s >> 32).wrapping_add(1) << 32) | (s & 0xffff_ffff) | u64::from(events))
            });
        self.changed.notify_waiters();
    }
}

/// The agent's epoll for commands' pipes (one per [`crate::http::Agent`]).
pub struct Reactor {
    epoll: AsyncFd<OwnedFd>,
    slots: Mutex<HashMap<u64, Arc<Slot>>>,
    next: AtomicU64,
}

impl std::fmt::Debug for Reactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reactor")
            .field("epoll", &self.epoll.as_raw_fd())
            .finish()
    }
}

impl Reactor {
    /// A new epoll instance and the task that dispatches its events. Call in the runtime.
    pub fn start() -> io::Result<Arc<Reactor>> {
        // SAFETY: plain syscall; the descriptor is owned from here on.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: just made, owned here.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: the descriptor is owned by the `AsyncFd` and closed only with it.
        let epoll = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)? };
        let r = Arc::new(Reactor {
            epoll,
            slots: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
        });
        tokio::spawn(dispatch(Arc::downgrade(&r)));
        Ok(r)
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Slot>>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Hands each event to its pipe's slot; an event for a serial number that has no slot (a
/// registration deleted before a checkpoint and restored by runsc) is dropped.
async fn dispatch(reactor: std::sync::Weak<Reactor>) {
    let mut events = [libc::epoll_event { events: 0, u64: 0 }; BATCH];
    loop {
        let Some(r) = reactor.upgrade() else { return };
        let Ok(mut guard) = r.epoll.readable().await else {
            return;
        };
        loop {
            // SAFETY: a valid buffer of BATCH events; no wait (timeout 0).
            let n = unsafe {
                libc::epoll_wait(r.epoll.as_raw_fd(), events.as_mut_ptr(), BATCH as i32, 0)
            };
            if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            if n <= 0 {
                break;
            }
            let slots = r.slots();
            for ev in &events[..n as usize] {
                let (id, bits) = (ev.u64, ev.events);
                if let Some(slot) = slots.get(&id) {
                    slot.deliver(bits);
                }
            }
        }
        guard.clear_ready();
    }
}

/// A non-blocking descriptor (a pipe's end, a terminal's master) watched by the agent's own
/// epoll.
pub struct Watched {
    fd: Option<OwnedFd>,
    id: u64,
    slot: Arc<Slot>,
    reactor: Arc<Reactor>,
}

impl std::fmt::Debug for Watched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watched")
            .field("fd", &self.raw())
            .field("id", &self.id)
            .finish()
    }
}

impl Watched {
    /// Watches `fd` for `interest` ([`READ`] or [`WRITE`]), edge-triggered; the descriptor is
    /// made non-blocking. On error it is closed.
    pub fn new(reactor: &Arc<Reactor>, fd: OwnedFd, interest: u32) -> io::Result<Watched> {
        let r = reactor;
        set_nonblocking(fd.as_raw_fd())?;
        let id = r.next.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(Slot::default());
        r.slots().insert(id, slot.clone());
        let added = ctl(
            r.epoll.as_raw_fd(),
            libc::EPOLL_CTL_ADD,
            fd.as_raw_fd(),
            interest | ALWAYS | libc::EPOLLET as u32,
            id,
        );
        // On error, dropping it takes the serial number out of the table and closes `fd`.
        let w = Watched {
            fd: Some(fd),
            id,
            slot,
            reactor: r.clone(),
        };
        added.map(|()| w)
    }

    fn raw(&self) -> RawFd {
        self.fd.as_ref().map_or(-1, |f| f.as_raw_fd())
    }

    /// Waits until the descriptor may be ready for `interest` (or hung up, or in error).
    pub async fn ready(&self, interest: u32) {
        loop {
            let changed = self.slot.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let bits = self.slot.state.load(Ordering::Acquire) as u32;
            if bits & (interest | ALWAYS) != 0 {
                return;
            }
            changed.await;
        }
    }

    /// Runs `io` (a non-blocking call on the descriptor for `interest`); when it would block,
    /// the readiness for `interest` is cleared (the other direction's is kept), unless an
    /// event came meanwhile.
    pub fn try_io<T>(
        &self,
        interest: u32,
        io: impl FnOnce(RawFd) -> io::Result<T>,
    ) -> io::Result<T> {
        let seen = self.slot.state.load(Ordering::Acquire);
        let result = io(self.raw());
        if matches!(&result, Err(e) if e.kind() == io::ErrorKind::WouldBlock) {
            let _ = self.slot.state.compare_exchange(
                seen,
                seen & !u64::from(interest | ALWAYS),
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
        result
    }

    /// Writes all of `data`, waiting while the pipe is full.
    pub async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let written = self.try_io(WRITE, |fd| write(fd, data));
            match written {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => data = &data[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.ready(WRITE).await,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// The descriptor, no longer watched (still non-blocking).
    pub fn into_fd(mut self) -> OwnedFd {
        self.forget();
        self.fd.take().expect("a watched descriptor until dropped")
    }

    /// Out of the epoll and out of the table: an event for `id` that comes later is dropped.
    fn forget(&mut self) {
        let r = &self.reactor;
        if let Some(fd) = &self.fd {
            let _ = ctl(
                r.epoll.as_raw_fd(),
                libc::EPOLL_CTL_DEL,
                fd.as_raw_fd(),
                0,
                0,
            );
        }
        r.slots().remove(&self.id);
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        if self.fd.is_some() {
            self.forget();
        }
    }
}

impl AsRawFd for Watched {
    fn as_raw_fd(&self) -> RawFd {
        self.raw()
    }
}

impl std::os::fd::AsFd for Watched {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd
            .as_ref()
            .expect("a watched descriptor until dropped")
            .as_fd()
    }
}

/// `read(2)` of `fd` into `buf`: the bytes read (0 at end of file), or the error.
pub fn read(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: reads into a valid buffer; a descriptor that is not open fails with EBADF.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// `write(2)` of `data` to `fd`: the bytes written, or the error.
fn write(fd: RawFd, data: &[u8]) -> io::Result<usize> {
    // SAFETY: writes from a valid buffer; a descriptor that is not open fails with EBADF.
    let n = unsafe { libc::write(fd, data.as_ptr().cast(), data.len()) };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// `epoll_ctl(epoll, op, fd, …)` with `events` and `data` (ignored for a delete).
fn ctl(epoll: RawFd, op: i32, fd: RawFd, events: u32, data: u64) -> io::Result<()> {
    let mut ev = libc::epoll_event { events, u64: data };
    // SAFETY: `ev` is a valid event; bad descriptors fail with EBADF.
    match unsafe { libc::epoll_ctl(epoll, op, fd, &mut ev) } {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller owns.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 || libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pipe() -> (OwnedFd, OwnedFd) {
        let mut fds = [0; 2];
        // SAFETY: fills a two-element array.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: just made, owned here.
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    }

    fn read_watched(w: &Watched, buf: &mut [u8]) -> io::Result<usize> {
        w.try_io(READ, |fd| read(fd, buf))
    }

    #[tokio::test]
    async fn data_then_end_of_file_through_the_agents_epoll() {
        let rx = Reactor::start().unwrap();
        let (r, w) = pipe();
        let r = Watched::new(&rx, r, READ).unwrap();
        let w = Watched::new(&rx, w, WRITE).unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(
            read_watched(&r, &mut buf).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        w.write_all(b"hello").await.unwrap();
        r.ready(READ).await;
        assert_eq!(read_watched(&r, &mut buf).unwrap(), 5);
        assert_eq!(&buf[..5], b"hello");
        // A pipe filled past its size: the writer waits for the reader.
        let big = vec![7u8; 1 << 20];
        let writer = tokio::spawn(async move {
            w.write_all(&big).await.unwrap();
            w
        });
        let mut got = 0;
        let mut chunk = vec![0u8; 65536];
        while got < 1 << 20 {
            match read_watched(&r, &mut chunk) {
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => r.ready(READ).await,
                Err(e) => panic!("{e}"),
            }
        }
        drop(writer.await.unwrap());
        r.ready(READ).await;
        assert_eq!(read_watched(&r, &mut buf).unwrap(), 0, "end of file");
    }

    #[tokio::test]
    async fn an_event_for_a_registration_that_is_gone_is_dropped() {
        let rx = Reactor::start().unwrap();
        let (r, w) = pipe();
        let r = Watched::new(&rx, r, READ).unwrap();
        let stale = r.id;
        let fd = r.into_fd();
        // What a restored epoll does: an event with the data of a deleted registration.
        assert!(!rx.slots().contains_key(&stale));
        let (r2, w2) = pipe();
        let r2 = Watched::new(&rx, r2, READ).unwrap();
        let epoll = rx.epoll.as_raw_fd();
        let stale_events = (libc::EPOLLIN | libc::EPOLLET) as u32;
        ctl(
            epoll,
            libc::EPOLL_CTL_ADD,
            fd.as_raw_fd(),
            stale_events,
            stale,
        )
        .unwrap();
        assert_eq!(write(w.as_raw_fd(), b"x").unwrap(), 1);
        assert_eq!(write(w2.as_raw_fd(), b"y").unwrap(), 1);
        // The live pipe still gets its event; the stale one touches nothing.
        r2.ready(READ).await;
        let mut buf = [0u8; 4];
        assert_eq!(read_watched(&r2, &mut buf).unwrap(), 1);
        ctl(epoll, libc::EPOLL_CTL_DEL, fd.as_raw_fd(), 0, 0).unwrap();
    }
}
