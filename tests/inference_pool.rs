//! InferencePool discovery end to end, on loopback: a node whose only replica source is a
//! `[[kubernetes]]` table with `inference_pool`, pointed at a fake API server (axum, real HTTP)
//! that serves an `InferencePool` collection and a pod collection — LISTs filtered by the label
//! and field selectors asked for, WATCHes as chunked streams of newline-delimited events — in
//! front of simulated replicas (`kvmesh::replica`) on 127.0.0.1 and 127.0.0.2. The objects are
//! `tests/data/k8s-inferencepool.json` and item 0 of `tests/data/k8s-pod-list.json` with
//! loopback addresses, ports and labels put in.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use kvmesh::proxy::RunningNode;
use kvmesh::replica::ReplicaHandle;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

mod common;
use common::k8s::{self, complete, health, metric, metrics, text, wait_health};
use common::{client, sim_replica};

const LIMIT: Duration = Duration::from_secs(40);
const POOL_DATA: &str = include_str!("data/k8s-inferencepool.json");
const PODS_DATA: &str = include_str!("data/k8s-pod-list.json");
const POOLS: &str = "/apis/inference.networking.k8s.io/v1/namespaces/serving/inferencepools";
const PODS: &str = "/api/v1/namespaces/serving/pods";

async fn bounded<F: Future>(f: F) -> F::Output {
    common::bounded(LIMIT.as_secs(), f).await
}

/// A simulated replica `id` on `host` (port `port`, 0 for any), 50× faster than real time.
async fn replica_at(id: &str, host: &str, port: u16) -> ReplicaHandle {
    sim_replica(id, |c| {
        c.host = host.into();
        c.port = port;
    })
    .await
}

/// The example pool named `llama`, selecting `labels`, at `ports`.
fn pool(labels: Value, ports: &[u16]) -> Value {
    let mut p: Value = serde_json::from_str(POOL_DATA).unwrap();
    p["metadata"]["name"] = json!("llama");
    p["spec"]["selector"]["matchLabels"] = labels;
    p["spec"]["targetPorts"] = ports.iter().map(|n| json!({"number": n})).collect();
    p
}

/// Pod `name` at `ip` with label `app`, ready or not, terminating or not: item 0 of the
/// example list with these put in.
fn pod(name: &str, ip: &str, app: &str, ready: bool, terminating: bool) -> Value {
    let list: Value = serde_json::from_str(PODS_DATA).unwrap();
    let mut p = list["items"][0].clone();
    p["metadata"]["name"] = json!(name);
    p["metadata"]["labels"] = json!({"app": app});
    if terminating {
        p["metadata"]["deletionTimestamp"] = json!("2026-12-01T10:00:00Z");
    }
    p["status"]["podIP"] = json!(ip);
    p["status"]["podIPs"] = json!([{"ip": ip}]);
    for c in p["status"]["conditions"].as_array_mut().unwrap() {
        if c["type"] == "Ready" || c["type"] == "ContainersReady" {
            c["status"] = json!(if ready { "True" } else { "False" });
        }
    }
    p
}

/// Whether `object` matches a `k=v,…` label selector and a `metadata.name=x` field selector.
fn matches(object: &Value, labels: &str, fields: &str) -> bool {
    let label_ok = labels.split(',').filter(|s| !s.is_empty()).all(|kv| {
        let (k, v) = kv.split_once('=').unwrap();
        object["metadata"]["labels"][k].as_str() == Some(v)
    });
    let field_ok = match fields.strip_prefix("metadata.name=") {
        Some(name) => object["metadata"]["name"].as_str() == Some(name),
        None => fields.is_empty(),
    };
    label_ok && field_ok
}

/// One fake collection: its objects, open watches (with their selectors), what was asked.
#[derive(Default)]
struct Collection {
    objects: Mutex<BTreeMap<String, Value>>,
    watchers: Mutex<Vec<(String, String, mpsc::UnboundedSender<Bytes>)>>,
    lists: AtomicUsize,
    /// (labelSelector, fieldSelector) of every request.
    asked: Mutex<Vec<(String, String)>>,
}

/// A fake kube-apiserver for one namespace's InferencePools and pods.
#[derive(Default)]
struct FakeApi {
    pools: Collection,
    pods: Collection,
    rv: AtomicUsize,
    /// Shut down: answer every request 503 (see tests/k8s_discovery.rs).
    down: AtomicBool,
}

impl FakeApi {
    fn collection(&self, pods: bool) -> &Collection {
        if pods {
            &self.pods
        } else {
            &self.pools
        }
    }

    /// Stores (or deletes) an object and sends the event to every open watch it matches.
    fn event(&self, pods: bool, kind: &str, mut object: Value) {
        let rv = self.rv.fetch_add(1, Ordering::SeqCst) + 1;
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        let c = self.collection(pods);
        let name = object["metadata"]["name"].as_str().unwrap().to_owned();
        if kind == "DELETED" {
            c.objects.lock().unwrap().remove(&name);
        } else {
            c.objects.lock().unwrap().insert(name, object.clone());
        }
        let line = Bytes::from(format!("{}\n", json!({"type": kind, "object": object})));
        c.watchers
            .lock()
            .unwrap()
            .retain(|(l, f, w)| !matches(&object, l, f) || w.send(line.clone()).is_ok());
    }

    /// Changes an object without telling the watches.
    fn set_silently(&self, pods: bool, object: Value) {
        self.rv.fetch_add(1, Ordering::SeqCst);
        let name = object["metadata"]["name"].as_str().unwrap().to_owned();
        self.collection(pods)
            .objects
            .lock()
            .unwrap()
            .insert(name, object);
    }

    /// Sends a raw line to every open watch of a collection.
    fn send_line(&self, pods: bool, line: &str) {
        let bytes = Bytes::from(format!("{line}\n"));
        self.collection(pods)
            .watchers
            .lock()
            .unwrap()
            .retain(|(_, _, w)| w.send(bytes.clone()).is_ok());
    }

    /// Waits (≤ 5 s) until a watch of the collection is open under label selector `labels`.
    async fn wait_watch(&self, pods: bool, labels: &str) {
        let deadline = Instant::now() + Duration::from_secs(5);
        let c = self.collection(pods);
        while !c
            .watchers
            .lock()
            .unwrap()
            .iter()
            .any(|(l, _, _)| l == labels)
        {
            assert!(Instant::now() < deadline, "no watch opened for {labels:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn end_watches(&self) {
        self.pools.watchers.lock().unwrap().clear();
        self.pods.watchers.lock().unwrap().clear();
    }
}

async fn serve(api: &FakeApi, pods: bool, q: HashMap<String, String>) -> Response {
    let c = api.collection(pods);
    let labels = q.get("labelSelector").cloned().unwrap_or_default();
    let fields = q.get("fieldSelector").cloned().unwrap_or_default();
    c.asked
        .lock()
        .unwrap()
        .push((labels.clone(), fields.clone()));
    if api.down.load(Ordering::SeqCst) {
        return axum::http::StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    if q.get("watch").map(String::as_str) == Some("1") {
        let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
        {
            let mut watchers = c.watchers.lock().unwrap();
            if api.down.load(Ordering::SeqCst) {
                return axum::http::StatusCode::SERVICE_UNAVAILABLE.into_response();
            }
            watchers.push((labels, fields, tx));
        }
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|b| (Ok::<_, std::io::Error>(b), rx))
        });
        return Response::builder()
            .header("content-type", "application/json")
            .body(Body::from_stream(stream))
            .unwrap();
    }
    c.lists.fetch_add(1, Ordering::SeqCst);
    let items: Vec<Value> = c
        .objects
        .lock()
        .unwrap()
        .values()
        .filter(|o| matches(o, &labels, &fields))
        .cloned()
        .collect();
    axum::Json(json!({
        "kind": if pods { "PodList" } else { "InferencePoolList" },
        "metadata": {"resourceVersion": api.rv.load(Ordering::SeqCst).to_string()},
        "items": items,
    }))
    .into_response()
}

async fn pools_route(
    State(api): State<Arc<FakeApi>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    serve(&api, false, q).await
}

async fn pods_route(
    State(api): State<Arc<FakeApi>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    serve(&api, true, q).await
}

/// A running fake API server; `shutdown` takes it away.
struct FakeServer {
    api: Arc<FakeApi>,
    addr: std::net::SocketAddr,
    stop: Option<oneshot::Sender<()>>,
}

impl FakeServer {
    async fn start(pools: Vec<Value>, pods: Vec<Value>) -> Self {
        let api = Arc::new(FakeApi::default());
        for p in pools {
            api.set_silently(false, p);
        }
        for p in pods {
            api.set_silently(true, p);
        }
        let app = axum::Router::new()
            .route(POOLS, get(pools_route))
            .route(PODS, get(pods_route))
            .with_state(Arc::clone(&api));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await;
        });
        FakeServer {
            api,
            addr,
            stop: Some(stop),
        }
    }

    fn shutdown(&mut self) {
        self.api.down.store(true, Ordering::SeqCst);
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.api.end_watches();
    }
}

/// A node on 127.0.0.1:0 whose only replica source is the fake API server's pool `llama`.
async fn node_for(api: &FakeServer) -> RunningNode {
    k8s::node_for(
        "namespace = \"serving\"\ninference_pool = \"llama\"",
        api.addr,
    )
    .await
}

/// The replicas that serve some of `n` distinct requests.
async fn served_by(c: &reqwest::Client, node: &RunningNode, seed: &str, n: usize) -> Vec<String> {
    let mut served = std::collections::BTreeSet::new();
    for i in 0..n {
        let (status, r) = complete(c, node, &text(&format!("{seed}{i}"), 600)).await;
        assert_eq!(status, 200);
        served.insert(r);
    }
    served.into_iter().collect()
}

/// (1) The pool's ready pod becomes one replica per target port, found under the pool's
/// selector (asked for the pool by name); (2) the pool dropping a port drains that replica;
/// (3) a new selector re-lists the pods under it; (4) the pool deleted drains everything.
#[tokio::test]
async fn a_pools_pod_serves_on_every_target_port_and_the_pool_steers_discovery() {
    bounded(async {
        let r0 = replica_at("r0", "127.0.0.1", 0).await;
        let r1 = replica_at("r1", "127.0.0.1", 0).await;
        let (p0, p1) = (r0.addr.port(), r1.addr.port());
        let r2 = replica_at("r2", "127.0.0.2", p1).await;
        let mut api = FakeServer::start(
            vec![pool(json!({"app": "vllm"}), &[p0, p1])],
            vec![
                pod("vllm-0", "127.0.0.1", "vllm", true, false),
                pod("other-0", "127.0.0.2", "other", true, false),
            ],
        )
        .await;
        let node = node_for(&api).await;
        let c = client();
        let id0 = format!("vllm-0@127.0.0.1:{p0}");
        let id1 = format!("vllm-0@127.0.0.1:{p1}");
        let id2 = format!("other-0@127.0.0.2:{p1}");

        // (1) Both ports of the one selected pod serve; the other pod is not selected.
        wait_health(&c, &node, &id0, "healthy").await;
        wait_health(&c, &node, &id1, "healthy").await;
        assert!(!health(&c, &node).await.contains_key(&id2));
        let mut served = served_by(&c, &node, "a", 8).await;
        for i in 0..40 {
            if served.len() == 2 {
                break;
            }
            served = served_by(&c, &node, &format!("b{i}"), 4).await;
        }
        assert_eq!(served.len(), 2, "both ranks serve: {served:?}");
        let asked = |pods: bool| api.api.collection(pods).asked.lock().unwrap().clone();
        assert!(asked(false)
            .iter()
            .all(|(l, f)| l.is_empty() && f == "metadata.name=llama"));
        assert!(asked(true)
            .iter()
            .all(|(l, f)| l == "app=vllm" && f.is_empty()));

        // (2) The pool keeps only the second port: the first port's replica drains.
        api.api.wait_watch(false, "").await;
        api.api
            .event(false, "MODIFIED", pool(json!({"app": "vllm"}), &[p1]));
        wait_health(&c, &node, &id0, "draining").await;
        assert_eq!(served_by(&c, &node, "c", 6).await, vec![id1.clone()]);

        // (3) A new selector: the pods are re-listed under it; the old pod drains.
        let lists = api.api.pods.lists.load(Ordering::SeqCst);
        api.api
            .event(false, "MODIFIED", pool(json!({"app": "other"}), &[p1]));
        wait_health(&c, &node, &id2, "healthy").await;
        wait_health(&c, &node, &id1, "draining").await;
        assert_eq!(api.api.pods.lists.load(Ordering::SeqCst), lists + 1);
        assert_eq!(asked(true).last().unwrap().0, "app=other");
        assert_eq!(served_by(&c, &node, "d", 6).await, vec![id2.clone()]);

        // (4) The pool is deleted: its pods drain, nothing is left to route to.
        api.api
            .event(false, "DELETED", pool(json!({"app": "other"}), &[p1]));
        wait_health(&c, &node, &id2, "draining").await;
        assert_eq!(complete(&c, &node, &text("none", 600)).await.0, 503);

        node.shutdown().await;
        api.shutdown();
        for r in [r0, r1, r2] {
            r.shutdown().await;
        }
    })
    .await;
}

/// (5) A pod turning ready joins and a terminating one drains; (6) a 410 on the pods' watch
/// re-lists (and the list shows what no event said); (7) the API server going away keeps the
/// last set routable.
#[tokio::test]
async fn pods_join_and_drain_with_their_state_and_an_outage_keeps_the_set() {
    bounded(async {
        let r0 = replica_at("r0", "127.0.0.1", 0).await;
        let port = r0.addr.port();
        let r1 = replica_at("r1", "127.0.0.2", port).await;
        let r2 = replica_at("r2", "127.0.0.3", port).await;
        let mut api = FakeServer::start(
            vec![pool(json!({"app": "vllm"}), &[port])],
            vec![
                pod("vllm-0", "127.0.0.1", "vllm", true, false),
                pod("vllm-1", "127.0.0.2", "vllm", false, false),
            ],
        )
        .await;
        let node = node_for(&api).await;
        let c = client();
        let ids: Vec<String> = (0..3)
            .map(|i| format!("vllm-{i}@127.0.0.{}:{port}", i + 1))
            .collect();
        wait_health(&c, &node, &ids[0], "healthy").await;
        assert!(!health(&c, &node).await.contains_key(&ids[1]), "not ready: not registered");

        // (5) Ready joins; terminating drains.
        api.api.wait_watch(true, "app=vllm").await;
        api.api
            .event(true, "MODIFIED", pod("vllm-1", "127.0.0.2", "vllm", true, false));
        wait_health(&c, &node, &ids[1], "healthy").await;
        api.api
            .event(true, "MODIFIED", pod("vllm-0", "127.0.0.1", "vllm", true, true));
        wait_health(&c, &node, &ids[0], "draining").await;
        assert_eq!(served_by(&c, &node, "t", 6).await, vec![ids[1].clone()]);

        // (6) A pod appears without an event; the watch's 410 makes the source re-list.
        let lists = api.api.pods.lists.load(Ordering::SeqCst);
        api.api
            .set_silently(true, pod("vllm-2", "127.0.0.3", "vllm", true, false));
        api.api.send_line(
            true,
            r#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"too old resource version: 1 (48311)","reason":"Expired","code":410}}"#,
        );
        wait_health(&c, &node, &ids[2], "healthy").await;
        assert_eq!(api.api.pods.lists.load(Ordering::SeqCst), lists + 1);

        // (7) The API server goes away: both collections fail to reconnect; the set stays.
        api.shutdown();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let m = metrics(&c, &node).await;
            let errors = metric(
                &m,
                "kvmesh_k8s_watch_errors_total{source=\"serving/inferencepool/llama\"}",
            );
            if errors >= 2.0 {
                break;
            }
            assert!(Instant::now() < deadline, "the source never noticed the outage: {m}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let h = health(&c, &node).await;
        for id in &ids[1..] {
            assert_eq!(h.get(id).map(String::as_str), Some("healthy"), "{h:?}");
        }
        let served = served_by(&c, &node, "o", 30).await;
        assert_eq!(served.len(), 2, "still routing across the kept set: {served:?}");

        node.shutdown().await;
        for r in [r0, r1, r2] {
            r.shutdown().await;
        }
    })
    .await;
}
