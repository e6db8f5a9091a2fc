//! The workload flags of `kvmesh sim` and `kvmesh bench`, and `--family-param KEY=VALUE`.

use std::str::FromStr;

use super::agent::{agent, AgentParams};
use super::agentic::{agentic, default_agentic_dir, AgenticParams};
use super::burst::{burst, BurstParams};
use super::chat::{chat, ChatParams};
use super::from_trace::from_trace;
use super::kind::{build, WorkloadKind};
use super::rag::{rag, RagParams};
use super::request::{retime, GenParams, Workload, WorkloadError};
use super::rollout::{rollout, RolloutParams};
use super::system_prompt::{system_prompt, SystemPromptParams};
use super::tenants::{tenants, TenantsParams};
use super::zipf::{zipf, ZipfParams};
use crate::bench::trace::{self, default_trace};

/// The workload flags shared by `kvmesh sim` and `kvmesh bench`.
#[derive(Clone, Debug, clap::Args)]
pub struct WorkloadArgs {
    /// Workload: `trace[:path]` (Mooncake JSONL; default the shipped conversation trace),
    /// `agentic[:path]` (Claude Code conversations, a directory or one file; default the shipped
    /// ones in data/traces/agentic), `system-prompt`, `chat`, `rag`, `agent`, `zipf`, `tenants`,
    /// `burst` or `rollout`.
    #[arg(long, default_value = "trace")]
    pub workload: WorkloadKind,
    /// Mean arrival rate in requests/s. Synthetic families: the Poisson rate they are generated
    /// at (default 20). Trace and agentic: arrival times are rescaled to this mean rate
    /// (default: as recorded, 3.4 req/s for the conversation trace; agentic: as recorded, with
    /// its gap_s and max_pause_s).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Requests: the number to generate (synthetic, default 2,000) or to replay from the start
    /// of the trace or the agentic conversations (default all).
    #[arg(long)]
    pub requests: Option<usize>,
    /// Seed of the generators (and of every other random choice of the command).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Trace only: spread requests sharing a quantised timestamp over the ~3 s step (false:
    /// replay the recorded bursts).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub dequantize: bool,
    /// Synthetic and agentic families: set one parameter of the family, `KEY=VALUE`
    /// (repeatable). Ranges are `LO..=HI`, `LO-HI` or one number. Keys — agentic:
    /// conversations (0 = all), gap_s (mean s between conversation starts), max_pause_s (cap on
    /// a pause within one), prompt_scale (tokens per block × this, (0, 1]), max_prompt_tokens
    /// (keep the first N; 0 = all), max_output_tokens; system-prompt: groups, prompts_per_group,
    /// system_tokens, question_tokens, output_tokens; chat: concurrent_sessions, turns,
    /// system_tokens, user_tokens, answer_tokens; rag: documents, zipf_s, chunks_per_prompt,
    /// chunk_tokens, system_tokens, question_tokens, output_tokens; agent: concurrent_runs, steps,
    /// system_tokens, task_tokens, observation_tokens, action_tokens; zipf: prefixes, hot_weight,
    /// zipf_s, prefix_tokens, suffix_tokens, output_tokens; tenants: big_share,
    /// big_system_tokens, small_tenants, small_system_tokens, user_tokens, output_tokens,
    /// big_skew (big tenant's rate ÷ one small tenant's), big_absent (true: drop its requests);
    /// burst: background_prefixes, prefix_tokens, burst_at_s, burst_s, burst_rate,
    /// burst_prefix_tokens, lead_rate, suffix_tokens, output_tokens; rollout: samples, spread_s,
    /// system_tokens, problem_tokens, output_tokens.
    /// Defaults and meanings: docs/benchmarks-notebook.md and `src/bench/workload/`.
    #[arg(long = "family-param", value_name = "KEY=VALUE")]
    pub family_params: Vec<String>,
}

/// Parameters of a synthetic family settable by name (`--family-param KEY=VALUE`).
pub trait FamilyParams: Default {
    /// The family's settable keys, in documentation order.
    const KEYS: &'static [&'static str];
    /// Sets `key` from its text `value`; an unknown key or a bad value is an error naming it.
    fn set(&mut self, key: &str, value: &str) -> Result<(), WorkloadError>;

    /// Defaults overridden by `KEY=VALUE` items, applied in order (a later one wins).
    fn from_pairs(family: &str, pairs: &[String]) -> Result<Self, WorkloadError> {
        let mut p = Self::default();
        for pair in pairs {
            let Some((key, value)) = pair.split_once('=') else {
                return Err(WorkloadError::Invalid(format!(
                    "--family-param '{pair}' is not KEY=VALUE (keys for {family}: {})",
                    Self::KEYS.join(", ")
                )));
            };
            let key = key.trim();
            if !Self::KEYS.contains(&key) {
                return Err(WorkloadError::Invalid(format!(
                    "unknown parameter '{key}' for the {family} family (valid: {})",
                    Self::KEYS.join(", ")
                )));
            }
            p.set(key, value.trim())?;
        }
        Ok(p)
    }
}

fn parse_num<T: FromStr>(key: &str, value: &str) -> Result<T, WorkloadError> {
    value
        .parse()
        .map_err(|_| WorkloadError::Invalid(format!("{key}: '{value}' is not a valid number")))
}

/// `LO..=HI`, `LO-HI` or `N` (= `N..=N`); the generators check the bounds.
fn parse_range(key: &str, value: &str) -> Result<(u32, u32), WorkloadError> {
    let (lo, hi) = value
        .split_once("..=")
        .or_else(|| value.split_once('-'))
        .unwrap_or((value, value));
    let bad = || {
        WorkloadError::Invalid(format!(
            "{key}: '{value}' is not a range (LO..=HI, LO-HI or N)"
        ))
    };
    let lo = lo.trim().parse().map_err(|_| bad())?;
    let hi = hi.trim().parse().map_err(|_| bad())?;
    Ok((lo, hi))
}

/// Implements [`FamilyParams`] for a struct: `num` fields parse as numbers, `range` fields as
/// ranges; the key is the field's name.
macro_rules! family_params {
    ($ty:ty { $($kind:ident $field:ident),* $(,)? }) => {
        impl FamilyParams for $ty {
            const KEYS: &'static [&'static str] = &[$(stringify!($field)),*];
            fn set(&mut self, key: &str, value: &str) -> Result<(), WorkloadError> {
                match key {
                    $(stringify!($field) => {
                        self.$field = family_params!(@parse $kind key value);
                    })*
                    other => {
                        return Err(WorkloadError::Invalid(format!(
                            "unknown parameter '{other}' (valid: {})",
                            Self::KEYS.join(", ")
                        )))
                    }
                }
                Ok(())
            }
        }
    };
    (@parse num $key:ident $value:ident) => { parse_num($key, $value)? };
    (@parse range $key:ident $value:ident) => { parse_range($key, $value)? };
}

family_params!(AgenticParams {
    num conversations,
    num gap_s,
    num max_pause_s,
    num prompt_scale,
    num max_prompt_tokens,
    num max_output_tokens,
});
family_params!(SystemPromptParams {
    num groups,
    num prompts_per_group,
    num system_tokens,
    range question_tokens,
    range output_tokens,
});
family_params!(ChatParams {
    num concurrent_sessions,
    range turns,
    num system_tokens,
    range user_tokens,
    range answer_tokens,
});
family_params!(RagParams {
    num documents,
    num zipf_s,
    num chunks_per_prompt,
    num chunk_tokens,
    num system_tokens,
    range question_tokens,
    range output_tokens,
});
family_params!(AgentParams {
    num concurrent_runs,
    range steps,
    num system_tokens,
    range task_tokens,
    range observation_tokens,
    range action_tokens,
});
family_params!(ZipfParams {
    num prefixes,
    num hot_weight,
    num zipf_s,
    num prefix_tokens,
    range suffix_tokens,
    range output_tokens,
});
family_params!(TenantsParams {
    num big_share,
    num big_system_tokens,
    num small_tenants,
    num small_system_tokens,
    range user_tokens,
    range output_tokens,
    num big_skew,
    num big_absent,
});
family_params!(BurstParams {
    num background_prefixes,
    num prefix_tokens,
    num burst_at_s,
    num burst_s,
    num burst_rate,
    num burst_prefix_tokens,
    num lead_rate,
    range suffix_tokens,
    range output_tokens,
});

family_params!(RolloutParams {
    num samples,
    num spread_s,
    num system_tokens,
    range problem_tokens,
    range output_tokens,
});

/// Builds a synthetic family with its defaults overridden by `pairs` (`KEY=VALUE`).
pub fn build_with(
    kind: &WorkloadKind,
    gen: &GenParams,
    pairs: &[String],
) -> Result<Workload, WorkloadError> {
    let f = kind.name();
    let requests = match kind {
        WorkloadKind::Trace(_) => {
            if !pairs.is_empty() {
                return Err(WorkloadError::Invalid(
                    "--family-param applies to the synthetic families, not the trace".into(),
                ));
            }
            return build(kind, gen);
        }
        WorkloadKind::Agentic(path) => {
            let path = path.clone().unwrap_or_else(default_agentic_dir);
            agentic(&path, &FamilyParams::from_pairs(f, pairs)?, gen)?
        }
        WorkloadKind::SystemPrompt => system_prompt(&FamilyParams::from_pairs(f, pairs)?, gen)?,
        WorkloadKind::Chat => chat(&FamilyParams::from_pairs(f, pairs)?, gen)?,
        WorkloadKind::Rag => rag(&FamilyParams::from_pairs(f, pairs)?, gen)?,
        WorkloadKind::Agent => agent(&FamilyParams::from_pairs(f, pairs)?, gen)?,
        WorkloadKind::Zipf => zipf(&FamilyParams::from_pairs(f, pairs)?, gen)?,
        WorkloadKind::Tenants => tenants(&FamilyParams::from_pairs(f, pairs)?, gen)?,
        WorkloadKind::Burst => burst(&FamilyParams::from_pairs(f, pairs)?, gen)?,
        WorkloadKind::Rollout => rollout(&FamilyParams::from_pairs(f, pairs)?, gen)?,
    };
    Ok(Workload {
        name: f.to_owned(),
        requests,
    })
}

impl WorkloadArgs {
    /// Builds the workload these flags describe.
    pub fn load(&self) -> Result<Workload, WorkloadError> {
        let defaults = GenParams::default();
        let gen = GenParams {
            rate: self.rate.unwrap_or(defaults.rate),
            requests: self.requests.unwrap_or(defaults.requests),
            seed: self.seed,
        };
        match &self.workload {
            WorkloadKind::Trace(_) if !self.family_params.is_empty() => {
                Err(WorkloadError::Invalid(
                    "--family-param applies to the synthetic families, not the trace".into(),
                ))
            }
            WorkloadKind::Trace(path) => {
                let path = path.clone().unwrap_or_else(default_trace);
                let mut requests = from_trace(&trace::load(&path)?, self.dequantize);
                if let Some(n) = self.requests {
                    requests.truncate(n);
                }
                if let Some(rate) = self.rate {
                    gen.validate()?;
                    retime(&mut requests, rate);
                }
                Ok(Workload {
                    name: "trace".into(),
                    requests,
                })
            }
            WorkloadKind::Agentic(_) => {
                // All of every conversation unless cut; the rate only when given.
                let all = GenParams {
                    requests: self.requests.unwrap_or(usize::MAX),
                    ..gen
                };
                let mut w = build_with(&self.workload, &all, &self.family_params)?;
                if let Some(rate) = self.rate {
                    gen.validate()?;
                    retime(&mut w.requests, rate);
                }
                Ok(w)
            }
            kind => build_with(kind, &gen, &self.family_params),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::workload::testing::*;

    #[test]
    fn trace_args_cut_and_retime_the_trace() {
        let args = WorkloadArgs {
            workload: WorkloadKind::Trace(None),
            rate: Some(10.0),
            requests: Some(500),
            seed: 1,
            dequantize: true,
            family_params: vec![],
        };
        let w = args.load().unwrap();
        assert_eq!(w.requests.len(), 500);
        let span = w.requests[499].at_s - w.requests[0].at_s;
        assert!((499.0 / span - 10.0).abs() < 1e-6, "rate {}", 499.0 / span);
        assert_eq!(w.requests[0].at_s, 0.0);
        let synthetic = WorkloadArgs {
            workload: WorkloadKind::Zipf,
            rate: None,
            requests: Some(50),
            ..args
        };
        assert_eq!(synthetic.load().unwrap().requests.len(), 50);
    }

    #[test]
    fn family_params_override_defaults() {
        let pairs = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let p = AgentParams::from_pairs(
            "agent",
            &pairs(&[
                "concurrent_runs=3",
                "steps=5..=7",
                "action_tokens = 16-32",
                "system_tokens=100",
            ]),
        )
        .unwrap();
        assert_eq!(p.concurrent_runs, 3);
        assert_eq!(p.steps, (5, 7));
        assert_eq!(p.action_tokens, (16, 32));
        assert_eq!(p.system_tokens, 100);
        assert_eq!(p.task_tokens, AgentParams::default().task_tokens);
        let r =
            RagParams::from_pairs("rag", &pairs(&["zipf_s=0.8", "question_tokens=64"])).unwrap();
        assert_eq!((r.zipf_s, r.question_tokens), (0.8, (64, 64)));
        let z =
            ZipfParams::from_pairs("zipf", &pairs(&["hot_weight=10", "hot_weight=20"])).unwrap();
        assert_eq!(z.hot_weight, 20.0, "a later pair wins");
        // Through the CLI flags: the generated workload follows the parameters.
        let args = WorkloadArgs {
            workload: WorkloadKind::SystemPrompt,
            rate: Some(10.0),
            requests: Some(40),
            seed: 1,
            dequantize: true,
            family_params: pairs(&["groups=2", "system_tokens=512"]),
        };
        let w = args.load().unwrap();
        let firsts: HashSet<_> = w.requests.iter().map(|r| r.segments[0]).collect();
        assert_eq!(firsts.len(), 2);
        assert!(w.requests.iter().all(|r| r.segments[0].1 == 512));
        // Every family takes its documented keys.
        for k in WorkloadKind::SYNTHETIC {
            let a = WorkloadArgs {
                workload: k.clone(),
                family_params: vec![],
                ..args.clone()
            };
            assert!(a.load().is_ok(), "{k}");
        }
    }

    #[test]
    fn agentic_args_take_family_params_cut_and_retime() {
        let args = WorkloadArgs {
            workload: WorkloadKind::Agentic(None),
            rate: None,
            requests: None,
            seed: 1,
            dequantize: true,
            family_params: vec!["conversations=4".into(), "prompt_scale=0.25".into()],
        };
        let w = args.load().unwrap();
        let sessions: HashSet<_> = w.requests.iter().map(|r| r.session.clone()).collect();
        assert_eq!((w.name.as_str(), sessions.len()), ("agentic", 4));
        assert!(w
            .requests
            .iter()
            .all(|r| r.segments.iter().all(|s| s.1 <= 16)));
        let cut = WorkloadArgs {
            rate: Some(2.0),
            requests: Some(20),
            ..args.clone()
        }
        .load()
        .unwrap();
        assert_eq!(cut.requests.len(), 20);
        let span = cut.requests[19].at_s - cut.requests[0].at_s;
        assert!((19.0 / span - 2.0).abs() < 1e-6, "rate {}", 19.0 / span);
        let e = WorkloadArgs {
            family_params: vec!["gap=3".into()],
            ..args
        }
        .load()
        .unwrap_err()
        .to_string();
        assert!(e.contains("conversations, gap_s"), "{e}");
    }

    #[test]
    fn family_params_reject_bad_input_naming_the_valid_keys() {
        let one = |k: WorkloadKind, p: &str| {
            WorkloadArgs {
                workload: k,
                rate: None,
                requests: Some(10),
                seed: 1,
                dequantize: true,
                family_params: vec![p.to_owned()],
            }
            .load()
            .unwrap_err()
            .to_string()
        };
        let e = one(WorkloadKind::Agent, "runs=3");
        assert!(
            e.contains("'runs'") && e.contains("agent") && e.contains("concurrent_runs, steps"),
            "{e}"
        );
        let e = one(WorkloadKind::Chat, "turns");
        assert!(
            e.contains("KEY=VALUE") && e.contains("concurrent_sessions"),
            "{e}"
        );
        let e = one(WorkloadKind::Rag, "documents=many");
        assert!(e.contains("documents") && e.contains("'many'"), "{e}");
        let e = one(WorkloadKind::Zipf, "suffix_tokens=9..=x");
        assert!(e.contains("suffix_tokens") && e.contains("range"), "{e}");
        // Values parse but the generator's own checks still apply.
        let e = one(WorkloadKind::Agent, "steps=5-2");
        assert!(e.contains("steps"), "{e}");
        let e = one(WorkloadKind::Tenants, "big_share=1.5");
        assert!(e.contains("big_share"), "{e}");
        let e = one(WorkloadKind::Trace(None), "groups=2");
        assert!(e.contains("not the trace"), "{e}");
    }
}
