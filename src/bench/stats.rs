//! Latency statistics: percentiles and means over recorded samples.

use serde::Serialize;

/// Summary of a set of samples (seconds).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Distribution {
    /// Number of samples.
    pub count: usize,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest sample.
    pub max: f64,
}

impl Distribution {
    /// Summarises `samples` (sorted in place; NaNs sort last).
    pub fn of(samples: &mut [f64]) -> Self {
        if samples.is_empty() {
            return Distribution::default();
        }
        samples.sort_by(f64::total_cmp);
        let at = |q: f64| {
            samples[((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len()) - 1]
        };
        Distribution {
            count: samples.len(),
            mean: samples.iter().sum::<f64>() / samples.len() as f64,
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
            max: samples[samples.len() - 1],
        }
    }
}

/// Largest share over mean share: 1.0 is perfect balance.
pub fn max_over_mean(counts: &[u64]) -> f64 {
    if counts.is_empty() {
        return 0.0;
    }
    let mean = counts.iter().sum::<u64>() as f64 / counts.len() as f64;
    let max = counts.iter().copied().max().unwrap_or(0) as f64;
    if mean == 0.0 {
        0.0
    } else {
        max / mean
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let mut s: Vec<f64> = (1..=100).map(f64::from).collect();
        let d = Distribution::of(&mut s);
        assert_eq!(
            (d.count, d.p50, d.p90, d.p99, d.max),
            (100, 50.0, 90.0, 99.0, 100.0)
        );
        assert!((d.mean - 50.5).abs() < 1e-9);
        assert_eq!(Distribution::of(&mut []).count, 0);
        assert_eq!(max_over_mean(&[1, 1, 4]), 2.0);
    }
}
