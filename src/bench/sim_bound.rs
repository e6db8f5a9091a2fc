//! A bound no router can beat: each request alone on an idle replica that holds every block any
//! earlier request of the workload computed.
//!
//! Why it is a bound: a request's time to first token on the simulated engine is at least its
//! own prefill steps (`Engine::step_ms` with nothing else in the batch: step overhead, per-token
//! prefill and attention over the uncached tokens, in chunks of `max_num_batched_tokens`), and
//! the tokens a replica can skip are at most the longest prefix some earlier request shared with
//! it (one infinite cache holding everything, the workload's ideal hit). Queueing, batching with
//! other requests, eviction, block rounding and network time only add. The central greedy
//! router is a reference that policies can beat; this is the floor under all of them.

use super::stats::Distribution;
use super::workload::ideal::ideal_cached_tokens;
use super::workload::request::WorkloadRequest;
use crate::engine_sim::{tokenize, Engine, EngineConfig};

/// Per-request TTFT floor, in model seconds, for `requests` in arrival order on `engine`.
pub fn ttft_floor(requests: &[WorkloadRequest], engine: &EngineConfig) -> Distribution {
    let model = Engine::new(engine.clone());
    let mut cached = ideal_cached_tokens(requests);
    let mut samples = Vec::with_capacity(requests.len());
    let mut text = String::new();
    for (r, cached) in requests.iter().zip(cached.drain(..)) {
        r.write_prompt(&mut text);
        let prompt = tokenize(&text).len();
        // Segment tokens and engine tokens differ by rounding: credit at most the whole prompt
        // but one token (an engine always computes the last token to sample the first output).
        let skip = (cached as usize).min(prompt.saturating_sub(1));
        let mut done = skip;
        let mut ms = 0.0;
        let chunk = engine.max_num_batched_tokens.max(1);
        while done < prompt {
            let n = (prompt - done).min(chunk);
            ms += model.step_ms(&[(n, done)], 0, 0);
            done += n;
        }
        samples.push(ms / 1000.0);
    }
    Distribution::of(&mut samples)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::sim::{run, SimConfig};
    use crate::bench::workload;

    #[test]
    fn no_policy_and_not_the_central_router_beat_the_floor() {
        let reqs = workload::system_prompt(
            &workload::SystemPromptParams::default(),
            &workload::GenParams {
                rate: 50.0,
                requests: 300,
                seed: 3,
            },
        )
        .unwrap();
        let cfg = SimConfig::default();
        let floor = ttft_floor(&reqs, &cfg.engine);
        assert!(floor.mean > 0.0);
        for c in [
            SimConfig::default(),
            SimConfig {
                oracle: true,
                ..SimConfig::default()
            },
        ] {
            let r = run(&reqs, &c).unwrap();
            assert!(
                r.ttft.mean >= floor.mean && r.ttft.p50 >= floor.p50,
                "{}: mean {} p50 {} under the floor {} / {}",
                r.policy,
                r.ttft.mean,
                r.ttft.p50,
                floor.mean,
                floor.p50
            );
        }
    }
}
