//! The gossip state schema: which keys a node publishes in chitchat and how their values are
//! encoded.
//!
//! chitchat replicates string key-values. A value that does not fit one gossip message silently
//! blocks every later update of its node, forever, while the node still looks alive; so every
//! value here is small, and the encoder *refuses* anything over [`MAX_VALUE_BYTES`] instead of
//! letting it through. Big things (summary bodies) travel over QUIC streams (see `sync`), and
//! gossip carries only their version.
//!
//! Values are msgpack with field names (`rmp_serde::to_vec_named`), then base64 (chitchat values
//! are UTF-8 strings). Named fields make the schema evolvable: a newer node may add fields (older
//! ones ignore them) and every field added after version 1 must be `#[serde(default)]`.
//!
//! | key | published by | value | notes |
//! |---|---|---|---|
//! | `node` | every node | [`NodeRecord`]: `schema`, `region`, `zone`, `http_url`, `quic_addr`, `version`, `generation` | written once at start |
//! | `replica:<id>` | the replica's home node | [`ReplicaRecord`]: `url`, `region`, `zone`, `pool`, `models`, `capacity_tokens`, `prefill_tokens_per_s`, `max_in_flight`, `health`, `load` {`waiting`, `running`, `kv_usage`, `queued_prefill_tokens`}, `summary` {`epoch`, `seq`, `digest`}, `origin`, `kv_events`, `kv_shares` {KV-quota tenant → thousandths}, `pd` {`role`, `bootstrap_port`, `engine_id`} (absent = `both`) | `<id>` ≤ [`MAX_REPLICA_ID_BYTES`]; deleted when the node stops being home |
//! | `inflight` | every routing node | [`InflightRecord`]: `tenants` {shared-quota tenant → requests this node has in flight}; `counts` {replica id → requests} is read but no longer written (load sharing carries it) | non-zero counts only |
//! | `rload:<id>` | the replica's home node | `ReplicaLoadRecord` (`replica_load.rs`): the record's changing part (health, load, summary version, KV shares), one-letter names | at most once per `replica_load_interval_ms`; read over the member's `replica:<id>` |
//! | `rtt` | every node | [`RttRecord`]: `ms` {region → smoothed QUIC RTT in ms to the nearest live node of that region} | refreshed every few seconds |
//! | `hot` | every node with `[hot_prefix]` | `HotRecord` (`hot_record.rs`): `entries` [(first-k-block key, requests/s)] | ≤ 16 entries, rates finite in 0..=100,000 |
//! | `homes` | every node, after each round that changed its replica records | [`HomesRecord`]: `count` (replica records it publishes), `round` | chitchat delivers a node's keys in version order, so a peer holding `homes` holds every replica record written before it: `count` equal to the records received = caught up |
//!
//! Every decoder returns an error on malformed input (bad base64, bad msgpack, missing fields,
//! oversized strings) and never panics.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use base64::Engine as _;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::core::role::{PdFacts, Role, MAX_ENGINE_ID_BYTES};
use crate::core::view::{
    Health, ReplicaInfo, ReplicaLoad, DEFAULT_PREFILL_ATTENTION_MS_PER_PAIR,
    MAX_PREFILL_ATTENTION_MS_PER_PAIR,
};

/// Version of this schema, carried in [`NodeRecord::schema`].
pub const SCHEMA_VERSION: u32 = 1;
/// Largest encoded value (the base64 string chitchat carries), in bytes.
pub const MAX_VALUE_BYTES: usize = 1024;
/// Largest replica id, so `replica:<id>` keys stay small too.
pub const MAX_REPLICA_ID_BYTES: usize = 128;
/// Key of the node record.
pub const KEY_NODE: &str = "node";
/// Prefix of replica records.
pub const REPLICA_PREFIX: &str = "replica:";
/// Key of the in-flight record.
pub const KEY_INFLIGHT: &str = "inflight";
/// Key of the RTT record.
pub const KEY_RTT: &str = "rtt";
/// Key of the homes marker.
pub const KEY_HOMES: &str = "homes";

/// Bounds on the numbers a peer's records carry: a decoded value outside them is refused like a
/// malformed one (and counted by the reader), so nothing downstream sizes memory or loops by an
/// unchecked peer number. Generous against any real engine, tiny against `u64::MAX`.
pub mod bounds {
    /// Most KV capacity a replica record may claim, in tokens (2^32; cache models are clamped
    /// further, see `core::cache_model::MAX_CAPACITY_BLOCKS`).
    pub const MAX_CAPACITY_TOKENS: u64 = 1 << 32;
    /// Most prefill throughput a record may claim, tokens per second.
    pub const MAX_PREFILL_TOKENS_PER_S: f64 = 1e9;
    /// Most in-flight requests a record may allow, and most requests any count may claim
    /// (waiting, running, in flight, records published).
    pub const MAX_REQUESTS: u32 = 1 << 20;
    /// Most prompt tokens a record may claim queued for prefill.
    pub const MAX_QUEUED_TOKENS: u64 = 1 << 40;
    /// Most models a record may list.
    pub const MAX_MODELS: usize = 256;
    /// Highest KV usage a record may claim (a fraction; a little above 1 is rounding).
    pub const MAX_KV_USAGE: f32 = 1.5;
    /// Largest RTT a record may claim, in ms.
    pub const MAX_RTT_MS: f32 = 600_000.0;
    /// How far past this node's wall clock a summary epoch may be, in ms. Epochs are
    /// wall-clock milliseconds, bumped by one at each handover; a new home starts above every
    /// epoch it sees, so an unbounded one from a member would push every later home's there.
    pub const MAX_EPOCH_LEAD_MS: u64 = 86_400_000;
}

/// Wall-clock milliseconds, for the epoch bound.
pub(super) fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Errors encoding or decoding a gossip value.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    /// The encoded value would exceed [`MAX_VALUE_BYTES`]; it was not published.
    #[error("{what} value of {len} bytes exceeds the {MAX_VALUE_BYTES}-byte gossip limit")]
    TooLarge {
        /// Which record.
        what: &'static str,
        /// Encoded length.
        len: usize,
    },
    /// A replica id that is empty or longer than [`MAX_REPLICA_ID_BYTES`].
    #[error("invalid replica id {0:?} (1..={MAX_REPLICA_ID_BYTES} bytes)")]
    BadReplicaId(String),
    /// A decoded number outside its bound (see [`bounds`]).
    #[error("decode {what}: {field} = {value} is out of bounds")]
    OutOfBounds {
        /// Which record.
        what: &'static str,
        /// Which field.
        field: &'static str,
        /// The value, as text.
        value: String,
    },
    /// msgpack encoding failed.
    #[error("encode {what}: {source}")]
    Encode {
        /// Which record.
        what: &'static str,
        /// The cause.
        source: rmp_serde::encode::Error,
    },
    /// Not base64.
    #[error("decode {what}: bad base64: {source}")]
    Base64 {
        /// Which record.
        what: &'static str,
        /// The cause.
        source: base64::DecodeError,
    },
    /// Not the expected msgpack.
    #[error("decode {what}: {source}")]
    Decode {
        /// Which record.
        what: &'static str,
        /// The cause.
        source: rmp_serde::decode::Error,
    },
}

pub(super) fn encode<T: Serialize>(what: &'static str, v: &T) -> Result<String, SchemaError> {
    let bytes =
        rmp_serde::to_vec_named(v).map_err(|source| SchemaError::Encode { what, source })?;
    // Check the length before allocating the string: base64 grows by 4/3, rounded up.
    let len = bytes.len().div_ceil(3) * 4;
    if len > MAX_VALUE_BYTES {
        return Err(SchemaError::TooLarge { what, len });
    }
    Ok(base64::engine::general_purpose::STANDARD.encode(bytes))
}

pub(super) fn decode<T: DeserializeOwned>(what: &'static str, s: &str) -> Result<T, SchemaError> {
    // A peer's oversized value is refused before any parsing, like ours would have been.
    if s.len() > MAX_VALUE_BYTES {
        return Err(SchemaError::TooLarge { what, len: s.len() });
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(s)
        .map_err(|source| SchemaError::Base64 { what, source })?;
    rmp_serde::from_slice(&bytes).map_err(|source| SchemaError::Decode { what, source })
}

/// `Ok` when `ok`, else [`SchemaError::OutOfBounds`] for `field` = `value`.
pub(super) fn bound(
    what: &'static str,
    field: &'static str,
    ok: bool,
    value: impl std::fmt::Display,
) -> Result<(), SchemaError> {
    if ok {
        Ok(())
    } else {
        Err(SchemaError::OutOfBounds {
            what,
            field,
            value: value.to_string(),
        })
    }
}

/// The `node` record: who a node is and where to reach it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// Schema version the node writes ([`SCHEMA_VERSION`]).
    pub schema: u32,
    /// Region of the node.
    pub region: String,
    /// Zone or rack ("" when not set).
    pub zone: String,
    /// Base URL of the node's HTTP front (where requests may be forwarded).
    pub http_url: String,
    /// QUIC address for summary sync and block reports (the gossip address: one endpoint).
    pub quic_addr: SocketAddr,
    /// kvmesh version of the node.
    pub version: String,
    /// Generation (start time in ms); a restarted node has a larger one.
    pub generation: u64,
}

impl NodeRecord {
    /// Encodes for gossip; errors when over the limit.
    pub fn encode(&self) -> Result<String, SchemaError> {
        encode("node", self)
    }
    /// Decodes a peer's value.
    pub fn decode(s: &str) -> Result<Self, SchemaError> {
        decode("node", s)
    }
}

/// Health on the wire (the core's [`Health`] is not serde on purpose: the core has no wire).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WireHealth {
    /// Takes traffic.
    Healthy,
    /// Takes no traffic.
    Unhealthy,
    /// Finishing, takes nothing new.
    Draining,
}

impl From<Health> for WireHealth {
    fn from(h: Health) -> Self {
        match h {
            Health::Healthy => WireHealth::Healthy,
            Health::Unhealthy => WireHealth::Unhealthy,
            Health::Draining => WireHealth::Draining,
        }
    }
}

impl From<WireHealth> for Health {
    fn from(h: WireHealth) -> Self {
        match h {
            WireHealth::Healthy => Health::Healthy,
            WireHealth::Unhealthy => Health::Unhealthy,
            WireHealth::Draining => Health::Draining,
        }
    }
}

/// Engine load as scraped by the home node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WireLoad {
    /// Requests queued in the engine.
    pub waiting: u32,
    /// Requests running in the engine.
    pub running: u32,
    /// KV cache usage, 0..1.
    pub kv_usage: f32,
    /// Prompt tokens queued for prefill.
    pub queued_prefill_tokens: u64,
}

impl WireLoad {
    /// The core's load with this node's own in-flight count.
    pub fn to_load(&self, in_flight: u32) -> ReplicaLoad {
        ReplicaLoad {
            waiting: self.waiting,
            running: self.running,
            kv_usage: self.kv_usage,
            in_flight,
            peer_in_flight: 0,
            queued_prefill_tokens: self.queued_prefill_tokens,
            engine_excess: ReplicaLoad::excess_of(self.waiting, self.running, in_flight),
            engine_others: ReplicaLoad::excess_of(self.waiting, self.running, in_flight),
        }
    }
}

impl From<&ReplicaLoad> for WireLoad {
    fn from(l: &ReplicaLoad) -> Self {
        WireLoad {
            waiting: l.waiting,
            running: l.running,
            kv_usage: l.kv_usage,
            queued_prefill_tokens: l.queued_prefill_tokens,
        }
    }
}

/// Which summary the home node holds: peers pull when `(epoch, seq)` is newer than theirs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SummaryVersion {
    /// Summary epoch.
    pub epoch: u64,
    /// Sequence number within the epoch.
    pub seq: u64,
    /// `ReplicaSummary::digest` of the home's filter, to spot divergence.
    pub digest: u64,
}

/// A `replica:<id>` record, published by the replica's home node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplicaRecord {
    /// Base URL of the replica's OpenAI-compatible API.
    pub url: String,
    /// Region.
    pub region: String,
    /// Zone or rack.
    pub zone: String,
    /// Pool.
    pub pool: String,
    /// Models served.
    pub models: Vec<String>,
    /// KV capacity in tokens.
    pub capacity_tokens: u64,
    /// Predicted prefill tokens per second.
    pub prefill_tokens_per_s: f64,
    /// Prefill attention, ms per query·key pair (`ReplicaInfo::prefill_attention_ms_per_pair`).
    /// Added after version 1: absent reads as the default (the 8B preset's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_attention_ms_per_pair: Option<f64>,
    /// In-flight requests above which it counts as full.
    pub max_in_flight: u32,
    /// Health as the home node sees it.
    pub health: WireHealth,
    /// Load as the home node scraped it.
    pub load: WireLoad,
    /// Summary version held by the home node.
    pub summary: SummaryVersion,
    /// The node that has the replica from its own configuration or DNS and vouches for it
    /// ("" = the publisher itself). A replica learned from gossip is kept only while this node
    /// is a live member, so replicas a departed node introduced leave with it. Added after
    /// version 1: absent reads as "".
    #[serde(default)]
    pub origin: String,
    /// Where the engine publishes its KV events, at the replica URL's host, so whichever node
    /// becomes home subscribes. Added after version 1: absent reads as none.
    #[serde(default)]
    pub kv_events: Option<WireKvEvents>,
    /// Its prefill/decode disaggregation facts. Added after version 1: absent (and `None`,
    /// which is never written, so older nodes read no new key) means `both`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pd: Option<WirePd>,
    /// The home's estimate of each KV-quota tenant's share of the replica's cache, in
    /// thousandths (tenant → 0..=[`KV_SHARE_SCALE`]), from a model that every node's block
    /// reports feed with their tenants: every node steers on this one estimate rather than on
    /// its own routing alone (`core::tenants`). `None`: the home publishes none (no tenant has
    /// a `max_kv_share` there, or an older node). A tenant left out holds nothing (or did not
    /// fit: at most [`MAX_KV_SHARE_TENANTS`] names of at most [`MAX_TENANT_BYTES`], the largest
    /// shares kept). Added after version 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_shares: Option<BTreeMap<String, u16>>,
    /// The replica's KV size and offload bandwidths (`core::kv_load`), so every node of the
    /// region weighs its CPU/disk hits alike. Added later: absent reads as none; out of bounds
    /// refuses the record.
    #[serde(default)]
    pub kv_load: Option<crate::core::kv_load::KvLoad>,
}

/// A replica's disaggregation facts as gossiped (`core/role.rs`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WirePd {
    /// Role.
    #[serde(default)]
    pub role: Role,
    /// KV bootstrap port at the replica URL's host, if any.
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
    /// Mooncake engine id (at most [`MAX_ENGINE_ID_BYTES`]).
    #[serde(default)]
    pub engine_id: String,
}

impl WirePd {
    /// The wire form of `pd`; `None` for the default (`both`, nothing else), which is what an
    /// absent field reads as.
    pub fn of(pd: &PdFacts) -> Option<WirePd> {
        (*pd != PdFacts::default()).then(|| WirePd {
            role: pd.role,
            bootstrap_port: pd.bootstrap_port,
            engine_id: pd.engine_id.clone(),
        })
    }

    /// The core's facts.
    pub fn facts(&self) -> PdFacts {
        PdFacts {
            role: self.role,
            bootstrap_port: self.bootstrap_port,
            engine_id: self.engine_id.clone(),
        }
    }

    /// Whether the port and the engine id are within bounds (`what`: the record, for errors).
    pub fn check(&self, what: &'static str) -> Result<(), SchemaError> {
        bound(
            what,
            "pd.bootstrap_port",
            self.bootstrap_port != Some(0),
            self.bootstrap_port.unwrap_or(0),
        )?;
        bound(
            what,
            "pd.engine_id",
            self.engine_id.len() <= MAX_ENGINE_ID_BYTES,
            self.engine_id.len(),
        )
    }
}

/// A replica's KV-event ports as gossiped: the host is always the replica URL's (which the
/// learned-replica allow-list has vetted), never a peer's choice.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireKvEvents {
    /// PUB port (rank 0).
    pub port: u16,
    /// ROUTER replay port (rank 0), if any.
    pub replay_port: Option<u16>,
    /// Topic prefix (at most [`MAX_TOPIC_BYTES`]).
    pub topic: String,
    /// Data-parallel ranks (1..=[`MAX_DP_RANKS`]).
    pub dp_ranks: u16,
}

impl WireKvEvents {
    /// Whether the ports, topic and ranks are within bounds (`what`: the record, for errors).
    pub fn check(&self, what: &'static str) -> Result<(), SchemaError> {
        bound(what, "kv_events.port", self.port > 0, self.port)?;
        bound(
            what,
            "kv_events.topic",
            self.topic.len() <= MAX_TOPIC_BYTES,
            self.topic.len(),
        )?;
        let ranks = u32::from(self.dp_ranks);
        bound(
            what,
            "kv_events.dp_ranks",
            (1..=MAX_DP_RANKS).contains(&self.dp_ranks)
                && u32::from(self.port) + ranks <= 65_536
                && self
                    .replay_port
                    .is_none_or(|p| p > 0 && u32::from(p) + ranks <= 65_536),
            self.dp_ranks,
        )
    }
}

/// Most tenants whose KV share a replica record carries.
pub const MAX_KV_SHARE_TENANTS: usize = 8;
/// A published KV share's unit: a share of 1 is this many.
pub const KV_SHARE_SCALE: u16 = 1000;

/// Longest KV-event topic a record carries.
pub const MAX_TOPIC_BYTES: usize = 64;
/// Most data-parallel ranks a record may claim (each is a connection).
pub const MAX_DP_RANKS: u16 = 64;

impl ReplicaRecord {
    /// A record from the core's types.
    pub fn new(
        info: &ReplicaInfo,
        health: Health,
        load: &ReplicaLoad,
        summary: SummaryVersion,
    ) -> Self {
        ReplicaRecord {
            url: info.url.clone(),
            region: info.region.clone(),
            zone: info.zone.clone(),
            pool: info.pool.clone(),
            models: info.models.clone(),
            capacity_tokens: info.capacity_tokens,
            prefill_tokens_per_s: info.prefill_tokens_per_s,
            prefill_attention_ms_per_pair: (info.prefill_attention_ms_per_pair
                != DEFAULT_PREFILL_ATTENTION_MS_PER_PAIR)
                .then_some(info.prefill_attention_ms_per_pair),
            max_in_flight: info.max_in_flight,
            health: health.into(),
            load: load.into(),
            summary,
            origin: String::new(),
            kv_events: None,
            pd: WirePd::of(&info.pd),
            kv_shares: None,
            kv_load: info.kv_load,
        }
    }

    /// Adds the KV-quota tenants' `shares` (0..=1) that still fit, largest first, rounded to
    /// thousandths; zero shares are left out (absent reads as zero). Publishes an empty map,
    /// not `None`, when none is held.
    pub fn with_kv_shares(mut self, shares: impl IntoIterator<Item = (String, f64)>) -> Self {
        let mut all: Vec<(String, u16)> = shares
            .into_iter()
            .filter(|(t, _)| t.len() <= MAX_TENANT_BYTES)
            .map(|(t, v)| {
                let v = if v.is_finite() {
                    v.clamp(0.0, 1.0)
                } else {
                    0.0
                };
                (t, (v * f64::from(KV_SHARE_SCALE)).round() as u16)
            })
            .filter(|(_, v)| *v > 0)
            .collect();
        all.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        self.kv_shares = Some(BTreeMap::new());
        for (t, v) in all.into_iter().take(MAX_KV_SHARE_TENANTS) {
            if let Some(m) = self.kv_shares.as_mut() {
                m.insert(t.clone(), v);
            }
            if self.encode().is_err() {
                if let Some(m) = self.kv_shares.as_mut() {
                    m.remove(&t);
                }
                break;
            }
        }
        self
    }

    /// The core's static facts for replica `id`.
    pub fn info(&self, id: &str) -> ReplicaInfo {
        ReplicaInfo {
            id: id.to_owned(),
            url: self.url.clone(),
            region: self.region.clone(),
            zone: self.zone.clone(),
            pool: self.pool.clone(),
            models: self.models.clone(),
            capacity_tokens: self.capacity_tokens,
            prefill_tokens_per_s: self.prefill_tokens_per_s,
            prefill_attention_ms_per_pair: self
                .prefill_attention_ms_per_pair
                .unwrap_or(DEFAULT_PREFILL_ATTENTION_MS_PER_PAIR),
            max_in_flight: self.max_in_flight,
            pd: self.pd.as_ref().map(WirePd::facts).unwrap_or_default(),
            kv_load: self.kv_load.filter(|l| l.validate().is_ok()),
        }
    }

    /// Encodes for gossip; errors when over the limit (e.g. hundreds of LoRA adapters).
    pub fn encode(&self) -> Result<String, SchemaError> {
        encode("replica", self)
    }
    /// Decodes a peer's value; numbers outside [`bounds`] are refused.
    pub fn decode(s: &str) -> Result<Self, SchemaError> {
        let r: ReplicaRecord = decode("replica", s)?;
        // (The origin is a node id: bounded by the value's size like every string here.)
        r.check()?;
        check_changing("replica", &r.load, &r.summary, r.kv_shares.as_ref())?;
        if let Some(k) = &r.kv_events {
            k.check("replica")?;
        }
        if let Some(p) = &r.pd {
            p.check("replica")?;
        }
        if let Some(l) = &r.kv_load {
            bound("replica", "kv_load", l.validate().is_ok(), format!("{l:?}"))?;
        }
        Ok(r)
    }

    /// Whether every number is within [`bounds`].
    pub fn check(&self) -> Result<(), SchemaError> {
        use bounds::*;
        let w = "replica";
        bound(
            w,
            "capacity_tokens",
            self.capacity_tokens <= MAX_CAPACITY_TOKENS,
            self.capacity_tokens,
        )?;
        let p = self.prefill_tokens_per_s;
        bound(
            w,
            "prefill_tokens_per_s",
            p.is_finite() && (0.0..=MAX_PREFILL_TOKENS_PER_S).contains(&p),
            p,
        )?;
        if let Some(e) = self.prefill_attention_ms_per_pair {
            bound(
                w,
                "prefill_attention_ms_per_pair",
                e.is_finite() && (0.0..=MAX_PREFILL_ATTENTION_MS_PER_PAIR).contains(&e),
                e,
            )?;
        }
        bound(
            w,
            "max_in_flight",
            self.max_in_flight <= MAX_REQUESTS,
            self.max_in_flight,
        )?;
        bound(
            w,
            "models",
            self.models.len() <= MAX_MODELS,
            self.models.len(),
        )?;
        check_load(w, &self.load)
    }
}

/// Whether a load is within [`bounds`].
fn check_load(w: &'static str, l: &WireLoad) -> Result<(), SchemaError> {
    use bounds::*;
    bound(w, "load.waiting", l.waiting <= MAX_REQUESTS, l.waiting)?;
    bound(w, "load.running", l.running <= MAX_REQUESTS, l.running)?;
    bound(
        w,
        "load.kv_usage",
        l.kv_usage.is_finite() && (0.0..=MAX_KV_USAGE).contains(&l.kv_usage),
        l.kv_usage,
    )?;
    bound(
        w,
        "load.queued_prefill_tokens",
        l.queued_prefill_tokens <= MAX_QUEUED_TOKENS,
        l.queued_prefill_tokens,
    )
}

/// The checks on the fields of a replica record that change while it is served (load, summary
/// version, KV shares), wherever they travel: in the record or in its `rload:` companion.
pub(super) fn check_changing(
    w: &'static str,
    load: &WireLoad,
    summary: &SummaryVersion,
    kv_shares: Option<&BTreeMap<String, u16>>,
) -> Result<(), SchemaError> {
    check_load(w, load)?;
    let epoch = summary.epoch;
    let latest = wall_ms().saturating_add(bounds::MAX_EPOCH_LEAD_MS);
    bound(w, "summary.epoch", epoch <= latest, epoch)?;
    if let Some(m) = kv_shares {
        bound(w, "kv_shares", m.len() <= MAX_KV_SHARE_TENANTS, m.len())?;
        for (t, v) in m {
            bound(w, "kv_shares", t.len() <= MAX_TENANT_BYTES, t.len())?;
            bound(w, "kv_shares", *v <= KV_SHARE_SCALE, v)?;
        }
    }
    Ok(())
}

/// The gossip key of replica `id`; errors on ids that are empty or too long.
pub fn replica_key(id: &str) -> Result<String, SchemaError> {
    if id.is_empty() || id.len() > MAX_REPLICA_ID_BYTES {
        return Err(SchemaError::BadReplicaId(id.to_owned()));
    }
    Ok(format!("{REPLICA_PREFIX}{id}"))
}

/// Most tenants an `inflight` record carries (only those with a cluster-wide share).
pub const MAX_RECORD_TENANTS: usize = 32;
/// Longest tenant name an `inflight` record carries.
pub const MAX_TENANT_BYTES: usize = 64;

/// The `inflight` record: this node's in-flight requests per tenant for the tenants whose quota
/// is a share of the cluster (so every node enforces it cluster-wide). Per replica counts
/// (`counts`) are decoded from older peers but no longer written: load sharing carries them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InflightRecord {
    /// Replica id → in-flight requests (non-zero only). No longer written; read from older peers.
    #[serde(default)]
    pub counts: BTreeMap<String, u32>,
    /// Tenant → in-flight requests at this node (non-zero only; at most
    /// [`MAX_RECORD_TENANTS`] names of at most [`MAX_TENANT_BYTES`]).
    #[serde(default)]
    pub tenants: BTreeMap<String, u32>,
}

impl InflightRecord {
    /// A record of the non-zero `counts` that fits [`MAX_VALUE_BYTES`]: when all do not fit,
    /// the largest counts are kept (they are the ones that change other nodes' decisions).
    pub fn fit(counts: impl IntoIterator<Item = (String, u32)>) -> Self {
        let mut all: Vec<(String, u32)> = counts.into_iter().filter(|(_, c)| *c > 0).collect();
        // Largest first, ties by id so every run keeps the same ones.
        all.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        let mut rec = InflightRecord::default();
        for (id, c) in all {
            rec.counts.insert(id.clone(), c);
            if rec.encode().is_err() {
                rec.counts.remove(&id);
                break;
            }
        }
        rec
    }

    /// Adds the largest non-zero tenant counts that still fit (names over
    /// [`MAX_TENANT_BYTES`] are left out).
    pub fn with_tenants(mut self, tenants: impl IntoIterator<Item = (String, u32)>) -> Self {
        let mut all: Vec<(String, u32)> = tenants
            .into_iter()
            .filter(|(t, c)| *c > 0 && t.len() <= MAX_TENANT_BYTES)
            .collect();
        all.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        for (t, c) in all.into_iter().take(MAX_RECORD_TENANTS) {
            self.tenants.insert(t.clone(), c);
            if self.encode().is_err() {
                self.tenants.remove(&t);
                break;
            }
        }
        self
    }

    /// Encodes for gossip; errors when over the limit.
    pub fn encode(&self) -> Result<String, SchemaError> {
        encode("inflight", self)
    }
    /// Decodes a peer's value; a count over [`bounds::MAX_REQUESTS`] is refused.
    pub fn decode(s: &str) -> Result<Self, SchemaError> {
        let r: InflightRecord = decode("inflight", s)?;
        for c in r.counts.values().chain(r.tenants.values()) {
            bound("inflight", "counts", *c <= bounds::MAX_REQUESTS, c)?;
        }
        let n = r.tenants.len();
        bound("inflight", "tenants", n <= MAX_RECORD_TENANTS, n)?;
        for t in r.tenants.keys() {
            bound("inflight", "tenants", t.len() <= MAX_TENANT_BYTES, t.len())?;
        }
        Ok(r)
    }
}

/// The `homes` record: how many `replica:<id>` records the node publishes, written after them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HomesRecord {
    /// Replica records the node publishes.
    pub count: u32,
    /// Bumped on every write, so the marker's gossip version always follows the records'.
    pub round: u64,
}

impl HomesRecord {
    /// Encodes for gossip.
    pub fn encode(&self) -> Result<String, SchemaError> {
        encode("homes", self)
    }
    /// Decodes a peer's value; a count over [`bounds::MAX_REQUESTS`] is refused.
    pub fn decode(s: &str) -> Result<Self, SchemaError> {
        let r: HomesRecord = decode("homes", s)?;
        bound("homes", "count", r.count <= bounds::MAX_REQUESTS, r.count)?;
        Ok(r)
    }
}

/// The `rtt` record: this node's measured RTT to each region.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RttRecord {
    /// Region → RTT in milliseconds (to the nearest live node of that region).
    pub ms: BTreeMap<String, f32>,
}

impl RttRecord {
    /// Encodes for gossip; errors when over the limit.
    pub fn encode(&self) -> Result<String, SchemaError> {
        encode("rtt", self)
    }
    /// Decodes a peer's value; an RTT that is not a finite 0..=[`bounds::MAX_RTT_MS`] is
    /// refused.
    pub fn decode(s: &str) -> Result<Self, SchemaError> {
        let r: RttRecord = decode("rtt", s)?;
        for ms in r.ms.values() {
            let ok = ms.is_finite() && (0.0..=bounds::MAX_RTT_MS).contains(ms);
            bound("rtt", "ms", ok, ms)?;
        }
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn record() -> ReplicaRecord {
        ReplicaRecord {
            url: "http://10.0.0.1:8000".into(),
            region: "eu".into(),
            zone: "eu-a".into(),
            pool: "shared".into(),
            models: vec!["llama-3-8b".into()],
            capacity_tokens: 500_000,
            prefill_tokens_per_s: 12_000.0,
            prefill_attention_ms_per_pair: None,
            max_in_flight: 256,
            health: WireHealth::Healthy,
            load: WireLoad {
                waiting: 3,
                running: 17,
                kv_usage: 0.4,
                queued_prefill_tokens: 9000,
            },
            summary: SummaryVersion {
                epoch: 1_700_000_000_000,
                seq: 42,
                digest: u64::MAX,
            },
            origin: String::new(),
            kv_events: None,
            kv_load: None,
            pd: None,
            kv_shares: None,
        }
    }

    #[test]
    fn kv_shares_are_bounded_rounded_and_keep_the_largest() {
        // Rounded to thousandths, clamped, zero and non-finite left out.
        let r = record().with_kv_shares([
            ("big".to_owned(), 0.6667),
            ("over".to_owned(), 7.0),
            ("idle".to_owned(), 0.0),
            ("nan".to_owned(), f64::NAN),
        ]);
        let m = r.kv_shares.clone().unwrap();
        assert_eq!(
            m,
            BTreeMap::from([("big".into(), 667), ("over".into(), 1000)])
        );
        assert_eq!(ReplicaRecord::decode(&r.encode().unwrap()).unwrap(), r);
        // Nothing held: an empty map (the home publishes, all zero), not `None`.
        assert_eq!(record().with_kv_shares([]).kv_shares, Some(BTreeMap::new()));
        // Many long names: the largest that fit, never over the value limit.
        let many = (0..40).map(|i| (format!("{i:02}{}", "t".repeat(60)), f64::from(i) / 40.0));
        let r = record().with_kv_shares(many);
        let m = r.kv_shares.as_ref().unwrap();
        assert!(
            !m.is_empty() && m.len() <= MAX_KV_SHARE_TENANTS,
            "{}",
            m.len()
        );
        assert!(m.keys().all(|t| t.starts_with('3')), "largest first: {m:?}");
        assert!(r.encode().is_ok());
        // A peer's map past a bound is refused.
        type Edit = fn(&mut BTreeMap<String, u16>);
        let cases: [Edit; 3] = [
            |m| {
                m.insert("t".into(), KV_SHARE_SCALE + 1);
            },
            |m| {
                m.insert("t".repeat(MAX_TENANT_BYTES + 1), 1);
            },
            |m| m.extend((0..=MAX_KV_SHARE_TENANTS).map(|i| (i.to_string(), 1))),
        ];
        for edit in cases {
            let mut r = record();
            let mut m = BTreeMap::new();
            edit(&mut m);
            r.kv_shares = Some(m);
            let bytes = rmp_serde::to_vec_named(&r).unwrap();
            let s = base64::engine::general_purpose::STANDARD.encode(bytes);
            assert!(
                matches!(
                    ReplicaRecord::decode(&s),
                    Err(SchemaError::OutOfBounds {
                        field: "kv_shares",
                        ..
                    })
                ),
                "{:?}",
                r.kv_shares
            );
        }
    }

    #[test]
    fn a_kv_load_travels_in_the_record_and_is_bounds_checked() {
        use crate::core::kv_load::KvLoad;
        let load = KvLoad {
            cpu_gb_per_s: 5.0,
            ..KvLoad::default()
        };
        let r = ReplicaRecord {
            kv_load: Some(load),
            ..record()
        };
        let s = r.encode().unwrap();
        assert!(s.len() < 500, "replica record is {} bytes", s.len());
        let back = ReplicaRecord::decode(&s).unwrap();
        assert_eq!(back.info("r1").kv_load, Some(load));
        // A peer claiming a zero-byte token or an absurd link is refused, whole.
        for bad in [
            KvLoad {
                bytes_per_token: 0,
                ..load
            },
            KvLoad {
                cpu_gb_per_s: 1e9,
                ..load
            },
        ] {
            let r = ReplicaRecord {
                kv_load: Some(bad),
                ..record()
            };
            let s = r.encode().unwrap();
            assert!(ReplicaRecord::decode(&s).is_err(), "{bad:?}");
        }
        // Absent (an older publisher): none, the fixed tier weights.
        assert_eq!(record().info("r1").kv_load, None);
    }

    #[test]
    fn records_round_trip_and_stay_small() {
        let r = record();
        let s = r.encode().unwrap();
        assert!(s.len() < 400, "replica record is {} bytes", s.len());
        assert_eq!(ReplicaRecord::decode(&s).unwrap(), r);
        let n = NodeRecord {
            schema: SCHEMA_VERSION,
            region: "eu".into(),
            zone: "".into(),
            http_url: "http://127.0.0.1:8080".into(),
            quic_addr: "127.0.0.1:7946".parse().unwrap(),
            version: "0.1.0".into(),
            generation: 1,
        };
        assert_eq!(NodeRecord::decode(&n.encode().unwrap()).unwrap(), n);
        let info = r.info("r1");
        let back = ReplicaRecord::new(&info, Health::Healthy, &r.load.to_load(0), r.summary);
        assert_eq!(back, r);
    }

    #[test]
    fn a_role_rides_in_the_record_and_an_older_record_reads_as_both() {
        let mut r = record();
        let mut info = r.info("r0");
        assert_eq!(info.pd, PdFacts::default(), "no pd field: both");
        info.pd = PdFacts {
            role: Role::Prefill,
            bootstrap_port: Some(8998),
            engine_id: "e-1".into(),
        };
        r.pd = WirePd::of(&info.pd);
        let back = ReplicaRecord::decode(&r.encode().unwrap()).unwrap();
        assert_eq!(back.info("r0").pd, info.pd);
        // A default role is not written at all, so older nodes see the record they know.
        r.pd = WirePd::of(&PdFacts::default());
        assert!(r.pd.is_none());
        // Out-of-bounds facts are refused.
        for bad in [
            WirePd {
                role: Role::Decode,
                bootstrap_port: Some(0),
                engine_id: String::new(),
            },
            WirePd {
                role: Role::Decode,
                bootstrap_port: None,
                engine_id: "e".repeat(65),
            },
        ] {
            r.pd = Some(bad);
            let s = encode("replica", &r).unwrap();
            assert!(ReplicaRecord::decode(&s).is_err());
        }
    }

    #[test]
    fn oversized_values_are_refused() {
        let mut r = record();
        r.models = (0..200).map(|i| format!("lora-adapter-{i}")).collect();
        assert!(matches!(r.encode(), Err(SchemaError::TooLarge { .. })));
        assert!(matches!(
            ReplicaRecord::decode(&"A".repeat(MAX_VALUE_BYTES + 4)),
            Err(SchemaError::TooLarge { .. })
        ));
        assert!(replica_key(&"x".repeat(MAX_REPLICA_ID_BYTES + 1)).is_err());
        assert!(replica_key("").is_err());
        assert_eq!(replica_key("r1").unwrap(), "replica:r1");
    }

    #[test]
    fn inflight_fit_keeps_the_largest_counts() {
        let counts = (0..500).map(|i| (format!("replica-{i:04}"), i as u32));
        let rec = InflightRecord::fit(counts);
        assert!(rec.encode().is_ok());
        assert!(rec.counts.len() > 10 && rec.counts.len() < 500);
        assert!(!rec.counts.contains_key("replica-0000"));
        assert!(rec.counts.contains_key("replica-0499"));
        let min_kept = rec.counts.values().min().copied().unwrap();
        assert!(min_kept > 400);
    }

    #[test]
    fn out_of_bounds_numbers_are_refused() {
        type Edit = fn(&mut ReplicaRecord);
        let cases: [(&str, Edit); 11] = [
            ("capacity_tokens", |r| r.capacity_tokens = u64::MAX),
            ("prefill_attention_ms_per_pair", |r| {
                r.prefill_attention_ms_per_pair = Some(f64::NAN)
            }),
            ("prefill_attention_ms_per_pair", |r| {
                r.prefill_attention_ms_per_pair = Some(1.0)
            }),
            ("prefill_tokens_per_s", |r| {
                r.prefill_tokens_per_s = f64::NAN
            }),
            ("prefill_tokens_per_s", |r| r.prefill_tokens_per_s = -1.0),
            ("max_in_flight", |r| r.max_in_flight = u32::MAX),
            ("models", |r| {
                r.models = vec![String::new(); bounds::MAX_MODELS + 1]
            }),
            ("load.waiting", |r| r.load.waiting = u32::MAX),
            ("load.running", |r| r.load.running = u32::MAX),
            ("load.kv_usage", |r| r.load.kv_usage = f32::INFINITY),
            ("load.queued_prefill_tokens", |r| {
                r.load.queued_prefill_tokens = u64::MAX
            }),
        ];
        for (field, edit) in cases {
            let mut r = record();
            edit(&mut r);
            // Encoded as a peer would (encode does not check: a hostile peer would not either).
            let bytes = rmp_serde::to_vec_named(&r).unwrap();
            let s = base64::engine::general_purpose::STANDARD.encode(bytes);
            match ReplicaRecord::decode(&s) {
                Err(SchemaError::OutOfBounds { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: {other:?}"),
            }
        }
        // At the bounds: accepted.
        let mut r = record();
        r.capacity_tokens = bounds::MAX_CAPACITY_TOKENS;
        r.max_in_flight = bounds::MAX_REQUESTS;
        assert!(ReplicaRecord::decode(&r.encode().unwrap()).is_ok());
        // A replica's prefill attention travels in its record; absent reads as the default.
        let info = |e| ReplicaInfo {
            prefill_attention_ms_per_pair: e,
            ..crate::core::view::testing::info("r", "eu")
        };
        for e in [0.0, 9.5e-7, DEFAULT_PREFILL_ATTENTION_MS_PER_PAIR] {
            let sent = ReplicaRecord::new(
                &info(e),
                Health::Healthy,
                &ReplicaLoad::default(),
                r.summary,
            );
            let got = ReplicaRecord::decode(&sent.encode().unwrap()).unwrap();
            assert_eq!(got.info("r").prefill_attention_ms_per_pair, e);
        }
        let bad_inflight = InflightRecord {
            counts: BTreeMap::from([("r".to_owned(), u32::MAX)]),
            ..Default::default()
        };
        assert!(InflightRecord::decode(&bad_inflight.encode().unwrap()).is_err());
        let mut future = record();
        future.summary.epoch = u64::MAX / 2;
        assert!(ReplicaRecord::decode(&future.encode().unwrap()).is_err());
        future.summary.epoch = wall_ms() + 3_600_000;
        assert!(ReplicaRecord::decode(&future.encode().unwrap()).is_ok());
        let mut kv = record();
        kv.kv_events = Some(WireKvEvents {
            port: 5557,
            replay_port: Some(5558),
            topic: String::new(),
            dp_ranks: 2,
        });
        assert!(ReplicaRecord::decode(&kv.encode().unwrap()).is_ok());
        for bad in [
            WireKvEvents {
                port: 0,
                replay_port: None,
                topic: String::new(),
                dp_ranks: 1,
            },
            WireKvEvents {
                port: 5557,
                replay_port: None,
                topic: "t".repeat(65),
                dp_ranks: 1,
            },
            WireKvEvents {
                port: 5557,
                replay_port: None,
                topic: String::new(),
                dp_ranks: 0,
            },
            WireKvEvents {
                port: 65_535,
                replay_port: None,
                topic: String::new(),
                dp_ranks: 4,
            },
        ] {
            kv.kv_events = Some(bad);
            assert!(ReplicaRecord::decode(&kv.encode().unwrap()).is_err());
        }
        let bad_tenant = InflightRecord {
            tenants: BTreeMap::from([("t".to_owned(), u32::MAX)]),
            ..Default::default()
        };
        assert!(InflightRecord::decode(&bad_tenant.encode().unwrap()).is_err());
        let many_tenants = InflightRecord {
            tenants: (0..40).map(|i| (format!("t{i}"), 1)).collect(),
            ..Default::default()
        };
        assert!(InflightRecord::decode(&many_tenants.encode().unwrap()).is_err());
        let fitted = InflightRecord::default().with_tenants((0..40).map(|i| (format!("t{i}"), i)));
        assert_eq!(fitted.tenants.len(), MAX_RECORD_TENANTS);
        assert!(InflightRecord::decode(&fitted.encode().unwrap()).is_ok());
        let bad_rtt = RttRecord {
            ms: BTreeMap::from([("eu".to_owned(), f32::NAN)]),
        };
        assert!(RttRecord::decode(&bad_rtt.encode().unwrap()).is_err());
        let bad_homes = HomesRecord {
            count: u32::MAX,
            round: 1,
        };
        assert!(HomesRecord::decode(&bad_homes.encode().unwrap()).is_err());
    }

    #[test]
    fn malformed_values_are_errors() {
        assert!(matches!(
            NodeRecord::decode("not base64!"),
            Err(SchemaError::Base64 { .. })
        ));
        assert!(matches!(
            NodeRecord::decode("AAAA"),
            Err(SchemaError::Decode { .. })
        ));
        // A valid record of another type is not a node record.
        let rtt = RttRecord::default().encode().unwrap();
        assert!(NodeRecord::decode(&rtt).is_err());
    }

    proptest! {
        /// No string a peer gossips can panic a decoder.
        #[test]
        fn decoders_never_panic(s in ".{0,1200}", bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = ReplicaRecord::decode(&s);
            let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
            let _ = ReplicaRecord::decode(&b64);
            let _ = NodeRecord::decode(&b64);
            let _ = InflightRecord::decode(&b64);
            let _ = RttRecord::decode(&b64);
        }
    }
}
