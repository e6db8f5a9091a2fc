//! Read-only answers for the HTTP front: `/ready`, `/v1/models` and `/admin/state`.

use serde::Serialize;

use super::mesh_state::MeshStateJson;
use super::state::{Endpoint, Node};
use crate::core::cache_model::CacheSource;
use crate::core::view::Health;

impl Node {
    /// Whether some replica is healthy and has known models, or another region offers room
    /// (the node can serve, if only by forwarding), and, in a mesh, the node is warm (decided at the end of each round in `mesh_loop.rs`).
    pub fn ready(&self) -> bool {
        if !self.mesh_ready() {
            return false;
        }
        let core = self.lock();
        let local = core
            .view
            .replicas()
            .iter()
            .any(|r| r.health == Health::Healthy && !r.info.models.is_empty());
        // Regional gossip: a node can also serve by forwarding to a region that offers room.
        local
            || core
                .view
                .remote_regions
                .values()
                .any(|o| o.models.iter().any(|m| m.open > 0))
    }

    /// The view index and address of every replica not unhealthy that serves `model` (any
    /// model when `None`): where a stored response may be (`proxy/stored_responses.rs`).
    pub fn serving(&self, model: Option<&str>) -> Vec<(usize, Endpoint)> {
        let indexes: Vec<usize> = {
            let core = self.lock();
            core.view
                .replicas()
                .iter()
                .enumerate()
                .filter(|(_, r)| r.health != Health::Unhealthy)
                .filter(|(_, r)| model.is_none_or(|m| r.info.models.iter().any(|x| x == m)))
                .map(|(i, _)| i)
                .collect()
        };
        indexes
            .into_iter()
            .filter_map(|i| Some((i, self.endpoint(i)?)))
            .collect()
    }

    /// The union of the models of every replica still in the registry and of every other
    /// region's offer, sorted.
    pub fn models(&self) -> Vec<String> {
        let core = self.lock();
        let mut models: Vec<String> = core
            .view
            .replicas()
            .iter()
            .filter(|r| r.health != Health::Draining)
            .flat_map(|r| r.info.models.iter().cloned())
            .chain(
                core.view
                    .remote_regions
                    .values()
                    .flat_map(|o| o.models.iter().map(|m| m.model.clone())),
            )
            .collect();
        drop(core);
        models.sort();
        models.dedup();
        models
    }

    /// A snapshot for `/admin/state`.
    pub fn state(&self) -> NodeState {
        let core = self.lock();
        let replicas = core
            .view
            .replicas()
            .iter()
            .zip(&core.replicas)
            .enumerate()
            .map(|(i, (r, rt))| ReplicaStateJson {
                id: r.info.id.clone(),
                url: r.info.url.clone(),
                region: r.info.region.clone(),
                pool: r.info.pool.clone(),
                role: r.info.pd.role.as_str().to_owned(),
                models: r.info.models.clone(),
                health: match r.health {
                    Health::Healthy => "healthy",
                    Health::Unhealthy => "unhealthy",
                    Health::Draining => "draining",
                }
                .to_owned(),
                ejected: rt.health.ejected(),
                consecutive_failures: rt.health.request_failures(),
                capacity_tokens: r.info.capacity_tokens,
                waiting: r.load.waiting,
                running: r.load.running,
                kv_usage: r.load.kv_usage,
                in_flight: r.load.in_flight,
                peer_in_flight: r.load.peer_in_flight,
                queued_prefill_tokens: r.load.queued_prefill_tokens,
                cache_keys: rt.cache.len(),
                cache_source: match rt.cache.source() {
                    CacheSource::Exact => "exact",
                    CacheSource::Approximate => "approximate",
                }
                .to_owned(),
                summary_epoch: r.summary.as_ref().map_or(0, |s| s.epoch()),
                summary_seq: r.summary.as_ref().map_or(0, |s| s.seq()),
                summary_keys: r.summary.as_ref().map_or(0, |s| s.inserted()),
                summary_bytes: r.summary.as_ref().map_or(0, |s| s.filter_bytes()),
                overlay_keys: core.view.overlay_len(i),
            })
            .collect();
        drop(core);
        NodeState {
            region: self.cfg.region.clone(),
            policy: self.policy().as_str().to_owned(),
            uptime_s: self.now().as_secs_f64(),
            replicas,
            mesh: self.mesh_state(),
        }
    }
}

/// `/admin/state`.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct NodeState {
    /// The node's region.
    pub region: String,
    /// Routing policy.
    pub policy: String,
    /// Seconds since start.
    pub uptime_s: f64,
    /// Every replica.
    pub replicas: Vec<ReplicaStateJson>,
    /// Members, homes and summary versions, when the node runs a mesh.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mesh: Option<MeshStateJson>,
}

/// One replica in `/admin/state`.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct ReplicaStateJson {
    /// Id.
    pub id: String,
    /// Base URL.
    pub url: String,
    /// Region.
    pub region: String,
    /// Pool.
    pub pool: String,
    /// Disaggregation role: `prefill`, `decode` or `both`.
    pub role: String,
    /// Models served.
    pub models: Vec<String>,
    /// `healthy`, `unhealthy` or `draining`.
    pub health: String,
    /// Ejected by outlier detection.
    pub ejected: bool,
    /// Consecutive failed requests.
    pub consecutive_failures: u32,
    /// KV capacity (tokens).
    pub capacity_tokens: u64,
    /// Engine's waiting requests (scraped).
    pub waiting: u32,
    /// Engine's running requests (scraped).
    pub running: u32,
    /// Engine's KV usage 0..1 (scraped).
    pub kv_usage: f32,
    /// This node's requests open there.
    pub in_flight: u32,
    /// The region's other nodes' requests open there, as their load updates said.
    #[serde(default)]
    pub peer_in_flight: u32,
    /// This node's estimate of prompt tokens waiting for prefill there.
    pub queued_prefill_tokens: u64,
    /// Keys live in the cache model.
    pub cache_keys: usize,
    /// `exact` (follows the engine's KV events) or `approximate` (from routed requests).
    #[serde(default)]
    pub cache_source: String,
    /// Summary epoch in the view.
    pub summary_epoch: u64,
    /// Summary sequence in the view.
    pub summary_seq: u64,
    /// Keys inserted in the summary this epoch.
    pub summary_keys: usize,
    /// Summary filter size in bytes.
    pub summary_bytes: usize,
    /// Keys in this node's overlay for it.
    pub overlay_keys: usize,
}
