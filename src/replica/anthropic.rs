//! The Anthropic Messages shapes the replica speaks (`POST /v1/messages`, as vLLM ≥ 0.11 serves
//! them, and `/v1/messages/count_tokens`): the request turned into the replica's chat messages,
//! the answer, its SSE events and Anthropic-shaped errors. Pure functions, like `openai.rs`.
//!
//! The prompt is rendered by the chat endpoint's own [`openai::render_chat`]: `system` becomes a
//! `system` message first, and each message's content its blocks in order, a text block giving its
//! text and any other block (image, tool use, tool result, …) its compact JSON, so two different
//! tool calls or images never render alike. A plain-text conversation therefore charges exactly
//! the tokens the same conversation sent to `/v1/chat/completions` does, and shares its prefix
//! cache entries.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use super::openai::{self, filler, filler_text, typed_sse, ApiError, Usage};

/// Anthropic's error `type` for an HTTP status.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

/// `{"type": "error", "error": {"type", "message"}}` for `e`.
pub fn error_body(e: &ApiError) -> Value {
    json!({"type": "error", "error": {"type": error_type(e.status), "message": e.message}})
}

/// `e` answered in Anthropic's shape, with its status.
pub fn error_response(e: &ApiError) -> Response {
    (e.status, axum::Json(error_body(e))).into_response()
}

fn bad(message: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::bad_request(message, Some(param))
}

/// What `/v1/messages` needs from a request body.
#[derive(Debug, Clone, PartialEq)]
pub struct MessagesRequest {
    /// The prompt text, rendered as the chat endpoint renders the same conversation.
    pub prompt: String,
    /// `max_tokens` (required by Anthropic's API, ≥ 1).
    pub max_tokens: u32,
    /// `stream`.
    pub stream: bool,
    /// The tool the answer calls: with `tools` and a `tool_choice` other than `none`, the tool
    /// `tool_choice` names, else the first one.
    pub tool: Option<String>,
}

/// The text one content block contributes: a text block its text, any other its compact JSON.
fn block_text(block: &Value) -> Result<String, ApiError> {
    let kind = block.get("type").and_then(Value::as_str).ok_or_else(|| {
        bad(
            "messages: each content block must be an object with a string 'type'",
            "messages",
        )
    })?;
    if kind == "text" {
        return block
            .get("text")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| bad("messages: a text block needs a string 'text'", "messages"));
    }
    Ok(block.to_string())
}

/// A message's content (string or blocks) as one text.
fn content_text(content: Option<&Value>) -> Result<String, ApiError> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(blocks)) => {
            let mut text = String::new();
            for block in blocks {
                text.push_str(&block_text(block)?);
            }
            Ok(text)
        }
        _ => Err(bad(
            "messages: each message's 'content' must be a string or a list of content blocks",
            "messages",
        )),
    }
}

/// `system`: absent, a string, or a list of text blocks (their texts joined).
fn system_text(body: &Value) -> Result<Option<String>, ApiError> {
    match body.get("system") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(blocks)) if blocks.is_empty() => Ok(None),
        Some(Value::Array(blocks)) => {
            let mut text = String::new();
            for b in blocks {
                let t = b
                    .get("text")
                    .and_then(Value::as_str)
                    .filter(|_| b.get("type").and_then(Value::as_str) == Some("text"))
                    .ok_or_else(|| bad("system: only text blocks are allowed", "system"))?;
                text.push_str(t);
            }
            Ok(Some(text))
        }
        Some(_) => Err(bad(
            "system: must be a string or a list of text blocks",
            "system",
        )),
    }
}

/// The request's conversation as the replica's chat messages (`{role, content}` with string
/// content): the system prompt first, then each message with its blocks' text.
pub fn chat_messages(body: &Value) -> Result<Vec<Value>, ApiError> {
    if !body.is_object() {
        return Err(bad("the request body must be a JSON object", "messages"));
    }
    match body.get("model") {
        None | Some(Value::Null) | Some(Value::String(_)) => {}
        Some(_) => return Err(bad("model: must be a string", "model")),
    }
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .filter(|m| !m.is_empty())
        .ok_or_else(|| bad("messages: a non-empty list is required", "messages"))?;
    let mut out = Vec::with_capacity(messages.len() + 1);
    if let Some(system) = system_text(body)? {
        out.push(json!({"role": "system", "content": system}));
    }
    for m in messages {
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            _ => {
                return Err(bad(
                    "messages: each message's 'role' must be \"user\" or \"assistant\"",
                    "messages",
                ))
            }
        };
        out.push(json!({"role": role, "content": content_text(m.get("content"))?}));
    }
    Ok(out)
}

/// The prompt text of a Messages body (the chat renderer over [`chat_messages`]).
pub fn prompt_text(body: &Value) -> Result<String, ApiError> {
    Ok(openai::render_chat(&chat_messages(body)?))
}

/// The tool the answer calls, if any (see [`MessagesRequest::tool`]).
fn chosen_tool(body: &Value) -> Result<Option<String>, ApiError> {
    let tools = match body.get("tools") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(tools)) => tools,
        Some(_) => return Err(bad("tools: must be a list", "tools")),
    };
    let Some(first) = tools.first() else {
        return Ok(None);
    };
    let choice = body.get("tool_choice").filter(|c| !c.is_null());
    if choice.is_some_and(|c| !c.is_object()) {
        return Err(bad("tool_choice: must be an object", "tool_choice"));
    }
    let kind = choice.and_then(|c| c.get("type")).and_then(Value::as_str);
    if kind == Some("none") {
        return Ok(None);
    }
    let named = choice
        .filter(|_| kind == Some("tool"))
        .and_then(|c| c.get("name"))
        .and_then(Value::as_str);
    let name = named
        .or_else(|| first.get("name").and_then(Value::as_str))
        .ok_or_else(|| bad("tools: each tool needs a string 'name'", "tools"))?;
    Ok(Some(name.to_owned()))
}

/// Parses a `/v1/messages` body.
pub fn parse(body: &Value) -> Result<MessagesRequest, ApiError> {
    let prompt = prompt_text(body)?;
    let max_tokens = match body.get("max_tokens") {
        None | Some(Value::Null) => return Err(bad("max_tokens: Field required", "max_tokens")),
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .filter(|n| *n >= 1)
            .ok_or_else(|| bad("max_tokens: must be a positive integer", "max_tokens"))?,
    };
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("stream: must be a boolean", "stream")),
    };
    Ok(MessagesRequest {
        prompt,
        max_tokens,
        stream,
        tool: chosen_tool(body)?,
    })
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": N}`, the prompt tokens `/v1/messages`
/// would charge for the same body (`max_tokens` is not needed here).
pub fn count_tokens(body: &Value) -> Result<Value, ApiError> {
    let n = crate::engine_sim::tokens::count_tokens(&prompt_text(body)?);
    Ok(json!({"input_tokens": n}))
}

/// One answer of `/v1/messages`: its ids and what it says.
#[derive(Debug, Clone)]
pub struct Reply {
    /// `msg_<replica>-<n>`.
    pub id: String,
    /// Served model name.
    pub model: String,
    /// The tool call it ends with: (`toolu_<replica>_<n>`, tool name).
    pub tool: Option<(String, String)>,
}

impl Reply {
    /// The answer to engine request `n` of `replica`.
    pub fn new(replica: &str, n: u64, model: &str, tool: Option<String>) -> Self {
        Self {
            id: format!("msg_{replica}-{n}"),
            model: model.to_owned(),
            tool: tool.map(|name| (format!("toolu_{replica}_{n}"), name)),
        }
    }

    fn stop_reason(&self) -> &'static str {
        if self.tool.is_some() {
            "tool_use"
        } else {
            "max_tokens"
        }
    }

    fn tool_block(&self) -> Option<Value> {
        self.tool
            .as_ref()
            .map(|(id, name)| json!({"type": "tool_use", "id": id, "name": name, "input": {}}))
    }

    /// Anthropic's `usage`: uncached input, cache reads, no cache writes (the engine caches
    /// every prompt by itself; nothing is billed as a write).
    pub fn usage(usage: Usage) -> Value {
        json!({
            "input_tokens": usage.prompt.saturating_sub(usage.cached),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached,
            "output_tokens": usage.completion,
        })
    }

    /// The non-streaming answer.
    pub fn full(&self, usage: Usage) -> Value {
        let mut content = vec![json!({"type": "text", "text": filler_text(usage.completion)})];
        content.extend(self.tool_block());
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": content, "stop_reason": self.stop_reason(), "stop_sequence": null,
            "usage": Self::usage(usage),
        })
    }

    /// The stream up to the first token: `message_start` (usage so far: the prompt, one output
    /// token), the text block's start, a `ping` and the first `text_delta`.
    pub fn opening(&self, usage: Usage) -> Vec<String> {
        let message = json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": Self::usage(Usage { completion: 1, ..usage }),
        });
        vec![
            typed_sse(
                "message_start",
                &json!({"type": "message_start", "message": message}),
            ),
            typed_sse(
                "content_block_start",
                &json!({"type": "content_block_start", "index": 0,
                        "content_block": {"type": "text", "text": ""}}),
            ),
            typed_sse("ping", &json!({"type": "ping"})),
            self.text_delta(0),
        ]
    }

    /// The `text_delta` of generated token `i`.
    pub fn text_delta(&self, i: u32) -> String {
        typed_sse(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": filler(i)}}),
        )
    }

    /// The stream after the last token: the text block's stop, the tool-use block if any (its
    /// input `{}` as one `input_json_delta`), `message_delta` with the stop reason and usage, and
    /// `message_stop`.
    pub fn closing(&self, usage: Usage) -> Vec<String> {
        let stop = |index: usize| {
            typed_sse(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": index}),
            )
        };
        let mut events = vec![stop(0)];
        if let Some(block) = self.tool_block() {
            events.push(typed_sse(
                "content_block_start",
                &json!({"type": "content_block_start", "index": 1, "content_block": block}),
            ));
            events.push(typed_sse(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": 1,
                        "delta": {"type": "input_json_delta", "partial_json": "{}"}}),
            ));
            events.push(stop(1));
        }
        events.push(typed_sse(
            "message_delta",
            &json!({"type": "message_delta",
                    "delta": {"stop_reason": self.stop_reason(), "stop_sequence": null},
                    "usage": Self::usage(usage)}),
        ));
        events.push(typed_sse("message_stop", &json!({"type": "message_stop"})));
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::engine_sim::tokenize;

    #[test]
    fn plain_text_conversation_renders_as_chat_does() {
        let chat = json!({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "more"}]},
        ]});
        let messages = json!({"model": "m", "max_tokens": 8,
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief.",
                    "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hello there"}]},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Tell me more"},
        ]});
        let chat_tokens = openai::parse_chat(&chat, 16).unwrap().prompt;
        let parsed = parse(&messages).unwrap();
        assert_eq!(tokenize(&parsed.prompt), chat_tokens);
        assert_eq!(parsed.max_tokens, 8);
        assert!(!parsed.stream && parsed.tool.is_none());
        let count = count_tokens(&messages).unwrap();
        assert_eq!(count["input_tokens"], chat_tokens.len());
    }

    #[test]
    fn non_text_blocks_keep_prompts_apart() {
        let with = |input: Value| {
            json!({"max_tokens": 1, "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": input}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]},
            ]})
        };
        let a = parse(&with(json!({"city": "Paris"}))).unwrap().prompt;
        let b = parse(&with(json!({"city": "Rome"}))).unwrap().prompt;
        assert_ne!(a, b);
        assert!(a.contains(r#""name":"get_weather""#), "{a}");
        assert!(a.contains("sunny") && a.contains("example.com/a.png"));
    }

    #[test]
    fn bad_requests_are_400() {
        for body in [
            json!({"messages": [{"role": "user", "content": "x"}]}),
            json!({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}),
            json!({"max_tokens": 1, "messages": []}),
            json!({"max_tokens": 1, "messages": [{"role": "system", "content": "x"}]}),
            json!({"max_tokens": 1, "messages": [{"role": "user", "content": 5}]}),
            json!({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text"}]}]}),
            json!({"max_tokens": 1, "messages": [{"role": "user", "content": [7]}]}),
            json!({"max_tokens": 1, "system": 3, "messages": [{"role": "user", "content": "x"}]}),
            json!({"max_tokens": 1, "stream": "yes", "messages": [{"role": "user", "content": "x"}]}),
            json!({"max_tokens": 1, "tools": {}, "messages": [{"role": "user", "content": "x"}]}),
            json!([1]),
        ] {
            let e = parse(&body).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(error_body(&e)["error"]["type"], "invalid_request_error");
        }
    }

    #[test]
    fn tools_make_a_tool_use_answer() {
        let body = |choice: Value| {
            json!({"max_tokens": 2, "tool_choice": choice,
                   "tools": [{"name": "a", "input_schema": {}}, {"name": "b", "input_schema": {}}],
                   "messages": [{"role": "user", "content": "x"}]})
        };
        assert_eq!(
            parse(&body(Value::Null)).unwrap().tool.as_deref(),
            Some("a")
        );
        let named = json!({"type": "tool", "name": "b"});
        assert_eq!(parse(&body(named)).unwrap().tool.as_deref(), Some("b"));
        assert_eq!(parse(&body(json!({"type": "none"}))).unwrap().tool, None);

        let reply = Reply::new("r0", 7, "sim", Some("a".into()));
        let usage = Usage {
            prompt: 10,
            cached: 4,
            completion: 2,
        };
        let full = reply.full(usage);
        assert_eq!(full["id"], "msg_r0-7");
        assert_eq!(full["stop_reason"], "tool_use");
        assert_eq!(full["content"][0]["text"], filler_text(2));
        assert_eq!(
            full["content"][1],
            json!({"type": "tool_use", "id": "toolu_r0_7", "name": "a", "input": {}})
        );
        assert_eq!(
            full["usage"],
            json!({"input_tokens": 6, "cache_creation_input_tokens": 0,
                   "cache_read_input_tokens": 4, "output_tokens": 2})
        );
        let plain = Reply::new("r0", 8, "sim", None).full(usage);
        assert_eq!(plain["stop_reason"], "max_tokens");
        assert_eq!(plain["content"].as_array().map(Vec::len), Some(1));
    }

    #[test]
    fn stream_events_in_anthropic_order() {
        let reply = Reply::new("r0", 1, "sim", Some("t".into()));
        let usage = Usage {
            prompt: 5,
            cached: 0,
            completion: 2,
        };
        let mut events = reply.opening(usage);
        events.push(reply.text_delta(1));
        events.extend(reply.closing(usage));
        let names: Vec<&str> = events
            .iter()
            .filter_map(|e| e.strip_prefix("event: "))
            .filter_map(|e| e.split('\n').next())
            .collect();
        assert_eq!(
            names,
            [
                "message_start",
                "content_block_start",
                "ping",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        let start: Value = serde_json::from_str(
            events[0]
                .lines()
                .nth(1)
                .and_then(|l| l.strip_prefix("data: "))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(start["message"]["usage"]["output_tokens"], 1);
        assert_eq!(start["message"]["content"], json!([]));
    }

    #[test]
    fn errors_by_status() {
        let e = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "x", "down");
        assert_eq!(
            error_body(&e),
            json!({"type": "error", "error": {"type": "overloaded_error", "message": "down"}})
        );
        let e = ApiError::new(StatusCode::NOT_FOUND, "x", "no");
        assert_eq!(error_body(&e)["error"]["type"], "not_found_error");
        let e = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "x", "boom");
        assert_eq!(error_body(&e)["error"]["type"], "api_error");
    }
}
