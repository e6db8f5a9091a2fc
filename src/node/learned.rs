//! Replicas learned from peers' gossip: who may introduce one, where it may live, how many, and
//! when it goes.
//!
//! Exists because a learned replica gets this node's health checks, scrapes and clients' prompts,
//! so a member must not be able to point the mesh anywhere. A record is learned only when:
//! - its publisher is the replica's rendezvous home (`ReplicaEntry::home`), or this node is the
//!   home and the publisher stands in for a replica in its own configuration (see
//!   `mesh_roles.rs`); otherwise it is ignored (`not_home`);
//! - its URL is http(s) with a host the allow-list admits (`not_allowed`, `bad_url`): this
//!   node's own replicas' hosts (static or DNS-found), loopback when the mesh is on loopback,
//!   and `[mesh] learn_replicas_from` (`mesh/allow.rs`);
//! - no other replica this node knows has the same URL (`same_url`): one engine is one replica
//!   whatever ids a member gives it, so a member cannot multiply one endpoint's share of traffic;
//! - the publisher has introduced fewer than `max_learned_replicas_per_peer` replicas here
//!   (`peer_cap`) and this node holds fewer than `max_learned_replicas` learned ones
//!   (`total_cap`).
//!
//! Each learned replica has an *origin*: the node that has it from its own configuration (the
//! record's `origin`, or its publisher). While the origin is a live member, the replica is kept
//! as long as some live member publishes it (the origin dropping it from its configuration or
//! DNS withdraws it everywhere). When the origin dies, its replicas stay in service under their
//! new rendezvous home, which health-checks and scrapes them like its own: a router's death
//! costs the mesh no engine capacity. They leave only when their own checks fail, or an
//! operator removes them ([`keeps_learned`]); a drained one is dropped (see `registry.rs`).
//! Ignored records are counted once per (replica, publisher, reason) in
//! `kvmesh_mesh_records_ignored_total{reason}`.

use std::collections::HashSet;

use super::state::Node;
use crate::core::view::Health;
use crate::mesh::allow::{self, AllowRule};
use crate::mesh::{Member, ReplicaEntry};
use crate::replicas::entry::ReplicaConfig;
use crate::replicas::health::HealthTracker;

/// Why a peer's replica record was not learned (the metric's `reason`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LearnError {
    /// The publisher is not the replica's home (and this node is not its home either).
    #[error("replica {id}: published by {publisher}, not its home")]
    NotHome {
        /// Replica id.
        id: String,
        /// Publisher's node id.
        publisher: String,
    },
    /// The URL is not an http(s) URL with a host.
    #[error("replica {id}: URL {url:?} is not an http(s) URL with a host")]
    BadUrl {
        /// Replica id.
        id: String,
        /// The URL.
        url: String,
    },
    /// The URL's host is not on the allow-list.
    #[error("replica {id}: host {host:?} is not in mesh.learn_replicas_from nor a host of this node's own replicas")]
    NotAllowed {
        /// Replica id.
        id: String,
        /// The host.
        host: String,
    },
    /// Another replica in the registry has the same URL (one engine, one replica).
    #[error("replica {id}: its URL is replica {other}'s")]
    SameUrl {
        /// Replica id.
        id: String,
        /// The replica already at that URL.
        other: String,
    },
    /// The publisher introduced `mesh.max_learned_replicas_per_peer` already.
    #[error("replica {id}: {publisher} already introduced {cap} replicas here (mesh.max_learned_replicas_per_peer)")]
    PeerCap {
        /// Replica id.
        id: String,
        /// Publisher's node id.
        publisher: String,
        /// The cap.
        cap: usize,
    },
    /// This node holds `mesh.max_learned_replicas` learned replicas already.
    #[error("replica {id}: {cap} learned replicas already (mesh.max_learned_replicas)")]
    TotalCap {
        /// Replica id.
        id: String,
        /// The cap.
        cap: usize,
    },
    /// The registry refused it (e.g. a bad cache model size).
    #[error("replica {id}: {reason}")]
    Registry {
        /// Replica id.
        id: String,
        /// Why.
        reason: String,
    },
}

impl LearnError {
    /// The metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            LearnError::NotHome { .. } => "not_home",
            LearnError::BadUrl { .. } => "bad_url",
            LearnError::NotAllowed { .. } => "not_allowed",
            LearnError::SameUrl { .. } => "same_url",
            LearnError::PeerCap { .. } => "peer_cap",
            LearnError::TotalCap { .. } => "total_cap",
            LearnError::Registry { .. } => "registry",
        }
    }
}

/// The learned-replica policy of a node, from its `[mesh]` table.
#[derive(Clone, Debug, Default)]
pub struct LearnPolicy {
    rules: Vec<AllowRule>,
    loopback: bool,
    per_peer: usize,
    total: usize,
}

impl LearnPolicy {
    /// The policy of `node`'s configuration (none without a mesh: nothing is learned then).
    pub fn of(node: &Node) -> LearnPolicy {
        let Some(m) = &node.cfg.mesh else {
            return LearnPolicy::default();
        };
        let mesh_ip = m.advertise.unwrap_or(m.listen).ip();
        LearnPolicy {
            // Validated with the configuration; a bad entry cannot reach here.
            rules: m
                .learn_replicas_from
                .iter()
                .filter_map(|r| AllowRule::parse(r).ok())
                .collect(),
            loopback: mesh_ip.is_loopback(),
            per_peer: m.max_learned_replicas_per_peer,
            total: m.max_learned_replicas,
        }
    }
}

/// The node that vouches for an entry's replica: the record's origin when its home says so,
/// else the publisher itself (a stand-in vouches for itself only).
pub(super) fn origin_of(e: &ReplicaEntry) -> String {
    origin_id(e).to_owned()
}

/// [`origin_of`], borrowed.
fn origin_id(e: &ReplicaEntry) -> &str {
    if e.home && !e.record.origin.is_empty() {
        &e.record.origin
    } else {
        &e.publisher
    }
}

impl Node {
    /// One sync round's learning from the region's replica records, `records` (those this
    /// node publishes, `self_id`'s, are skipped); `me_home(e)`: this node is `e`'s replica's
    /// home. Each record tried is handed to `outcome` with what [`Node::learn_replica`] said.
    ///
    /// A record whose vouching node ([`origin_of`]) is not live in `live` is passed over: not
    /// live here *yet*, on a starting node that has not heard it, learning it would only see it
    /// expire in the same round (`apply_membership`), and the next round learn it again. Every
    /// starting node's registry flapped so, every round until the origin turned live: 1,752
    /// drops and returns in one 100-node start.
    pub(super) fn learn_round<'a>(
        &self,
        records: impl IntoIterator<Item = &'a ReplicaEntry>,
        live: &[Member],
        self_id: &str,
        me_home: impl Fn(&ReplicaEntry) -> bool,
        policy: &LearnPolicy,
        mut outcome: impl FnMut(&'a ReplicaEntry, Result<(usize, bool), LearnError>),
    ) {
        let live_ids: HashSet<&str> = live.iter().map(|m| m.node_id.as_str()).collect();
        for e in records {
            if e.publisher == self_id || !live_ids.contains(origin_id(e)) {
                continue;
            }
            outcome(e, self.learn_replica(e, me_home(e), policy));
        }
    }

    /// Learns a replica from a peer's record, or says why not (see the module doc). `me_home`:
    /// this node is the replica's home. Returns its index and whether watcher tasks must be
    /// started for it (new, or back after being dropped).
    pub(super) fn learn_replica(
        &self,
        e: &ReplicaEntry,
        me_home: bool,
        policy: &LearnPolicy,
    ) -> Result<(usize, bool), LearnError> {
        let id = e.id.clone();
        if !e.home && !me_home {
            return Err(LearnError::NotHome {
                id,
                publisher: e.publisher.clone(),
            });
        }
        let r = &e.record;
        let dropped = {
            let core = self.lock();
            let index = core.view.index_of(&id);
            let existing = index.and_then(|i| core.replicas.get(i));
            match existing {
                // Known and in the registry, or configured here (a DNS source took it out:
                // gossip does not bring it back).
                Some(rt) if !rt.removed || !rt.mesh.learned => {
                    return Ok((index.unwrap_or_default(), false));
                }
                Some(rt) => rt.dropped,
                None => false,
            }
        };
        // Parsed only for a replica to learn: every sync round passes every known one here.
        let bad_url = || LearnError::BadUrl {
            id: e.id.clone(),
            url: r.url.chars().take(200).collect(),
        };
        let url = reqwest::Url::parse(&r.url).map_err(|_| bad_url())?;
        let host = match url.host_str() {
            Some(h) if matches!(url.scheme(), "http" | "https") => h.to_owned(),
            _ => return Err(bad_url()),
        };
        if !self.host_allowed(policy, &host) {
            return Err(LearnError::NotAllowed { id, host });
        }
        if let Some(other) = self.replica_at(&url) {
            return Err(LearnError::SameUrl { id, other });
        }
        let (from_peer, learned) = {
            let core = self.lock();
            let active = core
                .replicas
                .iter()
                .filter(|rt| rt.mesh.learned && !rt.removed);
            active.fold((0usize, 0usize), |(p, t), rt| {
                let mine = rt.mesh.learned_from.as_deref() == Some(e.publisher.as_str());
                (p + usize::from(mine), t + 1)
            })
        };
        if from_peer >= policy.per_peer {
            return Err(LearnError::PeerCap {
                id,
                publisher: e.publisher.clone(),
                cap: policy.per_peer,
            });
        }
        if learned >= policy.total {
            return Err(LearnError::TotalCap {
                id,
                cap: policy.total,
            });
        }
        let spec = ReplicaConfig {
            url: r.url.clone(),
            id: Some(id.clone()),
            region: Some(r.region.clone()),
            zone: r.zone.clone(),
            pool: r.pool.clone(),
            models: r.models.clone(),
            capacity_tokens: Some(r.capacity_tokens.max(1)),
            prefill_tokens_per_s: if r.prefill_tokens_per_s.is_finite()
                && r.prefill_tokens_per_s > 0.0
            {
                r.prefill_tokens_per_s
            } else {
                50_000.0
            },
            // Bounded by the record's decoding (`schema.rs`).
            prefill_attention_ms_per_pair: r
                .prefill_attention_ms_per_pair
                .unwrap_or(crate::core::view::DEFAULT_PREFILL_ATTENTION_MS_PER_PAIR),
            max_in_flight: r.max_in_flight.max(1),
            role: r.pd.as_ref().map(|p| p.role).unwrap_or_default(),
            bootstrap_port: r.pd.as_ref().and_then(|p| p.bootstrap_port),
            engine_id: r
                .pd
                .as_ref()
                .map(|p| p.engine_id.clone())
                .unwrap_or_default(),
            // Subscribed to only while this node is its home (`watchers.rs`).
            kv_events: r
                .kv_events
                .as_ref()
                .and_then(|k| super::kv_gossip::from_wire(&r.url, k)),
            kv_load: r.kv_load.filter(|l| l.validate().is_ok()),
        };
        let (i, new) = self
            .add_replica(&spec)
            .map_err(|err| LearnError::Registry {
                id: id.clone(),
                reason: err.to_string(),
            })?;
        let mut core = self.lock();
        if let Some(rt) = core.replicas.get_mut(i) {
            // Its home decides; until this node is home it is a follower.
            rt.mesh.learned = true;
            if new {
                rt.mesh.home = false;
            }
            rt.mesh.learned_from = Some(e.publisher.clone());
            rt.mesh.origin = Some(origin_of(e));
        }
        Ok((i, new || dropped))
    }

    /// Whether a replica at `host` may be taken from a peer: `mesh.learn_replicas_from`,
    /// loopback on a loopback mesh, or a host of this node's own replicas.
    pub(super) fn host_allowed(&self, policy: &LearnPolicy, host: &str) -> bool {
        policy.rules.iter().any(|rule| rule.matches(host))
            || (policy.loopback && allow::is_loopback(host))
            || self.own_host(host)
    }

    /// The id of a replica in the registry at `url` (compared parsed: case, default port and a
    /// trailing slash do not make another engine).
    fn replica_at(&self, url: &reqwest::Url) -> Option<String> {
        let same = |other: &str| {
            reqwest::Url::parse(other).is_ok_and(|o| {
                o.scheme() == url.scheme()
                    && o.host_str() == url.host_str()
                    && o.port_or_known_default() == url.port_or_known_default()
                    && o.path().trim_end_matches('/') == url.path().trim_end_matches('/')
            })
        };
        let core = self.lock();
        core.replicas
            .iter()
            .enumerate()
            .filter(|(_, rt)| !rt.removed)
            .filter_map(|(i, _)| core.view.replica(i))
            .find(|r| same(&r.info.url))
            .map(|r| r.info.id.clone())
    }

    /// Whether `host` is the host of one of this node's own replicas (configured, or found by
    /// its DNS sources), in the registry now.
    fn own_host(&self, host: &str) -> bool {
        let core = self.lock();
        let endpoints = self.endpoints.read().unwrap_or_else(|p| p.into_inner());
        core.replicas
            .iter()
            .zip(endpoints.iter())
            .filter(|(rt, _)| !rt.mesh.learned && !rt.removed)
            .any(|(_, ep)| {
                reqwest::Url::parse(&ep.base)
                    .ok()
                    .and_then(|u| u.host_str().map(|h| allow::same_host(h, host)))
                    .unwrap_or(false)
            })
    }
}

/// Whether a learned replica stays in the registry this round. `origin_live`: the node that
/// vouches for it is a live member; `published`: a live member publishes its record (this
/// node, as its home, included); `homed`: the region has a live home for it (a peer that takes
/// it over within a round or two, or this node); `down`: its active checks fail (not a passing
/// outlier ejection).
///
/// With its origin live, the origin's word holds: unpublished, it goes. With its origin gone,
/// the engine is still there: it stays under its new home unless it is down itself.
pub(super) fn keeps_learned(origin_live: bool, published: bool, homed: bool, down: bool) -> bool {
    if origin_live {
        published
    } else {
        (published || homed) && !down
    }
}

/// Whether a learned replica is down: by this node's active health checks when it is the
/// home (`me_home`; not an ejection for failed requests, which ends by itself), else by its
/// home's published record (`record`, if the home's).
pub(super) fn is_down(
    me_home: bool,
    health: &HealthTracker,
    record: Option<&ReplicaEntry>,
) -> bool {
    if me_home {
        health.health() == Health::Unhealthy && !health.ejected()
    } else {
        record
            .filter(|e| e.home)
            .is_some_and(|e| Health::from(e.record.health) == Health::Unhealthy)
    }
}

/// Remembers which ignored records were counted, so a record ignored every round counts once.
#[derive(Debug, Default)]
pub(super) struct Ignored {
    seen: HashSet<(String, String, &'static str)>,
}

/// Most (replica, publisher, reason) triples remembered; past it the set restarts (recounting).
const MAX_IGNORED: usize = 16_384;

impl Ignored {
    /// Whether this is the first time `err` is seen for `publisher` (so it is counted and logged).
    pub(super) fn first(&mut self, publisher: &str, err: &LearnError) -> bool {
        if self.seen.len() >= MAX_IGNORED {
            self.seen.clear();
        }
        let id = match err {
            LearnError::NotHome { id, .. }
            | LearnError::BadUrl { id, .. }
            | LearnError::NotAllowed { id, .. }
            | LearnError::SameUrl { id, .. }
            | LearnError::PeerCap { id, .. }
            | LearnError::TotalCap { id, .. }
            | LearnError::Registry { id, .. } => id.clone(),
        };
        self.seen.insert((id, publisher.to_owned(), err.reason()))
    }

    /// Forgets everything about replicas no longer published, so a record that returns is
    /// counted again.
    pub(super) fn retain(&mut self, published: &HashSet<(String, String)>) {
        self.seen
            .retain(|(id, p, _)| published.contains(&(id.clone(), p.clone())));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::schema::{ReplicaRecord, SummaryVersion, WireHealth, WireLoad};
    use crate::mesh::Member;
    use crate::node::config::{MeshSection, NodeConfig};
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::time::Duration;

    fn node(listen: &str) -> Arc<Node> {
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
            listen: listen.parse().unwrap(),
            certs_dir: Some("/nonexistent".into()),
            learn_replicas_from: vec![".svc.example".into()],
            max_learned_replicas_per_peer: 2,
            max_learned_replicas: 3,
            ..MeshSection::default()
        });
        Node::new(cfg).unwrap()
    }

    fn entry(id: &str, publisher: &str, url: &str, home: bool) -> ReplicaEntry {
        ReplicaEntry {
            id: id.into(),
            publisher: publisher.into(),
            publisher_addr: "127.0.0.1:9".parse().unwrap(),
            record: ReplicaRecord {
                url: url.into(),
                region: "eu".into(),
                zone: String::new(),
                pool: String::new(),
                models: vec!["m".into()],
                capacity_tokens: 1000,
                prefill_tokens_per_s: 1000.0,
                prefill_attention_ms_per_pair: None,
                max_in_flight: 8,
                health: WireHealth::Healthy,
                load: WireLoad::default(),
                summary: SummaryVersion::default(),
                origin: String::new(),
                kv_events: None,
                pd: None,
                kv_shares: None,
                kv_load: None,
            },
            home,
        }
    }

    fn member(id: &str, port: u16, is_self: bool) -> Member {
        Member::for_test(id, port, is_self)
    }

    #[test]
    fn learning_needs_the_home_an_allowed_host_and_room_under_the_caps() {
        let n = node("10.0.0.1:7946");
        let policy = LearnPolicy::of(&n);
        let learn = |e: &ReplicaEntry, me_home| n.learn_replica(e, me_home, &policy);
        let reason = |r: Result<(usize, bool), LearnError>| r.unwrap_err().reason();
        // Not the home's record, and this node is not the home either.
        let e = entry("x", "p", "http://10.0.0.5:9000", false);
        assert_eq!(reason(learn(&e, false)), "not_home");
        // This node is the home: a stand-in's record may introduce it.
        assert!(learn(&e, true).unwrap().1);
        // Hosts: loopback is not allowed on a mesh that is not on loopback; an unknown host
        // is not; a bad scheme is a bad URL.
        for (url, why) in [
            ("http://127.0.0.1:8000", "not_allowed"),
            ("http://[::1]:8000", "not_allowed"),
            ("http://169.254.169.254/", "not_allowed"),
            ("ftp://10.0.0.5/", "bad_url"),
            ("not a url", "bad_url"),
        ] {
            assert_eq!(
                reason(learn(&entry("y", "p", url, true), false)),
                why,
                "{url}"
            );
        }
        // The allow-list's suffix.
        assert!(learn(&entry("s1", "p", "http://v.svc.example:8000", true), false).is_ok());
        // Per-peer cap (2): p introduced x and s1.
        let third = entry("s2", "p", "http://w.svc.example:8000", true);
        assert_eq!(reason(learn(&third, false)), "peer_cap");
        // Total cap (3).
        assert!(learn(&entry("q1", "q", "http://q.svc.example", true), false).is_ok());
        assert_eq!(
            reason(learn(
                &entry("q2", "q", "http://q2.svc.example", true),
                false
            )),
            "total_cap"
        );
        // A known replica is not learned twice, and does not count against a cap.
        let known = entry("x", "p", "http://10.0.0.5:9000", true);
        assert_eq!(
            learn(&known, false).unwrap(),
            (learn(&e, true).unwrap().0, false)
        );
        assert_eq!(n.replica_count(), 4);
    }

    /// Issue #35: a member published replica ids it is the rendezvous home of, all at one URL,
    /// and drew most of the traffic there. One URL is one replica, whatever its ids.
    #[test]
    fn one_url_is_one_replica_whatever_its_ids() {
        let n = node("127.0.0.1:7946");
        let policy = LearnPolicy::of(&n);
        let learn =
            |id: &str, url: &str| n.learn_replica(&entry(id, "p", url, true), false, &policy);
        // This node's own replica's URL, under another id: refused.
        let own = learn("alias", "http://10.0.0.5:8000/").unwrap_err();
        assert_eq!(own.reason(), "same_url");
        // A new URL is learned once; the same engine under more ids is not.
        assert!(learn("one", "http://127.0.0.1:8001").is_ok());
        for (id, url) in [
            ("two", "http://127.0.0.1:8001/"),
            ("three", "HTTP://127.0.0.1:8001"),
        ] {
            assert_eq!(learn(id, url).unwrap_err().reason(), "same_url", "{url}");
        }
        // Another port is another engine.
        assert!(learn("four", "http://127.0.0.1:8002").is_ok());
        assert_eq!(n.replica_count(), 3);
    }

    #[test]
    fn a_learned_replica_this_node_then_configures_is_its_own() {
        let n = node("127.0.0.1:7946");
        let policy = LearnPolicy::of(&n);
        let (i, _) = n
            .learn_replica(
                &entry("one", "p", "http://127.0.0.1:8001", true),
                false,
                &policy,
            )
            .unwrap();
        let learned = |n: &Node| {
            let core = n.lock();
            let m = &core.replicas[i].mesh;
            (m.learned, m.learned_from.is_some(), m.origin.is_some())
        };
        assert_eq!(learned(&n), (true, true, true));
        // A reload, DNS or Kubernetes names it too: no longer the peer's to expire.
        let spec = ReplicaConfig {
            id: Some("one".into()),
            ..ReplicaConfig::from_url("http://127.0.0.1:8001".to_owned())
        };
        assert_eq!(n.add_configured_replica(&spec).unwrap(), (i, false));
        assert_eq!(learned(&n), (false, false, false));
    }

    #[test]
    fn loopback_is_allowed_on_a_loopback_mesh() {
        let n = node("127.0.0.1:7946");
        let policy = LearnPolicy::of(&n);
        let e = entry("l", "p", "http://127.0.0.1:8001", true);
        assert!(n.learn_replica(&e, false, &policy).is_ok());
    }

    /// A starting node hears a replica's home before the node that vouches for it: the
    /// record waits, unlearned, until the origin is live, and is then learned once and kept.
    #[test]
    fn a_replica_is_learned_only_once_its_origin_is_live_and_then_kept() {
        let n = node("127.0.0.1:7946");
        let policy = LearnPolicy::of(&n);
        let me = member("a", 7000, true);
        let mut h = member("h", 7001, false);
        let o = member("o", 7002, false);
        let id = (0..)
            .map(|i| format!("vouched{i}"))
            .find(|id| {
                let all = [me.clone(), h.clone(), o.clone()];
                let two = [me.clone(), h.clone()];
                let home = |m: &[Member]| crate::mesh::cluster::home_in(m, id, "eu").unwrap().0;
                home(&all) == "h" && home(&two) == "h"
            })
            .unwrap();
        let mut e = entry(&id, "h", "http://127.0.0.1:8001", true);
        e.record.origin = "o".into();
        Arc::make_mut(&mut h.replicas).insert(id.clone(), e.record.clone());
        let records = BTreeMap::from([(id.clone(), e.clone())]);
        let round = |live: &[Member]| {
            let mut tried = Vec::new();
            n.learn_round(
                records.values(),
                live,
                "a",
                |_| false,
                &policy,
                |e, r| tried.push((e.id.clone(), r.map(|(_, new)| new).ok())),
            );
            let plan = n.apply_membership("a", live, &records);
            (tried, plan.expired)
        };
        // o not heard yet: nothing tried, nothing learned, so nothing to expire.
        let early = [me.clone(), h.clone()];
        for _ in 0..3 {
            assert_eq!(round(&early), (vec![], vec![]));
            assert!(n.lock().view.index_of(&id).is_none());
        }
        // o live: learned once, kept by the same round and the next.
        let all = [me.clone(), h.clone(), o.clone()];
        assert_eq!(round(&all), (vec![(id.clone(), Some(true))], vec![]));
        assert_eq!(round(&all), (vec![(id.clone(), Some(false))], vec![]));
        // A record this node publishes itself is never learned from.
        let mut mine = e.clone();
        mine.publisher = "a".into();
        let mut tried = 0;
        n.learn_round([&mine], &all, "a", |_| true, &policy, |_, _| tried += 1);
        assert_eq!(tried, 0);
        // Learned regardless of the origin (the old order): its home still publishes it, so
        // it stays (a replica outlives the router that configured it).
        let m = node("127.0.0.1:7946");
        m.learn_replica(&e, false, &LearnPolicy::of(&m)).unwrap();
        assert!(m.apply_membership("a", &early, &records).expired.is_empty());
    }

    /// Issue #35: kill -9 of the node that configured two of four replicas took them out of
    /// the whole mesh ("learned, origin gone"). They stay, under their new home, while their
    /// own checks pass; a replica whose origin still lives goes when nobody publishes it.
    #[test]
    fn a_replica_outlives_its_origin_under_its_new_home_and_leaves_only_when_down() {
        let n = node("127.0.0.1:7946");
        let policy = LearnPolicy::of(&n);
        let me = member("a", 7000, true);
        let mut o = member("o", 7001, false);
        let q = member("q", 7002, false);
        // o configured it and is its home among the three; without o, q is its home.
        let id = (0..)
            .map(|i| format!("kept{i}"))
            .find(|id| {
                let home = |m: &[Member]| crate::mesh::cluster::home_in(m, id, "eu").unwrap().0;
                home(&[me.clone(), o.clone(), q.clone()]) == "o"
                    && home(&[me.clone(), q.clone()]) == "q"
            })
            .unwrap();
        let e = entry(&id, "o", "http://127.0.0.1:8001", true);
        Arc::make_mut(&mut o.replicas).insert(id.clone(), e.record.clone());
        let (i, _) = n.learn_replica(&e, false, &policy).unwrap();
        let all = [me.clone(), o.clone(), q.clone()];
        let records = BTreeMap::from([(id.clone(), e.clone())]);
        assert!(n.apply_membership("a", &all, &records).expired.is_empty());
        let health = |n: &Node| n.lock().view.replica(i).unwrap().health;
        assert_eq!(health(&n), Health::Healthy);
        // o dies. The round before q, its new home, publishes it: kept, still routable.
        let survivors = [me.clone(), q.clone()];
        let plan = n.apply_membership("a", &survivors, &BTreeMap::new());
        assert!(plan.expired.is_empty());
        assert_eq!(health(&n), Health::Healthy, "not 'vouched for by nobody'");
        // q publishes it (origin o, gone): kept, with q's figures.
        let mut q2 = q.clone();
        let mut by_q = entry(&id, "q", "http://127.0.0.1:8001", true);
        by_q.record.origin = "o".into();
        Arc::make_mut(&mut q2.replicas).insert(id.clone(), by_q.record.clone());
        let survivors = [me.clone(), q2.clone()];
        let records = BTreeMap::from([(id.clone(), by_q.clone())]);
        for _ in 0..3 {
            assert!(n
                .apply_membership("a", &survivors, &records)
                .expired
                .is_empty());
            assert_eq!(health(&n), Health::Healthy);
        }
        // Its own checks fail (q says so): now it leaves.
        let mut down = by_q.clone();
        down.record.health = WireHealth::Unhealthy;
        let records = BTreeMap::from([(id.clone(), down)]);
        assert_eq!(
            n.apply_membership("a", &survivors, &records).expired,
            vec![i]
        );
        // keeps_learned, in short.
        assert!(
            keeps_learned(true, true, true, true),
            "origin live: its word"
        );
        assert!(
            !keeps_learned(true, false, true, false),
            "origin live, unpublished"
        );
        assert!(
            keeps_learned(false, false, true, false),
            "handing over to a new home"
        );
        assert!(
            !keeps_learned(false, true, true, true),
            "origin gone and down"
        );
        assert!(!keeps_learned(false, false, false, false), "no home at all");
    }

    #[test]
    fn a_learned_replica_unpublished_by_its_live_origin_is_dropped_after_its_drain() {
        let n = node("127.0.0.1:7946");
        let policy = LearnPolicy::of(&n);
        let mut p = member("p", 7001, false);
        let me = member("a", 7000, true);
        // p publishes "gone" as its home; this node learns it with origin p.
        let id = (0..)
            .map(|i| format!("gone{i}"))
            .find(|id| {
                crate::mesh::cluster::home_in(&[me.clone(), p.clone()], id, "eu")
                    .unwrap()
                    .0
                    == "p"
            })
            .unwrap();
        let e = entry(&id, "p", "http://127.0.0.1:8001", true);
        Arc::make_mut(&mut p.replicas).insert(id.clone(), e.record.clone());
        let (i, new) = n.learn_replica(&e, false, &policy).unwrap();
        assert!(new);
        let records = BTreeMap::from([(id.clone(), e.clone())]);
        let live = vec![me.clone(), p.clone()];
        let plan = n.apply_membership("a", &live, &records);
        assert!(plan.expired.is_empty());
        assert_eq!(n.lock().replicas[i].mesh.origin.as_deref(), Some("p"));
        // p, live, withdraws it: the replica drains (no new requests), keeps its index.
        let p_live = member("p", 7001, false);
        let plan = n.apply_membership("a", &[me.clone(), p_live], &BTreeMap::new());
        assert_eq!(plan.expired, vec![i]);
        {
            let core = n.lock();
            assert!(core.replicas[i].removed);
            assert_eq!(core.view.replica(i).unwrap().health, Health::Draining);
        }
        // Not dropped before DROP_AFTER, nor while a request is in flight.
        let removed_at = n.lock().replicas[i].removed_at.unwrap();
        assert_eq!(n.sweep_departed_at(removed_at + Duration::from_secs(1)), 0);
        n.lock().view.replica_mut(i).unwrap().load.in_flight = 1;
        let later = removed_at + super::super::registry::DROP_AFTER;
        assert_eq!(n.sweep_departed_at(later), 0);
        n.lock().view.replica_mut(i).unwrap().load.in_flight = 0;
        // Then dropped: a tombstone with its memory freed.
        assert_eq!(n.sweep_departed_at(later), 1);
        {
            let core = n.lock();
            let rt = &core.replicas[i];
            assert!(rt.dropped);
            assert!(core.view.replica(i).unwrap().summary.is_none());
            assert!(rt.cache.summary().filter_bytes() < 1024);
            assert_eq!(core.view.index_of(&id), Some(i), "the index is stable");
        }
        assert_eq!(n.live_incarnation(i), None, "its watchers end");
        assert_eq!(n.replica_count(), 2);
        // Published again (p back): revived at the same index, with new watchers.
        assert_eq!(n.learn_replica(&e, false, &policy).unwrap(), (i, true));
        assert!(!n.lock().replicas[i].removed);
        assert!(n.live_incarnation(i).is_some());
    }
}
