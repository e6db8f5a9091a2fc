//! The KV-tier flags of `kvmesh sim` and `kvmesh bench`: a CPU tier on every simulated engine,
//! the link it loads over, and whether the routers weigh CPU hits by that load time.
//!
//! They exist for the load-time figures (docs/benchmarks-notebook.md, "KV location as a routing
//! signal"): a CPU tier only matters when the working set outgrows the GPU cache, and the
//! weighting only when routers can tell a CPU hit from a GPU one, which takes exact (KV-event)
//! home models — `--exact-homes` in the simulator, KV events on in a fleet.

use crate::core::kv_load::KvLoad;
use crate::engine_sim::EngineConfig;

/// KV-tier flags of `kvmesh sim` and `kvmesh bench` (fleet runs).
#[derive(Clone, Debug, Default, clap::Args)]
pub struct TierArgs {
    /// CPU tier of every simulated replica, in tokens (vLLM's offloading connector: computed
    /// blocks written through to host memory, a hit there loaded back). Default none.
    #[arg(long)]
    pub cpu_capacity_tokens: Option<usize>,
    /// Host-to-device link of that tier, GB/s (default 25).
    #[arg(long)]
    pub cpu_gb_per_s: Option<f64>,
    /// Replicas declare their KV size and CPU link to the routers (`[[replicas]] kv_load`), so
    /// CPU hits weigh by load time instead of the fixed `tier_weights`.
    #[arg(long)]
    pub kv_load_routing: bool,
}

impl TierArgs {
    /// Sets the engines' CPU tier.
    pub fn apply_engine(&self, engine: &mut EngineConfig) {
        if let Some(t) = self.cpu_capacity_tokens {
            engine.cpu_capacity_tokens = t;
        }
        if let Some(gb) = self.cpu_gb_per_s {
            engine.cpu_gb_per_s = gb;
        }
    }

    /// What the replicas declare to the routers, from the engine they run (none without
    /// `--kv-load-routing`).
    pub fn kv_load(&self, engine: &EngineConfig) -> Option<KvLoad> {
        self.kv_load_routing.then(|| KvLoad {
            bytes_per_token: engine.kv_bytes_per_token,
            cpu_gb_per_s: engine.cpu_gb_per_s,
            ..KvLoad::default()
        })
    }
}
