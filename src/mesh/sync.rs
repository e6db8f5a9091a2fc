//! Summary sync and routed-block reports: the mesh traffic too big or too frequent for gossip.
//!
//! Gossip only says *which* summary a replica's home holds (`replica:<id>` → epoch/seq/digest).
//! A node that sees a newer version pulls the body over a QUIC **bidi** stream:
//!
//! ```text
//! request:  [KIND_SUMMARY_REQUEST] msgpack-named SummaryRequest {replica_id, epoch, seq}   (≤ 1 KiB)
//! response: [RESP_OK] SummaryMessage::encode()   — a delta when the home's log reaches back to
//!                                                  `seq` of the same epoch, else a snapshot
//!           [RESP_UNKNOWN | RESP_BAD_REQUEST | RESP_NO_HANDLER] utf-8 reason
//! ```
//!
//! Routing nodes tell a replica's home which blocks they just sent there (engines without KV
//! events are modelled from these) in batched, fire-and-forget **uni** streams:
//!
//! ```text
//! [KIND_BLOCK_REPORT] msgpack-named BlockReport {replica_id, keys, kv_tenant}   (≤ MAX_REPORT_KEYS keys)
//! ```
//!
//! A report carries the KV-quota tenant of the requests whose blocks it lists (one report per
//! tenant label), so the home's model attributes every node's blocks, not only its own, and the
//! shares it publishes are the fleet's (`core::tenants`, `schema::ReplicaRecord::kv_shares`).
//!
//! Every peer byte is decoded with a bound; anything malformed is dropped and counted by the
//! transport, never a panic.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::core::summary::{SummaryError, SummaryMessage, MAX_SUMMARY_MESSAGE_BYTES};

use super::load_share::LoadUpdate;
use super::schema::{MAX_REPLICA_ID_BYTES, MAX_TENANT_BYTES};

/// Largest summary request accepted.
pub const MAX_REQUEST_BYTES: usize = 1024;
/// Most keys in one block report; senders split larger batches.
pub const MAX_REPORT_KEYS: usize = 8192;
/// Largest block report accepted (msgpack u64s take at most 9 bytes each, plus the id).
pub const MAX_REPORT_BYTES: usize =
    MAX_REPORT_KEYS * 9 + MAX_REPLICA_ID_BYTES + MAX_TENANT_BYTES + 96;
/// Largest summary response accepted (status byte + the core's bound).
pub const MAX_RESPONSE_BYTES: usize = MAX_SUMMARY_MESSAGE_BYTES + 1;

/// Response status: a summary message follows.
pub const RESP_OK: u8 = 0;
/// Response status: this node has no summary for the replica.
pub const RESP_UNKNOWN: u8 = 1;
/// Response status: the request did not decode.
pub const RESP_BAD_REQUEST: u8 = 2;
/// Response status: the node serves no summaries (no handler registered yet).
pub const RESP_NO_HANDLER: u8 = 3;

/// Errors of summary sync and block reports as messages (the transport wraps them in
/// `TransportError::Sync` with its own failures: this file stays below the transport).
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// The peer answered with an error status.
    #[error("peer refused the summary request ({status}): {reason}")]
    Refused {
        /// The status byte.
        status: u8,
        /// The peer's reason.
        reason: String,
    },
    /// The response was empty or not a summary message.
    #[error("malformed summary response: {0}")]
    Malformed(String),
    /// The summary message itself was refused by the core's bounded decoder.
    #[error(transparent)]
    Summary(#[from] SummaryError),
    /// A request or report that we refuse to send (bad id, too many keys).
    #[error("invalid {0}")]
    Invalid(String),
}

/// What a node asks a replica's home for: the changes since the summary it holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SummaryRequest {
    /// The replica.
    pub replica_id: String,
    /// Epoch of the requester's copy (0 when it has none).
    pub epoch: u64,
    /// Seq of the requester's copy.
    pub seq: u64,
}

impl SummaryRequest {
    /// msgpack-named bytes; refuses bad ids.
    pub fn encode(&self) -> Result<Vec<u8>, SyncError> {
        check_id(&self.replica_id)?;
        rmp_serde::to_vec_named(self).map_err(|e| SyncError::Invalid(e.to_string()))
    }

    /// Decodes a peer's request (bounded).
    pub fn decode(bytes: &[u8]) -> Result<Self, SyncError> {
        if bytes.len() > MAX_REQUEST_BYTES {
            return Err(SyncError::Malformed(format!(
                "request of {} bytes",
                bytes.len()
            )));
        }
        let r: SummaryRequest =
            rmp_serde::from_slice(bytes).map_err(|e| SyncError::Malformed(e.to_string()))?;
        check_id(&r.replica_id).map_err(|e| SyncError::Malformed(e.to_string()))?;
        Ok(r)
    }
}

/// Block keys a routing node just sent to a replica, for the replica's home node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockReport {
    /// The replica the blocks were routed to.
    pub replica_id: String,
    /// Block keys (`BlockKey.0`), in prompt order.
    pub keys: Vec<u64>,
    /// Whose requests brought them, for KV quotas: `None` unknown (a handover, an older node:
    /// the home leaves them unattributed), `""` a tenant without a `max_kv_share`, else the
    /// name of a tenant with one (at most [`MAX_TENANT_BYTES`]). Added after version 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_tenant: Option<String>,
}

impl BlockReport {
    /// msgpack-named bytes; refuses bad ids, tenant names over [`MAX_TENANT_BYTES`] and more
    /// than [`MAX_REPORT_KEYS`] keys.
    pub fn encode(&self) -> Result<Vec<u8>, SyncError> {
        check_id(&self.replica_id)?;
        check_tenant(self.kv_tenant.as_deref())?;
        if self.keys.len() > MAX_REPORT_KEYS {
            return Err(SyncError::Invalid(format!(
                "block report with {} keys (max {MAX_REPORT_KEYS})",
                self.keys.len()
            )));
        }
        rmp_serde::to_vec_named(self).map_err(|e| SyncError::Invalid(e.to_string()))
    }

    /// Decodes a peer's report (bounded).
    pub fn decode(bytes: &[u8]) -> Result<Self, SyncError> {
        if bytes.len() > MAX_REPORT_BYTES {
            return Err(SyncError::Malformed(format!(
                "report of {} bytes",
                bytes.len()
            )));
        }
        let r: BlockReport =
            rmp_serde::from_slice(bytes).map_err(|e| SyncError::Malformed(e.to_string()))?;
        check_id(&r.replica_id).map_err(|e| SyncError::Malformed(e.to_string()))?;
        check_tenant(r.kv_tenant.as_deref()).map_err(|e| SyncError::Malformed(e.to_string()))?;
        if r.keys.len() > MAX_REPORT_KEYS {
            return Err(SyncError::Malformed(format!("{} keys", r.keys.len())));
        }
        Ok(r)
    }
}

/// Whether a node holding `local` (its copy's epoch and seq, `None` without a copy) should pull
/// the summary the home advertises as `remote`. A newer epoch always pulls (a snapshot); an older
/// advertised epoch never does (the gossip is stale, the home has moved on).
pub fn needs_pull(local: Option<(u64, u64)>, remote: &super::schema::SummaryVersion) -> bool {
    match local {
        None => true,
        Some((epoch, seq)) => (remote.epoch, remote.seq) > (epoch, seq),
    }
}

fn check_id(id: &str) -> Result<(), SyncError> {
    if id.is_empty() || id.len() > MAX_REPLICA_ID_BYTES {
        return Err(SyncError::Invalid(format!("replica id {id:?}")));
    }
    Ok(())
}

fn check_tenant(tenant: Option<&str>) -> Result<(), SyncError> {
    match tenant {
        Some(t) if t.len() > MAX_TENANT_BYTES => Err(SyncError::Invalid(format!(
            "tenant name of {} bytes",
            t.len()
        ))),
        _ => Ok(()),
    }
}

/// What the node plugs into the mesh: answers summary requests for the replicas it is home for,
/// and receives block reports. Called on the transport's tasks: keep both quick and never block
/// on I/O (take a lock, copy, return).
pub trait MeshHandler: Send + Sync + 'static {
    /// The answer to `req` (normally `ReplicaSummary::answer(req.epoch, req.seq)`), or `None`
    /// when this node holds no summary for the replica.
    fn summary(&self, req: &SummaryRequest) -> Option<SummaryMessage>;

    /// Blocks routed to a replica by the node at `from` (its gossip address).
    fn block_report(&self, from: SocketAddr, report: BlockReport);

    /// The node at `from` shares its in-flight load (see `load_share`). Ignored by default.
    fn load_update(&self, from: SocketAddr, update: LoadUpdate) {
        let _ = (from, update);
    }
}

/// The server side of a summary request: the response bytes, and whether the request was
/// malformed (for the transport's counter).
pub(crate) fn answer(handler: Option<&dyn MeshHandler>, body: &[u8]) -> (Vec<u8>, bool) {
    let req = match SummaryRequest::decode(body) {
        Ok(r) => r,
        Err(e) => return (status(RESP_BAD_REQUEST, &e.to_string()), true),
    };
    let Some(h) = handler else {
        return (status(RESP_NO_HANDLER, "no summary handler"), false);
    };
    match h.summary(&req) {
        None => (status(RESP_UNKNOWN, &req.replica_id), false),
        Some(msg) => match msg.encode() {
            Ok(bytes) => {
                let mut out = Vec::with_capacity(bytes.len() + 1);
                out.push(RESP_OK);
                out.extend_from_slice(&bytes);
                (out, false)
            }
            Err(e) => (status(RESP_UNKNOWN, &e.to_string()), false),
        },
    }
}

fn status(code: u8, reason: &str) -> Vec<u8> {
    let mut out = vec![code];
    // Reasons are for logs only; cap them so an error can never become a large response.
    out.extend(reason.bytes().take(256));
    out
}

/// The client side: parses a response.
pub(crate) fn parse_response(bytes: &[u8]) -> Result<SummaryMessage, SyncError> {
    match bytes.split_first() {
        None => Err(SyncError::Malformed("empty response".into())),
        Some((&RESP_OK, body)) => Ok(SummaryMessage::decode(body)?),
        Some((&code, reason)) => Err(SyncError::Refused {
            status: code,
            reason: String::from_utf8_lossy(reason).into_owned(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::keys::BlockKey;
    use crate::core::summary::{ReplicaSummary, SummaryConfig};
    use std::sync::Mutex;

    struct One(Mutex<ReplicaSummary>);
    impl MeshHandler for One {
        fn summary(&self, req: &SummaryRequest) -> Option<SummaryMessage> {
            (req.replica_id == "r1").then(|| self.0.lock().unwrap().answer(req.epoch, req.seq))
        }
        fn block_report(&self, _: SocketAddr, _: BlockReport) {}
    }

    #[test]
    fn request_answer_round_trip() {
        let cfg = SummaryConfig::for_cluster("t");
        let mut s = ReplicaSummary::new(7, 1000, &cfg).unwrap();
        s.insert(&[BlockKey(1), BlockKey(2)]);
        let h = One(Mutex::new(s));
        let req = SummaryRequest {
            replica_id: "r1".into(),
            epoch: 7,
            seq: 0,
        };
        let (resp, bad) = answer(Some(&h), &req.encode().unwrap());
        assert!(!bad);
        match parse_response(&resp).unwrap() {
            SummaryMessage::Delta(d) => assert_eq!(d.keys, vec![1, 2]),
            other => panic!("expected a delta, got {other:?}"),
        }
        let unknown = SummaryRequest {
            replica_id: "r2".into(),
            ..req.clone()
        };
        let (resp, _) = answer(Some(&h), &unknown.encode().unwrap());
        assert!(matches!(
            parse_response(&resp),
            Err(SyncError::Refused {
                status: RESP_UNKNOWN,
                ..
            })
        ));
        let (resp, bad) = answer(Some(&h), b"\xc1garbage");
        assert!(bad);
        assert!(matches!(
            parse_response(&resp),
            Err(SyncError::Refused {
                status: RESP_BAD_REQUEST,
                ..
            })
        ));
        let (resp, _) = answer(None, &req.encode().unwrap());
        assert!(matches!(
            parse_response(&resp),
            Err(SyncError::Refused {
                status: RESP_NO_HANDLER,
                ..
            })
        ));
        assert!(parse_response(&[]).is_err());
        assert!(parse_response(&[RESP_OK, 0xc1]).is_err());
    }

    #[test]
    fn pulls_only_newer_versions() {
        use crate::mesh::schema::SummaryVersion;
        let v = |epoch, seq| SummaryVersion {
            epoch,
            seq,
            digest: 0,
        };
        assert!(needs_pull(None, &v(0, 0)));
        assert!(needs_pull(Some((5, 3)), &v(5, 4)));
        assert!(needs_pull(Some((5, 3)), &v(6, 0)));
        assert!(!needs_pull(Some((5, 3)), &v(5, 3)));
        assert!(!needs_pull(Some((5, 3)), &v(4, 99)));
    }

    #[test]
    fn reports_are_bounded() {
        let r = BlockReport {
            replica_id: "r1".into(),
            keys: vec![u64::MAX; MAX_REPORT_KEYS],
            kv_tenant: Some("t".repeat(MAX_TENANT_BYTES)),
        };
        let bytes = r.encode().unwrap();
        assert!(bytes.len() <= MAX_REPORT_BYTES);
        assert_eq!(BlockReport::decode(&bytes).unwrap(), r);
        let big = BlockReport {
            keys: vec![1; MAX_REPORT_KEYS + 1],
            ..r.clone()
        };
        assert!(big.encode().is_err());
        assert!(BlockReport::decode(&rmp_serde::to_vec_named(&big).unwrap()).is_err());
        assert!(BlockReport::decode(b"junk").is_err());
        let empty_id = BlockReport {
            replica_id: String::new(),
            keys: vec![],
            kv_tenant: None,
        };
        assert!(empty_id.encode().is_err());
        // A tenant name past the bound is refused both ways.
        let long = BlockReport {
            kv_tenant: Some("t".repeat(MAX_TENANT_BYTES + 1)),
            keys: vec![1],
            ..r.clone()
        };
        assert!(long.encode().is_err());
        assert!(BlockReport::decode(&rmp_serde::to_vec_named(&long).unwrap()).is_err());
        // An older node's report (no tenant field) still decodes, as unknown.
        #[derive(Serialize)]
        struct V1 {
            replica_id: String,
            keys: Vec<u64>,
        }
        let v1 = rmp_serde::to_vec_named(&V1 {
            replica_id: "r1".into(),
            keys: vec![7],
        })
        .unwrap();
        assert_eq!(BlockReport::decode(&v1).unwrap().kv_tenant, None);
    }
}
