//! Node configuration: a TOML file (`${NAME}` reads the environment, `env.rs`), with CLI flags for
//! the common case layered on top.
//!
//! Exists so that a node either starts fully and correctly configured or not at all: unknown keys
//! are refused (`deny_unknown_fields`), every value is validated, and every error names the key it
//! is about. Durations are plain integers with their unit in the key name (`_ms`, `_s`) so a
//! config file reads unambiguously without a duration grammar.

use crate::core::region_choice::ForwardChoice;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::core::cost::TierWeights;
use crate::core::hot_prefix::HotPrefixConfig;
use crate::core::policy::PolicyKind;
use crate::core::priority::{class_by_name, PrioritiesConfig, MAX_WEIGHT, MIN_WEIGHT};
use crate::core::tenants::TenantConfig;
use crate::tokenize::TokenizerConfig;

mod env;
pub mod error;
pub mod hold;
pub mod mesh;
pub mod otel;
pub mod pd;
pub mod picker;
pub mod server;

use error::invalid;
pub use error::ConfigError;
pub use mesh::{DistanceConfig, MeshSection};
pub use otel::TracingConfig;
pub use pd::{PdProtocol, PdSection};
pub use picker::PickerSection;
pub use server::{AuthConfig, Secrets, ServerConfig};
// The sections other subsystems own, assembled here (re-exported so that one path names every
// part of a node's configuration).
pub use crate::replicas::dns::{DnsConfig, DnsKvEvents, DnsRecord};
pub use crate::replicas::entry::{ReplicaConfig, DEFAULT_CAPACITY_TOKENS};
pub use crate::replicas::health::HealthConfig;
pub use crate::replicas::k8s::KubernetesConfig;
pub use crate::replicas::kv_events::{KvEventsSource, KvWatchConfig};
pub use crate::replicas::probe::ScrapeConfig;

/// Default `drop_departed_after_s`: flapping DNS answers bring a replica back within it
/// without rebuilding anything.
pub const DEFAULT_DROP_DEPARTED_AFTER_S: u64 = 30;

/// Longest duration any setting may name: 7 days.
pub const MAX_DURATION_MS: u64 = 7 * 86_400_000;

/// Largest `recompute_charge_per_s` and `evict_charge` (beyond it the replica holding a prefix
/// is never left).
pub const MAX_RECOMPUTE_CHARGE_PER_S: f64 = 1000.0;

/// Everything a node needs. Every field has a default, so an empty file plus `--replica` flags is
/// a working configuration.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeConfig {
    /// Address the HTTP front listens on. Default `127.0.0.1:8080`.
    pub listen: SocketAddr,
    /// The node's region. Default `default`.
    pub region: String,
    /// The node's zone or rack. Default empty.
    pub zone: String,
    /// Cluster id; seeds the Bloom filters (must match across a cluster). Default `kvmesh`.
    pub cluster_id: String,
    /// Routing policy name. Default `p2c-cache`.
    pub policy: String,
    /// Router RNG seed. Default 0.
    pub seed: u64,
    /// Routing-text block size in bytes (about 4 bytes per token). Default 256.
    pub block_bytes: usize,
    /// Largest accepted request body in bytes; larger gets 413. Default 32 MiB.
    pub max_body_bytes: usize,
    /// Adds `x-kvmesh-decision` (branch, hit, best hit on offer, predicted TTFT) to responses,
    /// for debugging routing. It tells a client what the node believes is cached, so keep it off
    /// where clients are not trusted. Default false.
    pub debug_headers: bool,
    /// Bearer token required by `/admin/*`, inline (prefer `auth.admin_token_file` or
    /// `KVMESH_ADMIN_TOKEN`, which beat it). Default none (see `[auth]`).
    pub admin_token: Option<String>,
    /// Client connection limits and HTTPS (`[server]`).
    pub server: ServerConfig,
    /// Tokens and API keys (`[auth]`).
    pub auth: AuthConfig,
    /// Header carrying the session id for affinity (the body's `user` is the fallback). Default
    /// `x-session-id`.
    pub session_header: String,
    /// More headers naming a session, read in order after `session_header` (and before the
    /// body's user id): what agents send. At most 16. Default `x-claude-code-session-id`,
    /// `session-id`, `session_id`, `x-session-affinity`.
    pub session_headers: Vec<String>,
    /// Header carrying an affinity key, e.g. the ids of a RAG request's documents: when no
    /// replica's cache holds more of the prompt than another's, requests with the same key go to
    /// the same replica (`RouteRequest::affinity_key`). Ignored when a session is named. Default
    /// `x-affinity-key`.
    pub affinity_header: String,
    /// Header carrying the tenant id. Default `x-tenant-id`.
    pub tenant_header: String,
    /// Forward to another region when every local queue exceeds this (seconds). Default 10.
    pub spill_after_s: f64,
    /// Which region a forwarded request goes to: `"cost"` (default: the least RTT + queue +
    /// prefill of what the region does not hold) or `"nearest"` (the nearest with room).
    pub forward_by: ForwardChoice,
    /// A prompt whose longest cached prefix is held only in another region: `"local"`
    /// (default: recompute it here), `"forward"` (or forward the request there when that is
    /// sooner) or `"weigh"` (or pull its KV to a local replica that takes hints, over the pair's
    /// link: `[[mesh.distance]]`'s `kv_gb_per_s`, else `[kv_fetch.links] cross_region`).
    pub remote_prefix: crate::core::remote_prefix::RemotePrefixMode,
    /// Seconds one outstanding request adds to a replica's predicted wait. Default 0.005.
    pub w_load_s: f64,
    /// Seconds credited to a session's preferred replica. Default 0.2 (see `CostModel`).
    pub affinity_credit_s: f64,
    /// `p2c-cache`: seconds charged to a replica that would recompute a prefix another holds,
    /// per second of extra prefill, per second of prefill queued on the average replica
    /// ([`crate::core::policy::P2cCache::recompute_charge_per_s`]). 0..=1000; default 0 (off).
    pub recompute_charge_per_s: f64,
    /// `p2c-cache`: seconds charged to a replica that would recompute a prefix another holds,
    /// per second of extra prefill, times how full its cache is
    /// ([`crate::core::policy::P2cCache::evict_charge`]). 0..=1000; default 8; 0 turns it off.
    pub evict_charge: f64,
    /// Share of a cached block's prefill the cost model credits by the tier the replica holds it
    /// in (known from KV events' `medium`), each 0..=1. Default
    /// `{ gpu = 1.0, cpu = 0.75, disk = 0.25 }`; keys left out keep their default.
    pub tier_weights: TierWeights,
    /// Pulling a prefix's KV from the replica that holds it (`[kv_fetch]`: `mode = "off"`
    /// (default), `"priced"` or `"reactive"`, link rates; `core::kv_fetch`). Only replicas whose
    /// `kv_load.hints` names a format are told to pull.
    pub kv_fetch: crate::core::kv_fetch::KvFetchConfig,
    /// How long a just-routed key counts in the overlay (seconds). Default 10.
    pub overlay_ttl_s: u64,
    /// Approximate cache model: a block not routed again within this long is presumed evicted
    /// (seconds). Default 600.
    pub cache_ttl_s: u64,
    /// How often changed cache summaries are copied into the view (ms). Default 100.
    pub summary_interval_ms: u64,
    /// Upstream timeouts.
    pub timeouts: TimeoutConfig,
    /// Failover.
    pub retry: RetryConfig,
    /// Active health checks and passive outlier ejection.
    pub health: HealthConfig,
    /// Load scraping from the replicas' `/metrics`.
    pub scrape: ScrapeConfig,
    /// How long shutdown waits for in-flight requests (seconds). Default 30.
    pub drain_s: u64,
    /// The replicas this node routes to (static registry).
    pub replicas: Vec<ReplicaConfig>,
    /// DNS sources of replicas, re-resolved on their records' TTL. Default none.
    pub dns: Vec<DnsConfig>,
    /// Kubernetes sources of replicas: EndpointSlices, listed and watched. Default none.
    pub kubernetes: Vec<KubernetesConfig>,
    /// Per-tenant policies, by tenant id.
    pub tenants: HashMap<String, TenantConfig>,
    /// Policy for tenants not listed (and requests without a tenant).
    pub default_tenant: TenantConfig,
    /// Mesh membership (`[mesh]`); none means a single node. Default none.
    pub mesh: Option<MeshSection>,
    /// Token mode: the model's tokenizer and chat template, so request keys match the keys of
    /// engine KV events. Default none (text mode).
    pub tokenizer: Option<TokenizerConfig>,
    /// OpenTelemetry trace export of routed requests (`[tracing]`). Default off.
    pub tracing: TracingConfig,
    /// Prefill/decode disaggregation (`[pd]`, `docs/pd.md`). Default off.
    pub pd: PdSection,
    /// Hot-prefix detection and replication (`[hot_prefix]`, see `core::hot_prefix`):
    /// detection and warm-ups only with `enabled`. Default off.
    pub hot_prefix: HotPrefixConfig,
    /// How KV-event connections are watched for silence (`[kv_events]`: `heartbeat_ms`,
    /// `silence_ms`; see `replicas::kv_events`). Defaults 1000 and 5000 ms.
    pub kv_events: KvWatchConfig,
    /// Least time a replica that left the registry drains before it is dropped and its slot
    /// may be reused by another replica, in seconds (0..=86400; `node/registry.rs`). A replica
    /// back within it keeps its state. Default 30.
    pub drop_departed_after_s: u64,
    /// Priority classes and the admission queue (`[priorities]`): with it, a request that finds
    /// every eligible replica at its `max_in_flight`, or its tenant at a quota, waits in a
    /// bounded fair queue with a deadline instead of being sent (full replica) or refused
    /// (quota) at once. Default none (off).
    pub priorities: Option<PrioritiesConfig>,
    /// The Gateway API endpoint picker (`[picker]`: an Envoy ext_proc gRPC listener). Default
    /// off.
    pub picker: PickerSection,
    /// Holding a request while its replica still computes the prompt it rides on (`[hold]`).
    /// Default on.
    pub hold: hold::HoldSection,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            region: "default".into(),
            zone: String::new(),
            cluster_id: "kvmesh".into(),
            policy: PolicyKind::P2cCache.as_str().into(),
            seed: 0,
            block_bytes: crate::core::keys::DEFAULT_BLOCK_BYTES,
            max_body_bytes: 32 << 20,
            debug_headers: false,
            admin_token: None,
            server: ServerConfig::default(),
            auth: AuthConfig::default(),
            session_header: "x-session-id".into(),
            session_headers: [
                "x-claude-code-session-id",
                "session-id",
                "session_id",
                "x-session-affinity",
            ]
            .map(String::from)
            .to_vec(),
            affinity_header: "x-affinity-key".into(),
            tenant_header: "x-tenant-id".into(),
            spill_after_s: 10.0,
            forward_by: ForwardChoice::Cost,
            remote_prefix: crate::core::remote_prefix::RemotePrefixMode::Local,
            w_load_s: 0.005,
            affinity_credit_s: 0.2,
            recompute_charge_per_s: 0.0,
            evict_charge: crate::core::policy::DEFAULT_EVICT_CHARGE,
            tier_weights: TierWeights::default(),
            kv_fetch: crate::core::kv_fetch::KvFetchConfig::default(),
            overlay_ttl_s: 10,
            cache_ttl_s: 600,
            summary_interval_ms: 100,
            timeouts: TimeoutConfig::default(),
            retry: RetryConfig::default(),
            health: HealthConfig::default(),
            scrape: ScrapeConfig::default(),
            drain_s: 30,
            replicas: Vec::new(),
            dns: Vec::new(),
            kubernetes: Vec::new(),
            tenants: HashMap::new(),
            default_tenant: TenantConfig::default(),
            mesh: None,
            tokenizer: None,
            tracing: TracingConfig::default(),
            pd: PdSection::default(),
            hot_prefix: HotPrefixConfig::default(),
            kv_events: KvWatchConfig::default(),
            drop_departed_after_s: DEFAULT_DROP_DEPARTED_AFTER_S,
            priorities: None,
            picker: PickerSection::default(),
            hold: hold::HoldSection::default(),
        }
    }
}

/// Upstream timeouts, all in milliseconds.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TimeoutConfig {
    /// TCP connect to a replica. Default 2,000.
    pub connect_ms: u64,
    /// From sending a non-streamed request to the response headers (a non-streaming completion
    /// sends them only when done, hence the long default). Default 300,000.
    pub first_byte_ms: u64,
    /// The same for a streamed request (`"stream": true`), whose headers engines send before the
    /// prefill: a replica that accepts and never answers holds it this long before it is retried
    /// elsewhere and counted against the replica. At most half of `retry.budget_ms`, so a
    /// timed-out stream has budget left for another replica. A replica predicted to need
    /// longer waits twice its predicted time to first token instead, up to `first_byte_ms`.
    /// A replica that made progress during the wait (first bytes of requests before this one,
    /// at this node or its region peers) keeps the request for another wait of this length,
    /// up to `first_byte_ms`: queued behind other prompts is not stuck. Default 10,000.
    pub stream_first_byte_ms: u64,
    /// Longest silence inside a response body before the stream is cut. Default 60,000.
    pub idle_ms: u64,
    /// Longest silence between two chunks of a streamed answer once its first chunk came: past
    /// it the replica counts as hung and the stream continues elsewhere (`retry.stream_resumes`).
    /// An engine sends a chunk every decode step (tens of ms, under a second beside chunked
    /// prefills); a preempted request's recompute of a long context takes seconds. Default 20,000.
    pub stream_idle_ms: u64,
}

impl Default for TimeoutConfig {
    fn default() -> Self {
        TimeoutConfig {
            connect_ms: 2_000,
            first_byte_ms: 300_000,
            stream_first_byte_ms: 10_000,
            idle_ms: 60_000,
            stream_idle_ms: 20_000,
        }
    }
}

/// Failover of requests whose replica failed before the client saw a byte.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Attempts per request, the first included. Default 3.
    pub max_attempts: u32,
    /// No new attempt starts this long (ms) after the request arrived (with `[priorities]`,
    /// after it got its slot: waiting in the admission queue does not count). Default 30,000.
    pub budget_ms: u64,
    /// A streamed request with no response headers after this long (ms) is also sent to the
    /// next best replica; the first answer wins and the other is dropped. It costs a duplicate
    /// prefill per hedge, and a replica that only lost races is not ejected. 0 = off. Default 0.
    pub hedge_after_ms: u64,
    /// Times a streamed completions or chat answer whose replica fails (or goes silent past
    /// `timeouts.stream_idle_ms`) mid-stream is continued on another replica, from the text
    /// already sent; past it the stream ends with an error event. 0 = never. At most 16.
    /// Default 2. A resumable stream keeps its request's body until it ends: such bodies take
    /// at most a quarter of `server.max_buffered_body_bytes` at once, and a stream past that is
    /// relayed without resumes (`kvmesh_stream_resumes_total{outcome="body_not_kept"}`).
    pub stream_resumes: u32,
    /// The same for a non-streamed request, whose answer comes only when done: a slow or stuck
    /// replica no longer holds it for `timeouts.first_byte_ms`, and a long completion still
    /// finishes where it runs if it is first. Below `budget_ms`; at or past
    /// `timeouts.first_byte_ms` it never fires; 0 = off. Default 15,000.
    pub hedge_whole_after_ms: u64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            max_attempts: 3,
            budget_ms: 30_000,
            hedge_after_ms: 0,
            stream_resumes: 2,
            hedge_whole_after_ms: 15_000,
        }
    }
}

/// Where a discovery source's replica template is checked (`validate_replica` on the replica it
/// would make there).
const PLACEHOLDER: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 8000);

/// Most continuations of one stream (`retry.stream_resumes`): each costs a prefill of the
/// prompt and the text so far.
pub const MAX_STREAM_RESUMES: u32 = 16;

/// Largest config file read.
pub const MAX_CONFIG_BYTES: u64 = 4 << 20;

impl NodeConfig {
    /// Parses TOML text (unknown keys refused) and validates it.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        Self::parse(text, None)
    }

    /// Reads a config file (at most [`MAX_CONFIG_BYTES`]), replaces `${NAME}` with environment
    /// variables (`env.rs`), parses and validates it.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        use std::io::Read;
        let read_err = |source| ConfigError::Read {
            path: path.to_owned(),
            source,
        };
        let mut text = String::new();
        std::fs::File::open(path)
            .map_err(read_err)?
            .take(MAX_CONFIG_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(read_err)?;
        if text.len() as u64 > MAX_CONFIG_BYTES {
            return Err(read_err(std::io::Error::other(format!(
                "larger than {MAX_CONFIG_BYTES} bytes"
            ))));
        }
        let text = env::expand(&text, |name| std::env::var(name).ok())?;
        Self::parse(&text, Some(path.to_owned()))
    }

    fn parse(text: &str, origin: Option<PathBuf>) -> Result<Self, ConfigError> {
        let cfg: NodeConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            origin,
            message: e.to_string(),
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The routing policy.
    pub fn policy_kind(&self) -> Result<PolicyKind, ConfigError> {
        self.policy
            .parse()
            .map_err(|e: crate::core::policy::UnknownPolicy| invalid("policy", e.to_string()))
    }

    /// A first-byte timeout must leave the retry budget room for another replica: a stream
    /// that timed out at the budget's end was answered 502 instead of going elsewhere (issue
    /// #35). A hedge of a whole (non-streamed) request starts within the budget.
    fn validate_retry_fits_timeouts(&self) -> Result<(), ConfigError> {
        let (t, r) = (&self.timeouts, &self.retry);
        if r.max_attempts > 1 && t.stream_first_byte_ms.saturating_mul(2) > r.budget_ms {
            return Err(invalid(
                "timeouts.stream_first_byte_ms",
                format!(
                    "must be at most half of retry.budget_ms ({} ms), so a timed-out stream has budget left for another replica",
                    r.budget_ms
                ),
            ));
        }
        let hedge = r.hedge_whole_after_ms;
        if hedge > 0 && hedge >= r.budget_ms {
            return Err(invalid(
                "retry.hedge_whole_after_ms",
                format!(
                    "must be below retry.budget_ms ({} ms), or 0 (off)",
                    r.budget_ms
                ),
            ));
        }
        Ok(())
    }

    /// Checks every value; the first problem found is returned, naming its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_basics()?;
        self.validate_routing_numbers()?;
        self.validate_durations()?;
        self.validate_retry_and_health()?;
        self.validate_sources()?;
        self.validate_tenants()?;
        self.server.validate()?;
        self.auth.validate()?;
        if self.server.max_buffered_body_bytes < self.max_body_bytes as u64 {
            return Err(invalid(
                "server.max_buffered_body_bytes",
                "must be at least max_body_bytes (one largest body must fit)",
            ));
        }
        if let Some(m) = &self.mesh {
            m.validate()?;
        }
        self.tracing.validate()?;
        self.hold.validate()?;
        self.validate_upkeep()?;
        self.hot_prefix
            .validate()
            .map_err(|m| invalid("hot_prefix", m))?;
        if let Some(p) = &self.priorities {
            p.validate()
                .map_err(|(k, msg)| invalid(format!("priorities.{k}"), msg))?;
        }
        Ok(())
    }

    /// The routing basics: policy, P/D, region, sizes, the admin token, header names.
    fn validate_basics(&self) -> Result<(), ConfigError> {
        self.policy_kind()?;
        self.pd.validate()?;
        self.picker.validate()?;
        if self.region.is_empty() {
            return Err(invalid("region", "must not be empty"));
        }
        if self.block_bytes == 0 {
            return Err(invalid("block_bytes", "must be at least 1"));
        }
        if self.max_body_bytes == 0 {
            return Err(invalid("max_body_bytes", "must be at least 1"));
        }
        if self.admin_token.as_deref() == Some("") {
            return Err(invalid(
                "admin_token",
                "must not be empty (omit it instead)",
            ));
        }
        if self.session_headers.len() > 16 {
            return Err(invalid("session_headers", "at most 16 headers"));
        }
        for (key, v) in [
            ("session_header", &self.session_header),
            ("affinity_header", &self.affinity_header),
            ("tenant_header", &self.tenant_header),
        ]
        .into_iter()
        .chain(self.session_headers.iter().map(|h| ("session_headers", h)))
        {
            if axum::http::HeaderName::from_bytes(v.as_bytes()).is_err() {
                return Err(invalid(key, format!("'{v}' is not a valid header name")));
            }
        }
        Ok(())
    }

    /// The routing weights, credits and shares: finite and in range.
    fn validate_routing_numbers(&self) -> Result<(), ConfigError> {
        for (key, v) in [
            ("spill_after_s", self.spill_after_s),
            ("w_load_s", self.w_load_s),
            ("affinity_credit_s", self.affinity_credit_s),
            ("recompute_charge_per_s", self.recompute_charge_per_s),
            ("evict_charge", self.evict_charge),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(invalid(
                    key,
                    format!("must be a finite number ≥ 0, got {v}"),
                ));
            }
        }
        for (key, v) in [
            ("tier_weights.gpu", self.tier_weights.gpu),
            ("tier_weights.cpu", self.tier_weights.cpu),
            ("tier_weights.disk", self.tier_weights.disk),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(invalid(
                    key,
                    format!("must be between 0 and 1 (the share of a cached block's prefill saved), got {v}"),
                ));
            }
        }
        self.kv_fetch
            .validate()
            .map_err(|e| invalid("kv_fetch", e.to_string()))?;
        Ok(())
    }

    /// Every duration against one upper bound (so no sum of a time and a configured
    /// duration can overflow), and the ones that must not be zero.
    fn validate_durations(&self) -> Result<(), ConfigError> {
        // Every duration has one upper bound, so no sum of a time and a configured duration can
        // overflow (which panics) anywhere in the node.
        let mut durations_ms: Vec<(String, u64)> = vec![
            (
                "overlay_ttl_s".into(),
                self.overlay_ttl_s.saturating_mul(1000),
            ),
            ("cache_ttl_s".into(), self.cache_ttl_s.saturating_mul(1000)),
            ("drain_s".into(), self.drain_s.saturating_mul(1000)),
            ("summary_interval_ms".into(), self.summary_interval_ms),
            ("timeouts.connect_ms".into(), self.timeouts.connect_ms),
            ("timeouts.first_byte_ms".into(), self.timeouts.first_byte_ms),
            (
                "timeouts.stream_first_byte_ms".into(),
                self.timeouts.stream_first_byte_ms,
            ),
            ("timeouts.idle_ms".into(), self.timeouts.idle_ms),
            (
                "timeouts.stream_idle_ms".into(),
                self.timeouts.stream_idle_ms,
            ),
            ("retry.budget_ms".into(), self.retry.budget_ms),
            ("retry.hedge_after_ms".into(), self.retry.hedge_after_ms),
            (
                "retry.hedge_whole_after_ms".into(),
                self.retry.hedge_whole_after_ms,
            ),
            ("health.interval_ms".into(), self.health.interval_ms),
            ("health.timeout_ms".into(), self.health.timeout_ms),
            (
                "health.eject_backoff_ms".into(),
                self.health.eject_backoff_ms,
            ),
            (
                "health.max_eject_backoff_ms".into(),
                self.health.max_eject_backoff_ms,
            ),
            ("scrape.interval_ms".into(), self.scrape.interval_ms),
            ("scrape.timeout_ms".into(), self.scrape.timeout_ms),
        ];
        for (n, d) in self.dns.iter().enumerate() {
            durations_ms.push((format!("dns[{n}].min_refresh_ms"), d.min_refresh_ms));
            durations_ms.push((format!("dns[{n}].max_refresh_ms"), d.max_refresh_ms));
        }
        if let Some(m) = &self.mesh {
            durations_ms.push(("mesh.gossip_interval_ms".into(), m.gossip_interval_ms));
            durations_ms.push(("mesh.failure_detection_ms".into(), m.failure_detection_ms));
            durations_ms.push(("mesh.warmup_timeout_ms".into(), m.warmup_timeout_ms));
        }
        for (key, v) in durations_ms {
            if v > MAX_DURATION_MS {
                return Err(invalid(
                    key,
                    format!("at most {} days", MAX_DURATION_MS / 86_400_000),
                ));
            }
        }
        for (key, v) in [
            ("spill_after_s", self.spill_after_s),
            ("w_load_s", self.w_load_s),
            ("affinity_credit_s", self.affinity_credit_s),
        ] {
            if v > MAX_DURATION_MS as f64 / 1000.0 {
                return Err(invalid(key, "at most 7 days"));
            }
        }
        for (key, v) in [
            ("recompute_charge_per_s", self.recompute_charge_per_s),
            ("evict_charge", self.evict_charge),
        ] {
            if v > MAX_RECOMPUTE_CHARGE_PER_S {
                return Err(invalid(
                    key,
                    format!("at most {MAX_RECOMPUTE_CHARGE_PER_S}"),
                ));
            }
        }
        for (key, v) in [
            ("summary_interval_ms", self.summary_interval_ms),
            ("timeouts.connect_ms", self.timeouts.connect_ms),
            ("timeouts.first_byte_ms", self.timeouts.first_byte_ms),
            (
                "timeouts.stream_first_byte_ms",
                self.timeouts.stream_first_byte_ms,
            ),
            ("timeouts.idle_ms", self.timeouts.idle_ms),
            ("timeouts.stream_idle_ms", self.timeouts.stream_idle_ms),
            ("health.interval_ms", self.health.interval_ms),
            ("health.timeout_ms", self.health.timeout_ms),
            ("health.eject_backoff_ms", self.health.eject_backoff_ms),
            ("scrape.timeout_ms", self.scrape.timeout_ms),
        ] {
            if v == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        Ok(())
    }

    /// Retries and ejection: attempts, stream continuations, timeouts that leave budget for a
    /// retry, ejection thresholds and backoffs.
    fn validate_retry_and_health(&self) -> Result<(), ConfigError> {
        if self.retry.max_attempts == 0 {
            return Err(invalid("retry.max_attempts", "must be at least 1"));
        }
        if self.retry.stream_resumes > MAX_STREAM_RESUMES {
            return Err(invalid(
                "retry.stream_resumes",
                format!("at most {MAX_STREAM_RESUMES}"),
            ));
        }
        self.validate_retry_fits_timeouts()?;
        if self.health.unhealthy_after == 0 {
            return Err(invalid("health.unhealthy_after", "must be at least 1"));
        }
        if self.health.eject_after_failures == 0 {
            return Err(invalid("health.eject_after_failures", "must be at least 1"));
        }
        if self.health.max_eject_backoff_ms < self.health.eject_backoff_ms {
            return Err(invalid(
                "health.max_eject_backoff_ms",
                "must be at least health.eject_backoff_ms",
            ));
        }
        Ok(())
    }

    /// Where replicas come from: `[[replicas]]` (unique ids), the tokenizer, `[[dns]]`,
    /// `[[kubernetes]]`.
    /// KV events make a replica's cache model exact, but their keys are built from token ids:
    /// without `[tokenizer]` the node keys requests by text, so no request ever matches the
    /// exact model and only the overlay's last seconds count (issue #38: the Mooncake window's
    /// hit ratio fell from 0.143 to 0.065). Allowed (tests use it), but said once at start.
    fn warn_events_without_tokenizer(&self) {
        if self.tokenizer.is_some() {
            return;
        }
        if let Some(n) = self.replicas.iter().position(|r| r.kv_events.is_some()) {
            tracing::warn!(
                "replicas[{n}].kv_events is set but [tokenizer] is not: event keys (token ids) \
                 never match this node's text keys, so its exact cache models find no hits; \
                 add [tokenizer] (path = \"builtin:kvmesh-sim\" for kvmesh replica)"
            );
        }
    }

    fn validate_sources(&self) -> Result<(), ConfigError> {
        let mut ids = std::collections::HashSet::new();
        for (n, r) in self.replicas.iter().enumerate() {
            let prefix = format!("replicas[{n}]");
            validate_replica(&prefix, r)?;
            if !ids.insert(r.effective_id()) {
                return Err(invalid(
                    format!("{prefix}.id"),
                    format!("duplicate replica id '{}'", r.effective_id()),
                ));
            }
        }
        if let Some(t) = &self.tokenizer {
            if t.block_size == Some(0) {
                return Err(invalid("tokenizer.block_size", "must be at least 1"));
            }
        }
        self.warn_events_without_tokenizer();
        for (n, d) in self.dns.iter().enumerate() {
            let key = |f: &str| format!("dns[{n}].{f}");
            if d.name.is_empty() {
                return Err(invalid(key("name"), "must not be empty"));
            }
            if d.record == DnsRecord::A && d.port.is_none() {
                return Err(invalid(key("port"), "required when record = \"a\""));
            }
            if !matches!(d.scheme.as_str(), "http" | "https") {
                return Err(invalid(key("scheme"), "must be http or https"));
            }
            if d.min_refresh_ms == 0 {
                return Err(invalid(key("min_refresh_ms"), "must be at least 1"));
            }
            if d.max_refresh_ms < d.min_refresh_ms {
                return Err(invalid(
                    key("max_refresh_ms"),
                    "must be at least min_refresh_ms",
                ));
            }
            // The fields every found replica shares: checked on one at a placeholder address.
            validate_replica(&format!("dns[{n}]"), &d.replica(PLACEHOLDER))?;
        }
        for (n, k) in self.kubernetes.iter().enumerate() {
            k.validate()
                .map_err(|(field, msg)| invalid(format!("kubernetes[{n}].{field}"), msg))?;
            let found = crate::replicas::k8s::Found {
                id: PLACEHOLDER.to_string(),
                addr: PLACEHOLDER,
                zone: None,
                port_index: 0,
                ranks: 0,
            };
            validate_replica(&format!("kubernetes[{n}]"), &k.replica(&found))?;
        }
        Ok(())
    }

    /// Tenants and the default tenant: pools, quotas, KV shares.
    fn validate_tenants(&self) -> Result<(), ConfigError> {
        for (name, t) in self
            .tenants
            .iter()
            .map(|(n, t)| (format!("tenants.{n}"), t))
            .chain(std::iter::once((
                "default_tenant".to_owned(),
                &self.default_tenant,
            )))
        {
            if let Some(s) = t.max_cluster_share {
                if !(s > 0.0 && s <= 1.0) {
                    return Err(invalid(
                        format!("{name}.max_cluster_share"),
                        "must be in (0, 1]",
                    ));
                }
            }
            if let Some(s) = t.max_kv_share {
                if !(0.0..=1.0).contains(&s) {
                    return Err(invalid(format!("{name}.max_kv_share"), "must be in [0, 1]"));
                }
            }
            if let Some(w) = t.weight {
                if !(MIN_WEIGHT..=MAX_WEIGHT).contains(&w) {
                    return Err(invalid(format!("{name}.weight"), "must be in [0.01, 1000]"));
                }
            }
            for (field, class) in [("priority", &t.priority), ("max_priority", &t.max_priority)] {
                let Some(class) = class else { continue };
                let known = self
                    .priorities
                    .as_ref()
                    .is_some_and(|p| class_by_name(&p.classes, class).is_some());
                if !known {
                    return Err(invalid(
                        format!("{name}.{field}"),
                        "must name a class of [priorities] (and [priorities] must be set)",
                    ));
                }
            }
        }
        if self.default_tenant.max_kv_share.is_some() {
            // Unlisted tenants share one KV slot: a per-tenant share cannot be counted for them.
            return Err(invalid(
                "default_tenant.max_kv_share",
                "is per named tenant: set it under [tenants.<name>]",
            ));
        }
        let kv_named = self
            .tenants
            .values()
            .filter(|t| t.max_kv_share.is_some())
            .count();
        if kv_named > crate::core::tenants::KV_SLOTS - 2 {
            return Err(invalid(
                "tenants.<name>.max_kv_share",
                format!(
                    "at most {} tenants may have one ({kv_named} do)",
                    crate::core::tenants::KV_SLOTS - 2
                ),
            ));
        }
        Ok(())
    }

    /// Checks how engines are watched and departed replicas dropped (`[kv_events]`,
    /// `drop_departed_after_s`).
    fn validate_upkeep(&self) -> Result<(), ConfigError> {
        self.kv_events
            .validate()
            .map_err(|(k, msg)| invalid(format!("kv_events.{k}"), msg))?;
        if self.drop_departed_after_s > 86_400 {
            return Err(invalid("drop_departed_after_s", "must be at most 86400"));
        }
        Ok(())
    }

    /// Applies CLI flags over this config, then validates the result.
    pub fn apply_args(&mut self, args: &ServeArgs) -> Result<(), ConfigError> {
        if let Some(l) = args.listen {
            self.listen = l;
        }
        if let Some(r) = &args.region {
            self.region = r.clone();
        }
        if let Some(p) = &args.policy {
            self.policy = p.clone();
        }
        if let Some(s) = args.seed {
            self.seed = s;
        }
        if let Some(t) = &args.admin_token_file {
            self.auth.admin_token_file = Some(t.clone());
        }
        if !args.replica.is_empty() {
            // Flags replace the file's list: mixing the two would be surprising.
            self.replicas = args.replica.iter().map(ReplicaConfig::from_url).collect();
        }
        let mesh_flags = args.mesh_listen.is_some()
            || !args.seeds.is_empty()
            || args.certs_dir.is_some()
            || args.node_id.is_some();
        if mesh_flags {
            let m = self.mesh.get_or_insert_with(MeshSection::default);
            if let Some(l) = args.mesh_listen {
                m.listen = l;
            }
            if !args.seeds.is_empty() {
                m.seeds = args.seeds.clone();
            }
            if let Some(d) = &args.certs_dir {
                m.certs_dir = Some(d.clone());
                (m.ca, m.cert, m.key) = (None, None, None);
            }
            if let Some(id) = &args.node_id {
                m.node_id = id.clone();
            }
        }
        self.validate()
    }

    /// Builds the configuration from the CLI: the file (if any), then the flags.
    pub fn from_args(args: &ServeArgs) -> Result<Self, ConfigError> {
        let mut cfg = match &args.config {
            Some(path) => NodeConfig::from_file(path)?,
            None => NodeConfig::default(),
        };
        // OpenTelemetry's standard variables, read here at the edge only.
        cfg.tracing.apply_env(|k| std::env::var(k).ok());
        cfg.apply_args(args)?;
        // A mesh node may learn every replica from its peers' gossip.
        if cfg.replicas.is_empty()
            && cfg.dns.is_empty()
            && cfg.kubernetes.is_empty()
            && cfg.mesh.is_none()
        {
            return Err(invalid(
                "replicas",
                "no replica configured (use [[replicas]], [[dns]] or [[kubernetes]] in the config, or --replica URL)",
            ));
        }
        Ok(cfg)
    }

    /// `timeouts.connect_ms` as a duration.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.timeouts.connect_ms)
    }
}

/// Checks one replica's fields (`[[replicas]]` entries, and replicas added at run time); errors
/// name `prefix.field`.
pub fn validate_replica(prefix: &str, r: &ReplicaConfig) -> Result<(), ConfigError> {
    let key = |f: &str| format!("{prefix}.{f}");
    let url = reqwest::Url::parse(&r.url)
        .map_err(|e| invalid(key("url"), format!("'{}': {e}", r.url)))?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
        return Err(invalid(
            key("url"),
            format!("'{}' must be an http(s) URL with a host", r.url),
        ));
    }
    if r.id.as_deref() == Some("") {
        return Err(invalid(key("id"), "must not be empty (omit it instead)"));
    }
    let id = r.effective_id();
    let max = crate::mesh::schema::MAX_REPLICA_ID_BYTES;
    if id.len() > max {
        // It would route here, but its records, summaries and tips would never reach a peer.
        return Err(invalid(
            key("id"),
            format!(
                "'{id}' is {} bytes, over the {max} a mesh carries: set a shorter id",
                id.len()
            ),
        ));
    }
    if r.region.as_deref() == Some("") {
        return Err(invalid(
            key("region"),
            "must not be empty (omit it instead)",
        ));
    }
    if r.models.iter().any(String::is_empty) {
        return Err(invalid(key("models"), "model names must not be empty"));
    }
    if r.capacity_tokens == Some(0) {
        return Err(invalid(key("capacity_tokens"), "must be at least 1"));
    }
    if !r.prefill_tokens_per_s.is_finite() || r.prefill_tokens_per_s <= 0.0 {
        return Err(invalid(key("prefill_tokens_per_s"), "must be > 0"));
    }
    let e = r.prefill_attention_ms_per_pair;
    if !e.is_finite() || !(0.0..=crate::core::view::MAX_PREFILL_ATTENTION_MS_PER_PAIR).contains(&e)
    {
        return Err(invalid(
            key("prefill_attention_ms_per_pair"),
            "must be between 0 and 1e-4 (ms per query-key pair; 8B on one H100: 7.5e-7)",
        ));
    }
    if r.max_in_flight == 0 {
        return Err(invalid(key("max_in_flight"), "must be at least 1"));
    }
    if r.bootstrap_port == Some(0) {
        return Err(invalid(key("bootstrap_port"), "must be a port, 1-65535"));
    }
    if r.engine_id.len() > crate::core::role::MAX_ENGINE_ID_BYTES {
        return Err(invalid(
            key("engine_id"),
            format!("at most {} bytes", crate::core::role::MAX_ENGINE_ID_BYTES),
        ));
    }
    if let Some(kv) = &r.kv_events {
        kv.validate()
            .map_err(|(field, msg)| invalid(key(&format!("kv_events.{field}")), msg))?;
    }
    if let Some(load) = &r.kv_load {
        load.validate()
            .map_err(|e| invalid(key("kv_load"), e.to_string()))?;
    }
    Ok(())
}

/// `kvmesh serve` flags; each overrides the config file's value.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct ServeArgs {
    /// TOML config file (see config/node.toml).
    #[arg(long, short = 'c')]
    pub config: Option<PathBuf>,
    /// Listen address, e.g. 127.0.0.1:8080.
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Replica base URL; repeat for several. Replaces the config file's replicas.
    #[arg(long = "replica", value_name = "URL")]
    pub replica: Vec<String>,
    /// The node's region.
    #[arg(long)]
    pub region: Option<String>,
    /// Routing policy (p2c-cache, lmetric, cache-argmin, sglang-threshold, chwbl, p2c, least-load,
    /// round-robin, random).
    #[arg(long)]
    pub policy: Option<String>,
    /// Router RNG seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// File holding the bearer token for /admin/* (sets `auth.admin_token_file`; the
    /// `KVMESH_ADMIN_TOKEN` environment variable beats it). Never on the command line: `ps`
    /// shows it.
    #[arg(long, value_name = "FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// Join the mesh: UDP address of this node's QUIC endpoint (sets `mesh.listen`).
    #[arg(long, value_name = "ADDR")]
    pub mesh_listen: Option<SocketAddr>,
    /// Mesh seed (`ip:port`, `host:port` or `srv:<name>`); repeat for several. Replaces
    /// `mesh.seeds`.
    #[arg(long = "mesh-seed", value_name = "ADDR")]
    pub seeds: Vec<String>,
    /// Directory made by `kvmesh certs` (sets `mesh.certs_dir`; the certificate name is the node
    /// id unless `mesh.cert_name` says otherwise).
    #[arg(long, value_name = "DIR")]
    pub certs_dir: Option<PathBuf>,
    /// This node's mesh id (sets `mesh.node_id`).
    #[arg(long)]
    pub node_id: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replicas::kv_events::RankRouting;

    #[test]
    fn durations_that_would_overflow_are_refused() {
        for (text, key) in [
            ("overlay_ttl_s = 18446744073709551615", "overlay_ttl_s"),
            ("[health]\neject_backoff_ms = 18446744073709551615\nmax_eject_backoff_ms = 18446744073709551615", "health.eject_backoff_ms"),
            ("spill_after_s = 1e300", "spill_after_s"),
            ("recompute_charge_per_s = 1e6", "recompute_charge_per_s"),
            ("recompute_charge_per_s = -1.0", "recompute_charge_per_s"),
            ("evict_charge = 1e6", "evict_charge"),
            ("evict_charge = -1.0", "evict_charge"),
            ("[timeouts]\nidle_ms = 18446744073709551615", "timeouts.idle_ms"),
        ] {
            let e = NodeConfig::from_toml(text).unwrap_err().to_string();
            assert!(e.contains(key), "{text}: {e}");
        }
    }

    #[test]
    fn a_replica_id_longer_than_a_mesh_carries_is_refused() {
        let long = "r".repeat(129);
        let text = format!("[[replicas]]\nurl = \"http://a:1\"\nid = \"{long}\"\n");
        let e = NodeConfig::from_toml(&text).unwrap_err().to_string();
        assert!(e.contains("replicas[0].id") && e.contains("128"), "{e}");
        let ok = format!(
            "[[replicas]]\nurl = \"http://a:1\"\nid = \"{}\"\n",
            &long[..128]
        );
        assert!(NodeConfig::from_toml(&ok).is_ok());
    }

    #[test]
    fn empty_config_is_valid_with_defaults() {
        let c = NodeConfig::from_toml("").unwrap();
        assert_eq!(c.block_bytes, 256);
        assert_eq!(c.policy_kind().unwrap(), PolicyKind::P2cCache);
    }

    #[test]
    fn unknown_keys_are_named() {
        let e = NodeConfig::from_toml("listen = \"127.0.0.1:1\"\nbogus_key = 1\n").unwrap_err();
        assert!(e.to_string().contains("bogus_key"), "{e}");
        let e = NodeConfig::from_toml("[timeouts]\nconect_ms = 5\n").unwrap_err();
        assert!(e.to_string().contains("conect_ms"), "{e}");
        let e = NodeConfig::from_toml("[[replicas]]\nurl = \"http://a:1\"\nmodel = [\"m\"]\n")
            .unwrap_err();
        assert!(e.to_string().contains("model"), "{e}");
    }

    #[test]
    fn bad_values_are_named() {
        for (toml, key) in [
            ("policy = \"fastest\"", "policy"),
            ("block_bytes = 0", "block_bytes"),
            ("[retry]\nmax_attempts = 0", "retry.max_attempts"),
            ("[retry]\nstream_resumes = 17", "retry.stream_resumes"),
            ("[timeouts]\nstream_idle_ms = 0", "timeouts.stream_idle_ms"),
            (
                "[auth]\nshared_system_prompts = [\"\"]",
                "auth.shared_system_prompts",
            ),
            // Issue #35: a stream's first-byte timeout equal to the budget left none for a retry.
            (
                "[timeouts]\nstream_first_byte_ms = 30000\n[retry]\nbudget_ms = 30000",
                "timeouts.stream_first_byte_ms",
            ),
            (
                "[retry]\nbudget_ms = 30000\nhedge_whole_after_ms = 30000",
                "retry.hedge_whole_after_ms",
            ),

            ("[[replicas]]\nurl = \"not a url\"", "replicas[0].url"),
            (
                "[[replicas]]\nurl = \"http://a:1\"\nprefill_attention_ms_per_pair = -1e-7",
                "replicas[0].prefill_attention_ms_per_pair",
            ),
            (
                "[[replicas]]\nurl = \"http://a:1\"\nprefill_attention_ms_per_pair = 0.5",
                "replicas[0].prefill_attention_ms_per_pair",
            ),
            (
                "[[replicas]]\nurl = \"http://a:1\"\n[[replicas]]\nurl = \"http://a:1\"",
                "replicas[1].id",
            ),
            (
                "[tenants.acme]\nmax_cluster_share = 2.0",
                "tenants.acme.max_cluster_share",
            ),
            (
                "[tenants.acme]\nmax_kv_share = 1.5",
                "tenants.acme.max_kv_share",
            ),
            (
                "[tenants.acme]\nmax_kv_share = -0.1",
                "tenants.acme.max_kv_share",
            ),
            (
                "[default_tenant]\nmax_kv_share = 0.5",
                "default_tenant.max_kv_share",
            ),
            ("[tenants.acme]\npriority = \"critical\"", "tenants.acme.priority"),
            (
                "[priorities]\n[tenants.acme]\nmax_priority = \"gold\"",
                "tenants.acme.max_priority",
            ),
            ("[priorities]\n[tenants.acme]\nweight = 0", "tenants.acme.weight"),
            ("[priorities]\ndefault_class = \"gold\"", "priorities.default_class"),
            ("[priorities]\nclasses = []", "priorities.classes"),
            (
                "[priorities]\nclasses = [{ name = \"a\" }, { name = \"a\" }]",
                "priorities.classes[1].name",
            ),
            (
                "[priorities]\ndefault_class = \"a\"\nclasses = [{ name = \"a\", max_wait_ms = 0 }]",
                "priorities.classes[0].max_wait_ms",
            ),
            ("[priorities]\nheader = \"x y\"", "priorities.header"),
            ("listen = \"nowhere\"", "listen"),
            ("[kv_events]\nheartbeat_ms = 10", "kv_events.heartbeat_ms"),
            ("[kv_events]\nheartbeat_ms = 1000\nsilence_ms = 1500", "kv_events.silence_ms"),
            ("[kv_events]\nsilence_ms = 700000", "kv_events.silence_ms"),
            ("[kv_events]\nping_ms = 1", "ping_ms"),
            ("drop_departed_after_s = 86401", "drop_departed_after_s"),
            ("[[dns]]\nname = \"x.\"\nrecord = \"a\"", "dns[0].port"),
            ("[[dns]]\nname = \"x.\"\nrecord = \"mx\"", "record"),
            (
                "[[kubernetes]]\nnamespace = \"serving\"",
                "kubernetes[0].service",
            ),
            (
                "[[kubernetes]]\nnamespace = \"s\"\nservice = \"v\"\nmax_backoff_ms = 1",
                "kubernetes[0].max_backoff_ms",
            ),
            (
                "[[kubernetes]]\nnamespace = \"s\"\nservce = \"v\"",
                "servce",
            ),
            (
                "[[kubernetes]]\nnamespace = \"s\"\nservice = \"v\"\nkv_events = { port = 5557, dp_ranks = 0 }",
                "kubernetes[0].kv_events.dp_ranks",
            ),
            (
                "[[kubernetes]]\nnamespace = \"s\"\nservice = \"v\"\nmax_in_flight = 0",
                "kubernetes[0].max_in_flight",
            ),
            (
                "[[dns]]\nname = \"x.\"\nrecord = \"srv\"\nmodels = [\"\"]",
                "dns[0].models",
            ),
        ] {
            let e = NodeConfig::from_toml(toml).unwrap_err().to_string();
            assert!(e.contains(key), "{toml:?} → {e}");
        }
    }

    #[test]
    fn kv_events_and_tokenizer_parse_and_are_checked() {
        let c = NodeConfig::from_toml(
            "[tokenizer]\npath = \"/m/tokenizer.json\"\nblock_size = 32\n[[replicas]]\nurl = \"http://a:1\"\nkv_events = { endpoint = \"tcp://a:5557\", replay = \"tcp://a:5558\", dp_ranks = 2 }\n",
        )
        .unwrap();
        let kv = c.replicas[0].kv_events.as_ref().unwrap();
        assert_eq!((kv.dp_ranks, kv.topic.as_str()), (2, ""));
        assert_eq!(c.tokenizer.as_ref().unwrap().block_size, Some(32));
        // Several ranks name the rank by header unless told otherwise; one rank never does.
        assert_eq!(kv.rank_routing(), RankRouting::Header);
        let body = NodeConfig::from_toml(
            "[[replicas]]\nurl = \"http://a:1\"\nkv_events = { endpoint = \"tcp://a:1\", dp_ranks = 4, rank_routing = \"body\" }",
        )
        .unwrap();
        let kv = body.replicas[0].kv_events.as_ref().unwrap();
        assert_eq!(kv.rank_routing(), RankRouting::Body);
        let one = NodeConfig::from_toml(
            "[[replicas]]\nurl = \"http://a:1\"\nkv_events = { endpoint = \"tcp://a:1\", rank_routing = \"header\" }",
        )
        .unwrap();
        let kv = one.replicas[0].kv_events.as_ref().unwrap();
        assert_eq!(kv.rank_routing(), RankRouting::Off);
        assert!(NodeConfig::from_toml(
            "[[replicas]]\nurl = \"http://a:1\"\nkv_events = { endpoint = \"tcp://a:1\", rank_routing = \"sideways\" }",
        )
        .is_err());
        for (toml, key) in [
            (
                "[[replicas]]\nurl = \"http://a:1\"\nkv_events = { endpoint = \"tcp://*:5557\" }",
                "replicas[0].kv_events.endpoint",
            ),
            (
                "[[replicas]]\nurl = \"http://a:1\"\nkv_events = { endpoint = \"tcp://a:1\", dp_ranks = 0 }",
                "replicas[0].kv_events.dp_ranks",
            ),
            ("[tokenizer]\npath = \"t\"\nblock_size = 0", "tokenizer.block_size"),
        ] {
            let e = NodeConfig::from_toml(toml).unwrap_err().to_string();
            assert!(e.contains(key), "{toml:?} → {e}");
        }
    }

    #[test]
    fn dns_sources_give_every_replica_they_find_its_kv_event_endpoints() {
        let c = NodeConfig::from_toml(
            "[[dns]]\nname = \"vllm.svc.\"\nkv_events = { port = 5557, replay_port = 5558, dp_ranks = 2 }\n",
        )
        .unwrap();
        let d = &c.dns[0];
        let v4 = d.replica(SocketAddr::from(([10, 1, 2, 3], 8000)));
        let kv = v4.kv_events.unwrap();
        assert_eq!(kv.endpoint, "tcp://10.1.2.3:5557");
        assert_eq!(kv.replay.as_deref(), Some("tcp://10.1.2.3:5558"));
        assert_eq!(
            kv.rank_endpoints().unwrap()[1],
            (
                "tcp://10.1.2.3:5558".into(),
                Some("tcp://10.1.2.3:5559".into())
            )
        );
        let v6 = d.replica("[fd00::7]:8000".parse().unwrap());
        assert_eq!(v6.kv_events.unwrap().endpoint, "tcp://[fd00::7]:5557");
        let none = NodeConfig::from_toml("[[dns]]\nname = \"vllm.svc.\"\n").unwrap();
        assert!(none.dns[0]
            .replica(SocketAddr::from(([10, 1, 2, 3], 8000)))
            .kv_events
            .is_none());
        for toml in [
            "[[dns]]\nname = \"v.\"\nkv_events = { port = 5557, dp_ranks = 0 }",
            "[[dns]]\nname = \"v.\"\nkv_events = { port = 65535, dp_ranks = 2 }",
        ] {
            let e = NodeConfig::from_toml(toml).unwrap_err().to_string();
            assert!(e.contains("dns[0].kv_events."), "{toml:?} → {e}");
        }
    }

    #[test]
    fn roles_come_from_replicas_and_discovery_sources_and_are_checked() {
        use crate::core::role::Role;
        let c = NodeConfig::from_toml(
            "[[replicas]]\nurl = \"http://10.0.0.1:8000\"\nrole = \"prefill\"\nbootstrap_port = 9000\nengine_id = \"e1\"\n\
             [[replicas]]\nurl = \"http://10.0.0.2:8000\"\n\
             [[dns]]\nname = \"decode.svc.\"\nrole = \"decode\"\n\
             [pd]\nprotocol = \"vllm-mooncake\"\n",
        )
        .unwrap();
        assert_eq!(c.replicas[0].pd().role, Role::Prefill);
        assert_eq!(c.replicas[0].pd().bootstrap_port, Some(9000));
        assert_eq!(c.replicas[0].pd().engine_id, "e1");
        assert_eq!(c.replicas[1].pd(), crate::core::role::PdFacts::default());
        let found = c.dns[0].replica(SocketAddr::from(([10, 1, 2, 3], 8000)));
        assert_eq!(found.role, Role::Decode);
        assert_eq!(c.pd.protocol, Some(PdProtocol::VllmMooncake));
        for (toml, key) in [
            (
                "[[replicas]]\nurl = \"http://h:1\"\nrole = \"leader\"",
                "role",
            ),
            (
                "[[replicas]]\nurl = \"http://h:1\"\nbootstrap_port = 0",
                "replicas[0].bootstrap_port",
            ),
            ("[pd]\nprotocol = \"nixl\"", "protocol"),
        ] {
            let e = NodeConfig::from_toml(toml).unwrap_err().to_string();
            assert!(e.contains(key), "{toml:?} → {e}");
        }
    }

    #[test]
    fn tier_weights_parse_default_and_are_checked() {
        let c = NodeConfig::from_toml("").unwrap();
        assert_eq!(c.tier_weights, TierWeights::default());
        assert_eq!(
            (c.tier_weights.gpu, c.tier_weights.cpu, c.tier_weights.disk),
            (1.0, 0.75, 0.25)
        );
        let c = NodeConfig::from_toml("tier_weights = { cpu = 0.5, disk = 0 }").unwrap();
        assert_eq!(
            (c.tier_weights.gpu, c.tier_weights.cpu, c.tier_weights.disk),
            (1.0, 0.5, 0.0),
            "keys left out keep their default"
        );
        let c = NodeConfig::from_toml("[tier_weights]\ngpu = 0.9\ncpu = 0.9\ndisk = 0.9").unwrap();
        assert_eq!(c.tier_weights.disk, 0.9);
        for (toml, key) in [
            ("tier_weights = { cpu = 1.5 }", "tier_weights.cpu"),
            ("tier_weights = { disk = -0.1 }", "tier_weights.disk"),
            ("tier_weights = { gpu = nan }", "tier_weights.gpu"),
            ("tier_weights = { ssd = 0.1 }", "ssd"),
            ("tier_weights = { cpu = \"high\" }", "tier_weights"),
        ] {
            let e = NodeConfig::from_toml(toml).unwrap_err().to_string();
            assert!(e.contains(key), "{toml:?} → {e}");
        }
        let e = NodeConfig::from_toml("tier_weights = { cpu = 1.5 }")
            .unwrap_err()
            .to_string();
        assert!(e.contains("between 0 and 1") && e.contains("1.5"), "{e}");
    }

    #[test]
    fn kv_fetch_parses_with_defaults_and_bad_links_name_the_key() {
        use crate::core::kv_fetch::FetchMode;
        use crate::core::kv_load::KvHintFormat;
        let c = NodeConfig::from_toml(
            "[kv_fetch]\nmode = \"priced\"\n[kv_fetch.links]\nsame_zone = { gb_per_s = 25, setup_ms = 2 }\n\
             [[replicas]]\nurl = \"http://a:1\"\nkv_load = { hints = \"llm-d\" }\n",
        )
        .unwrap();
        assert_eq!(c.kv_fetch.mode, FetchMode::Priced);
        assert_eq!(c.kv_fetch.links.same_zone.gb_per_s, 25.0);
        assert_eq!(
            c.kv_fetch.links.same_host.gb_per_s, 450.0,
            "others keep their default"
        );
        assert_eq!(
            c.replicas[0].kv_load.map(|l| l.hints),
            Some(KvHintFormat::LlmD)
        );
        assert_eq!(NodeConfig::default().kv_fetch.mode, FetchMode::Off);
        let e = NodeConfig::from_toml(
            "[kv_fetch.links]\ncross_region = { gb_per_s = 0, setup_ms = 1 }\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("kv_fetch.links.cross_region"), "{e}");
        assert!(NodeConfig::from_toml("[kv_fetch]\nmode = \"sometimes\"\n").is_err());
    }

    #[test]
    fn remote_prefix_parses_and_a_bad_value_names_the_key() {
        use crate::core::remote_prefix::RemotePrefixMode;
        assert_eq!(NodeConfig::default().remote_prefix, RemotePrefixMode::Local);
        let c = NodeConfig::from_toml("remote_prefix = \"weigh\"\n").unwrap();
        assert_eq!(c.remote_prefix, RemotePrefixMode::Weigh);
        let e = NodeConfig::from_toml("remote_prefix = \"pull\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("remote_prefix"), "{e}");
    }

    #[test]
    fn a_replica_kv_load_parses_with_defaults_and_is_checked_in_every_template() {
        use crate::core::kv_load::KvLoad;
        let c = NodeConfig::from_toml(
            "[[replicas]]\nurl = \"http://10.0.0.1:8000\"\nkv_load = { cpu_gb_per_s = 5 }\n",
        )
        .unwrap();
        assert_eq!(
            c.replicas[0].kv_load,
            Some(KvLoad {
                cpu_gb_per_s: 5.0,
                ..KvLoad::default()
            }),
            "fields left out keep their default"
        );
        let c = NodeConfig::from_toml("[[replicas]]\nurl = \"http://10.0.0.1:8000\"\n").unwrap();
        assert_eq!(c.replicas[0].kv_load, None);
        let c = NodeConfig::from_toml("[[dns]]\nname = \"v.\"\nkv_load = {}\n").unwrap();
        assert_eq!(
            c.dns[0].replica("10.0.0.9:8000".parse().unwrap()).kv_load,
            Some(KvLoad::default())
        );
        for (toml, key) in [
            (
                "[[replicas]]\nurl = \"http://a:1\"\nkv_load = { bytes_per_token = 0 }",
                "replicas[0].kv_load",
            ),
            (
                "[[replicas]]\nurl = \"http://a:1\"\nkv_load = { cpu_gb_per_s = 0 }",
                "replicas[0].kv_load",
            ),
            (
                "[[dns]]\nname = \"v.\"\nkv_load = { disk_gb_per_s = 1e9 }",
                "dns[0].kv_load",
            ),
            (
                "[[replicas]]\nurl = \"http://a:1\"\nkv_load = { nvme_gb_per_s = 1 }",
                "nvme_gb_per_s",
            ),
        ] {
            let e = NodeConfig::from_toml(toml).unwrap_err().to_string();
            assert!(e.contains(key), "{toml:?} → {e}");
        }
    }

    /// `serve` refuses a node without any replica source, and a `[[kubernetes]]` source is one.
    #[test]
    fn a_kubernetes_source_alone_is_a_replica_source() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.toml");
        let args = ServeArgs {
            config: Some(path.clone()),
            ..Default::default()
        };
        std::fs::write(&path, "").unwrap();
        let e = NodeConfig::from_args(&args).unwrap_err().to_string();
        assert!(e.contains("no replica configured"), "{e}");
        std::fs::write(
            &path,
            "[[kubernetes]]\nnamespace = \"serving\"\nservice = \"vllm\"\nport_name = \"http\"\n",
        )
        .unwrap();
        let cfg = NodeConfig::from_args(&args).unwrap();
        assert_eq!(
            cfg.kubernetes[0].selector(),
            "kubernetes.io/service-name=vllm"
        );
    }

    #[test]
    fn hot_prefix_parses_and_bad_values_name_the_key() {
        let c = NodeConfig::from_toml("[hot_prefix]\nenabled = true\nmin_rate = 20.0").unwrap();
        assert!(c.hot_prefix.enabled && c.hot_prefix.min_rate == 20.0);
        assert!(!NodeConfig::default().hot_prefix.enabled, "off by default");
        let e = NodeConfig::from_toml("[hot_prefix]\nbudget_share = 2.0")
            .unwrap_err()
            .to_string();
        assert!(e.contains("hot_prefix.budget_share"), "{e}");
        assert!(NodeConfig::from_toml("[hot_prefix]\nnope = 1").is_err());
    }

    #[test]
    fn the_shipped_example_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/node.toml");
        let c = NodeConfig::from_file(&path).unwrap();
        assert_eq!(c.replicas.len(), 2);
    }

    #[test]
    fn flags_override_the_file() {
        let mut c =
            NodeConfig::from_toml("region = \"us\"\n[[replicas]]\nurl = \"http://a:1\"").unwrap();
        let args = ServeArgs {
            region: Some("eu".into()),
            replica: vec!["http://b:2".into(), "http://c:3".into()],
            policy: Some("round-robin".into()),
            ..Default::default()
        };
        c.apply_args(&args).unwrap();
        assert_eq!(c.region, "eu");
        assert_eq!(c.replicas.len(), 2);
        assert_eq!(c.replicas[0].effective_id(), "b:2");
        let bad = ServeArgs {
            policy: Some("nope".into()),
            ..Default::default()
        };
        assert!(c
            .apply_args(&bad)
            .unwrap_err()
            .to_string()
            .contains("policy"));
    }
}
