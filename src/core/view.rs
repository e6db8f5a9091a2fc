//! View: everything a node knows about the fleet, in one synchronous structure the router reads.
//!
//! The live node fills it from gossip, scrapes and summary pulls; the simulator fills it from its
//! virtual world; tests fill it by hand. The router never does I/O: it only reads a `View`.
//!
//! Besides replica metadata, load and summaries, the view keeps a per-replica *overlay* of block
//! keys this node routed a moment ago. The summary from the home node lags by a gossip round or
//! two; without the overlay, a burst of requests sharing a new prefix would scatter before the
//! first one's blocks became visible.
//!
//! An overlay entry only counts once the blocks can really be there: a routed request's blocks
//! exist in the engine's prefix cache as *its* prefill schedules them, not when it is sent.
//! Engines look up the prefix cache when they admit a request, so a follow-up that reaches a
//! replica while its predecessor is still queued there is admitted next to it and recomputes the
//! whole prefix (one arriving mid-prefill finds the chunks scheduled so far: vLLM v1 and SGLang
//! cache chunk by chunk).
//! Under sustained overload (queues of seconds) crediting such *promised* blocks steered every
//! step of an agent run onto one replica, where the steps serialised and missed each other: the
//! simulator measured 42% of the predicted hit tokens realised, and p2c-cache behind round-robin.
//! So [`View::record_routed_ready`] takes the predicted completion of the request's prefill
//! (`CostModel::prefill_done_s` in `cost.rs`, which reads the view) and the overlay entry counts from then on
//! ([`View::record_routed`] = ready at once), or from when the prefill is known done if that is
//! earlier ([`View::prefill_done`]: the live node's first byte). It stops counting `overlay_ttl`
//! after the predicted start; a key already counting keeps its earlier start.
//! A request that repeats or extends a prompt still being computed rides on it instead, paying
//! the wait for it ([`View::pending_run`]; the router's `ride_on`, then the node's hold).
//!
//! A replica's hit ([`View::hit_tiers`]) is the leading run of the request's keys held in its
//! summary or in ready, unexpired overlay entries, split by tier: `gpu` (plain keys or overlay),
//! `cpu` (then CPU-salted keys), `any` (then CPU- or disk-salted keys). The tier searches run only
//! when the summary has lower-tier keys and the GPU run stopped early. Replica indexes are stable
//! for the view's life, so a decision's index stays valid while the request runs.
//!
//! The GPU runs of replicas without an overlay come from the view's bit-sliced summaries
//! (`summary_slices.rs`), searched once per request for 64 replicas at a time; the others (an
//! overlay, a filter kind not sliced) probe their own filter, with the same probes.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use super::keys::BlockKey;
use super::peer_tips::PeerTips;
use super::region_offer::RegionOffer;
use super::regions::RegionMap;
use super::role::PdFacts;
use super::summary::{FilterBits, FilterGeometry, KeyHasher, KeyHashes, ReplicaSummary, Tier};
use super::summary_slices::{self, SliceRuns, SummarySlices, SLICE_WIDTH};

/// Prefill attention of an 8B model on one H100, ms per query·key pair: the simulated engine's
/// `8b-h100` preset (`engine_sim::config`, calibrated in engine-timing.md §2). At 50,000 tokens/s
/// a new token's attention costs as much as its per-token part once ~27,000 tokens precede it.
pub const DEFAULT_PREFILL_ATTENTION_MS_PER_PAIR: f64 = 7.5e-7;

/// Most a replica's prefill attention may be configured or published, ms per pair (100× the 70B
/// preset's): a bound on an outside number.
pub const MAX_PREFILL_ATTENTION_MS_PER_PAIR: f64 = 1e-4;

/// Static facts about a replica.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplicaInfo {
    /// Stable id, unique in the cluster (e.g. `eu-a-vllm-0`).
    pub id: String,
    /// Base URL of its OpenAI-compatible API.
    pub url: String,
    /// Region it lives in.
    pub region: String,
    /// Zone or rack inside the region ("" when not set).
    pub zone: String,
    /// Pool (e.g. `shared`, `dedicated-acme`); tenants map to ordered pools.
    pub pool: String,
    /// Models it serves (base models and LoRA adapters).
    pub models: Vec<String>,
    /// KV cache capacity in tokens.
    pub capacity_tokens: u64,
    /// Predicted prefill speed in tokens per second (config or measurement): the per-token part
    /// of a prefill's price (`cost.rs`).
    pub prefill_tokens_per_s: f64,
    /// Prefill attention, ms per query·key pair: a prefill of C new tokens after p cached ones
    /// also pays `e·C·(p + C/2)` (`cost.rs`). Default
    /// [`DEFAULT_PREFILL_ATTENTION_MS_PER_PAIR`] (the simulated engine's 8B preset);
    /// 0 prices prefill by tokens alone.
    pub prefill_attention_ms_per_pair: f64,
    /// In-flight requests above which the replica counts as full. Default 256.
    pub max_in_flight: u32,
    /// Its part in prefill/decode disaggregation (`role.rs`). Default `both`, no bootstrap.
    pub pd: PdFacts,
    /// KV size and offload links, to weigh its CPU/disk hits by load time
    /// ([`super::kv_load`]); `None`: the node's fixed `tier_weights`.
    pub kv_load: Option<super::kv_load::KvLoad>,
}

/// Health as the node sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    /// Takes traffic.
    Healthy,
    /// Failed checks or was ejected; takes no traffic until it recovers.
    Unhealthy,
    /// Leaving: finishes what it has, takes nothing new.
    Draining,
}

/// Load figures; all may be stale by a scrape or gossip interval except `in_flight`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ReplicaLoad {
    /// Requests queued in the engine (`vllm:num_requests_waiting`).
    pub waiting: u32,
    /// Requests running in the engine (`vllm:num_requests_running`).
    pub running: u32,
    /// KV cache usage, 0..1.
    pub kv_usage: f32,
    /// Requests this node has sent to the replica and not seen finish (always fresh).
    pub in_flight: u32,
    /// Requests the other nodes of the region have in flight there, as their load updates said
    /// a moment ago (`mesh/load_share.rs`; bounded by the node).
    pub peer_in_flight: u32,
    /// Prompt tokens queued for prefill at the replica, as best known (uncached part): this
    /// node's own, plus the other nodes'.
    pub queued_prefill_tokens: u64,
    /// What the engine's figures (`waiting + running`) counted beyond the region's routers'
    /// own requests when they were read ([`View::set_engine_load`]): requests that reached the
    /// replica some other way (a client calling it directly, a router that restarted, another
    /// region's routers).
    pub engine_excess: u32,
    /// What the engine's figures counted beyond *this node's* requests when they were read:
    /// the most the other nodes' claims can be backed by (`node/load_share.rs`). Taken at the
    /// read, not worked out from today's own count against the old figure: that shrank as this
    /// node sent a replica more, so the more it sent there the fewer of its peers' requests it
    /// counted, and it kept sending (three nodes' hot burst, issue #37: runs of requests to one
    /// replica, its own count up 5 → 11 while the peers' it counted fell 5 → 1).
    pub engine_others: u32,
}

impl ReplicaLoad {
    /// What an engine reporting `waiting + running` counts beyond the `routers`' own requests
    /// there ([`Self::engine_excess`]).
    #[inline]
    pub fn excess_of(waiting: u32, running: u32, routers: u32) -> u32 {
        waiting.saturating_add(running).saturating_sub(routers)
    }

    /// Outstanding requests: the region's routers' own count (fresh) plus what the engine
    /// counted beyond it at its last read. Not the larger of the engine's figure and the
    /// routers': a figure read before a burst of completions kept the replica looking busy
    /// until the next scrape, and when the scrape came it looked idle to every node at once,
    /// which sent it a herd (simulator, hot burst seed 3: fifteen requests in 60 ms to the one
    /// replica that had sat idle for a scrape interval).
    #[inline]
    pub fn outstanding(&self) -> u32 {
        self.in_flight
            .saturating_add(self.peer_in_flight)
            .saturating_add(self.engine_excess)
    }
}

/// One replica as the node knows it.
#[derive(Debug)]
pub struct ReplicaState {
    /// Static facts; shared, so a simulator's thousand views of one replica hold one copy.
    pub info: Arc<ReplicaInfo>,
    /// Current health.
    pub health: Health,
    /// Latest load.
    pub load: ReplicaLoad,
    /// Its cache summary, when this node holds one (replicas of the node's own region). Shared:
    /// views holding the same version of a summary hold one copy.
    pub summary: Option<Arc<ReplicaSummary>>,
    /// Rendezvous seed of its id (affinity, hash rings); computed once.
    pub seed: u64,
    /// How full its prefix cache is believed to be, 0..=1 ([`ReplicaSummary::fill`] of
    /// `summary`), kept by [`View::set_summary`] so the router reads one number per candidate
    /// rather than the summary behind its pointer (p2c-cache's `evict_charge`).
    cache_fill: f64,
    /// Keys just routed here by this node: when they start and stop counting.
    overlay: HashMap<u64, OverlayEntry>,
    /// Estimated share (0..=1) of its KV cache held by each KV slot (`tenants.rs`), from the
    /// cache model (`CacheModel::tenant_shares`); empty until set, i.e. while no tenant has a
    /// `max_kv_share`.
    kv_shares: Vec<f32>,
}

impl ReplicaState {
    /// Whether this node's overlay holds any key for the replica (most replicas' is empty: the
    /// router then skips every overlay lookup).
    #[inline]
    pub fn has_overlay(&self) -> bool {
        !self.overlay.is_empty()
    }

    /// How full its prefix cache is believed to be, 0..=1 (0 without a summary): the fill of
    /// the summary last set through [`View::set_summary`].
    #[inline]
    pub fn cache_fill(&self) -> f64 {
        self.cache_fill
    }

    /// Whether a ready, unexpired overlay entry holds `key` at `now`.
    #[inline(never)]
    fn overlay_holds(&self, key: BlockKey, now: Duration) -> bool {
        self.overlay
            .get(&key.0)
            .is_some_and(|e| e.ready <= now && now < e.until)
    }

    /// The estimated share of its KV cache held by KV slot `slot` (0 when unknown).
    pub fn kv_share(&self, slot: u8) -> f32 {
        self.kv_shares.get(slot as usize).copied().unwrap_or(0.0)
    }
}

/// One overlay key: routed here by this node, held from `ready` (the routed request's predicted
/// first token, when its prefill has put the block in the cache) until `until`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct OverlayEntry {
    /// From when the key counts as held (view time).
    ready: Duration,
    /// When it stops counting: `overlay_ttl` after `ready`, by then the summary should have it.
    until: Duration,
    /// A routed request's first byte showed the block computed ([`View::prefill_done`]), so
    /// the engine holds it now, not only by prediction: a KV pull may name it as a source
    /// (`fetch_plan.rs`), where a predicted block it does not hold yet would be a failed pull.
    confirmed: bool,
}

/// Overlay entries kept per replica at most; beyond that the oldest are not tracked (the summary
/// will carry them soon anyway).
pub const MAX_OVERLAY_KEYS: usize = 1 << 16;

/// What a node knows.
#[derive(Debug)]
pub struct View {
    /// The node's own region.
    pub local_region: String,
    /// Distances between regions.
    pub regions: RegionMap,
    /// Prompt tokens per block key (256 bytes of text ≈ 64 tokens; the engine block size in token mode).
    pub tokens_per_block: u32,
    /// How long an overlay entry counts. Default 10 s (several gossip intervals).
    pub overlay_ttl: Duration,
    /// Prefixes the region's other nodes just routed (`peer_tips.rs`); the router adds them to
    /// the hits it reads here.
    pub peer_tips: PeerTips,
    /// Other regions' offers, by region, as their representatives publish them (regional
    /// gossip: those regions' replicas are not in this view). The driver keeps at most
    /// [`super::region_offer::MAX_REMOTE_REGIONS`].
    pub remote_regions: BTreeMap<String, RegionOffer>,
    /// Regions whose every forwarding target just failed, with the time (the router's clock)
    /// until which forwarding skips them: a region gone dark is still in its record until the
    /// region layer declares its representatives dead. At most
    /// [`super::region_offer::MAX_REMOTE_REGIONS`] (see [`View::mark_unreachable`]).
    pub unreachable_regions: BTreeMap<String, Duration>,
    replicas: Vec<ReplicaState>,
    index: HashMap<String, usize>,
    /// The replicas' summaries, bit-sliced for the hit search; kept in step by
    /// [`View::set_summary`] (a summary changed another way is searched the per-replica way).
    slices: SummarySlices,
}

impl View {
    /// An empty view for a node of `local_region`.
    pub fn new(local_region: impl Into<String>, tokens_per_block: u32) -> Self {
        View {
            local_region: local_region.into(),
            regions: RegionMap::default(),
            tokens_per_block: tokens_per_block.max(1),
            overlay_ttl: Duration::from_secs(10),
            peer_tips: PeerTips::default(),
            remote_regions: BTreeMap::new(),
            unreachable_regions: BTreeMap::new(),
            replicas: Vec::new(),
            index: HashMap::new(),
            slices: SummarySlices::default(),
        }
    }

    /// Forwarding skips `region` until `until` (the router's clock). Expired entries go first;
    /// past the cap the soonest to expire goes, so the map stays bounded whatever fails.
    pub fn mark_unreachable(&mut self, region: &str, now: Duration, until: Duration) {
        self.unreachable_regions.retain(|_, u| *u > now);
        if !self.unreachable_regions.contains_key(region)
            && self.unreachable_regions.len() >= super::region_offer::MAX_REMOTE_REGIONS
        {
            let soonest = self
                .unreachable_regions
                .iter()
                .min_by_key(|(_, u)| **u)
                .map(|(r, _)| r.clone());
            if let Some(r) = soonest {
                self.unreachable_regions.remove(&r);
            }
        }
        self.unreachable_regions.insert(region.to_owned(), until);
    }

    /// Whether forwarding skips `region` at `now` ([`View::mark_unreachable`]).
    pub fn is_unreachable(&self, region: &str, now: Duration) -> bool {
        self.unreachable_regions
            .get(region)
            .is_some_and(|until| *until > now)
    }

    /// Adds or updates a replica's static facts; returns its index. Indexes are stable while a
    /// replica is known (a removed one stays, marked draining, until the registry drops it and
    /// may give its slot to another: [`View::replace`]), so decisions can hold them.
    pub fn upsert(&mut self, info: impl Into<Arc<ReplicaInfo>>) -> usize {
        let info: Arc<ReplicaInfo> = info.into();
        if let Some(&i) = self.index.get(&info.id) {
            self.replicas[i].info = info;
            return i;
        }
        let seed = super::affinity::replica_seed(&info.id);
        let i = self.replicas.len();
        self.index.insert(info.id.clone(), i);
        self.replicas.push(ReplicaState {
            info,
            health: Health::Healthy,
            load: ReplicaLoad::default(),
            summary: None,
            seed,
            cache_fill: 0.0,
            overlay: HashMap::new(),
            kv_shares: Vec::new(),
        });
        i
    }

    /// Puts a new replica in slot `i` in place of the one there (a dropped tombstone the
    /// registry reclaims): the old id no longer names it, and its health, load, summary,
    /// overlay and shares start over. The caller makes sure nothing holds `i` for the old
    /// replica (nothing in flight there). Returns false, changing nothing, if `i` is out of
    /// range or the new id already has a slot.
    pub fn replace(&mut self, i: usize, info: impl Into<Arc<ReplicaInfo>>) -> bool {
        let info: Arc<ReplicaInfo> = info.into();
        if i >= self.replicas.len() || self.index.contains_key(&info.id) {
            return false;
        }
        let old = &self.replicas[i].info.id;
        if self.index.get(old) == Some(&i) {
            self.index.remove(old);
        }
        self.index.insert(info.id.clone(), i);
        self.slices.set(i, None);
        // Peers' tips name the slot, not the replica: the old one's prefixes are not the new one's.
        self.peer_tips.forget_replica(i);
        self.replicas[i] = ReplicaState {
            seed: super::affinity::replica_seed(&info.id),
            info,
            health: Health::Healthy,
            load: ReplicaLoad::default(),
            summary: None,
            cache_fill: 0.0,
            overlay: HashMap::new(),
            kv_shares: Vec::new(),
        };
        true
    }

    /// Index of a replica by id.
    pub fn index_of(&self, id: &str) -> Option<usize> {
        self.index.get(id).copied()
    }

    /// All replicas, by index.
    pub fn replicas(&self) -> &[ReplicaState] {
        &self.replicas
    }

    /// One replica.
    pub fn replica(&self, i: usize) -> Option<&ReplicaState> {
        self.replicas.get(i)
    }

    /// One replica, mutably (health, load, summary updates).
    pub fn replica_mut(&mut self, i: usize) -> Option<&mut ReplicaState> {
        self.replicas.get_mut(i)
    }

    /// Sets a replica's health.
    pub fn set_health(&mut self, i: usize, health: Health) {
        if let Some(r) = self.replicas.get_mut(i) {
            r.health = health;
        }
    }

    /// Replaces a replica's engine figures, keeping this node's own in-flight count; what they
    /// count beyond the region's routers' requests now is kept as [`ReplicaLoad::engine_excess`],
    /// beyond this node's as [`ReplicaLoad::engine_others`].
    pub fn set_engine_load(
        &mut self,
        i: usize,
        waiting: u32,
        running: u32,
        kv_usage: f32,
        queued_prefill_tokens: u64,
    ) {
        if let Some(r) = self.replicas.get_mut(i) {
            let routers = r.load.in_flight.saturating_add(r.load.peer_in_flight);
            r.load.waiting = waiting;
            r.load.running = running;
            r.load.kv_usage = kv_usage;
            r.load.queued_prefill_tokens = queued_prefill_tokens;
            r.load.engine_excess = ReplicaLoad::excess_of(waiting, running, routers);
            r.load.engine_others = ReplicaLoad::excess_of(waiting, running, r.load.in_flight);
        }
    }

    /// Sets what the other nodes of the region have in flight at replica `i` and the prompt
    /// tokens queued there in all (this node's own included).
    pub fn set_shared_load(&mut self, i: usize, peer_in_flight: u32, queued_prefill_tokens: u64) {
        if let Some(r) = self.replicas.get_mut(i) {
            r.load.peer_in_flight = peer_in_flight;
            r.load.queued_prefill_tokens = queued_prefill_tokens;
        }
    }

    /// Forgets a departed replica's summary, overlay and engine load (its index stays, a
    /// tombstone; see the node's registry).
    pub fn clear_summary(&mut self, i: usize) {
        if let Some(r) = self.replicas.get_mut(i) {
            r.summary = None;
            r.cache_fill = 0.0;
            r.overlay = Default::default();
            r.load = ReplicaLoad::default();
            r.kv_shares = Vec::new();
            self.slices.set(i, None);
        }
    }

    /// Sets the estimated KV-cache share of each KV slot at replica `i` (`shares[slot]`).
    pub fn set_kv_shares(&mut self, i: usize, shares: &[f32]) {
        if let Some(r) = self.replicas.get_mut(i) {
            r.kv_shares.clear();
            r.kv_shares.extend_from_slice(shares);
        }
    }

    /// Sets a replica's summary (owned, or shared with other views).
    pub fn set_summary(&mut self, i: usize, summary: impl Into<Arc<ReplicaSummary>>) {
        if let Some(r) = self.replicas.get_mut(i) {
            r.summary = Some(summary.into());
            // Overlay keys the summary now covers are redundant.
            if let Some(s) = &r.summary {
                r.overlay.retain(|k, _| !s.contains(BlockKey(*k)));
                r.cache_fill = s.fill();
            }
            self.slices.set(i, r.summary.as_deref());
        }
    }

    /// Records a routing decision whose blocks count at once (see [`View::record_routed_ready`]).
    pub fn record_routed(&mut self, i: usize, keys: &[BlockKey], now: Duration) {
        self.record_routed_ready(i, keys, now, Duration::ZERO);
    }

    /// Records a routing decision: the request counts as in flight until [`View::finished`], and
    /// its keys join the replica's overlay, held from `now + ready_in` — the predicted end of the
    /// request's prefill, when it will have put them in the engine's cache — for `overlay_ttl`. A key already held (ready earlier) keeps its earlier start: a prefix that is
    /// in the cache stays a hit however many requests are queued behind it.
    pub fn record_routed_ready(
        &mut self,
        i: usize,
        keys: &[BlockKey],
        now: Duration,
        ready_in: Duration,
    ) {
        let ttl = self.overlay_ttl;
        if let Some(r) = self.replicas.get_mut(i) {
            r.load.in_flight = r.load.in_flight.saturating_add(1);
            let ready = now + ready_in;
            let until = ready + ttl;
            for k in keys {
                if r.overlay.len() >= MAX_OVERLAY_KEYS && !r.overlay.contains_key(&k.0) {
                    break;
                }
                r.overlay
                    .entry(k.0)
                    .and_modify(|e| {
                        if e.until <= now {
                            // Expired but not yet swept: a fresh entry.
                            *e = OverlayEntry {
                                ready,
                                until,
                                confirmed: false,
                            };
                        } else {
                            e.ready = e.ready.min(ready);
                            e.until = e.until.max(until);
                        }
                    })
                    .or_insert(OverlayEntry {
                        ready,
                        until,
                        confirmed: false,
                    });
            }
        }
    }

    /// The request routed to replica `i` with `keys` has finished its prefill (the live node: its
    /// first byte arrived): its overlay keys predicted ready later count from `now`. A replica
    /// faster than its configured prefill rate is then credited as soon as it has the blocks,
    /// not when the prediction said. Keys the overlay does not hold (expired, or beyond
    /// `MAX_OVERLAY_KEYS`) are left alone.
    pub fn prefill_done(&mut self, i: usize, keys: &[BlockKey], now: Duration) {
        if let Some(r) = self.replicas.get_mut(i) {
            for k in keys {
                if let Some(e) = r.overlay.get_mut(&k.0) {
                    if e.ready > now && e.until > now {
                        e.ready = now;
                    }
                    e.confirmed |= e.until > now;
                }
            }
        }
    }

    /// A request routed to replica `i` failed before its first byte: its keys that only it put
    /// in the overlay (still waiting for their predicted prefill end, so nothing confirmed them)
    /// leave it, so a refused request does not draw its prefix's next requests to that replica.
    pub fn routed_failed(&mut self, i: usize, keys: &[BlockKey], now: Duration) {
        if let Some(r) = self.replicas.get_mut(i) {
            for k in keys {
                if r.overlay.get(&k.0).is_some_and(|e| e.ready > now) {
                    r.overlay.remove(&k.0);
                }
            }
        }
    }

    /// A request routed to replica `i` finished (or failed).
    pub fn finished(&mut self, i: usize) {
        if let Some(r) = self.replicas.get_mut(i) {
            r.load.in_flight = r.load.in_flight.saturating_sub(1);
        }
    }

    /// Drops expired overlay entries. Call on a timer.
    pub fn expire_overlay(&mut self, now: Duration) {
        for r in &mut self.replicas {
            r.overlay.retain(|_, e| e.until > now);
        }
    }

    /// The longest prompt this node routed to replica `i` that `keys` repeat or extend and that is
    /// still being computed there: its length in blocks and when its prefill is predicted done.
    /// `from` is the run already counting (the request's hit); the ride starts there, so
    /// `keys[from]` must be one the overlay holds.
    ///
    /// A routed prompt's keys join the overlay whole, and a key depends on every block before
    /// it, so the keys the overlay holds (counting or still ahead) are prefix-closed along
    /// `keys`: the run's end is found by bisection, a few lookups however long the prompt. Its
    /// last key's `ready` is the prefill's end (the block computed last).
    pub fn pending_run(
        &self,
        i: usize,
        keys: &[BlockKey],
        from: usize,
        now: Duration,
    ) -> Option<(usize, Duration)> {
        let r = self.replicas.get(i)?;
        if r.overlay.is_empty() {
            return None;
        }
        let held = |j: usize| r.overlay.get(&keys[j].0).is_some_and(|e| now < e.until);
        if from >= keys.len() || !held(from) {
            return None;
        }
        // `held(end - 1)` holds; the largest such `end` in `from + 1 ..= keys.len()`.
        let (mut end, mut past) = (from + 1, keys.len());
        while end < past {
            let mid = end + (past - end).div_ceil(2);
            if held(mid - 1) {
                end = mid;
            } else {
                past = mid - 1;
            }
        }
        let ready = r.overlay.get(&keys[end - 1].0)?.ready;
        (ready > now).then_some((end, ready))
    }

    /// Leading `keys` replica `i` holds on GPU *now* as far as this node knows for certain: in
    /// its summary (the home's cache model) or in overlay entries a first byte confirmed
    /// ([`View::prefill_done`]). Predicted blocks — a routed request still computing them, a
    /// peer's tip — do not count: this is what a KV pull may take from `i` (`fetch_plan.rs`),
    /// and a pull of blocks not yet computed fails and leaves the whole prompt to recompute.
    /// Searched as [`View::hit_tiers`] searches (the held set is prefix-closed); called for one
    /// replica per decision, and only with `[kv_fetch]` on.
    pub fn hit_settled(&self, i: usize, keys: &[BlockKey], now: Duration) -> usize {
        let Some(r) = self.replicas.get(i) else {
            return 0;
        };
        let summary = r.summary.as_deref();
        leading_run(keys.len(), 0, |j| {
            summary.is_some_and(|s| s.contains(keys[j]))
                || r.overlay
                    .get(&keys[j].0)
                    .is_some_and(|e| e.confirmed && e.ready <= now && now < e.until)
        })
    }

    /// Overlay size of a replica (for metrics and tests).
    pub fn overlay_len(&self, i: usize) -> usize {
        self.replicas.get(i).map_or(0, |r| r.overlay.len())
    }

    /// Leading `keys` that replica `i` holds in any tier, as far as this node knows: its summary
    /// or overlay. [`View::hit_tiers`] splits it by tier.
    pub fn hit(&self, i: usize, keys: &[BlockKey], now: Duration) -> usize {
        self.hit_tiers(i, keys, now).any
    }

    /// Leading `keys` that replica `i` holds, by tier.
    ///
    /// An engine's cache is prefix-closed (it evicts the tails of chains first, and a block is
    /// only reusable after its predecessors), so "block j is held" is monotone in j and the
    /// length of the held run can be found by exponential then binary search: about 2·log2(hit)
    /// filter probes instead of `hit + 1`, which is what keeps a 32k-token decision over 64
    /// replicas in microseconds. The price: a Bloom false positive at a probed position past the
    /// true end overestimates the hit (probability ≈ fp_rate × log2(hit) per replica), where a
    /// linear scan would overestimate by one block with probability fp_rate.
    ///
    /// With offload the same holds per tier: the union of tiers is prefix-closed and, as each
    /// tier evicts its least recently used blocks to the next, the GPU set is a prefix of it and
    /// GPU ∪ CPU too. So three searches, each starting where the previous stopped: GPU (plain
    /// keys and the overlay — just-routed blocks are computed on GPU), then CPU-salted keys,
    /// then CPU- or disk-salted keys. The last two run only when the summary has lower-tier keys
    /// at all and the GPU run stopped before the end, so a replica without offload costs what
    /// it did before tiers.
    pub fn hit_tiers(&self, i: usize, keys: &[BlockKey], now: Duration) -> TierHit {
        let mut scratch = HitScratch::default();
        scratch.reset(keys.len());
        self.hit_tiers_with(i, keys, now, &mut scratch)
    }

    /// [`View::hit`] with the keys' filter hashes memoised in `scratch` across the replicas of
    /// one decision (call [`HitScratch::reset`] once per request).
    pub fn hit_with(
        &self,
        i: usize,
        keys: &[BlockKey],
        now: Duration,
        scratch: &mut HitScratch,
    ) -> usize {
        self.hit_tiers_with(i, keys, now, scratch).any
    }

    /// [`View::hit_tiers`] with the keys' filter hashes memoised in `scratch` across the
    /// replicas of one decision (call [`HitScratch::reset`] once per request). The router's hot
    /// path.
    #[inline]
    pub fn hit_tiers_with(
        &self,
        i: usize,
        keys: &[BlockKey],
        now: Duration,
        scratch: &mut HitScratch,
    ) -> TierHit {
        // The common case, kept short (a few loads and compares): the run this request's search
        // of the replica's slice already found.
        match self.found_gpu_run(i, keys.len(), scratch) {
            Some(gpu) => TierHit {
                gpu,
                cpu: gpu,
                any: gpu,
            },
            None => self.searched_hit_tiers(i, keys, now, scratch),
        }
    }

    /// Searches every slice of the bit-sliced summaries for the request's `keys` at once (each
    /// (slice, filter kind) once per request, as the first replica asked would), so that a pass
    /// over every replica can read their runs with [`View::sliced_hit`], without the checks
    /// that hold for the whole request. Call after [`HitScratch::reset`] for `keys`; the answer
    /// holds until the scratch is reset again or the view changes.
    pub fn search_slices(&self, keys: &[BlockKey], scratch: &mut HitScratch) -> SlicesSearched {
        let n = keys.len();
        if scratch.n != n || scratch.stamp == 0 {
            scratch.reset(n);
        }
        scratch
            .slice_runs
            .begin(&self.slices, scratch.stamp, self.replicas.len());
        let slices = self.replicas.len().div_ceil(SLICE_WIDTH);
        for slice in 0..slices {
            for g in 0..summary_slices::MAX_GROUPS {
                if self.slices.group(g).is_none() {
                    continue;
                }
                let mask = self.slices.members_in(slice, g);
                // A member whose summary is its column's: its filter gives the search its seed
                // and geometry (a slice whose members all changed behind the view's back is
                // left to the per-replica search).
                let Some(s) = slice_members(mask).find_map(|m| {
                    let s = self
                        .replicas
                        .get(slice * SLICE_WIDTH + m)?
                        .summary
                        .as_deref()?;
                    (self.slices.member_of(slice * SLICE_WIDTH + m, s) == Some(g)).then_some(s)
                }) else {
                    continue;
                };
                if !scratch.slice_runs.check_searched(slice, g) {
                    self.search_slice(slice, g, s, keys, scratch);
                }
            }
        }
        SlicesSearched { n }
    }

    /// Replica `i`'s (state `r`) hit as [`View::search_slices`] found it, when that is its whole
    /// hit: no overlay, no lower tiers, its summary the very filter its column was searched
    /// with. `None`: ask [`View::hit_tiers_with`]. A few loads and compares: the checks that
    /// hold for the whole request were made once, by `search_slices` (`searched` is its
    /// answer, for the same scratch and view).
    #[inline(always)]
    pub fn sliced_hit(
        &self,
        i: usize,
        r: &ReplicaState,
        scratch: &HitScratch,
        searched: SlicesSearched,
    ) -> Option<usize> {
        // (A run read for another request or view would be wrong, and is not checked for
        // here, per replica: the caller holds the view and the request across its pass.)
        debug_assert!(
            scratch.n == searched.n && scratch.slice_runs.is_on(&self.slices),
            "sliced_hit needs this request's search_slices on this view"
        );
        let run = scratch.slice_runs.run(i)?;
        let s = r.summary.as_deref()?;
        if !r.overlay.is_empty() || s.has_lower_tiers() {
            return None;
        }
        self.slices.holds(i, s).then_some(run)
    }

    /// The runs [`View::search_slices`] found (`searched` is its answer, for the same scratch
    /// and view), for one pass over every replica in order ([`SlicedHits`]); `None` when the
    /// search has no run entry for some replica (never, after `search_slices`: the pass then
    /// asks each replica apart).
    #[inline]
    pub fn sliced_hits<'a>(
        &'a self,
        scratch: &'a HitScratch,
        searched: SlicesSearched,
    ) -> Option<SlicedHits<'a>> {
        debug_assert!(
            scratch.n == searched.n && scratch.slice_runs.is_on(&self.slices),
            "sliced_hits needs this request's search_slices on this view"
        );
        let (runs, stamp) = scratch.slice_runs.current();
        (runs.len() >= self.replicas.len()).then_some(SlicedHits {
            view: self,
            runs,
            stamp,
        })
    }

    /// Replica `i`'s GPU run as this request's search of its slice found it, when that is its
    /// whole hit and still good: no overlay, no lower tiers, its summary the one searched, the
    /// scratch on this request (`n` keys) and this very state of the view.
    #[inline(always)]
    fn found_gpu_run(&self, i: usize, n: usize, scratch: &HitScratch) -> Option<usize> {
        let r = self.replicas.get(i)?;
        let s = r.summary.as_deref()?;
        if !r.overlay.is_empty() || s.has_lower_tiers() || scratch.n != n {
            return None;
        }
        let run = scratch.slice_runs.found(i, &self.slices, scratch.stamp)?;
        self.slices.holds(i, s).then_some(run)
    }

    /// [`View::hit_tiers_with`] past the common case: the first replica of its slice asked for
    /// this request (which searches the slice), an overlay, lower tiers, a filter kind not sliced.
    #[inline(never)]
    fn searched_hit_tiers(
        &self,
        i: usize,
        keys: &[BlockKey],
        now: Duration,
        scratch: &mut HitScratch,
    ) -> TierHit {
        let Some(r) = self.replicas.get(i) else {
            return TierHit::default();
        };
        let n = keys.len();
        if scratch.n != n || scratch.stamp == 0 {
            scratch.reset(n);
        }
        // Most replicas have no overlay: one test, and the lookup stays out of the hot loop.
        let overlay_empty = r.overlay.is_empty();
        let in_overlay = |j: usize| !overlay_empty && r.overlay_holds(keys[j], now);
        let Some(s) = r.summary.as_deref() else {
            let gpu = leading_run(n, 0, in_overlay);
            return TierHit {
                gpu,
                cpu: gpu,
                any: gpu,
            };
        };
        // Without an overlay, the run its slice's search found (one search per request for
        // 64 replicas). Else every replica after the first of its geometry finds the slots its
        // search probes memoised; the general path below memoises the others (and repeats the
        // same probes).
        let sliced = if overlay_empty {
            self.sliced_gpu_run(i, s, keys, scratch)
        } else {
            None
        };
        let gpu = match sliced {
            Some(gpu) => gpu,
            None => match scratch.memoised_gpu_run(s, n, in_overlay) {
                Some(gpu) => gpu,
                None => {
                    let mut probe = scratch.prober(s, keys);
                    leading_run(n, 0, |j| probe.holds(Tier::Gpu, j) || in_overlay(j))
                }
            },
        };
        if !s.has_lower_tiers() || gpu >= n {
            return TierHit {
                gpu,
                cpu: gpu,
                any: gpu,
            };
        }
        // Past the GPU run plain keys are not held (the GPU set is a prefix), so only salted
        // keys are probed.
        let mut probe = scratch.prober(s, keys);
        let cpu = leading_run(n, gpu, |j| probe.holds(Tier::Cpu, j));
        let any = leading_run(n, cpu, |j| {
            probe.holds(Tier::Disk, j) || probe.holds(Tier::Cpu, j)
        });
        TierHit { gpu, cpu, any }
    }

    /// Replica `i`'s GPU run (its summary `s`, no overlay) from its slice's lockstep search,
    /// made on the first of the slice's replicas asked for this request: `None` when its filter
    /// kind is not sliced, its column is not of this very summary, or the search gave up.
    #[inline]
    fn sliced_gpu_run(
        &self,
        i: usize,
        s: &ReplicaSummary,
        keys: &[BlockKey],
        scratch: &mut HitScratch,
    ) -> Option<usize> {
        let runs = &mut scratch.slice_runs;
        runs.begin(&self.slices, scratch.stamp, self.replicas.len());
        if let Some(run) = runs.run(i) {
            // Found for its column: good while the column holds this very summary.
            return self.slices.holds(i, s).then_some(run);
        }
        let g = self.slices.member_of(i, s)?;
        let slice = i / SLICE_WIDTH;
        if runs.check_searched(slice, g) {
            return None;
        }
        self.search_slice(slice, g, s, keys, scratch);
        scratch.slice_runs.run(i)
    }

    /// Runs the lockstep search of `slice` for kind `g` (whose filters are `s`'s seed and
    /// geometry) over its members, and records their runs in the scratch (a member with an
    /// overlay, or whose summary is no longer its column's, gets a run it does not use).
    #[inline(never)]
    fn search_slice(
        &self,
        slice: usize,
        g: usize,
        s: &ReplicaSummary,
        keys: &[BlockKey],
        scratch: &mut HitScratch,
    ) {
        let Some(words) = self.slices.group(g).and_then(|group| group.slice(slice)) else {
            return;
        };
        let mask = self.slices.members_in(slice, g);
        // The runs live in the scratch the prober borrows: out for the search, then back.
        let mut runs = std::mem::take(&mut scratch.slice_runs);
        let mut work = std::mem::take(&mut runs.work);
        let mut probe = scratch.prober(s, keys);
        summary_slices::lockstep_runs(
            keys.len(),
            mask,
            &mut work,
            |j| {
                probe
                    .positions(j)
                    .map(|p| summary_slices::held_in(words, p))
            },
            |m, run| runs.record(slice, m, run),
        );
        runs.work = work;
        scratch.slice_runs = runs;
    }
}

/// Proof that [`View::search_slices`] ran for a request: what [`View::sliced_hit`] reads by.
#[derive(Clone, Copy, Debug)]
pub struct SlicesSearched {
    /// The request's keys.
    n: usize,
}

/// [`View::search_slices`]'s runs for a pass over every replica of the view in order: the
/// run entries walked alongside the replicas ([`SlicedHits::found`]), so a replica's run is a
/// load and a compare, and [`SlicedHits::hit`] makes [`View::sliced_hit`]'s checks on it. For
/// the view and scratch it was made from, until either changes.
#[derive(Clone, Copy, Debug)]
pub struct SlicedHits<'a> {
    view: &'a View,
    /// Per replica (at least as many as the view has): the stamp of the request its run was
    /// found for, and the run.
    runs: &'a [(u32, u32)],
    /// The current request's stamp.
    stamp: u32,
}

impl<'a> SlicedHits<'a> {
    /// Per replica of the view, in order (and past them, more): the run its slice's search
    /// found for this request, if it found one.
    #[inline]
    pub fn found(&self) -> impl Iterator<Item = Option<u32>> + 'a {
        let stamp = self.stamp;
        self.runs
            .iter()
            .map(move |&(s, run)| (s == stamp).then_some(run))
    }

    /// Replica `i`'s (state `r`) hit from `found`, its entry of [`SlicedHits::found`], when
    /// that is its whole hit: [`View::sliced_hit`]'s answer.
    #[inline(always)]
    pub fn hit(&self, i: usize, r: &ReplicaState, found: Option<u32>) -> Option<usize> {
        let run = found?;
        let s = r.summary.as_deref()?;
        if !r.overlay.is_empty() || s.has_lower_tiers() {
            return None;
        }
        self.view.slices.holds(i, s).then_some(run as usize)
    }
}

/// The members of a slice's `mask`, by position in the slice.
fn slice_members(mut mask: u64) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        if mask == 0 {
            return None;
        }
        let m = mask.trailing_zeros() as usize;
        mask &= mask - 1;
        Some(m)
    })
}

/// Leading blocks a replica holds, as cumulative run lengths by tier: `gpu ≤ cpu ≤ any`.
/// Blocks `0..gpu` are on GPU, `gpu..cpu` in CPU memory (best copy), `cpu..any` on disk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierHit {
    /// Leading blocks held on GPU.
    pub gpu: usize,
    /// Leading blocks held on GPU or in CPU memory.
    pub cpu: usize,
    /// Leading blocks held in any tier (the plain hit).
    pub any: usize,
}

/// The length of the leading run of positions `0..n` that `held` accepts, given that positions
/// below `start` are held (and `held` is monotone): one probe at `start`, then exponential then
/// binary search. Invariant in the loops: `held(lo)`, and `hi` is not held or is `n`.
#[inline]
fn leading_run(n: usize, start: usize, mut held: impl FnMut(usize) -> bool) -> usize {
    match try_leading_run(n, start, |j| Ok::<bool, Infallible>(held(j))) {
        Ok(run) => run,
        Err(never) => match never {},
    }
}

/// [`leading_run`] with a `held` that may give up (`Err`), which ends the search. Same probes
/// in the same order, so when no probe gives up the result is `leading_run`'s.
#[inline]
fn try_leading_run<E>(
    n: usize,
    start: usize,
    mut held: impl FnMut(usize) -> Result<bool, E>,
) -> Result<usize, E> {
    if start >= n || !held(start)? {
        return Ok(start.min(n));
    }
    let (mut lo, mut step) = (start, 1usize);
    let mut hi = loop {
        let probe = lo + step;
        if probe >= n {
            break n;
        }
        if !held(probe)? {
            break probe;
        }
        lo = probe;
        step *= 2;
    };
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if held(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(hi)
}

/// Probe slots per key: the plain key (slot `j`), then its CPU-salted (`n + j`) and disk-salted
/// (`2n + j`) forms.
const SLOTS_PER_KEY: usize = 3;
/// Filter geometries a scratch memoises probe positions for. A fleet has one per replica size,
/// rarely more than two; a replica of yet another geometry is probed the slower way.
const MAX_MEMO_GEOMETRIES: usize = 4;
/// Hash functions per key up to which positions are memoised (an fp rate of 1% gives 7, 0.1%
/// gives 10); beyond that the filter is probed the slower way.
const MAX_MEMO_HASHES: u32 = 32;

/// What one decision computes about its request's keys once, to probe every replica's filter
/// with: each key's filter hashes (two SipHash rounds) and, per filter geometry, the bit
/// positions they probe (a 64-bit division each). Every filter of a cluster shares one seed, so
/// both are the same for every replica of a geometry: testing a replica's filter for a key is
/// then a stamp check and a handful of loads. Entries carry the stamp of the request they were
/// computed for, so starting a request ([`HitScratch::reset`]) clears nothing, and a decision
/// allocates nothing once the buffers have grown to the longest request.
#[derive(Debug, Default)]
pub struct HitScratch {
    hasher: Option<KeyHasher>,
    /// Keys of the current request.
    n: usize,
    /// The current request's stamp (never 0 once reset; entries start at 0).
    stamp: u32,
    /// Per probe slot: the stamp it was computed for, and the hashes.
    hashes: Vec<(u32, KeyHashes)>,
    /// Probe positions, per filter geometry met.
    geometries: Vec<GeometryMemo>,
    /// Whether a tier-salted key was hashed for the current request (requests that never meet
    /// a replica with lower tiers should not).
    tier_hashed: bool,
    /// GPU runs found by slice searches (`summary_slices.rs`) for the current request.
    slice_runs: SliceRuns,
    /// Keys' filter hashes from earlier requests ([`RecentKeyHashes`]).
    recent: RecentKeyHashes,
}

/// The filter hashes of keys hashed for earlier requests, kept across requests (the stamped
/// `HitScratch::hashes` serve one request): a direct-mapped table of [`RecentKeyHashes::SLOTS`]
/// entries, each (seed fingerprint, key, hashes), so a key hashed before under the same seed
/// costs a few loads and compares instead of two SipHash rounds (~440 instructions). Why:
/// consecutive requests share their prefixes (a conversation's turns, a system prompt, the
/// siblings of a rollout), so the keys a decision's slice search probes were mostly hashed
/// by an earlier decision; at 64 and 512 replicas the 13 keys the benchmark's search probes
/// were ~5.7k instructions of every decision (`scripts/decision-instructions.sh`). A key not
/// seen before pays the lookup and the store, ~15 instructions on top of its hashes. Fixed
/// size (40 KiB, allocated on first use), whatever keys the requests bring; a slot another
/// key took is a miss, never a wrong answer: the key is compared in full and the seed by the
/// fingerprint summaries are already matched by (`KeyHasher::seed_id`).
#[derive(Debug, Default)]
struct RecentKeyHashes {
    /// `SLOTS` entries once used (empty before); `None` until a key is stored there.
    slots: Vec<Option<RecentKeyHash>>,
}

/// One [`RecentKeyHashes`] entry.
#[derive(Clone, Copy, Debug)]
struct RecentKeyHash {
    /// [`KeyHasher::seed_id`] of the hasher that hashed it.
    seed_id: u64,
    key: BlockKey,
    hashes: KeyHashes,
    /// Its GPU probe positions in the filters of one geometry, the last it was memoised for
    /// ([`RecentKeyHashes::positions`]); `None` until then, or when that geometry has more
    /// hashes than [`RECENT_POSITIONS`].
    positions: Option<(FilterGeometry, [u32; RECENT_POSITIONS])>,
}

/// Probe positions a [`RecentKeyHashes`] entry keeps: enough for a false-positive rate of 0.1 %
/// (10 hashes; 1 %, the default, has 7). A geometry with more is memoised afresh each request.
const RECENT_POSITIONS: usize = 10;

impl RecentKeyHashes {
    /// Entries (a power of two: the slot is the key's low bits, keys being hashes already).
    const SLOTS: usize = 1024;

    /// `hasher.hash(key)`, from the table when the key was hashed with that seed before.
    #[inline]
    fn hash(&mut self, hasher: &KeyHasher, key: BlockKey) -> KeyHashes {
        let seed_id = hasher.seed_id();
        let at = key.0 as usize & (Self::SLOTS - 1);
        if let Some(Some(e)) = self.slots.get(at) {
            if e.key == key && e.seed_id == seed_id {
                return e.hashes;
            }
        }
        let hashes = hasher.hash(key);
        if self.slots.is_empty() {
            self.slots.resize(Self::SLOTS, None);
        }
        if let Some(slot) = self.slots.get_mut(at) {
            *slot = Some(RecentKeyHash {
                seed_id,
                key,
                hashes,
                positions: None,
            });
        }
        hashes
    }

    /// The GPU probe positions of `key` (hashed with `seed_id`) in filters of `geometry`, when
    /// an earlier request memoised them here ([`RecentKeyHashes::keep_positions`]).
    #[inline]
    fn positions(&self, seed_id: u64, key: BlockKey, geometry: FilterGeometry) -> Option<&[u32]> {
        let at = key.0 as usize & (Self::SLOTS - 1);
        let e = self.slots.get(at)?.as_ref()?;
        if e.key != key || e.seed_id != seed_id {
            return None;
        }
        let (kept, positions) = e.positions.as_ref()?;
        if *kept != geometry {
            return None;
        }
        positions.get(..geometry.hashes() as usize)
    }

    /// Keeps `positions`, `key`'s (hashed with `seed_id`) GPU probe positions in filters of
    /// `geometry`, with its entry, if the entry is still that key's and they fit.
    fn keep_positions(
        &mut self,
        seed_id: u64,
        key: BlockKey,
        geometry: FilterGeometry,
        positions: &[u32],
    ) {
        let at = key.0 as usize & (Self::SLOTS - 1);
        let Some(Some(e)) = self.slots.get_mut(at) else {
            return;
        };
        if e.key != key || e.seed_id != seed_id || positions.len() > RECENT_POSITIONS {
            return;
        }
        let mut kept = [0; RECENT_POSITIONS];
        kept[..positions.len()].copy_from_slice(positions);
        e.positions = Some((geometry, kept));
    }
}

/// Probe positions of one request's keys in filters of one geometry.
#[derive(Debug)]
struct GeometryMemo {
    geometry: FilterGeometry,
    /// The last request stamp this memo served (a full scratch recycles one not used by the
    /// current request).
    used: u32,
    /// Per probe slot, `geometry.hashes() + 1` words: the stamp of the request its positions
    /// were computed for, then the positions. One buffer, so a probe checks one range.
    slots: Vec<u32>,
}

impl GeometryMemo {
    /// Sizes the buffers for `slots` probe slots (grows only).
    fn fit(&mut self, slots: usize) {
        let want = slots.saturating_mul(self.stride());
        if self.slots.len() < want {
            self.slots.resize(want, 0);
        }
    }

    /// Words per slot: the stamp, then the positions.
    fn stride(&self) -> usize {
        self.geometry.hashes() as usize + 1
    }
}

impl HitScratch {
    /// Starts a request of `n` keys: forgets the previous request's hashes and positions.
    pub fn reset(&mut self, n: usize) {
        self.n = n;
        self.next_stamp();
        let slots = n.saturating_mul(SLOTS_PER_KEY);
        if self.hashes.len() < slots {
            self.hashes.resize(slots, (0, KeyHashes::default()));
        }
        for m in &mut self.geometries {
            m.fit(slots);
        }
    }

    /// A stamp no entry carries yet.
    fn next_stamp(&mut self) {
        self.stamp = self.stamp.wrapping_add(1);
        self.tier_hashed = false;
        if self.stamp == 0 {
            // Wrapped (after 2³² requests): entries of 2³² requests ago would pass for current.
            self.hashes.iter_mut().for_each(|e| e.0 = 0);
            for m in &mut self.geometries {
                let stride = m.stride();
                m.slots.iter_mut().step_by(stride).for_each(|s| *s = 0);
                m.used = 0;
            }
            self.stamp = 1;
        }
    }

    /// A prober of `summary`'s filter for the current request's `keys`: makes the hasher the
    /// one of the filter's seed and finds (or makes) the memo of its geometry, once per replica.
    #[inline]
    fn prober<'a>(&'a mut self, summary: &'a ReplicaSummary, keys: &'a [BlockKey]) -> Prober<'a> {
        if self
            .hasher
            .as_ref()
            .is_none_or(|h| h.seed_id() != summary.seed_id())
        {
            // Only on the first decision (or a seed change, which config forbids): what was
            // computed with another seed no longer counts.
            self.hasher = Some(summary.key_hasher());
            let tier_hashed = self.tier_hashed;
            self.next_stamp();
            self.tier_hashed = tier_hashed;
        }
        let g = summary.geometry();
        let at = match self.geometries.iter().position(|m| m.geometry == g) {
            Some(at) => Some(at),
            None => self.add_geometry(g),
        };
        let stamp = self.stamp;
        let memo = match at.and_then(|at| self.geometries.get_mut(at)) {
            Some(m) => {
                m.used = stamp;
                &mut m.slots[..]
            }
            None => &mut [],
        };
        Prober {
            summary,
            bits: summary.bits(),
            keys,
            n: self.n,
            stride: g.hashes() as usize + 1,
            stamp,
            hasher: self.hasher.as_ref(),
            hashes: &mut self.hashes,
            recent: &mut self.recent,
            memo,
            tier_hashed: &mut self.tier_hashed,
        }
    }

    /// The GPU run of `summary` (and the overlay, `in_overlay`) for the current request's `n`
    /// keys when every slot the search probes has its positions memoised: the router's hot
    /// path, a stamp check and a few loads per probe. `None` as soon as a probe finds its slot
    /// not memoised (or the filter's seed or geometry has no memo): the caller then runs the
    /// general path, which memoises.
    #[inline]
    fn memoised_gpu_run(
        &mut self,
        summary: &ReplicaSummary,
        n: usize,
        mut in_overlay: impl FnMut(usize) -> bool,
    ) -> Option<usize> {
        if self
            .hasher
            .as_ref()
            .is_none_or(|h| h.seed_id() != summary.seed_id())
        {
            return None;
        }
        let g = summary.geometry();
        let stamp = self.stamp;
        let m = self.geometries.iter_mut().find(|m| m.geometry == g)?;
        m.used = stamp;
        let memo = &m.slots[..];
        let stride = g.hashes() as usize + 1;
        let bits = summary.bits();
        try_leading_run(n, 0, |j| {
            let at = j * stride;
            match memo.get(at..at + stride) {
                Some([s, positions @ ..]) if *s == stamp => {
                    Ok(bits.contains_positions(positions) || in_overlay(j))
                }
                _ => Err(()),
            }
        })
        .ok()
    }

    /// A memo for geometry `g`, new or recycled from one the current request has not used.
    #[cold]
    fn add_geometry(&mut self, g: FilterGeometry) -> Option<usize> {
        if g.hashes() == 0 || g.hashes() > MAX_MEMO_HASHES {
            return None;
        }
        let at = if self.geometries.len() < MAX_MEMO_GEOMETRIES {
            self.geometries.push(GeometryMemo {
                geometry: g,
                used: self.stamp,
                slots: Vec::new(),
            });
            self.geometries.len() - 1
        } else {
            let stamp = self.stamp;
            let at = self.geometries.iter().position(|m| m.used != stamp)?;
            let m = self.geometries.get_mut(at)?;
            // Cleared, not just relabelled: under another stride an old position would be
            // read as a stamp, and could equal the current one.
            m.slots.iter_mut().for_each(|w| *w = 0);
            m.geometry = g;
            m.used = stamp;
            at
        };
        let slots = self.n.saturating_mul(SLOTS_PER_KEY);
        self.geometries.get_mut(at)?.fit(slots);
        Some(at)
    }
}

/// Probes one replica's filter for one request's keys, with the request's memoised hashes and
/// positions ([`HitScratch::prober`]).
struct Prober<'a> {
    summary: &'a ReplicaSummary,
    bits: FilterBits<'a>,
    keys: &'a [BlockKey],
    /// Keys of the request (probe slots per tier).
    n: usize,
    /// Memo words per probe slot: the stamp, then this geometry's positions.
    stride: usize,
    stamp: u32,
    hasher: Option<&'a KeyHasher>,
    hashes: &'a mut [(u32, KeyHashes)],
    /// Hashes of earlier requests' keys, consulted before hashing one afresh.
    recent: &'a mut RecentKeyHashes,
    /// The geometry's memo ([`GeometryMemo::slots`]); empty when the geometry has none.
    memo: &'a mut [u32],
    tier_hashed: &'a mut bool,
}

impl Prober<'_> {
    /// Whether the filter (probably) holds key `j` salted for `tier`: the answer of
    /// [`ReplicaSummary::contains`] on [`Tier::summary_key`].
    #[inline]
    fn holds(&mut self, tier: Tier, j: usize) -> bool {
        let slot = match tier {
            Tier::Gpu => j,
            Tier::Cpu => self.n + j,
            Tier::Disk => 2 * self.n + j,
        };
        let at = slot * self.stride;
        if let Some([stamp, positions @ ..]) = self.memo.get(at..at + self.stride) {
            if *stamp == self.stamp {
                return self.bits.contains_positions(positions);
            }
        }
        self.holds_first(tier, j, slot)
    }

    /// Key `j`'s (GPU) probe positions in this geometry, memoised; `None` when the geometry has
    /// no memo or a position does not fit.
    #[inline]
    fn positions(&mut self, j: usize) -> Option<&[u32]> {
        let at = j * self.stride;
        let memoised = matches!(self.memo.get(at), Some(&stamp) if stamp == self.stamp);
        if !memoised {
            self.memoise(j)?;
        }
        self.memo.get(at + 1..at + self.stride)
    }

    /// Memoises key `j`'s GPU positions: as an earlier request found them for this geometry
    /// ([`RecentKeyHashes::positions`]), else from its hashes (hashed unless already hashed for
    /// this request), and then kept for the next request. Why keep them: a key's positions are
    /// a 64-bit division or two per hash (~250 instructions a key at 7 hashes), and a request's
    /// slice search probes the same ~13 keys as the one before whenever they share a prefix
    /// (`scripts/decision-instructions.sh`: ~2.5k instructions of a decision at any fleet size).
    #[cold]
    fn memoise(&mut self, j: usize) -> Option<()> {
        let key = *self.keys.get(j)?;
        let geometry = self.summary.geometry();
        let at = j * self.stride;
        let [stamp, positions @ ..] = self.memo.get_mut(at..at + self.stride)? else {
            return None;
        };
        let seed_id = self.hasher.map(KeyHasher::seed_id);
        if let Some(kept) = seed_id.and_then(|seed| self.recent.positions(seed, key, geometry)) {
            if kept.len() == positions.len() {
                positions.copy_from_slice(kept);
                *stamp = self.stamp;
                return Some(());
            }
        }
        let h = match self.hashes.get(j) {
            Some(&(s, h)) if s == self.stamp => h,
            _ => {
                let h = match self.hasher {
                    Some(hasher) => self.recent.hash(hasher, key),
                    None => self.summary.key_hasher().hash(key),
                };
                *self.hashes.get_mut(j)? = (self.stamp, h);
                h
            }
        };
        if !geometry.probe_positions(h, positions) {
            return None;
        }
        if let Some(seed) = seed_id {
            self.recent.keep_positions(seed, key, geometry, positions);
        }
        *stamp = self.stamp;
        Some(())
    }

    /// [`Prober::holds`] for a slot whose positions are not memoised yet: hashes the key
    /// (unless a filter of another geometry already did) and memoises its positions.
    #[inline(never)]
    fn holds_first(&mut self, tier: Tier, j: usize, slot: usize) -> bool {
        let Some(&key) = self.keys.get(j) else {
            return false;
        };
        let h = match self.hashes.get(slot) {
            Some(&(s, h)) if s == self.stamp => h,
            _ => {
                let key = tier.summary_key(key);
                let h = match self.hasher {
                    Some(hasher) => self.recent.hash(hasher, key),
                    None => self.summary.key_hasher().hash(key),
                };
                if let Some(e) = self.hashes.get_mut(slot) {
                    *e = (self.stamp, h);
                }
                if tier != Tier::Gpu {
                    *self.tier_hashed = true;
                }
                h
            }
        };
        let at = slot * self.stride;
        if let Some([stamp, positions @ ..]) = self.memo.get_mut(at..at + self.stride) {
            if self.summary.geometry().probe_positions(h, positions) {
                *stamp = self.stamp;
                return self.bits.contains_positions(positions);
            }
        }
        self.summary.contains_hashed(h)
    }
}

/// Test helpers shared by the core's tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::ReplicaInfo;

    /// A replica of model `m` in pool `shared`, 50k prefill tokens/s.
    pub fn info(id: &str, region: &str) -> ReplicaInfo {
        ReplicaInfo {
            id: id.into(),
            url: format!("http://{id}"),
            region: region.into(),
            zone: String::new(),
            pool: "shared".into(),
            models: vec!["m".into()],
            capacity_tokens: 450_000,
            prefill_tokens_per_s: 50_000.0,
            prefill_attention_ms_per_pair: super::DEFAULT_PREFILL_ATTENTION_MS_PER_PAIR,
            max_in_flight: 256,
            pd: super::PdFacts::default(),
            kv_load: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::testing::info;
    use super::*;
    use crate::core::summary::SummaryConfig;

    #[test]
    fn a_failed_attempt_takes_back_only_its_unconfirmed_overlay_keys() {
        let mut v = View::new("eu", 64);
        let i = v.upsert(info("r0", "eu"));
        let t0 = Duration::from_secs(100);
        let shared: Vec<BlockKey> = (1..=2).map(BlockKey).collect();
        let mine: Vec<BlockKey> = (1..=4).map(BlockKey).collect();
        // An earlier request's prefill is done: its keys are confirmed.
        v.record_routed_ready(i, &shared, t0, Duration::from_secs(1));
        v.prefill_done(i, &shared, t0 + Duration::from_millis(500));
        let t1 = t0 + Duration::from_secs(1);
        v.record_routed_ready(i, &mine, t1, Duration::from_secs(2));
        assert_eq!(v.hit(i, &mine, t1 + Duration::from_secs(3)), 4);
        // It is refused before its first byte: what it alone promised is gone.
        v.routed_failed(i, &mine, t1 + Duration::from_millis(100));
        assert_eq!(v.hit(i, &mine, t1 + Duration::from_secs(3)), 2);
        assert_eq!(v.overlay_len(i), 2);
    }

    /// The engine's figures are read once a scrape interval; the routers see each request
    /// finish. A figure read while the routers' requests ran must not keep the replica busy
    /// after they finished (then look idle to every node at once when the next scrape comes):
    /// only what the engine counted beyond the routers' requests stays until the next read.
    #[test]
    fn an_engine_figure_counts_only_what_the_routers_did_not_send() {
        let mut v = View::new("eu", 64);
        let i = v.upsert(info("r0", "eu"));
        let t0 = Duration::from_secs(100);
        let load = |v: &View| v.replica(i).unwrap().load.outstanding();
        for _ in 0..10 {
            v.record_routed(i, &[], t0);
        }
        // Read while this node's ten run, plus two requests that reached the engine directly.
        v.set_engine_load(i, 0, 12, 0.5, 0);
        assert_eq!(load(&v), 12);
        for _ in 0..8 {
            v.finished(i);
        }
        assert_eq!(
            load(&v),
            4,
            "two of this node's, two that bypassed the routers"
        );
        // The region's other routers' requests, shared a moment later, count at once.
        v.set_shared_load(i, 5, 0);
        assert_eq!(load(&v), 9);
        // The next read: the engine counts fewer than the routers (requests in transit).
        v.set_engine_load(i, 0, 3, 0.5, 0);
        assert_eq!(load(&v), 7, "the routers' fresh count, nothing added");
    }

    #[test]
    fn overlay_counts_until_its_ttl_and_summary_takes_over() {
        let mut v = View::new("eu", 64);
        let i = v.upsert(info("r0", "eu"));
        let keys: Vec<BlockKey> = (1..=4).map(BlockKey).collect();
        let t0 = Duration::from_secs(100);
        v.record_routed(i, &keys, t0);
        assert_eq!(v.hit(i, &keys, t0), 4);
        assert_eq!(v.replica(i).unwrap().load.in_flight, 1);
        assert_eq!(
            v.hit(i, &keys, t0 + Duration::from_secs(11)),
            0,
            "overlay expired"
        );
        let mut s = ReplicaSummary::new(1, 100, &SummaryConfig::for_cluster("c")).unwrap();
        s.insert(&keys[..2]);
        v.set_summary(i, s);
        assert_eq!(
            v.overlay_len(i),
            2,
            "keys covered by the summary leave the overlay"
        );
        assert_eq!(v.hit(i, &keys, t0), 4, "summary and overlay together");
        v.expire_overlay(t0 + Duration::from_secs(11));
        assert_eq!(v.hit(i, &keys, t0), 2);
        v.finished(i);
        v.finished(i);
        assert_eq!(v.replica(i).unwrap().load.in_flight, 0);
    }

    /// What a pull may take: the summary's blocks and the overlay's blocks a first byte
    /// confirmed, not blocks only predicted ready (a request may still be computing them).
    #[test]
    fn settled_blocks_are_the_summarys_and_the_confirmed_overlays() {
        let keys: Vec<BlockKey> = (1..=8).map(BlockKey).collect();
        let mut v = View::new("eu", 16);
        let i = v.upsert(info("r", "eu"));
        let t0 = Duration::from_secs(10);
        v.record_routed_ready(i, &keys, t0, Duration::from_secs(1));
        let later = t0 + Duration::from_secs(2);
        assert_eq!(v.hit(i, &keys, later), 8, "predicted ready");
        assert_eq!(v.hit_settled(i, &keys, later), 0, "but not confirmed");
        v.prefill_done(i, &keys[..5], t0 + Duration::from_millis(500));
        assert_eq!(v.hit_settled(i, &keys, later), 5);
        let mut s = ReplicaSummary::new(1, 100, &SummaryConfig::for_cluster("c")).unwrap();
        s.insert(&keys[..6]);
        v.set_summary(i, s);
        assert_eq!(v.hit_settled(i, &keys, later), 6);
    }

    #[test]
    fn overlay_keys_count_from_the_predicted_first_token() {
        let mut v = View::new("eu", 64);
        let i = v.upsert(info("r0", "eu"));
        let keys: Vec<BlockKey> = (1..=4).map(BlockKey).collect();
        let t0 = Duration::from_secs(100);
        // Queued behind 5 s of work: the blocks are promised, not cached.
        v.record_routed_ready(i, &keys[..2], t0, Duration::from_secs(5));
        assert_eq!(v.hit(i, &keys, t0 + Duration::from_secs(1)), 0);
        assert_eq!(v.hit(i, &keys, t0 + Duration::from_secs(5)), 2);
        // Counted for the TTL after they are ready, not after routing.
        assert_eq!(v.hit(i, &keys, t0 + Duration::from_secs(14)), 2);
        assert_eq!(v.hit(i, &keys, t0 + Duration::from_secs(15)), 0);
        // A held key keeps its earlier start when a later request promises it again.
        let t1 = t0 + Duration::from_secs(6);
        v.record_routed_ready(i, &keys, t1, Duration::from_secs(3));
        assert_eq!(v.hit(i, &keys, t1), 2, "the first two stay held");
        assert_eq!(v.hit(i, &keys, t1 + Duration::from_secs(3)), 4);
        assert_eq!(v.replica(i).unwrap().load.in_flight, 2);
        // Its prefill is known done earlier than predicted (first byte): it counts from then.
        let t2 = t1 + Duration::from_secs(1);
        v.prefill_done(i, &keys, t2);
        assert_eq!(v.hit(i, &keys, t2), 4);
    }

    #[test]
    fn hit_search_matches_a_linear_scan_on_prefix_closed_sets() {
        let cfg = SummaryConfig::for_cluster("c");
        let keys: Vec<BlockKey> = (0..600u64)
            .map(|k| BlockKey(k.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
            .collect();
        for held in [0usize, 1, 2, 3, 7, 8, 100, 511, 512, 599, 600] {
            let mut v = View::new("eu", 64);
            let i = v.upsert(info("r0", "eu"));
            let mut s = ReplicaSummary::new(1, 10_000, &cfg).unwrap();
            s.insert(&keys[..held]);
            let linear = s.hit(&keys);
            v.set_summary(i, s);
            assert_eq!(v.hit(i, &keys, Duration::ZERO), linear, "held {held}");
            for len in [0usize, 1, 5, 64, 599] {
                assert_eq!(
                    v.hit(i, &keys[..len], Duration::ZERO),
                    linear.min(len),
                    "held {held} len {len}"
                );
            }
        }
    }

    fn tiered_view(gpu: usize, cpu: usize, disk: usize, keys: &[BlockKey]) -> View {
        let mut v = View::new("eu", 64);
        let i = v.upsert(info("r0", "eu"));
        let mut s = ReplicaSummary::new(1, 10_000, &SummaryConfig::for_cluster("c")).unwrap();
        s.insert(&keys[..gpu]);
        s.insert_tier(&keys[gpu..gpu + cpu], Tier::Cpu);
        s.insert_tier(&keys[gpu + cpu..gpu + cpu + disk], Tier::Disk);
        v.set_summary(i, s);
        v
    }

    #[test]
    fn a_prefix_half_on_gpu_and_half_on_cpu_is_split_by_tier() {
        let keys: Vec<BlockKey> = (0..200u64)
            .map(|k| BlockKey(k.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
            .collect();
        let v = tiered_view(50, 50, 0, &keys);
        let h = v.hit_tiers(0, &keys, Duration::ZERO);
        assert_eq!(
            h,
            TierHit {
                gpu: 50,
                cpu: 100,
                any: 100
            }
        );
        assert_eq!(
            v.hit(0, &keys, Duration::ZERO),
            100,
            "the plain hit counts every tier"
        );
        // Just-routed blocks count as GPU (the overlay), ahead of the summary's tiers.
        let mut v = tiered_view(0, 100, 0, &keys);
        v.record_routed(0, &keys[..10], Duration::ZERO);
        assert_eq!(
            v.hit_tiers(0, &keys, Duration::ZERO),
            TierHit {
                gpu: 10,
                cpu: 100,
                any: 100
            }
        );
    }

    #[test]
    fn tiered_search_matches_a_linear_scan() {
        let keys: Vec<BlockKey> = (0..300u64)
            .map(|k| BlockKey(k.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
            .collect();
        for (gpu, cpu, disk) in [
            (0, 0, 1),
            (0, 7, 0),
            (1, 1, 1),
            (3, 0, 64),
            (100, 100, 100),
            (299, 0, 1),
            (0, 0, 300),
            (17, 120, 5),
        ] {
            let v = tiered_view(gpu, cpu, disk, &keys);
            let s = v.replica(0).unwrap().summary.as_ref().unwrap();
            // Linear: each key's best tier, the runs as prefixes.
            let tiers: Vec<Option<Tier>> = keys.iter().map(|k| s.tier_of(*k)).collect();
            let run =
                |ok: &dyn Fn(Tier) -> bool| tiers.iter().take_while(|t| t.is_some_and(ok)).count();
            let want = TierHit {
                gpu: run(&|t| t == Tier::Gpu),
                cpu: run(&|t| t <= Tier::Cpu),
                any: run(&|_| true),
            };
            assert_eq!(want.any, gpu + cpu + disk, "no false positive in the way");
            assert_eq!(
                v.hit_tiers(0, &keys, Duration::ZERO),
                want,
                "{gpu}/{cpu}/{disk}"
            );
        }
    }

    #[test]
    fn replicas_without_lower_tiers_cost_no_tier_probe() {
        let keys: Vec<BlockKey> = (0..64).map(BlockKey).collect();
        let v = tiered_view(10, 0, 0, &keys);
        let mut scratch = HitScratch::default();
        scratch.reset(keys.len());
        let h = v.hit_tiers_with(0, &keys, Duration::ZERO, &mut scratch);
        assert_eq!(
            h,
            TierHit {
                gpu: 10,
                cpu: 10,
                any: 10
            }
        );
        assert!(!scratch.tier_hashed, "no salted key was hashed");
        // With lower tiers, a full GPU hit needs no tier probe either.
        let v = tiered_view(64, 0, 0, &keys);
        let mut s = ReplicaSummary::new(2, 1000, &SummaryConfig::for_cluster("c")).unwrap();
        s.insert(&keys);
        s.insert_tier(&[BlockKey(999)], Tier::Cpu);
        let mut v2 = View::new("eu", 64);
        let i = v2.upsert(info("r0", "eu"));
        v2.set_summary(i, s);
        scratch.reset(keys.len());
        assert_eq!(
            v2.hit_tiers_with(i, &keys, Duration::ZERO, &mut scratch)
                .any,
            64
        );
        assert!(!scratch.tier_hashed);
        assert_eq!(v.hit(0, &keys, Duration::ZERO), 64);
    }

    /// The hit search as it was before the probe memo: every probe asks the filter itself
    /// (`ReplicaSummary::contains`, `bloomfilter`'s own hashing) and the overlay, in the order
    /// of the original exponential-then-binary search. The memoised paths must agree with it
    /// exactly, Bloom false positives included.
    fn reference_hit_tiers(v: &View, i: usize, keys: &[BlockKey], now: Duration) -> TierHit {
        fn search(n: usize, start: usize, held: impl Fn(usize) -> bool) -> usize {
            if start >= n || !held(start) {
                return start.min(n);
            }
            let (mut lo, mut step) = (start, 1usize);
            let mut hi = loop {
                let probe = lo + step;
                if probe >= n {
                    break n;
                }
                if !held(probe) {
                    break probe;
                }
                lo = probe;
                step *= 2;
            };
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if held(mid) {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            hi
        }
        let r = &v.replicas[i];
        let n = keys.len();
        let s = r.summary.as_deref();
        let gpu = search(n, 0, |j| {
            s.is_some_and(|s| s.contains(keys[j]))
                || r.overlay
                    .get(&keys[j].0)
                    .is_some_and(|e| e.ready <= now && now < e.until)
        });
        match s {
            Some(s) if s.has_lower_tiers() && gpu < n => {
                let salted = |t: Tier, j: usize| s.contains(t.summary_key(keys[j]));
                let cpu = search(n, gpu, |j| salted(Tier::Cpu, j));
                let any = search(n, cpu, |j| salted(Tier::Disk, j) || salted(Tier::Cpu, j));
                TierHit { gpu, cpu, any }
            }
            _ => TierHit {
                gpu,
                cpu: gpu,
                any: gpu,
            },
        }
    }

    /// One replica of a random view: its filter's size and fp rate (so its geometry), seed,
    /// what it holds of the shared key chain by tier, unrelated keys, and an overlay run.
    #[derive(Clone, Debug)]
    struct ReplicaSpec {
        capacity: usize,
        fp_rate: f64,
        other_seed: bool,
        no_summary: bool,
        gpu: usize,
        cpu: usize,
        disk: usize,
        noise: usize,
        overlay: Option<(usize, usize, i64)>,
    }

    fn replica_spec() -> impl Strategy<Value = ReplicaSpec> {
        (
            prop_oneof![Just(64usize), Just(200), Just(1_000), Just(7_000)],
            prop_oneof![Just(0.01f64), Just(0.05), Just(0.3)],
            (any::<bool>(), prop::bool::weighted(0.1)),
            (0usize..70, 0usize..20, 0usize..20),
            0usize..400,
            proptest::option::of((0usize..70, 0usize..40, -3_000i64..3_000)),
        )
            .prop_map(
                |(
                    capacity,
                    fp_rate,
                    (other_seed, no_summary),
                    (gpu, cpu, disk),
                    noise,
                    overlay,
                )| {
                    ReplicaSpec {
                        capacity,
                        fp_rate,
                        other_seed,
                        no_summary,
                        gpu,
                        cpu,
                        disk,
                        noise,
                        overlay,
                    }
                },
            )
    }

    fn chain_key(seed: u64, j: u64) -> BlockKey {
        BlockKey(
            (seed ^ j.wrapping_mul(0x9E37_79B9_7F4A_7C15))
                .wrapping_mul(0xBF58_476D_1CE4_E5B9)
                .rotate_left(31),
        )
    }

    fn random_view(chain: &[BlockKey], specs: &[ReplicaSpec], now: Duration) -> View {
        let mut v = View::new("eu", 64);
        for (i, spec) in specs.iter().enumerate() {
            let idx = v.upsert(info(&format!("r{i}"), "eu"));
            if !spec.no_summary {
                let cluster = if spec.other_seed { "other" } else { "c" };
                let cfg = SummaryConfig {
                    fp_rate: spec.fp_rate,
                    ..SummaryConfig::for_cluster(cluster)
                };
                let mut s = ReplicaSummary::new(1, spec.capacity, &cfg).unwrap();
                let gpu = spec.gpu.min(chain.len());
                let cpu = (gpu + spec.cpu).min(chain.len());
                let disk = (cpu + spec.disk).min(chain.len());
                s.insert(&chain[..gpu]);
                s.insert_tier(&chain[gpu..cpu], Tier::Cpu);
                s.insert_tier(&chain[cpu..disk], Tier::Disk);
                let noise: Vec<BlockKey> = (0..spec.noise as u64)
                    .map(|k| chain_key(0xD1CE ^ i as u64, k))
                    .collect();
                let third = noise.len() / 3;
                s.insert(&noise[..third]);
                s.insert_tier(&noise[third..2 * third], Tier::Cpu);
                s.insert_tier(&noise[2 * third..], Tier::Disk);
                v.set_summary(idx, s);
            }
            if let Some((start, len, ready_ms)) = spec.overlay {
                let start = start.min(chain.len());
                let end = (start + len).min(chain.len());
                let ready = Duration::from_millis(ready_ms.unsigned_abs());
                let routed_at = if ready_ms < 0 { now - ready } else { now };
                let ready_in = if ready_ms < 0 { Duration::ZERO } else { ready };
                v.record_routed_ready(idx, &chain[start..end], routed_at, ready_in);
            }
        }
        v
    }

    proptest! {
        /// Region marks are on a lease: whatever regions are marked when, the map never holds
        /// more than `MAX_REMOTE_REGIONS`, and once the latest mark's end has passed no region
        /// is skipped; the next mark then clears every expired one.
        #[test]
        fn region_marks_end_and_stay_bounded(
            marks in proptest::collection::vec((0u32..200, 0u64..10_000, 1u64..30_000), 1..300),
        ) {
            let mut v = View::new("here", 16);
            let mut now = 0u64;
            let mut last_end = 0u64;
            for (region, gap, hold) in marks {
                now += gap;
                let until = now + hold;
                last_end = last_end.max(until);
                v.mark_unreachable(&format!("r{region}"), Duration::from_millis(now), Duration::from_millis(until));
                prop_assert!(v.unreachable_regions.len() <= crate::core::region_offer::MAX_REMOTE_REGIONS);
            }
            let after = Duration::from_millis(last_end);
            for region in 0..200 {
                let name = format!("r{region}");
                prop_assert!(!v.is_unreachable(&name, after), "{} still skipped", name);
            }
            v.mark_unreachable("other", after, after + Duration::from_secs(5));
            prop_assert_eq!(v.unreachable_regions.len(), 1);
        }
        /// The memoised hit search (shared scratch across replicas and requests, several filter
        /// geometries and seeds, more geometries than the scratch memoises) gives exactly the
        /// hits of the unmemoised search, false positives included.
        #[test]
        fn memoised_hits_equal_the_full_search(
            chain_seed in any::<u64>(),
            specs in proptest::collection::vec(replica_spec(), 1..12),
            requests in proptest::collection::vec((0usize..90, 0usize..90, any::<u64>()), 1..6),
        ) {
            let chain: Vec<BlockKey> = (0..90).map(|j| chain_key(chain_seed, j)).collect();
            let now = Duration::from_secs(100);
            let v = random_view(&chain, &specs, now);
            let mut scratch = HitScratch::default();
            for (len, diverge_at, tail_seed) in requests {
                // The chain's first `len` keys, diverging into unrelated keys from `diverge_at`.
                let keys: Vec<BlockKey> = (0..len)
                    .map(|j| if j < diverge_at { chain[j] } else { chain_key(tail_seed, j as u64) })
                    .collect();
                scratch.reset(keys.len());
                for i in 0..v.replicas().len() {
                    let want = reference_hit_tiers(&v, i, &keys, now);
                    prop_assert_eq!(v.hit_tiers_with(i, &keys, now, &mut scratch), want, "replica {}", i);
                    prop_assert_eq!(v.hit_tiers(i, &keys, now), want);
                }
                // Again, every slot memoised now (the router's steady state), in reverse order.
                for i in (0..v.replicas().len()).rev() {
                    let want = reference_hit_tiers(&v, i, &keys, now);
                    prop_assert_eq!(v.hit_tiers_with(i, &keys, now, &mut scratch), want, "replica {} again", i);
                }
            }
        }
    }

    /// Mostly one filter kind (so the view slices it), some of other kinds.
    fn sliced_spec() -> impl Strategy<Value = ReplicaSpec> {
        (replica_spec(), prop::bool::weighted(0.85)).prop_map(|(spec, common)| {
            if common {
                ReplicaSpec {
                    capacity: 1_000,
                    fp_rate: 0.05,
                    other_seed: false,
                    no_summary: false,
                    ..spec
                }
            } else {
                spec
            }
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// The sliced search (64 replicas at a time, `summary_slices.rs`) gives exactly the
        /// hits of the per-replica search, false positives included, and keeps doing so as
        /// summaries change through `set_summary`, are cleared, or are replaced behind the
        /// view's back, and as overlays appear, with or without a new request in between.
        #[test]
        fn sliced_hits_equal_the_full_search(
            chain_seed in any::<u64>(),
            specs in proptest::collection::vec(sliced_spec(), 16..140),
            requests in proptest::collection::vec((0usize..90, 0usize..90, any::<u64>()), 1..4),
            changes in proptest::collection::vec((0usize..140, 0u8..4, 0usize..90), 1..12),
        ) {
            let chain: Vec<BlockKey> = (0..90).map(|j| chain_key(chain_seed, j)).collect();
            let now = Duration::from_secs(100);
            let mut v = random_view(&chain, &specs, now);
            let mut scratch = HitScratch::default();
            let requests: Vec<Vec<BlockKey>> = requests
                .into_iter()
                .map(|(len, diverge_at, tail_seed)| {
                    (0..len)
                        .map(|j| if j < diverge_at { chain[j] } else { chain_key(tail_seed, j as u64) })
                        .collect()
                })
                .collect();
            let check = |v: &View, scratch: &mut HitScratch, keys: &[BlockKey], reset: bool| {
                if reset {
                    scratch.reset(keys.len());
                }
                for i in 0..v.replicas().len() {
                    let want = reference_hit_tiers(v, i, keys, now);
                    let got = v.hit_tiers_with(i, keys, now, scratch);
                    if got != want {
                        return Err(format!("replica {i}: {got:?} != {want:?}"));
                    }
                }
                Ok(())
            };
            for keys in &requests {
                check(&v, &mut scratch, keys, true).map_err(TestCaseError::fail)?;
            }
            let cfg = SummaryConfig { fp_rate: 0.05, ..SummaryConfig::for_cluster("c") };
            // The scratch on the first request again (a scratch serves one request between
            // resets: its memos are for that request's keys).
            let keys = &requests[0];
            check(&v, &mut scratch, keys, true).map_err(TestCaseError::fail)?;
            for (i, what, len) in changes {
                let i = i % v.replicas().len();
                let mut s = ReplicaSummary::new(2, 1_000, &cfg).unwrap();
                s.insert(&chain[..len]);
                match what {
                    0 => v.set_summary(i, s),
                    1 => v.clear_summary(i),
                    2 => v.replica_mut(i).unwrap().summary = Some(Arc::new(s)),
                    _ => v.record_routed(i, &chain[..len], now),
                }
                // The same request again, the view changed under it; then a new request.
                check(&v, &mut scratch, keys, false).map_err(TestCaseError::fail)?;
                check(&v, &mut scratch, keys, true).map_err(TestCaseError::fail)?;
            }
        }
    }

    proptest! {
        /// The recent keys' table answers what the hasher does, for keys met again, keys that
        /// share a slot (the same low bits) and the same keys under another seed, in any order.
        #[test]
        fn recent_key_hashes_are_the_hashers(
            picks in proptest::collection::vec((0usize..6, any::<bool>()), 1..200),
            high in any::<u64>(),
        ) {
            let seeds = [[1u8; 32], [2u8; 32]];
            let hashers = seeds.map(|s| KeyHasher::new(&s));
            // Three keys of one slot, three of others.
            let slot_mask = RecentKeyHashes::SLOTS as u64 - 1;
            let keys: Vec<BlockKey> = (0..6u64)
                .map(|k| BlockKey((high & !slot_mask).wrapping_add(k << 40) | (k / 3)))
                .collect();
            let mut recent = RecentKeyHashes::default();
            for (k, second_seed) in picks {
                let hasher = &hashers[usize::from(second_seed)];
                prop_assert_eq!(recent.hash(hasher, keys[k]), hasher.hash(keys[k]));
            }
        }

        /// The positions a recent key keeps are the ones its hashes give in the geometry
        /// asked, whatever was kept before: keys of one slot, two seeds, geometries of other
        /// sizes and hash counts (one past what an entry keeps), in any order.
        #[test]
        fn recent_key_positions_are_the_geometrys(
            picks in proptest::collection::vec((0usize..6, any::<bool>(), 0usize..4), 1..200),
            high in any::<u64>(),
        ) {
            let cluster = SummaryConfig::for_cluster("c");
            let seeds = [cluster.seed, [2u8; 32]];
            // 1 % and 0.1 % false positives (7 and 10 hashes) at two sizes, and 30 hashes.
            let geometries: Vec<FilterGeometry> = [(1_000, 0.01), (5_000, 0.01), (1_000, 0.001), (1_000, 1e-9)]
                .iter()
                .map(|&(capacity, fp_rate)| {
                    let cfg = SummaryConfig { fp_rate, ..SummaryConfig::for_cluster("c") };
                    ReplicaSummary::new(1, capacity, &cfg).unwrap().geometry()
                })
                .collect();
            prop_assert!(geometries[3].hashes() as usize > RECENT_POSITIONS);
            let slot_mask = RecentKeyHashes::SLOTS as u64 - 1;
            let keys: Vec<BlockKey> = (0..6u64)
                .map(|k| BlockKey((high & !slot_mask).wrapping_add(k << 40) | (k / 3)))
                .collect();
            let mut recent = RecentKeyHashes::default();
            for (k, second_seed, g) in picks {
                let hasher = KeyHasher::new(&seeds[usize::from(second_seed)]);
                let (key, geometry) = (keys[k], geometries[g]);
                let h = recent.hash(&hasher, key);
                let mut want = vec![0u32; geometry.hashes() as usize];
                prop_assert!(geometry.probe_positions(hasher.hash(key), &mut want));
                if let Some(kept) = recent.positions(hasher.seed_id(), key, geometry) {
                    prop_assert_eq!(kept, &want[..]);
                }
                let mut fresh = vec![0u32; geometry.hashes() as usize];
                prop_assert!(geometry.probe_positions(h, &mut fresh));
                recent.keep_positions(hasher.seed_id(), key, geometry, &fresh);
                if fresh.len() <= RECENT_POSITIONS {
                    prop_assert_eq!(recent.positions(hasher.seed_id(), key, geometry), Some(&want[..]));
                }
            }
        }
    }

    /// The recent keys' table stays at the size its doc gives, positions and all.
    #[test]
    fn recent_key_hashes_take_96_kib() {
        let bytes = std::mem::size_of::<Option<RecentKeyHash>>() * RecentKeyHashes::SLOTS;
        assert!(bytes <= 96 * 1024, "{bytes} bytes");
    }

    #[test]
    fn a_large_fleet_of_one_filter_kind_is_searched_by_slices() {
        let chain: Vec<BlockKey> = (0..50).map(|j| chain_key(7, j)).collect();
        let specs: Vec<ReplicaSpec> = (0..100)
            .map(|i| ReplicaSpec {
                capacity: 1_000,
                fp_rate: 0.01,
                other_seed: false,
                no_summary: false,
                gpu: i % 50,
                cpu: 0,
                disk: 0,
                noise: 0,
                overlay: None,
            })
            .collect();
        let v = random_view(&chain, &specs, Duration::ZERO);
        let mut scratch = HitScratch::default();
        scratch.reset(chain.len());
        for i in 0..100 {
            let s = v.replicas[i].summary.as_deref().unwrap();
            assert!(v.slices.member_of(i, s).is_some(), "replica {i} sliced");
            assert_eq!(
                v.hit_tiers_with(i, &chain, Duration::ZERO, &mut scratch)
                    .gpu,
                i % 50
            );
            assert_eq!(
                scratch.slice_runs.run(i),
                Some(i % 50),
                "found by its slice"
            );
        }
    }

    #[test]
    fn upsert_keeps_indexes_stable() {
        let mut v = View::new("eu", 64);
        let a = v.upsert(info("a", "eu"));
        let b = v.upsert(info("b", "us"));
        assert_eq!(v.upsert(info("a", "eu")), a);
        assert_eq!(v.index_of("b"), Some(b));
        assert_eq!(v.index_of("zz"), None);
    }
}
