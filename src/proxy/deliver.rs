//! The deliver stage: attempts at serving a decided request — to a replica, a P/D pair or
//! another region — with failover while nothing has reached the client.
//!
//! Exists to keep the data plane's rules in one place: the body is sent byte for byte; a replica
//! that fails before answering (connect error, first-byte timeout, 500/502/503/504) is retried
//! elsewhere within an attempt and time budget (its index joins `RouteRequest::exclude`); once
//! response headers go to the client the request is committed and never retried; a late stream
//! may be hedged once. A `Forward` decision (on the first attempt, or a retry with no local
//! candidate left) goes to another region (`region_forward.rs`). The request's block keys move
//! into the response body stream (no copy), whose first chunk hands them to
//! `Ticket::first_byte` (none for a non-2xx answer).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::Response;
use bytes::Bytes;

use super::blame::{Attempts, Failure};
use super::decide::{decide, AttemptCtx, Decided};
use super::error::{is_failure, upstream_cause, ApiError};
use super::pd;
use super::pd_leg::PairCtx;
use super::region_forward;
use super::respond::{decision_header, respond, Relay, DECISION_HEADER};
use super::resume::StreamGuard;
use super::trace_span::{self, RequestTrace};
use super::understand::Understood;
use crate::core::keys::BlockKey;
use crate::core::pd::PdPair;
use crate::core::router::{Decision, RouteRequest, Routed};
use crate::node::{Endpoint, HoldOutcome, Node, Ticket};

/// A body at least this big that every replica tried cut off mid-upload is answered with 413:
/// over someone's size limit is the likeliest reason.
const LIKELY_REFUSED_BODY_BYTES: usize = 1 << 20;

/// What a request's attempts share.
pub(crate) struct Delivery<'a> {
    pub node: &'a Arc<Node>,
    pub u: &'a Understood,
    /// Headers to send upstream (hop-by-hop removed, auth replaced).
    pub headers: HeaderMap,
    pub tenant: Option<&'a str>,
    pub class: Option<crate::core::priority::ClassId>,
    pub trace: Option<&'a RequestTrace>,
}

/// Where the attempts stand.
#[derive(Default)]
struct Progress {
    tried: Vec<usize>,
    attempts: Attempts,
    last_error: Option<ApiError>,
    /// The last replica error answer: more useful to the client than ours.
    last_failed_response: Option<(reqwest::Response, Ticket, u32)>,
}

/// An attempt the replica answered with a status that is not a failure: the client gets it.
/// (An attempt that failed before anything reached the client is booked in `Progress`.)
struct Served {
    resp: reqwest::Response,
    target: Target,
    sent_at: Instant,
}

/// Serves `route_req` (built over `d.u`, whose block keys are `keys`) with up to
/// `retry.max_attempts` attempts.
pub(crate) async fn deliver(
    d: Delivery<'_>,
    route_req: RouteRequest<'_>,
    mut keys: Vec<BlockKey>,
) -> Result<Response, ApiError> {
    let node = d.node;
    let budget = Duration::from_millis(node.cfg.retry.budget_ms);
    let mut started = Instant::now();
    // A pinned request (a stored response's follow-up) starts with every other replica out.
    let mut p = Progress {
        tried: route_req.exclude.to_vec(),
        ..Progress::default()
    };
    let pinned = !route_req.exclude.is_empty();
    // Under `[pd]` a pair's body is rewritten per leg: parsed as a tree (many times its size)
    // once the router names a pair, and only then.
    let pd_wanted = super::decide::pd_protocol(node).is_some() && pd_capable(d.u);
    let mut pd_map = None;
    for attempt in 0..node.cfg.retry.max_attempts {
        if attempt > 0 && started.elapsed() >= budget {
            break;
        }
        let attempt_req = RouteRequest {
            keys: &keys,
            exclude: &p.tried,
            ..route_req
        };
        let ctx = AttemptCtx {
            attempt,
            class: d.class,
            pd: pd_wanted,
        };
        match decide(node, &attempt_req, ctx).await {
            Decided::Refuse(e) => return Err(e),
            Decided::NoneLeft => break,
            Decided::Forward { region, reason } => {
                match forward(&d, &region, reason).await {
                    Ok(resp) => return Ok(resp),
                    Err(region_forward::ForwardError::RegionFailed(e)) => {
                        // Nothing reached the client: route again without that region (it may
                        // have gone dark while its record still stands).
                        node.mark_region_unreachable(&region);
                        p.last_error = Some(e);
                    }
                    Err(region_forward::ForwardError::Unavailable(e)) => return Err(e),
                }
            }
            Decided::Pair {
                pair,
                prefill,
                decode,
            } => {
                if pd_map.is_none() {
                    pd_map = Some(pd::json_object(&d.u.body).ok_or_else(pd::not_an_object)?);
                }
                let map = pd_map.as_ref().ok_or_else(pd::not_an_object)?;
                let served = serve_pair(&d, map, attempt, pair, prefill, decode, &keys).await;
                match served {
                    Ok(resp) => {
                        std::mem::take(&mut p.attempts).succeeded(node);
                        return Ok(resp);
                    }
                    Err((replica, failure, error)) => {
                        p.failed(node, replica, failure, error);
                    }
                }
            }
            Decided::Route { routed, ticket } => {
                if attempt == 0 {
                    // The retry budget counts from the slot, not from the wait for it.
                    started = Instant::now();
                } else {
                    node.metrics.retries.inc();
                }
                // A hedge is routed like the request, excluding only the replica it hedges.
                let hedge_req = RouteRequest {
                    keys: &keys,
                    ..route_req
                };
                let ctx = Attempt {
                    d: &d,
                    route_req: &hedge_req,
                    number: attempt,
                    pinned,
                };
                if let Some(Served {
                    resp,
                    target,
                    sent_at,
                }) = ctx.run(routed, ticket, &keys, &mut p).await
                {
                    std::mem::take(&mut p.attempts).succeeded(node);
                    // Nothing else needs the keys once a replica answered: they go with the
                    // response, whose first byte records them (see `Ticket::first_byte`).
                    let keys = std::mem::take(&mut keys);
                    return Ok(relay(&d, resp, target, sent_at, keys));
                }
            }
        }
    }
    gave_up(&d, p)
}

/// Whether the request may run as a P/D pair: the adapters rewrite OpenAI bodies only.
fn pd_capable(u: &Understood) -> bool {
    matches!(
        u.api,
        crate::core::dialect::Api::Completions | crate::core::dialect::Api::Chat
    )
}

impl Progress {
    fn failed(&mut self, node: &Arc<Node>, replica: usize, failure: Failure, error: String) {
        self.attempts.failed(node, replica, failure);
        self.tried.push(replica);
        self.last_error = Some(ApiError::bad_gateway(error));
    }
}

/// Every attempt failed: the answer the client gets.
fn gave_up(d: &Delivery<'_>, p: Progress) -> Result<Response, ApiError> {
    let cut = p.attempts.all_cut();
    let big = d.u.body.len() > LIKELY_REFUSED_BODY_BYTES;
    let request_blamed = p.attempts.gave_up(d.node, big);
    if request_blamed && cut && big {
        // Replicas (or proxies before them) commonly cut the connection on a body over their
        // limit instead of answering 413.
        return Err(ApiError::refused_as_too_large(d.u.body.len()));
    }
    if let Some((resp, ticket, hit)) = p.last_failed_response {
        let relay = Relay::new(d.u.api, hit, d.trace.map(|t| t.span().clone()));
        return Ok(respond(d.node, resp, ticket, Vec::new(), relay));
    }
    Err(p
        .last_error
        .unwrap_or_else(|| ApiError::unavailable("no replica could take the request")))
}

/// A `Forward` decision: the request to a node of `region`, with its tenant.
async fn forward(
    d: &Delivery<'_>,
    region: &str,
    reason: crate::core::router::ForwardReason,
) -> Result<Response, region_forward::ForwardError> {
    let mut headers = d.headers.clone();
    if let Some(v) = d.tenant.and_then(|t| HeaderValue::from_str(t).ok()) {
        headers.insert(HeaderName::from_static(region_forward::TENANT_HEADER), v);
    }
    if let Some(t) = d.trace {
        t.forwarding(region, reason);
    }
    region_forward::forward(
        d.node,
        region,
        reason,
        d.u.path,
        &headers,
        d.u.body.clone(),
        d.trace.map(RequestTrace::span),
    )
    .await
}

/// A P/D pair's two legs; a failed leg names its replica, the failure and the error.
async fn serve_pair(
    d: &Delivery<'_>,
    map: &serde_json::Map<String, serde_json::Value>,
    attempt: u32,
    pair: PdPair,
    prefill: Ticket,
    decode: Ticket,
    keys: &[BlockKey],
) -> Result<Response, (usize, Failure, String)> {
    let Some(protocol) = super::decide::pd_protocol(d.node) else {
        return Err((pair.decode, Failure::Status, "P/D is off".into()));
    };
    if attempt > 0 {
        d.node.metrics.retries.inc();
    }
    let ctx = PairCtx {
        node: d.node,
        path: d.u.path,
        headers: &d.headers,
        body: map,
        first_byte: first_byte_timeout(d.node, d.u.stream(), 0.0),
        trace: d.trace,
    };
    // The legs take a copy of the keys into the answer.
    let mut leg_keys = keys.to_vec();
    pd::serve_pair(&ctx, protocol, pair, prefill, decode, &mut leg_keys)
        .await
        .map_err(|f| {
            tracing::warn!(leg = f.leg, attempt, error = %f.error, "disaggregated leg failed");
            (f.replica, f.failure, f.error)
        })
}

/// How far past the replica's predicted time to first token it may answer before it counts
/// as not answering.
const FIRST_BYTE_OVER_PREDICTION: f64 = 2.0;

/// The wait for an attempt's first byte. Streams send their headers before the prefill (some
/// engines and proxies only at the first token); a whole completion only when done. A replica
/// predicted to need longer than the configured wait (a 100k-token prompt behind a queue)
/// gets [`FIRST_BYTE_OVER_PREDICTION`] × its prediction, up to `timeouts.first_byte_ms` (what a
/// whole answer may take): a fixed timeout would blame it for the work it was sent to do, and
/// the retry elsewhere recomputes the whole prompt (issue #38: agentic turns failed and were
/// recomputed at 10 s). A wait past `retry.budget_ms` leaves no retry: the request stays where
/// its prompt is being computed.
fn first_byte_timeout(node: &Node, stream: bool, predicted_s: f64) -> Duration {
    let configured = if stream {
        node.cfg.timeouts.stream_first_byte_ms
    } else {
        node.cfg.timeouts.first_byte_ms
    };
    let scaled = Duration::try_from_secs_f64(predicted_s * FIRST_BYTE_OVER_PREDICTION)
        .unwrap_or_default()
        .min(Duration::from_millis(node.cfg.timeouts.first_byte_ms));
    Duration::from_millis(configured).max(scaled)
}

/// How long an attempt waits for its first byte: a first wait, then more while the replica
/// shows it is working through its queue.
#[derive(Clone, Copy, Debug)]
struct FirstByteWait {
    /// The first wait ([`first_byte_timeout`]).
    first: Duration,
    /// Each further wait, granted when the replica made progress during the last one: the
    /// configured wait (`timeouts.stream_first_byte_ms` for a stream).
    further: Duration,
    /// When the attempt was sent; no wait runs past `timeouts.first_byte_ms` from then.
    since: Instant,
    /// Most time from `since` to the first byte (`timeouts.first_byte_ms`).
    cap: Duration,
    /// The replica's progress count when the attempt was sent (`Node::replica_progress`).
    mark: Option<u64>,
}

impl FirstByteWait {
    /// The wait of an attempt sent now to replica `replica`, predicted to answer in
    /// `predicted_s`.
    /// The prediction is scaled by how late the replica's first bytes have come against
    /// predictions (`Node::replica_progress`): a 120k-token prefill the node predicts at 2.4 s
    /// takes the engine ~8 s alone, and no other request there gets a first byte meanwhile.
    fn start(node: &Node, replica: usize, stream: bool, predicted_s: f64) -> Self {
        let t = &node.cfg.timeouts;
        let facts = node.replica_progress(replica);
        let lag = facts.map_or(1.0, |(_, lag)| lag);
        FirstByteWait {
            first: first_byte_timeout(node, stream, predicted_s * lag),
            further: Duration::from_millis(if stream {
                t.stream_first_byte_ms
            } else {
                t.first_byte_ms
            }),
            since: Instant::now(),
            cap: Duration::from_millis(t.first_byte_ms),
            mark: facts.map(|(progress, _)| progress),
        }
    }

    /// The same wait with `spent` of its first wait gone (the part before a hedge).
    fn after(mut self, spent: Duration) -> Self {
        self.first = self.first.saturating_sub(spent);
        self
    }
}

/// `send`'s answer from replica `replica`, or `None` when the wait runs out. A replica that
/// sent nothing within the wait keeps the request for another wait as long as its progress
/// count moved during the last one (requests before this one there got their first bytes, at
/// this node or at the region's others): a stream queued behind long prefills at a working
/// replica is not retried elsewhere, where it would recompute its whole prompt (issue #38: at
/// three nodes, each node's prediction misses the queue the others make, and 10 s waits retried
/// 23–83 agentic turns). A stuck replica moves nothing and loses the request after one wait.
async fn await_first_byte<T>(
    node: &Node,
    replica: usize,
    wait: FirstByteWait,
    mut send: impl std::future::Future<Output = T> + Unpin,
) -> Option<T> {
    let mut window = wait.first;
    let mut mark = wait.mark;
    loop {
        if let Ok(answer) = tokio::time::timeout(window, &mut send).await {
            return Some(answer);
        }
        let left = wait.cap.saturating_sub(wait.since.elapsed());
        let now = node.replica_progress(replica).map(|(progress, _)| progress);
        let moved = matches!((mark, now), (Some(a), Some(b)) if a != b);
        if !moved || left.is_zero() {
            return None;
        }
        node.metrics.first_byte_waits_extended.inc();
        mark = now;
        window = wait.further.min(left);
    }
}

/// One attempt at a local replica.
struct Attempt<'a, 'd> {
    d: &'a Delivery<'d>,
    route_req: &'a RouteRequest<'a>,
    number: u32,
    /// Only one replica may serve it: never hedged elsewhere.
    pinned: bool,
}

/// The replica an attempt is at (a won hedge replaces it).
struct Target {
    routed: Routed,
    ticket: Ticket,
    endpoint: Endpoint,
    span: Option<tracing::Span>,
}

impl Attempt<'_, '_> {
    /// Sends the request to the routed replica (hedging a late stream), and either relays the
    /// answer or records the failure in `p`.
    async fn run(
        &self,
        routed: Routed,
        ticket: Ticket,
        keys: &[BlockKey],
        p: &mut Progress,
    ) -> Option<Served> {
        let trace = self.d.trace;
        let endpoint = ticket.endpoint().clone();
        tracing::debug!(
            replica = %endpoint.id, hit_blocks = routed.hit_blocks,
            reason = routed.reason.as_str(), attempt = self.number, "routed"
        );
        let mut headers = None;
        let mut span = None;
        if let Some(t) = trace {
            t.routed(&routed, &endpoint.id, ticket.hit_tokens(), self.number + 1);
            let s = t.attempt(&endpoint.id, self.number + 1);
            let mut h = self.d.headers.clone();
            trace_span::inject(&s, &mut h);
            headers = Some(h);
            span = Some(s);
        }
        let mut target = Target {
            routed,
            ticket,
            endpoint,
            span,
        };
        let headers = headers.as_ref().unwrap_or(&self.d.headers);
        // A planned KV pull goes in the body, in the form the replica takes (`kv_hint.rs`).
        let hinted =
            super::kv_hint::hinted_body(self.d.node, target.routed.fetch.as_ref(), &self.d.u.body);
        let body = hinted.as_ref().unwrap_or(&self.d.u.body);
        // While the replica still computes the prompt this request was credited with, the
        // request waits for that prefill's first byte: sent now, the engine would recompute it
        // in parallel (`node/hold.rs`). This node's own prefills first, then the region's
        // other nodes' (known by their tips).
        let (node, r) = (self.d.node, &target.routed);
        if node.holds.before_send(r.replica, keys, r.hit_blocks).await == HoldOutcome::NotHeld {
            node.hold_on_peer_prefill(r.replica, keys, r.hit_blocks)
                .await;
        }
        let sent_at = Instant::now();
        let answer = self
            .send_hedged(&mut target, headers, body, keys, &mut p.tried)
            .await;
        if let Some(span) = target.span.take() {
            let (status, error) = match &answer {
                Some(Ok(resp)) => (Some(resp.status()), None),
                Some(Err(e)) if e.is_connect() => (None, Some("connect")),
                Some(Err(_)) => (None, Some("transport")),
                None => (None, Some("timeout")),
            };
            trace_span::attempt_done(&span, status, error);
        }
        self.settle(answer, target, sent_at, keys, p)
    }

    /// The answer of the routed replica within the first-byte timeout (`None`: nothing came).
    /// A first attempt late past `retry.hedge_after_ms` (a stream) or
    /// `retry.hedge_whole_after_ms` (a whole answer) is also sent to the next best replica; the
    /// first answer wins and the other is dropped (its engine sees the connection close). The
    /// loser is not blamed: slow is not failed.
    async fn send_hedged(
        &self,
        t: &mut Target,
        headers: &HeaderMap,
        body: &Bytes,
        keys: &[BlockKey],
        tried: &mut Vec<usize>,
    ) -> Option<reqwest::Result<reqwest::Response>> {
        let (node, u) = (self.d.node, &self.d.u);
        let wait = FirstByteWait::start(node, t.routed.replica, u.stream(), t.routed.predicted_s);
        let first_byte = wait.first;
        let mut send = std::pin::pin!(send_to(
            node,
            &t.endpoint,
            t.ticket.rank(),
            u.path,
            headers,
            body
        ));
        let retry = &node.cfg.retry;
        let hedge_after = Duration::from_millis(if u.stream() {
            retry.hedge_after_ms
        } else {
            retry.hedge_whole_after_ms
        });
        let hedged = self.number == 0 && !self.pinned;
        let replica = t.routed.replica;
        if !hedged || hedge_after.is_zero() || hedge_after >= first_byte {
            return await_first_byte(node, replica, wait, send).await;
        }
        if let Ok(r) = tokio::time::timeout(hedge_after, &mut send).await {
            return Some(r);
        }
        let left = first_byte - hedge_after;
        let Some(_slot) = HedgeSlot::take(node) else {
            node.metrics
                .hedges
                .with_label_values(&["over_budget"])
                .inc();
            return await_first_byte(node, replica, wait.after(hedge_after), send).await;
        };
        let exclude = [replica];
        let (Decision::Route(r2), Some(t2)) = node.route(&RouteRequest {
            exclude: &exclude,
            ..*self.route_req
        }) else {
            return await_first_byte(node, replica, wait.after(hedge_after), send).await;
        };
        let e2 = t2.endpoint().clone();
        // The hedge is an attempt of its own, with its own span.
        let mut hedge_span = None;
        let hedge_headers = self.d.trace.map(|tr| {
            let span = tr.attempt(&e2.id, self.number + 2);
            let mut h = headers.clone();
            trace_span::inject(&span, &mut h);
            hedge_span = Some(span);
            h
        });
        let hedge = std::pin::pin!(send_to(
            node,
            &e2,
            t2.rank(),
            u.path,
            hedge_headers.as_ref().unwrap_or(headers),
            &u.body
        ));
        node.metrics.hedges.with_label_values(&["sent"]).inc();
        match tokio::time::timeout(left, futures::future::select(send, hedge)).await {
            Ok(futures::future::Either::Left((r, _))) => {
                node.metrics.hedges.with_label_values(&["first_won"]).inc();
                t2.failed(keys);
                Some(r)
            }
            Ok(futures::future::Either::Right((r, _))) => {
                node.metrics.hedges.with_label_values(&["hedge_won"]).inc();
                std::mem::replace(&mut t.ticket, t2).failed(keys);
                tried.push(t.routed.replica);
                if let Some(tr) = self.d.trace {
                    tr.routed(&r2, &e2.id, t.ticket.hit_tokens(), self.number + 2);
                }
                // The first attempt's span ends (unanswered); the hedge's records the outcome.
                t.span = hedge_span;
                (t.routed, t.endpoint) = (r2, e2);
                // A hedge goes without a KV-fetch hint.
                t.routed.fetch = None;
                Some(r)
            }
            Err(_) => {
                t2.failed(keys);
                None
            }
        }
    }

    /// Relays a served answer, or books the failure. What the client is told stays free of
    /// replica names and addresses; the log has them.
    fn settle(
        &self,
        answer: Option<reqwest::Result<reqwest::Response>>,
        t: Target,
        sent_at: Instant,
        keys: &[BlockKey],
        p: &mut Progress,
    ) -> Option<Served> {
        let node = self.d.node;
        let i = t.routed.replica;
        let (failure, error) = match answer {
            Some(Ok(resp)) if !is_failure(resp.status()) => {
                return Some(Served {
                    resp,
                    target: t,
                    sent_at,
                })
            }
            Some(Ok(resp)) => {
                let msg = format!("the replica answered {}", resp.status());
                if let Some((_, earlier, _)) = p.last_failed_response.take() {
                    earlier.failed(keys);
                }
                p.last_failed_response = Some((resp, t.ticket, t.routed.hit_blocks));
                (Failure::Status, msg)
            }
            Some(Err(e)) => {
                t.ticket.failed(keys);
                let failure = if e.is_connect() {
                    Failure::Connect
                } else {
                    Failure::Transport
                };
                (
                    failure,
                    format!("the replica failed: {}", upstream_cause(e)),
                )
            }
            None => {
                t.ticket.failed(keys);
                // The wait may have grown while the replica made progress: say what it was.
                let waited = Duration::from_millis(sent_at.elapsed().as_millis() as u64);
                let msg = format!("the replica sent nothing within {waited:?}");
                (Failure::Timeout, msg)
            }
        };
        tracing::warn!(replica = %t.endpoint.id, url = %t.endpoint.base, attempt = self.number, error = %error, "attempt failed");
        node.metrics
            .requests
            .with_label_values(&[&t.endpoint.id, node.policy().as_str(), "failed"])
            .inc();
        p.failed(node, i, failure, error);
        None
    }
}

/// The replica answered: count it and stream the answer to the client.
fn relay(
    d: &Delivery<'_>,
    resp: reqwest::Response,
    t: Target,
    sent_at: Instant,
    keys: Vec<BlockKey>,
) -> Response {
    let node = d.node;
    let replica_id: &str = &t.endpoint.id;
    let first_byte_s = sent_at.elapsed().as_secs_f64();
    node.metrics
        .first_byte_seconds
        .with_label_values(&[replica_id])
        .observe(first_byte_s);
    // Streamed responses start at the first token; others only when complete.
    let stream_ok = d.u.stream() && resp.status().is_success();
    if stream_ok {
        tracing::debug!(
            target: "kvmesh::load_view", replica = %replica_id,
            predicted_ms = (t.routed.predicted_s * 1000.0) as u64,
            first_byte_ms = (first_byte_s * 1000.0) as u64, "first byte"
        );
        node.metrics
            .decisions
            .prediction(t.routed.predicted_s, first_byte_s);
    }
    if stream_ok {
        node.stream_answered(t.routed.replica, t.routed.predicted_s, first_byte_s);
    } else {
        node.request_succeeded(t.routed.replica);
    }
    let outcome = if resp.status().is_success() {
        "ok"
    } else {
        "client_error"
    };
    node.metrics
        .requests
        .with_label_values(&[replica_id, node.policy().as_str(), outcome])
        .inc();
    let rank = t.ticket.rank().map(|r| r.rank);
    // A stream whose replica fails mid-way continues elsewhere (`resume.rs`).
    let guard = StreamGuard::for_answer(node, d.u, &d.headers, d.tenant, d.class, &resp);
    let relay = Relay::new(
        d.u.api,
        t.routed.hit_blocks,
        d.trace.map(|tr| tr.span().clone()),
    )
    .branch(t.routed.branch())
    .fetch(t.routed.fetch.map_or(0, |f| f.fetched_tokens()))
    .offered(super::kv_hint::offered_pull(node, t.routed.fetch.as_ref()))
    .guard(guard);
    let mut out = respond(node, resp, t.ticket, keys, relay);
    if node.cfg.debug_headers {
        if let Ok(v) = HeaderValue::from_str(&decision_header(&t.routed, rank)) {
            out.headers_mut()
                .insert(HeaderName::from_static(DECISION_HEADER), v);
        }
    }
    out
}

/// Sends the request's original bytes to replica `endpoint` (pinned by the caller, on its stack),
/// naming the data-parallel `rank` the node chose, if any (header, or body field for SGLang).
pub(super) fn send_to(
    node: &Node,
    endpoint: &Endpoint,
    rank: Option<crate::node::RankTarget>,
    path: &str,
    headers: &HeaderMap,
    body: &Bytes,
) -> impl std::future::Future<Output = reqwest::Result<reqwest::Response>> {
    let req = node
        .client
        .post(format!("{}{}", endpoint.base, path))
        .headers(headers.clone());
    match rank {
        Some(rank) => {
            node.metrics.decisions.dp_rank_named.inc();
            rank.apply(req, body)
        }
        None => req.body(body.clone()),
    }
    .send()
}

/// A hedge's place in the node's hedge budget: at most a fifth of the requests awaiting
/// response headers (at least 3) are hedged at once — Envoy's retry budget defaults. A fleet
/// slow because it is overloaded would otherwise get a second copy of every late request
/// exactly when it can least take it.
struct HedgeSlot<'a>(&'a Node);

impl<'a> HedgeSlot<'a> {
    fn take(node: &'a Node) -> Option<Self> {
        use std::sync::atomic::Ordering;
        let budget = (node.metrics.in_flight_total.get() / 5).max(3);
        let held = node.hedges_in_flight.fetch_add(1, Ordering::AcqRel);
        if held >= budget {
            node.hedges_in_flight.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(HedgeSlot(node))
    }
}

impl Drop for HedgeSlot<'_> {
    fn drop(&mut self) {
        self.0
            .hedges_in_flight
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::config::NodeConfig;

    /// A stream waits the configured 10 s for a replica predicted quick, twice the prediction
    /// for one predicted slow (a long prompt behind a queue), and never past what a whole
    /// answer may take; a nonsense prediction changes nothing.
    #[test]
    fn a_first_byte_wait_follows_the_predicted_time_to_first_token() {
        crate::proxy::install_crypto_provider();
        let node = Node::new(NodeConfig::default()).unwrap();
        let wait = |stream, predicted_s| first_byte_timeout(&node, stream, predicted_s);
        assert_eq!(wait(true, 0.5), Duration::from_secs(10));
        assert_eq!(wait(true, 20.0), Duration::from_secs(40));
        assert_eq!(
            wait(true, 1e9),
            Duration::from_secs(300),
            "capped at first_byte_ms"
        );
        assert_eq!(wait(true, f64::NAN), Duration::from_secs(10));
        assert_eq!(wait(true, -5.0), Duration::from_secs(10));
        assert_eq!(wait(false, 20.0), Duration::from_secs(300));
    }

    /// Issue #38: a replica whose first bytes came 3× later than predicted gets 3× the
    /// prediction-scaled wait (a lone 120k-token prefill is no longer retried at 10 s); one
    /// never observed, or not taking requests, the plain one.
    #[test]
    fn a_first_byte_wait_scales_with_the_replicas_observed_lag() {
        crate::proxy::install_crypto_provider();
        let cfg = NodeConfig {
            replicas: vec![crate::replicas::entry::ReplicaConfig {
                id: Some("r0".into()),
                models: vec!["m".into()],
                ..crate::replicas::entry::ReplicaConfig::from_url("http://10.0.0.1:8000")
            }],
            ..NodeConfig::default()
        };
        let node = Node::new(cfg).unwrap();
        let first = |predicted_s| FirstByteWait::start(&node, 0, true, predicted_s).first;
        assert_eq!(first(8.0), Duration::from_secs(16));
        for _ in 0..100 {
            node.stream_answered(0, 2.0, 6.0);
        }
        let scaled = first(8.0).as_secs_f64();
        assert!((scaled - 48.0).abs() < 1.0, "{scaled}");
        assert_eq!(
            first(1.0),
            Duration::from_secs(10),
            "still at least the configured wait"
        );
        assert_eq!(
            FirstByteWait::start(&node, 7, true, 8.0).first,
            Duration::from_secs(16),
            "no such replica: the prediction alone"
        );
    }

    /// Hedging cannot double an overloaded fleet's load: a fifth of the requests awaiting
    /// headers (at least 3) are hedged at once, and a slot comes back when its hedge ends.
    #[test]
    fn hedges_in_flight_stay_within_a_fifth_of_the_waiting_requests() {
        crate::proxy::install_crypto_provider();
        let node = Node::new(NodeConfig::default()).unwrap();
        let few: Vec<_> = std::iter::from_fn(|| HedgeSlot::take(&node))
            .take(10)
            .collect();
        assert_eq!(few.len(), 3, "a quiet node: 3 hedges at a time");
        drop(few);
        node.metrics.in_flight_total.set(40);
        let slots: Vec<_> = std::iter::from_fn(|| HedgeSlot::take(&node))
            .take(20)
            .collect();
        assert_eq!(slots.len(), 8, "40 waiting requests: 8 hedges");
        drop(slots);
        assert_eq!(
            node.hedges_in_flight
                .load(std::sync::atomic::Ordering::Acquire),
            0
        );
    }
}
