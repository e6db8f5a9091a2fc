//! The regional layout (issue #17): each region its own gossip cluster, regions exchanging one
//! record each through their representatives. Real QUIC endpoints with mTLS on 127.0.0.1, in
//! one process; every test bounded.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvmesh::core::region_offer::{OfferedModel, RegionHead, RegionOffer};
use kvmesh::mesh::certs::ClusterCa;
use kvmesh::mesh::region_layer::representatives;
use kvmesh::mesh::regional::RegionalRound;
use kvmesh::mesh::{Member, Mesh};

use common::{bounded, init_logs, wait_until};

const CLUSTER: &str = "regional-test";

async fn start(ca: &ClusterCa, name: &str, region: &str, seeds: &[SocketAddr]) -> Mesh {
    let mut cfg = common::loopback_mesh(CLUSTER, name, region, ca.issue(name).unwrap(), seeds);
    cfg.gossip_interval = Duration::from_millis(100);
    cfg.region_interval = Duration::from_millis(200);
    cfg.http_url = format!("https://{name}.example:8443");
    Mesh::start(cfg).await.unwrap()
}

fn offer(region: &str) -> RegionOffer {
    offer_with_head(region, 42)
}

fn offer_with_head(region: &str, head: u64) -> RegionOffer {
    RegionOffer {
        region: region.into(),
        models: vec![OfferedModel {
            model: "m".into(),
            pool: String::new(),
            whole: true,
            healthy: 2,
            open: 1,
            least_queue_ms: 10,
            prefill_tokens_per_s: 10_000,
        }],
        heads: vec![RegionHead {
            key: head,
            depth: 16,
        }],
        holders: vec![],
    }
}

/// One sync round at `m`, as a node's loop makes it, offering `offer`, with `extra` members
/// counted live besides the ones `m` knows.
async fn round_offering(m: &Mesh, offer: RegionOffer, extra: &[Member]) -> RegionalRound {
    let mut live: Vec<_> = m.members().await.into_iter().filter(|x| x.live).collect();
    live.extend(extra.iter().cloned());
    m.sync_regions(&live, || offer).await
}

/// One sync round at `m`, as a node's loop makes it.
async fn round(m: &Mesh) -> RegionalRound {
    round_offering(m, offer(&m.node_record().region), &[]).await
}

/// Runs rounds on every mesh every 20 ms until `done` holds for all, or `limit` passes.
async fn rounds_until(
    meshes: &[&Mesh],
    limit: Duration,
    done: impl Fn(&Mesh, &RegionalRound) -> bool,
) -> Option<Duration> {
    wait_until(limit, async || {
        let mut all = true;
        for m in meshes {
            let r = round(m).await;
            all &= done(m, &r);
        }
        all
    })
    .await
}

fn region_members(live: &[kvmesh::mesh::Member]) -> Vec<String> {
    let mut ids: Vec<String> = live.iter().map(|m| m.node_id.clone()).collect();
    ids.sort();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regions_gossip_apart_and_learn_each_other_from_records() {
    init_logs();
    bounded(40, async {
        let ca = ClusterCa::generate().unwrap();
        // One seed for everyone, in region eu: us nodes find each other through it.
        let e1 = start(&ca, "e1", "eu", &[]).await;
        let seed = [e1.addr()];
        let e2 = start(&ca, "e2", "eu", &seed).await;
        let e3 = start(&ca, "e3", "eu", &seed).await;
        let u1 = start(&ca, "u1", "us", &seed).await;
        let u2 = start(&ca, "u2", "us", &seed).await;
        let all = [&e1, &e2, &e3, &u1, &u2];
        let sizes = [("eu", 3usize), ("us", 2)];
        let took = rounds_until(&all, Duration::from_secs(20), |m, r| {
            let want = sizes
                .iter()
                .find(|(name, _)| *name == m.node_record().region)
                .map_or(0, |(_, n)| *n);
            // And the other region's record counts all of its nodes.
            let other = r
                .records
                .values()
                .next()
                .map_or(0, |rec| rec.nodes as usize);
            r.records.len() == 1 && r.region_live == want && other == 5 - want
        })
        .await;
        for m in all {
            let live = m.live_nodes().await;
            println!(
                "{}: members {:?}, records {:?}",
                m.node_id(),
                region_members(&live),
                round(m).await.records.keys().collect::<Vec<_>>()
            );
        }
        let took = took.expect("every node sees its region and the other region's record");
        println!("every node sees its region and holds the other's record after {took:?}");
        // Each sees exactly its own region's nodes.
        for m in [&e1, &e2, &e3] {
            assert_eq!(region_members(&m.live_nodes().await), ["e1", "e2", "e3"]);
        }
        for m in [&u1, &u2] {
            assert_eq!(region_members(&m.live_nodes().await), ["u1", "u2"]);
        }
        // The record carries what forwarding needs.
        let r = round(&e3).await;
        let us = &r.records["us"];
        assert_eq!(us.nodes, 2);
        assert_eq!(us.models[0].open, 1);
        assert_eq!(us.heads, vec![(42, 16)]);
        assert!(us.targets.iter().all(|t| t.node_id.starts_with('u')));
        assert!(!us.targets.is_empty());
        // A member of eu that is not one of its representatives relays a record of us of its
        // own making, newer than the real one, naming itself as us's target: not taken.
        let mut liar = e3
            .members()
            .await
            .into_iter()
            .find(|m| m.node_id == "e1")
            .expect("e1 as e3 sees it");
        liar.node_id = (0..100)
            .map(|i| format!("x{i}"))
            .find(|x| !representatives(["e1", "e2", "e3", x.as_str()], 2).contains(&x.as_str()))
            .expect("a name that is not a representative");
        let mut forged = us.clone();
        forged.at_ms += 60_000;
        forged.targets[0].node_id = liar.node_id.clone();
        liar.regions = Arc::new(BTreeMap::from([("us".to_owned(), forged)]));
        let r = round_offering(&e3, offer("eu"), &[liar]).await;
        assert!(
            r.records["us"]
                .targets
                .iter()
                .all(|t| t.node_id.starts_with('u')),
            "{:?}",
            r.records["us"]
        );
        // Two representatives per region (of 3 in eu, 2 in us).
        let mut reps = 0;
        for m in all {
            reps += usize::from(round(m).await.representative);
        }
        assert_eq!(reps, 4);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_regions_nodes_meet_through_another_regions_seed_before_any_round() {
    init_logs();
    bounded(30, async {
        let ca = ClusterCa::generate().unwrap();
        // The only seed is in eu and runs no regional round, so its directory knows no us node:
        // u1 and u2 can meet only because the seed names earlier askers of us to later ones.
        let e1 = start(&ca, "e1", "eu", &[]).await;
        let seed = [e1.addr()];
        let u1 = start(&ca, "u1", "us", &seed).await;
        let u2 = start(&ca, "u2", "us", &seed).await;
        let met = wait_until(Duration::from_secs(20), async || {
            region_members(&u1.live_nodes().await) == ["u1", "u2"]
                && region_members(&u2.live_nodes().await) == ["u1", "u2"]
        })
        .await;
        println!("u1 and u2 met after {met:?}");
        assert!(
            met.is_some(),
            "us nodes met through the eu seed's rendezvous"
        );
        assert_eq!(region_members(&e1.live_nodes().await), ["e1"]);
    })
    .await;
}

/// Issue #17: a representative can lose its role (a node that outranks it joins its region) and
/// win it back when that node leaves. Its layer then starts again, empty, and the other regions
/// must hear its record again, also when it equals the one published last (a CI run once had a
/// region's record missing for 20 s; the unchanged record was never published into the new
/// layer). Peers still hold the old incarnation, dead, at a higher key version than the new one
/// starts from; the record before the last one is published after it to cover that too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_representative_that_steps_down_and_back_is_heard_again() {
    init_logs();
    bounded(60, async {
        let ca = ClusterCa::generate().unwrap();
        let e1 = start(&ca, "e1", "eu", &[]).await;
        let u1 = start(&ca, "u1", "us", &[e1.addr()]).await;
        // e1 offers eu with `head` (and `extra` members); u1 runs its own round: does u1 hold
        // eu's record, and with which head?
        let eu_at_u1 = async |head: u64, extra: &[Member]| {
            let r = round_offering(&e1, offer_with_head("eu", head), extra).await;
            let heads = round(&u1)
                .await
                .records
                .get("eu")
                .map(|rec| rec.heads.clone());
            (r.representative, heads)
        };
        // eu's record changes once (head 7 after head 42), so the layer's first incarnation
        // holds it at a higher version than the next one starts with.
        for head in [42, 7] {
            let seen = wait_until(Duration::from_secs(20), async || {
                eu_at_u1(head, &[]).await.1 == Some(vec![(head, 16)])
            })
            .await;
            assert!(seen.is_some(), "u1 holds eu's record with head {head}");
        }

        // Two made-up eu members that outrank e1 for the region's two representative roles.
        let me = e1
            .members()
            .await
            .into_iter()
            .find(|m| m.is_self)
            .expect("e1 lists itself");
        let fakes: Vec<Member> = (0..200)
            .map(|i| format!("eu-x{i}"))
            .filter(|id| representatives([id.as_str(), "e1"], 1) == [id.as_str()])
            .take(2)
            .enumerate()
            .map(|(i, id)| Member {
                node_id: id,
                is_self: false,
                gossip_addr: SocketAddr::from(([127, 0, 0, 1], 9 + i as u16)),
                ..me.clone()
            })
            .collect();
        assert_eq!(fakes.len(), 2);
        // e1 steps down while u1 goes on; u1 forgets eu's record once e1's layer is silent.
        let forgotten = wait_until(Duration::from_secs(20), async || {
            let (representative, heads) = eu_at_u1(7, &fakes).await;
            assert!(!representative);
            heads.is_none()
        })
        .await;
        println!("e1 stepped down; u1 forgot eu's record after {forgotten:?}");
        assert!(
            forgotten.is_some(),
            "u1 drops eu's record once e1 left the region layer"
        );

        // The made-up members leave: e1 is a representative again. First with the record it
        // published last, then with the one before it.
        for head in [7, 42] {
            let seen = wait_until(Duration::from_secs(10), async || {
                eu_at_u1(head, &[]).await.1 == Some(vec![(head, 16)])
            })
            .await;
            println!("e1 back as representative; u1 holds head {head} after {seen:?}");
            assert!(
                seen.is_some(),
                "u1 hears eu's record with head {head} from e1's new layer"
            );
        }
    })
    .await;
}
