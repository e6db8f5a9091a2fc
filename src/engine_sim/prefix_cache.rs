//! The engine's prefix cache: fixed-size KV blocks identified by chained hashes, bounded by a KV
//! capacity, evicted least-recently-used.
//!
//! It mirrors vLLM's block pool closely enough that a router can learn from it what it would learn
//! from vLLM: only full blocks are hashed, a block's hash chains its parent's, blocks used by running
//! requests are pinned (reference counted), freed blocks stay cached until capacity pressure evicts
//! them (tail blocks of a request first, so chains shrink from the end), and every store/evict is
//! reported as an event so the server can publish vLLM-format KV events.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::tokens::TokenId;

/// A block's identity: XXH3-64 of its tokens (u32 little-endian), seeded with the parent's hash.
pub type BlockHash = u64;

/// Seed of the first block of every chain, so that a chain root never collides with a block seeded
/// by a real parent hash of 0 by accident of convention.
pub const ROOT_HASH_SEED: u64 = 0x6b76_6d65_7368_0001;

/// Hashes of the full blocks of `tokens` (a trailing partial block is not hashed, as in vLLM).
pub fn block_hashes(tokens: &[TokenId], block_tokens: usize) -> Vec<BlockHash> {
    salted_block_hashes(tokens, block_tokens, None)
}

/// The seed of a chain's first block: with a `cache_salt`, salted, as vLLM adds the salt to the
/// extra keys of the block starting at token 0 — through chaining every later block differs too,
/// so requests with different salts never share a block.
pub fn chain_root(cache_salt: Option<&str>) -> BlockHash {
    match cache_salt.filter(|s| !s.is_empty()) {
        None => ROOT_HASH_SEED,
        Some(salt) => xxh3_64_with_seed(salt.as_bytes(), ROOT_HASH_SEED),
    }
}

/// [`block_hashes`] of a request with `cache_salt` (see [`chain_root`]).
pub fn salted_block_hashes(
    tokens: &[TokenId],
    block_tokens: usize,
    cache_salt: Option<&str>,
) -> Vec<BlockHash> {
    let block_tokens = block_tokens.max(1);
    let mut parent = chain_root(cache_salt);
    let mut bytes = Vec::with_capacity(block_tokens * 4);
    tokens
        .chunks_exact(block_tokens)
        .map(|block| {
            bytes.clear();
            for token in block {
                bytes.extend_from_slice(&token.to_le_bytes());
            }
            parent = xxh3_64_with_seed(&bytes, parent);
            parent
        })
        .collect()
}

/// A change to the cache's contents, in the shape of vLLM's KV events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// Consecutive blocks of one chain became cached.
    Stored {
        /// Hash of the block preceding the first stored block; `None` for a chain root.
        parent: Option<BlockHash>,
        /// Hashes of the stored blocks, in chain order.
        hashes: Vec<BlockHash>,
        /// The stored blocks' tokens, `hashes.len() × block_tokens` of them.
        token_ids: Vec<TokenId>,
        /// A chain root's `cache_salt` (vLLM's extra keys of the block at token 0); `None`
        /// when unsalted or when the first stored block is not the root.
        cache_salt: Option<String>,
    },
    /// Blocks were evicted.
    Removed {
        /// Hashes of the evicted blocks.
        hashes: Vec<BlockHash>,
    },
    /// Every cached block was dropped (vLLM's `reset_prefix_cache`).
    Cleared,
    /// Blocks written through to CPU memory (the CPU tier, `cpu_tier.rs`): vLLM's offloading
    /// connector reports them as `BlockStored` with medium `"CPU"` and no token ids.
    Offloaded {
        /// Hashes of the blocks, in chain order.
        hashes: Vec<BlockHash>,
    },
    /// Blocks evicted from CPU memory (`BlockRemoved`, medium `"CPU"`).
    OffloadEvicted {
        /// Hashes of the evicted blocks.
        hashes: Vec<BlockHash>,
    },
}

#[derive(Debug, Clone, Copy)]
struct Block {
    /// Running requests using this block; evictable only at 0.
    refs: u32,
    /// Position in the LRU order while `refs == 0`.
    lru_tick: u64,
}

/// Block-granular prefix cache with LRU eviction and pinning (see the module docs).
#[derive(Debug)]
pub struct PrefixCache {
    block_tokens: usize,
    capacity_blocks: usize,
    blocks: HashMap<BlockHash, Block>,
    /// Evictable (unpinned) cached blocks by the tick of their release; the smallest goes first.
    lru: BTreeMap<u64, BlockHash>,
    tick: u64,
    /// Blocks held by running requests that are not in the cache (partial prompt tails, decode room,
    /// not yet computed prompt blocks).
    private_blocks: usize,
    events: Vec<CacheEvent>,
}

impl PrefixCache {
    /// A cache of `capacity_tokens / block_tokens` blocks.
    pub fn new(capacity_tokens: usize, block_tokens: usize) -> Self {
        let block_tokens = block_tokens.max(1);
        Self {
            block_tokens,
            capacity_blocks: capacity_tokens / block_tokens,
            blocks: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            private_blocks: 0,
            events: Vec::new(),
        }
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Total number of KV blocks (vLLM's `num_gpu_blocks`).
    pub fn capacity_blocks(&self) -> usize {
        self.capacity_blocks
    }

    /// Blocks in use: cached (pinned or not) plus private blocks of running requests.
    pub fn used_blocks(&self) -> usize {
        self.blocks.len() + self.private_blocks
    }

    /// Blocks held by running requests (pinned cached blocks plus private ones), the share vLLM
    /// reports as `kv_cache_usage_perc`: cached-but-free blocks count as free there.
    pub fn active_blocks(&self) -> usize {
        self.blocks.len() - self.lru.len() + self.private_blocks
    }

    /// Number of blocks currently in the cache (hashed, pinned or evictable).
    pub fn cached_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Whether a block is cached.
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.blocks.contains_key(&hash)
    }

    /// Length of the leading run of `hashes` present in the cache.
    pub fn match_prefix(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count()
    }

    /// Pins the cached blocks `hits` and reserves `new_private` further blocks, evicting LRU blocks
    /// as needed. Returns false, changing nothing, when the blocks cannot fit.
    pub fn allocate(&mut self, hits: &[BlockHash], new_private: usize) -> bool {
        let hits_evictable = hits
            .iter()
            .filter(|h| self.blocks.get(h).is_some_and(|b| b.refs == 0))
            .count();
        let free = self.capacity_blocks.saturating_sub(self.used_blocks());
        let evictable = self.lru.len() - hits_evictable;
        if free + evictable < new_private || hits.iter().any(|h| !self.contains(*h)) {
            return false;
        }
        for hash in hits {
            self.pin(*hash);
        }
        let mut removed = Vec::new();
        while self.capacity_blocks.saturating_sub(self.used_blocks()) < new_private {
            let Some((_, hash)) = self.lru.pop_first() else {
                break;
            };
            self.blocks.remove(&hash);
            removed.push(hash);
        }
        if !removed.is_empty() {
            self.events.push(CacheEvent::Removed { hashes: removed });
        }
        self.private_blocks += new_private;
        true
    }

    /// Moves freshly computed full blocks from a request's private allocation into the cache,
    /// pinned for that request. `tokens` holds exactly the blocks' tokens. A block another request
    /// cached meanwhile is shared instead, and the duplicate private block freed.
    // The entry API cannot be used: the hit branch calls `self.pin`, which borrows `self`.
    #[allow(clippy::map_entry)]
    /// `cache_salt` is the request's, reported with a stored chain root.
    pub fn commit(
        &mut self,
        parent: Option<BlockHash>,
        hashes: &[BlockHash],
        tokens: &[TokenId],
        cache_salt: Option<&str>,
    ) {
        let mut run: Option<(Option<BlockHash>, Vec<BlockHash>, Vec<TokenId>)> = None;
        let mut prev = parent;
        for (i, hash) in hashes.iter().copied().enumerate() {
            self.private_blocks = self.private_blocks.saturating_sub(1);
            let shared = match self.blocks.entry(hash) {
                Entry::Occupied(mut entry) => {
                    let block = entry.get_mut();
                    if block.refs == 0 {
                        self.lru.remove(&block.lru_tick);
                    }
                    block.refs += 1;
                    true
                }
                Entry::Vacant(entry) => {
                    entry.insert(Block {
                        refs: 1,
                        lru_tick: 0,
                    });
                    false
                }
            };
            if shared {
                if let Some((p, hs, ts)) = run.take() {
                    self.push_stored(p, hs, ts, cache_salt);
                }
            } else {
                let start = (i * self.block_tokens).min(tokens.len());
                let end = ((i + 1) * self.block_tokens).min(tokens.len());
                let entry = run.get_or_insert_with(|| (prev, Vec::new(), Vec::new()));
                entry.1.push(hash);
                entry.2.extend_from_slice(&tokens[start..end]);
            }
            prev = Some(hash);
        }
        if let Some((p, hs, ts)) = run {
            self.push_stored(p, hs, ts, cache_salt);
        }
    }

    /// Unpins a finished request's cached blocks and frees its private ones. Blocks are released
    /// last-first so the LRU evicts the tails of chains before their shared heads (as vLLM does).
    pub fn release(&mut self, pinned: &[BlockHash], private: usize) {
        for hash in pinned.iter().rev() {
            if let Some(block) = self.blocks.get_mut(hash) {
                block.refs = block.refs.saturating_sub(1);
                if block.refs == 0 {
                    self.tick += 1;
                    block.lru_tick = self.tick;
                    self.lru.insert(self.tick, *hash);
                }
            }
        }
        self.private_blocks = self.private_blocks.saturating_sub(private);
    }

    /// Drops every cached block, as vLLM's `reset_prefix_cache` does. Like vLLM it refuses (returns
    /// false) while any cached block is pinned by a running request.
    pub fn reset(&mut self) -> bool {
        if self.lru.len() != self.blocks.len() {
            return false;
        }
        self.blocks.clear();
        self.lru.clear();
        self.events.push(CacheEvent::Cleared);
        true
    }

    /// Queues an event of another tier (the CPU tier's), in order with this cache's own.
    pub fn push_event(&mut self, e: CacheEvent) {
        self.events.push(e);
    }

    /// Events since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        std::mem::take(&mut self.events)
    }

    fn pin(&mut self, hash: BlockHash) {
        if let Some(block) = self.blocks.get_mut(&hash) {
            if block.refs == 0 {
                self.lru.remove(&block.lru_tick);
            }
            block.refs += 1;
        }
    }

    fn push_stored(
        &mut self,
        parent: Option<BlockHash>,
        hashes: Vec<BlockHash>,
        tokens: Vec<TokenId>,
        cache_salt: Option<&str>,
    ) {
        let cache_salt = cache_salt
            .filter(|s| parent.is_none() && !s.is_empty())
            .map(str::to_owned);
        self.events.push(CacheEvent::Stored {
            parent,
            hashes,
            token_ids: tokens,
            cache_salt,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(start: u32, n: u32) -> Vec<TokenId> {
        (start..start + n).collect()
    }

    /// Caches the full blocks of `tokens` as one request would, then releases them.
    fn cache_sequence(cache: &mut PrefixCache, tokens: &[TokenId]) -> Vec<BlockHash> {
        let hashes = block_hashes(tokens, cache.block_tokens());
        let hits = cache.match_prefix(&hashes);
        assert!(cache.allocate(&hashes[..hits], hashes.len() - hits));
        let parent = hits.checked_sub(1).map(|i| hashes[i]);
        let bs = cache.block_tokens();
        cache.commit(
            parent,
            &hashes[hits..],
            &tokens[hits * bs..hashes.len() * bs],
            None,
        );
        cache.release(&hashes, 0);
        hashes
    }

    #[test]
    fn hashes_chain_and_ignore_partial_blocks() {
        let a = block_hashes(&toks(0, 40), 16);
        assert_eq!(a.len(), 2);
        let b = block_hashes(&toks(0, 32), 16);
        assert_eq!(a, b);
        // Same second block content, different first block: the chain makes the hash differ.
        let mut c = toks(0, 32);
        c[0] = 999;
        let c = block_hashes(&c, 16);
        assert_ne!(a[1], c[1]);
        // A salt changes the root, hence every block; no salt and an empty one are alike.
        let salted = salted_block_hashes(&toks(0, 32), 16, Some("s"));
        assert!(salted.iter().zip(&b).all(|(x, y)| x != y));
        assert_eq!(salted_block_hashes(&toks(0, 32), 16, Some("")), b);
    }

    #[test]
    fn stores_emit_events_and_prefix_matches() {
        let mut cache = PrefixCache::new(16 * 10, 16);
        let tokens = toks(0, 48);
        let hashes = cache_sequence(&mut cache, &tokens);
        assert_eq!(
            cache.take_events(),
            vec![CacheEvent::Stored {
                parent: None,
                hashes: hashes.clone(),
                token_ids: tokens.clone(),
                cache_salt: None,
            }]
        );
        let mut other = toks(0, 32);
        other.extend(toks(1000, 16));
        assert_eq!(cache.match_prefix(&block_hashes(&other, 16)), 2);
        // Extending the chain reports the parent.
        let mut longer = tokens.clone();
        longer.extend(toks(500, 16));
        let longer_hashes = cache_sequence(&mut cache, &longer);
        assert_eq!(
            cache.take_events(),
            vec![CacheEvent::Stored {
                parent: Some(hashes[2]),
                hashes: vec![longer_hashes[3]],
                token_ids: toks(500, 16),
                cache_salt: None,
            }]
        );
    }

    #[test]
    fn evicts_least_recently_used_tail_first() {
        let mut cache = PrefixCache::new(16 * 4, 16);
        let a = cache_sequence(&mut cache, &toks(0, 32));
        let b = cache_sequence(&mut cache, &toks(100, 32));
        cache.take_events();
        // Touch `a` again so `b` is the least recently used.
        cache_sequence(&mut cache, &toks(0, 32));
        assert!(cache.allocate(&[], 1));
        assert_eq!(
            cache.take_events(),
            vec![CacheEvent::Removed { hashes: vec![b[1]] }]
        );
        assert!(cache.contains(a[0]) && cache.contains(a[1]) && cache.contains(b[0]));
    }

    #[test]
    fn pinned_blocks_are_never_evicted() {
        let mut cache = PrefixCache::new(16 * 3, 16);
        let tokens = toks(0, 32);
        let hashes = block_hashes(&tokens, 16);
        assert!(cache.allocate(&[], 2));
        cache.commit(None, &hashes, &tokens, None);
        // Two blocks pinned, one free: a request needing two more blocks must wait.
        assert!(!cache.allocate(&[], 2));
        assert!(cache.allocate(&[], 1));
        assert_eq!(cache.used_blocks(), 3);
        cache.release(&hashes, 1);
        assert!(cache.allocate(&[], 3));
        assert!(!cache.contains(hashes[0]));
    }

    #[test]
    fn reset_refuses_while_pinned_then_clears() {
        let mut cache = PrefixCache::new(16 * 4, 16);
        let tokens = toks(0, 32);
        let hashes = block_hashes(&tokens, 16);
        assert!(cache.allocate(&[], 2));
        cache.commit(None, &hashes, &tokens, None);
        assert!(!cache.reset());
        cache.release(&hashes, 0);
        cache.take_events();
        assert!(cache.reset());
        assert_eq!(cache.cached_blocks(), 0);
        assert_eq!(cache.take_events(), vec![CacheEvent::Cleared]);
    }

    #[test]
    fn hits_are_pinned_before_eviction_makes_room() {
        let mut cache = PrefixCache::new(16 * 3, 16);
        let hashes = cache_sequence(&mut cache, &toks(0, 48));
        // Needs the 3 cached blocks as hits plus 1 new block: cannot fit without evicting a hit.
        assert!(!cache.allocate(&hashes, 1));
        assert_eq!(cache.cached_blocks(), 3);
        assert!(cache.allocate(&hashes[..2], 1));
        assert!(cache.contains(hashes[0]) && cache.contains(hashes[1]));
        assert!(!cache.contains(hashes[2]));
    }
}
