//! Every UDP byte the mesh endpoint sends and receives, packet headers, handshakes, ACKs and
//! keep-alives included.
//!
//! The transport's own counters see payloads (a gossip message, a summary); what an operator pays
//! for, and what the mesh's growth law is checked against, is the wire. quinn keeps per-connection
//! statistics that vanish with the connection, so the endpoint's socket is wrapped instead: the
//! wrapper forwards every call to the runtime's socket and adds up what went through.

use std::fmt;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};

/// Bytes through the endpoint's socket, both ways.
#[derive(Debug, Default)]
pub struct UdpBytes {
    /// Datagram bytes handed to the kernel.
    pub sent: AtomicU64,
    /// Datagram bytes received.
    pub received: AtomicU64,
}

/// A socket that counts into a shared [`UdpBytes`].
pub struct CountingSocket {
    inner: Arc<dyn AsyncUdpSocket>,
    bytes: Arc<UdpBytes>,
}

impl CountingSocket {
    /// Wraps `inner`, counting into `bytes`.
    pub fn new(inner: Arc<dyn AsyncUdpSocket>, bytes: Arc<UdpBytes>) -> Self {
        CountingSocket { inner, bytes }
    }
}

impl fmt::Debug for CountingSocket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CountingSocket")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl AsyncUdpSocket for CountingSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        Arc::clone(&self.inner).create_io_poller()
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        self.inner.try_send(transmit)?;
        self.bytes
            .sent
            .fetch_add(transmit.contents.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let polled = self.inner.poll_recv(cx, bufs, meta);
        if let Poll::Ready(Ok(n)) = &polled {
            let got: usize = meta.iter().take(*n).map(|m| m.len).sum();
            self.bytes.received.fetch_add(got as u64, Ordering::Relaxed);
        }
        polled
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}
