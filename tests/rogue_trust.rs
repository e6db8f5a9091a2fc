//! Issue #35 (trust): a member with a valid certificate is trusted only for what it owns.
//! Each test plays a rogue member against honest ones over real QUIC on loopback and shows
//! the abuse refused or bounded: relayed forgeries of another member's `node` and `replica:`
//! records, `admin:` drains without the operator role, `node` records for a region the
//! certificate does not bind, and key floods (capped per member; freed when it leaves).

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use chitchat::ChitchatId;
use common::{bounded, loopback_mesh, wait_until};

use kvmesh::mesh::admin::{AdminOp, AdminRecord};
use kvmesh::mesh::certs::{CertError, CertRoles, ClusterCa};
use kvmesh::mesh::gossip_guard::MAX_KEYS_PER_MEMBER;
use kvmesh::mesh::replica_load::RecordChange;
use kvmesh::mesh::schema::{NodeRecord, ReplicaRecord, SummaryVersion, WireHealth, WireLoad};
use kvmesh::mesh::{Member, Mesh, MeshError};

const CLUSTER: &str = "rogue-trust";

fn roles(region: Option<&str>, operator: bool) -> CertRoles {
    CertRoles {
        region: region.map(str::to_owned),
        operator,
    }
}

async fn start_with(
    ca: &ClusterCa,
    name: &str,
    region: &str,
    roles: &CertRoles,
    seeds: &[SocketAddr],
) -> Mesh {
    let identity = ca.issue_with(name, roles).unwrap();
    let mut cfg = loopback_mesh(CLUSTER, name, region, identity, seeds);
    cfg.gossip_interval = Duration::from_millis(100);
    cfg.failure_detection = Duration::from_millis(1000);
    cfg.dead_node_grace_period = Duration::from_secs(2);
    cfg.http_url = format!("https://{name}.example:8443");
    Mesh::start(cfg).await.unwrap()
}

async fn start(ca: &ClusterCa, name: &str, seeds: &[SocketAddr]) -> Mesh {
    start_with(ca, name, "eu", &CertRoles::default(), seeds).await
}

/// `of`'s view of member `name` (live or not).
async fn member(of: &Mesh, name: &str) -> Option<Member> {
    of.members().await.into_iter().find(|m| m.node_id == name)
}

async fn sees_live(of: &Mesh, names: &[&str]) -> bool {
    let live = of.live_nodes().await;
    names
        .iter()
        .all(|n| live.iter().any(|m| m.node_id == *n && m.node.is_some()))
}

fn id_of(m: &Member) -> ChitchatId {
    ChitchatId::new(m.node_id.clone(), m.generation, m.gossip_addr)
}

fn replica(url: &str) -> ReplicaRecord {
    ReplicaRecord {
        url: url.into(),
        region: "eu".into(),
        zone: String::new(),
        pool: String::new(),
        models: vec!["m".into()],
        capacity_tokens: 100_000,
        prefill_tokens_per_s: 10_000.0,
        prefill_attention_ms_per_pair: None,
        max_in_flight: 64,
        health: WireHealth::Healthy,
        load: WireLoad::default(),
        summary: SummaryVersion::default(),
        origin: String::new(),
        kv_events: None,
        pd: None,
        kv_shares: None,
        kv_load: None,
    }
}

/// `m` publishes a replica record `marker`, and `of` waits until it sees it, then for ten more
/// gossip messages: what `m` published before has had its chance to arrive.
async fn after_marker(m: &Mesh, of: &Mesh, marker: &str) {
    m.publish_replica(marker, &replica("http://10.0.0.9:8000"), RecordChange::Full)
        .await
        .unwrap();
    wait_until(Duration::from_secs(20), || async {
        member(of, m.node_id())
            .await
            .is_some_and(|x| x.replicas.contains_key(marker))
    })
    .await
    .expect("the marker arrives");
    let seen = of.stats().transport.gossip_received;
    wait_until(Duration::from_secs(10), || async {
        of.stats().transport.gossip_received >= seen + 10
    })
    .await
    .expect("gossip goes on");
}

/// Three members of one region, all seeing each other live: (a, b, rogue).
async fn trio(ca: &ClusterCa) -> (Mesh, Mesh, Mesh) {
    let a = start(ca, "a", &[]).await;
    let b = start(ca, "b", &[a.addr()]).await;
    let rogue = start(ca, "rogue", &[a.addr()]).await;
    for m in [&a, &b, &rogue] {
        wait_until(Duration::from_secs(10), || {
            sees_live(m, &["a", "b", "rogue"])
        })
        .await
        .expect("the three meet");
    }
    (a, b, rogue)
}

/// The rogue rewrites, in its own copy of a's state, a's `node` record (unsigned, and signed
/// by itself) and a's `replica:r1` record (a is r1's home), and gossips them on: b keeps a's
/// own records, counts the forgeries, and still takes a's later updates (nothing froze).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relayed_forgeries_of_another_members_records_are_refused() {
    bounded(60, async {
        let ca = ClusterCa::generate().unwrap();
        let (a, b, rogue) = trio(&ca).await;
        a.publish_replica("r1", &replica("http://10.0.0.1:8000"), RecordChange::Full)
            .await
            .unwrap();
        wait_until(Duration::from_secs(5), || async {
            member(&b, "a")
                .await
                .is_some_and(|m| m.replicas.contains_key("r1"))
                && member(&rogue, "a")
                    .await
                    .is_some_and(|m| m.replicas.contains_key("r1"))
        })
        .await
        .expect("a's record reaches b and the rogue");
        let victim = id_of(&member(&rogue, "a").await.unwrap());
        let mut evil_node = member(&b, "a").await.unwrap().node.unwrap();
        evil_node.http_url = "https://evil.example:8443".into();
        let mut evil_replica = replica("http://evil.example:8000");
        evil_replica.health = WireHealth::Unhealthy;
        let forgeries = [
            ("node", evil_node.encode().unwrap()),
            ("replica:r1", evil_replica.encode().unwrap()),
        ];
        for (key, value) in &forgeries {
            rogue.forge_member_state(&victim, key, value).await;
            after_marker(&rogue, &b, &format!("marker-{key}")).await;
            let seen = member(&b, "a").await.unwrap();
            assert_eq!(
                seen.node.as_ref().map(|n| n.http_url.as_str()),
                Some("https://a.example:8443"),
                "b took the forged node record"
            );
            assert_eq!(
                seen.replicas.get("r1"),
                Some(&replica("http://10.0.0.1:8000"))
            );
        }
        // Whoever heard the forgeries from the rogue refused them (the other may have heard
        // of them only through that peer, which never took them).
        let refused = a.stats().transport.forged_refused + b.stats().transport.forged_refused;
        assert!(refused >= 1, "{:?} / {:?}", a.stats(), b.stats());
        // a's own later update still reaches b past the forged versions.
        let mut newer = replica("http://10.0.0.1:8000");
        newer.load.waiting = 7;
        a.publish_replica("r1", &newer, RecordChange::Full)
            .await
            .unwrap();
        wait_until(Duration::from_secs(5), || async {
            member(&b, "a")
                .await
                .is_some_and(|m| m.replicas.get("r1").is_some_and(|r| r.load.waiting == 7))
        })
        .await
        .expect("a's next update reaches b");
        for m in [rogue, b, a] {
            m.shutdown().await;
        }
    })
    .await;
}

/// A member without the operator role publishes a region-wide drain (`admin:` records for
/// four replicas): no peer applies them. An operator's record gets through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_records_need_an_operator_certificate() {
    bounded(60, async {
        let ca = ClusterCa::generate().unwrap();
        let (a, b, rogue) = trio(&ca).await;
        let op = start_with(&ca, "op", "eu", &roles(None, true), &[a.addr()]).await;
        let drain = AdminRecord {
            stamp_ms: 1,
            op: AdminOp::Drain,
            spec: None,
        };
        for r in ["r1", "r2", "r3", "r4"] {
            rogue
                .publish_unchecked(&format!("admin:{r}"), &drain.encode().unwrap())
                .await;
        }
        op.publish_admin("r1", &drain).await.unwrap();
        wait_until(Duration::from_secs(10), || async {
            member(&b, "op")
                .await
                .is_some_and(|m| m.admin.contains_key("r1"))
        })
        .await
        .expect("the operator's record reaches b");
        for of in [&a, &b] {
            after_marker(&rogue, of, &format!("marker-{}", of.node_id())).await;
            let seen = member(of, "rogue").await.unwrap();
            assert!(seen.admin.is_empty(), "{:?}", seen.admin);
            assert!(seen.node.is_some(), "the rogue's own records still count");
        }
        // Whoever heard the rogue first refused all four (the other may have heard it only
        // through that peer, which relays its state without them).
        let refused = a.stats().transport.authority_refused + b.stats().transport.authority_refused;
        assert!(refused >= 4, "{:?} / {:?}", a.stats(), b.stats());
        for m in [op, rogue, b, a] {
            m.shutdown().await;
        }
    })
    .await;
}

/// A certificate bound to region eu: the node does not start as a member of us, and a `node`
/// record for us it publishes anyway is refused by its peers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_bound_to_a_region_is_refused_elsewhere() {
    bounded(60, async {
        let ca = ClusterCa::generate().unwrap();
        let identity = ca.issue_with("x", &roles(Some("eu"), false)).unwrap();
        let cfg = loopback_mesh(CLUSTER, "x", "us", identity, &[]);
        match Mesh::start(cfg).await {
            Err(MeshError::Certs(CertError::WrongRegion { config, cert })) => {
                assert_eq!((config.as_str(), cert.as_str()), ("us", "eu"));
            }
            other => panic!("started in the wrong region: {other:?}"),
        }
        let a = start(&ca, "a", &[]).await;
        let rogue = start_with(&ca, "rogue", "eu", &roles(Some("eu"), false), &[a.addr()]).await;
        wait_until(Duration::from_secs(10), || sees_live(&a, &["rogue"]))
            .await
            .expect("a sees the rogue");
        let mut us: NodeRecord = rogue.node_record().clone();
        us.region = "us".into();
        rogue.publish_unchecked("node", &us.encode().unwrap()).await;
        after_marker(&rogue, &a, "marker").await;
        let seen = member(&a, "rogue").await.unwrap();
        assert_eq!(seen.node.map(|n| n.region), Some("eu".to_owned()));
        assert!(
            a.stats().transport.authority_refused >= 1,
            "{:?}",
            a.stats()
        );
        rogue.shutdown().await;
        a.shutdown().await;
    })
    .await;
}

/// A member publishing 5,000 keys: each peer holds at most the per-member cap of them, and
/// forgets them all once the member has left (dead past the grace period).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_flood_is_capped_and_freed_when_the_member_leaves() {
    bounded(90, async {
        let ca = ClusterCa::generate().unwrap();
        let a = start(&ca, "a", &[]).await;
        let rogue = start(&ca, "rogue", &[a.addr()]).await;
        wait_until(Duration::from_secs(10), || sees_live(&a, &["rogue"]))
            .await
            .expect("a sees the rogue");
        let value = replica("http://10.0.0.1:8000").encode().unwrap();
        for i in 0..5_000 {
            rogue
                .publish_unchecked(&format!("replica:flood-{i}"), &value)
                .await;
        }
        // Every key either held or refused at least once.
        wait_until(Duration::from_secs(40), || async {
            let held = member(&a, "rogue").await.map_or(0, |m| m.replicas.len());
            held as u64 + a.stats().transport.key_cap_refused >= 5_000
        })
        .await
        .expect("a takes or refuses each of the rogue's keys");
        let held = member(&a, "rogue").await.unwrap().replicas.len();
        assert!(
            held > 0 && held <= MAX_KEYS_PER_MEMBER,
            "a holds {held} of its keys"
        );
        rogue.shutdown().await;
        wait_until(Duration::from_secs(30), || async {
            member(&a, "rogue").await.is_none()
        })
        .await
        .expect("a forgets the departed member");
        a.shutdown().await;
    })
    .await;
}
