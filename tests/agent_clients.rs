//! The official `anthropic` and `openai` Python clients against a 3-node mesh of kvmesh nodes
//! (3 simulated replicas): Anthropic Messages with tools (streamed and not), count_tokens,
//! OpenAI Responses streamed and a `previous_response_id` chain whose turns enter through
//! different nodes, retrieve and cancel of a stored response, embeddings, and each API's error
//! shape — what agents will really point at kvmesh (`scripts/agent_clients_check.py`).
//!
//! Needs `python3` with `anthropic` and `openai` (`.ci/run` installs them). When they are
//! missing the test says so and passes, unless `KVMESH_REQUIRE_OPENAI=1` (set by `.ci/run`).

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use kvmesh::node::config::{MeshSection, NodeConfig};
use kvmesh::proxy::{self, RunningNode};

mod common;

fn clients_available() -> bool {
    std::process::Command::new("python3")
        .args(["-c", "import anthropic, openai"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn mesh_config(
    certs: &Path,
    name: &str,
    seeds: &[String],
    replicas: &[(String, String)],
) -> NodeConfig {
    kvmesh::mesh::certs::issue_in_dir(certs, name).unwrap();
    let mut cfg = common::named_node_config(replicas);
    cfg.region = "eu".into();
    cfg.cluster_id = "agent-clients".into();
    cfg.drain_s = 2;
    cfg.debug_headers = false;
    // The clients' own waits, not the shared config's short ones.
    cfg.health.timeout_ms = NodeConfig::default().health.timeout_ms;
    cfg.timeouts = NodeConfig::default().timeouts;
    cfg.mesh = Some(MeshSection {
        node_id: name.into(),
        listen: "127.0.0.1:0".parse().unwrap(),
        seeds: seeds.to_vec(),
        certs_dir: Some(certs.to_owned()),
        gossip_interval_ms: 100,
        failure_detection_ms: 1_000,
        warmup_timeout_ms: 5_000,
        ..MeshSection::default()
    });
    cfg
}

fn mesh_addr(n: &RunningNode) -> String {
    n.node.mesh().expect("a mesh node").addr().to_string()
}

/// The sum over `texts` (Prometheus expositions) of `metric`'s series for `api` whose labels
/// also contain `also`.
fn sum_metric(texts: &[String], metric: &str, api: &str, also: &str) -> f64 {
    let api = format!("api=\"{api}\"");
    texts
        .iter()
        .flat_map(|t| t.lines())
        .filter(|l| l.starts_with(&format!("{metric}{{")) && l.contains(&api) && l.contains(also))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_anthropic_and_openai_clients_work_through_a_three_node_mesh() {
    if !clients_available() {
        assert!(
            std::env::var("KVMESH_REQUIRE_OPENAI").is_err(),
            "python3 with the anthropic and openai packages is required (pip install anthropic openai)"
        );
        eprintln!("skipping: python3 with anthropic and openai is not installed");
        return;
    }
    proxy::install_crypto_provider();
    tokio::time::timeout(Duration::from_secs(90), async {
        let mut replicas = Vec::new();
        for i in 0..3 {
            replicas.push(common::sim_replica(&format!("r{i}"), |_| {}).await);
        }
        let list: Vec<(String, String)> = replicas
            .iter()
            .map(|r| (r.id.clone(), r.base_url()))
            .collect();
        let certs = tempfile::tempdir().unwrap();
        kvmesh::mesh::certs::init_dir(certs.path()).unwrap();
        let a = proxy::spawn(mesh_config(certs.path(), "a", &[], &list))
            .await
            .unwrap();
        let seed = [mesh_addr(&a)];
        let b = proxy::spawn(mesh_config(certs.path(), "b", &seed, &list))
            .await
            .unwrap();
        let c = proxy::spawn(mesh_config(certs.path(), "c", &seed, &list))
            .await
            .unwrap();
        let http = common::client();
        for n in [&a, &b, &c] {
            let ready = format!("http://{}/ready", n.addr);
            common::wait_until(Duration::from_secs(30), async || {
                let r = http.get(&ready).send().await;
                r.is_ok_and(|r| r.status().is_success())
            })
            .await
            .expect("every node gets ready");
        }
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/agent_clients_check.py"
        );
        let out = tokio::process::Command::new("python3")
            .arg(script)
            .args([&a, &b, &c].map(|n| format!("http://{}", n.addr)))
            .kill_on_drop(true)
            .output()
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "agent clients check failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("{}", String::from_utf8_lossy(&out.stdout).trim());
        // Every answered request left a receipt: the engine's reported cached tokens against
        // the node's prediction, per API.
        let mut texts = Vec::new();
        for n in [&a, &b, &c] {
            let url = format!("http://{}/metrics", n.addr);
            texts.push(http.get(url).send().await.unwrap().text().await.unwrap());
        }
        for api in ["messages", "responses"] {
            let sum = |metric: &str, also: &str| sum_metric(&texts, metric, api, also);
            let receipts = sum("kvmesh_receipts_total", "outcome=\"reported\"");
            let predicted = sum("kvmesh_receipt_predicted_tokens_total", "");
            let reported = sum("kvmesh_receipt_reported_tokens_total", "");
            let matched = sum("kvmesh_receipt_matched_tokens_total", "");
            eprintln!(
                "{api}: {receipts} receipts; cached tokens predicted {predicted}, reported by the \
                 engine {reported}, matched {matched}"
            );
            assert!(receipts >= 2.0, "{api}: no receipts");
            assert!(
                reported > 0.0,
                "{api}: the engine's cached tokens were not read"
            );
        }
        for n in [a, b, c] {
            n.shutdown().await;
        }
        for r in replicas {
            r.shutdown().await;
        }
    })
    .await
    .expect("the agent clients check took over 90 s");
}
