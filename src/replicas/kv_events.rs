//! Engine truth: a replica's KV events, subscribed over ZMQ, feed its cache model exactly.
//!
//! Exists so the home node knows what each engine caches, evictions included, instead of
//! guessing from the requests it routed. Per replica and data-parallel rank (port + rank), a SUB
//! socket receives vLLM's 3-frame messages; a [`SeqTracker`] orders them (replaying gaps through
//! a DEALER on the replay port, clearing when history is lost or the publisher restarted); an
//! [`EventIndex`] turns them into our own token-chain keys; the node applies the resulting store /
//! remove / clear operations to the replica's cache model in exact mode, through the
//! [`KvEventSink`] it implements.
//!
//! **The switch.** While every rank's stream is connected and synced, the replica's cache model
//! is exact and routed requests no longer touch it (`Node::route` only records routed requests
//! in approximate models). When a stream disconnects the node falls back at once to a new
//! approximate model seeded with the last exact key set (so routing keeps its knowledge and
//! learns from routed requests again), and back to a new exact model from the index when the
//! stream is up again. Each switch starts a new summary epoch (peers then pull a snapshot), is
//! logged, and counted in `kvmesh_cache_source_switches_total{replica,to}`. "Up" means every
//! rank is connected and no replay is running. The new exact model takes the index's keys with
//! their tiers; the approximate one counts them all as GPU-held (it has no tiers). Mesh block
//! reports feed only approximate models (`Node::record_report`).
//!
//! **Tasks and wire.** One task per replica owns its ranks' trackers and the index, so the node's
//! lock is taken once per batch. Each replay runs on a fresh DEALER: `["", seq]` is answered with
//! `["", seq, payload]` per batch or, as vLLM 0.32 really sends them, `["", topic, seq, payload]`
//! (captured in `tests/data/vllm-0.32-kv-events.json`), until the end marker; [`REPLAY_TIMEOUT`]
//! of silence fails the replay. Malformed messages are dropped, counted, and warned about at
//! most once per 10 s per replica.
//!
//! **Silence.** A publisher can vanish without closing its connection (its host lost, its
//! process stopped, a partition): the SUB would wait forever and the model stay "exact" and
//! frozen. So every connection has TCP keepalive, and a publisher speaking ZMTP 3.1 (libzmq,
//! so vLLM; `kvmesh replica`) is sent a `PING` every `[kv_events] heartbeat_ms`; nothing heard
//! for `silence_ms` ends the connection like a disconnect (the model goes approximate at once),
//! counts in `kvmesh_kv_events_silences_total{replica}`, and reconnects with backoff.
//!
//! **Bounds.** Both sockets are this crate's own ZMTP client (`zmtp.rs`), which checks every
//! declared frame length against `max_message_bytes` before allocating and drops a peer that
//! breaks it (counted as malformed, reconnected with backoff). At most [`CHANNEL_DEPTH`]
//! messages wait between the sockets and the event loop, and a replay buffers live messages up
//! to `max_buffered_bytes`: a replica's stream holds at most
//! `CHANNEL_DEPTH × max_message_bytes + max_buffered_bytes` of the node's memory.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};
use serde::Deserialize;
use tokio::sync::{mpsc, watch};

use super::kv_index::{EventIndex, Op, MAX_TRACKED_RANKS};
use super::kv_stream::{Action, SeqTracker};
use super::zmtp::{SocketType, ZmtpConnection, ZmtpError, ZmtpLimits};
use crate::core::keys::BlockKey;
use crate::core::summary::Tier;
use crate::kv_events::{decode_batch, END_OF_REPLAY_SEQ};
use crate::shutdown::stopped;

/// Longest silence of a replay (connecting, or between two replies) before it is abandoned and
/// the replica cleared. Per message rather than in total, so a long ring replays in full.
pub const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait between SUB connection attempts.
const MAX_CONNECT_BACKOFF: Duration = Duration::from_secs(5);
/// At most one warning per replica per this long about malformed messages.
const WARN_EVERY: Duration = Duration::from_secs(10);
/// Messages in flight between a replica's sockets and its event loop.
pub const CHANNEL_DEPTH: usize = 64;
/// Default `max_message_bytes`: a vLLM step's batch is kilobytes; 4 MiB is ~800k token ids.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 << 20;
/// Default `max_buffered_bytes` of live messages held during a replay.
pub const DEFAULT_MAX_BUFFERED_BYTES: usize = 64 << 20;
/// Largest `max_message_bytes` / `max_buffered_bytes` a configuration may set (1 GiB).
pub const MAX_LIMIT_BYTES: usize = 1 << 30;

/// Default `[kv_events] heartbeat_ms`.
pub const DEFAULT_HEARTBEAT_MS: u64 = 1_000;
/// Default `[kv_events] silence_ms`.
pub const DEFAULT_SILENCE_MS: u64 = 5_000;

/// `[kv_events]` of the node config: how every KV-event connection is watched for silence.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct KvWatchConfig {
    /// Time between two ZMTP `PING`s to a publisher speaking ZMTP 3.1, and between TCP
    /// keepalive probes, in ms (50..=60000). Default 1000.
    pub heartbeat_ms: u64,
    /// Nothing heard for this long from a pinged publisher (no message, no `PONG`), in ms: the
    /// stream counts as down (the replica's model goes approximate) and is reconnected. Also
    /// TCP keepalive's idle time before the first probe. At least 2 × `heartbeat_ms`, at most
    /// 600000. Default 5000.
    pub silence_ms: u64,
}

impl Default for KvWatchConfig {
    fn default() -> Self {
        KvWatchConfig {
            heartbeat_ms: DEFAULT_HEARTBEAT_MS,
            silence_ms: DEFAULT_SILENCE_MS,
        }
    }
}

impl KvWatchConfig {
    /// Checks the bounds; the message names the field at fault.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if !(50..=60_000).contains(&self.heartbeat_ms) {
            return Err(("heartbeat_ms", "must be within 50..=60000".into()));
        }
        let least = self.heartbeat_ms * 2;
        if !(least..=600_000).contains(&self.silence_ms) {
            return Err((
                "silence_ms",
                format!("must be within 2 × heartbeat_ms ({least})..=600000"),
            ));
        }
        Ok(())
    }

    fn heartbeat(&self) -> Duration {
        Duration::from_millis(self.heartbeat_ms)
    }

    fn silence(&self) -> Duration {
        Duration::from_millis(self.silence_ms)
    }
}

/// `kv_events = { ... }` of a replica in the node config: where its engine publishes KV events.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct KvEventsSource {
    /// The engine's PUB endpoint, `tcp://host:port` (vLLM `endpoint`, default port 5557); the
    /// node connects to it (required).
    pub endpoint: String,
    /// The engine's ROUTER replay endpoint, `tcp://host:port` (vLLM `replay_endpoint`). Default
    /// none: gaps then clear the replica's blocks instead of being replayed.
    #[serde(default)]
    pub replay: Option<String>,
    /// Topic prefix to subscribe to. Default "" (every topic; vLLM's default topic is "").
    #[serde(default)]
    pub topic: String,
    /// Data-parallel ranks; rank r publishes on port + r (and replays on replay port + r).
    /// Default 1.
    #[serde(default = "one_rank")]
    pub dp_ranks: u16,
    /// How the home node names the data-parallel rank holding a request's prefix: `"header"`
    /// (vLLM's `X-data-parallel-rank`), `"body"` (SGLang's `data_parallel_rank` field; the body
    /// is then re-serialized with it) or `"off"` (the engine's own balancer picks). Default:
    /// `"header"` when `dp_ranks` > 1, else `"off"`. Only a node whose cache model of the
    /// replica follows its events names a rank.
    #[serde(default)]
    pub rank_routing: Option<RankRouting>,
    /// Largest event message (all frames) accepted, in bytes; a peer declaring more is
    /// disconnected before anything is allocated. Default 4 MiB.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// Live messages buffered while a replay runs, in bytes (besides the 4,096-message cap);
    /// past it the replay is abandoned and the replica cleared. Default 64 MiB.
    #[serde(default = "default_max_buffered_bytes")]
    pub max_buffered_bytes: usize,
}

/// How a request names the data-parallel rank it must run on (`kv_events.rank_routing`).
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum RankRouting {
    /// vLLM: the `X-data-parallel-rank` request header; the body passes byte for byte.
    Header,
    /// SGLang: a `data_parallel_rank` field added to the JSON body.
    Body,
    /// Name no rank.
    Off,
}

fn one_rank() -> u16 {
    1
}

/// Default of `max_message_bytes`.
pub fn default_max_message_bytes() -> usize {
    DEFAULT_MAX_MESSAGE_BYTES
}

/// Default of `max_buffered_bytes`.
pub fn default_max_buffered_bytes() -> usize {
    DEFAULT_MAX_BUFFERED_BYTES
}

/// `tcp://host:port` split into host and port.
fn split_endpoint(endpoint: &str) -> Result<(&str, u16), String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("'{endpoint}' must be tcp://host:port"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| format!("'{endpoint}' has no port"))?;
    if host.is_empty() || host.contains('*') {
        return Err(format!("'{endpoint}' needs a host to connect to"));
    }
    let port = port
        .parse::<u16>()
        .map_err(|_| format!("'{endpoint}' has a bad port"))?;
    Ok((host, port))
}

fn offset(endpoint: &str, rank: u16) -> Result<String, String> {
    let (host, port) = split_endpoint(endpoint)?;
    let port = port
        .checked_add(rank)
        .ok_or_else(|| format!("'{endpoint}' + rank {rank} overflows the port"))?;
    Ok(format!("tcp://{host}:{port}"))
}

impl KvEventsSource {
    /// A source at `endpoint` with every default.
    pub fn new(endpoint: impl Into<String>) -> Self {
        KvEventsSource {
            endpoint: endpoint.into(),
            replay: None,
            topic: String::new(),
            dp_ranks: 1,
            rank_routing: None,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            max_buffered_bytes: DEFAULT_MAX_BUFFERED_BYTES,
        }
    }

    /// How requests name a rank: as configured, else header with several ranks; always off
    /// with one rank.
    pub fn rank_routing(&self) -> RankRouting {
        match self.rank_routing {
            _ if self.dp_ranks <= 1 => RankRouting::Off,
            Some(r) => r,
            None => RankRouting::Header,
        }
    }

    /// The frame limits of this source's sockets.
    pub fn limits(&self) -> ZmtpLimits {
        ZmtpLimits {
            max_frame_bytes: self.max_message_bytes,
            max_message_bytes: self.max_message_bytes,
            max_frames: 8,
        }
    }

    /// Checks the endpoints, rank count and limits; the message names the field at fault.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        // Rank sets are 64-bit masks (`kv_index::MAX_TRACKED_RANKS`), as gossip bounds them.
        if !(1..=MAX_TRACKED_RANKS).contains(&usize::from(self.dp_ranks)) {
            return Err((
                "dp_ranks",
                format!("must be within 1..={MAX_TRACKED_RANKS}"),
            ));
        }
        for (field, v) in [
            ("max_message_bytes", self.max_message_bytes),
            ("max_buffered_bytes", self.max_buffered_bytes),
        ] {
            if !(1024..=MAX_LIMIT_BYTES).contains(&v) {
                return Err((field, format!("must be in 1024..={MAX_LIMIT_BYTES}")));
            }
        }
        let last = self.dp_ranks - 1;
        offset(&self.endpoint, last).map_err(|e| ("endpoint", e))?;
        if let Some(r) = &self.replay {
            offset(r, last).map_err(|e| ("replay", e))?;
        }
        Ok(())
    }

    /// Per rank: the PUB endpoint and the replay endpoint, if any.
    pub fn rank_endpoints(&self) -> Result<Vec<(String, Option<String>)>, String> {
        (0..self.dp_ranks.max(1))
            .map(|r| {
                Ok((
                    offset(&self.endpoint, r)?,
                    self.replay.as_deref().map(|e| offset(e, r)).transpose()?,
                ))
            })
            .collect()
    }
}

/// The node's KV-event and token-mode metrics, registered in its registry.
#[derive(Clone)]
pub struct KvMetrics {
    /// `kvmesh_kv_events_batches_total{replica}`: batches applied.
    pub batches: IntCounterVec,
    /// `kvmesh_kv_events_malformed_total{replica}`: messages dropped (bad frames or payload),
    /// and connections dropped for breaking the ZMTP limits or protocol.
    pub malformed: IntCounterVec,
    /// `kvmesh_kv_events_clears_total{replica,reason}`: stream resets (gap, history lost,
    /// restart, engine's AllBlocksCleared).
    pub clears: IntCounterVec,
    /// `kvmesh_kv_events_skipped_total{replica,reason}`: events or hashes the index skipped.
    pub skipped: IntCounterVec,
    /// `kvmesh_kv_events_up{replica}`: 1 while the replica's cache model follows its events.
    pub up: IntGaugeVec,
    /// `kvmesh_exact_blocks{replica}`: blocks the replica holds according to its events.
    pub exact_blocks: IntGaugeVec,
    /// `kvmesh_cache_source_switches_total{replica,to}`: exact ↔ approximate switches.
    pub switches: IntCounterVec,
    /// `kvmesh_kv_events_silences_total{replica}`: connections ended because a pinged
    /// publisher stopped answering for `[kv_events] silence_ms`.
    pub silences: IntCounterVec,
    /// `kvmesh_token_mode_fallbacks_total{reason}`: requests routed by text keys although a
    /// tokenizer is configured.
    pub token_fallbacks: IntCounterVec,
}

impl KvMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels)?;
            registry.register(Box::new(c.clone()))?;
            Ok::<_, prometheus::Error>(c)
        };
        let gauge = |name: &str, help: &str| {
            let g = IntGaugeVec::new(Opts::new(name, help), &["replica"])?;
            registry.register(Box::new(g.clone()))?;
            Ok::<_, prometheus::Error>(g)
        };
        Ok(KvMetrics {
            batches: counter(
                "kvmesh_kv_events_batches_total",
                "KV event batches applied",
                &["replica"],
            )?,
            malformed: counter(
                "kvmesh_kv_events_malformed_total",
                "KV event messages dropped as malformed",
                &["replica"],
            )?,
            clears: counter(
                "kvmesh_kv_events_clears_total",
                "Replica block sets cleared, by reason",
                &["replica", "reason"],
            )?,
            skipped: counter(
                "kvmesh_kv_events_skipped_total",
                "KV events or hashes skipped, by reason",
                &["replica", "reason"],
            )?,
            up: gauge(
                "kvmesh_kv_events_up",
                "1 while the replica's cache model follows its KV events",
            )?,
            exact_blocks: gauge(
                "kvmesh_exact_blocks",
                "Blocks the replica holds according to its KV events",
            )?,
            switches: counter(
                "kvmesh_cache_source_switches_total",
                "Cache model switches between exact (events) and approximate",
                &["replica", "to"],
            )?,
            silences: counter(
                "kvmesh_kv_events_silences_total",
                "KV-event connections ended because the publisher went silent",
                &["replica"],
            )?,
            token_fallbacks: counter(
                "kvmesh_token_mode_fallbacks_total",
                "Requests keyed by text although token mode is configured, by reason",
                &["reason"],
            )?,
        }
        .with_fixed_labels())
    }

    /// Forgets replica `id`'s series (it was dropped): a fleet's churn leaves no series behind.
    pub fn forget(&self, id: &str) {
        for vec in [&self.batches, &self.malformed, &self.silences] {
            let _ = vec.remove_label_values(&[id]);
        }
        for vec in [&self.up, &self.exact_blocks] {
            let _ = vec.remove_label_values(&[id]);
        }
        let reasons = [
            ("gap", &self.clears),
            ("history_lost", &self.clears),
            ("restarted", &self.clears),
            ("replay_overflow", &self.clears),
            ("all_blocks_cleared", &self.clears),
            ("unknown_parent", &self.skipped),
            ("unknown_removed", &self.skipped),
            ("other_group", &self.skipped),
            ("unsupported", &self.skipped),
            ("malformed_event", &self.skipped),
            ("over_capacity", &self.skipped),
            ("unknown_copied", &self.skipped),
            ("exact", &self.switches),
            ("approximate", &self.switches),
        ];
        for (label, vec) in reasons {
            let _ = vec.remove_label_values(&[id, label]);
        }
    }

    /// Fixed label values exist at 0 from the start.
    fn with_fixed_labels(self) -> Self {
        for reason in ["other_model", "load", "template", "encode", "unsupported"] {
            self.token_fallbacks.with_label_values(&[reason]).reset();
        }
        self
    }
}

/// What the socket tasks tell a replica's event loop.
#[derive(Debug)]
enum Input {
    Connected,
    Disconnected,
    /// The publisher stopped answering heartbeats (a `Disconnected` follows).
    Silent,
    Live(u64, Bytes),
    /// A message of the wrong shape (frame count, sequence width).
    Bad(&'static str),
    Replayed(u64, u64, Bytes),
    ReplayDone(u64),
    ReplayFailed(u64, String),
}

type Tx = mpsc::Sender<(usize, Input)>;

fn seq_of(frame: &[u8]) -> Option<u64> {
    <[u8; 8]>::try_from(frame).ok().map(u64::from_be_bytes)
}

async fn send(tx: &Tx, rank: usize, input: Input) -> bool {
    tx.send((rank, input)).await.is_ok()
}

/// The problem to count when a connection ends with `e`, if the peer is at fault.
fn peer_fault(e: &ZmtpError) -> Option<&'static str> {
    match e {
        ZmtpError::FrameTooLarge { .. } => Some("frame over max_message_bytes"),
        ZmtpError::MessageTooLarge(_) => Some("message over its limits"),
        ZmtpError::Greeting(_) => Some("bad ZMTP greeting"),
        ZmtpError::Handshake(_) => Some("bad ZMTP frame or command"),
        _ => None,
    }
}

/// Keeps a SUB connection to `endpoint` and forwards what it receives; reconnects with backoff.
async fn sub_reader(
    endpoint: String,
    topic: String,
    limits: ZmtpLimits,
    watching: KvWatchConfig,
    rank: usize,
    tx: Tx,
) {
    let mut backoff = Duration::from_millis(50);
    loop {
        if tx.is_closed() {
            return;
        }
        let connected = async {
            let mut conn =
                ZmtpConnection::connect(&endpoint, SocketType::Sub, limits, REPLAY_TIMEOUT).await?;
            conn.subscribe(topic.as_bytes()).await?;
            let pinged = conn.heartbeat(watching.heartbeat(), watching.silence());
            tracing::debug!(%endpoint, pinged, "KV event SUB connected");
            Ok::<_, ZmtpError>(conn)
        };
        let mut conn = match connected.await {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(%endpoint, error = %e, "KV event SUB connect failed; retrying");
                if let Some(why) = peer_fault(&e) {
                    if !send(&tx, rank, Input::Bad(why)).await {
                        return;
                    }
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_CONNECT_BACKOFF);
                continue;
            }
        };
        if !send(&tx, rank, Input::Connected).await {
            return;
        }
        let ended = loop {
            let msg = tokio::select! {
                m = conn.recv() => m,
                _ = tx.closed() => return,
            };
            let input = match msg {
                Ok(mut frames) => match (frames.len(), frames.get(1).and_then(|f| seq_of(f))) {
                    (3, Some(seq)) => Input::Live(seq, frames.swap_remove(2)),
                    (3, None) => Input::Bad("sequence frame is not 8 bytes"),
                    _ => Input::Bad("not 3 frames"),
                },
                Err(e) => break e,
            };
            // A healthy stream resets the backoff.
            backoff = Duration::from_millis(50);
            if !send(&tx, rank, input).await {
                return;
            }
        };
        tracing::debug!(%endpoint, error = %ended, "KV event SUB connection ended");
        if matches!(ended, ZmtpError::Silent(_)) && !send(&tx, rank, Input::Silent).await {
            return;
        }
        if let Some(why) = peer_fault(&ended) {
            if !send(&tx, rank, Input::Bad(why)).await {
                return;
            }
        }
        if !send(&tx, rank, Input::Disconnected).await {
            return;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_CONNECT_BACKOFF);
    }
}

/// One replay exchange on a fresh DEALER: `["", from]` → `["", seq, payload]`… `["", ff×8, ""]`.
async fn replay(endpoint: String, limits: ZmtpLimits, rank: usize, id: u64, from: u64, tx: Tx) {
    let timed_out = |_| "timed out".to_owned();
    let exchange = async {
        let mut dealer =
            ZmtpConnection::connect(&endpoint, SocketType::Dealer, limits, REPLAY_TIMEOUT)
                .await
                .map_err(|e| e.to_string())?;
        tokio::time::timeout(REPLAY_TIMEOUT, dealer.send(&[b"", &from.to_be_bytes()]))
            .await
            .map_err(timed_out)?
            .map_err(|e| e.to_string())?;
        loop {
            let frames = tokio::time::timeout(REPLAY_TIMEOUT, dealer.recv())
                .await
                .map_err(timed_out)?
                .map_err(|e| e.to_string())?;
            match parse_replay_reply(frames)? {
                None => return Ok(()),
                Some((seq, payload)) => {
                    if !send(&tx, rank, Input::Replayed(id, seq, payload)).await {
                        return Ok(());
                    }
                }
            }
        }
    };
    let input = match exchange.await {
        Ok(()) => Input::ReplayDone(id),
        Err(e) => Input::ReplayFailed(id, e),
    };
    send(&tx, rank, input).await;
}

/// One reply of a replay as a DEALER sees it: `Some((seq, payload))`, or `None` for the end
/// marker. Accepts `["", seq, payload]` (the upstream publisher's documented form) and
/// `["", topic, seq, payload]` (what vLLM 0.32 actually sends, captured in
/// `tests/data/vllm-0.32-kv-events.json`, end marker `["", "", ff×8, ""]`).
pub fn parse_replay_reply(mut frames: Vec<Bytes>) -> Result<Option<(u64, Bytes)>, String> {
    if frames.first().is_some_and(|f| f.is_empty()) {
        frames.remove(0);
    }
    let (seq, payload) = match frames.as_slice() {
        [seq, payload] | [_, seq, payload] => (seq, payload),
        _ => return Err(format!("replay reply of {} frames", frames.len())),
    };
    if seq.as_ref() == END_OF_REPLAY_SEQ {
        return Ok(None);
    }
    match seq_of(seq) {
        Some(s) => Ok(Some((s, payload.clone()))),
        None => Err("bad sequence frame in replay".to_owned()),
    }
}

struct Rank {
    tracker: SeqTracker,
    replay_endpoint: Option<String>,
    connected: bool,
    /// The current replay's id; replies of older ones are ignored.
    replay_id: u64,
}

/// What the subscriber needs from the node it feeds (the node implements it): the one place
/// where what the engine says crosses into routing state. Called from the subscriber's task;
/// each call takes the node's lock at most once.
pub trait KvEventSink: Send + Sync + 'static {
    /// Applies the index's operations to replica `i`'s cache model, if it follows events.
    fn apply_ops(&self, i: usize, ops: &[Op]) -> anyhow::Result<()>;
    /// Switches replica `i`'s cache model to exact (stream up) or approximate (down), seeded with
    /// `keys`, the last exact set with each key's best tier.
    fn set_exact(&self, i: usize, exact: bool, keys: &[(BlockKey, Tier)]) -> anyhow::Result<()>;
    /// The engine's block size, as replica `i`'s events carry it (token mode follows it
    /// unless a block size is configured).
    fn learn_block_size(&self, i: usize, block_size: u32);
}

/// Subscribes to replica `i`'s (`id`'s) KV events until `stop` turns true, feeding `sink`.
pub async fn run(
    sink: Arc<dyn KvEventSink>,
    metrics: KvMetrics,
    i: usize,
    id: Arc<str>,
    source: KvEventsSource,
    watching: KvWatchConfig,
    mut stop: watch::Receiver<bool>,
) {
    let endpoints = match source.rank_endpoints() {
        Ok(e) => e,
        Err(e) => {
            tracing::error!(replica = %id, error = %e, "bad kv_events endpoints");
            return;
        }
    };
    // At 0 from the start, so dashboards and alerts see the series.
    metrics.malformed.with_label_values(&[&id]).reset();
    metrics.silences.with_label_values(&[&id]).reset();
    let (tx, mut rx) = mpsc::channel::<(usize, Input)>(CHANNEL_DEPTH);
    let limits = source.limits();
    let mut ranks = Vec::with_capacity(endpoints.len());
    let mut readers = Vec::with_capacity(endpoints.len());
    for (r, (sub, replay_ep)) in endpoints.into_iter().enumerate() {
        tracing::info!(replica = %id, rank = r, endpoint = %sub, replay = ?replay_ep, "subscribing to KV events");
        readers.push(tokio::spawn(sub_reader(
            sub,
            source.topic.clone(),
            limits,
            watching,
            r,
            tx.clone(),
        )));
        ranks.push(Rank {
            tracker: SeqTracker::new(replay_ep.is_some())
                .with_max_buffered_bytes(source.max_buffered_bytes),
            replay_endpoint: replay_ep,
            connected: false,
            replay_id: 0,
        });
    }
    metrics.up.with_label_values(&[&id]).set(0);
    let mut lp = EventLoop {
        sink,
        metrics,
        i,
        id: Arc::clone(&id),
        index: EventIndex::new(ranks.len()),
        ranks,
        tx,
        next_replay: 1,
        exact: false,
        limits,
        last_warn: None,
        last_replay_warn: None,
        last_clear_log: None,
        reported: Default::default(),
    };
    loop {
        tokio::select! {
            msg = rx.recv() => match msg {
                Some((rank, input)) => lp.input(rank, input),
                None => break,
            },
            _ = stopped(&mut stop) => break,
        }
    }
    for r in readers {
        r.abort();
    }
    // The stream is gone: the model goes back to approximate, so a later subscription starts
    // from a fresh exact model instead of adding to this one.
    if lp.exact {
        if let Err(e) = lp.sink.set_exact(lp.i, false, &lp.index.tiered_keys()) {
            tracing::warn!(replica = %id, error = %e, "cannot switch cache model");
        }
    }
    lp.metrics.up.with_label_values(&[&id]).set(0);
}

struct EventLoop {
    sink: Arc<dyn KvEventSink>,
    metrics: KvMetrics,
    i: usize,
    id: Arc<str>,
    index: EventIndex,
    ranks: Vec<Rank>,
    tx: Tx,
    next_replay: u64,
    exact: bool,
    limits: ZmtpLimits,
    last_warn: Option<Instant>,
    /// When a failed replay was last logged.
    last_replay_warn: Option<Instant>,
    /// When a clear of the event-fed blocks was last logged: an engine whose sequence jumps on
    /// every message clears on every message, counted in `kvmesh_kv_events_clears_total`.
    last_clear_log: Option<Instant>,
    /// Index counters already added to the metrics.
    reported: HashMap<&'static str, u64>,
}

impl EventLoop {
    fn input(&mut self, rank: usize, input: Input) {
        let Some(r) = self.ranks.get_mut(rank) else {
            return;
        };
        let actions = match input {
            Input::Connected => {
                if r.connected {
                    return;
                }
                r.connected = true;
                // Fresh connection: fetch what was published before (startup) or while we were
                // away (reconnect).
                r.tracker.start()
            }
            Input::Disconnected => {
                r.connected = false;
                Vec::new()
            }
            Input::Silent => {
                self.metrics.silences.with_label_values(&[&self.id]).inc();
                tracing::warn!(replica = %self.id, rank, "KV event publisher silent past [kv_events] silence_ms: cache model approximate, reconnecting");
                Vec::new()
            }
            Input::Live(seq, payload) => r.tracker.live(seq, payload),
            Input::Bad(why) => {
                self.malformed(why);
                Vec::new()
            }
            Input::Replayed(id, seq, payload) if id == r.replay_id => {
                r.tracker.replayed(seq, payload)
            }
            Input::ReplayDone(id) if id == r.replay_id => r.tracker.replay_done(),
            Input::ReplayFailed(id, e) if id == r.replay_id => {
                // A publisher that keeps failing replays must not flood the log either.
                let now = Instant::now();
                if self.last_replay_warn.is_none_or(|t| now - t >= WARN_EVERY) {
                    self.last_replay_warn = Some(now);
                    tracing::warn!(replica = %self.id, rank, error = %e, "KV event replay failed (further failures logged at most every 10 s; see kvmesh_kv_events_clears_total)");
                }
                r.tracker.replay_failed()
            }
            Input::Replayed(..) | Input::ReplayDone(_) | Input::ReplayFailed(..) => Vec::new(),
        };
        let mut ops = Vec::new();
        for action in actions {
            match action {
                Action::Apply { payload, .. } => match decode_batch(&payload) {
                    Ok(batch) => {
                        self.index.apply(rank, &batch, &mut ops);
                        self.metrics.batches.with_label_values(&[&self.id]).inc();
                        if batch
                            .events
                            .iter()
                            .any(|e| matches!(e, crate::kv_events::KvEvent::AllBlocksCleared))
                        {
                            self.count_clear("all_blocks_cleared");
                        }
                    }
                    Err(e) => self.malformed_payload(&e),
                },
                Action::Clear(reason) => {
                    let now = Instant::now();
                    if self.last_clear_log.is_none_or(|t| now - t >= WARN_EVERY) {
                        self.last_clear_log = Some(now);
                        tracing::info!(replica = %self.id, rank, reason = reason.as_str(), "clearing the replica's event-fed blocks (further clears counted in kvmesh_kv_events_clears_total, logged at most every 10 s)");
                    }
                    self.count_clear(reason.as_str());
                    self.index.clear_rank(rank, &mut ops);
                }
                Action::RequestReplay { from } => self.request_replay(rank, from),
            }
        }
        self.after(ops);
    }

    fn request_replay(&mut self, rank: usize, from: u64) {
        let Some(r) = self.ranks.get_mut(rank) else {
            return;
        };
        let Some(endpoint) = r.replay_endpoint.clone() else {
            return;
        };
        let id = self.next_replay;
        self.next_replay += 1;
        r.replay_id = id;
        tracing::debug!(replica = %self.id, rank, from, "requesting KV event replay");
        tokio::spawn(replay(
            endpoint,
            self.limits,
            rank,
            id,
            from,
            self.tx.clone(),
        ));
    }

    fn count_clear(&self, reason: &str) {
        self.metrics
            .clears
            .with_label_values(&[&self.id, reason])
            .inc();
    }

    fn malformed(&mut self, why: &str) {
        self.metrics.malformed.with_label_values(&[&self.id]).inc();
        let now = Instant::now();
        if self.last_warn.is_none_or(|t| now - t >= WARN_EVERY) {
            self.last_warn = Some(now);
            tracing::warn!(replica = %self.id, problem = why, "dropping malformed KV event message (further ones counted, not logged, for 10 s)");
        }
    }

    fn malformed_payload(&mut self, e: &crate::kv_events::WireError) {
        let text = e.to_string();
        self.malformed(&text);
    }

    /// Carries the operations to the node, follows the engine's block size, updates metrics and
    /// the exact/approximate switch.
    fn after(&mut self, ops: Vec<Op>) {
        if let Err(e) = self.sink.apply_ops(self.i, &ops) {
            tracing::warn!(replica = %self.id, error = %e, "cannot apply KV events");
        }
        if let Some(bs) = self.index.block_size() {
            self.sink.learn_block_size(self.i, bs);
        }
        let m = &self.metrics;
        m.exact_blocks
            .with_label_values(&[&self.id])
            .set(self.index.len() as i64);
        let s = self.index.stats();
        for (reason, total) in [
            ("unknown_parent", s.unknown_parent),
            ("unknown_removed", s.unknown_removed),
            ("other_group", s.other_group),
            ("unsupported", s.unsupported),
            ("malformed_event", s.malformed),
            ("over_capacity", s.over_capacity),
            ("unknown_copied", s.unknown_copied),
        ] {
            let seen = self.reported.entry(reason).or_insert(0);
            if total > *seen {
                m.skipped
                    .with_label_values(&[&self.id, reason])
                    .inc_by(total - *seen);
                *seen = total;
            }
        }
        let up = self
            .ranks
            .iter()
            .all(|r| r.connected && !r.tracker.replaying());
        if up != self.exact {
            match self.sink.set_exact(self.i, up, &self.index.tiered_keys()) {
                Ok(()) => {
                    self.exact = up;
                    // A new exact model of a multi-rank replica learns who holds what.
                    let sets = self.index.rank_sets();
                    if up && !sets.is_empty() {
                        if let Err(e) = self.sink.apply_ops(self.i, &[Op::Ranks(sets)]) {
                            tracing::warn!(replica = %self.id, error = %e, "cannot apply rank sets");
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(replica = %self.id, error = %e, "cannot switch cache model")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_replies_with_and_without_topic() {
        let b = |s: &[u8]| Bytes::copy_from_slice(s);
        let seq = 7u64.to_be_bytes();
        assert_eq!(
            parse_replay_reply(vec![b(b""), b(&seq), b(b"p")]).unwrap(),
            Some((7, b(b"p")))
        );
        assert_eq!(
            parse_replay_reply(vec![b(b""), b(b"kv-events"), b(&seq), b(b"p")]).unwrap(),
            Some((7, b(b"p")))
        );
        // An empty topic is a frame too.
        assert_eq!(
            parse_replay_reply(vec![b(b""), b(b""), b(&seq), b(b"p")]).unwrap(),
            Some((7, b(b"p")))
        );
        for end in [
            vec![b(b""), b(&END_OF_REPLAY_SEQ), b(b"")],
            vec![b(b""), b(b""), b(&END_OF_REPLAY_SEQ), b(b"")],
        ] {
            assert_eq!(parse_replay_reply(end).unwrap(), None);
        }
        assert!(parse_replay_reply(vec![b(b""), b(b"short"), b(b"p")]).is_err());
        assert!(parse_replay_reply(vec![b(b"")]).is_err());
    }

    #[test]
    fn endpoints_offset_by_rank() {
        let s = KvEventsSource {
            replay: Some("tcp://10.0.0.1:5558".into()),
            dp_ranks: 2,
            ..KvEventsSource::new("tcp://10.0.0.1:5557")
        };
        s.validate().unwrap();
        assert_eq!(
            s.rank_endpoints().unwrap(),
            vec![
                (
                    "tcp://10.0.0.1:5557".to_owned(),
                    Some("tcp://10.0.0.1:5558".to_owned())
                ),
                (
                    "tcp://10.0.0.1:5558".to_owned(),
                    Some("tcp://10.0.0.1:5559".to_owned())
                ),
            ]
        );
        for (bad, field) in [
            ("tcp://*:5557", "endpoint"),
            ("http://a:1", "endpoint"),
            ("tcp://a", "endpoint"),
            ("tcp://a:65535", "endpoint"),
        ] {
            let s = KvEventsSource {
                dp_ranks: 2,
                ..KvEventsSource::new(bad)
            };
            assert_eq!(s.validate().unwrap_err().0, field, "{bad}");
        }
        for (s, field) in [
            (
                KvEventsSource {
                    max_message_bytes: 10,
                    ..KvEventsSource::new("tcp://a:1")
                },
                "max_message_bytes",
            ),
            (
                KvEventsSource {
                    max_buffered_bytes: usize::MAX,
                    ..KvEventsSource::new("tcp://a:1")
                },
                "max_buffered_bytes",
            ),
        ] {
            assert_eq!(s.validate().unwrap_err().0, field);
        }
        let parsed: KvEventsSource =
            toml::from_str("endpoint = \"tcp://a:1\"\nmax_message_bytes = 65536\n").unwrap();
        assert_eq!(
            (parsed.max_message_bytes, parsed.max_buffered_bytes),
            (65536, DEFAULT_MAX_BUFFERED_BYTES)
        );
    }
}
