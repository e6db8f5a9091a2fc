//! The Gateway API endpoint picker: an Envoy ext_proc gRPC listener (`[picker]`) beside the HTTP
//! front, following the endpoint-picker protocol (kubernetes-sigs/gateway-api-inference-extension,
//! proposal 004, v1.0.0).
//!
//! Exists so that on a cluster where a gateway sends the traffic (an `InferencePool` behind
//! Envoy Gateway, Istio, kgateway…), every picker replica decides as a kvmesh node does — same
//! stages, same view, same mesh — and only names the endpoint. Files, one concept each:
//! `stream.rs` (one stream's state machine), `pick.rs` (a decision as `ip:port`s, the subset
//! hint), `accounting.rs` (the response phase's bookkeeping), `wire.rs` (Envoy's messages),
//! `health.rs` (gRPC health), `metrics.rs`, `ctx.rs` (what streams share).

mod accounting;
mod ctx;
mod health;
mod metrics;
mod pick;
mod stream;
mod wire;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use anyhow::Context;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::sync::{mpsc, watch};
use tonic::{Request, Response, Status, Streaming};

use crate::node::Node;
use ctx::PickerCtx;
use metrics::PickerMetrics;

/// Answers buffered per stream before the stream's task waits for the gateway to read.
const ANSWERS_BUFFERED: usize = 16;

/// The ext_proc service.
struct Picker(PickerCtx);

type AnswerStream =
    Pin<Box<dyn futures::Stream<Item = Result<ProcessingResponse, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = AnswerStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let (tx, mut rx) = mpsc::channel(ANSWERS_BUFFERED);
        // The stream's task ends with the stream: when the gateway goes away its reads fail
        // and its sends find no reader, and everything it booked is released as it ends.
        tokio::spawn(stream::run(self.0.clone(), request.into_inner(), tx));
        let answers = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
        Ok(Response::new(Box::pin(answers)))
    }
}

/// A running picker listener.
pub struct PickerListener {
    /// Where it listens (the real port when configured with port 0).
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl PickerListener {
    /// Stops serving at once (streams in flight end).
    pub fn abort(&self) {
        self.task.abort();
    }
}

/// Starts the picker when `[picker] listen` is set: binds, registers its metrics, serves the
/// ext_proc and health services until `stop`.
pub async fn start(
    node: &Arc<Node>,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<Option<PickerListener>> {
    let Some(listen) = node.cfg.picker.listen else {
        return Ok(None);
    };
    let tcp = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen} (picker.listen)"))?;
    let addr = tcp.local_addr()?;
    let metrics = PickerMetrics::new(&node.metrics.registry).context("picker metrics")?;
    let ctx = PickerCtx {
        node: Arc::clone(node),
        cfg: Arc::new(node.cfg.picker.clone()),
        metrics,
    };
    let (reporter, health_service) = tonic_health::server::health_reporter();
    tokio::spawn(health::watch_ready(
        Arc::clone(node),
        reporter,
        stop.clone(),
    ));
    let incoming = tonic::transport::server::TcpIncoming::from(tcp).with_nodelay(Some(true));
    let mut shutdown = stop;
    let server = tonic::transport::Server::builder()
        .max_concurrent_streams(node.cfg.picker.max_concurrent_streams)
        // A gateway that vanished without closing is found out between requests.
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(10)))
        .add_service(health_service)
        .add_service(ExternalProcessorServer::new(Picker(ctx)))
        .serve_with_incoming_shutdown(incoming, async move {
            let _ = shutdown.wait_for(|s| *s).await;
        });
    let task = tokio::spawn(async move {
        if let Err(e) = server.await {
            tracing::warn!(error = %e, "the picker's listener failed");
        }
    });
    tracing::info!(%addr, "endpoint picker (ext_proc) listening");
    Ok(Some(PickerListener { addr, task }))
}
