//! The HTTP listener, wrapped so the "refuse connections" fault can really close the listening
//! socket (clients then get ECONNREFUSED, as from a dead host) and reopen it on the same address.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

use super::faults::Faults;

/// A TCP listener that closes itself while the fault state says to refuse connections.
pub struct FaultyListener {
    inner: Option<TcpListener>,
    addr: SocketAddr,
    faults: Arc<Faults>,
    changed: Arc<Notify>,
}

impl FaultyListener {
    /// Wraps a bound listener. `changed` is notified whenever the fault settings change.
    pub fn new(
        listener: TcpListener,
        addr: SocketAddr,
        faults: Arc<Faults>,
        changed: Arc<Notify>,
    ) -> Self {
        Self {
            inner: Some(listener),
            addr,
            faults,
            changed,
        }
    }
}

impl axum::serve::Listener for FaultyListener {
    type Io = TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            if let Some(until) = self.faults.refusing_until() {
                if self.inner.take().is_some() {
                    tracing::warn!(addr = %self.addr, "fault: refusing connections");
                }
                let until = tokio::time::Instant::from_std(until);
                tokio::select! {
                    _ = tokio::time::sleep_until(until) => {}
                    _ = self.changed.notified() => {}
                }
                continue;
            }
            let Some(listener) = &self.inner else {
                match TcpListener::bind(self.addr).await {
                    Ok(l) => {
                        tracing::info!(addr = %self.addr, "accepting connections again");
                        self.inner = Some(l);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, addr = %self.addr, "rebinding the listener failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
                continue;
            };
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        let _ = stream.set_nodelay(true);
                        return (stream, peer);
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                },
                _ = self.changed.notified() => {}
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.addr)
    }
}
