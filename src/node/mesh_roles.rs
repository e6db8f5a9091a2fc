//! The node's side of the mesh: home and follower roles per replica, applying what gossip says
//! to the routing view, answering peers' summary requests and taking their block reports.
//!
//! Exists in its own file so the single-node code reads as it would without a mesh and the mesh
//! can be read in one place. All of it is synchronous and short under the node's lock; the async
//! loop that calls it (gossip reads, publishing, pulls) is `mesh_loop.rs`, and the data it works
//! on is in `mesh_state.rs`.
//!
//! Roles, per replica:
//! - **home** (this node wins the rendezvous hash over the live nodes of the replica's region, or
//!   the node runs alone): scrapes the replica's `/metrics`, keeps the authoritative approximate
//!   `CacheModel` fed by its own routes and by peers' block reports, copies its summary into the
//!   view, and publishes the `replica:<id>` record.
//! - **follower**: the view's summary is the copy pulled from the home; health and engine load come
//!   from the home's record (made worse, never better, by this node's own passive ejection and —
//!   for replicas in its static config — its own cheap `/health` checks); routed blocks are
//!   reported to the home; the node's own in-flight counts stay its own. Its own cache model is
//!   kept but never shown. It pulls the summary when the record is newer than its copy
//!   (`needs_pull`), for replicas of its own region only.
//!
//! A single node is home of everything, so nothing changes without a mesh. Replicas learned from
//! a peer's record get watcher tasks too, idle until this node becomes their home; `/metrics`
//! scrapes run on the home only, `/health` checks on the home and on nodes that have the replica
//! from their own config or DNS. A replica in this node's config that no live peer publishes (its
//! home may not have it in its config) gets a stand-in record from this node's own model, until
//! the home, having learned it from that record, publishes its own.
//!
//! **Handover.** A node that becomes home restarts the model's epoch above both the wall clock
//! and the previous home's epoch (`CacheModel::restart_epoch`, keeping the keys it routed there
//! itself), so every peer pulls the new home's snapshot. A live previous home keeps its record up
//! (and keeps answering summary requests) until the new home publishes — so no replica ever
//! vanishes from gossip — then withdraws it and sends its live keys to the new home as block
//! reports. When the old home died instead, what only it knew is lost, bounded by overlays and
//! re-reported routes.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::mesh_state::{
    MemberJson, MeshPlan, MeshStateJson, NodeMesh, Peer, Pull, PullKind, RegionJson,
    ReplicaMeshJson, Status,
};
use super::state::{Core, Node, ReplicaRuntime};
use crate::core::keys::BlockKey;
use crate::core::regions::RegionMap;
use crate::core::summary::{ReplicaSummary, SummaryMessage};
use crate::core::tenants::Tenants;
use crate::core::view::{Health, ReplicaInfo, ReplicaLoad};
use crate::mesh::cluster::{GossipLayout, LiveHomes};
use crate::mesh::load_share::LoadUpdate;
use crate::mesh::replica_load::RecordChange;
use crate::mesh::schema::{InflightRecord, ReplicaRecord, SummaryVersion};
use crate::mesh::sync::needs_pull;
use crate::mesh::{BlockReport, Member, Mesh, MeshHandler, ReplicaEntry, SummaryRequest};

/// Wall-clock milliseconds (summary epochs are wall-clock based so a new home supersedes).
fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(1)
}

impl Node {
    /// Whether the configuration asks for a mesh.
    pub fn in_mesh(&self) -> bool {
        self.cfg.mesh.is_some()
    }

    /// The running mesh, once attached.
    pub fn mesh(&self) -> Option<Arc<Mesh>> {
        self.mesh
            .mesh
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Attaches a started mesh and installs this node as its handler.
    pub(super) fn attach_mesh(self: &Arc<Self>, mesh: Arc<Mesh>) {
        mesh.set_handler(Arc::new(Handler(Arc::downgrade(self))));
        *self.mesh.mesh.write().unwrap_or_else(|p| p.into_inner()) = Some(mesh);
    }

    /// Detaches the mesh (shutdown); the caller stops it.
    pub(super) fn detach_mesh(&self) -> Option<Arc<Mesh>> {
        self.mesh
            .mesh
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// The mesh slot (the sync loop's wake-up).
    pub fn mesh_slot(&self) -> &NodeMesh {
        &self.mesh
    }

    pub(super) fn status(&self) -> std::sync::MutexGuard<'_, Status> {
        self.mesh.status.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether active `/health` checks of replica `i` run here: on its home, and for replicas
    /// this node has from its own config or DNS (a cheap GET that lets it see a dead replica
    /// before the home's record says so). Replicas learned only from gossip are checked by
    /// their home alone.
    pub(super) fn should_check(&self, i: usize) -> bool {
        self.lock()
            .replicas
            .get(i)
            .is_some_and(|rt| rt.mesh.home || !rt.mesh.learned)
    }

    /// Whether `/metrics` scrapes of replica `i` run here: on its home only (followers read the
    /// load from the home's record).
    pub(super) fn should_scrape(&self, i: usize) -> bool {
        self.lock().replicas.get(i).is_some_and(|rt| rt.mesh.home)
    }

    /// After a request's first byte (its blocks are now in the replica's prefix cache): tell the
    /// home (batched by the mesh, with the request's KV tenant label, `Tenants::kv_label`), or
    /// wake the publisher when home.
    pub(super) fn after_first_byte(
        &self,
        i: usize,
        target: Option<SocketAddr>,
        kv_label: Option<&str>,
        keys: &[BlockKey],
    ) {
        let Some(mesh) = self.mesh() else {
            return;
        };
        match target {
            Some(home) => {
                let id = self.id_of(i);
                mesh.report_keys(home, &id, kv_label, keys.iter().map(|k| k.0));
            }
            None => self.mesh.changed.notify_one(),
        }
    }

    /// Ready as far as the mesh goes: no mesh, or warm (first gossip round done and the region's
    /// summaries pulled, or the warm-up timeout passed).
    pub(super) fn mesh_ready(&self) -> bool {
        !self.in_mesh() || self.status().warm
    }

    /// Whether the node is warm (always true without a mesh).
    pub fn mesh_warm(&self) -> bool {
        self.mesh_ready()
    }

    /// Marks the node warm.
    pub(super) fn set_mesh_warm(&self) {
        self.status().warm = true;
    }

    /// Records the members and forwarding peers the sync loop last saw.
    pub(super) fn set_mesh_members(&self, members: &[Member]) {
        let json = members
            .iter()
            .map(|m| MemberJson {
                node_id: m.node_id.clone(),
                region: m.region().unwrap_or("").to_owned(),
                live: m.live,
                generation: m.generation,
                is_self: m.is_self,
                http_url: m
                    .node
                    .as_ref()
                    .map_or(String::new(), |n| n.http_url.clone()),
                replicas_published: m.replicas.len(),
            })
            .collect();
        let peers = members
            .iter()
            .filter(|m| m.live && !m.is_self)
            .filter_map(|m| {
                let n = m.node.as_ref()?;
                (!n.http_url.is_empty()).then(|| Peer {
                    node_id: m.node_id.clone(),
                    region: n.region.clone(),
                    http_url: n.http_url.trim_end_matches('/').to_owned(),
                    quic_addr: n.quic_addr,
                })
            })
            .collect();
        let members_in = members
            .iter()
            .filter(|m| m.live && !m.is_self)
            .filter_map(|m| {
                let n = m.node.as_ref()?;
                Some((n.region.clone(), n.quic_addr))
            })
            .collect();
        // Each region peer may make its share of the peer-tip store (`core::peer_tips`): set
        // here, where the region's membership changes, not per load update.
        let region_peers = members
            .iter()
            .filter(|m| m.live && !m.is_self && m.region() == Some(self.cfg.region.as_str()))
            .count()
            .max(1);
        {
            let mut core = self.lock();
            let quota = core.view.peer_tips.cap() / region_peers;
            core.view.peer_tips.set_peer_quota(quota);
        }
        let mut st = self.status();
        st.members = json;
        st.peers = peers;
        st.members_in = members_in;
    }

    /// Whether `addr` is the QUIC address of a live (verified) member of `region`, HTTP front
    /// or not.
    pub(super) fn is_member_in(&self, region: &str, addr: SocketAddr) -> bool {
        self.status()
            .members_in
            .iter()
            .any(|(r, a)| r == region && *a == addr)
    }

    /// The regions other than this node's with a live peer that takes forwarded requests
    /// (a member in the flat layout, a target of the region's record in the regional one),
    /// sorted.
    pub fn forward_regions(&self) -> Vec<String> {
        let st = self.status();
        let own = &self.cfg.region;
        let mut regions: Vec<String> = st
            .peers
            .iter()
            .chain(&st.region_targets)
            .filter(|p| &p.region != own)
            .map(|p| p.region.clone())
            .collect();
        regions.sort_unstable();
        regions.dedup();
        regions
    }

    /// Live peers of `region` that take forwarded requests.
    pub fn peers_in(&self, region: &str) -> Vec<Peer> {
        let st = self.status();
        let members: Vec<Peer> = st
            .peers
            .iter()
            .filter(|p| p.region == region)
            .cloned()
            .collect();
        if !members.is_empty() {
            return members;
        }
        // Regional gossip: another region's nodes are named by its record.
        st.region_targets
            .iter()
            .filter(|p| p.region == region)
            .cloned()
            .collect()
    }

    /// Whether `addr` is the QUIC address of a live peer of `region`.
    pub(super) fn is_peer_in(&self, region: &str, addr: SocketAddr) -> bool {
        self.status()
            .peers
            .iter()
            .any(|p| p.region == region && p.quic_addr == addr)
    }

    /// Replaces the view's region distances.
    pub(super) fn set_regions(&self, map: RegionMap) {
        self.lock().view.regions = map;
    }

    /// One membership round, under the lock: decide homes, fold records into the view, and say
    /// what to publish, withdraw and pull. `records` holds one entry per replica id (the
    /// publisher preferred by `replicas_in_region`). Per replica, in named steps: a removed one
    /// is withdrawn; a learned one whose origin is gone expires ([`learned_fate`]); then this
    /// node is its home ([`publish_as_home`]) or follows the home ([`follow_home`]).
    pub(super) fn apply_membership(
        &self,
        self_id: &str,
        live: &[Member],
        records: &BTreeMap<String, ReplicaEntry>,
    ) -> MeshPlan {
        let load_interval = Duration::from_millis(
            self.cfg
                .mesh
                .as_ref()
                .map_or(0, |m| m.replica_load_interval_ms),
        );
        let mut plan = MeshPlan::default();
        let mut guard = self.lock();
        let core = &mut *guard;
        let round = Round {
            self_id,
            live,
            records,
            now: self.now(),
            wall: now_ms(),
            load_interval,
            local: core.view.local_region.clone(),
            pull_remote: self.cfg.remote_prefix
                != crate::core::remote_prefix::RemotePrefixMode::Local,
        };
        let homes = LiveHomes::new(live);
        for i in 0..core.replicas.len() {
            let Some(r) = core.view.replica(i) else {
                continue;
            };
            let info = r.info.clone();
            let load = r.load;
            let rt = &mut core.replicas[i];
            if rt.removed {
                if rt.mesh.published.take().is_some() {
                    plan.unpublish.push(info.id.clone());
                }
                continue;
            }
            let home = homes.home(&info.id, &info.region);
            let me_home = home.as_ref().is_some_and(|(h, _)| h == self_id);
            let handing_over =
                match learned_fate(core, i, &info, me_home, home.is_some(), &round, &mut plan) {
                    LearnedFate::Expired => continue,
                    LearnedFate::Kept { handing_over } => handing_over,
                };
            if me_home {
                publish_as_home(core, i, &info, &load, &round, &mut plan);
            } else {
                let follow = Following { home, handing_over };
                follow_home(core, i, &info, &load, follow, &round, &mut plan);
            }
            let h = core.replicas[i].effective_health();
            core.view.set_health(i, h);
            super::kv_shares::refresh_kv_shares(core, i);
        }
        plan
    }

    /// Applies a pulled summary to replica `i`'s view copy. A snapshot's filter is built
    /// before the lock is taken (a delta is applied under it, to the copy it extends).
    pub(super) fn apply_pulled(&self, i: usize, msg: &SummaryMessage) -> anyhow::Result<PullKind> {
        let now = self.now();
        let built = match msg {
            SummaryMessage::Snapshot(snap) => {
                Some(ReplicaSummary::from_snapshot(snap, &self.summary_cfg))
            }
            SummaryMessage::Delta(_) => None,
        };
        let mut guard = self.lock();
        let core = &mut *guard;
        let Some(rt) = core.replicas.get_mut(i) else {
            anyhow::bail!("no replica {i}");
        };
        rt.mesh.pulling = false;
        if rt.mesh.home {
            return Ok(PullKind::Ignored);
        }
        let Some(r) = core.view.replica_mut(i) else {
            anyhow::bail!("no replica {i}");
        };
        let (summary, kind) = match (msg, built) {
            (_, Some(snapshot)) => (snapshot?, PullKind::Snapshot),
            (SummaryMessage::Delta(d), None) => {
                let held = if rt.mesh.pulled.is_some() {
                    r.summary.take()
                } else {
                    None
                };
                let Some(held) = held else {
                    rt.mesh.pulled = None;
                    anyhow::bail!("a delta without a copy to apply it to");
                };
                // The live node is the only holder, so this does not copy.
                let mut s = Arc::unwrap_or_clone(held);
                if let Err(e) = s.apply_delta(d) {
                    // Keep the copy for routing; ask for a snapshot next time.
                    r.summary = Some(Arc::new(s));
                    rt.mesh.pulled = None;
                    return Err(e.into());
                }
                (s, PullKind::Delta)
            }
            (SummaryMessage::Snapshot(_), None) => anyhow::bail!("a snapshot not built"),
        };
        rt.mesh.pulled = Some((summary.epoch(), summary.seq()));
        rt.mesh.updated_at = Some(now);
        core.view.set_summary(i, summary);
        Ok(kind)
    }

    /// A record could not be published (e.g. over the size limit): forget it, so the homes
    /// marker does not count it and the next round tries again.
    pub(super) fn publish_failed(&self, id: &str) {
        let mut core = self.lock();
        if let Some(i) = core.view.index_of(id) {
            if let Some(rt) = core.replicas.get_mut(i) {
                rt.mesh.published = None;
            }
        }
    }

    /// Replica records this node publishes now.
    pub(super) fn published_count(&self) -> u32 {
        let n = self
            .lock()
            .replicas
            .iter()
            .filter(|rt| rt.mesh.published.is_some())
            .count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// A pull of replica `i` failed: allow the next round to try again.
    pub(super) fn pull_failed(&self, i: usize) {
        if let Some(rt) = self.lock().replicas.get_mut(i) {
            rt.mesh.pulling = false;
        }
    }

    /// This node's in-flight counts for gossip, per tenant with a cluster share. Per replica
    /// they go to the region's nodes by load sharing, within milliseconds (`load_share.rs`); in
    /// the record they changed with every request and nobody read them, so they are no longer
    /// written.
    pub(super) fn inflight_record(&self) -> InflightRecord {
        let core = self.lock();
        InflightRecord::default().with_tenants(
            core.router
                .tenants
                .shared_usage()
                .map(|(t, c)| (t.to_owned(), c)),
        )
    }

    /// The other live nodes' in-flight requests per tenant (their `inflight` records), so a
    /// tenant's cluster share holds across nodes. A region peer's count is taken at most as the
    /// requests it claims in flight by load sharing: a member's record is its own word, and a
    /// count of a million would refuse the tenant at every node.
    pub(super) fn set_peer_tenant_usage(&self, live: &[Member]) {
        let sharing = self
            .cfg
            .mesh
            .as_ref()
            .is_some_and(|m| m.load_share_interval_ms > 0);
        let peers: Vec<&Member> = live.iter().filter(|m| !m.is_self).collect();
        // One lock at a time (the request path reads the tenants apart from the core lock).
        let claims: Vec<Option<u32>> = {
            let core = self.lock();
            peers
                .iter()
                .map(|m| {
                    m.node
                        .as_ref()
                        .filter(|n| sharing && n.region == self.cfg.region)
                        .map(|n| core.peer_loads.in_flight_of(&n.quic_addr))
                })
                .collect()
        };
        let mut usage: HashMap<String, u32> = HashMap::new();
        let configured = self.tenant_cfgs.read().unwrap_or_else(|p| p.into_inner());
        for (m, claimed) in peers.iter().zip(claims) {
            for (t, c) in &m.inflight.tenants {
                // Only configured tenants: names a peer sends cannot grow this map.
                if configured.contains_key(t) {
                    let c = claimed.map_or(*c, |n| (*c).min(n));
                    let e = usage.entry(t.clone()).or_default();
                    *e = e.saturating_add(c);
                }
            }
        }
        drop(configured);
        self.lock().router.tenants.set_peer_usage(usage);
    }

    /// This node's region, and how many of its replicas the view holds, not draining, with a
    /// known home (what `/admin/state` shows as converged).
    pub(super) fn homed_local_replicas(&self) -> (String, usize) {
        let core = self.lock();
        let region = core.view.local_region.clone();
        let homed = core
            .view
            .replicas()
            .iter()
            .zip(&core.replicas)
            .filter(|(r, rt)| {
                r.info.region == region
                    && r.health != Health::Draining
                    && (rt.mesh.home || rt.mesh.home_id.is_some())
            })
            .count();
        (region, homed)
    }

    /// The `mesh` section of `/admin/state`.
    pub fn mesh_state(&self) -> Option<MeshStateJson> {
        let mesh = self.mesh()?;
        let (warm, members, representative, targets) = {
            let st = self.status();
            (
                st.warm,
                st.members.clone(),
                st.representative,
                st.region_targets.clone(),
            )
        };
        let now = self.now();
        let core = self.lock();
        let replicas = core
            .view
            .replicas()
            .iter()
            .zip(&core.replicas)
            .map(|(r, rt)| ReplicaMeshJson {
                id: r.info.id.clone(),
                region: r.info.region.clone(),
                home: if rt.mesh.home {
                    mesh.node_id().to_owned()
                } else {
                    rt.mesh.home_id.clone().unwrap_or_default()
                },
                learned: rt.mesh.learned,
                summary_epoch: r.summary.as_ref().map_or(0, |s| s.epoch()),
                summary_seq: r.summary.as_ref().map_or(0, |s| s.seq()),
                summary_age_s: rt
                    .mesh
                    .updated_at
                    .map(|t| now.saturating_sub(t).as_secs_f64()),
            })
            .collect();
        Some(MeshStateJson {
            node_id: mesh.node_id().to_owned(),
            generation: mesh.node_record().generation,
            quic_addr: mesh.addr().to_string(),
            warm,
            members,
            replicas,
            layout: match mesh.layout() {
                GossipLayout::Regional => "regional".into(),
                GossipLayout::Flat => "flat".into(),
            },
            representative,
            regions: core
                .view
                .remote_regions
                .values()
                .map(|o| RegionJson {
                    region: o.region.clone(),
                    models: o
                        .models
                        .iter()
                        .map(|m| (m.model.clone(), m.healthy, m.open, m.least_queue_ms))
                        .collect(),
                    heads: o.heads.len(),
                    targets: targets
                        .iter()
                        .filter(|t| t.region == o.region)
                        .map(|t| t.node_id.clone())
                        .collect(),
                })
                .collect(),
        })
    }
}

impl Node {
    /// Seconds since the oldest summary this node follows (another node is home) last changed.
    pub(super) fn summary_age_max_s(&self) -> f64 {
        let now = self.now();
        let core = self.lock();
        core.replicas
            .iter()
            .filter(|rt| !rt.mesh.home && !rt.removed)
            .filter_map(|rt| rt.mesh.updated_at)
            .map(|t| now.saturating_sub(t).as_secs_f64())
            .fold(0.0, f64::max)
    }
}

/// The record this node publishes for a replica, from its own model, health and load.
fn own_record(
    rt: &ReplicaRuntime,
    info: &ReplicaInfo,
    load: &ReplicaLoad,
    tenants: &Tenants,
) -> ReplicaRecord {
    let s = rt.cache.summary();
    // The digest hashes the whole filter: reuse it while the version is unchanged.
    let digest = match &rt.mesh.published {
        Some(p) if (p.summary.epoch, p.summary.seq) == (s.epoch(), s.seq()) => p.summary.digest,
        _ => s.digest(),
    };
    let version = SummaryVersion {
        epoch: s.epoch(),
        seq: s.seq(),
        digest,
    };
    // Only this node's own pending prefill: followers add every node's, this one's included,
    // from load sharing; the home's total would count theirs twice.
    let own = ReplicaLoad {
        queued_prefill_tokens: rt.pending_prefill_tokens,
        ..*load
    };
    let mut record = ReplicaRecord::new(info, rt.effective_health(), &own, version);
    record.origin = rt.mesh.origin.clone().unwrap_or_default();
    record.kv_events = rt
        .kv_source
        .as_ref()
        .and_then(|k| super::kv_gossip::to_wire(&info.url, k));
    super::kv_shares::with_own_kv_shares(record, rt, tenants)
}

/// What one membership round knows besides the core: who this node is, who is live, what they
/// publish, and when.
struct Round<'a> {
    /// This node's id.
    self_id: &'a str,
    /// The live members, this node included.
    live: &'a [Member],
    /// One record per replica id (see [`Node::apply_membership`]).
    records: &'a BTreeMap<String, ReplicaEntry>,
    /// The node's clock.
    now: Duration,
    /// Wall-clock milliseconds (a new home's epoch).
    wall: u64,
    /// Least time between two `rload:` records of a replica.
    load_interval: Duration,
    /// This node's region.
    local: String,
    /// Also pull other regions' replicas' summaries (in the flat layout, where their records
    /// reach this node): `remote_prefix` weighs prefixes they hold (`core::remote_prefix`).
    pull_remote: bool,
}

/// What becomes of replica `i` if it is learned (known only from a peer's record).
enum LearnedFate {
    /// It drains and is dropped: nobody live vouches for it, or it is down.
    Expired,
    /// It stays. `handing_over`: its origin is gone and its new home does not publish it yet,
    /// so "nobody publishes it" does not mean "nobody vouches for it".
    Kept { handing_over: bool },
}

/// A learned replica stays while some live member publishes it (this node, as its home,
/// included), or while its origin is gone and a live peer is its new home, unless it is down
/// (`learned.rs::keeps_learned`): a router's death costs no capacity. Else it drains.
fn learned_fate(
    core: &mut Core,
    i: usize,
    info: &ReplicaInfo,
    me_home: bool,
    has_home: bool,
    round: &Round<'_>,
    plan: &mut MeshPlan,
) -> LearnedFate {
    let rt = &mut core.replicas[i];
    if !rt.mesh.learned {
        return LearnedFate::Kept {
            handing_over: false,
        };
    }
    if let Some(e) = round.records.get(&info.id).filter(|e| e.home) {
        rt.mesh.origin = Some(super::learned::origin_of(e));
    }
    let origin_live = rt
        .mesh
        .origin
        .as_ref()
        .is_some_and(|o| round.live.iter().any(|m| m.node_id == *o));
    let published = me_home
        || round
            .live
            .iter()
            .any(|m| !m.is_self && m.replicas.contains_key(&info.id));
    let down = super::learned::is_down(me_home, &rt.health, round.records.get(&info.id));
    if super::learned::keeps_learned(origin_live, published, has_home, down) {
        return LearnedFate::Kept {
            handing_over: !origin_live && !published,
        };
    }
    tracing::info!(replica = %info.id, origin = ?rt.mesh.origin, origin_live, "learned replica expired: draining");
    rt.removed = true;
    rt.removed_at = Some(round.now);
    if rt.mesh.published.take().is_some() {
        plan.unpublish.push(info.id.clone());
    }
    plan.expired.push(i);
    core.view.set_health(i, Health::Draining);
    LearnedFate::Expired
}

/// This node is replica `i`'s home: start a new epoch when it just became home (or a peer's
/// is newer), and publish its record when it changed.
fn publish_as_home(
    core: &mut Core,
    i: usize,
    info: &Arc<ReplicaInfo>,
    load: &ReplicaLoad,
    round: &Round<'_>,
    plan: &mut MeshPlan,
) {
    let (self_id, live, now, wall) = (round.self_id, round.live, round.now, round.wall);
    let load_interval = round.load_interval;
    let rt = &mut core.replicas[i];
    let mut restart = None;
    if !rt.mesh.home {
        // Gained: supersede the previous home's epoch, keep what this node routed.
        let pulled = rt.mesh.pulled.map_or(0, |(e, _)| e.saturating_add(1));
        restart = Some(wall.max(pulled));
        tracing::info!(replica = %info.id, "became home");
    }
    let ours = rt.cache.summary().epoch();
    let theirs = live
        .iter()
        .filter(|m| !m.is_self)
        .filter_map(|m| m.replicas.get(&info.id))
        .map(|r| r.summary.epoch)
        .max();
    if let Some(t) = theirs.filter(|t| *t >= ours) {
        restart = Some(restart.unwrap_or(0).max(t.saturating_add(1)));
    }
    if let Some(epoch) = restart {
        if let Err(e) = rt.cache.restart_epoch(epoch) {
            tracing::warn!(replica = %info.id, error = %e, "cannot start a new epoch");
        }
        rt.summary_dirty = true;
    }
    rt.mesh.home = true;
    rt.mesh.home_id = Some(self_id.to_owned());
    rt.mesh.home_addr = None;
    rt.mesh.remote_health = None;
    rt.mesh.remote_queued = 0;
    rt.mesh.remote_kv_shares = None;
    rt.mesh.pulled = None;
    let record = own_record(rt, info, load, &core.router.tenants);
    let version = record.summary;
    let change = RecordChange::between(
        rt.mesh.published.as_ref(),
        &record,
        rt.mesh.load_published_at.map(|t| now.saturating_sub(t)),
        load_interval,
    );
    if change != RecordChange::None {
        rt.mesh.load_published_at = Some(now);
        if rt.mesh.published.as_ref().map(|p| p.summary) != Some(version) {
            rt.mesh.updated_at = Some(now);
            // The home's own view gets the new summary now, with its record, not at
            // the next upkeep tick: that tick was the slowest step of visibility.
            rt.summary_dirty = false;
            let copy = rt.cache.summary().routing_copy();
            core.view.set_summary(i, copy);
        }
        let rt = &mut core.replicas[i];
        rt.mesh.published = Some(record.clone());
        plan.publish.push((info.id.clone(), record, change));
    }
}

/// Whom a replica this node is not home of follows this round.
struct Following {
    /// Its home (node id, gossip address); `None` when no live node of its region is.
    home: Option<(String, SocketAddr)>,
    /// Its origin is gone and the new home does not publish it yet ([`LearnedFate::Kept`]).
    handing_over: bool,
}

/// Another node is replica `i`'s home (or none is): hand over to it once it publishes, stand in
/// for it while nobody does, and fold its record into the view.
fn follow_home(
    core: &mut Core,
    i: usize,
    info: &Arc<ReplicaInfo>,
    load: &ReplicaLoad,
    follow: Following,
    round: &Round<'_>,
    plan: &mut MeshPlan,
) {
    let Following { home, handing_over } = follow;
    let (self_id, live, records, local) = (
        round.self_id,
        round.live,
        round.records,
        round.local.as_str(),
    );
    let rt = &mut core.replicas[i];
    if rt.mesh.home {
        tracing::info!(replica = %info.id, "no longer home");
        // The view keeps this node's own copy until the new home's replaces it.
        rt.mesh.pulled = None;
    }
    // The record stays up until the new home publishes its own: a new home that
    // knows the replica only from gossip learns it from this record, and peers
    // never see the replica vanish. Then this node's keys go to the new home.
    let taken_over = home.as_ref().is_some_and(|(h, _)| {
        live.iter()
            .any(|m| m.node_id == *h && m.replicas.contains_key(&info.id))
    });
    if taken_over && rt.mesh.published.take().is_some() {
        plan.unpublish.push(info.id.clone());
        if let Some((_, addr)) = &home {
            let keys = rt.cache.live_keys().into_iter().map(|k| k.0).collect();
            plan.handover.push((info.id.clone(), *addr, keys));
        }
    }
    rt.mesh.home = false;
    rt.mesh.home_id = home.as_ref().map(|(h, _)| h.clone());
    rt.mesh.home_addr = home.map(|(_, a)| a);
    // A replica in this node's own config that no live peer publishes (its home
    // may not know it: configs differ): publish a stand-in record from this node's
    // own model so the home learns it, until the home takes over as above.
    let others_publish = live
        .iter()
        .any(|m| !m.is_self && m.replicas.contains_key(&info.id));
    if !others_publish && !rt.mesh.learned && info.region == local {
        rt.mesh.remote_health = None;
        rt.mesh.remote_queued = 0;
        let record = own_record(rt, info, load, &core.router.tenants);
        if rt.mesh.published.as_ref() != Some(&record) {
            // A stand-in goes out whole: it is how the home learns the replica.
            rt.mesh.published = Some(record.clone());
            plan.publish
                .push((info.id.clone(), record, RecordChange::Full));
        }
    }
    match records.get(&info.id).filter(|e| e.publisher != self_id) {
        // Published, but not by its home (per this node's membership): ignored.
        // What the home last said stands until the home publishes (a handover, or
        // memberships that differ for a round).
        Some(e) if !e.home => {}
        Some(e) => {
            let rec = &e.record;
            rt.mesh.remote_health = Some(rec.health.into());
            rt.mesh.remote_queued = rec.load.queued_prefill_tokens;
            super::kv_shares::set_remote_kv_shares(rt, rec, &core.router.tenants);
            let queued = rt.queued_estimate();
            let learned = rt.mesh.learned;
            let in_region = info.region == local;
            if (in_region || round.pull_remote) && needs_pull(rt.mesh.pulled, &rec.summary) {
                // Warm-up waits for its own region's summaries only.
                plan.behind += usize::from(in_region);
                if !rt.mesh.pulling {
                    rt.mesh.pulling = true;
                    let (epoch, seq) = rt.mesh.pulled.unwrap_or((0, 0));
                    plan.pulls.push(Pull {
                        index: i,
                        id: info.id.clone(),
                        from: e.publisher_addr,
                        epoch,
                        seq,
                    });
                }
            }
            if learned {
                let fresh = rec.info(&info.id);
                if fresh != **info {
                    core.view.upsert(fresh);
                }
            }
            // A new figure (the home's next scrape) judges the peers' claims; the same one
            // again, gossiped each round, says nothing new.
            let fresh = core.view.replica(i).is_some_and(|r| {
                (r.load.waiting, r.load.running) != (rec.load.waiting, rec.load.running)
            });
            core.view.set_engine_load(
                i,
                rec.load.waiting,
                rec.load.running,
                rec.load.kv_usage.clamp(0.0, 1.0),
                queued,
            );
            if fresh {
                super::load_share::reweigh_claims(core, i, round.now);
            }
        }
        None => {
            // Nobody else publishes it: a replica known only from gossip has no one
            // vouching for it any more; a configured one keeps its own checks (this
            // node's own record, if any, only echoes them).
            // (Unless it is being handed over: its origin died and the new home has not
            // published it yet.)
            if !handing_over {
                rt.mesh.remote_health = rt.mesh.learned.then_some(Health::Unhealthy);
            }
            rt.mesh.remote_queued = 0;
            rt.mesh.remote_kv_shares = None;
        }
    }
}

/// Answers peers' summary requests and takes their block reports.
struct Handler(Weak<Node>);

impl MeshHandler for Handler {
    fn summary(&self, req: &SummaryRequest) -> Option<SummaryMessage> {
        let node = self.0.upgrade()?;
        let core = node.lock();
        let i = core.view.index_of(&req.replica_id)?;
        let rt = core.replicas.get(i)?;
        // Only the home's model is authoritative (or the old home's, while it still publishes
        // during a handover); a follower's copy has no addition log.
        (rt.mesh.home || rt.mesh.published.is_some())
            .then(|| rt.cache.summary().answer(req.epoch, req.seq))
    }

    fn block_report(&self, from: SocketAddr, report: BlockReport) {
        let Some(node) = self.0.upgrade() else {
            return;
        };
        let now = node.now();
        let refused = |reason: &str| {
            if let Some(m) = node.mesh_slot().metrics.get() {
                m.reports_refused.with_label_values(&[reason]).inc();
            }
        };
        // Only the region's live members route to its replicas.
        if !node.is_member_in(&node.cfg.region, from) {
            refused("not_a_region_member");
            return;
        }
        let keys: Vec<BlockKey> = report.keys.iter().copied().map(BlockKey).collect();
        let mut guard = node.lock();
        let core = &mut *guard;
        // The sender's tenant label, as this node's configuration numbers it.
        let tenant = core
            .router
            .tenants
            .kv_slot_of_label(report.kv_tenant.as_deref());
        let Some(i) = core.view.index_of(&report.replica_id) else {
            drop(guard);
            refused("unknown_replica");
            tracing::debug!(%from, replica = %report.replica_id, "block report for an unknown replica");
            return;
        };
        let Some(rt) = core.replicas.get_mut(i) else {
            return;
        };
        // Only the home's model takes reports (a handover's keys arrive once it is home).
        if !rt.mesh.home || rt.removed {
            drop(guard);
            refused("not_home");
            return;
        }
        if !rt.learn_reported(&keys, tenant, now) {
            return;
        }
        let home = rt.mesh.home;
        drop(guard);
        if home {
            node.mesh.changed.notify_one();
        }
    }

    fn load_update(&self, from: SocketAddr, update: LoadUpdate) {
        if let Some(node) = self.0.upgrade() {
            node.apply_load_update(from, update);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::summary::SummaryConfig;
    use crate::mesh::cluster::home_in;
    use crate::mesh::schema::WireHealth;
    use crate::node::config::{MeshSection, NodeConfig};
    use crate::replicas::entry::ReplicaConfig;
    use std::time::Duration;

    fn member(id: &str, port: u16, is_self: bool) -> Member {
        Member::for_test(id, port, is_self)
    }

    /// Node `a` of region `eu` with replicas `r0..r7` (the mesh is never started).
    fn eight_replicas_at_node_a() -> NodeConfig {
        crate::proxy::install_crypto_provider();
        let mut cfg = NodeConfig {
            region: "eu".into(),
            ..NodeConfig::default()
        };
        cfg.replicas = (0..8).map(ReplicaConfig::numbered).collect();
        cfg.mesh = Some(MeshSection {
            node_id: "a".into(),
            certs_dir: Some("/nonexistent".into()),
            ..MeshSection::default()
        });
        cfg
    }

    #[test]
    fn homes_publish_followers_pull_and_apply() {
        let cfg = eight_replicas_at_node_a();
        let node = Node::new(cfg.clone()).unwrap();
        let live = vec![member("a", 7000, true), member("b", 7001, false)];
        let plan = node.apply_membership("a", &live, &BTreeMap::new());
        let mine: Vec<String> = (0..8)
            .map(|i| format!("r{i}"))
            .filter(|id| home_in(&live, id, "eu").unwrap().0 == "a")
            .collect();
        assert!(!mine.is_empty() && mine.len() < 8, "homes spread: {mine:?}");
        // Its own replicas as home; b's too, as a stand-in, since b publishes none of them (b
        // may not have them in its config: it learns them from these records).
        let published: Vec<String> = plan.publish.iter().map(|(id, _, _)| id.clone()).collect();
        assert_eq!(published.len(), 8);
        for id in &published {
            let core = node.lock();
            let rt = &core.replicas[core.view.index_of(id).unwrap()];
            assert_eq!(rt.mesh.home, mine.contains(id), "{id}");
        }
        assert!(plan.pulls.is_empty(), "nothing advertised yet");
        // A second round with nothing new publishes nothing.
        assert!(node
            .apply_membership("a", &live, &BTreeMap::new())
            .publish
            .is_empty());

        // b publishes one of its replicas with a summary: a pulls it once, from b.
        let theirs = (0..8)
            .map(|i| format!("r{i}"))
            .find(|id| !mine.contains(id))
            .unwrap();
        let scfg = SummaryConfig::for_cluster(&cfg.cluster_id);
        let mut s = ReplicaSummary::new(5, 1000, &scfg).unwrap();
        s.insert(&[BlockKey(11), BlockKey(12)]);
        let i = node.lock().view.index_of(&theirs).unwrap();
        let info = node.lock().view.replica(i).unwrap().info.clone();
        let mut rec = ReplicaRecord::new(
            &info,
            Health::Unhealthy,
            &Default::default(),
            SummaryVersion {
                epoch: 5,
                seq: s.seq(),
                digest: s.digest(),
            },
        );
        rec.load.waiting = 7;
        let entry = ReplicaEntry {
            id: theirs.clone(),
            publisher: "b".into(),
            publisher_addr: live[1].gossip_addr,
            record: rec.clone(),
            home: true,
        };
        let records = BTreeMap::from([(theirs.clone(), entry)]);
        let plan = node.apply_membership("a", &live, &records);
        assert_eq!(plan.behind, 1);
        assert_eq!(
            plan.pulls,
            vec![Pull {
                index: i,
                id: theirs.clone(),
                from: live[1].gossip_addr,
                epoch: 0,
                seq: 0
            }]
        );
        {
            let core = node.lock();
            let r = core.view.replica(i).unwrap();
            assert_eq!(r.health, Health::Unhealthy, "the home's health counts");
            assert_eq!(r.load.waiting, 7, "the home's load counts");
            assert_eq!(
                core.replicas[i].mesh.report_target(),
                Some(live[1].gossip_addr)
            );
        }
        // In flight: no second pull.
        assert!(node.apply_membership("a", &live, &records).pulls.is_empty());
        let kind = node
            .apply_pulled(i, &SummaryMessage::Snapshot(s.snapshot()))
            .unwrap();
        assert_eq!(kind, PullKind::Snapshot);
        let keys = [BlockKey(11), BlockKey(12)];
        assert_eq!(node.lock().view.hit(i, &keys, Duration::ZERO), 2);
        // Up to date now.
        let plan = node.apply_membership("a", &live, &records);
        assert_eq!((plan.behind, plan.pulls.len()), (0, 0));
        // A delta from the same epoch applies on top.
        s.insert(&[BlockKey(13)]);
        let delta = s.answer(5, 1);
        assert!(matches!(delta, SummaryMessage::Delta(_)));
        assert_eq!(node.apply_pulled(i, &delta).unwrap(), PullKind::Delta);
        let keys = [BlockKey(11), BlockKey(12), BlockKey(13)];
        assert_eq!(node.lock().view.hit(i, &keys, Duration::ZERO), 3);
        assert_eq!(rec.health, WireHealth::Unhealthy);

        // b dies: a becomes home of everything, with an epoch above b's.
        let alone = vec![live[0].clone()];
        let plan = node.apply_membership("a", &alone, &BTreeMap::new());
        assert_eq!(plan.publish.len(), 8 - mine.len());
        let (_, r, _) = plan
            .publish
            .iter()
            .find(|(id, _, _)| *id == theirs)
            .unwrap();
        assert!(r.summary.epoch > 5);
        node.lock().replicas[i]
            .cache
            .record_routed(&[BlockKey(99)], Duration::ZERO);

        // b comes back: a keeps publishing b's replicas until b publishes them (a new home may
        // know them only from a's records), then withdraws and hands its keys over.
        let plan = node.apply_membership("a", &live, &BTreeMap::new());
        assert!(plan.unpublish.is_empty() && plan.handover.is_empty());
        assert_eq!(
            node.lock().replicas[i].mesh.report_target(),
            Some(live[1].gossip_addr)
        );
        let mut taken = live.clone();
        Arc::make_mut(&mut taken[1].replicas).insert(theirs.clone(), rec.clone());
        let plan = node.apply_membership("a", &taken, &records);
        assert!(plan.unpublish.contains(&theirs));
        let (id, to, keys) = plan
            .handover
            .iter()
            .find(|(id, _, _)| *id == theirs)
            .unwrap();
        assert_eq!((id, *to), (&theirs, live[1].gossip_addr));
        assert_eq!(keys, &vec![99]);
    }

    #[test]
    fn block_reports_only_from_region_members_and_only_at_the_home() {
        let cfg = eight_replicas_at_node_a();
        let node = Node::new(cfg).unwrap();
        let live = vec![member("a", 7000, true), member("b", 7001, false)];
        node.apply_membership("a", &live, &BTreeMap::new());
        let handler = Handler(Arc::downgrade(&node));
        let mine = (0..8)
            .map(|i| format!("r{i}"))
            .find(|id| home_in(&live, id, "eu").unwrap().0 == "a");
        let theirs = (0..8)
            .map(|i| format!("r{i}"))
            .find(|id| home_in(&live, id, "eu").unwrap().0 == "b");
        let holds = |id: &str, key: u64| {
            let core = node.lock();
            core.replicas[core.view.index_of(id).unwrap()]
                .cache
                .contains(BlockKey(key))
        };
        let report = |id: &str, key: u64| BlockReport {
            replica_id: id.to_owned(),
            keys: vec![key],
            kv_tenant: None,
        };
        let b = live[1].gossip_addr;
        let stranger: SocketAddr = "127.0.0.1:9999".parse().unwrap();
        // Before b is known as a live member of the region, nobody's reports count.
        assert!(mine.is_some() && theirs.is_some());
        if let Some(id) = &mine {
            handler.block_report(b, report(id, 1));
            assert!(!holds(id, 1));
        }
        node.set_mesh_members(&live);
        if let Some(id) = &mine {
            handler.block_report(stranger, report(id, 2));
            assert!(!holds(id, 2), "a stranger's report was taken");
            handler.block_report(b, report(id, 3));
            assert!(holds(id, 3), "a member's report at the home was refused");
        }
        if let Some(id) = &theirs {
            handler.block_report(b, report(id, 4));
            assert!(
                !holds(id, 4),
                "a report for a replica this node is not home of was taken"
            );
        }
    }
}
