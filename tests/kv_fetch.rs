//! KV fetch between simulated replicas (issue #37): a request carrying a fetch hint pulls the
//! prefix's blocks from the named replica over real HTTP and computes only the rest; a source
//! that dies mid-transfer, or holds nothing, costs a recompute, never the request.

mod common;

use std::time::Duration;

use common::{bounded, client, sim_replica};
use kvmesh::core::kv_hint::{self, FetchHint};
use kvmesh::core::kv_load::KvHintFormat;
use serde_json::{json, Value};

/// `n` distinct prompt bytes starting with `seed` (a token per 4 bytes).
fn text(seed: &str, n: usize) -> String {
    let mut s = String::new();
    let mut i = 0;
    while s.len() < n {
        s.push_str(&format!("{seed}-{i:06} "));
        i += 1;
    }
    s.truncate(n);
    s
}

/// A completions body for `prompt`, with a hint to pull tokens `0..end` from `source` in
/// `format` (none when `source` is `None`).
fn body(prompt: &str, source: Option<&str>, end: u64, format: KvHintFormat) -> Value {
    let mut b = json!({ "model": "sim-llama-8b", "prompt": prompt, "max_tokens": 1 });
    if let Some(url) = source {
        let hint = FetchHint {
            source_url: url.to_owned(),
            source_id: None,
            start_token: 0,
            end_token: end,
        };
        let (field, v) = kv_hint::build(format, &hint, "test-1").unwrap();
        kv_hint::set_in(&mut b, field, v);
    }
    b
}

/// `(status, cached tokens, fetched tokens)` of one completion.
async fn complete(c: &reqwest::Client, base: &str, body: &Value) -> (u16, usize, usize) {
    let resp = c
        .post(format!("{base}/v1/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    let header = |name: &str| -> usize {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or(usize::MAX)
    };
    let out = (
        resp.status().as_u16(),
        header("x-kvmesh-cached-tokens"),
        header("x-kvmesh-fetched-tokens"),
    );
    let _ = resp.bytes().await;
    out
}

async fn metric(c: &reqwest::Client, base: &str, name: &str) -> f64 {
    let text = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hinted_request_pulls_the_prefix_from_the_source_in_either_form() {
    bounded(60, async {
        let c = client();
        let source = sim_replica("src", |_| {}).await;
        let target = sim_replica("dst", |_| {}).await;
        let (src, dst) = (source.base_url(), target.base_url());
        for (i, format) in [KvHintFormat::VllmEnvelope, KvHintFormat::LlmD]
            .into_iter()
            .enumerate()
        {
            // 8,192 tokens: the source computes them once.
            let prompt = text(&format!("doc{i}"), 4 * 8192);
            assert_eq!(
                complete(&c, &src, &body(&prompt, None, 0, format)).await.0,
                200
            );
            // The target pulls all but the last block (an engine recomputes the last token's).
            let (status, cached, fetched) =
                complete(&c, &dst, &body(&prompt, Some(&src), 8192, format)).await;
            assert_eq!(status, 200);
            assert_eq!((cached, fetched), (8192 - 16, 8192 - 16), "{format:?}");
            // Now the target holds them itself: a plain follow-up hits its own cache.
            let (_, cached, fetched) = complete(&c, &dst, &body(&prompt, None, 0, format)).await;
            assert_eq!((cached, fetched), (8192 - 16, 0));
        }
        assert_eq!(
            metric(&c, &dst, "kvmesh_replica_kv_fetched_tokens_total").await,
            2.0 * (8192.0 - 16.0)
        );
        assert!(metric(&c, &src, "kvmesh_replica_kv_served_tokens_total").await >= 2.0 * 8176.0);
        source.shutdown().await;
        target.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_that_dies_mid_transfer_or_holds_nothing_costs_a_recompute_not_the_request() {
    bounded(60, async {
        let c = client();
        let target = sim_replica("dst", |_| {}).await;
        let dst = target.base_url();
        // A source that takes the pull, reads it, and dies before the blocks are through.
        let dying = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let dying_url = format!("http://{}", dying.local_addr().unwrap());
        let killer = tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let mut pulls = 0;
            while let Ok((mut sock, _)) = dying.accept().await {
                let mut buf = vec![0u8; 64 * 1024];
                let _ = tokio::time::timeout(Duration::from_secs(2), sock.read(&mut buf)).await;
                pulls += 1;
                drop(sock); // the connection resets mid-answer
                if pulls == 1 {
                    return pulls;
                }
            }
            pulls
        });
        let prompt = text("dying", 4 * 4096);
        let (status, cached, fetched) = complete(
            &c,
            &dst,
            &body(&prompt, Some(&dying_url), 4096, KvHintFormat::VllmEnvelope),
        )
        .await;
        assert_eq!((status, cached, fetched), (200, 0, 0));
        assert_eq!(killer.await.unwrap(), 1, "the target did ask the source");
        // A live source that holds none of it: recomputed too.
        let empty = sim_replica("empty", |_| {}).await;
        let prompt = text("never-seen", 4 * 4096);
        let (status, cached, fetched) = complete(
            &c,
            &dst,
            &body(&prompt, Some(&empty.base_url()), 4096, KvHintFormat::LlmD),
        )
        .await;
        assert_eq!((status, cached, fetched), (200, 0, 0));
        // And a source gone altogether (its port closed).
        let gone = sim_replica("gone", |_| {}).await;
        let gone_url = gone.base_url();
        gone.shutdown().await;
        let prompt = text("gone", 4 * 4096);
        let (status, _, fetched) = complete(
            &c,
            &dst,
            &body(&prompt, Some(&gone_url), 4096, KvHintFormat::VllmEnvelope),
        )
        .await;
        assert_eq!((status, fetched), (200, 0));
        assert_eq!(
            metric(&c, &dst, "kvmesh_replica_kv_fetch_failures_total").await,
            3.0
        );
        // A malformed hint is ignored (counted), the request served.
        let mut bad = body(&text("bad", 400), None, 0, KvHintFormat::None);
        bad["kv_hints"] = json!({ "actions": "nope" });
        assert_eq!(complete(&c, &dst, &bad).await.0, 200);
        empty.shutdown().await;
        target.shutdown().await;
    })
    .await;
}
