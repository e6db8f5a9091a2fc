//! The simulated replica's side of prefill/decode disaggregation: which leg a request is, the
//! hand-over of its KV cache, and the modelled transfer time.
//!
//! Real engines move the KV cache over RDMA between a prefill and a decode engine that found
//! each other through the request: SGLang's `bootstrap_host`/`bootstrap_port`/`bootstrap_room`
//! (the same body to both; the server's role says which side it is), vLLM NIXL's
//! `kv_transfer_params` returned by the prefill (`remote_host`, `remote_port`,
//! `remote_request_id`, ...), vLLM Mooncake's `transfer_id` and `remote_bootstrap_addr`. The
//! simulated replica reads exactly those fields, and the decode side *pulls* the cache from the
//! prefill side over HTTP (`GET /kvmesh/kv/<key>` on the address the fields name), which answers
//! once that prefill is done plus the modelled transfer time,
//! `kv_bytes_per_token × prompt tokens / link bandwidth` (divided by the engine's time scale).
//! So a wrong field anywhere in a router's request shows up as a failed request, as it would
//! with real engines.
//!
//! A prefill leg generates one token (SGLang's prefill server and vLLM's `max_tokens: 1` alike)
//! and its blocks enter its prefix cache; a decode leg waits for the hand-over, then computes
//! only the last prompt token and decodes (`Engine::submit_with_kv`); the handed-over blocks
//! enter its cache too, with their KV events, as vLLM's decode engines do.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::watch;

use super::openai::ApiError;
use crate::core::role::Role;

/// Hand-overs waiting at most (a prefill replica's table); beyond it new prefill legs get 503.
pub const MAX_PENDING_TRANSFERS: usize = 10_000;
/// A hand-over nobody fetched is forgotten after this long.
pub const TRANSFER_TTL: Duration = Duration::from_secs(120);
/// Longest transfer key accepted (bytes).
pub const MAX_KEY_BYTES: usize = 128;

/// The replica's disaggregation settings (`[pd]` of its config file).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PdSimConfig {
    /// Its role. `both` (the default) serves requests whole and refuses SGLang bootstrap rooms,
    /// which name no side.
    pub role: Role,
    /// KV cache bytes per prompt token: layers × KV heads × head dim × 2 (K and V) × bytes per
    /// value. Default 131,072 (Llama-3.1-8B in bf16: 32 × 8 × 128 × 2 × 2).
    pub kv_bytes_per_token: u64,
    /// The prefill-to-decode link, gigabits per second. Default 100 (one 100 GbE / 4x HDR lane).
    pub link_gbps: f64,
    /// The longest a decode leg waits for its hand-over (ms), then fails with 503. Default 30,000.
    pub transfer_timeout_ms: u64,
}

impl Default for PdSimConfig {
    fn default() -> Self {
        PdSimConfig {
            role: Role::Both,
            kv_bytes_per_token: 131_072,
            link_gbps: 100.0,
            transfer_timeout_ms: 30_000,
        }
    }
}

impl PdSimConfig {
    /// Checks the numbers.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.link_gbps.is_finite() && self.link_gbps > 0.0 && self.link_gbps <= 1e5) {
            return Err(format!(
                "link_gbps must be in (0, 100000], not {}",
                self.link_gbps
            ));
        }
        if self.kv_bytes_per_token > 1 << 30 {
            return Err("kv_bytes_per_token must be at most 1 GiB".into());
        }
        if !(1..=3_600_000).contains(&self.transfer_timeout_ms) {
            return Err("transfer_timeout_ms must be within 1..=3600000".into());
        }
        Ok(())
    }

    /// The modelled transfer time of `tokens` prompt tokens, at engine time scale `scale`.
    pub fn transfer_time(&self, tokens: usize, scale: f64) -> Duration {
        let bytes = self.kv_bytes_per_token as f64 * tokens as f64;
        let secs = bytes * 8.0 / (self.link_gbps * 1e9);
        let scale = if scale > 0.0 { scale } else { 1.0 };
        Duration::try_from_secs_f64(secs / scale).unwrap_or(Duration::MAX)
    }
}

/// Which part of a disaggregated request a body asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leg {
    /// An ordinary request.
    Whole,
    /// Compute the prompt and hold its KV under `key` for a decode replica.
    Prefill {
        /// Transfer key.
        key: String,
        /// Answer with NIXL's `kv_transfer_params` (what the decode needs to pull).
        nixl: bool,
    },
    /// Pull the prompt's KV from `source` (a URL on the prefill replica), then decode.
    Decode {
        /// Where the hand-over is fetched.
        source: String,
    },
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::bad_request(msg, Some("kv_transfer_params"))
}

fn checked_key(key: &str) -> Result<&str, ApiError> {
    let ok = !key.is_empty()
        && key.len() <= MAX_KEY_BYTES
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(key)
    } else {
        Err(bad(format!(
            "transfer key '{key}' is not 1-128 of [A-Za-z0-9._-]"
        )))
    }
}

fn http_url(base: &str, key: &str) -> Result<String, ApiError> {
    let url = reqwest::Url::parse(base).map_err(|e| bad(format!("'{base}': {e}")))?;
    if url.scheme() != "http" || url.host_str().is_none() {
        return Err(bad(format!("'{base}' is not an http:// address")));
    }
    Ok(format!("{}/kvmesh/kv/{key}", base.trim_end_matches('/')))
}

/// The leg `body` asks a replica of `role` for; `fresh_id` names a NIXL hand-over (vLLM's
/// prefill picks its own request id and returns it).
pub fn leg(body: &Value, role: Role, fresh_id: impl FnOnce() -> String) -> Result<Leg, ApiError> {
    let str_of = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
    if let Some(room) = body.get("bootstrap_room").filter(|v| !v.is_null()) {
        let room = room
            .as_u64()
            .ok_or_else(|| bad("bootstrap_room must be a non-negative integer"))?;
        let key = format!("sglang-{room}");
        return match role {
            Role::Prefill => Ok(Leg::Prefill { key, nixl: false }),
            Role::Decode => {
                let host = str_of(body, "bootstrap_host")
                    .ok_or_else(|| bad("a bootstrap_room needs a bootstrap_host"))?;
                let port = body
                    .get("bootstrap_port")
                    .and_then(Value::as_u64)
                    .and_then(|p| u16::try_from(p).ok())
                    .ok_or_else(|| bad("a bootstrap_room needs a bootstrap_port"))?;
                let host = if host.contains(':') {
                    format!("[{host}]")
                } else {
                    host
                };
                Ok(Leg::Decode {
                    source: http_url(&format!("http://{host}:{port}"), &key)?,
                })
            }
            Role::Both => Err(bad(
                "a bootstrap_room reached a replica that is neither prefill nor decode",
            )),
        };
    }
    let Some(p) = body.get("kv_transfer_params").filter(|v| !v.is_null()) else {
        return Ok(Leg::Whole);
    };
    let flag = |k: &str| p.get(k).and_then(Value::as_bool).unwrap_or(false);
    match (flag("do_remote_decode"), flag("do_remote_prefill")) {
        (true, true) => Err(bad("do_remote_decode and do_remote_prefill both set")),
        (true, false) => {
            if role == Role::Decode {
                return Err(bad("a decode replica got a prefill leg"));
            }
            match str_of(p, "transfer_id") {
                Some(t) => Ok(Leg::Prefill {
                    key: checked_key(&t)?.to_owned(),
                    nixl: false,
                }),
                None => Ok(Leg::Prefill {
                    key: fresh_id(),
                    nixl: true,
                }),
            }
        }
        (false, true) => {
            if role == Role::Prefill {
                return Err(bad("a prefill replica got a decode leg"));
            }
            if let (Some(t), Some(addr)) =
                (str_of(p, "transfer_id"), str_of(p, "remote_bootstrap_addr"))
            {
                if str_of(p, "remote_engine_id").is_none() {
                    return Err(bad("a Mooncake decode leg needs remote_engine_id"));
                }
                return Ok(Leg::Decode {
                    source: http_url(&addr, checked_key(&t)?)?,
                });
            }
            let host = str_of(p, "remote_host").ok_or_else(|| bad("no remote_host"))?;
            let port = p
                .get("remote_port")
                .and_then(Value::as_u64)
                .and_then(|p| u16::try_from(p).ok())
                .ok_or_else(|| bad("no remote_port"))?;
            let id = str_of(p, "remote_request_id").ok_or_else(|| bad("no remote_request_id"))?;
            if str_of(p, "remote_engine_id").is_none() || p.get("remote_block_ids").is_none() {
                return Err(bad(
                    "a NIXL decode leg needs remote_engine_id and remote_block_ids",
                ));
            }
            Ok(Leg::Decode {
                source: http_url(&format!("http://{host}:{port}"), checked_key(&id)?)?,
            })
        }
        (false, false) => Ok(Leg::Whole),
    }
}

/// NIXL's answer to a prefill leg: what the decode replica needs to pull the blocks (vLLM's
/// `NixlConnector.request_finished` fields).
pub fn nixl_params(engine_id: &str, host: &str, port: u16, key: &str, blocks: usize) -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_engine_id": engine_id,
        "remote_block_ids": (0..blocks).collect::<Vec<_>>(),
        "remote_host": host,
        "remote_port": port,
        "remote_request_id": key,
        "tp_size": 1,
    })
}

/// A prefill replica's hand-overs: a prompt's token count once its prefill is done, by key.
#[derive(Debug, Default)]
pub struct Transfers {
    inner: Mutex<HashMap<String, Slot>>,
}

#[derive(Debug)]
struct Slot {
    created: Instant,
    ready: watch::Sender<Option<usize>>,
}

impl Transfers {
    /// The hand-over `key`, created if new (a decode may ask before its prefill arrives, as
    /// SGLang sends both at once). `None` when the table is full.
    pub fn slot(&self, key: &str) -> Option<watch::Receiver<Option<usize>>> {
        let mut map = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = map.get(key) {
            return Some(s.ready.subscribe());
        }
        let now = Instant::now();
        map.retain(|_, s| now.duration_since(s.created) < TRANSFER_TTL);
        if map.len() >= MAX_PENDING_TRANSFERS {
            return None;
        }
        let (tx, rx) = watch::channel(None);
        map.insert(
            key.to_owned(),
            Slot {
                created: now,
                ready: tx,
            },
        );
        Some(rx)
    }

    /// The prefill of `key` is done: `tokens` prompt tokens are ready to go.
    pub fn ready(&self, key: &str, tokens: usize) {
        let map = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = map.get(key) {
            s.ready.send_replace(Some(tokens));
        }
    }

    /// Forgets `key` (its decode took it).
    pub fn taken(&self, key: &str) {
        let mut map = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        map.remove(key);
    }
}

/// Waits for the hand-over `key` within `timeout`, then for its transfer time; the prompt
/// tokens moved, or the error to answer the decode replica with.
pub async fn hand_over(
    transfers: &Transfers,
    key: &str,
    cfg: &PdSimConfig,
    time_scale: f64,
    timeout: Duration,
) -> Result<usize, ApiError> {
    checked_key(key)?;
    let mut rx = transfers.slot(key).ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "too many hand-overs",
        )
    })?;
    // The watch's guard is not `Send`: copy the value out before the next await.
    let waited = tokio::time::timeout(timeout, async {
        rx.wait_for(Option::is_some).await.map(|v| *v)
    })
    .await;
    let tokens = match waited {
        Ok(Ok(v)) => v.unwrap_or(0),
        _ => {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                format!("no prefill finished '{key}' within {timeout:?}"),
            ))
        }
    };
    transfers.taken(key);
    tokio::time::sleep(cfg.transfer_time(tokens, time_scale)).await;
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> String {
        "nixl-r-1".into()
    }

    #[test]
    fn each_protocol_names_its_leg_by_the_fields_the_engines_read() {
        // SGLang: the same body to both sides; the role decides.
        let b = json!({"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7});
        assert_eq!(
            leg(&b, Role::Prefill, id).unwrap(),
            Leg::Prefill {
                key: "sglang-7".into(),
                nixl: false
            }
        );
        assert_eq!(
            leg(&b, Role::Decode, id).unwrap(),
            Leg::Decode {
                source: "http://10.0.0.1:8998/kvmesh/kv/sglang-7".into()
            }
        );
        assert!(leg(&b, Role::Both, id).is_err());
        // vLLM NIXL: the prefill names its own id; the decode pulls with what it returned.
        let p =
            json!({"kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}});
        assert_eq!(
            leg(&p, Role::Prefill, id).unwrap(),
            Leg::Prefill {
                key: id(),
                nixl: true
            }
        );
        assert!(leg(&p, Role::Decode, id).is_err());
        let d = json!({"kv_transfer_params": nixl_params("e", "127.0.0.1", 9000, "nixl-r-1", 2)});
        assert_eq!(
            leg(&d, Role::Decode, id).unwrap(),
            Leg::Decode {
                source: "http://127.0.0.1:9000/kvmesh/kv/nixl-r-1".into()
            }
        );
        // vLLM Mooncake: the router's transfer id on both sides.
        let p = json!({"kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": "xfer-1"}});
        assert_eq!(
            leg(&p, Role::Prefill, id).unwrap(),
            Leg::Prefill {
                key: "xfer-1".into(),
                nixl: false
            }
        );
        let d = json!({"kv_transfer_params": {"do_remote_decode": false, "do_remote_prefill": true,
            "transfer_id": "xfer-1", "remote_bootstrap_addr": "http://10.0.0.2:8998", "remote_engine_id": "e"}});
        assert_eq!(
            leg(&d, Role::Decode, id).unwrap(),
            Leg::Decode {
                source: "http://10.0.0.2:8998/kvmesh/kv/xfer-1".into()
            }
        );
        // Missing or malformed fields are the client's error, never a panic.
        for bad in [
            json!({"bootstrap_room": -1}),
            json!({"bootstrap_room": 1}),
            json!({"kv_transfer_params": {"do_remote_prefill": true}}),
            json!({"kv_transfer_params": {"do_remote_decode": true, "transfer_id": "../x"}}),
            json!({"kv_transfer_params": {"do_remote_prefill": true, "transfer_id": "t", "remote_bootstrap_addr": "ftp://x", "remote_engine_id": "e"}}),
        ] {
            assert!(
                leg(&bad, Role::Decode, id).is_err() || leg(&bad, Role::Prefill, id).is_err(),
                "{bad}"
            );
        }
        assert_eq!(
            leg(&json!({"prompt": "x"}), Role::Decode, id).unwrap(),
            Leg::Whole
        );
    }

    #[test]
    fn the_transfer_takes_bytes_over_bandwidth() {
        let cfg = PdSimConfig::default();
        // 1,000 tokens × 128 KiB = 131 MB over 100 Gb/s = 10.5 ms.
        let t = cfg.transfer_time(1000, 1.0);
        assert_eq!(t.as_micros(), 10_485);
        assert_eq!(cfg.transfer_time(1000, 10.0).as_micros(), 1_048);
        assert!(PdSimConfig {
            link_gbps: 0.0,
            ..cfg.clone()
        }
        .validate()
        .is_err());
        assert!(cfg.validate().is_ok());
    }

    #[tokio::test]
    async fn a_decode_waits_for_its_prefill_even_when_it_asks_first() {
        let t = std::sync::Arc::new(Transfers::default());
        let cfg = PdSimConfig {
            link_gbps: 1e5,
            ..PdSimConfig::default()
        };
        let waiter = {
            let (t, cfg) = (t.clone(), cfg.clone());
            tokio::spawn(async move { hand_over(&t, "k", &cfg, 1.0, Duration::from_secs(5)).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(t.slot("k").is_some());
        t.ready("k", 64);
        assert_eq!(waiter.await.unwrap().unwrap(), 64);
        let late = hand_over(&t, "never", &cfg, 1.0, Duration::from_millis(10)).await;
        assert!(late.is_err());
    }
}
