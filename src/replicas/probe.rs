//! One look at a replica over HTTP: `GET /health`, `GET /v1/models` (ids only) and
//! `GET /metrics` parsed into an [`EngineLoad`]. Every read is bounded in size and time; what the
//! answers mean for routing is the node's business (`node/watchers.rs`, `node/feedback.rs`).

use std::time::Duration;

use serde::Deserialize;

use super::prom::{self, EngineLoad};

/// Load scraping.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScrapeConfig {
    /// Interval of `GET /metrics` scrapes (ms); 0 disables scraping. Default 1,000.
    pub interval_ms: u64,
    /// Timeout of one scrape (ms). Default 1,000.
    pub timeout_ms: u64,
}

impl Default for ScrapeConfig {
    fn default() -> Self {
        ScrapeConfig {
            interval_ms: 1_000,
            timeout_ms: 1_000,
        }
    }
}

/// `/v1/models` as OpenAI-compatible servers answer it (only the ids matter).
#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelEntry>,
}

#[derive(Deserialize)]
struct ModelEntry {
    id: String,
}

/// Largest `/metrics` or `/v1/models` body read from a replica: enough for any real engine, and
/// a bound on what a misbehaving one can make the node buffer.
const MAX_SCRAPE_BYTES: usize = 8 << 20;

async fn get_text(
    client: &reqwest::Client,
    url: &str,
    timeout: Duration,
) -> anyhow::Result<String> {
    let resp = client.get(url).timeout(timeout).send().await?;
    anyhow::ensure!(resp.status().is_success(), "HTTP {}", resp.status());
    if resp.content_length().unwrap_or(0) > MAX_SCRAPE_BYTES as u64 {
        anyhow::bail!("body over {MAX_SCRAPE_BYTES} bytes");
    }
    let bytes = resp.bytes().await?;
    anyhow::ensure!(
        bytes.len() <= MAX_SCRAPE_BYTES,
        "body over {MAX_SCRAPE_BYTES} bytes"
    );
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// `GET {base}/health`: whether the replica answered 2xx within `timeout`.
pub async fn health(client: &reqwest::Client, id: &str, base: &str, timeout: Duration) -> bool {
    match client
        .get(format!("{base}/health"))
        .timeout(timeout)
        .send()
        .await
    {
        Ok(r) => r.status().is_success(),
        Err(e) => {
            tracing::debug!(replica = %id, error = %e, "health check failed");
            false
        }
    }
}

/// `GET {base}/v1/models`: the model ids it serves, or `None` (logged) when it cannot say.
pub async fn models(
    client: &reqwest::Client,
    id: &str,
    base: &str,
    timeout: Duration,
) -> Option<Vec<String>> {
    match get_text(client, &format!("{base}/v1/models"), timeout).await {
        Ok(text) => match serde_json::from_str::<ModelList>(&text) {
            Ok(list) => Some(list.data.into_iter().map(|m| m.id).collect()),
            Err(e) => {
                tracing::warn!(replica = %id, error = %e, "bad /v1/models");
                None
            }
        },
        Err(e) => {
            tracing::warn!(replica = %id, error = %e, "cannot list models");
            None
        }
    }
}

/// `GET {base}/metrics`, parsed (bad lines are skipped and counted in the result).
pub async fn metrics(
    client: &reqwest::Client,
    base: &str,
    timeout: Duration,
) -> anyhow::Result<EngineLoad> {
    let text = get_text(client, &format!("{base}/metrics"), timeout).await?;
    Ok(prom::parse_engine_load(&text))
}
