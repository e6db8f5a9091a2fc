//! The runtime admin API (token-protected like `/admin/state`): list, add, drain and remove
//! replicas. `kvmesh replicas …` calls it; the node applies each command and shares it with its
//! region (`node/admin.rs`).
//!
//! - `GET /admin/replicas` — the replicas of this node's region as it sees them.
//! - `POST /admin/replicas` — a `[[replicas]]` entry as JSON: add, or update (and end a drain).
//! - `POST /admin/replicas/{id}/drain` — no new requests; in-flight ones finish.
//! - `DELETE /admin/replicas/{id}` — drain, then drop from the registry.
//!
//! `?wait_s=N` (at most [`MAX_WAIT_S`]) on drain and delete answers once nothing is in flight
//! to the replica through the region's nodes, or after N seconds (`"drained": false`).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;

use super::auth::authorized;
use super::error::ApiError;
use crate::mesh::admin::AdminOp;
use crate::node::watchers::check_all;
use crate::node::{AdminError, AdminOutcome, AdminReplica, Node};
use crate::replicas::entry::ReplicaConfig;

/// The largest replica description `POST /admin/replicas` reads (a few hundred bytes in use).
const MAX_ADMIN_BODY_BYTES: usize = 64 << 10;

/// Longest `wait_s` a drain may ask for.
pub const MAX_WAIT_S: u64 = 600;

/// `?wait_s=` of drain and delete.
#[derive(Debug, Default, serde::Deserialize)]
pub struct WaitQuery {
    /// Seconds to wait for the replica's in-flight requests to finish (0: answer at once).
    #[serde(default)]
    pub wait_s: u64,
}

/// The answer to a command.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct CommandAnswer {
    /// What was done.
    #[serde(flatten)]
    pub outcome: AdminOutcome,
    /// With `wait_s`: whether nothing was in flight any more when it answered.
    pub drained: Option<bool>,
}

fn refused(e: AdminError) -> ApiError {
    match e {
        AdminError::NotFound(_) => ApiError {
            status: StatusCode::NOT_FOUND,
            message: e.to_string(),
            kind: "invalid_request_error",
            param: None,
            code: "replica_not_found",
            retry_after_s: None,
        },
        AdminError::OtherRegion { .. } => ApiError {
            status: StatusCode::CONFLICT,
            message: e.to_string(),
            kind: "invalid_request_error",
            param: Some("region"),
            code: "other_region",
            retry_after_s: None,
        },
        AdminError::Invalid(m) => ApiError::bad_request(m, None),
    }
}

/// `GET /admin/replicas`.
pub async fn list(
    State(node): State<Arc<Node>>,
    headers: HeaderMap,
) -> Result<Json<Vec<AdminReplica>>, ApiError> {
    authorized(&headers, node.secrets.admin_token.as_deref())?;
    Ok(Json(node.admin_replicas()))
}

/// `POST /admin/replicas`. The token is checked before a byte of the body is read; the body is
/// read within [`MAX_ADMIN_BODY_BYTES`] and `server.body_read_timeout_ms`.
pub async fn add(
    State(node): State<Arc<Node>>,
    headers: HeaderMap,
    body: Body,
) -> Result<(StatusCode, Json<CommandAnswer>), ApiError> {
    authorized(&headers, node.secrets.admin_token.as_deref())?;
    let limit = Duration::from_millis(node.cfg.server.body_read_timeout_ms);
    let body =
        match tokio::time::timeout(limit, axum::body::to_bytes(body, MAX_ADMIN_BODY_BYTES)).await {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => {
                return Err(ApiError::bad_request(
                    format!(
                "cannot read the replica description (at most {MAX_ADMIN_BODY_BYTES} bytes): {e}"
            ),
                    None,
                ))
            }
            Err(_) => return Err(ApiError::body_timeout(limit)),
        };
    let spec: ReplicaConfig = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("not a replica description: {e}"), None))?;
    let id = spec.effective_id();
    let outcome = node
        .admin_command(AdminOp::Add, &id, Some(&spec))
        .map_err(refused)?;
    if outcome.new {
        // Answer once it was checked (health, models), so it is routable when the call returns.
        let index = node.lock().view.index_of(&id);
        check_all(&node, index.into_iter()).await;
    }
    let status = if outcome.new {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        Json(CommandAnswer {
            outcome,
            drained: None,
        }),
    ))
}

/// The path's replica id and the `?wait_s=` query as extracted: read only once the token is
/// checked, and refused in the API's error shape, not axum's plain text.
type Asked = (
    Result<Path<String>, PathRejection>,
    Result<Query<WaitQuery>, QueryRejection>,
);

/// `POST /admin/replicas/{id}/drain`.
pub async fn drain(
    State(node): State<Arc<Node>>,
    headers: HeaderMap,
    id: Result<Path<String>, PathRejection>,
    q: Result<Query<WaitQuery>, QueryRejection>,
) -> Result<Json<CommandAnswer>, ApiError> {
    command(node, headers, AdminOp::Drain, (id, q)).await
}

/// `DELETE /admin/replicas/{id}`.
pub async fn remove(
    State(node): State<Arc<Node>>,
    headers: HeaderMap,
    id: Result<Path<String>, PathRejection>,
    q: Result<Query<WaitQuery>, QueryRejection>,
) -> Result<Json<CommandAnswer>, ApiError> {
    command(node, headers, AdminOp::Remove, (id, q)).await
}

async fn command(
    node: Arc<Node>,
    headers: HeaderMap,
    op: AdminOp,
    (id, q): Asked,
) -> Result<Json<CommandAnswer>, ApiError> {
    authorized(&headers, node.secrets.admin_token.as_deref())?;
    let Path(id) = id.map_err(|e| ApiError::bad_request(e.body_text(), None))?;
    let Query(q) = q.map_err(|e| ApiError::bad_request(e.body_text(), Some("wait_s")))?;
    if q.wait_s > MAX_WAIT_S {
        return Err(ApiError::bad_request(
            format!("wait_s must be at most {MAX_WAIT_S}"),
            Some("wait_s"),
        ));
    }
    let mut outcome = node.admin_command(op, &id, None).map_err(refused)?;
    let drained = if q.wait_s > 0 {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(q.wait_s);
        loop {
            outcome.in_flight = node.replica_in_flight(&id);
            if outcome.in_flight == 0 || tokio::time::Instant::now() >= deadline {
                break Some(outcome.in_flight == 0);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    } else {
        None
    };
    Ok(Json(CommandAnswer { outcome, drained }))
}
