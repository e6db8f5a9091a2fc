//! kvmesh: a peer-to-peer mesh of KV-cache-aware request routers for LLM inference fleets.
//!
//! Layout, bottom up (ARCHITECTURE.md is the map, with each layer's invariants; a file only
//! imports from its own layer or the ones before it in this list, and `tests/layout.rs` checks
//! that, and that no file imports itself through others):
//! - [`shutdown`]: the stop signal background tasks watch.
//! - [`core`]: the sans-IO routing core — block keys, summaries, cache model, view, policies,
//!   regions, affinity, tenants. Synchronous, deterministic, time passed in.
//! - [`engine_sim`]: the sans-IO engine model (prefix cache, continuous batching, timing) shared
//!   by the simulated replica and the simulator.
//! - [`kv_events`]: vLLM's KV-event wire format (msgpack codec, ZMQ publisher with replay).
//! - [`tokenize`]: token mode — the model's chat template and tokenizer, so request keys match
//!   engine event keys.
//! - [`replica`]: `kvmesh replica`, a simulated OpenAI-compatible engine server.
//! - [`mesh`]: chitchat gossip over QUIC with mTLS, the state schema, home nodes, summary sync.
//! - [`replicas`]: talking to engines — HTTP probes, the health state machine, DNS sources, the
//!   KV-event subscriber — through narrow traits the node implements.
//! - [`node`]: the live router's state behind one lock, its registry, roles in the mesh,
//!   watcher tasks and configuration.
//! - [`proxy`]: `kvmesh serve`, the HTTP front (OpenAI endpoints, streaming, failover,
//!   forwarding to other regions, admin, metrics).
//! - [`bench`](mod@bench): workloads (Mooncake trace, synthetic families), the discrete-event simulator,
//!   and `kvmesh bench`'s HTTP replay, reports and charts; `kvmesh demo`.

pub mod bench;
pub mod core;
pub mod engine_sim;
pub mod kv_events;
pub mod mesh;
pub mod node;
pub mod proxy;
pub mod replica;
pub mod replicas;
pub mod shutdown;
pub mod tokenize;
