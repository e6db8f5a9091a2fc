//! The mesh's QUIC transport: chitchat gossip, summary sync and block reports over one mTLS
//! `quinn::Endpoint` per node.
//!
//! Why it is shaped this way:
//! - **One endpoint, server and client.** Incoming connections then come from the peer's gossip
//!   port, so `remote_address()` is the address chitchat replies to.
//! - **One uni stream per message**, prefixed by a kind byte ([`KIND_GOSSIP`],
//!   [`KIND_BLOCK_REPORT`]); chitchat messages reach ~64 KiB, beyond a QUIC datagram. Bidi streams
//!   carry request/response traffic ([`KIND_SUMMARY_REQUEST`], see `sync`). Load updates
//!   ([`KIND_LOAD_UPDATE`], see `load_share`) go as QUIC datagrams: small, frequent, and better
//!   lost than late (the next one carries absolute counts).
//! - **chitchat awaits `Socket::send` inline**, so `send` only queues: a per-peer task dials (with
//!   a timeout), caches the connection and writes. A dead or unreachable peer fills and drains its
//!   own small queue; gossip with everyone else never waits for it.
//! - **Nothing a peer sends can crash the node**: every read is bounded, malformed or oversized
//!   messages are dropped and counted in [`TransportStats`], and logged at most once per
//!   [`WARN_EVERY`].
//! - **Fault injection** for tests: a blocklist of peer addresses whose traffic is dropped both
//!   ways ([`QuicTransport::block`]), which is how partitions are simulated.
//! - **Identity.** Each connection carries the node names of the peer's certificate
//!   (`certs::node_names`). A gossip Syn or SynAck from address A lists the sender's own
//!   `ChitchatId` (advertised at A) in its digest: when the ids it lists at A include none the
//!   certificate names, the message is dropped, counted ([`TransportStats::identity_refused`]),
//!   the connection closed and A refused for [`REFUSE_FOR`]; the ids it does name are recorded
//!   as *verified* ([`QuicTransport::is_verified`]). `Mesh` counts a member live only once
//!   verified, so state relayed by third parties for a node that never proved its name directly
//!   (a fake generation, a fake address) routes nothing. The rule assumes a node's advertised
//!   address is the one its peers see (no NAT between nodes), as chitchat does.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chitchat::transport::{Socket, Transport};
use chitchat::{ChitchatId, ChitchatMessage, Deserializable, Serializable};
use futures::future::{BoxFuture, FutureExt, Shared};
use tokio::sync::mpsc;
use tokio::time::timeout;
use tracing::{debug, warn};

use super::certs::{self, QuicConfigs, CLUSTER_SAN};
use super::directory::{self, Askers, Directory, DirectoryAnswer, DirectoryRequest};
use super::gossip_guard::{Filtered, Guard};
use super::load_share::{LoadUpdate, MAX_LOAD_UPDATE_BYTES};
use super::sync::{self, MeshHandler};
use super::udp_count::{CountingSocket, UdpBytes};

/// Uni stream: one serialized chitchat message follows.
pub const KIND_GOSSIP: u8 = 0x01;
/// Uni stream: one msgpack `BlockReport` follows.
pub const KIND_BLOCK_REPORT: u8 = 0x02;
/// Datagram: one positional-msgpack `LoadUpdate` follows (see `load_share`).
pub const KIND_LOAD_UPDATE: u8 = 0x03;
/// Bidi stream: one msgpack `SummaryRequest` follows; the response is a status byte + body.
pub const KIND_SUMMARY_REQUEST: u8 = 0x10;
/// Uni stream: one zstd-compressed chitchat message of the node's own cluster (its region's,
/// or the whole mesh's in the flat layout). A digest lists every member with fixed-width
/// integers, mostly small: compressed it is about a third of its size.
pub const KIND_GOSSIP_Z: u8 = 0x04;
/// Uni stream: one zstd-compressed chitchat message of the region layer (the representatives'
/// cluster, see `region_layer`).
pub const KIND_REGIONS_Z: u8 = 0x05;
/// Bidi stream: one msgpack `DirectoryRequest` follows; the response is a `DirectoryAnswer`.
pub const KIND_DIRECTORY: u8 = 0x11;
/// zstd level for gossip: the fastest; the messages are a few KiB.
const GOSSIP_ZSTD_LEVEL: i32 = 1;
/// Largest chitchat message accepted (chitchat sizes its messages for a UDP datagram).
pub const MAX_GOSSIP_BYTES: usize = 65_507;
/// Malformed-input warnings are logged at most this often (the counters see every one).
pub const WARN_EVERY: Duration = Duration::from_secs(10);
/// A per-peer sender task with nothing to send for this long exits.
const PEER_IDLE: Duration = Duration::from_secs(30);
/// An address whose peer claimed a node id its certificate does not name is refused this long.
pub const REFUSE_FOR: Duration = Duration::from_secs(60);
/// Most refused addresses remembered (oldest forgotten first).
const MAX_REFUSED: usize = 4096;
/// Most node ids with verified chitchat ids remembered; `Mesh` prunes those chitchat forgot.
const MAX_VERIFIED: usize = 65_536;
/// Verified chitchat ids (generations) kept per node id, the newest: a node restarting has a
/// new generation beside its old one until chitchat forgets that. A member inventing
/// generations of its own name displaces only its own.
const VERIFIED_GENERATIONS: usize = 2;

/// Transport tuning.
#[derive(Clone, Debug)]
pub struct TransportConfig {
    /// Longest a caller waits for a connection to be dialled. Default 1 s (a few RTTs even
    /// across continents). The dial itself goes on after the caller stops waiting, up to
    /// `handshake_timeout`: the next caller for the same peer joins it.
    pub connect_timeout: Duration,
    /// Longest a QUIC handshake may take, dialled or accepted. Default 5 s. Well above one
    /// handshake's time, because a node starting among a hundred others on a few cores
    /// completes handshakes in seconds, and a handshake dropped at its caller's timeout and
    /// dialled again does its work twice (see the dial in `Inner::connection`).
    pub handshake_timeout: Duration,
    /// Most incoming handshakes in flight at once; more are refused (and counted as handshake
    /// failures) until some end. Default 1,024: a hundred nodes starting at once dial a seed
    /// about once each.
    pub max_pending_handshakes: usize,
    /// Longest wait to write or read one gossip message or report. Default 2 s.
    pub io_timeout: Duration,
    /// Longest wait for a whole summary request/response. Default 5 s (snapshots are MBs).
    pub sync_timeout: Duration,
    /// Idle connections close after this long (keep-alives every third of it). Default 10 s.
    pub idle_timeout: Duration,
    /// Messages queued per peer before new ones are dropped. Default 64 (chitchat retries
    /// every round anyway; a deep queue only delays fresh state).
    pub peer_queue: usize,
    /// Received gossip messages queued for chitchat before new ones are dropped. Default 1024.
    pub recv_queue: usize,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            connect_timeout: Duration::from_secs(1),
            handshake_timeout: Duration::from_secs(5),
            max_pending_handshakes: 1024,
            io_timeout: Duration::from_secs(2),
            sync_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(10),
            peer_queue: 64,
            recv_queue: 1024,
        }
    }
}

/// Errors of the transport.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// A summary request, response or block report was refused or malformed.
    #[error(transparent)]
    Sync(#[from] sync::SyncError),
    /// The UDP socket or the endpoint could not be created.
    #[error("cannot bind {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// Traffic to this peer is blocked (fault injection).
    #[error("peer {0} is blocked")]
    Blocked(SocketAddr),
    /// The QUIC connection could not be established (includes TLS rejections).
    #[error("connect to {peer}: {reason}")]
    Connect {
        /// The peer.
        peer: SocketAddr,
        /// Why.
        reason: String,
    },
    /// A stream failed.
    #[error("stream to {peer}: {reason}")]
    Stream {
        /// The peer.
        peer: SocketAddr,
        /// Why.
        reason: String,
    },
    /// An operation did not finish in time.
    #[error("{what} with {peer} timed out")]
    Timeout {
        /// The peer.
        peer: SocketAddr,
        /// The operation.
        what: &'static str,
    },
    /// The gossip socket was already opened, or the address does not match the endpoint.
    #[error("gossip socket: {0}")]
    Socket(String),
    /// The transport was closed.
    #[error("transport closed")]
    Closed,
}

/// Counters of the transport, for metrics. Monotonic.
#[derive(Debug, Default)]
pub struct TransportStats {
    /// Messages, reports or requests from peers that did not decode (dropped).
    pub malformed: AtomicU64,
    /// Streams from peers over their size limit (dropped).
    pub oversized: AtomicU64,
    /// Messages dropped because the peer is blocked (fault injection).
    pub blocked: AtomicU64,
    /// Outgoing messages dropped: peer queue full, or the peer could not be reached.
    pub send_dropped: AtomicU64,
    /// Handshakes this node dialled that failed or ran past `handshake_timeout` (includes
    /// certificate rejections by the peer). A caller that stops waiting earlier is not one.
    pub connect_failures: AtomicU64,
    /// Incoming handshakes that failed (e.g. a certificate from another CA).
    pub handshake_failures: AtomicU64,
    /// Gossip messages dropped because the sender claimed a node id its certificate does not
    /// name (the peer is then refused for [`REFUSE_FOR`]).
    pub identity_refused: AtomicU64,
    /// Gossip messages written.
    pub gossip_sent: AtomicU64,
    /// Bytes of gossip messages written (kind byte included).
    pub gossip_bytes_sent: AtomicU64,
    /// Gossip messages received and handed to chitchat.
    pub gossip_received: AtomicU64,
    /// Bytes of gossip messages received.
    pub gossip_bytes_received: AtomicU64,
    /// Block reports written.
    pub reports_sent: AtomicU64,
    /// Block reports received and handed to the handler.
    pub reports_received: AtomicU64,
    /// Summary requests answered.
    pub sync_served: AtomicU64,
    /// Bytes of summary responses written.
    pub sync_bytes_sent: AtomicU64,
    /// Load-update datagrams sent.
    pub load_sent: AtomicU64,
    /// Bytes of load-update datagrams sent (kind byte included).
    pub load_bytes_sent: AtomicU64,
    /// Load-update datagrams received and handed to the handler.
    pub load_received: AtomicU64,
    /// Bytes of load-update datagrams received.
    pub load_bytes_received: AtomicU64,
    /// Directory requests answered.
    pub directory_served: AtomicU64,
}

/// A copy of [`TransportStats`] at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// See [`TransportStats::malformed`].
    pub malformed: u64,
    /// See [`TransportStats::oversized`].
    pub oversized: u64,
    /// See [`TransportStats::blocked`].
    pub blocked: u64,
    /// See [`TransportStats::send_dropped`].
    pub send_dropped: u64,
    /// See [`TransportStats::connect_failures`].
    pub connect_failures: u64,
    /// See [`TransportStats::handshake_failures`].
    pub handshake_failures: u64,
    /// See [`TransportStats::identity_refused`].
    pub identity_refused: u64,
    /// See [`TransportStats::gossip_sent`].
    pub gossip_sent: u64,
    /// See [`TransportStats::gossip_bytes_sent`].
    pub gossip_bytes_sent: u64,
    /// See [`TransportStats::gossip_received`].
    pub gossip_received: u64,
    /// See [`TransportStats::gossip_bytes_received`].
    pub gossip_bytes_received: u64,
    /// See [`TransportStats::reports_sent`].
    pub reports_sent: u64,
    /// See [`TransportStats::reports_received`].
    pub reports_received: u64,
    /// See [`TransportStats::sync_served`].
    pub sync_served: u64,
    /// See [`TransportStats::sync_bytes_sent`].
    pub sync_bytes_sent: u64,
    /// See [`TransportStats::load_sent`].
    pub load_sent: u64,
    /// See [`TransportStats::load_bytes_sent`].
    pub load_bytes_sent: u64,
    /// See [`TransportStats::load_received`].
    pub load_received: u64,
    /// See [`TransportStats::load_bytes_received`].
    pub load_bytes_received: u64,
    /// See [`TransportStats::directory_served`].
    pub directory_served: u64,
    /// Node deltas refused whole: unsigned or forged values (see `gossip_guard`).
    pub forged_refused: u64,
    /// Signed values their publisher may not publish (region, operator role).
    pub authority_refused: u64,
    /// New keys past a member's key cap.
    pub key_cap_refused: u64,
    /// Resets of a member relayed by another, made plain deltas.
    pub reset_refused: u64,
    /// Digest entries of members no certificate was seen of, left out.
    pub digest_unknown: u64,
    /// Gossip value signatures verified.
    pub signatures_verified: u64,
    /// Every UDP byte the endpoint sent (see `udp_count`).
    pub udp_bytes_sent: u64,
    /// Every UDP byte the endpoint received.
    pub udp_bytes_received: u64,
}

impl TransportStats {
    /// The current values.
    pub fn snapshot(&self) -> StatsSnapshot {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StatsSnapshot {
            malformed: g(&self.malformed),
            oversized: g(&self.oversized),
            blocked: g(&self.blocked),
            send_dropped: g(&self.send_dropped),
            connect_failures: g(&self.connect_failures),
            handshake_failures: g(&self.handshake_failures),
            identity_refused: g(&self.identity_refused),
            gossip_sent: g(&self.gossip_sent),
            gossip_bytes_sent: g(&self.gossip_bytes_sent),
            gossip_received: g(&self.gossip_received),
            gossip_bytes_received: g(&self.gossip_bytes_received),
            reports_sent: g(&self.reports_sent),
            reports_received: g(&self.reports_received),
            sync_served: g(&self.sync_served),
            sync_bytes_sent: g(&self.sync_bytes_sent),
            load_sent: g(&self.load_sent),
            load_bytes_sent: g(&self.load_bytes_sent),
            load_received: g(&self.load_received),
            load_bytes_received: g(&self.load_bytes_received),
            directory_served: g(&self.directory_served),
            forged_refused: 0,
            authority_refused: 0,
            key_cap_refused: 0,
            reset_refused: 0,
            digest_unknown: 0,
            signatures_verified: 0,
            udp_bytes_sent: 0,
            udp_bytes_received: 0,
        }
    }
}

fn bump(a: &AtomicU64) {
    a.fetch_add(1, Ordering::Relaxed);
}

/// Lets one warning through per [`WARN_EVERY`], so a peer spraying garbage cannot flood logs.
#[derive(Debug)]
struct WarnGate {
    start: Instant,
    /// Milliseconds since `start` of the last warning, `u64::MAX` before the first.
    last_ms: AtomicU64,
}

impl WarnGate {
    fn new() -> Self {
        WarnGate {
            start: Instant::now(),
            last_ms: AtomicU64::new(u64::MAX),
        }
    }

    fn allow(&self) -> bool {
        let now = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
        let last = self.last_ms.load(Ordering::Relaxed);
        let due = last == u64::MAX || now.saturating_sub(last) >= WARN_EVERY.as_millis() as u64;
        due && self
            .last_ms
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }
}

/// One queued outgoing uni-stream message (kind byte included).
struct Outgoing {
    kind: u8,
    bytes: Vec<u8>,
}

type GossipItem = (SocketAddr, ChitchatMessage);

/// A handshake in flight to one peer, shared by every caller that wants a connection to it. It
/// runs in a task of its own, so a caller that stops waiting does not abandon it.
type Dial = Shared<BoxFuture<'static, Result<quinn::Connection, String>>>;

/// Most handshakes in flight at once (peer addresses come from gossip: the map is capped).
const MAX_DIALS: usize = 4096;

struct Inner {
    endpoint: quinn::Endpoint,
    local_addr: SocketAddr,
    cfg: TransportConfig,
    conns: Mutex<HashMap<SocketAddr, quinn::Connection>>,
    /// Handshakes in flight, one per peer at most (see `Inner::connection`).
    dials: Mutex<HashMap<SocketAddr, Dial>>,
    /// Incoming handshakes in flight (capped by `max_pending_handshakes`).
    pending_handshakes: Arc<AtomicUsize>,
    senders: Mutex<HashMap<SocketAddr, mpsc::Sender<Outgoing>>>,
    gossip_tx: mpsc::Sender<GossipItem>,
    gossip_rx: Mutex<Option<mpsc::Receiver<GossipItem>>>,
    /// Where region-layer gossip goes while this node runs a region-layer cluster.
    regions_tx: Mutex<Option<mpsc::Sender<GossipItem>>>,
    /// What this node answers directory requests with (`Mesh` refreshes it).
    directory: RwLock<Directory>,
    /// Who recently asked this node's directory for which region (the rendezvous).
    askers: Mutex<Askers>,
    /// Every UDP byte through the endpoint.
    udp: Arc<UdpBytes>,
    blocked: Mutex<HashSet<SocketAddr>>,
    /// Addresses refused for an identity mismatch, until when.
    refused: Mutex<HashMap<SocketAddr, Instant>>,
    /// Chitchat ids whose node proved its name on a direct connection (see the module doc).
    verified: Mutex<HashMap<Arc<str>, Vec<ChitchatId>>>,
    handler: RwLock<Option<Arc<dyn MeshHandler>>>,
    /// Check every value of the region's gossip, and of the region layer's, against its
    /// publisher (see `gossip_guard`); `None` until `Mesh` installs them (then for the
    /// transport's life).
    guards: RwLock<Option<Guards>>,
    stats: TransportStats,
    warn_gate: WarnGate,
}

/// Locks a std mutex, recovering from poisoning: every critical section here only inserts or
/// removes map entries, so a panicked holder cannot leave a broken invariant.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The node's QUIC endpoint: the chitchat transport, the summary-sync client and server, and
/// the block-report channel. Cheap to clone (one shared endpoint).
#[derive(Clone)]
pub struct QuicTransport {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for QuicTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicTransport")
            .field("local_addr", &self.inner.local_addr)
            .finish_non_exhaustive()
    }
}

impl QuicTransport {
    /// Binds the UDP socket at `listen` and starts accepting connections. Must run inside a
    /// tokio runtime.
    pub fn bind(
        listen: SocketAddr,
        configs: QuicConfigs,
        cfg: TransportConfig,
    ) -> Result<Self, TransportError> {
        let bind_err = |source| TransportError::Bind {
            addr: listen,
            source,
        };
        let socket = std::net::UdpSocket::bind(listen).map_err(bind_err)?;
        let runtime = quinn::default_runtime()
            .ok_or_else(|| bind_err(std::io::Error::other("no async runtime for quinn")))?;
        let udp = Arc::new(UdpBytes::default());
        let counting = CountingSocket::new(
            runtime.wrap_udp_socket(socket).map_err(bind_err)?,
            Arc::clone(&udp),
        );
        let mut endpoint = quinn::Endpoint::new_with_abstract_socket(
            quinn::EndpointConfig::default(),
            Some(configs.server),
            Arc::new(counting),
            runtime,
        )
        .map_err(bind_err)?;
        endpoint.set_default_client_config(configs.client);
        let local_addr = endpoint.local_addr().map_err(bind_err)?;
        let (gossip_tx, gossip_rx) = mpsc::channel(cfg.recv_queue.max(1));
        let inner = Arc::new(Inner {
            endpoint,
            local_addr,
            cfg,
            conns: Mutex::new(HashMap::new()),
            dials: Mutex::new(HashMap::new()),
            pending_handshakes: Arc::new(AtomicUsize::new(0)),
            senders: Mutex::new(HashMap::new()),
            gossip_tx,
            gossip_rx: Mutex::new(Some(gossip_rx)),
            regions_tx: Mutex::new(None),
            directory: RwLock::new(Directory::default()),
            askers: Mutex::new(Askers::default()),
            udp,
            blocked: Mutex::new(HashSet::new()),
            refused: Mutex::new(HashMap::new()),
            verified: Mutex::new(HashMap::new()),
            handler: RwLock::new(None),
            guards: RwLock::new(None),
            stats: TransportStats::default(),
            warn_gate: WarnGate::new(),
        });
        tokio::spawn(accept_loop(inner.clone()));
        Ok(QuicTransport { inner })
    }

    /// The bound address (the node's gossip and QUIC address).
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr
    }

    /// The counters.
    pub fn stats(&self) -> &TransportStats {
        &self.inner.stats
    }

    /// The counters now, the endpoint's UDP bytes included.
    pub fn snapshot(&self) -> StatsSnapshot {
        let mut s = self.inner.stats.snapshot();
        if let Some(g) = &*self.inner.guards.read().unwrap_or_else(|e| e.into_inner()) {
            let (r, l) = (&g.region.stats, &g.layer.stats);
            let sum = |a: &AtomicU64, b: &AtomicU64| {
                a.load(Ordering::Relaxed) + b.load(Ordering::Relaxed)
            };
            s.forged_refused = sum(&r.forged_refused, &l.forged_refused);
            s.authority_refused = sum(&r.authority_refused, &l.authority_refused);
            s.key_cap_refused = sum(&r.key_cap_refused, &l.key_cap_refused);
            s.reset_refused = sum(&r.reset_refused, &l.reset_refused);
            s.digest_unknown = sum(&r.digest_unknown, &l.digest_unknown);
            s.signatures_verified = sum(&r.verified, &l.verified);
        }
        s.udp_bytes_sent = self.inner.udp.sent.load(Ordering::Relaxed);
        s.udp_bytes_received = self.inner.udp.received.load(Ordering::Relaxed);
        s
    }

    /// Replaces what this node answers directory requests with.
    pub fn set_directory(&self, directory: Directory) {
        *self
            .inner
            .directory
            .write()
            .unwrap_or_else(|e| e.into_inner()) = directory;
    }

    /// Asks `peer` which nodes of `region` it knows (see `directory`).
    pub async fn ask_directory(
        &self,
        peer: SocketAddr,
        region: &str,
    ) -> Result<DirectoryAnswer, TransportError> {
        let body = DirectoryRequest {
            region: region.to_owned(),
        }
        .encode()?;
        let resp = self
            .inner
            .request(
                peer,
                KIND_DIRECTORY,
                &body,
                directory::MAX_DIRECTORY_ANSWER_BYTES,
            )
            .await?;
        Ok(DirectoryAnswer::decode(&resp)?)
    }

    /// The region layer's side of the endpoint: a chitchat transport whose messages travel as
    /// [`KIND_REGIONS_Z`]. Each `open` replaces the previous socket (a node stops and starts
    /// its region-layer cluster as it stops and becomes a representative).
    pub fn regions_layer(&self) -> RegionsTransport {
        RegionsTransport {
            transport: self.clone(),
        }
    }

    /// Installs the handler that answers summary requests and receives block reports.
    pub fn set_handler(&self, handler: Arc<dyn MeshHandler>) {
        *self
            .inner
            .handler
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Some(handler);
    }

    /// Installs the gates every gossip message's values pass before chitchat sees them: `region`
    /// for the region's gossip, `layer` for the region layer's (see `gossip_guard`).
    pub fn set_guards(&self, region: Arc<Guard>, layer: Arc<Guard>) {
        *self.inner.guards.write().unwrap_or_else(|e| e.into_inner()) =
            Some(Guards { region, layer });
    }

    /// Fault injection: drops all traffic to and from `peer` (gossip, reports, sync) until
    /// [`QuicTransport::unblock`]. Block on both sides for a symmetric partition.
    pub fn block(&self, peer: SocketAddr) {
        lock(&self.inner.blocked).insert(peer);
    }

    /// Ends [`QuicTransport::block`] for `peer`.
    pub fn unblock(&self, peer: SocketAddr) {
        lock(&self.inner.blocked).remove(&peer);
    }

    /// Whether the node of `id` proved its name: a gossip message it sent from its advertised
    /// address, on a connection whose certificate names `id.node_id`.
    pub fn is_verified(&self, id: &ChitchatId) -> bool {
        lock(&self.inner.verified)
            .get(&id.node_id)
            .is_some_and(|ids| ids.contains(id))
    }

    /// Forgets verified ids for which `keep` is false (chitchat forgot the node).
    pub fn retain_verified(&self, keep: impl Fn(&ChitchatId) -> bool) {
        lock(&self.inner.verified).retain(|_, ids| {
            ids.retain(|id| keep(id));
            !ids.is_empty()
        });
    }

    /// Whether `peer` is refused now for an identity mismatch.
    pub fn is_refused(&self, peer: SocketAddr) -> bool {
        self.inner.is_refused(peer)
    }

    /// Smoothed RTT of the live connection to `peer`, if there is one.
    pub fn rtt(&self, peer: SocketAddr) -> Option<Duration> {
        self.inner.cached(peer).map(|c| c.rtt())
    }

    /// Smoothed RTT of every live connection, by peer address.
    pub fn rtts(&self) -> HashMap<SocketAddr, Duration> {
        lock(&self.inner.conns)
            .iter()
            .filter(|(_, c)| c.close_reason().is_none())
            .map(|(a, c)| (*a, c.rtt()))
            .collect()
    }

    /// Queues a block report for `peer` (fire-and-forget). Errors only on a report that cannot
    /// be encoded; delivery failures are counted in [`TransportStats::send_dropped`].
    pub fn send_report(
        &self,
        peer: SocketAddr,
        report: &sync::BlockReport,
    ) -> Result<(), TransportError> {
        let body = report.encode()?;
        let mut bytes = Vec::with_capacity(body.len() + 1);
        bytes.push(KIND_BLOCK_REPORT);
        bytes.extend_from_slice(&body);
        self.inner.enqueue(
            peer,
            Outgoing {
                kind: KIND_BLOCK_REPORT,
                bytes,
            },
        );
        Ok(())
    }

    /// Sends a load update (already encoded) to `peer` as one datagram: at once on a live
    /// connection, else through the peer's sender task, which dials. Fire-and-forget; losses are
    /// repaired by the next update (see `load_share`).
    pub fn send_load(&self, peer: SocketAddr, update: &[u8]) {
        if update.len() > MAX_LOAD_UPDATE_BYTES {
            bump(&self.inner.stats.send_dropped);
            return;
        }
        let mut bytes = Vec::with_capacity(update.len() + 1);
        bytes.push(KIND_LOAD_UPDATE);
        bytes.extend_from_slice(update);
        if self.inner.is_blocked(peer) {
            bump(&self.inner.stats.blocked);
            return;
        }
        match self.inner.cached(peer) {
            Some(conn) => send_datagram(&self.inner, &conn, bytes),
            None => self.inner.enqueue(
                peer,
                Outgoing {
                    kind: KIND_LOAD_UPDATE,
                    bytes,
                },
            ),
        }
    }

    /// Asks `peer` for the summary of a replica (see `sync` for the exchange).
    pub async fn fetch_summary(
        &self,
        peer: SocketAddr,
        req: &sync::SummaryRequest,
    ) -> Result<crate::core::summary::SummaryMessage, TransportError> {
        let body = req.encode()?;
        let resp = self
            .inner
            .request(peer, KIND_SUMMARY_REQUEST, &body, sync::MAX_RESPONSE_BYTES)
            .await?;
        Ok(sync::parse_response(&resp)?)
    }

    /// Closes the endpoint: every connection is closed and every task of this transport ends.
    pub fn close(&self) {
        self.inner.endpoint.close(0u32.into(), b"shutdown");
        lock(&self.inner.conns).clear();
        lock(&self.inner.senders).clear();
    }
}

impl Inner {
    /// Blocked by fault injection, or refused for an identity mismatch.
    fn is_blocked(&self, peer: SocketAddr) -> bool {
        let blocked = lock(&self.blocked).contains(&peer);
        blocked || self.is_refused(peer)
    }

    fn is_refused(&self, peer: SocketAddr) -> bool {
        let mut refused = lock(&self.refused);
        match refused.get(&peer) {
            Some(until) if *until > Instant::now() => true,
            Some(_) => {
                refused.remove(&peer);
                false
            }
            None => false,
        }
    }

    /// Refuses `peer` for [`REFUSE_FOR`] and closes its connection.
    fn refuse(&self, peer: SocketAddr, conn: &quinn::Connection) {
        {
            let mut refused = lock(&self.refused);
            let now = Instant::now();
            if refused.len() >= MAX_REFUSED {
                refused.retain(|_, until| *until > now);
            }
            if refused.len() >= MAX_REFUSED {
                if let Some(oldest) = refused.iter().min_by_key(|(_, u)| **u).map(|(a, _)| *a) {
                    refused.remove(&oldest);
                }
            }
            refused.insert(peer, now + REFUSE_FOR);
        }
        conn.close(1u32.into(), b"node id not named by the certificate");
        let mut conns = lock(&self.conns);
        if conns
            .get(&peer)
            .is_some_and(|c| c.stable_id() == conn.stable_id())
        {
            conns.remove(&peer);
        }
    }

    /// Checks a gossip message's identity claims against the certificate's `names` (see the
    /// module doc). Returns false when the message must be dropped.
    fn check_identity(&self, peer: SocketAddr, names: &[String], body: &[u8]) -> bool {
        match identity_verdict(peer, names, digest_ids(body)) {
            Ok(named) => {
                if !named.is_empty() {
                    let mut verified = lock(&self.verified);
                    for id in named {
                        remember_verified(&mut verified, id);
                    }
                }
                true
            }
            Err(claims) => {
                bump(&self.stats.identity_refused);
                let claims: Vec<&str> = claims.iter().map(|id| &*id.node_id).collect();
                self.warn(
                    "gossip message",
                    peer,
                    &format!("it claims node id {claims:?} but its certificate names {names:?}; peer refused for {REFUSE_FOR:?}"),
                );
                false
            }
        }
    }

    fn warn(&self, what: &str, peer: SocketAddr, detail: &dyn std::fmt::Display) {
        if self.warn_gate.allow() {
            let s = self.stats.snapshot();
            warn!(%peer, malformed = s.malformed, oversized = s.oversized,
                "dropped {what}: {detail} (further drops within {WARN_EVERY:?} are only counted)");
        } else {
            debug!(%peer, "dropped {what}: {detail}");
        }
    }

    /// The live cached connection to `peer`; forgets a closed one.
    fn cached(&self, peer: SocketAddr) -> Option<quinn::Connection> {
        let mut conns = lock(&self.conns);
        match conns.get(&peer) {
            Some(c) if c.close_reason().is_none() => Some(c.clone()),
            Some(_) => {
                conns.remove(&peer);
                None
            }
            None => None,
        }
    }

    /// The connection to `peer`, dialing when there is none. The caller waits at most
    /// `connect_timeout`; the handshake goes on in its own task for up to `handshake_timeout`,
    /// and callers meanwhile join it rather than dial again. Under load (a hundred nodes
    /// starting on two cores) handshakes take longer than a caller waits: dropping each one at
    /// the caller's timeout and dialling again made every handshake's work, on both sides, go
    /// to waste, and kept the seeds busiest exactly when every node needs them.
    async fn connection(
        self: &Arc<Self>,
        peer: SocketAddr,
    ) -> Result<quinn::Connection, TransportError> {
        if let Some(c) = self.cached(peer) {
            return Ok(c);
        }
        let dial = self.dial(peer)?;
        match timeout(self.cfg.connect_timeout, dial).await {
            Err(_) => Err(TransportError::Timeout {
                peer,
                what: "connect",
            }),
            Ok(Err(reason)) => Err(TransportError::Connect { peer, reason }),
            Ok(Ok(c)) => Ok(c),
        }
    }

    /// The handshake in flight to `peer`, started when there is none. The task caches the
    /// connection (and serves it) when it completes, then leaves the map.
    fn dial(self: &Arc<Self>, peer: SocketAddr) -> Result<Dial, TransportError> {
        let mut dials = lock(&self.dials);
        if let Some(d) = dials.get(&peer) {
            return Ok(d.clone());
        }
        if dials.len() >= MAX_DIALS {
            return Err(TransportError::Connect {
                peer,
                reason: format!("{MAX_DIALS} handshakes already in flight"),
            });
        }
        let connecting =
            self.endpoint
                .connect(peer, CLUSTER_SAN)
                .map_err(|e| TransportError::Connect {
                    peer,
                    reason: e.to_string(),
                })?;
        let inner = Arc::clone(self);
        // The task removes its entry under the same lock, so not before it was inserted below.
        let task = tokio::spawn(async move {
            let result = match timeout(inner.cfg.handshake_timeout, connecting).await {
                Err(_) => Err("handshake timed out".to_owned()),
                Ok(Err(e)) => Err(e.to_string()),
                Ok(Ok(c)) => Ok(c),
            };
            match &result {
                Ok(conn) => {
                    lock(&inner.conns).insert(peer, conn.clone());
                    tokio::spawn(serve_connection(Arc::clone(&inner), conn.clone()));
                }
                Err(_) => bump(&inner.stats.connect_failures),
            }
            lock(&inner.dials).remove(&peer);
            result
        });
        let dial = async move { task.await.unwrap_or_else(|e| Err(e.to_string())) }
            .boxed()
            .shared();
        dials.insert(peer, dial.clone());
        Ok(dial)
    }

    /// Queues `out` on `peer`'s sender task, starting one if needed. Never waits.
    fn enqueue(self: &Arc<Self>, peer: SocketAddr, out: Outgoing) {
        if self.is_blocked(peer) {
            bump(&self.stats.blocked);
            return;
        }
        let mut senders = lock(&self.senders);
        let out = match senders.get(&peer) {
            Some(tx) => match tx.try_send(out) {
                Ok(()) => return,
                Err(mpsc::error::TrySendError::Full(_)) => {
                    bump(&self.stats.send_dropped);
                    return;
                }
                Err(mpsc::error::TrySendError::Closed(out)) => out,
            },
            None => out,
        };
        let (tx, rx) = mpsc::channel(self.cfg.peer_queue.max(1));
        // A fresh channel has room for one message.
        let _ = tx.try_send(out);
        senders.insert(peer, tx);
        tokio::spawn(peer_sender(self.clone(), peer, rx));
    }

    /// One request/response exchange on a new bidi stream.
    async fn request(
        self: &Arc<Self>,
        peer: SocketAddr,
        kind: u8,
        body: &[u8],
        max_response: usize,
    ) -> Result<Vec<u8>, TransportError> {
        if self.is_blocked(peer) {
            bump(&self.stats.blocked);
            return Err(TransportError::Blocked(peer));
        }
        let conn = self.connection(peer).await?;
        let stream_err = |e: &dyn std::fmt::Display| TransportError::Stream {
            peer,
            reason: e.to_string(),
        };
        let exchange = async {
            let (mut send, mut recv) = conn.open_bi().await.map_err(|e| stream_err(&e))?;
            send.write_all(&[kind]).await.map_err(|e| stream_err(&e))?;
            send.write_all(body).await.map_err(|e| stream_err(&e))?;
            send.finish().map_err(|e| stream_err(&e))?;
            recv.read_to_end(max_response)
                .await
                .map_err(|e| stream_err(&e))
        };
        let resp = timeout(self.cfg.sync_timeout, exchange)
            .await
            .map_err(|_| TransportError::Timeout {
                peer,
                what: "request",
            })??;
        if self.is_blocked(peer) {
            bump(&self.stats.blocked);
            return Err(TransportError::Blocked(peer));
        }
        Ok(resp)
    }
}

fn send_datagram(inner: &Inner, conn: &quinn::Connection, bytes: Vec<u8>) {
    let len = bytes.len() as u64;
    match conn.send_datagram(bytes.into()) {
        Ok(()) => {
            bump(&inner.stats.load_sent);
            inner
                .stats
                .load_bytes_sent
                .fetch_add(len, Ordering::Relaxed);
        }
        Err(e) => {
            bump(&inner.stats.send_dropped);
            debug!(peer = %conn.remote_address(), error = %e, "datagram not sent");
        }
    }
}

async fn write_uni(conn: &quinn::Connection, bytes: &[u8]) -> Result<(), String> {
    let mut s = conn.open_uni().await.map_err(|e| e.to_string())?;
    s.write_all(bytes).await.map_err(|e| e.to_string())?;
    s.finish().map_err(|e| e.to_string())
}

/// Writes `peer`'s queued messages in order; exits when idle.
async fn peer_sender(inner: Arc<Inner>, peer: SocketAddr, mut rx: mpsc::Receiver<Outgoing>) {
    loop {
        let out = match timeout(PEER_IDLE, rx.recv()).await {
            Ok(Some(out)) => out,
            Ok(None) => return,
            Err(_) => {
                let mut senders = lock(&inner.senders);
                // Remove ourselves under the lock only if nothing raced in meanwhile.
                if rx.is_empty() {
                    senders.remove(&peer);
                    return;
                }
                continue;
            }
        };
        if inner.is_blocked(peer) {
            bump(&inner.stats.blocked);
            continue;
        }
        let conn = match inner.connection(peer).await {
            Ok(c) => c,
            Err(e) => {
                // The peer is unreachable now: what is queued is stale by the time it would be
                // (chitchat will send fresh state next round), so drop it rather than dial again
                // for every message.
                let mut dropped = 1;
                while rx.try_recv().is_ok() {
                    dropped += 1;
                }
                inner
                    .stats
                    .send_dropped
                    .fetch_add(dropped, Ordering::Relaxed);
                debug!(%peer, error = %e, dropped, "peer unreachable");
                continue;
            }
        };
        if out.kind == KIND_LOAD_UPDATE {
            send_datagram(&inner, &conn, out.bytes);
            continue;
        }
        match timeout(inner.cfg.io_timeout, write_uni(&conn, &out.bytes)).await {
            Ok(Ok(())) => match out.kind {
                KIND_GOSSIP | KIND_GOSSIP_Z | KIND_REGIONS_Z => {
                    bump(&inner.stats.gossip_sent);
                    inner
                        .stats
                        .gossip_bytes_sent
                        .fetch_add(out.bytes.len() as u64, Ordering::Relaxed);
                }
                _ => bump(&inner.stats.reports_sent),
            },
            Ok(Err(e)) => {
                bump(&inner.stats.send_dropped);
                debug!(%peer, error = %e, "write failed");
            }
            Err(_) => {
                bump(&inner.stats.send_dropped);
                debug!(%peer, "write timed out");
            }
        }
    }
}

async fn accept_loop(inner: Arc<Inner>) {
    while let Some(incoming) = inner.endpoint.accept().await {
        let peer = incoming.remote_address();
        if inner.is_blocked(peer) {
            bump(&inner.stats.blocked);
            incoming.ignore();
            continue;
        }
        // Anyone can start a handshake (the certificate is checked at its end), and each one
        // waits up to `handshake_timeout`: a flood must not grow without bound.
        let pending = Arc::clone(&inner.pending_handshakes);
        if pending.fetch_add(1, Ordering::Relaxed) >= inner.cfg.max_pending_handshakes {
            pending.fetch_sub(1, Ordering::Relaxed);
            bump(&inner.stats.handshake_failures);
            inner.warn(
                "incoming connection",
                peer,
                &"too many handshakes in flight",
            );
            incoming.refuse();
            continue;
        }
        let inner = inner.clone();
        tokio::spawn(async move {
            let handshake = timeout(inner.cfg.handshake_timeout, incoming).await;
            pending.fetch_sub(1, Ordering::Relaxed);
            match handshake {
                Ok(Ok(conn)) => {
                    // The newest connection from a peer is the one to send on: a peer dials
                    // only when it holds no live connection to this node, so one still cached
                    // here is either a simultaneous dial (both stay served, either works) or
                    // a dead incarnation's (the peer restarted on the same address; its new
                    // endpoint drops that connection's packets without a reset this node can
                    // check, so it would look live until its idle timeout: 10 s of gossip to
                    // nowhere). Both connections keep being served until they close.
                    lock(&inner.conns).insert(peer, conn.clone());
                    serve_connection(inner, conn).await;
                }
                Ok(Err(e)) => {
                    bump(&inner.stats.handshake_failures);
                    inner.warn("incoming connection", peer, &e);
                }
                Err(_) => {
                    bump(&inner.stats.handshake_failures);
                    inner.warn("incoming connection", peer, &"handshake timed out");
                }
            }
        });
    }
}

/// The gossip gates: one per chitchat cluster a node takes part in.
struct Guards {
    /// The region's (or, flat, the mesh's) cluster.
    region: Arc<Guard>,
    /// The region layer's (representatives of every region).
    layer: Arc<Guard>,
}

/// Adds `id` to the verified ids, keeping each node id's [`VERIFIED_GENERATIONS`] newest.
fn remember_verified(verified: &mut HashMap<Arc<str>, Vec<ChitchatId>>, id: ChitchatId) {
    if !verified.contains_key(&id.node_id) && verified.len() >= MAX_VERIFIED {
        // Only as many node ids as the CA issued names can get here; past the cap (a CA that
        // issued more), start over rather than grow.
        verified.clear();
    }
    let ids = verified.entry(Arc::clone(&id.node_id)).or_default();
    if ids.contains(&id) {
        return;
    }
    ids.push(id);
    if ids.len() > VERIFIED_GENERATIONS {
        ids.sort_unstable_by_key(|i| std::cmp::Reverse(i.generation_id));
        ids.truncate(VERIFIED_GENERATIONS);
    }
}

/// The identity rule (module doc) for a message from `peer` whose certificate names `names` and
/// whose digest lists `ids`: `Ok` with the ids it proves (advertised at `peer`, named by the
/// certificate), or `Err` with what it claimed at `peer` when none of that is named.
fn identity_verdict(
    peer: SocketAddr,
    names: &[String],
    ids: Vec<ChitchatId>,
) -> Result<Vec<ChitchatId>, Vec<ChitchatId>> {
    let here: Vec<ChitchatId> = ids
        .into_iter()
        .filter(|id| same_addr(id.gossip_advertise_addr, peer))
        .collect();
    if here.is_empty() {
        return Ok(Vec::new());
    }
    let (named, other): (Vec<ChitchatId>, Vec<ChitchatId>) = here
        .into_iter()
        .partition(|id| names.iter().any(|n| **n == *id.node_id));
    if named.is_empty() {
        Err(other)
    } else {
        Ok(named)
    }
}

/// Two addresses equal once IPv4-mapped IPv6 is read as IPv4.
fn same_addr(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port() && a.ip().to_canonical() == b.ip().to_canonical()
}

/// The chitchat ids listed in the digest of a serialized Syn or SynAck (empty for other
/// messages, or bytes that do not parse: chitchat has decoded the message already by then).
/// Layout (chitchat 0.11.2, protocol V0): magic u16, version u8, message type u8 (0 Syn,
/// 1 SynAck), then the digest: u16 count, then per node its id and three u64s.
fn digest_ids(body: &[u8]) -> Vec<ChitchatId> {
    let Some(&kind) = body.get(3) else {
        return Vec::new();
    };
    if kind > 1 {
        return Vec::new();
    }
    let mut buf = &body[4..];
    let Ok(n) = u16::deserialize(&mut buf) else {
        return Vec::new();
    };
    let mut out = Vec::with_capacity(usize::from(n).min(1024));
    for _ in 0..n {
        let Ok(id) = ChitchatId::deserialize(&mut buf) else {
            break;
        };
        let skipped = (0..3).all(|_| u64::deserialize(&mut buf).is_ok());
        out.push(id);
        if !skipped {
            break;
        }
    }
    out
}

/// The node names of the peer's certificate on `conn`.
fn peer_names(conn: &quinn::Connection) -> Arc<[String]> {
    conn.peer_identity()
        .and_then(|any| {
            any.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
                .ok()
        })
        .and_then(|chain| chain.first().map(certs::node_names))
        .unwrap_or_default()
        .into()
}

/// Reads every stream a peer opens on `conn` until it closes.
async fn serve_connection(inner: Arc<Inner>, conn: quinn::Connection) {
    let peer = conn.remote_address();
    let names = peer_names(&conn);
    loop {
        tokio::select! {
            uni = conn.accept_uni() => match uni {
                Ok(recv) => {
                    tokio::spawn(read_uni(inner.clone(), conn.clone(), names.clone(), recv));
                }
                Err(_) => break,
            },
            bi = conn.accept_bi() => match bi {
                Ok((send, recv)) => { tokio::spawn(serve_bi(inner.clone(), peer, send, recv)); }
                Err(_) => break,
            },
            dg = conn.read_datagram() => match dg {
                Ok(bytes) => read_datagram(&inner, peer, &bytes),
                Err(_) => break,
            },
        }
    }
    let mut conns = lock(&inner.conns);
    if conns
        .get(&peer)
        .is_some_and(|c| c.stable_id() == conn.stable_id())
    {
        conns.remove(&peer);
    }
}

/// Reads a stream's kind byte, then the rest up to `limit(kind)` bytes. `None` when the stream
/// was dropped (counted).
async fn read_stream(
    inner: &Inner,
    peer: SocketAddr,
    recv: &mut quinn::RecvStream,
    limit: impl Fn(u8) -> Option<usize>,
) -> Option<(u8, Vec<u8>)> {
    let read = async {
        let mut kind = [0u8; 1];
        recv.read_exact(&mut kind)
            .await
            .map_err(|e| (false, e.to_string()))?;
        let Some(max) = limit(kind[0]) else {
            return Err((true, format!("unknown stream kind {:#04x}", kind[0])));
        };
        match recv.read_to_end(max).await {
            Ok(body) => Ok((kind[0], body)),
            Err(quinn::ReadToEndError::TooLong) => {
                bump(&inner.stats.oversized);
                Err((false, format!("stream over {max} bytes")))
            }
            Err(e) => Err((false, e.to_string())),
        }
    };
    match timeout(inner.cfg.io_timeout, read).await {
        Ok(Ok(x)) => Some(x),
        Ok(Err((malformed, reason))) => {
            if malformed {
                bump(&inner.stats.malformed);
            }
            let _ = recv.stop(0u32.into());
            inner.warn("stream", peer, &reason);
            None
        }
        Err(_) => {
            let _ = recv.stop(0u32.into());
            inner.warn("stream", peer, &"read timed out");
            None
        }
    }
}

/// A datagram from `peer`: a kind byte, then a load update (the only datagram kind).
fn read_datagram(inner: &Inner, peer: SocketAddr, bytes: &[u8]) {
    if inner.is_blocked(peer) {
        bump(&inner.stats.blocked);
        return;
    }
    let decoded = match bytes.split_first() {
        Some((&KIND_LOAD_UPDATE, body)) => LoadUpdate::decode(body).map_err(|e| e.to_string()),
        Some((kind, _)) => Err(format!("unknown datagram kind {kind:#04x}")),
        None => Err("empty datagram".to_owned()),
    };
    match decoded {
        Ok(update) => {
            bump(&inner.stats.load_received);
            inner
                .stats
                .load_bytes_received
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
            let handler = inner
                .handler
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            if let Some(h) = handler {
                h.load_update(peer, update);
            }
        }
        Err(e) => {
            bump(&inner.stats.malformed);
            inner.warn("datagram", peer, &e);
        }
    }
}

async fn read_uni(
    inner: Arc<Inner>,
    conn: quinn::Connection,
    names: Arc<[String]>,
    mut recv: quinn::RecvStream,
) {
    let peer = conn.remote_address();
    let limit = |kind| match kind {
        KIND_GOSSIP | KIND_GOSSIP_Z | KIND_REGIONS_Z => Some(MAX_GOSSIP_BYTES),
        KIND_BLOCK_REPORT => Some(sync::MAX_REPORT_BYTES),
        _ => None,
    };
    let Some((kind, body)) = read_stream(&inner, peer, &mut recv, limit).await else {
        return;
    };
    if inner.is_blocked(peer) {
        bump(&inner.stats.blocked);
        return;
    }
    if matches!(kind, KIND_GOSSIP | KIND_GOSSIP_Z | KIND_REGIONS_Z) {
        read_gossip(&inner, &conn, &names, kind, body);
    } else {
        match sync::BlockReport::decode(&body) {
            Ok(report) => {
                bump(&inner.stats.reports_received);
                let handler = inner
                    .handler
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                if let Some(h) = handler {
                    h.block_report(peer, report);
                }
            }
            Err(e) => {
                bump(&inner.stats.malformed);
                inner.warn("block report", peer, &e);
            }
        }
    }
}

/// A gossip message's body (kind byte read): unpacked, decoded, its sender's identity and its
/// values checked (by its cluster's gate), then handed to chitchat or the region layer.
fn read_gossip(inner: &Inner, conn: &quinn::Connection, names: &[String], kind: u8, body: Vec<u8>) {
    let peer = conn.remote_address();
    let wire_len = body.len() as u64 + 1;
    let body = if kind == KIND_GOSSIP {
        body
    } else {
        match unzstd(&body) {
            Ok(b) => b,
            Err(e) => {
                bump(&inner.stats.malformed);
                inner.warn("gossip message", peer, &e);
                return;
            }
        }
    };
    let mut buf = body.as_slice();
    let msg = match ChitchatMessage::deserialize(&mut buf) {
        Ok(msg) if buf.is_empty() => msg,
        Ok(_) => {
            bump(&inner.stats.malformed);
            inner.warn("gossip message", peer, &"trailing bytes");
            return;
        }
        Err(e) => {
            bump(&inner.stats.malformed);
            inner.warn("gossip message", peer, &e);
            return;
        }
    };
    if !inner.check_identity(peer, names, &body) {
        inner.refuse(peer, conn);
        return;
    }
    let Some(msg) = guarded(inner, peer, names, (kind, &body), msg) else {
        return;
    };
    bump(&inner.stats.gossip_received);
    inner
        .stats
        .gossip_bytes_received
        .fetch_add(wire_len, Ordering::Relaxed);
    let sent = if kind == KIND_REGIONS_Z {
        let tx = lock(&inner.regions_tx).clone();
        // Not a representative now: the sender's view is a round old; drop it.
        tx.is_some_and(|tx| tx.try_send((peer, msg)).is_ok())
    } else {
        inner.gossip_tx.try_send((peer, msg)).is_ok()
    };
    if !sent {
        // chitchat is behind or gone; gossip is periodic, so dropping is safe.
        debug!(%peer, me = %inner.local_addr, kind, "gossip receive queue full (or no region layer here)");
    }
}

/// `msg` as chitchat may see it: its values checked by its cluster's gate (once installed),
/// rebuilt without what was refused. `None`: drop it.
fn guarded(
    inner: &Inner,
    peer: SocketAddr,
    names: &[String],
    (kind, body): (u8, &[u8]),
    msg: ChitchatMessage,
) -> Option<ChitchatMessage> {
    let guard = inner
        .guards
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .map(|g| {
            if kind == KIND_REGIONS_Z {
                Arc::clone(&g.layer)
            } else {
                Arc::clone(&g.region)
            }
        });
    let Some(guard) = guard else {
        return Some(msg);
    };
    match guard.filter(body, names) {
        Filtered::Unchanged => Some(msg),
        Filtered::Rewritten(kept) => {
            inner.warn(
                "gossip values",
                peer,
                &"unsigned, forged or unauthorised values, or a relayed reset (see kvmesh_mesh_dropped_total)",
            );
            let mut buf = kept.as_slice();
            match ChitchatMessage::deserialize(&mut buf) {
                Ok(m) if buf.is_empty() => Some(m),
                _ => {
                    bump(&inner.stats.malformed);
                    None
                }
            }
        }
        Filtered::Malformed(e) => {
            bump(&inner.stats.malformed);
            inner.warn("gossip message", peer, &e);
            None
        }
    }
}

async fn serve_bi(
    inner: Arc<Inner>,
    peer: SocketAddr,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) {
    let limit = |kind| match kind {
        KIND_SUMMARY_REQUEST => Some(sync::MAX_REQUEST_BYTES),
        KIND_DIRECTORY => Some(directory::MAX_DIRECTORY_REQUEST_BYTES),
        _ => None,
    };
    let Some((kind, body)) = read_stream(&inner, peer, &mut recv, limit).await else {
        let _ = send.reset(0u32.into());
        return;
    };
    if inner.is_blocked(peer) {
        bump(&inner.stats.blocked);
        let _ = send.reset(0u32.into());
        return;
    }
    if kind == KIND_DIRECTORY {
        answer_directory(&inner, peer, send, &body).await;
        return;
    }
    let handler = inner
        .handler
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let (resp, malformed) = sync::answer(handler.as_deref(), &body);
    if malformed {
        bump(&inner.stats.malformed);
        inner.warn("summary request", peer, &"undecodable request");
    }
    let write = async {
        send.write_all(&resp).await.map_err(|e| e.to_string())?;
        send.finish().map_err(|e| e.to_string())
    };
    match timeout(inner.cfg.sync_timeout, write).await {
        Ok(Ok(())) => {
            bump(&inner.stats.sync_served);
            inner
                .stats
                .sync_bytes_sent
                .fetch_add(resp.len() as u64, Ordering::Relaxed);
        }
        Ok(Err(e)) => debug!(%peer, error = %e, "summary response failed"),
        Err(_) => debug!(%peer, "summary response timed out"),
    }
}

/// Answers a directory request from `peer` (a malformed one gets a reset stream).
async fn answer_directory(
    inner: &Inner,
    peer: SocketAddr,
    mut send: quinn::SendStream,
    body: &[u8],
) {
    let resp = DirectoryRequest::decode(body).and_then(|req| {
        let mut ans = inner
            .directory
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .answer(&req);
        // The directory's own members first; recent askers of the region fill the room left.
        let room = directory::MAX_DIRECTORY_PEERS.saturating_sub(ans.peers.len());
        let askers = inner.askers.lock().unwrap_or_else(|e| e.into_inner()).ask(
            &req.region,
            peer,
            Instant::now(),
            room,
        );
        for a in askers {
            if !ans.peers.contains(&a) {
                ans.peers.push(a);
            }
        }
        ans.encode()
    });
    let resp = match resp {
        Ok(r) => r,
        Err(e) => {
            bump(&inner.stats.malformed);
            inner.warn("directory request", peer, &e);
            let _ = send.reset(0u32.into());
            return;
        }
    };
    let write = async {
        send.write_all(&resp).await.map_err(|e| e.to_string())?;
        send.finish().map_err(|e| e.to_string())
    };
    match timeout(inner.cfg.io_timeout, write).await {
        Ok(Ok(())) => bump(&inner.stats.directory_served),
        Ok(Err(e)) => debug!(%peer, error = %e, "directory answer failed"),
        Err(_) => debug!(%peer, "directory answer timed out"),
    }
}

thread_local! {
    // A zstd context is hundreds of KiB to set up: one per thread, reused by every message
    // (a profile of an idle node showed context creation at a tenth of its CPU).
    static ZSTD_C: std::cell::RefCell<Option<zstd::bulk::Compressor<'static>>> =
        const { std::cell::RefCell::new(None) };
    static ZSTD_D: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

/// Compresses one gossip message with this thread's context.
fn zstd_gossip(plain: &[u8]) -> std::io::Result<Vec<u8>> {
    ZSTD_C.with(|c| {
        let mut c = c.borrow_mut();
        if c.is_none() {
            *c = Some(zstd::bulk::Compressor::new(GOSSIP_ZSTD_LEVEL)?);
        }
        match c.as_mut() {
            Some(c) => c.compress(plain),
            None => Err(std::io::Error::other("no zstd context")),
        }
    })
}

/// Decompresses one gossip message (at most [`MAX_GOSSIP_BYTES`]) with this thread's context.
fn unzstd(packed: &[u8]) -> std::io::Result<Vec<u8>> {
    ZSTD_D.with(|d| {
        let mut d = d.borrow_mut();
        if d.is_none() {
            *d = Some(zstd::bulk::Decompressor::new()?);
        }
        match d.as_mut() {
            Some(d) => d.decompress(packed, MAX_GOSSIP_BYTES),
            None => Err(std::io::Error::other("no zstd context")),
        }
    })
}

/// The region layer's chitchat transport (see [`QuicTransport::regions_layer`]).
#[derive(Clone, Debug)]
pub struct RegionsTransport {
    transport: QuicTransport,
}

#[async_trait]
impl Transport for RegionsTransport {
    async fn open(&self, listen_addr: SocketAddr) -> anyhow::Result<Box<dyn Socket>> {
        let inner = &self.transport.inner;
        if listen_addr != inner.local_addr {
            return Err(TransportError::Socket(format!(
                "chitchat listens on {listen_addr} but the endpoint is bound to {}",
                inner.local_addr
            ))
            .into());
        }
        let (tx, rx) = mpsc::channel(inner.cfg.recv_queue.max(1));
        *lock(&inner.regions_tx) = Some(tx);
        Ok(Box::new(GossipSocket {
            transport: self.transport.clone(),
            rx,
            kind: KIND_REGIONS_Z,
        }))
    }
}

/// The chitchat side of the transport: `open` hands chitchat a socket over this endpoint.
#[async_trait]
impl Transport for QuicTransport {
    async fn open(&self, listen_addr: SocketAddr) -> anyhow::Result<Box<dyn Socket>> {
        if listen_addr != self.inner.local_addr {
            return Err(TransportError::Socket(format!(
                "chitchat listens on {listen_addr} but the endpoint is bound to {}",
                self.inner.local_addr
            ))
            .into());
        }
        let rx = lock(&self.inner.gossip_rx)
            .take()
            .ok_or_else(|| TransportError::Socket("already opened".into()))?;
        Ok(Box::new(GossipSocket {
            transport: self.clone(),
            rx,
            kind: KIND_GOSSIP_Z,
        }))
    }
}

/// chitchat's socket: sends are queued per peer, receives come from every connection's readers.
struct GossipSocket {
    transport: QuicTransport,
    rx: mpsc::Receiver<GossipItem>,
    /// [`KIND_GOSSIP_Z`] or [`KIND_REGIONS_Z`]: which cluster this socket carries.
    kind: u8,
}

#[async_trait]
impl Socket for GossipSocket {
    async fn send(&mut self, to: SocketAddr, msg: ChitchatMessage) -> anyhow::Result<()> {
        let mut plain = Vec::with_capacity(msg.serialized_len());
        msg.serialize(&mut plain);
        let packed = zstd_gossip(&plain)
            .map_err(|e| TransportError::Socket(format!("compressing gossip: {e}")))?;
        let mut bytes = Vec::with_capacity(packed.len() + 1);
        bytes.push(self.kind);
        bytes.extend_from_slice(&packed);
        self.transport.inner.enqueue(
            to,
            Outgoing {
                kind: self.kind,
                bytes,
            },
        );
        Ok(())
    }

    async fn recv(&mut self) -> anyhow::Result<(SocketAddr, ChitchatMessage)> {
        self.rx
            .recv()
            .await
            .ok_or_else(|| TransportError::Closed.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_node_id_keeps_its_newest_verified_generations_only() {
        let mut v = HashMap::new();
        let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
        remember_verified(&mut v, ChitchatId::new("b".to_owned(), 1, addr));
        for generation in [3, 1, 5, 2, 4] {
            remember_verified(&mut v, ChitchatId::new("m".to_owned(), generation, addr));
        }
        let gens: Vec<u64> = v["m"].iter().map(|i| i.generation_id).collect();
        assert_eq!(gens, vec![5, 4]);
        // Another node's proof stands.
        assert_eq!(v["b"], vec![ChitchatId::new("b".to_owned(), 1, addr)]);
    }

    fn bound(ca: &certs::ClusterCa, name: &str, cfg: TransportConfig) -> QuicTransport {
        let quic = ca
            .issue(name)
            .unwrap()
            .quic_configs(Duration::from_secs(10))
            .unwrap();
        QuicTransport::bind("127.0.0.1:0".parse().unwrap(), quic, cfg).unwrap()
    }

    /// A caller that stops waiting does not abandon the handshake: it completes in its own
    /// task, is cached, and the next caller uses it without dialling again.
    #[tokio::test]
    async fn a_dial_outlives_the_caller_that_stopped_waiting_for_it() {
        let ca = certs::ClusterCa::generate().unwrap();
        let server = bound(&ca, "server", TransportConfig::default());
        let impatient = TransportConfig {
            connect_timeout: Duration::from_micros(1),
            ..TransportConfig::default()
        };
        let client = bound(&ca, "client", impatient);
        let peer = server.local_addr();
        let first = client.inner.connection(peer).await;
        assert!(
            matches!(first, Err(TransportError::Timeout { .. })),
            "{first:?}"
        );
        let t0 = Instant::now();
        while client.rtt(peer).is_none() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the abandoned dial never completed"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Cached: answered at once, whatever the caller's timeout.
        assert!(client.inner.connection(peer).await.is_ok());
        assert_eq!(client.stats().snapshot().connect_failures, 0);
        assert!(
            lock(&client.inner.dials).is_empty(),
            "the dial left its entry"
        );
        client.close();
        server.close();
    }

    /// Incoming handshakes past the cap are refused and counted; within it they complete.
    #[tokio::test]
    async fn incoming_handshakes_over_the_cap_are_refused() {
        let ca = certs::ClusterCa::generate().unwrap();
        let full = TransportConfig {
            max_pending_handshakes: 0,
            ..TransportConfig::default()
        };
        let server = bound(&ca, "server", full);
        let client = bound(&ca, "client", TransportConfig::default());
        let refused = client.inner.dial(server.local_addr()).unwrap().await;
        assert!(refused.is_err(), "{refused:?}");
        assert_eq!(server.stats().snapshot().handshake_failures, 1);
        let open = bound(&ca, "open", TransportConfig::default());
        assert!(client.inner.dial(open.local_addr()).unwrap().await.is_ok());
        // The server's side ends a moment after the client's: its count drains to zero.
        let t0 = Instant::now();
        while open.inner.pending_handshakes.load(Ordering::Relaxed) != 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "a handshake stayed pending"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(open.stats().snapshot().handshake_failures, 0);
        for t in [client, server, open] {
            t.close();
        }
    }

    /// Every caller during one handshake joins it: one dial per peer at a time.
    #[tokio::test]
    async fn callers_during_a_handshake_share_one_dial() {
        let ca = certs::ClusterCa::generate().unwrap();
        let server = bound(&ca, "server", TransportConfig::default());
        let client = bound(&ca, "client", TransportConfig::default());
        let peer = server.local_addr();
        let a = client.inner.dial(peer).unwrap();
        let b = client.inner.dial(peer).unwrap();
        assert_eq!(lock(&client.inner.dials).len(), 1);
        let (a, b) = tokio::join!(a, b);
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a.stable_id(), b.stable_id());
        client.close();
        server.close();
    }

    #[test]
    fn digest_ids_reads_the_ids_of_syn_and_synack_only() {
        // A real Syn, built through chitchat's own state machine is not public: build the bytes
        // by the documented layout and check chitchat decodes them too.
        let a = ChitchatId::new("n3", 7, "127.0.0.1:7001".parse().unwrap());
        let b = ChitchatId::new("n1", 9, "127.0.0.1:7002".parse().unwrap());
        let mut bytes = Vec::new();
        ChitchatMessage::BadCluster.serialize(&mut bytes);
        bytes.truncate(3); // magic + version
        bytes.push(0); // Syn
        2u16.serialize(&mut bytes);
        for id in [&a, &b] {
            id.serialize(&mut bytes);
            for v in [5u64, 0, 3] {
                v.serialize(&mut bytes);
            }
        }
        "test-cluster".to_owned().serialize(&mut bytes);
        let mut buf = bytes.as_slice();
        assert!(matches!(
            ChitchatMessage::deserialize(&mut buf),
            Ok(ChitchatMessage::Syn { .. })
        ));
        let mut ids = digest_ids(&bytes);
        ids.sort();
        let mut want = vec![a, b];
        want.sort();
        assert_eq!(ids, want);
        // BadCluster (and Ack: type 2) list nothing; truncated bytes list what parsed.
        let mut bad = Vec::new();
        ChitchatMessage::BadCluster.serialize(&mut bad);
        assert!(digest_ids(&bad).is_empty());
        assert!(digest_ids(&bytes[..10]).is_empty());
        assert!(same_addr(
            "[::ffff:127.0.0.1]:5".parse().unwrap(),
            "127.0.0.1:5".parse().unwrap()
        ));
    }

    #[test]
    fn identity_verdict_binds_named_ids_and_refuses_impostors() {
        let peer: SocketAddr = "127.0.0.1:7003".parse().unwrap();
        let other: SocketAddr = "127.0.0.1:7004".parse().unwrap();
        let id = |n: &str, g: u64, a: SocketAddr| ChitchatId::new(n.to_owned(), g, a);
        let names = vec!["n3".to_owned()];
        // The sender lists itself at its address, named: proven. Others' ids (at other
        // addresses) are neither proven nor held against it.
        let ok = identity_verdict(peer, &names, vec![id("n3", 2, peer), id("n1", 1, other)]);
        assert_eq!(ok, Ok(vec![id("n3", 2, peer)]));
        // A stale id of another node once at this address (port reuse) does not condemn it.
        let reuse = identity_verdict(peer, &names, vec![id("n5", 1, peer), id("n3", 2, peer)]);
        assert_eq!(reuse, Ok(vec![id("n3", 2, peer)]));
        // Certificate for `spoof`, claiming n3 at its own address: refused.
        let spoof = vec!["spoof".to_owned()];
        let bad = identity_verdict(peer, &spoof, vec![id("n3", 9, peer), id("n1", 1, other)]);
        assert_eq!(bad, Err(vec![id("n3", 9, peer)]));
        // Nothing listed at the sender's address (an Ack, or NAT): nothing proven, nothing refused.
        assert_eq!(
            identity_verdict(peer, &spoof, vec![id("n1", 1, other)]),
            Ok(vec![])
        );
        // A certificate without node names proves nothing.
        assert!(identity_verdict(peer, &[], vec![id("n3", 1, peer)]).is_err());
    }

    #[test]
    fn warn_gate_lets_one_warning_through_per_period() {
        let g = WarnGate::new();
        assert!(g.allow());
        assert!(!g.allow());
        assert!(!g.allow());
    }

    proptest! {
        /// chitchat's decoder is what stands between a peer's gossip stream and the node: random
        /// bytes, including a valid envelope header followed by garbage, must never panic it.
        #[test]
        fn chitchat_decoder_never_panics(tail in proptest::collection::vec(any::<u8>(), 0..2048), header in any::<bool>()) {
            let mut bytes = Vec::new();
            if header {
                // A real Syn's first bytes, so decoding gets past the envelope.
                let syn = ChitchatMessage::BadCluster;
                syn.serialize(&mut bytes);
                bytes.truncate(bytes.len().min(3));
            }
            bytes.extend_from_slice(&tail);
            let mut buf = bytes.as_slice();
            let _ = ChitchatMessage::deserialize(&mut buf);
        }
    }
}
