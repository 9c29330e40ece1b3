//! `gpu-ckpt-node-installer install|uninstall|status|repair`: see the crate's README.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use node_installer::install::{self, DEFAULT_RESTART};
use node_installer::labels::SERVICE_ACCOUNT_DIR;
use node_installer::lifecycle::{self, DaemonSetRef};
use node_installer::paths::HostFs;
use node_installer::site::SiteArgs;
use node_installer::status::{self, READY_FILE};

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
    /// when nobody changed it since, else only the imports entries go. With `--daemonset`, only
    /// when that DaemonSet is gone or being deleted (or the API server cannot say).
    Uninstall(Common),
    /// The readiness probe: exit 0 when this container's install finished (the ready marker)
    /// and the node is still as installed (every file, containerd's imports); else name what
    /// is not, and exit 1.
    Status(Common),
    /// The watch: when the node is no longer as installed (another agent rewrote containerd's
    /// configuration, a file changed), say what changed and install again (restarting
    /// containerd when its configuration changed); nothing when nothing changed.
    Repair(Common),
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
    /// The node's driver root (a node path): `/` where the NVIDIA container toolkit has the
    /// driver on the host, `/run/nvidia/driver` with the GPU operator's driver container. NVML
    /// is loaded from it for the GPU labels.
    #[arg(long, default_value = "/")]
    driver_root: PathBuf,
    /// The ready marker (a path in this container): written when an install (labels
    /// included) succeeded, removed at an uninstall or a failure.
    #[arg(long, default_value = READY_FILE)]
    ready_file: PathBuf,
    /// The DaemonSet this runs in, NAMESPACE/NAME: `uninstall` leaves the node installed while
    /// it exists and is not being deleted (the pod stopped for a rolling update).
    #[arg(long)]
    daemonset: Option<DaemonSetRef>,
}

impl Common {
    fn options(&self) -> Result<install::Options> {
        Ok(install::Options {
            fs: HostFs::new(&self.root, &self.host_root)?,
            containerd_config: self.containerd_config.clone(),
            dropin_dir: self.dropin_dir.clone(),
            bin_dir: self.bin_dir.clone(),
            lib_dir: self.lib_dir.clone(),
            payload: self.payload.clone(),
            restart_command: self.restart_command.clone(),
            label_node: self.label_node.clone().filter(|n| !n.is_empty()),
            service_account_dir: self.service_account_dir.clone(),
            driver_root: self.driver_root.clone(),
            site: self.site.clone(),
            min_restart_interval: None,
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
    match cli.command {
        Cmd::Install(c) => install_ready(&c, "install", Vec::new()),
        Cmd::Uninstall(c) => {
            status::clear_ready(&c.ready_file)?;
            if let Some(ds) = &c.daemonset {
                if !lifecycle::uninstall_on_stop(ds, &c.service_account_dir) {
                    println!(
                        "{}",
                        summary("uninstall", &install::Outcome::default())
                            .with("kept", true.into())
                    );
                    return Ok(());
                }
            }
            let out = install::uninstall(&c.options()?)?;
            println!("{}", summary("uninstall", &out));
            Ok(())
        }
        Cmd::Status(c) => {
            let problems = status::status(&c.options()?, &c.ready_file)?;
            println!(
                "{}",
                serde_json::json!({"ready": problems.is_empty(), "problems": problems})
            );
            anyhow::ensure!(problems.is_empty(), "not ready: {}", problems.join("; "));
            Ok(())
        }
        Cmd::Repair(c) => {
            let found = status::drift(&c.options()?)?;
            if found.is_empty() {
                return Ok(());
            }
            for f in &found {
                tracing::warn!(found = %f, "the node is no longer as installed: installing again");
            }
            install_ready(&c, "repair", found)
        }
    }
}

/// Installs; the ready marker is removed first and written once the install (labels included)
/// succeeded.
fn install_ready(c: &Common, action: &str, found: Vec<String>) -> Result<()> {
    status::clear_ready(&c.ready_file)?;
    let out = install::install(&c.options()?)?;
    let mut line = summary(action, &out);
    if !found.is_empty() {
        line = line.with("found", found.into());
    }
    status::mark_ready(&c.ready_file, &line.to_string())?;
    println!("{line}");
    Ok(())
}

/// The one line a log reader (and the tests) can parse.
fn summary(action: &str, out: &install::Outcome) -> serde_json::Value {
    serde_json::json!({
        "action": action,
        "files_changed": out.files_changed,
        "config_changed": out.config_changed,
        "restarted": out.restarted,
        "labelled": out.labelled,
    })
}

trait With {
    fn with(self, key: &str, v: serde_json::Value) -> Self;
}

impl With for serde_json::Value {
    fn with(mut self, key: &str, v: serde_json::Value) -> Self {
        if let Some(m) = self.as_object_mut() {
            m.insert(key.to_string(), v);
        }
        self
    }
}
