//! The HTTP front of a node: OpenAI endpoints, health, metrics, admin — and starting/stopping it.
//!
//! Exists so there is one way to run a node, used alike by `kvmesh serve`, the integration tests
//! and the demo: [`spawn`] builds the node from a [`NodeConfig`], runs one health round so the
//! node starts knowing which replicas are up, binds, and returns a [`RunningNode`] whose
//! [`RunningNode::shutdown`] stops accepting and drains in-flight requests up to a deadline.

pub mod admin;
pub mod admin_cli;
mod auth;
mod blame;
mod body;
mod cache_salt;
mod decide;
mod deliver;
pub mod error;
pub mod forward;
mod identify;
mod kv_hint;
pub mod listener;
pub mod otel;
pub mod pd;
mod pd_leg;
mod pd_sglang;
mod pd_vllm;
mod picker;
mod receipts;
pub mod region_forward;
mod respond;
mod resume;
pub mod stored_responses;
mod tls;
mod trace_span;
mod understand;
pub mod warm_peers;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use tokio::sync::watch;

use crate::node::config::{NodeConfig, ServeArgs};
use crate::node::mesh_loop::{self, MeshRuntime};
use crate::node::watchers::{check_all, spawn_watchers};
use crate::node::{Node, NodeState};
use crate::replicas::dns::DnsSource;
use crate::replicas::k8s::{K8sMetrics, K8sSource};
use auth::authorized;
use error::ApiError;
use listener::{Listener, ListenerConfig};

/// How often the peer client pings a pooled connection to another node, and how long it waits
/// for the answer before dropping the connection.
const PEER_KEEP_ALIVE: Duration = Duration::from_secs(10);

/// The node's HTTP routes: the APIs, and the operator's `/admin` routes.
pub fn app(node: Arc<Node>) -> axum::Router {
    api_routes()
        .route("/admin/state", get(admin_state))
        .route("/admin/replicas", get(admin::list).post(admin::add))
        .route("/admin/replicas/{id}", axum::routing::delete(admin::remove))
        .route("/admin/replicas/{id}/drain", post(admin::drain))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(node)
}

/// The peer listener's routes: the APIs only. A mesh certificate lets a peer forward requests,
/// not command this node: with no admin token (a loopback front needs none), `/admin` there
/// would be open to every member, whatever its certificate's roles.
pub fn peer_app(node: Arc<Node>) -> axum::Router {
    api_routes()
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(node)
}

/// The routes every front serves.
fn api_routes() -> axum::Router<Arc<Node>> {
    axum::Router::new()
        .route("/v1/completions", post(forward::completions))
        .route("/v1/chat/completions", post(forward::chat_completions))
        .route("/v1/messages", post(forward::messages))
        .route("/v1/messages/count_tokens", post(forward::count_tokens))
        .route("/v1/responses", post(forward::responses))
        .route("/v1/responses/{id}", get(stored_responses::get))
        .route("/v1/responses/{id}/cancel", post(stored_responses::cancel))
        .route("/v1/embeddings", post(forward::embeddings))
        .route("/v1/rerank", post(forward::rerank_v1))
        .route("/rerank", post(forward::rerank))
        .route("/v1/score", post(forward::score))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
}

/// 405 in the shape of the API the path belongs to (Anthropic's for `/v1/messages…`).
async fn method_not_allowed(uri: axum::http::Uri) -> axum::response::Response {
    let e = ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: format!("{} does not take this method", uri.path()),
        kind: "invalid_request_error",
        param: None,
        code: "method_not_allowed",
        retry_after_s: None,
    };
    let shape = if uri.path().starts_with("/v1/messages") {
        error::ErrorShape::Anthropic
    } else {
        error::ErrorShape::OpenAi
    };
    e.into_response_shaped(shape)
}

async fn not_found() -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: "no such endpoint".into(),
        kind: "invalid_request_error",
        param: None,
        code: "not_found",
        retry_after_s: None,
    }
}

async fn models(State(node): State<Arc<Node>>) -> Json<serde_json::Value> {
    let data: Vec<serde_json::Value> = node
        .models()
        .into_iter()
        .map(|id| serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "kvmesh"}))
        .collect();
    Json(serde_json::json!({"object": "list", "data": data}))
}

async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "ok"}))
}

async fn ready(State(node): State<Arc<Node>>) -> Response {
    if node.ready() {
        Json(serde_json::json!({"status": "ready"})).into_response()
    } else {
        ApiError::unavailable("no healthy replica with known models").into_response()
    }
}

async fn metrics(State(node): State<Arc<Node>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorized(&headers, node.secrets.metrics_token.as_deref()) {
        return e.into_response();
    }
    match node.metrics.render() {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4"),
            )],
            text,
        )
            .into_response(),
        Err(e) => ApiError::internal(format!("cannot render metrics: {e}")).into_response(),
    }
}

async fn admin_state(
    State(node): State<Arc<Node>>,
    headers: HeaderMap,
) -> Result<Json<NodeState>, ApiError> {
    // Without a token the admin API is open only on loopback (`AuthConfig::load` refuses the
    // rest unless `auth.admin_open`).
    authorized(&headers, node.secrets.admin_token.as_deref())?;
    Ok(Json(node.state()))
}

/// A node running in this process.
pub struct RunningNode {
    /// The address it listens on (the real port when configured with port 0).
    pub addr: SocketAddr,
    /// The mesh's mutual-TLS listener for forwarded requests, when the node runs a mesh.
    pub peer_addr: Option<SocketAddr>,
    /// The endpoint picker's ext_proc gRPC listener, with `[picker] listen`.
    pub picker_addr: Option<SocketAddr>,
    /// The node's shared state (for tests and embedding).
    pub node: Arc<Node>,
    stop: watch::Sender<bool>,
    server: Listener,
    peer_server: Option<Listener>,
    picker: Option<picker::PickerListener>,
    mesh: Option<MeshRuntime>,
    /// The certificates it presents, and where to reload them from (shared with the file
    /// watcher of `server.cert_reload_interval_s`).
    certs: Arc<tls::Certificates>,
}

impl RunningNode {
    /// Stops accepting, waits for in-flight requests up to the configured drain deadline, stops
    /// the watcher tasks. Returns whether the drain finished in time.
    pub async fn shutdown(self) -> bool {
        let drain = Duration::from_secs(self.node.cfg.drain_s);
        let _ = self.stop.send(true);
        let both = async {
            self.server.drained().await;
            if let Some(p) = &self.peer_server {
                p.drained().await;
            }
        };
        // Idle connections and ones still sending a request head are not waited for.
        let drained = tokio::time::timeout(drain, both).await.is_ok();
        if !drained {
            tracing::warn!(?drain, "drain deadline passed; dropping remaining requests");
        }
        self.server.abort();
        if let Some(p) = &self.peer_server {
            p.abort();
        }
        if let Some(p) = &self.picker {
            p.abort();
        }
        // Leave the mesh after draining, so forwarded requests in flight could still finish.
        if let Some(mesh) = self.mesh {
            mesh.shutdown(&self.node).await;
        }
        drained
    }

    /// Reads the configuration again from `args` (its file and flags) and applies what may
    /// change at run time (`Node::reload`); an invalid file changes nothing.
    pub fn reload(&self, args: &ServeArgs) -> anyhow::Result<crate::node::ReloadReport> {
        let cfg = NodeConfig::from_args(args).context("reading the configuration")?;
        self.node.reload(&cfg)
    }

    /// Re-reads every configured certificate from its files — the client listener's
    /// (`server.tls_cert` / `server.tls_key`) and the mesh's (QUIC and peer HTTPS) — and makes new
    /// handshakes present it; established connections continue. Each is validated first (key
    /// matches; for the mesh also the CA loaded at start, the cluster SAN and this node's id):
    /// one that fails keeps the certificate in use, is warned about, and makes this an error.
    /// Counted in `kvmesh_cert_reloads_total{result}`. The CA is not reloaded.
    pub fn reload_certificates(&self) -> anyhow::Result<()> {
        self.certs.reload()
    }

    /// Stops at once, like a crash: the mesh goes silent and the listener closes without
    /// draining (tests of node death).
    pub async fn kill(self) {
        let _ = self.stop.send(true);
        if let Some(mesh) = self.mesh {
            mesh.shutdown(&self.node).await;
        }
        self.server.abort();
        if let Some(p) = &self.peer_server {
            p.abort();
        }
        if let Some(p) = &self.picker {
            p.abort();
        }
    }
}

/// Installs the ring crypto provider for rustls (reqwest is built without one); a provider
/// already installed is fine.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Starts a node: state, one health round, the listeners, the mesh, the watcher tasks.
pub async fn spawn(cfg: NodeConfig) -> anyhow::Result<RunningNode> {
    install_crypto_provider();
    let listen = cfg.listen;
    let node = Node::new(cfg)?;
    register_tracing(&node)?;
    let (dns, kubernetes) = initial_sources(&node).await?;
    // Start knowing which replicas are up and what they serve, bounded by the check timeout.
    check_all(&node, 0..node.replica_count()).await;
    let tcp = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let server_cfg = &node.cfg.server;
    let client_cert = match (&server_cfg.tls_cert, &server_cfg.tls_key) {
        (Some(cert), Some(key)) => {
            Some(tls::ClientCert::load(cert, key).context("server.tls_cert / server.tls_key")?)
        }
        _ => None,
    };
    let client_tls = match &client_cert {
        Some(c) => Some(Arc::new(tls::server_config(c.live())?)),
        None => None,
    };
    let listener_cfg = ListenerConfig {
        header_read_timeout: Duration::from_millis(server_cfg.header_read_timeout_ms),
        idle_timeout: Duration::from_millis(server_cfg.keep_alive_idle_ms),
        max_connections: server_cfg.max_connections,
        http2_max_streams: server_cfg.http2_max_streams,
        tls: client_tls,
        peer: false,
    };
    let (stop, stop_rx) = watch::channel(false);
    let _ = node.stop_signal.set(stop_rx.clone());
    // One certificate for every mesh connection (QUIC both ways, peer HTTPS both ways), so one
    // reload rotates them all.
    let mesh_cert = node
        .cfg
        .mesh
        .as_ref()
        .map(|m| tls::MeshCert::load(m, &node.cfg.region))
        .transpose()?;
    let (peer_server, peer_url) = match &mesh_cert {
        Some(cert) => peer_front(&node, cert, listen, &listener_cfg, &stop_rx).await?,
        None => (None, String::new()),
    };
    let server = Listener::serve(tcp, app(Arc::clone(&node)), listener_cfg, stop_rx.clone())?;
    let addr = server.addr;
    let picker = picker::start(&node, stop_rx.clone()).await?;
    // The mesh starts once the peer address is known (peers forward to it); until it is warm
    // `/ready` says no, while requests are already served from what the node knows.
    let mesh = mesh_loop::start(
        &node,
        peer_url,
        mesh_cert.as_ref().map(tls::MeshCert::live),
        stop_rx.clone(),
    )
    .await?;
    spawn_watchers(&node, &stop_rx, dns, kubernetes);
    if let Some(section) = node.cfg.mesh.as_ref().filter(|_| peer_server.is_some()) {
        if section.warm_forward_interval_ms > 0 {
            let interval = Duration::from_millis(section.warm_forward_interval_ms);
            warm_peers::spawn(&node, interval, stop_rx.clone());
        }
    }
    let certs = Arc::new(tls::Certificates {
        client: client_cert,
        mesh: mesh_cert,
        reloads: node.metrics.cert_reloads.clone(),
    });
    if node.cfg.server.cert_reload_interval_s > 0 {
        tokio::spawn(tls::watch_files(
            Arc::clone(&certs),
            Duration::from_secs(node.cfg.server.cert_reload_interval_s),
            stop_rx.clone(),
        ));
    }
    tracing::info!(%addr, replicas = node.replica_count(), policy = node.policy().as_str(), "node listening");
    Ok(RunningNode {
        addr,
        peer_addr: peer_server.as_ref().map(|p| p.addr),
        picker_addr: picker.as_ref().map(|p| p.addr),
        node,
        stop,
        server,
        peer_server,
        picker,
        mesh,
        certs,
    })
}

/// With `[tracing]`: the process's export counters on this node's `/metrics`.
fn register_tracing(node: &Node) -> anyhow::Result<()> {
    if !node.cfg.tracing.enabled() {
        return Ok(());
    }
    let stats = otel::stats()?;
    for c in [&stats.exported, &stats.dropped, &stats.failed] {
        node.metrics.registry.register(Box::new(c.clone()))?;
    }
    match node.cfg.tracing.traces_url() {
        Some(url) if otel::installed() => {
            tracing::info!(%url, sample_ratio = node.cfg.tracing.sample_ratio, "exporting traces");
        }
        _ => tracing::warn!("[tracing] is on but no trace export pipeline is installed"),
    }
    Ok(())
}

/// DNS sources resolved and Kubernetes sources listed once, so the node starts with their
/// replicas (a failed list starts empty and retries in the watch loop).
async fn initial_sources(
    node: &Arc<Node>,
) -> anyhow::Result<(Vec<(DnsSource, Duration)>, Vec<K8sSource>)> {
    let mut dns = Vec::with_capacity(node.cfg.dns.len());
    for d in &node.cfg.dns {
        let mut source = DnsSource::new(d.clone())?;
        let (_, next) = source.sync(node.as_ref()).await;
        dns.push((source, next));
    }
    // Their metrics are registered once per node, for all of them.
    let mut kubernetes = Vec::with_capacity(node.cfg.kubernetes.len());
    if !node.cfg.kubernetes.is_empty() {
        let metrics = K8sMetrics::new(&node.metrics.registry)?;
        for (n, k) in node.cfg.kubernetes.iter().enumerate() {
            let mut source = K8sSource::new(k.clone(), metrics.clone())
                .with_context(|| format!("kubernetes[{n}]"))?;
            source.initial_sync(node.as_ref()).await;
            kubernetes.push(source);
        }
    }
    Ok((dns, kubernetes))
}

/// An HTTP client over `tls` for forwards to one node (see `peer_front`).
fn peer_client(
    tls: rustls::ClientConfig,
    connect_timeout: Duration,
) -> anyhow::Result<reqwest::Client> {
    // Every peer listener speaks HTTP/2, so forwards to a peer share one connection: with ALPN
    // alone the pool cannot know that before the first handshake, and a burst of forwards to
    // another region opened one TLS connection (one more round trip across regions) per
    // request in flight.
    reqwest::Client::builder()
        .use_preconfigured_tls(tls)
        .http2_prior_knowledge()
        // Only to servers that prove a cluster certificate: a peer's record naming a plain
        // `http://` URL (config refuses one; a rogue peer might not) gets nothing.
        .https_only(true)
        // Each answer carries the peer's certificate: a forward checks it names the node meant.
        .tls_info(true)
        // A connection to a peer that died without a word is found out and dropped from the
        // pool between forwards, not by the next forward's timeout.
        .http2_keep_alive_interval(PEER_KEEP_ALIVE)
        .http2_keep_alive_timeout(PEER_KEEP_ALIVE)
        .http2_keep_alive_while_idle(true)
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true)
        .build()
        .context("peer HTTPS client")
}

/// The peer listener, where forwarded requests arrive inside the cluster's mutual TLS, and the
/// peer clients the node forwards with; returns the listener and its URL.
async fn peer_front(
    node: &Arc<Node>,
    cert: &tls::MeshCert,
    listen: SocketAddr,
    listener_cfg: &ListenerConfig,
    stop_rx: &watch::Receiver<bool>,
) -> anyhow::Result<(Option<Listener>, String)> {
    let Some(section) = &node.cfg.mesh else {
        return Ok((None, String::new()));
    };
    let (server_tls, _) = crate::mesh::peer_tls::https_configs_with(cert.identity(), cert.live())
        .context("mesh certificates for the peer listener")?;
    // One forwarding client per node a record names, its handshake checking that node's
    // certificate (`mesh::peer_tls`); made on first use.
    let (identity, live) = (cert.identity().clone(), cert.live());
    let connect_timeout = node.cfg.connect_timeout();
    node.forward_clients
        .set_maker(Box::new(move |node_id: &str, region: &str| {
            let tls = crate::mesh::peer_tls::forward_client_config(
                &identity,
                Arc::clone(&live),
                node_id,
                region,
            );
            match tls
                .map_err(anyhow::Error::from)
                .and_then(|tls| peer_client(tls, connect_timeout))
            {
                Ok(c) => Some(c),
                Err(e) => {
                    tracing::warn!(node = %node_id, error = %e, "no forwarding client");
                    None
                }
            }
        }));
    let bind = section
        .peer_listen
        .unwrap_or_else(|| SocketAddr::new(listen.ip(), 0));
    let tcp = tokio::net::TcpListener::bind(bind)
        .await
        .with_context(|| format!("cannot listen on {bind} (mesh.peer_listen)"))?;
    let peer = Listener::serve(
        tcp,
        peer_app(Arc::clone(node)),
        ListenerConfig {
            tls: Some(Arc::new(server_tls)),
            peer: true,
            idle_timeout: listener::PEER_IDLE,
            ..listener_cfg.clone()
        },
        stop_rx.clone(),
    )?;
    let url = format!("https://{}", peer.addr);
    Ok((Some(peer), url))
}

/// `kvmesh serve`: runs a node until SIGINT/SIGTERM, then drains; SIGHUP reloads the
/// configuration `args` name (`RunningNode::reload`). `cfg` is what `args` gave at start. The
/// caller installs the trace export pipeline (`otel::Pipeline`) in its subscriber first, and shuts
/// it down after.
pub async fn serve(cfg: NodeConfig, args: &ServeArgs) -> anyhow::Result<()> {
    let mut hangups = crate::shutdown::Hangups::watch();
    let running = spawn(cfg).await?;
    println!("kvmesh node listening on http://{}", running.addr);
    let stop = crate::shutdown::signalled();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => break,
            _ = hangups.next() => {
                tracing::info!("SIGHUP: reloading the configuration");
                if let Err(e) = running.reload(args) {
                    tracing::warn!(error = %format!("{e:#}"), "reload failed; the node runs on as it was");
                }
                if let Err(e) = running.reload_certificates() {
                    tracing::warn!(error = %format!("{e:#}"), "certificate reload failed; the old ones stay in use");
                }
            }
        }
    }
    tracing::info!("shutting down: draining in-flight requests");
    running.shutdown().await;
    Ok(())
}

/// `kvmesh status`: fetches `/admin/state` from a node and renders it as a table.
pub async fn status(node_url: &str, token: Option<&str>) -> anyhow::Result<String> {
    install_crypto_provider();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    let mut req = client.get(format!("{}/admin/state", node_url.trim_end_matches('/')));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req
        .send()
        .await
        .with_context(|| format!("cannot reach {node_url}"))?;
    let status = resp.status();
    let body = resp.text().await?;
    anyhow::ensure!(status.is_success(), "{node_url} answered {status}: {body}");
    let state: NodeState = serde_json::from_str(&body).context("unexpected /admin/state answer")?;
    Ok(render_state(&state))
}

/// The table `kvmesh status` prints.
pub fn render_state(s: &NodeState) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "region {}  policy {}  uptime {:.0}s  replicas {}",
        s.region,
        s.policy,
        s.uptime_s,
        s.replicas.len()
    );
    let _ = writeln!(
        out,
        "{:<24} {:<10} {:>5} {:>5} {:>5} {:>6} {:>10} {:>9} {:>8} {:>8}  models",
        "replica",
        "health",
        "wait",
        "run",
        "infl",
        "kv%",
        "queued_tok",
        "sum_seq",
        "sum_keys",
        "overlay"
    );
    for r in &s.replicas {
        let health = if r.ejected {
            format!("{}*", r.health)
        } else {
            r.health.clone()
        };
        let _ = writeln!(
            out,
            "{:<24} {:<10} {:>5} {:>5} {:>5} {:>6.1} {:>10} {:>9} {:>8} {:>8}  {}",
            r.id,
            health,
            r.waiting,
            r.running,
            r.in_flight,
            r.kv_usage * 100.0,
            r.queued_prefill_tokens,
            r.summary_seq,
            r.summary_keys,
            r.overlay_keys,
            r.models.join(",")
        );
    }
    if let Some(m) = &s.mesh {
        let _ = writeln!(
            out,
            "\nmesh node {} gen {} quic {} {}",
            m.node_id,
            m.generation,
            m.quic_addr,
            if m.warm { "warm" } else { "warming" }
        );
        let _ = writeln!(
            out,
            "{:<20} {:<12} {:<5} {:>15} {:>7}  http",
            "member", "region", "live", "generation", "homes"
        );
        for n in &m.members {
            let _ = writeln!(
                out,
                "{:<20} {:<12} {:<5} {:>15} {:>7}  {}{}",
                n.node_id,
                n.region,
                if n.live { "yes" } else { "no" },
                n.generation,
                n.replicas_published,
                n.http_url,
                if n.is_self { "  (this node)" } else { "" }
            );
        }
        let _ = writeln!(
            out,
            "{:<24} {:<12} {:<20} {:>15} {:>9} {:>8}",
            "replica", "region", "home", "sum_epoch", "sum_seq", "age_s"
        );
        for r in &m.replicas {
            let _ = writeln!(
                out,
                "{:<24} {:<12} {:<20} {:>15} {:>9} {:>8}",
                r.id,
                r.region,
                if r.home.is_empty() { "-" } else { &r.home },
                r.summary_epoch,
                r.summary_seq,
                r.summary_age_s
                    .map_or_else(|| "-".to_owned(), |a| format!("{a:.1}"))
            );
        }
    }
    out
}
