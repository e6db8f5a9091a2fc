//! p2c: the power of two choices on load alone. Two replicas drawn uniformly; the one with fewer
//! outstanding requests wins. Exponentially better balance than random, robust to stale load.

use rand::rngs::SmallRng;

use super::kind::PolicyKind;
use super::pick::{two_distinct, Pick, Policy, PolicyInput, Reason};

/// Two random choices, fewer outstanding wins.
#[derive(Debug, Default)]
pub struct PowerOfTwo;

impl Policy for PowerOfTwo {
    fn kind(&self) -> PolicyKind {
        PolicyKind::P2c
    }
    fn uses_cache(&self) -> bool {
        false
    }
    fn pick(&mut self, input: &PolicyInput<'_>, rng: &mut SmallRng) -> Pick {
        let c = input.candidates;
        let (a, b) = two_distinct(c.len(), rng);
        let Some(b) = b else {
            return Pick {
                chosen: a,
                runner_up: None,
                reason: Reason::OnlyCandidate,
            };
        };
        let (chosen, other) = if c[b].outstanding < c[a].outstanding {
            (b, a)
        } else {
            (a, b)
        };
        Pick {
            chosen,
            runner_up: Some(other),
            reason: Reason::NoHit,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    #[test]
    fn the_most_loaded_replica_never_wins() {
        let c = [cand(0, 0, 10), cand(1, 0, 2), cand(2, 0, 3)];
        let h = histogram(&mut PowerOfTwo, &c, &keys(1), 3000);
        assert_eq!(h[0], 0);
        // r1 wins both of its pairs (2/3 of draws), r2 only its pair with r0 (1/3).
        assert!(h[1] > 1800 && h[2] > 800, "{h:?}");
    }
}
