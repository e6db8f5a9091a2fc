//! TLS for node-to-node HTTP: forwarded requests travel inside the cluster's mutual TLS.
//!
//! Exists because a request forwarded to another region carries the prompt and the client's
//! headers; it must be as private as gossip, and the receiving node must know it came from a
//! member (only then does it honour the hop header). The server side requires a client
//! certificate from the cluster CA; the client side presents this node's certificate and checks
//! the server's against the CA and [`CLUSTER_SAN`] whatever address it dialled (peers are known
//! by address, like chitchat's). TLS 1.3 only, ALPN `h2` and `http/1.1`.
//!
//! Which member answered is checked per forward, against the node the caller meant
//! ([`names_node`] on the answer's certificate): a record pointing at another node's address
//! (a redirected forward) gets no answer through.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{DigitallySignedStruct, SignatureScheme};

use super::cert_resolver::ReloadableCert;
use super::certs::{CertError, NodeIdentity, CLUSTER_SAN};

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
    let inner = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
        .build()
        .map_err(|e| CertError::Verifier(e.to_string()))?;
    let mut client = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(ClusterNameVerifier { inner }))
        .with_client_cert_resolver(cert);
    client.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok((server, client))
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
/// address dialled (node certificates name the cluster, not their addresses).
#[derive(Debug)]
struct ClusterNameVerifier {
    inner: Arc<WebPkiServerVerifier>,
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
        self.inner
            .verify_server_cert(end_entity, intermediates, &name, ocsp, now)
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
}
