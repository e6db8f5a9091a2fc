//! Home nodes: which node watches a replica (health, metrics, KV events) and publishes its
//! record and summary.
//!
//! The home of a replica is the rendezvous-hash winner of the replica id over the live nodes of
//! the replica's region. Every node computes it alone from its own membership view and they all
//! agree once gossip has converged; when a node dies only the replicas it was home for move (the
//! others keep their home and its warm cache model), and no coordination is needed.

use std::collections::{BTreeMap, HashMap};

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

/// The live nodes of every region, sorted and deduplicated once with their rendezvous seeds,
/// so the homes of many replicas cost one score per node each (a sync round looks up every
/// replica's home several times). Agrees with [`home_node`] on every replica.
pub struct HomeTable<'a> {
    /// Per region: (node id, its seed), sorted by id, without duplicates.
    by_region: HashMap<&'a str, Vec<(&'a str, u64)>>,
}

impl<'a> HomeTable<'a> {
    /// `live` is (node id, region).
    pub fn new(live: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        let mut by_region: HashMap<&str, Vec<(&str, u64)>> = HashMap::new();
        for (node, region) in live {
            by_region
                .entry(region)
                .or_default()
                .push((node, affinity::replica_seed(node)));
        }
        for nodes in by_region.values_mut() {
            nodes.sort_unstable_by(|a, b| a.0.cmp(b.0));
            nodes.dedup_by(|a, b| a.0 == b.0);
        }
        Self { by_region }
    }

    /// The home of `replica_id` among `region`'s nodes; `None` when the region has none.
    pub fn home(&self, replica_id: &str, region: &str) -> Option<&'a str> {
        let nodes = self.by_region.get(region)?;
        let i = affinity::preferred(replica_id.as_bytes(), nodes.iter().map(|(_, seed)| *seed))?;
        nodes.get(i).map(|(id, _)| *id)
    }
}

/// Homes of many replicas: `replicas` is (replica id, region), `live` is (node id, region).
/// Replicas of a region without live nodes get no home.
pub fn assign_homes<'a>(
    replicas: impl IntoIterator<Item = (&'a str, &'a str)>,
    live: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> BTreeMap<&'a str, &'a str> {
    let table = HomeTable::new(live);
    replicas
        .into_iter()
        .filter_map(|(replica, region)| Some((replica, table.home(replica, region)?)))
        .collect()
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
        /// The table answers what `home_node` answers, duplicates and other regions aside.
        #[test]
        fn the_table_agrees_with_home_node(n in 1usize..16, dup in 0usize..4, replicas in 1usize..100) {
            let nodes: Vec<String> = (0..n).map(|i| format!("node-{i}")).collect();
            let mut live: Vec<(&str, &str)> = nodes.iter().map(|s| (s.as_str(), "eu")).collect();
            live.extend(nodes.iter().take(dup).map(|s| (s.as_str(), "eu")));
            live.push(("other", "us"));
            let table = HomeTable::new(live.iter().copied());
            for r in 0..replicas {
                let id = format!("replica-{r}");
                prop_assert_eq!(table.home(&id, "eu"), home_node(&id, nodes.iter().map(|s| s.as_str())));
            }
            prop_assert_eq!(table.home("r", "ap"), None);
        }

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
