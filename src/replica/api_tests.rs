//! The Anthropic Messages, Responses and pooling routes over a real loopback replica: headers,
//! shapes, shared prefix-cache entries across APIs, the response store, errors and faults.

use std::time::Duration;

use serde_json::{json, Value};

use super::{spawn, FaultConfig, ReplicaConfig, ReplicaHandle};

const LIMIT: Duration = Duration::from_secs(30);

async fn replica(faults: FaultConfig) -> ReplicaHandle {
    let mut cfg = ReplicaConfig {
        id: "r-api".into(),
        exit_on_crash: false,
        faults,
        ..ReplicaConfig::default()
    };
    cfg.engine.time_scale = 50.0;
    spawn(cfg).await.unwrap()
}

/// A text of about `n` tokens, distinct per seed.
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

fn client() -> reqwest::Client {
    // reqwest is built without a default TLS provider (plain HTTP here, but it wants one).
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

async fn get(url: String) -> reqwest::Response {
    client().get(url).send().await.unwrap()
}

/// POSTs `body` to `path`: status, the `x-kvmesh-*` headers (cached, prompt) and the body text.
async fn post(base: &str, path: &str, body: Value) -> (u16, Option<(usize, usize)>, String) {
    let resp = client()
        .post(format!("{base}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let h = resp.headers();
    let num = |name: &str| {
        h.get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok())
    };
    let charge = num("x-kvmesh-cached-tokens").zip(num("x-kvmesh-prompt-tokens"));
    // Answers carry the replica's id; errors, as the completions', carry no charge.
    if status == 200 {
        assert_eq!(
            h.get("x-kvmesh-replica").and_then(|v| v.to_str().ok()),
            Some("r-api"),
            "{path}"
        );
    }
    if charge.is_some() {
        assert!(h.get("x-kvmesh-dp-rank").is_some());
    }
    (status, charge, resp.text().await.unwrap())
}

fn json_of(text: &str) -> Value {
    serde_json::from_str(text).unwrap()
}

#[tokio::test]
async fn messages_share_the_chat_prefix_cache() {
    tokio::time::timeout(LIMIT, async {
        let r = replica(FaultConfig::default()).await;
        let base = r.base_url();
        let (system, user) = (text("sys", 64), text("user", 64));
        let chat = json!({"max_tokens": 2, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": user}]});
        let (status, charge, _) = post(&base, "/v1/chat/completions", chat).await;
        assert_eq!(status, 200);
        let (_, prompt) = charge.unwrap();
        let messages = json!({"model": "m", "max_tokens": 3, "system": system,
                              "messages": [{"role": "user", "content": user}]});
        let (status, charge, body) = post(&base, "/v1/messages", messages.clone()).await;
        assert_eq!(status, 200, "{body}");
        let (cached, same_prompt) = charge.unwrap();
        assert_eq!(same_prompt, prompt);
        assert!(cached > prompt / 2, "{cached} of {prompt} cached");
        let v = json_of(&body);
        assert!(v["id"].as_str().unwrap().starts_with("msg_r-api-"));
        assert_eq!(v["usage"]["cache_read_input_tokens"], cached);
        assert_eq!(v["usage"]["input_tokens"], prompt - cached);
        assert_eq!(v["usage"]["output_tokens"], 3);
        assert_eq!(v["stop_reason"], "max_tokens");

        let (status, _, body) = post(&base, "/v1/messages/count_tokens", messages).await;
        assert_eq!(
            (status, json_of(&body)["input_tokens"].as_u64()),
            (200, Some(prompt as u64))
        );

        let mut streamed = json!({"max_tokens": 2, "stream": true,
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": "hi"}]});
        let (status, charge, body) = post(&base, "/v1/messages", streamed.clone()).await;
        assert_eq!(status, 200);
        assert!(charge.is_some());
        assert!(body.starts_with("event: message_start\n"), "{body}");
        assert!(body.contains(r#""stop_reason":"tool_use""#));
        assert!(body.ends_with("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"));

        streamed["max_tokens"] = json!(0);
        let (status, charge, body) = post(&base, "/v1/messages", streamed).await;
        assert_eq!((status, charge), (400, None));
        assert_eq!(json_of(&body)["error"]["type"], "invalid_request_error");
        assert_eq!(json_of(&body)["type"], "error");
        r.shutdown().await;
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn responses_chain_through_the_store() {
    tokio::time::timeout(LIMIT, async {
        let r = replica(FaultConfig::default()).await;
        let base = r.base_url();
        let first = json!({"model": "m", "instructions": text("ins", 40),
                           "input": text("turn1", 40), "max_output_tokens": 4});
        let (status, charge, body) = post(&base, "/v1/responses", first).await;
        assert_eq!(status, 200, "{body}");
        let (_, prompt1) = charge.unwrap();
        let v = json_of(&body);
        let id = v["id"].as_str().unwrap().to_owned();
        assert!(id.starts_with("resp_r-api_"), "{id}");
        assert_eq!(v["usage"]["input_tokens"], prompt1);
        assert_eq!(v["status"], "completed");

        let second = json!({"instructions": text("ins", 40), "input": "and then?",
                            "previous_response_id": id, "stream": true});
        let (status, charge, body) = post(&base, "/v1/responses", second).await;
        assert_eq!(status, 200);
        let (cached, prompt2) = charge.unwrap();
        assert!(
            prompt2 > prompt1 && cached >= prompt1 / 2,
            "{cached}/{prompt2}"
        );
        assert!(body.starts_with("event: response.created\n"), "{body}");
        let completed = body
            .split("\n\n")
            .find(|e| e.starts_with("event: response.completed"))
            .and_then(|e| e.split_once("data: "))
            .map(|(_, d)| json_of(d))
            .unwrap();
        let id2 = completed["response"]["id"].as_str().unwrap().to_owned();
        assert_eq!(completed["response"]["previous_response_id"], id);

        let got = get(format!("{base}/v1/responses/{id2}")).await;
        assert_eq!(got.status(), 200);
        assert_eq!(json_of(&got.text().await.unwrap()), completed["response"]);

        let unknown = json!({"input": "x", "previous_response_id": "resp_r-api_999999"});
        let (status, charge, body) = post(&base, "/v1/responses", unknown).await;
        assert_eq!((status, charge), (404, None));
        let e = json_of(&body);
        assert_eq!(e["error"]["param"], "previous_response_id");
        assert!(e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("resp_r-api_999999"));

        let (status, _, _) = post(&base, &format!("/v1/responses/{id}/cancel"), json!({})).await;
        assert_eq!(status, 400);
        let (status, _, _) = post(&base, "/v1/responses/resp_nope/cancel", json!({})).await;
        assert_eq!(status, 404);
        let missing = get(format!("{base}/v1/responses/resp_nope")).await;
        assert_eq!(missing.status(), 404);

        let unstored = json!({"input": "x", "store": false});
        let (_, _, body) = post(&base, "/v1/responses", unstored).await;
        let id3 = json_of(&body)["id"].as_str().unwrap().to_owned();
        let gone = get(format!("{base}/v1/responses/{id3}")).await;
        assert_eq!(gone.status(), 404);
        r.shutdown().await;
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn pooling_runs_through_the_engine() {
    tokio::time::timeout(LIMIT, async {
        let r = replica(FaultConfig::default()).await;
        let base = r.base_url();
        let (status, charge, body) = post(
            &base,
            "/v1/embeddings",
            json!({"model": "m", "input": ["abcdefgh", "abcd"], "dimensions": 4}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(charge.map(|c| c.1), Some(3));
        let v = json_of(&body);
        assert_eq!(v["usage"]["prompt_tokens"], 3);
        assert_eq!(v["data"][1]["embedding"].as_array().map(Vec::len), Some(4));

        for path in ["/rerank", "/v1/rerank", "/v2/rerank"] {
            let body = json!({"query": "q", "documents": ["a", "b", "c"], "top_n": 2});
            let (status, charge, text) = post(&base, path, body).await;
            assert_eq!(status, 200);
            assert_eq!(charge.map(|c| c.1), Some(3));
            assert_eq!(json_of(&text)["results"].as_array().map(Vec::len), Some(2));
        }
        let (status, charge, text) = post(
            &base,
            "/v1/score",
            json!({"text_1": "q", "text_2": ["a", "b"]}),
        )
        .await;
        assert_eq!((status, charge.map(|c| c.1)), (200, Some(2)));
        assert_eq!(json_of(&text)["data"][1]["index"], 1);

        let (status, _, _) = post(&base, "/v1/embeddings", json!({"input": [""]})).await;
        assert_eq!(status, 400);
        let metrics = get(format!("{base}/metrics")).await;
        assert!(metrics.text().await.unwrap().contains("vllm:"));
        r.shutdown().await;
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn faults_hit_the_new_endpoints_in_their_shapes() {
    tokio::time::timeout(LIMIT, async {
        let r = replica(FaultConfig {
            error_rate: 1.0,
            ..FaultConfig::default()
        })
        .await;
        let base = r.base_url();
        let msg = json!({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]});
        let (status, _, body) = post(&base, "/v1/messages", msg.clone()).await;
        assert_eq!(status, 500);
        assert_eq!(json_of(&body)["error"]["type"], "api_error");
        // Answered by the front: no fault.
        let (status, _, _) = post(&base, "/v1/messages/count_tokens", msg).await;
        assert_eq!(status, 200);
        for (path, body) in [
            ("/v1/responses", json!({"input": "x"})),
            ("/v1/embeddings", json!({"input": "x"})),
        ] {
            let (status, _, text) = post(&base, path, body).await;
            assert_eq!(status, 500);
            assert_eq!(json_of(&text)["error"]["code"], 500);
        }
        r.shutdown().await;
    })
    .await
    .unwrap();
}
