//! Replicas from Kubernetes: the EndpointSlices of a Service (or of a label selector), listed
//! and then watched through the API server.
//!
//! Exists because DNS only tells a router what the cluster DNS cached, up to a TTL late, and
//! nothing about readiness or termination: the EndpointSlice API says within a watch round trip
//! which pods are ready, and which are terminating and must stop getting new requests. Each
//! `[[kubernetes]]` source keeps the slices it was shown (LIST, then WATCH from the list's
//! `resourceVersion`; `410 Gone` or an `ERROR` event with code 410 re-lists) and brings the
//! node's registry in line through the [`ReplicaRegistry`] the node implements, exactly as a DNS
//! source does: an endpoint that becomes routable is registered (or brought back), one that
//! leaves, turns not-ready or starts terminating is removed, so it drains (in-flight requests
//! finish, new ones go elsewhere). An API server that fails or goes away changes nothing: the
//! last set stays until the API answers again (reconnecting with jittered, doubling backoff).
//!
//! A small client over reqwest rather than the `kube` crate: one resource, two verbs, and every
//! read under this project's bounds — a LIST body at most [`MAX_LIST_BYTES`], a watch event line
//! at most [`MAX_EVENT_LINE_BYTES`] (a longer one is skipped to the next newline), at most
//! `max_endpoints` endpoints and as many slices per source, every request under a deadline.
//! Malformed events, slices and endpoints are dropped and counted in
//! `kvmesh_k8s_dropped_total{source,reason}`, with one warning per 10 s, never a panic.
//!
//! Which endpoints count (the `discovery.k8s.io/v1` API reference): `conditions.ready` unset
//! means ready; `terminating` unset means not terminating. An endpoint is routable when it is
//! ready and not terminating. A terminating endpoint that is still `serving` finishes what it
//! has, which is what draining gives it; it gets nothing new. Only the first address is used
//! (the API says addresses are fungible; the EndpointSlice controller writes one). Slices of
//! address type `FQDN` (deprecated, undefined semantics) are skipped.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};
use rand::Rng;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::dns::{DnsKvEvents, ReplicaRegistry};
use super::entry::{default_max_in_flight, default_pool, default_prefill_rate, ReplicaConfig};
use super::kv_events::KvEventsSource;
use crate::core::role::Role;

/// Largest watch event line read (bytes); a longer one is skipped and counted.
pub const MAX_EVENT_LINE_BYTES: usize = 1 << 20;
/// Largest LIST response body read (bytes); a larger one fails the list (the set is kept).
pub const MAX_LIST_BYTES: usize = 16 << 20;
/// Largest `max_endpoints` a source may set.
pub const MAX_ENDPOINTS_LIMIT: usize = 65_536;
/// Largest service-account token read (bytes).
const MAX_TOKEN_BYTES: u64 = 64 << 10;
/// Largest CA bundle read (bytes).
const MAX_CA_BYTES: u64 = 1 << 20;
/// Longest resourceVersion kept (bytes); the API's are decimal etcd revisions.
const MAX_RESOURCE_VERSION_BYTES: usize = 256;
/// Longest pod name or zone taken from an endpoint (a DNS subdomain is at most 253 bytes).
const MAX_NAME_BYTES: usize = 253;
/// Longest `watch_timeout_s` (the API server's own default is 30-60 minutes).
pub const MAX_WATCH_TIMEOUT_S: u64 = 3_600;
/// Longest `request_timeout_ms`, `min_backoff_ms` and `max_backoff_ms`: one hour.
pub const MAX_K8S_MS: u64 = 3_600_000;
/// At most one warning per source per this long about dropped input.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// The in-cluster service-account token, which the kubelet keeps fresh.
pub const DEFAULT_TOKEN_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";
/// The in-cluster CA bundle that signed the API server's certificate.
pub const DEFAULT_CA_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt";

/// Replicas found in a namespace's EndpointSlices. Every routable endpoint becomes a replica
/// with id `<pod>@<ip>:<port>` (`<ip>:<port>` without a pod reference); endpoints that leave,
/// turn not-ready or start terminating drain.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct KubernetesConfig {
    /// Namespace of the EndpointSlices (required).
    pub namespace: String,
    /// Service whose slices to follow (label `kubernetes.io/service-name`). Exactly one of
    /// `service` and `label_selector` is required.
    #[serde(default)]
    pub service: Option<String>,
    /// A raw label selector for the slices instead, e.g. `app=vllm,tier!=canary`.
    #[serde(default)]
    pub label_selector: Option<String>,
    /// Name of the EndpointSlice port to route to. Default: the slice's only port (a slice with
    /// several ports and no `port_name` is skipped, and counted).
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
fn is_dns_label(s: &str) -> bool {
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
        match (&self.service, &self.label_selector) {
            (Some(_), Some(_)) => {
                return err("label_selector", "give service or label_selector, not both")
            }
            (None, None) => return err("service", "one of service or label_selector is required"),
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

    /// The label selector sent to the API server.
    pub fn selector(&self) -> String {
        match (&self.service, &self.label_selector) {
            (Some(s), _) => format!("kubernetes.io/service-name={s}"),
            (None, Some(l)) => l.clone(),
            (None, None) => String::new(),
        }
    }

    /// The source's name in logs and metrics: `<namespace>/<service>` or
    /// `<namespace>/<selector>`.
    pub fn source_name(&self) -> String {
        match &self.service {
            Some(s) => format!("{}/{s}", self.namespace),
            None => format!("{}/{}", self.namespace, self.selector()),
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
            max_in_flight: self.max_in_flight,
            role: self.role,
            bootstrap_port: self.bootstrap_port,
            // Engine ids differ per engine: a discovered prefill names its own in its answer.
            engine_id: String::new(),
            kv_events: self.kv_events.as_ref().map(|k| k.at(found.addr.ip())),
            kv_load: self.kv_load,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The API's shapes (`discovery.k8s.io/v1`). Every field optional: what is missing or mistyped
// makes that slice or endpoint drop, never the stream.

/// An EndpointSlice, as much of it as routing needs.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct EndpointSlice {
    /// Name and resourceVersion.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// `IPv4`, `IPv6` or `FQDN`.
    #[serde(default, rename = "addressType")]
    pub address_type: Option<String>,
    /// The endpoints (`null` when the slice is empty).
    #[serde(default)]
    pub endpoints: Option<Vec<Endpoint>>,
    /// The ports every endpoint of the slice listens on (`null` when none).
    #[serde(default)]
    pub ports: Option<Vec<EndpointPort>>,
}

/// The part of `metadata` used here.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ObjectMeta {
    /// Object name (slices: unique in the namespace).
    #[serde(default)]
    pub name: Option<String>,
    /// The object's (or list's) version, to watch from.
    #[serde(default, rename = "resourceVersion")]
    pub resource_version: Option<String>,
}

/// One endpoint of a slice.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Endpoint {
    /// Its addresses; the first is used.
    #[serde(default)]
    pub addresses: Option<Vec<String>>,
    /// Ready / serving / terminating.
    #[serde(default)]
    pub conditions: Option<EndpointConditions>,
    /// The object it stands for (a Pod, usually).
    #[serde(default, rename = "targetRef")]
    pub target_ref: Option<ObjectReference>,
    /// Its zone.
    #[serde(default)]
    pub zone: Option<String>,
}

/// An endpoint's conditions; unset means "unknown", read as the API reference says.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct EndpointConditions {
    /// Ready for traffic; unset reads as ready.
    #[serde(default)]
    pub ready: Option<bool>,
    /// Serving, whatever the terminating state; informational here.
    #[serde(default)]
    pub serving: Option<bool>,
    /// Terminating; unset reads as not terminating.
    #[serde(default)]
    pub terminating: Option<bool>,
}

/// A reference to the object behind an endpoint.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ObjectReference {
    /// `Pod`, usually.
    #[serde(default)]
    pub kind: Option<String>,
    /// The object's name.
    #[serde(default)]
    pub name: Option<String>,
}

/// A port of a slice.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct EndpointPort {
    /// The Service port's name (empty or unset for an unnamed port).
    #[serde(default)]
    pub name: Option<String>,
    /// The port number; unset means "all ports", which routing cannot use.
    #[serde(default)]
    pub port: Option<i64>,
    /// `TCP` (the default), `UDP` or `SCTP`.
    #[serde(default)]
    pub protocol: Option<String>,
}

/// Why input from the API server was dropped (the `reason` label of
/// `kvmesh_k8s_dropped_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dropped {
    /// A watch event line that is not a JSON event of a known type.
    MalformedEvent,
    /// A watch event line over [`MAX_EVENT_LINE_BYTES`].
    OverlongLine,
    /// A slice without a name, or with an object that is not a slice.
    BadSlice,
    /// A slice of address type FQDN (or unknown), or without the port asked for.
    UnusableSlice,
    /// An endpoint without a usable address, or with an over-long name.
    BadEndpoint,
    /// An endpoint or slice past `max_endpoints`.
    OverCap,
}

impl Dropped {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Dropped::MalformedEvent => "malformed_event",
            Dropped::OverlongLine => "overlong_line",
            Dropped::BadSlice => "bad_slice",
            Dropped::UnusableSlice => "unusable_slice",
            Dropped::BadEndpoint => "bad_endpoint",
            Dropped::OverCap => "over_cap",
        }
    }
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
}

/// Whether an endpoint with these conditions should get new requests: ready (unset = ready)
/// and not terminating (unset = not). A terminating endpoint, serving or not, only finishes.
pub fn routable(c: Option<&EndpointConditions>) -> bool {
    let Some(c) = c else { return true };
    c.ready != Some(false) && c.terminating != Some(true)
}

/// The slice's port to route to: the one named `port_name` (TCP), or its only port.
fn slice_port(ports: &[EndpointPort], port_name: Option<&str>) -> Option<u16> {
    let tcp = |p: &&EndpointPort| p.protocol.as_deref().is_none_or(|proto| proto == "TCP");
    let port = match port_name {
        Some(name) => ports
            .iter()
            .filter(tcp)
            .find(|p| p.name.as_deref() == Some(name))?,
        None => {
            let mut tcp_ports = ports.iter().filter(tcp);
            let only = tcp_ports.next()?;
            if tcp_ports.next().is_some() {
                return None;
            }
            only
        }
    };
    u16::try_from(port.port?).ok().filter(|&p| p != 0)
}

/// The routable endpoints of one slice, and what was dropped (reason, count).
pub fn slice_endpoints(
    slice: &EndpointSlice,
    port_name: Option<&str>,
) -> (Vec<Found>, Vec<(Dropped, u64)>) {
    let endpoints = slice.endpoints.as_deref().unwrap_or_default();
    if endpoints.is_empty() {
        return (Vec::new(), Vec::new());
    }
    let ip_slice = matches!(slice.address_type.as_deref(), Some("IPv4" | "IPv6"));
    let port = slice_port(slice.ports.as_deref().unwrap_or_default(), port_name);
    let Some(port) = port.filter(|_| ip_slice) else {
        return (Vec::new(), vec![(Dropped::UnusableSlice, 1)]);
    };
    let mut found = Vec::new();
    let mut bad = 0u64;
    for ep in endpoints {
        if !routable(ep.conditions.as_ref()) {
            continue;
        }
        let Some(ip) = ep
            .addresses
            .as_deref()
            .and_then(<[String]>::first)
            .and_then(|a| a.parse::<IpAddr>().ok())
        else {
            bad += 1;
            continue;
        };
        let addr = SocketAddr::new(ip, port);
        let pod = ep
            .target_ref
            .as_ref()
            .filter(|r| r.kind.as_deref().is_none_or(|k| k == "Pod"))
            .and_then(|r| r.name.as_deref())
            .filter(|n| !n.is_empty());
        if pod.is_some_and(|n| n.len() > MAX_NAME_BYTES) {
            bad += 1;
            continue;
        }
        let id = match pod {
            Some(name) => format!("{name}@{addr}"),
            None => addr.to_string(),
        };
        let zone = ep
            .zone
            .as_deref()
            .filter(|z| !z.is_empty() && z.len() <= MAX_NAME_BYTES)
            .map(str::to_owned);
        found.push(Found { id, addr, zone });
    }
    let dropped = if bad > 0 {
        vec![(Dropped::BadEndpoint, bad)]
    } else {
        Vec::new()
    };
    (found, dropped)
}

/// The slices a source was shown, by name, reduced to their routable endpoints: the state a
/// LIST replaces and watch events edit. At most `max_slices` slices.
#[derive(Debug, Default)]
pub struct SliceSet {
    slices: BTreeMap<String, Vec<Found>>,
}

impl SliceSet {
    /// Sets slice `name`'s endpoints; a new slice past `max_slices` is refused (false).
    pub fn upsert(&mut self, name: String, found: Vec<Found>, max_slices: usize) -> bool {
        if !self.slices.contains_key(&name) && self.slices.len() >= max_slices {
            return false;
        }
        self.slices.insert(name, found);
        true
    }

    /// Forgets slice `name`.
    pub fn remove(&mut self, name: &str) {
        self.slices.remove(name);
    }

    /// Forgets every slice (before a LIST's are applied).
    pub fn clear(&mut self) {
        self.slices.clear();
    }

    /// How many slices it holds.
    pub fn len(&self) -> usize {
        self.slices.len()
    }

    /// Whether it holds no slice.
    pub fn is_empty(&self) -> bool {
        self.slices.is_empty()
    }

    /// The replicas wanted now, by id — one per id (an endpoint in two slices, as during a
    /// controller's rebalancing, counts once), at most `max` in slice-name order — and how many
    /// more there were.
    pub fn desired(&self, max: usize) -> (BTreeMap<String, Found>, usize) {
        let mut out = BTreeMap::new();
        let mut over = 0;
        for f in self.slices.values().flatten() {
            if out.contains_key(&f.id) {
                continue;
            }
            if out.len() >= max {
                over += 1;
                continue;
            }
            out.insert(f.id.clone(), f.clone());
        }
        (out, over)
    }
}

/// One watch event, decoded.
#[derive(Debug)]
pub enum WatchEvent {
    /// `ADDED` or `MODIFIED`: the slice as it is now.
    Applied(EndpointSlice),
    /// `DELETED`: the slice as it was (or it stopped matching the selector).
    Deleted(EndpointSlice),
    /// `BOOKMARK`: nothing changed up to this resourceVersion.
    Bookmark(Option<String>),
    /// `ERROR` with code 410 (`Expired`/`Gone`): the resourceVersion is too old; re-list.
    Expired,
    /// Any other `ERROR`: the message (the watch is reopened).
    Error(String),
}

/// What a malformed watch line was.
#[derive(Debug, thiserror::Error)]
#[error("malformed watch event: {0}")]
pub struct MalformedEvent(String);

/// A `Status` object, as an `ERROR` event carries it.
#[derive(Debug, Default, Deserialize)]
struct Status {
    #[serde(default)]
    code: Option<i64>,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    message: Option<String>,
}

/// Decodes one watch line (`{"type": ..., "object": {...}}`).
pub fn parse_event(line: &[u8]) -> Result<WatchEvent, MalformedEvent> {
    #[derive(Deserialize)]
    struct Raw<'a> {
        #[serde(rename = "type")]
        kind: String,
        #[serde(borrow)]
        object: &'a RawValue,
    }
    let raw: Raw<'_> = serde_json::from_slice(line).map_err(|e| MalformedEvent(e.to_string()))?;
    // Serde would read a struct from an array too; the API only ever sends objects.
    if !raw.object.get().starts_with('{') {
        return Err(MalformedEvent("object is not a JSON object".into()));
    }
    let slice = || -> Result<EndpointSlice, MalformedEvent> {
        serde_json::from_str(raw.object.get()).map_err(|e| MalformedEvent(e.to_string()))
    };
    Ok(match raw.kind.as_str() {
        "ADDED" | "MODIFIED" => WatchEvent::Applied(slice()?),
        "DELETED" => WatchEvent::Deleted(slice()?),
        "BOOKMARK" => WatchEvent::Bookmark(slice()?.metadata.resource_version),
        "ERROR" => {
            let status: Status = serde_json::from_str(raw.object.get())
                .map_err(|e| MalformedEvent(e.to_string()))?;
            if status.code == Some(410)
                || matches!(status.reason.as_deref(), Some("Expired" | "Gone"))
            {
                WatchEvent::Expired
            } else {
                let mut msg = status.message.unwrap_or_default();
                msg.truncate(MAX_NAME_BYTES);
                WatchEvent::Error(format!("code {:?}: {msg}", status.code))
            }
        }
        other => {
            let mut t = other.to_owned();
            t.truncate(32);
            return Err(MalformedEvent(format!("unknown event type {t:?}")));
        }
    })
}

/// A piece of a watch stream: a complete line, or a line that was too long (skipped).
#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    /// One event line, without its newline.
    Complete(Vec<u8>),
    /// A line over the limit, skipped up to its newline (reported once).
    Overlong,
}

/// Splits a byte stream into newline-delimited lines of at most `max` bytes, holding at most
/// `max` bytes between chunks: a longer line is reported once and skipped to its newline.
#[derive(Debug)]
pub struct LineSplitter {
    buf: Vec<u8>,
    max: usize,
    skipping: bool,
}

impl LineSplitter {
    /// A splitter for lines of at most `max` bytes.
    pub fn new(max: usize) -> Self {
        LineSplitter {
            buf: Vec::new(),
            max,
            skipping: false,
        }
    }

    /// Feeds a chunk; complete (non-blank) lines and over-long ones go to `out`.
    pub fn push(&mut self, mut chunk: &[u8], out: &mut Vec<Line>) {
        while !chunk.is_empty() {
            let nl = chunk.iter().position(|&b| b == b'\n');
            let (part, rest) = match nl {
                Some(i) => (&chunk[..i], Some(&chunk[i + 1..])),
                None => (chunk, None),
            };
            if !self.skipping {
                if self.buf.len() + part.len() > self.max {
                    self.buf = Vec::new();
                    self.skipping = true;
                    out.push(Line::Overlong);
                } else {
                    self.buf.extend_from_slice(part);
                }
            }
            match rest {
                Some(r) => {
                    let line = std::mem::take(&mut self.buf);
                    if !self.skipping && !line.iter().all(u8::is_ascii_whitespace) {
                        out.push(Line::Complete(line));
                    }
                    self.skipping = false;
                    chunk = r;
                }
                None => chunk = &[],
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Metrics and errors.

/// The metrics of every Kubernetes source of a node (label `source` = `<namespace>/<service>`).
#[derive(Clone)]
pub struct K8sMetrics {
    /// `kvmesh_k8s_dropped_total{source,reason}`: input from the API server dropped.
    pub dropped: IntCounterVec,
    /// `kvmesh_k8s_lists_total{source,result}`: LISTs (`ok`, `error`).
    pub lists: IntCounterVec,
    /// `kvmesh_k8s_watch_errors_total{source}`: watches that failed or broke (reconnected).
    pub watch_errors: IntCounterVec,
    /// `kvmesh_k8s_endpoints{source}`: routable endpoints the source registers now.
    pub endpoints: IntGaugeVec,
}

impl K8sMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels)?;
            registry.register(Box::new(c.clone()))?;
            Ok::<_, prometheus::Error>(c)
        };
        let endpoints = IntGaugeVec::new(
            Opts::new(
                "kvmesh_k8s_endpoints",
                "Routable endpoints a Kubernetes source registers",
            ),
            &["source"],
        )?;
        registry.register(Box::new(endpoints.clone()))?;
        Ok(K8sMetrics {
            dropped: counter(
                "kvmesh_k8s_dropped_total",
                "Input from the Kubernetes API dropped, by reason",
                &["source", "reason"],
            )?,
            lists: counter(
                "kvmesh_k8s_lists_total",
                "EndpointSlice LISTs, by result",
                &["source", "result"],
            )?,
            watch_errors: counter(
                "kvmesh_k8s_watch_errors_total",
                "EndpointSlice watches that failed or broke",
                &["source"],
            )?,
            endpoints,
        })
    }
}

/// Why a Kubernetes source could not start, or a request failed.
#[derive(Debug, thiserror::Error)]
pub enum K8sError {
    /// No `api_server`, and not in a cluster.
    #[error("no api_server configured and KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are not set (not in a cluster?)")]
    NoApiServer,
    /// The CA bundle could not be read or holds no usable certificate.
    #[error("ca_file {path}: {message}")]
    Ca {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The HTTP client could not be built.
    #[error("cannot build the API client: {0}")]
    Client(String),
    /// A request failed (connect, timeout, read).
    #[error("{op} {url}: {message}")]
    Request {
        /// `list` or `watch`.
        op: &'static str,
        /// The URL.
        url: String,
        /// What went wrong.
        message: String,
    },
    /// The API server answered with an error status.
    #[error("{op} {url}: HTTP {status}{hint}")]
    Status {
        /// `list` or `watch`.
        op: &'static str,
        /// The URL.
        url: String,
        /// The status code.
        status: u16,
        /// A hint for 401/403.
        hint: &'static str,
    },
    /// The resourceVersion expired (410): re-list.
    #[error("resourceVersion expired (410 Gone)")]
    Gone,
    /// The LIST body was over [`MAX_LIST_BYTES`] or not an EndpointSliceList.
    #[error("list {url}: {message}")]
    BadList {
        /// The URL.
        url: String,
        /// What was wrong.
        message: String,
    },
}

/// The API server of `cfg`: configured, or the in-cluster one from the environment.
pub fn api_server_url(cfg: &KubernetesConfig) -> Result<String, K8sError> {
    if let Some(api) = &cfg.api_server {
        return Ok(api.trim_end_matches('/').to_owned());
    }
    let host = std::env::var("KUBERNETES_SERVICE_HOST").map_err(|_| K8sError::NoApiServer)?;
    let port = std::env::var("KUBERNETES_SERVICE_PORT").map_err(|_| K8sError::NoApiServer)?;
    let port: u16 = port.trim().parse().map_err(|_| K8sError::NoApiServer)?;
    let host = host.trim();
    Ok(match host.parse::<IpAddr>() {
        Ok(IpAddr::V6(v6)) => format!("https://[{v6}]:{port}"),
        _ => format!("https://{host}:{port}"),
    })
}

/// Reads at most `max` bytes of `path`.
fn read_bounded(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut out = Vec::new();
    std::fs::File::open(path)?
        .take(max + 1)
        .read_to_end(&mut out)?;
    if out.len() as u64 > max {
        return Err(std::io::Error::other(format!("larger than {max} bytes")));
    }
    Ok(out)
}

/// An HTTP client for `api` that trusts only `ca_file` for https (no roots at all for an
/// `http://` API server). The TLS setup names its crypto provider, so no process-wide default
/// is needed.
fn api_client(api: &str, cfg: &KubernetesConfig) -> Result<reqwest::Client, K8sError> {
    let mut roots = rustls::RootCertStore::empty();
    if api.starts_with("https://") {
        use rustls::pki_types::{pem::PemObject, CertificateDer};
        let ca_err = |message: String| K8sError::Ca {
            path: cfg.ca_file.clone(),
            message,
        };
        let pem = read_bounded(&cfg.ca_file, MAX_CA_BYTES).map_err(|e| ca_err(e.to_string()))?;
        for cert in CertificateDer::pem_slice_iter(&pem) {
            let cert = cert.map_err(|e| ca_err(e.to_string()))?;
            roots.add(cert).map_err(|e| ca_err(e.to_string()))?;
        }
        if roots.is_empty() {
            return Err(ca_err("no certificate in it".into()));
        }
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| K8sError::Client(e.to_string()))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    reqwest::Client::builder()
        .connect_timeout(Duration::from_millis(cfg.request_timeout_ms))
        .tcp_nodelay(true)
        .use_preconfigured_tls(tls)
        .build()
        .map_err(|e| K8sError::Client(e.to_string()))
}

// ---------------------------------------------------------------------------------------------
// The source.

/// An open watch: its response, the split of its body into lines, and when to give up on it.
struct OpenWatch {
    response: reqwest::Response,
    lines: LineSplitter,
    deadline: tokio::time::Instant,
}

/// One configured Kubernetes source: its client, the slices it was shown, and the replicas it
/// registered.
pub struct K8sSource {
    cfg: KubernetesConfig,
    name: String,
    /// `<api>/apis/discovery.k8s.io/v1/namespaces/<ns>/endpointslices`.
    collection: String,
    client: reqwest::Client,
    /// Whether the bearer token may be sent (https only: never in clear text).
    send_token: bool,
    metrics: K8sMetrics,
    slices: SliceSet,
    /// Where to watch from; `None` means a LIST is due.
    resource_version: Option<String>,
    watch: Option<OpenWatch>,
    /// Registered replicas this source lists now: id → (index, address).
    members: HashMap<String, (usize, SocketAddr)>,
    backoff: Duration,
    last_warn: Option<Instant>,
    /// Drops since the last warning.
    unwarned: u64,
}

impl K8sSource {
    /// A source for `cfg`: resolves the API server, reads the CA bundle for https.
    pub fn new(cfg: KubernetesConfig, metrics: K8sMetrics) -> Result<Self, K8sError> {
        let api = api_server_url(&cfg)?;
        let client = api_client(&api, &cfg)?;
        let send_token = api.starts_with("https://");
        if !send_token && cfg.token_file.exists() {
            tracing::warn!(api = %api, "Kubernetes api_server is plain http: the service-account token is not sent");
        }
        let collection = format!(
            "{api}/apis/discovery.k8s.io/v1/namespaces/{}/endpointslices",
            cfg.namespace
        );
        Ok(K8sSource {
            name: cfg.source_name(),
            backoff: Duration::from_millis(cfg.min_backoff_ms),
            cfg,
            collection,
            client,
            send_token,
            metrics,
            slices: SliceSet::default(),
            resource_version: None,
            watch: None,
            members: HashMap::new(),
            last_warn: None,
            unwarned: 0,
        })
    }

    /// The source's name (`<namespace>/<service>`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The replicas this source lists now that have `kv_events`, with their event sources.
    pub fn kv_events_members(&self) -> Vec<(usize, KvEventsSource)> {
        let Some(kv) = &self.cfg.kv_events else {
            return Vec::new();
        };
        let mut out: Vec<(usize, KvEventsSource)> = self
            .members
            .values()
            .map(|(i, addr)| (*i, kv.at(addr.ip())))
            .collect();
        out.sort_by_key(|(i, _)| *i);
        out
    }

    /// The collection's URL with `params` (and the label selector) in its query.
    fn url_with(&self, params: &[(&str, &str)]) -> String {
        match reqwest::Url::parse(&self.collection) {
            Ok(mut url) => {
                {
                    let mut q = url.query_pairs_mut();
                    q.append_pair("labelSelector", &self.cfg.selector());
                    for (k, v) in params {
                        q.append_pair(k, v);
                    }
                }
                url.into()
            }
            // Validated at start; a URL that does not parse fails at send with its own error.
            Err(_) => self.collection.clone(),
        }
    }

    fn request(&self, url: &str) -> reqwest::RequestBuilder {
        let mut req = self.client.get(url).header("accept", "application/json");
        if self.send_token {
            match read_bounded(&self.cfg.token_file, MAX_TOKEN_BYTES) {
                Ok(token) => {
                    let token = String::from_utf8_lossy(&token).trim().to_owned();
                    if !token.is_empty() {
                        req = req.bearer_auth(token);
                    }
                }
                Err(e) => {
                    tracing::debug!(file = %self.cfg.token_file.display(), error = %e, "no service-account token")
                }
            }
        }
        req
    }

    fn count_dropped(&mut self, reason: Dropped, n: u64) {
        if n == 0 {
            return;
        }
        self.metrics
            .dropped
            .with_label_values(&[&self.name, reason.as_str()])
            .inc_by(n);
        self.unwarned += n;
        if self.last_warn.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
            tracing::warn!(source = %self.name, reason = reason.as_str(), dropped = self.unwarned, "Kubernetes input dropped (further drops counted in kvmesh_k8s_dropped_total, warned at most every 10 s)");
            self.last_warn = Some(Instant::now());
            self.unwarned = 0;
        }
    }

    /// Applies one slice as it is now; false if it was refused (over the cap, or nameless).
    fn apply_slice(&mut self, slice: &EndpointSlice) -> bool {
        let Some(name) = slice.metadata.name.clone().filter(|n| !n.is_empty()) else {
            self.count_dropped(Dropped::BadSlice, 1);
            return false;
        };
        let (found, dropped) = slice_endpoints(slice, self.cfg.port_name.as_deref());
        for (reason, n) in dropped {
            self.count_dropped(reason, n);
        }
        if !self.slices.upsert(name, found, self.cfg.max_endpoints) {
            self.count_dropped(Dropped::OverCap, 1);
            return false;
        }
        true
    }

    fn set_resource_version(&mut self, rv: Option<String>) {
        if let Some(rv) = rv.filter(|v| !v.is_empty() && v.len() <= MAX_RESOURCE_VERSION_BYTES) {
            self.resource_version = Some(rv);
        }
    }

    /// LISTs the slices and replaces the set with them; on error the set is kept.
    pub async fn list(&mut self) -> Result<(), K8sError> {
        let result = self.list_inner().await;
        let label = if result.is_ok() { "ok" } else { "error" };
        self.metrics
            .lists
            .with_label_values(&[&self.name, label])
            .inc();
        result
    }

    async fn list_inner(&mut self) -> Result<(), K8sError> {
        let url = &self.url_with(&[]);
        let err = |message: String| K8sError::Request {
            op: "list",
            url: url.clone(),
            message,
        };
        let timeout = Duration::from_millis(self.cfg.request_timeout_ms);
        let deadline = tokio::time::Instant::now() + timeout;
        let req = self.request(url).timeout(timeout);
        let mut resp = req.send().await.map_err(|e| err(e.to_string()))?;
        check_status("list", url, resp.status())?;
        if resp
            .content_length()
            .is_some_and(|n| n > MAX_LIST_BYTES as u64)
        {
            return Err(K8sError::BadList {
                url: url.clone(),
                message: format!("body over {MAX_LIST_BYTES} bytes"),
            });
        }
        let mut body = Vec::new();
        loop {
            let chunk = tokio::time::timeout_at(deadline, resp.chunk())
                .await
                .map_err(|_| err("timed out reading the body".into()))?
                .map_err(|e| err(e.to_string()))?;
            let Some(chunk) = chunk else { break };
            if body.len() + chunk.len() > MAX_LIST_BYTES {
                return Err(K8sError::BadList {
                    url: url.clone(),
                    message: format!("body over {MAX_LIST_BYTES} bytes"),
                });
            }
            body.extend_from_slice(&chunk);
        }
        #[derive(Deserialize)]
        struct List<'a> {
            #[serde(default)]
            metadata: ObjectMeta,
            #[serde(default, borrow)]
            items: Option<Vec<&'a RawValue>>,
        }
        let list: List<'_> = serde_json::from_slice(&body).map_err(|e| K8sError::BadList {
            url: url.clone(),
            message: e.to_string(),
        })?;
        let Some(rv) = list
            .metadata
            .resource_version
            .filter(|v| !v.is_empty() && v.len() <= MAX_RESOURCE_VERSION_BYTES)
        else {
            return Err(K8sError::BadList {
                url: url.clone(),
                message: "no usable metadata.resourceVersion".into(),
            });
        };
        // The list is whole: only now is the old set replaced.
        self.slices.clear();
        for raw in list.items.unwrap_or_default() {
            match serde_json::from_str::<EndpointSlice>(raw.get()) {
                Ok(slice) => {
                    self.apply_slice(&slice);
                }
                Err(_) => self.count_dropped(Dropped::BadSlice, 1),
            }
        }
        self.resource_version = Some(rv);
        Ok(())
    }

    /// Opens a WATCH from the current resourceVersion.
    async fn open_watch(&self, rv: &str) -> Result<OpenWatch, K8sError> {
        let url = &self.url_with(&[
            ("watch", "1"),
            ("resourceVersion", rv),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", &self.cfg.watch_timeout_s.to_string()),
        ]);
        let timeout = Duration::from_millis(self.cfg.request_timeout_ms);
        let req = self.request(url);
        let response = tokio::time::timeout(timeout, req.send())
            .await
            .map_err(|_| K8sError::Request {
                op: "watch",
                url: url.clone(),
                message: "no response headers in time".into(),
            })?
            .map_err(|e| K8sError::Request {
                op: "watch",
                url: url.clone(),
                message: e.to_string(),
            })?;
        check_status("watch", url, response.status())?;
        Ok(OpenWatch {
            response,
            lines: LineSplitter::new(MAX_EVENT_LINE_BYTES),
            deadline: tokio::time::Instant::now()
                + Duration::from_secs(self.cfg.watch_timeout_s)
                + timeout,
        })
    }

    /// Brings the registry in line with the slices: registers routable endpoints it does not
    /// list yet (or brings them back), removes (drains) the ones it listed that left. Returns
    /// the replicas new to the node and whether anything changed.
    pub fn reconcile(&mut self, registry: &dyn ReplicaRegistry) -> (Vec<usize>, bool) {
        let (desired, over) = self.slices.desired(self.cfg.max_endpoints);
        if over > 0 && self.last_warn.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
            tracing::warn!(source = %self.name, over, max_endpoints = self.cfg.max_endpoints, "more endpoints than max_endpoints: the rest are ignored");
            self.last_warn = Some(Instant::now());
        }
        let mut added = Vec::new();
        let mut changed = false;
        for (id, found) in &desired {
            if self.members.contains_key(id) {
                continue;
            }
            match registry.add_replica(&self.cfg.replica(found)) {
                Ok((i, new)) => {
                    tracing::info!(replica = %id, source = %self.name, "endpoint routable");
                    if new {
                        added.push(i);
                    }
                    self.members.insert(id.clone(), (i, found.addr));
                    changed = true;
                }
                Err(e) => tracing::warn!(replica = %id, error = %e, "cannot register replica"),
            }
        }
        let gone: Vec<String> = self
            .members
            .keys()
            .filter(|id| !desired.contains_key(*id))
            .cloned()
            .collect();
        for id in gone {
            if let Some((i, _)) = self.members.remove(&id) {
                tracing::info!(replica = %id, source = %self.name, "endpoint gone, not ready or terminating: draining");
                registry.remove_replica(i);
                changed = true;
            }
        }
        self.metrics
            .endpoints
            .with_label_values(&[&self.name])
            .set(self.members.len() as i64);
        (added, changed)
    }

    /// Waits the current backoff (jittered to 50-100 %), then doubles it up to the maximum.
    async fn back_off(&mut self) {
        let jitter = rand::rng().random_range(0.5..=1.0);
        tokio::time::sleep(self.backoff.mul_f64(jitter)).await;
        self.backoff = (self.backoff * 2).min(Duration::from_millis(self.cfg.max_backoff_ms));
    }

    fn reset_backoff(&mut self) {
        self.backoff = Duration::from_millis(self.cfg.min_backoff_ms);
    }

    /// Lists once and brings the registry in line (the node does this before serving). Returns
    /// the replicas new to the node; on error the set is kept and the error logged.
    pub async fn initial_sync(&mut self, registry: &dyn ReplicaRegistry) -> Vec<usize> {
        match self.list().await {
            Ok(()) => self.reconcile(registry).0,
            Err(e) => {
                tracing::warn!(source = %self.name, error = %e, "Kubernetes LIST failed; retrying in the background");
                Vec::new()
            }
        }
    }

    /// Lists, watches and reconnects until the registry changed; returns the replicas new to
    /// the node (possibly none: some drained). Never returns on API errors — it backs off and
    /// retries, keeping the set — so the caller races it against its stop signal. The open watch
    /// stays in the source between calls: no event is lost while the caller works.
    pub async fn next_change(&mut self, registry: &dyn ReplicaRegistry) -> Vec<usize> {
        loop {
            let Some(watch) = self.watch.as_mut() else {
                let Some(rv) = self.resource_version.clone() else {
                    match self.list().await {
                        Ok(()) => {
                            self.reset_backoff();
                            let (added, changed) = self.reconcile(registry);
                            if changed {
                                return added;
                            }
                        }
                        Err(e) => {
                            tracing::warn!(source = %self.name, error = %e, "Kubernetes LIST failed; keeping the previous replicas");
                            self.back_off().await;
                        }
                    }
                    continue;
                };
                match self.open_watch(&rv).await {
                    Ok(w) => self.watch = Some(w),
                    Err(K8sError::Gone) => {
                        tracing::info!(source = %self.name, "watch resourceVersion expired: re-listing");
                        self.resource_version = None;
                    }
                    Err(e) => {
                        self.metrics
                            .watch_errors
                            .with_label_values(&[&self.name])
                            .inc();
                        tracing::warn!(source = %self.name, error = %e, "Kubernetes WATCH failed; keeping the previous replicas");
                        self.back_off().await;
                    }
                }
                continue;
            };
            let deadline = watch.deadline;
            let chunk = match tokio::time::timeout_at(deadline, watch.response.chunk()).await {
                Ok(Ok(Some(chunk))) => chunk,
                Ok(Ok(None)) | Err(_) => {
                    // The API server ended the watch (timeoutSeconds), or it outlived its
                    // deadline: reopen from the last resourceVersion.
                    self.watch = None;
                    continue;
                }
                Ok(Err(e)) => {
                    self.watch = None;
                    self.metrics
                        .watch_errors
                        .with_label_values(&[&self.name])
                        .inc();
                    tracing::warn!(source = %self.name, error = %e, "Kubernetes watch broke; reconnecting");
                    self.back_off().await;
                    continue;
                }
            };
            let mut lines = Vec::new();
            watch.lines.push(&chunk, &mut lines);
            let mut touched = false;
            for line in lines {
                let line = match line {
                    Line::Complete(l) => l,
                    Line::Overlong => {
                        self.count_dropped(Dropped::OverlongLine, 1);
                        continue;
                    }
                };
                match parse_event(&line) {
                    Ok(WatchEvent::Applied(slice)) => {
                        self.apply_slice(&slice);
                        self.set_resource_version(slice.metadata.resource_version);
                        touched = true;
                    }
                    Ok(WatchEvent::Deleted(slice)) => {
                        match slice.metadata.name.as_deref() {
                            Some(name) => self.slices.remove(name),
                            None => self.count_dropped(Dropped::BadSlice, 1),
                        }
                        self.set_resource_version(slice.metadata.resource_version);
                        touched = true;
                    }
                    Ok(WatchEvent::Bookmark(rv)) => self.set_resource_version(rv),
                    Ok(WatchEvent::Expired) => {
                        tracing::info!(source = %self.name, "watch resourceVersion expired: re-listing");
                        self.watch = None;
                        self.resource_version = None;
                        break;
                    }
                    Ok(WatchEvent::Error(msg)) => {
                        tracing::warn!(source = %self.name, error = %msg, "Kubernetes watch error event; reopening");
                        self.metrics
                            .watch_errors
                            .with_label_values(&[&self.name])
                            .inc();
                        self.watch = None;
                        break;
                    }
                    Err(e) => {
                        tracing::debug!(source = %self.name, error = %e, "watch event dropped");
                        self.count_dropped(Dropped::MalformedEvent, 1);
                    }
                }
            }
            if touched {
                // A watch that delivers is healthy: the next failure starts from the minimum.
                self.reset_backoff();
                let (added, changed) = self.reconcile(registry);
                if changed {
                    return added;
                }
            }
        }
    }
}

/// Maps a non-success status to an error: 410 to [`K8sError::Gone`], 401/403 with an RBAC hint.
fn check_status(op: &'static str, url: &str, status: reqwest::StatusCode) -> Result<(), K8sError> {
    if status.is_success() {
        return Ok(());
    }
    if status == reqwest::StatusCode::GONE {
        return Err(K8sError::Gone);
    }
    let hint = match status.as_u16() {
        401 => " (token missing or invalid: check token_file)",
        403 => " (the service account needs get/list/watch on endpointslices.discovery.k8s.io in this namespace)",
        _ => "",
    };
    Err(K8sError::Status {
        op,
        url: url.to_owned(),
        status: status.as_u16(),
        hint,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIST: &str = include_str!("../../tests/data/k8s-endpointslice-list.json");
    const WATCH: &str = include_str!("../../tests/data/k8s-endpointslice-watch.jsonl");

    fn cfg(toml_text: &str) -> KubernetesConfig {
        toml::from_str(toml_text).unwrap()
    }

    fn list_slices() -> Vec<EndpointSlice> {
        let v: serde_json::Value = serde_json::from_str(LIST).unwrap();
        v["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| serde_json::from_value(i.clone()).unwrap())
            .collect()
    }

    /// The captured list: ready endpoints count, a not-ready and a terminating (still serving)
    /// one do not, a missing `ready` reads as ready, the named port is taken.
    #[test]
    fn a_real_list_gives_ready_non_terminating_endpoints_at_the_named_port() {
        let slices = list_slices();
        let (found, dropped) = slice_endpoints(&slices[0], Some("http"));
        assert!(dropped.is_empty(), "{dropped:?}");
        let ids: Vec<&str> = found.iter().map(|f| f.id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "vllm-7c9d8f6b5-abcde@10.244.1.17:8000",
                "vllm-7c9d8f6b5-hjklm@10.244.3.4:8000"
            ]
        );
        assert_eq!(found[0].zone.as_deref(), Some("us-east-1a"));
        // The only port, without a name asked for; an unnamed one asked for by name is not.
        let (found, _) = slice_endpoints(&slices[1], None);
        assert_eq!(found.len(), 1);
        assert_eq!(
            found[0].id, "[fd00:10:244::5]:8000",
            "no targetRef: the address"
        );
        let (none, dropped) = slice_endpoints(&slices[1], Some("http"));
        assert!(none.is_empty());
        assert_eq!(dropped, vec![(Dropped::UnusableSlice, 1)]);
        // Several ports and none named: ambiguous, skipped.
        let (none, dropped) = slice_endpoints(&slices[0], None);
        assert!(none.is_empty());
        assert_eq!(dropped, vec![(Dropped::UnusableSlice, 1)]);
    }

    #[test]
    fn conditions_read_as_the_api_reference_says() {
        let c = |ready, serving, terminating| EndpointConditions {
            ready,
            serving,
            terminating,
        };
        assert!(routable(None), "no conditions: unknown, ready");
        assert!(routable(Some(&c(None, None, None))));
        assert!(routable(Some(&c(Some(true), Some(true), Some(false)))));
        assert!(!routable(Some(&c(Some(false), Some(false), None))));
        // Terminating but serving (publishNotReadyAddresses may even keep ready true): drains.
        assert!(!routable(Some(&c(Some(false), Some(true), Some(true)))));
        assert!(!routable(Some(&c(Some(true), Some(true), Some(true)))));
    }

    #[test]
    fn bad_endpoints_and_fqdn_slices_are_dropped_and_counted() {
        let slice: EndpointSlice = serde_json::from_str(
            r#"{"metadata":{"name":"s"},"addressType":"IPv4","ports":[{"name":"http","port":8000}],
               "endpoints":[{"addresses":["not-an-ip"]},{"addresses":[]},{},
                            {"addresses":["10.0.0.9"],"targetRef":{"kind":"Pod","name":"p"}}]}"#,
        )
        .unwrap();
        let (found, dropped) = slice_endpoints(&slice, Some("http"));
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].id, "p@10.0.0.9:8000");
        assert_eq!(dropped, vec![(Dropped::BadEndpoint, 3)]);
        let fqdn: EndpointSlice = serde_json::from_str(
            r#"{"metadata":{"name":"f"},"addressType":"FQDN","ports":[{"port":80}],"endpoints":[{"addresses":["a.example"]}]}"#,
        )
        .unwrap();
        assert_eq!(
            slice_endpoints(&fqdn, None),
            (Vec::new(), vec![(Dropped::UnusableSlice, 1)])
        );
        // Port out of range, or "all ports" (unset): unusable.
        for ports in [
            r#"[{"port":70000}]"#,
            r#"[{"name":"http"}]"#,
            r#"[{"port":0}]"#,
        ] {
            let s: EndpointSlice = serde_json::from_str(&format!(
                r#"{{"addressType":"IPv4","ports":{ports},"endpoints":[{{"addresses":["10.0.0.1"]}}]}}"#
            ))
            .unwrap();
            assert!(slice_endpoints(&s, None).0.is_empty(), "{ports}");
        }
        // An empty slice (`endpoints: null`) is fine and drops nothing.
        let empty: EndpointSlice =
            serde_json::from_str(r#"{"addressType":"IPv4","endpoints":null,"ports":null}"#)
                .unwrap();
        assert_eq!(slice_endpoints(&empty, None), (Vec::new(), Vec::new()));
    }

    #[test]
    fn the_desired_set_dedups_across_slices_and_is_capped() {
        let f = |id: &str, port: u16| Found {
            id: id.into(),
            addr: SocketAddr::from(([10, 0, 0, 1], port)),
            zone: None,
        };
        let mut set = SliceSet::default();
        assert!(set.upsert("a".into(), vec![f("x", 1), f("y", 2)], 2));
        assert!(set.upsert("b".into(), vec![f("y", 2), f("z", 3)], 2));
        assert!(!set.upsert("c".into(), vec![f("w", 4)], 2), "slice cap");
        assert!(
            set.upsert("b".into(), vec![f("y", 2), f("z", 3)], 2),
            "update at the cap"
        );
        let (want, over) = set.desired(10);
        assert_eq!(want.keys().collect::<Vec<_>>(), ["x", "y", "z"]);
        assert_eq!(over, 0);
        let (want, over) = set.desired(2);
        assert_eq!(want.len(), 2);
        assert_eq!(over, 1);
        set.remove("a");
        assert_eq!(set.desired(10).0.keys().collect::<Vec<_>>(), ["y", "z"]);
        set.clear();
        assert!(set.is_empty());
    }

    /// The captured watch stream: every line decodes to its event, the 410 to `Expired`.
    #[test]
    fn real_watch_events_decode() {
        let events: Vec<WatchEvent> = WATCH
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with("//"))
            .map(|l| parse_event(l.as_bytes()).unwrap())
            .collect();
        assert!(
            matches!(&events[0], WatchEvent::Applied(s) if s.metadata.name.as_deref() == Some("vllm-w8n2c")),
            "{events:?}"
        );
        let WatchEvent::Applied(modified) = &events[1] else {
            panic!("{:?}", events[1])
        };
        let (found, _) = slice_endpoints(modified, Some("http"));
        assert_eq!(found.len(), 1, "the terminating endpoint drains");
        assert!(matches!(&events[2], WatchEvent::Bookmark(Some(rv)) if rv == "1300"));
        assert!(
            matches!(&events[3], WatchEvent::Deleted(s) if s.metadata.name.as_deref() == Some("vllm-w8n2c"))
        );
        assert!(matches!(&events[4], WatchEvent::Expired));
        assert!(matches!(&events[5], WatchEvent::Error(_)));
    }

    #[test]
    fn malformed_events_are_errors_not_panics() {
        for line in [
            &b"not json"[..],
            b"{}",
            b"{\"type\":\"ADDED\"}",
            b"{\"type\":\"SURPRISE\",\"object\":{}}",
            b"{\"type\":\"ADDED\",\"object\":{\"endpoints\":\"many\"}}",
            b"{\"type\":\"ERROR\",\"object\":[1]}",
            b"\xff\xfe",
        ] {
            assert!(
                parse_event(line).is_err(),
                "{:?}",
                String::from_utf8_lossy(line)
            );
        }
    }

    #[test]
    fn lines_split_across_chunks_and_overlong_ones_are_skipped() {
        let mut s = LineSplitter::new(8);
        let mut out = Vec::new();
        s.push(b"abc", &mut out);
        assert!(out.is_empty());
        s.push(b"de\n\nfg", &mut out);
        assert_eq!(out, vec![Line::Complete(b"abcde".to_vec())]);
        out.clear();
        // "fg" + 9 more bytes: over 8, reported once, skipped to its newline.
        s.push(b"123456789", &mut out);
        s.push(b"more\nok\n", &mut out);
        assert_eq!(out, vec![Line::Overlong, Line::Complete(b"ok".to_vec())]);
        out.clear();
        s.push(b"12345678\n", &mut out);
        assert_eq!(
            out,
            vec![Line::Complete(b"12345678".to_vec())],
            "exactly max fits"
        );
    }

    #[test]
    fn config_defaults_and_errors_name_the_field() {
        let c = cfg("namespace = \"serving\"\nservice = \"vllm\"\n");
        c.validate().unwrap();
        assert_eq!(c.selector(), "kubernetes.io/service-name=vllm");
        assert_eq!(c.source_name(), "serving/vllm");
        assert_eq!(c.token_file, Path::new(DEFAULT_TOKEN_FILE));
        assert_eq!(c.ca_file, Path::new(DEFAULT_CA_FILE));
        assert_eq!(
            (
                c.request_timeout_ms,
                c.watch_timeout_s,
                c.min_backoff_ms,
                c.max_backoff_ms
            ),
            (10_000, 300, 500, 30_000)
        );
        assert_eq!((c.max_endpoints, c.scheme.as_str()), (4_096, "http"));
        for (text, field) in [
            ("namespace = \"Bad_NS\"\nservice = \"v\"", "namespace"),
            ("namespace = \"n\"", "service"),
            (
                "namespace = \"n\"\nservice = \"v\"\nlabel_selector = \"a=b\"",
                "label_selector",
            ),
            (
                "namespace = \"n\"\nservice = \"v\"\nport_name = \"\"",
                "port_name",
            ),
            (
                "namespace = \"n\"\nservice = \"v\"\napi_server = \"ftp://x\"",
                "api_server",
            ),
            (
                "namespace = \"n\"\nservice = \"v\"\nwatch_timeout_s = 0",
                "watch_timeout_s",
            ),
            (
                "namespace = \"n\"\nservice = \"v\"\nmin_backoff_ms = 10\nmax_backoff_ms = 5",
                "max_backoff_ms",
            ),
            (
                "namespace = \"n\"\nservice = \"v\"\nmax_endpoints = 100000",
                "max_endpoints",
            ),
        ] {
            assert_eq!(cfg(text).validate().unwrap_err().0, field, "{text}");
        }
    }

    #[test]
    fn the_api_server_defaults_to_the_in_cluster_service() {
        let mut c = cfg("namespace = \"n\"\nservice = \"v\"\napi_server = \"http://127.0.0.1:9/\"");
        assert_eq!(api_server_url(&c).unwrap(), "http://127.0.0.1:9");
        c.api_server = None;
        // The environment is the process's: only assert the shape when it is set.
        match api_server_url(&c) {
            Ok(url) => assert!(url.starts_with("https://"), "{url}"),
            Err(e) => assert!(matches!(e, K8sError::NoApiServer)),
        }
    }

    /// An https API server needs a CA bundle with a certificate in it, read at start.
    #[test]
    fn an_https_api_server_trusts_the_ca_file_only_if_it_holds_a_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.crt");
        let cert =
            rcgen::generate_simple_self_signed(vec!["kubernetes.default.svc".into()]).unwrap();
        std::fs::write(&ca, cert.cert.pem()).unwrap();
        let mut c =
            cfg("namespace = \"n\"\nservice = \"v\"\napi_server = \"https://127.0.0.1:6443\"");
        c.ca_file = ca.clone();
        let metrics = K8sMetrics::new(&Registry::new()).unwrap();
        let src = K8sSource::new(c.clone(), metrics.clone()).unwrap();
        assert!(src.send_token, "the token goes over https only");
        std::fs::write(&ca, "not a certificate").unwrap();
        assert!(matches!(
            K8sSource::new(c.clone(), metrics.clone()),
            Err(K8sError::Ca { .. })
        ));
        c.ca_file = dir.path().join("missing.crt");
        assert!(matches!(
            K8sSource::new(c, metrics),
            Err(K8sError::Ca { .. })
        ));
    }

    /// A source's registry diff: new endpoints are added once, departed ones removed once.
    #[test]
    fn reconcile_adds_new_endpoints_and_drains_departed_ones() {
        use std::sync::Mutex;
        #[derive(Default)]
        struct Reg {
            ids: Mutex<Vec<String>>,
            removed: Mutex<Vec<usize>>,
        }
        impl ReplicaRegistry for Reg {
            fn add_replica(&self, spec: &ReplicaConfig) -> anyhow::Result<(usize, bool)> {
                let mut ids = self.ids.lock().unwrap();
                let id = spec.id.clone().unwrap();
                if let Some(i) = ids.iter().position(|x| *x == id) {
                    return Ok((i, false));
                }
                ids.push(id);
                Ok((ids.len() - 1, true))
            }
            fn remove_replica(&self, i: usize) {
                self.removed.lock().unwrap().push(i);
            }
        }
        let metrics = K8sMetrics::new(&Registry::new()).unwrap();
        let c = cfg("namespace = \"n\"\nservice = \"v\"\napi_server = \"http://127.0.0.1:9\"\nport_name = \"http\"\nzone = \"\"");
        let mut src = K8sSource::new(c, metrics).unwrap();
        let reg = Reg::default();
        for s in list_slices() {
            src.apply_slice(&s);
        }
        let (added, changed) = src.reconcile(&reg);
        assert_eq!((added.clone(), changed), (vec![0, 1], true));
        assert_eq!(src.reconcile(&reg), (Vec::new(), false), "idempotent");
        let spec = src
            .cfg
            .replica(&src.slices.desired(10).0["vllm-7c9d8f6b5-abcde@10.244.1.17:8000"]);
        assert_eq!(spec.url, "http://10.244.1.17:8000");
        assert_eq!(spec.zone, "us-east-1a", "the endpoint's zone");
        src.slices.remove("vllm-xk2p9");
        assert_eq!(src.reconcile(&reg), (Vec::new(), true));
        let mut removed = reg.removed.lock().unwrap().clone();
        removed.sort();
        assert_eq!(removed, [0, 1]);
    }
}
