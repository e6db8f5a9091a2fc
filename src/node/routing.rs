//! Routing a request: the core's decision, recorded so that the next decisions see it, and the
//! [`Ticket`] that undoes the accounting exactly once.
//!
//! Accounting of a routed request (in-flight counts, tenant quotas, queued prefill) is owned by a
//! [`Ticket`] whose `Drop` undoes it, so a client that disconnects mid-stream, a failed attempt
//! and a finished response all release exactly once.
//!
//! A routed request's blocks are in the engine's prefix cache only once *its* prefill is done,
//! as the simulator models it (`bench::sim`): at routing time they go into the view's overlay
//! counted from the predicted end of that prefill (`View::record_routed_ready`), and only at
//! the response's first byte ([`Ticket::first_byte`]) into the replica's approximate cache model
//! and the block report to a remote home. A request that fails before its first byte records
//! nothing there.
//!
//! KV quotas: the first byte also attributes the request's blocks to its tenant's KV slot in
//! this node's cache model (an approximate model learns them with the slot; an exact one tags
//! those its engine's events already stored) and refreshes the view's tenant shares there, which
//! the router steers on. A share is this node's tenant mix at the replica times the cache's
//! fill as the home's summary shows it, so the nodes of a mesh agree on it.
//!
//! Data-parallel ranks: when this node's model of the chosen replica is exact (it is the home
//! and the replica's KV events, per rank, are up) and the replica has several ranks with rank
//! routing on, the decision also names the rank (`core::dp_rank`: the rank's own hit and this
//! node's queued prefill and requests there), and the [`Ticket`] carries it to the proxy as a
//! [`RankTarget`]. A follower has only the home's merged summary, so it names no rank and the
//! engine's balancer picks: rank sets stay off the gossip, which keeps its values small.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::state::{Core, Endpoint, Node, PendingTip, MAX_PENDING_TIPS};
use crate::core::cache_model::CacheSource;
use crate::core::dp_rank::{pick_rank, RankLoad, MAX_RANKS};
use crate::core::keys::BlockKey;
use crate::core::router::{Decision, RejectReason, RouteRequest, Routed};
use crate::replicas::kv_events::RankRouting;
use crate::tokenize::token_namespace;

/// vLLM's request header naming the data-parallel rank to run on.
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";
/// SGLang's request body field naming the data-parallel rank.
pub const DP_RANK_FIELD: &str = "data_parallel_rank";

/// The data-parallel rank a request is sent to, and how the replica is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankTarget {
    /// The rank.
    pub rank: u16,
    /// Header or body field (never [`RankRouting::Off`]).
    pub how: RankRouting,
}

impl RankTarget {
    /// `req` with the rank named and `body` attached: the header, or the body re-serialized
    /// with `data_parallel_rank` set (a body that is not a JSON object goes as it is: the
    /// request was parsed as one already, so this does not happen).
    pub fn apply(&self, req: reqwest::RequestBuilder, body: &Bytes) -> reqwest::RequestBuilder {
        match self.how {
            RankRouting::Header => req
                .header(DP_RANK_HEADER, self.rank.to_string())
                .body(body.clone()),
            RankRouting::Body => {
                match serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body) {
                    Ok(mut map) => {
                        map.insert(DP_RANK_FIELD.to_owned(), self.rank.into());
                        match serde_json::to_vec(&map) {
                            Ok(v) => req.body(v),
                            Err(_) => req.body(body.clone()),
                        }
                    }
                    Err(_) => req.body(body.clone()),
                }
            }
            RankRouting::Off => req.body(body.clone()),
        }
    }
}

/// The rank to name for a request routed to replica `i`, if the replica has ranks and rank
/// routing is on; advances the rotation. Where the prefix is: at the home, from the exact
/// model's rank sets (the engine's KV events); at any other node (or a home whose events are
/// down), from the ranks this node and its region peers sent the prefix's earlier turns to
/// (`core::rank_hints`).
fn choose_rank(
    core: &mut Core,
    i: usize,
    req: &RouteRequest<'_>,
    now: Duration,
) -> Option<RankTarget> {
    let w_load_s = core.router.config().cost.w_load_s;
    let tokens_per_block = core.view.tokens_per_block;
    let rate = core.view.replica(i)?.info.prefill_tokens_per_s;
    let rt = core.replicas.get_mut(i)?;
    let source = rt.kv_source.as_ref()?;
    let how = source.rank_routing();
    let ranks = usize::from(source.dp_ranks).min(MAX_RANKS);
    if how == RankRouting::Off || ranks <= 1 {
        return None;
    }
    let runs = if rt.cache.source() == CacheSource::Exact {
        rt.cache.rank_runs(req.keys, ranks)
    } else {
        rt.rank_hints.runs(req.keys, ranks, now)
    };
    if rt.rank_loads.len() < ranks {
        rt.rank_loads.resize(ranks, RankLoad::default());
    }
    let rotate = rt.rank_rotate;
    rt.rank_rotate = rt.rank_rotate.wrapping_add(1);
    let rank = pick_rank(
        &runs,
        &rt.rank_loads[..ranks],
        req.prompt_tokens,
        tokens_per_block,
        rate,
        w_load_s,
        rotate,
    )?;
    Some(RankTarget {
        rank: u16::try_from(rank).ok()?,
        how,
    })
}

/// What a booked leg does at its replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Booking {
    /// Runs the prompt: a whole request, or the prefill leg of a disaggregated one.
    Whole,
    /// Decodes a prompt a prefill replica computes, predicted handed over in `ready_in`.
    Decode {
        /// When the prompt's blocks are predicted to be at the decode replica.
        ready_in: Duration,
    },
}

/// What [`Node::book`] decided for one leg, for [`Node::record_leg`] to record.
struct Leg<'a> {
    /// Prefill tokens it queues at the replica (0 for a decode leg).
    uncached: u64,
    /// Prompt tokens it finds cached there (0 for a decode leg).
    cached: u64,
    /// Blocks it brings to the replica's cache (counted against the tenant's KV share).
    new_blocks: usize,
    /// The tenant it counts against (only on the leg that prefills).
    tenant: Option<&'a str>,
    /// The tenant's KV slot for the blocks it brings.
    kv_slot: u8,
    /// The data-parallel rank named, if any.
    target: Option<RankTarget>,
    /// When its blocks are predicted to be in the replica's cache.
    ready_in: Duration,
}

/// Cap on the predicted wait before a routed request's blocks count in the overlay (as in the
/// simulator): a wildly overloaded estimate must not park keys for hours.
const MAX_READY_IN_S: f64 = 3600.0;

impl Node {
    /// Routes `req` (never to a replica in `req.exclude`, those it already failed on). On a
    /// route, records it (overlay from the predicted end of its prefill, in-flight, tenant,
    /// queued prefill) and returns the [`Ticket`] that releases it. The cache model and the home
    /// learn its blocks later, at [`Ticket::first_byte`].
    pub fn route(self: &Arc<Self>, req: &RouteRequest<'_>) -> (Decision, Option<Ticket>) {
        match self.route_if(req, |_, _, _, _| true) {
            Some(routed) => routed,
            // The gate always lets it through.
            None => (Decision::Reject(RejectReason::NoHealthyReplica), None),
        }
    }

    /// [`Node::route`], but `gate` sees the decision first, under the same lock (with the node,
    /// the core and the core's time): when it says no, nothing is recorded and `None` returned
    /// (the admission queue, `admission.rs`, queues the request there instead).
    pub(super) fn route_if(
        self: &Arc<Self>,
        req: &RouteRequest<'_>,
        gate: impl FnOnce(&Node, &mut Core, &Decision, Duration) -> bool,
    ) -> Option<(Decision, Option<Ticket>)> {
        let started = Instant::now();
        let now = self.now();
        let mut guard = self.lock();
        let core = &mut *guard;
        let mut decision = core.router.route(&core.view, req, now);
        if !gate(self, core, &decision, now) {
            return None;
        }
        let tokens_per_block = core.view.tokens_per_block;
        let ticket = match &mut decision {
            Decision::Route(d) => {
                if let Some(heads) = core.heads.as_mut() {
                    heads.record(req.keys);
                }
                Some(self.book(core, d, req, now, Booking::Whole))
            }
            _ => None,
        };
        drop(guard);
        if ticket.is_some() {
            self.mesh.load_changed.notify_one();
        }
        self.metrics
            .decision_seconds
            .observe(started.elapsed().as_secs_f64());
        if let Decision::Route(d) = &decision {
            self.metrics.hit_blocks.observe(d.hit_blocks as f64);
        }
        self.metrics.decisions.record(&decision, tokens_per_block);
        Some((decision, ticket))
    }

    /// Records leg `how` of `req` routed to `d.replica` (in-flight, overlay from the predicted
    /// end of its prefill, and for a leg that prefills: queued prefill, tenant, the rank) and
    /// returns the [`Ticket`] that releases it. `core` is the locked state.
    pub(super) fn book(
        self: &Arc<Self>,
        core: &mut Core,
        d: &mut Routed,
        req: &RouteRequest<'_>,
        now: Duration,
        how: Booking,
    ) -> Ticket {
        let i = d.replica;
        let prefills = how == Booking::Whole;
        let target = if prefills {
            choose_rank(core, i, req, now)
        } else {
            None
        };
        d.dp_rank = target.map(|t| t.rank);
        let cached = d.hit_blocks as u64 * core.view.tokens_per_block as u64;
        let uncached = if prefills {
            req.prompt_tokens.saturating_sub(cached)
        } else {
            0
        };
        // Routed prefill earns hot-prefix warm-ups their credit (a warm-up is booked elsewhere).
        core.hot.credit(uncached);
        // Its blocks count in the overlay once its prefill is predicted done: the prefill
        // queued there before it (this request's own not yet added), then its own. A decode
        // leg holds them once its prefill replica's prefill is done and handed over.
        let ready_in = match how {
            Booking::Whole => {
                let s = core.view.replica(i).map_or(0.0, |r| {
                    core.router
                        .config()
                        .cost
                        .prefill_done_after_s(r, cached, uncached)
                });
                Duration::try_from_secs_f64(s.clamp(0.0, MAX_READY_IN_S)).unwrap_or_default()
            }
            Booking::Decode { ready_in } => ready_in,
        };
        if let (Some(r), Some(rt)) = (core.view.replica(i), core.replicas.get(i)) {
            tracing::debug!(
                target: "kvmesh::load_view",
                replica = %r.info.id, uncached, predicted_ms = (d.predicted_s * 1000.0) as u64,
                queued = r.load.queued_prefill_tokens, own = rt.pending_prefill_tokens,
                peers = rt.peer_pending_tokens, home = rt.mesh.remote_queued,
                in_flight = r.load.in_flight, peer_in_flight = r.load.peer_in_flight,
                waiting = r.load.waiting, running = r.load.running,
                engine_excess = r.load.engine_excess, engine_others = r.load.engine_others, "booked"
            );
        }
        // The tenant's request counts once, on the leg that prefills.
        let leg = Leg {
            uncached,
            cached: if prefills { cached } else { 0 },
            new_blocks: if prefills {
                req.keys.len().saturating_sub(d.hit_blocks as usize)
            } else {
                0
            },
            tenant: req.tenant.filter(|_| prefills),
            kv_slot: core.router.tenants.kv_slot(req.tenant),
            target,
            ready_in,
        };
        self.record_leg(core, i, req.keys, leg, now)
    }

    /// Records a leg booked at replica `i` (overlay from `leg.ready_in`, the tip for the
    /// region's other nodes, queued prefill, rank, tenant, in-flight) and returns its [`Ticket`].
    fn record_leg(
        self: &Arc<Self>,
        core: &mut Core,
        i: usize,
        keys: &[BlockKey],
        leg: Leg<'_>,
        now: Duration,
    ) -> Ticket {
        let Leg {
            uncached,
            cached,
            new_blocks,
            tenant,
            kv_slot,
            target,
            ready_in,
        } = leg;
        core.view.record_routed_ready(i, keys, now, ready_in);
        // A long prefill is listed for requests that ride on it to wait for (`hold.rs`).
        let hit_blocks = u32::try_from(keys.len().saturating_sub(new_blocks)).unwrap_or(u32::MAX);
        let prefilling = self.holds.started(i, keys, hit_blocks, now, ready_in);
        // The region's other nodes learn this prefix with the next load update, with the rank
        // named, so that they name it for its follow-ups too.
        let blocks = u32::try_from(keys.len()).unwrap_or(u32::MAX);
        let rank = target.map(|t| t.rank);
        if let (Some(last), Some(rank)) = (keys.last(), rank) {
            if let Some(rt) = core.replicas.get_mut(i) {
                rt.rank_hints.insert(*last, blocks, rank, now);
            }
        }
        let mut claim = None;
        if self.cfg.mesh.is_some() && core.pending_tips.len() < MAX_PENDING_TIPS {
            if let Some(tip) = PendingTip::new(i, keys, now + ready_in, rank) {
                core.pending_tips.push(tip);
                claim = Some(Box::new(tip));
            }
        }
        if let Some(rt) = core.replicas.get_mut(i) {
            rt.pending_prefill_tokens = rt.pending_prefill_tokens.saturating_add(uncached);
            if let Some(l) = target.and_then(|t| rt.rank_loads.get_mut(usize::from(t.rank))) {
                l.pending_tokens = l.pending_tokens.saturating_add(uncached);
                l.in_flight = l.in_flight.saturating_add(1);
            }
            let pending = rt.queued_estimate();
            if let Some(r) = core.view.replica_mut(i) {
                r.load.queued_prefill_tokens = pending;
            }
        }
        if let Some(t) = tenant {
            core.router.tenants.started(t, i);
        }
        if new_blocks > 0 && core.router.tenants.any_kv_quota() {
            super::kv_shares::count_routed(core, i, kv_slot, new_blocks);
        }
        let endpoint = self.endpoint(i).unwrap_or_else(|| Endpoint {
            id: Arc::from("?"),
            base: Arc::from(""),
        });
        self.metrics
            .in_flight
            .with_label_values(&[&endpoint.id])
            .inc();
        Ticket {
            node: Arc::clone(self),
            replica: i,
            endpoint,
            tenant: tenant.map(str::to_owned),
            kv_slot,
            pending_tokens: uncached,
            hit_tokens: cached,
            started: false,
            rank: target,
            prefilling,
            claim,
        }
    }

    /// Records a request this node sends on its own — a hot-prefix warm-up of `keys`,
    /// `tokens` of prefill, for `tenant` — to replica `i` as a routed one, so the next
    /// decisions see its load and, from its first byte, its blocks. `None` for an unknown
    /// replica.
    pub fn route_to(
        self: &Arc<Self>,
        i: usize,
        keys: &[BlockKey],
        tokens: u64,
        tenant: Option<&str>,
    ) -> Option<Ticket> {
        let now = self.now();
        let ticket = {
            let mut guard = self.lock();
            let core = &mut *guard;
            core.view.replica(i)?;
            if i >= core.replicas.len() {
                return None;
            }
            let ready_in = core
                .view
                .replica(i)
                .map_or(0.0, |r| core.router.config().cost.prefill_done_s(r, tokens));
            let leg = Leg {
                uncached: tokens,
                cached: 0,
                new_blocks: keys.len(),
                tenant,
                kv_slot: core.router.tenants.kv_slot(tenant),
                target: None,
                ready_in: Duration::try_from_secs_f64(ready_in.clamp(0.0, MAX_READY_IN_S))
                    .unwrap_or_default(),
            };
            self.record_leg(core, i, keys, leg, now)
        };
        self.mesh.load_changed.notify_one();
        Some(ticket)
    }

    /// The node's token-mode keys for a request: appends them to `out` and returns the prompt's
    /// token count, or `None` when the request uses text mode (no tokenizer, another model, or it
    /// cannot be tokenized faithfully — counted in `kvmesh_token_mode_fallbacks_total{reason}`).
    pub fn token_keys(
        &self,
        body: &[u8],
        model: &str,
        lora: Option<&str>,
        cache_salt: Option<&str>,
        isolated_tenant: Option<&str>,
        out: &mut Vec<BlockKey>,
    ) -> Option<u64> {
        let tm = self.tokenizer.as_ref()?;
        if !tm.applies_to(model) {
            self.kv_metrics
                .token_fallbacks
                .with_label_values(&["other_model"])
                .inc();
            return None;
        }
        let ns = token_namespace(lora, cache_salt, isolated_tenant);
        match tm.request_keys(body, ns, out) {
            Ok(n) => Some(n),
            Err(e) => {
                out.clear();
                tracing::debug!(error = %e, "request keyed by text");
                self.kv_metrics
                    .token_fallbacks
                    .with_label_values(&[e.label()])
                    .inc();
                None
            }
        }
    }
}

/// Releases a routed request's accounting when dropped.
pub struct Ticket {
    node: Arc<Node>,
    replica: usize,
    endpoint: Endpoint,
    tenant: Option<String>,
    /// The KV slot its blocks are attributed to (`core::tenants`), fixed at routing.
    kv_slot: u8,
    pending_tokens: u64,
    /// Prompt tokens the decision believed cached there (its hit blocks in tokens).
    hit_tokens: u64,
    /// [`Ticket::first_byte`] ran.
    started: bool,
    /// The data-parallel rank named, if any (its load is released with the ticket's).
    rank: Option<RankTarget>,
    /// Its id in the node's list of long prefills (`hold.rs`), unlisted at the first byte or
    /// the drop.
    prefilling: Option<u64>,
    /// The tip that told the region's other nodes its prefill is under way: withdrawn when the
    /// ticket drops without a first byte (a failure, a cancelled client), so that nothing of
    /// theirs keeps waiting on it, nor counts its blocks, nor strikes this node for it. Boxed:
    /// a ticket moves through the request path, and the tip's ladder is most of its size.
    claim: Option<Box<PendingTip>>,
}

impl Ticket {
    /// The replica's view index.
    pub fn replica(&self) -> usize {
        self.replica
    }

    /// The replica's address.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// Prompt tokens the decision believed cached at the replica (hit blocks × tokens per
    /// block), for traces.
    pub fn hit_tokens(&self) -> u64 {
        self.hit_tokens
    }

    /// The data-parallel rank to name to the replica, if any.
    pub fn rank(&self) -> Option<RankTarget> {
        self.rank
    }

    /// The replica sent its first byte: its prefill is done, so the request's prompt tokens no
    /// longer count as queued there, and its blocks (`keys`) are now in the engine's prefix
    /// cache: the overlay counts them from now if it predicted later, an approximate cache
    /// model learns them (an exact, KV-event one takes no guesses) and, when another node is the
    /// replica's home, they are reported to it. Pass no keys for a response that is not a
    /// success (the engine refused the request: nothing was cached). Only the first call
    /// counts; later ones are no-ops.
    pub fn first_byte(&mut self, keys: &[BlockKey]) {
        if std::mem::replace(&mut self.started, true) {
            return;
        }
        // Requests held on this prefill go now: its blocks are in the engine's cache.
        if let Some(id) = self.prefilling.take() {
            self.node.holds.done(self.replica, id);
        }
        let tokens = std::mem::take(&mut self.pending_tokens);
        let now = self.node.now();
        let mut guard = self.node.lock();
        let core = &mut *guard;
        release_pending(core, self.replica, tokens, self.rank, false);
        if let Some(rt) = core.replicas.get_mut(self.replica) {
            rt.progress = rt.progress.wrapping_add(1);
        }
        self.node.mesh.load_changed.notify_one();
        if keys.is_empty() {
            return;
        }
        // Its prefill is done now, whatever was predicted: the overlay counts its keys from now.
        core.view.prefill_done(self.replica, keys, now);
        // And the region's other nodes, whose tips of this prompt still count from the predicted
        // end: a tip again, ready now, so they count it from now (an early first byte) and for
        // `overlay_ttl` more (a late one, whose first tip may have run out before the home's
        // summary has the blocks), marked as the first byte: a request riding on this prefill
        // at a peer waits no longer. Only this node's own request: a peer reports only its own.
        if self.node.cfg.mesh.is_some() {
            let rank = self.rank.map(|t| t.rank);
            if let Some(tip) = PendingTip::at_first_byte(self.replica, keys, now, rank) {
                tip.queue_answer(&mut core.pending_tips);
            }
        }
        let Some(rt) = core.replicas.get_mut(self.replica) else {
            return;
        };
        if rt.cache.source() == CacheSource::Approximate {
            rt.cache.record_routed_by(keys, self.kv_slot, now);
            rt.summary_dirty = true;
        } else {
            rt.cache.attribute(keys, self.kv_slot);
        }
        let target = rt.mesh.report_target();
        super::kv_shares::refresh_kv_shares(core, self.replica);
        let label = core.router.tenants.kv_label(self.tenant.as_deref());
        drop(guard);
        self.node
            .after_first_byte(self.replica, target, label, keys);
    }
}

impl Ticket {
    /// The attempt failed before its first byte: the overlay drops the request's unconfirmed
    /// `keys` there (see [`crate::core::view::View::routed_failed`]); the accounting is released
    /// when the ticket drops.
    pub fn failed(self, keys: &[BlockKey]) {
        if self.started || keys.is_empty() {
            return;
        }
        let now = self.node.now();
        self.node.lock().view.routed_failed(self.replica, keys, now);
    }
}

/// Releases `tokens` of replica `i`'s queued prefill (and of the named `rank`'s, with the
/// request itself when `finished`).
fn release_pending(
    core: &mut Core,
    i: usize,
    tokens: u64,
    rank: Option<RankTarget>,
    finished: bool,
) {
    if let Some(rt) = core.replicas.get_mut(i) {
        if let Some(l) = rank.and_then(|t| rt.rank_loads.get_mut(usize::from(t.rank))) {
            l.pending_tokens = l.pending_tokens.saturating_sub(tokens);
            if finished {
                l.in_flight = l.in_flight.saturating_sub(1);
            }
        }
        rt.pending_prefill_tokens = rt.pending_prefill_tokens.saturating_sub(tokens);
        let pending = rt.queued_estimate();
        if let Some(r) = core.view.replica_mut(i) {
            r.load.queued_prefill_tokens = pending;
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(id) = self.prefilling.take() {
            self.node.holds.done(self.replica, id);
        }
        let now = self.node.now();
        let mut guard = self.node.lock();
        let core = &mut *guard;
        release_pending(core, self.replica, self.pending_tokens, self.rank, true);
        if let (false, Some(tip)) = (self.started, self.claim.take()) {
            tip.withdrawn().queue_answer(&mut core.pending_tips);
        }
        if let (true, Some(rt)) = (self.started, core.replicas.get_mut(self.replica)) {
            // It answered and ended: the engine is stepping.
            rt.progress = rt.progress.wrapping_add(1);
        }
        core.view.finished(self.replica);
        if let Some(t) = &self.tenant {
            core.router.tenants.finished(t, self.replica);
        }
        // A slot freed: the admission queue's next request that can use it takes it.
        if let Some(q) = core.admission.as_mut() {
            q.released(now);
            self.node
                .grant_next(core, Some(self.replica), None, self.tenant.as_deref(), now);
        }
        drop(guard);
        self.node.mesh.load_changed.notify_one();
        self.node
            .metrics
            .in_flight
            .with_label_values(&[&self.endpoint.id])
            .dec();
    }
}
