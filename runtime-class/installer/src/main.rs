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
    /// is not, and exit 1. With `--uninstalled` (the uninstall action's probe): when this
    /// container's uninstall finished and nothing of gpu-ckpt is left on the node.
    Status {
        #[command(flatten)]
        common: Common,
        /// Check that the node is uninstalled instead.
        #[arg(long)]
        uninstalled: bool,
    },
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
    /// The DaemonSet this runs in, NAMESPACE/NAME: `uninstall` leaves the node installed only
    /// while it is not being deleted and has a newer pod template than this pod's
    /// (`--pod-template-generation`): the pod stopped for a rolling update.
    #[arg(long)]
    daemonset: Option<DaemonSetRef>,
    /// This pod's `pod-template-generation` label (the DaemonSet's generation it was made
    /// from). Empty or not a number: unknown, and `uninstall --daemonset` uninstalls.
    #[arg(long, default_value = "")]
    pod_template_generation: String,
    /// `repair` restarts containerd at most once in this many seconds: a restart due sooner
    /// (another agent keeps rewriting containerd's configuration) waits, reported in the log
    /// and by `status`, and the next check after the interval restarts. 0: no limit.
    #[arg(long, default_value_t = 300)]
    min_restart_interval_seconds: u64,
    /// For how long `uninstall --daemonset` asks the API server again (a doubling pause from
    /// 1 s) while it cannot be asked, before it uninstalls; inside the pod's grace period.
    #[arg(long, default_value_t = 30)]
    owner_retry_seconds: u64,
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
        Cmd::Install(c) => install_ready(&c, "install", Vec::new(), None),
        Cmd::Uninstall(c) => {
            status::clear_ready(&c.ready_file)?;
            if let Some(ds) = &c.daemonset {
                let generation = c.pod_template_generation.trim().parse::<u64>().ok();
                if generation.is_none() {
                    tracing::warn!(
                        value = %c.pod_template_generation,
                        "no pod template generation: this pod's template cannot be compared with the DaemonSet's"
                    );
                }
                let retry = std::time::Duration::from_secs(c.owner_retry_seconds);
                if !lifecycle::uninstall_on_stop(ds, &c.service_account_dir, generation, retry) {
                    println!(
                        "{}",
                        summary("uninstall", &install::Outcome::default())
                            .with("kept", true.into())
                    );
                    return Ok(());
                }
            }
            let out = install::uninstall(&c.options()?)?;
            let line = summary("uninstall", &out);
            // The uninstall action's readiness probe (`status --uninstalled`) needs it.
            status::mark_ready(&c.ready_file, &line.to_string())?;
            println!("{line}");
            Ok(())
        }
        Cmd::Status {
            common: c,
            uninstalled,
        } => {
            let problems = if uninstalled {
                status::uninstalled(&c.options()?, &c.ready_file)?
            } else {
                status::status(&c.options()?, &c.ready_file)?
            };
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
            let min = std::time::Duration::from_secs(c.min_restart_interval_seconds);
            install_ready(&c, "repair", found, (!min.is_zero()).then_some(min))
        }
    }
}

/// Installs; the ready marker is removed first and written once the install (labels included)
/// succeeded.
/// `min_restart_interval`: see [`install::Options::min_restart_interval`].
fn install_ready(
    c: &Common,
    action: &str,
    found: Vec<String>,
    min_restart_interval: Option<std::time::Duration>,
) -> Result<()> {
    status::clear_ready(&c.ready_file)?;
    let out = install::install(&install::Options {
        min_restart_interval,
        ..c.options()?
    })?;
    let mut line = summary(action, &out);
    if !found.is_empty() {
        line = line.with("found", found.into());
    }
    if let Some(why) = &out.restart_deferred {
        line = line.with("restart_deferred", why.as_str().into());
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
