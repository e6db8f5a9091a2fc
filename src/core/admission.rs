//! The admission queue: where a request waits when no replica has room for it (every eligible
//! replica at its `max_in_flight`, or its tenant at a quota), instead of being refused at once.
//!
//! Bounded per class (`priority.rs`); dequeued by self-clocked weighted fair queueing (SCFQ)
//! over *flows*, a flow being one (class, tenant): a request's virtual finish tag is its flow's
//! previous tag (or the queue's virtual time, if later) plus `1 / (class weight × tenant
//! weight)`, and a freed slot goes to the smallest tag. So two backlogged flows are served in
//! the ratio of their weights, a flow that was idle starts at the present (it banks no credit),
//! and a request of a heavy class arriving behind a flood of light ones is served within a few
//! slots. Ties go to the earlier arrival.
//!
//! Deadlines: each request may wait its class's `max_wait_ms`. The queue measures how often
//! slots free (the mean gap between releases, never below the time since the last one) and
//! predicts a new request's wait as (requests ahead of it + 1) × that gap; one that cannot make
//! its deadline is refused at once, with `Retry-After` the time until it could (the predicted
//! wait minus the allowed wait). A request still waiting at its deadline is refused too. Until
//! [`MIN_RELEASES`] slots have freed the queue predicts nothing and only deadlines apply.
//!
//! Sans-IO and generic over the waiter's payload `T` (the node keeps a wake-up handle there, the
//! simulator a request index): time is passed in, no clock, no randomness.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use super::priority::{ClassConfig, ClassId, MAX_CLASSES};

/// Slots that must have freed before the queue trusts its release rate for predictions.
pub const MIN_RELEASES: u64 = 8;
/// Weight of the newest gap in the mean gap between releases (an exponential average over
/// about the last 20 releases).
const GAP_ALPHA: f64 = 0.05;
/// Largest `Retry-After` the queue suggests, in seconds.
pub const MAX_RETRY_AFTER_S: u32 = 3600;
/// Queued requests a dequeue looks at for one its caller can place (the others wait on).
pub const MAX_SCAN: usize = 64;

/// Why a request was refused instead of waiting (or after waiting).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectReason {
    /// Its class already has `max_queue` requests waiting.
    QueueFull,
    /// Its predicted wait is longer than its class's `max_wait_ms`.
    WaitTooLong,
    /// It waited `max_wait_ms` without a slot.
    Expired,
}

impl RejectReason {
    /// Stable label (`kvmesh_queue_rejected_total{reason}`).
    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::QueueFull => "queue_full",
            RejectReason::WaitTooLong => "wait_too_long",
            RejectReason::Expired => "expired",
        }
    }
}

/// A refusal: why, and when to try again (seconds, 1..=[`MAX_RETRY_AFTER_S`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rejection {
    /// Why.
    pub reason: RejectReason,
    /// Suggested `Retry-After`.
    pub retry_after_s: u32,
}

/// A request leaving the queue, with its payload.
#[derive(Debug)]
pub struct Left<T> {
    /// Its queue id.
    pub id: u64,
    /// Its class.
    pub class: ClassId,
    /// How long it waited.
    pub waited: Duration,
    /// What the caller queued with it.
    pub payload: T,
}

#[derive(Debug)]
struct Entry<T> {
    class: ClassId,
    flow: (ClassId, String),
    tag: f64,
    enqueued: Duration,
    deadline: Duration,
    payload: T,
}

/// A flow's state while it has requests waiting (dropped when it has none: it banks nothing).
#[derive(Debug, Default)]
struct Flow {
    last_tag: f64,
    waiting: usize,
}

/// Waiting requests by class, dequeued by weighted fair queueing, with deadlines.
#[derive(Debug)]
pub struct AdmissionQueue<T> {
    classes: Vec<ClassConfig>,
    /// Waiting requests per class.
    waiting: Vec<usize>,
    entries: HashMap<u64, Entry<T>>,
    /// (tag bits, id): dequeue order. Tags are finite and non-negative, so their bits order as
    /// the numbers do.
    order: BTreeSet<(u64, u64)>,
    /// (deadline, id).
    deadlines: BTreeSet<(Duration, u64)>,
    /// Per flow with requests waiting (at most one per waiting request).
    flows: HashMap<(ClassId, String), Flow>,
    /// The tag of the last request dequeued.
    vtime: f64,
    next_id: u64,
    /// Mean seconds between two releases (exponential average), once two were seen.
    gap_s: Option<f64>,
    last_release: Option<Duration>,
    releases: u64,
}

impl<T> AdmissionQueue<T> {
    /// An empty queue for `classes` (the first [`MAX_CLASSES`] count).
    pub fn new(mut classes: Vec<ClassConfig>) -> Self {
        classes.truncate(MAX_CLASSES);
        AdmissionQueue {
            waiting: vec![0; classes.len()],
            classes,
            entries: HashMap::new(),
            order: BTreeSet::new(),
            deadlines: BTreeSet::new(),
            flows: HashMap::new(),
            vtime: 0.0,
            next_id: 0,
            gap_s: None,
            last_release: None,
            releases: 0,
        }
    }

    /// The classes, in priority order.
    pub fn classes(&self) -> &[ClassConfig] {
        &self.classes
    }

    /// Replaces the classes' weights and bounds (a reload). Only when the names are the same, in
    /// the same order (waiting requests keep their class ids); returns whether it applied.
    /// Waiting requests keep their tags and deadlines; the new bounds apply to new requests.
    pub fn set_classes(&mut self, mut classes: Vec<ClassConfig>) -> bool {
        classes.truncate(MAX_CLASSES);
        let same_names = classes.len() == self.classes.len()
            && classes
                .iter()
                .zip(&self.classes)
                .all(|(a, b)| a.name == b.name);
        if same_names {
            self.classes = classes;
        }
        same_names
    }

    /// Requests waiting, in all classes.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Requests waiting in `class`.
    pub fn waiting_in(&self, class: ClassId) -> usize {
        self.waiting.get(class.index()).copied().unwrap_or(0)
    }

    /// Whether `id` is still waiting.
    pub fn contains(&self, id: u64) -> bool {
        self.entries.contains_key(&id)
    }

    /// A slot freed at `now` (a request finished): feeds the release rate.
    pub fn released(&mut self, now: Duration) {
        if let Some(last) = self.last_release {
            let gap = now.saturating_sub(last).as_secs_f64();
            self.gap_s = Some(match self.gap_s {
                Some(g) => g + GAP_ALPHA * (gap - g),
                None => gap,
            });
        }
        self.last_release = Some(now);
        self.releases = self.releases.saturating_add(1);
    }

    /// The predicted seconds between two releases at `now`, once enough were seen: the mean
    /// gap, or the time since the last release if that is longer (releases stopped).
    pub fn release_gap_s(&self, now: Duration) -> Option<f64> {
        if self.releases < MIN_RELEASES {
            return None;
        }
        let since = self
            .last_release
            .map_or(0.0, |l| now.saturating_sub(l).as_secs_f64());
        self.gap_s.map(|g| g.max(since))
    }

    /// The tag a request of `class` from `tenant` (weight `tenant_weight`) would get now.
    fn tag_for(&self, class: ClassId, flow: &(ClassId, String), tenant_weight: f64) -> f64 {
        let class_weight = self.classes.get(class.index()).map_or(1.0, |c| c.weight);
        let weight = (class_weight * tenant_weight).max(f64::MIN_POSITIVE);
        let start = self
            .flows
            .get(flow)
            .map_or(self.vtime, |f| f.last_tag.max(self.vtime));
        start + 1.0 / weight
    }

    /// Seconds for `n` more releases, if the rate is known.
    fn wait_for(&self, n: usize, now: Duration) -> Option<f64> {
        self.release_gap_s(now).map(|g| g * n as f64)
    }

    /// Queues a request of `class` from `tenant` (weighted `tenant_weight`, clamped to the
    /// classes' weight bounds) at `now`, with `payload`. Refused (the payload handed back) when
    /// the class is full or the predicted wait misses its deadline; else its id.
    pub fn enqueue(
        &mut self,
        class: ClassId,
        tenant: Option<&str>,
        tenant_weight: f64,
        now: Duration,
        payload: T,
    ) -> Result<u64, (Rejection, T)> {
        let Some(cfg) = self.classes.get(class.index()) else {
            return Err((self.rejection(RejectReason::QueueFull, 0.0), payload));
        };
        let max_wait_s = cfg.max_wait_ms as f64 / 1000.0;
        if self.waiting_in(class) >= cfg.max_queue {
            // One place frees per release at best: try again about then.
            let gap = self.release_gap_s(now).unwrap_or(1.0);
            return Err((self.rejection(RejectReason::QueueFull, gap), payload));
        }
        let tenant_weight =
            tenant_weight.clamp(super::priority::MIN_WEIGHT, super::priority::MAX_WEIGHT);
        let flow = (class, tenant.unwrap_or_default().to_owned());
        let tag = self.tag_for(class, &flow, tenant_weight);
        let ahead = self.order.range(..(tag.to_bits(), u64::MAX)).count();
        if let Some(wait) = self.wait_for(ahead + 1, now) {
            if wait > max_wait_s {
                return Err((
                    self.rejection(RejectReason::WaitTooLong, wait - max_wait_s),
                    payload,
                ));
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        let deadline = now + Duration::from_millis(cfg.max_wait_ms);
        let f = self.flows.entry(flow.clone()).or_default();
        f.last_tag = tag;
        f.waiting += 1;
        if let Some(w) = self.waiting.get_mut(class.index()) {
            *w += 1;
        }
        self.order.insert((tag.to_bits(), id));
        self.deadlines.insert((deadline, id));
        self.entries.insert(
            id,
            Entry {
                class,
                flow,
                tag,
                enqueued: now,
                deadline,
                payload,
            },
        );
        Ok(id)
    }

    fn rejection(&self, reason: RejectReason, after_s: f64) -> Rejection {
        let s = after_s.ceil().clamp(1.0, f64::from(MAX_RETRY_AFTER_S));
        Rejection {
            reason,
            retry_after_s: s as u32,
        }
    }

    /// Takes `id` out of the queue (its client left, or it timed out on its own clock).
    fn take(&mut self, id: u64, now: Duration) -> Option<Left<T>> {
        let e = self.entries.remove(&id)?;
        self.order.remove(&(e.tag.to_bits(), id));
        self.deadlines.remove(&(e.deadline, id));
        if let Some(w) = self.waiting.get_mut(e.class.index()) {
            *w = w.saturating_sub(1);
        }
        if let Some(f) = self.flows.get_mut(&e.flow) {
            f.waiting = f.waiting.saturating_sub(1);
            if f.waiting == 0 {
                self.flows.remove(&e.flow);
            }
        }
        Some(Left {
            id,
            class: e.class,
            waited: now.saturating_sub(e.enqueued),
            payload: e.payload,
        })
    }

    /// A freed slot: the waiting request with the smallest tag among the first [`MAX_SCAN`]
    /// that `fits` (the caller's test: can it use this slot?) leaves the queue.
    pub fn pop_next(&mut self, now: Duration, mut fits: impl FnMut(&T) -> bool) -> Option<Left<T>> {
        let id = self
            .order
            .iter()
            .take(MAX_SCAN)
            .map(|&(_, id)| id)
            .find(|id| self.entries.get(id).is_some_and(|e| fits(&e.payload)))?;
        let tag = self.entries.get(&id)?.tag;
        let left = self.take(id, now)?;
        // SCFQ: the virtual time is the tag of the request served last. One passed over by
        // `fits` has a smaller tag than anything queued after this, so it keeps its place.
        self.vtime = self.vtime.max(tag);
        Some(left)
    }

    /// The client of `id` left: it leaves the queue (and frees its place).
    pub fn cancel(&mut self, id: u64, now: Duration) -> Option<Left<T>> {
        self.take(id, now)
    }

    /// Requests whose deadline is at or before `now` leave the queue, each with the
    /// `Retry-After` it gets (the predicted time for the requests that were ahead of it).
    pub fn expire(&mut self, now: Duration) -> Vec<(Left<T>, Rejection)> {
        let due: Vec<u64> = self
            .deadlines
            .range(..=(now, u64::MAX))
            .map(|&(_, id)| id)
            .collect();
        due.into_iter()
            .filter_map(|id| self.expire_one(id, now))
            .collect()
    }

    /// Request `id` timed out (its own timer fired, at or after its deadline): it leaves the
    /// queue with its `Retry-After`.
    pub fn expire_one(&mut self, id: u64, now: Duration) -> Option<(Left<T>, Rejection)> {
        let e = self.entries.get(&id)?;
        let ahead = self.order.range(..(e.tag.to_bits(), id)).count();
        let after = self.wait_for(ahead, now).unwrap_or(1.0);
        let left = self.take(id, now)?;
        Some((left, self.rejection(RejectReason::Expired, after)))
    }

    /// The earliest deadline of a waiting request.
    pub fn next_deadline(&self) -> Option<Duration> {
        self.deadlines.first().map(|&(d, _)| d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::priority::class_by_name;

    const CRITICAL: ClassId = ClassId(0);
    const STANDARD: ClassId = ClassId(1);
    const BATCH: ClassId = ClassId(2);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn queue() -> AdmissionQueue<&'static str> {
        AdmissionQueue::new(ClassConfig::defaults())
    }

    /// `n` releases `gap_ms` apart ending at `end`: the queue learns the release rate.
    fn learn_rate(q: &mut AdmissionQueue<&'static str>, gap_ms: u64, end: Duration) {
        let n = MIN_RELEASES;
        for k in 0..n {
            q.released(end - ms(gap_ms * (n - 1 - k)));
        }
    }

    #[test]
    fn the_default_classes_are_found_by_name() {
        let classes = ClassConfig::defaults();
        assert_eq!(class_by_name(&classes, "critical"), Some(CRITICAL));
        assert_eq!(class_by_name(&classes, "batch"), Some(BATCH));
    }

    #[test]
    fn a_batch_flood_does_not_delay_critical() {
        let mut q = queue();
        for _ in 0..500 {
            q.enqueue(BATCH, Some("flood"), 1.0, ms(0), "batch")
                .map_err(|e| e.0)
                .unwrap();
        }
        // Serving the flood for a while...
        for _ in 0..10 {
            assert_eq!(
                q.pop_next(ms(1), |_| true).map(|l| l.payload),
                Some("batch")
            );
        }
        // ...a critical request arrives behind 490 batch ones and takes the next freed slot.
        q.enqueue(CRITICAL, Some("vip"), 1.0, ms(2), "critical")
            .map_err(|e| e.0)
            .unwrap();
        let next = q.pop_next(ms(3), |_| true).unwrap();
        assert_eq!(
            (next.payload, next.class, next.waited),
            ("critical", CRITICAL, ms(1))
        );
        // Even many critical requests each wait behind at most one batch request per 16 served
        // (the weights' ratio): batch is slowed, not starved.
        for _ in 0..32 {
            q.enqueue(CRITICAL, Some("vip"), 1.0, ms(4), "critical")
                .map_err(|e| e.0)
                .unwrap();
        }
        let served: Vec<_> = (0..34)
            .filter_map(|_| q.pop_next(ms(5), |_| true))
            .collect();
        let batch = served.iter().filter(|l| l.payload == "batch").count();
        assert_eq!(batch, 2, "32 critical and 2 batch in the next 34 slots");
    }

    #[test]
    fn two_tenants_weighted_3_to_1_get_3_to_1_of_the_freed_slots() {
        let mut q = queue();
        for _ in 0..40 {
            q.enqueue(STANDARD, Some("big"), 3.0, ms(0), "big")
                .map_err(|e| e.0)
                .unwrap();
            q.enqueue(STANDARD, Some("small"), 1.0, ms(0), "small")
                .map_err(|e| e.0)
                .unwrap();
        }
        let served: Vec<_> = (0..40)
            .filter_map(|_| q.pop_next(ms(1), |_| true))
            .collect();
        let big = served.iter().filter(|l| l.payload == "big").count();
        assert_eq!((big, 40 - big), (30, 10));
        // An idle tenant banks no credit: one that arrives now is not owed the past.
        for _ in 0..4 {
            q.enqueue(STANDARD, Some("late"), 1.0, ms(2), "late")
                .map_err(|e| e.0)
                .unwrap();
        }
        let served: Vec<_> = (0..12)
            .filter_map(|_| q.pop_next(ms(3), |_| true))
            .collect();
        let count = |who| served.iter().filter(|l| l.payload == who).count();
        let (late, small) = (count("late"), count("small"));
        assert!(
            late.abs_diff(small) <= 1 && late <= 3,
            "late {late}, small {small}: the same weight, the same share from now on"
        );
    }

    #[test]
    fn a_full_class_refuses_at_once_with_retry_after_and_others_still_queue() {
        let mut classes = ClassConfig::defaults();
        classes[2].max_queue = 2;
        let mut q: AdmissionQueue<&str> = AdmissionQueue::new(classes);
        learn_rate(&mut q, 500, ms(10_000));
        for _ in 0..2 {
            q.enqueue(BATCH, None, 1.0, ms(10_000), "b")
                .map_err(|e| e.0)
                .unwrap();
        }
        let (rejected, payload) = q.enqueue(BATCH, None, 1.0, ms(10_000), "b3").unwrap_err();
        assert_eq!(payload, "b3", "the caller gets its payload back");
        assert_eq!(
            rejected,
            Rejection {
                reason: RejectReason::QueueFull,
                retry_after_s: 1
            }
        );
        assert!(q.enqueue(STANDARD, None, 1.0, ms(10_000), "s").is_ok());
        assert_eq!(q.waiting_in(BATCH), 2);
        // A place freed by a leaving client is free again.
        let first = q.pop_next(ms(10_001), |p| *p == "b").map(|l| l.id);
        assert!(first.is_some());
        assert!(q.enqueue(BATCH, None, 1.0, ms(10_001), "b4").is_ok());
    }

    #[test]
    fn a_wait_that_cannot_meet_the_deadline_is_refused_with_the_time_it_needs() {
        let mut q = queue();
        // One slot frees every 500 ms; critical may wait 5 s: ten requests ahead is the most.
        learn_rate(&mut q, 500, ms(60_000));
        let now = ms(60_000);
        for _ in 0..9 {
            q.enqueue(CRITICAL, Some("a"), 1.0, now, "c")
                .map_err(|e| e.0)
                .unwrap();
        }
        assert!(q.enqueue(CRITICAL, Some("a"), 1.0, now, "tenth").is_ok());
        let (r, _) = q
            .enqueue(CRITICAL, Some("a"), 1.0, now, "eleventh")
            .unwrap_err();
        // 11 releases × 0.5 s = 5.5 s, 0.5 s too long: retry in 1 s.
        assert_eq!(r.reason, RejectReason::WaitTooLong);
        assert_eq!(r.retry_after_s, 1);
        // Batch waits up to 30 s, and its requests' tags come after the critical ones: the
        // prediction counts only those ahead of it.
        assert!(q.enqueue(BATCH, Some("b"), 1.0, now, "batch").is_ok());
        // Releases stopping make every prediction longer (the gap is at least the silence).
        let later = now + ms(20_000);
        assert_eq!(q.release_gap_s(later), Some(20.0));
        let (r, _) = q.enqueue(BATCH, Some("b"), 1.0, later, "x").unwrap_err();
        assert_eq!(r.reason, RejectReason::WaitTooLong);
        assert!(r.retry_after_s > 30, "{r:?}");
    }

    #[test]
    fn without_a_known_release_rate_only_deadlines_apply() {
        let mut q = queue();
        q.released(ms(0));
        let id = q
            .enqueue(CRITICAL, None, 1.0, ms(1), "c")
            .map_err(|e| e.0)
            .unwrap();
        assert_eq!(q.next_deadline(), Some(ms(5_001)));
        assert!(q.expire(ms(5_000)).is_empty());
        let expired = q.expire(ms(5_001));
        assert_eq!(expired.len(), 1);
        let (left, r) = &expired[0];
        assert_eq!((left.id, left.waited), (id, ms(5_000)));
        assert_eq!(
            *r,
            Rejection {
                reason: RejectReason::Expired,
                retry_after_s: 1
            }
        );
        assert!(q.is_empty() && q.next_deadline().is_none());
    }

    #[test]
    fn an_expired_request_is_told_when_the_queue_ahead_of_it_should_have_drained() {
        let mut q = queue();
        learn_rate(&mut q, 1_000, ms(100_000));
        for _ in 0..4 {
            q.enqueue(BATCH, Some("x"), 1.0, ms(100_000), "b")
                .map_err(|e| e.0)
                .unwrap();
        }
        let last = q
            .enqueue(BATCH, Some("x"), 1.0, ms(100_000), "last")
            .map_err(|e| e.0)
            .unwrap();
        // Its own timer fired (the node's way); 4 ahead at ≥ 1 s each.
        let (left, r) = q.expire_one(last, ms(101_000)).unwrap();
        assert_eq!(left.payload, "last");
        assert_eq!((r.reason, r.retry_after_s), (RejectReason::Expired, 4));
        assert!(q.expire_one(last, ms(101_000)).is_none(), "gone already");
    }

    #[test]
    fn a_cancelled_request_frees_its_place_and_its_flow() {
        let mut q = queue();
        let a = q
            .enqueue(BATCH, Some("t"), 1.0, ms(0), "a")
            .map_err(|e| e.0)
            .unwrap();
        let b = q
            .enqueue(BATCH, Some("t"), 1.0, ms(0), "b")
            .map_err(|e| e.0)
            .unwrap();
        assert_eq!(q.cancel(a, ms(5)).map(|l| l.payload), Some("a"));
        assert!(q.cancel(a, ms(5)).is_none());
        assert_eq!((q.len(), q.waiting_in(BATCH)), (1, 1));
        assert!(q.contains(b));
        assert_eq!(q.cancel(b, ms(6)).map(|l| l.waited), Some(ms(6)));
        assert!(q.flows.is_empty() && q.deadlines.is_empty() && q.order.is_empty());
    }

    #[test]
    fn a_request_that_cannot_use_the_slot_keeps_its_place() {
        let mut q = queue();
        q.enqueue(CRITICAL, None, 1.0, ms(0), "other-model")
            .map_err(|e| e.0)
            .unwrap();
        q.enqueue(BATCH, None, 1.0, ms(0), "this-model")
            .map_err(|e| e.0)
            .unwrap();
        let got = q.pop_next(ms(1), |p| *p == "this-model").map(|l| l.payload);
        assert_eq!(got, Some("this-model"));
        assert_eq!(
            q.pop_next(ms(1), |_| true).map(|l| l.payload),
            Some("other-model")
        );
        assert!(q.pop_next(ms(1), |_| true).is_none());
    }

    #[test]
    fn a_reload_changes_weights_and_bounds_only_under_the_same_names() {
        let mut q = queue();
        let mut changed = ClassConfig::defaults();
        changed[0].max_queue = 0;
        assert!(q.set_classes(changed));
        let (r, _) = q.enqueue(CRITICAL, None, 1.0, ms(0), "c").unwrap_err();
        assert_eq!(r.reason, RejectReason::QueueFull);
        let renamed = vec![ClassConfig::new("gold", 1.0, 1, 1)];
        assert!(!q.set_classes(renamed));
        assert_eq!(q.classes().len(), 3);
    }
}
