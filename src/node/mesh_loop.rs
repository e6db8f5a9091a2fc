//! The async side of a mesh node: start the mesh and run its sync loop.
//!
//! Exists to keep the I/O of the mesh out of the request path and out of the node's state: one
//! loop per node reads gossip (every gossip interval, on any gossip change, and when a summary
//! this node is home for changed), hands it to the synchronous `Node::apply_membership`
//! (`mesh_roles.rs`), then publishes, withdraws and pulls what that decided, publishes in-flight
//! counts, refreshes region distances and metrics, and decides when the node is warm.
//!
//! Rounds: every gossip interval, on any gossip change and when a home summary changed,
//! coalesced to at most one per fifth of an interval.
//!
//! **Start.** Until the first gossip round (a seedless node: at once; otherwise once a peer is
//! live and every live member's node record has arrived, or `warmup_timeout_ms` passed) the node
//! claims no homes. It is *warm*
//! — `/ready` — once the live set has been stable for 3 rounds (peers heard of through a seed
//! turn live a round or two later), it holds every replica record each live peer's `homes`
//! marker counts (a peer's keys may arrive over several gossip messages), and no replica of its
//! region advertises a newer summary than it holds; or after `warmup_timeout_ms`.
//!
//! **Regions.** Each round sets the view's region distances from the mesh's measured RTTs, with
//! `[[mesh.distance]]` pinned on top. Summary pulls give up after ten rounds (1–5 s) and are
//! retried by a later round.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::config::MeshSection;
use super::learned::{Ignored, LearnError, LearnPolicy};
use super::mesh_state::{MeshPlan, Pull, PullKind};
use super::metrics::MeshMetrics;
use super::remote_regions::OfferFold;
use super::state::Node;
use crate::mesh::cert_resolver::ReloadableCert;
use crate::mesh::cluster::{region_map_of, replicas_in_region_with, LiveHomes};
use crate::mesh::hot_record::HotRecord;
use crate::mesh::schema::{HomesRecord, InflightRecord};
use crate::mesh::transport::{StatsSnapshot, WARN_EVERY};
use crate::mesh::{Member, Mesh, ReplicaEntry};
use crate::replicas::entry::ReplicaConfig;
use crate::shutdown::stopped;

/// The running mesh side of a node.
pub struct MeshRuntime {
    /// The sync loop.
    task: JoinHandle<()>,
}

impl MeshRuntime {
    /// Stops the loop and the mesh (peers see this node go silent).
    pub async fn shutdown(self, node: &Node) {
        self.task.abort();
        let _ = self.task.await;
        if let Some(mesh) = node.detach_mesh() {
            // Close the endpoint at once even if a pull task still holds the handle.
            mesh.transport().close();
            if let Ok(mesh) = Arc::try_unwrap(mesh) {
                mesh.shutdown().await;
            }
        }
    }
}

/// Starts the mesh for `node` (whose HTTP front is bound at `http_addr`) and its sync loop.
/// `cert`, when given, is what the QUIC endpoint presents, shared with the caller so that a
/// reload replaces it (see `MeshConfig::cert`).
pub async fn start(
    node: &Arc<Node>,
    peer_url: String,
    cert: Option<Arc<ReloadableCert>>,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<Option<MeshRuntime>> {
    let Some(section) = node.cfg.mesh.clone() else {
        return Ok(None);
    };
    if section.http_url.is_none()
        && reqwest::Url::parse(&peer_url)
            .is_ok_and(|u| u.host_str().is_some_and(|h| h == "0.0.0.0" || h == "[::]"))
    {
        tracing::warn!(%peer_url, "mesh.http_url not set and the peer listener is on a wildcard: peers cannot forward here; set mesh.http_url");
    }
    let mut cfg = section.mesh_config(
        &node.cfg.region,
        &node.cfg.zone,
        &node.cfg.cluster_id,
        peer_url,
    )?;
    cfg.cert = cert;
    let mesh_ip = section.advertise.unwrap_or(section.listen).ip();
    if section.learn_replicas_from.is_empty()
        && node.cfg.replicas.is_empty()
        && node.cfg.dns.is_empty()
        && node.cfg.kubernetes.is_empty()
        && !mesh_ip.is_loopback()
    {
        tracing::warn!("this node has no [[replicas]], no [[dns]], no [[kubernetes]] and no mesh.learn_replicas_from: it will learn no replica from its peers (set mesh.learn_replicas_from to the hosts or networks your engines live in)");
    }
    let mesh = Arc::new(Mesh::start(cfg).await?);
    node.attach_mesh(Arc::clone(&mesh));
    let metrics = MeshMetrics::new(&node.metrics.registry)?;
    // A node is started once; a second start would have failed registering the metrics above.
    let _ = node.mesh_slot().metrics.set(metrics.clone());
    if section.load_share_interval_ms > 0 {
        let pacing = super::load_share::Pacing::new(
            Duration::from_millis(section.load_share_interval_ms),
            u64::from(section.load_share_budget_kib_s) * 1024,
        );
        tokio::spawn(super::load_share::share_load(
            Arc::clone(node),
            Arc::clone(&mesh),
            pacing,
            stop.clone(),
        ));
    }
    let task = tokio::spawn(sync_loop(Arc::clone(node), mesh, section, metrics, stop));
    Ok(Some(MeshRuntime { task }))
}

struct LoopState {
    started: Instant,
    last_stats: StatsSnapshot,
    last_schema_errors: u64,
    last_inflight: Option<InflightRecord>,
    /// The `hot` record last published.
    last_hot: Option<HotRecord>,
    /// When the first gossip round completed.
    joined: Option<Instant>,
    /// Writes of the homes marker so far.
    homes_round: u64,
    /// Replicas whose record could not be published (warned once).
    unpublishable: BTreeSet<String>,
    /// Live members (id, generation) at the last round, and since when they are unchanged.
    live_ids: Vec<(String, u64)>,
    live_since: Instant,
    /// What may be learned from peers' records.
    policy: LearnPolicy,
    /// Ignored records already counted.
    ignored: Ignored,
    /// When an ignored record was last logged at warn level.
    ignore_warn: Instant,
    /// The region as this node last saw it: live members of its region, and its region's
    /// replicas in the view with a known home (logged at debug on change).
    region_seen: (usize, usize, usize),
}

async fn sync_loop(
    node: Arc<Node>,
    mesh: Arc<Mesh>,
    section: MeshSection,
    metrics: MeshMetrics,
    mut stop: watch::Receiver<bool>,
) {
    let interval = section.gossip_interval();
    // Bursts of changes (a busy home, many peers publishing) coalesce to at most one round per
    // fifth of an interval.
    let spacing = interval / 5;
    let mut changes = mesh.watch_changes().await;
    // `kvmesh_mesh_sync_rounds_total` by cause, looked up once.
    let rounds = ["tick", "gossip", "local"].map(|c| metrics.sync_rounds.with_label_values(&[c]));
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut st = LoopState {
        started: Instant::now(),
        last_stats: StatsSnapshot::default(),
        last_schema_errors: 0,
        last_inflight: None,
        last_hot: None,
        joined: None,
        homes_round: 0,
        unpublishable: BTreeSet::new(),
        live_ids: Vec::new(),
        region_seen: (0, 0, 0),
        live_since: Instant::now(),
        policy: LearnPolicy::of(&node),
        ignored: Ignored::default(),
        ignore_warn: Instant::now()
            .checked_sub(WARN_EVERY)
            .unwrap_or_else(Instant::now),
    };
    loop {
        let changed = async {
            match changes.as_mut() {
                Some(rx) => {
                    if rx.changed().await.is_err() {
                        std::future::pending::<()>().await;
                    }
                }
                None => std::future::pending::<()>().await,
            }
        };
        let cause = tokio::select! {
            _ = tick.tick() => &rounds[0],
            _ = changed => &rounds[1],
            _ = node.mesh_slot().changed.notified() => &rounds[2],
            _ = stopped(&mut stop) => return,
        };
        cause.inc();
        sync_once(&node, &mesh, &section, &metrics, &mut st, &stop).await;
        tokio::time::sleep(spacing).await;
    }
}

/// Counts the region offers refused this round for naming another region's replica
/// (`records_ignored{reason="foreign_holder"}`) and the offered holders dropped for a host no
/// pull may go to (`reason="untrusted_holder"`); warns at most once per `WARN_EVERY`. Holders
/// left out for empty pulls (`reason="empty_holder"`) are only counted: the bar warned once.
fn note_refused_offers(st: &mut LoopState, metrics: &MeshMetrics, fold: &OfferFold) {
    if fold.empty_holders > 0 {
        metrics
            .records_ignored
            .with_label_values(&["empty_holder"])
            .inc_by(fold.empty_holders as u64);
    }
    let regions = &fold.refused;
    if regions.is_empty() && fold.untrusted_holders == 0 {
        return;
    }
    metrics
        .records_ignored
        .with_label_values(&["foreign_holder"])
        .inc_by(regions.len() as u64);
    metrics
        .records_ignored
        .with_label_values(&["untrusted_holder"])
        .inc_by(fold.untrusted_holders as u64);
    if st.ignore_warn.elapsed() >= WARN_EVERY {
        st.ignore_warn = Instant::now();
        tracing::warn!(?regions, untrusted_holders = fold.untrusted_holders, "region offer names a replica of another region (refused) or a holder outside mesh.learn_replicas_from (dropped); more within {WARN_EVERY:?} are only counted");
    }
}

/// Counts and logs an ignored record, once per (replica, publisher, reason); warns at most once
/// per `WARN_EVERY`.
///
/// `expected`: whether the record is normal while memberships settle (see
/// [`stand_in_of_own`]): counted like any other, logged at debug only. Asked only the first
/// time a (publisher, reason) is seen, not every round.
fn note_ignored(
    st: &mut LoopState,
    metrics: &MeshMetrics,
    publisher: &str,
    err: &LearnError,
    expected: impl FnOnce() -> bool,
) {
    if !st.ignored.first(publisher, err) {
        return;
    }
    metrics
        .records_ignored
        .with_label_values(&[err.reason()])
        .inc();
    if expected() {
        tracing::debug!(from = %publisher, error = %err, "replica record ignored (a stand-in)");
    } else if st.ignore_warn.elapsed() >= WARN_EVERY {
        st.ignore_warn = Instant::now();
        tracing::warn!(from = %publisher, error = %err, "replica record ignored (more within {WARN_EVERY:?} are only counted)");
    } else {
        tracing::debug!(from = %publisher, error = %err, "replica record ignored");
    }
}

async fn sync_once(
    node: &Arc<Node>,
    mesh: &Arc<Mesh>,
    section: &MeshSection,
    metrics: &MeshMetrics,
    st: &mut LoopState,
    stop: &watch::Receiver<bool>,
) {
    let live = live_members(node, mesh, metrics, st).await;

    // First gossip round: a seedless node is the first of its cluster; otherwise some peer
    // answered and every live peer's node record arrived. Until then (or the warm-up timeout)
    // the node claims no homes: alone, it would claim every replica and publish records that
    // the real homes must then supersede.
    let timed_out = st.started.elapsed() >= Duration::from_millis(section.warmup_timeout_ms);
    if st.joined.is_none() {
        let joined = section.seeds.is_empty()
            || (live.len() > 1 && live.iter().all(|m| m.node.is_some()))
            || mesh.first_in_region()
            || timed_out;
        if !joined {
            return;
        }
        st.joined = Some(Instant::now());
    }

    // One entry per replica of every region anyone publishes.
    let regions: BTreeSet<String> = live
        .iter()
        .flat_map(|m| m.replicas.values().map(|r| r.region.clone()))
        .collect();
    let homes = LiveHomes::new(&live);
    let mut records = BTreeMap::new();
    for region in &regions {
        for e in replicas_in_region_with(&live, &homes, region) {
            records.insert(e.id.clone(), e);
        }
    }
    let self_id = mesh.node_id();
    count_records_not_from_homes(st, metrics, &live, &homes, self_id, &node.cfg.replicas);
    learn_replicas(node, stop, st, metrics, &live, &homes, &records, self_id);
    sync_admin(node, mesh, &live, st).await;

    let mut map = region_map_of(&live);
    let setup_ms = node.cfg.kv_fetch.links.cross_region.setup_ms;
    for d in &section.distance {
        map.configure(&d.a, &d.b, d.ms);
        if let Some(link) = d.kv_link(setup_ms) {
            map.configure_link(&d.a, &d.b, link);
        }
    }
    node.set_regions(map);

    // Regional gossip: other regions as one record each (their replicas are not members here).
    let regional = mesh.sync_regions(&live, || node.region_offer()).await;
    let fold = node.set_remote_regions(&regional.records, regional.representative);
    note_refused_offers(st, metrics, &fold);
    let regions_known = regional.records.len();

    node.set_peer_tenant_usage(&live);
    let mut plan = node.apply_membership(mesh.node_id(), &live, &records);
    if !plan.expired.is_empty() {
        metrics.learned_expired.inc_by(plan.expired.len() as u64);
    }
    metrics.summaries_behind.set(plan.behind as i64);
    metrics.summary_age_max.set(node.summary_age_max_s());
    carry_out(node, mesh, st, &plan).await;
    spawn_pulls(
        node,
        mesh,
        section,
        metrics,
        std::mem::take(&mut plan.pulls),
    );
    publish_node_records(node, mesh, st, &live, self_id).await;
    mark_warm(
        node,
        section,
        st,
        &live,
        (plan.behind, regions_known, timed_out),
    );
}

/// The members, with the mesh's transport counters into the metrics; the live ones.
async fn live_members(
    node: &Arc<Node>,
    mesh: &Arc<Mesh>,
    metrics: &MeshMetrics,
    st: &mut LoopState,
) -> Vec<Member> {
    let members = mesh.members().await;
    node.set_mesh_members(&members);
    let live: Vec<Member> = members.into_iter().filter(|m| m.live).collect();
    metrics.live_members.set(live.len() as i64);
    let stats = mesh.stats();
    metrics.add_stats(
        &st.last_stats,
        &stats.transport,
        (st.last_schema_errors, stats.schema_errors),
    );
    st.last_stats = stats.transport;
    st.last_schema_errors = stats.schema_errors;
    live
}

/// Whether a record not from its replica's home is a peer's stand-in for a replica this node
/// has in its own configuration too, at the same URL: a node publishes one for a configured
/// replica no live peer publishes yet (`mesh_roles.rs`), so that its home learns it, and the
/// region's third nodes ignore it, as they should, until the home publishes. Normal at every
/// start of a mesh whose nodes share a replica list (each of three `kvmesh bench` nodes warned
/// of the others' stand-ins).
fn stand_in_of_own(own: &[ReplicaConfig], id: &str, url: &str) -> bool {
    own.iter().any(|c| c.url == url && c.effective_id() == id)
}

/// Records of live members that are not the replica's home (and not a stand-in for this
/// node, its home): kept out of the view, counted once each.
fn count_records_not_from_homes(
    st: &mut LoopState,
    metrics: &MeshMetrics,
    live: &[Member],
    homes: &LiveHomes<'_>,
    self_id: &str,
    own: &[ReplicaConfig],
) {
    let mut published: HashSet<(String, String)> = HashSet::new();
    for m in live.iter().filter(|m| !m.is_self) {
        for (id, r) in m.replicas.iter() {
            published.insert((id.clone(), m.node_id.clone()));
            let home = homes.home_id(id, &r.region);
            if home != Some(m.node_id.as_str()) && home != Some(self_id) {
                let err = LearnError::NotHome {
                    id: id.clone(),
                    publisher: m.node_id.clone(),
                };
                let expected = || stand_in_of_own(own, id, &r.url);
                note_ignored(st, metrics, &m.node_id, &err, expected);
            }
        }
    }
    st.ignored.retain(&published);
}

/// Learns the replicas peers publish (their homes' records), starting watchers for new ones;
/// refusals are counted.
#[allow(clippy::too_many_arguments)]
fn learn_replicas(
    node: &Arc<Node>,
    stop: &watch::Receiver<bool>,
    st: &mut LoopState,
    metrics: &MeshMetrics,
    live: &[Member],
    homes: &LiveHomes<'_>,
    records: &BTreeMap<String, ReplicaEntry>,
    self_id: &str,
) {
    let me_home = |e: &ReplicaEntry| homes.home_id(&e.id, &e.record.region) == Some(self_id);
    let mut refused = Vec::new();
    node.learn_round(
        records.values(),
        live,
        self_id,
        me_home,
        &st.policy,
        |e, r| match r {
            Ok((i, true)) => {
                tracing::info!(replica = %e.id, from = %e.publisher, "replica learned from gossip");
                super::watchers::spawn_replica_watchers(node, stop, i);
            }
            Ok(_) => {}
            Err(err) => refused.push((e, err)),
        },
    );
    for (e, err) in refused {
        let not_home = matches!(err, LearnError::NotHome { .. });
        let expected = || not_home && stand_in_of_own(&node.cfg.replicas, &e.id, &e.record.url);
        note_ignored(st, metrics, &e.publisher, &err, expected);
    }
}

/// Operator commands: the region's peers' newer ones apply here, this node's own go out.
async fn sync_admin(node: &Arc<Node>, mesh: &Arc<Mesh>, live: &[Member], st: &LoopState) {
    node.apply_admin_records(live, &st.policy);
    for (id, record) in node.take_admin_outbox() {
        let done = match &record {
            Some(r) => mesh.publish_admin(&id, r).await,
            None => mesh.unpublish_admin(&id).await,
        };
        if let Err(e) = done {
            tracing::warn!(replica = %id, error = %e, "operator command not published");
        }
    }
}

/// Publishes and withdraws the plan's records, hands keys over, and writes the homes marker.
async fn carry_out(node: &Arc<Node>, mesh: &Arc<Mesh>, st: &mut LoopState, plan: &MeshPlan) {
    for (id, record, change) in &plan.publish {
        match mesh.publish_replica(id, record, *change).await {
            Ok(()) => {
                st.unpublishable.remove(id);
            }
            Err(e) => {
                // Retried every round; logged once per replica until it works.
                if st.unpublishable.insert(id.clone()) {
                    tracing::warn!(replica = %id, error = %e, "replica record not published");
                }
                node.publish_failed(id);
            }
        }
    }
    for id in &plan.unpublish {
        if let Err(e) = mesh.unpublish_replica(id).await {
            tracing::warn!(replica = %id, error = %e, "replica record not withdrawn");
        }
    }
    for (id, home, keys) in &plan.handover {
        tracing::info!(replica = %id, %home, keys = keys.len(), "handing over to the new home");
        mesh.report_blocks(*home, id, keys);
    }
    if !plan.publish.is_empty() || !plan.unpublish.is_empty() || st.homes_round == 0 {
        st.homes_round += 1;
        let marker = HomesRecord {
            count: node.published_count(),
            round: st.homes_round,
        };
        if let Err(e) = mesh.publish_homes(&marker).await {
            tracing::warn!(error = %e, "homes marker not published");
        }
    }
}

/// Pulls newer summaries, each in its own task, applied as they arrive.
fn spawn_pulls(
    node: &Arc<Node>,
    mesh: &Arc<Mesh>,
    section: &MeshSection,
    metrics: &MeshMetrics,
    pulls: Vec<Pull>,
) {
    // A pull stuck on a half-dead connection must not hold the replica's copy back for the
    // transport's whole sync timeout: give up after ten rounds (1–5 s) and let a later round retry.
    let pull_timeout =
        (section.gossip_interval() * 10).clamp(Duration::from_secs(1), Duration::from_secs(5));
    for pull in pulls {
        let node = Arc::clone(node);
        let mesh = Arc::clone(mesh);
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let fetch = mesh.fetch_summary(pull.from, &pull.id, pull.epoch, pull.seq);
            let fetched = match tokio::time::timeout(pull_timeout, fetch).await {
                Ok(r) => r.map_err(|e| e.to_string()),
                Err(_) => Err(format!("no answer within {pull_timeout:?}")),
            };
            match fetched {
                Ok(msg) => {
                    if let Ok(bytes) = msg.encode() {
                        metrics.sync_bytes_received.inc_by(bytes.len() as u64);
                    }
                    match node.apply_pulled(pull.index, &msg) {
                        Ok(kind) => {
                            metrics.pulls.with_label_values(&[kind.as_str()]).inc();
                            if kind != PullKind::Ignored {
                                // Readiness and status may change now, not a round later.
                                node.mesh_slot().changed.notify_one();
                            }
                        }
                        Err(e) => {
                            metrics.pulls.with_label_values(&["error"]).inc();
                            tracing::debug!(replica = %pull.id, error = %e, "pulled summary not applied");
                        }
                    }
                }
                Err(e) => {
                    node.pull_failed(pull.index);
                    metrics.pulls.with_label_values(&["error"]).inc();
                    tracing::debug!(replica = %pull.id, peer = %pull.from, error = %e, "summary pull failed");
                }
            }
        });
    }
}

/// This node's own `hot` and `inflight` records, when they changed.
async fn publish_node_records(
    node: &Arc<Node>,
    mesh: &Arc<Mesh>,
    st: &mut LoopState,
    live: &[Member],
    self_id: &str,
) {
    let hot = node.hot_gossip(self_id, live);
    if st.last_hot.as_ref() != Some(&hot) {
        match mesh.publish_hot(&hot).await {
            Ok(()) => st.last_hot = Some(hot),
            Err(e) => tracing::warn!(error = %e, "hot-prefix record not published"),
        }
    }

    let inflight = node.inflight_record();
    if st.last_inflight.as_ref() != Some(&inflight) {
        match mesh.publish_inflight(&inflight).await {
            Ok(()) => st.last_inflight = Some(inflight),
            Err(e) => tracing::warn!(error = %e, "in-flight record not published"),
        }
    }
}

/// Marks the node warm (`/ready`) once membership is stable, peers' records arrived and
/// nothing is left to pull (or the warm-up timed out); logs when its region was seen whole.
/// `progress`: summaries still behind, other regions' records held, whether it timed out.
fn mark_warm(
    node: &Arc<Node>,
    section: &MeshSection,
    st: &mut LoopState,
    live: &[Member],
    (behind, regions_known, timed_out): (usize, usize, bool),
) {
    // A peer's keys may arrive over several gossip messages: "nothing to pull" counts only once
    // this node holds every record each live peer says it publishes (its homes marker, written
    // after its records, arrives after them).
    // And peers this node heard of through others count as live only once their heartbeats
    // reach it, a round or two later: the live set must also have been stable for 3 rounds.
    let caught_up = live.iter().filter(|m| !m.is_self).all(|m| {
        m.homes
            .is_some_and(|h| h.count as usize == m.replicas.len())
    });
    let ids: Vec<(String, u64)> = live
        .iter()
        .map(|m| (m.node_id.clone(), m.generation))
        .collect();
    if ids != st.live_ids {
        st.live_ids = ids;
        st.live_since = Instant::now();
    }
    // When this node has seen its region whole (and how many other regions' records it holds),
    // on its own clock: `scripts/mesh-scale.py` reads these lines to time convergence, rolling
    // restarts and a region going dark without polling a hundred nodes.
    let (region, homed) = node.homed_local_replicas();
    let seen = (
        live.iter()
            .filter(|m| m.node.as_ref().is_some_and(|n| n.region == region))
            .count(),
        homed,
        regions_known,
    );
    if seen != st.region_seen {
        st.region_seen = seen;
        tracing::debug!(
            members_live = seen.0,
            replicas_homed = seen.1,
            other_regions = seen.2,
            elapsed_ms = st.started.elapsed().as_millis() as u64,
            "region seen"
        );
    }
    let stable = st.live_since.elapsed() >= 3 * section.gossip_interval();
    if !node.mesh_warm() && ((stable && caught_up && behind == 0) || timed_out) {
        node.set_mesh_warm();
        tracing::info!(
            elapsed_ms = st.started.elapsed().as_millis() as u64,
            timed_out,
            behind = behind,
            "node warm"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer's stand-in for a replica this node has configured too is expected while the mesh
    /// settles; a record naming another id or another URL is not.
    #[test]
    fn a_stand_in_is_a_record_of_a_replica_this_node_has_configured_at_that_url() {
        let own = vec![ReplicaConfig {
            id: Some("replica-4".into()),
            ..ReplicaConfig::from_url("http://127.0.0.1:8004")
        }];
        assert!(stand_in_of_own(&own, "replica-4", "http://127.0.0.1:8004"));
        assert!(!stand_in_of_own(&own, "replica-4", "http://10.9.9.9:8004"));
        assert!(!stand_in_of_own(&own, "replica-5", "http://127.0.0.1:8004"));
        assert!(!stand_in_of_own(&[], "replica-4", "http://127.0.0.1:8004"));
    }
}
