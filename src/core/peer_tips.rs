//! Peer tips: the prefixes the region's *other* nodes just routed, known within milliseconds.
//!
//! A node's overlay (`view.rs`) holds the blocks it routed itself a moment ago; blocks another
//! node routed reach it only through the replica's home and the next summary round, 100 ms to a
//! second later. Behind a load balancer, the next turn of a conversation lands on another node
//! two times in three and misses the blocks its previous turn is computing right now. Sending
//! every routed key would cost a kilobyte per request and peer; sending the *tip* — the last
//! block key of the routed prompt and its block count — costs ~30 bytes and says as much: block
//! keys are chained (key *i* hashes blocks 0..=i), so a request whose key at position *j* equals a
//! tip of `j + 1` blocks shares that whole prefix. A shorter shared prefix (a system prompt under
//! a different question, a document under another one) the last key cannot name, so a tip also
//! names the prompt's keys at the [`ladder`]'s lengths — 4, 8, 16, … blocks, a handful per prompt,
//! each a plain tip of its own length on the wire (so nodes of every version read them), each
//! (replica, key, length) once per update — and a request sharing `L` leading blocks with a peer's
//! finds at least the largest of those lengths ≤ `L`, more than half of what it shares. Without
//! them a region's other nodes learnt a new system prompt only from the next summary round, up to
//! a second later, and sprayed its first requests over the fleet: in `kvmesh sim` (3 nodes, ten
//! seeds) the system-prompt family's p99 TTFT was 0.246 s with the last key alone and 0.152 s
//! with the ladder, rag's 2.91 → 1.98 s.
//!
//! Tips count, like the overlay, from the routed request's predicted prefill end (`ready`) until
//! `until`. The store is bounded ([`PeerTips::cap`]); expired tips are swept by [`PeerTips::expire`].

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::time::Duration;

use super::keys::BlockKey;

/// One peer-routed prefix at one replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tip {
    /// The replica's view index.
    pub replica: usize,
    /// Blocks of the prefix (the tip key is block `blocks - 1`).
    pub blocks: u32,
    /// From when the blocks count (predicted end of that request's prefill).
    pub ready: Duration,
    /// When they stop counting (by then the home's summary has them).
    pub until: Duration,
}

/// Hashes a block key (already a uniform 64-bit hash) with one multiply, keyed by a seed.
///
/// Every request looks each of its keys up here, 512 lookups for a 32k-token prompt: SipHash
/// made that 8 µs of a decision. The keys come from peers, so the table must not be an identity
/// map a peer could fill one bucket of; an xor and an odd multiplier from a seed the peer does
/// not know keep its keys spread (not a cryptographic guarantee; the store is capped anyway).
#[derive(Clone, Copy, Debug)]
pub struct SeededKeyHash {
    xor: u64,
    mul: u64,
}

impl SeededKeyHash {
    /// From any seed (the node passes a random one, the simulator a fixed one).
    pub fn new(seed: u64) -> Self {
        let mix = |mut z: u64| {
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        SeededKeyHash {
            xor: mix(seed),
            mul: mix(seed ^ 0x9e37_79b9_7f4a_7c15) | 1,
        }
    }
}

impl BuildHasher for SeededKeyHash {
    type Hasher = KeyHashState;
    fn build_hasher(&self) -> KeyHashState {
        KeyHashState {
            seed: *self,
            state: 0,
        }
    }
}

/// The state of [`SeededKeyHash`] for one key.
#[derive(Debug)]
pub struct KeyHashState {
    seed: SeededKeyHash,
    state: u64,
}

impl Hasher for KeyHashState {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.state = (self.state.rotate_left(8) ^ u64::from(*b)).wrapping_mul(self.seed.mul);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.state = (v ^ self.seed.xor).wrapping_mul(self.seed.mul);
    }

    fn finish(&self) -> u64 {
        self.state ^ (self.state >> 29)
    }
}

/// Shortest shared prefix a tip names besides the whole prompt, in blocks (4 blocks: 256 tokens at
/// 64-token blocks, below which a shared prefix is not worth a key).
pub const LADDER_FIRST_BLOCKS: usize = 4;

/// Most ladder keys one tip carries (4 · 2^15 blocks: beyond any context served today).
pub const MAX_LADDER_KEYS: usize = 16;

/// The shorter prefix lengths, in blocks, a tip for a prompt of `blocks` blocks names besides its
/// whole length: 4, 8, 16, … below `blocks`, at most [`MAX_LADDER_KEYS`] of them.
pub fn ladder(blocks: usize) -> impl Iterator<Item = usize> {
    (0..MAX_LADDER_KEYS)
        .map(|i| LADDER_FIRST_BLOCKS << i)
        .take_while(move |&len| len < blocks)
}

/// A routed prompt's keys at its [`ladder`]'s lengths, held inline (no allocation when a request
/// is booked): the shorter prefixes its tip names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ladder {
    keys: [BlockKey; MAX_LADDER_KEYS],
    len: u8,
}

impl Ladder {
    /// The ladder of a prompt of `keys`.
    pub fn of(keys: &[BlockKey]) -> Self {
        let mut l = Ladder {
            keys: [BlockKey(0); MAX_LADDER_KEYS],
            len: 0,
        };
        for (slot, len) in l.keys.iter_mut().zip(ladder(keys.len())) {
            *slot = keys[len - 1];
            l.len += 1;
        }
        l
    }

    /// Each shorter prefix as (its last key, its blocks), shortest first.
    pub fn prefixes(&self) -> impl Iterator<Item = (BlockKey, u32)> + '_ {
        self.keys[..usize::from(self.len)]
            .iter()
            .zip(ladder(usize::MAX))
            .map(|(k, len)| (*k, len as u32))
    }
}

impl Default for Ladder {
    fn default() -> Self {
        Ladder::of(&[])
    }
}

/// A tip as the store keeps it: whether a peer has said its prefill answered yet.
#[derive(Clone, Copy, Debug)]
struct Held {
    tip: Tip,
    /// A tip sent at the prefill's first byte ([`PeerTips::insert_first_byte`]) arrived: the
    /// blocks are computed, not only predicted.
    first_byte: bool,
    /// Who first claimed it under way, and when ([`PeerTips::insert_claim`]): a hold on it
    /// that ends without its first byte counts against that peer (`core::unanswered_claims`).
    claim: Option<Claim>,
    /// The first-byte tip came from the claimer itself ([`PeerTips::insert_first_byte_from`]):
    /// only that answer speaks for the claim ([`Answer::ByClaimer`]).
    claimer_answered: bool,
    /// The claimer withdrew it ([`PeerTips::withdraw_from`]: the request failed or was cancelled
    /// before its first byte): answered, so nothing waits on it, but its blocks were never
    /// computed, so it counts as no hit. A new claim of the prefix starts it afresh.
    withdrawn: bool,
    /// The region peer whose tip made the entry (`None`: not from a load update): what it counts
    /// against in the per-peer quota.
    creator: Option<SocketAddr>,
}

/// How a claimed prefill was answered, as far as the peers' tips say ([`PeerTips::answer`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// No first-byte tip counts for it: the claim went unanswered.
    Unanswered,
    /// The peer that claimed it sent its first-byte tip: evidence for that peer.
    ByClaimer,
    /// Only another peer's first-byte tip (or one from no load update) came: the blocks are
    /// computed, so a hold on it ends, but that speaks neither for nor against the claimer. A
    /// peer is trusted only for what it owns: were any member's answer the claimer's, two
    /// colluding members could take back each other's strikes (`core::unanswered_claims`).
    ByAnother,
}

/// A peer's claim that a prefill is under way: its sender and when it arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claim {
    /// The region peer whose load update named it.
    pub from: SocketAddr,
    /// When this node received it (core time).
    pub at: Duration,
}

/// Peer tips by tip key, bounded in all and per peer.
#[derive(Debug)]
pub struct PeerTips {
    by_key: HashMap<u64, Vec<Held>, SeededKeyHash>,
    len: usize,
    cap: usize,
    /// Entries each region peer made (keyed by the live region peers a caller admits).
    by_peer: HashMap<SocketAddr, usize>,
    /// Most entries one peer may make ([`PeerTips::set_peer_quota`]): tips with keys no request
    /// ever matches hold nobody, so no strike catches a peer that sends them, and without a
    /// quota one member could fill the store and crowd out every other peer's tips.
    peer_quota: usize,
}

impl Default for PeerTips {
    fn default() -> Self {
        PeerTips::with_cap(1 << 16, 0)
    }
}

impl PeerTips {
    /// An empty store holding at most `cap` tips, its table keyed by `seed`.
    pub fn with_cap(cap: usize, seed: u64) -> Self {
        PeerTips {
            by_key: HashMap::with_hasher(SeededKeyHash::new(seed)),
            len: 0,
            cap,
            by_peer: HashMap::new(),
            peer_quota: cap,
        }
    }

    /// Sets the most entries one peer may make (the store's cap shared among the region's
    /// peers); entries already held stay until they expire.
    pub fn set_peer_quota(&mut self, quota: usize) {
        self.peer_quota = quota.clamp(1, self.cap.max(1));
    }

    /// Most tips held.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Tips held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// No tips held (the common single-node case: lookups are skipped).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Records that a peer routed `blocks` blocks ending in `key` to `tip.replica`. Returns false
    /// when the store is full (the tip is dropped: the summary round will carry it).
    pub fn insert(&mut self, key: BlockKey, tip: Tip) -> bool {
        self.put(key, tip, false, None)
    }

    /// [`PeerTips::insert`] for a tip a region peer sent, remembering its [`Claim`] (the first
    /// claimer's, where several name one prefill): what a hold on it weighs.
    pub fn insert_claim(&mut self, key: BlockKey, tip: Tip, claim: Claim) -> bool {
        self.put_claim(key, tip, claim)
    }

    /// [`PeerTips::insert`] for a tip a peer sent at the prefill's first byte: the blocks are
    /// computed now, and the prefill no longer counts as under way ([`PeerTips::in_prefill`]).
    pub fn insert_first_byte(&mut self, key: BlockKey, tip: Tip) -> bool {
        self.put(key, tip, true, None)
    }

    /// [`PeerTips::insert_first_byte`] for a tip the region peer at `from` sent: where `from`
    /// is who claimed that prefill, its claim is answered ([`Answer::ByClaimer`]).
    pub fn insert_first_byte_from(&mut self, key: BlockKey, tip: Tip, from: SocketAddr) -> bool {
        self.put(key, tip, true, Some(from))
    }

    /// The region peer at `from` withdraws its claim of the prefill of `tip.blocks` blocks ending
    /// in `key` at `tip.replica` (its request failed or was cancelled before its first byte):
    /// nothing waits on it any more, its hold is answered by the claimer (no strike), and its
    /// blocks never count as a hit. Only the claimer's withdrawal counts, and not once the
    /// prefill answered. Returns whether a claim was withdrawn.
    pub fn withdraw_from(&mut self, key: BlockKey, tip: Tip, from: SocketAddr) -> bool {
        let Some(h) = self.by_key.get_mut(&key.0).and_then(|tips| {
            tips.iter_mut()
                .find(|h| h.tip.replica == tip.replica && h.tip.blocks == tip.blocks)
        }) else {
            return false;
        };
        if h.first_byte || h.claim.is_none_or(|c| c.from != from) {
            return false;
        }
        h.first_byte = true;
        h.claimer_answered = true;
        h.withdrawn = true;
        true
    }

    fn put_claim(&mut self, key: BlockKey, tip: Tip, claim: Claim) -> bool {
        self.merge_or_push(key, tip, Some(claim.from), |h| {
            if h.withdrawn {
                // The prefix is sent again: a new prefill, under way from its own predicted end.
                *h = Held {
                    tip,
                    first_byte: false,
                    claim: Some(claim),
                    claimer_answered: false,
                    withdrawn: false,
                    creator: h.creator,
                };
            } else {
                h.claim = h.claim.or(Some(claim));
            }
        })
    }

    /// A tip, at its first byte (`first_byte`) or not, sent by `answerer` (`None`: not from a
    /// load update).
    fn put(
        &mut self,
        key: BlockKey,
        tip: Tip,
        first_byte: bool,
        answerer: Option<SocketAddr>,
    ) -> bool {
        self.merge_or_push(key, tip, answerer, |h| {
            h.first_byte |= first_byte;
            h.claimer_answered |=
                first_byte && answerer.is_some_and(|from| h.claim.is_some_and(|c| c.from == from));
            // Computed after all: another request of the prompt answered.
            if first_byte {
                h.withdrawn = false;
            }
        })
    }

    /// Merges `tip` into the held one of the same replica and length (the earliest ready, the
    /// latest until), or holds a new one while the store, and `creator`'s quota, have room; then
    /// `mark`s it.
    fn merge_or_push(
        &mut self,
        key: BlockKey,
        tip: Tip,
        creator: Option<SocketAddr>,
        mark: impl FnOnce(&mut Held),
    ) -> bool {
        if tip.blocks == 0 {
            return false;
        }
        let tips = self.by_key.entry(key.0).or_default();
        if let Some(h) = tips
            .iter_mut()
            .find(|h| h.tip.replica == tip.replica && h.tip.blocks == tip.blocks)
        {
            h.tip.ready = h.tip.ready.min(tip.ready);
            h.tip.until = h.tip.until.max(tip.until);
            mark(h);
            return true;
        }
        let made = creator.map_or(0, |p| self.by_peer.get(&p).copied().unwrap_or(0));
        if self.len >= self.cap || made >= self.peer_quota {
            if tips.is_empty() {
                self.by_key.remove(&key.0);
            }
            return false;
        }
        let mut held = Held {
            tip,
            first_byte: false,
            claim: None,
            claimer_answered: false,
            withdrawn: false,
            creator,
        };
        mark(&mut held);
        tips.push(held);
        self.len += 1;
        if let Some(p) = creator {
            *self.by_peer.entry(p).or_default() += 1;
        }
        true
    }

    /// Keeps the entries `keep` holds, and the counts that follow from them.
    fn retain(&mut self, keep: impl Fn(&Held) -> bool) {
        let (mut len, mut by_peer) = (0, HashMap::new());
        self.by_key.retain(|_, tips| {
            tips.retain(&keep);
            for h in tips.iter() {
                if let Some(p) = h.creator {
                    *by_peer.entry(p).or_default() += 1;
                }
            }
            len += tips.len();
            !tips.is_empty()
        });
        self.len = len;
        self.by_peer = by_peer;
    }

    /// Drops every tip of replica `i` (its view slot was given to another replica).
    pub fn forget_replica(&mut self, i: usize) {
        self.retain(|h| h.tip.replica != i);
    }

    /// Drops tips that stopped counting.
    pub fn expire(&mut self, now: Duration) {
        self.retain(|h| h.tip.until > now);
    }

    /// [`PeerTips::hits`] and, in the same pass over `keys`, the replicas a peer sent a prompt
    /// to that is still being computed there (its predicted end ahead of `now`, no first-byte tip
    /// yet) and that `keys` repeat whole or, with `extensions`, begin with: `pending` gets
    /// `(replica, its blocks, its predicted end)` (cleared first; one per replica, the longest,
    /// then the soonest). What a request rides on (the router's `ride_on`). A prompt `keys`
    /// extend is found by its own last key, so every key is looked up once, for both.
    pub fn hits_and_pending(
        &self,
        keys: &[BlockKey],
        extensions: bool,
        now: Duration,
        hits: &mut Vec<(usize, u32)>,
        pending: &mut Vec<(usize, u32, Duration)>,
    ) {
        hits.clear();
        pending.clear();
        if self.is_empty() {
            return;
        }
        let last = keys.len().saturating_sub(1);
        for (j, k) in keys.iter().enumerate() {
            let Some(tips) = self.by_key.get(&k.0) else {
                continue;
            };
            for h in tips {
                let t = &h.tip;
                if h.withdrawn || t.blocks as usize != j + 1 || t.until <= now {
                    continue;
                }
                if t.ready <= now {
                    match hits.iter_mut().find(|(r, _)| *r == t.replica) {
                        Some(e) => e.1 = e.1.max(t.blocks),
                        None => hits.push((t.replica, t.blocks)),
                    }
                } else if !h.first_byte && (extensions || j == last) {
                    match pending.iter_mut().find(|e| e.0 == t.replica) {
                        Some(e) if e.1 < t.blocks => *e = (t.replica, t.blocks, t.ready),
                        Some(e) if e.1 == t.blocks => e.2 = e.2.min(t.ready),
                        Some(_) => {}
                        None => pending.push((t.replica, t.blocks, t.ready)),
                    }
                }
            }
        }
    }

    /// For the request's `keys`, the longest counting peer-routed prefix per replica: appends
    /// `(replica, blocks)` to `out` (cleared first; one entry per replica).
    pub fn hits(&self, keys: &[BlockKey], now: Duration, out: &mut Vec<(usize, u32)>) {
        out.clear();
        if self.is_empty() {
            return;
        }
        for (j, k) in keys.iter().enumerate() {
            let Some(tips) = self.by_key.get(&k.0) else {
                continue;
            };
            for t in tips.iter().filter(|h| !h.withdrawn).map(|h| &h.tip) {
                if t.blocks as usize != j + 1 || t.ready > now || t.until <= now {
                    continue;
                }
                match out.iter_mut().find(|(r, _)| *r == t.replica) {
                    Some(e) => e.1 = e.1.max(t.blocks),
                    None => out.push((t.replica, t.blocks)),
                }
            }
        }
    }

    /// For the request's `keys`, the longest prefix per replica that a peer sent there and whose
    /// prefill has not answered yet, as far as the peers' tips say: no first-byte tip has come
    /// ([`PeerTips::insert_first_byte`]), whether or not its predicted end has passed (the cost
    /// model prices a long prefill short). Appends [`PeerPrefill`]s to `out` (cleared first; one
    /// per replica, the longest).
    ///
    /// What a request riding on another node's prefill waits for: an engine finds a prefix's
    /// blocks only once they are computed, so a follow-up sent while its parent still prefills
    /// there recomputes the parent in parallel (in the agentic replay, a fifth of the turns,
    /// 0.13–0.15 of the queried tokens: docs/peer-bench.md). Behind a balancer the parent was
    /// routed by another node two times in three, whose prefill this node knows only by its tip.
    pub fn in_prefill(&self, keys: &[BlockKey], now: Duration, out: &mut Vec<PeerPrefill>) {
        out.clear();
        if self.is_empty() {
            return;
        }
        for (j, k) in keys.iter().enumerate() {
            let Some(tips) = self.by_key.get(&k.0) else {
                continue;
            };
            for h in tips {
                let t = &h.tip;
                if h.first_byte || t.blocks as usize != j + 1 || t.until <= now {
                    continue;
                }
                let p = PeerPrefill {
                    replica: t.replica,
                    blocks: t.blocks,
                    ready: t.ready,
                    claim: h.claim,
                };
                match out.iter_mut().find(|e| e.replica == t.replica) {
                    Some(e) if e.blocks < p.blocks => *e = p,
                    Some(_) => {}
                    None => out.push(p),
                }
            }
        }
    }

    /// The longest prefix of `keys`, of at least `min_blocks` blocks, that a peer sent to
    /// replica `i` and whose prefill has not answered yet (as [`PeerTips::in_prefill`], for one
    /// replica) for which `counts` holds (the node leaves out claims it distrusts:
    /// `core::unanswered_claims`). Looks up only the keys from `min_blocks` on, longest first,
    /// and stops at the first found: the per-request check of a hold on a peer's prefill
    /// (`core::hold`).
    pub fn in_prefill_at(
        &self,
        i: usize,
        keys: &[BlockKey],
        min_blocks: usize,
        now: Duration,
        counts: impl Fn(&PeerPrefill) -> bool,
    ) -> Option<PeerPrefill> {
        if self.is_empty() {
            return None;
        }
        let from = min_blocks.max(1) - 1;
        (from..keys.len()).rev().find_map(|j| {
            self.by_key.get(&keys[j].0)?.iter().find_map(|h| {
                let t = &h.tip;
                (!h.first_byte && t.replica == i && t.blocks as usize == j + 1 && t.until > now)
                    .then_some(PeerPrefill {
                        replica: t.replica,
                        blocks: t.blocks,
                        ready: t.ready,
                        claim: h.claim,
                    })
                    .filter(|p| counts(p))
            })
        })
    }

    /// How the `blocks`-block prefix ending in `key` at replica `i` was answered, by a
    /// first-byte tip that still counts at `now` ([`Answer`]): a hold released on it was
    /// released by an answer, not by the claim's expiry, and only its claimer's answer speaks
    /// for the claim.
    pub fn answer(&self, i: usize, key: BlockKey, blocks: u32, now: Duration) -> Answer {
        let held = self.by_key.get(&key.0).and_then(|tips| {
            tips.iter().find(|h| {
                h.first_byte && h.tip.replica == i && h.tip.blocks == blocks && h.tip.until > now
            })
        });
        match held {
            None => Answer::Unanswered,
            Some(h) if h.claimer_answered => Answer::ByClaimer,
            Some(_) => Answer::ByAnother,
        }
    }
}

/// A prefix a peer sent to a replica whose prefill has not answered yet
/// ([`PeerTips::in_prefill`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerPrefill {
    /// The replica's view index.
    pub replica: usize,
    /// Leading blocks of the request's prompt that prefill computes.
    pub blocks: u32,
    /// When the peer predicted it done (may have passed: predictions of long prefills run early).
    pub ready: Duration,
    /// Who claimed it, when (`None` for a tip not from a load update: the simulator's).
    pub claim: Option<Claim>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tips_ladder_names_the_shorter_prefixes_at_doubling_lengths() {
        assert_eq!(ladder(4).count(), 0);
        assert_eq!(ladder(5).collect::<Vec<_>>(), vec![4]);
        assert_eq!(ladder(33).collect::<Vec<_>>(), vec![4, 8, 16, 32]);
        assert_eq!(ladder(usize::MAX).count(), MAX_LADDER_KEYS);
        // A request sharing only a 2,048-token system prompt (32 blocks) with a peer's 40-block
        // prompt finds those 32 blocks at the peer's replica.
        let peer = keys(40, 1);
        let mine: Vec<BlockKey> = peer[..32].iter().copied().chain(keys(8, 2)).collect();
        let mut t = PeerTips::default();
        let tip = |blocks| Tip {
            replica: 3,
            blocks,
            ready: Duration::ZERO,
            until: Duration::from_secs(1),
        };
        assert!(t.insert(peer[39], tip(40)));
        let mut out = Vec::new();
        t.hits(&mine, Duration::ZERO, &mut out);
        assert!(
            out.is_empty(),
            "the last key alone says nothing of a shared system prompt"
        );
        let rungs: Vec<(BlockKey, u32)> = Ladder::of(&peer).prefixes().collect();
        assert_eq!(
            rungs,
            vec![(peer[3], 4), (peer[7], 8), (peer[15], 16), (peer[31], 32)]
        );
        for (key, blocks) in rungs {
            assert!(t.insert(key, tip(blocks)));
        }
        t.hits(&mine, Duration::ZERO, &mut out);
        assert_eq!(out, vec![(3, 32)]);
    }

    fn keys(n: u64, salt: u64) -> Vec<BlockKey> {
        // Chained like real keys: a different first block changes every later key.
        (0..n).map(|i| BlockKey(salt * 1_000_003 + i)).collect()
    }

    const S: Duration = Duration::from_secs(1);

    /// Two region peers' addresses.
    fn two_peers() -> (SocketAddr, SocketAddr) {
        (
            "10.0.0.1:7000".parse().unwrap(),
            "10.0.0.2:7000".parse().unwrap(),
        )
    }

    fn tip(replica: usize, blocks: u32) -> Tip {
        Tip {
            replica,
            blocks,
            ready: S,
            until: 10 * S,
        }
    }

    #[test]
    fn an_extension_of_a_peer_routed_prompt_hits_its_whole_length() {
        let mut t = PeerTips::default();
        let routed = keys(8, 1);
        assert!(t.insert(routed[7], tip(3, 8)));
        let mut out = Vec::new();
        // The next turn: the same 8 blocks and 4 more.
        let next = keys(12, 1);
        t.hits(&next, 2 * S, &mut out);
        assert_eq!(out, vec![(3, 8)]);
        // Not before its prefill is predicted done, nor after it expired.
        t.hits(&next, S / 2, &mut out);
        assert!(out.is_empty());
        t.hits(&next, 10 * S, &mut out);
        assert!(out.is_empty());
        // Another prompt never matches.
        t.hits(&keys(12, 2), 2 * S, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn the_longest_unanswered_peer_prefill_at_one_replica_of_at_least_a_length() {
        let mut t = PeerTips::default();
        let parent = keys(8, 1);
        assert!(t.insert(parent[7], tip(3, 8)));
        assert!(t.insert(parent[3], tip(3, 4)));
        assert!(t.insert(parent[5], tip(1, 6)));
        let next = keys(12, 1);
        let at = |t: &PeerTips, i, min| {
            t.in_prefill_at(i, &next, min, 2 * S, |_| true)
                .map(|p| p.blocks)
        };
        assert_eq!(at(&t, 3, 1), Some(8));
        assert_eq!(at(&t, 3, 8), Some(8));
        assert_eq!(at(&t, 3, 9), None);
        assert_eq!(at(&t, 1, 4), Some(6));
        assert_eq!(at(&t, 2, 1), None);
        // The whole prompt answered: the rung still under way, if long enough.
        assert!(t.insert_first_byte(parent[7], tip(3, 8)));
        assert_eq!(at(&t, 3, 1), Some(4));
        assert_eq!(at(&t, 3, 5), None);
        // Expired tips are not under way.
        assert_eq!(t.in_prefill_at(1, &next, 1, 10 * S, |_| true), None);
    }

    #[test]
    fn a_prompt_under_way_is_pending_for_its_repeats_and_with_extensions_for_what_extends_it_and_a_hit_once_computed(
    ) {
        let mut t = PeerTips::default();
        let parent = keys(8, 1);
        assert!(t.insert(parent[7], tip(3, 8)));
        assert!(t.insert(parent[3], tip(3, 4)));
        let (next, mut out, mut hits) = (keys(12, 1), Vec::new(), Vec::new());
        let (ready, early) = (tip(3, 8).ready, S / 2);
        t.hits_and_pending(&parent, false, early, &mut hits, &mut out);
        assert_eq!(out, vec![(3, 8, ready)], "the very prompt");
        t.hits_and_pending(&next, false, early, &mut hits, &mut out);
        assert!(out.is_empty(), "an extension, not asked for");
        t.hits_and_pending(&next, true, early, &mut hits, &mut out);
        assert_eq!(out, vec![(3, 8, ready)], "the longest it extends");
        // Computed (its predicted end passed, or its first byte came): nothing to ride on.
        t.hits_and_pending(&next, true, ready, &mut hits, &mut out);
        assert!(out.is_empty());
        assert_eq!(
            hits,
            vec![(3, 8)],
            "computed by then: a hit, from the same pass"
        );
        assert!(t.insert_first_byte(parent[7], tip(3, 8)));
        t.hits_and_pending(&next, true, early, &mut hits, &mut out);
        assert_eq!(out, vec![(3, 4, ready)], "the rung still under way");
    }

    #[test]
    fn one_peer_makes_at_most_its_quota_of_the_store() {
        let mut t = PeerTips::with_cap(8, 0);
        t.set_peer_quota(4);
        let (a, b) = two_peers();
        let claim = |from| Claim { from, at: S };
        let junk = keys(10, 7);
        let held = (0..10)
            .filter(|&k| t.insert_claim(junk[k], tip(3, 1 + k as u32), claim(a)))
            .count();
        assert_eq!(held, 4, "a's quota");
        assert!(
            t.insert_first_byte_from(keys(1, 9)[0], tip(3, 1), b),
            "b's own share"
        );
        // Expired, a's entries no longer count against it.
        t.expire(100 * S);
        assert!(t.is_empty());
        assert!(t.insert_claim(junk[0], tip(3, 1), claim(a)));
    }

    #[test]
    fn only_the_claimer_withdraws_an_unanswered_claim_and_a_new_claim_starts_afresh() {
        let mut t = PeerTips::default();
        let parent = keys(8, 1);
        let (a, b) = two_peers();
        let claim = |from| Claim { from, at: S };
        let under_way = |t: &PeerTips| t.in_prefill_at(3, &parent, 1, S / 2, |_| true).is_some();
        assert!(t.insert_claim(parent[7], tip(3, 8), claim(a)));
        assert!(!t.withdraw_from(parent[7], tip(3, 8), b), "not b's claim");
        assert!(under_way(&t));
        assert!(t.withdraw_from(parent[7], tip(3, 8), a));
        assert!(!under_way(&t));
        assert_eq!(t.answer(3, parent[7], 8, S), Answer::ByClaimer);
        let mut hits = Vec::new();
        t.hits(&parent, 2 * S, &mut hits);
        assert!(hits.is_empty(), "never computed");
        // Sent again (by b): a new prefill, under way and b's claim.
        assert!(t.insert_claim(parent[7], tip(3, 8), claim(b)));
        assert!(under_way(&t));
        assert_eq!(t.answer(3, parent[7], 8, S), Answer::Unanswered);
        // Answered, then withdrawn by a request that failed: the blocks stand.
        assert!(t.insert_first_byte_from(parent[7], tip(3, 8), b));
        assert!(!t.withdraw_from(parent[7], tip(3, 8), b));
        t.hits(&parent, 2 * S, &mut hits);
        assert_eq!(hits, vec![(3, 8)]);
        // The replica's slot given to another: its tips go.
        t.forget_replica(3);
        assert!(t.is_empty());
    }

    #[test]
    fn a_claim_names_its_first_sender_and_a_distrusted_one_is_passed_over_for_a_shorter() {
        let mut t = PeerTips::default();
        let parent = keys(8, 1);
        let (a, b) = two_peers();
        let claim = |from, at| Claim { from, at };
        assert!(t.insert_claim(parent[7], tip(3, 8), claim(a, S)));
        assert!(t.insert_claim(parent[7], tip(3, 8), claim(b, 2 * S)));
        assert!(t.insert_claim(parent[3], tip(3, 4), claim(b, 2 * S)));
        let next = keys(12, 1);
        let found = t.in_prefill_at(3, &next, 1, 2 * S, |_| true).unwrap();
        assert_eq!((found.blocks, found.claim), (8, Some(claim(a, S))));
        // A's claims left out: B's shorter one.
        let not_a = |p: &PeerPrefill| p.claim.is_some_and(|c| c.from != a);
        let found = t.in_prefill_at(3, &next, 1, 2 * S, not_a).unwrap();
        assert_eq!((found.blocks, found.claim), (4, Some(claim(b, 2 * S))));
        // Answered: by a first-byte tip only, while it counts; for the claim, only by its
        // claimer's (A's), not by B's, who claimed it second, nor by a tip from no update.
        let answer = |t: &PeerTips, key, blocks, now| t.answer(3, key, blocks, now);
        assert_eq!(answer(&t, parent[7], 8, 2 * S), Answer::Unanswered);
        assert!(t.insert_first_byte_from(parent[7], tip(3, 8), b));
        assert!(t.insert_first_byte(parent[7], tip(3, 8)));
        assert_eq!(answer(&t, parent[7], 8, 2 * S), Answer::ByAnother);
        assert!(
            t.in_prefill_at(3, &next, 8, 2 * S, |_| true).is_none(),
            "any answer ends the prefill: its blocks are computed"
        );
        assert!(t.insert_first_byte_from(parent[7], tip(3, 8), a));
        assert_eq!(answer(&t, parent[7], 8, 2 * S), Answer::ByClaimer);
        assert_eq!(
            answer(&t, parent[7], 8, 10 * S),
            Answer::Unanswered,
            "expired"
        );
        assert_eq!(
            t.answer(2, parent[7], 8, 2 * S),
            Answer::Unanswered,
            "another replica"
        );
        assert_eq!(
            answer(&t, parent[3], 4, 2 * S),
            Answer::Unanswered,
            "the rung is not"
        );
        // An answer before any claim is nobody's claim's.
        let mut t = PeerTips::default();
        assert!(t.insert_first_byte_from(parent[7], tip(3, 8), a));
        assert!(t.insert_claim(parent[7], tip(3, 8), claim(a, S)));
        assert_eq!(answer(&t, parent[7], 8, 2 * S), Answer::ByAnother);
    }

    #[test]
    fn a_peers_prefill_is_under_way_until_its_first_byte_tip_even_past_its_predicted_end() {
        let mut t = PeerTips::default();
        let parent = keys(8, 1);
        // The parent's tip and a ladder rung, predicted done at S.
        assert!(t.insert(parent[7], tip(3, 8)));
        assert!(t.insert(parent[3], tip(3, 4)));
        let next = keys(12, 1);
        let mut out = Vec::new();
        let under_way = vec![PeerPrefill {
            replica: 3,
            blocks: 8,
            ready: S,
            claim: None,
        }];
        t.in_prefill(&next, S / 2, &mut out);
        assert_eq!(out, under_way);
        // Past the predicted end with no first byte: still under way (and already a hit).
        t.in_prefill(&next, 2 * S, &mut out);
        assert_eq!(out, under_way);
        // The first-byte tip of the whole prompt ends it; its ladder rung, still unconfirmed,
        // names the shorter prefix until its own first-byte tip comes.
        assert!(t.insert_first_byte(
            parent[7],
            Tip {
                ready: 2 * S,
                ..tip(3, 8)
            }
        ));
        t.in_prefill(&next, 2 * S, &mut out);
        assert_eq!(
            out,
            vec![PeerPrefill {
                replica: 3,
                blocks: 4,
                ready: S,
                claim: None,
            }]
        );
        assert!(t.insert_first_byte(
            parent[3],
            Tip {
                ready: 2 * S,
                ..tip(3, 4)
            }
        ));
        t.in_prefill(&next, 2 * S, &mut out);
        assert!(out.is_empty());
        // A first byte does not make the hit count any sooner than its tip says.
        let mut hits = Vec::new();
        t.hits(&next, 2 * S, &mut hits);
        assert_eq!(hits, vec![(3, 8)]);
        // Another prompt never matches; an expired tip is not under way.
        let mut t = PeerTips::default();
        assert!(t.insert(parent[7], tip(3, 8)));
        t.in_prefill(&keys(12, 2), S / 2, &mut out);
        assert!(out.is_empty());
        t.in_prefill(&next, 10 * S, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn the_longest_tip_per_replica_wins_and_the_store_is_bounded() {
        let mut t = PeerTips::with_cap(3, 7);
        let k = keys(16, 1);
        assert!(t.insert(k[3], tip(0, 4)));
        assert!(t.insert(k[9], tip(0, 10)));
        assert!(t.insert(k[9], tip(1, 10)));
        assert!(
            t.insert(k[9], tip(1, 10)),
            "a repeat refreshes, takes no room"
        );
        assert!(!t.insert(k[12], tip(2, 13)), "full");
        assert_eq!(t.len(), 3);
        // A tip whose block count does not match its position is not a prefix of this request.
        assert!(!t.insert(
            k[5],
            Tip {
                blocks: 0,
                ..tip(2, 1)
            }
        ));
        let mut out = Vec::new();
        t.hits(&k, 2 * S, &mut out);
        out.sort();
        assert_eq!(out, vec![(0, 10), (1, 10)]);
        t.expire(10 * S);
        assert!(t.is_empty());
        assert!(t.insert(k[12], tip(2, 13)), "room again after expiry");
    }
}
