//! The node: the routing core's state as the live router drives it, and everything that keeps
//! that state true — the replica registry, what replicas report, the node's mesh roles — with
//! its configuration.
//!
//! Two doors lead in. The HTTP front (`proxy/`) calls [`Node::route`] and holds the returned
//! [`Ticket`] while the response streams; the mesh (`mesh/`) calls the node through the
//! `MeshHandler` it installs (summary requests, block reports) and the sync loop here feeds it
//! gossip. Below the node, `replicas/` talks to engines and reports through narrow traits
//! ([`crate::replicas::kv_events::KvEventSink`], [`crate::replicas::dns::ReplicaRegistry`]) that
//! the node implements, so nothing below imports it.
//!
//! Layout (each file imports its siblings by path; this file only declares and re-exports):
//! - [`state`]: [`Node`] and the [`Core`] behind its one std mutex (view, router, per-replica
//!   runtime); time, locking, endpoints.
//! - [`registry`]: [`Node::new`]; adding, bringing back and draining replicas.
//! - [`routing`]: [`Node::route`], token-mode keys, and the [`Ticket`] that releases a routed
//!   request's accounting exactly once.
//! - [`feedback`]: checks, scrapes, request outcomes and KV events folded into health, load and
//!   cache models; the periodic upkeep.
//! - [`snapshot`]: `/ready`, `/v1/models`, `/admin/state`.
//! - [`watchers`]: the tasks that probe replicas, follow KV events and DNS.
//! - [`mesh_state`], [`mesh_roles`], [`mesh_loop`]: the node in a mesh — its data, the home and
//!   follower roles under the lock, and the async sync loop.
//! - [`metrics`]: the Prometheus metrics the node serves.
//! - [`config`]: `NodeConfig` and `kvmesh serve`'s flags, assembling the sections the
//!   subsystems own.

pub mod config;
pub mod feedback;
pub mod mesh_loop;
pub mod mesh_roles;
pub mod mesh_state;
pub mod metrics;
pub mod registry;
pub mod routing;
pub mod snapshot;
pub mod state;
pub mod watchers;

pub use mesh_state::{MeshStateJson, Peer, PullKind};
pub use routing::Ticket;
pub use snapshot::{NodeState, ReplicaStateJson};
pub use state::{Core, Endpoint, Node, ReplicaRuntime};
