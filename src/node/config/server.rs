//! The `[server]` and `[auth]` tables: how the HTTP front treats the clients it cannot trust.
//!
//! Exists so that every read from a client has a size and a time limit and every client-held
//! resource a cap, stated in one place: slow or idle connections are cut, the number of open
//! connections and the bytes of request bodies held at once are bounded, and who a client is
//! (its tenant) and what it may see (admin state, metrics) is decided by secrets the operator
//! gave, never by what a client claims. Secrets come from files or the environment, never from
//! the command line (`ps` shows it).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::error::{invalid, ConfigError};
use crate::core::tenant_salt::{TenantSalts, MAX_SHARED_PROMPTS, MAX_SHARED_PROMPT_BYTES};

/// Environment variable holding the admin token (beats `auth.admin_token_file`).
pub const ADMIN_TOKEN_ENV: &str = "KVMESH_ADMIN_TOKEN";
/// Environment variable holding the metrics token (beats `auth.metrics_token_file`).
pub const METRICS_TOKEN_ENV: &str = "KVMESH_METRICS_TOKEN";
/// Environment variable holding the tenant-salt secret (beats `auth.tenant_salt_secret_file`).
pub const TENANT_SALT_SECRET_ENV: &str = "KVMESH_TENANT_SALT_SECRET";
/// Domain separation of a tenant-salt secret derived from the API keys file.
const DERIVED_SALT_SECRET_LABEL: &[u8] = b"kvmesh tenant-salt secret from api keys v1\0";
/// Longest secret or key file read (a token file is a line; a key file a few thousand lines).
const MAX_SECRET_FILE_BYTES: u64 = 4 << 20;
/// Most API keys one file may hold.
const MAX_API_KEYS: usize = 100_000;
/// Upper bound of every `_ms` limit here: one day.
const MAX_MS: u64 = 86_400_000;

/// `[server]`: limits on client connections and optional HTTPS.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Time a client has to send a whole request head (ms), from its first byte, or from the
    /// connection's start for its first request. Slowloris, and a connection that never sends a
    /// request, are cut after this. Default 10,000.
    pub header_read_timeout_ms: u64,
    /// The longest a keep-alive connection is kept idle between requests (ms), at least
    /// `header_read_timeout_ms`. Longer than clients keep idle connections in their pools
    /// (aiohttp 15 s, httpx 5 s, aiperf 300 s, Go 90 s), because a request written on a
    /// connection the server is closing that moment is lost, and a POST is not retried (issue
    /// #38's agentic replay lost one of 219 with a 10 s idle limit). The connection cap still
    /// closes the least recently active first. Default 75,000 (nginx's `keepalive_timeout`).
    pub keep_alive_idle_ms: u64,
    /// Time a client has to send a whole request body (ms). Default 60,000 (32 MiB at 4.5 Mbit/s).
    pub body_read_timeout_ms: u64,
    /// Open client connections at most; at the cap the least recently active one is closed
    /// (after its request in flight, if any) to admit a new one. Also bounded by the process's
    /// open-files limit, raised to its hard maximum at start. Default 8,192.
    pub max_connections: usize,
    /// Bytes of request bodies held at once, across requests, reserved as they arrive (never as
    /// declared); a body that would exceed it waits up to `body_read_timeout_ms`, then gets 503.
    /// The first `body_fair_share_bytes` of each body come from a separate quarter of this on
    /// top, so small requests never queue behind big ones. Default 512 MiB.
    pub max_buffered_body_bytes: u64,
    /// The part of each body taken from the fair-share quarter (see `max_buffered_body_bytes`).
    /// Default 1 MiB.
    pub body_fair_share_bytes: u64,
    /// After the first 2 s of a body, it must have arrived at this average rate at least (bytes
    /// per second), else 408: a client cannot hold budget by trickling. 0 turns it off.
    /// Default 32,768.
    pub min_body_bytes_per_s: u64,
    /// Concurrent streams per HTTP/2 connection (h2c prior knowledge and HTTPS ALPN `h2`).
    /// Default 256.
    pub http2_max_streams: u32,
    /// PEM certificate chain for HTTPS on `listen`; with `tls_key`. Default none (plain HTTP).
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for HTTPS on `listen`. Default none.
    pub tls_key: Option<PathBuf>,
    /// Every this many seconds, check whether the certificate and key files (`tls_cert` /
    /// `tls_key`, and the mesh's node certificate and key) changed (modification time, size)
    /// and reload them if so, as `RunningNode::reload_certificates` does. Default 0: off
    /// (reload on SIGHUP only).
    pub cert_reload_interval_s: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            header_read_timeout_ms: 10_000,
            keep_alive_idle_ms: 75_000,
            body_read_timeout_ms: 60_000,
            max_connections: 8_192,
            max_buffered_body_bytes: 512 << 20,
            body_fair_share_bytes: 1 << 20,
            min_body_bytes_per_s: 32 << 10,
            http2_max_streams: 256,
            tls_cert: None,
            tls_key: None,
            cert_reload_interval_s: 0,
        }
    }
}

impl ServerConfig {
    /// Checks every value, naming the key at fault.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (key, v) in [
            ("server.header_read_timeout_ms", self.header_read_timeout_ms),
            ("server.body_read_timeout_ms", self.body_read_timeout_ms),
        ] {
            if v == 0 || v > MAX_MS {
                return Err(invalid(key, format!("must be 1..={MAX_MS}, got {v}")));
            }
        }
        if !(self.header_read_timeout_ms..=MAX_MS).contains(&self.keep_alive_idle_ms) {
            return Err(invalid(
                "server.keep_alive_idle_ms",
                format!(
                    "must be server.header_read_timeout_ms ({})..={MAX_MS}, got {}",
                    self.header_read_timeout_ms, self.keep_alive_idle_ms
                ),
            ));
        }
        if !(1..=1_000_000).contains(&self.max_connections) {
            return Err(invalid("server.max_connections", "must be 1..=1000000"));
        }
        if self.max_buffered_body_bytes < 1 << 20 {
            return Err(invalid("server.max_buffered_body_bytes", "at least 1 MiB"));
        }
        if !(1024..=self.max_buffered_body_bytes / 4).contains(&self.body_fair_share_bytes) {
            return Err(invalid(
                "server.body_fair_share_bytes",
                "must be 1 KiB..=max_buffered_body_bytes / 4",
            ));
        }
        if self.min_body_bytes_per_s > 1 << 30 {
            return Err(invalid("server.min_body_bytes_per_s", "at most 1 GiB/s"));
        }
        if !(1..=10_000).contains(&self.http2_max_streams) {
            return Err(invalid("server.http2_max_streams", "must be 1..=10000"));
        }
        if self.cert_reload_interval_s > MAX_MS / 1000 {
            return Err(invalid(
                "server.cert_reload_interval_s",
                format!("must be 0 (off) or up to {}", MAX_MS / 1000),
            ));
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err(invalid(
                "server.tls_cert",
                "tls_cert and tls_key go together",
            ));
        }
        Ok(())
    }
}

/// `[auth]`: who may call what. Tokens and keys are read from files (or the environment) when
/// the node starts.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// File holding the bearer token `/admin/*` requires (first line). `KVMESH_ADMIN_TOKEN`
    /// beats it; the top-level `admin_token` is the last resort. Without any, the admin API is
    /// open only while `listen` is a loopback address: a node listening elsewhere refuses to
    /// start unless `admin_open = true`. Default none.
    pub admin_token_file: Option<PathBuf>,
    /// Serve `/admin/*` without a token on a non-loopback `listen` (trusted networks only).
    /// Default false.
    pub admin_open: bool,
    /// File holding the bearer token `/metrics` requires (`KVMESH_METRICS_TOKEN` beats it).
    /// Default none: `/metrics` is open.
    pub metrics_token_file: Option<PathBuf>,
    /// File of API keys, one `<tenant> <key>` per line (`#` starts a comment). With it every
    /// completion needs `Authorization: Bearer <key>`; the key decides the tenant (the tenant
    /// header is ignored) and is not passed to replicas. Default none: no keys, the tenant
    /// header names the tenant.
    pub api_keys_file: Option<PathBuf>,
    /// File holding a bearer token sent to replicas when API keys are on (their own
    /// `--api-key`). Default none.
    pub replica_token_file: Option<PathBuf>,
    /// With API keys: set every completions and chat request's `cache_salt` from its tenant
    /// (`core::tenant_salt`), overriding the client's, so tenants never share an engine cache
    /// entry. Default true.
    pub tenant_salts: bool,
    /// File holding the secret tenant salts are keyed with (first line, ≥ 16 bytes);
    /// `KVMESH_TENANT_SALT_SECRET` beats it. Every node of a mesh should share it (a tenant's
    /// cache then follows it across nodes). Default none: derived from the API keys file's
    /// contents (nodes with the same file agree; a changed file changes every salt once).
    pub tenant_salt_secret_file: Option<PathBuf>,
    /// System prompts every tenant may share (opt-in, ≤ 16, each 1..=65,536 bytes): a request
    /// whose prompt begins with one gets that prompt's salt, the same for every tenant. The
    /// engine salts from the first block on, so the whole prompt is then shared, the tenant's
    /// own part included. Default none.
    pub shared_system_prompts: Vec<String>,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            admin_token_file: None,
            admin_open: false,
            metrics_token_file: None,
            api_keys_file: None,
            replica_token_file: None,
            tenant_salts: true,
            tenant_salt_secret_file: None,
            shared_system_prompts: Vec::new(),
        }
    }
}

/// Secrets read from the files and environment `[auth]` names, at start.
#[derive(Clone, Default)]
pub struct Secrets {
    /// `/admin/*` bearer token.
    pub admin_token: Option<String>,
    /// `/metrics` bearer token.
    pub metrics_token: Option<String>,
    /// SHA-256 of each API key → its tenant.
    pub api_keys: Option<HashMap<[u8; 32], String>>,
    /// Bearer token for replicas.
    pub replica_token: Option<String>,
    /// The `cache_salt` each tenant's requests get (API keys on and `auth.tenant_salts`).
    pub tenant_salts: Option<TenantSalts>,
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Secrets")
            .field("admin_token", &self.admin_token.as_ref().map(|_| "…"))
            .field("metrics_token", &self.metrics_token.as_ref().map(|_| "…"))
            .field("api_keys", &self.api_keys.as_ref().map(HashMap::len))
            .field("replica_token", &self.replica_token.as_ref().map(|_| "…"))
            .field("tenant_salts", &self.tenant_salts)
            .finish()
    }
}

/// SHA-256 of an API key, the form keys are kept in.
pub fn key_digest(key: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, key);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

fn read_secret_file(key: &str, path: &Path) -> Result<String, ConfigError> {
    use std::io::Read;
    let file = std::fs::File::open(path)
        .map_err(|e| invalid(key, format!("cannot read {}: {e}", path.display())))?;
    let mut text = String::new();
    // One byte more than allowed, to tell a file at the bound from one past it: cut short, its
    // last key would be another key, and the rest would be lost without a word.
    file.take(MAX_SECRET_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| invalid(key, format!("cannot read {}: {e}", path.display())))?;
    if text.len() as u64 > MAX_SECRET_FILE_BYTES {
        return Err(invalid(
            key,
            format!("{} is over {MAX_SECRET_FILE_BYTES} bytes", path.display()),
        ));
    }
    Ok(text)
}

fn token_from(
    key: &str,
    env: Option<&str>,
    file: Option<&Path>,
) -> Result<Option<String>, ConfigError> {
    let raw = match (env.map(std::env::var), file) {
        (Some(Ok(v)), _) => v,
        (_, Some(path)) => read_secret_file(key, path)?,
        _ => return Ok(None),
    };
    let token = raw.lines().next().unwrap_or("").trim().to_owned();
    if token.is_empty() {
        return Err(invalid(key, "the token is empty"));
    }
    Ok(Some(token))
}

impl AuthConfig {
    /// Reads the secrets; `inline_admin` is the top-level `admin_token`, `listen` the HTTP
    /// front's address (a non-loopback one needs an admin token or `admin_open`).
    pub fn load(
        &self,
        inline_admin: Option<&str>,
        listen: SocketAddr,
    ) -> Result<Secrets, ConfigError> {
        let admin_token = token_from(
            "auth.admin_token_file",
            Some(ADMIN_TOKEN_ENV),
            self.admin_token_file.as_deref(),
        )?
        .or_else(|| inline_admin.map(str::to_owned));
        if admin_token.is_none() && !self.admin_open && !listen.ip().is_loopback() {
            return Err(invalid(
                "auth.admin_token_file",
                format!(
                    "the node listens on {listen}, beyond loopback: set an admin token \
                     ({ADMIN_TOKEN_ENV} or auth.admin_token_file) or auth.admin_open = true"
                ),
            ));
        }
        let metrics_token = token_from(
            "auth.metrics_token_file",
            Some(METRICS_TOKEN_ENV),
            self.metrics_token_file.as_deref(),
        )?;
        let replica_token = token_from(
            "auth.replica_token_file",
            None,
            self.replica_token_file.as_deref(),
        )?;
        let (api_keys, tenant_salts) = match &self.api_keys_file {
            None => (None, None),
            Some(path) => {
                let text = read_secret_file("auth.api_keys_file", path)?;
                let keys = parse_api_keys(&text)?;
                let salts = self.tenant_salts_for(&text, &keys)?;
                (Some(keys), salts)
            }
        };
        Ok(Secrets {
            admin_token,
            metrics_token,
            api_keys,
            replica_token,
            tenant_salts,
        })
    }

    /// The tenants' salts, keyed by the configured secret or one derived from the API keys
    /// file's `keys_text` (secret as a whole: a tenant knows its own key only).
    fn tenant_salts_for(
        &self,
        keys_text: &str,
        keys: &HashMap<[u8; 32], String>,
    ) -> Result<Option<TenantSalts>, ConfigError> {
        if !self.tenant_salts {
            return Ok(None);
        }
        let secret = match token_from(
            "auth.tenant_salt_secret_file",
            Some(TENANT_SALT_SECRET_ENV),
            self.tenant_salt_secret_file.as_deref(),
        )? {
            Some(s) if s.len() < 16 => {
                return Err(invalid(
                    "auth.tenant_salt_secret_file",
                    "the secret is shorter than 16 bytes",
                ))
            }
            Some(s) => s.into_bytes(),
            None => {
                let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
                ctx.update(DERIVED_SALT_SECRET_LABEL);
                ctx.update(keys_text.as_bytes());
                ctx.finish().as_ref().to_vec()
            }
        };
        let tenants = keys.values().map(String::as_str);
        Ok(Some(TenantSalts::new(
            &secret,
            tenants,
            &self.shared_system_prompts,
        )))
    }

    /// Checks the shared system prompts' bounds.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let key = "auth.shared_system_prompts";
        if self.shared_system_prompts.len() > MAX_SHARED_PROMPTS {
            return Err(invalid(
                key,
                format!("at most {MAX_SHARED_PROMPTS} prompts"),
            ));
        }
        if self
            .shared_system_prompts
            .iter()
            .any(|p| p.is_empty() || p.len() > MAX_SHARED_PROMPT_BYTES)
        {
            return Err(invalid(
                key,
                format!("each prompt is 1..={MAX_SHARED_PROMPT_BYTES} bytes"),
            ));
        }
        Ok(())
    }
}

/// `<tenant> <key>` lines → key digest → tenant.
fn parse_api_keys(text: &str) -> Result<HashMap<[u8; 32], String>, ConfigError> {
    let key = "auth.api_keys_file";
    let mut out = HashMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut parts = line.split_whitespace();
        let (Some(tenant), Some(api_key), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(invalid(
                key,
                format!("line {}: expected '<tenant> <key>'", n + 1),
            ));
        };
        if tenant.len() > 128 || api_key.len() < 16 || api_key.len() > 512 {
            return Err(invalid(
                key,
                format!(
                    "line {}: a tenant is at most 128 bytes, a key 16..=512",
                    n + 1
                ),
            ));
        }
        if out
            .insert(key_digest(api_key.as_bytes()), tenant.to_owned())
            .is_some()
        {
            return Err(invalid(key, format!("line {}: duplicate key", n + 1)));
        }
        if out.len() > MAX_API_KEYS {
            return Err(invalid(key, format!("more than {MAX_API_KEYS} keys")));
        }
    }
    if out.is_empty() {
        return Err(invalid(key, "no keys in the file"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_file_past_its_bound_is_refused_not_cut_short() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        std::fs::write(&path, vec![b'k'; MAX_SECRET_FILE_BYTES as usize + 1]).unwrap();
        let e = read_secret_file("auth.api_keys_file", &path)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("auth.api_keys_file") && e.contains("over"),
            "{e}"
        );
        std::fs::write(&path, vec![b'k'; MAX_SECRET_FILE_BYTES as usize]).unwrap();
        assert!(read_secret_file("auth.api_keys_file", &path).is_ok());
    }

    #[test]
    fn api_keys_map_to_tenants_and_bad_lines_name_their_number() {
        let keys = parse_api_keys(
            "# keys\nacme sk-acme-0123456789abcdef\n\nbeta sk-beta-0123456789abcdef # x\n",
        )
        .unwrap();
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[&key_digest(b"sk-acme-0123456789abcdef")], "acme");
        let e = parse_api_keys("acme short\n").unwrap_err().to_string();
        assert!(e.contains("line 1"), "{e}");
        let e = parse_api_keys("acme\n").unwrap_err().to_string();
        assert!(e.contains("line 1"), "{e}");
        assert!(parse_api_keys("# nothing\n").is_err());
    }

    #[test]
    fn a_node_beyond_loopback_needs_an_admin_token() {
        let open: SocketAddr = "0.0.0.0:8080".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let auth = AuthConfig::default();
        assert!(auth.load(None, local).is_ok());
        let e = auth.load(None, open).unwrap_err().to_string();
        assert!(e.contains("auth.admin_token_file"), "{e}");
        assert!(auth.load(Some("t0ken"), open).is_ok());
        let auth = AuthConfig {
            admin_open: true,
            ..AuthConfig::default()
        };
        assert!(auth.load(None, open).is_ok());
    }

    #[test]
    fn tokens_come_from_their_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.token");
        std::fs::write(&path, "s3cret\n").unwrap();
        let auth = AuthConfig {
            metrics_token_file: Some(path),
            ..AuthConfig::default()
        };
        let s = auth.load(None, "127.0.0.1:1".parse().unwrap()).unwrap();
        assert_eq!(s.metrics_token.as_deref(), Some("s3cret"));
        let auth = AuthConfig {
            metrics_token_file: Some(dir.path().join("missing")),
            ..AuthConfig::default()
        };
        assert!(auth.load(None, "127.0.0.1:1".parse().unwrap()).is_err());
    }

    #[test]
    fn limits_are_bounded() {
        let mut s = ServerConfig::default();
        assert!(s.validate().is_ok());
        s.header_read_timeout_ms = u64::MAX;
        assert!(s.validate().is_err());
        let s = ServerConfig {
            keep_alive_idle_ms: 9_999,
            ..ServerConfig::default()
        };
        assert!(
            s.validate().is_err(),
            "an idle limit under the head deadline"
        );
        let s = ServerConfig {
            tls_cert: Some("a.pem".into()),
            ..ServerConfig::default()
        };
        assert!(s.validate().is_err());
        let s = ServerConfig {
            cert_reload_interval_s: 86_401,
            ..ServerConfig::default()
        };
        assert!(s.validate().is_err());
    }
}
