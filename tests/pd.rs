//! Prefill/decode disaggregation through a node, on real sockets: each protocol adapter against
//! simulated P/D replicas (a decode replica succeeds only if the fields the node sent let it pull
//! the prefill's KV), and against recording fakes that capture the legs' bodies and headers, so
//! the shapes are checked field by field; plus the retry rules (a prefill failure moves the
//! prefill; a decode failing after its first byte is not retried) and the bypass.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use common::{bounded, client, sim_replica};
use kvmesh::core::role::Role;
use kvmesh::node::config::{NodeConfig, PdProtocol, ReplicaConfig as NodeReplica};
use kvmesh::proxy::{self, RunningNode};
use kvmesh::replica::ReplicaHandle;
use serde_json::{json, Value};

const MODEL: &str = "sim-llama-8b";

fn replica_entry(id: &str, url: String, role: Role, bootstrap_port: Option<u16>) -> NodeReplica {
    NodeReplica {
        id: Some(id.into()),
        models: vec![MODEL.into()],
        role,
        bootstrap_port,
        ..NodeReplica::from_url(url)
    }
}

async fn node(protocol: PdProtocol, bypass: u64, replicas: Vec<NodeReplica>) -> RunningNode {
    proxy::install_crypto_provider();
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        drain_s: 1,
        debug_headers: true,
        ..NodeConfig::default()
    };
    cfg.health.interval_ms = 100;
    cfg.pd.protocol = Some(protocol);
    cfg.pd.bypass_uncached_tokens = bypass;
    cfg.pd.prefill_timeout_ms = 10_000;
    cfg.replicas = replicas;
    proxy::spawn(cfg).await.unwrap()
}

async fn pd_replica(id: &str, role: Role) -> ReplicaHandle {
    sim_replica(id, |c| {
        c.pd.role = role;
        c.engine.time_scale = 200.0;
    })
    .await
}

fn prompt(n: usize) -> String {
    (0..n).map(|i| format!("word{i} ")).collect()
}

/// Each protocol serves streamed and whole completions through a simulated 1P1D pair: the
/// decode pulls the KV with what the node told it, then decodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_protocol_serves_a_pair_of_simulated_replicas() {
    bounded(60, async {
        for protocol in [PdProtocol::Sglang, PdProtocol::VllmNixl, PdProtocol::VllmMooncake] {
            let p = pd_replica("p0", Role::Prefill).await;
            let d = pd_replica("d0", Role::Decode).await;
            // The simulated replica serves its KV hand-over on its HTTP port.
            let n = node(
                protocol,
                0,
                vec![
                    replica_entry("p0", p.base_url(), Role::Prefill, Some(p.addr.port())),
                    replica_entry("d0", d.base_url(), Role::Decode, None),
                ],
            )
            .await;
            let c = client();
            for stream in [false, true] {
                let resp = c
                    .post(format!("http://{}/v1/completions", n.addr))
                    .json(&json!({"model": MODEL, "prompt": prompt(300), "max_tokens": 5, "stream": stream}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), 200, "{protocol:?} stream={stream}");
                let pd = resp.headers()["x-kvmesh-pd"].to_str().unwrap().to_owned();
                let legs = format!("protocol={}; prefill=p0; decode=d0", protocol.as_str());
                if protocol == PdProtocol::Sglang {
                    assert_eq!(pd, legs);
                } else {
                    // The node read the prefill's answer and names its hit: none on a cold
                    // cache, the prompt (less its last block) the second time.
                    let cached: u64 = pd
                        .strip_prefix(&format!("{legs}; prefill_cached="))
                        .and_then(|n| n.parse().ok())
                        .unwrap_or_else(|| panic!("{pd}"));
                    assert_eq!(cached > 0, stream, "{pd}");
                }
                assert_eq!(resp.headers()["x-kvmesh-replica"], "d0");
                let text = resp.text().await.unwrap();
                if stream {
                    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
                } else {
                    let v: Value = serde_json::from_str(&text).unwrap();
                    assert_eq!(v["usage"]["completion_tokens"], 5);
                }
            }
            n.shutdown().await;
            p.shutdown().await;
            d.shutdown().await;
        }
    })
    .await;
}

/// A simulated decode replica holding the prompt from the last pair takes the next request
/// whole: the bypass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_bypasses_disaggregation_to_the_decode_that_holds_it() {
    bounded(60, async {
        let p = pd_replica("p0", Role::Prefill).await;
        let d = pd_replica("d0", Role::Decode).await;
        let n = node(
            PdProtocol::VllmNixl,
            256,
            vec![
                replica_entry("p0", p.base_url(), Role::Prefill, None),
                replica_entry("d0", d.base_url(), Role::Decode, None),
            ],
        )
        .await;
        let c = client();
        let body = json!({"model": MODEL, "prompt": prompt(400), "max_tokens": 3});
        let send = || {
            c.post(format!("http://{}/v1/completions", n.addr))
                .json(&body)
                .send()
        };
        let first = send().await.unwrap();
        assert_eq!(first.status(), 200);
        assert!(
            first.headers().contains_key("x-kvmesh-pd"),
            "a cold prompt is split"
        );
        first.bytes().await.unwrap();
        let second = send().await.unwrap();
        assert_eq!(second.status(), 200);
        assert!(!second.headers().contains_key("x-kvmesh-pd"), "bypassed");
        assert_eq!(second.headers()["x-kvmesh-routed-to"], "d0");
        assert!(
            second.headers()["x-kvmesh-cached-tokens"]
                .to_str()
                .unwrap()
                .parse::<u64>()
                .unwrap()
                > 0,
            "the decode replica's cache held the handed-over prompt"
        );
        let metrics = c
            .get(format!("http://{}/metrics", n.addr))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(metrics.contains("kvmesh_pd_decisions_total{outcome=\"bypass\"} 1"));
        assert!(metrics.contains("kvmesh_pd_decisions_total{outcome=\"pair\"} 1"));
        n.shutdown().await;
        p.shutdown().await;
        d.shutdown().await;
    })
    .await;
}

// ---- recording fakes ------------------------------------------------------------------------

/// How a fake replica answers a completion.
#[derive(Clone, Copy)]
enum Mode {
    /// A one-token completion carrying NIXL's `kv_transfer_params`.
    NixlPrefill,
    /// A plain completion (a decode, or a prefill that returns nothing special).
    Plain,
    /// 503.
    Unavailable,
    /// A streamed answer that breaks after its first chunk.
    BreaksMidStream,
}

#[derive(Clone)]
struct Fake {
    mode: Mode,
    seen: Arc<Mutex<Vec<(HeaderMap, Value)>>>,
}

impl Fake {
    fn seen(&self) -> Vec<(HeaderMap, Value)> {
        self.seen.lock().unwrap().clone()
    }
}

async fn fake_completion(
    State(f): State<Fake>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    f.seen.lock().unwrap().push((headers, body));
    match f.mode {
        Mode::NixlPrefill => Json(json!({
            "id": "cmpl-p", "object": "text_completion", "model": MODEL,
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "kv_transfer_params": {
                "do_remote_prefill": true, "do_remote_decode": false,
                "remote_engine_id": "eng-p", "remote_block_ids": [3, 4],
                "remote_host": "10.9.9.9", "remote_port": 5600,
                "remote_request_id": "req-p", "tp_size": 1
            }
        }))
        .into_response(),
        Mode::Plain => Json(json!({
            "id": "cmpl-d", "object": "text_completion", "model": MODEL,
            "choices": [{"index": 0, "text": "hello", "finish_reason": "length"}]
        }))
        .into_response(),
        Mode::Unavailable => StatusCode::SERVICE_UNAVAILABLE.into_response(),
        Mode::BreaksMidStream => {
            // The first chunk, a pause (so the headers and it leave), then the connection breaks.
            let chunks = futures::stream::unfold(0, |i| async move {
                match i {
                    0 => Some((Ok("data: {\"choices\":[{\"text\":\"a\"}]}\n\n"), 1)),
                    1 => {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        Some((Err(std::io::Error::other("engine died")), 2))
                    }
                    _ => None,
                }
            });
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(chunks))
                .unwrap()
        }
    }
}

async fn fake(mode: Mode) -> (SocketAddr, Fake) {
    let f = Fake {
        mode,
        seen: Arc::default(),
    };
    let app = Router::new()
        .route("/v1/completions", post(fake_completion))
        .route("/health", get(|| async { StatusCode::OK }))
        .with_state(f.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    (addr, f)
}

fn client_body() -> Value {
    json!({
        "model": MODEL, "prompt": prompt(50), "max_tokens": 40, "temperature": 0.3,
        "stream": false, "min_tokens": 2, "user": "u1"
    })
}

async fn post_completion(n: &RunningNode, body: &Value) -> reqwest::Response {
    client()
        .post(format!("http://{}/v1/completions", n.addr))
        .json(body)
        .send()
        .await
        .unwrap()
}

/// The client's fields, other than those `changed`, reach a leg as they were sent.
fn keeps_client_fields(leg: &Value, changed: &[&str]) {
    for (k, v) in client_body().as_object().unwrap() {
        if !changed.contains(&k.as_str()) {
            assert_eq!(&leg[k], v, "field {k}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_nixl_prefills_one_token_then_hands_the_returned_params_to_the_decode() {
    bounded(30, async {
        let (pa, p) = fake(Mode::NixlPrefill).await;
        let (da, d) = fake(Mode::Plain).await;
        let n = node(
            PdProtocol::VllmNixl,
            0,
            vec![
                replica_entry("p0", format!("http://{pa}"), Role::Prefill, None),
                replica_entry("d0", format!("http://{da}"), Role::Decode, None),
            ],
        )
        .await;
        let resp = post_completion(&n, &client_body()).await;
        assert_eq!(resp.status(), 200);
        let (ph, pb) = p.seen().remove(0);
        let (dh, db) = d.seen().remove(0);
        // Prefill: one token, not streamed, no min_tokens, KV kept for a remote decode.
        assert_eq!(pb["max_tokens"], 1);
        assert_eq!(pb["stream"], false);
        assert!(pb.get("min_tokens").is_none());
        assert_eq!(
            pb["kv_transfer_params"],
            json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                   "remote_block_ids": null, "remote_host": null, "remote_port": null})
        );
        keeps_client_fields(&pb, &["max_tokens", "stream", "min_tokens"]);
        // Decode: the client's request, with the prefill's kv_transfer_params verbatim.
        keeps_client_fields(&db, &[]);
        assert_eq!(
            db["kv_transfer_params"],
            json!({"do_remote_prefill": true, "do_remote_decode": false,
                   "remote_engine_id": "eng-p", "remote_block_ids": [3, 4],
                   "remote_host": "10.9.9.9", "remote_port": 5600,
                   "remote_request_id": "req-p", "tp_size": 1})
        );
        let id = ph["x-request-id"].to_str().unwrap();
        assert_eq!(id.len(), 32);
        assert_eq!(dh["x-request-id"], id, "one request id on both legs");
        n.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_mooncake_names_one_transfer_and_the_prefills_bootstrap_to_the_decode() {
    bounded(30, async {
        let (pa, p) = fake(Mode::Plain).await;
        let (da, d) = fake(Mode::Plain).await;
        let mut prefill = replica_entry("p0", format!("http://{pa}"), Role::Prefill, Some(18998));
        prefill.engine_id = "engine-p0".into();
        let n = node(
            PdProtocol::VllmMooncake,
            0,
            vec![
                prefill,
                replica_entry("d0", format!("http://{da}"), Role::Decode, None),
            ],
        )
        .await;
        assert_eq!(post_completion(&n, &client_body()).await.status(), 200);
        let (_, pb) = p.seen().remove(0);
        let (_, db) = d.seen().remove(0);
        let kp = pb["kv_transfer_params"].as_object().unwrap();
        assert_eq!(kp.len(), 3);
        assert_eq!(kp["do_remote_decode"], true);
        assert_eq!(kp["do_remote_prefill"], false);
        let transfer = kp["transfer_id"].as_str().unwrap();
        assert!(transfer.starts_with("xfer-"));
        assert_eq!(pb["max_tokens"], 1);
        assert_eq!(
            db["kv_transfer_params"],
            json!({"do_remote_decode": false, "do_remote_prefill": true, "transfer_id": transfer,
                   "remote_bootstrap_addr": "http://127.0.0.1:18998",
                   "remote_engine_id": "engine-p0"})
        );
        keeps_client_fields(&db, &[]);
        n.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_sends_one_bootstrapped_body_to_both_legs() {
    bounded(30, async {
        let (pa, p) = fake(Mode::Plain).await;
        let (da, d) = fake(Mode::Plain).await;
        let n = node(
            PdProtocol::Sglang,
            0,
            vec![
                replica_entry("p0", format!("http://{pa}"), Role::Prefill, Some(18999)),
                replica_entry("d0", format!("http://{da}"), Role::Decode, None),
            ],
        )
        .await;
        let resp = post_completion(&n, &client_body()).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(
            resp.json::<Value>().await.unwrap()["id"],
            "cmpl-d",
            "the decode answers"
        );
        // The prefill leg may still be read in the background: wait for it.
        common::wait_for(Duration::from_secs(5), || !p.seen().is_empty()).await;
        let (_, pb) = p.seen().remove(0);
        let (_, db) = d.seen().remove(0);
        assert_eq!(pb, db, "the same body to both");
        assert_eq!(db["bootstrap_host"], "127.0.0.1");
        assert_eq!(db["bootstrap_port"], 18999);
        let room = db["bootstrap_room"].as_u64().unwrap();
        assert!(room < 1 << 63);
        keeps_client_fields(&db, &[]);
        n.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_prefill_is_retried_on_another_before_any_decode() {
    bounded(30, async {
        let (ba, bad) = fake(Mode::Unavailable).await;
        let (ga, good) = fake(Mode::NixlPrefill).await;
        let (da, d) = fake(Mode::Plain).await;
        let n = node(
            PdProtocol::VllmNixl,
            0,
            vec![
                replica_entry("p-bad", format!("http://{ba}"), Role::Prefill, None),
                replica_entry("p-good", format!("http://{ga}"), Role::Prefill, None),
                replica_entry("d0", format!("http://{da}"), Role::Decode, None),
            ],
        )
        .await;
        for i in 0..4 {
            let mut body = client_body();
            body["prompt"] = Value::from(prompt(50 + i));
            let resp = post_completion(&n, &body).await;
            assert_eq!(resp.status(), 200);
            assert!(resp.headers()["x-kvmesh-pd"]
                .to_str()
                .unwrap()
                .contains("prefill=p-good"));
        }
        assert_eq!(good.seen().len(), 4);
        assert_eq!(
            d.seen().len(),
            4,
            "each decode started once, after a good prefill"
        );
        // Every decode carries the good prefill's parameters.
        assert!(d
            .seen()
            .iter()
            .all(|(_, b)| b["kv_transfer_params"]["remote_engine_id"] == "eng-p"));
        let _ = bad;
        n.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_that_breaks_after_its_first_byte_is_not_retried() {
    bounded(30, async {
        let (pa, p) = fake(Mode::NixlPrefill).await;
        let (d1a, d1) = fake(Mode::BreaksMidStream).await;
        let n = node(
            PdProtocol::VllmNixl,
            0,
            vec![
                replica_entry("p0", format!("http://{pa}"), Role::Prefill, None),
                replica_entry("d1", format!("http://{d1a}"), Role::Decode, None),
            ],
        )
        .await;
        let mut body = client_body();
        body["stream"] = Value::Bool(true);
        let resp = post_completion(&n, &body).await;
        assert_eq!(resp.status(), 200, "committed at the decode's headers");
        assert!(resp.bytes().await.is_err(), "the break reaches the client");
        assert_eq!(p.seen().len(), 1);
        assert_eq!(d1.seen().len(), 1, "no second decode");
        n.shutdown().await;
    })
    .await;
}
