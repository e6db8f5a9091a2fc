//! The regional layout (issue #17): each region its own gossip cluster, regions exchanging one
//! record each through their representatives. Real QUIC endpoints with mTLS on 127.0.0.1, in
//! one process; every test bounded.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvmesh::core::region_offer::{OfferedModel, RegionHead, RegionOffer};
use kvmesh::mesh::certs::ClusterCa;
use kvmesh::mesh::regional::RegionalRound;
use kvmesh::mesh::Mesh;

use common::{bounded, init_logs};

const CLUSTER: &str = "regional-test";

async fn start(ca: &ClusterCa, name: &str, region: &str, seeds: &[SocketAddr]) -> Mesh {
    let mut cfg = common::loopback_mesh(CLUSTER, name, region, ca.issue(name).unwrap(), seeds);
    cfg.gossip_interval = Duration::from_millis(100);
    cfg.region_interval = Duration::from_millis(200);
    cfg.http_url = format!("https://{name}.example:8443");
    Mesh::start(cfg).await.unwrap()
}

fn offer(region: &str) -> RegionOffer {
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
        heads: vec![RegionHead { key: 42, depth: 16 }],
    }
}

/// One sync round at `m`, as a node's loop makes it.
async fn round(m: &Mesh) -> RegionalRound {
    let live: Vec<_> = m.members().await.into_iter().filter(|x| x.live).collect();
    let region = m.node_record().region.clone();
    m.sync_regions(&live, || offer(&region)).await
}

/// Runs rounds on every mesh every 50 ms until `done` holds for all, or `limit` passes.
async fn rounds_until(
    meshes: &[&Mesh],
    limit: Duration,
    done: impl Fn(&Mesh, &RegionalRound) -> bool,
) -> Option<Duration> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        let mut all = true;
        for m in meshes {
            let r = round(m).await;
            all &= done(m, &r);
        }
        if all {
            return Some(t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
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
        let t0 = Instant::now();
        let mut met = false;
        while t0.elapsed() < Duration::from_secs(20) && !met {
            met = region_members(&u1.live_nodes().await) == ["u1", "u2"]
                && region_members(&u2.live_nodes().await) == ["u1", "u2"];
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        println!("u1 and u2 met after {:?}", t0.elapsed());
        assert!(met, "us nodes met through the eu seed's rendezvous");
        assert_eq!(region_members(&e1.live_nodes().await), ["e1"]);
    })
    .await;
}
