//! A certificate that can be replaced under running TLS configurations: rotation without a
//! restart.
//!
//! Exists because cert-manager (or any PKI) renews certificate files in place every few weeks,
//! and a `rustls` configuration built with `with_single_cert` keeps the certificate it was built
//! with until the process exits. rustls asks a *resolver* for the certificate at every handshake
//! instead, so every configuration a node builds — the client HTTPS listener, both sides of the
//! mesh's QUIC endpoint, the peer HTTPS listener and the peer client — resolves through a
//! [`ReloadableCert`]. Replacing its content makes each *new* handshake present the new
//! certificate; connections already established keep the keys they negotiated and continue.
//!
//! This file only holds and swaps: deciding whether a new certificate is acceptable is the
//! caller's job (the mesh's checks are `certs::NodeIdentity::validated_key`), because what makes
//! one acceptable differs between the client listener and the mesh. [`certified_key`] is the
//! check common to both: the key parses and belongs to the certificate.

use std::sync::{Arc, RwLock};

use rustls::client::ResolvesClientCert;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::SignatureScheme;

/// A certificate chain and key that every TLS configuration holding this resolver presents, and
/// that [`ReloadableCert::replace`] swaps for new handshakes.
pub struct ReloadableCert {
    /// What the next handshake presents. A lock rather than a lock-free cell: it is read once
    /// per handshake (next to a signature, far more costly) and written once per rotation.
    current: RwLock<Arc<CertifiedKey>>,
}

impl std::fmt::Debug for ReloadableCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The chain is public, but a log line has no use for kilobytes of DER.
        f.debug_struct("ReloadableCert").finish_non_exhaustive()
    }
}

impl ReloadableCert {
    /// A resolver presenting `key` until it is replaced.
    pub fn new(key: CertifiedKey) -> Arc<Self> {
        Arc::new(ReloadableCert {
            current: RwLock::new(Arc::new(key)),
        })
    }

    /// The certificate and key new handshakes present now.
    pub fn current(&self) -> Arc<CertifiedKey> {
        // A poisoned lock still holds a whole `Arc` (the write is one assignment).
        Arc::clone(&self.current.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// The end-entity certificate new handshakes present now.
    pub fn end_entity(&self) -> Option<CertificateDer<'static>> {
        self.current().cert.first().cloned()
    }

    /// Makes new handshakes present `key` (already validated by the caller); returns the one it
    /// replaces. Established connections are not touched.
    pub fn replace(&self, key: CertifiedKey) -> Arc<CertifiedKey> {
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        std::mem::replace(&mut *current, Arc::new(key))
    }
}

impl ResolvesServerCert for ReloadableCert {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

impl ResolvesClientCert for ReloadableCert {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// A chain (leaf first) and its private key as rustls presents them, with the ring provider:
/// refused when the chain is empty, the key does not parse, or the key is not the leaf's (a
/// half-written rotation — new certificate, old key — must never be presented).
pub fn certified_key(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<CertifiedKey, rustls::Error> {
    if chain.is_empty() {
        return Err(rustls::Error::NoCertificatesPresented);
    }
    let provider = rustls::crypto::ring::default_provider();
    let signing = provider.key_provider.load_private_key(key)?;
    let key = CertifiedKey::new(chain, signing);
    // Strict, unlike `with_single_cert`, which lets a key that cannot tell its public half
    // through: every key type ring loads can, so "unknown" here means something is wrong.
    key.keys_match()?;
    Ok(key)
}

/// The SHA-256 fingerprint of a certificate in lower-case hex, as `openssl x509 -fingerprint
/// -sha256` prints it (without colons): how logs say which certificate is in use.
pub fn fingerprint(cert: &CertificateDer<'_>) -> String {
    use std::fmt::Write;
    let digest = ring::digest::digest(&ring::digest::SHA256, cert.as_ref());
    let mut hex = String::with_capacity(64);
    for b in digest.as_ref() {
        let _ = write!(hex, "{b:02x}");
    }
    hex
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{CertificateParams, KeyPair};

    fn self_signed(name: &str) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let der = rustls::pki_types::PrivatePkcs8KeyDer::from(key.serialize_der()).into();
        (vec![cert.der().clone()], der)
    }

    #[test]
    fn replace_changes_what_both_sides_resolve_and_mismatched_keys_are_refused() {
        let (a_chain, a_key) = self_signed("a.example");
        let (b_chain, b_key) = self_signed("b.example");
        let cert = ReloadableCert::new(certified_key(a_chain.clone(), a_key).unwrap());
        assert_eq!(cert.end_entity().as_ref(), a_chain.first());
        let old = cert.replace(certified_key(b_chain.clone(), b_key).unwrap());
        assert_eq!(old.cert, a_chain);
        let client_side = ResolvesClientCert::resolve(cert.as_ref(), &[], &[]).unwrap();
        assert_eq!(client_side.cert, b_chain);
        assert!(ResolvesClientCert::has_certs(cert.as_ref()));
        // A's certificate with B's key: refused.
        let (_, other_key) = self_signed("c.example");
        assert!(matches!(
            certified_key(a_chain.clone(), other_key),
            Err(rustls::Error::InconsistentKeys(_))
        ));
        let (_, key) = self_signed("d.example");
        assert!(certified_key(Vec::new(), key).is_err());
        let print = fingerprint(&b_chain[0]);
        assert_eq!(print.len(), 64);
        assert_ne!(print, fingerprint(&a_chain[0]));
    }
}
