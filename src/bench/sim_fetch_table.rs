//! `kvmesh sim --kv-fetch-region-table`: where pulling a prefix's KV from another region pays,
//! against recomputing it locally and forwarding the request there, by prompt length, link,
//! round trip (`--region-rtt-ms`) and the load on either side — each cell the core's own
//! weighing (`core::remote_prefix::RemotePrefix`, the formulas the router applies), over the
//! simulator's engine presets.

use std::fmt::Write as _;

use crate::core::kv_fetch::{source_step_s, LinkSpec, LinkTable};
use crate::core::remote_prefix::{PrefixRoute, RemotePrefix};
use crate::engine_sim::Preset;

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

/// The loads compared, `(label, seconds of prefill queued)`: idle, or 2 s queued (its current
/// step a full chunk).
const LOADS: [(&str, f64); 2] = [("idle", 0.0), ("2 s queued", 2.0)];

/// The table, markdown, for regions `rtt_s` apart: one row per model × prompt × local load ×
/// remote holder load, one column per link; each cell the cheapest way and its predicted
/// seconds to first token.
pub fn region_fetch_table(rtt_s: f64) -> String {
    let mut out = String::new();
    let links = links();
    let _ = write!(
        out,
        "| model | prompt (tokens) | local replica | remote holder | recompute here (s) |"
    );
    for (name, _) in &links {
        let _ = write!(out, " {name} |");
    }
    out.push_str("\n|---|---:|---|---|---:|");
    for _ in &links {
        out.push_str("---|");
    }
    out.push('\n');
    for m in models() {
        for prompt in [2_048u64, 8_192, 32_768, 131_072] {
            for (local, local_s) in LOADS {
                for (remote, remote_s) in LOADS {
                    let queued = (remote_s * m.rate) as u64;
                    let w = |link: LinkSpec| RemotePrefix {
                        prompt_tokens: prompt,
                        local_held: 0,
                        local_queue_s: local_s,
                        local_rate: m.rate,
                        remote_held: prompt,
                        remote_queue_s: remote_s,
                        remote_rate: m.rate,
                        source_step_s: source_step_s(u64::from(queued > 0), queued, m.rate),
                        rtt_s,
                        bytes_per_token: m.bytes_per_token,
                        link,
                    };
                    let recompute = w(links[0].1).costs_s()[0];
                    let _ = write!(
                        out,
                        "| {} | {prompt} | {local} | {remote} | {recompute:.3} |",
                        m.name
                    );
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
    }
    let _ = writeln!(
        out,
        "\nRound trip {:.0} ms; the local replica holding nothing, the remote one the whole \
         prompt. A fetch costs the link's setup ({} ms) + the holder's current step + the bytes \
         at the link's rate + the local prefill of the last token; a forward the round trip + \
         the holder's queue + its prefill of the last token (`core::remote_prefix`).",
        rtt_s * 1000.0,
        links[0].1.setup_ms
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_covers_every_cell_and_fetching_pays_somewhere_and_not_everywhere() {
        let t = region_fetch_table(0.090);
        // Header, rule, 2 models × 4 prompts × 2 local loads × 2 remote loads.
        assert_eq!(t.lines().take_while(|l| l.starts_with('|')).count(), 2 + 32);
        assert!(t.contains("**fetch**"), "{t}");
        assert!(t.contains("recompute"), "{t}");
        assert!(t.contains("forward"), "{t}");
    }
}
