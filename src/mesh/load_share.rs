//! Load sharing: every routing node tells the other nodes of its region, within milliseconds,
//! what it has just sent to each replica, so that all of them route on the region's load and not
//! only on their own.
//!
//! Why: a node sees its own in-flight requests at once, but the others' only through the home's
//! `/metrics` scrape and the gossiped record, 100 ms to a second late. Behind a load balancer that
//! spreads requests over three nodes, each node then piles onto the replica that looks idle to it,
//! in bursts, and the mesh routed 1.33× slower than one node at an equal hit ratio.
//!
//! What travels: a [`LoadUpdate`] in one QUIC datagram (unreliable, unordered, no stream set-up):
//! the sender's *absolute* counts for the replicas whose counts changed, {replica id, requests in
//! flight, uncached prompt tokens not yet prefilled}. Absolute values make loss harmless: the
//! next update of the replica, or the sender's refresh of every non-zero entry each
//! [`LoadShareConfig::refresh`], corrects it; an entry nobody refreshed for
//! [`LoadShareConfig::stale_after`] is dropped, so a lost "back to zero" costs at most that.
//!
//! With the counts go the *tips* of the prompts routed since the last datagram ([`RoutedTip`]:
//! replica, last block key, blocks, predicted ms to prefill end, the data-parallel rank named,
//! whether it is the one sent again at the prompt's first byte;
//! see `core/peer_tips.rs`, `core/rank_hints.rs`), so the other nodes also see where a prefix
//! was just sent, not only that something was, and send its follow-ups to the same rank.
//!
//! Bounded in bytes: a sender flushes at most once per [`LoadShareConfig::min_interval`], so a
//! node sends at most `peers × (1 / min_interval)` datagrams a second of at most
//! [`MAX_LOAD_UPDATE_BYTES`] (in practice one entry of ~25 bytes per changed replica and one tip
//! of ~35 bytes per routed request; tips beyond what one flush can carry split into more
//! datagrams, and the node keeps at most 1,024 between flushes). That bound grows with the
//! region (every update goes to every peer), so the node also paces its flushes by a byte
//! budget, `mesh.load_share_budget_kib_s` sent per second (`node/load_share.rs::Pacing`): it
//! receives about as much from peers doing the same, whatever the region's size.
//! Bounded in trust: a peer's claim for a replica counts at most the
//! replica's `max_in_flight` requests and [`LoadShareConfig::max_tokens_per_request`] tokens per
//! request; claims for replicas this node does not know are ignored; at most
//! [`LoadShareConfig::max_peers`] peers and [`LoadShareConfig::max_entries_per_peer`] entries a
//! peer are kept. The node weighs the sum over peers against the engine's own figures
//! ([`PeerLoads::judge`] at each figure the engine reports, [`PeerLoads::weigh`] in between,
//! `node/load_share.rs`): claims ahead of a fresh figure count for a few seconds and then only
//! as far as the engine backs them, and tokens per request are bounded by the replica's KV
//! capacity, so lying peers add only a small phantom load, briefly (or, timed to be within each
//! figure as it arrives, at most the slack: `max(16, max_in_flight / 8)` requests).
//!
//! Sans-IO: [`LoadPublisher`] decides what to send and [`PeerLoads`] merges what arrives; time is
//! an argument. The transport carries the bytes, the node drives both.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::schema::MAX_REPLICA_ID_BYTES;

/// Largest encoded update: fits one QUIC datagram on a 1280-byte-MTU path.
pub const MAX_LOAD_UPDATE_BYTES: usize = 1100;

/// Settings of load sharing (`[mesh]` keys `load_share_*`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoadShareConfig {
    /// Least time between two flushes of a sender. Default 2 ms: a tenth of a short prompt's
    /// prefill, and at most 500 datagrams a second per peer.
    pub min_interval: Duration,
    /// Every non-zero entry is re-sent this often, to repair lost datagrams. Default 1 s.
    pub refresh: Duration,
    /// An entry not refreshed for this long is dropped. Default 3 s (three refreshes).
    pub stale_after: Duration,
    /// Peers whose claims are kept at most. Default 256.
    pub max_peers: usize,
    /// Entries kept per peer at most. Default 4096.
    pub max_entries_per_peer: usize,
    /// Uncached prompt tokens one in-flight request may claim at most. Default 2^21 (2M tokens,
    /// beyond any context window served today); the node bounds it again by the replica's KV
    /// capacity.
    pub max_tokens_per_request: u64,
    /// How long peers' claims for a replica may run ahead of what its engine reports (the
    /// scrape's and gossip's lag, a burst the engine has not counted yet) before only what the
    /// engine backs counts. Default 3 s (the lag is ≤ 1–2 s with the default intervals).
    pub unbacked_grace: Duration,
    /// How long claims must stay within the engine's figures before they may run ahead again.
    /// Default 30 s: a member that alternates lies with silence gets at most `unbacked_grace`
    /// of effect in every `trust_after` (~10 %).
    pub trust_after: Duration,
}

impl Default for LoadShareConfig {
    fn default() -> Self {
        LoadShareConfig {
            min_interval: Duration::from_millis(2),
            refresh: Duration::from_secs(1),
            stale_after: Duration::from_secs(3),
            max_peers: 256,
            max_entries_per_peer: 4096,
            max_tokens_per_request: 1 << 21,
            unbacked_grace: Duration::from_secs(3),
            trust_after: Duration::from_secs(30),
        }
    }
}

/// One replica's load as the sending node has it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadEntry {
    /// Replica id.
    pub replica: String,
    /// Requests the sender has in flight there.
    pub in_flight: u32,
    /// Uncached prompt tokens of those requests with no first byte yet.
    pub pending_tokens: u64,
}

/// A prefix the sender just routed (see `core/peer_tips.rs`): its last block key and length.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoutedTip {
    /// Replica id.
    pub replica: String,
    /// The prompt's last block key (`BlockKey.0`).
    pub key: u64,
    /// Blocks of the prompt.
    pub blocks: u32,
    /// Predicted ms from sending until its prefill is done (its blocks count from then).
    pub ready_ms: u32,
    /// The data-parallel rank the sender named for it, if any, so that nodes which do not
    /// follow the replica's KV events can send its follow-ups to the same rank
    /// (`core/rank_hints.rs`); receivers drop a rank past the replica's ranks (≤ 64). Added
    /// after the first version (positional: always written, `nil` when none).
    #[serde(default)]
    pub rank: Option<u16>,
    /// Sent at the prompt's first byte (`ready_ms` 0): its prefill has answered, so a request
    /// riding on it need wait no longer (`core::peer_tips::PeerTips::in_prefill`). Added after
    /// `rank` (positional; a sender without it reads as false).
    #[serde(default)]
    pub first_byte: bool,
    /// Sent when the prompt's request failed or was cancelled before its first byte: the
    /// sender withdraws its claim that the prefill is under way (nothing waits on it; its blocks
    /// never count). Only the claimer's withdrawal counts
    /// (`core::peer_tips::PeerTips::withdraw_from`). Added after `first_byte` (positional; a
    /// sender without it reads as false) and written only when true: a node of the version
    /// before refuses an array longer than it knows, so every other tip stays in its form.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub withdrawn: bool,
}

/// One datagram: the sender's incarnation, a sequence number, changed entries and the prefixes
/// routed since the last one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadUpdate {
    /// Random per sender start: a restarted peer's counts replace its old ones.
    pub origin: u64,
    /// Increases with every datagram of this origin; older ones arriving late are ignored.
    pub seq: u64,
    /// Absolute counts; an entry of zeros removes the replica.
    pub entries: Vec<LoadEntry>,
    /// Prefixes routed since the previous datagram.
    #[serde(default)]
    pub tips: Vec<RoutedTip>,
}

/// Why an update was refused.
#[derive(Debug, thiserror::Error)]
pub enum LoadShareError {
    /// Not decodable, over the size limit, or with a bad replica id.
    #[error("malformed load update: {0}")]
    Malformed(String),
    /// Older than one already applied from the same sender.
    #[error("stale load update (seq {seq} ≤ {last})")]
    Stale {
        /// Its seq.
        seq: u64,
        /// The last applied.
        last: u64,
    },
    /// The peer table is full and this is a new peer.
    #[error("too many peers sharing load")]
    TooManyPeers,
}

impl LoadUpdate {
    /// Positional msgpack (field names would double the size of a small datagram).
    pub fn encode(&self) -> Result<Vec<u8>, LoadShareError> {
        let bytes =
            rmp_serde::to_vec(self).map_err(|e| LoadShareError::Malformed(e.to_string()))?;
        if bytes.len() > MAX_LOAD_UPDATE_BYTES {
            return Err(LoadShareError::Malformed(format!(
                "{} bytes (max {MAX_LOAD_UPDATE_BYTES})",
                bytes.len()
            )));
        }
        Ok(bytes)
    }

    /// Decodes a peer's datagram (bounded; ids checked).
    pub fn decode(bytes: &[u8]) -> Result<Self, LoadShareError> {
        if bytes.len() > MAX_LOAD_UPDATE_BYTES {
            return Err(LoadShareError::Malformed(format!("{} bytes", bytes.len())));
        }
        let u: LoadUpdate =
            rmp_serde::from_slice(bytes).map_err(|e| LoadShareError::Malformed(e.to_string()))?;
        let bad = |id: &str| id.is_empty() || id.len() > MAX_REPLICA_ID_BYTES;
        if let Some(id) = u
            .entries
            .iter()
            .map(|e| e.replica.as_str())
            .chain(u.tips.iter().map(|t| t.replica.as_str()))
            .find(|id| bad(id))
        {
            return Err(LoadShareError::Malformed(format!(
                "replica id of {} bytes",
                id.len()
            )));
        }
        Ok(u)
    }

    /// Splits `entries` and `tips` into datagrams of at most [`MAX_LOAD_UPDATE_BYTES`],
    /// numbered from `*seq` (advanced past the last one).
    pub fn split(
        origin: u64,
        seq: &mut u64,
        entries: Vec<LoadEntry>,
        tips: Vec<RoutedTip>,
    ) -> Vec<Vec<u8>> {
        // An entry costs at most 1 (array) + 2 + id + 5 + 9 bytes, a tip 1 + 2 + id + 9 + 5 + 5
        // + 3 (its rank) + 1 (its first byte);
        // the envelope 1 + 9 + 9 + 3 + 3.
        const ENVELOPE: usize = 25;
        let mut out = Vec::new();
        let mut batch = LoadUpdate {
            origin,
            seq: 0,
            entries: Vec::new(),
            tips: Vec::new(),
        };
        let mut size = ENVELOPE;
        let mut flush = |batch: &mut LoadUpdate, out: &mut Vec<Vec<u8>>| {
            if batch.entries.is_empty() && batch.tips.is_empty() {
                return;
            }
            *seq += 1;
            batch.seq = *seq;
            match batch.encode() {
                Ok(b) => out.push(b),
                Err(e) => tracing::debug!(error = %e, "load update not sent"),
            }
            batch.entries.clear();
            batch.tips.clear();
        };
        let ok = |id: &str| !id.is_empty() && id.len() <= MAX_REPLICA_ID_BYTES;
        for e in entries.into_iter().filter(|e| ok(&e.replica)) {
            let cost = 17 + e.replica.len();
            if size + cost > MAX_LOAD_UPDATE_BYTES {
                flush(&mut batch, &mut out);
                size = ENVELOPE;
            }
            size += cost;
            batch.entries.push(e);
        }
        for t in tips.into_iter().filter(|t| ok(&t.replica)) {
            let cost = 26 + t.replica.len();
            if size + cost > MAX_LOAD_UPDATE_BYTES {
                flush(&mut batch, &mut out);
                size = ENVELOPE;
            }
            size += cost;
            batch.tips.push(t);
        }
        flush(&mut batch, &mut out);
        out
    }
}

/// The sending side: what changed since the last flush, plus a periodic refresh.
#[derive(Debug)]
pub struct LoadPublisher {
    /// This sender's incarnation.
    pub origin: u64,
    seq: u64,
    /// What peers were last told, non-zero entries only.
    sent: HashMap<String, (u32, u64)>,
    last_refresh: Option<Duration>,
    refresh: Duration,
}

impl LoadPublisher {
    /// A publisher with a random-enough `origin` (the node passes one from its RNG or clock).
    pub fn new(origin: u64, cfg: &LoadShareConfig) -> Self {
        LoadPublisher {
            origin,
            seq: 0,
            sent: HashMap::new(),
            last_refresh: None,
            refresh: cfg.refresh,
        }
    }

    /// The datagrams to send now, given this node's current counts for every replica it routes
    /// to (`own`: id, in flight, pending tokens; zeros allowed) and the prefixes it routed since
    /// the last flush. Changed entries always; every non-zero entry when the refresh is due.
    pub fn flush<'a>(
        &mut self,
        own: impl IntoIterator<Item = (&'a str, u32, u64)>,
        tips: Vec<RoutedTip>,
        now: Duration,
    ) -> Vec<Vec<u8>> {
        let refresh = self
            .last_refresh
            .is_none_or(|t| now.saturating_sub(t) >= self.refresh);
        if refresh {
            self.last_refresh = Some(now);
        }
        let mut entries = Vec::new();
        for (id, in_flight, pending) in own {
            let now_v = (in_flight, pending);
            let before = self.sent.get(id).copied().unwrap_or((0, 0));
            let changed = before != now_v;
            if now_v == (0, 0) {
                if changed {
                    self.sent.remove(id);
                }
            } else if changed {
                self.sent.insert(id.to_owned(), now_v);
            }
            if changed || (refresh && now_v != (0, 0)) {
                entries.push(LoadEntry {
                    replica: id.to_owned(),
                    in_flight,
                    pending_tokens: pending,
                });
            }
        }
        LoadUpdate::split(self.origin, &mut self.seq, entries, tips)
    }
}

/// One peer's claim for one replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claim {
    /// Requests in flight (already bounded).
    pub in_flight: u32,
    /// Pending prompt tokens (already bounded).
    pub pending_tokens: u64,
    /// When it was last set or refreshed.
    seen: Duration,
}

#[derive(Debug)]
struct PeerTable {
    origin: u64,
    seq: u64,
    claims: HashMap<String, Claim>,
}

/// Counts of an applied update, for metrics.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Replicas whose claimed load from this peer changed (recompute their totals).
    pub changed: Vec<String>,
    /// Entries for replicas this node does not know (ignored).
    pub unknown: usize,
    /// Entries whose values were cut to their bounds.
    pub clamped: usize,
}

/// How far the claims at a replica with `slack` (see [`PeerLoads::weigh`]) may run ahead of a
/// fresh figure and still be backed: a quarter of the slack, at least 2 requests. It covers
/// requests sent and not yet counted by the engine, and a figure gossip brought a moment after
/// its home read it; a member may add that much phantom load for as long as it likes.
pub fn judge_tolerance(slack: u32) -> u32 {
    (slack / 4).max(2)
}

/// How the peers' claims for one replica stand against what its engine reports.
#[derive(Clone, Copy, Debug, Default)]
struct Backing {
    /// When the claims were last judged against a figure.
    judged_at: Duration,
    /// Since when the claims have run ahead of the engine (kept through short backed spells).
    unbacked_since: Option<Duration>,
    /// Since when they have stayed within the engine's figures, while `unbacked_since` is set.
    backed_since: Option<Duration>,
}

/// The receiving side: every region peer's latest claims, bounded.
#[derive(Debug)]
pub struct PeerLoads {
    cfg: LoadShareConfig,
    peers: HashMap<SocketAddr, PeerTable>,
    /// Replicas whose claims were judged against their engine (at most `max_entries_per_peer`).
    backing: HashMap<String, Backing>,
}

impl PeerLoads {
    /// An empty table.
    pub fn new(cfg: LoadShareConfig) -> Self {
        PeerLoads {
            cfg,
            peers: HashMap::new(),
            backing: HashMap::new(),
        }
    }

    /// Judges the peers' `claimed` requests at `replica` against a figure its engine has just
    /// reported: `backed` requests beyond this node's own, read at the same moment. Called when
    /// a figure arrives, so that claim and figure are like for like: judged against an older
    /// figure, honest claims run ahead of it by everything routed since, and a region whose
    /// load rose for three seconds lost its peers' claims for the next thirty (three nodes'
    /// hot burst, issue #37: each node saw every replica at its last scrape plus its own
    /// requests, 40 % under their real count, and sent runs of requests to one of them).
    /// `tolerance` covers requests sent but not yet counted by the engine, and a figure that
    /// came by gossip, a moment old.
    pub fn judge(
        &mut self,
        replica: &str,
        claimed: u32,
        backed: u32,
        tolerance: u32,
        now: Duration,
    ) {
        if !self.backing.contains_key(replica) {
            if self.backing.len() >= self.cfg.max_entries_per_peer {
                return;
            }
            self.backing.insert(replica.to_owned(), Backing::default());
        }
        let Some(b) = self.backing.get_mut(replica) else {
            return;
        };
        b.judged_at = now;
        if claimed <= backed.saturating_add(tolerance) {
            if b.unbacked_since.is_some() {
                let since = *b.backed_since.get_or_insert(now);
                if now.saturating_sub(since) >= self.cfg.trust_after {
                    b.unbacked_since = None;
                    b.backed_since = None;
                }
            }
        } else {
            b.backed_since = None;
            b.unbacked_since.get_or_insert(now);
        }
    }

    /// How many of the peers' `claimed` requests at `replica` count, given that its engine
    /// last reported `backed` requests beyond this node's own. What the engine backs counts.
    /// Up to `slack` more count while the claims are trusted: at every figure since `trust_after`
    /// ago they were within it ([`Self::judge`]), or they ran ahead for less than
    /// `unbacked_grace`. Past it, only what the engine backs, until they have stayed within the
    /// figures for `trust_after`. So a member claiming what no engine confirms steers traffic
    /// for seconds, not for as long as it likes. With no figure judged for `unbacked_grace`
    /// (none arrives), the claims are judged here against the last one.
    pub fn weigh(
        &mut self,
        replica: &str,
        claimed: u32,
        backed: u32,
        slack: u32,
        now: Duration,
    ) -> u32 {
        if claimed <= backed {
            return claimed;
        }
        let stale = self
            .backing
            .get(replica)
            .is_none_or(|b| now.saturating_sub(b.judged_at) >= self.cfg.unbacked_grace);
        if stale {
            self.judge(replica, claimed, backed, judge_tolerance(slack), now);
        }
        let Some(b) = self.backing.get(replica) else {
            // The table is full: nothing is trusted beyond the engine.
            return backed;
        };
        let excess = match b.unbacked_since {
            Some(since) if now.saturating_sub(since) >= self.cfg.unbacked_grace => 0,
            _ => slack,
        };
        claimed.min(backed.saturating_add(excess))
    }

    /// Replicas whose claims ran ahead of their engine lately: to weigh again as time passes.
    pub fn unbacked(&self) -> Vec<String> {
        self.backing
            .iter()
            .filter(|(_, b)| b.unbacked_since.is_some())
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Applies `update` from the peer at `from`. `max_in_flight(id)` is the replica's bound on
    /// requests, or `None` for a replica this node does not know (the entry is ignored).
    pub fn apply(
        &mut self,
        from: SocketAddr,
        update: LoadUpdate,
        now: Duration,
        max_in_flight: impl Fn(&str) -> Option<u32>,
    ) -> Result<Applied, LoadShareError> {
        if !self.peers.contains_key(&from) && self.peers.len() >= self.cfg.max_peers {
            return Err(LoadShareError::TooManyPeers);
        }
        let mut applied = Applied::default();
        let table = self.peers.entry(from).or_insert(PeerTable {
            origin: update.origin,
            seq: 0,
            claims: HashMap::new(),
        });
        if table.origin != update.origin {
            // The peer restarted: its old counts are void.
            applied
                .changed
                .extend(table.claims.drain().map(|(id, _)| id));
            table.origin = update.origin;
            table.seq = 0;
        } else if update.seq <= table.seq {
            return Err(LoadShareError::Stale {
                seq: update.seq,
                last: table.seq,
            });
        }
        table.seq = update.seq;
        for e in update.entries {
            let Some(max) = max_in_flight(&e.replica) else {
                applied.unknown += 1;
                continue;
            };
            let in_flight = e.in_flight.min(max);
            let pending = e
                .pending_tokens
                .min(u64::from(in_flight).saturating_mul(self.cfg.max_tokens_per_request));
            if (in_flight, pending) != (e.in_flight, e.pending_tokens) {
                applied.clamped += 1;
            }
            let claim = Claim {
                in_flight,
                pending_tokens: pending,
                seen: now,
            };
            let old = if in_flight == 0 && pending == 0 {
                table.claims.remove(&e.replica)
            } else if let Some(c) = table.claims.get_mut(&e.replica) {
                Some(std::mem::replace(c, claim))
            } else if table.claims.len() < self.cfg.max_entries_per_peer {
                table.claims.insert(e.replica.clone(), claim)
            } else {
                applied.clamped += 1;
                continue;
            };
            let same = old.is_some_and(|o| {
                (o.in_flight, o.pending_tokens) == (claim.in_flight, claim.pending_tokens)
            }) || (old.is_none() && in_flight == 0 && pending == 0);
            if !same {
                applied.changed.push(e.replica);
            }
        }
        Ok(applied)
    }

    /// Drops claims not refreshed within `stale_after`, and the judgements of replicas no
    /// figure has come for since (a replica gone, an engine silent) unless they found the
    /// claims unbacked; returns the replicas whose claims were dropped.
    pub fn expire(&mut self, now: Duration) -> Vec<String> {
        let stale_after = self.cfg.stale_after;
        let mut changed = Vec::new();
        for t in self.peers.values_mut() {
            t.claims.retain(|id, c| {
                let keep = now.saturating_sub(c.seen) < stale_after;
                if !keep {
                    changed.push(id.clone());
                }
                keep
            });
        }
        self.peers.retain(|_, t| !t.claims.is_empty());
        self.backing.retain(|_, b| {
            b.unbacked_since.is_some() || now.saturating_sub(b.judged_at) < stale_after
        });
        changed
    }

    /// Forgets every peer for which `live` is false (left the mesh or the region); returns the
    /// replicas whose totals changed.
    pub fn retain_peers(&mut self, live: impl Fn(&SocketAddr) -> bool) -> Vec<String> {
        let mut changed = Vec::new();
        self.peers.retain(|a, t| {
            let keep = live(a);
            if !keep {
                changed.extend(t.claims.keys().cloned());
            }
            keep
        });
        changed
    }

    /// The sum of every peer's claims for `replica`: (requests in flight, pending tokens).
    pub fn totals(&self, replica: &str) -> (u32, u64) {
        self.peers
            .values()
            .filter_map(|t| t.claims.get(replica))
            .fold((0u32, 0u64), |(n, p), c| {
                (
                    n.saturating_add(c.in_flight),
                    p.saturating_add(c.pending_tokens),
                )
            })
    }

    /// The requests the peer at `peer` claims in flight at this region's replicas, in all (0
    /// for a peer with no claims).
    pub fn in_flight_of(&self, peer: &SocketAddr) -> u32 {
        self.peers.get(peer).map_or(0, |t| {
            t.claims
                .values()
                .fold(0u32, |n, c| n.saturating_add(c.in_flight))
        })
    }

    /// Peers with at least one claim.
    pub fn peers(&self) -> usize {
        self.peers.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn known(id: &str) -> Option<u32> {
        id.starts_with('r').then_some(256)
    }

    fn update(origin: u64, seq: u64, entries: &[(&str, u32, u64)]) -> LoadUpdate {
        LoadUpdate {
            origin,
            seq,
            tips: Vec::new(),
            entries: entries
                .iter()
                .map(|(r, n, p)| LoadEntry {
                    replica: (*r).to_owned(),
                    in_flight: *n,
                    pending_tokens: *p,
                })
                .collect(),
        }
    }

    const T0: Duration = Duration::ZERO;

    #[test]
    fn a_peer_counts_once_its_update_arrives_and_stops_at_zero() {
        let mut loads = PeerLoads::new(LoadShareConfig::default());
        let a = loads
            .apply(addr(1), update(7, 1, &[("r0", 3, 9000)]), T0, known)
            .unwrap();
        assert_eq!(a.changed, vec!["r0".to_owned()]);
        assert_eq!(loads.totals("r0"), (3, 9000));
        loads
            .apply(addr(2), update(8, 1, &[("r0", 1, 100)]), T0, known)
            .unwrap();
        assert_eq!(loads.totals("r0"), (4, 9100), "peers add up");
        loads
            .apply(addr(1), update(7, 2, &[("r0", 0, 0)]), T0, known)
            .unwrap();
        assert_eq!(loads.totals("r0"), (1, 100));
        // Per peer, over its replicas: what bounds its word on its tenants' requests.
        loads
            .apply(addr(2), update(8, 2, &[("r1", 4, 0)]), T0, known)
            .unwrap();
        assert_eq!(loads.in_flight_of(&addr(2)), 5);
        assert_eq!(loads.in_flight_of(&addr(1)), 0);
    }

    #[test]
    fn late_datagrams_never_undo_newer_ones() {
        let mut loads = PeerLoads::new(LoadShareConfig::default());
        loads
            .apply(addr(1), update(7, 5, &[("r0", 2, 10)]), T0, known)
            .unwrap();
        let late = loads.apply(addr(1), update(7, 4, &[("r0", 9, 99)]), T0, known);
        assert!(matches!(late, Err(LoadShareError::Stale { .. })));
        assert_eq!(loads.totals("r0"), (2, 10));
    }

    #[test]
    fn a_restarted_peer_replaces_its_old_counts() {
        let mut loads = PeerLoads::new(LoadShareConfig::default());
        loads
            .apply(
                addr(1),
                update(7, 50, &[("r0", 2, 10), ("r1", 1, 1)]),
                T0,
                known,
            )
            .unwrap();
        let a = loads
            .apply(addr(1), update(8, 1, &[("r0", 1, 5)]), T0, known)
            .unwrap();
        assert!(a.changed.contains(&"r1".to_owned()));
        assert_eq!(loads.totals("r0"), (1, 5));
        assert_eq!(loads.totals("r1"), (0, 0));
    }

    #[test]
    fn absurd_claims_are_cut_to_their_bounds_and_unknown_replicas_ignored() {
        let cfg = LoadShareConfig::default();
        let mut loads = PeerLoads::new(cfg);
        let a = loads
            .apply(
                addr(1),
                update(7, 1, &[("r0", u32::MAX, u64::MAX), ("x9", 5, 5)]),
                T0,
                known,
            )
            .unwrap();
        assert_eq!(a.unknown, 1);
        assert_eq!(a.clamped, 1);
        assert_eq!(loads.totals("r0"), (256, 256 * cfg.max_tokens_per_request));
        assert_eq!(loads.totals("x9"), (0, 0));
        // Tokens without requests are not load.
        loads
            .apply(addr(1), update(7, 2, &[("r1", 0, 1 << 40)]), T0, known)
            .unwrap();
        assert_eq!(loads.totals("r1"), (0, 0));
    }

    /// Issue #35: a member claimed `u32::MAX` in flight at a replica whose engine reported
    /// nothing, and every node steered away from it for as long as the member kept saying so.
    #[test]
    fn claims_no_engine_confirms_count_for_the_grace_then_not_until_trust_returns() {
        let cfg = LoadShareConfig::default();
        let mut p = PeerLoads::new(cfg);
        let s = Duration::from_secs;
        // What the engine backs always counts.
        assert_eq!(p.weigh("r", 5, 8, 16, s(0)), 5);
        // A burst ahead of the engine: the slack counts, for the grace.
        assert_eq!(p.weigh("r", 40, 8, 16, s(0)), 24);
        assert_eq!(p.weigh("r", 40, 8, 16, s(2)), 24);
        // Past the grace, still unconfirmed: only what the engine backs.
        assert_eq!(p.weigh("r", 40, 8, 16, cfg.unbacked_grace), 8);
        // Alternating with silence does not earn the slack back...
        for t in 4..30 {
            assert_eq!(p.weigh("r", 0, 8, 16, s(t)), 0);
            assert_eq!(p.weigh("r", 40, 8, 16, s(t)), 8, "at {t} s");
        }
        // ...nor does being within the figures when one arrives, once...
        p.judge("r", 3, 8, 4, s(30));
        assert_eq!(p.weigh("r", 40, 8, 16, s(31)), 8);
        // ...only staying within them at every figure for `trust_after` does.
        for t in 31..=(31 + cfg.trust_after.as_secs()) {
            p.judge("r", 3, 8, 4, s(t));
        }
        assert!(p.unbacked().is_empty());
        assert_eq!(p.weigh("r", 40, 8, 16, s(62)), 24);
        // Another replica is weighed on its own.
        assert_eq!(p.weigh("q", 2, 0, 16, s(62)), 2);
        assert!(
            p.unbacked().is_empty(),
            "2 unbacked requests are within the tolerance"
        );
    }

    /// Issue #37: three honest nodes in a rising burst. Each figure the engine reports is
    /// judged against the claims at that moment; in between, the claims run ahead of it by what
    /// the region sent since, and count. Judged against the last figure at every update, they
    /// lost their weight three seconds in, and every node saw every replica at its last read
    /// plus its own requests (40 % under their real count).
    #[test]
    fn honest_claims_ahead_of_a_figure_read_before_the_rise_keep_their_weight() {
        let cfg = LoadShareConfig::default();
        let mut p = PeerLoads::new(cfg);
        let mut backed = 0;
        // 20 s: the region's requests there rise by one every 100 ms, this node's a third of
        // them; each second the engine's figure arrives, one request short of the routers'.
        for step in 0..200u32 {
            let now = Duration::from_millis(100 * u64::from(step));
            let routers = 1 + step / 2;
            let own = routers / 3;
            let claimed = routers - own;
            if step % 10 == 0 {
                backed = claimed.saturating_sub(1);
                p.judge("r", claimed, backed, judge_tolerance(16), now);
            }
            assert_eq!(
                p.weigh("r", claimed, backed, 16, now),
                claimed,
                "at {now:?}"
            );
        }
        assert!(p.unbacked().is_empty());
        // A replica no figure comes for any more is forgotten.
        assert_eq!(p.backing.len(), 1);
        p.expire(Duration::from_secs(30));
        assert!(p.backing.is_empty());
    }

    /// The price of judging only at the figures: claims timed to be within each figure as it
    /// arrives and ahead of it in between count up to the slack. Claims ahead of a figure even
    /// by a little more than the tolerance are caught at it.
    #[test]
    fn claims_ahead_of_a_fresh_figure_by_more_than_the_tolerance_lose_the_slack_after_the_grace() {
        let cfg = LoadShareConfig::default();
        let mut p = PeerLoads::new(cfg);
        let tolerance = judge_tolerance(16);
        let mut weighed = 0;
        for t in 0..10 {
            let now = Duration::from_secs(t);
            p.judge("r", 8 + tolerance + 1, 8, tolerance, now);
            weighed = p.weigh("r", 8 + tolerance + 1, 8, 16, now);
        }
        assert_eq!(weighed, 8, "only what the engine backs");
        assert_eq!(p.unbacked(), vec!["r".to_owned()]);
    }

    #[test]
    fn tables_are_capped_in_peers_and_entries() {
        let cfg = LoadShareConfig {
            max_peers: 2,
            max_entries_per_peer: 2,
            ..LoadShareConfig::default()
        };
        let mut loads = PeerLoads::new(cfg);
        for p in 1..=2 {
            loads
                .apply(addr(p), update(1, 1, &[("r0", 1, 1)]), T0, known)
                .unwrap();
        }
        assert!(matches!(
            loads.apply(addr(3), update(1, 1, &[("r0", 1, 1)]), T0, known),
            Err(LoadShareError::TooManyPeers)
        ));
        let a = loads
            .apply(
                addr(1),
                update(1, 2, &[("r1", 1, 1), ("r2", 1, 1), ("r3", 1, 1)]),
                T0,
                known,
            )
            .unwrap();
        assert_eq!(a.clamped, 2, "with r0 held, only r1 fits");
        assert_eq!(loads.totals("r1"), (1, 1));
        assert_eq!(loads.totals("r3"), (0, 0));
    }

    #[test]
    fn unrefreshed_claims_and_departed_peers_are_dropped() {
        let cfg = LoadShareConfig::default();
        let mut loads = PeerLoads::new(cfg);
        loads
            .apply(addr(1), update(1, 1, &[("r0", 1, 1)]), T0, known)
            .unwrap();
        loads
            .apply(addr(2), update(2, 1, &[("r1", 1, 1)]), T0, known)
            .unwrap();
        assert!(loads.expire(cfg.stale_after / 2).is_empty());
        loads
            .apply(
                addr(1),
                update(1, 2, &[("r0", 1, 1)]),
                cfg.stale_after,
                known,
            )
            .unwrap();
        assert_eq!(
            loads.expire(cfg.stale_after + Duration::from_millis(1)),
            vec!["r1".to_owned()]
        );
        assert_eq!(loads.retain_peers(|a| *a != addr(1)), vec!["r0".to_owned()]);
        assert_eq!(loads.peers(), 0);
    }

    #[test]
    fn the_publisher_sends_changes_at_once_and_refreshes_the_rest() {
        let cfg = LoadShareConfig::default();
        let mut p = LoadPublisher::new(42, &cfg);
        let decode = |d: Vec<Vec<u8>>| -> Vec<LoadEntry> {
            d.iter()
                .flat_map(|b| LoadUpdate::decode(b).unwrap().entries)
                .collect()
        };
        // First flush: a refresh, non-zero entries only.
        let e = decode(p.flush([("r0", 1, 100), ("r1", 0, 0)], Vec::new(), T0));
        assert_eq!(e.len(), 1);
        // Unchanged and no refresh due: nothing.
        assert!(p
            .flush(
                [("r0", 1, 100), ("r1", 0, 0)],
                Vec::new(),
                Duration::from_millis(5)
            )
            .is_empty());
        // A change, including back to zero, goes out.
        let e = decode(p.flush(
            [("r0", 0, 0), ("r1", 2, 7)],
            Vec::new(),
            Duration::from_millis(10),
        ));
        assert_eq!(e.len(), 2);
        assert!(e.iter().any(|x| x.replica == "r0" && x.in_flight == 0));
        // At the refresh, every non-zero entry again.
        let e = decode(p.flush([("r0", 0, 0), ("r1", 2, 7)], Vec::new(), cfg.refresh));
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].replica, "r1");
    }

    #[test]
    fn a_tip_from_a_sender_without_the_first_byte_field_reads_as_not_answered() {
        // The tip as written before `first_byte` (positional: five fields).
        #[derive(Serialize)]
        struct OldTip {
            replica: String,
            key: u64,
            blocks: u32,
            ready_ms: u32,
            rank: Option<u16>,
        }
        #[derive(Serialize)]
        struct OldUpdate {
            origin: u64,
            seq: u64,
            entries: Vec<LoadEntry>,
            tips: Vec<OldTip>,
        }
        let old = OldUpdate {
            origin: 1,
            seq: 1,
            entries: Vec::new(),
            tips: vec![OldTip {
                replica: "r0".into(),
                key: 7,
                blocks: 12,
                ready_ms: 30,
                rank: None,
            }],
        };
        let u = LoadUpdate::decode(&rmp_serde::to_vec(&old).unwrap()).unwrap();
        assert!(!u.tips[0].first_byte && !u.tips[0].withdrawn);
        assert_eq!((u.tips[0].key, u.tips[0].blocks), (7, 12));
        let mut answered = u.clone();
        answered.tips[0].first_byte = true;
        let back = LoadUpdate::decode(&answered.encode().unwrap()).unwrap();
        assert_eq!(back, answered);
        let mut withdrawn = u.clone();
        withdrawn.tips[0].withdrawn = true;
        let back = LoadUpdate::decode(&withdrawn.encode().unwrap()).unwrap();
        assert_eq!(back, withdrawn);
        // A tip not withdrawn is written as the version before wrote it (six fields), so a node
        // of that version still reads the update.
        #[derive(serde::Deserialize)]
        #[allow(dead_code)]
        struct PrevTip(String, u64, u32, u32, Option<u16>, bool);
        #[derive(serde::Deserialize)]
        #[allow(dead_code)]
        struct PrevUpdate(u64, u64, Vec<LoadEntry>, Vec<PrevTip>);
        let bytes = rmp_serde::to_vec(&answered).unwrap();
        assert!(rmp_serde::from_slice::<PrevUpdate>(&bytes).is_ok());
        // A withdrawn one it cannot read (the update is refused there, as any it cannot read).
        let bytes = rmp_serde::to_vec(&withdrawn).unwrap();
        assert!(rmp_serde::from_slice::<PrevUpdate>(&bytes).is_err());
    }

    #[test]
    fn large_updates_split_into_datagrams_with_increasing_seq() {
        let mut seq = 0;
        let entries: Vec<LoadEntry> = (0..500)
            .map(|i| LoadEntry {
                replica: format!("replica-with-a-longish-id-{i:04}"),
                in_flight: 200,
                pending_tokens: u64::MAX,
            })
            .collect();
        let tips: Vec<RoutedTip> = (0..300)
            .map(|i| RoutedTip {
                replica: format!("replica-with-a-longish-id-{i:04}"),
                key: u64::MAX - i,
                blocks: u32::MAX,
                ready_ms: u32::MAX,
                rank: Some(u16::MAX),
                first_byte: true,
                withdrawn: true,
            })
            .collect();
        let out = LoadUpdate::split(1, &mut seq, entries, tips);
        assert!(out.len() > 1);
        let mut last = 0;
        let (mut n, mut t) = (0, 0);
        for b in &out {
            assert!(b.len() <= MAX_LOAD_UPDATE_BYTES);
            let u = LoadUpdate::decode(b).unwrap();
            assert!(u.seq > last);
            last = u.seq;
            n += u.entries.len();
            t += u.tips.len();
        }
        assert_eq!((n, t), (500, 300));
        assert_eq!(seq, last);
    }

    proptest::proptest! {
        #[test]
        fn decoding_peer_bytes_never_panics(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..1200)) {
            let _ = LoadUpdate::decode(&bytes);
        }
    }
}
