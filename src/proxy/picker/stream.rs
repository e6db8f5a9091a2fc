//! One ext_proc stream — one HTTP request through the gateway — from its headers to its
//! answer's end: the picker's state machine, in body mode `FULL_DUPLEX_STREAMED`.
//!
//! Exists so the picker decides exactly as the HTTP front does, in the front's own stages:
//! 1. request headers: the path names the API (as the front's routes do), `identify` the tenant
//!    and session, the subset hint is read; a request without a body is picked by load at once;
//! 2. request body chunks: fed to the front's `body::read`, so the same size (413), time and
//!    rate (408) and node-wide budget bounds hold; nothing is answered until the last chunk;
//! 3. decide: `understand` then `decide` (admission may wait; a gateway that leaves meanwhile
//!    is noticed), local replicas only (`forwarded`: the gateway reaches only its pool's pods);
//!    an error becomes an `ImmediateResponse` in the API's error shape (503 none can serve, 429
//!    shed or over quota, 413, 400, 401, 404);
//! 4. the pick: the request-headers answer (destination header + dynamic metadata, `pick.rs`),
//!    then the body, as Envoy forwards in this mode only what the processor sends back;
//! 5. response phase: each message is answered in order (body chunks sent back unchanged) while
//!    `accounting.rs` keeps the node's books; the stream's end, however it comes, releases them.
//!
//! Waits are bounded: the headers by `server.header_read_timeout_ms`, the body by the front's
//! limits, the answer's headers by `timeouts.first_byte_ms`, each later chunk by `timeouts.idle_ms`.

use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Msg;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::sync::mpsc;
use tonic::{Status, Streaming};

use super::super::body::{self, BodyPermit};
use super::super::decide::{decide, AttemptCtx, Decided};
use super::super::error::{ApiError, ErrorShape};
use super::super::forward::{error_shape, pin_to_stored_response, route_request};
use super::super::identify::{header_str, identify, Identity};
use super::super::receipts::Receipt;
use super::super::stored_responses;
use super::super::understand::{understand, Understood};
use super::accounting::Accounting;
use super::ctx::PickerCtx;
use super::pick::{self, Subset};
use super::wire;
use crate::core::dialect::Api;
use crate::core::router::RouteRequest;
use crate::core::view::Health;

/// The answers of one stream, in order.
pub type Out = mpsc::Sender<Result<ProcessingResponse, Status>>;

/// How a stream ended, for `kvmesh_picker_streams_total{outcome}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// An endpoint was named.
    Picked,
    /// The gateway was told to answer the client itself (`ImmediateResponse`).
    Refused,
    /// The gateway went away (or went silent) before the pick.
    Abandoned,
    /// A message out of the protocol's order: the stream ends with an error.
    Malformed,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Picked => "picked",
            Outcome::Refused => "refused",
            Outcome::Abandoned => "abandoned",
            Outcome::Malformed => "malformed",
        }
    }
}

/// Runs one stream to its end and counts how it ended.
pub async fn run(ctx: PickerCtx, mut inbound: Streaming<ProcessingRequest>, out: Out) {
    let outcome = serve(&ctx, &mut inbound, &out).await;
    if outcome == Outcome::Malformed {
        tracing::debug!("ext_proc stream ended: a message out of the protocol's order");
        let _ = out
            .send(Err(Status::invalid_argument(
                "ext_proc message out of order for an endpoint picker in FULL_DUPLEX_STREAMED mode",
            )))
            .await;
    }
    ctx.metrics
        .streams
        .with_label_values(&[outcome.as_str()])
        .inc();
}

/// The next message within `wait`; `None`: the stream ended, broke or stayed silent.
async fn next(
    inbound: &mut Streaming<ProcessingRequest>,
    wait: Duration,
) -> Option<ProcessingRequest> {
    match tokio::time::timeout(wait, inbound.message()).await {
        Ok(Ok(Some(m))) => Some(m),
        _ => None,
    }
}

/// Which API a path names (the HTTP front's routes); any other path is routed by load.
fn api_for(path: &str) -> (Api, &'static str) {
    match path {
        "/v1/completions" => (Api::Completions, "/v1/completions"),
        "/v1/chat/completions" => (Api::Chat, "/v1/chat/completions"),
        "/v1/messages" => (Api::Messages, "/v1/messages"),
        "/v1/messages/count_tokens" => (Api::CountTokens, "/v1/messages/count_tokens"),
        "/v1/responses" => (Api::Responses, "/v1/responses"),
        "/v1/embeddings" => (Api::Pooling, "/v1/embeddings"),
        "/v1/rerank" => (Api::Pooling, "/v1/rerank"),
        "/rerank" => (Api::Pooling, "/rerank"),
        "/v1/score" => (Api::Pooling, "/v1/score"),
        _ => (Api::Pooling, ""),
    }
}

/// Tells the gateway to answer the client with `e`, in `shape`.
async fn refuse(out: &Out, e: ApiError, shape: ErrorShape) -> Outcome {
    let status = e.status.as_u16();
    let reply = wire::immediate(status, e.body_shaped(shape), e.retry_after_s);
    let _ = out.send(Ok(reply)).await;
    Outcome::Refused
}

async fn serve(ctx: &PickerCtx, inbound: &mut Streaming<ProcessingRequest>, out: &Out) -> Outcome {
    let node = &ctx.node;
    let head_wait = Duration::from_millis(node.cfg.server.header_read_timeout_ms);
    let Some(first) = next(inbound, head_wait).await else {
        return Outcome::Abandoned;
    };
    let Some(Msg::RequestHeaders(h)) = first.request else {
        return Outcome::Malformed;
    };
    let head = wire::read_head(h.headers.as_ref());
    let subset = wire::subset_hint(first.metadata_context.as_ref(), &ctx.cfg.subset_namespace);
    let (api, path) = api_for(&head.path);
    let shape = error_shape(api);
    if h.end_of_stream {
        // With API keys on, a retrieve or cancel of a stored response needs a key here as at
        // the HTTP front (other bodyless requests, `/v1/models`, need none there either).
        let stored = stored_response_id(&head.path);
        if stored.is_some() {
            if let Err(e) = identify(node, &head.headers, false) {
                return refuse(out, e, shape).await;
            }
        }
        return bodyless(ctx, inbound, out, stored, subset.as_deref()).await;
    }
    let who = match identify(node, &head.headers, false) {
        Ok(w) => w,
        Err(e) => return refuse(out, e, shape).await,
    };
    let (body, permit, trailers) = match read_body(ctx, inbound, &head.headers).await {
        Ok(b) => b,
        Err(BodyEnd::Refused(e)) => return refuse(out, e, shape).await,
        Err(BodyEnd::Gone) => return Outcome::Abandoned,
        Err(BodyEnd::Malformed) => return Outcome::Malformed,
    };
    let started = Instant::now();
    let request = Request {
        api,
        path,
        who,
        headers: &head.headers,
        subset: subset.as_deref(),
    };
    let (u, keys, picked) = match decide_pick(ctx, request, body, out).await {
        Ok(p) => p,
        Err(Some(e)) => return refuse(out, e, shape).await,
        Err(None) => return Outcome::Abandoned,
    };
    // The pick first, then the body: in this mode Envoy forwards what the processor sends back.
    let sent = {
        let mut replies = std::iter::once(wire::pick_response(
            &picked.named.endpoints,
            Some(u.body.len()),
            &ctx.cfg.metadata_namespace,
        ))
        .chain(wire::body_chunks(&u.body, true, true))
        .chain(trailers.then(|| wire::trailers_continue(true)));
        send_all(out, &mut replies).await
    };
    drop(permit);
    ctx.metrics
        .decision_seconds
        .observe(started.elapsed().as_secs_f64());
    if !sent {
        return Outcome::Picked;
    }
    let receipt = Receipt::new(u.api, Some(picked.branch), picked.ticket.hit_tokens());
    let acct = Accounting::new(
        ctx.clone(),
        picked.ticket,
        keys,
        picked.named.primary(),
        receipt,
        (u.prompt_tokens, who.tenant),
    );
    drop(u);
    response_phase(ctx, inbound, out, Some(acct)).await;
    Outcome::Picked
}

/// Sends `replies` in order; `false` when the gateway is gone.
async fn send_all(out: &Out, replies: &mut impl Iterator<Item = ProcessingResponse>) -> bool {
    for r in replies {
        if out.send(Ok(r)).await.is_err() {
            return false;
        }
    }
    true
}

/// Why a body was not read whole.
enum BodyEnd {
    /// Over a limit, too slow, or the budget is gone: the error to answer with.
    Refused(ApiError),
    /// The gateway went away.
    Gone,
    /// Something other than body chunks (or trailers) came.
    Malformed,
}

/// Reads the request body from the stream's body chunks through the HTTP front's reader (its
/// bounds, its budget); the permit holds the body's share of the budget. The flag says the
/// request had trailers (they end the body, and get their answer after it).
async fn read_body<'n>(
    ctx: &'n PickerCtx,
    inbound: &mut Streaming<ProcessingRequest>,
    headers: &HeaderMap,
) -> Result<(Bytes, BodyPermit<'n>, bool), BodyEnd> {
    let (tx, mut rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(8);
    let chunks = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
    let read = body::read(&ctx.node, axum::body::Body::from_stream(chunks), headers);
    tokio::pin!(read);
    let pump = async move {
        loop {
            let m = match inbound.message().await {
                Ok(Some(m)) => m,
                _ => return Err(BodyEnd::Gone),
            };
            match m.request {
                Some(Msg::RequestBody(b)) => {
                    let end = b.end_of_stream;
                    // The reader stopped (it refused the body): it answers.
                    if tx.send(Ok(Bytes::from(b.body))).await.is_err() || end {
                        return Ok(false);
                    }
                }
                Some(Msg::RequestTrailers(_)) => return Ok(true),
                _ => return Err(BodyEnd::Malformed),
            }
        }
    };
    tokio::pin!(pump);
    let mut trailers = None;
    loop {
        tokio::select! {
            r = &mut read => {
                return match r {
                    Ok((body, permit)) => Ok((body, permit, trailers.unwrap_or(false))),
                    Err(e) => Err(BodyEnd::Refused(e)),
                };
            }
            p = &mut pump, if trailers.is_none() => trailers = Some(p?),
        }
    }
}

/// What the decision stage is given besides the body.
struct Request<'a> {
    api: Api,
    path: &'static str,
    who: Identity<'a>,
    headers: &'a HeaderMap,
    subset: Option<&'a [String]>,
}

/// A decision, named.
struct Picked {
    ticket: crate::node::Ticket,
    branch: crate::core::router::Branch,
    named: pick::Named,
}

/// Understands and decides the request (the HTTP front's stages), then names the pick. `Err`:
/// the error to answer with, or `None` when the gateway left while the request waited.
async fn decide_pick(
    ctx: &PickerCtx,
    r: Request<'_>,
    body: Bytes,
    out: &Out,
) -> Result<(Understood, Vec<crate::core::keys::BlockKey>, Picked), Option<ApiError>> {
    let node = &ctx.node;
    let mut u = understand(node, r.api, r.path, body, r.who.tenant)
        .await
        .map_err(Some)?;
    let pinned = pin_to_stored_response(node, &u).await.map_err(Some)?;
    let class = node.priority_class(
        r.who.tenant,
        node.cfg
            .priorities
            .as_ref()
            .and_then(|p| header_str(r.headers, &p.header)),
    );
    let mut exclude = pinned.unwrap_or_default();
    let subset = r.subset.map(Subset::parse);
    if let Some(s) = &subset {
        let outside = pick::excluded_by(node, s, &ctx.cfg.rank_ports);
        if outside.len() == node.replica_count() {
            return Err(Some(ApiError::unavailable(
                "no endpoint of the gateway's subset can serve the request",
            )));
        }
        exclude.extend(outside);
    }
    let keys = std::mem::take(&mut u.keys);
    let route_req = RouteRequest {
        keys: &keys,
        exclude: &exclude,
        // The gateway reaches only this pool's pods: pick here or refuse, never forward.
        forwarded: true,
        ..route_request(&r.who, &u, None)
    };
    let ctx_attempt = AttemptCtx {
        attempt: 0,
        class,
        pd: false,
    };
    let decided = tokio::select! {
        d = decide(node, &route_req, ctx_attempt) => d,
        _ = out.closed() => return Err(None),
    };
    let (routed, ticket) = match decided {
        Decided::Route { routed, ticket } => (routed, ticket),
        Decided::Refuse(e) => return Err(Some(e)),
        _ => {
            return Err(Some(ApiError::unavailable(format!(
                "no replica of this pool can serve model '{}' now",
                u.model()
            ))))
        }
    };
    let Some(named) = pick::name(node, &ticket, &route_req, subset.as_ref(), &ctx.cfg) else {
        return Err(Some(ApiError::unavailable(
            "the chosen replica's URL names no host and port",
        )));
    };
    let picked = Picked {
        ticket,
        branch: routed.branch(),
        named,
    };
    Ok((u, keys, picked))
}

/// A request without a body (`GET /v1/models`, say): the least loaded healthy replica the
/// subset allows, booked nowhere (it costs an engine nothing to speak of); for a `stored`
/// response's retrieve or cancel (its id), the replica that stores it.
async fn bodyless(
    ctx: &PickerCtx,
    inbound: &mut Streaming<ProcessingRequest>,
    out: &Out,
    stored: Option<&str>,
    subset: Option<&[String]>,
) -> Outcome {
    let node = &ctx.node;
    let subset = subset.map(Subset::parse);
    let excluded = subset
        .as_ref()
        .map(|s| pick::excluded_by(node, s, &ctx.cfg.rank_ports))
        .unwrap_or_default();
    // A retrieve or cancel of a stored response goes to the replica that stores it, or nowhere.
    if let Some(id) = stored {
        let held = match stored_responses::locate(node, None, id).await {
            Ok(Some(i)) if excluded.binary_search(&i).is_err() => Some(i),
            Ok(_) => None,
            Err(e) => return refuse(out, e, ErrorShape::OpenAi).await,
        };
        let place =
            held.and_then(|i| pick::place_of(node, i, None, subset.as_ref(), &ctx.cfg.rank_ports));
        let Some(endpoint) = place else {
            let e = stored_responses::retrieve_not_found(id);
            return refuse(out, e, ErrorShape::OpenAi).await;
        };
        let reply = wire::pick_response(&endpoint, None, &ctx.cfg.metadata_namespace);
        if out.send(Ok(reply)).await.is_ok() {
            response_phase(ctx, inbound, out, None).await;
        }
        return Outcome::Picked;
    }
    let best = {
        let core = node.lock();
        core.view
            .replicas()
            .iter()
            .enumerate()
            .filter(|(i, r)| r.health == Health::Healthy && excluded.binary_search(i).is_err())
            .min_by_key(|(_, r)| r.load.outstanding())
            .map(|(i, _)| i)
    };
    let Some(endpoint) =
        best.and_then(|i| pick::place_of(node, i, None, subset.as_ref(), &ctx.cfg.rank_ports))
    else {
        let e =
            ApiError::unavailable("no healthy replica the gateway allows can serve the request");
        return refuse(out, e, ErrorShape::OpenAi).await;
    };
    // No body: no length to set.
    let reply = wire::pick_response(&endpoint, None, &ctx.cfg.metadata_namespace);
    if out.send(Ok(reply)).await.is_ok() {
        response_phase(ctx, inbound, out, None).await;
    }
    Outcome::Picked
}

/// The response id of `GET /v1/responses/{id}` or `POST /v1/responses/{id}/cancel`.
fn stored_response_id(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/v1/responses/")?;
    let id = rest.strip_suffix("/cancel").unwrap_or(rest);
    (!id.is_empty() && !id.contains('/')).then_some(id)
}

/// The response phase: every message answered in order, the books kept by `acct`, until the
/// gateway ends the stream (or goes silent past the timeouts).
async fn response_phase(
    ctx: &PickerCtx,
    inbound: &mut Streaming<ProcessingRequest>,
    out: &Out,
    mut acct: Option<Accounting>,
) {
    let timeouts = &ctx.node.cfg.timeouts;
    let mut answering = false;
    loop {
        let wait = Duration::from_millis(if answering {
            timeouts.idle_ms
        } else {
            timeouts.first_byte_ms
        });
        let Some(m) = next(inbound, wait).await else {
            return;
        };
        if let (Some(a), Some(e)) = (acct.as_mut(), served(m.metadata_context.as_ref(), ctx)) {
            a.served(e);
        }
        let reply = match m.request {
            Some(Msg::ResponseHeaders(h)) => {
                answering = true;
                let status = wire::header_value(h.headers.as_ref(), ":status")
                    .and_then(|s| s.parse::<u16>().ok());
                if let Some(a) = acct.as_mut() {
                    a.response_headers(status, h.end_of_stream);
                }
                wire::response_headers_continue()
            }
            Some(Msg::ResponseBody(b)) => {
                answering = true;
                if let Some(a) = acct.as_mut() {
                    a.response_body(&b.body, b.end_of_stream);
                }
                wire::body_response(b.body, b.end_of_stream, false)
            }
            Some(Msg::ResponseTrailers(_)) => {
                if let Some(a) = acct.as_mut() {
                    a.finish();
                }
                wire::trailers_continue(false)
            }
            Some(Msg::RequestTrailers(_)) => wire::trailers_continue(true),
            // Nothing else belongs after the pick: ignored, counted.
            _ => {
                ctx.metrics
                    .streams
                    .with_label_values(&[Outcome::Malformed.as_str()])
                    .inc();
                continue;
            }
        };
        if out.send(Ok(reply)).await.is_err() {
            return;
        }
    }
}

/// The served endpoint a message's metadata reports, if any.
fn served<'a>(metadata: Option<&'a Metadata>, ctx: &PickerCtx) -> Option<&'a str> {
    wire::served_endpoint(metadata, &ctx.cfg.metadata_namespace)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::config::{NodeConfig, ReplicaConfig};
    use crate::node::Node;
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap as EnvoyHeaders, HeaderValue};
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
    use envoy_types::pb::envoy::service::ext_proc::v3::{body_mutation, HttpBody, HttpHeaders};
    use std::net::SocketAddr;
    use std::sync::Arc;
    use tokio::sync::watch;

    #[test]
    fn stored_response_paths_name_their_id() {
        assert_eq!(stored_response_id("/v1/responses/resp_1"), Some("resp_1"));
        assert_eq!(
            stored_response_id("/v1/responses/resp_1/cancel"),
            Some("resp_1")
        );
        for path in [
            "/v1/responses",
            "/v1/responses/",
            "/v1/responses/a/b",
            "/v1/models",
        ] {
            assert_eq!(stored_response_id(path), None, "{path}");
        }
    }

    #[test]
    fn paths_name_the_front_routes_apis() {
        assert_eq!(api_for("/v1/chat/completions").0, Api::Chat);
        assert_eq!(api_for("/v1/messages").0, Api::Messages);
        assert_eq!(api_for("/v1/responses").0, Api::Responses);
        assert_eq!(api_for("/v1/completions").0, Api::Completions);
        assert_eq!(api_for("/somewhere/else"), (Api::Pooling, ""));
    }

    /// A node with 3 replicas (never dialled) and its picker listening on loopback.
    async fn picker(max_body: usize) -> (Arc<Node>, SocketAddr, watch::Sender<bool>) {
        crate::proxy::install_crypto_provider();
        let mut cfg = NodeConfig {
            replicas: (0..3).map(ReplicaConfig::numbered).collect(),
            max_body_bytes: max_body,
            ..NodeConfig::default()
        };
        cfg.picker.listen = Some("127.0.0.1:0".parse().unwrap());
        let node = Node::new(cfg).unwrap();
        let (stop, rx) = watch::channel(false);
        let l = super::super::start(&node, rx).await.unwrap().unwrap();
        (node, l.addr, stop)
    }

    fn headers(path: &str) -> ProcessingRequest {
        let h = |k: &str, v: &str| HeaderValue {
            key: k.into(),
            raw_value: v.as_bytes().to_vec(),
            ..HeaderValue::default()
        };
        ProcessingRequest {
            request: Some(Msg::RequestHeaders(HttpHeaders {
                headers: Some(EnvoyHeaders {
                    headers: vec![h(":path", path), h(":method", "POST")],
                }),
                ..HttpHeaders::default()
            })),
            ..ProcessingRequest::default()
        }
    }

    fn chunk(body: &[u8], end: bool) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(Msg::RequestBody(HttpBody {
                body: body.to_vec(),
                end_of_stream: end,
                ..HttpBody::default()
            })),
            ..ProcessingRequest::default()
        }
    }

    /// Opens a stream; the sender feeds it, the answers come back.
    async fn open(
        addr: SocketAddr,
    ) -> (
        mpsc::Sender<ProcessingRequest>,
        Streaming<ProcessingResponse>,
    ) {
        let mut client = ExternalProcessorClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let (tx, mut rx) = mpsc::channel(64);
        let requests = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
        let answers = client.process(requests).await.unwrap().into_inner();
        (tx, answers)
    }

    fn in_flight(node: &Node) -> u32 {
        node.state().replicas.iter().map(|r| r.in_flight).sum()
    }

    #[tokio::test]
    async fn a_chunked_body_is_picked_sent_back_whole_and_released_when_abandoned() {
        let (node, addr, _stop) = picker(1 << 20).await;
        let body = serde_json::to_vec(&serde_json::json!({
            "model": "m", "prompt": "p".repeat(100_000), "max_tokens": 1
        }))
        .unwrap();
        let (tx, mut answers) = open(addr).await;
        tx.send(headers("/v1/completions")).await.unwrap();
        let parts: Vec<&[u8]> = body.chunks(4096).collect();
        for (i, c) in parts.iter().enumerate() {
            tx.send(chunk(c, i + 1 == parts.len())).await.unwrap();
        }
        let first = answers.message().await.unwrap().unwrap();
        let Some(Answer::RequestHeaders(h)) = first.response else {
            panic!("the pick comes first: {first:?}")
        };
        let set = h.response.unwrap().header_mutation.unwrap().set_headers;
        let dest = String::from_utf8(set[0].header.as_ref().unwrap().raw_value.clone()).unwrap();
        assert_eq!(
            dest.split(',').count(),
            3,
            "the pick and 2 fallbacks: {dest}"
        );
        assert!(dest.starts_with("10.0.0."));
        let mut back = Vec::new();
        loop {
            let m = answers.message().await.unwrap().unwrap();
            let Some(Answer::RequestBody(b)) = m.response else {
                panic!("body answers follow")
            };
            let Some(body_mutation::Mutation::StreamedResponse(s)) =
                b.response.unwrap().body_mutation.unwrap().mutation
            else {
                panic!("streamed")
            };
            back.extend_from_slice(&s.body);
            if s.end_of_stream {
                break;
            }
        }
        assert_eq!(back, body);
        assert_eq!(in_flight(&node), 1, "the pick is booked");
        drop(tx);
        drop(answers);
        let deadline = Instant::now() + Duration::from_secs(10);
        while in_flight(&node) != 0 {
            assert!(
                Instant::now() < deadline,
                "an abandoned stream releases its booking"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn out_of_order_and_oversized_requests_get_an_error_not_a_pick() {
        let (node, addr, _stop) = picker(1000).await;
        let (tx, mut answers) = open(addr).await;
        tx.send(chunk(b"{}", true)).await.unwrap();
        let e = answers.message().await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        let (tx, mut answers) = open(addr).await;
        tx.send(headers("/v1/completions")).await.unwrap();
        tx.send(chunk(&[b' '; 600], false)).await.unwrap();
        tx.send(chunk(&[b' '; 600], true)).await.unwrap();
        let m = answers.message().await.unwrap().unwrap();
        let Some(Answer::ImmediateResponse(r)) = m.response else {
            panic!("an immediate response: {m:?}")
        };
        assert_eq!(r.status.unwrap().code, 413);
        assert!(String::from_utf8_lossy(&r.body).contains("request_too_large"));
        assert_eq!(in_flight(&node), 0);
    }
}
