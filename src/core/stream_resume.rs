//! Continuing a streamed answer on another replica, sans-IO: what the client has been sent, the
//! request that continues it, and the continuation's events made to read as the same stream.
//!
//! Exists so that a replica dying (or hanging) mid-stream is not a bare truncation for the
//! client. The relay cuts the engine's bytes at event boundaries ([`SseFramer`]: a client never
//! holds half an event), and a [`StreamLog`] reads each event as it passes — the answer's `id`,
//! `created` and `model`, the generated text, the tokens sent, whether it finished. When the
//! replica fails, [`continuation_body`] asks for the rest: for completions the prompt plus the
//! text so far, for chat the messages plus an assistant message with the text so far and vLLM's
//! `continue_final_message: true, add_generation_prompt: false`; either with the token budget
//! (`max_tokens`, `max_completion_tokens`, `min_tokens`) less what was sent. The continuation's
//! events then pass through [`StreamLog::rewrite`]: the first answer's `id`/`created`/`model`, no
//! second role, usage that adds up. Where no seamless continuation exists (several choices, tool
//! calls, token-id prompts, Anthropic Messages and Responses streams), the stream ends with an
//! error event in the API's own shape ([`error_event`]).
//!
//! Tokens sent are counted as the engine's `usage.completion_tokens` when each chunk carries it
//! (vLLM's `continuous_usage_stats`), else as chunks with text: vLLM sends one a token unless
//! speculative decoding joins several, so the remaining budget is exact or generous.

use std::borrow::Cow;

use memchr::memmem;
use serde::de::{IgnoredAny, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::{Map, Value};

use super::dialect::Api;

/// Largest event the relay holds back while waiting for its end; a longer one (no engine sends
/// one) passes as it comes and makes the stream unresumable.
pub const MAX_EVENT_BYTES: usize = 256 * 1024;

/// Largest generated text kept for a continuation (≈ 250k tokens); past it the stream is
/// unresumable and ends with an error event if its replica fails.
pub const MAX_TEXT_BYTES: usize = 1 << 20;

/// The OpenAI stream's terminator.
pub const DONE: &[u8] = b"data: [DONE]\n\n";

/// Splits a byte stream into whole server-sent events; holds at most one partial event.
#[derive(Debug, Default)]
pub struct SseFramer {
    /// The bytes after the last event boundary seen.
    partial: Vec<u8>,
    /// The held event grew past [`MAX_EVENT_BYTES`]: bytes pass unframed from now on.
    pub overflowed: bool,
}

impl SseFramer {
    /// Where the whole events of `held ++ chunk` end: the offset into `chunk` just past the
    /// last event boundary (`\n\n` or `\r\n\r\n`), or `None` if `chunk` completes none.
    pub fn boundary(&self, chunk: &[u8]) -> Option<usize> {
        // A boundary split between the held bytes and the chunk.
        let tail = &self.partial[self.partial.len().saturating_sub(3)..];
        let mut joined = [0u8; 6];
        let head = chunk.len().min(3);
        joined[..tail.len()].copy_from_slice(tail);
        joined[tail.len()..tail.len() + head].copy_from_slice(&chunk[..head]);
        let last_in_chunk = last_boundary(chunk);
        let across = last_boundary(&joined[..tail.len() + head])
            .filter(|end| *end > tail.len())
            .map(|end| end - tail.len());
        last_in_chunk.max(across)
    }

    /// Takes `chunk` into the held bytes (after the events before its boundary were taken).
    /// Returns false when the held event is now too big to hold.
    pub fn hold(&mut self, rest: &[u8]) -> bool {
        if self.partial.len() + rest.len() > MAX_EVENT_BYTES {
            self.overflowed = true;
            return false;
        }
        self.partial.extend_from_slice(rest);
        true
    }

    /// The held bytes, taken (to prepend to the events a chunk completes).
    pub fn take_held(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.partial)
    }

    /// Whether a partial event is held.
    pub fn holding(&self) -> bool {
        !self.partial.is_empty()
    }

    /// Forgets a partial event (of a replica that failed).
    pub fn clear(&mut self) {
        self.partial.clear();
    }
}

/// The offset just past the last event boundary in `b`.
fn last_boundary(b: &[u8]) -> Option<usize> {
    let lf = memmem::rfind(b, b"\n\n").map(|i| i + 2);
    let crlf = memmem::rfind(b, b"\r\n\r\n").map(|i| i + 4);
    lf.max(crlf)
}

/// Calls `f` with each event's `event:` name (if any) and its joined `data:` payload, for the
/// whole events in `bytes`.
pub fn for_each_event(bytes: &[u8], mut f: impl FnMut(Option<&[u8]>, &[u8])) {
    let mut rest = bytes;
    while !rest.is_empty() {
        let end = memmem::find(rest, b"\n\n")
            .map(|i| (i, i + 2))
            .into_iter()
            .chain(memmem::find(rest, b"\r\n\r\n").map(|i| (i, i + 4)))
            .min_by_key(|(i, _)| *i);
        let (event, next) = match end {
            Some((i, skip)) => (&rest[..i], &rest[skip..]),
            None => (rest, &rest[rest.len()..]),
        };
        let mut name = None;
        let mut data: Option<&[u8]> = None;
        for line in event.split(|b| *b == b'\n') {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if let Some(v) = line.strip_prefix(b"event:") {
                name = Some(v.trim_ascii());
            } else if let Some(v) = line.strip_prefix(b"data:") {
                // Engines send one data line an event; a second one is not joined (rare,
                // and no engine's JSON spans lines), the first is read.
                data.get_or_insert(v.strip_prefix(b" ").unwrap_or(v));
            }
        }
        if name.is_some() || data.is_some() {
            f(name, data.unwrap_or_default());
        }
        rest = next;
    }
}

/// Why a stream cannot be continued seamlessly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unresumable {
    /// Anthropic Messages and Responses streams are not continued (their events carry indexes
    /// and sequence numbers a continuation would have to renumber): they end with an error.
    Api,
    /// Several choices (`n` > 1) or one with an index other than 0.
    Choices,
    /// Tool calls or reasoning in the deltas: their text is not the message's content.
    NotText,
    /// More text than [`MAX_TEXT_BYTES`], or an event over [`MAX_EVENT_BYTES`].
    TooLong,
    /// The request cannot be rewritten: `echo`, structured output, a token-id or batched
    /// prompt, no JSON object.
    Request,
}

impl Unresumable {
    /// Words for logs and the error event.
    pub fn as_str(self) -> &'static str {
        match self {
            Unresumable::Api => "this API's streams are not continued",
            Unresumable::Choices => "the stream has several choices",
            Unresumable::NotText => "the stream carries tool calls or reasoning",
            Unresumable::TooLong => "the stream is too long to continue",
            Unresumable::Request => "the request's fields cannot be continued",
        }
    }
}

/// What the client has been sent of one streamed answer (every leg), read event by event.
#[derive(Clone, Debug)]
pub struct StreamLog {
    api: Api,
    /// The first answer's `id`, `created` and `model`: every continuation event gets them.
    id: Option<String>,
    created: Option<u64>,
    model: Option<String>,
    /// The generated text the client has (`text` or `delta.content`, all legs).
    text: String,
    /// Tokens sent by the legs before the current one.
    before: u64,
    /// Chunks with text in the current leg.
    leg_chunks: u64,
    /// The current leg's engine-reported `completion_tokens`, if it reports them.
    leg_usage: Option<u64>,
    /// Events passed (a Responses stream's next `sequence_number`).
    pub events: u64,
    /// A `finish_reason` went by: the text is complete.
    pub finished: bool,
    /// The stream's end went by (`[DONE]`, `message_stop`, a final `response.*`, an error
    /// event): nothing is missing.
    pub done: bool,
    /// Why a continuation would not be seamless, once known.
    pub unresumable: Option<Unresumable>,
}

impl StreamLog {
    /// A log of an `api` stream.
    pub fn new(api: Api) -> Self {
        let unresumable = match api {
            Api::Completions | Api::Chat => None,
            _ => Some(Unresumable::Api),
        };
        StreamLog {
            api,
            id: None,
            created: None,
            model: None,
            text: String::new(),
            before: 0,
            leg_chunks: 0,
            leg_usage: None,
            events: 0,
            finished: false,
            done: false,
            unresumable,
        }
    }

    /// The generated text so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Tokens the client has been sent.
    pub fn tokens(&self) -> u64 {
        self.before + self.leg_usage.unwrap_or(self.leg_chunks)
    }

    /// Reads the whole events in `bytes`, as sent to the client.
    pub fn observe(&mut self, bytes: &[u8]) {
        for_each_event(bytes, |name, data| self.observe_event(name, data));
    }

    fn observe_event(&mut self, name: Option<&[u8]>, data: &[u8]) {
        self.events += 1;
        match self.api {
            Api::Completions | Api::Chat => self.observe_openai(data),
            _ => {
                let name = name.unwrap_or_default();
                if matches!(
                    name,
                    b"message_stop"
                        | b"error"
                        | b"response.completed"
                        | b"response.incomplete"
                        | b"response.failed"
                ) {
                    self.done = true;
                }
            }
        }
    }

    fn observe_openai(&mut self, data: &[u8]) {
        if data.trim_ascii() == b"[DONE]" {
            self.done = true;
            return;
        }
        let Ok(chunk) = serde_json::from_slice::<Chunk<'_>>(data) else {
            return;
        };
        if chunk.error.is_some() {
            self.done = true;
            return;
        }
        if self.id.is_none() {
            self.id = chunk.id.map(Cow::into_owned);
            self.created = chunk.created;
            self.model = chunk.model.map(Cow::into_owned);
        }
        if let Some(u) = chunk.usage.and_then(|u| u.completion_tokens) {
            self.leg_usage = Some(u);
        }
        let Some(choice) = chunk.choices.first else {
            return;
        };
        if chunk.choices.more || choice.index != 0 {
            self.unresumable = Some(Unresumable::Choices);
        }
        let text = match choice.delta {
            Some(d) => {
                if d.tool_calls.is_some() || d.reasoning_content.is_some() {
                    self.unresumable = Some(Unresumable::NotText);
                }
                d.content
            }
            None => choice.text,
        };
        if let Some(t) = text.filter(|t| !t.is_empty()) {
            self.leg_chunks += 1;
            if self.text.len() + t.len() > MAX_TEXT_BYTES {
                self.unresumable = Some(Unresumable::TooLong);
            } else {
                self.text.push_str(&t);
            }
        }
        if choice.finish_reason.is_some() {
            self.finished = true;
        }
    }

    /// A continuation leg starts: tokens so far are the earlier legs'.
    pub fn next_leg(&mut self) {
        self.before = self.tokens();
        self.leg_chunks = 0;
        self.leg_usage = None;
    }

    /// A continuation's whole events (`bytes`) as the client must see them: the first
    /// answer's `id`, `created` and `model`, no role (the client has it), no empty chunk,
    /// usage counting every leg's tokens; `[DONE]` as is. Logged as sent.
    pub fn rewrite(&mut self, bytes: &[u8], out: &mut Vec<u8>) {
        for_each_event(bytes, |name, data| {
            if data.trim_ascii() == b"[DONE]" {
                self.observe_event(name, data);
                out.extend_from_slice(DONE);
                return;
            }
            let Ok(Value::Object(mut chunk)) = serde_json::from_slice::<Value>(data) else {
                // Not JSON: the client would not have understood it from the first replica
                // either; it is dropped.
                return;
            };
            // Logged as the engine counts (its usage, before the legs' sum is written in).
            self.observe_event(name, data);
            if !self.restyle(&mut chunk) {
                return;
            }
            let Ok(json) = serde_json::to_vec(&chunk) else {
                return;
            };
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(&json);
            out.extend_from_slice(b"\n\n");
        });
    }

    /// Makes one continuation chunk look like the first answer's; false: drop it.
    fn restyle(&self, chunk: &mut Map<String, Value>) -> bool {
        if let Some(id) = &self.id {
            chunk.insert("id".into(), Value::from(id.as_str()));
        }
        if let Some(created) = self.created {
            chunk.insert("created".into(), Value::from(created));
        }
        if let Some(model) = &self.model {
            chunk.insert("model".into(), Value::from(model.as_str()));
        }
        let mut has_usage = false;
        if let Some(Value::Object(u)) = chunk.get_mut("usage") {
            has_usage = true;
            let before = self.before;
            let prompt = u.get("prompt_tokens").and_then(Value::as_u64);
            let completion = u.get("completion_tokens").and_then(Value::as_u64);
            if let (Some(p), Some(c)) = (prompt, completion) {
                // The continuation's prompt holds the text sent so far: those tokens were
                // generated, not prompted. The total stays the last engine's.
                let moved = before.min(p);
                u.insert("prompt_tokens".into(), Value::from(p - moved));
                u.insert("completion_tokens".into(), Value::from(c + moved));
            }
        }
        let Some(Value::Object(choice)) = chunk
            .get_mut("choices")
            .and_then(Value::as_array_mut)
            .and_then(|c| c.first_mut())
        else {
            return true;
        };
        let finish = choice.get("finish_reason").is_some_and(|f| !f.is_null());
        let Some(Value::Object(delta)) = choice.get_mut("delta") else {
            return true;
        };
        delta.remove("role");
        let empty = delta
            .iter()
            .all(|(k, v)| v.is_null() || (k == "content" && v.as_str() == Some("")));
        !(empty && !finish && !has_usage)
    }
}

/// One OpenAI stream chunk, as much as the log reads (strings borrowed when unescaped).
#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
    #[serde(default)]
    created: Option<u64>,
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    choices: FirstChoice<'a>,
    #[serde(default)]
    usage: Option<ChunkUsage>,
    #[serde(default)]
    error: Option<IgnoredAny>,
}

#[derive(Deserialize)]
struct ChunkUsage {
    #[serde(default)]
    completion_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default)]
    index: u32,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    delta: Option<Delta<'a>>,
    #[serde(borrow, default)]
    finish_reason: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(borrow, default)]
    content: Option<Cow<'a, str>>,
    #[serde(default)]
    tool_calls: Option<IgnoredAny>,
    #[serde(default)]
    reasoning_content: Option<IgnoredAny>,
}

/// A chunk's `choices`: the first, and whether more follow (no allocation for the list).
#[derive(Default)]
struct FirstChoice<'a> {
    first: Option<Choice<'a>>,
    more: bool,
}

impl<'de: 'a, 'a> Deserialize<'de> for FirstChoice<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = FirstChoice<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a list of choices")
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(FirstChoice::default())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let first = seq.next_element::<Choice<'a>>()?;
                let mut more = false;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    more = true;
                }
                Ok(FirstChoice { first, more })
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// What continues a stream.
#[derive(Debug, PartialEq)]
pub enum Continuation {
    /// Send this body (the same path) to another replica.
    Body(Vec<u8>),
    /// Nothing is left to generate: end the stream (these events, then the end).
    Finished(Vec<u8>),
}

/// The request that continues `log`'s stream of the request `original` (its body), or why
/// none can.
pub fn continuation_body(original: &[u8], log: &StreamLog) -> Result<Continuation, Unresumable> {
    if let Some(why) = log.unresumable {
        return Err(why);
    }
    if log.finished {
        // The text was complete; only the end (usage, `[DONE]`) was lost.
        return Ok(Continuation::Finished(DONE.to_vec()));
    }
    let Ok(Value::Object(mut body)) = serde_json::from_slice::<Value>(original) else {
        return Err(Unresumable::Request);
    };
    let more_than_one = |k: &str| body.get(k).and_then(Value::as_u64).is_some_and(|n| n > 1);
    if more_than_one("n") || more_than_one("best_of") {
        return Err(Unresumable::Choices);
    }
    if body.get("echo").and_then(Value::as_bool) == Some(true) || constrained(&body) {
        return Err(Unresumable::Request);
    }
    let sent = log.tokens();
    let mut exhausted = false;
    for key in ["max_tokens", "max_completion_tokens"] {
        if let Some(max) = body.get(key).and_then(Value::as_u64) {
            let left = max.saturating_sub(sent);
            exhausted |= left == 0;
            body.insert(key.into(), Value::from(left));
        }
    }
    if let Some(min) = body.get("min_tokens").and_then(Value::as_u64) {
        body.insert("min_tokens".into(), Value::from(min.saturating_sub(sent)));
    }
    if exhausted {
        return Ok(Continuation::Finished(closing_events(log)));
    }
    match log.api {
        Api::Completions => continue_prompt(&mut body, log.text())?,
        Api::Chat => continue_message(&mut body, log.text())?,
        _ => return Err(Unresumable::Api),
    }
    serde_json::to_vec(&body)
        .map(Continuation::Body)
        .map_err(|_| Unresumable::Request)
}

/// Structured output (`response_format` other than text, vLLM's `guided_*` and
/// `structured_outputs`): its grammar would start over in the continuation, mid-document.
fn constrained(body: &Map<String, Value>) -> bool {
    let format = body
        .get("response_format")
        .and_then(|f| f.get("type"))
        .and_then(Value::as_str);
    let guided = [
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
    ]
    .iter()
    .any(|k| body.get(*k).is_some_and(|v| !v.is_null()));
    guided || format.is_some_and(|t| t != "text")
}

/// Completions: the prompt (a string, or a list of one) followed by the text so far.
fn continue_prompt(body: &mut Map<String, Value>, text: &str) -> Result<(), Unresumable> {
    let prompt = match body.get_mut("prompt") {
        Some(Value::String(s)) => s,
        Some(Value::Array(items)) if items.len() == 1 => match &mut items[0] {
            Value::String(s) => s,
            _ => return Err(Unresumable::Request),
        },
        _ => return Err(Unresumable::Request),
    };
    prompt.push_str(text);
    Ok(())
}

/// Chat: the messages with the text so far as the assistant's message, left open
/// (`continue_final_message`); a client's own open assistant message gets the text appended.
fn continue_message(body: &mut Map<String, Value>, text: &str) -> Result<(), Unresumable> {
    let continuing = body.get("continue_final_message").and_then(Value::as_bool) == Some(true);
    let Some(Value::Array(messages)) = body.get_mut("messages") else {
        return Err(Unresumable::Request);
    };
    let open = match messages.last_mut() {
        Some(Value::Object(m))
            if continuing && m.get("role").and_then(Value::as_str) == Some("assistant") =>
        {
            Some(m)
        }
        _ => None,
    };
    match open {
        Some(m) => match m.get_mut("content") {
            Some(Value::String(s)) => s.push_str(text),
            Some(Value::Array(parts)) => {
                parts.push(serde_json::json!({"type": "text", "text": text}));
            }
            _ => {
                m.insert("content".into(), Value::from(text));
            }
        },
        None => messages.push(serde_json::json!({"role": "assistant", "content": text})),
    }
    body.insert("continue_final_message".into(), Value::Bool(true));
    body.insert("add_generation_prompt".into(), Value::Bool(false));
    Ok(())
}

/// The end of a stream whose token budget was spent when its replica failed: a chunk with
/// `finish_reason: "length"`, then `[DONE]`.
fn closing_events(log: &StreamLog) -> Vec<u8> {
    let (object, choice) = match log.api {
        Api::Chat => (
            "chat.completion.chunk",
            serde_json::json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": "length"}),
        ),
        _ => (
            "text_completion",
            serde_json::json!({"index": 0, "text": "", "logprobs": null, "finish_reason": "length"}),
        ),
    };
    let chunk = serde_json::json!({
        "id": log.id, "object": object, "created": log.created, "model": log.model,
        "choices": [choice],
    });
    let mut out = format!("data: {chunk}\n\n").into_bytes();
    out.extend_from_slice(DONE);
    out
}

/// The event that ends a stream no replica could finish, in `api`'s shape: OpenAI's `error`
/// chunk then `[DONE]` (as vLLM ends a failed stream), Anthropic's `event: error`, the
/// Responses API's `event: error` numbered after the `events` already sent.
pub fn error_event(api: Api, message: &str, events: u64) -> Vec<u8> {
    match api {
        Api::Messages | Api::CountTokens => {
            let data = serde_json::json!({
                "type": "error",
                "error": {"type": "api_error", "message": message},
            });
            format!("event: error\ndata: {data}\n\n").into_bytes()
        }
        Api::Responses => {
            let data = serde_json::json!({
                "type": "error", "code": "server_error", "message": message,
                "param": null, "sequence_number": events,
            });
            format!("event: error\ndata: {data}\n\n").into_bytes()
        }
        _ => {
            let data = serde_json::json!({"error": {
                "message": message, "type": "server_error", "param": null, "code": 502,
            }});
            let mut out = format!("data: {data}\n\n").into_bytes();
            out.extend_from_slice(DONE);
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat_chunk(id: &str, role: bool, content: &str, finish: Option<&str>) -> String {
        let delta = if role {
            json!({"role": "assistant", "content": content})
        } else {
            json!({"content": content})
        };
        let c = json!({"id": id, "object": "chat.completion.chunk", "created": 7, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
        format!("data: {c}\n\n")
    }

    #[test]
    fn the_framer_finds_boundaries_across_chunks() {
        let mut f = SseFramer::default();
        assert_eq!(f.boundary(b"data: {}\n"), None);
        assert!(f.hold(b"data: {}\n"));
        assert_eq!(f.boundary(b"\ndata: {"), Some(1), "split \\n|\\n");
        let mut f = SseFramer::default();
        assert_eq!(f.boundary(b"data: a\n\ndata: b\n\ndata"), Some(18));
        assert!(f.hold(b"data: x\r\n"));
        assert_eq!(f.boundary(b"\r\nmore"), Some(2), "split \\r\\n|\\r\\n");
        assert!(!f.hold(&vec![b'x'; MAX_EVENT_BYTES]));
        assert!(f.overflowed);
    }

    #[test]
    fn a_chat_stream_continues_as_one_message() {
        let mut log = StreamLog::new(Api::Chat);
        let first = chat_chunk("a", true, "Hello", None) + &chat_chunk("a", false, " wor", None);
        log.observe(first.as_bytes());
        assert_eq!((log.text(), log.tokens()), ("Hello wor", 2));
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 10, "stream": true});
        let Ok(Continuation::Body(next)) = continuation_body(body.to_string().as_bytes(), &log)
        else {
            panic!("not continued")
        };
        let next: Value = serde_json::from_slice(&next).unwrap();
        assert_eq!(next["max_tokens"], 8);
        assert_eq!(next["continue_final_message"], true);
        assert_eq!(next["add_generation_prompt"], false);
        assert_eq!(
            next["messages"][1],
            json!({"role": "assistant", "content": "Hello wor"})
        );
        log.next_leg();
        let second = chat_chunk("b", true, "ld", None)
            + &chat_chunk("b", false, "", Some("length"))
            + "data: {\"id\":\"b\",\"choices\":[],\"usage\":{\"prompt_tokens\":20,\"completion_tokens\":2,\"total_tokens\":22}}\n\n"
            + "data: [DONE]\n\n";
        let mut out = Vec::new();
        log.rewrite(second.as_bytes(), &mut out);
        let out = String::from_utf8(out).unwrap();
        assert!(!out.contains("\"role\""), "no second role: {out}");
        assert!(!out.contains("\"b\""), "the first id: {out}");
        assert!(out.contains("\"prompt_tokens\":18") && out.contains("\"completion_tokens\":4"));
        assert!(out.ends_with("data: [DONE]\n\n"));
        assert_eq!(log.text(), "Hello world");
        assert!(log.done && log.finished);
    }

    #[test]
    fn completions_continue_the_prompt_and_a_spent_budget_just_ends() {
        let mut log = StreamLog::new(Api::Completions);
        let c = json!({"id": "c", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": " ab", "finish_reason": null}]});
        log.observe(format!("data: {c}\n\n").as_bytes());
        let body = json!({"model": "m", "prompt": ["Say"], "max_tokens": 3, "min_tokens": 2});
        let Ok(Continuation::Body(next)) = continuation_body(body.to_string().as_bytes(), &log)
        else {
            panic!("not continued")
        };
        let next: Value = serde_json::from_slice(&next).unwrap();
        assert_eq!(next["prompt"], json!(["Say ab"]));
        assert_eq!(
            (next["max_tokens"].as_u64(), next["min_tokens"].as_u64()),
            (Some(2), Some(1))
        );
        let spent = json!({"model": "m", "prompt": "Say", "max_tokens": 1});
        let Ok(Continuation::Finished(end)) = continuation_body(spent.to_string().as_bytes(), &log)
        else {
            panic!("a spent budget is finished")
        };
        assert!(String::from_utf8(end)
            .unwrap()
            .contains("\"finish_reason\":\"length\""));
    }

    #[test]
    fn what_cannot_continue_says_why_and_errors_keep_each_apis_shape() {
        let mut log = StreamLog::new(Api::Chat);
        let c = json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]});
        log.observe(format!("data: {c}\n\n").as_bytes());
        assert_eq!(log.unresumable, Some(Unresumable::NotText));
        let log = StreamLog::new(Api::Completions);
        let ids = json!({"model": "m", "prompt": [1, 2, 3]});
        assert_eq!(
            continuation_body(ids.to_string().as_bytes(), &log),
            Err(Unresumable::Request)
        );
        let json_mode =
            json!({"model": "m", "prompt": "x", "response_format": {"type": "json_object"}});
        assert_eq!(
            continuation_body(json_mode.to_string().as_bytes(), &log),
            Err(Unresumable::Request)
        );
        let n = json!({"model": "m", "prompt": "x", "n": 2});
        assert_eq!(
            continuation_body(n.to_string().as_bytes(), &log),
            Err(Unresumable::Choices)
        );
        let mut msgs = StreamLog::new(Api::Messages);
        msgs.observe(b"event: message_start\ndata: {}\n\n");
        assert_eq!(msgs.unresumable, Some(Unresumable::Api));
        let e = String::from_utf8(error_event(Api::Messages, "gone", msgs.events)).unwrap();
        assert!(e.starts_with("event: error\ndata: {") && e.contains("api_error"));
        let e = String::from_utf8(error_event(Api::Responses, "gone", 5)).unwrap();
        assert!(e.contains("\"sequence_number\":5"));
        let e = String::from_utf8(error_event(Api::Chat, "gone", 0)).unwrap();
        assert!(e.contains("\"error\"") && e.ends_with("data: [DONE]\n\n"));
    }
}
