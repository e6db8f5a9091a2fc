//! The interface every policy implements: eligible [`Candidate`]s in, a [`Pick`] out, and the
//! random draws several policies share.

use rand::rngs::SmallRng;
use rand::Rng;

use super::kind::PolicyKind;
use crate::core::keys::BlockKey;

/// One eligible replica, as a policy sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// Index of the replica in the [`crate::core::view::View`].
    pub replica: usize,
    /// Stable hash of the replica id (hash rings, rendezvous).
    pub seed: u64,
    /// Leading prompt blocks the replica is believed to hold, in any tier (0 when the policy
    /// ignores caches).
    pub hit_blocks: u32,
    /// `hit_blocks` credited by the tier each block is held in
    /// ([`crate::core::cost::CostModel::credited_blocks`]); equal to `hit_blocks` when every
    /// block is on GPU (default weights).
    pub credited_blocks: f64,
    /// Outstanding requests (see [`crate::core::view::ReplicaLoad::outstanding`]).
    pub outstanding: u32,
    /// Requests this node has in flight there.
    pub in_flight: u32,
    /// Predicted seconds before this request's prefill could start (queued work).
    pub queue_s: f64,
    /// The prefill part of `queue_s`: seconds of uncached prompt work already queued there.
    pub prefill_queue_s: f64,
    /// Predicted seconds to first token: queue plus uncached prefill, minus any affinity credit.
    pub cost_s: f64,
    /// Predicted seconds of prefill this request would add there (its uncached tokens at the
    /// replica's prefill rate, plus their attention over the context: `CostModel::prefill_s`),
    /// without queue or credit: the fleet capacity it spends.
    pub prefill_s: f64,
    /// How full its prefix cache is believed to be, 0..=1 (`CostModel::cache_fill`): the share
    /// of what a prefill writes there that evicts other blocks.
    pub cache_fill: f64,
}

/// What a policy decides on.
#[derive(Clone, Copy, Debug)]
pub struct PolicyInput<'a> {
    /// The eligible replicas; never empty.
    pub candidates: &'a [Candidate],
    /// The request's block keys.
    pub keys: &'a [BlockKey],
}

/// Why a policy picked what it picked (a metrics label and a log field).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Only one candidate.
    OnlyCandidate,
    /// p2c-cache: the longest-hit replica was cheaper than the second choice.
    LongestHit,
    /// p2c-cache: the second choice was cheaper than the longest-hit replica.
    SecondChoice,
    /// No replica holds any block: two choices on load.
    NoHit,
    /// round-robin.
    RoundRobin,
    /// random.
    Random,
    /// least-load.
    LeastLoad,
    /// chwbl: first replica on the ring under the load bound.
    HashRing,
    /// sglang-threshold: loads imbalanced, shortest queue.
    Imbalanced,
    /// sglang-threshold: match rate above the cache threshold.
    CacheMatch,
    /// sglang-threshold: match rate below the threshold, least loaded.
    LowMatch,
    /// cache-argmin: the lowest predicted cost.
    LowestCost,
    /// lmetric: the lowest uncached prefill × batch size.
    LowestProduct,
}

impl Reason {
    /// Stable label for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::OnlyCandidate => "only_candidate",
            Reason::LongestHit => "longest_hit",
            Reason::SecondChoice => "second_choice",
            Reason::NoHit => "no_hit",
            Reason::RoundRobin => "round_robin",
            Reason::Random => "random",
            Reason::LeastLoad => "least_load",
            Reason::HashRing => "hash_ring",
            Reason::Imbalanced => "imbalanced",
            Reason::CacheMatch => "cache_match",
            Reason::LowMatch => "low_match",
            Reason::LowestCost => "lowest_cost",
            Reason::LowestProduct => "lowest_product",
        }
    }
}

/// A policy's answer: positions in [`PolicyInput::candidates`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pick {
    /// The chosen candidate.
    pub chosen: usize,
    /// The candidate it was weighed against, when there was one.
    pub runner_up: Option<usize>,
    /// Why.
    pub reason: Reason,
}

/// A routing policy.
pub trait Policy: Send {
    /// The policy's name as configured.
    fn kind(&self) -> PolicyKind;
    /// Whether candidates need their cache hits computed (the router skips that work otherwise).
    fn uses_cache(&self) -> bool;
    /// Picks one of `input.candidates` (non-empty).
    fn pick(&mut self, input: &PolicyInput<'_>, rng: &mut SmallRng) -> Pick;
}

/// A candidate drawn at random with weight `1 / (0.01 + cost_s)²`, skipping position `exclude`.
/// Cheap replicas (idle, or holding part of the prompt) are likely, but never certain, so routers
/// sharing one stale view do not all draw the same one. `None` only when nothing is left to draw.
pub(crate) fn draw_toward_low_cost(
    c: &[Candidate],
    exclude: Option<usize>,
    rng: &mut SmallRng,
) -> Option<usize> {
    let total: f64 = c
        .iter()
        .enumerate()
        .map(|(i, x)| draw_weight(i, x, exclude))
        .sum();
    draw_from_total(c, exclude, total, rng)
}

/// Candidate `x`'s (at position `i`) weight in [`draw_toward_low_cost`]: 0 at `exclude`.
#[inline]
pub(crate) fn draw_weight(i: usize, x: &Candidate, exclude: Option<usize>) -> f64 {
    if Some(i) == exclude {
        0.0
    } else {
        low_cost_weight(x)
    }
}

/// Candidate `x`'s weight in [`draw_toward_low_cost`] where it is not excluded:
/// `1 / (0.01 + cost_s)²`, its cost counted from 0.
#[inline(always)]
pub(crate) fn low_cost_weight(x: &Candidate) -> f64 {
    let c = 0.01 + x.cost_s.max(0.0);
    1.0 / (c * c)
}

/// [`draw_toward_low_cost`]'s draw, given the sum of the weights (in position order, as
/// `Iterator::sum` adds them), which a caller passing over the candidates anyway may have
/// worked out on the way: the same draw, from the same random number.
///
/// The excluded position is left out of the walk rather than tested at every position (it
/// weighs 0, which the walk skips): two runs, before and after it, so a candidate costs its
/// weight, a compare and a subtraction (at 512 candidates the test was ~1k instructions a
/// decision; `scripts/decision-instructions.sh`).
pub(crate) fn draw_from_total(
    c: &[Candidate],
    exclude: Option<usize>,
    total: f64,
    rng: &mut SmallRng,
) -> Option<usize> {
    draw_walk(c, low_cost_weight, exclude, total, rng)
}

/// [`draw_from_total`] over the candidates' weights worked out already (`weights[i]` is
/// [`low_cost_weight`] of candidate `i`): the same walk, the same draw from the same random
/// number, without working each weight out again.
pub(crate) fn draw_from_weights(
    weights: &[f64],
    exclude: Option<usize>,
    total: f64,
    rng: &mut SmallRng,
) -> Option<usize> {
    draw_walk(weights, |&w| w, exclude, total, rng)
}

/// The draw of [`draw_from_total`] and [`draw_from_weights`]: a random share of `total`, walked
/// down the weights (`weight` of each of `items`, never negative: [`low_cost_weight`]'s) but
/// `exclude`'s, to the first that the share left is under; the last with a weight when
/// rounding leaves the share past the end.
#[inline(always)]
fn draw_walk<W>(
    items: &[W],
    weight: impl Fn(&W) -> f64,
    exclude: Option<usize>,
    total: f64,
    rng: &mut SmallRng,
) -> Option<usize> {
    if total <= 0.0 {
        return None;
    }
    let mut target = rng.random::<f64>() * total;
    // `exclude` past the end excludes nothing.
    let cut = exclude.map_or(items.len(), |e| e.min(items.len()));
    let (before, after) = items.split_at(cut);
    // `after` starts at the excluded position (empty when nothing is excluded).
    let rest = after.get(1..).unwrap_or_default();
    if let Some(k) = walk_down(&mut target, before, &weight) {
        return Some(k);
    }
    if let Some(k) = walk_down(&mut target, rest, &weight) {
        return Some(cut + 1 + k);
    }
    let last_weighted = |run: &[W]| run.iter().rposition(|x| weight(x) > 0.0);
    last_weighted(rest)
        .map(|k| cut + 1 + k)
        .or_else(|| last_weighted(before))
}

/// [`draw_walk`] down `run`: the position in it that what is left of the `target` falls in,
/// if it falls in this run. A weight of 0 is walked like any other, with no test of its own
/// (a test at every candidate, ~2 instructions each of ~250 walked at 512 candidates, and the
/// last weighted one kept on the way: `scripts/decision-instructions.sh`): the target is
/// never below 0 (a share of a positive total, less only weights it is not under), so a
/// weight of 0 never takes it and leaves it as it is, as skipping that candidate did. The
/// last candidate with a weight, the answer when rounding leaves the target past the end,
/// is found then, backwards (`draw_walk`).
#[inline(always)]
fn walk_down<W>(target: &mut f64, run: &[W], weight: impl Fn(&W) -> f64) -> Option<usize> {
    for (k, x) in run.iter().enumerate() {
        let w = weight(x);
        if *target < w {
            return Some(k);
        }
        *target -= w;
    }
    None
}

/// Position of the minimum of `key` over the candidates, ties broken at random (reservoir style,
/// so no allocation).
pub(crate) fn argmin_random_tie<K: PartialOrd + Copy>(
    c: &[Candidate],
    rng: &mut SmallRng,
    key: impl Fn(&Candidate) -> K,
) -> usize {
    let mut best = 0;
    let mut best_key = key(&c[0]);
    let mut ties = 1u32;
    for (i, x) in c.iter().enumerate().skip(1) {
        let k = key(x);
        if k < best_key {
            best = i;
            best_key = k;
            ties = 1;
        } else if k == best_key {
            ties += 1;
            if rng.random_range(0..ties) == 0 {
                best = i;
            }
        }
    }
    best
}

/// Two distinct positions drawn uniformly (the second is `None` with one candidate).
pub(crate) fn two_distinct(n: usize, rng: &mut SmallRng) -> (usize, Option<usize>) {
    let a = rng.random_range(0..n);
    if n < 2 {
        return (a, None);
    }
    let b = (a + 1 + rng.random_range(0..n - 1)) % n;
    (a, Some(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngCore, SeedableRng};

    /// [`draw_from_total`] as it was, testing every position against `exclude`: the oracle of
    /// the walk in two runs.
    fn draw_testing_each_position(
        c: &[Candidate],
        exclude: Option<usize>,
        total: f64,
        rng: &mut SmallRng,
    ) -> Option<usize> {
        if total <= 0.0 {
            return None;
        }
        let mut target = rng.random::<f64>() * total;
        let mut last = None;
        for (i, x) in c.iter().enumerate() {
            let w = draw_weight(i, x, exclude);
            if w <= 0.0 {
                continue;
            }
            last = Some(i);
            if target < w {
                return Some(i);
            }
            target -= w;
        }
        last
    }

    fn costed(costs: &[f64]) -> Vec<Candidate> {
        costs
            .iter()
            .enumerate()
            .map(|(i, &cost_s)| Candidate {
                replica: i,
                seed: i as u64,
                hit_blocks: 0,
                credited_blocks: 0.0,
                outstanding: 0,
                in_flight: 0,
                queue_s: cost_s,
                prefill_queue_s: 0.0,
                cost_s,
                prefill_s: 0.0,
                cache_fill: 0.0,
            })
            .collect()
    }

    proptest::proptest! {
        /// The walk in two runs draws what the walk testing each position drew, from the same
        /// random number, for every excluded position (in range, past the end, none) and
        /// totals both exact and off (a caller's sum may round differently; the walk must still
        /// agree); so does the walk over weights worked out beforehand (`draw_from_weights`).
        /// Costs from a few values, so equal weights and a target landing on a boundary are
        /// common; infinite costs weigh 0 (walked with no test of their own, and never the last
        /// weighted one when the target falls past the end), negative and NaN ones count as 0.
        #[test]
        fn the_draw_around_the_excluded_position_is_the_draw_testing_each(
            costs in proptest::collection::vec(proptest::prop_oneof![
                proptest::strategy::Just(0.0), proptest::strategy::Just(0.05),
                proptest::strategy::Just(0.3), proptest::strategy::Just(f64::INFINITY),
                proptest::strategy::Just(-1.0), proptest::strategy::Just(f64::NAN),
                0.0f64..2.0], 1..70),
            exclude in proptest::option::of(0usize..80),
            scale in proptest::prop_oneof![proptest::strategy::Just(1.0), 0.5f64..1.5],
            seed in proptest::prelude::any::<u64>(),
        ) {
            let c = costed(&costs);
            let weights: Vec<f64> = c.iter().map(low_cost_weight).collect();
            let exact: f64 = c.iter().enumerate().map(|(i, x)| draw_weight(i, x, exclude)).sum();
            let total = exact * scale;
            let rng = || SmallRng::seed_from_u64(seed);
            let (mut new, mut kept, mut old) = (rng(), rng(), rng());
            let want = draw_testing_each_position(&c, exclude, total, &mut old);
            proptest::prop_assert_eq!(draw_from_total(&c, exclude, total, &mut new), want);
            proptest::prop_assert_eq!(draw_from_weights(&weights, exclude, total, &mut kept), want);
            let next = old.next_u64();
            proptest::prop_assert_eq!(new.next_u64(), next);
            proptest::prop_assert_eq!(kept.next_u64(), next);
        }
    }
}
