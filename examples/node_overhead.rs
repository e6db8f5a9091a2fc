//! Added latency of a kvmesh node versus calling the upstream directly.
//!
//! Exists to check the node's budget (≤ 1 ms p99 added): an in-process node in front of a fake
//! OpenAI upstream that answers at once, driven at fixed request rates with a 4 KiB prompt
//! (16 routing blocks), first directly and then through the node. Run with
//! `cargo run --release --example node_overhead`. Client, node and upstream share the process,
//! so CPU figures are the difference between the two runs.

use std::time::{Duration, Instant};

use axum::routing::{get, post};
use kvmesh::node::config::{NodeConfig, ReplicaConfig};

const BODY: &str = r#"{"id":"c","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}"#;

fn cpu_seconds() -> f64 {
    // utime + stime of this process, in clock ticks (100 Hz on Linux).
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let rest = s.rsplit_once(')')?.1.to_owned();
            let f: Vec<&str> = rest.split_whitespace().collect();
            let ut: f64 = f.get(11)?.parse().ok()?;
            let st: f64 = f.get(12)?.parse().ok()?;
            Some((ut + st) / 100.0)
        })
        .unwrap_or(0.0)
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Sends `n` requests at `rate` per second to `url`; returns sorted latencies and CPU seconds.
async fn run(
    c: &reqwest::Client,
    url: &str,
    body: &str,
    rate: f64,
    n: usize,
) -> anyhow::Result<(Vec<Duration>, f64)> {
    let cpu0 = cpu_seconds();
    let mut every = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    let mut tasks = Vec::with_capacity(n);
    for _ in 0..n {
        every.tick().await;
        let req = c
            .post(url)
            .header("content-type", "application/json")
            .body(body.to_owned());
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let resp = req.send().await?;
            let ok = resp.status().is_success();
            resp.bytes().await?;
            anyhow::ensure!(ok, "non-2xx");
            Ok::<_, anyhow::Error>(t.elapsed())
        }));
    }
    let mut lat = Vec::with_capacity(n);
    for t in tasks {
        lat.push(t.await??);
    }
    lat.sort();
    Ok((lat, cpu_seconds() - cpu0))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    kvmesh::proxy::install_crypto_provider();
    let app = axum::Router::new()
        .route(
            "/v1/completions",
            post(|| async { ([("content-type", "application/json")], BODY) }),
        )
        .route("/health", get(|| async { "ok" }))
        .route(
            "/metrics",
            get(|| async { "vllm:num_requests_running 0\n" }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let upstream = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });

    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse()?,
        ..NodeConfig::default()
    };
    cfg.replicas = vec![ReplicaConfig {
        models: vec!["m".into()],
        ..ReplicaConfig::from_url(format!("http://{upstream}"))
    }];
    let node = kvmesh::proxy::spawn(cfg).await?;
    let c = reqwest::Client::builder().tcp_nodelay(true).build()?;
    let prompt: String = (0..4096).map(|i| (b'a' + (i % 26) as u8) as char).collect();
    let body = serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 1}).to_string();
    let direct = format!("http://{upstream}/v1/completions");
    let via = format!("http://{}/v1/completions", node.addr);

    // Warm up connections on both paths.
    run(&c, &direct, &body, 500.0, 200).await?;
    run(&c, &via, &body, 500.0, 200).await?;
    println!("| rate req/s | path | p50 µs | p99 µs | CPU ms / 1k req |");
    println!("|---|---|---|---|---|");
    for (rate, n) in [(100.0, 1000), (1000.0, 5000)] {
        let (d, dcpu) = run(&c, &direct, &body, rate, n).await?;
        let (v, vcpu) = run(&c, &via, &body, rate, n).await?;
        for (name, lat, cpu) in [("direct", &d, dcpu), ("via node", &v, vcpu)] {
            println!(
                "| {rate} | {name} | {} | {} | {:.0} |",
                pct(lat, 0.5).as_micros(),
                pct(lat, 0.99).as_micros(),
                cpu * 1000.0 / (n as f64 / 1000.0)
            );
        }
        println!(
            "| {rate} | added | {} | {} | {:.0} |",
            pct(&v, 0.5).as_micros() as i128 - pct(&d, 0.5).as_micros() as i128,
            pct(&v, 0.99).as_micros() as i128 - pct(&d, 0.99).as_micros() as i128,
            (vcpu - dcpu) * 1000.0 / (n as f64 / 1000.0)
        );
    }
    node.shutdown().await;
    Ok(())
}
