//! round-robin: rotate through the eligible replicas. The baseline every router ships.
//!
//! Each router starts its rotation at a random (seeded) offset: many nodes all starting at
//! replica 0 would send their first requests to the same few replicas.

use rand::rngs::SmallRng;
use rand::Rng;

use super::kind::PolicyKind;
use super::pick::{Pick, Policy, PolicyInput, Reason};

/// Rotates through the candidates in view order.
#[derive(Debug, Default)]
pub struct RoundRobin {
    /// Next position; drawn from the router's RNG on the first pick.
    next: Option<usize>,
}

impl Policy for RoundRobin {
    fn kind(&self) -> PolicyKind {
        PolicyKind::RoundRobin
    }
    fn uses_cache(&self) -> bool {
        false
    }
    fn pick(&mut self, input: &PolicyInput<'_>, rng: &mut SmallRng) -> Pick {
        let n = input.candidates.len();
        let next = *self.next.get_or_insert_with(|| rng.random_range(0..n));
        let chosen = next % n;
        self.next = Some(next.wrapping_add(1));
        Pick {
            chosen,
            runner_up: None,
            reason: Reason::RoundRobin,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    #[test]
    fn visits_every_replica_in_turn() {
        let c = [cand(0, 50, 9), cand(1, 0, 0), cand(2, 0, 0)];
        assert_eq!(
            histogram(&mut RoundRobin::default(), &c, &keys(10), 9),
            vec![3, 3, 3]
        );
    }
}
