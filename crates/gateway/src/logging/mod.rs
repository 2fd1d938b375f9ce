//! Logs: one JSON object per line on stderr (access log and events), or text for humans.
//!
//! Lines go through a background writer so that a request never waits on a write to stderr
//! ([`writer`]). The access line, one per request, is written by hand into a reused buffer
//! ([`access`]); tracing writes the other events. Pingora's own lines pass through
//! [`redact`] on their way in.

mod access;
mod redact;
mod writer;

use std::sync::OnceLock;

use tracing_subscriber::EnvFilter;

pub use access::{access, set_log_query, AccessLine, EachName, MAX_USER_AGENT};
pub use redact::{redact, REDACTED};
pub use writer::LINES_DROPPED;

use writer::{Batch, Ordered};

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One JSON object per line.
    Json,
    /// Human-readable text.
    Text,
}

/// Where access lines go: the batch in front of the background writer, and the format.
static ACCESS: OnceLock<(&'static Batch, LogFormat)> = OnceLock::new();

/// Installs the global subscriber. `RUST_LOG` overrides the default filter, which keeps
/// Pingora's own chatter to warnings.
pub fn init(format: LogFormat) {
    let batch = Batch::start();
    let _ = ACCESS.set((batch, format));
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        EnvFilter::new("info,pingora=warn,pingora_core=warn,pingora_proxy=warn")
    });
    let max_level = filter.max_level_hint();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(Ordered(batch));
    let installed = match format {
        LogFormat::Json => tracing::subscriber::set_global_default(
            builder
                .json()
                .flatten_event(true)
                .with_current_span(false)
                .finish(),
        ),
        LogFormat::Text => {
            tracing::subscriber::set_global_default(builder.with_ansi(false).finish())
        }
    };
    if installed.is_ok() {
        // Pingora logs through the `log` crate: its lines reach tracing through
        // [`redact::Redacting`], never as they are.
        let level = match max_level {
            Some(l) if l == tracing::level_filters::LevelFilter::OFF => log::LevelFilter::Off,
            Some(l) if l == tracing::level_filters::LevelFilter::ERROR => log::LevelFilter::Error,
            Some(l) if l == tracing::level_filters::LevelFilter::WARN => log::LevelFilter::Warn,
            Some(l) if l == tracing::level_filters::LevelFilter::INFO => log::LevelFilter::Info,
            Some(l) if l == tracing::level_filters::LevelFilter::DEBUG => log::LevelFilter::Debug,
            _ => log::LevelFilter::Trace,
        };
        if log::set_boxed_logger(Box::new(redact::Redacting(tracing_log::LogTracer::new()))).is_ok()
        {
            log::set_max_level(level);
        }
    }
}

/// Writes out buffered lines; call before exiting the process. Waits at most a couple of
/// seconds for stderr, so that an exit never hangs on a stuck reader.
pub fn flush() {
    if let Some((batch, _)) = ACCESS.get() {
        batch.flush_and_wait();
    }
}
