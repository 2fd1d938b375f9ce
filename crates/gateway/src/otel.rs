//! Span export over OTLP: one server span per request, sent in batches to
//! `tracing.otlp.endpoint` (OTLP/HTTP, protobuf). Off by default.
//!
//! - With export off, a request pays one load of a `OnceLock` in [`sample`] and one in
//!   [`export`]: nothing else of this module runs.
//! - With it on, the sampling decision is made when the request starts ([`sample`]), so the
//!   `traceparent` the member gets carries it; a request that arrives with a valid
//!   `traceparent` follows the client's sampled flag. A sampled request's span is built when
//!   it ends and handed to the SDK's batch processor: a bounded queue (`max_queue`) that drops
//!   when full, drained by a thread of its own, so a slow or absent receiver never holds a
//!   request.
//! - Export is not silent when it fails: spans dropped at a full queue and spans whose export
//!   failed are counted ([`SPANS_DROPPED`], [`SPANS_FAILED`]), and failures are logged at most
//!   once every [`WARN_EVERY`]. At shutdown, what is queued gets [`SHUTDOWN_WAIT`] to go out:
//!   a dead receiver must not hold the exit.
//! - The span's ids are the ones the request's trace context already holds (its trace id,
//!   sluice's span id that the member got as parent id): the SDK makes its own, so the
//!   [`Ids`] generator hands it ours, through a thread-local set just before the span is built
//!   on the same thread.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{LazyLock, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, TraceContextExt as _, TraceFlags, TraceId,
    TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, IdGenerator, Sampler, SdkTracerProvider, SpanData,
    SpanExporter, Tracer,
};
use opentelemetry_sdk::Resource;
use prometheus::IntCounter;

use crate::config::OtlpConfig;
use crate::trace::TraceContext;

/// The process's exporter, when `tracing.otlp` is set.
static EXPORT: OnceLock<Export> = OnceLock::new();

struct Export {
    sample_ratio: f64,
    /// `tracing.otlp.max_queue`: spans handed to the SDK and not yet exported, at most.
    max_queue: usize,
    provider: SdkTracerProvider,
    tracer: Tracer,
}

/// How long one export may take (connect, send, answer) before the batch is given up.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the exit waits for queued spans to go out. A receiver that is down or slow would
/// otherwise hold the process for a whole export timeout after its requests are done.
const SHUTDOWN_WAIT: Duration = Duration::from_millis(800);

/// Failed exports are logged at most this often: a dead receiver fails every second.
const WARN_EVERY: Duration = Duration::from_secs(30);

/// `sluice_otlp_spans_dropped_total`: spans not exported because the queue was full.
pub static SPANS_DROPPED: LazyLock<IntCounter> = LazyLock::new(|| {
    IntCounter::new(
        "sluice_otlp_spans_dropped_total",
        "Spans not exported because the export queue (tracing.otlp.max_queue) was full.",
    )
    .expect("valid metric")
});

/// `sluice_otlp_spans_failed_total`: spans whose export to the receiver failed.
pub static SPANS_FAILED: LazyLock<IntCounter> = LazyLock::new(|| {
    IntCounter::new(
        "sluice_otlp_spans_failed_total",
        "Spans whose export to the OTLP receiver failed (unreachable, timed out, or refused).",
    )
    .expect("valid metric")
});

/// Spans handed to the SDK and not yet through an export. The SDK's queue drops silently
/// when full, so sluice keeps its own count and drops (and counts) first.
static QUEUED: AtomicUsize = AtomicUsize::new(0);

/// Starts the exporter for `config`. Called once, at start; no request waits for it.
pub fn start(config: &OtlpConfig) -> Result<(), String> {
    let endpoint = format!("{}/v1/traces", config.endpoint.trim_end_matches('/'));
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(EXPORT_TIMEOUT))
        .http_status_as_error(false)
        .build()
        .into();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(Ureq(agent))
        .with_endpoint(endpoint.clone())
        .with_timeout(EXPORT_TIMEOUT)
        .build()
        .map_err(|e| format!("cannot set up the OTLP exporter: {e}"))?;
    let exporter = Counted {
        inner: exporter,
        endpoint: crate::logging::redact(&endpoint).into_owned(),
        last_warning: AtomicU64::new(u64::MAX),
        failed_since_warning: AtomicU64::new(0),
        started: Instant::now(),
    };
    let queue = config.max_queue.get() as usize;
    let processor = BatchSpanProcessor::builder(exporter)
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_max_queue_size(queue)
                .with_max_export_batch_size(queue.min(512))
                .with_scheduled_delay(Duration::from_secs(1))
                .build(),
        )
        .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        // The decision was made at the request's start (`sample`); what reaches the SDK is
        // exported.
        .with_sampler(Sampler::AlwaysOn)
        .with_id_generator(Ids)
        .with_resource(
            Resource::builder_empty()
                .with_service_name(config.service_name.clone())
                .build(),
        )
        .build();
    let tracer = provider.tracer("sluice");
    EXPORT
        .set(Export {
            sample_ratio: config.sample_ratio,
            max_queue: queue,
            provider,
            tracer,
        })
        .map_err(|_| "the OTLP exporter is already running".to_string())
}

/// Sends what is queued, waiting at most [`SHUTDOWN_WAIT`] (about a second); call before the
/// process exits. What has not gone out by then is left behind.
pub fn flush() {
    let Some(e) = EXPORT.get() else {
        return;
    };
    // On a thread of its own, so that no wait inside the SDK or the HTTP client can outlast
    // the bound.
    let (done_tx, done) = std::sync::mpsc::channel();
    let provider = e.provider.clone();
    let spawned = std::thread::Builder::new()
        .name("sluice-otlp-flush".into())
        .spawn(move || {
            let _ = provider.shutdown_with_timeout(SHUTDOWN_WAIT);
            let _ = done_tx.send(());
        });
    if spawned.is_ok() {
        let _ = done.recv_timeout(SHUTDOWN_WAIT + Duration::from_millis(100));
    }
}

/// Whether a request that starts a new trace is sampled: never with export off, else with
/// probability `tracing.otlp.sample_ratio`.
pub fn sample() -> bool {
    EXPORT
        .get()
        .is_some_and(|e| e.sample_ratio >= 1.0 || fastrand::f64() < e.sample_ratio)
}

/// Whether spans are exported at all.
pub fn enabled() -> bool {
    EXPORT.get().is_some()
}

/// What a finished request's span says. No header value, no query: the same rule as the
/// access log.
pub struct Finished<'a> {
    pub trace: TraceContext,
    pub started: SystemTime,
    pub method: &'a str,
    pub route: &'a str,
    pub authority: &'a str,
    pub path: &'a str,
    pub member: &'a str,
    pub status: u16,
    pub attempts: u32,
    pub error: Option<&'a str>,
    pub request_id: Option<&'a str>,
}

/// Exports the span of a finished request, if export is on and its trace is sampled.
pub fn export(f: &Finished<'_>) {
    let Some(e) = EXPORT.get() else {
        return;
    };
    if !f.trace.sampled() {
        return;
    }
    let queued = QUEUED.fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
        (n < e.max_queue).then_some(n + 1)
    });
    if queued.is_err() {
        SPANS_DROPPED.inc();
        return;
    }
    let trace_id = TraceId::from_bytes(f.trace.trace_id);
    let parent = match f.trace.parent_id {
        Some(parent) => Context::new().with_remote_span_context(SpanContext::new(
            trace_id,
            SpanId::from_bytes(parent),
            TraceFlags::new(f.trace.flags),
            true,
            TraceState::default(),
        )),
        None => Context::new(),
    };
    let mut attributes = Vec::with_capacity(10);
    attributes.push(KeyValue::new("http.request.method", f.method.to_string()));
    attributes.push(KeyValue::new("http.route", f.route.to_string()));
    attributes.push(KeyValue::new("server.address", f.authority.to_string()));
    attributes.push(KeyValue::new("url.path", f.path.to_string()));
    attributes.push(KeyValue::new(
        "http.response.status_code",
        i64::from(f.status),
    ));
    attributes.push(KeyValue::new("sluice.attempts", i64::from(f.attempts)));
    if !f.member.is_empty() {
        attributes.push(KeyValue::new("sluice.member", f.member.to_string()));
    }
    if let Some(error) = f.error {
        attributes.push(KeyValue::new("error.type", error.to_string()));
    }
    if let Some(id) = f.request_id {
        attributes.push(KeyValue::new("sluice.request_id", id.to_string()));
    }
    let builder = e
        .tracer
        .span_builder(format!("{} {}", f.method, f.route))
        .with_kind(SpanKind::Server)
        .with_start_time(f.started)
        .with_attributes(attributes);
    NEXT.set(Some((f.trace.trace_id, f.trace.span_id)));
    let mut span = builder.start_with_context(&e.tracer, &parent);
    NEXT.set(None);
    if f.status >= 500 || f.status == 0 {
        span.set_status(opentelemetry::trace::Status::error(
            f.error.unwrap_or("error").to_string(),
        ));
    }
    span.end();
}

thread_local! {
    /// The ids of the span about to be built on this thread ([`Ids`]).
    static NEXT: Cell<Option<([u8; 16], [u8; 8])>> = const { Cell::new(None) };
}

/// The SDK's id generator, handing out the ids of the request whose span is being built
/// (random ones should the SDK ask at another time).
#[derive(Debug)]
struct Ids;

impl IdGenerator for Ids {
    fn new_trace_id(&self) -> TraceId {
        match NEXT.get() {
            Some((trace, _)) => TraceId::from_bytes(trace),
            None => TraceId::from(fastrand::u128(1..)),
        }
    }

    fn new_span_id(&self) -> SpanId {
        match NEXT.get() {
            Some((_, span)) => SpanId::from_bytes(span),
            None => SpanId::from(fastrand::u64(1..)),
        }
    }
}

/// The OTLP exporter, counting what it failed to send and saying so in the log, at a bounded
/// rate: the SDK itself drops a failed batch without a word.
#[derive(Debug)]
struct Counted<E> {
    inner: E,
    /// Where spans go, for the warning (with any credentials redacted).
    endpoint: String,
    /// When a failure was last logged, in seconds since `started`.
    last_warning: AtomicU64,
    failed_since_warning: AtomicU64,
    started: Instant,
}

impl<E: SpanExporter> SpanExporter for Counted<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len();
        let result = self.inner.export(batch).await;
        QUEUED.fetch_sub(spans, Ordering::AcqRel);
        if let Err(error) = &result {
            SPANS_FAILED.inc_by(spans as u64);
            let failed = self
                .failed_since_warning
                .fetch_add(spans as u64, Ordering::Relaxed)
                + spans as u64;
            let now = self.started.elapsed().as_secs();
            let last = self.last_warning.load(Ordering::Relaxed);
            if last == u64::MAX || now.saturating_sub(last) >= WARN_EVERY.as_secs() {
                self.last_warning.store(now, Ordering::Relaxed);
                self.failed_since_warning.store(0, Ordering::Relaxed);
                let error = error.to_string();
                tracing::warn!(
                    target: "sluice::otel",
                    endpoint = %self.endpoint,
                    error = %crate::logging::redact(&error),
                    spans_failed = failed,
                    "span export to the OTLP receiver failed; its spans are dropped (logged at most every 30 s, counted in sluice_otlp_spans_failed_total)"
                );
            }
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP exporter's HTTP client: ureq, blocking, which suits the batch processor's own
/// thread (it runs each export to completion there).
#[derive(Debug)]
struct Ureq(ureq::Agent);

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for Ureq {
    async fn send_bytes(
        &self,
        request: http::Request<bytes::Bytes>,
    ) -> Result<http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        let (parts, body) = request.into_parts();
        let mut response = self.0.run(http::Request::from_parts(parts, &body[..]))?;
        let status = response.status();
        let body = response
            .body_mut()
            .with_config()
            .limit(1 << 20)
            .read_to_vec()?;
        Ok(http::Response::builder()
            .status(status)
            .body(bytes::Bytes::from(body))?)
    }
}
