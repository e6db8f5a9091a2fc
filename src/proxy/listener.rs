//! The accept loop under the node's HTTP routes: every client connection bounded in number, in
//! time and in what it may claim.
//!
//! Exists because `axum::serve` has no header timeout, no connection cap and no TLS, so a few
//! slow or idle clients could hold a node: slowloris kept connections forever and, past the
//! open-files limit, `/health` went dark. Here:
//!
//! - **Time.** A request head must arrive within `header_read_timeout_ms` of its first byte
//!   (a new connection's first request, of the connection's start): slowloris and silent
//!   connections are cut. Between requests a connection may stay idle for
//!   `keep_alive_idle_ms` (a peer's, on the mesh listener, [`PEER_IDLE`]), longer than clients
//!   keep idle connections pooled: a request a client writes as the server closes its
//!   connection is lost. Body reads have their own limit (`forward.rs`).
//! - **Number.** At most `max_connections` (capped by the open-files limit less a reserve for
//!   replicas, peers and files) are open. At the cap the least recently active connection is
//!   told to close — gracefully: a request in flight on it finishes first — and the new one is
//!   served; past the cap plus a margin new connections are closed at once, never queued.
//! - **Protocol.** HTTP/1.1 and HTTP/2 (h2c prior knowledge, or ALPN over TLS), with the same
//!   limits; optional TLS (rustls) on the same port.
//! - **Who.** Each request carries a [`ConnInfo`] extension; `peer` is set only on the mesh's
//!   mutual-TLS listener, whose clients proved a cluster certificate.
//! - **Drain.** On stop, idle connections close at once and busy ones after their requests;
//!   [`Listener::drained`] says when no request is left.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tower::ServiceExt;

use crate::shutdown::stopped;

/// Connections admitted over the cap while evicted ones finish their requests.
const OVERFLOW_SHARE: usize = 8;
/// How long the peer listener keeps a peer's HTTP/2 connection without a request: twice the
/// longest `mesh.warm_forward_interval_ms`. Peers proved a cluster certificate, and the
/// connection cap still evicts the least recently active.
pub const PEER_IDLE: Duration = Duration::from_secs(120);
/// HTTP/2 flow-control windows of a peer's connection: what a peer may send before this node
/// reads it, per connection and per forwarded request.
const PEER_CONNECTION_WINDOW: u32 = 16 << 20;
/// See [`PEER_CONNECTION_WINDOW`].
const PEER_STREAM_WINDOW: u32 = 4 << 20;
/// File descriptors kept free for replicas, peers, DNS and files when capping connections.
const FD_RESERVE: u64 = 512;

/// How a listener treats its clients.
#[derive(Clone)]
pub struct ListenerConfig {
    /// Whole request head deadline, from its first byte (or the connection's start).
    pub header_read_timeout: Duration,
    /// A connection with no request in flight and none being sent for this long is closed
    /// (not less than `header_read_timeout`). The client listener uses `keep_alive_idle_ms`;
    /// the peer listener [`PEER_IDLE`], longer than `mesh.warm_forward_interval_ms` allows, so
    /// the connections peers keep open for their forwards (`warm_peers.rs`) stay open between
    /// rounds.
    pub idle_timeout: Duration,
    /// Open connections at most (soft cap: least recently active evicted).
    pub max_connections: usize,
    /// Concurrent HTTP/2 streams per connection.
    pub http2_max_streams: u32,
    /// TLS, when the listener is HTTPS.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// Clients of this listener are mesh peers (mutual TLS).
    pub peer: bool,
}

/// What the handlers may know about the connection a request came on.
#[derive(Clone, Copy, Debug)]
pub struct ConnInfo {
    /// The client's address.
    pub remote: SocketAddr,
    /// The client proved a cluster certificate (the mesh's peer listener).
    pub peer: bool,
}

/// One open connection, as the eviction and drain see it.
struct Slot {
    id: u64,
    /// Requests whose responses have not finished.
    active: AtomicUsize,
    /// Last request start, ms since the listener started.
    last_active_ms: AtomicU64,
    /// When the request head being received began (its first byte, or the connection's
    /// start), ms since the listener started plus one; 0 while none is (idle, or a request in
    /// flight). [`HeadWatch`] sets it, [`ActiveGuard`] clears it.
    head_since_ms: AtomicU64,
    /// Tells the connection to close gracefully.
    close: Notify,
}

/// The open connections.
struct Table {
    slots: Mutex<Vec<Arc<Slot>>>,
    started: Instant,
    next_id: AtomicU64,
    /// Requests in flight across connections.
    active: AtomicUsize,
    idle: Notify,
}

impl Table {
    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Slot>>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A running listener.
pub struct Listener {
    /// The bound address.
    pub addr: SocketAddr,
    table: Arc<Table>,
    task: tokio::task::JoinHandle<()>,
}

impl Listener {
    /// Binds nothing: serves `listener` until `stop`, with `app`.
    pub fn serve(
        listener: TcpListener,
        app: axum::Router,
        cfg: ListenerConfig,
        stop: watch::Receiver<bool>,
    ) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let table = Arc::new(Table {
            slots: Mutex::new(Vec::new()),
            started: Instant::now(),
            next_id: AtomicU64::new(0),
            active: AtomicUsize::new(0),
            idle: Notify::new(),
        });
        let cap = effective_cap(cfg.max_connections);
        let task = tokio::spawn(accept_loop(
            listener,
            app,
            cfg,
            cap,
            Arc::clone(&table),
            stop,
        ));
        Ok(Listener { addr, table, task })
    }

    /// Open connections now.
    pub fn connections(&self) -> usize {
        self.table.slots().len()
    }

    /// After `stop`: waits until no request is in flight. Connections still sending a request
    /// head or idle do not count: [`Listener::abort`] cuts them.
    pub async fn drained(&self) {
        loop {
            let idle = self.table.idle.notified();
            if self.table.active.load(Ordering::Acquire) == 0 {
                return;
            }
            tokio::select! {
                _ = idle => {}
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
        }
    }

    /// Stops serving at once, cutting every connection (after the drain, or as a crash).
    pub fn abort(&self) {
        self.task.abort();
        for s in self.table.slots().iter() {
            s.close.notify_one();
        }
    }
}

/// `max_connections` within the open-files limit (raised to its hard maximum first).
fn effective_cap(wanted: usize) -> usize {
    let limit = rlimit::increase_nofile_limit(u64::MAX).unwrap_or(1024);
    // Each client connection is one descriptor here; replica and peer sockets need their own.
    let by_fds = limit.saturating_sub(FD_RESERVE).max(64);
    let cap = wanted.min(usize::try_from(by_fds).unwrap_or(usize::MAX));
    if cap < wanted {
        tracing::warn!(
            wanted,
            cap,
            nofile = limit,
            "server.max_connections lowered to fit the open-files limit"
        );
    }
    cap
}

async fn accept_loop(
    listener: TcpListener,
    app: axum::Router,
    cfg: ListenerConfig,
    cap: usize,
    table: Arc<Table>,
    mut stop: watch::Receiver<bool>,
) {
    let hard_cap = cap + cap / OVERFLOW_SHARE + 1;
    let tls = cfg.tls.clone().map(tokio_rustls::TlsAcceptor::from);
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stopped(&mut stop) => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        let (tcp, remote) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors or memory: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let open = table.slots().len();
        if open >= hard_cap {
            drop(tcp);
            continue;
        }
        if open >= cap {
            evict_least_recent(&table);
        }
        // Responses go out as several small writes (headers, then each streamed chunk): with
        // Nagle's algorithm on, a write behind an unacknowledged one waits for the client's
        // delayed ACK (40 ms on Linux) on every reused keep-alive connection.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY on a client connection");
        }
        let slot = Arc::new(Slot {
            id: table.next_id.fetch_add(1, Ordering::Relaxed),
            active: AtomicUsize::new(0),
            last_active_ms: AtomicU64::new(table.now_ms()),
            // The first request's head is due from the connection's start.
            head_since_ms: AtomicU64::new(table.now_ms() + 1),
            close: Notify::new(),
        });
        table.slots().push(Arc::clone(&slot));
        let info = ConnInfo {
            remote,
            peer: cfg.peer,
        };
        conns.spawn(serve_connection(
            tcp,
            tls.clone(),
            app.clone(),
            cfg.clone(),
            info,
            Arc::clone(&table),
            slot,
            stop.clone(),
        ));
    }
    // Stopped: connections finish their requests (idle ones close at once), then this returns.
    drop(listener);
    while conns.join_next().await.is_some() {}
}

fn evict_least_recent(table: &Table) {
    let slots = table.slots();
    if let Some(s) = slots.iter().min_by_key(|s| {
        (
            s.active.load(Ordering::Relaxed),
            s.last_active_ms.load(Ordering::Relaxed),
        )
    }) {
        s.close.notify_one();
    }
}

#[allow(clippy::too_many_arguments)]
async fn serve_connection(
    tcp: TcpStream,
    tls: Option<tokio_rustls::TlsAcceptor>,
    app: axum::Router,
    cfg: ListenerConfig,
    info: ConnInfo,
    table: Arc<Table>,
    slot: Arc<Slot>,
    stop: watch::Receiver<bool>,
) {
    match tls {
        None => {
            let io = TokioIo::new(HeadWatch::new(tcp, &table, &slot));
            run_http(io, app, &cfg, info, &table, &slot, stop).await
        }
        Some(acceptor) => {
            match tokio::time::timeout(cfg.header_read_timeout, acceptor.accept(tcp)).await {
                Ok(Ok(stream)) => {
                    let io = TokioIo::new(HeadWatch::new(stream, &table, &slot));
                    run_http(io, app, &cfg, info, &table, &slot, stop).await
                }
                Ok(Err(e)) => {
                    tracing::debug!(remote = %info.remote, error = %e, "TLS handshake failed")
                }
                Err(_) => tracing::debug!(remote = %info.remote, "TLS handshake timed out"),
            }
        }
    }
    table.slots().retain(|s| s.id != slot.id);
}

async fn run_http<I>(
    io: I,
    app: axum::Router,
    cfg: &ListenerConfig,
    info: ConnInfo,
    table: &Arc<Table>,
    slot: &Arc<Slot>,
    mut stop: watch::Receiver<bool>,
) where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // hyper's head timer starts as soon as a connection is idle, so it bounds the idle
        // wait too: set to the longer, and the head deadline is kept by the tick below.
        .header_read_timeout(cfg.idle_timeout.max(cfg.header_read_timeout))
        .max_buf_size(256 * 1024);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(cfg.http2_max_streams)
        .max_header_list_size(256 * 1024)
        .keep_alive_interval(cfg.header_read_timeout)
        .keep_alive_timeout(cfg.header_read_timeout);
    if cfg.peer {
        // A peer sends every forward it has for this node on one connection: room for a burst
        // of long prompts in flight across a region's round trip (hyper's 1 MiB would hold 1
        // MiB per round trip, 12 MiB/s at 80 ms).
        builder
            .http2()
            .initial_connection_window_size(PEER_CONNECTION_WINDOW)
            .initial_stream_window_size(PEER_STREAM_WINDOW);
    }
    let svc_table = Arc::clone(table);
    let svc_slot = Arc::clone(slot);
    let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
        let guard = ActiveGuard::new(&svc_table, &svc_slot);
        req.extensions_mut().insert(info);
        let app = app.clone();
        async move {
            let resp = app.oneshot(req.map(Body::new)).await?;
            // The request stays active until its response body is done (or dropped).
            Ok::<_, std::convert::Infallible>(resp.map(|b| {
                Body::new(b.map_frame(move |f| {
                    let _ = &guard;
                    f
                }))
            }))
        }
    });
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let idle_limit = cfg.idle_timeout.as_millis() as u64;
    let head_limit = cfg.header_read_timeout.as_millis() as u64;
    let period = cfg.idle_timeout.min(cfg.header_read_timeout) / 2;
    let mut tick = tokio::time::interval(period + Duration::from_millis(1));
    let mut closing = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(remote = %info.remote, error = %e, "connection ended");
                }
                return;
            }
            _ = slot.close.notified(), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = stopped(&mut stop), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = tick.tick(), if !closing => {
                if slot.active.load(Ordering::Relaxed) != 0 {
                    continue;
                }
                let now = table.now_ms();
                let head_since = slot.head_since_ms.load(Ordering::Relaxed);
                if head_since != 0 && (now + 1).saturating_sub(head_since) > head_limit {
                    // A head begun and not finished in time (slowloris), or never begun on a
                    // new connection: no request is in flight, so cut it.
                    tracing::debug!(remote = %info.remote, "request head timed out");
                    return;
                }
                // HTTP/2 has no head timeout between streams: an idle connection is closed here.
                let idle_ms = now.saturating_sub(slot.last_active_ms.load(Ordering::Relaxed));
                if idle_ms > idle_limit {
                    closing = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

/// Counts a request as active on its connection and listener until dropped.
struct ActiveGuard {
    table: Arc<Table>,
    slot: Arc<Slot>,
}

impl ActiveGuard {
    fn new(table: &Arc<Table>, slot: &Arc<Slot>) -> Self {
        slot.active.fetch_add(1, Ordering::AcqRel);
        slot.last_active_ms.store(table.now_ms(), Ordering::Relaxed);
        slot.head_since_ms.store(0, Ordering::Relaxed);
        table.active.fetch_add(1, Ordering::AcqRel);
        ActiveGuard {
            table: Arc::clone(table),
            slot: Arc::clone(slot),
        }
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.slot.active.fetch_sub(1, Ordering::AcqRel);
        self.slot
            .last_active_ms
            .store(self.table.now_ms(), Ordering::Relaxed);
        // Bytes read while the request was in flight (its body) began no new head.
        self.slot.head_since_ms.store(0, Ordering::Relaxed);
        if self.table.active.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.table.idle.notify_waiters();
        }
    }
}

/// A client connection's byte stream, noting when an HTTP/1 request head begins: the first
/// bytes read while no request is in flight start [`Slot::head_since_ms`]'s clock. HTTP/2
/// (its preface, `PRI * HTTP/2.0`, in the clear or inside TLS) reads frames between requests
/// (pings, window updates), so it is not watched: its idle connections close by
/// `idle_timeout`, as before.
struct HeadWatch<S> {
    io: S,
    table: Arc<Table>,
    slot: Arc<Slot>,
    /// The connection's first bytes, up to three, to tell HTTP/2's preface from a method.
    start: [u8; 3],
    /// How many of `start` are known.
    started: usize,
    /// The connection speaks HTTP/2 (`start` is `PRI`): not watched.
    http2: bool,
}

impl<S> HeadWatch<S> {
    fn new(io: S, table: &Arc<Table>, slot: &Arc<Slot>) -> Self {
        HeadWatch {
            io,
            table: Arc::clone(table),
            slot: Arc::clone(slot),
            start: [0; 3],
            started: 0,
            http2: false,
        }
    }

    /// Notes `read`, the bytes just read.
    fn saw(&mut self, read: &[u8]) {
        if self.started < self.start.len() {
            let n = read.len().min(self.start.len() - self.started);
            self.start[self.started..self.started + n].copy_from_slice(&read[..n]);
            self.started += n;
            self.http2 = self.start == *b"PRI";
            if self.http2 {
                self.slot.head_since_ms.store(0, Ordering::Relaxed);
            }
        }
        if self.http2 {
            return;
        }
        if self.slot.active.load(Ordering::Relaxed) == 0
            && self.slot.head_since_ms.load(Ordering::Relaxed) == 0
        {
            let since = self.table.now_ms() + 1;
            self.slot.head_since_ms.store(since, Ordering::Relaxed);
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for HeadWatch<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.saw(&buf.filled()[before..]);
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for HeadWatch<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The request's connection facts (absent only for requests not served by a [`Listener`], as in
/// tests calling the router directly).
pub fn conn_info(req: &Request) -> Option<ConnInfo> {
    req.extensions().get::<ConnInfo>().copied()
}
