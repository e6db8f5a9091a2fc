//! The registry: which replicas the node routes to. Static ones come from the config, others
//! from DNS and Kubernetes sources (`node/watchers.rs`) or from peers' gossip
//! (`node/mesh_roles.rs`).
//!
//! A replica that leaves is marked removed and drains (it takes no new requests, its in-flight
//! ones finish), and one that comes back gets its old index. Once drained — nothing in flight
//! and `drop_departed_after_s` (default [`DROP_AFTER`]) since it left — it is *dropped*: its
//! index stays as a tombstone (id and URL), while its cache model, view summary, engine figures
//! and metric series are freed and its watcher tasks end; coming back revives it with a fresh
//! model. A replica new to the node takes a tombstone's slot before the registry grows, so
//! Kubernetes rollouts and invented ids cost nothing that lasts: the slots number at most the
//! replicas present plus those departed within the drop time.
//!
//! **Reusing a slot is safe** because nothing holds a dropped replica's index: it was dropped
//! with nothing in flight (no `Ticket`, warm-up or P/D leg holds it), it is never routed to
//! (draining), its watcher tasks end with its incarnation (bumped again on reuse), its pending
//! load-sharing tips are discarded, and its view slot (summary, overlay, shares) starts over.
//! Peers' tips name replicas by id and last seconds. An operator's drain outlives the slot: the
//! id is remembered (`Core::reclaimed_drains`) and drained again if it comes back.

use std::sync::Arc;
use std::time::Duration;

use super::config::NodeConfig;
use super::mesh_state::ReplicaMesh;
use super::state::{Core, Endpoint, Node, ReplicaRuntime};
use crate::core::cache_model::CacheSource;
use crate::core::rank_hints::RankHints;
use crate::core::view::{Health, ReplicaInfo};
use crate::replicas::dns::ReplicaRegistry;
use crate::replicas::entry::{ReplicaConfig, DEFAULT_CAPACITY_TOKENS};
use crate::replicas::health::HealthTracker;

/// The default least time a departed replica drains before it is dropped
/// (`drop_departed_after_s`), as tests use it.
#[cfg(test)]
pub const DROP_AFTER: Duration = Duration::from_secs(super::config::DEFAULT_DROP_DEPARTED_AFTER_S);

impl Node {
    /// Builds the node's state from a validated config, with the static replicas registered.
    pub fn new(cfg: NodeConfig) -> anyhow::Result<Arc<Node>> {
        let node = Node::empty(cfg)?;
        for r in &node.cfg.replicas {
            node.add_replica(r)?;
        }
        Ok(node)
    }

    /// [`Node::add_replica`] for a replica this node's own sources name (its config, a reload,
    /// DNS, Kubernetes, an operator's `add`): one it had learned from a peer is its own now,
    /// and no longer expires with that peer or its record (`learned.rs`).
    pub fn add_configured_replica(&self, r: &ReplicaConfig) -> anyhow::Result<(usize, bool)> {
        let (i, new) = self.add_replica(r)?;
        if let Some(rt) = self.lock().replicas.get_mut(i) {
            rt.mesh.learned = false;
            rt.mesh.learned_from = None;
            rt.mesh.origin = None;
        }
        Ok((i, new))
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
            prefill_attention_ms_per_pair: r.prefill_attention_ms_per_pair,
            max_in_flight: r.max_in_flight,
            pd: r.pd(),
            kv_load: r.kv_load,
        };
        if let Some(i) = core.view.index_of(&id) {
            let rt = &mut core.replicas[i];
            // Keep what is known (discovered models, scraped capacity, a peer's record) unless
            // this entry configures it; the entry decides what later checks may rediscover.
            let mut info = info;
            if let Some(old) = core.view.replica(i) {
                if r.models.is_empty() {
                    info.models = old.info.models.clone();
                }
                if r.capacity_tokens.is_none() {
                    info.capacity_tokens = old.info.capacity_tokens;
                }
            }
            rt.models_configured = !r.models.is_empty();
            rt.capacity_configured = r.capacity_tokens.is_some();
            // A new URL for the same id (a reload, an operator's `add`): new requests go there,
            // and its health starts over; requests in flight finish where they are.
            let moved = core
                .view
                .replica(i)
                .is_some_and(|old| old.info.url != info.url);
            if moved {
                let mut endpoints = self.endpoints.write().unwrap_or_else(|p| p.into_inner());
                if let Some(ep) = endpoints.get_mut(i) {
                    ep.base = Arc::from(r.url.trim_end_matches('/'));
                }
                rt.health = HealthTracker::new();
                tracing::info!(replica = %id, url = %r.url, "replica moved to a new URL");
            }
            core.view.upsert(info);
            if r.kv_events.is_some() {
                rt.kv_source = r.kv_events.clone();
            }
            let back = std::mem::take(&mut rt.removed);
            rt.removed_at = None;
            let revived = std::mem::take(&mut rt.dropped);
            if revived {
                rt.incarnation += 1;
                rt.cache = self.cache_model(
                    CacheSource::Approximate,
                    self.epoch_base.max(rt.cache.summary().epoch() + 1),
                    capacity,
                    core.view.tokens_per_block,
                )?;
                rt.summary_dirty = true;
                rt.mesh = ReplicaMesh::default();
            }
            core.view.set_health(i, rt.effective_health());
            if back {
                tracing::info!(replica = %id, "replica back in the registry");
            }
            self.registry_changed.send_modify(|v| *v += 1);
            return Ok((i, revived));
        }
        let cache = self.cache_model(
            CacheSource::Approximate,
            self.epoch_base,
            capacity,
            core.view.tokens_per_block,
        )?;
        let mut rt = ReplicaRuntime {
            cache,
            summary_dirty: false,
            health: HealthTracker::new(),
            pending_prefill_tokens: 0,
            peer_in_flight: 0,
            peer_pending_tokens: 0,
            progress: 0,
            first_byte_log_lag: 0.0,
            models_configured: !r.models.is_empty(),
            capacity_configured: r.capacity_tokens.is_some(),
            engine: None,
            engine_at: None,
            kv_subscribed: false,
            removed: false,
            removed_at: None,
            dropped: false,
            incarnation: 0,
            mesh: ReplicaMesh::default(),
            kv_source: r.kv_events.clone(),
            admin_drained: false,
            admin_drained_by: None,
            rank_loads: Vec::new(),
            rank_rotate: 0,
            rank_hints: RankHints::default(),
        };
        let endpoint = Endpoint {
            id: Arc::from(id.as_str()),
            base: Arc::from(r.url.trim_end_matches('/')),
        };
        rt.admin_drained = core.reclaimed_drains.pop(&endpoint.id).is_some();
        let mut endpoints = self.endpoints.write().unwrap_or_else(|p| p.into_inner());
        let slot = reclaimable_slot(core);
        let i = match slot {
            Some(i) if core.view.replace(i, info.clone()) => {
                let old = std::mem::replace(&mut core.replicas[i], rt);
                core.replicas[i].incarnation = old.incarnation + 1;
                core.pending_tips.retain(|t| t.replica != i);
                // Only a drain taken here outlives its slot (a peer's lasts while it is live).
                if old.admin_drained && old.admin_drained_by.is_none() {
                    core.reclaimed_drains.put(Arc::clone(&endpoints[i].id), ());
                }
                tracing::info!(replica = %id, slot = i, was = %endpoints[i].id, "replica takes a dropped replica's slot");
                endpoints[i] = endpoint;
                i
            }
            _ => {
                let i = core.view.upsert(info);
                core.replicas.push(rt);
                endpoints.push(endpoint);
                i
            }
        };
        debug_assert_eq!(endpoints.len(), core.replicas.len());
        drop(endpoints);
        let health = core.replicas[i].effective_health();
        core.view.set_health(i, health);
        self.metrics
            .replica_healthy
            .with_label_values(&[&id])
            .set(1);
        self.metrics.in_flight.with_label_values(&[&id]).set(0);
        // Present at 0 from the start, so dashboards and alerts see the series before the first.
        self.metrics.ejections.with_label_values(&[&id]).reset();
        self.metrics
            .scrape_refused
            .with_label_values(&[&id])
            .reset();
        tracing::info!(replica = %id, url = %r.url, "replica registered");
        self.registry_changed.send_modify(|v| *v += 1);
        Ok((i, true))
    }

    /// Takes a replica out of the registry: it gets no new requests (requests in flight finish).
    /// Its index stays valid; [`Node::add_replica`] with the same id brings it back.
    pub fn remove_replica(&self, i: usize) {
        let now = self.now();
        let mut core = self.lock();
        if let Some(rt) = core.replicas.get_mut(i) {
            if !rt.removed {
                rt.removed = true;
                rt.removed_at = Some(now);
                core.view.set_health(i, Health::Draining);
                drop(core);
                self.registry_changed.send_modify(|v| *v += 1);
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

    /// Whether this node should follow replica `i`'s KV events: it is in the registry and this
    /// node is its home (always, without a mesh). Followers use the home's summary, so one
    /// subscription per replica serves the whole region.
    pub(super) fn kv_events_wanted(&self, i: usize) -> bool {
        self.lock()
            .replicas
            .get(i)
            .is_some_and(|rt| !rt.removed && rt.mesh.home)
    }

    /// Replica `i`'s incarnation while it is not dropped (its watcher tasks run while this
    /// stays what they started with).
    pub(super) fn live_incarnation(&self, i: usize) -> Option<u64> {
        self.lock()
            .replicas
            .get(i)
            .filter(|rt| !rt.dropped)
            .map(|rt| rt.incarnation)
    }

    /// Drops replicas that left the registry at least [`DROP_AFTER`] ago and have nothing in
    /// flight: frees their cache model, view summary and engine figures and forgets their
    /// metric series; the index stays, a tombstone. Returns how many it dropped.
    pub(super) fn sweep_departed(&self) -> usize {
        self.sweep_departed_at(self.now())
    }

    /// [`Node::sweep_departed`] at core time `now`.
    pub(super) fn sweep_departed_at(&self, now: Duration) -> usize {
        let drop_after = Duration::from_secs(self.cfg.drop_departed_after_s);
        let mut dropped = Vec::new();
        {
            let mut guard = self.lock();
            let core = &mut *guard;
            for (i, rt) in core.replicas.iter_mut().enumerate() {
                let due = rt.removed
                    && !rt.dropped
                    && rt
                        .removed_at
                        .is_some_and(|t| now.saturating_sub(t) >= drop_after);
                // Nothing in flight that holds the index: requests, a KV-event subscription
                // (the slot may go to another replica once dropped; a summary pull in flight
                // only delays that, see `reclaimable_slot`).
                let idle = core.view.replica(i).is_some_and(|r| r.load.in_flight == 0)
                    && rt.pending_prefill_tokens == 0
                    && !rt.kv_subscribed;
                if !(due && idle) {
                    continue;
                }
                // The smallest model there is: one block, a 64-item filter.
                match self.cache_model(CacheSource::Approximate, rt.cache.summary().epoch(), 0, 1) {
                    Ok(m) => rt.cache = m,
                    Err(e) => {
                        tracing::warn!(replica = %self.id_of(i), error = %e, "cannot drop a replica's model");
                        continue;
                    }
                }
                rt.dropped = true;
                rt.incarnation += 1;
                rt.engine = None;
                rt.engine_at = None;
                rt.summary_dirty = false;
                rt.health = HealthTracker::new();
                rt.peer_in_flight = 0;
                rt.peer_pending_tokens = 0;
                let published = rt.mesh.published.take();
                rt.mesh = ReplicaMesh {
                    home: false,
                    learned: rt.mesh.learned,
                    // A pull in flight still ends on this slot: it is not reused before.
                    pulling: rt.mesh.pulling,
                    published,
                    ..ReplicaMesh::default()
                };
                core.view.clear_summary(i);
                core.view.set_health(i, Health::Draining);
                dropped.push(i);
            }
        }
        if !dropped.is_empty() {
            self.registry_changed.send_modify(|v| *v += 1);
        }
        for &i in &dropped {
            let id = self.id_of(i);
            tracing::info!(replica = %id, "departed replica dropped (drained; its memory freed)");
            for vec in [&self.metrics.replica_healthy, &self.metrics.in_flight] {
                let _ = vec.remove_label_values(&[&id]);
            }
            let _ = self.metrics.ejections.remove_label_values(&[&id]);
            let _ = self.metrics.scrape_refused.remove_label_values(&[&id]);
            self.kv_metrics.forget(&id);
        }
        dropped.len()
    }
}

/// A dropped replica's slot that a new replica may take: nothing in flight or pending there
/// (requests, a KV-event subscription, a summary pull) and no record of it left to withdraw
/// from the mesh.
fn reclaimable_slot(core: &Core) -> Option<usize> {
    core.replicas
        .iter()
        .enumerate()
        .find(|(i, rt)| {
            rt.dropped
                && !rt.kv_subscribed
                && !rt.mesh.pulling
                && rt.mesh.published.is_none()
                && rt.pending_prefill_tokens == 0
                && core.view.replica(*i).is_some_and(|r| r.load.in_flight == 0)
        })
        .map(|(i, _)| i)
}

impl Node {
    /// Marks replica `i`'s KV-event subscription running, if `incarnation` is still live (its
    /// slot is then not dropped until [`Node::end_kv_subscription`]). Returns whether it did.
    pub(super) fn begin_kv_subscription(&self, i: usize, incarnation: u64) -> bool {
        let mut core = self.lock();
        match core.replicas.get_mut(i) {
            Some(rt) if rt.incarnation == incarnation && !rt.dropped => {
                rt.kv_subscribed = true;
                true
            }
            _ => false,
        }
    }

    /// Replica `i`'s KV-event subscription has ended (its task is done).
    pub(super) fn end_kv_subscription(&self, i: usize) {
        if let Some(rt) = self.lock().replicas.get_mut(i) {
            rt.kv_subscribed = false;
        }
    }

    /// Forgets engine figures older than their lease ([`scrape_lease`]): a replica whose
    /// scrapes keep failing (but whose health checks pass) is no longer avoided for the queue
    /// its last scrape reported. Returns how many it forgot.
    pub(super) fn expire_stale_scrapes(&self) -> usize {
        self.expire_stale_scrapes_at(self.now())
    }

    /// [`Node::expire_stale_scrapes`] at core time `now`.
    pub(super) fn expire_stale_scrapes_at(&self, now: Duration) -> usize {
        let lease = scrape_lease(self.cfg.scrape.interval_ms);
        let mut guard = self.lock();
        let core = &mut *guard;
        let mut expired = 0;
        for (i, rt) in core.replicas.iter_mut().enumerate() {
            if rt
                .engine_at
                .is_some_and(|at| now.saturating_sub(at) >= lease)
            {
                rt.engine = None;
                rt.engine_at = None;
                core.view
                    .set_engine_load(i, 0, 0, 0.0, rt.queued_estimate());
                expired += 1;
            }
        }
        expired
    }
}

/// How long a scrape's figures count: 10 scrape intervals, at least 10 s.
pub fn scrape_lease(interval_ms: u64) -> Duration {
    Duration::from_millis(interval_ms.saturating_mul(10).max(10_000))
}

// What a DNS or Kubernetes source needs of the node (`replicas::dns`, `replicas::k8s`).
impl ReplicaRegistry for Node {
    fn add_replica(&self, spec: &ReplicaConfig) -> anyhow::Result<(usize, bool)> {
        Node::add_configured_replica(self, spec)
    }

    fn remove_replica(&self, i: usize) {
        Node::remove_replica(self, i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DNS churn: a replica that left drains, is dropped to a tombstone after [`DROP_AFTER`]
    /// with its memory freed, and comes back at the same index with a fresh model.
    #[test]
    fn a_departed_replica_is_dropped_after_its_drain_and_revived_at_its_index() {
        crate::proxy::install_crypto_provider();
        let cfg = NodeConfig {
            replicas: vec![ReplicaConfig {
                id: Some("keep".into()),
                models: vec!["m".into()],
                ..ReplicaConfig::from_url("http://10.0.0.1:8000".to_owned())
            }],
            ..NodeConfig::default()
        };
        let node = Node::new(cfg).unwrap();
        let spec = ReplicaConfig {
            id: Some("dns-1".into()),
            capacity_tokens: Some(1 << 24),
            ..ReplicaConfig::from_url("http://10.0.0.2:8000".to_owned())
        };
        let (i, new) = node.add_replica(&spec).unwrap();
        assert!(new);
        let big = node.lock().replicas[i].cache.summary().filter_bytes();
        node.remove_replica(i);
        assert!(node.is_removed(i));
        let left = node.lock().replicas[i].removed_at.unwrap();
        assert_eq!(node.sweep_departed_at(left), 0, "drains first");
        assert_eq!(node.sweep_departed_at(left + DROP_AFTER), 1);
        {
            let core = node.lock();
            let rt = &core.replicas[i];
            assert!(rt.dropped && rt.engine.is_none());
            assert!(
                rt.cache.summary().filter_bytes() * 100 < big,
                "its model was freed"
            );
            assert_eq!(core.view.replica(i).unwrap().health, Health::Draining);
        }
        assert_eq!(node.live_incarnation(i), None);
        // Dropped once only.
        assert_eq!(node.sweep_departed_at(left + DROP_AFTER * 2), 0);
        // Back in DNS: same index, revived (watchers start again), healthy, sized again.
        assert_eq!(node.add_replica(&spec).unwrap(), (i, true));
        assert!(!node.is_removed(i));
        assert_eq!(node.lock().replicas[i].cache.summary().filter_bytes(), big);
        assert_eq!(node.replica_count(), 2);
        // The other replica was never touched.
        assert!(!node.is_removed(0));
    }

    /// A scrape's figures are on a lease: a replica that reported a long queue and then could
    /// not be scraped stops being avoided for it once the lease is over.
    #[test]
    fn stale_engine_figures_expire() {
        crate::proxy::install_crypto_provider();
        let node = Node::new(NodeConfig::default()).unwrap();
        let (i, _) = node
            .add_replica(&ReplicaConfig::from_url("http://10.0.0.1:8000".to_owned()))
            .unwrap();
        let load = crate::replicas::prom::EngineLoad {
            waiting: Some(500.0),
            running: Some(64.0),
            ..Default::default()
        };
        node.apply_scrape(i, 0, load).unwrap();
        let at = node.lock().replicas[i].engine_at.unwrap();
        assert_eq!(node.lock().view.replica(i).unwrap().load.waiting, 500);
        let lease = scrape_lease(node.cfg.scrape.interval_ms);
        assert_eq!(
            node.expire_stale_scrapes_at(at + lease - Duration::from_millis(1)),
            0
        );
        assert_eq!(node.expire_stale_scrapes_at(at + lease), 1);
        let core = node.lock();
        let r = core.view.replica(i).unwrap();
        assert_eq!((r.load.waiting, r.load.running), (0, 0));
        assert!(core.replicas[i].engine.is_none());
    }

    proptest::proptest! {
        /// The lease is at least 10 s and 10 scrape intervals, and never overflows.
        #[test]
        fn the_scrape_lease_covers_ten_intervals(interval in 0u64..u64::MAX) {
            let lease = scrape_lease(interval);
            proptest::prop_assert!(lease >= Duration::from_secs(10));
            proptest::prop_assert!(lease.as_millis() >= u128::from(interval.min(u64::MAX / 10)) * 10);
        }
    }

    /// A new replica takes a dropped one's slot instead of growing the registry: the old id
    /// no longer names it, the view slot starts over, the incarnation moves on (old tasks
    /// end); an operator's drain of the old id outlives the slot.
    #[test]
    fn a_new_replica_reclaims_a_dropped_slot() {
        crate::proxy::install_crypto_provider();
        let node = Node::new(NodeConfig::default()).unwrap();
        let spec = |id: &str, host: u8| ReplicaConfig {
            id: Some(id.into()),
            ..ReplicaConfig::from_url(format!("http://10.0.0.{host}:8000"))
        };
        let (i, _) = node.add_replica(&spec("old", 1)).unwrap();
        let (busy, _) = node.add_replica(&spec("busy", 2)).unwrap();
        node.lock().replicas[i].admin_drained = true;
        node.remove_replica(i);
        node.remove_replica(busy);
        node.lock().view.replica_mut(busy).unwrap().load.in_flight = 1;
        let left = node.lock().replicas[i].removed_at.unwrap();
        // Not reclaimable before it is dropped: a newcomer grows the registry.
        assert_eq!(node.add_replica(&spec("early", 3)).unwrap(), (2, true));
        assert_eq!(node.sweep_departed_at(left + DROP_AFTER), 1, "busy stays");
        let inc = node.lock().replicas[i].incarnation;
        assert_eq!(node.add_replica(&spec("new", 4)).unwrap(), (i, true));
        {
            let core = node.lock();
            assert_eq!(core.view.index_of("new"), Some(i));
            assert_eq!(core.view.index_of("old"), None);
            let r = core.view.replica(i).unwrap();
            assert_eq!(
                (r.health, r.info.url.as_str()),
                (Health::Healthy, "http://10.0.0.4:8000")
            );
            let rt = &core.replicas[i];
            assert!(!rt.dropped && !rt.removed && !rt.admin_drained);
            assert!(rt.incarnation > inc);
        }
        assert_eq!(&*node.id_of(i), "new");
        assert_eq!(node.live_incarnation(i), Some(inc + 1));
        assert_eq!(node.replica_count(), 3);
        // The busy one (something in flight) is never reclaimed: the next newcomer grows.
        assert_eq!(node.add_replica(&spec("next", 5)).unwrap(), (3, true));
        // The drained id back: a new slot, still drained by the operator.
        let (back, new) = node.add_replica(&spec("old", 1)).unwrap();
        assert!(new && back == 4);
        assert!(node.lock().replicas[back].admin_drained);
        assert_eq!(
            node.lock().view.replica(back).unwrap().health,
            Health::Draining
        );
    }
}
