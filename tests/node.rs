//! End-to-end tests of `kvmesh serve` on loopback: a node in-process in front of simulated
//! replicas (`kvmesh::replica`) and, where exact bytes and timing matter, a tiny fake upstream.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use kvmesh::core::cache_model::{CacheModel, CacheModelConfig, CacheSource};
use kvmesh::core::keys::BlockKey;
use kvmesh::core::router::{Decision, RouteRequest};
use kvmesh::core::summary::SummaryConfig;
use kvmesh::node::config::NodeConfig;
use kvmesh::node::Node;
use kvmesh::proxy::{self, RunningNode};
use kvmesh::replica::{self, ReplicaConfig, ReplicaHandle};
use serde_json::{json, Value};

mod common;
use common::dns::fake_dns;
use common::node_config;

const LIMIT: Duration = Duration::from_secs(20);
const ROUTED: &str = "x-kvmesh-routed-to";
const MODEL: &str = "sim-llama-8b";

async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(LIMIT, f)
        .await
        .expect("test exceeded its time bound")
}

fn client() -> reqwest::Client {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    proxy::install_crypto_provider();
    reqwest::Client::builder().build().unwrap()
}

/// Simulated replicas `r0..rn`, 50× faster than real time.
async fn replicas(n: usize) -> Vec<ReplicaHandle> {
    let mut out = Vec::new();
    for i in 0..n {
        let mut cfg = ReplicaConfig {
            id: format!("r{i}"),
            exit_on_crash: false,
            ..ReplicaConfig::default()
        };
        cfg.engine.time_scale = 50.0;
        out.push(replica::spawn(cfg).await.unwrap());
    }
    out
}

fn url(node: &RunningNode, path: &str) -> String {
    format!("http://{}{path}", node.addr)
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

async fn complete(c: &reqwest::Client, node: &RunningNode, prompt: &str) -> (u16, String) {
    let resp = c
        .post(url(node, "/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let replica = resp
        .headers()
        .get(ROUTED)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let _ = resp.bytes().await.unwrap();
    (status, replica)
}

#[tokio::test]
async fn shared_prefixes_stick_and_cold_prompts_spread() {
    bounded(async {
        let reps = replicas(3).await;
        let urls: Vec<String> = reps.iter().map(|r| r.base_url()).collect();
        let node = proxy::spawn(node_config(&urls)).await.unwrap();
        let c = client();

        // Ten requests sharing an 8 KiB prefix (32 blocks) with distinct tails: one replica.
        let prefix = text("system-prompt", 8192);
        let mut seen = std::collections::HashSet::new();
        for i in 0..10 {
            let (status, r) = complete(&c, &node, &format!("{prefix} question {i}")).await;
            assert_eq!(status, 200);
            seen.insert(r);
        }
        assert_eq!(seen.len(), 1, "a shared prefix went to {seen:?}");
        // Let a scrape (every 100 ms) see the prefix's replica idle again: one taken while its
        // last request ran says `running = 1`, and p2c-cache rightly avoids a busy replica for
        // cold prompts until the next scrape (on a fast machine the loop below is over by then).
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;

        // Thirty cold prompts: spread over the replicas.
        let mut counts = std::collections::HashMap::<String, usize>::new();
        for i in 0..30 {
            let (status, r) = complete(&c, &node, &text(&format!("cold{i}"), 2048)).await;
            assert_eq!(status, 200);
            *counts.entry(r).or_default() += 1;
        }
        assert_eq!(counts.len(), 3, "cold prompts went to {counts:?}");
        assert!(counts.values().all(|&n| n <= 20), "{counts:?}");

        node.shutdown().await;
        for r in reps {
            r.shutdown().await;
        }
    })
    .await;
}

/// The SSE body a fake upstream sends, chunk by chunk.
const SSE_CHUNKS: [&str; 4] = [
    "data: {\"id\":\"x\",\"choices\":[{\"text\":\"Hel\",\"index\":0}]}\n\n",
    "data: {\"id\":\"x\",\"choices\":[{\"text\":\"lo \\u00e9\",\"index\":0}]}\n\n",
    ": keep-alive comment\n\ndata: {\"id\":\"x\",\"choices\":[{\"text\":\"!\",\"index\":0}]}\n\n",
    "data: [DONE]\n\n",
];
const CHUNK_GAP: Duration = Duration::from_millis(150);

/// What a fake upstream does on completion requests.
#[derive(Clone, Copy)]
enum Fake {
    /// Streams `SSE_CHUNKS` with `CHUNK_GAP` between them.
    Stream,
    /// Answers 500.
    Fail,
    /// Sends no headers for 10 s.
    Hang,
    /// Sends the first chunk, then nothing for 10 s.
    StallAfterFirst,
}

/// A fake OpenAI upstream with vLLM-named metrics; counts completion requests.
async fn fake_upstream(mode: Fake) -> (SocketAddr, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let completion = move || {
        let h = h.clone();
        async move {
            h.fetch_add(1, Ordering::SeqCst);
            match mode {
                Fake::Fail => (
                    axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                    "{\"error\":{\"message\":\"boom\"}}",
                )
                    .into_response(),
                Fake::Hang => {
                    tokio::time::sleep(Duration::from_secs(10)).await;
                    "late".into_response()
                }
                Fake::Stream | Fake::StallAfterFirst => {
                    let gap = match mode {
                        Fake::StallAfterFirst => Duration::from_secs(10),
                        _ => CHUNK_GAP,
                    };
                    let s = futures::stream::iter(SSE_CHUNKS.iter().enumerate()).then(
                        move |(i, c)| async move {
                            if i > 0 {
                                tokio::time::sleep(gap).await;
                            }
                            Ok::<_, std::io::Error>(bytes::Bytes::from_static(c.as_bytes()))
                        },
                    );
                    Response::builder()
                        .header("content-type", "text/event-stream")
                        .body(Body::from_stream(s))
                        .unwrap()
                }
            }
        }
    };
    let app = axum::Router::new()
        .route("/v1/completions", post(completion.clone()))
        .route("/v1/chat/completions", post(completion))
        .route("/health", get(|| async { "ok" }))
        .route(
            "/v1/models",
            get(|| async {
                axum::Json(json!({"object":"list","data":[{"id":"fake-model","object":"model"}]}))
            }),
        )
        .route(
            "/metrics",
            get(|| async {
                "# TYPE vllm:num_requests_waiting gauge\n\
                 vllm:num_requests_waiting{model_name=\"fake-model\"} 5\n\
                 vllm:num_requests_running{model_name=\"fake-model\"} 2\n\
                 vllm:kv_cache_usage_perc{model_name=\"fake-model\"} 0.5\n\
                 vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1000\"} 1\n\
                 this line is garbage\n"
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, hits)
}

/// As the simulator models it: a routed request's blocks count in the routing node's overlay from
/// the predicted end of its prefill (the queue before it, then its own), and reach the replica's
/// cache model only at the response's first byte; a request that fails before it records
/// nothing, and an exact (KV-event) model takes no routed guesses.
#[tokio::test]
async fn blocks_count_from_the_predicted_prefill_end_and_are_learned_at_the_first_byte() {
    proxy::install_crypto_provider();
    let mut cfg = node_config(&["http://127.0.0.1:9".to_owned()]);
    cfg.replicas[0].models = vec![MODEL.into()];
    cfg.replicas[0].prefill_tokens_per_s = 1_000.0;
    let node = Node::new(cfg).unwrap();
    let req = |keys: &'static [BlockKey]| RouteRequest::plain(MODEL, keys, 5_000);
    let route = |keys: &'static [BlockKey]| {
        let (d, t) = node.route(&req(keys));
        assert!(matches!(d, Decision::Route(_)), "{d:?}");
        t.unwrap()
    };
    let held = |keys: &[BlockKey]| {
        let core = node.lock();
        keys.iter()
            .filter(|k| core.replicas[0].cache.contains(**k))
            .count()
    };
    let secs = Duration::from_secs;
    static A: [BlockKey; 4] = [BlockKey(1), BlockKey(2), BlockKey(3), BlockKey(4)];
    static B: [BlockKey; 4] = [BlockKey(11), BlockKey(12), BlockKey(13), BlockKey(14)];
    static C: [BlockKey; 2] = [BlockKey(21), BlockKey(22)];

    // 5,000 uncached tokens at 1,000 tokens/s on an idle replica: ready in 5 s.
    let mut a = route(&A);
    {
        let core = node.lock();
        let now = node.now();
        assert_eq!(core.view.hit(0, &A, now), 0, "not before its prefill");
        assert_eq!(core.view.hit(0, &A, now + secs(6)), A.len());
        let load = core.view.replica(0).unwrap().load;
        assert_eq!(load.queued_prefill_tokens, 5_000);
    }
    assert_eq!(held(&A), 0, "no first byte yet");
    // Queued behind A: ready in 10 s.
    let b = route(&B);
    {
        let core = node.lock();
        let now = node.now();
        assert_eq!(core.view.hit(0, &B, now + secs(6)), 0);
        assert_eq!(core.view.hit(0, &B, now + secs(11)), B.len());
    }

    // A's first byte: its blocks are cached, its prefill no longer queued, and they count in
    // the overlay from now (earlier than predicted).
    a.first_byte(&A);
    assert_eq!(held(&A), A.len());
    assert_eq!(node.lock().view.hit(0, &A, node.now()), A.len());
    assert!(node.lock().replicas[0].summary_dirty);
    a.first_byte(&B);
    assert_eq!(held(&B), 0, "only the first call counts");
    assert_eq!(
        node.lock()
            .view
            .replica(0)
            .unwrap()
            .load
            .queued_prefill_tokens,
        5_000
    );
    // B fails before its first byte: nothing recorded, nothing left queued.
    drop(b);
    assert_eq!(held(&B), 0);
    assert_eq!(
        node.lock()
            .view
            .replica(0)
            .unwrap()
            .load
            .queued_prefill_tokens,
        0
    );
    drop(a);
    assert_eq!(node.lock().view.replica(0).unwrap().load.in_flight, 0);

    // An exact model is the engine's truth: a first byte adds no guess to it.
    node.lock().replicas[0].cache = CacheModel::new(
        CacheSource::Exact,
        1,
        CacheModelConfig::with_capacity(64),
        SummaryConfig::for_cluster("test"),
    )
    .unwrap();
    let mut c = route(&C);
    c.first_byte(&C);
    assert_eq!(held(&C), 0);
}

#[tokio::test]
async fn sse_passes_through_byte_exact_and_unbuffered() {
    bounded(async {
        let (addr, _) = fake_upstream(Fake::Stream).await;
        let node = proxy::spawn(node_config(&[format!("http://{addr}")]))
            .await
            .unwrap();
        let c = client();
        for path in ["/v1/completions", "/v1/chat/completions"] {
            let body = if path == "/v1/completions" {
                json!({"model":"fake-model","prompt":"hi","stream":true})
            } else {
                json!({"model":"fake-model","messages":[{"role":"user","content":"hi"}],"stream":true})
            };
            let started = Instant::now();
            let resp = c.post(url(&node, path)).json(&body).send().await.unwrap();
            assert_eq!(resp.status(), 200);
            assert_eq!(resp.headers()["content-type"], "text/event-stream");
            let mut stream = resp.bytes_stream();
            let mut got = Vec::new();
            let mut first = None;
            while let Some(chunk) = stream.next().await {
                first.get_or_insert_with(|| started.elapsed());
                got.extend_from_slice(&chunk.unwrap());
            }
            let total = started.elapsed();
            assert_eq!(String::from_utf8(got).unwrap(), SSE_CHUNKS.concat());
            // The first chunk must not wait for the rest (3 gaps = 450 ms).
            let first = first.unwrap();
            assert!(first < CHUNK_GAP, "first byte after {first:?}");
            assert!(total >= CHUNK_GAP * 3, "whole body after {total:?}");
        }
        node.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn failover_hides_a_killed_replica_and_a_failing_one() {
    bounded(async {
        let mut reps = replicas(3).await;
        let (bad, bad_hits) = fake_upstream(Fake::Fail).await;
        let mut urls: Vec<String> = reps.iter().map(|r| r.base_url()).collect();
        urls.push(format!("http://{bad}"));
        let mut cfg = node_config(&urls);
        // Passive detection only: the dead replica must be found by requests, not checks. A long
        // interval is not enough: the watcher checks once at spawn and then on a grid whose phase
        // is random, so two failed checks could mark r1 down before its third failed request
        // ejects it (seen on a busy box: unhealthy, two failures, not ejected).
        cfg.health.interval_ms = 60_000;
        cfg.health.unhealthy_after = u32::MAX;
        cfg.replicas[3].models = vec![MODEL.into()];
        // Rotation makes every replica, bad ones included, get picked within a few requests.
        cfg.policy = "round-robin".into();
        let node = proxy::spawn(cfg).await.unwrap();
        let c = client();
        let dead = reps.remove(1);
        dead.shutdown().await;

        for i in 0..24 {
            let stream = i % 2 == 0;
            let resp = c
                .post(url(&node, "/v1/completions"))
                .json(
                    &json!({"model": MODEL, "prompt": text(&format!("p{i}"), 600),
                              "max_tokens": 3, "stream": stream}),
                )
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200, "request {i}");
            assert_ne!(resp.headers()[ROUTED], "r1");
            assert_ne!(resp.headers()[ROUTED], "r3");
            let body = resp.text().await.unwrap();
            if stream {
                assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
            }
        }
        let metrics = c
            .get(url(&node, "/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let retries: f64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix("kvmesh_retries_total "))
            .unwrap()
            .parse()
            .unwrap();
        assert!(retries >= 1.0, "{metrics}");
        assert!(bad_hits.load(Ordering::SeqCst) >= 1);
        // Both bad replicas were ejected after consecutive failures.
        let state: Value = c
            .get(url(&node, "/admin/state"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        for id in ["r1", "r3"] {
            let r = state["replicas"]
                .as_array()
                .unwrap()
                .iter()
                .find(|r| r["id"] == id)
                .unwrap();
            assert_eq!(r["health"], "unhealthy", "{r}");
            assert_eq!(r["ejected"], true, "{r}");
            // Their requests failed before a first byte: no blocks recorded there.
            assert_eq!(r["cache_keys"], 0, "{r}");
        }
        let learned: u64 = state["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["id"] == "r0" || r["id"] == "r2")
            .map(|r| r["cache_keys"].as_u64().unwrap())
            .sum();
        assert!(learned > 0, "{state}");
        node.shutdown().await;
        for r in reps {
            r.shutdown().await;
        }
    })
    .await;
}

#[tokio::test]
async fn malformed_requests_get_openai_errors_and_the_node_keeps_serving() {
    bounded(async {
        let reps = replicas(1).await;
        let mut cfg = node_config(&[reps[0].base_url()]);
        cfg.max_body_bytes = 64 * 1024;
        let node = proxy::spawn(cfg).await.unwrap();
        let c = client();
        let post = |body: Vec<u8>| {
            c.post(url(&node, "/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(body)
                .send()
        };
        let cases: Vec<(Vec<u8>, u16, &str)> = vec![
            (b"{not json".to_vec(), 400, "invalid_request_error"),
            (b"".to_vec(), 400, "invalid_request_error"),
            (b"[1,2,3]".to_vec(), 400, "invalid_request_error"),
            (br#"{"messages":[{"role":"user","content":"hi"}]}"#.to_vec(), 400, "invalid_request_error"),
            (br#"{"model":"sim-llama-8b"}"#.to_vec(), 400, "invalid_request_error"),
            (br#"{"model":"sim-llama-8b","messages":"nope"}"#.to_vec(), 400, "invalid_request_error"),
            (br#"{"model":"gpt-unknown","messages":[]}"#.to_vec(), 404, "invalid_request_error"),
            (vec![b' '; 100 * 1024], 413, "invalid_request_error"),
        ];
        for (body, status, kind) in cases {
            let resp = post(body.clone()).await.unwrap();
            assert_eq!(resp.status().as_u16(), status, "{:?}", String::from_utf8_lossy(&body[..body.len().min(60)]));
            let v: Value = resp.json().await.unwrap();
            assert_eq!(v["error"]["type"], kind, "{v}");
            assert!(v["error"]["message"].as_str().unwrap().len() > 5, "{v}");
            assert!(v["error"].get("code").is_some() && v["error"].get("param").is_some(), "{v}");
        }
        // A wrong method, in each API's shape.
        let resp = c.get(url(&node, "/v1/chat/completions")).send().await.unwrap();
        assert_eq!(resp.status(), 405);
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["code"], "method_not_allowed", "{v}");
        let resp = c.get(url(&node, "/v1/messages")).send().await.unwrap();
        assert_eq!(resp.status(), 405);
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        // Still serving.
        let resp = post(br#"{"model":"sim-llama-8b","messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#.to_vec())
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["object"], "chat.completion", "{v}");
        node.shutdown().await;
        for r in reps {
            r.shutdown().await;
        }
    })
    .await;
}

#[tokio::test]
async fn no_healthy_replica_is_503_with_retry_after() {
    bounded(async {
        // A port nobody listens on.
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let mut cfg = node_config(&[format!("http://{closed}")]);
        cfg.replicas[0].models = vec!["m".into()];
        cfg.health.unhealthy_after = 1;
        let node = proxy::spawn(cfg).await.unwrap();
        let c = client();
        let resp = c
            .post(url(&node, "/v1/completions"))
            .json(&json!({"model":"m","prompt":"hello"}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 503);
        assert_eq!(resp.headers()["retry-after"], "1");
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["code"], "no_healthy_replica");
        assert_eq!(
            c.get(url(&node, "/ready")).send().await.unwrap().status(),
            503
        );
        assert_eq!(
            c.get(url(&node, "/health")).send().await.unwrap().status(),
            200
        );
        node.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn unknown_config_keys_fail_fast_naming_the_key() {
    let e =
        NodeConfig::from_toml("listen = \"127.0.0.1:0\"\n[health]\ninterval = 5\n").unwrap_err();
    assert!(e.to_string().contains("interval"), "{e}");
    // The real binary refuses to start, naming the key, and exits non-zero.
    let dir = std::env::temp_dir().join(format!("kvmesh-node-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.toml");
    std::fs::write(&path, "listen = \"127.0.0.1:0\"\nreplcias = []\n").unwrap();
    let out = bounded(
        tokio::process::Command::new(env!("CARGO_BIN_EXE_kvmesh"))
            .args(["serve", "--config"])
            .arg(&path)
            .output(),
    )
    .await
    .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("replcias"), "{stderr}");
    let out = bounded(
        tokio::process::Command::new(env!("CARGO_BIN_EXE_kvmesh"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--replica",
                "ftp://x",
                "--policy",
                "p2c-cache",
            ])
            .output(),
    )
    .await
    .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("replicas[0].url"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn metrics_admin_state_models_and_scrapes() {
    bounded(async {
        let (addr, _) = fake_upstream(Fake::Stream).await;
        let mut cfg = node_config(&[format!("http://{addr}")]);
        cfg.admin_token = Some("s3cret".into());
        let node = proxy::spawn(cfg).await.unwrap();
        let c = client();
        let resp = c
            .post(url(&node, "/v1/completions"))
            .json(&json!({"model":"fake-model","prompt": text("x", 1024),"stream":true}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()[ROUTED], "r0");
        resp.bytes().await.unwrap();

        let models: Value = c
            .get(url(&node, "/v1/models"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(models["data"][0]["id"], "fake-model");

        let metrics = c
            .get(url(&node, "/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        for name in [
            "kvmesh_requests_total{outcome=\"ok\",policy=\"p2c-cache\",replica=\"r0\"} 1",
            "kvmesh_hit_blocks_count 1",
            "kvmesh_decision_seconds_count 1",
            "kvmesh_in_flight{replica=\"r0\"} 0",
            "kvmesh_replica_healthy{replica=\"r0\"} 1",
            "kvmesh_retries_total 0",
        ] {
            assert!(metrics.contains(name), "missing {name} in\n{metrics}");
        }

        assert_eq!(
            c.get(url(&node, "/admin/state"))
                .send()
                .await
                .unwrap()
                .status(),
            401
        );
        assert_eq!(
            c.get(url(&node, "/admin/state"))
                .bearer_auth("wrong")
                .send()
                .await
                .unwrap()
                .status(),
            401
        );
        // Wait for a scrape and a summary tick to land.
        let deadline = Instant::now() + Duration::from_secs(5);
        let state = loop {
            let state: Value = c
                .get(url(&node, "/admin/state"))
                .bearer_auth("s3cret")
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let r = &state["replicas"][0];
            if r["waiting"] == 5 && r["summary_keys"].as_u64() > Some(0)
                || Instant::now() > deadline
            {
                break state;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let r = &state["replicas"][0];
        assert_eq!(r["waiting"], 5, "{state}");
        assert_eq!(r["running"], 2, "{state}");
        assert_eq!(r["kv_usage"], 0.5, "{state}");
        assert_eq!(r["capacity_tokens"], 16_000, "{state}");
        assert_eq!(r["health"], "healthy", "{state}");
        assert_eq!(r["in_flight"], 0, "{state}");
        assert_eq!(r["queued_prefill_tokens"], 0, "{state}");
        assert!(r["summary_keys"].as_u64().unwrap() >= 4, "{state}");
        let skipped = c
            .get(url(&node, "/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            !skipped.contains("kvmesh_scrape_skipped_lines_total 0"),
            "{skipped}"
        );

        let table = proxy::status(&format!("http://{}", node.addr), Some("s3cret"))
            .await
            .unwrap();
        assert!(
            table.contains("r0") && table.contains("fake-model"),
            "{table}"
        );
        assert!(proxy::status(&format!("http://{}", node.addr), None)
            .await
            .is_err());
        node.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn shutdown_drains_a_stream_in_flight() {
    bounded(async {
        let (addr, _) = fake_upstream(Fake::Stream).await;
        let node = proxy::spawn(node_config(&[format!("http://{addr}")]))
            .await
            .unwrap();
        let c = client();
        let resp = c
            .post(url(&node, "/v1/completions"))
            .json(&json!({"model":"fake-model","prompt":"hi","stream":true}))
            .send()
            .await
            .unwrap();
        let addr = node.addr;
        let drained = tokio::spawn(node.shutdown());
        let body = resp.text().await.unwrap();
        assert_eq!(body, SSE_CHUNKS.concat());
        assert!(drained.await.unwrap(), "drain did not finish in time");
        // No longer accepting.
        assert!(c.get(format!("http://{addr}/health")).send().await.is_err());
    })
    .await;
}

#[tokio::test]
async fn timeouts_retry_before_the_first_byte_and_never_after() {
    bounded(async {
        let (hang, hang_hits) = fake_upstream(Fake::Hang).await;
        let (good, good_hits) = fake_upstream(Fake::Stream).await;
        let mut cfg = node_config(&[format!("http://{hang}"), format!("http://{good}")]);
        cfg.timeouts.stream_first_byte_ms = 300;
        cfg.policy = "round-robin".into();
        let node = proxy::spawn(cfg).await.unwrap();
        let c = client();
        for _ in 0..2 {
            let resp = c
                .post(url(&node, "/v1/completions"))
                .json(&json!({"model":"fake-model","prompt":"hi","stream":true}))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            assert_eq!(resp.headers()[ROUTED], "r1");
            assert_eq!(resp.text().await.unwrap(), SSE_CHUNKS.concat());
        }
        // Round-robin sent requests to the hanging replica first; each timed out and moved on.
        let hung = hang_hits.load(Ordering::SeqCst);
        assert!((1..=2).contains(&hung), "{hung}");
        assert_eq!(good_hits.load(Ordering::SeqCst), 2);
        let metrics = c
            .get(url(&node, "/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            metrics.contains(&format!("kvmesh_retries_total {hung}")),
            "{metrics}"
        );
        node.shutdown().await;

        // A stream that started and then went silent is not retried from the start: it is
        // continued on the other replica (`src/proxy/resume.rs`), and the client's stream ends
        // cleanly (this fake ignores the continuation's prompt and starts over).
        let (stall, stall_hits) = fake_upstream(Fake::StallAfterFirst).await;
        let (good, good_hits) = fake_upstream(Fake::Stream).await;
        let mut cfg = node_config(&[format!("http://{stall}"), format!("http://{good}")]);
        cfg.timeouts.idle_ms = 300;
        cfg.timeouts.stream_idle_ms = 300;
        cfg.policy = "round-robin".into();
        let node = proxy::spawn(cfg).await.unwrap();
        let mut cut = 0;
        for _ in 0..2 {
            let resp = c
                .post(url(&node, "/v1/completions"))
                .json(&json!({"model":"fake-model","prompt":"hi","stream":true}))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            let stalled = resp.headers()[ROUTED] == "r0";
            let mut stream = resp.bytes_stream();
            let mut got = Vec::new();
            let mut failed = false;
            while let Some(chunk) = stream.next().await {
                match chunk {
                    Ok(b) => got.extend_from_slice(&b),
                    Err(_) => {
                        failed = true;
                        break;
                    }
                }
            }
            if stalled {
                cut += 1;
                assert!(!failed, "a silent stream is continued, not cut");
                let got = String::from_utf8(got).unwrap();
                assert!(got.starts_with(SSE_CHUNKS[0]), "{got}");
                assert!(got.ends_with("data: [DONE]\n\n"), "{got}");
                assert_eq!(got.matches("[DONE]").count(), 1, "{got}");
            } else {
                assert_eq!(got, SSE_CHUNKS.concat().as_bytes());
            }
        }
        // Round-robin counts the continuations too: one or both requests met the stall.
        assert!((1..=2).contains(&cut), "{cut}");
        assert_eq!(stall_hits.load(Ordering::SeqCst), cut);
        // Requests it served from the start, and the stalled ones' continuations.
        assert_eq!(good_hits.load(Ordering::SeqCst), 2);
        let metrics = c
            .get(url(&node, "/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(metrics.contains("kvmesh_retries_total 0"), "{metrics}");
        assert!(
            metrics.contains(&format!(
                "outcome=\"stream_aborted\",policy=\"round-robin\",replica=\"r0\"}} {cut}"
            )),
            "{metrics}"
        );
        assert!(
            metrics.contains(&format!(
                "kvmesh_stream_resumes_total{{api=\"completions\",outcome=\"resumed\"}} {cut}"
            )),
            "{metrics}"
        );
        node.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn tenants_over_quota_get_429() {
    bounded(async {
        let (addr, _) = fake_upstream(Fake::Stream).await;
        let mut cfg = node_config(&[format!("http://{addr}")]);
        cfg.tenants = NodeConfig::from_toml("[tenants.acme]\nmax_in_flight_per_replica = 1\n")
            .unwrap()
            .tenants;
        let node = proxy::spawn(cfg).await.unwrap();
        let c = client();
        let send = |tenant: &'static str| {
            c.post(url(&node, "/v1/completions"))
                .header("x-tenant-id", tenant)
                .json(&json!({"model":"fake-model","prompt":"hi","stream":true}))
                .send()
        };
        let open = send("acme").await.unwrap();
        assert_eq!(open.status(), 200);
        let over = send("acme").await.unwrap();
        assert_eq!(over.status(), 429);
        let v: Value = over.json().await.unwrap();
        assert_eq!(v["error"]["type"], "rate_limit_error");
        // Another tenant is unaffected; acme gets its slot back when its stream ends.
        assert_eq!(send("other").await.unwrap().status(), 200);
        open.text().await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(send("acme").await.unwrap().status(), 200);
        node.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn dns_srv_registers_replicas_and_drains_departed_ones() {
    bounded(async {
        let reps = replicas(2).await;
        let srv = Arc::new(std::sync::Mutex::new(vec![
            ("r0.sim.test.".to_owned(), reps[0].addr.port()),
            ("r1.sim.test.".to_owned(), reps[1].addr.port()),
        ]));
        let dns = fake_dns(srv.clone()).await;
        let mut cfg = node_config(&[]);
        cfg.dns = NodeConfig::from_toml(&format!(
            "[[dns]]\nname = \"_http._tcp.sim.test.\"\nnameserver = \"{dns}\"\nmin_refresh_ms = 100\n"
        ))
        .unwrap()
        .dns;
        let node = proxy::spawn(cfg).await.unwrap();
        let c = client();
        let ids: Vec<String> = reps.iter().map(|r| r.addr.to_string()).collect();
        let state: Value = c.get(url(&node, "/admin/state")).send().await.unwrap().json().await.unwrap();
        let mut found: Vec<&str> = state["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["health"] == "healthy" && r["models"][0] == MODEL)
            .map(|r| r["id"].as_str().unwrap())
            .collect();
        found.sort();
        let mut want: Vec<&str> = ids.iter().map(String::as_str).collect();
        want.sort();
        assert_eq!(found, want, "{state}");

        // r0 leaves DNS: within a TTL or two it drains and gets nothing new.
        srv.lock().unwrap().remove(0);
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let state: Value = c.get(url(&node, "/admin/state")).send().await.unwrap().json().await.unwrap();
            let r0 = state["replicas"].as_array().unwrap().iter().find(|r| r["id"] == ids[0]).unwrap().clone();
            if r0["health"] == "draining" {
                break;
            }
            assert!(Instant::now() < deadline, "r0 never drained: {state}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for i in 0..6 {
            let (status, r) = complete(&c, &node, &text(&format!("d{i}"), 600)).await;
            assert_eq!(status, 200);
            assert_eq!(r, ids[1]);
        }
        node.shutdown().await;
        for r in reps {
            r.shutdown().await;
        }
    })
    .await;
}
