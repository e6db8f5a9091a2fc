//! `kvmesh serve` as a mesh node: several nodes on loopback (real QUIC with mTLS, real HTTP) in
//! front of simulated replicas, in-process, and once as separate processes.
//!
//! Every test is bounded by `tokio::time::timeout`. Figures (propagation, home handover) are
//! printed; run with `cargo test --test mesh_node -- --nocapture` to see them.

mod common;

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{live_members, mesh_addr};
use kvmesh::bench::delay_line::DelayLine;
use kvmesh::mesh::replica_load::RecordChange;
use kvmesh::node::config::{MeshSection, NodeConfig};
use kvmesh::node::NodeState;
use kvmesh::proxy::warm_peers::warmups;
use kvmesh::proxy::{self, RunningNode};
use kvmesh::replica::{self, ReplicaConfig, ReplicaHandle};
use serde_json::json;

const ROUTED: &str = "x-kvmesh-routed-to";
const HIT: &str = "x-kvmesh-hit-blocks";
const MODEL: &str = "sim-llama-8b";
const FAILURE_DETECTION_MS: u64 = 1_000;

async fn bounded<F: Future>(secs: u64, f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .expect("test exceeded its time bound")
}

fn client() -> reqwest::Client {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    proxy::install_crypto_provider();
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

async fn replica(id: &str) -> ReplicaHandle {
    replica_with(id, |_| {}).await
}

/// A simulated replica `id`, 50× faster than real time unless `adjust` says otherwise.
async fn replica_with(id: &str, adjust: impl FnOnce(&mut ReplicaConfig)) -> ReplicaHandle {
    let mut cfg = ReplicaConfig {
        id: id.into(),
        exit_on_crash: false,
        ..ReplicaConfig::default()
    };
    cfg.engine.time_scale = 50.0;
    adjust(&mut cfg);
    replica::spawn(cfg).await.unwrap()
}

/// A mesh node `name` of `region` with `replicas` (id, url), seeded with `seeds`.
async fn mesh_node(
    certs: &Path,
    name: &str,
    region: &str,
    seeds: &[SocketAddr],
    replicas: &[(String, String)],
) -> RunningNode {
    mesh_node_with(certs, name, region, seeds, replicas, None).await
}

/// [`mesh_node`] advertising `http_url` to peers instead of its real address.
async fn mesh_node_with(
    certs: &Path,
    name: &str,
    region: &str,
    seeds: &[SocketAddr],
    replicas: &[(String, String)],
    http_url: Option<String>,
) -> RunningNode {
    proxy::spawn(mesh_config(certs, name, region, seeds, replicas, http_url))
        .await
        .unwrap()
}

/// The configuration [`mesh_node_with`] starts.
fn mesh_config(
    certs: &Path,
    name: &str,
    region: &str,
    seeds: &[SocketAddr],
    replicas: &[(String, String)],
    http_url: Option<String>,
) -> NodeConfig {
    // A restarted node keeps its certificate.
    if !certs.join(format!("{name}.pem")).exists() {
        kvmesh::mesh::certs::issue_in_dir(certs, name).unwrap();
    }
    let mut cfg = common::named_node_config(replicas);
    cfg.region = region.into();
    cfg.cluster_id = "mesh-node-test".into();
    cfg.drain_s = 2;
    cfg.mesh = Some(MeshSection {
        node_id: name.into(),
        listen: "127.0.0.1:0".parse().unwrap(),
        seeds: seeds.iter().map(|s| s.to_string()).collect(),
        certs_dir: Some(certs.to_owned()),
        gossip_interval_ms: 100,
        failure_detection_ms: FAILURE_DETECTION_MS,
        warmup_timeout_ms: 5_000,
        http_url,
        ..MeshSection::default()
    });
    cfg
}

/// Polls `cond` every 20 ms until it holds or `limit` passes; returns the time it took.
async fn wait_for(limit: Duration, mut cond: impl FnMut() -> bool) -> Option<Duration> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if cond() {
            return Some(t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// Homes of every replica as `n` sees them (replica id → home node id, "" when unknown).
fn homes(n: &RunningNode) -> Vec<(String, String)> {
    let s: NodeState = n.node.state();
    s.mesh
        .unwrap()
        .replicas
        .into_iter()
        .map(|r| (r.id, r.home))
        .collect()
}

/// Whether every node sees `expect` live members, agrees on every replica's home (one of
/// `expect`) and holds a record for each (their records were published and gossiped).
fn converged(nodes: &[&RunningNode], expect: &[&str], replicas: usize) -> bool {
    let first = homes(nodes[0]);
    nodes.iter().all(|n| {
        let mut live = live_members(n);
        live.sort();
        let h = homes(n);
        live == expect
            && h.len() == replicas
            && h == first
            && h.iter().all(|(_, home)| expect.contains(&home.as_str()))
            && n.node.mesh_warm()
    }) && {
        // Every replica published by its home: the homes' own records.
        let published: usize = nodes
            .iter()
            .map(|n| {
                n.node
                    .state()
                    .mesh
                    .unwrap()
                    .members
                    .iter()
                    .find(|m| m.is_self)
                    .map_or(0, |m| m.replicas_published)
            })
            .sum();
        published == replicas
    }
}

async fn complete(
    c: &reqwest::Client,
    node: SocketAddr,
    prompt: &str,
    extra: &[(&str, &str)],
) -> (u16, reqwest::header::HeaderMap) {
    let mut req = c
        .post(format!("http://{node}/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 4}));
    for (k, v) in extra {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let _ = resp.bytes().await.unwrap();
    (status, headers)
}

fn header(h: &reqwest::header::HeaderMap, name: &str) -> String {
    h.get(name)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
}

/// `n` distinct prompt bytes starting with `seed`.
fn text(seed: &str, n: usize) -> String {
    let mut s = String::new();
    let mut i = 0;
    while s.len() < n {
        s.push_str(&format!("{seed}-{i:06} "));
        i += 1;
    }
    s.truncate(n);
    s
}

/// The version of replica `id`'s summary in `n`'s view.
fn view_version(n: &RunningNode, id: &str) -> Option<(u64, u64)> {
    let core = n.node.lock();
    let i = core.view.index_of(id)?;
    let s = core.view.replica(i)?.summary.as_ref()?;
    Some((s.epoch(), s.seq()))
}

/// The version of the home's authoritative model of replica `id`, if `n` is its home.
fn home_version(n: &RunningNode, id: &str) -> Option<(u64, u64)> {
    let core = n.node.lock();
    let i = core.view.index_of(id)?;
    let rt = &core.replicas[i];
    rt.mesh
        .home
        .then(|| (rt.cache.summary().epoch(), rt.cache.summary().seq()))
}

async fn three_nodes(
    dir: &Path,
    reps: &[ReplicaHandle],
) -> (RunningNode, RunningNode, RunningNode) {
    let list: Vec<(String, String)> = reps.iter().map(|r| (r.id.clone(), r.base_url())).collect();
    let a = mesh_node(dir, "a", "eu", &[], &list).await;
    let seed = [mesh_addr(&a)];
    let b = mesh_node(dir, "b", "eu", &seed, &list).await;
    let c = mesh_node(dir, "c", "eu", &seed, &list).await;
    (a, b, c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_converge_and_a_prefix_routed_at_one_is_preferred_at_another() {
    bounded(30, async {
        let dir = common::cluster_ca();
        let mut reps = Vec::new();
        for i in 0..3 {
            reps.push(replica(&format!("r{i}")).await);
        }
        let (a, b, c) = three_nodes(dir.path(), &reps).await;
        let t = wait_for(Duration::from_secs(10), || {
            converged(&[&a, &b, &c], &["a", "b", "c"], 3)
        })
        .await
        .expect("3 nodes converge");
        println!("3 nodes + 3 replicas converged in {t:?}");
        let http = client();
        for n in [&a, &b, &c] {
            let r = http
                .get(format!("http://{}/ready", n.addr))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "ready once warm");
        }

        // A long prefix through A…
        let prompt = text("shared-system-prompt", 8192);
        let (status, h) = complete(&http, a.addr, &prompt, &[]).await;
        assert_eq!(status, 200);
        let chosen = header(&h, ROUTED);
        assert!(!chosen.is_empty());
        let sent = Instant::now();
        // …reaches the home's model (directly or by A's block report)…
        let home = [&a, &b, &c]
            .into_iter()
            .find(|n| home_version(n, &chosen).is_some())
            .expect("the replica has a home");
        let seen = wait_for(Duration::from_secs(5), || {
            home_version(home, &chosen).is_some_and(|(_, seq)| seq > 0)
        })
        .await
        .expect("the home recorded the prefix");
        let target = home_version(home, &chosen).unwrap();
        // …and the view of a node that is neither A nor the home: a copy pulled from the home.
        let observer = if home_version(&b, &chosen).is_some() {
            &c
        } else {
            &b
        };
        let visible = wait_for(Duration::from_secs(5), || {
            view_version(observer, &chosen).is_some_and(|v| v >= target)
        })
        .await
        .expect("the observer's view catches up with the home");
        println!(
            "prefix at home after {seen:?}; visible at a third node {:?} after routing",
            sent.elapsed().min(seen + visible)
        );
        {
            let core = observer.node.lock();
            let i = core.view.index_of(&chosen).unwrap();
            assert_eq!(
                core.view.overlay_len(i),
                0,
                "B never routed it: the hit can only come from the summary"
            );
        }
        let (status, h) = complete(&http, observer.addr, &prompt, &[]).await;
        assert_eq!(status, 200);
        assert_eq!(
            header(&h, ROUTED),
            chosen,
            "the observer prefers the replica A warmed"
        );
        let hit: u32 = header(&h, HIT).parse().unwrap();
        assert!(
            hit >= 30,
            "the observer expected the cached prefix: hit {hit}"
        );

        // `kvmesh status` shows the mesh.
        let table = proxy::status(&format!("http://{}", b.addr), None)
            .await
            .unwrap();
        assert!(
            table.contains("member") && table.contains("(this node)"),
            "{table}"
        );
        assert!(table.contains(&chosen));
        let metrics = http
            .get(format!("http://{}/metrics", b.addr))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(metrics.contains("kvmesh_mesh_gossip_bytes_total{direction=\"sent\"}"));
        assert!(metrics.contains("kvmesh_mesh_live_members 3"));
        // The sync loop counts its rounds by cause; the gossip interval alone drives some.
        let ticks = metrics
            .lines()
            .find_map(|l| l.strip_prefix("kvmesh_mesh_sync_rounds_total{cause=\"tick\"} "))
            .and_then(|v| v.parse::<u64>().ok());
        assert!(ticks.is_some_and(|t| t > 0), "{metrics}");

        for n in [a, b, c] {
            n.shutdown().await;
        }
        for r in reps {
            r.shutdown().await;
        }
    })
    .await;
}

/// What node `n` believes the region's other nodes have in flight at replica `id`.
fn peer_in_flight(n: &RunningNode, id: &str) -> u32 {
    let core = n.node.lock();
    core.view
        .index_of(id)
        .and_then(|i| core.view.replica(i))
        .map_or(0, |r| r.load.peer_in_flight)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_and_its_prefix_at_one_node_count_at_the_others_within_milliseconds() {
    bounded(30, async {
        let dir = common::cluster_ca();
        let r0 = replica("r0").await;
        let list = vec![(r0.id.clone(), r0.base_url())];
        let a = mesh_node(dir.path(), "a", "eu", &[], &list).await;
        let b = mesh_node(dir.path(), "b", "eu", &[mesh_addr(&a)], &list).await;
        wait_for(Duration::from_secs(10), || converged(&[&a, &b], &["a", "b"], 1))
            .await
            .expect("2 nodes converge");
        let http = client();
        // A long stream through A, left unread so that it stays in flight.
        let resp = http
            .post(format!("http://{}/v1/completions", a.addr))
            .json(&json!({"model": MODEL, "prompt": text("held", 512), "max_tokens": 100_000, "stream": true}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let seen = wait_for(Duration::from_secs(2), || peer_in_flight(&b, "r0") == 1)
            .await
            .expect("B counts A's request");
        println!("B saw A's request in flight after {seen:?}");
        // And the prefix A routed (its last block key), so B's next turn of it can hit there.
        wait_for(Duration::from_secs(2), || !b.node.lock().view.peer_tips.is_empty())
            .await
            .expect("B learns the prefix A routed");
        assert!(a.node.lock().view.peer_tips.is_empty(), "not its own");
        assert_eq!(peer_in_flight(&a, "r0"), 0, "a node does not count itself as a peer");
        // Gossip alone never fills this figure: it is what the load updates carried.
        let stats = a.node.mesh().unwrap().transport().stats().snapshot();
        assert!(stats.load_sent > 0);
        drop(resp);
        wait_for(Duration::from_secs(2), || peer_in_flight(&b, "r0") == 0)
            .await
            .expect("B sees it finish");
        a.shutdown().await;
        b.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_nodes_replicas_move_home_and_routing_continues() {
    bounded(40, async {
        let dir = common::cluster_ca();
        let mut reps = Vec::new();
        for i in 0..4 {
            reps.push(replica(&format!("r{i}")).await);
        }
        let (a, b, c) = three_nodes(dir.path(), &reps).await;
        wait_for(Duration::from_secs(10), || {
            converged(&[&a, &b, &c], &["a", "b", "c"], 4)
        })
        .await
        .expect("3 nodes converge");

        // Kill the node that is home of the most replicas.
        let h = homes(&a);
        let mut nodes = vec![a, b, c];
        let victim = ["a", "b", "c"]
            .iter()
            .enumerate()
            .max_by_key(|(_, n)| h.iter().filter(|(_, home)| home == *n).count())
            .map(|(i, _)| i)
            .unwrap();
        let moved: Vec<String> = h
            .iter()
            .filter(|(_, home)| *home == ["a", "b", "c"][victim])
            .map(|(r, _)| r.clone())
            .collect();
        assert!(!moved.is_empty());
        let dead = nodes.remove(victim);
        let old_generation = dead.node.state().mesh.unwrap().generation;
        let survivors: Vec<SocketAddr> = nodes.iter().map(|n| n.addr).collect();

        // Traffic through the survivors all along.
        let http = client();
        let ok = Arc::new(AtomicUsize::new(0));
        let failed = Arc::new(AtomicUsize::new(0));
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let load = {
            let (http, ok, failed) = (http.clone(), ok.clone(), failed.clone());
            tokio::spawn(async move {
                let mut k = 0usize;
                while !*stop_rx.borrow() {
                    let prompt = text(&format!("p{}", k % 7), 2048);
                    let (status, _) = complete(&http, survivors[k % 2], &prompt, &[]).await;
                    if status == 200 {
                        ok.fetch_add(1, Ordering::Relaxed);
                    } else {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                    k += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
        };
        let killed = Instant::now();
        dead.kill().await;
        let names: Vec<&str> = ["a", "b", "c"]
            .into_iter()
            .enumerate()
            .filter(|(i, _)| *i != victim)
            .map(|(_, n)| n)
            .collect();
        let t = wait_for(Duration::from_secs(10), || {
            converged(&[&nodes[0], &nodes[1]], &names, 4)
        })
        .await
        .expect("homes move to the survivors");
        println!(
            "replicas {moved:?} moved home {:?} after the kill (failure detection {FAILURE_DETECTION_MS} ms)",
            killed.elapsed().min(t)
        );
        assert!(
            t <= Duration::from_millis(FAILURE_DETECTION_MS * 3),
            "homes moved in {t:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        let _ = stop_tx.send(true);
        load.await.unwrap();
        let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
        println!("{ok} requests served on the survivors, {failed} failed");
        assert!(ok > 10);
        assert_eq!(failed, 0);

        // The dead node comes back: a new generation, warm from its peers before it is ready,
        // and home again of the replicas the rendezvous hash gives it.
        let name = ["a", "b", "c"][victim];
        let list: Vec<(String, String)> =
            reps.iter().map(|r| (r.id.clone(), r.base_url())).collect();
        let back = mesh_node(dir.path(), name, "eu", &[mesh_addr(&nodes[0])], &list).await;
        let t0 = Instant::now();
        let t = wait_for(Duration::from_secs(10), || {
            converged(&[&nodes[0], &nodes[1], &back], &["a", "b", "c"], 4)
        })
        .await
        .expect("the restarted node rejoins");
        println!("restarted node converged and warm {:?} after start", t0.elapsed().min(t));
        let state = back.node.state().mesh.unwrap();
        assert!(state.generation > old_generation);
        assert!(state.warm);
        for (id, home) in homes(&back) {
            if home != name {
                let peer = nodes.iter().find(|n| home_version(n, &id).is_some()).unwrap();
                let (epoch, _) = home_version(peer, &id).unwrap();
                assert_eq!(
                    view_version(&back, &id).map(|v| v.0),
                    Some(epoch),
                    "{id}: pulled from its home {home}"
                );
            }
        }
        nodes.push(back);
        for n in nodes {
            n.shutdown().await;
        }
        for r in reps {
            r.shutdown().await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_a_foreign_certificate_is_never_listed() {
    bounded(20, async {
        let dir = common::cluster_ca();
        let other = common::cluster_ca();
        let r = replica("r0").await;
        let list = vec![(r.id.clone(), r.base_url())];
        let a = mesh_node(dir.path(), "a", "eu", &[], &list).await;
        let b = mesh_node(dir.path(), "b", "eu", &[mesh_addr(&a)], &list).await;
        let x = mesh_node(other.path(), "intruder", "eu", &[mesh_addr(&a)], &list).await;
        wait_for(Duration::from_secs(5), || live_members(&b).len() == 2)
            .await
            .expect("a and b meet");
        tokio::time::sleep(Duration::from_millis(1500)).await;
        for n in [&a, &b] {
            let members = n.node.state().mesh.unwrap().members;
            assert!(
                members.iter().all(|m| m.node_id != "intruder"),
                "{members:?}"
            );
        }
        assert_eq!(live_members(&x), vec!["intruder".to_owned()]);
        assert!(
            a.node.mesh().unwrap().stats().transport.handshake_failures > 0,
            "the intruder's handshakes were refused"
        );
        for n in [a, b, x] {
            n.shutdown().await;
        }
        r.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_at_a_region_without_replicas_is_served_one_hop_away() {
    bounded(30, async {
        let dir = common::cluster_ca();
        let ra = replica("ra0").await;
        let rb = replica("rb0").await;
        let a1 = mesh_node(
            dir.path(),
            "a1",
            "a",
            &[],
            &[(ra.id.clone(), ra.base_url())],
        )
        .await;
        let b1 = mesh_node(
            dir.path(),
            "b1",
            "b",
            &[mesh_addr(&a1)],
            &[(rb.id.clone(), rb.base_url())],
        )
        .await;
        // a1 learns region b's offer (rb0 healthy, with room) from b's region record.
        wait_for(Duration::from_secs(10), || region_offered(&a1, "b", 1))
            .await
            .expect("a1 learns region b's replica");
        ra.shutdown().await;
        let http = client();
        // At once, before a1's checks notice: the attempt on ra0 fails, the retry goes to b.
        let (status, h) = complete(&http, a1.addr, &text("right-away", 1024), &[]).await;
        assert_eq!(status, 200);
        assert_eq!(header(&h, ROUTED), "rb0");
        wait_for(Duration::from_secs(5), || {
            a1.node
                .state()
                .replicas
                .iter()
                .any(|r| r.id == "ra0" && r.health == "unhealthy")
        })
        .await
        .expect("a1 sees its replica down");

        let (status, h) = complete(&http, a1.addr, &text("cross-region", 1024), &[]).await;
        assert_eq!(status, 200);
        assert_eq!(header(&h, "x-kvmesh-forwarded-to"), "b1");
        assert_eq!(header(&h, "x-kvmesh-hop"), "1", "b1 saw the hop header");
        assert_eq!(header(&h, ROUTED), "rb0");
        let forwards = |n: &RunningNode| -> u64 {
            n.node.mesh_slot().metrics.get().map_or(0, |m| {
                ["a", "b"]
                    .iter()
                    .map(|r| m.forwards.with_label_values(&[r, "ok"]).get())
                    .sum()
            })
        };
        assert_eq!(forwards(&a1), 2);
        assert_eq!(forwards(&b1), 0, "exactly one hop");

        // A client cannot claim its request hopped already (that would keep it from being
        // forwarded): the header is stripped and the request forwarded as any other.
        let (status, h) = complete(
            &http,
            a1.addr,
            &text("cross-region", 1024),
            &[("x-kvmesh-hop", "1")],
        )
        .await;
        assert_eq!(status, 200);
        assert_eq!(header(&h, "x-kvmesh-forwarded-to"), "b1");
        assert_eq!(forwards(&a1), 3);

        // A peer can, over the mesh's mutual TLS: a request that already hopped is never
        // forwarded again.
        let id = kvmesh::mesh::certs::NodeIdentity::load_dir(dir.path(), "b1").unwrap();
        let (_, tls) = kvmesh::mesh::peer_tls::https_configs(&id).unwrap();
        let peer = reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .build()
            .unwrap();
        let peer_url = format!("https://{}/v1/completions", a1.peer_addr.unwrap());
        let resp = peer
            .post(&peer_url)
            .header("x-kvmesh-hop", "1")
            .json(&json!({"model": MODEL, "prompt": text("hopped", 1024), "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 503);
        assert_eq!(forwards(&a1), 3);
        // Without a cluster certificate the peer listener does not talk at all.
        let stranger = reqwest::Client::builder()
            .tls_danger_accept_invalid_certs(true)
            .build()
            .unwrap();
        assert!(stranger.get(&peer_url).send().await.is_err());

        for n in [a1, b1] {
            n.shutdown().await;
        }
        rb.shutdown().await;
    })
    .await;
}

/// Sends every prompt to `node` at once; each must be answered, forwarded to `peer`.
async fn burst_forwarded_to(c: &reqwest::Client, node: SocketAddr, prompts: &[String], peer: &str) {
    let answers =
        futures::future::join_all(prompts.iter().map(|p| complete(c, node, p, &[]))).await;
    for (k, (status, h)) in answers.iter().enumerate() {
        assert_eq!(*status, 200, "request {k} at {node}");
        assert_eq!(header(h, "x-kvmesh-forwarded-to"), peer);
    }
}

/// A node opens its connection to the node it would forward to in another region before any
/// forward, and a burst of forwards shares it: one handshake across the regions, not one per
/// request in flight (each costs a round trip between regions; 3.7–4.4 s instead of 2 in the
/// demo's wire test, regions 2 s apart). A node that does not warm its connections still
/// opens only one for a burst: peers speak HTTP/2, so the burst waits for one handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwards_share_one_connection_opened_before_the_first() {
    bounded(30, async {
        let dir = common::cluster_ca();
        let rb = replica("rb0").await;
        // A node of region a without replicas: every request goes to region b.
        let a1 = mesh_node(dir.path(), "a1", "a", &[], &[]).await;
        let mut cold = mesh_config(dir.path(), "a2", "a", &[mesh_addr(&a1)], &[], None);
        if let Some(m) = cold.mesh.as_mut() {
            m.warm_forward_interval_ms = 0;
        }
        let a2 = proxy::spawn(cold).await.unwrap();
        // b1's peers reach it through a line that counts their connections.
        let line = DelayLine::start(Duration::ZERO).await.unwrap();
        let b1 = mesh_node_with(
            dir.path(),
            "b1",
            "b",
            &[mesh_addr(&a1)],
            &[(rb.id.clone(), rb.base_url())],
            Some(format!("https://{}", line.addr)),
        )
        .await;
        line.set_upstream(b1.peer_addr.unwrap());
        wait_for(Duration::from_secs(10), || {
            a1.node.ready() && region_offered(&a1, "b", 1)
        })
        .await
        .expect("a1 learns region b");
        // Within a second of learning b1, with no request yet.
        let warmed = wait_for(Duration::from_secs(5), || warmups(&a1.node, "ok") >= 1)
            .await
            .expect("a1 opens a connection to b1 before any forward");
        println!("a1 warmed its connection to b1 {warmed:?} after learning region b");
        assert_eq!(line.connections(), 1);

        let http = client();
        let prompts: Vec<String> = (0..8).map(|k| text(&format!("burst{k}"), 1024)).collect();
        burst_forwarded_to(&http, a1.addr, &prompts, "b1").await;
        assert_eq!(
            line.connections(),
            1,
            "eight forwards in flight at once share the warm connection"
        );
        assert_eq!(warmups(&a1.node, "failed"), 0);

        wait_for(Duration::from_secs(10), || region_offered(&a2, "b", 1))
            .await
            .expect("a2 learns region b");
        assert_eq!(warmups(&a2.node, "ok"), 0);
        assert_eq!(
            line.connections(),
            1,
            "a2 opened nothing before its first forward"
        );
        burst_forwarded_to(&http, a2.addr, &prompts, "b1").await;
        assert_eq!(
            line.connections(),
            2,
            "a cold node's burst of eight forwards opens one connection"
        );
        for n in [a1, a2, b1] {
            n.shutdown().await;
        }
        rb.shutdown().await;
    })
    .await;
}

/// A peer's certificate does not make any URL it names a place to send requests: a member that
/// advertises a plain `http://` address (a node's own configuration refuses one) gets no
/// connection, neither a warm-up nor a forward, since the peer client speaks only TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_naming_a_plain_http_url_gets_no_connection() {
    bounded(30, async {
        let dir = common::cluster_ca();
        let mut cfg = mesh_config(dir.path(), "a1", "a", &[], &[], None);
        if let Some(m) = cfg.mesh.as_mut() {
            // One cluster for both regions: b's member is a peer with its own URL.
            m.layout = kvmesh::node::config::mesh::LayoutConfig::Flat;
        }
        let a1 = proxy::spawn(cfg).await.unwrap();
        // Where the rogue points its peers, counting every connection made to it.
        let plain = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let plain_addr = plain.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&accepted);
        let server = tokio::spawn(async move {
            while let Ok((conn, _)) = plain.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                drop(conn);
            }
        });
        let rogue = rogue_member_with(dir.path(), "b9", "b", mesh_addr(&a1), |c| {
            c.layout = kvmesh::mesh::GossipLayout::Flat;
            c.http_url = format!("http://{plain_addr}");
        })
        .await;
        wait_for(Duration::from_secs(10), || {
            !a1.node.peers_in("b").is_empty()
        })
        .await
        .expect("a1 lists b9 as a peer of region b");
        wait_for(Duration::from_secs(5), || warmups(&a1.node, "failed") >= 1)
            .await
            .expect("a1 tries to warm b9 and fails");
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            0,
            "nothing reached b9's URL"
        );
        server.abort();
        drop(rogue);
        a1.shutdown().await;
    })
    .await;
}

/// An HTTPS address on loopback where nothing listens: a node advertising it has gone dark.
fn dead_https_url() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("https://127.0.0.1:{port}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_that_fails_at_one_node_goes_to_another_of_the_region() {
    bounded(30, async {
        let dir = common::cluster_ca();
        let rb = replica("rb0").await;
        let list = [(rb.id.clone(), rb.base_url())];
        // A node of region a without replicas: every request goes to region b.
        let a1 = mesh_node(dir.path(), "a1", "a", &[], &[]).await;
        let seed = [mesh_addr(&a1)];
        // b1 advertises an HTTP address where nothing listens; b2 is fine.
        let b1 = mesh_node_with(dir.path(), "b1", "b", &seed, &list, Some(dead_https_url())).await;
        let b2 = mesh_node(dir.path(), "b2", "b", &seed, &list).await;
        // Regional gossip: a1 knows region b by its record, naming both of b's nodes.
        wait_for(Duration::from_secs(10), || {
            a1.node.ready() && region_offered(&a1, "b", 2)
        })
        .await
        .expect("a1 learns region b");
        // Unmeasured nodes go last: the random order below needs an RTT to both (a loaded
        // machine can take a moment to connect to the second).
        wait_for(Duration::from_secs(10), || {
            let rtts = a1.node.mesh().map(|m| m.peer_rtts()).unwrap_or_default();
            let peers = a1.node.peers_in("b");
            peers.len() == 2 && peers.iter().all(|p| rtts.contains_key(&p.quic_addr))
        })
        .await
        .expect("a1 measures its RTT to both of b's nodes");
        let http = client();
        let m = a1.node.mesh_slot().metrics.get().unwrap();
        let retried = || m.forwards.with_label_values(&["b", "retry"]).get();
        // Nodes within one 5 ms step of RTT are tried in random order, so b1 comes first some
        // of the time; on a loaded machine their RTTs can sit a step apart for a while (then
        // the nearer one always goes first), so send until a forward met b1 first, at most 64.
        let mut sent = 0;
        while sent < 16 || (retried() == 0 && sent < 64) {
            let prompt = text(&format!("fo{sent}"), 1024);
            let (status, h) = complete(&http, a1.addr, &prompt, &[]).await;
            assert_eq!(status, 200, "request {sent}");
            assert_eq!(header(&h, "x-kvmesh-forwarded-to"), "b2");
            sent += 1;
        }
        let ok = m.forwards.with_label_values(&["b", "ok"]).get();
        println!(
            "{sent} forwards: {ok} ok, {} after a failed node",
            retried()
        );
        assert_eq!(ok, sent);
        assert!(retried() > 0, "no forward met b1 first in {sent}");
        for n in [a1, b1, b2] {
            n.shutdown().await;
        }
        rb.shutdown().await;
    })
    .await;
}

/// Issue #35: a node's record that points at another node's address does not redirect
/// forwards. b1 advertises b2's peer listener (b2 itself advertises a dead address): a forward
/// meant for b1 that reaches b2 is refused (counted `misdirected`) instead of being served as
/// b1's, so with b2 dark the region fails rather than answer through the wrong node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_reaching_another_node_than_the_one_meant_is_refused() {
    bounded(40, async {
        let dir = common::cluster_ca();
        let rb = replica("rb0").await;
        let list = [(rb.id.clone(), rb.base_url())];
        let a1 = mesh_node(dir.path(), "a1", "a", &[], &[]).await;
        let seed = [mesh_addr(&a1)];
        let b2 = mesh_node_with(dir.path(), "b2", "b", &seed, &list, Some(dead_https_url())).await;
        let b2_listener = format!("https://{}", b2.peer_addr.unwrap());
        let b1 = mesh_node_with(dir.path(), "b1", "b", &seed, &list, Some(b2_listener)).await;
        wait_for(Duration::from_secs(10), || {
            a1.node.ready() && region_offered(&a1, "b", 2)
        })
        .await
        .expect("a1 learns region b");
        let http = client();
        let (status, h) = complete(&http, a1.addr, &text("redirected", 1024), &[]).await;
        assert_eq!(
            status,
            503,
            "answered as {:?}",
            header(&h, "x-kvmesh-forwarded-to")
        );
        let m = a1.node.mesh_slot().metrics.get().unwrap();
        assert_eq!(m.forwards.with_label_values(&["b", "misdirected"]).get(), 1);
        assert_eq!(m.forwards.with_label_values(&["b", "ok"]).get(), 0);
        for n in [a1, b1, b2] {
            n.shutdown().await;
        }
        rb.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_whose_nodes_all_fail_gives_way_to_the_next_region() {
    bounded(40, async {
        let dir = common::cluster_ca();
        let rb = replica("rb0").await;
        let rc = replica("rc0").await;
        // a1 has no replicas; region b is nearer than c, but its only node advertises an HTTP
        // address where nothing listens (a region gone dark whose record still stands).
        let mut cfg = mesh_config(dir.path(), "a1", "a", &[], &[], None);
        if let Some(m) = cfg.mesh.as_mut() {
            for (other, ms) in [("b", 10.0), ("c", 50.0)] {
                m.distance.push(kvmesh::node::config::DistanceConfig {
                    a: "a".into(),
                    b: other.into(),
                    ms,
                    kv_gb_per_s: None,
                    kv_setup_ms: None,
                });
            }
        }
        let a1 = proxy::spawn(cfg).await.unwrap();
        let seed = [mesh_addr(&a1)];
        let b1 = mesh_node_with(
            dir.path(),
            "b1",
            "b",
            &seed,
            &[(rb.id.clone(), rb.base_url())],
            Some(dead_https_url()),
        )
        .await;
        let c1 = mesh_node(
            dir.path(),
            "c1",
            "c",
            &seed,
            &[(rc.id.clone(), rc.base_url())],
        )
        .await;
        wait_for(Duration::from_secs(15), || {
            a1.node.ready() && region_offered(&a1, "b", 1) && region_offered(&a1, "c", 1)
        })
        .await
        .expect("a1 learns regions b and c");
        let http = client();
        let m = a1.node.mesh_slot().metrics.get().unwrap();
        let (status, h) = complete(&http, a1.addr, &text("dark-b-0", 1024), &[]).await;
        assert_eq!(status, 200);
        assert_eq!(header(&h, "x-kvmesh-forwarded-to"), "c1");
        assert_eq!(header(&h, ROUTED), "rc0");
        assert_eq!(m.forwards.with_label_values(&["b", "unavailable"]).get(), 1);
        // While b is marked, requests go to c at once: b is not tried again.
        for k in 1..6 {
            let (status, h) =
                complete(&http, a1.addr, &text(&format!("dark-b-{k}"), 1024), &[]).await;
            assert_eq!(status, 200, "request {k}");
            assert_eq!(header(&h, "x-kvmesh-forwarded-to"), "c1");
        }
        assert_eq!(m.forwards.with_label_values(&["b", "unavailable"]).get(), 1);
        assert_eq!(m.forwards.with_label_values(&["c", "ok"]).get(), 6);
        for n in [a1, b1, c1] {
            n.shutdown().await;
        }
        rb.shutdown().await;
        rc.shutdown().await;
    })
    .await;
}

/// Whether `n` knows `region` by its region record: an open replica of `MODEL`, and at least
/// `targets` nodes to forward to.
fn region_offered(n: &RunningNode, region: &str, targets: usize) -> bool {
    n.node.state().mesh.is_some_and(|m| {
        m.regions.iter().any(|r| {
            r.region == region
                && r.targets.len() >= targets
                && r.models
                    .iter()
                    .any(|(model, _, open, _)| model == MODEL && *open > 0)
        })
    })
}

/// Child processes killed on drop, whatever the test's outcome.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_processes_form_a_mesh_and_serve() {
    bounded(40, async {
        let dir = common::cluster_ca();
        for n in ["n1", "n2"] {
            kvmesh::mesh::certs::issue_in_dir(dir.path(), n).unwrap();
        }
        let bin = env!("CARGO_BIN_EXE_kvmesh");
        // Worktrees sharing one CARGO_TARGET_DIR overwrite each other's `target/debug/kvmesh`;
        // say so plainly instead of failing later on an unknown flag.
        let help = Command::new(bin).args(["serve", "--help"]).output().unwrap();
        assert!(
            String::from_utf8_lossy(&help.stdout).contains("--mesh-listen"),
            "{bin} is not this tree's build (another build in a shared target dir replaced it); rebuild and rerun"
        );
        let log = |name: &str| {
            Stdio::from(std::fs::File::create(dir.path().join(format!("{name}.log"))).unwrap())
        };
        let debug_cfg = dir.path().join("debug.toml");
        std::fs::write(&debug_cfg, "debug_headers = true\n").unwrap();
        let mut children = Children(Vec::new());
        let mut replica_urls = Vec::new();
        for i in 0..2 {
            let port = free_tcp_port();
            children.0.push(
                Command::new(bin)
                    .args(["replica", "--port", &port.to_string(), "--id"])
                    .arg(format!("p{i}"))
                    .args(["--time-scale", "50"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap(),
            );
            replica_urls.push(format!("http://127.0.0.1:{port}"));
        }
        let quic1 = free_udp_port();
        let mut http_addrs = Vec::new();
        for (i, name) in ["n1", "n2"].into_iter().enumerate() {
            let http_port = free_tcp_port();
            let quic = if i == 0 { quic1 } else { free_udp_port() };
            let mut cmd = Command::new(bin);
            cmd.args(["serve", "--listen"])
                .arg(format!("127.0.0.1:{http_port}"))
                // The test reads which replica served.
                .arg("--config")
                .arg(&debug_cfg)
                .args(["--region", "eu", "--node-id", name, "--certs-dir"])
                .arg(dir.path())
                .arg("--mesh-listen")
                .arg(format!("127.0.0.1:{quic}"));
            for u in &replica_urls {
                cmd.args(["--replica", u]);
            }
            if i > 0 {
                cmd.arg("--mesh-seed").arg(format!("127.0.0.1:{quic1}"));
            }
            children.0.push(
                cmd.stdout(Stdio::null())
                    .stderr(log(name))
                    .spawn()
                    .unwrap(),
            );
            http_addrs.push(format!("127.0.0.1:{http_port}"));
        }
        let http = client();
        for addr in &http_addrs {
            let t0 = Instant::now();
            loop {
                let ready = http
                    .get(format!("http://{addr}/ready"))
                    .send()
                    .await
                    .is_ok_and(|r| r.status() == 200);
                if ready {
                    break;
                }
                if t0.elapsed() > Duration::from_secs(25) {
                    for n in ["n1", "n2"] {
                        let text = std::fs::read_to_string(dir.path().join(format!("{n}.log")));
                        println!("--- {n} ---\n{}", text.unwrap_or_default());
                    }
                    panic!("node {addr} never became ready");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        // Both nodes list each other.
        let t0 = Instant::now();
        loop {
            let s: NodeState = http
                .get(format!("http://{}/admin/state", http_addrs[1]))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let live = s.mesh.unwrap().members.iter().filter(|m| m.live).count();
            if live == 2 {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "nodes never met");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let (status, h) = complete(
            &http,
            http_addrs[1].parse().unwrap(),
            &text("process", 1024),
            &[],
        )
        .await;
        assert_eq!(status, 200);
        assert!(header(&h, ROUTED).starts_with("127.0.0.1:"));
        drop(children);
    })
    .await;
}

/// A plain `Mesh` member (no HTTP front, no replicas of its own) named `name`, seeded with
/// `seed`: stands for a member that publishes what it likes.
async fn rogue_member(certs: &Path, name: &str, seed: SocketAddr) -> kvmesh::mesh::Mesh {
    rogue_member_with(certs, name, "eu", seed, |_| {}).await
}

/// [`rogue_member`] of `region`, its configuration adjusted by `adjust`.
async fn rogue_member_with(
    certs: &Path,
    name: &str,
    region: &str,
    seed: SocketAddr,
    adjust: impl FnOnce(&mut kvmesh::mesh::MeshConfig),
) -> kvmesh::mesh::Mesh {
    common::rogue_member(
        "mesh-node-test",
        certs,
        name,
        region,
        seed,
        FAILURE_DETECTION_MS,
        adjust,
    )
    .await
}

fn rogue_record(url: String) -> kvmesh::mesh::schema::ReplicaRecord {
    use kvmesh::mesh::schema::{ReplicaRecord, SummaryVersion, WireHealth, WireLoad};
    ReplicaRecord {
        url,
        region: "eu".into(),
        zone: String::new(),
        pool: String::new(),
        models: vec![MODEL.into()],
        capacity_tokens: 100_000,
        prefill_tokens_per_s: 10_000.0,
        prefill_attention_ms_per_pair: None,
        max_in_flight: 64,
        health: WireHealth::Healthy,
        load: WireLoad::default(),
        summary: SummaryVersion {
            epoch: 1,
            seq: 0,
            digest: 0,
        },
        origin: String::new(),
        kv_events: None,
        pd: None,
        kv_shares: None,
        kv_load: None,
    }
}

/// `name{label="value"}`'s value in `n`'s `/metrics` (0 when absent).
async fn metric(c: &reqwest::Client, n: &RunningNode, series: &str) -> f64 {
    let text = c
        .get(format!("http://{}/metrics", n.addr))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0.0)
}

/// Issue #13: a member that publishes 300 `replica:` records with URLs outside the allow-list
/// (here: 10.66.x.y, while this node's own replicas and mesh are on loopback and
/// `learn_replicas_from` is empty) gets none of them learned — no health checks, scrapes or
/// prompts go there — even for the ids it is the rendezvous home of; each is counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_publishing_300_replicas_outside_the_allow_list_gets_none_learned() {
    bounded(60, async {
        let c = client();
        let certs = common::cluster_ca();
        let r = replica("own").await;
        let n1 = mesh_node(
            certs.path(),
            "n1",
            "eu",
            &[],
            &[("own".into(), r.base_url())],
        )
        .await;
        let rogue = rogue_member(certs.path(), "rogue", mesh_addr(&n1)).await;
        // Ids the rogue is home of: only the allow-list stands in the way.
        let ids: Vec<String> = (0..)
            .map(|i| format!("bogus-{i}"))
            .filter(|id| kvmesh::mesh::home::home_node(id, ["n1", "rogue"]) == Some("rogue"))
            .take(300)
            .collect();
        for (k, id) in ids.iter().enumerate() {
            let url = format!("http://10.66.{}.{}:8000", k / 256, k % 256);
            rogue
                .publish_replica(id, &rogue_record(url), RecordChange::Full)
                .await
                .unwrap();
        }
        rogue
            .publish_homes(&kvmesh::mesh::schema::HomesRecord {
                count: 300,
                round: 1,
            })
            .await
            .unwrap();
        let series = "kvmesh_mesh_records_ignored_total{reason=\"not_allowed\"}";
        let t0 = Instant::now();
        while metric(&c, &n1, series).await < 300.0 {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "not all 300 were refused: {} (replicas: {})",
                metric(&c, &n1, series).await,
                n1.node.replica_count()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // A few more rounds: still only its own replica, and each record counted once.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(live_members(&n1).contains(&"rogue".to_owned()));
        assert_eq!(n1.node.replica_count(), 1, "a bogus replica was learned");
        let ids_seen: Vec<String> = n1.node.state().replicas.into_iter().map(|r| r.id).collect();
        assert_eq!(ids_seen, vec!["own".to_owned()]);
        assert_eq!(metric(&c, &n1, series).await, 300.0);
        let (status, _) = complete(&c, n1.addr, "hello", &[]).await;
        assert_eq!(status, 200);
        rogue.shutdown().await;
        n1.shutdown().await;
        r.shutdown().await;
    })
    .await;
}

/// Issue #13: only a replica's rendezvous home may publish its record. A member that is not the
/// home of replica `r` publishes a record for it claiming it unhealthy and swamped: the node
/// that routes to `r` (a follower: another node is `r`'s home) ignores it, counts it, keeps
/// routing there, and never pulls a summary from the impostor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_record_published_by_a_non_home_is_ignored() {
    use kvmesh::mesh::home::home_node;
    bounded(60, async {
        let c = client();
        let certs = common::cluster_ca();
        let nodes = ["n1", "n2", "rogue"];
        // A replica whose home is n2 among the three.
        let id = (0..)
            .map(|i| format!("r{i}"))
            .find(|id| home_node(id, nodes) == Some("n2"))
            .unwrap();
        let r = replica(&id).await;
        let n1 = mesh_node(certs.path(), "n1", "eu", &[], &[(id.clone(), r.base_url())]).await;
        let n2 = mesh_node(certs.path(), "n2", "eu", &[mesh_addr(&n1)], &[]).await;
        // n2 is a verified member before the rogue comes: otherwise, for a moment, the rogue
        // would rightly be the home among the members n1 knows (and its epoch would stick).
        wait_for(Duration::from_secs(10), || {
            live_members(&n1).contains(&"n2".to_owned())
        })
        .await
        .expect("n1 sees n2");
        let rogue = rogue_member(certs.path(), "rogue", mesh_addr(&n1)).await;
        // The impostor's record: unhealthy, swamped, with a newer summary to pull from it; and
        // an URL nobody can learn (so n2, the home, never takes it from there).
        let mut rec = rogue_record("ftp://rogue.example/".into());
        rec.health = kvmesh::mesh::schema::WireHealth::Unhealthy;
        rec.load.waiting = 50_000;
        // An hour ahead: plausible (epochs beyond a day ahead are refused at decoding).
        let in_an_hour = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
            + 3_600_000;
        rec.summary.epoch = in_an_hour;
        rogue
            .publish_replica(&id, &rec, RecordChange::Full)
            .await
            .unwrap();
        let t0 = Instant::now();
        let series = "kvmesh_mesh_records_ignored_total{reason=\"not_home\"}";
        while metric(&c, &n1, series).await < 1.0 {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "the non-home record was never ignored: members {:?}",
                live_members(&n1)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // For several rounds after: n1 sees n2 as the home, the replica healthy with its own
        // figures, no summary at the impostor's epoch, and requests are served there.
        let t1 = Instant::now();
        while t1.elapsed() < Duration::from_millis(1500) {
            let st = n1.node.state();
            let rs = st.replicas.iter().find(|x| x.id == id).unwrap();
            assert_eq!(rs.health, "healthy", "the impostor's health was applied");
            assert!(rs.waiting < 50_000, "the impostor's load was applied");
            let home = homes(&n1).into_iter().find(|(x, _)| *x == id).unwrap().1;
            assert!(home.is_empty() || home == "n2", "home {home}");
            // No summary pulled from the impostor (n2, the home, may have moved above its epoch).
            assert!(view_version(&n1, &id).is_none_or(|v| v != (in_an_hour, rec.summary.seq)));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let (status, h) = complete(&c, n1.addr, "hello there", &[]).await;
        assert_eq!((status, header(&h, ROUTED)), (200, id.clone()));
        rogue.shutdown().await;
        n2.shutdown().await;
        n1.shutdown().await;
        r.shutdown().await;
    })
    .await;
}

/// A tenant's `max_cluster_share` holds across the mesh: the requests it has open at one node
/// count at the others (through the gossiped `inflight` records), so N nodes do not allow N
/// times the share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_share_of_the_cluster_holds_across_nodes() {
    bounded(30, async {
        let dir = common::cluster_ca();
        // Real-time replicas: a long completion stays in flight.
        let mut reps = Vec::new();
        for id in ["r0", "r1"] {
            reps.push(replica_with(id, |c| c.engine.time_scale = 1.0).await);
        }
        let list: Vec<(String, String)> =
            reps.iter().map(|r| (r.id.clone(), r.base_url())).collect();
        let with_quota = |mut cfg: NodeConfig| {
            for r in &mut cfg.replicas {
                r.max_in_flight = 4;
            }
            // 8 slots in the cluster: acme may hold 2.
            cfg.tenants.insert(
                "acme".into(),
                kvmesh::core::tenants::TenantConfig {
                    max_cluster_share: Some(0.25),
                    ..Default::default()
                },
            );
            cfg
        };
        let a = proxy::spawn(with_quota(mesh_config(
            dir.path(),
            "a",
            "eu",
            &[],
            &list,
            None,
        )))
        .await
        .unwrap();
        let seed = [mesh_addr(&a)];
        let b = proxy::spawn(with_quota(mesh_config(
            dir.path(),
            "b",
            "eu",
            &seed,
            &list,
            None,
        )))
        .await
        .unwrap();
        wait_for(Duration::from_secs(10), || a.node.ready() && b.node.ready())
            .await
            .expect("the mesh never became ready");
        let http = client();
        let open = |addr: SocketAddr, n: usize| {
            http.post(format!("http://{addr}/v1/completions"))
                .header("x-tenant-id", "acme")
                .json(
                    &json!({"model": MODEL, "prompt": text(&format!("long {n}"), 512),
                              "max_tokens": 4000, "stream": true}),
                )
                .send()
        };
        // Two long streams at a: acme's whole share.
        let mut held = Vec::new();
        for n in 0..2 {
            let resp = open(a.addr, n).await.unwrap();
            assert_eq!(resp.status(), 200);
            held.push(resp);
        }
        // b learns them within a few gossip rounds and refuses a third.
        let mut refused = false;
        for n in 2..40 {
            let resp = open(b.addr, n).await.unwrap();
            if resp.status() == 429 {
                refused = true;
                break;
            }
            drop(resp);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(refused, "b never counted a's requests against acme's share");
        drop(held);
        for n in [a, b] {
            n.shutdown().await;
        }
        for r in reps {
            r.shutdown().await;
        }
    })
    .await;
}

/// A replica learned from gossip follows its engine's KV events where it is homed: its record
/// carries the event ports (at the replica URL's host), so whichever node becomes its home
/// subscribes, and no other node does (not even the one whose configuration names them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_home_of_a_learned_replica_follows_its_kv_events() {
    bounded(40, async {
        let dir = common::cluster_ca();
        let mut reps = Vec::new();
        for i in 0..3 {
            let events = |c: &mut ReplicaConfig| {
                c.kv_events = Some(kvmesh::replica::config::KvEventsConfig::default())
            };
            reps.push(replica_with(&format!("k{i}"), events).await);
        }
        let list: Vec<(String, String)> =
            reps.iter().map(|r| (r.id.clone(), r.base_url())).collect();
        let mut a_cfg = mesh_config(dir.path(), "a", "eu", &[], &list, None);
        for (r, h) in a_cfg.replicas.iter_mut().zip(&reps) {
            r.kv_events = Some(kvmesh::node::config::KvEventsSource {
                endpoint: format!("tcp://127.0.0.1:{}", h.kv_events_port.unwrap()),
                replay: h.kv_replay_port.map(|p| format!("tcp://127.0.0.1:{p}")),
                ..kvmesh::node::config::KvEventsSource::new("")
            });
        }
        let a = proxy::spawn(a_cfg).await.unwrap();
        let seed = [mesh_addr(&a)];
        // b and c have no replicas of their own: they learn a's.
        let b = mesh_node(dir.path(), "b", "eu", &seed, &[]).await;
        let c = mesh_node(dir.path(), "c", "eu", &seed, &[]).await;
        let nodes = [("a", &a), ("b", &b), ("c", &c)];
        wait_for(Duration::from_secs(15), || {
            nodes.iter().all(|(_, n)| {
                n.node.ready()
                    && n.node.state().mesh.is_some_and(|m| {
                        m.replicas.len() == 3 && m.replicas.iter().all(|r| !r.home.is_empty())
                    })
            })
        })
        .await
        .expect("every node knows every replica and its home");
        let homes: Vec<(String, String)> = a
            .node
            .state()
            .mesh
            .unwrap()
            .replicas
            .iter()
            .map(|r| (r.id.clone(), r.home.clone()))
            .collect();
        let learned_homes: Vec<_> = homes.iter().filter(|(_, h)| h != "a").collect();
        assert!(
            !learned_homes.is_empty(),
            "every replica is homed at its origin: {homes:?}"
        );
        let source = |n: &RunningNode, id: &str| {
            n.node
                .state()
                .replicas
                .iter()
                .find(|r| r.id == id)
                .map(|r| r.cache_source.clone())
                .unwrap_or_default()
        };
        for (id, home) in &learned_homes {
            let (_, home_node) = nodes.iter().find(|(name, _)| name == home).unwrap();
            let t = wait_for(Duration::from_secs(10), || source(home_node, id) == "exact").await;
            assert!(t.is_some(), "{id}'s home {home} never followed its events");
            // Followers, its origin included, leave the events to the home.
            for (name, n) in &nodes {
                if name != home {
                    let t =
                        wait_for(Duration::from_secs(3), || source(n, id) == "approximate").await;
                    assert!(
                        t.is_some(),
                        "{id} at {name}, a follower, follows its events"
                    );
                }
            }
        }
        for n in [a, b, c] {
            n.shutdown().await;
        }
        for r in reps {
            r.shutdown().await;
        }
    })
    .await;
}

/// With API keys on every node, a forwarded request keeps the tenant its key named: the
/// forwarding node checked the key and passes the tenant over the mesh's mutual TLS (the
/// client's key itself stays at the first node).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_tenants_survive_forwarding() {
    bounded(30, async {
        let dir = common::cluster_ca();
        let rb = replica("rb0").await;
        let keys = dir.path().join("api-keys");
        std::fs::write(&keys, "acme sk-acme-0123456789abcdef\n").unwrap();
        let with_keys = |mut cfg: NodeConfig| {
            cfg.auth.api_keys_file = Some(keys.clone());
            // Only acme's pool may serve acme: a request without its tenant would be refused.
            cfg.tenants.insert(
                "acme".into(),
                kvmesh::core::tenants::TenantConfig {
                    pools: vec!["gold".into()],
                    ..Default::default()
                },
            );
            for r in &mut cfg.replicas {
                r.pool = "gold".into();
            }
            cfg
        };
        // a1 has no replicas: everything is forwarded to b1.
        let a1 = proxy::spawn(with_keys(mesh_config(
            dir.path(),
            "a1",
            "a",
            &[],
            &[],
            None,
        )))
        .await
        .unwrap();
        let seed = [mesh_addr(&a1)];
        let b1 = proxy::spawn(with_keys(mesh_config(
            dir.path(),
            "b1",
            "b",
            &seed,
            &[(rb.id.clone(), rb.base_url())],
            None,
        )))
        .await
        .unwrap();
        wait_for(Duration::from_secs(10), || {
            a1.node.ready() && region_offered(&a1, "b", 1)
        })
        .await
        .expect("a1 learns region b's replica");
        let http = client();
        let resp = http
            .post(format!("http://{}/v1/completions", a1.addr))
            .bearer_auth("sk-acme-0123456789abcdef")
            .json(&json!({"model": MODEL, "prompt": text("keyed", 512), "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{:?}", resp.text().await);
        let resp = http
            .post(format!("http://{}/v1/completions", a1.addr))
            .json(&json!({"model": MODEL, "prompt": text("keyless", 512), "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 401);
        for n in [a1, b1] {
            n.shutdown().await;
        }
        rb.shutdown().await;
    })
    .await;
}
