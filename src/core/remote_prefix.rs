//! A prompt whose longest cached prefix is in another region: recompute it here, pull its KV
//! from that region's holder to a local replica, or forward the request there (issue #37, the
//! seed's "copy the KV, or recompute, or go where it is?").
//!
//! Predicted seconds to first token of each way, for a local candidate and the other region's
//! holder:
//!
//! ```text
//! recompute = the candidate's own cost (queue + prefill of what it lacks; an in-region pull)
//! pull      = queue + setup(link) + step(holder) + lacking tokens × bytes_per_token / rate(link)
//!             + prefill of the rest
//! forward   = round trip + the holder's queue + its prefill of the rest
//! ```
//!
//! `link` is the pair's pinned link (`[[mesh.distance]]`'s `kv_gb_per_s`) or
//! `[kv_fetch.links] cross_region`; `step(holder)` is `kv_fetch::source_step_s`, one engine step
//! of the holder's current load. The holder is the other region's healthy replica holding the
//! longest *settled* run (its summary, or overlay blocks a first byte confirmed:
//! [`View::hit_settled`]) — a replica still computing the prefix has nothing to hand out —, and
//! only when that run beats every local candidate's by `kv_fetch.min_tokens`.
//!
//! With `remote_prefix = "weigh"` each local candidate that takes hints gets the pull where it
//! is cheaper than its own cost (its plan names the holder; the proxy writes it in the
//! replica's hint form, as for in-region pulls), and the request is forwarded when going there
//! beats every local candidate's cost, pull included. `"forward"` weighs only recompute against
//! forward; `"local"` (the default) neither. Ties stay local: moving nothing beats moving blocks,
//! which beats moving the request. With the regional gossip layout the node sees no other
//! region's replicas, only its offer (`region_offer.rs`): the forward is priced from the
//! offer's heads, and the pull from the holder the offer names for its deepest head the prompt
//! starts with (its run, its step; the plan carries the head's key, `KvFetchPlan::offer_key`,
//! and the proxy reads the holder's address from the offer).
//!
//! Sans-IO and allocation-free: one pass over the view's replicas (their static facts cached by
//! the router), a settled-hit search for those of other regions serving the model, a few flops
//! per candidate.

use std::time::Duration;

use super::cost::CostModel;
use super::keys::BlockKey;
use super::kv_fetch::{KvFetchPlan, LinkSpec, PullSource, OFFERED_SOURCE};
use super::policy::Candidate;
use super::role::Leg;
use super::view::{Health, ReplicaState, View};

/// What the router does with a prompt whose longest cached prefix is in another region
/// (top-level `remote_prefix`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RemotePrefixMode {
    /// Recompute it here (the behaviour before; other regions count only on spill). Default.
    #[default]
    Local,
    /// Recompute here or forward the request to the holder's region, whichever is sooner.
    Forward,
    /// Recompute, pull the KV to a local replica that takes hints, or forward: the soonest.
    Weigh,
}

impl RemotePrefixMode {
    /// The mode's name, as configured.
    pub fn as_str(self) -> &'static str {
        match self {
            RemotePrefixMode::Local => "local",
            RemotePrefixMode::Forward => "forward",
            RemotePrefixMode::Weigh => "weigh",
        }
    }
}

impl std::str::FromStr for RemotePrefixMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "local" => Ok(RemotePrefixMode::Local),
            "forward" => Ok(RemotePrefixMode::Forward),
            "weigh" => Ok(RemotePrefixMode::Weigh),
            other => Err(format!(
                "unknown remote_prefix '{other}' (local, forward, weigh)"
            )),
        }
    }
}

/// Where a prompt whose prefix a replica of another region holds is best served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefixRoute {
    /// Recompute the prefix on the local replica.
    Recompute,
    /// Pull the held run from the other region's replica, then compute the rest locally.
    Fetch,
    /// Send the request to the other region's replica.
    Forward,
}

/// Seconds to move `tokens` tokens of KV over `link` from a source whose current step lasts
/// `step_s`: setup, the step, the bytes.
pub fn pull_s(link: LinkSpec, step_s: f64, tokens: f64, bytes_per_token: u32) -> f64 {
    link.setup_ms / 1000.0
        + step_s
        + tokens * f64::from(bytes_per_token) / (link.gb_per_s.max(1e-6) * 1e9)
}

/// Seconds to first token of a forward: the round trip, the holder's queue, its prefill of
/// what it lacks.
pub fn forward_s(rtt_s: f64, queue_s: f64, prompt_tokens: f64, held_tokens: f64, rate: f64) -> f64 {
    rtt_s + queue_s + (prompt_tokens - held_tokens).max(0.0) / rate.max(1.0)
}

/// The figures one weighing needs: a local target and another region's holder (all seconds,
/// tokens, tokens/s). [`RemotePrefix::between`] reads them from a view; the simulator's table
/// (`kvmesh sim --kv-fetch-region-table`) sets them directly.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RemotePrefix {
    /// Prompt length.
    pub prompt_tokens: u64,
    /// Leading prompt tokens the local target holds.
    pub local_held: u64,
    /// The local target's predicted queue.
    pub local_queue_s: f64,
    /// The local target's prefill rate.
    pub local_rate: f64,
    /// Leading prompt tokens the remote holder holds now (settled: a pull of predicted blocks
    /// finds nothing).
    pub remote_held: u64,
    /// The remote holder's predicted queue (a forwarded request waits in it).
    pub remote_queue_s: f64,
    /// The remote holder's prefill rate.
    pub remote_rate: f64,
    /// The wait for the holder's current step before it hands blocks out
    /// (`kv_fetch::source_step_s`).
    pub source_step_s: f64,
    /// Round trip between the regions (a forward pays it once).
    pub rtt_s: f64,
    /// KV bytes per token of the model.
    pub bytes_per_token: u32,
    /// The link between them.
    pub link: LinkSpec,
}

impl RemotePrefix {
    /// Local target `target` and another region's `holder` for `keys`, as this view sees them
    /// at `now`: hits (the holder's settled), queues, rates, the round trip and the link
    /// ([`cross_link`]). `None` when either index is out of the view.
    pub fn between(
        view: &View,
        cost: &CostModel,
        (target, holder): (usize, usize),
        keys: &[BlockKey],
        prompt_tokens: u64,
        now: Duration,
    ) -> Option<RemotePrefix> {
        let (t, h) = (view.replica(target)?, view.replica(holder)?);
        let tpb = u64::from(view.tokens_per_block);
        let bytes_per_token = t
            .info
            .kv_load
            .map_or(super::kv_load::KvLoad::default().bytes_per_token, |l| {
                l.bytes_per_token
            });
        Some(RemotePrefix {
            prompt_tokens,
            local_held: view.hit(target, keys, now) as u64 * tpb,
            local_queue_s: cost.queue_s(t),
            local_rate: t.info.prefill_tokens_per_s,
            remote_held: view.hit_settled(holder, keys, now) as u64 * tpb,
            remote_queue_s: cost.queue_s(h),
            remote_rate: h.info.prefill_tokens_per_s,
            source_step_s: PullSource::of(h).step_s,
            rtt_s: view.regions.distance(&t.info.region, &h.info.region) / 1000.0,
            bytes_per_token,
            link: cross_link(view, cost, &t.info.region, &h.info.region),
        })
    }

    /// Predicted seconds to first token of each way, `[recompute, fetch, forward]` (module
    /// doc). A fetch needs the holder to hold more than the target.
    pub fn costs_s(&self) -> [f64; 3] {
        let tokens = self.prompt_tokens as f64;
        let local_rate = self.local_rate.max(1.0);
        let remote_held = self.remote_held.min(self.prompt_tokens.saturating_sub(1)) as f64;
        let local_held = (self.local_held as f64).min(tokens);
        let recompute = self.local_queue_s + (tokens - local_held) / local_rate;
        let fetch = if remote_held > local_held {
            self.local_queue_s
                + pull_s(
                    self.link,
                    self.source_step_s,
                    remote_held - local_held,
                    self.bytes_per_token,
                )
                + (tokens - remote_held) / local_rate
        } else {
            f64::INFINITY
        };
        let forward = forward_s(
            self.rtt_s,
            self.remote_queue_s,
            tokens,
            remote_held,
            self.remote_rate,
        );
        [recompute, fetch, forward]
    }

    /// The cheapest way and its predicted seconds; ties go to recomputing, then fetching.
    pub fn choose(&self) -> (PrefixRoute, f64) {
        let [recompute, fetch, forward] = self.costs_s();
        let mut best = (PrefixRoute::Recompute, recompute);
        if fetch < best.1 {
            best = (PrefixRoute::Fetch, fetch);
        }
        if forward < best.1 {
            best = (PrefixRoute::Forward, forward);
        }
        best
    }
}

/// The link a prefix's KV crosses from region `from` to region `to`: the pair's pinned one, else
/// `[kv_fetch.links] cross_region`.
pub fn cross_link(view: &View, cost: &CostModel, from: &str, to: &str) -> LinkSpec {
    view.regions
        .link(from, to)
        .map_or(cost.fetch.links.cross_region, |l| LinkSpec {
            gb_per_s: l.gb_per_s,
            setup_ms: l.setup_ms,
        })
}

/// Another region's replica holding the longest settled run of a prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteHolder {
    /// Its index in the view.
    pub replica: usize,
    /// Leading blocks it holds now.
    pub blocks: u32,
}

/// The healthy replica `eligible` admits (the router's: another region, serving the model, not
/// excluded) holding the longest settled run of `keys`, at least `min_blocks`; ties to the least
/// queued, then the lowest index (every node of a region picks alike).
pub fn remote_holder(
    view: &View,
    cost: &CostModel,
    (keys, now): (&[BlockKey], Duration),
    min_blocks: u32,
    mut eligible: impl FnMut(usize, &ReplicaState) -> bool,
) -> Option<RemoteHolder> {
    let min_blocks = min_blocks.max(1) as usize;
    if keys.len() < min_blocks {
        return None;
    }
    let mut best: Option<(usize, usize, f64)> = None;
    for (i, r) in view.replicas().iter().enumerate() {
        if r.health != Health::Healthy || !eligible(i, r) {
            continue;
        }
        // A cache is prefix-closed: a run of `need` blocks holds block `need − 1`. One filter
        // probe rules out most replicas (those without an overlay, where settled blocks could
        // also be) before the search.
        let need = best.map_or(min_blocks, |(_, b, _)| b.max(min_blocks));
        if !r.has_overlay()
            && !r
                .summary
                .as_deref()
                .is_some_and(|s| s.contains(keys[need - 1]))
        {
            continue;
        }
        let held = view.hit_settled(i, keys, now);
        if held < min_blocks || best.is_some_and(|(_, b, _)| held < b) {
            continue;
        }
        let queue = cost.queue_s(r);
        if best.is_some_and(|(_, b, q)| held == b && queue >= q) {
            continue;
        }
        best = Some((i, held, queue));
    }
    best.map(|(replica, blocks, _)| RemoteHolder {
        replica,
        blocks: u32::try_from(blocks).unwrap_or(u32::MAX),
    })
}

/// One decision's question about a prefix held in another region.
#[derive(Clone, Copy, Debug)]
pub struct RemoteAsk<'a> {
    /// What to weigh.
    pub mode: RemotePrefixMode,
    /// Requested model (for offers).
    pub model: &'a str,
    /// The tenant's pools (any when empty): a forward lands only in one of them.
    pub pools: &'a [String],
    /// Block keys of the prompt.
    pub keys: &'a [BlockKey],
    /// Prompt length in tokens.
    pub prompt_tokens: u64,
    /// The longest hit among the local candidates, in blocks.
    pub local_best_blocks: u32,
    /// The request may be forwarded (it has not hopped yet).
    pub may_forward: bool,
}

/// What the weighing decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteWay<'v> {
    /// Served here; `pulls`: some candidate's cost now includes a pull from the other region
    /// (its plan set).
    Stay {
        /// A pull across regions was planned for some candidate.
        pulls: bool,
    },
    /// Forward to this region: going where the prefix is beats every local way.
    Forward(&'v str),
}

/// Weighs recompute, pull and forward for a prompt whose longest run is in another region
/// (module doc): prices a pull from the holder into each candidate that takes hints where it
/// is cheaper (`plans[j]`, aligned with `candidates`), then answers whether to forward.
pub fn weigh<'v>(
    view: &'v View,
    cost: &CostModel,
    ask: &RemoteAsk<'_>,
    (candidates, plans): (&mut [Candidate], &mut [Option<KvFetchPlan>]),
    now: Duration,
    eligible: impl FnMut(usize, &ReplicaState) -> bool,
) -> RemoteWay<'v> {
    let stay = RemoteWay::Stay { pulls: false };
    if ask.mode == RemotePrefixMode::Local || candidates.is_empty() {
        return stay;
    }
    let tpb = u64::from(view.tokens_per_block.max(1));
    let min_more = u32::try_from(cost.fetch.min_tokens.div_ceil(tpb).max(1)).unwrap_or(u32::MAX);
    let min_blocks = ask.local_best_blocks.saturating_add(min_more);
    let holder = remote_holder(view, cost, (ask.keys, now), min_blocks, eligible);
    let pulls = ask.mode == RemotePrefixMode::Weigh && {
        // Flat gossip: the holder in the view; regional: the one an offer names.
        let from = match holder {
            Some(h) => PullFrom::replica(view, h),
            None => PullFrom::offered(view, ask, min_blocks, now),
        };
        from.is_some_and(|f| price_pulls(view, cost, f, (candidates, plans), ask.prompt_tokens))
    };
    let local_s = candidates
        .iter()
        .map(|c| c.cost_s)
        .fold(f64::INFINITY, f64::min);
    if ask.may_forward {
        if let Some((region, s)) = best_forward(view, cost, ask, holder, min_blocks, now) {
            if s < local_s {
                return RemoteWay::Forward(region);
            }
        }
    }
    RemoteWay::Stay { pulls }
}

/// The source of a pull across regions, as pricing needs it.
#[derive(Clone, Copy, Debug)]
struct PullFrom<'v> {
    /// Its view index, or [`OFFERED_SOURCE`] for a holder an offer names.
    replica: usize,
    /// The offered head's key when an offer names it.
    offer_key: Option<u64>,
    /// Leading blocks of the prompt it holds settled.
    blocks: u32,
    /// Seconds a pull waits for its current step.
    step_s: f64,
    /// Its region.
    region: &'v str,
}

impl<'v> PullFrom<'v> {
    /// The view's `holder` (flat gossip).
    fn replica(view: &'v View, holder: RemoteHolder) -> Option<Self> {
        let r = view.replica(holder.replica)?;
        Some(PullFrom {
            replica: holder.replica,
            offer_key: None,
            blocks: holder.blocks,
            step_s: PullSource::of(r).step_s,
            region: &r.info.region,
        })
    }

    /// The holder another region's offer names for the deepest prefix of the prompt, at least
    /// `min_blocks` long (regional gossip): of the answering regions serving the model, the
    /// longest run, then the shortest step, then the first region by name.
    fn offered(
        view: &'v View,
        ask: &RemoteAsk<'_>,
        min_blocks: u32,
        now: Duration,
    ) -> Option<Self> {
        let mut best: Option<PullFrom<'v>> = None;
        for (region, offer) in &view.remote_regions {
            if *region == view.local_region
                || offer.holders.is_empty()
                || view.is_unreachable(region, now)
                || !offer.models.iter().any(|m| m.model == ask.model)
            {
                continue;
            }
            let Some((h, blocks)) = offer.pull_source(ask.keys) else {
                continue;
            };
            let step_s = f64::from(h.step_ms) / 1000.0;
            let better = best.is_none_or(|b| (blocks, -step_s) > (b.blocks, -b.step_s));
            if blocks >= min_blocks && better {
                best = Some(PullFrom {
                    replica: OFFERED_SOURCE,
                    offer_key: Some(h.head.key),
                    blocks,
                    step_s,
                    region,
                });
            }
        }
        best
    }
}

/// Prices a pull of `from`'s run into every candidate that takes hints and holds at least
/// `kv_fetch.min_tokens` less; takes it where it beats the candidate's cost. Says whether any
/// candidate took one.
fn price_pulls(
    view: &View,
    cost: &CostModel,
    from: PullFrom<'_>,
    (candidates, plans): (&mut [Candidate], &mut [Option<KvFetchPlan>]),
    prompt_tokens: u64,
) -> bool {
    let tpb = u64::from(view.tokens_per_block);
    // Never more than the prompt less its last token (an engine recomputes that one).
    let source_tokens = (u64::from(from.blocks) * tpb).min(prompt_tokens.saturating_sub(1));
    // The candidates are this region's and the holder another's: the link is the regions'
    // (what `KvFetchConfig::transfer_from` would find, without parsing each candidate's URL).
    let step_s = from.step_s;
    let link = cross_link(view, cost, &view.local_region, from.region);
    let min_tokens = cost.fetch.min_tokens;
    let mut any = false;
    for (c, plan) in candidates.iter_mut().zip(plans.iter_mut()) {
        let own_tokens = u64::from(c.hit_blocks) * tpb;
        if source_tokens < own_tokens.saturating_add(min_tokens) {
            continue;
        }
        let Some(target) = view.replica(c.replica) else {
            continue;
        };
        // A replica that takes no hint never gets one.
        let Some(load) = target.info.kv_load.filter(|l| !l.hints.is_none()) else {
            continue;
        };
        let moved = (source_tokens - own_tokens) as f64;
        let transfer_s = pull_s(link, step_s, moved, load.bytes_per_token);
        let rate = target.info.prefill_tokens_per_s.max(1.0);
        let prefill_s = prompt_tokens.saturating_sub(source_tokens) as f64 / rate;
        let pulled_s = c.queue_s + transfer_s + prefill_s;
        if pulled_s >= c.cost_s {
            continue;
        }
        c.cost_s = pulled_s;
        c.prefill_s = prefill_s;
        *plan = Some(KvFetchPlan {
            source: from.replica,
            offer_key: from.offer_key,
            from_tokens: own_tokens,
            tokens: source_tokens,
            predicted_s: transfer_s,
            format: load.hints,
        });
        any = true;
    }
    any
}

/// The soonest forward to a region holding at least `min_blocks` of the prompt: the holder in
/// the view (when it takes whole requests, has room, is in the tenant's pools and its region
/// answers), or an offer whose heads hold that much. `(region, predicted seconds)`.
fn best_forward<'v>(
    view: &'v View,
    cost: &CostModel,
    ask: &RemoteAsk<'_>,
    holder: Option<RemoteHolder>,
    min_blocks: u32,
    now: Duration,
) -> Option<(&'v str, f64)> {
    let local = view.local_region.as_str();
    let tpb = f64::from(view.tokens_per_block);
    let tokens = ask.prompt_tokens as f64;
    let mut best: Option<(&'v str, f64)> = None;
    let mut consider = |region: &'v str, s: f64| {
        if best.is_none_or(|(_, b)| s < b) {
            best = Some((region, s));
        }
    };
    if let Some(h) = holder.and_then(|h| Some((h, view.replica(h.replica)?))) {
        let (holder, r) = h;
        let region = r.info.region.as_str();
        let open = r.info.pd.role.serves(Leg::Whole)
            && r.load.outstanding() < r.info.max_in_flight
            && (ask.pools.is_empty() || ask.pools.contains(&r.info.pool))
            && !view.is_unreachable(region, now);
        if open {
            let held = (f64::from(holder.blocks) * tpb).min(tokens - 1.0);
            let rtt_s = view.regions.distance(local, region) / 1000.0;
            let s = forward_s(
                rtt_s,
                cost.queue_s(r),
                tokens,
                held,
                r.info.prefill_tokens_per_s,
            );
            consider(region, s);
        }
    }
    for (region, offer) in &view.remote_regions {
        if region == local || view.is_unreachable(region, now) {
            continue;
        }
        let held = offer.held_blocks(ask.keys);
        if held < min_blocks as usize {
            continue;
        }
        let Some((queue, rate)) = offer.open_for(ask.model, ask.pools, f64::INFINITY) else {
            continue;
        };
        let held = (held as f64 * tpb).min(tokens - 1.0);
        let rtt_s = view.regions.distance(local, region) / 1000.0;
        consider(region.as_str(), forward_s(rtt_s, queue, tokens, held, rate));
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::kv_fetch::LinkTable;
    use crate::core::summary::{ReplicaSummary, SummaryConfig};
    use crate::core::view::{testing::info, ReplicaLoad};

    const T: Duration = Duration::from_secs(0);

    /// An 8B prompt of 32,768 tokens; the local target `eu` is idle and holds nothing; a
    /// replica in `us` (90 ms away) holds the whole prefix (its summary) and queues
    /// `us_queued` prefill tokens; the cross-region link is `link`.
    fn remote(us_queued: u64, link: LinkSpec) -> (PrefixRoute, f64) {
        let keys: Vec<BlockKey> = (1..=512).map(BlockKey).collect();
        let mut v = View::new("eu", 64);
        v.regions.measured("eu", "us", 90.0);
        let t = v.upsert(info("local", "eu"));
        let h = v.upsert(info("holder", "us"));
        let mut s = ReplicaSummary::new(1, 10_000, &SummaryConfig::for_cluster("c")).unwrap();
        s.insert(&keys);
        v.set_summary(h, s);
        v.replica_mut(h).unwrap().load = ReplicaLoad {
            queued_prefill_tokens: us_queued,
            in_flight: u32::from(us_queued > 0),
            ..ReplicaLoad::default()
        };
        let mut cost = CostModel::default();
        cost.fetch.links.cross_region = link;
        let w = RemotePrefix::between(&v, &cost, (t, h), &keys, 32_768, T).unwrap();
        w.choose()
    }

    #[test]
    fn a_busy_holder_across_a_fast_link_is_fetched_from_across_a_slow_one_recomputed() {
        // The holder queues 5 s: forwarding waits behind it.
        let busy = 250_000;
        // A 400 Gb/s interconnect: 4.3 GB in 86 ms + 60 ms + one step, against 0.66 s.
        let fast = LinkSpec {
            gb_per_s: 50.0,
            setup_ms: 60.0,
        };
        let (way, s) = remote(busy, fast);
        assert_eq!(way, PrefixRoute::Fetch, "{s}");
        assert!(s < 0.5, "{s}");
        // One 5 Gb/s flow over the WAN (the default): 6.9 s of transfer, recompute instead.
        let (way, _) = remote(busy, LinkTable::default().cross_region);
        assert_eq!(way, PrefixRoute::Recompute);
        // An idle holder: go where it is (90 ms + one block's prefill).
        let (way, s) = remote(0, LinkTable::default().cross_region);
        assert_eq!(way, PrefixRoute::Forward, "{s}");
        assert!(s < 0.1, "{s}");
    }

    use crate::core::kv_load::{KvHintFormat, KvLoad};
    use crate::core::region_offer::{OfferedHolder, OfferedModel, RegionHead, RegionOffer};
    use crate::core::router::{Decision, ForwardReason, RouteRequest, Router, RouterConfig};
    use crate::core::tenants::Tenants;
    use crate::core::view::ReplicaInfo;

    const NOW: Duration = Duration::from_secs(100);
    /// A 400 Gb/s interconnect.
    const FAST: LinkSpec = LinkSpec {
        gb_per_s: 50.0,
        setup_ms: 60.0,
    };

    /// A 32,768-token prompt (2,048 blocks of 16); region `eu` has replica `near` (index 0,
    /// taking vLLM hints when `hints`) queueing `near_queued` prefill tokens; region `us`, 90 ms
    /// away, has `far` (index 1) holding the whole prompt by its summary, queueing `far_queued`.
    fn two_regions(hints: bool, near_queued: u64, far_queued: u64) -> (View, Vec<BlockKey>) {
        let keys: Vec<BlockKey> = (1..=2048).map(BlockKey).collect();
        let mut v = View::new("eu", 16);
        v.regions.measured("eu", "us", 90.0);
        let near = v.upsert(ReplicaInfo {
            kv_load: hints.then(|| KvLoad {
                hints: KvHintFormat::VllmEnvelope,
                ..KvLoad::default()
            }),
            ..info("near", "eu")
        });
        let far = v.upsert(info("far", "us"));
        let mut s = ReplicaSummary::new(1, 10_000, &SummaryConfig::for_cluster("c")).unwrap();
        s.insert(&keys);
        v.set_summary(far, s);
        for (i, queued) in [(near, near_queued), (far, far_queued)] {
            v.replica_mut(i).unwrap().load = ReplicaLoad {
                queued_prefill_tokens: queued,
                in_flight: u32::from(queued > 0),
                ..ReplicaLoad::default()
            };
        }
        (v, keys)
    }

    fn route(v: &View, keys: &[BlockKey], mode: RemotePrefixMode, link: LinkSpec) -> Decision {
        route_req(v, &RouteRequest::plain("m", keys, 32_768), mode, link)
    }

    fn route_req(
        v: &View,
        req: &RouteRequest<'_>,
        mode: RemotePrefixMode,
        link: LinkSpec,
    ) -> Decision {
        let mut cost = CostModel::default();
        cost.fetch.links.cross_region = link;
        let cfg = RouterConfig {
            remote_prefix: mode,
            cost,
            ..RouterConfig::default()
        };
        Router::new(cfg, Tenants::default()).route(v, req, NOW)
    }

    /// The issue's rule, wired: with the holder in `us` 5 s deep in queue, the idle `near`
    /// pulls its KV over a fast link (the plan names `far`), recomputes over one WAN flow; a
    /// replica that takes no hint never gets one.
    #[test]
    fn the_router_pulls_from_a_busy_remote_holder_over_a_fast_link_and_recomputes_over_a_slow_one()
    {
        let (v, keys) = two_regions(true, 0, 250_000);
        let Decision::Route(r) = route(&v, &keys, RemotePrefixMode::Weigh, FAST) else {
            panic!("served here")
        };
        let plan = r.fetch.expect("a pull from the other region");
        assert_eq!((r.replica, plan.source), (0, 1));
        assert_eq!((plan.from_tokens, plan.tokens), (0, 32_767));
        assert_eq!(plan.format, KvHintFormat::VllmEnvelope);
        // 4.3 GB at 50 GB/s + 60 ms + one step, against 0.66 s of prefill.
        assert!(r.predicted_s < 0.4, "{}", r.predicted_s);
        let Decision::Route(r) = route(
            &v,
            &keys,
            RemotePrefixMode::Weigh,
            LinkTable::default().cross_region,
        ) else {
            panic!("served here")
        };
        assert_eq!(r.fetch, None, "over one 5 Gb/s flow it recomputes");
        // Without hints, or when only forwarding is weighed: no pull.
        let (plain, keys) = two_regions(false, 0, 250_000);
        let Decision::Route(r) = route(&plain, &keys, RemotePrefixMode::Weigh, FAST) else {
            panic!("served here")
        };
        assert_eq!(r.fetch, None);
        for mode in [RemotePrefixMode::Local, RemotePrefixMode::Forward] {
            let Decision::Route(r) = route(&v, &keys, mode, FAST) else {
                panic!("served here")
            };
            assert_eq!(r.fetch, None, "{mode:?}");
        }
        // The pair's pinned link beats the default one.
        let (mut pinned, _) = two_regions(true, 0, 250_000);
        pinned.regions.configure_link(
            "us",
            "eu",
            crate::core::regions::RegionLink {
                gb_per_s: 50.0,
                setup_ms: 60.0,
            },
        );
        let Decision::Route(r) = route(
            &pinned,
            &keys,
            RemotePrefixMode::Weigh,
            LinkTable::default().cross_region,
        ) else {
            panic!("served here")
        };
        assert_eq!(r.fetch.map(|p| p.source), Some(1));
    }

    /// An idle holder across 90 ms, the local replica 5 s deep: go where the prefix is — unless
    /// only recomputing is configured, or the request already hopped.
    #[test]
    fn the_router_forwards_to_an_idle_remote_holder_when_the_local_region_is_busy() {
        let (v, keys) = two_regions(true, 250_000, 0);
        for mode in [RemotePrefixMode::Forward, RemotePrefixMode::Weigh] {
            assert_eq!(
                route(&v, &keys, mode, FAST),
                Decision::Forward {
                    region: "us".into(),
                    reason: ForwardReason::Prefix
                },
                "{mode:?}"
            );
        }
        assert!(matches!(
            route(&v, &keys, RemotePrefixMode::Local, FAST),
            Decision::Route(_)
        ));
        let hopped = RouteRequest {
            forwarded: true,
            ..RouteRequest::plain("m", &keys, 32_768)
        };
        let Decision::Route(r) = route_req(&v, &hopped, RemotePrefixMode::Weigh, FAST) else {
            panic!("a forwarded request is never forwarded again")
        };
        // It may still pull: 5 s of queue either way, the pull saves the prefill.
        assert_eq!(r.fetch.map(|p| p.source), Some(1));
        // A busy region whose holder is full takes no forward.
        let (mut full, _) = two_regions(true, 250_000, 0);
        full.replica_mut(1).unwrap().load.in_flight = 256;
        assert!(matches!(
            route(&full, &keys, RemotePrefixMode::Forward, FAST),
            Decision::Route(_)
        ));
    }

    /// A remote replica only predicted to hold the prompt (a request routed there is still
    /// computing it) is neither pulled from nor forwarded to; once a first byte confirms it, it is.
    #[test]
    fn a_remote_holder_still_computing_the_prefix_is_no_source() {
        let (mut v, keys) = two_regions(true, 0, 250_000);
        v.set_summary(
            1,
            ReplicaSummary::new(1, 10_000, &SummaryConfig::for_cluster("c")).unwrap(),
        );
        v.record_routed_ready(
            1,
            &keys,
            NOW - Duration::from_secs(2),
            Duration::from_secs(1),
        );
        let Decision::Route(r) = route(&v, &keys, RemotePrefixMode::Weigh, FAST) else {
            panic!("served here")
        };
        assert_eq!(r.fetch, None);
        v.prefill_done(1, &keys, NOW - Duration::from_millis(500));
        let Decision::Route(r) = route(&v, &keys, RemotePrefixMode::Weigh, FAST) else {
            panic!("served here")
        };
        assert_eq!(r.fetch.map(|p| p.source), Some(1));
    }

    /// Region `us`'s offer for model `m`: one healthy, open replica `least_queue_ms` deep,
    /// prefilling 50k tokens/s, with `heads` and no holders.
    fn us_offer(least_queue_ms: u32, heads: Vec<RegionHead>) -> RegionOffer {
        RegionOffer {
            region: "us".into(),
            models: vec![OfferedModel {
                model: "m".into(),
                pool: String::new(),
                whole: true,
                healthy: 1,
                open: 1,
                least_queue_ms,
                prefill_tokens_per_s: 50_000,
            }],
            heads,
            holders: vec![],
        }
    }

    /// With regional gossip the other region is an offer: a forward is priced from its heads.
    #[test]
    fn an_offer_holding_the_prefix_draws_a_forward_from_a_busy_region() {
        let (mut v, keys) = two_regions(true, 250_000, 0);
        v.set_health(1, Health::Unhealthy);
        let mut offer = us_offer(0, vec![]);
        v.remote_regions.insert("us".into(), offer.clone());
        assert!(matches!(
            route(&v, &keys, RemotePrefixMode::Forward, FAST),
            Decision::Route(_)
        ));
        offer.heads = RegionHead::of(&keys).into_iter().collect();
        v.remote_regions.insert("us".into(), offer);
        assert!(matches!(
            route(&v, &keys, RemotePrefixMode::Forward, FAST),
            Decision::Forward {
                reason: ForwardReason::Prefix,
                ..
            }
        ));
    }

    /// Regional gossip: `eu` sees no replica of `us`, only its offer, whose region 5 s deep
    /// holds the prompt and names `far` as the head's holder. Over a fast link the idle `near`
    /// pulls from the named holder (the plan carries the head's key, no view index); an offer
    /// without a holder, a replica without hints or `forward` mode pull nothing.
    #[test]
    fn under_regional_gossip_the_router_pulls_from_the_holder_an_offer_names() {
        let (mut v, keys) = two_regions(true, 0, 0);
        v.set_health(1, Health::Unhealthy); // out of sight, as with regional gossip
        let head = RegionHead::of(&keys).unwrap();
        let mut offer = us_offer(5_000, vec![head]);
        v.remote_regions.insert("us".into(), offer.clone());
        let Decision::Route(r) = route(&v, &keys, RemotePrefixMode::Weigh, FAST) else {
            panic!("served here")
        };
        assert_eq!(r.fetch, None, "no holder named: nothing to pull from");
        offer.holders = vec![OfferedHolder {
            head,
            id: "far".into(),
            url: "http://10.2.0.1:8000".into(),
            step_ms: 8,
        }];
        v.remote_regions.insert("us".into(), offer);
        let Decision::Route(r) = route(&v, &keys, RemotePrefixMode::Weigh, FAST) else {
            panic!("served here")
        };
        let plan = r.fetch.expect("a pull from the offered holder");
        assert_eq!(r.replica, 0);
        assert_eq!(
            (plan.source, plan.offer_key),
            (OFFERED_SOURCE, Some(head.key))
        );
        assert_eq!((plan.from_tokens, plan.tokens), (0, 32_767));
        assert!(r.predicted_s < 0.4, "{}", r.predicted_s);
        let Decision::Route(r) = route(&v, &keys, RemotePrefixMode::Forward, FAST) else {
            panic!("served here")
        };
        assert_eq!(r.fetch, None, "forward mode weighs no pull");
        let (mut plain, _) = two_regions(false, 0, 0);
        plain.set_health(1, Health::Unhealthy);
        plain.remote_regions = v.remote_regions.clone();
        let Decision::Route(r) = route(&plain, &keys, RemotePrefixMode::Weigh, FAST) else {
            panic!("served here")
        };
        assert_eq!(r.fetch, None, "a replica without hints gets none");
    }

    #[test]
    fn modes_parse_by_name() {
        for m in [
            RemotePrefixMode::Local,
            RemotePrefixMode::Forward,
            RemotePrefixMode::Weigh,
        ] {
            assert_eq!(m.as_str().parse::<RemotePrefixMode>(), Ok(m));
        }
        assert!("pull".parse::<RemotePrefixMode>().is_err());
    }
}
