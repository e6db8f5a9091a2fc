//! p2c-cache, the default: two choices with a cache score.
//!
//! Candidate A is the replica with the longest hit, credited by tier (a block on GPU counts more
//! than one offloaded to CPU or disk); among near-ties, the cheapest. Candidate B is a *different*
//! replica drawn at random, weighted toward low predicted cost (so toward idle replicas and those
//! holding part of the prompt). The request goes to whichever has the lower predicted cost
//! (queued work plus uncached prefill, in seconds), except that B pays for the prefill it adds
//! over A in proportion to its own prefill backlog (`backlog_weight_per_s`). So:
//! - a warm, idle holder wins (its prefill is short);
//! - a hot prefix whose holder is swamped spills to an idle B, which then holds the prefix too,
//!   and later requests spread between the two (near-ties go to the less loaded);
//! - when B is busy too, recomputing the prefix there spends prefill the fleet is short of, so
//!   the holder keeps the request unless its own queue outweighs that (see the field);
//! - optionally (`recompute_charge_per_s`, off by default), when the fleet as a whole has
//!   prefill queued, B pays again for its recomputation in proportion: a follow-up leaves its
//!   holder only when that holder is far deeper in queue than the rest, as sglang-router's
//!   imbalance threshold does (issue #38: more hits on the Mooncake window, but the agentic
//!   sessions regressed);
//! - a holder of the *whole* prompt (an RL rollout's siblings, a resent prompt) keeps it unless
//!   B is sooner on the prefill side too: the siblings' own decodes do not split the group
//!   ([`P2cCache`]'s `b_answers_sooner`);
//! - when B's cache is full, its copy of the prefix evicts other conversations' blocks, so B
//!   pays for its recomputation again in proportion (`evict_charge`): on a fleet whose working set
//!   overflows its KV, follow-ups stay with their holders unless those are far deeper in queue;
//!   where the caches have room, spilling stays as cheap as before (issue #38);
//! - a *hot* prefix (held by two or more replicas, each with twice the candidates' mean
//!   outstanding requests) gets one more holder sooner: B pays only a quarter of its copy's
//!   prefill (`hot_copy_share`), since the holders' excess load is paid again by each of the
//!   prefix's later requests and the copy only once;
//! - many routers with the same stale view do not all pick the same B, so they do not herd;
//! - except that when A is clearly dearer (`escape_margin_s`) than a nearly idle replica
//!   (`escape_max_queue_s`), B is that replica rather than a draw: the draw would find it
//!   little more than one time in N−1, and a nearly idle replica is where a brief herd does no
//!   harm;
//! - with no hit anywhere, it is plain power-of-two-choices on cost.
//!
//! Both refinements were measured in `kvmesh sim` over the trace and six families, three seeds
//! (docs/benchmarks-notebook.md, "The default policy"): the cheapest near-tie instead of a random one
//! took chat from 0.078 to 0.071 s mean TTFT and rag from 1.81 to 1.62 s; the backlog charge
//! took rag (overloaded) to 1.01 s with p99 5.4 → 1.7 s, system-prompt to chwbl's level.
//!
//! The backlog is B's *queued prefill* ([`Candidate::prefill_queue_s`]), not its whole queue
//! estimate: the requests a recomputation delays are those waiting for their own prefill behind
//! it, while the decoding batch (the `w_load × outstanding` part of `queue_s`) only slows by a
//! step's share. Charging by the whole estimate made B dear on every replica with a large
//! decode batch, so a holder with a passing prefill queue kept its sessions' turns: over ten
//! seeds chat's p99 was 0.243 s against cache-argmin's 0.194 (9 seeds of 10 behind); charged
//! by the prefill backlog it is 0.198, and agent's 0.364 → 0.331 (cache-argmin 0.321; all before
//! peer tips carried a ladder, with which chat reads 0.203 against 0.193 and agent 0.333
//! against 0.318: docs/benchmarks-notebook.md, "Ten seeds").

use rand::rngs::SmallRng;
use rand::Rng;

use super::kind::PolicyKind;
use super::pick::{
    draw_from_weights, draw_toward_low_cost, low_cost_weight, Candidate, Pick, Policy, PolicyInput,
    Reason,
};

/// Two choices with a cache score.
#[derive(Debug)]
pub struct P2cCache {
    /// Hits within this fraction of the longest count as ties for A. Default 1/16.
    pub tie_fraction: f64,
    /// Seconds charged to B per second of prefill it adds over A, per second of B's queued
    /// prefill. Default 32: a second of queued prefill is about 32 requests' (~30 ms each for
    /// an 8B model on an H100), each of which the added prefill delays. At 0 the charge is off
    /// (rag, overloaded, then reads 1.77 s mean TTFT against 1.23 s); at 8 or 128 the five-seed
    /// means of every family stay within noise of 32's, except rag (1.36 s at 8). (Measured
    /// before peer tips carried a ladder.)
    pub backlog_weight_per_s: f64,
    /// B is the cheapest candidate, not a draw, when A's predicted cost is more than this many
    /// seconds above it (and that candidate is nearly idle, see `escape_max_queue_s`). Default
    /// 0.05. The draw's weights are nearly flat when every cost carries the same large decode term
    /// (`w_load × outstanding`: ~1 s at 200 req/s on 8 replicas), so it finds the one replica that
    /// would answer at once little more than one time in N−1; this is what kept chat's p99 5.6 %
    /// behind cache-argmin's over ten seeds (docs/benchmarks-notebook.md, "Round 10"). At 0.03 or 0.07 s the
    /// ten-seed figures are within noise of 0.05's; at 0.1 s chat's p99 is behind again (+3.3 %).
    /// Infinite turns the escape off, as it is on a node that does not share load with its region's
    /// other nodes (`RouterConfig::shared_load`): with views a scrape old, six nodes all escaped to
    /// the same replica (chat +20 %, system-prompt +27 % mean TTFT over five seeds, `kvmesh sim
    /// --nodes 6 --load-share-ms 0`).
    pub escape_margin_s: f64,
    /// The escape applies only while the cheapest candidate has at most this many seconds of
    /// queued prefill. Default 0.1. Routers sharing a stale view would all escape to the same
    /// replica; one nearly idle takes the burst, and its queue (which counts this node's own
    /// routes at once, and the region's within a load-sharing interval) soon closes the
    /// escape. Without the bound, rag (overloaded: ~1 s queues everywhere) herded onto the
    /// cheapest replica: mean TTFT +3.2 %, p99 +11.5 % over ten seeds.
    pub escape_max_queue_s: f64,
    /// Seconds charged to B per second of prefill it adds over A, per second of prefill queued on
    /// the average candidate (the fleet's backlog), on top of B's own predicted cost, which counts
    /// that prefill once, as this request's wait. The node's `recompute_charge_per_s` key sets it.
    /// Default 0 (off): at 12 the Mooncake window's hit ratio rose, but the agentic sessions
    /// regressed (below), so it stays off until that is understood. At 12, on a fleet with half a
    /// second of prefill queued per replica, B must answer sooner by seven times the prefill it
    /// would recompute; on an idle fleet the charge is nothing. Why charge it again: leaving the
    /// holder spends capacity the TTFT comparison does not see — when every replica has prefill
    /// queued, some request waits for each second of it, and the copy of the prefix evicts other
    /// conversations' blocks from B's cache, whose follow-ups then recompute too. The backlog
    /// charge above counts only those waiting at B now, and nothing when B is idle, as it is in
    /// most escapes. Measured (issue #38) in `kvmesh sim` on the Mooncake window (1,200 requests at
    /// 4×, 1 node, 8 replicas, seeds 2–5): without it the fleet's hit ratio was 0.132 (12 % of the
    /// hit tokens on offer given up to load), mean / p99 TTFT 1.32 / 8.92 s; at 8 it is 0.142, 1.30
    /// / 8.32 s, at 12 0.140, 1.29 / 8.37 s. Live through `scripts/peer-bench` (docs/peer-bench.md)
    /// the hit ratio went from 0.136 to 0.144–0.148 (sglang-router's 0.152–0.153 in the same
    /// command), mean and p99 TTFT still 0.24–0.70× sglang-router's; that fleet's backlog is
    /// shallower, so 12 acts there as a fixed charge of 4–5 would (a fixed 7 reached 0.151 in one
    /// run). A fixed charge (3: B must save 4× its recomputation on any fleet) cost the lightly
    /// loaded `agent` family 28 % mean TTFT in the sim; this one leaves the synthetic families
    /// within noise (seeds 1–3). But on the agentic sessions (`scripts/peer-bench --trace agentic
    /// --conversations 16 --speedup 8`, one run) kvmesh at 12 read 8153 / 6187 / 27931 ms, hit
    /// 0.665, 45 failed (first-byte waits on holders kept deep in 100k-token prefills), against
    /// 2605 / 330 / 14878 ms, 0.723 before (sglang-router: 4308 / 495 / 20973, 0.752, unchanged).
    /// Never leaving a holder for load (an infinite charge) cost 1.3× p99 TTFT on the trace. A
    /// backlog floor (an idle B paid ~2.6× its recomputation) did not move the live hit ratio
    /// (0.138 against 0.135).
    pub recompute_charge_per_s: f64,
    /// Seconds charged to B per second of prefill it adds over A, times the share of B's cache
    /// that is full ([`Candidate::cache_fill`], 0..=1): B pays again for the blocks its copy of
    /// the prefix would evict, which other conversations' follow-ups then recompute. Default
    /// [`DEFAULT_EVICT_CHARGE`]; the node's `evict_charge` key sets it. Why (issue #38): the
    /// Mooncake window's prompts hold 13.2 M distinct tokens against the eight replicas' 3.6 M
    /// of KV, so every replica evicts from the first quarter of the window on, and each
    /// follow-up sent off its holder for load both loses its own hit and overwrites another
    /// conversation's; sglang-router leaves a holder only past an imbalance of 64 requests. On
    /// the agentic sessions, whose working set fits, a B with room evicts nothing and pays
    /// nothing, so spilling a 100k-token turn off a swamped holder stays cheap — the difference
    /// the fleet-backlog charge (`recompute_charge_per_s`) could not see. At 0 it is off.
    pub evict_charge: f64,
    /// The share of its copy's prefill B pays when it would become one more holder of a *hot*
    /// prefix, 0..=1 (1: the rule is off). Hot: at least two replicas hold it (it has spilled
    /// once already) and each of them has at least `hot_load_ratio` times the candidates' mean
    /// outstanding requests (every request of the prefix lands on them). The copy's prefill is
    /// paid once; the holders' excess load is paid by each of their later requests, so one more
    /// holder pays back over the prefix's next requests, which the per-request comparison does
    /// not see. Default [`DEFAULT_HOT_COPY_SHARE`].
    pub hot_copy_share: f64,
    /// How many times the candidates' mean outstanding every holder of a prefix must have for it
    /// to count as hot (`hot_copy_share`). Default [`DEFAULT_HOT_LOAD_RATIO`].
    pub hot_load_ratio: f64,
    /// The draw's weights ([`low_cost_weight`]) of the current pick's candidates, by position
    /// (a reused buffer, not a setting): worked out in one pass of their own, which the
    /// compiler does two candidates an instruction, then read by the escape scan and the
    /// draw's walk, each of which worked every weight out again (a division among five
    /// instructions a candidate; `scripts/decision-instructions.sh`).
    pub(super) draw_weights: Vec<f64>,
}

/// [`P2cCache::hot_copy_share`]'s default.
pub const DEFAULT_HOT_COPY_SHARE: f64 = 0.25;
/// [`P2cCache::hot_load_ratio`]'s default.
pub const DEFAULT_HOT_LOAD_RATIO: f64 = 2.0;

/// [`P2cCache::evict_charge`]'s default: B must answer sooner by 8 times the prefill it would
/// recompute over the holder when its cache is full.
pub const DEFAULT_EVICT_CHARGE: f64 = 8.0;

impl Default for P2cCache {
    fn default() -> Self {
        P2cCache {
            tie_fraction: 1.0 / 16.0,
            backlog_weight_per_s: 32.0,
            escape_margin_s: 0.05,
            escape_max_queue_s: 0.1,
            recompute_charge_per_s: 0.0,
            evict_charge: DEFAULT_EVICT_CHARGE,
            hot_copy_share: DEFAULT_HOT_COPY_SHARE,
            hot_load_ratio: DEFAULT_HOT_LOAD_RATIO,
            draw_weights: Vec::new(),
        }
    }
}

impl P2cCache {
    /// Candidate A: the cheapest among those whose hit is within the tie margin of the longest,
    /// random among equal costs (reservoir sampling, no allocation).
    fn longest_hit(&self, c: &[Candidate], max_hit: f64, rng: &mut SmallRng) -> usize {
        // Whole blocks of margin, as when hits were integers.
        let floor = max_hit - (max_hit * self.tie_fraction).floor().min(max_hit);
        // `credited <= 0 || credited < floor` as one compare: with a positive floor the first
        // is implied by the second; otherwise the first alone decides, and for any number but
        // NaN `credited <= 0` is `credited <` the least positive double (NaN passes both ways).
        let bar = if floor > 0.0 {
            floor
        } else {
            f64::from_bits(1)
        };
        let mut chosen = 0;
        let mut best = f64::INFINITY;
        let mut seen = 0u32;
        for (i, x) in c.iter().enumerate() {
            if x.credited_blocks < bar || x.cost_s > best {
                continue;
            }
            if x.cost_s < best {
                best = x.cost_s;
                seen = 0;
            }
            seen += 1;
            if rng.random_range(0..seen) == 0 {
                chosen = i;
            }
        }
        chosen
    }

    /// The escape's B: the cheapest candidate other than A (random among equal costs), when A
    /// costs more than `escape_margin_s` above it and it has at most `escape_max_queue_s` of
    /// queued prefill. Also the total of the draw's weights without A
    /// ([`draw_toward_low_cost`]), summed on the same pass, for the draw when there is no escape
    /// (at 512 candidates a pass is about 8k instructions of a decision's ~100k).
    fn escape(
        &self,
        c: &[Candidate],
        weights: &[f64],
        a: usize,
        rng: &mut SmallRng,
    ) -> (Option<usize>, f64) {
        let scan = cheapest_but(c, weights, a, rng);
        let b = scan.b;
        let escaped = b != a
            && c[a].cost_s - c[b].cost_s > self.escape_margin_s
            && c[b].prefill_queue_s <= self.escape_max_queue_s;
        (escaped.then_some(b), scan.total)
    }

    /// B, weighed against A (`c[a]`): the escape's, else a draw toward low cost without A;
    /// `None` when nothing is left to draw.
    fn second_choice(&mut self, c: &[Candidate], a: usize, rng: &mut SmallRng) -> Option<usize> {
        if !self.escape_margin_s.is_finite() {
            return draw_toward_low_cost(c, Some(a), rng);
        }
        let mut weights = std::mem::take(&mut self.draw_weights);
        weights.clear();
        weights.extend(c.iter().map(low_cost_weight));
        let b = match self.escape(c, &weights, a, rng) {
            (Some(b), _) => Some(b),
            (None, total) => draw_from_weights(&weights, Some(a), total, rng),
        };
        self.draw_weights = weights;
        b
    }

    /// B's cost as weighed against A's (`c[b]`, `c[a]`): its predicted cost plus the charge for
    /// the prefill it would spend beyond A's, scaled by B's own prefill backlog, by how full
    /// B's cache is (what the copy evicts) and by the fleet's backlog (the candidates' mean
    /// queued prefill, worked out only when there is a charge).
    fn charged_cost(&self, c: &[Candidate], a: usize, b: usize) -> f64 {
        let extra_prefill_s = (c[b].prefill_s - c[a].prefill_s).max(0.0);
        if extra_prefill_s == 0.0 {
            return c[b].cost_s;
        }
        let mut per_s = self.backlog_weight_per_s * c[b].prefill_queue_s.max(0.0)
            + self.evict_charge * c[b].cache_fill.clamp(0.0, 1.0);
        if self.recompute_charge_per_s > 0.0 {
            // A pass over the candidates: only when the charge is on.
            per_s += self.recompute_charge_per_s * fleet_backlog_s(c);
        }
        c[b].cost_s + per_s * extra_prefill_s
    }

    /// Whether B (`c[b]`, charged for its recomputation) answers sooner than A. When A holds the
    /// whole prompt (in its cache, or computing it for a request just sent: an RL `n`-sample
    /// rollout's siblings, a resent prompt) and B would recompute part of it, B must be sooner
    /// on the prefill side alone as well, without either's decode term (`queue_s −
    /// prefill_queue_s`, the `w_load × outstanding` share): a sibling at A needs one step, which
    /// A's decoding batch lengthens by a fraction of a millisecond a sequence, not by `w_load`.
    /// Without this the siblings' own decodes pushed the later ones of a group off their holder
    /// to recompute the prompt elsewhere: on the rollout family (8 identical prompts within
    /// 100 ms; `kvmesh sim --workload rollout --nodes 1 --seed 1`) 122 of 250 groups were split,
    /// mean TTFT 0.044 s against sglang-threshold's 0.038 s, which kept every group on one
    /// replica (docs/benchmarks.md, "Policies, LMetric among them").
    fn b_answers_sooner(&self, c: &[Candidate], a: usize, b: usize, prompt_blocks: usize) -> bool {
        let charged = self.charged_cost(c, a, b);
        let whole_at_a = prompt_blocks > 0 && c[a].hit_blocks as usize >= prompt_blocks;
        if charged >= c[a].cost_s {
            return !whole_at_a && self.b_copies_a_hot_prefix(c, a, b, charged);
        }
        if !whole_at_a || c[b].prefill_s <= c[a].prefill_s {
            return true;
        }
        let decode_s = |x: &Candidate| (x.queue_s - x.prefill_queue_s).max(0.0);
        charged - decode_s(&c[b]) < c[a].cost_s - decode_s(&c[a])
    }
}

impl P2cCache {
    /// Whether B, which does not answer sooner than A on this request alone (`charged`: its
    /// charged cost), should take it anyway as one more holder of a hot prefix: charged only
    /// `hot_copy_share` of the prefill its copy adds over A, B answers sooner, and every holder
    /// of A's hit (within the tie margin, at least two) has `hot_load_ratio` times the
    /// candidates' mean outstanding. The pass over the candidates runs only when the discounted
    /// comparison favours B. Why (issue #38): on the tenants family the big tenant's 4,096-token
    /// system prompt (60 % of the requests) stayed on two holders on seeds 2, 3 and 5 (about 600
    /// requests each against 120–190 on the other six replicas), whose decoding batches slowed
    /// every one of its requests; a third holder costs one ~82 ms prefill, which the
    /// per-request comparison charges in full to the one request that pays it, and which the
    /// prefix's next hundreds of requests pay back.
    fn b_copies_a_hot_prefix(&self, c: &[Candidate], a: usize, b: usize, charged: f64) -> bool {
        if self.hot_copy_share.is_nan() || self.hot_copy_share >= 1.0 {
            return false;
        }
        let copy_s = (c[b].prefill_s - c[a].prefill_s).max(0.0);
        if charged - (1.0 - self.hot_copy_share.max(0.0)) * copy_s >= c[a].cost_s {
            return false;
        }
        let hit = c[a].credited_blocks;
        let floor = hit - (hit * self.tie_fraction).floor().min(hit);
        let (mut holders, mut least_held, mut total) = (0u32, u32::MAX, 0u64);
        for x in c {
            total += u64::from(x.outstanding);
            if x.credited_blocks > 0.0 && x.credited_blocks >= floor {
                holders += 1;
                least_held = least_held.min(x.outstanding);
            }
        }
        let mean = total as f64 / c.len() as f64;
        holders >= 2 && mean > 0.0 && f64::from(least_held) >= self.hot_load_ratio * mean
    }
}

/// The cheapest candidate but A (`c[a]`), random among equal costs, and the sum of the draw's
/// weights (`weights`, by position) without A: [`P2cCache::escape`]'s one pass.
fn cheapest_but(c: &[Candidate], weights: &[f64], a: usize, rng: &mut SmallRng) -> EscapeScan {
    let n = c.len().min(weights.len());
    let (c, weights) = (&c[..n], &weights[..n]);
    if n == 0 {
        return EscapeScan {
            b: 0,
            best_key: f64::INFINITY,
            ties: 0,
            total: 0.0,
        };
    }
    // `argmin_random_tie` with A out of the running (candidates' replicas are distinct,
    // so A is its position: its key infinite, its weight 0), and the draw's sum as
    // `Iterator::sum` makes it (from -0.0, in position order). A is visited in its place
    // rather than tested for at every position: the runs before and after it are plain.
    let weight0 = if a == 0 { 0.0 } else { weights[0] };
    let key0 = if a == 0 { f64::INFINITY } else { c[0].cost_s };
    let mut scan = EscapeScan {
        b: 0,
        best_key: key0,
        ties: 1,
        total: -0.0 + weight0,
    };
    // The first candidate started the argmin; then up to A, A itself, and the rest.
    let cut = a.clamp(1, n);
    scan.run(&c[1..cut], &weights[1..cut], 1, rng);
    if (1..n).contains(&a) {
        scan.visit(a, f64::INFINITY, 0.0, rng);
    }
    let rest = if a < n { (a + 1).max(1) } else { n };
    scan.run(&c[rest..], &weights[rest..], rest, rng);
    scan
}

/// [`P2cCache::escape`]'s pass: the argmin of the costs so far (random among ties, reservoir
/// style) and the sum of the draw's weights so far.
struct EscapeScan {
    /// The position of the cheapest so far.
    b: usize,
    /// Its key (its cost; infinite for A).
    best_key: f64,
    /// How many so far share that key.
    ties: u32,
    /// The draw's weights so far, summed in position order.
    total: f64,
}

impl EscapeScan {
    /// Visits position `i` with key `key` and draw weight `weight`.
    #[inline(always)]
    fn visit(&mut self, i: usize, key: f64, weight: f64, rng: &mut SmallRng) {
        self.total += weight;
        // One compare for the usual candidate, dearer than the best so far (`<=` is false
        // for a NaN on either side, as both `<` and `==` are): at 512 candidates the two
        // tests in a row were ~1.5k instructions a decision (`scripts/decision-instructions.sh`).
        if key <= self.best_key {
            if key < self.best_key {
                (self.b, self.best_key, self.ties) = (i, key, 1);
            } else {
                self.ties += 1;
                if rng.random_range(0..self.ties) == 0 {
                    self.b = i;
                }
            }
        }
    }

    /// Visits `run`, the candidates from position `first` on, none of them A, with their
    /// draw's weights `weights`.
    #[inline(always)]
    fn run(&mut self, run: &[Candidate], weights: &[f64], first: usize, rng: &mut SmallRng) {
        for (k, (x, &w)) in run.iter().zip(weights).enumerate() {
            self.visit(first + k, x.cost_s, w, rng);
        }
    }
}

/// The candidates' mean queued prefill, seconds (0 for none): how short of prefill capacity
/// the fleet is, as [`P2cCache::recompute_charge_per_s`] charges it.
fn fleet_backlog_s(c: &[Candidate]) -> f64 {
    if c.is_empty() {
        return 0.0;
    }
    c.iter().map(|x| x.prefill_queue_s.max(0.0)).sum::<f64>() / c.len() as f64
}

impl Policy for P2cCache {
    fn kind(&self) -> PolicyKind {
        PolicyKind::P2cCache
    }
    fn uses_cache(&self) -> bool {
        true
    }
    fn pick(&mut self, input: &PolicyInput<'_>, rng: &mut SmallRng) -> Pick {
        let c = input.candidates;
        if c.len() == 1 {
            return Pick {
                chosen: 0,
                runner_up: None,
                reason: Reason::OnlyCandidate,
            };
        }
        // `fold(0.0, f64::max)` as a compare: the same maximum (a NaN never is one), without the
        // NaN-aware min/max sequence per candidate.
        let mut max_hit = 0.0;
        for x in c {
            if x.credited_blocks > max_hit {
                max_hit = x.credited_blocks;
            }
        }
        let (a, no_hit) = if max_hit <= 0.0 {
            // No cache anywhere: both choices are load-weighted draws.
            (draw_toward_low_cost(c, None, rng).unwrap_or(0), true)
        } else {
            (self.longest_hit(c, max_hit, rng), false)
        };
        let Some(b) = self.second_choice(c, a, rng) else {
            return Pick {
                chosen: a,
                runner_up: None,
                reason: Reason::OnlyCandidate,
            };
        };
        let (chosen, other, reason) = if self.b_answers_sooner(c, a, b, input.keys.len()) {
            (
                b,
                a,
                if no_hit {
                    Reason::NoHit
                } else {
                    Reason::SecondChoice
                },
            )
        } else {
            (
                a,
                b,
                if no_hit {
                    Reason::NoHit
                } else {
                    Reason::LongestHit
                },
            )
        };
        Pick {
            chosen,
            runner_up: Some(other),
            reason,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    #[test]
    fn an_idle_holder_takes_its_prefix() {
        let c = [cand(0, 0, 0), cand(1, 100, 0), cand(2, 0, 0)];
        assert_eq!(
            histogram(&mut P2cCache::default(), &c, &keys(128), 100),
            vec![0, 100, 0]
        );
    }

    #[test]
    fn a_loaded_holder_shares_its_hot_prefix() {
        // The holder has 6 queued requests (~0.27 s of work); a cold replica needs 0.04 s of
        // prefill for the rest of the prompt: the request spills.
        let c = [cand(0, 120, 6), cand(1, 0, 0), cand(2, 0, 0), cand(3, 0, 0)];
        let h = histogram(&mut P2cCache::default(), &c, &keys(128), 300);
        assert_eq!(h[0], 0, "{h:?}");
        // Spread over the others, not herded on one.
        assert!(h[1..].iter().all(|n| *n > 60), "{h:?}");
        // When the others are busy too, recomputing the prefix there spends prefill the fleet is
        // short of: the holder keeps it while its queue is moderate...
        let c = [cand(0, 120, 6), cand(1, 0, 1), cand(2, 0, 2), cand(3, 0, 2)];
        let h = histogram(&mut P2cCache::default(), &c, &keys(128), 300);
        assert_eq!(h[0], 300, "{h:?}");
        // ... and spills, spread rather than herded, once its queue outweighs that.
        let c = [
            cand(0, 120, 24),
            cand(1, 0, 1),
            cand(2, 0, 1),
            cand(3, 0, 1),
        ];
        let h = histogram(&mut P2cCache::default(), &c, &keys(128), 300);
        assert!(h[0] < 150 && h[1..].iter().all(|n| *n > 20), "{h:?}");
        // Without the charges, the second case spills as plain costs say.
        let mut plain = P2cCache {
            backlog_weight_per_s: 0.0,
            recompute_charge_per_s: 0.0,
            ..P2cCache::default()
        };
        let c = [cand(0, 120, 6), cand(1, 0, 1), cand(2, 0, 2), cand(3, 0, 2)];
        assert_eq!(histogram(&mut plain, &c, &keys(128), 300)[0], 0);
        // Lightly loaded holder: still wins.
        let c = [cand(0, 120, 1), cand(1, 0, 0), cand(2, 0, 0)];
        assert_eq!(
            histogram(&mut P2cCache::default(), &c, &keys(128), 100)[0],
            100
        );
    }

    #[test]
    fn only_queued_prefill_makes_recomputing_on_b_dear() {
        // A holds the prompt (8k tokens) behind a prefill queue; B holds nothing and is
        // decoding a large batch, which slows its steps but queues no prefill.
        let holder = Candidate {
            queue_s: 2.2,
            prefill_queue_s: 0.8,
            cost_s: 2.2,
            prefill_s: 0.0,
            ..cand(0, 128, 100)
        };
        let decoding = Candidate {
            queue_s: 1.0,
            prefill_queue_s: 0.0,
            cost_s: 1.0 + 0.16,
            prefill_s: 0.16,
            ..cand(1, 0, 200)
        };
        // B is cheaper, even charged for its recomputation on a fleet with 0.4 s of prefill
        // queued per replica (1.93 s at 12), and delays no one's prefill: the request goes there.
        let c = [holder, decoding];
        let h = histogram(&mut P2cCache::default(), &c, &keys(128), 100);
        assert_eq!(h, vec![0, 100]);
        // The same B with a third of a second of prefill queued: its 0.16 s of recomputation
        // would hold up ~10 waiting prompts, so the holder keeps the request.
        let queued = Candidate {
            prefill_queue_s: 0.3,
            ..decoding
        };
        let c = [holder, queued];
        assert_eq!(
            histogram(&mut P2cCache::default(), &c, &keys(128), 100),
            vec![100, 0]
        );
    }

    /// Eight replicas each decoding a large batch (the same ~1 s decode term in every cost); the
    /// holder has three quarters of a second of prefill queued, six others a fifth, one none.
    fn busy_fleet(idle_queue_s: f64) -> Vec<Candidate> {
        let decoding = |replica, hit, prefill_queue_s: f64| {
            let prefill_s = if hit > 0 { 0.0 } else { 0.16 };
            let queue_s = 1.0 + prefill_queue_s;
            Candidate {
                queue_s,
                prefill_queue_s,
                prefill_s,
                cost_s: queue_s + prefill_s,
                ..cand(replica, hit, 150)
            }
        };
        let mut c = vec![decoding(0, 128, 0.75)];
        c.extend((1..7).map(|i| decoding(i, 0, 0.2)));
        c.push(decoding(7, 0, idle_queue_s));
        c
    }

    /// The holder (a second of queue, 0.05 s of prefill left), six replicas holding nothing with
    /// `others_queue_s` of prefill queued each, and one idle replica (0.2 s of prefill).
    fn fleet_with_one_idle(others_queue_s: f64) -> Vec<Candidate> {
        let stranger = |replica, queue_s: f64| Candidate {
            queue_s,
            prefill_queue_s: queue_s,
            prefill_s: 0.2,
            cost_s: queue_s + 0.2,
            ..cand(replica, 0, 0)
        };
        let mut c = vec![Candidate {
            queue_s: 1.0,
            prefill_queue_s: 1.0,
            prefill_s: 0.05,
            cost_s: 1.05,
            ..cand(0, 128, 20)
        }];
        c.extend((1..7).map(|i| stranger(i, others_queue_s)));
        c.push(stranger(7, 0.0));
        c
    }

    #[test]
    fn on_a_busy_fleet_an_idle_b_must_save_more_than_the_prefill_it_recomputes() {
        // Every replica but one has a second of prefill queued: by plain costs the idle one
        // answers 0.85 s sooner, but it recomputes 0.15 s of prompt the holder has cached,
        // charged 12 × 0.875 s (the fleet's mean backlog) per second: 1.78 s. The holder keeps it.
        let mut charged = P2cCache {
            recompute_charge_per_s: 12.0,
            ..P2cCache::default()
        };
        let busy = fleet_with_one_idle(1.0);
        let h = histogram(&mut charged, &busy, &keys(128), 100);
        assert_eq!(h[0], 100, "{h:?}");
        // On a nearly idle fleet the same recomputation costs hardly anyone: the idle replica
        // answers.
        let idle = fleet_with_one_idle(0.05);
        let h = histogram(&mut charged, &idle, &keys(128), 100);
        assert_eq!(h[7], 100, "{h:?}");
        // Without the charge, plain costs send it to the idle replica on the busy fleet too.
        let mut uncharged = P2cCache {
            recompute_charge_per_s: 0.0,
            ..P2cCache::default()
        };
        let h = histogram(&mut uncharged, &busy, &keys(128), 100);
        assert_eq!(h[7], 100, "{h:?}");
    }

    #[test]
    fn a_full_cache_must_save_more_than_the_blocks_its_copy_evicts() {
        // The holder is a second deep; the idle replica answers 0.85 s sooner but would recompute
        // 0.15 s of prompt the holder has cached. With room in its cache (an agentic fleet whose
        // working set fits) that costs nobody else: it goes there.
        let mut with_room = fleet_with_one_idle(0.05);
        with_room[7].cache_fill = 0.0;
        let h = histogram(&mut P2cCache::default(), &with_room, &keys(128), 100);
        assert_eq!(h[7], 100, "{h:?}");
        // Its cache full (a Mooncake fleet, 3.7× over its KV), the copy evicts another
        // conversation's blocks: charged 8 × 0.15 s, the holder keeps its follow-up...
        let mut full = with_room.clone();
        full.iter_mut().for_each(|x| x.cache_fill = 1.0);
        let h = histogram(&mut P2cCache::default(), &full, &keys(128), 100);
        assert_eq!(h[0], 100, "{h:?}");
        // ... as it did not before the charge ...
        let mut uncharged = P2cCache {
            evict_charge: 0.0,
            ..P2cCache::default()
        };
        let h = histogram(&mut uncharged, &full, &keys(128), 100);
        assert_eq!(h[7], 100, "{h:?}");
        // ... until the holder is deeper in queue than the charge: two seconds, and it spills.
        // (Its queue is prefill: a whole-prompt holder's decodes alone would not count.)
        full[0].queue_s = 2.0;
        full[0].prefill_queue_s = 2.0;
        full[0].cost_s = 2.05;
        let h = histogram(&mut P2cCache::default(), &full, &keys(128), 100);
        assert_eq!(h[7], 100, "{h:?}");
    }

    #[test]
    fn a_clearly_dearer_holder_gives_way_to_the_nearly_idle_replica() {
        // The idle replica answers in 1.16 s against the holder's 1.75 s (1.63 s when charged
        // 12 s/s for its recomputation). A draw weighted by `1/(0.01 + cost)²` barely tells 1.16 from 1.36 s:
        // it finds it about one time in five.
        let c = busy_fleet(0.0);
        let h = histogram(&mut P2cCache::default(), &c, &keys(128), 300);
        assert_eq!(h[7], 300, "{h:?}");
        let mut no_escape = P2cCache {
            escape_margin_s: f64::INFINITY,
            ..P2cCache::default()
        };
        let h = histogram(&mut no_escape, &c, &keys(128), 300);
        assert!(h[7] < 100 && h[0] > 200, "{h:?}");
    }

    #[test]
    fn the_escape_needs_a_nearly_idle_replica() {
        // The cheapest has 0.12 s of prefill queued (over `escape_max_queue_s`): routers sharing a
        // view must not all pile onto it, so B is a draw again and the holder mostly keeps it.
        let c = busy_fleet(0.12);
        let h = histogram(&mut P2cCache::default(), &c, &keys(128), 300);
        assert!(h[7] < 100 && h[0] > 200, "{h:?}");
        // Within the margin of the holder (0.05 s), no escape either.
        let mut c = busy_fleet(0.0);
        c[0].cost_s = c[7].cost_s + 0.04;
        let h = histogram(&mut P2cCache::default(), &c, &keys(128), 300);
        assert!(h[7] < 100, "{h:?}");
    }

    /// A candidate priced by the default cost model as the router prices one (`router.rs`): a
    /// 100,000-token prompt of which `cached` tokens are held, behind `queued` prefill tokens, on
    /// an 8B replica whose prefill attention is `attention_ms_per_pair`.
    fn priced(replica: usize, cached: u64, queued: u64, attention_ms_per_pair: f64) -> Candidate {
        use crate::core::cost::CostModel;
        use crate::core::view::{testing::info, ReplicaInfo, View};
        let mut view = View::new("eu", 64);
        let i = view.upsert(ReplicaInfo {
            prefill_attention_ms_per_pair: attention_ms_per_pair,
            ..info(&format!("r{replica}"), "eu")
        });
        let r = view.replica_mut(i).expect("just added");
        r.load.queued_prefill_tokens = queued;
        let r = view.replica(i).expect("just added");
        let cost = CostModel::default();
        let hit_blocks = (cached / 64) as u32;
        let (queue_s, prefill_s) = (cost.queue_s(r), cost.prefill_s(r, 100_000, cached as f64));
        Candidate {
            queue_s,
            prefill_queue_s: cost.prefill_queue_s(r),
            prefill_s,
            cost_s: queue_s + prefill_s,
            ..cand(replica, hit_blocks, 0)
        }
    }

    #[test]
    fn a_long_cached_prefix_stays_with_its_busy_holder_when_recomputing_it_costs_more() {
        // An agentic turn: 96,000 of its 100,000 tokens are held by a replica with 125,000
        // prefill tokens queued (2.5 s at 50,000 tokens/s); three others are idle and hold none.
        let fleet = |attention| {
            let mut c = vec![priced(0, 96_000, 125_000, attention)];
            c.extend((1..4).map(|i| priced(i, 0, 0, attention)));
            c
        };
        // Priced as the engine runs it, the holder answers in 2.5 + 0.08 s per token + 0.29 s of
        // attention over the cached context = 2.87 s; an idle replica recomputes the prompt in
        // 2 s + 3.75 s of attention = 5.75 s. The holder keeps it.
        let engine = fleet(crate::core::view::DEFAULT_PREFILL_ATTENTION_MS_PER_PAIR);
        assert!(
            engine[0].cost_s < 2.9 && engine[1].cost_s > 5.7,
            "{engine:?}"
        );
        let h = histogram(&mut P2cCache::default(), &engine, &keys(1563), 300);
        assert_eq!(h[0], 300, "{h:?}");
        // Priced by tokens alone (the old model), the recompute looked like 2 s against the
        // holder's 2.58: every request left the holder and recomputed the prefix elsewhere.
        let linear = fleet(0.0);
        let h = histogram(&mut P2cCache::default(), &linear, &keys(1563), 300);
        assert_eq!(h[0], 0, "{h:?}");
    }

    #[test]
    fn a_holder_of_the_whole_prompt_keeps_its_siblings_despite_their_decodes() {
        // An RL rollout's siblings: A holds the whole 8k-token prompt (the first sibling computed
        // it) and decodes the group's other requests, 12 in all (a 60 ms decode term), with no
        // prefill queued; B is idle but would recompute the prompt (0.16 s).
        let holder = Candidate {
            queue_s: 0.06,
            prefill_queue_s: 0.0,
            cost_s: 0.06,
            prefill_s: 0.0,
            ..cand(0, 128, 12)
        };
        let stranger = |replica| Candidate {
            queue_s: 0.0,
            prefill_queue_s: 0.0,
            cost_s: 0.04,
            prefill_s: 0.04,
            ..cand(replica, 0, 0)
        };
        let c = [holder, stranger(1), stranger(2), stranger(3)];
        let h = histogram(&mut P2cCache::default(), &c, &keys(128), 300);
        assert_eq!(h[0], 300, "{h:?}");
        // With a prefill queue longer than the recomputation, the sibling does leave.
        let queued = Candidate {
            queue_s: 0.16,
            prefill_queue_s: 0.1,
            cost_s: 0.16,
            ..holder
        };
        let c = [queued, stranger(1), stranger(2), stranger(3)];
        let h = histogram(&mut P2cCache::default(), &c, &keys(128), 300);
        assert_eq!(h[0], 0, "{h:?}");
        // A prompt A holds only in part (a shared prefix, a new user turn) is weighed as before:
        // the decode term counts, and the idle replica takes it.
        let c = [holder, stranger(1), stranger(2), stranger(3)];
        let h = histogram(&mut P2cCache::default(), &c, &keys(129), 300);
        assert_eq!(h[0], 0, "{h:?}");
    }

    /// The tenants family's big tenant: a 4,096-token system prompt (64 blocks of 64 tokens here)
    /// before a short unique question, held by `holders` replicas that each decode
    /// `holder_outstanding` requests; the other replicas of eight decode 2 each and hold nothing.
    /// No prefill is queued anywhere (the fleet is lightly loaded).
    fn hot_tenant_fleet(holders: usize, holder_outstanding: u32) -> Vec<Candidate> {
        (0..8)
            .map(|i| {
                let (hit, outstanding, prefill_s) = if i < holders {
                    (64, holder_outstanding, 0.006)
                } else {
                    (0, 2, 0.088)
                };
                let queue_s = 0.005 * f64::from(outstanding);
                Candidate {
                    queue_s,
                    prefill_queue_s: 0.0,
                    cost_s: queue_s + prefill_s,
                    prefill_s,
                    ..cand(i, hit, outstanding)
                }
            })
            .collect()
    }

    #[test]
    fn a_hot_prefix_on_swamped_holders_gets_another_holder() {
        // Two holders with 9 requests each (a 45 ms decode term against the others' 10 ms) lose
        // to no stranger on cost alone (88 ms of prefill to copy the prompt), so without the rule
        // every request of the prefix stays with them.
        let c = hot_tenant_fleet(2, 9);
        let mut off = P2cCache {
            hot_copy_share: 1.0,
            ..P2cCache::default()
        };
        let h = histogram(&mut off, &c, &keys(72), 400);
        assert_eq!(h[0] + h[1], 400, "{h:?}");
        // Paying a quarter of the copy, a stranger drawn as B takes it: a third holder. (A third
        // of the draws find the other holder, which is no dearer than A: those stay.)
        let h = histogram(&mut P2cCache::default(), &c, &keys(72), 400);
        assert!(h[0] + h[1] < 200, "{h:?}");
        assert!(h[2..].iter().all(|n| *n > 20), "{h:?}");
        // One holder is a session's own prefix, not a hot one: it keeps its requests.
        let c = hot_tenant_fleet(1, 9);
        let h = histogram(&mut P2cCache::default(), &c, &keys(72), 400);
        assert_eq!(h[0], 400, "{h:?}");
        // Holders no busier than twice the fleet's mean (4 holders of 8 at 6: mean 4): the
        // prefix is spread enough, and the full copy is charged.
        let c = hot_tenant_fleet(4, 6);
        let h = histogram(&mut P2cCache::default(), &c, &keys(72), 400);
        assert_eq!(h[..4].iter().sum::<usize>(), 400, "{h:?}");
    }

    #[test]
    fn after_a_spill_two_holders_share_the_prefix() {
        // Both hold the prefix now: equal ties, so traffic splits between them.
        let c = [cand(0, 120, 2), cand(1, 120, 2), cand(2, 0, 0)];
        let h = histogram(&mut P2cCache::default(), &c, &keys(128), 1000);
        assert!(h[0] > 300 && h[1] > 300, "{h:?}");
        // Near-ties go to the less loaded holder.
        let c = [cand(0, 120, 3), cand(1, 118, 1), cand(2, 0, 0)];
        let h = histogram(&mut P2cCache::default(), &c, &keys(128), 1000);
        assert_eq!(h[1], 1000, "{h:?}");
    }

    #[test]
    fn without_hits_it_balances_load() {
        let c = [cand(0, 0, 8), cand(1, 0, 0), cand(2, 0, 1), cand(3, 0, 8)];
        let h = histogram(&mut P2cCache::default(), &c, &keys(128), 1000);
        assert!(
            h[1] > h[2] && h[2] > h[0] && h[0] < 50 && h[3] < 50,
            "{h:?}"
        );
    }

    /// B as it was chosen before the escape and the draw shared a pass: the escape's argmin
    /// (`argmin_random_tie`), then a draw that sums its weights itself.
    fn two_pass_second_choice(
        p: &P2cCache,
        c: &[Candidate],
        a: usize,
        rng: &mut SmallRng,
    ) -> Option<usize> {
        let a_replica = c[a].replica;
        let b = super::super::pick::argmin_random_tie(c, rng, |x| {
            if x.replica == a_replica {
                f64::INFINITY
            } else {
                x.cost_s
            }
        });
        let escaped = b != a
            && c[a].cost_s - c[b].cost_s > p.escape_margin_s
            && c[b].prefill_queue_s <= p.escape_max_queue_s;
        escaped
            .then_some(b)
            .or_else(|| draw_toward_low_cost(c, Some(a), rng))
    }

    /// A as it was chosen before the two skip tests became one compare: the oracle of
    /// [`P2cCache::longest_hit`].
    fn longest_hit_two_tests(
        p: &P2cCache,
        c: &[Candidate],
        max_hit: f64,
        rng: &mut SmallRng,
    ) -> usize {
        let floor = max_hit - (max_hit * p.tie_fraction).floor().min(max_hit);
        let (mut chosen, mut best, mut seen) = (0, f64::INFINITY, 0u32);
        for (i, x) in c.iter().enumerate() {
            if x.credited_blocks <= 0.0 || x.credited_blocks < floor || x.cost_s > best {
                continue;
            }
            if x.cost_s < best {
                best = x.cost_s;
                seen = 0;
            }
            seen += 1;
            if rng.random_range(0..seen) == 0 {
                chosen = i;
            }
        }
        chosen
    }

    proptest::proptest! {
        /// A, chosen with one compare per candidate against the bar, is the A of the two
        /// tests, with the same random draws, for credits at, under and over the floor (zero,
        /// negative, NaN among them) and tie margins from none to all.
        #[test]
        fn the_one_compare_longest_hit_is_the_two_test_one(
            credits in proptest::collection::vec(proptest::prop_oneof![
                proptest::strategy::Just(0.0), proptest::strategy::Just(-0.0),
                proptest::strategy::Just(-1.0), proptest::strategy::Just(f64::NAN),
                proptest::strategy::Just(15.0), proptest::strategy::Just(16.0),
                proptest::strategy::Just(0.75), 0.0f64..20.0], 1..60),
            outstanding in proptest::collection::vec(0u32..3, 60),
            tie_fraction in proptest::prop_oneof![
                proptest::strategy::Just(0.0), proptest::strategy::Just(1.0 / 16.0),
                proptest::strategy::Just(1.0), proptest::strategy::Just(2.0),
                proptest::strategy::Just(f64::NAN), -1.0f64..1.0],
            seed in proptest::prelude::any::<u64>(),
        ) {
            use rand::{RngCore, SeedableRng};
            let c: Vec<Candidate> = credits
                .iter()
                .zip(&outstanding)
                .enumerate()
                .map(|(i, (&credit, &out))| Candidate { credited_blocks: credit, ..cand(i, 0, out) })
                .collect();
            let max_hit = c.iter().map(|x| x.credited_blocks).fold(0.0, f64::max);
            proptest::prop_assume!(max_hit > 0.0);
            let p = P2cCache { tie_fraction, ..P2cCache::default() };
            let (mut one, mut two) = (SmallRng::seed_from_u64(seed), SmallRng::seed_from_u64(seed));
            proptest::prop_assert_eq!(
                p.longest_hit(&c, max_hit, &mut one),
                longest_hit_two_tests(&p, &c, max_hit, &mut two)
            );
            proptest::prop_assert_eq!(one.next_u64(), two.next_u64());
        }

        /// The one-pass escape and draw choose the B the two passes chose, with the same
        /// random draws (the generator's next output agrees too): costs from a few loads and
        /// hits, so ties (each one a draw) are common.
        #[test]
        fn the_one_pass_second_choice_is_the_two_pass_one(
            loads in proptest::collection::vec((0u32..3, 0u32..4), 1..80),
            a in 0usize..80,
            margin in proptest::prop_oneof![proptest::strategy::Just(0.0), proptest::strategy::Just(0.05)],
            seed in proptest::prelude::any::<u64>(),
        ) {
            use rand::{RngCore, SeedableRng};
            let c: Vec<Candidate> = loads
                .iter()
                .enumerate()
                .map(|(i, &(hit, out))| cand(i, hit * 40, out))
                .collect();
            let a = a % c.len();
            let mut p = P2cCache { escape_margin_s: margin, ..P2cCache::default() };
            let (mut one, mut two) = (SmallRng::seed_from_u64(seed), SmallRng::seed_from_u64(seed));
            proptest::prop_assert_eq!(
                p.second_choice(&c, a, &mut one),
                two_pass_second_choice(&p, &c, a, &mut two)
            );
            proptest::prop_assert_eq!(one.next_u64(), two.next_u64());
        }

        /// The escape's pass (A visited in its place, not tested for at each position) sums
        /// the draw's weights to the bit as `Iterator::sum` over `draw_weight` does, and finds
        /// the B `argmin_random_tie` finds, with the same random draws; A anywhere, past the
        /// end too.
        #[test]
        fn the_escape_pass_sums_and_ties_as_the_plain_passes(
            loads in proptest::collection::vec((0u32..3, 0u32..4), 1..80),
            a in 0usize..90,
            seed in proptest::prelude::any::<u64>(),
        ) {
            use rand::{RngCore, SeedableRng};
            let c: Vec<Candidate> = loads
                .iter()
                .enumerate()
                .map(|(i, &(hit, out))| cand(i, hit * 40, out))
                .collect();
            let (mut one, mut two) = (SmallRng::seed_from_u64(seed), SmallRng::seed_from_u64(seed));
            let weights: Vec<f64> = c.iter().map(low_cost_weight).collect();
            let scan = cheapest_but(&c, &weights, a, &mut one);
            let b = super::super::pick::argmin_random_tie(&c, &mut two, |x| {
                if x.replica == a { f64::INFINITY } else { x.cost_s }
            });
            let sum: f64 = c
                .iter()
                .enumerate()
                .map(|(i, x)| super::super::pick::draw_weight(i, x, Some(a)))
                .sum();
            proptest::prop_assert_eq!(scan.total.to_bits(), sum.to_bits());
            proptest::prop_assert_eq!(scan.b, b);
            proptest::prop_assert_eq!(one.next_u64(), two.next_u64());
        }
    }
}
