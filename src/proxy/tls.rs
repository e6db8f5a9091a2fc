//! HTTPS for clients (the operator's `server.tls_cert`, `server.tls_key`), and reloading every
//! certificate a node presents.
//!
//! Exists because certificates are renewed in place (cert-manager rewrites the files every few
//! weeks), and restarting a node to pick them up drops its in-flight requests and its warm state.
//! Two certificates are presented through a `ReloadableCert` (see `mesh::cert_resolver`): the
//! client listener's, and the node's mesh certificate, shared by the QUIC endpoint (both sides),
//! the peer HTTPS listener and the peer client. [`Certificates::reload`] re-reads their files,
//! validates them and swaps each: new handshakes present the new certificate, established
//! connections continue. A certificate that fails validation is never presented: the old one
//! stays in use, with a warning and an error for the caller. With
//! `server.cert_reload_interval_s`, [`watch_files`] also reloads when the files change.
//!
//! Checked before a swap — the client certificate: the chain parses and the key is its key (its
//! names are the operator's business, as at start); the mesh certificate: everything a node
//! checks at start (`NodeIdentity::validated_key`: chains to the CA, carries the cluster SAN,
//! names this node, key matches), against the CA loaded at start. Not reloaded: the CA itself
//! (the verifiers' roots) and the rest of the configuration; a TLS session resumed from before a
//! reload keeps the identity of its first handshake (rustls' 24 h session lifetime).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use prometheus::IntCounterVec;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
use tokio::sync::watch;

use crate::mesh::cert_resolver::{certified_key, fingerprint, ReloadableCert};
use crate::mesh::certs::NodeIdentity;
use crate::node::config::MeshSection;
use crate::shutdown::stopped;

/// A rustls server configuration presenting `cert`: TLS 1.2 and 1.3, ALPN `h2` and `http/1.1`.
pub(super) fn server_config(cert: Arc<ReloadableCert>) -> anyhow::Result<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(cert);
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(cfg)
}

/// The certificate chain and key in PEM files `cert` and `key`, the key checked against the
/// certificate.
fn load_pem_pair(cert: &Path, key: &Path) -> anyhow::Result<CertifiedKey> {
    let chain = CertificateDer::pem_file_iter(cert)
        .with_context(|| format!("cannot read {}", cert.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("bad certificate in {}", cert.display()))?;
    anyhow::ensure!(!chain.is_empty(), "no certificate in {}", cert.display());
    let key_der = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("cannot read a private key from {}", key.display()))?;
    certified_key(chain, key_der).with_context(|| {
        format!(
            "{} and {} do not make a usable certificate and key",
            cert.display(),
            key.display()
        )
    })
}

/// The client listener's certificate and where it is reloaded from.
pub(super) struct ClientCert {
    /// `server.tls_cert`: the PEM chain.
    cert: PathBuf,
    /// `server.tls_key`: the PEM key.
    key: PathBuf,
    /// What the client listener presents.
    live: Arc<ReloadableCert>,
}

impl ClientCert {
    /// Loads `cert` and `key` (the key must be the certificate's).
    pub(super) fn load(cert: &Path, key: &Path) -> anyhow::Result<Self> {
        Ok(ClientCert {
            cert: cert.to_owned(),
            key: key.to_owned(),
            live: ReloadableCert::new(load_pem_pair(cert, key)?),
        })
    }

    /// What the client listener presents (for its configuration).
    pub(super) fn live(&self) -> Arc<ReloadableCert> {
        Arc::clone(&self.live)
    }

    fn reload(&self) -> anyhow::Result<Swap> {
        let key = load_pem_pair(&self.cert, &self.key)?;
        Ok(Swap::of(&self.live, key))
    }
}

/// The node's mesh certificate and where it is reloaded from.
pub(super) struct MeshCert {
    /// Where the files are (`certs_dir`, or `ca` / `cert` / `key`) and the node id the
    /// certificate must name.
    section: MeshSection,
    /// The identity loaded at start: its CA is the one every verifier of this node trusts, so a
    /// new certificate is checked against it, not against whatever the CA file says now.
    started: NodeIdentity,
    /// The node's region: a new certificate must fit it, as the first had to (`verify_region`).
    region: String,
    /// What the QUIC endpoint, the peer listener and the peer client present.
    live: Arc<ReloadableCert>,
}

impl MeshCert {
    /// Loads the mesh identity of `section` and validates it as the node's, in `region`.
    pub(super) fn load(section: &MeshSection, region: &str) -> anyhow::Result<Self> {
        let started = section.identity()?;
        let key = started
            .validated_key(&section.node_id)
            .context("mesh certificates")?;
        Ok(MeshCert {
            section: section.clone(),
            started,
            region: region.to_owned(),
            live: ReloadableCert::new(key),
        })
    }

    /// The identity loaded at start (its CA configures the verifiers).
    pub(super) fn identity(&self) -> &NodeIdentity {
        &self.started
    }

    /// What every mesh connection presents (for the QUIC and peer HTTPS configurations).
    pub(super) fn live(&self) -> Arc<ReloadableCert> {
        Arc::clone(&self.live)
    }

    fn reload(&self) -> anyhow::Result<Swap> {
        let fresh = self.section.identity()?;
        if fresh.ca_pem != self.started.ca_pem {
            tracing::warn!("the mesh CA file changed on disk; the CA is not reloaded (restart the node to trust a new CA bundle)");
        }
        let renewed = self.started.with_leaf_of(&fresh);
        // As at start: a certificate binding another region would be refused by every peer.
        renewed.verify_region(&self.region)?;
        let key = renewed.validated_key(&self.section.node_id)?;
        Ok(Swap::of(&self.live, key))
    }
}

/// What one swap did, for the log.
struct Swap {
    /// Fingerprint of the certificate now presented.
    now: String,
    /// Whether it differs from the one presented before.
    changed: bool,
}

impl Swap {
    fn of(live: &ReloadableCert, key: CertifiedKey) -> Swap {
        let print = |k: &CertifiedKey| k.cert.first().map(fingerprint).unwrap_or_default();
        let now = print(&key);
        let old = live.replace(key);
        Swap {
            changed: print(&old) != now,
            now,
        }
    }
}

/// Every certificate a node presents that can be reloaded.
pub(super) struct Certificates {
    /// The client listener's (`server.tls_cert`), when it serves HTTPS.
    pub(super) client: Option<ClientCert>,
    /// The mesh's, when the node runs a mesh.
    pub(super) mesh: Option<MeshCert>,
    /// `kvmesh_cert_reloads_total{result}`.
    pub(super) reloads: IntCounterVec,
}

impl Certificates {
    /// Reloads each certificate from its files, validating before swapping; one that fails
    /// keeps its old certificate (warned) and makes the whole call an error, after the others
    /// were still reloaded. Counted by result.
    pub(super) fn reload(&self) -> anyhow::Result<()> {
        let result = self.reload_each();
        let label = if result.is_ok() { "ok" } else { "error" };
        self.reloads.with_label_values(&[label]).inc();
        result
    }

    /// The certificate and key files reloads read (the CA files aside: they are not reloaded).
    fn files(&self) -> Vec<PathBuf> {
        let mut files = Vec::new();
        if let Some(c) = &self.client {
            files.extend([c.cert.clone(), c.key.clone()]);
        }
        if let Some((cert, key)) = self.mesh.as_ref().and_then(|m| m.section.cert_files()) {
            files.extend([cert, key]);
        }
        files
    }

    fn reload_each(&self) -> anyhow::Result<()> {
        let mut failed = Vec::new();
        let results = [
            ("client", self.client.as_ref().map(ClientCert::reload)),
            ("mesh", self.mesh.as_ref().map(MeshCert::reload)),
        ];
        for (which, result) in results {
            match result {
                None => {}
                Some(Ok(swap)) => tracing::info!(
                    certificate = which,
                    fingerprint = %swap.now,
                    changed = swap.changed,
                    "certificate reloaded"
                ),
                Some(Err(e)) => {
                    tracing::warn!(certificate = which, error = %format!("{e:#}"), "certificate reload refused; the certificate in use stays");
                    failed.push(format!("{which} certificate: {e:#}"));
                }
            }
        }
        if failed.is_empty() {
            Ok(())
        } else {
            anyhow::bail!("certificate reload refused: {}", failed.join("; "))
        }
    }
}

/// What says a file changed: its modification time and size; `None` when it cannot be read
/// (being replaced, or gone).
type Stamp = Option<(SystemTime, u64)>;

fn stamps(files: &[PathBuf]) -> Vec<Stamp> {
    files
        .iter()
        // `metadata` follows symbolic links: a Kubernetes Secret volume swaps a `..data` link,
        // and the target's time is what changes.
        .map(|f| {
            let m = std::fs::metadata(f).ok()?;
            Some((m.modified().ok()?, m.len()))
        })
        .collect()
}

/// `server.cert_reload_interval_s`: every `interval`, reloads `certs` when any of their files
/// changed since the last look, until `stop`. A refused reload (a renewal caught half-written:
/// new certificate, old key) is warned and counted like any other; the next change — the key
/// arriving — triggers another, so nothing is retried while the files stay the same.
pub(super) async fn watch_files(
    certs: Arc<Certificates>,
    interval: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let files = certs.files();
    if files.is_empty() {
        return;
    }
    let mut seen = stamps(&files);
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stopped(&mut stop) => return,
        }
        let now = stamps(&files);
        if now != seen {
            seen = now;
            tracing::info!("certificate files changed; reloading");
            // Warned and counted inside; the error has nowhere else to go.
            let _ = certs.reload();
        }
    }
}
