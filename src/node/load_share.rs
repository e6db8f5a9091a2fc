//! The node's side of load sharing (`mesh/load_share.rs`): tell the region's other nodes what
//! this node has in flight at each replica within milliseconds, and route on what they tell it.
//!
//! Exists because a node's own in-flight count is fresh but partial: with three nodes behind a
//! load balancer each sees a third of the traffic at once and the rest a scrape or gossip round
//! late, so they pile onto the same replica in bursts. With the peers' counts merged, every
//! node's cost model sees the region's load as one router would.
//!
//! The task [`share_load`] wakes when this node's counts change (`NodeMesh::load_changed`,
//! notified by routing and tickets), waits out `load_share_interval_ms` since its last flush
//! (longer when the bytes sent need it: `load_share_budget_kib_s`, [`Pacing`]), and sends the
//! changed counts, with the tips of the prompts routed since (`core/peer_tips.rs`), to
//! every live node of its region; every second it re-sends all non-zero counts. Tips a peer sends
//! join the view's `peer_tips` for the replicas of this region this node knows, bounded in
//! length and wait ([`MAX_TIP_BLOCKS`], [`MAX_TIP_READY_MS`]) and in number (the store's cap). Received updates go through [`Node::apply_load_update`]: only from live
//! members of this node's region, bounded per claim by the mesh layer, then bounded again in sum
//! by the engine's own figures here ([`peer_cap`], [`refresh_shared_load`]; judged at each
//! figure, [`reweigh_claims`]), so peers can add at most a small phantom load (at most
//! `max(16, max_in_flight / 8)` requests above what the engine last reported, for at most
//! `unbacked_grace` once a figure shows them, then none) of at most the replica's KV capacity
//! in tokens.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::hold::HoldOutcome;
use super::state::{Core, Node, PendingTip, MAX_PENDING_TIPS};
use crate::core::dp_rank::MAX_RANKS;
use crate::core::hold;
use crate::core::keys::BlockKey;
use crate::core::peer_tips::{Answer, Claim, PeerPrefill, Tip};
use crate::core::view::ReplicaState;
use crate::mesh::load_share::{
    judge_tolerance, LoadPublisher, LoadShareConfig, LoadShareError, LoadUpdate, RoutedTip,
};
use crate::mesh::Mesh;
use crate::shutdown::stopped;

/// Most requests the peers' claims may add above the engine's last reported count: enough for
/// the requests a busy region sends a replica between two scrapes, small against a liar.
fn peer_slack(r: &ReplicaState) -> u32 {
    (r.info.max_in_flight / 8).max(16)
}

/// Most requests the peers' claims may count at all: the engine's last reported count plus
/// [`peer_slack`], never above `max_in_flight`.
pub fn peer_cap(r: &ReplicaState) -> u32 {
    let engine = r.load.waiting.saturating_add(r.load.running);
    r.info
        .max_in_flight
        .min(engine.saturating_add(peer_slack(r)))
}

/// Recomputes replica `i`'s load from the peers' claims (after they or the engine's figures
/// changed, or time passed): bounded by [`peer_cap`], weighed against the engine's figures
/// (`PeerLoads::weigh`: what it does not confirm counts only for a few seconds), and their
/// tokens bounded per request and in all by the replica's KV capacity.
pub(super) fn refresh_shared_load(
    core: &mut Core,
    i: usize,
    max_tokens_per_request: u64,
    now: Duration,
) {
    let (Some(r), Some(rt)) = (core.view.replica(i), core.replicas.get(i)) else {
        return;
    };
    let (n, p) = core.peer_loads.totals(&r.info.id);
    // What the engine reported beyond this node's own requests there when read: the peers'
    // at most.
    let backed = r.load.engine_others;
    let n = core
        .peer_loads
        .weigh(&r.info.id, n.min(peer_cap(r)), backed, peer_slack(r), now);
    // Tokens: a running request's prompt has its KV blocks already (the engine reports the
    // share in use), a waiting or not yet reported one at most a request's worth. So a claim
    // that rides on the scrape's lag (the engine still counting this node's finished request)
    // weighs the tokens the engine holds, not a whole cache's worth.
    let kv = r.info.capacity_tokens.max(1);
    let per_request = max_tokens_per_request.min(kv);
    let held = (f64::from(r.load.kv_usage.clamp(0.0, 1.0)) * kv as f64) as u64;
    let unheld = r.load.waiting.saturating_add(n.saturating_sub(backed));
    let p = p
        .min(u64::from(n).saturating_mul(per_request))
        .min(held.saturating_add(u64::from(unheld).saturating_mul(per_request)))
        .min(kv);
    if (n, p) == (rt.peer_in_flight, rt.peer_pending_tokens) {
        return;
    }
    let rt = &mut core.replicas[i];
    if p < rt.peer_pending_tokens {
        // The other nodes' prompts there are getting their first bytes.
        rt.progress = rt.progress.wrapping_add(1);
    }
    rt.peer_in_flight = n;
    rt.peer_pending_tokens = p;
    let queued = rt.queued_estimate();
    core.view.set_shared_load(i, n, queued);
}

/// Judges the peers' claims at replica `i` against its engine's figures just read (a scrape, or
/// its home's record), then weighs them again: what the engine no longer confirms stops
/// counting now, not at the next update.
pub(super) fn reweigh_claims(core: &mut Core, i: usize, now: Duration) {
    let Some(r) = core.view.replica(i) else {
        return;
    };
    let (n, p) = core.peer_loads.totals(&r.info.id);
    let backed = r.load.engine_others;
    core.peer_loads.judge(
        &r.info.id,
        n.min(peer_cap(r)),
        backed,
        judge_tolerance(peer_slack(r)),
        now,
    );
    if (n, p) != (0, 0) {
        let max_tokens = LoadShareConfig::default().max_tokens_per_request;
        refresh_shared_load(core, i, max_tokens, now);
    }
}

/// Longest wait a peer may announce before a routed prefix counts (10 minutes: a prefill
/// predicted further off is a replica hopelessly queued). A tip lives its wait and the overlay's
/// TTL; an hour let one member's junk keys stay that long.
const MAX_TIP_READY_MS: u32 = 600_000;
/// Longest prefix a tip may claim, in blocks (16M tokens at 16-token blocks: beyond any context).
const MAX_TIP_BLOCKS: u32 = 1 << 20;

/// Puts a peer's routed prefixes into the view, for replicas of `region` it knows, and the ranks
/// it named into those replicas' rank hints (a rank past the replica's ranks is dropped, the tip
/// kept); returns how many it dropped (unknown replica, out of bounds, store full).
fn learn_tips(
    core: &mut Core,
    tips: &[RoutedTip],
    region: &str,
    from: SocketAddr,
    now: Duration,
) -> usize {
    let view = &mut core.view;
    let mut dropped = 0;
    for t in tips {
        let replica = view
            .index_of(&t.replica)
            .filter(|i| view.replica(*i).is_some_and(|r| r.info.region == region));
        let (Some(replica), true) = (
            replica,
            t.blocks > 0 && t.blocks <= MAX_TIP_BLOCKS && t.ready_ms <= MAX_TIP_READY_MS,
        ) else {
            dropped += 1;
            continue;
        };
        if let (Some(rank), Some(rt)) = (t.rank, core.replicas.get_mut(replica)) {
            let ranks = rt.kv_source.as_ref().map_or(0, |k| usize::from(k.dp_ranks));
            if usize::from(rank) < ranks.min(MAX_RANKS) {
                rt.rank_hints.insert(BlockKey(t.key), t.blocks, rank, now);
            }
        }
        let ready = now + Duration::from_millis(u64::from(t.ready_ms));
        let tip = Tip {
            replica,
            blocks: t.blocks,
            ready,
            until: ready + view.overlay_ttl,
        };
        let held = if t.first_byte {
            view.peer_tips
                .insert_first_byte_from(BlockKey(t.key), tip, from)
        } else if t.withdrawn {
            // A withdrawal of a claim this node never held is no news.
            view.peer_tips.withdraw_from(BlockKey(t.key), tip, from);
            true
        } else {
            let claim = Claim { from, at: now };
            view.peer_tips.insert_claim(BlockKey(t.key), tip, claim)
        };
        if !held {
            dropped += 1;
        }
    }
    dropped
}

/// Most tips one load update carries: every answer's (with its ladder), every pending prompt's
/// own (at most `MAX_PENDING_TIPS`), then ladder tips up to this many in all. A prompt of 32k tokens names 8
/// shorter prefixes, so a full queue of them would otherwise be ~9,000 tips (~350 KB) to each
/// peer in one flush; what is left out arrives with the next summary round, as before tips.
const MAX_TIPS_PER_UPDATE: usize = 2 * MAX_PENDING_TIPS;

/// The tips of `pending` as peers receive them: answers first (first bytes and withdrawals, each
/// with its ladder), then each claimed prompt's own, then the shorter prefixes its ladder names (each a plain tip of its own length, so that nodes of every version read them),
/// each (replica, key, blocks) once per update — a system prompt routed a hundred times between
/// two updates is named once, as soon as any of them is ready, and as answered if any of them
/// got its first byte (a prompt routed and answered between two updates is news of both) — and
/// at most [`MAX_TIPS_PER_UPDATE`] in all.
fn routed_tips<'a>(
    pending: &[PendingTip],
    id_of: impl Fn(usize) -> Option<&'a str>,
    now: Duration,
) -> Vec<RoutedTip> {
    let mut named: HashMap<(usize, BlockKey, u32), usize> = HashMap::new();
    let mut out: Vec<RoutedTip> = Vec::new();
    let mut add = |t: &PendingTip, key: BlockKey, blocks: u32, rank: Option<u16>| {
        let Some(id) = id_of(t.replica) else {
            return;
        };
        let ready_ms = t.ready.saturating_sub(now).as_millis();
        let ready_ms = u32::try_from(ready_ms).unwrap_or(u32::MAX);
        if let Some(tip) = named
            .get(&(t.replica, key, blocks))
            .and_then(|&i| out.get_mut(i))
        {
            tip.ready_ms = tip.ready_ms.min(ready_ms);
            tip.first_byte |= t.first_byte;
            // Withdrawn only if every request of it named in this update ended unanswered.
            tip.withdrawn &= t.withdrawn && !tip.first_byte;
            return;
        }
        if out.len() < MAX_TIPS_PER_UPDATE {
            named.insert((t.replica, key, blocks), out.len());
            out.push(RoutedTip {
                replica: id.to_owned(),
                key: key.0,
                blocks,
                ready_ms,
                rank,
                first_byte: t.first_byte,
                withdrawn: t.withdrawn,
            });
        }
    };
    // Answers first, whole (their ladders too: a peer may hold on any rung of a claim), then
    // the claims' own tips, then their ladders: what the cap leaves out is news, not an answer
    // a peer's hold waits for.
    for t in pending.iter().filter(|t| t.is_answer()) {
        add(t, t.key, t.blocks, t.rank);
        for (key, blocks) in t.ladder.prefixes() {
            add(t, key, blocks, None);
        }
    }
    let claims = || pending.iter().filter(|t| !t.is_answer());
    for t in claims() {
        add(t, t.key, t.blocks, t.rank);
    }
    for t in claims() {
        for (key, blocks) in t.ladder.prefixes() {
            add(t, key, blocks, None);
        }
    }
    out
}

impl Node {
    /// A load update from the peer at `from`: applied if `from` is a live node of this node's
    /// region, for replicas of this region this node knows.
    pub(super) fn apply_load_update(&self, from: SocketAddr, mut update: LoadUpdate) {
        let refused = |reason: &str| {
            if let Some(m) = self.mesh_slot().metrics.get() {
                m.load_refused.with_label_values(&[reason]).inc();
            }
        };
        let region = &self.cfg.region;
        if !self.is_peer_in(region, from) {
            refused("not_a_region_peer");
            return;
        }
        let cfg = LoadShareConfig::default();
        let now = self.now();
        let tips = std::mem::take(&mut update.tips);
        // Asked before the node's lock: the bars' own lock is not nested inside it.
        let barred = self.holds.is_barred(from, now);
        let mut guard = self.lock();
        let core = &mut *guard;
        let view = &core.view;
        let applied = core.peer_loads.apply(from, update, now, |id| {
            view.index_of(id)
                .and_then(|i| view.replica(i))
                .filter(|r| &r.info.region == region)
                .map(|r| r.info.max_in_flight)
        });
        match applied {
            Ok(a) => {
                // Tips only from a datagram that was not stale (a late one's prefixes are old),
                // and not from a peer barred for claims that went unanswered: a member that lied
                // about what it computes is not believed about what it routed either.
                let (dropped_tips, barred_tips) = if barred {
                    (0, tips.len())
                } else {
                    (learn_tips(core, &tips, region, from, now), 0)
                };
                for id in &a.changed {
                    if let Some(i) = core.view.index_of(id) {
                        refresh_shared_load(core, i, cfg.max_tokens_per_request, now);
                    }
                }
                drop(guard);
                if !barred && tips.iter().any(|t| t.first_byte || t.withdrawn) {
                    self.mesh_slot().peer_answered.notify_waiters();
                }
                if let Some(m) = self.mesh_slot().metrics.get() {
                    for (reason, n) in [
                        ("unknown_replica", a.unknown),
                        ("clamped", a.clamped),
                        ("tip_dropped", dropped_tips),
                        ("tip_from_barred_peer", barred_tips),
                    ] {
                        if n > 0 {
                            m.load_refused.with_label_values(&[reason]).inc_by(n as u64);
                        }
                    }
                }
            }
            Err(LoadShareError::Stale { .. }) => refused("stale"),
            Err(LoadShareError::TooManyPeers) => refused("too_many_peers"),
            Err(LoadShareError::Malformed(_)) => refused("malformed"),
        }
    }

    /// Holds a request routed to replica `i`, credited with `hit_blocks` of `keys`, while a
    /// prefill another node of the region sent there still computes most of them (the rule:
    /// `core::hold::peer_plan`), until that peer's first-byte tip, its tip's end, or the
    /// deadline. The region-wide half of the node's own hold (`Holds::before_send`): behind a
    /// balancer a turn's predecessor was routed by another node two times in three
    /// (docs/mesh.md). Only on claims this node trusts (`Holds::trusts`: the peer not barred
    /// for unanswered claims, the engine not contradicting it); how the wait ends is evidence
    /// for or against the claiming peer (`Holds::judge`). Returns at once, without the node's
    /// lock, where nothing can qualify.
    pub async fn hold_on_peer_prefill(
        &self,
        i: usize,
        keys: &[BlockKey],
        hit_blocks: u32,
    ) -> HoldOutcome {
        let rule = *self.holds.rule();
        let need = hold::riding_needed(&rule, keys.len());
        if !rule.enabled || self.cfg.mesh.is_none() || (hit_blocks as usize) < need {
            return HoldOutcome::NotHeld;
        }
        let credited = &keys[..(hit_blocks as usize).min(keys.len())];
        let now = self.now();
        let distrusted = std::cell::Cell::new(false);
        let under_way = {
            let core = self.lock();
            // This node's requests the engine can have: its in flight there, less those it
            // holds (booked, not sent), this one among them.
            let unsent = self.holds.held_at(i).saturating_add(1);
            let engine = core.view.replica(i).map_or((0, 0), |r| {
                let l = &r.load;
                (
                    l.waiting.saturating_add(l.running),
                    l.in_flight.saturating_sub(unsent),
                )
            });
            core.view
                .peer_tips
                .in_prefill_at(i, credited, need, now, |p| {
                    let trusted = self.holds.trusts(p, now, engine);
                    distrusted.set(distrusted.get() || !trusted);
                    trusted
                })
        };
        let plan = under_way.and_then(|p| {
            hold::peer_plan(&rule, keys.len(), hit_blocks, p.blocks, now).map(|d| (p, d))
        });
        let Some((claimed, deadline)) = plan else {
            if distrusted.get() {
                self.holds.count_distrusted();
            }
            return HoldOutcome::NotHeld;
        };
        let Some(slot) = self.holds.take_slot(i) else {
            return HoldOutcome::Full;
        };
        tracing::debug!(replica = i, hit_blocks, "held on a peer's prefill");
        let released = self
            .wait_for_peer_prefill(i, credited, need as u32, deadline)
            .await;
        self.judge_claim(i, credited, &claimed, released);
        slot.end(if released {
            HoldOutcome::Released
        } else {
            HoldOutcome::Deadline
        })
    }

    /// Counts how a hold on the peer's `claimed` prefill of `keys` at replica `i` ended: for
    /// the peer where its own first-byte tip came, against it where the wait ended without any
    /// (`released` false: the deadline; or the claim expired unanswered), neither where only
    /// another peer answered ([`Answer::ByAnother`]: it vouches for nobody but itself).
    fn judge_claim(&self, i: usize, keys: &[BlockKey], claimed: &PeerPrefill, released: bool) {
        let tip = (claimed.blocks as usize).checked_sub(1);
        let (Some(claim), Some(&key)) = (claimed.claim, tip.and_then(|j| keys.get(j))) else {
            return;
        };
        let now = self.now();
        let answer = if released {
            let core = self.lock();
            core.view.peer_tips.answer(i, key, claimed.blocks, now)
        } else {
            Answer::Unanswered
        };
        match answer {
            Answer::ByClaimer => self.holds.judge(claim.from, key, true, now),
            Answer::Unanswered => self.holds.judge(claim.from, key, false, now),
            Answer::ByAnother => {}
        }
    }

    /// Waits until no prefill a peer sent to replica `i` of at least `blocks` leading blocks of
    /// `keys` is under way as far as its tips say ([`PeerTips::in_prefill_at`]: its first-byte
    /// tip came, or its tip expired), or until `deadline` (this node's clock, [`Node::now`]).
    /// True when nothing names it under way any more, false at the deadline. For a request
    /// held to ride on another node's prefill: this node sees its own prefills' first bytes
    /// first-hand, a peer's only by its tip (docs/mesh.md). Woken by each update carrying a
    /// first-byte tip.
    ///
    /// [`PeerTips::in_prefill_at`]: crate::core::peer_tips::PeerTips::in_prefill_at
    pub async fn wait_for_peer_prefill(
        &self,
        i: usize,
        keys: &[BlockKey],
        blocks: u32,
        deadline: Duration,
    ) -> bool {
        loop {
            // Registered before the check, so an answer arriving between the two still wakes it.
            let answered = self.mesh_slot().peer_answered.notified();
            tokio::pin!(answered);
            answered.as_mut().enable();
            let now = self.now();
            let under_way =
                self.lock()
                    .view
                    .peer_tips
                    .in_prefill_at(i, keys, blocks as usize, now, |_| true);
            if under_way.is_none() {
                return true;
            }
            let Some(left) = deadline.checked_sub(now).filter(|d| !d.is_zero()) else {
                return false;
            };
            if tokio::time::timeout(left, answered).await.is_err() {
                return false;
            }
        }
    }

    /// Forgets the claims of peers no longer live in this node's region, and claims nobody
    /// refreshed in time.
    pub(super) fn prune_peer_loads(&self, live: &HashSet<SocketAddr>) {
        let cfg = LoadShareConfig::default();
        let now = self.now();
        let mut guard = self.lock();
        let core = &mut *guard;
        let mut changed = core.peer_loads.retain_peers(|a| live.contains(a));
        changed.extend(core.peer_loads.expire(now));
        // Claims the engine has not confirmed lose their weight as time passes, unchanged.
        changed.extend(core.peer_loads.unbacked());
        core.view.peer_tips.expire(now);
        for id in changed {
            if let Some(i) = core.view.index_of(&id) {
                refresh_shared_load(core, i, cfg.max_tokens_per_request, now);
            }
        }
    }

    /// The datagrams that tell peers this node's current counts (see `LoadPublisher::flush`):
    /// requests in flight and pending prompt tokens at each replica of its region.
    fn load_datagrams(&self, publisher: &mut LoadPublisher) -> Vec<Vec<u8>> {
        let now = self.now();
        let mut core = self.lock();
        let core = &mut *core;
        let region = &self.cfg.region;
        let tips = routed_tips(
            &core.pending_tips,
            |i| core.view.replica(i).map(|r| r.info.id.as_str()),
            now,
        );
        core.pending_tips.clear();
        let own = core
            .view
            .replicas()
            .iter()
            .zip(&core.replicas)
            .filter(|(r, _)| &r.info.region == region)
            .map(|(r, rt)| {
                (
                    r.info.id.as_str(),
                    r.load.in_flight,
                    rt.pending_prefill_tokens,
                )
            });
        publisher.flush(own, tips, now)
    }
}

/// How often [`share_load`] may flush: a floor between flushes, and a byte budget kept as a
/// credit (a token bucket holding at most a quarter second of budget). A small region's
/// flushes never exhaust it and keep the floor; a large busy one's flushes each send to many
/// peers, run the credit down and then wait until it is paid back.
#[derive(Clone, Debug)]
pub(super) struct Pacing {
    /// Least pause after a flush (`mesh.load_share_interval_ms`).
    floor: Duration,
    /// Most bytes sent per second to all peers together (`mesh.load_share_budget_kib_s`).
    bytes_per_s: f64,
    /// Bytes that may go out now without waiting (negative: owed).
    credit: f64,
    /// When the credit was last brought up to date (the task's clock).
    at: Option<Duration>,
}

impl Pacing {
    pub fn new(floor: Duration, bytes_per_s: u64) -> Self {
        Self {
            floor,
            bytes_per_s: bytes_per_s.max(1) as f64,
            credit: 0.0,
            at: None,
        }
    }

    /// The pause after a flush at `now` that sent `sent` bytes (every datagram times every
    /// peer): the floor, or until the credit is paid back, but at most a second, so peers'
    /// claims (3 s) are refreshed in time even under a budget too small for one flush.
    pub fn pause_after(&mut self, sent: u64, now: Duration) -> Duration {
        let burst = self.bytes_per_s / 4.0;
        self.credit = match self.at {
            Some(at) => {
                (self.credit + self.bytes_per_s * now.saturating_sub(at).as_secs_f64()).min(burst)
            }
            None => burst,
        };
        self.at = Some(now);
        self.credit -= sent as f64;
        let owed_s = ((-self.credit).max(0.0) / self.bytes_per_s).min(1.0);
        self.floor.max(Duration::from_secs_f64(owed_s))
    }
}

/// Sends this node's load to its region's nodes until `stop` (see the module comment).
pub(super) async fn share_load(
    node: Arc<Node>,
    mesh: Arc<Mesh>,
    mut pacing: Pacing,
    mut stop: watch::Receiver<bool>,
) {
    let cfg = LoadShareConfig::default();
    let mut publisher = LoadPublisher::new(rand::random(), &cfg);
    let mut last_prune = tokio::time::Instant::now();
    let started = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = node.mesh_slot().load_changed.notified() => {}
            _ = tokio::time::sleep(cfg.refresh) => {}
            _ = stopped(&mut stop) => return,
        }
        let peers: Vec<SocketAddr> = node
            .peers_in(&node.cfg.region)
            .iter()
            .map(|p| p.quic_addr)
            .collect();
        if last_prune.elapsed() >= cfg.refresh {
            last_prune = tokio::time::Instant::now();
            node.prune_peer_loads(&peers.iter().copied().collect());
        }
        let datagrams = node.load_datagrams(&mut publisher);
        let mut sent = 0u64;
        for d in &datagrams {
            for p in &peers {
                mesh.transport().send_load(*p, d);
            }
            sent += (d.len() * peers.len()) as u64;
        }
        // Coalesce: changes during this pause go out together in the next flush. The pause
        // grows with what the flush cost, so a large region's bytes stay bounded.
        tokio::time::sleep(pacing.pause_after(sent, started.elapsed())).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::view::{ReplicaInfo, View};

    /// The region peer A's address, as B's load updates come from it.
    const PEER: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(
        std::net::Ipv4Addr::new(127, 0, 0, 1),
        7001,
    ));

    /// Two meshed nodes, A and B, of one region over one healthy replica `r0` predicted to
    /// prefill `prefill_tokens_per_s`, holding by `hold`; their certificates in `certs`.
    fn two_meshed_nodes(
        certs: &tempfile::TempDir,
        prefill_tokens_per_s: f64,
        hold: crate::node::config::hold::HoldSection,
    ) -> (Arc<Node>, Arc<Node>) {
        use crate::core::view::Health;
        use crate::node::config::{MeshSection, NodeConfig};
        use crate::replicas::entry::ReplicaConfig;

        crate::proxy::install_crypto_provider();
        crate::mesh::certs::init_dir(certs.path()).unwrap();
        let cfg = |id: &str| NodeConfig {
            replicas: vec![ReplicaConfig {
                id: Some("r0".into()),
                models: vec!["m".into()],
                prefill_tokens_per_s,
                ..ReplicaConfig::from_url("http://10.0.0.1:8000")
            }],
            mesh: Some(MeshSection {
                node_id: id.into(),
                certs_dir: Some(certs.path().to_owned()),
                ..MeshSection::default()
            }),
            hold: hold.clone(),
            ..NodeConfig::default()
        };
        for id in ["a", "b"] {
            crate::mesh::certs::issue_in_dir(certs.path(), id).unwrap();
        }
        let (a, b) = (Node::new(cfg("a")).unwrap(), Node::new(cfg("b")).unwrap());
        for n in [&a, &b] {
            n.lock().view.set_health(0, Health::Healthy);
        }
        (a, b)
    }

    #[test]
    fn a_routed_prompt_is_named_with_its_ladder_and_a_shared_prefix_once() {
        // Two questions under one 32-block system prompt, routed to replica 0 between two
        // updates: each question's own tip, and the system prompt's ladder keys once.
        let prompt = |q: u64| -> Vec<BlockKey> {
            (0..32)
                .map(BlockKey)
                .chain((0..8).map(|i| BlockKey(q * 1000 + i)))
                .collect()
        };
        let now = Duration::from_secs(1);
        let ready = now + Duration::from_millis(40);
        let pending: Vec<PendingTip> = [1, 2]
            .iter()
            .filter_map(|q| PendingTip::new(0, &prompt(*q), ready, Some(1)))
            .collect();
        let tips = routed_tips(&pending, |i| (i == 0).then_some("r0"), now);
        let named: Vec<(u64, u32, Option<u16>)> =
            tips.iter().map(|t| (t.key, t.blocks, t.rank)).collect();
        assert_eq!(
            named,
            vec![
                (1007, 40, Some(1)),
                (2007, 40, Some(1)),
                (3, 4, None),
                (7, 8, None),
                (15, 16, None),
                (31, 32, None),
            ]
        );
        assert!(tips.iter().all(|t| t.replica == "r0" && t.ready_ms == 40));
        // A replica the view no longer has is skipped.
        assert!(routed_tips(&pending, |_| None, now).is_empty());
        // A full queue of 32k-token prompts (512 blocks, 7 ladder keys each): every prompt's own
        // tip goes, ladder tips only up to the update's cap.
        let long: Vec<PendingTip> = (0..MAX_PENDING_TIPS as u64)
            .filter_map(|q| {
                let keys: Vec<BlockKey> = (0..512).map(|i| BlockKey(q << 20 | i)).collect();
                PendingTip::new(0, &keys, ready, None)
            })
            .collect();
        let tips = routed_tips(&long, |_| Some("r0"), now);
        assert_eq!(tips.len(), MAX_TIPS_PER_UPDATE);
        assert_eq!(
            tips.iter().filter(|t| t.blocks == 512).count(),
            MAX_PENDING_TIPS
        );
        // Answers queued after a full queue of claims still go, ladders and all, first.
        let mut pending = long;
        for q in 0..8u64 {
            let keys: Vec<BlockKey> = (0..512)
                .map(|i| BlockKey((1 << 40) | q << 20 | i))
                .collect();
            if let Some(t) = PendingTip::at_first_byte(0, &keys, now, None) {
                t.queue_answer(&mut pending);
            }
        }
        assert_eq!(pending.len(), MAX_PENDING_TIPS + 8);
        let tips = routed_tips(&pending, |_| Some("r0"), now);
        let answered = tips.iter().filter(|t| t.first_byte).count();
        assert_eq!(
            answered,
            8 * 8,
            "each answer's own tip and its 7 rungs: {answered}"
        );
        assert!(tips[..answered].iter().all(|t| t.first_byte));
    }

    fn view(max_in_flight: u32) -> View {
        let mut v = View::new("eu", 16);
        v.upsert(ReplicaInfo {
            id: "r0".into(),
            url: "http://127.0.0.1:1".into(),
            region: "eu".into(),
            zone: String::new(),
            pool: "shared".into(),
            models: vec!["m".into()],
            capacity_tokens: 1 << 20,
            prefill_tokens_per_s: 50_000.0,
            prefill_attention_ms_per_pair: crate::core::view::DEFAULT_PREFILL_ATTENTION_MS_PER_PAIR,
            max_in_flight,
            pd: Default::default(),
            kv_load: None,
        });
        v
    }

    #[test]
    fn a_small_regions_flushes_keep_the_floor_and_a_large_ones_pay_for_their_bytes() {
        let ms = Duration::from_millis;
        let budget = 32 * 1024;
        // 3 nodes: a burst of 10 flushes of 200 bytes (100 to each of 2 peers), 2 ms apart,
        // rides on the credit.
        let mut small = Pacing::new(ms(2), budget);
        let mut t = Duration::ZERO;
        for _ in 0..10 {
            assert_eq!(small.pause_after(200, t), ms(2));
            t += ms(2);
        }
        // 100 nodes: 9,900 bytes a flush. Once the credit is spent, each flush waits for its
        // bytes: ~300 ms at 32 KiB/s.
        let mut big = Pacing::new(ms(2), budget);
        let (mut t, mut sent) = (Duration::ZERO, 0u64);
        for _ in 0..50 {
            t += big.pause_after(9_900, t);
            sent += 9_900;
        }
        let rate = sent as f64 / t.as_secs_f64();
        assert!(rate <= budget as f64 * 1.2, "{rate} B/s");
        assert!(rate >= budget as f64 * 0.8, "{rate} B/s");
        // Whatever was sent, a flush waits at most a second.
        assert_eq!(big.pause_after(u64::MAX / 2, t), Duration::from_secs(1));
    }

    #[test]
    fn a_peers_tip_names_the_rank_for_the_prefixs_follow_ups_here() {
        use crate::core::router::{Decision, RouteRequest};
        use crate::core::view::Health;
        use crate::node::config::NodeConfig;
        use crate::replicas::entry::ReplicaConfig;
        use crate::replicas::kv_events::KvEventsSource;

        crate::proxy::install_crypto_provider();
        // A replica of 4 ranks whose events this node does not follow (another node is its
        // home, or its stream is down): its model is approximate, it knows no rank sets.
        let cfg = NodeConfig {
            replicas: vec![ReplicaConfig {
                id: Some("r0".into()),
                models: vec!["m".into()],
                kv_events: Some(KvEventsSource {
                    dp_ranks: 4,
                    ..KvEventsSource::new("tcp://127.0.0.1:5557")
                }),
                ..ReplicaConfig::from_url("http://10.0.0.1:8000")
            }],
            ..NodeConfig::default()
        };
        let node = Node::new(cfg).unwrap();
        let keys: Vec<BlockKey> = (0..6).map(BlockKey).collect();
        let route = |keys: &[BlockKey]| {
            let req = RouteRequest::plain("m", keys, 16 * keys.len() as u64);
            match node.route(&req) {
                (Decision::Route(d), _) => d.dp_rank,
                (other, _) => panic!("{other:?}"),
            }
        };
        {
            let mut core = node.lock();
            core.view.set_health(0, Health::Healthy);
            let region = core.view.local_region.clone();
            let now = node.now();
            // A peer sent the first 4 blocks to rank 2, and claims rank 9 for another prefix
            // (past the replica's 4 ranks: the rank is dropped, the tip kept).
            let tip = |key: u64, blocks: u32, rank: u16| RoutedTip {
                replica: "r0".into(),
                key,
                blocks,
                ready_ms: 0,
                rank: Some(rank),
                first_byte: false,
                withdrawn: false,
            };
            let dropped = learn_tips(
                &mut core,
                &[tip(3, 4, 2), tip(77, 1, 9)],
                &region,
                PEER,
                now,
            );
            assert_eq!(dropped, 0);
            assert_eq!(core.replicas[0].rank_hints.len(), 1);
        }
        // The prefix's follow-up goes to rank 2, whichever node routes it.
        assert_eq!(route(&keys), Some(2));
        // What this node routes names a rank too, and its own follow-ups find it.
        let other: Vec<BlockKey> = (100..103).map(BlockKey).collect();
        let first = route(&other).unwrap();
        let longer: Vec<BlockKey> = (100..108).map(BlockKey).collect();
        assert_eq!(route(&longer), Some(first));
    }

    /// Two meshed nodes whose replica's prefill is predicted far slower than it runs (a 96-token
    /// prompt ~96 s), and the ticket of a 6-block prompt A routed there.
    fn a_slow_prefill_routed_at_a() -> (
        tempfile::TempDir,
        Arc<Node>,
        Arc<Node>,
        Vec<BlockKey>,
        crate::node::routing::Ticket,
    ) {
        use crate::core::router::{Decision, RouteRequest};
        let certs = tempfile::tempdir().unwrap();
        let (a, b) = two_meshed_nodes(&certs, 1.0, Default::default());
        let keys: Vec<BlockKey> = (0..6).map(BlockKey).collect();
        let req = RouteRequest::plain("m", &keys, 16 * keys.len() as u64);
        let (Decision::Route(_), Some(ticket)) = a.route(&req) else {
            panic!("A routes to r0");
        };
        (certs, a, b, keys, ticket)
    }

    /// `n` learns `tips` from the region peer at `from`, every one of them kept.
    fn learn_from(n: &Node, tips: &[RoutedTip], from: SocketAddr) {
        let now = n.now();
        let mut core = n.lock();
        let region = core.view.local_region.clone();
        assert_eq!(learn_tips(&mut core, tips, &region, from, now), 0);
    }

    /// `n`'s next load update's tips (a flush): its pending tips as peers receive them.
    fn flush(n: &Arc<Node>) -> Vec<RoutedTip> {
        let now = n.now();
        let mut core = n.lock();
        let core = &mut *core;
        let tips = routed_tips(
            &core.pending_tips,
            |i| core.view.replica(i).map(|r| r.info.id.as_str()),
            now,
        );
        core.pending_tips.clear();
        tips
    }

    /// Issue #38 (three nodes behind a balancer): a peer's tip counted only from the routing
    /// node's *predicted* prefill end, while that node's own overlay counts from the first byte.
    /// A replica faster than predicted had the blocks long before the region's other nodes
    /// believed it, and a first byte later than `overlay_ttl` past the prediction left them no
    /// tip at all until the home's summary round. The first byte is news for the peers too.
    #[test]
    fn a_first_byte_tells_the_peers_the_prompt_is_cached_now() {
        let (_certs, a, b, keys, mut ticket) = a_slow_prefill_routed_at_a();
        // A's next load update (a flush): B learns the prefix, ready at the predicted end.
        let learn = |tips: &[RoutedTip]| {
            learn_from(&b, tips, PEER);
            let mut hits = Vec::new();
            b.lock().view.peer_tips.hits(&keys, b.now(), &mut hits);
            hits
        };
        let routed = flush(&a);
        assert!(routed.iter().any(|t| t.blocks == 6 && t.ready_ms > 10_000));
        assert!(learn(&routed).is_empty(), "not before the predicted end");
        // The replica answers at once: the prefix is in its cache now.
        ticket.first_byte(&keys);
        let answered = flush(&a);
        assert!(
            answered.iter().any(|t| t.blocks == 6 && t.ready_ms == 0),
            "the first byte goes out as a tip ready now: {answered:?}"
        );
        assert_eq!(learn(&answered), vec![(0, 6)], "B counts it from now");
    }

    /// A request that ends without its first byte (a failed attempt, a cancelled client)
    /// withdraws its claim: B waits on it no longer, takes a hold on it as answered by its
    /// claimer (no strike), and never counts its blocks. A withdrawal from another peer than
    /// the claimer is no news.
    #[test]
    fn a_request_ended_without_its_first_byte_withdraws_its_claim() {
        use crate::core::peer_tips::Answer;

        // The claim would stand for ~96 s.
        let (_certs, a, b, keys, ticket) = a_slow_prefill_routed_at_a();
        // B learns `tips` from `from`; then what it holds under way for `keys`.
        let learn = |tips: &[RoutedTip], from: SocketAddr| {
            learn_from(&b, tips, from);
            let mut out = Vec::new();
            b.lock().view.peer_tips.in_prefill(&keys, b.now(), &mut out);
            out.len()
        };
        assert_eq!(learn(&flush(&a), PEER), 1, "under way");
        drop(ticket);
        let withdrawn = flush(&a);
        assert!(
            withdrawn
                .iter()
                .any(|t| t.blocks == 6 && t.withdrawn && !t.first_byte),
            "{withdrawn:?}"
        );
        let stranger: SocketAddr = "127.0.0.1:9".parse().unwrap();
        assert_eq!(learn(&withdrawn, stranger), 1, "only the claimer withdraws");
        assert_eq!(learn(&withdrawn, PEER), 0, "withdrawn");
        let now = b.now();
        let core = b.lock();
        assert_eq!(
            core.view.peer_tips.answer(0, keys[5], 6, now),
            Answer::ByClaimer
        );
        let mut hits = Vec::new();
        core.view
            .peer_tips
            .hits(&keys, now + Duration::from_secs(100), &mut hits);
        assert!(hits.is_empty(), "never computed: {hits:?}");
    }

    /// A follow-up routed at B while A's parent prompt still prefills at r0 can ride on it
    /// only if B knows the prefill has not answered: B learns it from A's tip and keeps it under
    /// way past its predicted end, until A's first-byte tip says it answered (also when A routed
    /// and saw it answer between two updates: one tip, marked answered).
    #[test]
    fn a_peers_prefill_is_under_way_at_this_node_until_its_first_byte_tip() {
        use crate::core::peer_tips::PeerPrefill;
        use crate::core::router::{Decision, RouteRequest};

        // The replica's default prefill rate: its predicted end passes while the test runs.
        let default_rate =
            crate::replicas::entry::ReplicaConfig::from_url("http://r").prefill_tokens_per_s;
        let certs = tempfile::tempdir().unwrap();
        let (a, b) = two_meshed_nodes(&certs, default_rate, Default::default());
        // What B believes under way for a follow-up of `keys` after learning `tips`.
        let learn = |tips: &[RoutedTip], follow_up: &[BlockKey]| {
            let now = b.now();
            let mut core = b.lock();
            let region = core.view.local_region.clone();
            assert_eq!(learn_tips(&mut core, tips, &region, PEER, now), 0);
            let mut out = Vec::new();
            core.view.peer_tips.in_prefill(follow_up, now, &mut out);
            out.iter()
                .map(|p: &PeerPrefill| (p.replica, p.blocks))
                .collect::<Vec<_>>()
        };
        let parent: Vec<BlockKey> = (0..6).map(BlockKey).collect();
        let follow_up: Vec<BlockKey> = (0..9).map(BlockKey).collect();
        let req = RouteRequest::plain("m", &parent, 16 * parent.len() as u64);
        let (Decision::Route(_), Some(mut ticket)) = a.route(&req) else {
            panic!("A routes to r0");
        };
        // A short prompt: predicted done within milliseconds, and not answered.
        let routed = flush(&a);
        assert!(routed.iter().all(|t| !t.first_byte));
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            learn(&routed, &follow_up),
            vec![(0, 6)],
            "under way past its end"
        );
        ticket.first_byte(&parent);
        let answered = flush(&a);
        assert!(answered.iter().all(|t| t.first_byte), "{answered:?}");
        assert!(learn(&answered, &follow_up).is_empty(), "answered");

        // Routed and answered between two updates: the update names it once, answered.
        let other: Vec<BlockKey> = (100..110).map(BlockKey).collect();
        let req = RouteRequest::plain("m", &other, 16 * other.len() as u64);
        let (Decision::Route(_), Some(mut ticket)) = a.route(&req) else {
            panic!("A routes to r0");
        };
        ticket.first_byte(&other);
        let both = flush(&a);
        assert_eq!(
            both.iter().filter(|t| t.blocks == 10).count(),
            1,
            "{both:?}"
        );
        assert!(
            both.iter().all(|t| t.first_byte && t.ready_ms == 0),
            "{both:?}"
        );
        assert!(learn(&both, &other).is_empty());
    }

    /// [`two_meshed_nodes`] holding on any prefill, for at most `max_wait_ms`: a 96-token
    /// prompt is predicted to take ~96 s, so a first byte is the only news, and prompts of a
    /// few blocks are long enough to hold on.
    fn two_holding_nodes(certs: &tempfile::TempDir, max_wait_ms: u64) -> (Arc<Node>, Arc<Node>) {
        let hold = crate::node::config::hold::HoldSection {
            min_prefill_tokens: 16,
            max_wait_ms,
            ..Default::default()
        };
        two_meshed_nodes(certs, 1.0, hold)
    }

    /// Makes A (at [`PEER`]) a live region peer of B; returns A's next load update to B, with
    /// the tips of what A routed since the last one.
    fn a_heard_by(a: &Arc<Node>, b: &Arc<Node>) -> impl FnMut() -> LoadUpdate {
        b.status().peers.push(crate::node::mesh_state::Peer {
            node_id: "a".into(),
            region: b.cfg.region.clone(),
            http_url: "http://127.0.0.1:7000".into(),
            quic_addr: PEER,
        });
        let a = a.clone();
        let mut seq = 0;
        move || {
            let tips = flush(&a);
            seq += 1;
            LoadUpdate {
                origin: 9,
                seq,
                entries: Vec::new(),
                tips,
            }
        }
    }

    /// A's `n`-th claim: A routes a 6-block prompt to r0 and B hears of it. Returns A's ticket
    /// (kept unanswered, its prefill stays claimed under way), the prompt, and a 9-block
    /// follow-up that rides on it.
    fn a_claims(
        a: &Arc<Node>,
        b: &Node,
        send: &mut impl FnMut() -> LoadUpdate,
        n: u64,
    ) -> (crate::node::routing::Ticket, Vec<BlockKey>, Vec<BlockKey>) {
        use crate::core::router::{Decision, RouteRequest};

        let prompt =
            |len: u64| -> Vec<BlockKey> { (0..len).map(|j| BlockKey(n << 32 | j)).collect() };
        let parent = prompt(6);
        let req = RouteRequest::plain("m", &parent, 16 * parent.len() as u64);
        let (Decision::Route(_), Some(ticket)) = a.route(&req) else {
            panic!("A routes to r0");
        };
        b.apply_load_update(PEER, send());
        (ticket, parent, prompt(9))
    }

    /// A request held at B to ride on A's prefill wakes when A's first-byte tip arrives in a
    /// load update, not at its deadline; with no answer it gives up at the deadline. One that
    /// rides on too little of it is not held.
    #[tokio::test]
    async fn a_request_held_on_a_peers_prefill_goes_at_its_first_byte_update() {
        use crate::core::router::{Decision, RouteRequest};

        let certs = tempfile::tempdir().unwrap();
        let (a, b) = two_holding_nodes(&certs, 20_000);
        let from = PEER;
        let mut send = a_heard_by(&a, &b);
        let parent: Vec<BlockKey> = (0..6).map(BlockKey).collect();
        let follow_up: Vec<BlockKey> = (0..9).map(BlockKey).collect();
        let req = RouteRequest::plain("m", &parent, 16 * parent.len() as u64);
        let (Decision::Route(_), Some(mut ticket)) = a.route(&req) else {
            panic!("A routes to r0");
        };
        b.apply_load_update(from, send());
        // No answer: the wait gives up at its deadline.
        let soon = b.now() + Duration::from_millis(50);
        assert!(!b.wait_for_peer_prefill(0, &follow_up, 6, soon).await);
        // Credited with 2 of 9 blocks: too little rides on A's prefill to wait for it.
        let not_held = b.hold_on_peer_prefill(0, &follow_up, 2).await;
        assert_eq!(not_held, HoldOutcome::NotHeld);
        // Credited with A's 6 of 9: held; the answer comes while B waits (deadline 20 s off),
        // and B sends it at once.
        let waiter = {
            let b = b.clone();
            let keys = follow_up.clone();
            tokio::spawn(async move { b.hold_on_peer_prefill(0, &keys, 6).await })
        };
        // One thread (`tokio::test`): yielding runs the waiter until it parks on the wake-up.
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        assert!(!waiter.is_finished(), "still under way");
        ticket.first_byte(&parent);
        b.apply_load_update(from, send());
        let woke = tokio::time::timeout(Duration::from_secs(10), waiter).await;
        assert!(matches!(woke, Ok(Ok(HoldOutcome::Released))), "{woke:?}");
        assert_eq!(b.holds.held_now(), 0, "its slot is given back");
    }

    /// A member whose tips claim long prefills that never answer (or whose first-byte tips
    /// never come): B holds a request on each of three such claims until its deadline, then
    /// holds on none of A's claims (`core::unanswered_claims`): the request riding on the
    /// fourth goes at once, and A's later tips are not learned.
    #[tokio::test]
    async fn a_peers_claims_that_never_answer_hold_three_requests_then_none_nor_are_its_tips_learned(
    ) {
        use crate::core::router::{Decision, RouteRequest};

        let certs = tempfile::tempdir().unwrap();
        let (a, b) = two_holding_nodes(&certs, 50);
        let mut send = a_heard_by(&a, &b);
        // A's tickets are kept, never answered: its prefills stay claimed under way.
        let mut claims = Vec::new();
        let mut outcomes = Vec::new();
        for n in 0..4 {
            let (ticket, _, follow_up) = a_claims(&a, &b, &mut send, n);
            claims.push(ticket);
            outcomes.push(b.hold_on_peer_prefill(0, &follow_up, 6).await);
        }
        use HoldOutcome::{Deadline, NotHeld};
        assert_eq!(outcomes, [Deadline, Deadline, Deadline, NotHeld]);
        assert_eq!(b.holds.held_now(), 0);
        // Nor is what A says it routed believed any more: its next prompt's tip is dropped,
        // where before the bar each one reached B's view (it held the requests above).
        let prompt: Vec<BlockKey> = (0..6).map(|j| BlockKey(9 << 32 | j)).collect();
        let req = RouteRequest::plain("m", &prompt, 16 * prompt.len() as u64);
        let (Decision::Route(_), Some(_ticket)) = a.route(&req) else {
            panic!("A routes to r0");
        };
        b.apply_load_update(PEER, send());
        let mut under_way = Vec::new();
        b.lock()
            .view
            .peer_tips
            .in_prefill(&prompt, b.now(), &mut under_way);
        assert!(under_way.is_empty(), "a barred peer's tip was learned");
    }

    /// A peer is trusted only for what it owns: another member's first-byte tip for A's
    /// claimed prefill releases the requests held on it (the blocks are computed) but does not
    /// take back a strike of A's, as A's own answer would. Two unanswered claims of A's, one
    /// answered only by C, one more unanswered: A is barred. Were C's answer A's, A would stand
    /// at two strikes and the fifth request would be held again.
    #[tokio::test]
    async fn only_the_claimers_own_answer_takes_back_its_strike() {
        use crate::mesh::load_share::RoutedTip;

        let certs = tempfile::tempdir().unwrap();
        let (a, b) = two_holding_nodes(&certs, 50);
        let mut send = a_heard_by(&a, &b);
        let c: SocketAddr = "127.0.0.1:7002".parse().unwrap();
        b.status().peers.push(crate::node::mesh_state::Peer {
            node_id: "c".into(),
            region: b.cfg.region.clone(),
            http_url: "http://127.0.0.1:7003".into(),
            quic_addr: c,
        });
        let mut claims = Vec::new();
        let mut outcomes = Vec::new();
        for n in 0..5 {
            let (ticket, parent, follow_up) = a_claims(&a, &b, &mut send, n);
            claims.push(ticket);
            let held = {
                let b = b.clone();
                tokio::spawn(async move { b.hold_on_peer_prefill(0, &follow_up, 6).await })
            };
            if n == 2 {
                // One thread (`tokio::test`): yielding runs the hold until it parks.
                for _ in 0..4 {
                    tokio::task::yield_now().await;
                }
                let answer = RoutedTip {
                    replica: "r0".into(),
                    key: parent[5].0,
                    blocks: 6,
                    ready_ms: 0,
                    rank: None,
                    first_byte: true,
                    withdrawn: false,
                };
                let update = LoadUpdate {
                    origin: 3,
                    seq: 1,
                    entries: Vec::new(),
                    tips: vec![answer],
                };
                b.apply_load_update(c, update);
            }
            let outcome = tokio::time::timeout(Duration::from_secs(10), held).await;
            outcomes.push(outcome.expect("bounded by the hold's deadline").unwrap());
        }
        use HoldOutcome::{Deadline, NotHeld, Released};
        assert_eq!(outcomes, [Deadline, Deadline, Released, Deadline, NotHeld]);
    }

    /// Issue #35: datagrams claiming `u32::MAX` in flight and `u64::MAX` pending tokens at a
    /// replica whose engine reports nothing counted as 67 M tokens (~22 min of queued prefill)
    /// for as long as the member repeated them. Now: a burst's worth, at most the replica's KV
    /// capacity in tokens, for the grace; then nothing while the engine does not confirm it.
    #[test]
    fn absurd_claims_weigh_a_burst_briefly_then_nothing_the_engine_does_not_confirm() {
        use crate::mesh::load_share::LoadEntry;
        use crate::node::config::NodeConfig;
        use crate::replicas::entry::ReplicaConfig;

        crate::proxy::install_crypto_provider();
        let cfg = NodeConfig {
            replicas: vec![ReplicaConfig {
                id: Some("r0".into()),
                models: vec!["m".into()],
                capacity_tokens: Some(1 << 20),
                ..ReplicaConfig::from_url("http://10.0.0.1:8000")
            }],
            ..NodeConfig::default()
        };
        let node = Node::new(cfg).unwrap();
        let mut guard = node.lock();
        let core = &mut *guard;
        let grace = LoadShareConfig::default().unbacked_grace;
        let peer: SocketAddr = "127.0.0.2:7000".parse().unwrap();
        let claim = |core: &mut Core, seq: u64, now: Duration| {
            let update = LoadUpdate {
                origin: 1,
                seq,
                entries: vec![LoadEntry {
                    replica: "r0".into(),
                    in_flight: u32::MAX,
                    pending_tokens: u64::MAX,
                }],
                tips: Vec::new(),
            };
            core.peer_loads
                .apply(peer, update, now, |_| Some(256))
                .unwrap();
            refresh_shared_load(core, 0, 1 << 21, now);
            let r = core.view.replica(0).unwrap();
            (r.load.peer_in_flight, core.replicas[0].peer_pending_tokens)
        };
        let (n, p) = claim(core, 1, Duration::ZERO);
        assert_eq!(n, 32, "a burst's slack while the scrape may lag");
        assert_eq!(p, 1 << 20, "at most the replica's KV capacity");
        // The member keeps repeating it; the engine still reports nothing.
        for (seq, ms) in (2..).zip((500..10_000).step_by(500)) {
            let now = Duration::from_millis(ms);
            let (n, p) = claim(core, seq, now);
            if now >= grace {
                assert_eq!((n, p), (0, 0), "at {ms} ms");
            }
        }
        // An engine that does report the load backs honest claims.
        core.view.set_engine_load(0, 10, 30, 0.5, 0);
        let (n, _) = claim(core, 100, Duration::from_secs(11));
        assert_eq!(n, 40);
    }

    #[test]
    fn peers_add_at_most_a_small_phantom_load_above_the_engine() {
        let mut v = view(256);
        assert_eq!(
            peer_cap(v.replica(0).unwrap()),
            32,
            "idle engine: max_in_flight / 8"
        );
        v.set_engine_load(0, 10, 40, 0.5, 0);
        assert_eq!(peer_cap(v.replica(0).unwrap()), 82);
        v.set_engine_load(0, 200, 200, 0.5, 0);
        assert_eq!(
            peer_cap(v.replica(0).unwrap()),
            256,
            "never above max_in_flight"
        );
        let small = view(8);
        assert_eq!(peer_cap(small.replica(0).unwrap()), 8);
    }
}
