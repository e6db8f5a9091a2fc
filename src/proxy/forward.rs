//! The request path: read and parse the body once, route, send the original bytes to the chosen
//! replica, fail over while nothing has reached the client, and stream the answer back unbuffered.
//!
//! Exists to keep the data plane's rules in one place: the body is forwarded byte for byte (the
//! node only reads the fields routing needs); a replica that fails before answering (connect
//! error, first-byte timeout, 500/502/503/504) is retried elsewhere within an attempt and time
//! budget; once response headers go to the client the request is committed and never retried; a
//! silent stream is cut after the idle timeout.
//!
//! Failover passes the replicas already tried as `RouteRequest::exclude`; the core leaves them
//! out without touching the view. In a mesh, a `Forward` decision (on the first attempt, or on a
//! retry with no local candidate left) goes to another region (`region_forward.rs`); without a
//! mesh, a first-attempt `Forward` answers 503. The request's block keys move into the response
//! body stream (no copy), whose first chunk hands them to `Ticket::first_byte` (none for a
//! non-2xx answer).
//!
//! When the node traces (`trace_span.rs`), the request runs inside its `kvmesh.route` span, each
//! attempt's `traceparent` is its own `kvmesh.upstream` span, and the body stream holds the
//! request span until it ends; otherwise none of that exists.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use tracing::Instrument;

use super::blame::{Attempts, Failure};
use super::error::{is_failure, upstream_cause, ApiError};
use super::listener::conn_info;
use super::pd;
use super::pd_leg::PairCtx;
use super::region_forward;
use super::respond::{decision_header, is_hop_header, respond};
use super::trace_span::{self, RequestTrace};
use crate::core::keys::{text_block_keys, BlockKey, Namespace};
use crate::core::prompt::{Prompt, RoutingFields};
use crate::core::router::{Decision, RejectReason, RouteRequest};
use crate::node::config::server::key_digest;
use crate::node::{Node, PdRoute, Ticket};

thread_local! {
    /// Routing text buffer, reused by every request handled on this thread (rendering is
    /// synchronous, so no request holds it across an await).
    static TEXT: RefCell<String> = RefCell::new(String::with_capacity(16 * 1024));
}

pub use super::respond::{DECISION_HEADER, HIT_HEADER, REPLICA_HEADER};

/// Token-mode requests with a body over this many bytes are tokenized on the blocking pool.
const BLOCKING_TOKENIZE_BYTES: usize = 64 * 1024;

/// A body at least this big that every replica tried cut off mid-upload is answered with 413:
/// over someone's size limit is the likeliest reason.
const LIKELY_REFUSED_BODY_BYTES: usize = 1 << 20;

/// `POST /v1/completions`.
pub async fn completions(State(node): State<Arc<Node>>, req: Request) -> Response {
    handle(node, "/v1/completions", req).await
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(State(node): State<Arc<Node>>, req: Request) -> Response {
    handle(node, "/v1/chat/completions", req).await
}

/// Counts a request in `kvmesh_in_flight_total` until dropped, which also covers a client that
/// disconnects while the node waits for the replica (the handler future is then dropped).
struct Pending(prometheus::IntGauge);

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.dec();
    }
}

async fn handle(node: Arc<Node>, path: &'static str, mut req: Request) -> Response {
    node.metrics.in_flight_total.inc();
    let _pending = Pending(node.metrics.in_flight_total.clone());
    // Only a mesh peer (mutual TLS) may say a request was forwarded already: a client's hop
    // header would turn cross-region forwarding off for its request.
    if !conn_info(&req).is_some_and(|c| c.peer) {
        req.headers_mut().remove(region_forward::HOP_HEADER);
    }
    let hop = req.headers().contains_key(region_forward::HOP_HEADER);
    // `None` unless the node traces: then nothing below costs anything for tracing.
    let trace = RequestTrace::start(&node, path, req.headers(), hop);
    let result = match &trace {
        Some(t) => {
            // Events inside (a failed attempt, say) become events of the request's span.
            proxy(&node, path, req, Some(t))
                .instrument(t.span().clone())
                .await
        }
        None => proxy(&node, path, req, None).await,
    };
    if let Some(t) = &trace {
        t.finish(match &result {
            Ok(r) => r.status(),
            Err(e) => e.status,
        });
    }
    match result {
        Ok(mut r) => {
            // Echoed so the client (and tests) can see the request crossed regions.
            if hop && node.cfg.debug_headers {
                r.headers_mut().insert(
                    HeaderName::from_static(region_forward::HOP_HEADER),
                    HeaderValue::from_static("1"),
                );
            }
            r
        }
        Err(e) => {
            let outcome = match e.status {
                StatusCode::NOT_FOUND => "unknown_model",
                StatusCode::TOO_MANY_REQUESTS => "over_quota",
                StatusCode::SERVICE_UNAVAILABLE => "unavailable",
                StatusCode::BAD_GATEWAY => "failed",
                s if s.is_client_error() => "bad_request",
                _ => "error",
            };
            node.metrics
                .requests
                .with_label_values(&["", node.policy().as_str(), outcome])
                .inc();
            e.into_response()
        }
    }
}

/// Reads the whole body within `node`'s limits: at most `max_body_bytes` (else 413), within
/// `server.body_read_timeout_ms` (else 408), and only while the node's budget of buffered body
/// bytes has room (waits for it within the same deadline, else 503). The returned permit holds
/// the body's share of the budget; drop it with the body.
async fn read_body<'n>(
    node: &'n Node,
    body: Body,
    headers: &HeaderMap,
) -> Result<(Bytes, tokio::sync::SemaphorePermit<'n>), ApiError> {
    let limit = node.cfg.max_body_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::too_large(limit));
    }
    let deadline = Duration::from_millis(node.cfg.server.body_read_timeout_ms);
    let read = async {
        let kib = |bytes: usize| u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX);
        let budget_full = || ApiError::unavailable("the node is holding too many request bodies");
        // A declared length is reserved whole, up front; a chunked body as it grows.
        let first = declared.map_or(1 << 20, |n| n as usize).max(1024);
        let mut permit = node
            .body_budget
            .acquire_many(kib(first))
            .await
            .map_err(|_| budget_full())?;
        let mut held = first;
        let mut stream = body.into_data_stream();
        let mut buf = BytesMut::with_capacity(declared.unwrap_or(0) as usize);
        while let Some(chunk) = stream.next().await {
            let chunk =
                chunk.map_err(|e| ApiError::bad_request(format!("cannot read body: {e}"), None))?;
            if buf.len() + chunk.len() > limit {
                return Err(ApiError::too_large(limit));
            }
            if buf.len() + chunk.len() > held {
                let more = (buf.len() + chunk.len()).max(held * 2).min(limit) - held;
                let extra = node
                    .body_budget
                    .acquire_many(kib(more))
                    .await
                    .map_err(|_| budget_full())?;
                permit.merge(extra);
                held += more;
            }
            buf.extend_from_slice(&chunk);
        }
        Ok((buf.freeze(), permit))
    };
    match tokio::time::timeout(deadline, read).await {
        Ok(r) => r,
        Err(_) => Err(ApiError::body_timeout(deadline)),
    }
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty())
}

fn forwardable(headers: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(headers.len());
    for (k, v) in headers {
        if !is_hop_header(k) {
            out.append(k.clone(), v.clone());
        }
    }
    out
}

async fn proxy(
    node: &Arc<Node>,
    path: &'static str,
    req: Request,
    trace: Option<&RequestTrace>,
) -> Result<Response, ApiError> {
    let mut started = Instant::now();
    let (parts, body) = req.into_parts();
    // With API keys the key names the tenant; a tenant header proves nothing. A request a mesh
    // peer forwarded was checked there: its tenant travels in `TENANT_HEADER`.
    let from_peer = parts
        .extensions
        .get::<super::listener::ConnInfo>()
        .is_some_and(|c| c.peer);
    let key_tenant = match &node.secrets.api_keys {
        None => None,
        Some(_) if from_peer => header_str(&parts.headers, region_forward::TENANT_HEADER),
        Some(keys) => {
            let key = super::auth::bearer(&parts.headers).ok_or_else(ApiError::missing_api_key)?;
            Some(
                keys.get(&key_digest(key.as_bytes()))
                    .ok_or_else(ApiError::missing_api_key)?
                    .as_str(),
            )
        }
    };
    let (body, _budget) = read_body(node, body, &parts.headers).await?;
    let fields = RoutingFields::parse(&body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}"), None))?;
    let model = fields
        .model
        .as_deref()
        .filter(|m| !m.is_empty())
        .ok_or_else(|| ApiError::bad_request("the request has no 'model'", Some("model")))?;
    let tenant = match key_tenant {
        Some(t) => Some(t),
        None if node.secrets.api_keys.is_some() => None,
        None => header_str(&parts.headers, &node.cfg.tenant_header),
    };
    let session = header_str(&parts.headers, &node.cfg.session_header).or(fields.user.as_deref());
    let ns = Namespace::new(
        model,
        fields.lora_path.as_deref(),
        fields.cache_salt.as_deref(),
        tenant.filter(|_| node.tenant_isolated(tenant)),
    );
    let mut keys: Vec<BlockKey> = Vec::new();
    // Token mode (keys that match engine KV events) when configured; text mode otherwise.
    let isolated = tenant.filter(|_| node.tenant_isolated(tenant));
    let token_prompt = if node.tokenizer.is_some() && body.len() > BLOCKING_TOKENIZE_BYTES {
        // Tokenizing a long prompt takes milliseconds to seconds: not on an async worker.
        let (n, b) = (Arc::clone(node), body.clone());
        let owned = |s: Option<&str>| s.map(str::to_owned);
        let (m, lora, salt, iso) = (
            model.to_owned(),
            owned(fields.lora_path.as_deref()),
            owned(fields.cache_salt.as_deref()),
            owned(isolated),
        );
        let mut k = std::mem::take(&mut keys);
        let (prompt, k) = tokio::task::spawn_blocking(move || {
            let p = n.token_keys(
                &b,
                &m,
                lora.as_deref(),
                salt.as_deref(),
                iso.as_deref(),
                &mut k,
            );
            (p, k)
        })
        .await
        .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))?;
        keys = k;
        prompt
    } else {
        node.token_keys(
            &body,
            model,
            fields.lora_path.as_deref(),
            fields.cache_salt.as_deref(),
            isolated,
            &mut keys,
        )
    };
    if token_prompt.is_some() {
        // Token keys: counted as heat, but their text is not the engine's prompt to warm.
        node.observe_hot(model, &keys, None);
    }
    let prompt_tokens = token_prompt.map(Ok).unwrap_or_else(|| {
        TEXT.with(|text| {
            let mut text = text.borrow_mut();
            let rendered = fields.render(&mut text);
            if rendered.is_ok() {
                text_block_keys(ns, text.as_bytes(), node.cfg.block_bytes, &mut keys);
                // A completions prompt given as one string is the engine's prompt, byte for
                // byte: a warm-up can reproduce it. Chat (templated) and token prompts cannot.
                let exact = fields.messages.is_none()
                    && matches!(fields.prompt, Some(Prompt::Text(_)))
                    && path == "/v1/completions";
                let prompt = exact.then_some(text.as_str());
                node.observe_hot(model, &keys, prompt);
            }
            let tokens = text.len() as u64 / 4;
            // A huge prompt should not pin its buffer on this thread forever.
            if text.capacity() > 1 << 20 {
                *text = String::with_capacity(16 * 1024);
            }
            rendered.map(|()| tokens)
        })
    });
    let prompt_tokens = prompt_tokens.map_err(|e| ApiError::bad_request(e.to_string(), None))?;
    if let Some(t) = trace {
        t.request(model, tenant, prompt_tokens);
    }
    let route_req = RouteRequest {
        model,
        keys: &keys,
        prompt_tokens,
        session,
        affinity_key: header_str(&parts.headers, &node.cfg.affinity_header),
        tenant,
        // A request another node forwarded is served here or refused, never forwarded again.
        forwarded: parts.headers.contains_key(region_forward::HOP_HEADER),
        exclude: &[],
    };
    let mut headers = forwardable(&parts.headers);
    if node.secrets.api_keys.is_some() {
        // The client's key is for this node; replicas get the operator's token, if any.
        headers.remove(header::AUTHORIZATION);
        if let Some(v) = node
            .secrets
            .replica_token
            .as_deref()
            .and_then(|t| HeaderValue::from_str(&format!("Bearer {t}")).ok())
        {
            headers.insert(header::AUTHORIZATION, v);
        }
    }
    // With `[priorities]`: the request's class, from its tenant and the priority header.
    let class = node.priority_class(
        tenant,
        node.cfg
            .priorities
            .as_ref()
            .and_then(|p| header_str(&parts.headers, &p.header)),
    );
    let budget = Duration::from_millis(node.cfg.retry.budget_ms);
    let policy = node.policy().as_str();

    let mut tried: Vec<usize> = Vec::new();
    let mut attempts = Attempts::default();
    let mut last_error: Option<ApiError> = None;
    let mut last_failed_response: Option<(reqwest::Response, Ticket, u32)> = None;
    // Streams send their headers before the prefill; a whole completion only when done.
    let first_byte = Duration::from_millis(if fields.stream == Some(true) {
        node.cfg.timeouts.stream_first_byte_ms
    } else {
        node.cfg.timeouts.first_byte_ms
    });
    // Under `[pd]` the body is rewritten per leg: parsed once, here.
    let pd_on = node.cfg.pd.protocol.zip(node.cfg.pd.core());
    let client_map = match pd_on {
        Some(_) => Some(pd::json_object(&body).ok_or_else(pd::not_an_object)?),
        None => None,
    };
    for attempt in 0..node.cfg.retry.max_attempts {
        if attempt > 0 && started.elapsed() >= budget {
            break;
        }
        let attempt_req = RouteRequest {
            exclude: &tried,
            ..route_req
        };
        let (decision, ticket) = match (pd_on, &client_map) {
            (Some((protocol, cfg)), Some(map)) => match node.route_pd(&attempt_req, &cfg) {
                PdRoute::Whole {
                    decision, ticket, ..
                } => (decision, ticket),
                PdRoute::Pair {
                    pair,
                    prefill,
                    decode,
                } => {
                    if attempt > 0 {
                        node.metrics.retries.inc();
                    }
                    let ctx = PairCtx {
                        node,
                        path,
                        headers: &headers,
                        body: map,
                        first_byte,
                        trace,
                    };
                    // The route request borrows `keys`; the legs take a copy into the answer.
                    let mut leg_keys = keys.clone();
                    let served =
                        pd::serve_pair(&ctx, protocol, pair, prefill, decode, &mut leg_keys).await;
                    match served {
                        Ok(resp) => {
                            attempts.succeeded(node);
                            return Ok(resp);
                        }
                        Err(f) => {
                            tracing::warn!(leg = f.leg, attempt, error = %f.error, "disaggregated leg failed");
                            attempts.failed(node, f.replica, f.failure);
                            tried.push(f.replica);
                            last_error = Some(ApiError::bad_gateway(f.error));
                            continue;
                        }
                    }
                }
            },
            // Only the first attempt may wait for a slot; a retry keeps the place it was given.
            _ if attempt == 0 => {
                let routed = node
                    .route_fair(&attempt_req, class)
                    .await
                    .map_err(|r| ApiError::queue_refused(&r))?;
                // The retry budget counts from the slot, not from the wait for it.
                started = Instant::now();
                routed
            }
            _ => node.route(&attempt_req),
        };
        let (routed, ticket) = match (decision, ticket) {
            (Decision::Route(d), Some(t)) => (d, t),
            (Decision::Reject(RejectReason::UnknownModel), _) => {
                return Err(ApiError::unknown_model(model))
            }
            (Decision::Reject(RejectReason::OverQuota), _) => return Err(ApiError::over_quota()),
            // Also after local attempts failed: nothing reached the client yet, and another
            // region beats an error.
            (Decision::Forward { region, reason }, _) if node.in_mesh() => {
                let mut headers = headers.clone();
                if let Some(v) = tenant.and_then(|t| HeaderValue::from_str(t).ok()) {
                    headers.insert(HeaderName::from_static(region_forward::TENANT_HEADER), v);
                }
                if let Some(t) = trace {
                    t.forwarding(&region, reason);
                }
                match region_forward::forward(
                    node,
                    &region,
                    reason,
                    path,
                    &headers,
                    body.clone(),
                    trace.map(RequestTrace::span),
                )
                .await
                {
                    Ok(resp) => return Ok(resp),
                    // Nothing reached the client: route again without that region (it may
                    // have gone dark while its record still stands).
                    Err(region_forward::ForwardError::RegionFailed(e)) => {
                        node.mark_region_unreachable(&region);
                        last_error = Some(e);
                        continue;
                    }
                    Err(region_forward::ForwardError::Unavailable(e)) => return Err(e),
                }
            }
            (Decision::Forward { region, .. }, _) if attempt == 0 => {
                return Err(ApiError::unavailable(format!(
                    "no replica of this node can serve model '{model}' now; region '{region}' could, \
                     but forwarding between nodes needs the mesh, which this node does not run"
                )))
            }
            _ if attempt == 0 => {
                return Err(ApiError::unavailable(format!(
                    "no healthy replica serves model '{model}'"
                )))
            }
            // A retry found no other candidate: answer with what the last attempt got.
            _ => break,
        };
        let (mut routed, mut ticket) = (routed, ticket);
        let mut i = routed.replica;
        let mut endpoint = ticket.endpoint().clone();
        if attempt > 0 {
            node.metrics.retries.inc();
        }
        tracing::debug!(
            replica = %endpoint.id, hit_blocks = routed.hit_blocks, reason = routed.reason.as_str(),
            attempt, "routed"
        );
        // The attempt's span is the replica's parent: its context replaces the client's.
        let mut attempt_span = None;
        if let Some(t) = trace {
            t.routed(&routed, &endpoint.id, ticket.hit_tokens(), attempt + 1);
            let span = t.attempt(&endpoint.id, attempt + 1);
            trace_span::inject(&span, &mut headers);
            attempt_span = Some(span);
        }
        let sent_at = Instant::now();
        let mut send = std::pin::pin!(send_to(
            node,
            &endpoint,
            ticket.rank(),
            path,
            &headers,
            &body
        ));
        let hedge_after = Duration::from_millis(node.cfg.retry.hedge_after_ms);
        // `None`: nothing within the first-byte timeout.
        let answer = if attempt == 0
            && fields.stream == Some(true)
            && !hedge_after.is_zero()
            && hedge_after < first_byte
        {
            match tokio::time::timeout(hedge_after, &mut send).await {
                Ok(r) => Some(r),
                Err(_) => {
                    // Late: the same request to the next best replica; the first answer wins
                    // and the other is dropped (its engine sees the connection close). The
                    // loser is not blamed: slow is not failed.
                    let exclude = [i];
                    let left = first_byte - hedge_after;
                    match node.route(&RouteRequest {
                        exclude: &exclude,
                        ..route_req
                    }) {
                        (Decision::Route(r2), Some(t2)) => {
                            let e2 = t2.endpoint().clone();
                            // The hedge is an attempt of its own, with its own span.
                            let mut hedge_span = None;
                            let hedge_headers = trace.map(|t| {
                                let span = t.attempt(&e2.id, attempt + 2);
                                let mut h = headers.clone();
                                trace_span::inject(&span, &mut h);
                                hedge_span = Some(span);
                                h
                            });
                            let hedge = std::pin::pin!(send_to(
                                node,
                                &e2,
                                t2.rank(),
                                path,
                                hedge_headers.as_ref().unwrap_or(&headers),
                                &body
                            ));
                            node.metrics.hedges.with_label_values(&["sent"]).inc();
                            match tokio::time::timeout(left, futures::future::select(send, hedge))
                                .await
                            {
                                Ok(futures::future::Either::Left((r, _))) => {
                                    node.metrics.hedges.with_label_values(&["first_won"]).inc();
                                    t2.failed(&keys);
                                    Some(r)
                                }
                                Ok(futures::future::Either::Right((r, _))) => {
                                    node.metrics.hedges.with_label_values(&["hedge_won"]).inc();
                                    std::mem::replace(&mut ticket, t2).failed(&keys);
                                    tried.push(i);
                                    if let Some(t) = trace {
                                        t.routed(&r2, &e2.id, ticket.hit_tokens(), attempt + 2);
                                    }
                                    // The first attempt's span ends (unanswered); the
                                    // hedge's records the outcome.
                                    attempt_span = hedge_span;
                                    (i, routed, endpoint) = (r2.replica, r2, e2);
                                    Some(r)
                                }
                                Err(_) => {
                                    t2.failed(&keys);
                                    None
                                }
                            }
                        }
                        _ => tokio::time::timeout(left, send).await.ok(),
                    }
                }
            }
        } else {
            tokio::time::timeout(first_byte, send).await.ok()
        };
        let replica_id: &str = &endpoint.id;
        if let Some(span) = attempt_span.take() {
            let (status, error) = match &answer {
                Some(Ok(resp)) => (Some(resp.status()), None),
                Some(Err(e)) if e.is_connect() => (None, Some("connect")),
                Some(Err(_)) => (None, Some("transport")),
                None => (None, Some("timeout")),
            };
            trace_span::attempt_done(&span, status, error);
        }
        // What the client is told stays free of replica names and addresses; the log has them.
        let (failure, error) = match answer {
            Some(Ok(resp)) if !is_failure(resp.status()) => {
                let first_byte_s = sent_at.elapsed().as_secs_f64();
                node.metrics
                    .first_byte_seconds
                    .with_label_values(&[replica_id])
                    .observe(first_byte_s);
                // Streamed responses start at the first token; others only when complete.
                if fields.stream == Some(true) && resp.status().is_success() {
                    node.metrics
                        .decisions
                        .prediction(routed.predicted_s, first_byte_s);
                }
                node.request_succeeded(i);
                attempts.succeeded(node);
                let outcome = if resp.status().is_success() {
                    "ok"
                } else {
                    "client_error"
                };
                node.metrics
                    .requests
                    .with_label_values(&[replica_id, policy, outcome])
                    .inc();
                // The keys go with the response: its first byte records them (see
                // `Ticket::first_byte`). Nothing else needs them once a replica answered.
                let keys = std::mem::take(&mut keys);
                let span = trace.map(|t| t.span().clone());
                let rank = ticket.rank().map(|r| r.rank);
                let mut out = respond(node, resp, ticket, routed.hit_blocks, keys, span);
                if node.cfg.debug_headers {
                    if let Ok(v) = HeaderValue::from_str(&decision_header(&routed, rank)) {
                        out.headers_mut()
                            .insert(HeaderName::from_static(DECISION_HEADER), v);
                    }
                }
                return Ok(out);
            }
            Some(Ok(resp)) => {
                let msg = format!("the replica answered {}", resp.status());
                if let Some((_, earlier, _)) = last_failed_response.take() {
                    earlier.failed(&keys);
                }
                last_failed_response = Some((resp, ticket, routed.hit_blocks));
                (Failure::Status, msg)
            }
            Some(Err(e)) => {
                ticket.failed(&keys);
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
                ticket.failed(&keys);
                (
                    Failure::Timeout,
                    format!("the replica sent nothing within {first_byte:?}"),
                )
            }
        };
        tracing::warn!(replica = %replica_id, url = %endpoint.base, attempt, error = %error, "attempt failed");
        node.metrics
            .requests
            .with_label_values(&[replica_id, policy, "failed"])
            .inc();
        attempts.failed(node, i, failure);
        tried.push(i);
        last_error = Some(ApiError::bad_gateway(error));
    }
    // Every attempt failed.
    let cut = attempts.all_cut();
    let big = body.len() > LIKELY_REFUSED_BODY_BYTES;
    let request_blamed = attempts.gave_up(node, big);
    if request_blamed && cut && big {
        // Replicas (or proxies before them) commonly cut the connection on a body over their
        // limit instead of answering 413.
        return Err(ApiError::refused_as_too_large(body.len()));
    }
    // A replica's own error answer is more useful to the client than ours.
    if let Some((resp, ticket, hit)) = last_failed_response {
        let span = trace.map(|t| t.span().clone());
        return Ok(respond(node, resp, ticket, hit, Vec::new(), span));
    }
    Err(last_error.unwrap_or_else(|| ApiError::unavailable("no replica could take the request")))
}

/// Sends the request's original bytes to replica `endpoint` (pinned by the caller, on its stack),
/// naming the data-parallel `rank` the node chose, if any (header, or body field for SGLang).
fn send_to(
    node: &Node,
    endpoint: &crate::node::Endpoint,
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
