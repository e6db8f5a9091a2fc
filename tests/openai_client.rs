//! The official `openai` Python client against a kvmesh node (3 simulated replicas behind it):
//! completions and chat, streaming and not, the model list and a 404 — what users will really
//! point at kvmesh.
//!
//! Needs `python3` with the `openai` package (`pip install openai`; `.ci/run` installs it). When
//! it is missing the test says so and passes, unless `KVMESH_REQUIRE_OPENAI=1` (set by `.ci/run`),
//! so a newcomer's `cargo test` works without Python while CI always runs the real client.

use std::process::Stdio;
use std::time::Duration;

use kvmesh::node::config::{NodeConfig, ReplicaConfig as NodeReplica};
use kvmesh::replica::{self, ReplicaConfig};

fn openai_available() -> bool {
    std::process::Command::new("python3")
        .args(["-c", "import openai"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_works_through_a_node() {
    if !openai_available() {
        assert!(
            std::env::var("KVMESH_REQUIRE_OPENAI").is_err(),
            "python3 with the openai package is required (pip install openai)"
        );
        eprintln!(
            "skipping: python3 with the openai package is not installed (pip install openai)"
        );
        return;
    }
    tokio::time::timeout(Duration::from_secs(60), async {
        let mut replicas = Vec::new();
        for i in 0..3 {
            let mut cfg = ReplicaConfig {
                id: format!("r{i}"),
                exit_on_crash: false,
                ..ReplicaConfig::default()
            };
            cfg.engine.time_scale = 50.0;
            replicas.push(replica::spawn(cfg).await.unwrap());
        }
        let mut cfg = NodeConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            ..NodeConfig::default()
        };
        cfg.replicas = replicas
            .iter()
            .enumerate()
            .map(|(i, r)| NodeReplica {
                id: Some(format!("r{i}")),
                ..NodeReplica::from_url(r.base_url())
            })
            .collect();
        let node = kvmesh::proxy::spawn(cfg).await.unwrap();
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/openai_client_check.py"
        );
        let out = tokio::process::Command::new("python3")
            .arg(script)
            .arg(format!("http://{}", node.addr))
            .kill_on_drop(true)
            .output()
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "openai client check failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("{}", String::from_utf8_lossy(&out.stdout).trim());
        node.shutdown().await;
        for r in replicas {
            r.shutdown().await;
        }
    })
    .await
    .expect("the openai client check took over 60 s");
}
