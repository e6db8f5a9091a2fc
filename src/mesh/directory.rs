//! The directory: "which nodes of region R do you know?", asked of a seed on a QUIC stream.
//!
//! With regional gossip each region is its own chitchat cluster, and a chitchat seed of another
//! region would only answer "wrong cluster" (and both sides would log it every round). Operators
//! still list whatever seeds they have — a DNS SRV name for the whole fleet, node 0 — so a node
//! asks each seed this question instead, and gossips with the answers: same-region nodes join
//! its regional cluster, representatives its region-layer cluster. A seed of the node's own
//! region answers with its region's members; a seed elsewhere with the forwarding targets and
//! representatives its region records name. Answers are small and bounded both ways.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use super::sync::SyncError;

/// Addresses an answer carries per list at most.
pub const MAX_DIRECTORY_PEERS: usize = 16;
/// Largest directory request accepted.
pub const MAX_DIRECTORY_REQUEST_BYTES: usize = 256;
/// Largest directory answer accepted.
pub const MAX_DIRECTORY_ANSWER_BYTES: usize = 2048;
/// Longest region name asked or answered (as `schema::bounds` bounds strings).
const MAX_REGION_BYTES: usize = 128;

/// The question.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DirectoryRequest {
    /// The region whose nodes are wanted.
    pub region: String,
}

/// The answer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DirectoryAnswer {
    /// The answering node's own region.
    pub region: String,
    /// Live nodes of the asked region it knows (QUIC addresses), at most
    /// [`MAX_DIRECTORY_PEERS`].
    #[serde(default)]
    pub peers: Vec<SocketAddr>,
    /// Region-layer members (representatives of any region) it knows, at most
    /// [`MAX_DIRECTORY_PEERS`].
    #[serde(default)]
    pub reps: Vec<SocketAddr>,
}

impl DirectoryRequest {
    /// msgpack bytes.
    pub fn encode(&self) -> Result<Vec<u8>, SyncError> {
        rmp_serde::to_vec_named(self).map_err(|e| SyncError::Malformed(e.to_string()))
    }

    /// Decodes and bounds a peer's request.
    pub fn decode(bytes: &[u8]) -> Result<Self, SyncError> {
        if bytes.len() > MAX_DIRECTORY_REQUEST_BYTES {
            return Err(SyncError::Malformed("directory request too large".into()));
        }
        let r: DirectoryRequest =
            rmp_serde::from_slice(bytes).map_err(|e| SyncError::Malformed(e.to_string()))?;
        if r.region.len() > MAX_REGION_BYTES {
            return Err(SyncError::Malformed("region name too long".into()));
        }
        Ok(r)
    }
}

impl DirectoryAnswer {
    /// msgpack bytes (lists trimmed to their caps).
    pub fn encode(&self) -> Result<Vec<u8>, SyncError> {
        let mut a = self.clone();
        a.peers.truncate(MAX_DIRECTORY_PEERS);
        a.reps.truncate(MAX_DIRECTORY_PEERS);
        rmp_serde::to_vec_named(&a).map_err(|e| SyncError::Malformed(e.to_string()))
    }

    /// Decodes and bounds a peer's answer.
    pub fn decode(bytes: &[u8]) -> Result<Self, SyncError> {
        if bytes.len() > MAX_DIRECTORY_ANSWER_BYTES {
            return Err(SyncError::Malformed("directory answer too large".into()));
        }
        let a: DirectoryAnswer =
            rmp_serde::from_slice(bytes).map_err(|e| SyncError::Malformed(e.to_string()))?;
        if a.region.len() > MAX_REGION_BYTES
            || a.peers.len() > MAX_DIRECTORY_PEERS
            || a.reps.len() > MAX_DIRECTORY_PEERS
        {
            return Err(SyncError::Malformed(
                "directory answer over its bounds".into(),
            ));
        }
        Ok(a)
    }
}

/// What this node can tell askers; `Mesh` refreshes it every round.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Directory {
    /// This node's region.
    pub region: String,
    /// Live nodes by region (this node's region: its regional members; others: the targets
    /// their region records name).
    pub by_region: BTreeMap<String, Vec<SocketAddr>>,
    /// Region-layer members it knows.
    pub reps: Vec<SocketAddr>,
}

impl Directory {
    /// The answer to `req`.
    pub fn answer(&self, req: &DirectoryRequest) -> DirectoryAnswer {
        let mut peers = self.by_region.get(&req.region).cloned().unwrap_or_default();
        peers.truncate(MAX_DIRECTORY_PEERS);
        let mut reps = self.reps.clone();
        reps.truncate(MAX_DIRECTORY_PEERS);
        DirectoryAnswer {
            region: self.region.clone(),
            peers,
            reps,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(p: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], p))
    }

    #[test]
    fn a_node_answers_with_the_asked_regions_nodes_and_every_rep_it_knows() {
        let mut d = Directory {
            region: "eu".into(),
            ..Default::default()
        };
        d.by_region.insert("eu".into(), (1..40).map(addr).collect());
        d.by_region.insert("us".into(), vec![addr(100)]);
        d.reps = vec![addr(7), addr(100)];
        let a = d.answer(&DirectoryRequest {
            region: "eu".into(),
        });
        assert_eq!(a.region, "eu");
        assert_eq!(a.peers.len(), MAX_DIRECTORY_PEERS);
        let a = d.answer(&DirectoryRequest {
            region: "us".into(),
        });
        assert_eq!(a.peers, vec![addr(100)]);
        assert_eq!(a.reps, vec![addr(7), addr(100)]);
        let a = d.answer(&DirectoryRequest {
            region: "ap".into(),
        });
        assert!(a.peers.is_empty());
        let bytes = a.encode().unwrap();
        assert_eq!(DirectoryAnswer::decode(&bytes).unwrap(), a);
    }

    #[test]
    fn oversized_or_malformed_messages_are_refused() {
        assert!(DirectoryRequest::decode(&[0xc1]).is_err());
        let long = DirectoryRequest {
            region: "x".repeat(200),
        };
        let bytes = rmp_serde::to_vec_named(&long).unwrap();
        assert!(DirectoryRequest::decode(&bytes).is_err());
        let big = DirectoryAnswer {
            region: "eu".into(),
            peers: (0..40).map(addr).collect(),
            reps: vec![],
        };
        let bytes = rmp_serde::to_vec_named(&big).unwrap();
        assert!(DirectoryAnswer::decode(&bytes).is_err());
        // Encoding trims to the caps, so what a node sends always decodes.
        let bytes = big.encode().unwrap();
        assert_eq!(
            DirectoryAnswer::decode(&bytes).unwrap().peers.len(),
            MAX_DIRECTORY_PEERS
        );
    }
}
