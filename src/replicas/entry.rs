//! One entry of the node's replica registry: a `[[replicas]]` table of the configuration, or
//! what a DNS source made of an address it found (`DnsConfig::replica` in `dns.rs`).

use serde::Deserialize;

use super::kv_events::KvEventsSource;
use crate::core::kv_load::KvLoad;
use crate::core::role::{PdFacts, Role};

/// One replica of the registry: a `[[replicas]]` table, or a replica a DNS source found.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaConfig {
    /// Base URL of its OpenAI-compatible API, e.g. `http://10.0.0.5:8000` (required).
    pub url: String,
    /// Stable id. Default: the URL's `host:port`.
    #[serde(default)]
    pub id: Option<String>,
    /// Region. Default: the node's region.
    #[serde(default)]
    pub region: Option<String>,
    /// Zone or rack. Default empty.
    #[serde(default)]
    pub zone: String,
    /// Pool. Default `shared`.
    #[serde(default = "default_pool")]
    pub pool: String,
    /// Models it serves. Default: discovered from its `/v1/models` by the health checks.
    #[serde(default)]
    pub models: Vec<String>,
    /// KV capacity in tokens. Default: from `vllm:cache_config_info` when scraped, else 450,000.
    #[serde(default)]
    pub capacity_tokens: Option<u64>,
    /// Prefill speed in tokens/s for the cost model. Default 50,000 (8B model on one H100).
    #[serde(default = "default_prefill_rate")]
    pub prefill_tokens_per_s: f64,
    /// Prefill attention in ms per query·key pair for the cost model: a prefill of C new tokens
    /// after p cached ones also pays `e·C·(p + C/2)` ms (0..=1e-4). Default 7.5e-7 (8B on one
    /// H100, `kvmesh replica --preset 8b-h100`; 70B on four: 9.5e-7); 0 prices by tokens alone.
    #[serde(default = "default_prefill_attention")]
    pub prefill_attention_ms_per_pair: f64,
    /// In-flight requests above which it counts as full. Default 256.
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: u32,
    /// Its part in prefill/decode disaggregation: `prefill`, `decode` or `both` (`docs/pd.md`).
    /// Default `both`.
    #[serde(default)]
    pub role: Role,
    /// A prefill replica's KV bootstrap port (SGLang, vLLM Mooncake). Default none: 8998.
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
    /// A prefill replica's vLLM Mooncake engine id (`remote_engine_id`), at most 64 bytes.
    /// Default "": the one its prefill answer names.
    #[serde(default)]
    pub engine_id: String,
    /// The engine's KV-event endpoints; when set, the replica's cache model follows its events
    /// while the stream is up. Default none (approximate model only).
    #[serde(default)]
    pub kv_events: Option<KvEventsSource>,
    /// KV size and offload bandwidths, to weigh CPU/disk hits by their load time:
    /// `kv_load = { bytes_per_token = 131072, cpu_gb_per_s = 25, disk_gb_per_s = 3 }` (each
    /// field defaults to the value shown). Default none: the node's fixed `tier_weights`.
    #[serde(default)]
    pub kv_load: Option<KvLoad>,
}

pub(super) fn default_pool() -> String {
    "shared".into()
}
pub(super) fn default_prefill_rate() -> f64 {
    50_000.0
}
pub(super) fn default_prefill_attention() -> f64 {
    crate::core::view::DEFAULT_PREFILL_ATTENTION_MS_PER_PAIR
}
pub(super) fn default_max_in_flight() -> u32 {
    256
}

/// KV capacity assumed for a replica until configured or scraped (tokens).
pub const DEFAULT_CAPACITY_TOKENS: u64 = 450_000;

impl ReplicaConfig {
    /// A replica with every default, at `url`.
    pub fn from_url(url: impl Into<String>) -> Self {
        ReplicaConfig {
            url: url.into(),
            id: None,
            region: None,
            zone: String::new(),
            pool: default_pool(),
            models: Vec::new(),
            capacity_tokens: None,
            prefill_tokens_per_s: default_prefill_rate(),
            prefill_attention_ms_per_pair: default_prefill_attention(),
            max_in_flight: default_max_in_flight(),
            role: Role::Both,
            bootstrap_port: None,
            engine_id: String::new(),
            kv_events: None,
            kv_load: None,
        }
    }

    /// Test fleets: replica `r{i}` of model `m` at `http://10.0.0.{i}:8000` (never dialled).
    #[cfg(test)]
    pub(crate) fn numbered(i: usize) -> Self {
        ReplicaConfig {
            id: Some(format!("r{i}")),
            models: vec!["m".into()],
            ..ReplicaConfig::from_url(format!("http://10.0.0.{i}:8000"))
        }
    }

    /// Its disaggregation facts, as the core keeps them.
    pub fn pd(&self) -> PdFacts {
        PdFacts {
            role: self.role,
            bootstrap_port: self.bootstrap_port,
            engine_id: self.engine_id.clone(),
        }
    }

    /// The id: configured, or the URL's authority.
    pub fn effective_id(&self) -> String {
        if let Some(id) = &self.id {
            return id.clone();
        }
        reqwest::Url::parse(&self.url)
            .ok()
            .and_then(|u| {
                u.host_str()
                    .map(|h| format!("{h}:{}", u.port_or_known_default().unwrap_or(80)))
            })
            .unwrap_or_else(|| self.url.clone())
    }
}
