//! The router's quick candidate: a replica's [`Candidate`] made from the few numbers that
//! decide it in the common case, with the same operations, in the same order, as the general
//! `Router::candidate` (`router.rs`), so the two agree to the bit.
//!
//! The common case, per decision: the policy reads caches, no peer tip names this prompt (no
//! tip hit, no computation under way elsewhere) and the tenant has no KV quota; per replica: its
//! hit is the run the up-front slice search found ([`crate::core::view::View::sliced_hit`]: no
//! overlay, no lower tiers). Then the hit is that run, all on GPU, no burst rides on it, and the
//! cost is the queue plus the prefill price of the rest of the prompt. Every other replica takes
//! the general path, so a decision may mix both.
//!
//! Why it exists: at 512 replicas the candidate loop was two thirds of a decision's instructions
//! (`scripts/decision-instructions.sh`), and most of a replica's share was re-deriving what is the
//! same for the whole decision (tier weights, the request's tokens, which checks apply) or for the
//! replica across decisions (its prefill price, kept with the router's remembered static facts).
//! Remembering the last prefill priced (replicas of one kind mostly hold the same prefix) was
//! tried and cost more than it saved: the comparison and the memo's stores outweighed the few
//! arithmetic operations of the price.

use super::cost::{cache_fill, CostModel, PrefillPrice};
use super::policy::Candidate;
use super::view::ReplicaState;

/// One decision's constants of the quick candidate.
#[derive(Clone, Copy, Debug)]
pub struct QuickPrice {
    /// Credit per GPU block (the node's GPU tier weight).
    w_gpu: f64,
    /// Seconds one outstanding request adds (`CostModel::w_load_s`).
    w_load_s: f64,
    /// Tokens per block, as a float (the view's).
    tokens_per_block: f64,
    /// The request's prompt tokens, as a float.
    prompt_tokens: f64,
}

impl QuickPrice {
    /// The quick candidate's constants for a request of `prompt_tokens` on a view of
    /// `tokens_per_block`, priced by `cost`.
    pub fn new(cost: &CostModel, tokens_per_block: u32, prompt_tokens: u64) -> Self {
        QuickPrice {
            w_gpu: cost.tier_weights.gpu,
            w_load_s: cost.w_load_s,
            tokens_per_block: u64::from(tokens_per_block) as f64,
            prompt_tokens: prompt_tokens as f64,
        }
    }

    /// Replica `i` (state `r`, prefill price `price`) as a candidate whose whole hit is `run`
    /// leading blocks on GPU: `Router::candidate`'s answer for it in the common case.
    #[inline(always)]
    pub fn candidate(
        &self,
        i: usize,
        r: &ReplicaState,
        run: usize,
        price: PrefillPrice,
    ) -> Candidate {
        // `CostModel::credited_blocks_on` for a hit all on GPU.
        let credited_blocks = run as f64 * self.w_gpu;
        let outstanding = r.load.outstanding();
        // `CostModel::prefill_queue_s` and `queue_s`.
        let prefill_queue_s = tokens_as_f64(r.load.queued_prefill_tokens) / price.tokens_per_s;
        let queue_s = prefill_queue_s + self.w_load_s * outstanding as f64;
        // `CostModel::prefill_s`.
        let cached = (credited_blocks * self.tokens_per_block).max(0.0);
        let prefill_s = work_after_s(price, cached, self.prompt_tokens - cached);
        Candidate {
            replica: i,
            seed: r.seed,
            hit_blocks: run as u32,
            credited_blocks,
            outstanding,
            in_flight: r.load.in_flight,
            queue_s,
            prefill_queue_s,
            cost_s: queue_s + prefill_s,
            prefill_s,
            cache_fill: cache_fill(r),
        }
    }
}

/// `tokens as f64`, the same double, in one signed conversion for any count below 2⁶³ (every
/// real one): x86-64 has no unsigned one before AVX-512, so `u64 as f64` is a six-instruction
/// sequence, once per replica and decision here (`scripts/decision-instructions.sh`). Both
/// conversions round the same integer to nearest. The rest go through a call: with `as f64`
/// inline in both arms the compiler saw one unsigned conversion and emitted the sequence.
#[inline(always)]
fn tokens_as_f64(tokens: u64) -> f64 {
    match i64::try_from(tokens) {
        Ok(signed) => signed as f64,
        Err(_) => huge_tokens_as_f64(tokens),
    }
}

/// [`tokens_as_f64`] past `i64::MAX`, out of line (never, for a real queue).
#[cold]
#[inline(never)]
fn huge_tokens_as_f64(tokens: u64) -> f64 {
    tokens as f64
}

/// [`PrefillPrice::work_s`] for the quick candidate's numbers: `cached` is the result of
/// `max(0.0)` (never NaN: 0 or more, or +∞) and `uncached` a finite prompt less it. The same
/// operations on the same numbers, less the two finiteness tests (about a tenth of a quick
/// candidate's instructions) that these numbers make moot:
/// - `uncached` is finite or −∞ (+∞ or NaN would need a NaN or −∞ `cached`), and `max(0.0)`
///   takes −∞ to 0, as the test did;
/// - past the early return `uncached` is finite, so `cached` is too, and already `max(0.0)`'d
///   (a −0 `p` and a +0 one add alike to the positive `c / 2`).
#[inline(always)]
fn work_after_s(price: PrefillPrice, cached: f64, uncached: f64) -> f64 {
    let c = uncached.max(0.0);
    if c == 0.0 {
        return 0.0;
    }
    let per_token_s = c / price.tokens_per_s;
    per_token_s + price.attention_s_per_pair * c * (cached + c / 2.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// The one-conversion path is `as f64` to the bit, at the edges (0, 2⁵³ ± 1 where
        /// doubles stop being exact, 2⁶³ ± 1 where the signed path ends, `u64::MAX`) and
        /// anywhere between.
        #[test]
        fn tokens_as_f64_is_as_f64_to_the_bit(
            tokens in proptest::prop_oneof![
                proptest::strategy::Just(0u64), proptest::strategy::Just((1u64 << 53) - 1),
                proptest::strategy::Just((1u64 << 53) + 1), proptest::strategy::Just(i64::MAX as u64),
                proptest::strategy::Just(1u64 << 63), proptest::strategy::Just((1u64 << 63) + 1),
                proptest::strategy::Just(u64::MAX), proptest::prelude::any::<u64>(), 0u64..1_000_000_000],
        ) {
            proptest::prop_assert_eq!(tokens_as_f64(tokens).to_bits(), (tokens as f64).to_bits());
        }
    }

    proptest::proptest! {
        /// The quick prefill price is `PrefillPrice::work_s` to the bit on every number the
        /// quick candidate can give it: cached tokens from `max(0.0)` of anything (0, −0,
        /// huge, +∞, NaN) and a prompt from 0 up, at any price.
        #[test]
        fn the_quick_prefill_price_is_work_s_to_the_bit(
            credited in proptest::prop_oneof![
                proptest::strategy::Just(0.0), proptest::strategy::Just(-0.0),
                proptest::strategy::Just(f64::INFINITY), proptest::strategy::Just(f64::NAN),
                proptest::strategy::Just(f64::NEG_INFINITY), -10.0f64..1e6, 0.0f64..1e300],
            prompt in proptest::prop_oneof![proptest::strategy::Just(0u64), 0u64..1_000_000, proptest::prelude::any::<u64>()],
            tokens_per_s in proptest::prop_oneof![proptest::strategy::Just(1.0), 1.0f64..1e7],
            attention in proptest::prop_oneof![proptest::strategy::Just(0.0), 0.0f64..1e-5],
        ) {
            let price = PrefillPrice { tokens_per_s, attention_s_per_pair: attention };
            let cached = credited.max(0.0);
            let uncached = prompt as f64 - cached;
            proptest::prop_assert_eq!(
                work_after_s(price, cached, uncached).to_bits(),
                price.work_s(cached, uncached).to_bits()
            );
        }
    }
}
