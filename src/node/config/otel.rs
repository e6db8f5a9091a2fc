//! `[tracing]`: OpenTelemetry trace export of routed requests (OTLP over HTTP).
//!
//! Exists so that the one question "does this node export traces, and where to" has one answer
//! decided at start: the file's `otlp_endpoint`, else the standard `OTEL_EXPORTER_OTLP_ENDPOINT`
//! environment variable (read only by [`TracingConfig::apply_env`], at the CLI edge, so tests and
//! embedders are not steered by the environment), and `OTEL_SDK_DISABLED=true` turns it off.
//! Off by default: a node without a collector adds nothing to its request path.

use serde::Deserialize;

use super::error::{invalid, ConfigError};

/// The environment variable naming the OTLP collector's base URL (OpenTelemetry's standard).
pub const OTLP_ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
/// The environment variable that, set to `true`, turns every OpenTelemetry export off.
pub const SDK_DISABLED_ENV: &str = "OTEL_SDK_DISABLED";
/// The OTLP/HTTP path of the trace service, appended to the endpoint.
pub const TRACES_PATH: &str = "/v1/traces";

/// Trace export settings (`[tracing]`). Every field has a default; none of them matters until
/// an endpoint is set.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TracingConfig {
    /// Base URL of an OTLP/HTTP collector, e.g. `http://127.0.0.1:4318`; spans are posted to
    /// `<otlp_endpoint>/v1/traces` as protobuf. Unset: tracing is off unless
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` is set when `kvmesh serve` starts. Default none.
    pub otlp_endpoint: Option<String>,
    /// The `service.name` resource attribute of every span. Default `kvmesh`.
    pub service_name: String,
    /// Share of traces the node starts that are sampled, 0..=1. Parent-based: a request whose
    /// `traceparent` says sampled (or not) keeps its caller's decision. Default 1.0.
    pub sample_ratio: f64,
    /// Longest time one export (one batch, retries included) may take, in ms. Default 10,000.
    pub export_timeout_ms: u64,
    /// Ended spans held for export at most; beyond this they are dropped (counted in
    /// `kvmesh_trace_spans_dropped_total`), so a slow or absent collector never holds memory
    /// or the request path. Default 2,048.
    pub max_queue_spans: usize,
    /// Spans per export request at most. Default 512.
    pub max_export_batch_spans: usize,
    /// Queued spans are exported at least this often, in ms (a full batch goes at once).
    /// Default 1,000.
    pub schedule_delay_ms: u64,
}

impl Default for TracingConfig {
    fn default() -> Self {
        TracingConfig {
            otlp_endpoint: None,
            service_name: "kvmesh".into(),
            sample_ratio: 1.0,
            export_timeout_ms: 10_000,
            max_queue_spans: 2_048,
            max_export_batch_spans: 512,
            schedule_delay_ms: 1_000,
        }
    }
}

impl TracingConfig {
    /// Whether the node exports traces.
    pub fn enabled(&self) -> bool {
        self.otlp_endpoint.is_some()
    }

    /// The URL spans are posted to: the endpoint with `/v1/traces` appended (unless it already
    /// ends with it), or `None` when tracing is off.
    pub fn traces_url(&self) -> Option<String> {
        let base = self.otlp_endpoint.as_deref()?.trim_end_matches('/');
        if base.ends_with(TRACES_PATH) {
            return Some(base.to_owned());
        }
        Some(format!("{base}{TRACES_PATH}"))
    }

    /// Applies OpenTelemetry's standard environment: `OTEL_SDK_DISABLED=true` turns tracing off;
    /// otherwise, with no `otlp_endpoint` in the file, `OTEL_EXPORTER_OTLP_ENDPOINT` (when set
    /// and not empty) is the endpoint. The file's value wins over the environment, as
    /// programmatic configuration does in every OpenTelemetry SDK. `env` reads one variable.
    pub fn apply_env(&mut self, env: impl Fn(&str) -> Option<String>) {
        if env(SDK_DISABLED_ENV).is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            self.otlp_endpoint = None;
            return;
        }
        if self.otlp_endpoint.is_none() {
            self.otlp_endpoint = env(OTLP_ENDPOINT_ENV).filter(|v| !v.trim().is_empty());
        }
    }

    /// Checks every value; errors name the key (`tracing.<field>`).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(e) = &self.otlp_endpoint {
            let ok = reqwest::Url::parse(e)
                .is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some());
            if !ok {
                return Err(invalid(
                    "tracing.otlp_endpoint",
                    format!("'{e}' is not an http:// or https:// URL"),
                ));
            }
        }
        if self.service_name.is_empty() {
            return Err(invalid("tracing.service_name", "must not be empty"));
        }
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Err(invalid(
                "tracing.sample_ratio",
                format!("must be between 0 and 1, got {}", self.sample_ratio),
            ));
        }
        for (key, v) in [
            ("tracing.export_timeout_ms", self.export_timeout_ms),
            ("tracing.schedule_delay_ms", self.schedule_delay_ms),
            ("tracing.max_queue_spans", self.max_queue_spans as u64),
            (
                "tracing.max_export_batch_spans",
                self.max_export_batch_spans as u64,
            ),
        ] {
            if v == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        // A queue that holds everything a collector outage produces is no bound at all.
        if self.max_queue_spans > 1 << 20 {
            return Err(invalid("tracing.max_queue_spans", "at most 1,048,576"));
        }
        if self.max_export_batch_spans > self.max_queue_spans {
            return Err(invalid(
                "tracing.max_export_batch_spans",
                "must be at most max_queue_spans",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    #[test]
    fn the_environment_fills_in_only_what_the_file_leaves_out() {
        let mut c = TracingConfig::default();
        c.apply_env(env(&[]));
        assert!(!c.enabled(), "off by default");
        c.apply_env(env(&[(OTLP_ENDPOINT_ENV, "http://otel:4318/")]));
        assert_eq!(
            c.traces_url().as_deref(),
            Some("http://otel:4318/v1/traces")
        );
        let mut c = TracingConfig {
            otlp_endpoint: Some("http://file:4318".into()),
            ..TracingConfig::default()
        };
        c.apply_env(env(&[(OTLP_ENDPOINT_ENV, "http://env:4318")]));
        assert_eq!(
            c.traces_url().as_deref(),
            Some("http://file:4318/v1/traces")
        );
        c.apply_env(env(&[(SDK_DISABLED_ENV, "TRUE")]));
        assert!(!c.enabled(), "OTEL_SDK_DISABLED wins");
        let mut c = TracingConfig::default();
        c.apply_env(env(&[(OTLP_ENDPOINT_ENV, " ")]));
        assert!(!c.enabled(), "an empty variable is unset");
        let c = TracingConfig {
            otlp_endpoint: Some("https://c/v1/traces".into()),
            ..TracingConfig::default()
        };
        assert_eq!(c.traces_url().as_deref(), Some("https://c/v1/traces"));
    }

    #[test]
    fn bad_values_are_named() {
        for (c, key) in [
            (
                TracingConfig {
                    otlp_endpoint: Some("otel:4318".into()),
                    ..TracingConfig::default()
                },
                "tracing.otlp_endpoint",
            ),
            (
                TracingConfig {
                    sample_ratio: 1.5,
                    ..TracingConfig::default()
                },
                "tracing.sample_ratio",
            ),
            (
                TracingConfig {
                    sample_ratio: f64::NAN,
                    ..TracingConfig::default()
                },
                "tracing.sample_ratio",
            ),
            (
                TracingConfig {
                    max_queue_spans: 0,
                    ..TracingConfig::default()
                },
                "tracing.max_queue_spans",
            ),
            (
                TracingConfig {
                    max_export_batch_spans: 4096,
                    ..TracingConfig::default()
                },
                "tracing.max_export_batch_spans",
            ),
            (
                TracingConfig {
                    service_name: String::new(),
                    ..TracingConfig::default()
                },
                "tracing.service_name",
            ),
        ] {
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(key), "{c:?} → {e}");
        }
        assert!(TracingConfig::default().validate().is_ok());
    }
}
