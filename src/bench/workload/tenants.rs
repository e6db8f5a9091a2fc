//! The tenants family: one big tenant with a fixed system prompt, many small ones.
//!
//! `big_skew` sets the big tenant's rate as a multiple of one small tenant's (the KV-quota
//! figures use 100×), and `big_absent` drops its requests from the very same draw, so the small
//! tenants' requests and arrival times are identical with and without it: the baseline a quota
//! is measured against.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::request::{GenParams, WorkloadError, WorkloadRequest};
use super::synth::{check_range, positive, push_text, tokens_in, Arrivals, FAMILY_TENANTS};

/// Multi-tenant mix: a fraction `big_share` of requests comes from tenant `big`, whose requests
/// all start with one long fixed system prompt; the rest come from `small_tenants` tenants
/// (`small-<i>`, uniform), each with its own shorter system prompt. Every request ends with a
/// unique user message; the tenant id is sent in `x-tenant-id`.
#[derive(Clone, Debug)]
pub struct TenantsParams {
    /// Share of requests from the big tenant. Default 0.6.
    pub big_share: f64,
    /// The big tenant's system prompt. Default 4,096 tokens.
    pub big_system_tokens: u32,
    /// Number of small tenants. Default 40.
    pub small_tenants: usize,
    /// Each small tenant's system prompt. Default 1,024 tokens.
    pub small_system_tokens: u32,
    /// User message range. Default 64..=512 tokens.
    pub user_tokens: (u32, u32),
    /// Output length range. Default 64..=256 tokens.
    pub output_tokens: (u32, u32),
    /// When > 0, the big tenant's request rate as a multiple of one small tenant's; it sets
    /// `big_share` to `big_skew / (big_skew + small_tenants)`. Default 0 (use `big_share`).
    pub big_skew: f64,
    /// Generate as usual, then drop the big tenant's requests: the small tenants' requests
    /// are the same ones at the same times. Default false.
    pub big_absent: bool,
}

impl Default for TenantsParams {
    fn default() -> Self {
        TenantsParams {
            big_share: 0.6,
            big_system_tokens: 4096,
            small_tenants: 40,
            small_system_tokens: 1024,
            user_tokens: (64, 512),
            output_tokens: (64, 256),
            big_skew: 0.0,
            big_absent: false,
        }
    }
}

/// Generates [`TenantsParams`] requests.
pub fn tenants(p: &TenantsParams, gen: &GenParams) -> Result<Vec<WorkloadRequest>, WorkloadError> {
    gen.validate()?;
    positive("small_tenants", p.small_tenants)?;
    if !(0.0..=1.0).contains(&p.big_share) {
        return Err(WorkloadError::Invalid("big_share must be in [0, 1]".into()));
    }
    if !(p.big_skew.is_finite() && p.big_skew >= 0.0) {
        return Err(WorkloadError::Invalid(
            "big_skew must be a number ≥ 0".into(),
        ));
    }
    let big_share = if p.big_skew > 0.0 {
        p.big_skew / (p.big_skew + p.small_tenants as f64)
    } else {
        p.big_share
    };
    check_range("user_tokens", p.user_tokens)?;
    check_range("output_tokens", p.output_tokens)?;
    let mut rng = SmallRng::seed_from_u64(gen.seed);
    let mut arrivals = Arrivals {
        t: 0.0,
        rate: gen.rate,
    };
    let mut out = Vec::with_capacity(gen.requests);
    for i in 0..gen.requests {
        let mut segments = Vec::new();
        let tenant = if rng.random_bool(big_share) {
            push_text(
                &mut segments,
                FAMILY_TENANTS,
                u64::MAX,
                0,
                p.big_system_tokens,
            );
            "big".to_owned()
        } else {
            let t = rng.random_range(0..p.small_tenants) as u64;
            push_text(&mut segments, FAMILY_TENANTS, t, 0, p.small_system_tokens);
            format!("small-{t}")
        };
        let user = tokens_in(&mut rng, p.user_tokens);
        push_text(&mut segments, FAMILY_TENANTS, u64::MAX - 1, i as u64, user);
        out.push(WorkloadRequest {
            at_s: arrivals.next(&mut rng),
            segments,
            output_tokens: tokens_in(&mut rng, p.output_tokens),
            session: None,
            affinity: None,
            tenant: Some(tenant),
        });
    }
    if p.big_absent {
        out.retain(|r| r.tenant.as_deref() != Some("big"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::workload::testing::*;

    #[test]
    fn a_skewed_big_tenant_is_that_many_small_ones_and_its_absence_changes_nothing_else() {
        let skewed = TenantsParams {
            big_skew: 100.0,
            small_tenants: 10,
            ..Default::default()
        };
        let with = tenants(&skewed, &gen(5000)).unwrap();
        let big = with
            .iter()
            .filter(|r| r.tenant.as_deref() == Some("big"))
            .count();
        let per_small = (with.len() - big) as f64 / 10.0;
        let ratio = big as f64 / per_small;
        assert!((ratio - 100.0).abs() < 15.0, "{ratio}");
        let without = tenants(
            &TenantsParams {
                big_absent: true,
                ..skewed
            },
            &gen(5000),
        )
        .unwrap();
        let small: Vec<_> = with
            .iter()
            .filter(|r| r.tenant.as_deref() != Some("big"))
            .collect();
        assert_eq!(small.len(), without.len());
        assert!(small.iter().zip(&without).all(|(a, b)| {
            a.at_s == b.at_s && a.segments == b.segments && a.tenant == b.tenant
        }));
    }

    #[test]
    fn tenants_big_one_shares_one_prompt_small_ones_their_own() {
        let p = TenantsParams::default();
        let reqs = tenants(&p, &gen(3000)).unwrap();
        let big: Vec<_> = reqs
            .iter()
            .filter(|r| r.tenant.as_deref() == Some("big"))
            .collect();
        let share = big.len() as f64 / reqs.len() as f64;
        assert!((share - p.big_share).abs() < 0.04, "{share}");
        let big_segments = (p.big_system_tokens / MAX_SEGMENT_TOKENS) as usize;
        assert!(big
            .iter()
            .all(|r| r.segments[..big_segments] == big[0].segments[..big_segments]));
        let mut small: HashMap<&str, HashSet<(u64, u32)>> = HashMap::new();
        for r in reqs.iter().filter(|r| r.tenant.as_deref() != Some("big")) {
            small
                .entry(r.tenant.as_deref().unwrap())
                .or_default()
                .insert(r.segments[0]);
        }
        assert_eq!(small.len(), p.small_tenants);
        assert!(small.values().all(|firsts| firsts.len() == 1));
        let distinct: HashSet<_> = small.values().flatten().collect();
        assert_eq!(distinct.len(), p.small_tenants);
    }
}
