//! Prefill/decode disaggregation in `kvmesh bench` fleets: simulated replicas with roles that
//! hand the KV cache over by the protocol the nodes speak (`replica/pd.rs`), and nodes with
//! `[pd]` on, so a live run measures the same shapes as `kvmesh sim --pd`.
//!
//! Kept apart from `fleet.rs` so an ordinary fleet reads as it did; `run_fleet` calls in at the
//! three places a P/D fleet differs: each replica's `[pd]`, each node's replica entry (role and
//! the prefill's bootstrap port) and each node's `[pd]`.

use crate::core::role::Role;
use crate::node::config::{NodeConfig, PdProtocol, ReplicaConfig as NodeReplica};
use crate::replica::{ReplicaConfig, ReplicaHandle};

/// A P/D fleet's shape and hand-over.
#[derive(Clone, Debug, PartialEq)]
pub struct FleetPd {
    /// Each replica's role, by index; sets the fleet's replica count.
    pub roles: Vec<Role>,
    /// The nodes' `[pd] bypass_uncached_tokens` (0 = every request is split when it can be).
    pub bypass_uncached_tokens: u64,
    /// The protocol the nodes and the simulated replicas speak. Default vLLM NIXL.
    pub protocol: PdProtocol,
    /// KV bytes per prompt token crossing the link. Default 131,072 (Llama-3.1-8B, bf16).
    pub kv_bytes_per_token: u64,
    /// The prefill-to-decode link, Gb/s. Default 100.
    pub link_gbps: f64,
}

impl Default for FleetPd {
    fn default() -> Self {
        FleetPd {
            roles: Vec::new(),
            bypass_uncached_tokens: 256,
            protocol: PdProtocol::VllmNixl,
            kv_bytes_per_token: 131_072,
            link_gbps: 100.0,
        }
    }
}

impl FleetPd {
    /// The run's label suffix, as `kvmesh sim` names the same shape: `2P2D@256`.
    pub fn label(&self) -> String {
        let mut shape = String::new();
        let mut i = 0;
        while i < self.roles.len() {
            let role = self.roles[i];
            let n = self.roles[i..].iter().take_while(|r| **r == role).count();
            let letter = match role {
                Role::Prefill => 'P',
                Role::Decode => 'D',
                Role::Both => 'B',
            };
            shape.push_str(&format!("{n}{letter}"));
            i += n;
        }
        format!("{shape}@{}", self.bypass_uncached_tokens)
    }

    /// Replica `i`'s `[pd]`.
    pub(super) fn apply_replica(&self, i: usize, cfg: &mut ReplicaConfig) -> anyhow::Result<()> {
        cfg.pd.role = self.roles.get(i).copied().unwrap_or_default();
        cfg.pd.kv_bytes_per_token = self.kv_bytes_per_token;
        cfg.pd.link_gbps = self.link_gbps;
        cfg.pd
            .validate()
            .map_err(|e| anyhow::anyhow!("P/D fleet: {e}"))
    }

    /// A node's entry for replica `r` (index `i`): its role, and where a prefill serves its
    /// hand-over (the simulated replica serves it on its HTTP port).
    pub(super) fn apply_entry(&self, i: usize, r: &ReplicaHandle, entry: &mut NodeReplica) {
        entry.role = self.roles.get(i).copied().unwrap_or_default();
        if entry.role == Role::Prefill {
            entry.bootstrap_port = Some(r.addr.port());
        }
    }

    /// A node's `[pd]`.
    pub(super) fn apply_node(&self, cfg: &mut NodeConfig) {
        cfg.pd.protocol = Some(self.protocol);
        cfg.pd.bypass_uncached_tokens = self.bypass_uncached_tokens;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_label_names_the_shape_as_the_simulator_does() {
        let pd = FleetPd {
            roles: crate::bench::sim_pd::parse_roles("2P2D").unwrap(),
            bypass_uncached_tokens: 0,
            ..FleetPd::default()
        };
        assert_eq!(pd.label(), "2P2D@0");
        let mixed = FleetPd {
            roles: vec![Role::Both, Role::Prefill, Role::Decode, Role::Decode],
            ..FleetPd::default()
        };
        assert_eq!(mixed.label(), "1B1P2D@256");
    }
}
