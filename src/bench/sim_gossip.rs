//! How stale a simulated node's view is: the gossip model of `kvmesh sim`.
//!
//! A live node learns a replica's load and summary version from chitchat, which every
//! `gossip_interval` exchanges state (push and pull) with `fanout` random peers. News therefore
//! reaches a node after a number of rounds (its *hops*) that grows with the log of the fleet size,
//! and arrives in batches, once per round. The simulator reproduces that without simulating every
//! exchange:
//! - the fleet's true state is *published* on a fixed grid (loads every `interval / 4`, summaries
//!   every `interval`, as home nodes do) into short rings of versions ([`Published`]);
//! - node `n` has a round phase `phase_n` (uniform in one interval) and a hop count `hops_n` drawn
//!   from the measured spread of push-pull epidemics on the fleet ([`epidemic_hops`]); at time `t`
//!   it sees what was published at or before its last round's start minus `hops_n − 1` rounds
//!   ([`NodeLag::source_time`]).
//!
//! With the regional layout the epidemic runs over a region's nodes, and other regions arrive as
//! region records, a round of the representatives' cluster (and its hops) later
//! ([`region_record_source`]).
//!
//! Views are brought up to date lazily, when a node routes: with a thousand nodes and ten thousand
//! replicas, refreshing every view every round would cost far more than the routing itself, and
//! versions are shared (`Arc`), so a thousand views of one summary hold one copy.

use std::collections::VecDeque;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::Rng;

/// Rounds until each node first hears news published by a random origin, pooled over `trials`
/// push-pull epidemics on `nodes` nodes where every node contacts `fanout` random peers per round.
/// The origin is left out (it knows at once). Sorted, so a node's draw is a quantile.
pub fn epidemic_hops(nodes: usize, fanout: usize, trials: usize, rng: &mut SmallRng) -> Vec<u32> {
    let mut pooled = Vec::with_capacity(trials * nodes.saturating_sub(1));
    if nodes < 2 {
        return vec![1];
    }
    let fanout = fanout.clamp(1, nodes - 1);
    let mut informed = vec![false; nodes];
    let mut next = vec![false; nodes];
    for _ in 0..trials {
        informed.iter_mut().for_each(|x| *x = false);
        let origin = rng.random_range(0..nodes);
        informed[origin] = true;
        let mut count = 1;
        let mut round = 0u32;
        // Each round, every node exchanges with `fanout` peers; news crosses a contact either way.
        while count < nodes && round < 64 {
            round += 1;
            next.copy_from_slice(&informed);
            for a in 0..nodes {
                // Distinct peers, as chitchat picks them.
                for b in rand::seq::index::sample(rng, nodes - 1, fanout) {
                    let b = if b >= a { b + 1 } else { b };
                    if informed[a] && !next[b] {
                        next[b] = true;
                        pooled.push(round);
                        count += 1;
                    } else if informed[b] && !next[a] {
                        next[a] = true;
                        pooled.push(round);
                        count += 1;
                    }
                }
            }
            std::mem::swap(&mut informed, &mut next);
        }
    }
    pooled.sort_unstable();
    if pooled.is_empty() {
        pooled.push(1);
    }
    pooled
}

/// When a node's rounds fall and how far news travels to reach it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NodeLag {
    /// Offset of the node's rounds within an interval.
    pub phase: Duration,
    /// Rounds news takes to reach it (at least 1).
    pub hops: u32,
}

impl NodeLag {
    /// The publication time whose state the node sees at `now` (`None`: nothing yet).
    pub fn source_time(&self, now: Duration, interval: Duration) -> Option<Duration> {
        let since = now.checked_sub(self.phase)?;
        let rounds = (since.as_nanos() / interval.as_nanos().max(1)) as u32;
        let last_round = self.phase + interval * rounds;
        last_round.checked_sub(interval * self.hops.saturating_sub(1))
    }
}

/// The publication time of the region records a node holds at `now` in the regional layout
/// (`None`: nothing yet). A remote representative builds its region's record from its own view
/// at a round of the representatives' cluster, the record spreads over that cluster (`layer`:
/// the node's region's representatives' phase and hops there, rounds of `region_interval`), and
/// the node's region's representatives copy it into the regional cluster, where it reaches the
/// node as any regional news does (`local`, rounds of `interval`).
pub fn region_record_source(
    local: &NodeLag,
    layer: &NodeLag,
    now: Duration,
    interval: Duration,
    region_interval: Duration,
) -> Option<Duration> {
    let copied = local.source_time(now, interval)?;
    layer.source_time(copied, region_interval)
}

/// A ring of versions of one published value, oldest first, each with its publication time.
#[derive(Debug)]
pub struct Published<T> {
    versions: VecDeque<(Duration, T)>,
}

impl<T> Default for Published<T> {
    fn default() -> Self {
        Published {
            versions: VecDeque::new(),
        }
    }
}

impl<T> Published<T> {
    /// Publishes `value` at `at` (not before the last publication) and forgets versions no
    /// reader can still want: those superseded by one published at or before `horizon`.
    pub fn publish(&mut self, at: Duration, value: T, horizon: Duration) {
        self.versions.push_back((at, value));
        while self.versions.len() > 1 && self.versions[1].0 <= horizon {
            self.versions.pop_front();
        }
    }

    /// The newest version published at or before `at`.
    pub fn as_of(&self, at: Duration) -> Option<&T> {
        self.as_of_timed(at).map(|(_, v)| v)
    }

    /// The newest version published at or before `at`, with its publication time.
    pub fn as_of_timed(&self, at: Duration) -> Option<(Duration, &T)> {
        let i = self.versions.partition_point(|(t, _)| *t <= at);
        i.checked_sub(1)
            .map(|i| (self.versions[i].0, &self.versions[i].1))
    }

    /// The newest version.
    pub fn latest(&self) -> Option<&T> {
        self.versions.back().map(|(_, v)| v)
    }

    /// Versions held.
    pub fn len(&self) -> usize {
        self.versions.len()
    }

    /// Whether nothing was published.
    pub fn is_empty(&self) -> bool {
        self.versions.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn small_meshes_hear_everything_in_one_round() {
        let mut rng = SmallRng::seed_from_u64(1);
        let hops = epidemic_hops(3, 3, 8, &mut rng);
        assert_eq!(hops.len(), 16);
        assert!(hops.iter().all(|h| *h == 1));
        assert_eq!(epidemic_hops(1, 3, 8, &mut rng), vec![1]);
    }

    #[test]
    fn large_meshes_spread_in_logarithmic_rounds() {
        let mut rng = SmallRng::seed_from_u64(1);
        let hops = epidemic_hops(1000, 3, 4, &mut rng);
        assert_eq!(hops.len(), 4 * 999);
        let max = *hops.last().unwrap();
        let median = hops[hops.len() / 2];
        // Push-pull with fan-out 3 roughly quadruples the informed set per round early on.
        assert!((3..=5).contains(&median), "median {median}");
        assert!(max <= 8, "max {max}");
    }

    #[test]
    fn a_node_sees_its_last_round_minus_the_hops() {
        let ms = Duration::from_millis;
        let lag = NodeLag {
            phase: ms(30),
            hops: 1,
        };
        assert_eq!(lag.source_time(ms(10), ms(100)), None);
        assert_eq!(lag.source_time(ms(30), ms(100)), Some(ms(30)));
        assert_eq!(lag.source_time(ms(129), ms(100)), Some(ms(30)));
        assert_eq!(lag.source_time(ms(130), ms(100)), Some(ms(130)));
        let far = NodeLag { hops: 3, ..lag };
        assert_eq!(far.source_time(ms(250), ms(100)), Some(ms(30)));
        assert_eq!(far.source_time(ms(129), ms(100)), None);
    }

    #[test]
    fn other_regions_are_seen_through_the_record_layer_and_the_region() {
        let ms = Duration::from_millis;
        let local = NodeLag {
            phase: ms(30),
            hops: 2,
        };
        let layer = NodeLag {
            phase: ms(100),
            hops: 2,
        };
        // At 1,000 ms the node holds what its region had at 830 ms; its representatives then
        // held the record published at 100 ms (their last round, 600 ms, minus one round).
        let at = region_record_source(&local, &layer, ms(1000), ms(100), ms(500));
        assert_eq!(at, Some(ms(100)));
        // Before the first record has travelled, nothing.
        assert_eq!(
            region_record_source(&local, &layer, ms(300), ms(100), ms(500)),
            None
        );
        // Older than the node's news of its own region, always.
        let own = local.source_time(ms(1000), ms(100));
        assert!(own > at);
    }

    #[test]
    fn published_versions_are_read_as_of_a_time_and_pruned() {
        let ms = Duration::from_millis;
        let mut p = Published::default();
        assert!(p.as_of(ms(5)).is_none());
        p.publish(ms(0), 'a', ms(0));
        p.publish(ms(10), 'b', ms(0));
        p.publish(ms(20), 'c', ms(0));
        assert_eq!(p.as_of(ms(15)), Some(&'b'));
        assert_eq!(p.as_of(ms(20)), Some(&'c'));
        assert_eq!(p.latest(), Some(&'c'));
        // A reader at 12 ms or later needs 'b' at most: 'a' goes.
        p.publish(ms(30), 'd', ms(12));
        assert_eq!(p.len(), 3);
        assert_eq!(p.as_of(ms(12)), Some(&'b'));
    }
}
