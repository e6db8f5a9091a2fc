//! `[hold]`: holding a request at the node while the replica it goes to still computes the
//! prompt it was credited with (`core::hold`; docs/operations.md, "Bursts of one prompt").
//!
//! On by default. Each key is bounded here, and an error names it.

use std::time::Duration;

use serde::Deserialize;

use super::error::{invalid, ConfigError};
use crate::core::hold::HoldRule;

/// Most requests `max_held` may allow at once.
pub const MAX_HELD_LIMIT: u32 = 100_000;
/// Longest `max_wait_ms` (ms): 10 minutes.
pub const MAX_WAIT_LIMIT_MS: u64 = 600_000;

/// `[hold]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct HoldSection {
    /// Hold requests at all. Default true.
    pub enabled: bool,
    /// A request is held only when the prompt blocks it was credited with that are still being
    /// computed at its replica are at least this share of its prompt. In (0, 1]. Default 0.5.
    pub min_share: f64,
    /// Only prefills of at least this many uncached tokens are waited for, and only prompts of
    /// at least this many tokens are ridden on by requests that extend them
    /// (`RouterConfig::ride_extension_min_tokens`). Default 16,384: two of vLLM's and SGLang's
    /// default prefill chunks (8,192 tokens). Engines cache a prompt's blocks chunk by chunk as
    /// they schedule them, so a copy sent while a shorter prefill runs finds most of it cached
    /// and recomputes at most a chunk beside it; riding on it only queued requests behind it
    /// (a hot prefix's 8,192-token warm-up: the burst's window p99 0.201 s, 0.058 s without
    /// riding; docs/kv-transfer.md "Hot burst, live").
    pub min_prefill_tokens: u64,
    /// Added to the bound on the prefill's end (4 × its predicted prefill time after it was
    /// routed) before a held request goes anyway (ms). Default 1,000.
    pub margin_ms: u64,
    /// Longest a request is held (ms), whatever the prediction. 1..=600,000. Default 20,000.
    pub max_wait_ms: u64,
    /// Most requests held at once by the node; beyond, a request goes at once (counted as
    /// `full`). 1..=100,000. Default 256.
    pub max_held: u32,
    /// Most requests held at once for one replica. 1..=`max_held`. Default 64.
    pub max_held_per_replica: u32,
}

impl Default for HoldSection {
    fn default() -> Self {
        HoldSection {
            enabled: true,
            min_share: 0.5,
            min_prefill_tokens: 16_384,
            margin_ms: 1000,
            max_wait_ms: 20_000,
            max_held: 256,
            max_held_per_replica: 64,
        }
    }
}

impl HoldSection {
    /// Every key in range; the error names the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.min_share > 0.0 && self.min_share <= 1.0) {
            return Err(invalid(
                "hold.min_share",
                format!("must be in (0, 1], got {}", self.min_share),
            ));
        }
        if self.min_prefill_tokens > 1 << 32 {
            return Err(invalid(
                "hold.min_prefill_tokens",
                format!("must be at most 2^32, got {}", self.min_prefill_tokens),
            ));
        }
        if self.margin_ms > MAX_WAIT_LIMIT_MS {
            return Err(invalid(
                "hold.margin_ms",
                format!(
                    "must be at most {MAX_WAIT_LIMIT_MS}, got {}",
                    self.margin_ms
                ),
            ));
        }
        if !(1..=MAX_WAIT_LIMIT_MS).contains(&self.max_wait_ms) {
            return Err(invalid(
                "hold.max_wait_ms",
                format!(
                    "must be between 1 and {MAX_WAIT_LIMIT_MS}, got {}",
                    self.max_wait_ms
                ),
            ));
        }
        if !(1..=MAX_HELD_LIMIT).contains(&self.max_held) {
            return Err(invalid(
                "hold.max_held",
                format!(
                    "must be between 1 and {MAX_HELD_LIMIT}, got {}",
                    self.max_held
                ),
            ));
        }
        if !(1..=self.max_held).contains(&self.max_held_per_replica) {
            return Err(invalid(
                "hold.max_held_per_replica",
                format!(
                    "must be between 1 and hold.max_held ({}), got {}",
                    self.max_held, self.max_held_per_replica
                ),
            ));
        }
        Ok(())
    }

    /// The core's rule, with `tokens_per_block` to turn tokens into blocks.
    pub fn rule(&self, tokens_per_block: u32) -> HoldRule {
        let per = u64::from(tokens_per_block.max(1));
        HoldRule {
            enabled: self.enabled,
            min_share: self.min_share,
            min_blocks: u32::try_from(self.min_prefill_tokens.div_ceil(per)).unwrap_or(u32::MAX),
            margin: Duration::from_millis(self.margin_ms),
            max_wait: Duration::from_millis(self.max_wait_ms),
            max_held: self.max_held,
            max_held_per_replica: self.max_held_per_replica,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_range_keys_are_named() {
        for (s, key) in [
            (
                HoldSection {
                    min_share: 0.0,
                    ..HoldSection::default()
                },
                "hold.min_share",
            ),
            (
                HoldSection {
                    min_share: f64::NAN,
                    ..HoldSection::default()
                },
                "hold.min_share",
            ),
            (
                HoldSection {
                    max_wait_ms: 0,
                    ..HoldSection::default()
                },
                "hold.max_wait_ms",
            ),
            (
                HoldSection {
                    max_held: 0,
                    ..HoldSection::default()
                },
                "hold.max_held",
            ),
            (
                HoldSection {
                    max_held_per_replica: 300,
                    ..HoldSection::default()
                },
                "hold.max_held_per_replica",
            ),
            (
                HoldSection {
                    margin_ms: u64::MAX,
                    ..HoldSection::default()
                },
                "hold.margin_ms",
            ),
        ] {
            let e = s.validate().unwrap_err().to_string();
            assert!(e.contains(key), "{e} should name {key}");
        }
        assert!(HoldSection::default().validate().is_ok());
        assert_eq!(HoldSection::default().rule(16).min_blocks, 1024);
    }
}
