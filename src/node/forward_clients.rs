//! The HTTP clients a node forwards to other regions' nodes with: one per (node, region) a
//! region record names, so each client's TLS handshake can check that the peer's certificate
//! names that node and binds no other region (`mesh::peer_tls::forward_client_config`) before a
//! byte of a request goes.
//!
//! Exists apart from the proxy, which makes the clients (it owns the mesh certificate), because
//! the node holds them for the forwarding and warm-up tasks alike: a warm-up's connection is in
//! the pool of the very client the next forward uses.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// Clients kept at most: a record names at most three nodes of a region, and a node forwards to
/// a bounded number of regions; past it the cache starts over (records never name that many
/// but a member could churn its targets).
const MAX_CLIENTS: usize = 256;

/// Makes the client for forwards to node `.0` of region `.1`; `None` when it cannot be made.
pub type MakeClient = Box<dyn Fn(&str, &str) -> Option<reqwest::Client> + Send + Sync>;

/// The clients, made on first use.
#[derive(Default)]
pub struct ForwardClients {
    make: OnceLock<MakeClient>,
    clients: Mutex<HashMap<(String, String), reqwest::Client>>,
}

impl std::fmt::Debug for ForwardClients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForwardClients").finish_non_exhaustive()
    }
}

impl ForwardClients {
    /// Installs how clients are made (once, when the mesh starts; later calls are ignored).
    pub fn set_maker(&self, make: MakeClient) {
        let _ = self.make.set(make);
    }

    /// Whether clients can be made (the node is in a mesh with a peer listener).
    pub fn ready(&self) -> bool {
        self.make.get().is_some()
    }

    /// The client for forwards to `node_id` of `region`: the kept one, or a new one.
    pub fn get(&self, node_id: &str, region: &str) -> Option<reqwest::Client> {
        let key = (node_id.to_owned(), region.to_owned());
        if let Some(c) = self.lock().get(&key) {
            return Some(c.clone());
        }
        // Made outside the lock: building a client reads the CA and sets up a pool.
        let made = (self.make.get()?)(node_id, region)?;
        let mut clients = self.lock();
        if clients.len() >= MAX_CLIENTS {
            clients.clear();
        }
        Some(clients.entry(key).or_insert(made).clone())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), reqwest::Client>> {
        self.clients.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn one_client_per_node_and_region_made_once() {
        // reqwest builds with rustls and no provider of its own.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let clients = ForwardClients::default();
        assert!(clients.get("b1", "b").is_none(), "no maker yet");
        let made = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&made);
        clients.set_maker(Box::new(move |_, _| {
            count.fetch_add(1, Ordering::Relaxed);
            Some(reqwest::Client::new())
        }));
        for _ in 0..3 {
            assert!(clients.get("b1", "b").is_some());
        }
        assert!(clients.get("b1", "c").is_some());
        assert_eq!(made.load(Ordering::Relaxed), 2);
    }
}
