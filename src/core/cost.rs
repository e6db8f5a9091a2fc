//! Predicted cost: the seconds until a replica would send this request's first token.
//!
//! ```text
//! queue_s       = queued_prefill_tokens / prefill_rate  +  w_load × outstanding
//! cached_tokens = (gpu·w_gpu + (cpu − gpu)·w_cpu + (any − cpu)·w_disk) × tokens_per_block
//! cost_s        = queue_s  +  max(0, prompt_tokens − cached_tokens) / prefill_rate  −  affinity_credit
//! ```
//!
//! `queued_prefill_tokens` is the uncached prompt work already waiting at the replica, as best
//! known; `outstanding` the requests there (engine figure or this node's own, the larger);
//! `w_load` the time one more running request adds (a decode step's share plus scheduling,
//! default 5 ms — the per-step cost of an 8B model on an H100, see the engine-timing reference);
//! `gpu ≤ cpu ≤ any` are the leading blocks held on GPU, on GPU or in CPU memory, and in any
//! tier ([`TierHit`]), so `cached_tokens` credits each hit block by the weight of the best tier
//! it is held in: a block on GPU is reused outright, an offloaded one must be copied back first
//! (defaults 1.0 / 0.75 / 0.25 — a discount, not a transfer-time model). A replica that declares
//! its KV size and links ([`super::kv_load::KvLoad`], `kv_load` in its config) gets weights from the predicted
//! load time instead: `w_cpu = 1 − bytes_per_token × prefill_rate / cpu_bandwidth` (likewise
//! disk), so a CPU block costs exactly its copy time (see [`super::kv_load`]). Without offload
//! it is `hit_blocks × tokens_per_block`, as before tiers. The affinity credit applies only to
//! the session's rendezvous-preferred replica. With `[kv_fetch]` on, a candidate that takes fetch
//! hints may instead count the longest holder's run as its own, paying the transfer
//! ([`super::kv_fetch`]). Prefill rates come from the replica's config (default
//! 50,000 tokens/s: an 8B model on one H100, ~19 µs per prefill token).

use serde::Deserialize;

use super::view::{ReplicaInfo, ReplicaState, TierHit};

/// How much of a cached block's prefill each tier saves, 0..=1 (`tier_weights` in the node's
/// config, e.g. `tier_weights = { gpu = 1.0, cpu = 0.75, disk = 0.25 }`).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TierWeights {
    /// A block in the GPU pool. Default 1.0 (its prefill is skipped entirely).
    pub gpu: f64,
    /// A block held only in CPU memory. Default 0.75 (a host-to-device copy is much cheaper than
    /// recomputing it, but not free).
    pub cpu: f64,
    /// A block held only on disk or other slow storage. Default 0.25.
    pub disk: f64,
}

impl Default for TierWeights {
    fn default() -> Self {
        TierWeights {
            gpu: 1.0,
            cpu: 0.75,
            disk: 0.25,
        }
    }
}

/// Parameters of the cost formula.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// Seconds one outstanding request adds to the wait. Default 0.005.
    pub w_load_s: f64,
    /// Seconds credited to the session's preferred replica. Default 0.2: a session's follow-ups
    /// often arrive before every node's view shows where its previous turn went (summaries lag a
    /// gossip round or two); the credit keeps them on the one replica every node agrees on
    /// (rendezvous) unless it is 0.2 s busier. At 0.05 s the simulator measured agent runs at 80
    /// req/s sprayed over the fleet (mean TTFT 2.2 s vs 0.079 s) and chat 0.148 s vs 0.101 s.
    pub affinity_credit_s: f64,
    /// Credit per hit block by the tier it is held in. Default 1.0 / 0.75 / 0.25.
    pub tier_weights: TierWeights,
    /// Pulling a prefix from the replica that holds it ([`super::kv_fetch`]): off by default.
    pub fetch: super::kv_fetch::KvFetchConfig,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            w_load_s: 0.005,
            affinity_credit_s: 0.2,
            tier_weights: TierWeights::default(),
            fetch: super::kv_fetch::KvFetchConfig::default(),
        }
    }
}

impl CostModel {
    /// Seconds of uncached prompt work already queued at `r` (the prefill part of [`Self::queue_s`]).
    pub fn prefill_queue_s(&self, r: &ReplicaState) -> f64 {
        r.load.queued_prefill_tokens as f64 / r.info.prefill_tokens_per_s.max(1.0)
    }

    /// Predicted wait before this request's prefill could start on `r`.
    pub fn queue_s(&self, r: &ReplicaState) -> f64 {
        self.prefill_queue_s(r) + self.w_load_s * r.load.outstanding() as f64
    }

    /// Hit blocks credited by the node's fixed tier weights:
    /// `gpu·w_gpu + (cpu − gpu)·w_cpu + (any − cpu)·w_disk`.
    #[inline]
    pub fn credited_blocks(&self, h: TierHit) -> f64 {
        credit(h, &self.tier_weights)
    }

    /// Hit blocks credited on replica `info`: by its load-time weights when it declares a
    /// [`super::kv_load::KvLoad`], else by the node's fixed ones. The router's per-candidate call: the weights
    /// are worked out (two divisions) only when the hit has lower-tier blocks at all.
    #[inline]
    pub fn credited_blocks_on(&self, info: &ReplicaInfo, h: TierHit) -> f64 {
        match &info.kv_load {
            Some(load) if h.any != h.gpu => {
                let (cpu, disk) = load.weights(info.prefill_tokens_per_s);
                let w = TierWeights {
                    cpu,
                    disk,
                    ..self.tier_weights
                };
                credit(h, &w)
            }
            _ => self.credited_blocks(h),
        }
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

    /// Seconds of prefill for the uncached part of the prompt on `r`, given the (weighted)
    /// cached tokens.
    pub fn prefill_s(&self, r: &ReplicaState, prompt_tokens: u64, cached_tokens: f64) -> f64 {
        (prompt_tokens as f64 - cached_tokens).max(0.0) / r.info.prefill_tokens_per_s.max(1.0)
    }
}

/// `gpu·w.gpu + (cpu − gpu)·w.cpu + (any − cpu)·w.disk`.
#[inline]
fn credit(h: TierHit, w: &TierWeights) -> f64 {
    let gpu = h.gpu as f64 * w.gpu;
    if h.any == h.gpu {
        // No lower-tier blocks (always, without offload): skip the rest.
        return gpu;
    }
    gpu + h.cpu.saturating_sub(h.gpu) as f64 * w.cpu + h.any.saturating_sub(h.cpu) as f64 * w.disk
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_are_credited_by_tier_weight() {
        let c = CostModel::default();
        let h = |gpu, cpu, any| TierHit { gpu, cpu, any };
        assert_eq!(c.credited_blocks(h(10, 10, 10)), 10.0);
        // Half on GPU, half in CPU memory: 5 + 5 × 0.75.
        assert_eq!(c.credited_blocks(h(5, 10, 10)), 8.75);
        assert_eq!(c.credited_blocks(h(0, 4, 8)), 4.0);
        assert_eq!(c.credited_blocks(h(0, 0, 0)), 0.0);
        let flat = CostModel {
            tier_weights: TierWeights {
                gpu: 1.0,
                cpu: 1.0,
                disk: 1.0,
            },
            ..c
        };
        assert_eq!(flat.credited_blocks(h(2, 5, 9)), 9.0);
    }
}
