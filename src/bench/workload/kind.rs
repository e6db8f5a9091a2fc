//! Which workload to build, by name, and building one with its family's defaults.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use super::agent::{agent, AgentParams};
use super::agentic::{agentic, default_agentic_dir, AgenticParams};
use super::burst::{burst, BurstParams};
use super::chat::{chat, ChatParams};
use super::from_trace::from_trace;
use super::rag::{rag, RagParams};
use super::request::{GenParams, Workload, WorkloadError};
use super::rollout::{rollout, RolloutParams};
use super::system_prompt::{system_prompt, SystemPromptParams};
use super::tenants::{tenants, TenantsParams};
use super::zipf::{zipf, ZipfParams};
use crate::bench::trace::{self, default_trace};

/// Which workload to build, as given on the command line:
/// `trace[:path] | agentic[:path] | system-prompt | chat | rag | agent | zipf | tenants | burst |
/// rollout`.
#[derive(Clone, Debug, PartialEq)]
pub enum WorkloadKind {
    /// The Mooncake trace; `None` = the conversation trace shipped in `data/traces/`.
    Trace(Option<PathBuf>),
    /// Real agentic conversations ([`AgenticParams`]) from a directory or one file; `None` =
    /// the ones shipped in `data/traces/agentic/`.
    Agentic(Option<PathBuf>),
    /// Shared system prompts ([`SystemPromptParams`]).
    SystemPrompt,
    /// Multi-turn chat ([`ChatParams`]).
    Chat,
    /// Retrieval-augmented generation ([`RagParams`]).
    Rag,
    /// Agent runs ([`AgentParams`]).
    Agent,
    /// Zipf-skewed prefixes ([`ZipfParams`]).
    Zipf,
    /// Multi-tenant mix ([`TenantsParams`]).
    Tenants,
    /// A new hot prefix on top of background traffic ([`BurstParams`]).
    Burst,
    /// RL n-sample rollouts: each prompt n times within 100 ms ([`RolloutParams`]).
    Rollout,
}

impl WorkloadKind {
    /// The synthetic families, in documentation order.
    pub const SYNTHETIC: [WorkloadKind; 6] = [
        WorkloadKind::SystemPrompt,
        WorkloadKind::Chat,
        WorkloadKind::Rag,
        WorkloadKind::Agent,
        WorkloadKind::Zipf,
        WorkloadKind::Tenants,
    ];

    /// Short name (the CLI spelling without a path).
    pub fn name(&self) -> &'static str {
        match self {
            WorkloadKind::Trace(_) => "trace",
            WorkloadKind::Agentic(_) => "agentic",
            WorkloadKind::SystemPrompt => "system-prompt",
            WorkloadKind::Chat => "chat",
            WorkloadKind::Rag => "rag",
            WorkloadKind::Agent => "agent",
            WorkloadKind::Zipf => "zipf",
            WorkloadKind::Tenants => "tenants",
            WorkloadKind::Burst => "burst",
            WorkloadKind::Rollout => "rollout",
        }
    }
}

impl fmt::Display for WorkloadKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkloadKind::Trace(Some(p)) => write!(f, "trace:{}", p.display()),
            WorkloadKind::Agentic(Some(p)) => write!(f, "agentic:{}", p.display()),
            other => f.write_str(other.name()),
        }
    }
}

impl FromStr for WorkloadKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("trace:") {
            if path.is_empty() {
                return Err("trace: needs a path (or use plain `trace`)".into());
            }
            return Ok(WorkloadKind::Trace(Some(PathBuf::from(path))));
        }
        if let Some(path) = s.strip_prefix("agentic:") {
            if path.is_empty() {
                return Err("agentic: needs a path (or use plain `agentic`)".into());
            }
            return Ok(WorkloadKind::Agentic(Some(PathBuf::from(path))));
        }
        match s {
            "trace" => Ok(WorkloadKind::Trace(None)),
            "agentic" => Ok(WorkloadKind::Agentic(None)),
            "system-prompt" => Ok(WorkloadKind::SystemPrompt),
            "chat" => Ok(WorkloadKind::Chat),
            "rag" => Ok(WorkloadKind::Rag),
            "agent" => Ok(WorkloadKind::Agent),
            "zipf" => Ok(WorkloadKind::Zipf),
            "tenants" => Ok(WorkloadKind::Tenants),
            "burst" => Ok(WorkloadKind::Burst),
            "rollout" => Ok(WorkloadKind::Rollout),
            other => Err(format!(
                "unknown workload '{other}' (expected trace[:path], agentic[:path], system-prompt, chat, rag, agent, zipf, tenants, burst or rollout)"
            )),
        }
    }
}

/// Builds a workload with the families' default parameters. For the trace, `gen` is ignored:
/// the whole trace is returned with dequantised arrivals (use `WorkloadArgs::load` in `args.rs` to cut or
/// retime it). The agentic conversations take `gen`'s seed and request cap, not its rate (their
/// times are recorded ones).
pub fn build(kind: &WorkloadKind, gen: &GenParams) -> Result<Workload, WorkloadError> {
    let requests = match kind {
        WorkloadKind::Trace(path) => {
            let path = path.clone().unwrap_or_else(default_trace);
            from_trace(&trace::load(&path)?, true)
        }
        WorkloadKind::Agentic(path) => {
            let path = path.clone().unwrap_or_else(default_agentic_dir);
            agentic(&path, &AgenticParams::default(), gen)?
        }
        WorkloadKind::SystemPrompt => system_prompt(&SystemPromptParams::default(), gen)?,
        WorkloadKind::Chat => chat(&ChatParams::default(), gen)?,
        WorkloadKind::Rag => rag(&RagParams::default(), gen)?,
        WorkloadKind::Agent => agent(&AgentParams::default(), gen)?,
        WorkloadKind::Zipf => zipf(&ZipfParams::default(), gen)?,
        WorkloadKind::Tenants => tenants(&TenantsParams::default(), gen)?,
        WorkloadKind::Burst => burst(&BurstParams::default(), gen)?,
        WorkloadKind::Rollout => rollout(&RolloutParams::default(), gen)?,
    };
    Ok(Workload {
        name: kind.name().to_owned(),
        requests,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::workload::testing::*;

    #[test]
    fn kinds_parse_and_print() {
        for k in WorkloadKind::SYNTHETIC {
            assert_eq!(k.to_string().parse::<WorkloadKind>().unwrap(), k);
        }
        assert_eq!(
            "trace:/x/y.jsonl".parse::<WorkloadKind>().unwrap(),
            WorkloadKind::Trace(Some("/x/y.jsonl".into()))
        );
        assert_eq!(
            "trace".parse::<WorkloadKind>().unwrap(),
            WorkloadKind::Trace(None)
        );
        assert_eq!(
            "burst".parse::<WorkloadKind>().unwrap(),
            WorkloadKind::Burst
        );
        assert_eq!(
            "rollout".parse::<WorkloadKind>().unwrap(),
            WorkloadKind::Rollout
        );
        for k in [
            WorkloadKind::Agentic(None),
            WorkloadKind::Agentic(Some("/x/agentic".into())),
        ] {
            assert_eq!(k.to_string().parse::<WorkloadKind>().unwrap(), k);
        }
        assert!("agentic:".parse::<WorkloadKind>().is_err());
        assert!("nope".parse::<WorkloadKind>().is_err());
        assert!(chat(
            &ChatParams::default(),
            &GenParams {
                rate: 0.0,
                ..gen(1)
            }
        )
        .is_err());
    }
}
