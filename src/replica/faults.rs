//! Fault injection for reliability tests: the same misbehaviours a router meets in a real fleet
//! (errors, slowness, hangs, crashes, refused connections), switchable by flags at start-up and by
//! `POST /admin/faults` at run time. The randomness is seeded so a failing test replays exactly.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// Fault settings. The default injects nothing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct FaultConfig {
    /// Probability (0..1) that a completion request fails with HTTP 500. Default 0.
    pub error_rate: f64,
    /// Delay added before a completion request is processed, in ms. Default 0.
    pub added_latency_ms: u64,
    /// Accept completion requests but never answer them. Default false.
    pub hang: bool,
    /// Crash when completion request number `crash_after + 1` arrives. Default `None`.
    pub crash_after: Option<u64>,
    /// Close the listening socket (connections are refused) for this many ms; `u64::MAX` means
    /// until changed. Requests on already-open connections get 503 and `Connection: close`.
    /// Default 0.
    pub refuse_connections_ms: u64,
    /// Seed of the error-rate draws. Default 0.
    pub seed: u64,
    /// Streamed answers send this many tokens' events, then nothing more while the connection
    /// stays open: an engine hung mid-stream. Read at every token (a change reaches streams
    /// already running). Default `None`.
    pub stall_stream_after: Option<u32>,
    /// Streamed answers send this many tokens' events, then the connection drops without the
    /// stream's end: an engine dying mid-stream. Read at every token. Default `None`.
    pub cut_stream_after: Option<u32>,
    /// As a KV source (`POST /kvmesh/kv/fetch`, `kv_fetch.rs`), accept each pull, spend its
    /// modelled transfer, then drop the connection before the answer's end: a source dying
    /// mid-transfer, while completions, health checks and scrapes still succeed (so its home
    /// keeps offering it as a holder). Default false.
    pub cut_kv_pulls: bool,
}

/// A partial update for `POST /admin/faults`: absent fields stay as they are.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultPatch {
    /// See [`FaultConfig::error_rate`].
    pub error_rate: Option<f64>,
    /// See [`FaultConfig::added_latency_ms`].
    pub added_latency_ms: Option<u64>,
    /// See [`FaultConfig::hang`].
    pub hang: Option<bool>,
    /// See [`FaultConfig::crash_after`]; `null` clears it.
    #[serde(default, with = "double_option")]
    pub crash_after: Option<Option<u64>>,
    /// See [`FaultConfig::refuse_connections_ms`]; counted from the update.
    pub refuse_connections_ms: Option<u64>,
    /// See [`FaultConfig::seed`]; re-seeds the generator.
    pub seed: Option<u64>,
    /// See [`FaultConfig::stall_stream_after`]; `null` clears it.
    #[serde(default, with = "double_option")]
    pub stall_stream_after: Option<Option<u32>>,
    /// See [`FaultConfig::cut_stream_after`]; `null` clears it.
    #[serde(default, with = "double_option")]
    pub cut_stream_after: Option<Option<u32>>,
    /// See [`FaultConfig::cut_kv_pulls`].
    pub cut_kv_pulls: Option<bool>,
}

mod double_option {
    use serde::{Deserialize, Deserializer};

    pub fn deserialize<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        d: D,
    ) -> Result<Option<Option<T>>, D::Error> {
        Option::<T>::deserialize(d).map(Some)
    }
}

/// What to do with one completion request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Serve it (after `delay`).
    Serve {
        /// Injected latency.
        delay: Duration,
    },
    /// Answer 500.
    Error,
    /// Never answer.
    Hang,
    /// Crash the replica.
    Crash,
    /// Answer 503 and close the connection (refusing mode).
    Refuse,
}

/// What a stream does after a token, under the mid-stream faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamFault {
    /// Go on.
    Continue,
    /// Send nothing more, keep the connection open.
    Stall,
    /// Drop the connection without the stream's end.
    Cut,
}

/// Live fault state shared by the handlers.
#[derive(Debug)]
pub struct Faults {
    inner: Mutex<State>,
}

#[derive(Debug)]
struct State {
    cfg: FaultConfig,
    rng: SmallRng,
    requests: u64,
    refuse_until: Option<Instant>,
}

fn refuse_until(ms: u64) -> Option<Instant> {
    match ms {
        0 => None,
        // "Forever": far enough to never matter, near enough not to overflow Instant.
        u64::MAX => Some(Instant::now() + Duration::from_secs(100 * 365 * 86_400)),
        ms => Some(Instant::now() + Duration::from_millis(ms)),
    }
}

impl Faults {
    /// Fault state starting from `cfg`.
    pub fn new(cfg: FaultConfig) -> Self {
        Self {
            inner: Mutex::new(State {
                rng: SmallRng::seed_from_u64(cfg.seed),
                refuse_until: refuse_until(cfg.refuse_connections_ms),
                cfg,
                requests: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic elsewhere while holding the lock leaves plain data behind; keep using it.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The current settings.
    pub fn config(&self) -> FaultConfig {
        self.lock().cfg.clone()
    }

    /// Until when new connections are refused, if they are.
    pub fn refusing_until(&self) -> Option<Instant> {
        self.lock().refuse_until.filter(|u| *u > Instant::now())
    }

    /// Applies an admin update and returns the new settings.
    pub fn apply(&self, patch: FaultPatch) -> FaultConfig {
        let mut s = self.lock();
        if let Some(v) = patch.error_rate {
            s.cfg.error_rate = v.clamp(0.0, 1.0);
        }
        if let Some(v) = patch.added_latency_ms {
            s.cfg.added_latency_ms = v;
        }
        if let Some(v) = patch.hang {
            s.cfg.hang = v;
        }
        if let Some(v) = patch.crash_after {
            s.cfg.crash_after = v;
            s.requests = 0;
        }
        if let Some(v) = patch.refuse_connections_ms {
            s.cfg.refuse_connections_ms = v;
            s.refuse_until = refuse_until(v);
        }
        if let Some(v) = patch.stall_stream_after {
            s.cfg.stall_stream_after = v;
        }
        if let Some(v) = patch.cut_stream_after {
            s.cfg.cut_stream_after = v;
        }
        if let Some(v) = patch.cut_kv_pulls {
            s.cfg.cut_kv_pulls = v;
        }
        if let Some(v) = patch.seed {
            s.cfg.seed = v;
            s.rng = SmallRng::seed_from_u64(v);
        }
        s.cfg.clone()
    }

    /// What a stream that has sent `sent` tokens' events does next.
    pub fn stream_fault(&self, sent: u32) -> StreamFault {
        let s = self.lock();
        if s.cfg.cut_stream_after.is_some_and(|n| sent >= n) {
            StreamFault::Cut
        } else if s.cfg.stall_stream_after.is_some_and(|n| sent >= n) {
            StreamFault::Stall
        } else {
            StreamFault::Continue
        }
    }

    /// Decides the fate of the next completion request.
    pub fn verdict(&self) -> Verdict {
        let mut s = self.lock();
        if s.refuse_until.is_some_and(|u| u > Instant::now()) {
            return Verdict::Refuse;
        }
        s.requests += 1;
        if s.cfg.crash_after.is_some_and(|n| s.requests > n) {
            return Verdict::Crash;
        }
        if s.cfg.hang {
            return Verdict::Hang;
        }
        let rate = s.cfg.error_rate;
        if rate > 0.0 && s.rng.random::<f64>() < rate {
            return Verdict::Error;
        }
        Verdict::Serve {
            delay: Duration::from_millis(s.cfg.added_latency_ms),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_rate_is_seeded_and_roughly_right() {
        let draw = || {
            let f = Faults::new(FaultConfig {
                error_rate: 0.3,
                seed: 7,
                ..Default::default()
            });
            (0..1000)
                .map(|_| f.verdict() == Verdict::Error)
                .collect::<Vec<_>>()
        };
        let a = draw();
        assert_eq!(a, draw());
        let errors = a.iter().filter(|e| **e).count();
        assert!((250..350).contains(&errors), "{errors}");
    }

    #[test]
    fn crash_after_n_and_patches() {
        let f = Faults::new(FaultConfig {
            crash_after: Some(2),
            ..Default::default()
        });
        assert!(matches!(f.verdict(), Verdict::Serve { .. }));
        assert!(matches!(f.verdict(), Verdict::Serve { .. }));
        assert_eq!(f.verdict(), Verdict::Crash);
        let patch: FaultPatch =
            serde_json::from_str(r#"{"crash_after": null, "hang": true}"#).unwrap();
        f.apply(patch);
        assert_eq!(f.verdict(), Verdict::Hang);
        let patch: FaultPatch =
            serde_json::from_str(r#"{"refuse_connections_ms": 60000}"#).unwrap();
        f.apply(patch);
        assert_eq!(f.verdict(), Verdict::Refuse);
        assert!(f.refusing_until().is_some());
        let patch: FaultPatch =
            serde_json::from_str(r#"{"stall_stream_after": 3, "cut_stream_after": 5}"#).unwrap();
        f.apply(patch);
        assert_eq!(f.stream_fault(2), StreamFault::Continue);
        assert_eq!(f.stream_fault(3), StreamFault::Stall);
        assert_eq!(f.stream_fault(5), StreamFault::Cut);
        f.apply(serde_json::from_str(r#"{"cut_stream_after": null}"#).unwrap());
        assert_eq!(f.stream_fault(9), StreamFault::Stall);
    }
}
