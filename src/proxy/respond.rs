//! Answering the client with a replica's response: streamed as it arrives, unbuffered, holding
//! the request's `Ticket` until the body ends; the first chunk signals the ticket's first byte.
//!
//! Shared by the ordinary request path (`forward.rs`) and the decode leg of a disaggregated
//! request (`pd_leg.rs`), so both release their accounting and record their blocks the same way.
//! A streamed answer of the ordinary path also has a [`StreamGuard`] (`resume.rs`): it passes
//! whole events, and when the replica fails mid-stream (an error, an end without the stream's
//! terminator, silence past `timeouts.stream_idle_ms`) the relay goes on with a continuation
//! from another replica, or ends with the API's error event — never a bare truncation.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue};
use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;
use tracing::Span;

use super::receipts::{OfferedPull, Receipt};
use super::resume::{Recovery, StreamGuard};
use crate::core::dialect::Api;
use crate::core::keys::BlockKey;
use crate::core::router::Branch;
use crate::node::{Node, Ticket};

/// How an answer is relayed: what its receipt records, and the span it keeps open.
pub(crate) struct Relay {
    api: Api,
    hit_blocks: u32,
    branch: Option<Branch>,
    span: Option<Span>,
    guard: Option<Box<StreamGuard>>,
    /// Prompt tokens the replica was told to pull from another (a KV-fetch hint), for the
    /// receipt.
    fetch_tokens: u64,
    /// The pull's source when another region's offer named it, for the receipt to judge.
    offered: Option<OfferedPull>,
}

impl Relay {
    /// The relay of an `api` answer whose replica was believed to hold `hit_blocks`; `span`,
    /// the request's span when the node traces, stays open until the body ends.
    pub fn new(api: Api, hit_blocks: u32, span: Option<Span>) -> Self {
        Relay {
            api,
            hit_blocks,
            branch: None,
            span,
            guard: None,
            fetch_tokens: 0,
            offered: None,
        }
    }

    /// The replica was told to pull `tokens` prompt tokens from another (receipts count them
    /// apart).
    pub fn fetch(mut self, tokens: u64) -> Self {
        self.fetch_tokens = tokens;
        self
    }

    /// The pull's source is a holder another region's offer named (receipts judge the pull).
    pub fn offered(mut self, pull: Option<OfferedPull>) -> Self {
        self.offered = pull;
        self
    }

    /// Watch the answer as a stream that may continue elsewhere (`resume.rs`).
    pub fn guard(mut self, guard: Option<Box<StreamGuard>>) -> Self {
        self.guard = guard;
        self
    }

    /// The decision's branch, for the receipt's labels (none: a P/D pair).
    pub fn branch(mut self, branch: Branch) -> Self {
        self.branch = Some(branch);
        self
    }
}

/// Response header naming the replica the node sent the request to (distinct from the
/// simulated replica's own `x-kvmesh-replica`, which a real engine does not send); only with
/// `debug_headers = true`, like [`HIT_HEADER`].
pub const REPLICA_HEADER: &str = "x-kvmesh-routed-to";
/// Response header with the prefix blocks the node expected the replica to hold.
pub const HIT_HEADER: &str = "x-kvmesh-hit-blocks";
/// Response header explaining the decision, only with `debug_headers = true`:
/// `branch=cache; hit=12; best=12; predicted_ms=35.1` (`best=-` for policies blind to caches).
pub const DECISION_HEADER: &str = "x-kvmesh-decision";

/// Hop-by-hop headers and ones the HTTP client sets itself.
pub(super) fn is_hop_header(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "host"
            | "content-length"
            | "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

pub(super) fn decision_header(d: &crate::core::router::Routed, dp_rank: Option<u16>) -> String {
    let best = d
        .best_hit_blocks
        .map_or_else(|| "-".to_owned(), |b| b.to_string());
    let rank = dp_rank.map_or_else(String::new, |r| format!("; dp_rank={r}"));
    format!(
        "branch={}; hit={}; best={best}; predicted_ms={:.1}{rank}",
        d.branch().as_str(),
        d.hit_blocks,
        d.predicted_s * 1000.0
    )
}

/// Streams a replica's response to the client as it arrives, holding the request's ticket until
/// the body ends (or the client goes away). The body's first chunk signals the ticket's first
/// byte with the request's block `keys`, which count as cached there only if the replica
/// accepted the request (a success status); a body that fails before its first chunk records
/// nothing. A successful answer's receipt is read as it passes and recorded when it ends, or
/// when the body is dropped after the engine's usage passed (a client that stops reading at
/// `[DONE]`, or at a `Content-Length` the server then stops polling at).
pub(super) fn respond(
    node: &Arc<Node>,
    resp: reqwest::Response,
    ticket: Ticket,
    mut keys: Vec<BlockKey>,
    relay: Relay,
) -> Response {
    let status = resp.status();
    let hit_blocks = relay.hit_blocks;
    let receipt = status.is_success().then(|| {
        Receipt::new(relay.api, relay.branch, ticket.hit_tokens())
            .fetching(relay.fetch_tokens)
            .offered(relay.offered)
    });
    if !status.is_success() {
        keys = Vec::new();
    }
    let mut headers = HeaderMap::with_capacity(resp.headers().len() + 2);
    for (k, v) in resp.headers() {
        if !is_hop_header(k) || k == header::CONTENT_LENGTH {
            headers.append(k.clone(), v.clone());
        }
    }
    // They tell a client what the node believes is cached, and internal replica names:
    // debugging only.
    if node.cfg.debug_headers {
        if let Ok(v) = HeaderValue::from_str(&ticket.endpoint().id) {
            headers.insert(HeaderName::from_static(REPLICA_HEADER), v);
        }
        headers.insert(
            HeaderName::from_static(HIT_HEADER),
            HeaderValue::from(hit_blocks),
        );
    }
    let state = BodyState {
        inner: Box::pin(resp.bytes_stream()),
        ticket,
        keys,
        idle: Duration::from_millis(node.cfg.timeouts.idle_ms),
        stream_idle: Duration::from_millis(node.cfg.timeouts.stream_idle_ms),
        started: false,
        node: Arc::clone(node),
        done: false,
        receipt,
        guard: relay.guard,
        _span: relay.span,
    };
    let stream = futures::stream::unfold(state, |mut st| async move {
        loop {
            if st.done {
                return None;
            }
            // Past the first chunk a guarded stream is a decode: silence means a hung engine.
            let idle = match (&st.guard, st.started) {
                (Some(_), true) => st.stream_idle,
                _ => st.idle,
            };
            let why = match tokio::time::timeout(idle, st.inner.next()).await {
                Ok(Some(Ok(chunk))) => {
                    st.started = true;
                    // Only the first call counts; the keys are freed with it.
                    st.ticket.first_byte(&std::mem::take(&mut st.keys));
                    if let Some(r) = &mut st.receipt {
                        r.feed(&chunk);
                    }
                    let out = match &mut st.guard {
                        Some(g) => g.pass(chunk),
                        None => chunk,
                    };
                    if out.is_empty() {
                        continue;
                    }
                    return Some((Ok(out), st));
                }
                Ok(Some(Err(e))) => e.to_string(),
                Ok(None) => match st.guard.as_mut().map(|g| g.end()) {
                    Some(None) => "the replica ended the stream before its end".to_owned(),
                    Some(Some(last)) => {
                        st.finished();
                        return (!last.is_empty()).then_some((Ok(last), st));
                    }
                    None => {
                        st.finished();
                        return None;
                    }
                },
                Err(_) => format!("no data from the replica for {idle:?}"),
            };
            if let Some(item) = st.failed(why).await {
                return Some((item, st));
            }
        }
    });
    let mut out = Response::new(Body::from_stream(stream));
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    out
}

type ByteStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = reqwest::Result<Bytes>> + Send + 'static>>;

struct BodyState {
    inner: ByteStream,
    ticket: Ticket,
    /// The request's block keys until its first byte (then empty).
    keys: Vec<BlockKey>,
    idle: Duration,
    node: Arc<Node>,
    done: bool,
    /// Longest silence between chunks of a guarded stream after its first.
    stream_idle: Duration,
    /// A chunk of the current answer arrived.
    started: bool,
    /// What the engine reports cached, read as the answer passes (successful answers).
    receipt: Option<Receipt>,
    /// A streamed answer's events and continuation (`resume.rs`).
    guard: Option<Box<StreamGuard>>,
    /// The request's span when the node traces: it ends when the body does.
    _span: Option<Span>,
}

impl Drop for BodyState {
    fn drop(&mut self) {
        // Not polled to its end: the answer still counts if the engine's report went by.
        if let Some(r) = self.receipt.take().filter(Receipt::reported) {
            r.finish(&self.node);
        }
    }
}

impl BodyState {
    /// The answer ended properly: its receipt counts; nothing more is read.
    fn finished(&mut self) {
        self.done = true;
        if let Some(r) = self.receipt.take() {
            r.finish(&self.node);
        }
    }

    /// The replica failed the answer (`why`): continue elsewhere (`None`: read on), or end the
    /// body — with the API's error event when guarded, else with an error (a cut).
    async fn failed(&mut self, why: String) -> Option<std::io::Result<Bytes>> {
        self.aborted(&why);
        let Some(guard) = self.guard.as_mut() else {
            self.done = true;
            return Some(Err(std::io::Error::other(why)));
        };
        match guard.recover(self.ticket.replica(), &why).await {
            Recovery::Continued { resp, ticket, keys } => {
                self.inner = Box::pin((*resp).bytes_stream());
                // The failed replica's booking is released as its ticket drops.
                self.ticket = ticket;
                self.keys = keys;
                self.started = false;
                None
            }
            Recovery::End(bytes) => {
                self.done = true;
                (!bytes.is_empty()).then_some(Ok(bytes))
            }
        }
    }

    fn aborted(&mut self, why: &str) {
        // A broken answer leaves no receipt: its usage (if any) is not what was served.
        self.receipt = None;
        let i = self.ticket.replica();
        let id: &str = &self.ticket.endpoint().id;
        tracing::warn!(replica = %id, error = %why, "response stream aborted");
        self.node
            .metrics
            .requests
            .with_label_values(&[id, self.node.policy().as_str(), "stream_aborted"])
            .inc();
        // A stream that broke after its first byte is the replica's doing.
        self.node
            .metrics
            .upstream_failures
            .with_label_values(&["replica"])
            .inc();
        self.node.request_failed(i);
    }
}
