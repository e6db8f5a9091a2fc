//! A time-decayed heavy-hitters sketch: which prefixes are routed most often, right now.
//!
//! Space-saving (Metwally et al.) over a fixed array of counters, with forward exponential decay:
//! an arrival at time `t` adds `exp((t − landmark) / τ)`, so every count lives on one scale and
//! comparing two counters needs no `exp`. A counter's decayed weight at `now` is
//! `raw · exp(−(now − landmark) / τ)`; for a steady stream of rate `r` it tends to `r · τ`, so the
//! rate is weight ÷ τ. When the scale grows large the counters are renormalised to a new landmark.
//!
//! Space-saving never misses a heavy key: a key of true weight above `total / capacity` always
//! holds a counter, and a counter overestimates by at most its recorded `error` (the weight of
//! the key it replaced), so `count − error` is a lower bound. Memory is fixed (`capacity` ≤
//! [`MAX_COUNTERS`]); an update is one linear scan over ≤ 256 keys and never allocates — the
//! routing path pays it once per request.

use std::time::Duration;

/// Most counters a sketch may have.
pub const MAX_COUNTERS: usize = 256;

/// Renormalise once the scale factor passes this (far from f64 overflow, ~1.8e308).
const RENORMALISE_AT: f64 = 1e60;

/// One counter.
#[derive(Clone, Copy, Debug, Default)]
struct Counter {
    /// The key counted (meaningless while `raw` is 0).
    key: u64,
    /// Forward-decayed weight, on the landmark's scale.
    raw: f64,
    /// Overestimate inherited from the key this counter replaced, same scale.
    error: f64,
}

/// A decayed space-saving sketch of keys.
#[derive(Clone, Debug)]
pub struct HotSketch {
    counters: Vec<Counter>,
    /// Decay time constant τ in seconds: a burst's weight falls by `e` every τ.
    tau_s: f64,
    /// The time the scale is anchored at.
    landmark: Duration,
}

impl HotSketch {
    /// A sketch of `capacity` counters (clamped to 1..=[`MAX_COUNTERS`]) decaying with time
    /// constant `tau` (at least 1 ms).
    pub fn new(capacity: usize, tau: Duration) -> Self {
        HotSketch {
            counters: vec![Counter::default(); capacity.clamp(1, MAX_COUNTERS)],
            tau_s: tau.as_secs_f64().max(1e-3),
            landmark: Duration::ZERO,
        }
    }

    /// Counters held.
    pub fn capacity(&self) -> usize {
        self.counters.len()
    }

    /// The decay time constant in seconds.
    pub fn tau_s(&self) -> f64 {
        self.tau_s
    }

    /// The scale of an arrival at `now` (1 at the landmark). Time before the landmark (a caller
    /// whose clock stepped back) counts as the landmark.
    fn scale(&self, now: Duration) -> f64 {
        (now.saturating_sub(self.landmark).as_secs_f64() / self.tau_s).exp()
    }

    /// Counts one arrival of `key` at `now`.
    pub fn add(&mut self, key: u64, now: Duration) {
        let mut w = self.scale(now);
        if w > RENORMALISE_AT {
            self.renormalise(now);
            w = 1.0;
        }
        let (mut min, mut min_raw) = (0, f64::INFINITY);
        for (i, c) in self.counters.iter_mut().enumerate() {
            if c.raw > 0.0 && c.key == key {
                c.raw += w;
                return;
            }
            if c.raw < min_raw {
                (min, min_raw) = (i, c.raw);
            }
        }
        // Space-saving: the newcomer takes the lightest counter and inherits its weight as its
        // possible overestimate.
        let c = &mut self.counters[min];
        *c = Counter {
            key,
            raw: c.raw + w,
            error: c.raw,
        };
    }

    /// Moves the landmark to `now`, rescaling every counter (values unchanged).
    fn renormalise(&mut self, now: Duration) {
        let f = 1.0 / self.scale(now);
        for c in &mut self.counters {
            c.raw *= f;
            c.error *= f;
            if c.raw < 1e-12 {
                *c = Counter::default();
            }
        }
        self.landmark = now;
    }

    /// `key`'s rate at `now` in arrivals per second: (lower bound, estimate). 0 if untracked.
    pub fn rate(&self, key: u64, now: Duration) -> (f64, f64) {
        let f = 1.0 / (self.scale(now) * self.tau_s);
        self.counters
            .iter()
            .find(|c| c.raw > 0.0 && c.key == key)
            .map_or((0.0, 0.0), |c| ((c.raw - c.error) * f, c.raw * f))
    }

    /// Up to `out`'s free room of the heaviest keys at `now` with a guaranteed rate (lower
    /// bound) of at least `min_rate`, heaviest first, as `(key, rate)`. `out` is cleared.
    pub fn top(&self, now: Duration, min_rate: f64, max: usize, out: &mut Vec<(u64, f64)>) {
        out.clear();
        let f = 1.0 / (self.scale(now) * self.tau_s);
        for c in &self.counters {
            let lower = (c.raw - c.error) * f;
            if c.raw > 0.0 && lower >= min_rate && lower > 0.0 {
                out.push((c.key, lower));
            }
        }
        out.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        out.truncate(max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_steady_stream_reads_as_its_rate() {
        let mut s = HotSketch::new(16, Duration::from_secs(2));
        // 50 per second for 20 s (10 τ): the decayed count settles at rate × τ.
        for i in 0..1000 {
            s.add(7, ms(i * 20));
        }
        let (lower, est) = s.rate(7, ms(20_000));
        assert!((lower - 50.0).abs() < 2.0, "{lower}");
        assert_eq!(lower, est, "never evicted: exact");
        assert_eq!(s.rate(8, ms(20_000)), (0.0, 0.0));
    }

    #[test]
    fn heat_passes_with_time() {
        let mut s = HotSketch::new(16, Duration::from_secs(1));
        for i in 0..100 {
            s.add(1, ms(i * 10));
        }
        let hot = s.rate(1, ms(1000)).0;
        let later = s.rate(1, ms(4000)).0;
        // Three τ later: e^-3 of it.
        assert!(
            (later / hot - (-3.0f64).exp()).abs() < 1e-9,
            "{hot} {later}"
        );
    }

    #[test]
    fn a_heavy_key_is_never_lost_among_many_light_ones() {
        let mut s = HotSketch::new(8, Duration::from_secs(2));
        let mut t = 0;
        // 1 in 4 arrivals is key 0; the rest are all distinct (churn through 8 counters).
        for i in 0..4000u64 {
            t += 5;
            s.add(if i % 4 == 0 { 0 } else { 1000 + i }, ms(t));
        }
        let mut top = Vec::new();
        s.top(ms(t), 1.0, 4, &mut top);
        assert_eq!(top.first().map(|x| x.0), Some(0), "{top:?}");
        // 200 arrivals/s overall, a quarter of them key 0: its guaranteed rate is close to 50.
        assert!((40.0..=51.0).contains(&top[0].1), "{top:?}");
        // The one-off keys have no guaranteed rate worth reporting.
        assert_eq!(top.len(), 1, "{top:?}");
    }

    #[test]
    fn long_runs_renormalise_without_overflow() {
        let mut s = HotSketch::new(4, Duration::from_millis(1));
        // 10,000 τ: the raw scale would be e^10000 without renormalising.
        for i in 0..10_000 {
            s.add(3, ms(i));
        }
        let (lower, _) = s.rate(3, ms(9_999));
        assert!(
            lower.is_finite() && (lower - 1000.0).abs() < 700.0,
            "{lower}"
        );
        // A clock that steps back counts as the landmark, not a panic.
        s.add(3, ms(0));
        assert!(s.rate(3, ms(0)).0.is_finite());
    }

    #[test]
    fn capacity_is_bounded() {
        assert_eq!(HotSketch::new(0, ms(1)).capacity(), 1);
        assert_eq!(HotSketch::new(100_000, ms(1)).capacity(), MAX_COUNTERS);
    }
}
