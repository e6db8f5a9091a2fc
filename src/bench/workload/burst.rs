//! The burst family: a new hot prefix appears at a high rate on top of background traffic.
//!
//! This is the case hot-prefix replication is for (`core::hot_prefix`): until the burst nobody
//! holds its prefix, so its first requests land on one replica and, without replication,
//! queue there until p2c-cache spills them one replica at a time.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::request::{GenParams, WorkloadError, WorkloadRequest};
use super::synth::{check_range, positive, push_text, tokens_in, Arrivals, FAMILY_BURST};

/// Background requests (one of `background_prefixes` shared prefixes, uniformly, then a unique
/// suffix) arrive at the generator's rate; from `burst_at_s` for `burst_s` seconds a new prefix
/// of `burst_prefix_tokens` arrives on top at `burst_rate`, each with a unique suffix. With
/// `lead_rate` > 0 the burst's prefix also trickles in at that rate before the burst (a prefix
/// that is known, held by one replica, then turns hot).
#[derive(Clone, Debug)]
pub struct BurstParams {
    /// Background shared prefixes. Default 32.
    pub background_prefixes: usize,
    /// Background prefix length. Default 2,048 tokens.
    pub prefix_tokens: u32,
    /// When the burst starts, seconds from the start. Default 20.
    pub burst_at_s: f64,
    /// How long it lasts, seconds. Default 30.
    pub burst_s: f64,
    /// Its rate, requests/s, on top of the background. Default 100.
    pub burst_rate: f64,
    /// Its prefix length. Default 8,192 tokens.
    pub burst_prefix_tokens: u32,
    /// Its rate before the burst, requests/s (0: none, a new prefix). Default 0.
    pub lead_rate: f64,
    /// Suffix length range (both kinds). Default 64..=256 tokens.
    pub suffix_tokens: (u32, u32),
    /// Output length range. Default 32..=128 tokens.
    pub output_tokens: (u32, u32),
}

impl Default for BurstParams {
    fn default() -> Self {
        BurstParams {
            background_prefixes: 32,
            prefix_tokens: 2048,
            burst_at_s: 20.0,
            burst_s: 30.0,
            burst_rate: 100.0,
            burst_prefix_tokens: 8192,
            lead_rate: 0.0,
            suffix_tokens: (64, 256),
            output_tokens: (32, 128),
        }
    }
}

/// The text id `a` of the burst's prefix (background prefixes are `0..background_prefixes`).
const BURST_PREFIX: u64 = u64::MAX;

/// Generates [`BurstParams`] requests: `gen.requests` of them, in arrival order.
pub fn burst(p: &BurstParams, gen: &GenParams) -> Result<Vec<WorkloadRequest>, WorkloadError> {
    gen.validate()?;
    positive("background_prefixes", p.background_prefixes)?;
    let finite = |v: f64| v.is_finite() && v >= 0.0;
    let rates = p.burst_rate.is_finite() && p.burst_rate > 0.0 && finite(p.lead_rate);
    if !(finite(p.burst_at_s) && finite(p.burst_s) && rates) {
        return Err(WorkloadError::Invalid(
            "burst_at_s, burst_s and lead_rate must be ≥ 0 and burst_rate > 0".into(),
        ));
    }
    check_range("suffix_tokens", p.suffix_tokens)?;
    check_range("output_tokens", p.output_tokens)?;
    let mut rng = SmallRng::seed_from_u64(gen.seed);
    let mut background = Arrivals {
        t: 0.0,
        rate: gen.rate,
    };
    let mut hot = Arrivals {
        t: p.burst_at_s,
        rate: p.burst_rate,
    };
    let mut lead = Arrivals {
        t: 0.0,
        rate: p.lead_rate.max(1e-9),
    };
    let (mut next_bg, mut next_hot) = (background.next(&mut rng), hot.next(&mut rng));
    let mut next_lead = if p.lead_rate > 0.0 {
        lead.next(&mut rng)
    } else {
        f64::INFINITY
    };
    let end = p.burst_at_s + p.burst_s;
    let mut out = Vec::with_capacity(gen.requests);
    for i in 0..gen.requests {
        let in_lead = next_lead < p.burst_at_s && next_lead < next_bg;
        let in_burst = !in_lead && next_hot < end && next_hot < next_bg;
        let (at_s, prefix, tokens) = if in_lead {
            let at = next_lead;
            next_lead = lead.next(&mut rng);
            (at, BURST_PREFIX, p.burst_prefix_tokens)
        } else if in_burst {
            let at = next_hot;
            next_hot = hot.next(&mut rng);
            (at, BURST_PREFIX, p.burst_prefix_tokens)
        } else {
            let at = next_bg;
            next_bg = background.next(&mut rng);
            let prefix = rng.random_range(0..p.background_prefixes) as u64;
            (at, prefix, p.prefix_tokens)
        };
        let mut segments = Vec::new();
        push_text(&mut segments, FAMILY_BURST, prefix, u64::MAX, tokens);
        let suffix = tokens_in(&mut rng, p.suffix_tokens);
        push_text(&mut segments, FAMILY_BURST, prefix, i as u64, suffix);
        out.push(WorkloadRequest {
            at_s,
            segments,
            output_tokens: tokens_in(&mut rng, p.output_tokens),
            session: None,
            affinity: None,
            tenant: None,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::workload::testing::*;

    #[test]
    fn the_burst_prefix_appears_only_in_its_window_at_its_rate() {
        let p = BurstParams::default();
        let reqs = burst(
            &p,
            &GenParams {
                rate: 20.0,
                requests: 5000,
                seed: 3,
            },
        )
        .unwrap();
        assert!(reqs.windows(2).all(|w| w[0].at_s <= w[1].at_s));
        let hot_len = (p.burst_prefix_tokens / MAX_SEGMENT_TOKENS) as usize;
        let first = reqs
            .iter()
            .find(|r| r.prompt_tokens() > u64::from(p.burst_prefix_tokens))
            .unwrap();
        let hot: Vec<_> = reqs
            .iter()
            .filter(|r| r.segments[..hot_len.min(r.segments.len())] == first.segments[..hot_len])
            .collect();
        assert!(hot
            .iter()
            .all(|r| (p.burst_at_s..p.burst_at_s + p.burst_s).contains(&r.at_s)));
        let rate = hot.len() as f64 / p.burst_s;
        assert!((90.0..110.0).contains(&rate), "burst rate {rate}");
        // The background keeps its rate through the burst.
        let bg = reqs.len() - hot.len();
        let span = reqs.last().unwrap().at_s;
        assert!(((bg as f64 / span) - 20.0).abs() < 2.5, "{bg} in {span} s");
    }
}
