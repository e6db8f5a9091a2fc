//! The read stage: a request body, whole, within the node's limits — and without letting any
//! client make another wait.
//!
//! Exists because a body is the one thing a client controls in size and pace. The rules:
//! - at most `max_body_bytes` (413), within `server.body_read_timeout_ms` (408);
//! - the node-wide budget of buffered body bytes is reserved as bytes *arrive*, never as a
//!   `Content-Length` declares: 17 heads declaring 32 MiB each used to reserve 544 MiB up front
//!   and make a 4-token completion wait 59 s;
//! - each body's first `server.body_fair_share_bytes` come from a separate pool (a quarter of
//!   the budget, on top), so bodies that filled the main budget and stalled never delay a small
//!   request; permits are taken in small steps, so a big waiter never heads a FIFO queue that
//!   small ones stand behind;
//! - every 2 s window of a body must bring `server.min_body_bytes_per_s` × 2 s bytes, else 408:
//!   neither trickling nor a fast start followed by a stall holds budget for more than 4 s.

use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap};
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use tokio::sync::{Semaphore, SemaphorePermit};
use tokio::time::Instant;

use super::error::ApiError;
use crate::node::Node;

/// The window the minimum rate is checked over.
const RATE_WINDOW: Duration = Duration::from_secs(2);
/// The largest single reservation, in KiB: a request for more waits in line as several.
const STEP_KIB: u32 = 64;
/// A declared length pre-sizes the buffer only up to this; past it the buffer grows to the
/// declared length once bytes arrive (`reserve_for`), so a head alone costs little memory.
const PRESIZE_MAX: usize = 64 << 10;

/// Budget a body holds; released when dropped (with the body).
pub(super) struct BodyPermit<'n> {
    _first: Option<SemaphorePermit<'n>>,
    _rest: Option<SemaphorePermit<'n>>,
}

/// What one body has reserved so far, in KiB of each pool.
struct Reservation<'n> {
    first: Option<SemaphorePermit<'n>>,
    first_kib: u32,
    rest: Option<SemaphorePermit<'n>>,
    rest_kib: u32,
}

impl<'n> Reservation<'n> {
    /// Grows the reservation to cover `bytes` in all: the first `fair_kib` KiB from the fair
    /// pool, the rest from the main budget, each in steps of at most [`STEP_KIB`].
    async fn cover(&mut self, node: &'n Node, bytes: usize, fair_kib: u32) -> Result<(), ApiError> {
        let need = u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX);
        while self.first_kib < need.min(fair_kib) {
            let step = (need.min(fair_kib) - self.first_kib).min(STEP_KIB);
            take(&node.body_budget_first, &mut self.first, step).await?;
            self.first_kib += step;
        }
        while self.first_kib + self.rest_kib < need {
            let step = (need - self.first_kib - self.rest_kib).min(STEP_KIB);
            take(&node.body_budget, &mut self.rest, step).await?;
            self.rest_kib += step;
        }
        Ok(())
    }
}

async fn take<'n>(
    pool: &'n Semaphore,
    held: &mut Option<SemaphorePermit<'n>>,
    kib: u32,
) -> Result<(), ApiError> {
    let permit = pool
        .acquire_many(kib)
        .await
        .map_err(|_| ApiError::unavailable("the node is holding too many request bodies"))?;
    match held {
        Some(p) => p.merge(permit),
        None => *held = Some(permit),
    }
    Ok(())
}

/// Reads the whole body within `node`'s limits (see the module doc). The returned permit holds
/// the body's share of the budget; drop it with the body.
pub(super) async fn read<'n>(
    node: &'n Node,
    body: Body,
    headers: &HeaderMap,
) -> Result<(Bytes, BodyPermit<'n>), ApiError> {
    let limit = node.cfg.max_body_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::too_large(limit));
    }
    let server = &node.cfg.server;
    let deadline = Duration::from_millis(server.body_read_timeout_ms);
    let fair_kib = u32::try_from(server.body_fair_share_bytes / 1024).unwrap_or(u32::MAX);
    let min_rate = server.min_body_bytes_per_s;
    let read = async {
        let mut held = Reservation {
            first: None,
            first_kib: 0,
            rest: None,
            rest_kib: 0,
        };
        let presize = declared.map_or(0, |n| (n as usize).min(PRESIZE_MAX));
        let mut buf = BytesMut::with_capacity(presize);
        let mut stream = body.into_data_stream();
        let mut window = RateWindow::new(min_rate, declared);
        loop {
            let chunk = match window.deadline() {
                Some(at) => match tokio::time::timeout_at(at, stream.next()).await {
                    Ok(c) => c,
                    Err(_) => {
                        window.rollover(Instant::now())?;
                        continue;
                    }
                },
                None => stream.next().await,
            };
            let Some(chunk) = chunk else { break };
            let chunk =
                chunk.map_err(|e| ApiError::bad_request(format!("cannot read body: {e}"), None))?;
            if buf.len() + chunk.len() > limit {
                return Err(ApiError::too_large(limit));
            }
            window.arrived(chunk.len(), Instant::now())?;
            held.cover(node, buf.len() + chunk.len(), fair_kib).await?;
            reserve_for(&mut buf, chunk.len(), declared);
            buf.extend_from_slice(&chunk);
        }
        Ok((
            buf.freeze(),
            BodyPermit {
                _first: held.first,
                _rest: held.rest,
            },
        ))
    };
    match tokio::time::timeout(deadline, read).await {
        Ok(r) => r,
        Err(_) => Err(ApiError::body_timeout(deadline)),
    }
}

/// Grows `buf` for `more` bytes: once the first bytes have arrived, to the declared length at
/// once (no doubling: a 32 MiB body takes 32 MiB, not a 64 MiB buffer beside the 32 MiB one).
fn reserve_for(buf: &mut BytesMut, more: usize, declared: Option<u64>) {
    if buf.capacity() - buf.len() >= more {
        return;
    }
    let rest = declared.map_or(0, |d| {
        usize::try_from(d).unwrap_or(0).saturating_sub(buf.len())
    });
    buf.reserve(rest.max(more));
}

/// The minimum-rate check: each [`RATE_WINDOW`] must bring `min_rate` × the window's bytes,
/// or the rest of a declared body if that is less.
struct RateWindow {
    /// Bytes per second; 0: off.
    min_rate: u64,
    /// Bytes still to come, when the body declared its length.
    remaining: Option<u64>,
    start: Instant,
    bytes: u64,
}

impl RateWindow {
    fn new(min_rate: u64, declared: Option<u64>) -> Self {
        RateWindow {
            min_rate,
            remaining: declared,
            start: Instant::now(),
            bytes: 0,
        }
    }

    /// When the current window closes (`None`: no minimum rate).
    fn deadline(&self) -> Option<Instant> {
        (self.min_rate > 0).then(|| self.start + RATE_WINDOW)
    }

    fn arrived(&mut self, n: usize, now: Instant) -> Result<(), ApiError> {
        self.bytes += n as u64;
        self.remaining = self.remaining.map(|r| r.saturating_sub(n as u64));
        if self.deadline().is_some_and(|d| now >= d) {
            self.rollover(now)?;
        }
        Ok(())
    }

    /// Closes the window: 408 if it brought too few bytes, else a new one starts.
    fn rollover(&mut self, now: Instant) -> Result<(), ApiError> {
        let window = self.min_rate.saturating_mul(RATE_WINDOW.as_secs());
        // What this window had to bring: its share, or all that was left of the body.
        let left_at_start = self.remaining.map(|r| r + self.bytes);
        let need = left_at_start.map_or(window, |l| l.min(window));
        if self.bytes < need {
            return Err(ApiError::body_too_slow(self.min_rate));
        }
        self.start = now;
        self.bytes = 0;
        Ok(())
    }
}
