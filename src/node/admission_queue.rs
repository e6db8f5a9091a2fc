//! The admission queue's parts the node's state holds: what a waiting request leaves in the
//! queue, the queue's type, its per-class metrics and the refusal a request gets. Apart from
//! `admission.rs` (which drives them) so that the node's state can hold them without importing
//! the request path.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};
use tokio::sync::oneshot;

use crate::core::admission::{AdmissionQueue, RejectReason, Rejection};
use crate::core::priority::ClassId;

/// What a waiting request leaves in the queue.
#[derive(Debug)]
pub struct Waiter {
    /// Wakes the request when it is given a slot.
    pub(super) wake: oneshot::Sender<()>,
    /// Its model: only a slot of a replica serving it can be given to it.
    pub(super) model: String,
    /// Its tenant, when it waits on its tenant's quota: only a slot that tenant freed is its.
    pub(super) quota_tenant: Option<String>,
}

/// The admission queue of a node.
pub type NodeQueue = AdmissionQueue<Waiter>;

/// Why a request was refused after (or instead of) waiting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused {
    /// Its class's name.
    pub class: String,
    /// Why (`queue_full`, `wait_too_long`, `expired`), and when to retry.
    pub rejection: Rejection,
}

/// Per-class queue metrics (label `class`).
#[derive(Clone)]
pub struct QueueMetrics {
    /// `kvmesh_queue_waiting{class}`: requests waiting for a slot now.
    pub waiting: IntGaugeVec,
    /// `kvmesh_queue_wait_seconds{class}`: how long requests that got a slot waited.
    pub wait_seconds: HistogramVec,
    /// `kvmesh_queue_admitted_total{class}`: requests that got a slot after waiting.
    pub admitted: IntCounterVec,
    /// `kvmesh_queue_rejected_total{class,reason}`: requests refused (`queue_full`,
    /// `wait_too_long`, `expired`) or gone (`client_left`).
    pub rejected: IntCounterVec,
}

impl QueueMetrics {
    /// Creates and registers them.
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let waiting = IntGaugeVec::new(
            Opts::new(
                "kvmesh_queue_waiting",
                "Requests waiting for a slot in the admission queue, by priority class",
            ),
            &["class"],
        )?;
        let wait_seconds = HistogramVec::new(
            HistogramOpts::new(
                "kvmesh_queue_wait_seconds",
                "Time requests waited in the admission queue before getting a slot",
            )
            .buckets(prometheus::exponential_buckets(0.001, 2.0, 18)?),
            &["class"],
        )?;
        let admitted = IntCounterVec::new(
            Opts::new(
                "kvmesh_queue_admitted_total",
                "Requests that got a slot after waiting in the admission queue",
            ),
            &["class"],
        )?;
        let rejected = IntCounterVec::new(
            Opts::new(
                "kvmesh_queue_rejected_total",
                "Requests refused by the admission queue (queue_full, wait_too_long, expired) or whose client left (client_left)",
            ),
            &["class", "reason"],
        )?;
        registry.register(Box::new(waiting.clone()))?;
        registry.register(Box::new(wait_seconds.clone()))?;
        registry.register(Box::new(admitted.clone()))?;
        registry.register(Box::new(rejected.clone()))?;
        Ok(QueueMetrics {
            waiting,
            wait_seconds,
            admitted,
            rejected,
        })
    }
}

/// The class name of `class` in `q`.
pub(super) fn class_name(q: &NodeQueue, class: ClassId) -> String {
    q.classes()
        .get(class.index())
        .map_or_else(|| "?".to_owned(), |c| c.name.clone())
}

/// The `Retry-After` and label of a refusal, for the HTTP answer.
pub fn refusal_label(r: RejectReason) -> &'static str {
    match r {
        RejectReason::QueueFull => "priority_queue_full",
        RejectReason::WaitTooLong => "priority_wait_too_long",
        RejectReason::Expired => "priority_queue_timeout",
    }
}
