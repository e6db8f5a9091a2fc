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
//! - [`bench`]: workloads (Mooncake trace), statistics and the discrete-event simulator.

pub mod bench;
pub mod core;
pub mod engine_sim;
pub mod kv_events;
pub mod mesh;
pub mod replica;
