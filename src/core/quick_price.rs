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
    /// The quick candidate's constants for a request of `prompt_tokens` and `blocks` keys on a
    /// view of `tokens_per_block`, priced by `cost`; `None` when a hit of up to `blocks` GPU
    /// blocks could credit a non-finite number of tokens (a tier weight no node config passes:
    /// every candidate then takes the general path). Checked once here, so that a candidate's
    /// price needs none of [`PrefillPrice::work_s`]'s guards on its inputs: they always pass.
    pub fn new(
        cost: &CostModel,
        tokens_per_block: u32,
        prompt_tokens: u64,
        blocks: usize,
    ) -> Option<Self> {
        let quick = QuickPrice {
            w_gpu: cost.tier_weights.gpu,
            w_load_s: cost.w_load_s,
            tokens_per_block: u64::from(tokens_per_block) as f64,
            prompt_tokens: prompt_tokens as f64,
        };
        // The most a hit credits (`run ≤ blocks`, and a product of finite numbers grows with
        // either factor), so every run's credited tokens are finite if this is.
        let most = blocks as f64 * quick.w_gpu * quick.tokens_per_block;
        most.is_finite().then_some(quick)
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
        // `CostModel::prefill_s`: `PrefillPrice::work_s` less its guards, which pass here
        // (`cached` is finite and at least ±0 by `QuickPrice::new`, so `uncached` is finite).
        let cached = (credited_blocks * self.tokens_per_block).max(0.0);
        let uncached = self.prompt_tokens - cached;
        let prefill_s = if uncached > 0.0 {
            price.work_of_new_s(cached, uncached)
        } else {
            0.0
        };
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
