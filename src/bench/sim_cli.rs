//! `kvmesh sim` on the command line: run several policies (and the central greedy reference, and
//! the TTFT floor of `sim_bound.rs`) on one workload (the
//! trace or a synthetic family, see [`super::workload`]) and print one table; write the reports
//! as JSON and Markdown.

use crate::core::region_choice::ForwardChoice;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;

use super::hot_args::{hot_markdown, HotArgs, HotRow};
use super::report;
use super::sim::CENTRAL_GREEDY;
use super::sim::{run, NodeFailure, SimConfig, SimReport};
use super::sim_bound::ttft_floor;
use super::sim_bytes::{byte_table, mesh_bytes_markdown, GossipByteModel, GossipLayout, MeshShape};
use super::sim_classes::{class_markdown, ClassStats};
use super::sim_pd::{self, SimPd};
use super::tenant_args::{split_markdown, TenantArgs};
use super::tier_args::TierArgs;
use super::workload::{self, WorkloadArgs, WorkloadKind, WorkloadRequest};
use crate::core::cost::CostModel;
use crate::core::kv_load::KvLoad;
use crate::core::policy::PolicyKind;
use crate::engine_sim::{EngineConfig, Preset};
use crate::node::config::MAX_RECOMPUTE_CHARGE_PER_S;

/// Arguments of `kvmesh sim`.
#[derive(Debug, Args)]
pub struct SimArgs {
    /// The workload (trace or synthetic family) and its rate, size and seed.
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// Tenant KV quotas, the replicas' KV cache size and a tenant reported apart.
    #[command(flatten)]
    pub tenants: TenantArgs,
    /// A CPU tier on the engines, its link, and load-time weighting in the routers.
    #[command(flatten)]
    pub tiers: TierArgs,
    /// Home nodes keep exact cache models from the engines' KV events (tiers included), as
    /// with `kv_events` configured, instead of approximate ones from routed requests.
    #[arg(long)]
    pub exact_homes: bool,
    /// Mooncake-format JSONL trace (same as `--workload trace:PATH`).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Policies to compare (comma-separated). Default: every policy.
    #[arg(long, value_delimiter = ',')]
    pub policy: Vec<PolicyKind>,
    /// Also run the central greedy reference (one central router with an exact, instant view;
    /// greedy, so beatable: a reference, not a bound).
    #[arg(long, alias = "oracle", default_value_t = true, action = clap::ArgAction::Set)]
    pub central: bool,
    /// Router nodes.
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// Engine replicas.
    #[arg(long, default_value_t = 8)]
    pub replicas: usize,
    /// Regions: node n and replica r live in region n % regions, r % regions.
    #[arg(long, default_value_t = 1)]
    pub regions: usize,
    /// Round-trip time between neighbouring regions in milliseconds (regions lie on a line).
    #[arg(long, default_value_t = 50)]
    pub region_rtt_ms: u64,
    /// How often a replica's home scrapes its engine's metrics, in ms (the node's
    /// `scrape.interval_ms`).
    #[arg(long, default_value_t = 1000)]
    pub scrape_ms: u64,
    /// Least time between two summary-version publications of a replica's home, in ms (the
    /// node's `mesh.replica_load_interval_ms`; 0 = every gossip round).
    #[arg(long, default_value_t = 1000)]
    pub replica_load_ms: u64,
    /// Delay until a node's routing reaches the other nodes of its region (load sharing), in
    /// ms; 0 models load sharing off.
    #[arg(long, default_value_t = 2)]
    pub load_share_ms: u64,
    /// Gossip interval in milliseconds.
    #[arg(long, default_value_t = 100)]
    pub gossip_ms: u64,
    /// Peers each node gossips with per round.
    #[arg(long, default_value_t = 3)]
    pub fanout: usize,
    /// Gossip layout: `regional` (a cluster per region, other regions heard through region
    /// records) or `flat` (one cluster of every node); several (`flat,regional`) run each
    /// policy once per layout.
    #[arg(long, value_delimiter = ',', default_value = "regional")]
    pub gossip_layout: Vec<GossipLayout>,
    /// With the regional layout: the representatives' gossip interval (how often a region's
    /// record is refreshed), in ms.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..))]
    pub region_interval_ms: u64,
    /// Print the gossip byte model's growth table (flat against regions of 25 nodes, 10 to
    /// 10,000 nodes) and exit.
    #[arg(long)]
    pub byte_table: bool,
    /// Print where pulling a prefix's KV from another region pays against recomputing it and
    /// forwarding the request (prompt length × link × load on either side, regions
    /// `--region-rtt-ms` apart; the router's weighing, `core::remote_prefix`) and exit.
    #[arg(long)]
    pub kv_fetch_region_table: bool,
    /// A node failure, NODE@SECONDS from the first arrival (repeatable), e.g. `--fail 0@30`.
    #[arg(long = "fail")]
    pub failures: Vec<NodeFailure>,
    /// Milliseconds until the others declare a failed node dead and re-home its replicas.
    #[arg(long, default_value_t = 2000)]
    pub failure_detection_ms: u64,
    /// Divide the workload's arrival times by this (2 = twice the rate).
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Seconds of predicted TTFT credited to a session's rendezvous-preferred replica, in ms (the
    /// node's `affinity_credit_s`). Default: the node's default.
    #[arg(long)]
    pub affinity_credit_ms: Option<u64>,
    /// `p2c-cache`'s eviction charge (the node's `evict_charge`, 0..=1000, the same bound).
    /// Default: the node's default.
    #[arg(long, value_parser = parse_evict_charge)]
    pub evict_charge: Option<f64>,
    /// Share of the arrivals each region's nodes take, as `w0,w1,…` by region index (clients
    /// near some regions only); default: every node alike.
    #[arg(long, value_delimiter = ',')]
    pub entry_weights: Vec<f64>,
    /// Which region a forwarded request goes to (the node's `forward_by`): `cost` (least RTT +
    /// queue + prefill of what the region does not hold) or `nearest` (nearest with room).
    #[arg(long, default_value = "cost")]
    pub forward_by: ForwardChoice,
    /// KV fetch modes to compare, one run each (the node's `[kv_fetch] mode`): `off`, `priced`
    /// (a pull priced in the decision), `reactive` (decide, then pull from the longest holder).
    /// Any mode but `off` makes every replica take `vllm-envelope` hints.
    #[arg(long, value_delimiter = ',', default_value = "off")]
    pub kv_fetch: Vec<crate::core::kv_fetch::FetchMode>,
    /// The rate of the link between replicas, GB/s (`[kv_fetch] links.same_region`: simulated
    /// replicas share a region but no zone or host). Default: the node's, 12.5 (100 Gb/s).
    #[arg(long)]
    pub kv_fetch_gb_s: Option<f64>,
    /// The rate of the link between regions, GB/s (`[kv_fetch] links.cross_region`). Default:
    /// the node's, 0.625 (one 5 Gb/s flow).
    #[arg(long)]
    pub kv_fetch_region_gb_s: Option<f64>,
    /// What a node does with a prompt whose longest prefix another region holds, one run each
    /// (the node's `remote_prefix`): `local` (recompute), `forward` (or go there), `weigh` (or
    /// pull it too; replicas then take `vllm-envelope` hints).
    #[arg(long, value_delimiter = ',', default_value = "local")]
    pub remote_prefix: Vec<crate::core::remote_prefix::RemotePrefixMode>,
    /// Routing-text block size in bytes (the node's `block_bytes`).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(16..=65536))]
    pub block_bytes: u64,
    /// A prefill/decode fleet shape to simulate, SHAPE[@BYPASS] (repeatable: one run per shape
    /// and policy): `2P2D` (2 prefill then 2 decode replicas), `1P3D`, `4B` (4 ordinary
    /// replicas), or `prefill,decode,...`; BYPASS is `[pd] bypass_uncached_tokens` (default 256,
    /// 0 = off). Sets the replica count; the central reference is not run.
    #[arg(long = "pd")]
    pub pd: Vec<String>,
    /// KV bytes per prompt token moved from prefill to decode (P/D runs).
    #[arg(long, default_value_t = 131_072)]
    pub kv_bytes_per_token: u64,
    /// The prefill-to-decode link in Gb/s (P/D runs).
    #[arg(long, default_value_t = 100.0)]
    pub link_gbps: f64,
    /// Engine preset: `8b-h100` or `70b-tp4`.
    #[arg(long, default_value = "8b-h100")]
    pub preset: String,
    /// Hot-prefix replication and the burst window.
    #[command(flatten)]
    pub hot: HotArgs,
    /// Data-parallel ranks per replica (1..=64), each an engine of the preset with its own
    /// prefix cache.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub dp_ranks: u16,
    /// With --dp-ranks > 1: `header` (the router names the rank, as a home node with KV events
    /// does) or `off` (the replica's balancer picks: fewest in flight); several (`header,off`)
    /// run each policy once per value.
    #[arg(long, value_delimiter = ',', default_value = "header")]
    pub dp_rank_routing: Vec<String>,
    /// Directory for `sim-report.json`, `sim-report.md` and the charts (`sim-ttft-cdf.svg`,
    /// `sim-hit-ratio.svg`).
    #[arg(long, default_value = "kvmesh-out")]
    pub out: PathBuf,
}

/// Runs `kvmesh sim`: builds the runs the flags ask for, simulates each, prints the tables and
/// writes the reports.
pub fn main(mut args: SimArgs) -> anyhow::Result<()> {
    if args.byte_table {
        println!("{}", byte_table(&GossipByteModel::calibrated()));
        return Ok(());
    }
    if args.kv_fetch_region_table {
        let rtt_s = args.region_rtt_ms as f64 / 1000.0;
        println!("{}", super::sim_fetch_table::region_fetch_table(rtt_s));
        return Ok(());
    }
    if let Some(path) = args.trace.take() {
        args.workload.workload = WorkloadKind::Trace(Some(path));
    }
    let loaded = args.workload.load()?;
    let workload = loaded.requests;
    let (engine, kv_load, fetching) = engine_and_kv_load(&args)?;
    let policies = if args.policy.is_empty() {
        PolicyKind::ALL.to_vec()
    } else {
        args.policy.clone()
    };
    let base = base_config(&args, engine, kv_load)?;
    let named = rank_routings(&args)?;
    let runs = plan_runs(&args, &base, &policies, &named, fetching)?;
    let ideal = workload::ideal_hit_ratio(&workload);
    eprintln!(
        "kvmesh sim: {} ({} requests) on {} nodes x {} replicas in {} region(s) ({}), gossip {} ms \
         fan-out {}, speedup {}x, {} node failure(s)",
        args.workload.workload,
        workload.len(),
        base.nodes,
        base.replicas,
        base.regions,
        args.preset,
        args.gossip_ms,
        args.fanout,
        args.speedup,
        base.failures.len()
    );
    let (mut reports, names) = run_all(&workload, runs)?;
    let mut table = markdown(&reports, ideal);
    table.push('\n');
    table.push_str(&layout_markdown(&reports));
    table.push('\n');
    table.push_str(&bytes_markdown(&args, &reports));
    let labelled: Vec<(String, &SimReport)> = names.iter().cloned().zip(&reports).collect();
    table.push_str(&pd_markdown(&labelled));
    table.push_str(&extras_markdown(&base, &reports, &names));
    let n = base
        .max_requests
        .unwrap_or(workload.len())
        .min(workload.len());
    let floor = ttft_floor(&workload[..n], &base.engine);
    table.push_str(&format!(
        "TTFT floor no router can beat (each request alone on an idle replica holding every block \
         an earlier request computed): mean {:.3} s, p50 {:.3}, p90 {:.3}, p99 {:.3}\n",
        floor.mean, floor.p50, floor.p90, floor.p99
    ));
    println!("{table}");
    write_reports(&args.out, &mut reports, &table, ideal)?;
    eprintln!("reports written to {}", args.out.display());
    Ok(())
}

/// The engine of every simulated replica (the preset, its KV capacity and CPU tier), what the
/// replicas declare to the routers (`kv_load`), and whether any run pulls KV.
fn engine_and_kv_load(args: &SimArgs) -> anyhow::Result<(EngineConfig, Option<KvLoad>, bool)> {
    let preset = parse_preset(&args.preset)?;
    let mut engine = preset.config();
    if let Some(tokens) = args.tenants.kv_capacity_tokens {
        engine.kv_capacity_tokens = tokens;
    }
    args.tiers.apply_engine(&mut engine);
    let mut kv_load = args.tiers.kv_load(&engine);
    let fetching = args
        .kv_fetch
        .iter()
        .any(|m| *m != crate::core::kv_fetch::FetchMode::Off)
        || args
            .remote_prefix
            .contains(&crate::core::remote_prefix::RemotePrefixMode::Weigh);
    if fetching {
        kv_load = Some(KvLoad {
            hints: crate::core::kv_load::KvHintFormat::VllmEnvelope,
            ..kv_load.unwrap_or(KvLoad {
                bytes_per_token: engine.kv_bytes_per_token,
                ..Default::default()
            })
        });
    }
    Ok((engine, kv_load, fetching))
}

/// The configuration every run shares (its policy, shape and modes are set per run).
fn base_config(
    args: &SimArgs,
    engine: EngineConfig,
    kv_load: Option<KvLoad>,
) -> anyhow::Result<SimConfig> {
    Ok(SimConfig {
        nodes: args.nodes,
        replicas: args.replicas,
        regions: args.regions,
        region_rtt: Duration::from_millis(args.region_rtt_ms),
        seed: args.workload.seed,
        gossip_interval: Duration::from_millis(args.gossip_ms),
        scrape_interval: Duration::from_millis(args.scrape_ms.max(1)),
        replica_load_interval: Duration::from_millis(args.replica_load_ms),
        block_bytes: args.block_bytes as usize,
        load_share_delay: (args.load_share_ms > 0)
            .then(|| Duration::from_millis(args.load_share_ms)),
        gossip_fanout: args.fanout,
        region_interval: Duration::from_millis(args.region_interval_ms),
        failures: args.failures.clone(),
        failure_detection: Duration::from_millis(args.failure_detection_ms),
        engine,
        arrival_speedup: args.speedup,
        tenants: args.tenants.tenant_configs()?,
        split_tenant: args.tenants.split_tenant.clone(),
        dp_ranks: usize::from(args.dp_ranks),
        kv_load,
        exact_homes: args.exact_homes,
        priorities: args.tenants.priorities_config(),
        max_in_flight: args.tenants.max_in_flight,
        progress: true,
        cost: {
            let mut cost = CostModel::default();
            if let Some(ms) = args.affinity_credit_ms {
                cost.affinity_credit_s = ms as f64 / 1000.0;
            }
            if let Some(gb) = args.kv_fetch_gb_s {
                cost.fetch.links.same_region.gb_per_s = gb;
            }
            if let Some(gb) = args.kv_fetch_region_gb_s {
                cost.fetch.links.cross_region.gb_per_s = gb;
            }
            cost.fetch.validate()?;
            cost
        },
        window: args.hot.window_s,
        forward_by: args.forward_by,
        evict_charge: args
            .evict_charge
            .unwrap_or(crate::core::policy::DEFAULT_EVICT_CHARGE),
        entry_weights: args.entry_weights.clone(),
        ..Default::default()
    })
}

/// `--evict-charge`: a number in 0..=[`MAX_RECOMPUTE_CHARGE_PER_S`], the node key's bounds.
fn parse_evict_charge(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..=MAX_RECOMPUTE_CHARGE_PER_S).contains(&v) => Ok(v),
        _ => Err(format!(
            "expected a number in 0..={MAX_RECOMPUTE_CHARGE_PER_S}, got {s:?}"
        )),
    }
}

/// `--dp-rank-routing` as "the router names the rank" per run (`true` for `header`); one run
/// when replicas have a single rank.
fn rank_routings(args: &SimArgs) -> anyhow::Result<Vec<bool>> {
    let mut named = Vec::new();
    for how in &args.dp_rank_routing {
        match how.as_str() {
            "header" => named.push(true),
            "off" => named.push(false),
            other => anyhow::bail!("unknown --dp-rank-routing '{other}' (expected header or off)"),
        }
    }
    if args.dp_ranks <= 1 {
        named = vec![true];
    }
    Ok(named)
}

/// Every run the flags ask for, each with the label appended to its policy's name: P/D shape ×
/// policy × gossip layout × hot-prefix mode × KV fetch mode × rank routing, then the central
/// reference.
fn plan_runs(
    args: &SimArgs,
    base: &SimConfig,
    policies: &[PolicyKind],
    named: &[bool],
    fetching: bool,
) -> anyhow::Result<Vec<(SimConfig, String)>> {
    let shapes = pd_shapes(args)?;
    let mut runs: Vec<(SimConfig, String)> = Vec::new();
    for (pd, shape) in &shapes {
        let replicas = pd.as_ref().map_or(base.replicas, |x| x.roles.len());
        let shape = if shape.is_empty() {
            String::new()
        } else {
            format!(" {shape}")
        };
        let layouts = if args.gossip_layout.is_empty() {
            vec![GossipLayout::default()]
        } else {
            args.gossip_layout.clone()
        };
        for (p, layout) in policies
            .iter()
            .flat_map(|p| layouts.iter().map(move |l| (p, *l)))
        {
            let layout_label = if layouts.len() > 1 {
                format!(" {layout}")
            } else {
                String::new()
            };
            for (mode, fetch) in args
                .hot
                .modes()
                .into_iter()
                .flat_map(|m| args.kv_fetch.iter().map(move |f| (m.clone(), *f)))
            {
                for (n, remote) in named
                    .iter()
                    .flat_map(|n| args.remote_prefix.iter().map(move |r| (n, *r)))
                {
                    let hot = if mode.is_some() { " +hot" } else { "" };
                    let rank = match (base.dp_ranks > 1, *n) {
                        (false, _) => "",
                        (true, true) => " rank=header",
                        (true, false) => " rank=off",
                    };
                    let fetch_label = if fetching {
                        format!(" fetch={}", fetch.as_str())
                    } else {
                        String::new()
                    };
                    let remote_label = if args.remote_prefix.len() > 1
                        || remote != crate::core::remote_prefix::RemotePrefixMode::Local
                    {
                        format!(" remote={}", remote.as_str())
                    } else {
                        String::new()
                    };
                    let mut cost = base.cost;
                    cost.fetch.mode = fetch;
                    runs.push((
                        SimConfig {
                            policy: *p,
                            replicas,
                            pd: pd.clone(),
                            hot_prefix: mode.clone().unwrap_or_else(|| base.hot_prefix.clone()),
                            dp_rank_named: *n,
                            gossip_layout: layout,
                            cost,
                            remote_prefix: remote,
                            ..base.clone()
                        },
                        format!("{layout_label}{shape}{hot}{rank}{fetch_label}{remote_label}"),
                    ));
                }
            }
        }
    }
    if args.central && args.pd.is_empty() {
        runs.push((
            SimConfig {
                oracle: true,
                ..base.clone()
            },
            String::new(),
        ));
    }
    Ok(runs)
}

/// Simulates each run in turn (its time on stderr); the reports and their labelled names.
fn run_all(
    workload: &[WorkloadRequest],
    runs: Vec<(SimConfig, String)>,
) -> anyhow::Result<(Vec<SimReport>, Vec<String>)> {
    let mut reports = Vec::new();
    let mut names = Vec::new();
    for (cfg, label) in runs {
        let started = Instant::now();
        let mut report =
            run(workload, &cfg).with_context(|| format!("simulating {}", cfg.policy))?;
        if cfg.dp_ranks > 1 {
            report.policy = format!("{} dp={}", report.policy, cfg.dp_ranks);
        }
        report.policy.push_str(&label);
        eprintln!(
            "  {:<17} done in {:.1} s",
            report.policy,
            started.elapsed().as_secs_f64()
        );
        names.push(report.policy.clone());
        reports.push(report);
    }
    Ok((reports, names))
}

/// The gossip byte model's table for the first routed run's mesh shape (empty when only the
/// central reference ran).
fn bytes_markdown(args: &SimArgs, reports: &[SimReport]) -> String {
    let Some(r) = reports.iter().find(|r| r.policy != CENTRAL_GREEDY) else {
        return String::new();
    };
    let shape = MeshShape {
        layout: r.gossip_layout.parse().unwrap_or_default(),
        nodes: r.nodes,
        regions: r.regions,
        replicas: r.replicas,
        request_rate: r.arrival_rate,
        interval_s: Duration::from_millis(args.gossip_ms).as_secs_f64(),
        fanout: args.fanout,
    };
    let this_run = (args.gossip_layout.len() <= 1).then_some(shape.layout);
    let mut s = mesh_bytes_markdown(&GossipByteModel::calibrated(), &shape, this_run);
    s.push('\n');
    s
}

/// The tables and lines only some runs have: a tenant reported apart, the burst window and
/// warm-ups, KV pulls, CPU-tier hits, priority classes.
fn extras_markdown(base: &SimConfig, reports: &[SimReport], names: &[String]) -> String {
    let mut table = String::new();
    let splits: Vec<_> = reports
        .iter()
        .filter_map(|r| Some((r.policy.as_str(), r.tenant_split.as_ref()?)))
        .collect();
    if !splits.is_empty() {
        table.push('\n');
        table.push_str(&split_markdown(splits));
        let steered: Vec<String> = reports
            .iter()
            .map(|r| {
                format!(
                    "{} {} (overflowed {})",
                    r.policy, r.kv_steered, r.kv_overflowed
                )
            })
            .collect();
        table.push_str(&format!(
            "\nRequests a KV quota steered: {}\n",
            steered.join(", ")
        ));
    }
    if let Some(hot) = hot_table(reports, base.window) {
        table.push('\n');
        table.push_str(&hot);
    }
    if reports.iter().any(|r| r.kv_fetch.planned > 0) {
        table.push_str(&pulls_line(reports, names));
    }
    if reports.iter().any(|r| r.cpu_hit_tokens > 0) {
        let cpu: Vec<String> = reports
            .iter()
            .map(|r| {
                let share = r.cpu_hit_tokens as f64 / r.prompt_tokens.max(1) as f64;
                format!("{} {share:.3}", r.policy)
            })
            .collect();
        table.push_str(&format!(
            "\nPrompt tokens loaded from CPU tiers (part of the hit ratio): {}\n",
            cpu.join(", ")
        ));
    }
    if reports.iter().any(|r| r.classes.len() > 1 || r.refused > 0) {
        table.push('\n');
        let label = if base.priorities.is_some() {
            "priorities"
        } else {
            "no priorities"
        };
        let runs: Vec<(String, &[ClassStats])> = reports
            .iter()
            .map(|r| (format!("{} ({label})", r.policy), r.classes.as_slice()))
            .collect();
        table.push_str(&class_markdown(runs.iter().map(|(l, c)| (l.as_str(), *c))));
    }
    table
}

/// One line of every run's planned KV pulls, misses, tokens moved and mean transfer time.
fn pulls_line(reports: &[SimReport], names: &[String]) -> String {
    let lines: Vec<String> = reports
        .iter()
        .zip(names)
        .map(|(r, name)| {
            let f = r.kv_fetch;
            format!(
                "{name}: {} planned, {} missed, {:.3} of prompt tokens moved, mean transfer {:.1} ms",
                f.planned,
                f.missed,
                f.tokens as f64 / r.prompt_tokens.max(1) as f64,
                1000.0 * f.seconds / (f.planned - f.missed).max(1) as f64
            )
        })
        .collect();
    format!("\nKV pulls: {}\n", lines.join("; "))
}

/// Writes `sim-report.json`, `sim-report.md` and the two charts into `out` (the TTFT samples
/// move out of the reports into the CDF).
fn write_reports(
    out: &Path,
    reports: &mut [SimReport],
    table: &str,
    ideal: f64,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let json = serde_json::to_string_pretty(&reports)?;
    std::fs::write(out.join("sim-report.json"), json).context("writing sim-report.json")?;
    std::fs::write(out.join("sim-report.md"), table).context("writing sim-report.md")?;
    let cdf: Vec<(String, Vec<f64>)> = reports
        .iter_mut()
        .map(|r| (r.policy.clone(), std::mem::take(&mut r.ttft_samples)))
        .collect();
    report::cdf_chart(&out.join("sim-ttft-cdf.svg"), &cdf)?;
    let bars: Vec<(String, f64)> = reports
        .iter()
        .map(|r| (r.policy.clone(), r.hit_token_ratio))
        .collect();
    let ideal = report::HitReference {
        label: "ideal (one infinite cache)".into(),
        ratio: ideal,
    };
    report::ratio_bars_chart(&out.join("sim-hit-ratio.svg"), &bars, &[ideal])?;
    Ok(())
}

/// The P/D runs `--pd` asks for, each with its label; one plain run when none.
fn pd_shapes(args: &SimArgs) -> anyhow::Result<Vec<(Option<SimPd>, String)>> {
    if args.pd.is_empty() {
        return Ok(vec![(None, String::new())]);
    }
    args.pd
        .iter()
        .map(|spec| {
            let (roles, bypass) =
                sim_pd::parse_spec(spec).map_err(|e| anyhow::anyhow!("--pd {e}"))?;
            let shape = spec.split_once('@').map_or(spec.as_str(), |(s, _)| s);
            let pd = SimPd {
                roles,
                bypass_uncached_tokens: bypass,
                kv_bytes_per_token: args.kv_bytes_per_token,
                link_gbps: args.link_gbps,
            };
            Ok((Some(pd), format!("{shape}@{bypass}")))
        })
        .collect()
}

/// The engine preset named on the command line (`8b-h100` or `70b-tp4`).
pub fn parse_preset(name: &str) -> anyhow::Result<Preset> {
    match name {
        "8b-h100" => Ok(Preset::Llama8bH100),
        "70b-tp4" => Ok(Preset::Llama70bTp4),
        other => anyhow::bail!("unknown preset '{other}' (expected 8b-h100 or 70b-tp4)"),
    }
}

/// The window's TTFT and the warm-ups' prefill, when a window was asked for or any run warmed.
fn hot_table(reports: &[SimReport], window: Option<(f64, f64)>) -> Option<String> {
    if window.is_none() && reports.iter().all(|r| r.warmups == 0) {
        return None;
    }
    let rows: Vec<HotRow<'_>> = reports
        .iter()
        .map(|r| HotRow {
            label: &r.policy,
            window: r.window_ttft,
            run_p99: r.ttft.p99,
            warmups: r.warmups,
            warmup_tokens: r.warmup_prefill_tokens,
            share: r.warmup_prefill_share,
        })
        .collect();
    Some(hot_markdown(&rows, window))
}

/// One Markdown table of the runs.
pub fn markdown(reports: &[SimReport], ideal_token_ratio: f64) -> String {
    let mut s = String::from(
        "| policy | requests | errors | TTFT mean (s) | p50 | p90 | p99 | latency mean (s) | hit tokens | hit ratio | load max/mean |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in reports {
        s.push_str(&format!(
            "| {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} | {} | {:.3} | {:.2} |\n",
            r.policy,
            r.requests,
            r.errors,
            r.ttft.mean,
            r.ttft.p50,
            r.ttft.p90,
            r.ttft.p99,
            r.latency.mean,
            r.cached_tokens,
            r.hit_token_ratio,
            r.load_max_over_mean
        ));
    }
    s.push_str(
        "\n| policy | regions | cross-region | forwarded | lost (node failures) | re-homed replicas | gossip hops p50 / max | virtual s |\n|---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in reports {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} / {} | {:.1} |\n",
            r.policy,
            r.regions,
            r.cross_region,
            r.forwarded,
            r.lost,
            r.rehomed,
            r.gossip_hops_p50,
            r.gossip_hops_max,
            r.virtual_seconds
        ));
    }
    s.push_str(&format!("\nIdeal prefix-hit ratio of the workload (one infinite cache, tokens): {ideal_token_ratio:.3}\n"));
    s
}

/// Per run: its gossip layout, how much older its news of other regions is, the modelled
/// gossip bytes per node, and its hit ratio against the central greedy reference's.
pub fn layout_markdown(reports: &[SimReport]) -> String {
    let central = reports
        .iter()
        .find(|r| r.policy == CENTRAL_GREEDY)
        .map(|r| r.hit_token_ratio);
    let mut s = String::from(
        "| run | gossip layout | other regions' news, extra lag (s) | mesh KiB/s per node, idle | at the run's rate (mean) | representative | hit ratio | ÷ central's |\n|---|---|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in reports.iter().filter(|r| r.policy != CENTRAL_GREEDY) {
        let vs = match central {
            Some(c) if c > 0.0 => format!("{:.3}", r.hit_token_ratio / c),
            _ => "—".into(),
        };
        s.push_str(&format!(
            "| {} | {} | {:.2} | {:.1} | {:.1} | {:.1} | {:.3} | {vs} |\n",
            r.policy,
            r.gossip_layout,
            r.remote_extra_lag_s,
            r.mesh_bytes_idle.mean_kib(),
            r.mesh_bytes.mean_kib(),
            r.mesh_bytes.representative_kib(),
            r.hit_token_ratio,
        ));
    }
    s
}

/// The TTFT / ITL / P/D table of the runs (printed under the main one).
pub fn pd_markdown(reports: &[(String, &SimReport)]) -> String {
    let mut s = String::from(
        "| run | TTFT mean (s) | p50 | p99 | ITL mean (ms) | p50 | p99 | hit ratio | pairs | bypassed | transfer p50 (ms) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (name, r) in reports {
        let pd = r.pd.clone().unwrap_or_default();
        s.push_str(&format!(
            "| {} | {:.3} | {:.3} | {:.3} | {:.1} | {:.1} | {:.1} | {:.3} | {} | {} | {:.1} |\n",
            name,
            r.ttft.mean,
            r.ttft.p50,
            r.ttft.p99,
            r.itl.mean * 1000.0,
            r.itl.p50 * 1000.0,
            r.itl.p99 * 1000.0,
            r.hit_token_ratio,
            pd.pairs,
            pd.bypassed,
            pd.transfer.p50 * 1000.0
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--evict-charge` takes what the node's `evict_charge` key takes.
    #[test]
    fn an_evict_charge_outside_the_nodes_bounds_is_refused() {
        assert_eq!(parse_evict_charge("64"), Ok(64.0));
        assert_eq!(parse_evict_charge("0"), Ok(0.0));
        for bad in ["-1", "1001", "NaN", "lots"] {
            assert!(parse_evict_charge(bad).is_err(), "{bad}");
        }
    }
}
