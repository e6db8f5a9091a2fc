//! `kvmesh replica`: a simulated OpenAI-compatible LLM engine (DESIGN.md §8, issue #3).
//!
//! An axum server in front of the sans-IO [`crate::engine_sim`] model, driven in real time (divided
//! by the time scale), with vLLM-named metrics, vLLM-format KV events over ZMQ and fault injection.
//! [`spawn`] starts one in-process and returns its bound addresses, for tests, the demo and benches.

pub mod args;
pub mod config;
pub mod driver;
pub mod faults;
pub mod http;
pub mod listener;
pub mod metrics;
pub mod openai;
pub mod tokenize_api;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU64};
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, Notify};
use tokio::task::JoinHandle;

use crate::engine_sim::config::ConfigError;
use crate::kv_events::{KvPublisher, KvPublisherConfig, PublisherError};

pub use args::ReplicaArgs;
pub use config::{KvEventsConfig, ReplicaConfig};
pub use faults::{FaultConfig, FaultPatch};

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
}

/// A running replica. Dropping it does not stop it; call [`ReplicaHandle::shutdown`].
#[derive(Debug)]
pub struct ReplicaHandle {
    /// Bound HTTP address.
    pub addr: SocketAddr,
    /// Bound KV-event PUB port, if KV events are enabled.
    pub kv_events_port: Option<u16>,
    /// Bound KV-event replay (ROUTER) port, if enabled.
    pub kv_replay_port: Option<u16>,
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
    let publisher = match &config.kv_events {
        Some(kv) => Some(Arc::new(
            KvPublisher::start(KvPublisherConfig {
                host: config.host.clone(),
                port: kv.port,
                replay_port: kv.replay_port,
                topic: kv.topic.clone(),
                buffer_steps: kv.buffer_steps,
            })
            .await?,
        )),
        None => None,
    };
    let kv_events_port = publisher.as_ref().map(|p| p.port());
    let kv_replay_port = publisher.as_ref().and_then(|p| p.replay_port());
    let (stop, stop_rx) = watch::channel(false);
    let (driver_tx, driver_rx) = mpsc::unbounded_channel();
    let faults = Arc::new(faults::Faults::new(config.faults.clone()));
    let faults_changed = Arc::new(Notify::new());
    let shared = Arc::new(http::Shared {
        id: config.id.clone(),
        model: config.model.clone(),
        max_model_len: config.engine.max_model_len,
        max_body_bytes: config.max_body_bytes,
        default_max_tokens: config.default_max_tokens.max(1),
        driver: driver_tx,
        metrics: metrics.clone(),
        faults: faults.clone(),
        faults_changed: faults_changed.clone(),
        stop: stop.clone(),
        exit_on_crash: config.exit_on_crash,
        next_id: AtomicU64::new(0),
        in_flight: Arc::new(AtomicI64::new(0)),
    });
    let app = http::router(shared);
    let listener = listener::FaultyListener::new(tcp, addr, faults, faults_changed);
    let engine_cfg = config.engine.clone();
    let id = config.id.clone();
    let task = tokio::spawn(async move {
        let mut stop_driver = stop_rx.clone();
        let driver = driver::run(engine_cfg, driver_rx, metrics, publisher);
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
        id: config.id,
        stop,
        task,
    })
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
