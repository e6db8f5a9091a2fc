//! Predicted cost: the seconds until a replica would send this request's first token.
//!
//! ```text
//! queue_s       = queued_prefill_tokens / prefill_rate  +  w_load × outstanding
//! cached_tokens = (gpu·w_gpu + (cpu − gpu)·w_cpu + (any − cpu)·w_disk) × tokens_per_block
//! C             = max(0, prompt_tokens − cached_tokens)            (the uncached tokens)
//! prefill_s     = C / prefill_rate  +  e · C · (cached_tokens + C/2)
//! cost_s        = queue_s  +  prefill_s  −  affinity_credit
//! ```
//!
//! `prefill_s` is what the engine spends (`engine_sim/config.rs`: a step costs `a + b·P + e·Σ
//! C·(p + C/2) + …`): per new token, plus attention of each new token over every token before it,
//! cached or not. Summed over the chunks of one prompt the attention is `e·C·(p + C/2)` whatever
//! the chunking, so the price needs neither the chunk size nor the step count (the per-step
//! overhead, ~1 µs a token at 8,192-token chunks, is inside `prefill_rate`). Priced by tokens
//! alone, a prefill was predicted 2.6–3× (median; p90 7–13×) shorter than the live replicas took
//! on the agentic sessions (issue #38): a 100,000-token recompute costs ~5.7 s, not 2 s, while
//! extending that cached prefix by 1,000 tokens costs ~0.1 s. Linear, the router undervalued a
//! long cached prefix and left its holder for a replica that then recomputed it. `e` is the
//! replica's `prefill_attention_ms_per_pair` (default 7.5e-7: the 8B preset; 0 prices by tokens
//! alone, as before).
//!
//! `queued_prefill_tokens` is the uncached prompt work already waiting at the replica, as best
//! known, by tokens alone: a queued long-context prefill's attention is not in it, so a replica
//! queueing several 100k-token turns reads shorter than it is. Booking each request's whole
//! `prefill_s` there instead was measured (issue #38, docs/peer-bench.md, "Pricing the queue
//! with attention"): faster in the simulator, but live it moved more Mooncake follow-ups off
//! their holders for load and lost hits, so it is not done. `outstanding` the requests there
//! (engine figure or this node's own, the larger);
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

    /// Predicted seconds until a request just sent to `r` with `uncached_tokens` of prefill after
    /// `cached_tokens` already in its KV has finished it: the prefill already queued there, then
    /// its own ([`prefill_work_s`]). This is when its blocks are in the engine's prefix cache and
    /// a follow-up can reuse them (the view's overlay counts them from then on, see
    /// [`super::view::View::record_routed_ready`]). The `w_load` term is left out: it stands for
    /// decode steps sharing the engine, which slow a prefill but do not hold it back the way
    /// queued prefill does, and counting it would withhold credit from follow-ups that, on a
    /// lightly loaded replica, do find the blocks.
    pub fn prefill_done_after_s(
        &self,
        r: &ReplicaState,
        cached_tokens: u64,
        uncached_tokens: u64,
    ) -> f64 {
        self.prefill_queue_s(r)
            + prefill_work_s(&r.info, cached_tokens as f64, uncached_tokens as f64)
    }

    /// [`Self::prefill_done_after_s`] for a prompt with nothing cached (a warm-up, a whole
    /// prefix).
    pub fn prefill_done_s(&self, r: &ReplicaState, uncached_tokens: u64) -> f64 {
        self.prefill_done_after_s(r, 0, uncached_tokens)
    }

    /// How full `r`'s prefix cache is believed to be, 0..=1: the distinct keys its summary took
    /// this epoch over the blocks the replica holds (0 without a summary). At 1 a prefix
    /// recomputed there evicts as many blocks as it writes, and some other conversation's
    /// follow-up recomputes them (p2c-cache's `evict_charge`). The count
    /// includes keys the replica has since evicted (until the summary's next epoch, which starts
    /// by a quarter stale): it reads a full cache as full, and a draining one as fuller than it is.
    #[inline]
    pub fn cache_fill(&self, r: &ReplicaState) -> f64 {
        cache_fill(r)
    }

    /// Seconds of prefill for the uncached part of the prompt on `r`, given the (weighted)
    /// cached tokens ([`prefill_work_s`]).
    #[inline]
    pub fn prefill_s(&self, r: &ReplicaState, prompt_tokens: u64, cached_tokens: f64) -> f64 {
        let cached = cached_tokens.max(0.0);
        prefill_work_s(&r.info, cached, prompt_tokens as f64 - cached)
    }
}

/// How full `r`'s prefix cache is believed to be, 0..=1 ([`CostModel::cache_fill`]); a free
/// function so the router's quick candidate (`quick_price.rs`) reads it without the model.
#[inline]
pub fn cache_fill(r: &ReplicaState) -> f64 {
    r.cache_fill()
}

/// Seconds replica `info` spends prefilling `uncached` new tokens after `cached` ones already in
/// its KV: `C / prefill_rate + e·C·(p + C/2)` (the module doc). 0 for no new tokens; negative or
/// non-finite inputs count as 0.
#[inline]
pub fn prefill_work_s(info: &ReplicaInfo, cached: f64, uncached: f64) -> f64 {
    PrefillPrice::of(info).work_s(cached, uncached)
}

/// A replica's prefill price constants, as [`prefill_work_s`] derives them from its facts: worked
/// out once per replica and kept by the router (`router.rs`'s remembered facts), so the
/// per-decision price is the same operations on the same numbers, without re-deriving them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillPrice {
    /// Prefill tokens per second, at least 1.
    pub tokens_per_s: f64,
    /// Attention, seconds per query·key pair, at least 0.
    pub attention_s_per_pair: f64,
}

impl PrefillPrice {
    /// The price constants of replica `info`.
    #[inline]
    pub fn of(info: &ReplicaInfo) -> Self {
        PrefillPrice {
            tokens_per_s: info.prefill_tokens_per_s.max(1.0),
            attention_s_per_pair: info.prefill_attention_ms_per_pair.max(0.0) * 1e-3,
        }
    }

    /// [`prefill_work_s`] at this price: `uncached` new tokens after `cached` ones.
    #[inline]
    pub fn work_s(&self, cached: f64, uncached: f64) -> f64 {
        let c = if uncached.is_finite() {
            uncached.max(0.0)
        } else {
            0.0
        };
        if c == 0.0 {
            return 0.0;
        }
        let p = if cached.is_finite() {
            cached.max(0.0)
        } else {
            0.0
        };
        let per_token_s = c / self.tokens_per_s;
        per_token_s + self.attention_s_per_pair * c * (p + c / 2.0)
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
    use super::super::view::testing::info;
    use super::*;

    #[test]
    fn a_prefill_pays_attention_over_its_whole_context() {
        // The 8B preset: 50,000 tokens/s and 7.5e-7 ms per pair.
        let r = info("r", "eu");
        // A 100,000-token recompute: 2 s per token, 3.75 s of attention.
        assert!((prefill_work_s(&r, 0.0, 100_000.0) - 5.75).abs() < 1e-9);
        // The same prompt with 99,000 tokens cached: 20 ms per token, 74.6 ms of attention.
        let extend = prefill_work_s(&r, 99_000.0, 1_000.0);
        assert!((extend - (0.02 + 7.5e-10 * 1_000.0 * 99_500.0)).abs() < 1e-12);
        // What the engine model charges for that chunk (`engine_sim`'s 8B preset: 0.019 ms a
        // token, 7.5e-7 ms a pair): equal within its per-step overhead.
        let engine_ms = 0.019 * 1_000.0 + 7.5e-7 * 1_000.0 * (99_000.0 + 500.0);
        assert!(
            (extend * 1e3 - engine_ms).abs() / engine_ms < 0.05,
            "{extend} vs {engine_ms}"
        );
        // Without attention it is tokens over the rate, as before.
        let linear = ReplicaInfo {
            prefill_attention_ms_per_pair: 0.0,
            ..info("r", "eu")
        };
        assert_eq!(prefill_work_s(&linear, 99_000.0, 1_000.0), 0.02);
        // Nothing new, or nonsense: nothing.
        assert_eq!(prefill_work_s(&r, 5_000.0, 0.0), 0.0);
        assert_eq!(prefill_work_s(&r, f64::NAN, -3.0), 0.0);
        assert_eq!(
            prefill_work_s(&r, f64::INFINITY, 10.0),
            10.0 / 50_000.0 + 7.5e-10 * 50.0
        );
    }

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

    #[test]
    fn a_cache_is_as_full_as_the_keys_its_summary_took() {
        use super::super::keys::BlockKey;
        use super::super::summary::{ReplicaSummary, SummaryConfig};
        use super::super::view::View;
        let mut view = View::new("eu", 8);
        let i = view.upsert(info("r", "eu"));
        let cost = CostModel::default();
        // No summary: nothing known, nothing charged.
        let r = view.replica(i).expect("just added");
        assert_eq!(cost.cache_fill(r), 0.0);
        let keys: Vec<BlockKey> = (0..1_500).map(BlockKey).collect();
        let cfg = SummaryConfig::for_cluster("c");
        for (taken, fill) in [(250, 0.25), (1_000, 1.0), (1_500, 1.0)] {
            let mut s = ReplicaSummary::new(1, 1_000, &cfg).expect("a summary");
            s.insert(&keys[..taken]);
            view.set_summary(i, s);
            let r = view.replica(i).expect("just added");
            // `inserted` skips the filter's false positives (1 %).
            let got = cost.cache_fill(r);
            assert!(got <= fill && got > fill - 0.02, "{taken} keys: {got}");
        }
    }
}
