//! The APIs a client may speak, and what routing reads from each: model, routing text, output
//! budget, streaming, session and affinity hints.
//!
//! Exists so that one conversation keys alike whichever API carries it: a system prompt and the
//! same text turns sent as OpenAI chat, Anthropic Messages or OpenAI Responses render the same
//! routing text ([`super::prompt`]'s message layout), hence the same block keys, so a client that
//! moves between APIs keeps its cache. Parsing reads only these fields; the body is forwarded
//! unchanged. Every list a client controls is capped ([`super::prompt_de`]).

use serde::Deserialize;
use serde_json::value::RawValue;

use super::prompt::{
    begin_message, end_message, next_part, push_tools, PromptError, RoutingFields,
};
use super::prompt_de::{capped_list, raw_items};

/// The API a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    /// OpenAI `POST /v1/completions`.
    Completions,
    /// OpenAI `POST /v1/chat/completions`.
    Chat,
    /// Anthropic `POST /v1/messages`.
    Messages,
    /// Anthropic `POST /v1/messages/count_tokens`: no generation, routed by load.
    CountTokens,
    /// OpenAI `POST /v1/responses`.
    Responses,
    /// A pooling API (`/v1/embeddings`, `/v1/rerank`, `/rerank`, `/v1/score`): routed by load.
    Pooling,
}

impl Api {
    /// The metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            Api::Completions => "completions",
            Api::Chat => "chat",
            Api::Messages => "messages",
            Api::CountTokens => "count_tokens",
            Api::Responses => "responses",
            Api::Pooling => "pooling",
        }
    }

    /// Whether requests of this API are routed by their prompt's cached prefix (else by load).
    pub fn keyed(self) -> bool {
        !matches!(self, Api::CountTokens | Api::Pooling)
    }
}

/// Anthropic message content: a string or a list of content blocks (each kept raw).
#[derive(Debug)]
pub enum Blocks {
    /// Plain text.
    Text(String),
    /// Typed blocks: `text`, `image`, `tool_use`, `tool_result`, ...
    Items(Vec<Box<RawValue>>),
}

impl<'de> Deserialize<'de> for Blocks {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Blocks;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or a list")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Blocks, E> {
                Ok(Blocks::Text(v.to_owned()))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Blocks, E> {
                Ok(Blocks::Text(v))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, seq: A) -> Result<Blocks, A::Error> {
                raw_items(serde::de::value::SeqAccessDeserializer::new(seq)).map(Blocks::Items)
            }
        }
        d.deserialize_any(V)
    }
}

/// The fields of one block or item that rendering reads; the rest stays raw.
#[derive(Deserialize)]
struct Head {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    content: Option<Blocks>,
}

fn head(raw: &RawValue) -> Option<Head> {
    serde_json::from_str(raw.get()).ok()
}

/// Text parts render as their text (as chat's do); any other block as its type and raw JSON, so
/// two different images or tool calls differ.
fn render_blocks(blocks: &Blocks, out: &mut String) {
    match blocks {
        Blocks::Text(t) => out.push_str(t),
        Blocks::Items(items) => {
            for (i, raw) in items.iter().enumerate() {
                if i > 0 {
                    next_part(out);
                }
                match head(raw) {
                    Some(Head {
                        kind: Some(k),
                        text: Some(t),
                        ..
                    }) if matches!(k.as_str(), "text" | "input_text" | "output_text") => {
                        out.push_str(&t)
                    }
                    Some(Head { kind: Some(k), .. }) => {
                        out.push_str(&k);
                        out.push_str(raw.get());
                    }
                    _ => out.push_str(raw.get()),
                }
            }
        }
    }
}

/// An Anthropic message.
#[derive(Debug, Deserialize)]
pub struct AnthropicMessage {
    /// `user` or `assistant`.
    #[serde(default)]
    pub role: String,
    /// Text or blocks.
    #[serde(default)]
    pub content: Option<Blocks>,
}

/// Anthropic's `metadata`.
#[derive(Debug, Default, Deserialize)]
pub struct Metadata {
    /// The end user; names a session when nothing else does.
    #[serde(default)]
    pub user_id: Option<String>,
}

/// The routing fields of an Anthropic Messages (or count_tokens) body.
#[derive(Debug, Deserialize)]
pub struct MessagesFields {
    /// Model name.
    #[serde(default)]
    pub model: Option<String>,
    /// The system prompt: a string or text blocks.
    #[serde(default)]
    pub system: Option<Blocks>,
    /// The conversation (at most `MAX_MESSAGES`).
    #[serde(default, deserialize_with = "capped_list")]
    pub messages: Option<Vec<AnthropicMessage>>,
    /// Tool definitions.
    #[serde(default)]
    pub tools: Option<Box<RawValue>>,
    /// Server-sent events requested.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Output budget (required by the API; the engine checks it).
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// End-user metadata.
    #[serde(default)]
    pub metadata: Option<Metadata>,
}

impl MessagesFields {
    fn render(&self, out: &mut String) -> Result<(), PromptError> {
        let messages = self.messages.as_ref().ok_or(PromptError::MissingMessages)?;
        if let Some(tools) = &self.tools {
            push_tools(tools, out);
        }
        if let Some(system) = &self.system {
            begin_message("system", None, out);
            render_blocks(system, out);
            end_message(out);
        }
        for m in messages {
            begin_message(&m.role, None, out);
            if let Some(c) = &m.content {
                render_blocks(c, out);
            }
            end_message(out);
        }
        Ok(())
    }
}

/// The routing fields of an OpenAI Responses body.
#[derive(Debug, Deserialize)]
pub struct ResponsesFields {
    /// Model name.
    #[serde(default)]
    pub model: Option<String>,
    /// The system prompt of this turn.
    #[serde(default)]
    pub instructions: Option<String>,
    /// A string (one user message) or input items.
    #[serde(default)]
    pub input: Option<Blocks>,
    /// Tool definitions.
    #[serde(default)]
    pub tools: Option<Box<RawValue>>,
    /// Server-sent events requested.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Output budget.
    #[serde(default)]
    pub max_output_tokens: Option<u64>,
    /// The stored response this turn continues: only the replica that stored it can serve it.
    #[serde(default)]
    pub previous_response_id: Option<String>,
    /// The client's cache-affinity key.
    #[serde(default)]
    pub prompt_cache_key: Option<String>,
    /// End-user id.
    #[serde(default)]
    pub user: Option<String>,
}

impl ResponsesFields {
    fn render(&self, out: &mut String) -> Result<(), PromptError> {
        let input = self.input.as_ref().ok_or(PromptError::MissingInput)?;
        if let Some(tools) = &self.tools {
            push_tools(tools, out);
        }
        if let Some(i) = &self.instructions {
            begin_message("system", None, out);
            out.push_str(i);
            end_message(out);
        }
        match input {
            Blocks::Text(t) => {
                begin_message("user", None, out);
                out.push_str(t);
                end_message(out);
            }
            Blocks::Items(items) => {
                for raw in items {
                    render_item(raw, out);
                    end_message(out);
                }
            }
        }
        Ok(())
    }
}

/// One input item: a message renders as chat's would; anything else (a function call, its
/// output, a reasoning item) under its type, as raw JSON.
fn render_item(raw: &RawValue, out: &mut String) {
    match head(raw) {
        Some(Head {
            role: Some(role),
            content,
            ..
        }) => {
            begin_message(&role, None, out);
            if let Some(c) = &content {
                render_blocks(c, out);
            }
        }
        Some(Head { kind: Some(k), .. }) => {
            begin_message(&k, None, out);
            out.push_str(raw.get());
        }
        _ => out.push_str(raw.get()),
    }
}

/// What a load-routed body needs: its model.
#[derive(Debug, Deserialize)]
pub struct PoolingFields {
    /// Model name.
    #[serde(default)]
    pub model: Option<String>,
}

/// A request's routing fields, in its API's shape.
#[derive(Debug)]
pub enum Fields {
    /// Completions or chat.
    OpenAi(RoutingFields),
    /// Messages or count_tokens.
    Messages(MessagesFields),
    /// Responses.
    Responses(ResponsesFields),
    /// A pooling API.
    Pooling(PoolingFields),
}

impl Fields {
    /// Parses the routing fields of a body sent to `api`.
    /// Every list in it counts against one budget ([`super::prompt_de::MAX_ELEMENTS`]).
    pub fn parse(api: Api, body: &[u8]) -> Result<Self, serde_json::Error> {
        super::prompt_de::within_element_budget(|| {
            Ok(match api {
                Api::Completions | Api::Chat => Fields::OpenAi(serde_json::from_slice(body)?),
                Api::Messages | Api::CountTokens => Fields::Messages(serde_json::from_slice(body)?),
                Api::Responses => Fields::Responses(serde_json::from_slice(body)?),
                Api::Pooling => Fields::Pooling(serde_json::from_slice(body)?),
            })
        })
    }

    /// The model asked for.
    pub fn model(&self) -> Option<&str> {
        match self {
            Fields::OpenAi(f) => f.model.as_deref(),
            Fields::Messages(f) => f.model.as_deref(),
            Fields::Responses(f) => f.model.as_deref(),
            Fields::Pooling(f) => f.model.as_deref(),
        }
    }

    /// Whether the client asked for server-sent events.
    pub fn stream(&self) -> bool {
        match self {
            Fields::OpenAi(f) => f.stream,
            Fields::Messages(f) => f.stream,
            Fields::Responses(f) => f.stream,
            Fields::Pooling(_) => None,
        }
        .unwrap_or(false)
    }

    /// The end user the body names, which names a session when no header does.
    pub fn user(&self) -> Option<&str> {
        match self {
            Fields::OpenAi(f) => f.user.as_deref(),
            Fields::Messages(f) => f.metadata.as_ref().and_then(|m| m.user_id.as_deref()),
            Fields::Responses(f) => f.user.as_deref(),
            Fields::Pooling(_) => None,
        }
    }

    /// A cache-affinity key carried in the body (Responses' `prompt_cache_key`).
    pub fn affinity_key(&self) -> Option<&str> {
        match self {
            Fields::Responses(f) => f.prompt_cache_key.as_deref().filter(|k| !k.is_empty()),
            _ => None,
        }
    }

    /// The stored response this request continues, if any.
    pub fn previous_response_id(&self) -> Option<&str> {
        match self {
            Fields::Responses(f) => f.previous_response_id.as_deref().filter(|k| !k.is_empty()),
            _ => None,
        }
    }

    /// SGLang's LoRA selector and vLLM's cache salt (OpenAI dialects only).
    pub fn lora_and_salt(&self) -> (Option<&str>, Option<&str>) {
        match self {
            Fields::OpenAi(f) => (f.lora_path.as_deref(), f.cache_salt.as_deref()),
            _ => (None, None),
        }
    }

    /// The OpenAI fields, when the request is completions or chat.
    pub fn openai(&self) -> Option<&RoutingFields> {
        match self {
            Fields::OpenAi(f) => Some(f),
            _ => None,
        }
    }

    /// Renders the routing text into `out` (cleared first). A load-routed API renders nothing.
    pub fn render(&self, out: &mut String) -> Result<(), PromptError> {
        out.clear();
        match self {
            Fields::OpenAi(f) => f.render(out),
            Fields::Messages(f) => f.render(out),
            Fields::Responses(f) => f.render(out),
            Fields::Pooling(_) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(api: Api, body: &str) -> String {
        let mut s = String::new();
        Fields::parse(api, body.as_bytes())
            .unwrap()
            .render(&mut s)
            .unwrap();
        s
    }

    #[test]
    fn one_conversation_keys_alike_through_every_api() {
        let chat = text(
            Api::Chat,
            r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},
                {"role":"user","content":"Hi"},{"role":"assistant","content":"Hello"},
                {"role":"user","content":[{"type":"text","text":"More"}]}]}"#,
        );
        let messages = text(
            Api::Messages,
            r#"{"model":"m","max_tokens":8,"system":[{"type":"text","text":"Be brief."}],
                "messages":[{"role":"user","content":"Hi"},
                {"role":"assistant","content":[{"type":"text","text":"Hello"}]},
                {"role":"user","content":[{"type":"text","text":"More"}]}]}"#,
        );
        let responses = text(
            Api::Responses,
            r#"{"model":"m","instructions":"Be brief.","input":[
                {"role":"user","content":"Hi"},
                {"type":"message","role":"assistant","content":[{"type":"output_text","text":"Hello"}]},
                {"role":"user","content":[{"type":"input_text","text":"More"}]}]}"#,
        );
        assert_eq!(chat, messages);
        assert_eq!(chat, responses);
        let one = text(Api::Responses, r#"{"model":"m","input":"Hi"}"#);
        assert_eq!(
            one,
            text(
                Api::Chat,
                r#"{"messages":[{"role":"user","content":"Hi"}]}"#
            )
        );
    }

    #[test]
    fn tool_blocks_and_images_differ_by_content() {
        let a = text(
            Api::Messages,
            r#"{"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"a","content":"1"}]}]}"#,
        );
        let b = text(
            Api::Messages,
            r#"{"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"b","content":"1"}]}]}"#,
        );
        assert_ne!(a, b);
        assert!(a.contains("tool_result"));
        let f = text(
            Api::Responses,
            r#"{"input":[{"type":"function_call","call_id":"c","name":"f","arguments":"{}"}]}"#,
        );
        assert!(f.starts_with("function_call\n"), "{f:?}");
    }

    #[test]
    fn fields_each_api_reads() {
        let f = Fields::parse(
            Api::Responses,
            br#"{"model":"m","input":"x","stream":true,"previous_response_id":"resp_1","prompt_cache_key":"k","user":"u"}"#,
        )
        .unwrap();
        assert_eq!(f.model(), Some("m"));
        assert!(f.stream());
        assert_eq!(f.previous_response_id(), Some("resp_1"));
        assert_eq!(f.affinity_key(), Some("k"));
        assert_eq!(f.user(), Some("u"));
        let m = Fields::parse(
            Api::Messages,
            br#"{"model":"m","messages":[],"metadata":{"user_id":"u2"}}"#,
        )
        .unwrap();
        assert_eq!(m.user(), Some("u2"));
        let mut s = String::new();
        assert_eq!(
            Fields::parse(Api::Messages, br#"{"model":"m"}"#)
                .unwrap()
                .render(&mut s),
            Err(PromptError::MissingMessages)
        );
        let p = Fields::parse(Api::Pooling, br#"{"model":"e","input":["a"]}"#).unwrap();
        assert_eq!(p.model(), Some("e"));
        assert!(p.render(&mut s).is_ok() && s.is_empty());
        assert!(Fields::parse(Api::Messages, br#"{"messages":"x"}"#).is_err());
        assert!(Fields::parse(Api::Messages, br#"{"messages":7}"#).is_err());
    }

    /// `n` messages of 4,096 content parts each (every list within its own cap), in `api`'s shape.
    fn many_parts(api: Api, n: usize) -> String {
        let part = if api == Api::Chat { "{}" } else { "1" };
        let msg = format!(
            r#"{{"role":"user","content":[{}]}}"#,
            vec![part; 4096].join(",")
        );
        format!(
            r#"{{"model":"m","messages":[{}]}}"#,
            vec![msg.as_str(); n].join(",")
        )
    }

    /// The memory one crafted body's parse takes, measured: `cargo test --lib
    /// crafted_body_parse_memory -- --ignored --nocapture`. A 32 MiB chat body of 2,700 messages
    /// of 4,096 empty parts, parsed with the per-list caps alone (no budget scope: as before the
    /// budget) and through [`Fields::parse`]; the process's peak resident set (`VmHWM`) grows by
    /// what the first parse held at once.
    #[test]
    #[ignore]
    fn crafted_body_parse_memory() {
        let peak_kib = || -> u64 {
            let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap_or(0)
        };
        let body = many_parts(Api::Chat, 2700);
        let base = peak_kib();
        let t = std::time::Instant::now();
        let refused = Fields::parse(Api::Chat, body.as_bytes()).is_err();
        let (budget_ms, budget_peak) = (t.elapsed().as_millis(), peak_kib());
        let t = std::time::Instant::now();
        let caps_only = serde_json::from_slice::<RoutingFields>(body.as_bytes()).is_ok();
        let (caps_ms, caps_peak) = (t.elapsed().as_millis(), peak_kib());
        println!(
            "body {} MiB: with the budget refused={refused} in {budget_ms} ms, peak +{} MiB; \
             per-list caps alone parsed={caps_only} in {caps_ms} ms, peak +{} MiB",
            body.len() >> 20,
            budget_peak.saturating_sub(base) >> 10,
            caps_peak.saturating_sub(base) >> 10
        );
    }

    #[test]
    fn a_body_is_refused_past_its_element_budget_whatever_lists_hold_them() {
        for api in [Api::Chat, Api::Messages] {
            // 70 × 4,097 elements: over the body's 256 Ki, though each list is within its cap.
            let e = Fields::parse(api, many_parts(api, 70).as_bytes()).unwrap_err();
            assert!(e.to_string().contains("in all"), "{api:?}: {e}");
            // 60 × 4,097 are within it, and the refused parse left no debt behind.
            assert!(
                Fields::parse(api, many_parts(api, 60).as_bytes()).is_ok(),
                "{api:?}"
            );
        }
    }
}
