//! Reading members' chitchat states into [`Member`]s, once per change.
//!
//! The node reads every member's records on every sync round (rounds also follow changes, up
//! to five per gossip interval) and the RTT loop reads them again. Decoding every record each
//! time (base64, zstd, msgpack, bounds) was about a third of an idle node's CPU in a 25-node
//! region (perf, `scripts/mesh-scale.py`). A member's state changes only when its max version
//! moves, so a decoded member is kept with the stamp it was decoded at and reused until the
//! stamp moves; a malformed value is counted once per change, not once per round.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use chitchat::ChitchatId;
use tracing::debug;

use super::admin::{AdminRecord, ADMIN_PREFIX, MAX_ADMIN_RECORDS};
use super::hot_record::{HotRecord, KEY_HOT};
use super::member::Member;
use super::region_record::{RegionRecord, REGION_PREFIX};
use super::replica_load::{ReplicaLoadRecord, REPLICA_LOAD_PREFIX};
use super::schema::{
    self, HomesRecord, InflightRecord, NodeRecord, ReplicaRecord, RttRecord, SchemaError,
    KEY_HOMES, KEY_INFLIGHT, KEY_NODE, KEY_RTT, REPLICA_PREFIX,
};
use super::signed::payload;
use super::transport::QuicTransport;
use crate::core::region_offer::MAX_REMOTE_REGIONS;

/// The first `cap` live values of `entries` (key, signed value), as (key, payload). A withdrawn
/// key reads as absent (see `signed`) and does not count against the cap: a member keeps a
/// withdrawn `rload:` for every replica it stopped being home of (at start, each node is
/// briefly home of all), and counting those cut off live companions past the cap (its number
/// of live records). A follower then never read the home's load of the replicas whose ids
/// sort after the withdrawn ones, and weighed every peer's claim there down to that frozen
/// zero (issue #38: three nodes piled long prompts onto one such replica).
fn live_values<'a>(
    entries: impl Iterator<Item = (&'a str, &'a str)>,
    cap: usize,
) -> impl Iterator<Item = (&'a str, &'a str)> {
    entries
        .filter_map(|(key, value)| Some((key, payload(value)?)))
        .take(cap)
}

/// What a decoded member was decoded from: its state's max version, last GC version and
/// number of keys (a GC drops keys without a new version).
type Stamp = (u64, u64, usize);

/// Decoded members by chitchat id, with the stamp of the state they came from. Holds only ids
/// chitchat still has a state for (pruned on every read), so chitchat's own bounds bound it.
#[derive(Default)]
pub(super) struct MemberCache {
    by_id: HashMap<ChitchatId, (Stamp, Member)>,
}

/// `layer_ids`: the region layer's members, whose verification must outlive their absence
/// from this cluster.
pub(super) fn members_of(
    c: &chitchat::Chitchat,
    errors: &AtomicU64,
    transport: &QuicTransport,
    layer_ids: &HashSet<ChitchatId>,
    cache: &mut MemberCache,
) -> Vec<Member> {
    let self_id = c.self_chitchat_id().clone();
    let states = c.node_states();
    transport.retain_verified(|id| states.contains_key(id) || layer_ids.contains(id));
    // Live for the failure detector, and (peers) verified: a member whose certificate never
    // named it on a direct connection is not trusted with routing state.
    let live: std::collections::HashSet<&ChitchatId> = c
        .live_nodes()
        .filter(|id| **id == self_id || transport.is_verified(id))
        .collect();
    let count_err = |what: &str, id: &ChitchatId, e: &SchemaError| {
        errors.fetch_add(1, Ordering::Relaxed);
        debug!(node = %id.node_id, "skipping malformed {what}: {e}");
    };
    cache.by_id.retain(|id, _| states.contains_key(id));
    let mut out = Vec::with_capacity(states.len());
    for (id, state) in states {
        let stamp = (
            state.max_version(),
            state.last_gc_version(),
            state.num_key_values(),
        );
        let mut member = match cache.by_id.get(id) {
            Some((at, m)) if *at == stamp => m.clone(),
            _ => {
                let m = decode(id, state, &count_err);
                cache.by_id.insert(id.clone(), (stamp, m.clone()));
                m
            }
        };
        member.live = live.contains(id);
        member.is_self = *id == self_id;
        out.push(member);
    }
    out.sort_by(|a, b| {
        a.node_id
            .cmp(&b.node_id)
            .then_with(|| a.generation.cmp(&b.generation))
    });
    out
}

/// One member's records; `live` and `is_self` are the caller's to set.
fn decode(
    id: &ChitchatId,
    state: &chitchat::NodeState,
    count_err: &impl Fn(&str, &ChitchatId, &SchemaError),
) -> Member {
    // One small record under `key`: absent or malformed (counted) reads as none.
    fn one<T>(
        state: &chitchat::NodeState,
        key: &str,
        decode: impl Fn(&str) -> Result<T, SchemaError>,
        bad: impl Fn(&SchemaError),
    ) -> Option<T> {
        state
            .get(key)
            .and_then(payload)
            .and_then(|v| decode(v).map_err(|e| bad(&e)).ok())
    }
    // Records keyed `<prefix><replica id>`: ids come from keys, which no value limit
    // bounds, so an empty or over-long id is dropped and counted like a bad value.
    fn by_replica<T>(
        state: &chitchat::NodeState,
        prefix: &str,
        cap: usize,
        decode: impl Fn(&str) -> Result<T, SchemaError>,
        bad: impl Fn(&str, &SchemaError),
    ) -> BTreeMap<String, T> {
        let mut out = BTreeMap::new();
        let entries = state
            .iter_prefix(prefix)
            .map(|(k, v)| (k, v.value.as_str()));
        for (key, v) in live_values(entries, cap) {
            let Some(rid) = key.strip_prefix(prefix) else {
                continue;
            };
            if rid.is_empty() || rid.len() > schema::MAX_REPLICA_ID_BYTES {
                bad(
                    "key",
                    &SchemaError::BadReplicaId(rid.chars().take(64).collect()),
                );
                continue;
            }
            match decode(v) {
                Ok(r) => {
                    out.insert(rid.to_owned(), r);
                }
                Err(e) => bad(prefix.trim_end_matches(':'), &e),
            }
        }
        out
    }
    let bad = |what: &str, e: &SchemaError| count_err(what, id, e);
    let node = one(state, KEY_NODE, NodeRecord::decode, |e| bad("node", e));
    let mut replicas = by_replica(
        state,
        REPLICA_PREFIX,
        usize::MAX,
        ReplicaRecord::decode,
        bad,
    );
    // Each record's fresher changing part, from the same member (`replica_load.rs`); a
    // companion without its record is ignored.
    let loads = by_replica(
        state,
        REPLICA_LOAD_PREFIX,
        replicas.len(),
        ReplicaLoadRecord::decode,
        bad,
    );
    for (rid, load) in &loads {
        if let Some(r) = replicas.get_mut(rid) {
            load.overlay(r);
        }
    }
    let inflight = one(state, KEY_INFLIGHT, InflightRecord::decode, |e| {
        bad("inflight", e)
    })
    .unwrap_or_default();
    let rtt = one(state, KEY_RTT, RttRecord::decode, |e| bad("rtt", e)).unwrap_or_default();
    let hot = one(state, KEY_HOT, HotRecord::decode, |e| bad("hot", e)).unwrap_or_default();
    let homes = one(state, KEY_HOMES, HomesRecord::decode, |e| bad("homes", e));
    let admin = by_replica(
        state,
        ADMIN_PREFIX,
        MAX_ADMIN_RECORDS,
        AdminRecord::decode,
        bad,
    );
    Member {
        node_id: id.node_id.to_string(),
        generation: id.generation_id,
        gossip_addr: id.gossip_advertise_addr,
        live: false,
        is_self: false,
        node,
        replicas: Arc::new(replicas),
        inflight: Arc::new(inflight),
        rtt: Arc::new(rtt),
        homes,
        hot: Arc::new(hot),
        admin: Arc::new(admin),
        regions: Arc::new(by_replica(
            state,
            REGION_PREFIX,
            MAX_REMOTE_REGIONS,
            RegionRecord::decode,
            bad,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A home of two replicas, holding withdrawn companions for six it handed over: both live
    /// companions are read (before, the cap of two met a withdrawn one first).
    #[test]
    fn withdrawn_keys_do_not_count_against_the_cap() {
        let live = |p: &str| format!("x.s{p}");
        let gone = "x.w".to_owned();
        let entries: Vec<(String, String)> = vec![
            ("rload:a".into(), live("1")),
            ("rload:b".into(), gone.clone()),
            ("rload:c".into(), gone.clone()),
            ("rload:d".into(), gone),
            ("rload:e".into(), live("2")),
            ("rload:f".into(), live("3")),
        ];
        let iter = || entries.iter().map(|(k, v)| (k.as_str(), v.as_str()));
        let read: Vec<_> = live_values(iter(), 2).collect();
        assert_eq!(read, [("rload:a", "1"), ("rload:e", "2")]);
        assert_eq!(live_values(iter(), usize::MAX).count(), 3);
    }
}
