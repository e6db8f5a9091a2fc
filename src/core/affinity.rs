//! Affinity: a session (or agent run) prefers one replica, and every node agrees which, without
//! sharing any state.
//!
//! Rendezvous (highest-random-weight) hashing: each replica scores `H(session, replica)` and the
//! highest wins. When a replica leaves, only the sessions that preferred it move; the rest keep
//! their replica and its warm cache. The preference is a cost credit, not a pin: a busy preferred
//! replica still loses to an idle one.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// A replica's rendezvous seed; computed once per replica.
pub fn replica_seed(replica_id: &str) -> u64 {
    xxh3_64(replica_id.as_bytes())
}

/// The rendezvous score of `session` on the replica with `seed`.
#[inline]
pub fn score(session: &[u8], seed: u64) -> u64 {
    xxh3_64_with_seed(session, seed)
}

/// The position (in `seeds`) of the replica `session` prefers, or `None` when there is none.
pub fn preferred(session: &[u8], seeds: impl IntoIterator<Item = u64>) -> Option<usize> {
    seeds
        .into_iter()
        .enumerate()
        .map(|(i, s)| (score(session, s), i))
        .max()
        .map(|(_, i)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Removing a replica moves exactly the sessions that preferred it.
        #[test]
        fn removal_moves_only_its_sessions(n in 2usize..20, removed in 0usize..20, sessions in 1usize..300) {
            let removed = removed % n;
            let ids: Vec<String> = (0..n).map(|i| format!("replica-{i}")).collect();
            let seeds: Vec<u64> = ids.iter().map(|s| replica_seed(s)).collect();
            let kept: Vec<u64> = seeds.iter().enumerate().filter(|(i, _)| *i != removed).map(|(_, s)| *s).collect();
            for s in 0..sessions {
                let key = format!("session-{s}");
                let before = preferred(key.as_bytes(), seeds.iter().copied()).unwrap();
                let after = kept[preferred(key.as_bytes(), kept.iter().copied()).unwrap()];
                if before != removed {
                    prop_assert_eq!(after, seeds[before]);
                }
            }
        }
    }

    #[test]
    fn spreads_sessions() {
        let seeds: Vec<u64> = (0..4).map(|i| replica_seed(&format!("r{i}"))).collect();
        let mut counts = [0usize; 4];
        for s in 0..4000 {
            counts[preferred(format!("s{s}").as_bytes(), seeds.iter().copied()).unwrap()] += 1;
        }
        assert!(counts.iter().all(|c| (800..1200).contains(c)), "{counts:?}");
        assert_eq!(preferred(b"x", std::iter::empty()), None);
    }
}
