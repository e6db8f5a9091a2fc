//! The tenant flags `kvmesh sim` and `kvmesh bench` share — KV quotas for the nodes, a smaller
//! replica KV cache, one tenant reported apart — and the per-tenant table both print.
//!
//! They exist for the KV-quota figures (docs/benchmarks-notebook.md, "Tenant KV quotas"): a quota only
//! matters when a big tenant's traffic can flush the cache, which at the presets' 450k-token
//! caches takes far more traffic than a bench run sends; a smaller cache shows the same
//! dynamics at a rate both instruments replay in minutes.

use std::collections::HashMap;

use anyhow::Context;

use super::replay::RequestRecord;
use super::sim_classes::{class_label, class_stats, ClassStats};
use super::sim_config::{GroupStats, TenantSplit};
use super::stats::Distribution;
use super::workload::WorkloadRequest;
use crate::core::priority::PrioritiesConfig;
use crate::core::tenants::{TenantConfig, Tenants};

/// Tenant flags of `kvmesh sim` and `kvmesh bench` (fleet runs).
#[derive(Clone, Debug, Default, clap::Args)]
pub struct TenantArgs {
    /// Give tenant NAME a KV quota on every node: `NAME=SHARE` with SHARE in [0, 1], as
    /// `[tenants.NAME] max_kv_share` (repeatable).
    #[arg(long = "tenant-kv-share", value_name = "NAME=SHARE")]
    pub kv_shares: Vec<String>,
    /// Report tenant NAME's requests apart from every other tenant's (hit ratio, TTFT).
    #[arg(long, value_name = "NAME")]
    pub split_tenant: Option<String>,
    /// KV cache of every simulated replica, in tokens (default: the preset's, 450,000).
    #[arg(long)]
    pub kv_capacity_tokens: Option<usize>,
    /// Give every node `[priorities]` with the default classes (critical, standard, batch): a
    /// request that finds every replica full waits in a fair queue per class.
    #[arg(long)]
    pub priorities: bool,
    /// Put tenant NAME's requests in priority class CLASS: `NAME=CLASS`, as `[tenants.NAME]
    /// priority` (repeatable; the class is a request's label in the per-class table even
    /// without `--priorities`; unlisted tenants are `standard`).
    #[arg(long = "tenant-priority", value_name = "NAME=CLASS")]
    pub priority: Vec<String>,
    /// Weigh tenant NAME's share of freed slots: `NAME=WEIGHT` in [0.01, 1000], as
    /// `[tenants.NAME] weight` (repeatable).
    #[arg(long = "tenant-weight", value_name = "NAME=WEIGHT")]
    pub weight: Vec<String>,
    /// Every replica's `max_in_flight` (default: the engine's batch limit in the simulator,
    /// 256 in a fleet): with `--priorities`, where requests start waiting at the node.
    #[arg(long)]
    pub max_in_flight: Option<u32>,
}

/// `NAME=VALUE` of flag `flag`, both sides trimmed and non-empty.
fn pair<'a>(flag: &str, item: &'a str) -> anyhow::Result<(&'a str, &'a str)> {
    let (name, value) = item
        .split_once('=')
        .with_context(|| format!("--{flag} '{item}' is not NAME=VALUE"))?;
    let (name, value) = (name.trim(), value.trim());
    anyhow::ensure!(
        !name.is_empty() && !value.is_empty(),
        "--{flag} '{item}': empty name or value"
    );
    Ok((name, value))
}

impl TenantArgs {
    /// The tenant policies the flags give every node.
    pub fn tenant_configs(&self) -> anyhow::Result<HashMap<String, TenantConfig>> {
        let mut out = HashMap::new();
        for item in &self.kv_shares {
            let (name, share) = item
                .split_once('=')
                .with_context(|| format!("--tenant-kv-share '{item}' is not NAME=SHARE"))?;
            let share: f64 = share.trim().parse().with_context(|| {
                format!("--tenant-kv-share '{item}': '{share}' is not a number")
            })?;
            anyhow::ensure!(
                (0.0..=1.0).contains(&share),
                "--tenant-kv-share '{item}': the share must be in [0, 1]"
            );
            anyhow::ensure!(
                !name.trim().is_empty(),
                "--tenant-kv-share '{item}': no tenant name"
            );
            out.insert(
                name.trim().to_owned(),
                TenantConfig {
                    max_kv_share: Some(share),
                    ..TenantConfig::default()
                },
            );
        }
        let classes = self.priorities_config().map(|p| p.classes);
        for item in &self.priority {
            let (name, class) = pair("tenant-priority", item)?;
            if let Some(classes) = &classes {
                anyhow::ensure!(
                    crate::core::priority::class_by_name(classes, class).is_some(),
                    "--tenant-priority '{item}': no class '{class}'"
                );
            }
            out.entry(name.to_owned()).or_default().priority = Some(class.to_owned());
        }
        for item in &self.weight {
            let (name, w) = pair("tenant-weight", item)?;
            let w: f64 = w
                .parse()
                .with_context(|| format!("--tenant-weight '{item}': '{w}' is not a number"))?;
            anyhow::ensure!(
                (crate::core::priority::MIN_WEIGHT..=crate::core::priority::MAX_WEIGHT)
                    .contains(&w),
                "--tenant-weight '{item}': the weight must be in [0.01, 1000]"
            );
            out.entry(name.to_owned()).or_default().weight = Some(w);
        }
        Ok(out)
    }

    /// The nodes' `[priorities]`, with `--priorities`: the default classes.
    pub fn priorities_config(&self) -> Option<PrioritiesConfig> {
        self.priorities.then(PrioritiesConfig::default)
    }
}

/// One live run's records split into `tenant`'s and every other tenant's (times scaled by
/// `time_scale` to model seconds; failed requests left out).
pub fn split_records(
    records: &[RequestRecord],
    workload: &[WorkloadRequest],
    tenant: &str,
    time_scale: f64,
) -> TenantSplit {
    let group = |this: bool| {
        let (mut ttft, mut prompt, mut cached) = (Vec::new(), 0u64, 0u64);
        for r in records.iter().filter(|r| r.error.is_none()) {
            let Some(w) = workload.get(r.index) else {
                continue;
            };
            if (w.tenant.as_deref() == Some(tenant)) != this {
                continue;
            }
            prompt += r.prompt_tokens;
            cached += r.cached_tokens.unwrap_or(0);
            if let Some(t) = r.ttft_s {
                ttft.push(t * time_scale);
            }
        }
        GroupStats {
            requests: ttft.len(),
            hit_token_ratio: if prompt == 0 {
                0.0
            } else {
                cached as f64 / prompt as f64
            },
            ttft: Distribution::of(&mut ttft),
        }
    };
    TenantSplit {
        tenant: tenant.to_owned(),
        this: group(true),
        others: group(false),
    }
}

/// One live run's records by priority class (a request's tenant's `priority`, else
/// `standard`; times scaled by `time_scale` to model seconds): a 429 counts as refused (the
/// admission queue's answer), other failures are left out.
pub fn class_records(
    records: &[RequestRecord],
    workload: &[WorkloadRequest],
    tenants: &Tenants,
    time_scale: f64,
) -> Vec<ClassStats> {
    let default = PrioritiesConfig::default().default_class;
    let order: Vec<String> = PrioritiesConfig::default()
        .classes
        .into_iter()
        .map(|c| c.name)
        .collect();
    let outcomes = records.iter().filter_map(|r| {
        let w = workload.get(r.index)?;
        let label = class_label(tenants, w.tenant.as_deref(), &default);
        let refused = r.status == 429;
        if r.error.is_some() && !refused {
            return None;
        }
        let ttft = r.ttft_s.map_or(f64::NAN, |t| t * time_scale);
        Some((label, if refused { f64::NAN } else { ttft }, refused))
    });
    class_stats(&order, outcomes)
}

/// A Markdown table of labelled tenant splits: per run, the split tenant's row and the others'.
pub fn split_markdown<'a>(runs: impl IntoIterator<Item = (&'a str, &'a TenantSplit)>) -> String {
    let mut s = String::from(
        "| run | tenants | requests | hit ratio | TTFT p50 (s) | p90 | p99 |\n|---|---|---:|---:|---:|---:|---:|\n",
    );
    for (label, split) in runs {
        for (who, g) in [
            (split.tenant.clone(), &split.this),
            (format!("all but {}", split.tenant), &split.others),
        ] {
            s.push_str(&format!(
                "| {label} | {who} | {} | {:.3} | {:.3} | {:.3} | {:.3} |\n",
                g.requests, g.hit_token_ratio, g.ttft.p50, g.ttft.p90, g.ttft.p99
            ));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_share_flags_parse_and_bad_ones_name_the_item() {
        let args = |v: &[&str]| TenantArgs {
            kv_shares: v.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        };
        let t = args(&["big=0.25"]).tenant_configs().unwrap();
        assert_eq!(t["big"].max_kv_share, Some(0.25));
        for bad in ["big", "big=x", "big=1.5", "=0.5"] {
            let e = args(&[bad]).tenant_configs().unwrap_err().to_string();
            assert!(e.contains(bad), "{e}");
        }
    }

    #[test]
    fn records_split_by_the_workloads_tenant() {
        let w = |t: &str| WorkloadRequest {
            at_s: 0.0,
            segments: vec![(1, 100)],
            output_tokens: 1,
            session: None,
            affinity: None,
            tenant: Some(t.into()),
        };
        let workload = vec![w("big"), w("small-0"), w("small-1")];
        let rec = |index, cached, ttft| RequestRecord {
            index,
            prompt_tokens: 100,
            cached_tokens: Some(cached),
            ttft_s: Some(ttft),
            ..Default::default()
        };
        let records = vec![rec(0, 100, 0.1), rec(1, 50, 0.2), rec(2, 0, 0.4)];
        let s = split_records(&records, &workload, "big", 10.0);
        assert_eq!((s.this.requests, s.others.requests), (1, 2));
        assert_eq!(s.this.hit_token_ratio, 1.0);
        assert_eq!(s.others.hit_token_ratio, 0.25);
        assert!((s.others.ttft.p99 - 4.0).abs() < 1e-9, "model seconds");
    }
}
