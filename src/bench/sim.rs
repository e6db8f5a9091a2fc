//! `kvmesh sim`: a discrete-event simulation of router nodes and engine replicas in virtual time.
//!
//! It drives the *same* code as the live system: every node is a [`View`] + [`Router`] from the
//! core, every replica an [`Engine`] from the engine model, every home-node cache model a
//! [`CacheModel`]. What it models instead of running:
//! - gossip: loads and summaries reach each node late, by its round phase plus the rounds a
//!   push-pull epidemic with the configured fan-out takes to reach it (see [`super::sim_gossip`]);
//! - a routed request's blocks reach its replica's home cache model when its prefill completes
//!   (its first token): that is when the engine holds them, and what a KV-event (exact) model
//!   sees; the routing node's own overlay counts them from the predicted end of that prefill
//!   ([`View::record_routed_ready`]), before its stale view has the summary;
//! - regions: nodes and replicas are dealt to `regions` regions in turn, regions lie on a line
//!   `region_rtt` apart; a node holds summaries of its own region's replicas only, routes there,
//!   and forwards (one hop, one round trip more) when the core says so;
//! - the gossip layout (`gossip_layout`, `sim_bytes.rs` for its bytes): `flat`, every node
//!   hears every replica's load over one epidemic of all nodes; `regional`, a node hears its own
//!   region's replicas over an epidemic of the region's nodes only, and every other region as one
//!   region record (`core::region_offer`) that the region's representative builds from its own
//!   view every `region_interval` (heads: the region's most routed prefixes its summaries hold)
//!   and that reaches the node through the representatives' cluster, then its own region's
//!   (`sim_gossip::region_record_source`); other regions' replicas are hidden from its view;
//! - clients: each request of the workload arrives at a uniformly random live node;
//! - node failures: a failed node takes no more requests; requests it was proxying are lost
//!   (errors); the replicas it was home for keep their last published load and summary until the
//!   others detect the failure (`failure_detection`), then a new home (rendezvous over the
//!   region's live nodes) starts a fresh cache model in a new epoch.
//! - with `exact_homes`, homes keep exact cache models from the engines' KV events, tiers
//!   included (`sim_exact.rs`), instead of approximate ones from routed requests;
//! - tenant KV shares (`max_kv_share`): the home's cache model attributes each routed request's
//!   blocks to its tenant, as a live home does with its own requests and its peers' block
//!   reports (which carry the tenant, `node::kv_shares`), and the shares travel with the
//!   summary, a gossip round late, as in the replica's gossip record;
//! - data-parallel ranks (`dp_ranks`): a replica is N engines with a prefix cache each
//!   (`engine_sim::DpEngine`); the router picks the replica as usual, then either names the
//!   rank from the ranks' caches and queues (as a home with KV events does, without the events'
//!   lag) or leaves it to the replica's balancer (fewest in flight).
//! - hot-prefix replication (`hot_prefix.enabled`): every node counts what it routes in its
//!   own `core::hot_prefix` detector; their heavy hitters travel once per gossip round (like
//!   the live `hot` record); every load publication each node plans, and the warm-ups of the
//!   prefixes it owns (rendezvous over its region's live nodes) go to the engines as
//!   prefill-only requests, counted in the node's view, its peers' (load sharing) and the
//!   home's cache model as a routed request is.
//!
//! What a node knows, as a live node knows it: its own routing at once; the other nodes' of its
//! region `load_share_delay` later (load sharing); the engines' waiting/running/KV usage as their
//! homes scrape them every `scrape_interval`, then by gossip; summaries by gossip. Nobody reads
//! an engine's true queue.
//!
//! The `central-greedy` reference is one central router with exact, instant knowledge: for every
//! arrival it reads each engine's actual prefix cache and pending prefill, and picks the replica
//! with the lowest predicted time to first token (same cost formula as the core, plus the round
//! trip to the replica's region). No summaries, no staleness, no false positives — but greedy:
//! policies can beat it, so it is a reference, not a bound (`sim_bound.rs` is the bound).
//! Deterministic for a seed.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::sim_bytes::{GossipByteModel, GossipLayout, MeshShape, NodeBytes, REPRESENTATIVES};
use super::sim_classes::ClassStats;
pub use super::sim_classes::{class_label, class_stats};
pub use super::sim_config::{GroupStats, NodeFailure, SimConfig, SimError, SimReport, TenantSplit};
use super::sim_exact::ExactFeed;
use super::sim_gossip::{epidemic_hops, region_record_source, NodeLag, Published};
use super::sim_pd::{itl, submit_decode, Leg, PdStats};
use super::stats::{max_over_mean, Distribution};
use super::trace::BYTES_PER_TOKEN;
use super::workload::WorkloadRequest;
use crate::core::admission::{AdmissionQueue, RejectReason as QueueReject};
use crate::core::cache_model::{CacheModel, CacheModelConfig, CacheSource};
use crate::core::dp_rank::MAX_RANKS;
use crate::core::hot_prefix::{Action, HotPrefixes, Observed, WarmScope, WarmUp};
use crate::core::keys::{text_block_keys, BlockKey, Namespace};
use crate::core::pd::{self, PdChoice, WholeReason};
use crate::core::peer_tips::{Ladder, Tip};
use crate::core::policy::PolicyKind;
use crate::core::priority::resolve;
use crate::core::region_choice::build_offer;
use crate::core::region_offer::{RecentHeads, RegionOffer, MAX_RECENT_HEADS, MAX_REGION_HEADS};
use crate::core::router::{Decision, KvSteer, RouteRequest, Router, RouterConfig};
use crate::core::summary::{ReplicaSummary, SummaryConfig};
use crate::core::tenants::{TenantConfig, Tenants, KV_SLOTS};
use crate::core::view::{Health, ReplicaInfo, View};
use crate::engine_sim::prefix_cache::block_hashes;
use crate::engine_sim::{tokenize, DpEngine, Output, RankPick, Request};
use crate::mesh::home::home_node;

const MODEL: &str = "sim-llama-8b";

/// The report name of the central greedy reference router (`SimConfig::oracle`).
pub const CENTRAL_GREEDY: &str = "central-greedy";

/// Load publications per gossip interval (home nodes scrape more often than chitchat rounds).
const LOAD_PUBLICATIONS_PER_INTERVAL: u32 = 4;

/// Candidate heads a representative checks against its region's summaries per record: the
/// most routed prefixes, twice what a record keeps, so heads the region no longer holds leave
/// room for the next.
const HEAD_CANDIDATES: usize = 2 * MAX_REGION_HEADS;

/// Push-pull epidemics run to measure how many rounds news takes to reach a node.
const EPIDEMIC_TRIALS: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrival(usize),
    EngineWake(usize),
    /// The fleet's loads (and every `LOAD_PUBLICATIONS_PER_INTERVAL`-th time, summaries) are
    /// published; the counter says which publication this is.
    Publish(u64),
    NodeDown(usize),
    /// The failure of this node is detected: its replicas get new homes.
    Rehome(usize),
    /// A request waiting in this node's admission queue reaches its deadline.
    QueueDeadline(usize),
    /// A pair's KV has crossed the link: the request enters its decode engine.
    Transfer(usize),
}

/// One replica's load as its home scrapes and publishes it.
#[derive(Clone, Copy, Debug, Default)]
struct LoadSample {
    waiting: u32,
    running: u32,
    kv_usage: f32,
}

/// A change of one node's load at one replica, on its way to the region's other nodes.
#[derive(Clone, Copy, Debug)]
struct Share {
    /// When the others see it.
    at: Duration,
    origin: usize,
    replica: usize,
    in_flight: i32,
    pending_tokens: i64,
    /// A routed prefix: its last block key, blocks, when its prefill is predicted done, and
    /// the shorter prefixes it names (as the live node's load update carries them).
    tip: Option<(BlockKey, u32, Duration, Ladder)>,
}

impl Share {
    /// Names the prompt of `keys` as routed (ready at `ready`).
    fn set_tip(&mut self, keys: &[BlockKey], ready: Duration) {
        if let Some(last) = keys.last() {
            self.tip = Some((*last, keys.len() as u32, ready, Ladder::of(keys)));
        }
    }
}

/// A router node: where it lives, how late it hears, and (unless in oracle mode) its view.
struct SimNode {
    region: usize,
    lag: NodeLag,
    /// With the regional layer: the phase and hops of its region's representatives in the
    /// representatives' cluster, through which other regions' state reaches it.
    layer: Option<NodeLag>,
    live: bool,
    routing: Option<NodeRouting>,
}

struct NodeRouting {
    view: View,
    router: Router,
    /// Publication time of the loads the view holds (of its own region's replicas, with the
    /// regional layer; of every replica, flat).
    synced: Option<Duration>,
    /// With the regional layer: publication time of the region records (offers) it holds.
    offers_synced: Option<Duration>,
    /// The hot-prefix detector (replication on).
    hot: Option<HotPrefixes>,
    /// Publication time of the peers' heavy hitters it last applied.
    hot_synced: Option<Duration>,
    /// Requests (by index) waiting for a slot, with `SimConfig::priorities`.
    admission: Option<AdmissionQueue<usize>>,
}

/// What routing one request at its node came to.
enum Routing {
    /// Sent: the serving node, the replica, its believed hit and the round trips added.
    Sent(usize, usize, u32, Duration),
    /// Waiting in this node's admission queue; `true` when the node has room (the queue's head
    /// takes it).
    Queued(usize, bool),
    /// Refused by the admission queue.
    Refused(QueueReject),
    /// Failed (no replica, or refused by the router).
    Failed,
}

/// A warm-up an engine is running (engine request id = workload length + its index).
struct WarmFlight {
    node: usize,
    key: u64,
    replica: usize,
    keys: Vec<BlockKey>,
    uncached: u64,
    /// Not finished and not cancelled.
    live: bool,
}

/// Every live node's gossiped heavy hitters at one publication: (node, region, entries).
type HotTops = Arc<Vec<(usize, usize, Vec<(u64, f32)>)>>;

#[derive(Clone, Copy, Default)]
struct InFlight {
    arrival: Duration,
    node: usize,
    replica: usize,
    uncached_tokens: u64,
    /// Round trips added on the way (cross-region forward or replica).
    extra: Duration,
    /// Submitted to an engine and not finished.
    active: bool,
    /// Its node failed while it ran: the client lost it.
    lost: bool,
    /// Whole, or which leg of a pair (`sim_pd.rs`).
    leg: Leg,
    /// Its time to first token, seconds, once known (for the inter-token latency).
    ttft_s: f64,
}

type Queue = BinaryHeap<Reverse<(Duration, u64, Event)>>;

/// Latest virtual time a run may reach (about 31 years): arrivals or failures past it are a
/// configuration error, not an overflow.
const MAX_VIRTUAL_TIME: Duration = Duration::from_secs(1_000_000_000);

/// Per-request evidence for `RUST_LOG=kvmesh::bench::sim=debug`: what the decision for request
/// `id` predicted, to hold against its `first token` line (and its `kv pull` line, if any).
fn log_routed(id: usize, d: &crate::core::router::Routed) {
    tracing::debug!(
        target: "kvmesh::bench::sim",
        id,
        replica = d.replica,
        runner_up = d.runner_up,
        hit_blocks = d.hit_blocks,
        best_hit_blocks = d.best_hit_blocks,
        predicted_s = d.predicted_s,
        reason = ?d.reason,
        fetch_source = d.fetch.map(|f| f.source),
        "routed"
    );
}

/// When request `r` arrives, its workload time divided by `speedup`.
fn arrival_time(r: &WorkloadRequest, speedup: f64) -> Result<Duration, SimError> {
    Duration::try_from_secs_f64(r.at_s.max(0.0) / speedup)
        .ok()
        .filter(|t| *t <= MAX_VIRTUAL_TIME)
        .ok_or_else(|| {
            SimError::Config(format!(
                "arrival at {} s ÷ speedup {speedup} is out of range",
                r.at_s
            ))
        })
}

/// Runs the simulation of `workload` under `cfg`. Sessions and tenants of the workload reach the
/// router as they would through the headers.
pub fn run(workload: &[WorkloadRequest], cfg: &SimConfig) -> Result<SimReport, SimError> {
    cfg.validate()?;
    let reqs = &workload[..cfg
        .max_requests
        .unwrap_or(workload.len())
        .min(workload.len())];
    let mut sim = Sim::new(reqs, cfg)?;
    let mut first = None;
    for (i, r) in reqs.iter().enumerate() {
        let at = arrival_time(r, cfg.arrival_speedup)?;
        first.get_or_insert(at);
        sim.push(at, Event::Arrival(i));
    }
    let first = first.unwrap_or_default();
    for f in &cfg.failures {
        let at = first.checked_add(f.at).filter(|t| *t <= MAX_VIRTUAL_TIME);
        let at = at.ok_or_else(|| SimError::Config(format!("node {} fails too late", f.node)))?;
        sim.push(at, Event::NodeDown(f.node));
    }
    if !cfg.oracle {
        sim.push(Duration::ZERO, Event::Publish(0));
    }
    let mut last = Duration::ZERO;
    let mut shown = 0;
    while let Some(Reverse((now, _, ev))) = sim.queue.pop() {
        last = last.max(now);
        if cfg.progress && sim.done * 100 / reqs.len().max(1) > shown {
            shown = sim.done * 100 / reqs.len().max(1);
            eprint!(
                "\r  {}: {shown:>3}% of {} requests done, {:.1} virtual s",
                if cfg.oracle {
                    CENTRAL_GREEDY
                } else {
                    sim.policy.as_str()
                },
                reqs.len(),
                now.saturating_sub(first).as_secs_f64()
            );
            if shown == 100 {
                eprintln!();
            }
        }
        match ev {
            Event::Arrival(i) => sim.arrival(i, now),
            Event::EngineWake(r) => sim.engine_wake(r, now),
            Event::Publish(k) => sim.publish(k, now)?,
            Event::NodeDown(n) => sim.node_down(n, now),
            Event::Rehome(n) => sim.rehome(n)?,
            Event::QueueDeadline(n) => sim.queue_deadline(n, now),
            Event::Transfer(i) => sim.transferred(i, now),
        }
    }
    if cfg.progress && shown < 100 {
        eprintln!();
    }
    Ok(sim.report(last.saturating_sub(first)))
}

/// The state of one run.
struct Sim<'a> {
    cfg: &'a SimConfig,
    reqs: &'a [WorkloadRequest],
    policy: PolicyKind,
    tokens_per_block: u32,
    prefill_rate: f64,
    summary_cfg: SummaryConfig,
    queue: Queue,
    order: u64,
    rng: SmallRng,
    hops: Vec<u32>,
    /// Whether the regional layer is simulated (regional layout, several regions): nodes hear
    /// other regions only through region records.
    region_layer: bool,
    /// With the regional layer: how far a representative's view lags its region's true state
    /// when it builds the region's record (the median node's lag).
    rep_lag: Duration,
    /// The oldest news any node may still read is this old (versions older are forgotten).
    max_lag: Duration,
    /// With the regional layer: every region's record (offer), by region index, as its
    /// representative published it, every `region_interval`.
    offers: Published<Arc<Vec<RegionOffer>>>,
    /// When the region records were last published.
    offered: Option<Duration>,
    /// With the regional layer: per region, the live representative's counter of the prefixes
    /// (at power-of-two depths) its routed prompts started with, halved only when full: the
    /// candidates for its heads.
    head_counts: Vec<RecentHeads>,

    nodes: Vec<SimNode>,
    /// Live nodes, by index, in index order (clients pick among them).
    live: Vec<usize>,
    replica_region: Vec<usize>,
    region_replicas: Vec<Vec<usize>>,
    infos: Vec<Arc<ReplicaInfo>>,

    /// Each replica's engines (one per data-parallel rank).
    engines: Vec<DpEngine>,
    scheduled: Vec<Option<Duration>>,
    pending_prefill: Vec<u64>,
    /// The home node's cache model of each replica.
    models: Vec<CacheModel>,
    /// With `exact_homes`: each replica's KV-event feed into its model (else empty).
    exact: Vec<ExactFeed>,
    home: Vec<Option<usize>>,
    /// The replica's home has failed and nobody noticed yet: nothing new is published for it.
    orphaned: Vec<bool>,
    loads: Published<Vec<LoadSample>>,
    /// When the engines were last scraped.
    scraped: Option<Duration>,
    summaries: Vec<Published<Arc<ReplicaSummary>>>,
    /// When each replica's home last published a summary version (the throttle of
    /// `replica_load_interval`).
    summary_published_at: Vec<Option<Duration>>,
    /// Tenant KV shares of each replica as its home publishes them (only while some tenant
    /// has a KV quota).
    kv_shares: Vec<Published<Arc<[f32]>>>,
    /// The tenant policies, for the KV slot of each request's blocks.
    tenants: Tenants,
    /// Requests a KV quota steered.
    kv_steered: usize,
    /// Requests over their KV quota everywhere that overflowed (`KvSteer::Overflowed`).
    kv_overflowed: usize,
    /// The fetch the last `Routing::Sent` decision planned (`[kv_fetch]`), for `dispatch`.
    last_fetch: Option<crate::core::kv_fetch::KvFetchPlan>,
    /// Pulls planned, pulls that found nothing at their source, and prompt tokens moved.
    kv_fetch: super::sim_config::FetchStats,
    /// Load changes in flight between nodes, oldest first (one delay for all, so in time order).
    shares: VecDeque<Share>,

    flights: Vec<InFlight>,
    /// When each request arrived (it may be sent later, from an admission queue).
    arrived: Vec<Duration>,
    /// Requests the admission queue refused, and why.
    refused: Vec<Option<QueueReject>>,
    /// Block keys of each request until its first token, when they join the home's cache model.
    routed_keys: Vec<Vec<BlockKey>>,
    ttft: Vec<f64>,
    /// Per request: (time to first token or NaN, prompt tokens, cached tokens), for the tenant
    /// split.
    per_request: Vec<(f64, u64, u64)>,
    latency: Vec<f64>,
    itl: Vec<f64>,
    /// Pairs' prompts, from arrival until they enter their decode engine.
    pd_prompts: std::collections::HashMap<usize, Vec<u32>>,
    pd: PdStats,
    transfers: Vec<f64>,
    prompt_tokens: u64,
    cached_tokens: u64,
    errors: usize,
    lost: usize,
    cross_region: usize,
    forwarded: usize,
    rehomed: usize,
    /// Requests finished by an engine or failed before reaching one.
    done: usize,
    per_replica: Vec<u64>,
    text: String,
    keys: Vec<BlockKey>,
    /// Hot-prefix replication: the nodes' heavy hitters as gossip carries them.
    hot_tops: Published<HotTops>,
    warms: Vec<WarmFlight>,
    warmup_tokens: u64,
    warmups_cancelled: u64,
    hot_max: usize,
}

/// The name of simulated region `g`.
fn region_name(g: usize) -> String {
    format!("region-{g}")
}

/// The simulated fleet's replica records, as a node would learn them: `replica-{i}` in region
/// `i % regions`, the engine preset's rates (`prefill_rate`: one rank's tokens per second) times
/// its `ranks` data-parallel ranks.
fn replica_infos(cfg: &SimConfig, ranks: usize, prefill_rate: f64) -> Vec<Arc<ReplicaInfo>> {
    (0..cfg.replicas)
        .map(|i| {
            Arc::new(ReplicaInfo {
                id: format!("replica-{i}"),
                url: format!("sim://replica-{i}"),
                region: region_name(i % cfg.regions),
                zone: String::new(),
                pool: "shared".into(),
                models: vec![MODEL.into()],
                capacity_tokens: (cfg.engine.kv_capacity_tokens * ranks) as u64,
                prefill_tokens_per_s: prefill_rate * ranks as f64,
                prefill_attention_ms_per_pair: cfg.engine.prefill_attention_ms_per_pair,
                max_in_flight: cfg.max_in_flight.unwrap_or(cfg.engine.max_num_seqs as u32),
                pd: crate::core::role::PdFacts {
                    role: cfg
                        .pd
                        .as_ref()
                        .and_then(|p| p.roles.get(i).copied())
                        .unwrap_or_default(),
                    ..Default::default()
                },
                kv_load: cfg.kv_load,
            })
        })
        .collect()
}

/// Node `n`'s routing state (`scope` = its index, its region, whether gossip is regional): a view
/// of the fleet (other regions' replicas hidden behind their offers when regional), its router,
/// hot-prefix tracker and admission queue.
fn node_routing(
    cfg: &SimConfig,
    policy: PolicyKind,
    (n, region, region_layer): (usize, usize, bool),
    infos: &[Arc<ReplicaInfo>],
    tokens_per_block: u32,
) -> NodeRouting {
    let mut view = View::new(region_name(region), tokens_per_block);
    for a in 0..cfg.regions {
        for b in a + 1..cfg.regions {
            let ms = cfg.rtt(a, b).as_secs_f64() * 1000.0;
            view.regions.configure(&region_name(a), &region_name(b), ms);
        }
    }
    for (r, info) in infos.iter().enumerate() {
        view.upsert(Arc::clone(info));
        // A regional node has no record of other regions' replicas, only their
        // regions' offers: the view keeps their slots (indexes are the fleet's)
        // but neither the router nor `choose_region` may see them.
        if region_layer && r % cfg.regions != region {
            view.set_health(r, Health::Unhealthy);
        }
    }
    let rc = RouterConfig {
        policy,
        seed: cfg.seed.wrapping_add(n as u64),
        cost: cfg.cost,
        forward_by: cfg.forward_by,
        remote_prefix: cfg.remote_prefix,
        shared_load: cfg.load_share_delay.is_some() || cfg.nodes <= 1,
        evict_charge: cfg.evict_charge,
        ..Default::default()
    };
    NodeRouting {
        view,
        router: Router::new(rc, tenants(cfg)),
        synced: None,
        offers_synced: None,
        hot: cfg
            .hot_prefix
            .enabled
            .then(|| HotPrefixes::new(cfg.hot_prefix.clone())),
        hot_synced: None,
        admission: cfg
            .priorities
            .as_ref()
            .map(|p| AdmissionQueue::new(p.classes.clone())),
    }
}

impl<'a> Sim<'a> {
    fn new(reqs: &'a [WorkloadRequest], cfg: &'a SimConfig) -> Result<Self, SimError> {
        let policy = if cfg.oracle {
            PolicyKind::CacheArgmin
        } else {
            cfg.policy
        };
        let tokens_per_block = (cfg.block_bytes / BYTES_PER_TOKEN).max(1) as u32;
        let summary_cfg = SummaryConfig::for_cluster("sim");
        let ranks = cfg.dp_ranks.clamp(1, MAX_RANKS);
        // One rank's; a replica of several prefills on all of them at once.
        let prefill_rate = 1000.0 / cfg.engine.prefill_ms_per_token.max(1e-9);
        let mut rng = SmallRng::seed_from_u64(cfg.seed);

        let infos = replica_infos(cfg, ranks, prefill_rate);
        let replica_region: Vec<usize> = (0..cfg.replicas).map(|r| r % cfg.regions).collect();
        let mut region_replicas = vec![Vec::new(); cfg.regions];
        for (r, g) in replica_region.iter().enumerate() {
            region_replicas[*g].push(r);
        }

        let lags = gossip_lags(cfg, &mut rng);
        let nodes = sim_nodes(cfg, policy, &lags, &infos, tokens_per_block, &mut rng);

        let capacity_blocks = model_capacity(cfg) * ranks / tokens_per_block as usize;
        let models = (0..cfg.replicas)
            .map(|_| new_model(capacity_blocks, 1, &summary_cfg, cfg.exact_homes))
            .collect::<Result<Vec<_>, _>>()?;
        let rank_pick = if cfg.dp_rank_named {
            RankPick::Named {
                w_load_s: cfg.cost.w_load_s,
            }
        } else {
            RankPick::Balancer
        };
        let (engine_cfg, exact) = exact_feeds(cfg, tokens_per_block)?;
        let mut sim = Sim {
            cfg,
            reqs,
            policy,
            tokens_per_block,
            prefill_rate,
            summary_cfg,
            queue: BinaryHeap::new(),
            order: 0,
            rng,
            hops: lags.hops,
            region_layer: lags.region_layer,
            rep_lag: lags.rep_lag,
            max_lag: lags.max_lag,
            offers: Published::default(),
            offered: None,
            head_counts: (0..if lags.region_layer { cfg.regions } else { 0 })
                .map(|_| RecentHeads::new(MAX_RECENT_HEADS))
                .collect(),
            live: (0..cfg.nodes).collect(),
            nodes,
            replica_region,
            region_replicas,
            infos,
            engines: (0..cfg.replicas)
                .map(|_| DpEngine::new(engine_cfg.clone(), ranks, rank_pick))
                .collect(),
            exact,
            scheduled: vec![None; cfg.replicas],
            pending_prefill: vec![0; cfg.replicas],
            models,
            home: vec![None; cfg.replicas],
            orphaned: vec![false; cfg.replicas],
            loads: Published::default(),
            scraped: None,
            summaries: (0..cfg.replicas).map(|_| Published::default()).collect(),
            summary_published_at: vec![None; cfg.replicas],
            kv_shares: (0..cfg.replicas).map(|_| Published::default()).collect(),
            tenants: tenants(cfg),
            kv_steered: 0,
            kv_overflowed: 0,
            last_fetch: None,
            kv_fetch: Default::default(),
            shares: VecDeque::new(),
            flights: vec![InFlight::default(); reqs.len()],
            arrived: vec![Duration::ZERO; reqs.len()],
            refused: vec![None; reqs.len()],
            routed_keys: vec![Vec::new(); reqs.len()],
            ttft: Vec::with_capacity(reqs.len()),
            per_request: vec![(f64::NAN, 0, 0); reqs.len()],
            latency: Vec::with_capacity(reqs.len()),
            itl: Vec::with_capacity(reqs.len()),
            pd_prompts: Default::default(),
            pd: PdStats::default(),
            transfers: Vec::new(),
            prompt_tokens: 0,
            cached_tokens: 0,
            errors: 0,
            lost: 0,
            cross_region: 0,
            forwarded: 0,
            rehomed: 0,
            done: 0,
            per_replica: vec![0; cfg.replicas],
            text: String::new(),
            keys: Vec::new(),
            hot_tops: Published::default(),
            warms: Vec::new(),
            warmup_tokens: 0,
            warmups_cancelled: 0,
            hot_max: 0,
        };
        for r in 0..cfg.replicas {
            sim.home[r] = sim.home_of(r);
        }
        Ok(sim)
    }

    fn push(&mut self, t: Duration, e: Event) {
        self.order += 1;
        self.queue.push(Reverse((t, self.order, e)));
    }

    /// The names of region `g`'s live nodes, as the rendezvous hash takes them (`node-N`).
    fn region_node_ids(&self, g: usize) -> Vec<String> {
        self.live
            .iter()
            .filter(|n| self.nodes[**n].region == g)
            .map(|n| format!("node-{n}"))
            .collect()
    }

    /// The rendezvous home of replica `r` among its region's live nodes.
    fn home_of(&self, r: usize) -> Option<usize> {
        let ids = self.region_node_ids(self.replica_region[r]);
        let home = home_node(&self.infos[r].id, ids.iter().map(String::as_str))?;
        home.strip_prefix("node-")?.parse().ok()
    }

    /// The live node a new request arrives at: any, or with `entry_weights`, a node of a region
    /// drawn by its weight (any live node when that region has none).
    fn entry_node(&mut self) -> usize {
        let weights = &self.cfg.entry_weights;
        let total: f64 = weights.iter().filter(|w| w.is_finite() && **w > 0.0).sum();
        if total > 0.0 {
            let mut x = self.rng.random::<f64>() * total;
            let mut region = None;
            for (g, w) in weights.iter().enumerate() {
                if !(w.is_finite() && *w > 0.0) {
                    continue;
                }
                region = Some(g);
                if x < *w {
                    break;
                }
                x -= *w;
            }
            if let Some(g) = region {
                let here: Vec<usize> = self
                    .live
                    .iter()
                    .copied()
                    .filter(|n| self.nodes[*n].region == g)
                    .collect();
                if !here.is_empty() {
                    return here[self.rng.random_range(0..here.len())];
                }
            }
        }
        self.live[self.rng.random_range(0..self.live.len())]
    }

    fn arrival(&mut self, i: usize, now: Duration) {
        if self.live.is_empty() {
            self.fail_early();
            return;
        }
        let client = self.entry_node();
        self.arrived[i] = now;
        self.dispatch(i, client, now, true);
    }

    /// Routes request `i` through `client` and submits it; with `may_queue`, it may wait in
    /// the node's admission queue instead (a request leaving the queue routes without).
    fn dispatch(&mut self, i: usize, client: usize, now: Duration, may_queue: bool) {
        let reqs = self.reqs;
        let req = &reqs[i];
        self.deliver_shares(now);
        req.write_prompt(&mut self.text);
        self.keys.clear();
        let ns = Namespace::new(MODEL, None, None, None);
        text_block_keys(
            ns,
            self.text.as_bytes(),
            self.cfg.block_bytes,
            &mut self.keys,
        );
        let prompt = tokenize(&self.text);
        let client_region = self.nodes[client].region;

        let mut decode = None;
        let (node, r, uncached, mut extra) = if self.cfg.oracle {
            let (r, uncached) = self.oracle_pick(&prompt, client_region);
            (client, r, uncached, Duration::ZERO)
        } else {
            let (node, r, hit_blocks, extra) =
                match self.route(client, i, prompt.len(), now, may_queue, &mut decode) {
                    Routing::Sent(node, r, hit, extra) => (node, r, hit, extra),
                    Routing::Queued(node, room) => {
                        if room {
                            self.admit_next(node, now);
                        }
                        return;
                    }
                    Routing::Refused(why) => {
                        self.refused[i] = Some(why);
                        self.done += 1;
                        return;
                    }
                    Routing::Failed => {
                        self.fail_early();
                        return;
                    }
                };
            let hit_tokens = u64::from(hit_blocks) * u64::from(self.tokens_per_block);
            (
                node,
                r,
                (prompt.len() as u64).saturating_sub(hit_tokens),
                extra,
            )
        };
        // A planned pull: what arrives is not recomputed, and the prefix is there only once the
        // transfer is through as well.
        let pulled = self
            .last_fetch
            .take()
            .and_then(|f| self.pulled(i, r, f, &prompt, now));
        // The pulled tokens are booked as recomputed, as the live node books them
        // (`node::routing` books the chosen replica's own hit): in the overlay's prediction
        // (the first token confirms the blocks sooner) and as queued prefill until the first
        // token. Crediting the pull's shorter time made requests follow blocks still in
        // transfer and recompute them (burst window p99 ×2); booking only the tokens left after
        // the pull made the target look idle while it waited for the transfer, so the next
        // request's prefill went there first and delayed the pull's (burst seed 2: a pull
        // predicted 0.033 s took 0.082 s behind a 2,263-token prefill routed 20 ms later).
        let replica_region = self.replica_region[r];
        extra += self.cfg.rtt(self.nodes[node].region, replica_region);
        if replica_region != client_region {
            self.cross_region += 1;
        }
        let cached = (prompt.len() as u64).saturating_sub(uncached);
        let plan_now = self.book_at_node(node, r, decode, cached, uncached, now);
        if let Some(counts) = self.head_counts.get_mut(replica_region) {
            counts.record(&self.keys);
        }
        self.routed_keys[i].clone_from(&self.keys);
        self.pending_prefill[r] += uncached;
        self.flights[i] = InFlight {
            arrival: self.arrived[i],
            node,
            replica: r,
            uncached_tokens: uncached,
            extra,
            lost: false,
            active: false,
            leg: decode.map_or(Leg::Whole, |decode| Leg::Prefill { decode }),
            ttft_s: f64::NAN,
        };
        let hashes =
            (!self.exact.is_empty()).then(|| block_hashes(&prompt, self.cfg.engine.block_tokens));
        if decode.is_some() {
            self.pd_prompts.insert(i, prompt.clone());
        }
        let request = Request {
            id: i as u64,
            prompt,
            // A prefill leg generates one token, as vLLM's proxies ask of it.
            max_tokens: if decode.is_some() {
                1
            } else {
                req.output_tokens.max(1)
            },
            cache_salt: None,
        };
        let submitted = match pulled {
            Some(f) => self.engines[r].submit_fetched(request, now, f),
            None => self.engines[r].submit(request, now),
        };
        if submitted.is_err() {
            self.dispatch_failed(i, node, r, decode, uncached, now);
            return;
        }
        self.flights[i].active = true;
        if let (Some(feed), Some(h)) = (self.exact.get_mut(r), hashes) {
            feed.learn(&h, &self.keys);
        }
        self.per_replica[r] += 1;
        self.schedule(r);
        if plan_now {
            // As the live node: a candidate just became plannable, plan at once.
            self.plan_hot(node, now);
        }
    }

    /// Books the `uncached` tokens just sent to replica `r` (a pull's counted as recomputed) in
    /// the routing node's view as the live node does (`node::routing`): the overlay from the
    /// prefill's predicted end (after the `cached` tokens it reuses), the queued prefill,
    /// hot-prefix counts, the load shared with the
    /// region's peers, and a P/D pair's decode leg. True when the request made a hot-prefix
    /// candidate plannable ([`HotPrefixes::observe`]).
    fn book_at_node(
        &mut self,
        node: usize,
        r: usize,
        decode: Option<usize>,
        cached: u64,
        uncached: u64,
        now: Duration,
    ) -> bool {
        let mut plannable = false;
        if let Some(nr) = self.nodes[node].routing.as_mut() {
            // Its blocks count in this node's overlay once its prefill is predicted done.
            let ready_in = nr.view.replica(r).map_or(0.0, |rep| {
                nr.router
                    .config()
                    .cost
                    .prefill_done_after_s(rep, cached, uncached)
            });
            let ready_in =
                Duration::try_from_secs_f64(ready_in.clamp(0.0, 3600.0)).unwrap_or_default();
            nr.view.record_routed_ready(r, &self.keys, now, ready_in);
            if let Some(rep) = nr.view.replica_mut(r) {
                rep.load.queued_prefill_tokens += uncached;
            }
            if let Some(h) = nr.hot.as_mut() {
                let req = Observed {
                    model: MODEL,
                    keys: &self.keys,
                    text: Some(&self.text),
                    block_bytes: self.cfg.block_bytes,
                    scope: WarmScope::default(),
                };
                plannable = h.observe(req, now);
                h.credit(uncached);
            }
            self.share(now, node, r, 1, uncached as i64);
            if let Some(s) = self.shares.back_mut() {
                s.set_tip(&self.keys, now + ready_in);
            }
            if let Some(d) = decode {
                // The decode leg, as the live node books it: in flight, its blocks arriving with
                // the hand-over (from the prefill's predicted end).
                if let Some(nr) = self.nodes[node].routing.as_mut() {
                    nr.view.record_routed_ready(d, &self.keys, now, ready_in);
                }
                self.share(now, node, d, 1, 0);
            }
        }
        plannable
    }

    /// The engine refused request `i` at replica `r`: undo what `dispatch` booked (the node's
    /// view and shared load, the pending prefill, a P/D pair's decode leg) and count it failed.
    fn dispatch_failed(
        &mut self,
        i: usize,
        node: usize,
        r: usize,
        decode: Option<usize>,
        uncached: u64,
        now: Duration,
    ) {
        self.pd_prompts.remove(&i);
        if let Some(d) = decode {
            self.decode_gone(node, d, now);
        }
        self.fail_early();
        if let Some(nr) = self.nodes[node].routing.as_mut() {
            nr.view.finished(r);
            if let Some(rep) = nr.view.replica_mut(r) {
                rep.load.queued_prefill_tokens =
                    rep.load.queued_prefill_tokens.saturating_sub(uncached);
            }
            self.share(now, node, r, -1, -(uncached as i64));
        }
        self.pending_prefill[r] = self.pending_prefill[r].saturating_sub(uncached);
    }

    /// The fleet index of the replica the newest region offers name as holding head `key`.
    fn offered_source(&self, key: u64) -> Option<usize> {
        let offers = self.offers.latest()?;
        let h = offers
            .iter()
            .flat_map(|o| &o.holders)
            .find(|h| h.head.key == key)?;
        self.infos.iter().position(|i| i.id == h.id)
    }

    /// What a pull of `plan` (request or warm-up `id`) for replica `r` gets at `now`: the leading
    /// run of the planned blocks its source's engine holds now, arriving after the modelled
    /// transfer — the link between the two (`[kv_fetch] links`), the rest of the source's
    /// current step and the bytes, as the core prices it (`core::kv_fetch`). `None` (counted)
    /// when it holds none.
    fn pulled(
        &mut self,
        id: usize,
        r: usize,
        plan: crate::core::kv_fetch::KvFetchPlan,
        prompt: &[u32],
        now: Duration,
    ) -> Option<crate::engine_sim::Fetched> {
        use crate::core::kv_fetch::Link;
        self.kv_fetch.planned += 1;
        let bs = self.cfg.engine.block_tokens.max(1);
        let hashes = block_hashes(prompt, bs);
        let from = usize::try_from(plan.from_tokens).ok()? / bs;
        let to = (usize::try_from(plan.tokens).ok()? / bs).min(hashes.len());
        // Regional gossip: the holder a region offer names, found by its id in the fleet.
        let source_ix = match plan.offer_key {
            Some(key) => self.offered_source(key)?,
            None => plan.source,
        };
        let source = self.engines.get(source_ix)?;
        let held = if to > from {
            source.cached_prefix_tokens(&hashes[from..to]) / bs
        } else {
            0
        };
        let st = source.stats();
        // The source hands the blocks out when its current step ends (the core predicts a whole
        // step, `kv_fetch::source_step_s`; here the engine's own step end is known).
        let step_s = source
            .next_event_time()
            .map_or(0.0, |end| end.saturating_sub(now).as_secs_f64());
        let target_step_s = self
            .engines
            .get(r)
            .and_then(|e| e.next_event_time())
            .map_or(0.0, |end| end.saturating_sub(now).as_secs_f64());
        // Per-request evidence for `RUST_LOG=kvmesh::bench::sim=debug` (why a pull paid or not).
        tracing::debug!(
            target: "kvmesh::bench::sim",
            id,
            replica = r,
            source = source_ix,
            planned_blocks = to.saturating_sub(from),
            held_blocks = held,
            source_running = st.running,
            source_waiting = st.waiting,
            source_step_s = step_s,
            target_step_s,
            predicted_s = plan.predicted_s,
            "kv pull"
        );
        if held == 0 {
            self.kv_fetch.missed += 1;
            return None;
        }
        let cost = &self.cfg.cost;
        let spec = cost
            .fetch
            .links
            .spec(Link::between(&self.infos[r], &self.infos[source_ix]));
        let tokens = held * bs;
        let bytes = tokens as f64 * self.cfg.engine.kv_bytes_per_token as f64;
        let secs = spec.setup_ms / 1000.0 + step_s + bytes / (spec.gb_per_s.max(1e-6) * 1e9);
        self.kv_fetch.tokens += tokens as u64;
        self.kv_fetch.seconds += secs;
        Some(crate::engine_sim::Fetched {
            from_block: from,
            to_block: from + held,
            transfer: Duration::try_from_secs_f64(secs.clamp(0.0, 3600.0)).unwrap_or_default(),
        })
    }

    /// Routes through `client` (and, if the core forwards, one node of the target region).
    /// Returns the serving node, the replica, its believed hit and the round trips added.
    fn route(
        &mut self,
        client: usize,
        i: usize,
        prompt_tokens: usize,
        now: Duration,
        may_queue: bool,
        decode: &mut Option<usize>,
    ) -> Routing {
        let req = &self.reqs[i];
        let mut node = client;
        let mut extra = Duration::ZERO;
        for forwarded in [false, true] {
            self.sync_view(node, now);
            let rr = RouteRequest {
                model: MODEL,
                keys: &self.keys,
                prompt_tokens: prompt_tokens as u64,
                session: req.session.as_deref(),
                affinity_key: req.affinity.as_deref(),
                tenant: req.tenant.as_deref(),
                forwarded,
                exclude: &[],
            };
            let Some(nr) = self.nodes[node].routing.as_mut() else {
                return Routing::Failed;
            };
            let decision = match &self.cfg.pd {
                None => nr.router.route(&nr.view, &rr, now),
                Some(pd) => match pd::choose(&mut nr.router, &nr.view, &rr, now, &pd.core()) {
                    PdChoice::Pair(p) => {
                        self.pd.pairs += 1;
                        *decode = Some(p.decode);
                        Decision::Route(p.prefill)
                    }
                    PdChoice::Whole { decision, reason } => {
                        if reason == WholeReason::Bypass {
                            self.pd.bypassed += 1;
                        } else {
                            self.pd.whole_other += 1;
                        }
                        decision
                    }
                },
            };
            match decision {
                Decision::Route(d) => {
                    // As the live node does (`node::admission`): a request that finds every
                    // replica full, or others waiting, waits in the node's queue.
                    if let (true, Some(q), Some(p)) = (
                        may_queue && decode.is_none(),
                        nr.admission.as_mut(),
                        &self.cfg.priorities,
                    ) {
                        if d.saturated || !q.is_empty() {
                            let t = nr.router.tenants.config(rr.tenant);
                            let class = resolve(
                                &p.classes,
                                p.default_id(),
                                t.priority.as_deref(),
                                t.max_priority.as_deref(),
                                None,
                            );
                            let weight = t.weight.unwrap_or(1.0);
                            return match q.enqueue(class, rr.tenant, weight, now, i) {
                                Ok(_) => {
                                    let deadline = q.next_deadline();
                                    if let Some(at) = deadline {
                                        self.push(at, Event::QueueDeadline(node));
                                    }
                                    Routing::Queued(node, !d.saturated)
                                }
                                Err((r, _)) => Routing::Refused(r.reason),
                            };
                        }
                    }
                    match d.kv_steer {
                        KvSteer::Steered => self.kv_steered += 1,
                        KvSteer::Overflowed => self.kv_overflowed += 1,
                        KvSteer::Unsteered => {}
                    }
                    log_routed(i, &d);
                    self.last_fetch = d.fetch;
                    return Routing::Sent(node, d.replica, d.hit_blocks, extra);
                }
                Decision::Forward { region, .. } => {
                    let Some(g) = region
                        .strip_prefix("region-")
                        .and_then(|g| g.parse::<usize>().ok())
                    else {
                        return Routing::Failed;
                    };
                    let targets: Vec<usize> = self
                        .live
                        .iter()
                        .copied()
                        .filter(|m| self.nodes[*m].region == g)
                        .collect();
                    if targets.is_empty() {
                        return Routing::Failed;
                    }
                    let to = targets[self.rng.random_range(0..targets.len())];
                    extra += self.cfg.rtt(self.nodes[node].region, g);
                    self.forwarded += 1;
                    node = to;
                }
                Decision::Reject(_) => return Routing::Failed,
            }
        }
        Routing::Failed
    }

    /// A slot freed at `node` (or it found room while others wait): the next request of its
    /// admission queue is sent.
    fn admit_next(&mut self, node: usize, now: Duration) {
        let next = self.nodes[node]
            .routing
            .as_mut()
            .and_then(|nr| nr.admission.as_mut())
            .and_then(|q| q.pop_next(now, |_| true));
        if let Some(left) = next {
            self.dispatch(left.payload, node, now, false);
        }
    }

    /// Requests of `node`'s admission queue whose deadline passed are refused.
    fn queue_deadline(&mut self, node: usize, now: Duration) {
        let expired = self.nodes[node]
            .routing
            .as_mut()
            .and_then(|nr| nr.admission.as_mut())
            .map(|q| q.expire(now))
            .unwrap_or_default();
        for (left, r) in expired {
            self.refused[left.payload] = Some(r.reason);
            self.done += 1;
        }
    }

    fn fail_early(&mut self) {
        self.errors += 1;
        self.done += 1;
    }

    /// Brings node `n`'s view to what gossip has told it by `now`.
    fn sync_view(&mut self, n: usize, now: Duration) {
        let node = &mut self.nodes[n];
        let Some(nr) = node.routing.as_mut() else {
            return;
        };
        // Other regions, with the regional layer: their records (offers) as they reached it,
        // through the representatives' cluster and then its own region's.
        let records = node.layer.as_ref().and_then(|layer| {
            region_record_source(
                &node.lag,
                layer,
                now,
                self.cfg.gossip_interval,
                self.cfg.region_interval,
            )
        });
        if let Some((at, offers)) = records.and_then(|t| self.offers.as_of_timed(t)) {
            if nr.offers_synced != Some(at) {
                nr.offers_synced = Some(at);
                nr.view.remote_regions = offers
                    .iter()
                    .enumerate()
                    .filter(|(g, _)| *g != node.region)
                    .map(|(_, o)| (o.region.clone(), o.clone()))
                    .collect();
            }
        }
        let Some(source) = node.lag.source_time(now, self.cfg.gossip_interval) else {
            return;
        };
        if let (Some(h), Some((at, tops))) = (nr.hot.as_mut(), self.hot_tops.as_of_timed(source)) {
            if nr.hot_synced != Some(at) {
                nr.hot_synced = Some(at);
                for (m, region, top) in tops.iter() {
                    if *m != n && *region == node.region {
                        h.apply_peer(&format!("node-{m}"), top, now);
                    }
                }
            }
        }
        // Shares travel with the summaries, every gossip round (loads only change per scrape).
        if self.tenants.any_kv_quota() {
            for &r in &self.region_replicas[node.region] {
                if let Some(shares) = self.kv_shares[r].as_of(source) {
                    nr.view.set_kv_shares(r, shares);
                }
            }
        }
        let Some((at, loads)) = self.loads.as_of_timed(source) else {
            return;
        };
        if nr.synced == Some(at) {
            return;
        }
        nr.synced = Some(at);
        if self.region_layer {
            // Other regions' replicas are hidden; their offers carry what routing needs.
            for &r in &self.region_replicas[node.region] {
                if let Some(l) = loads.get(r) {
                    set_scraped_load(&mut nr.view, r, l);
                }
            }
        } else {
            for (r, l) in loads.iter().enumerate() {
                set_scraped_load(&mut nr.view, r, l);
            }
        }
        // A flat node weighing other regions' prefixes pulls their summaries too (as live).
        let every_region = !self.region_layer
            && self.cfg.remote_prefix != crate::core::remote_prefix::RemotePrefixMode::Local;
        let (own, all) = if every_region {
            (&[][..], 0..self.summaries.len())
        } else {
            (&self.region_replicas[node.region][..], 0..0)
        };
        for r in own.iter().copied().chain(all) {
            let Some(fresh) = self.summaries[r].as_of(source) else {
                continue;
            };
            let held = nr.view.replica(r).and_then(|x| x.summary.as_ref());
            if !held.is_some_and(|h| Arc::ptr_eq(h, fresh)) {
                nr.view.set_summary(r, Arc::clone(fresh));
            }
        }
        nr.view.expire_overlay(now);
        nr.view.peer_tips.expire(now);
    }

    fn engine_wake(&mut self, r: usize, now: Duration) {
        if self.scheduled[r] != Some(now) {
            return; // superseded by an earlier wake
        }
        self.scheduled[r] = None;
        let requests = self.reqs.len();
        let mut freed = Vec::new();
        for out in self.engines[r].advance(now) {
            match out {
                Output::FirstToken {
                    id,
                    cached_tokens: c,
                    prompt_tokens: p,
                    ..
                } if id as usize >= requests => {
                    self.warm_first_token(id as usize - requests, p, c, now);
                }
                Output::Finished { id } if id as usize >= requests => {
                    self.warm_finished(id as usize - requests, now);
                }
                Output::FirstToken {
                    id,
                    cached_tokens: c,
                    prompt_tokens: p,
                    ..
                } => self.first_token(r, id, p, c, now),
                Output::Finished { id } => self.request_finished(r, id, now, &mut freed),
                Output::Token { .. } => {}
            }
        }
        if let Some(feed) = self.exact.get_mut(r) {
            // Events reach a live home within milliseconds; one to a dead home is lost.
            let batches = self.engines[r].take_kv_batches();
            if !self.orphaned[r] {
                feed.apply(batches, &mut self.models[r], now);
            }
        }
        for node in freed {
            if self.nodes[node].live {
                self.admit_next(node, now);
            }
        }
        self.schedule(r);
    }

    /// Request `id`'s first token on replica `r` (`p` prompt tokens, `c` of them cached): its
    /// TTFT, the cache model's record of its blocks and the node's overlay and load, as the live
    /// node updates them at the first byte.
    fn first_token(&mut self, r: usize, id: u64, p: usize, c: usize, now: Duration) {
        let f = self.flights[id as usize];
        // A pair's keys serve twice: the prefill's cache, then the decode's.
        let keys = if matches!(f.leg, Leg::Prefill { .. }) {
            self.routed_keys[id as usize].clone()
        } else {
            std::mem::take(&mut self.routed_keys[id as usize])
        };
        // A report to a dead home is lost.
        if !self.orphaned[r] {
            let slot = self
                .tenants
                .kv_slot(self.reqs[id as usize].tenant.as_deref());
            if self.exact.is_empty() {
                self.models[r].record_routed_by(&keys, slot, now);
            } else {
                // An exact model takes no guesses; it learns the tenant only.
                self.models[r].attribute(&keys, slot);
            }
        }
        let ttft = (now - f.arrival + f.extra).as_secs_f64();
        tracing::debug!(
            target: "kvmesh::bench::sim",
            id,
            replica = r,
            at = f.arrival.as_secs_f64(),
            ttft,
            prompt = p,
            cached = c,
            "first token"
        );
        if let Leg::Decode { .. } = f.leg {
            // The handed-over blocks are not hits; the client's first token is this.
            if let Some(nr) = self.nodes[f.node].routing.as_mut() {
                nr.view.prefill_done(r, &keys, now);
            }
            if !f.lost {
                self.ttft.push(ttft);
                self.per_request[id as usize].0 = ttft;
            }
            self.flights[id as usize].ttft_s = ttft;
            return;
        }
        self.prompt_tokens += p as u64;
        self.cached_tokens += c as u64;
        let whole = f.leg == Leg::Whole;
        if !f.lost && whole {
            self.ttft.push(ttft);
            self.flights[id as usize].ttft_s = ttft;
        }
        self.per_request[id as usize] = (
            if f.lost || !whole { f64::NAN } else { ttft },
            p as u64,
            c as u64,
        );
        self.pending_prefill[r] = self.pending_prefill[r].saturating_sub(f.uncached_tokens);
        if let Some(nr) = self.nodes[f.node].routing.as_mut() {
            // As the live node does at the first byte: the overlay counts the blocks
            // from now if it predicted later.
            nr.view.prefill_done(r, &keys, now);
            if let Some(rep) = nr.view.replica_mut(r) {
                rep.load.queued_prefill_tokens = rep
                    .load
                    .queued_prefill_tokens
                    .saturating_sub(f.uncached_tokens);
            }
            self.share(now, f.node, r, 0, -(f.uncached_tokens as i64));
        }
    }

    /// Request `id` finished on replica `r`: its latency and ITL, and the node's view and
    /// admission queue (`freed` collects nodes with a slot back).
    fn request_finished(&mut self, r: usize, id: u64, now: Duration, freed: &mut Vec<usize>) {
        let f = self.flights[id as usize];
        if let Leg::Prefill { decode } = f.leg {
            self.prefill_leg_done(id as usize, r, decode, now);
            return;
        }
        self.flights[id as usize].active = false;
        if !f.lost {
            let latency = (now - f.arrival + f.extra).as_secs_f64();
            self.latency.push(latency);
            let out = self.reqs[id as usize].output_tokens.max(1);
            if let Some(x) = itl(latency, f.ttft_s, out).filter(|x| x.is_finite()) {
                self.itl.push(x);
            }
        }
        if let Some(nr) = self.nodes[f.node].routing.as_mut() {
            nr.view.finished(f.replica);
            if let Some(q) = nr.admission.as_mut() {
                q.released(now);
                freed.push(f.node);
            }
            self.share(now, f.node, f.replica, -1, 0);
        }
        self.done += 1;
    }

    /// Request `i`'s prefill leg ended on replica `r`: its KV crosses the link to `decode`.
    fn prefill_leg_done(&mut self, i: usize, r: usize, decode: usize, now: Duration) {
        let f = self.flights[i];
        if let Some(nr) = self.nodes[f.node].routing.as_mut() {
            nr.view.finished(r);
            self.share(now, f.node, r, -1, 0);
        }
        let tokens = self.pd_prompts.get(&i).map_or(0, Vec::len);
        let t = self
            .cfg
            .pd
            .as_ref()
            .map_or(Duration::ZERO, |p| p.transfer_time(tokens))
            .min(MAX_VIRTUAL_TIME);
        self.transfers.push(t.as_secs_f64());
        self.flights[i].leg = Leg::Decode { prefill: r };
        self.flights[i].replica = decode;
        self.push(now + t, Event::Transfer(i));
    }

    /// Request `i`'s KV has reached its decode replica: the decode leg starts.
    fn transferred(&mut self, i: usize, now: Duration) {
        let f = self.flights[i];
        let prompt = self.pd_prompts.remove(&i).unwrap_or_default();
        let out = self.reqs[i].output_tokens;
        if prompt.is_empty() || !submit_decode(&mut self.engines[f.replica], i, prompt, out, now) {
            self.flights[i].active = false;
            self.decode_gone(f.node, f.replica, now);
            if f.lost {
                self.done += 1;
            } else {
                self.fail_early();
            }
            return;
        }
        self.per_replica[f.replica] += 1;
        self.schedule(f.replica);
    }

    /// A pair's decode leg, booked at node `node`, will not run.
    fn decode_gone(&mut self, node: usize, d: usize, now: Duration) {
        if let Some(nr) = self.nodes[node].routing.as_mut() {
            nr.view.finished(d);
            self.share(now, node, d, -1, 0);
        }
    }

    /// Pushes replica `r`'s next wake-up unless an earlier one is already queued.
    fn schedule(&mut self, r: usize) {
        if let Some(next) = self.engines[r].next_event_time() {
            if self.scheduled[r].is_none_or(|s| next < s) {
                self.scheduled[r] = Some(next);
                self.push(next, Event::EngineWake(r));
            }
        }
    }

    /// Home nodes publish loads (and, once per round, summaries) into the gossip model.
    fn publish(&mut self, k: u64, now: Duration) -> Result<(), SimError> {
        let interval = self.cfg.gossip_interval;
        let max_hops = self.hops.last().copied().unwrap_or(1);
        // The oldest source time any node can still read: of its own region (summaries, hot
        // prefixes), and of any replica (loads, which other regions read through records).
        let horizon = now.saturating_sub(interval * (max_hops + 1));
        let load_horizon = now.saturating_sub(self.max_lag);
        // Homes scrape their engines every scrape interval; what a scrape read travels by gossip.
        let scrape = self
            .scraped
            .is_none_or(|t| now.saturating_sub(t) >= self.cfg.scrape_interval);
        if scrape {
            self.scraped = Some(now);
            let previous = self.loads.latest();
            let loads: Vec<LoadSample> = (0..self.engines.len())
                .map(|r| match previous {
                    Some(prev) if self.orphaned[r] => prev[r],
                    _ => {
                        let st = self.engines[r].stats();
                        LoadSample {
                            waiting: st.waiting as u32,
                            running: st.running as u32,
                            kv_usage: st.kv_usage as f32,
                        }
                    }
                })
                .collect();
            self.loads.publish(now, loads, load_horizon);
        }
        if k.is_multiple_of(u64::from(LOAD_PUBLICATIONS_PER_INTERVAL)) {
            for r in 0..self.models.len() {
                if self.orphaned[r] {
                    continue;
                }
                let m = &mut self.models[r];
                m.maybe_rebuild(now)
                    .map_err(|e| SimError::Config(e.to_string()))?;
                let s = m.summary();
                let last = self.summaries[r].latest().map(|p| (p.epoch(), p.seq()));
                // A new epoch goes out at once; a new sequence at most once an interval, as the
                // live home's `rload:` record (`mesh/replica_load.rs`).
                let due = match last {
                    None => true,
                    Some((epoch, _)) if epoch != s.epoch() => true,
                    Some(v) => {
                        v != (s.epoch(), s.seq())
                            && self.summary_published_at[r].is_none_or(|t| {
                                now.saturating_sub(t) >= self.cfg.replica_load_interval
                            })
                    }
                };
                if due {
                    self.summary_published_at[r] = Some(now);
                    self.summaries[r].publish(now, Arc::new(s.clone()), horizon);
                }
                if self.tenants.any_kv_quota() {
                    let mut shares = [0.0f32; KV_SLOTS];
                    self.models[r].tenant_shares(0.0, &mut shares);
                    self.kv_shares[r].publish(now, Arc::from(&shares[..]), horizon);
                }
            }
        }
        if self.cfg.hot_prefix.enabled {
            self.hot_tick(k, now, horizon);
        }
        if self.region_layer
            && self
                .offered
                .is_none_or(|t| now.saturating_sub(t) >= self.cfg.region_interval)
        {
            self.offered = Some(now);
            let offers = (0..self.cfg.regions)
                .map(|g| self.region_offer(g, now))
                .collect();
            self.offers
                .publish(now, Arc::new(offers), now.saturating_sub(self.max_lag));
        }
        if self.done < self.reqs.len() {
            self.push(
                now + interval / LOAD_PUBLICATIONS_PER_INTERVAL,
                Event::Publish(k + 1),
            );
        }
        Ok(())
    }

    /// Region `g`'s record as its representative (the rendezvous winner among the region's live
    /// nodes) builds it now from its own view: the region's offer, with heads from the prefixes
    /// most routed to the region that its replicas' summaries still hold. The counts then halve,
    /// so the heads follow what is routed now.
    fn region_offer(&mut self, g: usize, now: Duration) -> RegionOffer {
        let region = format!("region-{g}");
        let ids: Vec<String> = self
            .live
            .iter()
            .filter(|n| self.nodes[**n].region == g)
            .map(|n| format!("node-{n}"))
            .collect();
        let rep = home_node(&format!("{region}/record"), ids.iter().map(String::as_str))
            .and_then(|h| h.strip_prefix("node-")?.parse::<usize>().ok());
        // The live representative's counter and ranking (`RecentHeads`): it halves only when
        // full, so a prefix routed now and then at a quiet region still gathers counts.
        let candidates = self.head_counts[g].top(HEAD_CANDIDATES);
        let Some(rep) = rep else {
            return RegionOffer {
                region,
                ..Default::default()
            };
        };
        self.sync_view(rep, now);
        match self.nodes[rep].routing.as_ref() {
            Some(nr) => build_offer(&nr.view, &nr.router.config().cost, &region, candidates),
            None => RegionOffer {
                region,
                ..Default::default()
            },
        }
    }

    /// Node `origin`'s load at `replica` changed by (`in_flight`, `pending_tokens`): the other
    /// nodes of the replica's region see it `load_share_delay` later (never, with sharing off).
    fn share(
        &mut self,
        now: Duration,
        origin: usize,
        replica: usize,
        in_flight: i32,
        pending_tokens: i64,
    ) {
        if let Some(d) = self.cfg.load_share_delay {
            self.shares.push_back(Share {
                at: now + d,
                origin,
                replica,
                in_flight,
                pending_tokens,
                tip: None,
            });
        }
    }

    /// Applies the load changes due by `now` to every other live node of their replica's region.
    fn deliver_shares(&mut self, now: Duration) {
        while self.shares.front().is_some_and(|s| s.at <= now) {
            let Some(s) = self.shares.pop_front() else {
                break;
            };
            let g = self.replica_region[s.replica];
            for (m, node) in self.nodes.iter_mut().enumerate() {
                if m == s.origin || !node.live || node.region != g {
                    continue;
                }
                let Some(view) = node.routing.as_mut().map(|nr| &mut nr.view) else {
                    continue;
                };
                if let Some((key, blocks, ready, ladder)) = &s.tip {
                    let until = *ready + view.overlay_ttl;
                    for (key, blocks) in std::iter::once((*key, *blocks)).chain(ladder.prefixes()) {
                        let tip = Tip {
                            replica: s.replica,
                            blocks,
                            ready: *ready,
                            until,
                        };
                        view.peer_tips.insert(key, tip);
                    }
                }
                let Some(rep) = view.replica_mut(s.replica) else {
                    continue;
                };
                rep.load.peer_in_flight =
                    rep.load.peer_in_flight.saturating_add_signed(s.in_flight);
                rep.load.queued_prefill_tokens = rep
                    .load
                    .queued_prefill_tokens
                    .saturating_add_signed(s.pending_tokens);
            }
        }
    }

    fn node_down(&mut self, n: usize, now: Duration) {
        if !self.nodes[n].live {
            return;
        }
        self.nodes[n].live = false;
        self.live.retain(|m| *m != n);
        // Requests it was proxying lose their client connection (the engines still run them).
        for f in self.flights.iter_mut() {
            if f.active && f.node == n && !f.lost {
                f.lost = true;
                self.lost += 1;
                self.errors += 1;
            }
        }
        for r in 0..self.home.len() {
            if self.home[r] == Some(n) {
                self.orphaned[r] = true;
            }
        }
        self.push(now + self.cfg.failure_detection, Event::Rehome(n));
    }

    /// The others have noticed node `n` is gone: its replicas get new homes, which start fresh
    /// cache models in a new epoch.
    fn rehome(&mut self, n: usize) -> Result<(), SimError> {
        let capacity_blocks = model_capacity(self.cfg) / self.tokens_per_block as usize;
        for r in 0..self.home.len() {
            if self.home[r] != Some(n) {
                continue;
            }
            self.home[r] = self.home_of(r);
            if self.home[r].is_some() {
                let epoch = self.models[r].summary().epoch() + 1;
                self.models[r] = new_model(
                    capacity_blocks,
                    epoch,
                    &self.summary_cfg,
                    self.cfg.exact_homes,
                )?;
                self.orphaned[r] = false;
                self.rehomed += 1;
            }
        }
        Ok(())
    }

    /// The oracle's choice: the lowest predicted time to first token from the engines' true
    /// state plus the round trip to the replica's region (random among exact ties). Returns the
    /// replica and the uncached prompt tokens there.
    fn oracle_pick(&mut self, prompt: &[u32], client_region: usize) -> (usize, u64) {
        let w_load = self.cfg.cost.w_load_s;
        let hashes = block_hashes(
            prompt,
            self.engines.first().map_or(16, |e| e.config().block_tokens),
        );
        let mut best = (f64::INFINITY, 0usize, 0u64);
        let mut ties = 0u32;
        for (r, e) in self.engines.iter().enumerate() {
            let uncached = prompt.len().saturating_sub(e.cached_prefix_tokens(&hashes)) as u64;
            let st = e.stats();
            let cost = (e.pending_prefill_tokens() as u64 + uncached) as f64 / self.prefill_rate
                + w_load * (st.running + st.waiting) as f64
                + self
                    .cfg
                    .rtt(client_region, self.replica_region[r])
                    .as_secs_f64();
            if cost < best.0 {
                best = (cost, r, uncached);
                ties = 1;
            } else if cost == best.0 {
                ties += 1;
                if self.rng.random_range(0..ties) == 0 {
                    best = (cost, r, uncached);
                }
            }
        }
        (best.1, best.2)
    }

    /// Hot-prefix replication, every load publication: once per gossip round every live node's
    /// heavy hitters are published; then every live node plans for the prefixes it owns.
    fn hot_tick(&mut self, k: u64, now: Duration, horizon: Duration) {
        if k.is_multiple_of(u64::from(LOAD_PUBLICATIONS_PER_INTERVAL)) {
            let mut tops = Vec::with_capacity(self.live.len());
            for &n in &self.live {
                let node = &mut self.nodes[n];
                if let Some(h) = node.routing.as_mut().and_then(|nr| nr.hot.as_mut()) {
                    let mut top = Vec::new();
                    h.gossip_top(now, &mut top);
                    tops.push((n, node.region, top));
                }
            }
            self.hot_tops.publish(now, Arc::new(tops), horizon);
        }
        for n in self.live.clone() {
            self.plan_hot(n, now);
        }
    }

    /// Node `n` plans warm-ups for the hot prefixes it owns, and starts or cancels them.
    fn plan_hot(&mut self, n: usize, now: Duration) {
        let mut actions = Vec::new();
        self.sync_view(n, now);
        let ids = self.region_node_ids(self.nodes[n].region);
        let me = format!("node-{n}");
        let Some(nr) = self.nodes[n].routing.as_mut() else {
            return;
        };
        let Some(h) = nr.hot.as_mut() else {
            return;
        };
        let cost = nr.router.config().cost;
        let owns = |key: u64| {
            home_node(&format!("{key:016x}"), ids.iter().map(String::as_str)) == Some(&me)
        };
        h.plan(
            &nr.view,
            &cost,
            &nr.router.tenants,
            now,
            ids.len(),
            owns,
            &mut actions,
        );
        self.hot_max = self.hot_max.max(h.hot_count(now));
        for a in actions.drain(..) {
            match a {
                Action::WarmUp(w) => self.start_warm(n, *w, now),
                Action::Cancel { key, replica } => self.cancel_warm(n, key, replica, now),
            }
        }
    }

    /// Node `n` sends warm-up `w` to its replica: accounted as a routed request is (in flight,
    /// queued prefill, overlay from the predicted prefill end, shared with the region).
    fn start_warm(&mut self, n: usize, w: WarmUp, now: Duration) {
        let r = w.replica;
        let prompt = tokenize(&w.prompt);
        let id = self.reqs.len() + self.warms.len();
        // Replication by transfer: the prefix pulled from a holder, not recomputed.
        tracing::debug!(
            target: "kvmesh::bench::sim",
            id,
            replica = r,
            at = now.as_secs_f64(),
            source = w.fetch.map(|f| f.source),
            "warm-up"
        );
        let pulled = w.fetch.and_then(|f| self.pulled(id, r, f, &prompt, now));
        // Booked as the live node books a warm-up (`Node::route_to` with the whole prefix as
        // prefill), pulled or not.
        let uncached = w.tokens;
        let request = Request {
            id: id as u64,
            prompt,
            max_tokens: 1,
            cache_salt: w.scope.cache_salt.clone(),
        };
        let submitted = match pulled {
            Some(f) => self.engines[r].submit_fetched(request, now, f),
            None => self.engines[r].submit(request, now),
        }
        .is_ok();
        let Some(nr) = self.nodes[n].routing.as_mut() else {
            return;
        };
        if !submitted {
            if let Some(h) = nr.hot.as_mut() {
                h.warm_done(w.key, r, false);
            }
            return;
        }
        // Booked as the live node books a warm-up (`node::hot_prefix`, `route_to` with the whole
        // prefix): a pulled one counts from its recompute time, or sooner, from its first token.
        let ready_in = nr.view.replica(r).map_or(0.0, |rep| {
            nr.router.config().cost.prefill_done_s(rep, w.tokens)
        });
        let ready_in = Duration::try_from_secs_f64(ready_in.clamp(0.0, 3600.0)).unwrap_or_default();
        nr.view.record_routed_ready(r, &w.keys, now, ready_in);
        if let Some(rep) = nr.view.replica_mut(r) {
            rep.load.queued_prefill_tokens += uncached;
        }
        self.share(now, n, r, 1, uncached as i64);
        if let Some(s) = self.shares.back_mut() {
            s.set_tip(&w.keys, now + ready_in);
        }
        self.pending_prefill[r] += uncached;
        self.warms.push(WarmFlight {
            node: n,
            key: w.key,
            replica: r,
            keys: w.keys,
            uncached,
            live: true,
        });
        self.schedule(r);
    }

    /// Node `n`'s planner cancelled its warm-up of `key` on `replica`: the engine drops it and
    /// every count it added is taken back.
    fn cancel_warm(&mut self, n: usize, key: u64, replica: usize, now: Duration) {
        let Some(i) = self
            .warms
            .iter()
            .position(|w| w.live && w.node == n && w.key == key && w.replica == replica)
        else {
            return;
        };
        self.warms[i].live = false;
        self.warmups_cancelled += 1;
        self.engines[replica].cancel((self.reqs.len() + i) as u64);
        let uncached = self.warms[i].uncached;
        self.pending_prefill[replica] = self.pending_prefill[replica].saturating_sub(uncached);
        if let Some(nr) = self.nodes[n].routing.as_mut() {
            nr.view.routed_failed(replica, &self.warms[i].keys, now);
            nr.view.finished(replica);
            if let Some(rep) = nr.view.replica_mut(replica) {
                rep.load.queued_prefill_tokens =
                    rep.load.queued_prefill_tokens.saturating_sub(uncached);
            }
        }
        self.share(now, n, replica, -1, -(uncached as i64));
        self.schedule(replica);
    }

    /// Warm-up `i` finished its prefill: the home's cache model learns its blocks, as it does
    /// a routed request's, and its node's planner hears it.
    fn warm_first_token(&mut self, i: usize, prompt: usize, cached: usize, now: Duration) {
        let w = &mut self.warms[i];
        let (n, r, key, uncached) = (w.node, w.replica, w.key, w.uncached);
        let keys = std::mem::take(&mut w.keys);
        self.warmup_tokens += prompt.saturating_sub(cached) as u64;
        if !self.orphaned[r] {
            self.models[r].record_routed(&keys, now);
        }
        self.pending_prefill[r] = self.pending_prefill[r].saturating_sub(uncached);
        if let Some(nr) = self.nodes[n].routing.as_mut() {
            nr.view.prefill_done(r, &keys, now);
            if let Some(rep) = nr.view.replica_mut(r) {
                rep.load.queued_prefill_tokens =
                    rep.load.queued_prefill_tokens.saturating_sub(uncached);
            }
            if let Some(h) = nr.hot.as_mut() {
                h.warm_done(key, r, true);
            }
        }
        self.share(now, n, r, 0, -(uncached as i64));
    }

    /// Warm-up `i` ended (its one token).
    fn warm_finished(&mut self, i: usize, now: Duration) {
        let w = &mut self.warms[i];
        if !w.live {
            return;
        }
        w.live = false;
        let (n, r) = (w.node, w.replica);
        if let Some(nr) = self.nodes[n].routing.as_mut() {
            nr.view.finished(r);
        }
        self.share(now, n, r, -1, 0);
    }

    /// Times to first token of the requests arriving in `SimConfig::window`.
    fn window_ttft(&self) -> Option<Distribution> {
        let (start, len) = self.cfg.window?;
        let mut ttft: Vec<f64> = self
            .reqs
            .iter()
            .zip(&self.per_request)
            .filter(|(q, (t, _, _))| (start..start + len).contains(&q.at_s) && !t.is_nan())
            .map(|(_, (t, _, _))| *t)
            .collect();
        Some(Distribution::of(&mut ttft))
    }

    /// `split_tenant`'s requests and the others', apart.
    fn tenant_split(&self) -> Option<TenantSplit> {
        let tenant = self.cfg.split_tenant.clone()?;
        let group = |this: bool| {
            let (mut ttft, mut prompt, mut cached) = (Vec::new(), 0u64, 0u64);
            for (req, &(t, p, c)) in self.reqs.iter().zip(&self.per_request) {
                if (req.tenant.as_deref() == Some(tenant.as_str())) != this || p == 0 {
                    continue;
                }
                prompt += p;
                cached += c;
                if !t.is_nan() {
                    ttft.push(t);
                }
            }
            GroupStats {
                requests: ttft.len(),
                hit_token_ratio: if prompt == 0 {
                    0.0
                } else {
                    cached as f64 / prompt as f64
                },
                ttft: Distribution::of(&mut ttft),
            }
        };
        Some(TenantSplit {
            this: group(true),
            others: group(false),
            tenant,
        })
    }

    /// Per priority class: requests, TTFT and refusals, in the configured classes' order.
    fn class_report(&self) -> Vec<ClassStats> {
        let default_class = self
            .cfg
            .priorities
            .as_ref()
            .map_or("standard", |p| p.default_class.as_str());
        let order: Vec<String> = self
            .cfg
            .priorities
            .clone()
            .unwrap_or_default()
            .classes
            .into_iter()
            .map(|c| c.name)
            .collect();
        class_stats(
            &order,
            self.reqs.iter().enumerate().map(|(i, req)| {
                let label = class_label(&self.tenants, req.tenant.as_deref(), default_class);
                let ttft = self.per_request[i].0;
                (label, ttft, self.refused[i].is_some())
            }),
        )
    }

    /// Requests per second over the arrivals' span (not the run's, which ends with the last
    /// decode).
    fn arrival_rate(&self) -> f64 {
        let span = match (self.reqs.first(), self.reqs.last()) {
            (Some(a), Some(b)) => (b.at_s - a.at_s) / self.cfg.arrival_speedup,
            _ => 0.0,
        };
        if span > 0.0 {
            (self.reqs.len() - 1) as f64 / span
        } else {
            0.0
        }
    }

    /// The mesh's modelled costs: the median extra lag of another region's news, and the gossip
    /// bytes per node idle and at `arrival_rate`.
    fn mesh_estimates(&self, arrival_rate: f64) -> (f64, NodeBytes, NodeBytes) {
        let model = GossipByteModel::calibrated();
        let shape = MeshShape {
            layout: self.cfg.gossip_layout,
            nodes: self.cfg.nodes,
            regions: self.cfg.regions,
            replicas: self.cfg.replicas,
            request_rate: arrival_rate,
            interval_s: self.cfg.gossip_interval.as_secs_f64(),
            fanout: self.cfg.gossip_fanout,
        };
        let mut remote_lags: Vec<f64> = self
            .nodes
            .iter()
            .filter_map(|n| n.layer)
            .map(|l| {
                // Half a round of the layer's phase, its hops, the representative's own lag and
                // the regional copy (the node's own lag, which its region's news has too).
                let r = self.cfg.region_interval;
                (r / 2 + r * l.hops.saturating_sub(1) + self.rep_lag).as_secs_f64()
            })
            .collect();
        remote_lags.sort_by(f64::total_cmp);
        let remote_extra_lag_s = remote_lags
            .get(remote_lags.len() / 2)
            .copied()
            .unwrap_or(0.0);
        let idle = model.per_node(&MeshShape {
            request_rate: 0.0,
            ..shape
        });
        (remote_extra_lag_s, idle, model.per_node(&shape))
    }

    fn report(mut self, virtual_time: Duration) -> SimReport {
        let tenant_split = self.tenant_split();
        let window_ttft = self.window_ttft();
        let request_prefill = self.prompt_tokens.saturating_sub(self.cached_tokens);
        let all_prefill = request_prefill + self.warmup_tokens;
        let classes = self.class_report();
        let arrival_rate = self.arrival_rate();
        let (remote_extra_lag_s, mesh_bytes_idle, mesh_bytes) = self.mesh_estimates(arrival_rate);
        SimReport {
            gossip_layout: self.cfg.gossip_layout.as_str().into(),
            arrival_rate,
            remote_extra_lag_s,
            mesh_bytes_idle,
            mesh_bytes,
            window_ttft,
            warmups: self.warms.len() as u64,
            warmups_cancelled: self.warmups_cancelled,
            warmup_prefill_tokens: self.warmup_tokens,
            warmup_prefill_share: if all_prefill == 0 {
                0.0
            } else {
                self.warmup_tokens as f64 / all_prefill as f64
            },
            hot_prefixes_max: self.hot_max,
            classes,
            refused: self.refused.iter().filter(|r| r.is_some()).count(),
            kv_steered: self.kv_steered,
            kv_overflowed: self.kv_overflowed,
            kv_fetch: self.kv_fetch,
            tenant_split,
            policy: if self.cfg.oracle {
                CENTRAL_GREEDY.into()
            } else {
                self.policy.as_str().into()
            },
            nodes: self.cfg.nodes,
            replicas: self.cfg.replicas,
            regions: self.cfg.regions,
            requests: self.reqs.len(),
            errors: self.errors,
            lost: self.lost,
            cross_region: self.cross_region,
            forwarded: self.forwarded,
            rehomed: self.rehomed,
            gossip_hops_p50: self.hops[self.hops.len() / 2],
            gossip_hops_max: self.hops.last().copied().unwrap_or(1),
            ttft: Distribution::of(&mut self.ttft),
            ttft_samples: self.ttft,
            latency: Distribution::of(&mut self.latency),
            itl: Distribution::of(&mut self.itl),
            pd: self.cfg.pd.as_ref().map(|_| PdStats {
                transfer: Distribution::of(&mut self.transfers),
                ..self.pd.clone()
            }),
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            cpu_hit_tokens: self.engines.iter().map(|e| e.stats().cpu_hit_tokens).sum(),
            hit_token_ratio: if self.prompt_tokens == 0 {
                0.0
            } else {
                self.cached_tokens as f64 / self.prompt_tokens as f64
            },
            load_max_over_mean: max_over_mean(&self.per_replica),
            requests_per_replica: self.per_replica,
            virtual_seconds: virtual_time.as_secs_f64(),
        }
    }
}

/// The run's router nodes: each one's region, gossip lag (drawn from `rng` in node order:
/// its own layer's, then the representatives' layer's) and routing state.
fn sim_nodes(
    cfg: &SimConfig,
    policy: PolicyKind,
    lags: &GossipLags,
    infos: &[Arc<ReplicaInfo>],
    tokens_per_block: u32,
    rng: &mut SmallRng,
) -> Vec<SimNode> {
    (0..cfg.nodes)
        .map(|n| {
            let region = n % cfg.regions;
            let lag = NodeLag {
                phase: cfg.gossip_interval.mul_f64(rng.random::<f64>()),
                hops: lags.hops[rng.random_range(0..lags.hops.len())],
            };
            // Drawn after the node's own lag, so flat runs draw as they always did.
            let layer = lags.region_layer.then(|| NodeLag {
                phase: cfg.region_interval.mul_f64(rng.random::<f64>()),
                hops: lags.layer_hops[rng.random_range(0..lags.layer_hops.len())],
            });
            let routing = (!cfg.oracle).then(|| {
                let scope = (n, region, lags.region_layer);
                node_routing(cfg, policy, scope, infos, tokens_per_block)
            });
            SimNode {
                region,
                lag,
                layer,
                live: true,
                routing,
            }
        })
        .collect()
}

/// How far news spreads in a run: the epidemic hop counts of a node's region (and of the
/// representatives' layer between regions, under regional gossip), drawn from the run's RNG in
/// this order, and the lags they make.
struct GossipLags {
    /// Regional gossip with more than one region: a second layer carries other regions' news.
    region_layer: bool,
    /// Hop counts of the node's own layer, sorted (one per trial).
    hops: Vec<u32>,
    /// Hop counts of the representatives' layer (`[1]` without one).
    layer_hops: Vec<u32>,
    /// A representative's median lag behind its region's news.
    rep_lag: Duration,
    /// The longest a piece of news takes to reach every node.
    max_lag: Duration,
}

/// The run's gossip lags ([`GossipLags`]), drawing from `rng`.
fn gossip_lags(cfg: &SimConfig, rng: &mut SmallRng) -> GossipLags {
    // Regional: news of a node's own region spreads over the region's nodes only (the
    // largest region's count); flat, over every node. With one region they are the same.
    // (The central reference reads the engines, not views: no layer to model.)
    let region_layer =
        cfg.gossip_layout == GossipLayout::Regional && cfg.regions > 1 && !cfg.oracle;
    let members = if cfg.gossip_layout == GossipLayout::Regional {
        cfg.nodes.div_ceil(cfg.regions)
    } else {
        cfg.nodes
    };
    let hops = epidemic_hops(members, cfg.gossip_fanout, EPIDEMIC_TRIALS, rng);
    let reps = REPRESENTATIVES.min(members).max(1);
    let layer_hops = if region_layer {
        epidemic_hops(reps * cfg.regions, cfg.gossip_fanout, EPIDEMIC_TRIALS, rng)
    } else {
        vec![1]
    };
    let interval = cfg.gossip_interval;
    let rep_lag = interval / 2 + interval * hops[hops.len() / 2].saturating_sub(1);
    let mut max_lag = interval * (hops.last().copied().unwrap_or(1) + 1);
    if region_layer {
        max_lag += rep_lag + cfg.region_interval * (layer_hops.last().copied().unwrap_or(1) + 1);
    }
    GossipLags {
        region_layer,
        hops,
        layer_hops,
        rep_lag,
        max_lag,
    }
}

/// Sets replica `r`'s scraped load in `view`, keeping the queued prefill the node knows (its
/// own and its peers' routing, by load sharing: not scraped).
fn set_scraped_load(view: &mut View, r: usize, l: &LoadSample) {
    let queued = view.replica(r).map_or(0, |x| x.load.queued_prefill_tokens);
    view.set_engine_load(r, l.waiting, l.running, l.kv_usage, queued);
}

/// The tenant policies every node of `cfg` holds.
fn tenants(cfg: &SimConfig) -> Tenants {
    Tenants::new(cfg.tenants.clone(), TenantConfig::default())
}

/// Tokens a home's model is sized for: the GPU cache, plus the CPU tier when exact models
/// hold its blocks too (a summary sized for the GPU alone would be overfull).
fn model_capacity(cfg: &SimConfig) -> usize {
    cfg.engine.kv_capacity_tokens
        + if cfg.exact_homes {
            cfg.engine.cpu_capacity_tokens
        } else {
            0
        }
}

/// With `exact_homes`: the engines' config with KV events recorded, and one feed per replica
/// (text blocks must be whole engine blocks). Otherwise the config as is and no feeds.
fn exact_feeds(
    cfg: &SimConfig,
    tokens_per_block: u32,
) -> Result<(crate::engine_sim::EngineConfig, Vec<ExactFeed>), SimError> {
    let mut engine = cfg.engine.clone();
    if !cfg.exact_homes {
        return Ok((engine, Vec::new()));
    }
    if cfg.dp_ranks > 1 {
        return Err(SimError::Config(
            "exact homes model one rank per replica: drop --dp-ranks or --exact-homes".into(),
        ));
    }
    let bs = engine.block_tokens.max(1);
    let tpb = tokens_per_block as usize;
    if !tpb.is_multiple_of(bs) {
        return Err(SimError::Config(format!(
            "exact homes need text blocks of whole engine blocks: {tpb} tokens per text block, {bs} per engine block"
        )));
    }
    engine.record_kv_events = true;
    let feeds = (0..cfg.replicas)
        .map(|_| ExactFeed::new(tpb / bs))
        .collect();
    Ok((engine, feeds))
}

/// An empty cache model, as a (new) home node starts one: exact (fed by KV events) or
/// approximate.
fn new_model(
    capacity_blocks: usize,
    epoch: u64,
    summary_cfg: &SummaryConfig,
    exact: bool,
) -> Result<CacheModel, SimError> {
    CacheModel::new(
        if exact {
            CacheSource::Exact
        } else {
            CacheSource::Approximate
        },
        epoch,
        CacheModelConfig::with_capacity(capacity_blocks),
        summary_cfg.clone(),
    )
    .map_err(|e| SimError::Config(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::{trace, workload};
    use std::path::Path;

    fn conversation() -> Vec<WorkloadRequest> {
        workload::from_trace(
            &trace::load(
                &Path::new(env!("CARGO_MANIFEST_DIR")).join("data/traces/conversation_trace.jsonl"),
            )
            .unwrap(),
            true,
        )
    }

    fn small(policy: PolicyKind) -> SimConfig {
        SimConfig {
            policy,
            max_requests: Some(1000),
            ..Default::default()
        }
    }

    #[test]
    fn same_seed_same_report() {
        let t = conversation();
        let a = run(&t, &small(PolicyKind::P2cCache)).unwrap();
        let b = run(&t, &small(PolicyKind::P2cCache)).unwrap();
        assert_eq!(
            serde_json::to_string(&a).unwrap(),
            serde_json::to_string(&b).unwrap()
        );
        assert_eq!(a.requests, 1000);
        assert_eq!(a.errors, 0);
        assert_eq!(a.ttft.count, 1000);
    }

    #[test]
    fn p2c_cache_near_the_oracle_and_faster_than_round_robin() {
        let t = conversation();
        let p2c = run(&t, &small(PolicyKind::P2cCache)).unwrap();
        let rr = run(&t, &small(PolicyKind::RoundRobin)).unwrap();
        let oracle = run(
            &t,
            &SimConfig {
                oracle: true,
                ..small(PolicyKind::P2cCache)
            },
        )
        .unwrap();
        assert!(
            p2c.cached_tokens as f64 >= 0.9 * oracle.cached_tokens as f64,
            "p2c-cache {} vs oracle {} hit tokens",
            p2c.cached_tokens,
            oracle.cached_tokens
        );
        assert!(
            p2c.ttft.mean < rr.ttft.mean,
            "mean TTFT p2c-cache {} vs round-robin {}",
            p2c.ttft.mean,
            rr.ttft.mean
        );
        assert!(p2c.hit_token_ratio > rr.hit_token_ratio);
    }

    #[test]
    fn a_kv_quota_on_a_100x_tenant_keeps_the_small_tenants_within_a_tenth_of_their_hits() {
        // The tenants family with one tenant at 100× each small one's rate, on caches small
        // enough for its unique user messages to flush the small tenants' system prompts.
        // Before peer tips carried a ladder (`core::peer_tips`) the mesh lost a tenth of the
        // small tenants' hits to the big one here and the quota gave them back; now the region's
        // nodes see each small tenant's system prompt where one node would, and keep ~0.95 of
        // their hits without a quota too (docs/benchmarks-notebook.md, tenant KV quotas, round 7). Since
        // a request's own blocks count against the quota (round 9) the big tenant no longer
        // refills each replica its blocks aged out of, and the quota gains again: 0.404 against
        // 0.390 without and 0.409 alone. Since p2c-cache escapes to a nearly idle replica
        // (round 10) the small tenants find one more often without a quota too: 0.398 with it,
        // 0.394 without, 0.411 alone (0.97), on seed 1; the arms are now means over seeds 1–3.
        let params = |absent| workload::TenantsParams {
            big_skew: 100.0,
            user_tokens: (512, 2048),
            big_absent: absent,
            ..Default::default()
        };
        let cfg = |quota: Option<f64>| {
            let mut cfg = SimConfig {
                replicas: 8,
                split_tenant: Some("big".into()),
                ..Default::default()
            };
            cfg.engine.kv_capacity_tokens = 28_672;
            if let Some(q) = quota {
                cfg.tenants.insert(
                    "big".into(),
                    TenantConfig {
                        max_kv_share: Some(q),
                        ..Default::default()
                    },
                );
            }
            cfg
        };
        // The small tenants' hit ratio and the requests the quota steered, each arm over three
        // seeds: one seed's hit ratio moves ±8 % with the path its routing happens to take
        // (seed 1 read 0.348 without a quota where seeds 2 and 3 read 0.397 and 0.403, and the
        // build before read 0.350 on seed 6), more than the tenth this test allows.
        const SEEDS: [u64; 3] = [1, 2, 3];
        let small = |absent: bool, quota: Option<f64>| {
            let (mut hit, mut requests, mut steered) = (0.0, 0, 0);
            for seed in SEEDS {
                let gen = workload::GenParams {
                    rate: 8.0,
                    requests: 3000,
                    seed,
                };
                let w = workload::tenants(&params(absent), &gen).unwrap();
                let r = run(&w, &cfg(quota)).unwrap();
                assert_eq!(r.errors, 0, "a quota never rejects");
                let others = r.tenant_split.unwrap().others;
                hit += others.hit_token_ratio / SEEDS.len() as f64;
                requests += others.requests;
                steered += r.kv_steered;
            }
            (hit, requests, steered)
        };
        let (alone, alone_requests, _) = small(true, None);
        let (without, _, steered_off) = small(false, None);
        let (quota, quota_requests, steered) = small(false, Some(0.1));
        assert_eq!(steered_off, 0);
        assert!(steered > 0, "the quota steers the big tenant");
        assert_eq!(alone_requests, quota_requests);
        for (arm, got) in [("with the quota", quota), ("without", without)] {
            assert!(got >= 0.9 * alone, "{arm}: {got} vs {alone} alone");
        }
        assert!(
            quota > without && quota >= 0.96 * alone,
            "the quota gives the small tenants their hits back: {quota} with it, {without} without, {alone} alone"
        );
    }

    #[test]
    fn a_node_sees_a_peers_routing_only_after_the_load_share_delay() {
        let t = chat(10, 1.0);
        let delay = Duration::from_millis(5);
        let cfg = SimConfig {
            nodes: 2,
            replicas: 2,
            load_share_delay: Some(delay),
            ..Default::default()
        };
        let mut sim = Sim::new(&t, &cfg).unwrap();
        // Clients reach node 0 only; node 1 routes nothing but should learn node 0's load.
        sim.live = vec![0];
        let t0 = Duration::from_secs(1);
        sim.arrival(0, t0);
        let r = sim.flights[0].replica;
        let seen = |sim: &Sim, n: usize| {
            let load = sim.nodes[n]
                .routing
                .as_ref()
                .unwrap()
                .view
                .replica(r)
                .unwrap()
                .load;
            (
                load.in_flight,
                load.peer_in_flight,
                load.queued_prefill_tokens,
            )
        };
        let (own, peers, queued) = seen(&sim, 0);
        assert_eq!((own, peers), (1, 0), "its own routing counts at once");
        assert!(queued > 0);
        sim.deliver_shares(t0 + delay / 2);
        assert_eq!(seen(&sim, 1), (0, 0, 0), "not before the delay");
        sim.deliver_shares(t0 + delay);
        assert_eq!(
            seen(&sim, 1),
            (0, 1, queued),
            "then the peer's request and its prefill"
        );
        // Nor do the engines' true queues leak into a view before a scrape reaches it.
        sim.publish(1, t0).unwrap();
        sim.sync_view(1, t0 + delay);
        assert_eq!(
            sim.nodes[1]
                .routing
                .as_ref()
                .unwrap()
                .view
                .replica(r)
                .unwrap()
                .load
                .waiting,
            0
        );
        // With load sharing off, a peer's routing never reaches the view directly.
        let off = SimConfig {
            load_share_delay: None,
            ..cfg.clone()
        };
        let mut sim = Sim::new(&t, &off).unwrap();
        sim.live = vec![0];
        sim.arrival(0, t0);
        sim.deliver_shares(t0 + Duration::from_secs(10));
        assert_eq!(seen(&sim, 1).1, 0);
    }

    fn chat(requests: usize, rate: f64) -> Vec<WorkloadRequest> {
        workload::chat(
            &workload::ChatParams::default(),
            &workload::GenParams {
                rate,
                requests,
                seed: 1,
            },
        )
        .unwrap()
    }

    #[test]
    fn naming_the_rank_of_a_4_rank_replica_keeps_conversations_on_their_cache() {
        let t = chat(300, 20.0);
        let with = |named: bool| {
            let cfg = SimConfig {
                replicas: 2,
                dp_ranks: 4,
                dp_rank_named: named,
                ..small(PolicyKind::P2cCache)
            };
            run(&t, &cfg).unwrap()
        };
        let (header, off) = (with(true), with(false));
        assert_eq!((header.errors, off.errors), (0, 0));
        // The balancer lands a follow-up on the rank holding its prefix about 1 time in 4.
        assert!(
            header.hit_token_ratio > off.hit_token_ratio + 0.15,
            "named {:.3}, balancer {:.3}",
            header.hit_token_ratio,
            off.hit_token_ratio
        );
    }

    #[test]
    fn a_regional_node_sees_other_regions_only_as_their_records_and_a_flat_one_as_replicas() {
        let t = chat(200, 100.0);
        let cfg = SimConfig {
            nodes: 4,
            replicas: 8,
            regions: 2,
            ..Default::default()
        };
        assert_eq!(cfg.gossip_layout, GossipLayout::Regional);
        fn view<'s>(sim: &'s Sim, n: usize) -> &'s View {
            &sim.nodes[n].routing.as_ref().unwrap().view
        }
        let publish_until = |sim: &mut Sim, secs: u64| {
            let step = sim.cfg.gossip_interval / LOAD_PUBLICATIONS_PER_INTERVAL;
            let mut k = 0;
            while step * k as u32 <= Duration::from_secs(secs) {
                sim.publish(k, step * k as u32).unwrap();
                k += 1;
            }
        };
        let mut sim = Sim::new(&t, &cfg).unwrap();
        // Before any record has crossed the representatives' cluster: no other region at all.
        publish_until(&mut sim, 0);
        sim.sync_view(0, Duration::ZERO);
        assert!(view(&sim, 0).remote_regions.is_empty());
        publish_until(&mut sim, 3);
        sim.sync_view(0, Duration::from_secs(3));
        let v = view(&sim, 0);
        // Node 0 is in region 0: region 1 is one offer of its 4 idle replicas, which the view
        // keeps only as hidden slots.
        let regions: Vec<&String> = v.remote_regions.keys().collect();
        assert_eq!(regions, ["region-1"]);
        let offer = &v.remote_regions["region-1"].models[0];
        assert_eq!((offer.healthy, offer.open), (4, 4));
        for r in 0..8 {
            let healthy = v.replica(r).unwrap().health == Health::Healthy;
            assert_eq!(healthy, r % 2 == 0, "replica {r}");
        }
        assert!(sim.nodes.iter().all(|n| n.layer.is_some()));

        let flat = SimConfig {
            gossip_layout: GossipLayout::Flat,
            ..cfg.clone()
        };
        let mut sim = Sim::new(&t, &flat).unwrap();
        publish_until(&mut sim, 3);
        sim.sync_view(0, Duration::from_secs(3));
        let v = view(&sim, 0);
        assert!(v.remote_regions.is_empty());
        assert!((0..8).all(|r| v.replica(r).unwrap().health == Health::Healthy));
        assert!(sim.nodes.iter().all(|n| n.layer.is_none()));
    }

    #[test]
    fn a_region_record_names_the_routed_prefixes_its_replicas_hold() {
        let t = chat(50, 100.0);
        let cfg = SimConfig {
            nodes: 4,
            replicas: 8,
            regions: 2,
            ..Default::default()
        };
        let mut sim = Sim::new(&t, &cfg).unwrap();
        let held: Vec<BlockKey> = (1..=10u64).map(|i| BlockKey(i * 7919)).collect();
        let only_routed: Vec<BlockKey> = (1..=10u64).map(|i| BlockKey(i * 104_729)).collect();
        // Replica 1 (region 1) holds `held`; region 1 routed both prefixes, often.
        sim.models[1].record_routed(&held, Duration::ZERO);
        for _ in 0..100 {
            sim.head_counts[1].record(&held);
            sim.head_counts[1].record(&only_routed);
        }
        let step = cfg.gossip_interval / LOAD_PUBLICATIONS_PER_INTERVAL;
        for k in 0..=40u32 {
            sim.publish(u64::from(k), step * k).unwrap();
        }
        let offers = sim.offers.latest().unwrap();
        let region1 = &offers[1];
        assert_eq!(region1.region, "region-1");
        // Every power-of-two depth of the held prefix, none of the other.
        assert_eq!(region1.held_blocks(&held), 8);
        assert_eq!(region1.held_blocks(&only_routed), 0);
        assert_eq!(region1.heads.len(), 4);
        assert!(offers[0].heads.is_empty());
    }

    #[test]
    fn full_regions_spill_through_region_offers_as_through_replica_views() {
        let t = chat(400, 400.0);
        let cfg = SimConfig {
            nodes: 4,
            replicas: 4,
            regions: 2,
            max_in_flight: Some(2),
            ..Default::default()
        };
        let regional = run(&t, &cfg).unwrap();
        let flat = run(
            &t,
            &SimConfig {
                gossip_layout: GossipLayout::Flat,
                ..cfg.clone()
            },
        )
        .unwrap();
        for r in [&regional, &flat] {
            assert_eq!(r.errors, 0, "{}", r.gossip_layout);
            assert!(r.forwarded > 0, "{}", r.gossip_layout);
        }
        // The region layer's news is older; it reports by how much.
        assert!(regional.remote_extra_lag_s > 0.0 && flat.remote_extra_lag_s == 0.0);
        assert_eq!(
            (regional.gossip_layout.as_str(), flat.gossip_layout.as_str()),
            ("regional", "flat")
        );
    }

    #[test]
    fn regions_serve_their_own_clients_and_hold_only_their_own_summaries() {
        let t = chat(600, 100.0);
        let cfg = SimConfig {
            nodes: 4,
            replicas: 8,
            regions: 2,
            ..Default::default()
        };
        let p2c = run(&t, &cfg).unwrap();
        assert_eq!((p2c.errors, p2c.cross_region, p2c.forwarded), (0, 0, 0));
        let rr = run(
            &t,
            &SimConfig {
                policy: PolicyKind::RoundRobin,
                ..cfg.clone()
            },
        )
        .unwrap();
        assert!(p2c.hit_token_ratio > rr.hit_token_ratio);

        // White box: after a round, a node holds the summaries of its region's replicas, shared
        // with the other nodes of its region, and none of the other region's.
        let mut sim = Sim::new(&t, &cfg).unwrap();
        sim.publish(0, Duration::ZERO).unwrap();
        let later = Duration::from_secs(1);
        sim.sync_view(0, later);
        sim.sync_view(2, later);
        fn view<'s>(sim: &'s Sim, n: usize) -> &'s View {
            &sim.nodes[n].routing.as_ref().unwrap().view
        }
        for r in 0..8 {
            let (a, b) = (
                view(&sim, 0).replica(r).unwrap(),
                view(&sim, 2).replica(r).unwrap(),
            );
            if r % 2 == 0 {
                assert!(Arc::ptr_eq(
                    a.summary.as_ref().unwrap(),
                    b.summary.as_ref().unwrap()
                ));
                assert!(Arc::ptr_eq(&a.info, &b.info));
            } else {
                assert!(a.summary.is_none() && b.summary.is_none());
            }
        }
    }

    #[test]
    fn a_failed_node_loses_its_requests_and_its_replicas_get_new_homes() {
        let t = chat(600, 100.0);
        let cfg = SimConfig {
            failures: vec![NodeFailure {
                node: 0,
                at: Duration::from_secs(3),
            }],
            failure_detection: Duration::from_secs(1),
            ..Default::default()
        };
        let homed_on_0 = {
            let sim = Sim::new(&t, &cfg).unwrap();
            sim.home.iter().filter(|h| **h == Some(0)).count()
        };
        assert!(homed_on_0 > 0, "node 0 is home for some of the 8 replicas");
        let a = run(&t, &cfg).unwrap();
        assert_eq!(a.rehomed, homed_on_0);
        assert!(a.lost > 0, "requests in flight through node 0 are lost");
        assert_eq!(a.errors, a.lost, "everything else is served by the others");
        assert_eq!(a.latency.count, a.requests - a.lost);
        let b = run(&t, &cfg).unwrap();
        assert_eq!(
            serde_json::to_string(&a).unwrap(),
            serde_json::to_string(&b).unwrap()
        );
    }

    #[test]
    fn bad_configs_are_refused() {
        let t = chat(10, 10.0);
        for cfg in [
            SimConfig {
                regions: 9,
                ..Default::default()
            },
            SimConfig {
                failures: vec![NodeFailure {
                    node: 3,
                    at: Duration::ZERO,
                }],
                ..Default::default()
            },
            SimConfig {
                gossip_fanout: 0,
                ..Default::default()
            },
            SimConfig {
                failures: vec![NodeFailure {
                    node: 0,
                    at: Duration::from_secs(2_000_000_000),
                }],
                ..Default::default()
            },
            SimConfig {
                arrival_speedup: 1e-12,
                ..Default::default()
            },
        ] {
            assert!(matches!(run(&t, &cfg), Err(SimError::Config(_))));
        }
        assert!("0@1.5".parse::<NodeFailure>().is_ok());
        for bad in ["0", "x@1", "0@-1", "0@nan", "0@1e300"] {
            assert!(bad.parse::<NodeFailure>().is_err(), "{bad}");
        }
    }

    /// The agent family at `rate` with `runs` open runs, p2c-cache against round-robin.
    /// The tenants family at 60 requests/s on two replicas with a small KV cache: the engines
    /// queue, so without priorities every class waits alike. With them (the replicas' batch
    /// capped at 64 at the node), critical and standard requests skip the node's queue and
    /// batch absorbs the wait; throughput stays the same.
    #[test]
    fn priorities_keep_critical_fast_when_a_batch_flood_saturates_the_fleet() {
        use crate::core::priority::PrioritiesConfig;
        let w = workload::tenants(
            &workload::TenantsParams {
                big_share: 0.7,
                small_tenants: 8,
                ..Default::default()
            },
            &workload::GenParams {
                rate: 60.0,
                requests: 1200,
                seed: 1,
            },
        )
        .unwrap();
        let mut engine = crate::engine_sim::Preset::Llama8bH100.config();
        engine.kv_capacity_tokens = 40_000;
        let class = |c: &str| TenantConfig {
            priority: Some(c.to_owned()),
            ..Default::default()
        };
        let base = SimConfig {
            nodes: 2,
            replicas: 2,
            engine,
            tenants: std::collections::HashMap::from([
                ("big".to_owned(), class("batch")),
                ("small-0".to_owned(), class("critical")),
                ("small-1".to_owned(), class("critical")),
            ]),
            ..Default::default()
        };
        let off = run(&w, &base).unwrap();
        let on = run(
            &w,
            &SimConfig {
                priorities: Some(PrioritiesConfig::default()),
                max_in_flight: Some(64),
                ..base.clone()
            },
        )
        .unwrap();
        let get = |r: &SimReport, c: &str| {
            r.classes
                .iter()
                .find(|s| s.class == c)
                .cloned()
                .unwrap_or_default()
        };
        let (off_c, on_c, on_b) = (
            get(&off, "critical"),
            get(&on, "critical"),
            get(&on, "batch"),
        );
        assert!(off_c.ttft.p50 > 2.0, "not saturated: {off_c:?}");
        assert!(
            on_c.ttft.p99 * 4.0 < off_c.ttft.p99 && on_c.ttft.p99 < on_b.ttft.p50,
            "critical {on_c:?} vs without {off_c:?}, batch {on_b:?}"
        );
        assert_eq!((on_c.rejected, get(&on, "standard").rejected), (0, 0));
        assert_eq!(off.refused, 0);
    }

    fn agent_overload(runs: usize, rate: f64, requests: usize, nodes: usize, replicas: usize) {
        let w = workload::agent(
            &workload::AgentParams {
                concurrent_runs: runs,
                ..Default::default()
            },
            &workload::GenParams {
                rate,
                requests,
                seed: 1,
            },
        )
        .unwrap();
        let cfg = |policy| SimConfig {
            policy,
            nodes,
            replicas,
            oracle: false,
            ..Default::default()
        };
        let p2c = run(&w, &cfg(PolicyKind::P2cCache)).unwrap();
        let rr = run(&w, &cfg(PolicyKind::RoundRobin)).unwrap();
        assert!(rr.ttft.mean > 2.0, "not overloaded: {}", rr.ttft.mean);
        assert!(
            p2c.ttft.mean <= rr.ttft.mean && p2c.hit_token_ratio >= rr.hit_token_ratio,
            "p2c-cache {} s / {} hit vs round-robin {} s / {}",
            p2c.ttft.mean,
            p2c.hit_token_ratio,
            rr.ttft.mean,
            rr.hit_token_ratio
        );
    }

    /// Sustained overload (docs/benchmarks-notebook.md, "the agent family under overload"): agent runs
    /// arriving faster than the fleet can serve them, so every queue grows. Crediting blocks that
    /// are only promised by requests still queued at a replica piled the steps of a run onto it,
    /// where they missed each other, and p2c-cache lost to round-robin. The first 1,000 requests
    /// of the full-size case (~20 s in a debug build): p2c-cache 7.40 s vs round-robin 8.17 s.
    #[test]
    fn p2c_cache_no_worse_than_round_robin_under_overload() {
        agent_overload(8, 200.0, 1000, 3, 8);
    }

    /// The full-size case of the finding: 8 replicas, 3 nodes, agent at 200 req/s, 3,000
    /// requests (before the fix 27.8 s vs 24.4 s; after, 23.7 s). ~15 s in a release build, so
    /// run it explicitly: `cargo test --release -- --ignored overload_full_size`.
    #[test]
    #[ignore = "slow in debug builds; run with --release -- --ignored"]
    fn p2c_cache_no_worse_than_round_robin_under_overload_full_size() {
        agent_overload(8, 200.0, 3000, 3, 8);
    }
    /// Hot-prefix replication (docs/benchmarks-notebook.md, "Hot-prefix replication"): a prefix one
    /// replica holds turns hot (1 → 100 requests/s). With it, the owner warms more replicas
    /// within about its budget, and the burst's p99 is no worse than with p2c-cache's own
    /// spreading. (Before the backlog charge the default spread this burst slowly, 0.229 s p99
    /// against 0.059 s with warm-ups; since, it spreads it itself: 0.061 s against 0.046 s.)
    /// Seed 1, 4,000 requests (the burst starts at 20 s, ~400 in).
    #[test]
    fn hot_prefix_replication_warms_within_its_budget_and_never_slows_the_burst() {
        use crate::bench::workload::{burst, BurstParams, GenParams};
        use crate::core::hot_prefix::HotPrefixConfig;
        let p = BurstParams {
            lead_rate: 1.0,
            ..BurstParams::default()
        };
        // The window's p99 over three seeds: one seed's moves ±15 % with its routing's path
        // (seed 1 read 0.057 s with warm-ups and 0.055 without, seed 3 0.059 and 0.105).
        const SEEDS: [u64; 3] = [1, 2, 3];
        let (mut with, mut without) = (0.0, 0.0);
        for seed in SEEDS {
            let gen = GenParams {
                rate: 20.0,
                requests: 4000,
                seed,
            };
            let w = burst(&p, &gen).unwrap();
            let cfg = SimConfig {
                window: Some((20.0, 10.0)),
                ..Default::default()
            };
            let off = run(&w, &cfg).unwrap();
            let on = run(
                &w,
                &SimConfig {
                    hot_prefix: HotPrefixConfig {
                        enabled: true,
                        ..HotPrefixConfig::default()
                    },
                    ..cfg.clone()
                },
            )
            .unwrap();
            assert_eq!((off.warmups, off.warmup_prefill_tokens), (0, 0));
            assert!(on.warmups > 0 && on.hot_prefixes_max >= 1, "{}", on.warmups);
            // The budget is 5% of the region's prefill capacity over 10 s; measured against
            // the prefill actually done, a short run lands near it.
            assert!(
                on.warmup_prefill_share < 0.06,
                "{}",
                on.warmup_prefill_share
            );
            let (a, b) = (off.window_ttft.unwrap(), on.window_ttft.unwrap());
            assert_eq!(a.count, b.count);
            without += a.p99 / SEEDS.len() as f64;
            with += b.p99 / SEEDS.len() as f64;
        }
        assert!(
            with <= without,
            "burst p99 {with} with vs {without} without, the mean of three seeds"
        );
    }
}
