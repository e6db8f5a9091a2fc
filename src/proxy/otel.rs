//! The OpenTelemetry export pipeline of a `kvmesh serve` process: a tracer provider whose batch
//! processor posts spans as OTLP/HTTP protobuf to the configured collector, and the
//! `tracing-opentelemetry` layer that turns the request spans (`trace_span.rs`) into
//! OpenTelemetry spans.
//!
//! Exists so that export can never slow or block the request path. Ending a span only queues it
//! (a bounded gate in front of the SDK's batch processor: past `tracing.max_queue_spans` spans
//! waiting for export, a span is dropped and counted in `kvmesh_trace_spans_dropped_total`).
//! The batch processor exports from its own thread with reqwest's blocking client — the same
//! reqwest 0.13 and rustls the node already uses, no gRPC stack — so a slow collector costs
//! that thread its time, never a runtime worker. [`Pipeline::shutdown`] flushes what is queued.
//!
//! The pipeline is process-wide (a `tracing` layer lives in the global subscriber); a node
//! traces its requests only when its own `[tracing]` is on *and* a pipeline is installed, so
//! several in-process nodes (tests, fleets) each keep their own setting.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use opentelemetry::trace::TracerProvider as _;
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider, Span, SpanData,
    SpanExporter, SpanProcessor,
};
use opentelemetry_sdk::Resource;
use prometheus::IntCounter;
use tracing::{Level, Subscriber};
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

use crate::node::config::TracingConfig;

/// The `tracing` target of the request spans: the only spans the OpenTelemetry layer exports.
pub const TARGET: &str = "kvmesh::otel";

/// A failing collector is logged at most this often (every failure is counted).
const FAILURE_WARN_EVERY: Duration = Duration::from_secs(10);

/// Extra time [`Pipeline::shutdown`] allows beyond one export's timeout for the final flush.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

/// Set while a pipeline is installed in this process.
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The export counters, shared by every node of the process that traces.
static STATS: OnceLock<ExportStats> = OnceLock::new();

/// Whether a pipeline is installed in this process (checked per request by tracing nodes).
pub fn installed() -> bool {
    INSTALLED.load(Ordering::Relaxed)
}

/// Spans exported, dropped and refused, process-wide; each tracing node registers them in its
/// `/metrics` registry.
#[derive(Clone, Debug)]
pub struct ExportStats {
    /// `kvmesh_trace_spans_exported_total`: spans the collector accepted.
    pub exported: IntCounter,
    /// `kvmesh_trace_spans_dropped_total`: spans dropped because the export queue was full.
    pub dropped: IntCounter,
    /// `kvmesh_trace_spans_failed_total`: spans in batches whose export failed (collector down,
    /// refused, timed out).
    pub failed: IntCounter,
}

/// The process's export counters (created on first use).
pub fn stats() -> Result<&'static ExportStats, prometheus::Error> {
    if let Some(s) = STATS.get() {
        return Ok(s);
    }
    let made = ExportStats {
        exported: IntCounter::new(
            "kvmesh_trace_spans_exported_total",
            "Spans the OTLP collector accepted.",
        )?,
        dropped: IntCounter::new(
            "kvmesh_trace_spans_dropped_total",
            "Spans dropped because the trace export queue was full.",
        )?,
        failed: IntCounter::new(
            "kvmesh_trace_spans_failed_total",
            "Spans in export batches that failed (collector down, refused or too slow).",
        )?,
    };
    // A racing first caller may have won: both keep the one stored.
    Ok(STATS.get_or_init(|| made))
}

/// Why the pipeline could not start.
#[derive(Debug, thiserror::Error)]
pub enum OtelError {
    /// The OTLP exporter refused its configuration.
    #[error("cannot build the OTLP/HTTP trace exporter for {url}: {source}")]
    Exporter {
        /// The traces URL.
        url: String,
        /// The exporter's reason.
        source: opentelemetry_otlp::ExporterBuildError,
    },
    /// The export counters could not be created.
    #[error("cannot create the trace export metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// An installed export pipeline; [`Pipeline::shutdown`] flushes and stops it.
#[derive(Debug)]
pub struct Pipeline {
    provider: SdkTracerProvider,
    export_timeout: Duration,
}

impl Pipeline {
    /// Builds the pipeline `cfg` describes, or `None` when tracing is off. Marks tracing
    /// installed for this process; add [`Pipeline::layer`] to the global subscriber.
    pub fn start(cfg: &TracingConfig) -> Result<Option<Pipeline>, OtelError> {
        let Some(url) = cfg.traces_url() else {
            return Ok(None);
        };
        // reqwest is built without a rustls provider: the exporter's client needs one (one
        // already installed is fine).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let export_timeout = Duration::from_millis(cfg.export_timeout_ms);
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(url.clone())
            .with_timeout(export_timeout)
            .build()
            .map_err(|source| OtelError::Exporter {
                url: url.clone(),
                source,
            })?;
        let stats = stats()?.clone();
        let queued = Arc::new(AtomicUsize::new(0));
        let batch = BatchConfigBuilder::default()
            .with_max_queue_size(cfg.max_queue_spans)
            .with_max_export_batch_size(cfg.max_export_batch_spans)
            .with_scheduled_delay(Duration::from_millis(cfg.schedule_delay_ms))
            .build();
        let processor =
            BatchSpanProcessor::builder(Counted::new(exporter, Arc::clone(&queued), stats.clone()))
                .with_batch_config(batch)
                .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(Gate {
                inner: processor,
                queued,
                max: cfg.max_queue_spans,
                stats,
            })
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                cfg.sample_ratio,
            ))))
            .with_resource(
                Resource::builder()
                    .with_service_name(cfg.service_name.clone())
                    .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
                    .build(),
            )
            .build();
        INSTALLED.store(true, Ordering::Relaxed);
        Ok(Some(Pipeline {
            provider,
            export_timeout,
        }))
    }

    /// The `tracing` layer for the global subscriber: it exports the request spans (target
    /// [`TARGET`]) and attaches info-and-above events inside them (an attempt that failed, a
    /// stream cut) as span events. Nothing else reaches it.
    pub fn layer<S>(&self) -> impl Layer<S>
    where
        S: Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
    {
        tracing_opentelemetry::layer()
            .with_tracer(self.provider.tracer("kvmesh"))
            // Lean spans: no code location, thread, level or busy/idle timings as attributes,
            // and no OpenTelemetry context attached at every poll of the request future.
            .with_location(false)
            .with_threads(false)
            .with_level(false)
            .with_target(false)
            .with_tracked_inactivity(false)
            .with_context_activation(false)
            .with_filter(filter_fn(|meta| {
                if meta.is_span() {
                    meta.target() == TARGET
                } else {
                    *meta.level() <= Level::INFO
                }
            }))
    }

    /// Exports what is queued (within the export timeout and a second) and stops the export
    /// thread. Blocks: call it outside async code (`tokio::task::spawn_blocking`).
    pub fn shutdown(self) {
        INSTALLED.store(false, Ordering::Relaxed);
        if let Err(e) = self
            .provider
            .shutdown_with_timeout(self.export_timeout + SHUTDOWN_GRACE)
        {
            tracing::warn!(error = %e, "trace export did not shut down cleanly");
        }
    }
}

/// The bounded queue in front of the batch processor: admits a span only while fewer than
/// `max` are waiting for export (released by [`Counted`] once their batch is done), so the
/// processor's own queue never overflows and every drop is counted here.
#[derive(Debug)]
struct Gate<P> {
    inner: P,
    queued: Arc<AtomicUsize>,
    max: usize,
    stats: ExportStats,
}

impl<P: SpanProcessor> SpanProcessor for Gate<P> {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.queued.fetch_add(1, Ordering::AcqRel) >= self.max {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            self.stats.dropped.inc();
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP exporter, counting what it exported or failed and releasing the [`Gate`]'s slots.
#[derive(Debug)]
struct Counted<E> {
    inner: E,
    queued: Arc<AtomicUsize>,
    stats: ExportStats,
    /// When the exporter was built (the clock of `warned_at_s`).
    started: Instant,
    /// Seconds after `started` of the last failure warning; 0 = none yet.
    warned_at_s: AtomicU64,
}

impl<E> Counted<E> {
    fn new(inner: E, queued: Arc<AtomicUsize>, stats: ExportStats) -> Self {
        Counted {
            inner,
            queued,
            stats,
            started: Instant::now(),
            warned_at_s: AtomicU64::new(0),
        }
    }
}

impl<E: SpanExporter> SpanExporter for Counted<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len();
        let result = self.inner.export(batch).await;
        self.queued.fetch_sub(n, Ordering::AcqRel);
        match &result {
            Ok(()) => self.stats.exported.inc_by(n as u64),
            Err(e) => {
                self.stats.failed.inc_by(n as u64);
                // Counted every time; told at most once per `FAILURE_WARN_EVERY`.
                let now = self.started.elapsed().as_secs();
                let last = self.warned_at_s.load(Ordering::Relaxed);
                if last == 0 || now >= last + FAILURE_WARN_EVERY.as_secs() {
                    self.warned_at_s.store(now.max(1), Ordering::Relaxed);
                    tracing::warn!(error = %e, spans = n, "trace export failed");
                }
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

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use opentelemetry::trace::{Tracer as _, TracerProvider as _};

    use super::*;

    /// Holds what it is given, as the batch processor's queue would.
    #[derive(Debug, Default)]
    struct Held(Arc<Mutex<Vec<SpanData>>>);

    impl SpanProcessor for Held {
        fn on_start(&self, _: &mut Span, _: &Context) {}
        fn on_end(&self, span: SpanData) {
            if let Ok(mut v) = self.0.lock() {
                v.push(span);
            }
        }
        fn force_flush(&self) -> OTelSdkResult {
            Ok(())
        }
        fn shutdown_with_timeout(&self, _: Duration) -> OTelSdkResult {
            Ok(())
        }
    }

    /// Accepts or refuses every batch.
    #[derive(Debug)]
    struct Collector(bool);

    impl SpanExporter for Collector {
        async fn export(&self, _: Vec<SpanData>) -> OTelSdkResult {
            if self.0 {
                Ok(())
            } else {
                Err(opentelemetry_sdk::error::OTelSdkError::InternalFailure(
                    "refused".into(),
                ))
            }
        }
    }

    fn fresh_stats() -> ExportStats {
        let c = |n: &str| IntCounter::new(n, "test").unwrap();
        ExportStats {
            exported: c("exported"),
            dropped: c("dropped"),
            failed: c("failed"),
        }
    }

    #[test]
    fn a_full_queue_drops_and_counts_until_an_export_frees_it() {
        let stats = fresh_stats();
        let queued = Arc::new(AtomicUsize::new(0));
        let held = Arc::new(Mutex::new(Vec::new()));
        let provider = SdkTracerProvider::builder()
            .with_span_processor(Gate {
                inner: Held(Arc::clone(&held)),
                queued: Arc::clone(&queued),
                max: 2,
                stats: stats.clone(),
            })
            .build();
        let tracer = provider.tracer("test");
        let end_one = || drop(tracer.start("s"));
        for _ in 0..3 {
            end_one();
        }
        assert_eq!(held.lock().unwrap().len(), 2, "two admitted");
        assert_eq!(stats.dropped.get(), 1, "the third dropped and counted");
        assert_eq!(queued.load(Ordering::Relaxed), 2);

        // A refused batch still frees its slots, counted as failed.
        let batch: Vec<SpanData> = std::mem::take(&mut *held.lock().unwrap());
        let refusing = Counted::new(Collector(false), Arc::clone(&queued), stats.clone());
        assert!(futures::executor::block_on(refusing.export(batch)).is_err());
        assert_eq!(queued.load(Ordering::Relaxed), 0);
        assert_eq!((stats.failed.get(), stats.exported.get()), (2, 0));

        end_one();
        let batch: Vec<SpanData> = std::mem::take(&mut *held.lock().unwrap());
        assert_eq!(batch.len(), 1, "room again after the export");
        let accepting = Counted::new(Collector(true), Arc::clone(&queued), stats.clone());
        assert!(futures::executor::block_on(accepting.export(batch)).is_ok());
        assert_eq!(stats.exported.get(), 1);
        assert_eq!(stats.dropped.get(), 1);
    }
}
