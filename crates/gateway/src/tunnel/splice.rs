//! Linux: a plain-TCP tunnel's bytes moved by `splice(2)` through a pipe, socket to pipe to
//! socket, so that they never cross into user space.
//!
//! The copy loop of [`super::pump`] reads each chunk into a buffer and writes it out again: two
//! copies and two system calls per chunk and direction, on cores that the client and the
//! server need too. With `splice` the kernel moves page references from one socket's receive
//! queue to the other's send queue. It only applies when both sides are plain TCP sockets:
//! a TLS listener's client side must be decrypted by sluice, and then the copy loop runs.
//!
//! The client socket belongs to Pingora's stream (registered with tokio's reactor through it).
//! Its descriptor is duplicated and the duplicate is registered as a tokio `TcpStream` of its
//! own, so that readiness can be awaited; Pingora's stream is not read or written while the
//! tunnel runs, and closes the socket when the tunnel is over. What Pingora's stream had
//! already read past the CONNECT head, in its read buffer, is taken out first ([`drain`]) and
//! goes up before any spliced byte.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use pingora::protocols::l4::stream::Stream as L4Stream;
use pingora::protocols::{Stream, UniqueID};
use prometheus::IntCounter;
use tokio::io::{AsyncRead, Interest, ReadBuf};
use tokio::net::TcpStream;

use super::pump::{Counters, Pumped};

/// The pipe's size asked for: one call moves up to this much. 1 MiB is Linux's default
/// `/proc/sys/fs/pipe-max-size`, the most an unprivileged process may ask for; when refused, the
/// pipe keeps its default 64 KiB.
const PIPE_SIZE: usize = 1 << 20;

/// Set `SLUICE_TUNNEL_SPLICE=0` to use the copy loop instead (to compare the two).
pub(super) const SPLICE_ENV: &str = "SLUICE_TUNNEL_SPLICE";

/// The client side of a tunnel as a socket of its own, when it is a plain TCP connection; with
/// the bytes Pingora's stream had buffered past `early` appended to `early`. None (and
/// `early` possibly longer) when splicing does not apply: a TLS client, a client that has
/// already closed, or a descriptor that cannot be duplicated.
pub(super) fn client_socket(client: &mut Stream, early: &mut Vec<u8>) -> Option<TcpStream> {
    if std::env::var(SPLICE_ENV).is_ok_and(|v| v == "0") {
        return None;
    }
    // Pingora's plain TCP stream: its id is its socket's descriptor.
    let fd: RawFd = UniqueID::id(client.as_any().downcast_ref::<L4Stream>()?);
    if !drain(client, early) {
        return None;
    }
    // SAFETY: `fd` is the open socket of `client`, which outlives this call; F_DUPFD_CLOEXEC
    // returns a new descriptor (or -1), which the OwnedFd then owns alone.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return None;
    }
    // SAFETY: `dup` was just returned by fcntl and is owned by nobody else.
    let owned = unsafe { OwnedFd::from_raw_fd(dup) };
    let std = std::net::TcpStream::from(owned);
    std.set_nonblocking(true).ok()?;
    TcpStream::from_std(std).ok()
}

/// The most bytes [`drain`] takes into memory. A client that writes as fast as they are read
/// would otherwise keep the loop (and the buffer) growing: past this, the tunnel is copied
/// instead of spliced, through a buffer of fixed size.
const MAX_DRAIN: usize = 256 * 1024;

/// Reads what `client` returns without waiting (its read buffer, then whatever the socket has)
/// into `early`. True once a read would wait, so that nothing is left in the stream's buffers;
/// false at the end of the stream, on an error, or past [`MAX_DRAIN`] bytes (the copy loop then
/// takes over, and sees the rest).
fn drain(client: &mut Stream, early: &mut Vec<u8>) -> bool {
    let mut cx = Context::from_waker(Waker::noop());
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let mut buf = ReadBuf::new(&mut chunk);
        match Pin::new(&mut *client).poll_read(&mut cx, &mut buf) {
            Poll::Pending => return true,
            Poll::Ready(Ok(())) if !buf.filled().is_empty() => {
                early.extend_from_slice(buf.filled());
                if early.len() >= MAX_DRAIN {
                    return false;
                }
            }
            Poll::Ready(_) => return false,
        }
    }
}

/// A pipe, both ends non-blocking, as large as the system lets it be (up to [`PIPE_SIZE`]).
fn pipe() -> io::Result<(OwnedFd, OwnedFd, usize)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both were just returned by pipe2 and are owned by nobody else.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: F_SETPIPE_SZ takes an int and returns the size set, or -1 (the size is kept).
    let set = unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_SIZE as libc::c_int) };
    let size = if set > 0 { set as usize } else { 64 * 1024 };
    Ok((r, w, size))
}

/// Whether a socket has a byte to read (1) or has ended (0), without taking it.
fn peek(fd: RawFd) -> io::Result<usize> {
    let mut byte = 0u8;
    // SAFETY: one byte of room at `byte`; MSG_PEEK leaves it in the socket.
    let n = unsafe {
        libc::recv(
            fd,
            (&raw mut byte).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

fn splice(from: RawFd, to: RawFd, len: usize) -> io::Result<usize> {
    // SAFETY: plain descriptors, null offsets (both are sockets or pipes, which have none).
    let n = unsafe {
        libc::splice(
            from,
            std::ptr::null_mut(),
            to,
            std::ptr::null_mut(),
            len,
            libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// [`super::pump::pump`] for two TCP sockets: the same counting, half-closes and idle timeout.
pub(super) async fn pump(
    client: TcpStream,
    member: TcpStream,
    early_up: &[u8],
    early_down: &[u8],
    idle: Duration,
    counters: &Counters,
) -> Pumped {
    let start = Instant::now();
    let last = AtomicU64::new(0);
    let up = AtomicU64::new(0);
    let down = AtomicU64::new(0);
    let both = async {
        tokio::try_join!(
            one_way(&client, &member, early_up, &up, &counters.up, &last, start),
            one_way(
                &member,
                &client,
                early_down,
                &down,
                &counters.down,
                &last,
                start
            ),
        )
    };
    let idle_watch = async {
        loop {
            let due = start + Duration::from_millis(last.load(Ordering::Relaxed)) + idle;
            if Instant::now() >= due {
                return;
            }
            tokio::time::sleep_until(due.into()).await;
        }
    };
    let ended = tokio::select! {
        r = both => r.err(),
        () = idle_watch => Some("idle_timeout"),
    };
    Pumped {
        up: up.load(Ordering::Relaxed),
        down: down.load(Ordering::Relaxed),
        ended,
    }
}

/// `from` to `to` through a pipe of its own, until `from` ends (passed on as a half-close).
async fn one_way(
    from: &TcpStream,
    to: &TcpStream,
    early: &[u8],
    total: &AtomicU64,
    counter: &IntCounter,
    last: &AtomicU64,
    start: Instant,
) -> Result<(), &'static str> {
    let moved = |n: usize| {
        total.fetch_add(n as u64, Ordering::Relaxed);
        counter.inc_by(n as u64);
        last.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
    };
    if !early.is_empty() {
        write_all(to, early).await.map_err(|_| "io_error")?;
        moved(early.len());
    }
    // The pipe is made once the first byte is there: many tunnels carry nothing one way (a
    // CONNECT that is closed at once, say), and would pay for a pipe for nothing.
    let first = wait_for(from, Interest::READABLE, || peek(from.as_raw_fd()))
        .await
        .map_err(|_| "io_error")?;
    if first == 0 {
        // SAFETY: a socket descriptor that `to` keeps open.
        unsafe { libc::shutdown(to.as_raw_fd(), libc::SHUT_WR) };
        return Ok(());
    }
    let (pipe_r, pipe_w, size) = pipe().map_err(|_| "io_error")?;
    loop {
        // The pipe is empty here, so a WouldBlock is the socket's: nothing to read yet.
        let n = wait_for(from, Interest::READABLE, || {
            splice(from.as_raw_fd(), pipe_w.as_raw_fd(), size)
        })
        .await
        .map_err(|_| "io_error")?;
        if n == 0 {
            // SAFETY: a socket descriptor that `to` keeps open.
            unsafe { libc::shutdown(to.as_raw_fd(), libc::SHUT_WR) };
            return Ok(());
        }
        last.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
        let mut in_pipe = n;
        while in_pipe > 0 {
            // The pipe holds bytes here, so a WouldBlock is the socket's: its send queue is full.
            let sent = wait_for(to, Interest::WRITABLE, || {
                splice(pipe_r.as_raw_fd(), to.as_raw_fd(), in_pipe)
            })
            .await
            .map_err(|_| "io_error")?;
            if sent == 0 {
                return Err("io_error");
            }
            in_pipe -= sent;
            moved(sent);
        }
    }
}

/// Runs `op` on `socket` once it is ready for `interest`, again after each WouldBlock.
async fn wait_for(
    socket: &TcpStream,
    interest: Interest,
    mut op: impl FnMut() -> io::Result<usize>,
) -> io::Result<usize> {
    loop {
        socket.ready(interest).await?;
        match socket.try_io(interest, &mut op) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            other => return other,
        }
    }
}

/// Writes `bytes` to a socket shared by reference.
async fn write_all(socket: &TcpStream, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        socket.writable().await?;
        match socket.try_write(bytes) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
