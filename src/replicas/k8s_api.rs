//! The Kubernetes API client the replica sources share: LIST a collection, WATCH it from the
//! list's `resourceVersion`, re-list on `410 Gone`, back off on failure — every read bounded.
//!
//! Exists so that the EndpointSlice source (`k8s.rs`) and the InferencePool source
//! (`inference_pool.rs`, which follows a pool and its pods) read the API one way. A
//! [`ListWatch`] follows one collection (one resource in one namespace, under a label and/or
//! field selector) and hands its caller whole lists and batches of changes as typed objects;
//! the caller keeps the state. A failed LIST or WATCH returns nothing: the caller keeps what
//! it had, and the [`ListWatch`] retries with jittered, doubling backoff. [`Members`] brings
//! the node's registry in line with the set of endpoints a source wants.
//!
//! A small client over reqwest rather than the `kube` crate: a few resources, two verbs, and
//! every read under this project's bounds — a LIST body at most [`MAX_LIST_BYTES`], a watch
//! event line at most [`MAX_EVENT_LINE_BYTES`] (a longer one is skipped to the next newline),
//! every request under a deadline. Malformed events are dropped and counted in
//! `kvmesh_k8s_dropped_total{source,reason}`, with one warning per 10 s, never a panic.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};
use rand::Rng;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::dns::ReplicaRegistry;
use super::k8s_config::{
    Found, KubernetesConfig, MAX_CA_BYTES, MAX_EVENT_LINE_BYTES, MAX_LIST_BYTES, MAX_NAME_BYTES,
    MAX_RESOURCE_VERSION_BYTES, MAX_TOKEN_BYTES, WARN_EVERY,
};
use super::kv_events::KvEventsSource;

/// The part of `metadata` used here.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ObjectMeta {
    /// Object name (unique in the namespace).
    #[serde(default)]
    pub name: Option<String>,
    /// The object's (or list's) version, to watch from.
    #[serde(default, rename = "resourceVersion")]
    pub resource_version: Option<String>,
    /// Set once the object is being deleted (a terminating pod): it gets nothing new.
    #[serde(default, rename = "deletionTimestamp")]
    pub deletion_timestamp: Option<String>,
}

/// An API object a [`ListWatch`] can follow: it has `metadata`.
pub trait Object: DeserializeOwned {
    /// Its metadata.
    fn meta(&self) -> &ObjectMeta;
}

/// Why input from the API server was dropped (the `reason` label of
/// `kvmesh_k8s_dropped_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dropped {
    /// A watch event line that is not a JSON event of a known type.
    MalformedEvent,
    /// A watch event line over [`MAX_EVENT_LINE_BYTES`].
    OverlongLine,
    /// A slice (or pool, or pod) without a name, or with an object that is not one.
    BadSlice,
    /// A slice of address type FQDN (or unknown), or without the port asked for; a pool
    /// without a usable selector or target port.
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

/// One watch event, decoded.
#[derive(Debug)]
pub enum WatchEvent<T> {
    /// `ADDED` or `MODIFIED`: the object as it is now.
    Applied(T),
    /// `DELETED`: the object as it was (or it stopped matching the selector).
    Deleted(T),
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

/// `s` cut to at most `max` bytes, on a character boundary (outside text may be any UTF-8).
pub fn truncated(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// Decodes one watch line (`{"type": ..., "object": {...}}`) of a collection of `T`.
pub fn parse_event<T: Object>(line: &[u8]) -> Result<WatchEvent<T>, MalformedEvent> {
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
    let object = || -> Result<T, MalformedEvent> {
        serde_json::from_str(raw.object.get()).map_err(|e| MalformedEvent(e.to_string()))
    };
    Ok(match raw.kind.as_str() {
        "ADDED" | "MODIFIED" => WatchEvent::Applied(object()?),
        "DELETED" => WatchEvent::Deleted(object()?),
        "BOOKMARK" => WatchEvent::Bookmark(object()?.meta().resource_version.clone()),
        "ERROR" => {
            let status: Status = serde_json::from_str(raw.object.get())
                .map_err(|e| MalformedEvent(e.to_string()))?;
            if status.code == Some(410)
                || matches!(status.reason.as_deref(), Some("Expired" | "Gone"))
            {
                WatchEvent::Expired
            } else {
                let msg = truncated(&status.message.unwrap_or_default(), MAX_NAME_BYTES);
                WatchEvent::Error(format!("code {:?}: {msg}", status.code))
            }
        }
        other => {
            return Err(MalformedEvent(format!(
                "unknown event type {:?}",
                truncated(other, 32)
            )));
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
                "Kubernetes LISTs (EndpointSlices, InferencePools, pods), by result",
                &["source", "result"],
            )?,
            watch_errors: counter(
                "kvmesh_k8s_watch_errors_total",
                "Kubernetes watches that failed or broke",
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
        hint: String,
    },
    /// The resourceVersion expired (410): re-list.
    #[error("resourceVersion expired (410 Gone)")]
    Gone,
    /// The LIST body was over [`MAX_LIST_BYTES`] or not a list.
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

/// Maps a non-success status to an error: 410 to [`K8sError::Gone`], 401/403 with a hint (the
/// RBAC rule `resource` needs).
fn check_status(
    op: &'static str,
    url: &str,
    resource: &str,
    status: reqwest::StatusCode,
) -> Result<(), K8sError> {
    if status.is_success() {
        return Ok(());
    }
    if status == reqwest::StatusCode::GONE {
        return Err(K8sError::Gone);
    }
    let hint = match status.as_u16() {
        401 => " (token missing or invalid: check token_file)".to_owned(),
        403 => {
            format!(" (the service account needs get/list/watch on {resource} in this namespace)")
        }
        _ => String::new(),
    };
    Err(K8sError::Status {
        op,
        url: url.to_owned(),
        status: status.as_u16(),
        hint,
    })
}

// ---------------------------------------------------------------------------------------------
// The client and one followed collection.

/// The API server, the HTTP client that trusts its CA, and how to authenticate: built once per
/// source, shared by its collections.
#[derive(Clone)]
pub struct ApiClient {
    /// Base URL, without a trailing slash.
    pub base: String,
    client: reqwest::Client,
    /// Whether the bearer token may be sent (https only: never in clear text).
    pub send_token: bool,
    token_file: PathBuf,
}

impl ApiClient {
    /// A client for `cfg`'s API server: resolves it, reads the CA bundle for https.
    pub fn new(cfg: &KubernetesConfig) -> Result<Self, K8sError> {
        let base = api_server_url(cfg)?;
        let client = api_client(&base, cfg)?;
        let send_token = base.starts_with("https://");
        if !send_token && cfg.token_file.exists() {
            tracing::warn!(api = %base, "Kubernetes api_server is plain http: the service-account token is not sent");
        }
        Ok(ApiClient {
            base,
            client,
            send_token,
            token_file: cfg.token_file.clone(),
        })
    }

    /// A GET of `url` with the token (re-read each time: the kubelet rotates it).
    fn get(&self, url: &str) -> reqwest::RequestBuilder {
        let mut req = self.client.get(url).header("accept", "application/json");
        if self.send_token {
            match read_bounded(&self.token_file, MAX_TOKEN_BYTES) {
                Ok(token) => {
                    let token = String::from_utf8_lossy(&token).trim().to_owned();
                    if !token.is_empty() {
                        req = req.bearer_auth(token);
                    }
                }
                Err(e) => {
                    tracing::debug!(file = %self.token_file.display(), error = %e, "no service-account token")
                }
            }
        }
        req
    }
}

/// What a [`ListWatch`] learned: a whole list, or changes since the last call.
#[derive(Debug)]
pub enum Batch<T> {
    /// A LIST: the collection as it is now; replaces whatever the caller held.
    Listed(Vec<T>),
    /// Watch events, in order: the object as it is now, or as it was when deleted.
    Changes(Vec<WatchEvent<T>>),
}

/// Drops since the last warning, and when that was: one warning per [`WARN_EVERY`].
#[derive(Debug, Default)]
pub struct DropLog {
    last_warn: Option<Instant>,
    unwarned: u64,
}

impl DropLog {
    /// Whether a warning is due now (and if so, marks it given).
    pub fn warn_due(&mut self) -> bool {
        if self.last_warn.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
            self.last_warn = Some(Instant::now());
            return true;
        }
        false
    }

    /// Counts `n` drops of `reason` in `metrics` under `source`; warns at most every 10 s.
    pub fn count(&mut self, metrics: &K8sMetrics, source: &str, reason: Dropped, n: u64) {
        if n == 0 {
            return;
        }
        metrics
            .dropped
            .with_label_values(&[source, reason.as_str()])
            .inc_by(n);
        self.unwarned += n;
        if self.warn_due() {
            tracing::warn!(source = %source, reason = reason.as_str(), dropped = self.unwarned, "Kubernetes input dropped (further drops counted in kvmesh_k8s_dropped_total, warned at most every 10 s)");
            self.unwarned = 0;
        }
    }
}

/// An open watch: its response, the split of its body into lines, and when to give up on it.
struct OpenWatch {
    response: reqwest::Response,
    lines: LineSplitter,
    deadline: tokio::time::Instant,
    /// When it was opened: one that ends within a second of it is refused, not timed out.
    opened: tokio::time::Instant,
}

/// One collection followed: LIST, then WATCH from the list's resourceVersion, reopened when the
/// API server ends it, re-listed on 410, retried with backoff on failure.
pub struct ListWatch {
    api: ApiClient,
    /// The source's name (the `source` label of the metrics).
    name: String,
    /// The RBAC resource, for the 403 hint (`pods`, `endpointslices.discovery.k8s.io`, …).
    resource: &'static str,
    /// `<api>/<path to the namespaced collection>`.
    collection: String,
    /// Label selector (empty: none).
    label_selector: String,
    /// Field selector (empty: none).
    field_selector: String,
    request_timeout: Duration,
    watch_timeout_s: u64,
    min_backoff: Duration,
    max_backoff: Duration,
    metrics: K8sMetrics,
    /// Where to watch from; `None` means a LIST is due.
    resource_version: Option<String>,
    watch: Option<OpenWatch>,
    backoff: Duration,
    /// Dropped input, warned about at most every 10 s.
    pub drops: DropLog,
}

impl ListWatch {
    /// Follows `<api>/<path>` (e.g. `api/v1/namespaces/serving/pods`) under `cfg`'s timeouts.
    pub fn new(
        api: ApiClient,
        cfg: &KubernetesConfig,
        path: &str,
        resource: &'static str,
        metrics: K8sMetrics,
    ) -> Self {
        ListWatch {
            collection: format!("{}/{path}", api.base),
            api,
            name: cfg.source_name(),
            resource,
            label_selector: String::new(),
            field_selector: String::new(),
            request_timeout: cfg.request_timeout(),
            watch_timeout_s: cfg.watch_timeout_s,
            min_backoff: Duration::from_millis(cfg.min_backoff_ms),
            max_backoff: Duration::from_millis(cfg.max_backoff_ms),
            metrics,
            resource_version: None,
            watch: None,
            backoff: Duration::from_millis(cfg.min_backoff_ms),
            drops: DropLog::default(),
        }
    }

    /// The label selector sent with every LIST and WATCH.
    pub fn with_label_selector(mut self, selector: String) -> Self {
        self.label_selector = selector;
        self
    }

    /// The field selector sent with every LIST and WATCH (`metadata.name=<pool>`).
    pub fn with_field_selector(mut self, selector: String) -> Self {
        self.field_selector = selector;
        self
    }

    /// The API client (shared with the source's other collections).
    pub fn api(&self) -> &ApiClient {
        &self.api
    }

    /// The label selector now.
    pub fn label_selector(&self) -> &str {
        &self.label_selector
    }

    /// Follows another label selector from now: the open watch closes, a LIST is due.
    pub fn set_label_selector(&mut self, selector: String) {
        if selector != self.label_selector {
            self.label_selector = selector;
            self.relist();
        }
    }

    /// Makes a LIST due (the next [`ListWatch::next`] starts with one).
    pub fn relist(&mut self) {
        self.watch = None;
        self.resource_version = None;
    }

    /// Counts `n` drops of `reason`.
    pub fn count_dropped(&mut self, reason: Dropped, n: u64) {
        self.drops.count(&self.metrics, &self.name, reason, n);
    }

    /// The collection's URL with the selectors and `params` in its query.
    fn url_with(&self, params: &[(&str, &str)]) -> String {
        match reqwest::Url::parse(&self.collection) {
            Ok(mut url) => {
                {
                    let mut q = url.query_pairs_mut();
                    if !self.label_selector.is_empty() {
                        q.append_pair("labelSelector", &self.label_selector);
                    }
                    if !self.field_selector.is_empty() {
                        q.append_pair("fieldSelector", &self.field_selector);
                    }
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

    fn set_resource_version(&mut self, rv: Option<&str>) {
        if let Some(rv) = rv.filter(|v| !v.is_empty() && v.len() <= MAX_RESOURCE_VERSION_BYTES) {
            self.resource_version = Some(rv.to_owned());
        }
    }

    /// LISTs the collection; on success a watch follows from its resourceVersion. Items that
    /// are not a `T` are dropped and counted.
    pub async fn list<T: Object>(&mut self) -> Result<Vec<T>, K8sError> {
        let result = self.list_inner().await;
        let label = if result.is_ok() { "ok" } else { "error" };
        self.metrics
            .lists
            .with_label_values(&[&self.name, label])
            .inc();
        result
    }

    async fn list_inner<T: Object>(&mut self) -> Result<Vec<T>, K8sError> {
        let url = &self.url_with(&[]);
        let err = |message: String| K8sError::Request {
            op: "list",
            url: url.clone(),
            message,
        };
        let deadline = tokio::time::Instant::now() + self.request_timeout;
        let req = self.api.get(url).timeout(self.request_timeout);
        let mut resp = req.send().await.map_err(|e| err(e.to_string()))?;
        check_status("list", url, self.resource, resp.status())?;
        let too_big = || K8sError::BadList {
            url: url.clone(),
            message: format!("body over {MAX_LIST_BYTES} bytes"),
        };
        if resp
            .content_length()
            .is_some_and(|n| n > MAX_LIST_BYTES as u64)
        {
            return Err(too_big());
        }
        let mut body = Vec::new();
        loop {
            let chunk = tokio::time::timeout_at(deadline, resp.chunk())
                .await
                .map_err(|_| err("timed out reading the body".into()))?
                .map_err(|e| err(e.to_string()))?;
            let Some(chunk) = chunk else { break };
            if body.len() + chunk.len() > MAX_LIST_BYTES {
                return Err(too_big());
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
        let mut items = Vec::new();
        let mut bad = 0;
        for raw in list.items.unwrap_or_default() {
            match serde_json::from_str::<T>(raw.get()) {
                Ok(item) => items.push(item),
                Err(_) => bad += 1,
            }
        }
        self.count_dropped(Dropped::BadSlice, bad);
        self.watch = None;
        self.resource_version = Some(rv);
        Ok(items)
    }

    /// Opens a WATCH from `rv`.
    async fn open_watch(&self, rv: &str) -> Result<OpenWatch, K8sError> {
        let url = &self.url_with(&[
            ("watch", "1"),
            ("resourceVersion", rv),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", &self.watch_timeout_s.to_string()),
        ]);
        let failed = |message: String| K8sError::Request {
            op: "watch",
            url: url.clone(),
            message,
        };
        let response = tokio::time::timeout(self.request_timeout, self.api.get(url).send())
            .await
            .map_err(|_| failed("no response headers in time".into()))?
            .map_err(|e| failed(e.to_string()))?;
        check_status("watch", url, self.resource, response.status())?;
        Ok(OpenWatch {
            response,
            lines: LineSplitter::new(MAX_EVENT_LINE_BYTES),
            deadline: tokio::time::Instant::now()
                + Duration::from_secs(self.watch_timeout_s)
                + self.request_timeout,
            opened: tokio::time::Instant::now(),
        })
    }

    /// Waits the current backoff (jittered to 50-100 %), then doubles it up to the maximum.
    async fn back_off(&mut self) {
        let jitter = rand::rng().random_range(0.5..=1.0);
        tokio::time::sleep(self.backoff.mul_f64(jitter)).await;
        self.backoff = (self.backoff * 2).min(self.max_backoff);
    }

    fn watch_failed(&self) {
        self.metrics
            .watch_errors
            .with_label_values(&[&self.name])
            .inc();
    }

    /// Lists, watches and reconnects until there is something to hand over: a whole list, or
    /// a batch of changes. Never returns on API errors — it backs off and retries — so the
    /// caller races it against its stop signal; cancelling it loses nothing (the open watch
    /// stays in `self` between calls).
    pub async fn next<T: Object>(&mut self) -> Batch<T> {
        loop {
            let Some(watch) = self.watch.as_mut() else {
                let Some(rv) = self.resource_version.clone() else {
                    match self.list().await {
                        Ok(items) => {
                            self.backoff = self.min_backoff;
                            return Batch::Listed(items);
                        }
                        Err(e) => {
                            tracing::warn!(source = %self.name, resource = self.resource, error = %e, "Kubernetes LIST failed; keeping the previous replicas");
                            self.back_off().await;
                        }
                    }
                    continue;
                };
                match self.open_watch(&rv).await {
                    Ok(w) => self.watch = Some(w),
                    Err(K8sError::Gone) => {
                        tracing::info!(source = %self.name, resource = self.resource, "watch resourceVersion expired: re-listing");
                        self.resource_version = None;
                    }
                    Err(e) => {
                        self.watch_failed();
                        tracing::warn!(source = %self.name, resource = self.resource, error = %e, "Kubernetes WATCH failed; keeping the previous replicas");
                        self.back_off().await;
                    }
                }
                continue;
            };
            let chunk = match tokio::time::timeout_at(watch.deadline, watch.response.chunk()).await
            {
                Ok(Ok(Some(chunk))) => chunk,
                Ok(Ok(None)) if watch.opened.elapsed() < Duration::from_secs(1) => {
                    // Ended at once (a server or proxy that answers a watch with an empty body):
                    // reopening at once would hammer it.
                    self.watch = None;
                    self.watch_failed();
                    tracing::debug!(source = %self.name, resource = self.resource, "Kubernetes watch ended empty; reopening after a backoff");
                    self.back_off().await;
                    continue;
                }
                Ok(Ok(None)) | Err(_) => {
                    // The API server ended the watch (timeoutSeconds), or it outlived its
                    // deadline: reopen from the last resourceVersion.
                    self.watch = None;
                    continue;
                }
                Ok(Err(e)) => {
                    self.watch = None;
                    self.watch_failed();
                    tracing::warn!(source = %self.name, resource = self.resource, error = %e, "Kubernetes watch broke; reconnecting");
                    self.back_off().await;
                    continue;
                }
            };
            let mut lines = Vec::new();
            watch.lines.push(&chunk, &mut lines);
            let changes = self.decode_lines(lines);
            if !changes.is_empty() {
                // A watch that delivers is healthy: the next failure starts from the minimum.
                self.backoff = self.min_backoff;
                return Batch::Changes(changes);
            }
        }
    }

    /// Decodes a chunk's lines into changes: bookmarks move the resourceVersion, 410 and
    /// error events close the watch (after the changes before them), bad lines are counted.
    fn decode_lines<T: Object>(&mut self, lines: Vec<Line>) -> Vec<WatchEvent<T>> {
        let mut changes = Vec::new();
        for line in lines {
            let line = match line {
                Line::Complete(l) => l,
                Line::Overlong => {
                    self.count_dropped(Dropped::OverlongLine, 1);
                    continue;
                }
            };
            match parse_event::<T>(&line) {
                Ok(WatchEvent::Applied(object)) => {
                    self.set_resource_version(object.meta().resource_version.as_deref());
                    changes.push(WatchEvent::Applied(object));
                }
                Ok(WatchEvent::Deleted(object)) => {
                    self.set_resource_version(object.meta().resource_version.as_deref());
                    changes.push(WatchEvent::Deleted(object));
                }
                Ok(WatchEvent::Bookmark(rv)) => self.set_resource_version(rv.as_deref()),
                Ok(WatchEvent::Expired) => {
                    tracing::info!(source = %self.name, resource = self.resource, "watch resourceVersion expired: re-listing");
                    self.relist();
                    break;
                }
                Ok(WatchEvent::Error(msg)) => {
                    tracing::warn!(source = %self.name, resource = self.resource, error = %msg, "Kubernetes watch error event; reopening");
                    self.watch_failed();
                    self.watch = None;
                    break;
                }
                Err(e) => {
                    tracing::debug!(source = %self.name, error = %e, "watch event dropped");
                    self.count_dropped(Dropped::MalformedEvent, 1);
                }
            }
        }
        changes
    }
}

// ---------------------------------------------------------------------------------------------
// The registry side.

/// The replicas a source registered and lists now: id → (registry index, its KV-event source).
#[derive(Debug, Default)]
pub struct Members {
    by_id: HashMap<String, (usize, Option<KvEventsSource>)>,
}

impl Members {
    /// How many it lists.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Whether it lists none.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// The members with KV events, with their event sources, by registry index.
    pub fn kv_events(&self) -> Vec<(usize, KvEventsSource)> {
        let mut out: Vec<(usize, KvEventsSource)> = self
            .by_id
            .values()
            .filter_map(|(i, kv)| kv.clone().map(|kv| (*i, kv)))
            .collect();
        out.sort_by_key(|(i, _)| *i);
        out
    }

    /// Brings the registry in line with `desired`: registers endpoints it does not list yet
    /// (or brings them back), removes (drains) the ones it listed that left. Returns the
    /// replicas new to the node and whether anything changed.
    pub fn reconcile(
        &mut self,
        cfg: &KubernetesConfig,
        source: &str,
        desired: &BTreeMap<String, Found>,
        registry: &dyn ReplicaRegistry,
        metrics: &K8sMetrics,
    ) -> (Vec<usize>, bool) {
        let mut added = Vec::new();
        let mut changed = false;
        for (id, found) in desired {
            if self.by_id.contains_key(id) {
                continue;
            }
            match registry.add_replica(&cfg.replica(found)) {
                Ok((i, new)) => {
                    tracing::info!(replica = %id, source = %source, "endpoint routable");
                    if new {
                        added.push(i);
                    }
                    self.by_id.insert(id.clone(), (i, cfg.kv_events_at(found)));
                    changed = true;
                }
                Err(e) => tracing::warn!(replica = %id, error = %e, "cannot register replica"),
            }
        }
        let gone: Vec<String> = self
            .by_id
            .keys()
            .filter(|id| !desired.contains_key(*id))
            .cloned()
            .collect();
        for id in gone {
            if let Some((i, _)) = self.by_id.remove(&id) {
                tracing::info!(replica = %id, source = %source, "endpoint gone, not ready or terminating: draining");
                registry.remove_replica(i);
                changed = true;
            }
        }
        metrics
            .endpoints
            .with_label_values(&[source])
            .set(self.by_id.len() as i64);
        (added, changed)
    }
}

/// The objects a source was shown, by name, each reduced to what routing needs (a slice's
/// routable endpoints, a pod's address): the state a LIST replaces and watch events edit. At
/// most a cap of them.
#[derive(Debug)]
pub struct Named<V> {
    items: BTreeMap<String, V>,
}

impl<V> Default for Named<V> {
    fn default() -> Self {
        Named {
            items: BTreeMap::new(),
        }
    }
}

impl<V> Named<V> {
    /// Sets object `name`'s value; a new object past `max` is refused (false).
    pub fn upsert(&mut self, name: String, value: V, max: usize) -> bool {
        if !self.items.contains_key(&name) && self.items.len() >= max {
            return false;
        }
        self.items.insert(name, value);
        true
    }

    /// Forgets object `name`.
    pub fn remove(&mut self, name: &str) {
        self.items.remove(name);
    }

    /// Forgets every object (before a LIST's are applied).
    pub fn clear(&mut self) {
        self.items.clear();
    }

    /// How many objects it holds.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The objects in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &V)> {
        self.items.iter()
    }
}

/// The first `max` of `found` by id (an endpoint listed twice counts once), and how many more
/// there were.
pub fn capped<'a>(
    found: impl Iterator<Item = &'a Found>,
    max: usize,
) -> (BTreeMap<String, Found>, usize) {
    let mut out = BTreeMap::new();
    let mut over = 0;
    for f in found {
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
