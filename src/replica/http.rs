//! HTTP handlers: the OpenAI-compatible surface, vLLM's tokenizer endpoints, health/load/metrics
//! probes and the fault admin endpoint. Completions are handed to the driver task; responses follow
//! the engine model's timing (headers and the first chunk leave when the first token exists).
//! With several data-parallel ranks a completion goes to the rank it names (`X-data-parallel-rank`
//! header, vLLM; `data_parallel_rank` body field, SGLang) or, naming none, to the rank with the
//! fewest requests in flight: the engine's own balancer, which knows nothing of prefixes.
//! The steps a completion takes are `engine_call.rs`'s, shared with the Anthropic Messages,
//! Responses and pooling routes (`http_apis.rs`), which this router merges.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use super::driver::Command;
use super::engine_call::{
    self as call, admit, pick_rank, read_body, submit, with_headers, Failure, Job, SseShape,
};
use super::faults::FaultPatch;
use super::http_apis;
use super::openai::{self, ApiError, Kind, Meta, Usage, SSE_DONE};
use super::pd::{self as pd_leg, Leg};
use super::tokenize_api;

pub use super::engine_call::{DP_RANK_FIELD, DP_RANK_HEADER, SERVED_RANK_HEADER};
pub use super::shared::Shared;

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
        .route(super::kv_fetch::FETCH_PATH, post(super::kv_fetch::serve))
        .merge(http_apis::routes())
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
        "id": s.model, "object": "model", "created": call::unix_now(), "owned_by": "vllm",
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
    let unavailable = |m: &str| Failure::unavailable(m).respond(call::Dialect::OpenAi);
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

async fn handle(s: Arc<Shared>, kind: Kind, headers: HeaderMap, body: Body) -> Response {
    serve_openai(&s, kind, &headers, body)
        .await
        .unwrap_or_else(|f| f.respond(call::Dialect::OpenAi))
}

/// `/v1/completions` and `/v1/chat/completions`: parse, P/D leg, engine, answer.
async fn serve_openai(
    s: &Arc<Shared>,
    kind: Kind,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, Failure> {
    let arrived = Instant::now();
    let in_flight = admit(s).await?;
    let body = read_body(s, headers, body).await?;
    let mut parsed = match kind {
        Kind::Completion => openai::parse_completion(&body, s.default_max_tokens),
        Kind::Chat => openai::parse_chat(&body, s.default_max_tokens),
    }?;
    let leg = pd_leg::leg(&body, s.pd.role, || s.next_request_id("nixl"))?;
    if let Leg::Prefill { key, .. } = &leg {
        // A prefill server computes the prompt and samples one token; the decode does the rest.
        parsed.max_tokens = 1;
        if s.transfers.slot(key).is_none() {
            return Err(Failure::unavailable("too many KV hand-overs waiting"));
        }
    }
    if let Leg::Decode { source } = &leg {
        pull_kv(s, source).await?;
    }
    let rank = pick_rank(s, headers, &body)?;
    let fetch = super::kv_fetch::hint_of(s, &body);
    drop(body);
    let job = Job {
        prompt: parsed.prompt,
        max_tokens: parsed.max_tokens,
        handed_over: matches!(leg, Leg::Decode { .. }),
        param: "prompt",
        cache_salt: parsed.cache_salt.take(),
        fetch,
    };
    let started = submit(s, rank, in_flight, job, arrived).await?;
    let charge = started.charge;
    if let Leg::Prefill { key, .. } = &leg {
        s.transfers.ready(key, charge.prompt_tokens);
    }
    let prefix = match kind {
        Kind::Completion => "cmpl",
        Kind::Chat => "chatcmpl",
    };
    let meta = Meta {
        id: format!("{prefix}-{}-{}", s.id, started.engine_id),
        created: call::unix_now(),
        model: s.model.clone(),
        kind,
    };
    let resp = if parsed.stream {
        let shape = OpenAiSse {
            meta,
            include_usage: parsed.include_usage,
            offset: parsed.offset,
        };
        call::stream(s.clone(), started, parsed.max_tokens, shape)
    } else {
        let generated = started.finish(s).await?;
        let usage = Usage {
            prompt: charge.prompt_tokens,
            cached: charge.cached,
            completion: generated,
        };
        let mut full = meta.full_response(usage);
        if let Leg::Prefill { key, nixl: true } = &leg {
            let blocks = charge.prompt_tokens.div_ceil(s.block_tokens.max(1));
            let params =
                pd_leg::nixl_params(&s.id, &s.addr.ip().to_string(), s.addr.port(), key, blocks);
            if let Some(o) = full.as_object_mut() {
                o.insert("kv_transfer_params".into(), params);
            }
        }
        Json(full).into_response()
    };
    Ok(with_headers(resp, &s.id, charge))
}

/// OpenAI's completion and chat chunks (`data:` lines, `[DONE]` last).
struct OpenAiSse {
    meta: Meta,
    include_usage: bool,
    /// The filler word the answer starts at (a continuation's).
    offset: u32,
}

impl SseShape for OpenAiSse {
    fn opening(&mut self, last: bool) -> Vec<String> {
        let word = self.offset;
        vec![self.meta.token_chunk(word, true, last, self.include_usage)]
    }

    fn token(&mut self, i: u32, last: bool) -> String {
        let word = self.offset.wrapping_add(i);
        self.meta.token_chunk(word, false, last, self.include_usage)
    }

    fn closing(&mut self, usage: Usage) -> Vec<String> {
        let mut events = Vec::with_capacity(2);
        if self.include_usage {
            events.push(self.meta.usage_chunk(usage));
        }
        events.push(SSE_DONE.to_string());
        events
    }
}
