//! The picker's metrics, registered in the node's registry when the listener starts (listed in
//! docs/operations.md).
//!
//! Exists so an operator sees what the gateway asked and what came of it: streams by outcome,
//! whether the pick or a fallback served, and how long a decision took once the body was in.

use prometheus::{Histogram, HistogramOpts, IntCounterVec, Opts, Registry};

/// Handles of the picker's metrics.
#[derive(Clone)]
pub struct PickerMetrics {
    /// `kvmesh_picker_streams_total{outcome}`: ext_proc streams by how they ended (`picked`,
    /// `refused` with an immediate response, `abandoned` by the gateway before the pick,
    /// `malformed` messages out of the protocol's order).
    pub streams: IntCounterVec,
    /// `kvmesh_picker_served_total{by}`: picked requests by the endpoint the gateway reports
    /// served them (`pick`, `fallback`, `unknown` endpoint, `unreported`).
    pub served: IntCounterVec,
    /// `kvmesh_picker_decision_seconds`: from the body's last chunk to the pick sent.
    pub decision_seconds: Histogram,
}

impl PickerMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels)?;
            registry.register(Box::new(c.clone()))?;
            Ok::<_, prometheus::Error>(c)
        };
        let decision_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "kvmesh_picker_decision_seconds",
                "Endpoint picker: seconds from a request body's last chunk to the pick sent",
            )
            .buckets(vec![
                0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.05, 0.25, 1.0,
            ]),
        )?;
        registry.register(Box::new(decision_seconds.clone()))?;
        Ok(PickerMetrics {
            streams: counter(
                "kvmesh_picker_streams_total",
                "Endpoint picker: ext_proc streams, by outcome",
                &["outcome"],
            )?,
            served: counter(
                "kvmesh_picker_served_total",
                "Endpoint picker: picked requests, by the endpoint the gateway reports served them",
                &["by"],
            )?,
            decision_seconds,
        })
    }
}
