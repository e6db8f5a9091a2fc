//! `[pd]`: prefill/decode disaggregation, i.e. which protocol hands a request's KV cache from a
//! prefill replica to a decode replica, and when not to split a request at all.
//!
//! Off unless `protocol` is set: a node then routes every request whole, to replicas whose role
//! is `both` or `decode`. The protocols are the engines' own (`docs/pd.md` names the versions
//! followed); the node only rewrites the request bodies as each protocol says.

use serde::Deserialize;

use super::error::{invalid, ConfigError};
use crate::core::pd::PdConfig;

/// Which KV hand-over protocol the fleet's engines speak.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
pub enum PdProtocol {
    /// SGLang's bootstrap: `bootstrap_host`, `bootstrap_port`, `bootstrap_room` injected into
    /// the body, sent to the prefill and the decode replica at once.
    #[serde(rename = "sglang")]
    Sglang,
    /// vLLM's NixlConnector: the prefill first (`max_tokens: 1`, `kv_transfer_params`
    /// `do_remote_decode`), then the decode with the `kv_transfer_params` the prefill returned.
    #[serde(rename = "vllm-nixl")]
    VllmNixl,
    /// vLLM's MooncakeConnector: as NIXL, with a `transfer_id` the node picks and the decode
    /// told the prefill's `remote_bootstrap_addr` and `remote_engine_id`.
    #[serde(rename = "vllm-mooncake")]
    VllmMooncake,
}

impl PdProtocol {
    /// The protocol its label names (`sglang`, `vllm-nixl`, `vllm-mooncake`).
    pub fn parse(label: &str) -> Option<Self> {
        [Self::Sglang, Self::VllmNixl, Self::VllmMooncake]
            .into_iter()
            .find(|p| p.as_str() == label.trim())
    }

    /// Stable label (metrics, logs).
    pub fn as_str(self) -> &'static str {
        match self {
            PdProtocol::Sglang => "sglang",
            PdProtocol::VllmNixl => "vllm-nixl",
            PdProtocol::VllmMooncake => "vllm-mooncake",
        }
    }
}

/// Longest prompt the bypass may leave uncached (tokens): beyond a long prompt, the setting
/// means "never disaggregate", which is what leaving `protocol` unset says.
pub const MAX_BYPASS_UNCACHED_TOKENS: u64 = 1 << 20;

/// Longest prefill leg allowed (ms): an hour; a prefill is seconds even for huge prompts.
pub const MAX_PREFILL_TIMEOUT_MS: u64 = 3_600_000;

/// `[pd]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PdSection {
    /// The hand-over protocol; none = no disaggregation. Default none.
    pub protocol: Option<PdProtocol>,
    /// Send a request whole to the replica the router picks for it when that leaves fewer than
    /// this many prompt tokens uncached there (0 = never). Default 256.
    pub bypass_uncached_tokens: u64,
    /// The longest a prefill leg may take (ms) before it is abandoned and retried on another
    /// prefill replica (the sequential vLLM protocols), or the request fails. Default 60,000.
    pub prefill_timeout_ms: u64,
}

impl Default for PdSection {
    fn default() -> Self {
        PdSection {
            protocol: None,
            bypass_uncached_tokens: 256,
            prefill_timeout_ms: 60_000,
        }
    }
}

impl PdSection {
    /// Checks the numbers.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.bypass_uncached_tokens > MAX_BYPASS_UNCACHED_TOKENS {
            return Err(invalid(
                "pd.bypass_uncached_tokens",
                format!("at most {MAX_BYPASS_UNCACHED_TOKENS}"),
            ));
        }
        if self.prefill_timeout_ms == 0 || self.prefill_timeout_ms > MAX_PREFILL_TIMEOUT_MS {
            return Err(invalid(
                "pd.prefill_timeout_ms",
                format!("must be 1..={MAX_PREFILL_TIMEOUT_MS}"),
            ));
        }
        Ok(())
    }

    /// The core's pair-choice settings, when disaggregation is on.
    pub fn core(&self) -> Option<PdConfig> {
        self.protocol.map(|p| PdConfig {
            bypass_uncached_tokens: self.bypass_uncached_tokens,
            // An SGLang decode server runs nothing without a bootstrap room.
            whole_on_decode: p != PdProtocol::Sglang,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_by_default_and_each_protocol_parses_by_its_label() {
        let d: PdSection = toml::from_str("").unwrap();
        assert_eq!(d, PdSection::default());
        assert!(d.core().is_none());
        for p in [
            PdProtocol::Sglang,
            PdProtocol::VllmNixl,
            PdProtocol::VllmMooncake,
        ] {
            assert_eq!(PdProtocol::parse(p.as_str()), Some(p));
            let s: PdSection = toml::from_str(&format!("protocol = \"{}\"", p.as_str())).unwrap();
            assert_eq!(s.protocol, Some(p));
            let core = s.core().unwrap();
            assert_eq!(core.whole_on_decode, p != PdProtocol::Sglang);
            assert_eq!(core.bypass_uncached_tokens, 256);
        }
        assert!(toml::from_str::<PdSection>("protocol = \"nixl\"").is_err());
        let big = PdSection {
            bypass_uncached_tokens: MAX_BYPASS_UNCACHED_TOKENS + 1,
            ..PdSection::default()
        };
        assert!(big.validate().is_err());
    }
}
