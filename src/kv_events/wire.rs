//! vLLM's KV-event wire format (`vllm/distributed/kv_events.py`; spec in
//! `../shared/reference/engines.md` §7).
//!
//! A batch is msgpack `[ts, [events], data_parallel_rank]`. Events are tagged maps
//! `{"type": "BlockStored", ...}` since vLLM PR #42892 and tagged arrays before it; the encoder
//! writes the current map form, the decoder accepts both, plus the batch as a map, hashes as
//! unsigned, negative (SGLang) or binary ints, unknown fields and unknown event types, and caps list
//! lengths. Decoding never panics on any input.

use super::msgpack::{self, Value};

/// Sequence number sent as the end-of-replay marker (`(-1).to_bytes(8, "big", signed=True)`).
pub const END_OF_REPLAY_SEQ: [u8; 8] = [0xff; 8];
/// Most events accepted in one batch.
pub const MAX_EVENTS_PER_BATCH: usize = 65_536;
/// Most block hashes accepted in one event (SGLang's router uses the same cap).
pub const MAX_HASHES_PER_EVENT: usize = 65_536;
/// Most token ids accepted in one event.
pub const MAX_TOKENS_PER_EVENT: usize = 1 << 22;

/// One `EventBatch`: the KV events of one engine step.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Wall-clock time of the step, seconds since the Unix epoch.
    pub ts: f64,
    /// Events in order.
    pub events: Vec<KvEvent>,
    /// Data-parallel rank of the publishing engine, if sent.
    pub data_parallel_rank: Option<i64>,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks became cached.
    BlockStored(BlockStored),
    /// Blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// The whole cache was cleared.
    AllBlocksCleared,
    /// An event type this decoder does not know; skip it.
    Unknown(String),
}

/// `BlockStored`: consecutive blocks of one chain became cached.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// Engine hashes of the blocks (opaque ids, low 64 bits).
    pub block_hashes: Vec<u64>,
    /// Hash of the block before the first one; `None` for a chain root.
    pub parent_block_hash: Option<u64>,
    /// Tokens of all the blocks, `block_hashes.len() × block_size` of them.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// Deprecated LoRA id.
    pub lora_id: Option<i64>,
    /// Storage tier; `None` means "GPU".
    pub medium: Option<String>,
    /// LoRA adapter name.
    pub lora_name: Option<String>,
    /// Per-block extra hash keys (cache salt, multimodal ids), kept as raw msgpack.
    pub extra_keys: Option<Value>,
    /// KV-cache group of hybrid models; index only group 0.
    pub group_idx: Option<u32>,
    /// Attention kind of the group (e.g. "full_attention").
    pub kv_cache_spec_kind: Option<String>,
    /// Sliding window of the group, if any.
    pub kv_cache_spec_sliding_window: Option<i64>,
}

/// `BlockRemoved`: blocks were evicted.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    /// Engine hashes of the evicted blocks.
    pub block_hashes: Vec<u64>,
    /// Storage tier; `None` means "GPU".
    pub medium: Option<String>,
    /// KV-cache group of hybrid models.
    pub group_idx: Option<u32>,
}

/// Why a payload is not a valid `EventBatch`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum WireError {
    /// Not msgpack at all.
    #[error("invalid msgpack: {0}")]
    Msgpack(#[from] msgpack::MsgpackError),
    /// Msgpack, but not the expected shape.
    #[error("bad {field}: {problem}")]
    Shape {
        /// The field that is wrong.
        field: &'static str,
        /// What is wrong with it.
        problem: &'static str,
    },
}

fn shape(field: &'static str, problem: &'static str) -> WireError {
    WireError::Shape { field, problem }
}

/// Encodes a batch in vLLM's current form (array batch, map events), byte-compatible with msgspec.
pub fn encode_batch(batch: &EventBatch) -> Vec<u8> {
    encode(batch, false)
}

/// Encodes a batch with legacy array-form events (vLLM ≤ 0.23), for testing consumers.
pub fn encode_batch_legacy(batch: &EventBatch) -> Vec<u8> {
    encode(batch, true)
}

fn encode(batch: &EventBatch, legacy: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    msgpack::write_array_len(&mut out, 3);
    msgpack::write_f64(&mut out, batch.ts);
    msgpack::write_array_len(&mut out, batch.events.len());
    for event in &batch.events {
        if legacy {
            encode_event_array(&mut out, event);
        } else {
            encode_event_map(&mut out, event);
        }
    }
    match batch.data_parallel_rank {
        Some(rank) => msgpack::write_int(&mut out, rank as i128),
        None => msgpack::write_nil(&mut out),
    }
    out
}

fn write_hashes(out: &mut Vec<u8>, hashes: &[u64]) {
    msgpack::write_array_len(out, hashes.len());
    for h in hashes {
        msgpack::write_int(out, *h as i128);
    }
}

fn write_opt_int(out: &mut Vec<u8>, v: Option<i128>) {
    match v {
        Some(v) => msgpack::write_int(out, v),
        None => msgpack::write_nil(out),
    }
}

fn write_opt_str(out: &mut Vec<u8>, v: Option<&str>) {
    match v {
        Some(s) => msgpack::write_str(out, s),
        None => msgpack::write_nil(out),
    }
}

fn write_tokens(out: &mut Vec<u8>, tokens: &[u32]) {
    msgpack::write_array_len(out, tokens.len());
    for t in tokens {
        msgpack::write_int(out, *t as i128);
    }
}

fn encode_event_map(out: &mut Vec<u8>, event: &KvEvent) {
    match event {
        KvEvent::BlockStored(e) => {
            let optional = [
                e.extra_keys.is_some(),
                e.group_idx.is_some(),
                e.kv_cache_spec_kind.is_some(),
                e.kv_cache_spec_sliding_window.is_some(),
            ];
            msgpack::write_map_len(out, 8 + optional.iter().filter(|p| **p).count());
            msgpack::write_str(out, "type");
            msgpack::write_str(out, "BlockStored");
            msgpack::write_str(out, "block_hashes");
            write_hashes(out, &e.block_hashes);
            msgpack::write_str(out, "parent_block_hash");
            write_opt_int(out, e.parent_block_hash.map(|h| h as i128));
            msgpack::write_str(out, "token_ids");
            write_tokens(out, &e.token_ids);
            msgpack::write_str(out, "block_size");
            msgpack::write_int(out, e.block_size as i128);
            msgpack::write_str(out, "lora_id");
            write_opt_int(out, e.lora_id.map(|v| v as i128));
            msgpack::write_str(out, "medium");
            write_opt_str(out, e.medium.as_deref());
            msgpack::write_str(out, "lora_name");
            write_opt_str(out, e.lora_name.as_deref());
            if let Some(keys) = &e.extra_keys {
                msgpack::write_str(out, "extra_keys");
                msgpack::write_value(out, keys);
            }
            if let Some(g) = e.group_idx {
                msgpack::write_str(out, "group_idx");
                msgpack::write_int(out, g as i128);
            }
            if let Some(kind) = &e.kv_cache_spec_kind {
                msgpack::write_str(out, "kv_cache_spec_kind");
                msgpack::write_str(out, kind);
            }
            if let Some(w) = e.kv_cache_spec_sliding_window {
                msgpack::write_str(out, "kv_cache_spec_sliding_window");
                msgpack::write_int(out, w as i128);
            }
        }
        KvEvent::BlockRemoved(e) => {
            msgpack::write_map_len(out, 3 + usize::from(e.group_idx.is_some()));
            msgpack::write_str(out, "type");
            msgpack::write_str(out, "BlockRemoved");
            msgpack::write_str(out, "block_hashes");
            write_hashes(out, &e.block_hashes);
            msgpack::write_str(out, "medium");
            write_opt_str(out, e.medium.as_deref());
            if let Some(g) = e.group_idx {
                msgpack::write_str(out, "group_idx");
                msgpack::write_int(out, g as i128);
            }
        }
        KvEvent::AllBlocksCleared => {
            msgpack::write_map_len(out, 1);
            msgpack::write_str(out, "type");
            msgpack::write_str(out, "AllBlocksCleared");
        }
        KvEvent::Unknown(tag) => {
            msgpack::write_map_len(out, 1);
            msgpack::write_str(out, "type");
            msgpack::write_str(out, tag);
        }
    }
}

fn encode_event_array(out: &mut Vec<u8>, event: &KvEvent) {
    match event {
        KvEvent::BlockStored(e) => {
            msgpack::write_array_len(out, 10);
            msgpack::write_str(out, "BlockStored");
            write_hashes(out, &e.block_hashes);
            write_opt_int(out, e.parent_block_hash.map(|h| h as i128));
            write_tokens(out, &e.token_ids);
            msgpack::write_int(out, e.block_size as i128);
            write_opt_int(out, e.lora_id.map(|v| v as i128));
            write_opt_str(out, e.medium.as_deref());
            write_opt_str(out, e.lora_name.as_deref());
            msgpack::write_value(out, e.extra_keys.as_ref().unwrap_or(&Value::Nil));
            write_opt_int(out, e.group_idx.map(|g| g as i128));
        }
        KvEvent::BlockRemoved(e) => {
            msgpack::write_array_len(out, 4);
            msgpack::write_str(out, "BlockRemoved");
            write_hashes(out, &e.block_hashes);
            write_opt_str(out, e.medium.as_deref());
            write_opt_int(out, e.group_idx.map(|g| g as i128));
        }
        KvEvent::AllBlocksCleared => {
            msgpack::write_array_len(out, 1);
            msgpack::write_str(out, "AllBlocksCleared");
        }
        KvEvent::Unknown(tag) => {
            msgpack::write_array_len(out, 1);
            msgpack::write_str(out, tag);
        }
    }
}

/// Decodes one `EventBatch` payload (the third frame of a live or replayed message).
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, WireError> {
    let value = msgpack::decode(payload)?;
    let (ts, events, rank) = match &value {
        Value::Array(items) => (items.first(), items.get(1), items.get(2)),
        Value::Map(_) => (
            value.get("ts"),
            value.get("events"),
            value.get("data_parallel_rank"),
        ),
        _ => return Err(shape("batch", "not an array or map")),
    };
    let ts = match ts {
        Some(Value::Float(f)) => *f,
        Some(Value::Int(i)) => *i as f64,
        _ => return Err(shape("ts", "missing or not a number")),
    };
    let Some(Value::Array(raw_events)) = events else {
        return Err(shape("events", "missing or not an array"));
    };
    if raw_events.len() > MAX_EVENTS_PER_BATCH {
        return Err(shape("events", "too many events"));
    }
    let data_parallel_rank = match rank {
        None | Some(Value::Nil) => None,
        Some(Value::Int(i)) => {
            Some(i64::try_from(*i).map_err(|_| shape("data_parallel_rank", "out of range"))?)
        }
        Some(_) => return Err(shape("data_parallel_rank", "not an int")),
    };
    let events = raw_events
        .iter()
        .map(decode_event)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

/// Field lookup over either event form: by name in a map, by position in a tagged array.
struct Fields<'a> {
    value: &'a Value,
}

impl<'a> Fields<'a> {
    fn get(&self, name: &str, position: usize) -> Option<&'a Value> {
        match self.value {
            Value::Map(_) => self.value.get(name),
            Value::Array(items) => items.get(position),
            _ => None,
        }
        .filter(|v| !matches!(v, Value::Nil))
    }
}

fn decode_event(value: &Value) -> Result<KvEvent, WireError> {
    let tag = match value {
        Value::Map(_) => value.get("type").and_then(Value::as_str),
        Value::Array(items) => items.first().and_then(Value::as_str),
        _ => return Err(shape("event", "not a map or array")),
    }
    .ok_or(shape("event", "missing type tag"))?;
    let f = Fields { value };
    Ok(match tag {
        "BlockStored" => KvEvent::BlockStored(BlockStored {
            block_hashes: hashes(f.get("block_hashes", 1), "block_hashes")?,
            parent_block_hash: f
                .get("parent_block_hash", 2)
                .map(|v| hash(v, "parent_block_hash"))
                .transpose()?,
            token_ids: tokens(f.get("token_ids", 3))?,
            block_size: f
                .get("block_size", 4)
                .map(|v| uint(v, "block_size"))
                .transpose()?
                .unwrap_or(0),
            lora_id: f.get("lora_id", 5).map(|v| int(v, "lora_id")).transpose()?,
            medium: opt_str(f.get("medium", 6), "medium")?,
            lora_name: opt_str(f.get("lora_name", 7), "lora_name")?,
            extra_keys: f.get("extra_keys", 8).cloned(),
            group_idx: f
                .get("group_idx", 9)
                .map(|v| uint(v, "group_idx"))
                .transpose()?,
            kv_cache_spec_kind: opt_str(f.get("kv_cache_spec_kind", 10), "kv_cache_spec_kind")?,
            kv_cache_spec_sliding_window: f
                .get("kv_cache_spec_sliding_window", 11)
                .map(|v| int(v, "kv_cache_spec_sliding_window"))
                .transpose()?,
        }),
        "BlockRemoved" => KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes(f.get("block_hashes", 1), "block_hashes")?,
            medium: opt_str(f.get("medium", 2), "medium")?,
            group_idx: f
                .get("group_idx", 3)
                .map(|v| uint(v, "group_idx"))
                .transpose()?,
        }),
        "AllBlocksCleared" => KvEvent::AllBlocksCleared,
        other => KvEvent::Unknown(other.chars().take(64).collect()),
    })
}

/// An engine hash as u64: ints two's complement (SGLang sends signed), bytes by their last 8.
fn hash(v: &Value, field: &'static str) -> Result<u64, WireError> {
    match v {
        Value::Int(i) if *i < 0 => i64::try_from(*i)
            .map(|i| i as u64)
            .map_err(|_| shape(field, "hash out of range")),
        Value::Int(i) => u64::try_from(*i).map_err(|_| shape(field, "hash out of range")),
        Value::Bin(b) => {
            let tail = &b[b.len().saturating_sub(8)..];
            Ok(tail
                .iter()
                .fold(0u64, |acc, byte| (acc << 8) | u64::from(*byte)))
        }
        _ => Err(shape(field, "hash is not an int or bytes")),
    }
}

fn hashes(v: Option<&Value>, field: &'static str) -> Result<Vec<u64>, WireError> {
    match v {
        None => Ok(Vec::new()),
        Some(Value::Array(items)) if items.len() > MAX_HASHES_PER_EVENT => {
            Err(shape(field, "too many hashes"))
        }
        Some(Value::Array(items)) => items.iter().map(|h| hash(h, field)).collect(),
        Some(_) => Err(shape(field, "not an array")),
    }
}

fn tokens(v: Option<&Value>) -> Result<Vec<u32>, WireError> {
    match v {
        None => Ok(Vec::new()),
        Some(Value::Array(items)) if items.len() > MAX_TOKENS_PER_EVENT => {
            Err(shape("token_ids", "too many tokens"))
        }
        Some(Value::Array(items)) => items
            .iter()
            .map(|t| match t {
                Value::Int(i) => {
                    u32::try_from(*i).map_err(|_| shape("token_ids", "token out of range"))
                }
                _ => Err(shape("token_ids", "token is not an int")),
            })
            .collect(),
        Some(_) => Err(shape("token_ids", "not an array")),
    }
}

fn int(v: &Value, field: &'static str) -> Result<i64, WireError> {
    match v {
        Value::Int(i) => i64::try_from(*i).map_err(|_| shape(field, "out of range")),
        _ => Err(shape(field, "not an int")),
    }
}

fn uint(v: &Value, field: &'static str) -> Result<u32, WireError> {
    match v {
        Value::Int(i) => u32::try_from(*i).map_err(|_| shape(field, "out of range")),
        _ => Err(shape(field, "not an unsigned int")),
    }
}

fn opt_str(v: Option<&Value>, field: &'static str) -> Result<Option<String>, WireError> {
    match v {
        None => Ok(None),
        Some(Value::Str(s)) => Ok(Some(s.clone())),
        Some(_) => Err(shape(field, "not a string")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GOLDEN_ARRAY: &str = "93cb3ff8000000000000939aab426c6f636b53746f72656492cfffffffffffffffff07c0940102030402c0a3475055c0c0c094ac426c6f636b52656d6f7665649107a3475055c091b0416c6c426c6f636b73436c656172656400";
    const GOLDEN_MAP: &str = "93cb3ff80000000000009389a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfffffffffffffffff07b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f6964780083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739107a66d656469756da347505581a474797065b0416c6c426c6f636b73436c656172656400";

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn golden(group_idx: Option<u32>) -> EventBatch {
        EventBatch {
            ts: 1.5,
            events: vec![
                KvEvent::BlockStored(BlockStored {
                    block_hashes: vec![u64::MAX, 7],
                    parent_block_hash: None,
                    token_ids: vec![1, 2, 3, 4],
                    block_size: 2,
                    medium: Some("GPU".into()),
                    group_idx,
                    ..Default::default()
                }),
                KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![7],
                    medium: Some("GPU".into()),
                    group_idx: None,
                }),
                KvEvent::AllBlocksCleared,
            ],
            data_parallel_rank: Some(0),
        }
    }

    #[test]
    fn golden_map_form_round_trips_byte_for_byte() {
        let bytes = unhex(GOLDEN_MAP);
        assert_eq!(decode_batch(&bytes).unwrap(), golden(Some(0)));
        assert_eq!(encode_batch(&golden(Some(0))), bytes);
    }

    #[test]
    fn golden_array_form_round_trips_byte_for_byte() {
        let bytes = unhex(GOLDEN_ARRAY);
        assert_eq!(decode_batch(&bytes).unwrap(), golden(None));
        assert_eq!(encode_batch_legacy(&golden(None)), bytes);
    }

    #[test]
    fn accepts_negative_and_binary_hashes_unknown_fields_and_map_batches() {
        let mut out = Vec::new();
        msgpack::write_map_len(&mut out, 3);
        msgpack::write_str(&mut out, "events");
        msgpack::write_array_len(&mut out, 2);
        msgpack::write_map_len(&mut out, 4);
        msgpack::write_str(&mut out, "type");
        msgpack::write_str(&mut out, "BlockRemoved");
        msgpack::write_str(&mut out, "block_hashes");
        msgpack::write_value(
            &mut out,
            &Value::Array(vec![Value::Int(-1), Value::Bin((1..=32).collect())]),
        );
        msgpack::write_str(&mut out, "cache_salt");
        msgpack::write_str(&mut out, "x");
        msgpack::write_str(&mut out, "session_id");
        msgpack::write_nil(&mut out);
        msgpack::write_map_len(&mut out, 1);
        msgpack::write_str(&mut out, "type");
        msgpack::write_str(&mut out, "SomethingNew");
        msgpack::write_str(&mut out, "ts");
        msgpack::write_int(&mut out, 3);
        msgpack::write_str(&mut out, "extra");
        msgpack::write_nil(&mut out);
        let batch = decode_batch(&out).unwrap();
        assert_eq!(batch.ts, 3.0);
        assert_eq!(batch.data_parallel_rank, None);
        assert_eq!(
            batch.events,
            vec![
                KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![u64::MAX, 0x191a_1b1c_1d1e_1f20],
                    medium: None,
                    group_idx: None
                }),
                KvEvent::Unknown("SomethingNew".into())
            ]
        );
    }

    #[test]
    fn rejects_wrong_shapes_with_errors() {
        assert!(decode_batch(&[]).is_err());
        assert!(decode_batch(&[0x93, 0xc0, 0x90, 0x00]).is_err()); // ts nil
        assert!(decode_batch(&[0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x01]).is_err());
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_batch(&bytes);
        }

        #[test]
        fn mutated_golden_never_panics(idx in 0usize..200, byte in any::<u8>()) {
            let mut bytes = unhex(GOLDEN_MAP);
            let i = idx % bytes.len();
            bytes[i] = byte;
            let _ = decode_batch(&bytes);
        }
    }
}
