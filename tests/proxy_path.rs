//! The proxy path under the clients users really have: load balancers and pooled HTTP clients
//! that reuse keep-alive connections. Such a client writes a request and waits for a response made
//! of several small writes (headers, then each streamed chunk); with Nagle's algorithm on the
//! node's accepted socket, every write behind an unacknowledged one waits for the client's delayed
//! ACK, 40 ms on Linux, on every request of the connection.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvmesh::node::config::{NodeConfig, ReplicaConfig as NodeReplica};
use kvmesh::proxy::{self, RunningNode};
use kvmesh::replica::{self, ReplicaConfig, ReplicaHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const LIMIT: Duration = Duration::from_secs(30);
const MODEL: &str = "sim-llama-8b";

async fn replica() -> ReplicaHandle {
    let mut cfg = ReplicaConfig {
        id: "r0".into(),
        exit_on_crash: false,
        ..ReplicaConfig::default()
    };
    cfg.engine.time_scale = 1000.0;
    replica::spawn(cfg).await.unwrap()
}

async fn node(replica: &ReplicaHandle) -> RunningNode {
    node_with(replica, false).await
}

async fn node_with(replica: &ReplicaHandle, debug_headers: bool) -> RunningNode {
    proxy::install_crypto_provider();
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        drain_s: 1,
        debug_headers,
        ..NodeConfig::default()
    };
    cfg.health.interval_ms = 100;
    cfg.replicas = vec![NodeReplica {
        id: Some("r0".into()),
        ..NodeReplica::from_url(replica.base_url())
    }];
    proxy::spawn(cfg).await.unwrap()
}

/// One streamed completion on an open keep-alive connection, written as a client library does
/// (head and body in separate writes); returns the time until the response's last chunk.
async fn streamed_request(conn: &mut TcpStream, addr: SocketAddr, i: usize) -> Duration {
    let body = format!(
        r#"{{"model":"{MODEL}","prompt":"keep-alive request {i} with a short prompt","max_tokens":2,"stream":true}}"#
    );
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    );
    let started = Instant::now();
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(body.as_bytes()).await.unwrap();
    // Read until the response's chunked body ends ("0\r\n\r\n" after the last event).
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = conn.read(&mut chunk).await.unwrap();
        assert!(n > 0, "the node closed a keep-alive connection");
        buf.extend_from_slice(&chunk[..n]);
        if buf.ends_with(b"0\r\n\r\n") && find(&buf, b"[DONE]").is_some() {
            break;
        }
    }
    assert!(
        buf.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&buf)
    );
    started.elapsed()
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The node's end of the client connection `client` (found among this process's sockets).
#[cfg(target_os = "linux")]
fn server_side_nodelay(client: &TcpStream) -> Option<bool> {
    use std::os::fd::BorrowedFd;
    let ours = client.local_addr().ok()?;
    let theirs = client.peer_addr().ok()?;
    for entry in std::fs::read_dir("/proc/self/fd").ok()?.flatten() {
        let Ok(fd) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        // SAFETY: the descriptor is only borrowed for the getsockopt/getsockname calls below,
        // while this process keeps it open (the node holds the connection until the client
        // closes it, which this test does after the call).
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        let sock = socket2::SockRef::from(&fd);
        let (Ok(local), Ok(peer)) = (sock.local_addr(), sock.peer_addr()) else {
            continue;
        };
        if local.as_socket() == Some(theirs) && peer.as_socket() == Some(ours) {
            return sock.tcp_nodelay().ok();
        }
    }
    None
}

#[tokio::test]
async fn keep_alive_clients_get_nodelay_and_every_response_on_one_connection() {
    tokio::time::timeout(LIMIT, async {
        let rep = replica().await;
        let node = node(&rep).await;
        let mut conn = TcpStream::connect(node.addr).await.unwrap();
        // As aiohttp, hyper and haproxy do: the client's own writes go out at once, so any stall
        // left is the node's.
        conn.set_nodelay(true).unwrap();
        let mut took = Vec::new();
        for i in 0..20 {
            took.push(streamed_request(&mut conn, node.addr, i).await);
        }
        took.sort();
        // Figures only (timing is not asserted): without TCP_NODELAY on the node's socket this
        // read p50 44 ms (a delayed ACK per request), with it 2 ms.
        eprintln!(
            "keep-alive streamed requests through the node: p50 {:?}, max {:?}",
            took[took.len() / 2],
            took[took.len() - 1]
        );
        #[cfg(target_os = "linux")]
        assert_eq!(
            server_side_nodelay(&conn),
            Some(true),
            "the node's accepted socket must have TCP_NODELAY"
        );
        drop(conn);
        node.shutdown().await;
    })
    .await
    .expect("test exceeded its time bound");
}

/// The value of the first sample of `name` with `label` in a Prometheus text exposition.
fn sample(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && l.contains(label))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn decisions_are_counted_by_branch_and_explained_only_when_asked() {
    tokio::time::timeout(LIMIT, async {
        let rep = replica().await;
        proxy::install_crypto_provider();
        let http = reqwest::Client::new();
        let prompt = "a long shared prefix ".repeat(200);
        let body =
            serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": true});
        for debug in [false, true] {
            let node = node_with(&rep, debug).await;
            let mut last = None;
            for _ in 0..3 {
                let resp = http
                    .post(format!("http://{}/v1/completions", node.addr))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), 200);
                // What the node believes is cached, and where it sent the request, is for
                // debugging only: a client could probe others' prompts with it.
                for h in ["x-kvmesh-routed-to", "x-kvmesh-hit-blocks"] {
                    assert_eq!(resp.headers().contains_key(h), debug, "{h}");
                }
                last = resp
                    .headers()
                    .get("x-kvmesh-decision")
                    .map(|v| v.to_str().unwrap().to_owned());
                let _ = resp.bytes().await.unwrap();
                // Let the first byte's blocks count before the next request.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            match (debug, last) {
                (false, None) => {}
                (true, Some(h)) => {
                    assert!(h.starts_with("branch=cache; hit="), "{h}");
                    assert!(h.contains("best=") && h.contains("predicted_ms="), "{h}");
                }
                (d, h) => panic!("debug_headers {d}: header {h:?}"),
            }
            let m = http
                .get(format!("http://{}/metrics", node.addr))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            let cache = sample(&m, "kvmesh_decisions_total", "branch=\"cache\"");
            let load = sample(&m, "kvmesh_decisions_total", "branch=\"load\"");
            assert_eq!(cache + load, 3.0, "{m}");
            assert!(cache >= 2.0, "repeats of a prompt take the cache: {m}");
            let best = sample(&m, "kvmesh_decision_hit_tokens_total", "kind=\"best\"");
            let chosen = sample(&m, "kvmesh_decision_hit_tokens_total", "kind=\"chosen\"");
            assert!(best > 0.0 && chosen == best, "chosen {chosen} best {best}");
            let predicted: f64 = ["late", "early"]
                .iter()
                .map(|d| {
                    sample(
                        &m,
                        "kvmesh_ttft_prediction_error_seconds_count",
                        &format!("direction=\"{d}\""),
                    )
                })
                .sum();
            assert_eq!(
                predicted, 3.0,
                "every streamed request's prediction is checked"
            );
            node.shutdown().await;
        }
    })
    .await
    .expect("test exceeded its time bound");
}
