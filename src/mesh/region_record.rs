//! The region record: one region as the rest of the mesh sees it (regional gossip).
//!
//! A representative of region R builds it from its view (`core::region_choice::build_offer`)
//! and publishes it under [`KEY_REGION`] in the region layer; the representatives of every other
//! region copy it into their own regional cluster under `region:R` ([`REGION_PREFIX`]), so every
//! node learns every region from one small value each, refreshed at most every
//! `region_interval`. It carries what forwarding needs: the core's `RegionOffer` (models, room,
//! least queue, held prefix heads, who holds the deepest of them for pulls) and a few nodes to
//! forward to.
//!
//! Trust: in the region layer a `region` record counts only for the region its publisher's own
//! `node` record names (a node speaks for its region, not for others); a `region:R` copy counts
//! only under its own name and never for the reader's region.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use super::schema::{bound, bounds, decode, encode, wall_ms, SchemaError};
use crate::core::region_offer::{
    OfferedHolder, OfferedModel, RegionHead, RegionOffer, MAX_HEAD_DEPTH, MAX_HOLDER_STEP_MS,
    MAX_HOLDER_STR_BYTES, MAX_OFFERED_MODELS, MAX_OFFER_HOLDERS, MAX_REGION_HEADS,
};

/// Key of a representative's own region record in the region layer.
pub const KEY_REGION: &str = "region";
/// Prefix of another region's record copied into a regional cluster: `region:<name>`.
pub const REGION_PREFIX: &str = "region:";
/// Forwarding targets a record names at most.
pub const MAX_REGION_TARGETS: usize = 3;
/// Longest region name a record may carry (longer ones are refused).
pub const MAX_REGION_NAME_BYTES: usize = 64;
/// Longest URL or node id a target may carry.
const MAX_TARGET_STR_BYTES: usize = 256;
/// How far past this node's clock a record's `at_ms` may be (5 min: clock skew between honest
/// regions, with room). Newest wins, so a record from further ahead would outrank its region's
/// real ones until the clocks caught up: 24 h for a forged one before.
pub const MAX_AT_LEAD_MS: u64 = 300_000;

/// A node of the region that takes forwarded requests.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RegionTarget {
    /// Node id.
    pub node_id: String,
    /// Base URL of its HTTP front (its peer listener takes forwarded requests).
    pub http_url: String,
    /// Its QUIC address: a representative's is also a region-layer seed.
    pub quic_addr: SocketAddr,
}

/// The record.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RegionRecord {
    /// The region.
    pub region: String,
    /// Wall-clock ms when it was built: of two records for one region the newer wins.
    pub at_ms: u64,
    /// Live nodes in the region.
    #[serde(default)]
    pub nodes: u32,
    /// What it serves (the offer's models).
    #[serde(default)]
    pub models: Vec<OfferedModel>,
    /// Prefixes it holds as (key, depth): positional, so 16 of them take ~200 bytes.
    #[serde(default)]
    pub heads: Vec<(u64, u16)>,
    /// Nodes to forward to, the publishing representative first.
    #[serde(default)]
    pub targets: Vec<RegionTarget>,
    /// Holders of some heads as (key, depth, replica id, replica URL, step ms): positional, each
    /// for one of `heads`, the region's own replicas only (the offer's `holders`).
    #[serde(default)]
    pub holders: Vec<(u64, u16, String, String, u16)>,
}

impl RegionRecord {
    /// A record for `offer`, built now.
    pub fn new(offer: &RegionOffer, nodes: u32, targets: Vec<RegionTarget>) -> Self {
        RegionRecord {
            region: offer.region.clone(),
            at_ms: wall_ms(),
            nodes,
            models: offer.models.clone(),
            heads: offer.heads.iter().map(|h| (h.key, h.depth)).collect(),
            targets,
            holders: offer
                .holders
                .iter()
                .map(|h| {
                    (
                        h.head.key,
                        h.head.depth,
                        h.id.clone(),
                        h.url.clone(),
                        h.step_ms,
                    )
                })
                .collect(),
        }
    }

    /// The core's view of it.
    pub fn offer(&self) -> RegionOffer {
        RegionOffer {
            region: self.region.clone(),
            models: self.models.clone(),
            heads: self
                .heads
                .iter()
                .map(|&(key, depth)| RegionHead { key, depth })
                .collect(),
            holders: self
                .holders
                .iter()
                .map(|(key, depth, id, url, step_ms)| OfferedHolder {
                    head: RegionHead {
                        key: *key,
                        depth: *depth,
                    },
                    id: id.clone(),
                    url: url.clone(),
                    step_ms: *step_ms,
                })
                .collect(),
        }
    }

    /// Encodes for gossip, dropping holders beyond the first, then the shallowest heads (and a
    /// holder of one), then targets beyond the first, then the least open models until it fits
    /// the value limit.
    pub fn encode_fit(&self) -> Result<String, SchemaError> {
        let mut r = self.clone();
        r.targets.truncate(MAX_REGION_TARGETS);
        r.holders.truncate(MAX_OFFER_HOLDERS);
        loop {
            match encode("region", &r) {
                Err(SchemaError::TooLarge { .. }) if r.holders.len() > 1 => {
                    r.holders.pop();
                }
                Err(SchemaError::TooLarge { .. }) if !r.heads.is_empty() => {
                    if let Some((key, depth)) = r.heads.pop() {
                        r.holders.retain(|h| (h.0, h.1) != (key, depth));
                    }
                }
                Err(SchemaError::TooLarge { .. }) if r.targets.len() > 1 => {
                    r.targets.pop();
                }
                Err(SchemaError::TooLarge { .. }) if r.models.len() > 1 => {
                    r.models.pop();
                }
                other => return other,
            }
        }
    }

    /// Decodes a peer's value, refusing one over any bound (`at_ms` at most
    /// [`MAX_AT_LEAD_MS`] past this node's clock).
    pub fn decode(s: &str) -> Result<Self, SchemaError> {
        let r: RegionRecord = decode("region", s)?;
        let w = "region";
        bound(w, "region", !r.region.is_empty(), "empty")?;
        bound(
            w,
            "region",
            r.region.len() <= MAX_REGION_NAME_BYTES,
            r.region.len(),
        )?;
        let lead = r.at_ms <= wall_ms().saturating_add(MAX_AT_LEAD_MS);
        bound(w, "at_ms", lead, r.at_ms)?;
        bound(w, "nodes", r.nodes <= bounds::MAX_REQUESTS, r.nodes)?;
        bound(
            w,
            "models",
            r.models.len() <= MAX_OFFERED_MODELS,
            r.models.len(),
        )?;
        bound(w, "heads", r.heads.len() <= MAX_REGION_HEADS, r.heads.len())?;
        bound(
            w,
            "targets",
            r.targets.len() <= MAX_REGION_TARGETS,
            r.targets.len(),
        )?;
        for m in &r.models {
            bound(w, "healthy", m.healthy <= bounds::MAX_REQUESTS, m.healthy)?;
            bound(w, "open", m.open <= m.healthy, m.open)?;
            let rate_ok = f64::from(m.prefill_tokens_per_s) <= bounds::MAX_PREFILL_TOKENS_PER_S;
            bound(w, "prefill_tokens_per_s", rate_ok, m.prefill_tokens_per_s)?;
        }
        for (_, depth) in &r.heads {
            let ok = (1..=MAX_HEAD_DEPTH).contains(depth);
            bound(w, "depth", ok, depth)?;
        }
        for t in &r.targets {
            let ok =
                t.node_id.len() <= MAX_TARGET_STR_BYTES && t.http_url.len() <= MAX_TARGET_STR_BYTES;
            bound(w, "target", ok, &t.node_id)?;
        }
        check_holders(&r)?;
        Ok(r)
    }
}

/// A record's holders: at most [`MAX_OFFER_HOLDERS`], each for one of its heads, with a
/// non-empty bounded id, an `http(s)://` URL of bounded length and a step of at most
/// [`MAX_HOLDER_STEP_MS`]. (Whether the replica is the region's own is for the reader's view:
/// `core::region_choice::foreign_holder`.)
fn check_holders(r: &RegionRecord) -> Result<(), SchemaError> {
    let w = "region";
    let n = r.holders.len();
    bound(w, "holders", n <= MAX_OFFER_HOLDERS, n)?;
    for (key, depth, id, url, step_ms) in &r.holders {
        bound(w, "holders.head", r.heads.contains(&(*key, *depth)), key)?;
        let id_ok = !id.is_empty() && id.len() <= MAX_HOLDER_STR_BYTES;
        bound(w, "holders.id", id_ok, id.len())?;
        let scheme = url.starts_with("http://") || url.starts_with("https://");
        bound(
            w,
            "holders.url",
            scheme && url.len() <= MAX_HOLDER_STR_BYTES,
            url.len(),
        )?;
        bound(
            w,
            "holders.step_ms",
            *step_ms <= MAX_HOLDER_STEP_MS,
            step_ms,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(i: u16) -> RegionTarget {
        RegionTarget {
            node_id: format!("us-node-{i}"),
            http_url: format!("https://us-node-{i}.example.internal:8443"),
            quic_addr: SocketAddr::from(([10, 0, 0, i as u8], 7000 + i)),
        }
    }

    fn full() -> RegionRecord {
        RegionRecord {
            region: "us-east".into(),
            at_ms: wall_ms(),
            nodes: 25,
            models: vec![OfferedModel {
                model: "meta-llama/Llama-3.1-8B-Instruct".into(),
                pool: "shared".into(),
                whole: true,
                healthy: 32,
                open: 30,
                least_queue_ms: 120,
                prefill_tokens_per_s: 50_000,
            }],
            heads: (0..MAX_REGION_HEADS as u64)
                .map(|k| (u64::MAX - k, 1 << 10))
                .collect(),
            targets: (0..3).map(target).collect(),
            holders: (0..MAX_OFFER_HOLDERS as u64)
                .map(|k| {
                    let url = format!("http://10.1.0.{k}:8000");
                    (u64::MAX - k, 1 << 10, format!("us-replica-{k}"), url, 12)
                })
                .collect(),
        }
    }

    #[test]
    fn holders_round_trip_and_absurd_ones_are_refused() {
        let enc = |r: &RegionRecord| encode("region", r).unwrap();
        let mut r = full();
        r.heads.truncate(4);
        r.targets.truncate(1);
        r.holders.truncate(2);
        let back = RegionRecord::decode(&enc(&r)).unwrap();
        assert_eq!(back.holders, r.holders);
        let offer = back.offer();
        assert_eq!(offer.holders[0].id, "us-replica-0");
        assert_eq!(offer.holders[0].head.key, u64::MAX);
        assert_eq!(RegionRecord::new(&offer, 1, vec![]).holders, r.holders);
        type Spoil = fn(&mut RegionRecord);
        let bad_cases: [(&str, Spoil); 6] = [
            ("for no head", |r| r.holders[0].0 = 5),
            ("empty id", |r| r.holders[0].2.clear()),
            ("not http", |r| r.holders[0].3 = "file:///etc/passwd".into()),
            ("long url", |r| {
                r.holders[0].3 = format!("http://{}", "a".repeat(300))
            }),
            ("step over 200 ms", |r| r.holders[0].4 = 60_000),
            ("too many", |r| {
                let h = r.holders[0].clone();
                r.holders = vec![h; MAX_OFFER_HOLDERS + 1];
            }),
        ];
        for (why, spoil) in bad_cases {
            let mut bad = r.clone();
            spoil(&mut bad);
            assert!(RegionRecord::decode(&enc(&bad)).is_err(), "{why}");
        }
    }

    #[test]
    fn a_full_record_keeps_a_holder_and_its_head_when_it_must_drop_some() {
        let s = full().encode_fit().unwrap();
        let back = RegionRecord::decode(&s).unwrap();
        assert!(!back.holders.is_empty(), "a holder kept");
        for h in &back.holders {
            assert!(back.heads.contains(&(h.0, h.1)), "its head kept: {h:?}");
        }
    }

    #[test]
    fn a_full_record_fits_by_dropping_heads_and_round_trips() {
        let r = full();
        let s = r.encode_fit().unwrap();
        assert!(s.len() <= super::super::schema::MAX_VALUE_BYTES);
        let back = RegionRecord::decode(&s).unwrap();
        assert_eq!(back.region, r.region);
        assert_eq!(back.models, r.models);
        assert_eq!(back.targets, r.targets);
        assert!(back.heads.len() >= 12, "{} heads kept", back.heads.len());
        assert_eq!(back.heads[..], r.heads[..back.heads.len()]);
        assert_eq!(back.offer().heads.len(), back.heads.len());
    }

    #[test]
    fn absurd_claims_are_refused() {
        let enc = |r: &RegionRecord| encode("region", r).unwrap();
        let mut r = full();
        r.heads.truncate(4);
        assert!(RegionRecord::decode(&enc(&r)).is_ok());
        let mut bad = r.clone();
        bad.region = String::new();
        assert!(RegionRecord::decode(&enc(&bad)).is_err());
        let mut bad = r.clone();
        bad.models[0].open = 33;
        assert!(
            RegionRecord::decode(&enc(&bad)).is_err(),
            "more open than healthy"
        );
        let mut bad = r.clone();
        bad.heads[0].1 = 0;
        assert!(RegionRecord::decode(&enc(&bad)).is_err(), "depth 0");
        let mut bad = r.clone();
        bad.at_ms = wall_ms() + MAX_AT_LEAD_MS + 60_000;
        assert!(
            RegionRecord::decode(&enc(&bad)).is_err(),
            "from past the clock skew allowed"
        );
        let mut bad = r.clone();
        bad.at_ms = u64::MAX;
        assert!(
            RegionRecord::decode(&enc(&bad)).is_err(),
            "from the far future"
        );
        let mut bad = r;
        bad.targets = (0..4).map(target).collect();
        bad.models.clear();
        bad.heads.clear();
        assert!(
            RegionRecord::decode(&enc(&bad)).is_err(),
            "too many targets"
        );
        assert!(RegionRecord::decode("%%%").is_err());
    }
}
