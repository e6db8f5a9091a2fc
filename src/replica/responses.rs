//! The OpenAI Responses shapes the replica speaks (`POST /v1/responses`, `GET
//! /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, as vLLM ≥ 0.11 serves them): the
//! request turned into the replica's chat messages, the response object and its typed SSE
//! events, and the bounded store that `previous_response_id` reads. Pure, like `openai.rs`.
//!
//! The prompt is the chat endpoint's own [`openai::render_chat`] over `instructions` (a `system`
//! message first), then the stored conversation of `previous_response_id` (its inputs, without
//! its instructions, and its output as an `assistant` message), then this turn's input. So a
//! second turn's prompt extends the first's (a prefix-cache hit), and a plain-text conversation
//! charges the tokens the same one sent to `/v1/chat/completions` does.

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::http::StatusCode;
use lru::LruCache;
use serde_json::{json, Map, Value};

use super::openai::{self, filler, filler_text, typed_sse, ApiError, Usage};

/// Most responses the store keeps (least recently used go first).
pub const MAX_STORED: usize = 4096;
/// Largest stored entry (its conversation plus its response object), in bytes; a bigger one is
/// answered but not kept, so a follow-up naming it gets a 404, never an answer without context.
pub const MAX_ENTRY_BYTES: usize = 1 << 20;
/// Most bytes the whole store keeps.
pub const MAX_STORE_BYTES: usize = 64 << 20;

fn bad(message: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::bad_request(message, Some(param))
}

/// A chat message of the replica's renderer.
fn message(role: &str, content: String) -> Value {
    json!({"role": role, "content": content})
}

/// The text of one content part: text kinds give their text, a refusal its refusal, any other
/// part (image, file, audio) its compact JSON, so different images never render alike.
fn part_text(part: &Value) -> Result<String, ApiError> {
    let kind = part.get("type").and_then(Value::as_str).ok_or_else(|| {
        bad(
            "each content part must be an object with a string 'type'",
            "input",
        )
    })?;
    let field = match kind {
        "input_text" | "output_text" | "text" => "text",
        "refusal" => "refusal",
        _ => return Ok(part.to_string()),
    };
    part.get(field)
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| bad(format!("a '{kind}' part needs a string '{field}'"), "input"))
}

/// One input item as a chat message.
fn input_item(item: &Value) -> Result<Value, ApiError> {
    match item.get("type").and_then(Value::as_str) {
        None | Some("message") => {
            let role =
                match item.get("role").and_then(Value::as_str) {
                    Some(r @ ("user" | "assistant" | "system" | "developer")) => r,
                    _ => return Err(bad(
                        "each input message needs a 'role': user, assistant, system or developer",
                        "input",
                    )),
                };
            let content = match item.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut text = String::new();
                    for p in parts {
                        text.push_str(&part_text(p)?);
                    }
                    text
                }
                _ => {
                    return Err(bad(
                        "an input message's 'content' must be a string or a list of parts",
                        "input",
                    ))
                }
            };
            Ok(message(role, content))
        }
        // Only the call's own fields, so an item echoed back from an output (with its `id` and
        // `status`) renders as the same call.
        Some("function_call") => {
            let call = json!({
                "type": "function_call",
                "call_id": item.get("call_id"),
                "name": item.get("name"),
                "arguments": item.get("arguments"),
            });
            Ok(message("assistant", call.to_string()))
        }
        Some("function_call_output") => {
            let output = match item.get("output") {
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
                None => return Err(bad("a function_call_output needs 'output'", "input")),
            };
            Ok(message("tool", output))
        }
        Some(other) => Err(bad(
            format!("input items of type '{other}' are not supported by the simulated replica"),
            "input",
        )),
    }
}

/// `input` as chat messages: a string is one user message.
fn input_messages(input: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    match input {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![message("user", s.clone())]),
        Some(Value::Array(items)) => items.iter().map(input_item).collect(),
        Some(_) => Err(bad(
            "'input' must be a string or a list of input items",
            "input",
        )),
    }
}

fn optional<'a>(body: &'a Value, key: &str) -> Option<&'a Value> {
    body.get(key).filter(|v| !v.is_null())
}

fn flag(body: &Value, key: &'static str, default: bool) -> Result<bool, ApiError> {
    match optional(body, key) {
        None => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(bad(format!("'{key}' must be a boolean"), key)),
    }
}

fn optional_str(body: &Value, key: &'static str) -> Result<Option<String>, ApiError> {
    match optional(body, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(bad(format!("'{key}' must be a string"), key)),
    }
}

/// Request fields a response object echoes.
const ECHOED: [&str; 8] = [
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "temperature",
    "top_p",
    "metadata",
    "text",
    "truncation",
];

/// What a response object shows for an echoed field the request leaves out (OpenAI's defaults).
fn echo_default(key: &str) -> Value {
    match key {
        "tools" => json!([]),
        "tool_choice" => json!("auto"),
        "parallel_tool_calls" => json!(true),
        "temperature" | "top_p" => json!(1.0),
        "metadata" => json!({}),
        "text" => json!({"format": {"type": "text"}}),
        "truncation" => json!("disabled"),
        _ => Value::Null,
    }
}

/// What `/v1/responses` needs from a request body.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponsesRequest {
    /// `instructions`: a system message before everything, not carried to follow-ups.
    pub instructions: Option<String>,
    /// This turn's input as chat messages.
    pub input: Vec<Value>,
    /// The response this one continues.
    pub previous_response_id: Option<String>,
    /// Keep the response for `previous_response_id` and `GET` (default true).
    pub store: bool,
    /// `stream`.
    pub stream: bool,
    /// `max_output_tokens`, or the replica's default.
    pub max_tokens: u32,
    /// `max_output_tokens` as given (echoed).
    pub max_output_tokens: Option<u32>,
    /// The echoed request fields ([`ECHOED`]), defaults filled in.
    pub echo: Map<String, Value>,
}

/// Parses a `/v1/responses` body.
pub fn parse(body: &Value, default_max_tokens: u32) -> Result<ResponsesRequest, ApiError> {
    if !body.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
            None,
        ));
    }
    optional_str(body, "model")?;
    if flag(body, "background", false)? {
        return Err(bad(
            "background responses are not supported by the simulated replica",
            "background",
        ));
    }
    let max_output_tokens = match optional(body, "max_output_tokens") {
        None => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .filter(|n| *n >= 1)
                .ok_or_else(|| {
                    bad(
                        "'max_output_tokens' must be a positive integer",
                        "max_output_tokens",
                    )
                })?,
        ),
    };
    let echo = ECHOED
        .iter()
        .map(|key| {
            let v = optional(body, key)
                .cloned()
                .unwrap_or_else(|| echo_default(key));
            ((*key).to_owned(), v)
        })
        .collect();
    Ok(ResponsesRequest {
        instructions: optional_str(body, "instructions")?,
        input: input_messages(body.get("input"))?,
        previous_response_id: optional_str(body, "previous_response_id")?,
        store: flag(body, "store", true)?,
        stream: flag(body, "stream", false)?,
        max_tokens: max_output_tokens.unwrap_or(default_max_tokens),
        max_output_tokens,
        echo,
    })
}

/// The 404 for a `previous_response_id` the store does not hold.
pub fn unknown_previous(id: &str) -> ApiError {
    ApiError {
        param: Some("previous_response_id"),
        ..ApiError::new(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!(
                "Previous response with id '{id}' not found (unknown to this replica, not stored, \
                 or evicted from its store)."
            ),
        )
    }
}

/// The 404 for a response id the store does not hold.
pub fn unknown_response(id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "NotFoundError",
        format!("Response with id '{id}' not found."),
    )
}

/// The 400 for cancelling a stored response: only background responses can be, and the replica
/// runs none.
pub fn not_cancellable(id: &str) -> ApiError {
    ApiError::bad_request(
        format!(
            "Only responses created with background=true can be cancelled; '{id}' was not (the \
             simulated replica runs no background responses)."
        ),
        None,
    )
}

/// The messages this turn's prompt renders: instructions, the earlier conversation, the input.
pub fn prompt_messages(req: &ResponsesRequest, history: &[Value]) -> Vec<Value> {
    let mut out = Vec::with_capacity(history.len() + req.input.len() + 1);
    if let Some(i) = &req.instructions {
        out.push(message("system", i.clone()));
    }
    out.extend_from_slice(history);
    out.extend_from_slice(&req.input);
    out
}

/// This turn's prompt text (the chat renderer over [`prompt_messages`]).
pub fn prompt_text(req: &ResponsesRequest, history: &[Value]) -> String {
    openai::render_chat(&prompt_messages(req, history))
}

/// The conversation a follow-up continues: the earlier one, this input and this output.
pub fn conversation_after(req: &ResponsesRequest, history: &[Value], output: &str) -> Vec<Value> {
    let mut out = Vec::with_capacity(history.len() + req.input.len() + 1);
    out.extend_from_slice(history);
    out.extend_from_slice(&req.input);
    out.push(message("assistant", output.to_owned()));
    out
}

/// One response being answered: its identity and the request fields it echoes.
#[derive(Debug, Clone)]
pub struct Draft {
    /// `resp_<replica>_<n>`.
    pub id: String,
    /// The output message's id, `msg_<replica>_<n>`.
    pub item_id: String,
    /// Unix seconds.
    pub created_at: u64,
    /// Served model name.
    pub model: String,
    /// The request.
    pub req: ResponsesRequest,
}

impl Draft {
    /// The response to engine request `n` of `replica`.
    pub fn new(replica: &str, n: u64, created_at: u64, model: &str, req: ResponsesRequest) -> Self {
        Self {
            id: format!("resp_{replica}_{n}"),
            item_id: format!("msg_{replica}_{n}"),
            created_at,
            model: model.to_owned(),
            req,
        }
    }

    /// The `output_text` part.
    fn part(text: &str) -> Value {
        json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
    }

    /// The output message item.
    pub fn item(&self, text: Option<&str>) -> Value {
        let (status, content) = match text {
            Some(t) => ("completed", vec![Self::part(t)]),
            None => ("in_progress", Vec::new()),
        };
        json!({"type": "message", "id": self.item_id, "status": status, "role": "assistant",
               "content": content})
    }

    /// The response object: in progress (no usage, no output) or completed.
    pub fn object(&self, done: Option<Usage>) -> Value {
        let (status, output, usage) = match done {
            Some(u) => {
                let text = filler_text(u.completion);
                ("completed", json!([self.item(Some(&text))]), usage(u))
            }
            None => ("in_progress", json!([]), Value::Null),
        };
        let mut o = json!({
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "background": false, "error": null, "incomplete_details": null,
            "instructions": self.req.instructions, "max_output_tokens": self.req.max_output_tokens,
            "max_tool_calls": null, "model": self.model, "output": output,
            "previous_response_id": self.req.previous_response_id, "prompt": null,
            "reasoning": {"effort": null, "summary": null}, "service_tier": "auto",
            "store": self.req.store, "top_logprobs": 0, "usage": usage, "user": null,
        });
        if let Some(map) = o.as_object_mut() {
            map.extend(self.req.echo.clone());
        }
        o
    }

    /// The typed events up to the first token's delta; `seq` numbers them.
    pub fn opening(&self, seq: &mut u64) -> Vec<String> {
        let pending = self.object(None);
        vec![
            event(seq, "response.created", json!({"response": pending})),
            event(seq, "response.in_progress", json!({"response": pending})),
            event(
                seq,
                "response.output_item.added",
                json!({"output_index": 0, "item": self.item(None)}),
            ),
            event(
                seq,
                "response.content_part.added",
                json!({"item_id": self.item_id, "output_index": 0, "content_index": 0,
                       "part": Self::part("")}),
            ),
            self.delta(seq, 0),
        ]
    }

    /// The `response.output_text.delta` of generated token `i`.
    pub fn delta(&self, seq: &mut u64, i: u32) -> String {
        event(
            seq,
            "response.output_text.delta",
            json!({"item_id": self.item_id, "output_index": 0, "content_index": 0,
                   "delta": filler(i), "logprobs": []}),
        )
    }

    /// The typed events after the last token, `completed` being the finished response object.
    pub fn closing(&self, seq: &mut u64, completed: &Value, text: &str) -> Vec<String> {
        let at = json!({"item_id": self.item_id, "output_index": 0, "content_index": 0});
        let with = |extra: Value| {
            let mut v = at.clone();
            if let (Some(v), Some(extra)) = (v.as_object_mut(), extra.as_object()) {
                v.extend(extra.clone());
            }
            v
        };
        vec![
            event(
                seq,
                "response.output_text.done",
                with(json!({"text": text, "logprobs": []})),
            ),
            event(
                seq,
                "response.content_part.done",
                with(json!({"part": Self::part(text)})),
            ),
            event(
                seq,
                "response.output_item.done",
                json!({"output_index": 0, "item": self.item(Some(text))}),
            ),
            event(seq, "response.completed", json!({"response": completed})),
        ]
    }
}

/// The Responses `usage` object.
pub fn usage(u: Usage) -> Value {
    json!({
        "input_tokens": u.prompt,
        "input_tokens_details": {"cached_tokens": u.cached},
        "output_tokens": u.completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt + u.completion as usize,
    })
}

/// One typed event: `type` and `sequence_number` added to `fields`.
fn event(seq: &mut u64, kind: &str, mut fields: Value) -> String {
    if let Some(o) = fields.as_object_mut() {
        o.insert("type".into(), json!(kind));
        o.insert("sequence_number".into(), json!(*seq));
    }
    *seq += 1;
    typed_sse(kind, &fields)
}

/// A stored response: its JSON (for `GET`) and the conversation a follow-up continues.
#[derive(Debug)]
struct Stored {
    response: Bytes,
    conversation: Arc<Vec<Value>>,
    bytes: usize,
}

#[derive(Debug)]
struct StoreInner {
    entries: LruCache<String, Stored>,
    bytes: usize,
}

/// Stored responses by id: at most `max_entries` (LRU), each at most `max_entry_bytes`, all
/// together at most `max_bytes`. The ids are the replica's own, so a client can add entries only
/// by paying for engine requests, and the caps bound what they keep.
#[derive(Debug)]
pub struct Store {
    inner: Mutex<StoreInner>,
    max_entry_bytes: usize,
    max_bytes: usize,
}

impl Default for Store {
    fn default() -> Self {
        Self::new(MAX_STORED, MAX_ENTRY_BYTES, MAX_STORE_BYTES)
    }
}

impl Store {
    /// An empty store with these caps (a zero count keeps one).
    pub fn new(max_entries: usize, max_entry_bytes: usize, max_bytes: usize) -> Self {
        let cap = NonZeroUsize::new(max_entries).unwrap_or(NonZeroUsize::MIN);
        Self {
            inner: Mutex::new(StoreInner {
                entries: LruCache::new(cap),
                bytes: 0,
            }),
            max_entry_bytes,
            max_bytes: max_bytes.max(max_entry_bytes),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, StoreInner> {
        // A panic elsewhere while holding the lock leaves plain data behind; keep using it.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps `response` (the object `GET` answers) and the `conversation` a follow-up continues;
    /// false, keeping nothing, if together they are over the entry cap.
    pub fn insert(&self, id: String, response: &Value, conversation: Vec<Value>) -> bool {
        let response = Bytes::from(response.to_string());
        let conversation_bytes = serde_json::to_vec(&conversation).map_or(usize::MAX, |v| v.len());
        let bytes = response.len().saturating_add(conversation_bytes);
        if bytes > self.max_entry_bytes {
            return false;
        }
        let mut s = self.lock();
        if let Some(old) = s.entries.pop(&id) {
            s.bytes -= old.bytes;
        }
        while s.entries.len() >= s.entries.cap().get() || s.bytes + bytes > self.max_bytes {
            match s.entries.pop_lru() {
                Some((_, old)) => s.bytes -= old.bytes,
                None => break,
            }
        }
        s.bytes += bytes;
        let conversation = Arc::new(conversation);
        s.entries.put(
            id,
            Stored {
                response,
                conversation,
                bytes,
            },
        );
        true
    }

    /// The conversation of stored response `id` (and marks it recently used).
    pub fn conversation(&self, id: &str) -> Option<Arc<Vec<Value>>> {
        self.lock().entries.get(id).map(|e| e.conversation.clone())
    }

    /// The JSON of stored response `id`.
    pub fn response(&self, id: &str) -> Option<Bytes> {
        self.lock().entries.get(id).map(|e| e.response.clone())
    }

    /// Entries and bytes kept.
    pub fn size(&self) -> (usize, usize) {
        let s = self.lock();
        (s.entries.len(), s.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::engine_sim::tokenize;

    fn req(body: Value) -> ResponsesRequest {
        parse(&body, 16).unwrap()
    }

    #[test]
    fn plain_text_conversation_renders_as_chat_does() {
        let chat = json!({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": [{"type": "text", "text": "More"}]},
        ]});
        let chat_tokens = openai::parse_chat(&chat, 16).unwrap().prompt;
        let r = req(json!({"model": "m", "instructions": "Be brief.", "input": [
            {"role": "user", "content": "Hello"},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Hi.", "annotations": []}]},
            {"role": "user", "content": [{"type": "input_text", "text": "More"}]},
        ]}));
        assert_eq!(tokenize(&prompt_text(&r, &[])), chat_tokens);

        let single = req(json!({"input": "Hello"}));
        let chat = json!({"messages": [{"role": "user", "content": "Hello"}]});
        assert_eq!(
            tokenize(&prompt_text(&single, &[])),
            openai::parse_chat(&chat, 16).unwrap().prompt
        );
    }

    #[test]
    fn a_second_turn_extends_the_first() {
        let first = req(json!({"instructions": "Be brief.", "input": "Hello"}));
        let p1 = prompt_text(&first, &[]);
        let history = conversation_after(&first, &[], "Hi there.");
        let second = req(json!({"instructions": "Be brief.", "input": "And then?",
                                "previous_response_id": "resp_r0_1"}));
        let p2 = prompt_text(&second, &history);
        assert!(p2.starts_with(&p1), "{p2:?} does not extend {p1:?}");
        assert!(p2.contains("Hi there.") && p2.ends_with("And then?\n<|assistant|>\n"));
        // The first turn's instructions are not carried: without new ones there is no system.
        let bare = req(json!({"input": "x", "previous_response_id": "resp_r0_1"}));
        assert!(prompt_text(&bare, &history).starts_with("<|user|>\nHello\n"));
        assert_eq!(second.previous_response_id.as_deref(), Some("resp_r0_1"));
    }

    #[test]
    fn function_calls_render_by_their_fields() {
        let call = |args: &str, extra: Value| {
            let mut item = json!({"type": "function_call", "call_id": "c1", "name": "f",
                                  "arguments": args});
            if let (Some(i), Some(e)) = (item.as_object_mut(), extra.as_object()) {
                i.extend(e.clone());
            }
            req(json!({"input": [{"role": "user", "content": "x"}, item,
                       {"type": "function_call_output", "call_id": "c1", "output": "42"}]}))
        };
        let a = prompt_text(&call("{\"a\":1}", json!({})), &[]);
        let b = prompt_text(&call("{\"a\":2}", json!({})), &[]);
        let echoed = prompt_text(
            &call("{\"a\":1}", json!({"id": "fc_1", "status": "completed"})),
            &[],
        );
        assert_ne!(a, b);
        assert_eq!(a, echoed);
        assert!(a.contains("<|tool|>\n42\n"));
    }

    #[test]
    fn bad_requests_are_400() {
        for body in [
            json!([1]),
            json!({"input": 5}),
            json!({"input": [{"role": "robot", "content": "x"}]}),
            json!({"input": [{"role": "user", "content": 5}]}),
            json!({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}),
            json!({"input": [{"type": "reasoning", "summary": []}]}),
            json!({"input": "x", "max_output_tokens": 0}),
            json!({"input": "x", "store": "no"}),
            json!({"input": "x", "instructions": 3}),
            json!({"input": "x", "background": true}),
            json!({"input": "x", "previous_response_id": 3}),
        ] {
            assert_eq!(parse(&body, 16).unwrap_err().status, 400, "{body}");
        }
        let e = unknown_previous("resp_x_1");
        assert_eq!(e.status, 404);
        assert_eq!(e.body()["error"]["param"], "previous_response_id");
        assert!(e.message.contains("resp_x_1"));
    }

    #[test]
    fn response_object_has_the_client_fields() {
        let r = req(
            json!({"input": "hi", "max_output_tokens": 3, "temperature": 0.5,
                           "metadata": {"k": "v"}}),
        );
        assert_eq!((r.max_tokens, r.store, r.stream), (3, true, false));
        let d = Draft::new("r0", 9, 100, "sim", r);
        let usage = Usage {
            prompt: 10,
            cached: 4,
            completion: 3,
        };
        let o = d.object(Some(usage));
        for key in [
            "id",
            "object",
            "created_at",
            "status",
            "model",
            "output",
            "usage",
            "previous_response_id",
            "instructions",
            "error",
            "incomplete_details",
            "metadata",
            "parallel_tool_calls",
            "temperature",
            "top_p",
            "tool_choice",
            "tools",
            "text",
            "store",
        ] {
            assert!(o.get(key).is_some(), "missing {key}");
        }
        assert_eq!(o["id"], "resp_r0_9");
        assert_eq!(o["temperature"], 0.5);
        assert_eq!(o["metadata"], json!({"k": "v"}));
        assert_eq!(o["output"][0]["id"], "msg_r0_9");
        assert_eq!(o["output"][0]["content"][0]["text"], filler_text(3));
        assert_eq!(
            o["usage"],
            json!({"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4},
                   "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": 13})
        );
        let pending = d.object(None);
        assert_eq!(pending["status"], "in_progress");
        assert!(pending["usage"].is_null());
    }

    #[test]
    fn stream_events_are_numbered_in_order() {
        let d = Draft::new("r0", 1, 0, "sim", req(json!({"input": "hi"})));
        let mut seq = 0;
        let mut events = d.opening(&mut seq);
        events.push(d.delta(&mut seq, 1));
        let usage = Usage {
            prompt: 2,
            cached: 0,
            completion: 2,
        };
        events.extend(d.closing(&mut seq, &d.object(Some(usage)), &filler_text(2)));
        let parsed: Vec<Value> = events
            .iter()
            .map(|e| {
                let data = e.lines().nth(1).and_then(|l| l.strip_prefix("data: "));
                serde_json::from_str(data.unwrap()).unwrap()
            })
            .collect();
        let kinds: Vec<&str> = parsed.iter().filter_map(|v| v["type"].as_str()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed"
            ]
        );
        for (i, v) in parsed.iter().enumerate() {
            assert_eq!(v["sequence_number"], i);
        }
        assert_eq!(parsed[9]["response"]["usage"]["output_tokens"], 2);
        assert!(events[0].starts_with("event: response.created\n"));
    }

    #[test]
    fn the_store_is_bounded() {
        let store = Store::new(2, 200, 1000);
        let conv = |s: &str| vec![message("user", s.into())];
        assert!(store.insert("a".into(), &json!({"id": "a"}), conv("1")));
        assert!(store.insert("b".into(), &json!({"id": "b"}), conv("2")));
        assert!(store.conversation("a").is_some()); // a is now the most recent
        assert!(store.insert("c".into(), &json!({"id": "c"}), conv("3")));
        assert!(store.response("b").is_none(), "the least recent goes first");
        assert_eq!(store.size().0, 2);
        assert!(!store.insert("d".into(), &json!({"id": "d"}), conv(&"x".repeat(300))));
        assert!(store.response("d").is_none());
        // The total cap evicts too.
        let small = Store::new(100, 100, 150);
        for id in ["e", "f", "g", "h"] {
            assert!(small.insert(id.into(), &json!({"id": id}), conv("some text here")));
        }
        let (n, bytes) = small.size();
        assert!(bytes <= 150 && n < 4, "{n} entries, {bytes} bytes");
        assert_eq!(small.response("h").as_deref(), Some(&br#"{"id":"h"}"#[..]));
    }
}
