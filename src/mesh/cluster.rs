//! `Mesh`: one node's membership in the cluster — chitchat over the QUIC transport, the state
//! schema, home-node assignment, summary sync and block reports behind one handle.
//!
//! The node (`kvmesh serve`) starts a `Mesh`, publishes its replicas' records when it is their
//! home, reads every member's records to fill its routing `View`, pulls summary bodies from
//! homes, and reports routed blocks. Everything here is I/O plumbing; decisions stay in the core.
//!
//! A node's chitchat generation is its start time in ms, so a restart is a new member. The phi
//! failure-detector threshold is `failure_detection / gossip_interval`, at least 2 (defaults
//! 2 s / 100 ms), which declares a silent node dead after about `failure_detection`. Block
//! reports are batched per home and replica and sent every `report_flush_interval`; RTTs to
//! other regions are published every `rtt_interval` and read back as a region map.
//!
//! A member counts live only once it proved its node id on a direct connection (its certificate
//! names it; see `transport`); a live-but-unproven peer is asked for a gossip round at once, so
//! proving takes a round rather than waiting for chitchat's random peer choice.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use chitchat::{spawn_chitchat, ChitchatConfig, ChitchatHandle, ChitchatId, FailureDetectorConfig};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::core::regions::RegionMap;
use crate::core::summary::SummaryMessage;

use super::admin::{self, AdminRecord};
use super::cert_resolver::ReloadableCert;
use super::certs::{CertError, NodeIdentity};
use super::gossip_guard::{Guard, MAX_KEYS_PER_MEMBER};
use super::home;
use super::hot_record::{HotRecord, KEY_HOT};
pub use super::member::Member;
use super::member_decode::{members_of, MemberCache};
use super::region_layer::{LayerSettings, RegionLayer};
use super::regional::{Regional, RegionalRound};
use super::replica_load::{RecordChange, ReplicaLoadRecord};
use super::schema::{
    self, InflightRecord, NodeRecord, ReplicaRecord, RttRecord, SchemaError, KEY_INFLIGHT, KEY_RTT,
};
use super::schema::{HomesRecord, KEY_HOMES};
use super::seeds::{self, SeedResolver};
use super::signed::{CertCheck, LocalSigner, SignError};
use super::sync::{BlockReport, MeshHandler, SummaryRequest, MAX_REPORT_KEYS};
use super::transport::{QuicTransport, StatsSnapshot, TransportConfig, TransportError};
use crate::core::region_offer::RegionOffer;

/// Settings of a mesh node.
#[derive(Clone, Debug)]
pub struct MeshConfig {
    /// Unique node id (stable across restarts; the generation tells restarts apart).
    pub node_id: String,
    /// The node's region.
    pub region: String,
    /// Zone or rack ("" when not set).
    pub zone: String,
    /// Base URL of the node's HTTP front, published for cross-region forwarding.
    pub http_url: String,
    /// UDP address to bind (port 0 picks one).
    pub listen_addr: SocketAddr,
    /// Address peers dial; default: the bound address (set it when binding 0.0.0.0).
    pub advertise_addr: Option<SocketAddr>,
    /// Seeds as `ip:port`, `host:port` (chitchat re-resolves names every 60 s) or
    /// `srv:<name>` (DNS SRV, resolved at start; see `seeds`).
    pub seeds: Vec<String>,
    /// DNS server for `srv:` seeds; default: the system resolver.
    pub dns_server: Option<SocketAddr>,
    /// Cluster id: nodes of other clusters are refused by chitchat.
    pub cluster_id: String,
    /// Gossip round interval. Default 200 ms (see `MeshSection::gossip_interval_ms`).
    pub gossip_interval: Duration,
    /// Silence after which a node is declared dead. Default 2 s (the phi threshold is derived
    /// from it and the gossip interval).
    pub failure_detection: Duration,
    /// How long a dead node's state is kept before it is forgotten. Default 10 min.
    pub dead_node_grace_period: Duration,
    /// How often RTTs to other regions are published. Default 2 s.
    pub rtt_interval: Duration,
    /// How long block reports are batched before being sent. Default 50 ms (half a gossip
    /// round: a routed prefix reaches its home well before the next summary pull).
    pub report_flush_interval: Duration,
    /// Certificates for mTLS.
    pub identity: NodeIdentity,
    /// Where the endpoint's certificate is held, when the caller wants to replace it later (a
    /// reload; see `cert_resolver`): `Mesh::start` fills it with `identity`'s validated
    /// certificate. `None`: the mesh keeps its own, fixed for its lifetime.
    pub cert: Option<Arc<ReloadableCert>>,
    /// Transport tuning.
    pub transport: TransportConfig,
    /// One cluster per region plus the region layer (default), or one for the whole mesh.
    pub layout: GossipLayout,
    /// Representatives per region in the region layer. Default 2.
    pub representatives: usize,
    /// Gossip interval of the region layer, and the least time between two region records a
    /// representative publishes. Default 1 s.
    pub region_interval: Duration,
}

/// How the mesh's gossip is laid out (see `region_layer` for why).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GossipLayout {
    /// A chitchat cluster per region; other regions as region records through the
    /// representatives' region layer. A node's gossip cost grows with its region, not the mesh.
    #[default]
    Regional,
    /// One chitchat cluster for every node of every region (the layout before regional
    /// gossip): each node sees every replica, and pays for every node.
    Flat,
}

impl MeshConfig {
    /// A configuration with the defaults.
    pub fn new(
        node_id: impl Into<String>,
        region: impl Into<String>,
        listen_addr: SocketAddr,
        cluster_id: impl Into<String>,
        identity: NodeIdentity,
    ) -> Self {
        MeshConfig {
            node_id: node_id.into(),
            region: region.into(),
            zone: String::new(),
            http_url: String::new(),
            listen_addr,
            advertise_addr: None,
            seeds: Vec::new(),
            dns_server: None,
            cluster_id: cluster_id.into(),
            gossip_interval: Duration::from_millis(200),
            failure_detection: Duration::from_secs(2),
            dead_node_grace_period: Duration::from_secs(600),
            rtt_interval: Duration::from_secs(2),
            report_flush_interval: Duration::from_millis(50),
            identity,
            cert: None,
            transport: TransportConfig::default(),
            layout: GossipLayout::Regional,
            representatives: 2,
            region_interval: Duration::from_millis(1000),
        }
    }
}

/// Errors of the mesh.
#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    /// Certificates could not be loaded or used.
    #[error(transparent)]
    Certs(#[from] CertError),
    /// The transport could not start.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A value could not be published.
    #[error(transparent)]
    Schema(#[from] SchemaError),
    /// chitchat could not start.
    #[error("gossip: {0}")]
    Gossip(String),
    /// A configuration value is out of range.
    #[error("invalid mesh configuration: {0}")]
    Config(String),
    /// Gossip values cannot be signed or checked with these certificates.
    #[error("signed gossip: {0}")]
    Sign(#[from] SignError),
}

/// A replica as gossiped, with who published it.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplicaEntry {
    /// Replica id.
    pub id: String,
    /// Node id of the publisher (normally its home).
    pub publisher: String,
    /// QUIC address of the publisher (where to pull the summary).
    pub publisher_addr: SocketAddr,
    /// The record.
    pub record: ReplicaRecord,
    /// Whether the publisher is the replica's rendezvous home over `live` (see
    /// [`replicas_in_region`]): only the home's record is authoritative.
    pub home: bool,
}

/// Counters of the mesh.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeshStats {
    /// The transport's counters.
    pub transport: StatsSnapshot,
    /// Gossiped values that did not decode (skipped), counted each time they are read, so a
    /// steadily rising figure means a peer keeps publishing a bad value.
    pub schema_errors: u64,
}

/// Keys waiting per (home, replica id, KV tenant label of `BlockReport::kv_tenant`). Labels
/// come from this node's own tenant configuration, so the map is bounded by replicas × tenants.
type ReportBatches = HashMap<(SocketAddr, String, Option<String>), Vec<u64>>;

/// A running mesh node. Dropping it stops gossip and closes the endpoint.
pub struct Mesh {
    /// Shared with the regional join loop, which asks it for rounds with nodes seeds named.
    handle: Option<Arc<ChitchatHandle>>,
    transport: QuicTransport,
    self_id: ChitchatId,
    node: NodeRecord,
    schema_errors: Arc<AtomicU64>,
    reports: Arc<Mutex<ReportBatches>>,
    /// Wakes the report loop when a report is queued (it sleeps while there is none).
    reports_queued: Arc<tokio::sync::Notify>,
    tasks: Vec<JoinHandle<()>>,
    /// When each unverified live peer was last asked for a gossip round (see
    /// [`Mesh::members`]).
    probes: Mutex<HashMap<SocketAddr, std::time::Instant>>,
    /// The regional layout's state: the region layer, what was relayed, who was heard of.
    pub(super) regional: Option<Arc<Regional>>,
    /// Members decoded at their state's last change (shared with the RTT loop).
    decoded: Arc<Mutex<MemberCache>>,
    /// Signs every value this node publishes (see `signed`).
    signer: Arc<LocalSigner>,
    /// The certificate carries the operator role: peers apply this node's `admin:` records.
    operator: bool,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh")
            .field("node_id", &self.self_id.node_id)
            .field("addr", &self.self_id.gossip_advertise_addr)
            .finish_non_exhaustive()
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// What a node's certificate gives it (checked as at every reload, and its region): the key to
/// present, the signer of its values, the check of its peers' values, the operator role.
fn trust_of(
    cfg: &MeshConfig,
) -> Result<
    (
        rustls::sign::CertifiedKey,
        Arc<LocalSigner>,
        CertCheck,
        bool,
    ),
    MeshError,
> {
    let key = cfg.identity.validated_key(&cfg.node_id)?;
    cfg.identity.verify_region(&cfg.region)?;
    let operator = cfg.identity.roles()?.operator;
    let signer = LocalSigner::new(&key)?;
    let check = CertCheck::new(&cfg.identity)?;
    Ok((key, signer, check, operator))
}

/// Installs the gates the region's gossip and the region layer's pass (`gossip_guard`): one
/// each, as the layer's members are other regions' representatives, with their own incarnations.
fn install_guards(
    transport: &QuicTransport,
    cfg: &MeshConfig,
    check: CertCheck,
) -> Result<(), MeshError> {
    let layer_check = CertCheck::new(&cfg.identity)?;
    let hold = cfg.dead_node_grace_period;
    transport.set_guards(
        Guard::new(check, &cfg.node_id, hold),
        Guard::new(layer_check, &cfg.node_id, hold),
    );
    Ok(())
}

/// The failure detector for `cfg`. chitchat 0.11's phi is `silence / mean heartbeat interval`,
/// and heartbeats arrive about once per gossip round, so a threshold of
/// `failure_detection / gossip_interval` declares a node dead after about `failure_detection`.
fn failure_detector(cfg: &MeshConfig) -> FailureDetectorConfig {
    let rounds = cfg.failure_detection.as_secs_f64() / cfg.gossip_interval.as_secs_f64();
    FailureDetectorConfig {
        phi_threshold: rounds.max(2.0),
        sampling_window_size: 1000,
        // Longer silences are outages, not samples of the normal interval.
        max_interval: cfg.failure_detection,
        initial_interval: cfg.gossip_interval,
        dead_node_grace_period: cfg.dead_node_grace_period,
    }
}

impl Mesh {
    /// Binds the QUIC endpoint, starts gossip and publishes this node's `node` record.
    pub async fn start(cfg: MeshConfig) -> Result<Mesh, MeshError> {
        if cfg.gossip_interval.is_zero() || cfg.failure_detection <= cfg.gossip_interval {
            return Err(MeshError::Config(format!(
                "failure_detection ({:?}) must exceed gossip_interval ({:?}) > 0",
                cfg.failure_detection, cfg.gossip_interval
            )));
        }
        // Peers refuse a node whose certificate does not chain to the CA, lacks the cluster SAN
        // or does not name its node id: refuse to start so at once, with the reason, rather
        // than join and be ignored. A reload makes the same checks (`validated_key`).
        let (key, signer, check, operator) = trust_of(&cfg)?;
        let cert = match &cfg.cert {
            Some(cert) => {
                cert.replace(key);
                Arc::clone(cert)
            }
            None => ReloadableCert::new(key),
        };
        let seed_nodes = resolve_seeds(&cfg).await?;
        let quic = cfg
            .identity
            .quic_configs_with(cfg.transport.idle_timeout, cert)?;
        let transport = QuicTransport::bind(cfg.listen_addr, quic, cfg.transport.clone())?;
        install_guards(&transport, &cfg, check)?;
        let bound = transport.local_addr();
        let advertise = cfg.advertise_addr.unwrap_or(bound);
        let generation = now_ms();
        let node = NodeRecord {
            schema: schema::SCHEMA_VERSION,
            region: cfg.region.clone(),
            zone: cfg.zone.clone(),
            http_url: cfg.http_url.clone(),
            quic_addr: advertise,
            version: env!("CARGO_PKG_VERSION").to_owned(),
            generation,
        };
        let self_id = ChitchatId::new(cfg.node_id.clone(), generation, advertise);
        let config = chitchat_config(&cfg, &self_id, bound, &seed_nodes);
        let node_value = match node.encode() {
            Ok(v) => v,
            Err(e) => {
                transport.close();
                return Err(e.into());
            }
        };
        let initial = signer.initial_values(&self_id, &node_value);
        let handle = match spawn_chitchat(config, initial, &transport).await {
            Ok(h) => Arc::new(h),
            Err(e) => {
                transport.close();
                return Err(MeshError::Gossip(e.to_string()));
            }
        };
        info!(node_id = %cfg.node_id, addr = %advertise, region = %cfg.region, "mesh started");
        let schema_errors = Arc::new(AtomicU64::new(0));
        let decoded = Arc::new(Mutex::new(MemberCache::default()));
        let reports = Arc::new(Mutex::new(ReportBatches::new()));
        let reports_queued = Arc::new(tokio::sync::Notify::new());
        let regional = region_layer(
            &cfg,
            &transport,
            (&self_id, &signer),
            node_value,
            &schema_errors,
        );
        let mut tasks = vec![
            tokio::spawn(rtt_loop(
                handle.chitchat(),
                transport.clone(),
                cfg.rtt_interval,
                Arc::clone(&signer),
                schema_errors.clone(),
                regional.clone(),
                decoded.clone(),
            )),
            tokio::spawn(report_loop(
                reports.clone(),
                reports_queued.clone(),
                transport.clone(),
                cfg.report_flush_interval,
            )),
        ];
        if let Some(r) = &regional {
            // Until the first regional round fills it in, the directory names this node's
            // region and the node itself: a node of the region that asks it (every node
            // starting at once, this one a seed) joins it at once instead of a round later.
            let mut dir = super::directory::Directory {
                region: cfg.region.clone(),
                ..Default::default()
            };
            dir.by_region.insert(cfg.region.clone(), vec![advertise]);
            transport.set_directory(dir);
            tasks.push(tokio::spawn(super::regional::join_loop(
                Arc::clone(r),
                Arc::clone(&handle),
                transport.clone(),
                seed_nodes,
                cfg.region.clone(),
                advertise,
            )));
        }
        Ok(Mesh {
            handle: Some(handle),
            transport,
            self_id,
            node,
            schema_errors,
            reports,
            reports_queued,
            tasks,
            probes: Mutex::new(HashMap::new()),
            regional,
            decoded,
            signer,
            operator,
        })
    }

    /// This node's id.
    pub fn node_id(&self) -> &str {
        &self.self_id.node_id
    }

    /// This node's gossip and QUIC address.
    pub fn addr(&self) -> SocketAddr {
        self.self_id.gossip_advertise_addr
    }

    /// This node's `node` record.
    pub fn node_record(&self) -> &NodeRecord {
        &self.node
    }

    /// The transport (RTTs, counters, fault injection).
    pub fn transport(&self) -> &QuicTransport {
        &self.transport
    }

    /// Counters for metrics.
    pub fn stats(&self) -> MeshStats {
        MeshStats {
            transport: self.transport.snapshot(),
            schema_errors: self.schema_errors.load(Ordering::Relaxed),
        }
    }

    fn chitchat(&self) -> Option<&ChitchatHandle> {
        self.handle.as_deref()
    }

    /// Publishes `value` under `key`, signed (see `signed`). A new key past the per-member cap
    /// peers enforce is not published (warned).
    async fn set(&self, key: String, value: String) {
        if let Some(h) = self.chitchat() {
            let (signer, id) = (&self.signer, &self.self_id);
            let capped = h
                .with_chitchat(|c| {
                    let s = c.self_node_state();
                    let new = s.get_versioned(&key).is_none();
                    if new && s.key_values_including_deleted().count() >= MAX_KEYS_PER_MEMBER {
                        return true;
                    }
                    signer.publish(s, id, &key, &value);
                    false
                })
                .await;
            if capped {
                warn!(
                    key,
                    cap = MAX_KEYS_PER_MEMBER,
                    "gossip key not published: this node holds as many keys as peers accept"
                );
            }
        }
    }

    /// Publishes (or updates) the record of a replica this node is home for: the whole record
    /// and its `rload:` companion ([`RecordChange::Full`]), or only the companion
    /// ([`RecordChange::Load`]). Errors, without publishing, when the id or the encoded record
    /// is too large.
    pub async fn publish_replica(
        &self,
        id: &str,
        record: &ReplicaRecord,
        change: RecordChange,
    ) -> Result<(), MeshError> {
        if change == RecordChange::None {
            return Ok(());
        }
        let load_key = ReplicaLoadRecord::key(id)?;
        let load = ReplicaLoadRecord::of(record).encode()?;
        if change == RecordChange::Full {
            let value = record.encode()?;
            // The record first: a peer applies a companion only over its record.
            self.set(schema::replica_key(id)?, value).await;
        }
        self.set(load_key, load).await;
        Ok(())
    }

    /// Withdraws a replica record and its companion (this node stopped being its home, or the
    /// replica is gone).
    pub async fn unpublish_replica(&self, id: &str) -> Result<(), MeshError> {
        let key = schema::replica_key(id)?;
        self.delete(ReplicaLoadRecord::key(id)?).await;
        self.delete(key).await;
        Ok(())
    }

    /// Withdraws `key` (a signed withdrawal: see `signed`).
    async fn delete(&self, key: String) {
        if let Some(h) = self.chitchat() {
            let (signer, id) = (&self.signer, &self.self_id);
            h.with_chitchat(|c| signer.withdraw(c.self_node_state(), id, &key))
                .await;
        }
    }

    /// Publishes an operator command for replica `id` (see `admin.rs`); errors, without
    /// publishing, when the id or the encoded record is too large.
    /// Without the operator role in its certificate a node's commands apply only to itself:
    /// peers would refuse the record, so it is not published.
    pub async fn publish_admin(&self, id: &str, record: &AdminRecord) -> Result<(), MeshError> {
        let key = admin::admin_key(id)?;
        let value = record.encode()?;
        if !self.operator {
            debug!(
                replica = id,
                "operator command applied here only: the node certificate lacks the operator role"
            );
            return Ok(());
        }
        self.set(key, value).await;
        Ok(())
    }

    /// Publishes `value` under `key` as it is (signed), bypassing every check, the key cap
    /// included: fault injection, so tests can play a peer that publishes what a correct node
    /// never would.
    #[doc(hidden)]
    pub async fn publish_unchecked(&self, key: &str, value: &str) {
        if let Some(h) = self.chitchat() {
            let (signer, id) = (&self.signer, &self.self_id);
            h.with_chitchat(|c| signer.publish(c.self_node_state(), id, key, value))
                .await;
        }
    }

    /// Fault injection: rewrites, in this node's copy, member `victim`'s value under `key` as
    /// `value` at a version past its newest — what a member relaying forged state of another
    /// would gossip on. Tests only.
    #[doc(hidden)]
    pub async fn forge_member_state(&self, victim: &ChitchatId, key: &str, value: &str) {
        if let Some(h) = self.chitchat() {
            h.with_chitchat(|c| {
                let Some(state) = c.node_state(victim) else {
                    return;
                };
                let max = state.max_version() + 1000;
                let gc = state.last_gc_version();
                let mut kvs: Vec<(String, chitchat::VersionedValue)> = state
                    .key_values_including_deleted()
                    .map(|(k, v)| (k.to_owned(), v.clone()))
                    .collect();
                kvs.retain(|(k, _)| k != key);
                kvs.push((
                    key.to_owned(),
                    chitchat::VersionedValue {
                        value: value.to_owned(),
                        version: max,
                        status: chitchat::DeletionStatus::Set,
                    },
                ));
                c.reset_node_state_if_update(victim, kvs.into_iter(), max, gc);
            })
            .await;
        }
    }

    /// Withdraws the operator command for replica `id` (superseded, or the oldest over the cap).
    pub async fn unpublish_admin(&self, id: &str) -> Result<(), MeshError> {
        let key = admin::admin_key(id)?;
        self.delete(key).await;
        Ok(())
    }

    /// Publishes the homes marker; call it after publishing or withdrawing replica records.
    pub async fn publish_homes(&self, record: &HomesRecord) -> Result<(), MeshError> {
        let value = record.encode()?;
        self.set(KEY_HOMES.to_owned(), value).await;
        Ok(())
    }

    /// Publishes this node's heaviest prefixes.
    pub async fn publish_hot(&self, record: &HotRecord) -> Result<(), MeshError> {
        let value = record.encode()?;
        self.set(KEY_HOT.to_owned(), value).await;
        Ok(())
    }

    /// Publishes this node's in-flight counts (build it with [`InflightRecord::fit`]).
    pub async fn publish_inflight(&self, record: &InflightRecord) -> Result<(), MeshError> {
        let value = record.encode()?;
        self.set(KEY_INFLIGHT.to_owned(), value).await;
        Ok(())
    }

    /// Every member this node knows, live or dead, this node included, ordered by node id.
    pub async fn members(&self) -> Vec<Member> {
        let Some(h) = self.chitchat() else {
            return Vec::new();
        };
        let errors = &self.schema_errors;
        let transport = &self.transport;
        let layer_ids = match &self.regional {
            Some(r) => r.layer.ids().await,
            None => HashSet::new(),
        };
        let (members, unverified) = h
            .with_chitchat(|c| {
                let self_id = c.self_chitchat_id();
                let unverified: Vec<SocketAddr> = c
                    .live_nodes()
                    .filter(|id| *id != self_id && !transport.is_verified(id))
                    .map(|id| id.gossip_advertise_addr)
                    .collect();
                let mut cache = self.decoded.lock().unwrap_or_else(|e| e.into_inner());
                let members = members_of(c, errors, transport, &layer_ids, &mut cache);
                (members, unverified)
            })
            .await;
        self.probe(h, &unverified);
        members
    }

    /// The regional layout's round (nothing in the flat layout): as a representative, publish
    /// this region's record (`build` makes its offer; called only then) and relay the other
    /// regions'; return every other region's newest record, and refresh what this node answers
    /// directory requests with. `live` are the live members from [`Mesh::members`].
    pub async fn sync_regions(
        &self,
        live: &[Member],
        build: impl FnOnce() -> RegionOffer,
    ) -> RegionalRound {
        let (Some(r), Some(h)) = (&self.regional, self.chitchat()) else {
            return RegionalRound::default();
        };
        super::regional::round(
            r,
            &self.transport,
            self.node_id(),
            &self.node.region,
            live,
            build,
            Relay(h, &self.signer, &self.self_id),
        )
        .await
    }

    /// Regional layout: the seeds answered and named no node of this region, so this node is
    /// its region's first and need not wait for a peer before claiming homes.
    pub fn first_in_region(&self) -> bool {
        self.regional.as_ref().is_some_and(|r| r.first_in_region())
    }

    /// The gossip layout.
    pub fn layout(&self) -> GossipLayout {
        if self.regional.is_some() {
            GossipLayout::Regional
        } else {
            GossipLayout::Flat
        }
    }

    /// Asks chitchat for a gossip round with live peers that have not proved their name yet:
    /// their SynAck's digest verifies them (see `transport`), so a member turns live within a
    /// round, not whenever random peer selection reaches it. At most 8 a call, each peer at
    /// most once a second, never a refused one.
    fn probe(&self, h: &ChitchatHandle, unverified: &[SocketAddr]) {
        if unverified.is_empty() {
            return;
        }
        let now = std::time::Instant::now();
        let mut probes = self.probes.lock().unwrap_or_else(|e| e.into_inner());
        probes.retain(|_, t| now.duration_since(*t) < Duration::from_secs(10));
        for addr in unverified.iter().take(8) {
            let due = probes
                .get(addr)
                .is_none_or(|t| now.duration_since(*t) >= Duration::from_secs(1));
            if due && !self.transport.is_refused(*addr) {
                probes.insert(*addr, now);
                if let Err(e) = h.gossip(*addr) {
                    debug!(error = %e, "gossip round not requested");
                }
            }
        }
    }

    /// A watch that fires when a node joins or leaves or publishes anything (not on bare
    /// heartbeats); recomputed once per gossip round. The node can await `changed()` instead of
    /// polling [`Mesh::members`]. `None` after shutdown.
    pub async fn watch_changes(
        &self,
    ) -> Option<tokio::sync::watch::Receiver<BTreeMap<ChitchatId, chitchat::NodeState>>> {
        let h = self.chitchat()?;
        Some(h.with_chitchat(|c| c.live_nodes_watcher()).await)
    }

    /// The live members (this node included).
    pub async fn live_nodes(&self) -> Vec<Member> {
        let mut m = self.members().await;
        m.retain(|m| m.live);
        m
    }

    /// Replicas of `region` published by live members. When two live members publish the same
    /// replica (a home handover in progress), the current rendezvous home wins; an entry whose
    /// publisher is not the home has `home == false`.
    pub async fn replicas_in_region(&self, region: &str) -> Vec<ReplicaEntry> {
        replicas_in_region(&self.live_nodes().await, region)
    }

    /// The home node (id, QUIC address) of `replica_id` of `region` among live members.
    pub async fn home_of(&self, replica_id: &str, region: &str) -> Option<(String, SocketAddr)> {
        home_in(&self.live_nodes().await, replica_id, region)
    }

    /// Whether this node is the home of `replica_id` of `region`.
    pub async fn is_home(&self, replica_id: &str, region: &str) -> bool {
        self.home_of(replica_id, region)
            .await
            .is_some_and(|(id, _)| *id == *self.self_id.node_id)
    }

    /// Installs the handler that answers summary requests and receives block reports.
    pub fn set_handler(&self, handler: Arc<dyn MeshHandler>) {
        self.transport.set_handler(handler);
    }

    /// Pulls the summary of `replica_id` from `peer` (its QUIC address), given the version this
    /// node holds (`epoch` 0 when none): a delta when the peer can serve one, else a snapshot.
    pub async fn fetch_summary(
        &self,
        peer: SocketAddr,
        replica_id: &str,
        epoch: u64,
        seq: u64,
    ) -> Result<SummaryMessage, TransportError> {
        let req = SummaryRequest {
            replica_id: replica_id.to_owned(),
            epoch,
            seq,
        };
        self.transport.fetch_summary(peer, &req).await
    }

    /// Queues block keys routed to `replica_id` for its home at `home`; batched and sent every
    /// `report_flush_interval`, fire-and-forget. Their tenant is unknown (a handover).
    pub fn report_blocks(&self, home: SocketAddr, replica_id: &str, keys: &[u64]) {
        self.report_keys(home, replica_id, None, keys.iter().copied());
    }

    /// [`Mesh::report_blocks`] from any exact-size iterator of raw keys (the request path passes
    /// its block keys straight through, without collecting them first), for the KV tenant
    /// label `kv_tenant` ([`BlockReport::kv_tenant`]; a name over the bound counts as unknown).
    pub fn report_keys(
        &self,
        home: SocketAddr,
        replica_id: &str,
        kv_tenant: Option<&str>,
        keys: impl ExactSizeIterator<Item = u64>,
    ) {
        if keys.len() == 0 || schema::replica_key(replica_id).is_err() {
            return;
        }
        let label = kv_tenant
            .filter(|t| t.len() <= schema::MAX_TENANT_BYTES)
            .map(str::to_owned);
        let mut batches = self.reports.lock().unwrap_or_else(|e| e.into_inner());
        let batch = batches
            .entry((home, replica_id.to_owned(), label))
            .or_default();
        // A home that cannot keep up must not grow our memory: cap what waits per replica.
        let room = (4 * MAX_REPORT_KEYS).saturating_sub(batch.len());
        batch.extend(keys.take(room));
        drop(batches);
        self.reports_queued.notify_one();
    }

    /// Sends one block report now (fire-and-forget).
    pub fn send_block_report(
        &self,
        home: SocketAddr,
        report: &BlockReport,
    ) -> Result<(), TransportError> {
        self.transport.send_report(home, report)
    }

    /// Smoothed RTT to each peer with a live connection, by QUIC address.
    pub fn peer_rtts(&self) -> HashMap<SocketAddr, Duration> {
        self.transport.rtts()
    }

    /// This node's RTT to each region it has a connection to: the nearest live node's.
    pub async fn region_rtts(&self) -> BTreeMap<String, Duration> {
        region_rtts(&self.live_nodes().await, &self.transport.rtts())
    }

    /// Distances between regions from every live member's published RTTs (a pair measured by
    /// several nodes takes the smallest figure), ready for the router.
    pub async fn region_map(&self) -> RegionMap {
        region_map_of(&self.live_nodes().await)
    }

    /// Stops gossip (peers see this node go silent and declare it dead) and closes the endpoint.
    pub async fn shutdown(mut self) {
        self.stop().await;
    }

    async fn stop(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
        if let Some(r) = &self.regional {
            r.layer.shutdown().await;
        }
        if let Some(h) = self.handle.take() {
            match Arc::try_unwrap(h) {
                Ok(h) => {
                    if let Err(e) = h.shutdown().await {
                        debug!(error = %e, "gossip loop ended with an error");
                    }
                }
                // The aborted join loop has not dropped its copy yet.
                Err(h) => h.abort(),
            }
        }
        self.transport.close();
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
        if let Some(h) = self.handle.take() {
            h.abort();
        }
        self.transport.close();
    }
}

/// The regional cluster's own state, as the relay of other regions' records.
/// Values relayed are signed as this node's own (it vouches for what it relays).
struct Relay<'a>(&'a ChitchatHandle, &'a LocalSigner, &'a ChitchatId);

impl super::regional::AsyncRelay for Relay<'_> {
    async fn set(&self, key: String, value: String) {
        let Relay(h, signer, id) = self;
        h.with_chitchat(|c| signer.publish(c.self_node_state(), id, &key, &value))
            .await;
    }

    async fn delete(&self, key: String) {
        let Relay(h, signer, id) = self;
        h.with_chitchat(|c| signer.withdraw(c.self_node_state(), id, &key))
            .await;
    }
}

/// Distances between regions from `live` members' published RTTs (a pair measured by
/// several members takes the smallest figure).
pub fn region_map_of(live: &[Member]) -> RegionMap {
    let mut best: HashMap<(String, String), f64> = HashMap::new();
    for m in live {
        let Some(from) = m.region() else { continue };
        for (to, ms) in &m.rtt.ms {
            let key = (from.to_owned(), to.clone());
            let v = best.entry(key).or_insert(f64::INFINITY);
            *v = v.min(f64::from(*ms));
        }
    }
    let mut map = RegionMap::default();
    for ((a, b), ms) in best {
        map.measured(&a, &b, ms);
    }
    map
}

/// Homes of replicas among live members, the regions' node lists built once: a sync round
/// looks up every replica's home several times.
pub struct LiveHomes<'a> {
    table: home::HomeTable<'a>,
    live: &'a [Member],
}

impl<'a> LiveHomes<'a> {
    /// Tables the live members of `live` by region (members not live, or whose node record
    /// has not arrived, are no one's home).
    pub fn new(live: &'a [Member]) -> Self {
        let table = home::HomeTable::new(
            live.iter()
                .filter(|m| m.live)
                .filter_map(|m| Some((m.node_id.as_str(), m.region()?))),
        );
        Self { table, live }
    }

    /// The node id of the home of `replica_id` in `region`.
    pub fn home_id(&self, replica_id: &str, region: &str) -> Option<&'a str> {
        self.table.home(replica_id, region)
    }

    /// The home's (id, QUIC address).
    pub fn home(&self, replica_id: &str, region: &str) -> Option<(String, SocketAddr)> {
        let id = self.home_id(replica_id, region)?;
        // A restarted node may briefly appear twice; the newest generation is the one answering.
        let m = self
            .live
            .iter()
            .filter(|m| m.live && m.node_id == id && m.region() == Some(region))
            .max_by_key(|m| m.generation)?;
        Some((
            m.node_id.clone(),
            m.node.as_ref().map_or(m.gossip_addr, |n| n.quic_addr),
        ))
    }
}

/// The home (id, address) of a replica among `live` members of `region`.
pub fn home_in(live: &[Member], replica_id: &str, region: &str) -> Option<(String, SocketAddr)> {
    LiveHomes::new(live).home(replica_id, region)
}

/// Replicas of `region` published by `live` members; see [`Mesh::replicas_in_region`].
pub fn replicas_in_region(live: &[Member], region: &str) -> Vec<ReplicaEntry> {
    replicas_in_region_with(live, &LiveHomes::new(live), region)
}

/// [`replicas_in_region`] with the homes already tabled.
pub fn replicas_in_region_with(
    live: &[Member],
    homes: &LiveHomes<'_>,
    region: &str,
) -> Vec<ReplicaEntry> {
    let mut by_id: BTreeMap<&str, Vec<ReplicaEntry>> = BTreeMap::new();
    for m in live.iter().filter(|m| m.live) {
        let addr = m.node.as_ref().map_or(m.gossip_addr, |n| n.quic_addr);
        for (id, r) in m.replicas.iter().filter(|(_, r)| r.region == region) {
            by_id.entry(id).or_default().push(ReplicaEntry {
                id: id.clone(),
                publisher: m.node_id.clone(),
                publisher_addr: addr,
                record: r.clone(),
                home: false,
            });
        }
    }
    by_id
        .into_iter()
        .filter_map(|(id, mut entries)| {
            if let Some(home) = homes.home_id(id, region) {
                if let Some(i) = entries.iter().position(|e| e.publisher == home) {
                    let mut e = entries.swap_remove(i);
                    e.home = true;
                    return Some(e);
                }
            }
            // No publisher is the home: the newest summary, marked as not authoritative.
            entries.sort_by_key(|e| (e.record.summary.epoch, e.record.summary.seq));
            entries.pop()
        })
        .collect()
}

fn region_rtts(
    live: &[Member],
    rtts: &HashMap<SocketAddr, Duration>,
) -> BTreeMap<String, Duration> {
    let mut out: BTreeMap<String, Duration> = BTreeMap::new();
    for m in live.iter().filter(|m| !m.is_self) {
        let (Some(node), Some(rtt)) = (&m.node, rtts.get(&m.gossip_addr)) else {
            continue;
        };
        let e = out.entry(node.region.clone()).or_insert(*rtt);
        *e = (*e).min(*rtt);
    }
    out
}

async fn rtt_loop(
    chitchat: Arc<tokio::sync::Mutex<chitchat::Chitchat>>,
    transport: QuicTransport,
    every: Duration,
    signer: Arc<LocalSigner>,
    errors: Arc<AtomicU64>,
    regional: Option<Arc<Regional>>,
    decoded: Arc<Mutex<MemberCache>>,
) {
    let mut tick = tokio::time::interval(every.max(Duration::from_millis(10)));
    loop {
        tick.tick().await;
        let rtts = transport.rtts();
        // A representative also measures the other regions' representatives.
        let (layer_members, layer_ids) = match &regional {
            Some(r) => (r.layer.state().await.members, r.layer.ids().await),
            None => (Vec::new(), HashSet::new()),
        };
        let mut c = chitchat.lock().await;
        let live: Vec<Member> = {
            let mut cache = decoded.lock().unwrap_or_else(|e| e.into_inner());
            members_of(&c, &errors, &transport, &layer_ids, &mut cache)
        }
        .into_iter()
        .filter(|m| m.live)
        .collect();
        let mut ms = region_rtts(&live, &rtts);
        for (addr, region) in layer_members {
            if let Some(rtt) = rtts.get(&addr) {
                let e = ms.entry(region).or_insert(*rtt);
                *e = (*e).min(*rtt);
            }
        }
        let rec = RttRecord {
            ms: ms
                .into_iter()
                .map(|(r, d)| (r, d.as_secs_f32() * 1000.0))
                .collect(),
        };
        match rec.encode() {
            Ok(v) => {
                let id = c.self_chitchat_id().clone();
                signer.publish(c.self_node_state(), &id, KEY_RTT, &v);
            }
            Err(e) => warn!(error = %e, "RTT record not published"),
        }
    }
}

/// Sends the batched block reports every `every` while there are any; idle, it sleeps until
/// one is queued (`queued`) rather than wake twenty times a second for nothing. The first
/// report after a pause goes at once (the tick is overdue), later ones batch for `every`.
async fn report_loop(
    reports: Arc<Mutex<ReportBatches>>,
    queued: Arc<tokio::sync::Notify>,
    transport: QuicTransport,
    every: Duration,
) {
    let mut tick = tokio::time::interval(every.max(Duration::from_millis(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let batches = std::mem::take(&mut *reports.lock().unwrap_or_else(|e| e.into_inner()));
        if batches.is_empty() {
            queued.notified().await;
            continue;
        }
        for ((home, replica_id, kv_tenant), keys) in batches {
            for chunk in keys.chunks(MAX_REPORT_KEYS) {
                let report = BlockReport {
                    replica_id: replica_id.clone(),
                    keys: chunk.to_vec(),
                    kv_tenant: kv_tenant.clone(),
                };
                if let Err(e) = transport.send_report(home, &report) {
                    debug!(error = %e, "block report not sent");
                }
            }
        }
    }
}

/// The configured seeds, `srv:` names resolved (through `dns_server` when set).
async fn resolve_seeds(cfg: &MeshConfig) -> Result<Vec<String>, MeshError> {
    if !seeds::has_srv(&cfg.seeds) {
        return Ok(cfg.seeds.clone());
    }
    let resolver = match cfg.dns_server {
        Some(server) => SeedResolver::with_server(server, Duration::from_secs(2)),
        None => SeedResolver::system(),
    }
    .map_err(|e| MeshError::Config(e.to_string()))?;
    Ok(resolver.expand(&cfg.seeds).await)
}

/// chitchat's settings for this node. Regional: this region's own cluster, joined through the
/// seeds' directories (a seed of another region would only answer "wrong cluster"; see
/// `directory`), so chitchat gets no seeds of its own.
fn chitchat_config(
    cfg: &MeshConfig,
    self_id: &ChitchatId,
    bound: SocketAddr,
    seed_nodes: &[String],
) -> ChitchatConfig {
    let (cluster_id, chitchat_seeds) = match cfg.layout {
        GossipLayout::Flat => (cfg.cluster_id.clone(), seed_nodes.to_vec()),
        GossipLayout::Regional => (
            format!("{}/region/{}", cfg.cluster_id, cfg.region),
            Vec::new(),
        ),
    };
    ChitchatConfig {
        chitchat_id: self_id.clone(),
        cluster_id,
        gossip_interval: cfg.gossip_interval,
        listen_addr: bound,
        seed_nodes: chitchat_seeds,
        failure_detector_config: failure_detector(cfg),
        marked_for_deletion_grace_period: cfg.dead_node_grace_period,
        catchup_callback: None,
        extra_liveness_predicate: None,
    }
}

/// The region layer (regional layout only): the representatives' cluster of regions.
fn region_layer(
    cfg: &MeshConfig,
    transport: &QuicTransport,
    (self_id, signer): (&ChitchatId, &Arc<LocalSigner>),
    node_value: String,
    schema_errors: &Arc<AtomicU64>,
) -> Option<Arc<Regional>> {
    match cfg.layout {
        GossipLayout::Flat => None,
        GossipLayout::Regional => {
            // A silent representative is replaced after the usual detection time, but never
            // sooner than four of the layer's slower rounds.
            let settings = LayerSettings {
                cluster_id: format!("{}/regions", cfg.cluster_id),
                region: cfg.region.clone(),
                interval: cfg.region_interval,
                failure: failure_detector(&MeshConfig {
                    gossip_interval: cfg.region_interval,
                    failure_detection: cfg.failure_detection.max(cfg.region_interval * 4),
                    ..cfg.clone()
                }),
            };
            let layer = RegionLayer::new(
                transport.clone(),
                (self_id.clone(), Arc::clone(signer)),
                settings,
                node_value,
                schema_errors.clone(),
            );
            Some(Arc::new(Regional::new(
                layer,
                cfg.representatives.max(1),
                cfg.region_interval,
            )))
        }
    }
}
