//! A data-parallel replica: N engines (ranks) behind one address, each with its own prefix
//! cache, as vLLM `--data-parallel-size` runs them.
//!
//! Exists so the simulator can show what naming the rank is worth (`core::dp_rank`). Who picks
//! the rank ([`RankPick`]): the engine's own balancer, which sends a request to the rank with
//! the fewest requests in flight and finds the prompt's prefix only where it happens to land;
//! or the router, which names the rank the way a replica's home node does from the ranks' KV
//! events — the least predicted time to first token over each rank's cached leading run and
//! queued prefill (`core::dp_rank::pick_rank`). The router here reads the ranks' caches and
//! queues as they are, with no event lag: what a home with an exact model knows, a little
//! early. With one rank it is exactly an [`Engine`].
//!
//! The caller owns time, as with [`Engine`]: outputs of every rank, rank by rank, in order.

use std::time::Duration;

use super::config::EngineConfig;
use super::engine::{Engine, EngineStats, Output, Request, SubmitError};
use super::prefix_cache::salted_block_hashes;
use crate::core::dp_rank::{pick_rank, RankLoad, RankRuns, MAX_RANKS};

/// Who picks a request's rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RankPick {
    /// The engine's balancer: fewest requests in flight (ties rotate).
    Balancer,
    /// The router names it from the ranks' caches and queues (`core::dp_rank`), with this
    /// cost of one request in flight, in seconds (`CostModel::w_load_s`).
    Named {
        /// Seconds one request in flight adds to a rank's predicted cost.
        w_load_s: f64,
    },
}

/// N ranks behind one replica.
#[derive(Debug)]
pub struct DpEngine {
    ranks: Vec<Engine>,
    pick: RankPick,
    /// Rotates ties (a cold prefix on idle ranks).
    rotate: usize,
}

impl DpEngine {
    /// `ranks` engines of `cfg` (1..=[`MAX_RANKS`]; clamped), ranks picked by `pick`.
    pub fn new(cfg: EngineConfig, ranks: usize, pick: RankPick) -> Self {
        let n = ranks.clamp(1, MAX_RANKS);
        DpEngine {
            ranks: (0..n).map(|_| Engine::new(cfg.clone())).collect(),
            pick,
            rotate: 0,
        }
    }

    /// Ranks.
    pub fn rank_count(&self) -> usize {
        self.ranks.len()
    }

    /// One rank's configuration (all ranks share it).
    pub fn config(&self) -> &EngineConfig {
        self.ranks[0].config()
    }

    /// The rank `req` would go to now.
    fn choose(&mut self, req: &Request) -> usize {
        let n = self.ranks.len();
        let start = self.rotate;
        self.rotate = self.rotate.wrapping_add(1);
        if n == 1 {
            return 0;
        }
        let in_flight = |e: &Engine| {
            let st = e.stats();
            st.running + st.waiting
        };
        match self.pick {
            RankPick::Balancer => (0..n)
                .map(|k| (start + k) % n)
                .min_by_key(|r| in_flight(&self.ranks[*r]))
                .unwrap_or(0),
            RankPick::Named { w_load_s } => {
                let cfg = self.config();
                let bt = cfg.block_tokens.max(1);
                let rate = 1000.0 / cfg.prefill_ms_per_token.max(1e-9);
                let hashes = salted_block_hashes(&req.prompt, bt, req.cache_salt.as_deref());
                let mut runs = RankRuns::zeros(n);
                let mut loads = [RankLoad::default(); MAX_RANKS];
                for (r, e) in self.ranks.iter().enumerate() {
                    runs.raise(r, e.cached_prefix_tokens(&hashes) / bt);
                    loads[r] = RankLoad {
                        pending_tokens: e.pending_prefill_tokens() as u64,
                        in_flight: u32::try_from(in_flight(e)).unwrap_or(u32::MAX),
                    };
                }
                pick_rank(
                    &runs,
                    &loads[..n],
                    req.prompt.len() as u64,
                    u32::try_from(bt).unwrap_or(u32::MAX),
                    rate,
                    w_load_s,
                    start,
                )
                .unwrap_or(0)
            }
        }
    }

    /// Queues `req` on the rank [`RankPick`] picks; returns that rank.
    pub fn submit(&mut self, req: Request, now: Duration) -> Result<usize, SubmitError> {
        let r = self.choose(&req);
        self.ranks[r].submit(req, now)?;
        Ok(r)
    }

    /// Queues a decode whose prompt's KV was handed over ([`Engine::submit_with_kv`]) on the
    /// rank [`RankPick`] picks; returns that rank.
    pub fn submit_with_kv(&mut self, req: Request, now: Duration) -> Result<usize, SubmitError> {
        let r = self.choose(&req);
        self.ranks[r].submit_with_kv(req, now)?;
        Ok(r)
    }

    /// Queues a request with blocks pulled from another replica ([`Engine::submit_fetched`]) on
    /// the rank [`RankPick`] picks; returns that rank.
    pub fn submit_fetched(
        &mut self,
        req: Request,
        now: Duration,
        fetch: super::engine::Fetched,
    ) -> Result<usize, SubmitError> {
        let r = self.choose(&req);
        self.ranks[r].submit_fetched(req, now, fetch)?;
        Ok(r)
    }

    /// Drops request `id` from whichever rank holds it (a no-op on the others: ids are unique).
    pub fn cancel(&mut self, id: u64) {
        for e in &mut self.ranks {
            e.cancel(id);
        }
    }

    /// The earliest next event of any rank.
    pub fn next_event_time(&self) -> Option<Duration> {
        self.ranks.iter().filter_map(Engine::next_event_time).min()
    }

    /// KV event batches of every rank's completed steps, rank by rank. Only meaningful for one
    /// rank: the batches carry no rank, so the simulator refuses exact homes with several.
    pub fn take_kv_batches(&mut self) -> Vec<super::engine::KvBatch> {
        let mut out = Vec::new();
        for e in &mut self.ranks {
            out.extend(e.take_kv_batches());
        }
        out
    }

    /// Advances every rank to `now`; their outputs, rank by rank.
    pub fn advance(&mut self, now: Duration) -> Vec<Output> {
        let mut out = Vec::new();
        for e in &mut self.ranks {
            out.extend(e.advance(now));
        }
        out
    }

    /// The most prompt tokens any rank holds for a prompt with these block hashes (what an
    /// oracle that also named the rank would credit).
    pub fn cached_prefix_tokens(&self, hashes: &[super::prefix_cache::BlockHash]) -> usize {
        self.ranks
            .iter()
            .map(|e| e.cached_prefix_tokens(hashes))
            .max()
            .unwrap_or(0)
    }

    /// Prompt tokens queued for prefill on the least queued rank (where a new request could
    /// start soonest).
    pub fn pending_prefill_tokens(&self) -> usize {
        self.ranks
            .iter()
            .map(Engine::pending_prefill_tokens)
            .min()
            .unwrap_or(0)
    }

    /// The replica's gauges: counts and blocks summed over the ranks, KV usage of them all.
    pub fn stats(&self) -> EngineStats {
        if let [one] = &self.ranks[..] {
            // Bit for bit the engine's (the usage below would round).
            return one.stats();
        }
        let mut s = EngineStats::default();
        let mut used = 0.0;
        for e in &self.ranks {
            let r = e.stats();
            s.running += r.running;
            s.waiting += r.waiting;
            s.prefix_query_tokens += r.prefix_query_tokens;
            s.prefix_hit_tokens += r.prefix_hit_tokens;
            s.num_blocks += r.num_blocks;
            s.block_tokens = r.block_tokens;
            s.cached_blocks += r.cached_blocks;
            s.steps += r.steps;
            s.fetched_tokens += r.fetched_tokens;
            used += r.kv_usage * r.num_blocks as f64;
        }
        s.kv_usage = if s.num_blocks == 0 {
            0.0
        } else {
            used / s.num_blocks as f64
        };
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine_sim::tokens::tokenize;

    fn cfg() -> EngineConfig {
        EngineConfig::default()
    }

    /// Runs `prompts` one after the other (each finished before the next arrives) through a
    /// replica of 4 ranks; returns the prompt tokens served from the prefix cache.
    fn cached_over(pick: RankPick, prompts: &[String]) -> usize {
        let mut e = DpEngine::new(cfg(), 4, pick);
        let mut now = Duration::ZERO;
        let mut cached = 0;
        for (id, p) in prompts.iter().enumerate() {
            let req = Request {
                id: id as u64,
                prompt: tokenize(p),
                max_tokens: 2,
                cache_salt: None,
            };
            e.submit(req, now).unwrap();
            while let Some(t) = e.next_event_time() {
                now = t;
                for o in e.advance(now) {
                    if let Output::FirstToken { cached_tokens, .. } = o {
                        cached += cached_tokens;
                    }
                }
            }
        }
        cached
    }

    #[test]
    fn naming_the_rank_finds_a_conversations_prefix_that_the_balancer_scatters() {
        // Three conversations of four growing turns each, turns interleaved: with idle ranks
        // the balancer rotates, so a conversation's next turn lands on another of the 4 ranks.
        let turns: Vec<String> = (1..=4)
            .flat_map(|t| {
                (0..3).map(move |c| {
                    (0..t)
                        .map(|k| format!("conversation {c} turn {k} {}", "words ".repeat(200)))
                        .collect::<String>()
                })
            })
            .collect();
        let named = cached_over(RankPick::Named { w_load_s: 0.01 }, &turns);
        let balancer = cached_over(RankPick::Balancer, &turns);
        assert!(
            named > 2 * balancer.max(1),
            "named {named}, balancer {balancer}"
        );
    }

    #[test]
    fn one_rank_is_the_engine_and_stats_sum_over_ranks() {
        let mut e = DpEngine::new(cfg(), 1, RankPick::Balancer);
        assert_eq!(e.rank_count(), 1);
        let req = Request {
            id: 1,
            prompt: tokenize(&"x".repeat(400)),
            max_tokens: 1,
            cache_salt: None,
        };
        assert_eq!(e.submit(req.clone(), Duration::ZERO), Ok(0));
        assert_eq!(
            e.submit(req, Duration::ZERO),
            Err(SubmitError::DuplicateId(1))
        );
        let four = DpEngine::new(cfg(), 4, RankPick::Balancer);
        let one = Engine::new(cfg()).stats();
        assert_eq!(four.stats().num_blocks, 4 * one.num_blocks);
        assert_eq!(
            DpEngine::new(cfg(), 1000, RankPick::Balancer).rank_count(),
            MAX_RANKS
        );
    }
}
