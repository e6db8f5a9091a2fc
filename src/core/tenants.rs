//! Tenants: who may use which replicas, how much, and whether their cache is private.
//!
//! A tenant's tier lists pools in order (dedicated first, shared after); the router takes the
//! first pool that has a replica the tenant may still use. Quotas are counted in requests in
//! flight through this node: per replica (so one tenant cannot fill a replica's batch) and as a
//! share of the cluster's in-flight slots. An isolated tenant gets its own key namespace, so no
//! other tenant's request can be routed by (or reveal) its cached prompts.

use std::collections::HashMap;

use serde::Deserialize;

/// One tenant's policy.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// Own key namespace (no cache sharing with other tenants). Default false.
    #[serde(default)]
    pub isolated: bool,
    /// Pools in preference order; empty means every pool. Default empty.
    #[serde(default)]
    pub pools: Vec<String>,
    /// Most requests in flight on one replica. Default: no cap.
    #[serde(default)]
    pub max_in_flight_per_replica: Option<u32>,
    /// Largest share (0..1] of the cluster's in-flight slots (sum of replicas' `max_in_flight`).
    /// Default: no cap.
    #[serde(default)]
    pub max_cluster_share: Option<f64>,
}

/// Tenant policies and this node's in-flight counts per tenant.
#[derive(Clone, Debug, Default)]
pub struct Tenants {
    configs: HashMap<String, TenantConfig>,
    default: TenantConfig,
    /// tenant → (replica index → in flight, total in flight).
    usage: HashMap<String, (HashMap<usize, u32>, u32)>,
    /// tenant → in flight at the other nodes (their gossiped `inflight` records), for
    /// tenants with a cluster share.
    peer_usage: HashMap<String, u32>,
}

impl Tenants {
    /// Tenants with their configs; unknown tenants get `default`.
    pub fn new(configs: HashMap<String, TenantConfig>, default: TenantConfig) -> Self {
        Tenants {
            configs,
            default,
            usage: HashMap::new(),
            peer_usage: HashMap::new(),
        }
    }

    /// Replaces the policies (a configuration reload); the in-flight counts stay, so requests
    /// routed under the old quotas still release what they hold. A lowered quota only stops
    /// new requests.
    pub fn reconfigure(&mut self, configs: HashMap<String, TenantConfig>, default: TenantConfig) {
        self.configs = configs;
        self.default = default;
        // Peer counts of tenants no longer shared are dropped with their names.
        self.peer_usage.retain(|t, _| self.configs.contains_key(t));
    }

    /// The config of `tenant` (the default for unknown or absent tenants).
    pub fn config(&self, tenant: Option<&str>) -> &TenantConfig {
        tenant
            .and_then(|t| self.configs.get(t))
            .unwrap_or(&self.default)
    }

    /// In-flight requests of `tenant` on replica `i`.
    pub fn in_flight(&self, tenant: &str, i: usize) -> u32 {
        self.usage
            .get(tenant)
            .and_then(|(m, _)| m.get(&i))
            .copied()
            .unwrap_or(0)
    }

    /// In-flight requests of `tenant` everywhere.
    pub fn total_in_flight(&self, tenant: &str) -> u32 {
        self.usage.get(tenant).map_or(0, |(_, t)| *t)
    }

    /// Whether `tenant` may send one more request to replica `i`.
    pub fn replica_allows(&self, tenant: Option<&str>, i: usize) -> bool {
        let (Some(t), Some(cap)) = (tenant, self.config(tenant).max_in_flight_per_replica) else {
            return true;
        };
        self.in_flight(t, i) < cap
    }

    /// Whether `tenant` may send one more request given `cluster_slots` in-flight slots in all:
    /// its requests here and at the other nodes stay under its share.
    pub fn cluster_allows(&self, tenant: Option<&str>, cluster_slots: u64) -> bool {
        let (Some(t), Some(share)) = (tenant, self.config(tenant).max_cluster_share) else {
            return true;
        };
        let peers = self.peer_usage.get(t).copied().unwrap_or(0);
        let held = u64::from(self.total_in_flight(t)) + u64::from(peers);
        (held as f64) < share * cluster_slots as f64
    }

    /// This node's in-flight counts of the tenants that have a cluster share, for gossip.
    pub fn shared_usage(&self) -> impl Iterator<Item = (&str, u32)> + '_ {
        self.usage
            .iter()
            .filter(|(t, _)| {
                self.configs
                    .get(*t)
                    .is_some_and(|c| c.max_cluster_share.is_some())
            })
            .map(|(t, (_, total))| (t.as_str(), *total))
    }

    /// The other nodes' in-flight counts per tenant (replaces the previous ones).
    pub fn set_peer_usage(&mut self, usage: HashMap<String, u32>) {
        self.peer_usage = usage;
    }

    /// A request of `tenant` started on replica `i`.
    pub fn started(&mut self, tenant: &str, i: usize) {
        let (m, total) = self.usage.entry(tenant.to_owned()).or_default();
        *m.entry(i).or_default() += 1;
        *total += 1;
    }

    /// A request of `tenant` on replica `i` finished.
    pub fn finished(&mut self, tenant: &str, i: usize) {
        if let Some((m, total)) = self.usage.get_mut(tenant) {
            if let Some(c) = m.get_mut(&i) {
                *c = c.saturating_sub(1);
                *total = total.saturating_sub(1);
                if *c == 0 {
                    m.remove(&i);
                }
            }
            if *total == 0 {
                self.usage.remove(tenant);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reconfigured_quota_applies_to_new_requests_and_keeps_the_counts() {
        let capped = |n| TenantConfig {
            max_in_flight_per_replica: Some(n),
            ..Default::default()
        };
        let mut t = Tenants::new(
            HashMap::from([("acme".to_owned(), capped(1))]),
            TenantConfig::default(),
        );
        t.started("acme", 0);
        assert!(!t.replica_allows(Some("acme"), 0));
        t.reconfigure(
            HashMap::from([("acme".to_owned(), capped(2))]),
            TenantConfig::default(),
        );
        assert_eq!(t.in_flight("acme", 0), 1, "a reload forgets no request");
        assert!(t.replica_allows(Some("acme"), 0));
        t.started("acme", 0);
        assert!(!t.replica_allows(Some("acme"), 0));
        // Dropped from the config: the default (no cap) applies; releases still balance.
        t.reconfigure(HashMap::new(), TenantConfig::default());
        assert!(t.replica_allows(Some("acme"), 0));
        t.finished("acme", 0);
        t.finished("acme", 0);
        assert_eq!(t.total_in_flight("acme"), 0);
    }

    #[test]
    fn quotas_count_in_flight() {
        let acme = TenantConfig {
            max_in_flight_per_replica: Some(2),
            max_cluster_share: Some(0.5),
            ..Default::default()
        };
        let mut t = Tenants::new(
            HashMap::from([("acme".to_owned(), acme)]),
            TenantConfig::default(),
        );
        assert!(t.replica_allows(Some("acme"), 0));
        t.started("acme", 0);
        t.started("acme", 0);
        assert!(!t.replica_allows(Some("acme"), 0));
        assert!(t.replica_allows(Some("acme"), 1));
        assert!(
            !t.cluster_allows(Some("acme"), 4),
            "2 of 4 slots is the 50% share"
        );
        assert!(t.cluster_allows(Some("acme"), 5));
        assert!(t.replica_allows(Some("other"), 0) && t.replica_allows(None, 0));
        t.finished("acme", 0);
        assert!(t.replica_allows(Some("acme"), 0));
        t.finished("acme", 0);
        t.finished("acme", 0);
        assert_eq!(t.total_in_flight("acme"), 0);
    }

    #[test]
    fn a_cluster_share_counts_the_other_nodes_requests() {
        let acme = TenantConfig {
            max_cluster_share: Some(0.5),
            ..Default::default()
        };
        let mut t = Tenants::new(
            HashMap::from([("acme".to_owned(), acme)]),
            TenantConfig::default(),
        );
        t.started("acme", 0);
        t.started("beta", 0);
        assert!(
            t.cluster_allows(Some("acme"), 4),
            "1 of the 2 slots acme may hold"
        );
        // Another node holds one more: the share is full everywhere.
        t.set_peer_usage(HashMap::from([("acme".to_owned(), 1)]));
        assert!(!t.cluster_allows(Some("acme"), 4));
        // Only tenants with a cluster share are gossiped.
        let shared: Vec<_> = t.shared_usage().collect();
        assert_eq!(shared, vec![("acme", 1)]);
    }
}
