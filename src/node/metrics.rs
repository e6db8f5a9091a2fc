//! The node's own Prometheus metrics, served at `GET /metrics`: routing and replicas
//! ([`Metrics`]) and, once the mesh starts, gossip, sync and forwarding ([`MeshMetrics`]).
//!
//! Exists so an operator can see what the router decided and why without reading logs: requests
//! by replica, policy and outcome; how much cache each decision expected to hit and how much it
//! gave up for load; which consideration decided; how far the predicted TTFT was off; how long
//! deciding took; in-flight counts; replica health; retries.

use crate::core::router::{Branch, Decision, KvSteer};
use crate::mesh::transport::StatsSnapshot;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// The node's metric handles, all registered in `registry`.
#[derive(Clone)]
pub struct Metrics {
    /// The registry `/metrics` renders.
    pub registry: Registry,
    /// Predicted against engine-reported cached tokens, per answered request.
    pub receipts: ReceiptMetrics,
    /// `kvmesh_response_lookups_total{outcome}`: stored responses looked for on the replicas
    /// (`found`, `missing`; `refused`: past `RESPONSE_LOOKUPS` under way).
    pub response_lookups: IntCounterVec,
    /// `kvmesh_requests_total{replica,policy,outcome}`.
    pub requests: IntCounterVec,
    /// `kvmesh_hit_blocks`: blocks the chosen replica was believed to hold, per routed request.
    pub hit_blocks: Histogram,
    /// `kvmesh_decision_seconds`: time inside the router (lock held), per decision.
    pub decision_seconds: Histogram,
    /// `kvmesh_upstream_first_byte_seconds{replica}`: request sent → response headers.
    pub first_byte_seconds: HistogramVec,
    /// `kvmesh_in_flight{replica}`: requests this node has open at each replica.
    pub in_flight: IntGaugeVec,
    /// `kvmesh_in_flight_total`: requests at the node still waiting for response headers (being
    /// read, routed, sent or retried); streaming bodies are counted per replica in `in_flight`.
    pub in_flight_total: IntGauge,
    /// `kvmesh_replica_healthy{replica}`: 1 healthy, 0 not.
    pub replica_healthy: IntGaugeVec,
    /// `kvmesh_retries_total`: attempts after the first.
    pub retries: IntCounter,
    /// `kvmesh_first_byte_waits_extended_total`: first-byte waits that ran out at a replica
    /// which made progress meanwhile, and were extended instead of retried elsewhere.
    pub first_byte_waits_extended: IntCounter,
    /// `kvmesh_ejections_total{replica}`: passive outlier ejections.
    pub ejections: IntCounterVec,
    /// `kvmesh_hedges_total{outcome}`: hedged requests (`sent`), and which answer came first
    /// (`first_won`, `hedge_won`); `over_budget`: not hedged, a fifth of the requests awaiting
    /// headers (at least 3) being hedged already.
    pub hedges: IntCounterVec,
    /// `kvmesh_stream_resumes_total{api,outcome}`: streams whose replica failed mid-stream:
    /// `resumed` (continued on another replica), `failed` (a continuation attempt failed),
    /// `finished` (nothing was left to generate: ended cleanly), `error_event` (ended with the
    /// API's error event: unresumable, or no continuation left); and `body_not_kept`: a
    /// stream relayed without resumes because the node's budget for kept bodies was spent.
    pub stream_resumes: IntCounterVec,
    /// `kvmesh_pd_decisions_total{outcome}`: disaggregated requests, by how they ran: `pair`,
    /// or whole for a reason (`bypass`, `no_prefill`, `no_decode`, `same_replica`, `no_pair`).
    pub pd_decisions: IntCounterVec,
    /// `kvmesh_pd_legs_failed_total{leg}`: prefill and decode legs that failed (`prefill`
    /// before the decode started is retried on another prefill replica).
    pub pd_legs_failed: IntCounterVec,
    /// `kvmesh_upstream_failures_total{blame}`: failed attempts, by whom they were held against:
    /// `replica` (counts towards its ejection) or `request` (its content failed everywhere).
    pub upstream_failures: IntCounterVec,
    /// `kvmesh_scrape_errors_total{replica}`: failed `/metrics` scrapes.
    pub scrape_errors: IntCounterVec,
    /// `kvmesh_scrape_skipped_lines_total`: unparseable lines in replicas' `/metrics`.
    pub scrape_skipped_lines: IntCounter,
    /// `kvmesh_scrape_refused_values_total{replica}`: scraped values outside their bound
    /// (`replicas::prom`'s `MAX_*`), refused.
    pub scrape_refused: IntCounterVec,
    /// `kvmesh_cert_reloads_total{result}`: certificate reloads, `ok` or `error` (refused: the
    /// certificates in use stayed).
    pub cert_reloads: IntCounterVec,
    /// Decision quality: branches, hits given up, prediction error.
    pub decisions: DecisionMetrics,
}

/// How good the decisions are, as operators of peer routers asked to see it. Label values are
/// resolved once, so recording a decision does no map lookup.
#[derive(Clone)]
pub struct DecisionMetrics {
    /// `kvmesh_decisions_total{branch}`, indexed like [`Branch::ALL`].
    pub branch: [IntCounter; 6],
    /// `kvmesh_decision_hit_tokens_total{kind="chosen"}`: tokens the chosen replicas were
    /// believed to hold, for policies that look at caches.
    pub chosen_hit_tokens: IntCounter,
    /// `kvmesh_decision_hit_tokens_total{kind="best"}`: the longest hit on offer at the same
    /// decisions; `chosen / best` is the share of available hits the node took.
    pub best_hit_tokens: IntCounter,
    /// `kvmesh_ttft_prediction_error_seconds{direction="late"}`: streamed requests whose first
    /// byte came later than the cost model predicted, by how much.
    pub late: Histogram,
    /// `…{direction="early"}`: earlier than predicted, by how much.
    pub early: Histogram,
    /// `kvmesh_kv_quota_steered_total`: requests a tenant's KV quota (`max_kv_share`) moved off
    /// replicas where it held more than its share.
    pub kv_steered: IntCounter,
    /// `kvmesh_kv_quota_overflows_total`: requests of a tenant over its KV quota everywhere sent
    /// by the policy, because the replicas it dominates queued too long (`KV_OVERFLOW_S`).
    pub kv_overflowed: IntCounter,
    /// `kvmesh_dp_rank_named_total`: requests sent naming a data-parallel rank (the replica's
    /// home, with an exact per-rank model; `kv_events.rank_routing`).
    pub dp_rank_named: IntCounter,
}

impl DecisionMetrics {
    fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let branches = IntCounterVec::new(
            Opts::new(
                "kvmesh_decisions_total",
                "Routing decisions by the consideration that decided (cache, affinity, load, spill, forward, reject)",
            ),
            &["branch"],
        )?;
        let hits = IntCounterVec::new(
            Opts::new(
                "kvmesh_decision_hit_tokens_total",
                "Prompt tokens believed cached: at the chosen replica, and the most any eligible replica offered",
            ),
            &["kind"],
        )?;
        let error = HistogramVec::new(
            HistogramOpts::new(
                "kvmesh_ttft_prediction_error_seconds",
                "Streamed requests: |first byte - predicted time to first token|, by direction",
            )
            .buckets(prometheus::exponential_buckets(0.001, 2.0, 16)?),
            &["direction"],
        )?;
        registry.register(Box::new(branches.clone()))?;
        registry.register(Box::new(hits.clone()))?;
        registry.register(Box::new(error.clone()))?;
        let kv_steered = IntCounter::new(
            "kvmesh_kv_quota_steered_total",
            "Requests a tenant's KV quota (max_kv_share) moved off replicas where it held more than its share",
        )?;
        registry.register(Box::new(kv_steered.clone()))?;
        let kv_overflowed = IntCounter::new(
            "kvmesh_kv_quota_overflows_total",
            "Requests of a tenant over its KV quota on every replica sent by the policy, because the replicas it dominates queued too long",
        )?;
        registry.register(Box::new(kv_overflowed.clone()))?;
        let dp_rank_named = IntCounter::new(
            "kvmesh_dp_rank_named_total",
            "Requests sent naming the data-parallel rank that holds their prefix",
        )?;
        registry.register(Box::new(dp_rank_named.clone()))?;
        let b = |x: Branch| branches.with_label_values(&[x.as_str()]);
        Ok(DecisionMetrics {
            branch: Branch::ALL.map(b),
            chosen_hit_tokens: hits.with_label_values(&["chosen"]),
            best_hit_tokens: hits.with_label_values(&["best"]),
            late: error.with_label_values(&["late"]),
            early: error.with_label_values(&["early"]),
            kv_steered,
            kv_overflowed,
            dp_rank_named,
        })
    }

    /// Counts a decision; `tokens_per_block` converts its hits.
    pub fn record(&self, d: &Decision, tokens_per_block: u32) {
        let i = Branch::ALL
            .iter()
            .position(|b| *b == d.branch())
            .unwrap_or(0);
        self.branch[i].inc();
        if let Decision::Route(r) = d {
            match r.kv_steer {
                KvSteer::Steered => self.kv_steered.inc(),
                KvSteer::Overflowed => self.kv_overflowed.inc(),
                KvSteer::Unsteered => {}
            }
            if let Some(best) = r.best_hit_blocks {
                let tpb = u64::from(tokens_per_block);
                self.chosen_hit_tokens.inc_by(u64::from(r.hit_blocks) * tpb);
                self.best_hit_tokens.inc_by(u64::from(best) * tpb);
            }
        }
    }

    /// A streamed request's first byte came `actual_s` after it was sent; predicted `predicted_s`.
    pub fn prediction(&self, predicted_s: f64, actual_s: f64) {
        let err = actual_s - predicted_s;
        if !err.is_finite() {
            return;
        }
        if err >= 0.0 {
            self.late.observe(err);
        } else {
            self.early.observe(-err);
        }
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let reg = Registrar(&registry);
        let metrics = Metrics {
            requests: reg.counter_vec(
                "kvmesh_requests_total",
                "Requests by replica, policy and outcome",
                &["replica", "policy", "outcome"],
            )?,
            hit_blocks: reg.histogram(
                "kvmesh_hit_blocks",
                "Prefix blocks the chosen replica was believed to hold",
                vec![
                    0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0,
                ],
            )?,
            decision_seconds: reg.histogram(
                "kvmesh_decision_seconds",
                "Time to make one routing decision",
                prometheus::exponential_buckets(1e-6, 2.0, 16)?,
            )?,
            first_byte_seconds: reg.histogram_vec(
                "kvmesh_upstream_first_byte_seconds",
                "Request sent to a replica until its response headers",
                prometheus::exponential_buckets(0.001, 2.0, 18)?,
                &["replica"],
            )?,
            in_flight: reg.gauge_vec(
                "kvmesh_in_flight",
                "Requests open at each replica through this node",
                &["replica"],
            )?,
            in_flight_total: reg.gauge(
                "kvmesh_in_flight_total",
                "Requests at this node waiting for response headers",
            )?,
            replica_healthy: reg.gauge_vec(
                "kvmesh_replica_healthy",
                "1 when the replica takes traffic",
                &["replica"],
            )?,
            retries: reg.counter("kvmesh_retries_total", "Attempts after the first")?,
            first_byte_waits_extended: reg.counter(
                "kvmesh_first_byte_waits_extended_total",
                "First-byte waits extended because the replica made progress meanwhile",
            )?,
            ejections: reg.counter_vec(
                "kvmesh_ejections_total",
                "Passive outlier ejections",
                &["replica"],
            )?,
            hedges: reg.counter_vec(
                "kvmesh_hedges_total",
                "Requests hedged at a second replica after retry.hedge_after_ms / hedge_whole_after_ms, by outcome",
                &["outcome"],
            )?,
            stream_resumes: reg.counter_vec(
                "kvmesh_stream_resumes_total",
                "Streams whose replica failed mid-stream, by API and outcome",
                &["api", "outcome"],
            )?,
            pd_decisions: reg.counter_vec(
                "kvmesh_pd_decisions_total",
                "Requests under [pd], by outcome: pair, or whole and why",
                &["outcome"],
            )?,
            pd_legs_failed: reg.counter_vec(
                "kvmesh_pd_legs_failed_total",
                "Failed legs of disaggregated requests, by leg (prefill, decode)",
                &["leg"],
            )?,
            upstream_failures: reg.counter_vec(
                "kvmesh_upstream_failures_total",
                "Failed attempts at replicas, by blame: replica (counts towards ejection) or request",
                &["blame"],
            )?,
            scrape_errors: reg.counter_vec(
                "kvmesh_scrape_errors_total",
                "Failed replica /metrics scrapes",
                &["replica"],
            )?,
            scrape_skipped_lines: reg.counter(
                "kvmesh_scrape_skipped_lines_total",
                "Unparseable lines in replicas' /metrics",
            )?,
            scrape_refused: reg.counter_vec(
                "kvmesh_scrape_refused_values_total",
                "Values in replicas' /metrics outside their bound, refused",
                &["replica"],
            )?,
            cert_reloads: reg.counter_vec(
                "kvmesh_cert_reloads_total",
                "Certificate reloads, by result (error: refused, the certificates in use stayed)",
                &["result"],
            )?,
            decisions: DecisionMetrics::new(&registry)?,
            receipts: ReceiptMetrics::new(&registry)?,
            response_lookups: reg.counter_vec(
                "kvmesh_response_lookups_total",
                "Stored responses looked for on the replicas, by outcome (found, missing)",
                &["outcome"],
            )?,
            registry,
        };
        metrics.zero_fixed_labels();
        Ok(metrics)
    }

    /// Fixed label sets exist at 0 from the start (dashboards and alerts see them at once).
    fn zero_fixed_labels(&self) {
        for blame in ["replica", "request"] {
            self.upstream_failures.with_label_values(&[blame]).reset();
        }
        for outcome in ["sent", "first_won", "hedge_won"] {
            self.hedges.with_label_values(&[outcome]).reset();
        }
        for result in ["ok", "error"] {
            self.cert_reloads.with_label_values(&[result]).reset();
        }
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> Result<String, prometheus::Error> {
        let mut buf = Vec::with_capacity(8 * 1024);
        TextEncoder::new().encode(&self.registry.gather(), &mut buf)?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }
}

/// Makes metrics and registers each in one registry as it is made, so no handle is left
/// unregistered and no registration is written apart from its metric.
struct Registrar<'a>(&'a Registry);

impl Registrar<'_> {
    /// Registers `metric`; the handle back.
    fn add<M: prometheus::core::Collector + Clone + 'static>(
        &self,
        metric: M,
    ) -> Result<M, prometheus::Error> {
        self.0.register(Box::new(metric.clone()))?;
        Ok(metric)
    }

    fn counter(&self, name: &str, help: &str) -> Result<IntCounter, prometheus::Error> {
        self.add(IntCounter::new(name, help)?)
    }

    fn counter_vec(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
    ) -> Result<IntCounterVec, prometheus::Error> {
        self.add(IntCounterVec::new(Opts::new(name, help), labels)?)
    }

    fn gauge(&self, name: &str, help: &str) -> Result<IntGauge, prometheus::Error> {
        self.add(IntGauge::new(name, help)?)
    }

    fn gauge_vec(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
    ) -> Result<IntGaugeVec, prometheus::Error> {
        self.add(IntGaugeVec::new(Opts::new(name, help), labels)?)
    }

    fn histogram(
        &self,
        name: &str,
        help: &str,
        buckets: Vec<f64>,
    ) -> Result<Histogram, prometheus::Error> {
        self.add(Histogram::with_opts(
            HistogramOpts::new(name, help).buckets(buckets),
        )?)
    }

    fn histogram_vec(
        &self,
        name: &str,
        help: &str,
        buckets: Vec<f64>,
        labels: &[&str],
    ) -> Result<HistogramVec, prometheus::Error> {
        self.add(HistogramVec::new(
            HistogramOpts::new(name, help).buckets(buckets),
            labels,
        )?)
    }
}

/// Mesh metrics, registered in the node's registry.
#[derive(Clone)]
pub struct MeshMetrics {
    /// `kvmesh_mesh_gossip_messages_total{direction}`.
    pub gossip_messages: IntCounterVec,
    /// `kvmesh_mesh_gossip_bytes_total{direction}`.
    pub gossip_bytes: IntCounterVec,
    /// `kvmesh_mesh_udp_bytes_total{direction}`: every UDP byte of the mesh endpoint (packet
    /// headers, handshakes, ACKs included): what the mesh costs on the wire.
    pub udp_bytes: IntCounterVec,
    /// `kvmesh_mesh_sync_served_total`: summary requests answered.
    pub sync_served: IntCounter,
    /// `kvmesh_mesh_directory_served_total`: directory requests answered (seeds see joins).
    pub directory_served: IntCounter,
    /// `kvmesh_mesh_sync_bytes_sent_total`: bytes of summary responses sent.
    pub sync_bytes_sent: IntCounter,
    /// `kvmesh_mesh_sync_bytes_received_total`: bytes of summaries pulled (encoded size).
    pub sync_bytes_received: IntCounter,
    /// `kvmesh_mesh_block_reports_total{direction}`.
    pub reports: IntCounterVec,
    /// `kvmesh_mesh_dropped_total{reason}`: malformed/oversized input, undecodable or
    /// out-of-bounds gossip values, blocked or undeliverable messages, failed dials and
    /// handshakes, gossip from a peer whose certificate does not name the node it claims
    /// (`identity_refused`), unsigned or forged gossip values (`forged_refused`), records
    /// a certificate does not allow (`authority_refused`), keys past a member's cap
    /// (`key_cap_refused`), a member's reset relayed by another, made a plain delta
    /// (`reset_refused`), digest entries of members no certificate was seen of
    /// (`digest_unknown`: a just-joined member's, or a flood).
    pub dropped: IntCounterVec,
    /// `kvmesh_mesh_summary_pulls_total{kind}`: delta, snapshot, ignored, error.
    pub pulls: IntCounterVec,
    /// `kvmesh_forwards_total{region,outcome}`: ok, retry (a node failed, next tried),
    /// misdirected (the answer came from another node than the one meant; next tried),
    /// unavailable (every node failed or none live).
    pub forwards: IntCounterVec,
    /// `kvmesh_forward_warmups_total{outcome}`: `GET /health` sent to keep a connection open
    /// to a node this node would forward to (`proxy/warm_peers.rs`): ok, failed.
    pub forward_warmups: IntCounterVec,
    /// `kvmesh_mesh_live_members`: live members, this node included.
    pub live_members: IntGauge,
    /// `kvmesh_mesh_load_updates_total{direction}`: load-sharing datagrams.
    pub load_updates: IntCounterVec,
    /// `kvmesh_mesh_load_bytes_total{direction}`: bytes of load-sharing datagrams.
    pub load_bytes: IntCounterVec,
    /// `kvmesh_mesh_load_claims_refused_total{reason}`: peers' load claims ignored or cut:
    /// `stale`, `not_a_region_peer`, `too_many_peers`, `malformed`, `unknown_replica`,
    /// `clamped`, `tip_dropped` (a routed prefix for an unknown replica, out of bounds, or with
    /// the tip store full), `tip_from_barred_peer` (every tip of a peer barred for claims that
    /// went unanswered, `core::unanswered_claims`).
    pub load_refused: IntCounterVec,
    /// `kvmesh_mesh_records_ignored_total{reason}`: peers' `replica:` records not learned or
    /// not applied, once per (replica, publisher, reason): `not_home` (the publisher is not
    /// the replica's rendezvous home), `bad_url`, `not_allowed` (host outside
    /// `mesh.learn_replicas_from` and this node's own replica hosts), `same_url` (another
    /// replica has its URL), `peer_cap`, `total_cap`, `registry`; `foreign_holder` (per round:
    /// another region's offer named a replica this node knows in a third region or its own);
    /// `untrusted_holder` (per round and holder: an offered holder's host is outside
    /// `mesh.learn_replicas_from`, so no pull is sent there); `empty_holder` (per round and
    /// holder: an offered holder left out for 5 min after 3 empty pulls within 60 s).
    pub records_ignored: IntCounterVec,
    /// `kvmesh_mesh_block_reports_refused_total{reason}`: `not_a_region_member`,
    /// `unknown_replica`, `not_home` (this node is not the replica's home).
    pub reports_refused: IntCounterVec,
    /// `kvmesh_mesh_learned_expired_total`: learned replicas that expired (their live origin
    /// withdrew them, or their origin left and they are down) and drain.
    pub learned_expired: IntCounter,
    /// `kvmesh_mesh_summaries_behind`: replicas of this region whose home published a newer
    /// summary than this node holds (a pull is due or running); stays above 0 only when pulls
    /// fail.
    pub summaries_behind: IntGauge,
    /// `kvmesh_mesh_summary_age_max_seconds`: the longest time since a summary this node
    /// follows (another node is its home) last changed; high for an idle replica, so alert on
    /// `summaries_behind` instead.
    pub summary_age_max: prometheus::Gauge,
    /// `kvmesh_mesh_sync_rounds_total{cause}`: rounds of the mesh sync loop, by what woke it:
    /// `tick` (the gossip interval), `gossip` (a live member's keys changed), `local` (a
    /// summary this node is home for, or a pull, changed). Idle, expect about one `tick` per
    /// gossip interval and few of the others.
    pub sync_rounds: IntCounterVec,
}

impl MeshMetrics {
    /// Creates every mesh metric and registers it in the node's `registry`.
    pub(super) fn new(registry: &prometheus::Registry) -> Result<Self, prometheus::Error> {
        let reg = Registrar(registry);
        let m = MeshMetrics {
            gossip_messages: reg.counter_vec(
                "kvmesh_mesh_gossip_messages_total",
                "Gossip messages by direction",
                &["direction"],
            )?,
            gossip_bytes: reg.counter_vec(
                "kvmesh_mesh_gossip_bytes_total",
                "Gossip bytes by direction",
                &["direction"],
            )?,
            udp_bytes: reg.counter_vec(
                "kvmesh_mesh_udp_bytes_total",
                "UDP bytes of the mesh endpoint by direction, packet overhead included",
                &["direction"],
            )?,
            directory_served: reg.counter(
                "kvmesh_mesh_directory_served_total",
                "Directory requests answered (nodes joining their region through this one)",
            )?,
            sync_served: reg.counter(
                "kvmesh_mesh_sync_served_total",
                "Summary requests answered",
            )?,
            sync_bytes_sent: reg.counter(
                "kvmesh_mesh_sync_bytes_sent_total",
                "Bytes of summary responses sent",
            )?,
            sync_bytes_received: reg.counter(
                "kvmesh_mesh_sync_bytes_received_total",
                "Bytes of summaries pulled",
            )?,
            reports: reg.counter_vec(
                "kvmesh_mesh_block_reports_total",
                "Routed-block reports by direction",
                &["direction"],
            )?,
            dropped: reg.counter_vec(
                "kvmesh_mesh_dropped_total",
                "Mesh input or output dropped, by reason",
                &["reason"],
            )?,
            pulls: reg.counter_vec(
                "kvmesh_mesh_summary_pulls_total",
                "Summary pulls by kind",
                &["kind"],
            )?,
            forwards: reg.counter_vec(
                "kvmesh_forwards_total",
                "Requests forwarded to another region",
                &["region", "outcome"],
            )?,
            forward_warmups: reg.counter_vec(
                "kvmesh_forward_warmups_total",
                "Connections to forwarding targets kept open, by outcome",
                &["outcome"],
            )?,
            live_members: reg.gauge("kvmesh_mesh_live_members", "Live mesh members")?,
            load_updates: reg.counter_vec(
                "kvmesh_mesh_load_updates_total",
                "Load-sharing datagrams by direction",
                &["direction"],
            )?,
            load_bytes: reg.counter_vec(
                "kvmesh_mesh_load_bytes_total",
                "Bytes of load-sharing datagrams by direction",
                &["direction"],
            )?,
            load_refused: reg.counter_vec(
                "kvmesh_mesh_load_claims_refused_total",
                "Peers' load claims ignored or cut to their bounds, by reason",
                &["reason"],
            )?,
            records_ignored: reg.counter_vec(
                "kvmesh_mesh_records_ignored_total",
                "Peers' replica records ignored, once per replica, publisher and reason",
                &["reason"],
            )?,
            reports_refused: reg.counter_vec(
                "kvmesh_mesh_block_reports_refused_total",
                "Peers' block reports refused, by reason",
                &["reason"],
            )?,
            learned_expired: reg.counter(
                "kvmesh_mesh_learned_expired_total",
                "Learned replicas expired (withdrawn by their origin, or down with their origin gone), now draining",
            )?,
            summaries_behind: reg.gauge(
                "kvmesh_mesh_summaries_behind",
                "Replicas whose home published a newer summary than this node holds",
            )?,
            summary_age_max: reg.add(prometheus::Gauge::new(
                "kvmesh_mesh_summary_age_max_seconds",
                "Longest time since a followed replica's summary last changed",
            )?)?,
            sync_rounds: reg.counter_vec(
                "kvmesh_mesh_sync_rounds_total",
                "Rounds of the mesh sync loop, by what woke it",
                &["cause"],
            )?,
        };
        m.zero_fixed_labels();
        Ok(m)
    }

    /// Fixed label sets exist at 0 from the start.
    fn zero_fixed_labels(&self) {
        for cause in ["tick", "gossip", "local"] {
            self.sync_rounds.with_label_values(&[cause]).reset();
        }
        for kind in ["delta", "snapshot", "ignored", "error"] {
            self.pulls.with_label_values(&[kind]).reset();
        }
        for reason in [
            "not_home",
            "bad_url",
            "not_allowed",
            "same_url",
            "peer_cap",
            "total_cap",
            "registry",
            "foreign_holder",
            "untrusted_holder",
            "empty_holder",
        ] {
            self.records_ignored.with_label_values(&[reason]).reset();
        }
    }

    /// Adds what the transport counted since `prev`.
    pub(super) fn add_stats(&self, prev: &StatsSnapshot, now: &StatsSnapshot, schema: (u64, u64)) {
        let d = |f: fn(&StatsSnapshot) -> u64| f(now).saturating_sub(f(prev));
        let labelled: [(&IntCounterVec, &str, u64); 25] = [
            (&self.gossip_messages, "sent", d(|s| s.gossip_sent)),
            (&self.gossip_messages, "received", d(|s| s.gossip_received)),
            (&self.gossip_bytes, "sent", d(|s| s.gossip_bytes_sent)),
            (
                &self.gossip_bytes,
                "received",
                d(|s| s.gossip_bytes_received),
            ),
            (&self.udp_bytes, "sent", d(|s| s.udp_bytes_sent)),
            (&self.udp_bytes, "received", d(|s| s.udp_bytes_received)),
            (&self.load_updates, "sent", d(|s| s.load_sent)),
            (&self.load_updates, "received", d(|s| s.load_received)),
            (&self.load_bytes, "sent", d(|s| s.load_bytes_sent)),
            (&self.load_bytes, "received", d(|s| s.load_bytes_received)),
            (&self.reports, "sent", d(|s| s.reports_sent)),
            (&self.reports, "received", d(|s| s.reports_received)),
            (&self.dropped, "malformed", d(|s| s.malformed)),
            (&self.dropped, "oversized", d(|s| s.oversized)),
            (&self.dropped, "blocked", d(|s| s.blocked)),
            (&self.dropped, "send_dropped", d(|s| s.send_dropped)),
            (&self.dropped, "connect_failure", d(|s| s.connect_failures)),
            (
                &self.dropped,
                "handshake_failure",
                d(|s| s.handshake_failures),
            ),
            (&self.dropped, "identity_refused", d(|s| s.identity_refused)),
            (&self.dropped, "forged_refused", d(|s| s.forged_refused)),
            (
                &self.dropped,
                "authority_refused",
                d(|s| s.authority_refused),
            ),
            (&self.dropped, "key_cap_refused", d(|s| s.key_cap_refused)),
            (&self.dropped, "reset_refused", d(|s| s.reset_refused)),
            (&self.dropped, "digest_unknown", d(|s| s.digest_unknown)),
            (
                &self.dropped,
                "bad_gossip_value",
                schema.1.saturating_sub(schema.0),
            ),
        ];
        // Every series is created (at 0 until something happens), so dashboards see them all.
        for (counter, label, n) in labelled {
            counter.with_label_values(&[label]).inc_by(n);
        }
        self.sync_served.inc_by(d(|s| s.sync_served));
        self.directory_served.inc_by(d(|s| s.directory_served));
        self.sync_bytes_sent.inc_by(d(|s| s.sync_bytes_sent));
    }
}

/// Receipts (`proxy/receipts.rs`): per answered request, the prompt tokens the node predicted
/// cached at the replica it chose against what the engine reported. Routing precision is
/// `matched / predicted` (how much of what the node believed cached was), recall `matched /
/// reported` (how much of what was cached the node knew of), per API and decision branch.
#[derive(Clone)]
pub struct ReceiptMetrics {
    /// `kvmesh_receipts_total{api,branch,outcome}`: answers ended whole, by whether the engine
    /// reported cached tokens (`reported`) or not (`no_usage`).
    pub receipts: IntCounterVec,
    /// `kvmesh_receipt_predicted_tokens_total{api,branch}`: predicted cached, reported answers.
    pub predicted: IntCounterVec,
    /// `kvmesh_receipt_reported_tokens_total{api,branch}`: reported cached.
    pub reported: IntCounterVec,
    /// `kvmesh_receipt_matched_tokens_total{api,branch}`: min(predicted, reported) per answer.
    pub matched: IntCounterVec,
    /// `kvmesh_receipt_error_tokens`: reported − predicted cached tokens per answer.
    pub error_tokens: Histogram,
    /// `kvmesh_receipt_fetch_planned_tokens_total{api,branch}`: of the predicted, tokens a
    /// KV-fetch hint asked the replica to pull from another (`core::kv_fetch`).
    pub fetch_planned: IntCounterVec,
}

impl ReceiptMetrics {
    fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let tokens =
            |name: &str, help: &str| IntCounterVec::new(Opts::new(name, help), &["api", "branch"]);
        let receipts = IntCounterVec::new(
            Opts::new(
                "kvmesh_receipts_total",
                "Answers ended whole, by API, decision branch and whether the engine reported cached tokens",
            ),
            &["api", "branch", "outcome"],
        )?;
        let predicted = tokens(
            "kvmesh_receipt_predicted_tokens_total",
            "Prompt tokens the node predicted cached at the chosen replica (answers with a report)",
        )?;
        let reported = tokens(
            "kvmesh_receipt_reported_tokens_total",
            "Prompt tokens the engine reported served from cache",
        )?;
        let matched = tokens(
            "kvmesh_receipt_matched_tokens_total",
            "min(predicted, reported) cached tokens per answer: precision = matched / predicted",
        )?;
        let mut buckets: Vec<f64> = [65536.0, 16384.0, 4096.0, 1024.0, 256.0, 64.0, 16.0]
            .iter()
            .map(|b: &f64| -b)
            .collect();
        buckets.push(0.0);
        buckets.extend([16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0]);
        let error_tokens = Histogram::with_opts(
            HistogramOpts::new(
                "kvmesh_receipt_error_tokens",
                "Reported minus predicted cached tokens per answer (negative: the node believed more was cached)",
            )
            .buckets(buckets),
        )?;
        registry.register(Box::new(receipts.clone()))?;
        registry.register(Box::new(predicted.clone()))?;
        registry.register(Box::new(reported.clone()))?;
        registry.register(Box::new(matched.clone()))?;
        let fetch_planned = tokens(
            "kvmesh_receipt_fetch_planned_tokens_total",
            "Of the predicted cached tokens, those a KV-fetch hint asked the replica to pull",
        )?;
        registry.register(Box::new(error_tokens.clone()))?;
        registry.register(Box::new(fetch_planned.clone()))?;
        Ok(ReceiptMetrics {
            receipts,
            predicted,
            reported,
            matched,
            error_tokens,
            fetch_planned,
        })
    }
}
