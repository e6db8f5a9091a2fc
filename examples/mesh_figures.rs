//! Figures for the mesh (issue #5's bench note), measured in-process on loopback with real QUIC
//! (mTLS) between real nodes:
//!
//! 1. time for a new prefix routed at one node to become visible in every node's view of its
//!    region (p50/p99), at gossip intervals 100 ms and 500 ms;
//! 2. gossip + sync traffic per node with 32 busy replicas (10 req/s each, spread over 3 nodes);
//! 3. join-to-warm time of a new node into a 64-replica region.
//!
//! Replicas are never called: their URLs point at a closed port, health checks are made
//! harmless and requests are routed with `Node::route` directly, so only the mesh is measured.
//!
//! `cargo run --release --example mesh_figures`

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh::core::keys::BlockKey;
use kvmesh::core::router::{Decision, RouteRequest};
use kvmesh::node::config::{MeshSection, NodeConfig, ReplicaConfig};
use kvmesh::node::Node;
use kvmesh::proxy::{self, RunningNode};
use rand::Rng;

async fn node(
    certs: &Path,
    name: &str,
    seeds: &[SocketAddr],
    gossip_ms: u64,
    replicas: usize,
) -> anyhow::Result<RunningNode> {
    kvmesh::mesh::certs::issue_in_dir(certs, name)?;
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse()?,
        region: "eu".into(),
        drain_s: 1,
        ..NodeConfig::default()
    };
    // Replicas at a closed port stay "healthy": one failed check is below the threshold and the
    // next one is an hour away. No scrapes.
    cfg.health.interval_ms = 3_600_000;
    cfg.health.timeout_ms = 200;
    cfg.health.unhealthy_after = 100;
    cfg.scrape.interval_ms = 0;
    cfg.replicas = (0..replicas)
        .map(|i| ReplicaConfig {
            id: Some(format!("r{i:02}")),
            models: vec!["m".into()],
            capacity_tokens: Some(450_000),
            ..ReplicaConfig::from_url("http://127.0.0.1:9")
        })
        .collect();
    cfg.mesh = Some(MeshSection {
        node_id: name.into(),
        listen: "127.0.0.1:0".parse()?,
        seeds: seeds.iter().map(|s| s.to_string()).collect(),
        certs_dir: Some(certs.to_owned()),
        gossip_interval_ms: gossip_ms,
        failure_detection_ms: (gossip_ms * 20).max(2_000),
        warmup_timeout_ms: 30_000,
        ..MeshSection::default()
    });
    proxy::spawn(cfg).await
}

async fn cluster(
    certs: &Path,
    tag: &str,
    n: usize,
    gossip_ms: u64,
    replicas: usize,
) -> anyhow::Result<Vec<RunningNode>> {
    let first = node(certs, &format!("{tag}0"), &[], gossip_ms, replicas).await?;
    let seed = first
        .node
        .mesh()
        .map(|m| m.addr())
        .into_iter()
        .collect::<Vec<_>>();
    let mut nodes = vec![first];
    for i in 1..n {
        nodes.push(node(certs, &format!("{tag}{i}"), &seed, gossip_ms, replicas).await?);
    }
    let t0 = Instant::now();
    while !nodes.iter().all(|n| n.node.mesh_warm()) {
        anyhow::ensure!(t0.elapsed() < Duration::from_secs(30), "cluster never warm");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Let homes settle (every replica published once).
    tokio::time::sleep(Duration::from_millis(gossip_ms * 5)).await;
    Ok(nodes)
}

fn random_keys(n: usize) -> Vec<BlockKey> {
    let mut rng = rand::rng();
    (0..n).map(|_| BlockKey(rng.random())).collect()
}

/// Routes `keys` at `node`; returns the replica index.
fn route(node: &Arc<Node>, keys: &[BlockKey]) -> Option<usize> {
    let req = RouteRequest::plain("m", keys, keys.len() as u64 * 64);
    match node.route(&req) {
        (Decision::Route(d), _ticket) => Some(d.replica),
        _ => None,
    }
}

fn visible(node: &Arc<Node>, i: usize, keys: &[BlockKey]) -> bool {
    let now = node.now();
    node.lock().view.hit(i, keys, now) == keys.len()
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let k = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[k.clamp(1, sorted.len()) - 1]
}

async fn visibility(nodes: &[RunningNode], trials: usize, gossip_ms: u64) -> anyhow::Result<()> {
    let mut times = Vec::with_capacity(trials);
    let mut rng = rand::rng();
    for t in 0..trials {
        let at = t % nodes.len();
        let keys = random_keys(32);
        let Some(i) = route(&nodes[at].node, &keys) else {
            anyhow::bail!("no route");
        };
        let t0 = Instant::now();
        loop {
            if nodes.iter().all(|n| visible(&n.node, i, &keys)) {
                times.push(t0.elapsed());
                break;
            }
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(10),
                "prefix never visible"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        // Start the next trial at a random phase of the gossip round.
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..gossip_ms))).await;
    }
    times.sort();
    println!(
        "prefix visible on all {} nodes, gossip {gossip_ms} ms: p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms (n = {trials}; budget p99 ≤ {} ms)",
        nodes.len(),
        pct(&times, 50.0).as_secs_f64() * 1e3,
        pct(&times, 99.0).as_secs_f64() * 1e3,
        times.last().map_or(0.0, |d| d.as_secs_f64() * 1e3),
        2 * gossip_ms
    );
    Ok(())
}

/// Bytes a node sent and received on the mesh so far, as the transport counts them: gossip both
/// ways, summary responses sent, summaries pulled, and 40 bytes of framing per block report sent
/// (the transport counts reports, not their bytes; the caller adds 9 bytes per reported key).
fn mesh_bytes(node: &Arc<Node>) -> (u64, u64) {
    let Some(mesh) = node.mesh() else {
        return (0, 0);
    };
    let s = mesh.stats().transport;
    let pulled = node
        .mesh_slot()
        .metrics
        .get()
        .map_or(0, |m| m.sync_bytes_received.get());
    let sent = s.gossip_bytes_sent + s.sync_bytes_sent + s.reports_sent * 40;
    let received = s.gossip_bytes_received + pulled;
    (sent, received)
}

async fn traffic(nodes: &[RunningNode], secs: u64) -> anyhow::Result<()> {
    // 32 replicas × 10 req/s = 320 req/s over the nodes; each request: a 16-block prefix shared
    // by one of 64 conversations plus 16 new blocks (every request adds keys somewhere).
    let per_node = 320.0 / nodes.len() as f64;
    let prefixes: Arc<Vec<Vec<BlockKey>>> = Arc::new((0..64).map(|_| random_keys(16)).collect());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for n in nodes {
        let node = Arc::clone(&n.node);
        let prefixes = Arc::clone(&prefixes);
        let stop = Arc::clone(&stop);
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / per_node));
            let mut sent_keys = 0u64;
            let mut routed = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                tick.tick().await;
                let (p, tail) = {
                    let mut rng = rand::rng();
                    (rng.random_range(0..prefixes.len()), random_keys(16))
                };
                let mut keys = prefixes[p].clone();
                keys.extend(tail);
                if let Some(i) = route(&node, &keys) {
                    routed += 1;
                    let reported = node.lock().replicas[i].mesh.report_target().is_some();
                    if reported {
                        sent_keys += keys.len() as u64;
                    }
                }
            }
            (routed, sent_keys)
        }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before: Vec<(u64, u64)> = nodes.iter().map(|n| mesh_bytes(&n.node)).collect();
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let elapsed = t0.elapsed().as_secs_f64();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await?);
    }
    let total_elapsed = elapsed + 1.0;
    // Reported keys are counted over the whole run: take the measured window's share. Reports
    // received are estimated as an even share of all reports sent (homes are spread evenly).
    let window = |keys: u64| keys as f64 * elapsed / total_elapsed * 9.0;
    let all_report_bytes: f64 = results.iter().map(|(_, k)| window(*k)).sum();
    for (k, n) in nodes.iter().enumerate() {
        let (routed, report_keys) = results[k];
        let (s1, r1) = mesh_bytes(&n.node);
        let (s0, r0) = before[k];
        let sent = (s1 - s0) as f64 + window(report_keys);
        let recv = (r1 - r0) as f64 + all_report_bytes / nodes.len() as f64;
        println!(
            "node {k}: {:.0} req/s routed; mesh traffic sent {:.1} KiB/s, received {:.1} KiB/s, total {:.1} KiB/s (budget ≤ 256 KiB/s)",
            routed as f64 / total_elapsed,
            sent / elapsed / 1024.0,
            recv / elapsed / 1024.0,
            (sent + recv) / elapsed / 1024.0
        );
    }
    Ok(())
}

async fn join_to_warm(certs: &Path, nodes: &[RunningNode], replicas: usize) -> anyhow::Result<()> {
    // Fill the summaries first so the newcomer has real filters to pull.
    for n in nodes {
        for _ in 0..200 {
            route(&n.node, &random_keys(32));
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let seed: Vec<SocketAddr> = nodes[0].node.mesh().map(|m| m.addr()).into_iter().collect();
    let t0 = Instant::now();
    // The newcomer has no static replicas: it learns all of them from gossip.
    let newcomer = node(certs, "joiner", &seed, 100, 0).await?;
    let started = t0.elapsed();
    while !newcomer.node.mesh_warm() {
        anyhow::ensure!(t0.elapsed() < Duration::from_secs(30), "never warm");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let warm = t0.elapsed();
    let known = newcomer.node.replica_count();
    let with_summary = {
        let core = newcomer.node.lock();
        core.view
            .replicas()
            .iter()
            .filter(|r| r.summary.is_some())
            .count()
    };
    println!(
        "join to warm ({replicas}-replica region, 3 nodes, gossip 100 ms): {:.0} ms ({:.0} ms of it starting the node); {known} replicas learned, {with_summary} summaries pulled (budget ≤ 2000 ms)",
        warm.as_secs_f64() * 1e3,
        started.as_secs_f64() * 1e3
    );
    newcomer.shutdown().await;
    Ok(())
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    kvmesh::mesh::certs::init_dir(dir.path())?;

    let fast = cluster(dir.path(), "f", 3, 100, 32).await?;
    visibility(&fast, 100, 100).await?;
    traffic(&fast, 5).await?;
    for n in fast {
        n.shutdown().await;
    }

    let slow = cluster(dir.path(), "s", 3, 500, 32).await?;
    visibility(&slow, 40, 500).await?;
    for n in slow {
        n.shutdown().await;
    }

    let big = cluster(dir.path(), "j", 3, 100, 64).await?;
    join_to_warm(dir.path(), &big, 64).await?;
    for n in big {
        n.shutdown().await;
    }
    Ok(())
}
