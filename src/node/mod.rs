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
//! - `state.rs`: [`Node`] and the [`Core`] behind its one std mutex (view, router, per-replica
//!   runtime); time, locking, endpoints.
//! - `registry.rs`: [`Node::new`]; adding, bringing back, draining and dropping replicas.
//! - `admin.rs`: operator commands — add, drain, remove replicas at run time, mesh-wide.
//! - `reload.rs`: [`Node::reload`] — replicas, tenants and routing parameters from a reloaded
//!   configuration (SIGHUP).
//! - `learned.rs`: replicas learned from gossip — the home rule, allow-list, caps and expiry.
//! - `routing.rs`: [`Node::route`], token-mode keys, and the [`Ticket`] that releases a routed
//!   request's accounting exactly once.
//! - `hold.rs`: [`Holds::before_send`] — a request waits for the first byte of the prefill
//!   it rides on at its replica (`core::hold`), so the engine finds the prompt cached.
//! - `kv_shares.rs`: tenants' KV shares in a mesh — the home publishes its estimate, the other
//!   nodes steer on it.
//! - `admission.rs`: [`Node::route_fair`] — with `[priorities]`, requests wait for a slot in a
//!   bounded fair queue per priority class instead of going to a full replica or a 429;
//!   `admission_queue.rs`: the queue's payload, metrics and refusals the state holds.
//! - `feedback.rs`: checks, scrapes, request outcomes and KV events folded into health, load and
//!   cache models; the periodic upkeep.
//! - `forward_clients.rs`: the clients forwards to other regions go through, one per node named.
//! - `hot_prefix.rs`: hot-prefix replication — counting, merging peers' heat, warm-ups.
//! - `snapshot.rs`: `/ready`, `/v1/models`, `/admin/state`.
//! - `watchers.rs`: the tasks that probe replicas, follow KV events and DNS.
//! - `mesh_state.rs`, `mesh_roles.rs`, `mesh_loop.rs`: the node in a mesh — its data, the home and
//!   follower roles under the lock, and the async sync loop.
//! - `metrics.rs`: the Prometheus metrics the node serves.
//! - [`config`]: `NodeConfig` and `kvmesh serve`'s flags, assembling the sections the
//!   subsystems own.

mod admin;
mod admin_book;
mod admission;
mod admission_queue;
pub mod config;
mod feedback;
mod forward_clients;
mod hold;
mod hot_prefix;
mod kv_gossip;
mod kv_shares;
mod learned;
mod load_share;
pub(crate) mod mesh_loop;
mod mesh_roles;
mod mesh_state;
mod metrics;
mod pd_routing;
mod registry;
mod reload;
mod remote_regions;
mod routing;
mod snapshot;
mod state;
pub(crate) mod watchers;

pub use admin::{AdminError, AdminOutcome, AdminReplica};
pub use admission_queue::{refusal_label, QueueMetrics, Refused};
pub use forward_clients::{ForwardClients, MakeClient};
pub use hold::{HoldOutcome, Holds};
pub use mesh_state::{MemberJson, MeshStateJson, Peer, ReplicaMeshJson};
pub use metrics::{MeshMetrics, Metrics};
pub use pd_routing::PdRoute;
pub use reload::ReloadReport;
pub use routing::{RankTarget, Ticket, DP_RANK_FIELD, DP_RANK_HEADER};
pub use snapshot::{NodeState, ReplicaStateJson};
pub use state::{Core, Endpoint, Node, ReplicaRuntime};
