//! Keeping a connection open to the nodes this node would forward to in every other region.
//!
//! Exists because a forward over a new connection first pays the TCP and TLS handshakes, each a
//! round trip to the other region, and only then its request's own: three round trips instead
//! of one. Forwards are rare and come in bursts (a region spills when it is full), so by the
//! next burst the connections of the last one have closed; before HTTP/2 was the peer client's
//! only protocol, a burst even opened one connection per request in flight (the demo's wire
//! test, regions 2 s apart: every forward of a burst answered after 3.7–4.4 s).
//!
//! So every second this task looks at the first [`WARM_PER_REGION`] nodes of every other
//! region in forwarding order (`region_forward::forward_order`: nearest first, so all of a
//! region's nearest nodes unless more are equally near) and sends `GET /health` to each one
//! not warmed within `mesh.warm_forward_interval_ms`. The answer leaves an HTTP/2 connection
//! in the pool of that node's forwarding client, which every forward to it then shares; the peer listener
//! keeps a peer's idle connection for `listener::PEER_IDLE`, longer than the interval. A node
//! that appears (a new record, a restart) is warmed within a second.
//!
//! Cost: at most [`WARM_PER_REGION`] small requests per other region per interval (20 s by
//! default), on connections already open after the first.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::error::upstream_cause;
use super::region_forward::forward_order;
use crate::node::{Node, Peer};
use crate::shutdown::stopped;

/// Nodes of one region kept warm: the first in forwarding order.
pub const WARM_PER_REGION: usize = 8;
/// Nodes kept warm in all, whatever the number of regions: the bound on a round's requests
/// and on the task's map.
const MAX_WARM: usize = 64;
/// How often the task looks for nodes to warm.
const LOOK_EVERY: Duration = Duration::from_secs(1);

/// Starts the task; it ends with `stop`.
pub(super) fn spawn(node: &Arc<Node>, interval: Duration, stop: watch::Receiver<bool>) {
    tokio::spawn(run(Arc::clone(node), interval, stop));
}

async fn run(node: Arc<Node>, interval: Duration, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(LOOK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    // When each URL was last warmed (sent to, whatever the answer): only what is wanted now.
    let mut warmed: HashMap<String, Instant> = HashMap::new();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stopped(&mut stop) => return,
        }
        let wanted = targets(&node);
        warmed.retain(|url, _| wanted.iter().any(|p| p.http_url == *url));
        let now = Instant::now();
        let due: Vec<Peer> = wanted
            .into_iter()
            .filter(|p| {
                warmed
                    .get(&p.http_url)
                    .is_none_or(|at| now >= *at + interval)
            })
            .collect();
        if due.is_empty() {
            continue;
        }
        for p in &due {
            warmed.insert(p.http_url.clone(), now);
        }
        tokio::select! {
            _ = warm(&node, &due) => {}
            _ = stopped(&mut stop) => return,
        }
    }
}

/// The peers to keep warm now: the first [`WARM_PER_REGION`] of each other region in
/// forwarding order, [`MAX_WARM`] in all, each URL once.
pub fn targets(node: &Node) -> Vec<Peer> {
    let mut peers: Vec<Peer> = node
        .forward_regions()
        .iter()
        .flat_map(|region| {
            forward_order(node, region, false)
                .into_iter()
                .take(WARM_PER_REGION)
        })
        .collect();
    peers.sort_unstable_by(|a, b| a.http_url.cmp(&b.http_url));
    peers.dedup_by(|a, b| a.http_url == b.http_url);
    peers.truncate(MAX_WARM);
    peers
}

/// Sends `GET /health` to each peer at once, through its forwarding client, each bounded by the
/// first-byte timeout.
async fn warm(node: &Node, peers: &[Peer]) {
    let limit = Duration::from_millis(node.cfg.timeouts.first_byte_ms);
    let answers = futures::future::join_all(peers.iter().map(|p| {
        let client = node.forward_clients.get(&p.node_id, &p.region);
        let url = &p.http_url;
        async move {
            let Some(client) = client else {
                return Ok(Err("no forwarding client".to_owned()));
            };
            let send = client.get(format!("{url}/health")).send();
            tokio::time::timeout(limit, send)
                .await
                .map(|r| r.map_err(upstream_cause))
        }
    }))
    .await;
    let metrics = node.mesh_slot().metrics.get();
    for (url, answer) in peers.iter().map(|p| &p.http_url).zip(answers) {
        let failure = match answer {
            Ok(Ok(resp)) if resp.status().is_success() => None,
            Ok(Ok(resp)) => Some(format!("answered {}", resp.status())),
            Ok(Err(e)) => Some(e),
            Err(_) => Some(format!("no answer within {limit:?}")),
        };
        if let Some(error) = &failure {
            tracing::debug!(%url, %error, "warming a forwarding target failed");
        }
        if let Some(m) = metrics {
            let outcome = if failure.is_none() { "ok" } else { "failed" };
            m.forward_warmups.with_label_values(&[outcome]).inc();
        }
    }
}

/// Warm-ups this node sent so far with `outcome` (`ok` or `failed`); 0 without a mesh.
pub fn warmups(node: &Node, outcome: &str) -> u64 {
    node.mesh_slot()
        .metrics
        .get()
        .map_or(0, |m| m.forward_warmups.with_label_values(&[outcome]).get())
}
