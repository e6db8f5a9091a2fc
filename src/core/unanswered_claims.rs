//! Region peers whose "prefill under way" claims hold requests in vain, and the bar that stops
//! holding on them.
//!
//! A node holds a request that rides on a prefill another node of its region sent to the same
//! replica until that node's first-byte tip (`core::hold::peer_plan`). The tip is a claim
//! nothing else corroborates at once: a certified member can claim prefills that never were,
//! or never send their first bytes, and every other node then holds matching requests up to
//! `[hold] max_wait_ms` each. As with offered holders that deliver nothing
//! (`core::empty_holders`), the node learns from outcomes: a hold on a peer's claim that ends
//! without the claimed prefill's first-byte tip (its deadline passed, or the claim expired
//! unanswered) is an *unanswered claim*; [`UNANSWERED_TO_BAR`] distinct ones from one peer
//! within [`UNANSWERED_WINDOW`] and the node holds on none of that peer's claims for
//! [`BARRED_FOR`]. A claim answered by its first byte takes one strike back (once per claim):
//! an honest peer whose engine was slow once is not barred by two more slow answers among
//! many good ones. A lying member then costs each other node at most three waits of
//! `max_wait_ms` (for the requests held on them at once) per five minutes.
//!
//! The engine's own figures check a claim up front ([`engine_denies`]), as `PeerLoads::weigh`
//! checks load claims: a claim older than [`ENGINE_LAG`] at a replica whose engine reports
//! nothing beyond this node's own requests is not held on.
//!
//! Keyed by the peer's address (who sent the load update), at most [`MAX_PEERS`]. Sans-IO:
//! time is an argument.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use super::empty_holders::Noted;
use super::keys::BlockKey;

/// Distinct unanswered claims within [`UNANSWERED_WINDOW`] that bar a peer. Three, as for
/// empty pulls: one or two can be an honest prefill past `max_wait_ms` (20 s by default, three
/// times a 110k-token prompt's prefill) on an overloaded replica; three in a minute are not.
pub const UNANSWERED_TO_BAR: usize = 3;

/// How far back unanswered claims count.
pub const UNANSWERED_WINDOW: Duration = Duration::from_secs(60);

/// How long a barred peer's claims hold nothing: long enough that a lie costs little (three
/// holds per five minutes), short enough that an honest peer's overloaded minute is forgotten
/// soon (while barred its followers only lose the hold's gain, as before the hold existed).
pub const BARRED_FOR: Duration = Duration::from_secs(300);

/// Most peers remembered: the load updates' own bound on peers (`LoadShareConfig::max_peers`).
pub const MAX_PEERS: usize = 256;

/// How long a claimed prefill may go unseen by its replica's engine: the scrape's and the
/// update's lag, as `LoadShareConfig::unbacked_grace`.
pub const ENGINE_LAG: Duration = Duration::from_secs(3);

/// Whether the replica's engine contradicts a claim received at `claimed_at`: by `now` it is
/// older than [`ENGINE_LAG`], and the engine reports no request (`engine_requests`: waiting
/// and running) beyond this node's own `own_in_flight` there, so no peer's prefill is under way.
pub fn engine_denies(
    claimed_at: Duration,
    now: Duration,
    engine_requests: u32,
    own_in_flight: u32,
) -> bool {
    now.saturating_sub(claimed_at) >= ENGINE_LAG && engine_requests <= own_in_flight
}

/// One peer's recent unanswered claims and its bar.
#[derive(Clone, Debug, Default)]
struct Peer {
    /// When its distinct unanswered claims within the window came, with their tip keys, oldest
    /// first (at most [`UNANSWERED_TO_BAR`]).
    unanswered: Vec<(Duration, BlockKey)>,
    /// The last claim whose answer took a strike back: one claim, one strike, however many
    /// requests rode on it.
    last_answered: Option<BlockKey>,
    /// Not held on until then, if barred.
    barred_until: Option<Duration>,
    /// Its last outcome: the eviction order.
    last: Duration,
}

impl Peer {
    fn barred(&self, now: Duration) -> bool {
        self.barred_until.is_some_and(|t| now < t)
    }

    /// Whether forgetting it changes nothing: not barred, no strike within the window.
    fn idle(&self, now: Duration) -> bool {
        !self.barred(now) && now.saturating_sub(self.last) >= UNANSWERED_WINDOW
    }
}

/// The per-peer strikes and bars (see the module doc).
#[derive(Debug, Default)]
pub struct UnansweredClaims {
    peers: HashMap<SocketAddr, Peer>,
}

impl UnansweredClaims {
    /// Nothing counted.
    pub fn new() -> Self {
        UnansweredClaims::default()
    }

    /// Peers remembered.
    pub fn len(&self) -> usize {
        self.peers.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }

    /// Whether the claims of the peer at `from` hold nothing at `now`.
    pub fn is_barred(&self, from: SocketAddr, now: Duration) -> bool {
        !self.peers.is_empty() && self.peers.get(&from).is_some_and(|p| p.barred(now))
    }

    /// A hold on `from`'s claim of the prefix ending in `claim` ended at `now` without its
    /// first byte. A claim already counted within the window is not counted again (many
    /// requests may ride on one).
    pub fn note_unanswered(&mut self, from: SocketAddr, claim: BlockKey, now: Duration) -> Noted {
        if !self.peers.contains_key(&from) {
            self.make_room(now);
        }
        let p = self.peers.entry(from).or_default();
        p.last = now;
        if p.barred(now) {
            return Noted::AlreadyBarred;
        }
        p.unanswered
            .retain(|&(t, _)| now.saturating_sub(t) < UNANSWERED_WINDOW);
        if !p.unanswered.iter().any(|&(_, k)| k == claim) {
            p.unanswered.push((now, claim));
        }
        if p.unanswered.len() < UNANSWERED_TO_BAR {
            return Noted::Counted;
        }
        // Barred: it starts counting afresh when the bar ends.
        p.unanswered.clear();
        let until = now.saturating_add(BARRED_FOR);
        p.barred_until = Some(until);
        Noted::Barred(until)
    }

    /// A hold on `from`'s claim ending in `claim` was released by its first byte: the oldest
    /// strike is taken back, once per claim. A bar stands.
    pub fn note_answered(&mut self, from: SocketAddr, claim: BlockKey) {
        let Some(p) = self.peers.get_mut(&from) else {
            return;
        };
        if p.last_answered != Some(claim) && !p.unanswered.is_empty() {
            p.unanswered.remove(0);
        }
        p.last_answered = Some(claim);
    }

    /// Below [`MAX_PEERS`] before a new peer: the idle ones go first, then the stalest unbarred
    /// one, then the stalest.
    fn make_room(&mut self, now: Duration) {
        if self.peers.len() < MAX_PEERS {
            return;
        }
        self.peers.retain(|_, p| !p.idle(now));
        while self.peers.len() >= MAX_PEERS {
            let Some(stalest) = self
                .peers
                .iter()
                .min_by_key(|(_, p)| (p.barred(now), p.last))
                .map(|(a, _)| *a)
            else {
                return;
            };
            self.peers.remove(&stalest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    fn peer(n: u8) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, n], 7000))
    }

    #[test]
    fn three_unanswered_claims_in_a_minute_bar_a_peer_for_five_minutes_then_it_is_back() {
        let mut u = UnansweredClaims::new();
        let a = peer(1);
        assert_eq!(u.note_unanswered(a, BlockKey(1), s(10)), Noted::Counted);
        assert_eq!(u.note_unanswered(a, BlockKey(2), s(20)), Noted::Counted);
        assert!(!u.is_barred(a, s(20)));
        assert_eq!(
            u.note_unanswered(a, BlockKey(3), s(30)),
            Noted::Barred(s(330))
        );
        assert!(u.is_barred(a, s(30)));
        assert!(u.is_barred(a, s(329)));
        assert!(!u.is_barred(peer(2), s(30)), "others are not");
        assert_eq!(
            u.note_unanswered(a, BlockKey(4), s(40)),
            Noted::AlreadyBarred
        );
        u.note_answered(a, BlockKey(5));
        assert!(u.is_barred(a, s(40)), "an answer does not lift a bar");
        // Back after five minutes, counting afresh.
        assert!(!u.is_barred(a, s(330)));
        assert_eq!(u.note_unanswered(a, BlockKey(6), s(331)), Noted::Counted);
    }

    #[test]
    fn many_requests_held_on_one_claim_are_one_strike_and_strikes_a_minute_apart_do_not_add_up() {
        let mut u = UnansweredClaims::new();
        let a = peer(1);
        for t in 0..10 {
            assert_eq!(u.note_unanswered(a, BlockKey(1), s(t)), Noted::Counted);
        }
        for (t, k) in [(70, 2), (140, 3), (210, 4)] {
            assert_eq!(u.note_unanswered(a, BlockKey(k), s(t)), Noted::Counted);
        }
        assert!(!u.is_barred(a, s(210)));
    }

    #[test]
    fn an_answered_claim_takes_one_strike_back_once() {
        let mut u = UnansweredClaims::new();
        let a = peer(1);
        u.note_unanswered(a, BlockKey(1), s(1));
        u.note_unanswered(a, BlockKey(2), s(2));
        // Three requests released by one answer: one strike back.
        for _ in 0..3 {
            u.note_answered(a, BlockKey(9));
        }
        assert_eq!(u.note_unanswered(a, BlockKey(3), s(3)), Noted::Counted);
        assert_eq!(
            u.note_unanswered(a, BlockKey(4), s(4)),
            Noted::Barred(s(304))
        );
        // An answer from a peer never counted remembers nothing.
        u.note_answered(peer(2), BlockKey(1));
        assert_eq!(u.len(), 1);
    }

    #[test]
    fn the_map_is_capped_and_a_bar_survives_churn() {
        let mut u = UnansweredClaims::new();
        let a = peer(1);
        for k in 0..3 {
            u.note_unanswered(a, BlockKey(k), s(k));
        }
        assert!(u.is_barred(a, s(3)));
        let other = |i: usize| SocketAddr::from(([10, 1, (i >> 8) as u8, i as u8], 7000));
        for i in 0..MAX_PEERS - 1 {
            u.note_unanswered(other(i), BlockKey(1), s(3));
        }
        assert_eq!(u.len(), MAX_PEERS);
        for i in 0..2 * MAX_PEERS {
            let churn = SocketAddr::from(([10, 2, (i >> 8) as u8, i as u8], 7000));
            u.note_unanswered(churn, BlockKey(1), s(100) + Duration::from_millis(i as u64));
            assert!(u.len() <= MAX_PEERS);
        }
        assert!(
            u.is_barred(a, s(200)),
            "the idle went first, not the barred"
        );
    }

    #[test]
    fn an_old_claim_the_engine_does_not_see_is_denied() {
        // Within the engine's lag: not judged.
        assert!(!engine_denies(s(10), s(12), 0, 0));
        // Past it, nothing beyond this node's own requests at the engine: denied.
        assert!(engine_denies(s(10), s(13), 0, 0));
        assert!(engine_denies(s(10), s(13), 2, 2));
        // Something else running or waiting there: the claim may be true.
        assert!(!engine_denies(s(10), s(13), 3, 2));
        assert!(!engine_denies(s(10), s(5), 0, 0), "a clock behind");
    }
}
