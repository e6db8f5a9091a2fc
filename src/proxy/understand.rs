//! The understand stage: what a body asks for, in its API's dialect — the model, the block keys
//! of its prompt, its length, streaming — read once.
//!
//! Exists so that every API's request reaches `decide` as the same thing: keys over the routing
//! text of `core::dialect` (one conversation keys alike whichever API carries it), or, in token
//! mode, over the token ids the engine will see. Load-routed APIs (count_tokens, pooling) have
//! no keys; their length is estimated from the body. The body itself is kept, byte for byte —
//! except that, with API keys, a completions or chat body gets its tenant's `cache_salt`
//! (`core::tenant_salt`, set by `super::cache_salt`), and its keys are built with that salt.

use std::borrow::Cow;
use std::cell::RefCell;
use std::sync::Arc;

use bytes::Bytes;

use super::cache_salt::with_cache_salt;
use super::error::ApiError;
use crate::core::dialect::{Api, Fields};
use crate::core::dialect_chat::chat_body;
use crate::core::hot_prefix::WarmScope;
use crate::core::keys::{text_block_keys, BlockKey, Namespace};
use crate::core::prompt::Prompt;
use crate::core::tenant_salt::TenantSalts;
use crate::node::Node;

thread_local! {
    /// Routing text buffer, reused by every request handled on this thread (rendering is
    /// synchronous, so no request holds it across an await).
    static TEXT: RefCell<String> = RefCell::new(String::with_capacity(16 * 1024));
}

/// Token-mode requests with a body over this many bytes are tokenized on the blocking pool.
const BLOCKING_TOKENIZE_BYTES: usize = 64 * 1024;

/// A request, understood.
pub(crate) struct Understood {
    /// The API it came through.
    pub api: Api,
    /// The path it goes to upstream (the one it came to).
    pub path: &'static str,
    /// The body, as received.
    pub body: Bytes,
    /// Its routing fields.
    pub fields: Fields,
    /// The prompt's block keys (empty for load-routed APIs).
    pub keys: Vec<BlockKey>,
    /// The prompt's length in tokens (estimated in text mode).
    pub prompt_tokens: u64,
}

/// A request whose engine `cache_salt` the node sets: its tenant, and the node's salts.
#[derive(Clone, Copy)]
struct Salting<'a> {
    tenant: &'a str,
    salts: &'a TenantSalts,
}

impl<'a> Salting<'a> {
    /// The salting of a request by `tenant` with `fields`: API keys on (salts built), a
    /// tenant, and an API whose engines read `cache_salt` (completions, chat).
    fn of(node: &'a Node, fields: &Fields, tenant: Option<&'a str>) -> Option<Self> {
        fields.openai()?;
        Some(Salting {
            tenant: tenant?,
            salts: node.secrets.tenant_salts.as_ref()?,
        })
    }

    /// The salt, given the rendered routing text (for shared system prompts).
    fn salt(self, text: Option<&str>) -> Cow<'a, str> {
        self.salts.salt(self.tenant, text)
    }
}

impl Understood {
    /// The model asked for (checked non-empty by [`understand`]).
    pub fn model(&self) -> &str {
        self.fields.model().unwrap_or_default()
    }

    /// Whether the client asked for server-sent events.
    pub fn stream(&self) -> bool {
        self.fields.stream()
    }
}

/// Understands `body`, sent to `path` of `api` by `tenant` (whose isolation keys apart).
pub(crate) async fn understand(
    node: &Arc<Node>,
    api: Api,
    path: &'static str,
    body: Bytes,
    tenant: Option<&str>,
) -> Result<Understood, ApiError> {
    let fields = Fields::parse(api, &body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}"), None))?;
    if fields.model().is_none_or(str::is_empty) {
        return Err(ApiError::bad_request(
            "the request has no 'model'",
            Some("model"),
        ));
    }
    let mut u = Understood {
        api,
        path,
        body,
        fields,
        keys: Vec::new(),
        prompt_tokens: 0,
    };
    if !api.keyed() {
        u.prompt_tokens = u.body.len() as u64 / 4;
        return Ok(u);
    }
    let isolated = tenant.filter(|_| node.tenant_isolated(tenant));
    let salting = Salting::of(node, &u.fields, tenant);
    if node.tokenizer.is_some() {
        let salt = salting.map(|s| token_mode_salt(s, &u.fields));
        if let Some(tokens) = token_keys(node, &mut u, isolated, salt.as_deref()).await? {
            // Token keys: counted as heat, but their text is not the engine's prompt to warm.
            node.observe_hot(u.model(), &u.keys, None, WarmScope::default());
            u.prompt_tokens = tokens;
            set_salt(&mut u, salt.as_deref())?;
            return Ok(u);
        }
    }
    let (tokens, salt) = text_keys(node, &mut u, (tenant, isolated), salting)?;
    u.prompt_tokens = tokens;
    set_salt(&mut u, salt.as_deref())?;
    Ok(u)
}

/// Token mode's salt: the routing text is rendered only when shared system prompts need it.
fn token_mode_salt<'a>(s: Salting<'a>, fields: &Fields) -> Cow<'a, str> {
    if !s.salts.has_shared() {
        return s.salt(None);
    }
    TEXT.with(|text| {
        let mut text = text.borrow_mut();
        let rendered = fields.render(&mut text).is_ok();
        s.salt(rendered.then_some(text.as_str()))
    })
}

/// Sets the body's `cache_salt` to the node's `salt`, if any.
fn set_salt(u: &mut Understood, salt: Option<&str>) -> Result<(), ApiError> {
    if let Some(salt) = salt {
        u.body = with_cache_salt(&u.body, salt)
            .ok_or_else(|| ApiError::bad_request("the body is not a JSON object", None))?;
    }
    Ok(())
}

/// Token mode: keys over the token ids the engine will see, when the node has the model's
/// tokenizer (Messages and Responses through their chat form, `core::dialect_chat`). `None`:
/// text keys instead (counted in `kvmesh_token_mode_fallbacks_total`).
async fn token_keys(
    node: &Arc<Node>,
    u: &mut Understood,
    isolated: Option<&str>,
    node_salt: Option<&str>,
) -> Result<Option<u64>, ApiError> {
    if node.tokenizer.is_none() || !u.api.keyed() {
        return Ok(None);
    }
    // Messages and Responses are rendered as the chat the engine makes of them.
    let converted = match u.api {
        Api::Completions | Api::Chat => None,
        _ => match chat_body(&u.fields).and_then(|b| serde_json::to_vec(&b).ok()) {
            Some(b) => Some(Bytes::from(b)),
            None => {
                node.kv_metrics
                    .token_fallbacks
                    .with_label_values(&["dialect"])
                    .inc();
                return Ok(None);
            }
        },
    };
    let body = converted.unwrap_or_else(|| u.body.clone());
    let (lora, client_salt) = u.fields.lora_and_salt();
    let salt = node_salt.or(client_salt);
    if body.len() <= BLOCKING_TOKENIZE_BYTES {
        let model = u.fields.model().unwrap_or_default();
        return Ok(node.token_keys(&body, model, lora, salt, isolated, &mut u.keys));
    }
    // Tokenizing a long prompt takes milliseconds to seconds: not on an async worker.
    let owned = |s: Option<&str>| s.map(str::to_owned);
    let (n, m) = (Arc::clone(node), u.model().to_owned());
    let (lora, salt, iso) = (owned(lora), owned(salt), owned(isolated));
    let mut k = std::mem::take(&mut u.keys);
    let (tokens, k) = tokio::task::spawn_blocking(move || {
        let t = n.token_keys(
            &body,
            &m,
            lora.as_deref(),
            salt.as_deref(),
            iso.as_deref(),
            &mut k,
        );
        (t, k)
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))?;
    u.keys = k;
    Ok(tokens)
}

/// Text mode: keys over the routing text; returns the prompt's estimated tokens and the salt
/// the node sets (with `salting`).
fn text_keys<'a>(
    node: &Node,
    u: &mut Understood,
    (tenant, isolated): (Option<&str>, Option<&str>),
    salting: Option<Salting<'a>>,
) -> Result<(u64, Option<Cow<'a, str>>), ApiError> {
    let (lora, client_salt) = u.fields.lora_and_salt();
    let model = u.fields.model().unwrap_or_default();
    TEXT.with(|text| {
        let mut text = text.borrow_mut();
        let rendered = u.fields.render(&mut text);
        let node_salt = salting.map(|s| s.salt(rendered.is_ok().then_some(text.as_str())));
        if rendered.is_ok() {
            let salt = node_salt.as_deref().or(client_salt);
            let ns = Namespace::new(model, lora, salt, isolated);
            text_block_keys(ns, text.as_bytes(), node.cfg.block_bytes, &mut u.keys);
            // A completions prompt given as one string is the engine's prompt, byte for byte:
            // a warm-up can reproduce it. Templated and token prompts cannot.
            let exact = u.api == Api::Completions
                && u.fields.openai().is_some_and(|f| {
                    f.messages.is_none() && matches!(f.prompt, Some(Prompt::Text(_)))
                });
            // A warm-up of it keeps its engine-cache partition and tenant.
            let scope = WarmScope {
                lora,
                cache_salt: salt,
                tenant,
            };
            node.observe_hot(model, &u.keys, exact.then_some(text.as_str()), scope);
        }
        let tokens = text.len() as u64 / 4;
        // A huge prompt should not pin its buffer on this thread forever.
        if text.capacity() > 1 << 20 {
            *text = String::with_capacity(16 * 1024);
        }
        rendered
            .map(|()| (tokens, node_salt))
            .map_err(|e| ApiError::bad_request(e.to_string(), None))
    })
}
