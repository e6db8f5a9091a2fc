//! OpenTelemetry trace export, end to end on loopback: a node (and a two-region mesh) in front of
//! fake replicas that record the `traceparent` they receive, exporting OTLP/HTTP protobuf to an
//! in-test collector (axum on 127.0.0.1, `POST /v1/traces`, decoded with `opentelemetry-proto`).
//!
//! The export pipeline is process-wide, as in `kvmesh serve`: installed once here, with its own
//! collector on a thread of its own (tests run on separate runtimes). Each test tells its spans
//! apart by the trace id it chose. Every test is bounded by `tokio::time::timeout`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use kvmesh::node::config::{MeshSection, NodeConfig, ReplicaConfig, TracingConfig};
use kvmesh::proxy::{self, otel, RunningNode};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message;
use serde_json::json;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

mod common;
use common::bounded;

const MODEL: &str = "fake-model";

/// One exported span, as the collector decoded it (ids in lowercase hex).
#[derive(Clone, Debug)]
struct Exported {
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    name: String,
    /// OTLP `SpanKind`: 2 server, 3 client.
    kind: i32,
    attrs: HashMap<String, String>,
}

impl Exported {
    fn attr(&self, key: &str) -> &str {
        self.attrs.get(key).map_or("", String::as_str)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The in-test collector: everything it received.
static SPANS: Mutex<Vec<Exported>> = Mutex::new(Vec::new());

/// Starts (once) the collector on its own thread and runtime, and installs the export pipeline
/// pointing at it in this process's subscriber.
fn pipeline() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let app = axum::Router::new().route(
                    "/v1/traces",
                    post(|body: bytes::Bytes| async move {
                        let Ok(req) = ExportTraceServiceRequest::decode(body) else {
                            return StatusCode::BAD_REQUEST;
                        };
                        let mut out = SPANS.lock().unwrap();
                        for rs in req.resource_spans {
                            for ss in rs.scope_spans {
                                for s in ss.spans {
                                    let attrs = s
                                        .attributes
                                        .iter()
                                        .map(|kv| {
                                            let v = match kv
                                                .value
                                                .as_ref()
                                                .and_then(|v| v.value.as_ref())
                                            {
                                                Some(Value::StringValue(s)) => s.clone(),
                                                Some(Value::IntValue(i)) => i.to_string(),
                                                Some(Value::BoolValue(b)) => b.to_string(),
                                                Some(Value::DoubleValue(d)) => d.to_string(),
                                                other => format!("{other:?}"),
                                            };
                                            (kv.key.clone(), v)
                                        })
                                        .collect();
                                    out.push(Exported {
                                        trace_id: hex(&s.trace_id),
                                        span_id: hex(&s.span_id),
                                        parent_span_id: hex(&s.parent_span_id),
                                        name: s.name,
                                        kind: s.kind,
                                        attrs,
                                    });
                                }
                            }
                        }
                        StatusCode::OK
                    }),
                );
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                tx.send(listener.local_addr().unwrap()).unwrap();
                axum::serve(listener, app).await.unwrap();
            });
        });
        let addr = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        let p = otel::Pipeline::start(&tracing_cfg(addr))
            .unwrap()
            .expect("an endpoint turns tracing on");
        tracing_subscriber::registry()
            .with(p.layer())
            .try_init()
            .unwrap();
        // Lives as long as the test process; spans leave every 50 ms.
        std::mem::forget(p);
        COLLECTOR.set(addr).unwrap();
    });
}

static COLLECTOR: OnceLock<SocketAddr> = OnceLock::new();

fn tracing_cfg(collector: SocketAddr) -> TracingConfig {
    TracingConfig {
        otlp_endpoint: Some(format!("http://{collector}")),
        schedule_delay_ms: 50,
        export_timeout_ms: 2_000,
        ..TracingConfig::default()
    }
}

/// Waits until the collector holds at least `n` spans of `trace_id`, and returns them.
async fn spans_of(trace_id: &str, n: usize) -> Vec<Exported> {
    for _ in 0..200 {
        let found: Vec<Exported> = SPANS
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.trace_id == trace_id)
            .cloned()
            .collect();
        if found.len() >= n {
            return found;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("fewer than {n} spans of trace {trace_id} exported within 10 s");
}

fn one<'a>(spans: &'a [Exported], name: &str, node: Option<&str>) -> &'a Exported {
    let found: Vec<&Exported> = spans
        .iter()
        .filter(|s| s.name == name && node.is_none_or(|n| s.attr("kvmesh.node") == n))
        .collect();
    assert_eq!(found.len(), 1, "one {name} span at {node:?}: {spans:#?}");
    found[0]
}

/// What a fake replica received: its id and the request's `traceparent` and `tracestate`.
type Seen = Arc<Mutex<Vec<(String, Option<String>, Option<String>)>>>;

/// A fake replica `id` that records the trace headers of each completion; while `fail_first`
/// (shared) is above 0 it answers 503 and counts it down.
async fn replica(id: &str, seen: &Seen, fail_first: &Arc<AtomicUsize>) -> SocketAddr {
    let (id, seen, fail) = (id.to_owned(), Arc::clone(seen), Arc::clone(fail_first));
    let completion = move |headers: HeaderMap| {
        let (id, seen, fail) = (id.clone(), Arc::clone(&seen), Arc::clone(&fail));
        async move {
            let h = |n: &str| {
                headers
                    .get(n)
                    .map(|v| v.to_str().unwrap_or("<binary>").to_owned())
            };
            seen.lock()
                .unwrap()
                .push((id, h("traceparent"), h("tracestate")));
            let failing = fail
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            if failing {
                return (StatusCode::SERVICE_UNAVAILABLE, "{}".to_owned());
            }
            (
                StatusCode::OK,
                json!({"choices": [{"text": "ok"}]}).to_string(),
            )
        }
    };
    let app = axum::Router::new()
        .route("/v1/completions", post(completion))
        .route("/health", get(|| async { "ok" }))
        .route(
            "/v1/models",
            get(|| async { axum::Json(json!({"object": "list", "data": [{"id": MODEL}]})) }),
        )
        .route("/metrics", get(|| async { "" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

fn node_cfg(replicas: &[(&str, SocketAddr)], traced: bool) -> NodeConfig {
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        debug_headers: true,
        drain_s: 2,
        ..NodeConfig::default()
    };
    cfg.health.interval_ms = 100;
    cfg.timeouts.first_byte_ms = 5_000;
    cfg.replicas = replicas
        .iter()
        .map(|(id, addr)| ReplicaConfig {
            id: Some((*id).into()),
            ..ReplicaConfig::from_url(format!("http://{addr}"))
        })
        .collect();
    if traced {
        cfg.tracing = tracing_cfg(*COLLECTOR.get().unwrap());
    }
    cfg
}

fn client() -> reqwest::Client {
    proxy::install_crypto_provider();
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// A completion at `node` with `headers`; returns the status and response headers.
async fn complete(
    c: &reqwest::Client,
    node: SocketAddr,
    prompt: &str,
    headers: &[(&str, &str)],
) -> (u16, reqwest::header::HeaderMap) {
    let mut req = c
        .post(format!("http://{node}/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 4}));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let h = resp.headers().clone();
    let _ = resp.bytes().await.unwrap();
    (status, h)
}

fn header(h: &reqwest::header::HeaderMap, name: &str) -> String {
    h.get(name)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
}

/// `traceparent` → (trace id, parent id, flags).
fn parts(tp: &str) -> (String, String, String) {
    let p: Vec<&str> = tp.split('-').collect();
    assert_eq!(p.len(), 4, "a W3C traceparent: {tp}");
    assert_eq!(p[0], "00");
    (p[1].into(), p[2].into(), p[3].into())
}

/// A 1024-byte prompt (four 256-byte blocks) starting with `seed`.
fn prompt(seed: &str) -> String {
    let mut s = seed.to_owned();
    while s.len() < 1024 {
        s.push_str(" lorem ipsum");
    }
    s.truncate(1024);
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routed_request_continues_the_clients_trace_with_its_decision() {
    pipeline();
    bounded(30, async {
        let seen: Seen = Arc::default();
        let fail_first = Arc::new(AtomicUsize::new(1));
        let r0 = replica("r0", &seen, &fail_first).await;
        let r1 = replica("r1", &seen, &fail_first).await;
        let node = proxy::spawn(node_cfg(&[("r0", r0), ("r1", r1)], true))
            .await
            .unwrap();
        let http = client();
        let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
        let client_span = "00f067aa0ba902b7";
        let tp = format!("00-{trace}-{client_span}-01");
        let text = prompt("traced");

        // The first attempt gets a 503 (the replicas' shared first answer): retried elsewhere.
        let (status, h) = complete(
            &http,
            node.addr,
            &text,
            &[
                ("traceparent", &tp),
                ("tracestate", "vendor=x"),
                ("x-tenant-id", "acme"),
            ],
        )
        .await;
        assert_eq!(status, 200);
        let served_by = header(&h, "x-kvmesh-routed-to");
        let spans = spans_of(trace, 3).await;
        let route = one(&spans, "kvmesh.route", None);
        assert_eq!(
            route.parent_span_id, client_span,
            "child of the client's span"
        );
        assert_eq!(route.kind, 2, "server");
        assert_eq!(route.attr("kvmesh.policy"), "p2c-cache");
        assert_eq!(route.attr("kvmesh.replica"), served_by);
        assert_eq!(route.attr("kvmesh.attempts"), "2");
        assert_eq!(route.attr("kvmesh.model"), MODEL);
        assert_eq!(route.attr("kvmesh.tenant"), "acme");
        assert_eq!(
            route.attr("kvmesh.hit_blocks"),
            header(&h, "x-kvmesh-hit-blocks")
        );
        assert_eq!(route.attr("http.response.status_code"), "200");
        assert!(!route.attr("kvmesh.branch").is_empty());
        let mut upstream: Vec<&Exported> = spans
            .iter()
            .filter(|s| s.name == "kvmesh.upstream")
            .collect();
        upstream.sort_by_key(|s| s.attr("kvmesh.attempt").to_owned());
        assert_eq!(upstream.len(), 2, "one client span per attempt: {spans:#?}");
        for (s, status) in upstream.iter().zip(["503", "200"]) {
            assert_eq!(s.parent_span_id, route.span_id);
            assert_eq!(s.kind, 3, "client");
            assert_eq!(s.attr("http.response.status_code"), status);
        }
        assert_eq!(upstream[1].attr("kvmesh.replica"), served_by);

        // Each replica saw the trace, its attempt's span as parent, the client's state kept.
        let got = seen.lock().unwrap().clone();
        assert_eq!(got.len(), 2);
        for ((_, tp_seen, state), span) in got.iter().zip(&upstream) {
            let (t, parent, flags) = parts(tp_seen.as_deref().expect("a traceparent"));
            assert_eq!(t, trace);
            assert_ne!(parent, client_span);
            assert_eq!(
                parent, span.span_id,
                "the attempt's span is the replica's parent"
            );
            assert_eq!(flags, "01");
            assert_eq!(state.as_deref(), Some("vendor=x"));
        }

        // The same prompt again, in a new trace: a cache hit, one attempt.
        let trace2 = "0af7651916cd43dd8448eb211c80319c";
        let tp2 = format!("00-{trace2}-b7ad6b7169203331-01");
        let (status, h) = complete(&http, node.addr, &text, &[("traceparent", &tp2)]).await;
        assert_eq!(status, 200);
        let spans = spans_of(trace2, 2).await;
        let route = one(&spans, "kvmesh.route", None);
        assert_eq!(route.attr("kvmesh.branch"), "cache");
        assert_eq!(route.attr("kvmesh.hit_blocks"), "4");
        assert_eq!(
            route.attr("kvmesh.hit_blocks"),
            header(&h, "x-kvmesh-hit-blocks")
        );
        assert!(route.attr("kvmesh.hit_tokens").parse::<u64>().unwrap() > 0);
        assert_eq!(route.attr("kvmesh.attempts"), "1");
        assert_eq!(
            route.attr("kvmesh.replica"),
            header(&h, "x-kvmesh-routed-to")
        );
        assert!(node.shutdown().await);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_traceparent_starts_a_new_trace() {
    pipeline();
    bounded(30, async {
        let seen: Seen = Arc::default();
        let r0 = replica("r0", &seen, &Arc::default()).await;
        let node = proxy::spawn(node_cfg(&[("r0", r0)], true)).await.unwrap();
        let bad = "00-zzzz-not-hex-01";
        let (status, _) = complete(
            &client(),
            node.addr,
            &prompt("bad"),
            &[("traceparent", bad)],
        )
        .await;
        assert_eq!(status, 200);
        let got = seen.lock().unwrap().clone();
        let tp = got[0]
            .1
            .clone()
            .expect("the node's traceparent replaces the bad one");
        let (trace, parent, _) = parts(&tp);
        assert_ne!(trace, "0".repeat(32));
        let spans = spans_of(&trace, 2).await;
        let route = one(&spans, "kvmesh.route", None);
        assert_eq!(route.parent_span_id, "", "a root span");
        assert_eq!(one(&spans, "kvmesh.upstream", None).span_id, parent);
        assert!(node.shutdown().await);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_tracing_passes_trace_headers_untouched_and_exports_nothing() {
    pipeline();
    bounded(30, async {
        let seen: Seen = Arc::default();
        let r0 = replica("r0", &seen, &Arc::default()).await;
        let node = proxy::spawn(node_cfg(&[("r0", r0)], false)).await.unwrap();
        let http = client();
        let trace = "11111111111111111111111111111111";
        let tp = format!("00-{trace}-2222222222222222-01");
        let (status, _) = complete(
            &http,
            node.addr,
            &prompt("untraced"),
            &[("traceparent", &tp), ("tracestate", "k=v")],
        )
        .await;
        assert_eq!(status, 200);
        let (status, _) = complete(&http, node.addr, &prompt("none"), &[]).await;
        assert_eq!(status, 200);
        let got = seen.lock().unwrap().clone();
        assert_eq!(got[0].1.as_deref(), Some(tp.as_str()), "untouched");
        assert_eq!(got[0].2.as_deref(), Some("k=v"));
        assert_eq!(
            (got[1].1.as_deref(), got[1].2.as_deref()),
            (None, None),
            "none added"
        );
        // Several export periods later, nothing of that trace arrived.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(SPANS.lock().unwrap().iter().all(|s| s.trace_id != trace));
        let metrics = http
            .get(format!("http://{}/metrics", node.addr))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            !metrics.contains("kvmesh_trace_spans"),
            "no trace metrics when off"
        );
        assert!(node.shutdown().await);
    })
    .await;
}

/// A mesh node `name` of `region` with `replicas`, seeded with `seeds`, tracing.
async fn mesh_node(
    certs: &std::path::Path,
    name: &str,
    region: &str,
    seeds: &[SocketAddr],
    replicas: &[(&str, SocketAddr)],
) -> RunningNode {
    kvmesh::mesh::certs::issue_in_dir(certs, name).unwrap();
    let mut cfg = node_cfg(replicas, true);
    cfg.region = region.into();
    cfg.cluster_id = "otel-test".into();
    cfg.mesh = Some(MeshSection {
        node_id: name.into(),
        listen: "127.0.0.1:0".parse().unwrap(),
        seeds: seeds.iter().map(|s| s.to_string()).collect(),
        certs_dir: Some(certs.to_owned()),
        gossip_interval_ms: 100,
        failure_detection_ms: 1_000,
        warmup_timeout_ms: 5_000,
        ..MeshSection::default()
    });
    proxy::spawn(cfg).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_request_is_one_trace_across_both_regions() {
    pipeline();
    bounded(30, async {
        let dir = tempfile::tempdir().unwrap();
        kvmesh::mesh::certs::init_dir(dir.path()).unwrap();
        let seen: Seen = Arc::default();
        let rb = replica("rb0", &seen, &Arc::default()).await;
        // Region a has no replica: every request goes to region b.
        let a1 = mesh_node(dir.path(), "a1", "a", &[], &[]).await;
        let seed = [a1.node.mesh().unwrap().addr()];
        let b1 = mesh_node(dir.path(), "b1", "b", &seed, &[("rb0", rb)]).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while !(a1.node.ready() && b1.node.ready()) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "a1 never learned region b"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let trace = "abcdefabcdefabcdefabcdefabcdef01";
        let client_span = "0123456789abcdef";
        let tp = format!("00-{trace}-{client_span}-01");
        let (status, h) =
            complete(&client(), a1.addr, &prompt("hop"), &[("traceparent", &tp)]).await;
        assert_eq!(status, 200);
        assert_eq!(header(&h, "x-kvmesh-forwarded-to"), "b1");
        let spans = spans_of(trace, 4).await;
        let a_route = one(&spans, "kvmesh.route", Some("a1"));
        let forward = one(&spans, "kvmesh.forward", None);
        let b_route = one(&spans, "kvmesh.route", Some("b1"));
        let upstream = one(&spans, "kvmesh.upstream", None);
        assert_eq!(a_route.parent_span_id, client_span);
        assert_eq!(a_route.attr("kvmesh.forwarded_region"), "b");
        assert_eq!(a_route.attr("kvmesh.branch"), "forward");
        assert_eq!(a_route.attr("kvmesh.forwarded_to"), "b1");
        assert_eq!(forward.parent_span_id, a_route.span_id);
        assert_eq!(forward.attr("kvmesh.peer"), "b1");
        assert_eq!(
            b_route.parent_span_id, forward.span_id,
            "b1 continues a1's trace"
        );
        assert_eq!(b_route.attr("kvmesh.hop"), "true");
        assert_eq!(b_route.attr("kvmesh.replica"), "rb0");
        assert_eq!(upstream.parent_span_id, b_route.span_id);
        let got = seen.lock().unwrap().clone();
        let (t, parent, _) = parts(got[0].1.as_deref().expect("a traceparent"));
        assert_eq!(
            (t.as_str(), parent.as_str()),
            (trace, upstream.span_id.as_str())
        );
        a1.shutdown().await;
        b1.shutdown().await;
    })
    .await;
}
