//! Tenants' KV shares in a mesh: one estimate per replica, the home's.
//!
//! A KV quota (`max_kv_share`, `core::tenants`) steers a tenant off the replicas where it holds
//! too much of the cache. Each node's own cache model sees only the requests *it* routed, so
//! nodes estimating alone disagree: each confines a big tenant to the replica it happened to
//! send it to, and three nodes flush three replicas instead of one (measured: the small
//! tenants' hit ratio fell *below* the no-quota run). So the replica's home, whose model every
//! node's block reports feed with their tenant's label (`BlockReport::kv_tenant`), publishes the
//! quota tenants' shares in the replica's gossip record, and the other nodes steer on those,
//! a gossip round late. A node trusts shares only from the replica's home (as every other field
//! of the record); a home that publishes none (an older node) leaves each node to its own
//! model, scaled by the fill the home's summary implies.
//!
//! A gossip round is long next to a big tenant's rate: in the simulator, shares a second late
//! (a live mesh at the bench's time scale) cost a third of the quota's gain, because each node
//! keeps sending the tenant to a replica it still believes under its share. So a node adds to
//! the home's figures the new blocks its own requests brought since they last changed
//! ([`count_routed`]): its own overshoot shows at once, and only the other nodes' lags.

use super::state::{Core, ReplicaRuntime};
use crate::core::tenants::{Tenants, KV_SLOTS};
use crate::mesh::schema::{ReplicaRecord, KV_SHARE_SCALE};

/// `record` with this node's estimate of the quota tenants' shares of the replica, when some
/// tenant has a KV quota (the home's record; a stand-in record publishes its own too).
pub(super) fn with_own_kv_shares(
    record: ReplicaRecord,
    rt: &ReplicaRuntime,
    tenants: &Tenants,
) -> ReplicaRecord {
    if !tenants.any_kv_quota() {
        return record;
    }
    let shares = tenants
        .kv_quota_tenants()
        .map(|(t, slot)| (t.to_owned(), rt.cache.tenant_share(slot)));
    record.with_kv_shares(shares)
}

/// Keeps the KV shares the replica's home publishes in `rec` (`ReplicaRecord::kv_shares`), by
/// this node's KV slots: tenants without a quota here are ignored, those the home leaves out
/// hold nothing. `None` when the home publishes none. When they changed, the blocks this node
/// counted since the previous ones are taken as included.
pub(super) fn set_remote_kv_shares(
    rt: &mut ReplicaRuntime,
    rec: &ReplicaRecord,
    tenants: &Tenants,
) {
    let Some(published) = rec.kv_shares.as_ref().filter(|_| tenants.any_kv_quota()) else {
        rt.mesh.remote_kv_shares = None;
        rt.mesh.kv_routed_since = Vec::new();
        return;
    };
    let mut fresh = [0.0f32; KV_SLOTS];
    for (tenant, v) in published {
        if let Some((slot, _)) = tenants.kv_quota(Some(tenant)) {
            if let Some(s) = fresh.get_mut(usize::from(slot)) {
                *s = f32::from(*v) / f32::from(KV_SHARE_SCALE);
            }
        }
    }
    if rt.mesh.remote_kv_shares.as_deref() == Some(&fresh[..]) {
        return;
    }
    rt.mesh.remote_kv_shares = Some(fresh.to_vec());
    rt.mesh.kv_routed_since = vec![0; KV_SLOTS];
}

/// This node just sent replica `i` a request of KV slot `slot` bringing `new_blocks` blocks
/// it does not hold: counted on top of the home's published shares until they next change.
pub(super) fn count_routed(core: &mut Core, i: usize, slot: u8, new_blocks: usize) {
    let Some(rt) = core.replicas.get_mut(i) else {
        return;
    };
    if rt.mesh.home || rt.mesh.remote_kv_shares.is_none() {
        return;
    }
    if let Some(c) = rt.mesh.kv_routed_since.get_mut(usize::from(slot)) {
        *c = c.saturating_add(u32::try_from(new_blocks).unwrap_or(u32::MAX));
    }
    refresh_kv_shares(core, i);
}

/// Copies replica `i`'s tenant KV shares into the view, when some tenant has a KV quota (else
/// nobody reads them): the shares its home publishes when another node is home and publishes
/// them, else this node's own cache model's.
pub(super) fn refresh_kv_shares(core: &mut Core, i: usize) {
    if !core.router.tenants.any_kv_quota() {
        return;
    }
    let Some(rt) = core.replicas.get(i) else {
        return;
    };
    if let Some(published) = rt
        .mesh
        .remote_kv_shares
        .as_deref()
        .filter(|_| !rt.mesh.home)
    {
        let capacity = rt.cache.capacity_blocks().max(1) as f32;
        let mut shares = [0.0f32; KV_SLOTS];
        for (slot, s) in shares.iter_mut().enumerate() {
            let own = rt.mesh.kv_routed_since.get(slot).copied().unwrap_or(0);
            let p = published.get(slot).copied().unwrap_or(0.0);
            *s = (p + own as f32 / capacity).min(1.0);
        }
        core.view.set_kv_shares(i, &shares);
        return;
    }
    // Without the home's shares (an older home), a follower's model holds only its own
    // requests' blocks, so its own fill would be a fraction of the replica's; the summary it
    // pulled from the home says how many keys the replica's current epoch took (live plus
    // evicted-since, an overestimate by at most the rebuild threshold). With it every node
    // scales its own mix by about the replica's fill.
    let min_fill = core
        .view
        .replica(i)
        .and_then(|r| r.summary.as_deref())
        .map_or(0.0, |s| {
            s.inserted() as f64 / rt.cache.capacity_blocks().max(1) as f64
        });
    let mut shares = [0.0f32; KV_SLOTS];
    rt.cache.tenant_shares(min_fill, &mut shares);
    core.view.set_kv_shares(i, &shares);
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap};
    use std::time::Duration;

    use super::*;
    use crate::core::keys::BlockKey;
    use crate::core::tenants::TenantConfig;
    use crate::core::view::Health;
    use crate::mesh::schema::SummaryVersion;
    use crate::node::config::NodeConfig;
    use crate::node::state::Node;
    use crate::replicas::entry::ReplicaConfig;

    /// A node with two replicas of 100 blocks' capacity and a tenant `big` capped at 0.5.
    fn node() -> std::sync::Arc<Node> {
        crate::proxy::install_crypto_provider();
        let cfg = NodeConfig {
            replicas: (0..2)
                .map(|i| ReplicaConfig {
                    capacity_tokens: Some(100 * 16),
                    ..ReplicaConfig::numbered(i)
                })
                .collect(),
            tenants: HashMap::from([(
                "big".to_owned(),
                TenantConfig {
                    max_kv_share: Some(0.5),
                    ..Default::default()
                },
            )]),
            ..NodeConfig::default()
        };
        Node::new(cfg).unwrap()
    }

    fn keys(r: std::ops::Range<u64>) -> Vec<BlockKey> {
        r.map(BlockKey).collect()
    }

    #[test]
    fn the_home_counts_every_nodes_reported_blocks_by_tenant_and_publishes_the_shares() {
        let node = node();
        let mut guard = node.lock();
        let core = &mut *guard;
        let tpb = core.view.tokens_per_block as u64;
        let big = core.router.tenants.kv_slot_of_label(Some("big"));
        let other = core.router.tenants.kv_slot_of_label(Some(""));
        let cap = core.replicas[0].cache.capacity_blocks() as u64;
        assert_eq!(cap, 100 * 16 / tpb);
        // Another node's big-tenant request filled 60% of the cache, a small tenant's 20%.
        let big_blocks = cap * 6 / 10;
        let rt = &mut core.replicas[0];
        assert!(rt.learn_reported(&keys(0..big_blocks), big, Duration::ZERO));
        assert!(rt.learn_reported(&keys(1000..1000 + cap / 5), other, Duration::ZERO));
        let info = core.view.replica(0).unwrap().info.clone();
        let rec = ReplicaRecord::new(
            &info,
            Health::Healthy,
            &Default::default(),
            SummaryVersion::default(),
        );
        let published = with_own_kv_shares(rec.clone(), &core.replicas[0], &core.router.tenants);
        let m = published.kv_shares.clone().unwrap();
        let share = f64::from(m["big"]) / f64::from(KV_SHARE_SCALE);
        let want = big_blocks as f64 / cap as f64;
        assert!((share - want).abs() < 0.002, "{share} vs {want}");
        assert_eq!(m.len(), 1, "only quota tenants are named: {m:?}");
        // Unlabelled reports (a handover) belong to nobody: they fill the cache, and the share
        // is the known mix (big's of the attributed blocks) scaled by the fill.
        let (other_blocks, unlabelled) = (cap / 5, cap - big_blocks - cap / 5);
        let rt = &mut core.replicas[0];
        rt.learn_reported(&keys(5000..5000 + unlabelled), 0, Duration::ZERO);
        let again = with_own_kv_shares(rec.clone(), &core.replicas[0], &core.router.tenants);
        let want = big_blocks as f64 / (big_blocks + other_blocks) as f64;
        let got = f64::from(again.kv_shares.unwrap()["big"]) / f64::from(KV_SHARE_SCALE);
        assert!((got - want).abs() < 0.002, "{got} vs {want}");
        // No quota anywhere: nothing published.
        let plain = Tenants::default();
        assert_eq!(
            with_own_kv_shares(rec, &core.replicas[0], &plain).kv_shares,
            None
        );
    }

    #[test]
    fn a_follower_steers_on_the_homes_shares_not_its_own_routing() {
        let node = node();
        let mut guard = node.lock();
        let core = &mut *guard;
        let big = core.router.tenants.kv_slot(Some("big"));
        // This node routed only big-tenant requests to r1: alone, it would call big dominant
        // there.
        let cap = core.replicas[1].cache.capacity_blocks() as u64;
        core.replicas[1]
            .cache
            .record_routed_by(&keys(0..cap), big, Duration::ZERO);
        refresh_kv_shares(core, 1);
        assert!((core.view.replica(1).unwrap().kv_share(big) - 1.0).abs() < 1e-6);
        // Another node is home and says big holds 10% there (every node's traffic counted).
        core.replicas[1].mesh.home = false;
        let info = core.view.replica(1).unwrap().info.clone();
        let mut rec = ReplicaRecord::new(
            &info,
            Health::Healthy,
            &Default::default(),
            SummaryVersion::default(),
        );
        rec.kv_shares = Some(BTreeMap::from([
            ("big".to_owned(), 100),
            ("not-ours".to_owned(), 900),
        ]));
        set_remote_kv_shares(&mut core.replicas[1], &rec, &core.router.tenants);
        refresh_kv_shares(core, 1);
        let r = core.view.replica(1).unwrap();
        assert!((r.kv_share(big) - 0.1).abs() < 1e-6, "{}", r.kv_share(big));
        assert!(
            (0..KV_SLOTS as u8).all(|s| s == big || r.kv_share(s) == 0.0),
            "a tenant without a quota here takes no slot"
        );
        // This node sends big 10% of the cache more: it counts at once, on top of the home's
        // figure, until the home's figure changes (and includes them).
        count_routed(core, 1, big, (cap / 10) as usize);
        let share = |core: &Core| core.view.replica(1).unwrap().kv_share(big);
        assert!((share(core) - 0.1 - (cap / 10) as f32 / cap as f32).abs() < 1e-6);
        set_remote_kv_shares(&mut core.replicas[1], &rec, &core.router.tenants);
        refresh_kv_shares(core, 1);
        assert!(share(core) > 0.15, "the same record: still counted");
        if let Some(m) = rec.kv_shares.as_mut() {
            m.insert("big".to_owned(), 300);
        }
        set_remote_kv_shares(&mut core.replicas[1], &rec, &core.router.tenants);
        refresh_kv_shares(core, 1);
        assert!((share(core) - 0.3).abs() < 1e-6, "{}", share(core));
        // The home stops publishing them (an older node): back to this node's own estimate.
        rec.kv_shares = None;
        set_remote_kv_shares(&mut core.replicas[1], &rec, &core.router.tenants);
        refresh_kv_shares(core, 1);
        assert!((core.view.replica(1).unwrap().kv_share(big) - 1.0).abs() < 1e-6);
        // Its home again: its own model, whatever a record said before.
        rec.kv_shares = Some(BTreeMap::new());
        set_remote_kv_shares(&mut core.replicas[1], &rec, &core.router.tenants);
        core.replicas[1].mesh.home = true;
        refresh_kv_shares(core, 1);
        assert!((core.view.replica(1).unwrap().kv_share(big) - 1.0).abs() < 1e-6);
    }
}
