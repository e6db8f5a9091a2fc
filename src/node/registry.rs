//! The registry: which replicas the node routes to. Static ones come from the config, others
//! from DNS sources (`node/watchers.rs`) or from peers' gossip (`node/mesh_roles.rs`).
//!
//! Indexes are append-only, like the view's: a replica that leaves is marked removed and drains
//! (it takes no new requests, its in-flight ones finish), and one that comes back gets its old
//! index and keeps what was learned about it.

use std::sync::Arc;

use super::config::NodeConfig;
use super::mesh_state::ReplicaMesh;
use super::state::{Endpoint, Node, ReplicaRuntime};
use crate::core::cache_model::CacheSource;
use crate::core::view::{Health, ReplicaInfo};
use crate::replicas::dns::ReplicaRegistry;
use crate::replicas::entry::{ReplicaConfig, DEFAULT_CAPACITY_TOKENS};
use crate::replicas::health::HealthTracker;

impl Node {
    /// Builds the node's state from a validated config, with the static replicas registered.
    pub fn new(cfg: NodeConfig) -> anyhow::Result<Arc<Node>> {
        let node = Node::empty(cfg)?;
        for r in &node.cfg.replicas {
            node.add_replica(r)?;
        }
        Ok(node)
    }

    /// Registers a replica, or updates one with the same id (a removed one comes back).
    /// Returns its index and whether it is new to this node.
    pub fn add_replica(&self, r: &ReplicaConfig) -> anyhow::Result<(usize, bool)> {
        let id = r.effective_id();
        let capacity = r.capacity_tokens.unwrap_or(DEFAULT_CAPACITY_TOKENS);
        // The endpoint list is appended under its own lock while the core lock is held, so the
        // two always have the same length.
        let mut core = self.lock();
        let core = &mut *core;
        let info = ReplicaInfo {
            id: id.clone(),
            url: r.url.clone(),
            region: r.region.clone().unwrap_or_else(|| self.cfg.region.clone()),
            zone: r.zone.clone(),
            pool: r.pool.clone(),
            models: r.models.clone(),
            capacity_tokens: capacity,
            prefill_tokens_per_s: r.prefill_tokens_per_s,
            max_in_flight: r.max_in_flight,
        };
        if let Some(i) = core.view.index_of(&id) {
            // Keep what was learned (discovered models, scraped capacity) unless configured.
            let rt = &mut core.replicas[i];
            let mut info = info;
            if let Some(old) = core.view.replica(i) {
                if !rt.models_configured {
                    info.models = old.info.models.clone();
                }
                if !rt.capacity_configured {
                    info.capacity_tokens = old.info.capacity_tokens;
                }
            }
            core.view.upsert(info);
            let back = std::mem::take(&mut rt.removed);
            core.view.set_health(i, rt.effective_health());
            if back {
                tracing::info!(replica = %id, "replica back in the registry");
            }
            return Ok((i, false));
        }
        let i = core.view.upsert(info);
        let cache = self.cache_model(
            CacheSource::Approximate,
            self.epoch_base,
            capacity,
            core.view.tokens_per_block,
        )?;
        core.replicas.push(ReplicaRuntime {
            cache,
            summary_dirty: false,
            health: HealthTracker::new(),
            pending_prefill_tokens: 0,
            peer_in_flight: 0,
            peer_pending_tokens: 0,
            models_configured: !r.models.is_empty(),
            capacity_configured: r.capacity_tokens.is_some(),
            engine: None,
            removed: false,
            mesh: ReplicaMesh::default(),
        });
        let mut endpoints = self.endpoints.write().unwrap_or_else(|p| p.into_inner());
        endpoints.push(Endpoint {
            id: Arc::from(id.as_str()),
            base: Arc::from(r.url.trim_end_matches('/')),
        });
        debug_assert_eq!(endpoints.len(), core.replicas.len());
        drop(endpoints);
        self.metrics
            .replica_healthy
            .with_label_values(&[&id])
            .set(1);
        self.metrics.in_flight.with_label_values(&[&id]).set(0);
        tracing::info!(replica = %id, url = %r.url, "replica registered");
        Ok((i, true))
    }

    /// Takes a replica out of the registry: it gets no new requests (requests in flight finish).
    /// Its index stays valid; [`Node::add_replica`] with the same id brings it back.
    pub fn remove_replica(&self, i: usize) {
        let mut core = self.lock();
        if let Some(rt) = core.replicas.get_mut(i) {
            if !rt.removed {
                rt.removed = true;
                core.view.set_health(i, Health::Draining);
                drop(core);
                if let Some(ep) = self.endpoint(i) {
                    tracing::info!(replica = %ep.id, "replica left the registry");
                    self.metrics
                        .replica_healthy
                        .with_label_values(&[&ep.id])
                        .set(0);
                }
            }
        }
    }

    /// Whether replica `i` is out of the registry.
    pub(super) fn is_removed(&self, i: usize) -> bool {
        self.lock().replicas.get(i).is_none_or(|rt| rt.removed)
    }
}

// What a DNS source needs of the node (`replicas::dns`).
impl ReplicaRegistry for Node {
    fn add_replica(&self, spec: &ReplicaConfig) -> anyhow::Result<(usize, bool)> {
        Node::add_replica(self, spec)
    }

    fn remove_replica(&self, i: usize) {
        Node::remove_replica(self, i)
    }
}
