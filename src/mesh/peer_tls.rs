//! TLS for node-to-node HTTP: forwarded requests travel inside the cluster's mutual TLS.
//!
//! Exists because a request forwarded to another region carries the prompt and the client's
//! headers; it must be as private as gossip, and the receiving node must know it came from a
//! member (only then does it honour the hop header). The server side requires a client
//! certificate from the cluster CA; the client side presents this node's certificate and checks
//! the server's against the CA and [`CLUSTER_SAN`] whatever address it dialled (peers are known
//! by address, like chitchat's). TLS 1.3 only, ALPN `h2` and `http/1.1`.
//!
//! Which member a forward reaches is checked in the handshake, before any byte of the request
//! goes: a forward's client ([`forward_client_config`], one per node and region a record
//! names) accepts only a certificate that names that node and, if it binds a region, the
//! region the record put it in. A record pointing at another node's address (a redirected
//! forward), or naming as another region's node a member whose certificate binds its own
//! region, gets no connection. The answer's certificate is checked again ([`names_node`]).

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{DigitallySignedStruct, SignatureScheme};

use super::cert_resolver::ReloadableCert;
use super::certs::{cert_roles, CertError, NodeIdentity, CLUSTER_SAN};

/// rustls configurations for the peer HTTPS listener and the client that forwards to peers,
/// presenting `id`'s certificate through a resolver of their own (see [`https_configs_with`]).
pub fn https_configs(
    id: &NodeIdentity,
) -> Result<(rustls::ServerConfig, rustls::ClientConfig), CertError> {
    https_configs_with(id, ReloadableCert::new(id.certified_key()?))
}

/// [`https_configs`] presenting `cert` on both sides — the node shares the one its QUIC
/// endpoint presents, so one reload rotates every mesh connection. Only the CA is taken from
/// `id`.
pub fn https_configs_with(
    id: &NodeIdentity,
    cert: Arc<ReloadableCert>,
) -> Result<(rustls::ServerConfig, rustls::ClientConfig), CertError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let roots = Arc::new(id.roots()?);
    let client_verifier =
        WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| CertError::Verifier(e.to_string()))?;
    let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(client_verifier)
        .with_cert_resolver(cert.clone());
    server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let client = client_config(roots, provider, cert, None)?;
    Ok((server, client))
}

/// The client side of forwards to node `node_id`, which a record puts in `region`: as
/// [`https_configs_with`]'s, and the server's certificate must name `node_id` and bind no
/// other region (see the module doc).
pub fn forward_client_config(
    id: &NodeIdentity,
    cert: Arc<ReloadableCert>,
    node_id: &str,
    region: &str,
) -> Result<rustls::ClientConfig, CertError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let target = Target {
        node_id: node_id.to_owned(),
        region: region.to_owned(),
    };
    client_config(Arc::new(id.roots()?), provider, cert, Some(target))
}

/// A client config trusting `roots` for [`CLUSTER_SAN`] (and `target`, when given), presenting
/// `cert`, TLS 1.3, ALPN `h2` and `http/1.1`.
fn client_config(
    roots: Arc<rustls::RootCertStore>,
    provider: Arc<rustls::crypto::CryptoProvider>,
    cert: Arc<ReloadableCert>,
    target: Option<Target>,
) -> Result<rustls::ClientConfig, CertError> {
    let inner = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
        .build()
        .map_err(|e| CertError::Verifier(e.to_string()))?;
    let mut client = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(ClusterNameVerifier { inner, target }))
        .with_client_cert_resolver(cert);
    client.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(client)
}

/// How a forward's handshake refuses a certificate of another node than the one meant (part of
/// the TLS error a forward sees: `proxy/region_forward.rs` counts it `misdirected`).
pub const NOT_THE_NODE_MEANT: &str = "the peer is not the node meant";

/// The node a forward's connection must reach.
#[derive(Debug)]
struct Target {
    node_id: String,
    region: String,
}

/// Whether the DER leaf certificate a peer presented (`reqwest`'s `TlsInfo`) names `node_id`
/// (see `certs::node_names`): the node a forward reached is the node it meant.
pub fn names_node(leaf_der: Option<&[u8]>, node_id: &str) -> bool {
    leaf_der.is_some_and(|der| {
        super::certs::node_names(&CertificateDer::from(der))
            .iter()
            .any(|n| n == node_id)
    })
}

/// Verifies a peer's certificate chain against the cluster CA for [`CLUSTER_SAN`], not for the
/// address dialled (node certificates name the cluster, not their addresses); with a `target`,
/// also that it names that node and binds no other region.
#[derive(Debug)]
struct ClusterNameVerifier {
    inner: Arc<WebPkiServerVerifier>,
    target: Option<Target>,
}

impl ServerCertVerifier for ClusterNameVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _dialled: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let name =
            ServerName::try_from(CLUSTER_SAN).map_err(|e| rustls::Error::General(e.to_string()))?;
        let verified =
            self.inner
                .verify_server_cert(end_entity, intermediates, &name, ocsp, now)?;
        let Some(t) = &self.target else {
            return Ok(verified);
        };
        if !names_node(Some(end_entity.as_ref()), &t.node_id) {
            return Err(rustls::Error::General(format!(
                "{NOT_THE_NODE_MEANT}: its certificate does not name node {}",
                t.node_id
            )));
        }
        if cert_roles(end_entity).region.is_some_and(|r| r != t.region) {
            return Err(rustls::Error::General(format!(
                "{NOT_THE_NODE_MEANT}: its certificate binds another region than {}",
                t.region
            )));
        }
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::certs::ClusterCa;

    #[test]
    fn a_certificate_names_only_its_own_node() {
        let ca = ClusterCa::generate().unwrap();
        let id = ca.issue("n1").unwrap();
        let leaf = &id.chain().unwrap()[0];
        assert!(names_node(Some(leaf.as_ref()), "n1"));
        assert!(!names_node(Some(leaf.as_ref()), "n2"));
        assert!(!names_node(None, "n1"));
        assert!(!names_node(Some(b"junk"), "n1"));
    }

    #[test]
    fn configs_build_from_a_cluster_identity() {
        let ca = ClusterCa::generate().unwrap();
        let id = ca.issue("n1").unwrap();
        let (server, client) = https_configs(&id).unwrap();
        assert_eq!(server.alpn_protocols[0], b"h2");
        assert_eq!(client.alpn_protocols[1], b"http/1.1");
    }

    #[test]
    fn a_forwards_handshake_takes_only_the_node_meant_in_its_region() {
        use crate::mesh::certs::CertRoles;
        let ca = ClusterCa::generate().unwrap();
        let bound = |name: &str, region: Option<&str>| {
            let roles = CertRoles {
                region: region.map(str::to_owned),
                operator: false,
            };
            ca.issue_with(name, &roles).unwrap()
        };
        let me = ca.issue("me").unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = |node_id: &str, region: &str| {
            let inner = WebPkiServerVerifier::builder_with_provider(
                Arc::new(me.roots().unwrap()),
                provider.clone(),
            )
            .build()
            .unwrap();
            let target = Target {
                node_id: node_id.into(),
                region: region.into(),
            };
            ClusterNameVerifier {
                inner,
                target: Some(target),
            }
        };
        let verdict = |v: &ClusterNameVerifier, peer: &NodeIdentity| {
            let chain = peer.chain().unwrap();
            let name = ServerName::try_from("127.0.0.1").unwrap();
            v.verify_server_cert(&chain[0], &chain[1..], &name, &[], UnixTime::now())
        };
        let b1 = bound("b1", Some("b"));
        assert!(verdict(&verifier("b1", "b"), &b1).is_ok());
        // Another node at the address the record gave, or b1 named as another region's node.
        let b2 = bound("b2", Some("b"));
        let e = verdict(&verifier("b1", "b"), &b2).unwrap_err();
        assert!(e.to_string().contains(NOT_THE_NODE_MEANT), "{e}");
        assert!(verdict(&verifier("b1", "c"), &b1).is_err());
        // A certificate that binds no region fits any.
        assert!(verdict(&verifier("u1", "c"), &bound("u1", None)).is_ok());
    }
}
