//! Closed-loop load generator for one `kvmesh replica`: how many requests/s a replica process
//! sustains, and whether it stays faithful to the model while doing so (compare the driver-lag
//! histogram and TTFT against the model).
//!
//! `cargo run --release --example replica_load -- http://127.0.0.1:8000 64 10 256 16`
//! (url, concurrency, seconds, prompt tokens, max_tokens).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or_else(|| default.to_string());
    let url = arg(0, "http://127.0.0.1:8000");
    let concurrency: usize = arg(1, "64").parse().context("concurrency")?;
    let seconds: u64 = arg(2, "10").parse().context("seconds")?;
    let prompt_tokens: usize = arg(3, "256").parse().context("prompt tokens")?;
    let max_tokens: u32 = arg(4, "16").parse().context("max_tokens")?;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()?;
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for worker in 0..concurrency {
        let (client, url, done, errors) =
            (client.clone(), url.clone(), done.clone(), errors.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = 0u64;
            while Instant::now() < deadline {
                // Unique prompts: every request is a cold prefill.
                let prompt = format!("{worker:04}-{i:08}-").repeat(prompt_tokens * 4 / 14 + 1);
                let prompt = &prompt[..prompt_tokens * 4];
                let resp = client
                    .post(format!("{url}/v1/completions"))
                    .json(&json!({"prompt": prompt, "max_tokens": max_tokens}))
                    .send()
                    .await;
                let ok = match resp {
                    Ok(r) if r.status().is_success() => r.bytes().await.is_ok(),
                    _ => false,
                };
                if ok {
                    done.fetch_add(1, Ordering::Relaxed);
                } else {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
                i += 1;
            }
        }));
    }
    let started = Instant::now();
    for t in tasks {
        t.await?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let n = done.load(Ordering::Relaxed);
    println!(
        "{n} requests in {elapsed:.1} s = {:.0} req/s ({} errors), concurrency {concurrency}, prompt {prompt_tokens}, max_tokens {max_tokens}",
        n as f64 / elapsed,
        errors.load(Ordering::Relaxed)
    );
    let metrics = client
        .get(format!("{url}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    for line in metrics.lines().filter(|l| {
        !l.starts_with('#')
            && (l.contains("driver_lag_seconds_sum")
                || l.contains("driver_lag_seconds_count")
                || l.contains("time_to_first_token_seconds_sum")
                || l.contains("time_to_first_token_seconds_count"))
    }) {
        println!("{line}");
    }
    Ok(())
}
