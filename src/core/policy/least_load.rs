//! least-load: the replica with the fewest outstanding requests (random among ties).
//!
//! Perfect with fresh load; with many routers reading the same stale figures it herds, which is
//! why the default policy samples instead.

use rand::rngs::SmallRng;

use super::kind::PolicyKind;
use super::pick::{argmin_random_tie, Pick, Policy, PolicyInput, Reason};

/// Fewest outstanding requests.
#[derive(Debug, Default)]
pub struct LeastLoad;

impl Policy for LeastLoad {
    fn kind(&self) -> PolicyKind {
        PolicyKind::LeastLoad
    }
    fn uses_cache(&self) -> bool {
        false
    }
    fn pick(&mut self, input: &PolicyInput<'_>, rng: &mut SmallRng) -> Pick {
        let chosen = argmin_random_tie(input.candidates, rng, |c| c.outstanding);
        Pick {
            chosen,
            runner_up: None,
            reason: Reason::LeastLoad,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    #[test]
    fn picks_the_idlest_and_splits_ties() {
        let c = [cand(0, 100, 5), cand(1, 0, 1), cand(2, 0, 3)];
        assert_eq!(histogram(&mut LeastLoad, &c, &keys(10), 10), vec![0, 10, 0]);
        let tie = [cand(0, 0, 1), cand(1, 0, 1), cand(2, 0, 3)];
        let h = histogram(&mut LeastLoad, &tie, &keys(10), 1000);
        assert!(h[0] > 400 && h[1] > 400 && h[2] == 0, "{h:?}");
    }
}
