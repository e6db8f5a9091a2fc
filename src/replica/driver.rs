//! The real-time driver: one tokio task owns the engine model and runs it against the wall clock,
//! waking at the engine's next event time (already divided by the time scale) or when a request
//! arrives. Handlers talk to it by message, so the sans-IO model needs no locking. A replica with
//! several data-parallel ranks runs one driver per rank, each with its own engine and publisher.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::engine_sim::{
    BlockHash, CacheEvent, Engine, EngineConfig, Fetched, Output, Request, SubmitError,
};
use crate::kv_events::msgpack::Value;
use crate::kv_events::{BlockRemoved, BlockStored, EventBatch, KvEvent, KvPublisher};

use super::metrics::Metrics;

/// What the driver sends a request's handler.
pub type Update = Result<Output, SubmitError>;

/// Messages to the driver.
#[derive(Debug)]
pub enum Command {
    /// Start a request; updates go to `tx`.
    Submit {
        /// The request.
        req: Request,
        /// Where its outputs go.
        tx: mpsc::UnboundedSender<Update>,
        /// Its prompt's KV was handed over by a prefill replica (`pd.rs`).
        handed_over: bool,
        /// Blocks pulled from another replica on a KV-fetch hint (`kv_fetch.rs`).
        fetched: Option<Fetched>,
    },
    /// How many of `hashes` (a run of one chain) the cache holds, leading: a peer's pull.
    Holds {
        /// The asked blocks, in chain order.
        hashes: Vec<BlockHash>,
        /// Where the count goes.
        reply: tokio::sync::oneshot::Sender<usize>,
    },
    /// Drop a request (its client left).
    Cancel(u64),
    /// Clear the prefix cache; replies whether it was cleared.
    ResetPrefixCache(tokio::sync::oneshot::Sender<bool>),
}

/// Runs data-parallel rank `rank`'s engine until every command sender is dropped.
pub async fn run(
    cfg: EngineConfig,
    rank: u16,
    mut rx: mpsc::UnboundedReceiver<Command>,
    metrics: Metrics,
    publisher: Option<Arc<KvPublisher>>,
) {
    let block_size = cfg.block_tokens as u32;
    let mut engine = Engine::new(EngineConfig {
        record_kv_events: publisher.is_some(),
        ..cfg
    });
    let start = Instant::now();
    let mut streams: HashMap<u64, mpsc::UnboundedSender<Update>> = HashMap::new();
    loop {
        let deadline = engine.next_event_time().map(|t| start + t);
        let mut commands = Vec::new();
        tokio::select! {
            cmd = rx.recv() => match cmd {
                Some(cmd) => commands.push(cmd),
                None => break,
            },
            _ = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            } => {}
        }
        while let Ok(cmd) = rx.try_recv() {
            commands.push(cmd);
        }
        let now = start.elapsed();
        if let Some(due) = engine.next_event_time().filter(|t| *t <= now) {
            metrics.driver_lag.observe((now - due).as_secs_f64());
        }
        for cmd in commands {
            match cmd {
                Command::Submit {
                    req,
                    tx,
                    handed_over,
                    fetched,
                } => {
                    let id = req.id;
                    let submitted = match fetched {
                        _ if handed_over => engine.submit_with_kv(req, now),
                        Some(f) => engine.submit_fetched(req, now, f),
                        None => engine.submit(req, now),
                    };
                    match submitted {
                        Ok(()) => {
                            streams.insert(id, tx);
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e));
                        }
                    }
                }
                Command::Cancel(id) => {
                    streams.remove(&id);
                    engine.cancel(id);
                }
                Command::Holds { hashes, reply } => {
                    let tokens = engine.cached_prefix_tokens(&hashes);
                    let _ = reply.send(tokens / engine.config().block_tokens.max(1));
                }
                Command::ResetPrefixCache(reply) => {
                    let _ = reply.send(engine.reset_prefix_cache());
                }
            }
        }
        for output in engine.advance(now) {
            let (id, last) = match output {
                Output::FirstToken { id, .. } | Output::Token { id } => (id, false),
                Output::Finished { id } => (id, true),
            };
            let delivered = streams
                .get(&id)
                .is_some_and(|tx| tx.send(Ok(output)).is_ok());
            if last || !delivered {
                streams.remove(&id);
                if !delivered && !last {
                    engine.cancel(id);
                }
            }
        }
        if let Some(publisher) = &publisher {
            for batch in engine.take_kv_batches() {
                publisher.publish(to_wire(batch.events, block_size, rank));
            }
        }
        metrics.update_rank(usize::from(rank), &engine.stats());
    }
}

/// vLLM's extra keys of a salted chain: the salt among block 0's, none for the rest.
fn salt_extra_keys(salt: String, blocks: usize) -> Value {
    let mut per_block = vec![Value::Nil; blocks.max(1)];
    per_block[0] = Value::Array(vec![Value::Str(salt)]);
    Value::Array(per_block)
}

fn to_wire(events: Vec<CacheEvent>, block_size: u32, rank: u16) -> EventBatch {
    let ts = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let events = events
        .into_iter()
        .map(|e| match e {
            CacheEvent::Stored {
                parent,
                hashes,
                token_ids,
                cache_salt,
            } => KvEvent::BlockStored(BlockStored {
                extra_keys: cache_salt.map(|s| salt_extra_keys(s, hashes.len())),
                block_hashes: hashes,
                parent_block_hash: parent,
                token_ids,
                block_size,
                medium: Some("GPU".into()),
                group_idx: Some(0),
                ..Default::default()
            }),
            CacheEvent::Removed { hashes } => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: hashes,
                medium: Some("GPU".into()),
                group_idx: None,
            }),
            CacheEvent::Cleared => KvEvent::AllBlocksCleared,
            // As vLLM's offloading connector publishes them: no tokens, no parent.
            CacheEvent::Offloaded { hashes } => KvEvent::BlockStored(BlockStored {
                block_hashes: hashes,
                parent_block_hash: None,
                token_ids: Vec::new(),
                block_size,
                medium: Some("CPU".into()),
                ..Default::default()
            }),
            CacheEvent::OffloadEvicted { hashes } => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: hashes,
                medium: Some("CPU".into()),
                group_idx: None,
            }),
        })
        .collect();
    EventBatch {
        ts,
        events,
        data_parallel_rank: Some(i64::from(rank)),
    }
}
