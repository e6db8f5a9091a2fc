//! The agentic conversation format of callanjfox/kv-cache-tester (`data/traces/agentic/`): one
//! JSON object per file, one conversation per object, read with bounds.
//!
//! `{"id", "block_size", "requests": [{"t", "in", "out", "hash_ids", ...} | {"type": "subagent",
//! "t", "requests": [...]}]}`: each hash id names one `block_size`-token block of the prompt
//! (ids local to the file; `hash_ids` holds the *full* blocks, so up to `block_size - 1` trailing
//! prompt tokens have none). A sub-agent entry nests the sub-agent's own requests, timed from the
//! entry's `t`, in the same id namespace. Fields this replay does not use are ignored.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::request::{WorkloadError, MAX_SEGMENT_TOKENS};

/// Largest file read: the upstream files are all under 3 MB; 32 MiB leaves room for longer
/// conversations while a wrong path (a disk image) fails fast instead of filling memory.
pub const MAX_FILE_BYTES: u64 = 32 << 20;
/// Most conversation files one directory may hold (the upstream set has 739).
pub const MAX_FILES: usize = 4096;
/// Most requests one conversation may hold, sub-agents' included (the upstream maximum is ~1,000).
pub const MAX_REQUESTS_PER_FILE: usize = 100_000;
/// Deepest nesting of sub-agents inside sub-agents (the upstream set nests one level).
pub const MAX_SUBAGENT_DEPTH: usize = 4;
/// Largest hash id: ids are packed into 40 bits of a segment id (`agentic.rs`).
pub const MAX_HASH_ID: u64 = (1 << 40) - 1;

/// One request of a conversation, sub-agents' flattened in.
#[derive(Clone, Debug, PartialEq)]
pub struct AgenticRequest {
    /// Start, seconds from the conversation's start (a sub-agent's offset added).
    pub t: f64,
    /// Prompt tokens.
    pub input: u64,
    /// Output tokens.
    pub output: u64,
    /// Ids of the prompt's full blocks, in order.
    pub hash_ids: Vec<u64>,
}

/// One conversation file.
#[derive(Clone, Debug, PartialEq)]
pub struct Conversation {
    /// The conversation's `id`.
    pub id: String,
    /// Tokens per hash id.
    pub block_tokens: u32,
    /// Its requests, sub-agents' included, ordered by `t` (ties in file order).
    pub requests: Vec<AgenticRequest>,
}

#[derive(Deserialize)]
struct RawConversation {
    id: String,
    block_size: u64,
    requests: Vec<RawEntry>,
}

#[derive(Deserialize)]
struct RawEntry {
    t: f64,
    #[serde(rename = "in")]
    input: Option<u64>,
    out: Option<u64>,
    hash_ids: Option<Vec<u64>>,
    /// Present on sub-agent entries only.
    requests: Option<Vec<RawEntry>>,
}

fn error(path: &str, reason: impl Into<String>) -> WorkloadError {
    WorkloadError::Agentic {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

/// The conversation files `path` names: the `*.json` files of a directory in name order (at most
/// [`MAX_FILES`]), or the one file it is.
pub fn list(path: &Path) -> Result<Vec<PathBuf>, WorkloadError> {
    let name = path.display().to_string();
    let meta = std::fs::metadata(path).map_err(|e| error(&name, e.to_string()))?;
    if meta.is_file() {
        return Ok(vec![path.to_owned()]);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).map_err(|e| error(&name, e.to_string()))? {
        let p = entry.map_err(|e| error(&name, e.to_string()))?.path();
        if p.extension().is_some_and(|x| x == "json") && p.is_file() {
            files.push(p);
            // Checked while listing, so a huge directory is not listed whole first.
            if files.len() > MAX_FILES {
                return Err(error(&name, format!("more than {MAX_FILES} .json files")));
            }
        }
    }
    if files.is_empty() {
        return Err(error(&name, "no .json conversation files"));
    }
    files.sort();
    Ok(files)
}

/// Reads one conversation file (at most [`MAX_FILE_BYTES`]).
pub fn load(path: &Path) -> Result<Conversation, WorkloadError> {
    let name = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|e| error(&name, e.to_string()))?;
    let mut bytes = Vec::new();
    // One byte past the cap tells a file at the cap from a longer one.
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| error(&name, e.to_string()))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(error(&name, format!("larger than {MAX_FILE_BYTES} bytes")));
    }
    parse(&bytes, &name)
}

/// Parses one conversation; `name` labels errors.
pub fn parse(bytes: &[u8], name: &str) -> Result<Conversation, WorkloadError> {
    let raw: RawConversation = serde_json::from_slice(bytes)
        .map_err(|e| error(name, format!("not a conversation: {e}")))?;
    let block_tokens = u32::try_from(raw.block_size)
        .ok()
        .filter(|b| (1..=MAX_SEGMENT_TOKENS).contains(b))
        .ok_or_else(|| {
            error(
                name,
                format!(
                    "block_size {} is outside 1..={MAX_SEGMENT_TOKENS}",
                    raw.block_size
                ),
            )
        })?;
    let mut requests = Vec::new();
    flatten(&raw.requests, 0.0, 0, block_tokens, &mut requests)
        .map_err(|reason| error(name, reason))?;
    if requests.is_empty() {
        return Err(error(name, "no requests"));
    }
    // Sub-agents run beside their parent: order by start, keeping file order on ties. `t` is
    // finite (checked), so the comparison is total.
    requests.sort_by(|a, b| a.t.total_cmp(&b.t));
    Ok(Conversation {
        id: raw.id,
        block_tokens,
        requests,
    })
}

/// Appends `entries`' requests (sub-agents' recursively, `offset` added to their times).
fn flatten(
    entries: &[RawEntry],
    offset: f64,
    depth: usize,
    block: u32,
    out: &mut Vec<AgenticRequest>,
) -> Result<(), String> {
    for (i, e) in entries.iter().enumerate() {
        let where_ = || format!("request {i} (sub-agent depth {depth})");
        if !(e.t.is_finite() && e.t >= 0.0) {
            return Err(format!("{}: t {} is not a time >= 0", where_(), e.t));
        }
        let t = offset + e.t;
        if let Some(nested) = &e.requests {
            if depth >= MAX_SUBAGENT_DEPTH {
                return Err(format!(
                    "{}: sub-agents nested deeper than {MAX_SUBAGENT_DEPTH}",
                    where_()
                ));
            }
            flatten(nested, t, depth + 1, block, out)?;
            continue;
        }
        let (Some(input), Some(output), Some(hash_ids)) = (e.input, e.out, &e.hash_ids) else {
            return Err(format!("{}: needs `in`, `out` and `hash_ids`", where_()));
        };
        check_blocks(input, hash_ids, block).map_err(|m| format!("{}: {m}", where_()))?;
        if out.len() >= MAX_REQUESTS_PER_FILE {
            return Err(format!("more than {MAX_REQUESTS_PER_FILE} requests"));
        }
        out.push(AgenticRequest {
            t,
            input,
            output,
            hash_ids: hash_ids.clone(),
        });
    }
    Ok(())
}

/// The prompt must be its blocks plus less than one block without an id, and every id must fit
/// the segment id's 40 bits: so a prompt's size is bounded by the file's.
fn check_blocks(input: u64, hash_ids: &[u64], block: u32) -> Result<(), String> {
    let covered = hash_ids.len() as u64 * u64::from(block);
    if input >= covered + u64::from(block) {
        return Err(format!(
            "`in` {input} tokens but only {} hash ids of {block} tokens",
            hash_ids.len()
        ));
    }
    if let Some(id) = hash_ids.iter().find(|&&id| id > MAX_HASH_ID) {
        return Err(format!("hash id {id} exceeds {MAX_HASH_ID}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: &str = r#"{"id":"c1","block_size":64,"tool_tokens":1,"requests":[
        {"t":0.0,"type":"n","in":130,"out":5,"hash_ids":[1,2]},
        {"t":10.0,"type":"subagent","agent_id":"a1","requests":[
            {"t":0.0,"in":64,"out":3,"hash_ids":[9]},
            {"t":20.0,"in":70,"out":3,"hash_ids":[9]}]},
        {"t":15.0,"type":"s","in":200,"out":7,"hash_ids":[1,2,3]}]}"#;

    #[test]
    fn sub_agents_are_flattened_at_their_offset_in_time_order() {
        let c = parse(TWO.as_bytes(), "two.json").unwrap();
        assert_eq!(c.id, "c1");
        assert_eq!(c.block_tokens, 64);
        let times: Vec<f64> = c.requests.iter().map(|r| r.t).collect();
        assert_eq!(times, vec![0.0, 10.0, 15.0, 30.0]);
        assert_eq!(c.requests[1].hash_ids, vec![9]);
        assert_eq!(c.requests[2].input, 200);
        assert_eq!(c.requests[3].output, 3);
    }

    #[test]
    fn malformed_files_are_errors_naming_the_file() {
        let bad = [
            ("not json", "not a conversation"),
            (r#"{"id":"x","block_size":64,"requests":[]}"#, "no requests"),
            (r#"{"id":"x","block_size":0,"requests":[]}"#, "block_size"),
            (
                r#"{"id":"x","block_size":64,"requests":[{"t":0,"out":1,"hash_ids":[1]}]}"#,
                "needs `in`",
            ),
            (
                r#"{"id":"x","block_size":64,"requests":[{"t":-1,"in":1,"out":1,"hash_ids":[]}]}"#,
                "not a time",
            ),
            (
                r#"{"id":"x","block_size":64,"requests":[{"t":0,"in":500,"out":1,"hash_ids":[1]}]}"#,
                "only 1 hash ids",
            ),
            (
                r#"{"id":"x","block_size":64,"requests":[{"t":0,"in":64,"out":1,"hash_ids":[1099511627776]}]}"#,
                "exceeds",
            ),
        ];
        for (text, want) in bad {
            let e = parse(text.as_bytes(), "dir/bad.json")
                .unwrap_err()
                .to_string();
            assert!(e.contains("dir/bad.json") && e.contains(want), "{e}");
        }
        let mut deep = r#"{"t":0,"in":1,"out":1,"hash_ids":[]}"#.to_owned();
        for _ in 0..=MAX_SUBAGENT_DEPTH {
            deep = format!(r#"{{"t":0,"type":"subagent","requests":[{deep}]}}"#);
        }
        let text = format!(r#"{{"id":"x","block_size":64,"requests":[{deep}]}}"#);
        let e = parse(text.as_bytes(), "deep.json").unwrap_err().to_string();
        assert!(e.contains("nested deeper"), "{e}");
    }

    #[test]
    fn a_missing_file_or_empty_directory_is_an_error_naming_it() {
        let e = load(Path::new("/nonexistent/agentic/x.json")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/agentic/x.json"), "{e}");
        let dir = std::env::temp_dir().join(format!("kvmesh-agentic-empty-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let e = list(&dir).unwrap_err().to_string();
        assert!(e.contains("no .json"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
