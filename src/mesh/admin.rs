//! Operator commands as gossip: `admin:<replica id>` records.
//!
//! Exists so `kvmesh replicas add|drain|rm` on one node changes the whole region without a
//! central store: the node that took the command publishes what the operator wants for that
//! replica, stamped with its wall clock, and every node of the region applies the newest stamp
//! it has seen (ties broken by node id). A node that joins later reads the same records. The
//! records live as long as their publisher; a node restarts from its configuration file.
//!
//! A peer's certificate does not make its commands trusted beyond what the node would take from
//! gossip anyway: records apply only within the publisher's own region, an added replica's URL
//! must pass the learned-replica allow-list (`node/learned.rs`), and each publisher is read for
//! at most [`MAX_ADMIN_RECORDS`] records.

use serde::{Deserialize, Serialize};

use super::schema::{self, bounds, SchemaError, WireKvEvents, WirePd, MAX_REPLICA_ID_BYTES};

/// Gossip key prefix of admin records.
pub const ADMIN_PREFIX: &str = "admin:";

/// Most admin records a node publishes (the oldest go first) and reads from one peer.
pub const MAX_ADMIN_RECORDS: usize = 256;

/// Furthest ahead of this node's clock a peer's command may be stamped: the clock skew NTP-run
/// hosts keep well within. A stamp far ahead would win over every later command (a rogue
/// member's drain stamped a day ahead held a region for a day); refused at decoding, counted.
pub const MAX_STAMP_LEAD_MS: u64 = 60_000;

/// Most model names an added replica may list in its record.
pub const MAX_ADMIN_MODELS: usize = 16;

/// What the operator wants for a replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdminOp {
    /// Registered and routable (added, updated or taken out of a drain).
    Add,
    /// Takes no new requests; requests in flight finish. It stays registered.
    Drain,
    /// Drained, then dropped from the registry.
    Remove,
}

impl AdminOp {
    /// The name operators see.
    pub fn as_str(self) -> &'static str {
        match self {
            AdminOp::Add => "add",
            AdminOp::Drain => "drain",
            AdminOp::Remove => "remove",
        }
    }
}

/// The facts of a replica added at run time (the subset of `[[replicas]]` that gossip carries).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdminSpec {
    /// Base URL.
    pub url: String,
    /// Zone or rack.
    #[serde(default)]
    pub zone: String,
    /// Pool.
    pub pool: String,
    /// Models it serves (empty: discovered by health checks); at most [`MAX_ADMIN_MODELS`].
    #[serde(default)]
    pub models: Vec<String>,
    /// KV capacity in tokens, when configured.
    #[serde(default)]
    pub capacity_tokens: Option<u64>,
    /// Prefill tokens per second for the cost model.
    pub prefill_tokens_per_s: f64,
    /// In-flight requests above which it counts as full.
    pub max_in_flight: u32,
    /// KV-event ports at the URL's host, if any.
    #[serde(default)]
    pub kv_events: Option<WireKvEvents>,
    /// Disaggregation facts; absent (older nodes) = `both`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pd: Option<WirePd>,
    /// KV size and offload bandwidths, if configured. Added later: absent reads as none.
    #[serde(default)]
    pub kv_load: Option<crate::core::kv_load::KvLoad>,
}

/// One `admin:<id>` record.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdminRecord {
    /// When the command was taken (unix ms on the taking node); the newest wins.
    pub stamp_ms: u64,
    /// The command.
    pub op: AdminOp,
    /// The replica's facts, with [`AdminOp::Add`].
    #[serde(default)]
    pub spec: Option<AdminSpec>,
}

impl AdminRecord {
    /// Encodes for gossip; errors when over the 1 KiB value limit (long URLs, many models).
    pub fn encode(&self) -> Result<String, SchemaError> {
        self.check()?;
        schema::encode("admin", self)
    }

    /// Decodes a peer's value; numbers out of bounds and stamps more than
    /// [`MAX_STAMP_LEAD_MS`] ahead of this node's clock are refused.
    pub fn decode(s: &str) -> Result<Self, SchemaError> {
        let r: AdminRecord = schema::decode("admin", s)?;
        r.check()?;
        let latest = schema::wall_ms().saturating_add(MAX_STAMP_LEAD_MS);
        schema::bound("admin", "stamp_ms", r.stamp_ms <= latest, r.stamp_ms)?;
        Ok(r)
    }

    fn check(&self) -> Result<(), SchemaError> {
        let w = "admin";
        schema::bound(
            w,
            "spec",
            self.spec.is_some() == (self.op == AdminOp::Add),
            self.op.as_str(),
        )?;
        let Some(s) = &self.spec else {
            return Ok(());
        };
        schema::bound(
            w,
            "models",
            s.models.len() <= MAX_ADMIN_MODELS,
            s.models.len(),
        )?;
        if let Some(l) = &s.kv_load {
            schema::bound(w, "kv_load", l.validate().is_ok(), format!("{l:?}"))?;
        }
        let p = s.prefill_tokens_per_s;
        schema::bound(
            w,
            "prefill_tokens_per_s",
            p.is_finite() && p > 0.0 && p <= bounds::MAX_PREFILL_TOKENS_PER_S,
            p,
        )?;
        schema::bound(
            w,
            "max_in_flight",
            (1..=bounds::MAX_REQUESTS).contains(&s.max_in_flight),
            s.max_in_flight,
        )?;
        let cap = s.capacity_tokens.unwrap_or(1);
        schema::bound(
            w,
            "capacity_tokens",
            (1..=bounds::MAX_CAPACITY_TOKENS).contains(&cap),
            cap,
        )?;
        if let Some(k) = &s.kv_events {
            k.check(w)?;
        }
        if let Some(p) = &s.pd {
            p.check(w)?;
        }
        Ok(())
    }
}

/// The gossip key of replica `id`'s admin record; errors on ids that are empty or too long.
pub fn admin_key(id: &str) -> Result<String, SchemaError> {
    if id.is_empty() || id.len() > MAX_REPLICA_ID_BYTES {
        return Err(SchemaError::BadReplicaId(id.to_owned()));
    }
    Ok(format!("{ADMIN_PREFIX}{id}"))
}

/// Whether a record stamped `(stamp, by)` supersedes one stamped `(old_stamp, old_by)`: later
/// wins; on equal stamps the larger node id, so every node picks the same one.
pub fn supersedes(stamp: u64, by: &str, old: Option<(u64, &str)>) -> bool {
    old.is_none_or(|(s, b)| (stamp, by) > (s, b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add(url: &str) -> AdminRecord {
        AdminRecord {
            stamp_ms: 1_700_000_000_000,
            op: AdminOp::Add,
            spec: Some(AdminSpec {
                url: url.into(),
                zone: String::new(),
                pool: "shared".into(),
                models: vec!["m".into()],
                capacity_tokens: None,
                prefill_tokens_per_s: 50_000.0,
                max_in_flight: 256,
                kv_events: None,
                pd: None,
                kv_load: None,
            }),
        }
    }

    #[test]
    fn records_round_trip_and_refuse_what_is_out_of_bounds() {
        let r = add("http://10.0.0.5:8000");
        assert_eq!(AdminRecord::decode(&r.encode().unwrap()).unwrap(), r);
        let drain = AdminRecord {
            stamp_ms: 5,
            op: AdminOp::Drain,
            spec: None,
        };
        assert_eq!(
            AdminRecord::decode(&drain.encode().unwrap()).unwrap(),
            drain
        );

        let mut bad = add("http://h:1");
        bad.spec.as_mut().unwrap().max_in_flight = 0;
        assert!(bad.encode().is_err());
        let mut nan = add("http://h:1");
        nan.spec.as_mut().unwrap().prefill_tokens_per_s = f64::NAN;
        assert!(nan.encode().is_err());
        // A drain carrying a spec, or an add without one, is malformed.
        let odd = AdminRecord {
            spec: add("http://h:1").spec,
            ..drain.clone()
        };
        assert!(odd.encode().is_err());
        // A stamp from far in the future cannot pin a replica's state forever.
        let future = AdminRecord {
            stamp_ms: u64::MAX,
            ..drain
        };
        let value = schema::encode("admin", &future).unwrap();
        assert!(AdminRecord::decode(&value).is_err());
        // Nor a day, nor an hour (issue #35: 23 h ahead drained a region); a clock's skew is
        // allowed.
        for lead_ms in [23 * 3_600_000, 3_600_000, 2 * MAX_STAMP_LEAD_MS] {
            let ahead = AdminRecord {
                stamp_ms: schema::wall_ms() + lead_ms,
                ..future.clone()
            };
            let value = schema::encode("admin", &ahead).unwrap();
            assert!(AdminRecord::decode(&value).is_err(), "{lead_ms} ms ahead");
        }
        let skewed = AdminRecord {
            stamp_ms: schema::wall_ms() + 5_000,
            ..future.clone()
        };
        let value = schema::encode("admin", &skewed).unwrap();
        assert_eq!(AdminRecord::decode(&value).unwrap(), skewed);
        // Too long for one gossip value.
        assert!(add(&format!("http://{}:1", "h".repeat(1200)))
            .encode()
            .is_err());
    }

    #[test]
    fn the_newest_stamp_wins_and_ties_break_by_node_id() {
        assert!(supersedes(2, "a", Some((1, "z"))));
        assert!(!supersedes(1, "z", Some((2, "a"))));
        assert!(supersedes(2, "b", Some((2, "a"))));
        assert!(!supersedes(2, "a", Some((2, "a"))));
        assert!(supersedes(0, "a", None));
        assert!(admin_key("").is_err());
        assert_eq!(admin_key("r1").unwrap(), "admin:r1");
    }
}
