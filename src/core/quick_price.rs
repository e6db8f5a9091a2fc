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
        let prefill_queue_s = r.load.queued_prefill_tokens as f64 / price.tokens_per_s;
        let queue_s = prefill_queue_s + self.w_load_s * outstanding as f64;
        // `CostModel::prefill_s`.
        let cached = (credited_blocks * self.tokens_per_block).max(0.0);
        let prefill_s = price.work_s(cached, self.prompt_tokens - cached);
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
