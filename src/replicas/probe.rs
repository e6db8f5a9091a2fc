//! One look at a replica over HTTP: `GET /health`, `GET /v1/models` (ids only) and
//! `GET /metrics` parsed into an [`EngineLoad`]. Every read is bounded in size and time; what the
//! answers mean for routing is the node's business (`node/watchers.rs`, `node/feedback.rs`).

use std::time::Duration;

use serde::Deserialize;

use super::prom::{self, EngineLoad};

/// Load scraping.
#[derive(Clone, Debug, Deserialize, PartialEq)]
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
pub const MAX_SCRAPE_BYTES: usize = 8 << 20;
/// Most model ids taken from one `/v1/models` answer (base models and LoRA adapters); the rest
/// are refused.
pub const MAX_MODELS: usize = 256;
/// Longest model id taken (bytes); longer ones are refused.
pub const MAX_MODEL_ID_BYTES: usize = 256;

async fn get_text(
    client: &reqwest::Client,
    url: &str,
    timeout: Duration,
) -> anyhow::Result<String> {
    let mut resp = client.get(url).timeout(timeout).send().await?;
    anyhow::ensure!(resp.status().is_success(), "HTTP {}", resp.status());
    if resp.content_length().unwrap_or(0) > MAX_SCRAPE_BYTES as u64 {
        anyhow::bail!("body over {MAX_SCRAPE_BYTES} bytes");
    }
    // Chunk by chunk, so a body without a length (chunked) stops at the limit too.
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await? {
        anyhow::ensure!(
            body.len() + chunk.len() <= MAX_SCRAPE_BYTES,
            "body over {MAX_SCRAPE_BYTES} bytes"
        );
        body.extend_from_slice(&chunk);
    }
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// The model ids of a `/v1/models` body, within [`MAX_MODELS`] and [`MAX_MODEL_ID_BYTES`]; the
/// second value counts the ids refused.
pub fn parse_models(text: &str) -> Result<(Vec<String>, usize), serde_json::Error> {
    let list = serde_json::from_str::<ModelList>(text)?;
    let total = list.data.len();
    let ids: Vec<String> = list
        .data
        .into_iter()
        .map(|m| m.id)
        .filter(|id| !id.is_empty() && id.len() <= MAX_MODEL_ID_BYTES)
        .take(MAX_MODELS)
        .collect();
    let refused = total - ids.len();
    Ok((ids, refused))
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
        Ok(text) => match parse_models(&text) {
            Ok((ids, refused)) => {
                if refused > 0 {
                    tracing::warn!(replica = %id, refused, "model ids over the bounds refused");
                }
                Some(ids)
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_lists_are_bounded() {
        let long = "x".repeat(MAX_MODEL_ID_BYTES + 1);
        let body = serde_json::json!({"data": [{"id": "m"}, {"id": ""}, {"id": long}]});
        assert_eq!(
            parse_models(&body.to_string()).unwrap(),
            (vec!["m".to_owned()], 2)
        );
        let many: Vec<_> = (0..MAX_MODELS + 10)
            .map(|i| serde_json::json!({"id": format!("m{i}")}))
            .collect();
        let (ids, refused) = parse_models(&serde_json::json!({"data": many}).to_string()).unwrap();
        assert_eq!((ids.len(), refused), (MAX_MODELS, 10));
        assert!(parse_models("{\"data\": 5}").is_err());
    }
}
