//! Configuration reload (SIGHUP): the replicas, tenants and routing parameters of a running
//! node change without a restart and without failing a request.
//!
//! Exists because operators edit the config file (or its ConfigMap) and expect `systemctl
//! reload` to apply it. What reloads: `[[replicas]]` (new ones register and start their checks,
//! changed ones update, missing ones drain like a DNS departure), `[tenants]` and
//! `default_tenant` (requests already routed keep what they hold; new quotas apply to the next
//! request), and `policy` (fresh policy state), `spill_after_s`, `w_load_s`,
//! `affinity_credit_s`, `tier_weights`, `overlay_ttl_s` and the weights and bounds of the
//! `[priorities]` classes (their names, order, header and default class need a restart). Everything else is read at start: a reload that changes it says so in the
//! report and the log, and applies the rest.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::config::NodeConfig;
use super::state::Node;
use crate::core::cost::CostModel;
use crate::replicas::entry::ReplicaConfig;

/// What a reload did.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct ReloadReport {
    /// Replicas registered.
    pub added: Vec<String>,
    /// Replicas whose settings changed.
    pub updated: Vec<String>,
    /// Replicas no longer configured: they drain.
    pub removed: Vec<String>,
    /// Whether the tenants changed.
    pub tenants: bool,
    /// Whether routing parameters changed.
    pub routing: bool,
    /// Settings that changed but take effect only at restart.
    pub restart_needed: Vec<&'static str>,
}

impl Node {
    /// Applies what a reloaded configuration may change at run time (see the module doc).
    pub fn reload(self: &Arc<Self>, new: &NodeConfig) -> anyhow::Result<ReloadReport> {
        new.validate()?;
        let mut report = ReloadReport {
            restart_needed: restart_needed(&self.cfg, new),
            ..ReloadReport::default()
        };
        self.reload_replicas(new, &mut report)?;
        report.tenants = self.reload_tenants(new);
        self.reload_priorities(new, &mut report);
        self.reload_routing(new, &mut report)?;
        tracing::info!(
            added = report.added.len(),
            updated = report.updated.len(),
            removed = report.removed.len(),
            tenants = report.tenants,
            routing = report.routing,
            "configuration reloaded"
        );
        if !report.restart_needed.is_empty() {
            tracing::warn!(settings = ?report.restart_needed, "changed settings that apply only at restart were left as they are");
        }
        Ok(report)
    }

    /// Diffs the configured replicas by id: new ones register and start their watchers,
    /// changed ones update, missing ones drain.
    fn reload_replicas(
        self: &Arc<Self>,
        new: &NodeConfig,
        report: &mut ReloadReport,
    ) -> anyhow::Result<()> {
        let mut configured = self.configured.lock().unwrap_or_else(|p| p.into_inner());
        let old: HashMap<String, &ReplicaConfig> =
            configured.iter().map(|r| (r.effective_id(), r)).collect();
        let mut fresh = Vec::new();
        for r in &new.replicas {
            let id = r.effective_id();
            match old.get(&id) {
                Some(o) if same_replica(o, r) => {}
                Some(_) => {
                    self.add_configured_replica(r)?;
                    report.updated.push(id);
                }
                None => {
                    let (i, started) = self.add_configured_replica(r)?;
                    if started {
                        fresh.push(i);
                    }
                    report.added.push(id);
                }
            }
        }
        let kept: std::collections::HashSet<String> = new
            .replicas
            .iter()
            .map(ReplicaConfig::effective_id)
            .collect();
        for id in old.keys().filter(|id| !kept.contains(*id)) {
            let index = self.lock().view.index_of(id);
            if let Some(i) = index {
                self.remove_replica(i);
            }
            report.removed.push(id.clone());
        }
        *configured = new.replicas.clone();
        drop(configured);
        if let Some(stop) = self.stop_signal.get() {
            for i in fresh {
                super::watchers::spawn_replica_watchers(self, stop, i);
            }
        }
        Ok(())
    }

    /// Swaps in the new tenants and default tenant; whether either changed. Requests already
    /// routed keep what they hold.
    fn reload_tenants(&self, new: &NodeConfig) -> bool {
        // One lock at a time: the request path reads these apart from the core lock.
        let tenants_changed = {
            let mut cfgs = self.tenant_cfgs.write().unwrap_or_else(|p| p.into_inner());
            let changed = *cfgs != new.tenants;
            *cfgs = new.tenants.clone();
            changed
        } | {
            let mut default = self
                .default_tenant
                .write()
                .unwrap_or_else(|p| p.into_inner());
            let changed = *default != new.default_tenant;
            *default = new.default_tenant.clone();
            changed
        };
        if tenants_changed {
            self.lock()
                .router
                .tenants
                .reconfigure(new.tenants.clone(), new.default_tenant.clone());
        }
        tenants_changed
    }

    /// Priority classes: weights and bounds apply at once; new names, header or default class
    /// need a restart.
    fn reload_priorities(&self, new: &NodeConfig, report: &mut ReloadReport) {
        let (Some(old), Some(new_p)) = (&self.cfg.priorities, &new.priorities) else {
            return;
        };
        if old == new_p {
            return;
        }
        let mut core = self.lock();
        if let Some(q) = core.admission.as_mut() {
            if old.header == new_p.header
                && old.default_class == new_p.default_class
                && q.set_classes(new_p.classes.clone())
            {
                report.routing = true;
            } else {
                report.restart_needed.push("priorities");
            }
        }
    }

    /// Routing parameters: the cost model's weights, `spill_after_s`, the overlay TTL and the
    /// policy (fresh policy state when it changes).
    fn reload_routing(&self, new: &NodeConfig, report: &mut ReloadReport) -> anyhow::Result<()> {
        let mut core = self.lock();
        let cost = CostModel {
            w_load_s: new.w_load_s,
            affinity_credit_s: new.affinity_credit_s,
            tier_weights: new.tier_weights,
            fetch: new.kv_fetch,
        };
        let rc = core.router.config();
        let ttl = Duration::from_secs(new.overlay_ttl_s);
        let policy = new.policy_kind()?;
        if rc.spill_after_s != new.spill_after_s || rc.cost != cost || core.view.overlay_ttl != ttl
        {
            core.router.set_params(new.spill_after_s, cost);
            core.view.overlay_ttl = ttl;
            report.routing = true;
        }
        if core.router.config().policy != policy {
            core.router.set_policy(policy);
            self.policy.store(
                super::state::policy_index(policy),
                std::sync::atomic::Ordering::Relaxed,
            );
            tracing::info!(policy = policy.as_str(), "routing policy switched");
            report.routing = true;
        }
        Ok(())
    }
}

/// Whether two replica entries configure the same thing.
fn same_replica(a: &ReplicaConfig, b: &ReplicaConfig) -> bool {
    a.url == b.url
        && a.region == b.region
        && a.zone == b.zone
        && a.pool == b.pool
        && a.models == b.models
        && a.capacity_tokens == b.capacity_tokens
        && a.prefill_tokens_per_s == b.prefill_tokens_per_s
        && a.max_in_flight == b.max_in_flight
        && a.pd() == b.pd()
        && a.kv_events == b.kv_events
        && a.kv_load == b.kv_load
}

/// The settings read only at start that differ between `old` and `new`.
fn restart_needed(old: &NodeConfig, new: &NodeConfig) -> Vec<&'static str> {
    let changed = [
        ("listen", old.listen != new.listen),
        ("region", old.region != new.region),
        ("zone", old.zone != new.zone),
        ("cluster_id", old.cluster_id != new.cluster_id),
        ("seed", old.seed != new.seed),
        ("block_bytes", old.block_bytes != new.block_bytes),
        ("max_body_bytes", old.max_body_bytes != new.max_body_bytes),
        ("debug_headers", old.debug_headers != new.debug_headers),
        ("admin_token", old.admin_token != new.admin_token),
        ("session_header", old.session_header != new.session_header),
        (
            "affinity_header",
            old.affinity_header != new.affinity_header,
        ),
        ("tenant_header", old.tenant_header != new.tenant_header),
        ("cache_ttl_s", old.cache_ttl_s != new.cache_ttl_s),
        (
            "summary_interval_ms",
            old.summary_interval_ms != new.summary_interval_ms,
        ),
        ("drain_s", old.drain_s != new.drain_s),
        ("server", old.server != new.server),
        ("auth", old.auth != new.auth),
        ("timeouts", old.timeouts != new.timeouts),
        ("retry", old.retry != new.retry),
        ("health", old.health != new.health),
        ("scrape", old.scrape != new.scrape),
        ("dns", old.dns != new.dns),
        ("kubernetes", old.kubernetes != new.kubernetes),
        ("mesh", old.mesh != new.mesh),
        ("tokenizer", old.tokenizer != new.tokenizer),
        ("tracing", old.tracing != new.tracing),
        ("pd", old.pd != new.pd),
        ("hot_prefix", old.hot_prefix != new.hot_prefix),
        ("remote_prefix", old.remote_prefix != new.remote_prefix),
        (
            "priorities",
            old.priorities.is_some() != new.priorities.is_some(),
        ),
    ];
    changed
        .into_iter()
        .filter_map(|(name, differs)| differs.then_some(name))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::tenants::TenantConfig;

    fn cfg(replicas: &[(&str, &str)]) -> NodeConfig {
        let mut c = NodeConfig {
            region: "eu".into(),
            ..NodeConfig::default()
        };
        c.replicas = replicas
            .iter()
            .map(|(id, pool)| ReplicaConfig {
                id: Some((*id).into()),
                pool: (*pool).into(),
                ..ReplicaConfig::from_url(format!("http://10.0.0.5:80{}", id.len()))
            })
            .collect();
        c
    }

    #[test]
    fn a_reload_registers_updates_and_drains_replicas_and_says_what_needs_a_restart() {
        crate::proxy::install_crypto_provider();
        let old = cfg(&[("a", "p"), ("bb", "p")]);
        let node = Node::new(old.clone()).unwrap();
        let same = node.reload(&old).unwrap();
        assert_eq!(
            same,
            ReloadReport::default(),
            "an unchanged file changes nothing"
        );

        let mut new = cfg(&[("a", "q"), ("ccc", "p")]);
        new.tenants.insert("acme".into(), TenantConfig::default());
        new.spill_after_s = 3.0;
        new.policy = "round-robin".into();
        let r = node.reload(&new).unwrap();
        assert_eq!(r.added, vec!["ccc"]);
        assert_eq!(r.updated, vec!["a"]);
        assert_eq!(r.removed, vec!["bb"]);
        assert!(r.tenants && r.routing);
        assert!(r.restart_needed.is_empty(), "{:?}", r.restart_needed);
        assert_eq!(node.policy(), crate::core::policy::PolicyKind::RoundRobin);
        let core = node.lock();
        let pool = |id: &str| {
            let i = core.view.index_of(id).unwrap();
            (
                core.view.replica(i).unwrap().info.pool.clone(),
                core.replicas[i].removed,
            )
        };
        assert_eq!(pool("a"), ("q".to_owned(), false));
        assert_eq!(
            pool("bb"),
            ("p".to_owned(), true),
            "a replica left out drains"
        );
        assert_eq!(pool("ccc"), ("p".to_owned(), false));
        assert_eq!(core.router.config().spill_after_s, 3.0);
        assert_eq!(
            core.router.config().policy,
            crate::core::policy::PolicyKind::RoundRobin
        );
        drop(core);
        // What only a restart applies is named, and the rest still applies.
        let mut later = new.clone();
        later.block_bytes = 512;
        later.spill_after_s = 4.0;
        let r = node.reload(&later).unwrap();
        assert_eq!(r.restart_needed, vec!["block_bytes"]);
        assert!(r.routing);
        later.block_bytes = new.block_bytes;
        // The same id at a new URL: new requests go to the new one.
        let mut moved = later.clone();
        moved.replicas[0].url = "http://10.0.0.9:8000".into();
        assert_eq!(node.reload(&moved).unwrap().updated, vec!["a"]);
        let i = node.lock().view.index_of("a").unwrap();
        assert_eq!(&*node.endpoint(i).unwrap().base, "http://10.0.0.9:8000");
        // An invalid file is refused whole.
        let mut bad = moved.clone();
        bad.block_bytes = 0;
        assert!(node.reload(&bad).is_err());
    }

    #[test]
    fn a_reload_changes_class_weights_and_bounds_but_not_class_names() {
        use crate::core::priority::PrioritiesConfig;
        crate::proxy::install_crypto_provider();
        let mut old = cfg(&[("a", "p")]);
        old.priorities = Some(PrioritiesConfig::default());
        let node = Node::new(old.clone()).unwrap();
        let mut new = old.clone();
        if let Some(p) = new.priorities.as_mut() {
            p.classes[2].max_queue = 7;
        }
        let r = node.reload(&new).unwrap();
        assert!(r.routing && r.restart_needed.is_empty(), "{r:?}");
        let max_queue = |n: &Node| {
            n.lock()
                .admission
                .as_ref()
                .map(|q| q.classes()[2].max_queue)
        };
        assert_eq!(max_queue(&node), Some(7));
        // Renamed classes would renumber waiting requests: they wait for a restart.
        let mut renamed = new.clone();
        if let Some(p) = renamed.priorities.as_mut() {
            p.classes[2].name = "bulk".into();
        }
        let r = node.reload(&renamed).unwrap();
        assert_eq!(r.restart_needed, vec!["priorities"]);
        assert_eq!(max_queue(&node), Some(7));
        // Turning the queue on or off is a restart too.
        let r = node.reload(&cfg(&[("a", "p")])).unwrap();
        assert_eq!(r.restart_needed, vec!["priorities"]);
    }
}
