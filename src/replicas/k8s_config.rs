//! The `[[kubernetes]]` table: where a Kubernetes replica source looks (a Service's
//! EndpointSlices, a label selector's, or an `InferencePool`'s pods), how it talks to the API
//! server, and what every replica it finds shares; plus [`Found`], one routable endpoint.
//!
//! Shared by the EndpointSlice source (`k8s.rs`) and the InferencePool source
//! (`inference_pool.rs`), which differ only in what they read to learn the endpoints.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::dns::DnsKvEvents;
use super::entry::{default_max_in_flight, default_pool, default_prefill_rate, ReplicaConfig};
use crate::core::role::Role;

/// Largest watch event line read (bytes); a longer one is skipped and counted.
pub const MAX_EVENT_LINE_BYTES: usize = 1 << 20;
/// Largest LIST response body read (bytes); a larger one fails the list (the set is kept).
pub const MAX_LIST_BYTES: usize = 16 << 20;
/// Largest `max_endpoints` a source may set.
pub const MAX_ENDPOINTS_LIMIT: usize = 65_536;
/// Largest service-account token read (bytes).
pub const MAX_TOKEN_BYTES: u64 = 64 << 10;
/// Largest CA bundle read (bytes).
pub const MAX_CA_BYTES: u64 = 1 << 20;
/// Longest resourceVersion kept (bytes); the API's are decimal etcd revisions.
pub const MAX_RESOURCE_VERSION_BYTES: usize = 256;
/// Longest pod name or zone taken from an endpoint (a DNS subdomain is at most 253 bytes).
pub const MAX_NAME_BYTES: usize = 253;
/// Longest `watch_timeout_s` (the API server's own default is 30-60 minutes).
pub const MAX_WATCH_TIMEOUT_S: u64 = 3_600;
/// Longest `request_timeout_ms`, `min_backoff_ms` and `max_backoff_ms`: one hour.
pub const MAX_K8S_MS: u64 = 3_600_000;
/// At most one warning per source per this long about dropped input.
pub const WARN_EVERY: Duration = Duration::from_secs(10);

/// The in-cluster service-account token, which the kubelet keeps fresh.
pub const DEFAULT_TOKEN_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";
/// The in-cluster CA bundle that signed the API server's certificate.
pub const DEFAULT_CA_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt";

/// Replicas found in a namespace's EndpointSlices, or among the pods an `InferencePool`
/// selects. Every routable endpoint becomes a replica with id `<pod>@<ip>:<port>`
/// (`<ip>:<port>` without a pod reference); endpoints that leave, turn not-ready or start
/// terminating drain.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct KubernetesConfig {
    /// Namespace of the EndpointSlices (required).
    pub namespace: String,
    /// Service whose slices to follow (label `kubernetes.io/service-name`). Exactly one of
    /// `service`, `label_selector` and `inference_pool` is required.
    #[serde(default)]
    pub service: Option<String>,
    /// A raw label selector for the slices instead, e.g. `app=vllm,tier!=canary`.
    #[serde(default)]
    pub label_selector: Option<String>,
    /// An `InferencePool` (`inference.networking.k8s.io/v1`) to follow instead: the ready pods
    /// its `spec.selector.matchLabels` selects, at its `spec.targetPorts`. The pool is watched
    /// too: a changed selector or port list re-lists the pods.
    #[serde(default)]
    pub inference_pool: Option<String>,
    /// What a pool's several target ports are (only with `inference_pool`): `"replicas"`, one
    /// replica per pod and port (each port its own engine and cache, e.g. vLLM's data-parallel
    /// ranks behind their own API servers), or `"ranks"`, one replica per pod at its first port
    /// whose data-parallel ranks are the ports (`kv_events.dp_ranks` becomes the port count;
    /// a picker names rank r as `ip:targetPorts[r]`, `[picker] rank_ports`). Default
    /// `"replicas"`.
    #[serde(default)]
    pub target_ports: Option<TargetPorts>,
    /// Name of the EndpointSlice port to route to (not with `inference_pool`). Default: the
    /// slice's only port (a slice with several ports and no `port_name` is skipped, and
    /// counted).
    #[serde(default)]
    pub port_name: Option<String>,
    /// URL scheme of the replicas. Default `http`.
    #[serde(default = "default_scheme")]
    pub scheme: String,
    /// API server base URL. Default: `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`
    /// (in-cluster). `http://` is allowed for tests and `kubectl proxy`; the token is then not
    /// sent.
    #[serde(default)]
    pub api_server: Option<String>,
    /// Bearer token file, re-read at every LIST and WATCH (tokens rotate). A missing file means
    /// no token. Default `/var/run/secrets/kubernetes.io/serviceaccount/token`.
    #[serde(default = "default_token_file")]
    pub token_file: PathBuf,
    /// CA bundle (PEM) that signed the API server's certificate; read at start for `https`.
    /// Default `/var/run/secrets/kubernetes.io/serviceaccount/ca.crt`.
    #[serde(default = "default_ca_file")]
    pub ca_file: PathBuf,
    /// Connect and LIST deadline, and the wait for a WATCH's response headers (ms). Default
    /// 10,000.
    #[serde(default = "default_request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// How long one WATCH runs before the API server ends it and it is reopened from the last
    /// resourceVersion (`timeoutSeconds`); the client gives up `request_timeout_ms` after that.
    /// Default 300, at most 3,600.
    #[serde(default = "default_watch_timeout_s")]
    pub watch_timeout_s: u64,
    /// First wait after a failed LIST or WATCH (ms); it doubles, with jitter, per failure.
    /// Default 500.
    #[serde(default = "default_min_backoff_ms")]
    pub min_backoff_ms: u64,
    /// Longest wait between attempts (ms). Default 30,000.
    #[serde(default = "default_max_backoff_ms")]
    pub max_backoff_ms: u64,
    /// Most endpoints (and most slices) this source keeps; the rest are dropped and counted.
    /// Default 4,096, at most 65,536.
    #[serde(default = "default_max_endpoints")]
    pub max_endpoints: usize,
    /// Region of the replicas. Default: the node's region.
    #[serde(default)]
    pub region: Option<String>,
    /// Zone or rack. Default: each endpoint's own `zone`, else empty.
    #[serde(default)]
    pub zone: String,
    /// Pool. Default `shared`.
    #[serde(default = "default_pool")]
    pub pool: String,
    /// Models they serve. Default: discovered from each replica's `/v1/models`.
    #[serde(default)]
    pub models: Vec<String>,
    /// KV capacity in tokens. Default: scraped, else 450,000.
    #[serde(default)]
    pub capacity_tokens: Option<u64>,
    /// Prefill speed in tokens/s. Default 50,000.
    #[serde(default = "default_prefill_rate")]
    pub prefill_tokens_per_s: f64,
    /// In-flight requests above which a replica counts as full. Default 256.
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: u32,
    /// Role of the replicas it finds: `prefill`, `decode` or `both`. Default `both`.
    #[serde(default)]
    pub role: Role,
    /// Their KV bootstrap port (prefill replicas; SGLang, vLLM Mooncake). Default none: 8998.
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
    /// Where each replica's engine publishes KV events, as ports on the endpoint's address
    /// (as for `[[dns]]`). Default none.
    #[serde(default)]
    pub kv_events: Option<DnsKvEvents>,
    /// KV size and offload bandwidths of the replicas, as `[[replicas]] kv_load`. Default none.
    #[serde(default)]
    pub kv_load: Option<crate::core::kv_load::KvLoad>,
}

fn default_scheme() -> String {
    "http".into()
}
fn default_token_file() -> PathBuf {
    PathBuf::from(DEFAULT_TOKEN_FILE)
}
fn default_ca_file() -> PathBuf {
    PathBuf::from(DEFAULT_CA_FILE)
}
fn default_request_timeout_ms() -> u64 {
    10_000
}
fn default_watch_timeout_s() -> u64 {
    300
}
fn default_min_backoff_ms() -> u64 {
    500
}
fn default_max_backoff_ms() -> u64 {
    30_000
}
fn default_max_endpoints() -> usize {
    4_096
}

/// Whether `s` is a DNS label (RFC 1123): what namespaces, Service names and port names are.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

impl KubernetesConfig {
    /// Checks every value; the error names the field (under `kubernetes[n].`).
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        let err = |field: &'static str, msg: &str| Err((field, msg.to_owned()));
        if !is_dns_label(&self.namespace) {
            return err(
                "namespace",
                "must be a DNS label (lowercase letters, digits, '-')",
            );
        }
        let given = [
            self.service.is_some(),
            self.label_selector.is_some(),
            self.inference_pool.is_some(),
        ];
        if given.iter().filter(|g| **g).count() > 1 {
            let field = if self.inference_pool.is_some() {
                "inference_pool"
            } else {
                "label_selector"
            };
            return err(
                field,
                "give one of service, label_selector and inference_pool",
            );
        }
        if let Some(pool) = &self.inference_pool {
            if !is_dns_subdomain(pool) {
                return err(
                    "inference_pool",
                    "must be a DNS subdomain (lowercase letters, digits, '-', '.')",
                );
            }
            if self.port_name.is_some() {
                return err(
                    "port_name",
                    "not with inference_pool (the pool's targetPorts name the ports)",
                );
            }
        } else if self.target_ports.is_some() {
            return err("target_ports", "only with inference_pool");
        }
        match (&self.service, &self.label_selector) {
            (None, None) if self.inference_pool.is_some() => {}
            (Some(_), Some(_)) => {
                return err("label_selector", "give service or label_selector, not both")
            }
            (None, None) => {
                return err(
                    "service",
                    "one of service, label_selector or inference_pool is required",
                )
            }
            (Some(s), None) if !is_dns_label(s) => {
                return err(
                    "service",
                    "must be a DNS label (lowercase letters, digits, '-')",
                )
            }
            (None, Some(l)) if l.trim().is_empty() || l.len() > 1024 => {
                return err("label_selector", "must be 1 to 1024 characters")
            }
            _ => {}
        }
        if let Some(p) = &self.port_name {
            if !is_dns_label(p) {
                return err(
                    "port_name",
                    "must be a DNS label (omit it for the slice's only port)",
                );
            }
        }
        if !matches!(self.scheme.as_str(), "http" | "https") {
            return err("scheme", "must be http or https");
        }
        if let Some(api) = &self.api_server {
            match reqwest::Url::parse(api) {
                Ok(u) if matches!(u.scheme(), "http" | "https") && u.host_str().is_some() => {}
                _ => {
                    return Err((
                        "api_server",
                        format!("'{api}' must be an http(s) URL with a host"),
                    ))
                }
            }
        }
        if !(1..=MAX_K8S_MS).contains(&self.request_timeout_ms) {
            return err("request_timeout_ms", "must be 1 to 3,600,000");
        }
        if !(1..=MAX_WATCH_TIMEOUT_S).contains(&self.watch_timeout_s) {
            return err("watch_timeout_s", "must be 1 to 3,600");
        }
        if !(1..=MAX_K8S_MS).contains(&self.min_backoff_ms) {
            return err("min_backoff_ms", "must be 1 to 3,600,000");
        }
        if self.max_backoff_ms < self.min_backoff_ms || self.max_backoff_ms > MAX_K8S_MS {
            return err("max_backoff_ms", "must be min_backoff_ms to 3,600,000");
        }
        if !(1..=MAX_ENDPOINTS_LIMIT).contains(&self.max_endpoints) {
            return err("max_endpoints", "must be 1 to 65,536");
        }
        // The replica fields (region, models, capacity, speed, KV events) are checked by the
        // node's configuration on the replica an endpoint becomes (`validate_replica`).
        Ok(())
    }

    /// The label selector of the EndpointSlices (empty for an `inference_pool` source, whose
    /// pods' selector comes from the pool).
    pub fn selector(&self) -> String {
        match (&self.service, &self.label_selector) {
            (Some(s), _) => format!("kubernetes.io/service-name={s}"),
            (None, Some(l)) => l.clone(),
            (None, None) => String::new(),
        }
    }

    /// The source's name in logs and metrics: `<namespace>/<service>`,
    /// `<namespace>/inferencepool/<pool>` or `<namespace>/<selector>`.
    pub fn source_name(&self) -> String {
        match (&self.service, &self.inference_pool) {
            (Some(s), _) => format!("{}/{s}", self.namespace),
            (None, Some(p)) => format!("{}/inferencepool/{p}", self.namespace),
            (None, None) => format!("{}/{}", self.namespace, self.selector()),
        }
    }

    /// The replica an endpoint becomes.
    pub fn replica(&self, found: &Found) -> ReplicaConfig {
        ReplicaConfig {
            url: format!("{}://{}", self.scheme, found.addr),
            id: Some(found.id.clone()),
            region: self.region.clone(),
            zone: if self.zone.is_empty() {
                found.zone.clone().unwrap_or_default()
            } else {
                self.zone.clone()
            },
            pool: self.pool.clone(),
            models: self.models.clone(),
            capacity_tokens: self.capacity_tokens,
            prefill_tokens_per_s: self.prefill_tokens_per_s,
            prefill_attention_ms_per_pair: crate::core::view::DEFAULT_PREFILL_ATTENTION_MS_PER_PAIR,
            max_in_flight: self.max_in_flight,
            role: self.role,
            bootstrap_port: self.bootstrap_port,
            // Engine ids differ per engine: a discovered prefill names its own in its answer.
            engine_id: String::new(),
            kv_events: self.kv_events_at(found),
            kv_load: self.kv_load,
        }
    }

    /// Where the engine behind `found` publishes KV events: the configured ports on its
    /// address, moved up by its port index (vLLM offsets its publisher's ports by the
    /// data-parallel rank, and a pool's N target ports are N ranks). `None` without
    /// `kv_events`, or if the offset port would pass 65,535.
    pub fn kv_events_at(&self, found: &Found) -> Option<super::kv_events::KvEventsSource> {
        let kv = self.kv_events.as_ref()?;
        if found.port_index == 0 {
            let mut source = kv.at(found.addr.ip());
            if found.ranks > 0 {
                source.dp_ranks = found.ranks;
            }
            return Some(source);
        }
        let shifted = DnsKvEvents {
            port: kv.port.checked_add(found.port_index)?,
            replay_port: match kv.replay_port {
                Some(p) => Some(p.checked_add(found.port_index)?),
                None => None,
            },
            ..kv.clone()
        };
        Some(shifted.at(found.addr.ip()))
    }

    /// The connect/LIST deadline.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }
}

/// What an `InferencePool`'s several target ports are (`target_ports`).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum TargetPorts {
    /// One replica per pod and port.
    #[default]
    Replicas,
    /// One replica per pod; the ports are its data-parallel ranks, in order.
    Ranks,
}

/// Whether `s` is a DNS subdomain (RFC 1123): what object names (an `InferencePool`'s) are.
pub fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_NAME_BYTES && s.split('.').all(is_dns_label)
}

/// The replica id of pod `name` at `addr`: `name@addr`, the name shortened to fit the mesh's
/// 128-byte ids (its first bytes, `~`, and a hash of the whole name, the same at every node).
/// A pod name may take 253 bytes; a longer id would route here but never reach the peers.
pub fn pod_replica_id(name: &str, addr: std::net::SocketAddr) -> String {
    let addr = addr.to_string();
    let max = crate::mesh::schema::MAX_REPLICA_ID_BYTES;
    if name.len() + 1 + addr.len() <= max {
        return format!("{name}@{addr}");
    }
    let keep = max.saturating_sub(addr.len() + 1 + 17);
    let cut = (0..=keep.min(name.len()))
        .rev()
        .find(|&i| name.is_char_boundary(i))
        .unwrap_or(0);
    let hash = crate::core::affinity::replica_seed(name);
    format!("{}~{hash:016x}@{addr}", &name[..cut])
}

/// A routable endpoint: the replica it becomes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    /// Replica id: `<pod>@<ip>:<port>`, or `<ip>:<port>` without a pod reference. The address
    /// is part of it because a pod that keeps its name (a StatefulSet's) but moves is a new
    /// engine at a new URL, and the registry never changes an id's URL.
    pub id: String,
    /// Address and port.
    pub addr: SocketAddr,
    /// The endpoint's zone, if given.
    pub zone: Option<String>,
    /// Which of the pod's ports this is (an `InferencePool`'s `targetPorts` index; 0 for an
    /// EndpointSlice's endpoint): its engine's KV-event ports are the configured ones plus this.
    pub port_index: u16,
    /// Data-parallel ranks behind it, when a pool's ports are its ranks (`target_ports =
    /// "ranks"`): its KV events' `dp_ranks`. 0: as configured.
    pub ranks: u16,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_pod_name_is_shortened_to_an_id_the_same_at_every_node() {
        let addr: std::net::SocketAddr = "10.0.0.1:8000".parse().unwrap();
        assert_eq!(pod_replica_id("vllm-0", addr), "vllm-0@10.0.0.1:8000");
        let long = "p".repeat(253);
        let id = pod_replica_id(&long, addr);
        assert!(
            id.len() <= crate::mesh::schema::MAX_REPLICA_ID_BYTES,
            "{id}"
        );
        assert!(id.ends_with("@10.0.0.1:8000"), "{id}");
        assert_eq!(id, pod_replica_id(&long, addr));
        assert_ne!(id, pod_replica_id(&"p".repeat(252), addr));
    }
}
