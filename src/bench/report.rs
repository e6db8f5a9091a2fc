//! `kvmesh bench` reports: a [`RunResult`] of raw per-request records becomes a [`BenchReport`]
//! (percentiles, throughput, hit ratio, load shares), rendered as JSON, one Markdown table for
//! all runs, and SVG charts (TTFT CDF, hit ratio per run, per-replica load over time).
//!
//! Kept apart from the replay so the demo and `--compare` modes render any set of runs the same
//! way, and so the charts' dependency (plotters, SVG only) stays out of the request path.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use plotters::prelude::*;
use serde::Serialize;

use super::replay::RunResult;
use super::stats::{max_over_mean, Distribution};

/// Where the hit-token figure comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum HitSource {
    /// `x-kvmesh-cached-tokens` or `usage.prompt_tokens_details.cached_tokens` on every success.
    Responses,
    /// `/metrics` deltas of the vLLM prefix-cache counters.
    Metrics,
    /// Not known.
    None,
}

/// One replica's share of a run.
#[derive(Clone, Debug, Serialize)]
pub struct ReplicaShare {
    /// Replica id (`?` = not reported by the endpoint).
    pub replica: String,
    /// Successful requests it served.
    pub requests: u64,
    /// Prompt tokens of those requests.
    pub prompt_tokens: u64,
}

/// The summary of one run. Durations are in model seconds (wall × the run's time scale).
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// Run name.
    pub label: String,
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed (status, stream error, timeout).
    pub errors: usize,
    /// Time to first token of successful requests.
    pub ttft: Distribution,
    /// End-to-end latency of successful requests.
    pub latency: Distribution,
    /// Inter-token latency of successful requests of two tokens or more: the time after the
    /// first token over the tokens after it, as `kvmesh sim` counts it.
    pub itl: Distribution,
    /// Successful requests a node served as a prefill/decode pair.
    pub pd_pairs: usize,
    /// Duration of the run (model seconds).
    pub duration_s: f64,
    /// Successful requests per model second.
    pub throughput_rps: f64,
    /// Output tokens per model second.
    pub output_tokens_per_s: f64,
    /// Prompt tokens of successful requests.
    pub prompt_tokens: u64,
    /// Prompt tokens served from prefix caches.
    pub cached_tokens: u64,
    /// cached / prompt tokens.
    pub hit_token_ratio: f64,
    /// Where `cached_tokens` comes from.
    pub hit_source: HitSource,
    /// Per replica (the fleet's, or those seen), sorted by id.
    pub per_replica: Vec<ReplicaShare>,
    /// Largest replica request share over the mean.
    pub requests_max_over_mean: f64,
    /// Largest replica prompt-token share over the mean.
    pub tokens_max_over_mean: f64,
    /// Multiply wall times by this for model time (1 = real endpoints).
    pub time_scale: f64,
    /// The kvmesh nodes' receipts for the run, when the targets were kvmesh nodes.
    pub receipts: Option<super::replay::ReceiptDelta>,
}

/// Summarises one run.
pub fn summarize(run: &RunResult) -> BenchReport {
    let scale = run.time_scale;
    let ok: Vec<_> = run.records.iter().filter(|r| r.error.is_none()).collect();
    let mut ttft: Vec<f64> = ok
        .iter()
        .filter_map(|r| r.ttft_s)
        .map(|t| t * scale)
        .collect();
    let mut latency: Vec<f64> = ok.iter().map(|r| r.latency_s * scale).collect();
    let mut itl: Vec<f64> = ok
        .iter()
        .filter_map(|r| {
            let tokens = u32::try_from(r.output_tokens).unwrap_or(u32::MAX);
            super::sim_pd::itl(r.latency_s, r.ttft_s?, tokens)
        })
        .map(|x| x * scale)
        .collect();
    let prompt_tokens: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
    let output_tokens: u64 = ok.iter().map(|r| r.output_tokens).sum();
    let (cached_tokens, hit_source, hit_ratio) =
        if !ok.is_empty() && ok.iter().all(|r| r.cached_tokens.is_some()) {
            let c: u64 = ok.iter().filter_map(|r| r.cached_tokens).sum();
            (
                c,
                HitSource::Responses,
                ratio(c as f64, prompt_tokens as f64),
            )
        } else if let Some(m) = run.metrics {
            (m.hits as u64, HitSource::Metrics, ratio(m.hits, m.queries))
        } else {
            (0, HitSource::None, 0.0)
        };
    let mut shares: BTreeMap<String, (u64, u64)> =
        run.replicas.iter().map(|id| (id.clone(), (0, 0))).collect();
    for r in &ok {
        let id = r.replica.clone().unwrap_or_else(|| "?".into());
        let e = shares.entry(id).or_default();
        e.0 += 1;
        e.1 += r.prompt_tokens;
    }
    let per_replica: Vec<ReplicaShare> = shares
        .into_iter()
        .map(|(replica, (requests, prompt_tokens))| ReplicaShare {
            replica,
            requests,
            prompt_tokens,
        })
        .collect();
    let req_counts: Vec<u64> = per_replica.iter().map(|s| s.requests).collect();
    let tok_counts: Vec<u64> = per_replica.iter().map(|s| s.prompt_tokens).collect();
    let duration_s = run.wall_s * scale;
    BenchReport {
        label: run.label.clone(),
        requests: run.records.len(),
        errors: run.records.len() - ok.len(),
        ttft: Distribution::of(&mut ttft),
        latency: Distribution::of(&mut latency),
        itl: Distribution::of(&mut itl),
        pd_pairs: ok.iter().filter(|r| r.pd_pair).count(),
        duration_s,
        throughput_rps: ratio(ok.len() as f64, duration_s),
        output_tokens_per_s: ratio(output_tokens as f64, duration_s),
        prompt_tokens,
        cached_tokens,
        hit_token_ratio: hit_ratio,
        hit_source,
        requests_max_over_mean: max_over_mean(&req_counts),
        tokens_max_over_mean: max_over_mean(&tok_counts),
        per_replica,
        time_scale: scale,
        receipts: run.receipts,
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// One Markdown table of the runs, then each run's per-replica request counts.
pub fn markdown(reports: &[BenchReport]) -> String {
    let mut s = String::from(
        "| run | requests | errors | TTFT mean (s) | p50 | p90 | p99 | latency mean (s) | p50 | p90 | p99 | req/s | out tok/s | hit tokens | hit ratio | req max/mean | tok max/mean |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in reports {
        s.push_str(&format!(
            "| {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} | {} | {:.3}{} | {:.2} | {:.2} |\n",
            r.label,
            r.requests,
            r.errors,
            r.ttft.mean,
            r.ttft.p50,
            r.ttft.p90,
            r.ttft.p99,
            r.latency.mean,
            r.latency.p50,
            r.latency.p90,
            r.latency.p99,
            r.throughput_rps,
            r.output_tokens_per_s,
            r.cached_tokens,
            r.hit_token_ratio,
            match r.hit_source {
                HitSource::Responses => "",
                HitSource::Metrics => " (metrics)",
                HitSource::None => " (unknown)",
            },
            r.requests_max_over_mean,
            r.tokens_max_over_mean,
        ));
    }
    s.push_str("\n| run | ITL mean (ms) | p50 | p99 | P/D pairs |\n|---|---:|---:|---:|---:|\n");
    for r in reports {
        s.push_str(&format!(
            "| {} | {:.1} | {:.1} | {:.1} | {} |\n",
            r.label,
            r.itl.mean * 1000.0,
            r.itl.p50 * 1000.0,
            r.itl.p99 * 1000.0,
            r.pd_pairs
        ));
    }
    if reports.iter().any(|r| r.receipts.is_some()) {
        s.push_str(
            "\nReceipts (the nodes' predicted cached tokens against the engines' reports):\n\n\
             | run | answers | predicted | reported | matched | precision | recall |\n\
             |---|---:|---:|---:|---:|---:|---:|\n",
        );
        for r in reports {
            if let Some(d) = r.receipts {
                s.push_str(&format!(
                    "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.3} | {:.3} |\n",
                    r.label,
                    d.answers,
                    d.predicted,
                    d.reported,
                    d.matched,
                    ratio(d.matched, d.predicted),
                    ratio(d.matched, d.reported),
                ));
            }
        }
    }
    s.push_str("\nRequests per replica:\n\n");
    for r in reports {
        let counts: Vec<String> = r
            .per_replica
            .iter()
            .map(|x| format!("{} {}", x.replica, x.requests))
            .collect();
        s.push_str(&format!("- {}: {}\n", r.label, counts.join(", ")));
    }
    if reports.iter().any(|r| r.time_scale != 1.0) {
        s.push_str("\nTimes are model seconds: wall time × the simulated replicas' time scale.\n");
    }
    s
}

/// Writes `bench-report.json` (summaries + raw records), `bench-report.md` and the SVG charts
/// into `dir`; returns the paths written.
pub fn write_all(
    dir: &Path,
    runs: &[RunResult],
    refs: &[HitReference],
) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let reports: Vec<BenchReport> = runs.iter().map(summarize).collect();
    let mut written = Vec::new();
    let json = serde_json::json!({ "reports": reports, "runs": runs });
    let p = dir.join("bench-report.json");
    std::fs::write(&p, serde_json::to_string_pretty(&json)?)
        .with_context(|| format!("writing {}", p.display()))?;
    written.push(p);
    let p = dir.join("bench-report.md");
    std::fs::write(&p, markdown(&reports)).with_context(|| format!("writing {}", p.display()))?;
    written.push(p);
    let p = dir.join("ttft-cdf.svg");
    ttft_cdf_chart(&p, runs)?;
    written.push(p);
    let p = dir.join("hit-ratio.svg");
    hit_ratio_chart(&p, &reports, refs)?;
    written.push(p);
    for run in runs {
        let p = dir.join(format!("replica-load-{}.svg", file_safe(&run.label)));
        replica_load_chart(&p, run)?;
        written.push(p);
    }
    Ok(written)
}

fn file_safe(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn chart_err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("drawing chart: {e}")
}

/// TTFT CDF, one line per run (model seconds, log-free linear axis up to the largest p99).
pub fn ttft_cdf_chart(path: &Path, runs: &[RunResult]) -> anyhow::Result<()> {
    let series: Vec<(String, Vec<f64>)> = runs
        .iter()
        .map(|r| {
            let mut v: Vec<f64> = r
                .records
                .iter()
                .filter(|x| x.error.is_none())
                .filter_map(|x| x.ttft_s)
                .map(|t| t * r.time_scale)
                .collect();
            v.sort_by(f64::total_cmp);
            (r.label.clone(), v)
        })
        .collect();
    cdf_chart(path, &series)
}

/// TTFT CDF of labelled series of samples, each sorted ascending (the bench's runs, the
/// simulator's policies).
pub fn cdf_chart(path: &Path, series: &[(String, Vec<f64>)]) -> anyhow::Result<()> {
    let x_max = series
        .iter()
        .filter_map(|(_, v)| v.get((v.len() * 99 / 100).min(v.len().saturating_sub(1))))
        .fold(0.0f64, |a, &b| a.max(b))
        .max(1e-3)
        * 1.05;
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(chart_err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("TTFT CDF (up to the largest p99)", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..x_max, 0.0..1.0)
        .map_err(chart_err)?;
    chart
        .configure_mesh()
        .x_desc("time to first token (s)")
        .y_desc("fraction of requests")
        .draw()
        .map_err(chart_err)?;
    for (i, (label, v)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let n = v.len().max(1) as f64;
        chart
            .draw_series(LineSeries::new(
                v.iter()
                    .enumerate()
                    .filter(|(_, &t)| t <= x_max)
                    .map(|(k, &t)| (t, (k + 1) as f64 / n)),
                color.stroke_width(2),
            ))
            .map_err(chart_err)?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(chart_err)?;
    root.present().map_err(chart_err)?;
    Ok(())
}

/// A hit ratio the runs are drawn against: the workload's ideal, a central reference.
#[derive(Clone, Debug)]
pub struct HitReference {
    /// What it is, as the chart names it.
    pub label: String,
    /// Hit tokens / prompt tokens.
    pub ratio: f64,
}

/// Hit-token ratio per run, as bars, against `refs` (drawn as dashed lines).
pub fn hit_ratio_chart(
    path: &Path,
    reports: &[BenchReport],
    refs: &[HitReference],
) -> anyhow::Result<()> {
    let bars: Vec<(String, f64)> = reports
        .iter()
        .map(|r| (r.label.clone(), r.hit_token_ratio))
        .collect();
    ratio_bars_chart(path, &bars, refs)
}

/// The hit-ratio axis: from a little below the smallest value to a little above the largest
/// (bars and references), so a difference of a few points is visible; 0..1 only when the values
/// span most of it. Never outside 0..1, never narrower than 0.02.
fn ratio_axis(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if lo > hi {
        return (0.0, 1.0);
    }
    let pad = ((hi - lo) * 0.25).max(0.01);
    let (lo, hi) = ((lo - pad).max(0.0), (hi + pad).min(1.0));
    if hi - lo > 0.6 {
        (0.0, 1.0)
    } else {
        (lo, hi)
    }
}

/// Hit-token ratio of labelled runs, as bars on an axis that shows their differences, with each
/// of `refs` as a dashed line across the chart, labelled.
pub fn ratio_bars_chart(
    path: &Path,
    bars: &[(String, f64)],
    refs: &[HitReference],
) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (800, 450)).into_drawing_area();
    root.fill(&WHITE).map_err(chart_err)?;
    let n = bars.len().max(1);
    let labels: Vec<&str> = bars.iter().map(|(l, _)| l.as_str()).collect();
    let (y_lo, y_hi) = ratio_axis(bars.iter().map(|b| b.1).chain(refs.iter().map(|r| r.ratio)));
    let caption = if y_lo >= 0.005 {
        format!("prefix-cache hit tokens / prompt tokens (axis from {y_lo:.2})")
    } else {
        "prefix-cache hit tokens / prompt tokens".to_owned()
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..n as f64, y_lo..y_hi)
        .map_err(chart_err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - i as f64 - 0.5).abs() < 0.01 {
                labels.get(i).map(|l| l.to_string()).unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("hit-token ratio")
        .draw()
        .map_err(chart_err)?;
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (_, ratio))| {
            Rectangle::new(
                [(i as f64 + 0.15, y_lo), (i as f64 + 0.85, ratio.max(y_lo))],
                Palette99::pick(i).filled(),
            )
        }))
        .map_err(chart_err)?;
    let span = y_hi - y_lo;
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (_, ratio))| {
            Text::new(
                format!("{ratio:.3}"),
                (
                    i as f64 + 0.35,
                    (ratio + 0.03 * span).min(y_hi - 0.03 * span),
                ),
                ("sans-serif", 14),
            )
        }))
        .map_err(chart_err)?;
    for r in refs {
        chart
            .draw_series(DashedLineSeries::new(
                [(0.0, r.ratio), (n as f64, r.ratio)],
                6,
                4,
                BLACK.stroke_width(2),
            ))
            .map_err(chart_err)?;
        chart
            .draw_series(std::iter::once(Text::new(
                format!("{} {:.3}", r.label, r.ratio),
                // Above the line: a text hangs down from its anchor.
                (0.05, r.ratio + 0.06 * span),
                ("sans-serif", 13),
            )))
            .map_err(chart_err)?;
    }
    root.present().map_err(chart_err)?;
    Ok(())
}

/// Requests started per replica per time bin: one row per replica, one cell per bin, darker
/// for more; each row ends with the replica's share of the run's requests. A heatmap reads
/// at a glance where overlapping lines do not: a replica left idle is a pale row, a herd a
/// dark column on one row.
pub fn replica_load_chart(path: &Path, run: &RunResult) -> anyhow::Result<()> {
    let report = summarize(run);
    let ids: Vec<String> = report
        .per_replica
        .iter()
        .map(|s| s.replica.clone())
        .collect();
    let total: u64 = report.per_replica.iter().map(|s| s.requests).sum();
    let end = run
        .records
        .iter()
        .map(|r| r.sent_s * run.time_scale)
        .fold(0.0f64, f64::max)
        .max(1e-3);
    let bins = 40usize;
    let width = end / bins as f64 * 1.0001;
    let mut counts = vec![vec![0u64; bins]; ids.len()];
    for r in run.records.iter().filter(|r| r.error.is_none()) {
        let id = r.replica.as_deref().unwrap_or("?");
        if let Some(k) = ids.iter().position(|x| x == id) {
            let b = ((r.sent_s * run.time_scale / width) as usize).min(bins - 1);
            counts[k][b] += 1;
        }
    }
    let max_rate = counts.iter().flatten().copied().max().unwrap_or(0).max(1) as f64 / width;
    let rows = ids.len().max(1);
    let height = (120 + 28 * rows).clamp(220, 900) as u32;
    let root = SVGBackend::new(path, (800, height)).into_drawing_area();
    root.fill(&WHITE).map_err(chart_err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "requests/s by replica — {} (white 0, darkest {max_rate:.1}/s)",
                run.label
            ),
            ("sans-serif", 18),
        )
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(110)
        .right_y_label_area_size(60)
        .build_cartesian_2d(0.0..end, 0.0..rows as f64)
        .map_err(chart_err)?
        .set_secondary_coord(0.0..end, 0.0..rows as f64);
    let row_label = |y: &f64| {
        let i = y.floor() as usize;
        if (y - i as f64 - 0.5).abs() < 0.01 {
            ids.get(i).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc("time (s)")
        .y_labels(rows * 2 + 1)
        .y_label_formatter(&row_label)
        .draw()
        .map_err(chart_err)?;
    let shares: Vec<String> = report
        .per_replica
        .iter()
        .map(|s| format!("{:.0} %", 100.0 * s.requests as f64 / total.max(1) as f64))
        .collect();
    chart
        .configure_secondary_axes()
        .y_labels(rows * 2 + 1)
        .y_label_formatter(&|y: &f64| {
            let i = y.floor() as usize;
            if (y - i as f64 - 0.5).abs() < 0.01 {
                shares.get(i).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .draw()
        .map_err(chart_err)?;
    chart
        .draw_series(counts.iter().enumerate().flat_map(|(k, row)| {
            row.iter().enumerate().map(move |(b, &c)| {
                let x0 = b as f64 * width;
                Rectangle::new(
                    [(x0, k as f64 + 0.05), (x0 + width, k as f64 + 0.95)],
                    heat(c as f64 / width / max_rate).filled(),
                )
            })
        }))
        .map_err(chart_err)?;
    root.present().map_err(chart_err)?;
    Ok(())
}

/// A sequential colour for `v` in 0..=1: white to dark blue.
fn heat(v: f64) -> RGBColor {
    let v = if v.is_finite() {
        v.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let mix = |from: f64, to: f64| (from + (to - from) * v).round() as u8;
    RGBColor(mix(255.0, 8.0), mix(255.0, 48.0), mix(255.0, 107.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::replay::{MetricsDelta, RequestRecord};

    fn rec(i: usize, replica: &str, cached: Option<u64>, error: bool) -> RequestRecord {
        RequestRecord {
            index: i,
            sent_s: i as f64 * 0.1,
            status: if error { 500 } else { 200 },
            ttft_s: Some(0.01 * (i + 1) as f64),
            latency_s: 0.1,
            prompt_tokens: 100,
            output_tokens: 10,
            cached_tokens: cached,
            replica: Some(replica.into()),
            error: error.then(|| "status 500".into()),
            ..RequestRecord::default()
        }
    }

    fn run(records: Vec<RequestRecord>) -> RunResult {
        RunResult {
            label: "p2c-cache".into(),
            targets: vec!["http://x".into()],
            model: "m".into(),
            records,
            wall_s: 2.0,
            time_scale: 10.0,
            replicas: vec!["a".into(), "b".into(), "c".into()],
            receipts: None,
            metrics: Some(MetricsDelta {
                hits: 1.0,
                queries: 4.0,
            }),
            warmups: 0,
            warmup_tokens: 0,
        }
    }

    #[test]
    fn summary_counts_errors_shares_and_scales_time() {
        let r = run(vec![
            rec(0, "a", Some(50), false),
            rec(1, "a", Some(0), false),
            rec(2, "b", Some(100), false),
            rec(3, "b", None, true),
        ]);
        let s = summarize(&r);
        assert_eq!((s.requests, s.errors), (4, 1));
        assert_eq!(s.cached_tokens, 150);
        assert_eq!(s.hit_source, HitSource::Responses);
        assert!((s.hit_token_ratio - 0.5).abs() < 1e-9);
        // The idle replica c counts: shares 2, 1, 0 over mean 1.
        assert_eq!(s.per_replica.len(), 3);
        assert!((s.requests_max_over_mean - 2.0).abs() < 1e-9);
        assert!(
            (s.ttft.max - 0.3).abs() < 1e-9,
            "scaled by 10: {}",
            s.ttft.max
        );
        assert!((s.throughput_rps - 3.0 / 20.0).abs() < 1e-9);
        let md = markdown(&[s]);
        assert!(md.contains("| p2c-cache | 4 | 1 |"), "{md}");
    }

    #[test]
    fn metrics_deltas_stand_in_when_responses_lack_cached_tokens() {
        let s = summarize(&run(vec![rec(0, "a", None, false)]));
        assert_eq!(s.hit_source, HitSource::Metrics);
        assert!((s.hit_token_ratio - 0.25).abs() < 1e-9);
    }

    #[test]
    fn charts_are_written_as_svg() {
        let dir = std::env::temp_dir().join(format!("kvmesh-report-{}", std::process::id()));
        let runs = vec![run(vec![
            rec(0, "a", Some(1), false),
            rec(1, "b", Some(2), false),
        ])];
        let refs = [HitReference {
            label: "ideal".into(),
            ratio: 0.5,
        }];
        let files = write_all(&dir, &runs, &refs).unwrap();
        assert_eq!(files.len(), 5);
        for f in &files {
            let text = std::fs::read_to_string(f).unwrap();
            assert!(!text.is_empty());
            if f.extension().is_some_and(|e| e == "svg") {
                assert!(text.contains("<svg"), "{}", f.display());
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
