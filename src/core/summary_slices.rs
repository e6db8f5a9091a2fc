//! A view's summaries, bit-sliced: for each filter bit position one 64-bit word per 64
//! replicas, so that one decision learns every replica's hit with a few word operations per
//! probed key instead of a filter probe per replica and key.
//!
//! Every filter of a cluster shares one seed, so filters of one geometry (bitmap size, hash
//! count) test a key at the same bit positions. Transposed — bit `r` of a slice's word for
//! position `p` is bit `p` of replica `64·s + r`'s filter — testing one key for 64 replicas is
//! an AND of `k` words (`k` = 7 at the default 1 % false positives). The hit search
//! (`view.rs`) then runs its exponential-then-binary search for a slice's replicas in lockstep
//! ([`lockstep_runs`]): replicas that answer a probe alike take the same next probe, so a
//! slice costs a few word ANDs per distinct answer, where probing each replica's filter cost
//! about four probes of seven bit tests each per replica (two thirds of a 512-replica
//! decision's instructions).
//!
//! Exact: a replica's answers are its own filter's bits, and the lockstep search takes each
//! replica through the probes the per-replica search makes, so its run is the same
//! (property-tested in `view.rs`). Each member holds the filter its column was built from
//! ([`FilterHandle`]; filters are copy-on-write, so held bits never change), and a replica's run
//! from its slice is used only while its summary's filter is that very one: a summary replaced
//! behind [`SummarySlices::set`]'s back is searched the per-replica way, never read stale. (The
//! hold means that a follower applying a delta to a summary the view indexes copies its filter
//! once, where it would otherwise have changed it in place.)
//!
//! Bounds: at most [`MAX_GROUPS`] filter kinds (seed, geometry) are sliced; a kind is sliced only
//! while its replicas fill its slices at least a quarter (so the slices take at most four times
//! its filters' bytes; dropped below an eighth) and all slices together stay under
//! [`MAX_SLICED_BYTES`]. Replicas of any other kind are searched the per-replica way. Updating
//! a member costs one pass over its filter's words plus one word write per changed bit.

use std::sync::atomic::{AtomicU64, Ordering};

use super::summary::{FilterGeometry, FilterHandle, ReplicaSummary};

/// Replicas per slice: one bit each of a `u64`.
pub const SLICE_WIDTH: usize = 64;
/// Filter kinds (seed, geometry) sliced at most. A fleet has one per replica size, rarely more
/// than two.
pub const MAX_GROUPS: usize = 4;
/// All slices of a view together stay under this many bytes.
pub const MAX_SLICED_BYTES: u64 = 1 << 30;
/// Hash functions up to which a kind is sliced (the hit search memoises a key's positions up to
/// this many per geometry).
pub const MAX_SLICED_HASHES: u32 = 32;

/// Gives every index its own id (a hit scratch's remembered runs belong to one index).
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The bit-sliced summaries of one view's replicas (see the module doc).
#[derive(Debug)]
pub struct SummarySlices {
    /// Tells this index from any other.
    id: u64,
    /// Bumped by every change of a member: runs found before it no longer count.
    version: u64,
    /// Filter kinds; an emptied one stays, to be reused (indexes are stable).
    groups: Vec<Group>,
    /// By replica index: the kind it is a member of and the filter its column holds.
    members: Vec<Option<Member>>,
    /// Per slice and kind (`slice * MAX_GROUPS + kind`): its members in the slice, a bit each.
    member_masks: Vec<u64>,
}

impl Default for SummarySlices {
    fn default() -> Self {
        SummarySlices {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            version: 0,
            groups: Vec::new(),
            members: Vec::new(),
            member_masks: Vec::new(),
        }
    }
}

/// One replica in the index.
#[derive(Debug)]
struct Member {
    /// Its kind (index into `groups`).
    group: usize,
    /// The filter its column was built from.
    filter: FilterHandle,
}

/// The replicas whose filters share one seed and geometry.
#[derive(Debug)]
pub struct Group {
    seed_id: u64,
    geometry: FilterGeometry,
    /// Bit positions per slice (the geometry's bitmap bits).
    bits: usize,
    /// Members (replicas whose summary is of this kind).
    members: usize,
    /// Slice `s`'s word for position `p` at `s * bits + p`: bit `r` set when replica `64·s + r`
    /// is a member whose filter has bit `p`. Empty while the kind is not sliced.
    words: Vec<u64>,
}

impl Group {
    /// Whether the kind is sliced now.
    fn sliced(&self) -> bool {
        !self.words.is_empty()
    }

    /// Slice `slice`'s words, one per bit position.
    #[inline]
    pub fn slice(&self, slice: usize) -> Option<&[u64]> {
        let start = slice.checked_mul(self.bits)?;
        self.words.get(start..start.checked_add(self.bits)?)
    }

    /// Makes replica `col`'s column go from the bits of `old` to those of `new` (bitmaps of
    /// this geometry; `None`: no bits): one word compare per 64 positions, one write per
    /// changed bit.
    fn update(&mut self, col: usize, old: Option<&[u8]>, new: Option<&[u8]>) {
        let bit = 1u64 << (col % SLICE_WIDTH);
        let start = (col / SLICE_WIDTH) * self.bits;
        let Some(words) = self.words.get_mut(start..start + self.bits) else {
            return;
        };
        let (old, new) = (old.unwrap_or(&[]), new.unwrap_or(&[]));
        let chunks = old.len().max(new.len()).div_ceil(8);
        for c in 0..chunks {
            let (a, b) = (le_word(old, c), le_word(new, c));
            let mut changed = a ^ b;
            while changed != 0 {
                let k = changed.trailing_zeros();
                changed &= changed - 1;
                if let Some(w) = words.get_mut(c * 64 + k as usize) {
                    if b >> k & 1 == 1 {
                        *w |= bit;
                    } else {
                        *w &= !bit;
                    }
                }
            }
        }
    }

    /// Bytes the slices of a view of `slices` slices take.
    fn bytes_for(&self, slices: usize) -> u64 {
        (slices as u64)
            .saturating_mul(self.bits as u64)
            .saturating_mul(8)
    }
}

/// Word `c` of a bitmap read as little-endian `u64`s (bit `p % 64` of word `p / 64` is bit `p`),
/// zero past the end.
fn le_word(bytes: &[u8], c: usize) -> u64 {
    let mut w = [0u8; 8];
    if let Some(tail) = bytes.get(c * 8..) {
        let n = tail.len().min(8);
        w[..n].copy_from_slice(&tail[..n]);
    }
    u64::from_le_bytes(w)
}

/// The mask of a slice's replicas whose filters hold every one of `positions` (its words from
/// [`Group::slice`]).
#[inline]
pub fn held_in(words: &[u64], positions: &[u32]) -> u64 {
    let mut held = !0u64;
    for &p in positions {
        held &= words.get(p as usize).copied().unwrap_or(0);
        if held == 0 {
            break;
        }
    }
    held
}

impl SummarySlices {
    /// Tells this index from any other.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Bumped by every change of a member.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Kind `g`, when it is sliced now.
    #[inline]
    pub fn group(&self, g: usize) -> Option<&Group> {
        self.groups.get(g).filter(|g| g.sliced())
    }

    /// The sliced kind replica `i` is searched under, when its summary is `summary` — the very
    /// filter its column holds.
    #[inline]
    pub fn member_of(&self, i: usize, summary: &ReplicaSummary) -> Option<usize> {
        let m = self.members.get(i)?.as_ref()?;
        (m.filter.is_of(summary) && self.groups.get(m.group)?.sliced()).then_some(m.group)
    }

    /// Whether replica `i`'s column holds `summary`'s very filter.
    #[inline]
    pub fn holds(&self, i: usize, summary: &ReplicaSummary) -> bool {
        self.members
            .get(i)
            .and_then(Option::as_ref)
            .is_some_and(|m| m.filter.is_of(summary))
    }

    /// The members of kind `g` in `slice`, a bit each (a member's column may hold a filter its
    /// replica no longer has: check [`SummarySlices::holds`] before using its run).
    #[inline]
    pub fn members_in(&self, slice: usize, g: usize) -> u64 {
        self.member_masks
            .get(slice * MAX_GROUPS + g)
            .copied()
            .unwrap_or(0)
    }

    /// Marks replica `i` in or out of kind `g`'s member mask.
    fn mark(&mut self, i: usize, g: usize, member: bool) {
        let at = (i / SLICE_WIDTH) * MAX_GROUPS + g;
        if self.member_masks.len() <= at {
            self.member_masks.resize(at + 1, 0);
        }
        let bit = 1u64 << (i % SLICE_WIDTH);
        if member {
            self.member_masks[at] |= bit;
        } else {
            self.member_masks[at] &= !bit;
        }
    }

    /// Replica `i`'s summary is now `summary` (`None`: it has none). A call with the filter
    /// already held changes nothing.
    pub fn set(&mut self, i: usize, summary: Option<&ReplicaSummary>) {
        let old = self.members.get_mut(i).and_then(Option::take);
        if let (Some(m), Some(s)) = (&old, summary) {
            if m.filter.is_of(s) {
                self.members[i] = old;
                return;
            }
        }
        if old.is_none() && summary.is_none() {
            return;
        }
        self.version += 1;
        if self.members.len() <= i {
            self.members.resize_with(i + 1, || None);
        }
        let new_group = summary.and_then(|s| self.group_for(s));
        match (old, new_group, summary) {
            // The same kind: the column changes by the bits that differ.
            (Some(m), Some(g), Some(s)) if m.group == g => {
                let filter = s.filter_handle();
                if let Some(group) = self.groups.get_mut(g) {
                    if group.sliced() {
                        group.update(i, Some(m.filter.bitmap()), Some(filter.bitmap()));
                    }
                }
                self.members[i] = Some(Member { group: g, filter });
            }
            (old, new_group, summary) => {
                if let Some(m) = old {
                    self.leave(i, m);
                }
                if let (Some(g), Some(s)) = (new_group, summary) {
                    self.join(i, g, s.filter_handle());
                }
            }
        }
        self.rebalance();
    }

    /// The kind of `s`'s filter: found, or made in a free place; `None` when its geometry is
    /// not one the search can slice or every place is taken.
    fn group_for(&mut self, s: &ReplicaSummary) -> Option<usize> {
        let (seed_id, geometry) = (s.seed_id(), s.geometry());
        if let Some(g) = self
            .groups
            .iter()
            .position(|g| g.seed_id == seed_id && g.geometry == geometry)
        {
            return Some(g);
        }
        let hashes = geometry.hashes();
        let bits = usize::try_from(geometry.bit_len()).ok()?;
        if !(1..=MAX_SLICED_HASHES).contains(&hashes)
            || bits == 0
            || geometry.bit_len() > u64::from(u32::MAX) + 1
        {
            return None;
        }
        let group = Group {
            seed_id,
            geometry,
            bits,
            members: 0,
            words: Vec::new(),
        };
        if let Some(free) = self.groups.iter().position(|g| g.members == 0) {
            self.groups[free] = group;
            Some(free)
        } else if self.groups.len() < MAX_GROUPS {
            self.groups.push(group);
            Some(self.groups.len() - 1)
        } else {
            None
        }
    }

    /// Takes replica `i` (member `m`) out of its kind.
    fn leave(&mut self, i: usize, m: Member) {
        self.mark(i, m.group, false);
        if let Some(group) = self.groups.get_mut(m.group) {
            group.members = group.members.saturating_sub(1);
            if group.sliced() {
                group.update(i, Some(m.filter.bitmap()), None);
            }
        }
    }

    /// Puts replica `i`, with `filter`, in kind `g`.
    fn join(&mut self, i: usize, g: usize, filter: FilterHandle) {
        self.mark(i, g, true);
        let slices = self.slices();
        if let Some(group) = self.groups.get_mut(g) {
            group.members += 1;
            if group.sliced() {
                // The view may have grown a slice since the kind was sliced.
                group.words.resize(slices * group.bits, 0);
                group.update(i, None, Some(filter.bitmap()));
            }
        }
        self.members[i] = Some(Member { group: g, filter });
    }

    /// Slices of the view's replica range.
    fn slices(&self) -> usize {
        self.members.len().div_ceil(SLICE_WIDTH)
    }

    /// Slices a kind its members fill at least a quarter (within the byte bound) and drops the
    /// slices of one they fill less than an eighth (the gap keeps a kind from flapping).
    fn rebalance(&mut self) {
        let slices = self.slices();
        let mut used: u64 = self
            .groups
            .iter()
            .filter(|g| g.sliced())
            .map(|g| g.bytes_for(slices))
            .sum();
        for g in 0..self.groups.len() {
            let group = &mut self.groups[g];
            let room = slices * SLICE_WIDTH;
            if group.sliced() && group.members * 8 < room {
                used = used.saturating_sub(group.bytes_for(slices));
                group.words = Vec::new();
            } else if !group.sliced()
                && group.members > 0
                && group.members * 4 >= room
                && used.saturating_add(group.bytes_for(slices)) <= MAX_SLICED_BYTES
            {
                used += group.bytes_for(slices);
                self.build(g, slices);
            }
        }
    }

    /// Slices kind `g` from its members' filters.
    fn build(&mut self, g: usize, slices: usize) {
        let Some(group) = self.groups.get_mut(g) else {
            return;
        };
        group.words = vec![0; slices * group.bits];
        for (i, m) in self.members.iter().enumerate() {
            if let Some(m) = m.as_ref().filter(|m| m.group == g) {
                group.update(i, None, Some(m.filter.bitmap()));
            }
        }
    }
}

/// Where one replica's hit search stands: the states of `view.rs`'s `try_leading_run` from
/// position 0 (a first probe at 0, then exponential steps, then bisection), as data, so that
/// the replicas of a slice can take them together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunSearch {
    /// Nothing probed yet.
    Start,
    /// `0..=lo` held; the next probe is `lo + step`.
    Grow {
        /// The last held position probed.
        lo: usize,
        /// The distance to the next probe.
        step: usize,
    },
    /// `lo` held, `hi` not held (or the end): bisect.
    Narrow {
        /// A held position.
        lo: usize,
        /// A position not held, or `n`.
        hi: usize,
    },
    /// The run is this long.
    Over(usize),
}

impl RunSearch {
    /// The position to probe next (with the state to answer it in), or the run's length.
    #[inline]
    fn next(mut self, n: usize) -> Result<(usize, Self), usize> {
        loop {
            match self {
                RunSearch::Start if n == 0 => return Err(0),
                RunSearch::Start => return Ok((0, self)),
                RunSearch::Grow { lo, step } => {
                    let probe = lo.saturating_add(step);
                    if probe < n {
                        return Ok((probe, self));
                    }
                    self = RunSearch::Narrow { lo, hi: n };
                }
                RunSearch::Narrow { lo, hi } if hi - lo > 1 => {
                    return Ok((lo + (hi - lo) / 2, self));
                }
                RunSearch::Narrow { hi, .. } => return Err(hi),
                RunSearch::Over(run) => return Err(run),
            }
        }
    }

    /// The state after position `j` (this state's probe) answered `held`.
    #[inline]
    fn after(self, j: usize, held: bool) -> Self {
        match (self, held) {
            (RunSearch::Start, true) => RunSearch::Grow { lo: j, step: 1 },
            (RunSearch::Start, false) => RunSearch::Over(j),
            (RunSearch::Grow { step, .. }, true) => RunSearch::Grow {
                lo: j,
                step: step.saturating_mul(2),
            },
            (RunSearch::Grow { lo, .. }, false) => RunSearch::Narrow { lo, hi: j },
            (RunSearch::Narrow { hi, .. }, true) => RunSearch::Narrow { lo: j, hi },
            (RunSearch::Narrow { lo, .. }, false) => RunSearch::Narrow { lo, hi: j },
            (over @ RunSearch::Over(_), _) => over,
        }
    }
}

/// The leading run of `n` keys for every replica of `mask` (bits of one slice), each exactly
/// what its own search finds: replicas in the same state probe the same key, so one call of
/// `held(j)` — the slice's mask of replicas holding key `j`, `None` to give up — splits them
/// by their answer. `found(mask, run)` receives each finished group. `work` is a reused buffer
/// (its depth stays under three entries per probe of one search, ~2·log2 n). Returns false if
/// `held` gave up (the runs already found stand; the others are not found).
pub fn lockstep_runs(
    n: usize,
    mask: u64,
    work: &mut Vec<(u64, RunSearch)>,
    mut held: impl FnMut(usize) -> Option<u64>,
    mut found: impl FnMut(u64, usize),
) -> bool {
    work.clear();
    if mask != 0 {
        work.push((mask, RunSearch::Start));
    }
    while let Some((m, state)) = work.pop() {
        match state.next(n) {
            Err(run) => found(m, run),
            Ok((j, state)) => {
                let Some(h) = held(j) else {
                    return false;
                };
                let (yes, no) = (m & h, m & !h);
                if no != 0 {
                    work.push((no, state.after(j, false)));
                }
                if yes != 0 {
                    work.push((yes, state.after(j, true)));
                }
            }
        }
    }
    true
}

/// What one request's slice searches found, kept in the hit scratch (`view.rs`): per replica its
/// GPU run, per (slice, kind) whether it was searched. Entries carry the stamp of the (index,
/// index version, request) they were found for, so nothing is cleared between requests and a
/// change of the view voids them.
#[derive(Debug, Default)]
pub struct SliceRuns {
    /// (index id, index version, request stamp) the current stamp stands for.
    key: (u64, u64, u32),
    /// Never 0 once begun; entries start at 0.
    stamp: u32,
    /// Per replica: (stamp, run).
    runs: Vec<(u32, u32)>,
    /// Per slice and kind (`slice * MAX_GROUPS + kind`): the stamp it was searched for.
    searched: Vec<u32>,
    /// The lockstep search's work list (reused).
    pub work: Vec<(u64, RunSearch)>,
}

impl SliceRuns {
    /// Readies the runs for request `request` on `slices` of a view of `replicas` replicas:
    /// what was found for another request, index or version no longer counts.
    #[inline]
    pub fn begin(&mut self, slices: &SummarySlices, request: u32, replicas: usize) {
        let key = (slices.id, slices.version, request);
        if self.key != key {
            self.key = key;
            self.stamp = self.stamp.wrapping_add(1);
            if self.stamp == 0 {
                // Wrapped: entries of 2³² stamps ago would pass for current.
                self.runs.iter_mut().for_each(|e| e.0 = 0);
                self.searched.iter_mut().for_each(|s| *s = 0);
                self.stamp = 1;
            }
        }
        if self.runs.len() < replicas {
            self.runs.resize(replicas, (0, 0));
            let slots = replicas.div_ceil(SLICE_WIDTH) * MAX_GROUPS;
            self.searched.resize(slots, 0);
        }
    }

    /// Replica `i`'s run, if found for request `request` on this very state of `slices`
    /// ([`SliceRuns::begin`] not needed).
    #[inline(always)]
    pub fn found(&self, i: usize, slices: &SummarySlices, request: u32) -> Option<usize> {
        if self.key != (slices.id, slices.version, request) {
            return None;
        }
        self.run(i)
    }

    /// The per-replica entries (stamp, run) and the current stamp: an entry is a run found
    /// for the current stamp when its stamp is that one ([`SliceRuns::run`] for every replica
    /// in one pass).
    #[inline]
    pub fn current(&self) -> (&[(u32, u32)], u32) {
        (&self.runs, self.stamp)
    }

    /// Whether the current stamp stands for this very state of `slices`.
    pub fn is_on(&self, slices: &SummarySlices) -> bool {
        (self.key.0, self.key.1) == (slices.id, slices.version)
    }

    /// Replica `i`'s run, if found for the current stamp.
    #[inline]
    pub fn run(&self, i: usize) -> Option<usize> {
        match self.runs.get(i) {
            Some(&(s, run)) if s == self.stamp => Some(run as usize),
            _ => None,
        }
    }

    /// Whether `slice` was searched for kind `g` under the current stamp; marks it searched.
    pub fn check_searched(&mut self, slice: usize, g: usize) -> bool {
        match self.searched.get_mut(slice * MAX_GROUPS + g) {
            Some(s) if *s == self.stamp => true,
            Some(s) => {
                *s = self.stamp;
                false
            }
            None => true,
        }
    }

    /// Records `run` for the replicas of `mask` in `slice`.
    pub fn record(&mut self, slice: usize, mut mask: u64, run: usize) {
        let run = u32::try_from(run).unwrap_or(u32::MAX);
        let stamp = self.stamp;
        // A whole slice's entries as one array, so a member's store needs no bounds check (a
        // member's position is under `SLICE_WIDTH`): at 512 replicas a decision records 512
        // runs. Only a fleet's last, partial slice takes the checked loop below.
        let first = slice.saturating_mul(SLICE_WIDTH);
        let whole = first
            .checked_add(SLICE_WIDTH)
            .and_then(|end| self.runs.get_mut(first..end))
            .and_then(|entries| <&mut [(u32, u32); SLICE_WIDTH]>::try_from(entries).ok());
        if let Some(entries) = whole {
            while mask != 0 {
                let r = mask.trailing_zeros() as usize;
                mask &= mask - 1;
                entries[r % SLICE_WIDTH] = (stamp, run);
            }
            return;
        }
        while mask != 0 {
            let r = mask.trailing_zeros() as usize;
            mask &= mask - 1;
            if let Some(e) = self.runs.get_mut(slice * SLICE_WIDTH + r) {
                *e = (self.stamp, run);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::keys::BlockKey;
    use crate::core::summary::SummaryConfig;

    fn summary(keys: &[u64]) -> ReplicaSummary {
        let mut s = ReplicaSummary::new(1, 500, &SummaryConfig::for_cluster("t")).unwrap();
        s.insert(&keys.iter().map(|&k| BlockKey(k)).collect::<Vec<_>>());
        s
    }

    /// Whether slice words say replica `i` has bit `p`.
    fn has(x: &SummarySlices, g: usize, i: usize, p: usize) -> bool {
        let words = x.group(g).unwrap().slice(i / SLICE_WIDTH).unwrap();
        words[p] >> (i % SLICE_WIDTH) & 1 == 1
    }

    fn bit(bitmap: &[u8], p: usize) -> bool {
        bitmap[p / 8] >> (p % 8) & 1 == 1
    }

    /// Every column equals its member's filter, bit for bit.
    fn assert_columns(x: &SummarySlices, view: &[Option<ReplicaSummary>]) {
        for (i, s) in view.iter().enumerate() {
            let Some(s) = s else { continue };
            let g = x.member_of(i, s).expect("sliced");
            let h = s.filter_handle();
            let bits = s.geometry().bit_len() as usize;
            for p in 0..bits {
                assert_eq!(has(x, g, i, p), bit(h.bitmap(), p), "replica {i} bit {p}");
            }
        }
    }

    /// Recording a run stores it at each member of the mask, for a whole slice (the array
    /// path) and for a fleet's last, partial one (the checked path), and nowhere else.
    #[test]
    fn a_recorded_run_lands_at_each_member_and_nowhere_else() {
        for replicas in [128usize, 100] {
            let mut runs = SliceRuns {
                stamp: 7,
                runs: vec![(0, 0); replicas],
                ..SliceRuns::default()
            };
            let mask = 1u64 | 1 << 5 | 1 << 35 | 1 << 63;
            runs.record(1, mask, 9);
            for (i, &e) in runs.runs.iter().enumerate() {
                let member = i >= SLICE_WIDTH && mask & 1 << (i - SLICE_WIDTH) != 0;
                assert_eq!(
                    e,
                    if member { (7, 9) } else { (0, 0) },
                    "replica {i} of {replicas}"
                );
            }
        }
    }

    #[test]
    fn columns_follow_summaries_as_they_change_and_leave() {
        let mut x = SummarySlices::default();
        let mut view: Vec<Option<ReplicaSummary>> =
            (0..70).map(|i| Some(summary(&[i, i + 1000, 7]))).collect();
        for (i, s) in view.iter().enumerate() {
            x.set(i, s.as_ref());
        }
        assert_columns(&x, &view);
        // A changed filter, one removed, and one set again unchanged.
        let mut grown = view[3].clone().unwrap();
        grown.insert(&[BlockKey(99), BlockKey(98)]);
        view[3] = Some(grown);
        x.set(3, view[3].as_ref());
        let gone = view[65].take().unwrap();
        x.set(65, None);
        let before = x.version();
        x.set(4, view[4].as_ref());
        assert_eq!(x.version(), before, "the same filter again changes nothing");
        assert_columns(&x, &view);
        let g = x.member_of(0, view[0].as_ref().unwrap()).unwrap();
        let h = gone.filter_handle();
        let bits = gone.geometry().bit_len() as usize;
        assert!(
            (0..bits).all(|p| !has(&x, g, 65, p)),
            "a left column is empty"
        );
        assert!(bits > 0 && (0..bits).any(|p| bit(h.bitmap(), p)));
        // A summary replaced without `set`: not searched from the slices.
        let other = summary(&[1, 2, 3]);
        assert_eq!(x.member_of(5, &other), None);
    }

    #[test]
    fn a_sparse_kind_is_not_sliced_and_a_full_one_is() {
        let mut x = SummarySlices::default();
        let few: Vec<ReplicaSummary> = (0..10).map(|i| summary(&[i])).collect();
        for (i, s) in few.iter().enumerate() {
            x.set(i * 10, Some(s));
        }
        // 10 of a 91-replica range (two slices): under a quarter.
        assert_eq!(x.member_of(0, &few[0]), None);
        for i in 0..128 {
            if i % 10 != 0 {
                x.set(i, Some(&summary(&[i as u64])));
            }
        }
        assert!(x.member_of(0, &few[0]).is_some());
    }

    #[test]
    fn lockstep_gives_each_replica_the_run_of_its_own_answers() {
        // Replica r holds positions 0..r of 40, and also 33 (a false positive past its run).
        let n = 40;
        let held_by = |r: usize, j: usize| j < r || j == 33;
        let mut work = Vec::new();
        let mut runs = [usize::MAX; 64];
        let ok = lockstep_runs(
            n,
            !0,
            &mut work,
            |j| {
                Some(
                    (0..64)
                        .filter(|&r| held_by(r, j))
                        .fold(0u64, |m, r| m | 1 << r),
                )
            },
            |mask, run| {
                for (r, out) in runs.iter_mut().enumerate() {
                    if mask >> r & 1 == 1 {
                        *out = run;
                    }
                }
            },
        );
        assert!(ok);
        for (r, &run) in runs.iter().enumerate() {
            // The per-replica search, written out.
            let mut single = RunSearch::Start;
            let expect = loop {
                match single.next(n) {
                    Err(run) => break run,
                    Ok((j, s)) => single = s.after(j, held_by(r, j)),
                }
            };
            assert_eq!(run, expect, "replica {r}");
        }
        assert_eq!(runs[0], 0);
        assert_eq!(runs[50], n, "held through the end");
    }
}
