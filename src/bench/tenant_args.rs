//! The tenant flags `kvmesh sim` and `kvmesh bench` share — KV quotas for the nodes, a smaller
//! replica KV cache, one tenant reported apart — and the per-tenant table both print.
//!
//! They exist for the KV-quota figures (docs/benchmarks.md, "Tenant KV quotas"): a quota only
//! matters when a big tenant's traffic can flush the cache, which at the presets' 450k-token
//! caches takes far more traffic than a bench run sends; a smaller cache shows the same
//! dynamics at a rate both instruments replay in minutes.

use std::collections::HashMap;

use anyhow::Context;

use super::replay::RequestRecord;
use super::sim_config::{GroupStats, TenantSplit};
use super::stats::Distribution;
use super::workload::WorkloadRequest;
use crate::core::tenants::TenantConfig;

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
        Ok(out)
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
