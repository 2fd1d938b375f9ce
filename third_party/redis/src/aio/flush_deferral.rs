// PATCH (sluice, one write per runtime turn): this whole file.
//
// A multiplexed connection's driver task is woken by each command sent to it. On Tokio's
// multi-thread runtime the task a running task wakes goes into the "LIFO slot" and runs right
// after it, so the driver took one command at a time and wrote each in a system call of its
// own, even when the next ready tasks were about to send more. A `FlushDeferral` holds the
// flush back until the runtime has run out of ready tasks (or reaches its periodic driver
// check, every `event_interval` polls), through the same deferred wake-up that
// `tokio::task::yield_now` uses: the commands sent in one turn of the runtime then leave in one
// write, as NGINX and Redis itself batch what one turn of their event loop produced.
//
// When there is nothing else to run, the cost is one extra poll of the I/O driver (a
// non-blocking epoll_wait) before the write. Outside a Tokio runtime the deferral fires at
// once, so the connection behaves as before.
//
// The price is latency: a command waits for every other ready task to run as far as it can.
// Below saturation there is little to write together, and a command that arrives in a burst
// still waits behind it, so `set_flush_deferral` lets the application turn the wait off while
// its runtime is mostly idle (and on again under load); it is on until then.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

/// Whether flushes wait for the end of the runtime's turn, for every multiplexed connection of
/// the process.
static DEFERRING: AtomicBool = AtomicBool::new(true);

/// Turns the wait for the end of the runtime's turn before a write on (the default) or off, for
/// every multiplexed connection of the process. Off, commands are written as soon as the
/// connection's driver runs, one write per wake-up, as released: the better choice while the
/// runtime is mostly idle, when there is little to write together and a wait only adds latency.
/// A deferral already under way is not cut short.
pub fn set_flush_deferral(on: bool) {
    DEFERRING.store(on, Ordering::Relaxed);
}

/// One connection's flush deferral: at most one is outstanding at a time.
pub(crate) struct FlushDeferral {
    shared: Arc<Shared>,
    waiting: bool,
}

struct Shared {
    fired: AtomicBool,
    task: AtomicWaker,
}

impl Wake for Shared {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.fired.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl FlushDeferral {
    pub(crate) fn new() -> Self {
        Self {
            shared: Arc::new(Shared {
                fired: AtomicBool::new(false),
                task: AtomicWaker::new(),
            }),
            waiting: false,
        }
    }

    /// Ready when a flush may go ahead: the first call after writes starts a deferral and is
    /// pending; later calls are pending until the runtime has fired it. Every call leaves the
    /// task registered to be woken when it fires.
    pub(crate) fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.waiting {
            self.shared.task.register(cx.waker());
            if self.shared.fired.load(Ordering::Acquire) {
                self.waiting = false;
                return Poll::Ready(());
            }
            return Poll::Pending;
        }
        if !DEFERRING.load(Ordering::Relaxed) {
            return Poll::Ready(());
        }
        self.shared.fired.store(false, Ordering::Relaxed);
        self.shared.task.register(cx.waker());
        self.waiting = true;
        defer(Waker::from(self.shared.clone()));
        if self.shared.fired.load(Ordering::Acquire) {
            // Fired at once: not on a Tokio runtime.
            self.waiting = false;
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

/// Hands `waker` to the scheduler's deferred list. `yield_now` does that with the waker of the
/// context it is polled with, and is pending on its first poll. Polled with our own waker, it
/// tells us when the scheduler got to it, whatever else woke the driver meanwhile.
#[cfg(feature = "tokio-comp")]
fn defer(waker: Waker) {
    let mut deferred = Context::from_waker(&waker);
    let yielded = std::pin::pin!(::tokio::task::yield_now());
    let _ = yielded.poll(&mut deferred);
}

/// Without Tokio's scheduler there is no deferred wake-up to wait for.
#[cfg(not(feature = "tokio-comp"))]
fn defer(waker: Waker) {
    waker.wake();
}
