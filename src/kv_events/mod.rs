//! vLLM KV-cache events: the msgpack wire codec (shared by the replica's publisher and the router's
//! subscribers) and the replica-side ZMQ publisher with its replay socket.

pub mod msgpack;
pub mod publisher;
pub mod wire;
pub mod zmtp;

pub use publisher::{KvPublisher, KvPublisherConfig, PublisherError};
pub use wire::{
    decode_batch, encode_batch, BlockRemoved, BlockStored, EventBatch, KvEvent, WireError,
    END_OF_REPLAY_SEQ,
};
