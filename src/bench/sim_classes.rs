//! Per-priority-class results of a simulator run: how many requests each class had, how many
//! the admission queue refused, and their time to first token (waiting included).
//!
//! Exists so the priority figures (docs/benchmarks-notebook.md, "Priorities and fairness") compare runs
//! with and without `[priorities]` class by class: a request's class is its tenant's
//! `priority` (else the default class) in both runs, so the rows line up even when the run
//! without priorities queues nothing.

use serde::Serialize;

use super::stats::Distribution;
use crate::core::tenants::Tenants;

/// One class's requests in a run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ClassStats {
    /// The class name.
    pub class: String,
    /// Requests of the class.
    pub requests: usize,
    /// Refused by the admission queue (full, deadline unmeetable or passed).
    pub rejected: usize,
    /// Time to first token of those served (seconds, from arrival: queueing included).
    pub ttft: Distribution,
}

impl ClassStats {
    /// Refused share of the class's requests.
    pub fn rejected_rate(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.rejected as f64 / self.requests as f64
        }
    }
}

/// The class label of a request of `tenant`: its `priority`, else `default`.
pub fn class_label<'a>(tenants: &'a Tenants, tenant: Option<&str>, default: &'a str) -> &'a str {
    tenants
        .config(tenant)
        .priority
        .as_deref()
        .unwrap_or(default)
}

/// Groups per-request outcomes by class label, in the order of `order` (labels not in it come
/// after, sorted): `(label, ttft or NaN when not served, refused)`.
pub fn class_stats<'a>(
    order: &[String],
    outcomes: impl Iterator<Item = (&'a str, f64, bool)>,
) -> Vec<ClassStats> {
    let mut groups: Vec<(ClassStats, Vec<f64>)> = order
        .iter()
        .map(|c| {
            (
                ClassStats {
                    class: c.clone(),
                    ..ClassStats::default()
                },
                Vec::new(),
            )
        })
        .collect();
    for (label, ttft, refused) in outcomes {
        let g = match groups.iter().position(|(s, _)| s.class == label) {
            Some(g) => g,
            None => {
                groups.push((
                    ClassStats {
                        class: label.to_owned(),
                        ..ClassStats::default()
                    },
                    Vec::new(),
                ));
                groups.len() - 1
            }
        };
        let (stats, samples) = &mut groups[g];
        stats.requests += 1;
        stats.rejected += usize::from(refused);
        if !ttft.is_nan() {
            samples.push(ttft);
        }
    }
    groups
        .into_iter()
        .filter(|(s, _)| s.requests > 0)
        .map(|(mut s, mut samples)| {
            s.ttft = Distribution::of(&mut samples);
            s
        })
        .collect()
}

/// A Markdown table of labelled runs' class rows.
pub fn class_markdown<'a>(runs: impl IntoIterator<Item = (&'a str, &'a [ClassStats])>) -> String {
    let mut s = String::from(
        "| run | class | requests | rejected | TTFT p50 (s) | p90 | p99 |\n|---|---|---:|---:|---:|---:|---:|\n",
    );
    for (label, classes) in runs {
        for c in classes {
            s.push_str(&format!(
                "| {label} | {} | {} | {:.1}% | {:.3} | {:.3} | {:.3} |\n",
                c.class,
                c.requests,
                100.0 * c.rejected_rate(),
                c.ttft.p50,
                c.ttft.p90,
                c.ttft.p99
            ));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_group_by_class_in_the_configured_order() {
        let order = vec!["critical".to_owned(), "batch".to_owned()];
        let rows = class_stats(
            &order,
            [
                ("batch", 2.0, false),
                ("batch", f64::NAN, true),
                ("critical", 0.5, false),
                ("other", 1.0, false),
            ]
            .into_iter(),
        );
        let names: Vec<_> = rows.iter().map(|r| r.class.as_str()).collect();
        assert_eq!(names, ["critical", "batch", "other"]);
        assert_eq!((rows[1].requests, rows[1].rejected), (2, 1));
        assert_eq!(rows[1].rejected_rate(), 0.5);
        assert_eq!(rows[1].ttft.count, 1);
        let md = class_markdown([("on", rows.as_slice())]);
        assert!(md.contains("| on | batch | 2 | 50.0% | 2.000 |"), "{md}");
    }
}
