//! Replicas: talking to engine endpoints and turning what they say into the routing core's
//! inputs. Nothing here holds the node's state: each piece answers or reports, and the node
//! (`node/watchers.rs`, `node/feedback.rs`) decides what it means.
//!
//! - [`config`]: one `[[replicas]]` entry of the static registry.
//! - [`probe`]: `/health`, `/v1/models` and `/metrics` over HTTP, bounded.
//! - [`prom`]: the Prometheus text reader for vLLM / SGLang load names.
//! - [`health`]: the sans-IO health state machine (active checks + passive ejection).
//! - [`dns`]: DNS sources (SRV or A/AAAA, TTL re-resolve) and the registry they feed.
//! - [`kv_stream`], [`kv_index`], [`kv_events`]: an engine's KV-event stream, from ZMQ frames to
//!   cache-model operations, through the [`kv_events::KvEventSink`] the node implements.

pub mod config;
pub mod dns;
pub mod health;
pub mod kv_events;
pub mod kv_index;
pub mod kv_stream;
pub mod probe;
pub mod prom;
