//! Replicas from DNS: SRV records (host and port) or A/AAAA records (addresses, fixed port),
//! re-resolved when the answer's TTL runs out.
//!
//! Exists because fleets behind Kubernetes headless services or Consul change without telling
//! the router: each source resolves its name, registers every address it has not seen as a
//! replica in the [`ReplicaRegistry`] the node implements (the node's resolver task then starts
//! its watchers and checks it at once), brings back ones that returned, and drains ones that
//! left — never removing an index, so decisions in flight stay valid. A failed resolution keeps
//! the previous set: a DNS outage must not empty the fleet.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::RData;
use hickory_resolver::{Resolver, TokioResolver};

use serde::Deserialize;

use super::entry::{default_max_in_flight, default_pool, default_prefill_rate, ReplicaConfig};
use super::kv_events::KvEventsSource;
use crate::core::role::Role;

/// Most replicas one DNS source registers (the first, by address): each becomes a cache model,
/// watcher tasks and metric series, and an answer (over TCP) may list thousands.
pub const MAX_DNS_REPLICAS: usize = 1024;
/// Longest one resolution may take, SRV targets included (each resolved in turn, each up to the
/// resolver's own timeout): past it the previous replicas stay, and a node's start goes on.
const RESOLVE_DEADLINE: Duration = Duration::from_secs(10);

/// Which records a DNS source reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DnsRecord {
    /// SRV records: each gives a target host and a port; targets resolve through A/AAAA.
    Srv,
    /// A/AAAA records of `name`; every address with the configured `port`.
    A,
}

/// Replicas found in DNS. Every address found becomes a replica with id `ip:port`; replicas
/// that disappear from the answer stop taking new requests (draining).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DnsConfig {
    /// Name to resolve, e.g. `_http._tcp.vllm.ns.svc.cluster.local.` (required).
    pub name: String,
    /// `srv` or `a`. Default `srv`.
    #[serde(default = "default_dns_record")]
    pub record: DnsRecord,
    /// Port of every address (required for `a`, ignored for `srv`).
    #[serde(default)]
    pub port: Option<u16>,
    /// URL scheme of the replicas. Default `http`.
    #[serde(default = "default_scheme")]
    pub scheme: String,
    /// DNS server (`ip:port`). Default: the system's resolv.conf.
    #[serde(default)]
    pub nameserver: Option<SocketAddr>,
    /// Shortest time between resolutions (ms), whatever the TTL. Default 1,000.
    #[serde(default = "default_min_refresh_ms")]
    pub min_refresh_ms: u64,
    /// Longest time between resolutions (ms), whatever the TTL. Default 60,000.
    #[serde(default = "default_max_refresh_ms")]
    pub max_refresh_ms: u64,
    /// Region of the replicas. Default: the node's region.
    #[serde(default)]
    pub region: Option<String>,
    /// Zone or rack. Default empty.
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
    /// Where each discovered replica's engine publishes KV events, as ports on the replica's
    /// address: `kv_events = { port = 5557, replay_port = 5558, dp_ranks = 1 }`. Default none
    /// (approximate cache models from routed requests).
    #[serde(default)]
    pub kv_events: Option<DnsKvEvents>,
    /// KV size and offload bandwidths, to weigh CPU/disk hits by their load time:
    /// `kv_load = { bytes_per_token = 131072, cpu_gb_per_s = 25, disk_gb_per_s = 3 }` (each
    /// field defaults to the value shown). Default none: the node's fixed `tier_weights`.
    #[serde(default)]
    pub kv_load: Option<crate::core::kv_load::KvLoad>,
}

/// `kv_events` of a DNS source: the same for every replica it finds, at that replica's address.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct DnsKvEvents {
    /// The engines' PUB port (vLLM's default endpoint port is 5557) (required).
    pub port: u16,
    /// The engines' ROUTER replay port. Default none: gaps clear the replica's blocks.
    #[serde(default)]
    pub replay_port: Option<u16>,
    /// Topic prefix to subscribe to. Default "" (every topic).
    #[serde(default)]
    pub topic: String,
    /// Data-parallel ranks; rank r publishes on port + r (and replays on replay_port + r).
    /// Default 1.
    #[serde(default = "default_dp_ranks")]
    pub dp_ranks: u16,
    /// Largest event message accepted (bytes); see `KvEventsSource`. Default 4 MiB.
    #[serde(default = "super::kv_events::default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// Live messages buffered during a replay (bytes); see `KvEventsSource`. Default 64 MiB.
    #[serde(default = "super::kv_events::default_max_buffered_bytes")]
    pub max_buffered_bytes: usize,
}

fn default_dp_ranks() -> u16 {
    1
}

impl DnsKvEvents {
    /// The event source of the replica at `ip`.
    pub fn at(&self, ip: std::net::IpAddr) -> KvEventsSource {
        let tcp = |port: u16| format!("tcp://{}", SocketAddr::new(ip, port));
        KvEventsSource {
            endpoint: tcp(self.port),
            replay: self.replay_port.map(tcp),
            topic: self.topic.clone(),
            dp_ranks: self.dp_ranks,
            rank_routing: None,
            max_message_bytes: self.max_message_bytes,
            max_buffered_bytes: self.max_buffered_bytes,
        }
    }
}

fn default_dns_record() -> DnsRecord {
    DnsRecord::Srv
}
fn default_scheme() -> String {
    "http".into()
}
fn default_min_refresh_ms() -> u64 {
    1_000
}
fn default_max_refresh_ms() -> u64 {
    60_000
}

impl DnsConfig {
    /// The replica at `addr` found through this source.
    pub fn replica(&self, addr: SocketAddr) -> ReplicaConfig {
        ReplicaConfig {
            url: format!("{}://{addr}", self.scheme),
            id: Some(addr.to_string()),
            region: self.region.clone(),
            zone: self.zone.clone(),
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
            kv_events: self.kv_events.as_ref().map(|k| k.at(addr.ip())),
            kv_load: self.kv_load,
        }
    }
}

/// The registry a DNS source keeps up to date (the node implements it): the one thing a source
/// needs from the node it feeds.
pub trait ReplicaRegistry: Send + Sync {
    /// Registers a replica, or updates (and brings back) the one with the same id. Returns its
    /// index and whether it is new (or revived after it was dropped: its watchers start again).
    fn add_replica(&self, spec: &ReplicaConfig) -> anyhow::Result<(usize, bool)>;
    /// Takes replica `i` out of the registry: it drains.
    fn remove_replica(&self, i: usize);
}

/// One configured DNS source with its resolver.
pub struct DnsSource {
    cfg: DnsConfig,
    resolver: TokioResolver,
    /// Ids of replicas this source currently lists, with their indexes.
    members: HashSet<(String, usize)>,
    /// The last resolution named more than [`MAX_DNS_REPLICAS`]: said once, not every refresh.
    over_cap: bool,
}

/// Why a resolution failed.
#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    /// The resolver could not be built.
    #[error("cannot build a resolver for {name}: {source}")]
    Build {
        /// The configured name.
        name: String,
        /// Cause.
        source: hickory_resolver::net::NetError,
    },
    /// The lookup failed.
    #[error("cannot resolve {name}: {source}")]
    Lookup {
        /// The name looked up.
        name: String,
        /// Cause.
        source: hickory_resolver::net::NetError,
    },
}

impl DnsSource {
    /// A source for `cfg`, with the system resolver or the configured name server. The resolver
    /// keeps no cache of its own: the source re-resolves on the TTL and wants fresh answers.
    pub fn new(cfg: DnsConfig) -> Result<Self, DnsError> {
        let build = |e| DnsError::Build {
            name: cfg.name.clone(),
            source: e,
        };
        let builder = match cfg.nameserver {
            Some(ns) => {
                let mut conn = ConnectionConfig::udp();
                conn.port = ns.port();
                let mut tcp = ConnectionConfig::tcp();
                tcp.port = ns.port();
                let server = NameServerConfig::new(ns.ip(), true, vec![conn, tcp]);
                Resolver::builder_with_config(
                    ResolverConfig::from_name_servers(vec![server]),
                    TokioRuntimeProvider::default(),
                )
            }
            None => Resolver::builder_tokio().map_err(build)?,
        };
        let mut builder = builder;
        builder.options_mut().cache_size = 0;
        let resolver = builder.build().map_err(build)?;
        Ok(DnsSource {
            cfg,
            resolver,
            members: HashSet::new(),
            over_cap: false,
        })
    }

    /// The replicas this source lists now that have `kv_events`, with their event sources
    /// (index, source at the replica's address).
    pub fn kv_events_members(&self) -> Vec<(usize, KvEventsSource)> {
        let Some(kv) = &self.cfg.kv_events else {
            return Vec::new();
        };
        let mut out: Vec<(usize, KvEventsSource)> = self
            .members
            .iter()
            .filter_map(|(id, i)| {
                let addr = id.parse::<SocketAddr>().ok()?;
                Some((*i, kv.at(addr.ip())))
            })
            .collect();
        out.sort_by_key(|(i, _)| *i);
        out
    }

    /// The configured name.
    pub fn name(&self) -> &str {
        &self.cfg.name
    }

    /// Resolves the source: the replica addresses and when the answer expires.
    pub async fn resolve(&self) -> Result<(Vec<SocketAddr>, Instant), DnsError> {
        let err = |name: &str, e| DnsError::Lookup {
            name: name.to_owned(),
            source: e,
        };
        let mut addrs = Vec::new();
        let until = match self.cfg.record {
            DnsRecord::A => {
                let port = self.cfg.port.unwrap_or(80);
                let ips = self
                    .resolver
                    .lookup_ip(self.cfg.name.as_str())
                    .await
                    .map_err(|e| err(&self.cfg.name, e))?;
                addrs.extend(ips.iter().map(|ip| SocketAddr::new(ip, port)));
                ips.valid_until()
            }
            DnsRecord::Srv => {
                let srv = self
                    .resolver
                    .srv_lookup(self.cfg.name.as_str())
                    .await
                    .map_err(|e| err(&self.cfg.name, e))?;
                let mut until = srv.valid_until();
                for rec in srv.answers().iter().take(MAX_DNS_REPLICAS) {
                    let RData::SRV(s) = &rec.data else { continue };
                    let target = s.target.to_ascii();
                    match self.resolver.lookup_ip(target.as_str()).await {
                        Ok(ips) => {
                            until = until.min(ips.valid_until());
                            addrs.extend(ips.iter().map(|ip| SocketAddr::new(ip, s.port)));
                        }
                        // One unresolvable target must not hide the others.
                        Err(e) => {
                            tracing::warn!(target = %target, error = %e, "SRV target does not resolve")
                        }
                    }
                }
                until
            }
        };
        addrs.sort();
        addrs.dedup();
        Ok((addrs, until))
    }

    /// Resolves once and brings the registry in line. Returns the replicas new to the node and
    /// when to resolve next.
    pub async fn sync(&mut self, registry: &dyn ReplicaRegistry) -> (Vec<usize>, Duration) {
        let min = Duration::from_millis(self.cfg.min_refresh_ms);
        let max = Duration::from_millis(self.cfg.max_refresh_ms);
        let (mut addrs, until) = match tokio::time::timeout(RESOLVE_DEADLINE, self.resolve()).await
        {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "DNS resolution failed; keeping the previous replicas");
                return (Vec::new(), min);
            }
            Err(_) => {
                tracing::warn!(source = %self.cfg.name, "DNS resolution took over {RESOLVE_DEADLINE:?}; keeping the previous replicas");
                return (Vec::new(), min);
            }
        };
        let over_cap = addrs.len() > MAX_DNS_REPLICAS;
        if over_cap && !self.over_cap {
            tracing::warn!(source = %self.cfg.name, found = addrs.len(), "DNS names more replicas than a source registers; the first {MAX_DNS_REPLICAS} by address are kept (said once while it lasts)");
        }
        self.over_cap = over_cap;
        addrs.truncate(MAX_DNS_REPLICAS);
        let mut added = Vec::new();
        let mut now_members = HashSet::with_capacity(addrs.len());
        for addr in addrs {
            let spec = self.cfg.replica(addr);
            match registry.add_replica(&spec) {
                Ok((i, new)) => {
                    if new {
                        added.push(i);
                    }
                    now_members.insert((addr.to_string(), i));
                }
                Err(e) => tracing::warn!(%addr, error = %e, "cannot register replica"),
            }
        }
        for (id, i) in self.members.difference(&now_members) {
            tracing::info!(replica = %id, source = %self.cfg.name, "no longer in DNS");
            registry.remove_replica(*i);
        }
        self.members = now_members;
        let next = until
            .saturating_duration_since(Instant::now())
            .clamp(min, max);
        (added, next)
    }
}
