//! `gpu-ckpt drain-plan`'s flags and its run: read the two lists, plan, print.

use std::io::Read;
use std::path::{Path, PathBuf};

use super::{kube, plan, text, DrainPlanError, Options, Plan, Upgrade};

/// Plan a node's drain (or a fleet's driver upgrade) from `kubectl get pods -o json` and
/// `kubectl get nodes -o json`. Prints the plan; never calls the cluster. Exit 0: every gpu-ckpt
/// workload has somewhere to resume; 1: some have none (the plan says which and why); 2: error.
#[derive(clap::Args, Debug, Clone)]
pub struct DrainPlanArgs {
    /// `kubectl get pods -A -o json` (or only the node's pods: `--field-selector
    /// spec.nodeName=NODE`); `-` for stdin.
    #[arg(long, value_name = "FILE")]
    pub pods: PathBuf,
    /// `kubectl get nodes -o json`.
    #[arg(long, value_name = "FILE")]
    pub nodes: PathBuf,
    /// The node to drain (repeatable). Without it, --upgrade plans every gpu-ckpt node that
    /// needs the upgrade.
    #[arg(long = "node", value_name = "NAME")]
    pub node: Vec<String>,
    /// The versions the maintenance installs: `driver=580.95.05[,cuda=13.0]` (repeatable).
    #[arg(long, value_name = "KEY=VERSION,...")]
    pub upgrade: Vec<String>,
    /// Form the upgrade groups by this node label (e.g. a node pool label); the plan orders them.
    #[arg(long, value_name = "LABEL")]
    pub group_by: Option<String>,
    /// Otherwise: at most this many nodes per group.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub group_size: usize,
    /// Where the checkpoint images are pushed: REGISTRY/NAMESPACE/POD-CONTAINER:drain-NODE.
    #[arg(long, value_name = "REGISTRY/PATH")]
    pub registry: String,
    /// The kubelet's checkpoint timeout, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 600)]
    pub checkpoint_timeout: u64,
    /// How long to wait for a restore pod to be Ready and for the drain, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 900)]
    pub ready_timeout: u64,
    /// RuntimeClasses whose pods are checkpointed (comma-separated); the restore class
    /// (--restore-runtime-class) is always one of them.
    #[arg(
        long,
        value_name = "NAME,...",
        value_delimiter = ',',
        default_value = super::CHECKPOINT_RUNTIME_CLASS
    )]
    pub runtime_class: Vec<String>,
    /// The RuntimeClass the restore pods run on: the Helm chart's
    /// `runtimeClasses.restore.name` where it renamed the class.
    #[arg(
        long,
        value_name = "NAME",
        default_value = super::RESTORE_RUNTIME_CLASS
    )]
    pub restore_runtime_class: String,
    /// text (default), json or yaml.
    #[arg(short = 'o', long, value_name = "FORMAT", default_value = "text", value_parser = ["text", "json", "yaml"])]
    pub output: String,
}

/// Reads at most [`kube::MAX_INPUT_BYTES`] (+1, to tell a larger input) from a file or stdin.
fn read_input(path: &Path) -> Result<Vec<u8>, DrainPlanError> {
    let limit = kube::MAX_INPUT_BYTES as u64 + 1;
    let mut buf = Vec::new();
    let res = if path == Path::new("-") {
        std::io::stdin().lock().take(limit).read_to_end(&mut buf)
    } else {
        std::fs::File::open(path).and_then(|f| f.take(limit).read_to_end(&mut buf))
    };
    res.map_err(|source| DrainPlanError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(buf)
}

fn input_name(path: &Path) -> String {
    if path == Path::new("-") {
        "stdin".into()
    } else {
        path.display().to_string()
    }
}

/// Builds the plan the flags ask for.
pub fn make_plan(args: &DrainPlanArgs) -> Result<Plan, DrainPlanError> {
    if args.restore_runtime_class.is_empty() {
        return Err(DrainPlanError::Usage(
            "--restore-runtime-class is empty: name the RuntimeClass restore pods run on".into(),
        ));
    }
    if !["text", "json", "yaml"].contains(&args.output.as_str()) {
        return Err(DrainPlanError::Usage(format!(
            "--output {:?}: expected text, json or yaml",
            args.output
        )));
    }
    if args.pods == Path::new("-") && args.nodes == Path::new("-") {
        return Err(DrainPlanError::Usage(
            "--pods and --nodes cannot both be stdin".into(),
        ));
    }
    let pods = {
        let _s = tracing::info_span!("read_pods", path = %args.pods.display()).entered();
        kube::parse_pods(&input_name(&args.pods), &read_input(&args.pods)?)?
    };
    let nodes = {
        let _s = tracing::info_span!("read_nodes", path = %args.nodes.display()).entered();
        kube::parse_nodes(&input_name(&args.nodes), &read_input(&args.nodes)?)?
    };
    let mut upgrade = Upgrade::default();
    for u in &args.upgrade {
        upgrade.add(u)?;
    }
    let opts = Options {
        nodes: args.node.clone(),
        upgrade: if upgrade.is_empty() {
            None
        } else {
            Some(upgrade)
        },
        group_by: args.group_by.clone(),
        group_size: args.group_size,
        registry: args.registry.clone(),
        checkpoint_timeout_s: args.checkpoint_timeout,
        ready_timeout_s: args.ready_timeout,
        runtime_classes: {
            let mut classes: Vec<String> = args
                .runtime_class
                .iter()
                .filter(|s| !s.is_empty())
                .cloned()
                .collect();
            if !classes.contains(&args.restore_runtime_class) {
                classes.push(args.restore_runtime_class.clone());
            }
            classes
        },
        restore_runtime_class: args.restore_runtime_class.clone(),
        kubelet_port: super::KUBELET_PORT,
    };
    plan(&pods, &nodes, &opts)
}

/// Runs the command: writes the plan to `out`; returns whether the plan is complete.
pub fn run(args: &DrainPlanArgs, out: &mut dyn std::io::Write) -> Result<bool, DrainPlanError> {
    let plan = make_plan(args)?;
    let rendered = if args.output == "json" {
        let mut s = serde_json::to_string_pretty(&plan)
            .map_err(|e| DrainPlanError::Write(std::io::Error::other(e)))?;
        s.push('\n');
        s
    } else {
        text::render(&plan)
    };
    out.write_all(rendered.as_bytes())
        .map_err(DrainPlanError::Write)?;
    Ok(plan.complete)
}
