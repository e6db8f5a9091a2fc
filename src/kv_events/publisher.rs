//! The replica side of vLLM's KV-event transport: a ZMQ PUB socket sending one 3-frame message
//! (topic, 8-byte big-endian sequence, msgpack `EventBatch`) per engine step, and a ROUTER socket
//! replaying buffered batches to subscribers that missed some (`["", seq]` from a DEALER is
//! answered with `["", seq, payload]` per batch with a sequence ≥ seq, then `["", ff×8, ""]`).
//! Uses the pure-Rust `zeromq` crate, so no libzmq is needed.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{Endpoint, PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::wire::{encode_batch, EventBatch, END_OF_REPLAY_SEQ};

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
    /// Binding a socket failed.
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
        let mut publisher = PubSocket::new();
        let port = bind(&mut publisher, "PUB", &cfg.host, cfg.port).await?;
        let ring: Ring = Arc::new(Mutex::new(VecDeque::new()));
        let mut tasks = Vec::new();
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
            publisher,
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

async fn publish_loop(
    mut socket: PubSocket,
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
        let frames = vec![
            topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ];
        if let Some(msg) = message(frames) {
            if let Err(e) = socket.send(msg).await {
                tracing::debug!(error = %e, seq, "PUB send failed");
            }
        }
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
