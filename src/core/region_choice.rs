//! Which other region a request goes to when its own cannot serve it, and what this region
//! offers the others (the representative's side of `region_offer.rs`).
//!
//! A forwarded request pays a round trip to the other region and then whatever it would pay
//! there: the queue of the replica it lands on and the prefill of the part of its prompt that
//! region does not hold. So the region is the one with the least of `RTT + queue + prefill`, not
//! simply the nearest: a far region holding a 30k-token document is worth its 80 ms when the
//! prefill it saves is a second; with no prefix held anywhere the terms other than RTT and queue
//! are equal and the nearest region with room wins. Ties go to the nearer region, then the name,
//! so every node of a region decides alike.
//!
//! Two sources, merged per region: other regions' replicas this node has in its view (a flat
//! mesh, or replicas configured here with another region), with hits from their summaries, and
//! other regions' offers (regional gossip), with hits from their heads.

use std::time::Duration;

use super::cost::CostModel;
use super::keys::BlockKey;
use super::kv_fetch::PullSource;
use super::region_offer::{
    OfferedHolder, OfferedModel, RegionHead, RegionOffer, MAX_HOLDER_STEP_MS, MAX_OFFER_HOLDERS,
};
use super::role::Leg;
use super::view::{Health, ReplicaState, View};

/// How the region a forwarded request goes to is chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ForwardChoice {
    /// The least `RTT + queue + prefill of what the region does not hold` (module doc).
    #[default]
    Cost,
    /// The nearest region with room, whatever it holds or queues (the choice before region
    /// offers; kept to measure against).
    Nearest,
}

impl std::str::FromStr for ForwardChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cost" => Ok(ForwardChoice::Cost),
            "nearest" => Ok(ForwardChoice::Nearest),
            other => Err(format!("unknown forward choice '{other}' (cost, nearest)")),
        }
    }
}

/// One forwarding question.
#[derive(Clone, Copy, Debug)]
pub struct RegionAsk<'a> {
    /// Requested model.
    pub model: &'a str,
    /// The tenant's pools (any when empty).
    pub pools: &'a [String],
    /// Block keys of the prompt.
    pub keys: &'a [BlockKey],
    /// Prompt length in tokens.
    pub prompt_tokens: u64,
    /// Only replicas (or offers) queueing less than this many seconds count.
    pub bar_s: f64,
    /// The leg asked for; requests cross regions whole, so a prefill leg asks for a whole one.
    pub leg: Leg,
    /// By cost (default) or the nearest with room.
    pub choice: ForwardChoice,
}

/// The other region where the request would start soonest (module doc), or `None` when no
/// other region has a healthy replica of the model with room under the bar.
pub fn choose_region(
    view: &View,
    cost: &CostModel,
    ask: &RegionAsk<'_>,
    now: Duration,
) -> Option<String> {
    let leg = if ask.leg == Leg::Prefill {
        Leg::Whole
    } else {
        ask.leg
    };
    let local = view.local_region.as_str();
    let tpb = f64::from(view.tokens_per_block);
    let rtt_s = |region: &str| view.regions.distance(local, region) / 1000.0;
    // (cost, distance, region): the best per region, then the best overall.
    let mut best: Option<(f64, f64, &str)> = None;
    for (i, r) in view.replicas().iter().enumerate() {
        if !usable_remote(r, local, ask, leg) {
            continue;
        }
        let queue = cost.queue_s(r);
        if queue >= ask.bar_s {
            continue;
        }
        let start = match ask.choice {
            ForwardChoice::Nearest => 0.0,
            ForwardChoice::Cost => {
                let held = view.hit(i, ask.keys, now) as f64 * tpb;
                queue + cost.prefill_s(r, ask.prompt_tokens, held)
            }
        };
        let region = r.info.region.as_str();
        if view.is_unreachable(region, now) {
            continue;
        }
        consider(&mut best, region, rtt_s(region), start);
    }
    for (region, offer) in &view.remote_regions {
        if region == local || view.is_unreachable(region, now) {
            continue;
        }
        let Some((queue, rate)) = offer.open_for(ask.model, ask.pools, ask.bar_s) else {
            continue;
        };
        let start = match ask.choice {
            ForwardChoice::Nearest => 0.0,
            ForwardChoice::Cost => {
                let held = offer.held_blocks(ask.keys) as f64 * tpb;
                queue + (ask.prompt_tokens as f64 - held).max(0.0) / rate
            }
        };
        consider(&mut best, region.as_str(), rtt_s(region), start);
    }
    best.map(|(_, _, r)| r.to_owned())
}

/// Keeps the better of `best` and `region` (least `rtt + start`, then nearest, then name).
fn consider<'v>(best: &mut Option<(f64, f64, &'v str)>, region: &'v str, rtt_s: f64, start_s: f64) {
    let total = rtt_s + start_s;
    let better = match best {
        None => true,
        Some((c, d, name)) => (total, rtt_s, region) < (*c, *d, *name),
    };
    if better {
        *best = Some((total, rtt_s, region));
    }
}

/// A replica of another region that could take the forwarded request.
fn usable_remote(r: &ReplicaState, local: &str, ask: &RegionAsk<'_>, leg: Leg) -> bool {
    r.info.region != local
        && r.info.pd.role.serves(leg)
        && r.health == Health::Healthy
        && r.info.models.iter().any(|m| m == ask.model)
        && (ask.pools.is_empty() || ask.pools.contains(&r.info.pool))
        && r.load.outstanding() < r.info.max_in_flight
}

/// What `region` offers others, from this view's replicas of it: per (model, pool, whole) the
/// healthy and open counts and the least queue, those of `heads` some healthy replica of the
/// region still holds by its summary, and for the deepest of them who holds it (for pulls).
/// Trimmed to the offer's caps.
pub fn build_offer(
    view: &View,
    cost: &CostModel,
    region: &str,
    heads: impl IntoIterator<Item = RegionHead>,
) -> RegionOffer {
    let mut offer = RegionOffer {
        region: region.to_owned(),
        models: Vec::new(),
        heads: Vec::new(),
        holders: Vec::new(),
    };
    let mine = || {
        view.replicas()
            .iter()
            .filter(move |r| r.info.region == region && r.health == Health::Healthy)
    };
    for r in mine() {
        let whole = r.info.pd.role.serves(Leg::Whole);
        let open = r.load.outstanding() < r.info.max_in_flight;
        let queue_ms = (cost.queue_s(r) * 1000.0).clamp(0.0, f64::from(u32::MAX)) as u32;
        let rate = r.info.prefill_tokens_per_s.clamp(1.0, f64::from(u32::MAX)) as u32;
        for model in &r.info.models {
            let entry = offer
                .models
                .iter_mut()
                .find(|m| &m.model == model && m.pool == r.info.pool && m.whole == whole);
            let entry = match entry {
                Some(e) => e,
                None => {
                    offer.models.push(OfferedModel {
                        model: model.clone(),
                        pool: r.info.pool.clone(),
                        whole,
                        healthy: 0,
                        open: 0,
                        least_queue_ms: u32::MAX,
                        prefill_tokens_per_s: rate,
                    });
                    let last = offer.models.len() - 1;
                    &mut offer.models[last]
                }
            };
            entry.healthy += 1;
            if open {
                entry.open += 1;
                if queue_ms < entry.least_queue_ms {
                    entry.least_queue_ms = queue_ms;
                    entry.prefill_tokens_per_s = rate;
                }
            }
        }
    }
    for m in &mut offer.models {
        if m.open == 0 {
            m.least_queue_ms = 0;
        }
    }
    for head in heads {
        let held = mine().any(|r| {
            r.summary
                .as_ref()
                .is_some_and(|s| s.contains(BlockKey(head.key)))
        });
        if held {
            offer.heads.push(head);
        }
    }
    offer.trim();
    offer.holders = holders(view, cost, region, &offer.heads);
    offer
}

/// For the deepest of `heads` (already trimmed, deepest first), the healthy replica of `region`
/// holding it settled (its summary has the head's key): the least queued, then the lowest
/// index. At most [`MAX_OFFER_HOLDERS`].
fn holders(
    view: &View,
    cost: &CostModel,
    region: &str,
    heads: &[RegionHead],
) -> Vec<OfferedHolder> {
    let mut out = Vec::new();
    for head in heads {
        if out.len() == MAX_OFFER_HOLDERS {
            break;
        }
        let best = view
            .replicas()
            .iter()
            .filter(|r| r.info.region == region && r.health == Health::Healthy)
            .filter(|r| {
                r.summary
                    .as_ref()
                    .is_some_and(|s| s.contains(BlockKey(head.key)))
            })
            .min_by(|a, b| cost.queue_s(a).total_cmp(&cost.queue_s(b)));
        if let Some(r) = best {
            let step_ms = (PullSource::of(r).step_s * 1000.0).round();
            out.push(OfferedHolder {
                head: *head,
                id: r.info.id.clone(),
                url: r.info.url.trim_end_matches('/').to_owned(),
                step_ms: step_ms.clamp(0.0, f64::from(MAX_HOLDER_STEP_MS)) as u16,
            });
        }
    }
    out
}

/// A holder `offer` names that this view knows as a replica of another region than the offer's
/// (by id or URL): a region speaks only for its own replicas, so such an offer is refused whole.
pub fn foreign_holder<'o>(view: &View, offer: &'o RegionOffer) -> Option<&'o OfferedHolder> {
    offer.holders.iter().find(|h| {
        let by_id = view
            .index_of(&h.id)
            .and_then(|i| view.replica(i))
            .is_some_and(|r| r.info.region != offer.region);
        by_id
            || view.replicas().iter().any(|r| {
                r.info.region != offer.region
                    && r.info.url.trim_end_matches('/') == h.url.trim_end_matches('/')
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::keys::{text_block_keys, Namespace};
    use crate::core::summary::{ReplicaSummary, SummaryConfig};
    use crate::core::view::{testing::info, ReplicaLoad};

    const T: Duration = Duration::from_secs(0);

    fn ask<'a>(keys: &'a [BlockKey], prompt_tokens: u64) -> RegionAsk<'a> {
        RegionAsk {
            model: "m",
            pools: &[],
            keys,
            prompt_tokens,
            bar_s: f64::INFINITY,
            leg: Leg::Whole,
            choice: ForwardChoice::Cost,
        }
    }

    fn offer(region: &str, queue_ms: u32, heads: Vec<RegionHead>) -> RegionOffer {
        RegionOffer {
            region: region.into(),
            models: vec![OfferedModel {
                model: "m".into(),
                pool: String::new(),
                whole: true,
                healthy: 2,
                open: 2,
                least_queue_ms: queue_ms,
                prefill_tokens_per_s: 10_000,
            }],
            heads,
            holders: vec![],
        }
    }

    /// From eu: us at 90 ms, ap at 30 ms, both with room and no heads.
    fn eu_with_empty_us_and_nearer_ap() -> View {
        let mut v = View::new("eu", 64);
        v.regions.measured("eu", "us", 90.0);
        v.regions.measured("eu", "ap", 30.0);
        v.remote_regions.insert("us".into(), offer("us", 0, vec![]));
        v.remote_regions.insert("ap".into(), offer("ap", 0, vec![]));
        v
    }

    fn doc_keys() -> Vec<BlockKey> {
        let text = "a long shared document ".repeat(2_000);
        let mut keys = Vec::new();
        text_block_keys(
            Namespace::new("m", None, None, None),
            text.as_bytes(),
            256,
            &mut keys,
        );
        keys
    }

    #[test]
    fn with_no_prefix_anywhere_the_nearest_region_with_room_wins() {
        let v = eu_with_empty_us_and_nearer_ap();
        let keys = doc_keys();
        let c = CostModel::default();
        let got = choose_region(&v, &c, &ask(&keys, 4_000), T);
        assert_eq!(got.as_deref(), Some("ap"));
    }

    #[test]
    fn a_region_whose_targets_all_failed_is_skipped_until_its_mark_expires() {
        let mut v = eu_with_empty_us_and_nearer_ap();
        let keys = doc_keys();
        let c = CostModel::default();
        v.mark_unreachable("ap", T, T + Duration::from_secs(5));
        assert_eq!(
            choose_region(&v, &c, &ask(&keys, 4_000), T).as_deref(),
            Some("us")
        );
        let later = T + Duration::from_secs(5);
        assert_eq!(
            choose_region(&v, &c, &ask(&keys, 4_000), later).as_deref(),
            Some("ap")
        );
        // Bounded whatever fails: made-up regions evict the soonest to expire.
        for i in 0..(2 * crate::core::region_offer::MAX_REMOTE_REGIONS as u64) {
            let r = format!("r{i}");
            v.mark_unreachable(&r, T, T + Duration::from_secs(10 + i));
        }
        assert!(v.unreachable_regions.len() <= crate::core::region_offer::MAX_REMOTE_REGIONS);
    }

    #[test]
    fn the_region_holding_the_prefix_wins_when_the_prefill_saved_beats_the_round_trip() {
        let mut v = View::new("eu", 64);
        v.regions.measured("eu", "us", 90.0);
        v.regions.measured("eu", "ap", 30.0);
        let keys = doc_keys();
        let tokens = keys.len() as u64 * 64;
        let head = RegionHead::of(&keys).unwrap();
        v.remote_regions
            .insert("us".into(), offer("us", 0, vec![head]));
        v.remote_regions.insert("ap".into(), offer("ap", 0, vec![]));
        let c = CostModel::default();
        // ~11k tokens at 10k tokens/s: the held prefix saves ~1 s, more than 60 ms farther.
        assert_eq!(
            choose_region(&v, &c, &ask(&keys, tokens), T).as_deref(),
            Some("us")
        );
        // A short prompt that only starts like the document: nothing to save, the nearest wins.
        assert_eq!(
            choose_region(&v, &c, &ask(&keys[..1], 64), T).as_deref(),
            Some("ap")
        );
        // Asked for the nearest, the holder's cache does not count.
        let mut nearest = ask(&keys, tokens);
        nearest.choice = ForwardChoice::Nearest;
        assert_eq!(choose_region(&v, &c, &nearest, T).as_deref(), Some("ap"));
        // When the holder queues longer than the prefill it saves, the nearest wins.
        v.remote_regions
            .insert("us".into(), offer("us", 5_000, vec![head]));
        assert_eq!(
            choose_region(&v, &c, &ask(&keys, tokens), T).as_deref(),
            Some("ap")
        );
    }

    #[test]
    fn offers_over_the_bar_full_or_for_other_models_are_not_chosen() {
        let mut v = View::new("eu", 64);
        let mut full = offer("us", 0, vec![]);
        full.models[0].open = 0;
        v.remote_regions.insert("us".into(), full);
        v.remote_regions
            .insert("ap".into(), offer("ap", 800, vec![]));
        let keys = doc_keys();
        let c = CostModel::default();
        let mut a = ask(&keys, 100);
        assert_eq!(choose_region(&v, &c, &a, T).as_deref(), Some("ap"));
        a.bar_s = 0.5;
        assert_eq!(choose_region(&v, &c, &a, T), None);
        a.bar_s = f64::INFINITY;
        a.model = "other";
        assert_eq!(choose_region(&v, &c, &a, T), None);
        // The node's own region is never an answer, even if an offer names it.
        let mut v = View::new("eu", 64);
        v.remote_regions.insert("eu".into(), offer("eu", 0, vec![]));
        assert_eq!(choose_region(&v, &c, &ask(&keys, 100), T), None);
    }

    #[test]
    fn replicas_of_other_regions_in_the_view_count_with_their_summaries() {
        let keys = doc_keys();
        let tokens = keys.len() as u64 * 64;
        let mut v = View::new("eu", 64);
        v.regions.measured("eu", "us", 90.0);
        v.regions.measured("eu", "ap", 30.0);
        let mut us = info("us-0", "us");
        us.models = vec!["m".into()];
        us.prefill_tokens_per_s = 10_000.0;
        let mut ap = info("ap-0", "ap");
        ap.models = vec!["m".into()];
        ap.prefill_tokens_per_s = 10_000.0;
        let iu = v.upsert(us);
        v.upsert(ap);
        let mut s = ReplicaSummary::new(1, 10_000, &SummaryConfig::for_cluster("t")).unwrap();
        s.insert(&keys);
        v.set_summary(iu, s);
        let c = CostModel::default();
        assert_eq!(
            choose_region(&v, &c, &ask(&keys, tokens), T).as_deref(),
            Some("us")
        );
        // The offer built from this view says the same to other regions.
        let offer = build_offer(&v, &c, "us", RegionHead::of(&keys));
        assert_eq!(offer.models.len(), 1);
        assert_eq!(offer.models[0].open, 1);
        assert_eq!(
            offer.held_blocks(&keys),
            RegionHead::of(&keys).unwrap().depth as usize
        );
        let ap_offer = build_offer(&v, &c, "ap", RegionHead::of(&keys));
        assert!(ap_offer.heads.is_empty(), "ap holds nothing");
        // Full replicas are healthy but not open.
        let i = v.index_of("ap-0").unwrap();
        v.replica_mut(i).unwrap().load = ReplicaLoad {
            in_flight: 10_000,
            ..Default::default()
        };
        let ap_offer = build_offer(&v, &c, "ap", None);
        assert_eq!(
            (ap_offer.models[0].healthy, ap_offer.models[0].open),
            (1, 0)
        );
    }

    /// `us` has two replicas holding the document (the second less queued) and one that does
    /// not: the offer names the less queued holder for the head, with its address.
    #[test]
    fn an_offer_names_the_least_queued_settled_holder_of_a_head() {
        let keys = doc_keys();
        let mut v = View::new("us", 64);
        let mut s = ReplicaSummary::new(1, 10_000, &SummaryConfig::for_cluster("t")).unwrap();
        s.insert(&keys);
        for (id, queued, holds) in [
            ("us-0", 50_000, true),
            ("us-1", 0, true),
            ("us-2", 0, false),
        ] {
            let mut r = info(id, "us");
            r.models = vec!["m".into()];
            let i = v.upsert(r);
            v.replica_mut(i).unwrap().load = ReplicaLoad {
                queued_prefill_tokens: queued,
                in_flight: u32::from(queued > 0),
                ..Default::default()
            };
            if holds {
                v.set_summary(i, s.clone());
            }
        }
        let c = CostModel::default();
        let offer = build_offer(&v, &c, "us", RegionHead::of(&keys));
        assert_eq!(offer.holders.len(), 1, "{:?}", offer.holders);
        let h = &offer.holders[0];
        assert_eq!(h.head, RegionHead::of(&keys).unwrap());
        assert_eq!(h.id, "us-1");
        let us1 = v.replica(v.index_of("us-1").unwrap()).unwrap();
        assert_eq!(h.url, us1.info.url.trim_end_matches('/'));
        let (_, blocks) = offer.pull_source(&keys).unwrap();
        assert_eq!(blocks, u32::from(h.head.depth));
        assert!(foreign_holder(&v, &offer).is_none(), "its own replica");
    }

    /// A reader knows `eu-0` as its own region's replica: `us`'s offer naming it (by id, or by
    /// URL under another id) is refused; naming a replica the reader does not know is not.
    #[test]
    fn an_offer_naming_another_regions_replica_is_refused() {
        let keys = doc_keys();
        let head = RegionHead::of(&keys).unwrap();
        let mut v = View::new("eu", 64);
        let eu0 = info("eu-0", "eu");
        let eu0_url = eu0.url.clone();
        v.upsert(eu0);
        let mut us = offer("us", 0, vec![head]);
        us.holders = vec![OfferedHolder {
            head,
            id: "us-7".into(),
            url: "http://10.9.9.9:8000".into(),
            step_ms: 0,
        }];
        assert!(foreign_holder(&v, &us).is_none());
        let mut by_id = us.clone();
        by_id.holders[0].id = "eu-0".into();
        assert_eq!(
            foreign_holder(&v, &by_id).map(|h| h.id.as_str()),
            Some("eu-0")
        );
        let mut by_url = us;
        by_url.holders[0].url = format!("{}/", eu0_url.trim_end_matches('/'));
        assert!(foreign_holder(&v, &by_url).is_some());
    }
}
