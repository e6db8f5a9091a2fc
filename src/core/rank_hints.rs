//! Rank hints: which data-parallel rank a prefix was last sent to, for the nodes that do not
//! follow the replica's KV events.
//!
//! Only a replica's home follows its KV events, so only it knows from the engine which rank
//! holds which blocks (`dp_rank.rs`). Left to the engine's balancer, the requests reaching any
//! other node land on a rank that holds their prefix 1 time in N: with two nodes, half the
//! conversations lost their rank every other turn (hit ratio 0.622 against 0.773 on one node).
//! So every node announces the rank it named with each routed prefix's tip (`RoutedTip::rank`,
//! the load-sharing datagrams), and every node remembers, per replica, the last rank each
//! announced prefix went to: a request extending a remembered prefix of `j + 1` blocks (its key
//! at position `j` equals the tip key; keys are chained) counts that rank as holding those
//! blocks. A hint is a guess (the rank may have evicted the prefix since), so it expires after
//! [`HINT_TTL`] and the store is an LRU of at most a few thousand prefixes per replica.

use std::num::NonZeroUsize;
use std::time::Duration;

use lru::LruCache;

use super::dp_rank::{RankRuns, MAX_RANKS};
use super::keys::BlockKey;

/// How long a hint counts: the approximate cache model's default TTL (an engine under load
/// evicts sooner, which the LRU cap models only roughly).
pub const HINT_TTL: Duration = Duration::from_secs(600);
/// Prefixes remembered per replica by default.
pub const DEFAULT_HINTS: usize = 4096;

/// One remembered prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Hint {
    /// Blocks of the prefix (the key is block `blocks - 1`).
    blocks: u32,
    /// The rank it was sent to (< [`MAX_RANKS`]).
    rank: u8,
    /// When it stops counting.
    until: Duration,
}

/// One replica's rank hints, by tip key, least recently sent first out.
#[derive(Debug)]
pub struct RankHints {
    by_key: LruCache<u64, Hint>,
}

impl Default for RankHints {
    fn default() -> Self {
        RankHints::with_cap(DEFAULT_HINTS)
    }
}

impl RankHints {
    /// An empty store of at most `cap` prefixes (at least one); memory grows with use only.
    pub fn with_cap(cap: usize) -> Self {
        RankHints {
            by_key: LruCache::sparse(NonZeroUsize::new(cap).unwrap_or(NonZeroUsize::MIN)),
        }
    }

    /// Prefixes held (expired ones included until they are pushed out or looked past).
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Whether no prefix is held.
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// `blocks` blocks ending in `key` were sent to `rank` at `now`. A rank past [`MAX_RANKS`]
    /// or an empty prefix is ignored (returns false); the latest rank of a prefix wins.
    pub fn insert(&mut self, key: BlockKey, blocks: u32, rank: u16, now: Duration) -> bool {
        let Ok(rank) = u8::try_from(rank) else {
            return false;
        };
        if blocks == 0 || usize::from(rank) >= MAX_RANKS {
            return false;
        }
        let until = now.saturating_add(HINT_TTL);
        self.by_key.put(
            key.0,
            Hint {
                blocks,
                rank,
                until,
            },
        );
        true
    }

    /// For a request's `keys`, the longest hinted prefix each of `ranks` ranks holds, in
    /// blocks (all zero when nothing is remembered).
    pub fn runs(&self, keys: &[BlockKey], ranks: usize, now: Duration) -> RankRuns {
        let mut runs = RankRuns::zeros(ranks);
        if self.by_key.is_empty() {
            return runs;
        }
        for (j, k) in keys.iter().enumerate() {
            if let Some(h) = self.by_key.peek(&k.0) {
                if h.blocks as usize == j + 1 && h.until > now {
                    runs.raise(usize::from(h.rank), j + 1);
                }
            }
        }
        runs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(n: u64, salt: u64) -> Vec<BlockKey> {
        (0..n).map(|i| BlockKey(salt * 1_000_003 + i)).collect()
    }

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_follow_up_finds_the_rank_its_earlier_turns_went_to() {
        let mut h = RankHints::default();
        let turn1 = keys(4, 1);
        let turn2 = keys(9, 1);
        assert!(h.insert(turn1[3], 4, 2, S));
        // The second turn extends the first: rank 2 holds its first 4 blocks.
        assert_eq!(h.runs(&turn2, 4, 2 * S), vec![0, 0, 4, 0]);
        // Sent to rank 1 then; the third turn finds both, the longer on rank 1.
        assert!(h.insert(turn2[8], 9, 1, 3 * S));
        let turn3 = keys(12, 1);
        assert_eq!(h.runs(&turn3, 4, 4 * S), vec![0, 9, 4, 0]);
        // Another conversation finds nothing; a key at the wrong position is no match.
        assert_eq!(h.runs(&keys(9, 2), 4, 4 * S), vec![0, 0, 0, 0]);
        assert_eq!(h.runs(&turn2[3..], 4, 4 * S), vec![0, 0, 0, 0]);
        // Fewer ranks counted than hinted: the extra rank is ignored.
        assert_eq!(h.runs(&turn3, 2, 4 * S), vec![0, 9]);
        // Expired hints count no more.
        assert_eq!(h.runs(&turn3, 4, 3 * S + HINT_TTL), vec![0, 0, 0, 0]);
    }

    #[test]
    fn hints_are_bounded_and_reject_impossible_ranks() {
        let mut h = RankHints::with_cap(2);
        assert!(!h.insert(BlockKey(1), 1, MAX_RANKS as u16, S));
        assert!(!h.insert(BlockKey(1), 1, u16::MAX, S));
        assert!(!h.insert(BlockKey(1), 0, 0, S));
        assert!(h.is_empty());
        for k in 0..10 {
            assert!(h.insert(BlockKey(k), 1, 3, S));
        }
        assert_eq!(h.len(), 2, "least recently sent pushed out");
        assert_eq!(h.runs(&[BlockKey(9)], 4, S), vec![0, 0, 0, 1]);
        assert_eq!(h.runs(&[BlockKey(0)], 4, S), vec![0, 0, 0, 0]);
        // The latest rank of a prefix wins.
        assert!(h.insert(BlockKey(9), 1, 0, S));
        assert_eq!(h.runs(&[BlockKey(9)], 4, S), vec![1, 0, 0, 0]);
    }
}
