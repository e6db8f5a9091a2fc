//! What `kvmesh sim` is asked to simulate ([`SimConfig`], [`NodeFailure`]) and what a run
//! measured ([`SimReport`]).

use crate::core::region_choice::ForwardChoice;
use std::collections::HashMap;
use std::time::Duration;

use serde::Serialize;

use super::sim_pd::{PdStats, SimPd};
use super::stats::Distribution;
use crate::core::cost::CostModel;
use crate::core::hot_prefix::HotPrefixConfig;
use crate::core::policy::PolicyKind;
use crate::core::priority::PrioritiesConfig;
use crate::core::tenants::TenantConfig;
use crate::engine_sim::EngineConfig;

/// A node that fails during the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeFailure {
    /// The node's index (0-based).
    pub node: usize,
    /// When, counted from the first arrival.
    pub at: Duration,
}

impl std::str::FromStr for NodeFailure {
    type Err = String;

    /// `NODE@SECONDS`, e.g. `0@30` (node 0 fails 30 s into the run).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (node, at) = s
            .split_once('@')
            .ok_or_else(|| format!("'{s}': expected NODE@SECONDS, e.g. 0@30"))?;
        let node = node
            .trim()
            .parse()
            .map_err(|_| format!("'{s}': node must be an index"))?;
        let at: f64 = at
            .trim()
            .parse()
            .map_err(|_| format!("'{s}': seconds must be a number"))?;
        if !(at.is_finite() && at >= 0.0) {
            return Err(format!("'{s}': seconds must be ≥ 0"));
        }
        let at =
            Duration::try_from_secs_f64(at).map_err(|_| format!("'{s}': seconds out of range"))?;
        Ok(NodeFailure { node, at })
    }
}

/// What to simulate.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Router nodes. Default 3.
    pub nodes: usize,
    /// Engine replicas. Default 8.
    pub replicas: usize,
    /// Regions; node `n` and replica `r` live in region `n % regions`, `r % regions`. Default 1.
    pub regions: usize,
    /// Share of the arrivals each region's nodes take (clients near that region), by region
    /// index; empty (default): every live node alike. A region left out or at 0 takes none.
    pub entry_weights: Vec<f64>,
    /// Round-trip time between neighbouring regions; regions lie on a line, so regions `a` and `b`
    /// are `|a − b| × region_rtt` apart. Default 50 ms.
    pub region_rtt: Duration,
    /// Routing policy of every node. Default `p2c-cache`.
    pub policy: PolicyKind,
    /// The cost formula's parameters, as the nodes' `[routing]` config sets them. Default: the
    /// core's defaults.
    pub cost: CostModel,
    /// How a forwarded request's region is chosen (the nodes' `forward_by`). Default by cost.
    pub forward_by: ForwardChoice,
    /// `p2c-cache`'s eviction charge (the nodes' `evict_charge`). Default: the core's.
    pub evict_charge: f64,
    /// A prompt whose longest prefix another region holds (the nodes' `remote_prefix`):
    /// recompute here (default), or weigh forwarding, or pulling too. In the flat layout a node
    /// then also holds other regions' replicas' summaries, as a live node does.
    pub remote_prefix: crate::core::remote_prefix::RemotePrefixMode,
    /// Seed of every random choice. Default 1.
    pub seed: u64,
    /// Gossip round length. Default 100 ms.
    pub gossip_interval: Duration,
    /// Peers each node exchanges state with per round. Default 3 (chitchat's).
    pub gossip_fanout: usize,
    /// How gossip is laid out (`sim_bytes.rs`): `flat`, one cluster of every node, so news
    /// of any replica travels an epidemic over all nodes; or `regional`, a cluster per region
    /// (news of the region's replicas travels over its nodes only) and a cluster of the
    /// regions' representatives, through which other regions' state arrives as region records,
    /// refreshed every `region_interval`. Default regional.
    pub gossip_layout: super::sim_bytes::GossipLayout,
    /// With the regional layout: the representatives' gossip interval, which is also how often
    /// a region's record is refreshed. Default 500 ms.
    pub region_interval: Duration,
    /// Nodes that fail, and when. Default none.
    pub failures: Vec<NodeFailure>,
    /// How long the others take to declare a silent node dead. Default 2 s (the mesh's default).
    pub failure_detection: Duration,
    /// The engine model of every replica. Default: 8B on one H100.
    pub engine: EngineConfig,
    /// Routing-text block size. Default 256 bytes.
    pub block_bytes: usize,
    /// Workload arrival times are divided by this (2.0 = twice the workload's rate). Default 1.
    pub arrival_speedup: f64,
    /// Replay only the first N requests. Default: all.
    pub max_requests: Option<usize>,
    /// Print a progress line to stderr while running (the CLI's fleet-scale runs take minutes).
    /// Default off.
    pub progress: bool,
    /// Run the central greedy router instead (one router reading the engines' true state and
    /// picking the lowest predicted TTFT per request; a reference, not an upper bound).
    pub oracle: bool,
    /// How often a replica's home scrapes the engine's `/metrics` (waiting, running, KV usage),
    /// which then reach the nodes by gossip. Default 1 s (the node's `scrape.interval_ms`).
    pub scrape_interval: Duration,
    /// Least time between two publications of a replica's summary version by its home (the
    /// node's `mesh.replica_load_interval_ms`; a new epoch goes out at once). Default 1 s.
    pub replica_load_interval: Duration,
    /// How late a node's routing reaches the other nodes of its region (load sharing, see
    /// `mesh/load_share.rs`: flush interval plus half a round trip); `None` = load sharing off,
    /// peers' requests are then seen only in the engines' scraped counts. Default 2 ms.
    pub load_share_delay: Option<Duration>,
    /// Tenant policies of every node (`[tenants.<name>]`; unlisted tenants get the default,
    /// no limits). KV quotas (`max_kv_share`) steer on each replica's tenant shares as its home's
    /// cache model estimates them, published with its summary. Default none.
    pub tenants: HashMap<String, TenantConfig>,
    /// Report this tenant's requests apart from every other tenant's (hit ratio, TTFT), e.g.
    /// `big` of the tenants family. Default none.
    pub split_tenant: Option<String>,
    /// Hot-prefix replication of every node (`[hot_prefix]`, see `core::hot_prefix`): off
    /// unless `enabled`. Warm-ups go to the engines as prefill-only requests; the rendezvous
    /// owner of a prefix among its region's live nodes sends them. Default off.
    pub hot_prefix: HotPrefixConfig,
    /// Report the TTFT of the requests arriving in this window of workload time, `(start s,
    /// length s)`, apart (e.g. the first 10 s of a burst). Default none.
    pub window: Option<(f64, f64)>,
    /// Data-parallel ranks per replica, each an engine of `engine` with its own prefix cache
    /// (`engine_sim::DpEngine`; a replica's KV capacity and prefill rate are the ranks'
    /// together). Default 1.
    pub dp_ranks: usize,
    /// With `dp_ranks` > 1: whether the router names the rank (from the ranks' caches and
    /// queues, as a home with KV events does), else the replica's balancer picks it (fewest in
    /// flight). Default true.
    pub dp_rank_named: bool,
    /// The KV size and CPU link every replica declares to the routers (`[[replicas]] kv_load`),
    /// so their cost model weighs CPU hits by load time; `None`: the fixed `tier_weights`.
    /// What the engines really do is `engine`'s CPU tier. Default none.
    pub kv_load: Option<crate::core::kv_load::KvLoad>,
    /// Home nodes keep exact cache models fed by the engines' KV events (tiers included, from
    /// each event's medium), as with `kv_events` configured; otherwise approximate ones from
    /// routed requests. Default off.
    pub exact_homes: bool,
    /// Priority classes and an admission queue at every node (as a node's `[priorities]`);
    /// none: a full replica queues requests in its engine, as without the section. Default
    /// none.
    pub priorities: Option<PrioritiesConfig>,
    /// Every replica's `max_in_flight`. Default: the engine's `max_num_seqs`.
    pub max_in_flight: Option<u32>,
    /// Prefill/decode disaggregation (replica roles, bypass, KV link); `None` = every replica
    /// runs whole requests. Default none.
    pub pd: Option<SimPd>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            nodes: 3,
            replicas: 8,
            regions: 1,
            region_rtt: Duration::from_millis(50),
            policy: PolicyKind::P2cCache,
            cost: CostModel::default(),
            forward_by: ForwardChoice::Cost,
            evict_charge: crate::core::policy::DEFAULT_EVICT_CHARGE,
            remote_prefix: crate::core::remote_prefix::RemotePrefixMode::Local,
            entry_weights: Vec::new(),
            seed: 1,
            gossip_interval: Duration::from_millis(100),
            gossip_fanout: 3,
            gossip_layout: super::sim_bytes::GossipLayout::Regional,
            region_interval: Duration::from_millis(500),
            failures: Vec::new(),
            failure_detection: Duration::from_secs(2),
            engine: EngineConfig::default(),
            block_bytes: 256,
            arrival_speedup: 1.0,
            max_requests: None,
            progress: false,
            oracle: false,
            scrape_interval: Duration::from_secs(1),
            replica_load_interval: Duration::from_secs(1),
            load_share_delay: Some(Duration::from_millis(2)),
            tenants: HashMap::new(),
            split_tenant: None,
            hot_prefix: HotPrefixConfig::default(),
            window: None,
            dp_ranks: 1,
            dp_rank_named: true,
            kv_load: None,
            exact_homes: false,
            priorities: None,
            max_in_flight: None,
            pd: None,
        }
    }
}

impl SimConfig {
    pub(super) fn validate(&self) -> Result<(), SimError> {
        let bad = |m: &str| Err(SimError::Config(m.into()));
        if self.nodes == 0 || self.replicas == 0 {
            return bad("nodes and replicas must be at least 1");
        }
        if self.regions == 0 || self.regions > self.nodes.min(self.replicas) {
            return bad("regions must be at least 1 and at most min(nodes, replicas)");
        }
        if !(self.arrival_speedup.is_finite() && self.arrival_speedup > 0.0) {
            return bad("arrival_speedup must be > 0");
        }
        if self.scrape_interval.is_zero() {
            return bad("scrape interval must be > 0");
        }
        if self.gossip_interval.is_zero() || self.gossip_fanout == 0 {
            return bad("gossip interval and fan-out must be > 0");
        }
        if self.region_interval.is_zero() {
            return bad("region interval must be > 0");
        }
        if let Some(f) = self.failures.iter().find(|f| f.node >= self.nodes) {
            return Err(SimError::Config(format!(
                "failure of node {} but there are only {} nodes",
                f.node, self.nodes
            )));
        }
        if let Some((start, len)) = self.window {
            if !(start.is_finite() && len.is_finite() && start >= 0.0 && len > 0.0) {
                return bad("window must be START:LEN with START ≥ 0 and LEN > 0 seconds");
            }
        }
        self.hot_prefix.validate().map_err(SimError::Config)?;
        if self.max_in_flight == Some(0) {
            return bad("max_in_flight must be at least 1");
        }
        if let Some(p) = &self.priorities {
            p.validate()
                .map_err(|(k, m)| SimError::Config(format!("priorities.{k}: {m}")))?;
        }
        if let Some(pd) = &self.pd {
            pd.validate(self.replicas, self.oracle)
                .map_err(SimError::Config)?;
        }
        self.engine
            .validate()
            .map_err(|e| SimError::Config(e.to_string()))
    }

    /// Round-trip time between regions `a` and `b`.
    pub(super) fn rtt(&self, a: usize, b: usize) -> Duration {
        self.region_rtt * a.abs_diff(b) as u32
    }
}

/// What a run measured.
#[derive(Clone, Debug, Serialize)]
pub struct SimReport {
    /// Policy name (`central-greedy` for the central reference router).
    pub policy: String,
    /// Router nodes.
    pub nodes: usize,
    /// Replicas.
    pub replicas: usize,
    /// Regions.
    pub regions: usize,
    /// Requests replayed.
    pub requests: usize,
    /// Requests that could not be routed or submitted, or were lost with a failed node.
    pub errors: usize,
    /// Of the errors: requests in flight through a node when it failed.
    pub lost: usize,
    /// Requests served by a replica outside their client's region.
    pub cross_region: usize,
    /// Requests forwarded to another region's node.
    pub forwarded: usize,
    /// Replicas that got a new home after their home node failed.
    pub rehomed: usize,
    /// Gossip rounds news takes to reach a node: median and largest over the fleet.
    pub gossip_hops_p50: u32,
    /// See `gossip_hops_p50`.
    pub gossip_hops_max: u32,
    /// The gossip layout simulated (`flat` or `regional`).
    pub gossip_layout: String,
    /// With the regional layout and several regions: seconds by which a node's news of other
    /// regions' replicas lags its news of its own region's, median over the nodes (0 otherwise).
    pub remote_extra_lag_s: f64,
    /// Requests per second arriving: requests over the span of their arrivals (the rate the
    /// byte model is evaluated at).
    pub arrival_rate: f64,
    /// Modelled gossip bytes per node (`sim_bytes.rs`), sent + received, in this run's layout:
    /// idle and at `arrival_rate`.
    pub mesh_bytes_idle: super::sim_bytes::NodeBytes,
    /// See `mesh_bytes_idle`.
    pub mesh_bytes: super::sim_bytes::NodeBytes,
    /// Time to first token, seconds (requests not lost).
    pub ttft: Distribution,
    /// Every time to first token, seconds, ascending (for the CDF chart; not in the JSON).
    #[serde(skip)]
    pub ttft_samples: Vec<f64>,
    /// End-to-end latency, seconds (requests not lost).
    pub latency: Distribution,
    /// Inter-token latency, seconds: per request of two or more output tokens, (latency −
    /// TTFT) / (output tokens − 1).
    pub itl: Distribution,
    /// Pairs, bypasses and transfer times (when the fleet has roles).
    pub pd: Option<PdStats>,
    /// Prompt tokens sent.
    pub prompt_tokens: u64,
    /// Prompt tokens the engines served from their prefix caches.
    pub cached_tokens: u64,
    /// cached / prompt tokens.
    pub hit_token_ratio: f64,
    /// Of `cached_tokens`: those the engines loaded from their CPU tiers.
    pub cpu_hit_tokens: u64,
    /// Requests served by each replica.
    pub requests_per_replica: Vec<u64>,
    /// Largest replica share over the mean share.
    pub load_max_over_mean: f64,
    /// Virtual time from the first arrival to the last completion, seconds.
    pub virtual_seconds: f64,
    /// Requests a tenant's KV quota steered off some replica.
    pub kv_steered: usize,
    /// Requests of a tenant over its KV quota everywhere that went by the policy because the
    /// replicas it dominates queued too long.
    pub kv_overflowed: usize,
    /// KV pulls the decisions planned (`[kv_fetch]`), and what they moved.
    pub kv_fetch: FetchStats,
    /// `split_tenant`'s requests and every other tenant's, apart (when it was set).
    pub tenant_split: Option<TenantSplit>,
    /// Time to first token of the requests arriving in `SimConfig::window` (when it was set).
    pub window_ttft: Option<Distribution>,
    /// Hot-prefix warm-ups sent (0 with replication off).
    pub warmups: u64,
    /// Of them, cancelled because the heat passed before they finished.
    pub warmups_cancelled: u64,
    /// Prompt tokens the engines prefilled for warm-ups (not served from their caches).
    pub warmup_prefill_tokens: u64,
    /// Warm-up prefill ÷ all prefill (the requests' uncached tokens plus the warm-ups').
    pub warmup_prefill_share: f64,
    /// Most prefixes any node counted hot at once (sampled at its plans).
    pub hot_prefixes_max: usize,
    /// Requests refused by the admission queues (with priorities).
    pub refused: usize,
    /// Per priority class (a request's tenant's `priority`, else the default class).
    pub classes: Vec<super::sim_classes::ClassStats>,
}

/// One tenant's requests and the others', measured apart.
#[derive(Clone, Debug, Serialize)]
pub struct TenantSplit {
    /// The tenant split off.
    pub tenant: String,
    /// Its requests.
    pub this: GroupStats,
    /// Every other request.
    pub others: GroupStats,
}

/// Hit ratio and TTFT of a group of requests.
#[derive(Clone, Debug, Default, Serialize)]
pub struct GroupStats {
    /// Requests that got a first token.
    pub requests: usize,
    /// Their prompt tokens served from prefix caches ÷ their prompt tokens.
    pub hit_token_ratio: f64,
    /// Their times to first token, seconds.
    pub ttft: Distribution,
}

/// A simulation that failed to start.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// Bad configuration.
    #[error("invalid simulation config: {0}")]
    Config(String),
}

/// KV pulls in a simulated run (`core::kv_fetch`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct FetchStats {
    /// Decisions that planned a pull.
    pub planned: u64,
    /// Of those, pulls whose source held none of the blocks by then (recomputed).
    pub missed: u64,
    /// Prompt tokens moved between replicas.
    pub tokens: u64,
    /// Transfer seconds, summed.
    pub seconds: f64,
}
