//! Priority classes and the admission queue end to end, on loopback sockets: a node with
//! `[priorities]` in front of one upstream that takes one request at a time (`max_in_flight =
//! 1`) and answers only when the test lets it, so which request gets a freed slot is
//! deterministic.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::{get, post};
use common::{bounded, client, wait_for};
use kvmesh::node::config::{NodeConfig, ReplicaConfig as NodeReplica};
use kvmesh::proxy::{self, RunningNode};
use serde_json::{json, Value};

const LIMIT: Duration = Duration::from_secs(10);

/// The upstream: records each completion's prompt in arrival order and answers it only when
/// the test adds a permit.
struct Gate {
    order: Arc<Mutex<Vec<String>>>,
    permits: Arc<tokio::sync::Semaphore>,
}

async fn gated_upstream() -> (SocketAddr, Gate) {
    let order = Arc::new(Mutex::new(Vec::new()));
    let permits = Arc::new(tokio::sync::Semaphore::new(0));
    let (o, p) = (order.clone(), permits.clone());
    let completion = move |axum::Json(body): axum::Json<Value>| {
        let (o, p) = (o.clone(), p.clone());
        async move {
            let prompt = body["prompt"].as_str().unwrap_or("?").to_owned();
            o.lock().unwrap().push(prompt.clone());
            if let Ok(permit) = p.acquire().await {
                permit.forget();
            }
            axum::Json(json!({"object":"text_completion","choices":[{"text":prompt}]}))
        }
    };
    let app = axum::Router::new()
        .route("/v1/completions", post(completion))
        .route("/health", get(|| async { "ok" }))
        .route(
            "/v1/models",
            get(|| async { axum::Json(json!({"object":"list","data":[{"id":"m"}]})) }),
        )
        .route(
            "/metrics",
            get(|| async {
                "vllm:num_requests_waiting{model_name=\"m\"} 0\n\
                 vllm:num_requests_running{model_name=\"m\"} 0\n"
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, Gate { order, permits })
}

/// Classes: critical (weight 16), batch (weight 1, waits up to 10 s) and short (waits 300 ms);
/// every tenant runs batch and may ask for anything up to critical.
async fn node(upstream: SocketAddr) -> RunningNode {
    let mut cfg = NodeConfig::from_toml(
        r#"
        listen = "127.0.0.1:0"
        drain_s = 1
        [priorities]
        default_class = "batch"
        classes = [
          { name = "critical", weight = 16, max_wait_ms = 10000 },
          { name = "batch", weight = 1, max_wait_ms = 10000 },
          { name = "short", weight = 1, max_wait_ms = 300 },
        ]
        [default_tenant]
        max_priority = "critical"
        [tenants.capped]
        priority = "batch"
        "#,
    )
    .unwrap();
    cfg.health.interval_ms = 100;
    cfg.scrape.interval_ms = 100;
    cfg.replicas = vec![NodeReplica {
        id: Some("r0".into()),
        models: vec!["m".into()],
        max_in_flight: 1,
        ..NodeReplica::from_url(format!("http://{upstream}"))
    }];
    proxy::spawn(cfg).await.unwrap()
}

async fn metrics(c: &reqwest::Client, n: &RunningNode) -> String {
    c.get(format!("http://{}/metrics", n.addr))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Nothing in flight at the replica (the last response's ticket dropped).
fn idle(n: &RunningNode) -> bool {
    n.node
        .lock()
        .view
        .replica(0)
        .is_some_and(|r| r.load.in_flight == 0)
}

fn waiting(n: &RunningNode) -> usize {
    n.node.lock().admission.as_ref().map_or(0, |q| q.len())
}

#[tokio::test]
async fn a_freed_slot_goes_to_critical_first_deadlines_refuse_and_a_gone_client_frees_its_place() {
    bounded(20, async {
        let (addr, gate) = gated_upstream().await;
        let n = node(addr).await;
        let c = client();
        let send = |prompt: &str, class: &str, tenant: &str| {
            let req = c
                .post(format!("http://{}/v1/completions", n.addr))
                .header("x-kvmesh-priority", class)
                .header("x-tenant-id", tenant)
                .json(&json!({"model":"m","prompt":prompt}));
            tokio::spawn(req.send())
        };
        let order = |k: usize| {
            let seen = gate.order.clone();
            wait_for(LIMIT, move || seen.lock().unwrap().len() >= k)
        };

        // A holds the only slot; B (batch), then C (critical) wait.
        let a = send("A", "batch", "t");
        assert!(order(1).await.is_some());
        let b = send("B", "batch", "t");
        assert!(wait_for(LIMIT, || waiting(&n) == 1).await.is_some());
        // A tenant capped at batch cannot promote itself with the header: it waits behind B.
        let d = send("D", "critical", "capped");
        assert!(wait_for(LIMIT, || waiting(&n) == 2).await.is_some());
        let cr = send("C", "critical", "t");
        assert!(wait_for(LIMIT, || waiting(&n) == 3).await.is_some());
        let m = metrics(&c, &n).await;
        assert!(m.contains("kvmesh_queue_waiting{class=\"batch\"} 2"), "{m}");
        assert!(
            m.contains("kvmesh_queue_waiting{class=\"critical\"} 1"),
            "{m}"
        );

        // A finishes: its slot goes to C, arrived last but critical; then B, then D.
        for k in 2..=4 {
            gate.permits.add_permits(1);
            assert!(order(k).await.is_some());
        }
        assert_eq!(*gate.order.lock().unwrap(), ["A", "C", "B", "D"]);
        gate.permits.add_permits(1);
        for h in [a, cr, b, d] {
            assert_eq!(h.await.unwrap().unwrap().status(), 200);
        }

        assert!(wait_for(LIMIT, || idle(&n)).await.is_some());
        // E holds the slot; F in the short class passes its 300 ms deadline: 429, Retry-After.
        let e = send("E", "batch", "t");
        assert!(order(5).await.is_some());
        let f = send("F", "short", "t").await.unwrap().unwrap();
        assert_eq!(f.status(), 429);
        assert!(f.headers().contains_key("retry-after"), "{:?}", f.headers());
        let v: Value = f.json().await.unwrap();
        assert_eq!(v["error"]["type"], "rate_limit_error");
        assert_eq!(v["error"]["code"], "priority_queue_timeout");

        // G's client gives up while it waits: its place frees, so the slot E frees goes to H.
        let g = c
            .post(format!("http://{}/v1/completions", n.addr))
            .timeout(Duration::from_millis(300))
            .json(&json!({"model":"m","prompt":"G"}))
            .send()
            .await;
        assert!(g.is_err(), "G timed out on the client side");
        assert!(wait_for(LIMIT, || waiting(&n) == 0).await.is_some());
        let h = send("H", "batch", "t");
        assert!(wait_for(LIMIT, || waiting(&n) == 1).await.is_some());
        gate.permits.add_permits(1);
        assert!(order(6).await.is_some());
        assert_eq!(gate.order.lock().unwrap()[5], "H");
        gate.permits.add_permits(1);
        assert_eq!(e.await.unwrap().unwrap().status(), 200);
        assert_eq!(h.await.unwrap().unwrap().status(), 200);

        let m = metrics(&c, &n).await;
        for line in [
            "kvmesh_queue_rejected_total{class=\"short\",reason=\"expired\"} 1",
            "kvmesh_queue_rejected_total{class=\"batch\",reason=\"client_left\"} 1",
            "kvmesh_queue_admitted_total{class=\"critical\"} 1",
            "kvmesh_queue_admitted_total{class=\"batch\"} 3",
            "kvmesh_queue_waiting{class=\"batch\"} 0",
        ] {
            assert!(m.contains(line), "{line} in {m}");
        }
        n.shutdown().await;
    })
    .await;
}
