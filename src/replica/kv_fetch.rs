//! KV fetch between simulated replicas: the target's pull on a hint, and the source's answer.
//!
//! A request carrying a fetch hint (`core::kv_hint`: vLLM's `kv_hints` envelope or llm-d's
//! `kv_transfer_params.remote_kv_source`) names a source replica and a token range. Before the
//! request enters the engine, the target asks the source — a real HTTP request,
//! `POST /kvmesh/kv/fetch` with the range's block hashes — how many of them, leading, it holds.
//! The source answers after the modelled transfer of those blocks (`[pd]` `kv_bytes_per_token`
//! over `link_gbps`, divided by the time scale): the bytes are "on the wire" until then, so a
//! source that dies or is stopped mid-transfer is a failed pull. The target then submits the
//! request with the blocks that arrived ([`crate::engine_sim::Engine::submit_fetched`]): they
//! count as cached, enter its prefix cache with KV store events with its first chunk, and
//! the rest is recomputed. A failed pull (dead source, refused, timed out, or holding nothing)
//! recomputes everything: the request never fails for its hint.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};

use super::shared::Shared;
use crate::core::kv_hint::FetchHint;
use crate::engine_sim::prefix_cache::salted_block_hashes;
use crate::engine_sim::{BlockHash, Fetched, TokenId};

/// The source's path.
pub const FETCH_PATH: &str = "/kvmesh/kv/fetch";

/// Most blocks one pull may ask for (2 Mi tokens at 16 per block).
pub const MAX_ASK_BLOCKS: usize = 131_072;

/// A pull's question: these blocks of one chain, in order.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FetchAsk {
    /// The blocks' hashes (the engine's own, `prefix_cache::salted_block_hashes`).
    pub block_hashes: Vec<BlockHash>,
}

/// The source's answer, once the held blocks are "sent".
#[derive(Debug, Serialize, Deserialize)]
pub struct FetchAnswer {
    /// How many of the asked blocks, leading, it held and sent.
    pub held_blocks: usize,
}

/// `POST /kvmesh/kv/fetch`: the source's side. Counts the leading run of the asked blocks its
/// cache holds (any rank), waits the modelled transfer of that many, answers the count.
pub async fn serve(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    let ask: FetchAsk = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("invalid fetch request: {e}"),
            )
                .into_response()
        }
    };
    if ask.block_hashes.len() > MAX_ASK_BLOCKS {
        return (
            StatusCode::BAD_REQUEST,
            format!("at most {MAX_ASK_BLOCKS} blocks per fetch"),
        )
            .into_response();
    }
    let mut held = 0;
    for driver in &s.drivers {
        let (reply, rx) = tokio::sync::oneshot::channel();
        let cmd = super::driver::Command::Holds {
            hashes: ask.block_hashes.clone(),
            reply,
        };
        if driver.send(cmd).is_ok() {
            held = held.max(rx.await.unwrap_or(0));
        }
    }
    let tokens = held * s.block_tokens;
    tokio::time::sleep(s.pd.transfer_time(tokens, s.time_scale)).await;
    if s.faults.config().cut_kv_pulls {
        return cut_mid_transfer();
    }
    s.metrics.kv_served_tokens.inc_by(tokens as u64);
    Json(FetchAnswer { held_blocks: held }).into_response()
}

/// The `cut_kv_pulls` fault: a 200 whose body breaks off after its first bytes, so the
/// connection drops mid-answer (the target reads an error, not a count).
fn cut_mid_transfer() -> Response {
    let parts: [Result<Bytes, std::io::Error>; 2] = [
        Ok(Bytes::from_static(b"{\"held_blocks\":")),
        Err(std::io::Error::other("the KV source died mid-transfer")),
    ];
    let mut resp = axum::body::Body::from_stream(futures::stream::iter(parts)).into_response();
    resp.headers_mut().insert(
        axum::http::header::CONTENT_TYPE,
        axum::http::HeaderValue::from_static("application/json"),
    );
    resp
}

/// The fetch hint in a request body, if any; a malformed one is counted, logged and ignored
/// (the request runs without it).
pub fn hint_of(s: &Shared, body: &serde_json::Value) -> Option<FetchHint> {
    match crate::core::kv_hint::parse(body) {
        Ok(h) => h,
        Err(e) => {
            s.metrics
                .kv_fetch_failures
                .with_label_values(&["malformed"])
                .inc();
            tracing::debug!(replica = %s.id, error = %e, "ignoring a KV hint");
            None
        }
    }
}

/// The target's pull for a prompt with `hint`: the blocks that arrived, or `None` (counted and
/// logged) when none did.
pub async fn pull(
    s: &Shared,
    hint: &FetchHint,
    prompt: &[TokenId],
    cache_salt: Option<&str>,
) -> Option<Fetched> {
    let bs = s.block_tokens.max(1);
    let hashes = salted_block_hashes(prompt, bs, cache_salt);
    let from = usize::try_from(hint.start_token).ok()? / bs;
    let to = (usize::try_from(hint.end_token).ok()? / bs).min(hashes.len());
    if to <= from {
        return None;
    }
    let asked = &hashes[from..to.min(from + MAX_ASK_BLOCKS)];
    let started = std::time::Instant::now();
    let answer = ask(s, &hint.source_url, asked).await;
    tracing::debug!(
        replica = %s.id,
        source = %hint.source_url,
        asked = asked.len(),
        held = ?answer.as_ref().ok(),
        took_ms = started.elapsed().as_secs_f64() * 1000.0,
        "kv pull"
    );
    match answer {
        Ok(held) if held > 0 => Some(Fetched {
            from_block: from,
            to_block: from + held.min(asked.len()),
            transfer: std::time::Duration::ZERO,
        }),
        Ok(_) => {
            failed(s, &hint.source_url, "the source holds none of the blocks");
            None
        }
        Err(e) => {
            failed(s, &hint.source_url, &e);
            None
        }
    }
}

fn failed(s: &Shared, source: &str, why: &str) {
    s.metrics
        .kv_fetch_failures
        .with_label_values(&["source"])
        .inc();
    tracing::info!(replica = %s.id, %source, why, "KV fetch failed: recomputing");
}

/// One pull's request and answer.
async fn ask(s: &Shared, source: &str, hashes: &[BlockHash]) -> Result<usize, String> {
    let client = s
        .kv_client
        .get_or_init(|| {
            // reqwest is built without a default TLS provider: the process's, or ring.
            let _ = rustls::crypto::ring::default_provider().install_default();
            reqwest::Client::builder()
                .timeout(std::time::Duration::from_millis(s.pd.transfer_timeout_ms) * 2)
                .build()
                .ok()
        })
        .as_ref()
        .ok_or("no HTTP client")?;
    let url = format!("{}{FETCH_PATH}", source.trim_end_matches('/'));
    let resp = client
        .post(url)
        .json(&FetchAsk {
            block_hashes: hashes.to_vec(),
        })
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("source answered {}", resp.status()));
    }
    let bytes = resp.bytes().await.map_err(|e| e.to_string())?;
    if bytes.len() > 4096 {
        return Err("source answer too large".into());
    }
    let answer: FetchAnswer = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
    Ok(answer.held_blocks)
}
