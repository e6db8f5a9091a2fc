//! kvmesh: a peer-to-peer mesh of KV-cache-aware request routers for LLM inference fleets.
//!
//! Layout (see ARCHITECTURE.md for the map and each layer's invariants):
//! - [`core`]: the sans-IO routing core — block keys, summaries, cache model, view, policies,
//!   regions, affinity, tenants. Synchronous, deterministic, time passed in.
//! - [`config`]: the node's TOML configuration and CLI flags, validated.
//! - [`node`]: the core's state behind one lock, as the live node drives it.
//! - [`replicas`]: health checks, metrics scrapes and the health state machine.
//! - [`proxy`]: the HTTP front (OpenAI endpoints, streaming, failover, admin, metrics).

pub mod config;
pub mod core;
pub mod node;
pub mod proxy;
pub mod replicas;
