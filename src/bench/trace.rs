//! The Mooncake trace format, and the text kvmesh synthesises for it.
//!
//! The trace carries no text, only prefix-chained ids of 512-token blocks. A replay needs prompts
//! whose *shared prefixes are exactly the trace's*: each id becomes a deterministic block of
//! text (equal ids → equal text, different ids → different text), and a request's prompt is its
//! blocks in order, the last one cut to `input_length`. With the engine's tokenizer of one token
//! per 4 bytes, a 512-token block is 2,048 bytes.

use std::collections::HashSet;
use std::io::BufRead;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Tokens per trace block (fixed by the Mooncake trace).
pub const TRACE_BLOCK_TOKENS: u64 = 512;
/// Bytes of synthesised text per token (the simulated engine's tokenizer: one token per 4 bytes).
pub const BYTES_PER_TOKEN: usize = 4;

/// One request of the trace.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct TraceRequest {
    /// Arrival, ms from the trace start.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Output tokens.
    pub output_length: u64,
    /// Prefix-chained block ids.
    pub hash_ids: Vec<u64>,
}

/// A trace that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file cannot be opened or read.
    #[error("cannot read trace {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    /// A line is not a trace record.
    #[error("trace {path} line {line}: {source}")]
    Parse {
        path: String,
        line: usize,
        source: serde_json::Error,
    },
}

/// Reads a Mooncake JSONL trace (blank lines skipped).
pub fn load(path: &Path) -> Result<Vec<TraceRequest>, TraceError> {
    let p = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|source| TraceError::Io {
        path: p.clone(),
        source,
    })?;
    parse(std::io::BufReader::new(file), &p)
}

/// Parses JSONL trace records from a reader; `name` labels errors.
pub fn parse(reader: impl BufRead, name: &str) -> Result<Vec<TraceRequest>, TraceError> {
    let mut out = Vec::new();
    for (n, line) in reader.lines().enumerate() {
        let line = line.map_err(|source| TraceError::Io {
            path: name.to_owned(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let r = serde_json::from_str(&line).map_err(|source| TraceError::Parse {
            path: name.to_owned(),
            line: n + 1,
            source,
        })?;
        out.push(r);
    }
    Ok(out)
}

/// The ideal prefix-hit ratio in blocks: replay in order with one infinite cache; a block hits
/// when it lies in the leading run of blocks whose ids appeared in any earlier request.
pub fn ideal_hit_ratio(trace: &[TraceRequest]) -> f64 {
    let mut seen: HashSet<u64> = HashSet::new();
    let (mut hits, mut total) = (0u64, 0u64);
    for r in trace {
        hits += r.hash_ids.iter().take_while(|id| seen.contains(id)).count() as u64;
        total += r.hash_ids.len() as u64;
        seen.extend(r.hash_ids.iter().copied());
    }
    if total == 0 {
        0.0
    } else {
        hits as f64 / total as f64
    }
}

/// Arrival times in seconds with the trace's quantisation undone: the Mooncake timestamps come in
/// steps of about 3 s with ~10 requests per step, which would make every step a burst of
/// simultaneous arrivals that no real router sees. Requests sharing a timestamp are spread evenly
/// over the gap to the next distinct timestamp (deterministic; order kept).
pub fn dequantized_arrivals(trace: &[TraceRequest]) -> Vec<f64> {
    let mut out = Vec::with_capacity(trace.len());
    let mut i = 0;
    while i < trace.len() {
        let t = trace[i].timestamp;
        let j = i + trace[i..].iter().take_while(|r| r.timestamp == t).count();
        // The last step has no successor: assume the median step of 3 s.
        let next = trace.get(j).map_or(t + 3000, |r| r.timestamp);
        let gap = next.saturating_sub(t) as f64 / (j - i) as f64;
        for k in 0..(j - i) {
            out.push((t as f64 + gap * k as f64) / 1000.0);
        }
        i = j;
    }
    out
}

/// Appends the text of block `id` (`TRACE_BLOCK_TOKENS × BYTES_PER_TOKEN` bytes, or fewer when
/// `tokens` is smaller): lowercase words from a SplitMix64 stream seeded by the id.
pub fn push_block_text(id: u64, tokens: u64, out: &mut String) {
    let len = tokens.min(TRACE_BLOCK_TOKENS) as usize * BYTES_PER_TOKEN;
    let mut state = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let mut written = 0;
    out.reserve(len);
    while written < len {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        for byte in z.to_le_bytes() {
            if written == len {
                break;
            }
            // 26 letters and a space: words of ~4 letters, like text.
            let c = match byte % 27 {
                26 => ' ',
                n => (b'a' + n) as char,
            };
            out.push(c);
            written += 1;
        }
    }
}

/// The prompt of a trace request: its blocks' text in order, cut to `input_length` tokens.
pub fn synthesize_prompt(r: &TraceRequest, out: &mut String) {
    out.clear();
    let mut left = r.input_length;
    for id in &r.hash_ids {
        if left == 0 {
            break;
        }
        let tokens = left.min(TRACE_BLOCK_TOKENS);
        push_block_text(*id, tokens, out);
        left -= tokens;
    }
}

/// Default trace, found relative to the crate (source checkout) or the working directory.
pub fn default_trace() -> PathBuf {
    let shipped =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/traces/conversation_trace.jsonl");
    if shipped.exists() {
        shipped
    } else {
        PathBuf::from("data/traces/conversation_trace.jsonl")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn embedded() -> Vec<TraceRequest> {
        load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("data/traces/conversation_trace.jsonl"))
            .unwrap()
    }

    #[test]
    fn the_conversation_trace_has_ideal_hit_ratio_0_366() {
        let t = embedded();
        assert_eq!(t.len(), 12_031);
        let ratio = ideal_hit_ratio(&t);
        assert!((ratio - 0.366).abs() < 0.001, "ideal hit ratio {ratio}");
    }

    #[test]
    fn equal_ids_give_equal_text_and_different_ids_differ() {
        let mut a = String::new();
        let mut b = String::new();
        push_block_text(7, 512, &mut a);
        push_block_text(7, 512, &mut b);
        assert_eq!(a, b);
        assert_eq!(a.len(), 2048);
        b.clear();
        push_block_text(8, 512, &mut b);
        assert_ne!(a, b);
        // No shared 256-byte block between neighbours either.
        assert!(a
            .as_bytes()
            .chunks(256)
            .zip(b.as_bytes().chunks(256))
            .all(|(x, y)| x != y));
    }

    #[test]
    fn prompts_share_exactly_their_common_blocks() {
        let r1 = TraceRequest {
            timestamp: 0,
            input_length: 1100,
            output_length: 1,
            hash_ids: vec![0, 1, 2],
        };
        let r2 = TraceRequest {
            timestamp: 0,
            input_length: 1200,
            output_length: 1,
            hash_ids: vec![0, 1, 3],
        };
        let (mut p1, mut p2) = (String::new(), String::new());
        synthesize_prompt(&r1, &mut p1);
        synthesize_prompt(&r2, &mut p2);
        assert_eq!(p1.len(), 1100 * 4);
        assert_eq!(p2.len(), 1200 * 4);
        let common = p1
            .bytes()
            .zip(p2.bytes())
            .take_while(|(a, b)| a == b)
            .count();
        assert!((2048 * 2..2048 * 2 + 8).contains(&common), "{common}");
    }

    #[test]
    fn dequantized_arrivals_spread_each_step() {
        let r = |t| TraceRequest {
            timestamp: t,
            input_length: 1,
            output_length: 1,
            hash_ids: vec![0],
        };
        let t = [r(0), r(0), r(0), r(3000), r(6000), r(6000)];
        assert_eq!(dequantized_arrivals(&t), vec![0.0, 1.0, 2.0, 3.0, 6.0, 7.5]);
        let all = dequantized_arrivals(&embedded());
        assert!(all.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn malformed_lines_name_their_line() {
        let err = parse("{\"timestamp\":0,\"input_length\":1,\"output_length\":1,\"hash_ids\":[0]}\n\nnot json\n".as_bytes(), "t")
            .unwrap_err();
        assert!(err.to_string().contains("line 3"), "{err}");
    }
}
