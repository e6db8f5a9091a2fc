//! One workload type for every instrument: `kvmesh bench` replays it over HTTP, `kvmesh sim`
//! replays it in virtual time, and the demo reuses both.
//!
//!
//! A [`WorkloadRequest`] carries no text, only *segments*: `(text id, tokens)` pairs whose text is
//! [`push_block_text`](crate::bench::trace::push_block_text)`(id, tokens)`. Equal ids give equal text, so two prompts share exactly the
//! leading segments they have in common — the same trick that turns the Mooncake trace's hash ids
//! into prompts, generalised so that synthetic families can say "this system prompt, then that
//! document, then this question" and have the sharing structure they claim, byte for byte.
//!
//! Families (each seeded, arrivals Poisson at a rate; parameters and defaults on the structs):
//! - [`WorkloadKind::Trace`]: the Mooncake trace (512-token segments, last one partial).
//! - [`AgenticParams`] (`WorkloadKind::Agentic`): real Claude Code conversations, one session
//!   each, 64-token segments, staggered starts (not in `WorkloadKind::SYNTHETIC`: read from files).
//! - [`SystemPromptParams`]: groups × prompts sharing one system prompt per group.
//! - [`ChatParams`]: multi-turn sessions whose context grows turn by turn (session header).
//! - [`RagParams`]: k document chunks drawn by Zipf popularity, then a question.
//! - [`AgentParams`]: agent runs of many steps, each appending an action and an observation
//!   (run id as session).
//! - [`ZipfParams`]: one hot prefix 100× as popular as each of the others.
//! - [`BurstParams`]: a new hot prefix appearing at a high rate on top of background traffic
//!   (not in `WorkloadKind::SYNTHETIC`: its rate is not one Poisson rate).
//! - [`RolloutParams`]: RL n-sample rollouts, each prompt sent n times within 100 ms (not in
//!   `WorkloadKind::SYNTHETIC`: its arrivals come in groups).
//! - [`TenantsParams`]: one big tenant with a fixed system prompt plus many small tenants
//!   (tenant header).
//!
//! Layout: [`request`] (the types), [`synth`] (what the generators share), one file per family,
//! [`from_trace`](mod@from_trace), [`agentic`](mod@agentic) + [`agentic_file`] (the conversation
//! files), [`kind`] (names and defaults), [`args`] (the flags),
//! [`ideal`] (the best hit ratio possible).

pub mod agent;
pub mod agentic;
pub mod agentic_file;
pub mod args;
pub mod burst;
pub mod chat;
pub mod from_trace;
pub mod ideal;
pub mod kind;
pub mod rag;
pub mod request;
pub mod rollout;
pub mod synth;
pub mod system_prompt;
pub mod tenants;
pub mod zipf;

pub use agent::{agent, AgentParams};
pub use agentic::{agentic, default_agentic_dir, AgenticParams};
pub use args::{build_with, FamilyParams, WorkloadArgs};
pub use burst::{burst, BurstParams};
pub use chat::{chat, ChatParams};
pub use from_trace::from_trace;
pub use ideal::ideal_hit_ratio;
pub use kind::{build, WorkloadKind};
pub use rag::{rag, RagParams};
pub use request::{
    retime, GenParams, Workload, WorkloadError, WorkloadRequest, MAX_SEGMENT_TOKENS,
};
pub use rollout::{rollout, RolloutParams};
pub use system_prompt::{system_prompt, SystemPromptParams};
pub use tenants::{tenants, TenantsParams};
pub use zipf::{zipf, ZipfParams};

#[cfg(test)]
pub(crate) mod testing {
    pub use super::*;
    pub use std::collections::{HashMap, HashSet};

    pub fn gen(n: usize) -> GenParams {
        GenParams {
            rate: 10.0,
            requests: n,
            seed: 7,
        }
    }

    pub fn all(g: &GenParams) -> Vec<(WorkloadKind, Vec<WorkloadRequest>)> {
        WorkloadKind::SYNTHETIC
            .iter()
            .map(|k| (k.clone(), build(k, g).unwrap().requests))
            .collect()
    }

    pub fn leading_common(a: &WorkloadRequest, b: &WorkloadRequest) -> usize {
        a.segments
            .iter()
            .zip(&b.segments)
            .take_while(|(x, y)| x == y)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;

    #[test]
    fn every_family_is_deterministic_for_a_seed_and_differs_across_seeds() {
        let a = all(&gen(300));
        let b = all(&gen(300));
        let c = all(&GenParams {
            seed: 8,
            ..gen(300)
        });
        for ((k, x), ((_, y), (_, z))) in a.iter().zip(b.iter().zip(&c)) {
            assert_eq!(x, y, "{k} not deterministic");
            assert_ne!(x, z, "{k} ignores the seed");
            assert_eq!(x.len(), 300, "{k}");
            assert!(x.windows(2).all(|w| w[0].at_s <= w[1].at_s), "{k}");
            assert!(
                x.iter().all(|r| r.output_tokens >= 1
                    && !r.segments.is_empty()
                    && r.segments.iter().all(|&(_, t)| (1..=512).contains(&t))),
                "{k}"
            );
        }
    }

    #[test]
    fn arrivals_are_poisson_at_the_rate() {
        for (k, reqs) in all(&GenParams {
            rate: 50.0,
            requests: 4000,
            seed: 3,
        }) {
            let span = reqs.last().unwrap().at_s - reqs[0].at_s;
            let rate = (reqs.len() - 1) as f64 / span;
            assert!((rate - 50.0).abs() < 5.0, "{k}: measured rate {rate}");
        }
    }
}
