//! The request path, stage by stage: identify → read → understand → decide → deliver → relay.
//!
//! Exists so a reader can name each step of a request and find it in its own file:
//! - identify (`identify.rs`): tenant, session, forwarded-by-a-peer, from the head alone;
//! - read (`body.rs`): the whole body, bounded in size, time, rate and node-wide budget;
//! - understand (`understand.rs`): the API's dialect read into model, block keys and length;
//! - decide (`decide.rs`): the node's routing, admission, P/D pair or region, booked in a ticket;
//! - deliver (`deliver.rs`): attempts, failover, hedging, forwarding, P/D legs;
//! - relay (`respond.rs`, `receipts.rs`): the answer streamed back unbuffered, and its receipt.
//!
//! Every API the node serves enters here through its route; only errors differ in shape
//! (Anthropic's for Messages). When the node traces (`trace_span.rs`), the request runs inside
//! its `kvmesh.route` span; otherwise none of that exists.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use tracing::Instrument;

use super::auth::upstream_headers;
use super::deliver::{deliver, Delivery};
use super::error::{ApiError, ErrorShape};
use super::identify::{header_str, identify, Identity};
use super::listener::conn_info;
use super::region_forward;
use super::trace_span::RequestTrace;
use super::understand::{understand, Understood};
use crate::core::dialect::Api;
use crate::core::router::RouteRequest;
use crate::node::Node;

pub use super::respond::{DECISION_HEADER, HIT_HEADER, REPLICA_HEADER};

macro_rules! api_route {
    ($(#[$doc:meta])* $name:ident, $api:expr, $path:literal) => {
        $(#[$doc])*
        pub async fn $name(State(node): State<Arc<Node>>, req: Request) -> Response {
            handle(node, $api, $path, req).await
        }
    };
}

api_route!(
    /// `POST /v1/completions`.
    completions, Api::Completions, "/v1/completions"
);
api_route!(
    /// `POST /v1/chat/completions`.
    chat_completions, Api::Chat, "/v1/chat/completions"
);
api_route!(
    /// `POST /v1/messages` (Anthropic Messages).
    messages, Api::Messages, "/v1/messages"
);
api_route!(
    /// `POST /v1/messages/count_tokens` (Anthropic), routed by load.
    count_tokens, Api::CountTokens, "/v1/messages/count_tokens"
);
api_route!(
    /// `POST /v1/responses` (OpenAI Responses).
    responses, Api::Responses, "/v1/responses"
);
api_route!(
    /// `POST /v1/embeddings`, routed by load.
    embeddings, Api::Pooling, "/v1/embeddings"
);
api_route!(
    /// `POST /v1/rerank`, routed by load.
    rerank_v1, Api::Pooling, "/v1/rerank"
);
api_route!(
    /// `POST /rerank`, routed by load.
    rerank, Api::Pooling, "/rerank"
);
api_route!(
    /// `POST /v1/score`, routed by load.
    score, Api::Pooling, "/v1/score"
);

/// The error shape of `api`'s clients.
pub(super) fn error_shape(api: Api) -> ErrorShape {
    match api {
        Api::Messages | Api::CountTokens => ErrorShape::Anthropic,
        _ => ErrorShape::OpenAi,
    }
}

/// Counts a request in `kvmesh_in_flight_total` until dropped, which also covers a client that
/// disconnects while the node waits for the replica (the handler future is then dropped).
struct Pending(prometheus::IntGauge);

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.dec();
    }
}

async fn handle(node: Arc<Node>, api: Api, path: &'static str, mut req: Request) -> Response {
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
        // Events inside (a failed attempt, say) become events of the request's span.
        Some(t) => {
            pipeline(&node, api, path, req, Some(t))
                .instrument(t.span().clone())
                .await
        }
        None => pipeline(&node, api, path, req, None).await,
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
            node.metrics
                .requests
                .with_label_values(&["", node.policy().as_str(), outcome_label(e.status)])
                .inc();
            e.into_response_shaped(error_shape(api))
        }
    }
}

fn outcome_label(status: StatusCode) -> &'static str {
    match status {
        StatusCode::NOT_FOUND => "unknown_model",
        StatusCode::TOO_MANY_REQUESTS => "over_quota",
        StatusCode::SERVICE_UNAVAILABLE => "unavailable",
        StatusCode::BAD_GATEWAY => "failed",
        s if s.is_client_error() => "bad_request",
        _ => "error",
    }
}

/// The stages, in order.
async fn pipeline(
    node: &Arc<Node>,
    api: Api,
    path: &'static str,
    req: Request,
    trace: Option<&RequestTrace>,
) -> Result<Response, ApiError> {
    let (parts, body) = req.into_parts();
    let from_peer = parts
        .extensions
        .get::<super::listener::ConnInfo>()
        .is_some_and(|c| c.peer);
    let who = identify(node, &parts.headers, from_peer)?;
    let (body, _budget) = super::body::read(node, body, &parts.headers).await?;
    let mut u = understand(node, api, path, body, who.tenant).await?;
    if let Some(t) = trace {
        t.request(u.model(), who.tenant, u.prompt_tokens);
    }
    // A follow-up of a stored response goes to the replica that stores it, and only there.
    let pinned = pin_to_stored_response(node, &u).await?;
    let class = node.priority_class(
        who.tenant,
        node.cfg
            .priorities
            .as_ref()
            .and_then(|p| header_str(&parts.headers, &p.header)),
    );
    // The keys travel apart (they end up in the answer); the rest is read in place.
    let keys = std::mem::take(&mut u.keys);
    let route_req = route_request(&who, &u, pinned.as_deref());
    let d = Delivery {
        node,
        headers: upstream_headers(node, &parts.headers),
        tenant: who.tenant,
        class,
        trace,
        u: &u,
    };
    deliver(d, route_req, keys).await
}

/// What the router is asked; `keys` are filled in per attempt by `deliver`. `pinned`: every
/// replica but a stored response's holder, excluded, and no forwarding.
pub(super) fn route_request<'a>(
    who: &Identity<'a>,
    u: &'a Understood,
    pinned: Option<&'a [usize]>,
) -> RouteRequest<'a> {
    RouteRequest {
        model: u.model(),
        keys: &[],
        prompt_tokens: u.prompt_tokens,
        session: who.session.or(u.fields.user()),
        affinity_key: who.affinity_key.or(u.fields.affinity_key()),
        tenant: who.tenant,
        // A request another node forwarded is served here or refused, never forwarded again;
        // a stored response's follow-up is served by its holder or refused.
        forwarded: who.forwarded || pinned.is_some(),
        exclude: pinned.unwrap_or(&[]),
    }
}

/// With `previous_response_id`: every replica except the one that stores it (to exclude), or a
/// 404 when none does.
pub(super) async fn pin_to_stored_response(
    node: &Arc<Node>,
    u: &Understood,
) -> Result<Option<Vec<usize>>, ApiError> {
    let Some(id) = u.fields.previous_response_id() else {
        return Ok(None);
    };
    let holder = super::stored_responses::locate(node, Some(u.model()), id)
        .await?
        .ok_or_else(|| super::stored_responses::not_found(id))?;
    let replicas = node.replica_count();
    Ok(Some((0..replicas).filter(|&i| i != holder).collect()))
}
