//! Hostile and faulty clients and replicas against a node on loopback (issue #13): every case
//! here failed on the code before it and must keep passing.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use kvmesh::node::config::{NodeConfig, ReplicaConfig as NodeReplica};
use kvmesh::proxy::{self, RunningNode};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const LIMIT: Duration = Duration::from_secs(30);
const MODEL: &str = "sim-llama-8b";

async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(LIMIT, f)
        .await
        .expect("test exceeded its time bound")
}

fn client() -> reqwest::Client {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    proxy::install_crypto_provider();
    reqwest::Client::builder().build().unwrap()
}

fn node_config(urls: &[String]) -> NodeConfig {
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        drain_s: 5,
        ..NodeConfig::default()
    };
    cfg.health.interval_ms = 100;
    cfg.health.timeout_ms = 500;
    cfg.scrape.interval_ms = 100;
    cfg.timeouts.first_byte_ms = 5_000;
    cfg.timeouts.connect_ms = 500;
    cfg.replicas = urls
        .iter()
        .enumerate()
        .map(|(i, u)| NodeReplica {
            id: Some(format!("r{i}")),
            ..NodeReplica::from_url(u.clone())
        })
        .collect();
    cfg
}

fn url(node: &RunningNode, path: &str) -> String {
    format!("http://{}{path}", node.addr)
}

async fn admin_state(c: &reqwest::Client, node: &RunningNode) -> Value {
    c.get(url(node, "/admin/state"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// How a fake replica treats completions.
#[derive(Clone, Copy)]
enum Fake {
    /// Behind a proxy that limits body sizes: a declared body over this many bytes has its
    /// connection cut at once, mid-upload, with no answer.
    BodyLimit(usize),
    /// A prompt containing `poison` gets a 500 (the engine chokes on its content).
    Poison,
    /// Accepts completions and never answers (health checks still pass).
    Hang,
}

/// A raw-TCP replica: completions per `mode`, else a minimal completion; `/health` and
/// `/v1/models` answer 200.
async fn fake_replica(mode: Fake) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 16 * 1024];
                loop {
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        match sock.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    let answer = |status: &str, body: &str| {
                        format!(
                            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\n\
                             content-length: {}\r\n\r\n{body}",
                            body.len()
                        )
                    };
                    let completion = head.starts_with("post");
                    if let (Fake::BodyLimit(limit), true) = (mode, completion) {
                        if len > limit {
                            return;
                        }
                    }
                    while buf.len() < end + 4 + len {
                        match sock.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let content = &buf[end + 4..end + 4 + len];
                    if completion && matches!(mode, Fake::Hang) {
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                    }
                    if completion
                        && matches!(mode, Fake::Poison)
                        && content.windows(6).any(|w| w == b"poison")
                    {
                        let _ = sock
                            .write_all(answer("500 Internal Server Error", "{}").as_bytes())
                            .await;
                        buf.drain(..end + 4 + len);
                        continue;
                    }
                    let body = if head.starts_with("get /v1/models") {
                        format!("{{\"object\":\"list\",\"data\":[{{\"id\":\"{MODEL}\"}}]}}")
                    } else if completion {
                        "{\"choices\":[{\"text\":\"ok\"}]}".to_owned()
                    } else {
                        "{}".to_owned()
                    };
                    if sock
                        .write_all(answer("200 OK", &body).as_bytes())
                        .await
                        .is_err()
                    {
                        return;
                    }
                    buf.drain(..end + 4 + len);
                }
            });
        }
    });
    addr
}

/// A body every replica refuses (over their 8 MiB limit, under the node's 32 MiB) is the
/// client's fault: it gets a 413, and no replica is blamed, so the fleet stays up.
#[tokio::test]
async fn bodies_the_replicas_refuse_eject_no_replica() {
    bounded(async {
        let mut urls: Vec<String> = Vec::new();
        for _ in 0..3 {
            urls.push(format!(
                "http://{}",
                fake_replica(Fake::BodyLimit(8 << 20)).await
            ));
        }
        let node = proxy::spawn(node_config(&urls)).await.unwrap();
        let c = client();
        let big = "x".repeat(9 << 20);
        for i in 0..10 {
            let resp = c
                .post(url(&node, "/v1/completions"))
                .json(&json!({"model": MODEL, "prompt": big, "max_tokens": 1}))
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            let body = resp.text().await.unwrap();
            assert_eq!(status, 413, "request {i}: {body}");
        }
        let state = admin_state(&c, &node).await;
        for r in state["replicas"].as_array().unwrap() {
            assert_eq!(r["ejected"], false, "{r}");
        }
        let resp = c
            .post(url(&node, "/v1/completions"))
            .json(&json!({"model": MODEL, "prompt": "hello there", "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        node.shutdown().await;
    })
    .await;
}

async fn ejected(c: &reqwest::Client, node: &RunningNode) -> Vec<String> {
    admin_state(c, node).await["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["ejected"] == true)
        .map(|r| r["id"].as_str().unwrap().to_owned())
        .collect()
}

async fn complete(c: &reqwest::Client, node: &RunningNode, prompt: &str, stream: bool) -> u16 {
    let resp = c
        .post(url(node, "/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": stream}))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let _ = resp.bytes().await;
    status
}

/// A prompt that makes every engine fail (500) is the request's fault: the client gets the
/// engine's answer and no replica is ejected for it.
#[tokio::test]
async fn content_that_fails_everywhere_ejects_no_replica() {
    bounded(async {
        let mut urls: Vec<String> = Vec::new();
        for _ in 0..3 {
            urls.push(format!("http://{}", fake_replica(Fake::Poison).await));
        }
        let node = proxy::spawn(node_config(&urls)).await.unwrap();
        let c = client();
        for i in 0..10 {
            let status = complete(&c, &node, &format!("poison {i}"), false).await;
            assert_eq!(status, 500, "request {i}");
        }
        assert_eq!(ejected(&c, &node).await, Vec::<String>::new());
        assert_eq!(complete(&c, &node, "a fine prompt", false).await, 200);
        node.shutdown().await;
    })
    .await;
}

/// A replica that accepts and never answers is found by the requests it holds: each is retried
/// elsewhere after the streamed first-byte timeout, which blames the hung replica, and after a
/// few it is ejected.
#[tokio::test]
async fn a_hung_replica_is_ejected_and_its_requests_served_elsewhere() {
    bounded(async {
        let urls = vec![
            format!("http://{}", fake_replica(Fake::Hang).await),
            format!("http://{}", fake_replica(Fake::Poison).await),
        ];
        let mut cfg = node_config(&urls);
        cfg.timeouts.stream_first_byte_ms = 200;
        cfg.policy = "round-robin".into();
        let node = proxy::spawn(cfg).await.unwrap();
        let c = client();
        for i in 0..8 {
            let status = complete(&c, &node, &format!("prompt {i}"), true).await;
            assert_eq!(status, 200, "request {i}");
        }
        assert_eq!(ejected(&c, &node).await, vec!["r0".to_owned()]);
        node.shutdown().await;
    })
    .await;
}
