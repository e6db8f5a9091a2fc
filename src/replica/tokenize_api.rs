//! vLLM's tokenizer endpoints on the simulated replica: `POST /tokenize`, `POST /detokenize`,
//! `POST /v1/completions/render` and `POST /v1/chat/completions/render`.
//!
//! Peer routers (vLLM production-stack's KV-aware routers, llm-d's precise prefix scorer; issue #12
//! names vllm-router's `cache_aware`) ask each engine for a request's token ids before routing on
//! them; without these routes they fall back to load only, and a benchmark against
//! `kvmesh replica` would not measure them as they run against vLLM.
//! Shapes follow vLLM's `vllm/entrypoints/serve/tokenize/protocol.py` (`TokenizeCompletionRequest`,
//! `TokenizeChatRequest`, `TokenizeResponse`, `DetokenizeRequest`, `DetokenizeResponse`) and
//! `vllm/entrypoints/serve/disagg/protocol.py` (`GenerateRequest`, what render returns); see
//! docs/replica.md for the versions.
//!
//! Every prompt is built by the same functions the completion endpoints use
//! ([`openai::parse_completion`], [`openai::chat_prompt`]) and tokenized by
//! [`crate::engine_sim::tokenize`], so `/tokenize` counts exactly the tokens the engine charges.
//! Pure functions of the parsed body; the HTTP layer reads the body and writes the answer.

use serde_json::{json, Map, Value};

use crate::engine_sim::tokens::BYTES_PER_TOKEN;
use crate::engine_sim::{tokenize, TokenId};

use super::openai::{self, ApiError};

/// What the endpoints need to know about the served model.
#[derive(Debug, Clone, Copy)]
pub struct Served<'a> {
    /// Served model name, echoed when a request names none.
    pub model: &'a str,
    /// `max_model_len` of `/v1/models`, reported by `/tokenize` and enforced by render.
    pub max_model_len: usize,
    /// `max_tokens` when a render request sets none.
    pub default_max_tokens: u32,
}

fn object(body: &Value) -> Result<&Map<String, Value>, ApiError> {
    body.as_object()
        .ok_or_else(|| ApiError::bad_request("the request body must be a JSON object", None))
}

/// The request's `model`: absent, null or a string. Any name is served, as the completion
/// endpoints serve any (the simulated replica has one model under whatever name it is called).
fn requested_model(body: &Value) -> Result<Option<&str>, ApiError> {
    match body.get("model") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(m)) => Ok(Some(m)),
        Some(_) => Err(ApiError::bad_request(
            "'model' must be a string",
            Some("model"),
        )),
    }
}

fn flag(body: &Value, key: &'static str) -> Result<bool, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad_request(
            format!("'{key}' must be a boolean"),
            Some(key),
        )),
    }
}

/// `POST /tokenize`: the completion form (`prompt`, a string) or the chat form (`messages`,
/// rendered by the replica's chat template). Answers vLLM's `TokenizeResponse`: `count`,
/// `max_model_len`, `tokens` and `token_strs` (null unless `return_token_strs`).
/// `add_special_tokens` is accepted and has no effect: the simulated tokenizer has no special
/// tokens (no BOS), which is also what the engine charges.
pub fn tokenize_request(body: &Value, served: Served<'_>) -> Result<Value, ApiError> {
    let fields = object(body)?;
    requested_model(body)?;
    flag(body, "add_special_tokens")?;
    let return_strs = flag(body, "return_token_strs")?;
    let text = match (fields.get("prompt"), fields.get("messages")) {
        (Some(Value::String(prompt)), _) => prompt.clone(),
        (Some(_), _) => {
            return Err(ApiError::bad_request(
                "'prompt' must be a string",
                Some("prompt"),
            ))
        }
        (None, Some(_)) => openai::chat_prompt(body)?,
        (None, None) => {
            return Err(ApiError::bad_request(
                "either 'prompt' (a string) or 'messages' (a list) is required",
                Some("prompt"),
            ))
        }
    };
    let tokens = tokenize(&text);
    let token_strs = if return_strs {
        let last = tokens.len().saturating_sub(1);
        json!(tokens
            .iter()
            .enumerate()
            .map(|(i, id)| String::from_utf8_lossy(&token_bytes(*id, i == last)).into_owned())
            .collect::<Vec<_>>())
    } else {
        Value::Null
    };
    Ok(json!({
        "count": tokens.len(),
        "max_model_len": served.max_model_len,
        "tokens": tokens,
        "token_strs": token_strs,
    }))
}

/// The bytes token `id` stands for: its little-endian bytes, less the zero padding
/// [`crate::engine_sim::tokenize`] adds to the last chunk when this is the last token.
fn token_bytes(id: TokenId, last: bool) -> Vec<u8> {
    let mut bytes = id.to_le_bytes().to_vec();
    if last {
        // A last chunk holds at least one byte of text, so at most BYTES_PER_TOKEN - 1 are padding.
        let mut padding = 0;
        while padding < BYTES_PER_TOKEN - 1 && bytes.last() == Some(&0) {
            bytes.pop();
            padding += 1;
        }
    }
    bytes
}

/// The inverse of [`crate::engine_sim::tokenize`]: `detokenize(tokenize(s)) == s` for every `s`
/// that does not end in a NUL byte (the padding of the last chunk cannot be told from trailing
/// NULs of the text, and is dropped). Ids that are no tokenization of valid UTF-8 decode lossily
/// (U+FFFD), as a Hugging Face tokenizer decodes stray byte tokens.
pub fn detokenize(ids: &[TokenId]) -> String {
    let last = ids.len().saturating_sub(1);
    let bytes: Vec<u8> = ids
        .iter()
        .enumerate()
        .flat_map(|(i, id)| token_bytes(*id, i == last))
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// `POST /detokenize`: `{"tokens": [ids]}` → vLLM's `DetokenizeResponse` `{"prompt": text}`.
/// An id outside the simulated vocabulary (`u32`) is a 400, as an out-of-vocabulary id is to vLLM.
pub fn detokenize_request(body: &Value) -> Result<Value, ApiError> {
    object(body)?;
    requested_model(body)?;
    let bad = || {
        ApiError::bad_request(
            "'tokens' is required: a list of token ids (integers from 0 to 4294967295)",
            Some("tokens"),
        )
    };
    let ids = body
        .get("tokens")
        .and_then(Value::as_array)
        .ok_or_else(bad)?
        .iter()
        .map(|t| t.as_u64().and_then(|n| TokenId::try_from(n).ok()))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(bad)?;
    Ok(json!({"prompt": detokenize(&ids)}))
}

/// One vLLM `GenerateRequest` (what the render endpoints return): the prompt's token ids and the
/// sampling parameters the replica would use (only `max_tokens`: it samples nothing).
fn generate_request(
    body: &Value,
    served: Served<'_>,
    request_id: String,
    parsed: &openai::Parsed,
) -> Result<Value, ApiError> {
    if parsed.prompt.is_empty() {
        return Err(ApiError::bad_request(
            "the prompt renders to no tokens",
            Some("prompt"),
        ));
    }
    let total = parsed.prompt.len() + parsed.max_tokens as usize;
    if total > served.max_model_len {
        return Err(ApiError::bad_request(
            format!(
                "This model's maximum context length is {} tokens. However, you requested {} \
                 tokens ({} in the messages, {} in the completion).",
                served.max_model_len,
                total,
                parsed.prompt.len(),
                parsed.max_tokens
            ),
            Some("prompt"),
        ));
    }
    let model = requested_model(body)?.unwrap_or(served.model);
    let cache_salt = body.get("cache_salt").and_then(Value::as_str);
    let stream_options = if parsed.stream {
        body.get("stream_options").cloned().unwrap_or(Value::Null)
    } else {
        Value::Null
    };
    Ok(json!({
        "request_id": request_id,
        "token_ids": parsed.prompt,
        "features": null,
        "sampling_params": {"max_tokens": parsed.max_tokens},
        "model": model,
        "stream": parsed.stream,
        "stream_options": stream_options,
        "cache_salt": cache_salt,
        "priority": 0,
        "kv_transfer_params": null,
    }))
}

/// `POST /v1/completions/render`: a list with one `GenerateRequest` (the replica refuses batched
/// prompts, as its `/v1/completions` does). Each entry also carries the pre-`GenerateRequest`
/// render fields `prompt_token_ids` (and `prompt`, for a text prompt), so a router written against
/// either vLLM render shape reads its ids.
pub fn render_completion(
    body: &Value,
    served: Served<'_>,
    request_id: String,
) -> Result<Value, ApiError> {
    object(body)?;
    let parsed = openai::parse_completion(body, served.default_max_tokens)?;
    let mut entry = generate_request(body, served, request_id, &parsed)?;
    entry["prompt_token_ids"] = json!(parsed.prompt);
    let text = match body.get("prompt") {
        Some(Value::String(s)) => Some(s),
        Some(Value::Array(items)) => match items.as_slice() {
            [Value::String(s)] => Some(s),
            _ => None,
        },
        _ => None,
    };
    if let Some(text) = text {
        entry["prompt"] = json!(text);
    }
    Ok(json!([entry]))
}

/// `POST /v1/chat/completions/render`: one `GenerateRequest` for the prompt the replica's chat
/// template renders (the same tokens `/v1/chat/completions` charges).
pub fn render_chat(
    body: &Value,
    served: Served<'_>,
    request_id: String,
) -> Result<Value, ApiError> {
    object(body)?;
    let parsed = openai::parse_chat(body, served.default_max_tokens)?;
    generate_request(body, served, request_id, &parsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SERVED: Served<'static> = Served {
        model: "sim",
        max_model_len: 64,
        default_max_tokens: 4,
    };

    #[test]
    fn detokenize_inverts_tokenize() {
        for s in [
            "",
            "a",
            "abcd",
            "abcde",
            "héllo wörld ✓ 日本語",
            "mid\0dle",
            "\0\0\0\0x",
        ] {
            assert_eq!(detokenize(&tokenize(s)), s, "{s:?}");
        }
        // Trailing NULs cannot be told from padding.
        assert_eq!(detokenize(&tokenize("ab\0")), "ab");
        // Ids that are no UTF-8 text decode lossily instead of failing.
        assert_eq!(detokenize(&[0xFFFF_FFFF]), "\u{FFFD}".repeat(4));
    }

    #[test]
    fn tokenize_forms_agree_with_the_completion_parsers() {
        let completion = json!({"model": "x", "prompt": "abcdefghi", "add_special_tokens": true});
        let r = tokenize_request(&completion, SERVED).unwrap();
        let parsed = openai::parse_completion(&completion, 4).unwrap();
        assert_eq!(r["count"], 3);
        assert_eq!(r["tokens"], json!(parsed.prompt));
        assert_eq!(r["max_model_len"], 64);
        assert!(r["token_strs"].is_null());

        let chat = json!({"messages": [{"role": "user", "content": "hi"}]});
        let r = tokenize_request(&chat, SERVED).unwrap();
        assert_eq!(
            r["tokens"],
            json!(openai::parse_chat(&chat, 4).unwrap().prompt)
        );

        let strs = json!({"prompt": "abcdef", "return_token_strs": true});
        let r = tokenize_request(&strs, SERVED).unwrap();
        assert_eq!(r["token_strs"], json!(["abcd", "ef"]));
    }

    #[test]
    fn chat_closing_flags() {
        let open = json!({"messages": [{"role": "assistant", "content": "Sure"}],
                          "continue_final_message": true, "add_generation_prompt": false});
        let r = tokenize_request(&open, SERVED).unwrap();
        let ids: Vec<TokenId> = serde_json::from_value(r["tokens"].clone()).unwrap();
        assert_eq!(detokenize(&ids), "<|assistant|>\nSure");
        let both = json!({"messages": [{"role": "user", "content": "x"}],
                          "continue_final_message": true, "add_generation_prompt": true});
        assert_eq!(tokenize_request(&both, SERVED).unwrap_err().status, 400);
    }

    #[test]
    fn malformed_requests_are_400() {
        for body in [
            json!([1, 2]),
            json!({}),
            json!({"prompt": 5}),
            json!({"prompt": "x", "model": 3}),
            json!({"prompt": "x", "return_token_strs": "yes"}),
            json!({"messages": "hi"}),
            json!({"messages": [1]}),
        ] {
            assert_eq!(
                tokenize_request(&body, SERVED).unwrap_err().status,
                400,
                "{body}"
            );
        }
        for body in [
            json!({}),
            json!({"tokens": "abc"}),
            json!({"tokens": [-1]}),
            json!({"tokens": [4294967296u64]}),
            json!({"tokens": [1.5]}),
        ] {
            assert_eq!(detokenize_request(&body).unwrap_err().status, 400, "{body}");
        }
    }

    #[test]
    fn render_shapes() {
        let r = render_completion(
            &json!({"prompt": "abcdefgh", "max_tokens": 2, "cache_salt": "s"}),
            SERVED,
            "cmpl-r-1".into(),
        )
        .unwrap();
        let e = &r[0];
        assert_eq!(r.as_array().map(Vec::len), Some(1));
        assert_eq!(e["token_ids"], json!(tokenize("abcdefgh")));
        assert_eq!(e["prompt_token_ids"], e["token_ids"]);
        assert_eq!(e["prompt"], "abcdefgh");
        assert_eq!(e["sampling_params"]["max_tokens"], 2);
        assert_eq!(e["model"], "sim");
        assert_eq!(e["cache_salt"], "s");
        assert_eq!(e["request_id"], "cmpl-r-1");

        let chat = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        let r = render_chat(&chat, SERVED, "chatcmpl-r-2".into()).unwrap();
        assert_eq!(
            r["token_ids"],
            json!(tokenize("<|user|>\nhi\n<|assistant|>\n"))
        );
        assert_eq!(r["model"], "m");
        assert_eq!(r["sampling_params"]["max_tokens"], 4);

        // Over max_model_len (prompt + max_tokens), as vLLM's render refuses it.
        let long = json!({"prompt": "x".repeat(64 * 4), "max_tokens": 1});
        assert_eq!(
            render_completion(&long, SERVED, "c".into())
                .unwrap_err()
                .status,
            400
        );
        assert_eq!(
            render_completion(&json!({"prompt": ""}), SERVED, "c".into())
                .unwrap_err()
                .status,
            400
        );
    }
}
