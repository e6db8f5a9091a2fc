//! The wire shapes of a KV-fetch hint: what the node writes into a request body and what an
//! engine (or `kvmesh replica`) reads back.
//!
//! Two forms, chosen per replica by `kv_load.hints` ([`KvHintFormat`]):
//!
//! - `vllm-envelope`: vLLM's top-level `kv_hints` request field, a `KvHintsEnvelope`
//!   `{protocol_version, message_id, actions: [{action_id, action_type, action_version,
//!   payload}]}` (vllm-project/vllm#53423 `vllm/v1/kv_hints/protocol.py`, RFC #53421; Dynamo's
//!   `KvHint` in ai-dynamo/dynamo#13134 is the same message) with one action of type `kv.fetch`,
//!   version `1.0`. The PR keeps payloads opaque (`dict[str, Any]`) and no published schema of
//!   the `kv.fetch@1.0` payload was found; ours is modelled on Dynamo's router hint
//!   (ai-dynamo/dynamo#11695: `source_control_endpoint` + the blocks), naming the blocks by token
//!   range because a text-mode router's keys are not the engine's block hashes:
//!   `{source_control_endpoint, source_id, start_token, end_token}`.
//! - `llm-d`: `kv_transfer_params.remote_kv_source`, the field llm-d's sidecar fills from the
//!   router's `x-kv-cache-source-host-port` header (llm-d/llm-d-router#1929, #2409):
//!   `{remote_host, remote_port, kv_request_id, start_token, end_token}` (the host and port
//!   as in the P2P connector's `kv_transfer_params.p2p`, llm-d/llm-d-router#1937). Other keys of a
//!   client's `kv_transfer_params` are kept.
//!
//! The example documents of both are in `tests/data/kv-hints.json` (with their sources); the unit
//! tests check what we write against them, field for field.
//!
//! Reading is bounded: a URL of at most [`MAX_URL_BYTES`], at most [`MAX_ACTIONS`] actions,
//! token positions at most [`MAX_TOKENS`]; anything else is an error the reader reports and
//! ignores (the request then runs without the hint).

use serde_json::{json, Value};

use super::kv_load::KvHintFormat;

/// vLLM's top-level request field.
pub const ENVELOPE_FIELD: &str = "kv_hints";
/// The envelope's protocol version written.
pub const PROTOCOL_VERSION: &str = "1.0";
/// The fetch action's type.
pub const FETCH_ACTION: &str = "kv.fetch";
/// The fetch action's version.
pub const FETCH_VERSION: &str = "1.0";
/// llm-d's request field, and the key in it.
pub const TRANSFER_FIELD: &str = "kv_transfer_params";
/// The key under [`TRANSFER_FIELD`].
pub const REMOTE_SOURCE_KEY: &str = "remote_kv_source";
/// Longest source URL accepted.
pub const MAX_URL_BYTES: usize = 2048;
/// Most actions read from one envelope.
pub const MAX_ACTIONS: usize = 16;
/// Largest token position accepted (a prompt is at most 4 Mi tokens).
pub const MAX_TOKENS: u64 = 4 << 20;

/// One pull, as both forms carry it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FetchHint {
    /// The source replica's base URL (`http://host:port`).
    pub source_url: String,
    /// The source's id, when the form carries it.
    pub source_id: Option<String>,
    /// First prompt token to pull (a block boundary: what the target holds already).
    pub start_token: u64,
    /// One past the last prompt token to pull.
    pub end_token: u64,
}

/// Why a body's hint was not read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HintError {
    /// A field is missing, of the wrong type or out of bounds.
    #[error("malformed KV hint: {0}")]
    Malformed(&'static str),
}

/// The `(field, value)` to set at the top level of a request body for `hint` in `format`
/// (`None` for [`KvHintFormat::None`]). `message_id` names this hint (and its action).
pub fn build(
    format: KvHintFormat,
    hint: &FetchHint,
    message_id: &str,
) -> Option<(&'static str, Value)> {
    match format {
        KvHintFormat::None => None,
        KvHintFormat::VllmEnvelope => Some((
            ENVELOPE_FIELD,
            json!({
                "protocol_version": PROTOCOL_VERSION,
                "message_id": message_id,
                "actions": [{
                    "action_id": format!("{message_id}-fetch"),
                    "action_type": FETCH_ACTION,
                    "action_version": FETCH_VERSION,
                    "payload": {
                        "source_control_endpoint": hint.source_url,
                        "source_id": hint.source_id,
                        "start_token": hint.start_token,
                        "end_token": hint.end_token,
                    },
                }],
            }),
        )),
        KvHintFormat::LlmD => {
            let (host, port) = split_url(&hint.source_url)?;
            Some((
                TRANSFER_FIELD,
                json!({
                    REMOTE_SOURCE_KEY: {
                        "remote_host": host,
                        "remote_port": port,
                        "kv_request_id": message_id,
                        "start_token": hint.start_token,
                        "end_token": hint.end_token,
                    },
                }),
            ))
        }
    }
}

/// The fetch hint in a request body, in either form (the envelope first); `Ok(None)` when it
/// carries none.
pub fn parse(body: &Value) -> Result<Option<FetchHint>, HintError> {
    if let Some(env) = body.get(ENVELOPE_FIELD).filter(|v| !v.is_null()) {
        let actions = env
            .get("actions")
            .and_then(Value::as_array)
            .ok_or(HintError::Malformed("kv_hints.actions is not a list"))?;
        if actions.len() > MAX_ACTIONS {
            return Err(HintError::Malformed("kv_hints has too many actions"));
        }
        // Actions of other types or versions are not ours to read: skipped, as vLLM does.
        let fetch = actions.iter().find(|a| {
            a.get("action_type").and_then(Value::as_str) == Some(FETCH_ACTION)
                && a.get("action_version").and_then(Value::as_str) == Some(FETCH_VERSION)
        });
        if let Some(p) = fetch.and_then(|a| a.get("payload")) {
            let url = p
                .get("source_control_endpoint")
                .and_then(Value::as_str)
                .ok_or(HintError::Malformed("kv.fetch payload has no source"))?;
            let id = p.get("source_id").and_then(Value::as_str);
            return checked(url.to_owned(), id, p).map(Some);
        }
    }
    if let Some(src) = body
        .get(TRANSFER_FIELD)
        .and_then(|t| t.get(REMOTE_SOURCE_KEY))
        .filter(|v| !v.is_null())
    {
        let host = src
            .get("remote_host")
            .and_then(Value::as_str)
            .ok_or(HintError::Malformed("remote_kv_source has no remote_host"))?;
        let port = src
            .get("remote_port")
            .and_then(Value::as_u64)
            .and_then(|p| u16::try_from(p).ok())
            .ok_or(HintError::Malformed(
                "remote_kv_source has no valid remote_port",
            ))?;
        if host.is_empty() || host.contains(['/', '@', '?', '#', ' ']) {
            return Err(HintError::Malformed(
                "remote_kv_source.remote_host is not a host",
            ));
        }
        let url = if host.contains(':') {
            format!("http://[{host}]:{port}")
        } else {
            format!("http://{host}:{port}")
        };
        return checked(url, None, src).map(Some);
    }
    Ok(None)
}

/// The hint with its bounds checked: an http(s) URL, `start ≤ end ≤` [`MAX_TOKENS`].
fn checked(url: String, id: Option<&str>, p: &Value) -> Result<FetchHint, HintError> {
    if url.len() > MAX_URL_BYTES || !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(HintError::Malformed("the source is not an http(s) URL"));
    }
    let token = |k: &str| {
        p.get(k)
            .and_then(Value::as_u64)
            .filter(|t| *t <= MAX_TOKENS)
    };
    let start = token("start_token").unwrap_or(0);
    let end = token("end_token").ok_or(HintError::Malformed("no valid end_token"))?;
    if start > end {
        return Err(HintError::Malformed("start_token is past end_token"));
    }
    Ok(FetchHint {
        source_url: url,
        source_id: id.filter(|s| s.len() <= 256).map(str::to_owned),
        start_token: start,
        end_token: end,
    })
}

/// `(host, port)` of an `http(s)://host:port[/…]` URL (default ports by scheme).
fn split_url(url: &str) -> Option<(String, u16)> {
    let (scheme, rest) = url.split_once("://")?;
    let authority = rest.split(['/', '?', '#']).next()?;
    let authority = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let default = if scheme == "https" { 443 } else { 80 };
    if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6.split_once(']')?;
        let port = after
            .strip_prefix(':')
            .map_or(Some(default), |p| p.parse().ok())?;
        return Some((host.to_owned(), port));
    }
    match authority.rsplit_once(':') {
        Some((h, p)) => Some((h.to_owned(), p.parse().ok()?)),
        None => Some((authority.to_owned(), default)),
    }
}

/// Sets `value` as `field` in a parsed body object, merging into an existing
/// `kv_transfer_params` object (keeping the client's other keys); `false` when `body` is no
/// object.
pub fn set_in(body: &mut Value, field: &str, value: Value) -> bool {
    let Some(map) = body.as_object_mut() else {
        return false;
    };
    match (map.get_mut(field), value) {
        (Some(Value::Object(old)), Value::Object(new)) if field == TRANSFER_FIELD => {
            for (k, v) in new {
                old.insert(k, v);
            }
        }
        (_, value) => {
            map.insert(field.to_owned(), value);
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hint() -> FetchHint {
        FetchHint {
            source_url: "http://10.0.0.7:8000".into(),
            source_id: Some("r7".into()),
            start_token: 256,
            end_token: 8192,
        }
    }

    /// The fixture's documents for `form` (tests/data/kv-hints.json).
    fn fixture(form: &str) -> Value {
        let all: Value =
            serde_json::from_str(include_str!("../../tests/data/kv-hints.json")).unwrap();
        all["forms"][form]["example"].clone()
    }

    /// Same keys at every level and the same JSON type at every leaf.
    fn same_shape(a: &Value, b: &Value, path: &str) {
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                let mut kx: Vec<_> = x.keys().collect();
                let mut ky: Vec<_> = y.keys().collect();
                kx.sort();
                ky.sort();
                assert_eq!(kx, ky, "keys at {path}");
                for k in x.keys() {
                    same_shape(&x[k], &y[k], &format!("{path}.{k}"));
                }
            }
            (Value::Array(x), Value::Array(y)) => {
                assert_eq!(x.len(), y.len(), "length at {path}");
                for (i, (p, q)) in x.iter().zip(y).enumerate() {
                    same_shape(p, q, &format!("{path}[{i}]"));
                }
            }
            (Value::String(_), Value::String(_))
            | (Value::Number(_), Value::Number(_))
            | (Value::Bool(_), Value::Bool(_))
            | (Value::Null, Value::Null) => {}
            _ => panic!("type differs at {path}: {a} vs {b}"),
        }
    }

    #[test]
    fn the_vllm_envelope_has_the_published_shape_and_reads_back() {
        let (field, v) = build(KvHintFormat::VllmEnvelope, &hint(), "m-1").unwrap();
        assert_eq!(field, "kv_hints");
        let body = json!({ "model": "m", "prompt": "x", field: v });
        same_shape(&body, &fixture("vllm-envelope"), "body");
        assert_eq!(body["kv_hints"]["actions"][0]["action_type"], "kv.fetch");
        assert_eq!(body["kv_hints"]["actions"][0]["action_version"], "1.0");
        assert_eq!(parse(&body), Ok(Some(hint())));
        // The fixture's own document reads too.
        let f = parse(&fixture("vllm-envelope")).unwrap().unwrap();
        assert!(f.source_url.starts_with("http://"));
    }

    #[test]
    fn the_llm_d_form_has_the_published_shape_keeps_the_clients_params_and_reads_back() {
        let (field, v) = build(KvHintFormat::LlmD, &hint(), "m-2").unwrap();
        let mut body = json!({ "model": "m", "prompt": "x" });
        assert!(set_in(&mut body, field, v.clone()));
        same_shape(&body, &fixture("llm-d"), "body");
        let back = parse(&body).unwrap().unwrap();
        assert_eq!(back.source_url, "http://10.0.0.7:8000");
        assert_eq!((back.start_token, back.end_token), (256, 8192));
        let mut with_params = json!({ "kv_transfer_params": { "do_remote_decode": false } });
        set_in(&mut with_params, field, v);
        assert_eq!(with_params["kv_transfer_params"]["do_remote_decode"], false);
        assert!(with_params["kv_transfer_params"]["remote_kv_source"].is_object());
    }

    #[test]
    fn no_hint_for_a_replica_that_takes_none_and_bad_hints_are_errors() {
        assert_eq!(build(KvHintFormat::None, &hint(), "x"), None);
        assert_eq!(parse(&json!({ "prompt": "x" })), Ok(None));
        for bad in [
            json!({ "kv_hints": { "actions": 3 } }),
            json!({ "kv_hints": { "actions": [{ "action_type": "kv.fetch",
                "action_version": "1.0", "payload": { "source_control_endpoint": "file:///x",
                "end_token": 5 } }] } }),
            json!({ "kv_hints": { "actions": [{ "action_type": "kv.fetch",
                "action_version": "1.0", "payload": { "source_control_endpoint": "http://a:1",
                "start_token": 9, "end_token": 5 } }] } }),
            json!({ "kv_transfer_params": { "remote_kv_source": { "remote_host": "a/b",
                "remote_port": 1, "end_token": 5 } } }),
            json!({ "kv_transfer_params": { "remote_kv_source": { "remote_host": "a",
                "remote_port": 70000, "end_token": 5 } } }),
        ] {
            assert!(parse(&bad).is_err(), "{bad}");
        }
        // Another action type is not ours: no hint, no error.
        let other = json!({ "kv_hints": { "actions": [{ "action_type": "kv.share",
            "action_version": "1.0", "payload": {} }] } });
        assert_eq!(parse(&other), Ok(None));
    }

    #[test]
    fn urls_split_into_host_and_port() {
        assert_eq!(split_url("http://h:81/x"), Some(("h".into(), 81)));
        assert_eq!(split_url("https://h"), Some(("h".into(), 443)));
        assert_eq!(split_url("http://[::1]:9"), Some(("::1".into(), 9)));
        let h = parse(&json!({ "kv_transfer_params": { "remote_kv_source": {
            "remote_host": "::1", "remote_port": 9, "end_token": 16 } } }));
        assert_eq!(h.unwrap().unwrap().source_url, "http://[::1]:9");
    }
}
