//! Kubernetes replica discovery end to end, on loopback: a node whose only replica source is a
//! `[[kubernetes]]` table pointed at a fake API server (axum, real HTTP: a LIST answered as an
//! `EndpointSliceList`, a WATCH as a chunked stream of newline-delimited events), in front of
//! simulated replicas (`kvmesh::replica`). The slices are the captured shapes of
//! `tests/data/k8s-endpointslice-list.json` with loopback addresses and ports put in; the 410
//! event is the captured one of `tests/data/k8s-endpointslice-watch.jsonl`.

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
use common::k8s::{self, complete, health, metric, metrics, text, url, wait_health, MODEL, ROUTED};
use common::{client, sim_replica};

const LIMIT: Duration = Duration::from_secs(40);
const LIST_DATA: &str = include_str!("data/k8s-endpointslice-list.json");
const WATCH_DATA: &str = include_str!("data/k8s-endpointslice-watch.jsonl");
const COLLECTION: &str = "/apis/discovery.k8s.io/v1/namespaces/serving/endpointslices";

async fn bounded<F: Future>(f: F) -> F::Output {
    common::bounded(LIMIT.as_secs(), f).await
}

/// Simulated replicas, `time_scale` times faster than real time.
async fn replicas(n: usize, time_scale: f64) -> Vec<ReplicaHandle> {
    let mut out = Vec::new();
    for i in 0..n {
        out.push(sim_replica(&format!("r{i}"), |c| c.engine.time_scale = time_scale).await);
    }
    out
}

/// The replica id the node gives pod `pod` at `r`.
fn id_of(pod: &str, r: &ReplicaHandle) -> String {
    format!("{pod}@{}", r.addr)
}

/// An EndpointSlice named `name` holding pod `pod` at `r`'s address, its port as `http`: item 0
/// of the captured list with its endpoints and ports replaced. `conditions` as the API writes
/// them (`ready`, `serving`, `terminating`).
fn slice(name: &str, pod: &str, r: &ReplicaHandle, ready: bool, terminating: bool) -> Value {
    let list: Value = serde_json::from_str(LIST_DATA).unwrap();
    let mut s = list["items"][0].clone();
    s["metadata"]["name"] = json!(name);
    let mut ep = s["endpoints"][0].clone();
    ep["addresses"] = json!([r.addr.ip().to_string()]);
    ep["targetRef"]["name"] = json!(pod);
    ep["conditions"] =
        json!({"ready": ready, "serving": ready || terminating, "terminating": terminating});
    s["endpoints"] = json!([ep]);
    s["ports"] = json!([
        {"name": "http", "port": r.addr.port(), "protocol": "TCP"},
        {"name": "metrics", "port": 9, "protocol": "TCP"},
    ]);
    s
}

/// A fake kube-apiserver for one namespace's EndpointSlices.
#[derive(Default)]
struct FakeApi {
    slices: Mutex<BTreeMap<String, Value>>,
    rv: AtomicUsize,
    watchers: Mutex<Vec<mpsc::UnboundedSender<Bytes>>>,
    lists: AtomicUsize,
    watches: AtomicUsize,
    /// The label selectors asked for.
    selectors: Mutex<Vec<String>>,
    /// Answer the next WATCH with HTTP 410 Gone.
    gone_once: AtomicBool,
    /// Shut down: answer every request 503. A graceful shutdown keeps serving a keep-alive
    /// connection's request already on its way, so a WATCH re-opened just as the server went
    /// away would otherwise stay open (and the source never see the outage).
    down: AtomicBool,
}

impl FakeApi {
    /// Stores (or deletes) a slice and sends the event to every open watch.
    fn event(&self, kind: &str, mut object: Value) {
        let rv = self.rv.fetch_add(1, Ordering::SeqCst) + 1;
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        let name = object["metadata"]["name"].as_str().unwrap().to_owned();
        {
            let mut slices = self.slices.lock().unwrap();
            if kind == "DELETED" {
                slices.remove(&name);
            } else {
                slices.insert(name, object.clone());
            }
        }
        let line = json!({"type": kind, "object": object}).to_string();
        self.send_line(&line);
    }

    /// Changes a slice without telling the watches (only a re-LIST can see it).
    fn set_silently(&self, object: Value) {
        self.rv.fetch_add(1, Ordering::SeqCst);
        let name = object["metadata"]["name"].as_str().unwrap().to_owned();
        self.slices.lock().unwrap().insert(name, object);
    }

    /// Sends one raw line to every open watch.
    fn send_line(&self, line: &str) {
        let bytes = Bytes::from(format!("{line}\n"));
        self.watchers
            .lock()
            .unwrap()
            .retain(|w| w.send(bytes.clone()).is_ok());
    }

    /// Waits (≤ 5 s) until a watch is open, so that an event sent next reaches the node (this
    /// fake, unlike the API server, does not replay events from a resourceVersion).
    async fn wait_watch(&self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.watchers.lock().unwrap().is_empty() {
            assert!(Instant::now() < deadline, "no watch opened");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Ends every open watch (as the API server does at `timeoutSeconds`).
    fn end_watches(&self) {
        self.watchers.lock().unwrap().clear();
    }
}

async fn endpointslices(
    State(api): State<Arc<FakeApi>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    api.selectors
        .lock()
        .unwrap()
        .push(q.get("labelSelector").cloned().unwrap_or_default());
    if api.down.load(Ordering::SeqCst) {
        return axum::http::StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    if q.get("watch").map(String::as_str) == Some("1") {
        api.watches.fetch_add(1, Ordering::SeqCst);
        if api.gone_once.swap(false, Ordering::SeqCst) {
            let status = json!({"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",
                "message":"too old resource version","reason":"Expired","code":410});
            return (axum::http::StatusCode::GONE, axum::Json(status)).into_response();
        }
        let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
        {
            // `down` is read under the watchers' lock, so `shutdown` (down, then clear) ends
            // every watch, however this races with it.
            let mut watchers = api.watchers.lock().unwrap();
            if api.down.load(Ordering::SeqCst) {
                return axum::http::StatusCode::SERVICE_UNAVAILABLE.into_response();
            }
            watchers.push(tx);
        }
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|b| (Ok::<_, std::io::Error>(b), rx))
        });
        return Response::builder()
            .header("content-type", "application/json")
            .body(Body::from_stream(stream))
            .unwrap();
    }
    api.lists.fetch_add(1, Ordering::SeqCst);
    let items: Vec<Value> = api.slices.lock().unwrap().values().cloned().collect();
    axum::Json(json!({
        "kind": "EndpointSliceList",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"resourceVersion": api.rv.load(Ordering::SeqCst).to_string()},
        "items": items,
    }))
    .into_response()
}

/// A running fake API server; `shutdown` takes it away (listener closed, watches ended).
struct FakeServer {
    api: Arc<FakeApi>,
    addr: std::net::SocketAddr,
    stop: Option<oneshot::Sender<()>>,
}

impl FakeServer {
    async fn start(slices: Vec<Value>) -> Self {
        let api = Arc::new(FakeApi::default());
        for s in slices {
            api.set_silently(s);
        }
        let app = axum::Router::new()
            .route(COLLECTION, get(endpointslices))
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

/// A node on 127.0.0.1:0 whose only replica source is the fake API server's `vllm` Service.
async fn node_for(api: &FakeServer) -> RunningNode {
    k8s::node_for(
        "namespace = \"serving\"\nservice = \"vllm\"\nport_name = \"http\"",
        api.addr,
    )
    .await
}

/// (1) The LIST's ready endpoints become routable replicas and a not-ready one does not; (2) an
/// ADDED slice adds its endpoint, and a MODIFIED one turning ready adds that one.
#[tokio::test]
async fn listed_endpoints_route_and_added_or_readied_ones_join() {
    bounded(async {
        let reps = replicas(3, 50.0).await;
        let mut api = FakeServer::start(vec![
            slice("vllm-a", "vllm-0", &reps[0], true, false),
            slice("vllm-b", "vllm-1", &reps[1], false, false),
        ])
        .await;
        let node = node_for(&api).await;
        let c = client();
        let ids: Vec<String> = ["vllm-0", "vllm-1", "vllm-2"]
            .iter()
            .zip(&reps)
            .map(|(p, r)| id_of(p, r))
            .collect();

        let h = health(&c, &node).await;
        assert_eq!(h.get(&ids[0]).map(String::as_str), Some("healthy"), "{h:?}");
        assert!(
            !h.contains_key(&ids[1]),
            "a not-ready endpoint is not registered: {h:?}"
        );
        for i in 0..6 {
            assert_eq!(
                complete(&c, &node, &text(&format!("l{i}"), 600)).await,
                (200, ids[0].clone())
            );
        }
        assert_eq!(api.api.lists.load(Ordering::SeqCst), 1);
        assert!(api
            .api
            .selectors
            .lock()
            .unwrap()
            .iter()
            .all(|s| s == "kubernetes.io/service-name=vllm"));

        // (2) A new slice, then the not-ready endpoint turning ready: both join.
        api.api.wait_watch().await;
        api.api
            .event("ADDED", slice("vllm-c", "vllm-2", &reps[2], true, false));
        wait_health(&c, &node, &ids[2], "healthy").await;
        api.api
            .event("MODIFIED", slice("vllm-b", "vllm-1", &reps[1], true, false));
        wait_health(&c, &node, &ids[1], "healthy").await;
        let mut served = std::collections::BTreeSet::new();
        for i in 0..60 {
            let (status, r) = complete(&c, &node, &text(&format!("a{i}"), 600)).await;
            assert_eq!(status, 200);
            served.insert(r);
            if served.len() == 3 {
                break;
            }
        }
        assert_eq!(served.len(), 3, "every endpoint serves: {served:?}");
        assert_eq!(
            api.api.lists.load(Ordering::SeqCst),
            1,
            "events, not re-lists"
        );

        node.shutdown().await;
        api.shutdown();
        for r in reps {
            r.shutdown().await;
        }
    })
    .await;
}

/// (3) An endpoint that starts terminating (ready false, still serving) drains: a stream in
/// flight on it finishes, new requests go elsewhere; a DELETED slice drains its endpoint too.
#[tokio::test]
async fn a_terminating_endpoint_drains_while_its_stream_finishes() {
    bounded(async {
        // Real time: a 600-token stream takes seconds.
        let reps = replicas(2, 1.0).await;
        let mut api = FakeServer::start(vec![
            slice("vllm-a", "vllm-0", &reps[0], true, false),
            slice("vllm-b", "vllm-1", &reps[1], true, false),
        ])
        .await;
        let node = node_for(&api).await;
        let c = client();
        let ids = [id_of("vllm-0", &reps[0]), id_of("vllm-1", &reps[1])];
        wait_health(&c, &node, &ids[0], "healthy").await;
        wait_health(&c, &node, &ids[1], "healthy").await;

        let resp = c
            .post(url(&node, "/v1/completions"))
            .json(&json!({"model": MODEL, "prompt": text("long", 400), "max_tokens": 600, "stream": true}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let busy = resp.headers()[ROUTED].to_str().unwrap().to_owned();
        let (k, other) = if busy == ids[0] { (0, 1) } else { (1, 0) };
        let stream = tokio::spawn(async move { resp.text().await });

        let name = ["vllm-a", "vllm-b"][k];
        let pod = ["vllm-0", "vllm-1"][k];
        api.api.wait_watch().await;
        api.api.event("MODIFIED", slice(name, pod, &reps[k], false, true));
        wait_health(&c, &node, &busy, "draining").await;
        assert!(!stream.is_finished(), "the stream should still be in flight when the drain shows");
        for i in 0..6 {
            assert_eq!(
                complete(&c, &node, &text(&format!("n{i}"), 600)).await,
                (200, ids[other].clone()),
                "nothing new goes to a terminating endpoint"
            );
        }
        let body = stream.await.unwrap().unwrap();
        assert!(body.trim_end().ends_with("data: [DONE]"), "the stream in flight finished: …{}", &body[body.len().saturating_sub(200)..]);

        // The other slice is deleted: its endpoint drains too, and nothing is left to route to.
        let name = ["vllm-a", "vllm-b"][other];
        let pod = ["vllm-0", "vllm-1"][other];
        api.api.event("DELETED", slice(name, pod, &reps[other], true, false));
        wait_health(&c, &node, &ids[other], "draining").await;
        let (status, _) = complete(&c, &node, &text("none", 600)).await;
        assert_eq!(status, 503);

        node.shutdown().await;
        api.shutdown();
        for r in reps {
            r.shutdown().await;
        }
    })
    .await;
}

/// (4) An ERROR event with code 410 and a WATCH answered 410 Gone each make the source re-list
/// (and the re-list shows what no event said); malformed lines are dropped and counted; (5) the
/// API server going away keeps the last set routable.
#[tokio::test]
async fn expired_watches_relist_and_an_api_outage_keeps_the_set() {
    bounded(async {
        let reps = replicas(3, 50.0).await;
        let mut api =
            FakeServer::start(vec![slice("vllm-a", "vllm-0", &reps[0], true, false)]).await;
        let node = node_for(&api).await;
        let c = client();
        let ids: Vec<String> = ["vllm-0", "vllm-1", "vllm-2"]
            .iter()
            .zip(&reps)
            .map(|(p, r)| id_of(p, r))
            .collect();
        wait_health(&c, &node, &ids[0], "healthy").await;
        api.api.wait_watch().await;

        // Garbage on the stream is dropped and counted, and the watch goes on.
        api.api.send_line("this is not json");
        api.api
            .send_line(r#"{"type":"ADDED","object":{"metadata":{}}}"#);
        // vllm-1 appears without an event: only a re-list can find it.
        api.api
            .set_silently(slice("vllm-b", "vllm-1", &reps[1], true, false));
        let expired = WATCH_DATA
            .lines()
            .find(|l| l.contains("\"code\":410"))
            .unwrap();
        api.api.send_line(expired);
        wait_health(&c, &node, &ids[1], "healthy").await;
        assert_eq!(
            api.api.lists.load(Ordering::SeqCst),
            2,
            "the 410 event re-listed"
        );
        let m = metrics(&c, &node).await;
        assert_eq!(
            metric(
                &m,
                "kvmesh_k8s_dropped_total{reason=\"malformed_event\",source=\"serving/vllm\"}"
            ),
            1.0,
            "{m}"
        );
        assert_eq!(
            metric(
                &m,
                "kvmesh_k8s_dropped_total{reason=\"bad_slice\",source=\"serving/vllm\"}"
            ),
            1.0,
            "{m}"
        );

        // The next WATCH is answered 410 Gone: a re-list again.
        api.api
            .set_silently(slice("vllm-c", "vllm-2", &reps[2], true, false));
        api.api.gone_once.store(true, Ordering::SeqCst);
        api.api.end_watches();
        wait_health(&c, &node, &ids[2], "healthy").await;
        assert_eq!(
            api.api.lists.load(Ordering::SeqCst),
            3,
            "the 410 answer re-listed"
        );

        // (5) The API server goes away: the source fails to reconnect, and keeps every replica.
        api.shutdown();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let m = metrics(&c, &node).await;
            if metric(&m, "kvmesh_k8s_watch_errors_total{source=\"serving/vllm\"}") >= 2.0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the source never noticed the outage: {m}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let h = health(&c, &node).await;
        for id in &ids {
            assert_eq!(h.get(id).map(String::as_str), Some("healthy"), "{h:?}");
        }
        let mut served = std::collections::BTreeSet::new();
        for i in 0..30 {
            let (status, r) = complete(&c, &node, &text(&format!("o{i}"), 600)).await;
            assert_eq!(status, 200);
            served.insert(r);
        }
        assert!(
            served.len() >= 2,
            "still routing across the kept set: {served:?}"
        );

        node.shutdown().await;
        for r in reps {
            r.shutdown().await;
        }
    })
    .await;
}
