//! vLLM's `kv_transfer_params` protocol for a prefill/decode pair, with the NixlConnector and
//! MooncakeConnector shapes (as vLLM's own disaggregation proxies send them; `docs/pd.md`
//! names the versions followed).
//!
//! Two steps. The prefill gets the client's body with `max_tokens: 1` (and
//! `max_completion_tokens: 1` when the client set it), `stream: false`, no `stream_options`, no
//! `min_tokens`/`min_completion_tokens` (a prefill leg cannot honour them), and
//! `kv_transfer_params` asking it to keep the KV for a remote decode:
//! - NIXL: `{do_remote_decode: true, do_remote_prefill: false, remote_engine_id: null,
//!   remote_block_ids: null, remote_host: null, remote_port: null}`; its answer carries the
//!   `kv_transfer_params` the decode needs (engine id, block ids, host, port, request id), which
//!   the decode gets verbatim;
//! - Mooncake: `{do_remote_decode: true, do_remote_prefill: false, transfer_id}` with a
//!   `transfer_id` the node picks (`xfer-<request id>`); the decode gets `{do_remote_decode:
//!   false, do_remote_prefill: true, transfer_id, remote_bootstrap_addr:
//!   "http://<prefill host>:<bootstrap port>", remote_engine_id}`. vLLM's Mooncake proxy sends
//!   both legs at once; kvmesh waits for the prefill, as for NIXL, so a failed prefill can be
//!   retried elsewhere before any decode memory is reserved (the cost: the decode's memory
//!   reservation no longer overlaps the prefill).
//!
//! Both legs carry the same `X-Request-Id`. The decode's answer streams to the client as the
//! client asked. A prefill failure (or an answer that is not JSON) is a prefill failure, before
//! the decode started: the request path retries on another prefill replica.

use rand::Rng;
use serde_json::{json, Map, Value};

use super::blame::Failure;
use super::pd_leg::{
    edited, host_of, judged, read_answer, send_leg, LegFailure, PairCtx, PairServed,
    DEFAULT_BOOTSTRAP_PORT,
};
use crate::core::keys::BlockKey;
use crate::core::pd::PdPair;
use crate::core::role::PdFacts;
use crate::node::config::PdProtocol;
use crate::node::{Endpoint, Ticket};

/// The request id header both legs carry.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// NIXL's prefill-leg `kv_transfer_params`.
pub fn nixl_prefill_params() -> Value {
    json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null,
    })
}

/// Mooncake's prefill-leg `kv_transfer_params`.
pub fn mooncake_prefill_params(transfer_id: &str) -> Value {
    json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "transfer_id": transfer_id,
    })
}

/// Mooncake's decode-leg `kv_transfer_params`.
pub fn mooncake_decode_params(transfer_id: &str, bootstrap_addr: &str, engine_id: &str) -> Value {
    json!({
        "do_remote_decode": false,
        "do_remote_prefill": true,
        "transfer_id": transfer_id,
        "remote_bootstrap_addr": bootstrap_addr,
        "remote_engine_id": engine_id,
    })
}

/// The prefill leg's body: the client's, made a one-token, non-streamed completion that keeps
/// its KV for a remote decode.
pub fn prefill_body(client: &Map<String, Value>, params: Value) -> Vec<u8> {
    let mut edits: Vec<(&str, Option<Value>)> = vec![
        ("kv_transfer_params", Some(params)),
        ("stream", Some(Value::Bool(false))),
        ("max_tokens", Some(Value::from(1))),
        ("stream_options", None),
        ("min_tokens", None),
        ("min_completion_tokens", None),
    ];
    if client.contains_key("max_completion_tokens") {
        edits.push(("max_completion_tokens", Some(Value::from(1))));
    }
    edited(client, &edits)
}

/// A fresh request id (32 hex digits, as a UUID without dashes).
fn request_id() -> String {
    let mut rng = rand::rng();
    format!("{:016x}{:016x}", rng.random::<u64>(), rng.random::<u64>())
}

/// Runs the prefill, then the decode; answers with the decode's response and the legs' ids.
pub(super) async fn serve(
    ctx: &PairCtx<'_>,
    protocol: PdProtocol,
    pair: &PdPair,
    mut prefill: Ticket,
    decode: Ticket,
    keys: &mut Vec<BlockKey>,
) -> Result<PairServed, LegFailure> {
    let facts = ctx.node.pd_facts(pair.prefill.replica).unwrap_or_default();
    let p_end = prefill.endpoint().clone();
    let d_end = decode.endpoint().clone();
    let id = request_id();
    let transfer_id = format!("xfer-{id}");
    let params = match protocol {
        PdProtocol::VllmMooncake => mooncake_prefill_params(&transfer_id),
        _ => nixl_prefill_params(),
    };
    let extra = [(REQUEST_ID_HEADER, id.clone())];
    let limit = std::time::Duration::from_millis(ctx.node.cfg.pd.prefill_timeout_ms);
    let p = pair.prefill.replica;
    let prefill_fail = |failure, error: String| LegFailure {
        replica: p,
        failure,
        error,
        leg: "prefill",
    };
    let leg = async {
        let resp = judged(
            tokio::time::timeout(
                limit,
                send_leg(ctx, &p_end, &extra, prefill_body(ctx.body, params)),
            )
            .await,
            p,
            "prefill",
            limit,
        )?;
        if !resp.status().is_success() {
            return Err(prefill_fail(
                Failure::Status,
                format!("the prefill replica answered {}", resp.status()),
            ));
        }
        let bytes = read_answer(
            resp,
            std::time::Duration::from_millis(ctx.node.cfg.timeouts.idle_ms),
        )
        .await
        .map_err(|e| prefill_fail(Failure::Transport, format!("prefill answer: {e}")))?;
        serde_json::from_slice::<Map<String, Value>>(&bytes)
            .map_err(|e| prefill_fail(Failure::Status, format!("prefill answer is not JSON: {e}")))
    };
    let answer = match tokio::time::timeout(limit, leg).await {
        Ok(Ok(a)) => a,
        outcome => {
            // Neither leg put the prompt anywhere: their unconfirmed overlay keys go.
            prefill.failed(keys);
            decode.failed(keys);
            return Err(match outcome {
                Ok(Err(f)) => f,
                _ => prefill_fail(
                    Failure::Timeout,
                    format!("the prefill leg took over {limit:?}"),
                ),
            });
        }
    };
    // The prefill is done: its blocks are in its cache; its leg's accounting goes.
    prefill.first_byte(keys);
    let prefill_cached = answer
        .get("usage")
        .and_then(|u| u.get("prompt_tokens_details"))
        .and_then(|d| d.get("cached_tokens"))
        .and_then(Value::as_u64);
    drop(prefill);
    let returned = answer.get("kv_transfer_params").filter(|v| v.is_object());
    let decode_params = decode_kv_params(protocol, &transfer_id, &p_end, &facts, returned);
    let body = match decode_params {
        Some(v) => edited(ctx.body, &[("kv_transfer_params", Some(v))]),
        None => edited(ctx.body, &[]),
    };
    let resp = match judged(
        tokio::time::timeout(ctx.first_byte, send_leg(ctx, &d_end, &extra, body)).await,
        pair.decode,
        "decode",
        ctx.first_byte,
    ) {
        Ok(r) => r,
        Err(f) => {
            decode.failed(keys);
            return Err(f);
        }
    };
    let out = super::pd_leg::answer(ctx, resp, decode, pair.prefill.hit_blocks, keys);
    Ok(PairServed {
        resp: out,
        prefill: p_end.id.to_string(),
        decode: d_end.id.to_string(),
        prefill_cached,
    })
}

/// The decode leg's `kv_transfer_params`: for Mooncake, where to pull the prefill's KV from
/// (its host and bootstrap port, the engine id it returned or advertised); otherwise, as vLLM's
/// proxy does, what the prefill returned, verbatim (none, and the decode computes).
fn decode_kv_params(
    protocol: PdProtocol,
    transfer_id: &str,
    prefill: &Endpoint,
    facts: &PdFacts,
    returned: Option<&Value>,
) -> Option<Value> {
    if protocol != PdProtocol::VllmMooncake {
        return returned.cloned();
    }
    let host = host_of(&prefill.base).unwrap_or_default();
    let port = facts.bootstrap_port.unwrap_or(DEFAULT_BOOTSTRAP_PORT);
    let engine = returned
        .and_then(|r| r.get("remote_engine_id"))
        .and_then(Value::as_str)
        .map(str::to_owned)
        .or_else(|| (!facts.engine_id.is_empty()).then(|| facts.engine_id.clone()))
        .unwrap_or_else(|| prefill.id.to_string());
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host
    };
    Some(mooncake_decode_params(
        transfer_id,
        &format!("http://{host}:{port}"),
        &engine,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_leg_is_a_one_token_unstreamed_completion_that_keeps_its_kv() {
        let client: Map<String, Value> = serde_json::from_value(json!({
            "model": "m", "prompt": "p", "max_tokens": 100, "stream": true,
            "stream_options": {"include_usage": true}, "min_tokens": 5,
            "max_completion_tokens": 100, "temperature": 0.5
        }))
        .unwrap();
        let body: Value =
            serde_json::from_slice(&prefill_body(&client, nixl_prefill_params())).unwrap();
        assert_eq!(body["max_tokens"], 1);
        assert_eq!(body["max_completion_tokens"], 1);
        assert_eq!(body["stream"], false);
        assert!(body.get("stream_options").is_none() && body.get("min_tokens").is_none());
        assert_eq!(body["temperature"], 0.5, "the client's other fields pass");
        assert_eq!(body["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(body["kv_transfer_params"]["do_remote_prefill"], false);
        assert!(body["kv_transfer_params"]["remote_host"].is_null());
        let m = mooncake_decode_params("xfer-1", "http://h:8998", "e");
        assert_eq!(m.as_object().map(Map::len), Some(5));
        assert_eq!(m["do_remote_prefill"], true);
        assert_eq!(mooncake_prefill_params("xfer-1")["transfer_id"], "xfer-1");
        assert_eq!(request_id().len(), 32);
    }
}
