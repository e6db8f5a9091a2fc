//! Decision time and key hashing throughput.
//!
//! Hot-prefix sketch: one `HotPrefixes::observe` per request (what the request path adds with
//! `[hot_prefix]`), over a stream of 1,000 distinct prefixes churning its 64 counters, and on
//! a tracked hot prefix.
//!
//! Decision: a view of N replicas in one region, each with a summary that holds a shared
//! 2-block system prompt, one of them also the whole prompt (the warm replica), loads varied.
//! The keys are computed once outside the timed loop: this measures the decision alone.
//! Figures, and the issue #12 goals on `decision/p2c-cache/{64,512}r-32k`: docs/benchmarks-notebook.md,
//! "Decision time".

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvmesh::bench::decision_view;
use kvmesh::core::cost::CostModel;
use kvmesh::core::hot_prefix::{HotPrefixConfig, HotPrefixes, Observed, WarmScope};
use kvmesh::core::keys::{text_block_keys, BlockKey, Namespace};
use kvmesh::core::kv_fetch::{FetchMode, KvFetchConfig};
use kvmesh::core::policy::PolicyKind;
use kvmesh::core::router::{RouteRequest, Router, RouterConfig};
use kvmesh::core::tenants::Tenants;

fn decisions(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision");
    for replicas in [8usize, 64, 512] {
        for tokens in [1_024usize, 8_192, 32_768] {
            let mut keys = Vec::new();
            text_block_keys(
                Namespace::new("llama", None, None, None),
                &decision_view::prompt(tokens),
                256,
                &mut keys,
            );
            let v = decision_view::view(replicas, &keys).expect("the bench view");
            for policy in [PolicyKind::P2cCache, PolicyKind::RoundRobin] {
                let mut router = Router::new(
                    RouterConfig {
                        policy,
                        ..Default::default()
                    },
                    Tenants::default(),
                );
                let req = RouteRequest::plain("llama", &keys, tokens as u64);
                let id =
                    BenchmarkId::new(policy.as_str(), format!("{replicas}r-{}k", tokens / 1024));
                g.bench_function(id, |b| {
                    b.iter(|| black_box(router.route(&v, black_box(&req), Duration::ZERO)))
                });
            }
        }
    }
    // In a mesh the view also holds the prefixes peers just routed (`core/peer_tips.rs`): every
    // request looks each of its keys up once. 10,000 unrelated tips and one for this prompt.
    let mut keys = Vec::new();
    text_block_keys(
        Namespace::new("llama", None, None, None),
        &decision_view::prompt(32_768),
        256,
        &mut keys,
    );
    for replicas in [64usize, 512] {
        let mut v = decision_view::view(replicas, &keys).expect("the bench view");
        let tip = |replica: usize, blocks: u32| kvmesh::core::peer_tips::Tip {
            replica,
            blocks,
            ready: Duration::ZERO,
            until: Duration::from_secs(10),
        };
        for k in 0..10_000u64 {
            v.peer_tips.insert(
                BlockKey(k.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
                tip(k as usize % replicas, 8),
            );
        }
        if let Some(last) = keys.get(99) {
            v.peer_tips.insert(*last, tip(1, 100));
        }
        let mut router = Router::new(RouterConfig::default(), Tenants::default());
        let req = RouteRequest::plain("llama", &keys, 32_768);
        let id = BenchmarkId::new("p2c-cache", format!("{replicas}r-32k-with-peer-tips"));
        g.bench_function(id, |b| {
            b.iter(|| black_box(router.route(&v, black_box(&req), Duration::from_secs(1))))
        });
    }
    // `[kv_fetch] mode = "priced"` with every replica taking hints: each decision also finds the
    // longest settled holder and prices a pull for every candidate holding less
    // (`core/fetch_plan.rs`); against the same decision with fetching off.
    for replicas in [64usize, 512] {
        let mut v = decision_view::view(replicas, &keys).expect("the bench view");
        for i in 0..replicas {
            if let Some(r) = v.replica_mut(i) {
                std::sync::Arc::make_mut(&mut r.info).kv_load =
                    Some(kvmesh::core::kv_load::KvLoad {
                        hints: kvmesh::core::kv_load::KvHintFormat::VllmEnvelope,
                        ..Default::default()
                    });
            }
        }
        for mode in [FetchMode::Off, FetchMode::Priced] {
            let mut router = Router::new(
                RouterConfig {
                    cost: CostModel {
                        fetch: KvFetchConfig {
                            mode,
                            ..Default::default()
                        },
                        ..Default::default()
                    },
                    ..Default::default()
                },
                Tenants::default(),
            );
            let req = RouteRequest::plain("llama", &keys, 32_768);
            let id = BenchmarkId::new(
                format!("p2c-cache-kv-fetch-{}", mode.as_str()),
                format!("{replicas}r-32k"),
            );
            g.bench_function(id, |b| {
                b.iter(|| black_box(router.route(&v, black_box(&req), Duration::from_secs(1))))
            });
        }
    }
    remote_prefix_decisions(&mut g, &keys);
    g.finish();
}

/// A prefix only the other region holds (`core/remote_prefix.rs`): the bench view with its
/// second half (the warm replica among them) in region `us`, every replica taking hints;
/// `remote_prefix = "weigh"` (a pull priced into each local candidate, a forward weighed)
/// against `"local"` (the decision as before).
fn remote_prefix_decisions(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    keys: &[BlockKey],
) {
    use kvmesh::core::remote_prefix::RemotePrefixMode;
    for replicas in [64usize, 512] {
        let mut v = decision_view::view(replicas, keys).expect("the bench view");
        for i in 0..replicas {
            if let Some(r) = v.replica_mut(i) {
                let info = std::sync::Arc::make_mut(&mut r.info);
                info.kv_load = Some(kvmesh::core::kv_load::KvLoad {
                    hints: kvmesh::core::kv_load::KvHintFormat::VllmEnvelope,
                    ..Default::default()
                });
                if i >= replicas / 2 {
                    info.region = "us".into();
                }
            }
        }
        for mode in [RemotePrefixMode::Local, RemotePrefixMode::Weigh] {
            let mut router = Router::new(
                RouterConfig {
                    remote_prefix: mode,
                    ..Default::default()
                },
                Tenants::default(),
            );
            let req = RouteRequest::plain("llama", keys, 32_768);
            let id = BenchmarkId::new(
                format!("p2c-cache-remote-prefix-{}", mode.as_str()),
                format!("{replicas}r-32k"),
            );
            g.bench_function(id, |b| {
                b.iter(|| black_box(router.route(&v, black_box(&req), Duration::from_secs(1))))
            });
        }
    }
}

fn hashing(c: &mut Criterion) {
    let mut g = c.benchmark_group("keys");
    let text = decision_view::prompt(32_768);
    g.throughput(Throughput::Bytes(text.len() as u64));
    let ns = Namespace::new("llama", None, None, None);
    let mut out = Vec::with_capacity(1024);
    g.bench_function("text_block_keys/128KiB", |b| {
        b.iter(|| {
            out.clear();
            text_block_keys(ns, black_box(&text), 256, &mut out);
            black_box(out.len())
        })
    });
    g.finish();
}

fn hot_prefix(c: &mut Criterion) {
    let mut g = c.benchmark_group("hot_prefix");
    let ns = Namespace::new("llama", None, None, None);
    // 1,000 prompts of 8 blocks, all with different first blocks: every observe misses a
    // counter and replaces the lightest (the sketch's worst case).
    let texts: Vec<String> = (0..1000).map(|i| format!("{i:>8}").repeat(256)).collect();
    let keys: Vec<Vec<BlockKey>> = texts
        .iter()
        .map(|t| {
            let mut k = Vec::new();
            text_block_keys(ns, t.as_bytes(), 256, &mut k);
            k
        })
        .collect();
    let mut hot = HotPrefixes::new(HotPrefixConfig::default());
    let mut t = Duration::ZERO;
    let mut i = 0;
    g.bench_function("observe/churn", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            t += Duration::from_micros(100);
            let req = Observed {
                model: "llama",
                keys: black_box(&keys[i]),
                text: Some(&texts[i]),
                block_bytes: 256,
                scope: WarmScope::default(),
            };
            hot.observe(req, t);
        })
    });
    // One prefix at a high rate: tracked as a candidate, so each observe also measures its
    // shared run against the sample.
    g.bench_function("observe/hot", |b| {
        b.iter(|| {
            t += Duration::from_micros(100);
            let req = Observed {
                model: "llama",
                keys: black_box(&keys[0]),
                text: Some(&texts[0]),
                block_bytes: 256,
                scope: WarmScope::default(),
            };
            hot.observe(req, t);
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500));
    targets = decisions, hashing, hot_prefix
}
criterion_main!(benches);
