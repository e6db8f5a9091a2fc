//! kvmesh: a peer-to-peer mesh of KV-cache-aware request routers for LLM inference fleets.
//!
//! Layout (see ARCHITECTURE.md for the map and each layer's invariants):
//! - [`core`]: the sans-IO routing core — block keys, summaries, cache model, view, policies,
//!   regions, affinity, tenants. Synchronous, deterministic, time passed in.
//! - [`engine_sim`]: the sans-IO engine model (prefix cache, continuous batching, timing) shared
//!   by the simulated replica and the simulator.
//! - [`kv_events`]: vLLM's KV-event wire format (msgpack codec, ZMQ publisher with replay).
//! - [`mesh`]: chitchat gossip over QUIC with mTLS, the state schema, home nodes, summary sync.
//! - [`replica`]: `kvmesh replica`, a simulated OpenAI-compatible engine server.
//! - [`bench`]: workloads (Mooncake trace, synthetic families), the discrete-event simulator,
//!   and `kvmesh bench`'s HTTP replay, reports and charts.
//! - [`config`]: the node's TOML configuration and CLI flags, validated.
//! - [`node`]: the core's state behind one lock, as the live node drives it.
//! - [`replicas`]: health checks, metrics scrapes, the health state machine and the KV-event
//!   subscribers that make a replica's cache model exact.
//! - [`tokenize`]: token mode — the model's chat template and tokenizer, so request keys match
//!   engine event keys.
//! - [`proxy`]: `kvmesh serve`, the HTTP front (OpenAI endpoints, streaming, failover, admin,
//!   metrics).

pub mod bench;
pub mod config;
pub mod core;
pub mod engine_sim;
pub mod kv_events;
pub mod mesh;
pub mod node;
pub mod proxy;
pub mod replica;
pub mod replicas;
pub mod tokenize;
