//! `kvmesh sim --exact-homes`: home cache models fed by the engines' KV events, tiers included.
//!
//! A live home with `kv_events` configured keeps an exact model from the engine's events, each
//! block under its best tier (from the event's `medium`), so routers see which hits are on GPU
//! and which must be loaded from CPU memory (`core::view::TierHit`). The simulator's routers
//! key prompts by text blocks while the engine model hashes token blocks, so this feed maps one
//! to the other: at submission it learns, for each text block, the engine hash of the last
//! token block it covers (a text block holds `ratio` engine blocks; engines evict chains
//! tail first, so a text block is held while its last engine block is). Then it turns the
//! engine's stored / offloaded / removed events into the model's tiered stores and removals,
//! as `replicas/kv_index.rs` does for a live home. Engine blocks it never learned (a text
//! block's inner ones) are ignored.

use std::collections::HashMap;
use std::time::Duration;

use crate::core::cache_model::CacheModel;
use crate::core::keys::BlockKey;
use crate::core::summary::Tier;
use crate::engine_sim::{BlockHash, CacheEvent, KvBatch};

const GPU: u8 = 1;
const CPU: u8 = 2;

/// One replica's engine-hash → text-key map and the tiers each learned block is held in.
#[derive(Debug)]
pub(super) struct ExactFeed {
    /// Engine blocks per text block (≥ 1).
    ratio: usize,
    /// Engine hash of a text block's last engine block → (its key, tiers held: GPU | CPU).
    blocks: HashMap<BlockHash, (BlockKey, u8)>,
}

impl ExactFeed {
    /// A feed for text blocks of `ratio` engine blocks.
    pub(super) fn new(ratio: usize) -> Self {
        ExactFeed {
            ratio: ratio.max(1),
            blocks: HashMap::new(),
        }
    }

    /// A prompt with these engine block hashes and text keys was submitted to the engine.
    pub(super) fn learn(&mut self, hashes: &[BlockHash], keys: &[BlockKey]) {
        for (i, key) in keys.iter().enumerate() {
            let Some(h) = hashes.get((i + 1) * self.ratio - 1) else {
                break;
            };
            self.blocks.entry(*h).or_insert((*key, 0));
        }
    }

    /// Applies the engine's KV batches to the home's exact model.
    pub(super) fn apply(&mut self, batches: Vec<KvBatch>, model: &mut CacheModel, now: Duration) {
        for e in batches.into_iter().flat_map(|b| b.events) {
            match e {
                CacheEvent::Stored { hashes, .. } => self.gain(&hashes, GPU, model, now),
                CacheEvent::Offloaded { hashes } => self.gain(&hashes, CPU, model, now),
                CacheEvent::Removed { hashes } => self.lose(&hashes, GPU, model, now),
                CacheEvent::OffloadEvicted { hashes } => self.lose(&hashes, CPU, model, now),
                CacheEvent::Cleared => {
                    for b in self.blocks.values_mut() {
                        b.1 = 0;
                    }
                    // The live home starts a new epoch too; a summary error cannot happen for
                    // a capacity the model was built with, and would only leave it stale.
                    let _ = model.clear();
                }
            }
        }
    }

    fn gain(&mut self, hashes: &[BlockHash], tier: u8, model: &mut CacheModel, now: Duration) {
        let mut moved = Vec::new();
        for h in hashes {
            if let Some((key, held)) = self.blocks.get_mut(h) {
                let before = best(*held);
                *held |= tier;
                if best(*held) != before {
                    moved.push(*key);
                }
            }
        }
        if !moved.is_empty() {
            model.store_tier(&moved, tier_of(tier), now);
        }
    }

    fn lose(&mut self, hashes: &[BlockHash], tier: u8, model: &mut CacheModel, now: Duration) {
        let (mut gone, mut to_cpu) = (Vec::new(), Vec::new());
        for h in hashes {
            if let Some((key, held)) = self.blocks.get_mut(h) {
                if *held & tier == 0 {
                    continue;
                }
                *held &= !tier;
                match best(*held) {
                    None => gone.push(*key),
                    Some(t) if Some(t) != best(*held | tier) => to_cpu.push(*key),
                    Some(_) => {}
                }
            }
        }
        if !to_cpu.is_empty() {
            model.store_tier(&to_cpu, Tier::Cpu, now);
        }
        if !gone.is_empty() {
            model.remove(&gone);
        }
    }
}

/// The best tier of a tier set.
fn best(held: u8) -> Option<Tier> {
    if held & GPU != 0 {
        Some(Tier::Gpu)
    } else if held & CPU != 0 {
        Some(Tier::Cpu)
    } else {
        None
    }
}

fn tier_of(bit: u8) -> Tier {
    if bit == GPU {
        Tier::Gpu
    } else {
        Tier::Cpu
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::cache_model::{CacheModelConfig, CacheSource};
    use crate::core::summary::SummaryConfig;

    fn batch(events: Vec<CacheEvent>) -> Vec<KvBatch> {
        vec![KvBatch {
            at: Duration::ZERO,
            events,
        }]
    }

    #[test]
    fn events_become_tiered_stores_moves_and_removals() {
        let mut m = CacheModel::new(
            CacheSource::Exact,
            1,
            CacheModelConfig::with_capacity(100),
            SummaryConfig::for_cluster("t"),
        )
        .unwrap();
        let mut f = ExactFeed::new(2);
        let keys = [BlockKey(10), BlockKey(20)];
        // Engine blocks 1..=4: text key 10 ends at engine block 2, key 20 at block 4.
        f.learn(&[1, 2, 3, 4], &keys);
        let now = Duration::ZERO;
        let stored = CacheEvent::Stored {
            parent: None,
            hashes: vec![1, 2, 3, 4],
            token_ids: vec![],
            cache_salt: None,
        };
        f.apply(batch(vec![stored]), &mut m, now);
        assert_eq!(m.tier(keys[0]), Some(Tier::Gpu));
        assert_eq!(m.tier(keys[1]), Some(Tier::Gpu));
        let offloaded = CacheEvent::Offloaded {
            hashes: vec![1, 2, 3, 4],
        };
        f.apply(batch(vec![offloaded]), &mut m, now);
        assert_eq!(m.tier(keys[1]), Some(Tier::Gpu), "GPU stays best");
        f.apply(
            batch(vec![CacheEvent::Removed { hashes: vec![4] }]),
            &mut m,
            now,
        );
        assert_eq!(m.tier(keys[1]), Some(Tier::Cpu), "moved to CPU");
        f.apply(
            batch(vec![CacheEvent::OffloadEvicted { hashes: vec![4] }]),
            &mut m,
            now,
        );
        assert!(!m.contains(keys[1]));
        assert_eq!(m.tier(keys[0]), Some(Tier::Gpu));
        f.apply(batch(vec![CacheEvent::Cleared]), &mut m, now);
        assert!(m.is_empty());
    }
}
