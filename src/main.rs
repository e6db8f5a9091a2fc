//! The `kvmesh` command line.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "kvmesh", version, about = "KV-cache-aware request router mesh for LLM inference")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a router node.
    Serve(kvmesh::config::ServeArgs),
    /// Print a node's state as a table.
    Status {
        /// The node's base URL, e.g. http://127.0.0.1:8080.
        #[arg(long)]
        node: String,
        /// Bearer token for /admin/*.
        #[arg(long, env = "KVMESH_ADMIN_TOKEN")]
        token: Option<String>,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    match Cli::parse().command {
        Command::Serve(args) => kvmesh::proxy::serve(args).await,
        Command::Status { node, token } => {
            print!("{}", kvmesh::proxy::status(&node, token.as_deref()).await?);
            Ok(())
        }
    }
}
