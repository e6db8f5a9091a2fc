//! Routing a request under `[pd]`: the core's pair choice (`core/pd.rs`), booked as two legs.
//!
//! Exists beside `routing.rs` so the ordinary path stays as it is: a pair books its prefill
//! leg like any routed request (queued prefill, tenant, overlay from its predicted prefill end)
//! and its decode leg as a request in flight at the decode replica whose blocks arrive with the
//! hand-over (from the same predicted time). Each leg has its own [`Ticket`], so each replica's
//! accounting is released exactly once, whichever leg ends first; the tenant counts once, on
//! the prefill leg.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::routing::{Booking, Ticket};
use super::state::Node;
use crate::core::pd::{self, PdChoice, PdConfig, PdPair, WholeReason};
use crate::core::role::PdFacts;
use crate::core::router::{Decision, RouteRequest, Routed};

/// A routed request under `[pd]`.
pub enum PdRoute {
    /// The whole request, as [`Node::route`] answers (a ticket with a local route).
    Whole {
        /// The decision.
        decision: Decision,
        /// Its accounting, for a local route.
        ticket: Option<Ticket>,
        /// Why it is not a pair.
        reason: WholeReason,
    },
    /// Two legs.
    Pair {
        /// The pair, as the core chose it.
        pair: PdPair,
        /// The prefill leg's accounting.
        prefill: Ticket,
        /// The decode leg's accounting.
        decode: Ticket,
    },
}

impl Node {
    /// Replica `i`'s disaggregation facts (bootstrap port, engine id), for the protocol
    /// adapters.
    pub fn pd_facts(&self, i: usize) -> Option<PdFacts> {
        self.lock().view.replica(i).map(|r| r.info.pd.clone())
    }

    /// Routes `req` under disaggregation settings `cfg` (never to a replica in `req.exclude`)
    /// and books the legs it chose.
    pub fn route_pd(self: &Arc<Self>, req: &RouteRequest<'_>, cfg: &PdConfig) -> PdRoute {
        let started = Instant::now();
        let now = self.now();
        let mut guard = self.lock();
        let core = &mut *guard;
        let tokens_per_block = core.view.tokens_per_block;
        let choice = pd::choose(&mut core.router, &core.view, req, now, cfg);
        let route = match choice {
            PdChoice::Whole {
                mut decision,
                reason,
            } => {
                let ticket = match &mut decision {
                    Decision::Route(d) => Some(self.book(core, d, req, now, Booking::Whole)),
                    _ => None,
                };
                PdRoute::Whole {
                    decision,
                    ticket,
                    reason,
                }
            }
            PdChoice::Pair(mut pair) => {
                let prefill = self.book(core, &mut pair.prefill, req, now, Booking::Whole);
                let ready_in =
                    Duration::try_from_secs_f64(pair.prefill.predicted_s.clamp(0.0, 3600.0))
                        .unwrap_or_default();
                let mut decode_leg = Routed {
                    replica: pair.decode,
                    hit_blocks: 0,
                    ..pair.prefill
                };
                let decode = self.book(
                    core,
                    &mut decode_leg,
                    req,
                    now,
                    Booking::Decode { ready_in },
                );
                PdRoute::Pair {
                    pair,
                    prefill,
                    decode,
                }
            }
        };
        drop(guard);
        self.mesh.load_changed.notify_one();
        self.metrics
            .decision_seconds
            .observe(started.elapsed().as_secs_f64());
        let outcome = match &route {
            PdRoute::Whole {
                decision, reason, ..
            } => {
                if let Decision::Route(d) = decision {
                    self.metrics.hit_blocks.observe(d.hit_blocks as f64);
                }
                self.metrics.decisions.record(decision, tokens_per_block);
                reason.as_str()
            }
            PdRoute::Pair { pair, .. } => {
                self.metrics
                    .hit_blocks
                    .observe(pair.prefill.hit_blocks as f64);
                self.metrics
                    .decisions
                    .record(&Decision::Route(pair.prefill), tokens_per_block);
                "pair"
            }
        };
        self.metrics
            .pd_decisions
            .with_label_values(&[outcome])
            .inc();
        route
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::keys::BlockKey;
    use crate::core::role::Role;
    use crate::node::config::{NodeConfig, ReplicaConfig};

    fn node() -> Arc<Node> {
        crate::proxy::install_crypto_provider();
        let mut cfg = NodeConfig {
            region: "eu".into(),
            ..NodeConfig::default()
        };
        let replica = |id: &str, n: u8, role: Role| ReplicaConfig {
            id: Some(id.into()),
            models: vec!["m".into()],
            role,
            ..ReplicaConfig::from_url(format!("http://10.0.0.{n}:8000"))
        };
        cfg.replicas = vec![
            replica("p0", 1, Role::Prefill),
            replica("d0", 2, Role::Decode),
        ];
        Node::new(cfg).unwrap()
    }

    fn req(keys: &[BlockKey]) -> RouteRequest<'_> {
        RouteRequest {
            model: "m",
            keys,
            prompt_tokens: 4096,
            session: None,
            affinity_key: None,
            tenant: Some("t"),
            forwarded: false,
            exclude: &[],
        }
    }

    #[test]
    fn a_pair_books_both_legs_and_each_ticket_releases_its_own() {
        let n = node();
        let keys: Vec<BlockKey> = (1..=64).map(BlockKey).collect();
        let cfg = PdConfig {
            bypass_uncached_tokens: 0,
            ..PdConfig::default()
        };
        let PdRoute::Pair {
            pair,
            mut prefill,
            decode,
        } = n.route_pd(&req(&keys), &cfg)
        else {
            panic!("expected a pair");
        };
        let (p, d) = (pair.prefill.replica, pair.decode);
        let load = |i: usize| {
            let core = n.lock();
            let r = core.view.replica(i).unwrap();
            (r.load.in_flight, core.replicas[i].pending_prefill_tokens)
        };
        assert_eq!(
            load(p),
            (1, 4096),
            "the prefill leg queues the prompt's prefill"
        );
        assert_eq!(
            load(d),
            (1, 0),
            "the decode leg is in flight there, no prefill"
        );
        assert_eq!(decode.hit_tokens(), 0);
        // The prefill is done: its prefill leaves the queue; its leg ends.
        prefill.first_byte(&keys);
        assert_eq!(load(p), (1, 0));
        drop(prefill);
        assert_eq!(load(p), (0, 0));
        assert_eq!(load(d), (1, 0), "the decode still streams");
        drop(decode);
        assert_eq!(load(d), (0, 0));
        let metrics = n.metrics.registry.gather();
        let pairs = metrics
            .iter()
            .find(|m| m.name() == "kvmesh_pd_decisions_total")
            .map(|m| m.get_metric().len());
        assert_eq!(pairs, Some(1));
    }
}
