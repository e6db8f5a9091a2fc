//! Other regions as a node sees them at scale: not their replicas, one `RegionOffer` each.
//!
//! With regional gossip (`mesh/region_layer.rs`) a node hears only its own region's replicas;
//! every other region reaches it as one small record its representatives publish: per model and
//! pool, how many replicas are healthy and have room and the least queue among them, and the
//! region's *heads* — up to [`MAX_REGION_HEADS`] prompt prefixes it holds, each as the block key
//! at a power-of-two depth. That is what a forwarding decision needs and no more, so a node's
//! cost does not grow with the fleet.
//!
//! Why heads and not a union of Bloom filters: replicas' filters differ in size (each is sized
//! for its own cache), so they do not OR; a union sized for a region of hundreds of replicas would
//! be megabytes. A cross-region hop only pays for a long shared prefix (a system prompt, a
//! document), and those are the prefixes many requests repeat: the heaviest few, at depths within
//! 2× of their length, fit in a few hundred bytes and answer "does that region hold this prompt's
//! prefix, and how much of it" exactly up to the depth rounding (a head never claims more than the
//! region held when it was published).
//!
//! A pull needs more than a forward: who to pull from. So an offer also names, for up to
//! [`MAX_OFFER_HOLDERS`] of its deepest heads, the replica of the region holding that prefix
//! settled (its id and URL, the KV hint's source fields): with `remote_prefix = "weigh"` a node
//! of another region prices pulling that run into its own replica (`remote_prefix.rs`). An offer
//! names only its own region's replicas (`region_choice::foreign_holder` refuses one naming a
//! replica the reader knows in another region).
//!
//! The decision itself is in `router.rs`: among the regions with room, the least
//! `RTT + queue + prefill of what the region does not hold` — the region holding the prefix when
//! its extra round trip costs less than the prefill it saves, else the nearest.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::keys::BlockKey;

/// Model entries a region offer carries at most (the most open first).
pub const MAX_OFFERED_MODELS: usize = 8;
/// Heads a region offer carries at most.
pub const MAX_REGION_HEADS: usize = 24;
/// Heads a representative counts at most (`RecentHeads`; the node's `Core::heads`, and the
/// simulator's per region).
pub const MAX_RECENT_HEADS: usize = 512;
/// Regions a node keeps offers for at most (a region record names one region each).
pub const MAX_REMOTE_REGIONS: usize = 64;
/// The deepest head depth, in blocks (a prompt of 2^15 blocks of 16 tokens is 512k tokens).
pub const MAX_HEAD_DEPTH: u16 = 1 << 15;
/// Holders a region offer names at most (the deepest heads'): each costs ~80 bytes of a record
/// that must fit a 1 KiB gossip value.
pub const MAX_OFFER_HOLDERS: usize = 4;
/// Longest replica id or URL an offered holder may carry.
pub const MAX_HOLDER_STR_BYTES: usize = 256;
/// The longest step an offered holder may claim, in ms (`kv_fetch::MAX_SOURCE_STEP_S`).
pub const MAX_HOLDER_STEP_MS: u16 = 200;

/// One model (and pool) a region serves, in aggregate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OfferedModel {
    /// Model name.
    pub model: String,
    /// Replica pool ("" when none is set).
    #[serde(default)]
    pub pool: String,
    /// Whether these replicas take whole requests (not only prefill legs).
    #[serde(default)]
    pub whole: bool,
    /// Healthy replicas.
    #[serde(default)]
    pub healthy: u32,
    /// Healthy replicas below their `max_in_flight`.
    #[serde(default)]
    pub open: u32,
    /// The least predicted queue among the open replicas, in ms.
    #[serde(default)]
    pub least_queue_ms: u32,
    /// Prefill speed of that replica, tokens per second.
    #[serde(default)]
    pub prefill_tokens_per_s: u32,
}

/// A prefix a region holds: the block key at `depth` (the prompt's first `depth` blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RegionHead {
    /// The block key at position `depth − 1` (chained: it names the whole prefix).
    pub key: u64,
    /// Leading blocks the key stands for, ≥ 1.
    pub depth: u16,
}

impl RegionHead {
    /// The head of `keys` a region holding all of them publishes: the key at the deepest
    /// power-of-two depth ≤ `keys.len()` (capped at [`MAX_HEAD_DEPTH`]); `None` for no keys.
    pub fn of(keys: &[BlockKey]) -> Option<RegionHead> {
        let len = keys.len().min(MAX_HEAD_DEPTH as usize);
        if len == 0 {
            return None;
        }
        let depth = 1usize << (usize::BITS - 1 - len.leading_zeros());
        Some(RegionHead {
            key: keys[depth - 1].0,
            depth: depth as u16,
        })
    }
}

/// The replica of the offering region that holds one of its heads settled (its summary has the
/// head's key): what a node of another region needs to pull that prefix's KV from it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OfferedHolder {
    /// The head it holds: its run is the prompt's first `head.depth` blocks.
    pub head: RegionHead,
    /// Replica id (the hint's `source_id`).
    pub id: String,
    /// Replica base URL (the hint's `source_url`).
    pub url: String,
    /// Its current engine step in ms, what a pull waits for before blocks flow
    /// (`kv_fetch::source_step_s`), at most [`MAX_HOLDER_STEP_MS`].
    #[serde(default)]
    pub step_ms: u16,
}

/// What another region offers forwarded requests.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RegionOffer {
    /// The region.
    pub region: String,
    /// What it serves (at most [`MAX_OFFERED_MODELS`]).
    #[serde(default)]
    pub models: Vec<OfferedModel>,
    /// Prefixes it holds (at most [`MAX_REGION_HEADS`]).
    #[serde(default)]
    pub heads: Vec<RegionHead>,
    /// Who holds some of those heads settled, for pulls (at most [`MAX_OFFER_HOLDERS`], each
    /// for one of `heads`).
    #[serde(default)]
    pub holders: Vec<OfferedHolder>,
}

impl RegionOffer {
    /// Leading blocks of `keys` the region holds by its heads: the deepest head that is a
    /// prefix of `keys`. O(heads); 0 when none matches.
    pub fn held_blocks(&self, keys: &[BlockKey]) -> usize {
        self.heads
            .iter()
            .filter(|h| {
                let d = h.depth as usize;
                d >= 1 && d <= keys.len() && keys[d - 1].0 == h.key
            })
            .map(|h| h.depth as usize)
            .max()
            .unwrap_or(0)
    }

    /// The holder to pull `keys`' longest offered prefix from: the deepest head with a holder
    /// that is a prefix of `keys`, with its run in blocks. O(holders).
    pub fn pull_source(&self, keys: &[BlockKey]) -> Option<(&OfferedHolder, u32)> {
        self.holders
            .iter()
            .filter(|h| {
                let d = h.head.depth as usize;
                d >= 1 && d <= keys.len() && keys[d - 1].0 == h.head.key
            })
            .max_by_key(|h| h.head.depth)
            .map(|h| (h, u32::from(h.head.depth)))
    }

    /// The open entry for `model` that takes whole requests in one of `pools` (any pool when
    /// empty) with the least queue under `bar_s`: `(queue seconds, prefill tokens/s)`.
    pub fn open_for(&self, model: &str, pools: &[String], bar_s: f64) -> Option<(f64, f64)> {
        self.models
            .iter()
            .filter(|m| {
                m.model == model
                    && m.whole
                    && m.open > 0
                    && (pools.is_empty() || pools.contains(&m.pool))
            })
            .map(|m| {
                (
                    f64::from(m.least_queue_ms) / 1000.0,
                    f64::from(m.prefill_tokens_per_s.max(1)),
                )
            })
            .filter(|(q, _)| *q < bar_s)
            .min_by(|a, b| a.0.total_cmp(&b.0))
    }

    /// Sorts and trims to the caps: the most open models first, the deepest heads first
    /// (ties by key, so every representative trims alike).
    pub fn trim(&mut self) {
        self.models.sort_by(|a, b| {
            b.open
                .cmp(&a.open)
                .then(a.least_queue_ms.cmp(&b.least_queue_ms))
                .then_with(|| a.model.cmp(&b.model))
                .then_with(|| a.pool.cmp(&b.pool))
        });
        self.models.truncate(MAX_OFFERED_MODELS);
        self.heads
            .retain(|h| h.depth >= 1 && h.depth <= MAX_HEAD_DEPTH);
        self.heads
            .sort_by(|a, b| b.depth.cmp(&a.depth).then(a.key.cmp(&b.key)));
        self.heads.dedup();
        self.heads.truncate(MAX_REGION_HEADS);
        let heads = &self.heads;
        self.holders.retain(|h| heads.contains(&h.head));
        self.holders.sort_by(|a, b| {
            b.head
                .depth
                .cmp(&a.head.depth)
                .then(a.head.key.cmp(&b.head.key))
        });
        self.holders.dedup_by(|a, b| a.head == b.head);
        self.holders.truncate(MAX_OFFER_HOLDERS);
    }
}

/// The prefixes this node routed most, as heads at every power-of-two depth of each prompt:
/// what a representative offers other regions (checked against its region's summaries before it
/// goes out). A prefix many prompts share gathers counts at each depth it spans; a prompt's own
/// tail counts once. Bounded: at most `cap` heads; when full, every count halves and the zeros
/// go, so old prefixes fade and the map never grows past its first allocation.
#[derive(Debug)]
pub struct RecentHeads {
    counts: HashMap<RegionHead, u32>,
    cap: usize,
}

impl RecentHeads {
    /// A counter of at most `cap` heads.
    pub fn new(cap: usize) -> Self {
        RecentHeads {
            counts: HashMap::with_capacity(cap),
            cap: cap.max(1),
        }
    }

    /// Counts a routed prompt's heads (depths 1, 2, 4, … ≤ its length).
    pub fn record(&mut self, keys: &[BlockKey]) {
        let len = keys.len().min(MAX_HEAD_DEPTH as usize);
        let mut depth = 1usize;
        while depth <= len {
            let head = RegionHead {
                key: keys[depth - 1].0,
                depth: depth as u16,
            };
            match self.counts.get_mut(&head) {
                Some(c) => *c = c.saturating_add(1),
                None => {
                    if self.counts.len() >= self.cap {
                        self.counts.retain(|_, c| {
                            *c /= 2;
                            *c > 0
                        });
                    }
                    if self.counts.len() < self.cap {
                        self.counts.insert(head, 1);
                    }
                }
            }
            depth *= 2;
        }
    }

    /// The `n` heads worth most to another region: count × depth (requests × blocks a hit
    /// there saves), ties by depth then key.
    pub fn top(&self, n: usize) -> Vec<RegionHead> {
        let mut all: Vec<(u64, RegionHead)> = self
            .counts
            .iter()
            .filter(|(_, c)| **c > 1)
            .map(|(h, c)| (u64::from(*c) * u64::from(h.depth), *h))
            .collect();
        all.sort_unstable_by(|a, b| {
            b.0.cmp(&a.0)
                .then(b.1.depth.cmp(&a.1.depth))
                .then(a.1.key.cmp(&b.1.key))
        });
        all.into_iter().take(n).map(|(_, h)| h).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(n: u64) -> Vec<BlockKey> {
        (1..=n).map(|i| BlockKey(i * 1000)).collect()
    }

    fn model(name: &str, open: u32, queue_ms: u32) -> OfferedModel {
        OfferedModel {
            model: name.into(),
            pool: String::new(),
            whole: true,
            healthy: open.max(1),
            open,
            least_queue_ms: queue_ms,
            prefill_tokens_per_s: 10_000,
        }
    }

    fn holder(head: RegionHead) -> OfferedHolder {
        OfferedHolder {
            head,
            id: format!("r{}", head.key),
            url: format!("http://10.0.0.{}:8000", head.key % 250),
            step_ms: 0,
        }
    }

    #[test]
    fn the_pull_source_is_the_holder_of_the_deepest_offered_head_the_prompt_starts_with() {
        let k = keys(100);
        let (h8, h32) = (
            RegionHead::of(&k[..10]).unwrap(),
            RegionHead::of(&k[..40]).unwrap(),
        );
        let other = RegionHead { key: 7, depth: 64 };
        let offer = RegionOffer {
            region: "us".into(),
            models: vec![],
            heads: vec![other, h32, h8],
            holders: vec![holder(h8), holder(h32), holder(other)],
        };
        let (h, blocks) = offer.pull_source(&k).unwrap();
        assert_eq!((h.head, blocks), (h32, 32));
        let (h, blocks) = offer.pull_source(&k[..20]).unwrap();
        assert_eq!((h.head, blocks), (h8, 8));
        assert!(offer.pull_source(&k[..5]).is_none());
        // A head without a holder is for forwards only.
        let forward_only = RegionOffer {
            holders: vec![],
            ..offer
        };
        assert!(forward_only.pull_source(&k).is_none());
    }

    #[test]
    fn a_head_is_the_key_at_the_deepest_power_of_two_depth() {
        assert_eq!(RegionHead::of(&[]), None);
        let k = keys(100);
        let h = RegionHead::of(&k).unwrap();
        assert_eq!(h.depth, 64);
        assert_eq!(h.key, k[63].0);
        assert_eq!(RegionHead::of(&k[..1]).unwrap().depth, 1);
        assert_eq!(RegionHead::of(&k[..64]).unwrap().depth, 64);
    }

    #[test]
    fn recent_heads_rank_shared_prefixes_by_requests_times_depth() {
        let shared = keys(64);
        let mut heads = RecentHeads::new(64);
        for i in 0..20u64 {
            // A 64-block shared prefix, then a tail of the request's own.
            let mut k = shared.clone();
            k.extend((0..36).map(|j| BlockKey(1_000_000 + i * 100 + j)));
            heads.record(&k);
        }
        let top = heads.top(4);
        assert_eq!(top[0], RegionHead::of(&shared).unwrap(), "{top:?}");
        assert!(
            top.iter().all(|h| h.depth <= 64),
            "unique tails count once: {top:?}"
        );
        // Bounded: far more distinct prompts than the cap never grow the map past it.
        for i in 0..10_000u64 {
            heads.record(&[BlockKey(i), BlockKey(i + 1)]);
        }
        assert!(heads.counts.len() <= 64);
    }

    #[test]
    fn held_blocks_is_the_deepest_head_the_prompt_starts_with() {
        let k = keys(100);
        let offer = RegionOffer {
            region: "us".into(),
            models: vec![],
            heads: vec![
                RegionHead::of(&k[..10]).unwrap(), // depth 8
                RegionHead::of(&k[..40]).unwrap(), // depth 32
                RegionHead { key: 7, depth: 64 },  // another prompt
            ],
            holders: vec![],
        };
        assert_eq!(offer.held_blocks(&k), 32);
        assert_eq!(offer.held_blocks(&k[..20]), 8);
        assert_eq!(offer.held_blocks(&k[..5]), 0);
        // A different prompt with the same length matches nothing.
        assert_eq!(offer.held_blocks(&keys(3)), 0, "depth 1/2 heads absent");
        let other: Vec<BlockKey> = (1..=100).map(|i| BlockKey(i + 7)).collect();
        assert_eq!(offer.held_blocks(&other), 0);
    }

    #[test]
    fn open_for_takes_the_least_queue_among_open_whole_entries_in_the_pools() {
        let mut busy = model("m", 2, 900);
        busy.pool = "gold".into();
        let mut prefill_only = model("m", 5, 1);
        prefill_only.whole = false;
        let offer = RegionOffer {
            region: "us".into(),
            models: vec![model("m", 1, 300), busy, prefill_only, model("m", 0, 0)],
            heads: vec![],
            holders: vec![],
        };
        assert_eq!(offer.open_for("m", &[], 10.0), Some((0.3, 10_000.0)));
        assert_eq!(
            offer.open_for("m", &["gold".to_owned()], 10.0),
            Some((0.9, 10_000.0))
        );
        assert_eq!(offer.open_for("m", &[], 0.2), None, "over the bar");
        assert_eq!(offer.open_for("other", &[], 10.0), None);
    }

    #[test]
    fn trim_keeps_the_most_open_models_and_the_deepest_heads() {
        let mut offer = RegionOffer {
            region: "us".into(),
            models: (0..20).map(|i| model(&format!("m{i}"), i, 0)).collect(),
            heads: (0..40)
                .map(|i| RegionHead {
                    key: i,
                    depth: (i % 7) as u16,
                })
                .collect(),
            holders: (0..40)
                .map(|i| {
                    holder(RegionHead {
                        key: i,
                        depth: (i % 7) as u16,
                    })
                })
                .collect(),
        };
        offer.trim();
        assert_eq!(offer.holders.len(), MAX_OFFER_HOLDERS);
        assert!(
            offer.holders.iter().all(|h| offer.heads.contains(&h.head)),
            "a holder is for a kept head: {:?}",
            offer.holders
        );
        assert_eq!(offer.holders[0].head.depth, 6, "the deepest first");
        assert_eq!(offer.models.len(), MAX_OFFERED_MODELS);
        assert_eq!(offer.models[0].open, 19);
        assert_eq!(offer.heads.len(), MAX_REGION_HEADS);
        assert!(offer.heads.iter().all(|h| h.depth >= 1));
        assert_eq!(offer.heads[0].depth, 6);
    }
}
