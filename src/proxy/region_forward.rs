//! Forwarding a request to another region: HTTPS inside the cluster's mutual TLS to a live node
//! of that region (its peer listener, `mesh/peer_tls.rs`) with the hop header, streamed back
//! unbuffered.
//!
//! A forwarded request carries `x-kvmesh-hop: 1` and is never forwarded again; the receiving
//! node honours the header only on its peer listener (a client's is stripped), routes the
//! request as `forwarded`, and with `debug_headers` echoes the hop header while the forwarding
//! node adds `x-kvmesh-forwarded-to: <node>`. Peers are tried nearest first by QUIC RTT in 5 ms steps
//! (random among equally near ones, unmeasured ones last); one that fails before answering
//! (connect error, timeout, 500/502/503/504) gives way to the next. When none is left the
//! caller marks the region unreachable for a few seconds (its record outlives a region gone
//! dark by the region layer's failure detection) and routes once more, to the next region;
//! with none, the answer is 503.
//!
//! When the node traces, each try of a peer is a client span `kvmesh.forward` whose context is
//! the forwarded request's `traceparent`: the receiving node's span continues the same trace.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;
use rand::seq::SliceRandom;
use tracing::Span;

use super::error::{is_failure, upstream_cause, ApiError};
use super::trace_span;
use crate::core::router::ForwardReason;
use crate::node::{Node, Peer};

/// Request header marking a request another node already forwarded (its value is the hop
/// count, always 1). A request carrying it is never forwarded again.
pub const HOP_HEADER: &str = "x-kvmesh-hop";
/// Request header carrying the tenant of a forwarded request, which the forwarding node decided
/// (by API key when keys are on). Read only from a peer's connection.
pub const TENANT_HEADER: &str = "x-kvmesh-tenant";
/// Peers whose RTTs differ by less than this many ms count as equally near when forwarding.
const FORWARD_RTT_STEP_MS: u128 = 5;

/// Response header naming the node a request was forwarded to.
pub const FORWARDED_TO_HEADER: &str = "x-kvmesh-forwarded-to";

/// Why a forward did not answer.
pub enum ForwardError {
    /// Every node of the region that the record names failed before answering (or it named
    /// none): the region may have gone dark, and another region may still serve.
    RegionFailed(ApiError),
    /// This node cannot forward at all.
    Unavailable(ApiError),
}

/// Forwards a request the router sent to `region`: to a live node there (nearest by QUIC RTT in
/// 5 ms steps, random among equally near ones, unmeasured ones last), with the hop header; a node
/// that fails before answering (connect error, first-byte timeout, 500/502/503/504) gives way to
/// the next; the answer streams back unbuffered. `trace` is the request's span when the node
/// traces: each try gets a child span, sent on as the request's trace context, and the request
/// span stays open while the answer streams. When every node failed the caller may mark the
/// region unreachable and route again ([`ForwardError::RegionFailed`]). Like retries at
/// replicas, no new node is tried once `retry.budget_ms` has passed since the first.
pub async fn forward(
    node: &Arc<Node>,
    region: &str,
    reason: ForwardReason,
    path: &str,
    headers: &HeaderMap,
    body: Bytes,
    trace: Option<&Span>,
) -> Result<Response, ForwardError> {
    let metrics = node.mesh_slot().metrics.get();
    let count = |outcome: &str| {
        if let Some(m) = metrics {
            m.forwards.with_label_values(&[region, outcome]).inc();
        }
    };
    let peers = forward_order(node, region, true);
    let mut headers = headers.clone();
    headers.insert(
        HeaderName::from_static(HOP_HEADER),
        HeaderValue::from_static("1"),
    );
    let first_byte = Duration::from_millis(node.cfg.timeouts.first_byte_ms);
    if !node.forward_clients.ready() {
        count("unavailable");
        return Err(ForwardError::Unavailable(ApiError::unavailable(
            "no local replica can serve this request and this node cannot forward",
        )));
    }
    let (started, budget) = (
        std::time::Instant::now(),
        Duration::from_millis(node.cfg.retry.budget_ms),
    );
    for (n, peer) in peers.iter().enumerate() {
        if n > 0 && started.elapsed() >= budget {
            break;
        }
        let span = trace.map(|parent| {
            let span = trace_span::forward_span(parent, region, &peer.node_id);
            trace_span::inject(&span, &mut headers);
            span
        });
        // Its handshake checks the node's certificate: a record naming another node's
        // address, or a member of another region, gets no byte of the body.
        let Some(client) = node.forward_clients.get(&peer.node_id, &peer.region) else {
            continue;
        };
        let send = client
            .post(format!("{}{path}", peer.http_url))
            .headers(headers.clone())
            .body(body.clone())
            .send();
        let answer = tokio::time::timeout(first_byte, send).await;
        if let Some(span) = &span {
            let (status, error) = match &answer {
                Ok(Ok(resp)) => (Some(resp.status()), None),
                Ok(Err(e)) if e.is_connect() => (None, Some("connect")),
                Ok(Err(_)) => (None, Some("transport")),
                Err(_) => (None, Some("timeout")),
            };
            trace_span::attempt_done(span, status, error);
        }
        let last = match answer {
            // The member that answered is not the one meant (its record pointed elsewhere).
            Ok(Ok(resp)) if !reached(&resp, &peer.node_id) => {
                count("misdirected");
                format!("answered as another node than {}", peer.node_id)
            }
            Ok(Ok(resp)) if !is_failure(resp.status()) => {
                tracing::debug!(%region, peer = %peer.node_id, ?reason, "forwarded");
                count("ok");
                if let Some(t) = trace {
                    t.record("kvmesh.forwarded_to", peer.node_id.as_str());
                }
                return Ok(stream_back(
                    node,
                    resp,
                    &peer.node_id,
                    node.cfg.debug_headers,
                    trace.cloned(),
                ));
            }
            Ok(Ok(resp)) => format!("answered {}", resp.status()),
            Ok(Err(e)) => {
                let cause = upstream_cause(e);
                // The handshake found another node (or another region's) than the record says.
                if cause.contains(crate::mesh::peer_tls::NOT_THE_NODE_MEANT) {
                    count("misdirected");
                }
                format!("failed: {cause}")
            }
            Err(_) => format!("sent nothing within {first_byte:?}"),
        };
        tracing::warn!(%region, peer = %peer.node_id, url = %peer.http_url, error = %last, "forward attempt failed");
        count("retry");
    }
    count("unavailable");
    // The client learns the region (it chose none) but no node names or addresses.
    Err(ForwardError::RegionFailed(ApiError::unavailable(format!(
        "no local replica can serve this request and forwarding to region '{region}' failed"
    ))))
}

/// Whether `resp` came from node `node_id` (its TLS certificate names it).
fn reached(resp: &reqwest::Response, node_id: &str) -> bool {
    let leaf = resp
        .extensions()
        .get::<reqwest::tls::TlsInfo>()
        .and_then(|t| t.peer_certificate());
    crate::mesh::peer_tls::names_node(leaf, node_id)
}

/// The nodes of `region` in the order a forward tries them: nearest by QUIC RTT in 5 ms steps,
/// unmeasured ones last. Within a step the order is random when `shuffle` (nodes about as near
/// as each other share the forwarded load; one "nearest" node would take it all), else by node
/// id (the nodes `warm_peers.rs` keeps a connection to).
pub(super) fn forward_order(node: &Node, region: &str, shuffle: bool) -> Vec<Peer> {
    let mut peers = node.peers_in(region);
    let rtts = node.mesh().map(|m| m.peer_rtts()).unwrap_or_default();
    if shuffle {
        peers.shuffle(&mut rand::rng());
    } else {
        peers.sort_unstable_by(|a, b| a.node_id.cmp(&b.node_id));
    }
    // A stable sort keeps the order within a step.
    peers.sort_by_key(|p| {
        rtts.get(&p.quic_addr)
            .map_or(u128::MAX, |d| d.as_millis() / FORWARD_RTT_STEP_MS)
    });
    peers
}

/// Streams another node's answer back, cutting it after the idle timeout; `span` (the request's,
/// when the node traces) ends with the stream.
fn stream_back(
    node: &Arc<Node>,
    resp: reqwest::Response,
    peer: &str,
    debug: bool,
    span: Option<Span>,
) -> Response {
    let idle = Duration::from_millis(node.cfg.timeouts.idle_ms);
    let mut out = relay_answer(resp, idle, span, "no data from the forwarded node");
    if let (true, Ok(v)) = (debug, HeaderValue::from_str(peer)) {
        out.headers_mut()
            .insert(HeaderName::from_static(FORWARDED_TO_HEADER), v);
    }
    out
}

/// An upstream answer relayed as it arrives: its status and headers (hop-by-hop ones left out),
/// its body cut with an error (`cut`) when `idle` passes without a byte; `span` ends with it.
pub(super) fn relay_answer(
    resp: reqwest::Response,
    idle: Duration,
    span: Option<Span>,
    cut: &'static str,
) -> Response {
    let status = resp.status();
    let mut headers = HeaderMap::with_capacity(resp.headers().len() + 1);
    for (k, v) in resp.headers() {
        if !matches!(
            k.as_str(),
            "connection" | "keep-alive" | "transfer-encoding" | "te" | "trailer" | "upgrade"
        ) {
            headers.append(k.clone(), v.clone());
        }
    }
    let inner = Box::pin(resp.bytes_stream());
    let stream = futures::stream::unfold(
        (inner, false, span),
        move |(mut inner, done, span)| async move {
            if done {
                return None;
            }
            match tokio::time::timeout(idle, inner.next()).await {
                Ok(Some(Ok(chunk))) => Some((Ok(chunk), (inner, false, span))),
                Ok(Some(Err(e))) => Some((Err(std::io::Error::other(e)), (inner, true, span))),
                Ok(None) => None,
                Err(_) => Some((
                    Err(std::io::Error::new(std::io::ErrorKind::TimedOut, cut)),
                    (inner, true, span),
                )),
            }
        },
    );
    let mut out = Response::new(Body::from_stream(stream));
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    out
}
