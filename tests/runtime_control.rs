//! Runtime control, as an operator uses it: the admin API (`kvmesh replicas add|drain|rm`)
//! against one node changes routing on every node of its region; drains let requests in flight
//! finish; bad commands get OpenAI-style 4xx answers. In-process nodes on loopback (real QUIC
//! with mTLS, real HTTP) in front of simulated replicas; every test bounded in time.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use kvmesh::node::config::{MeshSection, NodeConfig, ReplicaConfig as NodeReplica};
use kvmesh::node::AdminReplica;
use kvmesh::proxy::{self, RunningNode};
use kvmesh::replica::ReplicaHandle;
use serde_json::{json, Value};

mod common;
use common::{bounded, client, sim_replica, wait_for};

const ROUTED: &str = "x-kvmesh-routed-to";
const MODEL: &str = "sim-llama-8b";

/// A simulated replica `id`, 50× faster than real time, answering `latency_ms` late.
async fn replica(id: &str, latency_ms: u64) -> ReplicaHandle {
    sim_replica(id, |c| c.faults.added_latency_ms = latency_ms).await
}

fn url(r: &ReplicaHandle) -> String {
    format!("http://{}", r.addr)
}

/// A node of region `eu` with `replicas` (id, url); a mesh member when `certs` is given.
fn config(certs: Option<(&Path, &str, &[SocketAddr])>, replicas: &[(&str, String)]) -> NodeConfig {
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        debug_headers: true,
        region: "eu".into(),
        cluster_id: "runtime-control-test".into(),
        drain_s: 2,
        ..NodeConfig::default()
    };
    cfg.health.interval_ms = 100;
    cfg.health.timeout_ms = 500;
    cfg.scrape.interval_ms = 100;
    cfg.timeouts.connect_ms = 500;
    cfg.replicas = replicas
        .iter()
        .map(|(id, url)| NodeReplica {
            id: Some((*id).into()),
            ..NodeReplica::from_url(url.clone())
        })
        .collect();
    if let Some((dir, name, seeds)) = certs {
        // Operators: their commands reach the region (peers refuse `admin:` records otherwise).
        let operator = kvmesh::mesh::certs::CertRoles {
            region: None,
            operator: true,
        };
        kvmesh::mesh::certs::issue_in_dir_with(dir, name, &operator).unwrap();
        cfg.mesh = Some(MeshSection {
            node_id: name.into(),
            listen: "127.0.0.1:0".parse().unwrap(),
            seeds: seeds.iter().map(|s| s.to_string()).collect(),
            certs_dir: Some(dir.to_owned()),
            gossip_interval_ms: 100,
            failure_detection_ms: 1_000,
            warmup_timeout_ms: 5_000,
            ..MeshSection::default()
        });
    }
    cfg
}

/// Two meshed nodes of region `eu`, both configured with `replicas`.
async fn two_nodes(dir: &Path, replicas: &[(&str, String)]) -> (RunningNode, RunningNode) {
    let n1 = proxy::spawn(config(Some((dir, "n1", &[])), replicas))
        .await
        .unwrap();
    let seed = n1.node.mesh().unwrap().addr();
    let n2 = proxy::spawn(config(Some((dir, "n2", &[seed])), replicas))
        .await
        .unwrap();
    let met = wait_for(Duration::from_secs(10), || {
        [&n1, &n2].iter().all(|n| {
            n.node
                .state()
                .mesh
                .is_some_and(|m| m.members.iter().filter(|m| m.live).count() == 2)
        })
    })
    .await;
    assert!(met.is_some(), "the two nodes never met");
    (n1, n2)
}

async fn complete(c: &reqwest::Client, node: SocketAddr, prompt: &str) -> (u16, String) {
    let resp = c
        .post(format!("http://{node}/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let routed = resp
        .headers()
        .get(ROUTED)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let _ = resp.bytes().await.unwrap();
    (status, routed)
}

/// An admin call; returns the status and the JSON answer.
async fn admin(
    c: &reqwest::Client,
    method: reqwest::Method,
    node: SocketAddr,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = c.request(method, format!("http://{node}{path}"));
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

fn listed(n: &RunningNode, id: &str) -> Option<AdminReplica> {
    n.node.admin_replicas().into_iter().find(|r| r.id == id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_added_on_one_node_is_routable_from_every_node_of_its_region() {
    bounded(60, async {
        let dir = tempfile::tempdir().unwrap();
        kvmesh::mesh::certs::init_dir(dir.path()).unwrap();
        let r1 = replica("r1", 0).await;
        let r2 = replica("r2", 0).await;
        let (n1, n2) = two_nodes(dir.path(), &[("r1", url(&r1))]).await;
        let c = client();
        assert!(listed(&n2, "r2").is_none());

        let t0 = Instant::now();
        let (status, answer) = admin(
            &c,
            reqwest::Method::POST,
            n1.addr,
            "/admin/replicas",
            Some(json!({"url": url(&r2), "id": "r2"})),
        )
        .await;
        assert_eq!(status, 201, "{answer}");
        assert_eq!(answer["op"], "add");
        // Registered and healthy at the other node of the region, by gossip.
        let seen = wait_for(Duration::from_secs(10), || {
            [&n1, &n2].iter().all(|n| {
                listed(n, "r2")
                    .is_some_and(|r| r.health == "healthy" && !r.learned && !r.models.is_empty())
            })
        })
        .await;
        let seen = seen.unwrap_or_else(|| {
            panic!(
                "n2 never took the replica added at n1: n1 {:?}, n2 {:?}",
                listed(&n1, "r2"),
                listed(&n2, "r2")
            )
        });
        println!(
            "added at n1 → healthy at n2 after {seen:?} (total {:?})",
            t0.elapsed()
        );

        // With r1 drained (at n2: the drain reaches n1 the same way), r2 serves everything, at
        // both nodes.
        let (status, _) = admin(
            &c,
            reqwest::Method::POST,
            n2.addr,
            "/admin/replicas/r1/drain",
            None,
        )
        .await;
        assert_eq!(status, 200);
        let drained_at_n1 = wait_for(Duration::from_secs(10), || {
            listed(&n1, "r1").is_some_and(|r| r.drained && r.health == "draining")
        })
        .await;
        assert!(drained_at_n1.is_some(), "the drain never reached n1");
        for (i, n) in [&n1, &n2, &n1, &n2].into_iter().enumerate() {
            let (status, routed) = complete(&c, n.addr, &format!("prompt {i} for r2")).await;
            assert_eq!(status, 200);
            assert_eq!(routed, "r2", "request {i} went elsewhere");
        }

        // `add` again ends the drain everywhere.
        let (status, _) = admin(
            &c,
            reqwest::Method::POST,
            n1.addr,
            "/admin/replicas",
            Some(json!({"url": url(&r1), "id": "r1"})),
        )
        .await;
        assert_eq!(status, 200);
        let back = wait_for(Duration::from_secs(10), || {
            listed(&n2, "r1").is_some_and(|r| !r.drained && r.health == "healthy")
        })
        .await;
        assert!(back.is_some(), "r1 never came back at n2");

        for n in [n2, n1] {
            n.shutdown().await;
        }
        r1.shutdown().await;
        r2.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_lets_requests_in_flight_finish_and_then_routes_around_the_replica() {
    bounded(60, async {
        let dir = tempfile::tempdir().unwrap();
        kvmesh::mesh::certs::init_dir(dir.path()).unwrap();
        let fast = replica("fast", 0).await;
        // Every answer of `slow` takes 2 s: a request to it is in flight long enough to watch.
        let slow = replica("slow", 2_000).await;
        let (n1, n2) = two_nodes(dir.path(), &[("fast", url(&fast)), ("slow", url(&slow))]).await;
        let c = client();
        let ready = wait_for(Duration::from_secs(10), || {
            [&n1, &n2].iter().all(|n| {
                n.node
                    .admin_replicas()
                    .iter()
                    .filter(|r| r.health == "healthy")
                    .count()
                    == 2
            })
        })
        .await;
        assert!(ready.is_some(), "replicas never healthy");

        // Send one request to `slow` through n1: drain `fast` for it, then bring `fast` back.
        let drained = admin(
            &c,
            reqwest::Method::POST,
            n1.addr,
            "/admin/replicas/fast/drain",
            None,
        )
        .await;
        assert_eq!(drained.0, 200);
        let in_flight = {
            let c = c.clone();
            let addr = n1.addr;
            tokio::spawn(async move {
                let r = complete(&c, addr, "a long request").await;
                (r, Instant::now())
            })
        };
        let started = wait_for(Duration::from_secs(5), || {
            listed(&n1, "slow").is_some_and(|r| r.in_flight == 1)
        })
        .await;
        assert!(started.is_some(), "the request never reached `slow`");
        let back = admin(
            &c,
            reqwest::Method::POST,
            n1.addr,
            "/admin/replicas",
            Some(json!({"url": url(&fast), "id": "fast"})),
        )
        .await;
        assert_eq!(back.0, 200);
        // n2 knows of n1's request by its load updates.
        let shared = wait_for(Duration::from_secs(5), || {
            listed(&n2, "slow").is_some_and(|r| r.peer_in_flight == 1)
        })
        .await;
        assert!(shared.is_some(), "n2 never saw n1's request in flight");

        // Drain `slow` at n2 and wait: the answer comes once n1's request finished.
        let t0 = Instant::now();
        let (status, answer) = admin(
            &c,
            reqwest::Method::POST,
            n2.addr,
            "/admin/replicas/slow/drain?wait_s=20",
            None,
        )
        .await;
        let answered = Instant::now();
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["drained"], true, "{answer}");
        assert_eq!(answer["in_flight"], 0);
        let ((status, routed), finished) = in_flight.await.unwrap();
        assert_eq!(status, 200, "the request in flight failed");
        assert_eq!(routed, "slow");
        assert!(
            answered + Duration::from_millis(50) >= finished,
            "the drain answered {:?} before the request in flight finished",
            finished - answered
        );
        println!("drain with wait answered after {:?}", t0.elapsed());

        // Nothing new goes to `slow`, from either node.
        let gone = wait_for(Duration::from_secs(10), || {
            listed(&n1, "slow").is_some_and(|r| r.drained)
        })
        .await;
        assert!(gone.is_some(), "the drain never reached n1");
        for i in 0..6 {
            let n = if i % 2 == 0 { &n1 } else { &n2 };
            let (status, routed) = complete(&c, n.addr, &format!("after the drain {i}")).await;
            assert_eq!(status, 200);
            assert_eq!(routed, "fast");
        }
        for n in [n2, n1] {
            n.shutdown().await;
        }
        fast.shutdown().await;
        slow.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_need_the_token_and_bad_ones_get_a_clear_4xx() {
    bounded(30, async {
        let r1 = replica("r1", 0).await;
        let r2 = replica("r2", 0).await;
        let mut cfg = config(None, &[("r1", url(&r1)), ("r2", url(&r2))]);
        cfg.admin_token = Some("s3cret".into());
        let n = proxy::spawn(cfg).await.unwrap();
        let c = client();
        let base = format!("http://{}", n.addr);

        let anon = c
            .delete(format!("{base}/admin/replicas/r2"))
            .send()
            .await
            .unwrap();
        assert_eq!(anon.status(), 401);
        assert!(listed(&n, "r2").is_some_and(|r| !r.removed));

        let call = |method: reqwest::Method, path: &str| {
            c.request(method, format!("{base}{path}"))
                .bearer_auth("s3cret")
        };
        let cases = [
            (
                call(reqwest::Method::POST, "/admin/replicas").body("{not json"),
                400,
            ),
            (
                call(reqwest::Method::POST, "/admin/replicas").json(&json!({"url": "ftp://x"})),
                400,
            ),
            (
                call(reqwest::Method::POST, "/admin/replicas")
                    .json(&json!({"url": "http://127.0.0.1:9", "max_in_flight": 0})),
                400,
            ),
            (
                call(reqwest::Method::POST, "/admin/replicas").json(&json!({
                    "url": "http://127.0.0.1:9",
                    "kv_events": {"endpoint": "tcp://10.9.9.9:5557"}
                })),
                400,
            ),
            (
                call(reqwest::Method::POST, "/admin/replicas")
                    .json(&json!({"url": "http://127.0.0.1:9", "region": "us"})),
                409,
            ),
            (
                call(reqwest::Method::POST, "/admin/replicas/nope/drain"),
                404,
            ),
            (
                call(reqwest::Method::DELETE, "/admin/replicas/r2?wait_s=100000"),
                400,
            ),
            // Not a number, and a body over the bound: the API's error shape too.
            (
                call(reqwest::Method::DELETE, "/admin/replicas/r2?wait_s=abc"),
                400,
            ),
            (
                call(reqwest::Method::POST, "/admin/replicas").body(vec![b' '; 100 << 10]),
                400,
            ),
        ];
        for (i, (req, want)) in cases.into_iter().enumerate() {
            let resp = req.send().await.unwrap();
            assert_eq!(resp.status().as_u16(), want, "case {i}");
            let body: Value = resp.json().await.unwrap();
            assert!(
                body["error"]["message"]
                    .as_str()
                    .is_some_and(|m| !m.is_empty()),
                "case {i}: {body}"
            );
        }

        // `add` on a known id updates it in place: here its pool and capacity.
        let resp = call(reqwest::Method::POST, "/admin/replicas")
            .json(&json!({"url": url(&r1), "id": "r1", "pool": "premium", "max_in_flight": 8}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert!(listed(&n, "r1").is_some_and(|r| r.pool == "premium"));
        let i = n.node.lock().view.index_of("r1").unwrap();
        assert_eq!(n.node.lock().view.replica(i).unwrap().info.max_in_flight, 8);

        // Removed: out of routing at once, listed as removed until dropped.
        let resp = call(reqwest::Method::DELETE, "/admin/replicas/r2?wait_s=5")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["op"], "remove");
        assert_eq!(body["drained"], true);
        assert!(listed(&n, "r2").is_some_and(|r| r.removed && r.drained));
        for i in 0..8 {
            let (status, routed) = complete(&c, n.addr, &format!("after rm {i}")).await;
            assert_eq!(status, 200);
            assert_eq!(routed, "r1");
        }
        let list: Vec<AdminReplica> = call(reqwest::Method::GET, "/admin/replicas")
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(list.len(), 2);
        n.shutdown().await;
        r1.shutdown().await;
        r2.shutdown().await;
    })
    .await;
}
