//! Owner-signed gossip values: every value a node publishes carries its own signature, so a
//! member that relays another member's state cannot change it.
//!
//! chitchat applies a newer version of any node's key from whoever sends it, and the transport
//! proves only the *sender's* id. So each value is an envelope
//! `<scheme: 4 hex><signature: base64url>.<s|w><payload>` whose signature, by the publisher's
//! certificate key, covers (node id, generation, key, version, set or withdrawn, payload): a
//! relay can neither alter a value, move it to another key or node, nor raise its version
//! (which would freeze the owner's later updates, chitchat keeping only newer versions).
//!
//! The key comes with the state: every node publishes its certificate chain under
//! [`KEY_CERT`] (version 1, before anything else), itself signed by that certificate. It is
//! self-authenticating — it must chain to the cluster CA and name the publisher's node id —
//! so a node can check values relayed by others before it ever meets their publisher.
//!
//! **Withdrawals.** chitchat's tombstones carry no value, so nothing could sign them. A signed
//! key is never deleted; it is *withdrawn*: set to a signed `w` envelope for the version
//! chitchat's `delete_after_ttl` then gives it (both under one lock, so no gossip sees the
//! step between), which readers read as absent and chitchat forgets after its grace period.
//! Receivers refuse plain tombstones (see `gossip_guard`).
//!
//! The signing key is the certificate key at start, for the node's generation: a certificate
//! reload changes what TLS presents, not what the gossiped values are signed with (a restart
//! is a new generation, signed with the new key).

use std::fmt::Write as _;
use std::sync::Arc;

use base64::Engine as _;
use chitchat::{ChitchatId, NodeState};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::ClientCertVerifier;
use rustls::sign::{CertifiedKey, Signer};
use rustls::SignatureScheme;

use super::certs::{self, CertError, CertRoles, NodeIdentity};

/// The key under which every node publishes its certificate chain.
pub const KEY_CERT: &str = "cert";
/// Largest `cert` value (a chain of a few certificates, base64, plus the envelope).
pub const MAX_CERT_VALUE_BYTES: usize = 8 * 1024;
/// Largest envelope around a payload: scheme, a signature of up to 512 bytes (RSA-4096)
/// in base64, separator and flag.
pub const MAX_ENVELOPE_BYTES: usize = 4 + 683 + 2;

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::URL_SAFE_NO_PAD;
const CHAIN_B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;
/// Domain separation: these bytes start every signed message.
const CONTEXT: &[u8] = b"kvmesh gossip value v1\0";
/// The schemes a node signs with, in order of preference (its key decides which applies).
const SCHEMES: [SignatureScheme; 5] = [
    SignatureScheme::ECDSA_NISTP256_SHA256,
    SignatureScheme::ED25519,
    SignatureScheme::ECDSA_NISTP384_SHA384,
    SignatureScheme::RSA_PSS_SHA256,
    SignatureScheme::RSA_PKCS1_SHA256,
];

/// Whether a value is published or withdrawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Status {
    /// A live value.
    Set,
    /// A withdrawn key (read as absent).
    Withdrawn,
}

/// Errors signing or checking values.
#[derive(Debug, thiserror::Error)]
pub enum SignError {
    /// The value is not an envelope.
    #[error("not a signed value")]
    Unsigned,
    /// The signature does not match the value and its publisher.
    #[error("bad signature")]
    BadSignature,
    /// The publisher's certificate does not chain to the CA or does not name it.
    #[error("publisher certificate refused: {0}")]
    BadCert(String),
    /// This node's key cannot sign with any supported scheme.
    #[error("the node key signs with none of {SCHEMES:?}")]
    NoScheme,
    /// Certificates could not be read.
    #[error(transparent)]
    Certs(#[from] CertError),
}

/// What one signature covers.
#[derive(Clone, Copy, Debug)]
pub struct Signed<'a> {
    /// The publisher's chitchat node id.
    pub node_id: &'a str,
    /// The publisher's generation.
    pub generation: u64,
    /// The gossip key.
    pub key: &'a str,
    /// The chitchat version the value has.
    pub version: u64,
    /// Set or withdrawn.
    pub status: Status,
    /// The value inside the envelope.
    pub payload: &'a str,
}

impl Signed<'_> {
    /// The bytes signed: length-prefixed fields after [`CONTEXT`].
    fn message(&self) -> Vec<u8> {
        let mut m = Vec::with_capacity(CONTEXT.len() + 40 + self.key.len() + self.payload.len());
        m.extend_from_slice(CONTEXT);
        for part in [self.node_id, self.key] {
            m.extend_from_slice(&(part.len() as u32).to_le_bytes());
            m.extend_from_slice(part.as_bytes());
        }
        m.extend_from_slice(&self.generation.to_le_bytes());
        m.extend_from_slice(&self.version.to_le_bytes());
        m.push(match self.status {
            Status::Set => b's',
            Status::Withdrawn => b'w',
        });
        m.extend_from_slice(self.payload.as_bytes());
        m
    }
}

/// An envelope taken apart (nothing checked yet).
#[derive(Debug)]
pub struct Envelope<'a> {
    /// The signature scheme.
    pub scheme: SignatureScheme,
    /// The signature.
    pub signature: Vec<u8>,
    /// Set or withdrawn.
    pub status: Status,
    /// The payload.
    pub payload: &'a str,
}

impl<'a> Envelope<'a> {
    /// Parses `value`.
    pub fn parse(value: &'a str) -> Result<Self, SignError> {
        let (head, rest) = value.split_once('.').ok_or(SignError::Unsigned)?;
        if head.len() < 5 || head.len() > 4 + 683 || !head.is_char_boundary(4) {
            return Err(SignError::Unsigned);
        }
        let scheme = u16::from_str_radix(&head[..4], 16).map_err(|_| SignError::Unsigned)?;
        let signature = B64.decode(&head[4..]).map_err(|_| SignError::Unsigned)?;
        let status = match rest.as_bytes().first() {
            Some(b's') => Status::Set,
            Some(b'w') => Status::Withdrawn,
            _ => return Err(SignError::Unsigned),
        };
        Ok(Envelope {
            scheme: SignatureScheme::from(scheme),
            signature,
            status,
            payload: &rest[1..],
        })
    }
}

/// The payload of a live value, `None` for a withdrawn or unsigned one: what readers decode.
/// (Values reach readers only after the transport checked them; see `gossip_guard`.)
pub fn payload(value: &str) -> Option<&str> {
    let (_, rest) = value.split_once('.')?;
    rest.strip_prefix('s')
}

/// This node's signing side: its key and the `cert` value it publishes.
pub struct LocalSigner {
    signer: Box<dyn Signer>,
    chain: String,
}

impl std::fmt::Debug for LocalSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalSigner")
            .field("scheme", &self.signer.scheme())
            .finish_non_exhaustive()
    }
}

impl LocalSigner {
    /// The signer of `key` (its certificate chain and key).
    pub fn new(key: &CertifiedKey) -> Result<Arc<Self>, SignError> {
        let signer = key.key.choose_scheme(&SCHEMES).ok_or(SignError::NoScheme)?;
        let chain = key
            .cert
            .iter()
            .map(|c| CHAIN_B64.encode(c.as_ref()))
            .collect::<Vec<_>>()
            .join(",");
        Ok(Arc::new(LocalSigner { signer, chain }))
    }

    /// The envelope of `what`.
    pub fn seal(&self, what: &Signed<'_>) -> String {
        // ring's signers fail only on a broken key, which `validated_key` has ruled out; an
        // empty signature would then be refused by every peer, never taken for a valid one.
        let sig = self.signer.sign(&what.message()).unwrap_or_default();
        let mut out = String::with_capacity(8 + sig.len() * 4 / 3 + what.payload.len());
        let _ = write!(out, "{:04x}", u16::from(self.signer.scheme()));
        B64.encode_string(&sig, &mut out);
        out.push('.');
        out.push(match what.status {
            Status::Set => 's',
            Status::Withdrawn => 'w',
        });
        out.push_str(what.payload);
        out
    }

    /// The initial `cert` value of node `id` (version 1: chitchat numbers initial values from 1).
    pub fn cert_value(&self, id: &ChitchatId) -> String {
        self.seal(&Signed {
            node_id: &id.node_id,
            generation: id.generation_id,
            key: KEY_CERT,
            version: 1,
            status: Status::Set,
            payload: &self.chain,
        })
    }

    /// A node's first values in a cluster: its certificate (version 1), then its node record
    /// `node` (version 2), both signed, for chitchat id `id`.
    pub fn initial_values(&self, id: &ChitchatId, node: &str) -> Vec<(String, String)> {
        let node_signed = self.seal(&Signed {
            node_id: &id.node_id,
            generation: id.generation_id,
            key: super::schema::KEY_NODE,
            version: 2,
            status: Status::Set,
            payload: node,
        });
        vec![
            (KEY_CERT.to_owned(), self.cert_value(id)),
            (super::schema::KEY_NODE.to_owned(), node_signed),
        ]
    }

    /// Publishes `payload` under `key` in this node's own `state` (chitchat id `id`), signed
    /// for the version chitchat gives it. Nothing changes when the live payload is the same.
    pub fn publish(&self, state: &mut NodeState, id: &ChitchatId, key: &str, payload: &str) {
        if let Some(v) = state.get_versioned(key) {
            if !v.is_deleted()
                && matches!(v.status, chitchat::DeletionStatus::Set)
                && super::signed::payload(&v.value) == Some(payload)
            {
                return;
            }
        }
        let version = state.max_version() + 1;
        let value = self.seal(&Signed {
            node_id: &id.node_id,
            generation: id.generation_id,
            key,
            version,
            status: Status::Set,
            payload,
        });
        state.set(key, value);
    }

    /// Withdraws `key` from this node's own `state` (see the module doc); nothing when it is
    /// absent or already withdrawn.
    pub fn withdraw(&self, state: &mut NodeState, id: &ChitchatId, key: &str) {
        match state.get_versioned(key) {
            Some(v) if matches!(v.status, chitchat::DeletionStatus::Set) => {}
            _ => return,
        }
        // `set` takes max + 1, `delete_after_ttl` max + 2 and keeps the value.
        let version = state.max_version() + 2;
        let value = self.seal(&Signed {
            node_id: &id.node_id,
            generation: id.generation_id,
            key,
            version,
            status: Status::Withdrawn,
            payload: "",
        });
        state.set(key, value);
        state.delete_after_ttl(key);
    }
}

/// A publisher's checked certificate: the key its values are verified with, and what it may
/// publish.
#[derive(Debug)]
pub struct PeerCert {
    leaf: CertificateDer<'static>,
    /// Its region and operator role.
    pub roles: CertRoles,
}

/// Checks publishers' certificates against the cluster CA and their values' signatures.
pub struct CertCheck {
    verifier: Arc<dyn ClientCertVerifier>,
    algs: WebPkiSupportedAlgorithms,
}

impl std::fmt::Debug for CertCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertCheck").finish_non_exhaustive()
    }
}

impl CertCheck {
    /// Trusting `id`'s CA.
    pub fn new(id: &NodeIdentity) -> Result<Self, SignError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let algs = provider.signature_verification_algorithms;
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(id.roots()?),
            provider,
        )
        .build()
        .map_err(|e| SignError::BadCert(e.to_string()))?;
        Ok(CertCheck { verifier, algs })
    }

    /// The certificate in `chain` (a `cert` payload: base64 DER, comma-separated, leaf first)
    /// when it chains to the CA and names `node_id`.
    pub fn check_cert(&self, node_id: &str, chain: &str) -> Result<PeerCert, SignError> {
        let mut ders = Vec::new();
        for part in chain.split(',').take(4) {
            let der = CHAIN_B64
                .decode(part)
                .map_err(|e| SignError::BadCert(e.to_string()))?;
            ders.push(CertificateDer::from(der));
        }
        let Some((leaf, rest)) = ders.split_first() else {
            return Err(SignError::BadCert("no certificate".into()));
        };
        self.verifier
            .verify_client_cert(leaf, rest, UnixTime::now())
            .map_err(|e| SignError::BadCert(e.to_string()))?;
        if !certs::node_names(leaf).iter().any(|n| n == node_id) {
            return Err(SignError::BadCert(format!(
                "the certificate does not name {node_id:?}"
            )));
        }
        Ok(PeerCert {
            roles: certs::cert_roles(leaf),
            leaf: leaf.clone().into_owned(),
        })
    }

    /// Whether `env` is `cert`'s signature over `what`.
    pub fn verify(&self, cert: &PeerCert, what: &Signed<'_>, env: &Envelope<'_>) -> bool {
        let Ok(ee) = webpki::EndEntityCert::try_from(&cert.leaf) else {
            return false;
        };
        let Some((_, algs)) = self.algs.mapping.iter().find(|(s, _)| *s == env.scheme) else {
            return false;
        };
        let message = what.message();
        algs.iter()
            .any(|alg| ee.verify_signature(*alg, &message, &env.signature).is_ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::certs::ClusterCa;

    fn signer(ca: &ClusterCa, name: &str) -> Arc<LocalSigner> {
        LocalSigner::new(&ca.issue(name).unwrap().certified_key().unwrap()).unwrap()
    }

    fn what<'a>(payload: &'a str, version: u64) -> Signed<'a> {
        Signed {
            node_id: "n1",
            generation: 7,
            key: "node",
            version,
            status: Status::Set,
            payload,
        }
    }

    #[test]
    fn a_value_verifies_only_as_signed() {
        let ca = ClusterCa::generate().unwrap();
        let id = ca.issue("n1").unwrap();
        let local = LocalSigner::new(&id.certified_key().unwrap()).unwrap();
        let check = CertCheck::new(&id).unwrap();
        let cert = check.check_cert("n1", &local.chain).unwrap();
        let value = local.seal(&what("abc", 3));
        let env = Envelope::parse(&value).unwrap();
        assert_eq!(payload(&value), Some("abc"));
        assert!(check.verify(&cert, &what("abc", 3), &env));
        // Another version, payload, key or generation: refused.
        assert!(!check.verify(&cert, &what("abc", 4), &env));
        assert!(!check.verify(&cert, &what("abd", 3), &env));
        assert!(!check.verify(
            &cert,
            &Signed {
                key: "hot",
                ..what("abc", 3)
            },
            &env
        ));
        assert!(!check.verify(
            &cert,
            &Signed {
                generation: 8,
                ..what("abc", 3)
            },
            &env
        ));
        // Another node's key: refused; its certificate does not name n1.
        let other = signer(&ca, "n2");
        let forged = other.seal(&what("abc", 3));
        assert!(!check.verify(&cert, &what("abc", 3), &Envelope::parse(&forged).unwrap()));
        assert!(check.check_cert("n1", &other.chain).is_err());
        // A certificate of another CA: refused.
        let rogue = signer(&ClusterCa::generate().unwrap(), "n1");
        assert!(check.check_cert("n1", &rogue.chain).is_err());
    }

    #[test]
    fn withdrawn_and_unsigned_values_read_as_absent() {
        let ca = ClusterCa::generate().unwrap();
        let local = signer(&ca, "n1");
        let w = local.seal(&Signed {
            status: Status::Withdrawn,
            ..what("", 3)
        });
        assert_eq!(payload(&w), None);
        assert_eq!(Envelope::parse(&w).unwrap().status, Status::Withdrawn);
        assert_eq!(payload("plain"), None);
        assert!(Envelope::parse("plain").is_err());
        assert!(Envelope::parse("zzzz.sx").is_err());
    }

    #[test]
    fn publish_and_withdraw_sign_the_versions_chitchat_gives() {
        let ca = ClusterCa::generate().unwrap();
        let id = ca.issue("n1").unwrap();
        let local = LocalSigner::new(&id.certified_key().unwrap()).unwrap();
        let check = CertCheck::new(&id).unwrap();
        let cert = check.check_cert("n1", &local.chain).unwrap();
        let me = ChitchatId::new("n1".to_owned(), 7, "127.0.0.1:1".parse().unwrap());
        let mut state = NodeState::for_test();
        local.publish(&mut state, &me, "k", "v1");
        local.publish(&mut state, &me, "k", "v1");
        local.publish(&mut state, &me, "j", "x");
        local.withdraw(&mut state, &me, "k");
        local.withdraw(&mut state, &me, "k");
        let mut seen = Vec::new();
        for (key, v) in state.key_values_including_deleted() {
            let env = Envelope::parse(&v.value).unwrap();
            let signed = Signed {
                node_id: "n1",
                generation: 7,
                key,
                version: v.version,
                status: env.status,
                payload: env.payload,
            };
            assert!(check.verify(&cert, &signed, &env), "{key} v{}", v.version);
            seen.push((key.to_owned(), v.version, env.status));
        }
        seen.sort();
        assert_eq!(
            seen,
            vec![
                ("j".into(), 2, Status::Set),
                ("k".into(), 4, Status::Withdrawn)
            ]
        );
    }
}
