//! Planning pulls for one decision's candidates: `kv_fetch.mode = "priced"` prices a pull from
//! the longest holder for every candidate, `"reactive"` attaches one to the chosen replica after
//! the decision. The cost of a pull and the link table are `kv_fetch.rs`; the router calls these
//! between the candidates' costs and the policy.

use super::kv_fetch::{longest_holder, KvFetchConfig, KvFetchPlan};
use super::policy::Candidate;
use super::view::View;

/// Prices a fetch for every candidate (`mode = "priced"`): where pulling the longest holder's
/// run is predicted cheaper than recomputing it, the candidate's recompute shrinks
/// (`prefill_s`) and its cost takes the transfer instead;
/// `plans[j]` names the pull for candidate `j`. `plans` is cleared and refilled, aligned with
/// `candidates`.
pub fn price(
    cfg: &KvFetchConfig,
    w_load_s: f64,
    view: &View,
    candidates: &mut [Candidate],
    plans: &mut Vec<Option<KvFetchPlan>>,
    prompt_tokens: u64,
) {
    plans.clear();
    plans.resize(candidates.len(), None);
    let tpb = u64::from(view.tokens_per_block);
    let Some((h, held)) = longest_holder(candidates.iter().map(|c| (c.hit_blocks, c.queue_s)))
    else {
        return;
    };
    let source_index = candidates[h].replica;
    let Some(source) = view.replica(source_index) else {
        return;
    };
    // Never more than the prompt: its last block may be partial, and an engine always
    // recomputes at least the last token.
    let source_tokens = (u64::from(held) * tpb).min(prompt_tokens.saturating_sub(1));
    for (c, plan) in candidates.iter_mut().zip(plans.iter_mut()) {
        let own_tokens = u64::from(c.hit_blocks) * tpb;
        if c.replica == source_index || source_tokens < own_tokens + cfg.min_tokens {
            continue;
        }
        let Some(target) = view.replica(c.replica) else {
            continue;
        };
        let moved = source_tokens - own_tokens;
        let Some(transfer_s) = cfg.transfer_s(&target.info, source, moved, w_load_s) else {
            continue;
        };
        let rate = target.info.prefill_tokens_per_s.max(1.0);
        let prefill_s = prompt_tokens.saturating_sub(source_tokens) as f64 / rate;
        // Against the candidate's own prefill (its hit credited by tier, so an offloaded hit
        // the fetch would supersede is compared at its load-time worth).
        if prefill_s + transfer_s >= c.prefill_s {
            continue;
        }
        // Its hit stays its own: the policy's longest-hit choice (A) is still the holder, and a
        // pull only makes this candidate cheaper as the second choice. Counting the pulled run
        // as held made every hint taker tie for the longest hit, so A became the cheapest
        // replica on every node at once (the herd p2c-cache's draw exists to avoid).
        c.cost_s = c.queue_s + prefill_s + transfer_s;
        c.prefill_s = prefill_s;
        *plan = Some(KvFetchPlan {
            source: source_index,
            from_tokens: own_tokens,
            tokens: source_tokens,
            predicted_s: transfer_s,
            format: target.info.kv_load.map(|l| l.hints).unwrap_or_default(),
        });
    }
}

/// The pull `mode = "reactive"` attaches after the decision: from the longest holder to the
/// chosen candidate `chosen`, whenever the holder has at least `min_tokens` more and the chosen
/// replica takes hints, whatever it costs.
pub fn reactive(
    cfg: &KvFetchConfig,
    w_load_s: f64,
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
    let transfer_s = cfg.transfer_s(&target.info, source, source_tokens - own_tokens, w_load_s)?;
    Some(KvFetchPlan {
        source: candidates[h].replica,
        from_tokens: own_tokens,
        tokens: source_tokens,
        predicted_s: transfer_s,
        format: target.info.kv_load.map(|l| l.hints).unwrap_or_default(),
    })
}
