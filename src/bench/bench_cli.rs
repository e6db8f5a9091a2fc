//! `kvmesh bench` on the command line: build a workload, replay it against URLs (one run), each
//! of `--compare` URL sets (one run each), or an in-process fleet per policy
//! (`--compare-policies`), print one table and write the reports and charts.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;

use super::fleet::{run_fleet_comparison, FleetConfig};
use super::fleet_pd::FleetPd;
use super::hot_args::{bench_row, hot_markdown, HotArgs};
use super::replay::{self, ReplayConfig, RunResult};
use super::replay_api::Api;
use super::report;
use super::sim_classes::{class_markdown, ClassStats};
use super::tenant_args::{class_records, split_markdown, split_records, TenantArgs};
use super::tier_args::TierArgs;
use super::workload::{WorkloadArgs, WorkloadRequest};
use crate::core::policy::PolicyKind;
use crate::node::config::PdProtocol;
use crate::replicas::kv_events::RankRouting;

/// Arguments of `kvmesh bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// The workload (trace or synthetic family) and its rate, size and seed.
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// Fleet runs: tenant KV quotas and the replicas' KV cache size; any run: a tenant
    /// reported apart.
    #[command(flatten)]
    pub tenants: TenantArgs,
    /// Fleet runs: a CPU tier on the replicas (KV events then on, nodes following them), its
    /// link, and load-time weighting in the nodes.
    #[command(flatten)]
    pub tiers: TierArgs,
    /// Base URL(s) to replay against, comma-separated; requests are spread over them uniformly
    /// at random (as a mesh's clients do). Example: http://127.0.0.1:8080
    #[arg(long, value_delimiter = ',')]
    pub url: Vec<String>,
    /// Several runs in one invocation, one per URL (use `a+b` to spread one run over two URLs).
    #[arg(long, value_delimiter = ',')]
    pub compare: Vec<String>,
    /// Start an in-process fleet (simulated replicas + kvmesh nodes) per policy and compare
    /// them, e.g. `p2c-cache,round-robin`.
    #[arg(long, value_delimiter = ',')]
    pub compare_policies: Vec<PolicyKind>,
    /// Fleet: simulated replicas per run.
    #[arg(long, default_value_t = 4)]
    pub replicas: usize,
    /// Fleet: kvmesh nodes per run, meshed when more than one (one region, each configured
    /// with every replica).
    #[arg(long, default_value_t = 1)]
    pub nodes: usize,
    /// Fleet: replicas run this many times faster than real time; arrivals are sped up to match
    /// and reported times are model seconds.
    #[arg(long, default_value_t = 10.0)]
    pub time_scale: f64,
    /// Fleet: data-parallel ranks per replica (each rank one engine of the preset); above 1,
    /// replicas publish KV events per rank and nodes follow them in token mode.
    #[arg(long, default_value_t = 1)]
    pub dp_ranks: u16,
    /// Fleet with --dp-ranks > 1: how nodes name the rank, `header`, `body` or `off` (the
    /// replica's own balancer picks); several (`header,off`) run one fleet each per policy.
    #[arg(long, value_delimiter = ',', default_value = "header")]
    pub dp_rank_routing: Vec<String>,
    /// Fleet: a prefill/decode shape, SHAPE[@BYPASS] as `kvmesh sim --pd` reads it (`2P2D@0`,
    /// `4B`, `1P3D@256`); repeatable, one fleet per shape and policy. Sets the replica count.
    #[arg(long = "pd")]
    pub pd: Vec<String>,
    /// Fleet with --pd: the hand-over protocol the nodes and replicas speak, `vllm-nixl`,
    /// `vllm-mooncake` or `sglang`.
    #[arg(long, default_value = "vllm-nixl")]
    pub pd_protocol: String,
    /// Fleet with --pd: KV bytes per prompt token moved from prefill to decode.
    #[arg(long, default_value_t = 131_072)]
    pub kv_bytes_per_token: u64,
    /// Fleet with --pd: the prefill-to-decode link in Gb/s; with --kv-fetch, the link KV pulls
    /// between replicas cross (the replicas spend it, the nodes price it).
    #[arg(long, default_value_t = 100.0)]
    pub link_gbps: f64,
    /// Fleet: engine preset, `8b-h100` or `70b-tp4`.
    #[arg(long, default_value = "8b-h100")]
    pub preset: String,
    /// Divide the workload's arrival times by this.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// `--url`/`--compare` runs: multiply measured times by this in reports (set it to the
    /// replicas' `--time-scale` to read model seconds from simulated replicas).
    #[arg(long, default_value_t = 1.0)]
    pub report_scale: f64,
    /// Most requests in flight at once.
    #[arg(long, default_value_t = 512)]
    pub concurrency: usize,
    /// The API requests go through, each prompt as one user message: `completions`
    /// (/v1/completions), `chat` (/v1/chat/completions), `messages` (Anthropic, /v1/messages) or
    /// `responses` (OpenAI, /v1/responses). Runs are labelled with it unless it is completions.
    #[arg(long, value_enum, default_value_t = Api::Completions)]
    pub api: Api,
    /// Model name. Default: the first model the (first) target lists in /v1/models.
    #[arg(long)]
    pub model: Option<String>,
    /// Prometheus endpoints (replicas) to read prefix-cache counter deltas from, for engines
    /// that do not report cached tokens per response. Comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub metrics_url: Vec<String>,
    /// Bound on one request, seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_s: u64,
    /// No progress line.
    #[arg(long)]
    pub quiet: bool,
    /// Fleet runs: hot-prefix replication (`--hot-prefix both` runs each policy without and
    /// with; run such a fleet at `--time-scale 1`, as `[hot_prefix]` counts wall-clock time);
    /// any run: `--window-s` reports the TTFT of a window of workload time apart.
    #[command(flatten)]
    pub hot: HotArgs,
    /// Fleet runs: KV fetch modes to compare, one fleet each (the nodes' `[kv_fetch] mode`):
    /// `off`, `priced`, `reactive`. Any mode but `off` makes every replica take
    /// `vllm-envelope` hints (the simulated replicas pull from each other over HTTP).
    #[arg(long, value_delimiter = ',', default_value = "off")]
    pub kv_fetch: Vec<crate::core::kv_fetch::FetchMode>,
    /// Directory for bench-report.json, bench-report.md and the SVG charts.
    #[arg(long, default_value = "kvmesh-out")]
    pub out: PathBuf,
}

/// `header`, `body` or `off`.
fn parse_rank_routing(s: &str) -> anyhow::Result<RankRouting> {
    match s.trim() {
        "header" => Ok(RankRouting::Header),
        "body" => Ok(RankRouting::Body),
        "off" => Ok(RankRouting::Off),
        other => anyhow::bail!("--dp-rank-routing: '{other}' is not header, body or off"),
    }
}

/// The fleets `--pd` asks for (`None`: an ordinary fleet).
fn pd_fleets(args: &BenchArgs) -> anyhow::Result<Vec<Option<FleetPd>>> {
    if args.pd.is_empty() {
        return Ok(vec![None]);
    }
    let protocol = PdProtocol::parse(&args.pd_protocol).with_context(|| {
        format!(
            "--pd-protocol {}: expected vllm-nixl, vllm-mooncake or sglang",
            args.pd_protocol
        )
    })?;
    args.pd
        .iter()
        .map(|spec| {
            let (roles, bypass) =
                super::sim_pd::parse_spec(spec).map_err(|e| anyhow::anyhow!("--pd {e}"))?;
            Ok(Some(FleetPd {
                roles,
                bypass_uncached_tokens: bypass,
                protocol,
                kv_bytes_per_token: args.kv_bytes_per_token,
                link_gbps: args.link_gbps,
            }))
        })
        .collect()
}

/// Names a non-default API in every run's label (tables, charts, report files), so runs through
/// different APIs compared side by side stay apart.
fn label_api(mut runs: Vec<RunResult>, api: Api) -> Vec<RunResult> {
    if api != Api::default() {
        for r in &mut runs {
            r.label = format!("{} api={api}", r.label);
        }
    }
    runs
}

/// Runs `kvmesh bench`: checks the flags, replays the workload (against URLs, or one in-process
/// fleet per policy), prints the tables and writes the reports.
pub async fn main(args: BenchArgs) -> anyhow::Result<()> {
    let workload = args.workload.load()?;
    anyhow::ensure!(!workload.requests.is_empty(), "the workload is empty");
    let base = ReplayConfig {
        model: args.model.clone(),
        speedup: args.speedup,
        concurrency: args.concurrency,
        seed: args.workload.seed,
        metrics_urls: args.metrics_url.clone(),
        request_timeout: Duration::from_secs(args.timeout_s),
        progress: !args.quiet,
        time_scale: args.report_scale,
        api: args.api,
        ..ReplayConfig::default()
    };
    anyhow::ensure!(
        args.report_scale.is_finite() && args.report_scale > 0.0,
        "--report-scale must be > 0"
    );
    eprintln!(
        "kvmesh bench: {} ({} requests, ideal hit ratio {:.3}) through {}",
        args.workload.workload,
        workload.requests.len(),
        super::workload::ideal_hit_ratio(&workload.requests),
        args.api.path()
    );
    check_modes(&args)?;
    let runs: Vec<RunResult> = if !args.compare_policies.is_empty() {
        fleet_runs(&args, &workload.requests, &base).await?
    } else {
        url_runs(&args, &workload.requests, &base).await?
    };
    let runs = label_api(runs, args.api);
    print_tables(&args, &runs, &workload.requests)?;
    let ideal = report::HitReference {
        label: "ideal (one infinite cache)".into(),
        ratio: crate::bench::workload::ideal_hit_ratio(&workload.requests),
    };
    let files = report::write_all(&args.out, &runs, &[ideal])?;
    eprintln!(
        "wrote {}",
        files
            .iter()
            .map(|f| f.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

/// Exactly one of `--url`, `--compare` and `--compare-policies`; the fleet-only flags only with
/// a fleet.
fn check_modes(args: &BenchArgs) -> anyhow::Result<()> {
    let modes = [
        !args.url.is_empty(),
        !args.compare.is_empty(),
        !args.compare_policies.is_empty(),
    ];
    anyhow::ensure!(
        modes.iter().filter(|m| **m).count() == 1,
        "give exactly one of --url, --compare or --compare-policies"
    );
    anyhow::ensure!(
        !args.compare_policies.is_empty()
            || (args.tenants.kv_shares.is_empty()
                && args.tenants.kv_capacity_tokens.is_none()
                && !args.tenants.priorities
                && args.tenants.weight.is_empty()
                && args.tenants.max_in_flight.is_none()),
        "--tenant-kv-share, --kv-capacity-tokens, --priorities, --tenant-weight and \
         --max-in-flight configure an in-process fleet (--compare-policies); for --url targets \
         set them in the nodes' and replicas' configs"
    );
    Ok(())
}

/// `--compare-policies`: one in-process fleet per policy, for each P/D shape × rank routing ×
/// hot-prefix mode.
async fn fleet_runs(
    args: &BenchArgs,
    requests: &[WorkloadRequest],
    base: &ReplayConfig,
) -> anyhow::Result<Vec<RunResult>> {
    let mut engine = super::sim_cli::parse_preset(&args.preset)?.config();
    engine.time_scale = args.time_scale;
    if let Some(tokens) = args.tenants.kv_capacity_tokens {
        engine.kv_capacity_tokens = tokens;
    }
    args.tiers.apply_engine(&mut engine);
    let kv_load = args.tiers.kv_load(&engine);
    let mut tenants = args.tenants.tenant_configs()?;
    if !args.tenants.priorities {
        // Without `[priorities]` a node refuses tenants naming classes; the classes then
        // only label the requests in the per-class table.
        for t in tenants.values_mut() {
            t.priority = None;
            t.max_priority = None;
        }
    }
    anyhow::ensure!(
        (1..=crate::replica::MAX_DP_RANKS).contains(&args.dp_ranks),
        "--dp-ranks must be within 1..={}",
        crate::replica::MAX_DP_RANKS
    );
    let routings = if args.dp_ranks > 1 {
        args.dp_rank_routing
            .iter()
            .map(|s| parse_rank_routing(s))
            .collect::<anyhow::Result<Vec<_>>>()?
    } else {
        vec![RankRouting::Off]
    };
    let pds = pd_fleets(args)?;
    let mut runs = Vec::new();
    let hot_modes = args.hot.modes();
    let hot_modes = &hot_modes;
    let fetch_modes = &args.kv_fetch;
    for ((pd, rank_routing, hot), fetch) in pds
        .iter()
        .flat_map(|pd| {
            routings
                .iter()
                .flat_map(move |r| hot_modes.iter().map(move |h| (pd.clone(), *r, h.clone())))
        })
        .flat_map(|run| fetch_modes.iter().map(move |f| (run.clone(), *f)))
    {
        let fleet = FleetConfig {
            kv_fetch: crate::core::kv_fetch::KvFetchConfig {
                mode: fetch,
                ..Default::default()
            },
            pd,
            hot_prefix: hot.unwrap_or_default(),
            replicas: args.replicas,
            nodes: args.nodes,
            time_scale: args.time_scale,
            engine: engine.clone(),
            tenants: tenants.clone(),
            priorities: args.tenants.priorities_config(),
            max_in_flight: args.tenants.max_in_flight,
            dp_ranks: args.dp_ranks,
            rank_routing,
            kv_events: engine.cpu_capacity_tokens > 0,
            kv_load,
            fetch_link_gbps: args.link_gbps,
            ..FleetConfig::default()
        };
        runs.extend(run_fleet_comparison(requests, &args.compare_policies, &fleet, base).await?);
    }
    Ok(runs)
}

/// `--url` (one run) or `--compare` (one run per URL set, `a+b` spreading one run over two).
async fn url_runs(
    args: &BenchArgs,
    requests: &[WorkloadRequest],
    base: &ReplayConfig,
) -> anyhow::Result<Vec<RunResult>> {
    let sets: Vec<Vec<String>> = if args.url.is_empty() {
        args.compare
            .iter()
            .map(|c| c.split('+').map(str::to_owned).collect())
            .collect()
    } else {
        vec![args.url.clone()]
    };
    let mut runs = Vec::with_capacity(sets.len());
    for targets in sets {
        let cfg = ReplayConfig {
            label: targets.join("+"),
            targets,
            ..base.clone()
        };
        let run = replay::replay(requests, &cfg)
            .await
            .with_context(|| format!("replaying against {}", cfg.label))?;
        runs.push(run);
    }
    Ok(runs)
}

/// Prints the runs' table, then the burst window / warm-up table, the split tenant's and the
/// priority classes' where asked for.
fn print_tables(
    args: &BenchArgs,
    runs: &[RunResult],
    requests: &[WorkloadRequest],
) -> anyhow::Result<()> {
    let reports: Vec<_> = runs.iter().map(report::summarize).collect();
    println!("{}", report::markdown(&reports));
    let window = args.hot.window_s;
    if window.is_some() || runs.iter().any(|r| r.warmups > 0) {
        let rows: Vec<_> = runs
            .iter()
            .zip(&reports)
            .map(|(run, rep)| bench_row(run, requests, window, rep.ttft.p99))
            .collect();
        println!("{}", hot_markdown(&rows, window));
    }
    if let Some(tenant) = &args.tenants.split_tenant {
        let splits: Vec<_> = runs
            .iter()
            .map(|r| {
                let split = split_records(&r.records, requests, tenant, r.time_scale);
                (r.label.clone(), split)
            })
            .collect();
        println!(
            "{}",
            split_markdown(splits.iter().map(|(l, s)| (l.as_str(), s)))
        );
    }
    if !args.tenants.priority.is_empty() {
        let tenants = crate::core::tenants::Tenants::new(
            args.tenants.tenant_configs()?,
            crate::core::tenants::TenantConfig::default(),
        );
        let label = if args.tenants.priorities {
            "priorities"
        } else {
            "no priorities"
        };
        let rows: Vec<(String, Vec<ClassStats>)> = runs
            .iter()
            .map(|r| {
                let classes = class_records(&r.records, requests, &tenants, r.time_scale);
                (format!("{} ({label})", r.label), classes)
            })
            .collect();
        println!(
            "{}",
            class_markdown(rows.iter().map(|(l, c)| (l.as_str(), c.as_slice())))
        );
    }
    Ok(())
}
