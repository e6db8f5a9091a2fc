//! Helpers the integration tests share: a time bound, an HTTP client, simulated replicas,
//! polling, a free port. Each test binary compiles this module and uses part of it.
#![allow(dead_code)]

use std::future::Future;
use std::time::{Duration, Instant};

use kvmesh::mesh::certs::NodeIdentity;
use kvmesh::mesh::MeshConfig;
use kvmesh::node::config::{NodeConfig, ReplicaConfig as NodeReplica};
use kvmesh::replica::{self, ReplicaConfig, ReplicaHandle};

pub mod dns;
pub mod k8s;

/// Runs `f`, failing the test if it takes more than `secs` seconds.
pub async fn bounded<F: Future>(secs: u64, f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .expect("test exceeded its time bound")
}

/// Logs to the test's output, filtered by `RUST_LOG` (once per binary).
pub fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// An HTTP client with a 20 s timeout (rustls' provider installed; logs on).
pub fn client() -> reqwest::Client {
    init_logs();
    kvmesh::proxy::install_crypto_provider();
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .expect("HTTP client")
}

/// A simulated replica `id`, 50× faster than real time unless `adjust` says otherwise.
pub async fn sim_replica(id: &str, adjust: impl FnOnce(&mut ReplicaConfig)) -> ReplicaHandle {
    let mut cfg = ReplicaConfig {
        id: id.into(),
        exit_on_crash: false,
        ..ReplicaConfig::default()
    };
    cfg.engine.time_scale = 50.0;
    adjust(&mut cfg);
    replica::spawn(cfg).await.expect("simulated replica")
}

/// Polls `cond` every 20 ms until it holds or `limit` passes; returns the time it took.
pub async fn wait_for(limit: Duration, mut cond: impl FnMut() -> bool) -> Option<Duration> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if cond() {
            return Some(t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// Awaits `cond` every 20 ms until it holds or `limit` passes; returns the time it took.
pub async fn wait_until(limit: Duration, mut cond: impl AsyncFnMut() -> bool) -> Option<Duration> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if cond().await {
            return Some(t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// A TCP port free on 127.0.0.1 a moment ago.
pub fn free_tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A mesh member's config on 127.0.0.1 (any port): `name` in `region` of `cluster`, presenting
/// `identity`, seeded by `seeds`; the rest at its defaults for the caller to adjust.
pub fn loopback_mesh(
    cluster: &str,
    name: &str,
    region: &str,
    identity: NodeIdentity,
    seeds: &[std::net::SocketAddr],
) -> MeshConfig {
    let mut cfg = MeshConfig::new(name, region, ([127, 0, 0, 1], 0).into(), cluster, identity);
    cfg.seeds = seeds.iter().map(|s| s.to_string()).collect();
    cfg
}

/// A cluster CA in a fresh temporary directory (`kvmesh certs init`).
pub fn cluster_ca() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    kvmesh::mesh::certs::init_dir(dir.path()).unwrap();
    dir
}

/// A node on loopback in front of `urls` (replicas `r0`, `r1`, …): [`named_node_config`].
pub fn node_config(urls: &[String]) -> NodeConfig {
    let named: Vec<(String, String)> = urls
        .iter()
        .enumerate()
        .map(|(i, u)| (format!("r{i}"), u.clone()))
        .collect();
    named_node_config(&named)
}

/// A node on loopback in front of `replicas` (id, URL), with debug headers, quick health
/// checks and scrapes (100 ms), and short connect and first-byte timeouts: what the node tests
/// start from, single or meshed.
pub fn named_node_config(replicas: &[(String, String)]) -> NodeConfig {
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        drain_s: 5,
        debug_headers: true,
        ..NodeConfig::default()
    };
    cfg.health.interval_ms = 100;
    cfg.health.timeout_ms = 500;
    cfg.scrape.interval_ms = 100;
    cfg.timeouts.first_byte_ms = 5_000;
    cfg.timeouts.connect_ms = 500;
    cfg.replicas = replicas
        .iter()
        .map(|(id, url)| NodeReplica {
            id: Some(id.clone()),
            ..NodeReplica::from_url(url.clone())
        })
        .collect();
    cfg
}

/// The QUIC address of a running node's mesh.
pub fn mesh_addr(n: &kvmesh::proxy::RunningNode) -> std::net::SocketAddr {
    n.node.mesh().unwrap().addr()
}

/// The ids of the members `n` sees live, sorted.
pub fn live_members(n: &kvmesh::proxy::RunningNode) -> Vec<String> {
    let members = n.node.state().mesh.map(|m| m.members).unwrap_or_default();
    let mut live: Vec<String> = members
        .into_iter()
        .filter(|m| m.live)
        .map(|m| m.node_id)
        .collect();
    live.sort();
    live
}

/// A rogue member: a plain `Mesh` with a valid certificate for `name` in cluster `cluster`,
/// region `region`, no HTTP front and no replicas of its own, that sends what its test likes;
/// gossip every 100 ms, death seen after `failure_detection_ms`; `adjust` changes the rest.
pub async fn rogue_member(
    cluster: &str,
    certs: &std::path::Path,
    name: &str,
    region: &str,
    seed: std::net::SocketAddr,
    failure_detection_ms: u64,
    adjust: impl FnOnce(&mut MeshConfig),
) -> kvmesh::mesh::Mesh {
    kvmesh::mesh::certs::issue_in_dir(certs, name).unwrap();
    let identity = NodeIdentity::load_dir(certs, name).unwrap();
    let mut cfg = loopback_mesh(cluster, name, region, identity, &[seed]);
    cfg.gossip_interval = Duration::from_millis(100);
    cfg.failure_detection = Duration::from_millis(failure_detection_ms);
    adjust(&mut cfg);
    kvmesh::mesh::Mesh::start(cfg).await.unwrap()
}
