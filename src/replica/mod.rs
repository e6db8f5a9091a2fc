//! `kvmesh replica`: a simulated OpenAI-compatible LLM engine (DESIGN.md §8, issue #3).
//!
//! An axum server in front of the sans-IO [`crate::engine_sim`] model, driven in real time (divided
//! by the time scale), with vLLM-named metrics, vLLM-format KV events over ZMQ and fault injection.
//! [`spawn`] starts one in-process and returns its bound addresses, for tests, the demo and benches.
//!
//! With `dp_ranks` > 1 it is a data-parallel engine, as vLLM's `--data-parallel-size`: one engine
//! model, driver and KV-event publisher per rank (rank r on port + r), one HTTP front that sends a
//! request to the rank it names (`X-data-parallel-rank`, or SGLang's `data_parallel_rank` field)
//! or else to the rank with the fewest requests in flight. Which rank served is in the
//! `x-kvmesh-dp-rank` response header, so tests and benches can see whether routing hit the rank
//! holding the prefix.

pub mod anthropic;
#[cfg(test)]
mod api_tests;
pub mod args;
pub mod config;
pub mod driver;
pub mod engine_call;
pub mod faults;
pub mod http;
pub mod http_apis;
pub mod kv_fetch;
pub mod listener;
pub mod metrics;
pub mod openai;
pub mod pd;
pub mod pooling;
pub mod responses;
pub mod shared;
pub mod tokenize_api;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize};
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, Notify};
use tokio::task::JoinHandle;

use crate::engine_sim::config::ConfigError;
use crate::kv_events::{KvPublisher, KvPublisherConfig, PublisherError};

pub use args::ReplicaArgs;
pub use config::{KvEventsConfig, ReplicaConfig, MAX_DP_RANKS};
pub use faults::{FaultConfig, FaultPatch};

/// Attempts at finding `dp_ranks` consecutive free ports when the KV-event port is 0.
const PORT_ATTEMPTS: usize = 32;

/// Why a replica could not start.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    /// The engine parameters are out of range.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The HTTP port could not be bound.
    #[error("binding HTTP on {addr}: {source}")]
    Bind {
        /// Address tried.
        addr: String,
        /// Cause.
        source: std::io::Error,
    },
    /// The KV event sockets could not be bound.
    #[error(transparent)]
    KvEvents(#[from] PublisherError),
    /// Metric registration failed.
    #[error("registering metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// `dp_ranks` is out of range.
    #[error("dp_ranks must be within 1..={MAX_DP_RANKS}, not {0}")]
    DpRanks(u16),
    /// The `[pd]` settings are out of range.
    #[error("pd: {0}")]
    Pd(String),
}

/// A running replica. Dropping it does not stop it; call [`ReplicaHandle::shutdown`].
#[derive(Debug)]
pub struct ReplicaHandle {
    /// Bound HTTP address.
    pub addr: SocketAddr,
    /// Bound KV-event PUB port of rank 0, if KV events are enabled (rank r's is this + r).
    pub kv_events_port: Option<u16>,
    /// Bound KV-event replay (ROUTER) port of rank 0, if enabled (rank r's is this + r).
    pub kv_replay_port: Option<u16>,
    /// Data-parallel ranks.
    pub dp_ranks: u16,
    /// The replica id.
    pub id: String,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl ReplicaHandle {
    /// `http://addr` for clients.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, stops the engine (cutting in-flight streams) and waits for the server task.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }

    /// Waits until the replica stops by itself (crash fault) or is shut down.
    pub async fn stopped(&mut self) {
        let mut rx = self.stop.subscribe();
        let _ = rx.wait_for(|stop| *stop).await;
    }
}

/// Starts a replica on `config.host:config.port` (0 = any free port) and returns once it accepts
/// connections.
pub async fn spawn(config: ReplicaConfig) -> Result<ReplicaHandle, ReplicaError> {
    config.engine.validate()?;
    let bind_addr = format!("{}:{}", config.host, config.port);
    let tcp = TcpListener::bind(&bind_addr)
        .await
        .map_err(|source| ReplicaError::Bind {
            addr: bind_addr.clone(),
            source,
        })?;
    let addr = tcp.local_addr().map_err(|source| ReplicaError::Bind {
        addr: bind_addr,
        source,
    })?;
    let metrics = metrics::Metrics::new(
        &config.model,
        config.engine.block_tokens,
        config.engine.num_blocks(),
    )?;
    if !(1..=MAX_DP_RANKS).contains(&config.dp_ranks) {
        return Err(ReplicaError::DpRanks(config.dp_ranks));
    }
    config.pd.validate().map_err(ReplicaError::Pd)?;
    let publishers = match &config.kv_events {
        Some(kv) => start_publishers(&config.host, kv, config.dp_ranks).await?,
        None => Vec::new(),
    };
    let kv_events_port = publishers.first().map(|p| p.port());
    let kv_replay_port = publishers.first().and_then(|p| p.replay_port());
    let (stop, stop_rx) = watch::channel(false);
    let (drivers, driver_rxs): (Vec<_>, Vec<_>) = (0..config.dp_ranks)
        .map(|_| mpsc::unbounded_channel())
        .unzip();
    let faults = Arc::new(faults::Faults::new(config.faults.clone()));
    let faults_changed = Arc::new(Notify::new());
    let shared = Arc::new(shared::Shared {
        id: config.id.clone(),
        model: config.model.clone(),
        max_model_len: config.engine.max_model_len,
        max_body_bytes: config.max_body_bytes,
        default_max_tokens: config.default_max_tokens.max(1),
        rank_in_flight: (0..config.dp_ranks)
            .map(|_| Arc::new(AtomicI64::new(0)))
            .collect(),
        next_rank: AtomicUsize::new(0),
        drivers,
        metrics: metrics.clone(),
        faults: faults.clone(),
        faults_changed: faults_changed.clone(),
        stop: stop.clone(),
        exit_on_crash: config.exit_on_crash,
        next_id: AtomicU64::new(0),
        in_flight: Arc::new(AtomicI64::new(0)),
        addr,
        time_scale: config.engine.time_scale,
        block_tokens: config.engine.block_tokens,
        pd: config.pd.clone(),
        transfers: pd::Transfers::default(),
        kv_client: std::sync::OnceLock::new(),
        responses: responses::Store::default(),
    });
    let app = http::router(shared);
    let listener = listener::FaultyListener::new(tcp, addr, faults, faults_changed);
    let engine_cfg = config.engine.clone();
    let id = config.id.clone();
    let task = tokio::spawn(async move {
        let mut stop_driver = stop_rx.clone();
        let mut publishers = publishers.into_iter();
        let ranks = driver_rxs.into_iter().enumerate().map(|(r, rx)| {
            let rank = u16::try_from(r).unwrap_or(u16::MAX);
            driver::run(
                engine_cfg.clone(),
                rank,
                rx,
                metrics.clone(),
                publishers.next().map(Arc::new),
            )
        });
        let driver = futures::future::join_all(ranks);
        let driver = async move {
            tokio::select! {
                _ = driver => {}
                _ = stop_driver.wait_for(|s| *s) => {}
            }
        };
        let mut stop_server = stop_rx;
        let server = async move {
            tokio::select! {
                result = axum::serve(listener, app) => {
                    if let Err(e) = result {
                        tracing::error!(error = %e, "HTTP server failed");
                    }
                }
                _ = stop_server.wait_for(|s| *s) => {}
            }
        };
        tokio::join!(driver, server);
        tracing::info!(replica = %id, "replica stopped");
    });
    tracing::info!(replica = %config.id, %addr, ?kv_events_port, ?kv_replay_port, "replica listening");
    Ok(ReplicaHandle {
        addr,
        kv_events_port,
        kv_replay_port,
        dp_ranks: config.dp_ranks,
        id: config.id,
        stop,
        task,
    })
}

/// One KV-event publisher per rank, rank r on `kv.port + r` (replay `kv.replay_port + r`), as
/// vLLM offsets them. With port 0 the first rank takes a free port and the others the ones after
/// it; when one of those is taken, the whole set is tried again elsewhere.
async fn start_publishers(
    host: &str,
    kv: &KvEventsConfig,
    ranks: u16,
) -> Result<Vec<KvPublisher>, ReplicaError> {
    let config = |port: u16, replay_port: Option<u16>| KvPublisherConfig {
        host: host.to_owned(),
        port,
        replay_port,
        topic: kv.topic.clone(),
        buffer_steps: kv.buffer_steps,
    };
    let fixed = kv.port != 0 && kv.replay_port != Some(0);
    let attempts = if fixed || ranks == 1 {
        1
    } else {
        PORT_ATTEMPTS
    };
    let mut last_error = None;
    for _ in 0..attempts {
        let first = KvPublisher::start(config(kv.port, kv.replay_port)).await?;
        let (base, replay_base) = (first.port(), first.replay_port());
        let mut all = vec![first];
        let mut failed = None;
        for r in 1..ranks {
            let offset = |p: u16| p.checked_add(r);
            let (Some(port), replay) = (offset(base), replay_base.map(offset)) else {
                failed = Some(PublisherError::PortRange(base, r));
                break;
            };
            let replay = match replay {
                Some(None) => {
                    failed = Some(PublisherError::PortRange(replay_base.unwrap_or(0), r));
                    break;
                }
                Some(Some(p)) => Some(p),
                None => None,
            };
            match KvPublisher::start(config(port, replay)).await {
                Ok(p) => all.push(p),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        match failed {
            None => return Ok(all),
            Some(e) => last_error = Some(e),
        }
    }
    Err(last_error
        .map(ReplicaError::KvEvents)
        .unwrap_or(ReplicaError::DpRanks(ranks)))
}

/// Runs a replica until `shutdown` completes (or the crash fault stops it).
pub async fn run(
    config: ReplicaConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ReplicaError> {
    let mut handle = spawn(config).await?;
    tokio::select! {
        _ = shutdown => {}
        _ = handle.stopped() => {}
    }
    handle.shutdown().await;
    Ok(())
}
