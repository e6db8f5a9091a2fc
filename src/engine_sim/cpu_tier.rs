//! The engine's CPU tier: offloaded KV blocks in host memory, as vLLM's offloading connector
//! keeps them, and the host-to-device link that loads them back.
//!
//! vLLM's `OffloadingConnector` writes every computed full block through to CPU memory (an
//! LRU of `num_cpu_blocks`), touches the blocks a request hits, and on admission reports the
//! blocks past the GPU hit that CPU holds as tokens to load; the request waits for the copy,
//! then those blocks are GPU blocks like any other. Its KV events are `BlockStored` with
//! `medium: "CPU"`, the same block hashes, no token ids and no parent, and `BlockRemoved` with
//! `medium: "CPU"` on eviction. This file is that LRU plus the link: loads queue on one link of
//! `cpu_gb_per_s`, so concurrent loads share its bandwidth. Sans-IO: time is passed in.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use super::prefix_cache::BlockHash;

/// Offloaded blocks, least recently used evicted first, and the link they load over.
#[derive(Debug)]
pub struct CpuTier {
    capacity_blocks: usize,
    /// Block → its tick in `lru`.
    blocks: HashMap<BlockHash, u64>,
    lru: BTreeMap<u64, BlockHash>,
    tick: u64,
    /// Seconds to load one block over the link.
    block_load_s: f64,
    /// When the link finishes the loads already queued.
    link_free_at: Duration,
}

/// What a store changed, for the KV events.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Offload {
    /// Blocks newly held in CPU memory (`BlockStored`, medium CPU).
    pub stored: Vec<BlockHash>,
    /// Blocks evicted from CPU memory to make room (`BlockRemoved`, medium CPU).
    pub evicted: Vec<BlockHash>,
}

impl CpuTier {
    /// A tier of `capacity_blocks` blocks whose link loads one block in `block_load_s` seconds.
    pub fn new(capacity_blocks: usize, block_load_s: f64) -> Self {
        CpuTier {
            capacity_blocks,
            blocks: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            block_load_s: if block_load_s.is_finite() {
                block_load_s.max(0.0)
            } else {
                0.0
            },
            link_free_at: Duration::ZERO,
        }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Whether a block is held.
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.blocks.contains_key(&hash)
    }

    /// How many of `hashes[start..]`, from `start` on, are held without a gap.
    pub fn run_from(&self, hashes: &[BlockHash], start: usize) -> usize {
        hashes
            .iter()
            .skip(start)
            .take_while(|h| self.blocks.contains_key(h))
            .count()
    }

    /// Makes the held ones of `hashes` most recently used (in order, so the last is the
    /// freshest: chains are evicted from their heads' far end, as on GPU).
    pub fn touch(&mut self, hashes: &[BlockHash]) {
        for h in hashes {
            if let Some(t) = self.blocks.get_mut(h) {
                self.lru.remove(t);
                self.tick += 1;
                *t = self.tick;
                self.lru.insert(self.tick, *h);
            }
        }
    }

    /// Writes `hashes` through to CPU memory: held ones are touched, the others stored,
    /// evicting the least recently used beyond capacity.
    pub fn store(&mut self, hashes: &[BlockHash]) -> Offload {
        let mut out = Offload::default();
        if self.capacity_blocks == 0 {
            return out;
        }
        // Heads last, so a chain's head is the freshest and its tail goes first.
        for h in hashes.iter().rev() {
            self.tick += 1;
            match self.blocks.insert(*h, self.tick) {
                Some(old) => {
                    self.lru.remove(&old);
                }
                None => out.stored.push(*h),
            }
            self.lru.insert(self.tick, *h);
        }
        out.stored.reverse();
        while self.blocks.len() > self.capacity_blocks {
            let Some((_, h)) = self.lru.pop_first() else {
                break;
            };
            self.blocks.remove(&h);
            out.evicted.push(h);
        }
        // A block stored and evicted by the same call was never really held: no event.
        if !out.evicted.is_empty() {
            let gone: HashSet<BlockHash> = out
                .stored
                .iter()
                .copied()
                .filter(|h| !self.blocks.contains_key(h))
                .collect();
            out.stored.retain(|h| !gone.contains(h));
            out.evicted.retain(|h| !gone.contains(h));
        }
        out
    }

    /// Queues the load of `blocks` blocks on the link at `now`: when it completes (`now` when
    /// there is nothing to load). `time_scale` divides the duration, like every engine time.
    pub fn load(&mut self, blocks: usize, now: Duration, time_scale: f64) -> Duration {
        if blocks == 0 {
            return now;
        }
        let s = blocks as f64 * self.block_load_s / time_scale.max(1e-3);
        let start = self.link_free_at.max(now);
        let end = start + Duration::try_from_secs_f64(s.min(3600.0)).unwrap_or_default();
        self.link_free_at = end;
        end
    }

    /// Drops every block (with the GPU cache's reset).
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.lru.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_through_touches_and_evicts_least_recent() {
        let mut t = CpuTier::new(3, 0.001);
        assert_eq!(
            t.store(&[1, 2]),
            Offload {
                stored: vec![1, 2],
                evicted: vec![]
            }
        );
        // Held blocks are touched, not stored again.
        assert_eq!(t.store(&[1, 2, 3]).stored, vec![3]);
        t.touch(&[1, 2]);
        // 3 is now the least recently used.
        assert_eq!(
            t.store(&[9]),
            Offload {
                stored: vec![9],
                evicted: vec![3]
            }
        );
        assert_eq!(t.run_from(&[1, 2, 3], 0), 2);
        assert_eq!(t.run_from(&[7, 2, 9], 1), 2);
        t.clear();
        assert!(t.is_empty());
        assert_eq!(CpuTier::new(0, 1.0).store(&[1]), Offload::default());
    }

    #[test]
    fn a_chain_longer_than_the_tier_keeps_its_head() {
        let mut t = CpuTier::new(2, 0.001);
        let out = t.store(&[1, 2, 3, 4]);
        assert_eq!(out.stored, vec![1, 2]);
        assert_eq!(
            out.evicted,
            Vec::<BlockHash>::new(),
            "never held, never reported"
        );
        assert_eq!(t.run_from(&[1, 2, 3, 4], 0), 2);
    }

    #[test]
    fn loads_queue_on_one_link() {
        let mut t = CpuTier::new(100, 0.010);
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        assert_eq!(t.load(0, s(1), 1.0), s(1));
        assert_eq!(t.load(5, s(1), 1.0), s(1) + ms(50));
        // A second load at the same moment waits for the first.
        assert_eq!(t.load(5, s(1), 1.0), s(1) + ms(100));
        // An idle link starts at once; time_scale divides.
        assert_eq!(t.load(10, s(5), 10.0), s(5) + ms(10));
    }
}
