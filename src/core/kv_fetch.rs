//! Pulling a prefix's KV from the replica that holds it: what a fetch costs, and when to plan one.
//!
//! Engines since 2026 can take a hint naming another replica to pull cached prefix blocks from
//! (vLLM's `KvHintsEnvelope` with a `kv.fetch@1.0` action, llm-d's
//! `kv_transfer_params.remote_kv_source`; the wire shapes are `proxy/kv_hint.rs`). So each
//! candidate has a third option besides reusing its own cached run or recomputing: fetch the
//! longest run another replica holds and compute only the rest. Its predicted cost is
//!
//! ```text
//! transfer_s = setup_s(link) + step_s(source) + (source_hit − own_hit) × tokens_per_block
//!              × bytes_per_token / bandwidth(link)
//! fetch_cost = queue_s + transfer_s + (prompt − source_hit × tokens_per_block) / prefill_rate
//! ```
//!
//! where `link` is what joins the two replicas — same host (NVLink), same zone or rack (RDMA),
//! same region (datacenter TCP), another region (WAN) — read from their URLs' hosts, zones and
//! regions; `step_s(source)` the source's load: a pull is served between the source engine's
//! steps, so it waits out the current one — a decode step plus the prefill chunk its queue puts
//! in it, at most one full chunk's ([`source_step_s`]). With `mode = "priced"` the router plans
//! the fetch for a candidate only where it is predicted cheaper than recomputing those tokens
//! there, and lowers the candidate's predicted cost and prefill by it only where it is also
//! sooner than the holder serving the request itself (`fetch_plan.rs`); the policy weighs it as
//! usual. The longest holder is found once
//! per decision, not per pair: the per-candidate work is a few flops and a link lookup, and
//! only for candidates that take hints and hold less than the holder.
//!
//! `mode = "reactive"` is what peers ship (Dynamo's router hints, llm-d's P2P source): decide
//! as without fetching, then tell the chosen replica to pull from the longest holder, priced or
//! not. It exists to be compared with (`kvmesh sim --kv-fetch reactive`).
//!
//! Only replicas that declare a hint format (`kv_load.hints`) are ever told to fetch; a source
//! needs none (it only answers pulls). Bandwidth defaults are published figures
//! (docs/kv-transfer.md names each source); all are configuration (`[kv_fetch]`).

use serde::Deserialize;

pub use super::kv_load::KvHintFormat;
use super::view::{ReplicaInfo, ReplicaState};

/// Whether, and how, the router plans fetches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FetchMode {
    /// Never: a candidate reuses its own run or recomputes. The default.
    #[default]
    Off,
    /// Priced in the decision: a candidate may pull the longest holder's run where that is
    /// predicted cheaper than recomputing it.
    Priced,
    /// Decided without fetching, then the chosen replica pulls from the longest holder (what
    /// Dynamo and llm-d do); for comparison.
    Reactive,
}

impl std::str::FromStr for FetchMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(FetchMode::Off),
            "priced" => Ok(FetchMode::Priced),
            "reactive" => Ok(FetchMode::Reactive),
            other => Err(format!(
                "unknown KV fetch mode '{other}' (off, priced, reactive)"
            )),
        }
    }
}

impl FetchMode {
    /// The mode's name, as configured.
    pub fn as_str(self) -> &'static str {
        match self {
            FetchMode::Off => "off",
            FetchMode::Priced => "priced",
            FetchMode::Reactive => "reactive",
        }
    }
}

/// One kind of link between two replicas: its rate and the fixed cost of starting a pull.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkSpec {
    /// Sustained rate, GB/s (10⁹ bytes per second).
    pub gb_per_s: f64,
    /// Seconds before the first byte moves (connection, descriptor exchange), in milliseconds.
    pub setup_ms: f64,
}

/// The four links a pair of replicas can be joined by, nearest first.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LinkTable {
    /// Same host (GPU to GPU over NVLink). Default 450 GB/s, 0.5 ms: H100 SXM NVLink 4 is
    /// 900 GB/s both ways together.
    pub same_host: LinkSpec,
    /// Same zone or rack (RDMA through NIXL or Mooncake). Default 50 GB/s, 1 ms: one 400 Gb/s
    /// NDR InfiniBand / ConnectX-7 port per GPU.
    pub same_zone: LinkSpec,
    /// Same region, other zone (datacenter TCP). Default 12.5 GB/s, 2 ms: a 100 Gb/s NIC.
    pub same_region: LinkSpec,
    /// Another region (TCP over the WAN). Default 0.625 GB/s, 60 ms: AWS caps one flow between
    /// regions at 5 Gb/s; the setup is a cross-continent round trip or two.
    pub cross_region: LinkSpec,
}

impl Default for LinkTable {
    fn default() -> Self {
        LinkTable {
            same_host: LinkSpec {
                gb_per_s: 450.0,
                setup_ms: 0.5,
            },
            same_zone: LinkSpec {
                gb_per_s: 50.0,
                setup_ms: 1.0,
            },
            same_region: LinkSpec {
                gb_per_s: 12.5,
                setup_ms: 2.0,
            },
            cross_region: LinkSpec {
                gb_per_s: 0.625,
                setup_ms: 60.0,
            },
        }
    }
}

/// Which link joins two replicas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Link {
    /// Same host in their URLs.
    SameHost,
    /// Same region and the same non-empty zone.
    SameZone,
    /// Same region, zones differ or are unknown.
    SameRegion,
    /// Different regions.
    CrossRegion,
}

impl Link {
    /// The link between replicas `a` and `b`.
    pub fn between(a: &ReplicaInfo, b: &ReplicaInfo) -> Link {
        Link::between_host(a, b, host_of(&b.url))
    }

    /// [`Link::between`] with `b`'s URL host already parsed (one source, many targets).
    pub fn between_host(a: &ReplicaInfo, b: &ReplicaInfo, b_host: &str) -> Link {
        if a.region != b.region {
            Link::CrossRegion
        } else if host_of(&a.url) == b_host {
            Link::SameHost
        } else if !a.zone.is_empty() && a.zone == b.zone {
            Link::SameZone
        } else {
            Link::SameRegion
        }
    }
}

impl LinkTable {
    /// The spec of `link`.
    pub fn spec(&self, link: Link) -> LinkSpec {
        match link {
            Link::SameHost => self.same_host,
            Link::SameZone => self.same_zone,
            Link::SameRegion => self.same_region,
            Link::CrossRegion => self.cross_region,
        }
    }
}

/// The host part of a base URL (`http://10.0.0.1:8000/x` → `10.0.0.1`), without allocating.
pub fn host_of(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
    let authority = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split(']').next().unwrap_or(v6);
    }
    authority.split(':').next().unwrap_or(authority)
}

/// Fetch settings (`[kv_fetch]` in the node's config).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvFetchConfig {
    /// Off (default), priced in the decision, or reactive (decide, then pull).
    pub mode: FetchMode,
    /// Link rates and setup times.
    pub links: LinkTable,
    /// Fewest tokens worth a pull. Default 256 (16 blocks of 16): below it the setup and the
    /// hint's bytes buy little.
    pub min_tokens: u64,
}

impl Default for KvFetchConfig {
    fn default() -> Self {
        KvFetchConfig {
            mode: FetchMode::Off,
            links: LinkTable::default(),
            min_tokens: 256,
        }
    }
}

/// Why a [`KvFetchConfig`] was refused (the message names the key).
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum KvFetchConfigError {
    /// A rate outside 0.01..=10000 GB/s or a setup outside 0..=10000 ms.
    #[error("kv_fetch.links.{0} must have gb_per_s in 0.01..=10000 and setup_ms in 0..=10000, got {1} GB/s, {2} ms")]
    Link(&'static str, f64, f64),
    /// `min_tokens` above 4 Mi.
    #[error("kv_fetch.min_tokens must be at most 4194304, got {0}")]
    MinTokens(u64),
}

impl KvFetchConfig {
    /// Checks the bounds.
    pub fn validate(&self) -> Result<(), KvFetchConfigError> {
        let l = &self.links;
        for (name, s) in [
            ("same_host", l.same_host),
            ("same_zone", l.same_zone),
            ("same_region", l.same_region),
            ("cross_region", l.cross_region),
        ] {
            if !super::kv_load::GB_PER_S_RANGE.contains(&s.gb_per_s)
                || !(0.0..=10_000.0).contains(&s.setup_ms)
            {
                return Err(KvFetchConfigError::Link(name, s.gb_per_s, s.setup_ms));
            }
        }
        if self.min_tokens > 4 << 20 {
            return Err(KvFetchConfigError::MinTokens(self.min_tokens));
        }
        Ok(())
    }

    /// Predicted seconds to move `tokens` tokens of KV from `source` to `target` (module doc).
    /// `None` when `target` takes no hint.
    pub fn transfer_s(
        &self,
        target: &ReplicaInfo,
        source: &ReplicaState,
        tokens: u64,
    ) -> Option<f64> {
        let from = PullSource::of(source);
        self.transfer_from(target, &from, tokens)
    }

    /// [`KvFetchConfig::transfer_s`] from a source read once per decision.
    pub fn transfer_from(
        &self,
        target: &ReplicaInfo,
        from: &PullSource<'_>,
        tokens: u64,
    ) -> Option<f64> {
        let load = target.kv_load.as_ref().filter(|l| !l.hints.is_none())?;
        let spec = self
            .links
            .spec(Link::between_host(target, from.info, from.host));
        let bytes = tokens as f64 * f64::from(load.bytes_per_token);
        Some(spec.setup_ms / 1000.0 + from.step_s + bytes / (spec.gb_per_s.max(1e-6) * 1e9))
    }
}

/// What pricing pulls from one source needs of it, read once per decision rather than once per
/// candidate: its info, its URL's host and its step ([`source_step_s`]).
#[derive(Clone, Copy, Debug)]
pub struct PullSource<'a> {
    /// The source's static description.
    pub info: &'a ReplicaInfo,
    /// Its URL's host ([`host_of`]).
    pub host: &'a str,
    /// Seconds a pull waits for its current step.
    pub step_s: f64,
}

impl<'a> PullSource<'a> {
    /// The source `source` as it is now.
    pub fn of(source: &'a ReplicaState) -> PullSource<'a> {
        PullSource {
            info: &source.info,
            host: host_of(&source.info.url),
            step_s: source_step_s(
                u64::from(source.load.outstanding()),
                source.load.queued_prefill_tokens,
                source.info.prefill_tokens_per_s,
            ),
        }
    }
}

/// The longest a pull waits for its source's engine: one step, and the longest step is one full
/// prefill chunk (8,192 tokens ≈ 0.19 s for an 8B model on an H100, engine-timing reference).
pub const MAX_SOURCE_STEP_S: f64 = 0.2;

/// The fixed part of one engine step: a decode-only step of a busy 8B engine on an H100 lasts
/// about this (vLLM step overhead 7.5 ms plus its batch's decode; engine-timing reference, the
/// simulator's `8b-h100` preset).
pub const STEP_BASE_S: f64 = 0.0075;

/// Prompt tokens one step prefills at most (vLLM's `max_num_batched_tokens` on an H100).
pub const STEP_CHUNK_TOKENS: u64 = 8192;

/// Seconds a pull waits for its source's engine: the engine hands blocks out between steps, so
/// an idle source (`outstanding` 0) serves at once and a busy one after its current step — a
/// decode step ([`STEP_BASE_S`]) plus the prefill chunk its queued prompt tokens put in it (up
/// to [`STEP_CHUNK_TOKENS`] at `prefill_tokens_per_s`), at most [`MAX_SOURCE_STEP_S`]. A step
/// lasts this whatever the batch size: the count of requests (what the cost model's `w_load`
/// weighs) made a 16-request source look 80 ms away, and priced pulls out where they paid.
pub fn source_step_s(
    outstanding: u64,
    queued_prefill_tokens: u64,
    prefill_tokens_per_s: f64,
) -> f64 {
    if outstanding == 0 {
        return 0.0;
    }
    let chunk = queued_prefill_tokens.min(STEP_CHUNK_TOKENS) as f64;
    (STEP_BASE_S + chunk / prefill_tokens_per_s.max(1.0)).min(MAX_SOURCE_STEP_S)
}

/// A pull the decision asks of the chosen replica: blocks `from_tokens..tokens` of the prompt
/// (in tokens, whole blocks), from replica `source`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvFetchPlan {
    /// The source replica's index in the view ([`OFFERED_SOURCE`] when `offer_key` names it).
    pub source: usize,
    /// `Some(head key)`: the source is not in the view but the holder another region's offer
    /// names for that head (regional gossip; `core::region_offer::OfferedHolder`).
    pub offer_key: Option<u64>,
    /// Prompt tokens the target is believed to hold already (the pull starts there).
    pub from_tokens: u64,
    /// Prompt tokens the source is believed to hold (the pull ends there).
    pub tokens: u64,
    /// Predicted seconds of the transfer.
    pub predicted_s: f64,
    /// The wire form the target takes.
    pub format: KvHintFormat,
}

/// The `source` of a plan whose source is an offered holder: no view index (a lookup by it finds
/// nothing, so code that knows only view sources skips the pull rather than misnaming one).
pub const OFFERED_SOURCE: usize = usize::MAX;

impl KvFetchPlan {
    /// Tokens the pull moves.
    pub fn fetched_tokens(&self) -> u64 {
        self.tokens.saturating_sub(self.from_tokens)
    }
}

/// The holder of the longest run among candidates: `(candidate index, hit blocks)`, ties to the
/// one with the least queue. `None` when nobody holds a block.
pub fn longest_holder<I>(hits: I) -> Option<(usize, u32)>
where
    I: IntoIterator<Item = (u32, f64)>,
{
    let mut best: Option<(usize, u32, f64)> = None;
    for (i, (hit, queue_s)) in hits.into_iter().enumerate() {
        if hit == 0 {
            continue;
        }
        match best {
            Some((_, h, q)) if hit < h || (hit == h && queue_s >= q) => {}
            _ => best = Some((i, hit, queue_s)),
        }
    }
    best.map(|(i, h, _)| (i, h))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::kv_load::KvLoad;
    use crate::core::view::testing::info;
    use crate::core::view::View;

    #[test]
    fn hosts_come_out_of_urls() {
        assert_eq!(host_of("http://10.0.0.1:8000"), "10.0.0.1");
        assert_eq!(host_of("https://u:p@gpu-3.example/v1"), "gpu-3.example");
        assert_eq!(host_of("http://[::1]:9000/"), "::1");
        assert_eq!(host_of("localhost"), "localhost");
    }

    #[test]
    fn the_link_is_the_nearest_thing_two_replicas_share() {
        let mut a = info("a", "eu");
        let mut b = info("b", "eu");
        a.url = "http://10.0.0.1:8000".into();
        b.url = "http://10.0.0.1:8001".into();
        assert_eq!(Link::between(&a, &b), Link::SameHost);
        b.url = "http://10.0.0.2:8000".into();
        assert_eq!(Link::between(&a, &b), Link::SameRegion);
        a.zone = "z1".into();
        b.zone = "z1".into();
        assert_eq!(Link::between(&a, &b), Link::SameZone);
        b.region = "us".into();
        assert_eq!(Link::between(&a, &b), Link::CrossRegion);
    }

    #[test]
    fn transfer_time_grows_with_tokens_and_distance_and_needs_a_hint_taker() {
        let cfg = KvFetchConfig::default();
        let mut target = info("t", "eu");
        let mut v = crate::core::view::View::new("eu", 16);
        let s = v.upsert(info("s", "eu"));
        let source = v.replica(s).unwrap();
        assert_eq!(cfg.transfer_s(&target, source, 1000), None);
        target.kv_load = Some(KvLoad {
            hints: KvHintFormat::VllmEnvelope,
            ..KvLoad::default()
        });
        let near = cfg.transfer_s(&target, source, 8192).unwrap();
        // 8192 tokens × 128 KiB over 12.5 GB/s + 2 ms.
        let expect = 0.002 + 8192.0 * 131_072.0 / 12.5e9;
        assert!((near - expect).abs() < 1e-9, "{near} vs {expect}");
        let far = {
            let mut t = target.clone();
            t.region = "us".into();
            cfg.transfer_s(&t, source, 8192).unwrap()
        };
        assert!(far > 10.0 * near);
    }

    /// A pull waits for the source's current step: none when it is idle, a decode step when it
    /// only decodes, plus the chunk its queued prefill puts in the step — whatever its number of
    /// requests (16 decoding requests used to price 80 ms).
    #[test]
    fn a_source_step_follows_its_queued_prefill_not_its_request_count() {
        assert_eq!(source_step_s(0, 1_000_000, 50_000.0), 0.0);
        assert_eq!(source_step_s(16, 0, 50_000.0), STEP_BASE_S);
        assert_eq!(
            source_step_s(1, 0, 50_000.0),
            source_step_s(64, 0, 50_000.0)
        );
        let chunk = source_step_s(16, 4096, 50_000.0);
        assert!(
            (chunk - (STEP_BASE_S + 4096.0 / 50_000.0)).abs() < 1e-12,
            "{chunk}"
        );
        assert_eq!(source_step_s(16, 1 << 30, 1.0), MAX_SOURCE_STEP_S);
    }

    #[test]
    fn the_longest_holder_is_the_least_queued_among_equals() {
        assert_eq!(longest_holder([(0, 0.0), (0, 1.0)]), None);
        assert_eq!(
            longest_holder([(3, 0.5), (8, 2.0), (8, 1.0), (2, 0.0)]),
            Some((2, 8))
        );
    }

    /// A busy holder `h` (10 s of queued prefill) of an 8,192-token prompt and an idle
    /// neighbour `n` that takes hints, in the same zone on other hosts; routed once with `cfg`.
    fn busy_holder_idle_neighbour(
        cfg: KvFetchConfig,
    ) -> (crate::core::router::Routed, usize, usize) {
        use crate::core::keys::BlockKey;
        use crate::core::policy::PolicyKind;
        use crate::core::router::{Decision, RouteRequest, Router, RouterConfig};
        use crate::core::summary::{ReplicaSummary, SummaryConfig};
        use crate::core::tenants::Tenants;
        let keys: Vec<BlockKey> = (1..=512).map(BlockKey).collect();
        let mut v = View::new("eu", 16);
        let h = v.upsert(ReplicaInfo {
            url: "http://10.0.0.1:8000".into(),
            zone: "z1".into(),
            ..info("holder", "eu")
        });
        let n = v.upsert(ReplicaInfo {
            url: "http://10.0.0.2:8000".into(),
            zone: "z1".into(),
            kv_load: Some(KvLoad {
                hints: KvHintFormat::VllmEnvelope,
                ..KvLoad::default()
            }),
            ..info("neighbour", "eu")
        });
        let mut s = ReplicaSummary::new(1, 10_000, &SummaryConfig::for_cluster("c")).unwrap();
        s.insert(&keys);
        v.set_summary(h, s);
        v.replica_mut(h).unwrap().load.queued_prefill_tokens = 500_000;
        let mut r = Router::new(
            RouterConfig {
                policy: PolicyKind::P2cCache,
                cost: crate::core::cost::CostModel {
                    fetch: cfg,
                    ..Default::default()
                },
                ..Default::default()
            },
            Tenants::default(),
        );
        let req = RouteRequest::plain("m", &keys, 512 * 16);
        match r.route(&v, &req, std::time::Duration::from_secs(100)) {
            Decision::Route(d) => (d, h, n),
            other => panic!("expected a route, got {other:?}"),
        }
    }

    #[test]
    fn a_busy_holder_and_an_idle_neighbour_on_a_fast_link_fetch() {
        let priced = KvFetchConfig {
            mode: FetchMode::Priced,
            ..KvFetchConfig::default()
        };
        let (d, h, n) = busy_holder_idle_neighbour(priced);
        assert_eq!(d.replica, n);
        let plan = d.fetch.expect("the neighbour pulls the prefix");
        assert_eq!(plan.source, h);
        assert_eq!((plan.from_tokens, plan.tokens), (0, 512 * 16 - 1));
        assert_eq!(plan.format, KvHintFormat::VllmEnvelope);
        // 1 ms + 8191 × 128 KiB at 50 GB/s ≈ 22 ms, against 164 ms of recompute.
        assert!(plan.predicted_s < 0.03, "{}", plan.predicted_s);
        assert!(d.predicted_s < 0.05, "{}", d.predicted_s);
        // Off: the same neighbour, recomputing.
        let (d, _, n) = busy_holder_idle_neighbour(KvFetchConfig::default());
        assert_eq!((d.replica, d.fetch), (n, None));
        assert!(d.predicted_s > 0.15, "{}", d.predicted_s);
    }

    #[test]
    fn across_a_slow_link_the_neighbour_recomputes() {
        let mut slow = KvFetchConfig {
            mode: FetchMode::Priced,
            ..KvFetchConfig::default()
        };
        // 8191 × 128 KiB at 1 GB/s ≈ 1.07 s: recomputing (164 ms) is cheaper.
        slow.links.same_zone.gb_per_s = 1.0;
        let (d, _, n) = busy_holder_idle_neighbour(slow);
        assert_eq!((d.replica, d.fetch), (n, None));
        // Reactive fetches anyway.
        slow.mode = FetchMode::Reactive;
        let (d, h, n) = busy_holder_idle_neighbour(slow);
        assert_eq!(d.replica, n);
        assert_eq!(d.fetch.map(|p| p.source), Some(h));
    }

    proptest::proptest! {
        /// Whatever the hits, loads and links: a pull is planned only for a replica that takes
        /// hints, from another replica holding more of the prompt, for at least `min_tokens`.
        #[test]
        fn a_pull_goes_only_to_a_hint_taker_from_a_longer_holder(
            fleet in proptest::collection::vec((0usize..40, 0u64..400_000, proptest::bool::ANY, 0u8..3), 2..6),
            reactive in proptest::bool::ANY,
            seed in 0u64..1000,
        ) {
            use crate::core::keys::BlockKey;
            use crate::core::policy::PolicyKind;
            use crate::core::router::{Decision, RouteRequest, Router, RouterConfig};
            use crate::core::summary::{ReplicaSummary, SummaryConfig};
            use crate::core::tenants::Tenants;
            let keys: Vec<BlockKey> = (1..=40).map(BlockKey).collect();
            let mut v = View::new("eu", 16);
            for (i, (hit, queued, hints, host)) in fleet.iter().enumerate() {
                let r = v.upsert(ReplicaInfo {
                    url: format!("http://10.0.0.{host}:{}", 8000 + i),
                    kv_load: hints.then(|| KvLoad {
                        hints: KvHintFormat::LlmD,
                        ..KvLoad::default()
                    }),
                    ..info(&format!("r{i}"), "eu")
                });
                let mut s = ReplicaSummary::new(1, 10_000, &SummaryConfig::for_cluster("c")).unwrap();
                s.insert(&keys[..*hit]);
                v.set_summary(r, s);
                v.replica_mut(r).unwrap().load.queued_prefill_tokens = *queued;
            }
            let mode = if reactive { FetchMode::Reactive } else { FetchMode::Priced };
            let mut r = Router::new(
                RouterConfig {
                    policy: PolicyKind::P2cCache,
                    seed,
                    cost: crate::core::cost::CostModel {
                        fetch: KvFetchConfig { mode, min_tokens: 16, ..KvFetchConfig::default() },
                        ..Default::default()
                    },
                    ..Default::default()
                },
                Tenants::default(),
            );
            let req = RouteRequest::plain("m", &keys, 40 * 16);
            let Decision::Route(d) = r.route(&v, &req, std::time::Duration::from_secs(100)) else {
                panic!("a healthy fleet routes");
            };
            if let Some(p) = d.fetch {
                let (target_hit, _, target_hints, _) = fleet[d.replica];
                let (source_hit, ..) = fleet[p.source];
                proptest::prop_assert!(target_hints, "a pull for a replica taking no hints");
                proptest::prop_assert_ne!(p.source, d.replica);
                proptest::prop_assert!(source_hit > target_hit);
                proptest::prop_assert_eq!(p.from_tokens, target_hit as u64 * 16);
                proptest::prop_assert!(p.tokens >= p.from_tokens + 16);
                proptest::prop_assert_eq!(p.format, KvHintFormat::LlmD);
            }
        }
    }

    #[test]
    fn config_bounds_name_the_key() {
        let mut c = KvFetchConfig::default();
        assert_eq!(c.validate(), Ok(()));
        c.links.cross_region.gb_per_s = 0.0;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("kv_fetch.links.cross_region"), "{e}");
    }
}
