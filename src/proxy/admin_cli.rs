//! `kvmesh replicas list|add|drain|rm`: the admin API from the command line.
//!
//! Exists so an operator changes a running fleet with one command against any node of the
//! region (the node shares the change through gossip), with the same token file as
//! `kvmesh status`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};

use super::admin::CommandAnswer;
use crate::core::role::Role;
use crate::node::AdminReplica;
use crate::replicas::entry::ReplicaConfig;

/// `kvmesh replicas`.
#[derive(Debug, Args)]
pub struct ReplicasArgs {
    /// The node's base URL, e.g. http://127.0.0.1:8080.
    #[arg(long, global = true, default_value = "http://127.0.0.1:8080")]
    pub node: String,
    /// File holding the bearer token for /admin/* (else `KVMESH_ADMIN_TOKEN`).
    #[arg(long, value_name = "FILE", global = true)]
    pub token_file: Option<PathBuf>,
    /// What to do.
    #[command(subcommand)]
    pub command: ReplicasCommand,
}

/// The replica commands.
#[derive(Debug, Subcommand)]
pub enum ReplicasCommand {
    /// The replicas of the node's region as the node sees them.
    List,
    /// Add a replica (or update one and end its drain) on every node of the region.
    Add {
        /// Base URL of its OpenAI-compatible API.
        url: String,
        /// Stable id (default: the URL's host:port).
        #[arg(long)]
        id: Option<String>,
        /// Pool (default `shared`).
        #[arg(long)]
        pool: Option<String>,
        /// Zone or rack.
        #[arg(long)]
        zone: Option<String>,
        /// A model it serves (repeat; default: discovered from its /v1/models).
        #[arg(long = "model")]
        models: Vec<String>,
        /// In-flight requests above which it counts as full (default 256).
        #[arg(long)]
        max_in_flight: Option<u32>,
        /// Prefill speed in tokens/s for the cost model (default 50,000).
        #[arg(long)]
        prefill_tokens_per_s: Option<f64>,
        /// KV capacity in tokens (default: scraped).
        #[arg(long)]
        capacity_tokens: Option<u64>,
        /// Disaggregation role: prefill, decode or both (default both).
        #[arg(long)]
        role: Option<String>,
        /// A prefill replica's KV bootstrap port (SGLang, vLLM Mooncake; default 8998).
        #[arg(long)]
        bootstrap_port: Option<u16>,
    },
    /// Stop routing new requests to a replica; requests in flight finish.
    Drain {
        /// Replica id.
        id: String,
        /// Wait up to this many seconds for its in-flight requests to finish.
        #[arg(long, default_value_t = 0)]
        wait: u64,
    },
    /// Drain a replica, then drop it from the registry.
    Rm {
        /// Replica id.
        id: String,
        /// Wait up to this many seconds for its in-flight requests to finish.
        #[arg(long, default_value_t = 0)]
        wait: u64,
    },
}

/// Runs a `kvmesh replicas` command; returns what to print.
pub async fn run(args: ReplicasArgs, token: Option<String>) -> anyhow::Result<String> {
    super::install_crypto_provider();
    let wait = match &args.command {
        ReplicasCommand::Drain { wait, .. } | ReplicasCommand::Rm { wait, .. } => *wait,
        _ => 0,
    };
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10 + wait))
        .build()?;
    let base = args.node.trim_end_matches('/');
    let auth = |r: reqwest::RequestBuilder| match &token {
        Some(t) => r.bearer_auth(t),
        None => r,
    };
    let req = match args.command {
        ReplicasCommand::List => client.get(format!("{base}/admin/replicas")),
        ReplicasCommand::Add {
            url,
            id,
            pool,
            zone,
            models,
            max_in_flight,
            prefill_tokens_per_s,
            capacity_tokens,
            role,
            bootstrap_port,
        } => {
            let mut spec = ReplicaConfig::from_url(url);
            spec.id = id;
            spec.models = models;
            spec.capacity_tokens = capacity_tokens;
            if let Some(p) = pool {
                spec.pool = p;
            }
            if let Some(z) = zone {
                spec.zone = z;
            }
            if let Some(m) = max_in_flight {
                spec.max_in_flight = m;
            }
            if let Some(p) = prefill_tokens_per_s {
                spec.prefill_tokens_per_s = p;
            }
            if let Some(r) = role {
                spec.role = Role::parse(&r)
                    .with_context(|| format!("--role {r}: expected prefill, decode or both"))?;
            }
            spec.bootstrap_port = bootstrap_port;
            client
                .post(format!("{base}/admin/replicas"))
                .json(&spec_json(&spec))
        }
        ReplicasCommand::Drain { id, wait } => client.post(format!(
            "{base}/admin/replicas/{}/drain?wait_s={wait}",
            encode(&id)
        )),
        ReplicasCommand::Rm { id, wait } => client.delete(format!(
            "{base}/admin/replicas/{}?wait_s={wait}",
            encode(&id)
        )),
    };
    let resp = auth(req)
        .send()
        .await
        .with_context(|| format!("cannot reach {base}"))?;
    let status = resp.status();
    let body = resp.text().await?;
    anyhow::ensure!(status.is_success(), "{base} answered {status}: {body}");
    if let Ok(list) = serde_json::from_str::<Vec<AdminReplica>>(&body) {
        return Ok(render_list(&list));
    }
    let a: CommandAnswer = serde_json::from_str(&body).context("unexpected answer")?;
    let mut out = format!(
        "{} {}: {} in flight",
        a.outcome.op, a.outcome.id, a.outcome.in_flight
    );
    match a.drained {
        Some(true) => out.push_str(", drained"),
        Some(false) => out.push_str(", still busy when the wait ended"),
        None => {}
    }
    out.push('\n');
    Ok(out)
}

/// The JSON the admin API takes for a replica (the `[[replicas]]` fields).
fn spec_json(r: &ReplicaConfig) -> serde_json::Value {
    let mut v = serde_json::json!({
        "url": r.url,
        "pool": r.pool,
        "zone": r.zone,
        "models": r.models,
        "max_in_flight": r.max_in_flight,
        "prefill_tokens_per_s": r.prefill_tokens_per_s,
    });
    if let Some(id) = &r.id {
        v["id"] = id.clone().into();
    }
    if let Some(c) = r.capacity_tokens {
        v["capacity_tokens"] = c.into();
    }
    v["role"] = r.role.as_str().into();
    if let Some(p) = r.bootstrap_port {
        v["bootstrap_port"] = p.into();
    }
    if !r.engine_id.is_empty() {
        v["engine_id"] = r.engine_id.clone().into();
    }
    v
}

/// Percent-encodes a replica id for a path segment (ids are usually `host:port`).
fn encode(id: &str) -> String {
    id.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b':' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn render_list(list: &[AdminReplica]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<24} {:<10} {:<8} {:<7} {:>6} {:>6}  url",
        "replica", "health", "pool", "role", "infl", "peers"
    );
    for r in list {
        // `*`: an operator's drain holds it; "removed": out of the registry, dropped once idle.
        let mut health = if r.removed {
            "removed".to_owned()
        } else {
            r.health.clone()
        };
        if r.drained {
            health.push('*');
        }
        let _ = writeln!(
            out,
            "{:<24} {:<10} {:<8} {:<7} {:>6} {:>6}  {}{}",
            r.id,
            health,
            r.pool,
            r.role,
            r.in_flight,
            r.peer_in_flight,
            r.url,
            if r.learned { "  (learned)" } else { "" }
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_encoded_for_a_path_segment() {
        assert_eq!(encode("10.0.0.5:8000"), "10.0.0.5:8000");
        assert_eq!(encode("a/b c"), "a%2Fb%20c");
    }
}
