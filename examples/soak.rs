//! Soak: a 3-node mesh with simulated replicas under steady load for a bounded time, sampling the
//! process's memory, open files and the clients' error counts, to show nothing grows without
//! bound (issue #13).
//!
//! Everything runs in this process (nodes, replicas, clients), so RSS and descriptors are the
//! whole fleet's; growth is what matters. Prompts, sessions and tenants are all distinct, the
//! worst case for every map keyed by client input.
//!
//! `cargo run --release --example soak -- --minutes 30 [--every-s 60] [--concurrency 8]`

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use kvmesh::bench::fleet::{mesh_section, wait_ready, MeshCerts};
use kvmesh::node::config::{NodeConfig, ReplicaConfig as NodeReplica};
use kvmesh::proxy;
use kvmesh::replica::{self, ReplicaConfig};

/// Longest soak: half an hour.
const MAX_MINUTES: f64 = 30.0;

#[derive(Parser)]
struct Args {
    /// How long to run (at most 30).
    #[arg(long, default_value_t = 2.0)]
    minutes: f64,
    /// Seconds between samples.
    #[arg(long, default_value_t = 10)]
    every_s: u64,
    /// Concurrent clients.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Simulated replicas (shared by the three nodes).
    #[arg(long, default_value_t = 4)]
    replicas: usize,
}

fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kib| kib / 1024.0)
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.minutes > 0.0 && args.minutes <= MAX_MINUTES,
        "--minutes must be in (0, {MAX_MINUTES}]"
    );
    proxy::install_crypto_provider();
    let mut reps = Vec::new();
    for i in 0..args.replicas {
        let mut cfg = ReplicaConfig {
            id: format!("r{i}"),
            exit_on_crash: false,
            ..ReplicaConfig::default()
        };
        cfg.engine.time_scale = 20.0;
        reps.push(replica::spawn(cfg).await?);
    }
    let certs = MeshCerts::new(["n1", "n2", "n3"])?;
    let mut nodes = Vec::new();
    let mut seed = None;
    for name in ["n1", "n2", "n3"] {
        let mut cfg = NodeConfig {
            listen: ([127, 0, 0, 1], 0).into(),
            region: "eu".into(),
            drain_s: 2,
            ..NodeConfig::default()
        };
        cfg.replicas = reps
            .iter()
            .map(|r| NodeReplica {
                id: Some(r.id.clone()),
                ..NodeReplica::from_url(r.base_url())
            })
            .collect();
        cfg.mesh = Some(mesh_section(name, &certs, seed));
        let n = proxy::spawn(cfg).await.context("starting a node")?;
        seed = seed.or(n.node.mesh().map(|m| m.addr()));
        nodes.push(n);
    }
    wait_ready(&nodes).await?;
    let addrs: Vec<_> = nodes.iter().map(|n| n.addr).collect();
    let ok = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for k in 0..args.concurrency {
        let (ok, errors, stop, addrs) = (ok.clone(), errors.clone(), stop.clone(), addrs.clone());
        clients.push(tokio::spawn(async move {
            let c = reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .unwrap_or_default();
            let mut n: u64 = 0;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                // Distinct prompts, sessions and tenants: every client-keyed map sees new keys.
                let prompt = format!("document {k}-{n}: ").repeat(40);
                let r = c
                    .post(format!(
                        "http://{}/v1/completions",
                        addrs[(n as usize + k) % addrs.len()]
                    ))
                    .header("x-tenant-id", format!("tenant-{k}-{}", n % 1000))
                    .header("x-session-id", format!("session-{k}-{n}"))
                    .json(&serde_json::json!({"model": "sim-llama-8b", "prompt": prompt, "max_tokens": 8, "stream": true}))
                    .send()
                    .await;
                let good = match r {
                    Ok(r) if r.status().is_success() => r.bytes().await.is_ok(),
                    _ => false,
                };
                if good {
                    ok.fetch_add(1, Ordering::Relaxed);
                } else {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    let started = Instant::now();
    let total = Duration::from_secs_f64(args.minutes * 60.0);
    println!(
        "{:>7} {:>9} {:>6} {:>10} {:>8} {:>8}",
        "t_s", "rss_mib", "fds", "requests", "errors", "req/s"
    );
    let mut last = (0u64, Instant::now());
    loop {
        let now_ok = ok.load(Ordering::Relaxed);
        let rate = (now_ok - last.0) as f64 / last.1.elapsed().as_secs_f64().max(1e-9);
        last = (now_ok, Instant::now());
        println!(
            "{:>7.0} {:>9.1} {:>6} {:>10} {:>8} {:>8.0}",
            started.elapsed().as_secs_f64(),
            rss_mib(),
            open_fds(),
            now_ok,
            errors.load(Ordering::Relaxed),
            rate
        );
        if started.elapsed() >= total {
            break;
        }
        let left = total.saturating_sub(started.elapsed());
        tokio::time::sleep(Duration::from_secs(args.every_s.max(1)).min(left)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.await;
    }
    for n in nodes {
        n.shutdown().await;
    }
    for r in reps {
        r.shutdown().await;
    }
    Ok(())
}
