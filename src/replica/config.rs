//! Configuration of one simulated replica: what a TOML `--config` file holds, with CLI flags
//! overriding it (`args.rs` layers the flags on top).

use serde::{Deserialize, Serialize};

use crate::engine_sim::EngineConfig;

use super::faults::FaultConfig;
use super::pd::PdSimConfig;

/// Most data-parallel ranks a simulated replica runs (as many as a node follows per replica).
pub const MAX_DP_RANKS: u16 = 64;

/// Everything a replica needs to run. All fields have defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicaConfig {
    /// Name reported in `x-kvmesh-replica`. Default "replica".
    pub id: String,
    /// Interface to bind HTTP (and KV events) on. Default "127.0.0.1".
    pub host: String,
    /// HTTP port; 0 picks a free one. Default 0.
    pub port: u16,
    /// Served model name (`/v1/models`, responses, metric label). Default "sim-llama-8b".
    pub model: String,
    /// The engine model. Default: the 8B-on-H100 preset.
    pub engine: EngineConfig,
    /// Largest accepted request body; bigger ones get 413. Default 8 MiB.
    pub max_body_bytes: usize,
    /// `max_tokens` when a request gives none. Default 16.
    pub default_max_tokens: u32,
    /// KV events over ZMQ; `None` (the default) disables them.
    pub kv_events: Option<KvEventsConfig>,
    /// Data-parallel ranks: this many independent engines (each with `engine`'s capacity and
    /// batch) behind one address, as vLLM's `--data-parallel-size`. Rank r publishes its KV
    /// events on `kv_events.port + r` (replay port + r). A request names its rank with the
    /// `X-data-parallel-rank` header (vLLM) or a `data_parallel_rank` body field (SGLang);
    /// otherwise the replica's own balancer picks the rank with the fewest requests in flight
    /// (round-robin among equals), like vLLM's internal DP load balancer. 1..=64; default 1.
    pub dp_ranks: u16,
    /// Fault injection; all off by default.
    pub faults: FaultConfig,
    /// Prefill/decode disaggregation: role, KV bytes per token, link (`pd.rs`). Default: a
    /// `both` replica.
    pub pd: PdSimConfig,
    /// Whether the crash fault exits the process (true, the CLI's behaviour) or only stops this
    /// replica (false, for replicas run inside tests). Default true.
    pub exit_on_crash: bool,
}

impl Default for ReplicaConfig {
    fn default() -> Self {
        Self {
            id: "replica".into(),
            host: "127.0.0.1".into(),
            port: 0,
            model: "sim-llama-8b".into(),
            engine: EngineConfig::default(),
            max_body_bytes: 8 << 20,
            default_max_tokens: 16,
            kv_events: None,
            dp_ranks: 1,
            faults: FaultConfig::default(),
            pd: PdSimConfig::default(),
            exit_on_crash: true,
        }
    }
}

/// vLLM-style KV event publication (`--kv-events-config` equivalent).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvEventsConfig {
    /// PUB port; 0 picks a free one. Default 0.
    pub port: u16,
    /// ROUTER replay port; 0 picks a free one; `None` disables replay. Default `Some(0)`.
    pub replay_port: Option<u16>,
    /// Topic frame. Default "" (vLLM's default).
    pub topic: String,
    /// Batches kept for replay. Default 10,000 (vLLM's `buffer_steps`).
    pub buffer_steps: usize,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            port: 0,
            replay_port: Some(0),
            topic: String::new(),
            buffer_steps: 10_000,
        }
    }
}
