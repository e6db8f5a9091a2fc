//! One workload type for every instrument: `kvmesh bench` replays it over HTTP, `kvmesh sim`
//! replays it in virtual time, and the demo reuses both.
//!
//! A [`WorkloadRequest`] carries no text, only *segments*: `(text id, tokens)` pairs whose text is
//! [`push_block_text`]`(id, tokens)`. Equal ids give equal text, so two prompts share exactly the
//! leading segments they have in common — the same trick that turns the Mooncake trace's hash ids
//! into prompts, generalised so that synthetic families can say "this system prompt, then that
//! document, then this question" and have the sharing structure they claim, byte for byte.
//!
//! Families (each seeded, arrivals Poisson at a rate; parameters and defaults on the structs):
//! - [`WorkloadKind::Trace`]: the Mooncake trace (512-token segments, last one partial).
//! - [`SystemPromptParams`]: groups × prompts sharing one system prompt per group.
//! - [`ChatParams`]: multi-turn sessions whose context grows turn by turn (session header).
//! - [`RagParams`]: k document chunks drawn by Zipf popularity, then a question.
//! - [`AgentParams`]: agent runs of many steps, each appending an action and an observation
//!   (run id as session).
//! - [`ZipfParams`]: one hot prefix 100× as popular as each of the others.
//! - [`TenantsParams`]: one big tenant with a fixed system prompt plus many small tenants
//!   (tenant header).

use std::collections::HashSet;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::trace::{self, dequantized_arrivals, push_block_text, TraceRequest, TRACE_BLOCK_TOKENS};

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
}

/// Which workload to build, as given on the command line:
/// `trace[:path] | system-prompt | chat | rag | agent | zipf | tenants`.
#[derive(Clone, Debug, PartialEq)]
pub enum WorkloadKind {
    /// The Mooncake trace; `None` = the conversation trace shipped in `data/traces/`.
    Trace(Option<PathBuf>),
    /// Shared system prompts ([`SystemPromptParams`]).
    SystemPrompt,
    /// Multi-turn chat ([`ChatParams`]).
    Chat,
    /// Retrieval-augmented generation ([`RagParams`]).
    Rag,
    /// Agent runs ([`AgentParams`]).
    Agent,
    /// Zipf-skewed prefixes ([`ZipfParams`]).
    Zipf,
    /// Multi-tenant mix ([`TenantsParams`]).
    Tenants,
}

impl WorkloadKind {
    /// The synthetic families, in documentation order.
    pub const SYNTHETIC: [WorkloadKind; 6] = [
        WorkloadKind::SystemPrompt,
        WorkloadKind::Chat,
        WorkloadKind::Rag,
        WorkloadKind::Agent,
        WorkloadKind::Zipf,
        WorkloadKind::Tenants,
    ];

    /// Short name (the CLI spelling without a path).
    pub fn name(&self) -> &'static str {
        match self {
            WorkloadKind::Trace(_) => "trace",
            WorkloadKind::SystemPrompt => "system-prompt",
            WorkloadKind::Chat => "chat",
            WorkloadKind::Rag => "rag",
            WorkloadKind::Agent => "agent",
            WorkloadKind::Zipf => "zipf",
            WorkloadKind::Tenants => "tenants",
        }
    }
}

impl fmt::Display for WorkloadKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkloadKind::Trace(Some(p)) => write!(f, "trace:{}", p.display()),
            other => f.write_str(other.name()),
        }
    }
}

impl FromStr for WorkloadKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("trace:") {
            if path.is_empty() {
                return Err("trace: needs a path (or use plain `trace`)".into());
            }
            return Ok(WorkloadKind::Trace(Some(PathBuf::from(path))));
        }
        match s {
            "trace" => Ok(WorkloadKind::Trace(None)),
            "system-prompt" => Ok(WorkloadKind::SystemPrompt),
            "chat" => Ok(WorkloadKind::Chat),
            "rag" => Ok(WorkloadKind::Rag),
            "agent" => Ok(WorkloadKind::Agent),
            "zipf" => Ok(WorkloadKind::Zipf),
            "tenants" => Ok(WorkloadKind::Tenants),
            other => Err(format!(
                "unknown workload '{other}' (expected trace[:path], system-prompt, chat, rag, agent, zipf or tenants)"
            )),
        }
    }
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
    fn validate(&self) -> Result<(), WorkloadError> {
        if !(self.rate.is_finite() && self.rate > 0.0) {
            return Err(WorkloadError::Invalid(format!(
                "rate must be > 0, got {}",
                self.rate
            )));
        }
        Ok(())
    }
}

/// Builds a workload with the families' default parameters. For the trace, `gen` is ignored:
/// the whole trace is returned with dequantised arrivals (use [`WorkloadArgs::load`] to cut or
/// retime it).
pub fn build(kind: &WorkloadKind, gen: &GenParams) -> Result<Workload, WorkloadError> {
    let requests = match kind {
        WorkloadKind::Trace(path) => {
            let path = path.clone().unwrap_or_else(super::sim_cli::default_trace);
            from_trace(&trace::load(&path)?, true)
        }
        WorkloadKind::SystemPrompt => system_prompt(&SystemPromptParams::default(), gen)?,
        WorkloadKind::Chat => chat(&ChatParams::default(), gen)?,
        WorkloadKind::Rag => rag(&RagParams::default(), gen)?,
        WorkloadKind::Agent => agent(&AgentParams::default(), gen)?,
        WorkloadKind::Zipf => zipf(&ZipfParams::default(), gen)?,
        WorkloadKind::Tenants => tenants(&TenantsParams::default(), gen)?,
    };
    Ok(Workload {
        name: kind.name().to_owned(),
        requests,
    })
}

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
                tenant: None,
            }
        })
        .collect()
}

/// The ideal prefix-hit ratio in tokens: replay in order with one infinite cache; a segment hits
/// when the whole chain of segments up to and including it appeared in an earlier request.
/// (For the Mooncake trace this is the README's token ratio, 0.374, up to partial last blocks.)
pub fn ideal_hit_ratio(requests: &[WorkloadRequest]) -> f64 {
    let mut seen: HashSet<u64> = HashSet::new();
    let (mut hits, mut total) = (0u64, 0u64);
    for r in requests {
        let mut chain = 0x5157_4b56_4d45_5348u64;
        let mut hitting = true;
        for &(id, tokens) in &r.segments {
            chain = mix(chain ^ mix(id ^ (u64::from(tokens) << 48)));
            if hitting && seen.contains(&chain) {
                hits += u64::from(tokens);
            } else {
                hitting = false;
            }
            seen.insert(chain);
            total += u64::from(tokens);
        }
    }
    if total == 0 {
        0.0
    } else {
        hits as f64 / total as f64
    }
}

/// SplitMix64 finaliser: ids for synthetic text, far from the trace's small ids.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The id of piece `part` of text `(family, a, b)`.
fn text_id(family: u64, a: u64, b: u64, part: u64) -> u64 {
    mix(mix(mix(family ^ 0xA5A5_0000) ^ a) ^ b.rotate_left(17)) ^ part.rotate_left(40)
}

/// Appends a text of `tokens` tokens as segments of at most [`MAX_SEGMENT_TOKENS`], ids derived
/// from `(family, a, b)`: the same triple always gives the same text.
fn push_text(segments: &mut Vec<(u64, u32)>, family: u64, a: u64, b: u64, tokens: u32) {
    let mut left = tokens;
    let mut part = 0;
    while left > 0 {
        let t = left.min(MAX_SEGMENT_TOKENS);
        segments.push((text_id(family, a, b, part), t));
        left -= t;
        part += 1;
    }
}

/// Poisson arrival times: exponential gaps with mean `1 / rate`.
struct Arrivals {
    t: f64,
    rate: f64,
}

impl Arrivals {
    fn next(&mut self, rng: &mut SmallRng) -> f64 {
        let at = self.t;
        // 1 - U is in (0, 1], so the log is finite.
        let u: f64 = rng.random();
        self.t += -(1.0 - u).ln() / self.rate;
        at
    }
}

fn tokens_in(rng: &mut SmallRng, (lo, hi): (u32, u32)) -> u32 {
    if hi <= lo {
        lo
    } else {
        rng.random_range(lo..=hi)
    }
}

fn check_range(name: &str, (lo, hi): (u32, u32)) -> Result<(), WorkloadError> {
    if lo == 0 || hi < lo {
        return Err(WorkloadError::Invalid(format!(
            "{name} must be a range lo..=hi with 1 <= lo <= hi, got {lo}..={hi}"
        )));
    }
    Ok(())
}

fn positive(name: &str, v: usize) -> Result<(), WorkloadError> {
    if v == 0 {
        return Err(WorkloadError::Invalid(format!("{name} must be at least 1")));
    }
    Ok(())
}

const FAMILY_SYSTEM: u64 = 1;
const FAMILY_CHAT: u64 = 2;
const FAMILY_RAG: u64 = 3;
const FAMILY_AGENT: u64 = 4;
const FAMILY_ZIPF: u64 = 5;
const FAMILY_TENANTS: u64 = 6;

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
            tenant: None,
        });
    }
    Ok(out)
}

/// Multi-turn chat: `concurrent_sessions` conversations are open at a time; each arrival takes
/// the next turn of a random open one. Turn k's prompt is turn k−1's prompt + the previous
/// answer + a new user message, so each turn extends the one before; every session starts with
/// the same short system prompt. A session that has had `turns` turns is replaced by a new one.
#[derive(Clone, Debug)]
pub struct ChatParams {
    /// Conversations open at once. Default 32.
    pub concurrent_sessions: usize,
    /// Turns per conversation range. Default 4..=12.
    pub turns: (u32, u32),
    /// System prompt shared by every session. Default 512 tokens.
    pub system_tokens: u32,
    /// User message length range. Default 64..=512 tokens.
    pub user_tokens: (u32, u32),
    /// Answer length range (output, then part of the next turn's prompt). Default 64..=384.
    pub answer_tokens: (u32, u32),
}

impl Default for ChatParams {
    fn default() -> Self {
        ChatParams {
            concurrent_sessions: 32,
            turns: (4, 12),
            system_tokens: 512,
            user_tokens: (64, 512),
            answer_tokens: (64, 384),
        }
    }
}

/// An open conversation or agent run: its prompt so far and what it still has to say.
struct Thread {
    id: u64,
    segments: Vec<(u64, u32)>,
    turn: u32,
    turns: u32,
    /// Tokens the last request asked for, appended as the answer before the next turn.
    last_output: u32,
}

/// Generates [`ChatParams`] requests.
pub fn chat(p: &ChatParams, gen: &GenParams) -> Result<Vec<WorkloadRequest>, WorkloadError> {
    gen.validate()?;
    positive("concurrent_sessions", p.concurrent_sessions)?;
    check_range("turns", p.turns)?;
    check_range("user_tokens", p.user_tokens)?;
    check_range("answer_tokens", p.answer_tokens)?;
    let mut rng = SmallRng::seed_from_u64(gen.seed);
    let mut arrivals = Arrivals {
        t: 0.0,
        rate: gen.rate,
    };
    let mut next_id = 0u64;
    let mut open_thread = |rng: &mut SmallRng| {
        let mut segments = Vec::new();
        push_text(&mut segments, FAMILY_CHAT, u64::MAX, 0, p.system_tokens);
        next_id += 1;
        Thread {
            id: next_id - 1,
            segments,
            turn: 0,
            turns: tokens_in(rng, p.turns),
            last_output: 0,
        }
    };
    let mut open: Vec<Thread> = (0..p.concurrent_sessions)
        .map(|_| open_thread(&mut rng))
        .collect();
    let mut out = Vec::with_capacity(gen.requests);
    while out.len() < gen.requests {
        let k = rng.random_range(0..open.len());
        let s = &mut open[k];
        if s.turn > 0 {
            push_text(
                &mut s.segments,
                FAMILY_CHAT,
                s.id,
                u64::from(s.turn) << 1 | 1,
                s.last_output,
            );
        }
        let user = tokens_in(&mut rng, p.user_tokens);
        push_text(
            &mut s.segments,
            FAMILY_CHAT,
            s.id,
            u64::from(s.turn) << 1,
            user,
        );
        let output = tokens_in(&mut rng, p.answer_tokens);
        out.push(WorkloadRequest {
            at_s: arrivals.next(&mut rng),
            segments: s.segments.clone(),
            output_tokens: output,
            session: Some(format!("chat-{}", s.id)),
            tenant: None,
        });
        s.last_output = output;
        s.turn += 1;
        if s.turn >= s.turns {
            open[k] = open_thread(&mut rng);
        }
    }
    Ok(out)
}

/// Retrieval-augmented generation: a shared instruction prompt, then `chunks_per_prompt`
/// distinct chunks drawn from `documents` by Zipf popularity (exponent `zipf_s`, most popular
/// first, as a retriever ranks them), then a unique question.
#[derive(Clone, Debug)]
pub struct RagParams {
    /// Corpus size (one chunk per document). Default 500.
    pub documents: usize,
    /// Zipf exponent of document popularity. Default 1.1.
    pub zipf_s: f64,
    /// Chunks in each prompt (k). Default 4.
    pub chunks_per_prompt: usize,
    /// Chunk length. Default 512 tokens.
    pub chunk_tokens: u32,
    /// Instruction prompt shared by every request. Default 256 tokens.
    pub system_tokens: u32,
    /// Question length range. Default 32..=128 tokens.
    pub question_tokens: (u32, u32),
    /// Output length range. Default 64..=256 tokens.
    pub output_tokens: (u32, u32),
}

impl Default for RagParams {
    fn default() -> Self {
        RagParams {
            documents: 500,
            zipf_s: 1.1,
            chunks_per_prompt: 4,
            chunk_tokens: 512,
            system_tokens: 256,
            question_tokens: (32, 128),
            output_tokens: (64, 256),
        }
    }
}

/// Draws from weights by inverse CDF (binary search over the cumulative sums).
struct Weighted {
    cumulative: Vec<f64>,
}

impl Weighted {
    fn new(weights: impl IntoIterator<Item = f64>) -> Self {
        let mut acc = 0.0;
        let cumulative = weights
            .into_iter()
            .map(|w| {
                acc += w;
                acc
            })
            .collect();
        Weighted { cumulative }
    }

    fn zipf(n: usize, s: f64) -> Self {
        Weighted::new((1..=n).map(|k| (k as f64).powf(-s)))
    }

    fn draw(&self, rng: &mut SmallRng) -> usize {
        let total = self.cumulative.last().copied().unwrap_or(0.0);
        let x = rng.random::<f64>() * total;
        self.cumulative
            .partition_point(|&c| c <= x)
            .min(self.cumulative.len().saturating_sub(1))
    }
}

/// Generates [`RagParams`] requests.
pub fn rag(p: &RagParams, gen: &GenParams) -> Result<Vec<WorkloadRequest>, WorkloadError> {
    gen.validate()?;
    positive("documents", p.documents)?;
    positive("chunks_per_prompt", p.chunks_per_prompt)?;
    if p.chunks_per_prompt > p.documents {
        return Err(WorkloadError::Invalid(
            "chunks_per_prompt must not exceed documents".into(),
        ));
    }
    if !(p.zipf_s.is_finite() && p.zipf_s >= 0.0) {
        return Err(WorkloadError::Invalid("zipf_s must be >= 0".into()));
    }
    check_range("question_tokens", p.question_tokens)?;
    check_range("output_tokens", p.output_tokens)?;
    let popularity = Weighted::zipf(p.documents, p.zipf_s);
    let mut rng = SmallRng::seed_from_u64(gen.seed);
    let mut arrivals = Arrivals {
        t: 0.0,
        rate: gen.rate,
    };
    let mut out = Vec::with_capacity(gen.requests);
    let mut chosen = Vec::with_capacity(p.chunks_per_prompt);
    for i in 0..gen.requests {
        chosen.clear();
        while chosen.len() < p.chunks_per_prompt {
            let d = popularity.draw(&mut rng);
            if !chosen.contains(&d) {
                chosen.push(d);
            }
        }
        chosen.sort_unstable();
        let mut segments = Vec::new();
        push_text(&mut segments, FAMILY_RAG, u64::MAX, 0, p.system_tokens);
        for &d in &chosen {
            push_text(&mut segments, FAMILY_RAG, d as u64, 0, p.chunk_tokens);
        }
        let q = tokens_in(&mut rng, p.question_tokens);
        push_text(&mut segments, FAMILY_RAG, u64::MAX - 1, i as u64, q);
        out.push(WorkloadRequest {
            at_s: arrivals.next(&mut rng),
            segments,
            output_tokens: tokens_in(&mut rng, p.output_tokens),
            session: None,
            tenant: None,
        });
    }
    Ok(out)
}

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

/// Zipf-skewed prefixes: `prefixes` long shared prefixes; prefix 0 is drawn `hot_weight` times
/// as often as the mean of the others, which follow Zipf(`zipf_s`) among themselves. Each
/// request is one prefix + a unique suffix. This is the family that punishes pure cache
/// affinity: following the hot prefix to one replica overloads it.
#[derive(Clone, Debug)]
pub struct ZipfParams {
    /// Distinct prefixes (one hot + the rest). Default 32.
    pub prefixes: usize,
    /// Popularity of the hot prefix over the mean of the others. Default 100.
    pub hot_weight: f64,
    /// Zipf exponent among the other prefixes. Default 0.5.
    pub zipf_s: f64,
    /// Prefix length. Default 2,048 tokens.
    pub prefix_tokens: u32,
    /// Suffix length range. Default 64..=256 tokens.
    pub suffix_tokens: (u32, u32),
    /// Output length range. Default 32..=128 tokens.
    pub output_tokens: (u32, u32),
}

impl Default for ZipfParams {
    fn default() -> Self {
        ZipfParams {
            prefixes: 32,
            hot_weight: 100.0,
            zipf_s: 0.5,
            prefix_tokens: 2048,
            suffix_tokens: (64, 256),
            output_tokens: (32, 128),
        }
    }
}

impl ZipfParams {
    /// Popularity weights of the prefixes: the others normalised to mean 1, the hot one
    /// `hot_weight`.
    pub fn weights(&self) -> Vec<f64> {
        let others = self.prefixes.saturating_sub(1);
        let raw: Vec<f64> = (1..=others)
            .map(|k| (k as f64).powf(-self.zipf_s))
            .collect();
        let mean = raw.iter().sum::<f64>() / others.max(1) as f64;
        std::iter::once(self.hot_weight)
            .chain(raw.into_iter().map(|w| w / mean))
            .collect()
    }
}

/// Generates [`ZipfParams`] requests.
pub fn zipf(p: &ZipfParams, gen: &GenParams) -> Result<Vec<WorkloadRequest>, WorkloadError> {
    gen.validate()?;
    if p.prefixes < 2 {
        return Err(WorkloadError::Invalid("prefixes must be at least 2".into()));
    }
    if !(p.hot_weight.is_finite() && p.hot_weight > 0.0 && p.zipf_s.is_finite()) {
        return Err(WorkloadError::Invalid(
            "hot_weight must be > 0 and zipf_s finite".into(),
        ));
    }
    check_range("suffix_tokens", p.suffix_tokens)?;
    check_range("output_tokens", p.output_tokens)?;
    let popularity = Weighted::new(p.weights());
    let mut rng = SmallRng::seed_from_u64(gen.seed);
    let mut arrivals = Arrivals {
        t: 0.0,
        rate: gen.rate,
    };
    let mut out = Vec::with_capacity(gen.requests);
    for i in 0..gen.requests {
        let prefix = popularity.draw(&mut rng) as u64;
        let mut segments = Vec::new();
        push_text(
            &mut segments,
            FAMILY_ZIPF,
            prefix,
            u64::MAX,
            p.prefix_tokens,
        );
        let suffix = tokens_in(&mut rng, p.suffix_tokens);
        push_text(&mut segments, FAMILY_ZIPF, prefix, i as u64, suffix);
        out.push(WorkloadRequest {
            at_s: arrivals.next(&mut rng),
            segments,
            output_tokens: tokens_in(&mut rng, p.output_tokens),
            session: None,
            tenant: None,
        });
    }
    Ok(out)
}

/// Multi-tenant mix: a fraction `big_share` of requests comes from tenant `big`, whose requests
/// all start with one long fixed system prompt; the rest come from `small_tenants` tenants
/// (`small-<i>`, uniform), each with its own shorter system prompt. Every request ends with a
/// unique user message; the tenant id is sent in `x-tenant-id`.
#[derive(Clone, Debug)]
pub struct TenantsParams {
    /// Share of requests from the big tenant. Default 0.6.
    pub big_share: f64,
    /// The big tenant's system prompt. Default 4,096 tokens.
    pub big_system_tokens: u32,
    /// Number of small tenants. Default 40.
    pub small_tenants: usize,
    /// Each small tenant's system prompt. Default 1,024 tokens.
    pub small_system_tokens: u32,
    /// User message range. Default 64..=512 tokens.
    pub user_tokens: (u32, u32),
    /// Output length range. Default 64..=256 tokens.
    pub output_tokens: (u32, u32),
}

impl Default for TenantsParams {
    fn default() -> Self {
        TenantsParams {
            big_share: 0.6,
            big_system_tokens: 4096,
            small_tenants: 40,
            small_system_tokens: 1024,
            user_tokens: (64, 512),
            output_tokens: (64, 256),
        }
    }
}

/// Generates [`TenantsParams`] requests.
pub fn tenants(p: &TenantsParams, gen: &GenParams) -> Result<Vec<WorkloadRequest>, WorkloadError> {
    gen.validate()?;
    positive("small_tenants", p.small_tenants)?;
    if !(0.0..=1.0).contains(&p.big_share) {
        return Err(WorkloadError::Invalid("big_share must be in [0, 1]".into()));
    }
    check_range("user_tokens", p.user_tokens)?;
    check_range("output_tokens", p.output_tokens)?;
    let mut rng = SmallRng::seed_from_u64(gen.seed);
    let mut arrivals = Arrivals {
        t: 0.0,
        rate: gen.rate,
    };
    let mut out = Vec::with_capacity(gen.requests);
    for i in 0..gen.requests {
        let mut segments = Vec::new();
        let tenant = if rng.random_bool(p.big_share) {
            push_text(
                &mut segments,
                FAMILY_TENANTS,
                u64::MAX,
                0,
                p.big_system_tokens,
            );
            "big".to_owned()
        } else {
            let t = rng.random_range(0..p.small_tenants) as u64;
            push_text(&mut segments, FAMILY_TENANTS, t, 0, p.small_system_tokens);
            format!("small-{t}")
        };
        let user = tokens_in(&mut rng, p.user_tokens);
        push_text(&mut segments, FAMILY_TENANTS, u64::MAX - 1, i as u64, user);
        out.push(WorkloadRequest {
            at_s: arrivals.next(&mut rng),
            segments,
            output_tokens: tokens_in(&mut rng, p.output_tokens),
            session: None,
            tenant: Some(tenant),
        });
    }
    Ok(out)
}

/// The workload flags shared by `kvmesh sim` and `kvmesh bench`.
#[derive(Clone, Debug, clap::Args)]
pub struct WorkloadArgs {
    /// Workload: `trace[:path]` (Mooncake JSONL; default the shipped conversation trace),
    /// `system-prompt`, `chat`, `rag`, `agent`, `zipf` or `tenants`.
    #[arg(long, default_value = "trace")]
    pub workload: WorkloadKind,
    /// Mean arrival rate in requests/s. Synthetic families: the Poisson rate they are generated
    /// at (default 20). Trace: its arrival times are rescaled to this mean rate (default: as
    /// recorded, 3.4 req/s for the conversation trace).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Requests: the number to generate (synthetic, default 2,000) or to replay from the start
    /// of the trace (default all).
    #[arg(long)]
    pub requests: Option<usize>,
    /// Seed of the generators (and of every other random choice of the command).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Trace only: spread requests sharing a quantised timestamp over the ~3 s step (false:
    /// replay the recorded bursts).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub dequantize: bool,
    /// Synthetic families: set one parameter of the family, `KEY=VALUE` (repeatable). Ranges are
    /// `LO..=HI`, `LO-HI` or one number. Keys — system-prompt: groups, prompts_per_group,
    /// system_tokens, question_tokens, output_tokens; chat: concurrent_sessions, turns,
    /// system_tokens, user_tokens, answer_tokens; rag: documents, zipf_s, chunks_per_prompt,
    /// chunk_tokens, system_tokens, question_tokens, output_tokens; agent: concurrent_runs, steps,
    /// system_tokens, task_tokens, observation_tokens, action_tokens; zipf: prefixes, hot_weight,
    /// zipf_s, prefix_tokens, suffix_tokens, output_tokens; tenants: big_share,
    /// big_system_tokens, small_tenants, small_system_tokens, user_tokens, output_tokens.
    /// Defaults and meanings: docs/benchmarks.md and `src/bench/workload.rs`.
    #[arg(long = "family-param", value_name = "KEY=VALUE")]
    pub family_params: Vec<String>,
}

/// Parameters of a synthetic family settable by name (`--family-param KEY=VALUE`).
pub trait FamilyParams: Default {
    /// The family's settable keys, in documentation order.
    const KEYS: &'static [&'static str];
    /// Sets `key` from its text `value`; an unknown key or a bad value is an error naming it.
    fn set(&mut self, key: &str, value: &str) -> Result<(), WorkloadError>;

    /// Defaults overridden by `KEY=VALUE` items, applied in order (a later one wins).
    fn from_pairs(family: &str, pairs: &[String]) -> Result<Self, WorkloadError> {
        let mut p = Self::default();
        for pair in pairs {
            let Some((key, value)) = pair.split_once('=') else {
                return Err(WorkloadError::Invalid(format!(
                    "--family-param '{pair}' is not KEY=VALUE (keys for {family}: {})",
                    Self::KEYS.join(", ")
                )));
            };
            let key = key.trim();
            if !Self::KEYS.contains(&key) {
                return Err(WorkloadError::Invalid(format!(
                    "unknown parameter '{key}' for the {family} family (valid: {})",
                    Self::KEYS.join(", ")
                )));
            }
            p.set(key, value.trim())?;
        }
        Ok(p)
    }
}

fn parse_num<T: FromStr>(key: &str, value: &str) -> Result<T, WorkloadError> {
    value
        .parse()
        .map_err(|_| WorkloadError::Invalid(format!("{key}: '{value}' is not a valid number")))
}

/// `LO..=HI`, `LO-HI` or `N` (= `N..=N`); the generators check the bounds.
fn parse_range(key: &str, value: &str) -> Result<(u32, u32), WorkloadError> {
    let (lo, hi) = value
        .split_once("..=")
        .or_else(|| value.split_once('-'))
        .unwrap_or((value, value));
    let bad = || {
        WorkloadError::Invalid(format!(
            "{key}: '{value}' is not a range (LO..=HI, LO-HI or N)"
        ))
    };
    let lo = lo.trim().parse().map_err(|_| bad())?;
    let hi = hi.trim().parse().map_err(|_| bad())?;
    Ok((lo, hi))
}

/// Implements [`FamilyParams`] for a struct: `num` fields parse as numbers, `range` fields as
/// ranges; the key is the field's name.
macro_rules! family_params {
    ($ty:ty { $($kind:ident $field:ident),* $(,)? }) => {
        impl FamilyParams for $ty {
            const KEYS: &'static [&'static str] = &[$(stringify!($field)),*];
            fn set(&mut self, key: &str, value: &str) -> Result<(), WorkloadError> {
                match key {
                    $(stringify!($field) => {
                        self.$field = family_params!(@parse $kind key value);
                    })*
                    other => {
                        return Err(WorkloadError::Invalid(format!(
                            "unknown parameter '{other}' (valid: {})",
                            Self::KEYS.join(", ")
                        )))
                    }
                }
                Ok(())
            }
        }
    };
    (@parse num $key:ident $value:ident) => { parse_num($key, $value)? };
    (@parse range $key:ident $value:ident) => { parse_range($key, $value)? };
}

family_params!(SystemPromptParams {
    num groups,
    num prompts_per_group,
    num system_tokens,
    range question_tokens,
    range output_tokens,
});
family_params!(ChatParams {
    num concurrent_sessions,
    range turns,
    num system_tokens,
    range user_tokens,
    range answer_tokens,
});
family_params!(RagParams {
    num documents,
    num zipf_s,
    num chunks_per_prompt,
    num chunk_tokens,
    num system_tokens,
    range question_tokens,
    range output_tokens,
});
family_params!(AgentParams {
    num concurrent_runs,
    range steps,
    num system_tokens,
    range task_tokens,
    range observation_tokens,
    range action_tokens,
});
family_params!(ZipfParams {
    num prefixes,
    num hot_weight,
    num zipf_s,
    num prefix_tokens,
    range suffix_tokens,
    range output_tokens,
});
family_params!(TenantsParams {
    num big_share,
    num big_system_tokens,
    num small_tenants,
    num small_system_tokens,
    range user_tokens,
    range output_tokens,
});

/// Builds a synthetic family with its defaults overridden by `pairs` (`KEY=VALUE`).
pub fn build_with(
    kind: &WorkloadKind,
    gen: &GenParams,
    pairs: &[String],
) -> Result<Workload, WorkloadError> {
    let f = kind.name();
    let requests = match kind {
        WorkloadKind::Trace(_) => {
            if !pairs.is_empty() {
                return Err(WorkloadError::Invalid(
                    "--family-param applies to the synthetic families, not the trace".into(),
                ));
            }
            return build(kind, gen);
        }
        WorkloadKind::SystemPrompt => system_prompt(&FamilyParams::from_pairs(f, pairs)?, gen)?,
        WorkloadKind::Chat => chat(&FamilyParams::from_pairs(f, pairs)?, gen)?,
        WorkloadKind::Rag => rag(&FamilyParams::from_pairs(f, pairs)?, gen)?,
        WorkloadKind::Agent => agent(&FamilyParams::from_pairs(f, pairs)?, gen)?,
        WorkloadKind::Zipf => zipf(&FamilyParams::from_pairs(f, pairs)?, gen)?,
        WorkloadKind::Tenants => tenants(&FamilyParams::from_pairs(f, pairs)?, gen)?,
    };
    Ok(Workload {
        name: f.to_owned(),
        requests,
    })
}

impl WorkloadArgs {
    /// Builds the workload these flags describe.
    pub fn load(&self) -> Result<Workload, WorkloadError> {
        let defaults = GenParams::default();
        let gen = GenParams {
            rate: self.rate.unwrap_or(defaults.rate),
            requests: self.requests.unwrap_or(defaults.requests),
            seed: self.seed,
        };
        match &self.workload {
            WorkloadKind::Trace(_) if !self.family_params.is_empty() => {
                Err(WorkloadError::Invalid(
                    "--family-param applies to the synthetic families, not the trace".into(),
                ))
            }
            WorkloadKind::Trace(path) => {
                let path = path.clone().unwrap_or_else(super::sim_cli::default_trace);
                let mut requests = from_trace(&trace::load(&path)?, self.dequantize);
                if let Some(n) = self.requests {
                    requests.truncate(n);
                }
                if let Some(rate) = self.rate {
                    gen.validate()?;
                    retime(&mut requests, rate);
                }
                Ok(Workload {
                    name: "trace".into(),
                    requests,
                })
            }
            kind => build_with(kind, &gen, &self.family_params),
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn gen(n: usize) -> GenParams {
        GenParams {
            rate: 10.0,
            requests: n,
            seed: 7,
        }
    }

    fn all(g: &GenParams) -> Vec<(WorkloadKind, Vec<WorkloadRequest>)> {
        WorkloadKind::SYNTHETIC
            .iter()
            .map(|k| (k.clone(), build(k, g).unwrap().requests))
            .collect()
    }

    fn leading_common(a: &WorkloadRequest, b: &WorkloadRequest) -> usize {
        a.segments
            .iter()
            .zip(&b.segments)
            .take_while(|(x, y)| x == y)
            .count()
    }

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

    #[test]
    fn chat_turns_extend_the_previous_turn_of_their_session() {
        let reqs = chat(&ChatParams::default(), &gen(600)).unwrap();
        let mut last: HashMap<&str, &WorkloadRequest> = HashMap::new();
        let mut extended = 0;
        for r in &reqs {
            let s = r.session.as_deref().unwrap();
            if let Some(prev) = last.get(s) {
                assert!(r.segments.len() > prev.segments.len() + 1);
                assert_eq!(&r.segments[..prev.segments.len()], &prev.segments[..]);
                // The answer of the previous turn has its output length.
                assert_eq!(
                    r.segments[prev.segments.len()].1,
                    prev.output_tokens.min(512)
                );
                extended += 1;
            }
            last.insert(s, r);
        }
        assert!(extended > 400, "{extended}");
        // All sessions share the system prompt, and nothing more across sessions.
        let a = reqs
            .iter()
            .find(|r| r.session.as_deref() == Some("chat-0"))
            .unwrap();
        let b = reqs
            .iter()
            .find(|r| r.session.as_deref() == Some("chat-1"))
            .unwrap();
        assert_eq!(leading_common(a, b), 1);
    }

    #[test]
    fn rag_documents_follow_zipf_popularity() {
        let p = RagParams::default();
        let reqs = rag(&p, &gen(2000)).unwrap();
        let mut counts: HashMap<u64, usize> = HashMap::new();
        for r in &reqs {
            assert_eq!(r.segments.len(), 1 + p.chunks_per_prompt + 1);
            let chunks: HashSet<_> = r.segments[1..=p.chunks_per_prompt].iter().collect();
            assert_eq!(chunks.len(), p.chunks_per_prompt, "chunks are distinct");
            for &(id, _) in &r.segments[1..=p.chunks_per_prompt] {
                *counts.entry(id).or_default() += 1;
            }
        }
        let mut by_pop: Vec<usize> = counts.values().copied().collect();
        by_pop.sort_unstable_by(|a, b| b.cmp(a));
        // The most popular document is in nearly every prompt; the tail is long.
        assert!(by_pop[0] > 900, "{by_pop:?}");
        assert!(by_pop[0] > 10 * by_pop[by_pop.len() / 2]);
        assert!(counts.len() > 100);
    }

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

    #[test]
    fn zipf_hot_prefix_is_a_hundred_times_each_other_on_average() {
        let p = ZipfParams::default();
        let reqs = zipf(&p, &gen(20_000)).unwrap();
        let prefix_segments = (p.prefix_tokens / MAX_SEGMENT_TOKENS) as usize;
        let mut counts: HashMap<Vec<(u64, u32)>, usize> = HashMap::new();
        for r in &reqs {
            *counts
                .entry(r.segments[..prefix_segments].to_vec())
                .or_default() += 1;
        }
        assert_eq!(counts.len(), p.prefixes);
        let mut c: Vec<usize> = counts.into_values().collect();
        c.sort_unstable_by(|a, b| b.cmp(a));
        let others = c[1..].iter().sum::<usize>() as f64 / (c.len() - 1) as f64;
        let ratio = c[0] as f64 / others;
        assert!((80.0..125.0).contains(&ratio), "hot/other mean {ratio}");
    }

    #[test]
    fn tenants_big_one_shares_one_prompt_small_ones_their_own() {
        let p = TenantsParams::default();
        let reqs = tenants(&p, &gen(3000)).unwrap();
        let big: Vec<_> = reqs
            .iter()
            .filter(|r| r.tenant.as_deref() == Some("big"))
            .collect();
        let share = big.len() as f64 / reqs.len() as f64;
        assert!((share - p.big_share).abs() < 0.04, "{share}");
        let big_segments = (p.big_system_tokens / MAX_SEGMENT_TOKENS) as usize;
        assert!(big
            .iter()
            .all(|r| r.segments[..big_segments] == big[0].segments[..big_segments]));
        let mut small: HashMap<&str, HashSet<(u64, u32)>> = HashMap::new();
        for r in reqs.iter().filter(|r| r.tenant.as_deref() != Some("big")) {
            small
                .entry(r.tenant.as_deref().unwrap())
                .or_default()
                .insert(r.segments[0]);
        }
        assert_eq!(small.len(), p.small_tenants);
        assert!(small.values().all(|firsts| firsts.len() == 1));
        let distinct: HashSet<_> = small.values().flatten().collect();
        assert_eq!(distinct.len(), p.small_tenants);
    }

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

    #[test]
    fn trace_args_cut_and_retime_the_trace() {
        let args = WorkloadArgs {
            workload: WorkloadKind::Trace(None),
            rate: Some(10.0),
            requests: Some(500),
            seed: 1,
            dequantize: true,
            family_params: vec![],
        };
        let w = args.load().unwrap();
        assert_eq!(w.requests.len(), 500);
        let span = w.requests[499].at_s - w.requests[0].at_s;
        assert!((499.0 / span - 10.0).abs() < 1e-6, "rate {}", 499.0 / span);
        assert_eq!(w.requests[0].at_s, 0.0);
        let synthetic = WorkloadArgs {
            workload: WorkloadKind::Zipf,
            rate: None,
            requests: Some(50),
            ..args
        };
        assert_eq!(synthetic.load().unwrap().requests.len(), 50);
    }

    #[test]
    fn family_params_override_defaults() {
        let pairs = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let p = AgentParams::from_pairs(
            "agent",
            &pairs(&[
                "concurrent_runs=3",
                "steps=5..=7",
                "action_tokens = 16-32",
                "system_tokens=100",
            ]),
        )
        .unwrap();
        assert_eq!(p.concurrent_runs, 3);
        assert_eq!(p.steps, (5, 7));
        assert_eq!(p.action_tokens, (16, 32));
        assert_eq!(p.system_tokens, 100);
        assert_eq!(p.task_tokens, AgentParams::default().task_tokens);
        let r =
            RagParams::from_pairs("rag", &pairs(&["zipf_s=0.8", "question_tokens=64"])).unwrap();
        assert_eq!((r.zipf_s, r.question_tokens), (0.8, (64, 64)));
        let z =
            ZipfParams::from_pairs("zipf", &pairs(&["hot_weight=10", "hot_weight=20"])).unwrap();
        assert_eq!(z.hot_weight, 20.0, "a later pair wins");
        // Through the CLI flags: the generated workload follows the parameters.
        let args = WorkloadArgs {
            workload: WorkloadKind::SystemPrompt,
            rate: Some(10.0),
            requests: Some(40),
            seed: 1,
            dequantize: true,
            family_params: pairs(&["groups=2", "system_tokens=512"]),
        };
        let w = args.load().unwrap();
        let firsts: HashSet<_> = w.requests.iter().map(|r| r.segments[0]).collect();
        assert_eq!(firsts.len(), 2);
        assert!(w.requests.iter().all(|r| r.segments[0].1 == 512));
        // Every family takes its documented keys.
        for k in WorkloadKind::SYNTHETIC {
            let a = WorkloadArgs {
                workload: k.clone(),
                family_params: vec![],
                ..args.clone()
            };
            assert!(a.load().is_ok(), "{k}");
        }
    }

    #[test]
    fn family_params_reject_bad_input_naming_the_valid_keys() {
        let one = |k: WorkloadKind, p: &str| {
            WorkloadArgs {
                workload: k,
                rate: None,
                requests: Some(10),
                seed: 1,
                dequantize: true,
                family_params: vec![p.to_owned()],
            }
            .load()
            .unwrap_err()
            .to_string()
        };
        let e = one(WorkloadKind::Agent, "runs=3");
        assert!(
            e.contains("'runs'") && e.contains("agent") && e.contains("concurrent_runs, steps"),
            "{e}"
        );
        let e = one(WorkloadKind::Chat, "turns");
        assert!(
            e.contains("KEY=VALUE") && e.contains("concurrent_sessions"),
            "{e}"
        );
        let e = one(WorkloadKind::Rag, "documents=many");
        assert!(e.contains("documents") && e.contains("'many'"), "{e}");
        let e = one(WorkloadKind::Zipf, "suffix_tokens=9..=x");
        assert!(e.contains("suffix_tokens") && e.contains("range"), "{e}");
        // Values parse but the generator's own checks still apply.
        let e = one(WorkloadKind::Agent, "steps=5-2");
        assert!(e.contains("steps"), "{e}");
        let e = one(WorkloadKind::Tenants, "big_share=1.5");
        assert!(e.contains("big_share"), "{e}");
        let e = one(WorkloadKind::Trace(None), "groups=2");
        assert!(e.contains("not the trace"), "{e}");
    }

    #[test]
    fn kinds_parse_and_print() {
        for k in WorkloadKind::SYNTHETIC {
            assert_eq!(k.to_string().parse::<WorkloadKind>().unwrap(), k);
        }
        assert_eq!(
            "trace:/x/y.jsonl".parse::<WorkloadKind>().unwrap(),
            WorkloadKind::Trace(Some("/x/y.jsonl".into()))
        );
        assert_eq!(
            "trace".parse::<WorkloadKind>().unwrap(),
            WorkloadKind::Trace(None)
        );
        assert!("nope".parse::<WorkloadKind>().is_err());
        assert!(chat(
            &ChatParams::default(),
            &GenParams {
                rate: 0.0,
                ..gen(1)
            }
        )
        .is_err());
    }
}
