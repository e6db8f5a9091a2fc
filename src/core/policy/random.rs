//! random: a uniformly random eligible replica.

use rand::rngs::SmallRng;
use rand::Rng;

use super::kind::PolicyKind;
use super::pick::{Pick, Policy, PolicyInput, Reason};

/// Uniformly random choice.
#[derive(Debug, Default)]
pub struct RandomPolicy;

impl Policy for RandomPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Random
    }
    fn uses_cache(&self) -> bool {
        false
    }
    fn pick(&mut self, input: &PolicyInput<'_>, rng: &mut SmallRng) -> Pick {
        Pick {
            chosen: rng.random_range(0..input.candidates.len()),
            runner_up: None,
            reason: Reason::Random,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    #[test]
    fn spreads_uniformly() {
        let c = [cand(0, 0, 0), cand(1, 0, 0), cand(2, 0, 0), cand(3, 0, 0)];
        let h = histogram(&mut RandomPolicy, &c, &keys(1), 4000);
        assert!(h.iter().all(|n| (850..1150).contains(n)), "{h:?}");
    }
}
