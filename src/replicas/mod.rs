//! Replicas: talking to engine endpoints and turning what they say into the routing core's
//! inputs. Nothing here holds the node's state: each piece answers or reports, and the node
//! (`node/watchers.rs`, `node/feedback.rs`) decides what it means.
//!
//! - [`entry`]: one registry entry (a `[[replicas]]` table, or what a DNS source found).
//! - [`probe`]: `/health`, `/v1/models` and `/metrics` over HTTP, bounded.
//! - [`prom`]: the Prometheus text reader for vLLM / SGLang load names.
//! - [`health`]: the sans-IO health state machine (active checks + passive ejection).
//! - [`dns`]: DNS sources (SRV or A/AAAA, TTL re-resolve) and the registry they feed.
//! - [`k8s`]: Kubernetes sources (EndpointSlices, listed and watched) feeding the same registry.
//! - [`kv_stream`], [`kv_index`], [`kv_events`]: an engine's KV-event stream, from ZMQ frames to
//!   cache-model operations, through the [`kv_events::KvEventSink`] the node implements.
//! - [`zmtp`]: the bounded ZMTP 3 client (SUB, DEALER) those streams read through.

pub mod dns;
pub mod entry;
pub mod health;
pub mod inference_pool;
pub mod k8s;
pub mod k8s_api;
pub mod k8s_config;
pub mod kv_events;
pub mod kv_index;
pub mod kv_stream;
pub mod probe;
pub mod prom;
pub mod zmtp;
