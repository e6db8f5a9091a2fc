//! `kvmesh sim --kv-fetch-region-table`: where pulling a prefix's KV from another region pays,
//! against recomputing it locally and forwarding the request there, by prompt length, link and
//! load — each cell the core's own weighing (`core::remote_prefix::RemotePrefix`), the rule the
//! router applies, over the simulator's engine presets.

use std::fmt::Write as _;

use crate::core::kv_fetch::{source_step_s, LinkSpec, LinkTable};
use crate::core::remote_prefix::{PrefixRoute, RemotePrefix};
use crate::engine_sim::Preset;

/// Round trip between the two regions, seconds (eu-west to us-east, about 90 ms).
const RTT_S: f64 = 0.090;

/// A model: name, KV bytes per token, prefill tokens/s (the simulator preset's linear rate).
struct Model {
    name: &'static str,
    bytes_per_token: u32,
    rate: f64,
}

fn models() -> [Model; 2] {
    let rate = |p: Preset| 1000.0 / p.config().prefill_ms_per_token.max(1e-9);
    [
        // Llama-3.1-8B BF16: 32 layers × 8 KV heads × 128 × 2 (K, V) × 2 bytes.
        Model {
            name: "8B (1×H100)",
            bytes_per_token: 131_072,
            rate: rate(Preset::Llama8bH100),
        },
        // Llama-3.1-70B BF16: 80 layers × 8 KV heads × 128 × 2 × 2 bytes.
        Model {
            name: "70B (4×H100)",
            bytes_per_token: 327_680,
            rate: rate(Preset::Llama70bTp4),
        },
    ]
}

/// The links compared: the default cross-region one and two dedicated interconnects.
fn links() -> [(&'static str, LinkSpec); 3] {
    let wan = LinkTable::default().cross_region;
    [
        ("one 5 Gb/s WAN flow (default)", wan),
        (
            "100 Gb/s interconnect",
            LinkSpec {
                gb_per_s: 12.5,
                setup_ms: wan.setup_ms,
            },
        ),
        (
            "400 Gb/s interconnect",
            LinkSpec {
                gb_per_s: 50.0,
                setup_ms: wan.setup_ms,
            },
        ),
    ]
}

/// The table, markdown: one row per model × prompt × load, one column per link; each cell the
/// cheapest way and its predicted seconds to first token.
pub fn region_fetch_table() -> String {
    let mut out = String::new();
    let links = links();
    let _ = write!(
        out,
        "| model | prompt (tokens) | remote holder | local idle, recompute (s) |"
    );
    for (name, _) in &links {
        let _ = write!(out, " {name} |");
    }
    out.push_str("\n|---|---:|---|---:|");
    for _ in &links {
        out.push_str("---|");
    }
    out.push('\n');
    for m in models() {
        for prompt in [2_048u64, 8_192, 32_768, 131_072] {
            // Idle, or 2 s of prefill queued (its current step a full chunk).
            for (load, queued) in [("idle", 0u64), ("2 s queued", (2.0 * m.rate) as u64)] {
                let w = |link: LinkSpec| RemotePrefix {
                    prompt_tokens: prompt,
                    local_held: 0,
                    local_queue_s: 0.0,
                    local_rate: m.rate,
                    remote_held: prompt,
                    remote_queue_s: queued as f64 / m.rate,
                    remote_rate: m.rate,
                    source_step_s: source_step_s(u64::from(queued > 0), queued, m.rate),
                    rtt_s: RTT_S,
                    bytes_per_token: m.bytes_per_token,
                    link,
                };
                let recompute = w(links[0].1).costs_s()[0];
                let _ = write!(out, "| {} | {prompt} | {load} | {recompute:.3} |", m.name);
                for (_, link) in &links {
                    let (way, s) = w(*link).choose();
                    let way = match way {
                        PrefixRoute::Recompute => "recompute",
                        PrefixRoute::Fetch => "**fetch**",
                        PrefixRoute::Forward => "forward",
                    };
                    let _ = write!(out, " {way} {s:.3} |");
                }
                out.push('\n');
            }
        }
    }
    let _ = writeln!(
        out,
        "\nRound trip {:.0} ms; the local replica idle, holding nothing; the remote one holding \
         the whole prompt. A fetch costs the link's setup ({} ms) + the holder's current step + \
         the bytes at the link's rate + the local prefill of the last token.",
        RTT_S * 1000.0,
        links[0].1.setup_ms
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_covers_every_cell_and_fetching_pays_somewhere_and_not_everywhere() {
        let t = region_fetch_table();
        // Header, rule, 2 models × 4 prompts × 2 loads.
        assert_eq!(t.lines().take_while(|l| l.starts_with('|')).count(), 2 + 16);
        assert!(t.contains("**fetch**"), "{t}");
        assert!(t.contains("recompute"), "{t}");
        assert!(t.contains("forward"), "{t}");
    }
}
