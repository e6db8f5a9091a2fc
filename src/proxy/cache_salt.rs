//! Setting a body's top-level `cache_salt`: the one edit the node makes to a request body
//! (router-derived salts, `core::tenant_salt`).
//!
//! Exists so the rest of the path can keep forwarding bodies byte for byte. The common case —
//! the client sent no `cache_salt` — appends the field before the closing brace: one copy of
//! the body, no re-serialization. A body that mentions `cache_salt` anywhere (the client's own,
//! a `null`, or the word in a prompt) is parsed and written again, so the client's value is
//! replaced, never left as a duplicate key that an engine (last wins) or a peer's strict parser
//! (an error) would read differently.

use bytes::{BufMut, Bytes, BytesMut};
use serde_json::Value;

/// The field, as it appears in JSON.
const FIELD: &[u8] = b"\"cache_salt\"";

/// `body` (a JSON object) with its top-level `cache_salt` set to `salt`. `None`: not a JSON
/// object (the caller parsed it as one already, so this does not happen for a checked body).
pub(crate) fn with_cache_salt(body: &Bytes, salt: &str) -> Option<Bytes> {
    if memchr::memmem::find(body, FIELD).is_none() {
        if let Some(b) = appended(body, salt) {
            return Some(b);
        }
    }
    let mut v: Value = serde_json::from_slice(body).ok()?;
    v.as_object_mut()?
        .insert("cache_salt".to_owned(), Value::String(salt.to_owned()));
    serde_json::to_vec(&v).ok().map(Bytes::from)
}

/// Fast path: the field inserted before the object's closing brace.
fn appended(body: &[u8], salt: &str) -> Option<Bytes> {
    let end = body.iter().rposition(|b| !b.is_ascii_whitespace())?;
    let start = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[start] != b'{' || body[end] != b'}' || start >= end {
        return None;
    }
    let empty = body[start + 1..end].iter().all(u8::is_ascii_whitespace);
    let quoted = serde_json::to_string(salt).ok()?;
    let mut out = BytesMut::with_capacity(body.len() + FIELD.len() + quoted.len() + 2);
    out.put_slice(&body[..end]);
    if !empty {
        out.put_u8(b',');
    }
    out.put_slice(FIELD);
    out.put_u8(b':');
    out.put_slice(quoted.as_bytes());
    out.put_slice(&body[end..]);
    Some(out.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn salted(body: &str) -> Value {
        let b = with_cache_salt(&Bytes::from(body.to_owned()), "S").unwrap();
        serde_json::from_slice(&b).unwrap()
    }

    #[test]
    fn appends_when_absent_and_replaces_the_clients() {
        let v = salted(r#"{"model":"m","prompt":"p"} "#);
        assert_eq!(v["cache_salt"], "S");
        assert_eq!(v["prompt"], "p");
        assert_eq!(salted("{ }")["cache_salt"], "S");
        // The client's salt (or null) is replaced, not duplicated.
        for body in [
            r#"{"model":"m","cache_salt":"mine","prompt":"p"}"#,
            r#"{"model":"m","cache_salt":null}"#,
        ] {
            let b = with_cache_salt(&Bytes::from(body), "S").unwrap();
            let text = std::str::from_utf8(&b).unwrap();
            assert_eq!(text.matches("cache_salt").count(), 1, "{text}");
            assert_eq!(salted(body)["cache_salt"], "S");
        }
        // Only the top level counts; a nested one stays.
        let v = salted(r#"{"model":"m","x":{"cache_salt":"in"}}"#);
        assert_eq!(
            (v["cache_salt"].as_str(), v["x"]["cache_salt"].as_str()),
            (Some("S"), Some("in"))
        );
    }

    #[test]
    fn refuses_what_is_not_an_object() {
        for body in ["[1]", "\"s\"", "", "{"] {
            assert!(with_cache_salt(&Bytes::from(body), "S").is_none(), "{body}");
        }
    }
}
