//! Replicas from DNS: SRV records (host and port) or A/AAAA records (addresses, fixed port),
//! re-resolved when the answer's TTL runs out.
//!
//! Exists because fleets behind Kubernetes headless services or Consul change without telling
//! the router: each source resolves its name, registers every address it has not seen as a
//! replica (with watcher tasks and an immediate health check), brings back ones that returned,
//! and drains ones that left — never removing an index, so decisions in flight stay valid. A
//! failed resolution keeps the previous set: a DNS outage must not empty the fleet.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::RData;
use hickory_resolver::{Resolver, TokioResolver};
use tokio::sync::watch;

use crate::config::{DnsConfig, DnsRecord};
use crate::node::Node;

/// One configured DNS source with its resolver.
pub struct DnsSource {
    cfg: DnsConfig,
    resolver: TokioResolver,
    /// Ids of replicas this source currently lists, with their indexes.
    members: HashSet<(String, usize)>,
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
        })
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
                for rec in srv.answers() {
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
    pub async fn sync(&mut self, node: &Node) -> (Vec<usize>, Duration) {
        let min = Duration::from_millis(self.cfg.min_refresh_ms);
        let max = Duration::from_millis(self.cfg.max_refresh_ms);
        let (addrs, until) = match self.resolve().await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "DNS resolution failed; keeping the previous replicas");
                return (Vec::new(), min);
            }
        };
        let mut added = Vec::new();
        let mut now_members = HashSet::with_capacity(addrs.len());
        for addr in addrs {
            let spec = self.cfg.replica(addr);
            match node.add_replica(&spec) {
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
            node.remove_replica(*i);
        }
        self.members = now_members;
        let next = until
            .saturating_duration_since(Instant::now())
            .clamp(min, max);
        (added, next)
    }
}

/// Keeps a source's replicas in the registry until `stop` turns true, first resolving after
/// `next`.
pub async fn run(
    node: Arc<Node>,
    mut source: DnsSource,
    mut next: Duration,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(next) => {}
            _ = super::stopped(&mut stop) => return,
        }
        let (added, wait) = source.sync(&node).await;
        next = wait;
        if !added.is_empty() {
            for &i in &added {
                super::spawn_replica_watchers(&node, &stop, i);
            }
            super::check_all(&node, added.into_iter()).await;
        }
    }
}
