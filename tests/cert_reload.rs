//! Certificate rotation without restart: `RunningNode::reload_certificates` makes new
//! handshakes present the certificate now in the files — on the client HTTPS listener, on both
//! sides of the mesh's QUIC endpoint and on both sides of peer HTTPS — while connections
//! established before keep working, and refuses (keeping the old certificate) one that does not
//! fit: a key that is not the certificate's, a certificate naming another node, from another CA.
//!
//! Every observation is a full TLS handshake by a raw rustls / quinn peer made here (session
//! resumption off), reading the certificate the node presented. Loopback only; every test is
//! bounded by `tokio::time::timeout`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kvmesh::mesh::certs::{self, NodeIdentity, CLUSTER_SAN};
use kvmesh::mesh::sync::RESP_BAD_REQUEST;
use kvmesh::mesh::transport::KIND_SUMMARY_REQUEST;
use kvmesh::node::config::{MeshSection, NodeConfig};
use kvmesh::proxy::{self, RunningNode};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_rustls::client::TlsStream;

mod common;
use common::{bounded, live_members, mesh_addr, wait_for};

fn init() {
    common::init_logs();
    proxy::install_crypto_provider();
}

/// A cluster CA in a fresh temporary directory.
fn ca_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    certs::init_dir(dir.path()).unwrap();
    dir
}

/// A new certificate and key (PEM) for `name` from the CA in `ca`, as `kvmesh certs issue`
/// makes them, without touching `ca` (issue refuses to overwrite, rotation needs a second one).
fn issue(ca: &Path, name: &str) -> (String, String) {
    let scratch = tempfile::tempdir().unwrap();
    for f in ["ca.pem", "ca.key"] {
        std::fs::copy(ca.join(f), scratch.path().join(f)).unwrap();
    }
    let (cert, key) = certs::issue_in_dir(scratch.path(), name).unwrap();
    (
        std::fs::read_to_string(cert).unwrap(),
        std::fs::read_to_string(key).unwrap(),
    )
}

/// Writes a certificate and key over the files a node reads (as cert-manager renews them).
fn install(cert_file: &Path, key_file: &Path, (cert, key): &(String, String)) {
    std::fs::write(cert_file, cert).unwrap();
    std::fs::write(key_file, key).unwrap();
}

fn leaf(cert_pem: &str) -> CertificateDer<'static> {
    CertificateDer::from_pem_slice(cert_pem.as_bytes()).unwrap()
}

fn ring() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A client trusting `ca_pem` for [`CLUSTER_SAN`], without a certificate of its own.
fn plain_client(ca_pem: &str) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(leaf(ca_pem)).unwrap();
    let mut cfg = rustls::ClientConfig::builder_with_provider(ring())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    // Every connection a full handshake: a resumed session shows the certificate of its first.
    cfg.resumption = rustls::client::Resumption::disabled();
    cfg
}

/// A mesh member's client for peer HTTPS (mutual TLS), speaking HTTP/1.1.
fn member_client(id: &NodeIdentity) -> rustls::ClientConfig {
    let (_, mut cfg) = kvmesh::mesh::peer_tls::https_configs(id).unwrap();
    cfg.resumption = rustls::client::Resumption::disabled();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    cfg
}

/// Connects to `addr` with `cfg`; returns the stream and the leaf certificate the server
/// presented.
async fn tls_connect(
    addr: SocketAddr,
    cfg: rustls::ClientConfig,
) -> (TlsStream<tokio::net::TcpStream>, CertificateDer<'static>) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from(CLUSTER_SAN).unwrap();
    let stream = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(name, tcp)
        .await
        .unwrap();
    let presented = stream.get_ref().1.peer_certificates().unwrap()[0].clone();
    (stream, presented)
}

/// One `GET /health` over HTTP/1.1 on an open connection; returns the response.
async fn health<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S) -> String {
    get_path(s, "/health").await
}

/// `GET path` over `s` (HTTP/1.1, kept open); the answer, whose JSON body ends in `}`.
async fn get_path<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, path: &str) -> String {
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: kvmesh\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    while !(buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.ends_with(b"}")) {
        let n = s.read(&mut chunk).await.unwrap();
        assert!(
            n > 0,
            "connection closed: {}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// A fresh QUIC connection to `addr` as a member holding `id`; returns it and the leaf the node
/// presented.
async fn quic_connect(
    id: &NodeIdentity,
    addr: SocketAddr,
) -> (quinn::Endpoint, quinn::Connection, CertificateDer<'static>) {
    // A new endpoint and configuration each time: nothing to resume.
    let q = id.quic_configs(Duration::from_secs(10)).unwrap();
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    ep.set_default_client_config(q.client);
    let conn = ep.connect(addr, CLUSTER_SAN).unwrap().await.unwrap();
    let presented = peer_leaf(&conn);
    (ep, conn, presented)
}

fn peer_leaf(conn: &quinn::Connection) -> CertificateDer<'static> {
    let chain = conn
        .peer_identity()
        .unwrap()
        .downcast::<Vec<CertificateDer<'static>>>()
        .unwrap();
    chain[0].clone()
}

fn metric(n: &RunningNode, line: &str) -> bool {
    n.node.metrics.render().unwrap().lines().any(|l| l == line)
}

/// A node with no replicas on loopback; `mesh` names its node id and certificate files
/// (CA, certificate, key) when it runs a mesh.
fn node_config(
    client_tls: Option<(PathBuf, PathBuf)>,
    mesh: Option<(&str, [PathBuf; 3], &[SocketAddr])>,
) -> NodeConfig {
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        cluster_id: "cert-reload-test".into(),
        drain_s: 1,
        ..NodeConfig::default()
    };
    if let Some((cert, key)) = client_tls {
        cfg.server.tls_cert = Some(cert);
        cfg.server.tls_key = Some(key);
    }
    if let Some((name, [ca, cert, key], seeds)) = mesh {
        cfg.mesh = Some(MeshSection {
            node_id: name.into(),
            listen: "127.0.0.1:0".parse().unwrap(),
            seeds: seeds.iter().map(|s| s.to_string()).collect(),
            ca: Some(ca),
            cert: Some(cert),
            key: Some(key),
            gossip_interval_ms: 100,
            failure_detection_ms: 1_000,
            warmup_timeout_ms: 5_000,
            ..MeshSection::default()
        });
    }
    cfg
}

/// Files of mesh node `name` in `dir` (the CA's directory), issued at first use.
fn mesh_files(dir: &Path, name: &str) -> [PathBuf; 3] {
    let cert = dir.join(format!("{name}.pem"));
    if !cert.exists() {
        certs::issue_in_dir(dir, name).unwrap();
    }
    [dir.join("ca.pem"), cert, dir.join(format!("{name}.key"))]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_listener_presents_a_reloaded_certificate_to_new_connections_only() {
    init();
    bounded(30, async {
        let ca = ca_dir();
        let ca_pem = std::fs::read_to_string(ca.path().join("ca.pem")).unwrap();
        let a = issue(ca.path(), "cert-a");
        let b = issue(ca.path(), "cert-b");
        let files = tempfile::tempdir().unwrap();
        let (cert_file, key_file) = (files.path().join("tls.crt"), files.path().join("tls.key"));
        install(&cert_file, &key_file, &a);
        let node = proxy::spawn(node_config(
            Some((cert_file.clone(), key_file.clone())),
            None,
        ))
        .await
        .unwrap();

        let (mut before, seen) = tls_connect(node.addr, plain_client(&ca_pem)).await;
        assert_eq!(seen, leaf(&a.0), "the node presents A at start");
        assert!(health(&mut before).await.starts_with("HTTP/1.1 200"));

        install(&cert_file, &key_file, &b);
        // The files alone change nothing: only a reload does.
        let (_, seen) = tls_connect(node.addr, plain_client(&ca_pem)).await;
        assert_eq!(seen, leaf(&a.0));
        node.reload_certificates().unwrap();
        let (mut after, seen) = tls_connect(node.addr, plain_client(&ca_pem)).await;
        assert_eq!(seen, leaf(&b.0), "a new connection sees B");
        assert!(health(&mut after).await.starts_with("HTTP/1.1 200"));
        // The connection opened before the reload keeps its session and keeps being served.
        assert_eq!(
            before.get_ref().1.peer_certificates().unwrap()[0],
            leaf(&a.0)
        );
        assert!(health(&mut before).await.starts_with("HTTP/1.1 200"));
        assert!(metric(&node, r#"kvmesh_cert_reloads_total{result="ok"} 1"#));
        assert!(metric(
            &node,
            r#"kvmesh_cert_reloads_total{result="error"} 0"#
        ));
        node.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_reload_interval_changed_files_are_picked_up_once_they_fit() {
    init();
    bounded(30, async {
        let ca = ca_dir();
        let ca_pem = std::fs::read_to_string(ca.path().join("ca.pem")).unwrap();
        let a = issue(ca.path(), "cert-a");
        let b = issue(ca.path(), "cert-b");
        let files = tempfile::tempdir().unwrap();
        let (cert_file, key_file) = (files.path().join("tls.crt"), files.path().join("tls.key"));
        install(&cert_file, &key_file, &a);
        let mut cfg = node_config(Some((cert_file.clone(), key_file.clone())), None);
        cfg.server.cert_reload_interval_s = 1;
        let node = proxy::spawn(cfg).await.unwrap();
        let seen = || async { tls_connect(node.addr, plain_client(&ca_pem)).await.1 };
        assert_eq!(seen().await, leaf(&a.0));

        // A renewal caught half-way (new certificate, old key): refused, A stays.
        std::fs::write(&cert_file, &b.0).unwrap();
        let refused = r#"kvmesh_cert_reloads_total{result="error"} 1"#;
        assert!(wait_for(Duration::from_secs(5), || metric(&node, refused))
            .await
            .is_some());
        assert_eq!(seen().await, leaf(&a.0));
        // The key arrives: the next look reloads, with no call.
        std::fs::write(&key_file, &b.1).unwrap();
        let ok = r#"kvmesh_cert_reloads_total{result="ok"} 1"#;
        assert!(wait_for(Duration::from_secs(5), || metric(&node, ok))
            .await
            .is_some());
        assert_eq!(seen().await, leaf(&b.0));
        // Unchanged files are not reloaded again.
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        assert!(metric(&node, ok) && metric(&node, refused));
        node.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_mesh_certificate_is_used_by_every_new_mesh_handshake_and_the_mesh_stays_up() {
    init();
    bounded(60, async {
        let ca = ca_dir();
        let dir = ca.path();
        // A member-like peer made here, to look at what n1 presents.
        certs::issue_in_dir(dir, "probe").unwrap();
        let probe = NodeIdentity::load_dir(dir, "probe").unwrap();
        let n1_files = mesh_files(dir, "n1");
        let n1 = proxy::spawn(node_config(None, Some(("n1", n1_files.clone(), &[]))))
            .await
            .unwrap();
        let seed = [mesh_addr(&n1)];
        let n2 = proxy::spawn(node_config(
            None,
            Some(("n2", mesh_files(dir, "n2"), &seed)),
        ))
        .await
        .unwrap();
        let pair = ["n1".to_owned(), "n2".to_owned()];
        assert!(
            wait_for(Duration::from_secs(10), || live_members(&n1) == pair
                && live_members(&n2) == pair)
            .await
            .is_some(),
            "the first two nodes never met"
        );
        let old = leaf(&std::fs::read_to_string(&n1_files[1]).unwrap());
        let (_ep, quic_before, seen) = quic_connect(&probe, mesh_addr(&n1)).await;
        assert_eq!(seen, old);
        let peer_addr = n1.peer_addr.unwrap();
        let (mut https_before, seen) = tls_connect(peer_addr, member_client(&probe)).await;
        assert_eq!(seen, old);

        // Rotate n1 to a freshly issued certificate of the same CA.
        let fresh = issue(dir, "n1");
        install(&n1_files[1], &n1_files[2], &fresh);
        n1.reload_certificates().unwrap();
        let new = leaf(&fresh.0);
        assert_ne!(new, old);

        // Server side: new QUIC and peer HTTPS handshakes see the new certificate.
        let (_ep2, _quic_after, seen) = quic_connect(&probe, mesh_addr(&n1)).await;
        assert_eq!(seen, new, "QUIC server side");
        let (mut https_after, seen) = tls_connect(peer_addr, member_client(&probe)).await;
        assert_eq!(seen, new, "peer HTTPS server side");
        assert!(health(&mut https_after).await.starts_with("HTTP/1.1 200"));
        // A member's certificate reaches the APIs there, not the operator's routes (this node
        // has no admin token: its front listens on loopback).
        let admin = get_path(&mut https_after, "/admin/state").await;
        assert!(admin.starts_with("HTTP/1.1 404"), "{admin}");

        // Client side, QUIC: n1 dials a member-like endpoint, which reads n1's certificate.
        let server = probe.quic_configs(Duration::from_secs(10)).unwrap().server;
        let listener = quinn::Endpoint::server(server, "127.0.0.1:0".parse().unwrap()).unwrap();
        let target = listener.local_addr().unwrap();
        let mesh = n1.node.mesh().unwrap();
        let dial = tokio::spawn(async move { mesh.fetch_summary(target, "r", 0, 0).await });
        let incoming = listener.accept().await.unwrap().await.unwrap();
        assert_eq!(peer_leaf(&incoming), new, "QUIC client side");
        incoming.close(0u32.into(), b"seen");
        let _ = dial.await;

        // Client side, peer HTTPS: n1's forwarding client (for the probe's node), against a
        // member-like listener.
        let (server_tls, _) = kvmesh::mesh::peer_tls::https_configs(&probe).unwrap();
        let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}/health", tcp.local_addr().unwrap());
        let client = n1.node.forward_clients.get("probe", "default").unwrap();
        let get = tokio::spawn(async move { client.get(url).send().await });
        let (sock, _) = tcp.accept().await.unwrap();
        let accepted = tokio_rustls::TlsAcceptor::from(Arc::new(server_tls))
            .accept(sock)
            .await
            .unwrap();
        let client_leaf = accepted.get_ref().1.peer_certificates().unwrap()[0].clone();
        assert_eq!(client_leaf, new, "peer HTTPS client side");
        drop(accepted);
        let _ = get.await;

        // Connections established before the rotation continue.
        let (mut s, mut r) = quic_before.open_bi().await.unwrap();
        s.write_all(&[KIND_SUMMARY_REQUEST, 0xc1, 0x00])
            .await
            .unwrap();
        s.finish().unwrap();
        assert_eq!(r.read_to_end(4096).await.unwrap()[0], RESP_BAD_REQUEST);
        assert!(health(&mut https_before).await.starts_with("HTTP/1.1 200"));

        // The mesh stays up: n2 still sees n1, and forwards to it (n1 serves the new
        // certificate); n1 forwards to n2 with its new client certificate; a third node joins
        // through n1 (full handshakes with n1 both ways).
        let to_n1 = n2.node.forward_clients.get("n1", "default").unwrap();
        let resp = to_n1
            .get(format!("https://{peer_addr}/health"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let to_n2 = n1.node.forward_clients.get("n2", "default").unwrap();
        let resp = to_n2
            .get(format!("https://{}/health", n2.peer_addr.unwrap()))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let n3 = proxy::spawn(node_config(
            None,
            Some(("n3", mesh_files(dir, "n3"), &seed)),
        ))
        .await
        .unwrap();
        let all = ["n1".to_owned(), "n2".to_owned(), "n3".to_owned()];
        assert!(
            wait_for(Duration::from_secs(10), || [&n1, &n2, &n3]
                .iter()
                .all(|n| live_members(n) == all))
            .await
            .is_some(),
            "n3 did not join: {:?} {:?} {:?}",
            live_members(&n1),
            live_members(&n2),
            live_members(&n3)
        );
        assert!(metric(&n1, r#"kvmesh_cert_reloads_total{result="ok"} 1"#));
        for n in [n3, n2, n1] {
            n.shutdown().await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_that_does_not_fit_is_refused_and_the_old_one_stays() {
    init();
    bounded(30, async {
        let ca = ca_dir();
        let dir = ca.path();
        let ca_pem = std::fs::read_to_string(dir.join("ca.pem")).unwrap();
        certs::issue_in_dir(dir, "probe").unwrap();
        let probe = NodeIdentity::load_dir(dir, "probe").unwrap();
        // Client listener files, and the mesh's.
        let files = tempfile::tempdir().unwrap();
        let (cert_file, key_file) = (files.path().join("tls.crt"), files.path().join("tls.key"));
        let a = issue(dir, "cert-a");
        install(&cert_file, &key_file, &a);
        let n1_files = mesh_files(dir, "n1");
        let n1_orig = (
            std::fs::read_to_string(&n1_files[1]).unwrap(),
            std::fs::read_to_string(&n1_files[2]).unwrap(),
        );
        let node = proxy::spawn(node_config(
            Some((cert_file.clone(), key_file.clone())),
            Some(("n1", n1_files.clone(), &[])),
        ))
        .await
        .unwrap();
        let mesh_leaf = leaf(&n1_orig.0);
        let presented = || async {
            let (_, client) = tls_connect(node.addr, plain_client(&ca_pem)).await;
            let (_ep, _conn, quic) = quic_connect(&probe, mesh_addr(&node)).await;
            let (_, peer) = tls_connect(node.peer_addr.unwrap(), member_client(&probe)).await;
            (client, quic, peer)
        };
        let unchanged = (leaf(&a.0), mesh_leaf.clone(), mesh_leaf.clone());
        assert_eq!(presented().await, unchanged);

        // The client certificate with another certificate's key.
        let b = issue(dir, "cert-b");
        install(&cert_file, &key_file, &(a.0.clone(), b.1.clone()));
        let err = node.reload_certificates().unwrap_err().to_string();
        assert!(err.contains("client certificate"), "{err}");
        assert_eq!(presented().await, unchanged);
        install(&cert_file, &key_file, &a);

        // A mesh certificate of the same CA naming another node.
        install(&n1_files[1], &n1_files[2], &issue(dir, "n9"));
        let err = node.reload_certificates().unwrap_err().to_string();
        assert!(
            err.contains("mesh certificate") && err.contains("n9"),
            "{err}"
        );
        assert_eq!(presented().await, unchanged);

        // One naming this node, from another CA.
        let other = ca_dir();
        install(&n1_files[1], &n1_files[2], &issue(other.path(), "n1"));
        let err = node.reload_certificates().unwrap_err().to_string();
        assert!(err.contains("mesh certificate"), "{err}");
        assert_eq!(presented().await, unchanged);

        // A fresh certificate for this node with the old key (a half-finished renewal).
        let fresh = issue(dir, "n1");
        install(
            &n1_files[1],
            &n1_files[2],
            &(fresh.0.clone(), n1_orig.1.clone()),
        );
        let err = node.reload_certificates().unwrap_err().to_string();
        assert!(err.contains("mesh certificate"), "{err}");
        // A file that is not PEM at all.
        std::fs::write(&n1_files[1], "not a certificate").unwrap();
        assert!(node.reload_certificates().is_err());
        assert_eq!(presented().await, unchanged);
        assert!(metric(
            &node,
            r#"kvmesh_cert_reloads_total{result="error"} 5"#
        ));
        assert!(metric(&node, r#"kvmesh_cert_reloads_total{result="ok"} 0"#));

        // With fitting files again, the reload goes through (the refusals left nothing behind).
        install(&n1_files[1], &n1_files[2], &fresh);
        node.reload_certificates().unwrap();
        let (_, quic, peer) = presented().await;
        assert_eq!((quic, peer), (leaf(&fresh.0), leaf(&fresh.0)));
        node.shutdown().await;
    })
    .await;
}
