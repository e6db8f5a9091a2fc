//! Serving a prefill/decode pair with the protocol adapter `[pd] protocol` names
//! (`pd_sglang.rs`, `pd_vllm.rs`; their shared plumbing: `pd_leg.rs`).
//!
//! The request path (`forward.rs`) routes with `Node::route_pd` when `[pd]` is on; a whole
//! decision takes the ordinary path, a pair comes here. The rules of the ordinary path hold for
//! each leg: bodies are rewritten only as the protocol says (the client's other fields pass
//! as they came), a leg that fails before the client saw a byte is a failed attempt of *its*
//! replica (the request path excludes it and chooses again: a prefill failure moves the prefill,
//! a decode failure the decode), and once the decode's response headers go to the client the
//! request is committed and never retried. Each leg holds its own `Ticket`: the prefill's is
//! released when the prefill leg's answer has been read (its blocks are then in the prefill
//! replica's cache, `Ticket::first_byte`), the decode's when the client's stream ends (the
//! handed-over blocks are in the decode replica's cache from its first byte on).

use axum::http::{HeaderName, HeaderValue};
use axum::response::Response;
use serde_json::{Map, Value};

use super::error::ApiError;
use super::pd_leg::{LegFailure, PairCtx};
use super::respond::{decision_header, DECISION_HEADER};
use crate::core::keys::BlockKey;
use crate::core::pd::PdPair;
use crate::node::config::PdProtocol;
use crate::node::Ticket;

/// Response header naming both legs, only with `debug_headers = true`:
/// `protocol=vllm-nixl; prefill=<id>; decode=<id>`, then `; prefill_cached=<tokens>` where the
/// protocol lets the node read the prefill's answer (the vLLM ones): the prefix hit the pair was
/// chosen for, which the decode's own `cached_tokens` does not show.
pub const PD_HEADER: &str = "x-kvmesh-pd";

/// Serves `pair` with `protocol`; on success the response streams the decode's answer.
pub(super) async fn serve_pair(
    ctx: &PairCtx<'_>,
    protocol: PdProtocol,
    pair: PdPair,
    prefill: Ticket,
    decode: Ticket,
    keys: &mut Vec<BlockKey>,
) -> Result<Response, LegFailure> {
    let result = match protocol {
        PdProtocol::Sglang => super::pd_sglang::serve(ctx, &pair, prefill, decode, keys).await,
        PdProtocol::VllmNixl | PdProtocol::VllmMooncake => {
            super::pd_vllm::serve(ctx, protocol, &pair, prefill, decode, keys).await
        }
    };
    let node = ctx.node;
    match result {
        Ok(served) => {
            let mut resp = served.resp;
            if node.cfg.debug_headers {
                let h = resp.headers_mut();
                let mut pd = format!(
                    "protocol={}; prefill={}; decode={}",
                    protocol.as_str(),
                    served.prefill,
                    served.decode
                );
                if let Some(c) = served.prefill_cached {
                    pd.push_str(&format!("; prefill_cached={c}"));
                }
                if let Ok(v) = HeaderValue::from_str(&pd) {
                    h.insert(HeaderName::from_static(PD_HEADER), v);
                }
                if let Ok(v) = HeaderValue::from_str(&decision_header(&pair.prefill, None)) {
                    h.insert(HeaderName::from_static(DECISION_HEADER), v);
                }
            }
            Ok(resp)
        }
        Err(f) => {
            node.metrics
                .pd_legs_failed
                .with_label_values(&[f.leg])
                .inc();
            Err(f)
        }
    }
}

/// The request's client body as a JSON object; `None` when it is not one.
pub fn json_object(body: &[u8]) -> Option<Map<String, Value>> {
    serde_json::from_slice::<Map<String, Value>>(body).ok()
}

/// An error for a body the adapters cannot rewrite.
pub(super) fn not_an_object() -> ApiError {
    ApiError::bad_request("a disaggregated request's body must be a JSON object", None)
}
