//! The stop signal every background task of a node watches: a `watch` channel that turns true
//! (or whose sender is dropped) when the node shuts down.

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
