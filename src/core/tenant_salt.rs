//! Router-derived cache salts: with API keys, the engine's `cache_salt` comes from the
//! authenticated tenant, not from the client.
//!
//! Exists because an engine's prefix cache is partitioned only by `cache_salt`, which a client
//! chooses (and can forge: a client that sends another tenant's salt, or none, probes the shared
//! cache by timing). The node knows the tenant from its API key, so it salts every completions
//! and chat request with `HMAC-SHA256(secret, tenant)`: tenants cannot guess each other's salt
//! from their names, and every node with the same secret gives a tenant the same salt (its cache
//! follows it across nodes).
//!
//! vLLM adds the salt to the extra keys of the block starting at token 0 only, and every later
//! block chains from it: two requests with different salts share *no* block. So a system prompt
//! every tenant may share can only be shared by giving those requests one salt: a request whose
//! prompt begins with one of the operator's `shared_system_prompts` gets that prompt's shared
//! salt (the same for every tenant) — its whole prompt, the tenant's own part included, is then
//! in the shared partition. Sharing is opt-in for exactly that reason.
//!
//! Sans-IO: built once from the secret; lookups neither allocate (known tenants) nor lock.

use std::borrow::Cow;
use std::collections::HashMap;

use base64::Engine as _;
use ring::hmac;

/// At most this many shared system prompts.
pub const MAX_SHARED_PROMPTS: usize = 16;

/// A shared system prompt is at most this many bytes.
pub const MAX_SHARED_PROMPT_BYTES: usize = 64 * 1024;

/// The routing text's prefix of a chat whose first message is a system message
/// (`core::prompt::begin_message`).
const SYSTEM_MESSAGE_PREFIX: &str = "system\n";

/// Domain separation: a tenant's salt and a shared prompt's never coincide.
const TENANT_LABEL: &[u8] = b"kvmesh tenant cache_salt v1\0";
const SHARED_LABEL: &[u8] = b"kvmesh shared cache_salt v1\0";

/// One system prompt every tenant may share, and its salt.
#[derive(Clone, Debug)]
struct SharedPrompt {
    /// The prompt text a request must begin with.
    text: String,
    /// The salt every tenant's request beginning with it gets.
    salt: String,
}

/// The salts a node sets, by tenant.
#[derive(Clone)]
pub struct TenantSalts {
    /// The HMAC key (from the node-wide secret).
    key: hmac::Key,
    /// Precomputed salts of the tenants the API keys name (no HMAC per request).
    known: HashMap<String, String>,
    /// Shared system prompts, longest first (the longest match wins).
    shared: Vec<SharedPrompt>,
}

impl std::fmt::Debug for TenantSalts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantSalts")
            .field("tenants", &self.known.len())
            .field("shared_prompts", &self.shared.len())
            .finish()
    }
}

impl TenantSalts {
    /// Salts under `secret` for `tenants`, with `shared_prompts` (checked by the config: at most
    /// [`MAX_SHARED_PROMPTS`], each 1..=[`MAX_SHARED_PROMPT_BYTES`] bytes).
    pub fn new<'a>(
        secret: &[u8],
        tenants: impl IntoIterator<Item = &'a str>,
        shared_prompts: &[String],
    ) -> Self {
        let key = hmac::Key::new(hmac::HMAC_SHA256, secret);
        let known = tenants
            .into_iter()
            .map(|t| (t.to_owned(), salt(&key, TENANT_LABEL, t.as_bytes())))
            .collect();
        let mut shared: Vec<SharedPrompt> = shared_prompts
            .iter()
            .filter(|p| !p.is_empty())
            .map(|p| SharedPrompt {
                text: p.clone(),
                salt: salt(&key, SHARED_LABEL, p.as_bytes()),
            })
            .collect();
        shared.sort_by_key(|p| std::cmp::Reverse(p.text.len()));
        TenantSalts { key, known, shared }
    }

    /// `tenant`'s salt (computed here only for a tenant the API keys do not name: one a peer
    /// forwarded).
    pub fn for_tenant(&self, tenant: &str) -> Cow<'_, str> {
        match self.known.get(tenant) {
            Some(s) => Cow::Borrowed(s),
            None => Cow::Owned(salt(&self.key, TENANT_LABEL, tenant.as_bytes())),
        }
    }

    /// Whether shared system prompts are configured (a request's text must then be rendered
    /// to choose its salt).
    pub fn has_shared(&self) -> bool {
        !self.shared.is_empty()
    }

    /// The shared salt of a request whose routing text is `text`: a completions prompt that
    /// begins with a shared prompt, or a chat whose first message is a system message that does.
    pub fn shared_for(&self, text: &str) -> Option<&str> {
        let system = text.strip_prefix(SYSTEM_MESSAGE_PREFIX);
        self.shared
            .iter()
            .find(|p| text.starts_with(&p.text) || system.is_some_and(|s| s.starts_with(&p.text)))
            .map(|p| p.salt.as_str())
    }

    /// The salt a request of `tenant` with routing text `text` gets.
    pub fn salt(&self, tenant: &str, text: Option<&str>) -> Cow<'_, str> {
        match text.and_then(|t| self.shared_for(t)) {
            Some(s) => Cow::Borrowed(s),
            None => self.for_tenant(tenant),
        }
    }
}

/// URL-safe base64 of `HMAC-SHA256(key, label ‖ data)`: 43 characters, 256 bits.
fn salt(key: &hmac::Key, label: &[u8], data: &[u8]) -> String {
    let mut ctx = hmac::Context::with_key(key);
    ctx.update(label);
    ctx.update(data);
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(ctx.sign().as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenants_get_distinct_stable_unguessable_salts() {
        let a = TenantSalts::new(b"secret", ["acme", "globex"], &[]);
        let b = TenantSalts::new(b"secret", ["acme"], &[]);
        assert_ne!(a.for_tenant("acme"), a.for_tenant("globex"));
        // Same secret, same salt on every node, named in the keys or not.
        assert_eq!(a.for_tenant("globex"), b.for_tenant("globex"));
        // Another secret: another salt; the tenant's name is not in it.
        let c = TenantSalts::new(b"other", ["acme"], &[]);
        assert_ne!(a.for_tenant("acme"), c.for_tenant("acme"));
        assert!(!a.for_tenant("acme").contains("acme"));
        assert_eq!(a.for_tenant("acme").len(), 43);
    }

    #[test]
    fn a_shared_system_prompt_gets_one_salt_for_every_tenant() {
        let shared = vec!["You are helpful.".to_owned(), "You".to_owned()];
        let s = TenantSalts::new(b"k", ["acme", "globex"], &shared);
        let chat = "system\nYou are helpful. Be brief.\u{1e}user\nHi\u{1e}";
        let a = s.salt("acme", Some(chat));
        assert_eq!(a, s.salt("globex", Some(chat)));
        assert_ne!(a, s.for_tenant("acme"));
        // The longest shared prompt wins; a completions prompt matches from its start.
        assert_eq!(s.shared_for("You are helpful. Q"), Some(a.as_ref()));
        assert_ne!(s.shared_for("You say"), Some(a.as_ref()));
        // Elsewhere in the prompt, or in a user message, is not a shared system prompt.
        assert_eq!(
            s.salt("acme", Some("user\nYou are helpful.")),
            s.for_tenant("acme")
        );
        assert_eq!(s.salt("acme", None), s.for_tenant("acme"));
    }
}
