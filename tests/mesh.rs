//! Multi-node mesh tests: real QUIC endpoints with mTLS on 127.0.0.1, in one process.
//!
//! Each test is bounded by `tokio::time::timeout`; ports come from binding 127.0.0.1:0.
//! Figures (convergence and detection times, gossip bytes) are printed; run with
//! `cargo test --test mesh -- --nocapture` to see them. These run the flat layout (one cluster,
//! regions mixed): the mechanics of membership, sync and identity; the regional layout has
//! `tests/regional.rs`.

mod common;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::wait_until;

use kvmesh::core::keys::BlockKey;
use kvmesh::core::summary::{ReplicaSummary, SummaryConfig, SummaryMessage};
use kvmesh::mesh::certs::{ClusterCa, CLUSTER_SAN};
use kvmesh::mesh::cluster::home_in;
use kvmesh::mesh::replica_load::RecordChange;
use kvmesh::mesh::schema::{InflightRecord, ReplicaRecord, SummaryVersion, WireHealth, WireLoad};
use kvmesh::mesh::sync::{needs_pull, RESP_BAD_REQUEST, RESP_OK};
use kvmesh::mesh::transport::{KIND_BLOCK_REPORT, KIND_GOSSIP, KIND_SUMMARY_REQUEST};
use kvmesh::mesh::{
    BlockReport, GossipLayout, Mesh, MeshConfig, MeshError, MeshHandler, SummaryRequest,
};

const GOSSIP: Duration = Duration::from_millis(100);
const CLUSTER: &str = "test-cluster";

async fn bounded<F: Future<Output = ()>>(secs: u64, f: F) {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .expect("test timed out");
}

async fn start(ca: &ClusterCa, name: &str, region: &str, seeds: &[SocketAddr]) -> Mesh {
    Mesh::start(config(ca, name, region, seeds)).await.unwrap()
}

async fn sees_live(m: &Mesh, names: &[&str]) -> bool {
    let live = m.live_nodes().await;
    names
        .iter()
        .all(|n| live.iter().any(|x| x.node_id == *n && x.node.is_some()))
}

/// Publishes `record` whole as replica `id`'s home.
async fn publish(m: &Mesh, id: &str, record: &ReplicaRecord) {
    m.publish_replica(id, record, RecordChange::Full)
        .await
        .unwrap();
}

fn record(region: &str, summary: SummaryVersion) -> ReplicaRecord {
    ReplicaRecord {
        url: "http://10.0.0.1:8000".into(),
        region: region.into(),
        zone: String::new(),
        pool: "shared".into(),
        models: vec!["m".into()],
        capacity_tokens: 100_000,
        prefill_tokens_per_s: 10_000.0,
        prefill_attention_ms_per_pair: None,
        max_in_flight: 64,
        health: WireHealth::Healthy,
        load: WireLoad::default(),
        summary,
        origin: String::new(),
        kv_events: None,
        pd: None,
        kv_shares: None,
        kv_load: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_converge_and_measure_rtt() {
    bounded(30, async {
        let ca = ClusterCa::generate().unwrap();
        let a = start(&ca, "a", "eu", &[]).await;
        let t0 = Instant::now();
        let b = start(&ca, "b", "eu", &[a.addr()]).await;
        let c = start(&ca, "c", "us", &[a.addr()]).await;
        let all = ["a", "b", "c"];
        for m in [&a, &b, &c] {
            wait_until(Duration::from_secs(5), || sees_live(m, &all))
                .await
                .expect("3 nodes did not converge");
        }
        let took = t0.elapsed();
        println!(
            "3-node convergence: {took:?} ({} gossip intervals)",
            took.as_millis() / 100
        );
        assert!(took < Duration::from_secs(3), "convergence took {took:?}");
        // Node records carry what the node needs to forward.
        let members = c.members().await;
        let ma = members.iter().find(|m| m.node_id == "a").unwrap();
        let rec = ma.node.as_ref().unwrap();
        assert_eq!(rec.region, "eu");
        assert_eq!(rec.quic_addr, a.addr());
        assert_eq!(rec.http_url, "http://a.example:8080");
        // In-flight counts gossip too.
        let inflight = InflightRecord::fit([("r1".to_string(), 3), ("r2".to_string(), 0)]);
        b.publish_inflight(&inflight).await.unwrap();
        wait_until(Duration::from_secs(3), || async {
            c.members()
                .await
                .iter()
                .any(|m| m.node_id == "b" && m.inflight.counts.get("r1") == Some(&3))
        })
        .await
        .expect("inflight record did not reach c");
        // RTT per region is measured on QUIC connections, gossiped, and becomes a RegionMap.
        wait_until(Duration::from_secs(5), || async {
            let map = a.region_map().await;
            map.distance("eu", "us") < 1000.0
        })
        .await
        .expect("eu-us distance never measured");
        let rtts = c.region_rtts().await;
        assert!(
            rtts.get("eu").is_some_and(|d| *d < Duration::from_secs(1)),
            "{rtts:?}"
        );
        // Steady-state gossip volume.
        let before = a.stats().transport;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let after = a.stats().transport;
        let bytes = after.gossip_bytes_sent - before.gossip_bytes_sent;
        let msgs = after.gossip_sent - before.gossip_sent;
        println!(
            "node a, 3-node cluster, steady state: {bytes} B/s gossip sent in {msgs} messages \
             ({} B per 100 ms round)",
            bytes / 10
        );
        assert!(msgs > 0);
        assert_eq!(after.malformed, 0);
        for m in [a, b, c] {
            m.shutdown().await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_from_another_ca_cannot_join_or_read() {
    bounded(30, async {
        let ca = ClusterCa::generate().unwrap();
        let rogue_ca = ClusterCa::generate().unwrap();
        let a = start(&ca, "a", "eu", &[]).await;
        let b = start(&ca, "b", "eu", &[a.addr()]).await;
        let d = start(&rogue_ca, "d", "eu", &[a.addr(), b.addr()]).await;
        publish(&a, "r1", &record("eu", SummaryVersion::default())).await;
        wait_until(Duration::from_secs(5), || sees_live(&b, &["a", "b"]))
            .await
            .expect("a and b did not converge");
        tokio::time::sleep(Duration::from_millis(1500)).await;
        for m in [&a, &b] {
            assert!(
                m.members().await.iter().all(|x| x.node_id != "d"),
                "{} lists the rogue node",
                m.node_id()
            );
        }
        let seen: Vec<String> = d.members().await.into_iter().map(|m| m.node_id).collect();
        assert_eq!(seen, vec!["d".to_string()], "rogue node read cluster state");
        assert!(d.fetch_summary(a.addr(), "r1", 0, 0).await.is_err());
        let refused = a.stats().transport.handshake_failures
            + b.stats().transport.handshake_failures
            + d.stats().transport.connect_failures;
        assert!(refused > 0);
        for m in [a, b, d] {
            m.shutdown().await;
        }
    })
    .await;
}

struct Home {
    cfg: SummaryConfig,
    summary: Mutex<ReplicaSummary>,
    reports: Mutex<Vec<(SocketAddr, BlockReport)>>,
}

impl MeshHandler for Home {
    fn summary(&self, req: &SummaryRequest) -> Option<SummaryMessage> {
        (req.replica_id == "r1").then(|| self.summary.lock().unwrap().answer(req.epoch, req.seq))
    }
    fn block_report(&self, from: SocketAddr, report: BlockReport) {
        // What a home does with reports from routing nodes: feed them to the replica's model.
        let keys: Vec<BlockKey> = report.keys.iter().map(|k| BlockKey(*k)).collect();
        self.summary.lock().unwrap().insert(&keys);
        self.reports.lock().unwrap().push((from, report));
    }
}

impl Home {
    fn version(&self) -> SummaryVersion {
        let s = self.summary.lock().unwrap();
        SummaryVersion {
            epoch: s.epoch(),
            seq: s.seq(),
            digest: s.digest(),
        }
    }
}

fn keys(r: std::ops::Range<u64>) -> Vec<BlockKey> {
    r.map(|i| BlockKey(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn summary_sync_delta_then_snapshot_and_block_reports() {
    bounded(30, async {
        let ca = ClusterCa::generate().unwrap();
        let a = start(&ca, "a", "eu", &[]).await;
        let b = start(&ca, "b", "eu", &[a.addr()]).await;
        let cfg = SummaryConfig::for_cluster(CLUSTER);
        let home = Arc::new(Home {
            cfg: cfg.clone(),
            summary: Mutex::new(ReplicaSummary::new(100, 10_000, &cfg).unwrap()),
            reports: Mutex::new(Vec::new()),
        });
        home.summary.lock().unwrap().insert(&keys(0..50));
        a.set_handler(home.clone());
        publish(&a, "r1", &record("eu", home.version())).await;

        // b learns the replica and its summary version by gossip, then pulls the body.
        let entry = loop {
            if let Some(e) = b
                .replicas_in_region("eu")
                .await
                .into_iter()
                .find(|e| e.id == "r1")
            {
                break e;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(entry.publisher, "a");
        assert_eq!(entry.publisher_addr, a.addr());
        assert_eq!(entry.record.summary, home.version());
        let first = b
            .fetch_summary(entry.publisher_addr, "r1", 0, 0)
            .await
            .unwrap();
        assert!(matches!(first, SummaryMessage::Snapshot(_)));
        let mut copy = match &first {
            SummaryMessage::Snapshot(s) => ReplicaSummary::from_snapshot(s, &cfg).unwrap(),
            SummaryMessage::Delta(_) => unreachable!(),
        };
        assert_eq!(copy.digest(), entry.record.summary.digest);

        // b routes a new prefix to r1 and reports its blocks to the home.
        let t_report = Instant::now();
        let routed = keys(1000..1040);
        b.report_blocks(
            a.addr(),
            "r1",
            &routed.iter().map(|k| k.0).collect::<Vec<_>>(),
        );
        wait_until(Duration::from_secs(3), || async {
            !home.reports.lock().unwrap().is_empty()
        })
        .await
        .expect("block report never arrived");
        assert_eq!(home.reports.lock().unwrap()[0].0, b.addr());
        assert_eq!(home.reports.lock().unwrap()[0].1.keys.len(), 40);
        let t_home = t_report.elapsed();

        // The home publishes the new version (a node does this every gossip round); b sees it
        // by gossip, and a delta brings b's copy to the home's digest.
        publish(&a, "r1", &record("eu", home.version())).await;
        wait_until(Duration::from_secs(3), || async {
            b.replicas_in_region("eu").await.iter().any(|e| {
                e.id == "r1" && needs_pull(Some((copy.epoch(), copy.seq())), &e.record.summary)
            })
        })
        .await
        .expect("new summary version never gossiped");
        let delta = b
            .fetch_summary(a.addr(), "r1", copy.epoch(), copy.seq())
            .await
            .unwrap();
        match &delta {
            SummaryMessage::Delta(d) => assert_eq!(d.keys.len(), 40),
            other => panic!("expected a delta, got {other:?}"),
        }
        copy.apply(&delta, &cfg).unwrap();
        assert_eq!(copy.digest(), home.version().digest);
        assert_eq!(copy.hit(&routed), 40);
        println!(
            "new prefix: report reached the home after {t_home:?}; visible in b's copy after {:?} \
             (report batch 50 ms + gossip 100 ms + pull)",
            t_report.elapsed()
        );

        // A new epoch at the home: b's next pull is a snapshot, applied to the same digest.
        {
            let mut s = home.summary.lock().unwrap();
            let mut fresh = ReplicaSummary::new(101, 10_000, &home.cfg).unwrap();
            fresh.insert(&keys(5000..5010));
            *s = fresh;
        }
        let snap = b
            .fetch_summary(a.addr(), "r1", copy.epoch(), copy.seq())
            .await
            .unwrap();
        assert!(matches!(snap, SummaryMessage::Snapshot(ref s) if s.epoch == 101));
        copy.apply(&snap, &cfg).unwrap();
        assert_eq!(copy.digest(), home.version().digest);
        assert_eq!(copy.epoch(), 101);

        // Unknown replicas are refused, not answered with garbage.
        assert!(b.fetch_summary(a.addr(), "nope", 0, 0).await.is_err());
        for m in [a, b] {
            m.shutdown().await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_and_malformed_input_is_refused_and_counted() {
    bounded(30, async {
        let ca = ClusterCa::generate().unwrap();
        let a = start(&ca, "a", "eu", &[]).await;
        let b = start(&ca, "b", "eu", &[a.addr()]).await;
        let cfg = SummaryConfig::for_cluster(CLUSTER);
        let home = Arc::new(Home {
            cfg: cfg.clone(),
            summary: Mutex::new(ReplicaSummary::new(1, 1000, &cfg).unwrap()),
            reports: Mutex::new(Vec::new()),
        });
        a.set_handler(home.clone());

        // The encoder refuses a value chitchat could not carry; nothing is published.
        let mut big = record("eu", SummaryVersion::default());
        big.models = (0..300).map(|i| format!("lora-adapter-{i}")).collect();
        assert!(matches!(
            a.publish_replica("big", &big, RecordChange::Full).await,
            Err(MeshError::Schema(_))
        ));
        assert!(a
            .publish_replica(
                &"x".repeat(500),
                &record("eu", SummaryVersion::default()),
                RecordChange::Full
            )
            .await
            .is_err());

        // A peer with a valid certificate sends garbage on every kind of stream.
        let q = ca
            .issue("fuzzer")
            .unwrap()
            .quic_configs(Duration::from_secs(10))
            .unwrap();
        let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        ep.set_default_client_config(q.client);
        let conn = ep.connect(a.addr(), CLUSTER_SAN).unwrap().await.unwrap();
        let uni = |bytes: Vec<u8>| {
            let conn = conn.clone();
            async move {
                let mut s = conn.open_uni().await.unwrap();
                // The node may stop reading an oversized stream midway; that is the point.
                let _ = s.write_all(&bytes).await;
                let _ = s.finish();
            }
        };
        let mut junk = vec![KIND_GOSSIP];
        junk.extend_from_slice(b"\xff\xffnot a chitchat message");
        uni(junk).await;
        uni(vec![0x7f, 1, 2, 3]).await;
        let mut bad_report = vec![KIND_BLOCK_REPORT];
        bad_report.extend_from_slice(b"\xc1\xc1");
        uni(bad_report).await;
        let mut oversized = vec![KIND_GOSSIP];
        oversized.resize(70_000, 0xaa);
        uni(oversized).await;
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        s.write_all(&[KIND_SUMMARY_REQUEST, 0xc1, 0x00])
            .await
            .unwrap();
        s.finish().unwrap();
        let resp = r.read_to_end(4096).await.unwrap();
        assert_eq!(resp[0], RESP_BAD_REQUEST);

        wait_until(Duration::from_secs(3), || async {
            let s = a.stats().transport;
            s.malformed >= 4 && s.oversized >= 1
        })
        .await
        .unwrap_or_else(|| panic!("drops not counted: {:?}", a.stats()));
        conn.close(0u32.into(), b"done");

        // The node keeps working: gossip converges and sync answers.
        publish(&b, "r1", &record("eu", SummaryVersion::default())).await;
        wait_until(Duration::from_secs(3), || async {
            a.replicas_in_region("eu")
                .await
                .iter()
                .any(|e| e.id == "r1")
        })
        .await
        .expect("gossip stopped after malformed input");
        assert!(a
            .replicas_in_region("eu")
            .await
            .iter()
            .all(|e| e.id != "big"));
        let msg = b.fetch_summary(a.addr(), "r1", 0, 0).await.unwrap();
        assert!(matches!(msg, SummaryMessage::Snapshot(_)));
        // A well-formed raw request gets a well-formed answer too.
        let conn = ep.connect(a.addr(), CLUSTER_SAN).unwrap().await.unwrap();
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        let mut req = vec![KIND_SUMMARY_REQUEST];
        req.extend(
            SummaryRequest {
                replica_id: "r1".into(),
                epoch: 0,
                seq: 0,
            }
            .encode()
            .unwrap(),
        );
        s.write_all(&req).await.unwrap();
        s.finish().unwrap();
        let resp = r.read_to_end(1 << 20).await.unwrap();
        assert_eq!(resp[0], RESP_OK);
        assert!(SummaryMessage::decode(&resp[1..]).is_ok());
        ep.close(0u32.into(), b"done");
        for m in [a, b] {
            m.shutdown().await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_node_is_detected_and_its_replicas_move() {
    bounded(30, async {
        let ca = ClusterCa::generate().unwrap();
        let a = start(&ca, "a", "eu", &[]).await;
        let b = start(&ca, "b", "eu", &[a.addr()]).await;
        let c = start(&ca, "c", "eu", &[a.addr()]).await;
        for m in [&a, &b, &c] {
            wait_until(Duration::from_secs(5), || sees_live(m, &["a", "b", "c"]))
                .await
                .expect("did not converge");
        }
        // Let the failure detector collect a few heartbeat intervals of c.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let ids: Vec<String> = (0..60).map(|i| format!("replica-{i}")).collect();
        let live = a.live_nodes().await;
        let before: Vec<String> = ids
            .iter()
            .map(|r| home_in(&live, r, "eu").unwrap().0)
            .collect();
        assert!(before.iter().any(|h| h == "c"));
        c.shutdown().await;
        let t0 = Instant::now();
        let detected = wait_until(Duration::from_secs(6), || async {
            let a_done = !a.live_nodes().await.iter().any(|m| m.node_id == "c");
            let b_done = !b.live_nodes().await.iter().any(|m| m.node_id == "c");
            a_done && b_done
        })
        .await
        .expect("dead node never detected");
        println!("dead node detected by both survivors after {detected:?} (gossip 100 ms, failure_detection 2 s)");
        assert!(t0.elapsed() < Duration::from_secs(4));
        // Only c's replicas moved, and a and b agree on every home.
        let (la, lb) = (a.live_nodes().await, b.live_nodes().await);
        for (r, old) in ids.iter().zip(&before) {
            let new_a = home_in(&la, r, "eu").unwrap().0;
            let new_b = home_in(&lb, r, "eu").unwrap().0;
            assert_eq!(new_a, new_b);
            if old == "c" {
                assert!(new_a == "a" || new_a == "b");
            } else {
                assert_eq!(&new_a, old);
            }
        }
        assert_eq!(
            a.is_home(&ids[0], "eu").await,
            home_in(&la, &ids[0], "eu").unwrap().0 == "a"
        );
        for m in [a, b] {
            m.shutdown().await;
        }
    })
    .await;
}

fn config(ca: &ClusterCa, name: &str, region: &str, seeds: &[SocketAddr]) -> MeshConfig {
    let mut cfg = common::loopback_mesh(CLUSTER, name, region, ca.issue(name).unwrap(), seeds);
    cfg.layout = GossipLayout::Flat;
    cfg.gossip_interval = GOSSIP;
    cfg.rtt_interval = Duration::from_millis(200);
    cfg.http_url = format!("http://{name}.example:8080");
    cfg
}

/// A node that crashes and comes back on its old address (a rolling restart, a pod rescheduled)
/// is heard at once: its peers still hold a connection to the dead process, which looks live
/// until its 10 s idle timeout, and a new incoming connection from that address must replace it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_back_on_its_old_address_is_heard_at_once() {
    bounded(30, async {
        let ca = ClusterCa::generate().unwrap();
        let a = start(&ca, "a", "eu", &[]).await;
        let b = start(&ca, "b", "eu", &[a.addr()]).await;
        // c runs on a runtime of its own, so that it can die as a process does: its tasks
        // dropped, nothing closing its connections.
        let cfg = config(&ca, "c", "eu", &[a.addr()]);
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let (die_tx, die_rx) = std::sync::mpsc::channel::<()>();
        let crashed = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            let c = rt.block_on(Mesh::start(cfg)).unwrap();
            let _ = started_tx.send((c.addr(), c.node_record().generation));
            let _ = die_rx.recv();
            // Its tasks go first, so nothing runs to send a close when the mesh is dropped.
            rt.shutdown_background();
            drop(c);
        });
        let (addr, old_gen) = started_rx.await.unwrap();
        for m in [&a, &b] {
            wait_until(Duration::from_secs(5), || sees_live(m, &["a", "b", "c"]))
                .await
                .expect("did not converge");
        }
        die_tx.send(()).unwrap();
        tokio::task::spawn_blocking(move || crashed.join())
            .await
            .unwrap()
            .unwrap();
        let mut cfg = config(&ca, "c", "eu", &[a.addr()]);
        cfg.listen_addr = addr;
        // The dead endpoint's socket goes with its last task: retry the bind for a while.
        let mut c = None;
        for _ in 0..50 {
            match Mesh::start(cfg.clone()).await {
                Ok(m) => {
                    c = Some(m);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        let c = c.expect("the old address is free again");
        let new_gen = c.node_record().generation;
        assert_ne!(new_gen, old_gen);
        let took = wait_until(Duration::from_secs(8), || async {
            let new_c_live = |live: Vec<kvmesh::mesh::Member>| {
                live.iter()
                    .any(|m| m.node_id == "c" && m.generation == new_gen)
            };
            sees_live(&c, &["a", "b"]).await
                && new_c_live(a.live_nodes().await)
                && new_c_live(b.live_nodes().await)
        })
        .await
        .expect("the restarted node and its peers never heard each other");
        println!("restarted node and its peers hear each other after {took:?}");
        assert!(
            took < Duration::from_secs(5),
            "took {took:?}: the old connection was used"
        );
        for m in [a, b, c] {
            m.shutdown().await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_heals_and_state_converges() {
    bounded(40, async {
        let ca = ClusterCa::generate().unwrap();
        let a = start(&ca, "a", "eu", &[]).await;
        let b = start(&ca, "b", "eu", &[a.addr()]).await;
        let c = start(&ca, "c", "eu", &[a.addr()]).await;
        for m in [&a, &b, &c] {
            wait_until(Duration::from_secs(5), || sees_live(m, &["a", "b", "c"]))
                .await
                .expect("did not converge");
        }
        // Split {a} | {b, c}.
        for peer in [b.addr(), c.addr()] {
            a.transport().block(peer);
        }
        b.transport().block(a.addr());
        c.transport().block(a.addr());
        publish(&c, "r-split", &record("eu", SummaryVersion::default())).await;
        publish(&a, "r-lonely", &record("eu", SummaryVersion::default())).await;
        wait_until(Duration::from_secs(3), || async {
            b.replicas_in_region("eu")
                .await
                .iter()
                .any(|e| e.id == "r-split")
        })
        .await
        .expect("b did not see c's write inside its side");
        // Long enough for each side to declare the other dead.
        let split = wait_until(Duration::from_secs(6), || async {
            !a.live_nodes().await.iter().any(|m| m.node_id == "c")
        })
        .await
        .expect("a never declared c dead during the partition");
        println!("partition: a declared c dead after {split:?}");
        let a_members = a.members().await;
        let c_at_a = a_members.iter().find(|m| m.node_id == "c").unwrap();
        assert!(
            !c_at_a.replicas.contains_key("r-split"),
            "write crossed the partition"
        );
        assert!(a.fetch_summary(c.addr(), "r-split", 0, 0).await.is_err());
        // Heal.
        for peer in [b.addr(), c.addr()] {
            a.transport().unblock(peer);
        }
        b.transport().unblock(a.addr());
        c.transport().unblock(a.addr());
        let t0 = Instant::now();
        wait_until(Duration::from_secs(10), || async {
            let a_ok = a
                .replicas_in_region("eu")
                .await
                .iter()
                .any(|e| e.id == "r-split")
                && sees_live(&a, &["a", "b", "c"]).await;
            let c_ok = c
                .replicas_in_region("eu")
                .await
                .iter()
                .any(|e| e.id == "r-lonely")
                && sees_live(&c, &["a", "b", "c"]).await;
            a_ok && c_ok
        })
        .await
        .expect("state did not converge after the partition healed");
        println!("partition healed: converged in {:?}", t0.elapsed());
        assert!(a.stats().transport.blocked > 0);
        for m in [a, b, c] {
            m.shutdown().await;
        }
    })
    .await;
}

/// A one-record DNS server: answers every SRV query with `localhost.:<port>` for each port.
async fn fake_srv_server(ports: Vec<u16>) -> SocketAddr {
    use hickory_resolver::proto::op::{Message, OpCode};
    use hickory_resolver::proto::rr::rdata::SRV;
    use hickory_resolver::proto::rr::{Name, RData, Record, RecordType};
    let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = sock.local_addr().unwrap();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 4096];
        while let Ok((n, from)) = sock.recv_from(&mut buf).await {
            let Ok(q) = Message::from_vec(&buf[..n]) else {
                continue;
            };
            let mut resp = Message::response(q.metadata.id, OpCode::Query);
            resp.metadata.recursion_desired = q.metadata.recursion_desired;
            resp.metadata.recursion_available = true;
            for query in &q.queries {
                resp.add_query(query.clone());
                if query.query_type() == RecordType::SRV {
                    for (i, p) in ports.iter().enumerate() {
                        let target = Name::from_ascii("localhost.").unwrap();
                        let srv = SRV::new(i as u16, 0, *p, target);
                        resp.add_answer(Record::from_rdata(
                            query.name().clone(),
                            60,
                            RData::SRV(srv),
                        ));
                    }
                }
            }
            let _ = sock.send_to(&resp.to_vec().unwrap(), from).await;
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn srv_seed_discovery_joins_the_cluster() {
    bounded(30, async {
        let ca = ClusterCa::generate().unwrap();
        let a = start(&ca, "a", "eu", &[]).await;
        let dns = fake_srv_server(vec![a.addr().port()]).await;
        let mut cfg = config(&ca, "b", "eu", &[]);
        cfg.seeds = vec!["srv:_kvmesh._udp.mesh.test.".into()];
        cfg.dns_server = Some(dns);
        let b = Mesh::start(cfg).await.unwrap();
        let changes = b.watch_changes().await.unwrap();
        for m in [&a, &b] {
            wait_until(Duration::from_secs(5), || sees_live(m, &["a", "b"]))
                .await
                .expect("SRV-discovered seed did not join");
        }
        // The watch reports the joined member without polling `members()`.
        wait_until(Duration::from_secs(2), || {
            let seen = changes.borrow().keys().any(|id| &*id.node_id == "a");
            async move { seen }
        })
        .await
        .expect("watch never showed node a");
        assert!(changes.has_changed().is_ok());
        for m in [a, b] {
            m.shutdown().await;
        }
    })
    .await;
}

/// Issue #13: a node's `node_id` must be a name its certificate carries. A node with a valid
/// cluster certificate issued for `spoof` that claims to be `n3` (a second live `n3`) is
/// refused: `Mesh::start` will not start under that name, and a modified node that skips the
/// check (the transport and chitchat driven by hand) is dropped by its peers, counted, and never
/// counted live; the real `n3` stays the only one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_certificate_does_not_name_its_node_id_is_refused() {
    use chitchat::{spawn_chitchat, ChitchatConfig, ChitchatId, FailureDetectorConfig};
    use kvmesh::mesh::certs::CertError;
    use kvmesh::mesh::schema::{NodeRecord, KEY_NODE, SCHEMA_VERSION};
    use kvmesh::mesh::transport::{QuicTransport, TransportConfig};

    bounded(40, async {
        let ca = ClusterCa::generate().unwrap();
        let a = start(&ca, "a", "eu", &[]).await;
        let b = start(&ca, "b", "eu", &[a.addr()]).await;
        let n3 = start(&ca, "n3", "eu", &[a.addr()]).await;
        for m in [&a, &b, &n3] {
            wait_until(Duration::from_secs(5), || sees_live(m, &["a", "b", "n3"]))
                .await
                .expect("mesh did not converge");
        }

        // The unmodified node refuses to start, naming both names.
        let spoof_identity = ca.issue("spoof").unwrap();
        let cfg = common::loopback_mesh(CLUSTER, "n3", "eu", spoof_identity.clone(), &[]);
        match Mesh::start(cfg).await {
            Err(MeshError::Certs(e @ CertError::WrongName { .. })) => {
                let msg = e.to_string();
                assert!(msg.contains("spoof") && msg.contains("n3"), "{msg}");
            }
            other => panic!("a node named n3 with a cert for spoof started: {other:?}"),
        }

        // A modified node skips the check: same CA, valid certificate for `spoof`, gossiping
        // as `n3` with a node record, seeded with a and b.
        let quic = spoof_identity
            .quic_configs(Duration::from_secs(10))
            .unwrap();
        let transport = QuicTransport::bind(
            "127.0.0.1:0".parse().unwrap(),
            quic,
            TransportConfig::default(),
        )
        .unwrap();
        let addr = transport.local_addr();
        let record = NodeRecord {
            schema: SCHEMA_VERSION,
            region: "eu".into(),
            zone: String::new(),
            http_url: "http://spoof.example:8080".into(),
            quic_addr: addr,
            version: "x".into(),
            generation: 1,
        };
        let config = ChitchatConfig {
            chitchat_id: ChitchatId::new("n3".to_owned(), 1, addr),
            cluster_id: CLUSTER.into(),
            gossip_interval: GOSSIP,
            listen_addr: addr,
            seed_nodes: vec![a.addr().to_string(), b.addr().to_string()],
            failure_detector_config: FailureDetectorConfig::default(),
            marked_for_deletion_grace_period: Duration::from_secs(600),
            catchup_callback: None,
            extra_liveness_predicate: None,
        };
        let handle = spawn_chitchat(
            config,
            vec![(KEY_NODE.to_owned(), record.encode().unwrap())],
            &transport,
        )
        .await
        .unwrap();

        // Its gossip reaches a and b, and is refused there.
        wait_until(Duration::from_secs(5), || {
            let refused = [&a, &b]
                .iter()
                .all(|m| m.stats().transport.identity_refused > 0);
            async move { refused }
        })
        .await
        .expect("the impostor's gossip was never refused");
        // Over many gossip rounds, no node ever counts a second n3 live, nor one at the
        // impostor's address; the real n3 stays live everywhere.
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_millis(1500) {
            for m in [&a, &b, &n3] {
                let live = m.live_nodes().await;
                let n3s: Vec<SocketAddr> = live
                    .iter()
                    .filter(|x| x.node_id == "n3")
                    .map(|x| x.gossip_addr)
                    .collect();
                assert_eq!(n3s, vec![n3.addr()], "{} sees n3 at {n3s:?}", m.node_id());
                assert!(live.iter().all(|x| x.gossip_addr != addr));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(a.transport().is_refused(addr));
        handle.abort();
        transport.close();
        for m in [a, b, n3] {
            m.shutdown().await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_under_overlong_replica_ids_are_dropped_and_counted() {
    bounded(30, async {
        let ca = ClusterCa::generate().unwrap();
        let a = start(&ca, "a", "eu", &[]).await;
        let b = start(&ca, "b", "eu", &[a.addr()]).await;
        // Valid values under keys no correct node writes: ids over 128 bytes.
        let long = "x".repeat(300);
        let value = record("eu", SummaryVersion::default()).encode().unwrap();
        a.publish_unchecked(&format!("replica:{long}"), &value)
            .await;
        let drain = kvmesh::mesh::admin::AdminRecord {
            stamp_ms: 1,
            op: kvmesh::mesh::admin::AdminOp::Drain,
            spec: None,
        };
        a.publish_unchecked(&format!("admin:{long}"), &drain.encode().unwrap())
            .await;
        // A well-formed record after them, to know when gossip has carried them over.
        publish(&a, "r1", &record("eu", SummaryVersion::default())).await;
        wait_until(Duration::from_secs(5), || async {
            b.members()
                .await
                .iter()
                .any(|m| m.node_id == "a" && m.replicas.contains_key("r1"))
        })
        .await
        .expect("a's records never reached b");
        let members = b.members().await;
        let from_a = members.iter().find(|m| m.node_id == "a").unwrap();
        assert_eq!(from_a.replicas.len(), 1, "{:?}", from_a.replicas.keys());
        assert!(from_a.admin.is_empty());
        // The replica record is decoded and refused; the admin record, from a node without the
        // operator role, is refused before decoding.
        let s = b.stats();
        assert!(s.schema_errors >= 1, "{s:?}");
        assert!(s.transport.authority_refused >= 1, "{s:?}");
        b.shutdown().await;
        a.shutdown().await;
    })
    .await;
}

/// A busy replica's home republishes only the changing part of its record (`rload:<id>`): a
/// peer reads the new load and summary version over the record it already holds, and a
/// companion whose record is withdrawn goes with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicas_changing_part_travels_alone_and_overlays_its_record() {
    bounded(30, async {
        let ca = ClusterCa::generate().unwrap();
        let a = start(&ca, "a", "eu", &[]).await;
        let b = start(&ca, "b", "eu", &[a.addr()]).await;
        let first = record(
            "eu",
            SummaryVersion {
                epoch: 1,
                seq: 1,
                digest: 7,
            },
        );
        publish(&a, "r1", &first).await;
        let seen = |want: ReplicaRecord| {
            let b = &b;
            async move {
                b.replicas_in_region("eu")
                    .await
                    .iter()
                    .any(|e| e.id == "r1" && e.record == want)
            }
        };
        wait_until(Duration::from_secs(5), || seen(first.clone()))
            .await
            .expect("the record did not reach b");
        let mut busier = first.clone();
        busier.load.waiting = 12;
        busier.load.queued_prefill_tokens = 40_000;
        busier.summary.seq = 9;
        a.publish_replica("r1", &busier, RecordChange::Load)
            .await
            .unwrap();
        wait_until(Duration::from_secs(5), || seen(busier.clone()))
            .await
            .expect("the changing part did not reach b");
        a.unpublish_replica("r1").await.unwrap();
        wait_until(Duration::from_secs(5), || async {
            b.replicas_in_region("eu").await.is_empty()
        })
        .await
        .expect("the withdrawn record stayed");
        for m in [a, b] {
            m.shutdown().await;
        }
    })
    .await;
}
