//! Stored responses (OpenAI Responses API): a follow-up that names `previous_response_id`, and
//! `GET /v1/responses/{id}` / `POST /v1/responses/{id}/cancel`, must reach the replica that
//! stores the response — through whichever node of the mesh the client calls.
//!
//! Exists because an engine keeps stored responses in its own memory: only that replica has the
//! conversation's context, and no other can answer without silently dropping it. A node locates
//! the holder by asking its region's replicas of the model (`GET /v1/responses/{id}`, all at
//! once, each within [`LOOKUP_TIMEOUT`]; the first that has it wins) and remembers the answer
//! (`Node::response_homes`, bounded), so the lookup needs no mesh state, works from every node
//! alike, and survives node deaths. When no replica has it (its replica is gone, or it was not
//! stored), the client gets a clear 404 in the Responses shape — never an answer without the
//! conversation.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Request, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures::stream::{FuturesUnordered, StreamExt};

use super::error::ApiError;
use super::listener::conn_info;
use crate::node::Node;

/// How long one replica may take to say whether it stores a response.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);
/// The most replicas one lookup asks.
const LOOKUP_FANOUT: usize = 256;
/// The longest response id accepted.
const MAX_ID_BYTES: usize = 256;

/// A response id checked to be safe in a URL path; `param` names where it came from.
fn checked_id<'a>(id: &'a str, param: &'static str) -> Result<&'a str, ApiError> {
    let ok = !id.is_empty()
        && id.len() <= MAX_ID_BYTES
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(id)
    } else {
        Err(ApiError::bad_request(
            format!(
                "'{}' is not a response id",
                id.escape_debug().take(64).collect::<String>()
            ),
            Some(param),
        ))
    }
}

/// 404 for a follow-up: no replica this node can reach stores `id`.
pub(crate) fn not_found(id: &str) -> ApiError {
    ApiError {
        param: Some("previous_response_id"),
        ..ApiError::not_found(
            "response_not_found",
            format!(
                "no replica this node can reach stores response '{id}': the replica that served \
                 it is gone, or it was created with store=false; send the whole conversation \
                 as input instead"
            ),
        )
    }
}

/// 404 for a retrieve or cancel: no replica this node can reach stores `id`.
pub(crate) fn retrieve_not_found(id: &str) -> ApiError {
    ApiError {
        param: Some("response_id"),
        ..ApiError::not_found(
            "response_not_found",
            format!(
                "Response with id '{id}' not found: no replica this node can reach stores it \
                 (the replica that served it is gone, or it was created with store=false)"
            ),
        )
    }
}

/// The view index of the replica that stores response `id` (of `model`, when named), if any.
pub(crate) async fn locate(
    node: &Arc<Node>,
    model: Option<&str>,
    id: &str,
) -> Result<Option<usize>, ApiError> {
    // A follow-up names the model; a retrieve or cancel does not.
    let param = if model.is_some() {
        "previous_response_id"
    } else {
        "response_id"
    };
    let id = checked_id(id, param)?;
    let candidates = node.serving(model);
    let remembered = lock(node).get(id).cloned();
    if let Some(rid) = remembered {
        if let Some(&(i, _)) = candidates.iter().find(|(_, e)| *e.id == *rid) {
            return Ok(Some(i));
        }
    }
    // Held until the lookup ends (the asks are dropped with it).
    let Ok(_lookup) = node.response_lookups.try_acquire() else {
        node.metrics
            .response_lookups
            .with_label_values(&["refused"])
            .inc();
        return Err(ApiError::unavailable(
            "too many stored-response lookups under way at this node",
        ));
    };
    let auth = replica_auth(node);
    let mut asks: FuturesUnordered<_> = candidates
        .iter()
        .take(LOOKUP_FANOUT)
        .map(|(i, e)| {
            let mut ask = node
                .client
                .get(format!("{}/v1/responses/{id}", e.base))
                .timeout(LOOKUP_TIMEOUT);
            if let Some(v) = &auth {
                ask = ask.header(header::AUTHORIZATION, v.clone());
            }
            let ask = ask.send();
            async move { (*i, ask.await.is_ok_and(|a| a.status().is_success())) }
        })
        .collect();
    while let Some((i, has)) = asks.next().await {
        if has {
            if let Some((_, e)) = candidates.iter().find(|(j, _)| *j == i) {
                lock(node).put(id.to_owned(), e.id.to_string());
            }
            node.metrics
                .response_lookups
                .with_label_values(&["found"])
                .inc();
            return Ok(Some(i));
        }
    }
    node.metrics
        .response_lookups
        .with_label_values(&["missing"])
        .inc();
    Ok(None)
}

/// The operator's token for replicas (`[auth]`), as an `Authorization` value.
fn replica_auth(node: &Node) -> Option<axum::http::HeaderValue> {
    let t = node.secrets.replica_token.as_deref()?;
    axum::http::HeaderValue::from_str(&format!("Bearer {t}")).ok()
}

fn lock(node: &Node) -> std::sync::MutexGuard<'_, lru::LruCache<String, String>> {
    node.response_homes
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// `GET /v1/responses/{id}`.
pub async fn get(State(node): State<Arc<Node>>, Path(id): Path<String>, req: Request) -> Response {
    relay_to_holder(&node, &id, reqwest::Method::GET, "", req)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/responses/{id}/cancel`.
pub async fn cancel(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    req: Request,
) -> Response {
    relay_to_holder(&node, &id, reqwest::Method::POST, "/cancel", req)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// Sends a request about stored response `id` to the replica that stores it, and its answer
/// back as it arrives.
async fn relay_to_holder(
    node: &Arc<Node>,
    id: &str,
    method: reqwest::Method,
    suffix: &str,
    req: Request,
) -> Result<Response, ApiError> {
    let from_peer = conn_info(&req).is_some_and(|c| c.peer);
    // With API keys, only a client with a key may read or cancel a stored response.
    super::identify::identify(node, req.headers(), from_peer)?;
    let i = locate(node, None, id)
        .await?
        .ok_or_else(|| retrieve_not_found(id))?;
    let endpoint = node.endpoint(i).ok_or_else(|| retrieve_not_found(id))?;
    // The client's query (`stream`, `starting_after`, `include[]`) goes with it.
    let query = req.uri().query().map_or(String::new(), |q| format!("?{q}"));
    let url = format!("{}/v1/responses/{id}{suffix}{query}", endpoint.base);
    // As the request path sends them: the node's API key replaced by the replica token.
    let headers = super::auth::upstream_headers(node, req.headers());
    let first_byte = Duration::from_millis(node.cfg.timeouts.first_byte_ms);
    let send = node.client.request(method, url).headers(headers).send();
    // Headers within the first-byte timeout; the body (a `?stream=true` retrieve runs as long
    // as the response) then each chunk within the idle timeout.
    let resp = match tokio::time::timeout(first_byte, send).await {
        Ok(r) => r.map_err(|e| {
            ApiError::bad_gateway(format!(
                "the replica failed: {}",
                super::error::upstream_cause(e)
            ))
        })?,
        Err(_) => {
            return Err(ApiError::bad_gateway(format!(
                "the replica sent nothing within {first_byte:?}"
            )))
        }
    };
    let idle = Duration::from_millis(node.cfg.timeouts.idle_ms);
    Ok(super::region_forward::relay_answer(
        resp,
        idle,
        None,
        "no data from the replica",
    ))
}
