//! Waiting for capacity instead of a 429 (SPEC §8, `quota.max_wait`).
//!
//! A request that the route's quota, every member's quota or every member's cooldown refuses
//! may wait up to `max_wait` for capacity. These rules shape how:
//!
//! - **In turn across clients, in arrival order within one.** The waiters of a route stand
//!   in one line per instance, made of one lane per fairness key (the identified client's
//!   name, or without one the request's `quota.key` value). The turn to ask the store goes
//!   round the lanes, one request each (round robin by request), and within a lane to the
//!   waiter that came first. A client that sends a burst fills only its own lane: each other
//!   client waits at most one turn of it per request, instead of behind the whole burst.
//! - **Only the holder of the turn asks the store.** A request that arrives while anyone
//!   waits joins its lane rather than asking the store first, or a steady stream of
//!   newcomers could take every freed unit from the waiters. A new lane joins the round
//!   after the lanes already in it.
//! - **Wake-ups from the store's own answer, not polling.** A refusal carries the exact time
//!   until the request's cost fits (`retry_after_us`), computed by the store for every window
//!   and member. The holder of the turn sleeps exactly that long and asks again. Another
//!   instance may take the capacity first; it then gets a new exact time and sleeps again. A
//!   wait that would end past the deadline is not started: the request is refused at once,
//!   with the exact `Retry-After`.
//! - **Bounds.** At most `max_waiting` requests wait per route and instance; past it a
//!   request is answered `429` at once, without asking the store: capacity that frees then
//!   is owed to the requests already waiting, and a newcomer that asked could take it ahead
//!   of them. Its `Retry-After` is the time until the turn's holder asks again
//!   ([`WaitLine::until_next_ask`]). Each waiter holds a connection and a task, and an
//!   unbounded line would let a burst hold them all. A full line still makes room for a
//!   client that has fewer waiters than another: the newest waiter of the longest lane is
//!   pushed out (answered the same `429`), as long as that lane stays at least as long as
//!   the newcomer's. Otherwise one client's burst could fill the line and keep every other
//!   client out of it. At most [`MAX_LANES`] keys have a lane
//!   of their own; waiters of further keys share one more lane, which takes its turn like
//!   any other, so that many keys cannot make the round itself costly. A lane is known by a
//!   keyed 64-bit digest of its key, never the key: a long header value costs the line
//!   nothing, and a key that is a credential is not kept.
//! - **A waiter whose client hangs up leaves at once** ([`hung_up`]), uncharged: otherwise it
//!   would keep its place, take the capacity at its turn for nobody, and push the live
//!   waiters behind it past their `max_wait`.
//!
//! A request that finds nobody waiting takes no lock: it reads one counter and asks the store.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// The most fairness keys with a lane of their own in one line; waiters of further keys share
/// one more lane.
pub const MAX_LANES: usize = 1024;

/// The lane of the keys past [`MAX_LANES`]. A key whose digest happens to be this one shares
/// it too, which only makes it less separate, never lost.
const SHARED_LANE: u64 = u64::MAX;

/// The waiting line of one route.
#[derive(Debug)]
pub struct WaitLine {
    /// The lanes and who holds the turn. A std mutex: it is never held across an await, and
    /// only requests that wait take it.
    lanes: Mutex<Lanes>,
    /// Places not given back yet, the holder of the turn and waiters pushed out but not yet
    /// answered included: read without the lock by every request, to see whether anyone
    /// waits.
    waiting: AtomicUsize,
    /// When the holder of the turn asks the store next, in microseconds since `born`; 0 when
    /// it is not asleep (or nobody waits).
    next_ask_us: AtomicU64,
    born: Instant,
    /// Keys a lane's digest, per line, so that nobody can choose keys that share a lane.
    digest: RandomState,
    /// `quota.max_wait`.
    pub max_wait: Duration,
    /// `quota.max_waiting`.
    pub max_waiting: usize,
}

#[derive(Debug, Default)]
struct Lanes {
    /// The waiters of each lane that has any, in arrival order (the holder of the turn is in
    /// none).
    queued: HashMap<u64, VecDeque<Waiter>>,
    /// The lanes in `queued`, in the order their turns come.
    round: VecDeque<u64>,
    /// The ticket of the waiter that holds the turn.
    turn: Option<u64>,
    /// Waiters in `queued`, and the holder of the turn: what `max_waiting` bounds.
    in_line: usize,
    next_ticket: u64,
}

#[derive(Debug)]
struct Waiter {
    ticket: u64,
    told: Arc<Told>,
}

/// What a waiter is told, under the lanes' lock: that the turn was handed to it, or that it
/// was pushed out of a full line.
#[derive(Debug, Default)]
struct Told {
    notify: Notify,
    pushed_out: AtomicBool,
}

/// How a wait for the turn ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Turn {
    /// This place holds the turn, until it is dropped.
    Held,
    /// The deadline came first; the place has left the line.
    TimedOut,
    /// A full line made room for a client with fewer waiters: this place has left the line,
    /// and its request is answered as if it had found the line full.
    PushedOut,
}

impl Lanes {
    /// Hands a free turn to the first waiter of the next lane in the round, which then goes
    /// to the end of the round if it has more.
    fn hand_on(&mut self) {
        if self.turn.is_some() {
            return;
        }
        while let Some(lane) = self.round.pop_front() {
            let Some(queue) = self.queued.get_mut(&lane) else {
                continue;
            };
            let Some(next) = queue.pop_front() else {
                self.queued.remove(&lane);
                continue;
            };
            if queue.is_empty() {
                self.queued.remove(&lane);
            } else {
                self.round.push_back(lane);
            }
            self.turn = Some(next.ticket);
            next.told.notify.notify_one();
            return;
        }
    }

    /// Takes `ticket` out of the line, handing the turn on when it held it.
    fn leave(&mut self, lane: u64, ticket: u64) {
        if self.turn == Some(ticket) {
            self.turn = None;
            self.in_line -= 1;
            self.hand_on();
            return;
        }
        let Some(queue) = self.queued.get_mut(&lane) else {
            return;
        };
        let before = queue.len();
        queue.retain(|w| w.ticket != ticket);
        self.in_line -= before - queue.len();
        if queue.is_empty() {
            self.queued.remove(&lane);
            self.round.retain(|l| *l != lane);
        }
    }

    /// Makes room in a full line for a newcomer of `lane`: pushes out the newest waiter of
    /// the longest lane, when that lane keeps at least as many waiters as `lane` will have.
    /// The holder of the turn, which is in no lane, is never pushed out. Whether room was made.
    fn push_out_for(&mut self, lane: u64) -> bool {
        let own = self.queued.get(&lane).map_or(0, VecDeque::len);
        let Some(longest) = self.queued.values_mut().max_by_key(|q| q.len()) else {
            return false;
        };
        if longest.len() < own + 2 {
            return false;
        }
        // Two or more in it: the lane keeps a waiter, and its place in the round.
        let Some(out) = longest.pop_back() else {
            return false;
        };
        out.told.pushed_out.store(true, Ordering::Relaxed);
        out.told.notify.notify_one();
        self.in_line -= 1;
        true
    }
}

/// A place in the line; leaving it (by drop) makes room for another, and hands the turn on
/// when this place held it.
pub struct Place<'a> {
    line: &'a WaitLine,
    lane: u64,
    ticket: u64,
    told: Arc<Told>,
    /// Already out of the lanes (its deadline passed, or it was pushed out); only the count
    /// is left to give back.
    left: bool,
}

impl Place<'_> {
    /// Waits for this place's turn to ask the store, until `deadline` (see [`Turn`]).
    pub async fn turn(&mut self, deadline: Instant) -> Turn {
        loop {
            {
                let lanes = self.line.lock();
                if self.told.pushed_out.load(Ordering::Relaxed) {
                    self.left = true;
                    return Turn::PushedOut;
                }
                if lanes.turn == Some(self.ticket) {
                    return Turn::Held;
                }
            }
            // A hand-on between the look above and this wait is not lost: `notify_one`
            // keeps a permit for the next `notified`.
            if tokio::time::timeout_at(deadline, self.told.notify.notified())
                .await
                .is_err()
            {
                // A turn handed over just now is handed on by `leave`.
                self.line.lock().leave(self.lane, self.ticket);
                self.left = true;
                return Turn::TimedOut;
            }
        }
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        if !self.left {
            self.line.lock().leave(self.lane, self.ticket);
        }
        self.line.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

impl WaitLine {
    /// A line for a route with this `max_wait` (non-zero) and `max_waiting`.
    pub fn new(max_wait: Duration, max_waiting: usize) -> WaitLine {
        WaitLine {
            lanes: Mutex::new(Lanes::default()),
            waiting: AtomicUsize::new(0),
            next_ask_us: AtomicU64::new(0),
            born: Instant::now(),
            digest: RandomState::new(),
            max_wait,
            max_waiting,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Lanes> {
        // Nothing under this lock panics; a poisoned lock still holds consistent lanes.
        self.lanes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether nobody waits: a newcomer may then ask the store directly.
    pub fn is_empty(&self) -> bool {
        self.waiting.load(Ordering::Acquire) == 0
    }

    /// How many wait now (for tests and status).
    pub fn len(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// How many lanes have waiters besides the holder of the turn (for tests).
    pub fn lanes(&self) -> usize {
        self.lock().queued.len()
    }

    /// A place at the end of the lane of `key` (the fairness key: the client's name, or the
    /// quota key), or `None` when the line is full and no other lane is longer than this
    /// one would be by two or more.
    pub fn join(&self, key: &str) -> Option<Place<'_>> {
        let told = Arc::new(Told::default());
        let mut lanes = self.lock();
        let mut lane = self.digest.hash_one(key);
        if !lanes.queued.contains_key(&lane) && lanes.queued.len() >= MAX_LANES {
            lane = SHARED_LANE;
        }
        if lanes.in_line >= self.max_waiting && !lanes.push_out_for(lane) {
            return None;
        }
        lanes.in_line += 1;
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let ticket = lanes.next_ticket;
        lanes.next_ticket += 1;
        let waiter = Waiter {
            ticket,
            told: told.clone(),
        };
        match lanes.queued.get_mut(&lane) {
            Some(queue) => queue.push_back(waiter),
            None => {
                lanes.queued.insert(lane, VecDeque::from([waiter]));
                lanes.round.push_back(lane);
            }
        }
        lanes.hand_on();
        drop(lanes);
        Some(Place {
            line: self,
            lane,
            ticket,
            told,
            left: false,
        })
    }

    /// The holder of the turn sleeps until `at` and then asks the store again.
    pub fn asks_at(&self, at: Instant) {
        let us =
            u64::try_from(at.saturating_duration_since(self.born).as_micros()).unwrap_or(u64::MAX);
        self.next_ask_us.store(us.max(1), Ordering::Release);
    }

    /// The time from `now` until the holder of the turn asks the store again: the earliest a
    /// request refused at a full line could find the line moving. Zero when it is not asleep.
    pub fn until_next_ask(&self, now: Instant) -> Duration {
        let us = self.next_ask_us.load(Ordering::Acquire);
        (self.born + Duration::from_micros(us)).saturating_duration_since(now)
    }
}

/// When the holder of the turn should ask again after a refusal that fits in `retry_after`, or `None` when
/// that is past `deadline` (waiting would only delay the same refusal).
pub fn wake_at(now: Instant, retry_after: Duration, deadline: Instant) -> Option<Instant> {
    // A refusal that says "now" (a member freed in the same microsecond) still yields, so
    // that a holder that keeps losing races cannot spin.
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

    /// Who holds the turn, by the labels places were joined with.
    fn holder<'a>(line: &WaitLine, places: &[(&'a str, Place<'_>)]) -> Option<&'a str> {
        let turn = line.lock().turn?;
        places
            .iter()
            .find(|(_, p)| p.ticket == turn)
            .map(|(label, _)| *label)
    }

    /// Serves the line to its end, each holder of the turn leaving in turn: the order of the
    /// turns, by label.
    fn serve<'a>(line: &WaitLine, mut places: Vec<(&'a str, Place<'_>)>) -> Vec<&'a str> {
        let mut order = Vec::new();
        while let Some(label) = holder(line, &places) {
            order.push(label);
            let at = places.iter().position(|(l, _)| *l == label).unwrap();
            places.remove(at);
        }
        assert!(places.is_empty(), "everyone had a turn");
        order
    }

    fn join_all<'a, 'l>(line: &'l WaitLine, who: &[(&'a str, &str)]) -> Vec<(&'a str, Place<'l>)> {
        who.iter()
            .map(|(label, key)| (*label, line.join(key).expect("room")))
            .collect()
    }

    #[test]
    fn the_line_is_bounded_and_places_are_given_back() {
        let line = WaitLine::new(Duration::from_secs(1), 2);
        assert!(line.is_empty());
        let a = line.join("a").expect("room");
        let b = line.join("b").expect("room");
        assert!(line.join("c").is_none(), "max_waiting is 2");
        assert!(line.join("a").is_none(), "whatever the key");
        drop(a);
        assert_eq!(line.len(), 1);
        let _c = line.join("c").expect("a place was given back");
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

    #[test]
    fn one_key_is_served_in_arrival_order() {
        let line = WaitLine::new(Duration::from_secs(10), 10);
        let places = join_all(&line, &[("1", "k"), ("2", "k"), ("3", "k"), ("4", "k")]);
        assert_eq!(serve(&line, places), ["1", "2", "3", "4"]);
    }

    /// A burst of one key does not keep another key waiting behind all of it: the turn goes
    /// round the keys, one request each, and a new key joins the round at its end.
    #[test]
    fn the_turn_goes_round_the_keys_one_request_each() {
        let line = WaitLine::new(Duration::from_secs(10), 100);
        let mut who: Vec<(&str, &str)> = vec![
            ("a1", "a"),
            ("a2", "a"),
            ("a3", "a"),
            ("a4", "a"),
            ("a5", "a"),
        ];
        who.extend([("b1", "b"), ("b2", "b"), ("c1", "c")]);
        let places = join_all(&line, &who);
        assert_eq!(
            serve(&line, places),
            ["a1", "a2", "b1", "c1", "a3", "b2", "a4", "a5"]
        );
        assert_eq!(line.lanes(), 0);
        assert!(line.is_empty());
    }

    /// A waiter that leaves (its client hung up) leaves its lane, and a lane left empty leaves
    /// the round; the turn of one that leaves holding it goes on at once.
    #[test]
    fn leaving_takes_a_waiter_out_of_its_lane_and_round() {
        let line = WaitLine::new(Duration::from_secs(10), 100);
        let mut places = join_all(
            &line,
            &[
                ("a1", "a"),
                ("a2", "a"),
                ("b1", "b"),
                ("c1", "c"),
                ("a3", "a"),
            ],
        );
        assert_eq!(line.lanes(), 3, "a1 holds the turn; a, b and c wait");
        // b1 and a2 hang up before their turn.
        places.retain(|(l, _)| *l != "b1" && *l != "a2");
        assert_eq!(line.lanes(), 2, "b's lane is gone");
        assert_eq!(line.len(), 3);
        // a's lane keeps its place in the round, ahead of c's.
        assert_eq!(serve(&line, places), ["a1", "a3", "c1"]);
        assert_eq!(line.lanes(), 0);
    }

    /// A full line makes room for a client with fewer waiters than another, by pushing out
    /// the newest waiter of the longest lane, until the lanes are even; the holder of the
    /// turn is never pushed out.
    #[tokio::test(start_paused = true)]
    async fn a_full_line_makes_room_for_a_client_with_fewer_waiters() {
        let line = WaitLine::new(Duration::from_secs(10), 5);
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut places = join_all(&line, &[("a1", "a"), ("a2", "a"), ("a3", "a")]);
        let mut a4 = line.join("a").expect("room");
        let mut a5 = line.join("a").expect("room");
        assert!(
            line.join("a").is_none(),
            "full, and a's own lane is the longest"
        );
        places.push(("b1", line.join("b").expect("a5 makes room")));
        assert_eq!(a5.turn(deadline).await, Turn::PushedOut);
        places.push(("b2", line.join("b").expect("a4 makes room")));
        assert_eq!(a4.turn(deadline).await, Turn::PushedOut);
        assert!(
            line.join("b").is_none(),
            "a's lane (a2, a3) is no longer than b's"
        );
        assert_eq!(
            line.len(),
            7,
            "places are counted until they are given back"
        );
        drop((a4, a5));
        assert_eq!(serve(&line, places), ["a1", "a2", "b1", "a3", "b2"]);
        assert!(line.is_empty());

        let one = WaitLine::new(Duration::from_secs(10), 1);
        let _held = one.join("a").expect("room");
        assert!(one.join("b").is_none(), "the holder of the turn stays");
    }

    #[test]
    fn keys_past_the_bound_share_one_lane() {
        let line = WaitLine::new(Duration::from_secs(10), MAX_LANES + 100);
        let _first = line.join("first").expect("room");
        let keys: Vec<String> = (0..MAX_LANES + 50).map(|i| format!("k{i}")).collect();
        let places: Vec<_> = keys.iter().map(|k| line.join(k).expect("room")).collect();
        assert_eq!(
            line.lanes(),
            MAX_LANES + 1,
            "the keys' lanes and the shared one"
        );
        assert_eq!(line.len(), MAX_LANES + 51);
        drop(places);
        assert_eq!(line.lanes(), 0);
        assert_eq!(line.lock().round.len(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_turn_goes_to_a_waiter_when_its_holder_leaves() {
        let line = WaitLine::new(Duration::from_secs(10), 10);
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut a = line.join("a").expect("room");
        assert_eq!(a.turn(deadline).await, Turn::Held, "the first to join");
        let mut b = line.join("b").expect("room");
        let b_turn = b.turn(deadline);
        tokio::pin!(b_turn);
        assert!(futures_poll_once(b_turn.as_mut()).await.is_pending());
        drop(a);
        // Paused time jumps to the deadline if the hand-on is lost.
        assert_eq!(b_turn.await, Turn::Held, "handed on before the deadline");
        assert_eq!(Instant::now(), deadline - Duration::from_secs(10));
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_past_its_deadline_gives_up_and_leaves() {
        let line = WaitLine::new(Duration::from_secs(1), 10);
        let _held = line.join("a").expect("room");
        let mut b = line.join("b").expect("room");
        let deadline = Instant::now() + Duration::from_millis(10);
        assert_eq!(b.turn(deadline).await, Turn::TimedOut);
        assert_eq!(line.lanes(), 0, "out of its lane at once");
        assert_eq!(line.len(), 2, "counted until its request is answered");
        drop(b);
        assert_eq!(line.len(), 1);
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
