//! Routing policies behind one trait, so the router, the simulator and the benchmark can swap them.
//!
//! The router does the common work first — the eligible set, each candidate's hit and predicted
//! cost — and a policy only picks among [`Candidate`]s. A policy never sees an ineligible replica,
//! so it cannot return one. Every policy is deterministic for a given seed: randomness comes from
//! the router's seeded RNG.

mod cache_argmin;
mod chwbl;
mod kind;
mod least_load;
mod lmetric;
mod p2c;
mod p2c_cache;
mod pick;
mod random;
mod round_robin;
mod sglang_threshold;

pub use cache_argmin::CacheArgmin;
pub use chwbl::Chwbl;
pub use kind::{PolicyKind, UnknownPolicy};
pub use least_load::LeastLoad;
pub use lmetric::LMetric;
pub use p2c::PowerOfTwo;
pub use p2c_cache::{P2cCache, DEFAULT_EVICT_CHARGE};
pub use pick::{Candidate, Pick, Policy, PolicyInput, Reason};
pub use random::RandomPolicy;
pub use round_robin::RoundRobin;
pub use sglang_threshold::SglangThreshold;

// Built here, above every policy, so that `kind.rs` (names) and `pick.rs` (the interface) stay
// below the policies that use them.
impl PolicyKind {
    /// A fresh policy of this kind with default parameters, for a node that sees its region's
    /// routing at once (see [`Self::build_for`]).
    pub fn build(self) -> Box<dyn Policy> {
        self.build_for(true, 0.0, DEFAULT_EVICT_CHARGE)
    }

    /// A fresh policy of this kind with default parameters; `shared_load` says whether the node
    /// sees its region peers' routing within a load-sharing interval (`RouterConfig::shared_load`)
    /// and, for `p2c-cache`, its recompute and eviction charges (`RouterConfig::recompute_charge_per_s`,
    /// `RouterConfig::evict_charge`).
    pub fn build_for(
        self,
        shared_load: bool,
        recompute_charge_per_s: f64,
        evict_charge: f64,
    ) -> Box<dyn Policy> {
        match self {
            PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
            PolicyKind::Random => Box::new(RandomPolicy),
            PolicyKind::LeastLoad => Box::new(LeastLoad),
            PolicyKind::P2c => Box::new(PowerOfTwo),
            PolicyKind::Chwbl => Box::new(Chwbl::default()),
            PolicyKind::CacheArgmin => Box::new(CacheArgmin),
            PolicyKind::LMetric => Box::new(LMetric),
            PolicyKind::SglangThreshold => Box::new(SglangThreshold::default()),
            PolicyKind::P2cCache if !shared_load => Box::new(P2cCache {
                escape_margin_s: f64::INFINITY,
                recompute_charge_per_s,
                evict_charge,
                ..P2cCache::default()
            }),
            PolicyKind::P2cCache => Box::new(P2cCache {
                recompute_charge_per_s,
                evict_charge,
                ..P2cCache::default()
            }),
        }
    }
}

#[cfg(test)]
pub(crate) mod testing {
    pub use super::*;
    pub use crate::core::keys::BlockKey;
    pub use rand::rngs::SmallRng;
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
            prefill_queue_s: outstanding as f64 * (2048.0 / 50_000.0),
            cache_fill: 0.0,
            cost_s: queue_s + uncached / 50_000.0,
            prefill_s: uncached / 50_000.0,
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
    use super::pick::*;
    use super::testing::*;
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
