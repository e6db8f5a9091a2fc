//! The state every handler of one replica shares. Its own file so that the request steps
//! (`engine_call.rs`) and every family of handlers can use it without importing each other.

use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::{mpsc, watch, Notify};

use super::driver::Command;
use super::faults::Faults;
use super::metrics::Metrics;
use super::pd::{PdSimConfig, Transfers};
use super::responses::Store;
use super::tokenize_api::Served;

/// State shared by all handlers of one replica.
#[derive(Debug)]
pub struct Shared {
    /// Replica id for `x-kvmesh-replica`.
    pub id: String,
    /// Served model name.
    pub model: String,
    /// Longest model length, for `/v1/models`.
    pub max_model_len: usize,
    /// Body size limit in bytes.
    pub max_body_bytes: usize,
    /// Default `max_tokens`.
    pub default_max_tokens: u32,
    /// Channels to the engine drivers, one per data-parallel rank (at least one).
    pub drivers: Vec<mpsc::UnboundedSender<Command>>,
    /// Completion requests in flight per rank (the balancer's load signal).
    pub rank_in_flight: Vec<Arc<AtomicI64>>,
    /// Where the balancer's round-robin among equally loaded ranks goes next.
    pub next_rank: AtomicUsize,
    /// Metrics registry.
    pub metrics: Metrics,
    /// Fault state.
    pub faults: Arc<Faults>,
    /// Notified when fault settings change (wakes the listener).
    pub faults_changed: Arc<Notify>,
    /// Set to stop the replica (crash fault).
    pub stop: watch::Sender<bool>,
    /// Whether the crash fault exits the process.
    pub exit_on_crash: bool,
    /// Request id counter.
    pub next_id: AtomicU64,
    /// Completion requests in flight (`/load`).
    pub in_flight: Arc<AtomicI64>,
    /// Its own HTTP address (NIXL's `remote_host`/`remote_port` in a prefill's answer).
    pub addr: std::net::SocketAddr,
    /// The engine's time scale (transfer times shrink with it).
    pub time_scale: f64,
    /// Tokens per KV block (NIXL's `remote_block_ids`).
    pub block_tokens: usize,
    /// Disaggregation settings.
    pub pd: PdSimConfig,
    /// Prefill legs' hand-overs waiting for their decode replica.
    pub transfers: Transfers,
    /// Pulls a decode leg's KV from its prefill replica; made at the first decode leg (`None`
    /// if it could not be), so other replicas need no TLS provider.
    pub kv_client: std::sync::OnceLock<Option<reqwest::Client>>,
    /// Stored OpenAI Responses (`previous_response_id`, `GET /v1/responses/{id}`).
    pub responses: Store,
}

impl Shared {
    /// What the tokenizer endpoints need to know about the served model.
    pub fn served(&self) -> Served<'_> {
        Served {
            model: &self.model,
            max_model_len: self.max_model_len,
            default_max_tokens: self.default_max_tokens,
        }
    }

    /// A fresh id `<prefix>-<replica>-<n>` for an answer that runs no engine request.
    pub fn next_request_id(&self, prefix: &str) -> String {
        format!("{prefix}-{}-{}", self.id, self.next_engine_id())
    }

    /// A fresh engine request id (unique among this replica's requests).
    pub fn next_engine_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}
