//! The gateway stand-in (`kvmesh::bench::gateway`) as a process: plays Envoy's ext_proc part in
//! front of one or more endpoint pickers (`kvmesh serve` with `[picker] listen`), so that
//! `kvmesh bench --url http://<listen>` replays through the pickers. Prints its counters every
//! `--stats-every` seconds and at Ctrl-C / SIGTERM. `scripts/picker-mesh-bench.py` drives it.
//!
//! `cargo run --release --example gateway -- --listen 127.0.0.1:18000 \
//!    --picker 127.0.0.1:19002 --picker 127.0.0.1:19012 [--random SEED] [--pick-timeout-ms 5000]`

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use kvmesh::bench::gateway::{Gateway, GatewayConfig, GatewayStats, Spread};

/// Reads `--name value` pairs (repeatable `--picker`).
fn parse(args: &[String]) -> anyhow::Result<(GatewayConfig, u64)> {
    let mut cfg = GatewayConfig::new("127.0.0.1:18000".parse()?, Vec::new());
    let mut stats_every = 0;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--listen" => cfg.listen = value()?.parse().context("--listen")?,
            "--picker" => cfg
                .pickers
                .push(value()?.parse::<SocketAddr>().context("--picker")?),
            "--random" => cfg.spread = Spread::Random(value()?.parse().context("--random")?),
            "--pick-timeout-ms" => {
                cfg.pick_timeout =
                    Duration::from_millis(value()?.parse().context("--pick-timeout-ms")?)
            }
            "--stats-every" => stats_every = value()?.parse().context("--stats-every")?,
            other => anyhow::bail!("unknown flag {other}"),
        }
    }
    anyhow::ensure!(!cfg.pickers.is_empty(), "give at least one --picker ADDR");
    Ok((cfg, stats_every))
}

fn print_stats(s: &GatewayStats) {
    let g = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    println!(
        "gateway: requests {} forwarded {} picker_failures {} no_picker {} immediate {} fallbacks_used {} upstream_failures {} tap_dropped {}",
        g(&s.requests),
        g(&s.forwarded),
        g(&s.picker_failures),
        g(&s.no_picker),
        g(&s.immediate),
        g(&s.fallbacks_used),
        g(&s.upstream_failures),
        g(&s.tap_dropped)
    );
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (cfg, stats_every) = parse(&args)?;
    let gw = Gateway::spawn(cfg.clone()).await?;
    println!(
        "gateway: listening on {} for pickers {:?}",
        gw.addr, cfg.pickers
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut tick = tokio::time::interval(Duration::from_secs(stats_every.max(1)));
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            _ = tick.tick(), if stats_every > 0 => print_stats(&gw.stats),
        }
    }
    print_stats(&gw.stats);
    gw.shutdown().await;
    Ok(())
}
