//! A replica's part in prefill/decode disaggregation: `prefill`, `decode` or `both`.
//!
//! Fleets that split prefill and decode run two kinds of engine: a prefill engine computes a
//! prompt's KV cache and hands it over the fast fabric; a decode engine receives it and
//! generates. `both` is the ordinary engine that does everything (the default, so a fleet
//! without disaggregation needs no setting). Which replica may take which leg of a request is
//! [`Role::serves`]; the pair choice is `pd.rs`.
//!
//! The hand-over needs a little more than a URL: SGLang's prefill servers take the transfer
//! through a *bootstrap* port of their own, and vLLM's Mooncake connector names the prefill
//! engine by an engine id. Both are static facts of the replica ([`PdFacts`]), configured,
//! gossiped with its record, and read by the proxy's protocol adapters.

use serde::{Deserialize, Serialize};

/// What a replica does in prefill/decode disaggregation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Computes prompts' KV caches and hands them to decode replicas.
    Prefill,
    /// Takes a KV cache from a prefill replica and generates.
    Decode,
    /// An ordinary engine: prefill and decode in one (the default).
    #[default]
    Both,
}

/// The part of a request a replica is asked to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leg {
    /// The whole request (prefill and decode in one engine). A decode replica can do it: a
    /// vLLM engine with a KV connector computes what it was not handed.
    Whole,
    /// The whole request, on an ordinary engine only: an SGLang decode server cannot run a
    /// request without a bootstrap room, so there the bypass may not pick one.
    WholeOnBoth,
    /// The prefill of a disaggregated request.
    Prefill,
}

impl Role {
    /// Every role, in label order.
    pub const ALL: [Role; 3] = [Role::Prefill, Role::Decode, Role::Both];

    /// Whether a replica of this role may take `leg`.
    pub fn serves(self, leg: Leg) -> bool {
        match leg {
            Leg::Whole => self != Role::Prefill,
            Leg::WholeOnBoth => self == Role::Both,
            Leg::Prefill => self != Role::Decode,
        }
    }

    /// Whether it can decode a request whose prefill ran elsewhere.
    pub fn decodes(self) -> bool {
        self != Role::Prefill
    }

    /// Stable label (config, admin API, metrics).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }

    /// The role a label names (`prefill`, `decode`, `both`).
    pub fn parse(s: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

/// Longest Mooncake engine id a replica may carry (bytes): ids are UUID-like.
pub const MAX_ENGINE_ID_BYTES: usize = 64;

/// A replica's static facts for disaggregation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PdFacts {
    /// Its role. Default `both`.
    pub role: Role,
    /// A prefill replica's KV bootstrap port (SGLang's `--disaggregation-bootstrap-port`,
    /// vLLM Mooncake's `VLLM_MOONCAKE_BOOTSTRAP_PORT`), at the replica URL's host. Default none:
    /// the adapters then use the engines' default, 8998.
    pub bootstrap_port: Option<u16>,
    /// A prefill replica's engine id for vLLM's Mooncake connector (`remote_engine_id`),
    /// at most [`MAX_ENGINE_ID_BYTES`]. Default "": the one the prefill answer names is used.
    pub engine_id: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_take_the_legs_their_engines_can_run() {
        use Leg::*;
        assert!(Role::Both.serves(Whole) && Role::Both.serves(Prefill));
        assert!(Role::Both.serves(WholeOnBoth));
        assert!(Role::Decode.serves(Whole) && !Role::Decode.serves(Prefill));
        assert!(!Role::Decode.serves(WholeOnBoth));
        assert!(!Role::Prefill.serves(Whole) && Role::Prefill.serves(Prefill));
        assert!(!Role::Prefill.decodes() && Role::Decode.decodes());
    }

    #[test]
    fn labels_round_trip_and_absent_is_both() {
        for r in Role::ALL {
            assert_eq!(Role::parse(r.as_str()), Some(r));
        }
        assert_eq!(Role::parse("Prefill"), None);
        assert_eq!(Role::default(), Role::Both);
        assert_eq!(PdFacts::default().role, Role::Both);
    }
}
