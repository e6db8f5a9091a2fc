//! A small ZMTP 3 client (NULL mechanism) for the two sockets the node opens to an engine: SUB
//! for live KV events and DEALER for replays.
//!
//! Exists because the `zeromq` crate (0.7) reserves a frame's declared length before its body
//! arrives and has no size limit: one 8-byte length field of 2^40 from anything listening on a
//! replica's event port aborts the node. Here every length is checked against [`ZmtpLimits`]
//! *before* a byte is allocated for it; a frame or message over the limit, a malformed greeting
//! or command, or too many frames in one message end the connection with a [`ZmtpError`] (the
//! caller counts it and reconnects with backoff).
//!
//! Wire (ZMTP 3.0, rfc.zeromq.org/spec/23): a 64-byte greeting each way (signature `ff 0…0 7f`,
//! version 3.0, mechanism `NULL`, as-server 0), then a `READY` command with our `Socket-Type`,
//! then frames: a flags byte (bit 0 more, bit 1 long, bit 2 command), a 1- or 8-byte big-endian
//! size, the body. A SUB subscribes with a message `[0x01, topic…]` (the 3.0 form, which libzmq
//! and `zeromq` publishers both take). Peers' commands after `READY` (3.1 `PING`, …) are read
//! within the limits and ignored.

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Bounds on what a peer may make this client read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZmtpLimits {
    /// Largest frame body accepted (bytes).
    pub max_frame_bytes: usize,
    /// Largest message accepted, all frames together (bytes).
    pub max_message_bytes: usize,
    /// Most frames in one message.
    pub max_frames: usize,
}

impl Default for ZmtpLimits {
    fn default() -> Self {
        ZmtpLimits {
            max_frame_bytes: 4 << 20,
            max_message_bytes: 4 << 20,
            max_frames: 16,
        }
    }
}

/// Largest command body accepted (`READY` with its properties, `PING`, `ERROR`).
const MAX_COMMAND_BYTES: usize = 4096;

/// Why a connection failed or ended.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    /// The endpoint is not `tcp://host:port`.
    #[error("bad ZMQ endpoint '{0}': must be tcp://host:port")]
    Endpoint(String),
    /// Connecting or handshaking took too long.
    #[error("ZMTP connect to {0} timed out")]
    Timeout(String),
    /// The socket failed.
    #[error("ZMTP I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The peer's greeting is not ZMTP 3 with the NULL mechanism.
    #[error("bad ZMTP greeting: {0}")]
    Greeting(&'static str),
    /// The peer broke the handshake or sent a malformed command.
    #[error("ZMTP handshake failed: {0}")]
    Handshake(String),
    /// A frame declared more than the limit.
    #[error("ZMTP frame of {declared} bytes exceeds the {limit}-byte limit")]
    FrameTooLarge {
        /// The length the peer declared.
        declared: u64,
        /// The limit.
        limit: usize,
    },
    /// A message's frames add up to more than the limit, or it has too many frames.
    #[error("ZMTP message exceeds the limit ({0})")]
    MessageTooLarge(&'static str),
}

impl ZmtpError {
    /// Whether the peer broke a limit or the protocol (as opposed to a network failure): worth
    /// counting as malformed input.
    pub fn is_peer_fault(&self) -> bool {
        !matches!(
            self,
            ZmtpError::Io(_) | ZmtpError::Timeout(_) | ZmtpError::Endpoint(_)
        )
    }
}

/// The socket type announced in `READY`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketType {
    /// Subscriber (to a PUB).
    Sub,
    /// Dealer (to a ROUTER).
    Dealer,
}

impl SocketType {
    fn name(self) -> &'static [u8] {
        match self {
            SocketType::Sub => b"SUB",
            SocketType::Dealer => b"DEALER",
        }
    }

    /// Whether a peer announcing `peer` may talk to this socket type (ZMTP 3.0's table).
    fn accepts(self, peer: &[u8]) -> bool {
        match self {
            SocketType::Sub => matches!(peer, b"PUB" | b"XPUB"),
            SocketType::Dealer => matches!(peer, b"ROUTER" | b"DEALER" | b"REP"),
        }
    }
}

/// The `Socket-Type` property of a `READY` command's properties (after the command name).
fn socket_type_property(mut props: &[u8]) -> Option<&[u8]> {
    while let Some((&name_len, rest)) = props.split_first() {
        let name = rest.get(..usize::from(name_len))?;
        let rest = &rest[usize::from(name_len)..];
        let len = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?) as usize;
        let value = rest.get(4..4usize.checked_add(len)?)?;
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            return Some(value);
        }
        props = &rest[4 + len..];
    }
    None
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

/// The 64-byte greeting this client sends: ZMTP 3.0, NULL, as-server 0.
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// Checks a peer's greeting.
pub fn check_greeting(g: &[u8; 64]) -> Result<(), ZmtpError> {
    if g[0] != 0xff || g[9] & 1 != 1 {
        return Err(ZmtpError::Greeting("bad signature"));
    }
    if g[10] < 3 {
        return Err(ZmtpError::Greeting("ZMTP version before 3"));
    }
    let mech = &g[12..32];
    let end = mech.iter().position(|&b| b == 0).unwrap_or(mech.len());
    if &mech[..end] != b"NULL" {
        return Err(ZmtpError::Greeting("mechanism is not NULL"));
    }
    Ok(())
}

/// A `READY` command frame announcing `socket_type`.
fn ready(socket_type: SocketType) -> BytesMut {
    let name = socket_type.name();
    let mut body = BytesMut::new();
    body.put_u8(5);
    body.put_slice(b"READY");
    body.put_u8(11);
    body.put_slice(b"Socket-Type");
    body.put_u32(name.len() as u32);
    body.put_slice(name);
    let mut out = BytesMut::with_capacity(body.len() + 2);
    out.put_u8(0x04);
    out.put_u8(body.len() as u8);
    out.put_slice(&body);
    out
}

/// Encodes one message's frames (data frames, MORE on all but the last).
pub fn encode_message(frames: &[&[u8]]) -> BytesMut {
    let mut out = BytesMut::new();
    for (i, f) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { 1 } else { 0 };
        if f.len() > 255 {
            out.put_u8(0x02 | more);
            out.put_u64(f.len() as u64);
        } else {
            out.put_u8(more);
            out.put_u8(f.len() as u8);
        }
        out.put_slice(f);
    }
    out
}

/// One frame header: (command, more, declared length).
async fn read_header<R: AsyncReadExt + Unpin>(r: &mut R) -> Result<(bool, bool, u64), ZmtpError> {
    let flags = r.read_u8().await?;
    if flags & !0x07 != 0 {
        return Err(ZmtpError::Handshake(format!(
            "bad frame flags {flags:#04x}"
        )));
    }
    let len = if flags & 0x02 != 0 {
        r.read_u64().await?
    } else {
        u64::from(r.read_u8().await?)
    };
    Ok((flags & 0x04 != 0, flags & 0x01 != 0, len))
}

/// Reads exactly `len` bytes, already checked against a limit.
async fn read_body<R: AsyncReadExt + Unpin>(r: &mut R, len: usize) -> Result<Bytes, ZmtpError> {
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf).await?;
    Ok(Bytes::from(buf))
}

/// Reads the next whole message, skipping commands, within `limits`. Generic over the reader
/// so the limits can be tested on bytes.
pub async fn read_message<R: AsyncReadExt + Unpin>(
    r: &mut R,
    limits: &ZmtpLimits,
) -> Result<Vec<Bytes>, ZmtpError> {
    let mut frames = Vec::new();
    let mut total = 0usize;
    loop {
        let (command, more, len) = read_header(r).await?;
        if command {
            if !frames.is_empty() {
                return Err(ZmtpError::Handshake("command inside a message".into()));
            }
            if len > MAX_COMMAND_BYTES as u64 {
                return Err(ZmtpError::FrameTooLarge {
                    declared: len,
                    limit: MAX_COMMAND_BYTES,
                });
            }
            // Heartbeats and other commands after READY carry nothing we act on.
            read_body(r, len as usize).await?;
            continue;
        }
        let limit = limits.max_frame_bytes;
        let len =
            usize::try_from(len)
                .ok()
                .filter(|l| *l <= limit)
                .ok_or(ZmtpError::FrameTooLarge {
                    declared: len,
                    limit,
                })?;
        total = total.saturating_add(len);
        if total > limits.max_message_bytes {
            return Err(ZmtpError::MessageTooLarge("bytes"));
        }
        if frames.len() >= limits.max_frames {
            return Err(ZmtpError::MessageTooLarge("frames"));
        }
        frames.push(read_body(r, len).await?);
        if !more {
            return Ok(frames);
        }
    }
}

/// One connected, handshaken ZMTP peer.
pub struct ZmtpConnection {
    stream: BufReader<TcpStream>,
    limits: ZmtpLimits,
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
        let handshake = async {
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            let _ = tcp.set_nodelay(true);
            let mut stream = BufReader::new(tcp);
            stream.get_mut().write_all(&greeting()).await?;
            let mut peer = [0u8; 64];
            stream.read_exact(&mut peer).await?;
            check_greeting(&peer)?;
            stream.get_mut().write_all(&ready(socket_type)).await?;
            let (command, _, len) = read_header(&mut stream).await?;
            if !command {
                return Err(ZmtpError::Handshake("first frame is not a command".into()));
            }
            if len > MAX_COMMAND_BYTES as u64 {
                return Err(ZmtpError::FrameTooLarge {
                    declared: len,
                    limit: MAX_COMMAND_BYTES,
                });
            }
            let body = read_body(&mut stream, len as usize).await?;
            match body.split_first() {
                Some((5, rest)) if rest.starts_with(b"READY") => {
                    let peer = socket_type_property(&rest[5..]).unwrap_or_default();
                    if !socket_type.accepts(peer) {
                        return Err(ZmtpError::Handshake(format!(
                            "peer socket type {:?} cannot talk to {:?}",
                            String::from_utf8_lossy(peer),
                            String::from_utf8_lossy(socket_type.name())
                        )));
                    }
                }
                Some((5, rest)) if rest.starts_with(b"ERROR") => {
                    return Err(ZmtpError::Handshake(format!(
                        "peer refused: {}",
                        String::from_utf8_lossy(rest.get(6..).unwrap_or_default())
                    )))
                }
                _ => return Err(ZmtpError::Handshake("expected READY".into())),
            }
            Ok(ZmtpConnection { stream, limits })
        };
        tokio::time::timeout(timeout, handshake)
            .await
            .map_err(|_| ZmtpError::Timeout(endpoint.to_owned()))?
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
        self.stream.get_mut().write_all(&bytes).await?;
        Ok(())
    }

    /// Receives the next message, within the limits.
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        read_message(&mut self.stream, &self.limits).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .map(|rt| rt.block_on(f))
            .expect("runtime")
    }

    #[test]
    fn the_peers_socket_type_must_match() {
        // Our own READY, as a peer would send it: a DEALER is fine for a DEALER, not for a SUB.
        let frame = ready(SocketType::Dealer);
        let props = &frame[2 + 6..];
        assert_eq!(socket_type_property(props), Some(&b"DEALER"[..]));
        assert!(SocketType::Dealer.accepts(b"DEALER"));
        assert!(!SocketType::Sub.accepts(b"DEALER"));
        assert!(SocketType::Sub.accepts(b"PUB"));
        // Truncated or absurd lengths read as "none", never out of bounds.
        assert_eq!(socket_type_property(&[11, b'S']), None);
        assert_eq!(socket_type_property(&[0, 0xff, 0xff, 0xff, 0xff]), None);
    }

    #[test]
    fn frames_round_trip() {
        let bytes = encode_message(&[b"topic", &[7u8; 300], b""]);
        let got = run(read_message(&mut &bytes[..], &ZmtpLimits::default())).unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(
            (&got[0][..], got[1].len(), got[2].len()),
            (&b"topic"[..], 300, 0)
        );
    }

    #[test]
    fn a_huge_declared_frame_is_refused_before_allocating() {
        // A long frame declaring 2^40 bytes, and no body: refused from the header alone.
        let mut bytes = vec![0x02];
        bytes.extend_from_slice(&(1u64 << 40).to_be_bytes());
        let err = run(read_message(&mut &bytes[..], &ZmtpLimits::default())).unwrap_err();
        assert!(matches!(err, ZmtpError::FrameTooLarge { declared, .. } if declared == 1 << 40));
        assert!(err.is_peer_fault());
        // u64::MAX too, and a command over its own limit.
        let mut bytes = vec![0x06];
        bytes.extend_from_slice(&u64::MAX.to_be_bytes());
        assert!(run(read_message(&mut &bytes[..], &ZmtpLimits::default())).is_err());
    }

    #[test]
    fn message_limits_count_frames_and_bytes() {
        let limits = ZmtpLimits {
            max_frame_bytes: 100,
            max_message_bytes: 150,
            max_frames: 3,
        };
        let two = encode_message(&[&[0u8; 100], &[0u8; 100]]);
        assert!(matches!(
            run(read_message(&mut &two[..], &limits)),
            Err(ZmtpError::MessageTooLarge("bytes"))
        ));
        let many = encode_message(&[b"a", b"b", b"c", b"d"]);
        assert!(matches!(
            run(read_message(&mut &many[..], &limits)),
            Err(ZmtpError::MessageTooLarge("frames"))
        ));
        // A command between messages is skipped; truncation is an I/O error, never a panic.
        let mut with_ping = vec![0x04, 5, 4, b'P', b'I', b'N', b'G'];
        with_ping.extend_from_slice(&encode_message(&[b"x"]));
        assert_eq!(
            run(read_message(&mut &with_ping[..], &limits))
                .unwrap()
                .len(),
            1
        );
        assert!(run(read_message(&mut &two[..5], &limits)).is_err());
        assert!(run(read_message(&mut &[0xf0u8, 1, 1][..], &limits)).is_err());
    }

    #[test]
    fn greetings_and_endpoints() {
        check_greeting(&greeting()).unwrap();
        let mut g = greeting();
        g[12..17].copy_from_slice(b"CURVE");
        assert!(check_greeting(&g).is_err());
        let mut g = greeting();
        g[10] = 2;
        assert!(check_greeting(&g).is_err());
        assert_eq!(
            parse_endpoint("tcp://[::1]:5557").unwrap(),
            ("::1".into(), 5557)
        );
        assert_eq!(parse_endpoint("tcp://a.b:1").unwrap(), ("a.b".into(), 1));
        assert!(parse_endpoint("tcp://:1").is_err());
        assert!(parse_endpoint("ipc://x").is_err());
    }
}
