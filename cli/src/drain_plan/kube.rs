//! The parts of `kubectl get pods -o json` and `kubectl get nodes -o json` a drain plan reads.
//!
//! Input is hostile: it is parsed into these types with the path of every field tracked
//! (`serde_path_to_error`), so a bad document gets one line naming the field
//! (`pods.json: items[3].spec.containers: missing`). Fields not named here are ignored; the
//! raw JSON of each pod is kept to write its restore pod from.
//!
//! The pod list may also hold the PersistentVolumeClaims its pods mount
//! (`kubectl get pods,pvc -A -o json` prints one `List` of both): their access modes decide the
//! order a pod with a claim is moved in.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

use super::DrainPlanError;

/// The NVIDIA device plugin's extended resource.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// GPU feature discovery's (and the GPU operator's) label on nodes with NVIDIA GPUs.
pub const GPU_PRESENT_LABEL: &str = "nvidia.com/gpu.present";
/// MIG slices are advertised as `nvidia.com/mig-<profile>` (mixed strategy).
pub const MIG_RESOURCE_PREFIX: &str = "nvidia.com/mig-";

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMeta {
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    #[serde(default)]
    pub owner_references: Vec<OwnerReference>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OwnerReference {
    pub kind: String,
    pub name: String,
    #[serde(default)]
    pub controller: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct Pod {
    pub metadata: ObjectMeta,
    pub spec: PodSpec,
    #[serde(default)]
    pub status: PodStatus,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodSpec {
    #[serde(default)]
    pub node_name: Option<String>,
    #[serde(default)]
    pub runtime_class_name: Option<String>,
    pub containers: Vec<Container>,
    #[serde(default)]
    pub init_containers: Vec<Container>,
    #[serde(default)]
    pub volumes: Vec<Volume>,
}

#[derive(Debug, Deserialize)]
pub struct Container {
    pub name: String,
    #[serde(default)]
    pub resources: Resources,
}

#[derive(Debug, Default, Deserialize)]
pub struct Resources {
    #[serde(default)]
    pub limits: BTreeMap<String, Value>,
    #[serde(default)]
    pub requests: BTreeMap<String, Value>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Volume {
    pub name: String,
    #[serde(default)]
    pub empty_dir: Option<Value>,
    #[serde(default)]
    pub host_path: Option<Value>,
    #[serde(default)]
    pub persistent_volume_claim: Option<ClaimSource>,
}

/// A pod volume's `persistentVolumeClaim`.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimSource {
    pub claim_name: String,
    #[serde(default)]
    pub read_only: bool,
}

/// The parts of a PersistentVolumeClaim a plan reads: its access modes.
#[derive(Debug, Deserialize)]
pub struct PersistentVolumeClaim {
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: ClaimModes,
    #[serde(default)]
    pub status: ClaimModes,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimModes {
    #[serde(default)]
    pub access_modes: Vec<String>,
}

/// How a claim's volume attaches, for the order of a move.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attach {
    /// `ReadWriteMany`, or `ReadOnlyMany` mounted read-only: the restore pod mounts it on
    /// another node while the original still runs.
    Shared,
    /// `ReadWriteOnce`, `ReadWriteOncePod` (or `ReadOnlyMany` mounted read-write): on one node
    /// at a time; it detaches only when the original pod is gone.
    SingleNode,
    /// The claim is not in the pod list: its access modes are unknown.
    Unknown,
}

/// A PersistentVolumeClaim a pod mounts, with what the pod list says of it.
#[derive(Debug, Clone)]
pub struct ClaimUse {
    /// The pod's volume name.
    pub volume: String,
    pub claim: String,
    pub read_only: bool,
    /// The claim's access modes (its status's, the bound volume's, else its spec's); None when
    /// the claim is not in the pod list.
    pub access_modes: Option<Vec<String>>,
}

impl ClaimUse {
    pub fn attach(&self) -> Attach {
        let Some(modes) = &self.access_modes else {
            return Attach::Unknown;
        };
        let has = |m: &str| modes.iter().any(|x| x == m);
        let read_only_many =
            has("ReadOnlyMany") && (self.read_only || modes.iter().all(|m| m == "ReadOnlyMany"));
        if has("ReadWriteMany") || read_only_many {
            Attach::Shared
        } else {
            Attach::SingleNode
        }
    }

    /// `ReadWriteOnce`, `ReadWriteMany, ReadOnlyMany`, or `access modes unknown`.
    pub fn modes(&self) -> String {
        match &self.access_modes {
            Some(m) if !m.is_empty() => m.join(", "),
            Some(_) => "no access modes".into(),
            None => "access modes unknown".into(),
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodStatus {
    #[serde(default)]
    pub phase: Option<String>,
    #[serde(default)]
    pub container_statuses: Vec<ContainerStatus>,
}

#[derive(Debug, Deserialize)]
pub struct ContainerStatus {
    pub name: String,
    #[serde(default)]
    pub ready: bool,
    /// `{"running": {...}}`, `{"waiting": {"reason": ...}}` or `{"terminated": {...}}`.
    #[serde(default)]
    pub state: BTreeMap<String, Value>,
}

#[derive(Debug, Deserialize)]
pub struct Node {
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: NodeSpec,
    #[serde(default)]
    pub status: NodeStatus,
}

#[derive(Debug, Default, Deserialize)]
pub struct NodeSpec {
    #[serde(default)]
    pub unschedulable: bool,
}

#[derive(Debug, Default, Deserialize)]
pub struct NodeStatus {
    #[serde(default)]
    pub allocatable: BTreeMap<String, Value>,
    #[serde(default)]
    pub capacity: BTreeMap<String, Value>,
    #[serde(default)]
    pub addresses: Vec<NodeAddress>,
    #[serde(default)]
    pub conditions: Vec<NodeCondition>,
}

#[derive(Debug, Deserialize)]
pub struct NodeAddress {
    #[serde(rename = "type")]
    pub kind: String,
    pub address: String,
}

#[derive(Debug, Deserialize)]
pub struct NodeCondition {
    #[serde(rename = "type")]
    pub kind: String,
    pub status: String,
}

/// One pod as read: its typed view, its raw JSON, and where it was in the list.
#[derive(Debug)]
pub struct PodEntry {
    pub index: usize,
    pub pod: Pod,
    pub raw: Value,
    /// GPUs the pod holds (`nvidia.com/gpu`, limits, else requests; init containers as the
    /// scheduler counts them).
    pub gpus: u32,
    /// The PersistentVolumeClaims it mounts, in the order of its volumes.
    pub claims: Vec<ClaimUse>,
}

impl PodEntry {
    pub fn namespace(&self) -> &str {
        self.pod.metadata.namespace.as_deref().unwrap_or("default")
    }
    pub fn name(&self) -> &str {
        &self.pod.metadata.name
    }
    /// `namespace/name`.
    pub fn id(&self) -> String {
        format!("{}/{}", self.namespace(), self.name())
    }
    pub fn node(&self) -> Option<&str> {
        self.pod.spec.node_name.as_deref().filter(|n| !n.is_empty())
    }
    /// The controller among the owner references (the one with `controller: true`, else the
    /// first).
    pub fn controller(&self) -> Option<&OwnerReference> {
        let refs = &self.pod.metadata.owner_references;
        refs.iter()
            .find(|r| r.controller == Some(true))
            .or_else(|| refs.first())
    }
    /// Succeeded or Failed: nothing runs any more.
    pub fn finished(&self) -> bool {
        matches!(
            self.pod.status.phase.as_deref(),
            Some("Succeeded") | Some("Failed")
        )
    }
}

#[derive(Debug)]
pub struct NodeEntry {
    pub index: usize,
    pub node: Node,
    /// Allocatable `nvidia.com/gpu` (else capacity; 0 when neither says).
    pub gpus: u32,
}

impl NodeEntry {
    pub fn name(&self) -> &str {
        &self.node.metadata.name
    }
    pub fn label(&self, key: &str) -> Option<&str> {
        self.node
            .metadata
            .labels
            .get(key)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }
    /// The address the kubelet listens on: InternalIP, else ExternalIP, else Hostname, else the
    /// node's name.
    pub fn kubelet_address(&self) -> String {
        for kind in ["InternalIP", "ExternalIP", "Hostname"] {
            if let Some(a) = self
                .node
                .status
                .addresses
                .iter()
                .find(|a| a.kind == kind && !a.address.is_empty())
            {
                return a.address.clone();
            }
        }
        self.name().to_string()
    }
    /// Whether something says the node has NVIDIA GPUs: an `nvidia.com/gpu` resource, GPU
    /// feature discovery's `nvidia.com/gpu.present=true`, or one of `gpu_labels`.
    pub fn has_gpus(&self, gpu_labels: &[&str]) -> bool {
        self.gpus > 0
            || self.label(GPU_PRESENT_LABEL) == Some("true")
            || gpu_labels.iter().any(|k| self.label(k).is_some())
    }
    /// `Ready` is `True`.
    pub fn ready(&self) -> bool {
        self.node
            .status
            .conditions
            .iter()
            .any(|c| c.kind == "Ready" && c.status == "True")
    }
}

/// Most a pod or node list may be: far more than any real cluster's `kubectl get -o json`.
pub const MAX_INPUT_BYTES: usize = 256 << 20;

/// Parses `bytes` as a v1 List of Pods, and of the PersistentVolumeClaims they mount where the
/// list has them (`kubectl get pods,pvc -A -o json`); `what` names the input in errors (its file
/// name).
pub fn parse_pods(what: &str, bytes: &[u8]) -> Result<Vec<PodEntry>, DrainPlanError> {
    let items = parse_list(what, bytes, "PodList")?;
    let mut pods = Vec::with_capacity(items.len());
    let mut claims: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for (i, raw) in items.into_iter().enumerate() {
        match raw.get("kind").and_then(Value::as_str) {
            None | Some("Pod") => {
                let pod: Pod = item(what, i, &raw)?;
                let gpus = pod_gpus(what, i, &pod)?;
                pods.push((i, pod, raw, gpus));
            }
            Some("PersistentVolumeClaim") => {
                let c: PersistentVolumeClaim = item(what, i, &raw)?;
                let ns = c.metadata.namespace.unwrap_or_else(|| "default".into());
                let modes = if c.status.access_modes.is_empty() {
                    c.spec.access_modes
                } else {
                    c.status.access_modes
                };
                claims.insert((ns, c.metadata.name), modes);
            }
            Some(other) => {
                return Err(DrainPlanError::Field {
                    input: what.to_string(),
                    field: format!("items[{i}].kind"),
                    problem: format!(
                        "{other:?}: expected \"Pod\" or \"PersistentVolumeClaim\" (the output of `kubectl get pods,pvc -o json`)"
                    ),
                })
            }
        }
    }
    Ok(pods
        .into_iter()
        .map(|(index, pod, raw, gpus)| {
            let ns = pod
                .metadata
                .namespace
                .clone()
                .unwrap_or_else(|| "default".into());
            let claims = pod
                .spec
                .volumes
                .iter()
                .filter_map(|v| {
                    let src = v.persistent_volume_claim.as_ref()?;
                    Some(ClaimUse {
                        volume: v.name.clone(),
                        claim: src.claim_name.clone(),
                        read_only: src.read_only,
                        access_modes: claims.get(&(ns.clone(), src.claim_name.clone())).cloned(),
                    })
                })
                .collect();
            PodEntry {
                index,
                pod,
                raw,
                gpus,
                claims,
            }
        })
        .collect())
}

/// Parses `bytes` as a v1 List of Nodes.
pub fn parse_nodes(what: &str, bytes: &[u8]) -> Result<Vec<NodeEntry>, DrainPlanError> {
    let items = parse_list(what, bytes, "NodeList")?;
    let mut out = Vec::with_capacity(items.len());
    let mut seen = std::collections::BTreeSet::new();
    for (i, raw) in items.iter().enumerate() {
        let node: Node = item(what, i, raw)?;
        if !seen.insert(node.metadata.name.clone()) {
            return Err(DrainPlanError::Field {
                input: what.to_string(),
                field: format!("items[{i}].metadata.name"),
                problem: format!("node {:?} is listed twice", node.metadata.name),
            });
        }
        let status = &node.status;
        let gpus = match status.allocatable.get(GPU_RESOURCE) {
            Some(v) => quantity(
                what,
                &format!("items[{i}].status.allocatable[\"{GPU_RESOURCE}\"]"),
                v,
            )?,
            None => match status.capacity.get(GPU_RESOURCE) {
                Some(v) => quantity(
                    what,
                    &format!("items[{i}].status.capacity[\"{GPU_RESOURCE}\"]"),
                    v,
                )?,
                None => 0,
            },
        };
        out.push(NodeEntry {
            index: i,
            node,
            gpus,
        });
    }
    Ok(out)
}

/// The items of a v1 List (`kind: List`, as `kubectl get -o json` prints it, or `PodList` /
/// `NodeList` from the API server), after the checks every input gets.
fn parse_list(what: &str, bytes: &[u8], list_kind: &str) -> Result<Vec<Value>, DrainPlanError> {
    if bytes.len() > MAX_INPUT_BYTES {
        return Err(DrainPlanError::Input {
            input: what.to_string(),
            problem: format!(
                "{} bytes is more than the {} a pod or node list may be",
                bytes.len(),
                MAX_INPUT_BYTES
            ),
        });
    }
    let mut value: Value = serde_json::from_slice(bytes).map_err(|e| DrainPlanError::Input {
        input: what.to_string(),
        problem: format!("not JSON: {e}"),
    })?;
    let kind = value.get("kind").and_then(Value::as_str).unwrap_or("");
    if !value.is_object() {
        return Err(DrainPlanError::Field {
            input: what.to_string(),
            field: "(top level)".into(),
            problem: "expected an object (a v1 List, as `kubectl get -o json` prints)".into(),
        });
    }
    if kind != "List" && kind != list_kind {
        return Err(DrainPlanError::Field {
            input: what.to_string(),
            field: "kind".into(),
            problem: format!(
                "{kind:?}: expected \"List\" or \"{list_kind}\" (the output of `kubectl get {} -o json`)",
                if list_kind == "PodList" { "pods" } else { "nodes" }
            ),
        });
    }
    match value.get_mut("items").map(Value::take) {
        Some(Value::Array(items)) => Ok(items),
        Some(Value::Null) | None => Err(DrainPlanError::Field {
            input: what.to_string(),
            field: "items".into(),
            problem: "missing".into(),
        }),
        Some(other) => Err(DrainPlanError::Field {
            input: what.to_string(),
            field: "items".into(),
            problem: format!("expected a list, found {other}"),
        }),
    }
}

/// Item `i` of a list as a `T`; an error names the field under `items[i]`.
fn item<T: serde::de::DeserializeOwned>(
    what: &str,
    i: usize,
    raw: &Value,
) -> Result<T, DrainPlanError> {
    serde_path_to_error::deserialize(raw).map_err(|e| {
        let path = e.path().to_string();
        let path = if path.is_empty() || path == "." {
            format!("items[{i}]")
        } else {
            format!("items[{i}].{path}")
        };
        field_error(what, &path, &e.into_inner().to_string())
    })
}

/// serde's "missing field `x`" at `a.b` reads `a.b.x: missing`; anything else is kept with its
/// path.
fn field_error(what: &str, path: &str, msg: &str) -> DrainPlanError {
    let join = |p: &str, f: &str| {
        if p.is_empty() || p == "." {
            f.to_string()
        } else {
            format!("{p}.{f}")
        }
    };
    let msg_core = msg.split(" at line ").next().unwrap_or(msg);
    if let Some(rest) = msg_core.strip_prefix("missing field `") {
        let field = rest.trim_end_matches('`');
        return DrainPlanError::Field {
            input: what.to_string(),
            field: join(path, field),
            problem: "missing".into(),
        };
    }
    DrainPlanError::Field {
        input: what.to_string(),
        field: if path.is_empty() || path == "." {
            "(top level)".into()
        } else {
            path.to_string()
        },
        problem: msg_core.to_string(),
    }
}

/// A whole-number quantity (`"2"` or `2`), as extended resources are.
fn quantity(what: &str, field: &str, v: &Value) -> Result<u32, DrainPlanError> {
    let n = match v {
        Value::String(s) => s.trim().parse::<u32>().ok(),
        Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
        _ => None,
    };
    n.ok_or_else(|| DrainPlanError::Field {
        input: what.to_string(),
        field: field.to_string(),
        problem: format!("{v} is not a whole number of GPUs"),
    })
}

fn container_gpus(
    what: &str,
    base: &str,
    containers: &[Container],
) -> Result<Vec<u32>, DrainPlanError> {
    let mut out = Vec::with_capacity(containers.len());
    for (j, c) in containers.iter().enumerate() {
        let n = match c.resources.limits.get(GPU_RESOURCE) {
            Some(v) => quantity(
                what,
                &format!("{base}[{j}].resources.limits[\"{GPU_RESOURCE}\"]"),
                v,
            )?,
            None => match c.resources.requests.get(GPU_RESOURCE) {
                Some(v) => quantity(
                    what,
                    &format!("{base}[{j}].resources.requests[\"{GPU_RESOURCE}\"]"),
                    v,
                )?,
                None => 0,
            },
        };
        out.push(n);
    }
    Ok(out)
}

/// The pod's GPUs as the scheduler counts them: the sum over its containers, or the largest
/// init container's if that is more.
fn pod_gpus(what: &str, i: usize, pod: &Pod) -> Result<u32, DrainPlanError> {
    let main: u32 = container_gpus(
        what,
        &format!("items[{i}].spec.containers"),
        &pod.spec.containers,
    )?
    .into_iter()
    .fold(0u32, u32::saturating_add);
    let init = container_gpus(
        what,
        &format!("items[{i}].spec.initContainers"),
        &pod.spec.init_containers,
    )?
    .into_iter()
    .max()
    .unwrap_or(0);
    if pod.spec.containers.is_empty() {
        return Err(DrainPlanError::Field {
            input: what.to_string(),
            field: format!("items[{i}].spec.containers"),
            problem: "empty: a pod has at least one container".into(),
        });
    }
    Ok(main.max(init))
}

/// Whether the pod asks for MIG slices.
pub fn uses_mig(pod: &Pod) -> bool {
    pod.spec
        .containers
        .iter()
        .chain(pod.spec.init_containers.iter())
        .any(|c| {
            c.resources
                .limits
                .keys()
                .chain(c.resources.requests.keys())
                .any(|k| k.starts_with(MIG_RESOURCE_PREFIX))
        })
}
