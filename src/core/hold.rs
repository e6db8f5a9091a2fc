//! Holding a request back while its replica still computes the prompt it was credited with.
//!
//! The router counts a prompt still being prefilled at a replica as cached there (the overlay,
//! `view.rs`: a burst of one prompt rides on its first copy). But an engine finds a prompt's
//! blocks only as its chunks are scheduled: a second copy (or a next turn extending it) sent
//! while the first is in prefill matches the chunks scheduled so far, recomputes the rest in
//! parallel, and shares the step's token budget with the first, so both finish late. Held at
//! the node until the first copy's first byte, it finds the whole prompt cached and answers at
//! once. Agentic sessions send exactly this: one
//! session's 110k-token turns, cut at the context cap, arrive every ~2 s while the first copy
//! computes for ~7 s (docs/operations.md, "Bursts of one prompt").
//!
//! [`PrefillBook`] lists, per replica, the long prefills this node sent that have no first byte
//! yet ([`Prefilling`]: their keys and the hit they were credited with), and counts the
//! requests held. [`PrefillBook::plan`] is the rule: a request rides on the prefill that
//! computes the most of its credited blocks, if those are at least [`HoldRule::min_share`] of
//! its prompt; it waits until that prefill's first byte, at most until a deadline from the
//! prefill's predicted end. Synchronous and clock-free, like the rest of the core: the node
//! (`node/hold.rs`) wraps it in a lock and a wake-up.

use std::time::Duration;

use super::keys::{shared_blocks, BlockKey};

/// Most prefills listed per replica: beyond it a new one is not listed (nothing rides on it).
pub const MAX_PREFILLING_PER_REPLICA: usize = 64;

/// A prefill predicted to end in `ready_in` is waited for until `LATE_FACTOR × ready_in` (plus
/// [`HoldRule::margin`]) after it was routed: the cost model prices queued prefill linearly,
/// without attention, and a 110k-token prompt takes about three times its linear price.
pub const LATE_FACTOR: u32 = 4;

/// Which requests are held, and for how long (`[hold]` in the node's configuration).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HoldRule {
    /// Off: nothing is listed or held.
    pub enabled: bool,
    /// A request is held only if the blocks it rides on (credited to it, still computing) are
    /// at least this share of its prompt's blocks. In (0, 1].
    pub min_share: f64,
    /// Only prefills of at least this many blocks not already cached are listed: a short one
    /// ends before holding could pay.
    pub min_blocks: u32,
    /// Added to a prefill's late bound ([`LATE_FACTOR`]) for its deadline.
    pub margin: Duration,
    /// No request is held longer than this, whatever its prefill's prediction.
    pub max_wait: Duration,
    /// Most requests held at once at one node.
    pub max_held: u32,
    /// Most requests held at once for one replica.
    pub max_held_per_replica: u32,
}

impl Default for HoldRule {
    fn default() -> Self {
        HoldRule {
            enabled: true,
            min_share: 0.5,
            min_blocks: 64,
            margin: Duration::from_secs(1),
            max_wait: Duration::from_secs(20),
            max_held: 256,
            max_held_per_replica: 64,
        }
    }
}

impl HoldRule {
    /// Whether a prefill of a `prompt_blocks` prompt credited with `hit_blocks` is long enough
    /// to be listed for requests to ride on ([`HoldRule::min_blocks`] computed, the rule on).
    pub fn lists(&self, prompt_blocks: usize, hit_blocks: u32) -> bool {
        let computes = prompt_blocks.saturating_sub(hit_blocks as usize);
        self.enabled && computes >= self.min_blocks.max(1) as usize
    }
}

/// One long prefill this node sent to a replica, with no first byte yet.
#[derive(Clone, Debug)]
pub struct Prefilling {
    /// Its number in the book (never reused).
    pub id: u64,
    /// Its prompt's block keys.
    keys: Box<[BlockKey]>,
    /// Leading blocks it was credited with (cached, or computing for another request): it
    /// computes the rest.
    hit_blocks: u32,
    /// Past this, whoever rides on it goes anyway.
    deadline: Duration,
}

/// What [`PrefillBook::plan`] decided for one request: wait for prefill `on`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HoldPlan {
    /// The prefill waited for ([`Prefilling::id`]).
    pub on: u64,
    /// The request's credited blocks that prefill is still computing.
    pub riding_blocks: u32,
    /// When the request goes anyway (core time).
    pub deadline: Duration,
}

/// Why a request was not held though it qualified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoldRefused {
    /// [`HoldRule::max_held`] or [`HoldRule::max_held_per_replica`] reached.
    Full,
}

/// The long prefills in flight per replica and the requests held on them (see the module doc).
#[derive(Debug, Default)]
pub struct PrefillBook {
    /// By replica index.
    replicas: Vec<PerReplica>,
    /// Requests held at once, all replicas.
    held: u32,
    /// The next [`Prefilling::id`].
    next_id: u64,
}

/// One replica's part of the book.
#[derive(Debug, Default)]
struct PerReplica {
    /// Its listed prefills (≤ [`MAX_PREFILLING_PER_REPLICA`]).
    prefilling: Vec<Prefilling>,
    /// Requests held for it.
    held: u32,
}

/// Blocks of a `prompt_blocks`-block prompt a request must ride on to be held: at least
/// `rule.min_share` of them, and at least one.
pub fn riding_needed(rule: &HoldRule, prompt_blocks: usize) -> usize {
    (rule.min_share * prompt_blocks as f64).ceil().max(1.0) as usize
}

/// The rule for a prefill *another node* of the region sent to the request's replica, known
/// only by its tips (`core::peer_tips`): a request credited with `hit_blocks` of a `prompt_blocks`
/// prompt rides on the peer's `peer_blocks`-block prefill, not answered yet, if the credited
/// blocks it shares are at least `rule.min_share` of its prompt. It waits until the peer's
/// first-byte tip, or the returned deadline: `rule.max_wait` from `now` (the peer's routing
/// time is not known here, so no late bound from it; its tip's own lifetime ends the wait
/// sooner). Unlike [`PrefillBook::plan`] the part the peer found cached is not known: a
/// prompt of fewer than [`HoldRule::min_blocks`] is not waited for, but a long prompt's short
/// uncached tail can hold a request too; the deadline bounds that.
pub fn peer_plan(
    rule: &HoldRule,
    prompt_blocks: usize,
    hit_blocks: u32,
    peer_blocks: u32,
    now: Duration,
) -> Option<Duration> {
    let riding = peer_blocks.min(hit_blocks) as usize;
    let long = peer_blocks >= rule.min_blocks.max(1);
    (rule.enabled && long && prompt_blocks > 0 && riding >= riding_needed(rule, prompt_blocks))
        .then(|| now.saturating_add(rule.max_wait))
}

impl PrefillBook {
    /// Lists a prefill of `keys` sent to replica `i`, credited with `hit_blocks`, predicted done
    /// `ready_in` after `now`, if it is long enough to ride on; returns its id.
    pub fn started(
        &mut self,
        rule: &HoldRule,
        i: usize,
        keys: &[BlockKey],
        hit_blocks: u32,
        now: Duration,
        ready_in: Duration,
    ) -> Option<u64> {
        if !rule.lists(keys.len(), hit_blocks) {
            return None;
        }
        if self.replicas.len() <= i {
            self.replicas.resize_with(i + 1, PerReplica::default);
        }
        let r = &mut self.replicas[i];
        if r.prefilling.len() >= MAX_PREFILLING_PER_REPLICA {
            return None;
        }
        let id = self.next_id;
        self.next_id += 1;
        let deadline = now
            .saturating_add(ready_in.saturating_mul(LATE_FACTOR))
            .saturating_add(rule.margin);
        r.prefilling.push(Prefilling {
            id,
            keys: keys.into(),
            hit_blocks,
            deadline,
        });
        Some(id)
    }

    /// Prefill `id` at replica `i` sent its first byte, or ended without one: unlisted.
    /// Returns whether it was listed.
    pub fn done(&mut self, i: usize, id: u64) -> bool {
        let Some(r) = self.replicas.get_mut(i) else {
            return false;
        };
        match r.prefilling.iter().position(|p| p.id == id) {
            Some(at) => {
                r.prefilling.swap_remove(at);
                true
            }
            None => false,
        }
    }

    /// Whether prefill `id` at replica `i` is still computing (listed).
    pub fn computing(&self, i: usize, id: u64) -> bool {
        self.replicas
            .get(i)
            .is_some_and(|r| r.prefilling.iter().any(|p| p.id == id))
    }

    /// Prefills listed at replica `i`.
    pub fn prefilling(&self, i: usize) -> usize {
        self.replicas.get(i).map_or(0, |r| r.prefilling.len())
    }

    /// Requests held for replica `i` now.
    pub fn held_at(&self, i: usize) -> u32 {
        self.replicas.get(i).map_or(0, |r| r.held)
    }

    /// Requests held now, all replicas.
    pub fn held(&self) -> u32 {
        self.held
    }

    /// The rule: should a request of `keys`, routed to replica `i` credited with `hit_blocks`,
    /// wait for a prefill there? The prefill that computes the most of its credited blocks,
    /// if those are at least `rule.min_share` of its prompt and its deadline is still ahead;
    /// the request goes at that deadline, or `rule.max_wait` from `now`, whichever is first.
    pub fn plan(
        &self,
        rule: &HoldRule,
        i: usize,
        keys: &[BlockKey],
        hit_blocks: u32,
        now: Duration,
    ) -> Option<HoldPlan> {
        if !rule.enabled || keys.is_empty() {
            return None;
        }
        let credited = &keys[..(hit_blocks as usize).min(keys.len())];
        let need = riding_needed(rule, keys.len());
        let r = self.replicas.get(i)?;
        let best = r
            .prefilling
            .iter()
            .filter(|p| p.deadline > now)
            .map(|p| {
                let shared = shared_blocks(credited, &p.keys);
                (p, shared.saturating_sub(p.hit_blocks as usize))
            })
            .filter(|&(_, riding)| riding >= need)
            .max_by(|a, b| a.1.cmp(&b.1).then(b.0.deadline.cmp(&a.0.deadline)))?;
        let (p, riding) = best;
        Some(HoldPlan {
            on: p.id,
            riding_blocks: u32::try_from(riding).unwrap_or(u32::MAX),
            deadline: p.deadline.min(now.saturating_add(rule.max_wait)),
        })
    }

    /// Takes a held slot for replica `i` under the rule's caps.
    pub fn hold(&mut self, rule: &HoldRule, i: usize) -> Result<(), HoldRefused> {
        if self.held >= rule.max_held {
            return Err(HoldRefused::Full);
        }
        if self.replicas.len() <= i {
            self.replicas.resize_with(i + 1, PerReplica::default);
        }
        let r = &mut self.replicas[i];
        if r.held >= rule.max_held_per_replica {
            return Err(HoldRefused::Full);
        }
        r.held += 1;
        self.held += 1;
        Ok(())
    }

    /// Gives back a slot [`PrefillBook::hold`] took.
    pub fn unhold(&mut self, i: usize) {
        if let Some(r) = self.replicas.get_mut(i) {
            r.held = r.held.saturating_sub(1);
        }
        self.held = self.held.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(tag: u64, n: usize) -> Vec<BlockKey> {
        (0..n as u64).map(|i| BlockKey(tag << 32 | i)).collect()
    }

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_peers_long_prefill_holds_a_request_riding_on_most_of_it_until_max_wait() {
        let rule = HoldRule::default();
        let now = 3 * S;
        // Credited with 900 of 1,000 blocks, 800 of them from a peer's 800-block prefill.
        assert_eq!(
            peer_plan(&rule, 1000, 900, 800, now),
            Some(now + rule.max_wait)
        );
        // Under half the prompt rides on it: sent at once.
        assert_eq!(peer_plan(&rule, 1000, 900, 400, now), None);
        assert_eq!(peer_plan(&rule, 1000, 400, 800, now), None);
        // A peer's prompt shorter than `min_blocks` ends before holding could pay.
        let short = HoldRule {
            min_blocks: 801,
            ..rule
        };
        assert_eq!(peer_plan(&short, 1000, 900, 800, now), None);
        let off = HoldRule {
            enabled: false,
            ..rule
        };
        assert_eq!(peer_plan(&off, 1000, 900, 800, now), None);
        assert_eq!(peer_plan(&rule, 0, 0, 800, now), None);
    }

    #[test]
    fn a_repeat_of_a_computing_prompt_waits_for_it_until_its_deadline() {
        let rule = HoldRule::default();
        let mut book = PrefillBook::default();
        let k = chain(1, 1000);
        let id = book.started(&rule, 2, &k, 0, S, 2 * S).unwrap();
        let plan = book.plan(&rule, 2, &k, 1000, 3 * S).unwrap();
        assert_eq!(plan.on, id);
        assert_eq!(plan.riding_blocks, 1000);
        // Routed at 1 s, predicted 2 s: late bound 1 + 4 × 2 + 1 (margin) = 10 s.
        assert_eq!(plan.deadline, 10 * S);
        // Another replica, or the request not credited with it: nothing to wait for.
        assert_eq!(book.plan(&rule, 1, &k, 1000, 3 * S), None);
        assert_eq!(book.plan(&rule, 2, &k, 0, 3 * S), None);
        // Past the deadline it is not waited for.
        assert_eq!(book.plan(&rule, 2, &k, 1000, 10 * S), None);
        assert!(book.done(2, id));
        assert!(!book.computing(2, id));
        assert_eq!(book.plan(&rule, 2, &k, 1000, 3 * S), None);
    }

    #[test]
    fn max_wait_caps_the_deadline() {
        let rule = HoldRule {
            max_wait: 2 * S,
            ..HoldRule::default()
        };
        let mut book = PrefillBook::default();
        let k = chain(1, 1000);
        book.started(&rule, 0, &k, 0, S, 100 * S).unwrap();
        assert_eq!(
            book.plan(&rule, 0, &k, 1000, 3 * S).unwrap().deadline,
            5 * S
        );
    }

    #[test]
    fn a_longer_turn_rides_on_the_shorter_prompt_computing_only_for_its_own_share() {
        let rule = HoldRule::default();
        let mut book = PrefillBook::default();
        let k = chain(1, 1000);
        // The computing prompt already had 600 blocks cached: it computes 400.
        book.started(&rule, 0, &k[..800], 600, S, S).unwrap();
        // A longer turn credited with the 800: rides on 200 of its 1000 blocks, under half.
        assert_eq!(book.plan(&rule, 0, &k, 800, 2 * S), None);
        // With a lower share it waits.
        let low = HoldRule {
            min_share: 0.2,
            ..rule
        };
        assert_eq!(
            book.plan(&low, 0, &k, 800, 2 * S).unwrap().riding_blocks,
            200
        );
    }

    #[test]
    fn it_rides_on_the_prefill_computing_most_of_it() {
        let rule = HoldRule {
            min_share: 0.1,
            ..HoldRule::default()
        };
        let mut book = PrefillBook::default();
        let k = chain(1, 1000);
        book.started(&rule, 0, &k[..300], 0, S, S).unwrap();
        let most = book.started(&rule, 0, &k[..900], 0, S, S).unwrap();
        book.started(&rule, 0, &chain(2, 900), 0, S, S).unwrap();
        assert_eq!(book.plan(&rule, 0, &k, 1000, 2 * S).unwrap().on, most);
    }

    #[test]
    fn short_prefills_are_not_listed_and_the_lists_are_capped() {
        let rule = HoldRule::default();
        let mut book = PrefillBook::default();
        assert_eq!(book.started(&rule, 0, &chain(1, 100), 50, S, S), None);
        for t in 0..MAX_PREFILLING_PER_REPLICA as u64 + 5 {
            book.started(&rule, 0, &chain(t, 100), 0, S, S);
        }
        assert_eq!(book.prefilling(0), MAX_PREFILLING_PER_REPLICA);
        let off = HoldRule {
            enabled: false,
            ..rule
        };
        assert_eq!(book.started(&off, 1, &chain(1, 100), 0, S, S), None);
        assert_eq!(book.plan(&off, 0, &chain(0, 100), 100, 2 * S), None);
    }

    #[test]
    fn held_slots_are_capped_per_replica_and_per_node() {
        let rule = HoldRule {
            max_held: 3,
            max_held_per_replica: 2,
            ..HoldRule::default()
        };
        let mut book = PrefillBook::default();
        assert!(book.hold(&rule, 0).is_ok());
        assert!(book.hold(&rule, 0).is_ok());
        assert_eq!(book.hold(&rule, 0), Err(HoldRefused::Full));
        assert!(book.hold(&rule, 1).is_ok());
        assert_eq!(book.hold(&rule, 2), Err(HoldRefused::Full), "node cap");
        book.unhold(0);
        assert!(book.hold(&rule, 2).is_ok());
        assert_eq!(book.held(), 3);
    }
}
