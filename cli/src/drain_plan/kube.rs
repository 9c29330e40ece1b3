//! The parts of `kubectl get pods -o json` and `kubectl get nodes -o json` a drain plan reads.
//!
//! Input is hostile: it is parsed into these types with the path of every field tracked
//! (`serde_path_to_error`), so a bad document gets one line naming the field
//! (`pods.json: items[3].spec.containers: missing`). Fields not named here are ignored; the
//! raw JSON of each pod is kept to write its restore pod from.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

use super::DrainPlanError;

/// The NVIDIA device plugin's extended resource.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// MIG slices are advertised as `nvidia.com/mig-<profile>` (mixed strategy).
pub const MIG_RESOURCE_PREFIX: &str = "nvidia.com/mig-";

/// A v1 List (`kind: List`, as `kubectl get -o json` prints it, or `PodList` / `NodeList` from
/// the API server).
#[derive(Debug, Deserialize)]
pub(crate) struct List<T> {
    pub items: Vec<T>,
}

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
    pub persistent_volume_claim: Option<Value>,
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

/// Parses `bytes` as a v1 List of Pods; `what` names the input in errors (its file name).
pub fn parse_pods(what: &str, bytes: &[u8]) -> Result<Vec<PodEntry>, DrainPlanError> {
    let (raw_items, list) = parse_list::<Pod>(what, bytes, "PodList")?;
    let mut out = Vec::with_capacity(list.items.len());
    for (i, (pod, raw)) in list.items.into_iter().zip(raw_items).enumerate() {
        let gpus = pod_gpus(what, i, &pod)?;
        out.push(PodEntry {
            index: i,
            pod,
            raw,
            gpus,
        });
    }
    Ok(out)
}

/// Parses `bytes` as a v1 List of Nodes.
pub fn parse_nodes(what: &str, bytes: &[u8]) -> Result<Vec<NodeEntry>, DrainPlanError> {
    let (_, list) = parse_list::<Node>(what, bytes, "NodeList")?;
    let mut out = Vec::with_capacity(list.items.len());
    let mut seen = std::collections::BTreeSet::new();
    for (i, node) in list.items.into_iter().enumerate() {
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

fn parse_list<T: serde::de::DeserializeOwned>(
    what: &str,
    bytes: &[u8],
    list_kind: &str,
) -> Result<(Vec<Value>, List<T>), DrainPlanError> {
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
    let value: Value = serde_json::from_slice(bytes).map_err(|e| DrainPlanError::Input {
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
    let list: List<T> = serde_path_to_error::deserialize(&value).map_err(|e| {
        let path = e.path().to_string();
        field_error(what, &path, &e.into_inner().to_string())
    })?;
    let raw = match value.get("items").and_then(Value::as_array) {
        Some(a) => a.clone(),
        None => Vec::new(),
    };
    Ok((raw, list))
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
