//! Replicas: the node's registry of engine endpoints, and the tasks that watch them.
//!
//! Exists to turn replicas' own HTTP surfaces into the routing core's inputs: active `/health`
//! checks (and `/v1/models` discovery) become health and model lists, `/metrics` scrapes become
//! load, and (`kv_events`) an engine's KV events become an exact cache model. The registry is
//! the static list from the config plus DNS sources; each replica gets its watcher tasks.

pub mod dns;
pub mod health;
pub mod kv_events;
pub mod kv_index;
pub mod kv_stream;
pub mod prom;

use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use tokio::sync::watch;

use crate::node::Node;

/// `/v1/models` as OpenAI-compatible servers answer it (only the ids matter).
#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelEntry>,
}

#[derive(Deserialize)]
struct ModelEntry {
    id: String,
}

/// Largest `/metrics` or `/v1/models` body read from a replica: enough for any real engine, and
/// a bound on what a misbehaving one can make the node buffer.
const MAX_SCRAPE_BYTES: usize = 8 << 20;

async fn get_text(node: &Node, url: &str, timeout: Duration) -> anyhow::Result<String> {
    let resp = node.client.get(url).timeout(timeout).send().await?;
    anyhow::ensure!(resp.status().is_success(), "HTTP {}", resp.status());
    if resp.content_length().unwrap_or(0) > MAX_SCRAPE_BYTES as u64 {
        anyhow::bail!("body over {MAX_SCRAPE_BYTES} bytes");
    }
    let bytes = resp.bytes().await?;
    anyhow::ensure!(
        bytes.len() <= MAX_SCRAPE_BYTES,
        "body over {MAX_SCRAPE_BYTES} bytes"
    );
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// One active check of replica `i`: `/health`, then `/v1/models` if its models are unknown.
pub async fn check_once(node: &Node, i: usize) {
    let Some(ep) = node.endpoint(i) else {
        return;
    };
    // In a mesh, followers leave most checks to the replica's home (see `node_mesh.rs`).
    if node.is_removed(i) || !node.should_check(i) {
        return;
    }
    let timeout = Duration::from_millis(node.cfg.health.timeout_ms);
    let base = &ep.base;
    let ok = match node
        .client
        .get(format!("{base}/health"))
        .timeout(timeout)
        .send()
        .await
    {
        Ok(r) => r.status().is_success(),
        Err(e) => {
            tracing::debug!(replica = %ep.id, error = %e, "health check failed");
            false
        }
    };
    let models = if ok && node.needs_models(i) {
        match get_text(node, &format!("{base}/v1/models"), timeout).await {
            Ok(text) => match serde_json::from_str::<ModelList>(&text) {
                Ok(list) => Some(list.data.into_iter().map(|m| m.id).collect()),
                Err(e) => {
                    tracing::warn!(replica = %ep.id, error = %e, "bad /v1/models");
                    None
                }
            },
            Err(e) => {
                tracing::warn!(replica = %ep.id, error = %e, "cannot list models");
                None
            }
        }
    } else {
        None
    };
    node.active_check(i, ok, models);
}

/// One scrape of replica `i`'s `/metrics`.
pub async fn scrape_once(node: &Node, i: usize) {
    let Some(ep) = node.endpoint(i) else {
        return;
    };
    if node.is_removed(i) || !node.should_scrape(i) {
        return;
    }
    let timeout = Duration::from_millis(node.cfg.scrape.timeout_ms);
    let id: &str = &ep.id;
    match get_text(node, &format!("{}/metrics", ep.base), timeout).await {
        Ok(text) => {
            let load = prom::parse_engine_load(&text);
            if load.skipped_lines > 0 {
                node.metrics.scrape_skipped_lines.inc_by(load.skipped_lines);
            }
            if let Err(e) = node.apply_scrape(i, load) {
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
/// its KV-event subscriber if configured, until `stop` turns true.
pub fn spawn_replica_watchers(node: &Arc<Node>, stop: &watch::Receiver<bool>, i: usize) {
    kv_events::spawn_for(node, stop, i);
    let period = Duration::from_millis(node.cfg.health.interval_ms);
    spawn_every(node, stop, period, move |n| async move {
        check_once(&n, i).await
    });
    if node.cfg.scrape.interval_ms > 0 {
        let period = Duration::from_millis(node.cfg.scrape.interval_ms);
        spawn_every(node, stop, period, move |n| async move {
            scrape_once(&n, i).await
        });
    }
}

/// Spawns every watcher: per registered replica, health checks and scrapes; for the node, the
/// summary/overlay/ejection upkeep; per DNS source, the resolver loop. All stop when `stop`
/// turns true.
pub fn spawn_watchers(
    node: &Arc<Node>,
    stop: &watch::Receiver<bool>,
    dns: Vec<(dns::DnsSource, Duration)>,
) {
    for i in 0..node.replica_count() {
        spawn_replica_watchers(node, stop, i);
    }
    let period = Duration::from_millis(node.cfg.summary_interval_ms);
    spawn_every(node, stop, period, |n| async move { n.tick() });
    for (source, next) in dns {
        tokio::spawn(dns::run(Arc::clone(node), source, next, stop.clone()));
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

/// Resolves once `rx` reads true or its sender is gone.
pub async fn stopped(rx: &mut watch::Receiver<bool>) {
    loop {
        if *rx.borrow_and_update() {
            return;
        }
        if rx.changed().await.is_err() {
            return;
        }
    }
}
