//! Strikes against members whose claims prove false, and the bar that stops believing them.
//!
//! Some claims a certified member makes cannot be checked when they arrive: a holder an offer
//! names may lack the prefix (`core::empty_holders`), a prefill a region peer says is under way
//! may never answer (`core::unanswered_claims`). The node learns from outcomes instead. Each
//! claim that proved false is a *strike* against whoever made it; [`BarRule::strikes_to_bar`]
//! strikes within [`BarRule::window`] bar that member for [`BarRule::barred_for`], and it
//! starts counting afresh when the bar ends. A lie then costs a bounded, small amount of work
//! per bar, and an honest member whose claim failed once in a while is never barred.
//!
//! A strike may name the claim it is for: strikes for one claim count once within the window
//! (many requests may rest on one claim), and one claim proved true takes one strike back
//! ([`StrikeBook::forgive`]). Keyed by something from outside (a URL, an address), so at most
//! [`BarRule::max_members`] are remembered: the idle go first, then the stalest unbarred (a
//! member churning names cannot lift its bar), then the stalest. Sans-IO: time is an argument.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;
use std::time::Duration;

use super::keys::BlockKey;

/// When strikes bar a member, for how long, and how many members are remembered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BarRule {
    /// Strikes within `window` that bar a member.
    pub strikes_to_bar: usize,
    /// How far back strikes count.
    pub window: Duration,
    /// How long a bar lasts.
    pub barred_for: Duration,
    /// Most members remembered, barred or counting.
    pub max_members: usize,
}

/// What a strike did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Noted {
    /// Counted; the member is still believed.
    Counted,
    /// This strike was the member's last allowed one: barred until the returned time.
    Barred(Duration),
    /// The member was already barred (a claim made before the bar, judged after).
    AlreadyBarred,
}

/// One member's recent strikes and its bar.
#[derive(Clone, Debug, Default)]
struct Record {
    /// Its strikes within the window, oldest first, each with the claim it was for (if named);
    /// at most `strikes_to_bar`.
    strikes: Vec<(Duration, Option<BlockKey>)>,
    /// The last claim that took a strike back: one claim, one strike back.
    last_forgiven: Option<BlockKey>,
    /// Barred until then, if barred.
    barred_until: Option<Duration>,
    /// Its last strike: the eviction order.
    last: Duration,
}

impl Record {
    fn barred(&self, now: Duration) -> bool {
        self.barred_until.is_some_and(|t| now < t)
    }

    /// Whether forgetting it changes nothing: not barred, no strike within the window.
    fn idle(&self, now: Duration, window: Duration) -> bool {
        !self.barred(now) && now.saturating_sub(self.last) >= window
    }
}

/// Members' strikes and bars under one [`BarRule`] (see the module doc).
#[derive(Debug)]
pub struct StrikeBook<K> {
    rule: BarRule,
    members: HashMap<K, Record>,
}

impl<K: Hash + Eq + Clone> StrikeBook<K> {
    /// Nothing counted.
    pub fn new(rule: BarRule) -> Self {
        StrikeBook {
            rule,
            members: HashMap::new(),
        }
    }

    /// Members remembered (barred or counting).
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Whether `who` is barred at `now`.
    pub fn is_barred<Q>(&self, who: &Q, now: Duration) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        !self.members.is_empty() && self.members.get(who).is_some_and(|r| r.barred(now))
    }

    /// A claim of `who` proved false at `now`. With `claim` named, a claim already struck
    /// within the window is not struck again.
    pub fn strike<Q>(&mut self, who: &Q, claim: Option<BlockKey>, now: Duration) -> Noted
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        if !self.members.contains_key(who) {
            self.make_room(now);
            // The key is copied only for a new member, not on every strike.
            self.members.insert(who.to_owned(), Record::default());
        }
        let rule = self.rule;
        let Some(r) = self.members.get_mut(who) else {
            return Noted::Counted;
        };
        r.last = now;
        if r.barred(now) {
            return Noted::AlreadyBarred;
        }
        r.strikes
            .retain(|&(t, _)| now.saturating_sub(t) < rule.window);
        if claim.is_none() || !r.strikes.iter().any(|&(_, c)| c == claim) {
            r.strikes.push((now, claim));
        }
        if r.strikes.len() < rule.strikes_to_bar {
            return Noted::Counted;
        }
        // Barred: it starts counting afresh when the bar ends.
        r.strikes.clear();
        let until = now.saturating_add(rule.barred_for);
        r.barred_until = Some(until);
        Noted::Barred(until)
    }

    /// A claim of `who` proved true: its oldest strike is taken back, once per claim. A bar
    /// stands; a member never struck is not remembered.
    pub fn forgive<Q>(&mut self, who: &Q, claim: BlockKey)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let Some(r) = self.members.get_mut(who) else {
            return;
        };
        if r.last_forgiven != Some(claim) && !r.strikes.is_empty() {
            r.strikes.remove(0);
        }
        r.last_forgiven = Some(claim);
    }

    /// Below the cap before a new member: the idle ones go first, then the stalest unbarred
    /// one, then the stalest.
    fn make_room(&mut self, now: Duration) {
        if self.members.len() < self.rule.max_members {
            return;
        }
        let window = self.rule.window;
        self.members.retain(|_, r| !r.idle(now, window));
        while self.members.len() >= self.rule.max_members {
            let Some(stalest) = self
                .members
                .iter()
                .min_by_key(|(_, r)| (r.barred(now), r.last))
                .map(|(k, _)| k.clone())
            else {
                return;
            };
            self.members.remove(&stalest);
        }
    }

    /// Whether `who` is remembered at all (tests of eviction order).
    #[cfg(test)]
    pub fn remembers<Q>(&self, who: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.members.contains_key(who)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULE: BarRule = BarRule {
        strikes_to_bar: 2,
        window: Duration::from_secs(10),
        barred_for: Duration::from_secs(30),
        max_members: 4,
    };

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    #[test]
    fn unnamed_strikes_each_count_and_a_named_claim_counts_once_within_the_window() {
        let mut book: StrikeBook<u32> = StrikeBook::new(RULE);
        assert_eq!(book.strike(&1, None, s(0)), Noted::Counted);
        assert_eq!(book.strike(&1, None, s(1)), Noted::Barred(s(31)));
        for t in 0..5 {
            assert_eq!(book.strike(&2, Some(BlockKey(7)), s(t)), Noted::Counted);
        }
        assert!(!book.is_barred(&2, s(5)));
        assert_eq!(
            book.strike(&2, Some(BlockKey(8)), s(6)),
            Noted::Barred(s(36))
        );
        assert_eq!(book.strike(&2, None, s(7)), Noted::AlreadyBarred);
        assert!(book.is_barred(&2, s(35)) && !book.is_barred(&2, s(36)));
    }

    #[test]
    fn a_claim_proved_true_takes_one_strike_back_and_the_book_stays_capped() {
        let mut book: StrikeBook<u32> = StrikeBook::new(RULE);
        book.strike(&1, Some(BlockKey(1)), s(0));
        book.forgive(&1, BlockKey(9));
        book.forgive(&1, BlockKey(9));
        assert_eq!(book.strike(&1, Some(BlockKey(2)), s(1)), Noted::Counted);
        assert_eq!(
            book.strike(&1, Some(BlockKey(3)), s(2)),
            Noted::Barred(s(32))
        );
        book.forgive(&5, BlockKey(1));
        assert!(
            !book.remembers(&5),
            "a member never struck is not remembered"
        );
        for who in 10..20 {
            book.strike(&who, None, s(3));
            assert!(book.len() <= RULE.max_members);
        }
        assert!(book.is_barred(&1, s(3)), "the unbarred went first");
    }
}
