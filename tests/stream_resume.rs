//! Streams that survive a replica: a replica killed (SIGKILL of a real `kvmesh replica`
//! process) or hung mid-stream, and the client still reads one continuous stream; a stream that
//! cannot continue ends with its API's error event, never a bare truncation.
//!
//! Each test routes the streams to replica `a` while `b` is drained, takes `b` out of the drain
//! once every stream is under way, then fails `a`. The simulated replica's text is a fixed
//! word sequence that a continuation picks up where its prompt stops, so a seamless stream
//! reads exactly `filler_text(max_tokens)`.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvmesh::mesh::admin::AdminOp;
use kvmesh::node::config::{NodeConfig, ReplicaConfig as NodeReplica};
use kvmesh::proxy::{self, RunningNode};
use kvmesh::replica::openai::filler_text;
use serde_json::{json, Value};

use common::{bounded, client, free_tcp_port, sim_replica, wait_for};

const MODEL: &str = "sim-llama-8b";

/// A node over replicas `(id, url)`, with `b` drained, a short stream idle deadline.
async fn node(replicas: &[(&str, String)]) -> RunningNode {
    node_with(replicas, |_| {}).await
}

/// [`node`], its config changed by `tweak` first.
async fn node_with(
    replicas: &[(&str, String)],
    tweak: impl FnOnce(&mut NodeConfig),
) -> RunningNode {
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().expect("address"),
        drain_s: 2,
        ..NodeConfig::default()
    };
    cfg.health.interval_ms = 100;
    cfg.health.timeout_ms = 500;
    cfg.scrape.interval_ms = 100;
    cfg.timeouts.connect_ms = 500;
    cfg.timeouts.stream_first_byte_ms = 5_000;
    cfg.timeouts.stream_idle_ms = 500;
    cfg.replicas = replicas.iter().map(|(id, url)| spec(id, url)).collect();
    tweak(&mut cfg);
    let n = proxy::spawn(cfg).await.expect("node");
    let healthy = wait_for(Duration::from_secs(10), || {
        n.node
            .admin_replicas()
            .iter()
            .all(|r| r.health == "healthy" && r.models.iter().any(|m| m == MODEL))
    })
    .await;
    assert!(healthy.is_some(), "replicas never became healthy");
    n.node
        .admin_command(AdminOp::Drain, "b", None)
        .expect("drain b");
    n
}

fn spec(id: &str, url: &str) -> NodeReplica {
    NodeReplica {
        id: Some(id.into()),
        models: vec![MODEL.into()],
        ..NodeReplica::from_url(url.to_owned())
    }
}

/// One client stream: its bytes, and how many chunks arrived so far.
struct Stream {
    chat: bool,
    usage: bool,
    max_tokens: u32,
    chunks: Arc<AtomicUsize>,
    /// Its bytes, and when each chunk arrived.
    task: tokio::task::JoinHandle<(String, Vec<Instant>)>,
}

/// Opens stream `i` (chat when `chat`) of `max_tokens` at `node`.
async fn open(c: &reqwest::Client, node: &RunningNode, i: usize, chat: bool, max: u32) -> Stream {
    let usage = i.is_multiple_of(2);
    let (path, body) = if chat {
        let body = json!({"model": MODEL, "max_tokens": max, "stream": true,
            "stream_options": {"include_usage": usage},
            "messages": [{"role": "user", "content": format!("Tell story number {i}.")}]});
        ("/v1/chat/completions", body)
    } else {
        let body = json!({"model": MODEL, "max_tokens": max, "stream": true,
            "stream_options": {"include_usage": usage},
            "prompt": format!("Story number {i} goes:")});
        ("/v1/completions", body)
    };
    let resp = c
        .post(format!("http://{}{path}", node.addr))
        .json(&body)
        .send()
        .await
        .expect("stream request");
    assert_eq!(resp.status(), 200);
    let chunks = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&chunks);
    let task = tokio::spawn(async move {
        let mut body = resp.bytes_stream();
        let mut all = Vec::new();
        let mut arrivals = Vec::new();
        while let Some(Ok(b)) = body.next().await {
            all.extend_from_slice(&b);
            seen.fetch_add(1, Ordering::Relaxed);
            arrivals.push(Instant::now());
        }
        (String::from_utf8_lossy(&all).into_owned(), arrivals)
    });
    Stream {
        chat,
        usage,
        max_tokens: max,
        chunks,
        task,
    }
}

/// Checks one finished stream reads as one answer: one id, one role, no error, the whole
/// filler text, usage adding up, one `[DONE]` at the end.
fn check_seamless(s: &Stream, text: &str) {
    let datas: Vec<&str> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    assert_eq!(
        datas.last(),
        Some(&"[DONE]"),
        "no [DONE] at the end: {text}"
    );
    assert_eq!(
        datas.iter().filter(|d| **d == "[DONE]").count(),
        1,
        "{text}"
    );
    let chunks: Vec<Value> = datas[..datas.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).expect("a JSON chunk"))
        .collect();
    assert!(chunks.iter().all(|c| c.get("error").is_none()), "{text}");
    let ids: std::collections::HashSet<&str> =
        chunks.iter().filter_map(|c| c["id"].as_str()).collect();
    assert_eq!(ids.len(), 1, "one id: {ids:?}");
    let mut got = String::new();
    let mut roles = 0;
    for c in &chunks {
        let Some(choice) = c["choices"].get(0) else {
            continue;
        };
        if s.chat {
            roles += usize::from(choice["delta"].get("role").is_some());
            got.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
        } else {
            got.push_str(choice["text"].as_str().unwrap_or(""));
        }
    }
    if s.chat {
        assert_eq!(roles, 1, "one role chunk: {text}");
    }
    assert_eq!(got, filler_text(s.max_tokens), "a continuous text");
    if s.usage {
        let usage = &chunks.last().expect("chunks")["usage"];
        assert_eq!(usage["completion_tokens"], s.max_tokens, "{usage}");
    }
}

/// The node's `kvmesh_stream_resumes_total` for `api` and `outcome`.
async fn resumes(c: &reqwest::Client, node: &RunningNode, api: &str, outcome: &str) -> u64 {
    let text = c
        .get(format!("http://{}/metrics", node.addr))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    let needle = format!("kvmesh_stream_resumes_total{{api=\"{api}\",outcome=\"{outcome}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&needle))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The longest a client waited for a byte from `since` on (the pause a failure cost it).
fn pause_after(arrivals: &[Instant], since: Instant) -> Duration {
    let mut last = since;
    let mut longest = Duration::ZERO;
    for t in arrivals.iter().filter(|t| **t > since) {
        longest = longest.max(*t - last);
        last = *t;
    }
    longest
}

/// Waits until every stream has read `n` chunks.
async fn under_way(streams: &[Stream], n: usize) {
    let ok = wait_for(Duration::from_secs(20), || {
        streams
            .iter()
            .all(|s| s.chunks.load(Ordering::Relaxed) >= n)
    })
    .await;
    assert!(ok.is_some(), "the streams never got going");
}

/// kill -9 of a replica serving 20 open streams (10 completions, 10 chat): all 20 complete for
/// their clients with a continuous text, continued on the other replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_of_a_replica_serving_20_streams_loses_none() {
    bounded(120, async {
        let port = free_tcp_port();
        let mut a = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvmesh"))
            .args(["replica", "--port", &port.to_string(), "--id", "a"])
            .args(["--model", MODEL, "--time-scale", "0.2"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("a replica process");
        let b = sim_replica("b", |_| {}).await;
        let c = client();
        let a_url = format!("http://127.0.0.1:{port}");
        let up = common::wait_until(Duration::from_secs(30), async || {
            c.get(format!("{a_url}/health"))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
        })
        .await;
        assert!(up.is_some(), "replica a never came up");
        let n = node(&[("a", a_url), ("b", b.base_url())]).await;
        let mut streams = Vec::new();
        for i in 0..20 {
            streams.push(open(&c, &n, i, i % 2 == 1, 400).await);
        }
        under_way(&streams, 3).await;
        n.node
            .admin_command(AdminOp::Add, "b", Some(&spec("b", &b.base_url())))
            .expect("b back");
        let open_at_kill = streams.iter().filter(|s| !s.task.is_finished()).count();
        let killed = Instant::now();
        a.start_kill().expect("kill -9");
        let _ = a.wait().await;
        let mut complete = 0;
        let mut gaps = Vec::new();
        for s in &mut streams {
            let (text, arrivals) = (&mut s.task).await.expect("client task");
            check_seamless(s, &text);
            complete += 1;
            gaps.push(pause_after(&arrivals, killed));
        }
        gaps.sort();
        let resumed = resumes(&c, &n, "chat", "resumed").await
            + resumes(&c, &n, "completions", "resumed").await;
        println!(
            "kill -9 of a replica serving 20 streams ({open_at_kill} open at the kill): \
             {complete}/20 complete and continuous, {resumed} continued on the other replica; \
             kill → next byte at the client: median {:?}, max {:?}",
            gaps[gaps.len() / 2],
            gaps[gaps.len() - 1]
        );
        assert_eq!(open_at_kill, 20, "the kill came after a stream ended");
        assert_eq!(resumed, 20);
        // Every kept body's budget came back with its stream.
        let budget = &n.node.resume_body_budget;
        let full = (NodeConfig::default().server.max_buffered_body_bytes >> 10) as usize / 4;
        let back = wait_for(Duration::from_secs(10), || {
            budget.available_permits() == full
        })
        .await;
        assert!(
            back.is_some(),
            "{} of {full} KiB",
            budget.available_permits()
        );
        n.shutdown().await;
        b.shutdown().await;
    })
    .await;
}

/// A replica that stops sending mid-stream (connection open) is caught by
/// `timeouts.stream_idle_ms` and its streams continue elsewhere; one that cuts the connection
/// mid-stream, too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_hung_or_cut_mid_stream_is_continued_elsewhere() {
    bounded(90, async {
        for fault in ["stall_stream_after", "cut_stream_after"] {
            let a = sim_replica("a", |cfg| cfg.engine.time_scale = 0.2).await;
            let b = sim_replica("b", |_| {}).await;
            let c = client();
            let n = node(&[("a", a.base_url()), ("b", b.base_url())]).await;
            let mut streams = Vec::new();
            for i in 0..4 {
                streams.push(open(&c, &n, i, i % 2 == 1, 200).await);
            }
            under_way(&streams, 3).await;
            n.node
                .admin_command(AdminOp::Add, "b", Some(&spec("b", &b.base_url())))
                .expect("b back");
            let faulted = Instant::now();
            let set = c
                .post(format!("{}/admin/faults", a.base_url()))
                .json(&json!({ fault: 0 }))
                .send()
                .await
                .expect("fault");
            assert!(set.status().is_success());
            let mut gap = Duration::ZERO;
            for s in &mut streams {
                let (text, arrivals) = (&mut s.task).await.expect("client task");
                check_seamless(s, &text);
                gap = gap.max(pause_after(&arrivals, faulted));
            }
            println!("{fault}: 4/4 streams continued; fault → next byte at the client ≤ {gap:?}");
            let resumed = resumes(&c, &n, "chat", "resumed").await
                + resumes(&c, &n, "completions", "resumed").await;
            assert_eq!(resumed, 4, "{fault}");
            n.shutdown().await;
            a.shutdown().await;
            b.shutdown().await;
        }
    })
    .await;
}

/// Anthropic Messages and Responses streams are not continued: a replica dying mid-stream ends
/// them with the API's error event instead of a bare cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_cannot_continue_ends_with_its_apis_error_event() {
    bounded(60, async {
        let a = sim_replica("a", |cfg| cfg.faults.cut_stream_after = Some(3)).await;
        let b = sim_replica("b", |_| {}).await;
        let c = client();
        let n = node(&[("a", a.base_url()), ("b", b.base_url())]).await;
        let messages = json!({"model": MODEL, "max_tokens": 50, "stream": true,
            "messages": [{"role": "user", "content": "Hi"}]});
        let text = c
            .post(format!("http://{}/v1/messages", n.addr))
            .json(&messages)
            .send()
            .await
            .expect("messages")
            .text()
            .await
            .expect("a clean end");
        assert!(
            text.ends_with("\n\n") && text.contains("event: error\ndata: {\"error\":"),
            "{text}"
        );
        let responses = json!({"model": MODEL, "max_output_tokens": 50, "stream": true,
            "input": "Hi"});
        let text = c
            .post(format!("http://{}/v1/responses", n.addr))
            .json(&responses)
            .send()
            .await
            .expect("responses")
            .text()
            .await
            .expect("a clean end");
        let last = text.trim_end().rsplit("\n\n").next().unwrap_or_default();
        assert!(last.starts_with("event: error\n"), "{text}");
        assert!(last.contains("\"sequence_number\":"), "{last}");
        assert_eq!(resumes(&c, &n, "messages", "error_event").await, 1);
        assert_eq!(resumes(&c, &n, "responses", "error_event").await, 1);
        n.shutdown().await;
        a.shutdown().await;
        b.shutdown().await;
    })
    .await;
}

/// A chat stream whose body the node cannot keep (past a quarter of its body budget, the share
/// resumable streams may hold) is relayed without resumes: its replica failing ends it with the
/// error event, as for an API that cannot continue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_body_is_past_the_resume_budget_ends_with_the_error_event() {
    bounded(60, async {
        let a = sim_replica("a", |cfg| cfg.faults.cut_stream_after = Some(3)).await;
        let b = sim_replica("b", |_| {}).await;
        let c = client();
        let n = node_with(&[("a", a.base_url()), ("b", b.base_url())], |cfg| {
            cfg.max_body_bytes = 1 << 20;
            cfg.server.max_buffered_body_bytes = 1 << 20;
            cfg.server.body_fair_share_bytes = 64 << 10;
        })
        .await;
        // 300 KiB of prompt: past the 256 KiB the node keeps for resumes.
        let long = "word ".repeat(60_000);
        let chat = json!({"model": MODEL, "max_tokens": 50, "stream": true,
            "messages": [{"role": "user", "content": long}]});
        let text = c
            .post(format!("http://{}/v1/chat/completions", n.addr))
            .json(&chat)
            .send()
            .await
            .expect("chat")
            .text()
            .await
            .expect("a clean end");
        assert!(
            text.ends_with("data: [DONE]\n\n") && text.contains("data: {\"error\":"),
            "{text}"
        );
        assert_eq!(resumes(&c, &n, "chat", "body_not_kept").await, 1);
        assert_eq!(resumes(&c, &n, "chat", "error_event").await, 1);
        assert_eq!(resumes(&c, &n, "chat", "resumed").await, 0);
        n.shutdown().await;
        a.shutdown().await;
        b.shutdown().await;
    })
    .await;
}
