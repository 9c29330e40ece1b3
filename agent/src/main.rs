//! `gpu-ckpt-agent`: the node agent's command line (see the crate's README.md).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;

/// gpu-ckpt's node agent: Prometheus metrics of this node's checkpoints and restores.
#[derive(Parser, Debug)]
#[command(name = "gpu-ckpt-agent", version)]
struct Args {
    /// Address to serve /metrics and /healthz on.
    #[arg(long, default_value = "0.0.0.0:9402")]
    listen: SocketAddr,
    /// The event journal's directory (the handlers' EventsDir).
    #[arg(long, default_value = journal::DEFAULT_DIR)]
    events_dir: PathBuf,
    /// A directory checkpoints are kept under (repeatable), e.g. the kubelet's
    /// /var/lib/kubelet/checkpoints.
    #[arg(long = "checkpoint-dir", value_name = "DIR")]
    checkpoint_dirs: Vec<PathBuf>,
    /// The directory of the node's signing key, whose public key node.pub is read (e.g.
    /// /var/lib/gpu-ckpt/keys). Without it the key id is the newest checkpoint record's
    /// signing_key, and the agent needs no access to the key directory (which holds the
    /// private key too).
    #[arg(long, value_name = "DIR")]
    key_dir: Option<PathBuf>,
    /// How often the journal is polled between scrapes, in milliseconds.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(10..))]
    poll_interval_ms: u64,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let config = agent::Config {
        events_dir: args.events_dir,
        checkpoint_dirs: args.checkpoint_dirs,
        key_dir: args.key_dir,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    rt.block_on(async move {
        let listener = agent::server::bind(args.listen).await?;
        let local = listener.local_addr().context("the listener's address")?;
        tracing::info!(listen = %local, events_dir = %config.events_dir.display(), "serving /metrics and /healthz");
        let shared = Arc::new(Mutex::new(agent::Agent::new(config)));
        let serve = agent::server::serve(listener, shared, Duration::from_millis(args.poll_interval_ms));
        tokio::select! {
            _ = serve => Ok(()),
            r = shutdown() => r,
        }
    })
}

/// SIGTERM or SIGINT: exit 0.
async fn shutdown() -> Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("stopping");
    Ok(())
}
