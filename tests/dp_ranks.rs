//! Data-parallel ranks end to end: a simulated replica with 4 ranks (one engine, prefix cache
//! and KV-event publisher each, on port + rank) behind a node that follows every rank's events
//! in token mode. With rank routing the node names the rank holding a conversation's prefix and
//! its follow-ups hit; with it off the replica's own balancer spreads them and most of the
//! prefix is recomputed.

use std::future::Future;
use std::time::Duration;

use kvmesh::core::cache_model::CacheSource;
use kvmesh::core::keys::{token_block_keys, BlockKey};
use kvmesh::engine_sim::tokens::tokenize;
use kvmesh::node::config::{NodeConfig, ReplicaConfig as NodeReplica};
use kvmesh::proxy::{self, RunningNode};
use kvmesh::replica::{KvEventsConfig, ReplicaHandle};
use kvmesh::replicas::kv_events::{KvEventsSource, RankRouting};
use kvmesh::tokenize::{token_namespace, TokenizerConfig, BUILTIN_SIM};
use serde_json::json;

mod common;
use common::sim_replica;

const LIMIT: Duration = Duration::from_secs(60);
const MODEL: &str = "sim-llama-8b";
/// The simulated engine's block: 16 tokens of 4 bytes.
const BLOCK_TOKENS: usize = 16;
const BLOCK_BYTES: usize = BLOCK_TOKENS * 4;
const RANKS: u16 = 4;

async fn bounded<F: Future>(f: F) -> F::Output {
    common::bounded(LIMIT.as_secs(), f).await
}

async fn dp_replica() -> ReplicaHandle {
    common::init_logs();
    sim_replica("r0", |c| {
        c.dp_ranks = RANKS;
        c.kv_events = Some(KvEventsConfig::default());
    })
    .await
}

async fn node_for(r: &ReplicaHandle, rank_routing: Option<RankRouting>) -> RunningNode {
    proxy::install_crypto_provider();
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        drain_s: 2,
        // The decision header names the rank the node chose.
        debug_headers: true,
        tokenizer: Some(TokenizerConfig {
            path: BUILTIN_SIM.into(),
            chat_template_config: None,
            block_size: Some(BLOCK_TOKENS as u32),
            models: vec![MODEL.into()],
        }),
        ..NodeConfig::default()
    };
    cfg.health.interval_ms = 100;
    cfg.scrape.interval_ms = 100;
    cfg.replicas = vec![NodeReplica {
        id: Some("r0".into()),
        kv_events: Some(KvEventsSource {
            replay: r.kv_replay_port.map(|p| format!("tcp://127.0.0.1:{p}")),
            dp_ranks: RANKS,
            rank_routing,
            ..KvEventsSource::new(format!("tcp://127.0.0.1:{}", r.kv_events_port.unwrap()))
        }),
        ..NodeReplica::from_url(r.base_url())
    }];
    let node = proxy::spawn(cfg).await.unwrap();
    until(|| node.node.lock().replicas[0].cache.source() == CacheSource::Exact).await;
    node
}

async fn until(mut f: impl FnMut() -> bool) {
    while !f() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A text of exactly `blocks` full blocks, distinct per `seed`.
fn text(seed: &str, blocks: usize) -> String {
    let mut s = String::new();
    let mut i = 0;
    while s.len() < blocks * BLOCK_BYTES {
        s.push_str(&format!("{seed}-{i:05} "));
        i += 1;
    }
    s.truncate(blocks * BLOCK_BYTES);
    s
}

fn keys(prompt: &str) -> Vec<BlockKey> {
    let mut out = Vec::new();
    token_block_keys(
        token_namespace(None, None, None),
        &tokenize(prompt),
        BLOCK_TOKENS,
        &mut out,
    );
    out
}

/// What one completion reported: the rank that served it and its cached tokens.
#[derive(Debug)]
struct Served {
    rank: u16,
    cached: u64,
}

async fn complete(url: &str, body: serde_json::Value, rank_header: Option<&str>) -> Served {
    let mut req = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(&body);
    if let Some(r) = rank_header {
        req = req.header("x-data-parallel-rank", r);
    }
    let resp = req.send().await.unwrap();
    assert_eq!(resp.status(), 200, "{:?}", resp.text().await);
    let h = |name: &str| -> u64 {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name}"))
    };
    let served = Served {
        rank: h("x-kvmesh-dp-rank") as u16,
        cached: h("x-kvmesh-cached-tokens"),
    };
    resp.bytes().await.unwrap();
    served
}

fn body(prompt: &str) -> serde_json::Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 1})
}

#[tokio::test]
async fn the_replica_serves_the_named_rank_and_balances_the_rest() {
    bounded(async {
        let r = dp_replica().await;
        let url = r.base_url();
        assert_eq!(r.dp_ranks, RANKS);
        let p = text("named", 4);
        // vLLM's header, then SGLang's body field: the same rank, and its cache.
        let first = complete(&url, body(&p), Some("2")).await;
        assert_eq!((first.rank, first.cached), (2, 0));
        let mut b = body(&p);
        b["data_parallel_rank"] = json!(2);
        let again = complete(&url, b, None).await;
        assert_eq!(again.rank, 2);
        assert_eq!(
            again.cached,
            3 * BLOCK_TOKENS as u64,
            "all but the last block"
        );
        // Another rank has its own cache: nothing there.
        assert_eq!(complete(&url, body(&p), Some("1")).await.cached, 0);
        // Unnamed, one at a time: the balancer rotates over the idle ranks.
        let mut seen = std::collections::HashSet::new();
        for i in 0..RANKS {
            seen.insert(
                complete(&url, body(&text(&format!("b{i}"), 2)), None)
                    .await
                    .rank,
            );
        }
        assert_eq!(seen.len(), RANKS as usize, "{seen:?}");
        // A rank it does not have is the client's error.
        for bad in ["4", "-1", "x"] {
            let resp = reqwest::Client::new()
                .post(format!("{url}/v1/completions"))
                .header("x-data-parallel-rank", bad)
                .json(&body(&p))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 400, "{bad}");
        }
        r.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn each_ranks_events_arrive_on_its_own_port_and_tell_who_holds_what() {
    bounded(async {
        let r = dp_replica().await;
        let node = node_for(&r, Some(RankRouting::Off)).await;
        let url = r.base_url();
        let (a, b) = (text("alpha", 6), text("beta", 6));
        complete(&url, body(&a), Some("1")).await;
        complete(&url, body(&b), Some("3")).await;
        complete(&url, body(&a), Some("3")).await;
        let (ka, kb) = (keys(&a), keys(&b));
        until(|| {
            let core = node.node.lock();
            let m = &core.replicas[0].cache;
            m.ranks_of(ka[5]) == 0b1010 && m.ranks_of(kb[5]) == 0b1000
        })
        .await;
        {
            let core = node.node.lock();
            assert_eq!(core.replicas[0].cache.rank_runs(&ka, 4), vec![0, 6, 0, 6]);
            assert_eq!(core.replicas[0].cache.rank_runs(&kb, 4), vec![0, 0, 0, 6]);
        }
        node.shutdown().await;
        r.shutdown().await;
    })
    .await;
}

/// Conversations of `turns` turns each, interleaved (3 conversations, so an unnamed balancer
/// rotating over 4 ranks moves each to another rank every turn): each turn's prompt is the
/// previous one plus 4 blocks. Returns the cached tokens of the follow-up turns over their
/// prompt tokens, and the served ranks per conversation.
async fn conversations(node: &RunningNode, turns: usize) -> (f64, Vec<Vec<u16>>) {
    let url = format!("http://{}", node.addr);
    let mut prompts: Vec<String> = (0..3).map(|c| text(&format!("conv{c}"), 8)).collect();
    let mut ranks = vec![Vec::new(); prompts.len()];
    let (mut cached, mut total) = (0u64, 0u64);
    for turn in 0..turns {
        for (c, p) in prompts.iter_mut().enumerate() {
            let served = complete(&url, body(p), None).await;
            ranks[c].push(served.rank);
            if turn > 0 {
                cached += served.cached;
                total += (p.len() / 4) as u64;
            }
            // Wait for the turn's blocks to reach the node's model before the next turn uses
            // them, as a user's think time would.
            let k = keys(p);
            let last = *k.last().unwrap();
            until(|| node.node.lock().replicas[0].cache.ranks_of(last) != 0).await;
            p.push_str(&text(&format!("turn{turn}-{c}"), 4));
        }
    }
    (cached as f64 / total as f64, ranks)
}

#[tokio::test]
async fn a_conversation_follows_its_rank_with_rank_routing_and_scatters_without() {
    bounded(async {
        let r = dp_replica().await;
        let node = node_for(&r, None).await;
        let (with, ranks) = conversations(&node, 5).await;
        // Every follow-up went to the rank that served the conversation before.
        for (c, rs) in ranks.iter().enumerate() {
            assert!(rs.iter().all(|r| *r == rs[0]), "conversation {c}: {rs:?}");
        }
        // A follow-up re-prefills only the last, partial block: 8+4t blocks of 12+4t cached.
        assert!(with > 0.6, "hit ratio with rank routing {with:.3}");
        assert!(node.node.metrics.decisions.dp_rank_named.get() > 0);
        let metrics_header = {
            let resp = reqwest::Client::new()
                .post(format!("http://{}/v1/completions", node.addr))
                .json(&body(&text("conv0", 8)))
                .send()
                .await
                .unwrap();
            let rank = resp.headers().get("x-kvmesh-dp-rank").cloned();
            let decision = resp
                .headers()
                .get("x-kvmesh-decision")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
                .unwrap_or_default();
            resp.bytes().await.unwrap();
            assert!(
                decision.ends_with(&format!("; dp_rank={}", ranks[0][0])),
                "the node's decision names the rank: {decision:?}"
            );
            rank
        };
        assert_eq!(
            metrics_header.and_then(|v| v.to_str().ok().map(str::to_owned)),
            Some(ranks[0][0].to_string()),
            "a repeated prefix lands on the rank holding it"
        );
        node.shutdown().await;
        r.shutdown().await;

        let r = dp_replica().await;
        let node = node_for(&r, Some(RankRouting::Off)).await;
        let (without, ranks) = conversations(&node, 5).await;
        assert_eq!(node.node.metrics.decisions.dp_rank_named.get(), 0);
        eprintln!("hit ratio with rank routing {with:.3}, without {without:.3}");
        assert!(
            ranks.iter().any(|rs| rs.iter().any(|r| *r != rs[0])),
            "the balancer never moved a conversation: {ranks:?}"
        );
        assert!(
            without < with - 0.2,
            "hit ratio without rank routing {without:.3}, with {with:.3}"
        );
        node.shutdown().await;
        r.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn sglang_style_replicas_get_the_rank_in_the_body() {
    bounded(async {
        let r = dp_replica().await;
        let node = node_for(&r, Some(RankRouting::Body)).await;
        let (ratio, ranks) = conversations(&node, 3).await;
        for rs in &ranks {
            assert!(rs.iter().all(|r| *r == rs[0]), "{rs:?}");
        }
        assert!(ratio > 0.5, "{ratio:.3}");
        node.shutdown().await;
        r.shutdown().await;
    })
    .await;
}
