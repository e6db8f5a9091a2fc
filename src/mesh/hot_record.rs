//! The `hot` gossip record: a node's heaviest prefixes, so the region's nodes merge their
//! hot-prefix detectors (`core::hot_prefix`).
//!
//! Gossip rather than the load-sharing datagrams: heat changes over seconds (the sketch's decay
//! time constant), a gossip round is fast enough, and a record that is only replaced — never
//! summed — cannot be double-counted when a datagram is repeated or reordered.

use serde::{Deserialize, Serialize};

use super::schema::{bound, decode, encode, SchemaError};
use crate::core::hot_prefix::{MAX_GOSSIP_ENTRIES, MAX_PEER_RATE};

/// Key of the hot-prefix record.
pub const KEY_HOT: &str = "hot";

/// The `hot` record: `entries` = (first-k-block key, this node's requests/s), heaviest first,
/// at most [`MAX_GOSSIP_ENTRIES`] (16 entries encode to about 330 bytes of base64).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HotRecord {
    /// (key, rate) pairs.
    pub entries: Vec<(u64, f32)>,
}

impl HotRecord {
    /// Encodes for gossip.
    pub fn encode(&self) -> Result<String, SchemaError> {
        encode("hot", self)
    }

    /// Decodes a peer's value: more than [`MAX_GOSSIP_ENTRIES`] entries, or a rate that is not
    /// a finite number in `0..=MAX_PEER_RATE`, refuses the record.
    pub fn decode(s: &str) -> Result<Self, SchemaError> {
        let r: HotRecord = decode("hot", s)?;
        let n = r.entries.len();
        bound("hot", "entries", n <= MAX_GOSSIP_ENTRIES, n)?;
        for (_, rate) in &r.entries {
            let ok = rate.is_finite() && (0.0..=MAX_PEER_RATE as f32).contains(rate);
            bound("hot", "rate", ok, rate)?;
        }
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_record_fits_and_round_trips() {
        let full = HotRecord {
            entries: (0..MAX_GOSSIP_ENTRIES as u64)
                .map(|k| (u64::MAX - k, 12_345.5))
                .collect(),
        };
        let s = full.encode().unwrap();
        assert!(s.len() < 512, "{}", s.len());
        assert_eq!(HotRecord::decode(&s).unwrap(), full);
    }

    #[test]
    fn absurd_claims_are_refused() {
        let bad = |entries: Vec<(u64, f32)>| HotRecord { entries }.encode().unwrap();
        assert!(HotRecord::decode(&bad(vec![(1, f32::INFINITY)])).is_err());
        assert!(HotRecord::decode(&bad(vec![(1, -1.0)])).is_err());
        assert!(HotRecord::decode(&bad(vec![(1, 1e9)])).is_err());
        assert!(HotRecord::decode(&bad(vec![(1, 1.0); MAX_GOSSIP_ENTRIES + 1])).is_err());
        assert!(HotRecord::decode("not base64!").is_err());
    }
}
