//! Routing text: the canonical rendering of an OpenAI request that block keys are computed over.
//!
//! The rendering must cover the *whole* prompt the engine will see — every chat message, every
//! text part, tool calls and tool results, and the tool definitions — because the engine's cache
//! holds the whole templated prompt. Routing on the first or last message only (a bug seen in
//! other routers) makes unrelated conversations collide and related ones miss.
//!
//! Only the fields routing needs are parsed; unknown fields are ignored, so the proxy can forward
//! the original body unchanged.

use serde::Deserialize;
use serde_json::value::RawValue;

pub use super::prompt_de::{Content, ContentPart, Prompt};

/// Separates chat messages in the routing text (ASCII record separator).
const RECORD_SEPARATOR: char = '\u{1e}';
/// Separates the parts inside one message (ASCII unit separator).
const UNIT_SEPARATOR: char = '\u{1f}';

/// The routing fields of a `/v1/completions` or `/v1/chat/completions` body.
#[derive(Debug, Deserialize)]
pub struct RoutingFields {
    /// Model name; with vLLM a LoRA adapter is served under its own model name.
    #[serde(default)]
    pub model: Option<String>,
    /// Completions prompt.
    #[serde(default)]
    pub prompt: Option<Prompt>,
    /// Chat messages (at most [`MAX_MESSAGES`]).
    #[serde(default, deserialize_with = "super::prompt_de::capped_list")]
    pub messages: Option<Vec<ChatMessage>>,
    /// Tool definitions; rendered into the prompt by every chat template that supports tools.
    #[serde(default)]
    pub tools: Option<Box<RawValue>>,
    /// vLLM's per-request cache salt: a different salt never shares cache entries.
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// SGLang's LoRA selector.
    #[serde(default)]
    pub lora_path: Option<String>,
    /// End-user id; may name a session when configured so.
    #[serde(default)]
    pub user: Option<String>,
    /// Whether the client wants server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Output budget, used to predict decode work.
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// Newer name of the output budget on chat.
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
}

/// One chat message; every field the chat template may render.
#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    /// system, user, assistant, tool, developer...
    #[serde(default)]
    pub role: String,
    /// Text or a list of parts.
    #[serde(default)]
    pub content: Option<Content>,
    /// Participant name.
    #[serde(default)]
    pub name: Option<String>,
    /// Assistant tool calls.
    #[serde(default)]
    pub tool_calls: Option<Box<RawValue>>,
    /// The call a tool result answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// Reasoning text some engines keep in the context.
    #[serde(default)]
    pub reasoning_content: Option<String>,
}

/// Why a body cannot be routed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PromptError {
    /// Neither `prompt` nor `messages` is present.
    #[error("the request has neither 'prompt' nor 'messages'")]
    Missing,
    /// An Anthropic Messages body without `messages`.
    #[error("the request has no 'messages'")]
    MissingMessages,
    /// A Responses body without `input`.
    #[error("the request has no 'input'")]
    MissingInput,
}

impl RoutingFields {
    /// Parses the routing fields of a JSON body.
    pub fn parse(body: &[u8]) -> Result<Self, serde_json::Error> {
        super::prompt_de::within_element_budget(|| serde_json::from_slice(body))
    }

    /// Renders the routing text into `out` (cleared first, so one buffer serves many requests).
    pub fn render(&self, out: &mut String) -> Result<(), PromptError> {
        out.clear();
        if let Some(messages) = &self.messages {
            if let Some(tools) = &self.tools {
                push_tools(tools, out);
            }
            for m in messages {
                render_message(m, out);
                end_message(out);
            }
            return Ok(());
        }
        match &self.prompt {
            Some(Prompt::Text(t)) => out.push_str(t),
            Some(Prompt::Texts(ts)) => join(ts.iter().map(String::as_str), out),
            Some(Prompt::Tokens(ts)) => push_tokens(ts, out),
            Some(Prompt::TokenLists(lists)) => {
                for (i, ts) in lists.iter().enumerate() {
                    if i > 0 {
                        out.push(RECORD_SEPARATOR);
                    }
                    push_tokens(ts, out);
                }
            }
            None => return Err(PromptError::Missing),
        }
        Ok(())
    }

    /// The output budget the client asked for, if any.
    pub fn output_budget(&self) -> Option<u64> {
        self.max_completion_tokens.or(self.max_tokens)
    }
}

/// Starts one message of the routing text: its role, and its participant name if any. Every
/// dialect renders a message this way, so one conversation keys alike whichever API carries it.
pub(crate) fn begin_message(role: &str, name: Option<&str>, out: &mut String) {
    out.push_str(role);
    if let Some(name) = name {
        out.push(UNIT_SEPARATOR);
        out.push_str(name);
    }
    out.push('\n');
}

/// Separates two parts of one message.
pub(crate) fn next_part(out: &mut String) {
    out.push(UNIT_SEPARATOR);
}

/// Ends one message.
pub(crate) fn end_message(out: &mut String) {
    out.push(RECORD_SEPARATOR);
}

/// The tool definitions, rendered before the first message (as chat templates do).
pub(crate) fn push_tools(tools: &RawValue, out: &mut String) {
    out.push_str("tools\n");
    out.push_str(tools.get());
    out.push(RECORD_SEPARATOR);
}

fn render_message(m: &ChatMessage, out: &mut String) {
    begin_message(&m.role, m.name.as_deref(), out);
    match &m.content {
        Some(Content::Text(t)) => out.push_str(t),
        Some(Content::Parts(parts)) => {
            for (i, p) in parts.iter().enumerate() {
                if i > 0 {
                    out.push(UNIT_SEPARATOR);
                }
                if let Some(t) = &p.text {
                    out.push_str(t);
                } else {
                    out.push_str(&p.kind);
                    for value in [&p.image_url, &p.input_audio].into_iter().flatten() {
                        out.push_str(value.get());
                    }
                }
            }
        }
        None => {}
    }
    if let Some(r) = &m.reasoning_content {
        out.push(UNIT_SEPARATOR);
        out.push_str(r);
    }
    if let Some(calls) = &m.tool_calls {
        out.push(UNIT_SEPARATOR);
        out.push_str(calls.get());
    }
    if let Some(id) = &m.tool_call_id {
        out.push(UNIT_SEPARATOR);
        out.push_str(id);
    }
}

fn join<'a>(parts: impl Iterator<Item = &'a str>, out: &mut String) {
    for (i, p) in parts.enumerate() {
        if i > 0 {
            out.push(RECORD_SEPARATOR);
        }
        out.push_str(p);
    }
}

/// Token ids render as decimal text; stable and cheap enough for the rare token-id prompt.
fn push_tokens(tokens: &[u32], out: &mut String) {
    use std::fmt::Write;
    for t in tokens {
        // Writing into a String cannot fail.
        let _ = write!(out, "{t} ");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(body: &str) -> Result<String, PromptError> {
        let f = RoutingFields::parse(body.as_bytes()).unwrap();
        let mut s = String::new();
        f.render(&mut s).map(|_| s)
    }

    #[test]
    fn completions_prompt_shapes() {
        assert_eq!(render(r#"{"prompt":"hello"}"#).unwrap(), "hello");
        assert_eq!(render(r#"{"prompt":["a","b"]}"#).unwrap(), "a\u{1e}b");
        assert_eq!(render(r#"{"prompt":[1,2,3]}"#).unwrap(), "1 2 3 ");
        assert_eq!(render(r#"{"prompt":[[1],[2]]}"#).unwrap(), "1 \u{1e}2 ");
        assert_eq!(render(r#"{"model":"m"}"#), Err(PromptError::Missing));
    }

    #[test]
    fn chat_renders_every_message_and_part() {
        let body = r#"{"model":"m","tools":[{"type":"function","function":{"name":"f"}}],"messages":[
            {"role":"system","content":"sys"},
            {"role":"user","content":[{"type":"text","text":"look"},{"type":"image_url","image_url":{"url":"u1"}}]},
            {"role":"assistant","content":null,"tool_calls":[{"id":"c1","function":{"name":"f","arguments":"{}"}}]},
            {"role":"tool","tool_call_id":"c1","content":"result"},
            {"role":"user","content":"last"}]}"#;
        let text = render(body).unwrap();
        for needle in [
            "sys",
            "look",
            "u1",
            "\"arguments\"",
            "c1",
            "result",
            "last",
            "\"name\":\"f\"",
        ] {
            assert!(text.contains(needle), "{needle} missing from {text:?}");
        }
        // Order is kept: the system prompt comes first so conversations share a prefix.
        assert!(text.starts_with("tools\n"));
        assert!(text.find("sys").unwrap() < text.find("last").unwrap());
    }

    #[test]
    fn different_images_differ() {
        let a = render(
            r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"a"}}]}]}"#,
        );
        let b = render(
            r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"b"}}]}]}"#,
        );
        assert_ne!(a.unwrap(), b.unwrap());
    }

    #[test]
    fn unknown_fields_are_ignored_and_budget_is_read() {
        let f = RoutingFields::parse(
            br#"{"prompt":"x","max_tokens":5,"vllm_xargs":{"a":1},"priority":3}"#,
        )
        .unwrap();
        assert_eq!(f.output_budget(), Some(5));
    }
}
