//! Cluster certificates: a CA, node certificates, and the rustls/quinn configurations built from
//! them.
//!
//! Every QUIC connection in the mesh is mutual TLS against one cluster CA, so a process without a
//! certificate from that CA can neither join gossip nor pull summaries. chitchat only hands the
//! transport a `SocketAddr` to dial, never a name, so every node certificate carries one
//! cluster-wide DNS SAN ([`CLUSTER_SAN`]) and clients verify that name. The node's own name goes
//! in the subject CN for operators and in a URI SAN `urn:kvmesh:node:<name>` ([`NODE_URI_PREFIX`])
//! for the mesh: a node's `node_id` must be one of its certificate's node names
//! ([`node_names`]: those URIs, plus any DNS SAN other than the cluster SAN), which the node
//! checks at start and every peer checks on each connection (see `transport`).
//!
//! `kvmesh certs init` / `kvmesh certs issue` write PEM files for a quick start; production
//! deployments may bring certificates from their own PKI as long as they carry the cluster SAN and
//! name the node (the URI, or the node id as a DNS SAN).
//!
//! Connections are TLS 1.3 only, with the ring provider passed explicitly and client
//! certificates required and verified against the CA; ALPN is [`ALPN`]. Key files are written
//! with mode 0600 (on Unix) and an existing file is never overwritten.
//!
//! The node's own certificate is presented through a [`ReloadableCert`] (see `cert_resolver`),
//! so a renewed certificate can replace it without a restart; [`NodeIdentity::validated_key`]
//! is the one gate, at start and at every reload: it chains to the CA, carries the cluster SAN,
//! names the node and its key matches. The CA (the roots the verifiers trust) is fixed at start:
//! `ca_pem` may hold several CAs (every certificate in it is trusted), which is how a CA is
//! rotated — a rolling restart with both CAs in the bundle.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::client::danger::ServerCertVerifier;
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;
use rustls::RootCertStore;

use super::cert_resolver::{certified_key, ReloadableCert};

/// The DNS name in every node certificate, and the name every client verifies.
pub const CLUSTER_SAN: &str = "kvmesh.mesh.internal";
/// Prefix of the URI SAN that names a node: `urn:kvmesh:node:<node_id>`.
pub const NODE_URI_PREFIX: &str = "urn:kvmesh:node:";
/// Prefix of the URI SAN that binds a node to a region: `urn:kvmesh:region:<region>`
/// (`kvmesh certs issue --region`). A certificate without one is trusted for any region.
pub const REGION_URI_PREFIX: &str = "urn:kvmesh:region:";
/// The URI SAN that lets a node publish operator commands (`admin:` records) to its peers
/// (`kvmesh certs issue --operator`).
pub const OPERATOR_URI: &str = "urn:kvmesh:role:operator";
/// The ALPN protocol of mesh connections; bumped when the stream formats change incompatibly.
pub const ALPN: &[u8] = b"kvmesh/1";
/// RTT assumed before a QUIC connection has its first sample (see `quic_configs_with`).
const INITIAL_RTT: std::time::Duration = std::time::Duration::from_millis(50);
/// Common name of CAs made by [`ClusterCa::generate`]; `issue` rebuilds the issuer from it.
const CA_COMMON_NAME: &str = "kvmesh cluster CA";
/// File names inside a certificate directory.
const CA_CERT_FILE: &str = "ca.pem";
const CA_KEY_FILE: &str = "ca.key";

/// Errors making, reading or using certificates.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// rcgen refused to build or sign.
    #[error("certificate generation failed: {0}")]
    Generate(#[from] rcgen::Error),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// PEM input did not contain what was expected.
    #[error("{what}: {reason}")]
    Pem {
        /// Which input.
        what: String,
        /// Why it was refused.
        reason: String,
    },
    /// rustls refused the configuration (bad key, bad chain, ...).
    #[error("TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
    /// The client verifier could not be built (e.g. empty root store).
    #[error("client verifier: {0}")]
    Verifier(String),
    /// quinn refused the rustls configuration.
    #[error("QUIC crypto configuration: {0}")]
    Quic(String),
    /// A file exists and would be overwritten.
    #[error("{0} already exists (refusing to overwrite)")]
    Exists(PathBuf),
    /// A node name that cannot be a file name or a CN.
    #[error("invalid node name {0:?}: use 1-64 of [A-Za-z0-9._-]")]
    BadName(String),
    /// The certificate does not name the node id it is used for.
    #[error("the node certificate names {names:?}, not node_id {node_id:?}: issue one for it (`kvmesh certs issue {node_id}`) or set node_id to a name the certificate carries")]
    WrongName {
        /// The configured node id.
        node_id: String,
        /// The node names the certificate carries.
        names: Vec<String>,
    },
    /// The certificate binds another region than the one configured.
    #[error("the node certificate binds region {cert:?}, not the configured region {config:?}: issue one with `kvmesh certs issue --region {config}` or set region to the certificate's")]
    WrongRegion {
        /// The configured region.
        config: String,
        /// The region the certificate binds.
        cert: String,
    },
}

/// What a certificate authorises beyond its node names: the region it binds its nodes to and
/// whether it may publish operator commands. Read from URI SANs ([`cert_roles`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CertRoles {
    /// The region the certificate's node must be in; `None`: any region (certificates issued
    /// before regions were bound, or by `certs issue` without `--region`).
    pub region: Option<String>,
    /// Carries [`OPERATOR_URI`]: its `admin:` records are applied by peers.
    pub operator: bool,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CertError + '_ {
    move |source| CertError::Io {
        path: path.to_owned(),
        source,
    }
}

/// The parameters of a kvmesh CA. `issue` rebuilds the issuer from these plus the CA key, which
/// avoids parsing the CA certificate (rcgen's parser is an extra dependency); the chain is then
/// verified with rustls before any file is written, so a mismatch cannot go unnoticed.
fn ca_params() -> Result<CertificateParams, CertError> {
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_COMMON_NAME);
    p.distinguished_name = dn;
    // Ten years: a quick-start CA should not expire under a running cluster.
    p.not_before = rcgen::date_time_ymd(2024, 1, 1);
    p.not_after = rcgen::date_time_ymd(2035, 1, 1);
    Ok(p)
}

fn check_name(name: &str) -> Result<(), CertError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(CertError::BadName(name.to_owned()))
    }
}

/// A cluster CA held in memory (PEM certificate and key).
#[derive(Clone)]
pub struct ClusterCa {
    /// The CA certificate, PEM.
    pub cert_pem: String,
    key_pem: String,
}

impl std::fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterCa").finish_non_exhaustive()
    }
}

impl ClusterCa {
    /// A new self-signed CA.
    pub fn generate() -> Result<Self, CertError> {
        let key = KeyPair::generate()?;
        let cert = ca_params()?.self_signed(&key)?;
        Ok(ClusterCa {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// A CA from its PEM certificate and key (as written by [`ClusterCa::write`]).
    pub fn from_pem(cert_pem: String, key_pem: String) -> Result<Self, CertError> {
        // Parse both now so a bad file fails here, not at the first `issue`.
        CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(|e| CertError::Pem {
            what: "CA certificate".into(),
            reason: e.to_string(),
        })?;
        KeyPair::from_pem(&key_pem)?;
        Ok(ClusterCa { cert_pem, key_pem })
    }

    /// Reads `ca.pem` and `ca.key` from `dir`.
    pub fn load(dir: &Path) -> Result<Self, CertError> {
        let cert = dir.join(CA_CERT_FILE);
        let key = dir.join(CA_KEY_FILE);
        ClusterCa::from_pem(
            fs::read_to_string(&cert).map_err(io_err(&cert))?,
            fs::read_to_string(&key).map_err(io_err(&key))?,
        )
    }

    /// Writes `ca.pem` and `ca.key` (mode 0600) into `dir`, creating it; refuses to overwrite.
    pub fn write(&self, dir: &Path) -> Result<(PathBuf, PathBuf), CertError> {
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let cert = dir.join(CA_CERT_FILE);
        let key = dir.join(CA_KEY_FILE);
        write_new(&cert, &self.cert_pem, false)?;
        write_new(&key, &self.key_pem, true)?;
        Ok((cert, key))
    }

    /// A certificate for node `name` (CN = name, SANs = [`CLUSTER_SAN`] and
    /// `urn:kvmesh:node:<name>`, server + client auth), verified against this CA before it is
    /// returned.
    pub fn issue(&self, name: &str) -> Result<NodeIdentity, CertError> {
        self.issue_with(name, &CertRoles::default())
    }

    /// [`ClusterCa::issue`] with `roles` as URI SANs: `urn:kvmesh:region:<r>` and
    /// [`OPERATOR_URI`].
    pub fn issue_with(&self, name: &str, roles: &CertRoles) -> Result<NodeIdentity, CertError> {
        check_name(name)?;
        if let Some(r) = &roles.region {
            check_name(r)?;
        }
        let ca_key = KeyPair::from_pem(&self.key_pem)?;
        let issuer = Issuer::new(ca_params()?, ca_key);
        let mut p = CertificateParams::new(vec![CLUSTER_SAN.to_owned()])?;
        let uri = rcgen::string::Ia5String::try_from(format!("{NODE_URI_PREFIX}{name}"))?;
        p.subject_alt_names.push(rcgen::SanType::URI(uri));
        if let Some(r) = &roles.region {
            let uri = rcgen::string::Ia5String::try_from(format!("{REGION_URI_PREFIX}{r}"))?;
            p.subject_alt_names.push(rcgen::SanType::URI(uri));
        }
        if roles.operator {
            let uri = rcgen::string::Ia5String::try_from(OPERATOR_URI.to_owned())?;
            p.subject_alt_names.push(rcgen::SanType::URI(uri));
        }
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        p.distinguished_name = dn;
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        p.use_authority_key_identifier_extension = true;
        p.not_before = rcgen::date_time_ymd(2024, 1, 1);
        p.not_after = rcgen::date_time_ymd(2035, 1, 1);
        let key = KeyPair::generate()?;
        let cert = p.signed_by(&key, &issuer)?;
        let id = NodeIdentity {
            ca_pem: self.cert_pem.clone(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        };
        id.verify_chain()?;
        Ok(id)
    }
}

fn write_new(path: &Path, contents: &str, secret: bool) -> Result<(), CertError> {
    use std::io::Write;
    let mut opts = fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    #[cfg(not(unix))]
    let _ = secret;
    let mut f = opts.open(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            CertError::Exists(path.to_owned())
        } else {
            CertError::Io {
                path: path.to_owned(),
                source: e,
            }
        }
    })?;
    f.write_all(contents.as_bytes()).map_err(io_err(path))
}

/// `kvmesh certs init`: a new CA in `dir`. Returns the paths written.
pub fn init_dir(dir: &Path) -> Result<(PathBuf, PathBuf), CertError> {
    // Check both files first so a half-initialised directory is never produced.
    for f in [CA_CERT_FILE, CA_KEY_FILE] {
        if dir.join(f).exists() {
            return Err(CertError::Exists(dir.join(f)));
        }
    }
    ClusterCa::generate()?.write(dir)
}

/// `kvmesh certs issue`: a certificate for `name` signed by the CA in `dir`, written as
/// `<name>.pem` and `<name>.key`. Returns the paths written.
pub fn issue_in_dir(dir: &Path, name: &str) -> Result<(PathBuf, PathBuf), CertError> {
    issue_in_dir_with(dir, name, &CertRoles::default())
}

/// [`issue_in_dir`] with `roles` (`kvmesh certs issue --region R --operator`).
pub fn issue_in_dir_with(
    dir: &Path,
    name: &str,
    roles: &CertRoles,
) -> Result<(PathBuf, PathBuf), CertError> {
    check_name(name)?;
    let ca = ClusterCa::load(dir)?;
    let id = ca.issue_with(name, roles)?;
    let cert = dir.join(format!("{name}.pem"));
    let key = dir.join(format!("{name}.key"));
    for p in [&cert, &key] {
        if p.exists() {
            return Err(CertError::Exists(p.clone()));
        }
    }
    write_new(&cert, &id.cert_pem, false)?;
    write_new(&key, &id.key_pem, true)?;
    Ok((cert, key))
}

/// The node names a certificate carries: its `urn:kvmesh:node:<name>` URI SANs, and its DNS
/// SANs other than [`CLUSTER_SAN`]. Empty when the certificate does not parse (a peer's
/// certificate has already been verified against the CA by then) or names no node.
pub fn node_names(cert: &CertificateDer<'_>) -> Vec<String> {
    let Ok(ee) = webpki::EndEntityCert::try_from(cert) else {
        return Vec::new();
    };
    let mut names: Vec<String> = ee
        .valid_uri_names()
        .filter_map(|u| u.strip_prefix(NODE_URI_PREFIX))
        .chain(ee.valid_dns_names().filter(|d| *d != CLUSTER_SAN))
        .filter(|n| !n.is_empty() && n.len() <= 255)
        .map(str::to_owned)
        .collect();
    names.sort();
    names.dedup();
    names
}

/// The roles a certificate carries (see [`CertRoles`]); none when it does not parse. With
/// several region SANs the first one counts.
pub fn cert_roles(cert: &CertificateDer<'_>) -> CertRoles {
    let Ok(ee) = webpki::EndEntityCert::try_from(cert) else {
        return CertRoles::default();
    };
    let mut roles = CertRoles::default();
    for uri in ee.valid_uri_names() {
        if uri == OPERATOR_URI {
            roles.operator = true;
        } else if let Some(r) = uri.strip_prefix(REGION_URI_PREFIX) {
            if roles.region.is_none() && !r.is_empty() && r.len() <= 255 {
                roles.region = Some(r.to_owned());
            }
        }
    }
    roles
}

/// What a node needs for mTLS: the cluster CA, its certificate and its key (all PEM).
#[derive(Clone)]
pub struct NodeIdentity {
    /// The cluster CA certificate(s) to trust, PEM.
    pub ca_pem: String,
    /// This node's certificate chain, PEM (leaf first).
    pub cert_pem: String,
    key_pem: String,
}

impl std::fmt::Debug for NodeIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeIdentity").finish_non_exhaustive()
    }
}

/// The client and server sides of a node's QUIC crypto, ready for one `quinn::Endpoint`.
#[derive(Clone)]
pub struct QuicConfigs {
    /// Accepts peers whose certificate chains to the cluster CA.
    pub server: quinn::ServerConfig,
    /// Dials peers, presenting this node's certificate and verifying [`CLUSTER_SAN`].
    pub client: quinn::ClientConfig,
}

impl std::fmt::Debug for QuicConfigs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicConfigs").finish_non_exhaustive()
    }
}

impl NodeIdentity {
    /// An identity from PEM strings.
    pub fn from_pem(ca_pem: String, cert_pem: String, key_pem: String) -> Self {
        NodeIdentity {
            ca_pem,
            cert_pem,
            key_pem,
        }
    }

    /// Reads the CA certificate, node certificate and node key from files.
    pub fn load(ca: &Path, cert: &Path, key: &Path) -> Result<Self, CertError> {
        Ok(NodeIdentity {
            ca_pem: fs::read_to_string(ca).map_err(io_err(ca))?,
            cert_pem: fs::read_to_string(cert).map_err(io_err(cert))?,
            key_pem: fs::read_to_string(key).map_err(io_err(key))?,
        })
    }

    /// Reads `ca.pem`, `<name>.pem` and `<name>.key` from a directory made by `kvmesh certs`.
    pub fn load_dir(dir: &Path, name: &str) -> Result<Self, CertError> {
        check_name(name)?;
        NodeIdentity::load(
            &dir.join(CA_CERT_FILE),
            &dir.join(format!("{name}.pem")),
            &dir.join(format!("{name}.key")),
        )
    }

    pub(crate) fn roots(&self) -> Result<RootCertStore, CertError> {
        let mut roots = RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(self.ca_pem.as_bytes()) {
            let c = c.map_err(|e| CertError::Pem {
                what: "CA certificate".into(),
                reason: e.to_string(),
            })?;
            roots.add(c)?;
        }
        if roots.is_empty() {
            return Err(CertError::Pem {
                what: "CA certificate".into(),
                reason: "no certificate found".into(),
            });
        }
        Ok(roots)
    }

    pub(crate) fn chain(&self) -> Result<Vec<CertificateDer<'static>>, CertError> {
        let chain = CertificateDer::pem_slice_iter(self.cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| CertError::Pem {
                what: "node certificate".into(),
                reason: e.to_string(),
            })?;
        if chain.is_empty() {
            return Err(CertError::Pem {
                what: "node certificate".into(),
                reason: "no certificate found".into(),
            });
        }
        Ok(chain)
    }

    pub(crate) fn key(&self) -> Result<PrivateKeyDer<'static>, CertError> {
        PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes()).map_err(|e| CertError::Pem {
            what: "node key".into(),
            reason: e.to_string(),
        })
    }

    /// Checks that the node certificate chains to the CA as a client certificate (the same
    /// check peers will make), so a bad pairing fails at startup, not at the first handshake.
    pub fn verify_chain(&self) -> Result<(), CertError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::new(self.roots()?), provider)
                .build()
                .map_err(|e| CertError::Verifier(e.to_string()))?;
        let chain = self.chain()?;
        verifier.verify_client_cert(&chain[0], &chain[1..], UnixTime::now())?;
        Ok(())
    }

    /// Checks that the node certificate is valid for [`CLUSTER_SAN`] as a server certificate
    /// under the CA: the name and purpose every peer dialling this node verifies.
    pub fn verify_cluster_name(&self) -> Result<(), CertError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier =
            WebPkiServerVerifier::builder_with_provider(Arc::new(self.roots()?), provider)
                .build()
                .map_err(|e| CertError::Verifier(e.to_string()))?;
        let chain = self.chain()?;
        let name =
            ServerName::try_from(CLUSTER_SAN).map_err(|e| CertError::Verifier(e.to_string()))?;
        verifier.verify_server_cert(&chain[0], &chain[1..], &name, &[], UnixTime::now())?;
        Ok(())
    }

    /// Everything a node checks before presenting this identity as `node_id`, at start and at
    /// every reload: the chain reaches the CA as a client certificate and as a server
    /// certificate for [`CLUSTER_SAN`], the certificate names `node_id`, and the key is the
    /// certificate's. Returns the certificate and key ready to present.
    pub fn validated_key(&self, node_id: &str) -> Result<CertifiedKey, CertError> {
        self.verify_chain()?;
        self.verify_cluster_name()?;
        self.verify_name(node_id)?;
        self.certified_key()
    }

    /// This identity's certificate chain and key as rustls presents them (the key checked
    /// against the certificate, nothing else; see [`NodeIdentity::validated_key`]).
    pub fn certified_key(&self) -> Result<CertifiedKey, CertError> {
        Ok(certified_key(self.chain()?, self.key()?)?)
    }

    /// The same CA with another certificate and key (`fresh`'s): what a reload validates, since
    /// the roots the running verifiers trust do not change until a restart.
    pub fn with_leaf_of(&self, fresh: &NodeIdentity) -> NodeIdentity {
        NodeIdentity {
            ca_pem: self.ca_pem.clone(),
            cert_pem: fresh.cert_pem.clone(),
            key_pem: fresh.key_pem.clone(),
        }
    }

    /// The node names this identity's certificate carries ([`node_names`] of the leaf).
    pub fn node_names(&self) -> Result<Vec<String>, CertError> {
        Ok(node_names(&self.chain()?[0]))
    }

    /// The roles of this identity's certificate ([`cert_roles`] of the leaf).
    pub fn roles(&self) -> Result<CertRoles, CertError> {
        Ok(cert_roles(&self.chain()?[0]))
    }

    /// Checks that the certificate binds `region`, or no region at all: a node refuses to start
    /// in a region its certificate does not allow, as its peers would refuse its records.
    pub fn verify_region(&self, region: &str) -> Result<(), CertError> {
        match self.roles()?.region {
            Some(r) if r != region => Err(CertError::WrongRegion {
                config: region.to_owned(),
                cert: r,
            }),
            _ => Ok(()),
        }
    }

    /// Checks that the certificate names `node_id` (see [`node_names`]): a node refuses to start
    /// under a name its certificate does not carry, as its peers would refuse it.
    pub fn verify_name(&self, node_id: &str) -> Result<(), CertError> {
        let names = self.node_names()?;
        if names.iter().any(|n| n == node_id) {
            Ok(())
        } else {
            Err(CertError::WrongName {
                node_id: node_id.to_owned(),
                names,
            })
        }
    }

    /// rustls server and client configurations: TLS 1.3 only, ring provider, client certificates
    /// required and verified against the CA, ALPN [`ALPN`]; this identity's certificate is
    /// presented through a [`ReloadableCert`] of its own (see [`NodeIdentity::rustls_configs_with`]
    /// to share one).
    pub fn rustls_configs(
        &self,
    ) -> Result<(rustls::ServerConfig, rustls::ClientConfig), CertError> {
        self.rustls_configs_with(ReloadableCert::new(self.certified_key()?))
    }

    /// [`NodeIdentity::rustls_configs`] presenting `cert` on both sides, so replacing its content
    /// changes what new handshakes present. Only the CA is taken from `self`.
    pub fn rustls_configs_with(
        &self,
        cert: Arc<ReloadableCert>,
    ) -> Result<(rustls::ServerConfig, rustls::ClientConfig), CertError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let roots = Arc::new(self.roots()?);
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| CertError::Verifier(e.to_string()))?;
        let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_cert_resolver(cert.clone());
        let mut client = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(roots)
            .with_client_cert_resolver(cert);
        server.alpn_protocols = vec![ALPN.to_vec()];
        client.alpn_protocols = vec![ALPN.to_vec()];
        Ok((server, client))
    }

    /// quinn configurations over [`NodeIdentity::rustls_configs`], with `idle_timeout` and a
    /// keep-alive of a third of it (keep-alives also keep RTT samples fresh).
    pub fn quic_configs(&self, idle_timeout: Duration) -> Result<QuicConfigs, CertError> {
        self.quic_configs_with(idle_timeout, ReloadableCert::new(self.certified_key()?))
    }

    /// [`NodeIdentity::quic_configs`] presenting `cert` (see
    /// [`NodeIdentity::rustls_configs_with`]).
    pub fn quic_configs_with(
        &self,
        idle_timeout: Duration,
        cert: Arc<ReloadableCert>,
    ) -> Result<QuicConfigs, CertError> {
        use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
        let (s, c) = self.rustls_configs_with(cert)?;
        let mut tc = quinn::TransportConfig::default();
        let idle = quinn::IdleTimeout::try_from(idle_timeout)
            .map_err(|e| CertError::Quic(e.to_string()))?;
        // QUIC assumes 333 ms of RTT before the first sample, so a first Initial that found
        // no endpoint yet (every node of a region starting at once) is sent again only after
        // ~1 s, the dial timeout. Peers of a mesh are mostly in one region, a few ms apart: at
        // 50 ms the lost Initial goes again after ~150 ms (and a far region's handshake sends at
        // most a spurious Initial or two, ~1.2 KB each).
        tc.max_idle_timeout(Some(idle))
            .keep_alive_interval(Some(idle_timeout / 3))
            .initial_rtt(INITIAL_RTT);
        let tc = Arc::new(tc);
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(
            QuicServerConfig::try_from(s).map_err(|e| CertError::Quic(e.to_string()))?,
        ));
        server.transport_config(tc.clone());
        let mut client = quinn::ClientConfig::new(Arc::new(
            QuicClientConfig::try_from(c).map_err(|e| CertError::Quic(e.to_string()))?,
        ));
        client.transport_config(tc);
        Ok(QuicConfigs { server, client })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_certificates_chain_to_their_ca_only() {
        let ca = ClusterCa::generate().unwrap();
        let id = ca.issue("node-a").unwrap();
        id.verify_chain().unwrap();
        id.rustls_configs().unwrap();
        let other = ClusterCa::generate().unwrap();
        let foreign = NodeIdentity::from_pem(
            ca.cert_pem.clone(),
            other.issue("x").unwrap().cert_pem,
            other.issue("x").unwrap().key_pem,
        );
        assert!(foreign.verify_chain().is_err());
        assert!(matches!(ca.issue("../etc"), Err(CertError::BadName(_))));
        // The node's name is in the certificate, and only that one.
        assert_eq!(id.node_names().unwrap(), vec!["node-a".to_owned()]);
        id.verify_name("node-a").unwrap();
        assert!(matches!(
            id.verify_name("n3"),
            Err(CertError::WrongName { .. })
        ));
        let msg = id.verify_name("n3").unwrap_err().to_string();
        assert!(msg.contains("node-a") && msg.contains("n3"), "{msg}");
        assert!(matches!(ca.issue(""), Err(CertError::BadName(_))));
    }

    #[test]
    fn validated_key_requires_the_cluster_san_the_node_name_and_the_matching_key() {
        let ca = ClusterCa::generate().unwrap();
        let id = ca.issue("n1").unwrap();
        id.validated_key("n1").unwrap();
        assert!(matches!(
            id.validated_key("n2"),
            Err(CertError::WrongName { .. })
        ));
        // Signed by the CA and naming n1, but without the cluster SAN peers dial by.
        let issuer = Issuer::new(
            ca_params().unwrap(),
            KeyPair::from_pem(&ca.key_pem).unwrap(),
        );
        let mut p = CertificateParams::new(vec!["other.example".to_owned()]).unwrap();
        let uri = rcgen::string::Ia5String::try_from(format!("{NODE_URI_PREFIX}n1")).unwrap();
        p.subject_alt_names.push(rcgen::SanType::URI(uri));
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &issuer).unwrap();
        let no_san = NodeIdentity::from_pem(ca.cert_pem.clone(), cert.pem(), key.serialize_pem());
        no_san.verify_chain().unwrap();
        no_san.verify_name("n1").unwrap();
        assert!(no_san.verify_cluster_name().is_err());
        assert!(no_san.validated_key("n1").is_err());
        // The right certificate with another key.
        let other = ca.issue("n1").unwrap();
        let mixed = NodeIdentity::from_pem(ca.cert_pem.clone(), id.cert_pem.clone(), other.key_pem);
        assert!(matches!(
            mixed.validated_key("n1"),
            Err(CertError::Tls(rustls::Error::InconsistentKeys(_)))
        ));
        // A reload keeps the CA it started with, whatever the fresh files hold.
        let foreign = ClusterCa::generate().unwrap().issue("n1").unwrap();
        assert!(foreign.validated_key("n1").is_ok());
        assert!(id.with_leaf_of(&foreign).validated_key("n1").is_err());
    }

    #[test]
    fn init_and_issue_write_files_and_refuse_overwrite() {
        let dir = std::env::temp_dir().join(format!(
            "kvmesh-certs-test-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        init_dir(&dir).unwrap();
        assert!(matches!(init_dir(&dir), Err(CertError::Exists(_))));
        issue_in_dir(&dir, "node-a").unwrap();
        assert!(matches!(
            issue_in_dir(&dir, "node-a"),
            Err(CertError::Exists(_))
        ));
        let id = NodeIdentity::load_dir(&dir, "node-a").unwrap();
        id.verify_chain().unwrap();
        id.quic_configs(Duration::from_secs(10)).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(dir.join("node-a.key"))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o077, 0);
        }
        fs::remove_dir_all(&dir).unwrap();
    }
}
