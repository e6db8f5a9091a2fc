//! The mesh: how nodes find each other, share small state and pull summary bodies.
//!
//! Membership, failure detection and small per-node state go through chitchat (`=0.11.2`, the
//! last version whose messages an out-of-tree transport can serialize) over a QUIC transport
//! with mutual TLS against a cluster CA. Summary bodies and routed-block reports travel on
//! QUIC streams of the same endpoint. Nothing here decides anything: the node feeds what the
//! mesh learns into the core's `View`.
//!
//! - [`admin`]: operator commands (`kvmesh replicas add|drain|rm`) as `admin:<id>` records.
//! - [`allow`]: the allow-list of hosts replicas learned from gossip may live at.
//! - [`certs`]: cluster CA and node certificates; rustls/quinn configurations (mTLS, TLS 1.3).
//! - [`cert_resolver`]: the certificate every TLS configuration presents, replaceable at run
//!   time (rotation without restart).
//! - [`directory`]: which nodes of a region a seed knows (joining one's regional cluster).
//! - [`udp_count`]: every UDP byte of the endpoint.
//! - [`transport`]: the QUIC endpoint — chitchat `Transport`, stream kinds, counters, RTT,
//!   partition injection.
//! - [`signed`]: owner-signed values (the envelope, this node's signer, certificate checks).
//! - [`gossip_guard`]: every gossiped value checked against its publisher before chitchat sees
//!   it; region and operator authority; keys per member capped.
//! - [`schema`]: the versioned gossip keys and their ≤ 1 KiB msgpack values.
//! - [`hot_record`]: the `hot` record, a node's heaviest prefixes (hot-prefix replication).
//! - `member_decode`: members' chitchat states read into `Member`s, once per change.
//! - [`home`]: which node is home for a replica (rendezvous over live nodes of its region).
//! - [`seeds`]: `srv:<name>` seeds through DNS SRV (hickory).
//! - [`sync`]: summary request/response and block reports; the [`MeshHandler`] the node plugs in.
//! - [`peer_tls`]: HTTPS with the cluster certificates, for requests forwarded between nodes.
//! - [`load_share`]: in-flight load sent to the region's nodes as QUIC datagrams, and merged.
//! - [`region_layer`], [`region_record`], [`regional`]: regional gossip — each region its own
//!   cluster, regions exchanging one record each through their representatives.
//! - [`cluster`]: [`Mesh`], the handle the node holds.

pub mod admin;
pub mod allow;
pub mod cert_resolver;
pub mod certs;
pub mod cluster;
pub mod directory;
pub mod gossip_guard;
pub mod home;
pub mod hot_record;
pub mod load_share;
pub mod member;
mod member_decode;
pub mod peer_tls;
pub mod region_layer;
pub mod region_record;
pub mod regional;
pub mod replica_load;
pub mod schema;
pub mod seeds;
pub mod signed;
pub mod sync;
pub mod transport;
pub mod udp_count;

pub use cluster::{GossipLayout, Member, Mesh, MeshConfig, MeshError, MeshStats, ReplicaEntry};
pub use sync::{BlockReport, MeshHandler, SummaryRequest, SyncError};
