//! Block keys: the chained 64-bit hashes that name the prefix blocks of a prompt.
//!
//! Every routing decision and every cache summary in kvmesh speaks in block keys. A key depends on
//! its block's bytes *and* on every block before it (`k0 = H(ns, b0)`, `ki = H(k(i-1), bi)`), so two
//! prompts share key `i` exactly when they share their first `i + 1` blocks — which is what an
//! engine's prefix cache can reuse. The chain is seeded by a [`Namespace`] so that prompts of
//! different models, LoRA adapters, cache salts or isolated tenants never match.
//!
//! Only full blocks get keys: engines cache whole blocks, so a trailing partial block can never hit.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Default block size in bytes of routing text (about 64 tokens of English text).
pub const DEFAULT_BLOCK_BYTES: usize = 256;

/// The key of one prefix block. Equal keys mean equal prefixes (up to hash collisions, 2^-64).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BlockKey(pub u64);

/// The seed of a key chain. Built from everything that makes two identical texts *not* share
/// an engine cache entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Namespace(u64);

/// Separates the namespace fields, so `("ab", "c")` and `("a", "bc")` differ.
const FIELD_SEPARATOR: u8 = 0x1f;

impl Namespace {
    /// The namespace of a request: model, optional LoRA adapter, optional `cache_salt` and, for an
    /// isolated tenant, the tenant id. Absent and empty fields are the same thing.
    pub fn new(
        model: &str,
        lora: Option<&str>,
        cache_salt: Option<&str>,
        tenant: Option<&str>,
    ) -> Self {
        let mut buf = Vec::with_capacity(
            model.len()
                + lora.map_or(0, str::len)
                + cache_salt.map_or(0, str::len)
                + tenant.map_or(0, str::len)
                + 8,
        );
        for (tag, field) in [
            (b'm', Some(model)),
            (b'l', lora),
            (b's', cache_salt),
            (b't', tenant),
        ] {
            buf.push(tag);
            buf.extend_from_slice(field.unwrap_or("").as_bytes());
            buf.push(FIELD_SEPARATOR);
        }
        Namespace(xxh3_64(&buf))
    }

    /// A namespace from a raw seed (tests, and token-mode chains that mirror an engine's root).
    pub const fn from_seed(seed: u64) -> Self {
        Namespace(seed)
    }

    /// The raw seed.
    pub const fn seed(self) -> u64 {
        self.0
    }
}

/// Appends the keys of every full `block_bytes` block of `text` to `out` (which is not cleared,
/// so a caller can reuse one buffer across requests).
///
/// `block_bytes` of 0 is treated as 1 rather than panicking: config validation rejects it earlier.
pub fn text_block_keys(ns: Namespace, text: &[u8], block_bytes: usize, out: &mut Vec<BlockKey>) {
    let block_bytes = block_bytes.max(1);
    out.reserve(text.len() / block_bytes);
    let mut prev = ns.0;
    for block in text.chunks_exact(block_bytes) {
        prev = xxh3_64_with_seed(block, prev);
        out.push(BlockKey(prev));
    }
}

/// The key chain over token ids, `block_tokens` tokens per block (the engine's block size). Used
/// for engine KV events and token-mode routing; tokens hash as little-endian u32.
pub fn token_block_keys(
    ns: Namespace,
    tokens: &[u32],
    block_tokens: usize,
    out: &mut Vec<BlockKey>,
) {
    let mut prev = ns.0;
    for block in tokens.chunks_exact(block_tokens.max(1)) {
        prev = chain_tokens(prev, block);
        out.push(BlockKey(prev));
    }
}

/// One link of the token chain: the key of `block` after the block whose key is `parent`.
/// Exposed so an event consumer can extend a chain from a known parent key.
pub fn chain_tokens(parent: u64, block: &[u32]) -> u64 {
    // 64 tokens per block at most on the stack-free path; longer blocks hash in pieces of the
    // same bytes, so the result does not depend on the buffer size.
    let mut bytes = [0u8; 256];
    if block.len() <= 64 {
        for (dst, t) in bytes.chunks_exact_mut(4).zip(block) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        return xxh3_64_with_seed(&bytes[..block.len() * 4], parent);
    }
    let mut buf = Vec::with_capacity(block.len() * 4);
    for t in block {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&buf, parent)
}

/// Leading blocks two prompts' keys share. Keys are chained (key `i` names blocks `0..=i`), so
/// prompts are equal exactly up to their first differing key and "equal at `i`" is monotone in
/// `i`: a binary search, `O(log n)` compares.
pub fn shared_blocks(a: &[BlockKey], b: &[BlockKey]) -> usize {
    let (mut lo, mut hi) = (0, a.len().min(b.len()));
    // Invariant: a[..lo] == b[..lo], and the keys differ at some index below `hi` unless `hi` is
    // the shorter length.
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if a[mid - 1] == b[mid - 1] {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_shared_run_is_up_to_the_first_differing_key() {
        let a = (0..100).map(|i| BlockKey(1 << 32 | i)).collect::<Vec<_>>();
        let mut b = a.clone();
        assert_eq!(shared_blocks(&a, &b), 100);
        assert_eq!(shared_blocks(&a, &b[..40]), 40);
        b[57] = BlockKey(9);
        b.truncate(58);
        // Chained keys differ from the first differing block on.
        assert_eq!(shared_blocks(&a, &b), 57);
        assert_eq!(shared_blocks(&a, &[BlockKey(2 << 32)]), 0);
        assert_eq!(shared_blocks(&[], &a), 0);
    }

    fn keys(ns: Namespace, text: &[u8], bb: usize) -> Vec<BlockKey> {
        let mut v = Vec::new();
        text_block_keys(ns, text, bb, &mut v);
        v
    }

    #[test]
    fn only_full_blocks_get_keys() {
        let ns = Namespace::new("m", None, None, None);
        assert_eq!(keys(ns, &[b'a'; 255], 256).len(), 0);
        assert_eq!(keys(ns, &[b'a'; 256], 256).len(), 1);
        assert_eq!(keys(ns, &[b'a'; 1000], 256).len(), 3);
    }

    #[test]
    fn namespaces_separate_equal_text() {
        let text = [b'x'; 512];
        let base = keys(Namespace::new("m", None, None, None), &text, 256);
        for other in [
            Namespace::new("m2", None, None, None),
            Namespace::new("m", Some("lora"), None, None),
            Namespace::new("m", None, Some("salt"), None),
            Namespace::new("m", None, None, Some("tenant")),
        ] {
            let k = keys(other, &text, 256);
            assert!(
                k.iter().all(|x| !base.contains(x)),
                "namespace {other:?} shares a key"
            );
        }
        // Empty and absent fields mean the same namespace.
        assert_eq!(
            Namespace::new("m", Some(""), None, None),
            Namespace::new("m", None, None, None)
        );
        // Field boundaries matter.
        assert_ne!(
            Namespace::new("ab", Some("c"), None, None),
            Namespace::new("a", Some("bc"), None, None)
        );
    }

    #[test]
    fn long_token_blocks_hash_like_short_ones() {
        let toks: Vec<u32> = (0..200).collect();
        let mut bytes = Vec::new();
        for t in &toks {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(chain_tokens(7, &toks), xxh3_64_with_seed(&bytes, 7));
        assert_eq!(
            chain_tokens(7, &toks[..16]),
            xxh3_64_with_seed(&bytes[..64], 7)
        );
    }

    proptest! {
        /// Keys of equal prefixes are equal; a change in block j changes every key from j on.
        #[test]
        fn prefix_property(
            common in proptest::collection::vec(any::<u8>(), 0..2048),
            a in proptest::collection::vec(any::<u8>(), 0..1024),
            b in proptest::collection::vec(any::<u8>(), 0..1024),
            bb in 1usize..300,
        ) {
            let ns = Namespace::new("model", None, None, None);
            let ta: Vec<u8> = common.iter().chain(&a).copied().collect();
            let tb: Vec<u8> = common.iter().chain(&b).copied().collect();
            let (ka, kb) = (keys(ns, &ta, bb), keys(ns, &tb, bb));
            let shared_blocks = ta.iter().zip(&tb).take_while(|(x, y)| x == y).count() / bb;
            for i in 0..ka.len().min(kb.len()) {
                if i < shared_blocks {
                    prop_assert_eq!(ka[i], kb[i]);
                } else {
                    prop_assert_ne!(ka[i], kb[i]);
                }
            }
        }

        #[test]
        fn token_prefix_property(
            common in proptest::collection::vec(any::<u32>(), 0..200),
            tail in proptest::collection::vec(any::<u32>(), 1..64),
            bt in 1usize..32,
        ) {
            let ns = Namespace::from_seed(1);
            let mut changed = common.clone();
            changed.extend(&tail);
            let mut base = common.clone();
            base.extend(tail.iter().map(|t| t.wrapping_add(1)));
            let (mut ka, mut kb) = (Vec::new(), Vec::new());
            token_block_keys(ns, &changed, bt, &mut ka);
            token_block_keys(ns, &base, bt, &mut kb);
            let shared = common.len() / bt;
            prop_assert_eq!(&ka[..shared], &kb[..shared]);
            for i in shared..ka.len() { prop_assert_ne!(ka[i], kb[i]); }
        }
    }
}
