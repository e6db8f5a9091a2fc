//! gRPC health (`grpc.health.v1.Health`) for the picker, as the endpoint-picker protocol asks:
//! `liveness` serves while the process answers; `readiness` and the ext_proc service name
//! (`envoy.service.ext_proc.v3.ExternalProcessor`) follow the node's `/ready`.
//!
//! Exists so a gateway (or a kubelet's gRPC probe) stops sending to a picker that cannot serve:
//! a watcher re-reads `Node::ready` every [`EVERY`] and reports only changes.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use crate::node::Node;

/// The service name of liveness.
pub const LIVENESS: &str = "liveness";
/// The service name of readiness.
pub const READINESS: &str = "readiness";
/// The ext_proc service's own name.
pub const EXT_PROC: &str = "envoy.service.ext_proc.v3.ExternalProcessor";
/// How often readiness is re-read.
pub const EVERY: Duration = Duration::from_millis(500);

/// Reports liveness now and readiness as it changes, until `stop`.
pub async fn watch_ready(
    node: Arc<Node>,
    reporter: HealthReporter,
    mut stop: watch::Receiver<bool>,
) {
    reporter
        .set_service_status(LIVENESS, ServingStatus::Serving)
        .await;
    let mut last = None;
    loop {
        let ready = node.ready();
        if last != Some(ready) {
            let status = if ready {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            for service in [READINESS, EXT_PROC] {
                reporter.set_service_status(service, status).await;
            }
            last = Some(ready);
        }
        tokio::select! {
            _ = tokio::time::sleep(EVERY) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}
