//! A small Prometheus text-format reader for the load figures engines export.
//!
//! Exists because the node needs four or five gauges from each replica every second and nothing
//! else: a full exposition-format parser would be more code to trust than this. Lines it cannot
//! read are skipped and counted — a replica's output must never crash or stall a node.
//!
//! Every number it passes on has a stated bound (the `MAX_*` constants below): a value outside
//! it — `num_gpu_blocks="1000000000000000"`, a negative queue, a usage of 7 — is refused, counted
//! in [`EngineLoad::refused_values`], and the figure keeps what the other lines said. One bad
//! line from one replica must not size anything the node allocates.

/// Load figures read from one scrape; `None` where the engine exported nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineLoad {
    /// Requests waiting (`vllm:num_requests_waiting`, `sglang:num_queue_reqs`), summed over
    /// engines/ranks.
    pub waiting: Option<f64>,
    /// Requests running (`vllm:num_requests_running`, `sglang:num_running_reqs`), summed.
    pub running: Option<f64>,
    /// KV usage 0..1 (`vllm:kv_cache_usage_perc` or its older `vllm:gpu_cache_usage_perc`,
    /// `sglang:token_usage`); the largest over engines.
    pub kv_usage: Option<f64>,
    /// KV capacity in tokens: `num_gpu_blocks × block_size` from `vllm:cache_config_info`.
    pub capacity_tokens: Option<u64>,
    /// Tokens per KV block: `block_size` of `vllm:cache_config_info`, or `page_size` of
    /// `sglang:cache_config_info` (token mode needs it).
    pub block_size: Option<u64>,
    /// LoRA adapters, from the newest `vllm:lora_requests_info` line (GIE model-server
    /// protocol): how many the engine holds at once (`max_lora`), and how many distinct adapters
    /// its running and waiting requests use.
    pub lora: Option<LoraLoad>,
    /// Lines that could not be parsed.
    pub skipped_lines: u64,
    /// Values read but outside their bound (see the `MAX_*` constants), refused.
    pub refused_values: u64,
}

/// What `vllm:lora_requests_info` says (its value is the time it was written: the newest wins).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoraLoad {
    /// Adapters the engine can hold at once (`max_lora`).
    pub max_lora: u64,
    /// Distinct adapters of running requests (`running_lora_adapters`, comma-separated).
    pub running_adapters: u64,
    /// Distinct adapters of waiting requests (`waiting_lora_adapters`).
    pub waiting_adapters: u64,
    /// The line's value: when it was written (seconds since the epoch).
    pub stamp: f64,
}

/// Largest `max_lora` accepted, and most adapters counted in one list.
pub const MAX_LORA: u64 = 4096;

/// Largest `block_size` (tokens per KV block) accepted from `vllm:cache_config_info`. Engines
/// use 1..=256; anything past this is a broken or hostile exporter.
pub const MAX_BLOCK_SIZE: u64 = 4096;
/// Largest `num_gpu_blocks` accepted from one `vllm:cache_config_info` line (2^26 blocks, far
/// past any single engine's KV pool).
pub const MAX_GPU_BLOCKS: u64 = 1 << 26;
/// Largest KV capacity (tokens) a scrape may report, summed over engines: 2^34 (17 G tokens).
pub const MAX_CAPACITY_TOKENS: u64 = 1 << 34;
/// Largest waiting or running request count accepted from one sample.
pub const MAX_REQUESTS: f64 = 1e7;
/// KV usage is a fraction: 0..=1 (a little slack for rounding).
pub const MAX_KV_USAGE: f64 = 1.0 + 1e-6;

/// One sample: metric name, the raw label block (without braces) and the value.
#[derive(Debug, PartialEq)]
pub struct Sample<'a> {
    /// Metric name.
    pub name: &'a str,
    /// Label text between the braces ("" when none).
    pub labels: &'a str,
    /// Value.
    pub value: f64,
}

/// Parses one exposition line. `Ok(None)` for blank and comment lines, `Err(())` for garbage.
#[allow(clippy::result_unit_err)]
pub fn parse_line(line: &str) -> Result<Option<Sample<'_>>, ()> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    let (name, labels, rest) = match line.find(['{', ' ', '\t']) {
        Some(p) if line.as_bytes()[p] == b'{' => {
            let close = label_end(&line[p + 1..]).ok_or(())? + p + 1;
            (&line[..p], &line[p + 1..close], &line[close + 1..])
        }
        Some(p) => (&line[..p], "", &line[p..]),
        None => return Err(()),
    };
    if name.is_empty() {
        return Err(());
    }
    // The value, optionally followed by a timestamp.
    let value_text = rest.split_whitespace().next().ok_or(())?;
    let value = match value_text {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse::<f64>().map_err(|_| ())?,
    };
    Ok(Some(Sample {
        name,
        labels,
        value,
    }))
}

/// Index of the closing brace of a label block, skipping quoted values (which may hold braces).
fn label_end(s: &str) -> Option<usize> {
    let mut in_quotes = false;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if in_quotes => escaped = true,
            '"' => in_quotes = !in_quotes,
            '}' if !in_quotes => return Some(i),
            _ => {}
        }
    }
    None
}

/// The value of label `key` in a raw label block.
pub fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    loop {
        rest = rest.trim_start_matches([',', ' ']);
        let eq = rest.find('=')?;
        let k = rest[..eq].trim();
        let after = rest[eq + 1..].trim_start().strip_prefix('"')?;
        let end = quoted_end(after)?;
        if k == key {
            return Some(&after[..end]);
        }
        rest = &after[end + 1..];
    }
}

fn quoted_end(s: &str) -> Option<usize> {
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => return Some(i),
            _ => {}
        }
    }
    None
}

fn add(slot: &mut Option<f64>, v: f64) {
    *slot = Some(slot.unwrap_or(0.0) + v);
}

fn max(slot: &mut Option<f64>, v: f64) {
    *slot = Some(slot.map_or(v, |s| s.max(v)));
}

/// Reads the load figures of a vLLM or SGLang `/metrics` body. Values outside their bound are
/// refused and counted in [`EngineLoad::refused_values`].
pub fn parse_engine_load(text: &str) -> EngineLoad {
    let mut load = EngineLoad::default();
    let mut legacy_usage = None;
    for line in text.lines() {
        let s = match parse_line(line) {
            Ok(Some(s)) => s,
            Ok(None) => continue,
            Err(()) => {
                load.skipped_lines += 1;
                continue;
            }
        };
        if !s.value.is_finite() {
            continue;
        }
        let requests = (0.0..=MAX_REQUESTS).contains(&s.value);
        let usage = (0.0..=MAX_KV_USAGE).contains(&s.value);
        match s.name {
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" if requests => {
                add(&mut load.waiting, s.value)
            }
            "vllm:num_requests_running" | "sglang:num_running_reqs" if requests => {
                add(&mut load.running, s.value)
            }
            "vllm:kv_cache_usage_perc" | "sglang:token_usage" if usage => {
                max(&mut load.kv_usage, s.value.min(1.0))
            }
            "vllm:gpu_cache_usage_perc" if usage => max(&mut legacy_usage, s.value.min(1.0)),
            "vllm:num_requests_waiting"
            | "sglang:num_queue_reqs"
            | "vllm:num_requests_running"
            | "sglang:num_running_reqs"
            | "vllm:kv_cache_usage_perc"
            | "sglang:token_usage"
            | "vllm:gpu_cache_usage_perc" => load.refused_values += 1,
            "vllm:cache_config_info" => {
                cache_config(&mut load, s.labels, "block_size", "num_gpu_blocks")
            }
            "sglang:cache_config_info" => {
                cache_config(&mut load, s.labels, "page_size", "num_pages")
            }
            "vllm:lora_requests_info" => lora_info(&mut load, s.labels, s.value),
            _ => {}
        }
    }
    if load.kv_usage.is_none() {
        load.kv_usage = legacy_usage;
    }
    load
}

/// `vllm:cache_config_info`'s `block_size` and `num_gpu_blocks` labels (SGLang's `page_size`
/// and `num_pages`), each within its bound; the capacity they give adds to the other engines'
/// up to [`MAX_CAPACITY_TOKENS`].
fn cache_config(load: &mut EngineLoad, labels: &str, size_key: &str, blocks_key: &str) {
    // A label that does not parse as a number ("None" before profiling) says nothing; one that
    // parses out of bounds is refused.
    let bounded = |key: &str, max: u64| -> Result<Option<u64>, ()> {
        match label(labels, key).map(|v| v.trim().parse::<u64>()) {
            Some(Ok(v)) if (1..=max).contains(&v) => Ok(Some(v)),
            Some(Ok(_)) => Err(()),
            // Out of u64 range is out of bounds too; other text says nothing.
            Some(Err(e)) if *e.kind() == std::num::IntErrorKind::PosOverflow => Err(()),
            Some(Err(_)) | None => Ok(None),
        }
    };
    let size = bounded(size_key, MAX_BLOCK_SIZE);
    let blocks = bounded(blocks_key, MAX_GPU_BLOCKS);
    let (size, blocks) = match (size, blocks) {
        (Ok(z), Ok(b)) => (z, b),
        _ => {
            load.refused_values += 1;
            return;
        }
    };
    if let Some(z) = size {
        load.block_size = Some(z);
    }
    if let (Some(b), Some(z)) = (blocks, size) {
        let total = load.capacity_tokens.unwrap_or(0).saturating_add(b * z);
        if total > MAX_CAPACITY_TOKENS {
            load.refused_values += 1;
        } else {
            load.capacity_tokens = Some(total);
        }
    }
}

/// `vllm:lora_requests_info{max_lora,running_lora_adapters,waiting_lora_adapters}`: kept if
/// newer than what an earlier line said; a `max_lora` out of bounds is refused.
fn lora_info(load: &mut EngineLoad, labels: &str, stamp: f64) {
    if load.lora.is_some_and(|l| l.stamp >= stamp) {
        return;
    }
    let Some(max_lora) = label(labels, "max_lora").and_then(|v| v.trim().parse::<u64>().ok())
    else {
        return;
    };
    if max_lora > MAX_LORA {
        load.refused_values += 1;
        return;
    }
    // Adapter names, comma-separated; empty when none. Counted, at most MAX_LORA.
    let count = |key: &str| {
        label(labels, key).map_or(0, |v| {
            (v.split(',').filter(|a| !a.trim().is_empty()).count() as u64).min(MAX_LORA)
        })
    };
    load.lora = Some(LoraLoad {
        max_lora,
        running_adapters: count("running_lora_adapters"),
        waiting_adapters: count("waiting_lora_adapters"),
        stamp,
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="28000",prefix_caching_hash_algo="sha{256}"} 1.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1234 1700000000000
"#;

    #[test]
    fn reads_vllm_names() {
        let l = parse_engine_load(VLLM);
        assert_eq!(l.running, Some(5.0));
        assert_eq!(l.waiting, Some(7.0));
        assert_eq!(l.kv_usage, Some(0.5));
        assert_eq!(l.capacity_tokens, Some(448_000));
        assert_eq!(l.block_size, Some(16));
        assert_eq!(l.skipped_lines, 0);
    }

    #[test]
    fn reads_sglang_names_and_legacy_vllm_usage() {
        let l = parse_engine_load(
            "sglang:num_queue_reqs{model_name=\"m\"} 4\nsglang:num_running_reqs 9\nsglang:token_usage{x=\"y\"} 0.75\n",
        );
        assert_eq!(
            (l.waiting, l.running, l.kv_usage),
            (Some(4.0), Some(9.0), Some(0.75))
        );
        let l = parse_engine_load("vllm:gpu_cache_usage_perc 0.4\n");
        assert_eq!(l.kv_usage, Some(0.4));
    }

    #[test]
    fn garbage_is_skipped_and_counted() {
        let l = parse_engine_load(
            "vllm:num_requests_waiting{a=\"1\" 3\nnovalue\nvllm:num_requests_running abc\n{x=\"1\"} 2\nvllm:num_requests_running 1\n\u{0}\u{ffff}\n",
        );
        assert_eq!(l.running, Some(1.0));
        assert_eq!(l.waiting, None);
        assert_eq!(l.skipped_lines, 5);
    }

    #[test]
    fn out_of_bound_numbers_are_refused_and_counted() {
        let l = parse_engine_load(concat!(
            "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1000000000000000\"} 1\n",
            "vllm:cache_config_info{block_size=\"99999999999999999999999\",num_gpu_blocks=\"10\"} 1\n",
            "vllm:cache_config_info{block_size=\"0\",num_gpu_blocks=\"10\"} 1\n",
            "vllm:num_requests_waiting -3\n",
            "vllm:num_requests_running 1e12\n",
            "vllm:kv_cache_usage_perc 7\n",
        ));
        assert_eq!(l.refused_values, 6);
        assert_eq!(
            (
                l.capacity_tokens,
                l.block_size,
                l.waiting,
                l.running,
                l.kv_usage
            ),
            (None, None, None, None, None)
        );
        // A good engine line next to a bad one still counts; the sum is bounded too.
        let l = parse_engine_load(concat!(
            "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1000\"} 1\n",
            "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1\n",
            "vllm:num_requests_running 2\n",
        ));
        assert_eq!(
            (l.capacity_tokens, l.block_size, l.running),
            (Some(16_000), Some(16), Some(2.0))
        );
        assert_eq!(l.refused_values, 0);
        let line = format!(
            "vllm:cache_config_info{{block_size=\"256\",num_gpu_blocks=\"{MAX_GPU_BLOCKS}\"}} 1\n"
        );
        let l = parse_engine_load(&line.repeat(3));
        assert_eq!(l.capacity_tokens, Some(MAX_CAPACITY_TOKENS));
        assert_eq!(l.refused_values, 2);
    }

    /// The rest of the GIE model-server protocol's names: vLLM's LoRA info (newest line wins),
    /// SGLang's cache config.
    #[test]
    fn reads_lora_info_and_sglang_cache_config() {
        let l = parse_engine_load(concat!(
            "vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"sql,chat\",waiting_lora_adapters=\"\"} 1.7e9\n",
            "vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"sql\",waiting_lora_adapters=\"chat,fr,de\"} 1.8e9\n",
            "vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"x\",waiting_lora_adapters=\"\"} 1.75e9\n",
            "sglang:cache_config_info{page_size=\"16\",num_pages=\"1000\"} 1\n",
        ));
        assert_eq!(
            l.lora,
            Some(LoraLoad {
                max_lora: 4,
                running_adapters: 1,
                waiting_adapters: 3,
                stamp: 1.8e9
            })
        );
        assert_eq!((l.block_size, l.capacity_tokens), (Some(16), Some(16_000)));
        let l = parse_engine_load("vllm:lora_requests_info{max_lora=\"100000\"} 1\n");
        assert_eq!((l.lora, l.refused_values), (None, 1));
    }

    #[test]
    fn labels_with_escapes() {
        assert_eq!(label(r#"a="x\"}",b="2""#, "b"), Some("2"));
        assert_eq!(label(r#"a="1""#, "c"), None);
        assert_eq!(label(r#"a=1"#, "a"), None);
    }
}
