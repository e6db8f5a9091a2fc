//! The agentic family: real Claude Code conversations (`data/traces/agentic/`, see its
//! README) replayed as sessions of long, mostly shared prompts.
//!
//! Each hash id becomes one segment of `block_size` (64) tokens, the last cut to the request's
//! `in`; the trailing tokens without an id (less than one block) become one segment of their own,
//! unique to the request, as they are the turn's new text. Segment ids pack the file's index into
//! the id, so different conversations never share text, and equal hash ids of one conversation
//! (its sub-agents' included) give equal text.

use std::path::{Path, PathBuf};

use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::agentic_file::{self, Conversation};
use super::request::{GenParams, WorkloadError, WorkloadRequest};
use super::synth::Arrivals;

/// Which conversations, how they overlap and how big their prompts are.
#[derive(Clone, Debug)]
pub struct AgenticParams {
    /// Conversations replayed, drawn by the seed from the files found; 0 = all. Default 0.
    pub conversations: usize,
    /// Mean seconds between two conversations' starts (exponential gaps, seeded), so several
    /// are open at once; 0 = all start together. Default 30.
    pub gap_s: f64,
    /// Longest pause between two requests of one conversation, seconds: a user away for hours
    /// would otherwise stretch a replay past any bench (kv-cache-tester's `--max-delay` 60 s).
    /// Default 60.
    pub max_pause_s: f64,
    /// Multiplies every segment's tokens (at least 1 each): 1/16 turns 100k-token prompts into
    /// ~6k-token ones with the same sharing structure. Within (0, 1]. Default 1.
    pub prompt_scale: f64,
    /// Prompts longer than this keep their first tokens only (after `prompt_scale`); 0 = no cut.
    /// A cut drops the growing tail, so a conversation's prompts look more alike. Simulated
    /// engines refuse prompts over their `max_model_len` (131,072 tokens: 43 of the 415 shipped
    /// requests); this or `prompt_scale` keeps them. Default 0.
    pub max_prompt_tokens: u32,
    /// Output tokens are capped to this (the traces' longest answers run to 10k). Default 512.
    pub max_output_tokens: u32,
}

impl Default for AgenticParams {
    fn default() -> Self {
        AgenticParams {
            conversations: 0,
            gap_s: 30.0,
            max_pause_s: 60.0,
            prompt_scale: 1.0,
            max_prompt_tokens: 0,
            max_output_tokens: 512,
        }
    }
}

impl AgenticParams {
    fn validate(&self) -> Result<(), WorkloadError> {
        let bad = |m: String| Err(WorkloadError::Invalid(m));
        if !(self.gap_s.is_finite() && self.gap_s >= 0.0) {
            return bad(format!("gap_s must be >= 0, got {}", self.gap_s));
        }
        if !(self.max_pause_s.is_finite() && self.max_pause_s >= 0.0) {
            return bad(format!(
                "max_pause_s must be >= 0, got {}",
                self.max_pause_s
            ));
        }
        if !(self.prompt_scale > 0.0 && self.prompt_scale <= 1.0) {
            return bad(format!(
                "prompt_scale must be within (0, 1], got {}",
                self.prompt_scale
            ));
        }
        if self.max_output_tokens == 0 {
            return bad("max_output_tokens must be at least 1".into());
        }
        Ok(())
    }
}

/// Most bytes of conversation files one workload reads (the shipped 29 are 2.2 MB, a 77-file
/// upstream sample ~40 MB): the workload is held in memory, segments and all.
pub const MAX_TOTAL_BYTES: u64 = 1 << 30;

/// The conversations shipped in `data/traces/agentic/`, found relative to the crate (source
/// checkout) or the working directory.
pub fn default_agentic_dir() -> PathBuf {
    let shipped = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/traces/agentic");
    if shipped.exists() {
        shipped
    } else {
        PathBuf::from("data/traces/agentic")
    }
}

/// Reads the conversations under `path` (a directory or one file) that `p` selects and turns
/// them into requests; `gen.requests` caps the count, `gen.seed` draws the conversations and
/// their starts, `gen.rate` is not used (retime the result for a rate).
pub fn agentic(
    path: &Path,
    p: &AgenticParams,
    gen: &GenParams,
) -> Result<Vec<WorkloadRequest>, WorkloadError> {
    p.validate()?;
    let files = agentic_file::list(path)?;
    // The file's index in name order goes into its ids, whichever are drawn.
    let mut order: Vec<usize> = (0..files.len()).collect();
    let mut rng = SmallRng::seed_from_u64(gen.seed);
    order.shuffle(&mut rng);
    if p.conversations > 0 {
        order.truncate(p.conversations);
    }
    let mut conversations = Vec::with_capacity(order.len());
    let mut read = 0u64;
    for i in order {
        // Sizes as listed: a file that grows meanwhile is still cut at its own cap.
        read += std::fs::metadata(&files[i]).map_or(0, |m| m.len());
        if read > MAX_TOTAL_BYTES {
            return Err(WorkloadError::Invalid(format!(
                "the conversations under {} hold more than {MAX_TOTAL_BYTES} bytes: pick fewer \
                 with --family-param conversations=N",
                path.display()
            )));
        }
        conversations.push((i, agentic_file::load(&files[i])?));
    }
    from_conversations(&conversations, p, gen)
}

/// Requests of `conversations` (`(file index, conversation)`, started in this order).
pub fn from_conversations(
    conversations: &[(usize, Conversation)],
    p: &AgenticParams,
    gen: &GenParams,
) -> Result<Vec<WorkloadRequest>, WorkloadError> {
    p.validate()?;
    let mut seen = std::collections::HashMap::new();
    for (i, c) in conversations {
        if let Some(other) = seen.insert(c.id.as_str(), *i) {
            return Err(WorkloadError::Invalid(format!(
                "files {other} and {i} hold the same conversation id '{}': one session each",
                c.id
            )));
        }
    }
    let mut starts = Arrivals {
        t: 0.0,
        // gap_s 0: an infinite rate, every gap 0.
        rate: 1.0 / p.gap_s,
    };
    let mut rng = SmallRng::seed_from_u64(gen.seed ^ 0xA6E7_71C5);
    let mut out = Vec::new();
    for (file, c) in conversations {
        let start = starts.next(&mut rng);
        conversation_requests(*file, c, start, p, &mut out)?;
    }
    // Stable: a conversation's own requests keep their order on equal times.
    out.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    out.truncate(gen.requests);
    Ok(out)
}

/// Appends one conversation's requests, the first at `start`, later ones after their recorded
/// pauses (each capped to `max_pause_s`).
fn conversation_requests(
    file: usize,
    c: &Conversation,
    start: f64,
    p: &AgenticParams,
    out: &mut Vec<WorkloadRequest>,
) -> Result<(), WorkloadError> {
    let file = u64::try_from(file)
        .ok()
        .filter(|&f| f < 1 << FILE_BITS)
        .ok_or_else(|| WorkloadError::Invalid(format!("file index {file} too large")))?;
    let mut at = start;
    let mut prev_t = c.requests.first().map_or(0.0, |r| r.t);
    for (n, r) in c.requests.iter().enumerate() {
        at += (r.t - prev_t).clamp(0.0, p.max_pause_s);
        prev_t = r.t;
        let mut segments = prompt_segments(file, n as u64, r, c.block_tokens);
        scale_and_cut(&mut segments, p.prompt_scale, p.max_prompt_tokens);
        out.push(WorkloadRequest {
            at_s: at,
            segments,
            output_tokens: u32::try_from(r.output)
                .unwrap_or(u32::MAX)
                .clamp(1, p.max_output_tokens),
            session: Some(c.id.clone()),
            affinity: None,
            tenant: None,
        });
    }
    Ok(())
}

/// Bits of a segment id holding the hash id or request number.
const ID_BITS: u32 = 40;
/// Bits holding the file index (above [`ID_BITS`], below the two tag bits).
const FILE_BITS: u32 = 22;
/// Tag of a block segment: top bit set, keeping clear of the Mooncake trace's small ids.
const BLOCK_TAG: u64 = 0b10 << 62;
/// Tag of a request's trailing segment without a hash id.
const TAIL_TAG: u64 = 0b11 << 62;

/// The id of hash id `hash` of file `file` (`hash` <= `MAX_HASH_ID`, `file` < 2^22): distinct
/// files and distinct hashes give distinct ids, by construction rather than by chance.
pub fn block_id(file: u64, hash: u64) -> u64 {
    BLOCK_TAG | file << ID_BITS | (hash & ((1 << ID_BITS) - 1))
}

fn tail_id(file: u64, request: u64) -> u64 {
    TAIL_TAG | file << ID_BITS | (request & ((1 << ID_BITS) - 1))
}

/// One segment per hash id (the last cut to `in`), then the trailing tokens without an id.
fn prompt_segments(
    file: u64,
    n: u64,
    r: &agentic_file::AgenticRequest,
    block: u32,
) -> Vec<(u64, u32)> {
    let mut left = r.input;
    let mut segments = Vec::with_capacity(r.hash_ids.len() + 1);
    for &h in &r.hash_ids {
        if left == 0 {
            break;
        }
        let t = left.min(u64::from(block));
        segments.push((block_id(file, h), t as u32));
        left -= t;
    }
    // Less than one block (checked when the file was read).
    if left > 0 {
        segments.push((tail_id(file, n), left.min(u64::from(block)) as u32));
    }
    segments
}

/// Scales every segment (at least 1 token each), then keeps the first `max_tokens` (0: all).
fn scale_and_cut(segments: &mut Vec<(u64, u32)>, scale: f64, max_tokens: u32) {
    if scale < 1.0 {
        for s in segments.iter_mut() {
            s.1 = ((f64::from(s.1) * scale).round() as u32).max(1);
        }
    }
    if max_tokens == 0 {
        return;
    }
    let mut left = max_tokens;
    let mut keep = 0;
    for s in segments.iter_mut() {
        if left == 0 {
            break;
        }
        s.1 = s.1.min(left);
        left -= s.1;
        keep += 1;
    }
    segments.truncate(keep);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::workload::agentic_file::AgenticRequest;
    use crate::bench::workload::testing::*;

    fn req(t: f64, input: u64, hash_ids: Vec<u64>) -> AgenticRequest {
        AgenticRequest {
            t,
            input,
            output: 2000,
            hash_ids,
        }
    }

    /// Two conversations with the very same hash ids, as every file numbers its blocks from 1.
    fn twins() -> Vec<(usize, Conversation)> {
        let c = |id: &str| Conversation {
            id: id.into(),
            block_tokens: 64,
            requests: vec![
                req(0.0, 150, vec![1, 2]),
                req(5.0, 200, vec![1, 2, 3]),
                req(5000.0, 260, vec![1, 2, 3, 4]),
            ],
        };
        vec![(0, c("a")), (1, c("b"))]
    }

    #[test]
    fn conversations_never_share_ids_but_share_within_themselves() {
        let w = from_conversations(&twins(), &AgenticParams::default(), &gen(100)).unwrap();
        assert_eq!(w.len(), 6);
        let ids = |s: &str| -> HashSet<u64> {
            w.iter()
                .filter(|r| r.session.as_deref() == Some(s))
                .flat_map(|r| r.segments.iter().map(|x| x.0))
                .collect()
        };
        assert!(ids("a").is_disjoint(&ids("b")));
        let a: Vec<_> = w
            .iter()
            .filter(|r| r.session.as_deref() == Some("a"))
            .collect();
        // Request 1 repeats request 0's two blocks: same ids, same text.
        assert_eq!(a[0].segments[..2], a[1].segments[..2]);
        let (mut p0, mut p1) = (String::new(), String::new());
        a[0].write_prompt(&mut p0);
        a[1].write_prompt(&mut p1);
        assert_eq!(p0[..128 * 4], p1[..128 * 4]);
        // 150 tokens: two blocks and a 22-token tail of its own.
        assert_eq!(a[0].prompt_tokens(), 150);
        assert_eq!(a[0].segments.len(), 3);
        assert_ne!(a[0].segments[2].0, a[1].segments[2].0);
        assert!(a.iter().all(|r| r.output_tokens == 512), "capped");
        // Blocks of one file never equal another's, whatever the hash.
        assert_ne!(block_id(0, MAX_HASH), block_id(1, 0));
        assert_ne!(block_id(1, 5), tail_id(1, 5));
    }

    const MAX_HASH: u64 = agentic_file::MAX_HASH_ID;

    #[test]
    fn arrivals_are_staggered_non_decreasing_and_pauses_capped() {
        let p = AgenticParams {
            gap_s: 100.0,
            ..AgenticParams::default()
        };
        let w = from_conversations(&twins(), &p, &gen(100)).unwrap();
        assert!(w.windows(2).all(|x| x[0].at_s <= x[1].at_s));
        let a: Vec<f64> = w
            .iter()
            .filter(|r| r.session.as_deref() == Some("a"))
            .map(|r| r.at_s)
            .collect();
        assert_eq!(a[0], 0.0, "the first conversation starts at 0");
        assert_eq!(a[1] - a[0], 5.0);
        assert_eq!(
            a[2] - a[1],
            60.0,
            "a 4,995 s pause is capped to max_pause_s"
        );
        let b0 = w
            .iter()
            .find(|r| r.session.as_deref() == Some("b"))
            .unwrap();
        assert!(b0.at_s > 0.0, "the second conversation starts later");
        let cut = from_conversations(&twins(), &p, &gen(4)).unwrap();
        assert_eq!(cut.len(), 4);
        let together = AgenticParams {
            gap_s: 0.0,
            ..AgenticParams::default()
        };
        let w = from_conversations(&twins(), &together, &gen(100)).unwrap();
        assert_eq!(
            (w[0].at_s, w[1].at_s),
            (0.0, 0.0),
            "gap_s 0: all start at once"
        );
    }

    #[test]
    fn scale_and_cut_keep_the_sharing_structure() {
        let p = AgenticParams {
            prompt_scale: 1.0 / 16.0,
            ..AgenticParams::default()
        };
        let w = from_conversations(&twins(), &p, &gen(100)).unwrap();
        assert_eq!(
            w[0].segments.iter().map(|s| s.1).collect::<Vec<_>>(),
            vec![4, 4, 1]
        );
        let p = AgenticParams {
            max_prompt_tokens: 100,
            ..AgenticParams::default()
        };
        let w = from_conversations(&twins(), &p, &gen(100)).unwrap();
        assert!(w.iter().all(|r| r.prompt_tokens() == 100));
        assert_eq!(w[0].segments.len(), 2);
        assert!(AgenticParams {
            prompt_scale: 0.0,
            ..AgenticParams::default()
        }
        .validate()
        .is_err());
    }

    #[test]
    fn the_shipped_conversations_load_as_sessions() {
        let w = agentic(
            &default_agentic_dir(),
            &AgenticParams::default(),
            &gen(usize::MAX),
        )
        .unwrap();
        let sessions: HashSet<_> = w.iter().map(|r| r.session.clone()).collect();
        assert_eq!(sessions.len(), 29);
        assert_eq!(w.len(), 415);
        assert!(w.windows(2).all(|x| x[0].at_s <= x[1].at_s));
        assert!(w
            .iter()
            .all(|r| r.segments.iter().all(|s| (1..=64).contains(&s.1))));
        let ideal = ideal_hit_ratio(&w);
        assert!(ideal > 0.8, "agentic prefix reuse {ideal}");
        // Same seed, same workload; a subset by the seed.
        let again = agentic(
            &default_agentic_dir(),
            &AgenticParams::default(),
            &gen(usize::MAX),
        );
        assert_eq!(again.unwrap(), w);
        let three = AgenticParams {
            conversations: 3,
            ..AgenticParams::default()
        };
        let w3 = agentic(&default_agentic_dir(), &three, &gen(usize::MAX)).unwrap();
        let s3: HashSet<_> = w3.iter().map(|r| r.session.clone()).collect();
        assert_eq!(s3.len(), 3);
    }

    #[test]
    fn a_bad_file_in_the_directory_is_an_error_naming_it() {
        let dir = std::env::temp_dir().join(format!("kvmesh-agentic-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("a.json"),
            r#"{"id":"a","block_size":64,"requests":[{"t":0,"in":10,"out":1,"hash_ids":[]}]}"#,
        )
        .unwrap();
        std::fs::write(dir.join("b.json"), "{\"id\": 3}").unwrap();
        let e = agentic(&dir, &AgenticParams::default(), &gen(10))
            .unwrap_err()
            .to_string();
        assert!(e.contains("b.json"), "{e}");
        std::fs::remove_file(dir.join("b.json")).unwrap();
        let w = agentic(&dir, &AgenticParams::default(), &gen(10)).unwrap();
        assert_eq!(w[0].segments.len(), 1, "a 10-token prompt is all tail");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
