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
//! [`BARRED_FOR`]. A claim answered by its claimer's own first-byte tip takes one strike back
//! (once per claim; another member's answer releases the hold but counts neither way,
//! `core::peer_tips::Answer`): an honest peer whose engine was slow once is not barred by two
//! more slow answers among many good ones. A lying member then costs each other node at most three waits of
//! `max_wait_ms` (for the requests held on them at once) per five minutes.
//!
//! The engine's own figures check a claim up front ([`engine_denies`]), as `PeerLoads::weigh`
//! checks load claims: a claim older than [`ENGINE_LAG`] at a replica whose engine reports
//! nothing beyond this node's own requests is not held on.
//!
//! Keyed by the peer's address (who sent the load update), at most [`MAX_PEERS`]. The strikes
//! and bars are `core::strike_book`'s. Sans-IO: time is an argument.

use std::net::SocketAddr;
use std::time::Duration;

use super::keys::BlockKey;
pub use super::strike_book::Noted;
use super::strike_book::{BarRule, StrikeBook};

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

/// The region peers' unanswered claims and bars: the strike book's rule with the numbers above.
pub const RULE: BarRule = BarRule {
    strikes_to_bar: UNANSWERED_TO_BAR,
    window: UNANSWERED_WINDOW,
    barred_for: BARRED_FOR,
    max_members: MAX_PEERS,
};

/// The per-peer strikes and bars (see the module doc).
#[derive(Debug)]
pub struct UnansweredClaims {
    peers: StrikeBook<SocketAddr>,
}

impl Default for UnansweredClaims {
    fn default() -> Self {
        UnansweredClaims {
            peers: StrikeBook::new(RULE),
        }
    }
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
        self.peers.is_barred(&from, now)
    }

    /// A hold on `from`'s claim of the prefix ending in `claim` ended at `now` without its
    /// first byte. A claim already counted within the window is not counted again (many
    /// requests may ride on one).
    pub fn note_unanswered(&mut self, from: SocketAddr, claim: BlockKey, now: Duration) -> Noted {
        self.peers.strike(&from, Some(claim), now)
    }

    /// A hold on `from`'s claim ending in `claim` was released by its first byte: the oldest
    /// strike is taken back, once per claim. A bar stands.
    pub fn note_answered(&mut self, from: SocketAddr, claim: BlockKey) {
        self.peers.forgive(&from, claim);
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
