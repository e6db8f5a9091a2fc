//! The zipf family: one hot prefix far more popular than the others.

use rand::rngs::SmallRng;
use rand::SeedableRng;

use super::request::{GenParams, WorkloadError, WorkloadRequest};
use super::synth::{check_range, push_text, tokens_in, Arrivals, Weighted, FAMILY_ZIPF};

/// Zipf-skewed prefixes: `prefixes` long shared prefixes; prefix 0 is drawn `hot_weight` times
/// as often as the mean of the others, which follow Zipf(`zipf_s`) among themselves. Each
/// request is one prefix + a unique suffix. This is the family that punishes pure cache
/// affinity: following the hot prefix to one replica overloads it.
#[derive(Clone, Debug)]
pub struct ZipfParams {
    /// Distinct prefixes (one hot + the rest). Default 32.
    pub prefixes: usize,
    /// Popularity of the hot prefix over the mean of the others. Default 100.
    pub hot_weight: f64,
    /// Zipf exponent among the other prefixes. Default 0.5.
    pub zipf_s: f64,
    /// Prefix length. Default 2,048 tokens.
    pub prefix_tokens: u32,
    /// Suffix length range. Default 64..=256 tokens.
    pub suffix_tokens: (u32, u32),
    /// Output length range. Default 32..=128 tokens.
    pub output_tokens: (u32, u32),
}

impl Default for ZipfParams {
    fn default() -> Self {
        ZipfParams {
            prefixes: 32,
            hot_weight: 100.0,
            zipf_s: 0.5,
            prefix_tokens: 2048,
            suffix_tokens: (64, 256),
            output_tokens: (32, 128),
        }
    }
}

impl ZipfParams {
    /// Popularity weights of the prefixes: the others normalised to mean 1, the hot one
    /// `hot_weight`.
    pub fn weights(&self) -> Vec<f64> {
        let others = self.prefixes.saturating_sub(1);
        let raw: Vec<f64> = (1..=others)
            .map(|k| (k as f64).powf(-self.zipf_s))
            .collect();
        let mean = raw.iter().sum::<f64>() / others.max(1) as f64;
        std::iter::once(self.hot_weight)
            .chain(raw.into_iter().map(|w| w / mean))
            .collect()
    }
}

/// Generates [`ZipfParams`] requests.
pub fn zipf(p: &ZipfParams, gen: &GenParams) -> Result<Vec<WorkloadRequest>, WorkloadError> {
    gen.validate()?;
    if p.prefixes < 2 {
        return Err(WorkloadError::Invalid("prefixes must be at least 2".into()));
    }
    if !(p.hot_weight.is_finite() && p.hot_weight > 0.0 && p.zipf_s.is_finite()) {
        return Err(WorkloadError::Invalid(
            "hot_weight must be > 0 and zipf_s finite".into(),
        ));
    }
    check_range("suffix_tokens", p.suffix_tokens)?;
    check_range("output_tokens", p.output_tokens)?;
    let popularity = Weighted::new(p.weights());
    let mut rng = SmallRng::seed_from_u64(gen.seed);
    let mut arrivals = Arrivals {
        t: 0.0,
        rate: gen.rate,
    };
    let mut out = Vec::with_capacity(gen.requests);
    for i in 0..gen.requests {
        let prefix = popularity.draw(&mut rng) as u64;
        let mut segments = Vec::new();
        push_text(
            &mut segments,
            FAMILY_ZIPF,
            prefix,
            u64::MAX,
            p.prefix_tokens,
        );
        let suffix = tokens_in(&mut rng, p.suffix_tokens);
        push_text(&mut segments, FAMILY_ZIPF, prefix, i as u64, suffix);
        out.push(WorkloadRequest {
            at_s: arrivals.next(&mut rng),
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
    fn zipf_hot_prefix_is_a_hundred_times_each_other_on_average() {
        let p = ZipfParams::default();
        let reqs = zipf(&p, &gen(20_000)).unwrap();
        let prefix_segments = (p.prefix_tokens / MAX_SEGMENT_TOKENS) as usize;
        let mut counts: HashMap<Vec<(u64, u32)>, usize> = HashMap::new();
        for r in &reqs {
            *counts
                .entry(r.segments[..prefix_segments].to_vec())
                .or_default() += 1;
        }
        assert_eq!(counts.len(), p.prefixes);
        let mut c: Vec<usize> = counts.into_values().collect();
        c.sort_unstable_by(|a, b| b.cmp(a));
        let others = c[1..].iter().sum::<usize>() as f64 / (c.len() - 1) as f64;
        let ratio = c[0] as f64 / others;
        assert!((80.0..125.0).contains(&ratio), "hot/other mean {ratio}");
    }
}
