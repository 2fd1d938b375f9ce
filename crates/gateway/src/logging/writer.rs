//! The background writer: lines reach stderr from a thread of their own, so that a request
//! never waits on a write to stderr, and lines stderr does not take in time are dropped and
//! counted rather than held.
//!
//! Access lines, one per request, are first gathered into a batch that reaches the writer
//! in one piece (see [`Batch`]): no queue message, allocation or thread wake-up per request.
//! The batch's buffer itself goes to the writer, which hands it back once written, so a line
//! is copied once, into the batch.

use std::collections::VecDeque;
use std::io::Write as _;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tracing_subscriber::fmt::MakeWriter;

/// A batch is handed to the writer once it holds this many bytes (about a hundred lines)...
const BATCH_BYTES: usize = 32 * 1024;
/// ...or at the latest this long after its first line, by the batch's flusher thread.
const BATCH_DELAY: Duration = Duration::from_millis(20);
/// Batches waiting for stderr beyond this many (4 MiB) are dropped rather than held: a
/// stderr that does not drain must not grow the gateway's memory or make requests wait.
const MAX_QUEUED_BATCHES: usize = 128;
/// How long [`super::flush`] waits at exit for stderr to take what is queued.
const FLUSH_WAIT: Duration = Duration::from_secs(2);

/// `sluice_log_lines_dropped_total`: log lines (access lines and events) dropped because
/// stderr did not take them fast enough. One per process, as the log writer is; every
/// gateway's registry exports it (`Metrics::new`).
pub static LINES_DROPPED: std::sync::LazyLock<prometheus::IntCounter> = std::sync::LazyLock::new(
    || {
        prometheus::IntCounter::new(
            "sluice_log_lines_dropped_total",
            "Log lines (access lines and events) dropped because stderr did not take them fast enough.",
        )
        .expect("valid metric")
    },
);

/// Access lines waiting for the background writer.
///
/// Sending each line on its own cost a copy into a new `Vec`, a message on the writer's queue
/// and, whenever the writer thread had gone idle, a futex wake-up: per request. Lines now
/// gather here and go to the writer as one batch, handed over by whoever fills it, or by
/// the flusher thread [`BATCH_DELAY`] after the first line of a quiet moment, or by
/// [`super::flush`] at exit. The one lock is held only to append a finished line or to hand the
/// batch over. A tracing event (a warning, a reload) is appended under the same lock and
/// hands the batch over at once, so lines keep the order in which they were written and an
/// event is not held back.
pub(super) struct Batch {
    writer: Writer,
    pending: Mutex<Pending>,
    /// Wakes the flusher when the first line of a batch arrives while it waits.
    arrived: Condvar,
}

struct Pending {
    bytes: Vec<u8>,
    /// The flusher waits for a first line (rather than sleeping out a delay).
    flusher_waiting: bool,
}

impl Batch {
    /// A batch for the life of the process, with its writer and flusher threads started.
    pub(super) fn start() -> &'static Batch {
        let batch: &'static Batch = Box::leak(Box::new(Batch {
            writer: Writer {
                queue: Mutex::new(Queue::default()),
                wake: Condvar::new(),
                drained: Condvar::new(),
            },
            pending: Mutex::new(Pending {
                bytes: Vec::with_capacity(BATCH_BYTES + 1024),
                flusher_waiting: false,
            }),
            arrived: Condvar::new(),
        }));
        let _ = std::thread::Builder::new()
            .name("sluice-log-write".into())
            .spawn(move || batch.writer.run());
        let _ = std::thread::Builder::new()
            .name("sluice-log-batch".into())
            .spawn(move || batch.run_flusher());
        batch
    }

    fn lock(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends a finished access line.
    pub(super) fn push(&self, line: &[u8]) {
        let mut p = self.lock();
        p.bytes.extend_from_slice(line);
        if p.bytes.len() >= BATCH_BYTES {
            self.hand_over(&mut p);
        } else if p.flusher_waiting {
            p.flusher_waiting = false;
            self.arrived.notify_one();
        }
    }

    /// A tracing event's line: written now, after the access lines before it.
    fn push_event(&self, line: &[u8]) {
        let mut p = self.lock();
        p.bytes.extend_from_slice(line);
        self.hand_over(&mut p);
    }

    /// Sends the batch to the writer; the caller holds the lock, which keeps the order.
    fn hand_over(&self, p: &mut Pending) {
        if !p.bytes.is_empty() {
            self.writer.send(&mut p.bytes);
        }
    }

    fn flush(&self) {
        self.hand_over(&mut self.lock());
    }

    /// Hands the batch over and waits at most [`FLUSH_WAIT`] for stderr to take what is
    /// queued, so that an exit never hangs on a stuck reader.
    pub(super) fn flush_and_wait(&self) {
        self.flush();
        self.writer.wait_drained(FLUSH_WAIT);
    }

    /// The flusher thread: hands a batch over [`BATCH_DELAY`] after its first line.
    fn run_flusher(&self) {
        loop {
            {
                let mut p = self.lock();
                while p.bytes.is_empty() {
                    p.flusher_waiting = true;
                    p = self.arrived.wait(p).unwrap_or_else(|e| e.into_inner());
                }
                p.flusher_waiting = false;
            }
            std::thread::sleep(BATCH_DELAY);
            self.flush();
        }
    }
}

/// The background writer: a thread that writes whole batches to stderr.
///
/// A batch's buffer is moved to the writer and comes back empty, with its capacity, for a
/// later batch. tracing-appender's writer, used before, copied each batch into a new `Vec`
/// for its queue and then into its `BufWriter`: two copies of every access line.
struct Writer {
    queue: Mutex<Queue>,
    /// Wakes the writer thread when a batch arrives.
    wake: Condvar,
    /// Tells [`Batch::flush_and_wait`] that everything queued was written.
    drained: Condvar,
}

#[derive(Default)]
struct Queue {
    full: VecDeque<Vec<u8>>,
    /// Written buffers, emptied, kept for the next batches.
    spare: Vec<Vec<u8>>,
    /// The writer thread holds a batch it has not finished writing.
    writing: bool,
}

impl Writer {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues the bytes of `batch` and leaves it empty (a spare buffer in its place).
    fn send(&self, batch: &mut Vec<u8>) {
        let mut q = self.lock();
        if q.full.len() >= MAX_QUEUED_BATCHES {
            // A full queue drops the batch rather than making a request wait; counted, since
            // a gap in the access log must not pass unnoticed.
            let lines = batch.iter().filter(|&&b| b == b'\n').count();
            LINES_DROPPED.inc_by(lines as u64);
            batch.clear();
            return;
        }
        // No spare (the writer is behind): an empty `Vec`, which grows as lines arrive, so
        // that a burst of events costs no allocation of a whole batch each.
        let fresh = q.spare.pop().unwrap_or_default();
        q.full.push_back(std::mem::replace(batch, fresh));
        self.wake.notify_one();
    }

    fn run(&self) {
        let mut stderr = std::io::stderr();
        let mut q = self.lock();
        loop {
            let Some(mut batch) = q.full.pop_front() else {
                q.writing = false;
                self.drained.notify_all();
                q = self.wake.wait(q).unwrap_or_else(|e| e.into_inner());
                continue;
            };
            q.writing = true;
            drop(q);
            // Nothing to do about a failed write to stderr; the batch is gone either way.
            let _ = stderr.write_all(&batch);
            batch.clear();
            q = self.lock();
            if q.spare.len() < 2 {
                q.spare.push(batch);
            }
        }
    }

    /// Waits, at most `limit`, until everything queued was written.
    fn wait_drained(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let mut q = self.lock();
        while !q.full.is_empty() || q.writing {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            q = self
                .drained
                .wait_timeout(q, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// The writer tracing's events go through, behind the access lines before them.
pub(super) struct Ordered(pub(super) &'static Batch);

impl<'a> MakeWriter<'a> for Ordered {
    type Writer = EventWriter;

    fn make_writer(&'a self) -> EventWriter {
        EventWriter(self.0)
    }
}

pub(super) struct EventWriter(&'static Batch);

impl std::io::Write for EventWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.push_event(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
