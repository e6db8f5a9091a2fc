//! Offered holders whose pulls come back empty, and the back-off that leaves them out.
//!
//! Under regional gossip a node sees another region only through its offer, and the holder an
//! offer names for a prefix (`core::region_offer::OfferedHolder`) is a claim nothing else
//! corroborates: a certified member may name a real engine at an allowed host that lacks the
//! prefix. The pull then finds nothing and the local replica recomputes. The node cannot check
//! the claim up front, so it learns from outcomes: an answer whose engine reports fewer cached
//! tokens than the plan's start plus half the planned pull ([`is_empty_pull`]) is an *empty
//! pull*; [`EMPTY_PULLS_TO_BAR`] of them from one holder within [`EMPTY_WINDOW`] leave it out
//! of the offers folded in for [`BARRED_FOR`]. A lying member then costs at most three
//! recomputes per holder per five minutes, each one the replica would have done anyway.
//!
//! Keyed by the holder's URL (what the hint names, and what a replica connects to), at most
//! [`MAX_HOLDERS`] of them: the URL comes from outside. The strikes and bars are
//! `core::strike_book`'s, as for region peers' unanswered claims. Sans-IO: time is an argument.

use std::time::Duration;

pub use super::strike_book::Noted;
use super::strike_book::{BarRule, StrikeBook};

/// Empty pulls within [`EMPTY_WINDOW`] that leave a holder out.
pub const EMPTY_PULLS_TO_BAR: usize = 3;

/// How far back empty pulls count: a real holder that lost a prefix to eviction once in a
/// while is not left out; one that answers empty again and again is.
pub const EMPTY_WINDOW: Duration = Duration::from_secs(60);

/// How long a holder is left out: long enough that a lie costs little, short enough that a
/// holder that missed while warming up is offered again soon.
pub const BARRED_FOR: Duration = Duration::from_secs(300);

/// Most holders remembered. An offer names at most 4 holders a region and a node folds at
/// most 64 regions, so 256 holds every holder that matters at once; more (a member churning
/// URLs) evict the idle ones first, then the stalest.
pub const MAX_HOLDERS: usize = 256;

/// Whether an answer to a request told to pull `planned` tokens starting at `from_tokens` came
/// back empty: its engine reports fewer than `from_tokens` plus half the pull cached (engines
/// count pulled tokens in `cached_tokens`; half, so a pull cut short by a block or two at the
/// holder's eviction edge is not one).
pub fn is_empty_pull(reported_cached: u64, from_tokens: u64, planned: u64) -> bool {
    planned > 0 && reported_cached < from_tokens.saturating_add(planned / 2)
}

/// The offered holders' empty pulls and bars: the strike book's rule with the numbers above.
pub const RULE: BarRule = BarRule {
    strikes_to_bar: EMPTY_PULLS_TO_BAR,
    window: EMPTY_WINDOW,
    barred_for: BARRED_FOR,
    max_members: MAX_HOLDERS,
};

/// The per-holder counts of empty pulls and the bars (see the module doc).
#[derive(Debug)]
pub struct EmptyHolders {
    holders: StrikeBook<String>,
}

impl Default for EmptyHolders {
    fn default() -> Self {
        EmptyHolders {
            holders: StrikeBook::new(RULE),
        }
    }
}

impl EmptyHolders {
    /// Nothing counted.
    pub fn new() -> Self {
        EmptyHolders::default()
    }

    /// Holders remembered (barred or counting).
    pub fn len(&self) -> usize {
        self.holders.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    /// Whether the holder at `url` is left out at `now`.
    pub fn is_barred(&self, url: &str, now: Duration) -> bool {
        self.holders.is_barred(key(url), now)
    }

    /// A pull from the holder at `url` came back empty at `now`: every empty pull is a strike.
    pub fn note_empty(&mut self, url: &str, now: Duration) -> Noted {
        self.holders.strike(key(url), None, now)
    }
}

/// A holder's URL as counted: without a trailing `/` (offers and hints trim it too).
fn key(url: &str) -> &str {
    url.trim_end_matches('/')
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: &str = "http://10.0.0.7:8000";

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    #[test]
    fn three_empty_pulls_within_a_minute_leave_a_holder_out_for_five_minutes_then_it_is_back() {
        let mut e = EmptyHolders::new();
        assert_eq!(e.note_empty(H, s(10)), Noted::Counted);
        assert_eq!(e.note_empty(H, s(20)), Noted::Counted);
        assert!(!e.is_barred(H, s(20)));
        assert_eq!(e.note_empty(H, s(30)), Noted::Barred(s(330)));
        assert!(e.is_barred(H, s(30)));
        assert!(
            e.is_barred("http://10.0.0.7:8000/", s(329)),
            "a trailing / is the same holder"
        );
        assert_eq!(e.note_empty(H, s(40)), Noted::AlreadyBarred);
        assert!(e.is_barred(H, s(329)));
        // Back after five minutes, counting afresh.
        assert!(!e.is_barred(H, s(330)));
        assert_eq!(e.note_empty(H, s(331)), Noted::Counted);
        assert_eq!(e.note_empty(H, s(332)), Noted::Counted);
        assert_eq!(e.note_empty(H, s(333)), Noted::Barred(s(633)));
        assert!(
            !e.is_barred("http://10.0.0.8:8000", s(333)),
            "others are not"
        );
    }

    #[test]
    fn empty_pulls_further_apart_than_the_window_do_not_add_up() {
        let mut e = EmptyHolders::new();
        for t in [0, 40, 80, 120, 160] {
            assert_eq!(e.note_empty(H, s(t)), Noted::Counted, "at {t} s");
        }
        assert!(!e.is_barred(H, s(160)));
        assert_eq!(e.note_empty(H, s(170)), Noted::Barred(s(470)));
    }

    #[test]
    fn the_map_is_capped_idle_holders_go_first_then_the_stalest_and_a_bar_survives_churn() {
        let mut e = EmptyHolders::new();
        // A holder barred at 0–2 s.
        for t in 0..3 {
            e.note_empty(H, s(t));
        }
        // Idle holders (one empty pull long ago) fill the map.
        for i in 0..MAX_HOLDERS - 1 {
            e.note_empty(&format!("http://idle-{i}"), s(3));
        }
        assert_eq!(e.len(), MAX_HOLDERS);
        // A minute later a churning member's new URLs evict the idle ones, never past the cap,
        // and the bar stays.
        for i in 0..2 * MAX_HOLDERS {
            e.note_empty(
                &format!("http://churn-{i}"),
                s(100) + Duration::from_millis(i as u64),
            );
            assert!(e.len() <= MAX_HOLDERS);
        }
        assert!(
            e.is_barred(H, s(200)),
            "the idle went first, not the barred"
        );
        // With nothing idle, the stalest goes: the oldest churned URL, not the newest.
        assert!(!e.holders.remembers("http://churn-0"));
        assert!(e
            .holders
            .remembers(format!("http://churn-{}", 2 * MAX_HOLDERS - 1).as_str()));
    }

    #[test]
    fn an_empty_pull_is_one_that_brought_less_than_half_its_plan() {
        assert!(is_empty_pull(0, 0, 8192));
        assert!(is_empty_pull(1000, 1000, 8192), "only what the target held");
        assert!(is_empty_pull(5000, 1000, 8192));
        assert!(!is_empty_pull(5096, 1000, 8192), "half arrived");
        assert!(!is_empty_pull(9192, 1000, 8192));
        assert!(!is_empty_pull(0, 0, 0), "no pull planned");
        assert!(!is_empty_pull(u64::MAX, u64::MAX, u64::MAX));
    }
}
