//! The gateway stand-in (`kvmesh::bench::gateway`) against a tiny fake endpoint picker: a real
//! tonic ext_proc server on loopback that decides once the body is whole (as a picker does),
//! echoes the body back as streamed body responses (full-duplex mode) and records what the
//! gateway sent in both phases; in front of simulated replicas.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, processing_response, BodyMutation, BodyResponse,
    CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse, ProcessingRequest,
    ProcessingResponse, StreamedBodyResponse,
};
use envoy_types::pb::google::protobuf::value::Kind;
use futures::Stream;
use kvmesh::bench::gateway::{Gateway, GatewayConfig};
use serde_json::json;
use tokio::sync::mpsc;

mod common;
use common::{client, sim_replica};

/// What the fake picker answers.
#[derive(Clone)]
enum Answer {
    /// Pick these endpoints (`ip:port,…`).
    Pick(String),
    /// Answer the request itself with this status.
    Immediate(u32),
}

/// What the fake picker saw, over all its streams.
#[derive(Default, Debug)]
struct Seen {
    /// Request headers of the last stream (key, value).
    headers: Vec<(String, String)>,
    /// Body chunks of the last stream, and their bytes.
    chunks: usize,
    body_bytes: usize,
    /// `:status` of each response-headers message.
    statuses: Vec<String>,
    /// The served endpoint of each response-phase message that named one.
    served: Vec<String>,
    /// Response bodies' ends seen.
    ends: usize,
}

struct FakePicker {
    answer: Answer,
    seen: Arc<Mutex<Seen>>,
}

fn headers_answer(dest: &str) -> ProcessingResponse {
    let set = HeaderValueOption {
        header: Some(HeaderValue {
            key: "x-gateway-destination-endpoint".into(),
            raw_value: dest.as_bytes().to_vec(),
            ..HeaderValue::default()
        }),
        ..HeaderValueOption::default()
    };
    ProcessingResponse {
        response: Some(processing_response::Response::RequestHeaders(
            HeadersResponse {
                response: Some(CommonResponse {
                    header_mutation: Some(HeaderMutation {
                        set_headers: vec![set],
                        ..HeaderMutation::default()
                    }),
                    ..CommonResponse::default()
                }),
            },
        )),
        ..ProcessingResponse::default()
    }
}

fn body_answer(body: Vec<u8>, end: bool) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::RequestBody(BodyResponse {
            response: Some(CommonResponse {
                body_mutation: Some(BodyMutation {
                    mutation: Some(body_mutation::Mutation::StreamedResponse(
                        StreamedBodyResponse {
                            body,
                            end_of_stream: end,
                            ..StreamedBodyResponse::default()
                        },
                    )),
                }),
                ..CommonResponse::default()
            }),
        })),
        ..ProcessingResponse::default()
    }
}

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for FakePicker {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Answers>, tonic::Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel::<Result<ProcessingResponse, tonic::Status>>(1024);
        let (answer, seen) = (self.answer.clone(), Arc::clone(&self.seen));
        tokio::spawn(async move {
            let mut held = Vec::new();
            let decide = |held: &mut Vec<Vec<u8>>| -> Vec<ProcessingResponse> {
                match &answer {
                    Answer::Immediate(code) => vec![ProcessingResponse {
                        response: Some(processing_response::Response::ImmediateResponse(
                            ImmediateResponse {
                                status: Some(HttpStatus { code: *code as i32 }),
                                body: b"no replica can serve".to_vec(),
                                ..ImmediateResponse::default()
                            },
                        )),
                        ..ProcessingResponse::default()
                    }],
                    // The pick, then the body back re-chunked (as a picker may).
                    Answer::Pick(dest) => {
                        let whole: Vec<u8> = held.drain(..).flatten().collect();
                        let chunks: Vec<&[u8]> = whole.chunks(50_000).collect();
                        let n = chunks.len();
                        std::iter::once(headers_answer(dest))
                            .chain(
                                chunks
                                    .into_iter()
                                    .enumerate()
                                    .map(|(i, b)| body_answer(b.to_vec(), i + 1 == n)),
                            )
                            .collect()
                    }
                }
            };
            while let Ok(Some(msg)) = inbound.message().await {
                let served = msg
                    .metadata_context
                    .as_ref()
                    .and_then(|m| m.filter_metadata.get("envoy.lb"))
                    .and_then(|s| s.fields.get("x-gateway-destination-endpoint-served"))
                    .and_then(|v| match &v.kind {
                        Some(Kind::StringValue(s)) => Some(s.clone()),
                        _ => None,
                    });
                let mut out = Vec::new();
                {
                    let mut seen = seen.lock().unwrap();
                    if let Some(s) = served {
                        seen.served.push(s);
                    }
                    match msg.request {
                        Some(processing_request::Request::RequestHeaders(h)) => {
                            seen.headers = h
                                .headers
                                .unwrap_or_default()
                                .headers
                                .into_iter()
                                .map(|h| {
                                    (h.key, String::from_utf8_lossy(&h.raw_value).into_owned())
                                })
                                .collect();
                            seen.chunks = 0;
                            seen.body_bytes = 0;
                            if h.end_of_stream {
                                out = decide(&mut held);
                            }
                        }
                        Some(processing_request::Request::RequestBody(b)) => {
                            seen.chunks += 1;
                            seen.body_bytes += b.body.len();
                            held.push(b.body);
                            if b.end_of_stream {
                                out = decide(&mut held);
                            }
                        }
                        Some(processing_request::Request::ResponseHeaders(h)) => {
                            let status = h
                                .headers
                                .unwrap_or_default()
                                .headers
                                .into_iter()
                                .find(|h| h.key == ":status")
                                .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
                                .unwrap_or_default();
                            seen.statuses.push(status);
                        }
                        Some(processing_request::Request::ResponseBody(b)) if b.end_of_stream => {
                            seen.ends += 1;
                        }
                        _ => {}
                    }
                }
                for m in out {
                    if tx.send(Ok(m)).await.is_err() {
                        return;
                    }
                }
            }
        });
        let stream =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
        Ok(tonic::Response::new(Box::pin(stream)))
    }
}

/// A fake picker on loopback; returns its address and what it saw.
async fn fake_picker(answer: Answer) -> (SocketAddr, Arc<Mutex<Seen>>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = futures::stream::unfold(listener, |l| async move {
        let conn = l.accept().await.map(|(s, _)| s);
        Some((conn, l))
    });
    let svc = ExternalProcessorServer::new(FakePicker {
        answer,
        seen: Arc::clone(&seen),
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(incoming),
    );
    (addr, seen)
}

/// An address nothing listens on.
async fn dead_addr() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap()
}

/// `n` bytes of prompt text.
fn prompt(n: usize) -> String {
    "gateway prompt text ".repeat(n / 20 + 1)[..n].to_owned()
}

async fn post(c: &reqwest::Client, gw: &Gateway, body: &serde_json::Value) -> reqwest::Response {
    c.post(format!("http://{}/v1/completions", gw.addr))
        .json(body)
        .send()
        .await
        .unwrap()
}

/// The request goes where the picker says, whole though it reached the picker in chunks, and
/// the picker hears the answer's status, its end, and which endpoint served.
#[tokio::test]
async fn the_request_goes_where_the_picker_says_and_the_picker_hears_what_served() {
    common::bounded(40, async {
        let r0 = sim_replica("r0", |_| {}).await;
        let r1 = sim_replica("r1", |_| {}).await;
        let (picker, seen) = fake_picker(Answer::Pick(r1.addr.to_string())).await;
        let gw = Gateway::spawn(GatewayConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            vec![picker],
        ))
        .await
        .unwrap();
        let c = client();
        let body = json!({"model": "sim-llama-8b", "prompt": prompt(200_000), "max_tokens": 4});
        let direct = c
            .post(format!("http://{}/v1/completions", r0.addr))
            .json(&body)
            .send()
            .await
            .unwrap();
        let prompt_tokens = direct.headers()["x-kvmesh-prompt-tokens"].clone();
        let _ = direct.bytes().await.unwrap();
        let resp = post(&c, &gw, &body).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["x-kvmesh-replica"], "r1");
        assert_eq!(
            resp.headers()["x-kvmesh-prompt-tokens"],
            prompt_tokens,
            "the body the picker sent back, whole"
        );
        let text = resp.text().await.unwrap();
        assert!(text.contains("\"choices\""), "{text}");
        // The tap's end reaches the picker after the client has its answer: wait for it.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while seen.lock().unwrap().ends == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "no end of body reported"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let seen = std::mem::take(&mut *seen.lock().unwrap());
        let header = |k: &str| {
            seen.headers
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(header(":method").as_deref(), Some("POST"));
        assert_eq!(header(":path").as_deref(), Some("/v1/completions"));
        assert_eq!(header("content-type").as_deref(), Some("application/json"));
        let sent = serde_json::to_vec(&body).unwrap().len();
        assert_eq!(seen.body_bytes, sent, "the whole body, once");
        assert!(seen.chunks >= 4, "{} chunks of at most 64 KiB", seen.chunks);
        assert_eq!(seen.statuses, vec!["200".to_owned()]);
        assert!(!seen.served.is_empty());
        assert!(
            seen.served.iter().all(|s| *s == r1.addr.to_string()),
            "{:?}",
            seen.served
        );
        assert_eq!(gw.stats.forwarded.load(Ordering::SeqCst), 1);
        gw.shutdown().await;
        for r in [r0, r1] {
            r.shutdown().await;
        }
    })
    .await;
}

/// A picker that cannot be reached is skipped for the next one; a picked endpoint that refuses
/// the connection gives way to the pick's fallback; a picker's own answer reaches the client.
#[tokio::test]
async fn dead_pickers_and_endpoints_are_skipped_and_immediate_answers_pass() {
    common::bounded(40, async {
        let r0 = sim_replica("r0", |_| {}).await;
        let dead = dead_addr().await;
        let (picker, seen) = fake_picker(Answer::Pick(format!("{dead},{}", r0.addr))).await;
        let gw = Gateway::spawn(GatewayConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            vec![dead, picker],
        ))
        .await
        .unwrap();
        let c = client();
        for i in 0..4 {
            let body = json!({"model": "sim-llama-8b", "prompt": prompt(100 + i), "max_tokens": 2});
            let resp = post(&c, &gw, &body).await;
            assert_eq!(resp.status(), 200);
            assert_eq!(resp.headers()["x-kvmesh-replica"], "r0");
            let _ = resp.bytes().await.unwrap();
        }
        // Round robin: half the requests started at the dead picker.
        assert_eq!(gw.stats.picker_failures.load(Ordering::SeqCst), 2);
        assert_eq!(gw.stats.fallbacks_used.load(Ordering::SeqCst), 4);
        assert_eq!(gw.stats.no_picker.load(Ordering::SeqCst), 0);
        assert!(!seen.lock().unwrap().served.contains(&dead.to_string()));
        gw.shutdown().await;

        let (busy, _) = fake_picker(Answer::Immediate(503)).await;
        let gw = Gateway::spawn(GatewayConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            vec![busy],
        ))
        .await
        .unwrap();
        let resp = post(&c, &gw, &json!({"model": "sim-llama-8b", "prompt": "x"})).await;
        assert_eq!(resp.status(), 503);
        assert_eq!(resp.text().await.unwrap(), "no replica can serve");
        assert_eq!(gw.stats.immediate.load(Ordering::SeqCst), 1);
        gw.shutdown().await;

        // No picker at all: 503 from the gateway itself.
        let gw = Gateway::spawn(GatewayConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            vec![dead_addr().await],
        ))
        .await
        .unwrap();
        let resp = post(&c, &gw, &json!({"model": "sim-llama-8b", "prompt": "x"})).await;
        assert_eq!(resp.status(), 503);
        assert_eq!(gw.stats.no_picker.load(Ordering::SeqCst), 1);
        gw.shutdown().await;
        r0.shutdown().await;
    })
    .await;
}
