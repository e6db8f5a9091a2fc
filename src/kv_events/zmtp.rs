//! ZMTP 3 framing (NULL mechanism), bounded: what the replica's PUB socket (`publisher.rs`) and
//! the node's client (`replicas/zmtp.rs`) both speak.
//!
//! Exists because the `zeromq` crate (0.7) reserves a frame's declared length before its body
//! arrives and has no size limit: one 8-byte length field of 2^40 from anything listening on a
//! replica's event port aborts the node; and it neither sends nor answers ZMTP 3.1 heartbeats
//! (it drops a peer that sends `PING`). Here every length is checked against [`ZmtpLimits`]
//! *before* a byte is allocated for it; a frame or message over the limit, a malformed greeting
//! or command, or too many frames in one message end the connection with a [`ZmtpError`].
//!
//! Wire (ZMTP 3.1, rfc.zeromq.org/spec/37): a 64-byte greeting each way (signature `ff 0…0 7f`,
//! version 3.x, mechanism `NULL`, as-server 0), then a `READY` command with the `Socket-Type`,
//! then frames: a flags byte (bit 0 more, bit 1 long, bit 2 command), a 1- or 8-byte big-endian
//! size, the body. A SUB subscribes with a message `[0x01, topic…]` (the 3.0 form, which libzmq
//! and `zeromq` publishers both take). Heartbeats (3.1 only): `PING` carries a TTL (tenths of a
//! second) and a context of at most 16 bytes; the peer answers `PONG` with the same context.
//! libzmq ≥ 4.2 (pyzmq, so vLLM's publisher) answers `PING` on every socket type.

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
pub const MAX_COMMAND_BYTES: usize = 4096;
/// Longest `PING` context a peer may send (ZMTP 3.1: up to 16 bytes), echoed in `PONG`.
pub const MAX_PING_CONTEXT: usize = 16;

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
    /// Nothing arrived (no message, no `PONG`) for this long although heartbeats were sent.
    #[error("ZMTP peer silent for {0:?}")]
    Silent(Duration),
}

impl ZmtpError {
    /// Whether the peer broke a limit or the protocol (as opposed to a network failure): worth
    /// counting as malformed input.
    pub fn is_peer_fault(&self) -> bool {
        !matches!(
            self,
            ZmtpError::Io(_)
                | ZmtpError::Timeout(_)
                | ZmtpError::Endpoint(_)
                | ZmtpError::Silent(_)
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
    /// Publisher (to a SUB).
    Pub,
}

impl SocketType {
    pub fn name(self) -> &'static [u8] {
        match self {
            SocketType::Sub => b"SUB",
            SocketType::Dealer => b"DEALER",
            SocketType::Pub => b"PUB",
        }
    }

    /// Whether a peer announcing `peer` may talk to this socket type (ZMTP 3.0's table).
    pub fn accepts(self, peer: &[u8]) -> bool {
        match self {
            SocketType::Sub => matches!(peer, b"PUB" | b"XPUB"),
            SocketType::Dealer => matches!(peer, b"ROUTER" | b"DEALER" | b"REP"),
            SocketType::Pub => matches!(peer, b"SUB" | b"XSUB"),
        }
    }
}

/// The `Socket-Type` property of a `READY` command's properties (after the command name).
pub fn socket_type_property(mut props: &[u8]) -> Option<&[u8]> {
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

/// A 64-byte greeting: ZMTP 3.`minor`, NULL, as-server 0. The node's client says 3.0 (it
/// subscribes the 3.0 way and sends `PING` only to a peer that says 3.1); the replica's PUB says
/// 3.1 (it answers `PING`).
pub fn greeting(minor: u8) -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = minor;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// Checks a peer's greeting; returns its minor version (1 for ZMTP 3.1: it answers `PING`).
pub fn check_greeting(g: &[u8; 64]) -> Result<u8, ZmtpError> {
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
    Ok(if g[10] > 3 { u8::MAX } else { g[11] })
}

/// A `READY` command frame announcing `socket_type`.
pub fn ready(socket_type: SocketType) -> BytesMut {
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

/// What arrives after the handshake: one command, or one whole message.
#[derive(Debug, PartialEq, Eq)]
pub enum Incoming {
    /// A command's body (name length, name, data): `PING`, `PONG`, `SUBSCRIBE`, `ERROR`, ….
    Command(Bytes),
    /// A message's frames.
    Message(Vec<Bytes>),
}

/// Reads the next whole message, skipping commands, within `limits`. Generic over the reader
/// so the limits can be tested on bytes.
pub async fn read_message<R: AsyncReadExt + Unpin>(
    r: &mut R,
    limits: &ZmtpLimits,
) -> Result<Vec<Bytes>, ZmtpError> {
    loop {
        if let Incoming::Message(frames) = read_incoming(r, limits).await? {
            return Ok(frames);
        }
    }
}

/// Reads the next command or whole message, within `limits`.
pub async fn read_incoming<R: AsyncReadExt + Unpin>(
    r: &mut R,
    limits: &ZmtpLimits,
) -> Result<Incoming, ZmtpError> {
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
            return Ok(Incoming::Command(read_body(r, len as usize).await?));
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
            return Ok(Incoming::Message(frames));
        }
    }
}

/// A command frame with `name` and `data` (a `READY`'s properties, a `PING`'s TTL and context).
fn command(name: &[u8], data: &[u8]) -> BytesMut {
    let body_len = 1 + name.len() + data.len();
    let mut out = BytesMut::with_capacity(body_len + 9);
    if body_len > 255 {
        out.put_u8(0x06);
        out.put_u64(body_len as u64);
    } else {
        out.put_u8(0x04);
        out.put_u8(body_len as u8);
    }
    out.put_u8(name.len() as u8);
    out.put_slice(name);
    out.put_slice(data);
    out
}

/// A `PING` asking the peer to answer within `ttl` (sent in tenths of a second, at most
/// 6553.5 s) with `context` echoed (at most [`MAX_PING_CONTEXT`] bytes; more is cut).
pub fn ping(ttl: Duration, context: &[u8]) -> BytesMut {
    let ttl = u16::try_from(ttl.as_millis() / 100).unwrap_or(u16::MAX);
    let context = &context[..context.len().min(MAX_PING_CONTEXT)];
    let mut data = Vec::with_capacity(2 + context.len());
    data.extend_from_slice(&ttl.to_be_bytes());
    data.extend_from_slice(context);
    command(b"PING", &data)
}

/// The `PONG` answering a `PING` whose command body is `ping_body`, or `None` if it is not a
/// well-formed `PING` (too short, or a context over [`MAX_PING_CONTEXT`]).
pub fn pong_for(ping_body: &[u8]) -> Option<BytesMut> {
    let data = command_data(ping_body, b"PING")?;
    let context = data.get(2..)?;
    (context.len() <= MAX_PING_CONTEXT).then(|| command(b"PONG", context))
}

/// The data after a command body's name, if the command is `name`.
pub fn command_data<'a>(body: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    let (&len, rest) = body.split_first()?;
    let (got, data) = rest.split_at_checked(usize::from(len))?;
    got.eq_ignore_ascii_case(name).then_some(data)
}

/// Greets and exchanges `READY` on a fresh connection as `socket_type`, announcing ZMTP
/// 3.`minor`; checks that the peer's socket type may talk to ours. Returns the peer's minor
/// version. Unbounded in time: the caller puts a deadline on it.
pub async fn handshake<S: AsyncReadExt + AsyncWriteExt + Unpin>(
    stream: &mut S,
    socket_type: SocketType,
    minor: u8,
) -> Result<u8, ZmtpError> {
    stream.write_all(&greeting(minor)).await?;
    let mut peer = [0u8; 64];
    stream.read_exact(&mut peer).await?;
    let peer_minor = check_greeting(&peer)?;
    stream.write_all(&ready(socket_type)).await?;
    let (command, _, len) = read_header(stream).await?;
    if !command {
        return Err(ZmtpError::Handshake("first frame is not a command".into()));
    }
    if len > MAX_COMMAND_BYTES as u64 {
        return Err(ZmtpError::FrameTooLarge {
            declared: len,
            limit: MAX_COMMAND_BYTES,
        });
    }
    let body = read_body(stream, len as usize).await?;
    if let Some(props) = command_data(&body, b"READY") {
        let peer = socket_type_property(props).unwrap_or_default();
        if !socket_type.accepts(peer) {
            return Err(ZmtpError::Handshake(format!(
                "peer socket type {:?} cannot talk to {:?}",
                String::from_utf8_lossy(peer),
                String::from_utf8_lossy(socket_type.name())
            )));
        }
        return Ok(peer_minor);
    }
    match command_data(&body, b"ERROR") {
        Some(reason) => Err(ZmtpError::Handshake(format!(
            "peer refused: {}",
            String::from_utf8_lossy(reason.get(1..).unwrap_or_default())
        ))),
        None => Err(ZmtpError::Handshake("expected READY".into())),
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
    fn greetings() {
        assert_eq!(check_greeting(&greeting(0)).unwrap(), 0);
        assert_eq!(check_greeting(&greeting(1)).unwrap(), 1);
        let mut g = greeting(0);
        g[12..17].copy_from_slice(b"CURVE");
        assert!(check_greeting(&g).is_err());
        let mut g = greeting(0);
        g[10] = 2;
        assert!(check_greeting(&g).is_err());
    }
}
