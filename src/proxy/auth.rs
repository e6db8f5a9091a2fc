//! Bearer tokens: the admin and metrics tokens, where API keys are read from, and what a replica
//! gets instead of the client's key.
//!
//! Exists so every check compares in constant time and reads the header one way.

use axum::http::{header, HeaderMap, HeaderValue};

use super::error::ApiError;
use super::respond::is_hop_header;
use crate::node::Node;

/// Constant-time comparison, so the token cannot be guessed byte by byte from response times.
fn token_matches(given: &[u8], expected: &[u8]) -> bool {
    given.len() == expected.len()
        && given
            .iter()
            .zip(expected)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// The request's bearer token, if any.
pub(super) fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
}

/// Passes when no token is required or the request bears it.
pub(super) fn authorized(headers: &HeaderMap, expected: Option<&str>) -> Result<(), ApiError> {
    match expected {
        None => Ok(()),
        Some(t) if token_matches(bearer(headers).unwrap_or("").as_bytes(), t.as_bytes()) => Ok(()),
        Some(_) => Err(ApiError::unauthorized()),
    }
}

/// The client's API key: a bearer token (OpenAI's clients) or `x-api-key` (Anthropic's).
pub(super) fn api_key(headers: &HeaderMap) -> Option<&str> {
    bearer(headers).or_else(|| {
        headers
            .get(API_KEY_HEADER)
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty())
    })
}

/// The header Anthropic's clients send their key in.
pub(super) const API_KEY_HEADER: &str = "x-api-key";

/// The client's headers as the replica gets them: hop-by-hop ones removed; with API keys, the
/// client's key (for this node) replaced by the operator's replica token, if any.
pub(super) fn upstream_headers(node: &Node, client: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(client.len());
    for (k, v) in client {
        if !is_hop_header(k) {
            out.append(k.clone(), v.clone());
        }
    }
    if node.secrets.api_keys.is_some() {
        out.remove(header::AUTHORIZATION);
        out.remove(API_KEY_HEADER);
        if let Some(v) = node
            .secrets
            .replica_token
            .as_deref()
            .and_then(|t| HeaderValue::from_str(&format!("Bearer {t}")).ok())
        {
            out.insert(header::AUTHORIZATION, v);
        }
    }
    out
}
