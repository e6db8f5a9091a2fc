//! Data-parallel ranks: which rank of a replica holds a request's prefix, and which rank to send
//! it to.
//!
//! Exists because a data-parallel engine (vLLM `--data-parallel-size`, SGLang `--dp-size`) is
//! several engines behind one address, each with its own prefix cache. The router picks the
//! replica from the merged summary ("held by any rank"); left to itself the engine's balancer
//! then picks a rank by queue length, which holds the prefix only by chance (1 in N at N ranks).
//! Where the replica's exact cache model knows which ranks hold each block (its KV events come
//! per rank), the node names the rank instead (`X-data-parallel-rank`, or SGLang's
//! `data_parallel_rank` body field).
//!
//! The choice is the core's cost formula per rank (`cost.rs`): the rank's own queued prefill
//! (this node's requests there without a first byte) plus the request's uncached prefill there,
//! over the replica's prefill rate, plus `w_load` per request this node has in flight there.
//! Ties (a prefix nobody holds on an idle replica) rotate, so cold prefixes spread over the ranks
//! as the engine's own balancer would spread them. Sans-IO and allocation-light: one decision
//! reads at most `2·log2(hit)` masks per distinct run end, and there are at most 64 ranks.

/// Most ranks a rank mask tells apart (bit r = rank r).
pub const MAX_RANKS: usize = 64;

/// This node's load on one rank of a replica.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankLoad {
    /// Uncached prompt tokens of this node's requests there that have no first byte yet.
    pub pending_tokens: u64,
    /// This node's requests in flight there.
    pub in_flight: u32,
}

/// The leading run of `0..n` each of `ranks` ranks holds, where `mask_at(j)` is the set of ranks
/// holding block j (bit r = rank r). A prefix cache is prefix-closed per rank, so the set only
/// shrinks along the prompt: the runs are found by searching, for the current set, where it
/// first loses a member, and starting again from there with what is left. If an engine broke
/// prefix-closedness the result could be a little off; it is a hint (the engine does the real
/// lookup), never a correctness matter.
pub fn rank_runs(n: usize, ranks: usize, mask_at: impl Fn(usize) -> u64) -> RankRuns {
    let ranks = ranks.min(MAX_RANKS);
    let all = if ranks == MAX_RANKS {
        u64::MAX
    } else {
        (1u64 << ranks) - 1
    };
    let mut runs = RankRuns {
        runs: [0; MAX_RANKS],
        len: ranks,
    };
    if n == 0 {
        return runs;
    }
    let mut set = mask_at(0) & all;
    let mut pos = 0usize;
    while set != 0 {
        // Positions pos.. where every member of `set` still holds the block: exponential then
        // binary search for the first one where some member does not.
        let keeps = |j: usize| mask_at(j) & set == set;
        let (mut lo, mut step) = (pos, 1usize);
        let mut hi = loop {
            let probe = lo.saturating_add(step);
            if probe >= n {
                break n;
            }
            if !keeps(probe) {
                break probe;
            }
            lo = probe;
            step = step.saturating_mul(2);
        };
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if keeps(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let left = if hi < n { mask_at(hi) & set } else { 0 };
        let mut ended = set & !left;
        while ended != 0 {
            let r = ended.trailing_zeros() as usize;
            runs.runs[r] = hi;
            ended &= ended - 1;
        }
        set = left;
        pos = hi;
    }
    runs
}

/// Each rank's leading run, by rank (`rank_runs`): on the stack, since the request path asks for
/// it on every decision at a multi-rank replica's home.
#[derive(Clone, Copy)]
pub struct RankRuns {
    runs: [usize; MAX_RANKS],
    len: usize,
}

impl RankRuns {
    /// No rank holds anything, for `ranks` ranks (at most [`MAX_RANKS`]).
    pub fn zeros(ranks: usize) -> Self {
        RankRuns {
            runs: [0; MAX_RANKS],
            len: ranks.min(MAX_RANKS),
        }
    }

    /// Rank `rank` holds at least the first `run` blocks (ignored past the ranks counted).
    pub fn raise(&mut self, rank: usize, run: usize) {
        if rank < self.len {
            self.runs[rank] = self.runs[rank].max(run);
        }
    }
}

impl std::ops::Deref for RankRuns {
    type Target = [usize];
    fn deref(&self) -> &[usize] {
        &self.runs[..self.len]
    }
}

impl std::fmt::Debug for RankRuns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl PartialEq<Vec<usize>> for RankRuns {
    fn eq(&self, other: &Vec<usize>) -> bool {
        **self == other[..]
    }
}

/// The rank to send a request to: the least predicted seconds to first token, given each rank's
/// leading run `runs[r]` (blocks) and this node's `loads[r]` there. `tokens_per_block` converts
/// runs to tokens, `prefill_tokens_per_s` tokens to seconds, `w_load_s` is the cost of one
/// request in flight (`CostModel::w_load_s`). Among equal costs the first from `rotate % ranks`
/// on wins. `None` when there are no ranks.
pub fn pick_rank(
    runs: &[usize],
    loads: &[RankLoad],
    prompt_tokens: u64,
    tokens_per_block: u32,
    prefill_tokens_per_s: f64,
    w_load_s: f64,
    rotate: usize,
) -> Option<usize> {
    let n = runs.len();
    if n == 0 {
        return None;
    }
    let rate = prefill_tokens_per_s.max(1.0);
    let cost = |r: usize| {
        let cached = (runs[r] as u64).saturating_mul(u64::from(tokens_per_block));
        let load = loads.get(r).copied().unwrap_or_default();
        let uncached = prompt_tokens.saturating_sub(cached);
        load.pending_tokens.saturating_add(uncached) as f64 / rate
            + w_load_s * f64::from(load.in_flight)
    };
    let start = rotate % n;
    let mut best: Option<(usize, f64)> = None;
    for k in 0..n {
        let r = (start + k) % n;
        let c = cost(r);
        if best.is_none_or(|(_, b)| c < b) {
            best = Some((r, c));
        }
    }
    best.map(|(r, _)| r)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Masks of a prompt of `n` blocks where rank r holds the first `held[r]` blocks.
    fn masks(n: usize, held: &[usize]) -> Vec<u64> {
        (0..n)
            .map(|j| {
                held.iter()
                    .enumerate()
                    .filter(|(_, h)| j < **h)
                    .fold(0u64, |m, (r, _)| m | 1 << r)
            })
            .collect()
    }

    #[test]
    fn each_rank_gets_its_own_leading_run() {
        for held in [
            vec![0, 0, 0, 0],
            vec![5, 0, 0, 0],
            vec![0, 0, 0, 9],
            vec![3, 7, 7, 1],
            vec![10, 10, 10, 10],
            vec![2, 9, 0, 4],
        ] {
            let m = masks(10, &held);
            let runs = rank_runs(10, 4, |j| m[j]);
            assert_eq!(runs, held, "{held:?}");
        }
        // Past the prompt's end nothing is probed; an empty prompt holds nothing.
        assert_eq!(rank_runs(0, 2, |_| unreachable!()), vec![0, 0]);
        // Bits of ranks the replica does not have are ignored.
        assert_eq!(rank_runs(3, 1, |_| 0b11), vec![3]);
        // 64 ranks: every bit counts.
        let runs = rank_runs(4, 64, |j| if j < 2 { u64::MAX } else { 1 << 63 });
        assert_eq!((runs[0], runs[63]), (2, 4));
    }

    proptest::proptest! {
        /// The searched runs equal a linear scan, for prefix-closed holdings.
        #[test]
        fn runs_match_a_linear_scan(held in proptest::collection::vec(0usize..200, 1..9), n in 0usize..200) {
            let m = masks(n, &held);
            let runs = rank_runs(n, held.len(), |j| m[j]);
            let want: Vec<usize> = held.iter().map(|h| (*h).min(n)).collect();
            proptest::prop_assert_eq!(runs, want);
        }
    }

    #[test]
    fn the_rank_holding_the_prefix_wins_unless_it_is_busier_than_the_prefill() {
        let idle = [RankLoad::default(); 4];
        // 64 blocks of 16 tokens at 50k tokens/s: the full hit saves ~20 ms of prefill.
        let pick = |runs: &[usize], loads: &[RankLoad], rotate| {
            pick_rank(runs, loads, 1024, 16, 50_000.0, 0.005, rotate)
        };
        assert_eq!(pick(&[0, 0, 64, 0], &idle, 0), Some(2));
        assert_eq!(pick(&[10, 0, 64, 0], &idle, 3), Some(2));
        // Three requests in flight there (15 ms) still lose to 20 ms of prefill...
        let mut loads = idle;
        loads[2].in_flight = 3;
        assert_eq!(pick(&[0, 0, 64, 0], &loads, 0), Some(2));
        // ...but a queue of 2,000 prefill tokens (40 ms) does not.
        loads[2].pending_tokens = 2_000;
        let other = pick(&[0, 0, 64, 0], &loads, 0);
        assert!(matches!(other, Some(0 | 1 | 3)), "{other:?}");
    }

    #[test]
    fn cold_prefixes_rotate_over_idle_ranks() {
        let idle = [RankLoad::default(); 4];
        let picks: Vec<Option<usize>> = (0..4)
            .map(|k| pick_rank(&[0; 4], &idle, 500, 16, 50_000.0, 0.005, k))
            .collect();
        assert_eq!(picks, vec![Some(0), Some(1), Some(2), Some(3)]);
        // A rank with a request in flight is passed over.
        let mut loads = idle;
        loads[1].in_flight = 1;
        assert_eq!(
            pick_rank(&[0; 4], &loads, 500, 16, 50_000.0, 0.005, 1),
            Some(2)
        );
        assert_eq!(pick_rank(&[], &[], 500, 16, 50_000.0, 0.005, 0), None);
    }
}
