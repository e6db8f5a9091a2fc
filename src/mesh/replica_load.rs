//! The `rload:<id>` record: the part of a replica's record that changes while it serves.
//!
//! A replica record (`replica:<id>`, `schema.rs`) is mostly facts that rarely change (URL,
//! region, models, capacity, roles) and a few fields that change with every routed request or
//! scrape: health, the scraped load, the summary version and the KV-quota shares. chitchat sends a
//! changed key's whole value, so a home that republished the full record on every change spent
//! ~250 bytes a change per replica per peer, and at a thousand busy replicas per region that was
//! most of the mesh's traffic (docs/benchmarks-notebook.md, "The mesh at scale"). The home now publishes
//! the full record when a fact changes (or health, or the summary's epoch: news a peer must not
//! wait for), and otherwise only this companion, with one-letter field names: at once when a
//! scrape changed the load (once a scrape interval at most), else at most once per
//! `mesh.replica_load_interval_ms` per replica. A reader overlays the companion on the record
//! of the same member ([`ReplicaLoadRecord::overlay`]); the record alone still reads complete
//! (it carries the values of its own publication), so an older peer loses only freshness.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::schema::{
    check_changing, decode, encode, ReplicaRecord, SchemaError, SummaryVersion, WireHealth,
    WireLoad, MAX_REPLICA_ID_BYTES,
};

/// Prefix of the companion records (not a prefix of `replica:`, whose scan must not see them).
pub const REPLICA_LOAD_PREFIX: &str = "rload:";

/// The changing part of a replica record.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplicaLoadRecord {
    /// Health as the home sees it.
    #[serde(rename = "h")]
    pub health: WireHealth,
    /// Requests queued in the engine.
    #[serde(rename = "w")]
    pub waiting: u32,
    /// Requests running in the engine.
    #[serde(rename = "r")]
    pub running: u32,
    /// KV cache usage, 0..1.
    #[serde(rename = "u")]
    pub kv_usage: f32,
    /// Prompt tokens queued for prefill.
    #[serde(rename = "q")]
    pub queued_prefill_tokens: u64,
    /// Summary epoch.
    #[serde(rename = "e")]
    pub epoch: u64,
    /// Summary sequence within the epoch.
    #[serde(rename = "s")]
    pub seq: u64,
    /// Summary digest.
    #[serde(rename = "d")]
    pub digest: u64,
    /// KV-quota tenants' shares in thousandths, as in the record.
    #[serde(rename = "k", default, skip_serializing_if = "Option::is_none")]
    pub kv_shares: Option<BTreeMap<String, u16>>,
}

impl ReplicaLoadRecord {
    /// The changing part of `r`.
    pub fn of(r: &ReplicaRecord) -> Self {
        ReplicaLoadRecord {
            health: r.health,
            waiting: r.load.waiting,
            running: r.load.running,
            kv_usage: r.load.kv_usage,
            queued_prefill_tokens: r.load.queued_prefill_tokens,
            epoch: r.summary.epoch,
            seq: r.summary.seq,
            digest: r.summary.digest,
            kv_shares: r.kv_shares.clone(),
        }
    }

    fn load(&self) -> WireLoad {
        WireLoad {
            waiting: self.waiting,
            running: self.running,
            kv_usage: self.kv_usage,
            queued_prefill_tokens: self.queued_prefill_tokens,
        }
    }

    fn summary(&self) -> SummaryVersion {
        SummaryVersion {
            epoch: self.epoch,
            seq: self.seq,
            digest: self.digest,
        }
    }

    /// `r` with this companion's values, unless the companion is older than what `r` itself
    /// says (a record republished after it, e.g. on a new epoch).
    pub fn overlay(&self, r: &mut ReplicaRecord) {
        if (self.epoch, self.seq) >= (r.summary.epoch, r.summary.seq) {
            self.overlay_unchecked(r);
        }
    }

    /// `r`'s changing fields set to this companion's, whatever their age.
    fn overlay_unchecked(&self, r: &mut ReplicaRecord) {
        r.health = self.health;
        r.load = self.load();
        r.summary = self.summary();
        r.kv_shares = self.kv_shares.clone();
    }

    /// The gossip key of replica `id`'s companion; errors on ids that are empty or too long.
    pub fn key(id: &str) -> Result<String, SchemaError> {
        if id.is_empty() || id.len() > MAX_REPLICA_ID_BYTES {
            return Err(SchemaError::BadReplicaId(id.to_owned()));
        }
        Ok(format!("{REPLICA_LOAD_PREFIX}{id}"))
    }

    /// Encodes for gossip.
    pub fn encode(&self) -> Result<String, SchemaError> {
        encode("rload", self)
    }

    /// Decodes a peer's value; numbers outside the replica record's bounds are refused.
    pub fn decode(s: &str) -> Result<Self, SchemaError> {
        let r: ReplicaLoadRecord = decode("rload", s)?;
        check_changing("rload", &r.load(), &r.summary(), r.kv_shares.as_ref())?;
        Ok(r)
    }
}

/// What of a replica's record a home publishes this round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordChange {
    /// Nothing changed, or only the changing part and its interval has not passed.
    None,
    /// Only the changing part: the `rload:` companion.
    Load,
    /// A fact, the health or the summary epoch changed (or nothing was published yet): the
    /// whole record, and the companion with it so the two agree.
    Full,
}

impl RecordChange {
    /// What to publish of `next` after `last` (the values peers hold), when the companion was
    /// last published `since_load` ago (`None`: never) and may go out every `interval`.
    pub fn between(
        last: Option<&ReplicaRecord>,
        next: &ReplicaRecord,
        since_load: Option<std::time::Duration>,
        interval: std::time::Duration,
    ) -> RecordChange {
        let Some(last) = last else {
            return RecordChange::Full;
        };
        if last == next {
            return RecordChange::None;
        }
        let mut facts = next.clone();
        ReplicaLoadRecord::of(last).overlay_unchecked(&mut facts);
        if facts != *last || last.health != next.health || last.summary.epoch != next.summary.epoch
        {
            return RecordChange::Full;
        }
        // A new scrape (the engine's queue) goes out at once: peers steer by it, and it
        // changes at most once a scrape interval. The summary version and the home's own
        // pending prefill, which change with every routed request (and the pending prefill
        // reaches the region by load sharing anyway), ride along or wait out the interval.
        let (a, b) = (&last.load, &next.load);
        let scraped = (a.waiting, a.running, a.kv_usage) != (b.waiting, b.running, b.kv_usage);
        if scraped || since_load.is_none_or(|t| t >= interval) {
            RecordChange::Load
        } else {
            RecordChange::None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::view::{Health, ReplicaLoad};
    use std::time::Duration;

    fn record() -> ReplicaRecord {
        let info = crate::core::view::ReplicaInfo {
            id: "r1".into(),
            url: "http://10.0.0.1:8000".into(),
            region: "eu".into(),
            zone: "a".into(),
            pool: "shared".into(),
            models: vec!["llama-3.1-8b".into()],
            capacity_tokens: 450_000,
            prefill_tokens_per_s: 50_000.0,
            prefill_attention_ms_per_pair: crate::core::view::DEFAULT_PREFILL_ATTENTION_MS_PER_PAIR,
            max_in_flight: 256,
            pd: Default::default(),
            kv_load: None,
        };
        let load = ReplicaLoad {
            waiting: 2,
            running: 9,
            kv_usage: 0.4,
            queued_prefill_tokens: 3000,
            ..ReplicaLoad::default()
        };
        let summary = SummaryVersion {
            epoch: 1_700_000_000_000,
            seq: 41,
            digest: 0x1234_5678_9abc_def0,
        };
        ReplicaRecord::new(&info, Health::Healthy, &load, summary)
    }

    #[test]
    fn the_companion_round_trips_and_is_a_fraction_of_the_record() {
        let r = record();
        let c = ReplicaLoadRecord::of(&r);
        let wire = c.encode().unwrap();
        assert_eq!(ReplicaLoadRecord::decode(&wire).unwrap(), c);
        let full = r.encode().unwrap();
        assert!(
            wire.len() * 3 < full.len(),
            "companion {} B, record {} B",
            wire.len(),
            full.len()
        );
        let mut stale = r.clone();
        stale.load.waiting = 0;
        c.overlay(&mut stale);
        assert_eq!(stale, r);
    }

    #[test]
    fn a_companion_older_than_its_record_is_not_applied() {
        let r = record();
        let old = ReplicaLoadRecord::of(&r);
        let mut newer = r.clone();
        newer.summary.seq += 5;
        newer.load.waiting = 7;
        let expect = newer.clone();
        old.overlay(&mut newer);
        assert_eq!(newer, expect);
    }

    #[test]
    fn out_of_bounds_companions_are_refused() {
        let mut c = ReplicaLoadRecord::of(&record());
        c.kv_usage = f32::NAN;
        assert!(ReplicaLoadRecord::decode(&c.encode().unwrap()).is_err());
        let mut c = ReplicaLoadRecord::of(&record());
        c.epoch = u64::MAX;
        assert!(ReplicaLoadRecord::decode(&c.encode().unwrap()).is_err());
        assert!(ReplicaLoadRecord::decode("not base64 !").is_err());
        assert!(ReplicaLoadRecord::key("").is_err());
        assert_eq!(ReplicaLoadRecord::key("r1").unwrap(), "rload:r1");
    }

    #[test]
    fn a_fact_health_or_epoch_goes_out_whole_load_alone_at_most_once_an_interval() {
        let second = Duration::from_secs(1);
        let last = record();
        assert_eq!(
            RecordChange::between(None, &last, None, second),
            RecordChange::Full
        );
        assert_eq!(
            RecordChange::between(Some(&last), &last, None, second),
            RecordChange::None
        );
        let mut busier = last.clone();
        busier.summary.seq += 1;
        busier.load.queued_prefill_tokens += 512;
        let soon = Some(Duration::from_millis(200));
        assert_eq!(
            RecordChange::between(Some(&last), &busier, soon, second),
            RecordChange::None
        );
        assert_eq!(
            RecordChange::between(Some(&last), &busier, Some(second), second),
            RecordChange::Load
        );
        // A new scrape does not wait.
        busier.load.running += 1;
        assert_eq!(
            RecordChange::between(Some(&last), &busier, soon, second),
            RecordChange::Load
        );
        for change in [
            |r: &mut ReplicaRecord| r.models.push("another".into()),
            |r: &mut ReplicaRecord| r.health = WireHealth::Draining,
            |r: &mut ReplicaRecord| r.summary.epoch += 1,
            |r: &mut ReplicaRecord| r.max_in_flight = 8,
        ] {
            let mut next = busier.clone();
            change(&mut next);
            assert_eq!(
                RecordChange::between(Some(&last), &next, soon, second),
                RecordChange::Full
            );
        }
    }
}
