//! Decision cost in instructions: a deterministic loop of routing decisions to run under
//! `valgrind --tool=callgrind`, which counts instructions (stable on a busy shared machine,
//! where wall time is not). `scripts/decision-instructions.sh` runs it twice with different
//! decision counts and divides the difference, so building the view is subtracted out.
//!
//! ```text
//! cargo run --release --example decision_instructions -- <replicas> <decisions> [policy]
//! ```
//!
//! The view is `kvmesh::bench::decision_view`'s, as in `benches/routing.rs`: N replicas in one
//! region, each with a Bloom summary sized for 7,000 keys (1 % false positives, k = 7) that
//! holds a 2-block system prompt every replica shares and 5,000 unrelated keys, and one replica
//! (the middle one) also the whole prompt; loads varied. The prompt is 32,768 tokens (512 block keys of 64 tokens), keyed once outside the
//! loop. Every decision routes the same request on the same view (the router never changes the
//! view), with the router's seeded RNG: the same arguments give the same instruction count.

use std::hint::black_box;
use std::time::Duration;

use kvmesh::bench::decision_view;
use kvmesh::core::keys::{text_block_keys, Namespace};
use kvmesh::core::policy::PolicyKind;
use kvmesh::core::router::{Decision, RouteRequest, Router, RouterConfig};
use kvmesh::core::tenants::Tenants;

/// Prompt length in tokens (about 4 bytes each).
const PROMPT_TOKENS: usize = 32_768;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let replicas: usize = args.next().as_deref().unwrap_or("512").parse()?;
    let decisions: usize = args.next().as_deref().unwrap_or("1000").parse()?;
    let policy: PolicyKind = args.next().as_deref().unwrap_or("p2c-cache").parse()?;
    anyhow::ensure!(
        (1..=100_000).contains(&replicas),
        "replicas must be 1..=100000"
    );
    let mut keys = Vec::new();
    text_block_keys(
        Namespace::new("llama", None, None, None),
        &decision_view::prompt(PROMPT_TOKENS),
        256,
        &mut keys,
    );
    let v = decision_view::view(replicas, &keys)?;
    let mut router = Router::new(
        RouterConfig {
            policy,
            ..Default::default()
        },
        Tenants::default(),
    );
    let req = RouteRequest::plain("llama", &keys, PROMPT_TOKENS as u64);
    // A digest of the routes, so a change that alters decisions shows (and the loop is not
    // optimised away).
    let mut digest = 0u64;
    for _ in 0..decisions {
        if let Decision::Route(r) = router.route(&v, black_box(&req), Duration::ZERO) {
            digest = digest.wrapping_mul(31).wrapping_add(r.replica as u64 + 1);
        }
    }
    println!(
        "replicas={replicas} decisions={decisions} policy={policy} routes_digest={digest:016x}"
    );
    Ok(())
}
