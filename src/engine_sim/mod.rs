//! Sans-IO model of an LLM inference engine (vLLM-like), shared by `kvmesh replica` (driven in real
//! time) and the simulator (driven in virtual time). No clock and no I/O live here: every call takes
//! "now" as a `Duration` since the engine's start, so the same code is deterministic under test.

pub mod config;
pub mod cpu_tier;
pub mod dp_engine;
pub mod engine;
pub mod prefix_cache;
pub mod tokens;

pub use config::{EngineConfig, Preset};
pub use dp_engine::{DpEngine, RankPick};
pub use engine::{Engine, EngineStats, Fetched, KvBatch, Output, Request, SubmitError};
pub use prefix_cache::{block_hashes, BlockHash, CacheEvent, PrefixCache};
pub use tokens::{count_tokens, tokenize, TokenId};
