//! The regional layout's moving parts: joining one's region through seeds' directories, and the
//! representatives' round (publish this region's record, relay the others', answer askers).
//!
//! Growth law, per node, for P nodes per region, R regions and k representatives per region
//! (k = 2): regional gossip costs what a flat cluster of P nodes costs (digests list P members);
//! the region layer adds, on the k of P nodes that are representatives, a flat cluster of k·R
//! members at a fifth of the rate; every node receives R − 1 relayed region records, each
//! republished at most every `region_interval` when it changed. Within the region, the churn is
//! the region's replicas' changing parts (`rload:<id>`, ~70 B, at most once per
//! `replica_load_interval` each: `replica_load.rs`) plus each node's `rtt` every 2 s. Load
//! sharing, beside gossip, adds at most about twice `load_share_budget_kib_s` (sent, and as
//! much received; `node/load_share.rs`). Nothing grows with the total node count N = P·R except
//! through R. The live figures and the byte
//! model (`bench/sim_bytes.rs`) are in docs/benchmarks-notebook.md.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chitchat::ChitchatHandle;
use futures::StreamExt;
use tracing::debug;

use super::directory::{Directory, MAX_DIRECTORY_PEERS};
use super::member::Member;
use super::region_layer::{representatives, RegionLayer};
use super::region_record::{RegionRecord, RegionTarget};
use super::transport::QuicTransport;
use crate::core::region_offer::RegionOffer;

/// Region-layer addresses remembered from directory answers at most.
const MAX_HEARD: usize = 256;
/// A representative heard of and not heard of again is forgotten after this long (it may have
/// stopped being one; the region records name the current ones).
const HEARD_FOR: Duration = Duration::from_secs(60);
/// How often a node that already has region peers asks one seed again (partitions heal through
/// it, as they do through chitchat's own seeds in the flat layout).
const REJOIN_EVERY: Duration = Duration::from_secs(5);
/// How often a node alone in its region asks every seed.
const JOIN_EVERY: Duration = Duration::from_millis(250);
/// Longest wait for one directory answer.
const ASK_TIMEOUT: Duration = Duration::from_secs(1);
/// Queue steps a published record rounds up to, so a busy region does not republish on every
/// routed request.
const QUEUE_STEP_MS: u32 = 50;

/// The regional layout's state in a `Mesh`.
pub struct Regional {
    /// The region layer (active while this node is a representative).
    pub(super) layer: RegionLayer,
    /// Representatives per region.
    k: usize,
    /// Least time between two published records.
    interval: Duration,
    /// Region-layer members heard of (directory answers), with when; capped at
    /// [`MAX_HEARD`], forgotten after [`HEARD_FOR`].
    heard: Mutex<BTreeMap<SocketAddr, Instant>>,
    /// A directory pass had answers and none named a node of this region: this node is its
    /// region's first (so it need not wait for peers to start).
    first_in_region: std::sync::atomic::AtomicBool,
    /// `region:<name>` keys this node relays, with the relayed record's stamp.
    relayed: tokio::sync::Mutex<BTreeMap<String, u64>>,
    /// The record last published (stamp zeroed) and when.
    published: Mutex<Option<(RegionRecord, Instant)>>,
}

impl std::fmt::Debug for Regional {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Regional")
            .field("k", &self.k)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Regional {
    /// State around `layer`, with `k` representatives per region.
    pub fn new(layer: RegionLayer, k: usize, interval: Duration) -> Self {
        Regional {
            layer,
            k,
            interval,
            heard: Mutex::new(BTreeMap::new()),
            first_in_region: std::sync::atomic::AtomicBool::new(false),
            relayed: tokio::sync::Mutex::new(BTreeMap::new()),
            published: Mutex::new(None),
        }
    }

    /// Whether a directory pass said this node is its region's first (see the field).
    pub(super) fn first_in_region(&self) -> bool {
        self.first_in_region
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    fn hear(&self, reps: &[SocketAddr]) {
        let now = Instant::now();
        let mut heard = lock(&self.heard);
        heard.retain(|_, at| now.duration_since(*at) < HEARD_FOR);
        for a in reps {
            if heard.len() >= MAX_HEARD && !heard.contains_key(a) {
                break;
            }
            heard.insert(*a, now);
        }
    }
}

/// What one regional round produced.
#[derive(Clone, Debug, Default)]
pub struct RegionalRound {
    /// The newest record of every other region.
    pub records: BTreeMap<String, RegionRecord>,
    /// This node is one of its region's representatives.
    pub representative: bool,
    /// Live members of this node's region, this node included.
    pub region_live: usize,
}

/// One round: representative or not, publish and relay, gather every other region's record,
/// refresh the directory. `live` are the regional cluster's live members (this node included);
/// `build` makes this region's offer (called only on a representative).
pub(super) async fn round(
    r: &Regional,
    transport: &QuicTransport,
    self_id: &str,
    region: &str,
    live: &[Member],
    build: impl FnOnce() -> RegionOffer,
    relay: impl AsyncRelay,
) -> RegionalRound {
    let mine: Vec<&Member> = live
        .iter()
        .filter(|m| m.live && m.region() == Some(region))
        .collect();
    let reps = representatives(mine.iter().map(|m| m.node_id.as_str()), r.k);
    let representative = reps.contains(&self_id);
    let quic = |m: &Member| m.node.as_ref().map_or(m.gossip_addr, |n| n.quic_addr);

    // Every other region's record as the region's representatives relay it (newest wins):
    // only theirs, so a member that is not one cannot pass off a record of its own making.
    let mut records: BTreeMap<String, RegionRecord> = BTreeMap::new();
    for m in mine.iter().filter(|m| reps.contains(&m.node_id.as_str())) {
        for (name, rec) in m.regions.iter() {
            if *name == rec.region {
                take_newer(&mut records, rec, region);
            }
        }
    }

    let mut seeds: BTreeSet<SocketAddr> = lock(&r.heard).keys().copied().collect();
    seeds.extend(
        records
            .values()
            .flat_map(|rec| rec.targets.first().map(|t| t.quic_addr)),
    );
    let seeds: Vec<SocketAddr> = seeds.into_iter().collect();
    let active = r.layer.set_active(representative).await;
    let mut relayed = r.relayed.lock().await;
    if active {
        r.layer.reach(&seeds).await;
        publish_own(r, &mine, &reps, region, build).await;
        let layer = r.layer.state().await;
        tracing::trace!(members = ?layer.members, records = layer.records.len(), seeds = ?seeds, "region layer");
        for rec in layer.records.values() {
            take_newer(&mut records, rec, region);
        }
        for (name, rec) in &layer.records {
            if relayed.get(name) != Some(&rec.at_ms) {
                match rec.encode_fit() {
                    Ok(v) => {
                        relay.set(format!("region:{name}"), v).await;
                        relayed.insert(name.clone(), rec.at_ms);
                    }
                    Err(e) => debug!(region = %name, error = %e, "region record not relayed"),
                }
            }
        }
        let gone: Vec<String> = relayed
            .keys()
            .filter(|n| !layer.records.contains_key(*n))
            .cloned()
            .collect();
        for name in gone {
            relay.delete(format!("region:{name}")).await;
            relayed.remove(&name);
        }
    } else {
        // The layer is stopped, and one started again holds nothing: this region's record goes
        // into it even if it equals the one published before.
        *lock(&r.published) = None;
        for (name, _) in std::mem::take(&mut *relayed) {
            relay.delete(format!("region:{name}")).await;
        }
    }
    drop(relayed);

    // What askers get: this region's members and representatives, other regions' targets.
    let mut dir = Directory {
        region: region.to_owned(),
        ..Default::default()
    };
    dir.by_region.insert(
        region.to_owned(),
        mine.iter()
            .map(|m| quic(m))
            .take(MAX_DIRECTORY_PEERS)
            .collect(),
    );
    for (name, rec) in &records {
        dir.by_region.insert(
            name.clone(),
            rec.targets.iter().map(|t| t.quic_addr).collect(),
        );
    }
    dir.reps = mine
        .iter()
        .filter(|m| reps.contains(&m.node_id.as_str()))
        .map(|m| quic(m))
        .chain(
            records
                .values()
                .flat_map(|rec| rec.targets.first().map(|t| t.quic_addr)),
        )
        .take(MAX_DIRECTORY_PEERS)
        .collect();
    transport.set_directory(dir);
    RegionalRound {
        records,
        representative,
        region_live: mine.len(),
    }
}

/// Keeps `rec` in `records` when it is another region's and newer than the one there.
fn take_newer(records: &mut BTreeMap<String, RegionRecord>, rec: &RegionRecord, own: &str) {
    if rec.region == own {
        return;
    }
    let newer = records
        .get(&rec.region)
        .is_none_or(|old| old.at_ms < rec.at_ms);
    if newer {
        records.insert(rec.region.clone(), rec.clone());
    }
}

/// Publishes this region's record in the region layer when it changed, at most every interval.
async fn publish_own(
    r: &Regional,
    mine: &[&Member],
    reps: &[&str],
    region: &str,
    build: impl FnOnce() -> RegionOffer,
) {
    let mut offer = build();
    offer.region = region.to_owned();
    for m in &mut offer.models {
        m.least_queue_ms = m.least_queue_ms.div_ceil(QUEUE_STEP_MS) * QUEUE_STEP_MS;
    }
    // Targets: the representatives first (they also seed the layer), then other members.
    let mut ordered: Vec<&Member> = mine.to_vec();
    ordered.sort_by_key(|m| {
        (
            reps.iter()
                .position(|id| *id == m.node_id)
                .unwrap_or(usize::MAX),
            m.node_id.clone(),
        )
    });
    let targets = ordered
        .iter()
        .filter_map(|m| {
            let n = m.node.as_ref()?;
            (!n.http_url.is_empty()).then(|| RegionTarget {
                node_id: m.node_id.clone(),
                http_url: n.http_url.trim_end_matches('/').to_owned(),
                quic_addr: n.quic_addr,
            })
        })
        .take(super::region_record::MAX_REGION_TARGETS)
        .collect();
    let mut record = RegionRecord::new(&offer, mine.len() as u32, targets);
    let stamp = record.at_ms;
    record.at_ms = 0;
    let due = match &*lock(&r.published) {
        None => true,
        Some((last, at)) => *last != record && at.elapsed() >= r.interval,
    };
    if !due {
        return;
    }
    let unstamped = record.clone();
    record.at_ms = stamp;
    match record.encode_fit() {
        Ok(v) => {
            r.layer.publish(v).await;
            *lock(&r.published) = Some((unstamped, Instant::now()));
        }
        Err(e) => debug!(error = %e, "region record not published"),
    }
}

/// Writes and deletes keys of this node's regional state (the relayed records).
pub(super) trait AsyncRelay {
    /// Sets `key` to `value`.
    fn set(&self, key: String, value: String) -> impl std::future::Future<Output = ()> + Send;
    /// Deletes `key`.
    fn delete(&self, key: String) -> impl std::future::Future<Output = ()> + Send;
}

/// Finds this node's region through its seeds' directories, for as long as the mesh runs: every
/// [`JOIN_EVERY`] (all seeds) while it has no region peer, else one seed every
/// [`REJOIN_EVERY`]. chitchat is asked for a round with each same-region node named (which
/// makes it a member); representatives go to the region layer's seeds.
pub(super) async fn join_loop(
    r: Arc<Regional>,
    chitchat: Arc<ChitchatHandle>,
    transport: QuicTransport,
    seeds: Vec<String>,
    region: String,
    me: SocketAddr,
) {
    let mut last_rejoin = Instant::now();
    let mut turn = 0usize;
    loop {
        let alone = chitchat
            .with_chitchat(|c| {
                let me = c.self_chitchat_id().clone();
                c.live_nodes().all(|id| *id == me)
            })
            .await;
        if alone || last_rejoin.elapsed() >= REJOIN_EVERY {
            last_rejoin = Instant::now();
            let addrs = resolve(&seeds, me).await;
            let asked: Vec<SocketAddr> = if alone {
                addrs
            } else if addrs.is_empty() {
                Vec::new()
            } else {
                turn = turn.wrapping_add(1);
                vec![addrs[turn % addrs.len()]]
            };
            // Each answer is used as it comes: a seed that is not up yet (every node starting
            // at once) must not hold back the peers a faster seed named for ASK_TIMEOUT.
            let mut answers: futures::stream::FuturesUnordered<_> = asked
                .iter()
                .map(|a| {
                    let transport = transport.clone();
                    let region = region.clone();
                    async move {
                        let ans =
                            tokio::time::timeout(ASK_TIMEOUT, transport.ask_directory(*a, &region))
                                .await;
                        (*a, ans)
                    }
                })
                .collect();
            let mut unanswered = asked.len();
            let mut found_any = false;
            let mut contacted: BTreeSet<SocketAddr> = BTreeSet::new();
            while let Some((seed, ans)) = answers.next().await {
                let ans = match ans {
                    Ok(Ok(ans)) => ans,
                    Ok(Err(e)) => {
                        debug!(%seed, error = %e, "directory not answered");
                        continue;
                    }
                    Err(_) => {
                        debug!(%seed, "directory not answered in time");
                        continue;
                    }
                };
                unanswered -= 1;
                debug!(%seed, region = %ans.region, peers = ?ans.peers, reps = ?ans.reps, "directory answer");
                r.hear(&ans.reps);
                let same_region = (ans.region == region).then_some(seed);
                let found = same_region
                    .into_iter()
                    .chain(ans.peers.iter().copied().filter(|a| *a != me));
                for addr in found {
                    found_any = true;
                    if contacted.len() >= MAX_DIRECTORY_PEERS || !contacted.insert(addr) {
                        continue;
                    }
                    if let Err(e) = chitchat.gossip(addr) {
                        debug!(error = %e, "gossip round not requested");
                    }
                }
            }
            // First in its region only when *every* seed answered and none named a node of it:
            // a seed of this region that has not answered yet may know the region's nodes (a
            // seed that never answers costs a region's first node its warm-up timeout).
            if alone && !asked.is_empty() && unanswered == 0 {
                r.first_in_region
                    .store(!found_any, std::sync::atomic::Ordering::Relaxed);
            }
        }
        tokio::time::sleep(JOIN_EVERY).await;
    }
}

/// The seeds' addresses (names looked up, at most 2 s each), without this node's own.
async fn resolve(seeds: &[String], me: SocketAddr) -> Vec<SocketAddr> {
    let mut out = Vec::new();
    for s in seeds.iter().take(64) {
        if let Ok(a) = s.parse::<SocketAddr>() {
            out.push(a);
            continue;
        }
        if let Ok(Ok(addrs)) =
            tokio::time::timeout(Duration::from_secs(2), tokio::net::lookup_host(s.as_str())).await
        {
            out.extend(addrs);
        }
    }
    out.retain(|a| *a != me);
    out.sort_unstable();
    out.dedup();
    out
}
