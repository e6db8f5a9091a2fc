//! Waiting for a slot: the node's side of the admission queue (`core::admission`), with the
//! `[priorities]` section set.
//!
//! A request that finds every eligible replica at its `max_in_flight`, or its tenant at a quota,
//! waits in its priority class's queue instead of being sent to a full replica (or refused with
//! 429 at once). The queue lives in the [`Core`], under the node's lock; each waiting request
//! holds the receiving end of a one-shot channel whose sender is its queue payload. A slot frees
//! when a [`super::routing::Ticket`] drops: under the same lock, the next request by weighted
//! fair order that can use it (same model; for one waiting on its tenant's quota, a request of
//! that tenant finished) leaves the queue and is woken; it then routes without waiting again
//! and takes the freed slot. While some request waits, a new one that finds room does not jump
//! the queue: it queues too and hands the room to the head of the queue (itself, if first).
//!
//! Cancel-safe: a waiting request whose client goes away is dropped with its [`Place`], which
//! takes it out of the queue (its place frees); one woken but dropped before it routed passes
//! its slot to the next. A request that waits longer than its class's `max_wait_ms`, or could
//! not meet it, is answered 429 with `Retry-After`. Requests re-routed after a failed attempt or
//! hedged do not queue again: they hold the place they were admitted with.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use super::admission_queue::{class_name, NodeQueue, Refused, Waiter};
use super::routing::Ticket;
use super::state::{Core, Node};
use crate::core::priority::{resolve, ClassId};
use crate::core::router::{Decision, RejectReason as RouteReject, RouteRequest};

impl Node {
    /// The priority class of a request from `tenant` whose priority header says `header`
    /// (`core::priority::resolve`); `None` when the node has no `[priorities]`.
    pub fn priority_class(&self, tenant: Option<&str>, header: Option<&str>) -> Option<ClassId> {
        let p = self.cfg.priorities.as_ref()?;
        let cfgs = self.tenant_cfgs.read().unwrap_or_else(|e| e.into_inner());
        let default = self
            .default_tenant
            .read()
            .unwrap_or_else(|e| e.into_inner());
        let t = tenant.and_then(|t| cfgs.get(t)).unwrap_or(&default);
        Some(resolve(
            &p.classes,
            p.default_id(),
            t.priority.as_deref(),
            t.max_priority.as_deref(),
            header,
        ))
    }

    /// Sets `kvmesh_queue_waiting` from the queue.
    fn queue_gauges(&self, q: &NodeQueue) {
        for (i, c) in q.classes().iter().enumerate() {
            let n = q.waiting_in(ClassId(i as u8));
            self.queue_metrics
                .waiting
                .with_label_values(&[&c.name])
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// A slot freed at replica `replica` by a request of `tenant` (or, with `replica` `None`,
    /// room found by a new request for `model`): the next waiting request that can use it
    /// leaves the queue and is woken. Called under the lock.
    pub(super) fn grant_next(
        &self,
        core: &mut Core,
        replica: Option<usize>,
        model: Option<&str>,
        tenant: Option<&str>,
        now: Duration,
    ) {
        let serves: Vec<String> = match replica {
            Some(i) => core
                .view
                .replica(i)
                .map(|r| r.info.models.clone())
                .unwrap_or_default(),
            None => model.map(|m| vec![m.to_owned()]).unwrap_or_default(),
        };
        let Some(q) = core.admission.as_mut() else {
            return;
        };
        // A woken request whose future is gone already (its place is being dropped) passes it
        // on: try the next, a few times at most.
        for _ in 0..4 {
            let fits = |w: &Waiter| {
                serves.contains(&w.model)
                    && w.quota_tenant
                        .as_deref()
                        .is_none_or(|t| replica.is_some() && Some(t) == tenant)
            };
            let Some(left) = q.pop_next(now, fits) else {
                break;
            };
            let name = class_name(q, left.class);
            self.queue_metrics
                .wait_seconds
                .with_label_values(&[&name])
                .observe(left.waited.as_secs_f64());
            self.queue_metrics
                .admitted
                .with_label_values(&[&name])
                .inc();
            if left.payload.wake.send(()).is_ok() {
                break;
            }
        }
        self.queue_gauges(q);
    }

    /// Routes `req` (of priority `class`), waiting in the admission queue while no replica has
    /// room (see the module doc); without `[priorities]` (`class` `None`) it is
    /// [`Node::route`]. Refused with a `Retry-After` when its class is full or its deadline
    /// cannot be met or passes.
    pub async fn route_fair(
        self: &Arc<Self>,
        req: &RouteRequest<'_>,
        class: Option<ClassId>,
    ) -> Result<(Decision, Option<Ticket>), Refused> {
        let Some(class) = class else {
            return Ok(self.route(req));
        };
        let (tx, rx) = oneshot::channel();
        let mut tx = Some(tx);
        let mut queued: Option<Result<(u64, Duration), Refused>> = None;
        let weight = {
            let cfgs = self.tenant_cfgs.read().unwrap_or_else(|e| e.into_inner());
            let default = self
                .default_tenant
                .read()
                .unwrap_or_else(|e| e.into_inner());
            let t = req.tenant.and_then(|t| cfgs.get(t)).unwrap_or(&default);
            t.weight.unwrap_or(1.0)
        };
        let first = self.route_if(req, |node, core, decision, now| {
            let Some(q) = core.admission.as_mut() else {
                return true;
            };
            let quota = matches!(decision, Decision::Reject(RouteReject::OverQuota));
            let saturated = matches!(decision, Decision::Route(r) if r.saturated);
            let overtaking = matches!(decision, Decision::Route(_)) && !q.is_empty();
            if !(quota || saturated || overtaking) {
                return true;
            }
            let Some(wake) = tx.take() else {
                return true;
            };
            let waiter = Waiter {
                wake,
                model: req.model.to_owned(),
                quota_tenant: quota.then(|| req.tenant.unwrap_or_default().to_owned()),
            };
            let max_wait = q
                .classes()
                .get(class.index())
                .map_or(Duration::ZERO, |c| Duration::from_millis(c.max_wait_ms));
            let outcome = match q.enqueue(class, req.tenant, weight, now, waiter) {
                Ok(id) => {
                    node.queue_gauges(q);
                    Ok((id, max_wait))
                }
                Err((rejection, _)) => {
                    let name = class_name(q, class);
                    node.queue_metrics
                        .rejected
                        .with_label_values(&[&name, rejection.reason.as_str()])
                        .inc();
                    Err(Refused {
                        class: name,
                        rejection,
                    })
                }
            };
            if outcome.is_ok() && !quota && !saturated {
                // Room exists, but others wait: the head of the queue takes it.
                node.grant_next(core, None, Some(req.model), None, now);
            }
            queued = Some(outcome);
            false
        });
        let (id, max_wait) = match (first, queued) {
            (Some(routed), _) => return Ok(routed),
            (None, Some(Ok(q))) => q,
            (None, Some(Err(refused))) => return Err(refused),
            (None, None) => return Ok(self.route(req)),
        };
        let mut place = Place {
            node: Arc::clone(self),
            id,
            class,
            model: req.model.to_owned(),
            rx,
            done: false,
        };
        let granted = tokio::time::timeout(max_wait, &mut place.rx).await;
        if !matches!(granted, Ok(Ok(()))) {
            // Its deadline passed: refused, unless a slot came at the last moment.
            let now = self.now();
            let mut core = self.lock();
            if let Some(q) = core.admission.as_mut() {
                if let Some((_, rejection)) = q.expire_one(id, now) {
                    place.done = true;
                    let name = class_name(q, class);
                    self.queue_metrics
                        .rejected
                        .with_label_values(&[&name, rejection.reason.as_str()])
                        .inc();
                    self.queue_gauges(q);
                    return Err(Refused {
                        class: name,
                        rejection,
                    });
                }
            }
            drop(core);
            if place.rx.try_recv().is_err() {
                // Neither queued nor woken: the queue was reset under it. Route as usual.
                place.done = true;
                return Ok(self.route(req));
            }
        }
        place.done = true;
        let (decision, ticket) = self.route(req);
        if ticket.is_none() {
            // Not served here after all (forwarded, or refused): the slot is the next one's.
            let now = self.now();
            let mut core = self.lock();
            self.grant_next(&mut core, None, Some(req.model), req.tenant, now);
        }
        Ok((decision, ticket))
    }
}

/// A request's place in the queue while it waits; dropping it (the client left) gives the place
/// up, or passes on a slot it was given and did not use.
struct Place {
    node: Arc<Node>,
    id: u64,
    class: ClassId,
    /// Its model (a slot it passes on goes to a request for the same model).
    model: String,
    rx: oneshot::Receiver<()>,
    /// It left the queue by the normal paths (routed, refused): nothing to undo.
    done: bool,
}

impl Drop for Place {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let now = self.node.now();
        let mut guard = self.node.lock();
        let core = &mut *guard;
        let Some(q) = core.admission.as_mut() else {
            return;
        };
        if q.cancel(self.id, now).is_some() {
            let name = class_name(q, self.class);
            self.node
                .queue_metrics
                .rejected
                .with_label_values(&[&name, "client_left"])
                .inc();
            self.node.queue_gauges(q);
        } else if self.rx.try_recv().is_ok() {
            // Woken, then gone before routing: the slot goes to the next.
            self.node
                .grant_next(core, None, Some(&self.model), None, now);
        }
    }
}
