//! Helpers of the Kubernetes discovery tests (`tests/k8s_discovery.rs`,
//! `tests/inference_pool.rs`): a node whose only replica source is one `[[kubernetes]]` table
//! pointed at a fake API server, and the requests and state reads both tests make of it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvmesh::node::config::NodeConfig;
use kvmesh::proxy::{self, RunningNode};
use serde_json::{json, Value};

/// The debug header naming the replica a node routed to.
pub const ROUTED: &str = "x-kvmesh-routed-to";
/// The simulated replicas' model.
pub const MODEL: &str = "sim-llama-8b";

/// A node on 127.0.0.1:0 whose only replica source is `[[kubernetes]]` with `source` (its
/// `namespace` and `service` or `inference_pool` lines) at the API server `api`, with short
/// timeouts and backoffs, fast health checks and debug headers.
pub async fn node_for(source: &str, api: std::net::SocketAddr) -> RunningNode {
    let mut cfg = NodeConfig::from_toml(&format!(
        "[[kubernetes]]\n\
         {source}\n\
         api_server = \"http://{api}\"\n\
         request_timeout_ms = 1000\n\
         watch_timeout_s = 60\n\
         min_backoff_ms = 50\n\
         max_backoff_ms = 200\n"
    ))
    .unwrap();
    cfg.listen = "127.0.0.1:0".parse().unwrap();
    cfg.drain_s = 5;
    cfg.debug_headers = true;
    cfg.health.interval_ms = 100;
    cfg.health.timeout_ms = 500;
    cfg.scrape.interval_ms = 100;
    cfg.timeouts.first_byte_ms = 10_000;
    cfg.timeouts.connect_ms = 500;
    proxy::spawn(cfg).await.unwrap()
}

/// The node's URL for `path`.
pub fn url(node: &RunningNode, path: &str) -> String {
    format!("http://{}{path}", node.addr)
}

/// `n` distinct prompt bytes starting with `seed`.
pub fn text(seed: &str, n: usize) -> String {
    let mut s = String::new();
    let mut i = 0;
    while s.len() < n {
        s.push_str(&format!("{seed}-{i:06} "));
        i += 1;
    }
    s.truncate(n);
    s
}

/// One completion: status and the replica that served it.
pub async fn complete(c: &reqwest::Client, node: &RunningNode, prompt: &str) -> (u16, String) {
    let resp = c
        .post(url(node, "/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let replica = resp
        .headers()
        .get(ROUTED)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let _ = resp.bytes().await.unwrap();
    (status, replica)
}

/// Replica id → health, from `/admin/state`.
pub async fn health(c: &reqwest::Client, node: &RunningNode) -> BTreeMap<String, String> {
    let state: Value = c
        .get(url(node, "/admin/state"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    state["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["id"].as_str().unwrap().to_owned(),
                r["health"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// Waits (≤ 5 s) until replica `id` has health `want`.
pub async fn wait_health(c: &reqwest::Client, node: &RunningNode, id: &str, want: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let h = health(c, node).await;
        if h.get(id).map(String::as_str) == Some(want) {
            return;
        }
        assert!(Instant::now() < deadline, "{id} never became {want}: {h:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The node's `/metrics` text.
pub async fn metrics(c: &reqwest::Client, node: &RunningNode) -> String {
    c.get(url(node, "/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The value of the first metric line starting with `prefix`, 0 if none.
pub fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}
