//! The view decision time is measured on, shared by `benches/routing.rs` (criterion, wall
//! time) and `examples/decision_instructions.rs` (callgrind, instructions), so that the two
//! figures in docs/benchmarks.md describe the same decision.
//!
//! N replicas in one region, each with a Bloom summary sized for 7,000 keys (1 % false
//! positives, k = 7) holding a 2-block system prompt every replica shares and 5,000 unrelated
//! keys (so filters are realistically full); the middle replica also holds the whole prompt;
//! loads varied by replica.

use crate::core::keys::BlockKey;
use crate::core::summary::{ReplicaSummary, SummaryConfig, SummaryError};
use crate::core::view::{ReplicaInfo, View};

/// A prompt of about `tokens` tokens (4 bytes each), its bytes varied so that blocks differ.
pub fn prompt(tokens: usize) -> Vec<u8> {
    (0..tokens * 4).map(|i| (i * 31 % 251) as u8).collect()
}

/// The view of `replicas` replicas described in the module doc, for a prompt keyed `keys`.
pub fn view(replicas: usize, keys: &[BlockKey]) -> Result<View, SummaryError> {
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
            prefill_attention_ms_per_pair: crate::core::view::DEFAULT_PREFILL_ATTENTION_MS_PER_PAIR,
            max_in_flight: 256,
            pd: Default::default(),
            kv_load: None,
        });
        let mut s = ReplicaSummary::new(1, 7_000, &cfg)?;
        s.insert(&keys[..2.min(keys.len())]);
        if i == replicas / 2 {
            s.insert(keys);
        }
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
