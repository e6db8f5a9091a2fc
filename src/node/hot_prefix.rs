//! Hot-prefix replication in the live node: the driver of `core::hot_prefix`.
//!
//! - With `[hot_prefix] enabled`, requests are counted as they are keyed (`proxy::forward`
//!   calls [`Node::observe_hot`]; off, it returns at once and nothing is counted; text
//!   is passed only for `/v1/completions` in text mode, where block `i` of the keys is bytes
//!   `i · block_bytes ..` of the prompt the engine sees, so a warm-up reproduces it).
//! - Every gossip round (`mesh_loop.rs`) the region's peers' `hot` records are merged in and
//!   this node's own is built ([`Node::hot_gossip`]); the round also names the region's live
//!   nodes, among which a prefix's rendezvous owner (`mesh::home::home_node` on the key) is the
//!   only node that warms it. A node alone owns every prefix.
//! - A task plans every [`PLAN_EVERY`], and at once when a candidate becomes plannable: with
//!   `[hot_prefix] enabled`, each warm-up is a `/v1/completions` request (`max_tokens: 1`,
//!   with the LoRA `lora_path`, `cache_salt` and tenant of the request that made the prefix
//!   hot, to that tenant's pools only) accounted as a routed request (a
//!   [`super::routing::Ticket`] from [`Node::route_to`]), so its first byte puts the blocks in
//!   the overlay, the cache model and the home's block reports, like any request's; a cancel
//!   aborts it, which drops its ticket. It also keeps the metrics current.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts};
use tokio::sync::watch;
use tokio::task::AbortHandle;

use super::state::Node;
use crate::core::hot_prefix::{Action, HotStats, Observed, WarmScope, WarmUp};
use crate::core::keys::BlockKey;
use crate::core::kv_fetch::KvFetchPlan;
use crate::core::kv_hint::{self, FetchHint};
use crate::mesh::home::home_node;
use crate::mesh::hot_record::HotRecord;
use crate::mesh::Member;
use crate::shutdown::stopped;

/// How often the planner runs: a new hot prefix's holders swamp within a few hundred ms.
pub const PLAN_EVERY: Duration = Duration::from_millis(50);
/// How often it runs with warm-ups off, when it only refreshes the `kvmesh_hot_prefixes`
/// gauge: twenty wake-ups a second of an idle node for a gauge were a tenth of its wake-ups.
pub const GAUGE_EVERY: Duration = Duration::from_secs(1);

/// The hot-prefix metric handles.
struct HotMetrics {
    /// `kvmesh_hot_prefixes`: prefixes over `min_rate` this node tracks.
    hot: IntGauge,
    /// `kvmesh_hot_warmups_total{result}`: `sent`, `failed`, `cancelled`, `over_budget`.
    warmups: IntCounterVec,
    /// `kvmesh_hot_warmup_tokens_total`: prefill tokens of the warm-ups sent (a warm-up by
    /// pull counts only the token it computes).
    tokens: IntCounter,
    /// `kvmesh_hot_warmup_credit_tokens`: what warm-ups may still spend (negative: owed).
    credit: IntGauge,
}

impl HotMetrics {
    fn new(node: &Node) -> prometheus::Result<Self> {
        let hot = IntGauge::new(
            "kvmesh_hot_prefixes",
            "Prefixes routed region-wide over hot_prefix.min_rate requests/s, tracked here",
        )?;
        let warmups = IntCounterVec::new(
            Opts::new(
                "kvmesh_hot_warmups_total",
                "Hot-prefix warm-ups (prefill-only requests) by result: sent, failed, cancelled, over_budget",
            ),
            &["result"],
        )?;
        let tokens = IntCounter::new(
            "kvmesh_hot_warmup_tokens_total",
            "Prefill tokens of the hot-prefix warm-ups sent (a pulled one counts only its last token)",
        )?;
        let credit = IntGauge::new(
            "kvmesh_hot_warmup_credit_tokens",
            "Prefill tokens hot-prefix warm-ups may still spend: earned at hot_prefix.budget_share \
             of the prefill this node routes; negative while warm-ups are owed",
        )?;
        let r = &node.metrics.registry;
        r.register(Box::new(hot.clone()))?;
        r.register(Box::new(credit.clone()))?;
        r.register(Box::new(warmups.clone()))?;
        r.register(Box::new(tokens.clone()))?;
        for result in ["sent", "failed", "cancelled", "over_budget"] {
            warmups.with_label_values(&[result]).reset();
        }
        Ok(HotMetrics {
            hot,
            warmups,
            tokens,
            credit,
        })
    }

    /// Adds what `now` counts beyond `before`.
    fn add(&self, before: &HotStats, now: &HotStats) {
        let by = |a: u64, b: u64| b.saturating_sub(a);
        for (result, a, b) in [
            ("sent", before.sent, now.sent),
            ("failed", before.failed, now.failed),
            ("cancelled", before.cancelled, now.cancelled),
            ("over_budget", before.over_budget, now.over_budget),
        ] {
            self.warmups.with_label_values(&[result]).inc_by(by(a, b));
        }
        self.tokens.inc_by(by(before.tokens, now.tokens));
    }
}

impl Node {
    /// Counts a keyed request in the hot-prefix sketch. `text` only when block `i` of `keys` is
    /// bytes `i · block_bytes ..` of the prompt the engine sees (text mode, completions);
    /// `scope`: its LoRA adapter, engine `cache_salt` and tenant, which a warm-up keeps.
    pub fn observe_hot(
        &self,
        model: &str,
        keys: &[BlockKey],
        text: Option<&str>,
        scope: WarmScope<'_>,
    ) {
        // Off, no request pays for the sketch (one more lock per request): the node counts and
        // publishes no heat, and the gauge reads 0.
        if !self.cfg.hot_prefix.enabled {
            return;
        }
        let now = self.now();
        let req = Observed {
            model,
            keys,
            text,
            block_bytes: self.cfg.block_bytes,
            scope,
        };
        let plannable = self.lock().hot.observe(req, now);
        if plannable {
            self.hot_plan_now.notify_one();
        }
    }

    /// Merges the region's live peers' `hot` records, remembers the region's live nodes (the
    /// owners a prefix is hashed over) and returns this node's own record.
    pub(super) fn hot_gossip(&self, self_id: &str, live: &[Member]) -> HotRecord {
        let now = self.now();
        let region = self.cfg.region.as_str();
        let mut guard = self.lock();
        let core = &mut *guard;
        core.hot_owners.clear();
        for m in live.iter().filter(|m| m.region() == Some(region)) {
            core.hot_owners.push(m.node_id.clone());
            if !m.is_self {
                core.hot.apply_peer(&m.node_id, &m.hot.entries, now);
            }
        }
        core.hot_self = self_id.to_owned();
        let mut record = HotRecord::default();
        core.hot.gossip_top(now, &mut record.entries);
        record
    }

    /// One planning round: the gauges (hot prefixes, credit) and counters, and (warm-ups on)
    /// the actions to take.
    fn plan_hot(&self, out: &mut Vec<Action>) -> (usize, HotStats, f64) {
        let now = self.now();
        let enabled = self.cfg.hot_prefix.enabled;
        let mut guard = self.lock();
        let core = &mut *guard;
        if enabled {
            let cost = core.router.config().cost;
            let owners = &core.hot_owners;
            let me = core.hot_self.as_str();
            let owns = |key: u64| {
                owners.is_empty()
                    || home_node(&format!("{key:016x}"), owners.iter().map(String::as_str))
                        == Some(me)
            };
            let nodes = owners.len().max(1);
            let tenants = &core.router.tenants;
            core.hot
                .plan(&core.view, &cost, tenants, now, nodes, owns, out);
        }
        (
            core.hot.hot_count(now),
            core.hot.stats(),
            core.hot.credit_tokens(),
        )
    }

    fn hot_done(&self, key: u64, replica: usize, ok: bool) {
        self.lock().hot.warm_done(key, replica, ok);
    }
}

/// Starts the planner task (it stops with `stop`); a metrics registration error is logged and
/// leaves the node without hot-prefix metrics and warm-ups.
pub fn spawn_hot_prefix(node: &Arc<Node>, stop: &watch::Receiver<bool>) {
    let metrics = match HotMetrics::new(node) {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(error = %e, "hot-prefix metrics not registered; warm-ups off");
            return;
        }
    };
    let node = Arc::clone(node);
    let mut stop = stop.clone();
    tokio::spawn(async move {
        let period = if node.cfg.hot_prefix.enabled {
            PLAN_EVERY
        } else {
            GAUGE_EVERY
        };
        let mut every = tokio::time::interval(period);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut running: HashMap<(u64, usize), AbortHandle> = HashMap::new();
        let mut actions = Vec::new();
        let mut last = HotStats::default();
        loop {
            tokio::select! {
                _ = every.tick() => {}
                _ = node.hot_plan_now.notified() => {}
                _ = stopped(&mut stop) => break,
            }
            running.retain(|_, h| !h.is_finished());
            let (hot, stats, credit) = node.plan_hot(&mut actions);
            for a in actions.drain(..) {
                match a {
                    Action::WarmUp(w) => {
                        let pair = (w.key, w.replica);
                        let task = tokio::spawn(warm_up(Arc::clone(&node), *w));
                        running.insert(pair, task.abort_handle());
                    }
                    Action::Cancel { key, replica } => {
                        if let Some(h) = running.remove(&(key, replica)) {
                            h.abort();
                        }
                    }
                }
            }
            metrics.hot.set(hot as i64);
            metrics.credit.set(credit as i64);
            metrics.add(&last, &stats);
            last = stats;
        }
        for h in running.values() {
            h.abort();
        }
    });
}

/// Sends one warm-up and reports how it went. Aborted (a cancel), its ticket drops and
/// releases the accounting; the planner already forgot the pair.
async fn warm_up(node: Arc<Node>, w: WarmUp) {
    let tenant = w.scope.tenant.as_deref();
    let Some(mut ticket) = node.route_to(w.replica, &w.keys, w.tokens, tenant) else {
        node.hot_done(w.key, w.replica, false);
        return;
    };
    let mut body = warm_up_body(&w);
    if let Some(plan) = &w.fetch {
        add_fetch_hint(&node, plan, &mut body);
    }
    // The warm-up's timeline (issue #37: when a copy was started after the prefix turned hot,
    // how long its pull and prefill took against the prediction).
    let sent_at = node.now();
    tracing::debug!(
        key = format_args!("{:016x}", w.key),
        replica = %ticket.endpoint().id,
        source = ?w.fetch.as_ref().and_then(|p| node.endpoint(p.source)).map(|e| e.id.to_string()),
        predicted_ms = w.fetch.as_ref().map(|p| p.predicted_s * 1000.0),
        tokens = w.tokens,
        at_s = sent_at.as_secs_f64(),
        "warm-up sent"
    );
    let url = format!("{}/v1/completions", ticket.endpoint().base);
    let mut req = node
        .client
        .post(url)
        .timeout(Duration::from_millis(node.cfg.timeouts.first_byte_ms))
        .json(&body);
    if let Some(t) = node.secrets.replica_token.as_deref() {
        req = req.bearer_auth(t);
    }
    let ok = match req.send().await {
        Ok(res) if res.status().is_success() => {
            // A one-token answer: its headers come once the prefill is done.
            ticket.first_byte(&w.keys);
            res.bytes().await.is_ok()
        }
        Ok(res) => {
            tracing::debug!(status = %res.status(), replica = %ticket.endpoint().id, "warm-up refused");
            ticket.failed(&w.keys);
            false
        }
        Err(e) => {
            tracing::debug!(error = %e, replica = %ticket.endpoint().id, "warm-up failed");
            ticket.failed(&w.keys);
            false
        }
    };
    tracing::debug!(
        key = format_args!("{:016x}", w.key),
        replica = w.replica,
        ok,
        took_ms = node.now().saturating_sub(sent_at).as_secs_f64() * 1000.0,
        "warm-up done"
    );
    node.hot_done(w.key, w.replica, ok);
}

/// Replication by transfer: the warm-up asks its replica to pull the prefix from `plan`'s source
/// (in the form the replica takes) instead of recomputing it; without the source's address it
/// recomputes.
fn add_fetch_hint(node: &Node, plan: &KvFetchPlan, body: &mut serde_json::Value) {
    let Some(source) = node.endpoint(plan.source) else {
        return;
    };
    let hint = FetchHint {
        source_url: source.base.to_string(),
        source_id: Some(source.id.to_string()),
        start_token: plan.from_tokens,
        end_token: plan.tokens,
    };
    let id = format!("kvmesh-warm-{:016x}", rand::random::<u64>());
    if let Some((field, value)) = kv_hint::build(plan.format, &hint, &id) {
        kv_hint::set_in(body, field, value);
    }
}

/// A warm-up's body: the prefix as a one-token completion, in the partition of the engine's
/// cache the request that made it hot used (its `lora_path`, its `cache_salt`).
fn warm_up_body(w: &WarmUp) -> serde_json::Value {
    let mut body = serde_json::json!({
        "model": w.model,
        "prompt": w.prompt,
        "max_tokens": 1,
        "stream": false,
    });
    if let Some(map) = body.as_object_mut() {
        if let Some(lora) = &w.scope.lora {
            map.insert("lora_path".into(), lora.as_str().into());
        }
        if let Some(salt) = &w.scope.cache_salt {
            map.insert("cache_salt".into(), salt.as_str().into());
        }
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::keys::BlockKey;
    use crate::core::router::RouteRequest;
    use crate::node::config::{NodeConfig, ReplicaConfig};

    /// A node with two replicas of model `m`, warm-ups on or off.
    fn node(enabled: bool) -> Arc<Node> {
        crate::proxy::install_crypto_provider();
        let mut cfg = NodeConfig::default();
        cfg.hot_prefix.enabled = enabled;
        cfg.replicas = (0..2).map(ReplicaConfig::numbered).collect();
        Node::new(cfg).unwrap()
    }

    /// A warm-up's body is in the engine-cache partition of the request that made the prefix
    /// hot: its `cache_salt` and `lora_path` go with it (issue #35).
    #[test]
    fn a_warm_up_body_carries_the_salt_and_lora() {
        let mut w = WarmUp {
            fetch: None,
            key: 1,
            replica: 0,
            model: "m".into(),
            prompt: "p".into(),
            keys: Vec::new(),
            tokens: 1,
            scope: Default::default(),
        };
        let plain = warm_up_body(&w);
        assert!(plain.get("cache_salt").is_none() && plain.get("lora_path").is_none());
        w.scope.cache_salt = Some("salt".into());
        w.scope.lora = Some("adapter".into());
        let b = warm_up_body(&w);
        assert_eq!(
            (b["cache_salt"].as_str(), b["lora_path"].as_str()),
            (Some("salt"), Some("adapter"))
        );
        assert_eq!(
            (b["prompt"].as_str(), b["max_tokens"].as_u64()),
            (Some("p"), Some(1))
        );
    }

    #[test]
    fn routed_prefill_earns_warm_up_credit_and_a_warm_up_earns_none() {
        let keys: Vec<BlockKey> = (1..=64).map(BlockKey).collect();
        let req = RouteRequest {
            model: "m",
            keys: &keys,
            prompt_tokens: 4096,
            session: None,
            affinity_key: None,
            tenant: None,
            forwarded: false,
            exclude: &[],
        };
        let node = node(true);
        let credit = || node.lock().hot.credit_tokens();
        assert_eq!(credit(), 0.0);
        // A cold prompt: all 4,096 tokens are prefill, 5 % of them credit.
        let (_, ticket) = node.route(&req);
        assert!(ticket.is_some());
        assert!((credit() - 0.05 * 4096.0).abs() < 1e-9, "{}", credit());
        // A warm-up is prefill the node sends on its own: it earns nothing.
        let warm = node.route_to(1, &keys, 4096, None);
        assert!(warm.is_some());
        assert!((credit() - 0.05 * 4096.0).abs() < 1e-9, "{}", credit());
        // Warm-ups off: nothing is saved up for the day they are turned on.
        let off = self::node(false);
        let (_, ticket) = off.route(&req);
        assert!(ticket.is_some());
        assert_eq!(off.lock().hot.credit_tokens(), 0.0);
    }
}
