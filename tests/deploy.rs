//! The deployment files in `deploy/`, checked without a network or a container runtime: the
//! systemd unit passes `systemd-analyze verify` (where that tool exists; skipped with a message
//! otherwise), and both Containerfiles run `kvmesh` as a non-root user and expose the ports the
//! default configuration listens on. `scripts/build-image.sh` builds and runs the image itself
//! (it needs buildah and a release build, so it is not run here). `scripts/validate-k8s.sh`
//! renders and validates the Kubernetes manifests of `deploy/k8s/` where kubectl is installed.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvmesh::node::config::{MeshSection, NodeConfig};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs `cmd` for at most `limit`; `None` if it had to be killed.
fn run_bounded(cmd: &mut Command, limit: Duration) -> Option<(bool, String)> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let start = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            let out = child.wait_with_output().expect("output");
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            return Some((out.status.success(), text));
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn systemd_unit_verifies() {
    let probe = Command::new("systemd-analyze")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        eprintln!("skipped: systemd-analyze is not installed");
        return;
    }
    // `verify` insists that ExecStart's binary exists: point it at the one cargo built. The file
    // keeps its name, since `verify` derives the unit name (and %d) from it.
    let unit = std::fs::read_to_string(repo().join("deploy/systemd/kvmesh.service")).unwrap();
    assert!(
        unit.contains("/usr/local/bin/kvmesh serve"),
        "ExecStart changed?"
    );
    let unit = unit.replace("/usr/local/bin/kvmesh", env!("CARGO_BIN_EXE_kvmesh"));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvmesh.service");
    std::fs::write(&path, unit).unwrap();
    let (ok, out) = run_bounded(
        Command::new("systemd-analyze")
            .args(["--man=no", "verify"])
            .arg(&path),
        Duration::from_secs(60),
    )
    .expect("systemd-analyze verify took over 60 s");
    // It reports problems on stderr, possibly with status 0: any output is a failure.
    assert!(
        ok && out.trim().is_empty(),
        "systemd-analyze verify:\n{out}"
    );
}

#[test]
fn systemd_unit_outlasts_the_drain() {
    let unit = std::fs::read_to_string(repo().join("deploy/systemd/kvmesh.service")).unwrap();
    let stop: u64 = directive(&unit, "TimeoutStopSec")[0].parse().unwrap();
    let drain = NodeConfig::default().drain_s;
    assert!(
        stop > drain,
        "TimeoutStopSec={stop} must exceed drain_s={drain}"
    );
    assert_eq!(directive(&unit, "LimitNOFILE"), ["1048576"]);
    assert_eq!(directive(&unit, "CapabilityBoundingSet"), [""]);
}

/// Every value of `key=` in a unit file, or of `KEY ` in a Containerfile.
fn directive(text: &str, key: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            l.strip_prefix(key)
                .and_then(|rest| rest.strip_prefix('=').or_else(|| rest.strip_prefix(' ')))
        })
        .map(|v| v.trim().to_string())
        .collect()
}

fn check_containerfile(path: &Path) {
    let text = std::fs::read_to_string(path).unwrap();
    let name = path.display();
    // The runtime stage is the one after the last FROM.
    let lines: Vec<&str> = text.lines().collect();
    let last_from = lines
        .iter()
        .rposition(|l| l.trim_start().starts_with("FROM "))
        .unwrap_or_else(|| panic!("{name}: no FROM"));
    let runtime = lines[last_from..].join("\n");

    let entry = directive(&runtime, "ENTRYPOINT");
    assert_eq!(
        entry.len(),
        1,
        "{name}: one ENTRYPOINT in the runtime stage"
    );
    assert!(
        entry[0].starts_with("[\"/") && entry[0].contains("kvmesh\""),
        "{name}: ENTRYPOINT must be the exec form naming the kvmesh binary: {}",
        entry[0]
    );

    let users = directive(&runtime, "USER");
    let user = users.last().unwrap_or_else(|| panic!("{name}: no USER"));
    let uid = user.split(':').next().unwrap();
    assert!(
        uid.parse::<u32>().is_ok_and(|u| u != 0),
        "{name}: USER must be a numeric non-root uid (so runAsNonRoot can check it): {user}"
    );

    let exposed: Vec<String> = directive(&runtime, "EXPOSE")
        .iter()
        .flat_map(|l| l.split_whitespace().map(str::to_string).collect::<Vec<_>>())
        .collect();
    let http = format!("{}/tcp", NodeConfig::default().listen.port());
    let mesh = format!("{}/udp", MeshSection::default().listen.port());
    for port in [http, mesh] {
        assert!(
            exposed.contains(&port),
            "{name}: EXPOSE lacks {port}: {exposed:?}"
        );
    }
}

#[test]
fn containerfiles_run_kvmesh_as_non_root_on_the_default_ports() {
    let dir = repo().join("deploy/container");
    check_containerfile(&dir.join("Containerfile"));
    check_containerfile(&dir.join("Containerfile.local"));
    // The full build runs in a builder image and copies the binary into a scratch stage.
    let full = std::fs::read_to_string(dir.join("Containerfile")).unwrap();
    assert!(
        full.contains("AS build") && full.contains("FROM scratch"),
        "multi-stage"
    );
}

/// `scripts/validate-k8s.sh` renders both region overlays of `deploy/k8s/` with `kubectl
/// kustomize` and, where `kubernetes-validate` is installed, validates them against the
/// Kubernetes schemas (the script says when it skips that). Skipped where kubectl is missing.
#[test]
fn k8s_overlays_render_and_validate() {
    let probe = Command::new("kubectl")
        .args(["version", "--client"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        eprintln!("skipped: kubectl is not installed");
        return;
    }
    let (ok, out) = run_bounded(
        &mut Command::new(repo().join("scripts/validate-k8s.sh")),
        Duration::from_secs(60),
    )
    .expect("scripts/validate-k8s.sh took over 60 s");
    eprintln!("{out}");
    assert!(ok, "scripts/validate-k8s.sh failed:\n{out}");
    for region in ["eu", "us", "picker"] {
        assert!(
            out.contains(&format!("validate-k8s: {region}: rendered")),
            "{region} not rendered:\n{out}"
        );
    }
    // The picker overlay's custom resources have no schema: their references are checked.
    assert!(
        out.contains("validate-k8s: picker: pool references check passed")
            || out.contains("PyYAML not installed"),
        "{out}"
    );
}

/// The picker overlay's node.toml follows the overlay's InferencePool in the overlay's
/// namespace and listens for ext_proc on the port its Service and the pool name.
#[test]
fn the_picker_overlay_config_follows_its_pool() {
    let dir = repo().join("deploy/k8s/overlays/picker");
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
    let text = read("node.toml")
        .replace("${POD_IP}", "10.1.2.3")
        .replace("${POD_NAME}", "kvmesh-0");
    let cfg = NodeConfig::from_toml(&text).unwrap_or_else(|e| panic!("picker node.toml: {e}"));
    let listen = cfg.picker.listen.map(|a| a.to_string());
    assert_eq!(
        listen.as_deref(),
        Some("0.0.0.0:9002"),
        "the picker listens on 9002"
    );
    assert!(text.contains("[picker]\nlisten = \"0.0.0.0:9002\""));
    let k = &cfg.kubernetes[0];
    assert_eq!(k.inference_pool.as_deref(), Some("kvmesh-pool"));
    assert!(read("kustomization.yaml").contains(&format!("namespace: {}\n", k.namespace)));
    let pool = read("inferencepool.yaml");
    assert!(pool.contains("  name: kvmesh-pool\n"), "{pool}");
    assert!(
        pool.contains("    name: kvmesh-picker\n    port:\n      number: 9002\n"),
        "{pool}"
    );
    assert!(read("picker-service.yaml").contains("port: 9002"));
}

/// The metric names `expr` mentions (histogram series reduced to their family).
#[test]
fn the_k8s_node_configs_are_valid_once_the_pod_fills_them_in() {
    // What the StatefulSet's downward API sets (no other test reads these names).
    std::env::set_var("POD_IP", "10.1.2.3");
    std::env::set_var("POD_NAME", "kvmesh-0");
    for file in [
        "deploy/k8s/base/node.toml",
        "deploy/k8s/overlays/eu/node.toml",
        "deploy/k8s/overlays/us/node.toml",
    ] {
        let cfg =
            NodeConfig::from_file(&repo().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        let mesh: MeshSection = cfg.mesh.unwrap_or_else(|| panic!("{file}: no [mesh]"));
        assert_eq!(mesh.node_id, "kvmesh-0", "{file}");
        assert_eq!(
            mesh.advertise,
            Some("10.1.2.3:7946".parse().unwrap()),
            "{file}"
        );
        assert_eq!(
            mesh.http_url.as_deref(),
            Some("https://10.1.2.3:8443"),
            "{file}"
        );
    }
}

fn metric_families(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(pos) = expr[i..].find("kvmesh_") {
        let start = i + pos;
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_lowercase() || bytes[end] == b'_') {
            end += 1;
        }
        let name = &expr[start..end];
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        out.push(family.to_owned());
        i = end;
    }
    out
}

/// Every metric the Grafana dashboard queries is one a live node exports: two regions, a node
/// without replicas forwarding to one with a replica that publishes KV events, after streamed
/// and plain requests at both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_queries_only_metrics_nodes_export() {
    use kvmesh::node::config::{KvEventsSource, ReplicaConfig as NodeReplica};
    use kvmesh::proxy;
    use kvmesh::replica::{self, config::KvEventsConfig, ReplicaConfig};
    let run = async {
        proxy::install_crypto_provider();
        let dash: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(repo().join("deploy/grafana/kvmesh.json")).unwrap(),
        )
        .unwrap();
        let mut wanted = std::collections::BTreeSet::new();
        for p in dash["panels"].as_array().unwrap() {
            for t in p["targets"].as_array().unwrap() {
                wanted.extend(metric_families(t["expr"].as_str().unwrap()));
            }
        }
        assert!(wanted.len() > 20, "{wanted:?}");

        let certs = tempfile::tempdir().unwrap();
        kvmesh::mesh::certs::init_dir(certs.path()).unwrap();
        let mut rcfg = ReplicaConfig {
            id: "rb0".into(),
            exit_on_crash: false,
            kv_events: Some(KvEventsConfig::default()),
            ..ReplicaConfig::default()
        };
        rcfg.engine.time_scale = 50.0;
        let rb = replica::spawn(rcfg).await.unwrap();
        let node = |name: &str, region: &str, seeds: Vec<String>, replicas: Vec<NodeReplica>| {
            kvmesh::mesh::certs::issue_in_dir(certs.path(), name).unwrap();
            let mut cfg = NodeConfig {
                listen: "127.0.0.1:0".parse().unwrap(),
                region: region.into(),
                drain_s: 2,
                replicas,
                ..NodeConfig::default()
            };
            cfg.health.interval_ms = 100;
            cfg.scrape.interval_ms = 100;
            cfg.mesh = Some(MeshSection {
                node_id: name.into(),
                listen: "127.0.0.1:0".parse().unwrap(),
                seeds,
                certs_dir: Some(certs.path().to_owned()),
                ..MeshSection::default()
            });
            proxy::spawn(cfg)
        };
        let b1 = node(
            "b1",
            "b",
            vec![],
            vec![NodeReplica {
                id: Some("rb0".into()),
                kv_events: Some(KvEventsSource {
                    endpoint: format!("tcp://127.0.0.1:{}", rb.kv_events_port.unwrap()),
                    ..KvEventsSource::new("")
                }),
                ..NodeReplica::from_url(rb.base_url())
            }],
        )
        .await
        .unwrap();
        let seed = b1.node.mesh().unwrap().addr().to_string();
        let a1 = node("a1", "a", vec![seed], vec![]).await.unwrap();
        let http = reqwest::Client::new();
        let mut forwarded = false;
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(20) {
            for (n, stream) in [(&a1, true), (&a1, false), (&b1, true), (&b1, false)] {
                let resp = http
                    .post(format!("http://{}/v1/completions", n.addr))
                    .json(&serde_json::json!({"model": "sim-llama-8b",
                        "prompt": "a shared prefix for the dashboard ".repeat(20),
                        "max_tokens": 2, "stream": stream}))
                    .send()
                    .await;
                if let Ok(r) = resp {
                    forwarded |= std::ptr::eq(n, &a1) && r.status() == 200;
                    let _ = r.bytes().await;
                }
            }
            if forwarded {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert!(forwarded, "a1 never forwarded to region b");
        // A few gossip rounds for the mesh counters.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut exported = std::collections::BTreeSet::new();
        for n in [&a1, &b1] {
            let text = http
                .get(format!("http://{}/metrics", n.addr))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            exported.extend(
                text.lines()
                    .filter_map(|l| l.strip_prefix("# TYPE "))
                    .filter_map(|l| l.split(' ').next())
                    .map(str::to_owned),
            );
        }
        let missing: Vec<_> = wanted.difference(&exported).collect();
        assert!(
            missing.is_empty(),
            "the dashboard queries metrics no node exports: {missing:?}"
        );
        for n in [a1, b1] {
            n.shutdown().await;
        }
        rb.shutdown().await;
    };
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("test exceeded its time bound");
}
