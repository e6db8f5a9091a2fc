//! Prefill/decode disaggregation in `kvmesh sim`: replicas with roles, pairs chosen by the
//! core's [`pd::choose`] at each simulated node, and the two legs of a pair.
//!
//! Kept apart from `sim.rs` so the ordinary path stays as it is; sim.rs calls in at the three
//! places a pair differs from a whole request:
//! - routing: [`pd::choose`] instead of [`Router::route`](crate::core::router::Router::route),
//!   with the decode leg booked in the node's view as the live node books it (in flight, its
//!   blocks credited from the prefill's predicted end: `node/pd_routing.rs`);
//! - the prefill engine's end: the request ran there with `max_tokens = 1` (as vLLM's proxies
//!   send it); its KV then crosses the link, `kv_bytes_per_token × prompt tokens / link
//!   bandwidth` (the same model as `replica/pd.rs`), and only then enters the decode engine;
//! - the decode engine takes the handed-over blocks ([`crate::engine_sim::Engine::submit_with_kv`]: it computes
//!   only the last prompt token) and decodes; the client's first token is the decode's.
//!
//! Hit ratios count the prefill engines' prefix hits only: what the decode received by transfer
//! is not a hit. Deterministic for a seed, like the rest of the simulator.

use std::time::Duration;

use serde::Serialize;

use super::stats::Distribution;
use crate::core::pd::PdConfig;
use crate::core::role::Role;
use crate::engine_sim::{DpEngine, Request};

/// Disaggregation of a simulated fleet.
#[derive(Clone, Debug, PartialEq)]
pub struct SimPd {
    /// Each replica's role, by index (as many as `SimConfig::replicas`).
    pub roles: Vec<Role>,
    /// The bypass threshold (`[pd] bypass_uncached_tokens`); 0 turns the bypass off.
    pub bypass_uncached_tokens: u64,
    /// KV bytes a prompt token moves from prefill to decode. Default 131,072 (Llama-3.1-8B, bf16).
    pub kv_bytes_per_token: u64,
    /// The prefill→decode link, Gb/s. Default 100.
    pub link_gbps: f64,
}

impl Default for SimPd {
    fn default() -> Self {
        SimPd {
            roles: Vec::new(),
            bypass_uncached_tokens: 256,
            kv_bytes_per_token: 131_072,
            link_gbps: 100.0,
        }
    }
}

impl SimPd {
    /// The core's settings (a simulated decode engine computes what it was not handed, as
    /// vLLM's does, so the bypass may pick a decode replica).
    pub fn core(&self) -> PdConfig {
        PdConfig {
            bypass_uncached_tokens: self.bypass_uncached_tokens,
            whole_on_decode: true,
        }
    }

    /// How long `prompt_tokens` of KV take to cross the link.
    pub fn transfer_time(&self, prompt_tokens: usize) -> Duration {
        let bits = self.kv_bytes_per_token as f64 * prompt_tokens as f64 * 8.0;
        Duration::try_from_secs_f64(bits / (self.link_gbps * 1e9)).unwrap_or(Duration::MAX)
    }

    /// Checks it against a fleet of `replicas` (and the central reference, which cannot pair).
    pub(super) fn validate(&self, replicas: usize, oracle: bool) -> Result<(), String> {
        let bad = |m: String| Err(m);
        if self.roles.len() != replicas {
            return bad(format!(
                "{} roles for {} replicas",
                self.roles.len(),
                replicas
            ));
        }
        if !self.roles.iter().any(|r| r.decodes()) {
            return bad("no replica can decode".into());
        }
        if !(self.link_gbps.is_finite() && self.link_gbps > 0.0) {
            return bad("link_gbps must be > 0".into());
        }
        if oracle {
            return bad("the central reference router does not pair replicas".into());
        }
        Ok(())
    }
}

/// Parses a run's P/D spec, `SHAPE[@BYPASS]` (`2P2D@256`): the roles (see [`parse_roles`]) and
/// the bypass threshold (default 256 tokens, 0 = off). `kvmesh sim --pd` and `kvmesh bench --pd`
/// read the same spec.
pub fn parse_spec(spec: &str) -> Result<(Vec<Role>, u64), String> {
    let (shape, bypass) = match spec.split_once('@') {
        Some((s, b)) => (
            s,
            b.trim()
                .parse()
                .map_err(|_| format!("'{spec}': bypass tokens after '@'"))?,
        ),
        None => (spec, SimPd::default().bypass_uncached_tokens),
    };
    Ok((parse_roles(shape)?, bypass))
}

/// Parses a fleet shape: `2P2D` (2 prefill then 2 decode replicas), `1P3D`, `4B` / `4` (4
/// ordinary replicas), or a comma-separated role list (`prefill,decode,both`).
pub fn parse_roles(s: &str) -> Result<Vec<Role>, String> {
    let s = s.trim();
    if s.contains(',') || Role::parse(s).is_some() {
        return s
            .split(',')
            .map(|r| Role::parse(r.trim()).ok_or_else(|| format!("'{r}': not a role")))
            .collect();
    }
    let mut roles = Vec::new();
    let mut n = String::new();
    for c in s.chars() {
        if c.is_ascii_digit() {
            n.push(c);
            continue;
        }
        let role = match c.to_ascii_uppercase() {
            'P' => Role::Prefill,
            'D' => Role::Decode,
            'B' => Role::Both,
            _ => return Err(format!("'{s}': expected e.g. 2P2D or prefill,decode")),
        };
        let count: usize = n
            .parse()
            .map_err(|_| format!("'{s}': count before '{c}'"))?;
        if count > 4096 {
            return Err(format!("'{s}': at most 4096 of a role"));
        }
        roles.extend(std::iter::repeat_n(role, count));
        n.clear();
    }
    if !n.is_empty() {
        let count: usize = n.parse().map_err(|_| format!("'{s}': bad count"))?;
        roles.extend(std::iter::repeat_n(Role::Both, count.min(4096)));
    }
    if roles.is_empty() {
        return Err(format!("'{s}': no replicas"));
    }
    Ok(roles)
}

/// Where a request's legs stand.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Leg {
    /// A whole request on one engine.
    #[default]
    Whole,
    /// The prefill leg runs; the decode replica waits.
    Prefill { decode: usize },
    /// The KV is crossing the link, or the decode leg runs.
    Decode { prefill: usize },
}

/// What the P/D part of a run counts.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PdStats {
    /// Requests split into a pair.
    pub pairs: usize,
    /// Requests the bypass sent whole.
    pub bypassed: usize,
    /// Requests run whole for another reason (no prefill, no decode, same replica, no pair).
    pub whole_other: usize,
    /// Modelled KV transfer times of the pairs, seconds.
    pub transfer: Distribution,
}

/// A decode leg's engine request: the prompt it was handed, its full output.
pub(super) fn submit_decode(
    engine: &mut DpEngine,
    id: usize,
    prompt: Vec<u32>,
    output_tokens: u32,
    now: Duration,
) -> bool {
    let req = Request {
        id: id as u64,
        prompt,
        max_tokens: output_tokens.max(1),
        cache_salt: None,
    };
    engine.submit_with_kv(req, now).is_ok()
}

/// Inter-token latency of one request: the time after its first token over the tokens after
/// it. None for a single-token answer.
pub(super) fn itl(latency_s: f64, ttft_s: f64, output_tokens: u32) -> Option<f64> {
    (output_tokens >= 2).then(|| (latency_s - ttft_s).max(0.0) / f64::from(output_tokens - 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::sim::{run, SimConfig};
    use crate::bench::workload::WorkloadRequest;

    /// Requests with one shared prompt of `tokens`, `gap_s` apart, 8 output tokens each.
    fn same_prompt(n: usize, tokens: u32, gap_s: f64) -> Vec<WorkloadRequest> {
        (0..n)
            .map(|i| WorkloadRequest {
                at_s: i as f64 * gap_s,
                segments: (0..tokens.div_ceil(500))
                    .map(|k| (7 + u64::from(k), 500.min(tokens - 500 * k)))
                    .collect(),
                output_tokens: 8,
                session: None,
                affinity: None,
                tenant: None,
            })
            .collect()
    }

    fn fleet(shape: &str, bypass: u64, link_gbps: f64) -> SimConfig {
        let roles = parse_roles(shape).unwrap();
        SimConfig {
            replicas: roles.len(),
            pd: Some(SimPd {
                roles,
                bypass_uncached_tokens: bypass,
                link_gbps,
                ..SimPd::default()
            }),
            ..SimConfig::default()
        }
    }

    #[test]
    fn the_bypass_sends_a_prompt_the_decode_holds_whole_and_without_it_every_request_pairs() {
        let w = same_prompt(3, 2000, 10.0);
        let r = run(&w, &fleet("1P1D", 256, 100.0)).unwrap();
        let pd = r.pd.unwrap();
        assert_eq!(r.errors, 0);
        assert_eq!(
            (pd.pairs, pd.bypassed),
            (1, 2),
            "the decode holds the first turn's hand-over: the next ones run whole there"
        );
        assert_eq!(
            r.requests_per_replica,
            [1, 3],
            "1 prefill leg; 1 decode leg + 2 whole"
        );
        let off = run(&w, &fleet("1P1D", 0, 100.0)).unwrap();
        assert_eq!(off.pd.unwrap().pairs, 3);
        assert_eq!(off.requests_per_replica, [3, 3]);
        // Hits are the prefill's: its cache holds the prompt after the first request.
        assert!(off.cached_tokens > 0 && off.hit_token_ratio < 1.0);
        assert_eq!((off.ttft.count, off.itl.count), (3, 3));
    }

    #[test]
    fn a_pairs_transfer_time_is_in_its_time_to_first_token() {
        let w = same_prompt(1, 4000, 1.0);
        let fast = run(&w, &fleet("1P1D", 0, 100.0)).unwrap();
        let slow = run(&w, &fleet("1P1D", 0, 10.0)).unwrap();
        let (tf, ts) = (fast.pd.unwrap().transfer.p50, slow.pd.unwrap().transfer.p50);
        let tokens = w[0].prompt_tokens() as f64;
        assert_eq!(tokens, 4000.0);
        assert!((tf - tokens * 131_072.0 * 8.0 / 100e9).abs() < 1e-6, "{tf}");
        assert!((ts - 10.0 * tf).abs() < 1e-6);
        assert!(
            (slow.ttft.mean - fast.ttft.mean - (ts - tf)).abs() < 1e-6,
            "TTFT {} vs {}: the transfer difference is {}",
            slow.ttft.mean,
            fast.ttft.mean,
            ts - tf
        );
        // The decode's tokens after the first are not slowed by the link.
        assert!((slow.itl.mean - fast.itl.mean).abs() < 1e-9);
        // A whole-request fleet pays no transfer.
        let agg = run(
            &w,
            &SimConfig {
                replicas: 2,
                ..SimConfig::default()
            },
        )
        .unwrap();
        assert!(agg.ttft.mean < fast.ttft.mean && agg.pd.is_none());
    }

    #[test]
    fn bad_pd_fleets_are_refused() {
        let w = same_prompt(1, 100, 1.0);
        let mut wrong_count = fleet("1P1D", 0, 100.0);
        wrong_count.replicas = 3;
        let mut oracle = fleet("1P1D", 0, 100.0);
        oracle.oracle = true;
        for cfg in [
            wrong_count,
            fleet("2P", 0, 100.0),
            fleet("1P1D", 0, 0.0),
            oracle,
        ] {
            assert!(run(&w, &cfg).is_err());
        }
    }

    #[test]
    fn fleet_shapes_parse() {
        use Role::*;
        assert_eq!(
            parse_roles("2P2D").unwrap(),
            [Prefill, Prefill, Decode, Decode]
        );
        assert_eq!(
            parse_roles("1p3d").unwrap(),
            [Prefill, Decode, Decode, Decode]
        );
        assert_eq!(parse_roles("2").unwrap(), [Both, Both]);
        assert_eq!(
            parse_roles("prefill, decode,both").unwrap(),
            [Prefill, Decode, Both]
        );
        for bad in ["", "P2", "2X", "prefill,x", "99999P"] {
            assert!(parse_roles(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_transfer_is_bytes_over_bandwidth_and_itl_spreads_the_rest() {
        let pd = SimPd::default();
        // 1,000 tokens × 128 KiB × 8 bits / 100 Gb/s.
        let t = pd.transfer_time(1000).as_secs_f64();
        assert!((t - 1000.0 * 131_072.0 * 8.0 / 1e11).abs() < 1e-9);
        assert_eq!(itl(1.0, 0.2, 5), Some(0.2));
        assert_eq!(itl(1.0, 0.2, 1), None);
    }
}
