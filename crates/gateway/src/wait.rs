//! Waiting for capacity instead of a 429 (SPEC §8, `quota.max_wait`).
//!
//! A request that the route's quota, every member's quota or every member's cooldown refuses
//! may wait up to `max_wait` for capacity. Three rules shape how:
//!
//! - **Arrival order, per instance.** The waiters of a route stand in one line: a fair
//!   (first-in, first-out) async mutex. Only the head of the line asks the store again; the
//!   others wait for their turn. A request that arrives while anyone waits joins the end of
//!   the line rather than asking the store first, or a steady stream of newcomers could take
//!   every freed unit from the waiters.
//! - **Wake-ups from the store's own answer, not polling.** A refusal carries the exact time
//!   until the request's cost fits (`retry_after_us`), computed by the store for every window
//!   and member. The head sleeps exactly that long and asks again. Another instance may take
//!   the capacity first; the head then gets a new exact time and sleeps again. A wait that
//!   would end past the deadline is not started: the request is refused at once, with the
//!   exact `Retry-After`.
//! - **A bound.** At most `max_waiting` requests wait per route and instance; past it a
//!   request is answered `429` at once, without asking the store: capacity that frees then
//!   is owed to the requests already waiting, and a newcomer that asked could take it ahead
//!   of them. Its `Retry-After` is the time until the head of the line asks again
//!   ([`WaitLine::until_next_ask`]). Each waiter holds a connection and a task, and an
//!   unbounded line would let a burst hold them all.
//! - **A waiter whose client hangs up leaves at once** ([`hung_up`]), uncharged: otherwise it
//!   would keep its place, take the capacity at its turn for nobody, and push the live
//!   waiters behind it past their `max_wait`.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{Mutex, MutexGuard};
use tokio::time::Instant;

/// The waiting line of one route.
#[derive(Debug)]
pub struct WaitLine {
    /// Held by the head of the line while it waits and asks the store; tokio's mutex is fair,
    /// so the others get it in the order they asked.
    head: Mutex<()>,
    /// Requests in the line, the head included.
    waiting: AtomicUsize,
    /// When the head asks the store next, in microseconds since `born`; 0 when it is not
    /// asleep (or nobody waits).
    next_ask_us: AtomicU64,
    born: Instant,
    /// `quota.max_wait`.
    pub max_wait: Duration,
    /// `quota.max_waiting`.
    pub max_waiting: usize,
}

/// A place in the line; leaving it (by drop) makes room for another.
pub struct Place<'a> {
    line: &'a WaitLine,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.line.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

impl WaitLine {
    /// A line for a route with this `max_wait` (non-zero) and `max_waiting`.
    pub fn new(max_wait: Duration, max_waiting: usize) -> WaitLine {
        WaitLine {
            head: Mutex::new(()),
            waiting: AtomicUsize::new(0),
            next_ask_us: AtomicU64::new(0),
            born: Instant::now(),
            max_wait,
            max_waiting,
        }
    }

    /// Whether nobody waits: a newcomer may then ask the store directly.
    pub fn is_empty(&self) -> bool {
        self.waiting.load(Ordering::Acquire) == 0
    }

    /// How many wait now (for tests and status).
    pub fn len(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// A place at the end of the line, or `None` when it is full.
    pub fn join(&self) -> Option<Place<'_>> {
        let taken = self
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_waiting).then_some(n + 1)
            });
        taken.ok().map(|_| Place { line: self })
    }

    /// The head sleeps until `at` and then asks the store again.
    pub fn asks_at(&self, at: Instant) {
        let us =
            u64::try_from(at.saturating_duration_since(self.born).as_micros()).unwrap_or(u64::MAX);
        self.next_ask_us.store(us.max(1), Ordering::Release);
    }

    /// The time from `now` until the head of the line asks the store again: the earliest a
    /// request refused at a full line could find the line moving. Zero when the head is not
    /// asleep.
    pub fn until_next_ask(&self, now: Instant) -> Duration {
        let us = self.next_ask_us.load(Ordering::Acquire);
        (self.born + Duration::from_micros(us)).saturating_duration_since(now)
    }

    /// Waits for the head of the line until `deadline`; `None` when the deadline came first.
    pub async fn head(&self, deadline: Instant) -> Option<MutexGuard<'_, ()>> {
        tokio::time::timeout_at(deadline, self.head.lock())
            .await
            .ok()
    }
}

/// When the head should ask again after a refusal that fits in `retry_after`, or `None` when
/// that is past `deadline` (waiting would only delay the same refusal).
pub fn wake_at(now: Instant, retry_after: Duration, deadline: Instant) -> Option<Instant> {
    // A refusal that says "now" (a member freed in the same microsecond) still yields, so
    // that a head that keeps losing races cannot spin.
    let wake = now + retry_after.max(Duration::from_millis(1));
    (wake <= deadline).then_some(wake)
}

/// Resolves once the client on the socket `fd` has hung up (its FIN or a reset), and never
/// when there is no socket to watch. Bytes the client sends meanwhile (the rest of a body, a
/// pipelined request) are left in the socket for the request to read.
///
/// Pingora's stream is not read while a request waits, so the socket is watched through a
/// duplicate of its descriptor, registered with the reactor on its own; it is only made when
/// a request actually waits.
pub async fn hung_up(fd: Option<RawFd>) {
    use std::io::ErrorKind::WouldBlock;
    use tokio::io::Interest;
    let watch = fd.and_then(|fd| {
        // SAFETY: `fd` is the open socket of the request's connection, which outlives this
        // future; F_DUPFD_CLOEXEC returns a new descriptor (or -1).
        let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        // SAFETY: `dup` was just returned by fcntl and is owned by nobody else.
        let owned = (dup >= 0).then(|| unsafe { OwnedFd::from_raw_fd(dup) })?;
        let socket = std::net::TcpStream::from(owned);
        socket.set_nonblocking(true).ok()?;
        tokio::net::TcpStream::from_std(socket).ok()
    });
    let Some(watch) = watch else {
        return std::future::pending().await;
    };
    loop {
        let Ok(ready) = watch.ready(Interest::READABLE).await else {
            return;
        };
        if ready.is_read_closed() {
            return;
        }
        // Bytes (or nothing after all) clear the readiness, so that only the next change
        // wakes the watch again.
        let peeked = watch.try_io(Interest::READABLE, || match peek(watch.as_raw_fd()) {
            Ok(0) => Ok(()),
            Ok(_) => Err(WouldBlock.into()),
            Err(e) => Err(e),
        });
        match peeked {
            Err(e) if e.kind() == WouldBlock => {}
            _ => return,
        }
    }
}

/// Whether a socket has a byte to read (1) or has ended (0), without taking it.
fn peek(fd: RawFd) -> std::io::Result<usize> {
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
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_is_bounded_and_places_are_given_back() {
        let line = WaitLine::new(Duration::from_secs(1), 2);
        assert!(line.is_empty());
        let a = line.join().expect("room");
        let b = line.join().expect("room");
        assert!(line.join().is_none(), "max_waiting is 2");
        drop(a);
        assert_eq!(line.len(), 1);
        let _c = line.join().expect("a place was given back");
        drop(b);
        assert!(!line.is_empty());
    }

    #[test]
    fn a_full_line_says_when_its_head_asks_next() {
        let line = WaitLine::new(Duration::from_secs(10), 1);
        let now = Instant::now();
        assert_eq!(line.until_next_ask(now), Duration::ZERO);
        line.asks_at(now + Duration::from_millis(1500));
        // Kept to the microsecond.
        let left = line.until_next_ask(now);
        assert!(
            left > Duration::from_micros(1_499_998) && left <= Duration::from_millis(1500),
            "{left:?}"
        );
        assert_eq!(
            line.until_next_ask(now + Duration::from_secs(2)),
            Duration::ZERO
        );
    }

    #[tokio::test]
    async fn the_head_is_taken_in_arrival_order() {
        let line = std::sync::Arc::new(WaitLine::new(Duration::from_secs(10), 10));
        let first = line
            .head(Instant::now() + Duration::from_secs(1))
            .await
            .unwrap();
        let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..5 {
            let (line, order) = (line.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let _head = line
                    .head(Instant::now() + Duration::from_secs(60))
                    .await
                    .unwrap();
                order.lock().unwrap().push(i);
            }));
            // Each task is queued on the mutex before the next one starts.
            tokio::task::yield_now().await;
        }
        drop(first);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3, 4]);
    }

    #[tokio::test]
    async fn a_waiter_past_its_deadline_gives_up() {
        let line = WaitLine::new(Duration::from_secs(1), 10);
        let _held = line
            .head(Instant::now() + Duration::from_secs(1))
            .await
            .unwrap();
        assert!(line
            .head(Instant::now() + Duration::from_millis(10))
            .await
            .is_none());
    }

    #[tokio::test]
    async fn a_hang_up_is_seen_and_bytes_sent_before_it_stay_unread() {
        use std::os::fd::AsRawFd;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (mut server, _) = listener.accept().await.unwrap();
        client.write_all(b"body").await.unwrap();
        let gone = hung_up(Some(server.as_raw_fd()));
        tokio::pin!(gone);
        // The bytes alone are no hang-up: the watch is still pending once they are there.
        let mut first = [0u8; 1];
        assert_eq!(server.peek(&mut first).await.unwrap(), 1);
        assert!(futures_poll_once(gone.as_mut()).await.is_pending());
        drop(client);
        tokio::time::timeout(Duration::from_secs(10), gone)
            .await
            .expect("the hang-up is seen");
        let mut body = Vec::new();
        server.read_to_end(&mut body).await.unwrap();
        assert_eq!(body, b"body", "nothing was taken from the socket");
    }

    /// Polls `f` once (after letting the reactor deliver what it has).
    async fn futures_poll_once<F: std::future::Future + Unpin>(
        mut f: F,
    ) -> std::task::Poll<F::Output> {
        tokio::task::yield_now().await;
        std::future::poll_fn(|cx| std::task::Poll::Ready(std::pin::Pin::new(&mut f).poll(cx))).await
    }

    #[test]
    fn wake_ups_past_the_deadline_are_not_started() {
        let now = Instant::now();
        let deadline = now + Duration::from_secs(2);
        assert_eq!(
            wake_at(now, Duration::from_millis(1500), deadline),
            Some(now + Duration::from_millis(1500))
        );
        assert_eq!(wake_at(now, Duration::from_secs(3), deadline), None);
        assert_eq!(
            wake_at(now, Duration::ZERO, deadline),
            Some(now + Duration::from_millis(1))
        );
    }
}
