//! lmetric: the lowest product of new prefill work and batch size (LMetric, Zhang et al.,
//! "Simple is Better: Multiplication May Be All You Need for LLM Request Scheduling",
//! arXiv 2603.15202; vLLM router's `smetric` is of the same family).
//!
//! ```text
//! score = uncached prefill × batch size        lowest wins
//! ```
//!
//! The first factor says how much a replica's cache saves (the prefill the request would add
//! there), the second how loaded it is. A weighted sum of the two needs a weight tuned per
//! workload; in a product the scale of each factor cancels when two scores are compared, so
//! there is no knob. Here:
//! - *uncached prefill* is [`Candidate::prefill_s`]: the prefill time the request's uncached
//!   tokens (hits credited by tier) would take there, attention over the cached context included
//!   (`core::cost`). Among replicas holding no part of the prompt, on a fleet of equal replicas,
//!   that orders exactly as the paper's token count; between a holder and a stranger it also
//!   weighs the holder's cached context (extending a long prefix pays attention over it).
//! - *batch size* is [`Candidate::outstanding`]: the replica's running plus queued requests as
//!   the engine last reported them (`num_requests_running + num_requests_waiting`), or this
//!   node's and its region peers' requests in flight there when that count is larger (it is
//!   fresher than a scrape).
//!
//! The product is 0 on every idle replica and on every replica holding the whole prompt: the
//! paper's one degenerate case. Ties are broken by the smaller uncached prefill, then the
//! smaller batch, then at random, so an idle holder beats an idle stranger and, among full
//! holders, the least loaded wins. The policy reads neither the session's affinity credit nor the
//! queued prefill: it is the paper's rule as published, a baseline for the default.

use rand::rngs::SmallRng;

use super::kind::PolicyKind;
use super::pick::{argmin_random_tie, Pick, Policy, PolicyInput, Reason};

/// Lowest (uncached prefill × batch size); ties to less prefill, then a smaller batch.
#[derive(Debug, Default)]
pub struct LMetric;

impl Policy for LMetric {
    fn kind(&self) -> PolicyKind {
        PolicyKind::LMetric
    }
    fn uses_cache(&self) -> bool {
        true
    }
    fn pick(&mut self, input: &PolicyInput<'_>, rng: &mut SmallRng) -> Pick {
        let chosen = argmin_random_tie(input.candidates, rng, |c| {
            let prefill_s = c.prefill_s.max(0.0);
            (
                prefill_s * f64::from(c.outstanding),
                prefill_s,
                c.outstanding,
            )
        });
        Pick {
            chosen,
            runner_up: None,
            reason: Reason::LowestProduct,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    #[test]
    fn the_product_weighs_a_hit_against_a_batch() {
        // A holder of 120 of 128 blocks with 6 requests: 8 blocks × 6 = 48 block-requests; a
        // cold replica with 1: 128 × 1 = 128. The holder keeps it...
        let c = [cand(0, 120, 6), cand(1, 0, 1), cand(2, 0, 2)];
        assert_eq!(
            histogram(&mut LMetric, &c, &keys(128), 100),
            vec![100, 0, 0]
        );
        // ... until its batch outweighs the cache it has: 8 × 20 = 160 > 128.
        let c = [cand(0, 120, 20), cand(1, 0, 1), cand(2, 0, 2)];
        assert_eq!(
            histogram(&mut LMetric, &c, &keys(128), 100),
            vec![0, 100, 0]
        );
    }

    #[test]
    fn zero_products_go_to_the_holder_then_the_idlest() {
        // Every product is 0 (idle replicas, and a holder of the whole prompt): the one with the
        // least prefill to do wins, not a random idle one.
        let c = [cand(0, 0, 0), cand(1, 100, 0), cand(2, 0, 0)];
        assert_eq!(
            histogram(&mut LMetric, &c, &keys(128), 100),
            vec![0, 100, 0]
        );
        // Two full holders: the smaller batch.
        let c = [cand(0, 128, 3), cand(1, 128, 1), cand(2, 0, 0)];
        assert_eq!(
            histogram(&mut LMetric, &c, &keys(128), 100),
            vec![0, 100, 0]
        );
        // Equal in every respect: split at random.
        let c = [cand(0, 0, 0), cand(1, 0, 0)];
        let h = histogram(&mut LMetric, &c, &keys(128), 1000);
        assert!(h[0] > 400 && h[1] > 400, "{h:?}");
    }
}
