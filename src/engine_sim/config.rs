//! Timing and capacity parameters of the engine model, with presets calibrated in
//! `../shared/reference/engine-timing.md` (§2: AIConfigurator H100 kernel tables, BLIS fits, vLLM
//! defaults). Step time, in ms: `a + b·P + e·Σ C·(p + C/2) + c·D + d·K` (the engine in `engine.rs` takes this config).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Engine parameters. `Default` is the 8B-on-one-H100 preset.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// `a`: fixed cost of one engine step in ms (one weight pass, launch, sampling). 8B: 7.5.
    pub step_overhead_ms: f64,
    /// `b`: cost per uncached prefill token in ms (GEMM slope). 8B: 0.019.
    pub prefill_ms_per_token: f64,
    /// `e`: prefill attention cost per query·key pair in ms; a chunk of C tokens after p tokens
    /// already in KV pays `e·C·(p + C/2)`, so cached tokens still cost attention. 8B: 7.5e-7.
    pub prefill_attention_ms_per_pair: f64,
    /// `c`: cost per decoding sequence in the step, in ms. 8B: 0.008.
    pub decode_ms_per_seq: f64,
    /// `d`: decode attention cost per context token read, in ms. 8B: 4.2e-5.
    pub decode_ms_per_context_token: f64,
    /// Token budget of one step (decodes count one each, prefill chunks fill the rest). vLLM on
    /// H100: 8192.
    pub max_num_batched_tokens: usize,
    /// Maximum running (admitted) sequences. vLLM on H100: 1024.
    pub max_num_seqs: usize,
    /// KV cache capacity in tokens. 8B on 80 GB: 450,000.
    pub kv_capacity_tokens: usize,
    /// Tokens per KV block. vLLM default: 16.
    pub block_tokens: usize,
    /// Longest accepted prompt + max_tokens. Default 131,072 (Llama 3.1's context).
    pub max_model_len: usize,
    /// Divides every modelled duration, to run faster than real time (0.001..=10,000). Default 1.
    pub time_scale: f64,
    /// Keep per-step KV event batches for `Engine::take_kv_batches`; off by
    /// default so that nobody has to drain them.
    pub record_kv_events: bool,
    /// CPU-tier capacity in tokens (vLLM's offloading connector, `cpu_tier.rs`): computed
    /// blocks are written through to host memory and a hit there is loaded back instead of
    /// recomputed. Default 0: no CPU tier.
    pub cpu_capacity_tokens: usize,
    /// KV bytes per token, all layers, for the CPU tier's load time (1..=4 MiB). Default
    /// 131,072: Llama-3.1-8B in BF16.
    pub kv_bytes_per_token: u32,
    /// Host-to-device link of the CPU tier in GB/s (0.01..=10,000). Default 25 (PCIe gen4 x16).
    pub cpu_gb_per_s: f64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Preset::Llama8bH100.config()
    }
}

/// Errors in an [`EngineConfig`].
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    /// A parameter is out of range.
    #[error("invalid engine config: {0}")]
    Invalid(&'static str),
}

impl EngineConfig {
    /// Checks the ranges the model relies on.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let costs = [
            self.step_overhead_ms,
            self.prefill_ms_per_token,
            self.prefill_attention_ms_per_pair,
            self.decode_ms_per_seq,
            self.decode_ms_per_context_token,
        ];
        if costs.iter().any(|c| !c.is_finite() || *c < 0.0) {
            return Err(ConfigError::Invalid("costs must be finite and >= 0"));
        }
        // Bounded so a step's wall duration (step ms ÷ scale) always fits a Duration.
        if !(1e-3..=1e4).contains(&self.time_scale) {
            return Err(ConfigError::Invalid(
                "time_scale must be between 0.001 and 10000",
            ));
        }
        if self.block_tokens == 0 || self.max_num_seqs == 0 || self.max_num_batched_tokens == 0 {
            return Err(ConfigError::Invalid(
                "block_tokens, max_num_seqs and max_num_batched_tokens must be > 0",
            ));
        }
        if self.kv_bytes_per_token == 0
            || self.kv_bytes_per_token > crate::core::kv_load::MAX_BYTES_PER_TOKEN
            || !crate::core::kv_load::GB_PER_S_RANGE.contains(&self.cpu_gb_per_s)
        {
            return Err(ConfigError::Invalid(
                "kv_bytes_per_token must be 1..=4 MiB and cpu_gb_per_s 0.01..=10000",
            ));
        }
        if self.kv_capacity_tokens < self.block_tokens {
            return Err(ConfigError::Invalid(
                "kv_capacity_tokens must hold one block",
            ));
        }
        Ok(())
    }

    /// Number of KV blocks.
    pub fn num_blocks(&self) -> usize {
        self.kv_capacity_tokens / self.block_tokens.max(1)
    }
}

/// Calibrated parameter sets (engine-timing.md §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Preset {
    /// Llama-3.1-8B, BF16, vLLM on one H100: TTFT 27/188 ms at 1k/8k tokens, ITL 7.6 ms at B=1.
    #[default]
    Llama8bH100,
    /// Llama-3.1-70B, BF16, vLLM TP4 on four H100s: TTFT 88/607 ms at 1k/8k, ITL 18.1 ms at B=1.
    Llama70bTp4,
}

impl Preset {
    /// The preset's parameters (time scale 1, KV events off).
    pub fn config(self) -> EngineConfig {
        let base = EngineConfig {
            step_overhead_ms: 7.5,
            prefill_ms_per_token: 0.019,
            prefill_attention_ms_per_pair: 7.5e-7,
            decode_ms_per_seq: 0.008,
            decode_ms_per_context_token: 4.2e-5,
            max_num_batched_tokens: 8192,
            max_num_seqs: 1024,
            kv_capacity_tokens: 450_000,
            block_tokens: 16,
            max_model_len: 131_072,
            time_scale: 1.0,
            record_kv_events: false,
            cpu_capacity_tokens: 0,
            kv_bytes_per_token: 131_072,
            cpu_gb_per_s: 25.0,
        };
        match self {
            Preset::Llama8bH100 => base,
            Preset::Llama70bTp4 => EngineConfig {
                step_overhead_ms: 18.0,
                prefill_ms_per_token: 0.068,
                prefill_attention_ms_per_pair: 9.5e-7,
                decode_ms_per_seq: 0.040,
                decode_ms_per_context_token: 2.7e-5,
                ..base
            },
        }
    }

    /// The served model name a replica advertises by default for this preset.
    pub fn model_name(self) -> &'static str {
        match self {
            Preset::Llama8bH100 => "sim-llama-8b",
            Preset::Llama70bTp4 => "sim-llama-70b",
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Preset::Llama8bH100 => "8b-h100",
            Preset::Llama70bTp4 => "70b-tp4",
        })
    }
}

impl FromStr for Preset {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "8b-h100" => Ok(Preset::Llama8bH100),
            "70b-tp4" => Ok(Preset::Llama70bTp4),
            other => Err(format!(
                "unknown preset {other:?} (expected 8b-h100 or 70b-tp4)"
            )),
        }
    }
}
