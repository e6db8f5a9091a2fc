//! HTTP handlers: the OpenAI-compatible surface, vLLM's tokenizer endpoints, health/load/metrics
//! probes and the fault admin endpoint. Completions are handed to the driver task; responses follow
//! the engine model's timing (headers and the first chunk leave when the first token exists).
//! With several data-parallel ranks a completion goes to the rank it names (`X-data-parallel-rank`
//! header, vLLM; `data_parallel_rank` body field, SGLang) or, naming none, to the rank with the
//! fewest requests in flight: the engine's own balancer, which knows nothing of prefixes.

use std::convert::Infallible;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch, Notify};

use crate::engine_sim::{Output, Request};

use super::driver::{Command, Update};
use super::faults::{FaultPatch, Faults, Verdict};
use super::metrics::Metrics;
use super::openai::{self, ApiError, Kind, Meta, Usage, SSE_DONE};
use super::pd::{self as pd_leg, Leg, PdSimConfig, Transfers};
use super::tokenize_api::{self, Served};

/// State shared by all handlers of one replica.
#[derive(Debug)]
pub struct Shared {
    /// Replica id for `x-kvmesh-replica`.
    pub id: String,
    /// Served model name.
    pub model: String,
    /// Longest model length, for `/v1/models`.
    pub max_model_len: usize,
    /// Body size limit in bytes.
    pub max_body_bytes: usize,
    /// Default `max_tokens`.
    pub default_max_tokens: u32,
    /// Channels to the engine drivers, one per data-parallel rank (at least one).
    pub drivers: Vec<mpsc::UnboundedSender<Command>>,
    /// Completion requests in flight per rank (the balancer's load signal).
    pub rank_in_flight: Vec<Arc<AtomicI64>>,
    /// Where the balancer's round-robin among equally loaded ranks goes next.
    pub next_rank: AtomicUsize,
    /// Metrics registry.
    pub metrics: Metrics,
    /// Fault state.
    pub faults: Arc<Faults>,
    /// Notified when fault settings change (wakes the listener).
    pub faults_changed: Arc<Notify>,
    /// Set to stop the replica (crash fault).
    pub stop: watch::Sender<bool>,
    /// Whether the crash fault exits the process.
    pub exit_on_crash: bool,
    /// Request id counter.
    pub next_id: AtomicU64,
    /// Completion requests in flight (`/load`).
    pub in_flight: Arc<AtomicI64>,
    /// Its own HTTP address (NIXL's `remote_host`/`remote_port` in a prefill's answer).
    pub addr: std::net::SocketAddr,
    /// The engine's time scale (transfer times shrink with it).
    pub time_scale: f64,
    /// Tokens per KV block (NIXL's `remote_block_ids`).
    pub block_tokens: usize,
    /// Disaggregation settings.
    pub pd: PdSimConfig,
    /// Prefill legs' hand-overs waiting for their decode replica.
    pub transfers: Transfers,
    /// Pulls a decode leg's KV from its prefill replica; made at the first decode leg (`None`
    /// if it could not be), so other replicas need no TLS provider.
    pub kv_client: std::sync::OnceLock<Option<reqwest::Client>>,
}

/// The replica's routes.
pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions/render", post(render_completion))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/load", get(load))
        .route("/metrics", get(metrics))
        .route("/admin/faults", get(get_faults).post(set_faults))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/kvmesh/kv/{key}", get(kv_hand_over))
        .fallback(|| async {
            ApiError::new(StatusCode::NOT_FOUND, "NotFoundError", "no such route")
        })
        .with_state(shared)
}

/// `GET /kvmesh/kv/{key}`: a decode replica pulls a prefill leg's KV cache (`pd.rs`).
async fn kv_hand_over(
    State(s): State<Arc<Shared>>,
    axum::extract::Path(key): axum::extract::Path<String>,
) -> Response {
    let timeout = std::time::Duration::from_millis(s.pd.transfer_timeout_ms);
    match pd_leg::hand_over(&s.transfers, &key, &s.pd, s.time_scale, timeout).await {
        Ok(tokens) => Json(json!({ "tokens": tokens })).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Pulls a decode leg's KV from `source`; the error to answer with when it cannot.
async fn pull_kv(s: &Shared, source: &str) -> Result<(), ApiError> {
    let unavailable = |why: String| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            format!("KV hand-over from {source} failed: {why}"),
        )
    };
    let client = s.kv_client.get_or_init(|| {
        // reqwest is built without a default TLS provider: the process's, or ring.
        let _ = rustls::crypto::ring::default_provider().install_default();
        reqwest::Client::builder()
            .timeout(std::time::Duration::from_millis(s.pd.transfer_timeout_ms) * 2)
            .build()
            .ok()
    });
    let client = client
        .as_ref()
        .ok_or_else(|| unavailable("no HTTP client".into()))?;
    let resp = client
        .get(source)
        .send()
        .await
        .map_err(|e| unavailable(e.to_string()))?;
    if !resp.status().is_success() {
        return Err(unavailable(resp.status().to_string()));
    }
    Ok(())
}

async fn completions(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    handle(s, Kind::Completion, headers, body).await
}

async fn chat_completions(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(s, Kind::Chat, headers, body).await
}

impl Shared {
    fn served(&self) -> Served<'_> {
        Served {
            model: &self.model,
            max_model_len: self.max_model_len,
            default_max_tokens: self.default_max_tokens,
        }
    }

    fn next_request_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{}-{n}", self.id)
    }
}

/// Reads a JSON body under the body limit and answers `f`'s value, or its error in OpenAI's shape.
/// The tokenizer endpoints use it: like vLLM's API server, the front answers them without the
/// engine, so they neither queue, count as load nor take the completion faults.
async fn json_call(
    s: &Shared,
    headers: &HeaderMap,
    body: Body,
    f: impl FnOnce(&Value) -> Result<Value, ApiError>,
) -> Response {
    match read_body(s, headers, body).await.and_then(|v| f(&v)) {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn tokenize(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    json_call(&s, &headers, body, |v| {
        tokenize_api::tokenize_request(v, s.served())
    })
    .await
}

async fn detokenize(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    json_call(&s, &headers, body, tokenize_api::detokenize_request).await
}

async fn render_completion(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    json_call(&s, &headers, body, |v| {
        tokenize_api::render_completion(v, s.served(), s.next_request_id("cmpl"))
    })
    .await
}

async fn render_chat(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    json_call(&s, &headers, body, |v| {
        tokenize_api::render_chat(v, s.served(), s.next_request_id("chatcmpl"))
    })
    .await
}

async fn models(State(s): State<Arc<Shared>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{
        "id": s.model, "object": "model", "created": unix_now(), "owned_by": "vllm",
        "root": s.model, "parent": null, "max_model_len": s.max_model_len,
    }]}))
}

async fn load(State(s): State<Arc<Shared>>) -> Json<Value> {
    Json(json!({"server_load": s.in_flight.load(Ordering::Relaxed).max(0)}))
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    match s.metrics.render() {
        Ok(text) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response(),
        Err(e) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalServerError",
            e.to_string(),
        )
        .into_response(),
    }
}

async fn reset_prefix_cache(State(s): State<Arc<Shared>>) -> Response {
    // Every rank's cache; the answer is OK only if all were cleared.
    let mut all = true;
    for driver in &s.drivers {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if driver.send(Command::ResetPrefixCache(tx)).is_err() {
            return unavailable("engine stopped");
        }
        match rx.await {
            Ok(cleared) => all &= cleared,
            Err(_) => return unavailable("engine stopped"),
        }
    }
    if all {
        StatusCode::OK.into_response()
    } else {
        ApiError::bad_request("the prefix cache is in use by running requests", None)
            .into_response()
    }
}

/// vLLM's header naming the data-parallel rank a request must run on.
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";
/// SGLang's body field naming the data-parallel rank.
pub const DP_RANK_FIELD: &str = "data_parallel_rank";
/// Response header: the rank that served the request.
pub const SERVED_RANK_HEADER: &str = "x-kvmesh-dp-rank";

/// The rank a request names (header first, then body field), if any; an unparsable or
/// out-of-range rank is a client error, as in vLLM.
fn named_rank(s: &Shared, headers: &HeaderMap, body: &Value) -> Result<Option<usize>, ApiError> {
    let ranks = s.drivers.len();
    let bad = || {
        ApiError::bad_request(
            format!("the data-parallel rank must be an integer in 0..{ranks}"),
            Some(DP_RANK_FIELD),
        )
    };
    let named = if let Some(v) = headers.get(DP_RANK_HEADER) {
        let r = v.to_str().ok().and_then(|v| v.trim().parse::<usize>().ok());
        Some(r.ok_or_else(bad)?)
    } else {
        match body.get(DP_RANK_FIELD) {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_u64()
                    .and_then(|r| usize::try_from(r).ok())
                    .ok_or_else(bad)?,
            ),
        }
    };
    match named {
        Some(r) if r >= ranks => Err(bad()),
        other => Ok(other),
    }
}

/// The engine's own balancer: the rank with the fewest requests in flight, round-robin among
/// equals (vLLM's internal DP balancer also goes by queue lengths, not by cached prefixes).
fn balanced_rank(s: &Shared) -> usize {
    let n = s.rank_in_flight.len().max(1);
    let start = s.next_rank.fetch_add(1, Ordering::Relaxed) % n;
    (0..n)
        .map(|k| (start + k) % n)
        .min_by_key(|r| {
            s.rank_in_flight
                .get(*r)
                .map_or(i64::MAX, |c| c.load(Ordering::Relaxed))
        })
        .unwrap_or(0)
}

async fn get_faults(State(s): State<Arc<Shared>>) -> Json<Value> {
    Json(json!(s.faults.config()))
}

async fn set_faults(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    match serde_json::from_slice::<FaultPatch>(&body) {
        Ok(patch) => {
            let cfg = s.faults.apply(patch);
            tracing::info!(?cfg, "fault settings changed");
            s.faults_changed.notify_waiters();
            Json(json!(cfg)).into_response()
        }
        Err(e) => {
            ApiError::bad_request(format!("invalid fault settings: {e}"), None).into_response()
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Decrements the in-flight count when the request (or its stream) ends.
struct InFlight(Arc<AtomicI64>);

impl InFlight {
    fn new(counter: &Arc<AtomicI64>) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        Self(counter.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

fn unavailable(message: &str) -> Response {
    let mut resp = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "ServiceUnavailableError",
        message,
    )
    .into_response();
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

async fn read_body(s: &Shared, headers: &HeaderMap, body: Body) -> Result<Value, ApiError> {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "RequestEntityTooLarge",
            format!("request body exceeds {} bytes", s.max_body_bytes),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > s.max_body_bytes) {
        return Err(too_large());
    }
    let bytes = axum::body::to_bytes(body, s.max_body_bytes)
        .await
        .map_err(|e| {
            let over_limit = std::error::Error::source(&e)
                .is_some_and(|src| src.is::<http_body_util::LengthLimitError>())
                || e.to_string().contains("length limit");
            if over_limit {
                too_large()
            } else {
                ApiError::bad_request(format!("could not read the request body: {e}"), None)
            }
        })?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}"), None))
}

async fn handle(s: Arc<Shared>, kind: Kind, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    match s.faults.verdict() {
        Verdict::Refuse => return unavailable("replica is refusing connections (fault injection)"),
        Verdict::Crash => {
            tracing::error!(replica = %s.id, "fault: crashing");
            if s.exit_on_crash {
                std::process::exit(70);
            }
            let _ = s.stop.send(true);
            return unavailable("replica crashed (fault injection)");
        }
        Verdict::Hang => std::future::pending::<()>().await,
        Verdict::Error => {
            return ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalServerError",
                "injected failure (fault injection)",
            )
            .into_response()
        }
        Verdict::Serve { delay } => {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
        }
    }
    let in_flight = InFlight::new(&s.in_flight);
    let body = match read_body(&s, &headers, body).await {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    let parsed = match kind {
        Kind::Completion => openai::parse_completion(&body, s.default_max_tokens),
        Kind::Chat => openai::parse_chat(&body, s.default_max_tokens),
    };
    let mut parsed = match parsed {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let leg = match pd_leg::leg(&body, s.pd.role, || s.next_request_id("nixl")) {
        Ok(l) => l,
        Err(e) => return e.into_response(),
    };
    if let Leg::Prefill { key, .. } = &leg {
        // A prefill server computes the prompt and samples one token; the decode does the rest.
        parsed.max_tokens = 1;
        if s.transfers.slot(key).is_none() {
            return unavailable("too many KV hand-overs waiting");
        }
    }
    if let Leg::Decode { source } = &leg {
        if let Err(e) = pull_kv(&s, source).await {
            return e.into_response();
        }
    }
    let rank = match named_rank(&s, &headers, &body) {
        Ok(Some(r)) => r,
        Ok(None) => balanced_rank(&s),
        Err(e) => return e.into_response(),
    };
    drop(body);
    let (Some(driver), Some(rank_load)) = (s.drivers.get(rank), s.rank_in_flight.get(rank)) else {
        return unavailable("engine stopped");
    };
    let rank_in_flight = InFlight::new(rank_load);
    let id = s.next_id.fetch_add(1, Ordering::Relaxed);
    let (tx, mut rx) = mpsc::unbounded_channel::<Update>();
    let req = Request {
        id,
        prompt: parsed.prompt,
        max_tokens: parsed.max_tokens,
    };
    let handed_over = matches!(leg, Leg::Decode { .. });
    if driver
        .send(Command::Submit {
            req,
            tx,
            handed_over,
        })
        .is_err()
    {
        return unavailable("engine stopped");
    }
    // Dropping `rx` (client gone) makes the driver cancel the request at its next output.
    let (cached, prompt_tokens) = match rx.recv().await {
        Some(Ok(Output::FirstToken {
            cached_tokens,
            prompt_tokens,
            ..
        })) => {
            if let Leg::Prefill { key, .. } = &leg {
                s.transfers.ready(key, prompt_tokens);
            }
            (cached_tokens, prompt_tokens)
        }
        Some(Ok(other)) => {
            tracing::error!(?other, "first engine output was not a first token");
            return unavailable("engine protocol error");
        }
        Some(Err(e)) => {
            return ApiError::bad_request(e.to_string(), Some("prompt")).into_response()
        }
        None => return unavailable("engine stopped"),
    };
    s.metrics.ttft.observe(started.elapsed().as_secs_f64());
    let prefix = match kind {
        Kind::Completion => "cmpl",
        Kind::Chat => "chatcmpl",
    };
    let meta = Meta {
        id: format!("{prefix}-{}-{id}", s.id),
        created: unix_now(),
        model: s.model.clone(),
        kind,
    };
    let max_tokens = parsed.max_tokens;
    let mut resp = if parsed.stream {
        stream_response(
            s.clone(),
            meta,
            rx,
            max_tokens,
            parsed.include_usage,
            cached,
            prompt_tokens,
            (in_flight, rank_in_flight),
        )
    } else {
        let mut generated = 1;
        let mut done =
            max_tokens == 1 && matches!(rx.recv().await, Some(Ok(Output::Finished { .. })));
        while !done {
            match rx.recv().await {
                Some(Ok(Output::Token { .. })) => generated += 1,
                Some(Ok(Output::Finished { .. })) => done = true,
                Some(_) => {}
                None => return unavailable("engine stopped mid-request"),
            }
        }
        drop((in_flight, rank_in_flight));
        s.metrics.success.inc();
        let usage = Usage {
            prompt: prompt_tokens,
            cached,
            completion: generated,
        };
        let mut full = meta.full_response(usage);
        if let Leg::Prefill { key, nixl: true } = &leg {
            let blocks = prompt_tokens.div_ceil(s.block_tokens.max(1));
            let params =
                pd_leg::nixl_params(&s.id, &s.addr.ip().to_string(), s.addr.port(), key, blocks);
            if let Some(o) = full.as_object_mut() {
                o.insert("kv_transfer_params".into(), params);
            }
        }
        Json(full).into_response()
    };
    let h = resp.headers_mut();
    for (name, value) in [
        ("x-kvmesh-replica", s.id.clone()),
        ("x-kvmesh-cached-tokens", cached.to_string()),
        ("x-kvmesh-prompt-tokens", prompt_tokens.to_string()),
        (SERVED_RANK_HEADER, rank.to_string()),
    ] {
        if let Ok(v) = HeaderValue::from_str(&value) {
            h.insert(name, v);
        }
    }
    resp
}

#[allow(clippy::too_many_arguments)]
fn stream_response(
    s: Arc<Shared>,
    meta: Meta,
    mut rx: mpsc::UnboundedReceiver<Update>,
    max_tokens: u32,
    include_usage: bool,
    cached: usize,
    prompt_tokens: usize,
    in_flight: (InFlight, InFlight),
) -> Response {
    let (body_tx, body_rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        let _in_flight = in_flight;
        let mut generated = 0u32;
        let send = |text: String| {
            let body_tx = body_tx.clone();
            async move { body_tx.send(Bytes::from(text)).await.is_ok() }
        };
        // The first token already arrived.
        generated += 1;
        if !send(meta.token_chunk(0, max_tokens == 1, include_usage)).await {
            return;
        }
        loop {
            match rx.recv().await {
                Some(Ok(Output::Token { .. })) => {
                    generated += 1;
                    if !send(meta.token_chunk(
                        generated - 1,
                        generated >= max_tokens,
                        include_usage,
                    ))
                    .await
                    {
                        return;
                    }
                }
                Some(Ok(Output::Finished { .. })) => break,
                Some(_) => {}
                // Engine stopped: end the stream without [DONE], as a dying server would.
                None => return,
            }
        }
        s.metrics.success.inc();
        if include_usage {
            let usage = Usage {
                prompt: prompt_tokens,
                cached,
                completion: generated,
            };
            if !send(meta.usage_chunk(usage)).await {
                return;
            }
        }
        send(SSE_DONE.to_string()).await;
    });
    let stream = futures::stream::unfold(body_rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<Bytes, Infallible>(b), rx))
    });
    let mut resp = Body::from_stream(stream).into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}
