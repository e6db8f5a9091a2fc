//! The region layer: a second, small chitchat cluster of each region's representatives, where
//! regions exchange their region records (`region_record.rs`).
//!
//! Why: with one cluster for the whole mesh every gossip digest lists every node, so each node's
//! traffic grows with the fleet and the fleet's with its square. Regional gossip bounds a node's
//! cost by its region's size; what other regions need of a region is one small aggregate, and a
//! cluster of `k · regions` members (default k = 2) carries those between regions.
//!
//! Representatives are the `k` rendezvous winners of a fixed key over the region's live members
//! ([`representatives`]): every node of the region computes the same set from its own
//! membership, with no election, and a representative's death moves the role to the next node
//! within a failure-detection time. A node runs the layer's chitchat only while it is one, on the
//! same QUIC endpoint (stream kind `KIND_REGIONS_Z`), under the same certificate checks: the
//! layer's digests prove node ids exactly as the regional cluster's do, and its values are
//! signed and checked as the region's are (`signed`, `gossip_guard`): a representative's
//! `node` and `region` records count only for the region its certificate binds, whoever
//! relays them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chitchat::{spawn_chitchat, ChitchatConfig, ChitchatHandle, ChitchatId, FailureDetectorConfig};
use tracing::{debug, info};

use super::region_record::{RegionRecord, KEY_REGION};
use super::schema::{NodeRecord, KEY_NODE};
use super::signed::{payload, LocalSigner};
use super::transport::QuicTransport;
use crate::core::affinity;

/// The key every node ranks its region's members by for the representative role.
const REPRESENTATIVE_KEY: &[u8] = b"kvmesh/region-representative";

/// The representatives among `nodes` (node ids of one region's live members): the `k` highest
/// rendezvous scores of a fixed key, best first. Order-independent; duplicates count once.
pub fn representatives<'a>(nodes: impl IntoIterator<Item = &'a str>, k: usize) -> Vec<&'a str> {
    let mut ids: Vec<&str> = nodes.into_iter().collect();
    ids.sort_unstable();
    ids.dedup();
    let mut scored: Vec<(u64, &str)> = ids
        .into_iter()
        .map(|id| {
            (
                affinity::score(REPRESENTATIVE_KEY, affinity::replica_seed(id)),
                id,
            )
        })
        .collect();
    scored.sort_unstable_by(|a, b| b.cmp(a));
    scored.into_iter().take(k).map(|(_, id)| id).collect()
}

/// What the layer says of the other regions.
#[derive(Clone, Debug, Default)]
pub struct LayerState {
    /// The newest record of each other region whose publisher belongs to it.
    pub records: BTreeMap<String, RegionRecord>,
    /// Live, verified members (other representatives), by QUIC address, with their region.
    pub members: Vec<(SocketAddr, String)>,
}

/// How the region layer gossips.
#[derive(Clone, Debug)]
pub struct LayerSettings {
    /// The layer's chitchat cluster id (the mesh's, suffixed `/regions`).
    pub cluster_id: String,
    /// This node's region.
    pub region: String,
    /// Gossip interval.
    pub interval: Duration,
    /// Failure detection.
    pub failure: FailureDetectorConfig,
}

/// The region layer of one node: idle until the node is a representative.
pub struct RegionLayer {
    transport: QuicTransport,
    chitchat_id: ChitchatId,
    /// Signs this node's values in the layer (the mesh's signer).
    signer: Arc<LocalSigner>,
    cluster_id: String,
    region: String,
    node_value: String,
    interval: Duration,
    failure: FailureDetectorConfig,
    handle: tokio::sync::Mutex<Option<ChitchatHandle>>,
    /// Times the layer was started. Each start is a new chitchat incarnation with the next
    /// generation, as chitchat asks of a restarted node (a generation "distinguishes a node's
    /// state between restarts" and must increase). Peers still hold the previous incarnation's
    /// state, dead, with its key versions.
    starts: AtomicU64,
    errors: Arc<AtomicU64>,
    /// When each address was last asked for a round by [`RegionLayer::reach`].
    reached: std::sync::Mutex<HashMap<SocketAddr, Instant>>,
}

/// An address not yet in the layer is asked for a round at most this often: it may be a node
/// that is no longer a representative (it drops the layer's messages).
const REACH_EVERY: Duration = Duration::from_secs(5);

impl std::fmt::Debug for RegionLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionLayer")
            .field("cluster_id", &self.cluster_id)
            .finish_non_exhaustive()
    }
}

impl RegionLayer {
    /// A layer for the node `chitchat_id`, signing with `signer`, whose `node` record encodes
    /// to `node_value`.
    pub fn new(
        transport: QuicTransport,
        (chitchat_id, signer): (ChitchatId, Arc<LocalSigner>),
        settings: LayerSettings,
        node_value: String,
        errors: Arc<AtomicU64>,
    ) -> Self {
        RegionLayer {
            transport,
            chitchat_id,
            signer,
            cluster_id: settings.cluster_id,
            region: settings.region,
            node_value,
            interval: settings.interval,
            failure: settings.failure,
            handle: tokio::sync::Mutex::new(None),
            starts: AtomicU64::new(0),
            errors,
            reached: std::sync::Mutex::new(HashMap::new()),
        }
    }

    /// Starts or stops the layer's chitchat (then [`RegionLayer::reach`] finds the other
    /// representatives). Returns whether it runs. A restart is a new incarnation (the next
    /// generation) that holds nothing: the caller publishes its record again.
    pub async fn set_active(&self, on: bool) -> bool {
        let mut guard = self.handle.lock().await;
        match (on, guard.is_some()) {
            (true, false) => {
                let mut chitchat_id = self.chitchat_id.clone();
                let start = self.starts.fetch_add(1, Ordering::Relaxed);
                chitchat_id.generation_id = chitchat_id.generation_id.saturating_add(start);
                let initial = self.signer.initial_values(&chitchat_id, &self.node_value);
                let config = ChitchatConfig {
                    chitchat_id,
                    cluster_id: self.cluster_id.clone(),
                    gossip_interval: self.interval,
                    listen_addr: self.chitchat_id.gossip_advertise_addr,
                    // No chitchat seeds: a seed that is no longer a representative drops the
                    // layer's messages, and chitchat would keep sending them every round.
                    // `reach` asks each address at most every REACH_EVERY instead.
                    seed_nodes: Vec::new(),
                    failure_detector_config: self.failure.clone(),
                    marked_for_deletion_grace_period: self.failure.dead_node_grace_period,
                    catchup_callback: None,
                    extra_liveness_predicate: None,
                };
                let layer = self.transport.regions_layer();
                match spawn_chitchat(config, initial, &layer).await {
                    Ok(h) => {
                        info!(region = %self.region, "representative: joined the region layer");
                        *guard = Some(h);
                    }
                    Err(e) => debug!(error = %e, "region layer not started"),
                }
            }
            (false, true) => {
                if let Some(h) = guard.take() {
                    info!(region = %self.region, "no longer a representative: left the region layer");
                    if let Err(e) = h.shutdown().await {
                        debug!(error = %e, "region layer ended with an error");
                    }
                }
            }
            _ => {}
        }
        guard.is_some()
    }

    /// Publishes this region's record (an encoded [`RegionRecord`]); no-op when inactive.
    pub async fn publish(&self, value: String) {
        if let Some(h) = self.handle.lock().await.as_ref() {
            let signer = &self.signer;
            h.with_chitchat(|c| {
                let id = c.self_chitchat_id().clone();
                signer.publish(c.self_node_state(), &id, KEY_REGION, &value);
            })
            .await;
        }
    }

    /// Asks for a round with each of `peers` the layer does not know yet (at most 8 a call,
    /// each at most every [`REACH_EVERY`]): how a representative reaches the others it heard of
    /// from seeds and records.
    pub async fn reach(&self, peers: &[SocketAddr]) {
        let guard = self.handle.lock().await;
        let Some(h) = guard.as_ref() else {
            return;
        };
        let known: HashSet<SocketAddr> = h
            .with_chitchat(|c| {
                c.node_states()
                    .keys()
                    .map(|id| id.gossip_advertise_addr)
                    .collect()
            })
            .await;
        let me = self.chitchat_id.gossip_advertise_addr;
        let now = Instant::now();
        let mut reached = self.reached.lock().unwrap_or_else(|e| e.into_inner());
        reached.retain(|_, at| now.duration_since(*at) < REACH_EVERY);
        let due: Vec<SocketAddr> = peers
            .iter()
            .filter(|a| **a != me && !known.contains(a) && !reached.contains_key(a))
            .take(8)
            .copied()
            .collect();
        for addr in &due {
            reached.insert(*addr, now);
            if let Err(e) = h.gossip(*addr) {
                debug!(error = %e, "region-layer round not requested");
            }
        }
    }

    /// Every node the layer's chitchat knows (empty when inactive).
    pub async fn ids(&self) -> HashSet<ChitchatId> {
        match self.handle.lock().await.as_ref() {
            Some(h) => {
                h.with_chitchat(|c| c.node_states().keys().cloned().collect())
                    .await
            }
            None => HashSet::new(),
        }
    }

    /// The other regions' records and the layer's members (empty when inactive).
    pub async fn state(&self) -> LayerState {
        let guard = self.handle.lock().await;
        let Some(h) = guard.as_ref() else {
            return LayerState::default();
        };
        let transport = &self.transport;
        let errors = &self.errors;
        let own = self.region.as_str();
        h.with_chitchat(|c| {
            let self_id = c.self_chitchat_id().clone();
            let mut out = LayerState::default();
            let live: Vec<ChitchatId> = c
                .live_nodes()
                .filter(|id| **id != self_id && transport.is_verified(id))
                .cloned()
                .collect();
            for id in live {
                let Some(state) = c.node_state(&id) else {
                    continue;
                };
                // The gate checked each value's signature; the records are the payloads.
                let node = state.get(KEY_NODE).and_then(payload).map(NodeRecord::decode);
                let node = match node {
                    Some(Ok(n)) => n,
                    Some(Err(e)) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        debug!(node = %id.node_id, "skipping malformed node record: {e}");
                        continue;
                    }
                    None => continue,
                };
                out.members
                    .push((id.gossip_advertise_addr, node.region.clone()));
                let Some(value) = state.get(KEY_REGION).and_then(payload) else {
                    continue;
                };
                match RegionRecord::decode(value) {
                    // Our own region's other representative: we publish that one ourselves.
                    Ok(r) if r.region == own && node.region == own => {}
                    // A representative speaks for its own region only, and never for ours.
                    Ok(r) if r.region == node.region && r.region != own => {
                        let newer = out
                            .records
                            .get(&r.region)
                            .is_none_or(|old| old.at_ms < r.at_ms);
                        if newer {
                            out.records.insert(r.region.clone(), r);
                        }
                    }
                    Ok(r) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        debug!(node = %id.node_id, region = %r.region, "region record for another region than its publisher's: ignored");
                    }
                    Err(e) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        debug!(node = %id.node_id, "skipping malformed region record: {e}");
                    }
                }
            }
            out
        })
        .await
    }

    /// Stops the layer's chitchat, if it runs.
    pub async fn shutdown(&self) {
        self.set_active(false).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_node_picks_the_same_representatives_whatever_the_order() {
        let a = ["n1", "n2", "n3", "n4", "n5"];
        let b = ["n5", "n3", "n1", "n4", "n2", "n3"];
        let ra = representatives(a, 2);
        assert_eq!(ra.len(), 2);
        assert_eq!(ra, representatives(b, 2));
        assert_eq!(representatives(["n1"], 2), vec!["n1"]);
        assert!(representatives([], 2).is_empty());
    }

    #[test]
    fn a_representatives_death_moves_only_its_own_role() {
        let nodes: Vec<String> = (0..25).map(|i| format!("node-{i}")).collect();
        let reps = representatives(nodes.iter().map(String::as_str), 2);
        let dead = reps[0];
        let after = representatives(nodes.iter().map(String::as_str).filter(|n| *n != dead), 2);
        // The survivor keeps its role (it moves up), one new node takes the free one.
        assert_eq!(after[0], reps[1]);
        assert!(!after.contains(&dead));
    }
}
