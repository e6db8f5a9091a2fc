//! Command-line flags of `kvmesh replica`, layered over an optional TOML config file.

use std::path::PathBuf;

use anyhow::Context;

use crate::engine_sim::Preset;

use super::config::{KvEventsConfig, ReplicaConfig, MAX_DP_RANKS};

/// `kvmesh replica` flags. Flags override the `--config` file, which overrides the defaults.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplicaArgs {
    /// HTTP port (0 = any free port).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Interface to bind.
    #[arg(long)]
    pub host: Option<String>,
    /// TOML file with a `ReplicaConfig` (engine parameters under `[engine]`).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Engine preset: 8b-h100 or 70b-tp4 (replaces the file's `[engine]` timing and capacity).
    #[arg(long)]
    pub preset: Option<Preset>,
    /// Run the model this many times faster than real time.
    #[arg(long)]
    pub time_scale: Option<f64>,
    /// Replica id for the `x-kvmesh-replica` header (default `replica-<port>`).
    #[arg(long)]
    pub id: Option<String>,
    /// Served model name.
    #[arg(long)]
    pub model: Option<String>,
    /// Publish vLLM KV events on this ZMQ PUB port.
    #[arg(long)]
    pub kv_events_port: Option<u16>,
    /// Serve KV event replay on this ZMQ ROUTER port (needs --kv-events-port).
    #[arg(long, requires = "kv_events_port")]
    pub kv_replay_port: Option<u16>,
    /// Topic frame of KV event messages.
    #[arg(long, requires = "kv_events_port")]
    pub kv_topic: Option<String>,
    /// Data-parallel ranks (independent engines behind this address; rank r publishes KV
    /// events on the KV-event port + r).
    #[arg(long)]
    pub dp_ranks: Option<u16>,
    /// Disaggregation role: prefill, decode or both (`docs/pd.md`).
    #[arg(long)]
    pub role: Option<String>,
    /// The prefill-to-decode link in Gb/s, for the modelled hand-over time.
    #[arg(long)]
    pub link_gbps: Option<f64>,
    /// CPU-tier capacity in tokens: computed blocks are written through to host memory and
    /// loaded back on a hit, with vLLM offloading-connector KV events (medium "CPU"). 0: none.
    #[arg(long)]
    pub cpu_capacity_tokens: Option<usize>,
    /// CPU-tier host-to-device link, GB/s (default 25).
    #[arg(long)]
    pub cpu_gb_per_s: Option<f64>,
    /// KV bytes per token (default 131072, an 8B model in BF16): the modelled P/D hand-over
    /// time and the CPU tier's load time.
    #[arg(long)]
    pub kv_bytes_per_token: Option<u32>,
    /// Fault: probability of answering 500.
    #[arg(long)]
    pub fault_error_rate: Option<f64>,
    /// Fault: added latency per request, ms.
    #[arg(long)]
    pub fault_latency_ms: Option<u64>,
    /// Fault: never answer completion requests.
    #[arg(long)]
    pub fault_hang: bool,
    /// Fault: exit the process when request N+1 arrives.
    #[arg(long)]
    pub fault_crash_after: Option<u64>,
    /// Fault: refuse connections from start-up until changed via /admin/faults.
    #[arg(long)]
    pub fault_refuse_connections: bool,
    /// Seed of the fault generator.
    #[arg(long)]
    pub fault_seed: Option<u64>,
}

impl ReplicaArgs {
    /// Builds the replica configuration.
    pub fn into_config(self) -> anyhow::Result<ReplicaConfig> {
        let mut cfg = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                toml::from_str::<ReplicaConfig>(&text)
                    .with_context(|| format!("parsing {}", path.display()))?
            }
            None => ReplicaConfig::default(),
        };
        cfg.port = self.port;
        if let Some(host) = self.host {
            cfg.host = host;
        }
        if let Some(preset) = self.preset {
            let record = cfg.engine.record_kv_events;
            cfg.engine = preset.config();
            cfg.engine.record_kv_events = record;
            if self.model.is_none() && self.config.is_none() {
                cfg.model = preset.model_name().into();
            }
        }
        if let Some(scale) = self.time_scale {
            cfg.engine.time_scale = scale;
        }
        if let Some(v) = self.cpu_capacity_tokens {
            cfg.engine.cpu_capacity_tokens = v;
        }
        if let Some(v) = self.cpu_gb_per_s {
            cfg.engine.cpu_gb_per_s = v;
        }
        if let Some(v) = self.kv_bytes_per_token {
            cfg.engine.kv_bytes_per_token = v;
        }
        cfg.id = self.id.unwrap_or_else(|| {
            if cfg.id == ReplicaConfig::default().id {
                format!("replica-{}", self.port)
            } else {
                cfg.id.clone()
            }
        });
        if let Some(model) = self.model {
            cfg.model = model;
        }
        if let Some(port) = self.kv_events_port {
            let kv = cfg.kv_events.get_or_insert_with(KvEventsConfig::default);
            kv.port = port;
            kv.replay_port = self.kv_replay_port;
            if let Some(topic) = self.kv_topic {
                kv.topic = topic;
            }
        }
        if let Some(n) = self.dp_ranks {
            cfg.dp_ranks = n;
        }
        anyhow::ensure!(
            (1..=MAX_DP_RANKS).contains(&cfg.dp_ranks),
            "--dp-ranks must be within 1..={MAX_DP_RANKS}"
        );
        if let Some(r) = &self.role {
            cfg.pd.role = crate::core::role::Role::parse(r)
                .with_context(|| format!("--role {r}: expected prefill, decode or both"))?;
        }
        if let Some(b) = self.kv_bytes_per_token {
            cfg.pd.kv_bytes_per_token = u64::from(b);
        }
        if let Some(g) = self.link_gbps {
            cfg.pd.link_gbps = g;
        }
        cfg.pd
            .validate()
            .map_err(|e| anyhow::anyhow!("pd settings: {e}"))?;
        let f = &mut cfg.faults;
        if let Some(v) = self.fault_error_rate {
            anyhow::ensure!(
                (0.0..=1.0).contains(&v),
                "--fault-error-rate must be within 0..1"
            );
            f.error_rate = v;
        }
        if let Some(v) = self.fault_latency_ms {
            f.added_latency_ms = v;
        }
        f.hang |= self.fault_hang;
        if self.fault_crash_after.is_some() {
            f.crash_after = self.fault_crash_after;
        }
        if self.fault_refuse_connections {
            f.refuse_connections_ms = u64::MAX;
        }
        if let Some(v) = self.fault_seed {
            f.seed = v;
        }
        cfg.exit_on_crash = true;
        cfg.engine.validate().context("engine configuration")?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Wrapper {
        #[command(flatten)]
        args: ReplicaArgs,
    }

    fn parse(argv: &[&str]) -> anyhow::Result<ReplicaConfig> {
        let mut full = vec!["kvmesh"];
        full.extend_from_slice(argv);
        Wrapper::try_parse_from(full)?.args.into_config()
    }

    #[test]
    fn flags_override_file_and_presets_apply() {
        let dir = std::env::temp_dir().join(format!("kvmesh-args-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("replica.toml");
        std::fs::write(
            &file,
            "id = \"from-file\"\nmodel = \"m\"\n[engine]\nkv_capacity_tokens = 1600\ntime_scale = 3.0\n[faults]\nerror_rate = 0.1\n",
        )
        .unwrap();
        let cfg = parse(&[
            "--port",
            "0",
            "--config",
            file.to_str().unwrap(),
            "--time-scale",
            "20",
        ])
        .unwrap();
        assert_eq!(cfg.id, "from-file");
        assert_eq!(cfg.model, "m");
        assert_eq!(cfg.engine.kv_capacity_tokens, 1600);
        assert_eq!(cfg.engine.time_scale, 20.0);
        assert_eq!(cfg.faults.error_rate, 0.1);
        let cfg = parse(&[
            "--preset",
            "70b-tp4",
            "--kv-events-port",
            "5557",
            "--kv-replay-port",
            "5558",
            "--fault-hang",
        ])
        .unwrap();
        assert_eq!(cfg.engine.step_overhead_ms, 18.0);
        assert_eq!(cfg.model, "sim-llama-70b");
        assert_eq!(cfg.id, "replica-8000");
        let kv = cfg.kv_events.unwrap();
        assert_eq!((kv.port, kv.replay_port), (5557, Some(5558)));
        assert!(cfg.faults.hang);
        assert!(parse(&["--time-scale", "0"]).is_err());
        assert!(parse(&["--time-scale", "1e-300"]).is_err());
        assert!(parse(&["--preset", "nope"]).is_err());
        assert!(parse(&["--kv-replay-port", "1"]).is_err());
        assert_eq!(parse(&["--dp-ranks", "4"]).unwrap().dp_ranks, 4);
        let pd = parse(&["--role", "prefill", "--link-gbps", "400"])
            .unwrap()
            .pd;
        assert_eq!(pd.role, crate::core::role::Role::Prefill);
        assert_eq!(pd.link_gbps, 400.0);
        assert!(parse(&["--role", "leader"]).is_err());
        assert!(parse(&["--link-gbps", "0"]).is_err());
        assert!(parse(&["--dp-ranks", "0"]).is_err());
        assert!(parse(&["--dp-ranks", "65"]).is_err());
        let cpu = parse(&[
            "--preset",
            "8b-h100",
            "--cpu-capacity-tokens",
            "900000",
            "--cpu-gb-per-s",
            "5",
        ])
        .unwrap()
        .engine;
        assert_eq!((cpu.cpu_capacity_tokens, cpu.cpu_gb_per_s), (900_000, 5.0));
        assert!(parse(&["--cpu-gb-per-s", "0"]).is_err());
        assert!(parse(&["--kv-bytes-per-token", "0"]).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
