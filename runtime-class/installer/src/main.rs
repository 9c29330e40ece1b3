//! `gpu-ckpt-node-installer install|uninstall`: see the crate's README.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use node_installer::install::{self, DEFAULT_RESTART};
use node_installer::labels::SERVICE_ACCOUNT_DIR;
use node_installer::paths::HostFs;
use node_installer::site::SiteArgs;

#[derive(Parser)]
#[command(
    name = "gpu-ckpt-node-installer",
    version,
    about = "Install gpu-ckpt onto a node (or remove it), from the node-installer DaemonSet"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Copy the payload onto the node, register both handlers with containerd, restart it when
    /// its configuration changed, label the node. Running it again changes nothing.
    Install(Common),
    /// Remove what `install` put there; containerd's configuration gets its original bytes back
    /// when nobody changed it since, else only the imports entries go.
    Uninstall(Common),
}

#[derive(Args)]
struct Common {
    /// The host's `/` as mounted here.
    #[arg(long, default_value = "/host")]
    root: PathBuf,
    /// Where that tree is for the node's containerd: the paths written into its configuration
    /// are under it (`/` on a node).
    #[arg(long, default_value = "/")]
    host_root: PathBuf,
    /// containerd's configuration file (a node path).
    #[arg(long, default_value = "/etc/containerd/config.toml")]
    containerd_config: PathBuf,
    /// The directory for the drop-ins (a node path).
    #[arg(long, default_value = "/etc/containerd/conf.d")]
    dropin_dir: PathBuf,
    /// The directory for the shim, gpu-ckpt, gpu-ckpt-hook and the criu link (a node path).
    #[arg(long, default_value = "/usr/local/bin")]
    bin_dir: PathBuf,
    /// The directory for CRIU and its libraries (a node path).
    #[arg(long, default_value = "/usr/local/lib/gpu-ckpt")]
    lib_dir: PathBuf,
    /// What the image carries: containerd-shim-gpu-ckpt-v1, gpu-ckpt, gpu-ckpt-hook, criu/.
    #[arg(long, default_value = "/payload")]
    payload: PathBuf,
    /// How to restart containerd on the node (a shell command line).
    #[arg(long, default_value = DEFAULT_RESTART)]
    restart_command: String,
    /// Label this Node (usually the pod's spec.nodeName) through the API server.
    #[arg(long)]
    label_node: Option<String>,
    /// The pod's service account (token, ca.crt).
    #[arg(long, default_value = SERVICE_ACCOUNT_DIR)]
    service_account_dir: PathBuf,
    /// The site's options: trust, restore sources, registry, runc, handler options.
    #[command(flatten)]
    site: SiteArgs,
}

impl Common {
    fn options(self) -> Result<install::Options> {
        Ok(install::Options {
            fs: HostFs::new(&self.root, &self.host_root)?,
            containerd_config: self.containerd_config,
            dropin_dir: self.dropin_dir,
            bin_dir: self.bin_dir,
            lib_dir: self.lib_dir,
            payload: self.payload,
            restart_command: self.restart_command,
            label_node: self.label_node.filter(|n| !n.is_empty()),
            service_account_dir: self.service_account_dir,
            site: self.site,
        })
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run() {
        eprintln!("gpu-ckpt-node-installer: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    let (what, out) = match cli.command {
        Cmd::Install(c) => ("install", install::install(&c.options()?)?),
        Cmd::Uninstall(c) => ("uninstall", install::uninstall(&c.options()?)?),
    };
    // One line a log reader (and the tests) can parse.
    println!(
        "{}",
        serde_json::json!({
            "action": what,
            "files_changed": out.files_changed,
            "config_changed": out.config_changed,
            "restarted": out.restarted,
            "labelled": out.labelled,
        })
    );
    Ok(())
}
