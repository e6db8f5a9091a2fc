//! Writing a decision's KV-fetch plan into the request body, in the form the chosen replica
//! takes (`core::kv_hint`); the deliver path's only body edit besides the tenant's `cache_salt`.
//!
//! A plan exists only for a replica whose `kv_load.hints` names a form (the router checks), so a
//! replica that takes no hint never sees one. As in `cache_salt.rs`, the common case — the
//! client's body does not mention the field — appends it before the closing brace: one copy of
//! the body, no re-serialization; otherwise the body is parsed and written again (an llm-d
//! hint merges into the client's `kv_transfer_params`).

use std::sync::atomic::{AtomicU64, Ordering};

use bytes::{BufMut, Bytes, BytesMut};

use super::receipts::OfferedPull;
use crate::core::kv_fetch::KvFetchPlan;
use crate::core::kv_hint::{self, FetchHint};
use crate::node::Node;

/// Hints written by this process, for their `message_id`s (unique with the process's start
/// stamp).
static NEXT_HINT: AtomicU64 = AtomicU64::new(0);

/// `body` with `plan`'s hint, or `None` when there is nothing to write (no plan, its source
/// gone from the node — or from the other region's offer that named it —, or a body that is no
/// JSON object).
pub(crate) fn hinted_body(node: &Node, plan: Option<&KvFetchPlan>, body: &Bytes) -> Option<Bytes> {
    let plan = plan?;
    let source = match plan.offer_key {
        Some(key) => node.offered_endpoint(key)?,
        None => node.endpoint(plan.source)?,
    };
    let hint = FetchHint {
        source_url: source.base.to_string(),
        source_id: Some(source.id.to_string()),
        start_token: plan.from_tokens,
        end_token: plan.tokens,
    };
    let id = format!(
        "kvmesh-{:08x}-{:x}",
        std::process::id(),
        NEXT_HINT.fetch_add(1, Ordering::Relaxed)
    );
    let (field, value) = kv_hint::build(plan.format, &hint, &id)?;
    with_field(body, field, value)
}

/// The holder of `plan`'s pull when another region's offer named it (`None` for a source in
/// the view, or no plan): its answer's receipt judges whether the pull came back empty.
pub(crate) fn offered_pull(node: &Node, plan: Option<&KvFetchPlan>) -> Option<OfferedPull> {
    let plan = plan?;
    let source = node.offered_endpoint(plan.offer_key?)?;
    Some(OfferedPull {
        holder: source.base,
        from_tokens: plan.from_tokens,
    })
}

/// `body` (a JSON object) with top-level `field` set to `value` (see the module doc).
pub(crate) fn with_field(body: &Bytes, field: &str, value: serde_json::Value) -> Option<Bytes> {
    let quoted_field = format!("\"{field}\"");
    if memchr::memmem::find(body, quoted_field.as_bytes()).is_none() {
        let end = body.iter().rposition(|b| !b.is_ascii_whitespace())?;
        let start = body.iter().position(|b| !b.is_ascii_whitespace())?;
        if body[start] == b'{' && body[end] == b'}' && start < end {
            let empty = body[start + 1..end].iter().all(u8::is_ascii_whitespace);
            let v = serde_json::to_vec(&value).ok()?;
            let mut out = BytesMut::with_capacity(body.len() + quoted_field.len() + v.len() + 2);
            out.put_slice(&body[..end]);
            if !empty {
                out.put_u8(b',');
            }
            out.put_slice(quoted_field.as_bytes());
            out.put_u8(b':');
            out.put_slice(&v);
            out.put_slice(&body[end..]);
            return Some(out.freeze());
        }
    }
    let mut v: serde_json::Value = serde_json::from_slice(body).ok()?;
    if !kv_hint::set_in(&mut v, field, value) {
        return None;
    }
    serde_json::to_vec(&v).ok().map(Bytes::from)
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::*;

    fn set(body: &str, field: &str, v: Value) -> Value {
        let b = with_field(&Bytes::from(body.to_owned()), field, v).unwrap();
        serde_json::from_slice(&b).unwrap()
    }

    #[test]
    fn a_hint_is_appended_or_merged_and_nothing_else_changes() {
        let v = set(
            r#"{"model":"m","prompt":"hi"}"#,
            "kv_hints",
            json!({"a": 1}),
        );
        assert_eq!(v, json!({"model":"m","prompt":"hi","kv_hints":{"a":1}}));
        assert_eq!(set("{ }", "kv_hints", json!(1)), json!({"kv_hints": 1}));
        // The client's own field is replaced, not duplicated.
        let v = set(r#"{"kv_hints":{"old":true},"x":1}"#, "kv_hints", json!(2));
        assert_eq!(v, json!({"kv_hints": 2, "x": 1}));
        // llm-d's merges into the client's kv_transfer_params.
        let v = set(
            r#"{"kv_transfer_params":{"keep":1}}"#,
            "kv_transfer_params",
            json!({"remote_kv_source": {"remote_port": 1}}),
        );
        assert_eq!(
            v,
            json!({"kv_transfer_params":{"keep":1,"remote_kv_source":{"remote_port":1}}})
        );
        assert!(with_field(&Bytes::from_static(b"[1]"), "kv_hints", json!(1)).is_none());
    }
}
