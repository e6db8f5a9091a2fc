//! What a workload is: requests as segments of shared text, and the errors and common
//! parameters of building one.

use serde::Serialize;

use crate::bench::trace::{self, push_block_text, TRACE_BLOCK_TOKENS};

/// Longest segment: [`push_block_text`] writes at most one trace block per id.
pub const MAX_SEGMENT_TOKENS: u32 = TRACE_BLOCK_TOKENS as u32;

/// One request of a workload.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkloadRequest {
    /// Arrival, seconds from the workload start (before any speedup).
    pub at_s: f64,
    /// The prompt: `(text id, tokens)` per segment, each at most [`MAX_SEGMENT_TOKENS`].
    pub segments: Vec<(u64, u32)>,
    /// Tokens to generate (`max_tokens`).
    pub output_tokens: u32,
    /// Session or agent-run id, sent as `x-session-id`.
    pub session: Option<String>,
    /// What the prompt is about beyond its text (a RAG request's top document), sent as
    /// `x-affinity-key`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity: Option<String>,
    /// Tenant id, sent as `x-tenant-id`.
    pub tenant: Option<String>,
}

impl WorkloadRequest {
    /// Prompt length in tokens (the simulated engine's tokenizer: one token per 4 bytes).
    pub fn prompt_tokens(&self) -> u64 {
        self.segments.iter().map(|&(_, t)| u64::from(t)).sum()
    }

    /// Writes the prompt text into `out` (cleared first), so callers can reuse one buffer.
    pub fn write_prompt(&self, out: &mut String) {
        out.clear();
        for &(id, tokens) in &self.segments {
            push_block_text(id, u64::from(tokens), out);
        }
    }
}

/// A named list of requests, ordered by arrival.
#[derive(Clone, Debug)]
pub struct Workload {
    /// Short name for reports (`trace`, `chat`, ...).
    pub name: String,
    /// The requests, `at_s` non-decreasing.
    pub requests: Vec<WorkloadRequest>,
}

/// Why a workload could not be built.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// The trace could not be read.
    #[error(transparent)]
    Trace(#[from] trace::TraceError),
    /// A parameter is out of range.
    #[error("invalid workload parameter: {0}")]
    Invalid(String),
    /// An agentic conversation file cannot be read or is not a conversation.
    #[error("agentic trace {path}: {reason}")]
    Agentic {
        /// The file (or directory) at fault.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// What every family takes from the command line.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GenParams {
    /// Mean arrival rate, requests per second (Poisson). Default 20.
    pub rate: f64,
    /// Number of requests. Default 2,000.
    pub requests: usize,
    /// Seed of every random choice. Default 1.
    pub seed: u64,
}

impl Default for GenParams {
    fn default() -> Self {
        GenParams {
            rate: 20.0,
            requests: 2000,
            seed: 1,
        }
    }
}

impl GenParams {
    pub(super) fn validate(&self) -> Result<(), WorkloadError> {
        if !(self.rate.is_finite() && self.rate > 0.0) {
            return Err(WorkloadError::Invalid(format!(
                "rate must be > 0, got {}",
                self.rate
            )));
        }
        Ok(())
    }
}

/// Scales arrival times so the mean rate becomes `rate` (burstiness kept).
pub fn retime(requests: &mut [WorkloadRequest], rate: f64) {
    let (Some(first), Some(last)) = (requests.first(), requests.last()) else {
        return;
    };
    let (t0, span) = (first.at_s, last.at_s - first.at_s);
    if span <= 0.0 || requests.len() < 2 || rate.is_nan() || rate <= 0.0 {
        return;
    }
    let scale = (requests.len() - 1) as f64 / rate / span;
    for r in requests {
        r.at_s = (r.at_s - t0) * scale;
    }
}
