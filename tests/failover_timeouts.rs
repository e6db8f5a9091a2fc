//! Timeouts, retries and blame that fit together (issue #35): a first-byte timeout leaves the
//! retry budget room for another replica, a whole (non-streamed) request late at a slow replica
//! is hedged elsewhere, and requests that are merely long eject nobody.
//!
//! Timeouts are the defaults scaled down (same ratios), so the tests run in seconds. Simulated
//! replicas in-process; every test bounded.

mod common;

use std::time::Instant;

use common::{bounded, client, sim_replica};
use kvmesh::node::config::{NodeConfig, ReplicaConfig as NodeReplica};
use kvmesh::proxy::{self, RunningNode};
use kvmesh::replica::ReplicaHandle;
use serde_json::json;

const MODEL: &str = "sim-llama-8b";
const ROUTED: &str = "x-kvmesh-routed-to";

/// A node in front of `replicas`, its first-byte timeouts, retry budget and hedge the
/// defaults divided by `scale`.
fn node_config(replicas: &[&ReplicaHandle], scale: u64) -> NodeConfig {
    let d = NodeConfig::default();
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        debug_headers: true,
        drain_s: 2,
        policy: "round-robin".into(),
        ..NodeConfig::default()
    };
    cfg.timeouts.first_byte_ms = d.timeouts.first_byte_ms / scale;
    cfg.timeouts.stream_first_byte_ms = d.timeouts.stream_first_byte_ms / scale;
    cfg.retry.budget_ms = d.retry.budget_ms / scale;
    cfg.retry.hedge_whole_after_ms = d.retry.hedge_whole_after_ms / scale;
    cfg.health.interval_ms = 100;
    cfg.health.timeout_ms = 500;
    cfg.scrape.interval_ms = 100;
    cfg.replicas = replicas
        .iter()
        .map(|r| NodeReplica {
            id: Some(r.id.clone()),
            models: vec![MODEL.into()],
            ..NodeReplica::from_url(r.base_url())
        })
        .collect();
    cfg
}

/// A completion of `prompt`: (status, replica that served it, seconds it took).
async fn complete(
    c: &reqwest::Client,
    node: &RunningNode,
    prompt: &str,
    stream: bool,
) -> (u16, String, f64) {
    let t0 = Instant::now();
    let resp = c
        .post(format!("http://{}/v1/completions", node.addr))
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream}))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let routed = resp
        .headers()
        .get(ROUTED)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let _ = resp.bytes().await;
    (status, routed, t0.elapsed().as_secs_f64())
}

/// `series`' value in the node's `/metrics`, summed over its labels (0 when absent).
async fn metric_sum(c: &reqwest::Client, node: &RunningNode, series: &str) -> f64 {
    let text = c
        .get(format!("http://{}/metrics", node.addr))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(series))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Issue #35: with the defaults a stream's first-byte timeout equalled the retry budget, so a
/// slow replica's streamed requests got 502 at the timeout instead of going elsewhere. A
/// replica that answers after 35 s (3.5 s here, timeouts ÷ 10): streamed requests time out
/// there and are retried on the other replica, whole ones are hedged there, all within the
/// budget (3 s here), none served by the slow one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_answering_after_35_s_is_failed_over_within_the_budget() {
    bounded(60, async {
        let slow = sim_replica("slow", |c| c.faults.added_latency_ms = 3_500).await;
        let fast = sim_replica("fast", |_| {}).await;
        let cfg = node_config(&[&slow, &fast], 10);
        let budget_s = cfg.retry.budget_ms as f64 / 1000.0;
        let node = proxy::spawn(cfg).await.unwrap();
        let c = client();
        // Round robin: every other request is routed to the slow replica first.
        let mut served = Vec::new();
        for i in 0..4 {
            for stream in [true, false] {
                let prompt = format!("request {i} stream {stream}");
                let (status, routed, took) = complete(&c, &node, &prompt, stream).await;
                served.push((stream, status, routed.clone(), took));
                assert_eq!(status, 200, "{prompt}: {served:?}");
                assert_eq!(routed, "fast", "{prompt}: {served:?}");
                // Served before the slow replica could have answered, within the budget.
                assert!(took < budget_s + 0.4, "{prompt}: {served:?}");
            }
        }
        println!("served (stream, status, replica, seconds): {served:?}");
        node.shutdown().await;
        slow.shutdown().await;
        fast.shutdown().await;
    })
    .await;
}

/// Issue #35: a request that times out as its only attempt was blamed on the replica, so six
/// ordinary long requests ejected both replicas, then 503 for everyone. Six whole requests
/// longer than the first-byte timeout (timeouts ÷ 100: 3 s) on two healthy replicas fail,
/// and eject nobody: the next request is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_long_requests_eject_nobody() {
    bounded(60, async {
        let long = |c: &mut kvmesh::replica::ReplicaConfig| c.faults.added_latency_ms = 4_000;
        let r0 = sim_replica("r0", long).await;
        let r1 = sim_replica("r1", long).await;
        let node = proxy::spawn(node_config(&[&r0, &r1], 100)).await.unwrap();
        let c = client();
        let prompts: Vec<String> = (0..6).map(|i| format!("long {i}")).collect();
        let long_ones = prompts.iter().map(|p| complete(&c, &node, p, false));
        let outcomes = futures::future::join_all(long_ones).await;
        println!("long requests (status, replica, seconds): {outcomes:?}");
        assert!(outcomes.iter().all(|(status, _, _)| *status != 200));
        assert_eq!(
            metric_sum(&c, &node, "kvmesh_ejections_total").await,
            0.0,
            "a replica was ejected for long requests"
        );
        // Short requests again: both replicas serve.
        for r in [&r0, &r1] {
            c.post(format!("{}/admin/faults", r.base_url()))
                .json(&json!({"added_latency_ms": 0}))
                .send()
                .await
                .unwrap();
        }
        let mut seen = std::collections::BTreeSet::new();
        for i in 0..4 {
            let (status, routed, _) = complete(&c, &node, &format!("short {i}"), false).await;
            assert_eq!(status, 200);
            seen.insert(routed);
        }
        assert_eq!(seen.len(), 2, "{seen:?}");
        node.shutdown().await;
        r0.shutdown().await;
        r1.shutdown().await;
    })
    .await;
}

/// Issue #38: a stream queued behind long prefills at a working replica was retried elsewhere
/// at its first-byte wait, and recomputed its whole prompt there (three nodes on the agentic
/// sessions: 23–83 such retries a run). Six long prompts at once on one replica whose prefill
/// takes ~0.8 s each (timeouts ÷ 5: a 2 s stream wait): the later ones get their first bytes
/// past 2 s, but each wait saw the replica answer the requests before it, so each is extended,
/// not failed: all six are served, nothing is retried. (A replica that answers nothing is
/// still left after one wait: `tests/node.rs`, `timeouts_retry_before_the_first_byte_and_never_after`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_queued_at_a_working_replica_waits_there_instead_of_retrying() {
    bounded(60, async {
        // 8,192-token prompts (4 bytes a token) in one prefill step each, ~0.8 s apiece.
        let r0 = sim_replica("r0", |c| c.engine.time_scale = 0.24).await;
        let cfg = node_config(&[&r0], 5);
        let wait_s = cfg.timeouts.stream_first_byte_ms as f64 / 1000.0;
        let node = proxy::spawn(cfg).await.unwrap();
        let c = client();
        let prompts: Vec<String> = (0..6)
            .map(|i| format!("{i} {}", "lorem ipsum dolor sit amet ".repeat(1213)))
            .collect();
        let outcomes =
            futures::future::join_all(prompts.iter().map(|p| complete(&c, &node, p, true))).await;
        println!("queued streams (status, replica, seconds): {outcomes:?}");
        assert!(
            outcomes.iter().any(|(_, _, took)| *took > wait_s),
            "no stream outlived the first wait: the test shows nothing ({outcomes:?})"
        );
        assert!(
            outcomes.iter().all(|(status, _, _)| *status == 200),
            "{outcomes:?}"
        );
        assert_eq!(metric_sum(&c, &node, "kvmesh_retries_total").await, 0.0);
        assert!(metric_sum(&c, &node, "kvmesh_first_byte_waits_extended_total").await >= 1.0);
        node.shutdown().await;
        r0.shutdown().await;
    })
    .await;
}
