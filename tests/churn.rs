//! No state that only grows: 1,000 replicas added and removed through the admin API (each
//! with KV events, as a Kubernetes rollout's pods would be) leave the node's registry, view and
//! task count where they were: a departed replica's slot is reclaimed by the next new one and
//! its watcher tasks, KV-event supervisor included, end.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{bounded, sim_replica, wait_for};
use kvmesh::mesh::admin::AdminOp;
use kvmesh::node::config::{NodeConfig, ReplicaConfig};
use kvmesh::node::Node;
use kvmesh::proxy;
use kvmesh::replica::KvEventsConfig;
use kvmesh::replicas::kv_events::KvEventsSource;

const CYCLES: usize = 1_000;

/// Metric series the node exports.
fn series(node: &Arc<Node>) -> usize {
    node.metrics
        .registry
        .gather()
        .iter()
        .map(|f| f.get_metric().len())
        .sum()
}

fn alive_tasks() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

/// Slots in the registry and in the view (they must stay equal).
fn slots(node: &Arc<Node>) -> (usize, usize) {
    let views = node.lock().view.replicas().len();
    (node.replica_count(), views)
}

/// Adds replica `id` (at `url`, KV events at `events`) and removes it again; returns once the
/// node dropped it (drained, its tasks told to end).
async fn cycle(node: &Arc<Node>, id: &str, url: &str, events: &str) {
    let spec = ReplicaConfig {
        id: Some(id.to_owned()),
        models: vec!["sim-llama-8b".into()],
        kv_events: Some(KvEventsSource::new(events)),
        ..ReplicaConfig::from_url(url.to_owned())
    };
    node.admin_command(AdminOp::Add, id, Some(&spec))
        .expect("add");
    node.admin_command(AdminOp::Remove, id, None)
        .expect("remove");
    let i = node.lock().view.index_of(id).expect("its slot");
    let dropped = wait_for(Duration::from_secs(10), || {
        node.lock().replicas.get(i).is_none_or(|rt| rt.dropped)
    })
    .await;
    assert!(dropped.is_some(), "{id} never dropped after its drain");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_replicas_come_and_go_and_leave_nothing_behind() {
    bounded(240, async {
        let r = sim_replica("engine", |c| c.kv_events = Some(KvEventsConfig::default())).await;
        let url = r.base_url();
        let events = format!("tcp://127.0.0.1:{}", r.kv_events_port.expect("KV events"));
        proxy::install_crypto_provider();
        let mut cfg = NodeConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            drain_s: 1,
            summary_interval_ms: 10,
            drop_departed_after_s: 0,
            ..NodeConfig::default()
        };
        cfg.health.interval_ms = 50;
        cfg.scrape.interval_ms = 50;
        let running = proxy::spawn(cfg).await.unwrap();
        let node = Arc::clone(&running.node);

        // Warm up (lazy statics, connection pools), then take the baseline.
        for k in 0..20 {
            cycle(&node, &format!("warm-{k}"), &url, &events).await;
        }
        // The warm-up's departed tasks end on their next tick.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let tasks_before = alive_tasks();
        let slots_before = slots(&node);
        let series_before = series(&node);

        for k in 0..CYCLES {
            cycle(&node, &format!("pod-{k}"), &url, &events).await;
        }

        // Tasks of departed replicas end on their next tick; wait for them, bounded.
        wait_for(Duration::from_secs(20), || alive_tasks() <= tasks_before + 4).await;
        let tasks_after = alive_tasks();
        let slots_after = slots(&node);
        let series_after = series(&node);
        println!(
            "after {CYCLES} add/remove cycles: tasks {tasks_before} → {tasks_after}, slots {slots_before:?} → {slots_after:?}, metric series {series_before} → {series_after}"
        );
        assert_eq!(slots_after.0, slots_after.1, "registry and view disagree");
        assert!(
            slots_after.0 <= slots_before.0 + 2,
            "the registry grew from {slots_before:?} to {slots_after:?} slots"
        );
        assert!(
            tasks_after <= tasks_before + 4,
            "tasks grew from {tasks_before} to {tasks_after}"
        );
        assert!(
            series_after <= series_before + 16,
            "metric series grew from {series_before} to {series_after}"
        );
        // A departed id is gone from the view; the last one's slot serves a newcomer.
        assert!(node.lock().view.index_of("pod-0").is_none());

        running.shutdown().await;
        r.shutdown().await;
    })
    .await;
}
