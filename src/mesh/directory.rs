//! The directory: "which nodes of region R do you know?", asked of a seed on a QUIC stream.
//!
//! With regional gossip each region is its own chitchat cluster, and a chitchat seed of another
//! region would only answer "wrong cluster" (and both sides would log it every round). Operators
//! still list whatever seeds they have — a DNS SRV name for the whole fleet, node 0 — so a node
//! asks each seed this question instead, and gossips with the answers: same-region nodes join
//! its regional cluster, representatives its region-layer cluster. A seed of the node's own
//! region answers with its region's members; a seed elsewhere with the forwarding targets and
//! representatives its region records name. Answers are small and bounded both ways.
//!
//! Every seed is also a rendezvous: it remembers who recently asked for which region
//! ([`Askers`]) and names them to later askers of the same region. When a whole fleet starts at
//! once, a region's own seed is often the slowest to answer (every node of every region dials
//! it); with the rendezvous the nodes of a region find each other through whichever seed answers
//! first, before any seed has run a regional round.

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

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
/// Askers remembered per region: enough for an answer, and a flood of askers only replaces
/// older ones.
pub const MAX_ASKERS_PER_REGION: usize = MAX_DIRECTORY_PEERS;
/// Regions with remembered askers at most (a peer naming made-up regions evicts the oldest).
pub const MAX_ASKER_REGIONS: usize = 64;
/// How long an asker is named to others: a start-up's worth; after that the regional rounds
/// know the region's members.
pub const ASKER_TTL: Duration = Duration::from_secs(30);

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

/// Who recently asked for which region: the rendezvous half of a seed (see the module doc).
///
/// The address is the asking connection's own (a node dials from its gossip socket), never one
/// the asker names, so a peer can add only itself. Sans-IO: time comes as an argument.
#[derive(Debug, Default)]
pub struct Askers {
    /// Per region, askers oldest first (an asker asking again moves to the back).
    by_region: BTreeMap<String, VecDeque<(SocketAddr, Instant)>>,
}

impl Askers {
    /// Records that `who` asked for `region` at `now`, and returns the other askers of that
    /// region still within [`ASKER_TTL`], newest first, at most `room`.
    pub fn ask(
        &mut self,
        region: &str,
        who: SocketAddr,
        now: Instant,
        room: usize,
    ) -> Vec<SocketAddr> {
        let fresh = |at: &Instant| now.saturating_duration_since(*at) < ASKER_TTL;
        self.by_region.retain(|_, q| {
            q.retain(|(_, at)| fresh(at));
            !q.is_empty()
        });
        let others: Vec<SocketAddr> = self
            .by_region
            .get(region)
            .into_iter()
            .flat_map(|q| q.iter().rev())
            .map(|(a, _)| *a)
            .filter(|a| *a != who)
            .take(room)
            .collect();
        if !self.by_region.contains_key(region) && self.by_region.len() >= MAX_ASKER_REGIONS {
            // The region whose newest asker is oldest goes.
            let stalest = self
                .by_region
                .iter()
                .min_by_key(|(_, q)| q.back().map(|(_, at)| *at))
                .map(|(r, _)| r.clone());
            if let Some(r) = stalest {
                self.by_region.remove(&r);
            }
        }
        let q = self.by_region.entry(region.to_owned()).or_default();
        q.retain(|(a, _)| *a != who);
        if q.len() >= MAX_ASKERS_PER_REGION {
            q.pop_front();
        }
        q.push_back((who, now));
        others
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
    fn a_seed_names_earlier_askers_of_the_same_region_to_later_ones() {
        let t0 = Instant::now();
        let mut k = Askers::default();
        assert!(k.ask("eu", addr(1), t0, 16).is_empty());
        assert!(k.ask("us", addr(9), t0, 16).is_empty());
        assert_eq!(k.ask("eu", addr(2), t0, 16), vec![addr(1)]);
        // Newest first, never the asker itself, at most `room`.
        assert_eq!(k.ask("eu", addr(3), t0, 16), vec![addr(2), addr(1)]);
        assert_eq!(k.ask("eu", addr(1), t0, 1), vec![addr(3)]);
        // Past the TTL nobody is named.
        assert!(k.ask("eu", addr(4), t0 + ASKER_TTL, 16).is_empty());
    }

    #[test]
    fn askers_are_capped_per_region_and_in_regions() {
        let t0 = Instant::now();
        let mut k = Askers::default();
        for p in 0..100 {
            k.ask("eu", addr(p), t0, 0);
        }
        let named = k.ask("eu", addr(1000), t0, 100);
        assert_eq!(named.len(), MAX_ASKERS_PER_REGION);
        assert_eq!(named[0], addr(99), "a flood replaces the oldest");
        for r in 0..200u16 {
            let t = t0 + Duration::from_millis(u64::from(r));
            k.ask(&format!("made-up-{r}"), addr(r), t, 0);
        }
        assert!(k.by_region.len() <= MAX_ASKER_REGIONS);
        assert!(k.by_region.contains_key("made-up-199"));
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
