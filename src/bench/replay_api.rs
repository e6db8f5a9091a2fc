//! The APIs `kvmesh bench --api` replays a workload through, and how each one's stream is read.
//!
//! Every API gets the same prompt text as one user message (completions: as the prompt), asks
//! for the workload's output tokens and streams. A stream is read event by event into a
//! [`StreamTally`]: which events carry generated text (the first one is the TTFT), which carry
//! usage (output tokens, prompt tokens, cached prompt tokens, in that API's fields) and which end
//! the stream. Completions and chat send bare `data:` chunks ended by `[DONE]`; Anthropic's
//! Messages and OpenAI's Responses send typed events, read through a table of event kinds
//! ([`MESSAGES_EVENTS`], [`RESPONSES_EVENTS`]), and end with their own last event.

use std::borrow::Cow;
use std::fmt;

use serde_json::{json, Value};

/// Which API the replay speaks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Api {
    /// OpenAI completions, `POST /v1/completions` with `prompt`.
    #[default]
    Completions,
    /// OpenAI chat, `POST /v1/chat/completions`.
    Chat,
    /// Anthropic Messages, `POST /v1/messages`.
    Messages,
    /// OpenAI Responses, `POST /v1/responses`.
    Responses,
}

impl fmt::Display for Api {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Anthropic's API refuses requests without a version; this one is its stable Messages API.
const ANTHROPIC_VERSION: (&str, &str) = ("anthropic-version", "2023-06-01");

impl Api {
    /// The `--api` spelling.
    pub fn name(self) -> &'static str {
        match self {
            Api::Completions => "completions",
            Api::Chat => "chat",
            Api::Messages => "messages",
            Api::Responses => "responses",
        }
    }

    /// The path requests go to, under a base URL.
    pub fn path(self) -> &'static str {
        match self {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
            Api::Messages => "/v1/messages",
            Api::Responses => "/v1/responses",
        }
    }

    /// Headers the API needs beyond JSON's content type.
    pub fn headers(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Api::Messages => &[ANTHROPIC_VERSION],
            _ => &[],
        }
    }

    /// The streaming request body for `prompt`, generating `max_tokens`.
    pub fn body(self, model: &str, prompt: String, max_tokens: u32) -> Value {
        let user = || json!([{"role": "user", "content": prompt}]);
        match self {
            // `ignore_eos` (vLLM / SGLang): generate exactly max_tokens, as the workload says;
            // `include_usage`: the usage chunk that carries the cached tokens.
            Api::Completions => json!({
                "model": model, "prompt": prompt, "max_tokens": max_tokens,
                "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true},
            }),
            Api::Chat => json!({
                "model": model, "messages": user(), "max_tokens": max_tokens,
                "stream": true, "stream_options": {"include_usage": true}, "ignore_eos": true,
            }),
            Api::Messages => json!({
                "model": model, "max_tokens": max_tokens, "messages": user(), "stream": true,
            }),
            Api::Responses => json!({
                "model": model, "input": prompt, "max_output_tokens": max_tokens, "stream": true,
            }),
        }
    }

    /// The event a complete stream ends with (for the error when it does not).
    pub fn last_event(self) -> &'static str {
        match self {
            Api::Completions | Api::Chat => "[DONE]",
            Api::Messages => "message_stop",
            Api::Responses => "response.completed",
        }
    }

    /// Reads one SSE event (`event:` name, joined `data:`) into `tally`; an error event or a
    /// malformed one is an error.
    pub fn read_event(
        self,
        event: Option<&str>,
        data: &[u8],
        tally: &mut StreamTally,
    ) -> Result<(), String> {
        match self {
            Api::Completions | Api::Chat => read_openai_chunk(data, tally),
            Api::Messages => read_typed(MESSAGES_EVENTS, anthropic_usage, event, data, tally),
            Api::Responses => read_typed(RESPONSES_EVENTS, responses_usage, event, data, tally),
        }
    }
}

/// What a stream said so far.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StreamTally {
    /// Events that carried generated text.
    pub text_events: u64,
    /// Output tokens, from the usage.
    pub output_tokens: Option<u64>,
    /// Prompt tokens, from the usage (cached ones included).
    pub prompt_tokens: Option<u64>,
    /// Prompt tokens served from the prefix cache, from the usage.
    pub cached_tokens: Option<u64>,
    /// The API's last event arrived.
    pub ended: bool,
}

/// What a typed event means to the replay; unlisted kinds (pings, block starts and stops,
/// `response.created`, ...) mean nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Meaning {
    /// Carries generated text.
    Text,
    /// Carries usage at this JSON pointer.
    Usage(&'static str),
    /// Ends the stream, with usage at this JSON pointer when the event has one.
    End(&'static str),
    /// A failure, described at this JSON pointer.
    Error(&'static str),
}

/// Anthropic Messages: the prompt's usage comes first, the output's at the end.
pub const MESSAGES_EVENTS: &[(&str, Meaning)] = &[
    ("message_start", Meaning::Usage("/message/usage")),
    ("content_block_delta", Meaning::Text),
    ("message_delta", Meaning::Usage("/usage")),
    ("message_stop", Meaning::End("/usage")),
    ("error", Meaning::Error("/error")),
];

/// OpenAI Responses: usage only in the final response object. `response.incomplete` ends a
/// response cut by `max_output_tokens`, which is how a workload's fixed output ends.
pub const RESPONSES_EVENTS: &[(&str, Meaning)] = &[
    ("response.output_text.delta", Meaning::Text),
    ("response.completed", Meaning::End("/response/usage")),
    ("response.incomplete", Meaning::End("/response/usage")),
    ("response.failed", Meaning::Error("/response/error")),
    ("error", Meaning::Error("")),
];

fn parse_json(data: &[u8]) -> Result<Value, String> {
    serde_json::from_slice(data).map_err(|e| format!("malformed stream event: {e}"))
}

/// One completions / chat chunk: `[DONE]`, an error, choices (text), usage.
fn read_openai_chunk(data: &[u8], tally: &mut StreamTally) -> Result<(), String> {
    if data == b"[DONE]" {
        tally.ended = true;
        return Ok(());
    }
    let v = parse_json(data)?;
    if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
        return Err(format!("error in stream: {err}"));
    }
    if v.get("choices")
        .and_then(Value::as_array)
        .is_some_and(|c| !c.is_empty())
    {
        tally.text_events += 1;
    }
    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
        let n = |k: &str| u.get(k).and_then(Value::as_u64);
        tally.output_tokens = n("completion_tokens").or(tally.output_tokens);
        tally.prompt_tokens = n("prompt_tokens").or(tally.prompt_tokens);
        let cached = u.pointer("/prompt_tokens_details/cached_tokens");
        tally.cached_tokens = cached.and_then(Value::as_u64).or(tally.cached_tokens);
    }
    Ok(())
}

/// One typed event, its kind from the data's `type` (else the `event:` line) looked up in
/// `table`; `usage` reads the API's usage object.
fn read_typed(
    table: &[(&str, Meaning)],
    usage: fn(&Value, &mut StreamTally),
    event: Option<&str>,
    data: &[u8],
    tally: &mut StreamTally,
) -> Result<(), String> {
    let v = parse_json(data)?;
    let kind = v
        .get("type")
        .and_then(Value::as_str)
        .or(event)
        .unwrap_or("");
    let Some(&(_, meaning)) = table.iter().find(|(k, _)| *k == kind) else {
        return Ok(());
    };
    match meaning {
        Meaning::Text => tally.text_events += 1,
        Meaning::Usage(at) => {
            if let Some(u) = v.pointer(at) {
                usage(u, tally);
            }
        }
        Meaning::End(at) => {
            if let Some(u) = v.pointer(at) {
                usage(u, tally);
            }
            tally.ended = true;
        }
        Meaning::Error(at) => {
            let what = v.pointer(at).unwrap_or(&v);
            return Err(format!("error in stream ({kind}): {what}"));
        }
    }
    Ok(())
}

/// Anthropic's usage: `input_tokens` excludes the cache, so the prompt is input + cache reads +
/// cache writes. `message_delta` may repeat fields or send only `output_tokens`.
fn anthropic_usage(u: &Value, tally: &mut StreamTally) {
    let n = |k: &str| u.get(k).and_then(Value::as_u64);
    if let Some(input) = n("input_tokens") {
        let cached = n("cache_read_input_tokens").unwrap_or(0);
        let written = n("cache_creation_input_tokens").unwrap_or(0);
        tally.prompt_tokens = Some(input + cached + written);
    }
    tally.cached_tokens = n("cache_read_input_tokens").or(tally.cached_tokens);
    tally.output_tokens = n("output_tokens").or(tally.output_tokens);
}

/// The Responses usage: `input_tokens` includes the cached ones.
fn responses_usage(u: &Value, tally: &mut StreamTally) {
    let n = |k: &str| u.get(k).and_then(Value::as_u64);
    tally.prompt_tokens = n("input_tokens").or(tally.prompt_tokens);
    tally.output_tokens = n("output_tokens").or(tally.output_tokens);
    let cached = u.pointer("/input_tokens_details/cached_tokens");
    tally.cached_tokens = cached.and_then(Value::as_u64).or(tally.cached_tokens);
}

/// One SSE event's `event:` name and data (`data:` lines joined by `\n`, as the SSE spec
/// says); `None` when it has no data (a comment, a keep-alive).
pub fn split_event(raw: &[u8]) -> Option<(Option<&str>, Cow<'_, [u8]>)> {
    let mut name = None;
    let mut data: Option<Cow<'_, [u8]>> = None;
    for line in raw.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(v) = line.strip_prefix(b"event:") {
            let v = v.strip_prefix(b" ").unwrap_or(v);
            name = std::str::from_utf8(v).ok();
        } else if let Some(v) = line.strip_prefix(b"data:") {
            let v = v.strip_prefix(b" ").unwrap_or(v);
            data = Some(match data {
                None => Cow::Borrowed(v),
                Some(prev) => {
                    let mut joined = prev.into_owned();
                    joined.push(b'\n');
                    joined.extend_from_slice(v);
                    Cow::Owned(joined)
                }
            });
        }
    }
    data.map(|d| (name, d))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Splits a recorded stream into events and reads them all; returns the tally and the index
    /// of the first text event.
    fn replay(api: Api, stream: &str) -> Result<(StreamTally, Option<usize>), String> {
        let mut tally = StreamTally::default();
        let mut first = None;
        for (i, raw) in stream.split("\n\n").enumerate() {
            let Some((name, data)) = split_event(raw.as_bytes()) else {
                continue;
            };
            api.read_event(name, &data, &mut tally)?;
            if first.is_none() && tally.text_events > 0 {
                first = Some(i);
            }
        }
        Ok((tally, first))
    }

    #[test]
    fn completions_and_chat_streams_end_at_done_with_usage() {
        let completions = "data: {\"id\":\"c\",\"choices\":[{\"text\":\"a\",\"index\":0}]}\n\n\
            data: {\"id\":\"c\",\"choices\":[{\"text\":\"b\",\"index\":0}]}\n\n\
            data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":100,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":64}}}\n\n\
            data: [DONE]\n\n";
        let (t, first) = replay(Api::Completions, completions).unwrap();
        assert_eq!(first, Some(0));
        let want = StreamTally {
            text_events: 2,
            output_tokens: Some(2),
            prompt_tokens: Some(100),
            cached_tokens: Some(64),
            ended: true,
        };
        assert_eq!(t, want);
        // vLLM's chat stream: a role chunk, content, usage with null details, [DONE].
        let chat = ": keep-alive\n\n\
            data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}],\"usage\":null}\n\n\
            data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n\
            data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":1,\"prompt_tokens_details\":null}}\n\n\
            data: [DONE]\n\n";
        let (t, first) = replay(Api::Chat, chat).unwrap();
        assert_eq!(first, Some(1), "the comment is no event");
        assert_eq!(
            (t.output_tokens, t.prompt_tokens, t.cached_tokens),
            (Some(1), Some(7), None)
        );
        assert!(t.ended);
        let e = replay(Api::Chat, "data: {\"error\":{\"message\":\"boom\"}}\n\n").unwrap_err();
        assert!(e.contains("boom"), "{e}");
        assert!(replay(Api::Chat, "data: {nope\n\n")
            .unwrap_err()
            .contains("malformed"));
        let cut = replay(
            Api::Completions,
            "data: {\"choices\":[{\"text\":\"a\"}]}\n\n",
        )
        .unwrap();
        assert!(!cut.0.ended, "no [DONE]: not ended");
    }

    #[test]
    fn anthropic_messages_stream_reads_usage_from_start_and_delta() {
        let stream = "event: message_start\n\
            data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"m\",\"usage\":{\"input_tokens\":36,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":64,\"output_tokens\":1}}}\n\n\
            event: content_block_start\n\
            data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n\
            event: ping\n\
            data: {\"type\": \"ping\"}\n\n\
            event: content_block_delta\n\
            data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\n\n\
            event: content_block_delta\n\
            data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"!\"}}\n\n\
            event: content_block_stop\n\
            data: {\"type\":\"content_block_stop\",\"index\":0}\n\n\
            event: message_delta\n\
            data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":2}}\n\n\
            event: message_stop\n\
            data: {\"type\":\"message_stop\"}\n\n";
        let (t, first) = replay(Api::Messages, stream).unwrap();
        assert_eq!(first, Some(3), "TTFT at the first content_block_delta");
        let want = StreamTally {
            text_events: 2,
            output_tokens: Some(2),
            prompt_tokens: Some(100),
            cached_tokens: Some(64),
            ended: true,
        };
        assert_eq!(t, want);
        let overloaded = "event: error\n\
            data: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n";
        let e = replay(Api::Messages, overloaded).unwrap_err();
        assert!(e.contains("overloaded_error"), "{e}");
    }

    #[test]
    fn responses_stream_ends_at_completed_with_usage() {
        let stream = "event: response.created\n\
            data: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_1\",\"status\":\"in_progress\",\"usage\":null}}\n\n\
            event: response.in_progress\n\
            data: {\"type\":\"response.in_progress\",\"sequence_number\":1,\"response\":{\"id\":\"resp_1\",\"status\":\"in_progress\"}}\n\n\
            event: response.output_item.added\n\
            data: {\"type\":\"response.output_item.added\",\"sequence_number\":2,\"output_index\":0,\"item\":{\"type\":\"message\",\"id\":\"msg_1\",\"role\":\"assistant\",\"content\":[]}}\n\n\
            event: response.output_text.delta\n\
            data: {\"type\":\"response.output_text.delta\",\"sequence_number\":3,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":\"Hi\"}\n\n\
            event: response.output_text.done\n\
            data: {\"type\":\"response.output_text.done\",\"sequence_number\":4,\"text\":\"Hi\"}\n\n\
            event: response.completed\n\
            data: {\"type\":\"response.completed\",\"sequence_number\":5,\"response\":{\"id\":\"resp_1\",\"status\":\"completed\",\"usage\":{\"input_tokens\":300,\"input_tokens_details\":{\"cached_tokens\":256},\"output_tokens\":1,\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":301}}}\n\n";
        let (t, first) = replay(Api::Responses, stream).unwrap();
        assert_eq!(first, Some(3));
        let want = StreamTally {
            text_events: 1,
            output_tokens: Some(1),
            prompt_tokens: Some(300),
            cached_tokens: Some(256),
            ended: true,
        };
        assert_eq!(t, want);
        let incomplete = "data: {\"type\":\"response.incomplete\",\"response\":{\"usage\":{\"input_tokens\":3,\"output_tokens\":9}}}\n\n";
        let (t, _) = replay(Api::Responses, incomplete).unwrap();
        assert!(
            t.ended && t.output_tokens == Some(9),
            "cut by max_output_tokens"
        );
        let failed = "event: response.failed\n\
            data: {\"type\":\"response.failed\",\"response\":{\"status\":\"failed\",\"error\":{\"code\":\"server_error\",\"message\":\"x\"}}}\n\n";
        assert!(replay(Api::Responses, failed)
            .unwrap_err()
            .contains("server_error"));
        let error = "event: error\ndata: {\"type\":\"error\",\"code\":\"rate_limit\",\"message\":\"slow down\"}\n\n";
        assert!(replay(Api::Responses, error)
            .unwrap_err()
            .contains("slow down"));
    }

    #[test]
    fn bodies_frame_the_prompt_as_one_user_message() {
        let p = || "the prompt".to_owned();
        let c = Api::Completions.body("m", p(), 8);
        assert_eq!(
            (c["prompt"].as_str(), c["max_tokens"].as_u64()),
            (Some("the prompt"), Some(8))
        );
        let chat = Api::Chat.body("m", p(), 8);
        assert_eq!(
            chat["messages"],
            json!([{"role": "user", "content": "the prompt"}])
        );
        assert_eq!(chat["stream_options"]["include_usage"], true);
        let m = Api::Messages.body("m", p(), 8);
        assert_eq!(m["messages"][0]["content"], "the prompt");
        assert_eq!(
            (m["max_tokens"].as_u64(), m["stream"].as_bool()),
            (Some(8), Some(true))
        );
        assert_eq!(
            Api::Messages.headers(),
            &[("anthropic-version", "2023-06-01")]
        );
        let r = Api::Responses.body("m", p(), 8);
        assert_eq!(
            (r["input"].as_str(), r["max_output_tokens"].as_u64()),
            (Some("the prompt"), Some(8))
        );
        assert_eq!(Api::Responses.path(), "/v1/responses");
    }

    #[test]
    fn sse_events_join_data_lines_and_skip_comments() {
        let (name, data) = split_event(b"event: x\r\ndata: a\r\ndata: b").unwrap();
        assert_eq!((name, &*data), (Some("x"), &b"a\nb"[..]));
        assert!(split_event(b": ping").is_none());
        let (name, data) = split_event(b"data:[DONE]").unwrap();
        assert_eq!((name, &*data), (None, &b"[DONE]"[..]));
    }
}
