//! The node's watcher tasks: per replica, active health checks and `/metrics` scrapes on their
//! intervals and its KV-event subscriber; per DNS source, the resolver loop; per Kubernetes
//! source, its list-and-watch loop; for the node, the summary/overlay/ejection upkeep. Each task
//! asks the replica (`replicas::probe`, the KV-event stream, DNS, the Kubernetes API) and hands
//! the answer to the node's state (`feedback.rs`, `registry.rs`).
//!
//! The replica layer feeds the node through narrow traits the node implements —
//! `KvEventSink` in `feedback.rs`, `ReplicaRegistry` in `registry.rs` — so nothing under
//! `replicas/` knows the node.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::state::Node;
use crate::replicas::dns::{self, DnsSource};
use crate::replicas::k8s::K8sSource;
use crate::replicas::kv_events::{self, KvEventSink, KvEventsSource};
use crate::replicas::probe;
use crate::shutdown::stopped;

/// One active check of replica `i`: `/health`, then `/v1/models` if its models are unknown.
pub(super) async fn check_once(node: &Node, i: usize) {
    let Some(ep) = node.endpoint(i) else {
        return;
    };
    let Some(incarnation) = node.live_incarnation(i) else {
        return;
    };
    // In a mesh, followers leave most checks to the replica's home (see `mesh_roles.rs`).
    if node.is_removed(i) || !node.should_check(i) {
        return;
    }
    let timeout = Duration::from_millis(node.cfg.health.timeout_ms);
    let ok = probe::health(&node.client, &ep.id, &ep.base, timeout).await;
    let models = if ok && node.needs_models(i) {
        probe::models(&node.client, &ep.id, &ep.base, timeout).await
    } else {
        None
    };
    // Applied only to the incarnation asked: the slot may have gone to another replica.
    node.active_check(i, incarnation, ok, models);
}

/// Unix ms of the last warning about refused scrape values (process-wide: one per 10 s).
static LAST_REFUSED_WARN: AtomicU64 = AtomicU64::new(0);

/// Whether a warning rate-limited by `last` (unix ms) may be logged now; at most once per 10 s.
fn warn_due(last: &AtomicU64) -> bool {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let prev = last.load(Ordering::Relaxed);
    now.saturating_sub(prev) >= 10_000
        && last
            .compare_exchange(prev, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}

/// One scrape of replica `i`'s `/metrics`.
pub(super) async fn scrape_once(node: &Node, i: usize) {
    let Some(ep) = node.endpoint(i) else {
        return;
    };
    let Some(incarnation) = node.live_incarnation(i) else {
        return;
    };
    if node.is_removed(i) || !node.should_scrape(i) {
        return;
    }
    let timeout = Duration::from_millis(node.cfg.scrape.timeout_ms);
    let id: &str = &ep.id;
    match probe::metrics(&node.client, &ep.base, timeout).await {
        Ok(load) => {
            if load.skipped_lines > 0 {
                node.metrics.scrape_skipped_lines.inc_by(load.skipped_lines);
            }
            if load.refused_values > 0 {
                node.metrics
                    .scrape_refused
                    .with_label_values(&[id])
                    .inc_by(load.refused_values);
                if warn_due(&LAST_REFUSED_WARN) {
                    tracing::warn!(replica = %id, refused = load.refused_values, "scrape values out of bounds refused (further ones counted, not logged, for 10 s)");
                }
            }
            if let Err(e) = node.apply_scrape(i, incarnation, load) {
                tracing::warn!(replica = %id, error = %e, "cannot apply scrape");
            }
        }
        Err(e) => {
            tracing::debug!(replica = %id, error = %e, "scrape failed");
            node.metrics.scrape_errors.with_label_values(&[id]).inc();
        }
    }
}

/// Runs one check round and one scrape round over `replicas` concurrently (used before serving
/// and when DNS adds replicas, so routing starts knowing health, models and capacities).
pub async fn check_all(node: &Arc<Node>, replicas: impl Iterator<Item = usize>) {
    let scrape = node.cfg.scrape.interval_ms > 0;
    futures::future::join_all(replicas.map(|i| async move {
        check_once(node, i).await;
        if scrape {
            scrape_once(node, i).await;
        }
    }))
    .await;
}

/// Spawns the watcher tasks of replica `i`: health checks and scrapes on their intervals, and
/// its KV-event subscriber if configured, until `stop` turns true or the replica is dropped
/// (`registry.rs`; a revived replica gets new ones).
pub(super) fn spawn_replica_watchers(node: &Arc<Node>, stop: &watch::Receiver<bool>, i: usize) {
    let Some(incarnation) = node.live_incarnation(i) else {
        return;
    };
    spawn_kv_events(node, stop, i);
    let period = Duration::from_millis(node.cfg.health.interval_ms);
    spawn_replica_every(node, stop, period, i, incarnation, move |n| async move {
        check_once(&n, i).await
    });
    if node.cfg.scrape.interval_ms > 0 {
        let period = Duration::from_millis(node.cfg.scrape.interval_ms);
        spawn_replica_every(node, stop, period, i, incarnation, move |n| async move {
            scrape_once(&n, i).await
        });
    }
}

/// [`spawn_every`] for replica `i`'s incarnation `incarnation`: ends when it is dropped.
fn spawn_replica_every<F, Fut>(
    node: &Arc<Node>,
    stop: &watch::Receiver<bool>,
    period: Duration,
    i: usize,
    incarnation: u64,
    f: F,
) where
    F: Fn(Arc<Node>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let node = Arc::clone(node);
    let mut stop = stop.clone();
    tokio::spawn(async move {
        // Now, then on the process's grid (a run that overruns skips to the next grid tick).
        let mut every = tokio::time::interval_at(on_the_grid(period), period);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            if node.live_incarnation(i) != Some(incarnation) {
                break;
            }
            f(Arc::clone(&node)).await;
            tokio::select! {
                _ = every.tick() => {}
                _ = stopped(&mut stop) => break,
            }
        }
    });
}

/// The next instant of a grid of `period` that every replica watcher of this process shares,
/// so their ticks of one period fall on the same instants and the node wakes once per period
/// for all its replicas, not once per replica and watcher: a node that knows 32 replicas woke
/// 64 times a second for checks that, on the nodes that are not the replica's home, only find
/// it is not theirs (a third of an idle node's wake-ups). The grid's phase is random per
/// process, so the nodes of one host do not all fire at once.
fn on_the_grid(period: Duration) -> tokio::time::Instant {
    static PHASE_MS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let phase = *PHASE_MS.get_or_init(rand::random::<u64>);
    let period_ms = u64::try_from(period.as_millis()).unwrap_or(u64::MAX).max(1);
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(0));
    let wait = period_ms - now_ms.wrapping_add(phase) % period_ms;
    let now = tokio::time::Instant::now();
    now.checked_add(Duration::from_millis(wait)).unwrap_or(now)
}

/// Spawns every watcher: per registered replica, health checks and scrapes; for the node, the
/// summary/overlay/ejection upkeep; per DNS source, the resolver loop; per Kubernetes source,
/// its list-and-watch loop. All stop when `stop` turns true.
pub fn spawn_watchers(
    node: &Arc<Node>,
    stop: &watch::Receiver<bool>,
    dns: Vec<(dns::DnsSource, Duration)>,
    kubernetes: Vec<K8sSource>,
) {
    for i in 0..node.replica_count() {
        spawn_replica_watchers(node, stop, i);
    }
    let period = Duration::from_millis(node.cfg.summary_interval_ms);
    spawn_every(node, stop, period, |n| async move { n.tick() });
    super::hot_prefix::spawn_hot_prefix(node, stop);
    for (source, next) in dns {
        tokio::spawn(run_dns(Arc::clone(node), source, next, stop.clone()));
    }
    for source in kubernetes {
        tokio::spawn(run_k8s(Arc::clone(node), source, stop.clone()));
    }
}

fn spawn_every<F, Fut>(node: &Arc<Node>, stop: &watch::Receiver<bool>, period: Duration, f: F)
where
    F: Fn(Arc<Node>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let node = Arc::clone(node);
    let mut stop = stop.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(period);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = every.tick() => f(Arc::clone(&node)).await,
                _ = stopped(&mut stop) => break,
            }
        }
    });
}

/// How often a KV-event supervisor looks whether its replica left (or came back).
const KV_REGISTRY_POLL: Duration = Duration::from_millis(200);

/// Starts the KV-event subscriber of a static replica `i` if its `[[replicas]]` entry has
/// `kv_events` (DNS- and Kubernetes-found replicas get theirs from their source, in
/// [`run_dns`] and [`run_k8s`]).
fn spawn_kv_events(node: &Arc<Node>, stop: &watch::Receiver<bool>, i: usize) {
    let source = node
        .lock()
        .replicas
        .get(i)
        .and_then(|rt| rt.kv_source.clone());
    if let Some(source) = source {
        ensure_kv_events(node, stop, i, source);
    }
}

/// Makes sure replica `i` has a KV-event supervisor: it subscribes while the replica is in the
/// registry, stops (back to the approximate model) when it leaves, subscribes again when it
/// comes back, and ends when `stop` turns true or the replica is dropped (a departed replica
/// keeps no task; revived, or its slot reused, it gets a new one). At most one per replica
/// incarnation; later calls are no-ops.
pub(super) fn ensure_kv_events(
    node: &Arc<Node>,
    stop: &watch::Receiver<bool>,
    i: usize,
    source: KvEventsSource,
) {
    let Some(ep) = node.endpoint(i) else {
        return;
    };
    let Some(incarnation) = node.live_incarnation(i) else {
        return;
    };
    {
        let mut watched = node.kv_watched.lock().unwrap_or_else(|p| p.into_inner());
        if watched.get(&i) == Some(&incarnation) {
            return;
        }
        // An older incarnation's supervisor is on its way out (it sees the change).
        watched.insert(i, incarnation);
    }
    if node.tokenizer.is_none() {
        tracing::warn!(replica = %ep.id, "kv_events without [tokenizer]: event keys are token keys, text-mode requests will not match them");
    }
    let node = Arc::clone(node);
    let mut stop = stop.clone();
    tokio::spawn(async move {
        supervise_kv_events(&node, &mut stop, i, incarnation, ep, source).await;
        // Ended with its incarnation: the slot may get a supervisor again. (One that gave up on
        // bad endpoints stays listed, so it is not restarted to fail again.)
        if node.live_incarnation(i) != Some(incarnation) {
            let mut watched = node.kv_watched.lock().unwrap_or_else(|p| p.into_inner());
            if watched.get(&i) == Some(&incarnation) {
                watched.remove(&i);
            }
        }
    });
}

/// The supervisor of [`ensure_kv_events`]: runs replica `i`'s subscriber while it is wanted,
/// until the node stops or the replica's `incarnation` ends.
async fn supervise_kv_events(
    node: &Arc<Node>,
    stop: &mut watch::Receiver<bool>,
    i: usize,
    incarnation: u64,
    ep: super::state::Endpoint,
    source: KvEventsSource,
) {
    let current = || node.live_incarnation(i) == Some(incarnation);
    // Registry changes wake it at once; the poll catches what else moves homes (the mesh).
    let mut changed = node.registry_changed.subscribe();
    loop {
        // Wait until the replica is in the registry (and, learned, homed here).
        while !node.kv_events_wanted(i) {
            if !current() {
                return;
            }
            tokio::select! {
                _ = tokio::time::sleep(KV_REGISTRY_POLL) => {}
                _ = changed.changed() => {}
                _ = stopped(stop) => return,
            }
        }
        // Atomic with the incarnation check: a slot with a subscription is never dropped (its
        // events must not reach whoever takes the slot next).
        if !node.begin_kv_subscription(i, incarnation) {
            return;
        }
        let (leave, leave_rx) = watch::channel(false);
        let sink: Arc<dyn KvEventSink> = Arc::clone(node) as Arc<dyn KvEventSink>;
        let mut sub = tokio::spawn(kv_events::run(
            sink,
            node.kv_metrics.clone(),
            i,
            Arc::clone(&ep.id),
            source.clone(),
            node.cfg.kv_events,
            leave_rx,
        ));
        let node_stopped = loop {
            tokio::select! {
                _ = async {
                    tokio::select! {
                        _ = tokio::time::sleep(KV_REGISTRY_POLL) => {}
                        _ = changed.changed() => {}
                    }
                } => {
                    if !node.kv_events_wanted(i) || !current() {
                        tracing::info!(replica = %ep.id, "replica left the registry or this node's homes: KV-event subscription ends");
                        break false;
                    }
                }
                _ = stopped(stop) => break true,
                // The subscriber gave up on its own (bad endpoints, logged): so do we.
                _ = &mut sub => {
                    node.end_kv_subscription(i);
                    return;
                }
            }
        };
        let _ = leave.send(true);
        let _ = sub.await;
        node.end_kv_subscription(i);
        if !current() {
            // Its last writer is done: the replica's KV series go with it.
            node.kv_metrics.forget(&ep.id);
        }
        if node_stopped {
            return;
        }
    }
}

/// Keeps a source's replicas in the registry until `stop` turns true, first resolving after
/// `next`.
async fn run_dns(
    node: Arc<Node>,
    mut source: DnsSource,
    mut next: Duration,
    mut stop: watch::Receiver<bool>,
) {
    // The source's replicas (from the resolution before serving, then from each one) get their
    // KV-event subscribers; ones seen before are no-ops.
    for (i, kv) in source.kv_events_members() {
        ensure_kv_events(&node, &stop, i, kv);
    }
    loop {
        tokio::select! {
            _ = tokio::time::sleep(next) => {}
            _ = stopped(&mut stop) => return,
        }
        let (added, wait) = source.sync(node.as_ref()).await;
        next = wait;
        for &i in &added {
            spawn_replica_watchers(&node, &stop, i);
        }
        for (i, kv) in source.kv_events_members() {
            ensure_kv_events(&node, &stop, i, kv);
        }
        if !added.is_empty() {
            check_all(&node, added.into_iter()).await;
        }
    }
}

/// Keeps a Kubernetes source's replicas in the registry until `stop` turns true: the source
/// lists and watches (reconnecting, keeping its set through API outages); each change starts
/// the watchers of replicas new to the node and checks them at once.
async fn run_k8s(node: Arc<Node>, mut source: K8sSource, mut stop: watch::Receiver<bool>) {
    // The replicas of the list before serving get their KV-event subscribers first.
    for (i, kv) in source.kv_events_members() {
        ensure_kv_events(&node, &stop, i, kv);
    }
    loop {
        let added = tokio::select! {
            added = source.next_change(node.as_ref()) => added,
            _ = stopped(&mut stop) => return,
        };
        for &i in &added {
            spawn_replica_watchers(&node, &stop, i);
        }
        for (i, kv) in source.kv_events_members() {
            ensure_kv_events(&node, &stop, i, kv);
        }
        if !added.is_empty() {
            check_all(&node, added.into_iter()).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Watchers started at different moments tick on one grid: their first ticks are the same
    /// instant or whole periods apart, never the time between their starts.
    #[tokio::test]
    async fn replica_watchers_of_one_period_tick_on_one_grid() {
        let period = Duration::from_millis(1000);
        let a = on_the_grid(period);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let b = on_the_grid(period);
        let now = tokio::time::Instant::now();
        assert!(a <= now + period && b <= now + period);
        let apart = b.duration_since(a).as_millis() % 1000;
        // Two clocks read a moment apart: a few ms of slack, far below the 300 ms between.
        assert!(apart <= 20 || apart >= 980, "{apart} ms off the grid");
    }
}
