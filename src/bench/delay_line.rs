//! A delay line: a TCP relay on 127.0.0.1 that holds every chunk for a fixed time in each
//! direction, so that a request one region forwards to another in an in-process fleet pays the
//! regions' round trip on the wire, as it would between data centres.
//!
//! Exists because the nodes only *know* a distance (`[[mesh.distance]]`, or a measured RTT) and
//! loopback has none: without a delay, a fleet's far region would cost its distance in the
//! routing decision but nothing in the measured TTFT. netem is not available on these machines
//! (`../shared/reference/machine.md`), so the delay sits outside the nodes, in front of the URL
//! a node gives its peers (`mesh.http_url`; TLS passes through it untouched). The delay is per destination: every connection to
//! one line pays the same.
//!
//! The upstream is set after the line starts, because a node's configuration must name the
//! line's URL before the node binds its own port; a connection before that is closed.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

/// Chunks one direction of a connection may hold in flight (each at most [`CHUNK`] bytes):
/// the line's memory bound per connection, and its bandwidth-delay product.
const IN_FLIGHT_CHUNKS: usize = 256;
/// Largest chunk read at once.
const CHUNK: usize = 16 * 1024;

/// A running delay line; stops (its connections too) when dropped.
pub struct DelayLine {
    /// Where it listens (on 127.0.0.1): what peers are sent to instead of the upstream.
    pub addr: SocketAddr,
    upstream: Arc<OnceLock<SocketAddr>>,
    connections: Arc<AtomicU64>,
    accept: JoinHandle<()>,
}

impl DelayLine {
    /// Starts a line that holds each chunk `one_way` in each direction (a round trip of twice
    /// that), with no upstream yet.
    pub async fn start(one_way: Duration) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let upstream = Arc::new(OnceLock::new());
        let to = Arc::clone(&upstream);
        let connections = Arc::new(AtomicU64::new(0));
        let relayed = Arc::clone(&connections);
        let accept = tokio::spawn(async move {
            // Dropped with the accept task: aborting it ends every connection.
            let mut conns = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((client, _)) = accepted else {
                            // Out of descriptors, say: wait instead of spinning.
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            continue;
                        };
                        if let Some(addr) = to.get().copied() {
                            relayed.fetch_add(1, Ordering::Relaxed);
                            conns.spawn(relay(client, addr, one_way));
                        }
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        Ok(DelayLine {
            addr,
            upstream,
            connections,
            accept,
        })
    }

    /// Where the line's connections go from now on (the first call wins).
    pub fn set_upstream(&self, addr: SocketAddr) {
        let _ = self.upstream.set(addr);
    }

    /// Connections relayed so far: how many a destination's clients opened.
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }
}

impl Drop for DelayLine {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Relays one connection both ways until both directions end.
async fn relay(client: TcpStream, upstream: SocketAddr, one_way: Duration) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::join!(
        pump(client_read, server_write, one_way),
        pump(server_read, client_write, one_way)
    );
}

/// Copies `from` to `to`, each chunk written `one_way` after it was read, in order; at the end
/// of `from`, shuts `to`'s write side once the held chunks are out.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, one_way: Duration) {
    let (tx, mut rx) = mpsc::channel::<(Instant, Bytes)>(IN_FLIGHT_CHUNKS);
    let reader = async move {
        let mut buf = BytesMut::with_capacity(CHUNK);
        loop {
            buf.reserve(CHUNK);
            match from.read_buf(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            let due = Instant::now() + one_way;
            if tx.send((due, buf.split().freeze())).await.is_err() {
                break;
            }
        }
    };
    let writer = async move {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server on 127.0.0.1: every connection gets back what it sends.
    async fn echo() -> SocketAddr {
        let l = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = s.into_split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn bounded<F: std::future::Future>(f: F) -> F::Output {
        tokio::time::timeout(Duration::from_secs(20), f)
            .await
            .expect("within 20 s")
    }

    #[tokio::test]
    async fn a_round_trip_through_the_line_takes_at_least_twice_its_delay_and_keeps_every_byte() {
        bounded(async {
            let line = DelayLine::start(Duration::from_millis(40)).await.unwrap();
            line.set_upstream(echo().await);
            let mut s = TcpStream::connect(line.addr).await.unwrap();
            let t0 = Instant::now();
            s.write_all(b"ping").await.unwrap();
            let mut got = [0u8; 4];
            s.read_exact(&mut got).await.unwrap();
            assert_eq!(&got, b"ping");
            assert!(
                t0.elapsed() >= Duration::from_millis(80),
                "{:?}",
                t0.elapsed()
            );
            // A megabyte in many chunks comes back whole and in order.
            let data: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 251) as u8).collect();
            let (mut r, mut w) = s.into_split();
            let sent = data.clone();
            let writer = tokio::spawn(async move {
                w.write_all(&sent).await.unwrap();
                w.shutdown().await.unwrap();
            });
            let mut back = Vec::new();
            r.read_to_end(&mut back).await.unwrap();
            writer.await.unwrap();
            assert_eq!(back.len(), data.len());
            assert!(back == data);
        })
        .await;
    }

    #[tokio::test]
    async fn a_line_without_an_upstream_closes_its_connections() {
        bounded(async {
            let line = DelayLine::start(Duration::from_millis(1)).await.unwrap();
            let mut s = TcpStream::connect(line.addr).await.unwrap();
            let mut buf = [0u8; 1];
            // Closed: end of stream (or a reset), never data.
            assert!(matches!(s.read(&mut buf).await, Ok(0) | Err(_)));
        })
        .await;
    }
}
