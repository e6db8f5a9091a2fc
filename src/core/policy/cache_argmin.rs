//! cache-argmin: route to the lowest predicted cost, as NVIDIA Dynamo's KV router does (at
//! temperature 0).
//!
//! Precise with fresh, exact load. With several routers and load that lags, every router picks
//! the same minimum until the figures catch up — it herds; the benchmark shows the price.

use rand::rngs::SmallRng;

use super::kind::PolicyKind;
use super::pick::{argmin_random_tie, Pick, Policy, PolicyInput, Reason};

/// Lowest predicted cost; random among exact ties.
#[derive(Debug, Default)]
pub struct CacheArgmin;

impl Policy for CacheArgmin {
    fn kind(&self) -> PolicyKind {
        PolicyKind::CacheArgmin
    }
    fn uses_cache(&self) -> bool {
        true
    }
    fn pick(&mut self, input: &PolicyInput<'_>, rng: &mut SmallRng) -> Pick {
        let chosen = argmin_random_tie(input.candidates, rng, |c| c.cost_s);
        Pick {
            chosen,
            runner_up: None,
            reason: Reason::LowestCost,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    #[test]
    fn herds_onto_the_cheapest_replica() {
        // The holder of a hot prefix is swamped; on a view that lags, every request goes to the
        // one replica that looks cheapest — the herd that p2c-cache avoids (see its tests).
        let c = [cand(0, 120, 6), cand(1, 0, 1), cand(2, 0, 2), cand(3, 0, 2)];
        assert_eq!(
            histogram(&mut CacheArgmin, &c, &keys(128), 200),
            vec![0, 200, 0, 0]
        );
        // A warm, lightly loaded holder is the cheapest: it gets everything.
        let c = [cand(0, 120, 2), cand(1, 0, 0), cand(2, 0, 0)];
        assert_eq!(
            histogram(&mut CacheArgmin, &c, &keys(128), 100),
            vec![100, 0, 0]
        );
    }
}
