//! What the node learns about its replicas — active checks, scrapes, request outcomes, KV
//! events — folded into health, load and cache models, and the periodic upkeep that copies
//! changed summaries into the view.

use std::sync::Arc;

use super::state::{Node, MAX_FIRST_BYTE_LAG};
use crate::core::cache_model::CacheSource;
use crate::core::keys::BlockKey;
use crate::core::summary::Tier;
use crate::core::tenants::KV_UNATTRIBUTED;
use crate::core::view::Health;
use crate::replicas::kv_events::KvEventSink;
use crate::replicas::kv_index::Op;
use crate::replicas::prom::EngineLoad;

/// Shortest predicted time to first token whose observation teaches a replica's first-byte lag.
pub const MIN_PREDICTION_S: f64 = 0.1;

/// Weight of the newest observation in a replica's first-byte lag (an exponential average over
/// the last ~10 long requests: it follows a change of workload within a minute of agentic turns).
const FIRST_BYTE_LAG_WEIGHT: f64 = 0.1;

/// Envoy's panic threshold (`replicas/health.rs`): in each pool where most replicas are
/// ejected, ejections stop taking replicas out of routing; recomputed when one starts or ends.
fn refresh_panic(core: &mut super::state::Core) {
    let mut pools: std::collections::HashMap<(&str, &str), (usize, usize)> = Default::default();
    for (i, rt) in core.replicas.iter().enumerate() {
        if let (Some(r), false) = (core.view.replica(i), rt.removed) {
            let n = pools.entry((&r.info.region, &r.info.pool)).or_default();
            n.0 += usize::from(rt.health.ejected());
            n.1 += 1;
        }
    }
    let panic: Vec<bool> = (0..core.replicas.len())
        .map(|i| {
            core.view.replica(i).is_some_and(|r| {
                let (ejected, total) = pools
                    .get(&(r.info.region.as_str(), r.info.pool.as_str()))
                    .copied()
                    .unwrap_or_default();
                crate::replicas::health::pool_in_panic(ejected, total)
            })
        })
        .collect();
    for (i, on) in panic.into_iter().enumerate() {
        if core.replicas[i].health.set_panic(on) {
            if on {
                tracing::warn!(replica = %core.view.replica(i).map_or("", |r| r.info.id.as_str()), "most of its pool is ejected: routed to anyway (panic threshold)");
            }
            let h = core.replicas[i].effective_health();
            core.view.set_health(i, h);
        }
    }
}

impl Node {
    /// Replica `i`'s progress count (`ReplicaRuntime::progress`) and first-byte lag
    /// (`ReplicaRuntime::first_byte_lag`), while it takes requests (healthy, not removed or
    /// drained): a waiting stream scales its wait by the lag and compares two progress readings
    /// to tell a replica working through a queue from a stuck one. `None`: not taking requests.
    pub fn replica_progress(&self, i: usize) -> Option<(u64, f64)> {
        let core = self.lock();
        let rt = core.replicas.get(i)?;
        (rt.effective_health() == Health::Healthy && !rt.dropped)
            .then(|| (rt.progress, rt.first_byte_lag()))
    }

    /// A stream at replica `i` answered (a non-5xx status) `observed_s` after it was sent,
    /// predicted at `predicted_s`: a success for its health, and an observation of how late the
    /// replica runs against the node's predictions (`ReplicaRuntime::first_byte_log_lag`).
    /// Predictions under [`MIN_PREDICTION_S`] are not observed: a few ms of overhead would
    /// read as a large lag.
    pub fn stream_answered(&self, i: usize, predicted_s: f64, observed_s: f64) {
        let mut core = self.lock();
        let Some(rt) = core.replicas.get_mut(i) else {
            return;
        };
        rt.health.request_succeeded();
        if predicted_s >= MIN_PREDICTION_S && observed_s.is_finite() && observed_s > 0.0 {
            let lag = (observed_s / predicted_s)
                .ln()
                .clamp(-MAX_FIRST_BYTE_LAG.ln(), MAX_FIRST_BYTE_LAG.ln());
            rt.first_byte_log_lag += FIRST_BYTE_LAG_WEIGHT * (lag - rt.first_byte_log_lag);
        }
    }

    /// A request to replica `i` succeeded (got a non-5xx answer).
    pub fn request_succeeded(&self, i: usize) {
        if let Some(rt) = self.lock().replicas.get_mut(i) {
            rt.health.request_succeeded();
        }
    }

    /// A request to replica `i` failed (connect error, timeout, 5xx): counts towards ejection.
    pub fn request_failed(&self, i: usize) {
        let now = self.now();
        let mut core = self.lock();
        let Some(rt) = core.replicas.get_mut(i) else {
            return;
        };
        if rt.health.request_failed(now, &self.cfg.health) {
            let health = rt.effective_health();
            core.view.set_health(i, health);
            refresh_panic(&mut core);
            drop(core);
            tracing::warn!(replica = %self.id_of(i), "ejected after consecutive failures");
            self.metrics
                .ejections
                .with_label_values(&[&self.id_of(i)])
                .inc();
            self.metrics
                .replica_healthy
                .with_label_values(&[&self.id_of(i)])
                .set(0);
        }
    }

    /// Whether replica `i` failed requests lately (consecutive failures above zero, or
    /// ejected): a request that merely timed out there is then held against it too
    /// (`proxy/blame.rs`).
    pub fn replica_failing(&self, i: usize) -> bool {
        let core = self.lock();
        core.replicas
            .get(i)
            .is_some_and(|rt| rt.health.request_failures() > 0 || rt.health.ejected())
    }

    /// Result of an active health check; `models` when discovered from `/v1/models`.
    pub(super) fn active_check(
        &self,
        i: usize,
        incarnation: u64,
        ok: bool,
        models: Option<Vec<String>>,
    ) {
        let mut core = self.lock();
        let Some(rt) = core
            .replicas
            .get_mut(i)
            .filter(|rt| rt.incarnation == incarnation && !rt.dropped)
        else {
            return;
        };
        let before = rt.effective_health();
        rt.health.active_result(ok, &self.cfg.health);
        let health = rt.effective_health();
        let models_configured = rt.models_configured;
        core.view.set_health(i, health);
        if let (Some(models), false) = (models, models_configured) {
            if let Some(r) = core.view.replica(i) {
                if r.info.models != models {
                    let mut info = (*r.info).clone();
                    info.models = models;
                    core.view.upsert(info);
                }
            }
        }
        drop(core);
        if before != health {
            tracing::info!(replica = %self.id_of(i), ?health, "health changed");
        }
        self.metrics
            .replica_healthy
            .with_label_values(&[&self.id_of(i)])
            .set((health == Health::Healthy) as i64);
    }

    /// Whether replica `i`'s models still need discovering.
    pub(super) fn needs_models(&self, i: usize) -> bool {
        let core = self.lock();
        match (core.replicas.get(i), core.view.replica(i)) {
            (Some(rt), Some(r)) => !rt.models_configured && r.info.models.is_empty(),
            _ => false,
        }
    }

    /// A scrape of replica `i`'s `/metrics`.
    pub(super) fn apply_scrape(
        &self,
        i: usize,
        incarnation: u64,
        load: EngineLoad,
    ) -> anyhow::Result<()> {
        let mut core = self.lock();
        let core = &mut *core;
        let Some(rt) = core
            .replicas
            .get_mut(i)
            .filter(|rt| rt.incarnation == incarnation && !rt.dropped)
        else {
            return Ok(());
        };
        rt.engine = Some(load);
        rt.engine_at = Some(self.now());
        if let (Some(bs), Some(tm)) = (load.block_size, self.tokenizer.as_ref()) {
            if let Some(bs) = u32::try_from(bs)
                .ok()
                .and_then(|bs| tm.learn_block_size(bs))
            {
                tracing::info!(replica = %self.id_of(i), block_size = bs, "token-mode block size from metrics");
                core.view.tokens_per_block = bs;
            }
        }
        // The region's other nodes' pending prefill stays in: a scrape says nothing about it,
        // and a home (the node that scrapes) dropping it every scrape interval routed as if the
        // queue held only its own requests (the 3-node demo's late first tokens).
        let queued = rt.queued_estimate();
        // Clamped to what peers accept in a gossiped load record: an engine summing more would
        // have its every record refused by the region (`schema::bounds::MAX_REQUESTS`).
        let cap = f64::from(crate::mesh::schema::bounds::MAX_REQUESTS);
        let to_u32 = |v: Option<f64>| v.map_or(0, |v| v.clamp(0.0, cap) as u32);
        core.view.set_engine_load(
            i,
            to_u32(load.waiting),
            to_u32(load.running),
            load.kv_usage.unwrap_or(0.0).clamp(0.0, 1.0) as f32,
            queued,
        );
        if let (Some(cap), false) = (load.capacity_tokens, rt.capacity_configured) {
            let known = core.view.replica(i).map_or(0, |r| r.info.capacity_tokens);
            if cap != known {
                // The cache model is sized by capacity at creation: start a new, correctly sized
                // one. This happens once, at the first scrape of a replica without a configured
                // capacity, so little routing history is lost. An exact model has no capacity of
                // its own (the filter resizes itself on rebuild), so it is kept.
                if rt.cache.source() == CacheSource::Approximate {
                    let epoch = rt.cache.summary().epoch() + 1;
                    rt.cache = self.cache_model(
                        CacheSource::Approximate,
                        epoch,
                        cap,
                        core.view.tokens_per_block,
                    )?;
                    rt.summary_dirty = true;
                }
                if let Some(r) = core.view.replica(i) {
                    let mut info = (*r.info).clone();
                    info.capacity_tokens = cap;
                    core.view.upsert(info);
                }
                tracing::info!(replica = %self.id_of(i), capacity_tokens = cap, "capacity from metrics");
            }
        }
        super::load_share::reweigh_claims(core, i, self.now());
        Ok(())
    }

    /// Periodic upkeep: copy changed summaries into the view, expire the overlay, start new
    /// summary epochs when due, end outlier ejections whose backoff passed (half-open).
    pub fn tick(&self) {
        let now = self.now();
        let mut guard = self.lock();
        let core = &mut *guard;
        core.view.expire_overlay(now);
        let mut reopened = Vec::new();
        for (i, rt) in core.replicas.iter_mut().enumerate() {
            match rt.cache.maybe_rebuild(now) {
                Ok(true) => rt.summary_dirty = true,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(replica = %self.id_of(i), error = %e, "summary rebuild failed")
                }
            }
            // A follower's view copy is the one pulled from the home, not this node's model.
            if rt.summary_dirty && rt.mesh.home {
                rt.summary_dirty = false;
                core.view.set_summary(i, rt.cache.summary().routing_copy());
            }
            if rt.health.tick(now, &self.cfg.health) {
                core.view.set_health(i, rt.effective_health());
                reopened.push(i);
            }
        }
        if !reopened.is_empty() {
            refresh_panic(core);
        }
        // Shares move with reports, events and expiry too, not only with this node's requests.
        for i in 0..core.replicas.len() {
            super::kv_shares::refresh_kv_shares(core, i);
        }
        drop(guard);
        for i in reopened {
            tracing::info!(replica = %self.id_of(i), "ejection over, half-open");
            let healthy = self.lock().view.replica(i).map(|r| r.health) == Some(Health::Healthy);
            self.metrics
                .replica_healthy
                .with_label_values(&[&self.id_of(i)])
                .set(healthy as i64);
        }
        self.sweep_departed();
        self.expire_stale_scrapes();
    }

    /// Switches replica `i`'s cache model between exact (events up) and approximate (events down),
    /// seeding the new model with `keys`, the last exact set with each key's best tier. An
    /// approximate model has no tiers: it takes every key as GPU-held (routed blocks are), so a
    /// replica whose stream is down gets full credit for its offloaded blocks until they age out.
    /// No-op when already in that mode.
    fn set_exact(&self, i: usize, exact: bool, keys: &[(BlockKey, Tier)]) -> anyhow::Result<()> {
        let now = self.now();
        let mut guard = self.lock();
        let core = &mut *guard;
        let Some(rt) = core.replicas.get_mut(i) else {
            return Ok(());
        };
        let want = if exact {
            CacheSource::Exact
        } else {
            CacheSource::Approximate
        };
        if rt.cache.source() == want {
            return Ok(());
        }
        let capacity = core.view.replica(i).map_or(0, |r| r.info.capacity_tokens);
        let epoch = rt.cache.summary().epoch() + 1;
        let mut model = self.cache_model(want, epoch, capacity, core.view.tokens_per_block)?;
        if exact {
            for tier in Tier::ALL {
                let of_tier: Vec<BlockKey> = keys
                    .iter()
                    .filter(|(_, t)| *t == tier)
                    .map(|(k, _)| *k)
                    .collect();
                if !of_tier.is_empty() {
                    model.store_tier(&of_tier, tier, now);
                }
            }
        } else {
            let plain: Vec<BlockKey> = keys.iter().map(|(k, _)| *k).collect();
            model.record_routed(&plain, now);
        }
        rt.cache = model;
        rt.summary_dirty = true;
        drop(guard);
        let id = self.endpoint(i).map_or_else(|| Arc::from("?"), |e| e.id);
        let to = if exact { "exact" } else { "approximate" };
        if exact {
            tracing::info!(replica = %id, blocks = keys.len(), "KV event stream up: cache model follows the engine");
        } else {
            tracing::warn!(replica = %id, blocks = keys.len(), "KV event stream down: back to the approximate cache model");
        }
        self.kv_metrics.switches.with_label_values(&[&id, to]).inc();
        self.kv_metrics
            .up
            .with_label_values(&[&id])
            .set(exact as i64);
        Ok(())
    }

    /// Applies the index's operations to replica `i`'s cache model, if it is in exact mode.
    fn apply_ops(&self, i: usize, ops: &[Op]) -> anyhow::Result<()> {
        if ops.is_empty() {
            return Ok(());
        }
        let now = self.now();
        let mut core = self.lock();
        let Some(rt) = core.replicas.get_mut(i) else {
            return Ok(());
        };
        if rt.cache.source() != CacheSource::Exact {
            return Ok(());
        }
        for op in ops {
            match op {
                Op::Store(keys, tier) => rt.cache.store_tier(keys, *tier, now),
                Op::Remove(keys) => rt.cache.remove(keys),
                Op::Clear => rt.cache.clear()?,
                Op::Ranks(sets) => rt.cache.set_ranks(sets),
            }
        }
        rt.summary_dirty = true;
        Ok(())
    }

    /// Blocks another node reports having routed to replica `i`
    /// ([`ReplicaRuntime::learn_reported`](super::state::ReplicaRuntime::learn_reported)).
    /// Returns whether its model took them.
    pub fn record_report(&self, i: usize, keys: &[BlockKey]) -> bool {
        let now = self.now();
        self.lock()
            .replicas
            .get_mut(i)
            .is_some_and(|rt| rt.learn_reported(keys, KV_UNATTRIBUTED, now))
    }
}

// What a KV-event subscriber needs of the node (`replicas::kv_events`).
impl KvEventSink for Node {
    fn apply_ops(&self, i: usize, ops: &[Op]) -> anyhow::Result<()> {
        Node::apply_ops(self, i, ops)
    }

    fn set_exact(&self, i: usize, exact: bool, keys: &[(BlockKey, Tier)]) -> anyhow::Result<()> {
        Node::set_exact(self, i, exact, keys)
    }

    fn learn_block_size(&self, i: usize, block_size: u32) {
        let Some(tm) = self.tokenizer.as_ref() else {
            return;
        };
        if let Some(bs) = tm.learn_block_size(block_size) {
            tracing::info!(replica = %self.id_of(i), block_size = bs, "token-mode block size from KV events");
            self.lock().view.tokens_per_block = bs;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::mesh::load_share::{LoadEntry, LoadUpdate};
    use crate::node::config::NodeConfig;
    use crate::node::state::Node;
    use crate::replicas::entry::ReplicaConfig;
    use crate::replicas::prom::EngineLoad;

    /// Issue #35: six long requests ejected both replicas, then 503 for everyone. With most of
    /// a pool ejected, ejections are ignored there (Envoy's panic threshold): routed to all.
    #[test]
    fn a_pool_mostly_ejected_is_routed_to_rather_than_refused() {
        use crate::core::router::{Decision, RouteRequest};
        use crate::core::view::Health;
        crate::proxy::install_crypto_provider();
        let replica = |id: &str, port: u16| ReplicaConfig {
            id: Some(id.into()),
            models: vec!["m".into()],
            ..ReplicaConfig::from_url(format!("http://10.0.0.1:{port}"))
        };
        let cfg = NodeConfig {
            replicas: vec![replica("r0", 8000), replica("r1", 8001)],
            ..NodeConfig::default()
        };
        let node = Node::new(cfg).unwrap();
        let health = |i: usize| node.lock().view.replica(i).unwrap().health;
        let ejections = node.cfg.health.eject_after_failures;
        for _ in 0..ejections {
            node.request_failed(0);
        }
        assert_eq!(
            health(0),
            Health::Unhealthy,
            "one of two ejected: the other serves"
        );
        for _ in 0..ejections {
            node.request_failed(1);
        }
        assert_eq!((health(0), health(1)), (Health::Healthy, Health::Healthy));
        let req = RouteRequest::plain("m", &[], 16);
        assert!(matches!(node.route(&req).0, Decision::Route(_)));
    }

    #[test]
    fn a_scrape_keeps_the_prefill_the_regions_other_nodes_queued() {
        let node = one_replica();
        {
            let mut guard = node.lock();
            let core = &mut *guard;
            core.replicas[0].pending_prefill_tokens = 100;
            let update = LoadUpdate {
                origin: 1,
                seq: 1,
                entries: vec![LoadEntry {
                    replica: "r0".into(),
                    in_flight: 2,
                    pending_tokens: 5_000,
                }],
                tips: Vec::new(),
            };
            let peer = "127.0.0.2:7000".parse().unwrap();
            core.peer_loads
                .apply(peer, update, Duration::ZERO, |_| Some(256))
                .unwrap();
            crate::node::load_share::refresh_shared_load(core, 0, 1 << 21, Duration::ZERO);
            assert_eq!(
                core.view.replica(0).unwrap().load.queued_prefill_tokens,
                5_100
            );
        }
        let scraped = EngineLoad {
            waiting: Some(1.0),
            running: Some(3.0),
            ..EngineLoad::default()
        };
        node.apply_scrape(0, 0, scraped).unwrap();
        let core = node.lock();
        let load = core.view.replica(0).unwrap().load;
        assert_eq!((load.waiting, load.running), (1, 3));
        assert_eq!(load.queued_prefill_tokens, 5_100, "the peer's 5,000 stay");
        assert_eq!(load.peer_in_flight, 2);
    }

    fn one_replica() -> std::sync::Arc<Node> {
        crate::proxy::install_crypto_provider();
        let cfg = NodeConfig {
            replicas: vec![ReplicaConfig {
                id: Some("r0".into()),
                models: vec!["m".into()],
                ..ReplicaConfig::from_url("http://10.0.0.1:8000")
            }],
            ..NodeConfig::default()
        };
        Node::new(cfg).unwrap()
    }

    /// Issue #38: the node predicts prefill as linear in uncached tokens; the engine's long
    /// prompts come ~3× later. Streams answered 3× later than predicted teach the replica a lag
    /// near 3; predictions too short to read are skipped; a replica faster than predicted
    /// still counts 1; nonsense is ignored.
    #[test]
    fn a_replicas_first_byte_lag_follows_observed_over_predicted() {
        let node = one_replica();
        let lag = || node.replica_progress(0).unwrap().1;
        assert_eq!(lag(), 1.0, "no observation yet");
        node.stream_answered(0, 0.01, 1.0);
        node.stream_answered(0, 2.0, f64::NAN);
        assert_eq!(lag(), 1.0, "a 10 ms prediction and a NaN teach nothing");
        for _ in 0..60 {
            node.stream_answered(0, 2.0, 6.0);
        }
        assert!((lag() - 3.0).abs() < 0.05, "{}", lag());
        for _ in 0..60 {
            node.stream_answered(0, 2.0, 0.5);
        }
        assert_eq!(lag(), 1.0, "faster than predicted: the prediction stands");
        for _ in 0..200 {
            node.stream_answered(0, 0.2, 1e6);
        }
        assert!(
            (lag() - super::MAX_FIRST_BYTE_LAG).abs() < 1e-6,
            "bounded: {}",
            lag()
        );
    }

    /// A replica's progress count moves with this node's first bytes there and with the
    /// region's other nodes' pending prefill there falling; not with a peer's new request, and
    /// not while nothing happens.
    #[test]
    fn progress_counts_first_bytes_here_and_at_peers() {
        let node = one_replica();
        let progress = || node.replica_progress(0).unwrap().0;
        let peer = "127.0.0.2:7000".parse().unwrap();
        let claim = |seq: u64, pending: u64| {
            let mut guard = node.lock();
            let core = &mut *guard;
            let update = LoadUpdate {
                origin: 1,
                seq,
                entries: vec![LoadEntry {
                    replica: "r0".into(),
                    in_flight: 1,
                    pending_tokens: pending,
                }],
                tips: Vec::new(),
            };
            core.peer_loads
                .apply(peer, update, Duration::ZERO, |_| Some(256))
                .unwrap();
            crate::node::load_share::refresh_shared_load(core, 0, 1 << 21, Duration::ZERO);
        };
        let start = progress();
        claim(1, 50_000);
        assert_eq!(progress(), start, "a peer's new request is not progress");
        claim(2, 50_000);
        assert_eq!(progress(), start, "nothing moved");
        claim(3, 0);
        assert_eq!(
            progress(),
            start + 1,
            "the peer's prompt got its first byte"
        );
        let req = crate::core::router::RouteRequest::plain("m", &[], 16);
        let (_, ticket) = node.route(&req);
        let mut ticket = ticket.unwrap();
        assert_eq!(progress(), start + 1, "routing is not progress");
        ticket.first_byte(&[]);
        assert_eq!(progress(), start + 2, "a first byte here");
        drop(ticket);
        assert_eq!(progress(), start + 3, "an answered request ended");
        let (_, unanswered) = node.route(&req);
        drop(unanswered);
        assert_eq!(
            progress(),
            start + 3,
            "a request ending unanswered is not progress"
        );
    }
}
