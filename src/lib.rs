//! kvmesh: a peer-to-peer mesh of KV-cache-aware request routers for LLM inference fleets.
//!
//! Layout (see ARCHITECTURE.md for the map and each layer's invariants):
//! - [`core`]: the sans-IO routing core — block keys, summaries, cache model, view, policies,
//!   regions, affinity, tenants. Synchronous, deterministic, time passed in.
//! - [`bench`]: workloads (Mooncake trace, synthetic families) and the simulator.

pub mod bench;
pub mod core;
