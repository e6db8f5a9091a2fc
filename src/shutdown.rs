//! The stop signal every background task of a node watches: a `watch` channel that turns true
//! (or whose sender is dropped) when the node shuts down; and the process signals that start a
//! shutdown (SIGINT, and SIGTERM as service managers and Kubernetes send it); and SIGHUP, which
//! asks a node to reload its configuration.

use tokio::sync::watch;

/// Resolves once `rx` reads true or its sender is gone.
pub async fn stopped(rx: &mut watch::Receiver<bool>) {
    loop {
        if *rx.borrow_and_update() {
            return;
        }
        if rx.changed().await.is_err() {
            return;
        }
    }
}

/// Resolves at SIGINT or SIGTERM (SIGINT only where there is no SIGTERM).
pub async fn signalled() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot watch SIGTERM");
                    std::future::pending::<()>().await
                }
            }
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

/// The process's SIGHUPs (none where there are none, or when they cannot be watched).
pub struct Hangups {
    #[cfg(unix)]
    signal: Option<tokio::signal::unix::Signal>,
}

impl Hangups {
    /// Starts watching SIGHUP; from now on a SIGHUP no longer ends the process.
    pub fn watch() -> Hangups {
        #[cfg(unix)]
        {
            let signal = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
                .map_err(
                    |e| tracing::warn!(error = %e, "cannot watch SIGHUP: no configuration reload"),
                )
                .ok();
            Hangups { signal }
        }
        #[cfg(not(unix))]
        Hangups {}
    }

    /// Resolves at the next SIGHUP (one that arrived since the last call included).
    pub async fn next(&mut self) {
        #[cfg(unix)]
        if let Some(s) = &mut self.signal {
            if s.recv().await.is_some() {
                return;
            }
            self.signal = None;
        }
        std::future::pending::<()>().await
    }
}
