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

use super::state::{Core, Endpoint, Node, MAX_PENDING_TIPS};
use crate::core::cache_model::CacheSource;
use crate::core::dp_rank::{pick_rank, RankLoad, MAX_RANKS};
use crate::core::keys::BlockKey;
use crate::core::router::{Decision, RejectReason, RouteRequest};
use crate::core::tenants::KV_SLOTS;
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

/// The rank to name for a request routed to replica `i`, if this node knows the replica's ranks
/// (exact model, rank routing on); advances the rotation.
fn choose_rank(core: &mut Core, i: usize, req: &RouteRequest<'_>) -> Option<RankTarget> {
    let w_load_s = core.router.config().cost.w_load_s;
    let tokens_per_block = core.view.tokens_per_block;
    let rate = core.view.replica(i)?.info.prefill_tokens_per_s;
    let rt = core.replicas.get_mut(i)?;
    let source = rt.kv_source.as_ref()?;
    let how = source.rank_routing();
    let ranks = usize::from(source.dp_ranks).min(MAX_RANKS);
    if how == RankRouting::Off || ranks <= 1 || rt.cache.source() != CacheSource::Exact {
        return None;
    }
    let runs = rt.cache.rank_runs(req.keys, ranks);
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
                let i = d.replica;
                let target = choose_rank(core, i, req);
                d.dp_rank = target.map(|t| t.rank);
                let cached = d.hit_blocks as u64 * core.view.tokens_per_block as u64;
                let uncached = req.prompt_tokens.saturating_sub(cached);
                // Its blocks count in the overlay once its prefill is predicted done: the prefill
                // queued there before it (this request's own not yet added), then its own.
                let ready_in = core.view.replica(i).map_or(0.0, |r| {
                    core.router.config().cost.prefill_done_s(r, uncached)
                });
                let ready_in = Duration::try_from_secs_f64(ready_in.clamp(0.0, MAX_READY_IN_S))
                    .unwrap_or_default();
                core.view.record_routed_ready(i, req.keys, now, ready_in);
                // The region's other nodes learn this prefix with the next load update.
                if let (Some(last), true) = (req.keys.last(), self.cfg.mesh.is_some()) {
                    if core.pending_tips.len() < MAX_PENDING_TIPS {
                        let blocks = u32::try_from(req.keys.len()).unwrap_or(u32::MAX);
                        core.pending_tips.push((i, last.0, blocks, now + ready_in));
                    }
                }
                let rt = &mut core.replicas[i];
                rt.pending_prefill_tokens = rt.pending_prefill_tokens.saturating_add(uncached);
                if let Some(l) = target.and_then(|t| rt.rank_loads.get_mut(usize::from(t.rank))) {
                    l.pending_tokens = l.pending_tokens.saturating_add(uncached);
                    l.in_flight = l.in_flight.saturating_add(1);
                }
                let pending = rt.queued_estimate();
                if let Some(r) = core.view.replica_mut(i) {
                    r.load.queued_prefill_tokens = pending;
                }
                if let Some(t) = req.tenant {
                    core.router.tenants.started(t, i);
                }
                let endpoint = self.endpoint(i).unwrap_or_else(|| Endpoint {
                    id: Arc::from("?"),
                    base: Arc::from(""),
                });
                self.metrics
                    .in_flight
                    .with_label_values(&[&endpoint.id])
                    .inc();
                Some(Ticket {
                    node: Arc::clone(self),
                    replica: i,
                    endpoint,
                    tenant: req.tenant.map(str::to_owned),
                    kv_slot: core.router.tenants.kv_slot(req.tenant),
                    pending_tokens: uncached,
                    hit_tokens: cached,
                    started: false,
                    rank: target,
                })
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
        let tokens = std::mem::take(&mut self.pending_tokens);
        let now = self.node.now();
        let mut guard = self.node.lock();
        let core = &mut *guard;
        release_pending(core, self.replica, tokens, self.rank, false);
        self.node.mesh.load_changed.notify_one();
        if keys.is_empty() {
            return;
        }
        // Its prefill is done now, whatever was predicted: the overlay counts its keys from now.
        core.view.prefill_done(self.replica, keys, now);
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
        refresh_kv_shares(core, self.replica);
        drop(guard);
        self.node.after_first_byte(self.replica, target, keys);
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

/// Copies replica `i`'s tenant KV shares from its cache model into the view, when some tenant
/// has a KV quota (else nobody reads them).
pub(super) fn refresh_kv_shares(core: &mut Core, i: usize) {
    if !core.router.tenants.any_kv_quota() {
        return;
    }
    let Some(rt) = core.replicas.get(i) else {
        return;
    };
    // A follower's model holds only its own requests' blocks, so its own fill would be a
    // fraction of the replica's; the summary it pulled from the home says how many keys the
    // replica's current epoch took (live plus evicted-since, an overestimate by at most the
    // rebuild threshold). With it every node scales the same mix by about the same fill, and
    // the nodes agree on where a tenant is over (and which replicas it dominates).
    let min_fill = core
        .view
        .replica(i)
        .and_then(|r| r.summary.as_deref())
        .map_or(0.0, |s| {
            s.inserted() as f64 / rt.cache.capacity_blocks().max(1) as f64
        });
    let mut shares = [0.0f32; KV_SLOTS];
    rt.cache.tenant_shares(min_fill, &mut shares);
    core.view.set_kv_shares(i, &shares);
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
        let now = self.node.now();
        let mut guard = self.node.lock();
        let core = &mut *guard;
        release_pending(core, self.replica, self.pending_tokens, self.rank, true);
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
