//! `Member`: one node of this node's cluster as gossip shows it, its records decoded.
//!
//! Apart from `cluster.rs` so the regional layout's files (`regional.rs`) read members without
//! importing the `Mesh` that drives them.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use super::admin::AdminRecord;
use super::hot_record::HotRecord;
use super::region_record::RegionRecord;
use super::schema::{HomesRecord, InflightRecord, NodeRecord, ReplicaRecord, RttRecord};

/// One member of the cluster as this node sees it.
///
/// Its records sit behind `Arc`s: members are decoded once per state change and handed out
/// every sync round, so a clone must not copy every replica record.
#[derive(Clone, Debug, PartialEq)]
pub struct Member {
    /// Node id.
    pub node_id: String,
    /// Generation (start time in ms).
    pub generation: u64,
    /// Gossip (and QUIC) address.
    pub gossip_addr: SocketAddr,
    /// Whether the failure detector counts it live and it proved its node id on a direct
    /// connection (its certificate names it; see `transport`). This node always is.
    pub live: bool,
    /// Whether this is the local node.
    pub is_self: bool,
    /// Its `node` record; `None` until gossiped, or when malformed.
    pub node: Option<NodeRecord>,
    /// The replica records it publishes (as home), by replica id.
    pub replicas: Arc<BTreeMap<String, ReplicaRecord>>,
    /// Its in-flight counts.
    pub inflight: Arc<InflightRecord>,
    /// Its measured RTTs by region.
    pub rtt: Arc<RttRecord>,
    /// Its homes marker, once it published one.
    pub homes: Option<HomesRecord>,
    /// Its heaviest prefixes (empty when it publishes none, or a malformed record).
    pub hot: Arc<HotRecord>,
    /// The operator commands it took, by replica id (at most `MAX_ADMIN_RECORDS` read).
    pub admin: Arc<BTreeMap<String, AdminRecord>>,
    /// Other regions' records it relays as a representative, by region (regional layout; at
    /// most `MAX_REMOTE_REGIONS` read).
    pub regions: Arc<BTreeMap<String, RegionRecord>>,
}

impl Member {
    /// A live member `id` of region "eu" at 127.0.0.1:`port` with a `node` record and no other
    /// records: the fixture the node's unit tests build their rounds from.
    #[cfg(test)]
    pub(crate) fn for_test(id: &str, port: u16, is_self: bool) -> Member {
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        Member {
            node_id: id.into(),
            generation: 1,
            gossip_addr: addr,
            live: true,
            is_self,
            node: Some(NodeRecord {
                schema: super::schema::SCHEMA_VERSION,
                region: "eu".into(),
                zone: String::new(),
                http_url: format!("http://{id}:8080"),
                quic_addr: addr,
                version: "t".into(),
                generation: 1,
            }),
            replicas: Default::default(),
            inflight: Default::default(),
            hot: Default::default(),
            rtt: Default::default(),
            homes: None,
            admin: Default::default(),
            regions: Default::default(),
        }
    }

    /// The member's region, when its node record is known.
    pub fn region(&self) -> Option<&str> {
        self.node.as_ref().map(|n| n.region.as_str())
    }
}
