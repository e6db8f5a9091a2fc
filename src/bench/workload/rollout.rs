//! The rollout family: RL `n`-sample rollouts, the same prompt sent `samples` times at once.
//!
//! A trainer asks for n completions of one prompt and the client library sends them as n
//! requests within a few milliseconds. The ideal is that they land on one replica: the first
//! computes the prompt and the other n − 1 reuse it, where spread over n replicas the fleet
//! computes it n times (llm-d co-locates same-prompt bursts within 100 ms for this). Until the
//! first one's prefill ends nobody's cache holds the prompt, so what keeps the group together is
//! the router's record of where it just sent it (the view's overlay of routed keys, and in a
//! mesh the load-sharing tips from the other nodes).

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::request::{GenParams, WorkloadError, WorkloadRequest};
use super::synth::{check_range, positive, push_text, tokens_in, Arrivals, FAMILY_ROLLOUT};

/// Groups of `samples` identical prompts arrive as a Poisson process at `rate / samples` (so the
/// requests' mean rate is the generator's), each request of a group at a uniform offset within
/// `spread_s` of the group's start. A prompt is a system prompt shared by every group, then the
/// group's own problem.
#[derive(Clone, Debug)]
pub struct RolloutParams {
    /// Requests per group (the rollout's n). Default 8.
    pub samples: usize,
    /// Window a group's requests arrive in, seconds. Default 0.1.
    pub spread_s: f64,
    /// System prompt shared by every group. Default 512 tokens.
    pub system_tokens: u32,
    /// The group's own prompt. Default 1,024..=4,096 tokens.
    pub problem_tokens: (u32, u32),
    /// Output length range. Default 64..=256 tokens.
    pub output_tokens: (u32, u32),
}

impl Default for RolloutParams {
    fn default() -> Self {
        RolloutParams {
            samples: 8,
            spread_s: 0.1,
            system_tokens: 512,
            problem_tokens: (1024, 4096),
            output_tokens: (64, 256),
        }
    }
}

/// Samples per group at most (a bound on a parameter from the command line).
const MAX_SAMPLES: usize = 1024;

/// Generates [`RolloutParams`] requests: `gen.requests` of them, in arrival order.
pub fn rollout(p: &RolloutParams, gen: &GenParams) -> Result<Vec<WorkloadRequest>, WorkloadError> {
    gen.validate()?;
    positive("samples", p.samples)?;
    if p.samples > MAX_SAMPLES || !(p.spread_s.is_finite() && p.spread_s >= 0.0) {
        return Err(WorkloadError::Invalid(format!(
            "samples must be 1..={MAX_SAMPLES} and spread_s ≥ 0"
        )));
    }
    check_range("problem_tokens", p.problem_tokens)?;
    check_range("output_tokens", p.output_tokens)?;
    let mut rng = SmallRng::seed_from_u64(gen.seed);
    let mut groups = Arrivals {
        t: 0.0,
        rate: gen.rate / p.samples as f64,
    };
    let mut out = Vec::with_capacity(gen.requests + p.samples);
    let mut group = 0u64;
    while out.len() < gen.requests {
        let start = groups.next(&mut rng);
        let mut segments = Vec::new();
        push_text(&mut segments, FAMILY_ROLLOUT, 0, u64::MAX, p.system_tokens);
        let problem = tokens_in(&mut rng, p.problem_tokens);
        push_text(&mut segments, FAMILY_ROLLOUT, 1, group, problem);
        for _ in 0..p.samples {
            out.push(WorkloadRequest {
                at_s: start + rng.random::<f64>() * p.spread_s,
                segments: segments.clone(),
                output_tokens: tokens_in(&mut rng, p.output_tokens),
                session: None,
                affinity: None,
                tenant: None,
            });
        }
        group += 1;
    }
    // Groups close together interleave; arrivals must not decrease.
    out.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    out.truncate(gen.requests);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::workload::testing::*;

    #[test]
    fn each_prompt_comes_samples_times_within_the_spread() {
        let p = RolloutParams::default();
        let reqs = rollout(&p, &gen(800)).unwrap();
        assert_eq!(reqs.len(), 800);
        assert!(reqs.windows(2).all(|w| w[0].at_s <= w[1].at_s));
        let mut by_prompt: HashMap<Vec<(u64, u32)>, Vec<f64>> = HashMap::new();
        for r in &reqs {
            by_prompt
                .entry(r.segments.clone())
                .or_default()
                .push(r.at_s);
        }
        // Whole groups, but for the last one the cut may take.
        let short = by_prompt.values().filter(|t| t.len() != 8).count();
        assert!(short <= 1, "{short}");
        for times in by_prompt.values() {
            let (lo, hi) = times
                .iter()
                .fold((f64::MAX, f64::MIN), |(lo, hi), t| (lo.min(*t), hi.max(*t)));
            assert!(hi - lo <= p.spread_s, "{lo} {hi}");
        }
        // Every group shares the system prompt and nothing more.
        let firsts: HashSet<u64> = reqs.iter().map(|r| r.segments[0].0).collect();
        assert_eq!(firsts.len(), 1);
        assert!(rollout(
            &RolloutParams {
                samples: 0,
                ..p.clone()
            },
            &gen(10)
        )
        .is_err());
    }
}
