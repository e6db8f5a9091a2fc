//! The spans of one routed request, and W3C trace context in and out of it.
//!
//! Exists so the request path touches tracing in one way only: [`RequestTrace::start`] returns
//! `None` unless the node traces (its `[tracing]` on and an export pipeline installed, see
//! `otel.rs`), and every call site is `if let Some(trace)`, so a node without tracing does no
//! work and no allocation for it. With tracing on:
//!
//! - the request gets a server span `kvmesh.route` whose parent is the client's `traceparent`
//!   (with its `tracestate`); a missing or malformed one starts a new trace;
//! - the routing decision lands on it as attributes (policy, replica, hit blocks and tokens,
//!   branch, attempts, forwarded region, tenant, model, status code);
//! - each attempt at a replica is a client span `kvmesh.upstream`, and each try of a node of
//!   another region a client span `kvmesh.forward`, whose context replaces the `traceparent`
//!   (and `tracestate`) sent on, so the replica — or the next node, which continues the trace
//!   the same way — sees the node's span as its parent;
//! - the request span ends when the response body does (or the client goes away).
//!
//! With tracing off the node forwards the client's `traceparent` and `tracestate` untouched,
//! like every other header: it is transparent to the trace, not a break in it.

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing::field::Empty;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::otel;
use crate::core::router::{ForwardReason, Routed};
use crate::node::Node;

/// The spans of one request at a tracing node.
pub struct RequestTrace {
    span: Span,
}

impl RequestTrace {
    /// Opens the request's server span, child of the trace context in `headers` (the client's
    /// request), or returns `None` when `node` does not trace. `hop`: another node forwarded
    /// the request here.
    pub fn start(node: &Node, path: &'static str, headers: &HeaderMap, hop: bool) -> Option<Self> {
        if !node.cfg.tracing.enabled() || !otel::installed() {
            return None;
        }
        let span = tracing::trace_span!(
            target: otel::TARGET,
            "kvmesh.route",
            otel.kind = "server",
            otel.status_code = Empty,
            http.request.method = "POST",
            url.path = path,
            http.response.status_code = Empty,
            kvmesh.node = node.cfg.mesh.as_ref().map_or("", |m| m.node_id.as_str()),
            kvmesh.region = node.cfg.region.as_str(),
            kvmesh.policy = node.policy().as_str(),
            kvmesh.hop = hop,
            kvmesh.model = Empty,
            kvmesh.tenant = Empty,
            kvmesh.prompt_tokens = Empty,
            kvmesh.branch = Empty,
            kvmesh.replica = Empty,
            kvmesh.hit_blocks = Empty,
            kvmesh.hit_tokens = Empty,
            kvmesh.best_hit_blocks = Empty,
            kvmesh.predicted_ttft_ms = Empty,
            kvmesh.attempts = Empty,
            kvmesh.forwarded_region = Empty,
            kvmesh.forward_reason = Empty,
            kvmesh.forwarded_to = Empty,
        );
        // An absent or malformed `traceparent` extracts an empty context: the span is a root.
        let parent = TraceContextPropagator::new().extract(&Extract(headers));
        // Fails only if the span is disabled (no layer took it): then it is inert anyway.
        let _ = span.set_parent(parent);
        Some(RequestTrace { span })
    }

    /// The request's span (to instrument the request future with, or to keep open while the
    /// response body streams).
    pub fn span(&self) -> &Span {
        &self.span
    }

    /// What the request asks for.
    pub fn request(&self, model: &str, tenant: Option<&str>, prompt_tokens: u64) {
        self.span.record("kvmesh.model", model);
        if let Some(t) = tenant {
            self.span.record("kvmesh.tenant", t);
        }
        self.span.record("kvmesh.prompt_tokens", prompt_tokens);
    }

    /// A local route, attempt number `attempt` (1 = first): the last one recorded is the one
    /// that served (or failed last).
    pub fn routed(&self, routed: &Routed, replica: &str, hit_tokens: u64, attempt: u32) {
        let s = &self.span;
        s.record("kvmesh.branch", routed.branch().as_str());
        s.record("kvmesh.replica", replica);
        s.record("kvmesh.hit_blocks", routed.hit_blocks);
        s.record("kvmesh.hit_tokens", hit_tokens);
        if let Some(best) = routed.best_hit_blocks {
            s.record("kvmesh.best_hit_blocks", best);
        }
        s.record("kvmesh.predicted_ttft_ms", routed.predicted_s * 1000.0);
        s.record("kvmesh.attempts", attempt);
    }

    /// A `Forward` decision: the request goes to a node of `region`.
    pub fn forwarding(&self, region: &str, reason: ForwardReason) {
        let s = &self.span;
        s.record(
            "kvmesh.branch",
            match reason {
                ForwardReason::Spill => "spill",
                ForwardReason::NoLocalReplica | ForwardReason::Prefix => "forward",
            },
        );
        s.record("kvmesh.forwarded_region", region);
        s.record(
            "kvmesh.forward_reason",
            match reason {
                ForwardReason::Spill => "spill",
                ForwardReason::NoLocalReplica => "no_local_replica",
                ForwardReason::Prefix => "prefix",
            },
        );
    }

    /// A client span for attempt `attempt` (1 = first) at replica `replica`; inject it into the
    /// attempt's headers with [`inject`] and close it with [`attempt_done`].
    pub fn attempt(&self, replica: &str, attempt: u32) -> Span {
        tracing::trace_span!(
            target: otel::TARGET,
            parent: &self.span,
            "kvmesh.upstream",
            otel.kind = "client",
            otel.status_code = Empty,
            kvmesh.replica = replica,
            kvmesh.attempt = attempt,
            http.response.status_code = Empty,
            error.type = Empty,
        )
    }

    /// The response status the client gets.
    pub fn finish(&self, status: StatusCode) {
        self.span
            .record("http.response.status_code", status.as_u16());
        // Server spans: only 5xx are the server's errors (OpenTelemetry's HTTP conventions).
        if status.is_server_error() {
            self.span.record("otel.status_code", "ERROR");
        }
    }
}

/// A client span for forwarding to node `peer` of `region`, child of `parent` (the request's
/// span); inject it into the forwarded request's headers.
pub fn forward_span(parent: &Span, region: &str, peer: &str) -> Span {
    tracing::trace_span!(
        target: otel::TARGET,
        parent: parent,
        "kvmesh.forward",
        otel.kind = "client",
        otel.status_code = Empty,
        kvmesh.forwarded_region = region,
        kvmesh.peer = peer,
        http.response.status_code = Empty,
        error.type = Empty,
    )
}

/// Records how an attempt (or forward) ended on its span: the replica's status, or `error`
/// (`connect`, `timeout`, `transport`) when none came.
pub fn attempt_done(span: &Span, status: Option<StatusCode>, error: Option<&'static str>) {
    if let Some(s) = status {
        span.record("http.response.status_code", s.as_u16());
    }
    if let Some(e) = error {
        span.record("error.type", e);
    }
    if error.is_some() || status.is_some_and(|s| s.is_server_error()) {
        span.record("otel.status_code", "ERROR");
    }
}

/// Writes `span`'s trace context as `traceparent` (and `tracestate`) into `headers`, replacing
/// the client's. A span without a valid context (not exported) leaves `headers` as they are.
pub fn inject(span: &Span, headers: &mut HeaderMap) {
    TraceContextPropagator::new().inject_context(&span.context(), &mut Inject(headers));
}

/// Reads trace context from request headers. A header that is not text is absent.
struct Extract<'a>(&'a HeaderMap);

impl Extractor for Extract<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

/// Writes trace context into outgoing headers. An empty value (no `tracestate`) removes the
/// header, so a client's stale `tracestate` does not ride along a different trace.
struct Inject<'a>(&'a mut HeaderMap);

impl Injector for Inject<'_> {
    fn set(&mut self, key: &str, value: String) {
        let Ok(name) = HeaderName::from_bytes(key.as_bytes()) else {
            return;
        };
        match HeaderValue::try_from(value) {
            Ok(v) if !v.is_empty() => {
                self.0.insert(name, v);
            }
            _ => {
                self.0.remove(name);
            }
        }
    }
}
