//! Prefill/decode pairs: where the two legs of a disaggregated request run.
//!
//! A disaggregated request runs its prefill on one replica and its decode on another, and the
//! KV cache moves between them over the fast fabric. So the pair is chosen inside the node's own
//! region and, where the prefill replica has a zone, inside that zone; a request that cannot be
//! paired here goes whole (to a replica that runs both legs, or to another region, whose node
//! may split it again): a pair never spans regions.
//!
//! Each leg is chosen for what bounds it:
//! - **prefill** by the router's ordinary decision over prefill-capable replicas
//!   ([`Router::route_leg`] with [`Leg::Prefill`]): the predicted seconds to first token, which
//!   the prefix hit dominates — the replica holding the prompt computes least;
//! - **decode** by load: decode is bound by KV memory and batch size, so the replica with the
//!   least `kv_usage + outstanding / max_in_flight` (in the prefill's region and zone) takes
//!   it; ties go to fewer requests in flight, then to the lower rendezvous seed.
//!
//! **Bypass.** Disaggregation pays a transfer for every prompt; when a replica that can run the
//! whole request already holds nearly all of it, the few tokens it must compute cost less than
//! the hand-over. So when the router's whole-request choice leaves fewer than
//! [`PdConfig::bypass_uncached_tokens`] tokens uncached, the request goes there whole (vLLM
//! router PR #130 and llm-d's prefix-based decider do the same). Decode replicas hold the
//! prompts they were handed, so a conversation's next turn usually bypasses.
//!
//! When the chosen prefill replica is also the best decode (a `both` replica), the request
//! runs whole there: a hand-over to itself would only cost.

use std::time::Duration;

use super::role::Leg;
use super::router::{Decision, RouteRequest, Routed, Router};
use super::view::{Health, ReplicaState, View};

/// Disaggregation settings of the pair choice.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PdConfig {
    /// Send the request whole when the whole-request choice leaves fewer than this many prompt
    /// tokens uncached there. 0 turns the bypass off. Default 256 (four 64-token blocks).
    pub bypass_uncached_tokens: u64,
    /// Whether a decode replica may run a bypassed request whole (vLLM: yes, a decode engine
    /// computes what it was not handed; SGLang: no, a decode server needs a bootstrap room, so
    /// only `both` replicas take whole requests). Default true.
    pub whole_on_decode: bool,
}

impl Default for PdConfig {
    fn default() -> Self {
        PdConfig {
            bypass_uncached_tokens: 256,
            whole_on_decode: true,
        }
    }
}

/// Why a request runs whole rather than as a pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WholeReason {
    /// No healthy prefill-only replica serves the model in this region: nothing to split onto.
    NoPrefill,
    /// The whole-request choice holds the prompt but for a few tokens (the bypass).
    Bypass,
    /// No decode replica in the prefill's region and zone can take it.
    NoDecode,
    /// The chosen prefill replica is also the best decode.
    SameReplica,
    /// The prefill leg could not be placed here (spill, quota, none left after failover).
    NoPair,
}

impl WholeReason {
    /// Stable label (metrics, debug headers).
    pub fn as_str(self) -> &'static str {
        match self {
            WholeReason::NoPrefill => "no_prefill",
            WholeReason::Bypass => "bypass",
            WholeReason::NoDecode => "no_decode",
            WholeReason::SameReplica => "same_replica",
            WholeReason::NoPair => "no_pair",
        }
    }
}

/// A prefill/decode pair in one region (and zone).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PdPair {
    /// The prefill leg, as the router decided it (replica, hit, predicted seconds).
    pub prefill: Routed,
    /// The decode replica's view index.
    pub decode: usize,
    /// Its load score (`kv_usage + outstanding / max_in_flight`) when chosen.
    pub decode_load: f64,
}

/// Where a possibly disaggregated request goes.
#[derive(Clone, Debug, PartialEq)]
pub enum PdChoice {
    /// The whole request, as an ordinary decision (which may forward or reject).
    Whole {
        /// The decision.
        decision: Decision,
        /// Why it is not a pair.
        reason: WholeReason,
    },
    /// Prefill on one replica, decode on another.
    Pair(PdPair),
}

/// Chooses where `req` runs: a pair, or whole (module doc). `req.exclude` applies to both legs.
pub fn choose(
    router: &mut Router,
    view: &View,
    req: &RouteRequest<'_>,
    now: Duration,
    cfg: &PdConfig,
) -> PdChoice {
    let whole_leg = if cfg.whole_on_decode {
        Leg::Whole
    } else {
        Leg::WholeOnBoth
    };
    let usable = |i: usize, r: &ReplicaState| {
        r.info.region == view.local_region
            && r.health == Health::Healthy
            && !req.exclude.contains(&i)
            && r.info.models.iter().any(|m| m == req.model)
    };
    let splittable = view
        .replicas()
        .iter()
        .enumerate()
        .any(|(i, r)| r.info.pd.role == super::role::Role::Prefill && usable(i, r));
    if !splittable {
        return PdChoice::Whole {
            decision: router.route_leg(view, req, now, Leg::Whole),
            reason: WholeReason::NoPrefill,
        };
    }
    let mut whole = None;
    if cfg.bypass_uncached_tokens > 0 {
        let d = router.route_leg(view, req, now, whole_leg);
        if let Decision::Route(r) = &d {
            let cached = u64::from(r.hit_blocks) * u64::from(view.tokens_per_block);
            if req.prompt_tokens.saturating_sub(cached) < cfg.bypass_uncached_tokens {
                return PdChoice::Whole {
                    decision: d,
                    reason: WholeReason::Bypass,
                };
            }
        }
        whole = Some(d);
    }
    // The whole-request decision, computed once (the bypass may have done it already).
    let whole = move |router: &mut Router, reason| PdChoice::Whole {
        decision: whole.unwrap_or_else(|| router.route_leg(view, req, now, whole_leg)),
        reason,
    };
    let prefill = match router.route_leg(view, req, now, Leg::Prefill) {
        Decision::Route(p) => p,
        _ => return whole(router, WholeReason::NoPair),
    };
    let Some(p) = view.replica(prefill.replica) else {
        return whole(router, WholeReason::NoPair);
    };
    let pools = &router.tenants.config(req.tenant).pools;
    let zone = p.info.zone.as_str();
    let best = view
        .replicas()
        .iter()
        .enumerate()
        .filter(|(i, r)| {
            usable(*i, r)
                && r.info.pd.role.decodes()
                && (zone.is_empty() || r.info.zone == zone)
                && (pools.is_empty() || pools.contains(&r.info.pool))
                && r.load.outstanding() < r.info.max_in_flight
        })
        .map(|(i, r)| (decode_load(r), r.load.in_flight, r.seed, i))
        .min_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    match best {
        None => whole(router, WholeReason::NoDecode),
        Some((_, _, _, d)) if d == prefill.replica => PdChoice::Whole {
            decision: Decision::Route(prefill),
            reason: WholeReason::SameReplica,
        },
        Some((load, _, _, d)) => PdChoice::Pair(PdPair {
            prefill,
            decode: d,
            decode_load: load,
        }),
    }
}

/// A decode candidate's load: KV usage (0..1) plus its outstanding requests as a share of its
/// in-flight cap. Both bound a decode engine: memory for the sequences, batch size for speed.
pub fn decode_load(r: &ReplicaState) -> f64 {
    let kv = f64::from(r.load.kv_usage).clamp(0.0, 1.0);
    kv + f64::from(r.load.outstanding()) / f64::from(r.info.max_in_flight.max(1))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::core::keys::{text_block_keys, BlockKey, Namespace};
    use crate::core::role::Role;
    use crate::core::router::{RouteRequest, RouterConfig};
    use crate::core::summary::{ReplicaSummary, SummaryConfig};
    use crate::core::tenants::Tenants;
    use crate::core::view::testing::info;
    use crate::core::view::ReplicaInfo;

    const NOW: Duration = Duration::from_secs(100);

    fn with_role(id: &str, region: &str, zone: &str, role: Role) -> ReplicaInfo {
        let mut i = info(id, region);
        i.zone = zone.into();
        i.pd.role = role;
        i
    }

    fn keys(text: &str) -> Vec<BlockKey> {
        let mut k = Vec::new();
        text_block_keys(
            Namespace::new("m", None, None, None),
            text.as_bytes(),
            256,
            &mut k,
        );
        k
    }

    fn req(keys: &[BlockKey]) -> RouteRequest<'_> {
        RouteRequest::plain("m", keys, keys.len() as u64 * 64)
    }

    fn router() -> Router {
        Router::new(RouterConfig::default(), Tenants::default())
    }

    fn holds(view: &mut View, i: usize, keys: &[BlockKey]) {
        let mut s = ReplicaSummary::new(1, 10_000, &SummaryConfig::for_cluster("c")).unwrap();
        s.insert(keys);
        view.set_summary(i, s);
    }

    /// 2 prefill + 2 decode replicas in `eu`.
    fn two_p_two_d() -> View {
        let mut v = View::new("eu", 64);
        v.upsert(with_role("p0", "eu", "", Role::Prefill));
        v.upsert(with_role("p1", "eu", "", Role::Prefill));
        v.upsert(with_role("d0", "eu", "", Role::Decode));
        v.upsert(with_role("d1", "eu", "", Role::Decode));
        v
    }

    fn pair(c: PdChoice) -> PdPair {
        match c {
            PdChoice::Pair(p) => p,
            other => panic!("expected a pair, got {other:?}"),
        }
    }

    #[test]
    fn the_prefill_holding_the_prompt_computes_it_and_the_idlest_decode_generates() {
        let text = "a long shared system prompt ".repeat(200);
        let k = keys(&text);
        let mut v = two_p_two_d();
        holds(&mut v, 1, &k);
        v.set_engine_load(2, 0, 30, 0.7, 0);
        v.set_engine_load(3, 0, 2, 0.1, 0);
        let cfg = PdConfig {
            bypass_uncached_tokens: 0,
            ..PdConfig::default()
        };
        let p = pair(choose(&mut router(), &v, &req(&k), NOW, &cfg));
        assert_eq!(p.prefill.replica, 1, "the prefix hit decides the prefill");
        assert_eq!(p.prefill.hit_blocks as usize, k.len());
        assert_eq!(p.decode, 3, "the least loaded decode");
        assert!(p.decode_load < 0.2);
    }

    #[test]
    fn a_decode_holding_nearly_all_of_the_prompt_takes_it_whole() {
        let text = "turn one of a conversation ".repeat(100);
        let k = keys(&text);
        let mut v = two_p_two_d();
        // The decode replica got the prompt with the last turn's transfer; one block is new.
        holds(&mut v, 2, &k[..k.len() - 1]);
        let c = choose(&mut router(), &v, &req(&k), NOW, &PdConfig::default());
        match c {
            PdChoice::Whole {
                decision: Decision::Route(r),
                reason: WholeReason::Bypass,
            } => assert_eq!(r.replica, 2),
            other => panic!("expected a bypass, got {other:?}"),
        }
        // Leaving more uncached than the bar: a pair.
        let cfg = PdConfig {
            bypass_uncached_tokens: 64,
            ..PdConfig::default()
        };
        pair(choose(&mut router(), &v, &req(&k), NOW, &cfg));
        // SGLang: a decode server cannot run a request whole, so no bypass to it.
        let cfg = PdConfig {
            whole_on_decode: false,
            ..PdConfig::default()
        };
        pair(choose(&mut router(), &v, &req(&k), NOW, &cfg));
    }

    #[test]
    fn without_prefill_replicas_requests_run_whole_and_never_on_a_prefill_only_one() {
        let k = keys(&"x".repeat(4096));
        let mut v = View::new("eu", 64);
        v.upsert(with_role("b0", "eu", "", Role::Both));
        v.upsert(with_role("p0", "eu", "", Role::Prefill));
        v.set_health(1, Health::Unhealthy);
        let c = choose(&mut router(), &v, &req(&k), NOW, &PdConfig::default());
        assert!(matches!(
            c,
            PdChoice::Whole {
                decision: Decision::Route(Routed { replica: 0, .. }),
                reason: WholeReason::NoPrefill
            }
        ));
        // The plain router never sends a whole request to a prefill-only replica.
        let mut v = View::new("eu", 64);
        v.upsert(with_role("p0", "eu", "", Role::Prefill));
        assert!(matches!(
            router().route(&v, &req(&k), NOW),
            Decision::Reject(_)
        ));
    }

    #[test]
    fn a_pair_stays_in_the_prefills_zone_and_a_both_replica_alone_runs_whole() {
        let k = keys(&"y".repeat(4096));
        let mut v = View::new("eu", 64);
        v.upsert(with_role("p-a", "eu", "a", Role::Prefill));
        v.upsert(with_role("d-b", "eu", "b", Role::Decode));
        let cfg = PdConfig {
            bypass_uncached_tokens: 0,
            ..PdConfig::default()
        };
        // The only decode is in another zone: the request runs whole on it (it can).
        let c = choose(&mut router(), &v, &req(&k), NOW, &cfg);
        assert!(
            matches!(
                c,
                PdChoice::Whole {
                    reason: WholeReason::NoDecode,
                    ..
                }
            ),
            "{c:?}"
        );
        v.upsert(with_role("d-a", "eu", "a", Role::Decode));
        assert_eq!(
            pair(choose(&mut router(), &v, &req(&k), NOW, &cfg)).decode,
            2
        );

        // A `both` replica that is the best prefill and the best decode runs it alone.
        let mut v = View::new("eu", 64);
        v.upsert(with_role("p0", "eu", "", Role::Prefill));
        v.upsert(with_role("b0", "eu", "", Role::Both));
        holds(&mut v, 1, &k);
        let c = choose(&mut router(), &v, &req(&k), NOW, &cfg);
        assert!(
            matches!(
                c,
                PdChoice::Whole {
                    decision: Decision::Route(Routed { replica: 1, .. }),
                    reason: WholeReason::SameReplica
                }
            ),
            "{c:?}"
        );
    }

    #[test]
    fn failover_moves_the_prefill_and_a_region_without_prefill_room_forwards_whole() {
        let k = keys(&"z".repeat(4096));
        let mut v = two_p_two_d();
        v.upsert(with_role("us-b", "us", "", Role::Both));
        v.regions.configure("eu", "us", 10.0);
        let cfg = PdConfig {
            bypass_uncached_tokens: 0,
            ..PdConfig::default()
        };
        let first = pair(choose(&mut router(), &v, &req(&k), NOW, &cfg));
        let exclude = [first.prefill.replica];
        let again = pair(choose(
            &mut router(),
            &v,
            &RouteRequest {
                exclude: &exclude,
                ..req(&k)
            },
            NOW,
            &cfg,
        ));
        assert_ne!(again.prefill.replica, first.prefill.replica);
        // Both decodes gone: the pair cannot form here, the whole request crosses regions.
        v.set_health(2, Health::Unhealthy);
        v.set_health(3, Health::Unhealthy);
        let c = choose(&mut router(), &v, &req(&k), NOW, &cfg);
        assert!(
            matches!(&c, PdChoice::Whole { decision: Decision::Forward { region, .. }, .. } if region == "us"),
            "{c:?}"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        #[test]
        fn a_pair_never_spans_regions_or_zones(
            replicas in prop::collection::vec(
                (0..3usize, 0..3usize, 0..3usize, any::<bool>(), 0u32..300, 0.0f32..1.0),
                1..24,
            ),
            local in 0..3usize,
            held in prop::collection::vec(any::<bool>(), 24),
            bypass in prop::sample::select(vec![0u64, 64, 256, 100_000]),
            seed in any::<u64>(),
        ) {
            let regions = ["eu", "us", "ap"];
            let zones = ["", "a", "b"];
            let roles = [Role::Prefill, Role::Decode, Role::Both];
            let k = keys(&"w".repeat(2048));
            let mut v = View::new(regions[local], 64);
            for (n, (reg, zone, role, healthy, running, kv)) in replicas.iter().enumerate() {
                let i = v.upsert(with_role(&format!("r{n}"), regions[*reg], zones[*zone], roles[*role]));
                v.set_engine_load(i, 0, *running, *kv, 0);
                if !healthy {
                    v.set_health(i, Health::Unhealthy);
                }
                if held[n] {
                    holds(&mut v, i, &k[..k.len() / 2]);
                }
            }
            v.regions.configure("eu", "us", 10.0);
            v.regions.configure("eu", "ap", 20.0);
            v.regions.configure("us", "ap", 15.0);
            let mut r = Router::new(RouterConfig { seed, ..RouterConfig::default() }, Tenants::default());
            let cfg = PdConfig { bypass_uncached_tokens: bypass, whole_on_decode: seed % 2 == 0 };
            match choose(&mut r, &v, &req(&k), NOW, &cfg) {
                PdChoice::Pair(p) => {
                    let (pi, di) = (&v.replicas()[p.prefill.replica].info, &v.replicas()[p.decode].info);
                    prop_assert_eq!(&pi.region, &di.region);
                    prop_assert_eq!(&pi.region, &v.local_region);
                    prop_assert!(pi.zone.is_empty() || pi.zone == di.zone);
                    prop_assert!(pi.pd.role != Role::Decode && di.pd.role != Role::Prefill);
                    prop_assert_ne!(p.prefill.replica, p.decode);
                    prop_assert_eq!(v.replicas()[p.decode].health, Health::Healthy);
                }
                PdChoice::Whole { decision: Decision::Route(w), .. } => {
                    let wi = &v.replicas()[w.replica].info;
                    prop_assert!(wi.pd.role != Role::Prefill, "a whole request on a prefill-only replica");
                    prop_assert_eq!(&wi.region, &v.local_region);
                }
                PdChoice::Whole { .. } => {}
            }
        }
    }
}
