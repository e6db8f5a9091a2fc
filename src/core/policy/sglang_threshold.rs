//! sglang-threshold: the SGLang router's `cache_aware` rule, for comparison.
//!
//! Loads are router-local in-flight counts. When they are imbalanced
//! (`max - min > balance_abs` and `max > balance_rel × min`) the least-loaded replica wins;
//! otherwise, if the best match covers more than `cache_threshold` of the prompt, the best match
//! wins; else the least-loaded. Defaults are SGLang's CLI defaults (64, 1.5, 0.3).

use rand::rngs::SmallRng;

use super::kind::PolicyKind;
use super::pick::{argmin_random_tie, Pick, Policy, PolicyInput, Reason};

/// SGLang's cache_aware rule.
#[derive(Debug)]
pub struct SglangThreshold {
    /// Absolute in-flight gap that counts as imbalance. Default 64.
    pub balance_abs: u32,
    /// Relative gap that counts as imbalance. Default 1.5.
    pub balance_rel: f64,
    /// Match rate above which the cache wins. Default 0.3.
    pub cache_threshold: f64,
}

impl Default for SglangThreshold {
    fn default() -> Self {
        SglangThreshold {
            balance_abs: 64,
            balance_rel: 1.5,
            cache_threshold: 0.3,
        }
    }
}

impl Policy for SglangThreshold {
    fn kind(&self) -> PolicyKind {
        PolicyKind::SglangThreshold
    }
    fn uses_cache(&self) -> bool {
        true
    }
    fn pick(&mut self, input: &PolicyInput<'_>, rng: &mut SmallRng) -> Pick {
        let c = input.candidates;
        let max = c.iter().map(|x| x.in_flight).max().unwrap_or(0);
        let min = c.iter().map(|x| x.in_flight).min().unwrap_or(0);
        if max - min > self.balance_abs && max as f64 > self.balance_rel * min as f64 {
            let chosen = argmin_random_tie(c, rng, |x| x.in_flight);
            return Pick {
                chosen,
                runner_up: None,
                reason: Reason::Imbalanced,
            };
        }
        let best = argmin_random_tie(c, rng, |x| std::cmp::Reverse(x.hit_blocks));
        let rate = if input.keys.is_empty() {
            0.0
        } else {
            c[best].hit_blocks as f64 / input.keys.len() as f64
        };
        if rate > self.cache_threshold {
            Pick {
                chosen: best,
                runner_up: None,
                reason: Reason::CacheMatch,
            }
        } else {
            Pick {
                chosen: argmin_random_tie(c, rng, |x| x.in_flight),
                runner_up: None,
                reason: Reason::LowMatch,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    #[test]
    fn follows_the_cache_above_the_threshold() {
        let c = [cand(0, 50, 10), cand(1, 0, 0)];
        let mut p = SglangThreshold::default();
        let mut r = rng();
        let pick = p.pick(
            &PolicyInput {
                candidates: &c,
                keys: &keys(100),
            },
            &mut r,
        );
        assert_eq!((pick.chosen, pick.reason), (0, Reason::CacheMatch));
        let pick = p.pick(
            &PolicyInput {
                candidates: &c,
                keys: &keys(200),
            },
            &mut r,
        );
        assert_eq!(
            (pick.chosen, pick.reason),
            (1, Reason::LowMatch),
            "25% match is below 0.3"
        );
    }

    #[test]
    fn imbalance_overrides_the_cache() {
        let c = [cand(0, 100, 100), cand(1, 0, 10)];
        let pick = SglangThreshold::default().pick(
            &PolicyInput {
                candidates: &c,
                keys: &keys(100),
            },
            &mut rng(),
        );
        assert_eq!((pick.chosen, pick.reason), (1, Reason::Imbalanced));
        // 90 apart but not 1.5x: balanced, cache wins.
        let c = [cand(0, 100, 270), cand(1, 0, 200)];
        let pick = SglangThreshold::default().pick(
            &PolicyInput {
                candidates: &c,
                keys: &keys(100),
            },
            &mut rng(),
        );
        assert_eq!(pick.chosen, 0);
    }
}
