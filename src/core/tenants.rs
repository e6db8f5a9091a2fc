//! Tenants: who may use which replicas, how much, and whether their cache is private.
//!
//! A tenant's tier lists pools in order (dedicated first, shared after); the router takes the
//! first pool that has a replica the tenant may still use. Quotas are counted in requests in
//! flight through this node: per replica (so one tenant cannot fill a replica's batch) and as a
//! share of the cluster's in-flight slots. An isolated tenant gets its own key namespace, so no
//! other tenant's request can be routed by (or reveal) its cached prompts.
//!
//! KV occupancy quotas (`max_kv_share`) bound a tenant's share of each replica's prefix cache,
//! so one tenant's traffic cannot flush the others' cached prompts. The cache model attributes
//! each live block to a *KV slot* (`cache_model.rs`): one per tenant with a `max_kv_share`
//! ([`Tenants::kv_slot`]), one for every other tenant ([`KV_OTHER`]) and one for blocks whose
//! tenant is unknown ([`KV_UNATTRIBUTED`]: handovers, KV events no routed request matched).
//! Slots are few and fixed ([`KV_SLOTS`]) because tenant names come from clients: a name only
//! gets a slot from the configuration, never from a request. The router steers on
//! these shares (`router.rs`); a quota never rejects a request.
//!
//! In a mesh every node must steer on one estimate per replica, or each node confines a big
//! tenant to a different replica and flushes several instead of one. So block reports carry
//! the tenant's label ([`Tenants::kv_label`]) and the replica's home, whose model then sees
//! every node's routing, publishes the quota tenants' shares in the replica's gossip record;
//! the other nodes steer on those (`node::routing`).

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
    /// Largest share (0..=1) of any one replica's KV cache the tenant's blocks may hold: a
    /// replica where it would hold that much with a request's new blocks takes none of its
    /// requests while another candidate stays under the share (see `router.rs`). Never
    /// rejects. Default: no cap.
    #[serde(default)]
    pub max_kv_share: Option<f64>,
    /// Priority class of its requests (`[priorities]`, see `priority.rs`). Default: the
    /// `priorities.default_class`.
    #[serde(default)]
    pub priority: Option<String>,
    /// Highest class the priority header may ask for its requests. Default: its `priority`
    /// (a header can only lower it).
    #[serde(default)]
    pub max_priority: Option<String>,
    /// Its share of freed slots against other tenants waiting in the same class, in
    /// [0.01, 1000] (`admission.rs`). Default 1.
    #[serde(default)]
    pub weight: Option<f64>,
}

/// KV slots a cache model tracks: [`KV_UNATTRIBUTED`], [`KV_OTHER`], then one per tenant with
/// a `max_kv_share` (at most `KV_SLOTS - 2` of them; more are refused by the config check and,
/// past the cap, share [`KV_OTHER`], unenforced).
pub const KV_SLOTS: usize = 64;
/// Blocks whose tenant is unknown: a report that names none (a handover, an older node), an
/// exact model's engine stored them and no routed request claimed them.
pub const KV_UNATTRIBUTED: u8 = 0;
/// Blocks of requests from tenants without a `max_kv_share` (or with no tenant).
pub const KV_OTHER: u8 = 1;

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
    /// Tenants with a KV share, by slot − 2. Append-only (a reload never renumbers a slot the
    /// cache models' counts refer to), at most `KV_SLOTS - 2`.
    kv_names: Vec<String>,
    /// tenant → (its KV slot, its `max_kv_share`), for tenants configured with one now.
    kv_quota: HashMap<String, (u8, f64)>,
}

impl Tenants {
    /// Tenants with their configs; unknown tenants get `default`.
    pub fn new(configs: HashMap<String, TenantConfig>, default: TenantConfig) -> Self {
        let mut t = Tenants {
            configs,
            default,
            usage: HashMap::new(),
            peer_usage: HashMap::new(),
            kv_names: Vec::new(),
            kv_quota: HashMap::new(),
        };
        t.assign_kv_slots();
        t
    }

    /// Gives each tenant configured with a `max_kv_share` a KV slot: its old one, else the next
    /// free one, in name order (so every node and simulator run numbers them alike).
    fn assign_kv_slots(&mut self) {
        let mut named: Vec<(&String, f64)> = self
            .configs
            .iter()
            .filter_map(|(n, c)| c.max_kv_share.map(|s| (n, s)))
            .collect();
        named.sort_by(|a, b| a.0.cmp(b.0));
        self.kv_quota.clear();
        for (name, share) in named {
            let slot = match self.kv_names.iter().position(|n| n == name) {
                Some(p) => p,
                None if self.kv_names.len() < KV_SLOTS - 2 => {
                    self.kv_names.push(name.clone());
                    self.kv_names.len() - 1
                }
                None => {
                    tracing::warn!(tenant = %name, "more tenants with max_kv_share than KV slots: unenforced");
                    continue;
                }
            };
            // At most KV_SLOTS − 2 names, so the slot fits a u8.
            self.kv_quota
                .insert(name.clone(), ((slot + 2) as u8, share.clamp(0.0, 1.0)));
        }
    }

    /// The KV slot a block routed for `tenant` is attributed to: its own when it has a
    /// `max_kv_share`, else [`KV_OTHER`].
    pub fn kv_slot(&self, tenant: Option<&str>) -> u8 {
        self.kv_quota(tenant).map_or(KV_OTHER, |(slot, _)| slot)
    }

    /// `tenant`'s KV slot and `max_kv_share`, when it has one.
    pub fn kv_quota(&self, tenant: Option<&str>) -> Option<(u8, f64)> {
        if self.kv_quota.is_empty() {
            return None;
        }
        tenant.and_then(|t| self.kv_quota.get(t)).copied()
    }

    /// Whether any tenant has a `max_kv_share` (else nobody needs the shares).
    pub fn any_kv_quota(&self) -> bool {
        !self.kv_quota.is_empty()
    }

    /// What a block report for a request of `tenant` says of whose blocks they are, so that
    /// the replica's home attributes them as this node would: `None` when no tenant has a KV
    /// quota (nobody needs to know), `""` for a tenant without one, else its name. The home
    /// maps the label back with [`Tenants::kv_slot_of_label`].
    pub fn kv_label<'a>(&self, tenant: Option<&'a str>) -> Option<&'a str> {
        if !self.any_kv_quota() {
            return None;
        }
        match tenant {
            Some(t) if self.kv_quota.contains_key(t) => Some(t),
            _ => Some(""),
        }
    }

    /// The KV slot of a block report's label ([`Tenants::kv_label`]): [`KV_UNATTRIBUTED`] for
    /// none (a handover, an older node), else the named tenant's slot here ([`KV_OTHER`] for
    /// `""` and for names without a quota in this node's configuration).
    pub fn kv_slot_of_label(&self, label: Option<&str>) -> u8 {
        match label {
            None => KV_UNATTRIBUTED,
            Some(t) => self.kv_slot(Some(t)),
        }
    }

    /// The tenants with a `max_kv_share` and their KV slots (what a home publishes shares of).
    pub fn kv_quota_tenants(&self) -> impl Iterator<Item = (&str, u8)> + '_ {
        self.kv_quota
            .iter()
            .map(|(t, (slot, _))| (t.as_str(), *slot))
    }

    /// Replaces the policies (a configuration reload); the in-flight counts stay, so requests
    /// routed under the old quotas still release what they hold. A lowered quota only stops
    /// new requests.
    pub fn reconfigure(&mut self, configs: HashMap<String, TenantConfig>, default: TenantConfig) {
        self.configs = configs;
        self.default = default;
        // Peer counts of tenants no longer shared are dropped with their names.
        self.peer_usage.retain(|t, _| self.configs.contains_key(t));
        self.assign_kv_slots();
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
    fn kv_slots_come_from_the_config_only_and_survive_a_reload() {
        let share = |s| TenantConfig {
            max_kv_share: Some(s),
            ..Default::default()
        };
        let mut t = Tenants::new(
            HashMap::from([
                ("zeta".to_owned(), share(0.5)),
                ("alpha".to_owned(), share(0.25)),
                ("plain".to_owned(), TenantConfig::default()),
            ]),
            TenantConfig::default(),
        );
        // Name order: every node numbers the slots alike.
        assert_eq!(t.kv_quota(Some("alpha")), Some((2, 0.25)));
        assert_eq!(t.kv_quota(Some("zeta")), Some((3, 0.5)));
        assert_eq!(t.kv_slot(Some("plain")), KV_OTHER);
        assert_eq!(t.kv_slot(Some("made-up-by-a-client")), KV_OTHER);
        assert_eq!(t.kv_slot(None), KV_OTHER);
        // Block reports name the quota tenants only; the home maps the label back.
        assert_eq!(t.kv_label(Some("alpha")), Some("alpha"));
        assert_eq!(t.kv_label(Some("plain")), Some(""));
        assert_eq!(t.kv_label(None), Some(""));
        assert_eq!(t.kv_slot_of_label(Some("alpha")), 2);
        assert_eq!(t.kv_slot_of_label(Some("")), KV_OTHER);
        assert_eq!(t.kv_slot_of_label(Some("not-configured-here")), KV_OTHER);
        assert_eq!(t.kv_slot_of_label(None), KV_UNATTRIBUTED);
        let mut named: Vec<_> = t.kv_quota_tenants().collect();
        named.sort();
        assert_eq!(named, vec![("alpha", 2), ("zeta", 3)]);
        // Without any KV quota reports carry no label at all.
        let none = Tenants::new(HashMap::new(), TenantConfig::default());
        assert_eq!(none.kv_label(Some("alpha")), None);
        // A reload drops alpha and adds beta: zeta keeps slot 3, beta gets a new one (the
        // counts of slot 2 may still be alpha's).
        t.reconfigure(
            HashMap::from([
                ("zeta".to_owned(), share(0.75)),
                ("beta".to_owned(), share(2.0)),
            ]),
            TenantConfig::default(),
        );
        assert_eq!(t.kv_quota(Some("zeta")), Some((3, 0.75)));
        assert_eq!(t.kv_quota(Some("beta")), Some((4, 1.0)), "clamped to 1");
        assert_eq!(t.kv_quota(Some("alpha")), None);
        // Slots are bounded: past the cap a tenant goes unenforced rather than growing them.
        let many: HashMap<String, TenantConfig> = (0..KV_SLOTS)
            .map(|i| (format!("t{i:03}"), share(0.5)))
            .collect();
        let t = Tenants::new(many, TenantConfig::default());
        assert_eq!(t.kv_quota(Some("t000")), Some((2, 0.5)));
        assert_eq!(t.kv_quota(Some("t061")), Some((63, 0.5)));
        assert_eq!(t.kv_quota(Some("t062")), None);
    }

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
