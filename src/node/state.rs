//! The node's state: the routing core's data behind one lock, plus what the HTTP front and the
//! replica tasks share (endpoints, the HTTP client, metrics, token mode, the mesh slot).
//!
//! Exists to keep the driver side of the sans-IO core in one place: the view, the router and each
//! replica's cache model and health record live together in a [`Core`] behind a std `Mutex`,
//! because every operation on them is synchronous and short (a routing decision is
//! microseconds). The lock is never held across an `.await`. Time for the core is the
//! [`Duration`] since the node started, from a monotonic clock. What the node *does* with this
//! state sits beside it, one concern a file (see `node/mod.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use super::config::{NodeConfig, Secrets};
use super::mesh_state::{worst, NodeMesh, ReplicaMesh};
use super::metrics::Metrics;
use crate::core::admission::AdmissionQueue;
use crate::core::cache_model::{CacheModel, CacheModelConfig, CacheSource};
use crate::core::cost::CostModel;
use crate::core::dp_rank::RankLoad;
use crate::core::hot_prefix::HotPrefixes;
use crate::core::keys::BlockKey;
use crate::core::peer_tips::{Ladder, PeerTips};
use crate::core::policy::PolicyKind;
use crate::core::rank_hints::RankHints;
use crate::core::router::{Router, RouterConfig};
use crate::core::summary::SummaryConfig;
use crate::core::tenants::{TenantConfig, Tenants, KV_UNATTRIBUTED};
use crate::core::view::{Health, View};
use crate::mesh::load_share::{LoadShareConfig, PeerLoads};
use crate::replicas::health::HealthTracker;
use crate::replicas::kv_events::{KvEventsSource, KvMetrics};
use crate::replicas::prom::EngineLoad;
use crate::tokenize::TokenMode;

/// Located stored responses a node remembers (`Node::response_homes`).
pub const RESPONSE_HOMES: std::num::NonZeroUsize = match std::num::NonZeroUsize::new(65_536) {
    Some(n) => n,
    None => unreachable!(),
};
/// Stored-response lookups a node runs at once (`Node::response_lookups`): 64 of up to 256
/// replicas each, a few thousand short GETs in flight at most.
pub const RESPONSE_LOOKUPS: usize = 64;
/// Most a replica's observed first-byte lag scales a prediction (`ReplicaRuntime::first_byte_lag`):
/// past it the engine is more likely stuck than slow.
pub const MAX_FIRST_BYTE_LAG: f64 = 16.0;

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
    /// The region's other nodes' in-flight requests there, from their load updates (bounded,
    /// see `load_share.rs`).
    pub peer_in_flight: u32,
    /// The region's other nodes' pending prompt tokens there (bounded likewise).
    pub peer_pending_tokens: u64,
    /// Signs that the engine is working through its queue: bumped when a request of this node
    /// there gets its first byte or ends after one, and when the region's other nodes' pending
    /// prefill there falls (their first bytes). A stream still waiting for its first byte stays
    /// at a replica whose count moved during its wait (`Node::replica_progress`,
    /// `proxy/deliver.rs`): slow behind a queue is not stuck.
    pub progress: u64,
    /// How much later than predicted this node's streams there got their first bytes: an
    /// average of `ln(observed ÷ predicted)` (`Node::stream_answered`), 0 until one is seen.
    /// While predictions priced prefill by tokens alone, long agentic prompts came 2.8× (median)
    /// to 7× (p90) later than predicted; the request's own prefill is now priced with its
    /// attention (`core::cost`), but the queue ahead of it is still counted in tokens and decodes
    /// share the engine's steps. A first-byte wait is scaled by it (`proxy/deliver.rs`), routing
    /// is not.
    pub first_byte_log_lag: f64,
    /// Models came from the config (never replaced by discovery).
    pub models_configured: bool,
    /// Capacity came from the config (never replaced by a scrape).
    pub capacity_configured: bool,
    /// Latest scrape, if any succeeded (and not older than its lease, `registry.rs`).
    pub engine: Option<EngineLoad>,
    /// When `engine` was scraped (core time).
    pub engine_at: Option<Duration>,
    /// Its KV-event subscriber task is running (`watchers.rs`): the slot is not dropped
    /// meanwhile, so no event of it reaches a replica that takes the slot later.
    pub kv_subscribed: bool,
    /// Left the registry (DNS no longer lists it, or a learned replica expired): takes no new
    /// requests.
    pub removed: bool,
    /// When it left the registry (core time).
    pub removed_at: Option<Duration>,
    /// Dropped after its drain: a tombstone keeping the index, its memory (cache model, view
    /// summary, scrape) freed and its watcher tasks ended. Coming back revives it.
    pub dropped: bool,
    /// Bumped whenever it is dropped or revived: watcher tasks of an older incarnation exit.
    pub incarnation: u64,
    /// Mesh role and sync state (home or follower); a single node is home of everything.
    pub mesh: ReplicaMesh,
    /// Where its engine publishes KV events: from the config, a DNS source or (learned) the
    /// home's record. Published in its record, so any node that becomes home subscribes.
    pub kv_source: Option<KvEventsSource>,
    /// Drained by an operator command (`admin.rs`): takes nothing new until added again, even
    /// when a DNS answer or a peer's record brings it back into the registry.
    pub admin_drained: bool,
    /// The region peer whose `admin:` record drained it, `None` when the command was taken
    /// here: a drain taken here holds until undone, one learned from a peer only while that
    /// peer is live (`admin.rs`), so a member that left cannot keep replicas out for good.
    pub admin_drained_by: Option<String>,
    /// This node's load on each data-parallel rank it named (`routing.rs`), grown as ranks are
    /// named (at most `kv_source.dp_ranks` ≤ 64 entries).
    pub rank_loads: Vec<RankLoad>,
    /// Rotates the rank chosen among equal costs (cold prefixes spread over the ranks).
    pub rank_rotate: usize,
    /// The ranks this node's and its region peers' routed prefixes went to (`routing.rs`,
    /// `load_share.rs`): how a node that does not follow the replica's KV events names a rank.
    /// Bounded LRU (`core::rank_hints`).
    pub rank_hints: RankHints,
}

impl ReplicaRuntime {
    /// Health for routing: draining once removed or drained by an operator, else what checks and ejection say, made worse
    /// by what the replica's home node publishes when another node is its home.
    pub fn effective_health(&self) -> Health {
        if self.removed || self.admin_drained {
            Health::Draining
        } else {
            worst(self.health.health(), self.mesh.remote_health)
        }
    }

    /// Blocks another node reports having routed here (mesh block reports) for a request of
    /// KV slot `tenant`: learned by an approximate model; an exact one only attributes those
    /// its events hold to the tenant — reports are guesses, events are the engine's truth.
    /// Returns whether the model's key set took them.
    pub fn learn_reported(&mut self, keys: &[BlockKey], tenant: u8, now: Duration) -> bool {
        if self.cache.source() != CacheSource::Approximate {
            if tenant != KV_UNATTRIBUTED {
                self.cache.attribute(keys, tenant);
            }
            return false;
        }
        self.cache.record_routed_by(keys, tenant, now);
        self.summary_dirty = true;
        true
    }

    /// How many times its predicted time the replica takes to a first byte, as observed
    /// (`first_byte_log_lag`): at least 1 (a replica faster than predicted still gets the
    /// prediction), at most [`MAX_FIRST_BYTE_LAG`].
    pub fn first_byte_lag(&self) -> f64 {
        self.first_byte_log_lag.exp().clamp(1.0, MAX_FIRST_BYTE_LAG)
    }

    /// Prompt tokens believed queued for prefill there: this node's own, plus the other
    /// nodes': their load updates (fresh, every node) or, without them, what the home last
    /// published (a gossip round late, the home's own only). Whichever is larger, as the two
    /// overlap.
    pub fn queued_estimate(&self) -> u64 {
        self.pending_prefill_tokens
            .saturating_add(self.peer_pending_tokens.max(self.mesh.remote_queued))
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
    /// What the region's other nodes last said they have in flight (`load_share.rs`).
    pub peer_loads: PeerLoads,
    /// The hot-prefix detector and warm-up planner (`hot_prefix.rs`).
    pub hot: HotPrefixes,
    /// The region's live nodes, this one included, as the last gossip round saw them: a
    /// prefix's warm-ups come from its rendezvous owner among them. Empty: alone, owns all.
    pub hot_owners: Vec<String>,
    /// This node's id in the mesh (empty without one).
    pub hot_self: String,
    /// Prefixes routed since the last load update (mesh only), for the region's other nodes.
    /// Claims up to `MAX_PENDING_TIPS` (1,024; more between two flushes are dropped: the summary
    /// round has them), answers (first bytes, withdrawals) up to twice that
    /// ([`PendingTip::queue_answer`]): an answer dropped leaves a peer's hold on its claim
    /// unanswered, and strikes this node.
    pub pending_tips: Vec<PendingTip>,
    /// Requests waiting for a slot (`admission.rs`), with `[priorities]` set.
    pub admission: Option<super::admission_queue::NodeQueue>,
    /// The prefixes this node routed most: the heads its region offers others
    /// (`core::region_offer`). Counted only while this node is one of its region's
    /// representatives (`remote_regions.rs` sets and clears it each mesh round): the other
    /// nodes of a regional mesh, a flat mesh and a single node do no such work per request.
    pub heads: Option<crate::core::region_offer::RecentHeads>,
    /// Other regions' offered holders whose pulls came back empty, and those left out for it
    /// (`remote_regions.rs`; at most 256).
    pub empty_holders: crate::core::empty_holders::EmptyHolders,
    /// Ids of operator-drained replicas whose dropped slot went to another replica
    /// (`registry.rs`): one of them back in the registry is still drained. At most
    /// [`MAX_RECLAIMED_DRAINS`], the least recently reclaimed forgotten first.
    pub reclaimed_drains: lru::LruCache<Arc<str>, ()>,
}

/// Most operator drains remembered for replicas whose slot was reclaimed.
pub const MAX_RECLAIMED_DRAINS: std::num::NonZeroUsize = match std::num::NonZeroUsize::new(4096) {
    Some(n) => n,
    None => unreachable!(),
};

/// Most routed prefixes kept for the next load update (answers to them have as much again).
pub const MAX_PENDING_TIPS: usize = 1024;

/// A prefix this node routed, until the next load update tells the region's other nodes
/// (`mesh::load_share::RoutedTip`). Fixed-size, so that booking a request allocates nothing.
#[derive(Clone, Copy, Debug)]
pub struct PendingTip {
    /// The replica's view index.
    pub replica: usize,
    /// The prompt's last block key.
    pub key: BlockKey,
    /// Blocks of the prompt.
    pub blocks: u32,
    /// When its prefill is predicted done.
    pub ready: Duration,
    /// The data-parallel rank named, if any.
    pub rank: Option<u16>,
    /// The shorter prefixes it names.
    pub ladder: Ladder,
    /// Sent at its first byte: its prefill has answered (`RoutedTip::first_byte`).
    pub first_byte: bool,
    /// Sent when its request ended without a first byte: the claim is withdrawn
    /// (`RoutedTip::withdrawn`).
    pub withdrawn: bool,
}

impl PendingTip {
    /// The tip for a prompt of `keys` routed to `replica`, its ladder included.
    pub fn new(
        replica: usize,
        keys: &[BlockKey],
        ready: Duration,
        rank: Option<u16>,
    ) -> Option<Self> {
        Some(PendingTip {
            replica,
            key: *keys.last()?,
            blocks: u32::try_from(keys.len()).unwrap_or(u32::MAX),
            ready,
            rank,
            ladder: Ladder::of(keys),
            first_byte: false,
            withdrawn: false,
        })
    }

    /// Queues this answer (a first-byte or withdrawn tip) in `pending`: within twice
    /// [`MAX_PENDING_TIPS`], so that claims filling their share never crowd out the answers to
    /// claims already sent.
    pub fn queue_answer(self, pending: &mut Vec<PendingTip>) {
        if pending.len() < 2 * MAX_PENDING_TIPS {
            pending.push(self);
        }
    }

    /// Whether it answers a claim (first byte or withdrawal).
    pub fn is_answer(&self) -> bool {
        self.first_byte || self.withdrawn
    }

    /// This tip withdrawn: its request ended without a first byte.
    pub fn withdrawn(self) -> Self {
        PendingTip {
            withdrawn: true,
            first_byte: false,
            ..self
        }
    }

    /// The tip sent again at the prompt's first byte, ready `now`: its prefill has answered.
    pub fn at_first_byte(
        replica: usize,
        keys: &[BlockKey],
        now: Duration,
        rank: Option<u16>,
    ) -> Option<Self> {
        PendingTip::new(replica, keys, now, rank).map(|t| PendingTip {
            first_byte: true,
            ..t
        })
    }
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
    /// The routing policy (as `PolicyKind::ALL` index; a reload may switch it): read it with
    /// [`Node::policy`].
    pub(super) policy: std::sync::atomic::AtomicU8,
    /// Replica endpoints, by view index (append-only, like the view).
    pub(super) endpoints: RwLock<Vec<Endpoint>>,
    /// HTTP client for replicas (pooled connections).
    pub client: reqwest::Client,
    /// Metric handles.
    pub metrics: Metrics,
    /// Admission queue metrics, per priority class (registered in `metrics.registry`).
    pub queue_metrics: super::admission_queue::QueueMetrics,
    /// KV-event and token-mode metric handles (registered in `metrics.registry`).
    pub kv_metrics: KvMetrics,
    /// Token mode (`[tokenizer]`), when configured and loaded; `None` means text mode.
    pub tokenizer: Option<TokenMode>,
    /// Everything routing reads and writes; take it with [`Node::lock`].
    pub(super) core: Mutex<Core>,
    /// Long prefills in flight and the requests held on them (`[hold]`, `hold.rs`).
    pub holds: super::hold::Holds,
    /// Time zero of the core's clock ([`Node::now`]).
    pub(super) start: Instant,
    /// Tenants by name (isolation and quotas), as configured.
    /// (Replaced by a configuration reload, `reload.rs`.)
    pub(super) tenant_cfgs: RwLock<HashMap<String, TenantConfig>>,
    /// The settings of a tenant not in `tenant_cfgs`.
    pub(super) default_tenant: RwLock<TenantConfig>,
    /// The cluster-wide summary settings (Bloom seed), for every cache model.
    pub(super) summary_cfg: SummaryConfig,
    /// First summary epoch of a new cache model: wall-clock ms at start, so a restarted node's
    /// summaries supersede the previous run's.
    pub(super) epoch_base: u64,
    /// Mesh membership, when the node runs one (see `mesh_state.rs`).
    pub(super) mesh: NodeMesh,
    /// Tokens and API keys read at start (`[auth]`).
    pub secrets: Secrets,
    /// Woken when a hot-prefix candidate becomes plannable, so the planner runs at once rather
    /// than at its next tick (`hot_prefix.rs`).
    pub(super) hot_plan_now: tokio::sync::Notify,
    /// Request bodies held at once, in KiB permits (`server.max_buffered_body_bytes`).
    pub body_budget: tokio::sync::Semaphore,
    /// The first `server.body_fair_share_bytes` of every body, in KiB permits: a quarter of
    /// `max_buffered_body_bytes` more, kept apart so that bodies stalled after filling the main
    /// budget never make a small request wait (`proxy/body.rs`).
    pub body_budget_first: tokio::sync::Semaphore,
    /// Bodies kept by resumable streams after their handler returned (`proxy/resume.rs`), in
    /// KiB permits: a quarter of `max_buffered_body_bytes` more. Taken without waiting; a stream
    /// that finds it spent is not resumable.
    pub resume_body_budget: tokio::sync::Semaphore,
    /// Hedges in flight (`proxy/deliver.rs`): at most a fifth of the requests awaiting response
    /// headers (at least 3) may be hedged at once, so hedging cannot double the load of a fleet
    /// that is slow because it is overloaded.
    pub hedges_in_flight: std::sync::atomic::AtomicI64,
    /// mTLS clients for forwarding to other nodes' peer listeners, one per node (made once the
    /// mesh starts).
    pub forward_clients: super::forward_clients::ForwardClients,
    /// Replicas with a KV-event supervisor (`watchers.rs`), so each gets one: index → the
    /// incarnation it serves (it ends when the replica is dropped or its slot reused).
    pub(super) kv_watched: Mutex<HashMap<usize, u64>>,
    /// Bumped whenever a replica joins, leaves or is dropped (`registry.rs`): KV-event
    /// supervisors wake on it instead of waiting for their next poll.
    pub(super) registry_changed: tokio::sync::watch::Sender<u64>,
    /// Stored responses (OpenAI Responses API) this node has located: response id → the id of
    /// the replica that stores it, at most [`RESPONSE_HOMES`] (`proxy/stored_responses.rs`).
    pub response_homes: Mutex<lru::LruCache<String, String>>,
    /// Stored-response lookups under way (`proxy/stored_responses.rs`): each asks every replica
    /// of the model, so a client naming ids nobody stores would turn one request into hundreds;
    /// past [`RESPONSE_LOOKUPS`] at once a lookup is refused (503) instead.
    pub response_lookups: tokio::sync::Semaphore,
    /// The `[[replicas]]` of the configuration last loaded (`reload.rs` diffs against it).
    pub(super) configured: Mutex<Vec<crate::replicas::entry::ReplicaConfig>>,
    /// Operator commands applied and to publish (`admin.rs`).
    pub(super) admin: Mutex<super::admin_book::AdminBook>,
    /// The node's stop signal, once it runs: replicas added at run time start their watcher
    /// tasks under it.
    pub stop_signal: std::sync::OnceLock<tokio::sync::watch::Receiver<bool>>,
}

/// `kind`'s index in `PolicyKind::ALL` (what [`Node::policy`] stores).
pub(super) fn policy_index(kind: PolicyKind) -> u8 {
    PolicyKind::ALL
        .iter()
        .position(|k| *k == kind)
        .map_or(0, |i| i as u8)
}

fn tokens_to_blocks(tokens: u64, tokens_per_block: u32) -> usize {
    // The cache model clamps it (`MAX_CAPACITY_BLOCKS`); here it only must not wrap.
    usize::try_from((tokens / u64::from(tokens_per_block.max(1))).max(1)).unwrap_or(usize::MAX)
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
    /// The node's state from a validated config, with no replica registered yet
    /// (`Node::new` in `registry.rs` registers the configured ones).
    pub(super) fn empty(cfg: NodeConfig) -> anyhow::Result<Arc<Node>> {
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
        // Peers send the tip keys: seed their table with what no peer knows.
        view.peer_tips = PeerTips::with_cap(view.peer_tips.cap(), rand::random());
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
                forward_by: cfg.forward_by,
                remote_prefix: cfg.remote_prefix,
                recompute_charge_per_s: cfg.recompute_charge_per_s,
                evict_charge: cfg.evict_charge,
                // Riders on a prompt they extend are held until its first byte (`hold.rs`).
                ride_extensions: cfg.hold.enabled,
                ride_extension_min_tokens: cfg.hold.min_prefill_tokens,
                shared_load: cfg
                    .mesh
                    .as_ref()
                    .is_none_or(|m| m.load_share_interval_ms > 0),
                cost: CostModel {
                    w_load_s: cfg.w_load_s,
                    affinity_credit_s: cfg.affinity_credit_s,
                    tier_weights: cfg.tier_weights,
                    fetch: cfg.kv_fetch,
                },
            },
            Tenants::new(cfg.tenants.clone(), cfg.default_tenant.clone()),
        );
        // HTTP/1.1 to engines, as they speak it (reqwest's HTTP/2, on for the peer client,
        // would otherwise be offered to any engine behind TLS).
        let client = reqwest::Client::builder()
            .http1_only()
            .connect_timeout(cfg.connect_timeout())
            .tcp_nodelay(true)
            .pool_idle_timeout(Duration::from_secs(90))
            .build()?;
        let metrics = Metrics::new()?;
        let kv_metrics = KvMetrics::new(&metrics.registry)?;
        let queue_metrics = super::admission_queue::QueueMetrics::new(&metrics.registry)?;
        let start = Instant::now();
        let holds =
            super::hold::Holds::new(cfg.hold.rule(tokens_per_block), start, &metrics.registry)?;
        let secrets = cfg.auth.load(cfg.admin_token.as_deref(), cfg.listen)?;
        let body_kib = usize::try_from(cfg.server.max_buffered_body_bytes >> 10)
            .unwrap_or(usize::MAX)
            .min(tokio::sync::Semaphore::MAX_PERMITS);
        let node = Arc::new(Node {
            policy: std::sync::atomic::AtomicU8::new(policy_index(policy)),
            endpoints: RwLock::new(Vec::with_capacity(cfg.replicas.len())),
            client,
            metrics,
            kv_metrics,
            queue_metrics,
            holds,
            tokenizer,
            core: Mutex::new(Core {
                view,
                router,
                replicas: Vec::with_capacity(cfg.replicas.len()),
                peer_loads: PeerLoads::new(LoadShareConfig::default()),
                pending_tips: Vec::new(),
                hot: HotPrefixes::new(cfg.hot_prefix.clone()),
                heads: None,
                empty_holders: crate::core::empty_holders::EmptyHolders::new(),
                reclaimed_drains: lru::LruCache::new(MAX_RECLAIMED_DRAINS),
                hot_owners: Vec::new(),
                hot_self: String::new(),
                admission: cfg
                    .priorities
                    .as_ref()
                    .map(|p| AdmissionQueue::new(p.classes.clone())),
            }),
            start,
            tenant_cfgs: RwLock::new(cfg.tenants.clone()),
            default_tenant: RwLock::new(cfg.default_tenant.clone()),
            summary_cfg,
            epoch_base,
            mesh: NodeMesh::default(),
            secrets,
            hot_plan_now: tokio::sync::Notify::new(),
            body_budget: tokio::sync::Semaphore::new(body_kib),
            body_budget_first: tokio::sync::Semaphore::new(body_kib / 4),
            resume_body_budget: tokio::sync::Semaphore::new(body_kib / 4),
            hedges_in_flight: std::sync::atomic::AtomicI64::new(0),
            forward_clients: Default::default(),
            kv_watched: Mutex::new(HashMap::new()),
            registry_changed: tokio::sync::watch::Sender::new(0),
            response_homes: Mutex::new(lru::LruCache::new(RESPONSE_HOMES)),
            response_lookups: tokio::sync::Semaphore::new(RESPONSE_LOOKUPS),
            configured: Mutex::new(cfg.replicas.clone()),
            admin: Mutex::new(super::admin_book::AdminBook::default()),
            stop_signal: std::sync::OnceLock::new(),
            cfg,
        });
        Ok(node)
    }

    /// The routing policy now.
    pub fn policy(&self) -> PolicyKind {
        let i = self.policy.load(std::sync::atomic::Ordering::Relaxed);
        PolicyKind::ALL
            .get(usize::from(i))
            .copied()
            .unwrap_or(PolicyKind::P2cCache)
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

    pub(super) fn id_of(&self, i: usize) -> Arc<str> {
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
        let configs = self.tenant_cfgs.read().unwrap_or_else(|p| p.into_inner());
        match tenant.and_then(|t| configs.get(t)) {
            Some(c) => c.isolated,
            None => {
                drop(configs);
                self.default_tenant
                    .read()
                    .unwrap_or_else(|p| p.into_inner())
                    .isolated
            }
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
