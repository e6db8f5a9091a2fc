//! The node's ZMTP 3 client (NULL mechanism) for the two sockets it opens to an engine: SUB for
//! live KV events and DEALER for replays. The framing, every length bounded before a byte is
//! allocated, is `kv_events::zmtp`; this adds connecting, deadlines and heartbeats.
//!
//! **Watching for silence.** A publisher that vanishes without closing its connection (host
//! gone, process stopped, a network partition) would otherwise leave the subscriber waiting
//! forever, and the replica's cache model "exact" and frozen. [`ZmtpConnection::heartbeat`]
//! turns on TCP keepalive (a dead host is found by the kernel) and, when the peer speaks ZMTP
//! 3.1 (libzmq ≥ 4.2, so vLLM's pyzmq publisher, and `kvmesh replica`), sends a `PING` every
//! `every`; anything received — a message or the `PONG` — counts as heard, and nothing heard for
//! `silence` ends the connection with [`ZmtpError::Silent`]. A ZMTP 3.0 peer (which may drop a
//! `PING`) gets no pings and no deadline: an idle stream is not a dead one.

use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::time::Instant;

pub use crate::kv_events::zmtp::{encode_message, read_message, SocketType, ZmtpError, ZmtpLimits};
use crate::kv_events::zmtp::{handshake, ping, read_incoming, Incoming};

/// Heartbeat state of a connection whose peer answers `PING`.
#[derive(Debug)]
struct Heartbeat {
    /// Time between two `PING`s.
    every: Duration,
    /// Longest time with nothing received before the peer counts as gone.
    silence: Duration,
    /// When something last arrived.
    last_heard: Instant,
    /// When the next `PING` is due.
    next_ping: Instant,
}

/// `tcp://host:port` → (host without IPv6 brackets, port).
pub fn parse_endpoint(endpoint: &str) -> Result<(String, u16), ZmtpError> {
    let bad = || ZmtpError::Endpoint(endpoint.to_owned());
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(bad)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(bad());
    }
    let port = port.parse::<u16>().map_err(|_| bad())?;
    Ok((host.to_owned(), port))
}

/// One connected, handshaken ZMTP peer.
pub struct ZmtpConnection {
    /// The receiving half, buffered.
    reader: BufReader<OwnedReadHalf>,
    /// The sending half (subscriptions, requests, `PING`s).
    writer: OwnedWriteHalf,
    limits: ZmtpLimits,
    /// The peer's ZMTP minor version (1: it answers `PING`).
    peer_minor: u8,
    /// Set by [`ZmtpConnection::heartbeat`] when the peer answers `PING`.
    heartbeat: Option<Heartbeat>,
}

impl ZmtpConnection {
    /// Connects to `endpoint` (`tcp://host:port`) and handshakes as `socket_type`, all within
    /// `timeout`.
    pub async fn connect(
        endpoint: &str,
        socket_type: SocketType,
        limits: ZmtpLimits,
        timeout: Duration,
    ) -> Result<Self, ZmtpError> {
        let (host, port) = parse_endpoint(endpoint)?;
        let connect = async {
            let mut tcp = TcpStream::connect((host.as_str(), port)).await?;
            let _ = tcp.set_nodelay(true);
            // The client says 3.0: it subscribes the 3.0 way, which every publisher takes.
            let peer_minor = handshake(&mut tcp, socket_type, 0).await?;
            let (read, writer) = tcp.into_split();
            Ok(ZmtpConnection {
                reader: BufReader::new(read),
                writer,
                limits,
                peer_minor,
                heartbeat: None,
            })
        };
        tokio::time::timeout(timeout, connect)
            .await
            .map_err(|_| ZmtpError::Timeout(endpoint.to_owned()))?
    }

    /// Watches the peer for silence from now on: TCP keepalive (first probe after `silence`
    /// idle, then every `every`, 3 probes), and with a ZMTP 3.1 peer a `PING` every `every`
    /// and [`ZmtpError::Silent`] from [`ZmtpConnection::recv`] when nothing arrived for
    /// `silence`. Returns whether the peer is pinged.
    pub fn heartbeat(&mut self, every: Duration, silence: Duration) -> bool {
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(silence)
            .with_interval(every)
            .with_retries(3);
        if let Err(e) = socket2::SockRef::from(self.writer.as_ref()).set_tcp_keepalive(&keepalive) {
            tracing::debug!(error = %e, "cannot set TCP keepalive");
        }
        if self.peer_minor < 1 {
            return false;
        }
        let now = Instant::now();
        self.heartbeat = Some(Heartbeat {
            every,
            silence,
            last_heard: now,
            next_ping: now + every,
        });
        true
    }

    /// SUB: subscribes to messages whose first frame starts with `topic` ("" = all).
    pub async fn subscribe(&mut self, topic: &[u8]) -> Result<(), ZmtpError> {
        let mut sub = Vec::with_capacity(topic.len() + 1);
        sub.push(1);
        sub.extend_from_slice(topic);
        self.send(&[&sub]).await
    }

    /// Sends one message.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), ZmtpError> {
        let bytes = encode_message(frames);
        self.writer.write_all(&bytes).await?;
        Ok(())
    }

    /// Receives the next message, within the limits; with a heartbeat, pings on time and fails
    /// with [`ZmtpError::Silent`] once the peer has been silent too long. Not cancel-safe (a
    /// message half read is lost): cancel only to drop the connection.
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        loop {
            let incoming = match &mut self.heartbeat {
                None => read_incoming(&mut self.reader, &self.limits).await?,
                Some(hb) => {
                    let read = read_incoming(&mut self.reader, &self.limits);
                    let got = heartbeat_while(hb, &mut self.writer, read).await?;
                    hb.last_heard = Instant::now();
                    got
                }
            };
            // Commands (PONG, anything after READY) only prove the peer is there.
            if let Incoming::Message(frames) = incoming {
                return Ok(frames);
            }
        }
    }
}

/// Awaits `read`, sending `hb`'s `PING`s on `writer` meanwhile; fails once nothing was heard
/// for `hb.silence` (a `PING` write that stalls that long counts as silence too).
async fn heartbeat_while(
    hb: &mut Heartbeat,
    writer: &mut OwnedWriteHalf,
    read: impl std::future::Future<Output = Result<Incoming, ZmtpError>>,
) -> Result<Incoming, ZmtpError> {
    tokio::pin!(read);
    loop {
        tokio::select! {
            got = &mut read => return got,
            _ = tokio::time::sleep_until(hb.next_ping) => {
                let now = Instant::now();
                if now.duration_since(hb.last_heard) >= hb.silence {
                    return Err(ZmtpError::Silent(hb.silence));
                }
                // The TTL asks the peer to drop us in turn if our pings stop.
                let frame = ping(hb.silence, b"");
                tokio::time::timeout(hb.silence, writer.write_all(&frame))
                    .await
                    .map_err(|_| ZmtpError::Silent(hb.silence))??;
                hb.next_ping = now + hb.every;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_events::zmtp::{command_data, pong_for, ready, MAX_COMMAND_BYTES};
    use tokio::net::TcpListener;

    #[test]
    fn endpoints() {
        assert_eq!(
            parse_endpoint("tcp://[::1]:5557").unwrap(),
            ("::1".into(), 5557)
        );
        assert_eq!(parse_endpoint("tcp://a.b:1").unwrap(), ("a.b".into(), 1));
        assert!(parse_endpoint("tcp://:1").is_err());
        assert!(parse_endpoint("ipc://x").is_err());
    }

    /// A PUB peer on loopback speaking ZMTP 3.`minor` that answers `pongs` PINGs, then goes
    /// silent (keeps the connection open, reads and ignores everything). Returns its endpoint.
    async fn peer(minor: u8, pongs: usize) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            handshake(&mut s, SocketType::Pub, minor).await.unwrap();
            let limits = ZmtpLimits::default();
            let mut answered = 0;
            while let Ok(got) = read_incoming(&mut s, &limits).await {
                if let Incoming::Command(body) = got {
                    if answered < pongs {
                        if let Some(pong) = pong_for(&body) {
                            answered += 1;
                            s.write_all(&pong).await.unwrap();
                        }
                    }
                }
            }
        });
        format!("tcp://{addr}")
    }

    #[tokio::test]
    async fn a_peer_that_stops_answering_pings_is_found_silent() {
        let ep = peer(1, 3).await;
        let mut c = ZmtpConnection::connect(
            &ep,
            SocketType::Sub,
            ZmtpLimits::default(),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert!(c.heartbeat(Duration::from_millis(50), Duration::from_millis(300)));
        c.subscribe(b"").await.unwrap();
        let t0 = Instant::now();
        let err = tokio::time::timeout(Duration::from_secs(10), c.recv())
            .await
            .expect("silence is detected")
            .unwrap_err();
        assert!(matches!(err, ZmtpError::Silent(_)), "{err}");
        assert!(!err.is_peer_fault());
        // Three pongs kept it alive past one silence; then one silence and at most a ping more.
        assert!(
            t0.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t0.elapsed()
        );
    }

    #[tokio::test]
    async fn a_zmtp_3_0_peer_is_not_pinged() {
        let ep = peer(0, 0).await;
        let mut c = ZmtpConnection::connect(
            &ep,
            SocketType::Sub,
            ZmtpLimits::default(),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert!(!c.heartbeat(Duration::from_millis(20), Duration::from_millis(100)));
        // Idle, never silent: nothing ends the wait but our own deadline.
        assert!(tokio::time::timeout(Duration::from_millis(400), c.recv())
            .await
            .is_err());
    }

    #[test]
    fn ping_and_pong_frames() {
        let p = ping(Duration::from_secs(5), b"ctx");
        // Command flag, short size, then the body.
        assert_eq!((p[0], usize::from(p[1])), (0x04, p.len() - 2));
        let body = &p[2..];
        assert_eq!(
            command_data(body, b"PING"),
            Some(&[0, 50, b'c', b't', b'x'][..])
        );
        let pong = pong_for(body).unwrap();
        assert_eq!(command_data(&pong[2..], b"PONG"), Some(&b"ctx"[..]));
        // Not a PING, truncated, or an oversized context: no answer.
        assert!(pong_for(&ready(SocketType::Sub)[2..]).is_none());
        assert!(pong_for(&[4, b'P', b'I', b'N', b'G', 0]).is_none());
        let mut long = vec![4, b'P', b'I', b'N', b'G', 0, 1];
        long.extend_from_slice(&[0; 17]);
        assert!(pong_for(&long).is_none());
        assert!(long.len() < MAX_COMMAND_BYTES);
    }
}
