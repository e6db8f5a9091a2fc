//! Turns one replica's decoded KV events into our own block keys (engines.md §7, §8.1).
//!
//! Exists because the engine's block hash cannot be reproduced by a router (it depends on the
//! hash algorithm, `PYTHONHASHSEED` and pickling), so kvmesh never uses it as a key: a key is
//! computed from the event's token ids with the same chain as token-mode requests,
//! `K_i = chain_tokens(K_{i-1}, tokens_i)`, seeded by the parent's key or, for a chain root, by the
//! namespace of its LoRA name and cache salt. The engine hash is kept only as a per-rank id, to
//! resolve removals and parent links.
//!
//! A replica with several data-parallel ranks is several engines behind one address: a key is
//! held while any rank holds it in any tier, so the index counts holders and reports a key as
//! removed only when the last one lets go. A key's tier for the summary is the best tier any
//! holder has it in; when that changes (offload: the GPU copy goes while a CPU copy stays) the
//! index emits the key again with its new tier. With more than one rank it also keeps, per key,
//! the set of ranks holding it (a 64-bit mask; ranks ≤ 64) and after each batch emits the new
//! sets of the keys whose set changed ([`Op::Ranks`]), so the node's cache model can say which
//! rank holds a request's prefix and route to that rank. Sans-IO: [`EventIndex::apply`] returns the cache-model
//! operations ([`Op`]) for the node to carry out under its lock.
//!
//! Offload connectors (vLLM's `OffloadingConnector`, engines.md) publish a copy in another
//! tier as a `BlockStored` with the same engine hashes, a `medium` such as `"CPU"`, no token
//! ids and no parent: such a store only adds its tier to blocks this rank already holds (their
//! GPU store came first, as the connector writes computed blocks through); a hash not known is
//! skipped and counted (`unknown_copied`).
//!
//! Rules: only KV-cache group 0 / full attention is indexed (hybrid models' other groups are
//! not prefix caches of the prompt). Stores with an unknown parent, multimodal or
//! prompt-embedding extra keys, or bad lengths, and stores past [`MAX_BLOCKS_PER_RANK`], are
//! skipped and counted ([`IndexStats`]). Within one event, tier moves (`Store` with the new best
//! tier) come before any `Remove`. Replaying the emitted operations on a map gives the index's
//! keys with their tiers (property-tested).

use std::collections::HashMap;

use super::prom::MAX_BLOCK_SIZE;
use crate::core::keys::{chain_tokens, BlockKey, Namespace};
use crate::kv_events::msgpack::Value;
use crate::kv_events::{BlockRemoved, BlockStored, EventBatch, KvEvent};
use crate::tokenize::token_namespace;

/// Most blocks tracked per rank; stores beyond it are skipped (and counted), which bounds the
/// memory a misbehaving engine can make the node spend. 4M blocks is 64M tokens at block size 16.
pub const MAX_BLOCKS_PER_RANK: usize = 1 << 22;

pub use crate::core::summary::Tier;

/// Another copy of a held block (e.g. offloaded to CPU): the entry gains `tier`, and its key
/// moves (joins `new`) only if this tier beats every copy so far.
fn add_copy(
    entry: &mut Entry,
    holders: &mut HashMap<u64, Holders>,
    tier: Tier,
    new: &mut Vec<BlockKey>,
) {
    if entry.tiers & bit(tier) != 0 {
        return;
    }
    entry.tiers |= bit(tier);
    if let Some(h) = holders.get_mut(&entry.key) {
        let before = h.best();
        h.change(bit(tier), true);
        if h.best() != before {
            new.push(BlockKey(entry.key));
        }
    }
}

/// The bit of a tier in an entry's tier set.
fn bit(t: Tier) -> u8 {
    match t {
        Tier::Gpu => 1,
        Tier::Cpu => 2,
        Tier::Disk => 4,
    }
}

/// A change to the replica's exact cache model, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Keys now held whose best tier is the given one: newly held, or held before in another
    /// best tier (moved).
    Store(Vec<BlockKey>, Tier),
    /// Keys no longer held by any rank.
    Remove(Vec<BlockKey>),
    /// Nothing is held any more: start a new, empty epoch.
    Clear,
    /// Keys still held whose set of holding ranks changed, with the new set (bit r = rank r),
    /// after this batch's stores and removals. Only for replicas with more than one rank.
    Ranks(Vec<(BlockKey, u64)>),
}

/// Most data-parallel ranks whose holding the index tells apart (the bits of a mask); a node
/// follows at most this many per replica (`schema::bounds`).
pub const MAX_TRACKED_RANKS: usize = 64;

/// Bit of `rank` in a rank mask (0 for a rank past [`MAX_TRACKED_RANKS`], never configured).
pub fn rank_bit(rank: usize) -> u64 {
    if rank < MAX_TRACKED_RANKS {
        1u64 << rank
    } else {
        0
    }
}

/// Counters of what the index skipped, for metrics and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Blocks stored (newly held by a rank).
    pub stored: u64,
    /// Blocks removed (no longer held by a rank).
    pub removed: u64,
    /// `BlockStored` events skipped because their parent hash was unknown (joined mid-chain).
    pub unknown_parent: u64,
    /// `BlockRemoved` hashes that were not known (normal after joining mid-stream).
    pub unknown_removed: u64,
    /// Events of another KV-cache group than 0 / full attention (hybrid models).
    pub other_group: u64,
    /// Events with multimodal or prompt-embedding extra keys, which token ids cannot describe.
    pub unsupported: u64,
    /// Events whose token ids do not match `block_hashes × block_size`.
    pub malformed: u64,
    /// Stores skipped at [`MAX_BLOCKS_PER_RANK`].
    pub over_capacity: u64,
    /// Hashes of token-less (offload connector) stores this rank did not hold.
    pub unknown_copied: u64,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    key: u64,
    tiers: u8,
}

/// Who holds one key: (rank, engine hash) entries in all, and per tier.
#[derive(Clone, Copy, Debug, Default)]
struct Holders {
    /// Entries holding the key in any tier.
    count: u32,
    /// Entries holding it in each tier, indexed by `Tier as usize`.
    per_tier: [u32; 3],
    /// Ranks with at least one entry holding it (bit r = rank r).
    ranks: u64,
}

impl Holders {
    /// The best tier some entry holds the key in.
    fn best(&self) -> Option<Tier> {
        Tier::ALL
            .into_iter()
            .find(|t| self.per_tier[*t as usize] > 0)
    }

    /// Adds or drops the tiers in `bits` for one entry.
    fn change(&mut self, bits: u8, add: bool) {
        for t in Tier::ALL {
            if bits & bit(t) != 0 {
                let c = &mut self.per_tier[t as usize];
                *c = if add { *c + 1 } else { c.saturating_sub(1) };
            }
        }
    }
}

/// The engine-hash → key map of one replica, over its data-parallel ranks.
#[derive(Debug, Default)]
pub struct EventIndex {
    ranks: Vec<HashMap<u64, Entry>>,
    /// Per key, which (rank, engine hash) entries hold it, in which tiers.
    holders: HashMap<u64, Holders>,
    /// Entries of one rank holding a key beyond its first (two engine hashes of one content,
    /// which a prefix cache should not have): (key, rank) → how many more. Keeps a rank's bit
    /// until its last entry for the key goes; empty in practice.
    extra: HashMap<(u64, usize), u32>,
    /// Keys whose rank set changed in the batch being applied (multi-rank replicas only).
    changed: Vec<u64>,
    /// Tokens per block of the last `BlockStored` seen.
    block_size: Option<u32>,
    stats: IndexStats,
}

impl EventIndex {
    /// An empty index for a replica with `dp_ranks` ranks (at least 1).
    pub fn new(dp_ranks: usize) -> Self {
        EventIndex {
            ranks: (0..dp_ranks.max(1)).map(|_| HashMap::new()).collect(),
            ..Default::default()
        }
    }

    /// Keys held by some rank.
    pub fn len(&self) -> usize {
        self.holders.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    /// Whether `key` is held by some rank.
    pub fn contains(&self, key: BlockKey) -> bool {
        self.holders.contains_key(&key.0)
    }

    /// Every key held, in no particular order.
    pub fn keys(&self) -> Vec<BlockKey> {
        self.holders.keys().map(|k| BlockKey(*k)).collect()
    }

    /// Every key held with its best tier, in no particular order (to seed a new cache model).
    pub fn tiered_keys(&self) -> Vec<(BlockKey, Tier)> {
        self.holders
            .iter()
            .filter_map(|(k, h)| Some((BlockKey(*k), h.best()?)))
            .collect()
    }

    /// The ranks holding `key` (bit r = rank r; 0 if none).
    pub fn ranks_of(&self, key: BlockKey) -> u64 {
        self.holders.get(&key.0).map_or(0, |h| h.ranks)
    }

    /// Every key held with the ranks holding it (to seed a new cache model); empty for a
    /// replica with one rank, whose model needs no ranks.
    pub fn rank_sets(&self) -> Vec<(BlockKey, u64)> {
        if self.ranks.len() <= 1 {
            return Vec::new();
        }
        self.holders
            .iter()
            .map(|(k, h)| (BlockKey(*k), h.ranks))
            .collect()
    }

    /// The best tier `key` is held in, if held.
    pub fn tier(&self, key: BlockKey) -> Option<Tier> {
        self.holders.get(&key.0).and_then(Holders::best)
    }

    /// Blocks held per tier, summed over ranks: `(gpu, cpu, disk)`.
    pub fn tier_counts(&self) -> (usize, usize, usize) {
        let mut c = (0, 0, 0);
        for e in self.ranks.iter().flat_map(HashMap::values) {
            c.0 += usize::from(e.tiers & bit(Tier::Gpu) != 0);
            c.1 += usize::from(e.tiers & bit(Tier::Cpu) != 0);
            c.2 += usize::from(e.tiers & bit(Tier::Disk) != 0);
        }
        c
    }

    /// Tokens per block the engine reported last.
    pub fn block_size(&self) -> Option<u32> {
        self.block_size
    }

    /// What was skipped so far.
    pub fn stats(&self) -> IndexStats {
        self.stats
    }

    /// Applies one batch from `rank`, appending the cache-model operations to `ops`.
    pub fn apply(&mut self, rank: usize, batch: &EventBatch, ops: &mut Vec<Op>) {
        if rank >= self.ranks.len() {
            self.ranks.resize_with(rank + 1, HashMap::new);
        }
        for event in &batch.events {
            match event {
                KvEvent::BlockStored(e) => self.stored(rank, e, ops),
                KvEvent::BlockRemoved(e) => self.removed(rank, e, ops),
                KvEvent::AllBlocksCleared => self.clear_rank_ops(rank, ops),
                KvEvent::Unknown(_) => {}
            }
        }
        self.push_rank_changes(ops);
    }

    /// Forgets everything `rank` held (its stream was reset).
    pub fn clear_rank(&mut self, rank: usize, ops: &mut Vec<Op>) {
        self.clear_rank_ops(rank, ops);
        self.push_rank_changes(ops);
    }

    /// Emits the new rank sets of the keys whose set changed, once each, if still held (a key
    /// gone is in a `Remove` or `Clear` already).
    fn push_rank_changes(&mut self, ops: &mut Vec<Op>) {
        if self.changed.is_empty() {
            return;
        }
        let mut changed = std::mem::take(&mut self.changed);
        changed.sort_unstable();
        changed.dedup();
        let sets: Vec<(BlockKey, u64)> = changed
            .iter()
            .filter_map(|k| Some((BlockKey(*k), self.holders.get(k)?.ranks)))
            .collect();
        changed.clear();
        self.changed = changed;
        if !sets.is_empty() {
            ops.push(Op::Ranks(sets));
        }
    }

    /// Notes that `rank` now holds `key` through one more entry.
    fn hold_rank(&mut self, key: u64, rank: usize) {
        let Some(h) = self.holders.get_mut(&key) else {
            return;
        };
        let bit = rank_bit(rank);
        if h.ranks & bit != 0 {
            *self.extra.entry((key, rank)).or_insert(0) += 1;
        } else {
            h.ranks |= bit;
            if self.ranks.len() > 1 {
                self.changed.push(key);
            }
        }
    }

    fn clear_rank_ops(&mut self, rank: usize, ops: &mut Vec<Op>) {
        let multi = self.ranks.len() > 1;
        let Some(blocks) = self.ranks.get_mut(rank) else {
            return;
        };
        let mut gone = Vec::new();
        let mut moved: [Vec<BlockKey>; 3] = Default::default();
        for (_, e) in blocks.drain() {
            let before = self.holders.get(&e.key).map(|h| h.ranks);
            let released = release(&mut self.holders, &mut self.extra, e, rank);
            if multi
                && self
                    .holders
                    .get(&e.key)
                    .is_some_and(|h| Some(h.ranks) != before)
            {
                self.changed.push(e.key);
            }
            match released {
                Release::Last => gone.push(BlockKey(e.key)),
                Release::Moved(t) => moved[t as usize].push(BlockKey(e.key)),
                Release::Kept => {}
            }
        }
        self.stats.removed += gone.len() as u64;
        if self.holders.is_empty() {
            ops.push(Op::Clear);
            return;
        }
        // Moves first: a key can lose its best tier to one entry and go with the next.
        push_moves(moved, ops);
        if !gone.is_empty() {
            ops.push(Op::Remove(gone));
        }
    }

    fn stored(&mut self, rank: usize, e: &BlockStored, ops: &mut Vec<Op>) {
        if !main_group(e.group_idx, e.kv_cache_spec_kind.as_deref()) {
            self.stats.other_group += 1;
            return;
        }
        if e.token_ids.is_empty() && e.parent_block_hash.is_none() && !e.block_hashes.is_empty() {
            self.copied(rank, e, ops);
            return;
        }
        let n = e.block_hashes.len();
        let bs = e.block_size as usize;
        // The block size also sizes token mode's keys: bounded like a scraped one.
        if n == 0 || bs == 0 || e.block_size as u64 > MAX_BLOCK_SIZE || e.token_ids.len() != n * bs
        {
            self.stats.malformed += 1;
            return;
        }
        self.block_size = Some(e.block_size);
        let tier = Tier::from_medium(e.medium.as_deref());
        let blocks = &mut self.ranks[rank];
        let mut prev = match e.parent_block_hash {
            Some(parent) => match blocks.get(&parent) {
                Some(p) => p.key,
                None => {
                    self.stats.unknown_parent += 1;
                    return;
                }
            },
            None => match root_namespace(e) {
                Some(ns) => ns.seed(),
                None => {
                    self.stats.unsupported += 1;
                    return;
                }
            },
        };
        let mut new = Vec::with_capacity(n);
        // Keys this rank gained an entry for (their rank sets are updated after the loop, which
        // borrows the rank's blocks).
        let mut fresh = Vec::new();
        for (hash, tokens) in e.block_hashes.iter().zip(e.token_ids.chunks_exact(bs)) {
            let key = chain_tokens(prev, tokens);
            prev = key;
            match blocks.get_mut(hash) {
                Some(entry) => add_copy(entry, &mut self.holders, tier, &mut new),
                None => {
                    if blocks.len() >= MAX_BLOCKS_PER_RANK {
                        self.stats.over_capacity += 1;
                        continue;
                    }
                    blocks.insert(
                        *hash,
                        Entry {
                            key,
                            tiers: bit(tier),
                        },
                    );
                    self.stats.stored += 1;
                    let h = self.holders.entry(key).or_default();
                    let before = h.best();
                    h.count += 1;
                    h.change(bit(tier), true);
                    if h.best() != before {
                        new.push(BlockKey(key));
                    }
                    fresh.push(key);
                }
            }
        }
        for key in fresh {
            self.hold_rank(key, rank);
        }
        if !new.is_empty() {
            ops.push(Op::Store(new, tier));
        }
    }

    /// A token-less store (an offload connector's copy): adds `medium`'s tier to known blocks.
    fn copied(&mut self, rank: usize, e: &BlockStored, ops: &mut Vec<Op>) {
        let tier = Tier::from_medium(e.medium.as_deref());
        let blocks = &mut self.ranks[rank];
        let mut new = Vec::new();
        for hash in &e.block_hashes {
            match blocks.get_mut(hash) {
                Some(entry) => add_copy(entry, &mut self.holders, tier, &mut new),
                None => self.stats.unknown_copied += 1,
            }
        }
        if !new.is_empty() {
            ops.push(Op::Store(new, tier));
        }
    }

    fn removed(&mut self, rank: usize, e: &BlockRemoved, ops: &mut Vec<Op>) {
        if e.group_idx.is_some_and(|g| g != 0) {
            self.stats.other_group += 1;
            return;
        }
        let b = bit(Tier::from_medium(e.medium.as_deref()));
        let multi = self.ranks.len() > 1;
        let blocks = &mut self.ranks[rank];
        let mut gone = Vec::new();
        let mut moved: [Vec<BlockKey>; 3] = Default::default();
        for hash in &e.block_hashes {
            let Some(entry) = blocks.get_mut(hash) else {
                self.stats.unknown_removed += 1;
                continue;
            };
            if entry.tiers & b == 0 {
                continue;
            }
            if entry.tiers != b {
                // Still held in another tier (e.g. offloaded to CPU before the GPU copy went):
                // the key stays, but its best tier may drop.
                entry.tiers &= !b;
                if let Some(h) = self.holders.get_mut(&entry.key) {
                    let before = h.best();
                    h.change(b, false);
                    if let Some(t) = h.best().filter(|t| Some(*t) != before) {
                        moved[t as usize].push(BlockKey(entry.key));
                    }
                }
                continue;
            }
            let gone_entry = *entry;
            blocks.remove(hash);
            self.stats.removed += 1;
            let key = gone_entry.key;
            let before = self.holders.get(&key).map(|h| h.ranks);
            let released = release(&mut self.holders, &mut self.extra, gone_entry, rank);
            if multi
                && self
                    .holders
                    .get(&key)
                    .is_some_and(|h| Some(h.ranks) != before)
            {
                self.changed.push(key);
            }
            match released {
                Release::Last => gone.push(BlockKey(gone_entry.key)),
                Release::Moved(t) => moved[t as usize].push(BlockKey(gone_entry.key)),
                Release::Kept => {}
            }
        }
        // Moves first: a key can lose its best tier to one entry and go with the next.
        push_moves(moved, ops);
        if !gone.is_empty() {
            ops.push(Op::Remove(gone));
        }
    }
}

/// What dropping one holder entry did to its key.
enum Release {
    /// It was the last holder: the key is gone.
    Last,
    /// Other holders remain, and the key's best tier is now this one.
    Moved(Tier),
    /// Other holders remain with the same best tier.
    Kept,
}

/// Drops holder entry `e` (all its tiers) of its key, which `rank` held it through.
fn release(
    holders: &mut HashMap<u64, Holders>,
    extra: &mut HashMap<(u64, usize), u32>,
    e: Entry,
    rank: usize,
) -> Release {
    let Some(h) = holders.get_mut(&e.key) else {
        return Release::Kept;
    };
    // The rank keeps its bit while another of its entries holds the key.
    match extra.get_mut(&(e.key, rank)) {
        Some(n) if *n > 1 => *n -= 1,
        Some(_) => {
            extra.remove(&(e.key, rank));
        }
        None => h.ranks &= !rank_bit(rank),
    }
    if h.count <= 1 {
        holders.remove(&e.key);
        return Release::Last;
    }
    let before = h.best();
    h.count -= 1;
    h.change(e.tiers, false);
    match h.best() {
        Some(t) if Some(t) != before => Release::Moved(t),
        _ => Release::Kept,
    }
}

/// Appends one store per tier for keys whose best tier changed, best tier first.
fn push_moves(moved: [Vec<BlockKey>; 3], ops: &mut Vec<Op>) {
    for (tier, keys) in Tier::ALL.into_iter().zip(moved) {
        if !keys.is_empty() {
            ops.push(Op::Store(keys, tier));
        }
    }
}

/// Only group 0 / full attention is indexed: sliding-window and Mamba groups of hybrid models
/// hold other content under the same tokens (Dynamo filters the same way).
fn main_group(group_idx: Option<u32>, kind: Option<&str>) -> bool {
    group_idx.is_none_or(|g| g == 0) && kind.is_none_or(|k| k == "full_attention")
}

/// The namespace of a chain root: its LoRA name and the cache salt among block 0's extra keys
/// (vLLM puts the LoRA name first, then the salt, only in the block starting at token 0).
/// `None` when block 0 has extra keys token ids cannot describe (multimodal items, prompt
/// embeddings).
fn root_namespace(e: &BlockStored) -> Option<Namespace> {
    let lora = e.lora_name.as_deref().filter(|l| !l.is_empty());
    let first = match &e.extra_keys {
        None | Some(Value::Nil) => None,
        Some(Value::Array(per_block)) => per_block.first(),
        Some(_) => return None,
    };
    let mut salt = None;
    match first {
        None | Some(Value::Nil) => {}
        Some(Value::Array(items)) => {
            let mut lora_seen = false;
            for item in items {
                match item {
                    Value::Str(s) if !lora_seen && Some(s.as_str()) == lora => lora_seen = true,
                    Value::Str(s) if salt.is_none() => salt = Some(s.as_str()),
                    _ => return None,
                }
            }
        }
        Some(_) => return None,
    }
    Some(token_namespace(lora, salt, None))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::keys::token_block_keys;
    use std::collections::HashSet;

    fn with_medium(mut e: KvEvent, medium: &str) -> KvEvent {
        if let KvEvent::BlockStored(s) = &mut e {
            s.medium = Some(medium.into());
        }
        e
    }

    fn stored(hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>, bs: u32) -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes: hashes,
            parent_block_hash: parent,
            token_ids: tokens,
            block_size: bs,
            medium: Some("GPU".into()),
            ..Default::default()
        })
    }

    fn removed(hashes: Vec<u64>, medium: &str) -> KvEvent {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes,
            medium: Some(medium.into()),
            group_idx: None,
        })
    }

    fn batch(events: Vec<KvEvent>) -> EventBatch {
        EventBatch {
            ts: 0.0,
            events,
            data_parallel_rank: None,
        }
    }

    fn expected(tokens: &[u32], bs: usize) -> Vec<BlockKey> {
        let mut out = Vec::new();
        token_block_keys(token_namespace(None, None, None), tokens, bs, &mut out);
        out
    }

    #[test]
    fn an_offload_connectors_token_less_cpu_store_adds_the_tier_to_known_blocks() {
        // vLLM's OffloadingConnector: BlockStored with the same hashes, medium CPU, no token
        // ids, no parent (and block size 0 in recent versions).
        let tokens: Vec<u32> = (1..=8).collect();
        let want = expected(&tokens, 4);
        let mut idx = EventIndex::new(1);
        let mut ops = Vec::new();
        let copy = |hashes: Vec<u64>| with_medium(stored(hashes, None, Vec::new(), 0), "CPU");
        idx.apply(
            0,
            &batch(vec![
                stored(vec![1, 2], None, tokens, 4),
                copy(vec![1, 2, 77]),
            ]),
            &mut ops,
        );
        assert_eq!(
            ops,
            vec![Op::Store(want.clone(), Tier::Gpu)],
            "GPU stays best"
        );
        assert_eq!(idx.stats().unknown_copied, 1, "hash 77 was never stored");
        assert_eq!(idx.stats().malformed, 0);
        assert_eq!(idx.tier_counts(), (2, 2, 0));
        // The GPU copies go: the keys move to CPU, still held.
        ops.clear();
        idx.apply(0, &batch(vec![removed(vec![1, 2], "GPU")]), &mut ops);
        assert_eq!(ops, vec![Op::Store(want.clone(), Tier::Cpu)]);
        ops.clear();
        idx.apply(0, &batch(vec![removed(vec![2], "CPU")]), &mut ops);
        assert_eq!(ops, vec![Op::Remove(want[1..].to_vec())]);
        assert_eq!(idx.tier(want[0]), Some(Tier::Cpu));
    }

    #[test]
    fn keys_match_token_mode_request_keys_across_split_events() {
        let tokens: Vec<u32> = (100..132).collect();
        let mut idx = EventIndex::new(1);
        let mut ops = Vec::new();
        // One chain in two events: the second links to the first through the engine hash.
        idx.apply(
            0,
            &batch(vec![stored(vec![11, 12], None, tokens[..16].to_vec(), 8)]),
            &mut ops,
        );
        idx.apply(
            0,
            &batch(vec![stored(
                vec![13, 14],
                Some(12),
                tokens[16..].to_vec(),
                8,
            )]),
            &mut ops,
        );
        let want = expected(&tokens, 8);
        assert_eq!(
            ops,
            vec![
                Op::Store(want[..2].to_vec(), Tier::Gpu),
                Op::Store(want[2..].to_vec(), Tier::Gpu)
            ]
        );
        assert_eq!(idx.block_size(), Some(8));
        // Removing the tail removes exactly its key.
        ops.clear();
        idx.apply(0, &batch(vec![removed(vec![14], "GPU")]), &mut ops);
        assert_eq!(ops, vec![Op::Remove(vec![want[3]])]);
        assert_eq!(idx.len(), 3);
    }

    #[test]
    fn an_absurd_block_size_is_malformed_not_learned() {
        let bs = MAX_BLOCK_SIZE as u32 + 1;
        let mut idx = EventIndex::new(1);
        let mut ops = Vec::new();
        idx.apply(
            0,
            &batch(vec![stored(vec![1], None, vec![7; bs as usize], bs)]),
            &mut ops,
        );
        assert!(ops.is_empty());
        assert_eq!((idx.block_size(), idx.stats().malformed), (None, 1));
    }

    #[test]
    fn namespace_from_lora_and_salt_in_block_zero() {
        let tokens: Vec<u32> = (0..4).collect();
        let mut e = BlockStored {
            block_hashes: vec![1],
            token_ids: tokens.clone(),
            block_size: 4,
            lora_name: Some("ad".into()),
            extra_keys: Some(Value::Array(vec![Value::Array(vec![
                Value::Str("ad".into()),
                Value::Str("salt-1".into()),
            ])])),
            ..Default::default()
        };
        let mut idx = EventIndex::new(1);
        let mut ops = Vec::new();
        idx.apply(0, &batch(vec![KvEvent::BlockStored(e.clone())]), &mut ops);
        let mut want = Vec::new();
        token_block_keys(
            token_namespace(Some("ad"), Some("salt-1"), None),
            &tokens,
            4,
            &mut want,
        );
        assert_eq!(ops, vec![Op::Store(want.clone(), Tier::Gpu)]);
        assert_ne!(want, expected(&tokens, 4), "salt changes the key");
        // Multimodal extra keys cannot be reproduced from tokens: skipped.
        e.block_hashes = vec![2];
        e.extra_keys = Some(Value::Array(vec![Value::Array(vec![Value::Array(vec![
            Value::Str("img".into()),
            Value::Int(0),
        ])])]));
        ops.clear();
        idx.apply(0, &batch(vec![KvEvent::BlockStored(e)]), &mut ops);
        assert!(ops.is_empty());
        assert_eq!(idx.stats().unsupported, 1);
    }

    #[test]
    fn unknown_parent_other_groups_and_bad_lengths_are_skipped_and_counted() {
        let mut idx = EventIndex::new(1);
        let mut ops = Vec::new();
        let mut sliding = BlockStored {
            block_hashes: vec![5],
            token_ids: vec![1, 2],
            block_size: 2,
            group_idx: Some(1),
            ..Default::default()
        };
        idx.apply(
            0,
            &batch(vec![
                stored(vec![1], Some(99), vec![1, 2], 2),
                stored(vec![2, 3], None, vec![1, 2, 3], 2),
                stored(vec![4], None, vec![1, 2], 0),
                KvEvent::BlockStored(sliding.clone()),
                removed(vec![77], "GPU"),
            ]),
            &mut ops,
        );
        sliding.group_idx = Some(0);
        sliding.kv_cache_spec_kind = Some("sliding_window".into());
        idx.apply(0, &batch(vec![KvEvent::BlockStored(sliding)]), &mut ops);
        assert!(ops.is_empty());
        let s = idx.stats();
        assert_eq!(
            (
                s.unknown_parent,
                s.malformed,
                s.other_group,
                s.unknown_removed
            ),
            (1, 2, 2, 1)
        );
    }

    #[test]
    fn tiers_and_ranks_hold_a_key_until_the_last_copy_goes() {
        let tokens = vec![1, 2, 3, 4];
        let want = expected(&tokens, 4);
        let mut idx = EventIndex::new(2);
        let mut ops = Vec::new();
        idx.apply(
            0,
            &batch(vec![stored(vec![1], None, tokens.clone(), 4)]),
            &mut ops,
        );
        // Offloaded to CPU: same engine hash, another tier.
        let mut cpu = stored(vec![1], None, tokens.clone(), 4);
        if let KvEvent::BlockStored(e) = &mut cpu {
            e.medium = Some("CPU".into());
        }
        idx.apply(0, &batch(vec![cpu]), &mut ops);
        // Rank 1 stores the same content under its own hash.
        idx.apply(
            1,
            &batch(vec![stored(vec![9], None, tokens.clone(), 4)]),
            &mut ops,
        );
        // Held from rank 0, then from ranks 0 and 1 (the CPU copy changes neither).
        assert_eq!(
            ops,
            vec![
                Op::Store(want.clone(), Tier::Gpu),
                Op::Ranks(vec![(want[0], 0b01)]),
                Op::Ranks(vec![(want[0], 0b11)])
            ]
        );
        assert_eq!(idx.tier_counts(), (2, 1, 0));
        ops.clear();
        idx.apply(0, &batch(vec![removed(vec![1], "GPU")]), &mut ops);
        idx.apply(0, &batch(vec![removed(vec![1], "CPU")]), &mut ops);
        assert_eq!(
            ops,
            vec![Op::Ranks(vec![(want[0], 0b10)])],
            "rank 1 still holds it"
        );
        ops.clear();
        idx.apply(1, &batch(vec![KvEvent::AllBlocksCleared]), &mut ops);
        assert_eq!(ops, vec![Op::Clear]);
        assert!(idx.is_empty());
    }

    #[test]
    fn an_offload_moves_keys_to_the_cpu_tier_and_the_summary_follows() {
        use crate::core::cache_model::{CacheModel, CacheModelConfig, CacheSource};
        use crate::core::summary::SummaryConfig;
        // 40 blocks of 4 tokens in a model whose filter holds 64: the rebuild threshold is
        // 25% of 64 = 16 stale keys.
        let tokens: Vec<u32> = (0..160).collect();
        let want = expected(&tokens, 4);
        let hashes: Vec<u64> = (1..=40).collect();
        let mut idx = EventIndex::new(1);
        let mut model = CacheModel::new(
            CacheSource::Exact,
            1,
            CacheModelConfig::with_capacity(64),
            // A tiny false-positive rate, so no salted key's plain twin answers by chance.
            SummaryConfig {
                fp_rate: 1e-9,
                ..SummaryConfig::for_cluster("t")
            },
        )
        .unwrap();
        let now = std::time::Duration::ZERO;
        let run = |idx: &mut EventIndex, events: Vec<KvEvent>, model: &mut CacheModel| {
            let mut ops = Vec::new();
            idx.apply(0, &batch(events), &mut ops);
            for op in &ops {
                match op {
                    Op::Store(k, t) => model.store_tier(k, *t, now),
                    Op::Remove(k) => model.remove(k),
                    Op::Clear => model.clear().unwrap(),
                    Op::Ranks(sets) => model.set_ranks(sets),
                }
            }
            ops
        };
        // Stored on GPU; the offload connector stores CPU copies; then the GPU copies of the
        // chain's tail are evicted.
        let ops = run(
            &mut idx,
            vec![stored(hashes.clone(), None, tokens.clone(), 4)],
            &mut model,
        );
        assert_eq!(ops, vec![Op::Store(want.clone(), Tier::Gpu)]);
        let ops = run(
            &mut idx,
            vec![with_medium(
                stored(hashes.clone(), None, tokens.clone(), 4),
                "CPU",
            )],
            &mut model,
        );
        assert!(ops.is_empty(), "a CPU copy of a GPU block moves nothing");
        let ops = run(
            &mut idx,
            vec![removed(hashes[24..].to_vec(), "GPU")],
            &mut model,
        );
        assert_eq!(ops, vec![Op::Store(want[24..].to_vec(), Tier::Cpu)]);
        assert_eq!(idx.tier(want[0]), Some(Tier::Gpu));
        assert_eq!(idx.tier(want[39]), Some(Tier::Cpu));
        assert_eq!(model.tier(want[39]), Some(Tier::Cpu));
        // 16 stale GPU keys: not yet past the threshold, so the filter still claims GPU for
        // the moved keys (a stale key, as after any removal).
        assert!(!model.maybe_rebuild(now).unwrap());
        assert_eq!(model.summary().tier_of(want[39]), Some(Tier::Gpu));
        run(&mut idx, vec![removed(vec![hashes[23]], "GPU")], &mut model);
        assert!(model.maybe_rebuild(now).unwrap());
        let s = model.summary();
        assert!(s.has_lower_tiers());
        assert!(want[..23].iter().all(|k| s.tier_of(*k) == Some(Tier::Gpu)));
        assert!(want[23..].iter().all(|k| s.tier_of(*k) == Some(Tier::Cpu)));
        // The CPU copies go too: the keys leave the model.
        let ops = run(
            &mut idx,
            vec![removed(hashes[23..].to_vec(), "CPU")],
            &mut model,
        );
        assert_eq!(ops, vec![Op::Remove(want[23..].to_vec())]);
        assert_eq!(model.len(), 23);
    }

    /// The first message a real vLLM 0.32 (CPU build) published, as real-engines.md shows it:
    /// the bytes up to the third token id are verbatim; the rest of the 32 ids are not in the
    /// reference, so ids of the same widths stand in (27 three-byte, 3 one-byte: 276 bytes in all,
    /// the captured length).
    fn real_vllm_message() -> (Vec<u8>, Vec<u32>) {
        const CAPTURED: &str = "93cb41dac3068f2aae29918ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cf18db6067965a9383b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc0020cd01eccd026a";
        let mut bytes: Vec<u8> = (0..CAPTURED.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&CAPTURED[i..i + 2], 16).unwrap())
            .collect();
        let mut tokens = vec![492u32, 618];
        for i in 0..30u32 {
            let t = if i % 10 == 9 { 32 + i } else { 300 + i };
            tokens.push(t);
            crate::kv_events::msgpack::write_int(&mut bytes, t as i128);
        }
        for (k, v) in [
            ("block_size", Value::Int(32)),
            ("lora_id", Value::Nil),
            ("medium", Value::Str("GPU".into())),
            ("lora_name", Value::Nil),
            ("extra_keys", Value::Array(vec![Value::Nil])),
            ("group_idx", Value::Int(0)),
            ("kv_cache_spec_kind", Value::Str("full_attention".into())),
        ] {
            crate::kv_events::msgpack::write_str(&mut bytes, k);
            crate::kv_events::msgpack::write_value(&mut bytes, &v);
        }
        crate::kv_events::msgpack::write_int(&mut bytes, 0);
        (bytes, tokens)
    }

    #[test]
    fn a_real_vllm_message_decodes_re_encodes_and_indexes() {
        let (bytes, tokens) = real_vllm_message();
        assert_eq!(bytes.len(), 276);
        let batch = crate::kv_events::decode_batch(&bytes).unwrap();
        assert_eq!(batch.data_parallel_rank, Some(0));
        assert!((batch.ts - 1_795_955_260.67).abs() < 0.01);
        let KvEvent::BlockStored(e) = &batch.events[0] else {
            panic!("{batch:?}")
        };
        assert_eq!(e.block_hashes, vec![1_791_131_274_830_320_515]);
        assert_eq!((e.block_size, e.group_idx), (32, Some(0)));
        // Our encoder writes the same bytes (field order and widths as msgspec).
        assert_eq!(crate::kv_events::encode_batch(&batch), bytes);
        let mut idx = EventIndex::new(1);
        let mut ops = Vec::new();
        idx.apply(0, &batch, &mut ops);
        assert_eq!(ops, vec![Op::Store(expected(&tokens, 32), Tier::Gpu)]);
    }

    proptest::proptest! {
        /// Random bytes through decode + index never panic.
        #[test]
        fn random_payloads_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            if let Ok(batch) = crate::kv_events::decode_batch(&bytes) {
                let mut idx = EventIndex::new(1);
                idx.apply(0, &batch, &mut Vec::new());
            }
        }

        /// Whatever the events (small hash space, so parents, duplicates, unknown removals and
        /// tier moves happen), replaying the emitted operations on a map gives the index's keys
        /// with their best tiers.
        #[test]
        fn operations_track_the_index_exactly(
            events in proptest::collection::vec((0u8..4, 0usize..2, 0u64..6, 0u64..6, 0u32..3, 0u8..3), 1..60)
        ) {
            let mut idx = EventIndex::new(2);
            let mut model: HashMap<BlockKey, Tier> = HashMap::new();
            // What a cache model learns of each key's ranks from the operations: a new key
            // starts unknown (0), `Ranks` sets it.
            let mut masks: HashMap<BlockKey, u64> = HashMap::new();
            for (kind, rank, h, parent, tok, medium) in events {
                let medium = ["GPU", "CPU", "DISK"][medium as usize];
                let event = match kind {
                    0 => with_medium(stored(vec![h], None, vec![tok, tok], 2), medium),
                    1 => with_medium(
                        stored(vec![h, h + 10], Some(parent), vec![tok, 1, 2, tok], 2),
                        medium,
                    ),
                    2 => removed(vec![h, parent], medium),
                    _ => KvEvent::AllBlocksCleared,
                };
                let mut ops = Vec::new();
                idx.apply(rank, &batch(vec![event]), &mut ops);
                for op in ops {
                    match op {
                        Op::Store(k, t) => {
                            for key in &k {
                                masks.entry(*key).or_insert(0);
                            }
                            model.extend(k.into_iter().map(|k| (k, t)))
                        }
                        Op::Remove(k) => for x in k { model.remove(&x); masks.remove(&x); },
                        Op::Clear => { model.clear(); masks.clear(); }
                        Op::Ranks(sets) => for (k, m) in sets {
                            if let Some(slot) = masks.get_mut(&k) {
                                *slot = m;
                            }
                        },
                    }
                }
                let want: HashMap<BlockKey, Tier> = idx.tiered_keys().into_iter().collect();
                proptest::prop_assert_eq!(&model, &want);
                for k in want.keys() {
                    proptest::prop_assert_eq!(masks.get(k).copied(), Some(idx.ranks_of(*k)), "ranks of {:?}", k);
                    proptest::prop_assert_ne!(idx.ranks_of(*k), 0);
                }
                let keys: HashSet<BlockKey> = idx.keys().into_iter().collect();
                proptest::prop_assert_eq!(keys.len(), want.len());
            }
        }
    }

    #[test]
    fn each_key_knows_its_ranks_and_changes_are_emitted_once_per_batch() {
        let tokens = vec![1, 2, 3, 4, 5, 6, 7, 8];
        let want = expected(&tokens, 4);
        let mut idx = EventIndex::new(4);
        let mut ops = Vec::new();
        idx.apply(
            1,
            &batch(vec![stored(vec![10, 11], None, tokens.clone(), 4)]),
            &mut ops,
        );
        assert_eq!(
            ops.drain(..).map(sorted).collect::<Vec<_>>(),
            vec![
                Op::Store(want.clone(), Tier::Gpu),
                sorted(Op::Ranks(vec![(want[0], 0b10), (want[1], 0b10)]))
            ]
        );
        // Rank 3 stores the first block under its own hash: no new key, only a rank change.
        ops.clear();
        idx.apply(
            3,
            &batch(vec![stored(vec![30], None, tokens[..4].to_vec(), 4)]),
            &mut ops,
        );
        assert_eq!(ops, vec![Op::Ranks(vec![(want[0], 0b1010)])]);
        assert_eq!(idx.ranks_of(want[1]), 0b10);
        // Rank 1 evicts both: block 0 stays (rank 3), block 1 goes.
        ops.clear();
        idx.apply(1, &batch(vec![removed(vec![11, 10], "GPU")]), &mut ops);
        assert_eq!(
            ops,
            vec![
                Op::Remove(vec![want[1]]),
                Op::Ranks(vec![(want[0], 0b1000)])
            ]
        );
        // A rank holding one content under two hashes keeps its bit until both go.
        ops.clear();
        idx.apply(
            3,
            &batch(vec![stored(vec![31], None, tokens[..4].to_vec(), 4)]),
            &mut ops,
        );
        assert!(ops.is_empty(), "{ops:?}");
        idx.apply(3, &batch(vec![removed(vec![30], "GPU")]), &mut ops);
        assert!(ops.is_empty(), "{ops:?}");
        assert_eq!(idx.ranks_of(want[0]), 0b1000);
        idx.clear_rank(3, &mut ops);
        assert_eq!(ops, vec![Op::Clear]);
        // One rank: the index keeps no rank sets and emits none.
        let mut one = EventIndex::new(1);
        ops.clear();
        one.apply(
            0,
            &batch(vec![stored(vec![1], None, tokens[..4].to_vec(), 4)]),
            &mut ops,
        );
        assert_eq!(ops, vec![Op::Store(want[..1].to_vec(), Tier::Gpu)]);
        assert!(one.rank_sets().is_empty());
    }

    /// `Op::Ranks` with its keys in key order (the index sorts them by key value).
    fn sorted(op: Op) -> Op {
        match op {
            Op::Ranks(mut sets) => {
                sets.sort_unstable_by_key(|(k, _)| k.0);
                Op::Ranks(sets)
            }
            other => other,
        }
    }

    #[test]
    fn clearing_one_rank_removes_only_its_keys() {
        let mut idx = EventIndex::new(2);
        let mut ops = Vec::new();
        idx.apply(
            0,
            &batch(vec![stored(vec![1], None, vec![1, 1], 2)]),
            &mut ops,
        );
        idx.apply(
            1,
            &batch(vec![stored(vec![2], None, vec![2, 2], 2)]),
            &mut ops,
        );
        ops.clear();
        idx.clear_rank(0, &mut ops);
        assert_eq!(ops, vec![Op::Remove(expected(&[1, 1], 2))]);
        assert!(idx.contains(expected(&[2, 2], 2)[0]));
    }
}
