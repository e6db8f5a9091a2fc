//! Continuous batching in the style of vLLM V1, as a sans-IO state machine.
//!
//! Each step runs every admitted sequence that is decoding (one token each) and fills the rest of
//! the token budget with prefill chunks, first come first served. Its duration is
//! `a + b·P + e·Σ C·(p + C/2) + c·D + d·K` ms (engine-timing.md §1), divided by `time_scale`.
//! Outputs appear at the end of the step that produced them: the first token at the end of the last
//! prefill chunk. Requests queue when `max_num_seqs` is reached or their KV blocks do not fit.
//! KV for a request (prompt + `max_tokens`) is reserved at admission, which replaces vLLM's
//! preemption: a request that is running never runs out of blocks.
//!
//! A prompt's blocks enter the prefix cache chunk by chunk, as in vLLM v1: when a step schedules
//! a prefill chunk, the full blocks within the tokens computed up to the end of that chunk are
//! cached and pinned for the request (`vllm/v1/core/kv_cache_manager.py`, `allocate_slots` →
//! `coordinator.cache_blocks(request, min(total_computed + num_new_tokens, num_tokens))`; the
//! block pool's `cache_full_blocks` emits one `BlockStored` per call, so each chunk's blocks go out
//! as one chained store event with that step's batch). vLLM's scheduler runs the running requests
//! before the waiting ones, so a request admitted in the same step already matches the chunk
//! scheduled there (their KV is written layer by layer before attention reads it); here likewise
//! the running requests' chunks are scheduled before admission. A copy arriving while the first
//! is mid-prefill therefore hits every block scheduled so far, shares them (a block cached by
//! both is one block, pinned twice) and computes only the rest. SGLang is one chunk later: its
//! scheduler inserts the chunked request into the radix tree (`cache_unfinished_req(chunked_req)`
//! in `get_next_batch_to_run` / `get_new_batch_prefill`, `python/sglang/srt/managers/scheduler.py`)
//! after the chunk ran, before the next batch is formed. A cancelled request's blocks are freed as
//! vLLM's `free` does: the ones cached so far stay cached, unpinned and evictable (tails first);
//! the rest of its reservation is released. The model never preempts, so vLLM's preemption
//! (which also frees and keeps the cached blocks) has no counterpart.
//!
//! With a CPU tier (`cpu_capacity_tokens`, `cpu_tier.rs`) a request whose prefix continues in
//! host memory past its GPU hit has those blocks loaded instead of recomputed: it is admitted
//! with them counted as in KV, but takes no step until the load over the link completes
//! (`kv_bytes_per_token × tokens / cpu_gb_per_s`, queued behind earlier loads); the loaded
//! blocks are cached on GPU with its first chunk, once the load is done (vLLM delays caching
//! blocks still in flight: `delay_cache_blocks`). Every computed block is written through to the
//! CPU tier at the end of the chunk that computed it, as vLLM's offloading connector does.
//!
//! The caller owns time. A real-time driver calls [`Engine::advance`] when the wall clock reaches
//! [`Engine::next_event_time`] or after [`Engine::submit`]; a discrete-event simulator does the same
//! with virtual time. Both see identical, deterministic behaviour.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use super::config::EngineConfig;
use super::cpu_tier::CpuTier;
use super::prefix_cache::{salted_block_hashes, BlockHash, CacheEvent, PrefixCache};
use super::tokens::TokenId;

/// A generation request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Caller-chosen id, unique among live requests.
    pub id: u64,
    /// Prompt token ids (see [`crate::engine_sim::tokens::tokenize`] for text).
    pub prompt: Vec<TokenId>,
    /// Tokens to generate, at least 1.
    pub max_tokens: u32,
    /// vLLM's `cache_salt`: salts the chain root, so only requests with the same salt share
    /// cached blocks (`prefix_cache::chain_root`).
    pub cache_salt: Option<String>,
}

/// Something a step produced for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// Prefill finished and the first token was sampled.
    FirstToken {
        /// Request id.
        id: u64,
        /// Prompt tokens served from the prefix cache (including those fetched).
        cached_tokens: usize,
        /// Prompt length in tokens.
        prompt_tokens: usize,
        /// Of `cached_tokens`, those pulled from another replica ([`Engine::submit_fetched`]).
        fetched_tokens: usize,
    },
    /// One more token was decoded.
    Token {
        /// Request id.
        id: u64,
    },
    /// The request generated `max_tokens` tokens and left the engine.
    Finished {
        /// Request id.
        id: u64,
    },
}

/// Why a request was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SubmitError {
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// `max_tokens` was 0.
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    /// prompt + max_tokens exceeds the model length or the whole KV cache.
    #[error(
        "prompt ({prompt} tokens) + max_tokens ({max_tokens}) exceeds the limit of {limit} tokens"
    )]
    TooLong {
        /// Prompt tokens.
        prompt: usize,
        /// Requested output tokens.
        max_tokens: u32,
        /// The binding limit.
        limit: usize,
    },
    /// A live request already has this id.
    #[error("request id {0} is already in use")]
    DuplicateId(u64),
}

/// A snapshot of the engine's gauges and counters.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineStats {
    /// Admitted sequences (vLLM `num_requests_running`).
    pub running: usize,
    /// Queued sequences (vLLM `num_requests_waiting`).
    pub waiting: usize,
    /// Share of KV blocks held by running requests, 0..1 (vLLM `kv_cache_usage_perc`).
    pub kv_usage: f64,
    /// Prompt tokens looked up in the prefix cache so far.
    pub prefix_query_tokens: u64,
    /// Prompt tokens found in the prefix cache so far.
    pub prefix_hit_tokens: u64,
    /// Total KV blocks.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_tokens: usize,
    /// Blocks currently cached (pinned or evictable).
    pub cached_blocks: usize,
    /// Steps run so far.
    pub steps: u64,
    /// Blocks held in the CPU tier (0 without one).
    pub cpu_blocks: usize,
    /// Prompt tokens loaded from the CPU tier so far (part of `prefix_hit_tokens`).
    pub cpu_hit_tokens: u64,
    /// Prompt tokens pulled from other replicas so far ([`Engine::submit_fetched`]).
    pub fetched_tokens: u64,
}

/// The KV events of one engine step, to publish as one vLLM `EventBatch`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvBatch {
    /// When the step ended (engine time).
    pub at: Duration,
    /// Events in order.
    pub events: Vec<CacheEvent>,
}

#[derive(Debug)]
struct Seq {
    prompt: Vec<TokenId>,
    /// The request's `cache_salt`, reported with the chain root it stores.
    cache_salt: Option<String>,
    hashes: Vec<BlockHash>,
    max_tokens: u32,
    hit_blocks: usize,
    /// Leading prompt blocks in the prefix cache, pinned for it: its hits, then every full block
    /// of each chunk once the chunk is scheduled (vLLM's `num_cached_block`).
    committed_blocks: usize,
    /// Prompt tokens in KV (cached prefix + computed chunks).
    prefilled: usize,
    generated: u32,
    private_blocks: usize,
    /// Its prompt's KV came from a prefill replica (disaggregation): only the last prompt
    /// token is computed here, and the handed-over blocks enter the prefix cache.
    transferred: bool,
    /// With blocks to load from the CPU tier: when the load completes; no step before.
    ready_at: Duration,
    /// Prompt tokens in KV at admission: GPU hit plus loaded.
    cached_tokens: usize,
    /// Blocks another replica sent for it ([`Engine::submit_fetched`]).
    fetch: Option<Fetched>,
    /// Of `cached_tokens`, those fetched.
    fetched_tokens: usize,
}

/// Prompt blocks `from_block..to_block` pulled from another replica's cache (a KV-fetch hint,
/// `core::kv_fetch`): usable where they continue this engine's own cached run, arriving
/// `transfer` after admission (0 when the caller already spent the transfer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fetched {
    /// First block sent.
    pub from_block: usize,
    /// One past the last block sent.
    pub to_block: usize,
    /// Time the blocks take to arrive, counted from admission (engine time, before scaling).
    pub transfer: Duration,
}

impl Seq {
    fn decoding(&self) -> bool {
        self.prefilled == self.prompt.len()
    }
}

#[derive(Debug, Clone, Copy)]
enum Work {
    Prefill(usize),
    Decode,
}

#[derive(Debug)]
struct Step {
    end: Duration,
    work: Vec<(u64, Work)>,
}

/// The engine model (see the module docs).
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    cache: PrefixCache,
    waiting: VecDeque<(u64, Seq)>,
    running: HashMap<u64, Seq>,
    /// Admission order of `running`, which is the order prefill chunks are granted in.
    order: Vec<u64>,
    live: HashSet<u64>,
    step: Option<Step>,
    /// Idle engine: when the next step should start because work arrived.
    wake: Option<Duration>,
    batches: Vec<KvBatch>,
    query_tokens: u64,
    hit_tokens: u64,
    steps: u64,
    /// The offload tier, with `cpu_capacity_tokens > 0`.
    cpu: Option<CpuTier>,
    cpu_hit_tokens: u64,
    fetched_tokens: u64,
}

impl Engine {
    /// An idle engine with an empty cache. Call [`EngineConfig::validate`] first on untrusted
    /// configs; out-of-range values are clamped here rather than trusted.
    pub fn new(cfg: EngineConfig) -> Self {
        let cache = PrefixCache::new(cfg.kv_capacity_tokens, cfg.block_tokens);
        let bs = cfg.block_tokens.max(1);
        let cpu = (cfg.cpu_capacity_tokens >= bs).then(|| {
            let block_bytes = f64::from(cfg.kv_bytes_per_token) * bs as f64;
            CpuTier::new(
                cfg.cpu_capacity_tokens / bs,
                block_bytes / (cfg.cpu_gb_per_s.max(1e-3) * 1e9),
            )
        });
        Self {
            cfg,
            cache,
            waiting: VecDeque::new(),
            running: HashMap::new(),
            order: Vec::new(),
            live: HashSet::new(),
            step: None,
            wake: None,
            batches: Vec::new(),
            query_tokens: 0,
            hit_tokens: 0,
            steps: 0,
            cpu,
            cpu_hit_tokens: 0,
            fetched_tokens: 0,
        }
    }

    /// The configuration in use.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Queues a request that arrived at `now`.
    pub fn submit(&mut self, req: Request, now: Duration) -> Result<(), SubmitError> {
        self.enqueue(req, now, false, None)
    }

    /// Queues a request with part of its prompt's KV pulled from another replica (`fetch`):
    /// the blocks that continue this engine's cached run count as cached, enter the prefix
    /// cache with their store events with its first chunk, and are ready `fetch.transfer`
    /// after admission; the rest is computed as usual.
    pub fn submit_fetched(
        &mut self,
        req: Request,
        now: Duration,
        fetch: Fetched,
    ) -> Result<(), SubmitError> {
        self.enqueue(req, now, false, Some(fetch))
    }

    /// Queues a request whose prompt's KV cache a prefill replica computed and handed over (a
    /// decode replica's side of disaggregation): it still needs its blocks (taken at admission,
    /// like any request's), but computes only the last prompt token, as vLLM's decode does, and
    /// the handed-over blocks enter the prefix cache (with their store events).
    pub fn submit_with_kv(&mut self, req: Request, now: Duration) -> Result<(), SubmitError> {
        self.enqueue(req, now, true, None)
    }

    fn enqueue(
        &mut self,
        req: Request,
        now: Duration,
        transferred: bool,
        fetch: Option<Fetched>,
    ) -> Result<(), SubmitError> {
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if req.max_tokens == 0 {
            return Err(SubmitError::ZeroMaxTokens);
        }
        let limit = self
            .cfg
            .max_model_len
            .min(self.cache.capacity_blocks() * self.cache.block_tokens());
        if req.prompt.len() + req.max_tokens as usize > limit {
            return Err(SubmitError::TooLong {
                prompt: req.prompt.len(),
                max_tokens: req.max_tokens,
                limit,
            });
        }
        if !self.live.insert(req.id) {
            return Err(SubmitError::DuplicateId(req.id));
        }
        let hashes = salted_block_hashes(
            &req.prompt,
            self.cache.block_tokens(),
            req.cache_salt.as_deref(),
        );
        self.waiting.push_back((
            req.id,
            Seq {
                prompt: req.prompt,
                cache_salt: req.cache_salt,
                hashes,
                max_tokens: req.max_tokens,
                hit_blocks: 0,
                committed_blocks: 0,
                prefilled: 0,
                generated: 0,
                private_blocks: 0,
                transferred,
                ready_at: Duration::ZERO,
                cached_tokens: 0,
                fetch,
                fetched_tokens: 0,
            },
        ));
        if self.step.is_none() {
            self.wake = Some(self.wake.map_or(now, |w| w.min(now)));
        }
        Ok(())
    }

    /// Drops a request (e.g. its client went away), freeing its blocks. Unknown ids are ignored.
    pub fn cancel(&mut self, id: u64) {
        if !self.live.remove(&id) {
            return;
        }
        if let Some(seq) = self.running.remove(&id) {
            self.order.retain(|o| *o != id);
            self.release(&seq);
        } else {
            self.waiting.retain(|(w, _)| *w != id);
        }
    }

    /// Drops every unpinned cached block (vLLM's `/reset_prefix_cache`); false, changing nothing,
    /// while requests are running. The `AllBlocksCleared` event goes out with the next KV batch.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if !self.running.is_empty() || !self.cache.reset() {
            return false;
        }
        if let Some(cpu) = &mut self.cpu {
            cpu.clear();
        }
        if self.cfg.record_kv_events {
            let at = self.step.as_ref().map_or(Duration::ZERO, |s| s.end);
            self.batches.push(KvBatch {
                at,
                events: self.cache.take_events(),
            });
        } else {
            self.cache.take_events();
        }
        true
    }

    /// When [`Engine::advance`] next has something to do: the end of the current step, or the start
    /// of the next one. `None` when idle with nothing queued.
    pub fn next_event_time(&self) -> Option<Duration> {
        match &self.step {
            Some(step) => Some(step.end),
            None => self.wake,
        }
    }

    /// Runs every step that ends at or before `now` and returns what they produced, in order.
    pub fn advance(&mut self, now: Duration) -> Vec<Output> {
        let mut outputs = Vec::new();
        loop {
            if let Some(step) = &self.step {
                if step.end > now {
                    break;
                }
                let end = step.end;
                self.complete_step(&mut outputs);
                self.start_step(end);
            } else if let Some(wake) = self.wake.filter(|w| *w <= now) {
                self.wake = None;
                self.start_step(wake);
            } else {
                break;
            }
        }
        outputs
    }

    /// KV event batches of the steps completed so far (only with `record_kv_events`).
    pub fn take_kv_batches(&mut self) -> Vec<KvBatch> {
        std::mem::take(&mut self.batches)
    }

    /// Prompt tokens the prefix cache holds right now for a prompt with these block hashes
    /// (see [`salted_block_hashes`]): what an oracle with exact knowledge would credit.
    pub fn cached_prefix_tokens(&self, hashes: &[BlockHash]) -> usize {
        self.cache.match_prefix(hashes) * self.cache.block_tokens()
    }

    /// Prompt tokens still to prefill before a new request's own prefill could start: the rest of
    /// every admitted prompt plus the uncached part of every queued one.
    pub fn pending_prefill_tokens(&self) -> usize {
        let bs = self.cache.block_tokens();
        let running: usize = self
            .running
            .values()
            .map(|s| s.prompt.len() - s.prefilled)
            .sum();
        let waiting: usize = self
            .waiting
            .iter()
            .map(|(_, s)| {
                s.prompt
                    .len()
                    .saturating_sub(self.cache.match_prefix(&s.hashes) * bs)
            })
            .sum();
        running + waiting
    }

    /// Current gauges and counters.
    pub fn stats(&self) -> EngineStats {
        let blocks = self.cache.capacity_blocks();
        EngineStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_usage: if blocks == 0 {
                0.0
            } else {
                self.cache.active_blocks() as f64 / blocks as f64
            },
            prefix_query_tokens: self.query_tokens,
            prefix_hit_tokens: self.hit_tokens,
            num_blocks: blocks,
            block_tokens: self.cache.block_tokens(),
            cached_blocks: self.cache.cached_blocks(),
            steps: self.steps,
            cpu_blocks: self.cpu.as_ref().map_or(0, CpuTier::len),
            cpu_hit_tokens: self.cpu_hit_tokens,
            fetched_tokens: self.fetched_tokens,
        }
    }

    /// The step duration the model assigns to a batch, in ms before time scaling. `chunks` are
    /// (chunk tokens, tokens already in KV) pairs; `decode_context` is Σ context of the decodes.
    pub fn step_ms(&self, chunks: &[(usize, usize)], decodes: usize, decode_context: usize) -> f64 {
        let c = &self.cfg;
        let prefill: usize = chunks.iter().map(|(n, _)| n).sum();
        let attention: f64 = chunks
            .iter()
            .map(|&(n, p)| n as f64 * (p as f64 + n as f64 / 2.0))
            .sum();
        c.step_overhead_ms
            + c.prefill_ms_per_token * prefill as f64
            + c.prefill_attention_ms_per_pair * attention
            + c.decode_ms_per_seq * decodes as f64
            + c.decode_ms_per_context_token * decode_context as f64
    }

    fn admit(&mut self, at: Duration) {
        let bs = self.cache.block_tokens();
        while self.running.len() < self.cfg.max_num_seqs {
            let Some((_, seq)) = self.waiting.front() else {
                break;
            };
            // vLLM always recomputes at least the last prompt token, so a fully cached prompt
            // still prefills its last block.
            let max_hit = (seq.prompt.len() - 1) / bs;
            let hits = self.cache.match_prefix(&seq.hashes).min(max_hit);
            // Past the GPU hit, what the CPU tier holds is loaded (into private blocks).
            let from_cpu = self
                .cpu
                .as_ref()
                .map_or(0, |c| c.run_from(&seq.hashes, hits).min(max_hit - hits));
            // Fetched blocks count where they continue the GPU hit (a gap makes them useless).
            let fetched = seq.fetch.map_or(0, |f| {
                if f.from_block <= hits {
                    f.to_block.min(max_hit).saturating_sub(hits)
                } else {
                    0
                }
            });
            let loaded = from_cpu.max(fetched);
            let total = (seq.prompt.len() + seq.max_tokens as usize).div_ceil(bs);
            let private = total - hits;
            if !self.cache.allocate(&seq.hashes[..hits], private) {
                break;
            }
            let Some((id, mut seq)) = self.waiting.pop_front() else {
                break;
            };
            seq.hit_blocks = hits;
            seq.committed_blocks = hits;
            // A handed-over prompt computes only its last token, but reports only what this
            // engine's own cache held as cached.
            seq.cached_tokens = (hits + loaded) * bs;
            seq.prefilled = if seq.transferred {
                seq.prompt.len() - 1
            } else {
                seq.cached_tokens
            };
            seq.private_blocks = private;
            let from_cpu = if fetched >= from_cpu { 0 } else { from_cpu };
            if let Some(cpu) = &mut self.cpu {
                cpu.touch(&seq.hashes[..hits + from_cpu]);
                seq.ready_at = cpu.load(from_cpu, at, self.cfg.time_scale);
            }
            if fetched > 0 && from_cpu == 0 {
                seq.fetched_tokens = fetched * bs;
                let transfer = seq.fetch.map_or(Duration::ZERO, |f| f.transfer);
                let scale = self.cfg.time_scale.max(1e-3);
                seq.ready_at = seq.ready_at.max(at + transfer.div_f64(scale));
                self.fetched_tokens += seq.fetched_tokens as u64;
            }
            self.cpu_hit_tokens += (from_cpu * bs) as u64;
            self.query_tokens += seq.prompt.len() as u64;
            self.hit_tokens += (hits * bs) as u64;
            self.running.insert(id, seq);
            self.order.push(id);
        }
    }

    fn start_step(&mut self, at: Duration) {
        let mut work = Vec::new();
        let mut decode_context = 0;
        for id in &self.order {
            if let Some(seq) = self.running.get(id).filter(|s| s.decoding()) {
                work.push((*id, Work::Decode));
                decode_context += seq.prompt.len() + seq.generated as usize;
            }
        }
        let decodes = work.len();
        let mut budget = self.cfg.max_num_batched_tokens.saturating_sub(decodes);
        let mut chunks = Vec::new();
        // As vLLM's scheduler does: the running requests' chunks first (each caching its blocks
        // as it is scheduled), then the waiting ones, whose prefix match sees those blocks.
        let admitted_before = self.order.len();
        self.schedule_chunks(0, at, &mut budget, &mut chunks, &mut work);
        self.admit(at);
        self.schedule_chunks(admitted_before, at, &mut budget, &mut chunks, &mut work);
        if work.is_empty() {
            // Only loads in progress: wake when the first completes.
            self.wake = self
                .running
                .values()
                .filter(|s| !s.decoding() && s.ready_at > at)
                .map(|s| s.ready_at)
                .min();
            return;
        }
        let ms = self.step_ms(&chunks, decodes, decode_context);
        let scale = if self.cfg.time_scale > 0.0 {
            self.cfg.time_scale
        } else {
            1.0
        };
        let duration = Duration::from_secs_f64((ms / 1000.0 / scale).max(0.0));
        self.step = Some(Step {
            end: at + duration,
            work,
        });
    }

    /// Grants prefill chunks, first come first served, to the running requests from admission
    /// position `from` on, and caches the full blocks each chunk completes (see the module docs).
    fn schedule_chunks(
        &mut self,
        from: usize,
        at: Duration,
        budget: &mut usize,
        chunks: &mut Vec<(usize, usize)>,
        work: &mut Vec<(u64, Work)>,
    ) {
        for i in from..self.order.len() {
            if *budget == 0 {
                break;
            }
            let id = self.order[i];
            let Some(seq) = self
                .running
                .get_mut(&id)
                .filter(|s| !s.decoding() && s.ready_at <= at)
            else {
                continue;
            };
            let chunk = (seq.prompt.len() - seq.prefilled).min(*budget);
            *budget -= chunk;
            chunks.push((chunk, seq.prefilled));
            work.push((id, Work::Prefill(chunk)));
            Self::cache_blocks(&mut self.cache, seq, seq.prefilled + chunk);
        }
    }

    /// vLLM's `cache_blocks(request, num_computed_tokens)`: moves the full prompt blocks within
    /// the first `computed` tokens that are not cached for `seq` yet into the prefix cache,
    /// pinned for it (a block another request cached meanwhile is shared), with their store events.
    fn cache_blocks(cache: &mut PrefixCache, seq: &mut Seq, computed: usize) {
        let bs = cache.block_tokens();
        let full = (computed / bs).min(seq.hashes.len());
        let from = seq.committed_blocks;
        if full <= from {
            return;
        }
        let parent = from.checked_sub(1).map(|i| seq.hashes[i]);
        cache.commit(
            parent,
            &seq.hashes[from..full],
            &seq.prompt[from * bs..full * bs],
            seq.cache_salt.as_deref(),
        );
        seq.private_blocks -= full - from;
        seq.committed_blocks = full;
    }

    fn complete_step(&mut self, outputs: &mut Vec<Output>) {
        let Some(step) = self.step.take() else {
            return;
        };
        self.steps += 1;
        let bs = self.cache.block_tokens();
        let mut finished = Vec::new();
        for (id, work) in step.work {
            let Some(seq) = self.running.get_mut(&id) else {
                continue; // cancelled during the step
            };
            match work {
                Work::Prefill(chunk) => {
                    seq.prefilled += chunk;
                    // Every computed block is written through to CPU memory as its chunk ends.
                    if let Some(cpu) = &mut self.cpu {
                        let done = (seq.prefilled / bs).min(seq.hashes.len());
                        let out = cpu.store(&seq.hashes[..done]);
                        if !out.stored.is_empty() {
                            self.cache
                                .push_event(CacheEvent::Offloaded { hashes: out.stored });
                        }
                        if !out.evicted.is_empty() {
                            self.cache.push_event(CacheEvent::OffloadEvicted {
                                hashes: out.evicted,
                            });
                        }
                    }
                    if !seq.decoding() {
                        continue;
                    }
                    seq.generated = 1;
                    outputs.push(Output::FirstToken {
                        id,
                        cached_tokens: seq.cached_tokens,
                        prompt_tokens: seq.prompt.len(),
                        fetched_tokens: seq.fetched_tokens,
                    });
                }
                Work::Decode => {
                    seq.generated += 1;
                    outputs.push(Output::Token { id });
                }
            }
            if seq.generated >= seq.max_tokens {
                outputs.push(Output::Finished { id });
                finished.push(id);
            }
        }
        for id in &finished {
            if let Some(seq) = self.running.remove(id) {
                self.live.remove(id);
                self.release(&seq);
            }
        }
        if !finished.is_empty() {
            self.order.retain(|id| self.running.contains_key(id));
        }
        let events = self.cache.take_events();
        if self.cfg.record_kv_events && !events.is_empty() {
            self.batches.push(KvBatch {
                at: step.end,
                events,
            });
        }
    }

    fn release(&mut self, seq: &Seq) {
        // Only the blocks cached for this sequence are pinned: its hits and the full blocks of
        // every chunk scheduled so far. vLLM's `free` keeps them cached (evictable), also when
        // the request was cancelled mid-prefill.
        self.cache
            .release(&seq.hashes[..seq.committed_blocks], seq.private_blocks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine_sim::config::Preset;
    use crate::engine_sim::prefix_cache::block_hashes;

    fn engine(cfg: EngineConfig) -> Engine {
        Engine::new(cfg)
    }

    fn req(id: u64, prompt: Vec<TokenId>, max_tokens: u32) -> Request {
        Request {
            id,
            prompt,
            max_tokens,
            cache_salt: None,
        }
    }

    /// Runs the engine until idle, returning (time, output) pairs.
    fn run(e: &mut Engine) -> Vec<(Duration, Output)> {
        let mut out = Vec::new();
        while let Some(t) = e.next_event_time() {
            for o in e.advance(t) {
                out.push((t, o));
            }
        }
        out
    }

    fn first_token_at(events: &[(Duration, Output)], id: u64) -> (Duration, usize) {
        events
            .iter()
            .find_map(|(t, o)| match o {
                Output::FirstToken {
                    id: i,
                    cached_tokens,
                    ..
                } if *i == id => Some((*t, *cached_tokens)),
                _ => None,
            })
            .unwrap()
    }

    #[test]
    fn fetched_blocks_count_as_cached_arrive_after_the_transfer_and_are_stored() {
        let cfg = EngineConfig {
            record_kv_events: true,
            ..Preset::Llama8bH100.config()
        };
        let prompt: Vec<TokenId> = (0..8192).collect();
        let blocks = 8192 / cfg.block_tokens;
        let transfer = Duration::from_millis(30);
        let mut e = engine(cfg.clone());
        let fetch = Fetched {
            from_block: 0,
            to_block: blocks,
            transfer,
        };
        e.submit_fetched(req(1, prompt.clone(), 1), Duration::ZERO, fetch)
            .unwrap();
        let out = run(&mut e);
        let (t, cached) = first_token_at(&out, 1);
        // All but the last block (an engine recomputes the last token's block).
        assert_eq!(cached, (blocks - 1) * cfg.block_tokens);
        assert!(out.iter().any(|(_, o)| matches!(
            o,
            Output::FirstToken { fetched_tokens, .. } if *fetched_tokens == cached
        )));
        assert!(t >= transfer && t < Duration::from_millis(60), "{t:?}");
        assert_eq!(e.stats().fetched_tokens, cached as u64);
        // The fetched blocks are now this engine's: stored (with events), and hit by a follow-up.
        let stored: usize = e
            .take_kv_batches()
            .iter()
            .flat_map(|b| &b.events)
            .map(|ev| match ev {
                CacheEvent::Stored { hashes, .. } => hashes.len(),
                _ => 0,
            })
            .sum();
        assert_eq!(stored, blocks);
        assert_eq!(
            e.cached_prefix_tokens(&block_hashes(&prompt, cfg.block_tokens)),
            8192
        );
        // Blocks that do not continue the engine's own run are useless: computed in full.
        let mut e = engine(cfg.clone());
        let gap = Fetched {
            from_block: 4,
            ..fetch
        };
        e.submit_fetched(req(2, prompt, 1), Duration::ZERO, gap)
            .unwrap();
        assert_eq!(first_token_at(&run(&mut e), 2).1, 0);
    }

    /// An engine whose steps take at most 1024 prompt tokens (64 blocks of 16), with KV events.
    fn chunked() -> Engine {
        engine(EngineConfig {
            max_num_batched_tokens: 1024,
            record_kv_events: true,
            ..Preset::Llama8bH100.config()
        })
    }

    /// A [`chunked`] engine in the second step of an 8192-token prompt (request 1): its first
    /// two chunks (128 blocks) are scheduled. Returns the engine, the prompt and the first
    /// step's end.
    fn in_the_second_chunk() -> (Engine, Vec<TokenId>, Duration) {
        let mut e = chunked();
        let prompt: Vec<TokenId> = (0..8192).collect();
        e.submit(req(1, prompt.clone(), 1), Duration::ZERO).unwrap();
        e.advance(Duration::ZERO);
        let first_end = e.next_event_time().unwrap();
        e.advance(first_end);
        (e, prompt, first_end)
    }

    #[test]
    fn a_copy_arriving_mid_prefill_hits_the_chunks_scheduled_so_far() {
        let (mut e, prompt, first_end) = in_the_second_chunk();
        // Mid-way through the second chunk: admitted when the third is scheduled, before it.
        let second_end = e.next_event_time().unwrap();
        e.submit(req(2, prompt.clone(), 1), (first_end + second_end) / 2)
            .unwrap();
        assert_eq!(e.cached_prefix_tokens(&block_hashes(&prompt, 16)), 2048);
        let out = run(&mut e);
        assert_eq!(first_token_at(&out, 2).1, 3 * 1024);
        assert_eq!(first_token_at(&out, 1).1, 0);
        assert_eq!(e.stats().prefix_hit_tokens, 3 * 1024);
    }

    #[test]
    fn each_chunk_stores_its_full_blocks_in_one_chained_event() {
        let mut e = chunked();
        // 4000 tokens: chunks of 1024, 1024, 1024, 928; 250 full blocks, a partial tail.
        let prompt: Vec<TokenId> = (0..4000).collect();
        let hashes = block_hashes(&prompt, 16);
        e.submit(req(1, prompt, 1), Duration::ZERO).unwrap();
        run(&mut e);
        let stored: Vec<(Option<BlockHash>, Vec<BlockHash>)> = e
            .take_kv_batches()
            .into_iter()
            .map(|b| match &b.events[..] {
                [CacheEvent::Stored {
                    parent, hashes: h, ..
                }] => (*parent, h.clone()),
                other => panic!("{other:?}"),
            })
            .collect();
        let bounds: [usize; 5] = [0, 64, 128, 192, 250];
        let expected: Vec<_> = bounds
            .windows(2)
            .map(|w| {
                let parent = w[0].checked_sub(1).map(|i| hashes[i]);
                (parent, hashes[w[0]..w[1]].to_vec())
            })
            .collect();
        assert_eq!(stored, expected);
    }

    #[test]
    fn cancel_mid_prefill_keeps_the_scheduled_chunks_cached_and_unpinned() {
        let (mut e, prompt, _) = in_the_second_chunk();
        e.cancel(1);
        // vLLM's `free`: the blocks cached so far stay, evictable; nothing is held.
        let s = e.stats();
        assert_eq!((s.cached_blocks, s.kv_usage), (128, 0.0));
        assert_eq!(e.cached_prefix_tokens(&block_hashes(&prompt, 16)), 2048);
        assert!(run(&mut e).is_empty());
        e.submit(req(2, prompt, 1), Duration::from_secs(1)).unwrap();
        assert_eq!(first_token_at(&run(&mut e), 2).1, 2048);
    }

    #[test]
    fn cold_ttft_matches_the_calibration_table() {
        // engine-timing.md §3: 8B, 8k prompt, cold, idle engine → 188 ms.
        let mut e = engine(Preset::Llama8bH100.config());
        e.submit(req(1, (0..8192).collect(), 1), Duration::ZERO)
            .unwrap();
        let (t, cached) = first_token_at(&run(&mut e), 1);
        assert_eq!(cached, 0);
        assert!((t.as_secs_f64() * 1000.0 - 188.3).abs() < 1.0, "{t:?}");
    }

    #[test]
    fn prefix_reuse_cuts_prefill_by_the_modelled_factor() {
        // engine-timing.md §3: an 8k prompt with 6k cached → 57 ms instead of 188 ms.
        let mut e = engine(Preset::Llama8bH100.config());
        let shared: Vec<TokenId> = (0..6144).collect();
        let mut first = shared.clone();
        first.extend(100_000..102_048);
        e.submit(req(1, first, 1), Duration::ZERO).unwrap();
        let cold = first_token_at(&run(&mut e), 1).0;
        let start = Duration::from_secs(10);
        let mut second = shared;
        second.extend(200_000..202_048);
        e.submit(req(2, second, 1), start).unwrap();
        let (t, cached) = first_token_at(&run(&mut e), 2);
        assert_eq!(cached, 6144);
        let warm = t - start;
        let expected_warm = e.step_ms(&[(2048, 6144)], 0, 0);
        assert!((warm.as_secs_f64() * 1000.0 - expected_warm).abs() < 0.01);
        assert!((expected_warm - 57.0).abs() < 1.5, "{expected_warm}");
        let ratio = cold.as_secs_f64() / warm.as_secs_f64();
        assert!(ratio > 3.0 && ratio < 3.6, "{ratio}");
        let s = e.stats();
        assert_eq!(s.prefix_query_tokens, 2 * 8192);
        assert_eq!(s.prefix_hit_tokens, 6144);
    }

    #[test]
    fn identical_prompt_recomputes_its_last_block() {
        let mut e = engine(Preset::Llama8bH100.config());
        e.submit(req(1, (0..64).collect(), 2), Duration::ZERO)
            .unwrap();
        run(&mut e);
        e.submit(req(2, (0..64).collect(), 2), Duration::from_secs(1))
            .unwrap();
        assert_eq!(first_token_at(&run(&mut e), 2).1, 48);
    }

    #[test]
    fn batching_budget_and_max_seqs_are_respected() {
        let cfg = EngineConfig {
            max_num_batched_tokens: 1000,
            max_num_seqs: 2,
            ..Preset::Llama8bH100.config()
        };
        let mut e = engine(cfg);
        for id in 0..3 {
            let base = id as u32 * 10_000;
            e.submit(req(id, (base..base + 1500).collect(), 3), Duration::ZERO)
                .unwrap();
        }
        // First step: only 2 admitted, 1000-token chunk for request 0 only.
        e.advance(Duration::ZERO);
        let s = e.stats();
        assert_eq!((s.running, s.waiting), (2, 1));
        let first_end = e.next_event_time().unwrap();
        let expected = e.step_ms(&[(1000, 0)], 0, 0);
        assert!((first_end.as_secs_f64() * 1000.0 - expected).abs() < 1e-6);
        // Second step: 500 tokens finish request 0, 500 go to request 1.
        assert!(e.advance(first_end).is_empty());
        let second_end = e.next_event_time().unwrap();
        let expected = e.step_ms(&[(500, 1000), (500, 0)], 0, 0);
        assert!(((second_end - first_end).as_secs_f64() * 1000.0 - expected).abs() < 1e-6);
        let out = run(&mut e);
        let finished: Vec<u64> = out
            .iter()
            .filter_map(|(_, o)| match o {
                Output::Finished { id } => Some(*id),
                _ => None,
            })
            .collect();
        assert_eq!(finished, vec![0, 1, 2]);
        let tokens = out
            .iter()
            .filter(|(_, o)| matches!(o, Output::Token { id: 2 }))
            .count();
        assert_eq!(tokens, 2, "first token + 2 decodes = max_tokens 3");
    }

    #[test]
    fn queues_when_kv_is_full_then_admits() {
        let cfg = EngineConfig {
            kv_capacity_tokens: 16 * 10,
            ..Preset::Llama8bH100.config()
        };
        let mut e = engine(cfg);
        e.submit(req(1, (0..100).collect(), 40), Duration::ZERO)
            .unwrap(); // 9 blocks
        e.submit(req(2, (1000..1100).collect(), 40), Duration::ZERO)
            .unwrap();
        e.advance(Duration::ZERO);
        assert_eq!((e.stats().running, e.stats().waiting), (1, 1));
        let out = run(&mut e);
        assert!(out.iter().any(|(_, o)| *o == Output::Finished { id: 2 }));
        assert_eq!(
            e.submit(req(3, (0..150).collect(), 20), Duration::ZERO),
            Err(SubmitError::TooLong {
                prompt: 150,
                max_tokens: 20,
                limit: 160
            })
        );
    }

    #[test]
    fn deterministic_and_time_scaled() {
        let trace = |scale: f64| {
            let mut e = engine(EngineConfig {
                time_scale: scale,
                record_kv_events: true,
                ..Preset::Llama8bH100.config()
            });
            for id in 0..20u64 {
                let shared = (id % 3) as u32 * 1000;
                let mut p: Vec<TokenId> = (shared..shared + 200).collect();
                p.extend((0..(id as u32 * 7)).map(|t| t + 50_000));
                e.submit(req(id, p, 5), Duration::from_millis(id * 3))
                    .unwrap();
            }
            (run(&mut e), e.take_kv_batches())
        };
        let (a, ka) = trace(1.0);
        let (b, kb) = trace(1.0);
        assert_eq!(a, b);
        assert_eq!(ka, kb);
        assert!(!ka.is_empty());
        let (c, _) = trace(2.0);
        assert_eq!(a.len(), c.len());
        // Same outputs, each at about half the time (arrivals are not scaled, so compare the end).
        let ratio = a.last().unwrap().0.as_secs_f64() / c.last().unwrap().0.as_secs_f64();
        assert!(ratio > 1.5 && ratio < 2.1, "{ratio}");
    }

    #[test]
    fn a_handed_over_prompt_decodes_at_once_and_enters_the_cache() {
        let mut e = engine(EngineConfig {
            record_kv_events: true,
            ..EngineConfig::default()
        });
        let prompt: Vec<TokenId> = (0..4096).collect();
        e.submit_with_kv(req(1, prompt.clone(), 2), Duration::ZERO)
            .unwrap();
        let out = run(&mut e);
        let (handed, cached) = first_token_at(&out, 1);
        assert_eq!(cached, 0, "nothing was in this engine's own cache");
        let mut cold = engine(EngineConfig::default());
        cold.submit(req(1, prompt.clone(), 2), Duration::ZERO)
            .unwrap();
        let (computed, _) = first_token_at(&run(&mut cold), 1);
        assert!(handed * 10 < computed, "{handed:?} vs {computed:?}");
        // The handed-over blocks are now a prefix hit, announced by store events.
        let bs = e.config().block_tokens;
        assert_eq!(
            e.cached_prefix_tokens(&block_hashes(&prompt, bs)),
            prompt.len() / bs * bs
        );
        assert!(e.take_kv_batches().iter().any(|b| b
            .events
            .iter()
            .any(|ev| matches!(ev, CacheEvent::Stored { .. }))));
    }

    #[test]
    fn cancel_frees_blocks() {
        let cfg = EngineConfig {
            kv_capacity_tokens: 16 * 10,
            ..Preset::Llama8bH100.config()
        };
        let mut e = engine(cfg);
        e.submit(req(1, (0..100).collect(), 40), Duration::ZERO)
            .unwrap();
        e.advance(Duration::ZERO);
        assert!(e.stats().kv_usage > 0.8);
        e.cancel(1);
        assert_eq!(e.stats().kv_usage, 0.0);
        assert!(run(&mut e).is_empty());
        e.submit(req(1, (0..100).collect(), 40), Duration::from_secs(1))
            .unwrap();
        let out = run(&mut e);
        assert!(out.iter().any(|(_, o)| *o == Output::Finished { id: 1 }));
        assert_eq!(e.stats().running, 0);
    }

    /// Prompt A cached, then pushed off the GPU by B, then A again: (A's second TTFT after
    /// its submission, its cached tokens, every KV event) on an engine of 64 GPU blocks.
    fn a_b_a(cpu_capacity_tokens: usize, cpu_gb_per_s: f64) -> (Duration, usize, Vec<CacheEvent>) {
        let mut e = engine(EngineConfig {
            kv_capacity_tokens: 64 * 16,
            cpu_capacity_tokens,
            cpu_gb_per_s,
            record_kv_events: true,
            ..Preset::Llama8bH100.config()
        });
        let a: Vec<TokenId> = (0..512).collect();
        e.submit(req(1, a.clone(), 1), Duration::ZERO).unwrap();
        run(&mut e);
        e.submit(
            req(2, (10_000..10_960).collect(), 1),
            Duration::from_secs(1),
        )
        .unwrap();
        run(&mut e);
        let at = Duration::from_secs(2);
        e.submit(req(3, a, 1), at).unwrap();
        let (t, cached) = first_token_at(&run(&mut e), 3);
        let events = e
            .take_kv_batches()
            .into_iter()
            .flat_map(|b| b.events)
            .collect();
        (t - at, cached, events)
    }

    #[test]
    fn a_cpu_hit_is_loaded_instead_of_recomputed() {
        // B (61 blocks) evicts A's tail from the GPU: 3 of A's 32 blocks stay there.
        let (cold_ttft, cold_cached, _) = a_b_a(0, 25.0);
        assert_eq!(cold_cached, 3 * 16);
        let (ttft, cached, _) = a_b_a(8192, 25.0);
        // The rest up to the last block comes from CPU memory: 28 blocks.
        assert_eq!(cached, 31 * 16);
        let load_s = 28.0 * 16.0 * 131_072.0 / 25e9;
        assert!(ttft.as_secs_f64() >= load_s, "{ttft:?}");
        assert!(ttft < cold_ttft, "{ttft:?} vs {cold_ttft:?}");
        // Over a congested link the engine still loads (as vLLM does), and it is slower than
        // recomputing: what the router's load-time weight predicts.
        let (slow, cached, _) = a_b_a(8192, 0.05);
        assert_eq!(cached, 31 * 16);
        assert!(slow.as_secs_f64() >= 28.0 * 16.0 * 131_072.0 / 0.05e9);
        assert!(slow > cold_ttft);
    }

    #[test]
    fn computed_blocks_are_written_through_to_cpu_with_events() {
        let (_, _, events) = a_b_a(8192, 25.0);
        let a = block_hashes(&(0..512).collect::<Vec<_>>(), 16);
        // A's GPU store comes first, then the same blocks as offloaded.
        let stored = events
            .iter()
            .position(|e| matches!(e, CacheEvent::Stored { hashes, .. } if hashes == &a))
            .unwrap();
        assert_eq!(
            events[stored + 1],
            CacheEvent::Offloaded { hashes: a.clone() }
        );
        // A's GPU eviction; its CPU copy stays (no CPU removal at all: 8192 tokens is room).
        assert!(events
            .iter()
            .any(|e| matches!(e, CacheEvent::Removed { hashes } if hashes.contains(&a[31]))));
        assert!(!events
            .iter()
            .any(|e| matches!(e, CacheEvent::OffloadEvicted { .. })));
        // A CPU tier of 64 blocks must evict A's tail to hold B.
        let (_, cached, events) = a_b_a(64 * 16, 25.0);
        assert!(events.iter().any(
            |e| matches!(e, CacheEvent::OffloadEvicted { hashes } if hashes.contains(&a[31]))
        ));
        assert!(cached < 31 * 16);
    }
}
