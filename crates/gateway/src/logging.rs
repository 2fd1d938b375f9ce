//! Logs: one JSON object per line on stderr (access log and events), or text for humans.
//!
//! Lines go through a background writer so that a request never waits on a write to stderr.

use std::sync::Mutex;

use tracing_appender::non_blocking::WorkerGuard;
use tracing_subscriber::EnvFilter;

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One JSON object per line.
    Json,
    /// Human-readable text.
    Text,
}

static GUARD: Mutex<Option<WorkerGuard>> = Mutex::new(None);

/// Installs the global subscriber. `RUST_LOG` overrides the default filter, which keeps
/// Pingora's own chatter to warnings.
pub fn init(format: LogFormat) {
    let (writer, guard) = tracing_appender::non_blocking(std::io::stderr());
    *GUARD.lock().unwrap_or_else(|p| p.into_inner()) = Some(guard);
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        EnvFilter::new("info,pingora=warn,pingora_core=warn,pingora_proxy=warn")
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    match format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .init(),
        LogFormat::Text => builder.with_ansi(false).init(),
    }
}

/// Writes out buffered lines; call before exiting the process.
pub fn flush() {
    GUARD.lock().unwrap_or_else(|p| p.into_inner()).take();
}
