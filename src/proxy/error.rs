//! Errors the node itself answers with, in OpenAI's JSON shape.
//!
//! Exists so every client library sees errors it already knows how to read:
//! `{"error":{"message","type","param","code"}}` with the matching HTTP status.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// An error response.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message.
    pub message: String,
    /// OpenAI error type (`invalid_request_error`, `server_error`, ...).
    pub kind: &'static str,
    /// The request field at fault, if any.
    pub param: Option<&'static str>,
    /// Machine-readable code.
    pub code: &'static str,
    /// Seconds for a `Retry-After` header.
    pub retry_after_s: Option<u32>,
}

#[derive(Serialize)]
struct Envelope<'a> {
    error: Body<'a>,
}

#[derive(Serialize)]
struct Body<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: &'a str,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: &'static str, message: String) -> Self {
        ApiError {
            status,
            message,
            kind,
            param: None,
            code,
            retry_after_s: None,
        }
    }

    /// 400: the body is not valid JSON or lacks a required field.
    pub fn bad_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ApiError {
            param,
            ..Self::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "invalid_request",
                message.into(),
            )
        }
    }

    /// 413: the body exceeds the configured limit.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!("request body exceeds the limit of {limit} bytes"),
        )
    }

    /// 413: every replica tried cut the connection while receiving this body.
    pub fn refused_as_too_large(len: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!(
                "every replica tried closed the connection while receiving this {len}-byte body; \
                 it is likely over their request size limit"
            ),
        )
    }

    /// 404: no replica serves the model.
    pub fn unknown_model(model: &str) -> Self {
        ApiError {
            param: Some("model"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "model_not_found",
                format!("the model '{model}' does not exist or no replica serves it"),
            )
        }
    }

    /// 404 with `code`: something the request names does not exist.
    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            code,
            message.into(),
        )
    }

    /// 503 with `Retry-After`: the node cannot serve now.
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            retry_after_s: Some(1),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "no_healthy_replica",
                message.into(),
            )
        }
    }

    /// 429: the tenant is over its quota.
    pub fn over_quota() -> Self {
        ApiError {
            retry_after_s: Some(1),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "tenant_over_quota",
                "the tenant has too many requests in flight".into(),
            )
        }
    }

    /// 429: the admission queue refused the request (its priority class's queue is full, or it
    /// could not get a slot within the class's `max_wait_ms`), with the queue's `Retry-After`.
    pub fn queue_refused(r: &crate::node::Refused) -> Self {
        use crate::core::admission::RejectReason;
        let why = match r.rejection.reason {
            RejectReason::QueueFull => "its queue is full",
            RejectReason::WaitTooLong => "the predicted wait exceeds the class's max_wait_ms",
            RejectReason::Expired => "no slot freed within the class's max_wait_ms",
        };
        ApiError {
            retry_after_s: Some(r.rejection.retry_after_s),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                crate::node::refusal_label(r.rejection.reason),
                format!(
                    "every replica is busy and the request cannot wait in priority class '{}': {why}",
                    r.class
                ),
            )
        }
    }

    /// 502: every attempt failed at the replica.
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_GATEWAY,
            "server_error",
            "upstream_error",
            message.into(),
        )
    }

    /// 401: the admin token is missing or wrong.
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_token",
            "a valid bearer token is required".into(),
        )
    }

    /// 401: API keys are on and the request has none, or an unknown one.
    pub fn missing_api_key() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_api_key",
            "a valid API key is required (Authorization: Bearer <key>)".into(),
        )
    }

    /// 408: the body did not arrive in time.
    pub fn body_timeout(limit: std::time::Duration) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "request_timeout",
            format!("the request body did not arrive within {limit:?}"),
        )
    }

    /// 408: the body arrived slower than `server.min_body_bytes_per_s` on average.
    pub fn body_too_slow(min_rate: u64) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "request_timeout",
            format!("the request body arrived slower than {min_rate} bytes/s"),
        )
    }

    /// 500: the node itself failed.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal_error",
            message.into(),
        )
    }
}

/// Anthropic's error envelope: `{"type":"error","error":{"type","message"}}`.
#[derive(Serialize)]
struct AnthropicEnvelope<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    error: AnthropicBody<'a>,
}

#[derive(Serialize)]
struct AnthropicBody<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    message: &'a str,
}

/// The shape an API's clients read errors in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorShape {
    /// `{"error":{"message","type","param","code"}}`: OpenAI's APIs, pooling, the node's own.
    OpenAi,
    /// `{"type":"error","error":{"type","message"}}`: Anthropic's Messages API.
    Anthropic,
}

impl ApiError {
    /// Anthropic's error type for this status (its documented list).
    fn anthropic_kind(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            s if s >= 500 => "api_error",
            _ => "invalid_request_error",
        }
    }

    /// The error's JSON body in `shape`.
    pub fn body_shaped(&self, shape: ErrorShape) -> Vec<u8> {
        match shape {
            ErrorShape::OpenAi => serde_json::to_vec(&Envelope {
                error: Body {
                    message: &self.message,
                    kind: self.kind,
                    param: self.param,
                    code: self.code,
                },
            }),
            ErrorShape::Anthropic => serde_json::to_vec(&AnthropicEnvelope {
                kind: "error",
                error: AnthropicBody {
                    kind: self.anthropic_kind(),
                    message: &self.message,
                },
            }),
        }
        .unwrap_or_else(|_| b"{\"error\":{\"message\":\"error\"}}".to_vec())
    }

    /// The error as a response in `shape`.
    pub fn into_response_shaped(self, shape: ErrorShape) -> Response {
        let body = self.body_shaped(shape);
        let mut resp = (self.status, body).into_response();
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(s) = self.retry_after_s {
            h.insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.into_response_shaped(ErrorShape::OpenAi)
    }
}

/// An upstream status (a replica's, or another node's) that counts as a failure: the request is
/// retried elsewhere while nothing has reached the client.
pub(super) fn is_failure(status: StatusCode) -> bool {
    matches!(
        status,
        StatusCode::INTERNAL_SERVER_ERROR
            | StatusCode::BAD_GATEWAY
            | StatusCode::SERVICE_UNAVAILABLE
            | StatusCode::GATEWAY_TIMEOUT
    )
}

/// An upstream error with its causes (`error sending request: connection refused`), never its
/// URL: what a client may be told.
pub(super) fn upstream_cause(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut out = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        let text = s.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}
