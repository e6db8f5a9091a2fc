//! The agent family: runs of many steps, each appending an action and an observation.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::request::{GenParams, WorkloadError, WorkloadRequest};
use super::synth::{check_range, positive, push_text, tokens_in, Arrivals, Thread, FAMILY_AGENT};

/// Agent runs: `concurrent_runs` runs are open at a time; each arrival is the next step of a
/// random open run. Every run starts with the same tool definitions and a unique task; each step
/// appends the previous action (the last output) and a tool observation, so context grows fast.
/// The run id is the session.
#[derive(Clone, Debug)]
pub struct AgentParams {
    /// Runs open at once. Default 8.
    pub concurrent_runs: usize,
    /// Steps per run range. Default 10..=30.
    pub steps: (u32, u32),
    /// Tool definitions + instructions shared by every run. Default 3,072 tokens.
    pub system_tokens: u32,
    /// Task description range. Default 128..=512 tokens.
    pub task_tokens: (u32, u32),
    /// Tool observation range, appended each step. Default 128..=1,024 tokens.
    pub observation_tokens: (u32, u32),
    /// Action (output) range. Default 32..=128 tokens.
    pub action_tokens: (u32, u32),
}

impl Default for AgentParams {
    fn default() -> Self {
        AgentParams {
            concurrent_runs: 8,
            steps: (10, 30),
            system_tokens: 3072,
            task_tokens: (128, 512),
            observation_tokens: (128, 1024),
            action_tokens: (32, 128),
        }
    }
}

/// Generates [`AgentParams`] requests.
pub fn agent(p: &AgentParams, gen: &GenParams) -> Result<Vec<WorkloadRequest>, WorkloadError> {
    gen.validate()?;
    positive("concurrent_runs", p.concurrent_runs)?;
    check_range("steps", p.steps)?;
    check_range("task_tokens", p.task_tokens)?;
    check_range("observation_tokens", p.observation_tokens)?;
    check_range("action_tokens", p.action_tokens)?;
    let mut rng = SmallRng::seed_from_u64(gen.seed);
    let mut arrivals = Arrivals {
        t: 0.0,
        rate: gen.rate,
    };
    let mut next_id = 0u64;
    let mut open_run = |rng: &mut SmallRng| {
        let mut segments = Vec::new();
        push_text(&mut segments, FAMILY_AGENT, u64::MAX, 0, p.system_tokens);
        let task = tokens_in(rng, p.task_tokens);
        push_text(&mut segments, FAMILY_AGENT, next_id, u64::MAX, task);
        next_id += 1;
        Thread {
            id: next_id - 1,
            segments,
            turn: 0,
            turns: tokens_in(rng, p.steps),
            last_output: 0,
        }
    };
    let mut open: Vec<Thread> = (0..p.concurrent_runs).map(|_| open_run(&mut rng)).collect();
    let mut out = Vec::with_capacity(gen.requests);
    while out.len() < gen.requests {
        let k = rng.random_range(0..open.len());
        let run = &mut open[k];
        if run.turn > 0 {
            let step = u64::from(run.turn);
            push_text(
                &mut run.segments,
                FAMILY_AGENT,
                run.id,
                step << 1 | 1,
                run.last_output,
            );
            let obs = tokens_in(&mut rng, p.observation_tokens);
            push_text(&mut run.segments, FAMILY_AGENT, run.id, step << 1, obs);
        }
        let action = tokens_in(&mut rng, p.action_tokens);
        out.push(WorkloadRequest {
            at_s: arrivals.next(&mut rng),
            segments: run.segments.clone(),
            output_tokens: action,
            session: Some(format!("agent-run-{}", run.id)),
            affinity: None,
            tenant: None,
        });
        run.last_output = action;
        run.turn += 1;
        if run.turn >= run.turns {
            open[k] = open_run(&mut rng);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::workload::testing::*;

    #[test]
    fn agent_steps_grow_the_run_context() {
        let reqs = agent(&AgentParams::default(), &gen(400)).unwrap();
        let mut last: HashMap<&str, &WorkloadRequest> = HashMap::new();
        for r in &reqs {
            let s = r.session.as_deref().unwrap();
            assert!(s.starts_with("agent-run-"));
            if let Some(prev) = last.get(s) {
                assert_eq!(&r.segments[..prev.segments.len()], &prev.segments[..]);
                assert!(r.prompt_tokens() >= prev.prompt_tokens() + 128 + 32);
            }
            last.insert(s, r);
        }
        let ideal = ideal_hit_ratio(&reqs);
        assert!(ideal > 0.8, "agent context reuse {ideal}");
    }
}
