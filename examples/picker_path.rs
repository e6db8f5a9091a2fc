//! Added latency of the endpoint picker (issue #36): decision + ext_proc round trip, as a gateway
//! in FULL_DUPLEX_STREAMED mode sees it, at a fixed rate with 100 KB prompts.
//!
//! A node with 8 simulated replicas (only health-checked: nothing is forwarded) runs its
//! `[picker]` listener in-process; a gateway stand-in (envoy-types' generated client, one HTTP/2
//! connection, one stream per request) sends each request's headers and its body in 16 KiB
//! chunks at once, as Envoy forwards them while they arrive, reads the pick and the body back,
//! then plays the response phase (headers with the served endpoint, one body chunk with usage)
//! and closes. Measured per request: from the last body chunk handed to the stream to the pick
//! (`pick`), and to the body's last chunk back (`added`: what the upstream request waits for).
//! The same is measured against a no-op processor (`echo`: the pick fixed, the body sent back,
//! no decision), so `added − echo` is kvmesh's own share beyond ext_proc's.
//! Workload: 64 conversations, each a 100 KB system prompt, turns cycling through them, so most
//! requests hit a cached prefix (the realistic, more expensive branch of the decision).
//!
//! `cargo run --release --example picker_path [-- --quick] [-- --rate R] [-- --secs S]`

use std::collections::HashMap;
use std::pin::Pin;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Msg;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, BodyMutation, BodyResponse, CommonResponse, HeadersResponse, HttpBody,
    HttpHeaders, ProcessingRequest, ProcessingResponse, StreamedBodyResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use kvmesh::node::config::{NodeConfig, ReplicaConfig};
use tokio::sync::mpsc;
use tonic::transport::Channel;

const CHUNK: usize = 16 << 10;

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn msg(m: Msg, metadata: Option<Metadata>) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(m),
        metadata_context: metadata,
        ..ProcessingRequest::default()
    }
}

fn headers(pairs: &[(&str, &str)], end: bool) -> HttpHeaders {
    HttpHeaders {
        headers: Some(HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: (*k).into(),
                    raw_value: v.as_bytes().to_vec(),
                    ..HeaderValue::default()
                })
                .collect(),
        }),
        end_of_stream: end,
        ..HttpHeaders::default()
    }
}

fn served(endpoint: &str) -> Metadata {
    let inner = Struct {
        fields: HashMap::from([(
            "x-gateway-destination-endpoint-served".to_owned(),
            Value {
                kind: Some(Kind::StringValue(endpoint.into())),
            },
        )]),
    };
    Metadata {
        filter_metadata: HashMap::from([("envoy.lb".to_owned(), inner)]),
        ..Metadata::default()
    }
}

/// One request through a picker; returns (pick, added) latencies after the body's last chunk.
async fn one(
    client: &mut ExternalProcessorClient<Channel>,
    body: &[u8],
) -> anyhow::Result<(Duration, Duration)> {
    let (tx, mut rx) = mpsc::channel(64);
    let requests = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
    let mut answers = client.process(requests).await?.into_inner();
    tx.send(msg(
        Msg::RequestHeaders(headers(
            &[(":method", "POST"), (":path", "/v1/chat/completions")],
            false,
        )),
        None,
    ))
    .await?;
    let parts: Vec<&[u8]> = body.chunks(CHUNK).collect();
    for (i, c) in parts.iter().enumerate() {
        let b = HttpBody {
            body: c.to_vec(),
            end_of_stream: i + 1 == parts.len(),
            ..HttpBody::default()
        };
        tx.send(msg(Msg::RequestBody(b), None)).await?;
    }
    let last = Instant::now();
    let first = answers
        .message()
        .await?
        .ok_or_else(|| anyhow::anyhow!("no pick"))?;
    let pick = last.elapsed();
    let Some(Answer::RequestHeaders(h)) = first.response else {
        anyhow::bail!("not a pick: {first:?}");
    };
    let endpoint = h
        .response
        .and_then(|r| r.header_mutation)
        .and_then(|m| m.set_headers.into_iter().next())
        .and_then(|o| o.header)
        .map(|h| {
            String::from_utf8_lossy(&h.raw_value)
                .split(',')
                .next()
                .unwrap_or_default()
                .to_owned()
        })
        .unwrap_or_default();
    loop {
        let m = answers
            .message()
            .await?
            .ok_or_else(|| anyhow::anyhow!("no body"))?;
        if let Some(Answer::RequestBody(BodyResponse { response: Some(c) })) = m.response {
            if let Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(s)),
            }) = c.body_mutation
            {
                if s.end_of_stream {
                    break;
                }
            }
        }
    }
    let added = last.elapsed();
    tx.send(msg(
        Msg::ResponseHeaders(headers(&[(":status", "200")], false)),
        Some(served(&endpoint)),
    ))
    .await?;
    let usage =
        br#"{"usage":{"prompt_tokens":25000,"prompt_tokens_details":{"cached_tokens":24000}}}"#;
    tx.send(msg(
        Msg::ResponseBody(HttpBody {
            body: usage.to_vec(),
            end_of_stream: true,
            ..HttpBody::default()
        }),
        None,
    ))
    .await?;
    answers.message().await?;
    answers.message().await?;
    drop(tx);
    while answers.message().await?.is_some() {}
    Ok((pick, added))
}

/// Runs `n` requests at `rate`/s against the processor at `addr`; sorted (pick, added).
async fn run(
    addr: std::net::SocketAddr,
    bodies: &[Vec<u8>],
    rate: f64,
    n: usize,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let client = ExternalProcessorClient::connect(format!("http://{addr}")).await?;
    let mut every = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        every.tick().await;
        let mut c = client.clone();
        let body = bodies[i % bodies.len()].clone();
        tasks.push(tokio::spawn(async move { one(&mut c, &body).await }));
    }
    let (mut picks, mut added) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for t in tasks {
        let (p, a) = t.await??;
        picks.push(p);
        added.push(a);
    }
    picks.sort();
    added.sort();
    Ok((picks, added))
}

/// A processor that decides nothing: the pick fixed, the body sent back when whole.
struct Echo;

type Answers =
    Pin<Box<dyn futures::Stream<Item = Result<ProcessingResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Echo {
    type ProcessStream = Answers;
    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Answers>, tonic::Status> {
        let mut inbound = request.into_inner();
        let (tx, mut rx) = mpsc::channel(16);
        tokio::spawn(async move {
            let mut body = Vec::new();
            while let Ok(Some(m)) = inbound.message().await {
                let reply = match m.request {
                    Some(Msg::RequestBody(b)) => {
                        body.extend_from_slice(&b.body);
                        if !b.end_of_stream {
                            continue;
                        }
                        let pick = ProcessingResponse {
                            response: Some(Answer::RequestHeaders(HeadersResponse {
                                response: Some(CommonResponse::default()),
                            })),
                            ..ProcessingResponse::default()
                        };
                        if tx.send(Ok(pick)).await.is_err() {
                            return;
                        }
                        body_answer(std::mem::take(&mut body), true)
                    }
                    Some(Msg::ResponseHeaders(_)) => ProcessingResponse {
                        response: Some(Answer::ResponseHeaders(HeadersResponse::default())),
                        ..ProcessingResponse::default()
                    },
                    Some(Msg::ResponseBody(b)) => body_answer(b.body, false),
                    _ => continue,
                };
                if tx.send(Ok(reply)).await.is_err() {
                    return;
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(futures::stream::poll_fn(
            move |cx| rx.poll_recv(cx),
        ))))
    }
}

fn body_answer(body: Vec<u8>, request: bool) -> ProcessingResponse {
    let b = BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body,
                        end_of_stream: true,
                        ..StreamedBodyResponse::default()
                    },
                )),
            }),
            ..CommonResponse::default()
        }),
    };
    ProcessingResponse {
        response: Some(if request {
            Answer::RequestBody(b)
        } else {
            Answer::ResponseBody(b)
        }),
        ..ProcessingResponse::default()
    }
}

fn arg(args: &[String], name: &str, default: f64) -> f64 {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let rate = arg(&args, "--rate", 1000.0);
    let secs = arg(&args, "--secs", if quick { 2.0 } else { 10.0 });
    let n = (rate * secs) as usize;
    kvmesh::proxy::install_crypto_provider();
    let mut replicas = Vec::new();
    for i in 0..8 {
        let cfg = kvmesh::replica::ReplicaConfig {
            id: format!("r{i}"),
            exit_on_crash: false,
            ..kvmesh::replica::ReplicaConfig::default()
        };
        replicas.push(kvmesh::replica::spawn(cfg).await?);
    }
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse()?,
        ..NodeConfig::default()
    };
    cfg.picker.listen = Some("127.0.0.1:0".parse()?);
    cfg.replicas = replicas
        .iter()
        .map(|r| ReplicaConfig {
            id: Some(r.id.clone()),
            ..ReplicaConfig::from_url(r.base_url())
        })
        .collect();
    let node = kvmesh::proxy::spawn(cfg).await?;
    let picker = node
        .picker_addr
        .ok_or_else(|| anyhow::anyhow!("no picker"))?;
    let echo_tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let echo = echo_tcp.local_addr()?;
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(ExternalProcessorServer::new(Echo))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(echo_tcp)),
    );
    // 64 conversations of a 100 KB system prompt each; turns cycle through them.
    let bodies: Vec<Vec<u8>> = (0..256)
        .map(|i| {
            let system: String = format!("Conversation {} system prompt. ", i % 64)
                .repeat(4000)
                .chars()
                .take(100_000)
                .collect();
            serde_json::to_vec(&serde_json::json!({
                "model": "sim-llama-8b", "max_tokens": 16, "stream": true,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": format!("turn {i}")}],
            }))
            .unwrap_or_default()
        })
        .collect();
    // Warm both paths (connections, the first pass over the prefixes).
    run(picker, &bodies, 200.0, 256).await?;
    run(echo, &bodies, 200.0, 100).await?;
    println!(
        "{n} requests at {rate}/s, 100 KB prompts in {} KiB chunks",
        CHUNK >> 10
    );
    println!("| path | pick p50 | pick p99 | added p50 | added p99 |\n|---|---|---|---|---|");
    for (name, addr) in [("echo (no decision)", echo), ("kvmesh picker", picker)] {
        let started = Instant::now();
        let (picks, added) = run(addr, &bodies, rate, n).await?;
        let took = started.elapsed().as_secs_f64();
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        println!(
            "| {name} | {:.3} ms | {:.3} ms | {:.3} ms | {:.3} ms |  ({:.0} req/s achieved)",
            ms(pct(&picks, 0.5)),
            ms(pct(&picks, 0.99)),
            ms(pct(&added, 0.5)),
            ms(pct(&added, 0.99)),
            n as f64 / took
        );
    }
    // The node's own share: from the body's last chunk in to the pick out (understand, decide,
    // fallbacks), whatever the queueing in front of it.
    let h = &node.node.metrics.registry.gather();
    for f in h
        .iter()
        .filter(|f| f.name() == "kvmesh_picker_decision_seconds")
    {
        for m in f.get_metric() {
            let hist = m.get_histogram();
            let n = hist.get_sample_count().max(1);
            println!(
                "node-side decision (kvmesh_picker_decision_seconds, warm-up included): {} picks, mean {:.1} µs",
                hist.get_sample_count(),
                hist.get_sample_sum() / n as f64 * 1e6
            );
            for b in hist.get_bucket() {
                println!(
                    "  ≤ {:>7.3} ms: {:.3}",
                    b.upper_bound() * 1e3,
                    b.cumulative_count() as f64 / n as f64
                );
            }
        }
    }
    node.shutdown().await;
    for r in replicas {
        r.shutdown().await;
    }
    Ok(())
}
