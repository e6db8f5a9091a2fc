//! round-robin: rotate through the eligible replicas. The baseline every router ships.

use rand::rngs::SmallRng;

use super::{Pick, Policy, PolicyInput, PolicyKind, Reason};

/// Rotates through the candidates in view order.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: usize,
}

impl Policy for RoundRobin {
    fn kind(&self) -> PolicyKind {
        PolicyKind::RoundRobin
    }
    fn uses_cache(&self) -> bool {
        false
    }
    fn pick(&mut self, input: &PolicyInput<'_>, _rng: &mut SmallRng) -> Pick {
        let chosen = self.next % input.candidates.len();
        self.next = self.next.wrapping_add(1);
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
