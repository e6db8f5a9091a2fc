//! Planning pulls for one decision's candidates: `kv_fetch.mode = "priced"` prices a pull from
//! the longest *settled* holder for every candidate, `"reactive"` attaches one to the chosen
//! replica after the decision. The cost of a pull and the link table are `kv_fetch.rs`; the
//! router calls these between the candidates' costs and the policy.
//!
//! A priced pull's source must hold the blocks now, not by prediction
//! ([`View::hit_settled`]: its summary, or overlay blocks a first byte confirmed). The simulator
//! showed why (issue #37): on a burst of a new 8,192-token prefix, 4 of 6 planned pulls named
//! a replica whose routed request was still computing the prefix (its overlay predicted the
//! blocks ready, its engine had none), so the target recomputed the whole prompt after being
//! chosen for a cheap pull, and the requests routed behind it queued.

use std::time::Duration;

use super::cost::PrefillPrice;
use super::keys::BlockKey;
use super::kv_fetch::{longest_holder, KvFetchConfig, KvFetchPlan, PullSource};
use super::policy::Candidate;
use super::view::View;

/// The candidate holding the longest run of `keys` *now* ([`View::hit_settled`]), at least
/// `min_blocks`, ties to the least queued: `(candidate index, settled blocks)`. A candidate's
/// believed hit bounds its settled one, so only candidates that could be a source and beat the
/// best so far are searched (usually one: a shared system prompt shorter than `min_blocks`
/// makes no replica a source).
pub fn settled_holder(
    view: &View,
    candidates: &[Candidate],
    (keys, now): (&[BlockKey], Duration),
    min_blocks: u32,
) -> Option<(usize, u32)> {
    let min_blocks = min_blocks.max(1);
    let mut best: Option<(usize, u32, f64)> = None;
    for (j, c) in candidates.iter().enumerate() {
        let bound = c.hit_blocks;
        if bound < min_blocks
            || best.is_some_and(|(_, b, q)| bound < b || (bound == b && c.queue_s >= q))
        {
            continue;
        }
        let held = u32::try_from(view.hit_settled(c.replica, keys, now)).unwrap_or(u32::MAX);
        if held < min_blocks {
            continue;
        }
        match best {
            Some((_, b, q)) if held < b || (held == b && c.queue_s >= q) => {}
            _ => best = Some((j, held, c.queue_s)),
        }
    }
    best.map(|(j, b, _)| (j, b))
}

/// Prices a fetch for every candidate (`mode = "priced"`): where pulling the longest settled
/// holder's run ([`settled_holder`]) is predicted cheaper than recomputing it, `plans[j]` names
/// the pull for candidate `j`; where it is also sooner than the holder serving the request
/// itself ([`source_serves_s`]), the candidate's recompute shrinks (`prefill_s`) and its cost
/// takes the transfer instead, so the decision weighs it. `plans` is cleared and refilled,
/// aligned with `candidates`.
pub fn price(
    cfg: &KvFetchConfig,
    view: &View,
    candidates: &mut [Candidate],
    plans: &mut Vec<Option<KvFetchPlan>>,
    (keys, prompt_tokens, now): (&[BlockKey], u64, Duration),
) {
    plans.clear();
    plans.resize(candidates.len(), None);
    let tpb = u64::from(view.tokens_per_block);
    let min_blocks = u32::try_from(cfg.min_tokens.div_ceil(tpb.max(1))).unwrap_or(u32::MAX);
    let Some((h, held)) = settled_holder(view, candidates, (keys, now), min_blocks) else {
        return;
    };
    let source_index = candidates[h].replica;
    let Some(source) = view.replica(source_index) else {
        return;
    };
    // Never more than the prompt: its last block may be partial, and an engine always
    // recomputes at least the last token.
    let source_tokens = (u64::from(held) * tpb).min(prompt_tokens.saturating_sub(1));
    let from = PullSource::of(source);
    let by_source_s = source_serves_s(&candidates[h], from.step_s);
    for (c, plan) in candidates.iter_mut().zip(plans.iter_mut()) {
        let own_tokens = u64::from(c.hit_blocks) * tpb;
        if c.replica == source_index || source_tokens < own_tokens + cfg.min_tokens {
            continue;
        }
        let Some(target) = view.replica(c.replica) else {
            continue;
        };
        let moved = source_tokens - own_tokens;
        let Some(transfer_s) = cfg.transfer_from(&target.info, &from, moved) else {
            continue;
        };
        // The rest is computed after the pulled context and pays attention over it, as every
        // candidate's own prefill is priced (`cost::PrefillPrice`): priced per token alone, a
        // pull under a long prompt looked a second cheaper than the holder serving it (agentic,
        // 57k tokens pulled, 22k computed: predicted 0.99 s, took 2.18; the holder 1.58).
        let prefill_s = PrefillPrice::of(&target.info).work_s(
            source_tokens as f64,
            prompt_tokens.saturating_sub(source_tokens) as f64,
        );
        // Against the candidate's own prefill (its hit credited by tier, so an offloaded hit
        // the fetch would supersede is compared at its load-time worth).
        if prefill_s + transfer_s >= c.prefill_s {
            continue;
        }
        // A pull waits for the source's step; so would the request at the source itself, behind
        // only its queued prefill. Where that is as soon, the pull must not draw the request
        // off its holder: the cost model's decode share (`w_load × outstanding`) makes a merely
        // decoding holder look tens of ms away, and a pull priced against that lost (issue
        // #37, burst seed 2: a 2,048-token pull from a holder with 7 decoding requests, 0.082 s
        // to first token where the holder took 0.011). The decision is then made as without
        // pulls; should the policy still pick this candidate (for load), it pulls rather than
        // recomputes.
        let pulled_s = c.queue_s + prefill_s + transfer_s;
        if pulled_s < by_source_s {
            // Its hit stays its own: the policy's longest-hit choice (A) is still the holder,
            // and a pull only makes this candidate cheaper as the second choice. Counting the
            // pulled run as held made every hint taker tie for the longest hit, so A became the
            // cheapest replica on every node at once (the herd p2c-cache's draw exists to avoid).
            c.cost_s = pulled_s;
            c.prefill_s = prefill_s;
        }
        *plan = Some(KvFetchPlan {
            source: source_index,
            offer_key: None,
            from_tokens: own_tokens,
            tokens: source_tokens,
            predicted_s: transfer_s,
            format: target.info.kv_load.map(|l| l.hints).unwrap_or_default(),
        });
    }
}

/// Seconds to first token were the request served by the source itself, priced as a pull from
/// it is: behind its queued prefill (`prefill_queue_s`) and its current step (`step_s`,
/// [`super::kv_fetch::source_step_s`]), then its own prefill of the rest. Not its cost: that
/// adds the cost model's decode share, which a pull's wait for one step does not pay either, so
/// comparing a pull against it would favour pulls from holders that are only decoding.
fn source_serves_s(source: &Candidate, step_s: f64) -> f64 {
    source.prefill_queue_s.max(0.0) + step_s + source.prefill_s.max(0.0)
}

/// The pull `mode = "reactive"` attaches after the decision: from the longest holder to the
/// chosen candidate `chosen`, whenever the holder has at least `min_tokens` more and the chosen
/// replica takes hints, whatever it costs.
pub fn reactive(
    cfg: &KvFetchConfig,
    view: &View,
    candidates: &[Candidate],
    chosen: usize,
    prompt_tokens: u64,
) -> Option<KvFetchPlan> {
    let tpb = u64::from(view.tokens_per_block);
    let (h, held) = longest_holder(candidates.iter().map(|c| (c.hit_blocks, c.queue_s)))?;
    let c = candidates.get(chosen)?;
    let source_tokens = (u64::from(held) * tpb).min(prompt_tokens.saturating_sub(1));
    let own_tokens = u64::from(c.hit_blocks) * tpb;
    if h == chosen || source_tokens < own_tokens + cfg.min_tokens {
        return None;
    }
    let source = view.replica(candidates[h].replica)?;
    let target = view.replica(c.replica)?;
    let transfer_s = cfg.transfer_s(&target.info, source, source_tokens - own_tokens)?;
    Some(KvFetchPlan {
        source: candidates[h].replica,
        offer_key: None,
        from_tokens: own_tokens,
        tokens: source_tokens,
        predicted_s: transfer_s,
        format: target.info.kv_load.map(|l| l.hints).unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::kv_fetch::FetchMode;
    use crate::core::kv_load::{KvHintFormat, KvLoad};
    use crate::core::view::testing::info;
    use crate::core::view::ReplicaInfo;

    const NOW: Duration = Duration::from_secs(100);

    /// A candidate at `replica` holding `hit_blocks`, with `in_flight` requests outstanding,
    /// queued `(queue_s, prefill_queue_s)` and its own prefill `prefill_s`, priced as the sum.
    fn candidate(
        replica: usize,
        hit_blocks: u32,
        in_flight: u32,
        (queue_s, prefill_queue_s): (f64, f64),
        prefill_s: f64,
    ) -> Candidate {
        Candidate {
            replica,
            seed: replica as u64,
            hit_blocks,
            credited_blocks: f64::from(hit_blocks),
            outstanding: in_flight,
            in_flight,
            queue_s,
            prefill_queue_s,
            cost_s: queue_s + prefill_s,
            prefill_s,
            cache_fill: 0.0,
        }
    }

    /// An 8,192-token prompt; replica `h` was routed it (its overlay predicts the blocks ready
    /// a second ago) and queues 10 s (decoding: its steps are short); `n` is idle, in the same
    /// zone, taking hints.
    fn fleet() -> (View, Vec<BlockKey>, Vec<Candidate>) {
        let keys: Vec<BlockKey> = (1..=512).map(BlockKey).collect();
        let mut v = View::new("eu", 16);
        let h = v.upsert(ReplicaInfo {
            zone: "z1".into(),
            ..info("holder", "eu")
        });
        let n = v.upsert(ReplicaInfo {
            zone: "z1".into(),
            kv_load: Some(KvLoad {
                hints: KvHintFormat::VllmEnvelope,
                ..KvLoad::default()
            }),
            ..info("neighbour", "eu")
        });
        v.record_routed_ready(
            h,
            &keys,
            NOW - Duration::from_secs(2),
            Duration::from_secs(1),
        );
        let rate = 50_000.0;
        let at = |replica, hit_blocks: u32, queue_s: f64| {
            let prefill_s = (8192.0 - f64::from(hit_blocks) * 16.0) / rate;
            candidate(replica, hit_blocks, 1, (queue_s, queue_s), prefill_s)
        };
        let c = vec![at(h, 512, 10.0), at(n, 0, 0.0)];
        (v, keys, c)
    }

    /// A holder only predicted to hold the prefix (its routed request may still be computing
    /// it) is no source: the neighbour would pull nothing and recompute the whole prompt after
    /// being chosen for a cheap pull (issue #37's burst: 4 of 6 pulls). Once its first byte
    /// confirms the blocks, it is.
    #[test]
    fn a_holder_still_computing_the_prefix_is_no_source() {
        let cfg = KvFetchConfig {
            mode: FetchMode::Priced,
            ..KvFetchConfig::default()
        };
        let (mut v, keys, mut c) = fleet();
        let mut plans = Vec::new();
        price(&cfg, &v, &mut c, &mut plans, (&keys, 8192, NOW));
        assert_eq!(plans, vec![None, None]);
        assert_eq!(settled_holder(&v, &c, (&keys, NOW), 1), None);
        v.prefill_done(0, &keys, NOW - Duration::from_millis(500));
        let (_, _, mut c) = fleet();
        price(&cfg, &v, &mut c, &mut plans, (&keys, 8192, NOW));
        let plan = plans[1].expect("the neighbour pulls from the confirmed holder");
        assert_eq!((plan.source, plan.from_tokens, plan.tokens), (0, 0, 8191));
        assert!(c[1].cost_s < 0.1, "{}", c[1].cost_s);
    }

    /// A holder that is only decoding (7 requests, no queued prefill) serves the request in one
    /// step; the cost model's decode share prices it 35 ms away, and a pull to an idle
    /// neighbour looked 4 ms cheaper than that and lost 70 ms (issue #37, burst seed 2). Such a
    /// pull does not lower the neighbour's cost (the decision is made as without pulls); once
    /// the holder has prefill queued, it does.
    #[test]
    fn a_pull_is_no_cheaper_than_a_holder_that_would_serve_the_request_in_its_next_step() {
        let cfg = KvFetchConfig {
            mode: FetchMode::Priced,
            ..KvFetchConfig::default()
        };
        let (mut v, keys, _) = fleet();
        v.prefill_done(0, &keys, NOW - Duration::from_millis(500));
        v.replica_mut(0).unwrap().load.running = 7;
        let prompt = 8192 + 94;
        let rate = 50_000.0;
        let decoding = |queued_s: f64| {
            let prefill_s = (prompt - 8191) as f64 / rate;
            let queue_s = queued_s + 0.005 * 7.0;
            candidate(0, 512, 7, (queue_s, queued_s), prefill_s)
        };
        let idle = candidate(1, 0, 0, (0.0, 0.0), prompt as f64 / rate);
        let mut plans = Vec::new();
        let mut c = vec![decoding(0.0), idle];
        price(&cfg, &v, &mut c, &mut plans, (&keys, prompt, NOW));
        assert_eq!(
            c[1].cost_s,
            prompt as f64 / rate,
            "the holder serves it in its next step: the neighbour is priced as recomputing"
        );
        // Should the policy pick the neighbour anyway (for load), it pulls.
        assert_eq!(plans[0], None);
        assert_eq!(plans[1].map(|p| p.source), Some(0));
        // With 2,000 tokens (40 ms) of prefill queued at the holder, the pull pays.
        v.replica_mut(0).unwrap().load.queued_prefill_tokens = 2_000;
        let mut c = vec![decoding(0.04), idle];
        price(&cfg, &v, &mut c, &mut plans, (&keys, prompt, NOW));
        assert_eq!(plans[1].map(|p| p.source), Some(0));
        assert!(c[1].cost_s < 0.08, "priced with the pull: {}", c[1].cost_s);
    }

    /// A pull under a long prompt: the holder has 57,344 tokens of a 79,344-token prompt, the
    /// idle neighbour nothing. The 22,000 tokens left are computed after the pulled context and
    /// pay attention over it (1.57 s at the default price, 0.44 s per token alone), wherever
    /// they are computed. So the pull (0.15 s at 50 GB/s) is sooner only where the holder's
    /// queue is longer than it: with 0.05 s queued the neighbour stays priced as recomputing
    /// (per token alone the pull read 0.59 s against the holder's 1.62 and drew the request);
    /// with 1 s queued it pulls, priced with the attention.
    #[test]
    fn the_rest_after_a_pull_pays_attention_over_the_pulled_context() {
        let cfg = KvFetchConfig {
            mode: FetchMode::Priced,
            ..KvFetchConfig::default()
        };
        let (mut v, _, _) = fleet();
        let held = 3_584u32;
        let keys: Vec<BlockKey> = (1..=u64::from(held)).map(BlockKey).collect();
        v.record_routed_ready(
            0,
            &keys,
            NOW - Duration::from_secs(2),
            Duration::from_secs(1),
        );
        v.prefill_done(0, &keys, NOW - Duration::from_millis(500));
        let (cached, prompt) = (u64::from(held) * 16, u64::from(held) * 16 + 22_000);
        let price_of = PrefillPrice::of(v.replica(0).map(|r| &r.info).unwrap());
        let rest_s = price_of.work_s(cached as f64, 22_000.0);
        let whole_s = price_of.work_s(0.0, prompt as f64);
        assert!(rest_s > 1.5 && whole_s > 3.0, "{rest_s} {whole_s}");
        let fleet_at = |holder_queue_s: f64| {
            let holder = candidate(0, held, 1, (holder_queue_s, holder_queue_s), rest_s);
            vec![holder, candidate(1, 0, 0, (0.0, 0.0), whole_s)]
        };
        let mut plans = Vec::new();
        let mut c = fleet_at(0.05);
        price(&cfg, &v, &mut c, &mut plans, (&keys, prompt, NOW));
        assert_eq!(
            c[1].cost_s, whole_s,
            "the holder answers sooner than the pull"
        );
        assert_eq!(
            plans[1].map(|p| p.source),
            Some(0),
            "picked for load, it pulls"
        );
        let mut c = fleet_at(1.0);
        price(&cfg, &v, &mut c, &mut plans, (&keys, prompt, NOW));
        let transfer_s = plans[1].map_or(f64::NAN, |p| p.predicted_s);
        assert!(transfer_s > 0.1 && transfer_s < 0.2, "{transfer_s}");
        assert!(
            (c[1].cost_s - (transfer_s + rest_s)).abs() < 1e-9,
            "{}",
            c[1].cost_s
        );
    }
}
