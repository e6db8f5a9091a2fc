//! The endpoint picker against a gateway built from Envoy's published protos: Python `grpcio`
//! with `xds-protos` and `grpcio-health-checking` (`scripts/ext_proc_check.py`) plays Envoy's
//! ext_proc filter in FULL_DUPLEX_STREAMED mode against a real `[picker]` listener of a node with
//! 3 simulated replicas and one with 4 data-parallel ranks, and forwards requests where it is
//! told. Cases: the pick and its `envoy.lb` metadata, fallbacks, bodies in many chunks, the
//! cache-aware choice, the subset hint (none serving → 503), served-endpoint readback, an
//! abandoned stream, shedding → 429, 413/400/404 in each API's shape, Messages, Responses and
//! bodyless requests, DP ranks as ports, a malformed stream, gRPC health.
//!
//! Needs `python3` with `grpcio`, `xds-protos` and `grpcio-health-checking` (`.ci/run` installs
//! them). When they are missing the test says so and passes, unless
//! `KVMESH_REQUIRE_EXT_PROC=1` (set by `.ci/run`).

use std::collections::HashMap;
use std::process::Stdio;
use std::time::Duration;

use kvmesh::core::tenants::TenantConfig;
use kvmesh::node::config::{NodeConfig, ReplicaConfig as NodeReplica};
use kvmesh::replica::KvEventsConfig;
use kvmesh::replicas::kv_events::KvEventsSource;

mod common;
use common::sim_replica;

/// The largest body the node takes here (small, so the 413 case sends little).
const MAX_BODY: usize = 512 << 10;
const DP_RANKS: u16 = 4;

fn gateway_protos_available() -> bool {
    std::process::Command::new("python3")
        .args([
            "-c",
            "import grpc, grpc_health.v1.health_pb2, envoy.service.ext_proc.v3.external_processor_pb2",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_envoy_side_client_gets_the_protocols_cases_from_the_picker() {
    if !gateway_protos_available() {
        assert!(
            std::env::var("KVMESH_REQUIRE_EXT_PROC").is_err(),
            "python3 with grpcio, xds-protos and grpcio-health-checking is required"
        );
        eprintln!("skipping: pip install grpcio xds-protos grpcio-health-checking");
        return;
    }
    common::init_logs();
    common::bounded(120, async {
        let mut replicas = Vec::new();
        for i in 0..3 {
            replicas.push(sim_replica(&format!("r{i}"), |_| {}).await);
        }
        let dp = sim_replica("dp", |c| {
            c.model = "dp-model".into();
            c.dp_ranks = DP_RANKS;
            c.kv_events = Some(KvEventsConfig::default());
        })
        .await;
        let mut cfg = NodeConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            max_body_bytes: MAX_BODY,
            drain_s: 2,
            ..NodeConfig::default()
        };
        cfg.picker.listen = Some("127.0.0.1:0".parse().unwrap());
        cfg.health.interval_ms = 200;
        cfg.tenants = HashMap::from([(
            "capped".to_owned(),
            TenantConfig {
                max_in_flight_per_replica: Some(1),
                ..TenantConfig::default()
            },
        )]);
        cfg.replicas = replicas
            .iter()
            .map(|r| NodeReplica {
                id: Some(r.id.clone()),
                ..NodeReplica::from_url(r.base_url())
            })
            .collect();
        cfg.replicas.push(NodeReplica {
            id: Some("dp".into()),
            models: vec!["dp-model".into()],
            kv_events: Some(KvEventsSource {
                dp_ranks: DP_RANKS,
                ..KvEventsSource::new(format!("tcp://127.0.0.1:{}", dp.kv_events_port.unwrap()))
            }),
            ..NodeReplica::from_url(dp.base_url())
        });
        let node = kvmesh::proxy::spawn(cfg).await.unwrap();
        let picker = node.picker_addr.expect("the picker listens");
        let fleet = serde_json::json!({
            "replicas": replicas.iter().map(|r| (r.id.clone(), r.addr.to_string())).collect::<HashMap<_, _>>(),
            "model": "sim-llama-8b",
            "dp": {"endpoint": dp.addr.to_string(), "ranks": DP_RANKS, "model": "dp-model"},
            "capped_tenant": "capped",
            "max_body_bytes": MAX_BODY,
        });
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/ext_proc_check.py");
        let out = tokio::process::Command::new("python3")
            .arg(script)
            .arg(picker.to_string())
            .arg(format!("http://{}", node.addr))
            .arg(fleet.to_string())
            .kill_on_drop(true)
            .output()
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "the gateway's checks failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("{}", String::from_utf8_lossy(&out.stdout).trim());
        node.shutdown().await;
        for r in replicas {
            r.shutdown().await;
        }
        dp.shutdown().await;
    })
    .await;
}

/// Off by default: no `[picker]`, no listener.
#[tokio::test]
async fn no_picker_without_its_listen_address() {
    let cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        ..NodeConfig::default()
    };
    let node = kvmesh::proxy::spawn(cfg).await.unwrap();
    assert!(node.picker_addr.is_none());
    tokio::time::timeout(Duration::from_secs(10), node.shutdown())
        .await
        .unwrap();
}
