//! The node's record of operator commands (`admin.rs` applies them): kept apart so the
//! node's state can hold it without importing the code that drives it.

use std::collections::{BTreeMap, HashMap};

use crate::mesh::admin::AdminRecord;

/// What this node knows of operator commands.
#[derive(Debug, Default)]
pub struct AdminBook {
    /// Replica id → (stamp, node id) of the newest command applied here.
    pub(super) applied: HashMap<String, (u64, String)>,
    /// This node's own commands, published as `admin:<id>` (at most `MAX_ADMIN_RECORDS`).
    pub(super) own: BTreeMap<String, AdminRecord>,
    /// Own records to publish (`Some`) or withdraw (`None`) at the next gossip round.
    pub(super) outbox: Vec<(String, Option<AdminRecord>)>,
    /// Replica id → the peer whose drain holds it here: the drain lasts while that peer is a
    /// live member publishing it, and no longer (a departed member's drain does not outlive it).
    pub(super) peer_drains: HashMap<String, String>,
}
