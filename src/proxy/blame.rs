//! Who failed: the replica or the request.
//!
//! Exists because passive ejection must punish replicas, not clients. A request whose content a
//! replica refuses — a body over its proxy's size limit, a prompt that crashes the engine's
//! parser — fails the same way on every replica it is retried on; counting each failure against
//! the replica lets one client eject the whole fleet with a few requests. So a failed attempt is
//! held against its replica only once the evidence says the replica was at fault:
//!
//! - a connect error at once (it says nothing about the request);
//! - any other failure (reset mid-upload, first-byte timeout, 5xx) when another replica then took
//!   the same request, or when it was the request's only attempt — except a first-byte timeout
//!   as the only attempt: a long request (a whole completion that takes longer than the
//!   timeout) times out wherever it runs, so it counts against the replica only when the
//!   replica is failing other requests too (its consecutive failures are above zero);
//! - never when the request failed on two or more replicas and succeeded nowhere, nor when a
//!   big body (over 1 MiB) was cut mid-upload wherever it was tried: then the request is blamed
//!   (counted in `kvmesh_upstream_failures_total{blame="request"}`).
//!
//! A hung or broken replica is still ejected: the next replica serves its requests, which blames
//! it (the first-byte timeouts leave the retry budget room for that: `node/config`). Six long
//! requests on two replicas eject nobody. A stream that breaks after its first byte is always
//! the replica's (see `forward.rs`).

use std::sync::Arc;

use crate::node::Node;

/// How an attempt failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Failure {
    /// No connection: refused, unreachable, TLS.
    Connect,
    /// The connection broke before response headers, often while the body was still being sent.
    Transport,
    /// No response headers within the first-byte timeout.
    Timeout,
    /// A failure status (500, 502, 503, 504).
    Status,
}

/// A request's failed attempts whose blame is not decided yet.
#[derive(Default)]
pub(super) struct Attempts {
    pending: Vec<(usize, Failure)>,
}

impl Attempts {
    /// Attempt at replica `i` failed with `f`. Connect errors are blamed at once.
    pub(super) fn failed(&mut self, node: &Arc<Node>, i: usize, f: Failure) {
        if f == Failure::Connect {
            blame_replica(node, i);
        } else {
            self.pending.push((i, f));
        }
    }

    /// Another replica answered: those that failed this request are at fault.
    pub(super) fn succeeded(self, node: &Arc<Node>) {
        for (i, _) in self.pending {
            blame_replica(node, i);
        }
    }

    /// No replica answered. Returns whether the request is blamed instead of the replicas:
    /// it failed on two or more, or — `big_body` — every try was cut mid-upload (a size limit
    /// before the engine does that; a dead replica shows in connect errors and checks instead).
    pub(super) fn gave_up(self, node: &Arc<Node>, big_body: bool) -> bool {
        let mut replicas: Vec<usize> = self.pending.iter().map(|(i, _)| *i).collect();
        replicas.sort_unstable();
        replicas.dedup();
        if replicas.len() >= 2 || (big_body && self.all_cut()) {
            node.metrics
                .upstream_failures
                .with_label_values(&["request"])
                .inc_by(self.pending.len() as u64);
            return true;
        }
        for (i, f) in self.pending {
            if f == Failure::Timeout && !node.replica_failing(i) {
                // Slow is not failed: a long request, on a replica that serves the others.
                node.metrics
                    .upstream_failures
                    .with_label_values(&["request"])
                    .inc();
                continue;
            }
            blame_replica(node, i);
        }
        false
    }

    /// Every undecided failure was a connection broken before the answer (none at all → false).
    pub(super) fn all_cut(&self) -> bool {
        !self.pending.is_empty() && self.pending.iter().all(|(_, f)| *f == Failure::Transport)
    }
}

fn blame_replica(node: &Arc<Node>, i: usize) {
    node.metrics
        .upstream_failures
        .with_label_values(&["replica"])
        .inc();
    node.request_failed(i);
}
