//! `kvmesh demo`: the first thing a newcomer runs. A real two-region mesh on loopback — per region
//! two kvmesh nodes (gossip over QUIC with mTLS) in front of three simulated engine replicas —
//! replays a slice of the real Mooncake conversation trace (or a synthetic family) through random
//! nodes, once per policy on a fresh fleet, and compares the results with the simulator's central
//! greedy router and with the TTFT floor no router can beat (`sim_bound.rs`).
//!
//! Everything runs in this process on 127.0.0.1 with real sockets; certificates go to a temporary
//! directory that is removed at the end. Replicas run `time_scale` times faster than real time
//! and arrivals are sped up to match, so figures are in model seconds.
//!
//! Regions lie on a line, `--region-rtt-ms` apart, and a request forwarded between them pays
//! that distance on the wire too: each node gives its peers the URL of a [`DelayLine`] in front
//! of it. A line delays whatever comes in by one distance, the one from the node's nearest
//! region that takes clients: exact for two regions and for any fleet whose every region is
//! forwarded to from one distance only (three regions with clients at the two ends, say).
//! `--entry-weights` puts the clients near some regions, `--workload` swaps the trace for a
//! synthetic family, and `--forward-by cost,nearest` runs each policy with both ways of choosing
//! the region a request is forwarded to (issue #17).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;

use super::delay_line::DelayLine;
use super::fleet::{mesh_section, wait_ready, Haproxy, MeshCerts};
use super::replay::{replay, ReplayConfig, RunResult};
use super::report;
use super::sim::{self, SimConfig};
use super::sim_bound::ttft_floor;
use super::trace::{self, default_trace};
use super::workload::args::build_with;
use super::workload::{from_trace, ideal_hit_ratio, GenParams, WorkloadKind, WorkloadRequest};
use crate::core::policy::PolicyKind;
use crate::core::region_choice::ForwardChoice;
use crate::engine_sim::EngineConfig;
use crate::node::config::{DistanceConfig, MeshSection, NodeConfig, ReplicaConfig as NodeReplica};
use crate::proxy::{self, warm_peers, RunningNode};
use crate::replica::{self, ReplicaHandle};

const MODEL: &str = "sim-llama-8b";
/// Region names, in order; `--regions N` uses the first N, on a line.
const REGIONS: [&str; 4] = ["eu", "us", "ap", "sa"];

/// Arguments of `kvmesh demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Requests to replay: the first of the conversation trace (1,200 ≈ 6 minutes of it), or
    /// as many of a synthetic family.
    #[arg(long, default_value_t = 1200)]
    pub requests: usize,
    /// Workload: `trace[:path]` (default: the shipped conversation trace) or a synthetic
    /// family (`rag`, `chat`, … as for `kvmesh bench`).
    #[arg(long, default_value = "trace")]
    pub workload: WorkloadKind,
    /// Synthetic families: the Poisson arrival rate in requests/s of model time (default 20).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Synthetic families: one parameter, `KEY=VALUE` (repeatable; keys as for `kvmesh bench`).
    #[arg(long = "family-param", value_name = "KEY=VALUE")]
    pub family_params: Vec<String>,
    /// Seed of the synthetic family and of the clients' choice of node.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Regions (1–4); the default two are `eu` and `us`.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=4))]
    pub regions: u8,
    /// kvmesh nodes per region.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=8))]
    pub nodes_per_region: u8,
    /// Simulated replicas per region.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(1..=16))]
    pub replicas_per_region: u8,
    /// Arrivals are compressed by this factor; default 4 for the trace (to load the six
    /// replicas ≈ 55%), 1 for a synthetic family (set its `--rate` instead).
    #[arg(long)]
    pub speedup: Option<f64>,
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
    /// Round trip between neighbouring regions in ms of model time: the nodes'
    /// `[[mesh.distance]]`, and with `--wire-delay` what a forwarded request pays.
    #[arg(long, default_value_t = 80.0)]
    pub region_rtt_ms: f64,
    /// Forwarded requests pay their regions' distance on the wire (a delay line in front of
    /// each node); false: loopback's ~0 ms whatever the configured distance.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub wire_delay: bool,
    /// Share of the clients each region's nodes take, `w0,w1,…` by region (a region of weight
    /// 0 gets no client: only what other regions forward); default every node alike.
    #[arg(long, value_delimiter = ',')]
    pub entry_weights: Vec<f64>,
    /// How a forwarded request's region is chosen (the nodes' `forward_by`); with both, each
    /// policy runs once with each.
    #[arg(long, value_delimiter = ',', default_value = "cost")]
    pub forward_by: Vec<ForwardChoice>,
    /// Every replica's `max_in_flight` at the nodes (a region whose replicas are all at it
    /// forwards); default the nodes' own (256).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_in_flight: Option<u32>,
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

    /// Configured distances: regions on a line, neighbours `region_rtt_ms` apart.
    fn distances(&self) -> Vec<DistanceConfig> {
        let names = self.region_names();
        let mut out = Vec::new();
        for (i, a) in names.iter().enumerate() {
            for (j, b) in names.iter().enumerate().skip(i + 1) {
                out.push(DistanceConfig {
                    a: (*a).into(),
                    b: (*b).into(),
                    ms: self.region_rtt_ms * (j - i) as f64,
                    kv_gb_per_s: None,
                    kv_setup_ms: None,
                });
            }
        }
        out
    }

    /// Whether region `i` takes clients.
    fn is_entry(&self, i: usize) -> bool {
        self.entry_weights.is_empty() || self.entry_weights.get(i).is_some_and(|w| *w > 0.0)
    }

    /// The round trip in ms of model time that requests forwarded to region `i` pay: its
    /// distance from the nearest other region that takes clients (the only regions that
    /// forward), else from its nearest neighbour; 0 with one region.
    fn wire_rtt_ms(&self, i: usize) -> f64 {
        let n = self.region_names().len();
        let others = || (0..n).filter(move |j| *j != i);
        let from = |j: usize| self.region_rtt_ms * i.abs_diff(j) as f64;
        others()
            .filter(|j| self.is_entry(*j))
            .map(from)
            .reduce(f64::min)
            .or_else(|| others().map(from).reduce(f64::min))
            .unwrap_or(0.0)
    }

    /// Arrivals are divided by this.
    fn speedup(&self) -> f64 {
        let default = if matches!(self.workload, WorkloadKind::Trace(_)) {
            4.0
        } else {
            1.0
        };
        self.speedup.unwrap_or(default)
    }

    /// The requests to replay.
    fn workload(&self) -> anyhow::Result<Vec<WorkloadRequest>> {
        let mut workload = match &self.workload {
            WorkloadKind::Trace(path) => {
                let path = path.clone().unwrap_or_else(default_trace);
                let trace =
                    trace::load(&path).with_context(|| format!("loading {}", path.display()))?;
                from_trace(&trace[..self.requests.min(trace.len())], true)
            }
            kind => {
                let gen = GenParams {
                    rate: self.rate.unwrap_or(GenParams::default().rate),
                    requests: self.requests,
                    seed: self.seed,
                };
                build_with(kind, &gen, &self.family_params)?.requests
            }
        };
        for r in &mut workload {
            r.output_tokens = r.output_tokens.clamp(1, self.max_output.max(1));
        }
        Ok(workload)
    }

    /// Checks what clap cannot.
    fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.requests > 0, "--requests must be at least 1");
        anyhow::ensure!(
            self.speedup() > 0.0
                && self.speedup().is_finite()
                && self.time_scale > 0.0
                && self.time_scale.is_finite(),
            "--speedup and --time-scale must be > 0"
        );
        anyhow::ensure!(
            self.region_rtt_ms.is_finite() && (0.0..=10_000.0).contains(&self.region_rtt_ms),
            "--region-rtt-ms must be within 0..=10000"
        );
        let regions = self.region_names().len();
        anyhow::ensure!(
            self.entry_weights.is_empty()
                || (self.entry_weights.len() == regions
                    && self
                        .entry_weights
                        .iter()
                        .all(|w| w.is_finite() && *w >= 0.0)
                    && self.entry_weights.iter().any(|w| *w > 0.0)),
            "--entry-weights needs one weight per region ({regions}), none negative, not all 0"
        );
        anyhow::ensure!(
            self.entry_weights.is_empty() || (!self.haproxy && self.entry_nodes == 0),
            "--entry-weights does not go with --haproxy or --entry-nodes"
        );
        anyhow::ensure!(!self.forward_by.is_empty(), "--forward-by needs a choice");
        anyhow::ensure!(
            !matches!(self.workload, WorkloadKind::Trace(_))
                || (self.family_params.is_empty() && self.rate.is_none()),
            "--family-param and --rate apply to the synthetic families, not the trace"
        );
        Ok(())
    }
}

/// Runs `kvmesh demo`.
pub async fn main(args: DemoArgs) -> anyhow::Result<()> {
    args.validate()?;
    let started = Instant::now();
    let workload = args.workload()?;
    let names: Vec<String> = args
        .region_names()
        .iter()
        .flat_map(|r| (0..usize::from(args.nodes_per_region)).map(move |n| node_name(r, n)))
        .collect();
    let certs = MeshCerts::new(names.iter().map(String::as_str))?;
    let what = match &args.workload {
        WorkloadKind::Trace(None) => "the Mooncake conversation trace".to_owned(),
        kind => format!("the {} workload", kind.name()),
    };
    eprintln!(
        "kvmesh demo: {} region(s) x ({} nodes + {} simulated replicas), mTLS gossip over QUIC on \
         127.0.0.1; {} requests of {what}, arrivals x{}, replicas at {}x real time",
        args.regions,
        args.nodes_per_region,
        args.replicas_per_region,
        workload.len(),
        args.speedup(),
        args.time_scale
    );
    if args.wire_delay && args.regions > 1 {
        let rtts: Vec<String> = args
            .region_names()
            .iter()
            .enumerate()
            .map(|(i, r)| format!("{r} {:.0} ms", args.wire_rtt_ms(i)))
            .collect();
        eprintln!(
            "  a request forwarded to a region pays on the wire (round trip, model time): {}",
            rtts.join(", ")
        );
    }
    let mut runs = Vec::new();
    for policy in &args.policy {
        for &forward_by in &args.forward_by {
            let label = match args.forward_by.len() {
                1 => policy.as_str().to_owned(),
                _ => format!("{policy} by {}", forward_name(forward_by)),
            };
            let t = Instant::now();
            let run = run_mesh(&workload, *policy, forward_by, &label, &args, &certs)
                .await
                .with_context(|| format!("the {label} run"))?;
            eprintln!("  {label}: done in {:.1} s", t.elapsed().as_secs_f64());
            runs.push(run);
        }
    }

    let engine = EngineConfig::default();
    let engine_floor = engine.clone();
    let oracle = sim::run(
        &workload,
        &SimConfig {
            replicas: usize::from(args.regions) * usize::from(args.replicas_per_region),
            oracle: true,
            engine,
            arrival_speedup: args.speedup(),
            ..SimConfig::default()
        },
    )?;
    let reports: Vec<_> = runs.iter().map(report::summarize).collect();
    let mut table = report::markdown(&reports);
    // Behind haproxy the entry node is unknown.
    if args.regions > 1 && !args.haproxy {
        table.push_str("\nServed in another region than the one the client sent to:\n\n");
        for run in &runs {
            table.push_str(&format!("- {}: {}\n", run.label, forwarded(run, &args)));
        }
    }
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
    let refs = hit_references(&workload, oracle.hit_token_ratio);
    let written = report::write_all(&args.out, &runs, &refs)?;
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

/// The hit chart's references: what one infinite cache would hit (no router does better) and
/// the central greedy router (`central_ratio`).
fn hit_references(workload: &[WorkloadRequest], central_ratio: f64) -> [report::HitReference; 2] {
    [
        report::HitReference {
            label: "ideal (one infinite cache)".into(),
            ratio: ideal_hit_ratio(workload),
        },
        report::HitReference {
            label: "central greedy reference".into(),
            ratio: central_ratio,
        },
    ]
}

fn node_name(region: &str, n: usize) -> String {
    format!("{region}-node-{n}")
}

/// How many of `run`'s answered requests a replica of another region than their entry node's
/// served, in all and by serving region. Nodes are numbered region by region, as `run_mesh`
/// starts them; replicas are named after their region.
fn forwarded(run: &RunResult, args: &DemoArgs) -> String {
    let names = args.region_names();
    let per_region = usize::from(args.nodes_per_region).max(1);
    let mut to = vec![0usize; names.len()];
    let mut answered = 0;
    for r in &run.records {
        let (Some(entry), Some(replica)) = (names.get(r.target / per_region), &r.replica) else {
            continue;
        };
        answered += 1;
        let served = names.iter().position(|n| {
            replica
                .strip_prefix(n)
                .is_some_and(|rest| rest.starts_with("-replica-"))
        });
        if let Some(g) = served.filter(|g| names[*g] != *entry) {
            to[g] += 1;
        }
    }
    let by: Vec<String> = names
        .iter()
        .zip(&to)
        .filter(|(_, n)| **n > 0)
        .map(|(name, n)| format!("{name} {n}"))
        .collect();
    format!(
        "{} of {answered} ({})",
        to.iter().sum::<usize>(),
        if by.is_empty() {
            "none".into()
        } else {
            format!("to {}", by.join(", "))
        }
    )
}

fn forward_name(f: ForwardChoice) -> &'static str {
    match f {
        ForwardChoice::Cost => "cost",
        ForwardChoice::Nearest => "nearest",
    }
}

/// One fresh fleet running `policy`: start, wait until every node is ready, replay, stop (also
/// on error).
async fn run_mesh(
    workload: &[WorkloadRequest],
    policy: PolicyKind,
    forward_by: ForwardChoice,
    label: &str,
    args: &DemoArgs,
    certs: &MeshCerts,
) -> anyhow::Result<RunResult> {
    let mut fleet = DemoFleet::default();
    let result = async {
        fleet.start_replicas(args).await?;
        fleet.start_nodes(policy, forward_by, args, certs).await?;
        wait_ready(&fleet.nodes).await?;
        wait_regions(&fleet.nodes, args.region_names().len()).await?;
        let targets = fleet.targets(args, certs).await?;
        let before: Vec<(u64, u64)> = fleet.nodes.iter().map(mesh_bytes).collect();
        let started = Instant::now();
        let cfg = ReplayConfig {
            targets,
            // Empty (every node alike) unless the clients sit near some regions.
            target_weights: if args.entry_weights.is_empty() {
                Vec::new()
            } else {
                std::mem::take(&mut fleet.weights)
            },
            seed: args.seed,
            model: Some(MODEL.into()),
            speedup: args.speedup() * args.time_scale,
            time_scale: args.time_scale,
            label: label.into(),
            progress: true,
            ..ReplayConfig::default()
        };
        let mut run = replay(workload, &cfg).await?;
        let secs = started.elapsed().as_secs_f64().max(1e-3);
        fleet.print_wire_use(&before, secs);
        run.replicas = fleet.replicas.iter().map(|(_, h)| h.id.clone()).collect();
        anyhow::Ok(run)
    }
    .await;
    fleet.shutdown().await;
    result
}

/// What one demo run started, kept apart from the run itself so that everything started is
/// stopped even when a later step fails.
#[derive(Default)]
struct DemoFleet {
    /// The simulated replicas, each with its region's name.
    replicas: Vec<(&'static str, ReplicaHandle)>,
    /// The kvmesh nodes, region by region.
    nodes: Vec<RunningNode>,
    /// Each node's delay line (with the node's name).
    lines: Vec<(String, DelayLine)>,
    /// The client weight of each node.
    weights: Vec<f64>,
    /// haproxy in front of the entry nodes, with `--haproxy`.
    front: Option<Haproxy>,
}

impl DemoFleet {
    /// Starts `replicas_per_region` simulated replicas in every region.
    async fn start_replicas(&mut self, args: &DemoArgs) -> anyhow::Result<()> {
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
                self.replicas.push((region, replica::spawn(cfg).await?));
            }
        }
        Ok(())
    }

    /// Starts `nodes_per_region` meshed nodes in every region, each over its region's replicas,
    /// behind a delay line (the regions' distance) when the demo puts one on the wire.
    async fn start_nodes(
        &mut self,
        policy: PolicyKind,
        forward_by: ForwardChoice,
        args: &DemoArgs,
        certs: &MeshCerts,
    ) -> anyhow::Result<()> {
        let mut seed_addr = None;
        for (g, &region) in args.region_names().iter().enumerate() {
            for n in 0..usize::from(args.nodes_per_region) {
                let name = node_name(region, n);
                let line = if args.wire_delay && args.regions > 1 {
                    // Half the round trip each way, in wall time.
                    let one_way = args.wire_rtt_ms(g) / 2000.0 / args.time_scale;
                    let one_way = Duration::try_from_secs_f64(one_way)
                        .with_context(|| format!("a one-way delay of {one_way} s"))?;
                    Some(DelayLine::start(one_way).await?)
                } else {
                    None
                };
                let mut cfg = self.node_config(region, policy, forward_by, args);
                cfg.mesh = Some(MeshSection {
                    distance: args.distances(),
                    load_share_interval_ms: args.load_share_ms,
                    http_url: line.as_ref().map(|l| format!("https://{}", l.addr)),
                    ..mesh_section(&name, certs, seed_addr)
                });
                let node = proxy::spawn(cfg).await?;
                if seed_addr.is_none() {
                    seed_addr = node.node.mesh().map(|m| m.addr());
                }
                if let Some(line) = line {
                    let peer = node
                        .peer_addr
                        .context("a meshed node has a listener for forwarded requests")?;
                    line.set_upstream(peer);
                    self.lines.push((name, line));
                }
                self.weights.push(match args.entry_weights.get(g) {
                    Some(w) => w / f64::from(args.nodes_per_region),
                    None => 1.0,
                });
                self.nodes.push(node);
            }
        }
        Ok(())
    }

    /// The next node's configuration (but its mesh section): `region`'s replicas, fast health
    /// checks and scrapes, debug headers.
    fn node_config(
        &self,
        region: &str,
        policy: PolicyKind,
        forward_by: ForwardChoice,
        args: &DemoArgs,
    ) -> NodeConfig {
        let engine = EngineConfig::default();
        let mut cfg = NodeConfig {
            listen: ([127, 0, 0, 1], 0).into(),
            debug_headers: true,
            region: region.into(),
            cluster_id: "kvmesh-demo".into(),
            policy: policy.as_str().into(),
            seed: self.nodes.len() as u64,
            drain_s: 5,
            forward_by,
            ..NodeConfig::default()
        };
        cfg.health.interval_ms = 200;
        cfg.scrape.interval_ms = 100;
        cfg.replicas = self
            .replicas
            .iter()
            .filter(|(r, _)| *r == region)
            .map(|(_, h)| NodeReplica {
                id: Some(h.id.clone()),
                models: vec![MODEL.into()],
                capacity_tokens: Some(engine.kv_capacity_tokens as u64),
                // Model-time rate, so the cost model works in model seconds.
                prefill_tokens_per_s: 1000.0 / engine.prefill_ms_per_token,
                max_in_flight: args
                    .max_in_flight
                    .unwrap_or(NodeReplica::from_url(h.base_url()).max_in_flight),
                ..NodeReplica::from_url(h.base_url())
            })
            .collect();
        cfg
    }

    /// Where the clients send: the first `entry_nodes` nodes (0: all), or haproxy in front of
    /// them with `--haproxy`.
    async fn targets(&mut self, args: &DemoArgs, certs: &MeshCerts) -> anyhow::Result<Vec<String>> {
        let entry = match args.entry_nodes {
            0 => self.nodes.len(),
            n => n.min(self.nodes.len()),
        };
        let mut targets: Vec<String> = self.nodes[..entry]
            .iter()
            .map(|n| format!("http://{}", n.addr))
            .collect();
        if args.haproxy {
            let addrs: Vec<_> = self.nodes[..entry].iter().map(|n| n.addr).collect();
            let proxy = Haproxy::start(&addrs, true, certs.dir()).await?;
            targets = vec![proxy.url.clone()];
            self.front = Some(proxy);
        }
        Ok(targets)
    }

    /// Prints each node's mesh traffic since `before` over `secs` of the run and the
    /// connections peers opened to each node across the delay lines.
    fn print_wire_use(&self, before: &[(u64, u64)], secs: f64) {
        if self.nodes.len() > 1 {
            let per_node: Vec<String> = self
                .nodes
                .iter()
                .zip(before)
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
        if !self.lines.is_empty() {
            // Peers' connections to each node (warm-ups and forwards; HTTP/2, so one per peer
            // unless one was lost): each new one paid its handshakes across the regions.
            let opened: Vec<String> = self
                .lines
                .iter()
                .map(|(name, line)| format!("{name} {}", line.connections()))
                .collect();
            eprintln!(
                "  connections peers opened to each node: {}",
                opened.join(", ")
            );
        }
    }

    /// Stops everything: haproxy, the nodes (each draining), the delay lines, the replicas.
    async fn shutdown(self) {
        drop(self.front);
        for n in self.nodes {
            n.shutdown().await;
        }
        drop(self.lines);
        for (_, r) in self.replicas {
            r.shutdown().await;
        }
    }
}

/// Waits until every node knows every other region's record and holds a connection to the
/// nodes it would forward to there, so that spills can be forwarded from the first request as
/// they would be in a fleet that has run for a while (a region's record arrives a region-layer
/// round or two after the nodes are ready; the connection one handshake later).
async fn wait_regions(nodes: &[RunningNode], regions: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let settled = |n: &RunningNode| {
        let known = n.node.lock().view.remote_regions.len() + 1 >= regions;
        let warmed = warm_peers::warmups(&n.node, "ok");
        let warm_off = n
            .node
            .cfg
            .mesh
            .as_ref()
            .is_none_or(|m| m.warm_forward_interval_ms == 0);
        known && (warm_off || warmed >= warm_peers::targets(&n.node).len() as u64)
    };
    while !nodes.iter().all(settled) {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the nodes did not learn every region's record (and connect to its nodes) in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
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
            ["demo", "--forward-by", "far"],
            ["demo", "--max-in-flight", "0"],
            ["demo", "--regions", "5"],
            ["demo", "--nodes-per-region", "0"],
            ["demo", "--replicas-per-region", "17"],
        ] {
            assert!(Cli::try_parse_from(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_forwarded_request_pays_the_distance_from_the_nearest_region_with_clients() {
        let two = Cli::parse_from(["demo"]).demo;
        assert_eq!((two.wire_rtt_ms(0), two.wire_rtt_ms(1)), (80.0, 80.0));
        // Clients at both ends of three regions 50 ms apart: the middle is forwarded to from
        // 50 ms either way, each end only from the other end.
        let ends = Cli::parse_from([
            "demo",
            "--regions",
            "3",
            "--region-rtt-ms",
            "50",
            "--entry-weights",
            "0.8,0,0.2",
        ])
        .demo;
        ends.validate().unwrap();
        let rtts: Vec<f64> = (0..3).map(|i| ends.wire_rtt_ms(i)).collect();
        assert_eq!(rtts, [100.0, 50.0, 100.0]);
        let d: Vec<f64> = ends.distances().iter().map(|d| d.ms).collect();
        assert_eq!(d, [50.0, 100.0, 50.0]);
        // One region with clients: it is forwarded to by nobody; the others from it.
        let one = Cli::parse_from(["demo", "--regions", "3", "--entry-weights", "0,1,0"]).demo;
        let rtts: Vec<f64> = (0..3).map(|i| one.wire_rtt_ms(i)).collect();
        assert_eq!(rtts, [80.0, 80.0, 80.0]);
        assert_eq!(
            Cli::parse_from(["demo", "--regions", "1"])
                .demo
                .wire_rtt_ms(0),
            0.0
        );
    }

    #[test]
    fn entry_weights_and_workloads_are_checked_before_anything_starts() {
        for bad in [
            &["demo", "--entry-weights", "1,1,1"][..],
            &["demo", "--entry-weights", "0,0"],
            &["demo", "--entry-weights=1,-1"],
            &["demo", "--entry-weights", "1,1", "--haproxy"],
            &["demo", "--region-rtt-ms=-1"],
            &["demo", "--speedup", "0"],
            &["demo", "--rate", "5"],
        ] {
            let a = Cli::parse_from(bad).demo;
            assert!(a.validate().is_err(), "{bad:?}");
        }
        let rag = Cli::parse_from([
            "demo",
            "--workload",
            "rag",
            "--requests",
            "50",
            "--rate",
            "5",
            "--family-param",
            "chunk_tokens=1024",
        ])
        .demo;
        rag.validate().unwrap();
        assert_eq!(rag.speedup(), 1.0);
        let w = rag.workload().unwrap();
        assert_eq!(w.len(), 50);
        assert!(w.iter().all(|r| r.output_tokens <= 64));
        assert_eq!(Cli::parse_from(["demo"]).demo.speedup(), 4.0);
        let bad_key = Cli::parse_from(["demo", "--workload", "rag", "--family-param", "x=1"]).demo;
        assert!(bad_key.workload().is_err());
    }
}
