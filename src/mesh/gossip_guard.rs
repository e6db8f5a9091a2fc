//! The gate between the wire and chitchat: every value in a gossip message's delta is checked
//! against its publisher's certificate (see `signed`) before chitchat sees it, whoever relayed
//! it, and what a valid publisher may publish is bounded.
//!
//! chitchat 0.11.2's `Delta` is opaque, so its wire form is read here: after the message header
//! (and, in a SynAck, the digest) comes a block stream (block type: 0 end, 1 zstd, 2 plain; u16
//! length) of operations: `0` node (chitchat id, last GC version, from version), `1` key-value
//! (key, value, version, status: 0 set, 1 deleted, 2 delete-after-TTL), `2` set-max-version.
//! When anything is refused the message is rebuilt from the kept operations as plain blocks.
//!
//! Per node delta (one publisher's operations):
//! - **Refused whole** (counted in `forged_refused`): a value without a valid signature (or
//!   whose publisher's `cert` is neither in the delta nor already known), a plain tombstone
//!   (signed keys are withdrawn, never deleted), a value over its size cap, or a set-max-version
//!   after values. Nothing of a forged delta is kept: a dropped value with the delta's max
//!   version left would skip the owner's own update of that version.
//! - **Refused one value** (valid signature, no authority; counted): a `node` record, or a
//!   region layer's `region` record, for another region than the publisher's certificate binds
//!   (`authority_refused`), an `admin:`
//!   record from a publisher without the operator role (`authority_refused`), a new key past
//!   [`MAX_KEYS_PER_MEMBER`] (`key_cap_refused`). The receiver's max version then stops at the
//!   last value kept, so a refused last value is offered again (and refused again) later.
//! - A set-max-version alone (a state whose newest values were all forgotten) is dropped: it
//!   is the one version nobody signs.
//!
//! Each (publisher, key, version, value) is verified once: a bounded set of what passed.
//!
//! **Digests** (a Syn's or SynAck's list of members with their heartbeats) are unsigned too, and
//! chitchat makes a member state and a failure-detector entry for every id a digest names. So a
//! digest keeps only this node's own entries, the sender's own (at most [`GENERATIONS_KEPT`]),
//! and incarnations whose signed `cert` this node has verified (`digest_unknown` counts the
//! rest): invented ids make no state, and a new member is learned from its signed values, which
//! carry its `cert`, as before. A relay can still repeat a known member's heartbeat higher than
//! that member sent it, keeping it live while it is dead, until its state is forgotten.
//!
//! A node delta's bookkeeping (last GC version, from version) is unsigned. A delta from version 0
//! whose last GC version is past what the receiver knows is chitchat's *reset*: the receiver
//! forgets the member's state and keeps only what the delta carries. Relayed, that would let
//! any member erase another's records (a reset carrying one genuine value) or, with a huge last
//! GC version, make every later withdrawal look already collected. So a reset counts only from
//! the member itself (the sender's certificate names it): a relay's has its last GC version
//! set to 0 (`reset_refused`), which makes it a plain delta from version 0 — the values the
//! receiver lacks, nothing forgotten. A receiver that fell behind a member's GC then keeps a
//! withdrawn key until the member itself gossips with it. What a relay can still do: withhold
//! (drop or delay) another member's state, as it always could. The region layer's messages
//! (`KIND_REGIONS_Z`) pass a gate of their own, by the same rules.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet};
use std::hash::BuildHasher;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chitchat::{ChitchatId, Deserializable};

use super::admin::ADMIN_PREFIX;
use super::region_record::{RegionRecord, KEY_REGION};
use super::schema::{self, NodeRecord, KEY_NODE};
use super::signed::{
    CertCheck, Envelope, PeerCert, Signed, Status, KEY_CERT, MAX_CERT_VALUE_BYTES,
    MAX_ENVELOPE_BYTES,
};

/// Most distinct keys one member (node id and generation) may hold at a node, withdrawn keys
/// included until chitchat forgets them. An honest node publishes ~8 fixed keys, `admin:` ≤ 256
/// and two per replica it is home of (`replica:`, `rload:`), so this allows ~1,900 homed
/// replicas; a flooding member holds at most this many values (~4 MiB) at each peer.
pub const MAX_KEYS_PER_MEMBER: usize = 4096;
/// Publishers (node ids) whose certificates are kept; generations per node id.
const MAX_SIGNERS: usize = 4096;
const GENERATIONS_KEPT: usize = 2;
/// Verified (publisher, key, version, value) hashes kept before the set starts over.
const MAX_SEEN: usize = 65_536;
/// Largest decompressed delta read (chitchat's messages are ≤ 64 KiB compressed).
const MAX_DELTA_BYTES: usize = 4 << 20;

/// Counters of refusals (monotonic).
#[derive(Debug, Default)]
pub struct GuardStats {
    /// Digest entries of members this node knows no certificate of, left out (see the module
    /// doc): normal for a member that just joined, a flood from a member otherwise.
    pub digest_unknown: AtomicU64,
    /// Node deltas dropped whole: unsigned, forged, unknown publisher, plain tombstone.
    pub forged_refused: AtomicU64,
    /// Validly signed values their publisher may not publish (region, operator role).
    pub authority_refused: AtomicU64,
    /// New keys past [`MAX_KEYS_PER_MEMBER`].
    pub key_cap_refused: AtomicU64,
    /// Resets (deltas from version 0 past the receiver's GC) of one member relayed by another,
    /// made plain deltas.
    pub reset_refused: AtomicU64,
    /// Signatures verified (each value once).
    pub verified: AtomicU64,
}

/// What [`Guard::filter`] made of a message.
#[derive(Debug, PartialEq, Eq)]
pub enum Filtered {
    /// Everything passed (or the message carries no delta): hand the original over.
    Unchanged,
    /// Some operations were refused: this is the message to hand over.
    Rewritten(Vec<u8>),
    /// The delta could not be read: drop the message.
    Malformed(String),
}

/// A member's keys as this node has seen them: key → when it was withdrawn (`None`: live).
type KeyBook = HashMap<String, Option<Instant>>;

#[derive(Default)]
struct GuardState {
    signers: HashMap<Arc<str>, Vec<(u64, Arc<PeerCert>)>>,
    seen: HashSet<u64>,
    keys: HashMap<(Arc<str>, u64), KeyBook>,
}

/// The gate (one per node and cluster, shared by its transport's readers).
pub struct Guard {
    check: CertCheck,
    /// This node's id: its own entries in a digest are always kept.
    self_id: Arc<str>,
    /// How long a withdrawn key still counts (chitchat's tombstone grace period).
    withdrawn_hold: Duration,
    hasher: RandomState,
    state: Mutex<GuardState>,
    /// Refusals, for metrics.
    pub stats: GuardStats,
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard").finish_non_exhaustive()
    }
}

/// One operation of a delta and where its bytes are.
#[derive(Debug)]
enum Op<'a> {
    Node {
        id: ChitchatId,
        last_gc_version: u64,
        from_version: u64,
        /// Where `last_gc_version`'s eight bytes are in the delta.
        last_gc_at: usize,
    },
    Kv {
        key: &'a str,
        value: &'a str,
        version: u64,
        status: u8,
    },
    SetMax,
}

/// Why a node delta was refused whole.
struct Forged(String);

impl Guard {
    /// The gate of node `self_id`, trusting `check`'s CA; withdrawn keys count for
    /// `withdrawn_hold`.
    pub fn new(check: CertCheck, self_id: &str, withdrawn_hold: Duration) -> Arc<Self> {
        Arc::new(Guard {
            check,
            self_id: self_id.into(),
            withdrawn_hold,
            hasher: RandomState::new(),
            state: Mutex::new(GuardState::default()),
            stats: GuardStats::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GuardState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Checks the digest and the delta of a serialized chitchat message (already known to
    /// decode) from a sender whose certificate names `sender` (its node ids).
    pub fn filter(&self, body: &[u8], sender: &[String]) -> Filtered {
        let digest = match self.filter_digest(body, sender) {
            Ok(d) => d,
            Err(e) => return Filtered::Malformed(e),
        };
        match (
            self.filter_delta(digest.as_deref().unwrap_or(body), sender),
            digest,
        ) {
            (Filtered::Unchanged, Some(rewritten)) => Filtered::Rewritten(rewritten),
            (filtered, _) => filtered,
        }
    }

    /// The message without the digest entries of members this node knows no certificate of
    /// (`None`: nothing left out). Kept: this node's own, the sender's own (at most
    /// [`GENERATIONS_KEPT`] of them), and incarnations whose `cert` this node verified.
    fn filter_digest(&self, body: &[u8], sender: &[String]) -> Result<Option<Vec<u8>>, String> {
        if !matches!(body.get(3), Some(0 | 1)) {
            return Ok(None);
        }
        let mut buf = &body[4..];
        let n = u16::deserialize(&mut buf).map_err(|e| e.to_string())?;
        let mut entries = Vec::with_capacity(usize::from(n).min(1024));
        for _ in 0..n {
            let start = body.len() - buf.len();
            let id = ChitchatId::deserialize(&mut buf).map_err(|e| e.to_string())?;
            for _ in 0..3 {
                read_u64(&mut buf)?;
            }
            entries.push((id, start..body.len() - buf.len()));
        }
        let rest = body.len() - buf.len();
        let keep: Vec<bool> = {
            let st = self.lock();
            let mut own = 0;
            entries
                .iter()
                .map(|(id, _)| {
                    if id.node_id == self.self_id {
                        return true;
                    }
                    if sender.iter().any(|n| **n == *id.node_id) {
                        own += 1;
                        return own <= GENERATIONS_KEPT;
                    }
                    st.signers
                        .get(&id.node_id)
                        .is_some_and(|gens| gens.iter().any(|(g, _)| *g == id.generation_id))
                })
                .collect()
        };
        let kept = keep.iter().filter(|k| **k).count();
        if kept == entries.len() {
            return Ok(None);
        }
        self.stats
            .digest_unknown
            .fetch_add((entries.len() - kept) as u64, Ordering::Relaxed);
        let mut out = Vec::with_capacity(body.len());
        out.extend_from_slice(&body[..4]);
        out.extend_from_slice(&(kept as u16).to_le_bytes());
        for ((_, range), _) in entries.iter().zip(&keep).filter(|(_, k)| **k) {
            out.extend_from_slice(&body[range.clone()]);
        }
        out.extend_from_slice(&body[rest..]);
        Ok(Some(out))
    }

    /// Checks the delta of a serialized chitchat message (see the module doc).
    fn filter_delta(&self, body: &[u8], sender: &[String]) -> Filtered {
        let Some(at) = delta_offset(body) else {
            return Filtered::Unchanged;
        };
        let mut raw = match decompress(&body[at..]) {
            Ok(r) => r,
            Err(e) => return Filtered::Malformed(e),
        };
        let ops = match parse_ops(&raw) {
            Ok(o) => o,
            Err(e) => return Filtered::Malformed(e),
        };
        let mut kept: Vec<Range<usize>> = Vec::with_capacity(ops.len());
        let mut changed = false;
        let mut relayed_resets = Vec::new();
        let mut i = 0;
        while i < ops.len() {
            let end = ops[i..]
                .iter()
                .skip(1)
                .position(|(op, _)| matches!(op, Op::Node { .. }))
                .map_or(ops.len(), |p| i + 1 + p);
            if let Some(at) = relayed_reset(&ops[i].0, sender) {
                relayed_resets.push(at);
            }
            changed |= self.node_delta(&ops[i..end], &mut kept);
            i = end;
        }
        if !changed && relayed_resets.is_empty() {
            return Filtered::Unchanged;
        }
        for at in relayed_resets {
            self.stats.reset_refused.fetch_add(1, Ordering::Relaxed);
            raw[at..at + 8].copy_from_slice(&0u64.to_le_bytes());
        }
        let mut out = Vec::with_capacity(body.len() + 16);
        out.extend_from_slice(&body[..at]);
        let mut plain = Vec::new();
        for r in kept {
            plain.extend_from_slice(&raw[r]);
        }
        for block in plain.chunks(usize::from(u16::MAX)) {
            out.push(2);
            out.extend_from_slice(&(block.len() as u16).to_le_bytes());
            out.extend_from_slice(block);
        }
        out.push(0);
        Filtered::Rewritten(out)
    }

    /// One node delta (`ops[0]` is its node op): pushes the ranges kept; true when anything
    /// was refused.
    fn node_delta(&self, ops: &[(Op<'_>, Range<usize>)], kept: &mut Vec<Range<usize>>) -> bool {
        let Some((Op::Node { id, .. }, node_range)) = ops.first() else {
            return true;
        };
        let kvs = &ops[1..];
        if kvs.is_empty() {
            kept.push(node_range.clone());
            return false;
        }
        if kvs.iter().all(|(op, _)| matches!(op, Op::SetMax)) {
            // Only a bare max version: a version nobody signed.
            return true;
        }
        match self.authenticate(id, kvs) {
            Ok(cert) => {
                kept.push(node_range.clone());
                let before = kept.len();
                self.authorise(id, &cert, kvs, kept);
                kept.len() - before != kvs.len()
            }
            Err(Forged(why)) => {
                self.stats.forged_refused.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(node = %id.node_id, "refused a forged or unsigned delta: {why}");
                true
            }
        }
    }

    /// Checks every value's signature; returns the publisher's certificate.
    fn authenticate(
        &self,
        id: &ChitchatId,
        kvs: &[(Op<'_>, Range<usize>)],
    ) -> Result<Arc<PeerCert>, Forged> {
        let mut cert = None;
        for (op, _) in kvs {
            let Op::Kv {
                key,
                value,
                version,
                status,
            } = op
            else {
                return Err(Forged("a max version after values".into()));
            };
            let status = match status {
                0 => Status::Set,
                2 => Status::Withdrawn,
                _ => return Err(Forged(format!("a plain tombstone for {key:?}"))),
            };
            let cap = if *key == KEY_CERT {
                MAX_CERT_VALUE_BYTES
            } else {
                schema::MAX_VALUE_BYTES + MAX_ENVELOPE_BYTES
            };
            if value.len() > cap {
                return Err(Forged(format!("{key:?} is {} bytes", value.len())));
            }
            let env = Envelope::parse(value).map_err(|e| Forged(format!("{key:?}: {e}")))?;
            if env.status != status {
                return Err(Forged(format!(
                    "{key:?}: status differs from the signed one"
                )));
            }
            let signed = Signed {
                node_id: &id.node_id,
                generation: id.generation_id,
                key,
                version: *version,
                status,
                payload: env.payload,
            };
            if *key == KEY_CERT && status == Status::Set {
                let c = self
                    .check
                    .check_cert(&id.node_id, env.payload)
                    .map_err(|e| Forged(e.to_string()))?;
                let c = Arc::new(c);
                if !self.check.verify(&c, &signed, &env) {
                    return Err(Forged(
                        "the certificate value is not signed by its key".into(),
                    ));
                }
                self.remember_signer(id, &c);
                cert = Some(c);
                continue;
            }
            let signer = match &cert {
                Some(c) => Arc::clone(c),
                None => self
                    .signer(id)
                    .ok_or_else(|| Forged("no certificate known for the publisher".into()))?,
            };
            let h = self
                .hasher
                .hash_one((&*id.node_id, id.generation_id, key, version, value));
            if self.lock().seen.contains(&h) {
                continue;
            }
            if !self.check.verify(&signer, &signed, &env) {
                return Err(Forged(format!("{key:?} v{version}: bad signature")));
            }
            self.stats.verified.fetch_add(1, Ordering::Relaxed);
            let mut st = self.lock();
            if st.seen.len() >= MAX_SEEN {
                st.seen.clear();
            }
            st.seen.insert(h);
            cert.get_or_insert(signer);
        }
        cert.or_else(|| self.signer(id))
            .ok_or_else(|| Forged("no certificate known for the publisher".into()))
    }

    /// Keeps the authentic values `cert` may publish, within the key cap.
    fn authorise(
        &self,
        id: &ChitchatId,
        cert: &PeerCert,
        kvs: &[(Op<'_>, Range<usize>)],
        kept: &mut Vec<Range<usize>>,
    ) {
        let now = Instant::now();
        let mut st = self.lock();
        let book_key = (Arc::clone(&id.node_id), id.generation_id);
        if !st.keys.contains_key(&book_key) && !make_room_for_book(&mut st.keys, id) {
            let values = kvs
                .iter()
                .filter(|(op, _)| matches!(op, Op::Kv { .. }))
                .count();
            self.stats
                .key_cap_refused
                .fetch_add(values as u64, Ordering::Relaxed);
            return;
        }
        let book = st.keys.entry(book_key).or_default();
        for (op, range) in kvs {
            let Op::Kv {
                key, value, status, ..
            } = op
            else {
                continue;
            };
            let set = *status == 0;
            if set && !may_publish(cert, key, value) {
                self.stats.authority_refused.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(node = %id.node_id, key, "refused a record its certificate does not allow");
                continue;
            }
            if !book.contains_key(*key) && book.len() >= MAX_KEYS_PER_MEMBER {
                let hold = self.withdrawn_hold;
                book.retain(|_, w| w.is_none_or(|t| now.duration_since(t) < hold));
                if book.len() >= MAX_KEYS_PER_MEMBER {
                    self.stats.key_cap_refused.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            }
            book.insert((*key).to_owned(), (!set).then_some(now));
            kept.push(range.clone());
        }
    }

    fn signer(&self, id: &ChitchatId) -> Option<Arc<PeerCert>> {
        let st = self.lock();
        let gens = st.signers.get(&id.node_id)?;
        gens.iter()
            .find(|(g, _)| *g == id.generation_id)
            .map(|(_, c)| Arc::clone(c))
    }

    fn remember_signer(&self, id: &ChitchatId, cert: &Arc<PeerCert>) {
        let mut st = self.lock();
        if !st.signers.contains_key(&id.node_id) && st.signers.len() >= MAX_SIGNERS {
            return;
        }
        let gens = st.signers.entry(Arc::clone(&id.node_id)).or_default();
        gens.retain(|(g, _)| *g != id.generation_id);
        gens.push((id.generation_id, Arc::clone(cert)));
        gens.sort_by_key(|(g, _)| std::cmp::Reverse(*g));
        gens.truncate(GENERATIONS_KEPT);
    }
}

/// Makes room for a new key book of member `id`: a node id keeps books for its
/// [`GENERATIONS_KEPT`] newest generations only (the oldest goes), else a member could multiply
/// its key cap by inventing generations, each with its own signed `cert`; and at most
/// [`MAX_SIGNERS`] node ids' worth in all. False: no room (an older generation than those kept,
/// or the books are full).
fn make_room_for_book(books: &mut HashMap<(Arc<str>, u64), KeyBook>, id: &ChitchatId) -> bool {
    let (mut held, mut oldest) = (0, u64::MAX);
    for (node, generation) in books.keys() {
        if *node == id.node_id {
            held += 1;
            oldest = oldest.min(*generation);
        }
    }
    if held >= GENERATIONS_KEPT {
        if id.generation_id < oldest {
            return false;
        }
        books.remove(&(Arc::clone(&id.node_id), oldest));
        return true;
    }
    books.len() < MAX_SIGNERS * GENERATIONS_KEPT
}

/// Whether a publisher with `cert` may publish `value` under `key`: a `node` record, or (in the
/// region layer) a `region` record, only for the region its certificate binds; an `admin:`
/// record only with the operator role.
fn may_publish(cert: &PeerCert, key: &str, value: &str) -> bool {
    if key == KEY_NODE || key == KEY_REGION {
        let Some(region) = &cert.roles.region else {
            return true;
        };
        let Some(payload) = super::signed::payload(value) else {
            return true;
        };
        return if key == KEY_NODE {
            NodeRecord::decode(payload).is_ok_and(|r| r.region == *region)
        } else {
            RegionRecord::decode(payload).is_ok_and(|r| r.region == *region)
        };
    }
    if key.starts_with(ADMIN_PREFIX) {
        return cert.roles.operator;
    }
    true
}

/// Where the last GC version of `op` is, when it is a reset of a member other than the sender:
/// a delta from version 0 with a last GC version (see the module doc).
fn relayed_reset(op: &Op<'_>, sender: &[String]) -> Option<usize> {
    match op {
        Op::Node {
            id,
            last_gc_version,
            from_version: 0,
            last_gc_at,
        } if *last_gc_version > 0 && !sender.iter().any(|n| **n == *id.node_id) => {
            Some(*last_gc_at)
        }
        _ => None,
    }
}

/// Where the delta starts in a serialized message: after the 4-byte header of an Ack (type 2),
/// after the header and digest of a SynAck (type 1); `None` for messages without one.
fn delta_offset(body: &[u8]) -> Option<usize> {
    match body.get(3)? {
        2 => Some(4),
        1 => {
            let mut buf = &body[4..];
            let n = u16::deserialize(&mut buf).ok()?;
            for _ in 0..n {
                ChitchatId::deserialize(&mut buf).ok()?;
                for _ in 0..3 {
                    u64::deserialize(&mut buf).ok()?;
                }
            }
            Some(body.len() - buf.len())
        }
        _ => None,
    }
}

/// The operation bytes of a block stream, at most [`MAX_DELTA_BYTES`].
fn decompress(mut buf: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let (&kind, rest) = buf.split_first().ok_or("truncated block stream")?;
        if kind == 0 {
            return Ok(out);
        }
        let len = rest
            .get(..2)
            .map(|b| usize::from(u16::from_le_bytes([b[0], b[1]])))
            .ok_or("truncated block length")?;
        let block = rest.get(2..2 + len).ok_or("truncated block")?;
        match kind {
            1 => {
                let plain = zstd::bulk::decompress(block, usize::from(u16::MAX))
                    .map_err(|e| format!("block: {e}"))?;
                out.extend_from_slice(&plain);
            }
            2 => out.extend_from_slice(block),
            k => return Err(format!("unknown block type {k}")),
        }
        if out.len() > MAX_DELTA_BYTES {
            return Err(format!("delta over {MAX_DELTA_BYTES} bytes"));
        }
        buf = &rest[2 + len..];
    }
}

/// A length-prefixed string.
fn read_str<'a>(buf: &mut &'a [u8]) -> Result<&'a str, String> {
    let len = usize::from(u16::deserialize(buf).map_err(|e| e.to_string())?);
    let bytes = buf.get(..len).ok_or("truncated string")?;
    *buf = &buf[len..];
    std::str::from_utf8(bytes).map_err(|e| e.to_string())
}

fn read_u64(buf: &mut &[u8]) -> Result<u64, String> {
    u64::deserialize(buf).map_err(|e| e.to_string())
}

/// The operations of `raw` with their byte ranges; the first must be a node op.
fn parse_ops(raw: &[u8]) -> Result<Vec<(Op<'_>, Range<usize>)>, String> {
    let mut buf = raw;
    let mut ops = Vec::new();
    while let Some((&tag, rest)) = buf.split_first() {
        let start = raw.len() - buf.len();
        buf = rest;
        let op = match tag {
            0 => {
                let id = ChitchatId::deserialize(&mut buf).map_err(|e| e.to_string())?;
                let last_gc_at = raw.len() - buf.len();
                let last_gc_version = read_u64(&mut buf)?;
                let from_version = read_u64(&mut buf)?;
                Op::Node {
                    id,
                    last_gc_version,
                    from_version,
                    last_gc_at,
                }
            }
            1 => {
                let key = read_str(&mut buf)?;
                let value = read_str(&mut buf)?;
                let version = read_u64(&mut buf)?;
                let (&status, rest) = buf.split_first().ok_or("truncated status")?;
                buf = rest;
                Op::Kv {
                    key,
                    value,
                    version,
                    status,
                }
            }
            2 => {
                read_u64(&mut buf)?;
                Op::SetMax
            }
            t => return Err(format!("unknown delta op {t}")),
        };
        if ops.is_empty() && !matches!(op, Op::Node { .. }) {
            return Err("a value before any node".into());
        }
        ops.push((op, start..raw.len() - buf.len()));
    }
    Ok(ops)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::certs::{CertRoles, ClusterCa};
    use crate::mesh::signed::LocalSigner;
    use chitchat::{ChitchatMessage, Serializable};

    /// A node's signer and chitchat id.
    struct Pub {
        signer: Arc<LocalSigner>,
        id: ChitchatId,
    }

    fn node(ca: &ClusterCa, name: &str, roles: &CertRoles) -> Pub {
        let ident = ca.issue_with(name, roles).unwrap();
        Pub {
            signer: LocalSigner::new(&ident.certified_key().unwrap()).unwrap(),
            id: ChitchatId::new(name.to_owned(), 7, "127.0.0.1:9".parse().unwrap()),
        }
    }

    impl Pub {
        fn value(&self, key: &str, version: u64, payload: &str) -> String {
            if key == KEY_CERT {
                return self.signer.cert_value(&self.id);
            }
            self.signer.seal(&Signed {
                node_id: &self.id.node_id,
                generation: self.id.generation_id,
                key,
                version,
                status: Status::Set,
                payload,
            })
        }
    }

    /// An Ack message carrying, per node delta, (id, [(key, value, version, status)]).
    /// One value on the wire: key, value, version, status.
    type Kv<'a> = (&'a str, String, u64, u8);

    fn ack(deltas: &[(&ChitchatId, Vec<Kv<'_>>)]) -> Vec<u8> {
        ack_after_gc(deltas, 0)
    }

    /// [`ack`] whose node deltas all start from version 0 with last GC version `last_gc`.
    fn ack_after_gc(deltas: &[(&ChitchatId, Vec<Kv<'_>>)], last_gc: u64) -> Vec<u8> {
        let mut ops = Vec::new();
        for (id, kvs) in deltas {
            ops.push(0u8);
            id.serialize(&mut ops);
            last_gc.serialize(&mut ops);
            0u64.serialize(&mut ops);
            for (k, v, version, status) in kvs {
                ops.push(1);
                k.serialize(&mut ops);
                v.as_str().serialize(&mut ops);
                version.serialize(&mut ops);
                ops.push(*status);
            }
        }
        let mut body = vec![0x53, 0xb0, 0, 2];
        assert_eq!(u16::from_le_bytes([body[0], body[1]]), 45_139);
        for block in ops.chunks(60_000) {
            body.push(2);
            body.extend_from_slice(&(block.len() as u16).to_le_bytes());
            body.extend_from_slice(block);
        }
        body.push(0);
        body
    }

    fn guard(ca: &ClusterCa) -> Arc<Guard> {
        let me = ca.issue("me").unwrap();
        Guard::new(CertCheck::new(&me).unwrap(), "me", Duration::from_secs(600))
    }

    /// The delta of the Ack `body` as the guard hands it to chitchat, from `sender` (the message
    /// checked to decode as chitchat's).
    fn handed_over_delta(g: &Guard, body: &[u8], sender: &str) -> Vec<u8> {
        let body = match g.filter(body, &[sender.to_owned()]) {
            Filtered::Unchanged => body.to_vec(),
            Filtered::Rewritten(b) => b,
            Filtered::Malformed(e) => panic!("{e}"),
        };
        let mut buf = body.as_slice();
        assert!(ChitchatMessage::deserialize(&mut buf).is_ok());
        decompress(&body[4..]).unwrap()
    }

    /// The (node id, keys) a filtered message hands chitchat.
    fn passed(g: &Guard, body: &[u8]) -> Vec<(String, Vec<String>)> {
        let raw = handed_over_delta(g, body, "relay");
        let mut out: Vec<(String, Vec<String>)> = Vec::new();
        for (op, _) in parse_ops(&raw).unwrap() {
            match op {
                Op::Node { id, .. } => out.push((id.node_id.to_string(), Vec::new())),
                Op::Kv { key, .. } => out.last_mut().unwrap().1.push(key.to_owned()),
                Op::SetMax => {}
            }
        }
        out
    }

    fn node_record(region: &str) -> String {
        NodeRecord {
            schema: schema::SCHEMA_VERSION,
            region: region.into(),
            zone: String::new(),
            http_url: "https://a.example:1".into(),
            quic_addr: "127.0.0.1:9".parse().unwrap(),
            version: "x".into(),
            generation: 7,
        }
        .encode()
        .unwrap()
    }

    /// A region layer `region` record for `region`.
    fn region_record(region: &str) -> String {
        RegionRecord {
            region: region.into(),
            at_ms: 1,
            ..RegionRecord::default()
        }
        .encode_fit()
        .unwrap()
    }

    #[test]
    fn signed_state_passes_and_a_relayed_forgery_is_dropped_whole() {
        let ca = ClusterCa::generate().unwrap();
        let g = guard(&ca);
        let a = node(&ca, "a", &CertRoles::default());
        let rogue = node(&ca, "rogue", &CertRoles::default());
        let rec = node_record("eu");
        let honest = vec![
            (KEY_CERT, a.value(KEY_CERT, 1, ""), 1, 0),
            (KEY_NODE, a.value(KEY_NODE, 2, &rec), 2, 0),
        ];
        let body = ack(&[(&a.id, honest.clone())]);
        assert_eq!(g.filter(&body, &[]), Filtered::Unchanged);
        // A relay's version of a's node record: signed by the relay, or a's signature moved
        // to another version: a's whole delta is dropped, the relay's own state passes.
        let forged_by_rogue = rogue.signer.seal(&Signed {
            node_id: "a",
            generation: 7,
            key: KEY_NODE,
            version: 9,
            status: Status::Set,
            payload: &rec,
        });
        let mut moved = honest.clone();
        moved[1].2 = 1000;
        for kvs in [
            vec![(KEY_NODE, forged_by_rogue, 9, 0)],
            moved,
            vec![(KEY_NODE, rec.clone(), 9, 0)],
            vec![(KEY_NODE, String::new(), 9, 1)],
        ] {
            let body = ack(&[
                (&a.id, kvs),
                (
                    &rogue.id,
                    vec![(KEY_CERT, rogue.value(KEY_CERT, 1, ""), 1, 0)],
                ),
            ]);
            assert_eq!(
                passed(&g, &body),
                vec![("rogue".to_owned(), vec![KEY_CERT.to_owned()])]
            );
        }
        assert!(g.stats.forged_refused.load(Ordering::Relaxed) >= 4);
    }

    #[test]
    fn region_and_operator_authority_come_from_the_certificate() {
        let ca = ClusterCa::generate().unwrap();
        let g = guard(&ca);
        let eu = CertRoles {
            region: Some("eu".into()),
            operator: false,
        };
        let a = node(&ca, "a", &eu);
        let op = node(
            &ca,
            "op",
            &CertRoles {
                operator: true,
                ..eu
            },
        );
        let admin = "x".to_owned();
        let body = ack(&[
            (
                &a.id,
                vec![
                    (KEY_CERT, a.value(KEY_CERT, 1, ""), 1, 0),
                    (KEY_NODE, a.value(KEY_NODE, 2, &node_record("us")), 2, 0),
                    ("admin:r1", a.value("admin:r1", 3, &admin), 3, 0),
                    ("hot", a.value("hot", 4, "h"), 4, 0),
                    (
                        KEY_REGION,
                        a.value(KEY_REGION, 5, &region_record("us")),
                        5,
                        0,
                    ),
                ],
            ),
            (
                &op.id,
                vec![
                    (KEY_CERT, op.value(KEY_CERT, 1, ""), 1, 0),
                    (KEY_NODE, op.value(KEY_NODE, 2, &node_record("eu")), 2, 0),
                    ("admin:r1", op.value("admin:r1", 3, &admin), 3, 0),
                    (
                        KEY_REGION,
                        op.value(KEY_REGION, 4, &region_record("eu")),
                        4,
                        0,
                    ),
                ],
            ),
        ]);
        let keys = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            passed(&g, &body),
            vec![
                ("a".to_owned(), keys(&[KEY_CERT, "hot"])),
                (
                    "op".to_owned(),
                    keys(&[KEY_CERT, KEY_NODE, "admin:r1", KEY_REGION])
                ),
            ]
        );
        assert_eq!(g.stats.authority_refused.load(Ordering::Relaxed), 3);
    }

    /// The last GC version of each node delta `body` hands chitchat, by node id.
    fn last_gc_versions(g: &Guard, body: &[u8], sender: &str) -> Vec<(String, u64)> {
        let raw = handed_over_delta(g, body, sender);
        let mut out = Vec::new();
        for (op, _) in parse_ops(&raw).unwrap() {
            if let Op::Node {
                id,
                last_gc_version,
                ..
            } = op
            {
                out.push((id.node_id.to_string(), last_gc_version));
            }
        }
        out
    }

    #[test]
    fn a_reset_counts_only_from_the_member_itself() {
        let ca = ClusterCa::generate().unwrap();
        let g = guard(&ca);
        let a = node(&ca, "a", &CertRoles::default());
        let rec = node_record("eu");
        // a's newest genuine value alone, as a reset: received from a, chitchat resets a's
        // state to it (a may say what it holds); relayed by anyone else, it is a plain delta.
        let reset = ack_after_gc(
            &[(
                &a.id,
                vec![
                    (KEY_CERT, a.value(KEY_CERT, 1, ""), 1, 0),
                    (KEY_NODE, a.value(KEY_NODE, 40, &rec), 40, 0),
                ],
            )],
            u64::MAX,
        );
        assert_eq!(
            last_gc_versions(&g, &reset, "a"),
            vec![("a".to_owned(), u64::MAX)]
        );
        assert_eq!(g.stats.reset_refused.load(Ordering::Relaxed), 0);
        assert_eq!(
            last_gc_versions(&g, &reset, "rogue"),
            vec![("a".to_owned(), 0)]
        );
        assert_eq!(g.stats.reset_refused.load(Ordering::Relaxed), 1);
        // What chitchat makes of the plain delta: a's values, nothing forgotten, no reset.
        let body = match g.filter(&reset, &["rogue".to_owned()]) {
            Filtered::Rewritten(b) => b,
            other => panic!("{other:?}"),
        };
        let mut buf = body.as_slice();
        assert!(matches!(
            ChitchatMessage::deserialize(&mut buf),
            Ok(ChitchatMessage::Ack { .. })
        ));
    }

    #[test]
    fn new_generations_do_not_multiply_a_members_key_cap() {
        let ca = ClusterCa::generate().unwrap();
        let g = guard(&ca);
        let a = node(&ca, "a", &CertRoles::default());
        for generation in 1..=5u64 {
            let id = ChitchatId::new("a".to_owned(), generation, a.id.gossip_advertise_addr);
            let signed = |key: &str, version: u64, payload: &str| {
                a.signer.seal(&Signed {
                    node_id: "a",
                    generation,
                    key,
                    version,
                    status: Status::Set,
                    payload,
                })
            };
            let kvs = vec![
                (KEY_CERT, a.signer.cert_value(&id), 1, 0),
                ("k", signed("k", 2, "x"), 2, 0),
            ];
            assert_eq!(
                passed(&g, &ack(&[(&id, kvs)]))[0].1.len(),
                2,
                "gen {generation}"
            );
        }
        let st = g.lock();
        let mut books: Vec<u64> = st.keys.keys().map(|(_, generation)| *generation).collect();
        books.sort_unstable();
        assert_eq!(books, vec![4, 5], "the two newest generations' books");
    }

    /// A Syn listing `ids` (heartbeat 5, last GC 0, max version 3 each).
    fn syn(ids: &[ChitchatId]) -> Vec<u8> {
        let mut bytes = Vec::new();
        ChitchatMessage::BadCluster.serialize(&mut bytes);
        bytes.truncate(3);
        bytes.push(0);
        (ids.len() as u16).serialize(&mut bytes);
        for id in ids {
            id.serialize(&mut bytes);
            for v in [5u64, 0, 3] {
                v.serialize(&mut bytes);
            }
        }
        "c".to_owned().serialize(&mut bytes);
        bytes
    }

    #[test]
    fn a_digest_names_only_members_whose_certificate_was_seen() {
        let ca = ClusterCa::generate().unwrap();
        let g = guard(&ca);
        let a = node(&ca, "a", &CertRoles::default());
        let body = ack(&[(&a.id, vec![(KEY_CERT, a.value(KEY_CERT, 1, ""), 1, 0)])]);
        assert_eq!(g.filter(&body, &[]), Filtered::Unchanged);
        let at = |name: &str, generation: u64| {
            ChitchatId::new(name.to_owned(), generation, "127.0.0.1:9".parse().unwrap())
        };
        let listed = [
            at("me", 1),
            at("relay", 1),
            at("relay", 2),
            at("relay", 3),
            a.id.clone(),
            at("a", 8),
            at("ghost", 1),
        ];
        let body = match g.filter(&syn(&listed), &["relay".to_owned()]) {
            Filtered::Rewritten(b) => b,
            other => panic!("{other:?}"),
        };
        let mut buf = body.as_slice();
        let Ok(ChitchatMessage::Syn { cluster_id, .. }) = ChitchatMessage::deserialize(&mut buf)
        else {
            panic!("not a Syn");
        };
        assert_eq!(cluster_id, "c");
        // This node, the sender's first two incarnations, and a's verified one; not a's
        // unknown incarnation nor a ghost.
        let mut kept = &body[4..];
        let n = u16::deserialize(&mut kept).unwrap();
        let ids: Vec<ChitchatId> = (0..n)
            .map(|_| {
                let id = ChitchatId::deserialize(&mut kept).unwrap();
                kept = &kept[24..];
                id
            })
            .collect();
        let want: Vec<ChitchatId> = [0, 1, 2, 4].iter().map(|&i| listed[i].clone()).collect();
        assert_eq!(ids, want);
        assert_eq!(g.stats.digest_unknown.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn keys_per_member_are_capped() {
        let ca = ClusterCa::generate().unwrap();
        let g = guard(&ca);
        let a = node(&ca, "a", &CertRoles::default());
        let mut kvs = vec![(KEY_CERT, a.value(KEY_CERT, 1, ""), 1u64, 0u8)];
        let keys: Vec<String> = (0..MAX_KEYS_PER_MEMBER + 10)
            .map(|i| format!("k{i}"))
            .collect();
        for (i, k) in keys.iter().enumerate() {
            let v = 2 + i as u64;
            kvs.push((k.as_str(), a.value(k, v, "x"), v, 0));
        }
        let got = passed(&g, &ack(&[(&a.id, kvs)]));
        assert_eq!(got[0].1.len(), MAX_KEYS_PER_MEMBER);
        assert_eq!(g.stats.key_cap_refused.load(Ordering::Relaxed), 11);
    }

    /// The cost of signing, measured: `cargo test --lib cost_of_signed_state -- --ignored
    /// --nocapture`. A node's full state (32 homed replicas: `replica:` + `rload:`, the fixed
    /// records) as one zstd-compressed Ack, signed vs plain, and the time to sign and verify.
    #[test]
    #[ignore]
    fn cost_of_signed_state() {
        use crate::mesh::replica_load::ReplicaLoadRecord;
        use crate::mesh::schema::{ReplicaRecord, SummaryVersion, WireHealth, WireLoad};
        let ca = ClusterCa::generate().unwrap();
        let g = guard(&ca);
        let a = node(&ca, "a", &CertRoles::default());
        let rec = |i: usize| ReplicaRecord {
            url: format!("http://10.0.{i}.1:8000"),
            region: "eu".into(),
            zone: String::new(),
            pool: String::new(),
            models: vec!["meta-llama/Llama-3.1-8B-Instruct".into()],
            capacity_tokens: 1_000_000,
            prefill_tokens_per_s: 10_000.0,
            prefill_attention_ms_per_pair: None,
            max_in_flight: 64,
            health: WireHealth::Healthy,
            load: WireLoad::default(),
            summary: SummaryVersion {
                epoch: 1_700_000_000_000 + i as u64,
                seq: 42,
                digest: 7,
            },
            origin: String::new(),
            kv_events: None,
            pd: None,
            kv_shares: None,
            kv_load: None,
        };
        let mut plain: Vec<(String, String)> = vec![(KEY_NODE.into(), node_record("eu"))];
        for i in 0..32 {
            plain.push((format!("replica:r{i}"), rec(i).encode().unwrap()));
            plain.push((
                format!("rload:r{i}"),
                ReplicaLoadRecord::of(&rec(i)).encode().unwrap(),
            ));
        }
        let sign_start = Instant::now();
        let mut signed: Vec<(String, String)> = vec![(KEY_CERT.into(), a.value(KEY_CERT, 1, ""))];
        for (k, (key, v)) in plain.iter().enumerate() {
            signed.push((key.clone(), a.value(key, 2 + k as u64, v)));
        }
        let sign_us = sign_start.elapsed().as_secs_f64() * 1e6 / plain.len() as f64;
        let as_ack = |kvs: &[(String, String)]| {
            let kvs: Vec<(&str, String, u64, u8)> = kvs
                .iter()
                .enumerate()
                .map(|(k, (key, v))| (key.as_str(), v.clone(), 1 + k as u64, 0))
                .collect();
            ack(&[(&a.id, kvs)])
        };
        let z = |b: &[u8]| zstd::bulk::compress(b, 1).unwrap().len();
        let (p, s) = (as_ack(&plain[..]), as_ack(&signed[..]));
        let t = Instant::now();
        assert_eq!(g.filter(&s, &[]), Filtered::Unchanged);
        let verify_us = t.elapsed().as_secs_f64() * 1e6 / signed.len() as f64;
        let t = Instant::now();
        assert_eq!(g.filter(&s, &[]), Filtered::Unchanged);
        let again_us = t.elapsed().as_secs_f64() * 1e6 / signed.len() as f64;
        // One round's change: 32 `rload:` updates.
        let rl = |kvs: &[(String, String)]| -> Vec<(String, String)> {
            kvs.iter()
                .filter(|(k, _)| k.starts_with("rload:"))
                .cloned()
                .collect()
        };
        let (pr, sr) = (as_ack(&rl(&plain)), as_ack(&rl(&signed)));
        println!(
            "full state (65 values): plain {} B, signed {} B (zstd-1: {} vs {} B); \
             32 rload updates: plain {} B, signed {} B (zstd-1: {} vs {} B); \
             sign {sign_us:.0} us/value, first check {verify_us:.0} us/value (cert check included), \
             repeat {again_us:.1} us/value",
            p.len(), s.len(), z(&p), z(&s), pr.len(), sr.len(), z(&pr), z(&sr)
        );
    }
}
