//! Home nodes: which node watches a replica (health, metrics, KV events) and publishes its
//! record and summary.
//!
//! The home of a replica is the rendezvous-hash winner of the replica id over the live nodes of
//! the replica's region. Every node computes it alone from its own membership view and they all
//! agree once gossip has converged; when a node dies only the replicas it was home for move (the
//! others keep their home and its warm cache model), and no coordination is needed.

use std::collections::BTreeMap;

use crate::core::affinity;

/// The home of `replica_id` among `nodes` (node ids of the replica's region that are live), or
/// `None` when there is none. Independent of the order of `nodes` and of duplicates.
pub fn home_node<'a>(
    replica_id: &str,
    nodes: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    let mut ids: Vec<&str> = nodes.into_iter().collect();
    // Sorted and deduplicated so a (vanishingly rare) score tie resolves the same on every node.
    ids.sort_unstable();
    ids.dedup();
    let i = affinity::preferred(
        replica_id.as_bytes(),
        ids.iter().map(|id| affinity::replica_seed(id)),
    )?;
    ids.get(i).copied()
}

/// Homes of many replicas: `replicas` is (replica id, region), `live` is (node id, region).
/// Replicas of a region without live nodes get no home.
pub fn assign_homes<'a>(
    replicas: impl IntoIterator<Item = (&'a str, &'a str)>,
    live: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> BTreeMap<&'a str, &'a str> {
    let mut by_region: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (node, region) in live {
        by_region.entry(region).or_default().push(node);
    }
    let mut out = BTreeMap::new();
    for (replica, region) in replicas {
        if let Some(nodes) = by_region.get(region) {
            if let Some(home) = home_node(replica, nodes.iter().copied()) {
                out.insert(replica, home);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn deterministic_and_order_independent() {
        let nodes = ["n1", "n2", "n3", "n4"];
        let rev = ["n4", "n3", "n2", "n1", "n2"];
        for r in 0..100 {
            let id = format!("replica-{r}");
            assert_eq!(home_node(&id, nodes), home_node(&id, rev));
        }
        assert_eq!(home_node("r", []), None);
        // Homes spread over the nodes.
        let mut counts = BTreeMap::new();
        for r in 0..400 {
            let id = format!("replica-{r}");
            *counts.entry(home_node(&id, nodes).unwrap()).or_insert(0) += 1;
        }
        assert!(counts.values().all(|c| (60..140).contains(c)), "{counts:?}");
    }

    #[test]
    fn homes_stay_in_the_replica_region() {
        let live = [("a1", "eu"), ("a2", "eu"), ("b1", "us")];
        let replicas = [("r-eu", "eu"), ("r-us", "us"), ("r-ap", "ap")];
        let homes = assign_homes(replicas, live);
        assert!(["a1", "a2"].contains(homes.get("r-eu").unwrap()));
        assert_eq!(homes.get("r-us"), Some(&"b1"));
        assert_eq!(homes.get("r-ap"), None);
    }

    proptest! {
        /// When a node dies, only the replicas it was home for move.
        #[test]
        fn only_the_dead_nodes_replicas_move(n in 2usize..12, dead in 0usize..12, replicas in 1usize..200) {
            let dead = dead % n;
            let nodes: Vec<String> = (0..n).map(|i| format!("node-{i}")).collect();
            let survivors: Vec<&str> = nodes.iter().enumerate().filter(|(i, _)| *i != dead).map(|(_, s)| s.as_str()).collect();
            let mut moved = 0;
            for r in 0..replicas {
                let id = format!("replica-{r}");
                let before = home_node(&id, nodes.iter().map(|s| s.as_str())).unwrap();
                let after = home_node(&id, survivors.iter().copied()).unwrap();
                if before == nodes[dead] {
                    prop_assert_ne!(after, before);
                    moved += 1;
                } else {
                    prop_assert_eq!(after, before);
                }
            }
            prop_assert!(moved <= replicas);
        }
    }
}
