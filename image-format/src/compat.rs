//! Can a checkpoint restore on this node? Same GPU model and count, the same driver branch (the
//! `580` of `580.65.06`) and CUDA driver version, same engine and model versions are required;
//! GPU UUIDs may differ and are remapped in order (checkpoint GPU i -> node GPU i). A node GPU
//! with less memory than the checkpointed one, or with less free memory than the checkpoint's
//! processes held on it, is also refused (the driver needs room for the restored allocations).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::manifest::{Devices, Gpu, Manifest, Workload};

/// What compatibility is decided on. Built from a manifest, from OCI annotations, or from a node's
/// inventory plus the versions the restoring pod declares.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub devices: Devices,
    pub workload: Workload,
}

impl Profile {
    pub fn from_manifest(m: &Manifest) -> Profile {
        Profile {
            devices: m.devices.clone(),
            workload: m.workload.clone(),
        }
    }

    /// A node's profile: its driver, CUDA driver version and `gpus` (the GPUs a container is
    /// given, in its order), with their free memory, from the node's inventory; the workload
    /// versions are the restoring pod's.
    pub fn from_inventory(
        inv: &gpu::NodeInventory,
        gpus: &[gpu::GpuUuid],
        workload: Workload,
    ) -> Profile {
        let pick: Vec<&gpu::GpuInfo> = gpus
            .iter()
            .filter_map(|u| inv.gpus.iter().find(|g| g.uuid == *u))
            .collect();
        Profile {
            devices: Devices {
                driver_version: inv.driver_version.clone(),
                cuda_driver_version: cuda_version_string(inv.cuda_driver_version),
                gpus: pick.iter().map(|g| gpu_entry(g)).collect(),
                processes: Vec::new(),
                node_gpus: inv.gpus.iter().map(gpu_entry).collect(),
            },
            workload,
        }
    }
}

/// `cuDriverGetVersion`'s 13000 as "13.0", as the manifest records it.
pub fn cuda_version_string(v: i32) -> String {
    if v <= 0 {
        String::new()
    } else {
        format!("{}.{}", v / 1000, (v % 1000) / 10)
    }
}

/// One GPU of the inventory as the manifest records it (with its free memory).
pub fn gpu_entry(g: &gpu::GpuInfo) -> Gpu {
    Gpu {
        uuid: g.uuid.to_string(),
        model: g.name.clone(),
        architecture: g.architecture.clone().unwrap_or_default(),
        memory_bytes: g.memory_total_bytes,
        pci_address: g.pci_bus_id.clone(),
        free_bytes: g.memory_free_bytes,
    }
}

/// The driver branch of a version: `580` of `580.65.06`.
pub fn driver_branch(v: &str) -> &str {
    v.split('.').next().unwrap_or(v)
}

/// One field that differs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Difference {
    /// Stable field id: `gpu_count`, `gpu_model`, `gpu_memory`, `driver_version`,
    /// `cuda_driver_version`, `engine_version`, `model_version`.
    pub field: String,
    /// For per-GPU fields, the GPU index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<usize>,
    /// Value in the checkpoint.
    pub checkpoint: String,
    /// Value on the node (or declared by the restoring pod).
    pub node: String,
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show = |s: &str| {
            if s.is_empty() {
                "(none)".to_string()
            } else {
                format!("{s:?}")
            }
        };
        match self.gpu {
            Some(i) => write!(
                f,
                "{} (gpu {i}): checkpoint {}, node {}",
                self.field,
                show(&self.checkpoint),
                show(&self.node)
            ),
            None => write!(
                f,
                "{}: checkpoint {}, node {}",
                self.field,
                show(&self.checkpoint),
                show(&self.node)
            ),
        }
    }
}

/// In a container's bundle: the GPUs it was given, as the createRuntime hook recorded them
/// (`gpu::assign::Assigned`), which the shim prefers to resolving the spec itself.
pub const BUNDLE_GPUS_FILE: &str = "gpu-ckpt-gpus.json";
/// In a container's bundle during a restore: the checkpoint's [`Devices`], which the prestart
/// hook holds to the container's GPUs before any restored process runs.
pub const BUNDLE_RESTORE_DEVICES_FILE: &str = "gpu-ckpt-restore-devices.json";

/// A UUID remapping pair.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuPair {
    pub old_uuid: String,
    pub new_uuid: String,
}

/// The verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    pub compatible: bool,
    /// Empty when compatible.
    pub differences: Vec<Difference>,
    /// Checkpointed GPU -> node GPU, for every GPU (also when UUIDs are equal). Empty when not
    /// compatible.
    pub gpu_map: Vec<GpuPair>,
}

impl Verdict {
    /// Pairs whose UUIDs actually change.
    pub fn remapped(&self) -> impl Iterator<Item = &GpuPair> {
        self.gpu_map.iter().filter(|p| p.old_uuid != p.new_uuid)
    }
}

fn diff(out: &mut Vec<Difference>, field: &str, gpu: Option<usize>, ckpt: &str, node: &str) {
    if ckpt != node {
        out.push(Difference {
            field: field.into(),
            gpu,
            checkpoint: ckpt.into(),
            node: node.into(),
        });
    }
}

/// Decide whether `checkpoint` can restore on `node`.
pub fn check(checkpoint: &Profile, node: &Profile) -> Verdict {
    let mut d = Vec::new();
    let (c, n) = (&checkpoint.devices, &node.devices);
    diff(
        &mut d,
        "gpu_count",
        None,
        &c.gpus.len().to_string(),
        &n.gpus.len().to_string(),
    );
    let needed = c.bytes_per_gpu();
    for (i, (cg, ng)) in c.gpus.iter().zip(n.gpus.iter()).enumerate() {
        diff(&mut d, "gpu_model", Some(i), &cg.model, &ng.model);
        if cg.memory_bytes > 0 && ng.memory_bytes > 0 && ng.memory_bytes < cg.memory_bytes {
            d.push(Difference {
                field: "gpu_memory".into(),
                gpu: Some(i),
                checkpoint: cg.memory_bytes.to_string(),
                node: ng.memory_bytes.to_string(),
            });
        }
        if let Some(free) = ng.free_bytes {
            if needed[i] > free {
                d.push(Difference {
                    field: "gpu_free_memory".into(),
                    gpu: Some(i),
                    checkpoint: needed[i].to_string(),
                    node: free.to_string(),
                });
            }
        }
    }
    if driver_branch(&c.driver_version) != driver_branch(&n.driver_version) {
        d.push(Difference {
            field: "driver_version".into(),
            gpu: None,
            checkpoint: c.driver_version.clone(),
            node: n.driver_version.clone(),
        });
    }
    diff(
        &mut d,
        "cuda_driver_version",
        None,
        &c.cuda_driver_version,
        &n.cuda_driver_version,
    );
    let (cw, nw) = (&checkpoint.workload, &node.workload);
    diff(
        &mut d,
        "engine_version",
        None,
        &cw.engine_version,
        &nw.engine_version,
    );
    diff(
        &mut d,
        "model_version",
        None,
        &cw.model_version,
        &nw.model_version,
    );
    let compatible = d.is_empty();
    let gpu_map = if compatible {
        c.gpus
            .iter()
            .zip(n.gpus.iter())
            .map(|(a, b)| GpuPair {
                old_uuid: a.uuid.clone(),
                new_uuid: b.uuid.clone(),
            })
            .collect()
    } else {
        Vec::new()
    };
    Verdict {
        compatible,
        differences: d,
        gpu_map,
    }
}

/// OCI annotation keys that carry the profile on an image manifest.
pub mod keys {
    pub const SCHEMA_VERSION: &str = "gpu-ckpt.io/manifest-schema-version";
    pub const MANIFEST_DIGEST: &str = "gpu-ckpt.io/manifest-digest";
    pub const GPU_COUNT: &str = "gpu-ckpt.io/gpu-count";
    /// JSON array of per-GPU objects {uuid, model, architecture, memory_bytes, pci_address}.
    pub const GPUS: &str = "gpu-ckpt.io/gpus";
    pub const GPU_MODEL: &str = "gpu-ckpt.io/gpu-model";
    pub const DRIVER_VERSION: &str = "gpu-ckpt.io/driver-version";
    pub const CUDA_DRIVER_VERSION: &str = "gpu-ckpt.io/cuda-driver-version";
    pub const ENGINE_VERSION: &str = "gpu-ckpt.io/engine-version";
    pub const MODEL_VERSION: &str = "gpu-ckpt.io/model-version";
    /// JSON array of the processes that held device state: {pid, gpus: [{uuid, bytes}]}.
    pub const DEVICE_BYTES: &str = "gpu-ckpt.io/device-processes";
}

/// The `gpu-ckpt.io/` annotations for a profile.
pub fn profile_annotations(p: &Profile) -> BTreeMap<String, String> {
    let mut a = BTreeMap::new();
    let models: Vec<&str> = p.devices.gpus.iter().map(|g| g.model.as_str()).collect();
    a.insert(keys::GPU_COUNT.into(), p.devices.gpus.len().to_string());
    a.insert(keys::GPU_MODEL.into(), models.join(","));
    a.insert(
        keys::GPUS.into(),
        serde_json::to_string(&p.devices.gpus).unwrap_or_default(),
    );
    a.insert(
        keys::DRIVER_VERSION.into(),
        p.devices.driver_version.clone(),
    );
    a.insert(
        keys::CUDA_DRIVER_VERSION.into(),
        p.devices.cuda_driver_version.clone(),
    );
    a.insert(
        keys::ENGINE_VERSION.into(),
        p.workload.engine_version.clone(),
    );
    a.insert(keys::MODEL_VERSION.into(), p.workload.model_version.clone());
    if !p.devices.processes.is_empty() {
        a.insert(
            keys::DEVICE_BYTES.into(),
            serde_json::to_string(&p.devices.processes).unwrap_or_default(),
        );
    }
    a
}

/// Rebuild a profile from annotations; `None` when the gpu-ckpt keys are absent or malformed.
pub fn profile_from_annotations(a: &BTreeMap<String, String>) -> Option<Profile> {
    let gpus: Vec<Gpu> = serde_json::from_str(a.get(keys::GPUS)?).ok()?;
    let count: usize = a.get(keys::GPU_COUNT)?.parse().ok()?;
    if count != gpus.len() {
        return None;
    }
    let get = |k: &str| a.get(k).cloned().unwrap_or_default();
    Some(Profile {
        devices: Devices {
            driver_version: get(keys::DRIVER_VERSION),
            cuda_driver_version: get(keys::CUDA_DRIVER_VERSION),
            gpus,
            processes: a
                .get(keys::DEVICE_BYTES)
                .and_then(|v| serde_json::from_str(v).ok())
                .unwrap_or_default(),
            node_gpus: Vec::new(),
        },
        workload: Workload {
            engine_version: get(keys::ENGINE_VERSION),
            model_version: get(keys::MODEL_VERSION),
        },
    })
}
