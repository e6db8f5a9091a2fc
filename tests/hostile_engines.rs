//! Bytes and numbers from engines, at their worst: a `/metrics` line claiming 10^15 KV blocks, a
//! ZMQ "publisher" declaring a 2^40-byte frame, and DNS-found replicas whose KV events must be
//! subscribed to (and dropped when they leave). Everything on loopback, every test time-bounded.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::routing::get;
use kvmesh::core::cache_model::MAX_CAPACITY_BLOCKS;
use kvmesh::node::config::{NodeConfig, ReplicaConfig as NodeReplica};
use kvmesh::proxy::{self, RunningNode};
use kvmesh::replicas::entry::DEFAULT_CAPACITY_TOKENS;
use kvmesh::replicas::kv_events::KvEventsSource;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

mod common;
use common::dns::fake_dns;

const LIMIT: Duration = Duration::from_secs(30);
const MODEL: &str = "m";

async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(LIMIT, f)
        .await
        .expect("test exceeded its time bound")
}

fn init() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    proxy::install_crypto_provider();
}

/// A tiny engine: `/health`, `/v1/models` and a `/metrics` body of our choosing.
async fn engine(metrics: &'static str) -> SocketAddr {
    let app = axum::Router::new()
        .route("/health", get(|| async { "ok" }))
        .route(
            "/v1/models",
            get(|| async { axum::Json(serde_json::json!({"data": [{"id": MODEL}]})) }),
        )
        .route("/metrics", get(move || async move { metrics }));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

fn node_config() -> NodeConfig {
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        drain_s: 1,
        ..NodeConfig::default()
    };
    cfg.health.interval_ms = 100;
    cfg.scrape.interval_ms = 50;
    cfg.timeouts.connect_ms = 500;
    cfg
}

async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Before: `num_gpu_blocks × block_size` sized the replica's cache model (a Bloom filter and a
/// preallocated LRU of 10^15 blocks): the allocation aborted the node at its first scrape.
/// After: the line is refused and counted, the model keeps its default size.
#[tokio::test]
async fn an_absurd_cache_config_is_refused_and_counted() {
    init();
    bounded(async {
        let addr = engine(concat!(
            "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1000000000000000\"} 1.0\n",
            "vllm:num_requests_waiting{engine=\"0\"} 1e300\n",
            "vllm:num_requests_running{engine=\"0\"} 2\n",
        ))
        .await;
        let mut cfg = node_config();
        cfg.replicas = vec![NodeReplica::from_url(format!("http://{addr}"))];
        let node: RunningNode = proxy::spawn(cfg).await.unwrap();
        let id = addr.to_string();
        let refused = || {
            node.node
                .metrics
                .scrape_refused
                .with_label_values(&[&id])
                .get()
        };
        // Several scrapes, each refusing both bad values.
        wait_for("refused values", || refused() >= 4).await;
        {
            let core = node.node.lock();
            let r = core.view.replica(0).unwrap();
            assert_eq!(r.info.capacity_tokens, DEFAULT_CAPACITY_TOKENS);
            let summary = core.replicas[0].cache.summary();
            assert!(summary.capacity_items() <= MAX_CAPACITY_BLOCKS);
            assert!(
                summary.filter_bytes() < 1 << 20,
                "{}",
                summary.filter_bytes()
            );
            // The good line of the same scrape was used.
            assert_eq!(core.replicas[0].engine.and_then(|e| e.running), Some(2.0));
        }
        assert!(node.shutdown().await);
    })
    .await;
}

/// A raw TCP "publisher": ZMTP greeting and READY (as a PUB), then (if `declared`) one frame
/// header declaring that many bytes and nothing more. Counts the connections it accepted and the
/// ones the peer closed.
async fn hostile_publisher(declared: Option<u64>) -> (u16, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    hostile_peer(b"PUB", declared).await
}

/// The same as any socket type (`ROUTER` for a replay endpoint).
async fn hostile_peer(
    socket_type: &'static [u8],
    declared: Option<u64>,
) -> (u16, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let closed = Arc::new(AtomicUsize::new(0));
    let (a, c) = (accepted.clone(), closed.clone());
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            a.fetch_add(1, Ordering::SeqCst);
            let c = c.clone();
            tokio::spawn(async move {
                let mut greeting = [0u8; 64];
                greeting[0] = 0xff;
                greeting[9] = 0x7f;
                greeting[10] = 3;
                greeting[12..16].copy_from_slice(b"NULL");
                let mut ready = vec![0x04, 22 + socket_type.len() as u8, 5];
                ready.extend_from_slice(b"READY");
                ready.push(11);
                ready.extend_from_slice(b"Socket-Type");
                ready.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
                ready.extend_from_slice(socket_type);
                let mut out = greeting.to_vec();
                out.extend_from_slice(&ready);
                if let Some(declared) = declared {
                    out.push(0x02);
                    out.extend_from_slice(&declared.to_be_bytes());
                }
                if s.write_all(&out).await.is_err() {
                    return;
                }
                // Hold the connection open, never sending the body: only the peer ends it.
                let mut buf = [0u8; 1024];
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => {
                            c.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                        Ok(_) => {}
                    }
                }
            });
        }
    });
    (port, accepted, closed)
}

/// Before: the `zeromq` crate reserved the declared 2^40 bytes and the allocation aborted the
/// node. After: the node's ZMTP client refuses the header, drops the connection, counts it as
/// malformed, and reconnects with backoff, still serving.
#[tokio::test]
async fn a_publisher_declaring_a_huge_frame_is_dropped_without_allocating_it() {
    init();
    bounded(async {
        let (port, accepted, closed) = hostile_publisher(Some(1 << 40)).await;
        let addr = engine("vllm:num_requests_running 0\n").await;
        let mut cfg = node_config();
        cfg.replicas = vec![NodeReplica {
            id: Some("r0".into()),
            kv_events: Some(KvEventsSource::new(format!("tcp://127.0.0.1:{port}"))),
            ..NodeReplica::from_url(format!("http://{addr}"))
        }];
        let node = proxy::spawn(cfg).await.unwrap();
        let malformed = || {
            node.node
                .kv_metrics
                .malformed
                .with_label_values(&["r0"])
                .get()
        };
        wait_for("the connection dropped twice", || {
            closed.load(Ordering::SeqCst) >= 2 && malformed() >= 2
        })
        .await;
        assert!(accepted.load(Ordering::SeqCst) >= 2, "it reconnects");
        assert_eq!(node.node.kv_metrics.up.with_label_values(&["r0"]).get(), 0);
        // Still routing.
        let c = reqwest::Client::new();
        let health = c
            .get(format!("http://{}/health", node.addr))
            .send()
            .await
            .unwrap();
        assert!(health.status().is_success());
        assert!(node.shutdown().await);
    })
    .await;
}

/// The same on the replay (DEALER) side: the live stream is fine, the replay endpoint declares
/// a 2^40-byte frame in its first reply. Before: the allocation aborted the node. After: the
/// replay fails, the replica's event-fed blocks are cleared (reason `gap`), the node goes on.
#[tokio::test]
async fn a_replay_endpoint_declaring_a_huge_frame_fails_the_replay_only() {
    init();
    bounded(async {
        let (sub_port, sub_accepted, _) = hostile_publisher(None).await;
        let (replay_port, replay_accepted, replay_closed) =
            hostile_peer(b"ROUTER", Some(1 << 40)).await;
        let addr = engine("vllm:num_requests_running 0\n").await;
        let mut cfg = node_config();
        cfg.replicas = vec![NodeReplica {
            id: Some("r0".into()),
            kv_events: Some(KvEventsSource {
                replay: Some(format!("tcp://127.0.0.1:{replay_port}")),
                ..KvEventsSource::new(format!("tcp://127.0.0.1:{sub_port}"))
            }),
            ..NodeReplica::from_url(format!("http://{addr}"))
        }];
        let node = proxy::spawn(cfg).await.unwrap();
        let clears = || {
            node.node
                .kv_metrics
                .clears
                .with_label_values(&["r0", "gap"])
                .get()
        };
        wait_for("the failed replay to clear", || {
            replay_closed.load(Ordering::SeqCst) >= 1 && clears() >= 1
        })
        .await;
        assert_eq!(
            sub_accepted.load(Ordering::SeqCst),
            1,
            "the live stream stays up"
        );
        assert!(replay_accepted.load(Ordering::SeqCst) >= 1);
        // With the replay over, the live stream alone makes the model exact.
        wait_for("the stream up", || {
            node.node.kv_metrics.up.with_label_values(&["r0"]).get() == 1
        })
        .await;
        assert!(node.shutdown().await);
    })
    .await;
}

/// Before: `[[dns]] kv_events` built an event source per address found, but only static
/// `[[replicas]]` got a subscriber: the publisher never saw a connection. After: each
/// DNS-found replica subscribes, unsubscribes when it leaves DNS, and subscribes again when it
/// comes back.
#[tokio::test]
async fn dns_found_replicas_subscribe_to_kv_events_and_stop_when_they_leave() {
    init();
    bounded(async {
        // Both replicas resolve to 127.0.0.1, so both subscribe to this one publisher port.
        let (port, accepted, closed) = hostile_publisher(None).await;
        let a = engine("vllm:num_requests_running 0\n").await;
        let b = engine("vllm:num_requests_running 0\n").await;
        let srv = Arc::new(std::sync::Mutex::new(vec![
            ("a.sim.test.".to_owned(), a.port()),
            ("b.sim.test.".to_owned(), b.port()),
        ]));
        let dns = fake_dns(srv.clone()).await;
        let mut cfg = node_config();
        cfg.dns = NodeConfig::from_toml(&format!(
            "[[dns]]\nname = \"_http._tcp.sim.test.\"\nnameserver = \"{dns}\"\nmin_refresh_ms = 100\nkv_events = {{ port = {port} }}\n"
        ))
        .unwrap()
        .dns;
        let node = proxy::spawn(cfg).await.unwrap();
        wait_for("both DNS-found replicas to subscribe", || {
            accepted.load(Ordering::SeqCst) >= 2
        })
        .await;
        assert_eq!(closed.load(Ordering::SeqCst), 0);

        // `a` leaves DNS: its subscription ends; `b`'s stays.
        srv.lock().unwrap().remove(0);
        wait_for("a's subscription to end", || closed.load(Ordering::SeqCst) >= 1).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(closed.load(Ordering::SeqCst), 1);
        assert_eq!(accepted.load(Ordering::SeqCst), 2, "no resubscription while gone");

        // It comes back: subscribed again.
        srv.lock().unwrap().push(("a.sim.test.".to_owned(), a.port()));
        wait_for("a to subscribe again", || accepted.load(Ordering::SeqCst) >= 3).await;
        assert!(node.shutdown().await);
    })
    .await;
}
