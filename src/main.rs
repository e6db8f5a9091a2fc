//! The `kvmesh` command line.

use anyhow::Context;
use clap::{Parser, Subcommand};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

#[derive(Debug, Parser)]
#[command(
    name = "kvmesh",
    version,
    about = "KV-cache-aware request routing mesh for LLM fleets"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a simulated OpenAI-compatible engine replica.
    Replica(kvmesh::replica::ReplicaArgs),
    /// Run a router node.
    Serve(kvmesh::node::config::ServeArgs),
    /// Print a node's state as a table.
    Status {
        /// The node's base URL, e.g. http://127.0.0.1:8080.
        #[arg(long)]
        node: String,
        /// File holding the bearer token for /admin/* (else `KVMESH_ADMIN_TOKEN`).
        #[arg(long, value_name = "FILE")]
        token_file: Option<std::path::PathBuf>,
    },
    /// List, add, drain or remove replicas on a running node (and its region).
    Replicas(kvmesh::proxy::admin_cli::ReplicasArgs),
    /// Simulate router nodes and replicas in virtual time on a trace; compare policies.
    Sim(kvmesh::bench::sim_cli::SimArgs),
    /// Replay a workload against OpenAI-compatible endpoints (or in-process fleets per policy)
    /// and report TTFT, latency, hit ratio and load balance.
    Bench(kvmesh::bench::bench_cli::BenchArgs),
    /// A two-region mesh on loopback replaying the conversation trace: p2c-cache vs round-robin.
    Demo(kvmesh::bench::demo::DemoArgs),
    /// Make a cluster CA and node certificates for mesh mTLS (quick start).
    #[command(subcommand)]
    Certs(CertsCommand),
}

#[derive(Debug, Subcommand)]
enum CertsCommand {
    /// Create a cluster CA (`ca.pem`, `ca.key`) in a directory.
    Init {
        /// Directory for the CA files (created if missing).
        #[arg(long)]
        dir: std::path::PathBuf,
    },
    /// Issue a node certificate (`<name>.pem`, `<name>.key`) signed by the CA in a directory.
    Issue {
        /// Directory holding `ca.pem` and `ca.key`.
        #[arg(long)]
        dir: std::path::PathBuf,
        /// Node name (certificate CN and file name).
        #[arg(long)]
        name: String,
        /// Bind the node to this region: it refuses to start elsewhere, and peers refuse its
        /// `node` record for any other region. Without it the certificate fits any region.
        #[arg(long)]
        region: Option<String>,
        /// Let the node publish operator commands (`admin:` records) that its peers apply.
        #[arg(long)]
        operator: bool,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // reqwest is built with `rustls-no-provider`; a second install (e.g. by a library) is harmless.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    // The instruments print their own progress and tables; the servers log at info.
    let default_level = match cli.command {
        Command::Demo(_) | Command::Sim(_) | Command::Bench(_) => "warn",
        _ => "info",
    };
    // `serve` reads its configuration before logging starts: `[tracing]` (or
    // OTEL_EXPORTER_OTLP_ENDPOINT) decides whether the subscriber gets the OpenTelemetry layer.
    let serve_cfg = match &cli.command {
        Command::Serve(args) => Some(kvmesh::node::config::NodeConfig::from_args(args)?),
        _ => None,
    };
    let otel = match &serve_cfg {
        Some(cfg) => kvmesh::proxy::otel::Pipeline::start(&cfg.tracing)?,
        None => None,
    };
    let fmt = tracing_subscriber::fmt::layer().with_filter(
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level)),
    );
    tracing_subscriber::registry()
        .with(fmt)
        .with(otel.as_ref().map(|p| p.layer()))
        .init();
    match cli.command {
        Command::Sim(args) => kvmesh::bench::sim_cli::main(args)?,
        Command::Bench(args) => kvmesh::bench::bench_cli::main(args).await?,
        Command::Demo(args) => kvmesh::bench::demo::main(args).await?,
        Command::Certs(CertsCommand::Init { dir }) => {
            let (cert, key) = kvmesh::mesh::certs::init_dir(&dir)?;
            println!("wrote {} and {}", cert.display(), key.display());
        }
        Command::Certs(CertsCommand::Issue {
            dir,
            name,
            region,
            operator,
        }) => {
            let roles = kvmesh::mesh::certs::CertRoles { region, operator };
            let (cert, key) = kvmesh::mesh::certs::issue_in_dir_with(&dir, &name, &roles)?;
            println!("wrote {} and {}", cert.display(), key.display());
        }
        Command::Replica(args) => {
            let config = args.into_config()?;
            kvmesh::replica::run(config, kvmesh::shutdown::signalled()).await?;
        }
        Command::Serve(args) => {
            let cfg = serve_cfg.context("serve configuration")?;
            let served = kvmesh::proxy::serve(cfg, &args).await;
            // Flush queued spans whatever the outcome; it blocks, so not on a runtime worker.
            if let Some(p) = otel {
                let _ = tokio::task::spawn_blocking(move || p.shutdown()).await;
            }
            served?;
        }
        Command::Status { node, token_file } => {
            let token = admin_token(token_file.as_deref())?;
            print!("{}", kvmesh::proxy::status(&node, token.as_deref()).await?);
        }
        Command::Replicas(args) => {
            let token = admin_token(args.token_file.as_deref())?;
            print!("{}", kvmesh::proxy::admin_cli::run(args, token).await?);
        }
    }
    Ok(())
}

/// The admin token: the first line of `file`, else `KVMESH_ADMIN_TOKEN`.
fn admin_token(file: Option<&std::path::Path>) -> anyhow::Result<Option<String>> {
    Ok(match file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_owned(),
        ),
        None => std::env::var(kvmesh::node::config::server::ADMIN_TOKEN_ENV).ok(),
    })
}
