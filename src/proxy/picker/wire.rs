//! Envoy's ext_proc messages, read and written: request headers into an `http::HeaderMap`, the
//! protocol's metadata entries, and the few response shapes a picker sends.
//!
//! Exists so the stream state machine (`stream.rs`) speaks in requests, picks and bodies, not in
//! protobuf: everything Envoy-shaped is built or read here, from `envoy-types`' generated types.
//! Every read is bounded: at most [`MAX_HEADERS`] headers of at most [`MAX_HEADER_BYTES`] in all,
//! at most [`MAX_SUBSET`] subset entries.

use std::collections::HashMap;

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap as EnvoyHeaders, HeaderValue as EnvoyHeader, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response, BodyMutation, BodyResponse, CommonResponse, HeaderMutation,
    HeadersResponse, ImmediateResponse, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

/// The header (and dynamic-metadata key) that names the picked endpoints.
pub const DESTINATION_KEY: &str = "x-gateway-destination-endpoint";
/// The filter-metadata key of the gateway's subset hint.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The metadata-context key where the gateway reports the endpoint that served.
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// Largest body chunk sent back to Envoy: some data planes cap a streamed chunk at 64 KiB.
pub const BODY_CHUNK_BYTES: usize = 62_000;
/// Most request headers read; the rest are ignored.
pub const MAX_HEADERS: usize = 256;
/// Most header bytes (names and values) read; headers past it are ignored.
pub const MAX_HEADER_BYTES: usize = 64 << 10;
/// Most subset entries read (an InferencePool's pods, times its ≤ 8 ports).
pub const MAX_SUBSET: usize = 4096;

/// A request's head as the picker needs it.
#[derive(Debug, Default)]
pub struct Head {
    /// `:path`, without its query.
    pub path: String,
    /// The ordinary headers (pseudo-headers and unreadable ones left out).
    pub headers: HeaderMap,
}

/// Reads Envoy's request headers (bounded; see the module doc).
pub fn read_head(headers: Option<&EnvoyHeaders>) -> Head {
    let mut head = Head::default();
    let mut bytes = 0usize;
    for h in headers.map_or(&[][..], |h| &h.headers[..]).iter() {
        let value = header_bytes(h);
        bytes += h.key.len() + value.len();
        if head.headers.len() >= MAX_HEADERS || bytes > MAX_HEADER_BYTES {
            break;
        }
        if h.key == ":path" {
            let path = String::from_utf8_lossy(value);
            head.path = path.split('?').next().unwrap_or_default().to_owned();
            continue;
        }
        let (Ok(name), Ok(v)) = (
            HeaderName::from_bytes(h.key.as_bytes()),
            HeaderValue::from_bytes(value),
        ) else {
            continue;
        };
        head.headers.append(name, v);
    }
    head
}

/// A header's value: `raw_value` when set (what Envoy sends), else `value`.
fn header_bytes(h: &EnvoyHeader) -> &[u8] {
    if h.raw_value.is_empty() {
        h.value.as_bytes()
    } else {
        &h.raw_value
    }
}

/// The value of response header `name` (`:status`, say), if present and text.
pub fn header_value<'a>(headers: Option<&'a EnvoyHeaders>, name: &str) -> Option<&'a str> {
    headers?
        .headers
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .and_then(|h| std::str::from_utf8(header_bytes(h)).ok())
}

/// The subset hint in `metadata`'s `namespace`: `None` when absent (every endpoint of the pool
/// may serve), else the listed `ip:port` or `ip` entries (a list of strings, or one
/// comma-separated string, as data planes send either), at most [`MAX_SUBSET`].
pub fn subset_hint(metadata: Option<&Metadata>, namespace: &str) -> Option<Vec<String>> {
    let value = metadata?
        .filter_metadata
        .get(namespace)?
        .fields
        .get(SUBSET_KEY)?;
    let mut out = Vec::new();
    let mut add = |s: &str| {
        for e in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            if out.len() < MAX_SUBSET {
                out.push(e.to_owned());
            }
        }
    };
    match &value.kind {
        Some(Kind::StringValue(s)) => add(s),
        Some(Kind::ListValue(l)) => {
            for v in &l.values {
                if let Some(Kind::StringValue(s)) = &v.kind {
                    add(s);
                }
            }
        }
        _ => {}
    }
    Some(out)
}

/// The endpoint the gateway reports served the request, from `metadata`'s `namespace`.
pub fn served_endpoint<'a>(metadata: Option<&'a Metadata>, namespace: &str) -> Option<&'a str> {
    match &metadata?
        .filter_metadata
        .get(namespace)?
        .fields
        .get(SERVED_KEY)?
        .kind
    {
        Some(Kind::StringValue(s)) => Some(s.as_str()),
        _ => None,
    }
}

/// Sets header `key`, replacing any the client sent (a client's own destination header must
/// not add a second endpoint to the pick).
fn set_header(key: &str, value: impl Into<Vec<u8>>) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(EnvoyHeader {
            key: key.to_owned(),
            raw_value: value.into(),
            ..EnvoyHeader::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

/// The answer to the request headers once the pick is made: the destination header (and the
/// body's new length, when there is a body), the route cache cleared so the route sees it, and
/// the same value in dynamic metadata under `namespace`.
pub fn pick_response(
    endpoints: &str,
    body_len: Option<usize>,
    namespace: &str,
) -> ProcessingResponse {
    let inner = Struct {
        fields: HashMap::from([(
            DESTINATION_KEY.to_owned(),
            Value {
                kind: Some(Kind::StringValue(endpoints.to_owned())),
            },
        )]),
    };
    let metadata = Struct {
        fields: HashMap::from([(
            namespace.to_owned(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]),
    };
    ProcessingResponse {
        dynamic_metadata: Some(metadata),
        response: Some(processing_response::Response::RequestHeaders(
            HeadersResponse {
                response: Some(CommonResponse {
                    clear_route_cache: true,
                    header_mutation: Some(HeaderMutation {
                        set_headers: std::iter::once(set_header(DESTINATION_KEY, endpoints))
                            .chain(body_len.map(|n| set_header("content-length", n.to_string())))
                            .collect(),
                        ..HeaderMutation::default()
                    }),
                    ..CommonResponse::default()
                }),
            },
        )),
        ..ProcessingResponse::default()
    }
}

/// `body` back to Envoy as the request's (`request`) or the response's body, in chunks of at
/// most [`BODY_CHUNK_BYTES`]; the last one ends the body when `end`. An empty body is one empty
/// chunk.
pub fn body_chunks(
    body: &[u8],
    end: bool,
    request: bool,
) -> impl Iterator<Item = ProcessingResponse> + '_ {
    let n = body.len().div_ceil(BODY_CHUNK_BYTES).max(1);
    (0..n).map(move |i| {
        let from = (i * BODY_CHUNK_BYTES).min(body.len());
        let to = (from + BODY_CHUNK_BYTES).min(body.len());
        body_response(body[from..to].to_vec(), end && i + 1 == n, request)
    })
}

/// One streamed body chunk back to Envoy.
pub fn body_response(chunk: Vec<u8>, end: bool, request: bool) -> ProcessingResponse {
    let common = CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(body_mutation::Mutation::StreamedResponse(
                StreamedBodyResponse {
                    body: chunk,
                    end_of_stream: end,
                    ..StreamedBodyResponse::default()
                },
            )),
        }),
        ..CommonResponse::default()
    };
    let body = BodyResponse {
        response: Some(common),
    };
    ProcessingResponse {
        response: Some(if request {
            processing_response::Response::RequestBody(body)
        } else {
            processing_response::Response::ResponseBody(body)
        }),
        ..ProcessingResponse::default()
    }
}

/// "Go on unchanged" to the response headers.
pub fn response_headers_continue() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ResponseHeaders(
            HeadersResponse::default(),
        )),
        ..ProcessingResponse::default()
    }
}

/// "Go on unchanged" to trailers (of the request when `request`).
pub fn trailers_continue(request: bool) -> ProcessingResponse {
    let t = TrailersResponse::default();
    ProcessingResponse {
        response: Some(if request {
            processing_response::Response::RequestTrailers(t)
        } else {
            processing_response::Response::ResponseTrailers(t)
        }),
        ..ProcessingResponse::default()
    }
}

/// The gateway answers the client itself: `status` with a JSON `body` (and `Retry-After`).
pub fn immediate(status: u16, body: Vec<u8>, retry_after_s: Option<u32>) -> ProcessingResponse {
    let mut set_headers = vec![set_header("content-type", "application/json")];
    if let Some(s) = retry_after_s {
        set_headers.push(set_header("retry-after", s.to_string()));
    }
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(
            ImmediateResponse {
                status: Some(HttpStatus {
                    code: i32::from(status),
                }),
                headers: Some(HeaderMutation {
                    set_headers,
                    ..HeaderMutation::default()
                }),
                body,
                ..ImmediateResponse::default()
            },
        )),
        ..ProcessingResponse::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::ListValue;

    fn text(s: &str) -> Value {
        Value {
            kind: Some(Kind::StringValue(s.into())),
        }
    }

    fn metadata(ns: &str, key: &str, v: Value) -> Metadata {
        Metadata {
            filter_metadata: HashMap::from([(
                ns.to_owned(),
                Struct {
                    fields: HashMap::from([(key.to_owned(), v)]),
                },
            )]),
            ..Metadata::default()
        }
    }

    #[test]
    fn the_subset_hint_reads_lists_and_comma_separated_strings() {
        let ns = "envoy.lb.subset_hint";
        assert_eq!(subset_hint(None, ns), None, "no metadata: no hint");
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![text("10.0.0.1:8000"), text("10.0.0.2:8000, 10.0.0.3")],
            })),
        };
        let m = metadata(ns, SUBSET_KEY, list);
        assert_eq!(
            subset_hint(Some(&m), ns).unwrap(),
            ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3"]
        );
        assert_eq!(subset_hint(Some(&m), "other"), None);
        let empty = metadata(ns, SUBSET_KEY, text(""));
        assert_eq!(
            subset_hint(Some(&empty), ns),
            Some(vec![]),
            "an empty hint is a hint: nothing is eligible"
        );
        let served = metadata("envoy.lb", SERVED_KEY, text("10.0.0.2:8000"));
        assert_eq!(
            served_endpoint(Some(&served), "envoy.lb"),
            Some("10.0.0.2:8000")
        );
    }

    #[test]
    fn heads_are_bounded_and_bodies_chunked_at_the_limit() {
        let many = EnvoyHeaders {
            headers: (0..1000)
                .map(|i| EnvoyHeader {
                    key: format!("x-h{i}"),
                    raw_value: b"v".to_vec(),
                    ..EnvoyHeader::default()
                })
                .chain([EnvoyHeader {
                    key: ":path".into(),
                    value: "/v1/chat/completions?x=1".into(),
                    ..EnvoyHeader::default()
                }])
                .collect(),
        };
        let head = read_head(Some(&many));
        assert_eq!(head.headers.len(), MAX_HEADERS);
        let path_first = EnvoyHeaders {
            headers: many.headers.iter().rev().take(3).cloned().collect(),
        };
        assert_eq!(read_head(Some(&path_first)).path, "/v1/chat/completions");
        let body = vec![7u8; BODY_CHUNK_BYTES * 2 + 1];
        let chunks: Vec<_> = body_chunks(&body, true, true).collect();
        assert_eq!(chunks.len(), 3);
        let ends: Vec<bool> = chunks
            .iter()
            .map(|c| match &c.response {
                Some(processing_response::Response::RequestBody(b)) => {
                    match b.response.as_ref().and_then(|r| r.body_mutation.as_ref()) {
                        Some(BodyMutation {
                            mutation: Some(body_mutation::Mutation::StreamedResponse(s)),
                        }) => s.end_of_stream,
                        _ => panic!("not streamed"),
                    }
                }
                _ => panic!("not a request body"),
            })
            .collect();
        assert_eq!(ends, [false, false, true]);
        assert_eq!(body_chunks(&[], true, false).count(), 1);
    }
}
