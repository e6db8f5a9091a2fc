//! `kvmesh bench`'s engine: replays a [`WorkloadRequest`] list over HTTP against one or several
//! OpenAI-compatible base URLs and records what each request saw.
//!
//! It exists apart from the CLI so the demo (and tests) can replay against fleets they started
//! themselves: [`replay`] for any URLs; `fleet.rs` starts in-process fleets to replay against.
//!
//! Measurement, per request, through the API of [`ReplayConfig::api`] (streaming completions by
//! default; chat, Anthropic Messages or OpenAI Responses with the prompt as one user message:
//! `replay_api.rs`): TTFT = the first event carrying generated text, latency = end of stream, both
//! from the moment the request was sent (after the concurrency cap let it go); output tokens from
//! the API's usage (else the number of text events); serving replica from
//! `x-kvmesh-replica` (else `x-kvmesh-routed-to`); cached prompt tokens from
//! `x-kvmesh-cached-tokens`, else the API's usage (`prompt_tokens_details.cached_tokens`,
//! `cache_read_input_tokens`, `input_tokens_details.cached_tokens`). For engines with
//! neither, the run also scrapes `--metrics-url`s before and after and reports the deltas of
//! `vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total` summed over them.
//! A prefill/decode pair (a kvmesh node's `x-kvmesh-pd` debug header) counts the prefill's hit
//! where the header names it (`prefill_cached`): the decode computed nothing of the prompt, so
//! its own `cached_tokens` says nothing of the routing. Inter-token latency per request is the
//! time after the first event over the tokens after the first.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use rand::distr::weighted::WeightedIndex;
use rand::distr::Distribution;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::replay_api::{split_event, Api, StreamTally};
use super::workload::WorkloadRequest;

/// Header naming the replica that served a completion (set by simulated replicas).
pub const REPLICA_HEADER: &str = "x-kvmesh-replica";
/// Header a kvmesh node sets to the replica it routed to (fallback for engines without
/// [`REPLICA_HEADER`]).
pub const ROUTED_HEADER: &str = crate::proxy::forward::REPLICA_HEADER;
/// Header carrying the prompt tokens served from the prefix cache.
pub const CACHED_HEADER: &str = "x-kvmesh-cached-tokens";
/// Header a kvmesh node names both legs of a prefill/decode pair in.
pub const PD_HEADER: &str = crate::proxy::pd::PD_HEADER;
/// Session header sent with requests that belong to a session or agent run.
pub const SESSION_HEADER: &str = "x-session-id";
/// Affinity-key header sent with requests that name one (RAG: the leading document).
pub const AFFINITY_HEADER: &str = "x-affinity-key";
/// Tenant header sent with requests that name a tenant.
pub const TENANT_HEADER: &str = "x-tenant-id";

/// How to replay.
#[derive(Clone, Debug)]
pub struct ReplayConfig {
    /// Base URLs (`http://host:port`); each request goes to one drawn at random.
    pub targets: Vec<String>,
    /// Relative weight of each target's draw, in `targets`' order (clients nearer some nodes);
    /// empty: every target alike. Default empty.
    pub target_weights: Vec<f64>,
    /// Model name; `None` = the first model `GET /v1/models` of the first target lists.
    pub model: Option<String>,
    /// Workload arrival times are divided by this. Default 1.
    pub speedup: f64,
    /// Most requests in flight at once; later arrivals wait for a slot. Default 512.
    pub concurrency: usize,
    /// Replay only the first N requests. Default: all.
    pub max_requests: Option<usize>,
    /// Seed of the target draw. Default 1.
    pub seed: u64,
    /// Prometheus endpoints to scrape before and after for prefix-cache counters. Default none.
    pub metrics_urls: Vec<String>,
    /// Bound on one request, headers to end of stream. Default 600 s.
    pub request_timeout: Duration,
    /// Print a progress line to stderr every 2 s. Default true.
    pub progress: bool,
    /// Name of the run in reports. Default "run".
    pub label: String,
    /// Measured durations are multiplied by this in reports (the time scale of simulated
    /// replicas, so figures are in model seconds). Default 1.
    pub time_scale: f64,
    /// The API requests go through. Default completions.
    pub api: Api,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            targets: Vec::new(),
            target_weights: Vec::new(),
            model: None,
            speedup: 1.0,
            concurrency: 512,
            max_requests: None,
            seed: 1,
            metrics_urls: Vec::new(),
            request_timeout: Duration::from_secs(600),
            progress: true,
            label: "run".into(),
            time_scale: 1.0,
            api: Api::Completions,
        }
    }
}

/// What one request saw. Durations are wall seconds (not yet scaled).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Index in the workload.
    pub index: usize,
    /// Index of the target URL it was sent to.
    pub target: usize,
    /// When it was sent, seconds since the run started.
    pub sent_s: f64,
    /// How much later than its schedule it was sent, wall seconds: the client's lag (a busy
    /// machine sends late, and a late burst is a lighter one).
    #[serde(default)]
    pub lag_s: f64,
    /// HTTP status (0 when no response arrived).
    pub status: u16,
    /// Time to the first event carrying generated text.
    pub ttft_s: Option<f64>,
    /// Time to the end of the stream (or the failure).
    pub latency_s: f64,
    /// Prompt tokens (from the usage, else the workload's count).
    pub prompt_tokens: u64,
    /// Output tokens (from the usage, else text events counted).
    pub output_tokens: u64,
    /// Prompt tokens served from the prefix cache, when the endpoint says.
    pub cached_tokens: Option<u64>,
    /// The replica that served it, when the endpoint says.
    pub replica: Option<String>,
    /// Served as a prefill/decode pair (the node's `x-kvmesh-pd` header).
    #[serde(default)]
    pub pd_pair: bool,
    /// Why it failed; `None` = success.
    pub error: Option<String>,
}

/// Prefix-cache counter deltas scraped from `/metrics` endpoints.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct MetricsDelta {
    /// Δ `vllm:prefix_cache_hits_total` (tokens), summed over endpoints.
    pub hits: f64,
    /// Δ `vllm:prefix_cache_queries_total` (tokens), summed over endpoints.
    pub queries: f64,
}

/// Receipt counter deltas (`kvmesh_receipt_*`) scraped from kvmesh targets: per answered
/// request, the prompt tokens the node predicted cached against what the engine reported.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ReceiptDelta {
    /// Answers with an engine report.
    pub answers: f64,
    /// Cached tokens the nodes predicted, over those answers.
    pub predicted: f64,
    /// Cached tokens the engines reported.
    pub reported: f64,
    /// min(predicted, reported) per answer, summed.
    pub matched: f64,
}

impl ReceiptDelta {
    /// The receipt counters in one Prometheus exposition, summed over label sets.
    pub fn of(text: &str) -> Self {
        let mut d = ReceiptDelta::default();
        for line in text.lines() {
            if let Ok(Some(s)) = crate::replicas::prom::parse_line(line) {
                match s.name {
                    "kvmesh_receipts_total" if s.labels.contains("outcome=\"reported\"") => {
                        d.answers += s.value
                    }
                    "kvmesh_receipt_predicted_tokens_total" => d.predicted += s.value,
                    "kvmesh_receipt_reported_tokens_total" => d.reported += s.value,
                    "kvmesh_receipt_matched_tokens_total" => d.matched += s.value,
                    _ => {}
                }
            }
        }
        d
    }

    fn minus(self, before: Self) -> Self {
        ReceiptDelta {
            answers: (self.answers - before.answers).max(0.0),
            predicted: (self.predicted - before.predicted).max(0.0),
            reported: (self.reported - before.reported).max(0.0),
            matched: (self.matched - before.matched).max(0.0),
        }
    }
}

/// One replay's raw results.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunResult {
    /// Name of the run.
    pub label: String,
    /// The target URLs.
    pub targets: Vec<String>,
    /// The model requested.
    pub model: String,
    /// Per request, in workload order.
    pub records: Vec<RequestRecord>,
    /// Wall seconds from the first send to the last completion.
    pub wall_s: f64,
    /// Multiply durations by this for model seconds.
    pub time_scale: f64,
    /// Replica ids known to exist (a fleet's), so idle replicas count in load shares; empty =
    /// those seen in responses.
    pub replicas: Vec<String>,
    /// Prefix-cache counter deltas, when metrics URLs were given and answered.
    pub metrics: Option<MetricsDelta>,
    /// Receipt counter deltas, when every target is a kvmesh node that answered `/metrics`.
    #[serde(default)]
    pub receipts: Option<ReceiptDelta>,
    /// Hot-prefix warm-ups the fleet's nodes sent (fleet runs; 0 otherwise).
    #[serde(default)]
    pub warmups: u64,
    /// Their prefill tokens.
    #[serde(default)]
    pub warmup_tokens: u64,
}

/// Why a replay could not run.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// Nothing to send to.
    #[error("no target URL given")]
    NoTargets,
    /// Bad parameter.
    #[error("invalid replay parameter: {0}")]
    Invalid(String),
    /// The HTTP client could not be built.
    #[error("building the HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    /// The model could not be discovered.
    #[error("discovering the model from {url}/v1/models: {reason}")]
    Models {
        /// The target asked.
        url: String,
        /// What went wrong.
        reason: String,
    },
}

/// Refuses a replay that cannot run: no target, a speedup or concurrency out of range, or a
/// workload that would take more than a year.
fn check(workload: &[WorkloadRequest], cfg: &ReplayConfig) -> Result<(), ReplayError> {
    if cfg.targets.is_empty() {
        return Err(ReplayError::NoTargets);
    }
    if !(cfg.speedup.is_finite() && cfg.speedup > 0.0) {
        return Err(ReplayError::Invalid("speedup must be > 0".into()));
    }
    if cfg.concurrency == 0 {
        return Err(ReplayError::Invalid(
            "concurrency must be at least 1".into(),
        ));
    }
    // The latest arrival bounds every wait (a year at most).
    if let Some(a) = workload.first() {
        let last = workload.iter().map(|r| r.at_s).fold(a.at_s, f64::max);
        let span = (last - a.at_s).max(0.0) / cfg.speedup;
        if !(span.is_finite() && span <= 365.0 * 86_400.0) {
            return Err(ReplayError::Invalid(format!(
                "the workload spans {span:.0} s after dividing by the speedup: more than a year"
            )));
        }
    }
    Ok(())
}

/// The load generator's HTTP client.
fn http_client(cfg: &ReplayConfig) -> Result<reqwest::Client, ReplayError> {
    crate::proxy::install_crypto_provider();
    // HTTP/1.1, a connection per request in flight, as the load generators it is compared
    // with (and the figures measured before reqwest's HTTP/2 was built in).
    reqwest::Client::builder()
        .http1_only()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(cfg.concurrency)
        // Below every target's keep-alive (a node's `header_read_timeout_ms`, 10 s; uvicorn's
        // 5 s): reusing a connection the server closes at that moment failed a request now and
        // then (`error sending request`), and a POST is not retried.
        .pool_idle_timeout(Duration::from_secs(4))
        .connect_timeout(Duration::from_secs(5))
        .build()
        .map_err(ReplayError::Client)
}

/// Replays `workload` against `cfg.targets` and returns every request's record.
pub async fn replay(
    workload: &[WorkloadRequest],
    cfg: &ReplayConfig,
) -> Result<RunResult, ReplayError> {
    check(workload, cfg)?;
    let client = http_client(cfg)?;
    let targets: Vec<String> = cfg
        .targets
        .iter()
        .map(|t| t.trim_end_matches('/').to_owned())
        .collect();
    let model = match &cfg.model {
        Some(m) => m.clone(),
        None => discover_model(&client, &targets[0]).await?,
    };
    let n = cfg
        .max_requests
        .unwrap_or(workload.len())
        .min(workload.len());
    let work: Arc<[WorkloadRequest]> = workload[..n].into();
    let choice = draw_targets(n, targets.len(), &cfg.target_weights, cfg.seed)?;
    let before = scrape_all(&client, &cfg.metrics_urls).await;
    let receipts_before = scrape_receipts(&client, &targets).await;

    let shared = Arc::new(Shared {
        client,
        targets: targets
            .iter()
            .map(|t| format!("{t}{}", cfg.api.path()))
            .collect(),
        api: cfg.api,
        model: model.clone(),
        timeout: cfg.request_timeout,
        done: AtomicUsize::new(0),
        failed: AtomicUsize::new(0),
    });
    let slots = Arc::new(Semaphore::new(cfg.concurrency));
    let start = Instant::now();
    let progress = cfg.progress.then(|| {
        tokio::spawn(progress_line(
            cfg.label.clone(),
            n,
            Arc::clone(&shared),
            start,
        ))
    });
    let t0 = work.first().map_or(0.0, |r| r.at_s);
    let mut tasks = JoinSet::new();
    for (i, &target) in choice.iter().enumerate() {
        let due = ((work[i].at_s - t0).max(0.0)) / cfg.speedup;
        // Bounded above (checked at the start), so neither conversion can fail.
        let due = Duration::try_from_secs_f64(due).unwrap_or_default();
        tokio::time::sleep_until((start + due).into()).await;
        // A closed semaphore cannot happen (never closed); treat it as "no cap" to stay total.
        let permit = Arc::clone(&slots).acquire_owned().await.ok();
        let shared = Arc::clone(&shared);
        let work = Arc::clone(&work);
        let due_s = due.as_secs_f64();
        tasks.spawn(async move {
            let mut rec = send(&shared, &work[i], i, target, start).await;
            rec.lag_s = (rec.sent_s - due_s).max(0.0);
            drop(permit);
            shared.done.fetch_add(1, Ordering::Relaxed);
            if rec.error.is_some() {
                shared.failed.fetch_add(1, Ordering::Relaxed);
            }
            rec
        });
    }
    let mut records = Vec::with_capacity(n);
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(rec) => records.push(rec),
            Err(e) => tracing::error!(error = %e, "replay task failed"),
        }
    }
    let wall_s = start.elapsed().as_secs_f64();
    if let Some(p) = progress {
        p.abort();
    }
    records.sort_by_key(|r| r.index);
    let after = scrape_all(&shared.client, &cfg.metrics_urls).await;
    let receipts = match (
        receipts_before,
        scrape_receipts(&shared.client, &targets).await,
    ) {
        (Some(b), Some(a)) => Some(a.minus(b)),
        _ => None,
    };
    let metrics = match (before, after) {
        (Some(b), Some(a)) => Some(MetricsDelta {
            hits: (a.hits - b.hits).max(0.0),
            queries: (a.queries - b.queries).max(0.0),
        }),
        _ => None,
    };
    if cfg.progress {
        summary_line(&cfg.label, &records, wall_s);
    }
    Ok(RunResult {
        label: cfg.label.clone(),
        targets,
        model,
        records,
        wall_s,
        time_scale: cfg.time_scale,
        replicas: Vec::new(),
        metrics,
        receipts,
        warmups: 0,
        warmup_tokens: 0,
    })
}

/// The run's last progress line: requests, wall time, failures and the client's lag p99.
fn summary_line(label: &str, records: &[RequestRecord], wall_s: f64) {
    let failed = records.iter().filter(|r| r.error.is_some()).count();
    let mut lags: Vec<f64> = records.iter().map(|r| r.lag_s).collect();
    let lag = super::stats::Distribution::of(&mut lags);
    eprintln!(
        "[{label}] {} requests in {wall_s:.1} s, {failed} failed, client lag p99 {:.1} ms",
        records.len(),
        lag.p99 * 1000.0
    );
}

struct Shared {
    client: reqwest::Client,
    /// The API's URL per target, built once.
    targets: Vec<String>,
    api: Api,
    model: String,
    timeout: Duration,
    done: AtomicUsize,
    failed: AtomicUsize,
}

async fn progress_line(label: String, total: usize, shared: Arc<Shared>, start: Instant) {
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    tick.tick().await;
    loop {
        tick.tick().await;
        let done = shared.done.load(Ordering::Relaxed);
        let failed = shared.failed.load(Ordering::Relaxed);
        let t = start.elapsed().as_secs_f64();
        eprintln!(
            "[{label}] {done}/{total} done ({:.0}%), {failed} failed, {:.1} req/s, {t:.0} s",
            100.0 * done as f64 / total.max(1) as f64,
            done as f64 / t.max(1e-9)
        );
    }
}

async fn discover_model(client: &reqwest::Client, base: &str) -> Result<String, ReplayError> {
    let fail = |reason: String| ReplayError::Models {
        url: base.to_owned(),
        reason,
    };
    let resp = client
        .get(format!("{base}/v1/models"))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .map_err(|e| fail(e.to_string()))?;
    if !resp.status().is_success() {
        return Err(fail(format!("status {}", resp.status())));
    }
    let v: serde_json::Value = resp.json().await.map_err(|e| fail(e.to_string()))?;
    v.get("data")
        .and_then(|d| d.get(0))
        .and_then(|m| m.get("id"))
        .and_then(|id| id.as_str())
        .map(str::to_owned)
        .ok_or_else(|| fail("no model listed".into()))
}

/// Sends one request and reads its stream to the end.
async fn send(
    shared: &Shared,
    req: &WorkloadRequest,
    index: usize,
    target: usize,
    start: Instant,
) -> RequestRecord {
    let mut prompt = String::with_capacity(req.prompt_tokens() as usize * 4);
    req.write_prompt(&mut prompt);
    let body = shared
        .api
        .body(&shared.model, prompt, req.output_tokens.max(1));
    let sent = Instant::now();
    let mut rec = RequestRecord {
        index,
        target,
        sent_s: sent.duration_since(start).as_secs_f64(),
        prompt_tokens: req.prompt_tokens(),
        ..RequestRecord::default()
    };
    let mut http = shared.client.post(&shared.targets[target]).json(&body);
    for &(name, value) in shared.api.headers() {
        http = http.header(name, value);
    }
    if let Some(s) = &req.session {
        http = http.header(SESSION_HEADER, s);
    }
    if let Some(k) = &req.affinity {
        http = http.header(AFFINITY_HEADER, k);
    }
    if let Some(t) = &req.tenant {
        http = http.header(TENANT_HEADER, t);
    }
    let outcome =
        tokio::time::timeout(shared.timeout, exchange(http, shared.api, sent, &mut rec)).await;
    rec.latency_s = sent.elapsed().as_secs_f64();
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(e)) => rec.error = Some(e),
        Err(_) => rec.error = Some(format!("timed out after {:?}", shared.timeout)),
    }
    rec
}

fn header_str<'a>(h: &'a reqwest::header::HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

/// Largest SSE event read: a Responses `response.completed` repeats the whole answer, far
/// below this; a server that never ends an event fails the request instead of filling memory.
const MAX_EVENT_BYTES: usize = 8 << 20;
/// Most bytes of an error answer kept for the record.
const MAX_ERROR_BYTES: usize = 64 << 10;

/// The request/response exchange; fills `rec` as data arrives.
async fn exchange(
    http: reqwest::RequestBuilder,
    api: Api,
    sent: Instant,
    rec: &mut RequestRecord,
) -> Result<(), String> {
    let resp = http.send().await.map_err(|e| format!("send: {e}"))?;
    rec.status = resp.status().as_u16();
    let h = resp.headers();
    rec.replica = header_str(h, REPLICA_HEADER)
        .or_else(|| header_str(h, ROUTED_HEADER))
        .map(str::to_owned);
    rec.cached_tokens = header_str(h, CACHED_HEADER).and_then(|v| v.parse().ok());
    if let Some(pd) = header_str(h, PD_HEADER) {
        rec.pd_pair = true;
        if let Some(c) = pd_prefill_cached(pd) {
            rec.cached_tokens = Some(c);
        }
    }
    let status = resp.status();
    let mut stream = resp.bytes_stream();
    if !status.is_success() {
        let mut text = Vec::new();
        while let Some(Ok(piece)) = stream.next().await {
            text.extend_from_slice(&piece);
            if text.len() >= MAX_ERROR_BYTES {
                break;
            }
        }
        let cut: String = String::from_utf8_lossy(&text).chars().take(200).collect();
        return Err(format!("status {status}: {cut}"));
    }
    let mut buf: Vec<u8> = Vec::with_capacity(1024);
    let mut tally = StreamTally::default();
    let result = async {
        while let Some(piece) = stream.next().await {
            buf.extend_from_slice(&piece.map_err(|e| format!("stream: {e}"))?);
            // Events end with a blank line; handle every complete one in the buffer.
            while let Some((event_len, sep_len)) = find_event_end(&buf) {
                if let Some((name, data)) = split_event(&buf[..event_len]) {
                    api.read_event(name, &data, &mut tally)?;
                    if rec.ttft_s.is_none() && tally.text_events > 0 {
                        rec.ttft_s = Some(sent.elapsed().as_secs_f64());
                    }
                }
                buf.drain(..event_len + sep_len);
            }
            if buf.len() > MAX_EVENT_BYTES {
                return Err(format!("a stream event over {MAX_EVENT_BYTES} bytes"));
            }
        }
        Ok(())
    }
    .await;
    // What arrived counts even when the stream failed later.
    rec.output_tokens = tally.output_tokens.unwrap_or(tally.text_events);
    if let Some(p) = tally.prompt_tokens {
        rec.prompt_tokens = p;
    }
    if rec.cached_tokens.is_none() {
        rec.cached_tokens = tally.cached_tokens;
    }
    result?;
    if !tally.ended {
        return Err(format!("stream ended without {}", api.last_event()));
    }
    Ok(())
}

/// `prefill_cached=<tokens>` of an `x-kvmesh-pd` header value.
fn pd_prefill_cached(value: &str) -> Option<u64> {
    value
        .split(';')
        .find_map(|part| part.trim().strip_prefix("prefill_cached="))
        .and_then(|n| n.parse().ok())
}

/// Position and separator length of the first event end (`\n\n` or `\r\n\r\n`).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// Sums the prefix-cache counters over `urls`; `None` if there are none or any failed.
async fn scrape_all(client: &reqwest::Client, urls: &[String]) -> Option<MetricsDelta> {
    if urls.is_empty() {
        return None;
    }
    let mut sum = MetricsDelta::default();
    for url in urls {
        let url = if url.trim_end_matches('/').ends_with("/metrics") {
            url.clone()
        } else {
            format!("{}/metrics", url.trim_end_matches('/'))
        };
        let text = match client
            .get(&url)
            .timeout(Duration::from_secs(10))
            .send()
            .await
        {
            Ok(r) if r.status().is_success() => r.text().await.ok()?,
            Ok(r) => {
                tracing::warn!(%url, status = %r.status(), "metrics scrape failed");
                return None;
            }
            Err(e) => {
                tracing::warn!(%url, error = %e, "metrics scrape failed");
                return None;
            }
        };
        let d = prefix_counters(&text);
        sum.hits += d.hits;
        sum.queries += d.queries;
    }
    Some(sum)
}

/// The receipt counters summed over `targets` (kvmesh nodes); `None` if any does not answer or
/// exposes none (another router).
async fn scrape_receipts(client: &reqwest::Client, targets: &[String]) -> Option<ReceiptDelta> {
    let mut sum = ReceiptDelta::default();
    for t in targets {
        let resp = client
            .get(format!("{t}/metrics"))
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .ok()
            .filter(|r| r.status().is_success())?;
        let text = resp.text().await.ok()?;
        // A kvmesh node (its receipt series appear with the first answer); not another router.
        if !text.contains("kvmesh_in_flight_total") {
            return None;
        }
        let d = ReceiptDelta::of(&text);
        sum.answers += d.answers;
        sum.predicted += d.predicted;
        sum.reported += d.reported;
        sum.matched += d.matched;
    }
    Some(sum)
}

/// The prefix-cache counters in one Prometheus exposition, summed over label sets.
pub fn prefix_counters(text: &str) -> MetricsDelta {
    let mut d = MetricsDelta::default();
    for line in text.lines() {
        if let Ok(Some(s)) = crate::replicas::prom::parse_line(line) {
            match s.name {
                "vllm:prefix_cache_hits_total" => d.hits += s.value,
                "vllm:prefix_cache_queries_total" => d.queries += s.value,
                _ => {}
            }
        }
    }
    d
}

/// The target of each of `n` requests among `targets`: uniform, or drawn by `weights` (one per
/// target, finite, not negative, not all zero), from `seed`.
fn draw_targets(
    n: usize,
    targets: usize,
    weights: &[f64],
    seed: u64,
) -> Result<Vec<usize>, ReplayError> {
    let mut rng = SmallRng::seed_from_u64(seed);
    if weights.is_empty() {
        return Ok((0..n).map(|_| rng.random_range(0..targets)).collect());
    }
    if weights.len() != targets {
        return Err(ReplayError::Invalid(format!(
            "{} target weights for {targets} targets",
            weights.len()
        )));
    }
    let draw = WeightedIndex::new(weights)
        .map_err(|e| ReplayError::Invalid(format!("target weights {weights:?}: {e}")))?;
    Ok((0..n).map(|_| draw.sample(&mut rng)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_drawn_by_their_weights() {
        let uniform = draw_targets(1000, 3, &[], 1).unwrap();
        assert!((0..3).all(|t| uniform.contains(&t)));
        let weighted = draw_targets(10_000, 3, &[0.8, 0.0, 0.2], 1).unwrap();
        let count = |t| weighted.iter().filter(|c| **c == t).count();
        assert_eq!(count(1), 0, "a target of weight 0 gets nothing");
        assert!((7_700..=8_300).contains(&count(0)), "{}", count(0));
        assert_eq!(count(0) + count(2), 10_000);
        for bad in [
            &[1.0, 1.0][..],
            &[0.0, 0.0, 0.0],
            &[1.0, -1.0, 1.0],
            &[1.0, f64::NAN, 1.0],
        ] {
            assert!(
                matches!(draw_targets(10, 3, bad, 1), Err(ReplayError::Invalid(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn event_ends_are_found_for_both_newline_styles() {
        assert_eq!(find_event_end(b"data: x\n\ndata: y"), Some((7, 2)));
        assert_eq!(find_event_end(b"data: x\r\n\r\n"), Some((7, 4)));
        assert_eq!(find_event_end(b"data: x\n"), None);
    }

    #[test]
    fn a_pairs_prefill_hit_is_read_from_the_pd_header_when_named() {
        let h = "protocol=vllm-nixl; prefill=replica-0; decode=replica-2; prefill_cached=512";
        assert_eq!(pd_prefill_cached(h), Some(512));
        assert_eq!(
            pd_prefill_cached("protocol=sglang; prefill=a; decode=b"),
            None
        );
        assert_eq!(pd_prefill_cached("prefill_cached=lots"), None);
    }

    #[test]
    fn prefix_counters_sum_label_sets_and_skip_the_rest() {
        let text = "# HELP x\nvllm:prefix_cache_hits_total{model_name=\"a\"} 10\nvllm:prefix_cache_hits_total{model_name=\"b\"} 5\nvllm:prefix_cache_queries_total 40\nother 3\ngarbage{\n";
        assert_eq!(
            prefix_counters(text),
            MetricsDelta {
                hits: 15.0,
                queries: 40.0
            }
        );
    }

    #[test]
    fn receipts_sum_label_sets_and_count_only_reported_answers() {
        let text = "kvmesh_receipts_total{api=\"chat\",branch=\"cache\",outcome=\"reported\"} 3\n\
                    kvmesh_receipts_total{api=\"chat\",branch=\"cache\",outcome=\"no_usage\"} 9\n\
                    kvmesh_receipt_predicted_tokens_total{api=\"chat\",branch=\"cache\"} 100\n\
                    kvmesh_receipt_predicted_tokens_total{api=\"messages\",branch=\"load\"} 20\n\
                    kvmesh_receipt_reported_tokens_total{api=\"chat\",branch=\"cache\"} 90\n\
                    kvmesh_receipt_matched_tokens_total{api=\"chat\",branch=\"cache\"} 80\n";
        let d = ReceiptDelta::of(text);
        assert_eq!(
            d,
            ReceiptDelta {
                answers: 3.0,
                predicted: 120.0,
                reported: 90.0,
                matched: 80.0
            }
        );
        assert_eq!(d.minus(d), ReceiptDelta::default());
    }

    #[tokio::test]
    async fn a_workload_stretched_past_a_year_is_refused_before_anything_is_sent() {
        let req = |at_s| WorkloadRequest {
            at_s,
            segments: vec![(1, 16)],
            output_tokens: 1,
            session: None,
            affinity: None,
            tenant: None,
        };
        let cfg = ReplayConfig {
            // Nothing listens here; the check must come first.
            targets: vec!["http://127.0.0.1:9".into()],
            speedup: 1e-12,
            ..ReplayConfig::default()
        };
        let e = replay(&[req(0.0), req(10.0)], &cfg).await.err();
        assert!(matches!(e, Some(ReplayError::Invalid(m)) if m.contains("more than a year")));
    }
}
