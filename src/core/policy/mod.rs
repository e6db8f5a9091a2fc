//! Routing policies behind one trait, so the router, the simulator and the benchmark can swap them.
//!
//! The router does the common work first — the eligible set, each candidate's hit and predicted
//! cost — and a policy only picks among [`Candidate`]s. A policy never sees an ineligible replica,
//! so it cannot return one. Every policy is deterministic for a given seed: randomness comes from
//! the router's seeded RNG.

mod cache_argmin;
mod chwbl;
mod least_load;
mod p2c;
mod p2c_cache;
mod random;
mod round_robin;
mod sglang_threshold;

use std::fmt;
use std::str::FromStr;

use rand::rngs::SmallRng;
use rand::Rng;

pub use cache_argmin::CacheArgmin;
pub use chwbl::Chwbl;
pub use least_load::LeastLoad;
pub use p2c::PowerOfTwo;
pub use p2c_cache::P2cCache;
pub use random::RandomPolicy;
pub use round_robin::RoundRobin;
pub use sglang_threshold::SglangThreshold;

use super::keys::BlockKey;

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
    /// Predicted seconds to first token: queue plus uncached prefill, minus any affinity credit.
    pub cost_s: f64,
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

/// The configurable policies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// Rotate through the candidates.
    RoundRobin,
    /// Uniformly random.
    Random,
    /// Fewest outstanding requests.
    LeastLoad,
    /// Two random choices, fewer outstanding wins.
    P2c,
    /// Consistent hashing with bounded loads on the prefix.
    Chwbl,
    /// Lowest predicted cost (Dynamo-style).
    CacheArgmin,
    /// SGLang's cache_aware rule.
    SglangThreshold,
    /// Two choices with a cache score (the default).
    P2cCache,
}

impl PolicyKind {
    /// Every policy, in the order reports list them.
    pub const ALL: [PolicyKind; 8] = [
        PolicyKind::P2cCache,
        PolicyKind::CacheArgmin,
        PolicyKind::SglangThreshold,
        PolicyKind::Chwbl,
        PolicyKind::P2c,
        PolicyKind::LeastLoad,
        PolicyKind::RoundRobin,
        PolicyKind::Random,
    ];

    /// The configured name.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::Random => "random",
            PolicyKind::LeastLoad => "least-load",
            PolicyKind::P2c => "p2c",
            PolicyKind::Chwbl => "chwbl",
            PolicyKind::CacheArgmin => "cache-argmin",
            PolicyKind::SglangThreshold => "sglang-threshold",
            PolicyKind::P2cCache => "p2c-cache",
        }
    }

    /// A fresh policy of this kind with default parameters.
    pub fn build(self) -> Box<dyn Policy> {
        match self {
            PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
            PolicyKind::Random => Box::new(RandomPolicy),
            PolicyKind::LeastLoad => Box::new(LeastLoad),
            PolicyKind::P2c => Box::new(PowerOfTwo),
            PolicyKind::Chwbl => Box::new(Chwbl::default()),
            PolicyKind::CacheArgmin => Box::new(CacheArgmin),
            PolicyKind::SglangThreshold => Box::new(SglangThreshold::default()),
            PolicyKind::P2cCache => Box::new(P2cCache::default()),
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown policy name.
#[derive(Debug, thiserror::Error)]
#[error("unknown policy '{0}' (expected one of: round-robin, random, least-load, p2c, chwbl, cache-argmin, sglang-threshold, p2c-cache)")]
pub struct UnknownPolicy(pub String);

impl FromStr for PolicyKind {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| UnknownPolicy(s.to_owned()))
    }
}

/// A candidate drawn at random with weight `1 / (0.01 + cost_s)²`, skipping position `exclude`.
/// Cheap replicas (idle, or holding part of the prompt) are likely, but never certain, so routers
/// sharing one stale view do not all draw the same one. `None` only when nothing is left to draw.
pub(crate) fn draw_toward_low_cost(
    c: &[Candidate],
    exclude: Option<usize>,
    rng: &mut SmallRng,
) -> Option<usize> {
    let weight = |i: usize, x: &Candidate| {
        if Some(i) == exclude {
            0.0
        } else {
            let c = 0.01 + x.cost_s.max(0.0);
            1.0 / (c * c)
        }
    };
    let total: f64 = c.iter().enumerate().map(|(i, x)| weight(i, x)).sum();
    if total <= 0.0 {
        return None;
    }
    let mut target = rng.random::<f64>() * total;
    let mut last = None;
    for (i, x) in c.iter().enumerate() {
        let w = weight(i, x);
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
pub(crate) mod testing {
    use super::*;
    use rand::SeedableRng;

    /// A candidate with the given hit and load; cost follows the default cost model's shape:
    /// 8k-token prompt (128 blocks of 64), 50k tokens/s, 5 ms per outstanding request.
    pub fn cand(replica: usize, hit_blocks: u32, outstanding: u32) -> Candidate {
        let queue_s = outstanding as f64 * (2048.0 / 50_000.0 + 0.005);
        let uncached = (128u32.saturating_sub(hit_blocks) * 64) as f64;
        Candidate {
            replica,
            seed: crate::core::affinity::replica_seed(&format!("r{replica}")),
            hit_blocks,
            credited_blocks: hit_blocks as f64,
            outstanding,
            in_flight: outstanding,
            queue_s,
            cost_s: queue_s + uncached / 50_000.0,
        }
    }

    pub fn rng() -> SmallRng {
        SmallRng::seed_from_u64(7)
    }

    pub fn keys(n: u64) -> Vec<BlockKey> {
        (0..n).map(BlockKey).collect()
    }

    /// How many of `rounds` picks land on each candidate position.
    pub fn histogram(
        p: &mut dyn Policy,
        c: &[Candidate],
        keys: &[BlockKey],
        rounds: usize,
    ) -> Vec<usize> {
        let mut rng = rng();
        let mut h = vec![0; c.len()];
        for _ in 0..rounds {
            let pick = p.pick(
                &PolicyInput {
                    candidates: c,
                    keys,
                },
                &mut rng,
            );
            h[pick.chosen] += 1;
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn names_round_trip() {
        for k in PolicyKind::ALL {
            assert_eq!(k.as_str().parse::<PolicyKind>().unwrap(), k);
            assert_eq!(k.build().kind(), k);
        }
        assert!("nope".parse::<PolicyKind>().is_err());
    }

    proptest! {
        /// Whatever the candidates, every policy picks one of them, and its runner-up too.
        #[test]
        fn picks_stay_in_range(
            specs in proptest::collection::vec((0u32..200, 0u32..100), 1..40),
            nkeys in 0u64..200,
            seed in any::<u64>(),
        ) {
            use rand::SeedableRng;
            let c: Vec<Candidate> = specs.iter().enumerate().map(|(i, (h, o))| cand(i * 3, *h, *o)).collect();
            let keys = keys(nkeys);
            let mut rng = SmallRng::seed_from_u64(seed);
            for kind in PolicyKind::ALL {
                let mut p = kind.build();
                for _ in 0..5 {
                    let pick = p.pick(&PolicyInput { candidates: &c, keys: &keys }, &mut rng);
                    prop_assert!(pick.chosen < c.len());
                    if let Some(r) = pick.runner_up {
                        prop_assert!(r < c.len() && r != pick.chosen);
                    }
                }
            }
        }
    }
}
