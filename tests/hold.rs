//! Holding a repeated long prompt at the node (`[hold]`, `node/hold.rs`): a copy that arrives
//! while its replica still computes the first waits for the first's first byte, so the engine
//! finds the whole prompt cached instead of recomputing it in parallel. A node in-process in
//! front of one simulated replica in real time, on loopback.

mod common;

use std::time::Duration;

use common::k8s::metric;
use common::{bounded, client, sim_replica, wait_for};
use kvmesh::node::config::hold::HoldSection;
use kvmesh::node::config::{NodeConfig, ReplicaConfig as NodeReplica};
use kvmesh::proxy::{self, RunningNode};
use kvmesh::replica::ReplicaHandle;
use serde_json::json;

const MODEL: &str = "sim-llama-8b";

/// About 60k tokens (4 bytes a token): ~2.5 s of prefill on the real-time replica.
fn long_prompt() -> String {
    let mut s = String::with_capacity(240_000);
    let mut i = 0;
    while s.len() < 240_000 {
        s.push_str(&format!("turn-{i:07} "));
        i += 1;
    }
    s
}

/// One real-time simulated replica and a node in front of it with `hold`.
async fn fleet(hold: HoldSection) -> (ReplicaHandle, RunningNode) {
    let replica = sim_replica("r0", |c| c.engine.time_scale = 1.0).await;
    proxy::install_crypto_provider();
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        drain_s: 1,
        debug_headers: true,
        hold,
        ..NodeConfig::default()
    };
    cfg.health.interval_ms = 100;
    cfg.replicas = vec![NodeReplica {
        id: Some("r0".into()),
        ..NodeReplica::from_url(replica.base_url())
    }];
    (replica, proxy::spawn(cfg).await.unwrap())
}

/// Sends `prompt` with `c`: (status, the replica's cached tokens), or `None` if the client gave
/// up first.
async fn complete(c: &reqwest::Client, n: &RunningNode, prompt: &str) -> Option<(u16, u64)> {
    let resp = c
        .post(format!("http://{}/v1/completions", n.addr))
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .ok()?;
    let status = resp.status().as_u16();
    let cached = resp
        .headers()
        .get("x-kvmesh-cached-tokens")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(0);
    resp.bytes().await.ok()?;
    Some((status, cached))
}

async fn metrics(c: &reqwest::Client, n: &RunningNode) -> String {
    c.get(format!("http://{}/metrics", n.addr))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Starts the first copy of `prompt` and returns once the node lists its prefill (routed, no
/// first byte yet): a copy sent now arrives during it.
async fn first_copy_computing(
    c: &reqwest::Client,
    n: &RunningNode,
    prompt: &str,
) -> tokio::task::JoinHandle<Option<(u16, u64)>> {
    // The replica must be healthy before the node routes to it.
    let warm = complete(c, n, "a short warm-up prompt").await;
    assert_eq!(warm.map(|w| w.0), Some(200));
    let (c1, n1, p1) = (c.clone(), n.node.clone(), prompt.to_owned());
    let addr = n.addr;
    let first = tokio::spawn(async move {
        let resp = c1
            .post(format!("http://{addr}/v1/completions"))
            .json(&json!({"model": MODEL, "prompt": p1, "max_tokens": 2}))
            .send()
            .await
            .ok()?;
        let status = resp.status().as_u16();
        resp.bytes().await.ok()?;
        Some((status, 0))
    });
    assert!(
        wait_for(Duration::from_secs(10), || n1.holds.prefilling(0) == 1)
            .await
            .is_some(),
        "the first copy's prefill is listed"
    );
    first
}

/// The mechanism, without the hold: a copy sent while the first computes matches only the
/// chunks the engine has scheduled so far (it caches per chunk, as vLLM v1) and recomputes the
/// rest of the prompt, clearly less than the held copy's ≥ 90 %.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_hold_a_copy_sent_during_the_prefill_recomputes_most_of_it() {
    bounded(60, async {
        let off = HoldSection {
            enabled: false,
            ..HoldSection::default()
        };
        let (_r, n) = fleet(off.clone()).await;
        let c = client();
        let prompt = long_prompt();
        // Listing is off too: wait for the node's in-flight count instead.
        let warm = complete(&c, &n, "a short warm-up prompt").await;
        assert_eq!(warm.map(|w| w.0), Some(200));
        let (c1, p1, addr) = (c.clone(), prompt.clone(), n.addr);
        let first = tokio::spawn(async move {
            c1.post(format!("http://{addr}/v1/completions"))
                .json(&json!({"model": MODEL, "prompt": p1, "max_tokens": 2}))
                .send()
                .await
                .ok()?
                .bytes()
                .await
                .ok()
        });
        let node = n.node.clone();
        assert!(wait_for(Duration::from_secs(10), || {
            node.state().replicas.iter().any(|r| r.in_flight == 1)
        })
        .await
        .is_some());
        let (status, cached) = complete(&c, &n, &prompt).await.unwrap();
        assert_eq!(status, 200);
        let tokens = prompt.len() as u64 / 4;
        assert!(
            cached * 10 < tokens * 9,
            "in the middle of its prefill the engine held only the chunks so far: {cached} of ~{tokens}"
        );
        assert!(first.await.unwrap().is_some());
        n.shutdown().await;
    })
    .await;
}

/// The hold: the copy waits for the first's first byte and finds the whole prompt cached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_sent_during_the_prefill_is_held_until_the_first_byte_and_finds_it_cached() {
    bounded(60, async {
        let (_r, n) = fleet(HoldSection::default()).await;
        let c = client();
        let prompt = long_prompt();
        let first = first_copy_computing(&c, &n, &prompt).await;
        let (status, cached) = complete(&c, &n, &prompt).await.unwrap();
        assert_eq!(status, 200);
        let tokens = prompt.len() as u64 / 4;
        assert!(
            cached * 10 >= tokens * 9,
            "held until the first byte, the copy found the prompt cached: {cached} of ~{tokens}"
        );
        assert_eq!(first.await.unwrap().map(|f| f.0), Some(200));
        let m = metrics(&c, &n).await;
        assert_eq!(
            metric(&m, "kvmesh_requests_held_total{outcome=\"released\"}"),
            1.0
        );
        assert_eq!(n.node.holds.held_now(), 0);
        assert_eq!(n.node.holds.prefilling(0), 0, "unlisted at its first byte");
        n.shutdown().await;
    })
    .await;
}

/// The bounds: a held request goes at its deadline; past the cap it goes at once; a client
/// that leaves while held gives its slot back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_request_goes_at_its_deadline_past_the_cap_at_once_and_a_leaving_client_frees_its_slot(
) {
    bounded(60, async {
        let hold = HoldSection {
            max_held: 1,
            max_held_per_replica: 1,
            ..HoldSection::default()
        };
        let (_r, n) = fleet(hold).await;
        let c = client();
        let prompt = long_prompt();
        let first = first_copy_computing(&c, &n, &prompt).await;
        // A client that gives up while held.
        let impatient = reqwest::Client::builder()
            .timeout(Duration::from_millis(800))
            .build()
            .unwrap();
        let (ni, pi) = (n.node.clone(), prompt.clone());
        let addr = n.addr;
        let gone = tokio::spawn(async move {
            let r = impatient
                .post(format!("http://{addr}/v1/completions"))
                .json(&json!({"model": MODEL, "prompt": pi, "max_tokens": 2}))
                .send()
                .await;
            assert!(r.is_err(), "it left before an answer");
        });
        assert!(
            wait_for(Duration::from_secs(10), || ni.holds.held_now() == 1)
                .await
                .is_some(),
            "the impatient copy is held"
        );
        // The one slot is taken: this copy goes at once.
        let full = complete(&c, &n, &prompt).await.unwrap();
        assert_eq!(full.0, 200);
        gone.await.unwrap();
        let node = n.node.clone();
        assert!(
            wait_for(Duration::from_secs(10), || node.holds.held_now() == 0)
                .await
                .is_some(),
            "the leaving client's slot is given back"
        );
        let m = metrics(&c, &n).await;
        assert_eq!(
            metric(&m, "kvmesh_requests_held_total{outcome=\"full\"}"),
            1.0
        );
        assert_eq!(
            metric(&m, "kvmesh_requests_held_total{outcome=\"client_gone\"}"),
            1.0
        );
        assert!(first.await.unwrap().is_some());
        n.shutdown().await;

        // A deadline shorter than the prefill: the copy goes when it passes.
        let short = HoldSection {
            max_wait_ms: 50,
            ..HoldSection::default()
        };
        let (_r2, n2) = fleet(short).await;
        let first = first_copy_computing(&c, &n2, &prompt).await;
        let (status, _) = complete(&c, &n2, &prompt).await.unwrap();
        assert_eq!(status, 200);
        let m = metrics(&c, &n2).await;
        assert_eq!(
            metric(&m, "kvmesh_requests_held_total{outcome=\"deadline\"}"),
            1.0
        );
        assert_eq!(n2.node.holds.held_now(), 0);
        assert!(first.await.unwrap().is_some());
        n2.shutdown().await;
    })
    .await;
}
