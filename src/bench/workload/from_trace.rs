//! The Mooncake trace as a workload: one 512-token segment per hash id.

use super::request::WorkloadRequest;
use crate::bench::trace::{dequantized_arrivals, TraceRequest, TRACE_BLOCK_TOKENS};

/// Maps Mooncake records to workload requests: one 512-token segment per hash id, the last cut
/// to `input_length`; arrivals from [`dequantized_arrivals`] when `dequantize`, else the recorded
/// (quantised) timestamps.
pub fn from_trace(trace: &[TraceRequest], dequantize: bool) -> Vec<WorkloadRequest> {
    let arrivals: Vec<f64> = if dequantize {
        dequantized_arrivals(trace)
    } else {
        trace.iter().map(|r| r.timestamp as f64 / 1000.0).collect()
    };
    trace
        .iter()
        .zip(arrivals)
        .map(|(r, at_s)| {
            let mut left = r.input_length;
            let mut segments = Vec::with_capacity(r.hash_ids.len());
            for &id in &r.hash_ids {
                if left == 0 {
                    break;
                }
                let tokens = left.min(TRACE_BLOCK_TOKENS);
                segments.push((id, tokens as u32));
                left -= tokens;
            }
            WorkloadRequest {
                at_s,
                segments,
                output_tokens: u32::try_from(r.output_length).unwrap_or(u32::MAX),
                session: None,
                affinity: None,
                tenant: None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::trace;
    use crate::bench::workload::testing::*;

    #[test]
    fn the_trace_maps_to_512_token_segments_with_a_partial_last() {
        let t = trace::parse(
            "{\"timestamp\":0,\"input_length\":1100,\"output_length\":9,\"hash_ids\":[0,1,2]}\n{\"timestamp\":3000,\"input_length\":600,\"output_length\":1,\"hash_ids\":[0,5]}\n"
                .as_bytes(),
            "t",
        )
        .unwrap();
        let w = from_trace(&t, true);
        assert_eq!(w[0].segments, vec![(0, 512), (1, 512), (2, 76)]);
        assert_eq!(w[0].output_tokens, 9);
        assert_eq!(w[1].at_s, 3.0);
        let (mut a, mut b) = (String::new(), String::new());
        w[0].write_prompt(&mut a);
        trace::synthesize_prompt(&t[0], &mut b);
        assert_eq!(a, b, "same text as the trace's own synthesis");
        // Request 2 reuses block 0 only: 512 of 1700 tokens.
        assert!((ideal_hit_ratio(&w) - 512.0 / 1700.0).abs() < 1e-9);
    }
}
