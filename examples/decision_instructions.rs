//! Decision cost in instructions: a deterministic loop of routing decisions to run under
//! `valgrind --tool=callgrind`, which counts instructions (stable on a busy shared machine,
//! where wall time is not). `scripts/decision-instructions.sh` runs it twice with different
//! decision counts and divides the difference, so building the view is subtracted out.
//!
//! ```text
//! cargo run --release --example decision_instructions -- <replicas> <decisions> [policy]
//! ```
//!
//! The view is `benches/routing.rs`'s: N replicas in one region, each with a Bloom summary sized
//! for 7,000 keys (1 % false positives, k = 7) that holds a 2-block system prompt every replica
//! shares and 5,000 unrelated keys, and one replica (the middle one) also the whole prompt; loads
//! varied. The prompt is 32,768 tokens (512 block keys of 64 tokens), keyed once outside the
//! loop. Every decision routes the same request on the same view (the router never changes the
//! view), with the router's seeded RNG: the same arguments give the same instruction count.

use std::hint::black_box;
use std::time::Duration;

use kvmesh::core::keys::{text_block_keys, BlockKey, Namespace};
use kvmesh::core::policy::PolicyKind;
use kvmesh::core::router::{Decision, RouteRequest, Router, RouterConfig};
use kvmesh::core::summary::{ReplicaSummary, SummaryConfig};
use kvmesh::core::tenants::Tenants;
use kvmesh::core::view::{ReplicaInfo, View};

/// Prompt length in tokens (about 4 bytes each).
const PROMPT_TOKENS: usize = 32_768;

fn prompt(tokens: usize) -> Vec<u8> {
    // Varied bytes so blocks differ.
    (0..tokens * 4).map(|i| (i * 31 % 251) as u8).collect()
}

fn view(replicas: usize, keys: &[BlockKey]) -> anyhow::Result<View> {
    let cfg = SummaryConfig::for_cluster("bench");
    let mut v = View::new("eu", 64);
    for i in 0..replicas {
        let idx = v.upsert(ReplicaInfo {
            id: format!("replica-{i}"),
            url: format!("http://10.0.0.{i}:8000"),
            region: "eu".into(),
            zone: String::new(),
            pool: "shared".into(),
            models: vec!["llama".into()],
            capacity_tokens: 450_000,
            prefill_tokens_per_s: 50_000.0,
            max_in_flight: 256,
            pd: Default::default(),
            kv_load: None,
        });
        let mut s = ReplicaSummary::new(1, 7_000, &cfg)?;
        s.insert(&keys[..2.min(keys.len())]);
        if i == replicas / 2 {
            s.insert(keys);
        }
        // Unrelated content, so filters are realistically full.
        let other: Vec<BlockKey> = (0..5_000u64)
            .map(|k| BlockKey(k ^ (i as u64) << 40))
            .collect();
        s.insert(&other);
        v.set_summary(idx, s);
        v.set_engine_load(
            idx,
            (i % 5) as u32,
            (i % 7) as u32,
            0.5,
            (i % 5) as u64 * 2048,
        );
    }
    Ok(v)
}

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
        &prompt(PROMPT_TOKENS),
        256,
        &mut keys,
    );
    let v = view(replicas, &keys)?;
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
