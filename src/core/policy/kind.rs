//! The configurable policies by name: what `policy = "…"` and `--policy` accept.

use std::fmt;
use std::str::FromStr;

/// The configurable policies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// Rotate through the candidates.
    RoundRobin,
    /// Uniformly random.
    Random,
    /// Fewest outstanding requests.
    LeastLoad,
    /// Two random choices, fewer outstanding wins.
    P2c,
    /// Consistent hashing with bounded loads on the prefix.
    Chwbl,
    /// Lowest predicted cost (Dynamo-style).
    CacheArgmin,
    /// SGLang's cache_aware rule.
    SglangThreshold,
    /// Two choices with a cache score (the default).
    P2cCache,
    /// Lowest uncached prefill × batch size (LMetric).
    LMetric,
}

impl PolicyKind {
    /// Every policy, in the order reports list them.
    pub const ALL: [PolicyKind; 9] = [
        PolicyKind::P2cCache,
        PolicyKind::LMetric,
        PolicyKind::CacheArgmin,
        PolicyKind::SglangThreshold,
        PolicyKind::Chwbl,
        PolicyKind::P2c,
        PolicyKind::LeastLoad,
        PolicyKind::RoundRobin,
        PolicyKind::Random,
    ];

    /// The configured name.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::Random => "random",
            PolicyKind::LeastLoad => "least-load",
            PolicyKind::P2c => "p2c",
            PolicyKind::Chwbl => "chwbl",
            PolicyKind::CacheArgmin => "cache-argmin",
            PolicyKind::SglangThreshold => "sglang-threshold",
            PolicyKind::P2cCache => "p2c-cache",
            PolicyKind::LMetric => "lmetric",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown policy name.
#[derive(Debug, thiserror::Error)]
#[error("unknown policy '{0}' (expected one of: round-robin, random, least-load, p2c, chwbl, cache-argmin, sglang-threshold, p2c-cache, lmetric)")]
pub struct UnknownPolicy(pub String);

impl FromStr for PolicyKind {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| UnknownPolicy(s.to_owned()))
    }
}
