//! The stop signal every background task of a node watches: a `watch` channel that turns true
//! (or whose sender is dropped) when the node shuts down; and the process signals that start a
//! shutdown (SIGINT, and SIGTERM as service managers and Kubernetes send it).

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
