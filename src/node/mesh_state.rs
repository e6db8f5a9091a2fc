//! The node's mesh state, as data: each replica's role (home or follower) and sync state, the
//! mesh slot (the running mesh, members, forwarding peers), what one membership round plans, and
//! the `mesh` section of `/admin/state`. What the node does with it is in `mesh_roles.rs` (under
//! the lock) and `mesh_loop.rs` (the async side).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use super::metrics::MeshMetrics;
use crate::core::view::Health;
use crate::mesh::replica_load::RecordChange;
use crate::mesh::schema::ReplicaRecord;
use crate::mesh::Mesh;

/// The worse of two healths (`None` adds nothing).
pub(super) fn worst(local: Health, remote: Option<Health>) -> Health {
    let rank = |h: Health| match h {
        Health::Healthy => 0,
        Health::Draining => 1,
        Health::Unhealthy => 2,
    };
    match remote {
        Some(r) if rank(r) > rank(local) => r,
        _ => local,
    }
}

/// One replica's mesh state.
#[derive(Debug)]
pub struct ReplicaMesh {
    /// This node is the replica's home (always, without a mesh).
    pub home: bool,
    /// The home's node id, when another node is home.
    pub home_id: Option<String>,
    /// The home's QUIC address (where block reports go), when another node is home.
    pub home_addr: Option<SocketAddr>,
    /// Health the home publishes, when another node is home.
    pub remote_health: Option<Health>,
    /// Prompt tokens the home publishes as queued there (0 when this node is home).
    pub remote_queued: u64,
    /// The KV-quota tenants' shares of the replica's cache the home publishes, by this node's
    /// KV slot (`KV_SLOTS` entries), when another node is home and publishes them; `None`
    /// otherwise (this node's own model estimates them).
    pub remote_kv_shares: Option<Vec<f32>>,
    /// Blocks this node's requests brought per KV slot since the home's published shares last
    /// changed (`KV_SLOTS` entries while `remote_kv_shares` is set): added to them, so that a
    /// node sees its own steering at once rather than a gossip round later (`kv_shares.rs`).
    pub kv_routed_since: Vec<u32>,
    /// Learned from gossip only (not in this node's config or DNS).
    pub learned: bool,
    /// Learned: the peer whose record introduced it (its per-peer cap counts it).
    pub learned_from: Option<String>,
    /// Learned: the node that has it from its own configuration; it is kept only while that
    /// node is a live member. `None` for this node's own replicas.
    pub origin: Option<String>,
    /// Version of the view's summary copy pulled from the home (followers).
    pub pulled: Option<(u64, u64)>,
    /// A pull is in flight.
    pub pulling: bool,
    /// When the view's summary last changed by a pull or a publish (core time).
    pub updated_at: Option<Duration>,
    /// The record last published (home), to publish only on change.
    pub published: Option<ReplicaRecord>,
    /// When its changing part (the `rload:` companion) was last published (core time).
    pub load_published_at: Option<Duration>,
}

impl Default for ReplicaMesh {
    fn default() -> Self {
        ReplicaMesh {
            home: true,
            home_id: None,
            home_addr: None,
            remote_health: None,
            remote_queued: 0,
            remote_kv_shares: None,
            kv_routed_since: Vec::new(),
            learned: false,
            learned_from: None,
            origin: None,
            pulled: None,
            pulling: false,
            updated_at: None,
            published: None,
            load_published_at: None,
        }
    }
}

impl ReplicaMesh {
    /// Where this node reports blocks it routes to the replica: the home's address when another
    /// node is home, else nowhere.
    pub fn report_target(&self) -> Option<SocketAddr> {
        if self.home {
            None
        } else {
            self.home_addr
        }
    }
}

/// A live node that may take forwarded requests.
#[derive(Clone, Debug, PartialEq)]
pub struct Peer {
    /// Node id.
    pub node_id: String,
    /// Region.
    pub region: String,
    /// Base URL of its HTTP front.
    pub http_url: String,
    /// QUIC address (RTT lookups).
    pub quic_addr: SocketAddr,
}

/// What the sync loop last learned, for readiness, forwarding and `/admin/state`.
#[derive(Default)]
pub(super) struct Status {
    /// First gossip round done and the region's summaries pulled (or the warm-up timed out).
    pub(super) warm: bool,
    /// Every member, as `/admin/state` shows it.
    pub(super) members: Vec<MemberJson>,
    /// Live peers that take forwarded requests.
    pub(super) peers: Vec<Peer>,
    /// Every live peer's (region, QUIC address): who may send block reports.
    pub(super) members_in: Vec<(String, SocketAddr)>,
    /// Forwarding targets of other regions from their region records (regional gossip: their
    /// nodes are not members here).
    pub(super) region_targets: Vec<Peer>,
    /// This node is one of its region's representatives.
    pub(super) representative: bool,
}

/// The node's mesh slot: the running mesh (if any) and what the sync loop last learned.
#[derive(Default)]
pub struct NodeMesh {
    /// The running mesh, once attached.
    pub(super) mesh: RwLock<Option<Arc<Mesh>>>,
    /// What the sync loop last learned.
    pub(super) status: Mutex<Status>,
    /// Woken when a summary this node is home for changed, so it is published without waiting
    /// for the next gossip interval.
    pub changed: Notify,
    /// Woken when this node's in-flight load at a replica changed, for the load-sharing task.
    pub load_changed: Notify,
    /// Woken (all waiters) when a peer's load update said a prefill it sent has answered (a
    /// first-byte tip), for requests riding on it (`Node::wait_for_peer_prefill`).
    pub peer_answered: Notify,
    /// Mesh metrics, once the mesh started.
    pub metrics: std::sync::OnceLock<MeshMetrics>,
}

/// A summary pull the sync loop should make.
#[derive(Clone, Debug, PartialEq)]
pub struct Pull {
    /// View index.
    pub index: usize,
    /// Replica id.
    pub id: String,
    /// Publisher's QUIC address.
    pub from: SocketAddr,
    /// Version held (0, 0 without a copy).
    pub epoch: u64,
    /// Sequence held.
    pub seq: u64,
}

/// What one membership round asks the async side to do.
#[derive(Debug, Default)]
pub struct MeshPlan {
    /// Records to publish (home, changed), and what of each.
    pub publish: Vec<(String, ReplicaRecord, RecordChange)>,
    /// Records to withdraw (no longer home).
    pub unpublish: Vec<String>,
    /// Summary pulls to start.
    pub pulls: Vec<Pull>,
    /// Replicas of the node's region whose home advertises a newer summary than the view holds.
    pub behind: usize,
    /// Handovers: (replica id, new home's address, this node's live keys for it), sent as block
    /// reports so the new home's model starts with what the old home knew.
    pub handover: Vec<(String, SocketAddr, Vec<u64>)>,
    /// Learned replicas that expired this round (now draining), by index.
    pub expired: Vec<usize>,
}

/// Kind of an applied pull (for metrics).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PullKind {
    /// Keys since the held seq.
    Delta,
    /// The whole filter.
    Snapshot,
    /// Dropped: this node became home meanwhile.
    Ignored,
}

impl PullKind {
    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            PullKind::Delta => "delta",
            PullKind::Snapshot => "snapshot",
            PullKind::Ignored => "ignored",
        }
    }
}

/// `mesh` in `/admin/state`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MeshStateJson {
    /// This node's id.
    pub node_id: String,
    /// This node's generation (start time, ms).
    pub generation: u64,
    /// This node's QUIC address.
    pub quic_addr: String,
    /// Warm: first gossip round done and the region's summaries pulled (or warm-up timed out).
    pub warm: bool,
    /// Every member known, live or dead.
    pub members: Vec<MemberJson>,
    /// Homes and summary versions per replica.
    pub replicas: Vec<ReplicaMeshJson>,
    /// `"regional"` or `"flat"`.
    #[serde(default)]
    pub layout: String,
    /// This node is one of its region's representatives (regional layout).
    #[serde(default)]
    pub representative: bool,
    /// Other regions as their records describe them (regional layout).
    #[serde(default)]
    pub regions: Vec<RegionJson>,
}

/// Another region in `/admin/state`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RegionJson {
    /// Region.
    pub region: String,
    /// Models it offers, with healthy / open replica counts and the least queue (ms).
    pub models: Vec<(String, u32, u32, u32)>,
    /// Prefix heads it holds.
    pub heads: usize,
    /// Nodes named to forward to.
    pub targets: Vec<String>,
}

/// One member in `/admin/state`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MemberJson {
    /// Node id.
    pub node_id: String,
    /// Region ("" until its node record arrives).
    pub region: String,
    /// Counted live by the failure detector.
    pub live: bool,
    /// Generation (start time, ms).
    pub generation: u64,
    /// This node.
    pub is_self: bool,
    /// Its HTTP front.
    pub http_url: String,
    /// Replica records it publishes (as home).
    pub replicas_published: usize,
}

/// One replica's mesh view in `/admin/state`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReplicaMeshJson {
    /// Replica id.
    pub id: String,
    /// Region.
    pub region: String,
    /// Home node id ("" when unknown).
    pub home: String,
    /// Known only from gossip.
    pub learned: bool,
    /// Epoch of the view's summary.
    pub summary_epoch: u64,
    /// Seq of the view's summary.
    pub summary_seq: u64,
    /// Seconds since the summary last changed by a pull or a publish.
    pub summary_age_s: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worst_health_wins() {
        assert_eq!(worst(Health::Healthy, None), Health::Healthy);
        assert_eq!(
            worst(Health::Healthy, Some(Health::Unhealthy)),
            Health::Unhealthy
        );
        assert_eq!(
            worst(Health::Unhealthy, Some(Health::Healthy)),
            Health::Unhealthy
        );
        assert_eq!(
            worst(Health::Healthy, Some(Health::Draining)),
            Health::Draining
        );
    }
}
