//! The hot-prefix flags shared by `kvmesh sim` and `kvmesh bench` (`--hot-prefix`,
//! `--hot-budget-share`, `--window-s`), and the table they add to both reports: TTFT in a
//! window of workload time (the first seconds of a burst) and the prefill warm-ups spent.

use clap::Args;

use super::replay::RunResult;
use super::stats::Distribution;
use super::workload::WorkloadRequest;
use crate::core::hot_prefix::HotPrefixConfig;

/// Hot-prefix replication and the burst window.
#[derive(Clone, Debug, Args)]
pub struct HotArgs {
    /// Hot-prefix replication (`core::hot_prefix`, the node's `[hot_prefix]` defaults): `off`,
    /// `on`, or `both` (each policy run without and with it; the latter labelled `+hot`).
    #[arg(long, default_value = "off", value_parser = ["off", "on", "both"])]
    pub hot_prefix: String,
    /// Share of the prefill a node routes that its warm-ups may spend (`hot_prefix.budget_share`).
    #[arg(long, default_value_t = HotPrefixConfig::default().budget_share)]
    pub hot_budget_share: f64,
    /// Report the TTFT of the requests arriving in this window of workload time apart,
    /// `START:LEN` in seconds, e.g. `20:10` for the first 10 s of the burst family's burst.
    #[arg(long, value_parser = parse_window)]
    pub window_s: Option<(f64, f64)>,
}

impl HotArgs {
    /// The settings of each run asked for, in order: without replication (`None`) and/or with.
    pub fn modes(&self) -> Vec<Option<HotPrefixConfig>> {
        let on = HotPrefixConfig {
            enabled: true,
            budget_share: self.hot_budget_share,
            ..HotPrefixConfig::default()
        };
        match self.hot_prefix.as_str() {
            "on" => vec![Some(on)],
            "both" => vec![None, Some(on)],
            _ => vec![None],
        }
    }
}

/// `START:LEN` seconds.
pub fn parse_window(s: &str) -> Result<(f64, f64), String> {
    let (a, b) = s
        .split_once(':')
        .ok_or_else(|| format!("'{s}': expected START:LEN in seconds, e.g. 20:10"))?;
    let num = |x: &str| {
        x.trim()
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v >= 0.0)
            .ok_or_else(|| format!("'{s}': '{x}' is not a number of seconds ≥ 0"))
    };
    Ok((num(a)?, num(b)?))
}

/// One row of the hot-prefix table.
pub struct HotRow<'a> {
    /// The run's label.
    pub label: &'a str,
    /// TTFT of the requests arriving in the window, if one was asked for.
    pub window: Option<Distribution>,
    /// TTFT p99 of the whole run, seconds.
    pub run_p99: f64,
    /// Warm-ups sent.
    pub warmups: u64,
    /// Their prefill tokens.
    pub warmup_tokens: u64,
    /// Warm-up prefill ÷ all prefill.
    pub share: f64,
}

/// The Markdown table of `rows`.
pub fn hot_markdown(rows: &[HotRow<'_>], window: Option<(f64, f64)>) -> String {
    let head = match window {
        Some((a, l)) => format!("TTFT {a}–{} s p50 | p99", a + l),
        None => "window p50 | p99".into(),
    };
    let mut s = format!(
        "| run | {head} | run p99 (s) | warm-ups | warm-up prefill tokens | share of all prefill |\n|---|---:|---:|---:|---:|---:|---:|\n"
    );
    for r in rows {
        let (p50, p99) = r.window.map_or((f64::NAN, f64::NAN), |d| (d.p50, d.p99));
        s.push_str(&format!(
            "| {} | {p50:.3} | {p99:.3} | {:.3} | {} | {} | {:.2}% |\n",
            r.label,
            r.run_p99,
            r.warmups,
            r.warmup_tokens,
            r.share * 100.0
        ));
    }
    s
}

/// A replay's TTFT in `window` (model seconds) and its warm-up prefill share: all prefill is the
/// requests' uncached prompt tokens plus the warm-ups'.
pub fn bench_row<'a>(
    run: &'a RunResult,
    workload: &[WorkloadRequest],
    window: Option<(f64, f64)>,
    run_p99: f64,
) -> HotRow<'a> {
    let scale = run.time_scale;
    let window = window.map(|(start, len)| {
        let mut ttft: Vec<f64> = run
            .records
            .iter()
            .filter(|r| {
                workload
                    .get(r.index)
                    .is_some_and(|q| (start..start + len).contains(&q.at_s))
            })
            .filter_map(|r| r.ttft_s.map(|t| t * scale))
            .collect();
        Distribution::of(&mut ttft)
    });
    let uncached: u64 = run
        .records
        .iter()
        .filter(|r| r.error.is_none())
        .map(|r| r.prompt_tokens.saturating_sub(r.cached_tokens.unwrap_or(0)))
        .sum();
    let all = uncached + run.warmup_tokens;
    HotRow {
        label: &run.label,
        window,
        run_p99,
        warmups: run.warmups,
        warmup_tokens: run.warmup_tokens,
        share: if all == 0 {
            0.0
        } else {
            run.warmup_tokens as f64 / all as f64
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_parse_and_bad_ones_are_refused() {
        assert_eq!(parse_window("20:10"), Ok((20.0, 10.0)));
        assert_eq!(parse_window(" 0.5 : 2 "), Ok((0.5, 2.0)));
        for bad in ["20", "a:1", "1:-2", "1:inf"] {
            assert!(parse_window(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn both_runs_without_then_with_replication() {
        let a = HotArgs {
            hot_prefix: "both".into(),
            hot_budget_share: 0.1,
            window_s: None,
        };
        let m = a.modes();
        assert_eq!(m.len(), 2);
        assert!(m[0].is_none());
        let on = m[1].as_ref().unwrap();
        assert!(on.enabled && on.budget_share == 0.1);
    }
}
