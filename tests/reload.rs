//! Configuration reload, as an operator does it: edit the file, `kill -HUP` the running
//! `kvmesh serve` process. Under steady load, a tenant's pools and quota change, a replica joins
//! and no request fails; a broken file changes nothing. Real processes and sockets on loopback,
//! every wait bounded.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

mod common;
use common::{free_tcp_port, sim_replica};

const MODEL: &str = "sim-llama-8b";

/// Kills the node process when the test ends, however it ends.
struct Node(Child);

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The node's config: replicas (id, url, pool), and tenant `acme` limited to `pools`.
fn write_config(
    path: &Path,
    port: u16,
    replicas: &[(&str, String, &str)],
    pools: &[&str],
    quota: u32,
) {
    let mut text = format!(
        "listen = \"127.0.0.1:{port}\"\ndebug_headers = true\n\n[health]\ninterval_ms = 100\n\n"
    );
    for (id, url, pool) in replicas {
        text.push_str(&format!(
            "[[replicas]]\nid = \"{id}\"\nurl = \"{url}\"\npool = \"{pool}\"\n\n"
        ));
    }
    text.push_str(&format!(
        "[tenants.acme]\npools = {pools:?}\nmax_in_flight_per_replica = {quota}\n"
    ));
    std::fs::write(path, text).unwrap();
}

fn hup(node: &Node) {
    let ok = Command::new("kill")
        .args(["-HUP", &node.0.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -HUP failed");
}

/// (status, replica that served, when) of one request as tenant `acme`.
async fn complete(c: &reqwest::Client, port: u16, i: usize) -> (u16, String, Instant) {
    let resp = c
        .post(format!("http://127.0.0.1:{port}/v1/completions"))
        .header("x-tenant-id", "acme")
        .json(&json!({"model": MODEL, "prompt": format!("request {i} of the reload test"), "max_tokens": 4}))
        .send()
        .await;
    let at = Instant::now();
    match resp {
        Ok(r) => {
            let status = r.status().as_u16();
            let routed = r
                .headers()
                .get("x-kvmesh-routed-to")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            let _ = r.bytes().await;
            (status, routed, at)
        }
        Err(_) => (0, String::new(), at),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_applies_a_changed_tenant_policy_under_load_with_no_failed_request() {
    tokio::time::timeout(Duration::from_secs(60), async {
        kvmesh::proxy::install_crypto_provider();
        let ra = sim_replica("ra", |_| {}).await;
        let rb = sim_replica("rb", |_| {}).await;
        let rc = sim_replica("rc", |_| {}).await;
        let (ua, ub, uc) = (
            format!("http://{}", ra.addr),
            format!("http://{}", rb.addr),
            format!("http://{}", rc.addr),
        );
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("node.toml");
        let port = free_tcp_port();
        write_config(
            &cfg,
            port,
            &[("ra", ua.clone(), "a"), ("rb", ub.clone(), "b")],
            &["a"],
            4,
        );
        let log = std::fs::File::create(dir.path().join("node.log")).unwrap();
        let node = Node(
            Command::new(env!("CARGO_BIN_EXE_kvmesh"))
                .args(["serve", "--config"])
                .arg(&cfg)
                // The node logs to stdout.
                .stdout(Stdio::from(log))
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let c = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        let t0 = Instant::now();
        loop {
            let ready = c
                .get(format!("http://127.0.0.1:{port}/ready"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200);
            if ready {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "the node never became ready"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }

        // Two clients, each one request at a time: within the quota before and after.
        let running = Arc::new(AtomicBool::new(true));
        let mut clients = Vec::new();
        for k in 0..2 {
            let (c, running) = (c.clone(), Arc::clone(&running));
            clients.push(tokio::spawn(async move {
                let mut out = Vec::new();
                let mut i = k * 100_000;
                while running.load(Ordering::Relaxed) {
                    out.push(complete(&c, port, i).await);
                    i += 1;
                }
                out
            }));
        }
        tokio::time::sleep(Duration::from_millis(800)).await;
        // acme moves to pool b, where a new replica joins; the quota is raised.
        write_config(
            &cfg,
            port,
            &[
                ("ra", ua.clone(), "a"),
                ("rb", ub.clone(), "b"),
                ("rc", uc.clone(), "b"),
            ],
            &["b"],
            16,
        );
        let reloaded_at = Instant::now();
        hup(&node);
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        // A broken file changes nothing: the node keeps routing acme to pool b.
        std::fs::write(&cfg, "this is = not [valid toml").unwrap();
        hup(&node);
        tokio::time::sleep(Duration::from_millis(800)).await;
        running.store(false, Ordering::Relaxed);
        let mut all = Vec::new();
        for h in clients {
            all.extend(h.await.unwrap());
        }

        let failed: Vec<_> = all.iter().filter(|(s, _, _)| *s != 200).collect();
        assert!(
            failed.is_empty(),
            "{} of {} requests failed: {:?}",
            failed.len(),
            all.len(),
            &failed[..failed.len().min(5)]
        );
        let before: Vec<&str> = all
            .iter()
            .filter(|(_, _, at)| *at < reloaded_at)
            .map(|(_, r, _)| r.as_str())
            .collect();
        assert!(
            before.len() > 10,
            "too little load before the reload: {}",
            before.len()
        );
        assert!(
            before.iter().all(|r| *r == "ra"),
            "acme left pool a before the reload: {before:?}"
        );
        // Answers after the reload settled (200 ms on): pool b only, its new replica included.
        let after: Vec<&str> = all
            .iter()
            .filter(|(_, _, at)| *at > reloaded_at + Duration::from_millis(200))
            .map(|(_, r, _)| r.as_str())
            .collect();
        assert!(
            after.len() > 10,
            "too little load after the reload: {}",
            after.len()
        );
        assert!(
            after.iter().all(|r| *r == "rb" || *r == "rc"),
            "acme still reached pool a: {after:?}"
        );
        let switch = all
            .iter()
            .filter(|(_, r, at)| *at >= reloaded_at && r != "ra")
            .map(|(_, _, at)| *at - reloaded_at)
            .min();
        println!(
            "{} requests, none failed; first answer from pool b {:?} after SIGHUP; rc served {}",
            all.len(),
            switch,
            after.iter().filter(|r| **r == "rc").count()
        );
        let log = std::fs::read_to_string(dir.path().join("node.log")).unwrap_or_default();
        assert!(log.contains("configuration reloaded"), "{log}");
        assert!(
            log.contains("reload failed"),
            "the broken file was not reported: {log}"
        );
        drop(node);
        for r in [ra, rb, rc] {
            r.shutdown().await;
        }
    })
    .await
    .expect("test exceeded its time bound");
}
