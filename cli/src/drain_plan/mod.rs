//! `gpu-ckpt drain-plan`: what to do, in which order, to take GPU nodes out for maintenance
//! without losing the work of their gpu-ckpt pods.
//!
//! Input: the pods (`kubectl get pods -A -o json`, or only the node's) and the nodes
//! (`kubectl get nodes -o json`, with the labels the node installer sets: [`GPU_MODEL_LABEL`],
//! [`DRIVER_LABEL`], [`CUDA_LABEL`], [`RUNTIME_LABEL`]). Output: a [`Plan`]: the maintained nodes
//! in groups, in order; per node its pods and what happens to each, and the ordered steps with
//! the kubelet's checkpoint calls. Whether a workload can go to a node is decided by
//! [`image_format::compat::check`], the rule the restore itself applies, on profiles built from the
//! nodes' labels and the pod's declared engine and model versions, plus the node's free GPUs.
//!
//! It never calls a cluster. docs/drain-plan.md describes the command.

pub mod cli;
pub mod kube;
pub mod text;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use serde::Serialize;
use serde_json::{json, Value};

use image_format::compat::{self, driver_branch, Profile};
use image_format::manifest::{Devices, DriverFile, Gpu, Workload};
use kube::{Attach, ClaimUse, NodeEntry, PodEntry};

/// Node label: `installed` where the node installer put the runtime on the node.
pub const RUNTIME_LABEL: &str = "node-restriction.kubernetes.io/gpu-ckpt-runtime";
pub const RUNTIME_INSTALLED: &str = "installed";
/// Node label: the GPU model as a label value (`NVIDIA-H100-80GB-HBM3`; several models joined
/// with `_`).
pub const GPU_MODEL_LABEL: &str = "node-restriction.kubernetes.io/gpu-ckpt-gpu-model";
/// Node label: the driver version (`580.65.06`).
pub const DRIVER_LABEL: &str = "node-restriction.kubernetes.io/gpu-ckpt-driver-version";
/// Node label: the CUDA driver version (`13.0`).
pub const CUDA_LABEL: &str = "node-restriction.kubernetes.io/gpu-ckpt-cuda-version";
/// The GPU labels: a GPU node without all three has unknown GPU versions.
pub const GPU_LABELS: [&str; 3] = [GPU_MODEL_LABEL, DRIVER_LABEL, CUDA_LABEL];
/// The label a restore pod is pinned to its destination by.
pub const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";
/// Where nvidia-container-toolkit mounts the driver's libraries in a container.
const DRIVER_LIB_DIR: &str = "/usr/lib/x86_64-linux-gnu";

/// The RuntimeClass whose pods are checkpointed, and the one restores run on: the chart's
/// default names (runtime-class/chart/gpu-ckpt/values.yaml); `--runtime-class` and
/// `--restore-runtime-class` name renamed ones.
pub const CHECKPOINT_RUNTIME_CLASS: &str = "gpu-ckpt";
pub const RESTORE_RUNTIME_CLASS: &str = "gpu-ckpt-restore";
/// Pod annotations the restore handler reads (shim/src/annotations.rs).
pub const RESTORE_FROM: &str = "gpu-ckpt.io/restore-from";
pub const ENGINE_VERSION: &str = "gpu-ckpt.io/engine-version";
pub const MODEL_VERSION: &str = "gpu-ckpt.io/model-version";
/// The kubelet's API port.
pub const KUBELET_PORT: u16 = 10250;
/// The annotation of a static pod's mirror.
const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

/// What can go wrong: all of it is bad input or a bad flag.
#[derive(Debug, thiserror::Error)]
pub enum DrainPlanError {
    /// A field of an input document is missing or wrong.
    #[error("{input}: {field}: {problem}")]
    Field {
        input: String,
        field: String,
        problem: String,
    },
    /// An input document as a whole is unusable.
    #[error("{input}: {problem}")]
    Input { input: String, problem: String },
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A flag's value is wrong, or flags contradict each other.
    #[error("{0}")]
    Usage(String),
    #[error("writing the plan: {0}")]
    Write(#[source] std::io::Error),
}

/// The versions a node's labels give, before or after its maintenance.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Versions {
    pub gpu_model: String,
    pub driver_version: String,
    pub cuda_version: String,
}

impl Versions {
    fn of(n: &NodeEntry) -> Versions {
        let get = |k: &str| n.label(k).unwrap_or_default().to_string();
        Versions {
            gpu_model: get(GPU_MODEL_LABEL),
            driver_version: get(DRIVER_LABEL),
            cuda_version: get(CUDA_LABEL),
        }
    }

    /// The GPU labels these versions lack (missing or empty).
    fn missing(&self) -> Vec<&'static str> {
        [
            (GPU_MODEL_LABEL, &self.gpu_model),
            (DRIVER_LABEL, &self.driver_version),
            (CUDA_LABEL, &self.cuda_version),
        ]
        .into_iter()
        .filter(|(_, v)| v.is_empty())
        .map(|(k, _)| k)
        .collect()
    }
}

/// Why a node's GPU versions are unknown: something says it has GPUs (an `nvidia.com/gpu`
/// resource, `nvidia.com/gpu.present=true`, another GPU label) but a GPU label is missing or
/// empty, as where the node installer could not read the GPUs through NVML. Such a node is never
/// a destination, and what it runs cannot be judged compatible anywhere.
fn gpu_labels_unknown(n: &NodeEntry) -> Option<String> {
    let missing = Versions::of(n).missing();
    if missing.is_empty() || !n.has_gpus(&GPU_LABELS) {
        return None;
    }
    let evidence = if n.gpus > 0 {
        format!("{} {}", n.gpus, kube::GPU_RESOURCE)
    } else if n.label(kube::GPU_PRESENT_LABEL).is_some() {
        format!("{}={}", kube::GPU_PRESENT_LABEL, "true")
    } else {
        "other GPU labels set".to_string()
    };
    Some(format!(
        "GPU labels unknown: {} missing or empty on a node with GPUs ({evidence}); the node installer could not read its GPUs",
        missing.join(", ")
    ))
}

/// `--upgrade driver=580.95.05,cuda=13.0`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Upgrade {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub driver: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cuda: Option<String>,
}

/// What an upgrade leaves on a node whose CUDA version it does not name: the same CUDA within
/// the driver's branch, else this (differs from every real version).
pub const UNKNOWN_CUDA: &str = "unknown";

impl Upgrade {
    /// Parses `key=value` pairs, comma-separated, keys `driver` and `cuda`; merges into `self`.
    pub fn add(&mut self, spec: &str) -> Result<(), DrainPlanError> {
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((k, v)) = part.split_once('=') else {
                return Err(DrainPlanError::Usage(format!(
                    "--upgrade {spec:?}: {part:?} is not KEY=VALUE (keys: driver, cuda)"
                )));
            };
            let v = v.trim();
            if v.is_empty()
                || !v
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || ".-_".contains(c))
            {
                return Err(DrainPlanError::Usage(format!(
                    "--upgrade {spec:?}: {k}={v:?} is not a version (letters, digits, '.', '-', '_')"
                )));
            }
            match k.trim() {
                "driver" => self.driver = Some(v.to_string()),
                "cuda" => self.cuda = Some(v.to_string()),
                other => {
                    return Err(DrainPlanError::Usage(format!(
                        "--upgrade {spec:?}: unknown key {other:?} (keys: driver, cuda)"
                    )))
                }
            }
        }
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.driver.is_none() && self.cuda.is_none()
    }

    /// A node's versions after the upgrade.
    pub fn apply(&self, v: &Versions) -> Versions {
        let mut out = v.clone();
        if let Some(d) = &self.driver {
            out.driver_version = d.clone();
            if self.cuda.is_none() && driver_branch(d) != driver_branch(&v.driver_version) {
                out.cuda_version = UNKNOWN_CUDA.to_string();
            }
        }
        if let Some(c) = &self.cuda {
            out.cuda_version = c.clone();
        }
        out
    }

    /// Whether a node still needs it.
    pub fn needed_by(&self, v: &Versions) -> bool {
        self.driver.as_ref().is_some_and(|d| *d != v.driver_version)
            || self.cuda.as_ref().is_some_and(|c| *c != v.cuda_version)
    }

    /// `driver 580.95.05, CUDA 13.0`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(d) = &self.driver {
            parts.push(format!("driver {d}"));
        }
        if let Some(c) = &self.cuda {
            parts.push(format!("CUDA {c}"));
        }
        parts.join(", ")
    }
}

/// What the plan is asked for.
#[derive(Debug, Clone)]
pub struct Options {
    /// The nodes to maintain. Empty: with an upgrade, every gpu-ckpt node that needs it.
    pub nodes: Vec<String>,
    pub upgrade: Option<Upgrade>,
    /// Form the groups by this node label's value.
    pub group_by: Option<String>,
    /// Otherwise, at most this many nodes per group.
    pub group_size: usize,
    /// Where checkpoint images go: `REGISTRY/NAMESPACE/POD-CONTAINER:drain-NODE`.
    pub registry: String,
    /// The kubelet's checkpoint timeout, seconds.
    pub checkpoint_timeout_s: u64,
    /// How long to wait for a restore pod to become Ready, seconds.
    pub ready_timeout_s: u64,
    /// RuntimeClasses whose pods are checkpointed.
    pub runtime_classes: Vec<String>,
    /// The RuntimeClass the restore pods get (the chart's `runtimeClasses.restore.name`).
    pub restore_runtime_class: String,
    pub kubelet_port: u16,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            nodes: Vec::new(),
            upgrade: None,
            group_by: None,
            group_size: 1,
            registry: String::new(),
            checkpoint_timeout_s: 600,
            ready_timeout_s: 900,
            runtime_classes: vec![
                CHECKPOINT_RUNTIME_CLASS.to_string(),
                RESTORE_RUNTIME_CLASS.to_string(),
            ],
            restore_runtime_class: RESTORE_RUNTIME_CLASS.to_string(),
            kubelet_port: KUBELET_PORT,
        }
    }
}

/// The whole plan.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upgrade: Option<Upgrade>,
    /// In the order they are maintained; every node of a group at once.
    pub groups: Vec<Group>,
    /// Nodes of the input that are not maintained, and why.
    pub skipped_nodes: Vec<SkippedNode>,
    /// Every gpu-ckpt workload has somewhere to resume.
    pub complete: bool,
    /// `namespace/pod on node` for every gpu-ckpt workload that has nowhere to resume.
    pub without_destination: Vec<String>,
    /// Nodes whose GPU labels are unknown (a GPU node without all of them), and why: never a
    /// destination.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unknown_nodes: Vec<SkippedNode>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SkippedNode {
    pub node: String,
    pub why: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Group {
    /// 1-based.
    pub number: usize,
    /// The `--group-by` label's value.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub label_value: Option<String>,
    pub nodes: Vec<NodePlan>,
}

#[derive(Debug, Clone, Serialize)]
pub struct NodePlan {
    pub node: String,
    pub kubelet: String,
    pub before: Versions,
    pub after: Versions,
    /// Why its GPU labels are unknown, where they are.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_labels_unknown: Option<String>,
    pub pods: Vec<PodPlan>,
    pub steps: Vec<Step>,
}

/// What a pod is, for the drain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PodClass {
    /// On a gpu-ckpt RuntimeClass: checkpointed and restored.
    GpuCkpt,
    /// Any other pod a drain evicts.
    Plain,
    DaemonSet,
    /// A static pod's mirror.
    Static,
    /// Succeeded or Failed.
    Finished,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "action", rename_all = "kebab-case")]
pub enum Disposition {
    /// Checkpointed, restored on `destination` (chosen among `candidates`, every node that
    /// could take it at that point of the plan).
    Migrate {
        destination: String,
        candidates: Vec<String>,
    },
    /// Checkpointed; no other node can take it, but this node can after its maintenance.
    RestoreAfterMaintenance { rejected: Vec<Rejection> },
    /// Nowhere to resume: every node and why not.
    NoDestination {
        rejected: Vec<Rejection>,
        then: String,
    },
    /// On a gpu-ckpt RuntimeClass, but nothing can be checkpointed.
    CannotCheckpoint { why: String, then: String },
    /// Evicted by the drain.
    Evicted { then: String },
    /// Left on the node.
    Stays { why: String },
    /// Nothing runs; the drain deletes it.
    Finished,
}

/// A node that cannot take a workload, and every reason (a compat field that differs, free
/// GPUs, the node's state).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Rejection {
    pub node: String,
    pub reasons: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct PodPlan {
    pub namespace: String,
    pub name: String,
    pub class: PodClass,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runtime_class: Option<String>,
    /// `Kind/name` of its controller.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    pub gpus: u32,
    pub containers: Vec<String>,
    #[serde(flatten)]
    pub disposition: Disposition,
    /// The checkpoint image of each container (gpu-ckpt pods that are checkpointed).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub images: BTreeMap<String, String>,
    /// The restore pod's name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub restore_pod: Option<String>,
    /// The claims that attach to one node at a time (ReadWriteOnce, or access modes unknown),
    /// where the pod moves to another node: the original is deleted after its checkpoint and
    /// before the restore pod is created.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub single_node_claims: Vec<String>,
    /// The downtime that order implies.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub downtime: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// Its index in the pod list.
    #[serde(skip)]
    pub entry: usize,
}

impl PodPlan {
    /// It moves to another node with claims that attach to one node at a time: the original is
    /// deleted after its checkpoint, before its restore pod is created (and before the drain).
    pub fn deleted_before_restore(&self) -> bool {
        matches!(self.disposition, Disposition::Migrate { .. })
            && !self.single_node_claims.is_empty()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StepKind {
    Cordon,
    Checkpoint,
    /// Delete the original, so that its single-node volumes detach.
    DeleteOriginal,
    BuildPush,
    CreateRestorePod,
    WaitReady,
    Drain,
    Maintenance,
    Relabel,
    Uncordon,
}

/// The kubelet's `POST /checkpoint/{namespace}/{pod}/{container}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KubeletCall {
    pub method: String,
    pub url: String,
    pub timeout_s: u64,
    /// What it answers: the archive's path on the node.
    pub answers: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Step {
    /// 1-based within the node.
    pub number: usize,
    pub kind: StepKind,
    pub text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kubelet: Option<KubeletCall>,
    /// A command to run (kubectl from anywhere; `gpu-ckpt build` on the node, as root).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
    /// The restore pod, for `kubectl create -f -`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub manifest: Option<Value>,
}

/// One node's state in the simulation the plan is made by.
#[derive(Debug, Clone)]
struct SimNode {
    versions: Versions,
    gpus: u32,
    used: u32,
    /// Why it takes no restore pod (not installed, not Ready, cordoned); None when it does.
    unavailable: Option<String>,
    /// Why its GPU labels are unknown ([`gpu_labels_unknown`]).
    unknown: Option<String>,
}

impl SimNode {
    /// Why this node's labels cannot give the GPU versions a workload holding `gpus` GPUs runs
    /// under: they are unknown, or they say no GPUs while it holds some.
    fn unknown_for(&self, gpus: u32) -> Option<String> {
        if self.unknown.is_some() {
            return self.unknown.clone();
        }
        let missing = self.versions.missing();
        (gpus > 0 && !missing.is_empty()).then(|| {
            format!(
                "GPU labels say no GPUs ({} not set) while the workload holds {gpus} GPU(s)",
                missing.join(", ")
            )
        })
    }
}

/// A pod in the simulation: where it runs now and under which name.
#[derive(Debug, Clone)]
struct SimPod {
    entry: usize,
    node: String,
    name: String,
    moved: bool,
}

#[derive(Debug, Clone)]
struct Sim {
    nodes: BTreeMap<String, SimNode>,
    pods: Vec<SimPod>,
    /// Nodes the plan maintains and has not yet.
    pending: BTreeSet<String>,
}

/// Score of a group at some point of the plan: fewer workloads without a destination first, then
/// fewer that wait for the maintenance, then fewer GPUs moved.
type Score = (usize, usize, u32);

struct Planner<'a> {
    opts: &'a Options,
    pods: &'a [PodEntry],
    nodes: BTreeMap<String, &'a NodeEntry>,
}

/// Makes the plan.
pub fn plan(
    pods: &[PodEntry],
    nodes: &[NodeEntry],
    opts: &Options,
) -> Result<Plan, DrainPlanError> {
    let _span = tracing::info_span!("drain_plan", pods = pods.len(), nodes = nodes.len()).entered();
    if opts.registry.is_empty() {
        return Err(DrainPlanError::Usage(
            "--registry is required: where the checkpoint images are pushed (e.g. registry.example.com/gpu-ckpt)".into(),
        ));
    }
    if opts.group_size == 0 {
        return Err(DrainPlanError::Usage(
            "--group-size must be at least 1".into(),
        ));
    }
    let upgrade = opts.upgrade.clone().filter(|u| !u.is_empty());
    let planner = Planner {
        opts,
        pods,
        nodes: nodes.iter().map(|n| (n.name().to_string(), n)).collect(),
    };
    let mut sim = Sim {
        nodes: BTreeMap::new(),
        pods: Vec::new(),
        pending: BTreeSet::new(),
    };
    for n in nodes {
        let unavailable = if n.label(RUNTIME_LABEL) != Some(RUNTIME_INSTALLED) {
            Some(format!(
                "gpu-ckpt is not installed (label {RUNTIME_LABEL} is not \"{RUNTIME_INSTALLED}\")"
            ))
        } else if !n.ready() {
            Some("not Ready".to_string())
        } else if n.node.spec.unschedulable {
            Some("cordoned (spec.unschedulable)".to_string())
        } else {
            None
        };
        sim.nodes.insert(
            n.name().to_string(),
            SimNode {
                versions: Versions::of(n),
                gpus: n.gpus,
                used: 0,
                unavailable,
                unknown: gpu_labels_unknown(n),
            },
        );
    }
    for (i, p) in pods.iter().enumerate() {
        let Some(node) = p.node() else { continue };
        if p.finished() {
            sim.pods.push(SimPod {
                entry: i,
                node: node.to_string(),
                name: p.name().to_string(),
                moved: false,
            });
            continue;
        }
        if let Some(n) = sim.nodes.get_mut(node) {
            n.used = n.used.saturating_add(p.gpus);
        }
        sim.pods.push(SimPod {
            entry: i,
            node: node.to_string(),
            name: p.name().to_string(),
            moved: false,
        });
    }

    // The nodes to maintain.
    let mut skipped = Vec::new();
    let fleet: Vec<String> = if opts.nodes.is_empty() {
        let Some(up) = &upgrade else {
            return Err(DrainPlanError::Usage(
                "name the node to drain with --node (or give --upgrade to plan for every gpu-ckpt node that needs it)".into(),
            ));
        };
        let mut fleet = Vec::new();
        for n in nodes {
            let v = Versions::of(n);
            if n.label(RUNTIME_LABEL) != Some(RUNTIME_INSTALLED) {
                skipped.push(SkippedNode {
                    node: n.name().into(),
                    why: format!("not a gpu-ckpt node (label {RUNTIME_LABEL} is not \"{RUNTIME_INSTALLED}\")"),
                });
            } else if v.driver_version.is_empty() {
                skipped.push(SkippedNode {
                    node: n.name().into(),
                    why: format!("no GPU driver label ({DRIVER_LABEL})"),
                });
            } else if !up.needed_by(&v) {
                skipped.push(SkippedNode {
                    node: n.name().into(),
                    why: format!("already runs {}", up.describe()),
                });
            } else {
                fleet.push(n.name().to_string());
            }
        }
        fleet
    } else {
        let mut seen = BTreeSet::new();
        for name in &opts.nodes {
            if !planner.nodes.contains_key(name) {
                return Err(DrainPlanError::Usage(format!(
                    "--node {name}: no such node in the node list"
                )));
            }
            if !seen.insert(name.clone()) {
                return Err(DrainPlanError::Usage(format!("--node {name}: given twice")));
            }
        }
        opts.nodes.clone()
    };
    sim.pending = fleet.iter().cloned().collect();

    let after = |sim: &Sim, node: &str| -> Versions {
        let v = sim
            .nodes
            .get(node)
            .map(|n| n.versions.clone())
            .unwrap_or_default();
        match &upgrade {
            Some(u) => u.apply(&v),
            None => v,
        }
    };

    // Groups: by label, ordered as the plan goes; or formed as it goes.
    let mut groups = Vec::new();
    if let Some(key) = &opts.group_by {
        let mut by: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for name in &fleet {
            let v = planner
                .nodes
                .get(name)
                .and_then(|n| n.label(key))
                .unwrap_or("")
                .to_string();
            by.entry(v).or_default().push(name.clone());
        }
        let mut remaining: Vec<(String, Vec<String>)> = by.into_iter().collect();
        while !remaining.is_empty() {
            let mut best: Option<(Score, usize)> = None;
            for (i, (_, members)) in remaining.iter().enumerate() {
                let mut trial = sim.clone();
                let (_, score) = planner.maintain(&mut trial, members, &after);
                if best.is_none_or(|(s, _)| score < s) {
                    best = Some((score, i));
                }
            }
            let Some((_, i)) = best else { break };
            let (value, members) = remaining.remove(i);
            let (plans, _) = planner.maintain(&mut sim, &members, &after);
            groups.push(Group {
                number: groups.len() + 1,
                label_value: Some(value),
                nodes: plans,
            });
        }
    } else {
        let mut remaining = fleet.clone();
        while !remaining.is_empty() {
            // Nodes with the fewest GPUs in gpu-ckpt pods first, then by name.
            remaining.sort_by_key(|n| (planner.ckpt_gpus_on(&sim, n), n.clone()));
            let mut group: Vec<String> = Vec::new();
            let mut score: Score = (0, 0, 0);
            for n in remaining.clone() {
                if group.len() >= opts.group_size {
                    break;
                }
                let mut members = group.clone();
                members.push(n.clone());
                let mut trial = sim.clone();
                let (_, s) = planner.maintain(&mut trial, &members, &after);
                if s.0 <= score.0 && s.1 <= score.1 {
                    group = members;
                    score = s;
                }
            }
            if group.is_empty() {
                // Every node leaves something without a destination: the least harm first.
                let mut best: Option<(Score, String)> = None;
                for n in &remaining {
                    let mut trial = sim.clone();
                    let (_, s) = planner.maintain(&mut trial, std::slice::from_ref(n), &after);
                    if best.as_ref().is_none_or(|(b, _)| s < *b) {
                        best = Some((s, n.clone()));
                    }
                }
                if let Some((_, n)) = best {
                    group.push(n);
                }
            }
            remaining.retain(|n| !group.contains(n));
            let (plans, _) = planner.maintain(&mut sim, &group, &after);
            groups.push(Group {
                number: groups.len() + 1,
                label_value: None,
                nodes: plans,
            });
        }
    }

    let mut without = Vec::new();
    for g in &groups {
        for n in &g.nodes {
            for p in &n.pods {
                if let Disposition::NoDestination { .. } = p.disposition {
                    without.push(format!("{}/{} on {}", p.namespace, p.name, n.node));
                }
            }
        }
    }
    let notes = upgrade_notes(&groups);
    Ok(Plan {
        upgrade,
        groups,
        skipped_nodes: skipped,
        complete: without.is_empty(),
        without_destination: without,
        unknown_nodes: unknown_nodes(nodes),
        notes,
    })
}

/// Every node whose GPU labels are unknown, and why ([`gpu_labels_unknown`]).
fn unknown_nodes(nodes: &[NodeEntry]) -> Vec<SkippedNode> {
    nodes
        .iter()
        .filter_map(|n| {
            gpu_labels_unknown(n).map(|why| SkippedNode {
                node: n.name().to_string(),
                why,
            })
        })
        .collect()
}

/// What the upgrade means for where checkpoints restore: a note per driver branch change, and
/// per release change within a branch (a GPU checkpoint restores only on its exact release).
fn upgrade_notes(groups: &[Group]) -> Vec<String> {
    let changes: BTreeSet<(&str, &str)> = groups
        .iter()
        .flat_map(|g| g.nodes.iter())
        .map(|n| {
            (
                n.before.driver_version.as_str(),
                n.after.driver_version.as_str(),
            )
        })
        .filter(|(a, b)| a != b)
        .collect();
    let mut notes: Vec<String> = Vec::new();
    for (from, to) in changes {
        let (fb, tb) = (driver_branch(from), driver_branch(to));
        let note = if fb != tb {
            format!("the upgrade changes the driver branch from {fb} to {tb}: a checkpoint restores only on its own branch, so workloads move to nodes still on {fb}, and those of the last group to be upgraded restart from the start")
        } else {
            format!("the upgrade changes the driver from {from} to {to} within its branch: a GPU checkpoint restores only on its exact driver version (its processes map the driver's files, named by it), so workloads move to nodes still on {from}, and those of the last group to be upgraded restart from the start")
        };
        if !notes.contains(&note) {
            notes.push(note);
        }
    }
    notes
}

impl<'a> Planner<'a> {
    fn is_ckpt(&self, p: &PodEntry) -> bool {
        p.pod
            .spec
            .runtime_class_name
            .as_ref()
            .is_some_and(|rc| self.opts.runtime_classes.iter().any(|c| c == rc))
    }

    fn ckpt_gpus_on(&self, sim: &Sim, node: &str) -> u32 {
        sim.pods
            .iter()
            .filter(|sp| sp.node == node)
            .filter_map(|sp| self.pods.get(sp.entry))
            .filter(|p| self.is_ckpt(p) && !p.finished())
            .map(|p| p.gpus)
            .fold(0, u32::saturating_add)
    }

    /// A workload's profile on a node with `versions`: as many GPUs as it holds, all of the
    /// node's model; the engine and model versions its pod declares.
    fn profile(p: &PodEntry, versions: &Versions) -> Profile {
        let a = &p.pod.metadata.annotations;
        let gpus = (0..p.gpus)
            .map(|_| Gpu {
                model: versions.gpu_model.clone(),
                ..Gpu::default()
            })
            .collect::<Vec<_>>();
        let devices = if p.gpus == 0 {
            Devices::default()
        } else {
            Devices {
                driver_version: versions.driver_version.clone(),
                cuda_driver_version: versions.cuda_version.clone(),
                gpus,
                // Its CUDA processes map the driver's files, named by its full version, so
                // that the checkpoint restores only on that version (compat's rule).
                driver_files: vec![DriverFile {
                    path: format!("{DRIVER_LIB_DIR}/libcuda.so.{}", versions.driver_version),
                    ..DriverFile::default()
                }],
                ..Devices::default()
            }
        };
        Profile {
            devices,
            workload: Workload {
                engine_version: a.get(ENGINE_VERSION).cloned().unwrap_or_default(),
                model_version: a.get(MODEL_VERSION).cloned().unwrap_or_default(),
            },
        }
    }

    /// Why `p`, checkpointed under `from`, cannot restore on a node with `to` and `free` GPUs;
    /// empty when it can.
    fn reasons(p: &PodEntry, from: &Versions, to: &Versions, free: Option<u32>) -> Vec<String> {
        let verdict = compat::check(&Self::profile(p, from), &Self::profile(p, to));
        // The profiles come from labels: every GPU of a node is of one model, so a per-GPU
        // difference is said once, without the index.
        let mut out: Vec<String> = Vec::new();
        for d in &verdict.differences {
            // The driver's files are the ones its version names: the driver_version line
            // says it.
            if d.field == "driver_file" {
                continue;
            }
            let line = compat::Difference {
                gpu: None,
                ..d.clone()
            }
            .to_string();
            if !out.contains(&line) {
                out.push(line);
            }
        }
        if let Some(free) = free {
            if free < p.gpus {
                out.push(format!(
                    "free GPUs: the workload needs {}, the node has {free} free",
                    p.gpus
                ));
            }
        }
        out
    }

    /// Takes the nodes `members` out at once: every pod on them gets its disposition, workloads
    /// take capacity where they go, and the nodes come back with their versions after the
    /// maintenance. Returns the node plans and the score.
    fn maintain(
        &self,
        sim: &mut Sim,
        members: &[String],
        after: &dyn Fn(&Sim, &str) -> Versions,
    ) -> (Vec<NodePlan>, Score) {
        let mut score: Score = (0, 0, 0);
        let mut plans = Vec::new();
        let mut sorted: Vec<&String> = members.iter().collect();
        sorted.sort();
        for node in sorted {
            let before = sim
                .nodes
                .get(node.as_str())
                .map(|n| n.versions.clone())
                .unwrap_or_default();
            let after_v = after(sim, node);
            let mut pod_plans = Vec::new();
            let here: Vec<usize> = (0..sim.pods.len())
                .filter(|&i| sim.pods[i].node == *node)
                .collect();
            let mut back_here = 0u32;
            for si in here {
                let sp = sim.pods[si].clone();
                let Some(p) = self.pods.get(sp.entry) else {
                    continue;
                };
                let (plan, dest) = self.dispose(sim, &sp, p, node, members, &before, &after_v);
                match &plan.disposition {
                    Disposition::Migrate { .. } => {
                        score.2 = score.2.saturating_add(p.gpus);
                    }
                    Disposition::RestoreAfterMaintenance { .. } => {
                        score.1 += 1;
                        back_here = back_here.saturating_add(p.gpus);
                    }
                    Disposition::NoDestination { .. } => score.0 += 1,
                    _ => {}
                }
                // The simulation moves on.
                let gone = !matches!(plan.disposition, Disposition::Stays { .. });
                if gone && !p.finished() {
                    if let Some(n) = sim.nodes.get_mut(node.as_str()) {
                        n.used = n.used.saturating_sub(p.gpus);
                    }
                }
                match dest {
                    Some(d) => {
                        if let Some(n) = sim.nodes.get_mut(d.as_str()) {
                            n.used = n.used.saturating_add(p.gpus);
                        }
                        let restore = plan.restore_pod.clone().unwrap_or_default();
                        let s = &mut sim.pods[si];
                        s.node = d;
                        s.name = restore;
                        s.moved = true;
                    }
                    None if gone => {
                        // Evicted, deleted or without destination: it leaves the plan.
                        sim.pods[si].node = String::new();
                    }
                    None => {}
                }
                pod_plans.push(plan);
            }
            if let Some(n) = sim.nodes.get_mut(node.as_str()) {
                n.versions = after_v.clone();
                n.used = n.used.saturating_add(back_here);
            }
            sim.pending.remove(node.as_str());
            let entry = self.nodes.get(node.as_str());
            let kubelet = entry
                .map(|e| e.kubelet_address())
                .unwrap_or_else(|| node.clone());
            let mut np = NodePlan {
                node: node.clone(),
                kubelet,
                before,
                after: after_v,
                gpu_labels_unknown: sim.nodes.get(node.as_str()).and_then(|n| n.unknown.clone()),
                pods: pod_plans,
                steps: Vec::new(),
            };
            np.steps = self.steps(&np);
            plans.push(np);
        }
        (plans, score)
    }

    /// What happens to one pod of a node being maintained; the destination where it moves.
    #[allow(clippy::too_many_arguments)]
    fn dispose(
        &self,
        sim: &Sim,
        sp: &SimPod,
        p: &PodEntry,
        node: &str,
        members: &[String],
        before: &Versions,
        after_v: &Versions,
    ) -> (PodPlan, Option<String>) {
        let owner = p.controller().map(|o| format!("{}/{}", o.kind, o.name));
        let mut plan = PodPlan {
            namespace: p.namespace().to_string(),
            name: sp.name.clone(),
            class: PodClass::Plain,
            runtime_class: p.pod.spec.runtime_class_name.clone(),
            owner: if sp.moved { None } else { owner.clone() },
            gpus: p.gpus,
            containers: p
                .pod
                .spec
                .containers
                .iter()
                .map(|c| c.name.clone())
                .collect(),
            disposition: Disposition::Finished,
            images: BTreeMap::new(),
            restore_pod: None,
            single_node_claims: Vec::new(),
            downtime: None,
            notes: Vec::new(),
            entry: sp.entry,
        };
        let owner_kind = p.controller().map(|o| o.kind.as_str());
        let then_fresh = || {
            match (&owner, sp.moved) {
            (Some(o), false) if owner_kind != Some("Node") => format!(
                "evicted by the drain; {o} starts a new pod elsewhere, from the start (its state is lost)"
            ),
            (Some(o), true) => format!(
                "deleted by the drain (--force): a restore pod has no controller; {o} does not start it again for {}/{}",
                p.namespace(),
                p.name()
            ),
            _ => "deleted by the drain (--force): it has no controller, so nothing starts it again".to_string(),
        }
        };
        if p.finished() {
            plan.class = PodClass::Finished;
            plan.disposition = Disposition::Finished;
            return (plan, None);
        }
        if p.pod.metadata.annotations.contains_key(MIRROR_ANNOTATION) || owner_kind == Some("Node")
        {
            plan.class = PodClass::Static;
            plan.disposition = Disposition::Stays {
                why: "static pod: the kubelet runs it from its manifest; the drain leaves it, and it stops and starts with the node".into(),
            };
            return (plan, None);
        }
        if owner_kind == Some("DaemonSet") {
            plan.class = PodClass::DaemonSet;
            plan.disposition = Disposition::Stays {
                why: "DaemonSet pod: the drain leaves it (--ignore-daemonsets); it stops with the node during the maintenance and its DaemonSet runs it again".into(),
            };
            return (plan, None);
        }
        if !self.is_ckpt(p) {
            plan.class = PodClass::Plain;
            if p.gpus > 0 {
                plan.notes.push(format!(
                    "holds {} GPU(s) but is not on a gpu-ckpt RuntimeClass ({}): its GPU work restarts from scratch",
                    p.gpus,
                    self.opts.runtime_classes.join(", ")
                ));
            }
            plan.disposition = Disposition::Evicted { then: then_fresh() };
            return (plan, None);
        }
        plan.class = PodClass::GpuCkpt;
        if let Some(why) = self.uncheckpointable(p) {
            plan.disposition = Disposition::CannotCheckpoint {
                why,
                then: then_fresh(),
            };
            return (plan, None);
        }
        for v in &p.pod.spec.volumes {
            if v.empty_dir.is_some() {
                plan.notes.push(format!(
                    "volume {:?} is an emptyDir: its files are not in the checkpoint and the restored pod starts with it empty",
                    v.name
                ));
            } else if v.host_path.is_some() {
                plan.notes.push(format!(
                    "volume {:?} is a hostPath: the restored pod sees the destination node's directory",
                    v.name
                ));
            } else if let Some(c) = p.claims.iter().find(|c| c.volume == v.name) {
                plan.notes.push(claim_note(c));
            }
        }
        // A GPU workload on a node whose GPU versions are unknown: its checkpoint's are too.
        if p.gpus > 0 {
            if let Some(why) = sim.nodes.get(node).and_then(|n| n.unknown_for(p.gpus)) {
                plan.disposition = Disposition::NoDestination {
                    rejected: vec![Rejection {
                        node: format!("{node} (the pod's node)"),
                        reasons: vec![format!(
                            "{why}: the GPU model, driver and CUDA versions its checkpoint would carry are unknown, so no node can be judged able to restore it"
                        )],
                    }],
                    then: format!(
                        "not checkpointed: its GPU versions are unknown. {}",
                        then_fresh()
                    ),
                };
                return (plan, None);
            }
        }
        let mut owner_note = match (&owner, sp.moved) {
            (Some(o), false) => Some(format!(
                "owned by {o}: when the drain evicts the pod its controller starts a new one as well; the restore pod has no owner (scale {o} down by one, or delete the new pod)"
            )),
            _ => None,
        };
        let (candidates, mut rejected) = Self::destinations(sim, p, node, members, before);
        let restore_name = restore_pod_name(&sp.name);
        let images: BTreeMap<String, String> = p
            .pod
            .spec
            .containers
            .iter()
            .map(|c| {
                (
                    c.name.clone(),
                    image_ref(&self.opts.registry, p.namespace(), &sp.name, &c.name, node),
                )
            })
            .collect();
        if let Some(dest) = self.choose(sim, &candidates) {
            plan.disposition = Disposition::Migrate {
                destination: dest.clone(),
                candidates,
            };
            if let Some(names) = single_node_move(&mut plan, p, node, &dest, &restore_name) {
                // Not the drain's eviction but the deletion makes the controller start
                // another pod, and that one may take the volumes first.
                owner_note = owner.as_ref().filter(|_| !sp.moved).map(|o| {
                    format!("owned by {o}: deleting the original makes {o} start a replacement, which may attach claim(s) {names} before the restore pod does, and the restore pod has no owner: scale {o} down by one before the deletion")
                });
            }
            plan.images = images;
            plan.restore_pod = Some(restore_name);
            plan.notes.extend(owner_note);
            return (plan, Some(dest));
        }
        // This node itself, after its maintenance?
        let here = match sim.nodes.get(node) {
            Some(SimNode {
                unknown: Some(u), ..
            }) => vec![u.clone()],
            n => Self::reasons(p, before, after_v, Some(n.map(|n| n.gpus).unwrap_or(0))),
        };
        if here.is_empty() {
            plan.disposition = Disposition::RestoreAfterMaintenance { rejected };
            plan.images = images;
            plan.restore_pod = Some(restore_name);
            plan.notes.extend(owner_note);
            return (plan, None);
        }
        rejected.push(Rejection {
            node: format!("{node} (after the maintenance)"),
            reasons: here,
        });
        plan.disposition = Disposition::NoDestination {
            rejected,
            then: format!("not checkpointed: no node can restore it. {}", then_fresh()),
        };
        (plan, None)
    }

    /// Where a workload of `node` (checkpointed under `before`) can go among the other nodes,
    /// and why not for each that cannot.
    fn destinations(
        sim: &Sim,
        p: &PodEntry,
        node: &str,
        members: &[String],
        before: &Versions,
    ) -> (Vec<String>, Vec<Rejection>) {
        let mut candidates = Vec::new();
        let mut rejected = Vec::new();
        for (name, n) in &sim.nodes {
            if name == node {
                continue;
            }
            if members.contains(name) {
                rejected.push(Rejection {
                    node: name.clone(),
                    reasons: vec!["maintained in the same group".into()],
                });
                continue;
            }
            let reasons = if let Some(u) = &n.unavailable {
                vec![u.clone()]
            } else if let Some(u) = &n.unknown {
                vec![u.clone()]
            } else if p.gpus > 0 && n.gpus == 0 {
                vec![format!("no GPUs ({})", kube::GPU_RESOURCE)]
            } else {
                Self::reasons(p, before, &n.versions, Some(n.gpus.saturating_sub(n.used)))
            };
            if reasons.is_empty() {
                candidates.push(name.clone());
            } else {
                rejected.push(Rejection {
                    node: name.clone(),
                    reasons,
                });
            }
        }
        (candidates, rejected)
    }

    /// Among the candidates: nodes this plan does not maintain or has maintained already (the
    /// workload does not move again), then the fullest that fits, then by name.
    fn choose(&self, sim: &Sim, candidates: &[String]) -> Option<String> {
        candidates
            .iter()
            .filter_map(|c| sim.nodes.get(c).map(|n| (c, n)))
            .min_by_key(|(c, n)| {
                (
                    sim.pending.contains(*c),
                    n.gpus.saturating_sub(n.used),
                    (*c).clone(),
                )
            })
            .map(|(c, _)| c.clone())
    }

    /// Why a running gpu-ckpt pod cannot be checkpointed, if it cannot.
    fn uncheckpointable(&self, p: &PodEntry) -> Option<String> {
        let phase = p.pod.status.phase.as_deref().unwrap_or("Unknown");
        if phase != "Running" {
            return Some(format!("phase {phase}: nothing runs to checkpoint"));
        }
        if kube::uses_mig(&p.pod) {
            return Some(
                "uses MIG GPU slices (nvidia.com/mig-*), which gpu-ckpt does not checkpoint".into(),
            );
        }
        for c in &p.pod.spec.containers {
            let st = p
                .pod
                .status
                .container_statuses
                .iter()
                .find(|s| s.name == c.name);
            match st {
                None => {
                    return Some(format!(
                        "container {:?} has no status: it is not running",
                        c.name
                    ))
                }
                Some(s) if !s.state.contains_key("running") => {
                    let (state, detail) = s
                        .state
                        .iter()
                        .next()
                        .map(|(k, v)| {
                            (
                                k.clone(),
                                v.get("reason")
                                    .and_then(Value::as_str)
                                    .unwrap_or("")
                                    .to_string(),
                            )
                        })
                        .unwrap_or_else(|| ("unknown".into(), String::new()));
                    let detail = if detail.is_empty() {
                        String::new()
                    } else {
                        format!(" ({detail})")
                    };
                    return Some(format!(
                        "container {:?} is not running: {state}{detail}",
                        c.name
                    ));
                }
                Some(_) => {}
            }
        }
        None
    }

    /// The ordered steps for one node.
    fn steps(&self, np: &NodePlan) -> Vec<Step> {
        let node = &np.node;
        let cmd = |v: &[&str]| Some(v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let mut all: Vec<Step> = Vec::new();
        all.push(Step {
            number: 1,
            kind: StepKind::Cordon,
            text: format!("cordon {node}: no new pods land on it"),
            pod: None,
            container: None,
            kubelet: None,
            command: cmd(&["kubectl", "cordon", node]),
            manifest: None,
        });
        let host = if np.kubelet.contains(':') {
            format!("[{}]", np.kubelet)
        } else {
            np.kubelet.clone()
        };
        let mut later = Vec::new();
        for pp in &np.pods {
            let dest = match &pp.disposition {
                Disposition::Migrate { destination, .. } => Some(destination.clone()),
                Disposition::RestoreAfterMaintenance { .. } => None,
                _ => continue,
            };
            let id = format!("{}/{}", pp.namespace, pp.name);
            let (mut checkpoints, mut builds) = self.checkpoint_steps(pp, node, &host, &id);
            if pp.deleted_before_restore() {
                // The volumes attach to one node at a time: every container's checkpoint, then
                // the original goes (nothing written to the volume after the checkpoint is
                // lost to a restore that expects it), then the images.
                all.append(&mut checkpoints);
                all.push(self.delete_original(pp, node, &id));
                all.append(&mut builds);
            } else {
                for (c, b) in checkpoints.into_iter().zip(builds) {
                    all.push(c);
                    all.push(b);
                }
            }
            let restore = pp.restore_pod.clone().unwrap_or_default();
            let on = dest.clone().unwrap_or_else(|| node.clone());
            let manifest = self.restore_manifest(pp, &restore, &on);
            let create = Step {
                number: 0,
                kind: StepKind::CreateRestorePod,
                text: format!(
                    "create pod {}/{restore} on {on} (RuntimeClass {}, {})",
                    pp.namespace,
                    self.opts.restore_runtime_class,
                    restore_annotation_text(pp)
                ),
                pod: Some(id.clone()),
                container: None,
                kubelet: None,
                command: cmd(&["kubectl", "create", "-f", "-"]),
                manifest,
            };
            let wait = Step {
                number: 0,
                kind: StepKind::WaitReady,
                text: format!("wait until {}/{restore} is Ready", pp.namespace),
                pod: Some(id.clone()),
                container: None,
                kubelet: None,
                command: Some(vec![
                    "kubectl".into(),
                    "wait".into(),
                    "-n".into(),
                    pp.namespace.clone(),
                    "--for=condition=Ready".into(),
                    format!("pod/{restore}"),
                    format!("--timeout={}s", self.opts.ready_timeout_s),
                ]),
                manifest: None,
            };
            if dest.is_some() {
                all.push(create);
                all.push(wait);
            } else {
                later.push(create);
                later.push(wait);
            }
        }
        // Pods deleted before the drain are not the drain's.
        let drained = || np.pods.iter().filter(|p| !p.deleted_before_restore());
        let force = drained()
            .any(|p| matches!(p.class, PodClass::Plain | PodClass::GpuCkpt) && p.owner.is_none());
        let empty_dir = drained().any(|p| {
            !matches!(p.class, PodClass::DaemonSet | PodClass::Static)
                && self
                    .pods
                    .get(p.entry)
                    .is_some_and(|e| e.pod.spec.volumes.iter().any(|v| v.empty_dir.is_some()))
        });
        let mut drain = vec![
            "kubectl".to_string(),
            "drain".into(),
            node.clone(),
            "--ignore-daemonsets".into(),
        ];
        if empty_dir {
            drain.push("--delete-emptydir-data".into());
        }
        if force {
            drain.push("--force".into());
        }
        drain.push(format!("--timeout={}s", self.opts.ready_timeout_s));
        let evicted = drained()
            .filter(|p| !matches!(p.disposition, Disposition::Stays { .. }))
            .count();
        all.push(Step {
            number: 0,
            kind: StepKind::Drain,
            text: format!(
                "drain {node}: evicts its {evicted} pod(s) other than DaemonSet and static pods{}",
                if force {
                    " (--force: some have no controller)"
                } else {
                    ""
                }
            ),
            pod: None,
            container: None,
            kubelet: None,
            command: Some(drain),
            manifest: None,
        });
        let maint = if np.before != np.after {
            format!(
                "maintenance of {node}: upgrade the driver from {} to {} (CUDA {} to {})",
                np.before.driver_version,
                np.after.driver_version,
                np.before.cuda_version,
                np.after.cuda_version
            )
        } else {
            format!("maintenance of {node} (kernel patch, reboot, ...): the node keeps its GPU model, driver and CUDA versions")
        };
        all.push(Step {
            number: 0,
            kind: StepKind::Maintenance,
            text: maint,
            pod: None,
            container: None,
            kubelet: None,
            command: None,
            manifest: None,
        });
        if np.before != np.after {
            let mut cmdv = vec![
                "kubectl".to_string(),
                "label".into(),
                "node".into(),
                node.clone(),
                "--overwrite".into(),
            ];
            cmdv.push(format!("{DRIVER_LABEL}={}", np.after.driver_version));
            if np.after.cuda_version != UNKNOWN_CUDA {
                cmdv.push(format!("{CUDA_LABEL}={}", np.after.cuda_version));
            }
            all.push(Step {
                number: 0,
                kind: StepKind::Relabel,
                text: format!(
                    "relabel {node} with its new versions (the node installer does it when its pod restarts)"
                ),
                pod: None,
                container: None,
                kubelet: None,
                command: Some(cmdv),
                manifest: None,
            });
        }
        all.push(Step {
            number: 0,
            kind: StepKind::Uncordon,
            text: format!("uncordon {node}"),
            pod: None,
            container: None,
            kubelet: None,
            command: cmd(&["kubectl", "uncordon", node]),
            manifest: None,
        });
        all.extend(later);
        for (i, s) in all.iter_mut().enumerate() {
            s.number = i + 1;
        }
        all
    }

    /// Per container of `pp` on `node` (kubelet at `host`): the kubelet's checkpoint call, and
    /// the build and push of its image.
    fn checkpoint_steps(
        &self,
        pp: &PodPlan,
        node: &str,
        host: &str,
        id: &str,
    ) -> (Vec<Step>, Vec<Step>) {
        let t = self.opts.checkpoint_timeout_s;
        let mut checkpoints = Vec::new();
        let mut builds = Vec::new();
        for c in &pp.containers {
            let path = format!("/checkpoint/{}/{}/{c}", pp.namespace, pp.name);
            checkpoints.push(Step {
                number: 0,
                kind: StepKind::Checkpoint,
                text: format!(
                    "checkpoint container {c} of {id}: POST https://{host}:{}{path}?timeout={t} (the pod keeps running)",
                    self.opts.kubelet_port
                ),
                pod: Some(id.to_string()),
                container: Some(c.clone()),
                kubelet: Some(KubeletCall {
                    method: "POST".into(),
                    url: format!("https://{host}:{}{path}?timeout={t}", self.opts.kubelet_port),
                    timeout_s: t,
                    answers: "{\"items\":[\"/var/lib/kubelet/checkpoints/checkpoint-<pod>_<namespace>-<container>-<time>.tar\"]}".into(),
                }),
                command: None,
                manifest: None,
            });
            let image = pp.images.get(c).cloned().unwrap_or_default();
            builds.push(Step {
                number: 0,
                kind: StepKind::BuildPush,
                text: format!(
                    "on {node}, as root: gpu-ckpt build <the archive the kubelet answered> --ref {image} --push"
                ),
                pod: Some(id.to_string()),
                container: Some(c.clone()),
                kubelet: None,
                command: Some(vec![
                    "gpu-ckpt".into(),
                    "build".into(),
                    "ARCHIVE".into(),
                    "--ref".into(),
                    image,
                    "--push".into(),
                ]),
                manifest: None,
            });
        }
        (checkpoints, builds)
    }

    /// Deleting the original of a move whose claims attach to one node at a time: `kubectl
    /// delete` returns once the kubelet has unmounted its volumes, and the attach-detach
    /// controller then detaches them for the restore pod's node.
    fn delete_original(&self, pp: &PodPlan, node: &str, id: &str) -> Step {
        let restore = pp.restore_pod.clone().unwrap_or_default();
        let claims = quoted(pp.single_node_claims.iter().map(String::as_str));
        Step {
            number: 0,
            kind: StepKind::DeleteOriginal,
            text: format!(
                "delete {id} so that claim(s) {claims} detach from {node}: its checkpoint is taken; the workload is down from here until {}/{restore} is Ready",
                pp.namespace
            ),
            pod: Some(id.to_string()),
            container: None,
            kubelet: None,
            command: Some(vec![
                "kubectl".into(),
                "delete".into(),
                "pod".into(),
                "-n".into(),
                pp.namespace.clone(),
                pp.name.clone(),
                "--wait=true".into(),
                format!("--timeout={}s", self.opts.ready_timeout_s),
            ]),
            manifest: None,
        }
    }

    /// The restore pod: the pod as it was (its spec, labels and annotations), without what the
    /// API server and its controller set, on the restore RuntimeClass (`Options::restore_runtime_class`), with the checkpoint
    /// images in `gpu-ckpt.io/restore-from`, held to `node` by node affinity.
    fn restore_manifest(&self, pp: &PodPlan, restore: &str, node: &str) -> Option<Value> {
        let original = self.pods.get(pp.entry)?;
        let raw = &original.raw;
        let hostname = self
            .nodes
            .get(node)
            .and_then(|n| n.label(HOSTNAME_LABEL))
            .unwrap_or(node)
            .to_string();
        let mut labels = raw
            .pointer("/metadata/labels")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        for k in [
            "pod-template-hash",
            "controller-revision-hash",
            "statefulset.kubernetes.io/pod-name",
            "apps.kubernetes.io/pod-index",
        ] {
            labels.remove(k);
        }
        let mut annotations = raw
            .pointer("/metadata/annotations")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        annotations.retain(|k, _| {
            k != "kubectl.kubernetes.io/last-applied-configuration"
                && k != RESTORE_FROM
                && !k.starts_with(&format!("{RESTORE_FROM}."))
        });
        if pp.images.len() == 1 {
            if let Some(img) = pp.images.values().next() {
                annotations.insert(RESTORE_FROM.into(), Value::String(img.clone()));
            }
        } else {
            for (c, img) in &pp.images {
                annotations.insert(format!("{RESTORE_FROM}.{c}"), Value::String(img.clone()));
            }
        }
        let mut spec = raw.get("spec").cloned().unwrap_or_else(|| json!({}));
        if let Some(s) = spec.as_object_mut() {
            s.remove("nodeName");
            s.insert(
                "runtimeClassName".into(),
                Value::String(self.opts.restore_runtime_class.clone()),
            );
            let affinity = s.entry("affinity").or_insert_with(|| json!({}));
            if let Some(a) = affinity.as_object_mut() {
                a.insert(
                    "nodeAffinity".into(),
                    json!({"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                        {"matchExpressions": [{"key": HOSTNAME_LABEL, "operator": "In", "values": [hostname]}]}
                    ]}}),
                );
            }
        }
        let mut meta = serde_json::Map::new();
        meta.insert("name".into(), Value::String(restore.to_string()));
        meta.insert("namespace".into(), Value::String(pp.namespace.clone()));
        if !labels.is_empty() {
            meta.insert("labels".into(), Value::Object(labels));
        }
        meta.insert("annotations".into(), Value::Object(annotations));
        Some(json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "spec": spec,
        }))
    }
}

/// A move of `p` from `node` to `dest` whose claims attach to one node at a time: the claims
/// and the downtime go into the plan. Returns the claims' names, quoted; None when every claim
/// is shared.
fn single_node_move(
    plan: &mut PodPlan,
    p: &PodEntry,
    node: &str,
    dest: &str,
    restore: &str,
) -> Option<String> {
    let single: Vec<&ClaimUse> = p
        .claims
        .iter()
        .filter(|c| c.attach() != Attach::Shared)
        .collect();
    if single.is_empty() {
        return None;
    }
    let names = quoted(single.iter().map(|c| c.claim.as_str()));
    let ns = p.namespace();
    plan.downtime = Some(format!(
        "from the deletion of {ns}/{} until {ns}/{restore} is Ready on {dest}: claim(s) {names} attach to one node at a time, so the original is deleted after its checkpoint and its volumes detach from {node}; then the images are built and pushed, and the restore pod attaches the volumes on {dest} and restores",
        plan.name
    ));
    plan.single_node_claims = single.iter().map(|c| c.claim.clone()).collect();
    Some(names)
}

/// What a pod's PersistentVolumeClaim means for its move.
fn claim_note(c: &ClaimUse) -> String {
    match c.attach() {
        Attach::Shared => format!(
            "volume {:?} is PersistentVolumeClaim {:?} ({}): it must be attachable on the destination; the restore pod mounts it there while the original still runs, until the drain",
            c.volume, c.claim, c.modes()
        ),
        Attach::SingleNode => format!(
            "volume {:?} is PersistentVolumeClaim {:?} ({}): it attaches to one node at a time, so a move to another node deletes the original after its checkpoint, before the restore pod is created",
            c.volume, c.claim, c.modes()
        ),
        Attach::Unknown => format!(
            "volume {:?} is PersistentVolumeClaim {:?}, which is not in the pod list: its access modes are unknown, so it is planned as ReadWriteOnce (give `kubectl get pods,pvc -A -o json` for its modes)",
            c.volume, c.claim
        ),
    }
}

/// `"a", "b"`.
fn quoted<'s>(names: impl IntoIterator<Item = &'s str>) -> String {
    names
        .into_iter()
        .map(|c| format!("{c:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn restore_annotation_text(pp: &PodPlan) -> String {
    if pp.images.len() == 1 {
        pp.images
            .values()
            .next()
            .map(|i| format!("{RESTORE_FROM}={i}"))
            .unwrap_or_default()
    } else {
        pp.images
            .iter()
            .map(|(c, i)| format!("{RESTORE_FROM}.{c}={i}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// `x` → `x-restore`, `x-restore` → `x-restore-2`, `x-restore-2` → `x-restore-3`; at most 253
/// characters (a pod name is a DNS subdomain).
pub fn restore_pod_name(name: &str) -> String {
    let (base, n) = match name.rsplit_once("-restore") {
        Some((b, "")) => (b, 1u32),
        Some((b, num)) => match num.strip_prefix('-').and_then(|d| d.parse::<u32>().ok()) {
            Some(k) => (b, k),
            None => (name, 0),
        },
        None => (name, 0),
    };
    let suffix = if n == 0 {
        "-restore".to_string()
    } else {
        format!("-restore-{}", n + 1)
    };
    let keep = 253usize.saturating_sub(suffix.len());
    let base: String = base.chars().take(keep).collect();
    format!("{}{suffix}", base.trim_end_matches(['-', '.']))
}

/// `REGISTRY/NAMESPACE/POD-CONTAINER:drain-NODE`, within the distribution spec's grammar
/// (lower-case path components, a tag of at most 128 characters).
pub fn image_ref(
    registry: &str,
    namespace: &str,
    pod: &str,
    container: &str,
    node: &str,
) -> String {
    let comp = |s: &str| -> String {
        let mapped: String = s
            .to_ascii_lowercase()
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '.' || c == '-' || c == '_' {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        mapped
            .trim_matches(|c: char| !c.is_ascii_alphanumeric())
            .to_string()
    };
    let tag: String = format!("drain-{}", comp(node)).chars().take(128).collect();
    format!(
        "{}/{}/{}-{}:{tag}",
        registry.trim_end_matches('/'),
        comp(namespace),
        comp(pod),
        comp(container)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restore_names_count_up() {
        assert_eq!(restore_pod_name("llm-0"), "llm-0-restore");
        assert_eq!(restore_pod_name("llm-0-restore"), "llm-0-restore-2");
        assert_eq!(restore_pod_name("llm-0-restore-2"), "llm-0-restore-3");
        assert!(restore_pod_name(&"a".repeat(300)).len() <= 253);
    }

    #[test]
    fn upgrades_parse_and_apply() {
        let mut u = Upgrade::default();
        u.add("driver=580.95.05").unwrap();
        let v = Versions {
            gpu_model: "NVIDIA-H100-80GB-HBM3".into(),
            driver_version: "570.86.15".into(),
            cuda_version: "12.8".into(),
        };
        // Another branch without a CUDA version: unknown.
        assert_eq!(u.apply(&v).cuda_version, UNKNOWN_CUDA);
        u.add("cuda=13.0").unwrap();
        assert_eq!(u.apply(&v).cuda_version, "13.0");
        assert!(u
            .add("kernel=6.1")
            .unwrap_err()
            .to_string()
            .contains("unknown key \"kernel\""));
        assert!(u.add("driver").is_err());
        assert!(u.add("driver=5 8").is_err());
    }

    #[test]
    fn image_refs_follow_the_grammar() {
        assert_eq!(
            image_ref(
                "registry.example.com/ckpt/",
                "ml",
                "llm-0",
                "server",
                "gpu-a.example"
            ),
            "registry.example.com/ckpt/ml/llm-0-server:drain-gpu-a.example"
        );
    }
}
