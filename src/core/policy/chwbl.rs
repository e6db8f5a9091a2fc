//! chwbl: consistent hashing with bounded loads (Mirrokni et al. 2018; KubeAI's default) on the
//! prompt's prefix key.
//!
//! Requests with the same first blocks land on the same replica, as long as its load stays under
//! `factor × average`; past that the request walks clockwise to the next replica on the ring. The
//! ring has `vnodes` points per replica and is rebuilt only when the eligible set changes.

use rand::rngs::SmallRng;
use rand::Rng;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::kind::PolicyKind;
use super::pick::{Candidate, Pick, Policy, PolicyInput, Reason};

/// Consistent hashing with bounded loads.
#[derive(Debug)]
pub struct Chwbl {
    /// Load bound as a multiple of the average load. Default 1.25.
    pub factor: f64,
    /// Ring points per replica. Default 100.
    pub vnodes: u32,
    /// Blocks that make the prefix key (4 blocks ≈ 256 tokens, as SMG's prefix_hash). Default 4.
    pub prefix_blocks: usize,
    ring: Vec<(u64, u64)>,
    ring_members: Vec<u64>,
}

impl Default for Chwbl {
    fn default() -> Self {
        Chwbl {
            factor: 1.25,
            vnodes: 100,
            prefix_blocks: 4,
            ring: Vec::new(),
            ring_members: Vec::new(),
        }
    }
}

impl Chwbl {
    fn ensure_ring(&mut self, c: &[Candidate]) {
        if self.ring_members.len() == c.len()
            && self.ring_members.iter().zip(c).all(|(m, x)| *m == x.seed)
        {
            return;
        }
        self.ring_members.clear();
        self.ring_members.extend(c.iter().map(|x| x.seed));
        self.ring.clear();
        for x in c {
            for v in 0..self.vnodes {
                self.ring
                    .push((xxh3_64_with_seed(&v.to_le_bytes(), x.seed), x.seed));
            }
        }
        self.ring.sort_unstable();
    }

    /// Most outstanding requests a replica may have and still take one more.
    pub fn bound(&self, c: &[Candidate]) -> u32 {
        let total: u64 = c.iter().map(|x| x.outstanding as u64).sum();
        (self.factor * (total + 1) as f64 / c.len() as f64).ceil() as u32
    }
}

impl Policy for Chwbl {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Chwbl
    }
    fn uses_cache(&self) -> bool {
        false
    }
    fn pick(&mut self, input: &PolicyInput<'_>, rng: &mut SmallRng) -> Pick {
        let c = input.candidates;
        self.ensure_ring(c);
        let point = match input
            .keys
            .get(self.prefix_blocks.min(input.keys.len()).wrapping_sub(1))
        {
            Some(k) => k.0,
            // Shorter than one block: nothing to be consistent about.
            None => rng.random(),
        };
        let bound = self.bound(c);
        let start = self.ring.partition_point(|(p, _)| *p < point);
        let n = self.ring.len();
        let mut first = None;
        for step in 0..n {
            let seed = self.ring[(start + step) % n].1;
            let Some(pos) = c.iter().position(|x| x.seed == seed) else {
                continue;
            };
            first.get_or_insert(pos);
            if c[pos].outstanding < bound {
                return Pick {
                    chosen: pos,
                    runner_up: first.filter(|f| *f != pos),
                    reason: Reason::HashRing,
                };
            }
        }
        // Unreachable in practice: the least-loaded replica is always under the bound.
        Pick {
            chosen: first.unwrap_or(0),
            runner_up: None,
            reason: Reason::HashRing,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use crate::core::keys::BlockKey;
    use proptest::prelude::*;

    #[test]
    fn same_prefix_same_replica_until_loaded() {
        let mut p = Chwbl::default();
        let c = [cand(0, 0, 0), cand(1, 0, 0), cand(2, 0, 0), cand(3, 0, 0)];
        let k = keys(20);
        let h = histogram(&mut p, &c, &k, 50);
        assert_eq!(h.iter().filter(|n| **n == 50).count(), 1, "{h:?}");
        // Same first 4 blocks, different tail: same replica.
        let mut k2 = keys(4);
        k2.push(BlockKey(999));
        assert_eq!(
            histogram(&mut p, &c, &k2, 1),
            h.iter().map(|n| n / 50).collect::<Vec<_>>()
        );
        // Overload the holder: the next one on the ring takes over.
        let holder = h.iter().position(|n| *n == 50).unwrap();
        let mut loaded = c;
        loaded[holder] = cand(holder, 0, 10);
        let h2 = histogram(&mut p, &loaded, &k, 10);
        assert_eq!(h2[holder], 0);
    }

    proptest! {
        /// The chosen replica is always under the bound when it takes the request.
        #[test]
        fn never_exceeds_the_load_bound(
            n in 1usize..12,
            reqs in proptest::collection::vec(0u64..50, 1..300),
        ) {
            let mut p = Chwbl::default();
            let mut c: Vec<Candidate> = (0..n).map(|i| cand(i, 0, 0)).collect();
            let mut rng = rng();
            for r in reqs {
                let k = [BlockKey(r)];
                let bound = p.bound(&c);
                let pick = p.pick(&PolicyInput { candidates: &c, keys: &k }, &mut rng);
                prop_assert!(c[pick.chosen].outstanding < bound);
                c[pick.chosen].outstanding += 1;
                let total: u32 = c.iter().map(|x| x.outstanding).sum();
                prop_assert!(c[pick.chosen].outstanding as f64 <= (1.25 * total as f64 / n as f64).ceil() + 1.0);
            }
        }
    }
}
