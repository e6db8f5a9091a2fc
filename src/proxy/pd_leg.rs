//! The legs of a prefill/decode pair: sending one, judging its outcome, reading a prefill's
//! answer, answering the client with the decode's: the plumbing both protocol adapters
//! (`pd_sglang.rs`, `pd_vllm.rs`) share; `pd.rs` says the rules.

use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderMap;
use axum::response::Response;
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use serde_json::{Map, Value};

use super::blame::Failure;
use super::error::{is_failure, upstream_cause};
use super::respond::{respond, Relay};
use super::trace_span::RequestTrace;
use crate::core::dialect::Api;
use crate::core::keys::BlockKey;
use crate::node::{Endpoint, Node, Ticket};

/// A pair an adapter served.
pub(super) struct PairServed {
    /// The decode's answer, as the client gets it.
    pub resp: Response,
    /// The prefill replica's id.
    pub prefill: String,
    /// The decode replica's id.
    pub decode: String,
    /// Prompt tokens the prefill found cached, when its answer was read.
    pub prefill_cached: Option<u64>,
}

/// Largest prefill answer read (bytes): a one-token completion plus `kv_transfer_params`.
pub(super) const MAX_PREFILL_ANSWER_BYTES: usize = 4 << 20;

/// The engines' default KV bootstrap port (SGLang `--disaggregation-bootstrap-port`, vLLM
/// `VLLM_MOONCAKE_BOOTSTRAP_PORT`), used when a prefill replica names none.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// What a pair's legs share: the request as it came, and how to answer.
pub(super) struct PairCtx<'a> {
    pub node: &'a Arc<Node>,
    pub path: &'static str,
    /// Headers to send upstream (hop-by-hop removed, auth replaced).
    pub headers: &'a HeaderMap,
    /// The client's body, a JSON object.
    pub body: &'a Map<String, Value>,
    /// How long the decode may take to send response headers.
    pub first_byte: Duration,
    /// The request's trace, when the node traces.
    pub trace: Option<&'a RequestTrace>,
}

/// One leg of a pair that failed before the client saw a byte.
pub(super) struct LegFailure {
    /// The replica that failed (the request path excludes it).
    pub replica: usize,
    /// How.
    pub failure: Failure,
    /// What to log and, if nothing else answers, tell the client.
    pub error: String,
    /// `prefill` or `decode`.
    pub leg: &'static str,
}

/// Sends `body` to `endpoint` at the request's path with the request's headers (plus `extra`);
/// the future owns what it needs, so a leg can finish in the background.
pub(super) fn send_leg(
    ctx: &PairCtx<'_>,
    endpoint: &Endpoint,
    extra: &[(&'static str, String)],
    body: Vec<u8>,
) -> impl std::future::Future<Output = reqwest::Result<reqwest::Response>> + Send + 'static {
    let mut req = ctx
        .node
        .client
        .post(format!("{}{}", endpoint.base, ctx.path))
        .headers(ctx.headers.clone())
        .header(axum::http::header::CONTENT_TYPE, "application/json");
    for (k, v) in extra {
        req = req.header(*k, v.as_str());
    }
    req.body(body).send()
}

/// A leg's outcome within `limit`, as a response that can be used or a failure of `replica`.
pub(super) fn judged(
    outcome: Result<reqwest::Result<reqwest::Response>, tokio::time::error::Elapsed>,
    replica: usize,
    leg: &'static str,
    limit: Duration,
) -> Result<reqwest::Response, LegFailure> {
    let fail = |failure, error| LegFailure {
        replica,
        failure,
        error,
        leg,
    };
    match outcome {
        Ok(Ok(r)) if !is_failure(r.status()) => Ok(r),
        Ok(Ok(r)) => Err(fail(
            Failure::Status,
            format!("the {leg} replica answered {}", r.status()),
        )),
        Ok(Err(e)) => Err(fail(
            if e.is_connect() {
                Failure::Connect
            } else {
                Failure::Transport
            },
            format!("the {leg} replica failed: {}", upstream_cause(e)),
        )),
        Err(_) => Err(fail(
            Failure::Timeout,
            format!("the {leg} replica sent nothing within {limit:?}"),
        )),
    }
}

/// Reads a leg's whole answer, at most [`MAX_PREFILL_ANSWER_BYTES`], each chunk within `idle`
/// of the one before (`timeouts.idle_ms`): a replica that sends its headers and then stalls
/// would otherwise hold the read, and the leg's ticket with it, forever.
pub(super) async fn read_answer(resp: reqwest::Response, idle: Duration) -> Result<Bytes, String> {
    let mut stream = resp.bytes_stream();
    let mut buf = BytesMut::new();
    loop {
        let chunk = match tokio::time::timeout(idle, stream.next()).await {
            Ok(Some(chunk)) => chunk.map_err(upstream_cause)?,
            Ok(None) => break,
            Err(_) => return Err(format!("no byte of the answer within {idle:?}")),
        };
        if buf.len() + chunk.len() > MAX_PREFILL_ANSWER_BYTES {
            return Err(format!("answer over {MAX_PREFILL_ANSWER_BYTES} bytes"));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}

/// The prefill leg answered: read the rest of its answer in the background (each chunk within
/// `idle`), then its blocks are in the prefill replica's cache and its accounting goes (at once if the
/// answer fails or stalls).
pub(super) fn finish_prefill_later(
    resp: reqwest::Response,
    mut ticket: Ticket,
    keys: Vec<BlockKey>,
    idle: Duration,
) {
    let ok = resp.status().is_success();
    tokio::spawn(async move {
        let read = read_answer(resp, idle).await;
        if ok && read.is_ok() {
            ticket.first_byte(&keys);
        }
        drop(ticket);
    });
}

/// The decode's answer, streamed to the client with the decode leg's ticket; `keys` go with it
/// (the handed-over blocks are in the decode replica's cache once it answers).
pub(super) fn answer(
    ctx: &PairCtx<'_>,
    resp: reqwest::Response,
    ticket: Ticket,
    hit_blocks: u32,
    keys: &mut Vec<BlockKey>,
) -> Response {
    let node = ctx.node;
    node.request_succeeded(ticket.replica());
    let outcome = if resp.status().is_success() {
        "ok"
    } else {
        "client_error"
    };
    node.metrics
        .requests
        .with_label_values(&[&ticket.endpoint().id, node.policy().as_str(), outcome])
        .inc();
    let span = ctx.trace.map(|t| t.span().clone());
    let api = if ctx.path == "/v1/completions" {
        Api::Completions
    } else {
        Api::Chat
    };
    let relay = Relay::new(api, hit_blocks, span);
    respond(node, resp, ticket, std::mem::take(keys), relay)
}

/// `body` with `edits` applied (a key set to `Some` value, or removed with `None`).
pub(super) fn edited(body: &Map<String, Value>, edits: &[(&str, Option<Value>)]) -> Vec<u8> {
    let mut m = body.clone();
    for (k, v) in edits {
        match v {
            Some(v) => {
                m.insert((*k).to_owned(), v.clone());
            }
            None => {
                m.remove(*k);
            }
        }
    }
    serde_json::to_vec(&m).unwrap_or_default()
}

/// The host of a replica's base URL (its KV bootstrap server's host).
pub(super) fn host_of(base: &str) -> Option<String> {
    reqwest::Url::parse(base)
        .ok()
        .and_then(|u| u.host_str().map(str::to_owned))
}
