//! Runs the structure-aware fuzzer (`src/bench/fuzz.rs`) over every decoder of outside bytes and
//! prints, per decoder: inputs, inputs/s, accepted, panics, bound violations, slowest input.
//!
//! `cargo run --release --example fuzz -- --iterations 10000000 [--target NAME] [--seed S]`
//!
//! Exits 1 if any target panicked or broke a bound, printing the first such input (hex).

use std::io::Write;

use anyhow::Context;
use kvmesh::bench::fuzz::{fuzz, targets};

fn main() -> anyhow::Result<()> {
    let mut iterations: u64 = 100_000;
    let mut only: Option<String> = None;
    let mut seed: u64 = 1;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--iterations" => iterations = value()?.parse().context("--iterations")?,
            "--target" => only = Some(value()?),
            "--seed" => seed = value()?.parse().context("--seed")?,
            other => anyhow::bail!(
                "unknown argument {other}; usage: --iterations N [--target NAME] [--seed S]"
            ),
        }
    }
    let all = targets();
    let chosen: Vec<_> = all
        .iter()
        .filter(|t| only.as_deref().is_none_or(|o| o == t.name))
        .collect();
    if chosen.is_empty() {
        let names: Vec<&str> = all.iter().map(|t| t.name).collect();
        anyhow::bail!("no target {:?}; targets: {}", only, names.join(", "));
    }
    // Panics are counted per input, not printed one by one.
    std::panic::set_hook(Box::new(|_| {}));
    println!(
        "{:<18} {:>12} {:>12} {:>10} {:>7} {:>10} {:>9} {:>11}",
        "target", "inputs", "inputs/s", "accepted", "panics", "violations", "time_s", "slowest_ms"
    );
    let mut bad = false;
    for t in chosen {
        let r = fuzz(t, iterations, seed);
        println!(
            "{:<18} {:>12} {:>12.0} {:>10} {:>7} {:>10} {:>9.1} {:>11.2}",
            r.name,
            r.inputs,
            r.rate(),
            r.accepted,
            r.panics,
            r.violations,
            r.elapsed.as_secs_f64(),
            r.slowest.as_secs_f64() * 1e3
        );
        std::io::stdout().flush().ok();
        if let Some((input, what)) = &r.first_finding {
            bad = true;
            let hex: String = input.iter().take(512).map(|b| format!("{b:02x}")).collect();
            eprintln!("{}: {what}\n  input ({} bytes): {hex}", r.name, input.len());
        }
    }
    if bad {
        std::process::exit(1);
    }
    Ok(())
}
