//! Holding a request at the node until the prefill it rides on has its first byte.
//!
//! The rule and the book are the core's (`core::hold`); this file gives them a lock, a wake-up
//! and metrics. A routed prefill long enough to ride on is listed by `Node::book`
//! (`routing.rs`) and unlisted at its `Ticket`'s first byte or drop, which wakes the requests
//! held on it. The proxy calls [`Holds::before_send`] between the decision and the send.
//! A held request keeps its `Ticket` (its booking stands: in flight, the overlay), so the next
//! decisions see it. A client that leaves drops the wait: its slot is given back, counted as
//! `client_gone`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus::{Histogram, HistogramOpts, IntCounterVec, Opts, Registry};

use std::net::SocketAddr;

use crate::core::hold::{HoldRule, PrefillBook};
use crate::core::keys::BlockKey;
use crate::core::peer_tips::PeerPrefill;
use crate::core::unanswered_claims::Noted;
use crate::core::unanswered_claims::{engine_denies, UnansweredClaims, UNANSWERED_TO_BAR};

/// The node's hold state: the book, the rule, the wake-up, the metrics.
pub struct Holds {
    /// The rule, from `[hold]`.
    rule: HoldRule,
    /// Time zero of the node's core clock (`Node::now`): deadlines are in its time.
    start: Instant,
    /// Listed prefills and held counts. Taken alone or inside the core's lock, never around it.
    book: Mutex<PrefillBook>,
    /// Prefills listed in `book`, all replicas: with none, a request skips the book's lock.
    listed: AtomicUsize,
    /// Woken whenever a listed prefill is unlisted.
    unlisted: tokio::sync::Notify,
    /// Region peers whose claimed prefills went unanswered, and their bars. Taken alone or
    /// inside the core's lock, never around it.
    claims: Mutex<UnansweredClaims>,
    /// `kvmesh_requests_held_total{outcome}`: `released` (the prefill's first byte, or its end),
    /// `deadline`, `full` (qualified, no slot: sent at once), `client_gone`, `distrusted` (a
    /// region peer's claim it would have ridden on was not trusted: `core::unanswered_claims`).
    held: IntCounterVec,
    /// `kvmesh_request_hold_seconds`: how long each held request waited.
    wait_seconds: Histogram,
}

/// How a held request's wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoldOutcome {
    /// Not held: nothing it rides on, or the rule is off.
    NotHeld,
    /// The prefill it rode on sent its first byte (or ended).
    Released,
    /// Its deadline passed first.
    Deadline,
    /// It qualified but the caps were reached: sent at once.
    Full,
}

impl HoldOutcome {
    fn label(self) -> &'static str {
        match self {
            HoldOutcome::NotHeld => "not_held",
            HoldOutcome::Released => "released",
            HoldOutcome::Deadline => "deadline",
            HoldOutcome::Full => "full",
        }
    }
}

impl Holds {
    /// Hold state under `rule`, on the node clock started at `start`, its metrics registered in
    /// `registry`.
    pub fn new(rule: HoldRule, start: Instant, registry: &Registry) -> prometheus::Result<Holds> {
        let held = IntCounterVec::new(
            Opts::new(
                "kvmesh_requests_held_total",
                "Requests held until the prefill they ride on at their replica had its first byte, by outcome",
            ),
            &["outcome"],
        )?;
        let wait_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "kvmesh_request_hold_seconds",
                "Time a held request waited before it was sent",
            )
            .buckets(vec![0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0]),
        )?;
        registry.register(Box::new(held.clone()))?;
        registry.register(Box::new(wait_seconds.clone()))?;
        Ok(Holds {
            rule,
            start,
            book: Mutex::new(PrefillBook::default()),
            listed: AtomicUsize::new(0),
            unlisted: tokio::sync::Notify::new(),
            claims: Mutex::new(UnansweredClaims::new()),
            held,
            wait_seconds,
        })
    }

    /// The book, locked (a poisoned lock is recovered: the book is counts and lists).
    fn book(&self) -> std::sync::MutexGuard<'_, PrefillBook> {
        self.book
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Lists a prefill routed to replica `i` (see `PrefillBook::started`).
    pub(super) fn started(
        &self,
        i: usize,
        keys: &[BlockKey],
        hit_blocks: u32,
        now: Duration,
        ready_in: Duration,
    ) -> Option<u64> {
        // Most prompts are too short to ride on: no lock for them.
        if !self.rule.lists(keys.len(), hit_blocks) {
            return None;
        }
        let id = self
            .book()
            .started(&self.rule, i, keys, hit_blocks, now, ready_in)?;
        self.listed.fetch_add(1, Ordering::Relaxed);
        Some(id)
    }

    /// Prefill `id` at replica `i` had its first byte or ended: unlisted, its riders woken.
    pub(super) fn done(&self, i: usize, id: u64) {
        if self.book().done(i, id) {
            self.listed.fetch_sub(1, Ordering::Relaxed);
            self.unlisted.notify_waiters();
        }
    }

    /// Requests held now.
    pub fn held_now(&self) -> u32 {
        self.book().held()
    }

    /// Requests held for replica `i` now: booked there (in flight), not sent yet.
    pub fn held_at(&self, i: usize) -> u32 {
        self.book().held_at(i)
    }

    /// Prefills listed at replica `i` now.
    pub fn prefilling(&self, i: usize) -> usize {
        self.book().prefilling(i)
    }
}

/// Gives a held slot back however the wait ends (a client that leaves drops the future).
pub struct Slot<'a> {
    holds: &'a Holds,
    replica: usize,
    /// Set when the wait ended on its own; unset at drop means the client left.
    ended: bool,
    started: std::time::Instant,
}

impl<'a> Slot<'a> {
    /// A slot [`PrefillBook::hold`] just took for replica `i`.
    fn taken(holds: &'a Holds, i: usize) -> Slot<'a> {
        Slot {
            holds,
            replica: i,
            ended: false,
            started: std::time::Instant::now(),
        }
    }

    /// The wait ended on its own with `outcome`: counted; the slot is given back.
    pub fn end(mut self, outcome: HoldOutcome) -> HoldOutcome {
        self.ended = true;
        self.holds.held.with_label_values(&[outcome.label()]).inc();
        outcome
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.holds.book().unhold(self.replica);
        self.holds
            .wait_seconds
            .observe(self.started.elapsed().as_secs_f64());
        if !self.ended {
            self.holds.held.with_label_values(&["client_gone"]).inc();
        }
    }
}

impl Holds {
    /// Waits, if the rule says so, until the prefill a request routed to replica `i` with
    /// `hit_blocks` of `keys` rides on has its first byte, or its deadline. Returns at once for
    /// a request that does not qualify (no allocation, one short lock).
    pub async fn before_send(&self, i: usize, keys: &[BlockKey], hit_blocks: u32) -> HoldOutcome {
        let holds = self;
        // No long prefill listed anywhere (the common case): nothing to ride on, no lock.
        if !holds.rule.enabled || hit_blocks == 0 || holds.listed.load(Ordering::Relaxed) == 0 {
            return HoldOutcome::NotHeld;
        }
        let plan = {
            let mut book = holds.book();
            let Some(plan) = book.plan(&holds.rule, i, keys, hit_blocks, self.start.elapsed())
            else {
                return HoldOutcome::NotHeld;
            };
            if book.hold(&holds.rule, i).is_err() {
                drop(book);
                holds.held.with_label_values(&["full"]).inc();
                return HoldOutcome::Full;
            }
            plan
        };
        let slot = Slot::taken(holds, i);
        tracing::debug!(
            replica = i,
            riding_blocks = plan.riding_blocks,
            on = plan.on,
            "held"
        );
        let outcome = loop {
            let unlisted = holds.unlisted.notified();
            tokio::pin!(unlisted);
            // Registered before the check, so an unlisting between the two is not missed.
            unlisted.as_mut().enable();
            if !holds.book().computing(i, plan.on) {
                break HoldOutcome::Released;
            }
            let Some(left) = plan
                .deadline
                .checked_sub(self.start.elapsed())
                .filter(|d| !d.is_zero())
            else {
                break HoldOutcome::Deadline;
            };
            tokio::select! {
                _ = &mut unlisted => {}
                _ = tokio::time::sleep(left) => {}
            }
        };
        slot.end(outcome)
    }

    /// A held slot for replica `i` under the rule's caps, for a request held on a region
    /// peer's prefill (`Node::hold_on_peer_prefill`); `None`, counted `full`, when the caps
    /// are reached.
    pub fn take_slot(&self, i: usize) -> Option<Slot<'_>> {
        if self.book().hold(&self.rule, i).is_err() {
            self.held.with_label_values(&["full"]).inc();
            return None;
        }
        Some(Slot::taken(self, i))
    }

    /// The rule, from `[hold]`.
    pub fn rule(&self) -> &HoldRule {
        &self.rule
    }

    fn claims(&self) -> std::sync::MutexGuard<'_, UnansweredClaims> {
        self.claims
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether a region peer's claimed prefill `p` may hold a request at `now`: its peer is
    /// not barred, and the replica's engine, reporting `engine` = (its requests, this node's
    /// own there), does not contradict it (`core::unanswered_claims`). A claim with no sender
    /// (not from a load update) is trusted.
    pub fn trusts(&self, p: &PeerPrefill, now: Duration, engine: (u32, u32)) -> bool {
        let Some(c) = p.claim else {
            return true;
        };
        !engine_denies(c.at, now, engine.0, engine.1) && !self.claims().is_barred(c.from, now)
    }

    /// Whether the region peer at `from` is barred at `now` for claims that went unanswered.
    /// What such a peer says it routed is not believed either: its tips are dropped
    /// (`apply_load_update`), so its claims neither hold requests nor count as cache hits.
    pub fn is_barred(&self, from: SocketAddr, now: Duration) -> bool {
        self.claims().is_barred(from, now)
    }

    /// A request qualified to ride on a region peer's claim this node does not trust: sent at
    /// once, counted `distrusted`.
    pub fn count_distrusted(&self) {
        self.held.with_label_values(&["distrusted"]).inc();
    }

    /// A hold on the claim of the peer at `from` ending in `claim` ended at `now`, `answered`
    /// by its first byte or not: evidence for or against the peer. The bar is logged once.
    pub fn judge(&self, from: SocketAddr, claim: BlockKey, answered: bool, now: Duration) {
        let mut claims = self.claims();
        if answered {
            claims.note_answered(from, claim);
            return;
        }
        if let Noted::Barred(until) = claims.note_unanswered(from, claim, now) {
            drop(claims);
            tracing::warn!(
                peer = %from,
                unanswered = UNANSWERED_TO_BAR,
                barred_for_s = until.saturating_sub(now).as_secs(),
                "a region peer's claimed prefills went unanswered: not holding on its claims"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::peer_tips::Claim;

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    /// The node's side of `core::unanswered_claims`: a claim the engine does not show past its
    /// lag, or from a barred peer, holds nothing; the bar comes from judged outcomes.
    #[test]
    fn a_claim_holds_unless_its_engine_shows_nothing_or_its_peer_is_barred() {
        let registry = Registry::new();
        let holds = Holds::new(HoldRule::default(), Instant::now(), &registry).unwrap();
        let from: SocketAddr = "10.0.0.1:7000".parse().unwrap();
        let p = PeerPrefill {
            replica: 0,
            blocks: 8,
            ready: s(10),
            claim: Some(Claim { from, at: s(10) }),
        };
        assert!(holds.trusts(&p, s(11), (0, 0)), "within the engine's lag");
        assert!(
            !holds.trusts(&p, s(14), (2, 2)),
            "only this node's own there"
        );
        assert!(holds.trusts(&p, s(14), (3, 2)));
        // Answers offset strikes; three unanswered claims within the minute bar the peer.
        holds.judge(from, BlockKey(1), false, s(14));
        holds.judge(from, BlockKey(2), false, s(15));
        holds.judge(from, BlockKey(9), true, s(16));
        holds.judge(from, BlockKey(3), false, s(17));
        assert!(holds.trusts(&p, s(17), (3, 2)), "two strikes stand");
        holds.judge(from, BlockKey(4), false, s(18));
        assert!(!holds.trusts(&p, s(18), (3, 2)), "barred");
        assert!(holds.trusts(&p, s(318), (3, 2)), "the bar lifts");
        // A tip from no load update (the simulator's) is not judged.
        let unclaimed = PeerPrefill { claim: None, ..p };
        assert!(holds.trusts(&unclaimed, s(18), (0, 0)));
    }
}
