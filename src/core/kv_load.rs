//! Predicted load time of an offloaded KV block: how much of its prefill a lower-tier hit saves.
//!
//! A block held only in CPU memory (or on disk) is not free: the engine copies it back to the
//! GPU before the request can use it. The copy takes `bytes_per_token × tokens_per_block /
//! bandwidth` seconds, the recompute it replaces `tokens_per_block / prefill_rate` seconds, so
//! the share of the prefill a hit saves — its weight in the cost model (`cost.rs`) — is
//!
//! ```text
//! w_tier = 1 − bytes_per_token × prefill_tokens_per_s / tier_bytes_per_s
//! ```
//!
//! (`tokens_per_block` cancels). A replica that declares its KV size and links (`kv_load` in
//! its config, carried in its gossip record) gets these weights; one without keeps the node's
//! fixed `tier_weights`.
//!
//! Why the weight may go below 0 and is not clamped there: the engines load every lower-tier hit
//! they find. vLLM's offloading connector reports all CPU hits as tokens to load
//! (`get_num_new_matched_tokens`) and the request waits for the copy; it never compares the copy
//! with recomputing. So on a link slower than recompute a CPU hit really costs more than no hit,
//! and the router should see that. The floor [`MIN_TIER_WEIGHT`] only keeps costs finite and
//! comparable. The ceiling is 1: a copy is never faster than nothing.
//!
//! Transfer state: vLLM's KV events carry only a block's `medium`, no transfer progress (a
//! store event comes once the offload is done), and SGLang's none at all, so the block's tier
//! is all the router uses; bandwidth is configured, not measured.

use serde::{Deserialize, Serialize};

/// Lowest weight a lower-tier hit gets: its load is 65× slower than recompute. Keeps costs
/// finite whatever the configured bandwidths.
pub const MIN_TIER_WEIGHT: f64 = -64.0;

/// Largest accepted KV size per token: 4 MiB (Llama-3.1-405B in BF16 is 504 KiB).
pub const MAX_BYTES_PER_TOKEN: u32 = 4 << 20;

/// Accepted bandwidths, GB/s (10⁹ bytes per second): from a congested network store to well
/// beyond any host link.
pub const GB_PER_S_RANGE: std::ops::RangeInclusive<f64> = 0.01..=10_000.0;

/// A replica's KV size and the bandwidths it loads offloaded blocks back at (`[[replicas]]
/// kv_load = { bytes_per_token = …, cpu_gb_per_s = …, disk_gb_per_s = … }`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvLoad {
    /// KV cache bytes of one token, all layers. Default 131,072: Llama-3.1-8B in BF16
    /// (2 × 32 layers × 8 KV heads × 128 dims × 2 bytes).
    pub bytes_per_token: u32,
    /// Host-to-device copy rate, GB/s. Default 25: a PCIe gen4 x16 link's practical rate (gen5
    /// doubles it; a link shared with other traffic gets less).
    pub cpu_gb_per_s: f64,
    /// Disk (or remote store) to device rate, GB/s. Default 3: one NVMe drive.
    pub disk_gb_per_s: f64,
    /// The KV-fetch hint this replica's engine takes, if any (`hints = "vllm-envelope"` or
    /// `"llm-d"`; default `"none"`): only a replica that declares one is ever told to pull a
    /// prefix from another replica (`kv_fetch.rs`). Left out of the gossip record when `none`,
    /// so peers that predate it still read the record.
    #[serde(skip_serializing_if = "KvHintFormat::is_none")]
    pub hints: KvHintFormat,
}

impl Default for KvLoad {
    fn default() -> Self {
        KvLoad {
            bytes_per_token: 131_072,
            cpu_gb_per_s: 25.0,
            disk_gb_per_s: 3.0,
            hints: KvHintFormat::None,
        }
    }
}

/// Which wire form of a fetch hint a replica's engine takes (`proxy/kv_hint.rs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KvHintFormat {
    /// Takes no hint: never told to fetch. The default.
    #[default]
    None,
    /// vLLM's top-level `kv_hints` field: a `KvHintsEnvelope` with one `kv.fetch@1.0` action
    /// (vllm-project/vllm#53423, RFC #53421).
    VllmEnvelope,
    /// llm-d's `kv_transfer_params.remote_kv_source` (llm-d-router#1929, #2409).
    LlmD,
}

impl KvHintFormat {
    /// No hint (serde's `skip_serializing_if`).
    pub fn is_none(&self) -> bool {
        *self == KvHintFormat::None
    }
}

/// Why a [`KvLoad`] was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum KvLoadError {
    /// `bytes_per_token` is 0 or above [`MAX_BYTES_PER_TOKEN`].
    #[error("kv_load.bytes_per_token must be 1..={MAX_BYTES_PER_TOKEN}, got {0}")]
    BytesPerToken(u32),
    /// A bandwidth is not finite or outside [`GB_PER_S_RANGE`].
    #[error("kv_load.{0} must be between 0.01 and 10000 GB/s, got {1}")]
    Bandwidth(&'static str, f64),
}

impl KvLoad {
    /// Checks the bounds (config and gossip both call it).
    pub fn validate(&self) -> Result<(), KvLoadError> {
        if self.bytes_per_token == 0 || self.bytes_per_token > MAX_BYTES_PER_TOKEN {
            return Err(KvLoadError::BytesPerToken(self.bytes_per_token));
        }
        for (name, v) in [
            ("cpu_gb_per_s", self.cpu_gb_per_s),
            ("disk_gb_per_s", self.disk_gb_per_s),
        ] {
            if !GB_PER_S_RANGE.contains(&v) {
                return Err(KvLoadError::Bandwidth(name, v));
            }
        }
        Ok(())
    }

    /// Seconds to load `tokens` tokens of KV from a tier with this bandwidth (GB/s).
    pub fn load_s(&self, tokens: u64, gb_per_s: f64) -> f64 {
        tokens as f64 * f64::from(self.bytes_per_token) / (gb_per_s.max(1e-9) * 1e9)
    }

    /// The share of a block's prefill a hit in a tier of this bandwidth saves on a replica
    /// prefilling `prefill_tokens_per_s`: `1 − load time / recompute time`, in
    /// [`MIN_TIER_WEIGHT`]..=1.
    #[inline]
    pub fn weight(&self, prefill_tokens_per_s: f64, gb_per_s: f64) -> f64 {
        let w = 1.0
            - f64::from(self.bytes_per_token) * prefill_tokens_per_s.max(1.0)
                / (gb_per_s.max(1e-9) * 1e9);
        if w.is_nan() {
            return MIN_TIER_WEIGHT;
        }
        w.clamp(MIN_TIER_WEIGHT, 1.0)
    }

    /// The (CPU, disk) weights for a replica prefilling `prefill_tokens_per_s` (a GPU block has
    /// nothing to load: it keeps the node's GPU weight).
    #[inline]
    pub fn weights(&self, prefill_tokens_per_s: f64) -> (f64, f64) {
        (
            self.weight(prefill_tokens_per_s, self.cpu_gb_per_s),
            self.weight(prefill_tokens_per_s, self.disk_gb_per_s),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(cpu: f64) -> KvLoad {
        KvLoad {
            cpu_gb_per_s: cpu,
            ..KvLoad::default()
        }
    }

    #[test]
    fn weight_is_one_minus_load_over_recompute() {
        // 8B on an H100: 131,072 B/token at 50,000 tokens/s is 6.55 GB/s of recompute.
        let w = load(50.0).weight(50_000.0, 50.0);
        assert!((w - (1.0 - 6.5536 / 50.0)).abs() < 1e-12, "{w}");
        // Loading at exactly the recompute rate saves nothing.
        assert!(load(6.5536).weight(50_000.0, 6.5536).abs() < 1e-12);
    }

    #[test]
    fn a_link_slower_than_recompute_makes_a_hit_cost_more_than_none() {
        let l = load(5.0);
        let w = l.weight(50_000.0, 5.0);
        assert!(w < 0.0, "{w}");
        // The weighted cost of one such block equals its load time.
        let compute_s = 16.0 / 50_000.0;
        let load_s = l.load_s(16, 5.0);
        assert!(((1.0 - w) * compute_s - load_s).abs() < 1e-12);
        // Absurd links stop at the floor; nothing exceeds 1.
        assert_eq!(l.weight(1e7, 0.01), MIN_TIER_WEIGHT);
        let fast = l.weight(1.0, 10_000.0);
        assert!(fast > 0.999_99 && fast <= 1.0, "{fast}");
    }

    #[test]
    fn bounds_are_checked() {
        assert_eq!(KvLoad::default().validate(), Ok(()));
        let bad = [
            KvLoad {
                bytes_per_token: 0,
                ..KvLoad::default()
            },
            KvLoad {
                bytes_per_token: MAX_BYTES_PER_TOKEN + 1,
                ..KvLoad::default()
            },
            load(0.0),
            load(f64::NAN),
            load(f64::INFINITY),
            KvLoad {
                disk_gb_per_s: 20_000.0,
                ..KvLoad::default()
            },
        ];
        for b in bad {
            assert!(b.validate().is_err(), "{b:?}");
        }
    }
}
