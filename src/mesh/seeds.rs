//! Seed discovery: turns `srv:<name>` seeds into `host:port` seeds through a DNS SRV lookup.
//!
//! chitchat already resolves `host:port` seeds itself (the OS resolver, again every 60 s), which
//! covers a Kubernetes headless service when the gossip port is known. SRV records add the port:
//! `srv:_gossip._udp.kvmesh.ns.svc.cluster.local` lists every pod with its port. The SRV name is
//! resolved once at start (with hickory, which speaks SRV); its targets are handed to chitchat as
//! host names, so their addresses keep being re-resolved. Once a node has joined, membership
//! comes from gossip, so a changed SRV set only matters to nodes that start later.

use std::net::SocketAddr;
use std::time::Duration;

use hickory_resolver::config::{NameServerConfig, ResolverConfig, ResolverOpts};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::RData;
use hickory_resolver::{Resolver, TokioResolver};
use tracing::{debug, warn};

/// Prefix marking a seed as an SRV name.
pub const SRV_PREFIX: &str = "srv:";

/// Errors building a resolver.
#[derive(Debug, thiserror::Error)]
#[error("DNS resolver: {0}")]
pub struct SeedError(String);

/// Resolves SRV seeds.
pub struct SeedResolver {
    resolver: TokioResolver,
}

impl std::fmt::Debug for SeedResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeedResolver").finish_non_exhaustive()
    }
}

impl SeedResolver {
    /// The system's resolver configuration (`/etc/resolv.conf`).
    pub fn system() -> Result<Self, SeedError> {
        let resolver = Resolver::builder_tokio()
            .map_err(|e| SeedError(e.to_string()))?
            .build()
            .map_err(|e| SeedError(e.to_string()))?;
        Ok(SeedResolver { resolver })
    }

    /// One DNS server over UDP (tests, or clusters with a dedicated discovery DNS), no cache.
    pub fn with_server(server: SocketAddr, timeout: Duration) -> Result<Self, SeedError> {
        let mut ns = NameServerConfig::udp(server.ip());
        for c in &mut ns.connections {
            c.port = server.port();
        }
        let mut opts = ResolverOpts::default();
        opts.cache_size = 0;
        opts.timeout = timeout;
        opts.attempts = 1;
        let resolver = Resolver::builder_with_config(
            ResolverConfig::from_name_servers(vec![ns]),
            TokioRuntimeProvider::default(),
        )
        .with_options(opts)
        .build()
        .map_err(|e| SeedError(e.to_string()))?;
        Ok(SeedResolver { resolver })
    }

    /// `seeds` with every `srv:<name>` replaced by the `target:port` of its SRV records
    /// (lowest priority value first, as SRV orders them). Other seeds pass through unchanged. A
    /// failed lookup is logged and contributes nothing: the remaining seeds may still suffice.
    pub async fn expand(&self, seeds: &[String]) -> Vec<String> {
        let mut out = Vec::new();
        for seed in seeds {
            let Some(name) = seed.strip_prefix(SRV_PREFIX) else {
                out.push(seed.clone());
                continue;
            };
            match self.resolver.srv_lookup(name).await {
                Ok(lookup) => {
                    let mut targets: Vec<(u16, String)> = lookup
                        .answers()
                        .iter()
                        .filter_map(|r| match &r.data {
                            RData::SRV(s) => {
                                let host = s.target.to_utf8();
                                let host = host.trim_end_matches('.');
                                Some((s.priority, format!("{host}:{}", s.port)))
                            }
                            _ => None,
                        })
                        .collect();
                    targets.sort();
                    debug!(%name, n = targets.len(), "SRV seeds resolved");
                    out.extend(targets.into_iter().map(|(_, t)| t));
                }
                Err(e) => warn!(%name, error = %e, "SRV seed lookup failed"),
            }
        }
        out.dedup();
        out
    }
}

/// Whether any seed needs an SRV lookup.
pub fn has_srv(seeds: &[String]) -> bool {
    seeds.iter().any(|s| s.starts_with(SRV_PREFIX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn plain_seeds_pass_through_and_failed_srv_contributes_nothing() {
        // Nothing listens on this port: the SRV lookup times out quickly.
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let dead = sock.local_addr().unwrap();
        drop(sock);
        let r = SeedResolver::with_server(dead, Duration::from_millis(200)).unwrap();
        let seeds = vec![
            "10.0.0.1:7946".to_string(),
            "srv:_gossip._udp.nowhere.test.".to_string(),
            "seed.example:7946".to_string(),
        ];
        assert!(has_srv(&seeds));
        assert_eq!(
            r.expand(&seeds).await,
            vec!["10.0.0.1:7946".to_string(), "seed.example:7946".to_string()]
        );
    }
}
