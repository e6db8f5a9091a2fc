//! Token mode: request keys from the model's own token ids, so they equal the keys the node
//! computes from the engine's KV events (`replicas::kv_index`) block for block.
//!
//! Exists because event token ids are post-chat-template, post-tokenizer ids: to match them a
//! router must render the model's chat template (`tokenizer_config.json`, Jinja, rendered with
//! minijinja) and run the model's tokenizer (`tokenizer.json`, Hugging Face `tokenizers`) exactly
//! as the engine does (engines.md §4, §8.2). Request keys are then
//! `token_block_keys(token_namespace(lora, salt, tenant), ids, block_size)`.
//!
//! The namespace leaves the model name out, unlike text mode: an event stream does not name its
//! model, and a replica's cache belongs to the one engine behind it (routing only considers
//! replicas serving the request's model anyway). LoRA name and cache salt stay in, on both sides.
//! Requests this cannot tokenize faithfully (multimodal parts, several prompts, a model the
//! tokenizer is not for, a block size not known yet) use text mode and are counted
//! (`kvmesh_token_mode_fallbacks_total{reason}`). No `[tokenizer]`, or one that fails to load,
//! means text mode for the whole node, logged at start.
//!
//! As vLLM does: chat messages are rendered by the template (minijinja with Python string
//! methods, `raise_exception`, `bos_token`/`eos_token`, `add_generation_prompt`, `tools`,
//! `chat_template_kwargs`) and tokenized without added special tokens; a completion prompt is
//! tokenized with them; token-id prompts are used as they are. The block size is configured or
//! learned from the events' `block_size` or `vllm:cache_config_info`, and then becomes the view's
//! `tokens_per_block`.
//!
//! `path = "builtin:kvmesh-sim"` selects the simulated replica's own rule instead of a file (one
//! token per 4 bytes, `engine_sim::tokens`), so a node in front of `kvmesh replica` fleets keys
//! completions exactly as their KV events do (chat requests, which it has no template for, use
//! text mode): what tests and `kvmesh bench --dp-ranks` fleets need to exercise exact models.
//!
//! An isolated tenant's token keys include the tenant, so they never match event keys (only the
//! node's own overlay): isolation wins over engine truth.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use serde::Deserialize;
use serde_json::Value as Json;

use crate::core::keys::{token_block_keys, BlockKey, Namespace};

/// The namespace of a token-mode key chain: LoRA adapter, cache salt and, for an isolated
/// tenant, the tenant id. Used alike for requests and for the chain roots of engine events.
pub fn token_namespace(
    lora: Option<&str>,
    cache_salt: Option<&str>,
    tenant: Option<&str>,
) -> Namespace {
    Namespace::new("", lora, cache_salt, tenant)
}

/// `[tokenizer]` in the node config.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TokenizerConfig {
    /// The model's `tokenizer.json` (required), or `builtin:kvmesh-sim` for the simulated
    /// replica's 4-bytes-per-token rule ([`BUILTIN_SIM`]).
    pub path: PathBuf,
    /// The model's `tokenizer_config.json`, for its `chat_template`, `bos_token` and
    /// `eos_token`. Default: none, and chat requests use text mode.
    #[serde(default)]
    pub chat_template_config: Option<PathBuf>,
    /// Tokens per engine block (vLLM `--block-size`). Default: learned from the engines' KV
    /// events (`block_size`) or `vllm:cache_config_info`; until then requests use text mode.
    #[serde(default)]
    pub block_size: Option<u32>,
    /// Models this tokenizer is for; requests for other models use text mode. Default: every
    /// model.
    #[serde(default)]
    pub models: Vec<String>,
}

/// Why token mode could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// A file could not be loaded.
    #[error("cannot load {path}: {message}")]
    Load {
        /// The file.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// The chat template failed to render this request.
    #[error("chat template: {0}")]
    Template(String),
    /// The tokenizer failed on this request.
    #[error("tokenizer: {0}")]
    Encode(String),
    /// The request has something token mode cannot reproduce.
    #[error("unsupported request: {0}")]
    Unsupported(&'static str),
}

impl TokenizeError {
    /// Short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            TokenizeError::Load { .. } => "load",
            TokenizeError::Template(_) => "template",
            TokenizeError::Encode(_) => "encode",
            TokenizeError::Unsupported(_) => "unsupported",
        }
    }
}

/// The `[tokenizer].path` that selects the simulated replica's tokenization.
pub const BUILTIN_SIM: &str = "builtin:kvmesh-sim";

/// Where token ids come from.
enum Encoder {
    /// The model's Hugging Face tokenizer.
    Hf(Box<tokenizers::Tokenizer>),
    /// `engine_sim::tokens::tokenize`: the simulated replica's rule.
    Sim,
}

/// The loaded tokenizer, chat template and block size of a node in token mode.
pub struct TokenMode {
    tokenizer: Encoder,
    template: Option<ChatTemplate>,
    /// 0 = unknown yet.
    block_size: AtomicU32,
    block_size_configured: bool,
    models: Vec<String>,
}

impl std::fmt::Debug for TokenMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenMode")
            .field("chat_template", &self.template.is_some())
            .field("block_size", &self.block_size())
            .field("models", &self.models)
            .finish()
    }
}

struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
}

/// `bos_token`/`eos_token` are either strings or `AddedToken` objects `{"content": ...}`.
fn special_token(config: &Json, name: &str) -> String {
    match config.get(name) {
        Some(Json::String(s)) => s.clone(),
        Some(Json::Object(o)) => o
            .get("content")
            .and_then(Json::as_str)
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    }
}

fn load_error(path: &Path, message: impl ToString) -> TokenizeError {
    TokenizeError::Load {
        path: path.to_owned(),
        message: message.to_string(),
    }
}

impl ChatTemplate {
    fn load(path: &Path) -> Result<Self, TokenizeError> {
        let text = std::fs::read_to_string(path).map_err(|e| load_error(path, e))?;
        let config: Json = serde_json::from_str(&text).map_err(|e| load_error(path, e))?;
        // Either one template, or named templates of which "default" is the chat one.
        let source = match config.get("chat_template") {
            Some(Json::String(s)) => s.clone(),
            Some(Json::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Json::as_str)
                .ok_or_else(|| load_error(path, "no \"default\" chat template"))?
                .to_owned(),
            _ => return Err(load_error(path, "no chat_template")),
        };
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // Templates call raise_exception() to reject conversations they cannot format.
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned("chat", source)
            .map_err(|e| load_error(path, e))?;
        Ok(ChatTemplate {
            env,
            bos_token: special_token(&config, "bos_token"),
            eos_token: special_token(&config, "eos_token"),
        })
    }

    fn render(&self, body: &Json, messages: Vec<Json>) -> Result<String, TokenizeError> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| TokenizeError::Template(e.to_string()))?;
        let mut ctx = serde_json::Map::new();
        // chat_template_kwargs first, so the fixed fields below win (as in vLLM).
        if let Some(Json::Object(kw)) = body.get("chat_template_kwargs") {
            ctx.extend(kw.clone());
        }
        ctx.insert("messages".into(), Json::Array(messages));
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(
                body.get("add_generation_prompt")
                    .and_then(Json::as_bool)
                    .unwrap_or(true),
            ),
        );
        ctx.insert("bos_token".into(), Json::String(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Json::String(self.eos_token.clone()));
        if let Some(tools) = body.get("tools").filter(|t| !t.is_null()) {
            ctx.insert("tools".into(), tools.clone());
        }
        template
            .render(minijinja::Value::from(minijinja::value::Serde(
                Json::Object(ctx),
            )))
            .map_err(|e| TokenizeError::Template(e.to_string()))
    }
}

/// Chat messages as a template sees them: list-of-parts content flattened to its text parts
/// joined by newlines (vLLM's "string" content format); any other part is unsupported.
fn template_messages(messages: &[Json]) -> Result<Vec<Json>, TokenizeError> {
    messages
        .iter()
        .map(|m| {
            let mut m = m.clone();
            if let Some(Json::Array(parts)) = m.get("content") {
                let mut texts = Vec::with_capacity(parts.len());
                for part in parts {
                    match (
                        part.get("type").and_then(Json::as_str),
                        part.get("text").and_then(Json::as_str),
                    ) {
                        (Some("text"), Some(t)) => texts.push(t),
                        _ => return Err(TokenizeError::Unsupported("non-text message part")),
                    }
                }
                let joined = texts.join("\n");
                if let Some(obj) = m.as_object_mut() {
                    obj.insert("content".into(), Json::String(joined));
                }
            }
            Ok(m)
        })
        .collect()
}

impl TokenMode {
    /// Loads the tokenizer and, if configured, the chat template.
    pub fn load(cfg: &TokenizerConfig) -> Result<Self, TokenizeError> {
        let tokenizer = if cfg.path.as_os_str() == BUILTIN_SIM {
            Encoder::Sim
        } else {
            Encoder::Hf(Box::new(
                tokenizers::Tokenizer::from_file(&cfg.path)
                    .map_err(|e| load_error(&cfg.path, e))?,
            ))
        };
        let template = cfg
            .chat_template_config
            .as_deref()
            .map(ChatTemplate::load)
            .transpose()?;
        Ok(TokenMode {
            tokenizer,
            template,
            block_size: AtomicU32::new(cfg.block_size.unwrap_or(0)),
            block_size_configured: cfg.block_size.is_some(),
            models: cfg.models.clone(),
        })
    }

    /// Whether requests for `model` use token mode.
    pub fn applies_to(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|m| m == model)
    }

    /// Tokens per block, once known.
    pub fn block_size(&self) -> Option<u32> {
        match self.block_size.load(Ordering::Relaxed) {
            0 => None,
            n => Some(n),
        }
    }

    /// An engine reported its block size (events or metrics). A configured size is kept; a
    /// learned one follows the engines. Returns the size now in force when it changed.
    pub fn learn_block_size(&self, block_size: u32) -> Option<u32> {
        if block_size == 0 || self.block_size_configured {
            if self.block_size_configured && self.block_size() != Some(block_size) {
                tracing::warn!(
                    configured = ?self.block_size(),
                    engine = block_size,
                    "engine block size differs from [tokenizer].block_size: keys will not match"
                );
            }
            return None;
        }
        let old = self.block_size.swap(block_size, Ordering::Relaxed);
        (old != block_size).then_some(block_size)
    }

    /// The token ids the engine will see for this request body, as vLLM builds them: chat
    /// messages through the chat template then the tokenizer without added special tokens
    /// (the template has them); a completion prompt through the tokenizer with them; token-id
    /// prompts as they are.
    pub fn request_tokens(&self, body: &[u8]) -> Result<Vec<u32>, TokenizeError> {
        // The shape first, typed and bounded: a token-id prompt goes straight into a capped
        // `Vec<u32>` (a `Json` tree would take ~32 bytes per id). Only a chat is read as a tree,
        // for the template.
        #[derive(serde::Deserialize)]
        struct Shape {
            #[serde(default)]
            messages: Option<Box<serde_json::value::RawValue>>,
            #[serde(default)]
            prompt: Option<crate::core::prompt::Prompt>,
        }
        let shape: Shape = serde_json::from_slice(body)
            .map_err(|_| TokenizeError::Unsupported("body is not JSON"))?;
        if shape.messages.is_some() {
            let body: Json = serde_json::from_slice(body)
                .map_err(|_| TokenizeError::Unsupported("body is not JSON"))?;
            if let Some(Json::Array(messages)) = body.get("messages") {
                let template = self
                    .template
                    .as_ref()
                    .ok_or(TokenizeError::Unsupported("no chat template configured"))?;
                let text = template.render(&body, template_messages(messages)?)?;
                return self.encode(&text, false);
            }
        }
        use crate::core::prompt::Prompt;
        match shape.prompt {
            Some(Prompt::Text(p)) => self.encode(&p, true),
            Some(Prompt::Texts(p)) if p.len() == 1 => self.encode(&p[0], true),
            Some(Prompt::Tokens(ids)) => Ok(ids),
            Some(Prompt::TokenLists(mut lists)) if lists.len() == 1 => Ok(lists.swap_remove(0)),
            Some(_) => Err(TokenizeError::Unsupported("several prompts")),
            None => Err(TokenizeError::Unsupported("no prompt or messages")),
        }
    }

    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        match &self.tokenizer {
            Encoder::Hf(t) => t
                .encode(text, add_special_tokens)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| TokenizeError::Encode(e.to_string())),
            Encoder::Sim => Ok(crate::engine_sim::tokens::tokenize(text)),
        }
    }

    /// Appends the request's block keys to `out` and returns its prompt tokens. `Err` means
    /// the request must use text mode (the reason is for logs and metrics).
    pub fn request_keys(
        &self,
        body: &[u8],
        ns: Namespace,
        out: &mut Vec<BlockKey>,
    ) -> Result<u64, TokenizeError> {
        let block_size = self
            .block_size()
            .ok_or(TokenizeError::Unsupported("block size not known yet"))?;
        let tokens = self.request_tokens(body)?;
        token_block_keys(ns, &tokens, block_size as usize, out);
        Ok(tokens.len() as u64)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A word-level tokenizer over a tiny vocabulary, in the `tokenizer.json` format.
    pub(crate) fn write_test_tokenizer(dir: &Path) -> (PathBuf, PathBuf) {
        let words = [
            "[UNK]",
            "<s>",
            "</s>",
            "<|user|>",
            "<|assistant|>",
            "<|system|>",
            "hello",
            "world",
            "you",
            "are",
            "helpful",
            "the",
            "cat",
            "sat",
            "on",
            "mat",
            ".",
            "a",
        ];
        let vocab: serde_json::Map<String, Json> = words
            .iter()
            .enumerate()
            .map(|(i, w)| (w.to_string(), Json::from(i)))
            .collect();
        let tokenizer = serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [
                {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 3, "content": "<|user|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 4, "content": "<|assistant|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 5, "content": "<|system|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
            ],
            "normalizer": null,
            "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
            },
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
        });
        let tok = dir.join("tokenizer.json");
        std::fs::write(&tok, tokenizer.to_string()).unwrap();
        let config = serde_json::json!({
            "bos_token": {"content": "<s>"},
            "eos_token": "</s>",
            "chat_template": "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'].strip() }} {% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
        });
        let cfg = dir.join("tokenizer_config.json");
        std::fs::write(&cfg, config.to_string()).unwrap();
        (tok, cfg)
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kvmesh-tok-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn mode(name: &str, block_size: Option<u32>) -> TokenMode {
        let dir = temp_dir(name);
        let (path, cfg) = write_test_tokenizer(&dir);
        let m = TokenMode::load(&TokenizerConfig {
            path,
            chat_template_config: Some(cfg),
            block_size,
            models: vec!["m".into()],
        })
        .unwrap();
        // Loaded into memory: the files are not needed any more.
        let _ = std::fs::remove_dir_all(&dir);
        m
    }

    #[test]
    fn chat_goes_through_the_template_then_the_tokenizer() {
        let m = mode("chat", Some(2));
        let body = serde_json::json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "you are helpful"},
                {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}
            ]
        });
        let ids = m.request_tokens(body.to_string().as_bytes()).unwrap();
        // <s> <|system|> you are helpful <|user|> hello world <|assistant|>
        assert_eq!(ids, vec![1, 5, 8, 9, 10, 3, 6, 7, 4]);
        let mut keys = Vec::new();
        let ns = token_namespace(None, None, None);
        let n = m
            .request_keys(body.to_string().as_bytes(), ns, &mut keys)
            .unwrap();
        assert_eq!(n, 9);
        let mut want = Vec::new();
        token_block_keys(ns, &ids, 2, &mut want);
        assert_eq!(keys, want);
        assert_eq!(keys.len(), 4, "only full blocks");
    }

    #[test]
    fn completions_add_special_tokens_and_token_prompts_pass_through() {
        let m = mode("compl", None);
        let ids = m
            .request_tokens(br#"{"model":"m","prompt":"the cat sat"}"#)
            .unwrap();
        assert_eq!(ids, vec![1, 11, 12, 13]);
        assert_eq!(
            m.request_tokens(br#"{"prompt":[7,8,9]}"#).unwrap(),
            vec![7, 8, 9]
        );
        assert!(matches!(
            m.request_tokens(br#"{"prompt":["a","b"]}"#),
            Err(TokenizeError::Unsupported(_))
        ));
        // No block size yet: keys cannot be made.
        assert!(m
            .request_keys(
                b"{\"prompt\":\"a\"}",
                token_namespace(None, None, None),
                &mut Vec::new()
            )
            .is_err());
        assert_eq!(m.learn_block_size(32), Some(32));
        assert_eq!(m.learn_block_size(32), None);
        assert_eq!(m.block_size(), Some(32));
        assert!(m.applies_to("m") && !m.applies_to("other"));
    }

    #[test]
    fn image_parts_and_template_errors_fall_back() {
        let m = mode("img", Some(4));
        let body = br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#;
        assert!(matches!(
            m.request_tokens(body),
            Err(TokenizeError::Unsupported(_))
        ));
        let bad = br#"{"messages":[{"role":"user","content":7}]}"#;
        assert!(matches!(
            m.request_tokens(bad),
            Err(TokenizeError::Template(_))
        ));
    }

    #[test]
    fn missing_files_are_load_errors() {
        let e = TokenMode::load(&TokenizerConfig {
            path: "/nonexistent/tokenizer.json".into(),
            chat_template_config: None,
            block_size: None,
            models: vec![],
        })
        .unwrap_err();
        assert!(matches!(e, TokenizeError::Load { .. }), "{e}");
    }

    #[test]
    fn the_builtin_sim_tokenizer_keys_like_the_simulated_replica() {
        let tm = TokenMode::load(&TokenizerConfig {
            path: BUILTIN_SIM.into(),
            chat_template_config: None,
            block_size: Some(2),
            models: vec![],
        })
        .unwrap();
        let text = "0123456789abcdefXY";
        let body = serde_json::json!({"model": "m", "prompt": text}).to_string();
        let mut got = Vec::new();
        let n = tm
            .request_keys(body.as_bytes(), token_namespace(None, None, None), &mut got)
            .unwrap();
        let ids = crate::engine_sim::tokens::tokenize(text);
        assert_eq!(n, ids.len() as u64);
        let mut want = Vec::new();
        token_block_keys(token_namespace(None, None, None), &ids, 2, &mut want);
        assert_eq!((got.len(), &got), (2, &want));
        // No chat template: chat requests use text mode.
        let chat =
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        assert!(tm.request_tokens(chat.to_string().as_bytes()).is_err());
    }
}
