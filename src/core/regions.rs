//! Regions: how far apart they are, so a node that cannot serve a request at home sends it to the
//! nearest region that can, and what link joins two regions when a prefix's KV is pulled across.
//!
//! Distances are round-trip times in milliseconds. The mesh measures them on its QUIC connections;
//! configuration may pin any pair. Unknown pairs count as [`UNKNOWN_DISTANCE_MS`], so a measured or
//! configured region is always preferred over one nobody has heard from. A pair may also pin its
//! KV link (`[[mesh.distance]]`'s `kv_gb_per_s`, `kv_setup_ms`: a dedicated interconnect);
//! pairs without one use `[kv_fetch.links] cross_region`.
//!
//! Lookups take `&str` and allocate nothing: the router asks on the request path.

use std::collections::HashMap;

/// Distance assumed between regions with no figure (ms).
pub const UNKNOWN_DISTANCE_MS: f64 = 10_000.0;

/// A KV link pinned between two regions (`core::kv_fetch::LinkSpec`'s figures; kept apart so
/// that this file, which the view imports, does not import the fetch pricing that imports the
/// view).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RegionLink {
    /// Sustained rate, GB/s (10⁹ bytes per second).
    pub gb_per_s: f64,
    /// Milliseconds before the first byte moves.
    pub setup_ms: f64,
}

/// Per-pair figures, keyed by the lesser name and then the greater (so `&str` lookups need no
/// owned key).
type PairMap<T> = HashMap<String, HashMap<String, T>>;

/// Distances (and pinned KV links) between regions, symmetric.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RegionMap {
    measured: PairMap<f64>,
    configured: PairMap<f64>,
    links: PairMap<RegionLink>,
}

/// `(a, b)` ordered, so either order finds one entry.
fn ordered<'s>(a: &'s str, b: &'s str) -> (&'s str, &'s str) {
    if a <= b {
        (a, b)
    } else {
        (b, a)
    }
}

fn put<T>(map: &mut PairMap<T>, a: &str, b: &str, v: T) {
    let (lo, hi) = ordered(a, b);
    map.entry(lo.to_owned())
        .or_default()
        .insert(hi.to_owned(), v);
}

fn get<'m, T>(map: &'m PairMap<T>, a: &str, b: &str) -> Option<&'m T> {
    let (lo, hi) = ordered(a, b);
    map.get(lo)?.get(hi)
}

impl RegionMap {
    /// Pins the distance between two regions (configuration wins over measurement).
    pub fn configure(&mut self, a: &str, b: &str, ms: f64) {
        put(&mut self.configured, a, b, ms);
    }

    /// Records a measured RTT between two regions.
    pub fn measured(&mut self, a: &str, b: &str, ms: f64) {
        if ms.is_finite() && ms >= 0.0 {
            put(&mut self.measured, a, b, ms);
        }
    }

    /// Pins the link a prefix's KV crosses between two regions (a dedicated interconnect).
    pub fn configure_link(&mut self, a: &str, b: &str, link: RegionLink) {
        put(&mut self.links, a, b, link);
    }

    /// The KV link pinned between two different regions, if any.
    pub fn link(&self, a: &str, b: &str) -> Option<RegionLink> {
        if a == b {
            return None;
        }
        get(&self.links, a, b).copied()
    }

    /// Distance in ms; 0 within a region.
    pub fn distance(&self, a: &str, b: &str) -> f64 {
        if a == b {
            return 0.0;
        }
        get(&self.configured, a, b)
            .or_else(|| get(&self.measured, a, b))
            .copied()
            .unwrap_or(UNKNOWN_DISTANCE_MS)
    }

    /// `regions` other than `from`, nearest first (ties by name, so every node orders alike).
    pub fn nearest_first<'a>(
        &self,
        from: &str,
        regions: impl IntoIterator<Item = &'a str>,
    ) -> Vec<&'a str> {
        let mut out: Vec<&str> = regions.into_iter().filter(|r| *r != from).collect();
        out.sort_by(|a, b| {
            self.distance(from, a)
                .total_cmp(&self.distance(from, b))
                .then_with(|| a.cmp(b))
        });
        out.dedup();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configured_beats_measured_and_unknown_is_last() {
        let mut m = RegionMap::default();
        m.measured("eu", "us", 80.0);
        m.measured("eu", "ap", 200.0);
        assert_eq!(
            m.nearest_first("eu", ["ap", "us", "eu", "sa"]),
            vec!["us", "ap", "sa"]
        );
        m.configure("ap", "eu", 10.0);
        assert_eq!(m.distance("eu", "ap"), 10.0);
        assert_eq!(m.nearest_first("eu", ["ap", "us"]), vec!["ap", "us"]);
        assert_eq!(m.distance("eu", "eu"), 0.0);
        m.measured("eu", "us", f64::NAN);
        assert_eq!(m.distance("us", "eu"), 80.0);
    }

    #[test]
    fn a_pinned_link_is_found_from_either_side_and_only_between_two_regions() {
        let mut m = RegionMap::default();
        let fast = RegionLink {
            gb_per_s: 50.0,
            setup_ms: 5.0,
        };
        m.configure_link("us", "eu", fast);
        assert_eq!(m.link("eu", "us"), Some(fast));
        assert_eq!(m.link("us", "eu"), Some(fast));
        assert_eq!(m.link("eu", "ap"), None);
        assert_eq!(m.link("eu", "eu"), None);
    }
}
