//! Router-derived cache salts (issue #35): with API keys the node sets every completions and
//! chat request's `cache_salt` from the authenticated tenant, so two tenants never share an
//! engine cache entry — whatever salt a client sends — except under an operator's shared system
//! prompt. The simulated replica salts its prefix cache as vLLM does (the salt seeds block 0,
//! every later block chains from it) and answers with the tokens it found cached
//! (`x-kvmesh-cached-tokens`): the engine's own word on which cache entry a request used.

mod common;

use std::path::PathBuf;

use common::{bounded, client, sim_replica};
use kvmesh::node::config::{NodeConfig, ReplicaConfig as NodeReplica};
use kvmesh::proxy::{self, RunningNode};
use serde_json::{json, Value};

const MODEL: &str = "sim-llama-8b";
const ACME: &str = "sk-acme-0123456789abcdef";
const BETA: &str = "sk-beta-0123456789abcdef";

/// A node in front of `url` with API keys for acme and beta, and `shared` system prompts.
async fn node_with_keys(url: String, shared: &[&str]) -> (RunningNode, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let keys: PathBuf = dir.path().join("keys");
    std::fs::write(&keys, format!("acme {ACME}\nbeta {BETA}\n")).expect("keys file");
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().expect("address"),
        drain_s: 5,
        ..NodeConfig::default()
    };
    cfg.health.interval_ms = 100;
    cfg.replicas = vec![NodeReplica {
        id: Some("r0".into()),
        ..NodeReplica::from_url(url)
    }];
    cfg.auth.api_keys_file = Some(keys);
    cfg.auth.shared_system_prompts = shared.iter().map(|s| (*s).to_owned()).collect();
    let node = proxy::spawn(cfg).await.expect("node");
    (node, dir)
}

/// Sends `body` to `path` with `key`; the engine's cached and prompt tokens.
async fn cached(
    c: &reqwest::Client,
    node: &RunningNode,
    key: &str,
    path: &str,
    body: Value,
) -> (u64, u64) {
    let resp = c
        .post(format!("http://{}{path}", node.addr))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .expect("response");
    assert_eq!(resp.status(), 200, "{:?}", resp.text().await);
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name}"))
    };
    let out = (
        header("x-kvmesh-cached-tokens"),
        header("x-kvmesh-prompt-tokens"),
    );
    resp.bytes().await.expect("body");
    out
}

/// Text of about `bytes` bytes, distinct per `seed`.
fn text(seed: &str, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 64);
    let mut i = 0;
    while s.len() < bytes {
        s.push_str(&format!("{seed} sentence {i} of a long prompt. "));
        i += 1;
    }
    s
}

#[tokio::test]
async fn tenants_sending_one_prompt_never_share_an_engine_cache_entry() {
    bounded(60, async {
        let replica = sim_replica("r0", |_| {}).await;
        let (node, _dir) = node_with_keys(replica.base_url(), &[]).await;
        let c = client();
        let prompt = text("the same question", 4096);
        let body = |salt: Option<&str>| {
            let mut b = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1});
            if let Some(s) = salt {
                b["cache_salt"] = json!(s);
            }
            b
        };
        let comp = "/v1/completions";
        // acme's second request hits acme's entry: the cache works.
        assert_eq!(cached(&c, &node, ACME, comp, body(None)).await.0, 0);
        let (hit, tokens) = cached(&c, &node, ACME, comp, body(None)).await;
        assert!(hit > tokens / 2, "acme's own entry: {hit} of {tokens}");
        // beta, same prompt: nothing cached — a second entry, beta's own.
        assert_eq!(cached(&c, &node, BETA, comp, body(None)).await.0, 0);
        // A client's salt is overridden, not trusted: beta naming any salt lands in beta's
        // entry, and acme naming beta's guess does not reach it either.
        let (hit, _) = cached(&c, &node, BETA, comp, body(Some("acme"))).await;
        assert!(hit > 0, "beta's salt is the node's, whatever beta sends");
        let fresh = text("another question", 4096);
        let fresh_body =
            json!({"model": MODEL, "prompt": fresh, "max_tokens": 1, "cache_salt": ""});
        assert_eq!(cached(&c, &node, BETA, comp, fresh_body.clone()).await.0, 0);
        assert_eq!(cached(&c, &node, ACME, comp, fresh_body).await.0, 0);
        // Chat too.
        let chat = json!({"model": MODEL, "max_tokens": 1,
            "messages": [{"role": "user", "content": text("a chat", 2048)}]});
        assert_eq!(
            cached(&c, &node, ACME, "/v1/chat/completions", chat.clone())
                .await
                .0,
            0
        );
        assert_eq!(
            cached(&c, &node, BETA, "/v1/chat/completions", chat)
                .await
                .0,
            0
        );
        node.shutdown().await;
        replica.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn a_shared_system_prompt_is_shared_and_the_rest_is_not() {
    bounded(60, async {
        let system = text("You are the shared assistant", 2048);
        let replica = sim_replica("r0", |_| {}).await;
        let (node, _dir) = node_with_keys(replica.base_url(), &[&system]).await;
        let c = client();
        let chat = |sys: &str, user: &str| {
            json!({"model": MODEL, "max_tokens": 1, "messages": [
                {"role": "system", "content": sys},
                {"role": "user", "content": text(user, 1024)}]})
        };
        let path = "/v1/chat/completions";
        assert_eq!(
            cached(&c, &node, ACME, path, chat(&system, "acme asks"))
                .await
                .0,
            0
        );
        // beta's request under the shared system prompt finds it cached (one entry for both
        // tenants), but not acme's own part.
        let (hit, tokens) = cached(&c, &node, BETA, path, chat(&system, "beta asks")).await;
        let system_tokens = system.len() as u64 / 4;
        assert!(
            hit + 64 >= system_tokens && hit < tokens - 128,
            "shared prefix cached: {hit} of {tokens} ({system_tokens} system)"
        );
        // A system prompt that is not the operator's shared one stays the tenant's own.
        let other = text("A private system prompt", 2048);
        assert_eq!(cached(&c, &node, ACME, path, chat(&other, "q")).await.0, 0);
        assert_eq!(cached(&c, &node, BETA, path, chat(&other, "q")).await.0, 0);
        node.shutdown().await;
        replica.shutdown().await;
    })
    .await;
}
