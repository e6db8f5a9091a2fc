//! Hot-prefix replication: detect a prefix routed at a high rate, and warm it on more replicas
//! before its holders drown.
//!
//! Without this, a hot prefix spreads only reactively: p2c-cache keeps sending it to the replica
//! that holds it until that replica's queue costs more than a full prefill elsewhere, and each
//! spill then pays that full prefill while requests wait behind it. Here a node notices the
//! heat first and, once the holders' predicted queue passes a threshold, sends a prefill-only
//! request (the shared prefix, `max_tokens: 1`) to the cheapest replica that does not hold it.
//! Routing then sees several holders and p2c-cache's longest-hit ties spread the prefix.
//!
//! - Detection: every routed request's first-`prefix_blocks` key goes into a decayed
//!   space-saving sketch ([`HotSketch`]), and into an onset sketch decaying 8× faster (a
//!   burst's start is seen ~0.2 s sooner; a node's own rate is the higher of the two); a node's
//!   heaviest keys reach the region's other nodes (gossip, [`HotPrefixes::gossip_top`]) and are
//!   added to its own rates
//!   ([`HotPrefixes::apply_peer`]: at most [`MAX_GOSSIP_ENTRIES`] per peer, rates clamped to
//!   [`MAX_PEER_RATE`], [`MAX_PEERS`] peers). A key whose mesh-wide rate passes `min_rate` is a
//!   *candidate* (at most [`MAX_CANDIDATES`]): it keeps one sample prompt, and the longest
//!   prefix every request seen since shares with it (`lcp`, in blocks) — the part worth warming.
//! - Warm-up ([`HotPrefixes::plan`], called on a timer, not per request): for a candidate this
//!   node *owns* (the caller says which: the rendezvous owner of the key among the region's live
//!   nodes, so two nodes never warm the same prefix), if its holders' mean predicted queue
//!   exceeds `min_queue_s` and the prefix takes longer than that to recompute (a shorter one is
//!   spread by routing at little cost), more replicas get a warm-up — as many as the holders'
//!   load calls for (their combined queue ÷ `min_queue_s` holders in all), each the idlest that
//!   neither holds the prefix nor is computing it for a routed request (predicted to hold it within
//!   [`PENDING_HORIZON`]; a warm-up there would queue a second copy behind the first, which
//!   made a new prefix's burst slower in the simulator) — at most one in flight per (prefix,
//!   replica), at most `max_warming` per prefix, paid from a token credit. The credit is earned
//!   by traffic: `budget_share` of the prefill this node routes, as it predicts it
//!   ([`HotPrefixes::credit`]), so warm-ups stay a share of the prefill the fleet really does,
//!   however idle it is (a budget by prefill capacity let six 8k-token warm-ups be 6–10 % of a
//!   lightly loaded fleet's prefill). A node may owe up to `max_warming` warm-ups (a prefix is
//!   warmed when it turns hot, not after the node has routed twenty times its length), and the
//!   credit is held to `budget_share` of the region's prefill capacity over
//!   [`BUDGET_WINDOW_S`], split among the region's nodes (each owns its share of the prefixes).
//!   Over any run a node's warm-ups cost at most `budget_share` × its routed prefill plus
//!   `max_warming` warm-ups. When the heat passes, in-flight warm-ups are cancelled and the
//!   candidate is dropped.
//! - Scope: a warm-up is the request that made the prefix hot, as far as the engine's cache
//!   goes — its LoRA adapter, `cache_salt` and tenant ([`WarmScope`]) — and goes only to
//!   replicas in that tenant's pools: a salted or isolated prompt never lands in another
//!   partition of an engine's cache (the side channel the salt closes).
//!
//! Sans-IO: time is an argument; the caller sends warm-ups and reports them back with
//! [`HotPrefixes::warm_done`]. The per-request path ([`HotPrefixes::observe`]) allocates only
//! when a new candidate is sampled.

use std::time::Duration;

use serde::Deserialize;

use super::cost::CostModel;
use super::hot_sketch::{HotSketch, MAX_COUNTERS};
use super::keys::{shared_blocks, BlockKey};
use super::tenants::Tenants;
use super::view::{Health, View};

/// Most prefixes tracked as candidates at once.
pub const MAX_CANDIDATES: usize = 8;
/// Most `(key, rate)` entries a node gossips, and accepts from one peer.
pub const MAX_GOSSIP_ENTRIES: usize = 16;
/// Most peers whose entries are held.
pub const MAX_PEERS: usize = 256;
/// Highest rate (requests/s) believed of one peer for one prefix; a larger claim is clamped.
pub const MAX_PEER_RATE: f64 = 100_000.0;
/// A peer's entries older than this are forgotten (it left, or stopped gossiping them).
pub const PEER_TTL: Duration = Duration::from_secs(5);
/// A warm-up not reported back by then is taken as failed (a lost completion must not block
/// the (prefix, replica) pair forever).
pub const WARM_TIMEOUT: Duration = Duration::from_secs(30);
/// The credit holds at most this many seconds of `budget_share` of the region's prefill
/// capacity: warm-ups may come in a burst (a new hot prefix wants several replicas at once),
/// but a long quiet spell does not save up for a flood.
const BUDGET_WINDOW_S: f64 = 10.0;
/// A replica that routing has sent the prefix and that is predicted to hold it within this
/// long counts as a holder, not a warm-up target.
const PENDING_HORIZON: Duration = Duration::from_secs(1);
/// Longest prefix a warm-up may carry, in blocks (a block report's cap).
pub const MAX_WARM_BLOCKS: u32 = 8192;
/// The onset sketch decays this many times faster than `tau_ms` (and no faster than
/// [`ONSET_MIN_TAU`]): a rate decayed over τ reaches `min_rate` only about
/// `τ · min_rate ÷ rate` after a step, 0.2 s into a 100 requests/s burst at τ = 2 s, and the
/// burst's first 0.2 s set its p99 (issue #37).
const ONSET_TAU_DIVISOR: u32 = 8;
/// Shortest time constant of the onset sketch: shorter, two requests close together would read
/// as a hot prefix.
const ONSET_MIN_TAU: Duration = Duration::from_millis(100);
/// A warm-up by pull is gated at its own predicted time, but never below this share of
/// `min_queue_s`: over a very fast link (NVLink, ~3 ms) a lower gate would copy every hot
/// prefix to `max_holders` replicas on a few requests of queue, filling KV with copies.
const PULL_GATE_FLOOR: f64 = 0.25;

/// Hot-prefix replication settings (`[hot_prefix]` in the node config, `--hot-prefix` in the
/// simulator).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HotPrefixConfig {
    /// Send warm-ups. Default false: a warm-up is engine work nobody asked for, and it is exact
    /// only in text mode for completions prompts (see docs/routing.md); detection and the
    /// `kvmesh_hot_prefixes` gauge run either way.
    pub enabled: bool,
    /// The prefix counted is a request's first this-many blocks (1..=64). Default 4 (1 KiB of
    /// text at the default block size).
    pub prefix_blocks: u32,
    /// Counters of the sketch (1..=256). Default 64.
    pub counters: usize,
    /// Decay time constant of the rates, ms (100..=600,000). Default 2,000.
    pub tau_ms: u64,
    /// Mesh-wide requests/s over which a prefix is hot (> 0, ≤ 1,000,000). Default 5.
    pub min_rate: f64,
    /// Warm when the holders' mean predicted queue exceeds this many seconds (0..=60). Default
    /// 0.05. The mean, not the least busy holder's: a fresh copy reads an empty queue while the
    /// prefix's load still sits on the others.
    /// A warm-up by pull is sent once the queue exceeds the pull's predicted time instead,
    /// where that is shorter (never below a quarter of this): it costs the target no prefill.
    pub min_queue_s: f64,
    /// Share of the prefill this node routes that its warm-ups may spend (0..=1), and of the
    /// region's prefill capacity they may burst to. Default 0.05.
    pub budget_share: f64,
    /// Warm-ups in flight per prefix, and warm-ups a node may owe its credit (1..=64).
    /// Default 3: a burst of 100 requests/s on an 8k-token prefix wanted about four holders
    /// (docs/benchmarks-notebook.md).
    pub max_warming: u32,
    /// Most holders a warm-up aims for, per prefix (1..=1024). Default 8.
    pub max_holders: u32,
    /// Longest prefix warmed, blocks (1..=8192). Default 512.
    pub max_warm_blocks: u32,
}

impl Default for HotPrefixConfig {
    fn default() -> Self {
        HotPrefixConfig {
            enabled: false,
            prefix_blocks: 4,
            counters: 64,
            tau_ms: 2000,
            min_rate: 5.0,
            min_queue_s: 0.05,
            budget_share: 0.05,
            max_warming: 3,
            max_holders: 8,
            max_warm_blocks: 512,
        }
    }
}

impl HotPrefixConfig {
    /// Checks every bound; the error names the key.
    pub fn validate(&self) -> Result<(), String> {
        let check = |ok: bool, key: &str, range: &str| {
            if ok {
                Ok(())
            } else {
                Err(format!("hot_prefix.{key} must be in {range}"))
            }
        };
        check(
            (1..=64).contains(&self.prefix_blocks),
            "prefix_blocks",
            "1..=64",
        )?;
        check(
            (1..=MAX_COUNTERS).contains(&self.counters),
            "counters",
            "1..=256",
        )?;
        check(
            (100..=600_000).contains(&self.tau_ms),
            "tau_ms",
            "100..=600000",
        )?;
        check(
            self.min_rate.is_finite() && self.min_rate > 0.0 && self.min_rate <= 1e6,
            "min_rate",
            "(0, 1000000]",
        )?;
        check(
            (0.0..=60.0).contains(&self.min_queue_s),
            "min_queue_s",
            "0..=60",
        )?;
        check(
            (0.0..=1.0).contains(&self.budget_share),
            "budget_share",
            "0..=1",
        )?;
        check(
            (1..=64).contains(&self.max_warming),
            "max_warming",
            "1..=64",
        )?;
        check(
            (1..=1024).contains(&self.max_holders),
            "max_holders",
            "1..=1024",
        )?;
        check(
            (1..=MAX_WARM_BLOCKS).contains(&self.max_warm_blocks),
            "max_warm_blocks",
            "1..=8192",
        )
    }
}

/// What the routing path tells the detector about one routed request.
#[derive(Clone, Copy, Debug)]
pub struct Observed<'a> {
    /// The request's model (warm-ups name it).
    pub model: &'a str,
    /// Its block keys.
    pub keys: &'a [BlockKey],
    /// Its prompt text, if block `i` is bytes `i·block_bytes ..` of it (text mode); `None`
    /// (token mode) counts the request but never samples it, so never warms it.
    pub text: Option<&'a str>,
    /// Bytes per block of `text`.
    pub block_bytes: usize,
    /// What, besides the text, the engine's cache entry depends on (its keys' namespace).
    pub scope: WarmScope<'a>,
}

/// A request's engine-cache partition and its tenant: a warm-up of its prefix carries the
/// same LoRA adapter and `cache_salt`, counts against the same tenant and goes only to that
/// tenant's pools.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WarmScope<'a> {
    /// SGLang's `lora_path` (vLLM names an adapter by its model).
    pub lora: Option<&'a str>,
    /// The `cache_salt` the engine sees (the node's, with router-derived salts).
    pub cache_salt: Option<&'a str>,
    /// The tenant, for its pools and accounting.
    pub tenant: Option<&'a str>,
}

impl WarmScope<'_> {
    fn to_owned(self) -> OwnedScope {
        let own = |s: Option<&str>| s.map(str::to_owned);
        OwnedScope {
            lora: own(self.lora),
            cache_salt: own(self.cache_salt),
            tenant: own(self.tenant),
        }
    }
}

/// A [`WarmScope`], kept with a candidate and sent with its warm-ups.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OwnedScope {
    /// SGLang's `lora_path`.
    pub lora: Option<String>,
    /// The `cache_salt` to send.
    pub cache_salt: Option<String>,
    /// The tenant it counts against.
    pub tenant: Option<String>,
}

/// A prefill-only request to send: `prompt` to `replica`, `max_tokens: 1`.
#[derive(Clone, Debug, PartialEq)]
pub struct WarmUp {
    /// The prefix's first-`prefix_blocks` key (its name in `warm_done`).
    pub key: u64,
    /// The view index of the replica to warm.
    pub replica: usize,
    /// The model to name.
    pub model: String,
    /// The shared prefix's text.
    pub prompt: String,
    /// Its block keys: record them as a routed request's once the warm-up's prefill is done.
    pub keys: Vec<BlockKey>,
    /// Its tokens (the prefill the budget was charged, unless it is pulled: then only the
    /// last token is).
    pub tokens: u64,
    /// The LoRA adapter, salt and tenant of the request that made it hot.
    pub scope: OwnedScope,
    /// With `[kv_fetch]` on and a target that takes hints: pull the prefix from its least
    /// busy holder instead of recomputing it (replication by transfer, `kv_fetch.rs`).
    pub fetch: Option<super::kv_fetch::KvFetchPlan>,
}

/// What [`HotPrefixes::plan`] asks the caller to do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Send a warm-up (boxed: it carries a pull plan, and a `Cancel` is small).
    WarmUp(Box<WarmUp>),
    /// The heat passed: stop the warm-up of `key` on `replica` if it is still running.
    Cancel {
        /// The prefix.
        key: u64,
        /// The replica.
        replica: usize,
    },
}

/// Counters for metrics and reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HotStats {
    /// Warm-ups planned (sent).
    pub sent: u64,
    /// Warm-ups that failed or timed out.
    pub failed: u64,
    /// Warm-ups cancelled because the heat passed.
    pub cancelled: u64,
    /// Prefill tokens the sent warm-ups were charged.
    pub tokens: u64,
    /// Warm-ups the budget refused.
    pub over_budget: u64,
}

/// A hot (or recently hot) prefix.
#[derive(Clone, Debug)]
struct Candidate {
    key: u64,
    model: String,
    /// The sample request's keys (at most `max_warm_blocks`).
    chain: Vec<BlockKey>,
    /// Its text, up to `chain`'s blocks.
    text: String,
    /// The sample's engine-cache partition and tenant (equal keys imply equal LoRA and salt).
    scope: OwnedScope,
    block_bytes: usize,
    /// Leading blocks of `chain` every request seen since shares.
    lcp: usize,
    /// Requests seen since sampled.
    seen: u32,
    /// Warm-ups in flight: (replica, sent at).
    warming: Vec<(usize, Duration)>,
}

/// One peer's gossiped heavy hitters.
#[derive(Clone, Debug)]
struct PeerTop {
    peer: String,
    at: Duration,
    entries: Vec<(u64, f64)>,
}

/// The detector and planner of one node.
#[derive(Clone, Debug)]
pub struct HotPrefixes {
    cfg: HotPrefixConfig,
    sketch: HotSketch,
    /// The same counts decayed [`ONSET_TAU_DIVISOR`] times faster: a prefix turning hot is
    /// seen by the higher of the two own rates, a hot one kept and gossiped by the slow one.
    onset: HotSketch,
    peers: Vec<PeerTop>,
    candidates: Vec<Candidate>,
    /// Tokens warm-ups may still spend: earned by routed prefill, negative after an overdraft.
    budget: f64,
    stats: HotStats,
    scratch: Vec<(u64, f64)>,
    tips: Vec<(usize, u32)>,
    tips_soon: Vec<(usize, u32)>,
}

impl HotPrefixes {
    /// A detector with `cfg` (call [`HotPrefixConfig::validate`] first; out-of-range values are
    /// clamped by the sketch).
    pub fn new(cfg: HotPrefixConfig) -> Self {
        HotPrefixes {
            sketch: HotSketch::new(cfg.counters, Duration::from_millis(cfg.tau_ms)),
            onset: HotSketch::new(
                cfg.counters,
                (Duration::from_millis(cfg.tau_ms) / ONSET_TAU_DIVISOR).max(ONSET_MIN_TAU),
            ),
            cfg,
            peers: Vec::new(),
            candidates: Vec::new(),
            budget: 0.0,
            stats: HotStats::default(),
            scratch: Vec::with_capacity(MAX_COUNTERS),
            tips: Vec::new(),
            tips_soon: Vec::new(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &HotPrefixConfig {
        &self.cfg
    }

    /// Counters so far.
    pub fn stats(&self) -> HotStats {
        self.stats
    }

    /// The key a request is counted under, if it has enough blocks.
    pub fn key_of(&self, keys: &[BlockKey]) -> Option<u64> {
        keys.get(self.cfg.prefix_blocks as usize - 1).map(|k| k.0)
    }

    /// `key`'s mesh-wide rate at `now`: this node's guaranteed rate (the higher of the slow
    /// and the onset estimate) plus its peers' claims.
    pub fn rate(&self, key: u64, now: Duration) -> f64 {
        let own = self
            .sketch
            .rate(key, now)
            .0
            .max(self.onset.rate(key, now).0);
        own + self
            .peers
            .iter()
            .filter(|p| now.saturating_sub(p.at) < PEER_TTL)
            .filter_map(|p| p.entries.iter().find(|e| e.0 == key).map(|e| e.1))
            .sum::<f64>()
    }

    /// Earns warm-up credit for `prefill_tokens` a request routed by this node recomputes
    /// (never for a warm-up's own). Nothing with warm-ups off: no credit saved up for the day
    /// they are turned on, and the gauge reads 0.
    pub fn credit(&mut self, prefill_tokens: u64) {
        if self.cfg.enabled {
            self.budget += self.cfg.budget_share * prefill_tokens as f64;
        }
    }

    /// Warm-up credit left, in tokens (negative while warm-ups are owed).
    pub fn credit_tokens(&self) -> f64 {
        self.budget
    }

    /// Counts one routed request; samples it if its prefix just became a candidate. True when
    /// this request made a candidate plannable (its second sighting: the shared prefix is told
    /// from the sample's own suffix): plan now rather than at the next tick. At a burst's onset
    /// the planner's tick was a quarter of the wait for the first copy (live hot burst seed 2:
    /// copies serving 0.2 s in, the p99 set by the requests queued on the one holder before;
    /// issue #37).
    pub fn observe(&mut self, req: Observed<'_>, now: Duration) -> bool {
        let Some(key) = self.key_of(req.keys) else {
            return false;
        };
        self.sketch.add(key, now);
        self.onset.add(key, now);
        if let Some(c) = self.candidates.iter_mut().find(|c| c.key == key) {
            c.seen = c.seen.saturating_add(1);
            c.lcp = shared_blocks(&c.chain[..c.lcp], req.keys);
            return c.seen == 2 && c.lcp >= self.cfg.prefix_blocks as usize;
        }
        let Some(text) = req.text else {
            return false;
        };
        if self.rate(key, now) < self.cfg.min_rate {
            return false;
        }
        // Room: a free slot, or a cooled candidate with nothing in flight.
        let min_rate = self.cfg.min_rate;
        if self.candidates.len() >= MAX_CANDIDATES {
            let cold = self.candidates.iter().position(|c| {
                c.warming.is_empty() && self.sketch.rate(c.key, now).0 < min_rate / 2.0
            });
            match cold {
                Some(i) => {
                    self.candidates.swap_remove(i);
                }
                None => return false,
            }
        }
        tracing::debug!(
            key = format_args!("{key:016x}"),
            at_s = now.as_secs_f64(),
            rate = self.rate(key, now),
            "hot candidate"
        );
        let blocks = req.keys.len().min(self.cfg.max_warm_blocks as usize);
        let block_bytes = req.block_bytes.max(1);
        let end = floor_char_boundary(text, blocks.saturating_mul(block_bytes));
        // A partial last block cannot be cached: only whole blocks of text count.
        let blocks = blocks.min(end / block_bytes);
        self.candidates.push(Candidate {
            key,
            model: req.model.to_owned(),
            chain: req.keys[..blocks].to_vec(),
            text: text[..end].to_owned(),
            scope: req.scope.to_owned(),
            block_bytes,
            lcp: blocks,
            seen: 1,
            warming: Vec::new(),
        });
        false
    }

    /// Prefixes whose mesh-wide rate is over `min_rate` (the `kvmesh_hot_prefixes` gauge).
    pub fn hot_count(&self, now: Duration) -> usize {
        self.candidates
            .iter()
            .filter(|c| self.rate(c.key, now) >= self.cfg.min_rate)
            .count()
    }

    /// This node's heaviest keys for the region's other nodes: at most [`MAX_GOSSIP_ENTRIES`],
    /// each with a guaranteed rate of at least a tenth of `min_rate` (`out` is cleared).
    pub fn gossip_top(&mut self, now: Duration, out: &mut Vec<(u64, f32)>) {
        self.sketch.top(
            now,
            self.cfg.min_rate / 10.0,
            MAX_GOSSIP_ENTRIES,
            &mut self.scratch,
        );
        out.clear();
        out.extend(self.scratch.iter().map(|&(k, r)| (k, r as f32)));
    }

    /// A region peer's gossiped heavy hitters, received at `now`: replaces what it said
    /// before. Entries past [`MAX_GOSSIP_ENTRIES`] are ignored, repeated keys count once,
    /// rates that are not finite or negative are dropped and larger than [`MAX_PEER_RATE`]
    /// clamped. A new peer past [`MAX_PEERS`] replaces the stalest. Returns the entries kept.
    pub fn apply_peer(&mut self, peer: &str, entries: &[(u64, f32)], now: Duration) -> usize {
        let mut kept: Vec<(u64, f64)> = Vec::with_capacity(MAX_GOSSIP_ENTRIES);
        for &(k, r) in entries.iter().take(MAX_GOSSIP_ENTRIES) {
            let r = f64::from(r);
            if !r.is_finite() || r < 0.0 || kept.iter().any(|e| e.0 == k) {
                continue;
            }
            kept.push((k, r.min(MAX_PEER_RATE)));
        }
        let n = kept.len();
        self.peers.retain(|p| now.saturating_sub(p.at) < PEER_TTL);
        if let Some(p) = self.peers.iter_mut().find(|p| p.peer == peer) {
            p.at = now;
            p.entries = kept;
        } else {
            if self.peers.len() >= MAX_PEERS {
                if let Some(i) = (0..self.peers.len()).min_by_key(|i| self.peers[*i].at) {
                    self.peers.swap_remove(i);
                }
            }
            self.peers.push(PeerTop {
                peer: peer.to_owned(),
                at: now,
                entries: kept,
            });
        }
        n
    }

    /// Plans warm-ups and cancellations at `now` for the prefixes `owns` says this node owns
    /// (appended to `out`). `view` is this node's view: its local region's healthy replicas
    /// serving the prefix's model are the targets; holders are those whose hit (summary,
    /// overlay, peers' tips) covers the prefix. `region_nodes` (the region's live nodes, this
    /// one included) divides the capacity cap on the credit. `tenants` says which pools a
    /// prefix's tenant may use: its warm-ups go only there.
    #[allow(clippy::too_many_arguments)]
    pub fn plan(
        &mut self,
        view: &View,
        cost: &CostModel,
        tenants: &Tenants,
        now: Duration,
        region_nodes: usize,
        owns: impl Fn(u64) -> bool,
        out: &mut Vec<Action>,
    ) {
        self.cap_credit(view, region_nodes);
        let min_rate = self.cfg.min_rate;
        let mut i = 0;
        while i < self.candidates.len() {
            let rate = self.rate(self.candidates[i].key, now);
            let c = &mut self.candidates[i];
            // Lost completions give their pair back.
            let before = c.warming.len();
            c.warming
                .retain(|(_, at)| now.saturating_sub(*at) < WARM_TIMEOUT);
            self.stats.failed += (before - c.warming.len()) as u64;
            if rate < min_rate {
                for (replica, _) in c.warming.drain(..) {
                    self.stats.cancelled += 1;
                    out.push(Action::Cancel {
                        key: c.key,
                        replica,
                    });
                }
                if rate < min_rate / 2.0 {
                    self.candidates.swap_remove(i);
                    continue;
                }
            } else if owns(c.key) {
                // As many at once as the holders' load asks for (`next_warm_up` says when
                // enough are on their way), at most `max_warming` in flight.
                while let Some(w) = self.next_warm_up(i, view, cost, tenants, now) {
                    out.push(Action::WarmUp(Box::new(w)));
                }
            }
            i += 1;
        }
    }

    /// Holds the credit to `budget_share` of the local region's healthy prefill capacity over
    /// `region_nodes`, for [`BUDGET_WINDOW_S`].
    fn cap_credit(&mut self, view: &View, region_nodes: usize) {
        let capacity: f64 = view
            .replicas()
            .iter()
            .filter(|r| r.health == Health::Healthy && r.info.region == view.local_region)
            .map(|r| r.info.prefill_tokens_per_s.max(0.0))
            .sum();
        let cap = self.cfg.budget_share * capacity / region_nodes.max(1) as f64 * BUDGET_WINDOW_S;
        self.budget = self.budget.min(cap);
    }

    /// One more warm-up for candidate `i`, if its holders are swamped and one is affordable.
    fn next_warm_up(
        &mut self,
        i: usize,
        view: &View,
        cost: &CostModel,
        tenants: &Tenants,
        now: Duration,
    ) -> Option<WarmUp> {
        let c = &self.candidates[i];
        let pools = &tenants.config(c.scope.tenant.as_deref()).pools;
        if c.seen < 2 || c.lcp < self.cfg.prefix_blocks as usize {
            return None; // one sample: its unique suffix is not yet told from the prefix
        }
        if c.warming.len() >= self.cfg.max_warming as usize {
            return None;
        }
        let Holders {
            ready,
            holders,
            ready_queue,
            pending_queue,
            target,
            source,
        } = holders_of(
            c,
            view,
            cost,
            pools,
            now,
            &mut self.tips,
            &mut self.tips_soon,
        );
        // No holder yet: the first routed request makes one. Enough of them: done.
        if ready == 0 || holders + c.warming.len() as u32 >= self.cfg.max_holders {
            return None;
        }
        let (replica, queue) = target?;
        let tokens = c.lcp as u64 * u64::from(view.tokens_per_block);
        let fetch = source.and_then(|(s, _)| warm_by_pull(view, cost, replica, s, tokens));
        let gate = warm_gate_s(self.cfg.min_queue_s, fetch.as_ref());
        // The holders' mean queue, not the least busy one's: routing sends the prefix to the
        // least busy holder, so a fresh copy reads an empty queue while the others still hold
        // theirs, and a gate on the least queue waited for routing to refill it before each
        // further copy (~0.2 s a step in the live hot burst, issue #37). Their combined queue
        // is the load the prefix puts on its holders (Little's law: arrival rate × time in
        // the engine), whichever of them it sits on now. Only the ready holders': one still
        // computing the prefix queues behind its own prefill of it, which is no load the
        // prefix puts on holders (counted, it read 115 ms at a lead's second request in the
        // simulator and spent the credit on three recomputed warm-ups long before the burst).
        let mean_queue = ready_queue / f64::from(ready);
        // The planner's inputs, for the burst's timeline (`RUST_LOG=kvmesh::core::hot_prefix=debug`):
        // when a warm-up is late, whether the heat, the holders' queue or the gate held it back.
        tracing::debug!(
            key = format_args!("{:016x}", c.key),
            at_s = now.as_secs_f64(),
            seen = c.seen,
            ready,
            holders,
            warming = c.warming.len(),
            mean_queue_ms = mean_queue * 1e3,
            gate_ms = gate * 1e3,
            target_queue_ms = queue * 1e3,
            "hot plan"
        );
        if mean_queue <= gate {
            return None;
        }
        // Holders wanted: the holders' combined queue spread until each one's share is back at
        // the gate (queue time grows with load: `ready_queue ÷ gate`). At a burst's onset one
        // holder is far past it, and the holders it needs are warmed at once rather than one
        // per plan (a hot burst's first 0.2 s set its p99, issue #37); the replicas already
        // warming, or computing the prefix for a routed request, count as holders.
        let wanted = (ready_queue / gate).ceil();
        if f64::from(holders.max(ready + c.warming.len() as u32)) >= wanted {
            return None;
        }
        // A target no less busy than the holders' mean would not take a share of their load,
        // nor one busier than a replica computing the prefix (that one holds it sooner).
        if queue >= mean_queue.min(pending_queue) {
            return None;
        }
        // A prefix the target recomputes within `min_queue_s` is spread by routing at little
        // cost: p2c-cache spills it once a holder's queue costs about one recomputation more
        // than another replica's. Warming it only adds prefill (system prompts of 2k tokens at
        // 300 requests/s: 24–39 warm-ups, no gain).
        let rate = view
            .replica(replica)
            .map_or(1.0, |r| r.info.prefill_tokens_per_s.max(1.0));
        if tokens as f64 / rate <= self.cfg.min_queue_s {
            return None;
        }
        // The budget is prefill: a warm-up by pull is charged only what it recomputes (the
        // last token), so replication by transfer is not held to the pace of recomputed
        // warm-ups. Charged the whole prefix, the first `max_warming` pulls used the credit
        // up and a hot burst got its fourth holder 12 s later (issue #37, hot burst seed 3).
        let charged = tokens - fetch.map_or(0, |f| f.fetched_tokens()).min(tokens);
        // A node may owe up to `max_warming` warm-ups: a prefix that turns hot gets its first
        // warm-ups at once, and later ones wait until routed prefill has paid them back.
        let may_owe = f64::from(self.cfg.max_warming.saturating_sub(1)) * tokens as f64;
        if self.budget + may_owe <= 0.0 {
            self.stats.over_budget += 1;
            return None;
        }
        self.budget -= charged as f64;
        self.stats.sent += 1;
        self.stats.tokens += charged;
        let c = &mut self.candidates[i];
        c.warming.push((replica, now));
        let end = floor_char_boundary(&c.text, c.lcp * c.block_bytes);
        Some(WarmUp {
            key: c.key,
            replica,
            model: c.model.clone(),
            prompt: c.text[..end].to_owned(),
            keys: c.chain[..c.lcp].to_vec(),
            tokens,
            scope: c.scope.clone(),
            fetch,
        })
    }

    /// A warm-up of `key` on `replica` ended (`ok`: its prefill is done). Returns whether it was
    /// still in flight (a cancelled or timed-out one is not).
    pub fn warm_done(&mut self, key: u64, replica: usize, ok: bool) -> bool {
        let Some(c) = self.candidates.iter_mut().find(|c| c.key == key) else {
            return false;
        };
        let Some(i) = c.warming.iter().position(|w| w.0 == replica) else {
            return false;
        };
        c.warming.swap_remove(i);
        if !ok {
            self.stats.failed += 1;
        }
        true
    }
}

/// What the planner knows of a candidate's replicas: holders (`ready` of them hold it now, the
/// rest are computing it), the sum of the ready ones' queues, the least queue of the rest
/// (infinite if none), the least busy other replica (a warm-up's target) and the least busy
/// settled holder (a pull's source), each with its queue (s).
struct Holders {
    ready: u32,
    holders: u32,
    ready_queue: f64,
    pending_queue: f64,
    target: Option<(usize, f64)>,
    source: Option<(usize, f64)>,
}

/// [`Holders`] of candidate `c` among the local region's healthy replicas serving its model in
/// `pools` (all, if empty); `tips_now` and `tips_soon` are scratch for the peers' tips now and within
/// [`PENDING_HORIZON`].
fn holders_of(
    c: &Candidate,
    view: &View,
    cost: &CostModel,
    pools: &[String],
    now: Duration,
    tips_now: &mut Vec<(usize, u32)>,
    tips_soon: &mut Vec<(usize, u32)>,
) -> Holders {
    let keys = &c.chain[..c.lcp];
    let soon = now + PENDING_HORIZON;
    view.peer_tips.hits(keys, now, tips_now);
    view.peer_tips.hits(keys, soon, tips_soon);
    let tip = |tips: &[(usize, u32)], r: usize| {
        tips.iter().find(|t| t.0 == r).map_or(0, |t| t.1 as usize)
    };
    let (mut ready, mut holders) = (0u32, 0u32);
    let (mut ready_queue, mut pending_queue) = (0.0, f64::INFINITY);
    let mut target: Option<(usize, f64)> = None;
    // The least busy replica known to hold it now (not one still computing it, nor one a
    // peer's tip only predicts: a pull from either finds no blocks): a pull's source.
    let mut source: Option<(usize, f64)> = None;
    for (r, rep) in view.replicas().iter().enumerate() {
        if rep.health != Health::Healthy
            || rep.info.region != view.local_region
            || !rep.info.models.contains(&c.model)
            || !(pools.is_empty() || pools.contains(&rep.info.pool))
        {
            continue;
        }
        let holds =
            |at, tips: &[(usize, u32)]| view.hit(r, keys, at).max(tip(tips, r)) + 1 >= c.lcp;
        let queue = cost.queue_s(rep);
        let holds_now = holds(now, &tips_now[..]);
        // A replica whose routed requests are computing the prefix right now holds it
        // soon: warming it too would queue a second copy behind the first.
        if holds_now
            && source.is_none_or(|(_, q)| queue < q)
            && view.hit_settled(r, keys, now) + 1 >= c.lcp
        {
            source = Some((r, queue));
        }
        if holds_now || holds(soon, &tips_soon[..]) {
            holders += 1;
            if holds_now {
                ready += 1;
                ready_queue += queue;
            } else {
                pending_queue = pending_queue.min(queue);
            }
        } else if !c.warming.iter().any(|w| w.0 == r) && target.is_none_or(|(_, q)| queue < q) {
            target = Some((r, queue));
        }
    }
    Holders {
        ready,
        holders,
        ready_queue,
        pending_queue,
        target,
        source,
    }
}

/// The holders' predicted queue (s) past which a prefix gets another holder: `min_queue_s`
/// for a recomputed warm-up (it costs the target a prefill); for a warm-up by pull, which
/// costs no prefill, the pull's own predicted time once that is shorter (no shorter than
/// [`PULL_GATE_FLOOR`] of `min_queue_s`): a copy that lands before the holder's queue drains
/// relieves it. At a burst's onset this starts the first pull one or two plans sooner, while
/// the source is still lightly loaded (issue #37, hot burst seed 3: the single holder took
/// eight requests at 0.047–0.059 s before the first copy, planned at 0.05 s of queue, landed).
fn warm_gate_s(min_queue_s: f64, pull: Option<&super::kv_fetch::KvFetchPlan>) -> f64 {
    pull.map_or(min_queue_s, |p| {
        p.predicted_s
            .clamp(min_queue_s * PULL_GATE_FLOOR, min_queue_s)
    })
}

/// A warm-up of `tokens` on `target` as a pull from `source`, when `[kv_fetch]` is on and the
/// target takes hints: a transfer costs the target's queue no prefill, so a second holder is
/// ready in a transfer time rather than a recomputation behind its queue.
fn warm_by_pull(
    view: &View,
    cost: &CostModel,
    target: usize,
    source: usize,
    tokens: u64,
) -> Option<super::kv_fetch::KvFetchPlan> {
    if cost.fetch.mode == super::kv_fetch::FetchMode::Off {
        return None;
    }
    let t = view.replica(target)?;
    let s = view.replica(source)?;
    // An engine recomputes at least the last token.
    let tokens = tokens.saturating_sub(1);
    let predicted_s = cost.fetch.transfer_s(&t.info, s, tokens)?;
    // Only where the pull makes the second holder ready sooner than recomputing would (a busy
    // source's step, a slow link): otherwise the recomputed warm-up wins the race.
    if predicted_s >= tokens as f64 / t.info.prefill_tokens_per_s.max(1.0) {
        return None;
    }
    Some(super::kv_fetch::KvFetchPlan {
        source,
        offer_key: None,
        from_tokens: 0,
        tokens,
        predicted_s,
        format: t.info.kv_load.map(|l| l.hints).unwrap_or_default(),
    })
}

/// The largest char boundary of `s` at or below `i`.
fn floor_char_boundary(s: &str, i: usize) -> usize {
    let mut i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::keys::{text_block_keys, Namespace};
    use crate::core::view::testing::info;
    use crate::core::view::ReplicaInfo;

    /// `h.plan` by the one node of its region, owning every prefix, at default costs and
    /// tenants (what most cases here need).
    fn plan_at(h: &mut HotPrefixes, v: &View, now: Duration, out: &mut Vec<Action>) {
        h.plan(
            v,
            &CostModel::default(),
            &Tenants::default(),
            now,
            1,
            |_| true,
            out,
        );
    }

    const BB: usize = 16;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A prompt: `prefix` blocks of shared text then 2 blocks unique to `n`.
    fn prompt(prefix: &str, n: u64) -> (String, Vec<BlockKey>) {
        let text = format!("{}{:x<32}", prefix.repeat(8), n);
        let mut keys = Vec::new();
        text_block_keys(
            Namespace::new("m", None, None, None),
            text.as_bytes(),
            BB,
            &mut keys,
        );
        (text, keys)
    }

    fn on() -> HotPrefixConfig {
        HotPrefixConfig {
            enabled: true,
            ..Default::default()
        }
    }

    /// Four healthy replicas in `eu` prefilling 500 tokens/s (so that an 8-block prefix of 32
    /// tokens takes longer than `min_queue_s` to recompute); replica 0 holds `keys` and has
    /// `queued` prefill tokens.
    fn view(keys: &[BlockKey], queued: u64) -> View {
        view_at(500.0, keys, queued)
    }

    /// [`view`] with replicas prefilling `rate` tokens/s.
    fn view_at(rate: f64, keys: &[BlockKey], queued: u64) -> View {
        let mut v = View::new("eu", 4);
        for i in 0..4 {
            v.upsert(ReplicaInfo {
                prefill_tokens_per_s: rate,
                ..info(&format!("r{i}"), "eu")
            });
        }
        v.record_routed(0, keys, ms(0));
        v.replica_mut(0).unwrap().load.queued_prefill_tokens = queued;
        v
    }

    /// Four replicas in one zone of `eu` taking vLLM hints, `tokens_per_block` tokens a block;
    /// r0 holds `keys` from 100 ms, settled (its first byte confirmed it) when `settled`.
    fn hint_fleet(tokens_per_block: u32, keys: &[BlockKey], settled: bool) -> View {
        use crate::core::kv_load::{KvHintFormat, KvLoad};
        let mut v = View::new("eu", tokens_per_block);
        for i in 0..4 {
            v.upsert(ReplicaInfo {
                zone: "z1".into(),
                kv_load: Some(KvLoad {
                    hints: KvHintFormat::VllmEnvelope,
                    ..KvLoad::default()
                }),
                ..info(&format!("r{i}"), "eu")
            });
        }
        v.record_routed_ready(0, keys, ms(0), ms(100));
        if settled {
            v.prefill_done(0, keys, ms(100));
        }
        v
    }

    /// Observes request `i` of `prefix` at `at`; what `observe` said, and the request's keys.
    fn observe_one(
        h: &mut HotPrefixes,
        prefix: &str,
        i: u64,
        at: Duration,
    ) -> (bool, Vec<BlockKey>) {
        let (text, keys) = prompt(prefix, i);
        let plannable = h.observe(
            Observed {
                model: "m",
                keys: &keys,
                text: Some(&text),
                block_bytes: BB,
                scope: WarmScope::default(),
            },
            at,
        );
        (plannable, keys)
    }

    fn observe_n(h: &mut HotPrefixes, prefix: &str, n: u64, every_ms: u64) -> Vec<BlockKey> {
        let mut keys = Vec::new();
        for i in 0..n {
            keys = observe_one(h, prefix, i, ms(i * every_ms)).1;
        }
        keys
    }

    /// The planner runs at once when a candidate can first be planned (issue #37: at a burst's
    /// onset the tick was a quarter of the wait for the first copy), and only then: not on the
    /// requests before the prefix is hot, nor on every later one.
    #[test]
    fn observing_says_when_a_candidate_can_first_be_planned() {
        let mut h = HotPrefixes::new(on());
        let prefix = "a shared instruction block, long enough to be a prefix";
        let said: Vec<bool> = (0..40)
            .map(|i| observe_one(&mut h, prefix, i, ms(i * 10)).0)
            .collect();
        let first = said
            .iter()
            .position(|&s| s)
            .expect("said once the prefix is hot");
        assert!(
            first >= 1,
            "never on the request that samples the candidate"
        );
        assert_eq!(said.iter().filter(|&&s| s).count(), 1, "once: {said:?}");
    }

    /// A salted, LoRA, tenant prompt made hot: its warm-up carries all three and goes only to
    /// the tenant's pool, though a replica outside it is idler (issue #35: a warm-up used to
    /// resend the prompt unsalted, to any pool).
    #[test]
    fn a_warm_up_keeps_the_salt_lora_and_tenant_and_the_tenants_pools() {
        let mut h = HotPrefixes::new(on());
        let scope = WarmScope {
            lora: Some("adapter"),
            cache_salt: Some("salt-of-acme"),
            tenant: Some("acme"),
        };
        let mut keys = Vec::new();
        for i in 0..50 {
            let (text, k) = prompt("0123456789abcdef", i);
            let req = Observed {
                model: "m",
                keys: &k,
                text: Some(&text),
                block_bytes: BB,
                scope,
            };
            h.observe(req, ms(i * 20));
            keys = k;
        }
        h.credit(10_000);
        // r0 (gold) holds it, swamped; r1 and r2 (shared pool) idle; r3 (gold) a little busy.
        let mut v = View::new("eu", 4);
        for (i, pool) in ["gold", "shared", "shared", "gold"].into_iter().enumerate() {
            v.upsert(ReplicaInfo {
                prefill_tokens_per_s: 500.0,
                pool: pool.into(),
                ..info(&format!("r{i}"), "eu")
            });
        }
        v.record_routed(0, &keys[..8], ms(0));
        v.replica_mut(0).unwrap().load.queued_prefill_tokens = 10_000;
        v.replica_mut(3).unwrap().load.queued_prefill_tokens = 100;
        let acme = crate::core::tenants::TenantConfig {
            pools: vec!["gold".into()],
            ..Default::default()
        };
        let tenants = Tenants::new([("acme".to_owned(), acme)].into(), Default::default());
        let mut out = Vec::new();
        h.plan(
            &v,
            &CostModel::default(),
            &tenants,
            ms(1000),
            1,
            |_| true,
            &mut out,
        );
        let w = warm_ups(&out);
        assert_eq!(w.len(), 1, "{out:?}");
        assert_eq!(w[0].replica, 3, "acme's pool only");
        let own = |s: &str| Some(s.to_owned());
        assert_eq!(
            w[0].scope,
            OwnedScope {
                lora: own("adapter"),
                cache_salt: own("salt-of-acme"),
                tenant: own("acme"),
            }
        );
    }

    /// Replication by transfer: a warm-up pulls the prefix only from a holder known to hold it
    /// now (a first byte confirmed it, or its summary has it), never from one a routed request
    /// may still be computing it on (issue #37: such pulls found no blocks and recomputed), and
    /// only where the pull beats recomputing it at the target; it is charged the prefill it
    /// does (one token), not the prefix.
    #[test]
    fn a_warm_up_pulls_only_from_a_settled_holder_and_only_when_faster() {
        use crate::core::kv_fetch::{FetchMode, KvFetchConfig};
        // 8 blocks of 2,048 tokens (16,384: 0.33 s to recompute at 50,000 tokens/s); four
        // replicas in one zone taking hints; r0 holds the prefix, 4 s of prefill queued.
        let fleet = |confirmed: bool| {
            // One warm-up at a time: the charge below is one warm-up's.
            let mut h = HotPrefixes::new(HotPrefixConfig {
                max_warming: 1,
                ..on()
            });
            let keys = observe_n(&mut h, "0123456789abcdef", 50, 20);
            h.credit(1_000_000);
            let mut v = hint_fleet(2048, &keys[..8], confirmed);
            v.replica_mut(0).unwrap().load.queued_prefill_tokens = 200_000;
            (h, v)
        };
        let warm = |h: &mut HotPrefixes, v: &View, fetch: KvFetchConfig| {
            let cost = CostModel {
                fetch,
                ..CostModel::default()
            };
            let mut out = Vec::new();
            h.plan(
                v,
                &cost,
                &Tenants::default(),
                ms(1000),
                1,
                |_| true,
                &mut out,
            );
            let w = warm_ups(&out);
            assert_eq!(w.len(), 1, "{out:?}");
            w[0].fetch
        };
        let priced = KvFetchConfig {
            mode: FetchMode::Priced,
            ..KvFetchConfig::default()
        };
        // Predicted ready, never confirmed: recomputed.
        let (mut h, v) = fleet(false);
        assert_eq!(warm(&mut h, &v, priced), None);
        // Confirmed by its first byte: pulled from r0 (1 ms + 2.1 GB at 50 GB/s + one step of
        // r0's ≈ 0.22 s, against 0.33 s of recompute).
        let (mut h, v) = fleet(true);
        let credit = h.credit_tokens();
        let plan = warm(&mut h, &v, priced).expect("a pull from the settled holder");
        assert_eq!(plan.source, 0);
        assert!(plan.predicted_s < 0.3, "{}", plan.predicted_s);
        // The budget is prefill: the pull is charged only the token it recomputes, a
        // recomputed warm-up the whole prefix.
        assert_eq!(credit - h.credit_tokens(), 1.0);
        let (mut h, v) = fleet(true);
        assert_eq!(warm(&mut h, &v, KvFetchConfig::default()), None);
        assert_eq!(credit - h.credit_tokens(), 16_384.0);
        // Over a 1 GB/s link the pull (2 s) loses to recomputing: recomputed.
        let mut slow = priced;
        slow.links.same_zone.gb_per_s = 1.0;
        let (mut h, v) = fleet(true);
        assert_eq!(warm(&mut h, &v, slow), None);
    }

    /// A warm-up by pull is gated at its own predicted time, not at `min_queue_s`: a holder
    /// with 0.04 s of queue (eight requests, nothing left to prefill) gets a copy by a 0.03 s
    /// pull, where a recomputed warm-up waits for 0.05 s (issue #37, hot burst seed 3: the
    /// single holder took eight onset requests at 0.047–0.059 s before the first copy landed).
    #[test]
    fn a_warm_up_by_pull_starts_once_the_queue_passes_the_pull() {
        use crate::core::kv_fetch::{FetchMode, KvFetchConfig};
        let planned = |mode: FetchMode, running: u32| {
            let mut h = HotPrefixes::new(on());
            let keys = observe_n(&mut h, "0123456789abcdef", 50, 20);
            h.credit(1_000_000);
            // 8 blocks of 1,024 tokens: 0.16 s to recompute at 50,000 tokens/s, a 0.03 s pull
            // (1 ms + a 7.5 ms step + 1.07 GB at 50 GB/s) within one zone.
            let mut v = hint_fleet(1024, &keys[..8], true);
            v.set_engine_load(0, 0, running, 0.0, 0);
            let cost = CostModel {
                fetch: KvFetchConfig {
                    mode,
                    ..KvFetchConfig::default()
                },
                ..CostModel::default()
            };
            let mut out = Vec::new();
            h.plan(
                &v,
                &cost,
                &Tenants::default(),
                ms(1000),
                1,
                |_| true,
                &mut out,
            );
            warm_ups(&out)
        };
        // 8 running: 0.04 s of queue, past the pull's 0.03 s, short of `min_queue_s`.
        let w = planned(FetchMode::Priced, 8);
        assert_eq!(w.len(), 1, "{w:?}");
        let pull = w[0].fetch.expect("a warm-up by pull");
        assert!(pull.predicted_s < 0.04, "{}", pull.predicted_s);
        // Recomputed warm-ups keep `min_queue_s`; and a queue under the pull's time gets none.
        assert!(planned(FetchMode::Off, 8).is_empty());
        assert!(planned(FetchMode::Priced, 5).is_empty());
        // Past `min_queue_s` both warm.
        assert_eq!(planned(FetchMode::Off, 12).len(), 1);
    }

    fn warm_ups(out: &[Action]) -> Vec<WarmUp> {
        out.iter()
            .filter_map(|a| match a {
                Action::WarmUp(w) => Some(w.as_ref().clone()),
                Action::Cancel { .. } => None,
            })
            .collect()
    }

    #[test]
    fn defaults_are_valid_and_bounds_name_the_key() {
        assert_eq!(HotPrefixConfig::default().validate(), Ok(()));
        let bad = HotPrefixConfig {
            budget_share: 1.5,
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().contains("budget_share"));
        let bad = HotPrefixConfig {
            min_rate: f64::NAN,
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().contains("min_rate"));
    }

    #[test]
    fn a_prefix_at_a_high_rate_becomes_hot_and_its_shared_part_is_found() {
        let mut h = HotPrefixes::new(on());
        // 50 requests/s for 1 s, all sharing 8 blocks then differing.
        let keys = observe_n(&mut h, "0123456789abcdef", 50, 20);
        assert_eq!(h.hot_count(ms(1000)), 1);
        let c = &h.candidates[0];
        assert_eq!(c.lcp, 8, "the unique tail is not part of the prefix");
        assert_eq!(c.chain[..8], keys[..8]);
        // A trickle is not hot.
        let mut cold = HotPrefixes::new(on());
        observe_n(&mut cold, "0123456789abcdef", 3, 1000);
        assert_eq!(cold.hot_count(ms(3000)), 0);
    }

    #[test]
    fn swamped_holders_get_a_warm_up_on_the_idlest_other_replica() {
        let mut h = HotPrefixes::new(HotPrefixConfig {
            max_warming: 2,
            ..on()
        });
        let keys = observe_n(&mut h, "0123456789abcdef", 50, 20);
        h.credit(10_000);
        // Holder 0 has 20 s of queued prefill; replica 2 is a little busy, 1 and 3 idle.
        let mut v = view(&keys[..8], 10_000);
        v.replica_mut(2).unwrap().load.queued_prefill_tokens = 100;
        let mut out = Vec::new();
        plan_at(&mut h, &v, ms(1000), &mut out);
        // Far past `min_queue_s`: both warm-ups `max_warming` allows at once, idlest first,
        // never the same pair twice.
        let w = warm_ups(&out);
        assert_eq!(
            w.iter().map(|w| w.replica).collect::<Vec<_>>(),
            [1, 3],
            "{out:?}"
        );
        assert_eq!(w[0].keys, keys[..8]);
        assert_eq!(w[0].prompt, "0123456789abcdef".repeat(8));
        assert_eq!(w[0].tokens, 8 * 4);
        // max_warming (2) in flight: nothing more until one ends.
        out.clear();
        plan_at(&mut h, &v, ms(1020), &mut out);
        assert!(out.is_empty(), "{out:?}");
        assert!(h.warm_done(w[0].key, 1, true));
        assert!(!h.warm_done(w[0].key, 1, true), "reported once");
        assert_eq!(h.stats().sent, 2);
    }

    /// A burst's onset (issue #37): the holders a swamped holder needs are warmed in one plan
    /// (`ready × queue ÷ min_queue_s` in all), not one per plan; a holder just past
    /// `min_queue_s` gets one.
    #[test]
    fn a_burst_onset_warms_the_holders_the_load_needs_at_once() {
        let warmed = |queued: u64| {
            let mut h = HotPrefixes::new(on());
            let keys = observe_n(&mut h, "0123456789abcdef", 50, 20);
            h.credit(10_000);
            let mut out = Vec::new();
            plan_at(&mut h, &view(&keys[..8], queued), ms(1000), &mut out);
            warm_ups(&out).len()
        };
        // 0.2 s queued (4 × min_queue_s): three more holders, all three replicas at once.
        assert_eq!(warmed(100), 3);
        // 0.07 s queued: one more holder is enough.
        assert_eq!(warmed(35), 1);
    }

    /// A prefix that steps from 1 to 100 requests/s is hot within 50 ms: the slow rate
    /// (τ = 2 s) reads 4 requests/s then, the onset rate (τ ÷ 8) over 15 (issue #37: the slow
    /// one alone took 0.2 s, and the burst's first 0.2 s set its p99).
    #[test]
    fn a_step_in_rate_is_hot_before_the_slow_rate_catches_up() {
        let mut h = HotPrefixes::new(on());
        let mut observe = |i: u64, at: Duration| {
            let (text, k) = prompt("0123456789abcdef", i);
            let req = Observed {
                model: "m",
                keys: &k,
                text: Some(&text),
                block_bytes: BB,
                scope: WarmScope::default(),
            };
            h.observe(req, at);
        };
        for i in 0..10 {
            observe(i, ms(i * 1000));
        }
        for i in 0..5 {
            observe(10 + i, ms(10_000 + i * 10));
        }
        let key = h.key_of(&prompt("0123456789abcdef", 0).1).unwrap();
        assert!(
            h.sketch.rate(key, ms(10_050)).0 < 5.0,
            "the slow rate alone is not hot"
        );
        assert_eq!(h.hot_count(ms(10_050)), 1);
    }

    /// Warm-ups planned (their replicas) for a swamping prefix held by r0 with `queued[0]`
    /// prefill tokens and by r1 with `queued[1]`: r1 settled, or still `computing` it for a
    /// routed request (ready in 0.3 s); r2 and r3 idle.
    fn plan_with_second_holder(queued: [u64; 2], computing: bool) -> Vec<usize> {
        let mut h = HotPrefixes::new(on());
        let keys = observe_n(&mut h, "0123456789abcdef", 50, 20);
        h.credit(10_000);
        let mut v = view(&keys[..8], queued[0]);
        if computing {
            v.record_routed_ready(1, &keys[..8], ms(1000), ms(300));
        } else {
            v.record_routed(1, &keys[..8], ms(0));
        }
        v.replica_mut(1).unwrap().load.queued_prefill_tokens = queued[1];
        let mut out = Vec::new();
        plan_at(&mut h, &v, ms(1000), &mut out);
        warm_ups(&out).iter().map(|w| w.replica).collect()
    }

    /// A fresh copy does not hide its peers' queue (issue #37): routing sends the prefix to
    /// the least busy holder, so one copy just made reads an empty queue while the first holder
    /// still has 0.2 s. Gated on the least queue, the next copy waited ~0.2 s live for routing
    /// to refill the fresh one; on the holders' mean (0.1 s) the two they need (0.2 s ÷ 0.05)
    /// are warmed now. Holders whose mean is under the gate still get none.
    #[test]
    fn a_fresh_copy_with_an_empty_queue_does_not_hold_back_the_next() {
        // r0 0.2 s of queue, r1 (the fresh copy) none: r2 and r3 warmed.
        assert_eq!(plan_with_second_holder([100, 0], false), [2, 3]);
        // Both at 0.02 s (mean 0.02 s, under the 0.05 s gate), or 0.08 and 0 (mean 0.04 s).
        assert!(plan_with_second_holder([10, 10], false).is_empty());
        assert!(plan_with_second_holder([40, 0], false).is_empty());
    }

    /// A replica computing the prefix for a routed request queues behind its own prefill of
    /// it: that is no load on the holders, and does not count in their mean (counted, a
    /// lead's second request read 115 ms and three recomputed warm-ups spent the credit long
    /// before the burst, simulator seed 5).
    #[test]
    fn a_holder_still_computing_the_prefix_does_not_count_in_the_mean() {
        // r0 holds it with 0.02 s of queue; r1 computes it, 20 s of prefill queued.
        assert!(plan_with_second_holder([10, 10_000], true).is_empty());
    }

    #[test]
    fn a_replica_already_computing_the_prefix_is_not_warmed_again() {
        let plan = |queued: [u64; 3]| {
            let mut h = HotPrefixes::new(on());
            let keys = observe_n(&mut h, "0123456789abcdef", 50, 20);
            h.credit(10_000);
            // Holder 0 is swamped (20 s of queued prefill); replica 1 was just routed the
            // prefix (ready in 0.3 s); 2 and 3 do not hold it.
            let mut v = view(&keys[..8], 10_000);
            v.record_routed_ready(1, &keys[..8], ms(1000), ms(300));
            for (r, q) in (1..4).zip(queued) {
                v.replica_mut(r).unwrap().load.queued_prefill_tokens = q;
            }
            let mut out = Vec::new();
            plan_at(&mut h, &v, ms(1000), &mut out);
            warm_ups(&out).iter().map(|w| w.replica).collect::<Vec<_>>()
        };
        // Replica 1, computing it, is the idlest: it will share the load soon, so no warm-up
        // (a second copy would queue behind its first).
        assert_eq!(plan([5_000, 8_000, 8_000]), Vec::<usize>::new());
        // An idler replica than both gets it.
        assert_eq!(plan([5_000, 100, 8_000]), vec![2]);
    }

    #[test]
    fn a_prefix_recomputed_within_min_queue_is_left_to_routing() {
        let mut h = HotPrefixes::new(on());
        let keys = observe_n(&mut h, "0123456789abcdef", 50, 20);
        h.credit(10_000);
        // At 50,000 tokens/s the 32-token prefix recomputes in 0.6 ms: a swamped holder spills
        // it at once, and a warm-up would only add prefill.
        let v = view_at(50_000.0, &keys[..8], 1_000_000);
        let mut out = Vec::new();
        plan_at(&mut h, &v, ms(1000), &mut out);
        assert!(out.is_empty(), "{out:?}");
        assert_eq!(h.stats().over_budget, 0, "not a budget refusal");
    }

    #[test]
    fn an_idle_holder_or_a_foreign_prefix_gets_no_warm_up() {
        let mut h = HotPrefixes::new(on());
        let keys = observe_n(&mut h, "0123456789abcdef", 50, 20);
        let mut out = Vec::new();
        // The holder keeps up: no warm-up.
        plan_at(&mut h, &view(&keys[..8], 10), ms(1000), &mut out);
        assert!(out.is_empty(), "{out:?}");
        // Swamped, but another node owns the prefix: it warms, this one does not.
        h.plan(
            &view(&keys[..8], 10_000),
            &CostModel::default(),
            &Tenants::default(),
            ms(1000),
            1,
            |_| false,
            &mut out,
        );
        assert!(out.is_empty(), "{out:?}");
        // Nobody holds it yet: the first routed request will make a holder.
        let mut v = View::new("eu", 4);
        v.upsert(info("r0", "eu"));
        v.upsert(info("r1", "eu"));
        plan_at(&mut h, &v, ms(1000), &mut out);
        assert!(out.is_empty(), "{out:?}");
    }

    /// A detector that has seen a hot prefix, and a view whose one holder of it is swamped.
    /// Slow decay and a low bar keep the prefix hot while credit is earned.
    fn hot_and_swamped(max_warming: u32, budget_share: f64) -> (HotPrefixes, View) {
        let mut h = HotPrefixes::new(HotPrefixConfig {
            max_warming,
            max_holders: 1024,
            budget_share,
            tau_ms: 60_000,
            min_rate: 0.5,
            ..on()
        });
        let keys = observe_n(&mut h, "0123456789abcdef", 50, 20);
        let v = view(&keys[..8], 10_000);
        (h, v)
    }

    /// Plans at `t` ms; reports every warm-up sent as done (so only the credit holds the next
    /// back) and returns how many were sent.
    fn plan_and_finish(h: &mut HotPrefixes, v: &View, t: u64) -> usize {
        let mut out = Vec::new();
        h.plan(
            v,
            &CostModel::default(),
            &Tenants::default(),
            ms(t),
            5,
            |_| true,
            &mut out,
        );
        let sent = warm_ups(&out);
        for w in &sent {
            assert!(h.warm_done(w.key, w.replica, true));
        }
        sent.len()
    }

    #[test]
    fn warm_ups_are_paid_by_the_prefill_the_node_routes() {
        let (mut h, v) = hot_and_swamped(2, 0.01);
        // Nothing routed yet: a prefix that turns hot may still borrow `max_warming` (2)
        // warm-ups of 32 tokens; with nothing earned, the first leaves room for no second...
        assert_eq!(plan_and_finish(&mut h, &v, 1000), 1);
        // ... but owing 32 it starts no second before it has earned a token.
        assert_eq!(plan_and_finish(&mut h, &v, 1001), 0);
        // 1,000 routed tokens earn 10: owing 22, it may borrow once more.
        h.credit(1000);
        assert_eq!(plan_and_finish(&mut h, &v, 1002), 1);
        assert_eq!(plan_and_finish(&mut h, &v, 1003), 0, "owes 54");
        // 5,000 more earn 50: owing 4, one more.
        h.credit(5000);
        assert_eq!(plan_and_finish(&mut h, &v, 1004), 1);
        // Every plan that wanted another warm-up than the credit allowed counts a refusal.
        assert_eq!(h.stats().over_budget, 5);
        // Over the run: warm-ups ≤ share × routed prefill + `max_warming` warm-ups.
        assert!(h.stats().tokens as f64 <= 0.01 * 6000.0 + 2.0 * 32.0);
    }

    #[test]
    fn idle_time_does_not_save_up_credit_beyond_the_capacity_window() {
        // 4 replicas × 500 tokens/s × 0.001 ÷ 5 nodes × 10 s = 4 tokens held at most.
        let (mut h, v) = hot_and_swamped(1, 0.001);
        // A huge routed history would pay for 31,250 warm-ups; the cap leaves one.
        h.credit(1_000_000_000);
        let sent: usize = (0..5).map(|t| plan_and_finish(&mut h, &v, 1000 + t)).sum();
        assert_eq!(sent, 1);
        assert_eq!(h.stats().over_budget, 4);
    }

    #[test]
    fn when_the_heat_passes_warm_ups_are_cancelled_and_the_prefix_forgotten() {
        let mut h = HotPrefixes::new(on());
        let keys = observe_n(&mut h, "0123456789abcdef", 50, 20);
        h.credit(10_000);
        let v = view(&keys[..8], 10_000);
        let mut out = Vec::new();
        plan_at(&mut h, &v, ms(1000), &mut out);
        let key = warm_ups(&out)[0].key;
        out.clear();
        // 25 s (12 τ) without a request: the rate has decayed to nothing.
        plan_at(&mut h, &v, ms(26_000), &mut out);
        let cancel = |replica| Action::Cancel { key, replica };
        assert_eq!(out, vec![cancel(1), cancel(2), cancel(3)]);
        assert_eq!(h.hot_count(ms(26_000)), 0);
        assert!(h.candidates.is_empty());
        assert!(
            !h.warm_done(key, 1, true),
            "a cancelled warm-up reports nothing"
        );
    }

    #[test]
    fn peers_rates_add_up_but_absurd_claims_are_bounded() {
        let mut h = HotPrefixes::new(on());
        let (text, k) = prompt("0123456789abcdef", 1);
        let key = h.key_of(&k).unwrap();
        // Alone, 2 requests 1 s apart are not hot; with two peers at 3/s each, the region is
        // at > 5/s. (2 requests 10 ms apart are: the onset rate reads 8/s.)
        for t in [0, 1000] {
            h.observe(
                Observed {
                    model: "m",
                    keys: &k,
                    text: Some(&text),
                    block_bytes: BB,
                    scope: WarmScope::default(),
                },
                ms(t),
            );
        }
        assert_eq!(h.hot_count(ms(1000)), 0);
        assert_eq!(h.apply_peer("b", &[(key, 3.0)], ms(1000)), 1);
        assert_eq!(h.apply_peer("c", &[(key, 3.0)], ms(1000)), 1);
        assert!(h.rate(key, ms(1000)) > 6.0);
        // A peer repeating itself replaces its claim; garbage is dropped, huge rates clamped.
        let junk = [
            (key, f32::INFINITY),
            (1, -1.0),
            (2, f32::NAN),
            (3, 1e30),
            (3, 5.0),
        ];
        assert_eq!(h.apply_peer("c", &junk, ms(1020)), 1);
        assert_eq!(h.rate(3, ms(1020)), MAX_PEER_RATE);
        let many: Vec<(u64, f32)> = (0..100).map(|k| (k, 1.0)).collect();
        assert_eq!(h.apply_peer("d", &many, ms(1020)), MAX_GOSSIP_ENTRIES);
        // The peer table is capped, and stale peers are forgotten.
        for p in 0..MAX_PEERS + 10 {
            h.apply_peer(&format!("p{p}"), &[(9, 1.0)], ms(1030));
        }
        assert!(h.peers.len() <= MAX_PEERS);
        assert_eq!(
            h.rate(key, ms(1030) + PEER_TTL),
            h.sketch.rate(key, ms(1030) + PEER_TTL).0
        );
    }

    #[test]
    fn token_mode_requests_count_but_are_never_sampled() {
        let mut h = HotPrefixes::new(on());
        let (_, k) = prompt("0123456789abcdef", 1);
        for t in 0..50 {
            h.observe(
                Observed {
                    model: "m",
                    keys: &k,
                    text: None,
                    block_bytes: BB,
                    scope: WarmScope::default(),
                },
                ms(t * 20),
            );
        }
        assert!(h.rate(h.key_of(&k).unwrap(), ms(1000)) > 5.0);
        assert!(h.candidates.is_empty());
        // Short prompts have no first-k key at all.
        assert_eq!(h.key_of(&k[..3]), None);
    }

    #[test]
    fn gossip_carries_the_heaviest_keys_only() {
        let mut h = HotPrefixes::new(on());
        observe_n(&mut h, "0123456789abcdef", 50, 20);
        let mut top = Vec::new();
        h.gossip_top(ms(1000), &mut top);
        assert_eq!(top.len(), 1, "one-off suffixes share the hot first-k key");
        assert!(top[0].1 > 5.0);
    }
}
