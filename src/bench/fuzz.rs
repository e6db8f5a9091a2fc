//! A structure-aware mutation fuzzer for every decoder that reads outside bytes, on the stable
//! toolchain: gossip values, summary messages and requests, block reports, load updates, KV
//! events (and the index they feed), the ZMTP frame reader, Prometheus text, `/v1/models`
//! answers, request bodies and the node configuration.
//!
//! Each [`Target`] starts from valid encodings of its type (built with the project's own
//! encoders) and mutates them with a seeded RNG — bit flips, interesting bytes, truncation,
//! insertion, deletion, splices of two corpus entries, big integers over 1–8-byte windows,
//! msgpack length markers announcing 2^32 elements, and for text formats tokens like `1e308`,
//! `"`, `{`, `[[`. Every input runs under [`std::panic::catch_unwind`]; a panic is a finding. A
//! decoder that accepts an input must also respect its stated bounds (a delta's key count, a
//! scraped capacity, a Bloom filter's hash count, the frames of a ZMTP message…): a breach is a
//! *violation*, reported like a panic. Inputs that decode join the corpus (at most
//! [`MAX_CORPUS`]), so mutations stack on valid structure. The slowest input is timed, which
//! is how a decoder that loops on a peer's number shows up.
//!
//! `cargo run --release --example fuzz -- --iterations N [--target NAME] [--seed S]` runs it;
//! `tests` run a few thousand inputs per target.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::core::keys::BlockKey;
use crate::core::prompt::RoutingFields;
use crate::core::summary::{
    ReplicaSummary, SummaryConfig, SummaryMessage, MAX_BLOOM_HASHES, MAX_DELTA_KEYS,
    MAX_SUMMARY_MESSAGE_BYTES,
};
use crate::kv_events::wire::{
    decode_batch, encode_batch, encode_batch_legacy, KvEvent, END_OF_REPLAY_SEQ,
    MAX_EVENTS_PER_BATCH, MAX_HASHES_PER_EVENT, MAX_TOKENS_PER_EVENT,
};
use crate::mesh::load_share::{LoadEntry, LoadShareConfig, LoadUpdate, PeerLoads, RoutedTip};
use crate::mesh::schema::{
    HomesRecord, InflightRecord, NodeRecord, ReplicaRecord, RttRecord, SummaryVersion, WireHealth,
    WireLoad, MAX_REPLICA_ID_BYTES,
};
use crate::mesh::sync::{BlockReport, SummaryRequest, MAX_REPORT_KEYS};
use crate::node::config::NodeConfig;
use crate::replicas::kv_index::{EventIndex, MAX_BLOCKS_PER_RANK};
use crate::replicas::probe;
use crate::replicas::prom::{self, MAX_BLOCK_SIZE, MAX_CAPACITY_TOKENS};
use crate::replicas::zmtp::{self, ZmtpLimits};

/// Most inputs kept in a target's corpus.
pub const MAX_CORPUS: usize = 512;
/// Largest input the mutator grows to.
const MAX_INPUT: usize = 64 << 10;

/// One decoder under test.
pub struct Target {
    /// Name (`--target`).
    pub name: &'static str,
    /// Valid encodings to start from.
    pub seeds: fn() -> Vec<Vec<u8>>,
    /// Decodes an input: `Ok(true)` accepted (within bounds), `Ok(false)` refused as an error,
    /// `Err` a bound the accepted value breaks.
    pub run: fn(&[u8]) -> Result<bool, String>,
    /// A text format: mutations also splice text tokens.
    pub text: bool,
}

/// What one target's run found.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Target name.
    pub name: &'static str,
    /// Inputs run.
    pub inputs: u64,
    /// Inputs the decoder accepted.
    pub accepted: u64,
    /// Inputs that panicked.
    pub panics: u64,
    /// Accepted inputs that broke a stated bound.
    pub violations: u64,
    /// Wall time.
    pub elapsed: Duration,
    /// The slowest single input.
    pub slowest: Duration,
    /// The first finding: the input and what happened.
    pub first_finding: Option<(Vec<u8>, String)>,
}

impl Report {
    /// Inputs per second.
    pub fn rate(&self) -> f64 {
        self.inputs as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Every target, in a fixed order.
pub fn targets() -> Vec<Target> {
    vec![
        Target {
            name: "gossip_node",
            seeds: seeds_node,
            run: |b| gossip(b, |s| NodeRecord::decode(s).is_ok()),
            text: false,
        },
        Target {
            name: "gossip_replica",
            seeds: seeds_replica,
            run: run_gossip_replica,
            text: false,
        },
        Target {
            name: "gossip_inflight",
            seeds: seeds_inflight,
            run: |b| gossip(b, |s| InflightRecord::decode(s).is_ok()),
            text: false,
        },
        Target {
            name: "gossip_homes_rtt",
            seeds: seeds_homes_rtt,
            run: |b| {
                gossip(b, |s| {
                    HomesRecord::decode(s).is_ok() | RttRecord::decode(s).is_ok()
                })
            },
            text: false,
        },
        Target {
            name: "summary_message",
            seeds: seeds_summary,
            run: run_summary,
            text: false,
        },
        Target {
            name: "summary_request",
            seeds: seeds_summary_request,
            run: run_summary_request,
            text: false,
        },
        Target {
            name: "block_report",
            seeds: seeds_block_report,
            run: run_block_report,
            text: false,
        },
        Target {
            name: "load_update",
            seeds: seeds_load_update,
            run: run_load_update,
            text: false,
        },
        Target {
            name: "kv_events",
            seeds: seeds_kv,
            run: run_kv,
            text: false,
        },
        Target {
            name: "zmtp_frames",
            seeds: seeds_zmtp,
            run: run_zmtp,
            text: false,
        },
        Target {
            name: "prometheus",
            seeds: seeds_prom,
            run: run_prom,
            text: true,
        },
        Target {
            name: "models_list",
            seeds: || {
                vec![br#"{"object":"list","data":[{"id":"meta-llama/Llama-3.1-8B","object":"model","max_model_len":8192},{"id":"lora-a","parent":"x"}]}"#.to_vec()]
            },
            run: run_models,
            text: true,
        },
        Target {
            name: "request_body",
            seeds: seeds_request,
            run: run_request,
            text: true,
        },
        Target {
            name: "config",
            seeds: seeds_config,
            run: run_config,
            text: true,
        },
    ]
}

/// Runs `iterations` inputs through `target` from `seed`; panics are caught, never propagated.
pub fn fuzz(target: &Target, iterations: u64, seed: u64) -> Report {
    let mut rng = SmallRng::seed_from_u64(seed ^ fnv(target.name));
    let mut corpus = (target.seeds)();
    if corpus.is_empty() {
        corpus.push(Vec::new());
    }
    let mut report = Report {
        name: target.name,
        ..Report::default()
    };
    let start = Instant::now();
    let mut input = Vec::new();
    for n in 0..iterations {
        input.clear();
        // Every seed once as is, then mutants; now and then plain random bytes.
        if (n as usize) < corpus.len() {
            input.extend_from_slice(&corpus[n as usize]);
        } else if rng.random_ratio(1, 64) {
            let len = rng.random_range(0..256);
            input.extend((0..len).map(|_| rng.random::<u8>()));
        } else {
            let base = &corpus[rng.random_range(0..corpus.len())];
            input.extend_from_slice(base);
            let rounds = 1 + rng.random_range(0..4);
            for _ in 0..rounds {
                mutate(&mut rng, &mut input, &corpus, target.text);
            }
        }
        let t0 = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(|| (target.run)(&input)));
        let took = t0.elapsed();
        report.slowest = report.slowest.max(took);
        report.inputs += 1;
        let finding = match outcome {
            Ok(Ok(true)) => {
                report.accepted += 1;
                if corpus.len() < MAX_CORPUS {
                    corpus.push(input.clone());
                } else if rng.random_ratio(1, 16) {
                    let i = rng.random_range(0..corpus.len());
                    corpus[i] = input.clone();
                }
                None
            }
            Ok(Ok(false)) => None,
            Ok(Err(violation)) => {
                report.violations += 1;
                Some(format!("bound violated: {violation}"))
            }
            Err(payload) => {
                report.panics += 1;
                let msg = payload
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "non-string panic".to_owned());
                Some(format!("panic: {msg}"))
            }
        };
        if let (Some(what), None) = (finding, &report.first_finding) {
            report.first_finding = Some((input.clone(), what));
        }
    }
    report.elapsed = start.elapsed();
    report
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Bytes that mean something in msgpack or at boundaries.
const INTERESTING_BYTES: [u8; 24] = [
    0x00, 0x01, 0x7f, 0x80, 0xff, 0xc0, 0xc2, 0xc3, 0xc4, 0xc5, 0xc6, 0xca, 0xcb, 0xcc, 0xcf, 0xd0,
    0xd3, 0xd9, 0xdb, 0xdc, 0xdd, 0xde, 0xdf, 0x90,
];

/// Integers worth writing over a window.
const INTERESTING_INTS: [u64; 12] = [
    0,
    1,
    0x7f,
    0xff,
    0x7fff,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    1 << 32,
    1 << 40,
    i64::MAX as u64,
    u64::MAX,
];

/// Tokens spliced into text formats.
const TEXT_TOKENS: [&str; 28] = [
    "\"",
    "{",
    "}",
    "[",
    "]",
    "[[",
    "]]",
    "=",
    ",",
    ":",
    "\n",
    "\\",
    "\\u0000",
    "1e308",
    "-1",
    "NaN",
    "+Inf",
    "18446744073709551616",
    "99999999999999999999999",
    "0",
    "-0.0",
    "4294967296",
    "true",
    "null",
    "\u{1e}",
    "\u{feff}",
    "#",
    "' '",
];

/// Applies one random mutation to `input`.
fn mutate(rng: &mut SmallRng, input: &mut Vec<u8>, corpus: &[Vec<u8>], text: bool) {
    let len = input.len();
    let pos = |rng: &mut SmallRng| {
        if len == 0 {
            0
        } else {
            rng.random_range(0..len)
        }
    };
    let kinds = if text { 12 } else { 10 };
    match rng.random_range(0..kinds) {
        0 if len > 0 => {
            let i = pos(rng);
            input[i] ^= 1 << rng.random_range(0..8);
        }
        1 if len > 0 => {
            let i = pos(rng);
            input[i] = INTERESTING_BYTES[rng.random_range(0..INTERESTING_BYTES.len())];
        }
        2 if len > 0 => input.truncate(pos(rng)),
        3 => {
            let i = pos(rng);
            let n = rng.random_range(1..16);
            let bytes: Vec<u8> = (0..n).map(|_| rng.random()).collect();
            input.splice(i..i, bytes);
        }
        4 if len > 1 => {
            let i = pos(rng);
            let end = (i + rng.random_range(1..16)).min(len);
            input.drain(i..end);
        }
        5 => {
            // Splice: this input's head, another's tail.
            let other = &corpus[rng.random_range(0..corpus.len())];
            let cut = pos(rng);
            let from = if other.is_empty() {
                0
            } else {
                rng.random_range(0..other.len())
            };
            input.truncate(cut);
            input.extend_from_slice(&other[from..]);
        }
        6 if len > 0 => {
            // Duplicate a range.
            let i = pos(rng);
            let end = (i + rng.random_range(1..64)).min(len);
            let chunk = input[i..end].to_vec();
            let at = pos(rng);
            input.splice(at..at, chunk);
        }
        7 | 8 if len > 0 => {
            // A big integer over a 1, 2, 4 or 8-byte window, either endianness.
            let v = INTERESTING_INTS[rng.random_range(0..INTERESTING_INTS.len())];
            let width = [1usize, 2, 4, 8][rng.random_range(0..4)];
            let bytes = if rng.random() {
                v.to_be_bytes()
            } else {
                v.to_le_bytes()
            };
            let i = pos(rng);
            let slice = if rng.random() {
                &bytes[8 - width..]
            } else {
                &bytes[..width]
            };
            for (k, b) in slice.iter().enumerate() {
                if let Some(slot) = input.get_mut(i + k) {
                    *slot = *b;
                }
            }
        }
        9 => {
            // A msgpack length marker announcing a huge array, map, string or blob.
            let marker = [0xdd, 0xdf, 0xdb, 0xc6][rng.random_range(0..4)];
            let i = pos(rng);
            let n = INTERESTING_INTS[rng.random_range(0..INTERESTING_INTS.len())] as u32;
            let mut m = vec![marker];
            m.extend_from_slice(&n.to_be_bytes());
            input.splice(i..i, m);
        }
        10 | 11 => {
            let tok = TEXT_TOKENS[rng.random_range(0..TEXT_TOKENS.len())].as_bytes();
            let i = pos(rng);
            if rng.random() || len == 0 {
                input.splice(i..i, tok.iter().copied());
            } else {
                let end = (i + rng.random_range(1..8)).min(len);
                input.splice(i..end, tok.iter().copied());
            }
        }
        _ => {
            let i = pos(rng);
            input.insert(i.min(input.len()), rng.random());
        }
    }
    input.truncate(MAX_INPUT);
}

// ---- gossip values ----

/// Gossip values are base64 of msgpack: mutate the msgpack, decode its base64 (and the raw
/// bytes as text, for the base64 layer itself).
fn gossip(bytes: &[u8], decode: impl Fn(&str) -> bool) -> Result<bool, String> {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
    let ok = decode(&b64);
    decode(&String::from_utf8_lossy(bytes));
    Ok(ok)
}

fn unbase64(s: &str) -> Vec<u8> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .unwrap_or_default()
}

fn seeds_node() -> Vec<Vec<u8>> {
    let r = NodeRecord {
        schema: 1,
        region: "eu-west".into(),
        zone: "a".into(),
        http_url: "http://10.0.0.1:8080".into(),
        quic_addr: "10.0.0.1:7946"
            .parse()
            .unwrap_or(([127, 0, 0, 1], 1).into()),
        version: "0.1.0".into(),
        generation: 1_700_000_000_000,
    };
    r.encode().map(|s| vec![unbase64(&s)]).unwrap_or_default()
}

fn replica_record() -> ReplicaRecord {
    ReplicaRecord {
        url: "http://10.0.0.5:8000".into(),
        region: "eu".into(),
        zone: "z".into(),
        pool: "shared".into(),
        models: vec!["llama".into(), "lora-a".into()],
        capacity_tokens: 450_000,
        prefill_tokens_per_s: 50_000.0,
        prefill_attention_ms_per_pair: Some(9.5e-7),
        max_in_flight: 256,
        health: WireHealth::Healthy,
        load: WireLoad {
            waiting: 3,
            running: 7,
            kv_usage: 0.5,
            queued_prefill_tokens: 1234,
        },
        summary: SummaryVersion {
            epoch: 1_700_000_000_000,
            seq: 42,
            digest: u64::MAX,
        },
        origin: "n1".into(),
        pd: Some(crate::mesh::schema::WirePd {
            role: crate::core::role::Role::Prefill,
            bootstrap_port: Some(8998),
            engine_id: "engine-0".into(),
        }),
        kv_events: Some(crate::mesh::schema::WireKvEvents {
            port: 5557,
            replay_port: Some(5558),
            topic: "kv".into(),
            dp_ranks: 2,
        }),
        kv_shares: Some(std::collections::BTreeMap::from([("big".into(), 600)])),
        kv_load: Some(crate::core::kv_load::KvLoad::default()),
    }
}

fn seeds_replica() -> Vec<Vec<u8>> {
    replica_record()
        .encode()
        .map(|s| vec![unbase64(&s)])
        .unwrap_or_default()
}

fn run_gossip_replica(bytes: &[u8]) -> Result<bool, String> {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
    let _ = ReplicaRecord::decode(&String::from_utf8_lossy(bytes));
    match ReplicaRecord::decode(&b64) {
        Ok(r) => {
            // What a learner builds from it must not panic either.
            let _ = r.info("fuzzed");
            let _ = r.load.to_load(1);
            Ok(true)
        }
        Err(_) => Ok(false),
    }
}

fn seeds_inflight() -> Vec<Vec<u8>> {
    let r = InflightRecord::fit((0..20).map(|i| (format!("10.0.0.{i}:8000"), i + 1)));
    r.encode().map(|s| vec![unbase64(&s)]).unwrap_or_default()
}

fn seeds_homes_rtt() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    if let Ok(s) = (HomesRecord {
        count: 12,
        round: 99,
    })
    .encode()
    {
        out.push(unbase64(&s));
    }
    let mut rtt = RttRecord::default();
    rtt.ms.insert("eu".into(), 1.5);
    rtt.ms.insert("us".into(), 80.0);
    if let Ok(s) = rtt.encode() {
        out.push(unbase64(&s));
    }
    out
}

// ---- summaries, requests, reports ----

fn summary_cfg() -> SummaryConfig {
    SummaryConfig::for_cluster("fuzz")
}

fn seeds_summary() -> Vec<Vec<u8>> {
    let cfg = summary_cfg();
    let mut out = Vec::new();
    if let Ok(mut s) = ReplicaSummary::new(7, 64, &cfg) {
        let keys: Vec<BlockKey> = (0..40).map(BlockKey).collect();
        s.insert(&keys[..20]);
        s.insert(&keys[20..]);
        for msg in [s.answer(7, 1), s.answer(0, 0)] {
            if let Ok(b) = msg.encode() {
                out.push(b);
            }
        }
    }
    out
}

fn run_summary(bytes: &[u8]) -> Result<bool, String> {
    let cfg = summary_cfg();
    let Ok(msg) = SummaryMessage::decode(bytes) else {
        return Ok(false);
    };
    match &msg {
        SummaryMessage::Delta(d) => {
            if d.keys.len() > MAX_DELTA_KEYS {
                return Err(format!("delta of {} keys", d.keys.len()));
            }
            if let Ok(mut s) = ReplicaSummary::new(d.epoch, 64, &cfg) {
                let _ = s.apply_delta(d);
                let _ = s.hit(&[BlockKey(1), BlockKey(2)]);
            }
        }
        SummaryMessage::Snapshot(snap) => {
            if let Ok(s) = ReplicaSummary::from_snapshot(snap, &cfg) {
                if s.geometry().hashes() > MAX_BLOOM_HASHES {
                    return Err(format!("{} Bloom hashes", s.geometry().hashes()));
                }
                if s.filter_bytes() > MAX_SUMMARY_MESSAGE_BYTES {
                    return Err(format!("{} filter bytes", s.filter_bytes()));
                }
                let _ = s.hit(&[BlockKey(1), BlockKey(2), BlockKey(3)]);
                let h = s.key_hasher().hash(BlockKey(5));
                let _ = s.contains_hashed(h);
                let mut pos = vec![0u32; s.geometry().hashes() as usize];
                if s.geometry().probe_positions(h, &mut pos) {
                    let _ = s.contains_positions(&pos);
                }
                let _ = s.tier_of(BlockKey(9));
            }
        }
    }
    Ok(true)
}

fn seeds_summary_request() -> Vec<Vec<u8>> {
    SummaryRequest {
        replica_id: "10.0.0.5:8000".into(),
        epoch: 1_700_000_000_000,
        seq: 17,
    }
    .encode()
    .map(|b| vec![b])
    .unwrap_or_default()
}

fn run_summary_request(bytes: &[u8]) -> Result<bool, String> {
    match SummaryRequest::decode(bytes) {
        Ok(r) if r.replica_id.is_empty() || r.replica_id.len() > MAX_REPLICA_ID_BYTES => {
            Err(format!("replica id of {} bytes", r.replica_id.len()))
        }
        Ok(_) => Ok(true),
        Err(_) => Ok(false),
    }
}

fn seeds_block_report() -> Vec<Vec<u8>> {
    BlockReport {
        replica_id: "r0".into(),
        keys: vec![1, 2, u64::MAX, 1 << 40],
        kv_tenant: Some("big".into()),
    }
    .encode()
    .map(|b| vec![b])
    .unwrap_or_default()
}

fn run_block_report(bytes: &[u8]) -> Result<bool, String> {
    match BlockReport::decode(bytes) {
        Ok(r) if r.keys.len() > MAX_REPORT_KEYS => Err(format!("{} keys", r.keys.len())),
        Ok(r) if r.replica_id.is_empty() || r.replica_id.len() > MAX_REPLICA_ID_BYTES => {
            Err(format!("replica id of {} bytes", r.replica_id.len()))
        }
        Ok(_) => Ok(true),
        Err(_) => Ok(false),
    }
}

fn seeds_load_update() -> Vec<Vec<u8>> {
    LoadUpdate {
        origin: 99,
        seq: 5,
        entries: vec![
            LoadEntry {
                replica: "r0".into(),
                in_flight: 3,
                pending_tokens: 4000,
            },
            LoadEntry {
                replica: "r1".into(),
                in_flight: 0,
                pending_tokens: 0,
            },
        ],
        tips: vec![RoutedTip {
            replica: "r0".into(),
            key: 77,
            blocks: 12,
            ready_ms: 30,
            rank: Some(3),
            first_byte: false,
            withdrawn: false,
        }],
    }
    .encode()
    .map(|b| vec![b])
    .unwrap_or_default()
}

fn run_load_update(bytes: &[u8]) -> Result<bool, String> {
    let Ok(u) = LoadUpdate::decode(bytes) else {
        return Ok(false);
    };
    let cfg = LoadShareConfig::default();
    let ids: Vec<String> = u.entries.iter().map(|e| e.replica.clone()).collect();
    let mut peers = PeerLoads::new(cfg);
    let from = std::net::SocketAddr::from(([127, 0, 0, 1], 7946));
    let max = 256u32;
    let _ = peers.apply(from, u, Duration::from_secs(1), |_| Some(max));
    for id in &ids {
        let (n, pending) = peers.totals(id);
        if n > max || pending > u64::from(max) * cfg.max_tokens_per_request {
            return Err(format!("claim of {n} requests, {pending} tokens"));
        }
    }
    Ok(true)
}

// ---- KV events ----

fn hex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .filter_map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok())
        .collect()
}

/// engines.md §7's golden vectors, array and map form.
const GOLDEN_ARRAY: &str = "93cb3ff8000000000000939aab426c6f636b53746f72656492cfffffffffffffffff07c0940102030402c0a3475055c0c0c094ac426c6f636b52656d6f7665649107a3475055c091b0416c6c426c6f636b73436c656172656400";
const GOLDEN_MAP: &str = "93cb3ff80000000000009389a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfffffffffffffffff07b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f6964780083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739107a66d656469756da347505581a474797065b0416c6c426c6f636b73436c656172656400";

/// Real vLLM 0.32 messages (`tests/data/vllm-0.32-kv-events.json`): each live message's frames.
fn captured_frames() -> Vec<Vec<Vec<u8>>> {
    let text = include_str!("../../tests/data/vllm-0.32-kv-events.json");
    let Ok(v) = serde_json::from_str::<serde_json::Value>(text) else {
        return Vec::new();
    };
    v.get("live")
        .and_then(|l| l.as_array())
        .map(|msgs| {
            msgs.iter()
                .filter_map(|m| m.as_array())
                .map(|frames| frames.iter().filter_map(|f| f.as_str()).map(hex).collect())
                .collect()
        })
        .unwrap_or_default()
}

fn seeds_kv() -> Vec<Vec<u8>> {
    let mut out = vec![hex(GOLDEN_ARRAY), hex(GOLDEN_MAP)];
    out.extend(
        captured_frames()
            .into_iter()
            .filter_map(|f| f.get(2).cloned()),
    );
    if let Ok(batch) = decode_batch(&hex(GOLDEN_MAP)) {
        out.push(encode_batch(&batch));
        out.push(encode_batch_legacy(&batch));
    }
    out
}

fn run_kv(bytes: &[u8]) -> Result<bool, String> {
    let Ok(batch) = decode_batch(bytes) else {
        return Ok(false);
    };
    if batch.events.len() > MAX_EVENTS_PER_BATCH {
        return Err(format!("{} events", batch.events.len()));
    }
    for e in &batch.events {
        match e {
            KvEvent::BlockStored(s)
                if s.block_hashes.len() > MAX_HASHES_PER_EVENT
                    || s.token_ids.len() > MAX_TOKENS_PER_EVENT =>
            {
                return Err("stored event over its caps".into());
            }
            KvEvent::BlockRemoved(r) if r.block_hashes.len() > MAX_HASHES_PER_EVENT => {
                return Err("removed event over its cap".into());
            }
            _ => {}
        }
    }
    // The index it feeds reads the same outside values.
    let mut index = EventIndex::new(2);
    let mut ops = Vec::new();
    index.apply(0, &batch, &mut ops);
    index.apply(1, &batch, &mut ops);
    if index.len() > 2 * MAX_BLOCKS_PER_RANK {
        return Err(format!("index of {} blocks", index.len()));
    }
    let _ = index.tiered_keys();
    Ok(true)
}

// ---- ZMTP frames ----

fn seeds_zmtp() -> Vec<Vec<u8>> {
    let seq = 7u64.to_be_bytes();
    let payload = hex(GOLDEN_ARRAY);
    let captured = captured_frames().into_iter().map(|frames| {
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        zmtp::encode_message(&refs).to_vec()
    });
    captured
        .chain([
            zmtp::encode_message(&[b"", &END_OF_REPLAY_SEQ, b""]).to_vec(),
            zmtp::encode_message(&[b"", &seq, &payload]).to_vec(),
            zmtp::encode_message(&[b"", b"kv@pod", &seq, &[0u8; 300]]).to_vec(),
            {
                let mut v = vec![0x04, 5, 4, b'P', b'I', b'N', b'G'];
                v.extend_from_slice(&zmtp::encode_message(&[b"x", b"y"]));
                v
            },
        ])
        .collect()
}

fn run_zmtp(bytes: &[u8]) -> Result<bool, String> {
    let limits = ZmtpLimits {
        max_frame_bytes: 4096,
        max_message_bytes: 8192,
        max_frames: 8,
    };
    let mut reader = bytes;
    let mut accepted = false;
    // Every message in the input, until an error or the end.
    for _ in 0..64 {
        match futures::executor::block_on(zmtp::read_message(&mut reader, &limits)) {
            Ok(frames) => {
                let total: usize = frames.iter().map(|f| f.len()).sum();
                if frames.len() > limits.max_frames || total > limits.max_message_bytes {
                    return Err(format!("{} frames, {total} bytes", frames.len()));
                }
                // A replay reply, as the DEALER reads it.
                let _ = crate::replicas::kv_events::parse_replay_reply(frames);
                accepted = true;
            }
            Err(_) => break,
        }
    }
    Ok(accepted)
}

// ---- Prometheus text ----

fn seeds_prom() -> Vec<Vec<u8>> {
    vec![
        concat!(
            "# HELP vllm:num_requests_running Number of requests.\n",
            "# TYPE vllm:num_requests_running gauge\n",
            "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n",
            "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 7.0\n",
            "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n",
            "vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",num_gpu_blocks=\"28000\",prefix_caching_hash_algo=\"sha{256}\"} 1.0\n",
            "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 1234 1700000000000\n",
        )
        .as_bytes()
        .to_vec(),
        b"sglang:num_queue_reqs{model_name=\"m\"} 4\nsglang:num_running_reqs 9\nsglang:token_usage{x=\"y\\\"}\"} 0.75\nvllm:gpu_cache_usage_perc 0.4\n".to_vec(),
    ]
}

fn run_prom(bytes: &[u8]) -> Result<bool, String> {
    let text = String::from_utf8_lossy(bytes);
    let l = prom::parse_engine_load(&text);
    if l.capacity_tokens
        .is_some_and(|c| c > MAX_CAPACITY_TOKENS || c == 0)
    {
        return Err(format!("capacity {:?}", l.capacity_tokens));
    }
    if l.block_size.is_some_and(|b| b > MAX_BLOCK_SIZE || b == 0) {
        return Err(format!("block size {:?}", l.block_size));
    }
    if l.kv_usage.is_some_and(|u| !(0.0..=1.0).contains(&u)) {
        return Err(format!("kv usage {:?}", l.kv_usage));
    }
    // Sums of bounded samples: finite and non-negative.
    for v in [l.waiting, l.running].into_iter().flatten() {
        if !v.is_finite() || v < 0.0 {
            return Err(format!("request count {v}"));
        }
    }
    Ok(l.skipped_lines == 0)
}

fn run_models(bytes: &[u8]) -> Result<bool, String> {
    match probe::parse_models(&String::from_utf8_lossy(bytes)) {
        Ok((ids, _)) => {
            if ids.len() > probe::MAX_MODELS
                || ids
                    .iter()
                    .any(|i| i.is_empty() || i.len() > probe::MAX_MODEL_ID_BYTES)
            {
                return Err(format!("{} model ids", ids.len()));
            }
            Ok(true)
        }
        Err(_) => Ok(false),
    }
}

// ---- request bodies ----

fn seeds_request() -> Vec<Vec<u8>> {
    [
        r#"{"model":"m","prompt":"Hello there","max_tokens":16,"stream":true}"#,
        r#"{"model":"m","prompt":["a","b"],"cache_salt":"s","user":"u1"}"#,
        r#"{"model":"m","prompt":[1,2,3,4294967295],"max_completion_tokens":5}"#,
        r#"{"model":"m","prompt":[[1,2],[3]]}"#,
        r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","name":"x","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"data:,"}}]},{"role":"assistant","content":null,"reasoning_content":"hm","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]}],"tools":[{"type":"function","function":{"name":"f"}}],"lora_path":"l"}"#,
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}

fn run_request(bytes: &[u8]) -> Result<bool, String> {
    let Ok(fields) = RoutingFields::parse(bytes) else {
        return Ok(false);
    };
    let mut out = String::new();
    let _ = fields.render(&mut out);
    let _ = fields.output_budget();
    // Rendering never expands a body by more than a small factor (token ids: "1," → "1 ").
    if out.len() > 4 * bytes.len() + 64 {
        return Err(format!("{} bytes rendered from {}", out.len(), bytes.len()));
    }
    Ok(true)
}

// ---- configuration ----

fn seeds_config() -> Vec<Vec<u8>> {
    vec![
        include_str!("../../config/node.toml").as_bytes().to_vec(),
        concat!(
            "listen = \"127.0.0.1:0\"\npolicy = \"p2c\"\n[health]\ninterval_ms = 100\n",
            "[[replicas]]\nurl = \"http://a:1\"\ncapacity_tokens = 1000\n",
            "kv_events = { endpoint = \"tcp://a:5557\", replay = \"tcp://a:5558\", dp_ranks = 2 }\n",
            "[[dns]]\nname = \"_http._tcp.x.\"\nkv_events = { port = 5557 }\n",
            "[tokenizer]\npath = \"/m/tokenizer.json\"\nblock_size = 16\n",
        )
        .as_bytes()
        .to_vec(),
    ]
}

fn run_config(bytes: &[u8]) -> Result<bool, String> {
    let text = String::from_utf8_lossy(bytes);
    let Ok(cfg) = NodeConfig::from_toml(&text) else {
        return Ok(false);
    };
    if cfg.validate().is_err() {
        return Ok(false);
    }
    let _ = cfg.policy_kind();
    let _ = cfg.connect_timeout();
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_target_survives_a_short_run() {
        for t in targets() {
            let r = fuzz(&t, 3_000, 1);
            assert_eq!(r.inputs, 3_000);
            assert!(r.accepted > 0, "{}: no seed decodes", t.name);
            assert!(
                r.first_finding.is_none(),
                "{}: {} panics, {} violations; first: {:?}",
                t.name,
                r.panics,
                r.violations,
                r.first_finding
            );
        }
    }

    #[test]
    fn the_captured_vllm_messages_seed_the_kv_targets() {
        let kv = seeds_kv();
        assert!(kv.len() >= 7, "{}", kv.len());
        assert!(kv.iter().all(|b| run_kv(b) == Ok(true)));
        assert!(seeds_zmtp().iter().all(|b| run_zmtp(b) == Ok(true)));
    }

    #[test]
    fn the_mutator_is_deterministic_per_seed() {
        let t = &targets()[0];
        let a = fuzz(t, 500, 9);
        let b = fuzz(t, 500, 9);
        assert_eq!((a.accepted, a.panics), (b.accepted, b.panics));
    }
}
