//! `kvmesh demo`: the first thing a newcomer runs. A real two-region mesh on loopback — per region
//! two kvmesh nodes (gossip over QUIC with mTLS) in front of three simulated engine replicas —
//! replays a slice of the real Mooncake conversation trace through random nodes, once per policy
//! on a fresh fleet, and compares the results with the simulator's central greedy router and
//! with the TTFT floor no router can beat (`sim_bound.rs`).
//!
//! Everything runs in this process on 127.0.0.1 with real sockets; certificates go to a temporary
//! directory that is removed at the end. Replicas run `time_scale` times faster than real time
//! and arrivals are sped up to match, so figures are in model seconds.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;

use super::fleet::{mesh_section, wait_ready, Haproxy, MeshCerts};
use super::replay::{replay, ReplayConfig, RunResult};
use super::report;
use super::sim::{self, SimConfig};
use super::sim_bound::ttft_floor;
use super::trace::{self, default_trace};
use super::workload::{from_trace, WorkloadRequest};
use crate::core::policy::PolicyKind;
use crate::engine_sim::EngineConfig;
use crate::node::config::{DistanceConfig, MeshSection, NodeConfig, ReplicaConfig as NodeReplica};
use crate::proxy::{self, RunningNode};
use crate::replica::{self, ReplicaHandle};

const MODEL: &str = "sim-llama-8b";
/// Region names, in order; `--regions N` uses the first N. Neighbours are 80 ms apart.
const REGIONS: [&str; 4] = ["eu", "us", "ap", "sa"];

/// Arguments of `kvmesh demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Requests of the conversation trace to replay (1,200 ≈ 6 minutes of the trace).
    #[arg(long, default_value_t = 1200)]
    pub requests: usize,
    /// Regions (1–4); the default two are `eu` and `us`.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=4))]
    pub regions: u8,
    /// kvmesh nodes per region.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=8))]
    pub nodes_per_region: u8,
    /// Simulated replicas per region.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(1..=16))]
    pub replicas_per_region: u8,
    /// Trace arrivals are compressed by this factor, to load the six replicas (≈ 55% at 4).
    #[arg(long, default_value_t = 4.0)]
    pub speedup: f64,
    /// Replicas run this many times faster than real time.
    #[arg(long, default_value_t = 4.0)]
    pub time_scale: f64,
    /// Output tokens per request are capped at this, to keep the streams light on two cores
    /// (time to first token does not depend on it).
    #[arg(long, default_value_t = 64)]
    pub max_output: u32,
    /// Policies to compare, each on a fresh fleet.
    #[arg(long, value_delimiter = ',', default_value = "p2c-cache,round-robin")]
    pub policy: Vec<PolicyKind>,
    /// Least ms between two load updates a node sends its region's other nodes (the nodes'
    /// `mesh.load_share_interval_ms`); 0 turns load sharing off, to see what it brings.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(0..=1000))]
    pub load_share_ms: u64,
    /// Put haproxy (from `PATH`) in front of the nodes, round-robin over keep-alive
    /// connections, and send the workload to it: how users deploy several nodes.
    #[arg(long)]
    pub haproxy: bool,
    /// Send the workload to the first this many nodes only (0: every node); the others still
    /// gossip and share load. With 1, a mesh's decisions are one node's: what is left of a gap
    /// to a lone node is the mesh's overhead, not split decisions.
    #[arg(long, default_value_t = 0)]
    pub entry_nodes: usize,
    /// Directory for the reports and charts.
    #[arg(long, default_value = "kvmesh-out/demo")]
    pub out: PathBuf,
}

impl DemoArgs {
    /// The regions in use.
    fn region_names(&self) -> &'static [&'static str] {
        &REGIONS[..usize::from(self.regions).clamp(1, REGIONS.len())]
    }

    /// Configured distances: regions on a line, neighbours 80 ms apart.
    fn distances(&self) -> Vec<DistanceConfig> {
        let names = self.region_names();
        let mut out = Vec::new();
        for (i, a) in names.iter().enumerate() {
            for (j, b) in names.iter().enumerate().skip(i + 1) {
                out.push(DistanceConfig {
                    a: (*a).into(),
                    b: (*b).into(),
                    ms: 80.0 * (j - i) as f64,
                });
            }
        }
        out
    }
}

/// Runs `kvmesh demo`.
pub async fn main(args: DemoArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.requests > 0, "--requests must be at least 1");
    anyhow::ensure!(
        args.speedup > 0.0 && args.time_scale > 0.0,
        "--speedup and --time-scale must be > 0"
    );
    let started = Instant::now();
    let path = default_trace();
    let trace = trace::load(&path).with_context(|| format!("loading {}", path.display()))?;
    let mut workload = from_trace(&trace[..args.requests.min(trace.len())], true);
    for r in &mut workload {
        r.output_tokens = r.output_tokens.clamp(1, args.max_output.max(1));
    }
    let names: Vec<String> = args
        .region_names()
        .iter()
        .flat_map(|r| (0..usize::from(args.nodes_per_region)).map(move |n| node_name(r, n)))
        .collect();
    let certs = MeshCerts::new(names.iter().map(String::as_str))?;
    eprintln!(
        "kvmesh demo: {} region(s) x ({} nodes + {} simulated replicas), mTLS gossip over QUIC on \
         127.0.0.1; {} requests of the Mooncake conversation trace, arrivals x{}, replicas at {}x real time",
        args.regions,
        args.nodes_per_region,
        args.replicas_per_region,
        workload.len(),
        args.speedup,
        args.time_scale
    );
    let mut runs = Vec::new();
    for policy in &args.policy {
        let t = Instant::now();
        let run = run_mesh(&workload, *policy, &args, &certs)
            .await
            .with_context(|| format!("the {policy} run"))?;
        eprintln!("  {policy}: done in {:.1} s", t.elapsed().as_secs_f64());
        runs.push(run);
    }

    let engine = EngineConfig::default();
    let engine_floor = engine.clone();
    let oracle = sim::run(
        &workload,
        &SimConfig {
            replicas: usize::from(args.regions) * usize::from(args.replicas_per_region),
            oracle: true,
            engine,
            arrival_speedup: args.speedup,
            ..SimConfig::default()
        },
    )?;
    let reports: Vec<_> = runs.iter().map(report::summarize).collect();
    let mut table = report::markdown(&reports);
    table.push_str(&format!(
        "\nCentral greedy reference (kvmesh sim: one central router reading every engine's true \
         cache and queue, same workload and replicas; greedy, so beatable): TTFT mean {:.3} s, \
         p50 {:.3}, p90 {:.3}, p99 {:.3}; hit tokens {} (ratio {:.3}); load max/mean {:.2}\n",
        oracle.ttft.mean,
        oracle.ttft.p50,
        oracle.ttft.p90,
        oracle.ttft.p99,
        oracle.cached_tokens,
        oracle.hit_token_ratio,
        oracle.load_max_over_mean,
    ));
    let floor = ttft_floor(&workload, &engine_floor);
    table.push_str(&format!(
        "TTFT floor no router can beat (each request alone on an idle replica holding every block \
         an earlier request computed): mean {:.3} s, p50 {:.3}, p90 {:.3}, p99 {:.3}\n",
        floor.mean, floor.p50, floor.p90, floor.p99
    ));
    println!("\n{table}");
    if let [first, second, ..] = reports.as_slice() {
        if second.ttft.mean > 0.0 {
            println!(
                "{} vs {}: mean TTFT {:.2}x, prefix-hit tokens {:.2}x",
                first.label,
                second.label,
                first.ttft.mean / second.ttft.mean,
                first.cached_tokens as f64 / second.cached_tokens.max(1) as f64
            );
        }
    }
    let written = report::write_all(&args.out, &runs)?;
    std::fs::write(
        args.out.join("oracle.json"),
        serde_json::to_string_pretty(&oracle)?,
    )
    .context("writing oracle.json")?;
    std::fs::write(args.out.join("demo.md"), &table).context("writing demo.md")?;
    eprintln!(
        "reports and charts in {} ({} files); total {:.0} s",
        args.out.display(),
        written.len() + 2,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn node_name(region: &str, n: usize) -> String {
    format!("{region}-node-{n}")
}

/// One fresh two-region fleet running `policy`: start, wait until every node is ready, replay,
/// stop (also on error).
async fn run_mesh(
    workload: &[WorkloadRequest],
    policy: PolicyKind,
    args: &DemoArgs,
    certs: &MeshCerts,
) -> anyhow::Result<RunResult> {
    let mut replicas: Vec<(&str, ReplicaHandle)> = Vec::new();
    let mut nodes: Vec<RunningNode> = Vec::new();
    let mut front: Option<Haproxy> = None;
    let result = async {
        let engine = EngineConfig::default();
        for &region in args.region_names() {
            for i in 0..usize::from(args.replicas_per_region) {
                let mut cfg = replica::ReplicaConfig {
                    id: format!("{region}-replica-{i}"),
                    model: MODEL.into(),
                    engine: engine.clone(),
                    exit_on_crash: false,
                    ..Default::default()
                };
                cfg.engine.time_scale = args.time_scale;
                replicas.push((region, replica::spawn(cfg).await?));
            }
        }
        let mut seed_addr = None;
        for &region in args.region_names() {
            for n in 0..usize::from(args.nodes_per_region) {
                let name = node_name(region, n);
                let mut cfg = NodeConfig {
                    listen: ([127, 0, 0, 1], 0).into(),
                    debug_headers: true,
                    region: region.into(),
                    cluster_id: "kvmesh-demo".into(),
                    policy: policy.as_str().into(),
                    seed: nodes.len() as u64,
                    drain_s: 5,
                    ..NodeConfig::default()
                };
                cfg.health.interval_ms = 200;
                cfg.scrape.interval_ms = 100;
                cfg.replicas = replicas
                    .iter()
                    .filter(|(r, _)| *r == region)
                    .map(|(_, h)| NodeReplica {
                        id: Some(h.id.clone()),
                        models: vec![MODEL.into()],
                        capacity_tokens: Some(engine.kv_capacity_tokens as u64),
                        // Model-time rate, so the cost model works in model seconds.
                        prefill_tokens_per_s: 1000.0 / engine.prefill_ms_per_token,
                        ..NodeReplica::from_url(h.base_url())
                    })
                    .collect();
                cfg.mesh = Some(MeshSection {
                    distance: args.distances(),
                    load_share_interval_ms: args.load_share_ms,
                    ..mesh_section(&name, certs, seed_addr)
                });
                let node = proxy::spawn(cfg).await?;
                if seed_addr.is_none() {
                    seed_addr = node.node.mesh().map(|m| m.addr());
                }
                nodes.push(node);
            }
        }
        wait_ready(&nodes).await?;
        let entry = match args.entry_nodes {
            0 => nodes.len(),
            n => n.min(nodes.len()),
        };
        let mut targets: Vec<String> = nodes[..entry]
            .iter()
            .map(|n| format!("http://{}", n.addr))
            .collect();
        if args.haproxy {
            let addrs: Vec<_> = nodes[..entry].iter().map(|n| n.addr).collect();
            let proxy = Haproxy::start(&addrs, true, certs.dir()).await?;
            targets = vec![proxy.url.clone()];
            front = Some(proxy);
        }
        let before: Vec<(u64, u64)> = nodes.iter().map(mesh_bytes).collect();
        let started = Instant::now();
        let cfg = ReplayConfig {
            targets,
            model: Some(MODEL.into()),
            speedup: args.speedup * args.time_scale,
            time_scale: args.time_scale,
            label: policy.as_str().into(),
            progress: true,
            ..ReplayConfig::default()
        };
        let mut run = replay(workload, &cfg).await?;
        let secs = started.elapsed().as_secs_f64().max(1e-3);
        if nodes.len() > 1 {
            let per_node: Vec<String> = nodes
                .iter()
                .zip(&before)
                .map(|(n, b)| {
                    let a = mesh_bytes(n);
                    format!(
                        "gossip+sync {:.1} KiB/s, load sharing {:.1} KiB/s",
                        (a.0 - b.0) as f64 / secs / 1024.0,
                        (a.1 - b.1) as f64 / secs / 1024.0
                    )
                })
                .collect();
            eprintln!(
                "  mesh traffic per node (sent + received): {}",
                per_node.join("; ")
            );
        }
        run.replicas = replicas.iter().map(|(_, h)| h.id.clone()).collect();
        anyhow::Ok(run)
    }
    .await;
    drop(front);
    for n in nodes {
        n.shutdown().await;
    }
    for (_, r) in replicas {
        r.shutdown().await;
    }
    result
}

/// Bytes a node's mesh moved so far, sent plus received: (gossip and summary sync, load sharing).
fn mesh_bytes(n: &RunningNode) -> (u64, u64) {
    n.node.mesh().map_or((0, 0), |m| {
        let s = m.transport().stats().snapshot();
        (
            s.gossip_bytes_sent + s.gossip_bytes_received + s.sync_bytes_sent,
            s.load_bytes_sent + s.load_bytes_received,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        demo: DemoArgs,
    }

    #[test]
    fn the_default_is_two_regions_of_two_nodes_and_three_replicas_80_ms_apart() {
        let a = Cli::parse_from(["demo"]).demo;
        assert_eq!(
            (a.regions, a.nodes_per_region, a.replicas_per_region),
            (2, 2, 3)
        );
        assert_eq!(a.region_names(), ["eu", "us"]);
        let d = a.distances();
        assert_eq!(d.len(), 1);
        assert_eq!(
            (d[0].a.as_str(), d[0].b.as_str(), d[0].ms),
            ("eu", "us", 80.0)
        );
    }

    #[test]
    fn regions_lie_on_a_line_and_bad_shapes_are_refused() {
        let a = Cli::parse_from(["demo", "--regions", "3"]).demo;
        let d: Vec<_> = a
            .distances()
            .into_iter()
            .map(|d| (d.a, d.b, d.ms))
            .collect();
        assert_eq!(
            d,
            [
                ("eu".into(), "us".into(), 80.0),
                ("eu".into(), "ap".into(), 160.0),
                ("us".into(), "ap".into(), 80.0)
            ]
        );
        for bad in [
            ["demo", "--regions", "0"],
            ["demo", "--regions", "5"],
            ["demo", "--nodes-per-region", "0"],
            ["demo", "--replicas-per-region", "17"],
        ] {
            assert!(Cli::try_parse_from(bad).is_err(), "{bad:?}");
        }
    }
}
