//! `gpu-ckpt-cri`: the kubelet's CRI calls for scripts, on the project's CRI client
//! (`test_containers::cri`), so that a machine without crictl or kubelet (the real-GPU check
//! `shim-cri.sh`) can run a pod, checkpoint its container and remove it as kubelet would.
//!
//! - `run`: RunPodSandbox (hostNetwork: no CNI needed), then CreateContainer and StartContainer
//!   of one container, configured as kubelet configures them; the image must be on the node
//!   already (imagePullPolicy `Never`). Prints `pod <id>`, `container <id>` and `log <path>`
//!   (the container's CRI log file).
//! - `checkpoint`: CheckpointContainer into an archive, as kubelet's
//!   `POST /checkpoint/{namespace}/{pod}/{container}` does.
//! - `state`: the container's CRI state (`CONTAINER_RUNNING`, ...).
//! - `remove-pod`: StopContainer and RemoveContainer for each container, then StopPodSandbox and
//!   RemovePodSandbox (kubelet's order).
//! - `version`: the runtime's name and version.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use test_containers::cri::{ContainerSpec, Cri, Pod, PodSpec};

#[derive(Parser)]
#[command(
    name = "gpu-ckpt-cri",
    about = "The kubelet's CRI calls (pods, CheckpointContainer) for scripts"
)]
struct Cli {
    /// containerd's socket (its CRI service).
    #[arg(long)]
    socket: PathBuf,
    /// Deadline of each call, in seconds.
    #[arg(long, default_value_t = 180)]
    timeout_s: u64,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Runs a pod of one container; prints `pod <id>`, `container <id>`, `log <path>`.
    Run {
        /// The pod's name (namespace `default`).
        #[arg(long)]
        pod: String,
        /// The runtime handler (the RuntimeClass's `handler`).
        #[arg(long)]
        handler: String,
        /// Below this directory the pod's log directory `<ns>_<pod>_<uid>` is made.
        #[arg(long)]
        log_root: PathBuf,
        /// A pod annotation `KEY=VALUE` (repeatable).
        #[arg(long = "pod-annotation", value_parser = key_value)]
        pod_annotations: Vec<(String, String)>,
        /// The container's name.
        #[arg(long)]
        name: String,
        /// The container's image, which must be on the node.
        #[arg(long)]
        image: String,
        /// A container annotation `KEY=VALUE` (repeatable), e.g. a device plugin's CDI request
        /// `cdi.k8s.io/<plugin>=nvidia.com/gpu=0`.
        #[arg(long = "annotation", value_parser = key_value)]
        annotations: Vec<(String, String)>,
        /// The container's command and its arguments.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// CheckpointContainer into the archive PATH.
    Checkpoint {
        #[arg(long)]
        container: String,
        #[arg(long)]
        archive: PathBuf,
        /// The CRI request's timeout (seconds; 0: the runtime's default).
        #[arg(long, default_value_t = 0)]
        timeout: i64,
    },
    /// Prints the container's CRI state.
    State {
        #[arg(long)]
        container: String,
    },
    /// Stops and removes the pod's containers, then the pod.
    RemovePod {
        #[arg(long)]
        pod: String,
    },
    /// Prints the runtime's name and version.
    Version,
}

/// `KEY=VALUE`, split at the first `=` (a CDI request's value holds one itself).
fn key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli).await {
        eprintln!("gpu-ckpt-cri: {e:#}");
        std::process::exit(1);
    }
}

async fn run(cli: Cli) -> Result<()> {
    let cri = Cri::connect(&cli.socket)
        .await?
        .with_timeout(Duration::from_secs(cli.timeout_s));
    match cli.cmd {
        Cmd::Run {
            pod,
            handler,
            log_root,
            pod_annotations,
            name,
            image,
            annotations,
            command,
        } => {
            let mut pod_spec = PodSpec::new(&pod, &log_root).handler(&handler);
            for (k, v) in &pod_annotations {
                pod_spec = pod_spec.annotation(k, v);
            }
            let mut spec = ContainerSpec::new(&name, &image).command(&command);
            for (k, v) in &annotations {
                spec = spec.annotation(k, v);
            }
            run_pod(&cri, &pod_spec, &spec).await
        }
        Cmd::Checkpoint {
            container,
            archive,
            timeout,
        } => {
            cri.checkpoint_container(&container, &archive, timeout)
                .await
        }
        Cmd::State { container } => {
            println!("{}", cri.container_state(&container).await?.as_str_name());
            Ok(())
        }
        Cmd::RemovePod { pod } => remove_pod(&cri, &pod).await,
        Cmd::Version => {
            let v = cri.version().await?;
            println!("{} {}", v.runtime_name, v.runtime_version);
            Ok(())
        }
    }
}

/// RunPodSandbox, then the container as kubelet starts it with `imagePullPolicy: Never`.
async fn run_pod(cri: &Cri, pod_spec: &PodSpec, spec: &ContainerSpec) -> Result<()> {
    if cri.image_status(&spec.image).await?.is_none() {
        bail!(
            "image {} is not on the node (import it first: there is no registry to pull from)",
            spec.image
        );
    }
    let pod = cri.run_pod(pod_spec).await?;
    let id = cri.run_container(&pod, spec).await?;
    println!("pod {}", pod.id);
    println!("container {id}");
    println!("log {}", pod.container_log(&spec.name).display());
    Ok(())
}

/// Removes pod `id` as kubelet does, its cgroups included (their uid from the pod's status).
async fn remove_pod(cri: &Cri, id: &str) -> Result<()> {
    let status = cri
        .pod_sandbox_status(id)
        .await?
        .status
        .with_context(|| format!("CRI PodSandboxStatus {id}: no status"))?;
    let meta = status.metadata.unwrap_or_default();
    // Only the uid matters here: the log directory stays where the pod's was made.
    let spec = PodSpec::new(&meta.name, Path::new("/")).uid(&meta.uid);
    let pod = Pod {
        id: id.to_string(),
        config: spec.to_config(),
        spec,
    };
    cri.remove_pod(&pod).await
}
