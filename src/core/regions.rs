//! Regions: how far apart they are, so a node that cannot serve a request at home sends it to the
//! nearest region that can.
//!
//! Distances are round-trip times in milliseconds. The mesh measures them on its QUIC connections;
//! configuration may pin any pair. Unknown pairs count as [`UNKNOWN_DISTANCE_MS`], so a measured or
//! configured region is always preferred over one nobody has heard from.

use std::collections::HashMap;

/// Distance assumed between regions with no figure (ms).
pub const UNKNOWN_DISTANCE_MS: f64 = 10_000.0;

/// Distances between regions, symmetric.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RegionMap {
    measured: HashMap<(String, String), f64>,
    configured: HashMap<(String, String), f64>,
}

fn pair(a: &str, b: &str) -> (String, String) {
    if a <= b {
        (a.to_owned(), b.to_owned())
    } else {
        (b.to_owned(), a.to_owned())
    }
}

impl RegionMap {
    /// Pins the distance between two regions (configuration wins over measurement).
    pub fn configure(&mut self, a: &str, b: &str, ms: f64) {
        self.configured.insert(pair(a, b), ms);
    }

    /// Records a measured RTT between two regions.
    pub fn measured(&mut self, a: &str, b: &str, ms: f64) {
        if ms.is_finite() && ms >= 0.0 {
            self.measured.insert(pair(a, b), ms);
        }
    }

    /// Distance in ms; 0 within a region.
    pub fn distance(&self, a: &str, b: &str) -> f64 {
        if a == b {
            return 0.0;
        }
        let key = pair(a, b);
        self.configured
            .get(&key)
            .or_else(|| self.measured.get(&key))
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
}
