//! `kvmesh sim`: a discrete-event simulation of router nodes and engine replicas in virtual time.
//!
//! It drives the *same* code as the live system: every node is a [`View`] + [`Router`] from the
//! core, every replica an [`Engine`] from the engine model, every home-node cache model a
//! [`CacheModel`]. What it models instead of running:
//! - gossip: each node refreshes its view (engine load, summaries, queued prefill) every
//!   `gossip_interval`, staggered across nodes, so views are stale by up to one interval;
//! - a routed request's blocks reach the replica's cache model when its prefill completes (its
//!   first token): that is when the engine holds them, and what a KV-event (exact) model sees; the
//!   routing node's own overlay counts them from the predicted first token on
//!   ([`View::record_routed_ready`]), before its stale view has the summary;
//! - clients: each request of the workload arrives at a uniformly random node.
//!
//! The oracle baseline is one central router with exact, instant knowledge: for every arrival it
//! reads each engine's actual prefix cache and pending prefill, and picks the replica with the
//! lowest predicted time to first token (same cost formula as the core). No summaries, no
//! staleness, no false positives. Deterministic for a seed.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::stats::{max_over_mean, Distribution};
use super::trace::BYTES_PER_TOKEN;
use super::workload::WorkloadRequest;
use crate::core::cache_model::{CacheModel, CacheModelConfig, CacheSource};
use crate::core::keys::{text_block_keys, BlockKey, Namespace};
use crate::core::policy::PolicyKind;
use crate::core::router::{Decision, RouteRequest, Router, RouterConfig};
use crate::core::summary::SummaryConfig;
use crate::core::tenants::Tenants;
use crate::core::view::{ReplicaInfo, View};
use crate::engine_sim::prefix_cache::block_hashes;
use crate::engine_sim::{tokenize, Engine, EngineConfig, Output, Request};

const MODEL: &str = "sim-llama-8b";

/// What to simulate.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Router nodes. Default 3.
    pub nodes: usize,
    /// Engine replicas. Default 8.
    pub replicas: usize,
    /// Routing policy of every node. Default `p2c-cache`.
    pub policy: PolicyKind,
    /// Seed of every random choice. Default 1.
    pub seed: u64,
    /// How often a node's view is refreshed. Default 100 ms.
    pub gossip_interval: Duration,
    /// The engine model of every replica. Default: 8B on one H100.
    pub engine: EngineConfig,
    /// Routing-text block size. Default 256 bytes.
    pub block_bytes: usize,
    /// Workload arrival times are divided by this (2.0 = twice the workload's rate). Default 1.
    pub arrival_speedup: f64,
    /// Replay only the first N requests. Default: all.
    pub max_requests: Option<usize>,
    /// Run the oracle baseline instead (one central router reading the engines' true state).
    pub oracle: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            nodes: 3,
            replicas: 8,
            policy: PolicyKind::P2cCache,
            seed: 1,
            gossip_interval: Duration::from_millis(100),
            engine: EngineConfig::default(),
            block_bytes: 256,
            arrival_speedup: 1.0,
            max_requests: None,
            oracle: false,
        }
    }
}

/// What a run measured.
#[derive(Clone, Debug, Serialize)]
pub struct SimReport {
    /// Policy name (`oracle` for the baseline).
    pub policy: String,
    /// Router nodes.
    pub nodes: usize,
    /// Replicas.
    pub replicas: usize,
    /// Requests replayed.
    pub requests: usize,
    /// Requests that could not be routed or submitted.
    pub errors: usize,
    /// Time to first token, seconds.
    pub ttft: Distribution,
    /// End-to-end latency, seconds.
    pub latency: Distribution,
    /// Prompt tokens sent.
    pub prompt_tokens: u64,
    /// Prompt tokens the engines served from their prefix caches.
    pub cached_tokens: u64,
    /// cached / prompt tokens.
    pub hit_token_ratio: f64,
    /// Requests served by each replica.
    pub requests_per_replica: Vec<u64>,
    /// Largest replica share over the mean share.
    pub load_max_over_mean: f64,
    /// Virtual time from the first arrival to the last completion, seconds.
    pub virtual_seconds: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrival(usize),
    EngineWake(usize),
    Gossip(usize),
}

struct Node {
    view: View,
    router: Router,
}

#[derive(Clone, Copy, Default)]
struct InFlight {
    arrival: Duration,
    node: usize,
    replica: usize,
    uncached_tokens: u64,
}

/// A simulation that failed to start.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// Bad configuration.
    #[error("invalid simulation config: {0}")]
    Config(String),
}

/// Runs the simulation of `workload` under `cfg`. Sessions and tenants of the workload reach the
/// router as they would through the headers.
pub fn run(workload: &[WorkloadRequest], cfg: &SimConfig) -> Result<SimReport, SimError> {
    if cfg.nodes == 0 || cfg.replicas == 0 {
        return Err(SimError::Config(
            "nodes and replicas must be at least 1".into(),
        ));
    }
    if !(cfg.arrival_speedup.is_finite() && cfg.arrival_speedup > 0.0) {
        return Err(SimError::Config("arrival_speedup must be > 0".into()));
    }
    cfg.engine
        .validate()
        .map_err(|e| SimError::Config(e.to_string()))?;
    let reqs = &workload[..cfg
        .max_requests
        .unwrap_or(workload.len())
        .min(workload.len())];
    let nodes_n = if cfg.oracle { 1 } else { cfg.nodes };
    let policy = if cfg.oracle {
        PolicyKind::CacheArgmin
    } else {
        cfg.policy
    };
    let tokens_per_block = (cfg.block_bytes / BYTES_PER_TOKEN).max(1) as u32;
    let summary_cfg = SummaryConfig::for_cluster("sim");
    let prefill_rate = 1000.0 / cfg.engine.prefill_ms_per_token.max(1e-9);

    let infos: Vec<ReplicaInfo> = (0..cfg.replicas)
        .map(|i| ReplicaInfo {
            id: format!("replica-{i}"),
            url: format!("sim://replica-{i}"),
            region: "sim".into(),
            zone: String::new(),
            pool: "shared".into(),
            models: vec![MODEL.into()],
            capacity_tokens: cfg.engine.kv_capacity_tokens as u64,
            prefill_tokens_per_s: prefill_rate,
            max_in_flight: cfg.engine.max_num_seqs as u32,
        })
        .collect();
    let mut nodes: Vec<Node> = (0..nodes_n)
        .map(|n| {
            let mut view = View::new("sim", tokens_per_block);
            for info in &infos {
                view.upsert(info.clone());
            }
            let rc = RouterConfig {
                policy,
                seed: cfg.seed.wrapping_add(n as u64),
                ..Default::default()
            };
            Node {
                view,
                router: Router::new(rc, Tenants::default()),
            }
        })
        .collect();
    let capacity_blocks = cfg.engine.kv_capacity_tokens / tokens_per_block as usize;
    let mut models = (0..cfg.replicas)
        .map(|_| {
            CacheModel::new(
                CacheSource::Approximate,
                1,
                CacheModelConfig::with_capacity(capacity_blocks),
                summary_cfg.clone(),
            )
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| SimError::Config(e.to_string()))?;
    let mut engines: Vec<Engine> = (0..cfg.replicas)
        .map(|_| Engine::new(cfg.engine.clone()))
        .collect();
    let mut scheduled: Vec<Option<Duration>> = vec![None; cfg.replicas];
    let mut pending_prefill = vec![0u64; cfg.replicas];

    let mut heap: BinaryHeap<Reverse<(Duration, u64, Event)>> = BinaryHeap::new();
    let mut order = 0u64;
    let mut push = |heap: &mut BinaryHeap<_>, t: Duration, e: Event| {
        order += 1;
        heap.push(Reverse((t, order, e)));
    };
    for (i, r) in reqs.iter().enumerate() {
        push(
            &mut heap,
            Duration::from_secs_f64(r.at_s.max(0.0) / cfg.arrival_speedup),
            Event::Arrival(i),
        );
    }
    if !cfg.oracle {
        for n in 0..nodes_n {
            let first = cfg.gossip_interval.mul_f64((n + 1) as f64 / nodes_n as f64);
            push(&mut heap, first, Event::Gossip(n));
        }
    }

    let mut rng = SmallRng::seed_from_u64(cfg.seed);
    let mut flights = vec![InFlight::default(); reqs.len()];
    // Block keys of each request until its first token, when they join the cache model.
    let mut routed_keys: Vec<Vec<BlockKey>> = vec![Vec::new(); reqs.len()];
    let mut ttft = Vec::with_capacity(reqs.len());
    let mut latency = Vec::with_capacity(reqs.len());
    let (mut prompt_tokens, mut cached_tokens, mut errors, mut done) = (0u64, 0u64, 0usize, 0usize);
    let mut per_replica = vec![0u64; cfg.replicas];
    let mut text = String::new();
    let mut keys: Vec<BlockKey> = Vec::new();
    let ns = Namespace::new(MODEL, None, None, None);
    let mut last = Duration::ZERO;

    while let Some(Reverse((now, _, ev))) = heap.pop() {
        last = last.max(now);
        match ev {
            Event::Arrival(i) => {
                let req = &reqs[i];
                let n = rng.random_range(0..nodes_n);
                req.write_prompt(&mut text);
                keys.clear();
                text_block_keys(ns, text.as_bytes(), cfg.block_bytes, &mut keys);
                let prompt = tokenize(&text);
                let rr = RouteRequest {
                    model: MODEL,
                    keys: &keys,
                    prompt_tokens: prompt.len() as u64,
                    session: req.session.as_deref(),
                    tenant: req.tenant.as_deref(),
                    forwarded: false,
                    exclude: &[],
                };
                let node = &mut nodes[n];
                let (r, uncached, ready_in) = if cfg.oracle {
                    let (r, uncached) = oracle_pick(&engines, &prompt, prefill_rate, &mut rng);
                    (r, uncached, Duration::ZERO)
                } else {
                    let Decision::Route(d) = node.router.route(&node.view, &rr, now) else {
                        errors += 1;
                        done += 1;
                        continue;
                    };
                    let hit_tokens = d.hit_blocks as u64 * tokens_per_block as u64;
                    let uncached = (prompt.len() as u64).saturating_sub(hit_tokens);
                    // Its blocks count in this node's overlay once its prefill is predicted done.
                    let ready_in = node.view.replica(d.replica).map_or(0.0, |rep| {
                        node.router.config().cost.prefill_done_s(rep, uncached)
                    });
                    (
                        d.replica,
                        uncached,
                        Duration::from_secs_f64(ready_in.clamp(0.0, 3600.0)),
                    )
                };
                node.view.record_routed_ready(r, &keys, now, ready_in);
                if let Some(rep) = node.view.replica_mut(r) {
                    rep.load.queued_prefill_tokens += uncached;
                }
                routed_keys[i].clone_from(&keys);
                pending_prefill[r] += uncached;
                flights[i] = InFlight {
                    arrival: now,
                    node: n,
                    replica: r,
                    uncached_tokens: uncached,
                };
                let max_tokens = req.output_tokens.max(1);
                if engines[r]
                    .submit(
                        Request {
                            id: i as u64,
                            prompt,
                            max_tokens,
                        },
                        now,
                    )
                    .is_err()
                {
                    errors += 1;
                    done += 1;
                    nodes[n].view.finished(r);
                    pending_prefill[r] = pending_prefill[r].saturating_sub(uncached);
                    continue;
                }
                per_replica[r] += 1;
                schedule(&mut heap, &mut push, &engines[r], &mut scheduled[r], r);
            }
            Event::EngineWake(r) => {
                if scheduled[r] != Some(now) {
                    continue; // superseded by an earlier wake
                }
                scheduled[r] = None;
                for out in engines[r].advance(now) {
                    match out {
                        Output::FirstToken {
                            id,
                            cached_tokens: c,
                            prompt_tokens: p,
                        } => {
                            let f = flights[id as usize];
                            models[r]
                                .record_routed(&std::mem::take(&mut routed_keys[id as usize]), now);
                            ttft.push((now - f.arrival).as_secs_f64());
                            prompt_tokens += p as u64;
                            cached_tokens += c as u64;
                            pending_prefill[r] =
                                pending_prefill[r].saturating_sub(f.uncached_tokens);
                            if let Some(rep) = nodes[f.node].view.replica_mut(r) {
                                rep.load.queued_prefill_tokens = rep
                                    .load
                                    .queued_prefill_tokens
                                    .saturating_sub(f.uncached_tokens);
                            }
                        }
                        Output::Finished { id } => {
                            let f = flights[id as usize];
                            latency.push((now - f.arrival).as_secs_f64());
                            nodes[f.node].view.finished(f.replica);
                            done += 1;
                        }
                        Output::Token { .. } => {}
                    }
                }
                schedule(&mut heap, &mut push, &engines[r], &mut scheduled[r], r);
            }
            Event::Gossip(n) => {
                refresh(&mut nodes[n].view, &engines, &models, &pending_prefill, now);
                if n == 0 {
                    for m in &mut models {
                        // A rebuild only fails on an impossible filter size, checked at start.
                        let _ = m.maybe_rebuild(now);
                    }
                }
                if done < reqs.len() {
                    push(&mut heap, now + cfg.gossip_interval, Event::Gossip(n));
                }
            }
        }
    }

    let first = reqs
        .first()
        .map_or(0.0, |r| r.at_s.max(0.0) / cfg.arrival_speedup);
    Ok(SimReport {
        policy: if cfg.oracle {
            "oracle".into()
        } else {
            policy.as_str().into()
        },
        nodes: nodes_n,
        replicas: cfg.replicas,
        requests: reqs.len(),
        errors,
        ttft: Distribution::of(&mut ttft),
        latency: Distribution::of(&mut latency),
        prompt_tokens,
        cached_tokens,
        hit_token_ratio: if prompt_tokens == 0 {
            0.0
        } else {
            cached_tokens as f64 / prompt_tokens as f64
        },
        load_max_over_mean: max_over_mean(&per_replica),
        requests_per_replica: per_replica,
        virtual_seconds: last.as_secs_f64() - first,
    })
}

/// The oracle's choice: the lowest predicted time to first token from the engines' true state
/// (random among exact ties). Returns the replica and the uncached prompt tokens there.
fn oracle_pick(
    engines: &[Engine],
    prompt: &[u32],
    prefill_rate: f64,
    rng: &mut SmallRng,
) -> (usize, u64) {
    let w_load = crate::core::cost::CostModel::default().w_load_s;
    let hashes = block_hashes(
        prompt,
        engines.first().map_or(16, |e| e.config().block_tokens),
    );
    let mut best = (f64::INFINITY, 0usize, 0u64);
    let mut ties = 0u32;
    for (r, e) in engines.iter().enumerate() {
        let uncached = prompt.len().saturating_sub(e.cached_prefix_tokens(&hashes)) as u64;
        let st = e.stats();
        let cost = (e.pending_prefill_tokens() as u64 + uncached) as f64 / prefill_rate
            + w_load * (st.running + st.waiting) as f64;
        if cost < best.0 {
            best = (cost, r, uncached);
            ties = 1;
        } else if cost == best.0 {
            ties += 1;
            if rng.random_range(0..ties) == 0 {
                best = (cost, r, uncached);
            }
        }
    }
    (best.1, best.2)
}

/// Pushes the engine's next wake-up unless an earlier one is already queued.
fn schedule(
    heap: &mut BinaryHeap<Reverse<(Duration, u64, Event)>>,
    push: &mut impl FnMut(&mut BinaryHeap<Reverse<(Duration, u64, Event)>>, Duration, Event),
    engine: &Engine,
    scheduled: &mut Option<Duration>,
    r: usize,
) {
    if let Some(next) = engine.next_event_time() {
        if scheduled.is_none_or(|s| next < s) {
            *scheduled = Some(next);
            push(heap, next, Event::EngineWake(r));
        }
    }
}

/// What a gossip round brings a node: every replica's engine load, queued prefill and summary.
fn refresh(
    view: &mut View,
    engines: &[Engine],
    models: &[CacheModel],
    pending: &[u64],
    now: Duration,
) {
    for (r, engine) in engines.iter().enumerate() {
        let st = engine.stats();
        view.set_engine_load(
            r,
            st.waiting as u32,
            st.running as u32,
            st.kv_usage as f32,
            pending[r],
        );
        let fresh = models[r].summary();
        let stale = view
            .replica(r)
            .and_then(|x| x.summary.as_ref())
            .is_none_or(|s| s.epoch() != fresh.epoch() || s.seq() != fresh.seq());
        if stale {
            view.set_summary(r, fresh.clone());
        }
    }
    view.expire_overlay(now);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::{trace, workload};
    use std::path::Path;

    fn conversation() -> Vec<WorkloadRequest> {
        workload::from_trace(
            &trace::load(
                &Path::new(env!("CARGO_MANIFEST_DIR")).join("data/traces/conversation_trace.jsonl"),
            )
            .unwrap(),
            true,
        )
    }

    fn small(policy: PolicyKind) -> SimConfig {
        SimConfig {
            policy,
            max_requests: Some(1000),
            arrival_speedup: 2.0,
            ..Default::default()
        }
    }

    #[test]
    fn same_seed_same_report() {
        let t = conversation();
        let a = run(&t, &small(PolicyKind::P2cCache)).unwrap();
        let b = run(&t, &small(PolicyKind::P2cCache)).unwrap();
        assert_eq!(
            serde_json::to_string(&a).unwrap(),
            serde_json::to_string(&b).unwrap()
        );
        assert_eq!(a.requests, 1000);
        assert_eq!(a.errors, 0);
        assert_eq!(a.ttft.count, 1000);
    }

    #[test]
    fn p2c_cache_near_the_oracle_and_faster_than_round_robin() {
        let t = conversation();
        let p2c = run(&t, &small(PolicyKind::P2cCache)).unwrap();
        let rr = run(&t, &small(PolicyKind::RoundRobin)).unwrap();
        let oracle = run(
            &t,
            &SimConfig {
                oracle: true,
                ..small(PolicyKind::P2cCache)
            },
        )
        .unwrap();
        assert!(
            p2c.cached_tokens as f64 >= 0.9 * oracle.cached_tokens as f64,
            "p2c-cache {} vs oracle {} hit tokens",
            p2c.cached_tokens,
            oracle.cached_tokens
        );
        assert!(
            p2c.ttft.mean < rr.ttft.mean,
            "mean TTFT p2c-cache {} vs round-robin {}",
            p2c.ttft.mean,
            rr.ttft.mean
        );
        assert!(p2c.hit_token_ratio > rr.hit_token_ratio);
    }

    /// The agent family at `rate` with `runs` open runs, p2c-cache against round-robin.
    fn agent_overload(runs: usize, rate: f64, requests: usize, nodes: usize, replicas: usize) {
        let w = workload::agent(
            &workload::AgentParams {
                concurrent_runs: runs,
                ..Default::default()
            },
            &workload::GenParams {
                rate,
                requests,
                seed: 1,
            },
        )
        .unwrap();
        let cfg = |policy| SimConfig {
            policy,
            nodes,
            replicas,
            oracle: false,
            ..Default::default()
        };
        let p2c = run(&w, &cfg(PolicyKind::P2cCache)).unwrap();
        let rr = run(&w, &cfg(PolicyKind::RoundRobin)).unwrap();
        assert!(rr.ttft.mean > 2.0, "not overloaded: {}", rr.ttft.mean);
        assert!(
            p2c.ttft.mean <= rr.ttft.mean && p2c.hit_token_ratio >= rr.hit_token_ratio,
            "p2c-cache {} s / {} hit vs round-robin {} s / {}",
            p2c.ttft.mean,
            p2c.hit_token_ratio,
            rr.ttft.mean,
            rr.hit_token_ratio
        );
    }

    /// Sustained overload (docs/benchmarks.md, "the agent family under overload"): agent runs
    /// arriving faster than the fleet can serve them, so every queue grows. Crediting blocks that
    /// are only promised by requests still queued at a replica piled the steps of a run onto it,
    /// where they missed each other, and p2c-cache lost to round-robin. Scaled down (3 replicas,
    /// 2 nodes, 450 requests; ~8 s in a debug build): p2c-cache 7.2 s vs round-robin 9.7 s.
    #[test]
    fn p2c_cache_no_worse_than_round_robin_under_overload() {
        agent_overload(3, 75.0, 450, 2, 3);
    }

    /// The full-size case of the finding: 8 replicas, 3 nodes, agent at 200 req/s, 3,000
    /// requests (before the fix 27.8 s vs 24.4 s; after, 23.7 s). ~15 s in a release build, so
    /// run it explicitly: `cargo test --release -- --ignored overload_full_size`.
    #[test]
    #[ignore = "slow in debug builds; run with --release -- --ignored"]
    fn p2c_cache_no_worse_than_round_robin_under_overload_full_size() {
        agent_overload(8, 200.0, 3000, 3, 8);
    }
}
