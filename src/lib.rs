//! kvmesh: a peer-to-peer mesh of KV-cache-aware request routers for LLM inference fleets.

pub mod engine_sim;
pub mod kv_events;
pub mod replica;
