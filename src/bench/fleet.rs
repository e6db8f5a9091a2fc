//! In-process fleets to replay against: simulated replicas behind kvmesh nodes that form a real
//! mesh (QUIC gossip with mTLS, load sharing, summary sync), as users run several nodes.
//!
//! Exists so that every `kvmesh bench` fleet figure with several nodes is a mesh figure: nodes
//! that did not know of each other would each see a third of the load and measure a deployment
//! nobody runs. The demo starts its multi-region fleets with the same pieces ([`MeshCerts`],
//! [`wait_ready`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;

use super::fleet_pd::FleetPd;
use super::replay::{replay, ReplayConfig, RunResult};
use super::workload::request::WorkloadRequest;
use crate::core::hot_prefix::HotPrefixConfig;
use crate::core::policy::PolicyKind;
use crate::core::priority::PrioritiesConfig;
use crate::core::tenants::TenantConfig;
use crate::engine_sim::EngineConfig;
use crate::mesh::certs;
use crate::node::config::{MeshSection, NodeConfig, ReplicaConfig as NodeReplica};
use crate::proxy::{self, RunningNode};
use crate::replica::ReplicaHandle;
use crate::replicas::kv_events::{KvEventsSource, RankRouting};
use crate::tokenize::{TokenizerConfig, BUILTIN_SIM};

/// An in-process fleet: simulated replicas behind kvmesh nodes, meshed when there are several.
#[derive(Clone, Debug)]
pub struct FleetConfig {
    /// Simulated replicas. Default 4.
    pub replicas: usize,
    /// kvmesh nodes per run, one region, each configured with every replica; with more than one
    /// they form a mesh. Clients spread over them. Default 1.
    pub nodes: usize,
    /// Replicas run this many times faster than real time, and arrivals are sped up by the same
    /// factor, so the fleet sees the workload's load; reports are in model seconds. Default 10.
    pub time_scale: f64,
    /// Engine model of every replica (its `time_scale` is overridden). Default 8B on one H100.
    pub engine: EngineConfig,
    /// Model name served. Default "sim-llama-8b".
    pub model: String,
    /// Tenant policies of every node (`[tenants.<name>]`). Default none.
    pub tenants: HashMap<String, TenantConfig>,
    /// Data-parallel ranks per replica (each an `engine`). With more than one, replicas publish
    /// KV events per rank and nodes follow them in token mode (`builtin:kvmesh-sim`), so their
    /// cache models are exact and know which rank holds what. Default 1 (no events, text mode).
    pub dp_ranks: u16,
    /// With `dp_ranks` > 1: how nodes name the rank (`Off`: the replica's balancer picks).
    /// Default header.
    pub rank_routing: RankRouting,
    /// Every node's `[hot_prefix]`. Its times and rates are wall-clock: run a fleet with
    /// warm-ups at `time_scale` 1. Default: warm-ups off.
    pub hot_prefix: HotPrefixConfig,
    /// Replicas publish KV events and nodes follow them in token mode even with one rank, so
    /// home models are exact and know each block's tier (a CPU tier's offloads). Default off.
    pub kv_events: bool,
    /// What every replica declares to the nodes as `kv_load` (CPU hits weighed by load time).
    /// Default none (the fixed `tier_weights`).
    pub kv_load: Option<crate::core::kv_load::KvLoad>,
    /// Every node's `[priorities]` (each class's `max_wait_ms` in model time: the nodes get it
    /// divided by `time_scale`). Default none.
    pub priorities: Option<PrioritiesConfig>,
    /// Every replica's `max_in_flight` at the nodes. Default: the node's default (256).
    pub max_in_flight: Option<u32>,
    /// Prefill/decode disaggregation: the replicas' roles (their count overrides `replicas`)
    /// and the protocol. Default none (every replica serves requests whole).
    pub pd: Option<FleetPd>,
    /// Every node's `[kv_fetch]`; with a mode other than off every replica takes
    /// `vllm-envelope` hints (`kv_load.hints`) and the run is labelled `fetch=<mode>`.
    /// Default off.
    pub kv_fetch: crate::core::kv_fetch::KvFetchConfig,
    /// The link KV pulls between the fleet's replicas cross, Gb/s: the replicas spend their
    /// transfers at it (`[pd] link_gbps`), and the nodes price pulls at it (every replica is on
    /// 127.0.0.1, so it is their `same_host` link; the default table would say NVLink).
    /// Default 100 (12.5 GB/s, the node's `same_region` link).
    pub fetch_link_gbps: f64,
}

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            replicas: 4,
            nodes: 1,
            time_scale: 10.0,
            engine: EngineConfig::default(),
            model: "sim-llama-8b".into(),
            tenants: HashMap::new(),
            dp_ranks: 1,
            rank_routing: RankRouting::Header,
            hot_prefix: HotPrefixConfig::default(),
            kv_events: false,
            kv_load: None,
            priorities: None,
            max_in_flight: None,
            pd: None,
            kv_fetch: Default::default(),
            fetch_link_gbps: 100.0,
        }
    }
}

/// A cluster CA and node certificates in a temporary directory, removed on drop.
pub struct MeshCerts(PathBuf);

impl MeshCerts {
    /// A fresh CA with a certificate for each of `names`.
    pub fn new<'a>(names: impl IntoIterator<Item = &'a str>) -> anyhow::Result<Self> {
        static RUN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kvmesh-fleet-{}-{n}", std::process::id()));
        let certs = MeshCerts(dir);
        std::fs::create_dir_all(&certs.0)
            .with_context(|| format!("creating {}", certs.0.display()))?;
        certs::init_dir(&certs.0).context("making the fleet's cluster CA")?;
        for name in names {
            certs::issue_in_dir(&certs.0, name).context("issuing a node certificate")?;
        }
        Ok(certs)
    }

    /// The directory (a node's `mesh.certs_dir`).
    pub fn dir(&self) -> &Path {
        &self.0
    }
}

impl Drop for MeshCerts {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The `[mesh]` section of fleet node `name`, seeded by `seed` (none for the first node).
pub fn mesh_section(
    name: &str,
    certs: &MeshCerts,
    seed: Option<std::net::SocketAddr>,
) -> MeshSection {
    MeshSection {
        node_id: name.into(),
        listen: ([127, 0, 0, 1], 0).into(),
        seeds: seed.iter().map(|a| a.to_string()).collect(),
        certs_dir: Some(certs.dir().to_owned()),
        ..MeshSection::default()
    }
}

/// Waits until every node answers `/ready` (joined the mesh and warmed from its peers).
pub async fn wait_ready(nodes: &[RunningNode]) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    for n in nodes {
        let url = format!("http://{}/ready", n.addr);
        loop {
            let ok = client
                .get(&url)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "node {} not ready after 30 s",
                n.addr
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

/// Waits until some node follows each of the first `replicas` replicas' KV events (its cache
/// model of it is exact), so a run starts with the models it measures.
async fn wait_exact(nodes: &[RunningNode], replicas: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let exact = (0..replicas).all(|i| {
            nodes.iter().any(|n| {
                n.node.lock().replicas.get(i).is_some_and(|rt| {
                    rt.cache.source() == crate::core::cache_model::CacheSource::Exact
                })
            })
        });
        if exact {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "KV events not followed after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Starts a fresh fleet (cold caches) for `policy`, replays `workload` through its nodes and
/// stops it. `replay.targets`, `model`, `speedup` (multiplied by the time scale), `time_scale`
/// and `label` (when left "run") are set from the fleet.
pub async fn run_fleet(
    workload: &[WorkloadRequest],
    policy: PolicyKind,
    fleet: &FleetConfig,
    replay_cfg: &ReplayConfig,
) -> anyhow::Result<RunResult> {
    let replica_count = fleet
        .pd
        .as_ref()
        .map_or(fleet.replicas, |pd| pd.roles.len());
    anyhow::ensure!(
        replica_count > 0 && fleet.nodes > 0,
        "a fleet needs at least one replica and one node"
    );
    anyhow::ensure!(
        fleet.time_scale.is_finite() && fleet.time_scale > 0.0,
        "time_scale must be > 0"
    );
    let names: Vec<String> = (0..fleet.nodes).map(|n| format!("node-{n}")).collect();
    let certs = if fleet.nodes > 1 {
        Some(MeshCerts::new(names.iter().map(String::as_str))?)
    } else {
        None
    };
    let mut replicas = Vec::with_capacity(replica_count);
    let mut nodes: Vec<RunningNode> = Vec::with_capacity(fleet.nodes);
    let result = async {
        start_replicas(fleet, replica_count, &mut replicas).await?;
        // Follow the replicas' KV events (exact models): always with ranks, or when asked.
        let follow = fleet.dp_ranks > 1 || fleet.kv_events;
        for (n, name) in names.iter().enumerate() {
            let mut cfg = node_config(policy, fleet, replay_cfg, n, &replicas);
            if let Some(certs) = &certs {
                let seed = nodes.first().and_then(|f| f.node.mesh()).map(|m| m.addr());
                cfg.mesh = Some(mesh_section(name, certs, seed));
            }
            nodes.push(proxy::spawn(cfg).await?);
        }
        wait_ready(&nodes).await?;
        if follow {
            wait_exact(&nodes, replica_count).await?;
        }
        let cfg = ReplayConfig {
            targets: nodes.iter().map(|n| format!("http://{}", n.addr)).collect(),
            model: Some(fleet.model.clone()),
            speedup: replay_cfg.speedup * fleet.time_scale,
            time_scale: fleet.time_scale,
            label: run_label(policy, fleet, replay_cfg),
            ..replay_cfg.clone()
        };
        let mut run = replay(workload, &cfg).await?;
        run.replicas = replicas.iter().map(|r| r.id.clone()).collect();
        for n in &nodes {
            let stats = n.node.lock().hot.stats();
            run.warmups += stats.sent;
            run.warmup_tokens += stats.tokens;
        }
        anyhow::Ok(run)
    }
    .await;
    for n in nodes {
        n.shutdown().await;
    }
    for r in replicas {
        r.shutdown().await;
    }
    result
}

/// Starts the fleet's `count` simulated replicas into `replicas` (there, they are stopped even
/// when a later one fails to start).
async fn start_replicas(
    fleet: &FleetConfig,
    count: usize,
    replicas: &mut Vec<ReplicaHandle>,
) -> anyhow::Result<()> {
    for i in 0..count {
        let mut cfg = crate::replica::ReplicaConfig {
            id: format!("replica-{i}"),
            model: fleet.model.clone(),
            engine: fleet.engine.clone(),
            exit_on_crash: false,
            dp_ranks: fleet.dp_ranks,
            kv_events: (fleet.dp_ranks > 1 || fleet.kv_events)
                .then(crate::replica::KvEventsConfig::default),
            ..Default::default()
        };
        cfg.engine.time_scale = fleet.time_scale;
        cfg.pd.link_gbps = fleet.fetch_link_gbps;
        if let Some(pd) = &fleet.pd {
            pd.apply_replica(i, &mut cfg)?;
        }
        replicas.push(crate::replica::spawn(cfg).await?);
    }
    Ok(())
}

/// Node `n`'s configuration (but its mesh section): every replica of the fleet, at model-time
/// rates, following their KV events where the fleet asks for exact models.
fn node_config(
    policy: PolicyKind,
    fleet: &FleetConfig,
    replay_cfg: &ReplayConfig,
    n: usize,
    replicas: &[ReplicaHandle],
) -> NodeConfig {
    // A replica's rate is its ranks' together (each rank is one engine).
    let ranks = f64::from(fleet.dp_ranks.max(1));
    let prefill_rate = ranks * 1000.0 / fleet.engine.prefill_ms_per_token.max(1e-9);
    // Follow the replicas' KV events (exact models): always with ranks, or when asked.
    let follow = fleet.dp_ranks > 1 || fleet.kv_events;
    let fetching = fleet.kv_fetch.mode != crate::core::kv_fetch::FetchMode::Off;
    let mut cfg = NodeConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        // The replay reads which replica served from `x-kvmesh-routed-to`.
        debug_headers: true,
        policy: policy.as_str().into(),
        seed: replay_cfg.seed.wrapping_add(n as u64),
        drain_s: 5,
        tenants: fleet.tenants.clone(),
        hot_prefix: fleet.hot_prefix.clone(),
        kv_fetch: fleet.kv_fetch,
        // Deadlines are in wall-clock time: scaled, so they mean the same in model time.
        priorities: fleet.priorities.clone().map(|mut p| {
            for c in &mut p.classes {
                c.max_wait_ms = ((c.max_wait_ms as f64 / fleet.time_scale.max(1.0)) as u64).max(1);
            }
            p
        }),
        ..NodeConfig::default()
    };
    // The replicas pull from each other at `fetch_link_gbps`; price pulls at the same link.
    let same_region = cfg.kv_fetch.links.same_region;
    cfg.kv_fetch.links.same_host = crate::core::kv_fetch::LinkSpec {
        gb_per_s: fleet.fetch_link_gbps / 8.0,
        setup_ms: same_region.setup_ms,
    };
    cfg.health.interval_ms = 200;
    cfg.scrape.interval_ms = 100;
    if follow {
        // Keys equal to the events' keys, so the per-rank models answer.
        cfg.tokenizer = Some(TokenizerConfig {
            path: BUILTIN_SIM.into(),
            chat_template_config: None,
            block_size: u32::try_from(fleet.engine.block_tokens).ok(),
            models: vec![fleet.model.clone()],
        });
    }
    if let Some(pd) = &fleet.pd {
        pd.apply_node(&mut cfg);
    }
    cfg.replicas = replicas
        .iter()
        .map(|r| NodeReplica {
            id: Some(r.id.clone()),
            models: vec![fleet.model.clone()],
            // An exact model holds the CPU tier's blocks too: its summary is sized for both.
            capacity_tokens: Some(
                (fleet.engine.kv_capacity_tokens + fleet.engine.cpu_capacity_tokens) as u64
                    * u64::from(fleet.dp_ranks.max(1)),
            ),
            kv_load: fetching
                .then(|| crate::core::kv_load::KvLoad {
                    hints: crate::core::kv_load::KvHintFormat::VllmEnvelope,
                    ..fleet.kv_load.unwrap_or_default()
                })
                .or(fleet.kv_load),
            kv_events: r
                .kv_events_port
                .filter(|_| follow)
                .map(|port| KvEventsSource {
                    replay: r.kv_replay_port.map(|p| format!("tcp://127.0.0.1:{p}")),
                    dp_ranks: fleet.dp_ranks,
                    rank_routing: Some(fleet.rank_routing),
                    ..KvEventsSource::new(format!("tcp://127.0.0.1:{port}"))
                }),
            // Model-time rate: the node's cost model then works in model seconds, like its
            // w_load and spill thresholds.
            prefill_tokens_per_s: prefill_rate,
            max_in_flight: fleet
                .max_in_flight
                .unwrap_or(NodeReplica::from_url(r.base_url()).max_in_flight),
            ..NodeReplica::from_url(r.base_url())
        })
        .collect();
    if let Some(pd) = &fleet.pd {
        for (i, (entry, r)) in cfg.replicas.iter_mut().zip(replicas).enumerate() {
            pd.apply_entry(i, r, entry);
        }
    }
    cfg
}

/// The run's label: the replay's own, or (left "run") the policy with what sets the fleet
/// apart (ranks and their routing, warm-ups, a P/D shape).
fn run_label(policy: PolicyKind, fleet: &FleetConfig, replay_cfg: &ReplayConfig) -> String {
    let label = base_label(policy, fleet, replay_cfg);
    if fleet.kv_fetch.mode == crate::core::kv_fetch::FetchMode::Off {
        label
    } else {
        format!("{label} fetch={}", fleet.kv_fetch.mode.as_str())
    }
}

/// The label before the fetch mode: the replay's own, or the policy with ranks, warm-ups or
/// a P/D shape.
fn base_label(policy: PolicyKind, fleet: &FleetConfig, replay_cfg: &ReplayConfig) -> String {
    let unlabelled = replay_cfg.label == ReplayConfig::default().label;
    if unlabelled && fleet.dp_ranks > 1 {
        let how = match fleet.rank_routing {
            RankRouting::Header => "header",
            RankRouting::Body => "body",
            RankRouting::Off => "off",
        };
        format!("{} dp={} rank={how}", policy.as_str(), fleet.dp_ranks)
    } else if unlabelled && fleet.hot_prefix.enabled {
        format!("{} +hot", policy.as_str())
    } else if unlabelled && fleet.pd.is_some() {
        let shape = fleet.pd.as_ref().map(FleetPd::label).unwrap_or_default();
        format!("{} {shape}", policy.as_str())
    } else if unlabelled {
        policy.as_str().to_owned()
    } else {
        replay_cfg.label.clone()
    }
}

/// Runs [`run_fleet`] once per policy, each on a fresh fleet, in order. What `kvmesh bench
/// --compare-policies` calls.
pub async fn run_fleet_comparison(
    workload: &[WorkloadRequest],
    policies: &[PolicyKind],
    fleet: &FleetConfig,
    replay_cfg: &ReplayConfig,
) -> anyhow::Result<Vec<RunResult>> {
    let mut runs = Vec::with_capacity(policies.len());
    for &p in policies {
        tracing::info!(policy = p.as_str(), "starting fleet run");
        runs.push(run_fleet(workload, p, fleet, replay_cfg).await?);
    }
    Ok(runs)
}

/// haproxy (from `PATH`) in front of some backends: round-robin over keep-alive connections on
/// both sides, as operators put it in front of several nodes. Killed on drop.
///
/// `no_delay` sets `option http-no-delay`. Without it haproxy holds small streamed writes back
/// (`MSG_MORE`) until more data comes or ~200 ms pass, which delays every stream's first token:
/// the demo always sets it, `examples/proxy_path.rs` measures both.
pub struct Haproxy {
    child: std::process::Child,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
}

impl Haproxy {
    /// Writes a config into `dir`, starts haproxy and waits (≤ 5 s) until it accepts connections.
    pub async fn start(
        backends: &[std::net::SocketAddr],
        no_delay: bool,
        dir: &Path,
    ) -> anyhow::Result<Haproxy> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let servers: String = backends
            .iter()
            .enumerate()
            .map(|(i, b)| format!("    server s{i} {b}\n"))
            .collect();
        let no_delay = if no_delay {
            "    option http-no-delay\n"
        } else {
            ""
        };
        let cfg = format!(
            "global\n    maxconn 900\ndefaults\n    mode http\n    option http-keep-alive\n\
             {no_delay}    timeout connect 5s\n    timeout client 600s\n    timeout server 600s\n\
             frontend f\n    bind 127.0.0.1:{port}\n    default_backend b\n\
             backend b\n    balance roundrobin\n{servers}"
        );
        let path = dir.join(format!("haproxy-{port}.cfg"));
        std::fs::write(&path, cfg).with_context(|| format!("writing {}", path.display()))?;
        let child = std::process::Command::new("haproxy")
            .arg("-f")
            .arg(&path)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context("starting haproxy (is it installed? Debian: apt-get install haproxy)")?;
        let proxy = Haproxy {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            anyhow::ensure!(
                Instant::now() < deadline,
                "haproxy did not listen on {port}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(proxy)
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
