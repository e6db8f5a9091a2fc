//! A gateway stand-in: plays Envoy's part in front of a set of endpoint pickers, so that the
//! picker benchmarks (several picker replicas against one; one killed mid-run) run without an
//! Envoy binary.
//!
//! Exists because a Gateway API gateway asks an endpoint picker over Envoy's External Processing
//! protocol (`envoy.service.ext_proc.v3.ExternalProcessor/Process`, GIE proposal 004) and then
//! sends the request where the picker said; measuring kvmesh as a picker needs that client half.
//! For each HTTP request the stand-in:
//!
//! 1. opens an ext_proc stream to one of its pickers (round robin, or seeded random), and sends
//!    the request headers (pseudo-headers `:method`, `:path`, `:authority`, `:scheme` first,
//!    values in `raw_value`, as Envoy does) and then the body in chunks of at most
//!    [`CHUNK_BYTES`], as `FULL_DUPLEX_STREAMED` does: without waiting for answers;
//! 2. reads the pick — the `x-gateway-destination-endpoint` header the picker sets in its
//!    request-headers answer (else the same key in `envoy.lb` dynamic metadata): `ip:port`, then
//!    fallbacks, comma-separated — and the body the picker streams back (in full-duplex mode the
//!    gateway forwards what the processor returns). An `ImmediateResponse` goes to the client as
//!    is (the picker's 503 or 429). A picker that cannot be reached, fails the stream or says
//!    nothing within [`GatewayConfig::pick_timeout`] is skipped for the next one, as Envoy
//!    retries another endpoint of the picker's cluster; with none left the client gets 503;
//! 3. forwards the request to the picked endpoint (a connect failure tries the next fallback),
//!    with the picker's other header mutations applied, and streams the answer back unbuffered,
//!    while it sends the picker the response headers and every response body chunk, each with
//!    the endpoint that served in `metadata_context["envoy.lb"]
//!    ["x-gateway-destination-endpoint-served"]` — the picker's bookkeeping (first byte,
//!    completion, usage). The response phase is a tap: a slow picker never holds the client's
//!    stream (messages that do not fit the stream's buffer are dropped and counted).
//!
//! Not a gateway for production: no TLS, no routes, no retries of its own, bodies read whole
//! (bounded by [`GatewayConfig::max_body_bytes`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap as EnvoyHeaders, HeaderValue as EnvoyHeader, Metadata,
};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, processing_response, HttpBody, HttpHeaders,
    ProcessingRequest, ProcessingResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use futures::StreamExt;
use rand::{Rng, SeedableRng};
use tokio::sync::{mpsc, oneshot};
use tonic::transport::{Channel, Endpoint};

/// The header (and `envoy.lb` dynamic-metadata key) naming the picked endpoints.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The `metadata_context` key naming the endpoint that served.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The metadata namespace of both.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// Largest body chunk sent to a picker (Envoy streams a body in chunks of its buffer size).
pub const CHUNK_BYTES: usize = 64 << 10;
/// Response-phase messages buffered per stream beyond the request's; more are dropped.
const RESPONSE_BUFFER: usize = 256;
/// Most endpoints read from one pick (the pick and its fallbacks).
const MAX_DESTINATIONS: usize = 16;
/// How long the response phase's stream is kept open for the picker to finish, after the last
/// message went out.
const TAP_LINGER: Duration = Duration::from_secs(30);

/// How the stand-in spreads streams over its pickers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spread {
    /// Each request starts at the next picker.
    RoundRobin,
    /// Each request starts at a picker drawn with this seed.
    Random(u64),
}

/// A gateway stand-in's settings.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// Where clients connect (HTTP/1.1 and h2c).
    pub listen: SocketAddr,
    /// The pickers' ext_proc addresses (plaintext gRPC).
    pub pickers: Vec<SocketAddr>,
    /// Round robin or random.
    pub spread: Spread,
    /// Longest wait for one picker's pick (connect, stream, headers and body back); then the
    /// next picker is asked (Envoy's `message_timeout`, generous here: a busy test machine).
    pub pick_timeout: Duration,
    /// Longest request body read; a longer one gets 413.
    pub max_body_bytes: usize,
}

impl GatewayConfig {
    /// A stand-in on `listen` in front of `pickers`, round robin, 5 s per pick, 64 MiB bodies.
    pub fn new(listen: SocketAddr, pickers: Vec<SocketAddr>) -> Self {
        GatewayConfig {
            listen,
            pickers,
            spread: Spread::RoundRobin,
            pick_timeout: Duration::from_secs(5),
            max_body_bytes: 64 << 20,
        }
    }
}

/// What the stand-in counted.
#[derive(Debug, Default)]
pub struct GatewayStats {
    /// Requests taken from clients.
    pub requests: AtomicU64,
    /// Requests forwarded to a picked endpoint.
    pub forwarded: AtomicU64,
    /// Picker attempts that failed (unreachable, broken stream, no pick in time): each moved
    /// the request on to the next picker.
    pub picker_failures: AtomicU64,
    /// Requests no picker answered (the client got 503).
    pub no_picker: AtomicU64,
    /// Requests a picker answered itself (`ImmediateResponse`).
    pub immediate: AtomicU64,
    /// Forwards whose endpoint refused the connection, moved to the pick's next fallback.
    pub fallbacks_used: AtomicU64,
    /// Requests whose every endpoint failed (the client got 502).
    pub upstream_failures: AtomicU64,
    /// Response-phase messages dropped because the picker's stream was full or gone.
    pub tap_dropped: AtomicU64,
}

/// A running stand-in.
pub struct Gateway {
    /// The address it listens on.
    pub addr: SocketAddr,
    /// Its counters.
    pub stats: Arc<GatewayStats>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Gateway {
    /// Starts a stand-in (its pickers are dialled lazily, per stream).
    pub async fn spawn(cfg: GatewayConfig) -> anyhow::Result<Gateway> {
        anyhow::ensure!(
            !cfg.pickers.is_empty(),
            "a gateway needs at least one picker"
        );
        crate::proxy::install_crypto_provider();
        let channels = cfg
            .pickers
            .iter()
            .map(|addr| {
                Ok(Endpoint::from_shared(format!("http://{addr}"))?
                    .connect_timeout(Duration::from_secs(1))
                    .tcp_nodelay(true)
                    .connect_lazy())
            })
            .collect::<Result<Vec<Channel>, tonic::transport::Error>>()?;
        let stats = Arc::new(GatewayStats::default());
        let state = Arc::new(Shared {
            http: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(2))
                .tcp_nodelay(true)
                .build()?,
            channels,
            next: AtomicUsize::new(0),
            rng: std::sync::Mutex::new(match cfg.spread {
                Spread::Random(seed) => Some(rand::rngs::StdRng::seed_from_u64(seed)),
                Spread::RoundRobin => None,
            }),
            stats: Arc::clone(&stats),
            cfg: cfg.clone(),
        });
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .with_context(|| format!("gateway listen {}", cfg.listen))?;
        let addr = listener.local_addr()?;
        let app = axum::Router::new().fallback(handle).with_state(state);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(Gateway {
            addr,
            stats,
            stop: Some(stop),
            task,
        })
    }

    /// Stops accepting and waits for the server task.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(10), &mut self.task).await;
        self.task.abort();
    }
}

/// What every request handler shares.
struct Shared {
    cfg: GatewayConfig,
    http: reqwest::Client,
    /// One lazily connected channel per picker.
    channels: Vec<Channel>,
    next: AtomicUsize,
    rng: std::sync::Mutex<Option<rand::rngs::StdRng>>,
    stats: Arc<GatewayStats>,
}

impl Shared {
    /// The picker a request starts at.
    fn first_picker(&self) -> usize {
        let n = self.channels.len();
        if let Ok(mut rng) = self.rng.lock() {
            if let Some(rng) = rng.as_mut() {
                return rng.random_range(0..n);
            }
        }
        self.next.fetch_add(1, Ordering::Relaxed) % n
    }
}

/// A pick: the endpoints in order, and the other headers the picker sets.
type Pick = (Vec<SocketAddr>, Vec<(String, Vec<u8>)>);

/// What one picker said.
enum Asked {
    /// Send the request to `endpoints` (in order) with `body` and `headers` set.
    Pick {
        endpoints: Vec<SocketAddr>,
        headers: Vec<(String, Vec<u8>)>,
        body: Bytes,
        stream: Box<Tap>,
    },
    /// Answer the client with this.
    Immediate(Response<Body>),
}

/// One request, end to end.
async fn handle(
    axum::extract::State(state): axum::extract::State<Arc<Shared>>,
    req: Request<Body>,
) -> Response<Body> {
    state.stats.requests.fetch_add(1, Ordering::Relaxed);
    let (parts, body) = req.into_parts();
    let body = match axum::body::to_bytes(body, state.cfg.max_body_bytes).await {
        Ok(b) => b,
        Err(_) => return plain(StatusCode::PAYLOAD_TOO_LARGE, "request body too large"),
    };
    let head = request_head(&parts);
    let n = state.channels.len();
    let first = state.first_picker();
    for k in 0..n {
        let channel = state.channels[(first + k) % n].clone();
        let asked = tokio::time::timeout(
            state.cfg.pick_timeout,
            ask(channel, &head, &body, &state.stats),
        )
        .await;
        match asked {
            Ok(Ok(Asked::Immediate(resp))) => {
                state.stats.immediate.fetch_add(1, Ordering::Relaxed);
                return resp;
            }
            Ok(Ok(Asked::Pick {
                endpoints,
                headers,
                body,
                stream,
            })) => return forward(&state, &parts, endpoints, headers, body, stream).await,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "picker failed; trying the next");
            }
            Err(_) => tracing::debug!("picker gave no pick in time; trying the next"),
        }
        state.stats.picker_failures.fetch_add(1, Ordering::Relaxed);
    }
    state.stats.no_picker.fetch_add(1, Ordering::Relaxed);
    plain(
        StatusCode::SERVICE_UNAVAILABLE,
        "no endpoint picker answered",
    )
}

/// The request's headers as Envoy sends them: pseudo-headers first, names lower-cased.
fn request_head(parts: &axum::http::request::Parts) -> Vec<EnvoyHeader> {
    let raw = |key: &str, value: &[u8]| EnvoyHeader {
        key: key.to_owned(),
        raw_value: value.to_vec(),
        ..EnvoyHeader::default()
    };
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let authority = parts
        .headers
        .get("host")
        .map_or(&b"gateway"[..], HeaderValue::as_bytes);
    let mut out = vec![
        raw(":method", parts.method.as_str().as_bytes()),
        raw(":path", path.as_bytes()),
        raw(":authority", authority),
        raw(":scheme", b"http"),
    ];
    for (name, value) in &parts.headers {
        if name != "host" {
            out.push(raw(name.as_str(), value.as_bytes()));
        }
    }
    out
}

/// The messages of the request phase: headers, then the body in chunks.
fn request_messages(head: &[EnvoyHeader], body: &Bytes) -> Vec<ProcessingRequest> {
    let message = |request| ProcessingRequest {
        request: Some(request),
        ..ProcessingRequest::default()
    };
    let mut out = vec![message(processing_request::Request::RequestHeaders(
        HttpHeaders {
            headers: Some(EnvoyHeaders {
                headers: head.to_vec(),
            }),
            end_of_stream: body.is_empty(),
            ..HttpHeaders::default()
        },
    ))];
    let chunks: Vec<&[u8]> = body.chunks(CHUNK_BYTES).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        out.push(message(processing_request::Request::RequestBody(
            HttpBody {
                body: chunk.to_vec(),
                end_of_stream: i + 1 == chunks.len(),
                ..HttpBody::default()
            },
        )));
    }
    out
}

/// Opens a stream to one picker, sends the request phase and reads the pick.
async fn ask(
    channel: Channel,
    head: &[EnvoyHeader],
    body: &Bytes,
    stats: &Arc<GatewayStats>,
) -> anyhow::Result<Asked> {
    let messages = request_messages(head, body);
    let body_chunks = messages.len() - 1;
    let (tx, rx) = mpsc::channel::<ProcessingRequest>(messages.len() + RESPONSE_BUFFER);
    for m in messages {
        tx.try_send(m)
            .context("request phase does not fit its buffer")?;
    }
    let outbound =
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let mut client = ExternalProcessorClient::new(channel);
    let mut inbound = client.process(outbound).await?.into_inner();
    let mut pick: Option<Pick> = None;
    // The body the picker sends back. A picker may re-chunk it: once it streams the body, only
    // its end of stream ends it; answers without a mutation pass the chunks as they were.
    let mut echoed = Vec::new();
    let mut replaced = false;
    let mut unchanged_answers = 0usize;
    let mut body_done = body_chunks == 0;
    while pick.is_none() || !body_done {
        let Some(msg) = inbound.message().await? else {
            anyhow::bail!("the picker closed the stream before its pick and body");
        };
        match msg.response {
            Some(processing_response::Response::RequestHeaders(h)) => {
                pick = Some(read_pick(h, &msg.dynamic_metadata)?);
            }
            Some(processing_response::Response::RequestBody(b)) => {
                match b
                    .response
                    .and_then(|c| c.body_mutation)
                    .and_then(|m| m.mutation)
                {
                    Some(body_mutation::Mutation::StreamedResponse(s)) => {
                        replaced = true;
                        echoed.extend_from_slice(&s.body);
                        body_done |= s.end_of_stream;
                    }
                    Some(body_mutation::Mutation::Body(whole)) => {
                        replaced = true;
                        echoed = whole;
                        body_done = true;
                    }
                    Some(body_mutation::Mutation::ClearBody(_)) => {
                        replaced = true;
                        echoed.clear();
                        body_done = true;
                    }
                    None => {
                        unchanged_answers += 1;
                        body_done |= !replaced && unchanged_answers >= body_chunks;
                    }
                }
            }
            Some(processing_response::Response::ImmediateResponse(i)) => {
                return Ok(Asked::Immediate(immediate(i)));
            }
            _ => {}
        }
    }
    let (endpoints, headers) = pick.context("no pick")?;
    let body = if replaced {
        Bytes::from(echoed)
    } else {
        body.clone()
    };
    Ok(Asked::Pick {
        endpoints,
        headers,
        body,
        stream: Box::new(Tap {
            tx,
            inbound: Some(inbound),
            stats: Arc::clone(stats),
            served: String::new(),
            ended: false,
        }),
    })
}

/// The pick in a request-headers answer: the destination header (else the same key in
/// `envoy.lb` dynamic metadata) and the other headers it sets.
fn read_pick(
    h: envoy_types::pb::envoy::service::ext_proc::v3::HeadersResponse,
    dynamic_metadata: &Option<Struct>,
) -> anyhow::Result<Pick> {
    let set = h
        .response
        .and_then(|c| c.header_mutation)
        .map(|m| m.set_headers)
        .unwrap_or_default();
    let mut headers = Vec::new();
    let mut endpoints = None;
    for option in set {
        let Some(header) = option.header else {
            continue;
        };
        let value = if header.raw_value.is_empty() {
            header.value.into_bytes()
        } else {
            header.raw_value
        };
        if header.key.eq_ignore_ascii_case(DESTINATION) {
            endpoints = Some(parse_endpoints(&String::from_utf8_lossy(&value)));
        } else {
            headers.push((header.key, value));
        }
    }
    let endpoints = endpoints
        .or_else(|| metadata_destination(dynamic_metadata))
        .filter(|e| !e.is_empty())
        .context("a headers answer without a destination")?;
    Ok((endpoints, headers))
}

/// `ip:port[,ip:port…]`, at most [`MAX_DESTINATIONS`]; entries that do not parse are skipped.
pub fn parse_endpoints(value: &str) -> Vec<SocketAddr> {
    value
        .split(',')
        .filter_map(|e| e.trim().parse().ok())
        .take(MAX_DESTINATIONS)
        .collect()
}

/// The destination in `envoy.lb` dynamic metadata, if any.
fn metadata_destination(metadata: &Option<Struct>) -> Option<Vec<SocketAddr>> {
    let lb = metadata.as_ref()?.fields.get(LB_NAMESPACE)?;
    let Some(Kind::StructValue(lb)) = &lb.kind else {
        return None;
    };
    match &lb.fields.get(DESTINATION)?.kind {
        Some(Kind::StringValue(s)) => Some(parse_endpoints(s)),
        _ => None,
    }
}

/// The client's answer for a picker's `ImmediateResponse`.
fn immediate(
    i: envoy_types::pb::envoy::service::ext_proc::v3::ImmediateResponse,
) -> Response<Body> {
    let status = i
        .status
        .and_then(|s| u16::try_from(s.code).ok())
        .and_then(|c| StatusCode::from_u16(c).ok())
        .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut resp = Response::new(Body::from(i.body));
    *resp.status_mut() = status;
    for option in i.headers.map(|h| h.set_headers).unwrap_or_default() {
        let Some(h) = option.header else { continue };
        let value = if h.raw_value.is_empty() {
            h.value.into_bytes()
        } else {
            h.raw_value
        };
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(h.key.as_bytes()),
            HeaderValue::from_bytes(&value),
        ) {
            resp.headers_mut().insert(n, v);
        }
    }
    resp
}

fn plain(status: StatusCode, text: &'static str) -> Response<Body> {
    let mut resp = Response::new(Body::from(text));
    *resp.status_mut() = status;
    resp
}

/// Headers a proxy does not forward (hop-by-hop, and the ones the client library sets).
fn hop_by_hop(name: &str) -> bool {
    matches!(
        name,
        "host"
            | "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "content-length"
    )
}

/// Sends the request to the pick (then its fallbacks) and streams the answer back, tapping the
/// response phase to the picker.
async fn forward(
    state: &Shared,
    parts: &axum::http::request::Parts,
    endpoints: Vec<SocketAddr>,
    set: Vec<(String, Vec<u8>)>,
    body: Bytes,
    mut tap: Box<Tap>,
) -> Response<Body> {
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut headers = HeaderMap::new();
    for (name, value) in &parts.headers {
        if !hop_by_hop(name.as_str()) {
            headers.append(name, value.clone());
        }
    }
    for (name, value) in set {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&value),
        ) {
            if !n.as_str().starts_with(':') && !hop_by_hop(n.as_str()) {
                headers.insert(n, v);
            }
        }
    }
    let mut upstream = None;
    for (i, endpoint) in endpoints.iter().enumerate() {
        let sent = state
            .http
            .request(parts.method.clone(), format!("http://{endpoint}{path}"))
            .headers(headers.clone())
            .body(body.clone())
            .send()
            .await;
        match sent {
            Ok(resp) => {
                upstream = Some((resp, *endpoint));
                break;
            }
            Err(e) if e.is_connect() && i + 1 < endpoints.len() => {
                state.stats.fallbacks_used.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::debug!(endpoint = %endpoint, error = %e, "upstream failed");
                break;
            }
        }
    }
    let Some((resp, served)) = upstream else {
        state
            .stats
            .upstream_failures
            .fetch_add(1, Ordering::Relaxed);
        tap.finish();
        return plain(StatusCode::BAD_GATEWAY, "every picked endpoint failed");
    };
    state.stats.forwarded.fetch_add(1, Ordering::Relaxed);
    tap.served = served.to_string();
    let status = resp.status();
    let mut out = Response::builder().status(status.as_u16());
    let mut reported = vec![EnvoyHeader {
        key: ":status".into(),
        raw_value: status.as_str().as_bytes().to_vec(),
        ..EnvoyHeader::default()
    }];
    for (name, value) in resp.headers() {
        if !hop_by_hop(name.as_str()) {
            out = out.header(name, value);
        }
        reported.push(EnvoyHeader {
            key: name.as_str().to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..EnvoyHeader::default()
        });
    }
    tap.response_headers(reported);
    let stream = resp.bytes_stream().map(move |chunk| {
        if let Ok(bytes) = &chunk {
            tap.response_body(bytes);
        }
        chunk
    });
    out.body(Body::from_stream(stream))
        .unwrap_or_else(|_| plain(StatusCode::BAD_GATEWAY, "bad upstream headers"))
}

/// The response phase of one ext_proc stream: messages out without waiting, answers drained in
/// the background; ends the stream (end of body, then close) when dropped.
struct Tap {
    tx: mpsc::Sender<ProcessingRequest>,
    inbound: Option<tonic::Streaming<ProcessingResponse>>,
    stats: Arc<GatewayStats>,
    /// The endpoint that served (`ip:port`), reported with every message.
    served: String,
    /// Whether the end of the body was sent.
    ended: bool,
}

impl Tap {
    fn metadata(&self) -> Option<Metadata> {
        let mut lb = Struct::default();
        lb.fields.insert(
            SERVED.to_owned(),
            Value {
                kind: Some(Kind::StringValue(self.served.clone())),
            },
        );
        let mut filter_metadata = HashMap::new();
        filter_metadata.insert(LB_NAMESPACE.to_owned(), lb);
        Some(Metadata {
            filter_metadata,
            ..Metadata::default()
        })
    }

    fn send(&mut self, request: processing_request::Request) {
        let message = ProcessingRequest {
            request: Some(request),
            metadata_context: self.metadata(),
            ..ProcessingRequest::default()
        };
        if self.tx.try_send(message).is_err() {
            self.stats.tap_dropped.fetch_add(1, Ordering::Relaxed);
        }
        if self.inbound.is_some() {
            self.drain();
        }
    }

    /// Reads the picker's answers in the background until it closes (or [`TAP_LINGER`]).
    fn drain(&mut self) {
        // Outside a runtime (a drop at shutdown) the answers are simply not read.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if let Some(mut inbound) = self.inbound.take() {
            runtime.spawn(async move {
                let _ = tokio::time::timeout(TAP_LINGER, async {
                    while let Ok(Some(_)) = inbound.message().await {}
                })
                .await;
            });
        }
    }

    fn response_headers(&mut self, headers: Vec<EnvoyHeader>) {
        self.send(processing_request::Request::ResponseHeaders(HttpHeaders {
            headers: Some(EnvoyHeaders { headers }),
            end_of_stream: false,
            ..HttpHeaders::default()
        }));
    }

    fn response_body(&mut self, chunk: &[u8]) {
        for part in chunk.chunks(CHUNK_BYTES) {
            self.send(processing_request::Request::ResponseBody(HttpBody {
                body: part.to_vec(),
                end_of_stream: false,
                ..HttpBody::default()
            }));
        }
    }

    /// Ends the body (once) and lets the stream close.
    fn finish(&mut self) {
        if !self.ended {
            self.ended = true;
            self.send(processing_request::Request::ResponseBody(HttpBody {
                body: Vec::new(),
                end_of_stream: true,
                ..HttpBody::default()
            }));
        }
        self.drain();
    }
}

impl Drop for Tap {
    fn drop(&mut self) {
        // The answer's stream ended (or the client went away): the body is over.
        self.finish();
    }
}
