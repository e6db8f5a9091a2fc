//! Operator commands at run time: add, drain and remove replicas without a restart, on this
//! node and, through `admin:<id>` gossip records (`mesh/admin.rs`), on every node of its region.
//!
//! Exists because fleets change while routers run (a replica goes down for maintenance, a new
//! one comes up) and operators of peer routers expect to say so to any node. The rules:
//! - `add` registers the replica as if configured here (or updates it, and ends a drain);
//! - `drain` takes it out of routing; requests in flight finish; it stays listed as draining;
//! - `remove` drains it and then drops it from the registry (a tombstone, `registry.rs`).
//!
//! A drain outlives the replica's other sources: a DNS answer or a learned record that brings
//! it back leaves it draining until an `add`. Every node applies the newest command per replica
//! (later stamp, then larger node id), its own and its region's peers' alike; peers' adds pass
//! the learned-replica allow-list. A peer's drain lasts only while that peer is a live member
//! publishing it: a member that leaves (or a rogue one that is thrown out) takes its drains
//! with it, so they cannot hold a region's capacity after their author's authority is gone.
//! Commands live in memory: a node restarted alone takes them back from its peers' records, a
//! whole region restarted starts from its configuration files.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::learned::LearnPolicy;
use super::state::Node;
use crate::core::view::Health;
use crate::mesh::admin::{self, AdminOp, AdminRecord, AdminSpec, MAX_ADMIN_MODELS};
use crate::mesh::schema::WirePd;
use crate::mesh::Member;
use crate::replicas::entry::ReplicaConfig;

/// Most replica ids whose last applied command is remembered; past it, ids no live member
/// publishes a command for are forgotten.
const MAX_APPLIED: usize = 16_384;

/// Why a command was refused (the admin API's 4xx).
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// No replica with that id is registered here.
    #[error("no replica {0:?} on this node")]
    NotFound(String),
    /// The replica belongs to another region: its nodes take commands for it.
    #[error("replica {id:?} is in region {region:?}; send the command to a node there")]
    OtherRegion {
        /// Replica id.
        id: String,
        /// Its region.
        region: String,
    },
    /// The replica's description is invalid.
    #[error("{0}")]
    Invalid(String),
}

/// What a command did.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct AdminOutcome {
    /// Replica id.
    pub id: String,
    /// The command applied.
    pub op: String,
    /// Requests in flight to it through this node now.
    pub in_flight: u32,
    /// Whether it is new to this node.
    pub new: bool,
}

/// One replica as `GET /admin/replicas` lists it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct AdminReplica {
    /// Replica id.
    pub id: String,
    /// Base URL.
    pub url: String,
    /// Region.
    pub region: String,
    /// Pool.
    pub pool: String,
    /// Disaggregation role: `prefill`, `decode` or `both` (absent from older nodes: `both`).
    #[serde(default = "both")]
    pub role: String,
    /// Models it serves (configured, or discovered by health checks).
    pub models: Vec<String>,
    /// `healthy`, `unhealthy` or `draining`.
    pub health: String,
    /// Drained by an operator command.
    pub drained: bool,
    /// Out of the registry (removed, or its source no longer lists it).
    pub removed: bool,
    /// Requests in flight through this node.
    pub in_flight: u32,
    /// Requests in flight through the region's other nodes (their load updates).
    pub peer_in_flight: u32,
    /// Known from a peer's gossip only.
    pub learned: bool,
}

fn both() -> String {
    "both".into()
}

impl Node {
    /// Takes an operator command for replica `id` (`spec` with [`AdminOp::Add`]), applies it
    /// here and queues its record for the region's other nodes.
    pub fn admin_command(
        self: &Arc<Self>,
        op: AdminOp,
        id: &str,
        spec: Option<&ReplicaConfig>,
    ) -> Result<AdminOutcome, AdminError> {
        let local = self.cfg.region.clone();
        let wire = match (op, spec) {
            (AdminOp::Add, Some(r)) => {
                super::config::validate_replica("replica", r)
                    .map_err(|e| AdminError::Invalid(e.to_string()))?;
                if let Some(region) = r.region.as_ref().filter(|g| **g != local) {
                    return Err(AdminError::OtherRegion {
                        id: id.to_owned(),
                        region: region.clone(),
                    });
                }
                Some(to_spec(r)?)
            }
            (AdminOp::Add, None) => {
                return Err(AdminError::Invalid("add needs the replica's url".into()));
            }
            _ => {
                let core = self.lock();
                let i = core
                    .view
                    .index_of(id)
                    .ok_or_else(|| AdminError::NotFound(id.to_owned()))?;
                let region = core.view.replica(i).map(|r| r.info.region.clone());
                if let Some(region) = region.filter(|g| *g != local) {
                    return Err(AdminError::OtherRegion {
                        id: id.to_owned(),
                        region,
                    });
                }
                None
            }
        };
        let new = self.apply_admin(op, id, spec, None)?;
        let self_id = self.self_node_id();
        {
            let mut book = self.admin.lock().unwrap_or_else(|p| p.into_inner());
            let stamp = now_ms().max(book.applied.get(id).map_or(0, |(s, _)| s + 1));
            book.applied
                .insert(id.to_owned(), (stamp, self_id.to_owned()));
            // This node's own command now holds the replica, whoever drained it before.
            book.peer_drains.remove(id);
            let record = AdminRecord {
                stamp_ms: stamp,
                op,
                spec: wire,
            };
            // Only a mesh node publishes (its sync loop empties the outbox); `to_spec` checked
            // that the record encodes. The outbox keeps one entry per replica: the latest.
            if self.cfg.mesh.is_some() {
                book.own.insert(id.to_owned(), record.clone());
                book.outbox.retain(|(k, _)| k != id);
                book.outbox.push((id.to_owned(), Some(record)));
                while book.own.len() > admin::MAX_ADMIN_RECORDS {
                    let oldest = book
                        .own
                        .iter()
                        .min_by_key(|(_, r)| r.stamp_ms)
                        .map(|(k, _)| k.clone());
                    let Some(oldest) = oldest else { break };
                    book.own.remove(&oldest);
                    book.outbox.retain(|(k, _)| *k != oldest);
                    book.outbox.push((oldest, None));
                }
            }
        }
        self.mesh_slot().changed.notify_one();
        tracing::info!(replica = %id, op = op.as_str(), "operator command applied");
        Ok(AdminOutcome {
            id: id.to_owned(),
            op: op.as_str().to_owned(),
            in_flight: self.replica_in_flight(id),
            new,
        })
    }

    /// Applies `op` to replica `id` here, taken here (`by` = `None`) or from region peer `by`'s
    /// record; returns whether it is new to this node (its watcher tasks are started once the
    /// node runs).
    fn apply_admin(
        self: &Arc<Self>,
        op: AdminOp,
        id: &str,
        spec: Option<&ReplicaConfig>,
        by: Option<&str>,
    ) -> Result<bool, AdminError> {
        match (op, spec) {
            (AdminOp::Add, Some(r)) => {
                let mut r = r.clone();
                r.id = Some(id.to_owned());
                // Configured here now: it no longer expires with a peer.
                let (i, new) = self
                    .add_configured_replica(&r)
                    .map_err(|e| AdminError::Invalid(format!("{e:#}")))?;
                {
                    let mut core = self.lock();
                    if let Some(rt) = core.replicas.get_mut(i) {
                        rt.admin_drained = false;
                        rt.admin_drained_by = None;
                        let h = rt.effective_health();
                        core.view.set_health(i, h);
                    }
                }
                if new {
                    if let Some(stop) = self.stop_signal.get() {
                        super::watchers::spawn_replica_watchers(self, stop, i);
                    }
                }
                Ok(new)
            }
            (AdminOp::Add, None) => Err(AdminError::Invalid("add needs a spec".into())),
            (AdminOp::Drain | AdminOp::Remove, _) => {
                let i = {
                    let mut core = self.lock();
                    let i = core
                        .view
                        .index_of(id)
                        .ok_or_else(|| AdminError::NotFound(id.to_owned()))?;
                    if let Some(rt) = core.replicas.get_mut(i) {
                        rt.admin_drained = true;
                        rt.admin_drained_by = by.map(str::to_owned);
                    }
                    core.view.set_health(i, Health::Draining);
                    i
                };
                if op == AdminOp::Remove {
                    self.remove_replica(i);
                }
                Ok(false)
            }
        }
    }

    /// Applies the region's peers' newer commands (one gossip round).
    pub(super) fn apply_admin_records(self: &Arc<Self>, live: &[Member], policy: &LearnPolicy) {
        let local = self.cfg.region.as_str();
        let mut newest: BTreeMap<&str, (&AdminRecord, &str)> = BTreeMap::new();
        for m in live
            .iter()
            .filter(|m| !m.is_self && m.region() == Some(local))
        {
            for (id, r) in m.admin.iter() {
                let old = newest.get(id.as_str()).map(|(r, by)| (r.stamp_ms, *by));
                if admin::supersedes(r.stamp_ms, &m.node_id, old) {
                    newest.insert(id, (r, &m.node_id));
                }
            }
        }
        for (id, (record, by)) in newest {
            let due = {
                let book = self.admin.lock().unwrap_or_else(|p| p.into_inner());
                let old = book.applied.get(id).map(|(s, b)| (*s, b.as_str()));
                admin::supersedes(record.stamp_ms, by, old)
            };
            if !due {
                continue;
            }
            let spec = record.spec.as_ref().map(|s| from_spec(id, local, s));
            if let Some(r) = &spec {
                let host = reqwest::Url::parse(&r.url)
                    .ok()
                    .and_then(|u| u.host_str().map(str::to_owned));
                if !host.is_some_and(|h| self.host_allowed(policy, &h)) {
                    tracing::warn!(replica = %id, from = %by, url = %r.url, "operator command ignored: the URL's host is not allowed (mesh.learn_replicas_from)");
                    self.remember_applied(id, record.stamp_ms, by);
                    continue;
                }
            }
            match self.apply_admin(record.op, id, spec.as_ref(), Some(by)) {
                Ok(_) => {
                    tracing::info!(replica = %id, op = record.op.as_str(), from = %by, "operator command from a peer applied");
                    let mut book = self.admin.lock().unwrap_or_else(|p| p.into_inner());
                    if record.op == AdminOp::Drain {
                        book.peer_drains.insert(id.to_owned(), by.to_owned());
                    } else {
                        book.peer_drains.remove(id);
                    }
                }
                // A drain for a replica this node never heard of: nothing to do.
                Err(AdminError::NotFound(_)) => {}
                Err(e) => {
                    tracing::warn!(replica = %id, from = %by, error = %e, "operator command from a peer refused");
                }
            }
            self.remember_applied(id, record.stamp_ms, by);
        }
        self.end_orphaned_drains(live);
        let mut book = self.admin.lock().unwrap_or_else(|p| p.into_inner());
        if book.applied.len() > MAX_APPLIED {
            let published: std::collections::HashSet<&str> = live
                .iter()
                .flat_map(|m| m.admin.keys().map(String::as_str))
                .collect();
            let own: Vec<String> = book.own.keys().cloned().collect();
            book.applied
                .retain(|id, _| published.contains(id.as_str()) || own.contains(id));
        }
    }

    /// Ends the drains of peers that no longer publish them (they left the mesh, or withdrew
    /// the record): the replica returns to its own health, and the command is forgotten, so the
    /// record is applied again should its author return with it.
    fn end_orphaned_drains(&self, live: &[Member]) {
        let orphaned: Vec<String> = {
            let mut book = self.admin.lock().unwrap_or_else(|p| p.into_inner());
            let held = |id: &str, by: &str| {
                live.iter().any(|m| {
                    m.node_id == by && m.admin.get(id).is_some_and(|r| r.op == AdminOp::Drain)
                })
            };
            let gone: Vec<String> = book
                .peer_drains
                .iter()
                .filter(|(id, by)| !held(id, by))
                .map(|(id, _)| id.clone())
                .collect();
            for id in &gone {
                book.peer_drains.remove(id);
                book.applied.remove(id);
            }
            gone
        };
        if orphaned.is_empty() {
            return;
        }
        let mut core = self.lock();
        for id in &orphaned {
            let Some(i) = core.view.index_of(id) else {
                continue;
            };
            let Some(rt) = core.replicas.get_mut(i) else {
                continue;
            };
            rt.admin_drained = false;
            rt.admin_drained_by = None;
            let h = rt.effective_health();
            core.view.set_health(i, h);
            tracing::info!(replica = %id, "a departed member's drain ended");
        }
    }

    fn remember_applied(&self, id: &str, stamp: u64, by: &str) {
        let mut book = self.admin.lock().unwrap_or_else(|p| p.into_inner());
        book.applied.insert(id.to_owned(), (stamp, by.to_owned()));
    }

    /// Own records to publish or withdraw since the last call.
    pub(super) fn take_admin_outbox(&self) -> Vec<(String, Option<AdminRecord>)> {
        let mut book = self.admin.lock().unwrap_or_else(|p| p.into_inner());
        std::mem::take(&mut book.outbox)
    }

    /// Every replica this node knows of in its region, for `GET /admin/replicas`.
    pub fn admin_replicas(&self) -> Vec<AdminReplica> {
        let core = self.lock();
        let local = self.cfg.region.as_str();
        core.replicas
            .iter()
            .enumerate()
            .filter(|(_, rt)| !rt.dropped)
            .filter_map(|(i, rt)| {
                let r = core.view.replica(i)?;
                (r.info.region == local).then(|| AdminReplica {
                    id: r.info.id.clone(),
                    url: r.info.url.clone(),
                    region: r.info.region.clone(),
                    pool: r.info.pool.clone(),
                    role: r.info.pd.role.as_str().to_owned(),
                    models: r.info.models.clone(),
                    health: health_name(r.health).to_owned(),
                    drained: rt.admin_drained,
                    removed: rt.removed,
                    in_flight: r.load.in_flight,
                    peer_in_flight: r.load.peer_in_flight,
                    learned: rt.mesh.learned,
                })
            })
            .collect()
    }

    /// Requests in flight to replica `id` through this node and (by their load updates) the
    /// region's other nodes.
    pub fn replica_in_flight(&self, id: &str) -> u32 {
        let core = self.lock();
        core.view
            .index_of(id)
            .and_then(|i| core.view.replica(i))
            .map_or(0, |r| {
                r.load.in_flight.saturating_add(r.load.peer_in_flight)
            })
    }

    /// This node's mesh id, or "" without a mesh.
    fn self_node_id(&self) -> &str {
        self.cfg.mesh.as_ref().map_or("", |m| m.node_id.as_str())
    }
}

fn health_name(h: Health) -> &'static str {
    match h {
        Health::Healthy => "healthy",
        Health::Unhealthy => "unhealthy",
        Health::Draining => "draining",
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The gossiped facts of a replica added here; refuses what peers could not take the same way.
fn to_spec(r: &ReplicaConfig) -> Result<AdminSpec, AdminError> {
    if r.models.len() > MAX_ADMIN_MODELS {
        return Err(AdminError::Invalid(format!(
            "at most {MAX_ADMIN_MODELS} models (leave them out to discover them)"
        )));
    }
    let kv_events = match &r.kv_events {
        None => None,
        Some(k) => Some(super::kv_gossip::to_wire(&r.url, k).ok_or_else(|| {
            AdminError::Invalid(
                "kv_events endpoints must be tcp://<the replica URL's host>:<port> so every node of the region can follow them".into(),
            )
        })?),
    };
    let spec = AdminSpec {
        url: r.url.clone(),
        zone: r.zone.clone(),
        pool: r.pool.clone(),
        models: r.models.clone(),
        capacity_tokens: r.capacity_tokens,
        prefill_tokens_per_s: r.prefill_tokens_per_s,
        max_in_flight: r.max_in_flight,
        kv_events,
        pd: WirePd::of(&r.pd()),
        kv_load: r.kv_load,
    };
    let check = AdminRecord {
        stamp_ms: 0,
        op: AdminOp::Add,
        spec: Some(spec),
    };
    check
        .encode()
        .map_err(|e| AdminError::Invalid(format!("too large to share with the mesh: {e}")))?;
    check
        .spec
        .ok_or_else(|| AdminError::Invalid("no spec".into()))
}

/// A peer's added replica as this node's registry takes it.
fn from_spec(id: &str, region: &str, s: &AdminSpec) -> ReplicaConfig {
    ReplicaConfig {
        url: s.url.clone(),
        id: Some(id.to_owned()),
        region: Some(region.to_owned()),
        zone: s.zone.clone(),
        pool: s.pool.clone(),
        models: s.models.clone(),
        capacity_tokens: s.capacity_tokens,
        prefill_tokens_per_s: s.prefill_tokens_per_s,
        prefill_attention_ms_per_pair: crate::core::view::DEFAULT_PREFILL_ATTENTION_MS_PER_PAIR,
        max_in_flight: s.max_in_flight,
        role: s.pd.as_ref().map(|p| p.role).unwrap_or_default(),
        bootstrap_port: s.pd.as_ref().and_then(|p| p.bootstrap_port),
        engine_id: s
            .pd
            .as_ref()
            .map(|p| p.engine_id.clone())
            .unwrap_or_default(),
        kv_events: s
            .kv_events
            .as_ref()
            .and_then(|k| super::kv_gossip::from_wire(&s.url, k)),
        kv_load: s.kv_load.filter(|l| l.validate().is_ok()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::config::{MeshSection, NodeConfig};

    fn node() -> Arc<Node> {
        crate::proxy::install_crypto_provider();
        let mut cfg = NodeConfig {
            region: "eu".into(),
            ..NodeConfig::default()
        };
        cfg.replicas = vec![ReplicaConfig {
            id: Some("own".into()),
            models: vec!["m".into()],
            ..ReplicaConfig::from_url("http://10.0.0.5:8000".to_owned())
        }];
        cfg.mesh = Some(MeshSection {
            node_id: "a".into(),
            listen: "10.0.0.1:7946".parse().unwrap(),
            certs_dir: Some("/nonexistent".into()),
            ..MeshSection::default()
        });
        Node::new(cfg).unwrap()
    }

    /// A region member publishing `drains` as `admin:` drain records.
    fn member(id: &str, port: u16, is_self: bool, drains: &[&str]) -> Member {
        let stamp_ms = now_ms();
        let admin = drains
            .iter()
            .map(|r| {
                let record = AdminRecord {
                    stamp_ms,
                    op: AdminOp::Drain,
                    spec: None,
                };
                ((*r).to_owned(), record)
            })
            .collect();
        Member {
            admin: Arc::new(admin),
            ..Member::for_test(id, port, is_self)
        }
    }

    /// Issue #35: a member's drains held every replica of the region after it left. A peer's
    /// drain now lasts while that peer is live and publishes it; an operator's own drain here
    /// is not touched by peers leaving.
    #[test]
    fn a_peers_drain_ends_when_the_peer_leaves_or_withdraws_it() {
        let n = node();
        let policy = LearnPolicy::of(&n);
        let health = || n.admin_replicas()[0].health.clone();
        let me = member("a", 7000, true, &[]);
        let rogue = member("z", 7001, false, &["own"]);
        n.apply_admin_records(&[me.clone(), rogue.clone()], &policy);
        assert_eq!(health(), "draining");
        // Still published: it holds, round after round.
        n.apply_admin_records(&[me.clone(), rogue.clone()], &policy);
        assert_eq!(health(), "draining");
        // The member leaves: the drain ends with it.
        n.apply_admin_records(std::slice::from_ref(&me), &policy);
        assert_eq!(health(), "healthy");
        // It comes back with the same record: applied again; then it withdraws it: ended.
        n.apply_admin_records(&[me.clone(), rogue.clone()], &policy);
        assert_eq!(health(), "draining");
        let withdrawn = member("z", 7001, false, &[]);
        n.apply_admin_records(&[me.clone(), withdrawn], &policy);
        assert_eq!(health(), "healthy");
        // This node's own drain is the operator's word here: peers leaving do not end it.
        n.admin_command(AdminOp::Drain, "own", None).unwrap();
        n.apply_admin_records(std::slice::from_ref(&me), &policy);
        assert_eq!(health(), "draining");
    }
}
