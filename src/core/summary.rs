//! Replica summaries: what a node knows of a replica's prefix cache, in a few bytes per block.
//!
//! A summary is a Bloom filter over the block keys a replica holds, versioned by an `epoch` (a new
//! filter, rebuilt from the exact or LRU set to shed evicted keys) and a `seq` (bumped by every
//! batch of additions within the epoch). The home node owns the authoritative copy and keeps a
//! bounded log of additions, so peers can pull a small *delta* (keys added since their seq) instead
//! of the whole *snapshot* (filter bytes). Bloom filters never forget, so removals only count
//! towards the next epoch; a stale key costs at most one mis-scored routing decision.
//!
//! Every filter in a cluster uses one seed, so filters can be OR-ed and checked by any node.
//!
//! Tiers ride in the same filter: a block held in GPU memory is inserted under its own key; a
//! block held only in a lower tier (CPU offload, disk) under its *tier-salted* key
//! ([`Tier::summary_key`]: the key XOR a fixed per-tier constant). Deltas, snapshots, epochs and
//! versions are unchanged, and a reader that does not know tiers never matches a salted key, so it
//! simply sees the GPU-held blocks. `lower_tiers` (an optional, defaulted field of deltas and
//! snapshots, ignored by older readers) tells a reader whether salted keys are there at all, so
//! replicas without offload cost no extra probe. The flag is sticky within an epoch (an older,
//! overlapping delta cannot unset it), and the epoch's first lower-tier batch always bumps `seq`,
//! so peers pull the flag even when every salted key was already a false positive. During a
//! rolling upgrade an old node therefore sees only a replica's GPU-held blocks.
//!
//! Invariants: never a false negative; a delta applies only to its own epoch and only without a
//! gap; decoding a peer's message is bounded ([`MAX_SUMMARY_MESSAGE_BYTES`], [`MAX_DELTA_KEYS`],
//! [`MAX_BLOOM_HASHES`] hash functions, a non-empty bitmap, [`MAX_SNAPSHOT_ITEMS`]), refuses a
//! foreign Bloom seed, and returns an error rather than panicking.

use std::collections::VecDeque;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use bloomfilter::reexports::siphasher::sip::SipHasher13;
use bloomfilter::Bloom;
use serde::{Deserialize, Serialize};

use super::keys::BlockKey;

/// XOR-ed into a block key held only in CPU memory before it goes into a filter. Fixed forever
/// (every node of every version must agree): the first 64 bits of the fractional part of √2.
pub const CPU_SALT: u64 = 0x6A09_E667_F3BC_C908;
/// XOR-ed into a block key held only in disk (or other slow) storage: the first 64 bits of the
/// fractional part of √3.
pub const DISK_SALT: u64 = 0xBB67_AE85_84CA_A73B;

/// Where a replica holds a cached block, best (fastest to reuse) first. The derived order is
/// that ranking: `Gpu < Cpu < Disk`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// The engine's GPU block pool (an event `medium` of `"GPU"` or none).
    Gpu,
    /// Host memory (`"CPU"`): offloaded, reusable after a copy back.
    Cpu,
    /// Anything slower (`"DISK"`, `"SSD"`, connector names).
    Disk,
}

impl Tier {
    /// Every tier, best first.
    pub const ALL: [Tier; 3] = [Tier::Gpu, Tier::Cpu, Tier::Disk];

    /// The tier of a KV event's `medium` field (case-insensitive; none means GPU, as in vLLM).
    pub fn from_medium(medium: Option<&str>) -> Tier {
        match medium {
            None => Tier::Gpu,
            Some(m) if m.eq_ignore_ascii_case("gpu") => Tier::Gpu,
            Some(m) if m.eq_ignore_ascii_case("cpu") => Tier::Cpu,
            Some(_) => Tier::Disk,
        }
    }

    /// The key a block whose best tier is `self` is inserted under in a summary: the key itself
    /// for GPU, else the key XOR the tier's salt. Block keys are 64-bit hashes, so a salted key
    /// equals some other block's plain key with probability 2⁻⁶⁴.
    #[inline]
    pub fn summary_key(self, key: BlockKey) -> BlockKey {
        match self {
            Tier::Gpu => key,
            Tier::Cpu => BlockKey(key.0 ^ CPU_SALT),
            Tier::Disk => BlockKey(key.0 ^ DISK_SALT),
        }
    }
}

/// Upper bound on the encoded size of any summary message a node will decode (16 MiB).
pub const MAX_SUMMARY_MESSAGE_BYTES: usize = 16 << 20;
/// Upper bound on the keys of one delta: twice the home's addition log (65,536 keys by
/// default), since a pulled delta is applied under the node's lock.
pub const MAX_DELTA_KEYS: usize = 1 << 17;
/// Smallest filter capacity, so a tiny replica still gets a usable filter.
const MIN_CAPACITY_ITEMS: usize = 64;
/// Most hash functions a peer's filter may declare. Every probe of a lookup runs once per hash
/// function under the node's lock, so a peer's `k` is bounded: a false-positive rate of 1e-9
/// needs 30, the default 1% needs 7.
pub const MAX_BLOOM_HASHES: u32 = 64;
/// Most items a peer's snapshot may claim its filter was sized for (2^32: more than any bitmap
/// under [`MAX_SUMMARY_MESSAGE_BYTES`] can answer for).
pub const MAX_SNAPSHOT_ITEMS: u64 = 1 << 32;

/// How summaries are built; must be equal on every node of a cluster.
#[derive(Clone, Debug, PartialEq)]
pub struct SummaryConfig {
    /// Target false-positive rate at the filter's capacity. Default 0.01.
    pub fp_rate: f64,
    /// The cluster-wide Bloom seed. Default: derived from the cluster id.
    pub seed: [u8; 32],
    /// Additions kept for deltas; older peers get a snapshot. Default 65,536 keys.
    pub max_log_keys: usize,
}

impl SummaryConfig {
    /// The defaults, with the Bloom seed derived from a cluster id.
    pub fn for_cluster(cluster_id: &str) -> Self {
        let mut seed = [0u8; 32];
        for (i, chunk) in seed.chunks_exact_mut(8).enumerate() {
            let h = xxhash_rust::xxh3::xxh3_64_with_seed(cluster_id.as_bytes(), i as u64);
            chunk.copy_from_slice(&h.to_le_bytes());
        }
        SummaryConfig {
            fp_rate: 0.01,
            seed,
            max_log_keys: 65_536,
        }
    }
}

/// Errors building or applying a summary. Peers' bytes end here, never in a panic.
#[derive(Debug, thiserror::Error)]
pub enum SummaryError {
    /// The filter could not be created (bad size or rate).
    #[error("cannot build a Bloom filter for {items} items at fp rate {fp_rate}: {reason}")]
    Build {
        items: usize,
        fp_rate: f64,
        reason: &'static str,
    },
    /// Filter bytes do not parse.
    #[error("malformed Bloom filter bytes: {0}")]
    Filter(&'static str),
    /// A filter built with another seed cannot be checked or merged with ours.
    #[error("summary filter uses a different cluster seed")]
    SeedMismatch,
    /// The message is larger than we accept.
    #[error("summary message of {0} bytes exceeds the limit")]
    TooLarge(usize),
    /// A delta carries more keys than we accept.
    #[error("summary delta with {0} keys exceeds the limit")]
    TooManyKeys(usize),
    /// A peer's filter declares a geometry out of bounds (hash functions, bitmap size or items).
    #[error("summary filter out of bounds: {0}")]
    Bounds(String),
    /// msgpack decoding failed.
    #[error("malformed summary message: {0}")]
    Decode(#[from] rmp_serde::decode::Error),
    /// msgpack encoding failed.
    #[error("cannot encode summary message: {0}")]
    Encode(#[from] rmp_serde::encode::Error),
    /// A delta that does not continue this summary (other epoch, or a gap in seq).
    #[error("delta epoch {delta_epoch} seq {from_seq}..{to_seq} does not apply to epoch {epoch} seq {seq}")]
    DeltaMismatch {
        epoch: u64,
        seq: u64,
        delta_epoch: u64,
        from_seq: u64,
        to_seq: u64,
    },
}

/// Keys added between two sequence numbers of one epoch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SummaryDelta {
    /// Epoch the keys belong to.
    pub epoch: u64,
    /// The receiver's seq this delta continues.
    pub from_seq: u64,
    /// The seq after applying it.
    pub to_seq: u64,
    /// The added keys (tier-salted for blocks held only in a lower tier).
    pub keys: Vec<u64>,
    /// Whether the home's filter holds tier-salted keys at `to_seq`. Added after version 1 of
    /// the schema: absent (older homes, which never salt) reads as false.
    #[serde(default)]
    pub lower_tiers: bool,
}

/// A whole filter.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SummarySnapshot {
    /// Epoch of the filter.
    pub epoch: u64,
    /// Seq of the filter.
    pub seq: u64,
    /// Items the filter was sized for.
    pub capacity_items: u64,
    /// `bloomfilter` 3 serialization (header with seed, then bits).
    #[serde(with = "serde_bytes")]
    pub filter: Vec<u8>,
    /// Whether the filter holds tier-salted keys. Absent (older homes) reads as false.
    #[serde(default)]
    pub lower_tiers: bool,
}

/// What travels on a summary stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum SummaryMessage {
    /// Keys since the requester's seq.
    Delta(SummaryDelta),
    /// The whole filter.
    Snapshot(SummarySnapshot),
}

impl SummaryMessage {
    /// msgpack with field names, so nodes of different versions can read each other.
    pub fn encode(&self) -> Result<Vec<u8>, SummaryError> {
        Ok(rmp_serde::to_vec_named(self)?)
    }

    /// Decodes a peer's bytes, refusing oversized input before parsing it.
    pub fn decode(bytes: &[u8]) -> Result<Self, SummaryError> {
        if bytes.len() > MAX_SUMMARY_MESSAGE_BYTES {
            return Err(SummaryError::TooLarge(bytes.len()));
        }
        let msg: SummaryMessage = rmp_serde::from_slice(bytes)?;
        if let SummaryMessage::Delta(d) = &msg {
            if d.keys.len() > MAX_DELTA_KEYS {
                return Err(SummaryError::TooManyKeys(d.keys.len()));
            }
        }
        Ok(msg)
    }
}

/// `bloomfilter` 3's serialized header: version, bitmap length, k, seed.
const BLOOM_HEADER_BYTES: usize = 1 + 8 + 4 + 32;
/// The prime `bloomfilter` 3 reduces its derived hashes by.
const BLOOM_PRIME: u64 = 0xFFFF_FFFF_FFFF_FFC5;

/// A key's two filter hashes. Every filter of a cluster shares one seed, so these are the same
/// for every replica's filter: a router computes them once per key and request, not once per
/// key, request and replica (two SipHash rounds saved per probe).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyHashes([u64; 2]);

impl KeyHashes {
    /// The `i`-th derived hash, as `bloomfilter` 3 computes it: `h0`, `h1`, then
    /// `(h0 + i·h1) mod p`.
    #[inline]
    fn derived(self, i: u32) -> u64 {
        let [h0, h1] = self.0;
        match i {
            0 => h0,
            1 => h1,
            _ => h0.wrapping_add(u64::from(i).wrapping_mul(h1)) % BLOOM_PRIME,
        }
    }
}

/// What decides where a key's probes land in a filter: the bitmap's size in bits and the number
/// of hash functions. Every filter of a cluster shares one seed, so filters of equal geometry
/// (in practice: replicas sized alike) read a key at the very same bit positions. A router
/// computes those positions once per key and request ([`FilterGeometry::probe_positions`]) and
/// then tests each replica's filter with loads alone ([`ReplicaSummary::contains_positions`])
/// instead of one 64-bit division by the bitmap size per position, per replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FilterGeometry {
    /// Bits of the bitmap (never 0 for a filter that answers anything).
    bits: u64,
    /// Hash functions, i.e. probes per key.
    hashes: u32,
}

impl FilterGeometry {
    /// The geometry of `filter`.
    fn of(filter: &Bloom<u64>) -> Self {
        FilterGeometry {
            bits: filter.len(),
            hashes: filter.number_of_hash_functions(),
        }
    }

    /// Probes per key.
    #[inline]
    pub fn hashes(self) -> u32 {
        self.hashes
    }

    /// Bits of the bitmap: every probe position is below it.
    #[inline]
    pub fn bit_len(self) -> u64 {
        self.bits
    }

    /// Writes the bit positions `h` probes in filters of this geometry into `out`, one per hash
    /// function, in the filter's own probe order. Returns false, writing nothing useful, when
    /// `out` is not exactly [`FilterGeometry::hashes`] long or a position does not fit in a
    /// `u32` (a bitmap over 512 MiB): the caller then probes with [`ReplicaSummary::contains_hashed`].
    #[inline]
    pub fn probe_positions(self, h: KeyHashes, out: &mut [u32]) -> bool {
        if self.bits == 0 || out.len() != self.hashes as usize {
            return false;
        }
        for (i, slot) in (0u32..).zip(out.iter_mut()) {
            match u32::try_from(h.derived(i) % self.bits) {
                Ok(p) => *slot = p,
                Err(_) => return false,
            }
        }
        true
    }
}

/// Computes [`KeyHashes`] exactly as `bloomfilter` 3 hashes a `u64` for a filter with `seed`.
#[derive(Clone, Debug)]
pub struct KeyHasher {
    sips: [SipHasher13; 2],
    seed_id: u64,
}

fn seed_id(seed: &[u8; 32]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(seed)
}

impl KeyHasher {
    /// The hasher of filters built with `seed`.
    pub fn new(seed: &[u8; 32]) -> Self {
        let mut k1 = [0u8; 16];
        let mut k2 = [0u8; 16];
        k1.copy_from_slice(&seed[..16]);
        k2.copy_from_slice(&seed[16..]);
        KeyHasher {
            sips: [
                SipHasher13::new_with_key(&k1),
                SipHasher13::new_with_key(&k2),
            ],
            seed_id: seed_id(seed),
        }
    }

    /// The two hashes of `key`.
    #[inline]
    pub fn hash(&self, key: BlockKey) -> KeyHashes {
        let h = |i: usize| {
            let mut sip = self.sips[i];
            key.0.hash(&mut sip);
            sip.finish()
        };
        KeyHashes([h(0), h(1)])
    }

    /// Fingerprint of the seed, to match against [`ReplicaSummary::seed_id`].
    pub fn seed_id(&self) -> u64 {
        self.seed_id
    }
}

/// A filter's bitmap ([`ReplicaSummary::bits`]).
#[derive(Clone, Copy, Debug)]
pub struct FilterBits<'a>(&'a [u8]);

impl FilterBits<'_> {
    /// [`ReplicaSummary::contains_positions`]: whether every position's bit is set (false past
    /// the end).
    #[inline]
    pub fn contains_positions(self, positions: &[u32]) -> bool {
        // Seven hash functions is what the default fp rate (1%) gives. That case unrolled: in a
        // loop, its bookkeeping was a third of the instructions of a probe.
        match <&[u32; 7]>::try_from(positions) {
            Ok(&[a, b, c, d, e, f, g]) => {
                self.is_set(a)
                    && self.is_set(b)
                    && self.is_set(c)
                    && self.is_set(d)
                    && self.is_set(e)
                    && self.is_set(f)
                    && self.is_set(g)
            }
            Err(_) => positions.iter().all(|&p| self.is_set(p)),
        }
    }

    /// Whether bit `p` is set (false past the end).
    #[inline(always)]
    fn is_set(self, p: u32) -> bool {
        self.0
            .get((p >> 3) as usize)
            .is_some_and(|b| (b >> (p & 7)) & 1 != 0)
    }
}

/// A hold on one summary's filter, for an index built from its bits (`summary_slices.rs`).
/// The filter is shared copy-on-write, so while a handle is held those bits never change: a
/// summary whose filter is [`FilterHandle::is_of`] the handle's has exactly the bits it had
/// when the handle was taken.
#[derive(Clone, Debug)]
pub struct FilterHandle(Arc<Bloom<u64>>);

impl FilterHandle {
    /// Whether `summary`'s filter is this very one (same bits, same seed and geometry).
    #[inline]
    pub fn is_of(&self, summary: &ReplicaSummary) -> bool {
        Arc::ptr_eq(&self.0, &summary.filter)
    }

    /// Whether two handles hold the very same filter.
    pub fn same(&self, other: &FilterHandle) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// The filter's bitmap (`bloomfilter` 3's bit order: bit `p` is bit `p % 8` of byte `p / 8`).
    pub fn bitmap(&self) -> &[u8] {
        self.0.as_slice().get(BLOOM_HEADER_BYTES..).unwrap_or(&[])
    }
}

/// Whether bit `bit` of `bitmap` is set (`bloomfilter` 3's bit order: LSB first); false past the
/// end.
#[inline]
fn bit_is_set(bitmap: &[u8], bit: u64) -> bool {
    usize::try_from(bit / 8)
        .ok()
        .and_then(|byte| bitmap.get(byte))
        .is_some_and(|b| b & (1 << (bit % 8)) != 0)
}

/// One replica's summary: the filter, its version, and (on the home node) the addition log.
///
/// The filter is shared copy-on-write: [`ReplicaSummary::routing_copy`] (what a home puts in
/// its view every publish) shares it and leaves the log behind — routing never reads the log,
/// up to 1 MiB of it — and the first insert after that copies the filter alone, once.
#[derive(Clone, Debug)]
pub struct ReplicaSummary {
    epoch: u64,
    seq: u64,
    capacity_items: usize,
    filter: Arc<Bloom<u64>>,
    /// Additions of this epoch as (seq, key), oldest first; trimmed to `max_log_keys`.
    log: VecDeque<(u64, u64)>,
    /// Deltas can be served to peers whose seq is at least this.
    log_floor: u64,
    /// Distinct keys inserted this epoch (drives the home's rebuild decision); on a peer's copy,
    /// estimated from the snapshot's set bits plus the deltas' new keys.
    inserted: usize,
    max_log_keys: usize,
    /// Fingerprint of the filter's seed (see [`KeyHasher::seed_id`]).
    seed_id: u64,
    /// Whether a tier-salted key went in this epoch (sticky until the next epoch, like the
    /// filter's bits). False means every key is a GPU key, and a hit needs no tier probes.
    lower_tiers: bool,
    /// The filter's probe geometry, fixed for its life (read on every probe of a decision).
    geometry: FilterGeometry,
}

impl ReplicaSummary {
    /// An empty summary sized for `capacity_items` keys.
    pub fn new(
        epoch: u64,
        capacity_items: usize,
        cfg: &SummaryConfig,
    ) -> Result<Self, SummaryError> {
        let items = capacity_items.max(MIN_CAPACITY_ITEMS);
        let filter =
            Bloom::new_for_fp_rate_with_seed(items, cfg.fp_rate, &cfg.seed).map_err(|reason| {
                SummaryError::Build {
                    items,
                    fp_rate: cfg.fp_rate,
                    reason,
                }
            })?;
        let geometry = FilterGeometry::of(&filter);
        Ok(ReplicaSummary {
            epoch,
            seq: 0,
            capacity_items: items,
            filter: Arc::new(filter),
            log: VecDeque::new(),
            log_floor: 0,
            inserted: 0,
            max_log_keys: cfg.max_log_keys,
            seed_id: seed_id(&cfg.seed),
            lower_tiers: false,
            geometry,
        })
    }

    /// A follower's copy from a snapshot; its seed must be the cluster's.
    pub fn from_snapshot(s: &SummarySnapshot, cfg: &SummaryConfig) -> Result<Self, SummaryError> {
        let filter = Bloom::from_slice(&s.filter).map_err(SummaryError::Filter)?;
        if filter.seed() != cfg.seed {
            return Err(SummaryError::SeedMismatch);
        }
        // A peer's geometry is bounded before anything probes it: `k` probes per lookup run
        // under the node's lock, and an empty bitmap has nothing to probe.
        let k = filter.number_of_hash_functions();
        if !(1..=MAX_BLOOM_HASHES).contains(&k) {
            return Err(SummaryError::Bounds(format!(
                "{k} hash functions (1..={MAX_BLOOM_HASHES})"
            )));
        }
        // (Bloom's `is_empty` means "nothing inserted", not "no bits".)
        let bits = filter.len();
        if bits == 0 {
            return Err(SummaryError::Bounds("an empty bitmap".into()));
        }
        if s.capacity_items > MAX_SNAPSHOT_ITEMS {
            return Err(SummaryError::Bounds(format!(
                "{} items (at most {MAX_SNAPSHOT_ITEMS})",
                s.capacity_items
            )));
        }
        let geometry = FilterGeometry::of(&filter);
        // How full the replica's cache is, for a peer's copy too (`CostModel::cache_fill`).
        let inserted = estimated_keys(
            filter.as_slice().get(BLOOM_HEADER_BYTES..).unwrap_or(&[]),
            bits,
            k,
        );
        Ok(ReplicaSummary {
            epoch: s.epoch,
            seq: s.seq,
            capacity_items: usize::try_from(s.capacity_items).unwrap_or(usize::MAX),
            filter: Arc::new(filter),
            log: VecDeque::new(),
            log_floor: s.seq,
            inserted,
            max_log_keys: cfg.max_log_keys,
            seed_id: seed_id(&cfg.seed),
            lower_tiers: s.lower_tiers,
            geometry,
        })
    }

    /// Current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Current sequence number within the epoch.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Items the filter was sized for.
    pub fn capacity_items(&self) -> usize {
        self.capacity_items
    }

    /// Distinct keys inserted this epoch: counted on the home node, estimated on a peer's copy
    /// (from the snapshot's set bits, then counted through deltas).
    pub fn inserted(&self) -> usize {
        self.inserted
    }

    /// How full the replica's cache is believed to be, 0..=1: the distinct keys taken this
    /// epoch over the blocks the replica holds (0 for no capacity). At 1 a prefix recomputed
    /// there evicts as many blocks as it writes. The count includes keys the replica has since
    /// evicted (until the next epoch, which starts a quarter stale): it reads a full cache as
    /// full, and a draining one as fuller than it is.
    pub fn fill(&self) -> f64 {
        if self.capacity_items == 0 {
            return 0.0;
        }
        (self.inserted as f64 / self.capacity_items as f64).clamp(0.0, 1.0)
    }

    /// Whether the filter holds tier-salted keys (blocks held only in CPU or disk).
    #[inline]
    pub fn has_lower_tiers(&self) -> bool {
        self.lower_tiers
    }

    /// The best tier the filter (probably) holds `key` in, checking GPU, then CPU, then disk.
    /// A GPU key made stale by an offload still answers GPU until the next epoch.
    pub fn tier_of(&self, key: BlockKey) -> Option<Tier> {
        Tier::ALL
            .into_iter()
            .find(|t| self.filter.check(&t.summary_key(key).0))
    }

    /// Size of the filter's bitmap in bytes.
    pub fn filter_bytes(&self) -> usize {
        (self.filter.len() / 8) as usize
    }

    /// Whether the filter (probably) holds `key`.
    #[inline]
    pub fn contains(&self, key: BlockKey) -> bool {
        self.filter.check(&key.0)
    }

    /// A hasher for this filter's seed.
    pub fn key_hasher(&self) -> KeyHasher {
        KeyHasher::new(&self.filter.seed())
    }

    /// Fingerprint of the filter's seed.
    pub fn seed_id(&self) -> u64 {
        self.seed_id
    }

    /// The same answer as [`ReplicaSummary::contains`] for a key hashed by a [`KeyHasher`] of this
    /// filter's seed: the probes `bloomfilter` 3 makes (`h0`, `h1`, then `(h0 + i·h1) mod p`, each
    /// mod the bitmap's bits), on its serialized bitmap. Tested against `contains`.
    #[inline]
    pub fn contains_hashed(&self, h: KeyHashes) -> bool {
        let bits = self.bitmap();
        let nbits = self.filter.len();
        if nbits == 0 {
            return false;
        }
        (0..self.filter.number_of_hash_functions()).all(|i| {
            let bit = h.derived(i) % nbits;
            bit_is_set(bits, bit)
        })
    }

    /// This filter's probe geometry: filters of equal geometry read a key at equal positions.
    #[inline]
    pub fn geometry(&self) -> FilterGeometry {
        self.geometry
    }

    /// The same answer as [`ReplicaSummary::contains_hashed`] for positions that
    /// [`FilterGeometry::probe_positions`] wrote for this filter's [`geometry`](Self::geometry):
    /// whether every position's bit is set. Loads and bit tests only, no division.
    #[inline]
    pub fn contains_positions(&self, positions: &[u32]) -> bool {
        self.bits().contains_positions(positions)
    }

    /// The filter's bitmap, to test many memoised positions against without going through the
    /// filter each time.
    #[inline]
    pub fn bits(&self) -> FilterBits<'_> {
        FilterBits(self.bitmap())
    }

    /// A hold on this summary's filter (see [`FilterHandle`]).
    pub fn filter_handle(&self) -> FilterHandle {
        FilterHandle(Arc::clone(&self.filter))
    }

    /// The filter's bitmap: its serialized form past the header.
    #[inline]
    fn bitmap(&self) -> &[u8] {
        self.filter
            .as_slice()
            .get(BLOOM_HEADER_BYTES..)
            .unwrap_or(&[])
    }

    /// The copy routing reads (a home's view copy): the filter shared, not copied, and no
    /// addition log (it serves peers' deltas, which only the home's own model answers).
    pub fn routing_copy(&self) -> Self {
        ReplicaSummary {
            epoch: self.epoch,
            seq: self.seq,
            capacity_items: self.capacity_items,
            filter: Arc::clone(&self.filter),
            log: VecDeque::new(),
            log_floor: self.seq,
            inserted: self.inserted,
            max_log_keys: self.max_log_keys,
            seed_id: self.seed_id,
            lower_tiers: self.lower_tiers,
            geometry: self.geometry,
        }
    }

    /// Number of leading `keys` the filter holds, stopping at the first miss.
    pub fn hit(&self, keys: &[BlockKey]) -> usize {
        keys.iter().take_while(|k| self.filter.check(&k.0)).count()
    }

    /// Adds GPU-held keys as one batch: one seq bump if anything was new. Returns the number of
    /// new keys.
    pub fn insert(&mut self, keys: &[BlockKey]) -> usize {
        self.insert_tier(keys, Tier::Gpu)
    }

    /// Adds keys whose best tier is `tier` (salted by [`Tier::summary_key`]) as one batch: one
    /// seq bump if anything was new — or if this is the epoch's first lower-tier batch, so
    /// peers pull the `lower_tiers` flag even when every salted key was already a false
    /// positive. Returns the number of new keys.
    pub fn insert_tier(&mut self, keys: &[BlockKey], tier: Tier) -> usize {
        let next = self.seq + 1;
        let mut added = 0;
        for k in keys {
            let k = tier.summary_key(*k);
            // Checked first: a batch of known keys never copies a shared filter.
            if !self.filter.check(&k.0) {
                Arc::make_mut(&mut self.filter).set(&k.0);
                added += 1;
                self.log.push_back((next, k.0));
            }
        }
        let flag_flips = tier != Tier::Gpu && !keys.is_empty() && !self.lower_tiers;
        if flag_flips {
            self.lower_tiers = true;
        }
        if added > 0 || flag_flips {
            self.seq = next;
            self.inserted += added;
            while self.log.len() > self.max_log_keys {
                if let Some((s, _)) = self.log.pop_front() {
                    // Entries of seq `s` may be partly gone: only peers past `s` can get a delta.
                    self.log_floor = self.log_floor.max(s);
                }
            }
        }
        added
    }

    /// Keys added after `since` in this epoch, or `None` when the log no longer reaches back that
    /// far (or `since` is from the future) and the peer needs a snapshot.
    pub fn delta_since(&self, since: u64) -> Option<SummaryDelta> {
        if since < self.log_floor || since > self.seq {
            return None;
        }
        let start = self.log.partition_point(|(s, _)| *s <= since);
        Some(SummaryDelta {
            epoch: self.epoch,
            from_seq: since,
            to_seq: self.seq,
            keys: self.log.range(start..).map(|(_, k)| *k).collect(),
            lower_tiers: self.lower_tiers,
        })
    }

    /// The whole filter.
    pub fn snapshot(&self) -> SummarySnapshot {
        SummarySnapshot {
            epoch: self.epoch,
            seq: self.seq,
            capacity_items: self.capacity_items as u64,
            filter: self.filter.to_bytes(),
            lower_tiers: self.lower_tiers,
        }
    }

    /// The answer to a peer at (`epoch`, `seq`): a delta when possible, else a snapshot.
    pub fn answer(&self, epoch: u64, seq: u64) -> SummaryMessage {
        if epoch == self.epoch {
            if let Some(d) = self.delta_since(seq) {
                return SummaryMessage::Delta(d);
            }
        }
        SummaryMessage::Snapshot(self.snapshot())
    }

    /// Applies a delta pulled from the home node. Overlapping deltas are fine (inserts are
    /// idempotent); a gap or another epoch is an error and the caller pulls a snapshot.
    pub fn apply_delta(&mut self, d: &SummaryDelta) -> Result<(), SummaryError> {
        if d.epoch != self.epoch || d.from_seq > self.seq {
            return Err(SummaryError::DeltaMismatch {
                epoch: self.epoch,
                seq: self.seq,
                delta_epoch: d.epoch,
                from_seq: d.from_seq,
                to_seq: d.to_seq,
            });
        }
        let filter = Arc::make_mut(&mut self.filter);
        for k in &d.keys {
            if !filter.check(k) {
                self.inserted += 1;
            }
            filter.set(k);
        }
        // Sticky within an epoch, like the bits: an overlapping older delta cannot unset it.
        self.lower_tiers |= d.lower_tiers;
        self.seq = self.seq.max(d.to_seq);
        Ok(())
    }

    /// Applies any summary message; a snapshot replaces the filter.
    pub fn apply(&mut self, msg: &SummaryMessage, cfg: &SummaryConfig) -> Result<(), SummaryError> {
        match msg {
            SummaryMessage::Delta(d) => self.apply_delta(d),
            SummaryMessage::Snapshot(s) => {
                *self = ReplicaSummary::from_snapshot(s, cfg)?;
                Ok(())
            }
        }
    }

    /// A short fingerprint of the filter contents (for gossip and for spotting divergence).
    pub fn digest(&self) -> u64 {
        xxhash_rust::xxh3::xxh3_64(self.filter.as_slice())
    }
}

/// Distinct keys a Bloom filter of `bits` bits probed `hashes` times per key holds, estimated
/// from the share of its bits set (Swamidass and Baldi: `n = −(m/k)·ln(1 − X/m)`). One pass over
/// the bitmap, once per snapshot.
fn estimated_keys(bitmap: &[u8], bits: u64, hashes: u32) -> usize {
    if bits == 0 || hashes == 0 {
        return 0;
    }
    let set: u64 = bitmap.iter().map(|b| u64::from(b.count_ones())).sum();
    let m = bits as f64;
    let empty = (1.0 - set as f64 / m).max(1.0 / m);
    let n = -(m / f64::from(hashes)) * empty.ln();
    // A float past usize saturates (`as`), NaN reads 0.
    n.round() as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_peers_copy_knows_about_how_many_keys_the_home_holds() {
        let cfg = SummaryConfig::for_cluster("c");
        let mut home = ReplicaSummary::new(1, 1_000, &cfg).expect("a summary");
        let keys: Vec<BlockKey> = (0..1_000).map(BlockKey).collect();
        home.insert(&keys[..600]);
        let mut copy = ReplicaSummary::from_snapshot(&home.snapshot(), &cfg).expect("decodes");
        let n = copy.inserted() as f64;
        assert!(
            (n - home.inserted() as f64).abs() < 30.0,
            "{n} vs {}",
            home.inserted()
        );
        // Deltas count their new keys.
        let seq = home.seq();
        home.insert(&keys[600..900]);
        let d = home.delta_since(seq).expect("a delta");
        copy.apply_delta(&d).expect("applies");
        let n = copy.inserted() as f64;
        assert!(
            (n - home.inserted() as f64).abs() < 40.0,
            "{n} vs {}",
            home.inserted()
        );
    }

    fn cfg() -> SummaryConfig {
        SummaryConfig::for_cluster("test")
    }

    #[test]
    fn a_routing_copy_shares_the_filter_and_leaves_the_log() {
        let mut s = ReplicaSummary::new(1, 1000, &cfg()).unwrap();
        s.insert(&keys(0..10));
        let copy = s.routing_copy();
        assert!(Arc::ptr_eq(&s.filter, &copy.filter));
        assert!(copy.log.is_empty() && s.log.len() == 10);
        assert_eq!(
            (copy.epoch(), copy.seq(), copy.hit(&keys(0..10))),
            (1, s.seq(), 10)
        );
        // Known keys copy nothing; a new key copies the filter once, and the copy keeps its bits.
        s.insert(&keys(0..10));
        assert!(Arc::ptr_eq(&s.filter, &copy.filter));
        s.insert(&keys(10..11));
        assert!(!Arc::ptr_eq(&s.filter, &copy.filter));
        assert_eq!((s.hit(&keys(0..11)), copy.hit(&keys(0..11))), (11, 10));
        // A copy answers no deltas: only the home's own model does.
        assert!(copy.delta_since(0).is_none());
    }

    /// The routing lock's share of a summary publish and of a pulled snapshot, before and after
    /// (issue #35). Before: the view copy was `clone()` (filter + up to 65,536 logged keys) and
    /// a snapshot's filter was built under the lock. After: `routing_copy()` (filter shared, no
    /// log) plus the one filter copy the next new key makes; the snapshot is built outside.
    /// `cargo test --lib routing_lock_share -- --ignored --nocapture` (timings, not asserted).
    #[test]
    #[ignore]
    fn routing_lock_share_of_a_publish() {
        use std::hint::black_box;
        use std::time::Instant;
        let mut s = ReplicaSummary::new(1, 1 << 17, &cfg()).unwrap();
        for chunk in keys(0..100_000).chunks(64) {
            s.insert(chunk);
        }
        let n = 40u32;
        let per = |f: &mut dyn FnMut()| {
            let t = Instant::now();
            for _ in 0..n {
                f();
            }
            t.elapsed() / n
        };
        let deep = per(&mut || drop(black_box(s.clone())));
        let shared = per(&mut || drop(black_box(s.routing_copy())));
        let mut next = 1u64 << 40;
        let cow = per(&mut || {
            let held = s.routing_copy();
            next += 1;
            s.insert(&[BlockKey(next)]);
            drop(black_box(held));
        });
        let plain_insert = per(&mut || {
            next += 1;
            s.insert(&[BlockKey(next)]);
        });
        let snap = s.snapshot();
        let build = per(&mut || drop(black_box(ReplicaSummary::from_snapshot(&snap, &cfg()))));
        println!(
            "filter {} B, log {} keys: publish copy before {deep:?}, after {shared:?}; \
             first insert after a publish {cow:?} (an insert otherwise {plain_insert:?}); \
             snapshot build (was under the lock, now outside) {build:?}",
            s.filter_bytes(),
            s.log.len()
        );
    }

    fn keys(range: std::ops::Range<u64>) -> Vec<BlockKey> {
        range
            .map(|i| BlockKey(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
            .collect()
    }

    #[test]
    fn hit_counts_leading_keys_only() {
        let mut s = ReplicaSummary::new(1, 1000, &cfg()).unwrap();
        let k = keys(0..10);
        s.insert(&k[..5]);
        s.insert(&k[6..]);
        assert_eq!(s.hit(&k), 5);
        assert_eq!(s.hit(&k[6..]), 4);
        assert_eq!(s.hit(&[]), 0);
    }

    #[test]
    fn a_snapshot_claiming_billions_of_hash_functions_is_refused() {
        let s = ReplicaSummary::new(1, 100, &cfg()).unwrap();
        let mut snap = s.snapshot();
        // bloomfilter 3's header: version u8, bitmap length u64 LE, then k u32 LE.
        for k in [u32::MAX, MAX_BLOOM_HASHES + 1, 0] {
            snap.filter[9..13].copy_from_slice(&k.to_le_bytes());
            assert!(
                matches!(
                    ReplicaSummary::from_snapshot(&snap, &cfg()),
                    Err(SummaryError::Bounds(_) | SummaryError::Filter(_))
                ),
                "k = {k}"
            );
        }
        snap.filter[9..13].copy_from_slice(&MAX_BLOOM_HASHES.to_le_bytes());
        assert!(ReplicaSummary::from_snapshot(&snap, &cfg()).is_ok());
    }

    #[test]
    fn follower_catches_up_by_delta_then_snapshot() {
        let c = SummaryConfig {
            max_log_keys: 8,
            ..cfg()
        };
        let mut home = ReplicaSummary::new(3, 1000, &c).unwrap();
        let mut peer = ReplicaSummary::from_snapshot(&home.snapshot(), &c).unwrap();
        home.insert(&keys(0..4));
        home.insert(&keys(4..6));
        let msg = home.answer(peer.epoch(), peer.seq());
        assert!(matches!(msg, SummaryMessage::Delta(ref d) if d.keys.len() == 6));
        peer.apply(&SummaryMessage::decode(&msg.encode().unwrap()).unwrap(), &c)
            .unwrap();
        assert_eq!(peer.seq(), home.seq());
        assert_eq!(peer.hit(&keys(0..6)), 6);
        // The log keeps 8 keys: a peer at seq 2 can no longer get a delta.
        home.insert(&keys(6..16));
        assert!(home.delta_since(2).is_none());
        assert!(matches!(home.answer(3, 2), SummaryMessage::Snapshot(_)));
        // Another epoch always gets a snapshot.
        assert!(matches!(
            home.answer(2, home.seq()),
            SummaryMessage::Snapshot(_)
        ));
        peer.apply(&home.answer(3, 2), &c).unwrap();
        assert_eq!(peer.digest(), home.digest());
        // A delta with a gap is refused.
        let gap = SummaryDelta {
            epoch: 3,
            from_seq: 99,
            to_seq: 100,
            keys: vec![],
            lower_tiers: false,
        };
        assert!(peer.apply_delta(&gap).is_err());
    }

    #[test]
    fn foreign_seed_and_garbage_are_refused() {
        let other = ReplicaSummary::new(1, 100, &SummaryConfig::for_cluster("other")).unwrap();
        assert!(matches!(
            ReplicaSummary::from_snapshot(&other.snapshot(), &cfg()),
            Err(SummaryError::SeedMismatch)
        ));
        let bad = SummarySnapshot {
            epoch: 1,
            seq: 1,
            capacity_items: 1,
            filter: vec![1, 2, 3],
            lower_tiers: false,
        };
        assert!(ReplicaSummary::from_snapshot(&bad, &cfg()).is_err());
        assert!(SummaryMessage::decode(&[0xc1, 0xff, 0x00]).is_err());
        // A peer's `k` is bounded (the header's bytes 9..13, little-endian): 2^32 - 1 probes per
        // lookup under the node's lock is refused, and so is 0.
        let good = ReplicaSummary::new(1, 100, &cfg()).unwrap().snapshot();
        for k in [0u32, MAX_BLOOM_HASHES + 1, u32::MAX] {
            let mut hostile = good.clone();
            hostile.filter[9..13].copy_from_slice(&k.to_le_bytes());
            let r = ReplicaSummary::from_snapshot(&hostile, &cfg());
            assert!(r.is_err(), "k = {k}");
            if k > 0 {
                assert!(matches!(r, Err(SummaryError::Bounds(_))), "k = {k}");
            }
        }
        let mut at_bound = good.clone();
        at_bound.filter[9..13].copy_from_slice(&MAX_BLOOM_HASHES.to_le_bytes());
        assert!(ReplicaSummary::from_snapshot(&at_bound, &cfg()).is_ok());
        // An empty bitmap and an absurd item count are refused too.
        let mut empty = good.clone();
        empty.filter.truncate(BLOOM_HEADER_BYTES);
        empty.filter[1..9].copy_from_slice(&0u64.to_le_bytes());
        assert!(ReplicaSummary::from_snapshot(&empty, &cfg()).is_err());
        // A delta is bounded to twice what a home's log can hold.
        assert!(cfg().max_log_keys * 2 <= MAX_DELTA_KEYS);
        let huge = SummaryMessage::Delta(SummaryDelta {
            epoch: 1,
            from_seq: 0,
            to_seq: 1,
            keys: vec![7; MAX_DELTA_KEYS + 1],
            lower_tiers: false,
        });
        assert!(matches!(
            SummaryMessage::decode(&huge.encode().unwrap()),
            Err(SummaryError::TooManyKeys(_))
        ));
        let mut items = good.clone();
        items.capacity_items = u64::MAX;
        assert!(matches!(
            ReplicaSummary::from_snapshot(&items, &cfg()),
            Err(SummaryError::Bounds(_))
        ));
        assert!(matches!(
            SummaryMessage::decode(&vec![0u8; MAX_SUMMARY_MESSAGE_BYTES + 1]),
            Err(SummaryError::TooLarge(_))
        ));
    }

    #[test]
    fn false_positive_rate_within_one_and_a_half_times_target() {
        for (items, fp) in [(10_000usize, 0.01), (5_000, 0.05)] {
            let c = SummaryConfig {
                fp_rate: fp,
                ..cfg()
            };
            let mut s = ReplicaSummary::new(1, items, &c).unwrap();
            s.insert(&keys(0..items as u64));
            let probes = 200_000u64;
            let fps = keys(1_000_000..1_000_000 + probes)
                .iter()
                .filter(|k| s.contains(**k))
                .count();
            let rate = fps as f64 / probes as f64;
            assert!(rate <= fp * 1.5, "measured fp {rate} for target {fp}");
        }
    }

    #[test]
    fn hashed_probes_answer_like_the_filter() {
        for (cap, fp) in [(64usize, 0.01), (7_000, 0.01), (50_000, 0.05), (1_000, 0.3)] {
            let c = SummaryConfig {
                fp_rate: fp,
                ..cfg()
            };
            let mut s = ReplicaSummary::new(1, cap, &c).unwrap();
            s.insert(&keys(0..cap as u64));
            let copy = ReplicaSummary::from_snapshot(&s.snapshot(), &c).unwrap();
            let hasher = s.key_hasher();
            assert_eq!(hasher.seed_id(), s.seed_id());
            assert_eq!(copy.geometry(), s.geometry());
            let g = s.geometry();
            let mut positions = vec![0u32; g.hashes() as usize];
            for k in keys(0..3 * cap as u64) {
                assert_eq!(s.contains_hashed(hasher.hash(k)), s.contains(k), "{k:?}");
                assert_eq!(copy.contains_hashed(hasher.hash(k)), s.contains(k));
                assert!(g.probe_positions(hasher.hash(k), &mut positions));
                assert_eq!(s.contains_positions(&positions), s.contains(k), "{k:?}");
                assert_eq!(copy.contains_positions(&positions), s.contains(k));
            }
            // A buffer of another length is refused, not half filled.
            assert!(!g.probe_positions(hasher.hash(BlockKey(1)), &mut [0u32; 40]));
        }
    }

    #[test]
    fn salted_keys_never_collide_with_plain_hits() {
        let mut s = ReplicaSummary::new(1, 10_000, &cfg()).unwrap();
        let gpu = keys(0..100);
        let cpu = keys(100..200);
        let disk = keys(200..300);
        s.insert(&gpu);
        s.insert_tier(&cpu, Tier::Cpu);
        s.insert_tier(&disk, Tier::Disk);
        assert_eq!(s.hit(&gpu), 100);
        // A plain reader (or an old node) sees nothing of the lower tiers...
        assert!(cpu.iter().chain(&disk).all(|k| !s.contains(*k)));
        // ...and each tier's keys answer only for that tier.
        assert!(gpu.iter().all(|k| s.tier_of(*k) == Some(Tier::Gpu)));
        assert!(cpu.iter().all(|k| s.tier_of(*k) == Some(Tier::Cpu)));
        assert!(disk.iter().all(|k| s.tier_of(*k) == Some(Tier::Disk)));
        assert!(keys(300..400).iter().all(|k| s.tier_of(*k).is_none()));
        assert_ne!(CPU_SALT, DISK_SALT);
        assert_eq!(Tier::Cpu.summary_key(Tier::Cpu.summary_key(gpu[0])), gpu[0]);
    }

    #[test]
    fn the_lower_tiers_flag_travels_by_delta_and_snapshot() {
        let c = cfg();
        let mut home = ReplicaSummary::new(3, 1000, &c).unwrap();
        let mut peer = ReplicaSummary::from_snapshot(&home.snapshot(), &c).unwrap();
        home.insert(&keys(0..4));
        assert!(!home.has_lower_tiers());
        home.insert_tier(&keys(4..6), Tier::Cpu);
        assert!(home.has_lower_tiers());
        peer.apply(&home.answer(peer.epoch(), peer.seq()), &c)
            .unwrap();
        assert!(peer.has_lower_tiers());
        assert_eq!(peer.tier_of(keys(4..5)[0]), Some(Tier::Cpu));
        let copy = ReplicaSummary::from_snapshot(&home.snapshot(), &c).unwrap();
        assert!(copy.has_lower_tiers());
        // A batch of salted keys that are all false positives still bumps seq for the flag.
        let mut s = ReplicaSummary::new(1, 1000, &c).unwrap();
        s.insert(&keys(0..3));
        let salted: Vec<BlockKey> = keys(0..3)
            .iter()
            .map(|k| Tier::Cpu.summary_key(*k))
            .collect();
        s.insert(&salted); // now CPU-salting `salted` gives back the plain keys, already in
        let seq = s.seq();
        assert_eq!(s.insert_tier(&salted, Tier::Cpu), 0);
        assert!(s.has_lower_tiers() && s.seq() == seq + 1);
    }

    #[test]
    fn readers_without_tiers_and_messages_without_the_flag_interoperate() {
        // The shape of version-1 messages, before `lower_tiers`.
        #[derive(Serialize, Deserialize)]
        struct OldDelta {
            epoch: u64,
            from_seq: u64,
            to_seq: u64,
            keys: Vec<u64>,
        }
        #[derive(Serialize, Deserialize)]
        enum OldMessage {
            Delta(OldDelta),
        }
        let mut home = ReplicaSummary::new(1, 1000, &cfg()).unwrap();
        home.insert_tier(&keys(0..2), Tier::Disk);
        let bytes = home.answer(1, 0).encode().unwrap();
        let OldMessage::Delta(old) = rmp_serde::from_slice::<OldMessage>(&bytes).unwrap();
        assert_eq!(old.keys.len(), 2);
        let old_bytes = rmp_serde::to_vec_named(&OldMessage::Delta(old)).unwrap();
        match SummaryMessage::decode(&old_bytes).unwrap() {
            SummaryMessage::Delta(d) => assert!(!d.lower_tiers),
            other => panic!("{other:?}"),
        }
    }

    proptest! {
        /// A summary never forgets a key it was given: no false negatives.
        #[test]
        fn no_false_negatives(raw in proptest::collection::vec(any::<u64>(), 0..2000), cap in 1usize..5000) {
            let mut s = ReplicaSummary::new(1, cap, &cfg()).unwrap();
            let ks: Vec<BlockKey> = raw.iter().map(|k| BlockKey(*k)).collect();
            for chunk in ks.chunks(7) { s.insert(chunk); }
            prop_assert_eq!(s.hit(&ks), ks.len());
            let copy = ReplicaSummary::from_snapshot(&s.snapshot(), &cfg()).unwrap();
            prop_assert_eq!(copy.hit(&ks), ks.len());
        }

        /// Random bytes never panic the decoder.
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = SummaryMessage::decode(&bytes);
        }
    }
}
