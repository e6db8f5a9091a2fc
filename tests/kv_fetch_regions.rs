//! A prefix held in another region, live (issue #37, "across regions"): two mesh nodes on
//! loopback, one per region (the flat layout, so each sees the other's replicas and summaries),
//! each in front of a simulated replica. With `remote_prefix = "weigh"` and a fast link pinned
//! between the regions, a request at region `eu` whose prompt only `us`'s replica holds goes to
//! `eu`'s replica with a pull hint naming `us`'s, and the pull really happens; when that source
//! is dead the request still succeeds, recomputed.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::{bounded, client, cluster_ca, mesh_addr, sim_replica, wait_for};
use kvmesh::core::kv_load::{KvHintFormat, KvLoad};
use kvmesh::core::remote_prefix::RemotePrefixMode;
use kvmesh::node::config::mesh::LayoutConfig;
use kvmesh::node::config::{DistanceConfig, MeshSection, NodeConfig, ReplicaConfig};
use kvmesh::proxy::{self, RunningNode};
use serde_json::json;

const MODEL: &str = "sim-llama-8b";

/// A node of `region` in front of `replica` (id, url, takes vLLM hints), seeded by `seeds`:
/// the regions 5 s apart (a forward never pays) with a 50 GB/s KV link pinned between them.
fn node_config(
    certs: &Path,
    (name, region): (&str, &str),
    seeds: &[SocketAddr],
    (id, url, hints): (&str, String, bool),
) -> NodeConfig {
    kvmesh::mesh::certs::issue_in_dir(certs, name).unwrap();
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        debug_headers: true,
        region: region.into(),
        cluster_id: "kv-fetch-regions-test".into(),
        drain_s: 1,
        remote_prefix: RemotePrefixMode::Weigh,
        ..NodeConfig::default()
    };
    cfg.health.interval_ms = 200;
    // The home never marks its replica down in these tests: a dead source stays in the other
    // node's view, so the request is really sent with a hint naming it.
    cfg.health.unhealthy_after = 1_000;
    cfg.scrape.interval_ms = 100;
    cfg.timeouts.first_byte_ms = 10_000;
    cfg.replicas = vec![ReplicaConfig {
        id: Some(id.into()),
        models: vec![MODEL.into()],
        // A slow prefill as the router predicts it: recomputing 8,192 tokens looks like 4 s.
        prefill_tokens_per_s: 2_000.0,
        kv_load: hints.then(|| KvLoad {
            hints: KvHintFormat::VllmEnvelope,
            ..KvLoad::default()
        }),
        ..ReplicaConfig::from_url(url)
    }];
    cfg.mesh = Some(MeshSection {
        node_id: name.into(),
        listen: "127.0.0.1:0".parse().unwrap(),
        seeds: seeds.iter().map(|s| s.to_string()).collect(),
        certs_dir: Some(certs.to_owned()),
        gossip_interval_ms: 100,
        failure_detection_ms: 2_000,
        warmup_timeout_ms: 5_000,
        layout: LayoutConfig::Flat,
        distance: vec![DistanceConfig {
            a: "eu".into(),
            b: "us".into(),
            ms: 5_000.0,
            kv_gb_per_s: Some(50.0),
            kv_setup_ms: Some(5.0),
        }],
        ..MeshSection::default()
    });
    cfg
}

/// `n` distinct prompt bytes starting with `seed` (a token per 4 bytes).
fn text(seed: &str, n: usize) -> String {
    let mut s = String::new();
    let mut i = 0;
    while s.len() < n {
        s.push_str(&format!("{seed}-{i:06} "));
        i += 1;
    }
    s.truncate(n);
    s
}

/// `(status, replica routed to)` of one completion through `node`.
async fn complete(c: &reqwest::Client, node: SocketAddr, prompt: &str) -> (u16, String) {
    let resp = c
        .post(format!("http://{node}/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let routed = resp
        .headers()
        .get("x-kvmesh-routed-to")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let _ = resp.bytes().await;
    (status, routed)
}

/// The sum of a replica's `name` samples on its `/metrics`.
async fn metric(c: &reqwest::Client, base: &str, name: &str) -> f64 {
    let text = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The `(epoch, seq)` of replica `id`'s summary in `n`'s view.
fn view_version(n: &RunningNode, id: &str) -> Option<(u64, u64)> {
    let core = n.node.lock();
    let i = core.view.index_of(id)?;
    let s = core.view.replica(i)?.summary.as_ref()?;
    Some((s.epoch(), s.seq()))
}

/// The `(epoch, seq)` of the home's own model of replica `id`, if `n` is its home.
fn home_version(n: &RunningNode, id: &str) -> Option<(u64, u64)> {
    let core = n.node.lock();
    let i = core.view.index_of(id)?;
    let rt = &core.replicas[i];
    rt.mesh
        .home
        .then(|| (rt.cache.summary().epoch(), rt.cache.summary().seq()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_held_in_another_region_is_pulled_to_a_local_replica_and_a_dead_source_costs_a_recompute(
) {
    bounded(90, async {
        let c = client();
        let certs = cluster_ca();
        let ra = sim_replica("ra", |_| {}).await;
        let rb = sim_replica("rb", |_| {}).await;
        let eu = proxy::spawn(node_config(
            certs.path(),
            ("eu1", "eu"),
            &[],
            ("ra", ra.base_url(), true),
        ))
        .await
        .unwrap();
        let us = proxy::spawn(node_config(
            certs.path(),
            ("us1", "us"),
            &[mesh_addr(&eu)],
            ("rb", rb.base_url(), false),
        ))
        .await
        .unwrap();
        wait_for(Duration::from_secs(20), || {
            eu.node.lock().view.index_of("rb").is_some()
                && us.node.lock().view.index_of("ra").is_some()
        })
        .await
        .expect("each node learns the other region's replica");

        // Two 8,192-token prompts computed in `us` (its only replica), seen settled from `eu`.
        let prompts = [text("doc-one", 4 * 8192), text("doc-two", 4 * 8192)];
        for p in &prompts {
            assert_eq!(complete(&c, us.addr, p).await, (200, "rb".into()));
        }
        let settled = wait_for(Duration::from_secs(20), || {
            let home = home_version(&us, "rb");
            home.is_some_and(|(_, seq)| seq > 0) && view_version(&eu, "rb") >= home
        })
        .await;
        assert!(
            settled.is_some(),
            "eu's view catches up with rb's home: {:?} vs {:?}",
            view_version(&eu, "rb"),
            home_version(&us, "rb")
        );

        // At `eu`: the local replica, pulling from `us`'s (recomputing looks like 4 s, going
        // there 5 s, the pull ~30 ms).
        assert_eq!(complete(&c, eu.addr, &prompts[0]).await, (200, "ra".into()));
        let fetched = metric(&c, &ra.base_url(), "kvmesh_replica_kv_fetched_tokens_total").await;
        assert!(
            fetched >= 8_000.0,
            "ra pulled the prefix from rb: {fetched}"
        );
        assert!(
            metric(&c, &rb.base_url(), "kvmesh_replica_kv_served_tokens_total").await >= 8_000.0
        );

        // The source dies (its home does not notice in time): the hint still names it, the
        // pull fails, and the request is served by recomputing.
        let rb_url = rb.base_url();
        rb.shutdown().await;
        assert_eq!(complete(&c, eu.addr, &prompts[1]).await, (200, "ra".into()));
        assert_eq!(
            metric(&c, &ra.base_url(), "kvmesh_replica_kv_fetch_failures_total").await,
            1.0,
            "the pull from the dead source ({rb_url}) was tried and failed"
        );
        assert_eq!(
            metric(&c, &ra.base_url(), "kvmesh_replica_kv_fetched_tokens_total").await,
            fetched,
            "nothing more arrived"
        );
        eu.shutdown().await;
        us.shutdown().await;
        ra.shutdown().await;
    })
    .await;
}
