//! The best any router could do on a workload: its prefix-hit ratio with one infinite cache.

use std::collections::HashSet;

use super::request::WorkloadRequest;
use super::synth::mix;

/// The ideal prefix-hit ratio in tokens: replay in order with one infinite cache; a segment hits
/// when the whole chain of segments up to and including it appeared in an earlier request.
/// (For the Mooncake trace this is the README's token ratio, 0.374, up to partial last blocks.)
pub fn ideal_hit_ratio(requests: &[WorkloadRequest]) -> f64 {
    let cached = ideal_cached_tokens(requests);
    let hits: u64 = cached.iter().sum();
    let total: u64 = requests.iter().map(WorkloadRequest::prompt_tokens).sum();
    if total == 0 {
        0.0
    } else {
        hits as f64 / total as f64
    }
}

/// Per request, in order: the prompt tokens one infinite cache would hold when it arrives (the
/// leading segments whose whole chain appeared in an earlier request).
pub fn ideal_cached_tokens(requests: &[WorkloadRequest]) -> Vec<u64> {
    let mut seen: HashSet<u64> = HashSet::new();
    let mut out = Vec::with_capacity(requests.len());
    for r in requests {
        let mut chain = 0x5157_4b56_4d45_5348u64;
        let mut hitting = true;
        let mut hits = 0u64;
        for &(id, tokens) in &r.segments {
            chain = mix(chain ^ mix(id ^ (u64::from(tokens) << 48)));
            if hitting && seen.contains(&chain) {
                hits += u64::from(tokens);
            } else {
                hitting = false;
            }
            seen.insert(chain);
        }
        out.push(hits);
    }
    out
}
