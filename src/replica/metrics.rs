//! Prometheus metrics under vLLM's names (`vllm/v1/metrics/loggers.py`), so that a router or a
//! benchmark scraping a simulated replica needs no special case. Each replica has its own registry,
//! which lets many replicas share one process in tests.

use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntGauge, Opts, Registry, TextEncoder,
};

use crate::engine_sim::EngineStats;

/// vLLM's TTFT histogram buckets, in seconds.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// The replica's metrics.
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    running: IntGauge,
    waiting: IntGauge,
    kv_usage: Gauge,
    prefix_queries: IntCounter,
    prefix_hits: IntCounter,
    /// Time to first token as seen by the HTTP handler, seconds.
    pub ttft: Histogram,
    /// Requests that completed normally.
    pub success: IntCounter,
    /// How late the driver ran engine steps versus the model's schedule, seconds: the instrument's
    /// own fidelity (large values mean the replica process, not the model, is the bottleneck).
    pub driver_lag: Histogram,
    /// Prompt tokens pulled from other replicas on a KV-fetch hint and used
    /// (`kvmesh_replica_kv_fetched_tokens_total`).
    pub kv_fetched_tokens: IntCounter,
    /// KV-fetch hints that moved nothing, by reason: `source` (the source failed, died or holds
    /// none of it), `malformed` (`kvmesh_replica_kv_fetch_failures_total{reason}`).
    pub kv_fetch_failures: prometheus::IntCounterVec,
    /// Pulls this replica served as a source, and the tokens it sent
    /// (`kvmesh_replica_kv_served_tokens_total`).
    pub kv_served_tokens: IntCounter,
    /// The latest stats of each data-parallel rank's engine, summed into the gauges.
    ranks: std::sync::Arc<std::sync::Mutex<Vec<EngineStats>>>,
}

impl Metrics {
    /// Registers every metric with the `model_name` label.
    pub fn new(
        model: &str,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let label = |o: Opts| {
            o.const_label("model_name", model)
                .const_label("engine", "0")
        };
        let running = IntGauge::with_opts(label(Opts::new(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
        )))?;
        let waiting = IntGauge::with_opts(label(Opts::new(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
        )))?;
        let kv_usage = Gauge::with_opts(label(Opts::new(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
        )))?;
        let prefix_queries = IntCounter::with_opts(label(Opts::new(
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
        )))?;
        let prefix_hits = IntCounter::with_opts(label(Opts::new(
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
        )))?;
        let cache_info = Gauge::with_opts(
            label(Opts::new(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
            ))
            .const_label("block_size", block_size.to_string())
            .const_label("num_gpu_blocks", num_blocks.to_string()),
        )?;
        cache_info.set(1.0);
        let ttft_opts = HistogramOpts::new(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
        )
        .const_label("model_name", model)
        .const_label("engine", "0")
        .buckets(TTFT_BUCKETS.to_vec());
        let ttft = Histogram::with_opts(ttft_opts)?;
        let success = IntCounter::with_opts(
            label(Opts::new(
                "vllm:request_success_total",
                "Count of successfully processed requests.",
            ))
            .const_label("finished_reason", "length"),
        )?;
        let driver_lag = Histogram::with_opts(
            HistogramOpts::new(
                "kvmesh:replica_driver_lag_seconds",
                "Delay between an engine event's modelled time and when the driver processed it.",
            )
            .const_label("model_name", model)
            .buckets(vec![
                0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2.0,
            ]),
        )?;
        let kv_fetched_tokens = IntCounter::with_opts(label(Opts::new(
            "kvmesh_replica_kv_fetched_tokens_total",
            "Prompt tokens pulled from another replica on a KV-fetch hint and used.",
        )))?;
        let kv_fetch_failures = prometheus::IntCounterVec::new(
            label(Opts::new(
                "kvmesh_replica_kv_fetch_failures_total",
                "KV-fetch hints that moved nothing, by reason (source, malformed).",
            )),
            &["reason"],
        )?;
        let kv_served_tokens = IntCounter::with_opts(label(Opts::new(
            "kvmesh_replica_kv_served_tokens_total",
            "Prompt tokens of KV this replica sent to others as a fetch source.",
        )))?;
        registry.register(Box::new(kv_fetched_tokens.clone()))?;
        registry.register(Box::new(kv_fetch_failures.clone()))?;
        registry.register(Box::new(kv_served_tokens.clone()))?;
        registry.register(Box::new(driver_lag.clone()))?;
        registry.register(Box::new(running.clone()))?;
        registry.register(Box::new(waiting.clone()))?;
        registry.register(Box::new(kv_usage.clone()))?;
        registry.register(Box::new(prefix_queries.clone()))?;
        registry.register(Box::new(prefix_hits.clone()))?;
        registry.register(Box::new(cache_info))?;
        registry.register(Box::new(ttft.clone()))?;
        registry.register(Box::new(success.clone()))?;
        Ok(Self {
            registry,
            running,
            waiting,
            kv_usage,
            prefix_queries,
            prefix_hits,
            ttft,
            success,
            driver_lag,
            kv_fetched_tokens,
            kv_fetch_failures,
            kv_served_tokens,
            ranks: Default::default(),
        })
    }

    /// Mirrors the engine's gauges and counters (a replica with one data-parallel rank).
    pub fn update(&self, stats: &EngineStats) {
        self.update_rank(0, stats);
    }

    /// Mirrors data-parallel rank `rank`'s engine: the replica's gauges and counters are the
    /// sums over its ranks (KV usage their mean), as one `/metrics` per replica shows them.
    pub fn update_rank(&self, rank: usize, stats: &EngineStats) {
        let total = {
            let Ok(mut ranks) = self.ranks.lock() else {
                return;
            };
            if ranks.len() <= rank {
                ranks.resize(rank + 1, EngineStats::default());
            }
            ranks[rank] = *stats;
            let mut t = EngineStats::default();
            for s in ranks.iter() {
                t.running += s.running;
                t.waiting += s.waiting;
                t.kv_usage += s.kv_usage;
                t.prefix_query_tokens += s.prefix_query_tokens;
                t.prefix_hit_tokens += s.prefix_hit_tokens;
            }
            t.kv_usage /= ranks.len().max(1) as f64;
            t
        };
        self.running.set(total.running as i64);
        self.waiting.set(total.waiting as i64);
        self.kv_usage.set(total.kv_usage);
        let q = total
            .prefix_query_tokens
            .saturating_sub(self.prefix_queries.get());
        self.prefix_queries.inc_by(q);
        let h = total
            .prefix_hit_tokens
            .saturating_sub(self.prefix_hits.get());
        self.prefix_hits.inc_by(h);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> Result<String, prometheus::Error> {
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf)?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }
}
