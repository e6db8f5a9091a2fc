//! `[picker]`: the Gateway API endpoint picker, i.e. an Envoy ext_proc gRPC listener beside the
//! HTTP front (`proxy::picker`, docs/operations.md "Endpoint picker (ext_proc)").
//!
//! Off unless `listen` is set. A gateway then asks the node which replica serves each request;
//! the node decides as its HTTP front would, names the replica (and fallbacks) by `ip:port`,
//! and never sees the request's bytes go upstream. Bodies are bounded by the HTTP front's
//! limits (`max_body_bytes`, `server.body_*`). Whether a gateway lets requests through when the
//! picker is down (fail open) or refuses them (fail closed) is the gateway's setting (Envoy's
//! `failure_mode_allow`, the InferencePool's `endpointPickerRef.failureMode`), not the node's.

use std::net::SocketAddr;

use serde::Deserialize;

use super::error::{invalid, ConfigError};

/// Most fallback endpoints a pick may name (`fallbacks`).
pub const MAX_FALLBACKS: u32 = 8;
/// Most ports `rank_ports` may list: a replica has at most 64 data-parallel ranks.
pub const MAX_RANK_PORTS: usize = 64;
/// Most concurrent ext_proc streams per gateway connection a configuration may allow.
pub const MAX_STREAMS_LIMIT: u32 = 1_000_000;

/// `[picker]`.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct PickerSection {
    /// Address of the ext_proc gRPC listener (`envoy.service.ext_proc.v3.ExternalProcessor` and
    /// `grpc.health.v1.Health`), plaintext h2c as gateways dial a picker in-cluster. Default
    /// none: no picker.
    pub listen: Option<SocketAddr>,
    /// Endpoints named after the pick, for the gateway to try in order when the pick fails
    /// (each the next best replica, never one already named), 0..=8. Default 2.
    pub fallbacks: u32,
    /// The ports of a data-parallel replica's ranks, in rank order, as an InferencePool's
    /// `targetPorts` lists them: rank r is served at the replica's host, port `rank_ports[r]`.
    /// Default empty: rank r at the replica's URL port + r. At most 64.
    pub rank_ports: Vec<u16>,
    /// Metadata namespace of the pick (dynamic metadata) and of the served endpoint the gateway
    /// reports (metadata context). Default `envoy.lb`, the protocol's.
    pub metadata_namespace: String,
    /// Filter-metadata namespace of the gateway's subset hint. Default `envoy.lb.subset_hint`.
    pub subset_namespace: String,
    /// Concurrent ext_proc streams (one per request in flight) per gateway connection,
    /// 1..=1,000,000. Default 16,384.
    pub max_concurrent_streams: u32,
}

impl Default for PickerSection {
    fn default() -> Self {
        PickerSection {
            listen: None,
            fallbacks: 2,
            rank_ports: Vec::new(),
            metadata_namespace: "envoy.lb".into(),
            subset_namespace: "envoy.lb.subset_hint".into(),
            max_concurrent_streams: 16_384,
        }
    }
}

impl PickerSection {
    /// Checks the numbers and names; each error names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.fallbacks > MAX_FALLBACKS {
            return Err(invalid(
                "picker.fallbacks",
                format!("at most {MAX_FALLBACKS}"),
            ));
        }
        if self.rank_ports.len() > MAX_RANK_PORTS {
            return Err(invalid(
                "picker.rank_ports",
                format!("at most {MAX_RANK_PORTS} ports"),
            ));
        }
        if self.rank_ports.contains(&0) {
            return Err(invalid("picker.rank_ports", "a port must not be 0"));
        }
        for (key, v) in [
            ("picker.metadata_namespace", &self.metadata_namespace),
            ("picker.subset_namespace", &self.subset_namespace),
        ] {
            if v.is_empty() || v.len() > 128 {
                return Err(invalid(key, "must be 1 to 128 bytes"));
            }
        }
        if !(1..=MAX_STREAMS_LIMIT).contains(&self.max_concurrent_streams) {
            return Err(invalid(
                "picker.max_concurrent_streams",
                format!("must be 1..={MAX_STREAMS_LIMIT}"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_by_default_and_each_bound_names_its_key() {
        let d: PickerSection = toml::from_str("").unwrap();
        assert_eq!(d, PickerSection::default());
        assert!(d.listen.is_none());
        assert!(d.validate().is_ok());
        let on: PickerSection =
            toml::from_str("listen = \"127.0.0.1:9002\"\nrank_ports = [3000, 3002]").unwrap();
        assert_eq!(on.listen, Some("127.0.0.1:9002".parse().unwrap()));
        assert!(on.validate().is_ok());
        let bad = |s: PickerSection, key: &str| {
            let e = s.validate().unwrap_err().to_string();
            assert!(e.contains(key), "{e} names {key}");
        };
        bad(
            PickerSection {
                fallbacks: 9,
                ..PickerSection::default()
            },
            "picker.fallbacks",
        );
        bad(
            PickerSection {
                rank_ports: vec![0],
                ..PickerSection::default()
            },
            "picker.rank_ports",
        );
        bad(
            PickerSection {
                metadata_namespace: String::new(),
                ..PickerSection::default()
            },
            "picker.metadata_namespace",
        );
        bad(
            PickerSection {
                max_concurrent_streams: 0,
                ..PickerSection::default()
            },
            "picker.max_concurrent_streams",
        );
        assert!(toml::from_str::<PickerSection>("port = 1").is_err());
    }
}
