//! SGLang's bootstrap protocol for a prefill/decode pair (as sgl-router's / SMG's PD router
//! sends it; `docs/pd.md` names the version followed).
//!
//! The client's body gains three fields, `bootstrap_host` (the prefill replica's host),
//! `bootstrap_port` (its KV bootstrap port, default 8998) and `bootstrap_room` (a random id in
//! 0..2^63), and goes to the prefill and the decode replica *at once*: the decode server
//! reserves KV memory and, through the prefill's bootstrap server, receives the cache into it
//! while the prefill computes. The client gets the decode's answer; the prefill's is read and
//! dropped.
//!
//! Failure: until the decode's response headers arrive either leg may fail. A prefill failing
//! first fails the pair as a *prefill* failure (the request path retries on another prefill;
//! the decode waiting for that room is abandoned, and SGLang's decode times the room out); a
//! decode failing is a decode failure. Once the decode answered, the request is committed.

use rand::Rng;
use serde_json::Value;

use super::pd_leg::{
    edited, finish_prefill_later, host_of, judged, send_leg, LegFailure, PairCtx, PairServed,
    DEFAULT_BOOTSTRAP_PORT,
};
use crate::core::keys::BlockKey;
use crate::core::pd::PdPair;
use crate::node::Ticket;

/// Largest bootstrap room (SGLang draws from 0..2^63).
pub const MAX_ROOM: u64 = (1 << 63) - 1;

/// The bootstrap fields added to the client's body.
pub fn bootstrap_fields(host: &str, port: u16, room: u64) -> [(&'static str, Option<Value>); 3] {
    [
        ("bootstrap_host", Some(Value::from(host))),
        ("bootstrap_port", Some(Value::from(port))),
        ("bootstrap_room", Some(Value::from(room.min(MAX_ROOM)))),
    ]
}

/// Sends both legs at once; answers with the decode's response and the legs' replica ids.
pub(super) async fn serve(
    ctx: &PairCtx<'_>,
    pair: &PdPair,
    prefill: Ticket,
    decode: Ticket,
    keys: &mut Vec<BlockKey>,
) -> Result<PairServed, LegFailure> {
    let facts = ctx.node.pd_facts(pair.prefill.replica).unwrap_or_default();
    let p_end = prefill.endpoint().clone();
    let d_end = decode.endpoint().clone();
    let host = host_of(&p_end.base).unwrap_or_default();
    let port = facts.bootstrap_port.unwrap_or(DEFAULT_BOOTSTRAP_PORT);
    let room = rand::rng().random_range(0..=MAX_ROOM);
    let body = edited(ctx.body, &bootstrap_fields(&host, port, room));
    let limit = ctx.first_byte;
    let idle = std::time::Duration::from_millis(ctx.node.cfg.timeouts.idle_ms);
    let mut p_send = Box::pin(tokio::time::timeout(
        limit,
        send_leg(ctx, &p_end, &[], body.clone()),
    ));
    let mut d_send = Box::pin(tokio::time::timeout(
        limit,
        send_leg(ctx, &d_end, &[], body),
    ));
    // The prefill's answer, once it came first and was fine.
    let mut prefill = Some(prefill);
    let decoded = loop {
        tokio::select! {
            p = &mut p_send, if prefill.is_some() => {
                let ticket = prefill.take();
                match judged(p, pair.prefill.replica, "prefill", limit) {
                    Ok(resp) => {
                        if let Some(t) = ticket {
                            finish_prefill_later(resp, t, keys.clone(), idle);
                        }
                    }
                    Err(f) => {
                        if let Some(t) = ticket {
                            t.failed(keys);
                        }
                        decode.failed(keys);
                        return Err(f);
                    }
                }
            }
            d = &mut d_send => break judged(d, pair.decode, "decode", limit),
        }
    };
    let resp = match decoded {
        Ok(r) => r,
        Err(f) => {
            if let Some(t) = prefill.take() {
                t.failed(keys);
            }
            decode.failed(keys);
            return Err(f);
        }
    };
    if let Some(t) = prefill.take() {
        // The decode answered first: the prefill leg finishes in the background.
        let keys = keys.clone();
        tokio::spawn(async move {
            if let Ok(Ok(resp)) = p_send.await {
                if !super::error::is_failure(resp.status()) {
                    finish_prefill_later(resp, t, keys, idle);
                }
            }
        });
    }
    let out = super::pd_leg::answer(ctx, resp, decode, pair.prefill.hit_blocks, keys);
    Ok(PairServed {
        resp: out,
        prefill: p_end.id.to_string(),
        decode: d_end.id.to_string(),
        prefill_cached: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bootstrap_fields_name_the_prefill_and_a_room_sglang_accepts() {
        let f = bootstrap_fields("10.0.0.5", 8998, u64::MAX);
        assert_eq!(f[0], ("bootstrap_host", Some(Value::from("10.0.0.5"))));
        assert_eq!(f[1], ("bootstrap_port", Some(Value::from(8998))));
        assert_eq!(f[2], ("bootstrap_room", Some(Value::from(MAX_ROOM))));
    }
}
