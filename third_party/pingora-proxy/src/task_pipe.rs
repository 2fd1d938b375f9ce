//! PATCH (sluice, one-lock task pipe; third_party/PATCHES.md): the bounded channel that carries
//! `HttpTask`s between the two halves of an HTTP/1 proxied request.
//!
//! `proxy_1to1` made two `tokio::sync::mpsc` channels per request, one each way, and sent a
//! handful of tasks through them. tokio's channel is built for many senders on many threads: a
//! semaphore for its capacity, a linked list of 32-slot blocks, an atomic waker per side. Here
//! each channel has exactly one sender and one receiver, both polled by the same task
//! (`try_join!`), and never more than [`CAP`] tasks in flight. So a channel is one allocation:
//! a mutex around a ring of [`CAP`] slots and one waker per side, and each operation is one
//! uncontended lock.
//!
//! What the proxy relies on is kept, with tokio's own error types:
//! - a send (or a reservation) fails once the receiver is gone, and `PipeState` reads that
//!   failure to tell a finished downstream half from a broken pipe;
//! - `recv` returns `None` once the sender is gone and every task sent was received;
//! - a [`Permit`] holds a slot until it sends or is dropped, and dropping one frees the slot;
//! - every future here is cancel-safe: one dropped before it finished took nothing.
//!
//! Each side keeps one waker. A second task waiting on the same side replaces the first one's
//! waker and wakes it, so no wake-up is lost; the two would take turns being woken until
//! capacity came. `proxy_1to1` never does that: each side belongs to one half of one task.

use std::fmt;
use std::future::poll_fn;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

pub use tokio::sync::mpsc::error::{SendError, TrySendError};

/// How many tasks a channel holds: pingora-proxy's `TASK_BUFFER_SIZE`.
pub const CAP: usize = 4;

struct State<T> {
    /// A ring: `len` tasks from `head`.
    slots: [Option<T>; CAP],
    head: usize,
    len: usize,
    /// Slots promised to permits not yet used.
    reserved: usize,
    sender_alive: bool,
    receiver_alive: bool,
    /// The task waiting for a task to receive, or for the sender to go.
    recv_waker: Option<Waker>,
    /// The task waiting for a free slot, or for the receiver to go.
    send_waker: Option<Waker>,
}

struct Shared<T>(Mutex<State<T>>);

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // Nothing here panics while holding the lock; if something did, the state is still
        // whole (each change is a few plain assignments), so a poisoned lock is used as is.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Registers `cx`'s waker in `slot`. A different waker already there is woken, so that the task
/// it belongs to polls again and re-registers rather than sleeping forever.
fn register(slot: &mut Option<Waker>, cx: &Context<'_>) -> Option<Waker> {
    match slot {
        Some(waker) if waker.will_wake(cx.waker()) => None,
        _ => slot.replace(cx.waker().clone()),
    }
}

/// Puts `value` in the free slot after the queued ones (the caller checked there is one), and
/// returns the receiver's waker, to be woken once the lock is let go.
fn push<T>(state: &mut State<T>, value: T) -> Option<Waker> {
    let at = (state.head + state.len) % CAP;
    state.slots[at] = Some(value);
    state.len += 1;
    state.recv_waker.take()
}

/// A channel of [`CAP`] slots, with its one sender and one receiver.
pub fn channel<T>() -> (Sender<T>, Receiver<T>) {
    let shared = Arc::new(Shared(Mutex::new(State {
        slots: std::array::from_fn(|_| None),
        head: 0,
        len: 0,
        reserved: 0,
        sender_alive: true,
        receiver_alive: true,
        recv_waker: None,
        send_waker: None,
    })));
    (
        Sender {
            shared: shared.clone(),
        },
        Receiver { shared },
    )
}

/// The sending half. Not `Clone`: a channel has one sender.
pub struct Sender<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Sender<T> {
    /// Sends `value`, waiting for a free slot. Fails, giving `value` back, once the receiver is
    /// gone.
    pub async fn send(&self, value: T) -> Result<(), SendError<T>> {
        // Held here until a slot takes it: a `send` dropped while it waits keeps nothing.
        let mut value = Some(value);
        poll_fn(|cx| self.poll_send(cx, &mut value)).await
    }

    /// One lock for a send that finds room, where a reservation and then its permit took two.
    fn poll_send(&self, cx: &Context<'_>, value: &mut Option<T>) -> Poll<Result<(), SendError<T>>> {
        let mut state = self.shared.lock();
        // `value` is only taken on the way to `Ready`, which ends the future: it is there.
        let Some(v) = value.take() else {
            return Poll::Ready(Ok(()));
        };
        if !state.receiver_alive {
            return Poll::Ready(Err(SendError(v)));
        }
        if state.len + state.reserved < CAP {
            let waker = push(&mut state, v);
            drop(state);
            if let Some(waker) = waker {
                waker.wake();
            }
            return Poll::Ready(Ok(()));
        }
        *value = Some(v);
        let replaced = register(&mut state.send_waker, cx);
        drop(state);
        if let Some(waker) = replaced {
            waker.wake();
        }
        Poll::Pending
    }

    /// Waits for a free slot and holds it in a [`Permit`]. Fails once the receiver is gone.
    pub async fn reserve(&self) -> Result<Permit<'_, T>, SendError<()>> {
        poll_fn(|cx| self.poll_reserve(cx)).await
    }

    fn poll_reserve(&self, cx: &Context<'_>) -> Poll<Result<Permit<'_, T>, SendError<()>>> {
        let mut state = self.shared.lock();
        if !state.receiver_alive {
            return Poll::Ready(Err(SendError(())));
        }
        if state.len + state.reserved < CAP {
            state.reserved += 1;
            return Poll::Ready(Ok(Permit { sender: self }));
        }
        let replaced = register(&mut state.send_waker, cx);
        drop(state);
        if let Some(waker) = replaced {
            waker.wake();
        }
        Poll::Pending
    }

    /// A free slot now, if there is one.
    pub fn try_reserve(&self) -> Result<Permit<'_, T>, TrySendError<()>> {
        let mut state = self.shared.lock();
        if !state.receiver_alive {
            return Err(TrySendError::Closed(()));
        }
        if state.len + state.reserved < CAP {
            state.reserved += 1;
            return Ok(Permit { sender: self });
        }
        Err(TrySendError::Full(()))
    }

    /// Whether the receiver is gone: nothing sent from now on will be received.
    pub fn is_closed(&self) -> bool {
        !self.shared.lock().receiver_alive
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.sender_alive = false;
        let waker = state.recv_waker.take();
        drop(state);
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl<T> fmt::Debug for Sender<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sender").finish_non_exhaustive()
    }
}

/// A slot held for one send.
pub struct Permit<'a, T> {
    sender: &'a Sender<T>,
}

impl<T> Permit<'_, T> {
    /// Sends `value` into the slot held. If the receiver is gone by now, `value` is dropped, as
    /// a task the receiver left in the channel would be.
    pub fn send(self, value: T) {
        let sender = self.sender;
        // The slot is used (or gone with the receiver): this permit has nothing left to give
        // back, whatever happens below, so its `Drop` must not run.
        std::mem::forget(self);
        let mut state = sender.shared.lock();
        state.reserved -= 1;
        if !state.receiver_alive {
            drop(state);
            drop(value);
            return;
        }
        let waker = push(&mut state, value);
        drop(state);
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl<T> Drop for Permit<'_, T> {
    fn drop(&mut self) {
        let mut state = self.sender.shared.lock();
        state.reserved -= 1;
        let waker = state.send_waker.take();
        drop(state);
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl<T> fmt::Debug for Permit<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit").finish_non_exhaustive()
    }
}

/// The receiving half.
pub struct Receiver<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Receiver<T> {
    /// The next task, waiting for one; `None` once the sender is gone and every task it sent was
    /// received.
    pub async fn recv(&mut self) -> Option<T> {
        poll_fn(|cx| self.poll_recv(cx)).await
    }

    fn poll_recv(&mut self, cx: &Context<'_>) -> Poll<Option<T>> {
        let mut state = self.shared.lock();
        if state.len > 0 {
            let head = state.head;
            let value = state.slots[head].take();
            state.head = (head + 1) % CAP;
            state.len -= 1;
            let waker = state.send_waker.take();
            drop(state);
            if let Some(waker) = waker {
                waker.wake();
            }
            return Poll::Ready(value);
        }
        if !state.sender_alive {
            return Poll::Ready(None);
        }
        let replaced = register(&mut state.recv_waker, cx);
        drop(state);
        if let Some(waker) = replaced {
            waker.wake();
        }
        Poll::Pending
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.receiver_alive = false;
        // The tasks left are dropped outside the lock.
        let left = std::mem::replace(&mut state.slots, std::array::from_fn(|_| None));
        state.len = 0;
        let waker = state.send_waker.take();
        drop(state);
        drop(left);
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl<T> fmt::Debug for Receiver<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Receiver").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    /// A waker that counts its wake-ups.
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn counting() -> (Arc<Count>, Waker) {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        (count.clone(), Waker::from(count))
    }

    fn woken(count: &Count) -> usize {
        count.0.load(Ordering::SeqCst)
    }

    #[test]
    fn tasks_arrive_in_order_and_the_channel_holds_cap_of_them() {
        let (tx, mut rx) = channel::<usize>();
        let (count, waker) = counting();
        let cx = Context::from_waker(&waker);
        for round in 0..3 {
            for i in 0..CAP {
                tx.try_reserve().unwrap().send(round * 10 + i);
            }
            assert!(matches!(tx.try_reserve(), Err(TrySendError::Full(()))));
            assert!(tx.poll_reserve(&cx).is_pending());
            // A receive frees a slot and wakes the waiting sender.
            let before = woken(&count);
            assert_eq!(rx.poll_recv(&cx), Poll::Ready(Some(round * 10)));
            assert_eq!(woken(&count), before + 1);
            for i in 1..CAP {
                assert_eq!(rx.poll_recv(&cx), Poll::Ready(Some(round * 10 + i)));
            }
            assert!(rx.poll_recv(&cx).is_pending());
        }
    }

    #[test]
    fn a_permit_holds_its_slot_until_it_sends_or_is_dropped() {
        let (tx, mut rx) = channel::<u8>();
        let (count, waker) = counting();
        let cx = Context::from_waker(&waker);
        let permits: Vec<_> = (0..CAP).map(|_| tx.try_reserve().unwrap()).collect();
        assert!(matches!(tx.try_reserve(), Err(TrySendError::Full(()))));
        assert!(tx.poll_reserve(&cx).is_pending());
        let before = woken(&count);
        let mut permits = permits.into_iter();
        drop(permits.next());
        assert_eq!(woken(&count), before + 1, "a dropped permit frees its slot");
        assert!(rx.poll_recv(&cx).is_pending(), "and sends nothing");
        permits.next().unwrap().send(7);
        assert_eq!(rx.poll_recv(&cx), Poll::Ready(Some(7)));
        drop(permits);
        for _ in 0..CAP {
            drop(tx.try_reserve().unwrap());
        }
    }

    #[test]
    fn the_receiver_gets_what_was_sent_then_none_once_the_sender_is_gone() {
        let (tx, mut rx) = channel::<&str>();
        let (count, waker) = counting();
        let cx = Context::from_waker(&waker);
        assert!(rx.poll_recv(&cx).is_pending());
        tx.try_reserve().unwrap().send("a");
        assert_eq!(woken(&count), 1, "a send wakes the waiting receiver");
        tx.try_reserve().unwrap().send("b");
        drop(tx);
        assert_eq!(rx.poll_recv(&cx), Poll::Ready(Some("a")));
        assert_eq!(rx.poll_recv(&cx), Poll::Ready(Some("b")));
        assert_eq!(rx.poll_recv(&cx), Poll::Ready(None));
        assert_eq!(rx.poll_recv(&cx), Poll::Ready(None));

        // A sender dropped while the receiver waits wakes it.
        let (tx, mut rx) = channel::<()>();
        assert!(rx.poll_recv(&cx).is_pending());
        let before = woken(&count);
        drop(tx);
        assert_eq!(woken(&count), before + 1);
        assert_eq!(rx.poll_recv(&cx), Poll::Ready(None));
    }

    #[test]
    fn sends_fail_once_the_receiver_is_gone_and_what_it_left_is_dropped() {
        let dropped = Arc::new(AtomicUsize::new(0));
        struct Task(Arc<AtomicUsize>);
        impl Drop for Task {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let (tx, rx) = channel::<Task>();
        let (count, waker) = counting();
        let cx = Context::from_waker(&waker);
        for _ in 0..CAP {
            tx.try_reserve().unwrap().send(Task(dropped.clone()));
        }
        assert!(tx.poll_reserve(&cx).is_pending());
        assert!(!tx.is_closed());
        drop(rx);
        assert_eq!(woken(&count), 1, "the waiting sender is woken");
        assert_eq!(dropped.load(Ordering::SeqCst), CAP);
        assert!(tx.is_closed());
        assert!(matches!(
            tx.poll_reserve(&cx),
            Poll::Ready(Err(SendError(())))
        ));
        assert!(matches!(tx.try_reserve(), Err(TrySendError::Closed(()))));
    }

    #[test]
    fn a_send_waits_for_room_then_fails_with_its_value_once_the_receiver_is_gone() {
        let (tx, mut rx) = channel::<u32>();
        let (count, waker) = counting();
        let cx = Context::from_waker(&waker);
        for i in 0..CAP as u32 {
            let mut v = Some(i);
            assert!(matches!(tx.poll_send(&cx, &mut v), Poll::Ready(Ok(()))));
        }
        // Full: the send waits, keeping its value, until a receive makes room.
        let mut waiting = Some(99);
        assert!(tx.poll_send(&cx, &mut waiting).is_pending());
        assert_eq!(waiting, Some(99));
        let before = woken(&count);
        assert_eq!(rx.poll_recv(&cx), Poll::Ready(Some(0)));
        assert_eq!(woken(&count), before + 1);
        assert!(matches!(
            tx.poll_send(&cx, &mut waiting),
            Poll::Ready(Ok(()))
        ));
        // Full again; then the receiver goes, and the waiting send gets its value back.
        let mut last = Some(7);
        assert!(tx.poll_send(&cx, &mut last).is_pending());
        drop(rx);
        assert!(matches!(
            tx.poll_send(&cx, &mut last),
            Poll::Ready(Err(SendError(7)))
        ));
    }

    #[test]
    fn a_permit_taken_before_the_receiver_went_drops_its_task() {
        let (tx, rx) = channel::<Arc<()>>();
        let permit = tx.try_reserve().unwrap();
        drop(rx);
        let task = Arc::new(());
        permit.send(task.clone());
        assert_eq!(
            Arc::strong_count(&task),
            1,
            "the task was dropped, not kept"
        );
    }

    #[test]
    fn a_second_waiter_wakes_the_first_so_no_wake_up_is_lost() {
        let (tx, mut rx) = channel::<u8>();
        let (first, first_waker) = counting();
        let (second, second_waker) = counting();
        assert!(rx
            .poll_recv(&Context::from_waker(&first_waker))
            .is_pending());
        assert!(rx
            .poll_recv(&Context::from_waker(&second_waker))
            .is_pending());
        assert_eq!(woken(&first), 1, "the replaced waker is woken");
        tx.try_reserve().unwrap().send(1);
        assert_eq!(woken(&second), 1, "the registered one is woken by the send");
        // The same waker polling again registers nothing new and wakes nobody.
        let (third, third_waker) = counting();
        let (tx, mut rx) = channel::<u8>();
        let cx = Context::from_waker(&third_waker);
        assert!(rx.poll_recv(&cx).is_pending());
        assert!(rx.poll_recv(&cx).is_pending());
        assert_eq!(woken(&third), 0);
        drop(tx);
    }

    /// The channel against a `VecDeque` model, over many random operations on both halves,
    /// with permits held, used and dropped in between.
    #[test]
    fn random_operations_match_a_model() {
        use std::collections::VecDeque;
        let (_count, waker) = counting();
        let cx = Context::from_waker(&waker);
        let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..200 {
            let (tx, mut rx) = channel::<u64>();
            let mut model: VecDeque<u64> = VecDeque::new();
            let mut held: Vec<Permit<'_, u64>> = Vec::new();
            let mut sent = 0u64;
            for _ in 0..200 {
                match next() % 4 {
                    0 => {
                        let free = CAP - model.len() - held.len();
                        match tx.try_reserve() {
                            Ok(p) => {
                                assert!(free > 0);
                                held.push(p);
                            }
                            Err(TrySendError::Full(())) => assert_eq!(free, 0),
                            Err(TrySendError::Closed(())) => unreachable!(),
                        }
                    }
                    1 => {
                        if let Some(p) = held.pop() {
                            p.send(sent);
                            model.push_back(sent);
                            sent += 1;
                        }
                    }
                    2 => {
                        if !held.is_empty() {
                            let i = (next() as usize) % held.len();
                            drop(held.swap_remove(i));
                        }
                    }
                    _ => match rx.poll_recv(&cx) {
                        Poll::Ready(v) => assert_eq!(v, model.pop_front()),
                        Poll::Pending => assert!(model.is_empty()),
                    },
                }
            }
            drop(held);
            drop(tx);
            while let Some(v) = model.pop_front() {
                assert_eq!(rx.poll_recv(&cx), Poll::Ready(Some(v)));
            }
            assert_eq!(rx.poll_recv(&cx), Poll::Ready(None));
        }
    }

    #[test]
    fn two_tasks_stream_through_a_full_channel() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .build()
            .unwrap();
        runtime.block_on(async {
            let (tx, mut rx) = channel::<u32>();
            let sender = tokio::spawn(async move {
                for i in 0..10_000 {
                    tx.send(i).await.unwrap();
                }
            });
            for i in 0..10_000 {
                assert_eq!(rx.recv().await, Some(i));
            }
            assert_eq!(rx.recv().await, None);
            sender.await.unwrap();
        });
    }
}
