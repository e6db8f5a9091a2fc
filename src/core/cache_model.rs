//! Cache model: the home node's picture of one replica's prefix cache, and the source of its
//! summary.
//!
//! Two sources feed it. *Exact*: the engine's KV events say which blocks were stored and removed,
//! so the set is the engine's truth. *Approximate*: engines without events are modelled from the
//! requests routed to them — an LRU of block keys bounded by the replica's KV capacity, with a
//! TTL, which is how the engine itself evicts. Either way the model owns a [`ReplicaSummary`];
//! since a Bloom filter cannot delete, removed keys pile up as `stale` and, past a threshold, the
//! model starts a new epoch whose filter is rebuilt from the live set.
//!
//! Exact models also keep each block's best tier (GPU, CPU, disk) and put it in the summary as
//! [`Tier::summary_key`]. A block changing tier (an offload GPU → CPU, or a reload) is a remove of
//! its old tier key plus an add of the new one: the old key stays in the filter, counted as
//! stale like any removal, until a rebuild inserts only the current tier's key. So a peer's
//! filter may claim the old (better) tier until then, and an offload shows in peers' views only
//! after the next epoch. Approximate models have no tiers: routed blocks, block reports and a
//! handover's keys all count as GPU-held.
//!
//! Exact models of a replica with several data-parallel ranks also keep, per block, the set of
//! ranks holding it ([`CacheModel::set_ranks`], from the KV-event index); the summary stays one
//! per replica (any rank), and [`CacheModel::rank_runs`] tells the home node how much of a
//! request's prefix each rank holds, to name the rank (`dp_rank.rs`).
//!
//! Rebuild rules ([`CacheModel::maybe_rebuild`], on a timer): a new epoch starts when stale keys
//! exceed `rebuild_stale_fraction` (default 25%) of the filter's capacity, or when more than 1.5×
//! that capacity was inserted; it holds exactly the live set, each key under its current tier.
//! [`CacheModel::restart_epoch`] (a node that just became home) never goes back in epoch.
//!
//! Tenant occupancy (KV quotas, `tenants.rs`): each live block carries the KV slot of the tenant
//! whose request *last touched* it, and the model counts blocks per slot. Last touch, not first
//! store, because the LRU order is by last touch: the tenant whose requests keep a block resident
//! is the one its eviction pressure is charged to, and a tenant that stops using a prefix stops
//! paying for it. An approximate model learns the tenant with each routed request
//! ([`CacheModel::record_routed_by`]); block reports, handovers and KV events carry none, so those
//! blocks stay [`KV_UNATTRIBUTED`] unless a routed request of this node later claims them
//! ([`CacheModel::attribute`]: an exact model's blocks, matched by key at the first byte).
//! [`CacheModel::tenant_share`] estimates a slot's share of the replica's cache from that.

use std::num::NonZeroUsize;
use std::time::Duration;

use lru::LruCache;

use super::keys::BlockKey;
use super::summary::{ReplicaSummary, SummaryConfig, SummaryError, Tier};
use super::tenants::{KV_SLOTS, KV_UNATTRIBUTED};

/// Most blocks a cache model is sized for, whatever the replica claims (a scrape, a gossiped
/// record or a config): 4 Mi blocks — 64 Mi tokens at 16-token blocks, beyond any engine's KV
/// pool — so its filter is at most a few MiB. A model is only ever *sized* by this: the LRU
/// allocates as keys arrive, never up front, so a hostile capacity cannot make the node
/// preallocate gigabytes.
pub const MAX_CAPACITY_BLOCKS: usize = 1 << 22;

/// Where a cache model's knowledge comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheSource {
    /// Engine KV events: add/remove/clear, no capacity or TTL of our own.
    Exact,
    /// Routed requests: LRU bounded by capacity, with a TTL.
    Approximate,
}

/// Settings of a cache model.
#[derive(Clone, Debug)]
pub struct CacheModelConfig {
    /// Blocks the replica can hold (its KV capacity in tokens / tokens per block); clamped to
    /// 1..=[`MAX_CAPACITY_BLOCKS`] by [`CacheModel::new`].
    pub capacity_blocks: usize,
    /// Approximate mode: a key not routed again within this long is presumed evicted.
    /// Default 600 s (engines under load evict sooner through capacity, which the LRU models).
    pub ttl: Duration,
    /// Start a new epoch when stale keys exceed this fraction of the filter's capacity.
    /// Default 0.25: the false-positive rate then stays within about 1.5× the target.
    pub rebuild_stale_fraction: f64,
}

impl CacheModelConfig {
    /// Defaults for a replica holding `capacity_blocks` blocks.
    pub fn with_capacity(capacity_blocks: usize) -> Self {
        CacheModelConfig {
            capacity_blocks,
            ttl: Duration::from_secs(600),
            rebuild_stale_fraction: 0.25,
        }
    }
}

/// A live key's state.
#[derive(Clone, Copy, Debug)]
struct Slot {
    /// When it was last stored or routed.
    touched: Duration,
    /// The best tier it is held in (always GPU in approximate mode: routed blocks are computed
    /// into the GPU pool).
    tier: Tier,
    /// KV slot of the tenant whose request last touched it ([`KV_UNATTRIBUTED`] when unknown).
    tenant: u8,
    /// Data-parallel ranks holding it (bit r = rank r), for exact models of multi-rank replicas;
    /// 0 when not known (approximate mode, one rank).
    ranks: u64,
}

/// One replica's cache model.
#[derive(Debug)]
pub struct CacheModel {
    source: CacheSource,
    cfg: CacheModelConfig,
    summary_cfg: SummaryConfig,
    /// Live keys, least recently used first.
    entries: LruCache<u64, Slot>,
    summary: ReplicaSummary,
    /// Keys in the filter that the replica no longer holds.
    stale: usize,
    /// Live blocks per KV slot (sums to `entries.len()`).
    tenant_blocks: [u32; KV_SLOTS],
}

impl CacheModel {
    /// An empty model; `epoch` must exceed any epoch peers saw for this replica (use a clock or a
    /// node generation), so a new home's summary supersedes the old one.
    pub fn new(
        source: CacheSource,
        epoch: u64,
        mut cfg: CacheModelConfig,
        summary_cfg: SummaryConfig,
    ) -> Result<Self, SummaryError> {
        cfg.capacity_blocks = cfg.capacity_blocks.clamp(1, MAX_CAPACITY_BLOCKS);
        let capacity = cfg.capacity_blocks;
        let summary = ReplicaSummary::new(epoch, capacity, &summary_cfg)?;
        let entries = match source {
            CacheSource::Exact => LruCache::unbounded(),
            // Sparse: memory follows the keys actually held, not the claimed capacity.
            CacheSource::Approximate => {
                LruCache::sparse(NonZeroUsize::new(capacity).unwrap_or(NonZeroUsize::MIN))
            }
        };
        Ok(CacheModel {
            source,
            cfg,
            summary_cfg,
            entries,
            summary,
            stale: 0,
            tenant_blocks: [0; KV_SLOTS],
        })
    }

    /// A live block of slot `tenant` left (evicted, removed, expired or retagged).
    fn uncount(&mut self, tenant: u8) {
        if let Some(c) = self.tenant_blocks.get_mut(tenant as usize) {
            *c = c.saturating_sub(1);
        }
    }

    /// A live block of slot `tenant` arrived (or was retagged to it).
    fn count(&mut self, tenant: u8) {
        if let Some(c) = self.tenant_blocks.get_mut(tenant as usize) {
            *c = c.saturating_add(1);
        }
    }

    /// Live blocks attributed to KV slot `tenant`.
    pub fn tenant_blocks(&self, tenant: u8) -> usize {
        self.tenant_blocks
            .get(tenant as usize)
            .map_or(0, |c| *c as usize)
    }

    /// The estimated share (0..=1) of the replica's KV cache that slot `tenant`'s blocks hold:
    /// its share of the blocks whose tenant this model knows, times how full the cache is
    /// (live blocks over capacity, at most 1). On the home of an approximate model the live set
    /// includes the other nodes' reports, so the fill is the replica's, and the mix is this
    /// node's routing, which is the fleet's when clients spread over the nodes. Elsewhere the
    /// live set is this node's own requests only, so the fill — and the share — is a lower
    /// bound: a quota binds there later, never sooner.
    pub fn tenant_share(&self, tenant: u8) -> f64 {
        self.tenant_share_filled(tenant, 0.0)
    }

    /// [`CacheModel::tenant_share`] with the cache known to be at least `min_fill` full (0..=1):
    /// a follower passes what the home's summary implies, so that every node of the mesh
    /// estimates about the same shares (see `node::routing`).
    pub fn tenant_share_filled(&self, tenant: u8, min_fill: f64) -> f64 {
        let live = self.entries.len();
        let attributed = live.saturating_sub(self.tenant_blocks(KV_UNATTRIBUTED));
        if attributed == 0 || tenant == KV_UNATTRIBUTED {
            return 0.0;
        }
        let fill = (live as f64 / self.cfg.capacity_blocks.max(1) as f64)
            .max(min_fill)
            .clamp(0.0, 1.0);
        self.tenant_blocks(tenant) as f64 / attributed as f64 * fill
    }

    /// Every slot's [`CacheModel::tenant_share_filled`], into `out` (one per slot, `KV_SLOTS`
    /// at most).
    pub fn tenant_shares(&self, min_fill: f64, out: &mut [f32]) {
        for (slot, o) in out.iter_mut().enumerate().take(KV_SLOTS) {
            *o = self.tenant_share_filled(slot as u8, min_fill) as f32;
        }
    }

    /// Blocks the replica holds at most, as this model is sized.
    pub fn capacity_blocks(&self) -> usize {
        self.cfg.capacity_blocks
    }

    /// Exact mode: the blocks a routed request of KV slot `tenant` brought or touched, at its
    /// first byte. Keys the engine's events have stored are (re)attributed to it; keys not held
    /// yet (their store event comes later) stay as the events leave them, unattributed. Moves
    /// no key in the LRU order: events, not guesses, say what the engine holds.
    pub fn attribute(&mut self, keys: &[BlockKey], tenant: u8) {
        for k in keys {
            let Some(slot) = self.entries.peek_mut(&k.0) else {
                continue;
            };
            let old = std::mem::replace(&mut slot.tenant, tenant);
            if old != tenant {
                self.uncount(old);
                self.count(tenant);
            }
        }
    }

    /// Where this model's knowledge comes from.
    pub fn source(&self) -> CacheSource {
        self.source
    }

    /// The summary peers pull.
    pub fn summary(&self) -> &ReplicaSummary {
        &self.summary
    }

    /// Live keys.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no key is live.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Keys still in the filter but no longer held.
    pub fn stale(&self) -> usize {
        self.stale
    }

    /// Whether the model holds `key` right now (exact lookup, not the filter).
    pub fn contains(&self, key: BlockKey) -> bool {
        self.entries.contains(&key.0)
    }

    /// The best tier `key` is held in right now (exact lookup), if held.
    pub fn tier(&self, key: BlockKey) -> Option<Tier> {
        self.entries.peek(&key.0).map(|s| s.tier)
    }

    /// Approximate mode: the blocks of a request just routed to the replica. The engine will
    /// hold them and touch its existing ones, so they all become most recently used — the first
    /// block most of all: engines evict the tails of chains first, which keeps the cache
    /// prefix-closed, so the keys are touched from last to first.
    /// Their tenant is unknown (a peer's block report, a handover): see
    /// [`CacheModel::record_routed_by`].
    pub fn record_routed(&mut self, keys: &[BlockKey], now: Duration) {
        self.record_routed_by(keys, KV_UNATTRIBUTED, now);
    }

    /// [`CacheModel::record_routed`] for a request of KV slot `tenant`: its blocks, new or
    /// touched, are attributed to it (last touch).
    pub fn record_routed_by(&mut self, keys: &[BlockKey], tenant: u8, now: Duration) {
        self.expire(now);
        let slot = Slot {
            touched: now,
            tier: Tier::Gpu,
            tenant,
            ranks: 0,
        };
        for k in keys.iter().rev() {
            if let Some((old, old_slot)) = self.entries.push(k.0, slot) {
                // Evicted, or (same key) a lower-tier copy from a seeded exact set now back on GPU.
                if old != k.0 || old_slot.tier != Tier::Gpu {
                    self.stale += 1;
                }
                self.uncount(old_slot.tenant);
            }
            self.count(tenant);
        }
        self.summary.insert(keys);
    }

    /// Exact mode: blocks the engine stored in GPU memory.
    pub fn store(&mut self, keys: &[BlockKey], now: Duration) {
        self.store_tier(keys, Tier::Gpu, now);
    }

    /// Exact mode: blocks whose best tier is now `tier` — newly stored, or moved (offloaded to a
    /// lower tier after their GPU copy went, or reloaded). A move is a remove of the old tier's
    /// key (stale in the filter until the next epoch) plus an add of the new one.
    pub fn store_tier(&mut self, keys: &[BlockKey], tier: Tier, now: Duration) {
        for k in keys {
            // A move keeps the block's tenant and the ranks holding it; a new block's tenant is
            // unknown until a routed request claims it (`attribute`).
            if let Some(slot) = self.entries.get_mut(&k.0) {
                if slot.tier != tier {
                    self.stale += 1;
                }
                slot.tier = tier;
                slot.touched = now;
            } else {
                let slot = Slot {
                    touched: now,
                    tier,
                    tenant: KV_UNATTRIBUTED,
                    ranks: 0,
                };
                if let Some((_, evicted)) = self.entries.push(k.0, slot) {
                    // Only a bounded (approximate) LRU evicts here.
                    self.stale += 1;
                    self.uncount(evicted.tenant);
                }
                self.count(KV_UNATTRIBUTED);
            }
        }
        self.summary.insert_tier(keys, tier);
    }

    /// Exact mode, multi-rank replica: the new sets of ranks holding these blocks (bit r =
    /// rank r). Keys not held are ignored (their store comes first); recency is unchanged.
    pub fn set_ranks(&mut self, sets: &[(BlockKey, u64)]) {
        for (k, ranks) in sets {
            if let Some(s) = self.entries.peek_mut(&k.0) {
                s.ranks = *ranks;
            }
        }
    }

    /// The ranks holding `key` (bit r = rank r; 0 when not held or not known).
    pub fn ranks_of(&self, key: BlockKey) -> u64 {
        self.entries.peek(&key.0).map_or(0, |s| s.ranks)
    }

    /// How many leading `keys` each of `ranks` data-parallel ranks holds (see
    /// [`super::dp_rank::rank_runs`]); all zero without rank sets.
    pub fn rank_runs(&self, keys: &[BlockKey], ranks: usize) -> super::dp_rank::RankRuns {
        super::dp_rank::rank_runs(keys.len(), ranks, |j| self.ranks_of(keys[j]))
    }

    /// Exact mode: blocks the engine evicted.
    pub fn remove(&mut self, keys: &[BlockKey]) {
        for k in keys {
            if let Some(slot) = self.entries.pop(&k.0) {
                self.stale += 1;
                self.uncount(slot.tenant);
            }
        }
    }

    /// The engine dropped everything (or we lost track of it): a new, empty epoch at once.
    pub fn clear(&mut self) -> Result<(), SummaryError> {
        self.entries.clear();
        self.stale = 0;
        self.tenant_blocks = [0; KV_SLOTS];
        self.summary = ReplicaSummary::new(
            self.summary.epoch() + 1,
            self.cfg.capacity_blocks.max(1),
            &self.summary_cfg,
        )?;
        Ok(())
    }

    /// Approximate mode: drops keys untouched for longer than the TTL.
    pub fn expire(&mut self, now: Duration) {
        if self.source != CacheSource::Approximate {
            return;
        }
        while let Some((_, slot)) = self.entries.peek_lru() {
            if now.saturating_sub(slot.touched) <= self.cfg.ttl {
                break;
            }
            if let Some((_, slot)) = self.entries.pop_lru() {
                self.uncount(slot.tenant);
            }
            self.stale += 1;
        }
    }

    /// Starts a new epoch when evicted keys pile up in the filter, or when more keys went in than
    /// it was sized for. Returns whether it did. Call it on a timer, not per request.
    pub fn maybe_rebuild(&mut self, now: Duration) -> Result<bool, SummaryError> {
        self.expire(now);
        let capacity = self.summary.capacity_items();
        let too_stale = self.stale as f64 > self.cfg.rebuild_stale_fraction * capacity as f64;
        let overfull = self.summary.inserted() > capacity + capacity / 2;
        if !(too_stale || overfull) {
            return Ok(false);
        }
        self.rebuild(self.summary.epoch() + 1)?;
        Ok(true)
    }

    /// Replaces the summary by a new epoch holding exactly the live set, each key under its
    /// current tier (so keys that changed tier shed their old tier's key).
    fn rebuild(&mut self, epoch: u64) -> Result<(), SummaryError> {
        // Size the new filter for what is live now, but never below the configured capacity.
        let items = self
            .cfg
            .capacity_blocks
            .max(self.entries.len())
            .clamp(1, MAX_CAPACITY_BLOCKS);
        let mut next = ReplicaSummary::new(epoch, items, &self.summary_cfg)?;
        let mut by_tier: [Vec<BlockKey>; 3] = Default::default();
        for (k, slot) in self.entries.iter().rev() {
            by_tier[slot.tier as usize].push(BlockKey(*k));
        }
        for (tier, keys) in Tier::ALL.into_iter().zip(&by_tier) {
            if !keys.is_empty() {
                next.insert_tier(keys, tier);
            }
        }
        self.summary = next;
        self.stale = 0;
        Ok(())
    }

    /// The live keys, least recently used first (what a handover to a new home sends, so the
    /// most recent end up most recent there too). Tiers are not sent: block reports carry plain
    /// keys, and the new home's approximate model counts them as GPU-held (its own exact model,
    /// once its event stream is up, replaces that with the engine's truth).
    pub fn live_keys(&self) -> Vec<BlockKey> {
        self.entries
            .iter()
            .rev()
            .map(|(k, _)| BlockKey(*k))
            .collect()
    }

    /// Starts a new epoch of at least `min_epoch`, rebuilt from the live set. A node that becomes
    /// a replica's home calls it so its summary supersedes whatever the previous home published
    /// (peers only pull newer versions) while keeping what this node itself routed there.
    pub fn restart_epoch(&mut self, min_epoch: u64) -> Result<(), SummaryError> {
        self.rebuild(min_epoch.max(self.summary.epoch() + 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(source: CacheSource, capacity: usize) -> CacheModel {
        CacheModel::new(
            source,
            10,
            CacheModelConfig::with_capacity(capacity),
            SummaryConfig::for_cluster("t"),
        )
        .unwrap()
    }

    fn ks(r: std::ops::Range<u64>) -> Vec<BlockKey> {
        r.map(BlockKey).collect()
    }

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_hostile_capacity_is_clamped_and_not_preallocated() {
        // usize::MAX blocks (a gossiped or scraped capacity of 2^64 tokens) builds a model
        // sized at the bound, and allocates nothing per block until keys arrive.
        let m = model(CacheSource::Approximate, usize::MAX);
        assert_eq!(m.summary().capacity_items(), MAX_CAPACITY_BLOCKS);
        assert!(
            m.summary().filter_bytes() < 8 << 20,
            "{}",
            m.summary().filter_bytes()
        );
        assert!(m.is_empty());
        let zero = model(CacheSource::Approximate, 0);
        assert_eq!(zero.summary().capacity_items(), 64);
    }

    #[test]
    fn restart_epoch_supersedes_and_keeps_live_keys() {
        let mut m = model(CacheSource::Approximate, 16);
        m.record_routed(&ks(0..4), S);
        let before = m.summary().epoch();
        m.restart_epoch(before + 100).unwrap();
        assert_eq!(m.summary().epoch(), before + 100);
        assert_eq!(m.summary().hit(&ks(0..4)), 4);
        m.restart_epoch(0).unwrap();
        assert_eq!(m.summary().epoch(), before + 101, "never goes back");
    }

    #[test]
    fn approximate_mode_evicts_least_recently_routed() {
        let mut m = model(CacheSource::Approximate, 4);
        m.record_routed(&ks(0..2), S);
        m.record_routed(&ks(10..12), 2 * S);
        m.record_routed(&ks(0..2), 3 * S); // touch the first prefix again
        m.record_routed(&ks(20..22), 4 * S); // evicts 10, 11
        assert!(m.contains(BlockKey(0)) && m.contains(BlockKey(20)));
        assert!(!m.contains(BlockKey(10)) && !m.contains(BlockKey(11)));
        assert_eq!(m.stale(), 2);
        // The filter still claims 10 until a new epoch sheds it.
        assert!(m.summary().contains(BlockKey(10)));
    }

    #[test]
    fn approximate_mode_evicts_chain_tails_first() {
        let mut m = model(CacheSource::Approximate, 4);
        m.record_routed(&ks(0..3), S);
        m.record_routed(&ks(10..12), 2 * S); // evicts the tail of the first chain, not its head
        assert!(m.contains(BlockKey(0)) && m.contains(BlockKey(1)));
        assert!(!m.contains(BlockKey(2)));
    }

    #[test]
    fn approximate_mode_expires_by_ttl() {
        let mut m = model(CacheSource::Approximate, 100);
        m.record_routed(&ks(0..3), S);
        m.record_routed(&ks(5..6), 500 * S);
        m.expire(602 * S);
        assert_eq!(m.len(), 1);
        assert!(m.contains(BlockKey(5)));
    }

    #[test]
    fn exact_mode_follows_events_and_rebuilds_on_stale() {
        let mut m = model(CacheSource::Exact, 64);
        let epoch = m.summary().epoch();
        m.store(&ks(0..40), S);
        m.remove(&ks(0..10));
        assert_eq!(m.stale(), 10);
        assert!(
            !m.maybe_rebuild(S).unwrap(),
            "10 stale of 64 is below the 25% threshold"
        );
        m.remove(&ks(10..20));
        assert!(m.maybe_rebuild(S).unwrap());
        assert_eq!(m.summary().epoch(), epoch + 1);
        assert_eq!(m.summary().hit(&ks(20..40)), 20);
        // Rebuilt from the live set: removed keys are gone (barring a false positive).
        assert_eq!(m.summary().hit(&ks(0..20)), 0);
        m.clear().unwrap();
        assert_eq!(m.summary().epoch(), epoch + 2);
        assert!(m.is_empty());
    }

    #[test]
    fn a_tier_change_is_a_stale_old_key_plus_a_new_one_until_the_rebuild() {
        let mut m = model(CacheSource::Exact, 64);
        m.store(&ks(0..40), S);
        // Offload: the first 20 blocks now live only in CPU memory.
        m.store_tier(&ks(0..20), Tier::Cpu, 2 * S);
        assert_eq!(m.tier(BlockKey(3)), Some(Tier::Cpu));
        assert_eq!(m.stale(), 20, "each GPU key left behind in the filter");
        assert!(m.summary().has_lower_tiers());
        // Until the rebuild, the filter still claims the GPU copy (the best tier it holds).
        assert_eq!(m.summary().tier_of(BlockKey(3)), Some(Tier::Gpu));
        assert!(m.maybe_rebuild(2 * S).unwrap(), "20 stale > 25% of 64");
        assert!((0..20).all(|k| m.summary().tier_of(BlockKey(k)) == Some(Tier::Cpu)));
        assert!((20..40).all(|k| m.summary().tier_of(BlockKey(k)) == Some(Tier::Gpu)));
        // Storing the same tier again is not a change; a reload to GPU is.
        m.store_tier(&ks(0..2), Tier::Cpu, 3 * S);
        assert_eq!(m.stale(), 0);
        m.store(&ks(0..2), 3 * S);
        assert_eq!(m.stale(), 2);
        // A new home's epoch keeps the tiers.
        m.restart_epoch(0).unwrap();
        assert_eq!(m.summary().tier_of(BlockKey(0)), Some(Tier::Gpu));
        assert_eq!(m.summary().tier_of(BlockKey(5)), Some(Tier::Cpu));
        m.remove(&ks(0..40));
        assert!(m.is_empty());
    }

    #[test]
    fn an_absurd_capacity_is_clamped_not_allocated() {
        // 10^15 blocks (a scraped or gossiped number) would preallocate petabytes.
        let m = model(CacheSource::Approximate, 1_000_000_000_000_000);
        assert_eq!(m.summary().capacity_items(), MAX_CAPACITY_BLOCKS);
        assert!(m.summary().filter_bytes() <= 8 << 20);
        let m = model(CacheSource::Exact, usize::MAX);
        assert_eq!(m.summary().capacity_items(), MAX_CAPACITY_BLOCKS);
    }

    /// The per-slot counts equal a recount of the live set's tags.
    fn assert_counts_match(m: &CacheModel) {
        let mut recount = [0u32; KV_SLOTS];
        for (_, slot) in m.entries.iter() {
            recount[slot.tenant as usize] += 1;
        }
        assert_eq!(recount, m.tenant_blocks);
    }

    #[test]
    fn blocks_belong_to_the_tenant_that_last_touched_them_and_leave_with_eviction() {
        const BIG: u8 = 2;
        const SMALL: u8 = 3;
        let mut m = model(CacheSource::Approximate, 10);
        m.record_routed_by(&ks(0..4), SMALL, S);
        assert_eq!(m.tenant_blocks(SMALL), 4);
        assert!((m.tenant_share(SMALL) - 0.4).abs() < 1e-9, "4 of 10 blocks");
        // The big tenant touches the small one's first two blocks (a shared prefix): they are
        // its now, since its requests are what keeps them resident.
        m.record_routed_by(&ks(0..2), BIG, 2 * S);
        assert_eq!((m.tenant_blocks(BIG), m.tenant_blocks(SMALL)), (2, 2));
        // Its new blocks evict the LRU ones, the small tenant's tail.
        m.record_routed_by(&ks(100..108), BIG, 3 * S);
        assert_eq!(m.len(), 10);
        assert_eq!((m.tenant_blocks(BIG), m.tenant_blocks(SMALL)), (10, 0));
        assert!((m.tenant_share(BIG) - 1.0).abs() < 1e-9);
        assert_counts_match(&m);
        // A peer's report has no tenant: it fills the cache but belongs to nobody, so the
        // shares are the known mix scaled by the fill.
        m.record_routed(&ks(200..205), 4 * S);
        assert_eq!(m.tenant_blocks(KV_UNATTRIBUTED), 5);
        assert!(
            (m.tenant_share(BIG) - 1.0).abs() < 1e-9,
            "all it knows is big's, cache full"
        );
        assert_eq!(m.tenant_share(KV_UNATTRIBUTED), 0.0);
        // TTL expiry releases the counts too.
        m.expire(1000 * S);
        assert!(m.is_empty());
        assert_eq!(m.tenant_blocks, [0; KV_SLOTS]);
        assert_eq!(m.tenant_share(BIG), 0.0);
    }

    #[test]
    fn exact_blocks_are_unattributed_until_a_routed_request_claims_them() {
        const T: u8 = 5;
        let mut m = model(CacheSource::Exact, 8);
        m.store(&ks(0..4), S);
        assert_eq!(m.tenant_blocks(KV_UNATTRIBUTED), 4);
        assert_eq!(m.tenant_share(T), 0.0);
        // The request that brought 0..3 and a block the engine has not reported (9).
        m.attribute(&[BlockKey(0), BlockKey(1), BlockKey(2), BlockKey(9)], T);
        assert_eq!(m.tenant_blocks(T), 3);
        assert!(!m.contains(BlockKey(9)), "a claim adds nothing");
        // 3 of the 4 blocks it knows the tenant of... 3 of 3 attributed, cache half full.
        assert!((m.tenant_share(T) - 0.5).abs() < 1e-9);
        // Known (say, from the home's summary) to be full: the same mix, a full cache.
        assert!((m.tenant_share_filled(T, 1.0) - 1.0).abs() < 1e-9);
        // An offload keeps the tenant; an eviction drops it; a clear resets everything.
        m.store_tier(&ks(0..1), Tier::Cpu, 2 * S);
        assert_eq!(m.tenant_blocks(T), 3);
        m.remove(&ks(1..2));
        assert_eq!(m.tenant_blocks(T), 2);
        assert_counts_match(&m);
        m.clear().unwrap();
        assert_eq!(m.tenant_blocks, [0; KV_SLOTS]);
    }

    #[test]
    fn ranks_follow_stores_and_tier_moves_and_give_each_rank_its_run() {
        let mut m = model(CacheSource::Exact, 64);
        let keys = ks(0..6);
        m.store(&keys, S);
        // Rank 0 holds the whole prompt, rank 2 the first two blocks.
        let mut sets: Vec<(BlockKey, u64)> = keys.iter().map(|k| (*k, 0b001)).collect();
        sets[0].1 |= 0b100;
        sets[1].1 |= 0b100;
        m.set_ranks(&sets);
        assert_eq!(m.rank_runs(&keys, 3), vec![6, 0, 2]);
        // An offload of block 5 keeps who holds it.
        m.store_tier(&keys[5..], Tier::Cpu, 2 * S);
        assert_eq!(m.ranks_of(keys[5]), 0b001);
        // Rank 0 loses its tail: rank 2's run is now the longer one of the two.
        m.set_ranks(&[(keys[2], 0), (keys[3], 0)]);
        assert_eq!(m.rank_runs(&keys, 3), vec![2, 0, 2]);
        // Keys not held take no rank set; removed keys hold none.
        m.set_ranks(&[(BlockKey(99), 1)]);
        assert_eq!(m.ranks_of(BlockKey(99)), 0);
        m.remove(&keys[..1]);
        assert_eq!(m.rank_runs(&keys, 3), vec![0, 0, 0]);
        // An approximate model knows no ranks.
        let mut a = model(CacheSource::Approximate, 64);
        a.record_routed(&keys, S);
        assert_eq!(a.rank_runs(&keys, 2), vec![0, 0]);
    }

    #[test]
    fn overfull_filter_starts_a_new_epoch() {
        let mut m = model(CacheSource::Exact, 64);
        m.store(&ks(0..100), S);
        assert!(m.maybe_rebuild(S).unwrap());
        assert_eq!(m.summary().capacity_items(), 100);
        assert_eq!(m.summary().hit(&ks(0..100)), 100);
    }
}
