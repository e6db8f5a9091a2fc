//! p2c-cache, the default: two choices with a cache score.
//!
//! Candidate A is the replica with the longest hit, credited by tier (random among near-ties:
//! a block on GPU counts more than one offloaded to CPU or disk); candidate B is a
//! *different* replica drawn at random, weighted toward low predicted cost (so toward idle
//! replicas and those holding part of the prompt). The request goes to whichever
//! has the lower predicted cost (queued work plus uncached prefill, in seconds). So:
//! - a warm, idle holder wins (its prefill is short);
//! - a hot prefix whose holder is swamped spills to B, which then holds the prefix too, and later
//!   requests spread between the two (near-ties) — hot spots cool on their own;
//! - many routers with the same stale view do not all pick the same B, so they do not herd;
//! - with no hit anywhere, it is plain power-of-two-choices on cost.

use rand::rngs::SmallRng;
use rand::Rng;

use super::kind::PolicyKind;
use super::pick::{draw_toward_low_cost, Candidate, Pick, Policy, PolicyInput, Reason};

/// Two choices with a cache score.
#[derive(Debug)]
pub struct P2cCache {
    /// Hits within this fraction of the longest count as ties for A. Default 1/16.
    pub tie_fraction: f64,
}

impl Default for P2cCache {
    fn default() -> Self {
        P2cCache {
            tie_fraction: 1.0 / 16.0,
        }
    }
}

impl P2cCache {
    /// Candidate A: a uniformly random one among those whose hit is within the tie margin of the
    /// longest (reservoir sampling, no allocation).
    fn longest_hit(&self, c: &[Candidate], max_hit: f64, rng: &mut SmallRng) -> usize {
        // Whole blocks of margin, as when hits were integers.
        let floor = max_hit - (max_hit * self.tie_fraction).floor().min(max_hit);
        let mut chosen = 0;
        let mut seen = 0u32;
        for (i, x) in c.iter().enumerate() {
            if x.credited_blocks > 0.0 && x.credited_blocks >= floor {
                seen += 1;
                if rng.random_range(0..seen) == 0 {
                    chosen = i;
                }
            }
        }
        chosen
    }
}

impl Policy for P2cCache {
    fn kind(&self) -> PolicyKind {
        PolicyKind::P2cCache
    }
    fn uses_cache(&self) -> bool {
        true
    }
    fn pick(&mut self, input: &PolicyInput<'_>, rng: &mut SmallRng) -> Pick {
        let c = input.candidates;
        if c.len() == 1 {
            return Pick {
                chosen: 0,
                runner_up: None,
                reason: Reason::OnlyCandidate,
            };
        }
        let max_hit = c.iter().map(|x| x.credited_blocks).fold(0.0, f64::max);
        let (a, no_hit) = if max_hit <= 0.0 {
            // No cache anywhere: both choices are load-weighted draws.
            (draw_toward_low_cost(c, None, rng).unwrap_or(0), true)
        } else {
            (self.longest_hit(c, max_hit, rng), false)
        };
        let Some(b) = draw_toward_low_cost(c, Some(a), rng) else {
            return Pick {
                chosen: a,
                runner_up: None,
                reason: Reason::OnlyCandidate,
            };
        };
        let (chosen, other, reason) = if c[b].cost_s < c[a].cost_s {
            (
                b,
                a,
                if no_hit {
                    Reason::NoHit
                } else {
                    Reason::SecondChoice
                },
            )
        } else {
            (
                a,
                b,
                if no_hit {
                    Reason::NoHit
                } else {
                    Reason::LongestHit
                },
            )
        };
        Pick {
            chosen,
            runner_up: Some(other),
            reason,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    #[test]
    fn an_idle_holder_takes_its_prefix() {
        let c = [cand(0, 0, 0), cand(1, 100, 0), cand(2, 0, 0)];
        assert_eq!(
            histogram(&mut P2cCache::default(), &c, &keys(128), 100),
            vec![0, 100, 0]
        );
    }

    #[test]
    fn a_loaded_holder_shares_its_hot_prefix() {
        // The holder has 6 queued requests (~0.27 s of work); a cold replica needs 0.04 s of
        // prefill for the rest of the prompt: the request spills.
        let c = [cand(0, 120, 6), cand(1, 0, 0), cand(2, 0, 0), cand(3, 0, 0)];
        let h = histogram(&mut P2cCache::default(), &c, &keys(128), 300);
        assert_eq!(h[0], 0, "{h:?}");
        // Spread over the others, not herded on one.
        assert!(h[1..].iter().all(|n| *n > 60), "{h:?}");
        // Even when one cold replica looks a little cheaper (where cache-argmin herds).
        let c = [cand(0, 120, 6), cand(1, 0, 1), cand(2, 0, 2), cand(3, 0, 2)];
        let h = histogram(&mut P2cCache::default(), &c, &keys(128), 300);
        assert!(h[0] == 0 && h[1] < 250 && h[2] > 20 && h[3] > 20, "{h:?}");
        // Lightly loaded holder: still wins.
        let c = [cand(0, 120, 1), cand(1, 0, 0), cand(2, 0, 0)];
        assert_eq!(
            histogram(&mut P2cCache::default(), &c, &keys(128), 100)[0],
            100
        );
    }

    #[test]
    fn after_a_spill_two_holders_share_the_prefix() {
        // Both hold the prefix now: ties, so traffic splits between them.
        let c = [cand(0, 120, 2), cand(1, 120, 2), cand(2, 0, 0)];
        let h = histogram(&mut P2cCache::default(), &c, &keys(128), 1000);
        assert!(h[0] > 300 && h[1] > 300, "{h:?}");
    }

    #[test]
    fn without_hits_it_balances_load() {
        let c = [cand(0, 0, 8), cand(1, 0, 0), cand(2, 0, 1), cand(3, 0, 8)];
        let h = histogram(&mut P2cCache::default(), &c, &keys(128), 1000);
        assert!(
            h[1] > h[2] && h[2] > h[0] && h[0] < 50 && h[3] < 50,
            "{h:?}"
        );
    }
}
