//! The identify stage: who sends a request — its tenant, its session, whether a mesh peer
//! forwarded it — from its head alone, before a body byte is read.
//!
//! Exists so that a request without a valid API key costs no body budget, and so that every
//! front (each API's route, a picker) names tenants and sessions by the same rules: with API
//! keys the key names the tenant and a tenant header proves nothing; a request a mesh peer
//! forwarded was checked there and carries its tenant in `TENANT_HEADER`; a session is the first
//! of `session_header` then `session_headers` present (agents' own headers), else the body's
//! user id (read later, in `understand`).

use axum::http::HeaderMap;

use super::error::ApiError;
use super::region_forward;
use crate::node::config::server::key_digest;
use crate::node::Node;

/// Who a request is from.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Identity<'a> {
    /// The tenant, for pools, quotas and priorities.
    pub tenant: Option<&'a str>,
    /// The session a header names, for affinity.
    pub session: Option<&'a str>,
    /// The affinity key a header names.
    pub affinity_key: Option<&'a str>,
    /// Forwarded by another region's node (over mutual TLS): served here or refused.
    pub forwarded: bool,
}

/// A non-empty header value as text.
pub(crate) fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty())
}

/// Identifies the sender of a request with `headers`; `from_peer` says it came over the mesh's
/// mutual TLS. Fails with 401 when API keys are on and the key is missing or unknown.
pub(crate) fn identify<'a>(
    node: &'a Node,
    headers: &'a HeaderMap,
    from_peer: bool,
) -> Result<Identity<'a>, ApiError> {
    let tenant = match &node.secrets.api_keys {
        None => header_str(headers, &node.cfg.tenant_header),
        Some(_) if from_peer => header_str(headers, region_forward::TENANT_HEADER),
        Some(keys) => {
            let key = super::auth::api_key(headers).ok_or_else(ApiError::missing_api_key)?;
            Some(
                keys.get(&key_digest(key.as_bytes()))
                    .ok_or_else(ApiError::missing_api_key)?
                    .as_str(),
            )
        }
    };
    let session = std::iter::once(&node.cfg.session_header)
        .chain(&node.cfg.session_headers)
        .find_map(|h| header_str(headers, h));
    Ok(Identity {
        tenant,
        session,
        affinity_key: header_str(headers, &node.cfg.affinity_header),
        forwarded: from_peer && headers.contains_key(region_forward::HOP_HEADER),
    })
}
