//! The replica side of vLLM's KV-event transport: a ZMQ PUB socket sending one 3-frame message
//! (topic, 8-byte big-endian sequence, msgpack `EventBatch`) per engine step, and a ROUTER socket
//! replaying buffered batches to subscribers that missed some (`["", seq]` from a DEALER is
//! answered with `["", seq, payload]` per batch with a sequence ≥ seq, then `["", ff×8, ""]`).
//!
//! The PUB socket is this crate's own ZMTP 3.1 (`zmtp.rs`), like libzmq's: it answers a
//! subscriber's `PING` with `PONG` (so a node can tell a stopped engine from an idle one), takes
//! subscriptions as 3.0 messages or 3.1 commands, and drops messages for a subscriber whose
//! queue is full ([`SUBSCRIBER_QUEUE`], ZMQ's high-water mark). The ROUTER uses the pure-Rust
//! `zeromq` crate; no libzmq is needed.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use zeromq::{Endpoint, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::wire::{encode_batch, EventBatch, END_OF_REPLAY_SEQ};
use super::zmtp::{
    command_data, encode_message, handshake, pong_for, read_incoming, Incoming, SocketType,
    ZmtpLimits,
};

/// Messages queued for one subscriber before new ones are dropped (ZMQ's default SNDHWM).
pub const SUBSCRIBER_QUEUE: usize = 1000;
/// Longest handshake of a subscriber.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Topics one subscriber may hold.
const MAX_TOPICS: usize = 64;
/// What a subscriber may send: subscriptions and commands, small.
const SUBSCRIBER_LIMITS: ZmtpLimits = ZmtpLimits {
    max_frame_bytes: 4096,
    max_message_bytes: 4096,
    max_frames: 4,
};

/// Where and how to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvPublisherConfig {
    /// Interface to bind, e.g. "127.0.0.1".
    pub host: String,
    /// PUB port; 0 picks a free one.
    pub port: u16,
    /// ROUTER replay port; 0 picks a free one, `None` disables replay.
    pub replay_port: Option<u16>,
    /// First frame of every message. vLLM's default is "".
    pub topic: String,
    /// Batches kept for replay. vLLM's default is 10,000.
    pub buffer_steps: usize,
}

/// Errors starting the publisher.
#[derive(Debug, thiserror::Error)]
pub enum PublisherError {
    /// Binding the PUB socket failed.
    #[error("binding the KV-event PUB socket on {endpoint}: {source}")]
    Listen {
        /// The address tried.
        endpoint: String,
        /// The cause.
        source: std::io::Error,
    },
    /// Binding the ROUTER socket failed.
    #[error("binding ZMQ {what} socket on {endpoint}: {source}")]
    Bind {
        /// "PUB" or "ROUTER".
        what: &'static str,
        /// The endpoint tried.
        endpoint: String,
        /// The cause.
        source: zeromq::ZmqError,
    },
    /// A data-parallel rank's port (base + rank) is past 65535.
    #[error("port {0} + rank {1} is past 65535")]
    PortRange(u16, u16),
}

type Ring = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// A running publisher. Dropping it stops both sockets.
#[derive(Debug)]
pub struct KvPublisher {
    tx: mpsc::UnboundedSender<EventBatch>,
    port: u16,
    replay_port: Option<u16>,
    tasks: Vec<JoinHandle<()>>,
}

fn bound_port(endpoint: &Endpoint) -> u16 {
    match endpoint {
        Endpoint::Tcp(_, port) => *port,
        _ => 0,
    }
}

async fn bind<S: Socket>(
    socket: &mut S,
    what: &'static str,
    host: &str,
    port: u16,
) -> Result<u16, PublisherError> {
    let endpoint = format!("tcp://{host}:{port}");
    socket
        .bind(&endpoint)
        .await
        .map(|e| bound_port(&e))
        .map_err(|source| PublisherError::Bind {
            what,
            endpoint,
            source,
        })
}

impl KvPublisher {
    /// Binds the sockets and starts publishing.
    pub async fn start(cfg: KvPublisherConfig) -> Result<Self, PublisherError> {
        let host = match cfg.host.trim_start_matches('[').trim_end_matches(']') {
            "*" => "0.0.0.0",
            h => h,
        };
        let listener = TcpListener::bind((host, cfg.port))
            .await
            .map_err(|source| PublisherError::Listen {
                endpoint: format!("{}:{}", cfg.host, cfg.port),
                source,
            })?;
        let port = listener.local_addr().map_or(cfg.port, |a| a.port());
        let subscribers: Subscribers = Arc::default();
        let ring: Ring = Arc::new(Mutex::new(VecDeque::new()));
        let mut tasks = vec![tokio::spawn(accept_subscribers(
            listener,
            Arc::clone(&subscribers),
        ))];
        let replay_port = match cfg.replay_port {
            Some(p) => {
                let mut router = RouterSocket::new();
                let bound = bind(&mut router, "ROUTER", &cfg.host, p).await?;
                tasks.push(tokio::spawn(serve_replay(router, ring.clone())));
                Some(bound)
            }
            None => None,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        tasks.push(tokio::spawn(publish_loop(
            subscribers,
            rx,
            ring,
            cfg.topic,
            cfg.buffer_steps.max(1),
        )));
        tracing::info!(port, ?replay_port, "KV event publisher listening");
        Ok(Self {
            tx,
            port,
            replay_port,
            tasks,
        })
    }

    /// Queues a batch for publication; it gets the next sequence number.
    pub fn publish(&self, batch: EventBatch) {
        if self.tx.send(batch).is_err() {
            tracing::warn!("KV event publisher stopped; dropping a batch");
        }
    }

    /// The bound PUB port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The bound replay port, if replay is enabled.
    pub fn replay_port(&self) -> Option<u16> {
        self.replay_port
    }
}

impl Drop for KvPublisher {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

fn message(frames: Vec<Bytes>) -> Option<ZmqMessage> {
    ZmqMessage::try_from(frames).ok()
}

/// One connected subscriber: its topics and its queue of encoded messages.
struct Subscriber {
    /// Connection number (to remove it).
    id: u64,
    /// Topic prefixes it subscribed to.
    topics: Vec<Bytes>,
    /// Encoded frames to write; full → the message is dropped for it.
    queue: mpsc::Sender<Bytes>,
}

type Subscribers = Arc<Mutex<Vec<Subscriber>>>;

fn lock(subs: &Subscribers) -> std::sync::MutexGuard<'_, Vec<Subscriber>> {
    subs.lock().unwrap_or_else(|p| p.into_inner())
}

/// Accepts subscribers until aborted (their tasks end with it).
async fn accept_subscribers(listener: TcpListener, subscribers: Subscribers) {
    let mut connections = JoinSet::new();
    let mut next_id = 0u64;
    loop {
        // Reap finished connections so the set stays as large as the live ones.
        while connections.try_join_next().is_some() {}
        match listener.accept().await {
            Ok((stream, _)) => {
                next_id += 1;
                connections.spawn(serve_subscriber(stream, next_id, Arc::clone(&subscribers)));
            }
            Err(e) => {
                tracing::debug!(error = %e, "KV-event PUB accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// One subscriber: handshake, then its subscriptions and `PING`s in, its messages out.
async fn serve_subscriber(mut stream: TcpStream, id: u64, subscribers: Subscribers) {
    let _ = stream.set_nodelay(true);
    match tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        handshake(&mut stream, SocketType::Pub, 1),
    )
    .await
    {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "KV-event subscriber handshake failed");
            return;
        }
        Err(_) => {
            tracing::debug!("KV-event subscriber handshake timed out");
            return;
        }
    }
    let (read, mut write) = stream.into_split();
    let mut read = tokio::io::BufReader::new(read);
    let (queue, mut out) = mpsc::channel::<Bytes>(SUBSCRIBER_QUEUE);
    lock(&subscribers).push(Subscriber {
        id,
        topics: Vec::new(),
        queue: queue.clone(),
    });
    let writer = async move {
        while let Some(frame) = out.recv().await {
            if write.write_all(&frame).await.is_err() {
                return;
            }
        }
    };
    let reader = async {
        while let Ok(incoming) = read_incoming(&mut read, &SUBSCRIBER_LIMITS).await {
            match incoming {
                Incoming::Command(body) => {
                    if let Some(pong) = pong_for(&body) {
                        // A full queue drops the PONG like any message: the node then sees a
                        // subscriber too slow to keep up, which it is.
                        let _ = queue.try_send(pong.freeze());
                    } else if let Some(topic) = command_data(&body, b"SUBSCRIBE") {
                        subscribe(&subscribers, id, topic, true);
                    } else if let Some(topic) = command_data(&body, b"CANCEL") {
                        subscribe(&subscribers, id, topic, false);
                    }
                }
                Incoming::Message(frames) => match frames.first().map(|f| f.split_first()) {
                    Some(Some((1, topic))) => subscribe(&subscribers, id, topic, true),
                    Some(Some((0, topic))) => subscribe(&subscribers, id, topic, false),
                    _ => {}
                },
            }
        }
    };
    tokio::select! {
        _ = writer => {}
        _ = reader => {}
    }
    lock(&subscribers).retain(|s| s.id != id);
}

/// Adds (or cancels) subscriber `id`'s subscription to `topic`.
fn subscribe(subscribers: &Subscribers, id: u64, topic: &[u8], on: bool) {
    let mut subs = lock(subscribers);
    let Some(s) = subs.iter_mut().find(|s| s.id == id) else {
        return;
    };
    if on {
        if s.topics.len() < MAX_TOPICS && !s.topics.iter().any(|t| t.as_ref() == topic) {
            s.topics.push(Bytes::copy_from_slice(topic));
        }
    } else if let Some(at) = s.topics.iter().position(|t| t.as_ref() == topic) {
        s.topics.swap_remove(at);
    }
}

/// Queues `frame` (one encoded message whose topic is `topic`) for every matching subscriber.
fn fan_out(subscribers: &Subscribers, topic: &[u8], frame: &Bytes) {
    for s in lock(subscribers).iter() {
        if s.topics.iter().any(|t| topic.starts_with(t)) {
            // Full: dropped for this subscriber (it will see a sequence gap and replay).
            let _ = s.queue.try_send(frame.clone());
        }
    }
}

async fn publish_loop(
    subscribers: Subscribers,
    mut rx: mpsc::UnboundedReceiver<EventBatch>,
    ring: Ring,
    topic: String,
    buffer_steps: usize,
) {
    let topic = Bytes::from(topic.into_bytes());
    let mut seq: u64 = 0;
    while let Some(batch) = rx.recv().await {
        let payload = Bytes::from(encode_batch(&batch));
        if let Ok(mut ring) = ring.lock() {
            if ring.len() >= buffer_steps {
                ring.pop_front();
            }
            ring.push_back((seq, payload.clone()));
        }
        let frame = encode_message(&[&topic, &seq.to_be_bytes(), &payload]).freeze();
        fan_out(&subscribers, &topic, &frame);
        seq += 1;
    }
}

async fn serve_replay(mut socket: RouterSocket, ring: Ring) {
    loop {
        let msg = match socket.recv().await {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(error = %e, "replay socket receive failed");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let frames = msg.into_vec();
        // [identity, "", seq] from a DEALER; tolerate a missing delimiter.
        let (Some(identity), Some(last)) = (frames.first(), frames.last()) else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(last.as_ref()) else {
            tracing::debug!(frames = frames.len(), "malformed replay request");
            continue;
        };
        let start = u64::from_be_bytes(start);
        let batches: Vec<(u64, Bytes)> = match ring.lock() {
            Ok(ring) => ring.iter().filter(|(s, _)| *s >= start).cloned().collect(),
            Err(_) => Vec::new(),
        };
        let empty = Bytes::new();
        for (seq, payload) in batches {
            let frames = vec![
                identity.clone(),
                empty.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            if let Some(m) = message(frames) {
                if socket.send(m).await.is_err() {
                    break;
                }
            }
        }
        let end = vec![
            identity.clone(),
            empty.clone(),
            Bytes::from_static(&END_OF_REPLAY_SEQ),
            empty,
        ];
        if let Some(m) = message(end) {
            if let Err(e) = socket.send(m).await {
                tracing::debug!(error = %e, "replay end marker send failed");
            }
        }
    }
}
