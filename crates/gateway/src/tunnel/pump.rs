//! Copying a tunnel's bytes both ways, with an idle timeout.

use std::future::{poll_fn, Future};
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use prometheus::IntCounter;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// `sluice_tunnel_bytes_total` of the tunnel's route, by direction.
pub(crate) struct Counters {
    pub(crate) up: IntCounter,
    pub(crate) down: IntCounter,
}

/// What a tunnel carried.
pub(crate) struct Pumped {
    /// Client to member.
    pub(crate) up: u64,
    /// Member to client.
    pub(crate) down: u64,
    /// Why it ended, when not by both sides closing: `idle_timeout` or `io_error`.
    pub(crate) ended: Option<&'static str>,
}

const BUF: usize = 32 * 1024;

/// Copies `client` ⇄ `member` until both directions have ended (an end of stream is passed on
/// as a half-close), either fails, or `idle` passes with no byte either way. `early_up` and
/// `early_down` were read before the tunnel opened and go first.
pub(super) async fn pump<C, M>(
    client: &mut C,
    member: M,
    early_up: &[u8],
    early_down: &[u8],
    idle: Duration,
    counters: &Counters,
) -> Pumped
where
    C: AsyncRead + AsyncWrite + Unpin,
    M: AsyncRead + AsyncWrite + Unpin,
{
    let start = Instant::now();
    // Milliseconds since `start` of the last byte either way.
    let last = AtomicU64::new(0);
    let up = AtomicU64::new(0);
    let down = AtomicU64::new(0);
    let (mut cr, mut cw) = tokio::io::split(client);
    let (mut mr, mut mw) = tokio::io::split(member);
    let both = async {
        tokio::try_join!(
            one_way(&mut cr, &mut mw, early_up, &up, &counters.up, &last, start),
            one_way(
                &mut mr,
                &mut cw,
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

async fn one_way<R, W>(
    from: &mut R,
    to: &mut W,
    early: &[u8],
    total: &AtomicU64,
    counter: &IntCounter,
    last: &AtomicU64,
    start: Instant,
) -> Result<(), &'static str>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    // Made when a read finds bytes and freed when one has to wait, so that an idle tunnel holds
    // no copy buffer (two per tunnel): a wait costs a free and an allocation from the
    // allocator's thread cache, not 32 KiB per direction for as long as the tunnel is open.
    let mut buf = BytesMut::new();
    let mut chunk: &[u8] = early;
    loop {
        if !chunk.is_empty() {
            to.write_all(chunk).await.map_err(|_| "io_error")?;
            to.flush().await.map_err(|_| "io_error")?;
            let n = chunk.len() as u64;
            total.fetch_add(n, Ordering::Relaxed);
            counter.inc_by(n);
            last.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
        }
        buf.clear();
        let n = poll_fn(|cx| {
            if buf.capacity() == 0 {
                buf = BytesMut::with_capacity(BUF);
            }
            let read = pin!(from.read_buf(&mut buf)).poll(cx);
            if read.is_pending() {
                buf = BytesMut::new();
            }
            read
        })
        .await
        .map_err(|_| "io_error")?;
        if n == 0 {
            // End of stream: pass it on as a half-close; the other way may go on.
            let _ = to.shutdown().await;
            return Ok(());
        }
        last.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
        chunk = &buf[..n];
    }
}
