//! The generators' shared parts: text ids that make equal ids equal text, Poisson arrivals,
//! open threads (chat sessions, agent runs), weighted draws and parameter checks.

use rand::rngs::SmallRng;
use rand::Rng;

use super::request::{WorkloadError, MAX_SEGMENT_TOKENS};

/// SplitMix64 finaliser: ids for synthetic text, far from the trace's small ids.
pub(super) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The id of piece `part` of text `(family, a, b)`.
pub(super) fn text_id(family: u64, a: u64, b: u64, part: u64) -> u64 {
    mix(mix(mix(family ^ 0xA5A5_0000) ^ a) ^ b.rotate_left(17)) ^ part.rotate_left(40)
}

/// Appends a text of `tokens` tokens as segments of at most [`MAX_SEGMENT_TOKENS`], ids derived
/// from `(family, a, b)`: the same triple always gives the same text.
pub(super) fn push_text(segments: &mut Vec<(u64, u32)>, family: u64, a: u64, b: u64, tokens: u32) {
    let mut left = tokens;
    let mut part = 0;
    while left > 0 {
        let t = left.min(MAX_SEGMENT_TOKENS);
        segments.push((text_id(family, a, b, part), t));
        left -= t;
        part += 1;
    }
}

/// Poisson arrival times: exponential gaps with mean `1 / rate`.
pub(super) struct Arrivals {
    pub(super) t: f64,
    pub(super) rate: f64,
}

impl Arrivals {
    pub(super) fn next(&mut self, rng: &mut SmallRng) -> f64 {
        let at = self.t;
        // 1 - U is in (0, 1], so the log is finite.
        let u: f64 = rng.random();
        self.t += -(1.0 - u).ln() / self.rate;
        at
    }
}

pub(super) fn tokens_in(rng: &mut SmallRng, (lo, hi): (u32, u32)) -> u32 {
    if hi <= lo {
        lo
    } else {
        rng.random_range(lo..=hi)
    }
}

pub(super) fn check_range(name: &str, (lo, hi): (u32, u32)) -> Result<(), WorkloadError> {
    if lo == 0 || hi < lo {
        return Err(WorkloadError::Invalid(format!(
            "{name} must be a range lo..=hi with 1 <= lo <= hi, got {lo}..={hi}"
        )));
    }
    Ok(())
}

pub(super) fn positive(name: &str, v: usize) -> Result<(), WorkloadError> {
    if v == 0 {
        return Err(WorkloadError::Invalid(format!("{name} must be at least 1")));
    }
    Ok(())
}

pub(super) const FAMILY_SYSTEM: u64 = 1;
pub(super) const FAMILY_CHAT: u64 = 2;
pub(super) const FAMILY_RAG: u64 = 3;
pub(super) const FAMILY_AGENT: u64 = 4;
pub(super) const FAMILY_ZIPF: u64 = 5;
pub(super) const FAMILY_TENANTS: u64 = 6;
pub(super) const FAMILY_BURST: u64 = 7;
pub(super) const FAMILY_ROLLOUT: u64 = 8;

/// An open conversation or agent run: its prompt so far and what it still has to say.
pub(super) struct Thread {
    pub(super) id: u64,
    pub(super) segments: Vec<(u64, u32)>,
    pub(super) turn: u32,
    pub(super) turns: u32,
    /// Tokens the last request asked for, appended as the answer before the next turn.
    pub(super) last_output: u32,
}

/// Draws from weights by inverse CDF (binary search over the cumulative sums).
pub(super) struct Weighted {
    cumulative: Vec<f64>,
}

impl Weighted {
    pub(super) fn new(weights: impl IntoIterator<Item = f64>) -> Self {
        let mut acc = 0.0;
        let cumulative = weights
            .into_iter()
            .map(|w| {
                acc += w;
                acc
            })
            .collect();
        Weighted { cumulative }
    }

    pub(super) fn zipf(n: usize, s: f64) -> Self {
        Weighted::new((1..=n).map(|k| (k as f64).powf(-s)))
    }

    pub(super) fn draw(&self, rng: &mut SmallRng) -> usize {
        let total = self.cumulative.last().copied().unwrap_or(0.0);
        let x = rng.random::<f64>() * total;
        self.cumulative
            .partition_point(|&c| c <= x)
            .min(self.cumulative.len().saturating_sub(1))
    }
}
