//! Other regions at a node in the regional layout: its own region's offer (built when the node
//! is a representative) and every other region's record folded into the view and the
//! forwarding targets.
//!
//! Kept apart from `mesh_roles.rs`, which folds the node's own region's replica records: the
//! two sources never mix (another region's replicas are not in this view; see
//! `core::region_offer`).

use std::collections::BTreeMap;
use std::time::Duration;

use std::sync::Arc;

use super::learned::LearnPolicy;
use super::mesh_state::Peer;
use super::state::{Endpoint, Node};
use crate::core::empty_holders::{
    EmptyHolders, Noted, BARRED_FOR, EMPTY_PULLS_TO_BAR, EMPTY_WINDOW,
};
use crate::core::region_choice::{build_offer, foreign_holder};
use crate::core::region_offer::{
    RecentHeads, RegionOffer, MAX_RECENT_HEADS, MAX_REGION_HEADS, MAX_REMOTE_REGIONS,
};
use crate::mesh::region_record::RegionRecord;

/// How long forwarding skips a region whose every named node failed: longer than the region
/// layer takes to drop a dark region's record (4 s by default), short enough that a region
/// that was only briefly unreachable is tried again soon.
pub const REGION_UNREACHABLE_FOR: Duration = Duration::from_secs(5);

/// What folding other regions' records left out ([`Node::set_remote_regions`]).
#[derive(Debug, Default)]
pub struct OfferFold {
    /// Regions whose offer was refused whole: it named a replica this node knows in another
    /// region.
    pub refused: Vec<String>,
    /// Holders dropped from kept offers: their URL's host is not one a pull may be sent to.
    pub untrusted_holders: usize,
    /// Holders dropped from kept offers: their pulls came back empty, and they are left out
    /// for a while (`core::empty_holders`).
    pub empty_holders: usize,
}

impl Node {
    /// Forwarding skips `region` for [`REGION_UNREACHABLE_FOR`]: every node its record named
    /// failed before answering (`proxy::region_forward`).
    pub fn mark_region_unreachable(&self, region: &str) {
        let now = self.now();
        let fresh = {
            let mut core = self.lock();
            let fresh = !core.view.is_unreachable(region, now);
            core.view
                .mark_unreachable(region, now, now + REGION_UNREACHABLE_FOR);
            fresh
        };
        // Concurrent forwards that failed together warn once.
        if fresh {
            tracing::warn!(%region, for_s = REGION_UNREACHABLE_FOR.as_secs(), "every node of the region failed: forwarding skips it");
        }
    }

    /// This region's offer to the others, from this node's view: its replicas' room and
    /// queues, and the prefixes it routed most that some replica of the region still holds.
    pub(super) fn region_offer(&self) -> RegionOffer {
        let core = self.lock();
        let heads = core
            .heads
            .as_ref()
            .map(|h| h.top(MAX_REGION_HEADS * 2))
            .unwrap_or_default();
        let region = core.view.local_region.clone();
        build_offer(&core.view, &core.router.config().cost, &region, heads)
    }

    /// The replica another region's offer names as holding the head `key` (a pull's source
    /// under regional gossip, `KvFetchPlan::offer_key`); `None` when no offer names it now.
    pub fn offered_endpoint(&self, key: u64) -> Option<Endpoint> {
        let core = self.lock();
        let h = core
            .view
            .remote_regions
            .values()
            .flat_map(|o| &o.holders)
            .find(|h| h.head.key == key)?;
        Some(Endpoint {
            id: Arc::from(h.id.as_str()),
            base: Arc::from(h.url.trim_end_matches('/')),
        })
    }

    /// Folds other regions' newest records into the view (at most `MAX_REMOTE_REGIONS`) and
    /// the forwarding targets; `representative` is shown in `/admin/state`. Says which offers
    /// were refused whole (they named a holder this node knows in another region: a region
    /// speaks only for its own replicas) and how many holders were dropped for living where this
    /// node may not send a pull ([`Node::offered_holder_allowed`]).
    pub(super) fn set_remote_regions(
        &self,
        records: &BTreeMap<String, RegionRecord>,
        representative: bool,
    ) -> OfferFold {
        let mut fold = OfferFold::default();
        // Vetted before the lock: the host check reads this node's own replicas under it.
        let policy = LearnPolicy::of(self);
        let mut offers: Vec<(&String, RegionOffer)> = records
            .iter()
            .take(MAX_REMOTE_REGIONS)
            .map(|(name, r)| {
                let mut offer = r.offer();
                let before = offer.holders.len();
                offer
                    .holders
                    .retain(|h| self.offered_holder_allowed(&policy, &h.url));
                fold.untrusted_holders += before - offer.holders.len();
                (name, offer)
            })
            .collect();
        let targets: Vec<Peer> = records
            .values()
            .take(MAX_REMOTE_REGIONS)
            .flat_map(|r| {
                r.targets.iter().map(|t| Peer {
                    node_id: t.node_id.clone(),
                    region: r.region.clone(),
                    http_url: t.http_url.trim_end_matches('/').to_owned(),
                    quic_addr: t.quic_addr,
                })
            })
            .collect();
        {
            let mut core = self.lock();
            // Only a representative offers heads: start counting when this node becomes one
            // (its offer then builds up from what it routes next), stop when it no longer is.
            if representative != core.heads.is_some() {
                core.heads = representative.then(|| RecentHeads::new(MAX_RECENT_HEADS));
            }
            let local = core.view.local_region.clone();
            fold.empty_holders = drop_barred(&core.empty_holders, &mut offers, self.now());
            core.view.remote_regions.clear();
            for (name, offer) in offers {
                if *name == local {
                    continue;
                }
                if foreign_holder(&core.view, &offer).is_some() {
                    fold.refused.push(name.clone());
                    continue;
                }
                core.view.remote_regions.insert(name.clone(), offer);
            }
        }
        let mut st = self.status();
        st.region_targets = targets;
        st.representative = representative;
        fold
    }

    /// A hinted request's answer says its pull from the offered holder at `url` came back
    /// empty (`core::empty_holders::is_empty_pull`, judged by the receipt). The third within a
    /// minute leaves the holder out of the offers for five minutes — from the view at once, so
    /// no pull is priced from it, and from every fold until then (counted there,
    /// `records_ignored{reason="empty_holder"}`) — warned once per bar.
    pub fn note_empty_pull(&self, url: &str) {
        let now = self.now();
        let noted = {
            let mut core = self.lock();
            let noted = core.empty_holders.note_empty(url, now);
            if matches!(noted, Noted::Barred(_)) {
                let url = url.trim_end_matches('/');
                for offer in core.view.remote_regions.values_mut() {
                    offer.holders.retain(|h| h.url.trim_end_matches('/') != url);
                }
            }
            noted
        };
        if let Noted::Barred(_) = noted {
            tracing::warn!(holder = %url, pulls = EMPTY_PULLS_TO_BAR, within_s = EMPTY_WINDOW.as_secs(), for_s = BARRED_FOR.as_secs(), "an offered KV holder's pulls came back empty: left out of other regions' offers");
        } else {
            tracing::debug!(holder = %url, ?noted, "an offered KV holder's pull came back empty");
        }
    }

    /// Whether a pull hint may name `url`, a holder another region's offer names: its host
    /// must be one this node would learn a replica at from gossip (`mesh.learn_replicas_from`,
    /// loopback on a loopback mesh, a host of its own replicas). Under regional gossip the
    /// reader cannot check the URL against a replica record, and a local replica is told to
    /// connect there: without this a certified member of any region could point this node's
    /// replicas at any host (issue #37's trust gap).
    pub(super) fn offered_holder_allowed(&self, policy: &LearnPolicy, url: &str) -> bool {
        reqwest::Url::parse(url)
            .ok()
            .filter(|u| matches!(u.scheme(), "http" | "https"))
            .and_then(|u| u.host_str().map(|h| self.host_allowed(policy, h)))
            .unwrap_or(false)
    }
}

/// Drops from `offers` the holders `bars` leaves out at `now`; how many.
fn drop_barred(bars: &EmptyHolders, offers: &mut [(&String, RegionOffer)], now: Duration) -> usize {
    if bars.is_empty() {
        return 0;
    }
    let mut dropped = 0;
    for (_, offer) in offers.iter_mut() {
        let before = offer.holders.len();
        offer.holders.retain(|h| !bars.is_barred(&h.url, now));
        dropped += before - offer.holders.len();
    }
    dropped
}
