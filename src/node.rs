//! The node: the routing core's state behind one lock, plus what the HTTP front and the replica
//! tasks need to share.
//!
//! Exists to keep the driver side of the sans-IO core in one place: the view, the router and each
//! replica's approximate cache model and health record live together in a [`Core`] behind a std
//! `Mutex`, because every operation on them is synchronous and short (a routing decision is
//! microseconds). The lock is never held across an `.await`. Time for the core is the
//! [`Duration`] since the node started, from a monotonic clock.
//!
//! Accounting of a routed request (in-flight counts, tenant quotas, queued prefill) is owned by a
//! [`Ticket`] whose `Drop` undoes it, so a client that disconnects mid-stream, a failed attempt
//! and a finished response all release exactly once.
//!
//! A routed request's blocks are in the engine's prefix cache only once *its* prefill is done,
//! as the simulator models it (`bench::sim`): at routing time they go into the view's overlay
//! counted from the predicted end of that prefill ([`View::record_routed_ready`]), and only at
//! the response's first byte ([`Ticket::first_byte`]) into the replica's approximate cache model
//! and the block report to a remote home. A request that fails before its first byte records
//! nothing there.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::config::{NodeConfig, ReplicaConfig, DEFAULT_CAPACITY_TOKENS};
use crate::core::cache_model::{CacheModel, CacheModelConfig, CacheSource};
use crate::core::cost::CostModel;
use crate::core::keys::BlockKey;
use crate::core::policy::PolicyKind;
use crate::core::router::{Decision, RouteRequest, Router, RouterConfig};
use crate::core::summary::SummaryConfig;
use crate::core::tenants::{TenantConfig, Tenants};
use crate::core::view::{Health, ReplicaInfo, View};
use crate::proxy::metrics::Metrics;
use crate::replicas::health::HealthTracker;
use crate::replicas::kv_events::KvMetrics;
use crate::replicas::prom::EngineLoad;
use crate::tokenize::TokenMode;

#[path = "node_mesh.rs"]
pub mod mesh;

/// Driver-side state of one replica, indexed like the view.
#[derive(Debug)]
pub struct ReplicaRuntime {
    /// The replica's cache model: approximate (fed by this node's requests there at their first
    /// byte, and by other nodes' block reports when home) or, while
    /// its KV-event stream is up, exact (fed by the events; see `replicas::kv_events`).
    pub cache: CacheModel,
    /// The cache model changed since its summary was last copied into the view.
    pub summary_dirty: bool,
    /// Active-check and outlier-ejection state.
    pub health: HealthTracker,
    /// Uncached prompt tokens of this node's requests there that have no first byte yet.
    pub pending_prefill_tokens: u64,
    /// Models came from the config (never replaced by discovery).
    pub models_configured: bool,
    /// Capacity came from the config (never replaced by a scrape).
    pub capacity_configured: bool,
    /// Latest scrape, if any succeeded.
    pub engine: Option<EngineLoad>,
    /// Left the registry (DNS no longer lists it): takes no new requests.
    pub removed: bool,
    /// Mesh role and sync state (home or follower); a single node is home of everything.
    pub mesh: mesh::ReplicaMesh,
}

impl ReplicaRuntime {
    /// Health for routing: draining once removed, else what checks and ejection say, made worse
    /// by what the replica's home node publishes when another node is its home.
    pub fn effective_health(&self) -> Health {
        if self.removed {
            Health::Draining
        } else {
            mesh::worst(self.health.health(), self.mesh.remote_health)
        }
    }

    /// Prompt tokens believed queued for prefill there: this node's own, plus what the home
    /// publishes when another node is home.
    pub fn queued_estimate(&self) -> u64 {
        self.pending_prefill_tokens
            .saturating_add(self.mesh.remote_queued)
    }
}

/// Everything routing reads and writes, behind the node's one lock.
pub struct Core {
    /// What the node knows of the fleet.
    pub view: View,
    /// The router (policy, RNG, tenants).
    pub router: Router,
    /// Per replica, by view index.
    pub replicas: Vec<ReplicaRuntime>,
}

/// One replica's address; cheap to clone so the request path can hold it without a lock.
#[derive(Clone, Debug)]
pub struct Endpoint {
    /// Replica id.
    pub id: Arc<str>,
    /// Base URL without a trailing slash.
    pub base: Arc<str>,
}

/// The shared state of a running node.
pub struct Node {
    /// The validated configuration.
    pub cfg: NodeConfig,
    /// The routing policy.
    pub policy: PolicyKind,
    /// Replica endpoints, by view index (append-only, like the view).
    endpoints: RwLock<Vec<Endpoint>>,
    /// HTTP client for replicas (pooled connections).
    pub client: reqwest::Client,
    /// Metric handles.
    pub metrics: Metrics,
    /// KV-event and token-mode metric handles (registered in `metrics.registry`).
    pub kv_metrics: KvMetrics,
    /// Token mode (`[tokenizer]`), when configured and loaded; `None` means text mode.
    pub tokenizer: Option<TokenMode>,
    core: Mutex<Core>,
    start: Instant,
    tenant_cfgs: HashMap<String, TenantConfig>,
    default_tenant: TenantConfig,
    summary_cfg: SummaryConfig,
    epoch_base: u64,
    /// Mesh membership, when the node runs one (see `node_mesh.rs`).
    mesh: mesh::NodeMesh,
}

/// Cap on the predicted wait before a routed request's blocks count in the overlay (as in the
/// simulator): a wildly overloaded estimate must not park keys for hours.
const MAX_READY_IN_S: f64 = 3600.0;

fn tokens_to_blocks(tokens: u64, tokens_per_block: u32) -> usize {
    (tokens / u64::from(tokens_per_block.max(1))).max(1) as usize
}

/// Token mode if configured and loadable; otherwise text mode, with the reason logged.
fn load_token_mode(cfg: &NodeConfig) -> Option<TokenMode> {
    let Some(tc) = &cfg.tokenizer else {
        tracing::info!("no [tokenizer] configured: routing keys from request text");
        return None;
    };
    match TokenMode::load(tc) {
        Ok(tm) => {
            tracing::info!(tokenizer = %tc.path.display(), block_size = ?tm.block_size(), "token mode");
            Some(tm)
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot load the tokenizer: routing keys from request text");
            None
        }
    }
}

impl Node {
    /// Builds the node's state from a validated config, with the static replicas registered.
    pub fn new(cfg: NodeConfig) -> anyhow::Result<Arc<Node>> {
        cfg.validate()?;
        let policy = cfg.policy_kind()?;
        let tokenizer = load_token_mode(&cfg);
        // Text mode: a block of `block_bytes` bytes is about block_bytes / 4 tokens; token mode:
        // the engine's block size once known.
        let tokens_per_block = tokenizer
            .as_ref()
            .and_then(TokenMode::block_size)
            .unwrap_or((cfg.block_bytes / 4).max(1) as u32);
        let mut view = View::new(cfg.region.clone(), tokens_per_block);
        view.overlay_ttl = Duration::from_secs(cfg.overlay_ttl_s);
        let summary_cfg = SummaryConfig::for_cluster(&cfg.cluster_id);
        // Cache model epochs start at wall-clock ms, so a restarted node's summaries supersede
        // the previous run's.
        let epoch_base = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(1);
        let router = Router::new(
            RouterConfig {
                policy,
                seed: cfg.seed,
                spill_after_s: cfg.spill_after_s,
                cost: CostModel {
                    w_load_s: cfg.w_load_s,
                    affinity_credit_s: cfg.affinity_credit_s,
                    tier_weights: cfg.tier_weights,
                },
            },
            Tenants::new(cfg.tenants.clone(), cfg.default_tenant.clone()),
        );
        let client = reqwest::Client::builder()
            .connect_timeout(cfg.connect_timeout())
            .tcp_nodelay(true)
            .pool_idle_timeout(Duration::from_secs(90))
            .build()?;
        let metrics = Metrics::new()?;
        let kv_metrics = KvMetrics::new(&metrics.registry)?;
        let node = Arc::new(Node {
            policy,
            endpoints: RwLock::new(Vec::with_capacity(cfg.replicas.len())),
            client,
            metrics,
            kv_metrics,
            tokenizer,
            core: Mutex::new(Core {
                view,
                router,
                replicas: Vec::with_capacity(cfg.replicas.len()),
            }),
            start: Instant::now(),
            tenant_cfgs: cfg.tenants.clone(),
            default_tenant: cfg.default_tenant.clone(),
            summary_cfg,
            epoch_base,
            mesh: mesh::NodeMesh::default(),
            cfg,
        });
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
            models_configured: !r.models.is_empty(),
            capacity_configured: r.capacity_tokens.is_some(),
            engine: None,
            removed: false,
            mesh: mesh::ReplicaMesh::default(),
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
    pub fn is_removed(&self, i: usize) -> bool {
        self.lock().replicas.get(i).is_none_or(|rt| rt.removed)
    }

    /// Replica `i`'s address.
    pub fn endpoint(&self, i: usize) -> Option<Endpoint> {
        self.endpoints
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(i)
            .cloned()
    }

    /// Replicas ever registered (indexes `0..n`).
    pub fn replica_count(&self) -> usize {
        self.endpoints
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    fn id_of(&self, i: usize) -> Arc<str> {
        self.endpoint(i).map_or_else(|| Arc::from("?"), |e| e.id)
    }

    /// Time for the core: since the node started, monotonic.
    pub fn now(&self) -> Duration {
        self.start.elapsed()
    }

    /// The core, locked. A panic while holding the lock cannot leave the core half-updated in a
    /// way that matters more than refusing all traffic would, so a poisoned lock is recovered.
    pub fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `tenant`'s requests get their own key namespace.
    pub fn tenant_isolated(&self, tenant: Option<&str>) -> bool {
        tenant
            .and_then(|t| self.tenant_cfgs.get(t))
            .unwrap_or(&self.default_tenant)
            .isolated
    }

    /// Routes `req` (never to a replica in `req.exclude`, those it already failed on). On a
    /// route, records it (overlay from the predicted end of its prefill, in-flight, tenant,
    /// queued prefill) and returns the [`Ticket`] that releases it. The cache model and the home
    /// learn its blocks later, at [`Ticket::first_byte`].
    pub fn route(self: &Arc<Self>, req: &RouteRequest<'_>) -> (Decision, Option<Ticket>) {
        let started = Instant::now();
        let now = self.now();
        let mut guard = self.lock();
        let core = &mut *guard;
        let decision = core.router.route(&core.view, req, now);
        let ticket = match &decision {
            Decision::Route(d) => {
                let i = d.replica;
                let cached = d.hit_blocks as u64 * core.view.tokens_per_block as u64;
                let uncached = req.prompt_tokens.saturating_sub(cached);
                // Its blocks count in the overlay once its prefill is predicted done: the prefill
                // queued there before it (this request's own not yet added), then its own.
                let ready_in = core.view.replica(i).map_or(0.0, |r| {
                    core.router.config().cost.prefill_done_s(r, uncached)
                });
                let ready_in = Duration::try_from_secs_f64(ready_in.clamp(0.0, MAX_READY_IN_S))
                    .unwrap_or_default();
                core.view.record_routed_ready(i, req.keys, now, ready_in);
                let rt = &mut core.replicas[i];
                rt.pending_prefill_tokens = rt.pending_prefill_tokens.saturating_add(uncached);
                let pending = rt.queued_estimate();
                if let Some(r) = core.view.replica_mut(i) {
                    r.load.queued_prefill_tokens = pending;
                }
                if let Some(t) = req.tenant {
                    core.router.tenants.started(t, i);
                }
                let endpoint = self.endpoint(i).unwrap_or_else(|| Endpoint {
                    id: Arc::from("?"),
                    base: Arc::from(""),
                });
                self.metrics
                    .in_flight
                    .with_label_values(&[&endpoint.id])
                    .inc();
                Some(Ticket {
                    node: Arc::clone(self),
                    replica: i,
                    endpoint,
                    tenant: req.tenant.map(str::to_owned),
                    pending_tokens: uncached,
                    started: false,
                })
            }
            _ => None,
        };
        drop(guard);
        self.metrics
            .decision_seconds
            .observe(started.elapsed().as_secs_f64());
        if let Decision::Route(d) = &decision {
            self.metrics.hit_blocks.observe(d.hit_blocks as f64);
        }
        (decision, ticket)
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

    /// Result of an active health check; `models` when discovered from `/v1/models`.
    pub fn active_check(&self, i: usize, ok: bool, models: Option<Vec<String>>) {
        let mut core = self.lock();
        let Some(rt) = core.replicas.get_mut(i) else {
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
    pub fn needs_models(&self, i: usize) -> bool {
        let core = self.lock();
        match (core.replicas.get(i), core.view.replica(i)) {
            (Some(rt), Some(r)) => !rt.models_configured && r.info.models.is_empty(),
            _ => false,
        }
    }

    /// A scrape of replica `i`'s `/metrics`.
    pub fn apply_scrape(&self, i: usize, load: EngineLoad) -> anyhow::Result<()> {
        let mut core = self.lock();
        let core = &mut *core;
        let Some(rt) = core.replicas.get_mut(i) else {
            return Ok(());
        };
        rt.engine = Some(load);
        if let (Some(bs), Some(tm)) = (load.block_size, self.tokenizer.as_ref()) {
            if let Some(bs) = u32::try_from(bs)
                .ok()
                .and_then(|bs| tm.learn_block_size(bs))
            {
                tracing::info!(replica = %self.id_of(i), block_size = bs, "token-mode block size from metrics");
                core.view.tokens_per_block = bs;
            }
        }
        let pending = rt.pending_prefill_tokens;
        let to_u32 = |v: Option<f64>| v.map_or(0, |v| v.clamp(0.0, u32::MAX as f64) as u32);
        core.view.set_engine_load(
            i,
            to_u32(load.waiting),
            to_u32(load.running),
            load.kv_usage.unwrap_or(0.0).clamp(0.0, 1.0) as f32,
            pending,
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
                core.view.set_summary(i, rt.cache.summary().clone());
            }
            if rt.health.tick(now, &self.cfg.health) {
                core.view.set_health(i, rt.effective_health());
                reopened.push(i);
            }
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
    }

    /// Whether some replica is healthy and has known models (the node can serve) and, in a
    /// mesh, the node is warm (see `node_mesh.rs`).
    pub fn ready(&self) -> bool {
        self.mesh_ready()
            && self
                .lock()
                .view
                .replicas()
                .iter()
                .any(|r| r.health == Health::Healthy && !r.info.models.is_empty())
    }

    /// The union of the models of every replica still in the registry, sorted.
    pub fn models(&self) -> Vec<String> {
        let core = self.lock();
        let mut models: Vec<String> = core
            .view
            .replicas()
            .iter()
            .filter(|r| r.health != Health::Draining)
            .flat_map(|r| r.info.models.iter().cloned())
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
            policy: self.policy.as_str().to_owned(),
            uptime_s: self.now().as_secs_f64(),
            replicas,
            mesh: self.mesh_state(),
        }
    }
}

impl Node {
    /// A new, empty cache model for a replica of `capacity_tokens`, summary epoch `epoch`.
    pub(crate) fn cache_model(
        &self,
        source: CacheSource,
        epoch: u64,
        capacity_tokens: u64,
        tokens_per_block: u32,
    ) -> anyhow::Result<CacheModel> {
        let mut mc =
            CacheModelConfig::with_capacity(tokens_to_blocks(capacity_tokens, tokens_per_block));
        mc.ttl = Duration::from_secs(self.cfg.cache_ttl_s);
        Ok(CacheModel::new(
            source,
            epoch,
            mc,
            self.summary_cfg.clone(),
        )?)
    }
}

/// Releases a routed request's accounting when dropped.
pub struct Ticket {
    node: Arc<Node>,
    replica: usize,
    endpoint: Endpoint,
    tenant: Option<String>,
    pending_tokens: u64,
    /// [`Ticket::first_byte`] ran.
    started: bool,
}

impl Ticket {
    /// The replica's view index.
    pub fn replica(&self) -> usize {
        self.replica
    }

    /// The replica's address.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// The replica sent its first byte: its prefill is done, so the request's prompt tokens no
    /// longer count as queued there, and its blocks (`keys`) are now in the engine's prefix
    /// cache: the overlay counts them from now if it predicted later, an approximate cache
    /// model learns them (an exact, KV-event one takes no guesses) and, when another node is the
    /// replica's home, they are reported to it. Pass no keys for a response that is not a
    /// success (the engine refused the request: nothing was cached). Only the first call
    /// counts; later ones are no-ops.
    pub fn first_byte(&mut self, keys: &[BlockKey]) {
        if std::mem::replace(&mut self.started, true) {
            return;
        }
        let tokens = std::mem::take(&mut self.pending_tokens);
        let now = self.node.now();
        let mut guard = self.node.lock();
        let core = &mut *guard;
        release_pending(core, self.replica, tokens);
        if keys.is_empty() {
            return;
        }
        // Its prefill is done now, whatever was predicted: the overlay counts its keys from now.
        core.view.prefill_done(self.replica, keys, now);
        let Some(rt) = core.replicas.get_mut(self.replica) else {
            return;
        };
        if rt.cache.source() == CacheSource::Approximate {
            rt.cache.record_routed(keys, now);
            rt.summary_dirty = true;
        }
        let target = rt.mesh.report_target();
        drop(guard);
        self.node.after_first_byte(self.replica, target, keys);
    }
}

fn release_pending(core: &mut Core, i: usize, tokens: u64) {
    if let Some(rt) = core.replicas.get_mut(i) {
        rt.pending_prefill_tokens = rt.pending_prefill_tokens.saturating_sub(tokens);
        let pending = rt.queued_estimate();
        if let Some(r) = core.view.replica_mut(i) {
            r.load.queued_prefill_tokens = pending;
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut core = self.node.lock();
        release_pending(&mut core, self.replica, self.pending_tokens);
        core.view.finished(self.replica);
        if let Some(t) = &self.tenant {
            core.router.tenants.finished(t, self.replica);
        }
        drop(core);
        self.node
            .metrics
            .in_flight
            .with_label_values(&[&self.endpoint.id])
            .dec();
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
    pub mesh: Option<mesh::MeshStateJson>,
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
