//! A node subscribed to a simulated replica's KV events (ZMQ on loopback): its cache model for
//! the replica holds exactly the blocks the replica stored, loses the ones it evicted, recovers
//! history published before the node started (replay from 0), and falls back to the
//! approximate model when the stream goes away.

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use kvmesh::core::cache_model::CacheSource;
use kvmesh::core::keys::{token_block_keys, BlockKey};
use kvmesh::engine_sim::tokens::tokenize;
use kvmesh::node::config::{NodeConfig, ReplicaConfig as NodeReplica};
use kvmesh::node::Node;
use kvmesh::proxy::{self, RunningNode};
use kvmesh::replica::{self, KvEventsConfig, ReplicaConfig, ReplicaHandle};
use kvmesh::replicas::kv_events::KvEventsSource;
use kvmesh::tokenize::token_namespace;
use serde_json::json;

const LIMIT: Duration = Duration::from_secs(30);
const MODEL: &str = "sim-llama-8b";
/// The simulated engine's block: 16 tokens of 4 bytes.
const BLOCK_TOKENS: usize = 16;
const BLOCK_BYTES: usize = BLOCK_TOKENS * 4;

async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(LIMIT, f)
        .await
        .expect("test exceeded its time bound")
}

/// A replica publishing KV events (with replay), holding `capacity_blocks` blocks.
async fn replica_with_events(capacity_blocks: usize) -> ReplicaHandle {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let mut cfg = ReplicaConfig {
        id: "r0".into(),
        exit_on_crash: false,
        kv_events: Some(KvEventsConfig::default()),
        ..ReplicaConfig::default()
    };
    cfg.engine.time_scale = 50.0;
    cfg.engine.kv_capacity_tokens = capacity_blocks * BLOCK_TOKENS;
    cfg.engine.max_model_len = capacity_blocks * BLOCK_TOKENS;
    replica::spawn(cfg).await.unwrap()
}

async fn node_for(r: &ReplicaHandle) -> RunningNode {
    proxy::install_crypto_provider();
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        drain_s: 2,
        ..NodeConfig::default()
    };
    cfg.health.interval_ms = 100;
    cfg.scrape.interval_ms = 100;
    cfg.timeouts.connect_ms = 500;
    cfg.replicas = vec![NodeReplica {
        id: Some("r0".into()),
        kv_events: Some(KvEventsSource {
            endpoint: format!("tcp://127.0.0.1:{}", r.kv_events_port.unwrap()),
            replay: r.kv_replay_port.map(|p| format!("tcp://127.0.0.1:{p}")),
            ..KvEventsSource::new("")
        }),
        ..NodeReplica::from_url(r.base_url())
    }];
    proxy::spawn(cfg).await.unwrap()
}

/// A prompt of exactly `blocks` full blocks, distinct per `seed`.
fn prompt(seed: &str, blocks: usize) -> String {
    let mut s = String::new();
    let mut i = 0;
    while s.len() < blocks * BLOCK_BYTES {
        s.push_str(&format!("{seed}-{i:05} "));
        i += 1;
    }
    s.truncate(blocks * BLOCK_BYTES);
    s
}

/// The keys of the blocks the simulated replica stores for `prompt`, computed from its token
/// blocks the way the node must compute them from events.
fn expected_keys(prompt: &str) -> Vec<BlockKey> {
    let mut keys = Vec::new();
    token_block_keys(
        token_namespace(None, None, None),
        &tokenize(prompt),
        BLOCK_TOKENS,
        &mut keys,
    );
    keys
}

async fn complete_direct(url: &str, prompt: &str) {
    let resp = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.bytes().await.unwrap();
}

async fn complete(node: &RunningNode, prompt: &str) {
    complete_direct(&format!("http://{}", node.addr), prompt).await;
}

fn source(node: &Arc<Node>) -> CacheSource {
    node.lock().replicas[0].cache.source()
}

/// Polls `f` every 20 ms until it holds.
async fn until(mut f: impl FnMut() -> bool) {
    while !f() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn held(node: &Arc<Node>, keys: &[BlockKey]) -> usize {
    let core = node.lock();
    keys.iter()
        .filter(|k| core.replicas[0].cache.contains(**k))
        .count()
}

#[tokio::test]
async fn exact_model_holds_what_the_replica_stored_and_drops_evictions() {
    bounded(async {
        let r = replica_with_events(32).await;
        let node = node_for(&r).await;
        until(|| source(&node.node) == CacheSource::Exact).await;

        let a = prompt("alpha", 10);
        complete(&node, &a).await;
        let ka = expected_keys(&a);
        assert_eq!(ka.len(), 10);
        until(|| held(&node.node, &ka) == ka.len()).await;
        // Exactly those blocks: nothing routed-but-guessed, nothing else.
        assert_eq!(node.node.lock().replicas[0].cache.len(), ka.len());

        // Three more 12-block prompts overflow the 32-block cache: the oldest blocks go.
        let mut all: HashSet<BlockKey> = ka.iter().copied().collect();
        let mut last = Vec::new();
        for seed in ["beta", "gamma", "delta"] {
            let p = prompt(seed, 12);
            complete(&node, &p).await;
            last = expected_keys(&p);
            all.extend(&last);
        }
        until(|| held(&node.node, &last) == last.len()).await;
        until(|| held(&node.node, &ka) < ka.len()).await;
        {
            let core = node.node.lock();
            let model = &core.replicas[0].cache;
            assert!(
                model.len() <= 32,
                "{} blocks in a 32-block cache",
                model.len()
            );
            assert!(all.len() > 32);
            let live = all.iter().filter(|k| model.contains(**k)).count();
            assert_eq!(live, model.len(), "the model holds a block nobody stored");
        }

        node.shutdown().await;
        r.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn history_before_the_node_started_is_replayed() {
    bounded(async {
        let r = replica_with_events(256).await;
        let p = prompt("early", 8);
        complete_direct(&r.base_url(), &p).await;
        // Let the replica publish the batch before the node exists (no subscriber yet).
        tokio::time::sleep(Duration::from_millis(200)).await;
        let node = node_for(&r).await;
        let keys = expected_keys(&p);
        until(|| source(&node.node) == CacheSource::Exact && held(&node.node, &keys) == keys.len())
            .await;
        assert_eq!(node.node.lock().replicas[0].cache.len(), keys.len());
        node.shutdown().await;
        r.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn a_lost_stream_falls_back_to_the_approximate_model() {
    bounded(async {
        let r = replica_with_events(256).await;
        let node = node_for(&r).await;
        until(|| source(&node.node) == CacheSource::Exact).await;
        let p = prompt("kept", 4);
        complete(&node, &p).await;
        let keys = expected_keys(&p);
        until(|| held(&node.node, &keys) == keys.len()).await;
        // Another node's routed-block report is a guess: the exact model ignores it.
        let guessed = [BlockKey(42)];
        assert!(!node.node.record_report(0, &guessed));
        assert_eq!(held(&node.node, &guessed), 0);
        r.shutdown().await;
        until(|| source(&node.node) == CacheSource::Approximate).await;
        // Seeded with the last exact set, so routing keeps what it knew.
        assert_eq!(held(&node.node, &keys), keys.len());
        // And learns from reports again.
        assert!(node.node.record_report(0, &guessed));
        assert_eq!(held(&node.node, &guessed), 1);
        let metrics = node.node.metrics.render().unwrap();
        assert!(
            metrics.contains(
                "kvmesh_cache_source_switches_total{replica=\"r0\",to=\"approximate\"} 1"
            ),
            "{metrics}"
        );
        node.shutdown().await;
    })
    .await;
}

/// A word-level `tokenizer.json`: word `wN` has id N.
fn write_word_tokenizer(dir: &std::path::Path) -> std::path::PathBuf {
    let vocab: serde_json::Map<String, serde_json::Value> = (0..64)
        .map(|i| (format!("w{i}"), json!(i)))
        .chain(std::iter::once(("[UNK]".to_owned(), json!(64))))
        .collect();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, tokenizer.to_string()).unwrap();
    path
}

#[tokio::test]
async fn token_mode_keys_requests_by_the_models_token_ids() {
    bounded(async {
        let dir = std::env::temp_dir().join(format!("kvmesh-kv-events-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let r = replica_with_events(256).await;
        let mut cfg = NodeConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            drain_s: 2,
            tokenizer: Some(kvmesh::tokenize::TokenizerConfig {
                path: write_word_tokenizer(&dir),
                chat_template_config: None,
                block_size: Some(2),
                models: vec![MODEL.into()],
            }),
            ..NodeConfig::default()
        };
        cfg.replicas = vec![NodeReplica {
            id: Some("r0".into()),
            ..NodeReplica::from_url(r.base_url())
        }];
        proxy::install_crypto_provider();
        let node = proxy::spawn(cfg).await.unwrap();
        assert_eq!(node.node.lock().view.tokens_per_block, 2);
        complete(&node, "w5 w6 w7 w8 w9").await;
        let mut want = Vec::new();
        token_block_keys(
            token_namespace(None, None, None),
            &[5, 6, 7, 8, 9],
            2,
            &mut want,
        );
        assert_eq!(want.len(), 2);
        // No events configured: the approximate model records the routed token keys.
        assert_eq!(held(&node.node, &want), 2);
        assert_eq!(node.node.lock().replicas[0].cache.len(), 2);
        // A model the tokenizer is not for falls back to text keys, counted.
        let resp = reqwest::Client::new()
            .post(format!("http://{}/v1/completions", node.addr))
            .json(&json!({"model": "other", "prompt": "w1 w2"}))
            .send()
            .await
            .unwrap();
        resp.bytes().await.unwrap();
        let metrics = node.node.metrics.render().unwrap();
        assert!(
            metrics.contains("kvmesh_token_mode_fallbacks_total{reason=\"other_model\"} 1"),
            "{metrics}"
        );
        node.shutdown().await;
        r.shutdown().await;
        let _ = std::fs::remove_dir_all(&dir);
    })
    .await;
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Bytes captured from a real vLLM 0.32 (CPU build, block size 32, 40-block cache): three
/// completions with token-id prompts of 20 full blocks each, the third evicting the first; then a
/// DEALER replay from 0. See `source` in the file.
#[test]
fn captured_real_vllm_events_index_to_the_prompts_keys() {
    use kvmesh::kv_events::{decode_batch, KvEvent};
    use kvmesh::replicas::kv_index::{EventIndex, Op};
    let data: serde_json::Value =
        serde_json::from_str(include_str!("data/vllm-0.32-kv-events.json")).unwrap();
    let prompts: Vec<Vec<u32>> = serde_json::from_value(data["prompts"].clone()).unwrap();
    let live = data["live"].as_array().unwrap();
    assert_eq!(live.len(), 3);
    let mut index = EventIndex::new(1);
    let mut model: HashSet<BlockKey> = HashSet::new();
    let mut removed = 0;
    for (seq, msg) in live.iter().enumerate() {
        let frames: Vec<Vec<u8>> = msg
            .as_array()
            .unwrap()
            .iter()
            .map(|f| unhex(f.as_str().unwrap()))
            .collect();
        assert_eq!(frames.len(), 3);
        assert_eq!(frames[0], b"kv-events");
        assert_eq!(frames[1], (seq as u64).to_be_bytes());
        let batch = decode_batch(&frames[2]).unwrap();
        assert_eq!(batch.data_parallel_rank, Some(0));
        for e in &batch.events {
            match e {
                KvEvent::BlockStored(s) => {
                    assert_eq!(s.block_size, 32);
                    assert_eq!(s.kv_cache_spec_kind.as_deref(), Some("full_attention"));
                    // The stored tokens are the prompt's full blocks, in order.
                    assert_eq!(s.token_ids, prompts[seq][..s.token_ids.len()]);
                }
                KvEvent::BlockRemoved(r) => removed += r.block_hashes.len(),
                _ => {}
            }
        }
        let mut ops = Vec::new();
        index.apply(0, &batch, &mut ops);
        for op in ops {
            match op {
                Op::Store(k, _) => model.extend(k),
                Op::Remove(k) => k.iter().for_each(|x| {
                    model.remove(x);
                }),
                Op::Clear => model.clear(),
                // One rank: the index keeps no rank sets.
                Op::Ranks(_) => panic!("rank sets from a one-rank index"),
            }
        }
        // After each request the model holds every block of its prompt, keyed as token mode
        // keys a request for the same ids.
        let keys = expected_keys_tokens(&prompts[seq], 32);
        assert_eq!(keys.len(), 20);
        assert!(keys.iter().all(|k| model.contains(k)), "request {seq}");
    }
    let stats = index.stats();
    assert_eq!((stats.unknown_parent, stats.unknown_removed), (0, 0));
    assert!(removed > 0, "the third prompt evicted blocks");
    assert!(
        model.len() <= 40,
        "{} blocks in a 40-block cache",
        model.len()
    );
    let first = expected_keys_tokens(&prompts[0], 32);
    assert!(first.iter().any(|k| !model.contains(k)));
    // The replay answered the same batches, then the end marker.
    let replay = data["replay"].as_array().unwrap();
    for (seq, msg) in replay.iter().enumerate() {
        let frames: Vec<Vec<u8>> = msg
            .as_array()
            .unwrap()
            .iter()
            .map(|f| unhex(f.as_str().unwrap()))
            .collect();
        // vLLM 0.32 replays ["", topic, seq, payload] and ends with ["", "", ff×8, ""].
        assert_eq!(frames.len(), 4);
        assert!(frames[0].is_empty());
        if seq == live.len() {
            assert_eq!(frames[2], [0xff; 8]);
        } else {
            assert_eq!(frames[1], b"kv-events");
            assert_eq!(frames[2], (seq as u64).to_be_bytes());
            assert_eq!(
                frames[3],
                unhex(live[seq][2].as_str().unwrap()),
                "replayed payload {seq}"
            );
        }
    }
}

fn expected_keys_tokens(tokens: &[u32], block: usize) -> Vec<BlockKey> {
    let mut keys = Vec::new();
    token_block_keys(token_namespace(None, None, None), tokens, block, &mut keys);
    keys
}

/// A node whose replica `r0` (the simulated `r`, for a healthy HTTP side) takes its KV events
/// from a hand-driven publisher instead of the engine, so a test can publish any `medium`.
async fn node_with_publisher(
    r: &ReplicaHandle,
    publisher: &kvmesh::kv_events::KvPublisher,
) -> RunningNode {
    proxy::install_crypto_provider();
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        drain_s: 2,
        ..NodeConfig::default()
    };
    cfg.health.interval_ms = 100;
    cfg.scrape.interval_ms = 100;
    cfg.replicas = vec![NodeReplica {
        id: Some("r0".into()),
        kv_events: Some(KvEventsSource {
            endpoint: format!("tcp://127.0.0.1:{}", publisher.port()),
            replay: publisher
                .replay_port()
                .map(|p| format!("tcp://127.0.0.1:{p}")),
            ..KvEventsSource::new("")
        }),
        ..NodeReplica::from_url(r.base_url())
    }];
    proxy::spawn(cfg).await.unwrap()
}

#[tokio::test]
async fn cpu_events_reach_the_summary_and_the_hit_as_their_tier() {
    use kvmesh::core::summary::Tier;
    use kvmesh::core::view::TierHit;
    use kvmesh::kv_events::{
        BlockRemoved, BlockStored, EventBatch, KvEvent, KvPublisher, KvPublisherConfig,
    };
    fn stored(
        hashes: std::ops::RangeInclusive<u64>,
        parent: Option<u64>,
        tokens: &[u32],
        medium: &str,
    ) -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.collect(),
            parent_block_hash: parent,
            token_ids: tokens.to_vec(),
            block_size: BLOCK_TOKENS as u32,
            medium: Some(medium.into()),
            ..Default::default()
        })
    }
    fn batch(events: Vec<KvEvent>) -> EventBatch {
        EventBatch {
            ts: 0.0,
            events,
            data_parallel_rank: None,
        }
    }
    bounded(async {
        let r = replica_with_events(64).await;
        let publisher = KvPublisher::start(KvPublisherConfig {
            host: "127.0.0.1".into(),
            port: 0,
            replay_port: Some(0),
            topic: String::new(),
            buffer_steps: 1000,
        })
        .await
        .unwrap();
        let node = node_with_publisher(&r, &publisher).await;
        until(|| source(&node.node) == CacheSource::Exact).await;
        let tokens: Vec<u32> = (1000..1000 + 8 * BLOCK_TOKENS as u32).collect();
        let keys = expected_keys_tokens(&tokens, BLOCK_TOKENS);
        let half = 4 * BLOCK_TOKENS;
        // Blocks 0..4 in the GPU pool; 4..8 (their continuation) only in CPU memory.
        publisher.publish(batch(vec![
            stored(1..=4, None, &tokens[..half], "GPU"),
            stored(5..=8, Some(4), &tokens[half..], "CPU"),
        ]));
        let hit = || node.node.lock().view.hit_tiers(0, &keys, Duration::ZERO);
        until(|| hit().any == 8).await;
        assert_eq!(
            hit(),
            TierHit {
                gpu: 4,
                cpu: 8,
                any: 8
            }
        );
        {
            let core = node.node.lock();
            let summary = core.view.replica(0).unwrap().summary.as_ref().unwrap();
            assert!(summary.has_lower_tiers());
            assert_eq!(summary.tier_of(keys[0]), Some(Tier::Gpu));
            assert_eq!(summary.tier_of(keys[7]), Some(Tier::Cpu));
            // A reader that does not know tiers sees only the GPU blocks.
            assert_eq!(summary.hit(&keys), 4);
        }
        // Offload: blocks 2 and 3 get CPU copies, then their GPU copies go. The exact model
        // moves them to CPU; the filter keeps their stale GPU keys until its next epoch.
        publisher.publish(batch(vec![
            stored(3..=4, Some(2), &tokens[2 * BLOCK_TOKENS..half], "CPU"),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![3, 4],
                medium: Some("GPU".into()),
                group_idx: None,
            }),
        ]));
        let tier = |k: BlockKey| node.node.lock().replicas[0].cache.tier(k);
        until(|| tier(keys[3]) == Some(Tier::Cpu)).await;
        assert_eq!(tier(keys[2]), Some(Tier::Cpu));
        assert_eq!(tier(keys[1]), Some(Tier::Gpu));
        assert_eq!(node.node.lock().replicas[0].cache.stale(), 2);
        node.shutdown().await;
        r.shutdown().await;
    })
    .await;
}
