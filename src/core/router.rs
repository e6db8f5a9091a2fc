//! The router: one routing decision, from a request and a [`View`] to a [`Decision`].
//!
//! Order of work: the eligible set (model, health, the tenant's pools and quotas, the node's
//! region), then each candidate's hit and predicted cost, then region spill, then the policy.
//! The router reads the view and never changes it: the driver records the decision
//! ([`View::record_routed`], [`Tenants::started`]) once the request is really sent.
//!
//! KV quotas (`max_kv_share`, see `tenants.rs`) steer, they never reject. A candidate where the
//! tenant's estimated cache share, with the blocks the request would bring there, reaches its
//! quota is *over*, unless the request's whole prompt is already held there (it brings no block,
//! so it flushes nobody and keeps its hit). Counting the request's own blocks matters when one
//! request is a large part of the share: a tenant at 5 % of a replica with a 10 % quota would
//! otherwise land a 19 % prompt there, and every replica its blocks had aged out of would take
//! such a prompt in turn.
//! When some candidate is not over, the over ones are dropped: the tenant goes elsewhere. When
//! every candidate is over, only those where its share is within [`KV_DOMINATED_MARGIN`] of its
//! largest stay: the tenant's overflow goes to the replicas it already fills — its de-facto pool
//! — rather than spreading over all of them; unless they queue [`KV_OVERFLOW_S`] longer than
//! the others, when the policy chooses among all (so the pool grows with the tenant's load).
//! Within the pool the fullest replica alone takes it unless it queues [`KV_OVERFLOW_S`] longer
//! than the pool's cheapest, so a pool shrinks back when the load that grew it is gone.
//! Steering cannot shrink what a tenant's traffic brings, only where it lands; a tenant whose
//! new blocks outrun what the others evict cannot stay under its share everywhere, and spreading
//! it evenly would put it over everywhere and flush every replica. So the quota holds on the
//! replicas it was steered off (there the others' blocks evict its old ones, and it comes back
//! only while under its share), and its surplus is confined to the few it dominates.

use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::SeedableRng;

use super::affinity;
use super::cost::{CostModel, PrefillPrice};
use super::fetch_plan;
use super::keys::BlockKey;
use super::kv_fetch::{FetchMode, KvFetchPlan};
use super::policy::{Candidate, Policy, PolicyInput, PolicyKind, Reason};
use super::quick_price::QuickPrice;
use super::region_choice::{choose_region, ForwardChoice, RegionAsk};
use super::remote_prefix::{self, RemoteAsk, RemotePrefixMode, RemoteWay};
use super::role::Leg;
use super::tenants::Tenants;
use super::view::{
    Health, HitScratch, ReplicaInfo, ReplicaState, SlicedHits, SlicesSearched, TierHit, View,
};

/// When a tenant is over its KV share on every candidate, the candidates whose share is within
/// this of its largest stay (its de-facto pool); a wider margin spreads its surplus over more
/// replicas, for load, at the price of flushing them. 0.1: a replica it holds 10 points less of
/// than its fullest is not yet one it dominates.
pub const KV_DOMINATED_MARGIN: f32 = 0.1;

/// ... unless the cheapest of those is predicted this many seconds slower than the cheapest
/// candidate: then the policy picks among all of them, so a confined tenant's latency stays
/// bounded (and the replica it overflows to becomes one it dominates, if it keeps coming).
pub const KV_OVERFLOW_S: f64 = 0.25;

/// What a tenant's KV quota did to one decision's candidates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvSteer {
    /// Nothing: no quota, or no candidate was dropped.
    #[default]
    Unsteered,
    /// Candidates were dropped.
    Steered,
    /// Over everywhere, and the dominated replicas queue too long: none dropped.
    Overflowed,
}

/// Router settings.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// Policy. Default `p2c-cache`.
    pub policy: PolicyKind,
    /// RNG seed; equal seeds and inputs give equal decisions. Default 0.
    pub seed: u64,
    /// Forward to another region when every local candidate would queue longer than this
    /// (seconds). Default 10 s.
    pub spill_after_s: f64,
    /// The cost formula's parameters.
    pub cost: CostModel,
    /// How a forwarded request's region is chosen. Default by cost.
    pub forward_by: ForwardChoice,
    /// This node sees what its region's other nodes route within a load-sharing interval
    /// (load sharing on, or no other node). Default true. When false, `p2c-cache` never
    /// escapes to the cheapest replica ([`crate::core::policy::P2cCache::escape_margin_s`]):
    /// every node holding the same stale view would escape to the same one.
    pub shared_load: bool,
    /// `p2c-cache`'s [`crate::core::policy::P2cCache::recompute_charge_per_s`]. Default 0.
    pub recompute_charge_per_s: f64,
    /// `p2c-cache`'s [`crate::core::policy::P2cCache::evict_charge`]. Default 8.
    pub evict_charge: f64,
    /// A prompt whose longest cached prefix is in another region: recompute here (default),
    /// or also weigh forwarding there, or pulling its KV too (`remote_prefix.rs`).
    pub remote_prefix: RemotePrefixMode,
    /// A request also rides on a prompt still being computed that it *extends* (an agent's next
    /// turn sent before its last turn's first byte), not only on one it repeats whole. Default
    /// false; the node sets it where it holds riders (`[hold]` on): held until that prefill's
    /// first byte, a rider finds the whole ridden part cached, as the ride's cost assumes.
    /// Sent at once it finds only the chunks scheduled so far and recomputes the rest beside
    /// the first (the simulator, which does not hold: its small tenants' hits fell 0.417 → 0.372
    /// of alone in `a_kv_quota_on_a_100x_tenant_…` with it on).
    pub ride_extensions: bool,
    /// With `ride_extensions`, the shortest prompt under way (tokens) a request rides on that it
    /// extends rather than repeats. Default 0; the node sets the hold's `min_prefill_tokens`:
    /// a ride is credited only where the rider will be held until that prefill's first byte.
    /// Credited on a shorter one (a hot prefix's 8,192-token warm-up), riders were sent to the
    /// replica being warmed and waited behind it (the live hot burst's window p99 0.058 →
    /// 0.201 s, docs/kv-transfer.md "Hot burst, live").
    pub ride_extension_min_tokens: u64,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            policy: PolicyKind::P2cCache,
            seed: 0,
            spill_after_s: 10.0,
            cost: CostModel::default(),
            forward_by: ForwardChoice::Cost,
            shared_load: true,
            recompute_charge_per_s: 0.0,
            evict_charge: super::policy::DEFAULT_EVICT_CHARGE,
            remote_prefix: RemotePrefixMode::Local,
            ride_extensions: false,
            ride_extension_min_tokens: 0,
        }
    }
}

/// What routing needs to know about one request.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    /// Requested model.
    pub model: &'a str,
    /// Block keys of the prompt.
    pub keys: &'a [BlockKey],
    /// Prompt length in tokens (estimated in text mode).
    pub prompt_tokens: u64,
    /// Session or agent-run id, for affinity.
    pub session: Option<&'a str>,
    /// What the prompt is about beyond its text, e.g. the retrieved documents' ids: when no
    /// candidate's cache holds more of the prompt than the others', the key's rendezvous
    /// replica gets the affinity credit, so requests about the same documents land together
    /// on every node even before any of them is cached (`affinity.rs`).
    pub affinity_key: Option<&'a str>,
    /// Tenant id, for pools and quotas.
    pub tenant: Option<&'a str>,
    /// Already forwarded once by another region's node: never forward again.
    pub forwarded: bool,
    /// View indexes of replicas this request already failed on (failover): not candidates.
    pub exclude: &'a [usize],
}

impl<'a> RouteRequest<'a> {
    /// A first attempt of `prompt_tokens` tokens keyed by `keys`, with no session, affinity key
    /// or tenant (tests and tools; the proxy fills every field).
    pub fn plain(model: &'a str, keys: &'a [BlockKey], prompt_tokens: u64) -> Self {
        RouteRequest {
            model,
            keys,
            prompt_tokens,
            session: None,
            affinity_key: None,
            tenant: None,
            forwarded: false,
            exclude: &[],
        }
    }
}

/// A decision to send the request to a local replica.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Routed {
    /// The replica's index in the view.
    pub replica: usize,
    /// The replica it was weighed against.
    pub runner_up: Option<usize>,
    /// Leading blocks believed cached on the chosen replica, in any tier (not weighted: what
    /// the replica can reuse, whatever the copy-back costs).
    pub hit_blocks: u32,
    /// The longest hit any eligible replica offered, in blocks (`None` when the policy does not
    /// look at caches): with `hit_blocks`, what the decision gave up for load.
    pub best_hit_blocks: Option<u32>,
    /// The chosen replica got the session's affinity credit.
    pub affinity: bool,
    /// Predicted seconds to first token there (the cost without the affinity credit).
    pub predicted_s: f64,
    /// Predicted seconds to first token there.
    pub cost_s: f64,
    /// The policy's reason.
    pub reason: Reason,
    /// What the tenant's KV quota did (see the module doc): took candidates away, or, the
    /// tenant being over it everywhere and the replicas it dominates queueing
    /// [`KV_OVERFLOW_S`] longer than the best other, let it go by the policy.
    pub kv_steer: KvSteer,
    /// Every candidate was at its `max_in_flight`: the replica will queue it. A node with
    /// priority classes holds such a request in its admission queue instead
    /// (`core::admission`) until a slot frees.
    pub saturated: bool,
    /// The data-parallel rank of the replica to name, when the driver knows which rank holds
    /// the prefix (the node, at the replica's home, from its exact per-rank cache model; see
    /// `dp_rank.rs`). The router itself sees only merged summaries and leaves it `None`.
    pub dp_rank: Option<u16>,
    /// The prefix's KV to pull from another replica first, when `[kv_fetch]` planned one
    /// (`kv_fetch.rs`); the driver sends it as the replica's hint.
    pub fetch: Option<KvFetchPlan>,
}

/// Which consideration decided, for operators (`kvmesh_decisions_total{branch}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Branch {
    /// Routed to the longest hit on offer.
    Cache,
    /// Routed to the session's preferred replica, which did not hold the longest hit.
    Affinity,
    /// Routed elsewhere than the longest hit (for load), or nobody held a block.
    Load,
    /// Forwarded: the local region queues too long or is full.
    Spill,
    /// Forwarded: no local replica serves the model.
    Forward,
    /// Refused.
    Reject,
}

impl Branch {
    /// Every branch, in label order.
    pub const ALL: [Branch; 6] = [
        Branch::Cache,
        Branch::Affinity,
        Branch::Load,
        Branch::Spill,
        Branch::Forward,
        Branch::Reject,
    ];

    /// Stable label.
    pub fn as_str(self) -> &'static str {
        match self {
            Branch::Cache => "cache",
            Branch::Affinity => "affinity",
            Branch::Load => "load",
            Branch::Spill => "spill",
            Branch::Forward => "forward",
            Branch::Reject => "reject",
        }
    }
}

impl Routed {
    /// The branch of a local route: the longest hit on offer taken, else affinity, else load.
    pub fn branch(&self) -> Branch {
        match self.best_hit_blocks {
            Some(best) if self.hit_blocks > 0 && self.hit_blocks >= best => Branch::Cache,
            _ if self.affinity => Branch::Affinity,
            _ => Branch::Load,
        }
    }
}

impl Decision {
    /// The decision's branch.
    pub fn branch(&self) -> Branch {
        match self {
            Decision::Route(r) => r.branch(),
            Decision::Forward {
                reason: ForwardReason::Spill,
                ..
            } => Branch::Spill,
            Decision::Forward { .. } => Branch::Forward,
            Decision::Reject(_) => Branch::Reject,
        }
    }
}

/// Why a request goes to another region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForwardReason {
    /// No healthy local replica serves the model.
    NoLocalReplica,
    /// Every local candidate is busier than `spill_after_s`.
    Spill,
    /// The prompt's longest prefix is held there, and going there is sooner than recomputing
    /// or pulling it here (`remote_prefix.rs`).
    Prefix,
}

/// Why a request cannot be served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectReason {
    /// No replica anywhere serves the model (HTTP 404).
    UnknownModel,
    /// Replicas exist but none is healthy and reachable (HTTP 503).
    NoHealthyReplica,
    /// The tenant is over its quota (HTTP 429).
    OverQuota,
}

/// The outcome of routing one request.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// Send to a local replica.
    Route(Routed),
    /// Forward to a node of `region` (at most one hop).
    Forward {
        /// Target region.
        region: String,
        /// Why.
        reason: ForwardReason,
    },
    /// Answer with an error.
    Reject(RejectReason),
}

/// Per replica, what the router asks of its static facts — does it serve the request's model,
/// is it in the view's local region, which legs does its role take — remembered across
/// decisions. Answering afresh is two string comparisons per replica and decision (at 512
/// replicas about 20k of a decision's 325k instructions in the bench, more with real model
/// names); remembered, it is a pointer comparison. Exact: an entry holds the `Arc` of the facts
/// it answered for (so the allocation cannot be reused by other facts), and counts only while
/// the replica still has those very facts and the model and region are the ones asked.
#[derive(Debug, Default)]
struct StaticFacts {
    /// What the entries' answers are for.
    asked: Asked,
    /// By replica index (at least as many as the last view had replicas).
    entries: Vec<StaticEntry>,
}

/// The model and local region remembered facts answer for.
#[derive(Debug, Default)]
struct Asked {
    /// The model and local region the entries' answers are for.
    model: String,
    region: String,
}

/// One replica's remembered facts. An entry is checked by the address of the facts it answered
/// for (one compare, where an `Option<Arc>` compared by `Arc::ptr_eq` was six instructions a
/// replica); the `Arc` is held apart, so the allocation cannot be reused by other facts while
/// the address names it. A change of the model or region asked clears every address
/// ([`StaticFacts::begin`]), so the address alone says the answer is current: a generation
/// compared per replica was four more instructions a replica and decision, to spare a pass
/// that a change (rare: one model per router in practice) follows with an answer afresh for
/// every replica anyway.
#[derive(Debug, Default)]
struct StaticEntry {
    /// `Arc::as_ptr` of the facts answered for, as an address (0: none, or answered for
    /// another model or region; compared, never read through).
    addr: usize,
    /// The facts last answered for, held so that `addr` cannot name others (kept when `addr` is
    /// cleared: answering the same facts again then costs no `Arc` traffic).
    info: Option<Arc<ReplicaInfo>>,
    /// What the decision reads of these facts.
    known: Known,
}

impl StaticEntry {
    /// What is remembered of facts `info` for `asked`: this entry's answer when it is for those
    /// very facts (one compare, inline), else answered afresh and kept. Answered by reference,
    /// so the gathering loop reads the price and bounds in place: a copy returned by value
    /// went through the stack, four more instructions a replica.
    #[inline(always)]
    fn known(&mut self, info: &Arc<ReplicaInfo>, asked: &Asked) -> &Known {
        if self.addr == Arc::as_ptr(info) as usize {
            &self.known
        } else {
            self.remember(info, asked)
        }
    }

    /// [`StaticEntry::known`] for facts not remembered for the current question: answers, and
    /// remembers the answer.
    #[cold]
    #[inline(never)]
    fn remember(&mut self, info: &Arc<ReplicaInfo>, asked: &Asked) -> &Known {
        let known = Known {
            flags: StaticFacts::answer(info, &asked.model, &asked.region),
            max_in_flight: info.max_in_flight,
            price: PrefillPrice::of(info),
        };
        if !self
            .info
            .as_ref()
            .is_some_and(|held| Arc::ptr_eq(held, info))
        {
            self.info = Some(Arc::clone(info));
        }
        self.addr = Arc::as_ptr(info) as usize;
        self.known = known;
        &self.known
    }
}

/// What a decision reads of a replica's static facts, remembered with them ([`StaticFacts`]):
/// its [`facts`] bits and the numbers its candidate is priced by, worked out once per facts.
#[derive(Clone, Copy, Debug)]
struct Known {
    /// [`facts`] bits.
    flags: u8,
    /// `ReplicaInfo::max_in_flight`.
    max_in_flight: u32,
    /// Its prefill price (`PrefillPrice::of` its facts).
    price: PrefillPrice,
}

impl Default for Known {
    /// An entry not yet answered: nothing (never read; an entry's address is 0 until it is).
    fn default() -> Self {
        Known {
            flags: 0,
            max_in_flight: 0,
            price: PrefillPrice {
                tokens_per_s: 1.0,
                attention_s_per_pair: 0.0,
            },
        }
    }
}

/// The bits of a replica's remembered static facts ([`StaticFacts::get`]).
mod facts {
    use crate::core::role::{Leg, Role};

    /// It serves the request's model.
    pub const SERVES: u8 = 1;
    /// It is in the view's local region.
    pub const IN_REGION: u8 = 2;

    /// The bit saying its role takes `leg`.
    #[inline]
    pub const fn takes(leg: Leg) -> u8 {
        match leg {
            Leg::Whole => 4,
            Leg::WholeOnBoth => 8,
            Leg::Prefill => 16,
        }
    }

    /// The legs `role` takes, as bits.
    pub fn legs(role: Role) -> u8 {
        [Leg::Whole, Leg::WholeOnBoth, Leg::Prefill]
            .into_iter()
            .filter(|&leg| role.serves(leg))
            .fold(0, |bits, leg| bits | takes(leg))
    }

    /// What a replica must have to be local for `leg`: the model, the region, the role.
    #[inline]
    pub const fn local(leg: Leg) -> u8 {
        SERVES | IN_REGION | takes(leg)
    }
}

impl StaticFacts {
    /// Starts a decision for `model` in a view of local region `region` with `replicas`
    /// replicas: at least that many entries, for the current model and region.
    fn begin(&mut self, model: &str, region: &str, replicas: usize) {
        let asked = &mut self.asked;
        if asked.model != model || asked.region != region {
            asked.model.clear();
            asked.model.push_str(model);
            asked.region.clear();
            asked.region.push_str(region);
            // Every answer was for the old question.
            for e in &mut self.entries {
                e.addr = 0;
            }
        }
        if self.entries.len() < replicas {
            self.entries.resize_with(replicas, StaticEntry::default);
        }
    }

    /// The [`facts`] bits of replica `i` with facts `info` ([`StaticEntry::known`]; answered
    /// afresh, and not kept, past the entries [`StaticFacts::begin`] made).
    #[inline(always)]
    fn get(&mut self, i: usize, info: &Arc<ReplicaInfo>) -> u8 {
        match self.entries.get_mut(i) {
            Some(e) => e.known(info, &self.asked).flags,
            None => Self::answer(info, &self.asked.model, &self.asked.region),
        }
    }

    /// Marks in `local` the replicas that serve the model, take `leg`, are healthy, in the local
    /// region and not excluded (the static facts asked once, and remembered). Returns what it
    /// found of the fleet: whether any replica serves the model, their slots, and whether a
    /// local one is in an allowed pool.
    fn mark_local(
        &mut self,
        local: &mut Vec<bool>,
        view: &View,
        req: &RouteRequest<'_>,
        leg: Leg,
        allowed_pool: impl Fn(&ReplicaState) -> bool,
    ) -> Reach {
        let mut reach = Reach::default();
        local.clear();
        self.begin(req.model, &view.local_region, view.replicas().len());
        for (i, r) in view.replicas().iter().enumerate() {
            let flags = self.get(i, &r.info);
            let is_local = is_local(flags, leg, r, req, i);
            local.push(is_local);
            if flags & facts::SERVES != 0 {
                reach.model_known = true;
                reach.cluster_slots += u64::from(r.info.max_in_flight);
            }
            if is_local && allowed_pool(r) {
                reach.local_usable = true;
            }
        }
        reach
    }

    fn answer(info: &ReplicaInfo, model: &str, region: &str) -> u8 {
        let mut flags = facts::legs(info.pd.role);
        if info.models.iter().any(|m| m == model) {
            flags |= facts::SERVES;
        }
        if info.region == region {
            flags |= facts::IN_REGION;
        }
        flags
    }
}

/// Whether replica `i` (state `r`, static facts `flags`) may take `leg` of `req` here: it
/// serves the model, takes the leg, is healthy, in the local region and not excluded (pools
/// and quotas are checked apart).
#[inline(always)]
fn is_local(flags: u8, leg: Leg, r: &ReplicaState, req: &RouteRequest<'_>, i: usize) -> bool {
    flags & facts::local(leg) == facts::local(leg)
        && r.health == Health::Healthy
        && !req.exclude.contains(&i)
}

/// What one decision gathers over its candidates.
#[derive(Clone, Copy, Debug, PartialEq)]
struct CandidateTotals {
    /// The least predicted queue (infinite with no candidate).
    least_queue_s: f64,
    /// Every candidate is at its `max_in_flight` (true with none).
    all_full: bool,
    /// The longest hit.
    best_hit_blocks: u32,
}

impl Default for CandidateTotals {
    fn default() -> Self {
        CandidateTotals {
            least_queue_s: f64::INFINITY,
            all_full: true,
            best_hit_blocks: 0,
        }
    }
}

impl CandidateTotals {
    #[inline]
    fn add(&mut self, queue_s: f64, full: bool, hit_blocks: u32) {
        // `f64::min` but for a NaN `least_queue_s`, which never is (it starts infinite and
        // only takes a smaller number): a compare instead of a NaN-aware min.
        if queue_s < self.least_queue_s {
            self.least_queue_s = queue_s;
        }
        self.all_full &= full;
        self.best_hit_blocks = self.best_hit_blocks.max(hit_blocks);
    }
}

/// What a decision's first pass found of the fleet, before any candidate is weighed.
#[derive(Clone, Copy, Debug, Default)]
struct Reach {
    /// Some replica in the view serves the model.
    model_known: bool,
    /// The in-flight slots of the replicas serving the model (a tenant's cluster share).
    cluster_slots: u64,
    /// Some local replica (model, leg, health, region, not excluded) is in an allowed pool.
    local_usable: bool,
}

/// Which replicas one decision considers, beyond the per-replica facts in `Router::local`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Scope {
    /// The tenant's first pool (its index in the tenant's `pools`, in tier order) that has a
    /// usable local replica; `None`: any pool the tenant allows.
    tier_pool: Option<usize>,
    /// The tenant has a per-replica in-flight cap (else every replica allows it: no lookup).
    per_replica_cap: bool,
    /// The tenant's KV quota: its slot and share (`tenants.rs`).
    kv_quota: Option<(u8, f64)>,
}

/// Routes requests; owns the policy, the RNG, tenant state and reusable buffers.
pub struct Router {
    cfg: RouterConfig,
    policy: Box<dyn Policy>,
    rng: SmallRng,
    /// Tenant policies and in-flight counts.
    pub tenants: Tenants,
    candidates: Vec<Candidate>,
    scratch: HitScratch,
    /// This request's hits through peers' tips, by replica (reused buffer).
    tip_hits: Vec<(usize, u32)>,
    /// Replicas a peer just routed this very prompt (or, with `ride_extensions`, one it
    /// extends) to, still computing it: the prompt's blocks and when it will be done (reused
    /// buffer; see `ride_on`).
    pending_tips: Vec<(usize, u32, Duration)>,
    /// The tenant's KV share at each candidate and the share this request's new blocks would
    /// add there, aligned with `candidates`; (-1, 0) where the request brings no block (reused
    /// buffer; filled only for a tenant with a KV quota).
    kv_shares: Vec<(f32, f32)>,
    /// Per replica of the view, for the current decision: serves the model, healthy, in the
    /// local region, not excluded (pools and quotas are checked apart).
    local: Vec<bool>,
    facts: StaticFacts,
    /// Each candidate's planned pull under `kv_fetch.mode = "priced"` or from another region
    /// (`remote_prefix = "weigh"`), aligned with `candidates` (reused buffer).
    fetch_plans: Vec<Option<KvFetchPlan>>,
    /// `fetch_plans` were filled for this decision's candidates.
    plans_live: bool,
    /// Positions in `candidates` whose general candidate is still to be made
    /// ([`SlicedPass::gather`]; reused buffer).
    deferred: Vec<usize>,
}

impl Router {
    /// A router with `cfg` and `tenants`.
    pub fn new(cfg: RouterConfig, tenants: Tenants) -> Self {
        Router {
            policy: cfg.policy.build_for(
                cfg.shared_load,
                cfg.recompute_charge_per_s,
                cfg.evict_charge,
            ),
            rng: SmallRng::seed_from_u64(cfg.seed),
            tenants,
            candidates: Vec::new(),
            scratch: HitScratch::default(),
            tip_hits: Vec::new(),
            pending_tips: Vec::new(),
            kv_shares: Vec::new(),
            local: Vec::new(),
            facts: StaticFacts::default(),
            fetch_plans: Vec::new(),
            plans_live: false,
            deferred: Vec::new(),
            cfg,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &RouterConfig {
        &self.cfg
    }

    /// Replaces the spill bar and cost parameters (a configuration reload); the RNG stays.
    pub fn set_params(&mut self, spill_after_s: f64, cost: CostModel) {
        self.cfg.spill_after_s = spill_after_s;
        self.cfg.cost = cost;
    }

    /// Switches to policy `kind` (a configuration reload), with fresh policy state (a rotation
    /// counter, a hash ring): the next decision is the new policy's first.
    pub fn set_policy(&mut self, kind: PolicyKind) {
        self.policy = kind.build_for(
            self.cfg.shared_load,
            self.cfg.recompute_charge_per_s,
            self.cfg.evict_charge,
        );
        self.cfg.policy = kind;
    }

    /// Decides where `req` goes, given what `view` says at `now`: the whole request, to a
    /// replica that can run it all (not a prefill-only one; see `role.rs`).
    pub fn route(&mut self, view: &View, req: &RouteRequest<'_>, now: Duration) -> Decision {
        self.route_leg(view, req, now, Leg::Whole)
    }

    /// Decides where `leg` of `req` goes: as [`Router::route`], among the replicas whose role
    /// takes that leg (the prefill of a disaggregated request: `pd.rs`).
    pub fn route_leg(
        &mut self,
        view: &View,
        req: &RouteRequest<'_>,
        now: Duration,
        leg: Leg,
    ) -> Decision {
        self.plans_live = false;
        let (scope, mut gathered, quota_blocked) = match self.survey(view, req, leg, now) {
            Ok(surveyed) => surveyed,
            Err(decided) => return decided,
        };
        if self.candidates.is_empty() {
            return if quota_blocked {
                Decision::Reject(RejectReason::OverQuota)
            } else {
                self.forward_or_reject(
                    view,
                    req,
                    ForwardReason::NoLocalReplica,
                    f64::INFINITY,
                    leg,
                    now,
                )
            };
        }
        let kv_steer = match scope.kv_quota {
            Some((_, quota)) => self.steer_kv(quota as f32),
            None => KvSteer::Unsteered,
        };
        let cost = self.cfg.cost;
        if self.policy.uses_cache() && cost.fetch.mode == FetchMode::Priced {
            fetch_plan::price(
                &cost.fetch,
                view,
                &mut self.candidates,
                &mut self.fetch_plans,
                (req.keys, req.prompt_tokens, now),
            );
            self.plans_live = true;
        }
        if kv_steer == KvSteer::Steered {
            gathered = self.regather(view);
        }
        if let Some(forward) = self.weigh_remote_prefix(view, req, leg, now, gathered) {
            return forward;
        }
        if let Some(spilled) = self.spill(view, req, leg, now, gathered) {
            return spilled;
        }
        self.choose(view, req, now, gathered, kv_steer)
    }

    /// The decision's scope and its candidates, with their totals and whether a tenant's cap
    /// left some replica out; or the decision itself when the model is unknown, the tenant is
    /// over its cluster share, or no local replica can take it. A tenant with pools is scoped
    /// first (which of its pools is tried), then gathered; any other, the usual case, in one
    /// pass over the view that reads each replica once ([`Router::gather_unpooled`]).
    fn survey(
        &mut self,
        view: &View,
        req: &RouteRequest<'_>,
        leg: Leg,
        now: Duration,
    ) -> Result<(Scope, CandidateTotals, bool), Decision> {
        let tenant_cfg = self.tenants.config(req.tenant);
        if !tenant_cfg.pools.is_empty() {
            let scope = self.scope(view, req, leg, now)?;
            let (gathered, quota_blocked) = self.gather(view, req, now, &scope);
            return Ok((scope, gathered, quota_blocked));
        }
        let scope = Scope {
            tier_pool: None,
            per_replica_cap: req.tenant.is_some() && tenant_cfg.max_in_flight_per_replica.is_some(),
            kv_quota: self.tenants.kv_quota(req.tenant),
        };
        let (reach, gathered, quota_blocked) = self.gather_unpooled(view, req, leg, now, &scope);
        self.check_reach(view, req, leg, now, reach)?;
        Ok((scope, gathered, quota_blocked))
    }

    /// The decision itself when the replicas `reach` found cannot take the request: the model
    /// is unknown (here and in every other region's offer), the tenant is over its cluster
    /// share, or no local replica can take it (forwarded or rejected).
    fn check_reach(
        &self,
        view: &View,
        req: &RouteRequest<'_>,
        leg: Leg,
        now: Duration,
        reach: Reach,
    ) -> Result<(), Decision> {
        // Regional gossip: another region's replicas are known only by its offer.
        let model_known = reach.model_known
            || view
                .remote_regions
                .values()
                .any(|o| o.models.iter().any(|m| m.model == req.model));
        if !model_known {
            return Err(Decision::Reject(RejectReason::UnknownModel));
        }
        if !self.tenants.cluster_allows(req.tenant, reach.cluster_slots) {
            return Err(Decision::Reject(RejectReason::OverQuota));
        }
        if !reach.local_usable {
            return Err(self.forward_or_reject(
                view,
                req,
                ForwardReason::NoLocalReplica,
                f64::INFINITY,
                leg,
                now,
            ));
        }
        Ok(())
    }

    /// The scope of a tenant with pools: which replicas may take `req` at all (`self.local`),
    /// and of those which pool is tried, under which caps; or the decision itself (as
    /// [`Router::check_reach`]).
    fn scope(
        &mut self,
        view: &View,
        req: &RouteRequest<'_>,
        leg: Leg,
        now: Duration,
    ) -> Result<Scope, Decision> {
        let tenant_cfg = self.tenants.config(req.tenant);
        let pools = &tenant_cfg.pools;
        let allowed_pool = |r: &ReplicaState| pools.is_empty() || pools.contains(&r.info.pool);
        let reach = self
            .facts
            .mark_local(&mut self.local, view, req, leg, allowed_pool);
        self.check_reach(view, req, leg, now, reach)?;
        // The tenant's first pool (in tier order) that has a usable local replica.
        let local = &self.local;
        let tier_pool = pools.iter().position(|p| {
            view.replicas().iter().enumerate().any(|(i, r)| {
                local.get(i) == Some(&true)
                    && r.info.pool == *p
                    && self.tenants.replica_allows(req.tenant, i)
            })
        });
        Ok(Scope {
            tier_pool,
            // Without a per-replica cap every replica allows the tenant: no lookup per replica.
            per_replica_cap: req.tenant.is_some() && tenant_cfg.max_in_flight_per_replica.is_some(),
            kv_quota: self.tenants.kv_quota(req.tenant),
        })
    }

    /// Makes the candidates: every replica in `scope` the tenant's caps allow, with its hit and
    /// cost. Returns what the spill check and the answer need of them, and whether a cap left
    /// some replica out.
    fn gather(
        &mut self,
        view: &View,
        req: &RouteRequest<'_>,
        now: Duration,
        scope: &Scope,
    ) -> (CandidateTotals, bool) {
        let searched = self.begin_gather(view, req, now);
        let pools = &self.tenants.config(req.tenant).pools;
        let tier_pool = scope.tier_pool.and_then(|p| pools.get(p));
        let uses_cache = self.policy.uses_cache();
        // Gathered as the candidates are made (one pass instead of three; again if a KV quota
        // drops some).
        let mut gathered = CandidateTotals::default();
        let mut quota_blocked = false;
        let kv_slot = scope.kv_quota.map(|(slot, _)| slot);
        let per_replica_cap = scope.per_replica_cap;
        for ((i, r), &local) in view.replicas().iter().enumerate().zip(&self.local) {
            if !local {
                continue;
            }
            let in_pool = match tier_pool {
                Some(p) => r.info.pool == *p,
                None => pools.is_empty() || pools.contains(&r.info.pool),
            };
            if !in_pool {
                continue;
            }
            if per_replica_cap && !self.tenants.replica_allows(req.tenant, i) {
                quota_blocked = true;
                continue;
            }
            let work = candidate_work!(self, uses_cache, searched);
            let c = Self::candidate(work, view, req, now, (i, r), kv_slot);
            self.candidates.push(c);
            gathered.add(
                c.queue_s,
                c.outstanding >= r.info.max_in_flight,
                c.hit_blocks,
            );
        }
        (gathered, quota_blocked)
    }

    /// [`Router::scope`] and [`Router::gather`] in one pass, for a tenant without pools: each
    /// replica's static facts, health, caps, hit and cost read once, every local replica a
    /// candidate. Returns what the pass found of the fleet (for [`Router::check_reach`]), the
    /// candidates' totals and whether a cap left some replica out. At 512 replicas this pass is
    /// most of a decision's instructions (`scripts/decision-instructions.sh`): keep it lean.
    /// Where the decision has the quick candidate's case ([`SlicedPass::gather`]) the pass
    /// prices from the slice search's runs; otherwise each replica in full
    /// ([`Router::gather_each`]).
    fn gather_unpooled(
        &mut self,
        view: &View,
        req: &RouteRequest<'_>,
        leg: Leg,
        now: Duration,
        scope: &Scope,
    ) -> (Reach, CandidateTotals, bool) {
        let searched = self.begin_gather(view, req, now);
        let kv_slot = scope.kv_quota.map(|(slot, _)| slot);
        // The quick candidate's search, where this decision has its common case (no peer tip
        // on the prompt, no KV quota: `quick_price.rs`); each replica still qualifies apart.
        let quick_search = searched.filter(|_| {
            kv_slot.is_none() && self.tip_hits.is_empty() && self.pending_tips.is_empty()
        });
        self.facts
            .begin(req.model, &view.local_region, view.replicas().len());
        self.candidates.reserve(view.replicas().len());
        let gate = Gate {
            local: facts::local(leg),
            excludes: !req.exclude.is_empty(),
            per_replica_cap: scope.per_replica_cap,
        };
        let sliced = quick_search.and_then(|searched| view.sliced_hits(&self.scratch, searched));
        let Some(hits) = sliced else {
            return self.gather_each(view, req, now, gate, searched, kv_slot);
        };
        let pass = SlicedPass {
            quick: QuickPrice::new(&self.cfg.cost, view.tokens_per_block, req.prompt_tokens),
            facts: &mut self.facts,
            tenants: &self.tenants,
            candidates: &mut self.candidates,
            deferred: &mut self.deferred,
        };
        let (reach, quick_totals, quota_blocked) = pass.gather(view, req, gate, &hits);
        let gathered = self.price_deferred(view, req, now, searched, quick_totals);
        (reach, gathered, quota_blocked)
    }

    /// The general candidates [`SlicedPass::gather`] left placeholders for, made in their
    /// places; returns the totals of every candidate (`gathered`: the quick ones'). The same
    /// candidates as pricing each in its turn: a candidate reads nothing of the others, the
    /// hit scratch answers alike in any order of replicas, and the totals are a minimum, a
    /// conjunction and a maximum. No KV quota here (the quick case has none), so no share is
    /// recorded out of turn.
    fn price_deferred(
        &mut self,
        view: &View,
        req: &RouteRequest<'_>,
        now: Duration,
        searched: Option<SlicesSearched>,
        mut gathered: CandidateTotals,
    ) -> CandidateTotals {
        let uses_cache = self.policy.uses_cache();
        for &at in &self.deferred {
            let Some(i) = self.candidates.get(at).map(|c| c.replica) else {
                continue;
            };
            let Some(r) = view.replica(i) else {
                continue;
            };
            let work = candidate_work!(self, uses_cache, searched);
            let c = Self::candidate(work, view, req, now, (i, r), None);
            if let Some(slot) = self.candidates.get_mut(at) {
                *slot = c;
            }
            gathered.add(
                c.queue_s,
                c.outstanding >= r.info.max_in_flight,
                c.hit_blocks,
            );
        }
        gathered
    }

    /// [`Router::gather_unpooled`]'s pass for any other decision: every candidate made in full,
    /// in turn.
    fn gather_each(
        &mut self,
        view: &View,
        req: &RouteRequest<'_>,
        now: Duration,
        gate: Gate,
        searched: Option<SlicesSearched>,
        kv_slot: Option<u8>,
    ) -> (Reach, CandidateTotals, bool) {
        let uses_cache = self.policy.uses_cache();
        let mut reach = Reach::default();
        let mut gathered = CandidateTotals::default();
        let mut quota_blocked = false;
        // `begin` made an entry for every replica: zipped, neither is bounds-checked.
        let (asked, entries) = (&self.facts.asked, &mut self.facts.entries);
        for ((i, r), entry) in view.replicas().iter().enumerate().zip(entries.iter_mut()) {
            let Some(known) = gate.screen(
                entry.known(&r.info, asked),
                (i, r),
                req,
                &self.tenants,
                &mut reach,
                &mut quota_blocked,
            ) else {
                continue;
            };
            let work = candidate_work!(self, uses_cache, searched);
            let c = Self::candidate(work, view, req, now, (i, r), kv_slot);
            self.candidates.push(c);
            gathered.add(
                c.queue_s,
                c.outstanding >= known.max_in_flight,
                c.hit_blocks,
            );
        }
        (reach, gathered, quota_blocked)
    }

    /// Readies the per-decision buffers for making candidates: none yet, the request's keys in
    /// the hit scratch, the peers' tips on its prefix, and (for a policy that reads caches) the
    /// bit-sliced summaries searched for it once; returns that search's token.
    fn begin_gather(
        &mut self,
        view: &View,
        req: &RouteRequest<'_>,
        now: Duration,
    ) -> Option<SlicesSearched> {
        self.candidates.clear();
        self.kv_shares.clear();
        self.scratch.reset(req.keys.len());
        if self.policy.uses_cache() {
            view.peer_tips.hits_and_pending(
                req.keys,
                self.cfg.ride_extensions,
                now,
                &mut self.tip_hits,
                &mut self.pending_tips,
            );
            Some(view.search_slices(req.keys, &mut self.scratch))
        } else {
            self.tip_hits.clear();
            self.pending_tips.clear();
            None
        }
    }

    /// The totals of the candidates left after a KV quota dropped some.
    fn regather(&self, view: &View) -> CandidateTotals {
        let mut gathered = CandidateTotals::default();
        for c in &self.candidates {
            let full = view
                .replica(c.replica)
                .is_some_and(|r| r.load.outstanding() >= r.info.max_in_flight);
            gathered.add(c.queue_s, full, c.hit_blocks);
        }
        gathered
    }

    /// Spill: every local candidate is full or queues past `spill_after_s`, and some region is
    /// better off (a request already forwarded stays).
    fn spill(
        &self,
        view: &View,
        req: &RouteRequest<'_>,
        leg: Leg,
        now: Duration,
        gathered: CandidateTotals,
    ) -> Option<Decision> {
        let CandidateTotals {
            least_queue_s,
            all_full,
            ..
        } = gathered;
        if req.forwarded || !(least_queue_s > self.cfg.spill_after_s || all_full) {
            return None;
        }
        let bar = if all_full {
            f64::INFINITY
        } else {
            least_queue_s
        };
        let region =
            self.nearest_region_under(view, req, bar.min(self.cfg.spill_after_s), leg, now)?;
        Some(Decision::Forward {
            region,
            reason: ForwardReason::Spill,
        })
    }

    /// The policy's pick among the candidates (after the affinity credit), as the decision.
    fn choose(
        &mut self,
        view: &View,
        req: &RouteRequest<'_>,
        now: Duration,
        gathered: CandidateTotals,
        kv_steer: KvSteer,
    ) -> Decision {
        let uses_cache = self.policy.uses_cache();
        let cost = self.cfg.cost;
        let preferred = self.credit_affinity(req);
        let pick = self.policy.pick(
            &PolicyInput {
                candidates: &self.candidates,
                keys: req.keys,
            },
            &mut self.rng,
        );
        let chosen = self.candidates[pick.chosen];
        let fetch = self.fetch_for(view, req, pick.chosen);
        let hit_blocks = if uses_cache {
            chosen.hit_blocks
        } else {
            view.hit_with(chosen.replica, req.keys, now, &mut self.scratch) as u32
        };
        let affinity = preferred == Some(pick.chosen);
        Decision::Route(Routed {
            replica: chosen.replica,
            runner_up: pick.runner_up.map(|p| self.candidates[p].replica),
            hit_blocks,
            best_hit_blocks: uses_cache.then_some(gathered.best_hit_blocks),
            affinity,
            predicted_s: if affinity {
                chosen.cost_s + cost.affinity_credit_s
            } else {
                chosen.cost_s
            },
            cost_s: chosen.cost_s,
            reason: pick.reason,
            kv_steer,
            saturated: gathered.all_full,
            dp_rank: None,
            fetch,
        })
    }

    /// Candidate `i` (replica `r`) for `req`: its hit (summary, overlay, tiers, peers' tips; a
    /// burst riding on a computation under way), the tenant's KV share it would reach, and its
    /// queue, prefill and cost. Inlined into both gathering loops: called once per replica and
    /// decision, its call alone (arguments, registers) was a fifth of its instructions.
    #[inline(always)]
    fn candidate(
        w: CandidateWork<'_>,
        view: &View,
        req: &RouteRequest<'_>,
        now: Duration,
        (i, r): (usize, &ReplicaState),
        kv_slot: Option<u8>,
    ) -> Candidate {
        let (uses_cache, cost) = (w.uses_cache, w.cost);
        let tpb = view.tokens_per_block as u64;
        let (mut hit_blocks, mut credited_blocks) = if uses_cache {
            // Most replicas' hit is the run their slice's search found.
            let sliced = w
                .searched
                .and_then(|searched| view.sliced_hit(i, r, w.scratch, searched));
            let mut h = match sliced {
                Some(gpu) => TierHit {
                    gpu,
                    cpu: gpu,
                    any: gpu,
                },
                None => view.hit_tiers_with(i, req.keys, now, w.scratch),
            };
            // A peer just routed this prefix here: computed on GPU by the time it counts.
            let tip = if w.tip_hits.is_empty() {
                None
            } else {
                w.tip_hits.iter().find(|(r, _)| *r == i)
            };
            if let Some(&(_, t)) = tip {
                let t = t as usize;
                h.gpu = h.gpu.max(t);
                h.cpu = h.cpu.max(t);
                h.any = h.any.max(t);
            }
            (h.any as u32, cost.credited_blocks_on(&r.info, h))
        } else {
            (0, 0.0)
        };
        // A prompt this request repeats or extends is being computed there right now (a burst
        // of one prompt, or an agent's next turn sent before its last one's first byte): it
        // rides on that computation. Only where an overlay or a peer's tip could say so: most
        // replicas are looked up no further.
        let ride = if uses_cache
            && (hit_blocks as usize) < req.keys.len()
            && (r.has_overlay() || !w.pending_tips.is_empty())
        {
            let extensions = w.ride_extensions.then_some(w.ride_min_tokens);
            ride_on(
                w.pending_tips,
                extensions,
                view,
                i,
                req.keys,
                hit_blocks as usize,
                now,
            )
        } else {
            None
        };
        if let Some((blocks, _)) = ride {
            hit_blocks = u32::try_from(blocks).unwrap_or(u32::MAX);
            credited_blocks = f64::from(hit_blocks);
        }
        if let Some(slot) = kv_slot {
            let new_blocks = req.keys.len().saturating_sub(hit_blocks as usize);
            w.kv_shares.push(if new_blocks == 0 {
                (-1.0, 0.0)
            } else {
                let added = (new_blocks as u64 * tpb) as f64 / r.info.capacity_tokens.max(1) as f64;
                (r.kv_share(slot), added.min(1.0) as f32)
            });
        }
        // `CostModel::queue_s`, with its prefill part kept for the candidate.
        let outstanding = r.load.outstanding();
        let prefill_queue_s = cost.prefill_queue_s(r);
        let queue_s = prefill_queue_s + cost.w_load_s * outstanding as f64;
        let prefill_s = cost.prefill_s(r, req.prompt_tokens, credited_blocks * tpb as f64);
        let mut cost_s = queue_s + prefill_s;
        if let Some((_, wait_s)) = ride {
            // It starts once the prompt it rides on is computed, not behind the whole queued
            // prefill (which counts that very computation from its start).
            let ride_s = wait_s + cost.w_load_s * f64::from(outstanding) + prefill_s;
            cost_s = cost_s.min(ride_s);
        }
        Candidate {
            replica: i,
            seed: r.seed,
            hit_blocks,
            credited_blocks,
            outstanding,
            in_flight: r.load.in_flight,
            queue_s,
            prefill_queue_s,
            cost_s,
            prefill_s,
            cache_fill: cost.cache_fill(r),
        }
    }

    /// The KV pull the chosen candidate makes, if any: the one priced into the decision, or
    /// (reactive) one planned now from the longest holder.
    fn fetch_for(&self, view: &View, req: &RouteRequest<'_>, chosen: usize) -> Option<KvFetchPlan> {
        let cost = &self.cfg.cost;
        if !self.policy.uses_cache() {
            return None;
        }
        let planned = self
            .plans_live
            .then(|| self.fetch_plans.get(chosen).copied().flatten())
            .flatten();
        match cost.fetch.mode {
            FetchMode::Off | FetchMode::Priced => planned,
            FetchMode::Reactive => planned.or_else(|| {
                fetch_plan::reactive(
                    &cost.fetch,
                    view,
                    &self.candidates,
                    chosen,
                    req.prompt_tokens,
                )
            }),
        }
    }

    /// A prompt whose longest cached prefix is in another region (`remote_prefix`): prices a
    /// pull from that region's holder into the candidates, and forwards the request there when
    /// that is sooner than any local way (`remote_prefix.rs`). Whole requests only; a request
    /// that already hopped may still pull.
    fn weigh_remote_prefix(
        &mut self,
        view: &View,
        req: &RouteRequest<'_>,
        leg: Leg,
        now: Duration,
        gathered: CandidateTotals,
    ) -> Option<Decision> {
        let mode = self.cfg.remote_prefix;
        if mode == RemotePrefixMode::Local || leg != Leg::Whole || !self.policy.uses_cache() {
            return None;
        }
        if !self.plans_live {
            self.fetch_plans.clear();
            self.fetch_plans.resize(self.candidates.len(), None);
        }
        let ask = RemoteAsk {
            mode,
            model: req.model,
            pools: &self.tenants.config(req.tenant).pools,
            keys: req.keys,
            prompt_tokens: req.prompt_tokens,
            local_best_blocks: gathered.best_hit_blocks,
            may_forward: !req.forwarded,
        };
        let facts = &mut self.facts;
        let eligible = |i: usize, r: &ReplicaState| {
            let bits = facts.get(i, &r.info);
            bits & (facts::SERVES | facts::IN_REGION) == facts::SERVES && !req.exclude.contains(&i)
        };
        let way = remote_prefix::weigh(
            view,
            &self.cfg.cost,
            &ask,
            (&mut self.candidates, &mut self.fetch_plans),
            now,
            eligible,
        );
        match way {
            RemoteWay::Stay { pulls } => {
                self.plans_live |= pulls;
                None
            }
            RemoteWay::Forward(region) => Some(Decision::Forward {
                region: region.to_owned(),
                reason: ForwardReason::Prefix,
            }),
        }
    }

    /// Credits the session's (or, while caches do not tell the candidates apart, the affinity
    /// key's) rendezvous-preferred candidate with `affinity_credit_s`; returns its position.
    fn credit_affinity(&mut self, req: &RouteRequest<'_>) -> Option<usize> {
        let credit_s = self.cfg.cost.affinity_credit_s;
        if req.session.is_none() && req.affinity_key.is_none() {
            return None;
        }
        let longest = self.candidates.iter().map(|c| c.hit_blocks).max();
        if let Some(session) = req.session {
            // A session's credit keeps its turns together; it never pulls a turn off a longer
            // cached prefix elsewhere (a client sending a new session id per request, as aiperf
            // does, would otherwise scatter follow-ups: issue #38).
            let p = affinity::preferred(session.as_bytes(), self.candidates.iter().map(|c| c.seed))
                .filter(|&p| Some(self.candidates[p].hit_blocks) == longest)?;
            self.candidates[p].cost_s -= credit_s;
            return Some(p);
        }
        let key = req.affinity_key?;
        // Only while caches do not tell the candidates apart: a replica holding more of the
        // prompt wins on its own.
        if longest != self.candidates.iter().map(|c| c.hit_blocks).min() {
            return None;
        }
        let p = affinity::preferred(key.as_bytes(), self.candidates.iter().map(|c| c.seed))?;
        self.candidates[p].cost_s -= credit_s;
        Some(p)
    }

    /// Applies a KV quota of `quota` to the candidates (their shares in `kv_shares`): drops those
    /// over it when some are not, else keeps those the tenant dominates (module doc). Never
    /// leaves none. Says whether it dropped any, or let the tenant overflow.
    fn steer_kv(&mut self, quota: f32) -> KvSteer {
        let shares = &self.kv_shares;
        debug_assert_eq!(shares.len(), self.candidates.len());
        // Over: at its quota already, or would be once this request's blocks are in.
        let over = |&(s, added): &(f32, f32)| s + added >= quota;
        let keep_from = if shares.iter().any(|s| !over(s)) {
            // Keep the ones under (a share of -1, bringing nothing, is under any quota).
            f32::NEG_INFINITY
        } else {
            let fullest = shares.iter().map(|s| s.0).fold(f32::NEG_INFINITY, f32::max);
            let floor = fullest - KV_DOMINATED_MARGIN;
            // The cheapest candidate among those holding at least `least` of the tenant.
            let cheapest_from = |least: f32| {
                self.candidates
                    .iter()
                    .zip(shares)
                    .filter(|(_, s)| s.0 >= least)
                    .map(|(c, _)| c.cost_s)
                    .fold(f64::INFINITY, f64::min)
            };
            let pool = cheapest_from(floor);
            if pool - cheapest_from(f32::NEG_INFINITY) > KV_OVERFLOW_S {
                // Its replicas queue too long: it overflows to the others, by the policy.
                return KvSteer::Overflowed;
            }
            // Within its pool, the fullest takes it while that one keeps up: sharing the
            // traffic evenly would keep two replicas it came to fill at once (three nodes
            // routing its first requests, say) within the margin for good, where the second
            // should drain back to the other tenants.
            if cheapest_from(fullest) - pool > KV_OVERFLOW_S {
                floor
            } else {
                fullest
            }
        };
        let keep = |s: &(f32, f32)| {
            if keep_from == f32::NEG_INFINITY {
                !over(s)
            } else {
                s.0 >= keep_from
            }
        };
        let before = self.candidates.len();
        let mut kept = 0;
        for (j, share) in shares.iter().enumerate() {
            if keep(share) {
                self.candidates.swap(kept, j);
                kept += 1;
            }
        }
        self.candidates.truncate(kept.max(1));
        if kept < before {
            KvSteer::Steered
        } else {
            KvSteer::Unsteered
        }
    }

    fn forward_or_reject(
        &self,
        view: &View,
        req: &RouteRequest<'_>,
        reason: ForwardReason,
        bar: f64,
        leg: Leg,
        now: Duration,
    ) -> Decision {
        if !req.forwarded {
            if let Some(region) = self.nearest_region_under(view, req, bar, leg, now) {
                return Decision::Forward { region, reason };
            }
        }
        Decision::Reject(RejectReason::NoHealthyReplica)
    }

    /// The other region where `req` would start soonest (`region_choice.rs`): least
    /// `RTT + queue + prefill of what it does not hold` among regions with a healthy, non-full
    /// replica of the model in the tenant's pools queueing under `bar` seconds, which can take
    /// `leg` (requests cross regions whole: the region's node may then split them again).
    fn nearest_region_under(
        &self,
        view: &View,
        req: &RouteRequest<'_>,
        bar: f64,
        leg: Leg,
        now: Duration,
    ) -> Option<String> {
        let ask = RegionAsk {
            model: req.model,
            pools: &self.tenants.config(req.tenant).pools,
            keys: req.keys,
            prompt_tokens: req.prompt_tokens,
            bar_s: bar,
            leg,
            choice: self.cfg.forward_by,
        };
        choose_region(view, &self.cfg.cost, &ask, now)
    }
}

/// What one decision asks of every replica before it is a candidate, beyond its remembered
/// facts: the bits a local replica has for the leg, and whether the request excludes replicas
/// or the tenant has a per-replica cap (most do neither: then one test a replica for both).
#[derive(Clone, Copy, Debug)]
struct Gate {
    /// [`facts::local`] of the leg.
    local: u8,
    /// The request excludes some replicas (a failover's retry).
    excludes: bool,
    /// The tenant has a per-replica in-flight cap.
    per_replica_cap: bool,
}

impl Gate {
    /// Replica `i`'s (state `r`, remembered facts `known`) facts when it is a candidate: serves
    /// the model, takes the leg, healthy, in the local region, not excluded, under the tenant's
    /// cap. Counts it in `reach` (and a cap's refusal in `quota_blocked`) as it goes.
    #[inline(always)]
    fn screen<'k>(
        self,
        known: &'k Known,
        (i, r): (usize, &ReplicaState),
        req: &RouteRequest<'_>,
        tenants: &Tenants,
        reach: &mut Reach,
        quota_blocked: &mut bool,
    ) -> Option<&'k Known> {
        if known.flags & facts::SERVES == 0 {
            return None;
        }
        reach.model_known = true;
        reach.cluster_slots += u64::from(known.max_in_flight);
        if known.flags & self.local != self.local || r.health != Health::Healthy {
            return None;
        }
        if self.excludes || self.per_replica_cap {
            if self.excludes && req.exclude.contains(&i) {
                return None;
            }
            reach.local_usable = true;
            if self.per_replica_cap && !tenants.replica_allows(req.tenant, i) {
                *quota_blocked = true;
                return None;
            }
        }
        reach.local_usable = true;
        Some(known)
    }
}

/// [`Router::gather_unpooled`]'s pass where the decision has the quick candidate's case, with
/// the router's fields it uses borrowed apart (the slice runs it reads are in the router's hit
/// scratch, borrowed for the pass).
struct SlicedPass<'a> {
    quick: QuickPrice,
    facts: &'a mut StaticFacts,
    tenants: &'a Tenants,
    candidates: &'a mut Vec<Candidate>,
    deferred: &'a mut Vec<usize>,
}

impl SlicedPass<'_> {
    /// Each replica whose hit is its slice's run (`hits`) priced at once, any other (an
    /// overlay, lower tiers, a filter not sliced) left a placeholder and its position in
    /// `deferred`, for [`Router::price_deferred`]. The pass makes no general candidate (which
    /// needs the hit scratch mutably), so it walks the runs zipped with the replicas and their
    /// remembered facts (no bounds check, no reload of the router's fields for each replica),
    /// and its registers hold little more than the quick candidate's numbers. Returns what the
    /// pass found of the fleet, the quick candidates' totals and whether a cap left some
    /// replica out.
    fn gather(
        self,
        view: &View,
        req: &RouteRequest<'_>,
        gate: Gate,
        hits: &SlicedHits<'_>,
    ) -> (Reach, CandidateTotals, bool) {
        let mut reach = Reach::default();
        let mut gathered = CandidateTotals::default();
        let mut quota_blocked = false;
        self.deferred.clear();
        // `begin` made an entry for every replica, and the search a run for every replica
        // (`sliced_hits`): zipped, none is bounds-checked.
        let (asked, entries) = (&self.facts.asked, &mut self.facts.entries);
        let replicas = view.replicas().iter().enumerate().zip(entries.iter_mut());
        for (((i, r), entry), found) in replicas.zip(hits.found()) {
            let known = entry.known(&r.info, asked);
            let screened = gate.screen(
                known,
                (i, r),
                req,
                self.tenants,
                &mut reach,
                &mut quota_blocked,
            );
            let Some(known) = screened else {
                continue;
            };
            match hits.hit(i, r, found) {
                Some(run) => {
                    let c = self.quick.candidate(i, r, run, known.price);
                    self.candidates.push(c);
                    gathered.add(
                        c.queue_s,
                        c.outstanding >= known.max_in_flight,
                        c.hit_blocks,
                    );
                }
                None => {
                    self.deferred.push(self.candidates.len());
                    self.candidates.push(placeholder(i));
                }
            }
        }
        (reach, gathered, quota_blocked)
    }
}

/// A candidate's place in the candidates, held for replica `i` until its general candidate is
/// made ([`Router::price_deferred`]); never read as a candidate.
fn placeholder(i: usize) -> Candidate {
    Candidate {
        replica: i,
        seed: 0,
        hit_blocks: 0,
        credited_blocks: 0.0,
        outstanding: 0,
        in_flight: 0,
        queue_s: 0.0,
        prefill_queue_s: 0.0,
        cost_s: 0.0,
        prefill_s: 0.0,
        cache_fill: 0.0,
    }
}

/// The router's [`CandidateWork`] for a candidate of this decision, its fields borrowed one by
/// one (a method would borrow the whole router, which the gathering loops hold parts of).
macro_rules! candidate_work {
    ($router:ident, $uses_cache:expr, $searched:expr) => {
        CandidateWork {
            uses_cache: $uses_cache,
            cost: &$router.cfg.cost,
            scratch: &mut $router.scratch,
            searched: $searched,
            tip_hits: &$router.tip_hits,
            pending_tips: &$router.pending_tips,
            ride_extensions: $router.cfg.ride_extensions,
            ride_min_tokens: $router.cfg.ride_extension_min_tokens,
            kv_shares: &mut $router.kv_shares,
        }
    };
}
use candidate_work;

/// What making one candidate reads and writes of the router, borrowed field by field so that
/// the tenant's pools (borrowed from the router too) stay readable across the candidate loop.
struct CandidateWork<'a> {
    uses_cache: bool,
    cost: &'a CostModel,
    scratch: &'a mut HitScratch,
    /// This request's slice search ([`View::search_slices`]), when the policy reads caches.
    searched: Option<SlicesSearched>,
    tip_hits: &'a [(usize, u32)],
    pending_tips: &'a [(usize, u32, Duration)],
    /// [`RouterConfig::ride_extensions`].
    ride_extensions: bool,
    /// [`RouterConfig::ride_extension_min_tokens`].
    ride_min_tokens: u64,
    kv_shares: &'a mut Vec<(f32, f32)>,
}

/// The prompt `keys` ride on at replica `i`, if one is being computed there now: its length in
/// blocks and the seconds until its prefill is done. This node's own routing (a prompt it sent
/// there that `keys` repeat or extend, past the `from` blocks already counting), or a peer's
/// tip of one (`pending_tips`, [`crate::core::peer_tips::PeerTips::hits_and_pending`]); the longer,
/// then the sooner. A prompt it only extends counts where `extensions` is the shortest such
/// prompt in tokens ([`RouterConfig::ride_extensions`], `ride_extension_min_tokens`; the peers'
/// tips were gathered the same way).
///
/// Burst co-location: `n` identical prompts within a prefill (RL `n`-sample rollouts) ride on
/// the first, which computes the prompt once, instead of each landing on an idle replica that
/// computes it again. An agent's next turn, sent before its last turn's first byte, rides the
/// same way on the part it repeats. Until the first's prefill ends neither the summary nor the
/// counting overlay holds the prompt, and the replica's queue counts that prefill in full, so
/// without this every follower looks dearer there than on an idle replica by the prefill
/// itself. The node's hold (`core::hold`) then keeps a rider back until that prefill's first
/// byte, so it finds the whole ridden part cached; without the hold an engine caching chunk
/// by chunk (vLLM v1, SGLang) gives it what is scheduled so far, and it computes the rest
/// alongside.
fn ride_on(
    pending_tips: &[(usize, u32, Duration)],
    extensions: Option<u64>,
    view: &View,
    i: usize,
    keys: &[BlockKey],
    from: usize,
    now: Duration,
) -> Option<(usize, f64)> {
    let tpb = u64::from(view.tokens_per_block);
    let rides = |blocks: usize| {
        blocks == keys.len() || extensions.is_some_and(|min| blocks as u64 * tpb >= min)
    };
    let own = view
        .pending_run(i, keys, from, now)
        .filter(|&(blocks, _)| rides(blocks));
    let peer = pending_tips
        .iter()
        .find(|(r, ..)| *r == i)
        .map(|&(_, blocks, ready)| (blocks as usize, ready))
        .filter(|&(blocks, _)| rides(blocks));
    let (blocks, ready) = match (own, peer) {
        (Some(a), Some(b)) => {
            if a.0 != b.0 {
                a.max(b)
            } else {
                (a.0, a.1.min(b.1))
            }
        }
        (a, b) => a.or(b)?,
    };
    Some((blocks, ready.saturating_sub(now).as_secs_f64()))
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use proptest::prelude::*;

    use super::*;
    use crate::core::keys::{text_block_keys, Namespace};
    use crate::core::role::Role;
    use crate::core::summary::{ReplicaSummary, SummaryConfig, Tier};
    use crate::core::tenants::TenantConfig;
    use crate::core::view::testing::info;

    const NOW: Duration = Duration::from_secs(1000);

    fn router(policy: PolicyKind) -> Router {
        Router::new(
            RouterConfig {
                policy,
                ..Default::default()
            },
            Tenants::default(),
        )
    }

    fn req<'a>(keys: &'a [BlockKey]) -> RouteRequest<'a> {
        RouteRequest::plain("m", keys, keys.len() as u64 * 64)
    }

    fn prompt_keys(text: &str) -> Vec<BlockKey> {
        let mut k = Vec::new();
        text_block_keys(
            Namespace::new("m", None, None, None),
            text.repeat(64).as_bytes(),
            256,
            &mut k,
        );
        k
    }

    fn routed(d: Decision) -> Routed {
        match d {
            Decision::Route(r) => r,
            other => panic!("expected a route, got {other:?}"),
        }
    }

    #[test]
    fn a_prefix_sticks_to_the_replica_that_holds_it() {
        let mut v = View::new("eu", 64);
        for i in 0..4 {
            v.upsert(info(&format!("r{i}"), "eu"));
        }
        let keys = prompt_keys("shared system prompt ");
        let mut s = ReplicaSummary::new(1, 10_000, &SummaryConfig::for_cluster("c")).unwrap();
        s.insert(&keys);
        v.set_summary(2, s);
        let mut r = router(PolicyKind::P2cCache);
        for _ in 0..20 {
            let d = routed(r.route(&v, &req(&keys), NOW));
            assert_eq!(d.replica, 2);
            assert_eq!(d.hit_blocks as usize, keys.len());
            assert!(matches!(d.reason, Reason::LongestHit));
        }
    }

    #[test]
    fn a_prefix_a_peer_just_routed_counts_where_it_went() {
        let mut v = View::new("eu", 64);
        for i in 0..4 {
            v.upsert(info(&format!("r{i}"), "eu"));
        }
        let turn1 = prompt_keys("a conversation ");
        // Another node routed turn 1 to r2 a moment ago; its prefill is done by NOW.
        v.peer_tips.insert(
            *turn1.last().unwrap(),
            crate::core::peer_tips::Tip {
                replica: 2,
                blocks: turn1.len() as u32,
                ready: NOW - Duration::from_millis(10),
                until: NOW + Duration::from_secs(10),
            },
        );
        // Turn 2 extends turn 1: this node has no summary or overlay for it, yet sees the hit.
        let mut turn2 = turn1.clone();
        turn2.extend(prompt_keys("the next question "));
        let mut r = router(PolicyKind::P2cCache);
        let d = routed(r.route(&v, &req(&turn2), NOW));
        assert_eq!((d.replica, d.hit_blocks), (2, turn1.len() as u32));
        assert_eq!(d.branch(), Branch::Cache);
        // Policies blind to caches do not look.
        let mut rr = router(PolicyKind::RoundRobin);
        assert!(routed(rr.route(&v, &req(&turn2), NOW))
            .best_hit_blocks
            .is_none());
    }

    #[test]
    fn a_sessions_credit_never_pulls_a_turn_off_a_longer_cached_prefix() {
        // aiperf sends a new `X-Session-Affinity` per request: with the credit on whichever
        // replica each id prefers, follow-ups scattered off their holder (issue #38).
        let mut v = View::new("eu", 64);
        for i in 0..4 {
            v.upsert(info(&format!("r{i}"), "eu"));
        }
        let keys = prompt_keys("an earlier turn of this conversation ");
        let mut s = ReplicaSummary::new(1, 10_000, &SummaryConfig::for_cluster("c")).unwrap();
        s.insert(&keys);
        v.set_summary(0, s);
        let mut r = router(PolicyKind::P2cCache);
        let ids: Vec<String> = (0..32).map(|i| format!("session-{i}")).collect();
        for id in &ids {
            let mut turn = req(&keys);
            turn.session = Some(id);
            let d = routed(r.route(&v, &turn, NOW));
            assert_eq!((d.replica, d.branch()), (0, Branch::Cache), "{id}");
        }
        // Where caches do not tell replicas apart, the session still has its replica.
        let cold = prompt_keys("nobody has this ");
        let mut turn = req(&cold);
        turn.session = Some(&ids[0]);
        assert!(routed(r.route(&v, &turn, NOW)).affinity);
    }

    #[test]
    fn each_decision_names_the_consideration_that_decided_it() {
        let mut v = View::new("eu", 64);
        for i in 0..2 {
            v.upsert(info(&format!("r{i}"), "eu"));
        }
        let keys = prompt_keys("shared system prompt ");
        let mut s = ReplicaSummary::new(1, 10_000, &SummaryConfig::for_cluster("c")).unwrap();
        s.insert(&keys);
        v.set_summary(0, s);
        let mut r = router(PolicyKind::P2cCache);
        let d = routed(r.route(&v, &req(&keys), NOW));
        assert_eq!((d.replica, d.best_hit_blocks), (0, Some(keys.len() as u32)));
        assert_eq!(d.branch(), Branch::Cache);
        assert!(d.predicted_s >= 0.0 && !d.affinity);
        // The holder queues far longer than the prefill it would save: load wins.
        v.set_engine_load(0, 100, 100, 0.9, 10_000_000);
        let d = routed(r.route(&v, &req(&keys), NOW));
        assert_eq!((d.replica, d.hit_blocks), (1, 0));
        assert_eq!(d.best_hit_blocks, Some(keys.len() as u32));
        assert_eq!(d.branch(), Branch::Load);
        // Cold prompts: no hit anywhere is load too; and a session's preferred replica is
        // affinity when it holds nothing better than the others.
        let cold = prompt_keys("nobody has this ");
        let d = routed(r.route(&v, &req(&cold), NOW));
        assert_eq!(d.branch(), Branch::Load);
        let mut with_session = req(&cold);
        with_session.session = Some("s-1");
        v.set_engine_load(0, 0, 0, 0.0, 0);
        let d = routed(r.route(&v, &with_session, NOW));
        assert!(d.affinity);
        assert_eq!(d.branch(), Branch::Affinity);
        assert!(
            (d.predicted_s - d.cost_s - RouterConfig::default().cost.affinity_credit_s).abs()
                < 1e-9
        );
        // Refusals and forwards have their branches.
        assert_eq!(
            Decision::Reject(RejectReason::OverQuota).branch(),
            Branch::Reject
        );
        let fwd = |reason| Decision::Forward {
            region: "us".into(),
            reason,
        };
        assert_eq!(fwd(ForwardReason::Spill).branch(), Branch::Spill);
        assert_eq!(fwd(ForwardReason::NoLocalReplica).branch(), Branch::Forward);
    }

    /// Replica 0 holds the prompt on GPU, replica 1 holds it as long but offloaded (`tier`),
    /// replicas 2 and 3 are cold; loads equal.
    fn gpu_vs_offloaded(keys: &[BlockKey], tier: crate::core::summary::Tier) -> View {
        let mut v = View::new("eu", 64);
        for i in 0..4 {
            v.upsert(info(&format!("r{i}"), "eu"));
        }
        let cfg = SummaryConfig::for_cluster("c");
        let mut gpu = ReplicaSummary::new(1, 10_000, &cfg).unwrap();
        gpu.insert(keys);
        v.set_summary(0, gpu);
        let mut low = ReplicaSummary::new(1, 10_000, &cfg).unwrap();
        low.insert_tier(keys, tier);
        v.set_summary(1, low);
        v
    }

    #[test]
    fn a_gpu_hit_beats_an_equally_long_offloaded_hit() {
        use crate::core::summary::Tier;
        let keys = prompt_keys("offloaded system prompt ");
        for tier in [Tier::Cpu, Tier::Disk] {
            let v = gpu_vs_offloaded(&keys, tier);
            for policy in [PolicyKind::P2cCache, PolicyKind::CacheArgmin] {
                let mut r = router(policy);
                for _ in 0..50 {
                    let d = routed(r.route(&v, &req(&keys), NOW));
                    assert_eq!(d.replica, 0, "{policy} {tier:?}");
                    assert_eq!(d.hit_blocks as usize, keys.len());
                }
            }
            // The offloaded holder still beats a cold replica.
            let mut v = v;
            v.set_health(0, Health::Unhealthy);
            let d = routed(router(PolicyKind::CacheArgmin).route(&v, &req(&keys), NOW));
            assert_eq!(d.replica, 1, "{tier:?}");
        }
    }

    #[test]
    fn the_cost_credits_offloaded_blocks_by_tier_weight() {
        use crate::core::summary::Tier;
        let keys = prompt_keys("half offloaded ");
        let n = keys.len();
        let half = n / 2;
        let mut v = View::new("eu", 64);
        let i = v.upsert(info("r0", "eu"));
        let mut s = ReplicaSummary::new(1, 10_000, &SummaryConfig::for_cluster("c")).unwrap();
        s.insert(&keys[..half]);
        s.insert_tier(&keys[half..], Tier::Cpu);
        v.set_summary(i, s);
        let prompt_tokens = n as u64 * 64 + 100;
        let request = RouteRequest {
            prompt_tokens,
            ..req(&keys)
        };
        let d = routed(router(PolicyKind::CacheArgmin).route(&v, &request, NOW));
        assert_eq!(d.hit_blocks as usize, n, "hit_blocks counts every tier");
        let credited = half as f64 + (n - half) as f64 * 0.75;
        // The prefill price (`cost.rs`): per token plus attention over the credited context.
        let price = |cached: f64| {
            crate::core::cost::prefill_work_s(
                &info("r0", "eu"),
                cached,
                prompt_tokens as f64 - cached,
            )
        };
        let want = price(credited * 64.0);
        assert!((d.cost_s - want).abs() < 1e-12, "{} vs {want}", d.cost_s);
        // Configured weights apply.
        let mut r = Router::new(
            RouterConfig {
                policy: PolicyKind::CacheArgmin,
                cost: CostModel {
                    tier_weights: crate::core::cost::TierWeights {
                        gpu: 1.0,
                        cpu: 0.0,
                        disk: 0.0,
                    },
                    ..CostModel::default()
                },
                ..Default::default()
            },
            Tenants::default(),
        );
        let d = routed(r.route(&v, &request, NOW));
        let want = price(half as f64 * 64.0);
        assert!((d.cost_s - want).abs() < 1e-12, "{} vs {want}", d.cost_s);
    }

    /// Replica 0 holds every key in CPU memory behind a link of `cpu_gb_per_s` (or declares no
    /// load model: `None`); replica 1 holds the first `gpu_blocks` keys on GPU. Which one an
    /// argmin router picks.
    fn cpu_holder_vs_gpu_holder(cpu_gb_per_s: Option<f64>, gpu_blocks: usize) -> usize {
        use crate::core::kv_load::KvLoad;
        use crate::core::summary::Tier;
        let keys = prompt_keys("a prefix offloaded, or recomputed anew. ");
        let cfg = SummaryConfig::for_cluster("c");
        let mut v = View::new("eu", 64);
        let a = v.upsert(ReplicaInfo {
            kv_load: cpu_gb_per_s.map(|gb| KvLoad {
                cpu_gb_per_s: gb,
                ..KvLoad::default()
            }),
            ..info("cpu-holder", "eu")
        });
        let b = v.upsert(info("gpu-holder", "eu"));
        let mut s = ReplicaSummary::new(1, 10_000, &cfg).unwrap();
        s.insert_tier(&keys, Tier::Cpu);
        v.set_summary(a, s);
        let mut s = ReplicaSummary::new(1, 10_000, &cfg).unwrap();
        s.insert(&keys[..gpu_blocks]);
        v.set_summary(b, s);
        routed(router(PolicyKind::CacheArgmin).route(&v, &req(&keys), NOW)).replica
    }

    #[test]
    fn a_slow_cpu_link_loses_to_a_replica_that_recomputes_less() {
        // 8B at 50,000 tokens/s recomputes 6.55 GB/s of KV: over a 5 GB/s link a CPU hit costs
        // more than recomputing it, so a replica holding a quarter of the prefix on GPU wins.
        let n = prompt_keys("a prefix offloaded, or recomputed anew. ").len();
        assert!(n >= 8);
        assert_eq!(cpu_holder_vs_gpu_holder(Some(5.0), n / 4), 1);
        // The fixed discount (0.75) would have sent it to the CPU holder.
        assert_eq!(cpu_holder_vs_gpu_holder(None, n / 4), 0);
        // Even with nothing held elsewhere a cold replica beats the slow copy.
        assert_eq!(cpu_holder_vs_gpu_holder(Some(5.0), 0), 1);
    }

    #[test]
    fn a_fast_link_makes_a_cpu_hit_nearly_as_good_as_gpu() {
        let n = prompt_keys("a prefix offloaded, or recomputed anew. ").len();
        // 400 GB/s: w_cpu = 1 − 6.55/400 ≈ 0.984, better than 90% of the prefix on GPU...
        assert_eq!(cpu_holder_vs_gpu_holder(Some(400.0), n * 9 / 10), 0);
        // ...where the fixed 0.75 prefers the GPU holder.
        assert_eq!(cpu_holder_vs_gpu_holder(None, n * 9 / 10), 1);
        // A PCIe gen5 link (50 GB/s, w ≈ 0.87) still beats three quarters on GPU.
        assert_eq!(cpu_holder_vs_gpu_holder(Some(50.0), n * 3 / 4), 0);
        // Only the full GPU hit beats it.
        assert_eq!(cpu_holder_vs_gpu_holder(Some(400.0), n), 1);
    }

    #[test]
    fn the_overlay_makes_a_burst_stick_before_any_summary() {
        let mut v = View::new("eu", 64);
        for i in 0..4 {
            v.upsert(info(&format!("r{i}"), "eu"));
        }
        let keys = prompt_keys("new conversation ");
        let mut r = router(PolicyKind::P2cCache);
        let first = routed(r.route(&v, &req(&keys), NOW)).replica;
        v.record_routed(first, &keys, NOW);
        for _ in 0..10 {
            let d = routed(r.route(&v, &req(&keys), NOW));
            assert_eq!(d.replica, first);
        }
    }

    /// Routes `n` identical prompts of `blocks` blocks, `gap` apart, round-robin over `nodes`
    /// routers with a fresh 8-replica fleet each, booking each route as the live node does
    /// (overlay from the predicted prefill end, queued prefill) and telling the other routers
    /// as load sharing does (in flight, queued prefill, the prompt's tip). Returns the replica
    /// each request went to.
    fn burst_routes(
        policy: PolicyKind,
        nodes: usize,
        n: usize,
        blocks: usize,
        gap: Duration,
    ) -> Vec<usize> {
        let keys: Vec<BlockKey> = prompt_keys("one rollout prompt, sampled n times ")
            .into_iter()
            .cycle()
            .enumerate()
            .map(|(j, k)| BlockKey(k.0 ^ (j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)))
            .take(blocks)
            .collect();
        let mut views: Vec<View> = (0..nodes)
            .map(|_| {
                let mut v = View::new("eu", 64);
                for i in 0..8 {
                    v.upsert(info(&format!("r{i}"), "eu"));
                }
                v
            })
            .collect();
        let mut routers: Vec<Router> = (0..nodes)
            .map(|k| {
                Router::new(
                    RouterConfig {
                        policy,
                        seed: k as u64,
                        ..Default::default()
                    },
                    Tenants::default(),
                )
            })
            .collect();
        let cost = CostModel::default();
        let mut out = Vec::new();
        // (replica, predicted prefill end, uncached tokens) of every request routed so far: its
        // prefill counts in the replica's queue until then (the node releases it at the first
        // byte).
        let mut queued: Vec<(usize, Duration, u64)> = Vec::new();
        for i in 0..n {
            let now = NOW + gap * i as u32;
            let node = i % nodes;
            for v in &mut views {
                for r in 0..8 {
                    let tokens = queued
                        .iter()
                        .filter(|q| q.0 == r && q.1 > now)
                        .map(|q| q.2)
                        .sum();
                    let peers = v.replica(r).map_or(0, |x| x.load.peer_in_flight);
                    v.set_shared_load(r, peers, tokens);
                }
            }
            let d = routed(routers[node].route(&views[node], &req(&keys), now));
            let uncached = (keys.len() as u64).saturating_sub(u64::from(d.hit_blocks)) * 64;
            let ready_in = views[node].replica(d.replica).map_or(Duration::ZERO, |r| {
                Duration::from_secs_f64(cost.prefill_done_s(r, uncached))
            });
            queued.push((d.replica, now + ready_in, uncached));
            for (k, v) in views.iter_mut().enumerate() {
                let peers = v.replica(d.replica).map_or(0, |r| r.load.peer_in_flight);
                let tokens = v
                    .replica(d.replica)
                    .map_or(0, |r| r.load.queued_prefill_tokens);
                if k == node {
                    v.record_routed_ready(d.replica, &keys, now, ready_in);
                } else {
                    v.set_shared_load(d.replica, peers + 1, tokens + uncached);
                    let tip = crate::core::peer_tips::Tip {
                        replica: d.replica,
                        blocks: keys.len() as u32,
                        ready: now + ready_in,
                        until: now + ready_in + Duration::from_secs(3),
                    };
                    if let Some(last) = keys.last() {
                        v.peer_tips.insert(*last, tip);
                    }
                }
            }
            out.push(d.replica);
        }
        out
    }

    #[test]
    fn a_burst_of_one_prompt_lands_on_one_replica() {
        // RL n-sample rollouts: 8 identical 4k-token prompts within 100 ms, on an idle fleet.
        for nodes in [1, 3] {
            let routes = burst_routes(
                PolicyKind::P2cCache,
                nodes,
                8,
                64,
                Duration::from_micros(12_500),
            );
            let distinct: HashSet<usize> = routes.iter().copied().collect();
            assert_eq!(distinct.len(), 1, "{nodes} node(s): {routes:?}");
        }
    }

    /// An agent's next turn sent before its last turn's first byte: it repeats that turn's
    /// whole prompt and adds a little. It rides on the computation under way, credited with the
    /// part it repeats, instead of recomputing all of it on an idle replica.
    #[test]
    fn a_turn_extending_a_prompt_still_computing_rides_on_it() {
        let mut v = View::new("eu", 64);
        for i in 0..8 {
            v.upsert(info(&format!("r{i}"), "eu"));
        }
        let cost = CostModel::default();
        let turn = |blocks: usize| -> Vec<BlockKey> {
            prompt_keys("an agent's long session ")
                .into_iter()
                .cycle()
                .enumerate()
                .map(|(j, k)| BlockKey(k.0 ^ (j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)))
                .take(blocks)
                .collect()
        };
        // Turn one: 1,600 blocks (~100k tokens), seconds of prefill on an idle replica.
        let (first, next) = (turn(1600), turn(1610));
        let mut r = Router::new(
            RouterConfig {
                ride_extensions: true,
                ..Default::default()
            },
            Tenants::default(),
        );
        let d = routed(r.route(&v, &req(&first), NOW));
        let uncached = first.len() as u64 * 64;
        let ready_in = v.replica(d.replica).map_or(Duration::ZERO, |x| {
            Duration::from_secs_f64(cost.prefill_done_s(x, uncached))
        });
        assert!(ready_in > Duration::from_secs(1), "{ready_in:?}");
        v.record_routed_ready(d.replica, &first, NOW, ready_in);
        v.set_shared_load(d.replica, 0, uncached);
        // Turn two, a second later: the first is still computing.
        let later = NOW + Duration::from_secs(1);
        let two = routed(r.route(&v, &req(&next), later));
        assert_eq!(two.replica, d.replica);
        assert_eq!(two.hit_blocks, 1600, "credited with the part it repeats");
        // Where riders are not held (`ride_extensions` off), it only repeats nothing whole.
        let mut unheld = router(PolicyKind::P2cCache);
        assert_eq!(routed(unheld.route(&v, &req(&next), later)).hit_blocks, 0);
        // Nor on a prompt shorter than the hold holds on (1,600 blocks are 102,400 tokens).
        let mut short_only = Router::new(
            RouterConfig {
                ride_extensions: true,
                ride_extension_min_tokens: 1600 * 64 + 1,
                ..Default::default()
            },
            Tenants::default(),
        );
        assert_eq!(
            routed(short_only.route(&v, &req(&next), later)).hit_blocks,
            0
        );
        // Another node of the region knows turn one only by its peer's tip: the same.
        let mut other = View::new("eu", 64);
        for i in 0..8 {
            other.upsert(info(&format!("r{i}"), "eu"));
        }
        other.set_shared_load(d.replica, 1, uncached);
        let tip = crate::core::peer_tips::Tip {
            replica: d.replica,
            blocks: 1600,
            ready: NOW + ready_in,
            until: NOW + ready_in + Duration::from_secs(10),
        };
        assert!(other.peer_tips.insert(first[1599], tip));
        let by_tip = routed(r.route(&other, &req(&next), later));
        assert_eq!((by_tip.replica, by_tip.hit_blocks), (d.replica, 1600));
        assert_ne!(
            routed(unheld.route(&other, &req(&next), later)).hit_blocks,
            1600
        );
        assert_ne!(
            routed(short_only.route(&other, &req(&next), later)).hit_blocks,
            1600
        );
        // Once the first's prefill is done, the part counts as a plain hit.
        let done = NOW + ready_in + Duration::from_millis(1);
        v.set_shared_load(d.replica, 0, 0);
        let three = routed(r.route(&v, &req(&next), done));
        assert_eq!((three.replica, three.hit_blocks), (d.replica, 1600));
    }

    #[test]
    fn unknown_model_unhealthy_fleet_and_cross_region_fallback() {
        let mut v = View::new("eu", 64);
        let a = v.upsert(info("eu-0", "eu"));
        let b = v.upsert(info("us-0", "us"));
        let mut r = router(PolicyKind::P2cCache);
        let keys = prompt_keys("x");
        let mut unknown = req(&keys);
        unknown.model = "other";
        assert_eq!(
            r.route(&v, &unknown, NOW),
            Decision::Reject(RejectReason::UnknownModel)
        );
        v.set_health(a, Health::Unhealthy);
        assert_eq!(
            r.route(&v, &req(&keys), NOW),
            Decision::Forward {
                region: "us".into(),
                reason: ForwardReason::NoLocalReplica
            }
        );
        // A request that already hopped is never forwarded again.
        let hopped = RouteRequest {
            forwarded: true,
            ..req(&keys)
        };
        assert_eq!(
            r.route(&v, &hopped, NOW),
            Decision::Reject(RejectReason::NoHealthyReplica)
        );
        v.set_health(b, Health::Draining);
        assert_eq!(
            r.route(&v, &req(&keys), NOW),
            Decision::Reject(RejectReason::NoHealthyReplica)
        );
    }

    #[test]
    fn failover_excludes_replicas_already_tried() {
        let mut v = View::new("eu", 64);
        let a = v.upsert(info("eu-0", "eu"));
        let b = v.upsert(info("eu-1", "eu"));
        v.upsert(info("us-0", "us"));
        let keys = prompt_keys("retry");
        let mut r = router(PolicyKind::P2cCache);
        let tried = [a];
        for _ in 0..20 {
            assert_eq!(
                routed(r.route(
                    &v,
                    &RouteRequest {
                        exclude: &tried,
                        ..req(&keys)
                    },
                    NOW
                ))
                .replica,
                b
            );
        }
        // Every local replica tried: the request goes to the nearest other region.
        let all = [a, b];
        assert_eq!(
            r.route(
                &v,
                &RouteRequest {
                    exclude: &all,
                    ..req(&keys)
                },
                NOW
            ),
            Decision::Forward {
                region: "us".into(),
                reason: ForwardReason::NoLocalReplica
            }
        );
        // Exclusion is per request: the view itself is untouched.
        assert_eq!(v.replica(a).unwrap().health, Health::Healthy);
    }

    #[test]
    fn spill_goes_to_the_nearest_region_with_room() {
        let mut v = View::new("eu", 64);
        let a = v.upsert(info("eu-0", "eu"));
        v.upsert(info("us-0", "us"));
        v.upsert(info("ap-0", "ap"));
        v.regions.measured("eu", "us", 90.0);
        v.regions.measured("eu", "ap", 30.0);
        let keys = prompt_keys("y");
        let mut r = router(PolicyKind::P2cCache);
        assert!(matches!(r.route(&v, &req(&keys), NOW), Decision::Route(_)));
        // 20 s of queued prefill at eu-0: over the 10 s spill bar.
        v.set_engine_load(a, 50, 100, 0.9, 1_000_000);
        assert_eq!(
            r.route(&v, &req(&keys), NOW),
            Decision::Forward {
                region: "ap".into(),
                reason: ForwardReason::Spill
            }
        );
        // When every other region is busier still, stay home.
        let (us, ap) = (v.index_of("us-0").unwrap(), v.index_of("ap-0").unwrap());
        v.set_engine_load(us, 0, 0, 0.0, 5_000_000);
        v.set_engine_load(ap, 0, 0, 0.0, 5_000_000);
        assert!(matches!(r.route(&v, &req(&keys), NOW), Decision::Route(_)));
    }

    /// A router whose tenant "big" may hold at most `share` of any replica's KV cache.
    fn kv_quota_router(share: f64) -> Router {
        Router::new(
            RouterConfig::default(),
            Tenants::new(
                HashMap::from([(
                    "big".to_owned(),
                    TenantConfig {
                        max_kv_share: Some(share),
                        ..Default::default()
                    },
                )]),
                TenantConfig::default(),
            ),
        )
    }

    /// Four replicas in `eu` (64-token blocks, KV caches of `capacity_tokens`) where tenant "big"
    /// holds `shares[i]` of replica `i`, and a router giving it a KV quota of `quota`.
    fn kv_quota_fleet(quota: f64, shares: [f32; 4], capacity_tokens: u64) -> (View, Router) {
        let mut v = View::new("eu", 64);
        for i in 0..4 {
            v.upsert(ReplicaInfo {
                capacity_tokens,
                ..info(&format!("r{i}"), "eu")
            });
        }
        let r = kv_quota_router(quota);
        let (slot, _) = r.tenants.kv_quota(Some("big")).unwrap();
        let mut slots = [0.0f32; crate::core::tenants::KV_SLOTS];
        for (i, s) in shares.into_iter().enumerate() {
            slots[slot as usize] = s;
            v.set_kv_shares(i, &slots);
        }
        (v, r)
    }

    #[test]
    fn a_tenant_over_its_kv_share_goes_where_it_is_under_but_keeps_a_full_hit() {
        // Over on r0, r1, r3; under on r2.
        let (mut v, mut r) = kv_quota_fleet(0.5, [0.9, 0.6, 0.2, 0.5], 450_000);
        let keys = prompt_keys("big tenant prompt ");
        fn big(keys: &[BlockKey]) -> RouteRequest<'_> {
            RouteRequest {
                tenant: Some("big"),
                ..req(keys)
            }
        }
        for k in 0..50u64 {
            let mut own = keys.clone();
            own.push(BlockKey(k)); // a unique tail: new blocks wherever it goes
            let d = routed(r.route(&v, &big(&own), NOW));
            assert_eq!(d.replica, 2, "the only replica under the share");
            assert_eq!(d.kv_steer, KvSteer::Steered);
        }
        // Another tenant (and a client-made name) is not steered.
        let mut seen = std::collections::HashSet::new();
        for k in 0..200u64 {
            let own = [BlockKey(1000 + k)];
            let other = RouteRequest {
                tenant: Some("small-1"),
                ..req(&own)
            };
            let d = routed(r.route(&v, &other, NOW));
            assert_eq!(d.kv_steer, KvSteer::Unsteered);
            seen.insert(d.replica);
        }
        assert_eq!(seen.len(), 4);
        // A prompt r0 holds whole brings nothing there: the hit is kept.
        v.record_routed(0, &keys, NOW - Duration::from_secs(1));
        let d = routed(r.route(&v, &big(&keys), NOW));
        assert_eq!((d.replica, d.hit_blocks as usize), (0, keys.len()));
        // One more block than r0 holds: r0 is over again, so the request goes to r2.
        let mut longer = keys.clone();
        longer.push(BlockKey(7));
        assert_eq!(routed(r.route(&v, &big(&longer), NOW)).replica, 2);
    }

    #[test]
    fn a_request_that_would_take_its_tenant_over_the_share_counts_as_over() {
        // It fills r0; it holds 5 % of each other replica, under its 10 %. Caches of 100
        // blocks: one new block is a hundredth of a replica.
        let (v, mut r) = kv_quota_fleet(0.1, [0.6, 0.05, 0.05, 0.05], 100 * 64);
        let mut big = |keys: &[BlockKey]| -> usize {
            let req = RouteRequest {
                tenant: Some("big"),
                ..req(keys)
            };
            routed(r.route(&v, &req, NOW)).replica
        };
        // Three new blocks (3 %) fit under the share anywhere: it goes where it is under.
        let small: Vec<BlockKey> = (0..3).map(BlockKey).collect();
        assert_ne!(big(&small), 0);
        // Eight (8 %) would take it to 13 % wherever it is under: over everywhere, so it stays
        // on the replica it fills instead of flushing another one past its share.
        let long: Vec<BlockKey> = (0..8).map(BlockKey).collect();
        for _ in 0..50 {
            assert_eq!(big(&long), 0);
        }
    }

    #[test]
    fn a_tenant_over_its_kv_share_everywhere_stays_on_the_replicas_it_dominates() {
        let (mut v, mut r) = kv_quota_fleet(0.3, [0.35, 0.95, 0.31, 0.88], 450_000);
        // Routes `n` one-block requests of "big" with `router`; the replicas they went to, and
        // what the quota did to each one (all alike, or it panics).
        fn big_to(router: &mut Router, v: &View, n: u64) -> (HashSet<usize>, KvSteer) {
            let mut seen = HashSet::new();
            let mut how = None;
            for k in 0..n {
                let own = [BlockKey(k)];
                let big = RouteRequest {
                    tenant: Some("big"),
                    ..req(&own)
                };
                let d = routed(router.route(v, &big, NOW));
                assert_eq!(
                    *how.get_or_insert(d.kv_steer),
                    d.kv_steer,
                    "every request alike"
                );
                seen.insert(d.replica);
            }
            (seen, how.unwrap_or_default())
        }
        // Its pool is r1 (0.95) and r3 (0.88, within 0.1 of it); the fullest, r1, takes it while
        // it keeps up. Never r0 or r2, and never rejected.
        assert_eq!(
            big_to(&mut r, &v, 200),
            (HashSet::from([1]), KvSteer::Steered)
        );
        // r1 queues a second of prefill: the pool's other replica takes it.
        let rate = v.replica(1).unwrap().info.prefill_tokens_per_s as u64;
        v.set_engine_load(1, 0, 0, 0.0, rate);
        assert_eq!(
            big_to(&mut r, &v, 50),
            (HashSet::from([3]), KvSteer::Steered)
        );
        // Both queue a second: it overflows to the others, and says so.
        v.set_engine_load(3, 0, 0, 0.0, rate);
        assert_eq!(
            big_to(&mut r, &v, 50),
            (HashSet::from([0, 2]), KvSteer::Overflowed)
        );
        // Without the quota the same tenant spreads over all four (loads as they were).
        for i in [1, 3] {
            v.set_engine_load(i, 0, 0, 0.0, 0);
        }
        let mut free = router(PolicyKind::P2cCache);
        let (seen, how) = big_to(&mut free, &v, 200);
        assert_eq!((seen.len(), how), (4, KvSteer::Unsteered));
    }

    #[test]
    fn tenants_use_their_pools_in_order_and_their_quotas() {
        let mut v = View::new("eu", 64);
        let mut dedicated = info("ded-0", "eu");
        dedicated.pool = "acme".into();
        let d = v.upsert(dedicated);
        let s = v.upsert(info("shared-0", "eu"));
        let acme = TenantConfig {
            isolated: true,
            pools: vec!["acme".into(), "shared".into()],
            max_in_flight_per_replica: Some(1),
            max_cluster_share: None,
            max_kv_share: None,
            ..TenantConfig::default()
        };
        let mut r = Router::new(
            RouterConfig::default(),
            Tenants::new(
                HashMap::from([("acme".to_owned(), acme)]),
                TenantConfig::default(),
            ),
        );
        let keys = prompt_keys("z");
        let acme_req = RouteRequest {
            tenant: Some("acme"),
            ..req(&keys)
        };
        assert_eq!(
            routed(r.route(&v, &acme_req, NOW)).replica,
            d,
            "dedicated pool first"
        );
        r.tenants.started("acme", d);
        assert_eq!(
            routed(r.route(&v, &acme_req, NOW)).replica,
            s,
            "then the shared pool"
        );
        r.tenants.started("acme", s);
        assert_eq!(
            r.route(&v, &acme_req, NOW),
            Decision::Reject(RejectReason::OverQuota)
        );
        // Another tenant is unaffected and never sees the dedicated pool... unless it has no pools.
        let other = RouteRequest {
            tenant: Some("other"),
            ..req(&keys)
        };
        assert!(matches!(r.route(&v, &other, NOW), Decision::Route(_)));
    }

    #[test]
    fn a_session_prefers_one_replica_on_every_node() {
        let mut v = View::new("eu", 64);
        for i in 0..5 {
            v.upsert(info(&format!("r{i}"), "eu"));
        }
        let keys: Vec<BlockKey> = Vec::new(); // short prompt: no cache signal at all
        let session = RouteRequest {
            session: Some("chat-42"),
            affinity_key: None,
            ..req(&keys)
        };
        let mut picks = Vec::new();
        for seed in 0..3 {
            let mut r = Router::new(
                RouterConfig {
                    seed,
                    ..Default::default()
                },
                Tenants::default(),
            );
            let mut counts = [0; 5];
            for _ in 0..200 {
                counts[routed(r.route(&v, &session, NOW)).replica] += 1;
            }
            picks.push(
                counts
                    .iter()
                    .enumerate()
                    .max_by_key(|(_, c)| **c)
                    .map(|(i, _)| i)
                    .unwrap(),
            );
        }
        assert!(picks.windows(2).all(|w| w[0] == w[1]), "{picks:?}");
    }

    #[test]
    fn an_affinity_key_sends_cold_prompts_about_one_document_to_one_replica_on_every_node() {
        let mut v = View::new("eu", 64);
        for i in 0..5 {
            v.upsert(info(&format!("r{i}"), "eu"));
        }
        // Every replica holds the shared instruction prompt: caches do not tell them apart.
        let system = prompt_keys("answer from the documents below ");
        for i in 0..5 {
            let mut s = ReplicaSummary::new(1, 10_000, &SummaryConfig::for_cluster("c")).unwrap();
            s.insert(&system);
            v.set_summary(i, s);
        }
        let mut chosen = Vec::new();
        for (seed, question) in ["what is X", "who wrote Y", "when did Z"]
            .iter()
            .enumerate()
        {
            let mut r = Router::new(
                RouterConfig {
                    seed: seed as u64,
                    ..Default::default()
                },
                Tenants::default(),
            );
            let mut keys = system.clone();
            keys.extend(prompt_keys(&format!("doc-7 text, then {question}")));
            let about_doc_7 = RouteRequest {
                affinity_key: Some("doc-7"),
                ..req(&keys)
            };
            let d = routed(r.route(&v, &about_doc_7, NOW));
            assert!(d.affinity, "{d:?}");
            chosen.push(d.replica);
        }
        assert!(chosen.windows(2).all(|w| w[0] == w[1]), "{chosen:?}");
    }

    #[test]
    fn a_replica_holding_more_of_the_prompt_beats_the_affinity_key() {
        let mut v = View::new("eu", 64);
        for i in 0..5 {
            v.upsert(info(&format!("r{i}"), "eu"));
        }
        let keys = prompt_keys("doc-7 is cached on r3 ");
        let mut s = ReplicaSummary::new(1, 10_000, &SummaryConfig::for_cluster("c")).unwrap();
        s.insert(&keys);
        v.set_summary(3, s);
        let mut r = router(PolicyKind::P2cCache);
        for key in ["doc-7", "doc-8", "doc-9"] {
            let d = routed(r.route(
                &v,
                &RouteRequest {
                    affinity_key: Some(key),
                    ..req(&keys)
                },
                NOW,
            ));
            assert_eq!(d.replica, 3, "the key {key} pulled it off the cache");
            assert!(!d.affinity);
        }
    }

    #[test]
    fn remembered_static_facts_follow_upserts_models_and_views() {
        let mut v = View::new("eu", 64);
        let a = v.upsert(info("eu-0", "eu"));
        let keys = prompt_keys("facts");
        let mut r = router(PolicyKind::P2cCache);
        assert_eq!(routed(r.route(&v, &req(&keys), NOW)).replica, a);
        // The same facts, asked for another local region.
        v.local_region = "us".into();
        assert_eq!(
            r.route(&v, &req(&keys), NOW),
            Decision::Forward {
                region: "eu".into(),
                reason: ForwardReason::NoLocalReplica
            }
        );
        v.local_region = "eu".into();
        assert_eq!(routed(r.route(&v, &req(&keys), NOW)).replica, a);
        // New facts for the same index: the remembered answer for the old ones must not count.
        let mut moved = info("eu-0", "eu");
        moved.models = vec!["other".into()];
        v.upsert(moved);
        assert_eq!(
            r.route(&v, &req(&keys), NOW),
            Decision::Reject(RejectReason::UnknownModel)
        );
        let other = RouteRequest {
            model: "other",
            ..req(&keys)
        };
        assert_eq!(routed(r.route(&v, &other, NOW)).replica, a);
        // Another view, another local region, the same index: answered afresh.
        let mut us = View::new("us", 64);
        us.upsert(info("us-0", "us"));
        us.upsert(info("eu-1", "eu"));
        assert_eq!(routed(r.route(&us, &req(&keys), NOW)).replica, 0);
        let mut eu = View::new("eu", 64);
        eu.upsert(info("us-0", "us"));
        eu.upsert(info("eu-1", "eu"));
        assert_eq!(routed(r.route(&eu, &req(&keys), NOW)).replica, 1);
        assert_eq!(routed(r.route(&us, &req(&keys), NOW)).replica, 0);
    }

    #[test]
    fn equal_seeds_give_equal_decisions() {
        let mut v = View::new("eu", 64);
        for i in 0..8 {
            v.upsert(info(&format!("r{i}"), "eu"));
        }
        for kind in PolicyKind::ALL {
            let run = || {
                let mut r = router(kind);
                (0..50)
                    .map(|i| {
                        routed(r.route(&v, &req(&prompt_keys(&format!("p{i} "))), NOW)).replica
                    })
                    .collect::<Vec<_>>()
            };
            assert_eq!(run(), run(), "{kind}");
        }
    }

    proptest! {
        /// No policy ever returns a replica that is unhealthy, of another model, region or pool.
        #[test]
        fn never_routes_to_an_ineligible_replica(
            specs in proptest::collection::vec((any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>(), 0u32..50), 1..24),
            seed in any::<u64>(),
        ) {
            let mut v = View::new("eu", 64);
            for (i, (healthy, model, local, pool, load)) in specs.iter().enumerate() {
                let mut inf = info(&format!("r{i}"), if *local { "eu" } else { "us" });
                if !model { inf.models = vec!["other".into()]; }
                if !pool { inf.pool = "private".into(); }
                let idx = v.upsert(inf);
                v.set_health(idx, if *healthy { Health::Healthy } else { Health::Unhealthy });
                v.set_engine_load(idx, *load, *load, 0.5, *load as u64 * 1000);
            }
            let tenant = TenantConfig { pools: vec!["shared".into()], ..Default::default() };
            let keys = prompt_keys("q");
            for kind in PolicyKind::ALL {
                let mut r = Router::new(RouterConfig { policy: kind, seed, ..Default::default() },
                    Tenants::new(HashMap::new(), tenant.clone()));
                for _ in 0..4 {
                    if let Decision::Route(d) = r.route(&v, &RouteRequest { tenant: Some("t"), ..req(&keys) }, NOW) {
                        let rep = v.replica(d.replica).unwrap();
                        prop_assert_eq!(rep.health, Health::Healthy);
                        prop_assert!(rep.info.models.iter().any(|m| m == "m"));
                        prop_assert_eq!(&rep.info.region, "eu");
                        prop_assert_eq!(&rep.info.pool, "shared");
                    }
                }
            }
        }
    }

    /// A random replica for [`the_one_pass_survey_equals_scope_then_gather`]: static-fact
    /// bits (model, region, role, health), blocks held on GPU and then on CPU, its load, blocks
    /// in this node's overlay (none at 0: the quick candidate's case, `quick_price.rs`), and
    /// which of three prefill prices it has.
    fn survey_spec() -> impl Strategy<Value = (u8, usize, usize, u32, usize, usize)> {
        (
            any::<u8>(),
            0usize..12,
            prop_oneof![Just(0usize), 0usize..3],
            0u32..4,
            prop_oneof![Just(0usize), 0usize..3],
            0usize..3,
        )
    }

    proptest! {
        /// A tenant without pools is surveyed in one pass (`gather_unpooled`); the two passes
        /// a tenant with pools takes (`scope`, then `gather`) are its oracle: the same early
        /// decisions, candidates (in order, every field), totals and cap verdict, for every
        /// leg, exclusions and a per-replica cap. And each candidate's hit, read from the
        /// up-front slice search (`View::search_slices`), is the per-replica search's. Replicas
        /// of the quick candidate's case (`quick_price.rs`: no overlay, no lower tier, no peer
        /// tip) on several prices, interleaved, test its remembered price against the general one;
        /// without a tip the pass is the sliced one (`SlicedPass::gather`), whose other replicas'
        /// candidates are made afterwards in their places (`price_deferred`).
        #[test]
        fn the_one_pass_survey_equals_scope_then_gather(
            specs in proptest::collection::vec(survey_spec(), 1..140),
            excluded in proptest::collection::vec(0usize..140, 0..3),
            leg in prop_oneof![Just(Leg::Whole), Just(Leg::WholeOnBoth), Just(Leg::Prefill)],
            capped in any::<bool>(),
            tip in any::<bool>(),
        ) {
            let keys = prompt_keys("survey ");
            let cfg = SummaryConfig::for_cluster("c");
            let mut v = View::new("eu", 64);
            let mut tenants = Tenants::new(HashMap::new(), TenantConfig {
                max_in_flight_per_replica: capped.then_some(1),
                ..Default::default()
            });
            for (i, &(bits, gpu, cpu, load, overlay, price)) in specs.iter().enumerate() {
                let mut inf = info(&format!("r{i}"), if bits & 1 == 0 { "eu" } else { "us" });
                if bits & 2 != 0 {
                    inf.models = vec!["other".into()];
                }
                inf.prefill_tokens_per_s = [50_000.0, 20_000.0, 50_000.0][price];
                inf.prefill_attention_ms_per_pair = [7.5e-7, 7.5e-7, 0.0][price];
                inf.pd.role = [Role::Both, Role::Prefill, Role::Decode][usize::from(bits >> 2 & 3) % 3];
                let idx = v.upsert(inf);
                if bits & 16 != 0 {
                    v.set_health(idx, Health::Unhealthy);
                }
                if bits & 32 != 0 {
                    tenants.started("t", idx);
                }
                let mut s = ReplicaSummary::new(1, 2_000, &cfg).unwrap();
                s.insert(&keys[..gpu.min(keys.len())]);
                s.insert_tier(&keys[gpu.min(keys.len())..(gpu + cpu).min(keys.len())], Tier::Cpu);
                v.set_summary(idx, s);
                v.set_engine_load(idx, load, load + 1, 0.5, u64::from(load) * 3_000);
                if overlay > 0 {
                    v.record_routed(idx, &keys[..(gpu + overlay).min(keys.len())], NOW);
                }
            }
            if tip {
                // A peer's routing of this very prompt, still computing: every replica takes
                // the general path.
                let tip = crate::core::peer_tips::Tip {
                    replica: 0,
                    blocks: keys.len() as u32,
                    ready: NOW + Duration::from_secs(1),
                    until: NOW + Duration::from_secs(10),
                };
                v.peer_tips.insert(*keys.last().unwrap(), tip);
            }
            let rq = RouteRequest { tenant: Some("t"), exclude: &excluded, ..req(&keys) };
            let mut one = Router::new(RouterConfig::default(), tenants.clone());
            let mut two = Router::new(RouterConfig::default(), tenants);
            let surveyed = one.survey(&v, &rq, leg, NOW);
            let scoped = two.scope(&v, &rq, leg, NOW).map(|scope| {
                let (gathered, blocked) = two.gather(&v, &rq, NOW, &scope);
                (scope, gathered, blocked)
            });
            prop_assert_eq!(&surveyed, &scoped);
            if surveyed.is_ok() {
                prop_assert_eq!(&one.candidates, &two.candidates);
            }
            // A peer's tip adds to a replica's hit (`View::hit_tiers` does not read tips).
            for c in &one.candidates {
                let searched = v.hit_tiers(c.replica, &keys, NOW).any;
                if tip {
                    prop_assert!(c.hit_blocks as usize >= searched);
                } else {
                    prop_assert_eq!(c.hit_blocks as usize, searched);
                }
            }
        }
    }
}
