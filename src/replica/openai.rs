//! The OpenAI request/response shapes the replica speaks: prompt extraction from completions and
//! chat requests, deterministic filler output, SSE chunks, and OpenAI-shaped errors. Pure functions,
//! so the HTTP layer stays thin.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use crate::engine_sim::{tokenize, TokenId};

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message.
    pub message: String,
    /// OpenAI error type, e.g. "BadRequestError".
    pub kind: &'static str,
    /// The offending parameter, if any.
    pub param: Option<&'static str>,
}

impl ApiError {
    /// A 400 about `param`.
    pub fn bad_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "BadRequestError",
            param,
        }
    }

    /// Any status with a message.
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `/v1/completions`
    Completion,
    /// `/v1/chat/completions`
    Chat,
}

/// What the replica needs from a request body.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    /// Endpoint.
    pub kind: Kind,
    /// Prompt tokens.
    pub prompt: Vec<TokenId>,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// SSE streaming requested.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// Filler tokens the text being continued already ends with (a completion prompt, or a
    /// chat's open assistant message): the answer goes on from there ([`filler_offset`]).
    pub offset: u32,
    /// vLLM's `cache_salt`: only requests with the same salt share cached blocks.
    pub cache_salt: Option<String>,
}

/// The body's `cache_salt`, as vLLM reads it (a non-empty string, else none).
fn cache_salt(body: &Value) -> Result<Option<String>, ApiError> {
    match body.get("cache_salt") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::bad_request(
            "cache_salt must be a non-empty string",
            Some("cache_salt"),
        )),
    }
}

fn max_tokens(body: &Value, default: u32) -> Result<u32, ApiError> {
    let v = body
        .get("max_completion_tokens")
        .filter(|v| !v.is_null())
        .or_else(|| body.get("max_tokens").filter(|v| !v.is_null()));
    match v {
        None => Ok(default),
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .filter(|n| *n >= 1)
            .ok_or_else(|| {
                ApiError::bad_request("max_tokens must be a positive integer", Some("max_tokens"))
            }),
    }
}

fn stream_flags(body: &Value) -> (bool, bool) {
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let usage = body
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    (stream, usage)
}

fn token_ids(items: &[Value]) -> Option<Vec<TokenId>> {
    items
        .iter()
        .map(|t| t.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect()
}

/// Parses a `/v1/completions` body. `prompt` may be a string, a one-element list of strings, a list
/// of token ids or a one-element list of token-id lists; batched prompts are refused.
pub fn parse_completion(body: &Value, default_max_tokens: u32) -> Result<Parsed, ApiError> {
    let missing = || {
        ApiError::bad_request(
            "'prompt' is required: a string or a list of token ids",
            Some("prompt"),
        )
    };
    let prompt = match body.get("prompt").ok_or_else(missing)? {
        Value::String(s) => tokenize(s),
        Value::Array(items) => match items.as_slice() {
            [Value::String(s)] => tokenize(s),
            [Value::Array(ids)] => token_ids(ids).ok_or_else(missing)?,
            ids if ids.iter().all(Value::is_number) => token_ids(ids).ok_or_else(missing)?,
            _ => {
                return Err(ApiError::bad_request(
                    "batched prompts are not supported by the simulated replica",
                    Some("prompt"),
                ))
            }
        },
        _ => return Err(missing()),
    };
    let (stream, include_usage) = stream_flags(body);
    let text = match body.get("prompt") {
        Some(Value::String(s)) => Some(s.as_str()),
        Some(Value::Array(items)) => items.first().and_then(Value::as_str),
        _ => None,
    };
    Ok(Parsed {
        kind: Kind::Completion,
        offset: text.map_or(0, filler_offset),
        prompt,
        max_tokens: max_tokens(body, default_max_tokens)?,
        stream,
        include_usage,
        cache_salt: cache_salt(body)?,
    })
}

/// How a chat is closed, as vLLM's `add_generation_prompt` and `continue_final_message` say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatClose {
    /// Append the generation prompt `<|assistant|>\n` (vLLM default: true).
    pub add_generation_prompt: bool,
    /// Leave the final message open (no closing `\n`) so the model continues it (default false).
    pub continue_final_message: bool,
}

impl Default for ChatClose {
    fn default() -> Self {
        Self {
            add_generation_prompt: true,
            continue_final_message: false,
        }
    }
}

/// Renders chat messages to the prompt text the replica tokenizes, closed the default way (see
/// [`render_chat_with`]).
pub fn render_chat(messages: &[Value]) -> String {
    render_chat_with(messages, ChatClose::default())
}

/// Renders chat messages: per message `<|role|>\n`, the text of its content (string or all text
/// parts), `\n`; then the generation prompt `<|assistant|>\n` if asked for. With
/// `continue_final_message` the last message keeps no closing `\n`. A stand-in for a chat template
/// that keeps multi-turn prefixes stable.
pub fn render_chat_with(messages: &[Value], close: ChatClose) -> String {
    let mut out = String::new();
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
        out.push_str("<|");
        out.push_str(role);
        out.push_str("|>\n");
        match m.get("content") {
            Some(Value::String(s)) => out.push_str(s),
            Some(Value::Array(parts)) => {
                for part in parts {
                    if let Some(text) = part.get("text").and_then(Value::as_str) {
                        out.push_str(text);
                    }
                }
            }
            _ => {}
        }
        let last = i + 1 == messages.len();
        if !(last && close.continue_final_message) {
            out.push('\n');
        }
    }
    if close.add_generation_prompt && !close.continue_final_message {
        out.push_str("<|assistant|>\n");
    }
    out
}

fn optional_bool(body: &Value, key: &'static str) -> Result<Option<bool>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::bad_request(
            format!("'{key}' must be a boolean"),
            Some(key),
        )),
    }
}

/// The prompt text of a chat body (`messages`, `add_generation_prompt`, `continue_final_message`).
/// One function for `/v1/chat/completions`, `/tokenize` and the render endpoint, so all three
/// charge the same tokens for the same body.
pub fn chat_prompt(body: &Value) -> Result<String, ApiError> {
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .filter(|m| !m.is_empty())
        .ok_or_else(|| {
            ApiError::bad_request("'messages' is required: a non-empty list", Some("messages"))
        })?;
    if messages.iter().any(|m| !m.is_object()) {
        return Err(ApiError::bad_request(
            "each message must be an object",
            Some("messages"),
        ));
    }
    let continue_final_message = optional_bool(body, "continue_final_message")?.unwrap_or(false);
    let add_generation_prompt = optional_bool(body, "add_generation_prompt")?;
    if continue_final_message && add_generation_prompt == Some(true) {
        // vLLM's wording (TokenizeChatRequest / ChatCompletionRequest validators).
        return Err(ApiError::bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            Some("continue_final_message"),
        ));
    }
    let close = ChatClose {
        add_generation_prompt: add_generation_prompt.unwrap_or(true),
        continue_final_message,
    };
    Ok(render_chat_with(messages, close))
}

/// Parses a `/v1/chat/completions` body.
pub fn parse_chat(body: &Value, default_max_tokens: u32) -> Result<Parsed, ApiError> {
    let prompt = tokenize(&chat_prompt(body)?);
    let (stream, include_usage) = stream_flags(body);
    // An open assistant message (`continue_final_message`) is continued where it stops.
    let open = body.get("continue_final_message").and_then(Value::as_bool) == Some(true);
    let last = body
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|m| m.last())
        .filter(|m| open && m.get("role").and_then(Value::as_str) == Some("assistant"));
    let offset = last
        .and_then(|m| m.get("content"))
        .and_then(Value::as_str)
        .map_or(0, filler_offset);
    Ok(Parsed {
        kind: Kind::Chat,
        offset,
        prompt,
        max_tokens: max_tokens(body, default_max_tokens)?,
        stream,
        include_usage,
        cache_salt: cache_salt(body)?,
    })
}

const WORDS: &[&str] = &[
    " the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", " and", " then",
    " rests",
];

/// The text of generated token `i` (0-based): deterministic filler.
pub fn filler(i: u32) -> &'static str {
    WORDS[i as usize % WORDS.len()]
}

/// Longest run of filler words a text is scanned back for.
const MAX_FILLER_RUN: u32 = 1 << 20;

/// How many filler tokens `text` ends with, counted from the filler's first word: the index a
/// continuation of `text` starts at, so an answer continued on another replica reads as one
/// (`filler_text(k) + continuation == filler_text(k + m)`). 0 when it ends with none.
pub fn filler_offset(text: &str) -> u32 {
    let Some(last) = WORDS.iter().position(|w| text.ends_with(w)) else {
        return 0;
    };
    let mut rest = &text[..text.len() - WORDS[last].len()];
    let (mut run, mut at) = (1u32, last);
    while run < MAX_FILLER_RUN {
        let prev = (at + WORDS.len() - 1) % WORDS.len();
        let Some(before) = rest.strip_suffix(WORDS[prev]) else {
            break;
        };
        (rest, at, run) = (before, prev, run + 1);
    }
    // The run's words have indexes ≡ last − run + 1 ..= last; the longest suffix starting at a
    // first word has a length ≡ last + 1 (mod the cycle).
    let shortest = last as u32 + 1;
    if run < shortest {
        return 0;
    }
    let cycle = WORDS.len() as u32;
    shortest + (run - shortest) / cycle * cycle
}

/// The whole filler text of `n` tokens.
pub fn filler_text(n: u32) -> String {
    (0..n).map(filler).collect()
}

/// Token accounting of a finished (or finishing) request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt: usize,
    /// Of which served from the prefix cache.
    pub cached: usize,
    /// Generated tokens.
    pub completion: u32,
}

impl Usage {
    /// OpenAI's `usage` object.
    pub fn json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion as usize,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        })
    }
}

/// Identity of one response.
#[derive(Debug, Clone)]
pub struct Meta {
    /// Response id, e.g. "cmpl-replica-1-7".
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// Endpoint.
    pub kind: Kind,
}

impl Meta {
    fn object(&self, stream: bool) -> &'static str {
        match (self.kind, stream) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Chat, false) => "chat.completion",
        }
    }

    /// One SSE event carrying filler word `i` (the answer's `first` token carries the chat
    /// role); `last` sets `finish_reason`.
    pub fn token_chunk(&self, i: u32, first: bool, last: bool, include_usage: bool) -> String {
        let finish = if last { json!("length") } else { Value::Null };
        let choice = match self.kind {
            Kind::Completion => json!({
                "index": 0, "text": filler(i), "logprobs": null,
                "finish_reason": finish, "stop_reason": null,
            }),
            Kind::Chat => {
                let delta = if first {
                    json!({"role": "assistant", "content": filler(i)})
                } else {
                    json!({"content": filler(i)})
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
        };
        let mut chunk = json!({
            "id": self.id, "object": self.object(true), "created": self.created,
            "model": self.model, "choices": [choice],
        });
        if include_usage {
            chunk["usage"] = Value::Null;
        }
        sse(&chunk)
    }

    /// The final usage-only SSE event of `stream_options.include_usage`.
    pub fn usage_chunk(&self, usage: Usage) -> String {
        sse(&json!({
            "id": self.id, "object": self.object(true), "created": self.created,
            "model": self.model, "choices": [], "usage": usage.json(),
        }))
    }

    /// The non-streaming response body.
    pub fn full_response(&self, usage: Usage) -> Value {
        let text = filler_text(usage.completion);
        let choice = match self.kind {
            Kind::Completion => json!({
                "index": 0, "text": text, "logprobs": null,
                "finish_reason": "length", "stop_reason": null,
            }),
            Kind::Chat => json!({
                "index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": null, "finish_reason": "length",
            }),
        };
        json!({
            "id": self.id, "object": self.object(false), "created": self.created,
            "model": self.model, "choices": [choice], "usage": usage.json(),
        })
    }
}

fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

/// One SSE event with an `event:` line, as Anthropic's stream and the Responses API's typed
/// stream send them (clients dispatch on it; Anthropic's skips events without one).
pub fn typed_sse(event: &str, data: &Value) -> String {
    format!("event: {event}\ndata: {data}\n\n")
}

/// The SSE terminator.
pub const SSE_DONE: &str = "data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completion_prompt_forms() {
        let p = parse_completion(&json!({"prompt": "abcdefgh"}), 16).unwrap();
        assert_eq!(p.prompt.len(), 2);
        assert_eq!(p.max_tokens, 16);
        let p = parse_completion(
            &json!({"prompt": [1, 2, 3], "max_tokens": 4, "stream": true}),
            16,
        )
        .unwrap();
        assert_eq!((p.prompt, p.max_tokens, p.stream), (vec![1, 2, 3], 4, true));
        let p = parse_completion(&json!({"prompt": [[5, 6]]}), 16).unwrap();
        assert_eq!(p.prompt, vec![5, 6]);
        assert!(parse_completion(&json!({}), 16).is_err());
        assert!(parse_completion(&json!({"prompt": ["a", "b"]}), 16).is_err());
        assert!(parse_completion(&json!({"prompt": "x", "max_tokens": 0}), 16).is_err());
        assert!(parse_completion(&json!({"prompt": [-1]}), 16).is_err());
    }

    #[test]
    fn chat_renders_roles_and_all_text_parts() {
        let body = json!({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "image_url"}, {"type": "text", "text": "there"}]},
        ], "stream_options": {"include_usage": true}});
        let msgs = body["messages"].as_array().unwrap();
        assert_eq!(
            render_chat(msgs),
            "<|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\n"
        );
        let p = parse_chat(&body, 16).unwrap();
        assert!(p.include_usage);
        assert!(parse_chat(&json!({"messages": []}), 16).is_err());
        assert!(parse_chat(&json!({"prompt": "x"}), 16).is_err());
    }

    #[test]
    fn a_continuation_goes_on_where_the_text_stopped() {
        for k in [0, 1, 5, 11, 12, 13, 40] {
            assert_eq!(filler_offset(&filler_text(k)), k, "{k}");
            assert_eq!(filler_offset(&format!("Tell me{}", filler_text(k))), k);
        }
        assert_eq!(filler_offset("no filler here"), 0);
        assert_eq!(
            filler_offset(" quick"),
            0,
            "a run must start at the first word"
        );
        let p = parse_completion(&json!({"prompt": format!("x{}", filler_text(3))}), 4).unwrap();
        assert_eq!(p.offset, 3);
        let body = json!({"messages": [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": filler_text(2)}],
            "continue_final_message": true, "add_generation_prompt": false});
        assert_eq!(parse_chat(&body, 4).unwrap().offset, 2);
    }

    #[test]
    fn error_shape() {
        let e = ApiError::bad_request("nope", Some("prompt")).body();
        assert_eq!(e["error"]["type"], "BadRequestError");
        assert_eq!(e["error"]["param"], "prompt");
        assert_eq!(e["error"]["code"], 400);
    }
}
