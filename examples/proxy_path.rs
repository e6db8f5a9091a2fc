//! Added latency on the proxy path, as pooled keep-alive clients and load balancers see it.
//!
//! Exists to check the node's latency budget on streamed requests (issue #12): a fake upstream
//! that streams an SSE answer at once (a first event, a second, `[DONE]`, each its own write),
//! a node in front of it in-process, and optionally haproxy (if on `PATH`) in front of the node
//! or of the upstream. A pooled keep-alive client (reqwest, TCP_NODELAY like aiohttp) sends
//! requests at a fixed rate on each path and measures the time to the first SSE byte and to the
//! end. Paths: `direct` (client → upstream), `node` (client → node → upstream), and with haproxy
//! `haproxy` (client → haproxy → upstream) and `haproxy+node` (client → haproxy → node →
//! upstream), each with `option http-no-delay` and with haproxy's default, which holds small
//! streamed writes back (MSG_MORE) until more data comes or ~200 ms pass. Workloads: short
//! prompts at 20 and 1,000 req/s, then 50–500 KB prompts at 20 req/s.
//!
//! `cargo run --release --example proxy_path [-- --quick]`

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use futures::StreamExt;
use kvmesh::bench::fleet::Haproxy;
use kvmesh::node::config::{NodeConfig, ReplicaConfig};

fn sse() -> Body {
    let events = [
        "data: {\"id\":\"c\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"o\"}]}\n\n",
        "data: {\"id\":\"c\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"k\",\"finish_reason\":\"stop\"}]}\n\n",
        "data: [DONE]\n\n",
    ];
    let stream = futures::stream::iter(events.into_iter().enumerate()).then(|(i, e)| async move {
        // Each event its own write, a decode step (2 ms) apart, as an engine streams.
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        Ok::<_, std::io::Error>(bytes::Bytes::from_static(e.as_bytes()))
    });
    Body::from_stream(stream)
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Sends `n` requests at `rate` per second to `url` with bodies from `bodies` in turn; returns
/// sorted times to the first body byte and to the end.
async fn run(
    c: &reqwest::Client,
    url: &str,
    bodies: &[String],
    rate: f64,
    n: usize,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let mut every = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        every.tick().await;
        let req = c
            .post(url)
            .header("content-type", "application/json")
            .body(bodies[i % bodies.len()].clone());
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let resp = req.send().await?;
            anyhow::ensure!(resp.status().is_success(), "status {}", resp.status());
            let mut body = resp.bytes_stream();
            let mut first = None;
            while let Some(chunk) = body.next().await {
                let chunk = chunk?;
                if first.is_none() && !chunk.is_empty() {
                    first = Some(t.elapsed());
                }
            }
            Ok::<_, anyhow::Error>((first.unwrap_or_else(|| t.elapsed()), t.elapsed()))
        }));
    }
    let (mut ttfb, mut end) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for t in tasks {
        let (a, b) = t.await??;
        ttfb.push(a);
        end.push(b);
    }
    ttfb.sort();
    end.sort();
    Ok((ttfb, end))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    kvmesh::proxy::install_crypto_provider();
    let app = axum::Router::new()
        // The body is read in full, as an engine does (an unread body closes the connection).
        .route(
            "/v1/completions",
            post(|body: bytes::Bytes| async move {
                drop(body);
                sse()
            }),
        )
        .route("/health", get(|| async { "ok" }))
        .route(
            "/metrics",
            get(|| async { "vllm:num_requests_running 0\n" }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let upstream = listener.local_addr()?;
    tokio::spawn(async move {
        axum::serve(
            listener.tap_io(|t| {
                let _ = t.set_nodelay(true);
            }),
            app,
        )
        .await
    });
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse()?,
        ..NodeConfig::default()
    };
    cfg.replicas = vec![ReplicaConfig {
        models: vec!["m".into()],
        ..ReplicaConfig::from_url(format!("http://{upstream}"))
    }];
    let node = kvmesh::proxy::spawn(cfg).await?;

    let dir = tempfile::tempdir()?;
    let mut procs: Vec<Haproxy> = Vec::new();
    let mut paths = vec![
        ("direct", format!("http://{upstream}/v1/completions")),
        ("node", format!("http://{}/v1/completions", node.addr)),
    ];
    let fronts = [
        ("haproxy", upstream, true),
        ("haproxy+node", node.addr, true),
        ("haproxy (default cork)", upstream, false),
        ("haproxy (default cork)+node", node.addr, false),
    ];
    for (name, backend, no_delay) in fronts {
        match Haproxy::start(&[backend], no_delay, dir.path()).await {
            Ok(p) => {
                paths.push((name, format!("{}/v1/completions", p.url)));
                procs.push(p);
            }
            Err(e) => eprintln!("{name}: skipped ({e:#})"),
        }
    }

    let c = reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(64)
        .build()?;
    let body = |bytes: usize, salt: usize| {
        let prompt: String = (0..bytes)
            .map(|i| (b'a' + ((i + salt) % 26) as u8) as char)
            .collect();
        serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 2, "stream": true})
            .to_string()
    };
    let short = vec![body(4096, 0)];
    let large: Vec<String> = (0..8).map(|i| body(50_000 + i * 64_000, i)).collect();
    let scale = if quick { 5 } else { 1 };
    let runs: [(&str, &[String], f64, usize); 3] = [
        ("short, 20 req/s", &short, 20.0, 1200 / scale),
        ("short, 1000 req/s", &short, 1000.0, 10_000 / scale),
        ("50-500 KB, 20 req/s", &large, 20.0, 600 / scale),
    ];
    for (_, url) in &paths {
        run(&c, url, &short, 200.0, 100).await?;
    }
    println!("| workload | path | first byte p50 µs | p99 µs | max µs | end p50 µs | p99 µs |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    for (name, bodies, rate, n) in runs {
        for (path, url) in &paths {
            let (t, e) = run(&c, url, bodies, rate, n).await?;
            println!(
                "| {name} | {path} | {} | {} | {} | {} | {} |",
                pct(&t, 0.5).as_micros(),
                pct(&t, 0.99).as_micros(),
                pct(&t, 1.0).as_micros(),
                pct(&e, 0.5).as_micros(),
                pct(&e, 0.99).as_micros()
            );
        }
    }
    drop(procs);
    node.shutdown().await;
    Ok(())
}
