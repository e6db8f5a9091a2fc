//! The `[mesh]` table of the node configuration: how a node joins the mesh.
//!
//! Kept apart from `mod.rs` so the single-node configuration stays readable and mesh settings
//! evolve in one place. No `[mesh]` table (and no mesh flag) means a single node, exactly as
//! before. There is no plaintext option: a mesh node always needs a cluster CA and its own
//! certificate (`kvmesh certs init|issue`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::error::{invalid, ConfigError};
use crate::mesh::certs::NodeIdentity;
use crate::mesh::cluster::GossipLayout;
use crate::mesh::MeshConfig;

/// `[mesh]`: membership, gossip and certificates.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct MeshSection {
    /// Unique, stable node id (required; `--node-id`). Restarts keep it; the mesh tells runs
    /// apart by generation.
    pub node_id: String,
    /// UDP address of the QUIC endpoint (gossip, summary sync, block reports). Default
    /// `127.0.0.1:7946`.
    pub listen: SocketAddr,
    /// Address peers dial, when `listen` is a wildcard or behind NAT. Default: the bound address.
    pub advertise: Option<SocketAddr>,
    /// TCP address of the peer listener: HTTPS with the cluster certificates (mutual TLS), where
    /// other nodes forward requests. Default: the HTTP front's IP, any free port.
    pub peer_listen: Option<SocketAddr>,
    /// `https://` URL other nodes forward requests to, when the peer listener is on a wildcard
    /// or behind NAT. Default `https://<bound peer listener address>`.
    pub http_url: Option<String>,
    /// Seeds: `ip:port`, `host:port` or `srv:<name>` (DNS SRV). Default none (first node).
    pub seeds: Vec<String>,
    /// Gossip cluster id; nodes of other clusters are refused. Default: the top-level
    /// `cluster_id`.
    pub cluster_id: Option<String>,
    /// Directory made by `kvmesh certs` (`ca.pem`, `<cert_name>.pem`, `<cert_name>.key`).
    /// Either this or all of `ca`, `cert` and `key`. Default none.
    pub certs_dir: Option<PathBuf>,
    /// Certificate name in `certs_dir`. Default: `node_id`. Whatever the file is called, the
    /// certificate must name `node_id` (`kvmesh certs issue` names it after `--name`): the node
    /// refuses to start otherwise.
    pub cert_name: Option<String>,
    /// Cluster CA certificate (PEM), instead of `certs_dir`. Default none.
    pub ca: Option<PathBuf>,
    /// This node's certificate (PEM), instead of `certs_dir`. Default none.
    pub cert: Option<PathBuf>,
    /// This node's private key (PEM), instead of `certs_dir`. Default none.
    pub key: Option<PathBuf>,
    /// Gossip round interval (ms); also how often the node refreshes its view from gossip.
    /// Default 200: half the messages (and idle bytes and CPU) of 100 ms, for no routing
    /// difference the simulator can see (load travels in load-sharing datagrams, not gossip;
    /// docs/benchmarks-notebook.md, "The mesh at scale").
    pub gossip_interval_ms: u64,
    /// Silence after which a node is declared dead (ms); must exceed the gossip interval.
    /// Default 2,000.
    pub failure_detection_ms: u64,
    /// Longest wait at start for peers' summaries before `/ready` says ready anyway (ms).
    /// Default 5,000.
    pub warmup_timeout_ms: u64,
    /// Region distances pinned by configuration (they beat measured RTTs). Default none.
    pub distance: Vec<DistanceConfig>,
    /// Least time between two load updates this node sends its region's nodes (ms; see
    /// `mesh/load_share.rs`); 0 turns load sharing off (peers' load then comes only from the
    /// gossiped records, 100 ms–1 s late). Default 2, at most 1,000.
    pub load_share_interval_ms: u64,
    /// Most load-sharing bytes this node sends per second, to all its region's nodes together
    /// (KiB/s; a token bucket holding a quarter second, `node/load_share.rs::Pacing`). A node's
    /// updates go to every other node of its region, so without a bound their bytes would grow
    /// with the region; with it a node sends at most this and, as every peer does the same,
    /// receives at most about as much. Small regions never reach it (3 nodes of the demo: ~4
    /// KiB/s); a large busy region trades freshness for it (100 nodes: a flush every ~0.3 s
    /// at the default). A flush waits at most a second, so a budget below one flush a second
    /// (region nodes × ~100 B) is exceeded by that much. Default 32, 1 to 65,536.
    pub load_share_budget_kib_s: u32,
    /// Least time between two publications of a replica's changing state (load, summary
    /// version, KV shares) by its home (ms; `mesh/replica_load.rs`). A fact, a health change, a
    /// new summary epoch or a new scrape goes out at once. Its region's nodes hear of each
    /// other's routing within milliseconds anyway (load sharing, peer tips), so this bounds
    /// gossip at busy replicas: about one small record a replica per scrape or interval.
    /// Default 1,000, 0 to 10,000.
    pub replica_load_interval_ms: u64,
    /// Where replicas learned from peers' gossip may live: hosts (`vllm-3.internal`,
    /// `10.0.0.7`), CIDRs (`10.0.0.0/8`, `fd00::/8`), DNS suffixes (`.svc.cluster.local`), or
    /// `*` for anywhere. A learned replica gets this node's health checks, scrapes and prompts
    /// (with their `Authorization` headers), so by default only hosts this node already talks
    /// to are allowed: those of its own `[[replicas]]` and of the replicas its `[[dns]]` sources
    /// resolved — plus loopback when the mesh itself is on loopback (a one-machine cluster).
    /// Entries here add to that. Default none.
    pub learn_replicas_from: Vec<String>,
    /// Most replicas this node learns from any one publishing peer; more are ignored (counted
    /// in `kvmesh_mesh_records_ignored_total{reason="peer_cap"}`). Default 256.
    pub max_learned_replicas_per_peer: usize,
    /// Most replicas this node learns from gossip in all; more are ignored (counted with
    /// `reason="total_cap"`). Default 1,024.
    pub max_learned_replicas: usize,
    /// `"regional"` (default): one gossip cluster per region, other regions through their
    /// representatives' region records, so a node's gossip cost grows with its region, not
    /// the mesh. `"flat"`: one cluster for the whole mesh (every node sees every replica); a
    /// mesh must use one layout throughout (the two do not gossip with each other).
    pub layout: LayoutConfig,
    /// Representatives per region in the region layer (regional layout). Default 2, 1–8.
    pub representatives: usize,
    /// The region layer's gossip interval, and the least time between two region records
    /// (ms). Default 1,000, 50–10,000.
    pub region_interval_ms: u64,
    /// How often this node makes sure it holds a connection to the nodes it would forward to
    /// in every other region (ms; `proxy/warm_peers.rs`): a forward on an open connection pays
    /// one round trip to the other region, on a new one three (TCP, TLS, then the request).
    /// Each round costs one `GET /health` per such node (at most 8 a region). 0 turns it off.
    /// Default 20,000; 0 or 1,000–60,000 (the peer listener closes a peer's connection after
    /// 120 s without a request).
    pub warm_forward_interval_ms: u64,
}

/// `mesh.layout`.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LayoutConfig {
    /// A cluster per region plus the region layer.
    #[default]
    Regional,
    /// One cluster for the whole mesh.
    Flat,
}

impl Default for MeshSection {
    fn default() -> Self {
        MeshSection {
            node_id: String::new(),
            listen: SocketAddr::from(([127, 0, 0, 1], 7946)),
            advertise: None,
            peer_listen: None,
            http_url: None,
            seeds: Vec::new(),
            cluster_id: None,
            certs_dir: None,
            cert_name: None,
            ca: None,
            cert: None,
            key: None,
            gossip_interval_ms: 200,
            failure_detection_ms: 2_000,
            warmup_timeout_ms: 5_000,
            distance: Vec::new(),
            load_share_interval_ms: 2,
            load_share_budget_kib_s: 32,
            replica_load_interval_ms: 1_000,
            learn_replicas_from: Vec::new(),
            max_learned_replicas_per_peer: 256,
            max_learned_replicas: 1024,
            layout: LayoutConfig::Regional,
            representatives: 2,
            region_interval_ms: 1000,
            warm_forward_interval_ms: 20_000,
        }
    }
}

/// `[[mesh.distance]]`: the distance between two regions, in ms of round trip.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DistanceConfig {
    /// One region (required).
    pub a: String,
    /// The other region (required).
    pub b: String,
    /// Distance in ms (required, finite, ≥ 0).
    pub ms: f64,
    /// The rate of a dedicated KV link between the two regions, GB/s (0.01..=10000): a prefix
    /// pulled across (`remote_prefix = "weigh"`) is priced over it. Default none:
    /// `[kv_fetch.links] cross_region`.
    #[serde(default)]
    pub kv_gb_per_s: Option<f64>,
    /// That link's setup, ms (0..=10000). Default: `cross_region`'s (60).
    #[serde(default)]
    pub kv_setup_ms: Option<f64>,
}

impl DistanceConfig {
    /// The pinned KV link, when `kv_gb_per_s` is set (setup from `default_setup_ms` otherwise).
    pub fn kv_link(&self, default_setup_ms: f64) -> Option<crate::core::regions::RegionLink> {
        Some(crate::core::regions::RegionLink {
            gb_per_s: self.kv_gb_per_s?,
            setup_ms: self.kv_setup_ms.unwrap_or(default_setup_ms),
        })
    }
}

impl MeshSection {
    /// Checks every value, naming the key at fault.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.node_id.is_empty() {
            return Err(invalid("mesh.node_id", "required (or --node-id)"));
        }
        if self.node_id.len() > 128 {
            return Err(invalid("mesh.node_id", "at most 128 bytes"));
        }
        if self.gossip_interval_ms == 0 {
            return Err(invalid("mesh.gossip_interval_ms", "must be at least 1"));
        }
        if self.failure_detection_ms <= self.gossip_interval_ms {
            return Err(invalid(
                "mesh.failure_detection_ms",
                "must exceed mesh.gossip_interval_ms",
            ));
        }
        if !(1..=8).contains(&self.representatives) {
            return Err(invalid("mesh.representatives", "must be 1 to 8"));
        }
        if !(50..=10_000).contains(&self.region_interval_ms) {
            return Err(invalid("mesh.region_interval_ms", "must be 50 to 10000"));
        }
        if self.warm_forward_interval_ms != 0
            && !(1_000..=60_000).contains(&self.warm_forward_interval_ms)
        {
            return Err(invalid(
                "mesh.warm_forward_interval_ms",
                "must be 0 (off) or 1000 to 60000",
            ));
        }
        if self.replica_load_interval_ms > 10_000 {
            return Err(invalid("mesh.replica_load_interval_ms", "at most 10000"));
        }
        if self.load_share_interval_ms > 1_000 {
            return Err(invalid("mesh.load_share_interval_ms", "at most 1000"));
        }
        if !(1..=65_536).contains(&self.load_share_budget_kib_s) {
            return Err(invalid(
                "mesh.load_share_budget_kib_s",
                "must be 1 to 65536",
            ));
        }
        if self.cluster_id.as_deref() == Some("") {
            return Err(invalid(
                "mesh.cluster_id",
                "must not be empty (omit it instead)",
            ));
        }
        if let Some(u) = &self.http_url {
            let ok = reqwest::Url::parse(u)
                .is_ok_and(|u| u.scheme() == "https" && u.host_str().is_some());
            if !ok {
                return Err(invalid(
                    "mesh.http_url",
                    format!("'{u}' must be an https URL with a host (forwarding is mutual TLS)"),
                ));
            }
        }
        let paths = [&self.ca, &self.cert, &self.key];
        let given = paths.iter().filter(|p| p.is_some()).count();
        match (&self.certs_dir, given) {
            (Some(_), 0) | (None, 3) => {}
            (Some(_), _) => {
                return Err(invalid(
                    "mesh.certs_dir",
                    "give either certs_dir or ca + cert + key, not both",
                ))
            }
            (None, _) => {
                return Err(invalid(
                    "mesh.certs_dir",
                    "required (or all of mesh.ca, mesh.cert, mesh.key): a mesh node needs \
                     certificates (`kvmesh certs init --dir D`, `kvmesh certs issue --dir D --name N`)",
                ))
            }
        }
        for (n, rule) in self.learn_replicas_from.iter().enumerate() {
            if let Err(e) = crate::mesh::allow::AllowRule::parse(rule) {
                return Err(invalid(format!("mesh.learn_replicas_from[{n}]"), e));
            }
        }
        if self.max_learned_replicas_per_peer > self.max_learned_replicas {
            return Err(invalid(
                "mesh.max_learned_replicas_per_peer",
                "must not exceed mesh.max_learned_replicas",
            ));
        }
        self.validate_distances()?;
        Ok(())
    }

    /// Checks `[[mesh.distance]]`: region names, the distance, a pinned KV link's bounds.
    fn validate_distances(&self) -> Result<(), ConfigError> {
        for (n, d) in self.distance.iter().enumerate() {
            if d.a.is_empty() || d.b.is_empty() {
                return Err(invalid(
                    format!("mesh.distance[{n}]"),
                    "a and b must be region names",
                ));
            }
            if !d.ms.is_finite() || d.ms < 0.0 {
                return Err(invalid(
                    format!("mesh.distance[{n}].ms"),
                    "must be a finite number ≥ 0",
                ));
            }
            if d.kv_gb_per_s
                .is_some_and(|g| !(0.01..=10_000.0).contains(&g))
            {
                return Err(invalid(
                    format!("mesh.distance[{n}].kv_gb_per_s"),
                    "must be 0.01 to 10000",
                ));
            }
            if d.kv_setup_ms
                .is_some_and(|m| !(0.0..=10_000.0).contains(&m))
            {
                return Err(invalid(
                    format!("mesh.distance[{n}].kv_setup_ms"),
                    "must be 0 to 10000",
                ));
            }
            if d.kv_setup_ms.is_some() && d.kv_gb_per_s.is_none() {
                return Err(invalid(
                    format!("mesh.distance[{n}].kv_setup_ms"),
                    "needs kv_gb_per_s",
                ));
            }
        }
        Ok(())
    }

    /// Loads the certificates.
    pub fn identity(&self) -> anyhow::Result<NodeIdentity> {
        Ok(match (&self.certs_dir, &self.ca, &self.cert, &self.key) {
            (Some(dir), _, _, _) => {
                let name = self.cert_name.as_deref().unwrap_or(&self.node_id);
                NodeIdentity::load_dir(dir, name)?
            }
            (None, Some(ca), Some(cert), Some(key)) => NodeIdentity::load(ca, cert, key)?,
            _ => anyhow::bail!("mesh: no certificates configured"),
        })
    }

    /// The node certificate and key files [`MeshSection::identity`] reads (the CA's aside), for
    /// noticing that they changed; `None` when no certificates are configured.
    pub fn cert_files(&self) -> Option<(PathBuf, PathBuf)> {
        match (&self.certs_dir, &self.cert, &self.key) {
            (Some(dir), _, _) => {
                let name = self.cert_name.as_deref().unwrap_or(&self.node_id);
                Some((
                    dir.join(format!("{name}.pem")),
                    dir.join(format!("{name}.key")),
                ))
            }
            (None, Some(cert), Some(key)) => Some((cert.clone(), key.clone())),
            _ => None,
        }
    }

    /// The mesh library's configuration for a node of `region`/`zone` whose HTTP front is at
    /// `http_url` (used when `http_url` is not configured).
    pub fn mesh_config(
        &self,
        region: &str,
        zone: &str,
        default_cluster_id: &str,
        http_url: String,
    ) -> anyhow::Result<MeshConfig> {
        let mut cfg = MeshConfig::new(
            self.node_id.clone(),
            region,
            self.listen,
            self.cluster_id
                .clone()
                .unwrap_or_else(|| default_cluster_id.to_owned()),
            self.identity()?,
        );
        cfg.zone = zone.to_owned();
        cfg.http_url = self.http_url.clone().unwrap_or(http_url);
        cfg.advertise_addr = self.advertise;
        cfg.seeds = self.seeds.clone();
        cfg.gossip_interval = self.gossip_interval();
        cfg.failure_detection = Duration::from_millis(self.failure_detection_ms);
        cfg.layout = match self.layout {
            LayoutConfig::Regional => GossipLayout::Regional,
            LayoutConfig::Flat => GossipLayout::Flat,
        };
        cfg.representatives = self.representatives;
        cfg.region_interval = Duration::from_millis(self.region_interval_ms);
        // Reports wait at most a quarter round (50 ms at most), so a prefix routed at a follower
        // reaches its home well within the round that publishes it.
        cfg.report_flush_interval =
            (self.gossip_interval() / 4).clamp(Duration::from_millis(5), Duration::from_millis(50));
        Ok(cfg)
    }

    /// `gossip_interval_ms` as a duration.
    pub fn gossip_interval(&self) -> Duration {
        Duration::from_millis(self.gossip_interval_ms)
    }
}

#[cfg(test)]
mod tests {
    use crate::node::config::{NodeConfig, ServeArgs};

    #[test]
    fn mesh_flags_make_a_mesh_node() {
        let args = ServeArgs {
            node_id: Some("n2".into()),
            mesh_listen: Some("127.0.0.1:7001".parse().unwrap()),
            seeds: vec!["127.0.0.1:7000".into()],
            certs_dir: Some("/etc/kvmesh/certs".into()),
            ..Default::default()
        };
        // No replicas needed: a mesh node learns them from its peers.
        let c = NodeConfig::from_args(&args).unwrap();
        let m = c.mesh.unwrap();
        assert_eq!(m.node_id, "n2");
        assert_eq!(m.listen.port(), 7001);
        assert_eq!(m.seeds, vec!["127.0.0.1:7000".to_owned()]);
        let e = NodeConfig::from_args(&ServeArgs {
            node_id: Some("n2".into()),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("mesh.certs_dir"), "{e}");
        let single = NodeConfig::from_args(&ServeArgs::default()).unwrap_err();
        assert!(single.to_string().contains("replicas"), "{single}");
    }

    #[test]
    fn mesh_table_is_checked_and_named() {
        let ok = "[mesh]\nnode_id = \"n1\"\ncerts_dir = \"/tmp/x\"\nseeds = [\"127.0.0.1:7000\"]\n\
                  [[mesh.distance]]\na = \"eu\"\nb = \"us\"\nms = 80.0\n";
        let c = NodeConfig::from_toml(ok).unwrap();
        let m = c.mesh.unwrap();
        assert_eq!(m.gossip_interval_ms, 200);
        assert_eq!(m.warm_forward_interval_ms, 20_000);
        assert_eq!(m.distance[0].ms, 80.0);
        assert_eq!(m.distance[0].kv_link(60.0), None);
        let linked = format!("{ok}kv_gb_per_s = 50.0\n");
        let m = NodeConfig::from_toml(&linked).unwrap().mesh.unwrap();
        let link = m.distance[0].kv_link(60.0).unwrap();
        assert_eq!((link.gb_per_s, link.setup_ms), (50.0, 60.0));
        for (toml, key) in [
            (
                "[mesh]\nnode_id = \"n\"\ncerts_dir = \"/x\"\n[[mesh.distance]]\na = \"x\"\nb = \"y\"\nms = 1.0\nkv_gb_per_s = 0.0",
                "mesh.distance[0].kv_gb_per_s",
            ),
            (
                "[mesh]\nnode_id = \"n\"\ncerts_dir = \"/x\"\n[[mesh.distance]]\na = \"x\"\nb = \"y\"\nms = 1.0\nkv_setup_ms = 5.0",
                "mesh.distance[0].kv_setup_ms",
            ),
            ("[mesh]\ncerts_dir = \"/x\"", "mesh.node_id"),
            ("[mesh]\nnode_id = \"n\"", "mesh.certs_dir"),
            (
                "[mesh]\nnode_id = \"n\"\ncerts_dir = \"/x\"\nca = \"/ca\"",
                "mesh.certs_dir",
            ),
            (
                "[mesh]\nnode_id = \"n\"\ncerts_dir = \"/x\"\nfailure_detection_ms = 50",
                "mesh.failure_detection_ms",
            ),
            (
                "[mesh]\nnode_id = \"n\"\ncerts_dir = \"/x\"\nwarm_forward_interval_ms = 500",
                "mesh.warm_forward_interval_ms",
            ),
            (
                "[mesh]\nnode_id = \"n\"\ncerts_dir = \"/x\"\n[[mesh.distance]]\na = \"x\"\nb = \"y\"\nms = -1.0",
                "mesh.distance[0].ms",
            ),
            ("[mesh]\nnode_id = \"n\"\nplaintext = true", "plaintext"),
            (
                "[mesh]\nnode_id = \"n\"\ncerts_dir = \"/x\"\nlearn_replicas_from = [\"10.0.0.0/33\"]",
                "mesh.learn_replicas_from[0]",
            ),
            (
                "[mesh]\nnode_id = \"n\"\ncerts_dir = \"/x\"\nmax_learned_replicas = 1",
                "mesh.max_learned_replicas_per_peer",
            ),
        ] {
            let e = NodeConfig::from_toml(toml).unwrap_err().to_string();
            assert!(e.contains(key), "{toml:?} → {e}");
        }
    }
}
