//! A replica's health as one small state machine: active checks plus passive outlier ejection.
//!
//! Exists so the rules (when to eject, how long, when to try again) live in one synchronous,
//! testable place instead of being spread across the health task and the request path. Time is
//! passed in, like the routing core.
//!
//! Rules: `unhealthy_after` consecutive failed `/health` checks mark the replica down until a
//! check passes. Independently, `eject_after_failures` consecutive failed requests eject it for a
//! backoff; when the backoff ends it is *half-open*: it takes traffic again, but a single failure
//! re-ejects it for twice as long (up to the maximum), while a success clears the record.
//!
//! **On a lease.** Every part of the record ends by itself: an ejection at its backoff (≤
//! `max_eject_backoff_ms`), and the memory behind the next one (failures counted towards an
//! ejection, the doubling, the half-open state) `max_eject_backoff_ms` after its last failure
//! or reopening, so a replica that failed long ago and has had no traffic since does not go
//! straight back out on its next failure. Active checks are refreshed every interval.
//!
//! Envoy's panic threshold: while most replicas of a pool are ejected ([`pool_in_panic`]),
//! ejections there are ignored (the node sets [`HealthTracker::set_panic`]): a pool whose
//! replicas all failed a few requests (a bad client, a network blip) is routed to whole rather
//! than refusing everyone. Failed active checks still take a replica out.

use std::time::Duration;

use serde::Deserialize;

use crate::core::view::Health;

/// Health bookkeeping for one replica.
#[derive(Clone, Debug)]
pub struct HealthTracker {
    active_failures: u32,
    active_ok: bool,
    checked: bool,
    request_failures: u32,
    ejections: u32,
    ejected_until: Option<Duration>,
    /// When the failure record (`request_failures`, `ejections`) last changed: its lease
    /// starts there.
    record_since: Duration,
    /// Most of the replica's pool is ejected: its own ejection does not take it out of routing.
    panic: bool,
}

/// Whether a pool with `ejected` of its `total` replicas ejected is in panic: more than half.
pub fn pool_in_panic(ejected: usize, total: usize) -> bool {
    ejected.saturating_mul(2) > total
}

impl HealthTracker {
    /// A replica not yet checked: it takes traffic until a check says otherwise.
    pub fn new() -> Self {
        HealthTracker {
            active_failures: 0,
            active_ok: true,
            checked: false,
            request_failures: 0,
            ejections: 0,
            ejected_until: None,
            record_since: Duration::ZERO,
            panic: false,
        }
    }

    /// Sets whether the replica's pool is in panic ([`pool_in_panic`]); returns whether that
    /// changed.
    pub fn set_panic(&mut self, panic: bool) -> bool {
        std::mem::replace(&mut self.panic, panic) != panic
    }

    /// The health routing should use.
    pub fn health(&self) -> Health {
        if self.active_ok && (self.ejected_until.is_none() || self.panic) {
            Health::Healthy
        } else {
            Health::Unhealthy
        }
    }

    /// Whether at least one active check has completed.
    pub fn checked(&self) -> bool {
        self.checked
    }

    /// Whether the replica is ejected by outlier detection right now.
    pub fn ejected(&self) -> bool {
        self.ejected_until.is_some()
    }

    /// Consecutive failed requests.
    pub fn request_failures(&self) -> u32 {
        self.request_failures
    }

    /// Result of one active `/health` check.
    pub fn active_result(&mut self, ok: bool, cfg: &HealthConfig) {
        self.checked = true;
        if ok {
            self.active_failures = 0;
            self.active_ok = true;
        } else {
            self.active_failures = self.active_failures.saturating_add(1);
            if self.active_failures >= cfg.unhealthy_after {
                self.active_ok = false;
            }
        }
    }

    /// A request to the replica succeeded.
    pub fn request_succeeded(&mut self) {
        self.request_failures = 0;
        self.ejections = 0;
    }

    /// A request failed (connect error, timeout, 5xx). Returns whether this ejected the replica.
    pub fn request_failed(&mut self, now: Duration, cfg: &HealthConfig) -> bool {
        if self.ejected_until.is_some() {
            return false;
        }
        self.request_failures = self.request_failures.saturating_add(1);
        self.record_since = now;
        if self.request_failures < cfg.eject_after_failures {
            return false;
        }
        let backoff = cfg
            .eject_backoff_ms
            .saturating_mul(1u64 << self.ejections.min(20))
            .min(cfg.max_eject_backoff_ms);
        self.ejections = self.ejections.saturating_add(1);
        self.ejected_until = Some(now + Duration::from_millis(backoff));
        true
    }

    /// Ends an ejection whose backoff has passed (half-open), and forgets a failure record
    /// whose lease (`max_eject_backoff_ms` since it last changed) is over. Returns whether it
    /// ended an ejection.
    pub fn tick(&mut self, now: Duration, cfg: &HealthConfig) -> bool {
        match self.ejected_until {
            Some(until) if until <= now => {
                self.ejected_until = None;
                // Half-open: one more failure re-ejects.
                self.request_failures = cfg.eject_after_failures.saturating_sub(1);
                self.record_since = now;
                true
            }
            Some(_) => false,
            None => {
                let lease = Duration::from_millis(cfg.max_eject_backoff_ms);
                if now.saturating_sub(self.record_since) >= lease {
                    self.request_failures = 0;
                    self.ejections = 0;
                }
                false
            }
        }
    }
}

impl Default for HealthTracker {
    fn default() -> Self {
        Self::new()
    }
}

/// Health checking.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    /// Interval of active `GET /health` checks (ms). Default 1,000.
    pub interval_ms: u64,
    /// Timeout of one check (ms). Default 1,000.
    pub timeout_ms: u64,
    /// Consecutive failed checks before a replica is marked unhealthy. Default 2.
    pub unhealthy_after: u32,
    /// Consecutive request failures (connect error, timeout, 5xx) that eject a replica. Default 3.
    pub eject_after_failures: u32,
    /// First ejection's length (ms); doubles on each re-ejection after a failed half-open try.
    /// Default 5,000.
    pub eject_backoff_ms: u64,
    /// Longest ejection (ms). Default 60,000.
    pub max_eject_backoff_ms: u64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            interval_ms: 1_000,
            timeout_ms: 1_000,
            unhealthy_after: 2,
            eject_after_failures: 3,
            eject_backoff_ms: 5_000,
            max_eject_backoff_ms: 60_000,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn active_checks_need_consecutive_failures() {
        let cfg = HealthConfig::default();
        let mut h = HealthTracker::new();
        h.active_result(false, &cfg);
        assert_eq!(h.health(), Health::Healthy);
        h.active_result(false, &cfg);
        assert_eq!(h.health(), Health::Unhealthy);
        h.active_result(true, &cfg);
        assert_eq!(h.health(), Health::Healthy);
    }

    #[test]
    fn a_pool_mostly_ejected_is_routed_to_whole() {
        assert!(!pool_in_panic(1, 2), "half ejected: the other one serves");
        assert!(pool_in_panic(2, 2));
        assert!(pool_in_panic(3, 4));
        assert!(!pool_in_panic(0, 0));
        let cfg = HealthConfig::default();
        let mut h = HealthTracker::new();
        for t in 0..3 {
            h.request_failed(ms(t), &cfg);
        }
        assert!(h.ejected());
        assert_eq!(h.health(), Health::Unhealthy);
        assert!(h.set_panic(true));
        assert!(!h.set_panic(true));
        assert_eq!(h.health(), Health::Healthy, "ejection ignored in panic");
        // Failed checks still count.
        h.active_result(false, &cfg);
        h.active_result(false, &cfg);
        assert_eq!(h.health(), Health::Unhealthy);
        h.active_result(true, &cfg);
        assert!(h.set_panic(false));
        assert_eq!(h.health(), Health::Unhealthy, "out of panic: ejected again");
    }

    #[test]
    fn ejection_backs_off_and_half_opens() {
        let cfg = HealthConfig::default(); // 3 failures, 5 s, max 60 s
        let mut h = HealthTracker::new();
        assert!(!h.request_failed(ms(0), &cfg));
        assert!(!h.request_failed(ms(1), &cfg));
        assert!(h.request_failed(ms(2), &cfg));
        assert_eq!(h.health(), Health::Unhealthy);
        // Passing active checks do not end an ejection early.
        h.active_result(true, &cfg);
        assert!(!h.tick(ms(4_000), &cfg));
        assert_eq!(h.health(), Health::Unhealthy);
        assert!(h.tick(ms(5_002), &cfg));
        assert_eq!(h.health(), Health::Healthy);
        // Half-open: one failure re-ejects, for twice as long.
        assert!(h.request_failed(ms(5_100), &cfg));
        assert!(!h.tick(ms(5_100 + 9_999), &cfg));
        assert!(h.tick(ms(5_100 + 10_000), &cfg));
        // A success clears the record: three failures needed again, base backoff.
        h.request_succeeded();
        assert!(!h.request_failed(ms(20_000), &cfg));
        assert!(!h.request_failed(ms(20_001), &cfg));
        assert!(h.request_failed(ms(20_002), &cfg));
        assert!(h.tick(ms(25_002), &cfg));
    }

    /// One step of a replica's life, for the lease property.
    #[derive(Clone, Debug)]
    enum Step {
        Check(bool),
        Failed,
        Succeeded,
        Tick,
    }

    fn step() -> impl proptest::strategy::Strategy<Value = (Step, u64)> {
        use proptest::prelude::*;
        (
            prop_oneof![
                any::<bool>().prop_map(Step::Check),
                Just(Step::Failed),
                Just(Step::Succeeded),
                Just(Step::Tick),
            ],
            0u64..20_000,
        )
    }

    proptest::proptest! {
        /// Whatever happened, once failures stop an ejection ends and the record behind the
        /// next one is forgotten: two ticks, `max_eject_backoff_ms` apart, after the last step
        /// leave a replica that passes its checks healthy, with a clean record.
        #[test]
        fn ejection_and_its_memory_are_on_a_lease(
            steps in proptest::collection::vec(step(), 0..200),
            max in 1_000u64..120_000,
        ) {
            let cfg = HealthConfig { max_eject_backoff_ms: max, ..HealthConfig::default() };
            let mut h = HealthTracker::new();
            let mut now = 0;
            for (s, gap) in steps {
                now += gap;
                match s {
                    Step::Check(ok) => h.active_result(ok, &cfg),
                    Step::Failed => { h.request_failed(ms(now), &cfg); }
                    Step::Succeeded => h.request_succeeded(),
                    Step::Tick => { h.tick(ms(now), &cfg); }
                }
            }
            h.tick(ms(now + max), &cfg);
            h.tick(ms(now + 2 * max), &cfg);
            h.active_result(true, &cfg);
            proptest::prop_assert!(!h.ejected());
            proptest::prop_assert_eq!(h.health(), Health::Healthy);
            proptest::prop_assert_eq!((h.request_failures(), h.ejections), (0, 0));
        }
    }
}
