//! The decide stage: which replica (or pair, or region) serves one attempt of a request, with
//! its accounting booked — and nothing sent.
//!
//! Exists so that a front that only names an endpoint (an endpoint picker) makes exactly the
//! decision the relaying front makes: [`decide`] reads the node's view through `Node::route`
//! (`route_fair` on a first attempt, which may wait for an admission slot; `route_pd` under
//! `[pd]`) and turns the core's `Decision` into what the caller must do next. The caller owns
//! the `Ticket` it gets: dropping it releases the booking.

use std::sync::Arc;

use super::error::ApiError;
use crate::core::pd::PdPair;
use crate::core::priority::ClassId;
use crate::core::router::{Decision, ForwardReason, RejectReason, RouteRequest, Routed};
use crate::node::config::pd::PdProtocol;
use crate::node::{Node, PdRoute, Ticket};

/// What one attempt should do.
pub(crate) enum Decided {
    /// Send the whole request to a local replica.
    Route {
        /// The core's decision.
        routed: Routed,
        /// Its accounting (in flight, pending prefill, the overlay's guess).
        ticket: Ticket,
    },
    /// Send it as a prefill/decode pair.
    Pair {
        /// The pair.
        pair: PdPair,
        /// The prefill leg's accounting.
        prefill: Ticket,
        /// The decode leg's accounting.
        decode: Ticket,
    },
    /// Send it to a node of another region.
    Forward {
        /// The region.
        region: String,
        /// Why.
        reason: ForwardReason,
    },
    /// Answer the client with this error; no attempt is made.
    Refuse(ApiError),
    /// A retry found no other candidate: answer with what the last attempt got.
    NoneLeft,
}

/// How an attempt is decided: its number (0 for the first) and the request's admission class.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AttemptCtx {
    /// 0 for the first attempt; only it may wait for an admission slot.
    pub attempt: u32,
    /// The priority class, under `[priorities]`.
    pub class: Option<ClassId>,
    /// Whether the request may run as a P/D pair under `[pd]`.
    pub pd: bool,
}

/// Decides one attempt of `req` (see the module doc).
pub(crate) async fn decide(node: &Arc<Node>, req: &RouteRequest<'_>, ctx: AttemptCtx) -> Decided {
    let pd = pd_protocol(node).filter(|_| ctx.pd);
    let (decision, ticket) = match pd.and_then(|_| node.cfg.pd.core()) {
        Some(cfg) => match node.route_pd(req, &cfg) {
            PdRoute::Whole {
                decision, ticket, ..
            } => (decision, ticket),
            PdRoute::Pair {
                pair,
                prefill,
                decode,
            } => {
                return Decided::Pair {
                    pair,
                    prefill,
                    decode,
                }
            }
        },
        None if ctx.attempt == 0 => match node.route_fair(req, ctx.class).await {
            Ok(routed) => routed,
            Err(refused) => return Decided::Refuse(ApiError::queue_refused(&refused)),
        },
        None => node.route(req),
    };
    interpret(node, req.model, decision, ticket, ctx.attempt)
}

/// The node's P/D protocol, when `[pd]` is on.
pub(crate) fn pd_protocol(node: &Node) -> Option<PdProtocol> {
    node.cfg
        .pd
        .protocol
        .filter(|_| node.cfg.pd.core().is_some())
}

/// The core's decision as the next step of an attempt.
fn interpret(
    node: &Node,
    model: &str,
    decision: Decision,
    ticket: Option<Ticket>,
    attempt: u32,
) -> Decided {
    match (decision, ticket) {
        (Decision::Route(routed), Some(ticket)) => Decided::Route { routed, ticket },
        (Decision::Reject(RejectReason::UnknownModel), _) => {
            Decided::Refuse(ApiError::unknown_model(model))
        }
        (Decision::Reject(RejectReason::OverQuota), _) => Decided::Refuse(ApiError::over_quota()),
        // Also after local attempts failed: nothing reached the client yet, and another region
        // beats an error.
        (Decision::Forward { region, reason }, _) if node.in_mesh() => {
            Decided::Forward { region, reason }
        }
        (Decision::Forward { region, .. }, _) if attempt == 0 => {
            Decided::Refuse(ApiError::unavailable(format!(
                "no replica of this node can serve model '{model}' now; region '{region}' could, \
                 but forwarding between nodes needs the mesh, which this node does not run"
            )))
        }
        _ if attempt == 0 => Decided::Refuse(ApiError::unavailable(format!(
            "no healthy replica serves model '{model}'"
        ))),
        _ => Decided::NoneLeft,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::keys::{text_block_keys, BlockKey, Namespace};
    use crate::node::config::{NodeConfig, ReplicaConfig};

    fn node(replicas: usize) -> Arc<Node> {
        crate::proxy::install_crypto_provider();
        let cfg = NodeConfig {
            replicas: (0..replicas)
                .map(|i| ReplicaConfig {
                    id: Some(format!("r{i}")),
                    models: vec!["m".into()],
                    ..ReplicaConfig::from_url(format!("http://10.0.0.{}:8000", i + 1))
                })
                .collect(),
            ..NodeConfig::default()
        };
        Node::new(cfg).unwrap()
    }

    fn keys(text: &str) -> Vec<BlockKey> {
        let mut k = Vec::new();
        text_block_keys(
            Namespace::new("m", None, None, None),
            text.as_bytes(),
            64,
            &mut k,
        );
        k
    }

    #[tokio::test]
    async fn a_first_attempt_routes_and_books_without_sending() {
        let n = node(2);
        let k = keys(&"a".repeat(1024));
        let req = RouteRequest::plain("m", &k, 256);
        let Decided::Route { routed, ticket } = decide(&n, &req, AttemptCtx::default()).await
        else {
            panic!("not routed")
        };
        assert_eq!(ticket.replica(), routed.replica);
        assert_eq!(
            n.state().replicas[routed.replica].in_flight,
            1,
            "the ticket books the request"
        );
        drop(ticket);
        assert_eq!(
            n.state().replicas[routed.replica].in_flight,
            0,
            "dropping it releases the booking"
        );
    }

    #[tokio::test]
    async fn unknown_models_and_quota_are_refusals_in_the_api_shape() {
        let n = node(1);
        let req = RouteRequest::plain("other", &[], 8);
        match decide(&n, &req, AttemptCtx::default()).await {
            Decided::Refuse(e) => assert_eq!(e.status.as_u16(), 404),
            _ => panic!("an unknown model must be refused"),
        }
    }

    #[tokio::test]
    async fn a_retry_with_every_replica_tried_has_none_left_and_a_first_attempt_is_refused() {
        let n = node(2);
        let tried = [0, 1];
        let req = RouteRequest {
            exclude: &tried,
            ..RouteRequest::plain("m", &[], 8)
        };
        let retry = AttemptCtx {
            attempt: 1,
            ..AttemptCtx::default()
        };
        assert!(matches!(decide(&n, &req, retry).await, Decided::NoneLeft));
        match decide(&n, &req, AttemptCtx::default()).await {
            Decided::Refuse(e) => assert_eq!(e.status.as_u16(), 503),
            _ => panic!("a first attempt with nothing to try is refused"),
        }
    }

    #[tokio::test]
    async fn the_same_prompt_is_decided_to_its_cache() {
        let n = node(4);
        let k = keys(&"b".repeat(4096));
        let req = RouteRequest::plain("m", &k, 1024);
        let Decided::Route { routed, ticket } = decide(&n, &req, AttemptCtx::default()).await
        else {
            panic!("not routed")
        };
        let mut ticket = ticket;
        ticket.first_byte(&k);
        drop(ticket);
        let Decided::Route { routed: again, .. } = decide(&n, &req, AttemptCtx::default()).await
        else {
            panic!("not routed")
        };
        assert_eq!(
            again.replica, routed.replica,
            "the second goes where the blocks are"
        );
        assert!(again.hit_blocks > 0);
    }
}
