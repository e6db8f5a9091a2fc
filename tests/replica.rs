//! End-to-end tests of `kvmesh replica` over real loopback sockets: HTTP streaming, cache-hit TTFT,
//! metrics, errors, faults and the ZMQ KV-event stream with replay.

use std::future::Future;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvmesh::engine_sim::prefix_cache::block_hashes;
use kvmesh::engine_sim::{tokenize, Engine, EngineConfig};
use kvmesh::kv_events::{decode_batch, KvEvent, END_OF_REPLAY_SEQ};
use kvmesh::replica::{self, FaultConfig, KvEventsConfig, ReplicaConfig, ReplicaHandle};
use serde_json::{json, Value};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

const LIMIT: Duration = Duration::from_secs(30);

async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(LIMIT, f)
        .await
        .expect("test exceeded its time bound")
}

fn client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder().build().unwrap()
}

fn config() -> ReplicaConfig {
    ReplicaConfig {
        id: "r-test".into(),
        exit_on_crash: false,
        ..ReplicaConfig::default()
    }
}

async fn start(cfg: ReplicaConfig) -> ReplicaHandle {
    replica::spawn(cfg).await.unwrap()
}

/// Text whose tokenization is `n` tokens, all distinct from other seeds' texts.
fn text(seed: &str, n: usize) -> String {
    let mut s = String::new();
    let mut i = 0;
    while s.len() < n * 4 {
        s.push_str(&format!("{seed}-{i:07} "));
        i += 1;
    }
    s.truncate(n * 4);
    s
}

/// Streams a completion; returns (time to first body chunk, headers, whole body).
async fn stream_completion(
    c: &reqwest::Client,
    base: &str,
    prompt: &str,
    max_tokens: u32,
) -> (Duration, reqwest::header::HeaderMap, String) {
    let started = Instant::now();
    let resp = c
        .post(format!("{base}/v1/completions"))
        .json(
            &json!({"prompt": prompt, "max_tokens": max_tokens, "stream": true,
                      "stream_options": {"include_usage": true}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let headers = resp.headers().clone();
    let mut stream = resp.bytes_stream();
    let mut body = String::new();
    let mut ttft = None;
    while let Some(chunk) = stream.next().await {
        ttft.get_or_insert_with(|| started.elapsed());
        body.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    (ttft.unwrap(), headers, body)
}

fn header_usize(h: &reqwest::header::HeaderMap, name: &str) -> usize {
    h.get(name).unwrap().to_str().unwrap().parse().unwrap()
}

#[tokio::test]
async fn streams_and_a_cache_hit_cuts_ttft_by_the_modelled_factor() {
    bounded(async {
        // Scale 0.5 makes the modelled times (376 ms cold, 115 ms warm for an 8k prompt with 6k
        // cached, engine-timing.md §3) large against HTTP and tokenizing overheads; a busy 2-core
        // CI machine once added 40 ms to a 28 ms warm request at scale 2.
        let time_scale = 0.5;
        let r = start(ReplicaConfig {
            engine: EngineConfig {
                time_scale,
                ..EngineConfig::default()
            },
            ..config()
        })
        .await;
        let c = client();
        let base = r.base_url();
        let model = Engine::new(EngineConfig::default());
        let modelled_cold = model.step_ms(&[(8192, 0)], 0, 0);
        let modelled_warm = model.step_ms(&[(2048, 6144)], 0, 0);
        let modelled = modelled_cold / modelled_warm;

        // Scheduling noise only ever adds time, and to either request, so each attempt uses a
        // fresh shared prefix and the test passes on the first attempt whose ratio is in range.
        // A model without the cache discount (ratio 1) fails every attempt.
        let mut attempts = Vec::new();
        let mut in_range = None;
        for attempt in 0..3 {
            let shared = text(&format!("system{attempt}"), 6144);
            let first = format!("{shared}{}", text(&format!("alpha{attempt}"), 2048));
            let second = format!("{shared}{}", text(&format!("bravo{attempt}"), 2048));

            let (cold, h1, body) = stream_completion(&c, &base, &first, 4).await;
            assert_eq!(h1.get("x-kvmesh-replica").unwrap(), "r-test");
            assert_eq!(header_usize(&h1, "x-kvmesh-prompt-tokens"), 8192);
            assert_eq!(header_usize(&h1, "x-kvmesh-cached-tokens"), 0);
            assert_eq!(h1.get("content-type").unwrap(), "text/event-stream");
            let events: Vec<&str> = body.split("\n\n").filter(|e| !e.is_empty()).collect();
            assert_eq!(events.len(), 4 + 1 + 1, "4 tokens, usage, [DONE]: {body}");
            assert_eq!(*events.last().unwrap(), "data: [DONE]");
            let usage: Value =
                serde_json::from_str(events[4].strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(usage["usage"]["completion_tokens"], 4);
            assert_eq!(usage["usage"]["prompt_tokens"], 8192);
            // No noise makes a request faster than its model.
            assert!(cold.as_secs_f64() * 1000.0 >= modelled_cold / time_scale * 0.95);

            let (warm, h2, _) = stream_completion(&c, &base, &second, 4).await;
            assert_eq!(header_usize(&h2, "x-kvmesh-cached-tokens"), 6144);

            let measured = cold.as_secs_f64() / warm.as_secs_f64();
            eprintln!("cold {cold:?} warm {warm:?} ratio {measured:.2} modelled {modelled:.2}");
            attempts.push(format!("{cold:?}/{warm:?} = {measured:.2}"));
            if measured > modelled * 0.6 && measured < modelled * 1.4 {
                in_range = Some((cold, second));
                break;
            }
        }
        let Some((cold, second)) = in_range else {
            panic!("no attempt's cold/warm ratio was within 0.6-1.4x of the modelled {modelled:.2}: {attempts:?}");
        };

        // An identical prompt hits all but its last block.
        let (again, h3, _) = stream_completion(&c, &base, &second, 1).await;
        assert_eq!(header_usize(&h3, "x-kvmesh-cached-tokens"), 8192 - 16);
        assert!(
            again < cold / 4,
            "identical prompt TTFT {again:?} vs cold {cold:?}"
        );
        r.shutdown().await;
    })
    .await;
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing in\n{text}"))
}

#[tokio::test]
async fn metrics_count_the_requests_sent() {
    bounded(async {
        let r = start(ReplicaConfig {
            engine: EngineConfig {
                time_scale: 50.0,
                ..EngineConfig::default()
            },
            ..config()
        })
        .await;
        let c = client();
        let base = r.base_url();
        let shared = text("sys", 256);
        let (mut prompt_tokens, mut cached_tokens) = (0, 0);
        for i in 0..6 {
            let prompt = format!("{shared}{}", text(&format!("q{i}"), 40));
            let h = if i % 2 == 0 {
                stream_completion(&c, &base, &prompt, 3).await.1
            } else {
                let resp = c
                    .post(format!("{base}/v1/chat/completions"))
                    .json(&json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 3}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), 200);
                let h = resp.headers().clone();
                let body: Value = resp.json().await.unwrap();
                assert_eq!(body["object"], "chat.completion");
                assert_eq!(body["choices"][0]["message"]["content"], " the quick brown");
                assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], header_usize(&h, "x-kvmesh-cached-tokens"));
                h
            };
            prompt_tokens += header_usize(&h, "x-kvmesh-prompt-tokens");
            cached_tokens += header_usize(&h, "x-kvmesh-cached-tokens");
        }
        assert!(cached_tokens > 0);
        let text = c.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
        assert_eq!(metric(&text, "vllm:time_to_first_token_seconds_count"), 6.0);
        assert_eq!(metric(&text, "vllm:request_success_total"), 6.0);
        assert_eq!(metric(&text, "vllm:prefix_cache_queries_total"), prompt_tokens as f64);
        assert_eq!(metric(&text, "vllm:prefix_cache_hits_total"), cached_tokens as f64);
        assert_eq!(metric(&text, "vllm:num_requests_running"), 0.0);
        assert_eq!(metric(&text, "vllm:num_requests_waiting"), 0.0);
        assert_eq!(metric(&text, "vllm:kv_cache_usage_perc"), 0.0);
        assert!(text.contains(r#"num_gpu_blocks="28125""#) && text.contains(r#"block_size="16""#));
        assert!(text.contains(r#"model_name="sim-llama-8b""#));
        let load: Value = c.get(format!("{base}/load")).send().await.unwrap().json().await.unwrap();
        assert_eq!(load["server_load"], 0);
        r.shutdown().await;
    })
    .await;
}

async fn expect_error(resp: reqwest::Response, status: u16) -> Value {
    assert_eq!(resp.status(), status);
    let body: Value = resp.json().await.unwrap();
    assert!(body["error"]["message"].is_string(), "{body}");
    assert!(body["error"]["type"].is_string(), "{body}");
    body
}

#[tokio::test]
async fn rejects_bad_requests_in_openai_shape() {
    bounded(async {
        let r = start(ReplicaConfig {
            max_body_bytes: 4096,
            ..config()
        })
        .await;
        let c = client();
        let base = r.base_url();
        let post = |path: &str, body: String| {
            c.post(format!("{base}{path}"))
                .header("content-type", "application/json")
                .body(body)
                .send()
        };
        expect_error(
            post("/v1/completions", "{not json".into()).await.unwrap(),
            400,
        )
        .await;
        expect_error(
            post("/v1/completions", r#"{"max_tokens": 3}"#.into())
                .await
                .unwrap(),
            400,
        )
        .await;
        expect_error(
            post("/v1/chat/completions", r#"{"prompt": "x"}"#.into())
                .await
                .unwrap(),
            400,
        )
        .await;
        let big = json!({"prompt": "x".repeat(10_000)}).to_string();
        expect_error(post("/v1/completions", big.clone()).await.unwrap(), 413).await;
        // Without a Content-Length (chunked), the limit applies while reading.
        let chunks: Vec<Result<Vec<u8>, std::io::Error>> = big
            .into_bytes()
            .chunks(1000)
            .map(|c| Ok(c.to_vec()))
            .collect();
        let resp = c
            .post(format!("{base}/v1/completions"))
            .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks)))
            .send()
            .await
            .unwrap();
        expect_error(resp, 413).await;
        // Too long for the model: the engine refuses, the client gets a 400.
        let long: Vec<u32> = vec![7; 200_000];
        let r2 = start(config()).await;
        let resp = c
            .post(format!("{}/v1/completions", r2.base_url()))
            .json(&json!({"prompt": long}))
            .send()
            .await
            .unwrap();
        expect_error(resp, 400).await;
        r2.shutdown().await;

        let models: Value = c
            .get(format!("{base}/v1/models"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(models["data"][0]["owned_by"], "vllm");
        assert_eq!(models["data"][0]["id"], "sim-llama-8b");
        assert_eq!(
            c.get(format!("{base}/health"))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );
        r.shutdown().await;
    })
    .await;
}

/// POSTs `body` as JSON to `path` and returns (status, JSON answer).
async fn post_json(c: &reqwest::Client, base: &str, path: &str, body: &Value) -> (u16, Value) {
    let resp = c
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap())
}

#[tokio::test]
async fn tokenizer_endpoints_count_what_completions_charge() {
    bounded(async {
        let r = start(ReplicaConfig {
            engine: EngineConfig {
                time_scale: 50.0,
                ..EngineConfig::default()
            },
            ..config()
        })
        .await;
        let c = client();
        let base = r.base_url();
        let prompt = format!("{} — naïve café ✓ 日本語", text("tok", 37));

        // Completion form: /tokenize counts what /v1/completions reports as prompt_tokens.
        let (status, tok) = post_json(
            &c,
            &base,
            "/tokenize",
            &json!({"model": "sim-llama-8b", "prompt": prompt, "add_special_tokens": true}),
        )
        .await;
        assert_eq!(status, 200, "{tok}");
        assert_eq!(tok["tokens"], json!(tokenize(&prompt)));
        assert_eq!(tok["count"], tok["tokens"].as_array().unwrap().len());
        assert_eq!(tok["max_model_len"], EngineConfig::default().max_model_len);
        assert!(tok["token_strs"].is_null());
        let (status, done) = post_json(
            &c,
            &base,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 1}),
        )
        .await;
        assert_eq!(status, 200, "{done}");
        assert_eq!(done["usage"]["prompt_tokens"], tok["count"]);

        // Round trip through /detokenize.
        let (status, detok) = post_json(
            &c,
            &base,
            "/detokenize",
            &json!({"model": "sim-llama-8b", "tokens": tok["tokens"]}),
        )
        .await;
        assert_eq!(status, 200, "{detok}");
        assert_eq!(detok["prompt"], prompt.as_str());

        // Chat form: the replica's chat template, the same tokens /v1/chat/completions charges.
        let messages = json!([{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": prompt}]);
        let (_, chat_tok) = post_json(
            &c,
            &base,
            "/tokenize",
            &json!({"messages": messages, "add_generation_prompt": true}),
        )
        .await;
        let (status, chat_done) = post_json(
            &c,
            &base,
            "/v1/chat/completions",
            &json!({"messages": messages, "max_tokens": 1}),
        )
        .await;
        assert_eq!(status, 200, "{chat_done}");
        assert_eq!(chat_done["usage"]["prompt_tokens"], chat_tok["count"]);
        let (_, chat_text) = post_json(
            &c,
            &base,
            "/detokenize",
            &json!({"tokens": chat_tok["tokens"]}),
        )
        .await;
        assert_eq!(
            chat_text["prompt"],
            format!("<|system|>\nBe brief.\n<|user|>\n{prompt}\n<|assistant|>\n").as_str()
        );

        // Render: a list of GenerateRequest for completions, one GenerateRequest for chat.
        let (status, rendered) = post_json(
            &c,
            &base,
            "/v1/completions/render",
            &json!({"model": "sim-llama-8b", "prompt": prompt, "max_tokens": 3}),
        )
        .await;
        assert_eq!(status, 200, "{rendered}");
        let entry = &rendered.as_array().unwrap()[0];
        assert_eq!(entry["token_ids"], tok["tokens"]);
        assert_eq!(entry["prompt_token_ids"], tok["tokens"]);
        assert_eq!(entry["sampling_params"]["max_tokens"], 3);
        assert_eq!(entry["model"], "sim-llama-8b");
        assert!(entry["request_id"].as_str().unwrap().starts_with("cmpl-"));
        let (status, chat_rendered) = post_json(
            &c,
            &base,
            "/v1/chat/completions/render",
            &json!({"messages": messages}),
        )
        .await;
        assert_eq!(status, 200, "{chat_rendered}");
        assert_eq!(chat_rendered["token_ids"], chat_tok["tokens"]);
        assert!(chat_rendered["request_id"]
            .as_str()
            .unwrap()
            .starts_with("chatcmpl-"));
        r.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn tokenizer_endpoints_reject_bad_input_in_openai_shape() {
    bounded(async {
        let r = start(ReplicaConfig {
            max_body_bytes: 4096,
            ..config()
        })
        .await;
        let c = client();
        let base = r.base_url();
        let raw = |path: &str, body: String| {
            c.post(format!("{base}{path}"))
                .header("content-type", "application/json")
                .body(body)
                .send()
        };
        for path in [
            "/tokenize",
            "/detokenize",
            "/v1/completions/render",
            "/v1/chat/completions/render",
        ] {
            expect_error(raw(path, "{not json".into()).await.unwrap(), 400).await;
            expect_error(raw(path, "[1, 2]".into()).await.unwrap(), 400).await;
            let big = json!({"prompt": "x".repeat(10_000)}).to_string();
            expect_error(raw(path, big).await.unwrap(), 413).await;
        }
        for (path, body) in [
            ("/tokenize", json!({"model": "m"})),
            ("/tokenize", json!({"prompt": ["a"]})),
            ("/tokenize", json!({"prompt": "a", "model": 7})),
            (
                "/tokenize",
                json!({"messages": [{"role": "user", "content": "a"}],
                                 "add_generation_prompt": true, "continue_final_message": true}),
            ),
            ("/detokenize", json!({"tokens": [1, -2]})),
            ("/detokenize", json!({"tokens": [4_294_967_296u64]})),
            ("/v1/completions/render", json!({"prompt": ["a", "b"]})),
            (
                "/v1/completions/render",
                json!({"prompt": "a", "max_tokens": 1_000_000}),
            ),
            ("/v1/chat/completions/render", json!({"messages": []})),
        ] {
            let resp = c
                .post(format!("{base}{path}"))
                .json(&body)
                .send()
                .await
                .unwrap();
            let err = expect_error(resp, 400).await;
            assert_eq!(err["error"]["code"], 400, "{path} {body}: {err}");
        }
        r.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn faults_by_admin_endpoint() {
    bounded(async {
        let mut r = start(ReplicaConfig {
            engine: EngineConfig {
                time_scale: 50.0,
                ..EngineConfig::default()
            },
            faults: FaultConfig {
                crash_after: Some(4),
                ..FaultConfig::default()
            },
            ..config()
        })
        .await;
        let c = client();
        let base = r.base_url();
        let complete = || {
            c.post(format!("{base}/v1/completions"))
                .json(&json!({"prompt": "hello", "max_tokens": 2}))
                .send()
        };
        let admin = |body: Value| c.post(format!("{base}/admin/faults")).json(&body).send();

        assert_eq!(
            admin(json!({"error_rate": 1.0})).await.unwrap().status(),
            200
        );
        let body = expect_error(complete().await.unwrap(), 500).await;
        assert_eq!(body["error"]["type"], "InternalServerError");
        admin(json!({"error_rate": 0.0, "added_latency_ms": 150}))
            .await
            .unwrap();
        let t = Instant::now();
        assert_eq!(complete().await.unwrap().status(), 200);
        assert!(t.elapsed() >= Duration::from_millis(150));

        // Refusing: new connections fail until the window ends.
        admin(json!({"added_latency_ms": 0, "refuse_connections_ms": 400}))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let fresh = client();
        let url = format!("{base}/v1/completions");
        let refused = fresh.post(&url).json(&json!({"prompt": "x"})).send().await;
        assert!(
            refused.is_err(),
            "connection should be refused: {refused:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            fresh
                .post(&url)
                .json(&json!({"prompt": "x"}))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );

        // Hang: the request never completes.
        admin(json!({"hang": true})).await.unwrap();
        let hung = tokio::time::timeout(Duration::from_millis(300), complete()).await;
        assert!(hung.is_err(), "hang fault answered");
        admin(json!({"hang": false})).await.unwrap();

        // crash_after 4 counted the 500, the delayed request, the fresh one and the hung one; the
        // next request crashes the replica.
        let _ = complete().await;
        tokio::time::timeout(Duration::from_secs(5), r.stopped())
            .await
            .unwrap();
        r.shutdown().await;
    })
    .await;
}

fn kv_config() -> ReplicaConfig {
    ReplicaConfig {
        engine: EngineConfig {
            time_scale: 50.0,
            ..EngineConfig::default()
        },
        kv_events: Some(KvEventsConfig {
            topic: "kv@r-test@sim".into(),
            ..KvEventsConfig::default()
        }),
        ..config()
    }
}

#[tokio::test]
async fn kv_events_stream_decodes_to_the_engine_blocks() {
    bounded(async {
        let r = start(kv_config()).await;
        let mut sub = SubSocket::new();
        sub.connect(&format!("tcp://127.0.0.1:{}", r.kv_events_port.unwrap()))
            .await
            .unwrap();
        sub.subscribe("kv@").await.unwrap();
        // Let the subscription reach the publisher (ZMQ's slow-joiner window).
        tokio::time::sleep(Duration::from_millis(300)).await;
        let c = client();
        let prompt = text("events", 100);
        stream_completion(&c, &r.base_url(), &prompt, 2).await;
        let msg = tokio::time::timeout(Duration::from_secs(5), sub.recv())
            .await
            .unwrap()
            .unwrap();
        let frames = msg.into_vec();
        assert_eq!(frames.len(), 3);
        assert_eq!(&frames[0][..], b"kv@r-test@sim");
        assert_eq!(u64::from_be_bytes(frames[1][..].try_into().unwrap()), 0);
        let batch = decode_batch(&frames[2]).unwrap();
        assert_eq!(batch.data_parallel_rank, Some(0));
        let tokens = tokenize(&prompt);
        let KvEvent::BlockStored(stored) = &batch.events[0] else {
            panic!("expected BlockStored, got {:?}", batch.events);
        };
        assert_eq!(stored.block_size, 16);
        assert_eq!(stored.parent_block_hash, None);
        assert_eq!(stored.token_ids, tokens[..96]);
        assert_eq!(stored.block_hashes, block_hashes(&tokens, 16));

        // vLLM's /reset_prefix_cache publishes AllBlocksCleared as the next batch.
        let resp = c
            .post(format!("{}/reset_prefix_cache", r.base_url()))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let frames = tokio::time::timeout(Duration::from_secs(5), sub.recv())
            .await
            .unwrap()
            .unwrap()
            .into_vec();
        assert_eq!(u64::from_be_bytes(frames[1][..].try_into().unwrap()), 1);
        assert_eq!(
            decode_batch(&frames[2]).unwrap().events,
            vec![KvEvent::AllBlocksCleared]
        );
        let (_, h, _) = stream_completion(&c, &r.base_url(), &prompt, 1).await;
        assert_eq!(
            header_usize(&h, "x-kvmesh-cached-tokens"),
            0,
            "cache was cleared"
        );
        r.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn late_subscriber_catches_up_through_replay() {
    bounded(async {
        let r = start(ReplicaConfig {
            engine: EngineConfig {
                kv_capacity_tokens: 16 * 20,
                ..kv_config().engine
            },
            ..kv_config()
        })
        .await;
        let c = client();
        // Three distinct 160-token prompts in a 320-token cache: stores, then evictions.
        for i in 0..3 {
            stream_completion(&c, &r.base_url(), &text(&format!("doc{i}"), 160), 2).await;
        }
        let mut dealer = DealerSocket::new();
        dealer
            .connect(&format!("tcp://127.0.0.1:{}", r.kv_replay_port.unwrap()))
            .await
            .unwrap();
        let request = ZmqMessage::try_from(vec![
            bytes::Bytes::new(),
            bytes::Bytes::copy_from_slice(&0u64.to_be_bytes()),
        ])
        .unwrap();
        dealer.send(request).await.unwrap();
        let mut seqs = Vec::new();
        let (mut stored, mut removed) = (0, 0);
        loop {
            let frames = tokio::time::timeout(Duration::from_secs(5), dealer.recv())
                .await
                .unwrap()
                .unwrap()
                .into_vec();
            assert_eq!(frames.len(), 3, "[\"\", seq, payload]");
            assert!(frames[0].is_empty());
            if frames[1][..] == END_OF_REPLAY_SEQ {
                assert!(frames[2].is_empty());
                break;
            }
            seqs.push(u64::from_be_bytes(frames[1][..].try_into().unwrap()));
            for event in decode_batch(&frames[2]).unwrap().events {
                match event {
                    KvEvent::BlockStored(_) => stored += 1,
                    KvEvent::BlockRemoved(_) => removed += 1,
                    other => panic!("unexpected {other:?}"),
                }
            }
        }
        assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>());
        assert_eq!(stored, 3);
        assert!(removed >= 1, "the third prompt must evict");
        // Asking from a later sequence replays only the tail.
        let from = seqs.len() as u64 - 1;
        let request = ZmqMessage::try_from(vec![
            bytes::Bytes::new(),
            bytes::Bytes::copy_from_slice(&from.to_be_bytes()),
        ])
        .unwrap();
        dealer.send(request).await.unwrap();
        let frames = dealer.recv().await.unwrap().into_vec();
        assert_eq!(u64::from_be_bytes(frames[1][..].try_into().unwrap()), from);
        let end = dealer.recv().await.unwrap().into_vec();
        assert_eq!(&end[1][..], &END_OF_REPLAY_SEQ);
        r.shutdown().await;
    })
    .await;
}
