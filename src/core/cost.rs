//! Predicted cost: the seconds until a replica would send this request's first token.
//!
//! ```text
//! queue_s = queued_prefill_tokens / prefill_rate  +  w_load × outstanding
//! cost_s  = queue_s  +  (prompt_tokens − cached_tokens) / prefill_rate  −  affinity_credit
//! ```
//!
//! `queued_prefill_tokens` is the uncached prompt work already waiting at the replica, as best
//! known; `outstanding` the requests there (engine figure or this node's own, the larger);
//! `w_load` the time one more running request adds (a decode step's share plus scheduling,
//! default 5 ms — the per-step cost of an 8B model on an H100, see the engine-timing reference);
//! `cached_tokens = hit_blocks × tokens_per_block`; the affinity credit applies only to the
//! session's rendezvous-preferred replica. Prefill rates come from the replica's config (default
//! 50,000 tokens/s: an 8B model on one H100, ~19 µs per prefill token).

use super::view::ReplicaState;

/// Parameters of the cost formula.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// Seconds one outstanding request adds to the wait. Default 0.005.
    pub w_load_s: f64,
    /// Seconds credited to the session's preferred replica. Default 0.05.
    pub affinity_credit_s: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            w_load_s: 0.005,
            affinity_credit_s: 0.05,
        }
    }
}

impl CostModel {
    /// Predicted wait before this request's prefill could start on `r`.
    pub fn queue_s(&self, r: &ReplicaState) -> f64 {
        let rate = r.info.prefill_tokens_per_s.max(1.0);
        r.load.queued_prefill_tokens as f64 / rate + self.w_load_s * r.load.outstanding() as f64
    }

    /// Predicted seconds until a request just sent to `r` with `uncached_tokens` of prefill has
    /// finished it: the prefill already queued there, then its own. This is when its blocks are
    /// in the engine's prefix cache and a follow-up can reuse them (the view's overlay counts
    /// them from then on, see [`super::view::View::record_routed_ready`]). The `w_load` term is
    /// left out: it stands for decode steps sharing the engine, which slow a prefill but do not
    /// hold it back the way queued prefill does, and counting it would withhold credit from
    /// follow-ups that, on a lightly loaded replica, do find the blocks.
    pub fn prefill_done_s(&self, r: &ReplicaState, uncached_tokens: u64) -> f64 {
        let rate = r.info.prefill_tokens_per_s.max(1.0);
        r.load.queued_prefill_tokens.saturating_add(uncached_tokens) as f64 / rate
    }

    /// Seconds of prefill for the uncached part of the prompt on `r`.
    pub fn prefill_s(&self, r: &ReplicaState, prompt_tokens: u64, cached_tokens: u64) -> f64 {
        prompt_tokens.saturating_sub(cached_tokens) as f64 / r.info.prefill_tokens_per_s.max(1.0)
    }
}
