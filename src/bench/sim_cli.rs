//! `kvmesh sim` on the command line: run several policies (and the oracle) on one workload and
//! print one table; write the reports as JSON and Markdown.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;

use super::sim::{run, SimConfig, SimReport};
use super::trace;
use crate::core::policy::PolicyKind;
use crate::engine_sim::Preset;

/// Arguments of `kvmesh sim`.
#[derive(Debug, Args)]
pub struct SimArgs {
    /// Mooncake-format JSONL trace. Default: the conversation trace shipped in `data/traces/`.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Policies to compare (comma-separated). Default: every policy.
    #[arg(long, value_delimiter = ',')]
    pub policy: Vec<PolicyKind>,
    /// Also run the oracle baseline (central router, exact instant view).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub oracle: bool,
    /// Router nodes.
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// Engine replicas.
    #[arg(long, default_value_t = 8)]
    pub replicas: usize,
    /// Gossip interval in milliseconds.
    #[arg(long, default_value_t = 100)]
    pub gossip_ms: u64,
    /// Divide the trace's arrival times by this (2 = twice the rate).
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Replay only the first N requests.
    #[arg(long)]
    pub requests: Option<usize>,
    /// Engine preset: `8b-h100` or `70b-tp4`.
    #[arg(long, default_value = "8b-h100")]
    pub preset: String,
    /// Seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Directory for `sim-report.json` and `sim-report.md`.
    #[arg(long, default_value = "kvmesh-out")]
    pub out: PathBuf,
}

/// Default trace, found relative to the crate (source checkout) or the working directory.
pub fn default_trace() -> PathBuf {
    let shipped =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/traces/conversation_trace.jsonl");
    if shipped.exists() {
        shipped
    } else {
        PathBuf::from("data/traces/conversation_trace.jsonl")
    }
}

/// Runs `kvmesh sim`.
pub fn main(args: SimArgs) -> anyhow::Result<()> {
    let path = args.trace.clone().unwrap_or_else(default_trace);
    let workload = trace::load(&path)?;
    let preset = match args.preset.as_str() {
        "8b-h100" => Preset::Llama8bH100,
        "70b-tp4" => Preset::Llama70bTp4,
        other => anyhow::bail!("unknown preset '{other}' (expected 8b-h100 or 70b-tp4)"),
    };
    let policies = if args.policy.is_empty() {
        PolicyKind::ALL.to_vec()
    } else {
        args.policy.clone()
    };
    let base = SimConfig {
        nodes: args.nodes,
        replicas: args.replicas,
        seed: args.seed,
        gossip_interval: Duration::from_millis(args.gossip_ms),
        engine: preset.config(),
        arrival_speedup: args.speedup,
        max_requests: args.requests,
        ..Default::default()
    };
    let mut runs: Vec<(SimConfig, &str)> = policies
        .iter()
        .map(|p| {
            (
                SimConfig {
                    policy: *p,
                    ..base.clone()
                },
                "",
            )
        })
        .collect();
    if args.oracle {
        runs.push((
            SimConfig {
                oracle: true,
                ..base.clone()
            },
            "",
        ));
    }
    let ideal = trace::ideal_hit_ratio(
        &workload[..args.requests.unwrap_or(workload.len()).min(workload.len())],
    );
    eprintln!(
        "kvmesh sim: {} on {} nodes x {} replicas ({}), gossip {} ms, speedup {}x",
        path.display(),
        base.nodes,
        base.replicas,
        args.preset,
        args.gossip_ms,
        args.speedup
    );
    let mut reports = Vec::new();
    for (cfg, _) in runs {
        let started = Instant::now();
        let report = run(&workload, &cfg).with_context(|| format!("simulating {}", cfg.policy))?;
        eprintln!(
            "  {:<17} done in {:.1} s",
            report.policy,
            started.elapsed().as_secs_f64()
        );
        reports.push(report);
    }
    let table = markdown(&reports, ideal);
    println!("{table}");
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let json = serde_json::to_string_pretty(&reports)?;
    std::fs::write(args.out.join("sim-report.json"), json).context("writing sim-report.json")?;
    std::fs::write(args.out.join("sim-report.md"), &table).context("writing sim-report.md")?;
    eprintln!("reports written to {}", args.out.display());
    Ok(())
}

/// One Markdown table of the runs.
pub fn markdown(reports: &[SimReport], ideal_block_ratio: f64) -> String {
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
    s.push_str(&format!("\nIdeal prefix-hit ratio of the workload (one infinite cache, blocks): {ideal_block_ratio:.3}\n"));
    s
}
