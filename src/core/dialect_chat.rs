//! Token mode for the Anthropic Messages and OpenAI Responses dialects: the request as the chat
//! body an engine renders through its chat template, as vLLM converts these APIs to chat.
//!
//! Exists so that in token mode a Messages or Responses request is keyed by the token ids the
//! engine will see, like chat: text blocks become text parts, `tool_use` / `function_call`
//! become assistant `tool_calls`, `tool_result` / `function_call_output` become `tool`
//! messages, tool definitions become chat's function tools. What cannot be converted (an image,
//! an unknown block) makes the request keyed by text instead (`None`).

use serde_json::{json, Map, Value};

use super::dialect::{AnthropicMessage, Blocks, Fields, MessagesFields, ResponsesFields};

/// The chat body (`messages`, `tools`) of a Messages or Responses request; `None` for other
/// dialects or content that has no chat form.
pub fn chat_body(fields: &Fields) -> Option<Value> {
    match fields {
        Fields::Messages(f) => messages_body(f),
        Fields::Responses(f) => responses_body(f),
        _ => None,
    }
}

fn parse(raw: &serde_json::value::RawValue) -> Option<Map<String, Value>> {
    serde_json::from_str(raw.get()).ok()
}

/// Text parts of blocks; `None` if any block is not text.
fn text_parts(blocks: &Blocks) -> Option<Vec<Value>> {
    match blocks {
        Blocks::Text(t) => Some(vec![json!({"type": "text", "text": t})]),
        Blocks::Items(items) => items
            .iter()
            .map(|raw| {
                let b = parse(raw)?;
                let kind = b.get("type")?.as_str()?;
                let text = b.get("text")?.as_str()?;
                matches!(kind, "text" | "input_text" | "output_text")
                    .then(|| json!({"type": "text", "text": text}))
            })
            .collect(),
    }
}

/// The most tool definitions converted to chat form (OpenAI's API takes 128): past it the
/// request is keyed by text.
const MAX_TOOLS: usize = 1 << 10;
/// The longest tool list (its JSON text) converted to chat form: each definition is parsed as a
/// tree and copied into the chat body, many times its text (an empty `{}` becomes ~1.4 KB), so
/// a 32 MiB list of them would take gigabytes. Past it the request is keyed by text.
const MAX_TOOLS_BYTES: usize = 1 << 20;

/// Chat function tools from Anthropic's (`input_schema`) or Responses' (flat) definitions:
/// `Some(None)` without tools, `None` when the list has no chat form (not a list of objects,
/// or past [`MAX_TOOLS`] or [`MAX_TOOLS_BYTES`]).
fn tools(raw: Option<&serde_json::value::RawValue>) -> Option<Option<Value>> {
    let Some(raw) = raw else {
        return Some(None);
    };
    if raw.get().len() > MAX_TOOLS_BYTES {
        return None;
    }
    let list: Vec<Map<String, Value>> = serde_json::from_str(raw.get()).ok()?;
    if list.len() > MAX_TOOLS {
        return None;
    }
    let converted: Vec<Value> = list
        .into_iter()
        .map(|t| {
            let params = t.get("input_schema").or_else(|| t.get("parameters"));
            json!({"type": "function", "function": {
                "name": t.get("name"), "description": t.get("description"), "parameters": params,
            }})
        })
        .collect();
    Some(Some(Value::Array(converted)))
}

fn with_tools(messages: Vec<Value>, tools: Option<Value>) -> Value {
    match tools {
        Some(t) => json!({"messages": messages, "tools": t}),
        None => json!({"messages": messages}),
    }
}

fn messages_body(f: &MessagesFields) -> Option<Value> {
    let mut out = Vec::new();
    if let Some(system) = &f.system {
        out.push(json!({"role": "system", "content": text_parts(system)?}));
    }
    for m in f.messages.as_ref()? {
        anthropic_message(m, &mut out)?;
    }
    let tools = tools(f.tools.as_deref())?;
    Some(with_tools(out, tools))
}

/// One Anthropic message: its text, its tool calls, and each tool result as a `tool` message.
fn anthropic_message(m: &AnthropicMessage, out: &mut Vec<Value>) -> Option<()> {
    let Some(Blocks::Items(items)) = &m.content else {
        let parts = m.content.as_ref().map_or(Some(Vec::new()), text_parts)?;
        out.push(json!({"role": m.role, "content": parts}));
        return Some(());
    };
    let (mut parts, mut calls, mut results) = (Vec::new(), Vec::new(), Vec::new());
    for raw in items {
        let b = parse(raw)?;
        match b.get("type")?.as_str()? {
            "text" => parts.push(json!({"type": "text", "text": b.get("text")?.as_str()?})),
            "tool_use" => calls.push(json!({
                "id": b.get("id")?, "type": "function",
                "function": {"name": b.get("name")?, "arguments": b.get("input")?.to_string()},
            })),
            "tool_result" => {
                let content = match b.get("content") {
                    Some(Value::String(s)) => s.clone(),
                    Some(v @ Value::Array(_)) => {
                        let blocks: Blocks = serde_json::from_value(v.clone()).ok()?;
                        join_text(&text_parts(&blocks)?)
                    }
                    _ => String::new(),
                };
                results.push(json!({"role": "tool", "tool_call_id": b.get("tool_use_id")?, "content": content}));
            }
            _ => return None,
        }
    }
    if !parts.is_empty() || !calls.is_empty() {
        let mut msg = json!({"role": m.role, "content": parts});
        if !calls.is_empty() {
            msg["tool_calls"] = Value::Array(calls);
        }
        out.push(msg);
    }
    out.extend(results);
    Some(())
}

fn join_text(parts: &[Value]) -> String {
    parts
        .iter()
        .filter_map(|p| p.get("text").and_then(Value::as_str))
        .collect::<Vec<_>>()
        .join("\n")
}

fn responses_body(f: &ResponsesFields) -> Option<Value> {
    let mut out = Vec::new();
    if let Some(i) = &f.instructions {
        out.push(json!({"role": "system", "content": i}));
    }
    match f.input.as_ref()? {
        Blocks::Text(t) => out.push(json!({"role": "user", "content": t})),
        Blocks::Items(items) => {
            for raw in items {
                out.push(response_item(&parse(raw)?)?);
            }
        }
    }
    let tools = tools(f.tools.as_deref())?;
    Some(with_tools(out, tools))
}

/// One Responses input item as a chat message.
fn response_item(item: &Map<String, Value>) -> Option<Value> {
    if let Some(role) = item.get("role").and_then(Value::as_str) {
        let content = match item.get("content") {
            Some(Value::String(s)) => json!(s),
            Some(v @ Value::Array(_)) => {
                let blocks: Blocks = serde_json::from_value(v.clone()).ok()?;
                Value::Array(text_parts(&blocks)?)
            }
            _ => json!(""),
        };
        return Some(json!({"role": role, "content": content}));
    }
    match item.get("type")?.as_str()? {
        "function_call" => Some(json!({"role": "assistant", "content": "", "tool_calls": [{
            "id": item.get("call_id")?, "type": "function",
            "function": {"name": item.get("name")?, "arguments": item.get("arguments")?},
        }]})),
        "function_call_output" => Some(json!({
            "role": "tool", "tool_call_id": item.get("call_id")?, "content": item.get("output")?,
        })),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::dialect::Api;

    fn body(api: Api, json: &str) -> Option<Value> {
        chat_body(&Fields::parse(api, json.as_bytes()).unwrap())
    }

    #[test]
    fn messages_become_the_chat_vllm_renders() {
        let b = body(
            Api::Messages,
            r#"{"model":"m","system":"S","tools":[{"name":"f","input_schema":{"type":"object"}}],
                "messages":[{"role":"user","content":"Hi"},
                {"role":"assistant","content":[{"type":"text","text":"ok"},{"type":"tool_use","id":"t1","name":"f","input":{"a":1}}]},
                {"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"42"}]}]}"#,
        )
        .unwrap();
        let m = b["messages"].as_array().unwrap();
        assert_eq!(m[0]["role"], "system");
        assert_eq!(m[1]["content"][0]["text"], "Hi");
        assert_eq!(m[2]["tool_calls"][0]["function"]["arguments"], "{\"a\":1}");
        assert_eq!(m[3]["role"], "tool");
        assert_eq!(m[3]["content"], "42");
        assert_eq!(b["tools"][0]["function"]["name"], "f");
    }

    #[test]
    fn responses_become_chat_and_images_do_not_convert() {
        let b = body(
            Api::Responses,
            r#"{"model":"m","instructions":"S","input":[{"role":"user","content":[{"type":"input_text","text":"Hi"}]},
                {"type":"function_call","call_id":"c","name":"f","arguments":"{}"},
                {"type":"function_call_output","call_id":"c","output":"1"}]}"#,
        )
        .unwrap();
        let m = b["messages"].as_array().unwrap();
        assert_eq!(m.len(), 4);
        assert_eq!(m[2]["tool_calls"][0]["id"], "c");
        assert_eq!(m[3]["role"], "tool");
        assert!(body(
            Api::Messages,
            r#"{"messages":[{"role":"user","content":[{"type":"image","source":{}}]}]}"#
        )
        .is_none());
        assert!(body(Api::Chat, r#"{"messages":[]}"#).is_none());
    }

    #[test]
    fn a_tool_list_too_long_to_convert_keys_the_request_by_text() {
        let with = |tools: &str| {
            body(
                Api::Messages,
                &format!(r#"{{"model":"m","messages":[],"tools":{tools}}}"#),
            )
        };
        let list = |n: usize| format!("[{}]", vec![r#"{"name":"f"}"#; n].join(","));
        assert!(with(&list(MAX_TOOLS)).is_some());
        // One more, or a list whose text is past the bound, or no list at all: text keys.
        assert!(with(&list(MAX_TOOLS + 1)).is_none());
        let long = format!(
            r#"[{{"name":"f","description":"{}"}}]"#,
            "d".repeat(MAX_TOOLS_BYTES)
        );
        assert!(with(&long).is_none());
        assert!(with(r#"{"name":"f"}"#).is_none());
        // Without tools the chat body has none.
        assert!(body(Api::Messages, r#"{"model":"m","messages":[]}"#)
            .is_some_and(|b| b.get("tools").is_none()));
    }
}
