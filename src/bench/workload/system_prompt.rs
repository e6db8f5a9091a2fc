//! The system-prompt family: groups of requests sharing one system prompt.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::request::{GenParams, WorkloadError, WorkloadRequest};
use super::synth::{check_range, positive, push_text, tokens_in, Arrivals, FAMILY_SYSTEM};

/// Shared system prompts, after SGLang's "generated shared prefix" benchmark: `groups` system
/// prompts, each followed by `prompts_per_group` different questions. The request order is a
/// seeded shuffle of all (group, question) pairs, repeated with fresh questions when more
/// requests are asked for.
#[derive(Clone, Debug)]
pub struct SystemPromptParams {
    /// System prompts. Default 16.
    pub groups: usize,
    /// Questions per system prompt in one pass. Default 16.
    pub prompts_per_group: usize,
    /// System prompt length. Default 2,048 tokens.
    pub system_tokens: u32,
    /// Question length range. Default 128..=256 tokens.
    pub question_tokens: (u32, u32),
    /// Output length range. Default 64..=192 tokens.
    pub output_tokens: (u32, u32),
}

impl Default for SystemPromptParams {
    fn default() -> Self {
        SystemPromptParams {
            groups: 16,
            prompts_per_group: 16,
            system_tokens: 2048,
            question_tokens: (128, 256),
            output_tokens: (64, 192),
        }
    }
}

/// Generates [`SystemPromptParams`] requests.
pub fn system_prompt(
    p: &SystemPromptParams,
    gen: &GenParams,
) -> Result<Vec<WorkloadRequest>, WorkloadError> {
    gen.validate()?;
    positive("groups", p.groups)?;
    positive("prompts_per_group", p.prompts_per_group)?;
    check_range("question_tokens", p.question_tokens)?;
    check_range("output_tokens", p.output_tokens)?;
    let mut rng = SmallRng::seed_from_u64(gen.seed);
    let mut arrivals = Arrivals {
        t: 0.0,
        rate: gen.rate,
    };
    let mut out = Vec::with_capacity(gen.requests);
    let mut order: Vec<usize> = Vec::new();
    let mut pass = 0u64;
    while out.len() < gen.requests {
        if order.is_empty() {
            order = (0..p.groups * p.prompts_per_group).collect();
            // Fisher-Yates by hand: the order is part of the seed's contract.
            for i in (1..order.len()).rev() {
                order.swap(i, rng.random_range(0..=i));
            }
            pass += 1;
        }
        let Some(pair) = order.pop() else { break };
        let group = (pair / p.prompts_per_group) as u64;
        let mut segments = Vec::new();
        push_text(
            &mut segments,
            FAMILY_SYSTEM,
            group,
            u64::MAX,
            p.system_tokens,
        );
        let question = tokens_in(&mut rng, p.question_tokens);
        push_text(
            &mut segments,
            FAMILY_SYSTEM,
            group,
            (pass << 32) | pair as u64,
            question,
        );
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
    fn system_prompt_groups_share_exactly_their_system_prompt() {
        let p = SystemPromptParams::default();
        let reqs = system_prompt(&p, &gen(p.groups * p.prompts_per_group)).unwrap();
        let sys_segments = (p.system_tokens / MAX_SEGMENT_TOKENS) as usize;
        let mut groups: HashMap<Vec<(u64, u32)>, usize> = HashMap::new();
        for r in &reqs {
            *groups
                .entry(r.segments[..sys_segments].to_vec())
                .or_default() += 1;
        }
        // One full pass: every group exactly prompts_per_group times.
        assert_eq!(groups.len(), p.groups);
        assert!(groups.values().all(|&n| n == p.prompts_per_group));
        // Questions are never shared.
        let tails: HashSet<_> = reqs.iter().map(|r| r.segments[sys_segments]).collect();
        assert_eq!(tails.len(), reqs.len());
        let ideal = ideal_hit_ratio(&reqs);
        assert!(ideal > 0.8, "ideal {ideal}");
    }
}
