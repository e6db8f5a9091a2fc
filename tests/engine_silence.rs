//! Engines watched for silence: a node follows a real `kvmesh replica` process's KV events;
//! while the publisher is idle but alive (it answers the node's ZMTP `PING`s) the replica's cache
//! model stays exact; once the process is stopped (SIGSTOP: its connection stays open, nothing
//! answers) the node notices within `[kv_events] silence_ms`, counts a silence and falls back to
//! the approximate model; after SIGCONT the stream reconnects and the model is exact again.

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{bounded, client, free_tcp_port, wait_for, wait_until};
use kvmesh::core::cache_model::CacheSource;
use kvmesh::node::config::{KvWatchConfig, NodeConfig, ReplicaConfig as NodeReplica};
use kvmesh::proxy::{self, RunningNode};
use kvmesh::replicas::kv_events::KvEventsSource;

/// Heartbeats every 100 ms; silent after 600 ms.
const WATCH: KvWatchConfig = KvWatchConfig {
    heartbeat_ms: 100,
    silence_ms: 600,
};

/// Sends `signal` (`STOP`, `CONT`) to process `pid`.
fn signal(pid: u32, signal: &str) {
    let ok = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "kill -{signal} {pid}");
}

async fn node_for(http: u16, events: u16, replay: u16) -> RunningNode {
    proxy::install_crypto_provider();
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        drain_s: 1,
        kv_events: WATCH,
        ..NodeConfig::default()
    };
    cfg.health.interval_ms = 200;
    cfg.scrape.interval_ms = 0;
    cfg.replicas = vec![NodeReplica {
        id: Some("r0".into()),
        models: vec!["sim-llama-8b".into()],
        kv_events: Some(KvEventsSource {
            replay: Some(format!("tcp://127.0.0.1:{replay}")),
            ..KvEventsSource::new(format!("tcp://127.0.0.1:{events}"))
        }),
        ..NodeReplica::from_url(format!("http://127.0.0.1:{http}"))
    }];
    proxy::spawn(cfg).await.unwrap()
}

fn source(node: &RunningNode) -> CacheSource {
    node.node.lock().replicas[0].cache.source()
}

fn silences(node: &RunningNode) -> u64 {
    node.node
        .kv_metrics
        .silences
        .with_label_values(&["r0"])
        .get()
}

#[tokio::test]
async fn a_stopped_publisher_is_found_silent_and_the_model_goes_approximate() {
    bounded(90, async {
        let (http, events, replay) = (free_tcp_port(), free_tcp_port(), free_tcp_port());
        let mut replica = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvmesh"))
            .args(["replica", "--host", "127.0.0.1", "--id", "r0"])
            .args(["--port", &http.to_string()])
            .args(["--kv-events-port", &events.to_string()])
            .args(["--kv-replay-port", &replay.to_string()])
            .args(["--time-scale", "50"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("kvmesh replica");
        let pid = replica.id().expect("its pid");
        let http_client = client();
        let health = format!("http://127.0.0.1:{http}/health");
        let up = wait_until(Duration::from_secs(30), async || {
            http_client
                .get(&health)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
        })
        .await;
        assert!(up.is_some(), "the replica process never served /health");

        let node = node_for(http, events, replay).await;
        let exact = wait_for(Duration::from_secs(20), || {
            source(&node) == CacheSource::Exact
        })
        .await;
        assert!(exact.is_some(), "the stream never came up");

        // Idle but alive: no events for several silences, yet its PONGs keep the stream up.
        tokio::time::sleep(Duration::from_millis(WATCH.silence_ms * 3)).await;
        assert_eq!(
            source(&node),
            CacheSource::Exact,
            "an idle publisher is not a dead one"
        );
        assert_eq!(silences(&node), 0);

        // Stopped: the TCP connection stays open, nothing answers.
        signal(pid, "STOP");
        let stopped_at = Instant::now();
        let limit = Duration::from_secs(20);
        let seen = wait_for(limit, || source(&node) == CacheSource::Approximate).await;
        let took = stopped_at.elapsed();
        signal(pid, "CONT");
        assert!(
            seen.is_some(),
            "a stopped publisher left the model exact for {limit:?}"
        );
        // Found within the configured deadline: one silence, plus the ping tick that sees it,
        // plus slack for a busy machine's scheduling (still far below "never").
        let deadline = Duration::from_millis(WATCH.silence_ms + WATCH.heartbeat_ms + 2_000);
        assert!(
            took <= deadline,
            "found after {took:?}, deadline {deadline:?}"
        );
        assert!(silences(&node) >= 1);
        println!(
            "silence found after {} ms (silence_ms {})",
            took.as_millis(),
            WATCH.silence_ms
        );

        // Resumed: the node reconnects and follows the events exactly again.
        let back = wait_for(Duration::from_secs(30), || {
            source(&node) == CacheSource::Exact
        })
        .await;
        assert!(back.is_some(), "the stream never came back after SIGCONT");

        node.shutdown().await;
        let _ = replica.kill().await;
    })
    .await;
}
