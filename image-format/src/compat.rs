//! Can a checkpoint restore on this node? Same GPU model and count, the same driver branch (the
//! `580` of `580.65.06`) and CUDA driver version, same engine and model versions are required;
//! a checkpoint whose processes mapped the driver's files ([`Devices::driver_files`]) needs the
//! same full driver version, and the same files where the node's are known
//! ([`driver_file_differences`]);
//! GPU UUIDs may differ and are remapped in order (checkpoint GPU i -> node GPU i). A node GPU
//! with less memory than the checkpointed one, or with less free memory than the checkpoint's
//! processes held on it, is also refused (the driver needs room for the restored allocations).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::driver_files::{name_under, version_of};
use crate::manifest::{Devices, DriverFile, Gpu, Manifest, Workload};

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
                driver_files: Vec::new(),
                storage: String::new(),
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
    /// `driver_file`, `cuda_driver_version`, `engine_version`, `model_version`.
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
    d.extend(driver_differences(c, n));
    diff(
        &mut d,
        "cuda_driver_version",
        None,
        &c.cuda_driver_version,
        &n.cuda_driver_version,
    );
    d.extend(workload_differences(&checkpoint.workload, &node.workload));
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

/// The engine and model versions the checkpoint recorded against those the restoring pod
/// declares (`gpu-ckpt.io/engine-version`, `gpu-ckpt.io/model-version`): equal, or absent on both.
pub fn workload_differences(checkpoint: &Workload, node: &Workload) -> Vec<Difference> {
    let mut d = Vec::new();
    diff(
        &mut d,
        "engine_version",
        None,
        &checkpoint.engine_version,
        &node.engine_version,
    );
    diff(
        &mut d,
        "model_version",
        None,
        &checkpoint.model_version,
        &node.model_version,
    );
    d
}

/// The GPUs a restoring container gets on a node, as [`restore_check`] reads them.
#[derive(Debug, Clone, Copy)]
pub enum NodeGpus<'a> {
    /// The node has no NVIDIA driver.
    NoDriver,
    /// The node's inventory and the GPUs the container is given, in its order.
    Given(&'a gpu::NodeInventory, &'a [gpu::GpuUuid]),
    /// Only a profile of the GPUs the container is given (OCI annotations, a recorded
    /// profile): no MIG modes.
    Profile(&'a Devices),
}

/// What [`restore_check`] decided.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoreCheck {
    /// [`check`]'s verdict on the GPUs (not compatible where `refusal` is set).
    #[serde(flatten)]
    pub verdict: Verdict,
    /// A refusal no field difference holds: the node has no driver, or a GPU given is in MIG
    /// mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal: Option<String>,
}

impl RestoreCheck {
    fn of(verdict: Verdict) -> RestoreCheck {
        RestoreCheck {
            verdict,
            refusal: None,
        }
    }

    fn refused(why: String) -> RestoreCheck {
        RestoreCheck {
            verdict: Verdict {
                compatible: false,
                differences: Vec::new(),
                gpu_map: Vec::new(),
            },
            refusal: Some(why),
        }
    }

    pub fn compatible(&self) -> bool {
        self.refusal.is_none() && self.verdict.compatible
    }

    /// Why not, one line each: the refusal, then each difference (`field: checkpoint …, node …`).
    pub fn reasons(&self) -> Vec<String> {
        self.refusal
            .iter()
            .cloned()
            .chain(self.verdict.differences.iter().map(Difference::to_string))
            .collect()
    }
}

/// The rule a restore holds a checkpoint's GPUs to before CRIU runs: the shim's compatibility
/// step, and `gpu-ckpt compat` and `inspect`. A checkpoint without GPUs needs nothing of the
/// node's (neither a driver nor its versions); one with GPUs needs a driver, none of the GPUs
/// given in MIG mode, and [`check`]'s fields to match. The workload versions are not part of
/// it ([`workload_differences`]: the restoring pod declares them).
pub fn restore_check(checkpoint: &Devices, node: NodeGpus<'_>) -> RestoreCheck {
    if checkpoint.gpus.is_empty() {
        return RestoreCheck::of(Verdict {
            compatible: true,
            differences: Vec::new(),
            gpu_map: Vec::new(),
        });
    }
    let devices = match node {
        NodeGpus::NoDriver => {
            return RestoreCheck::refused(format!(
                "gpu_count: checkpoint {}, node 0 (no NVIDIA driver on this node)",
                checkpoint.gpus.len()
            ))
        }
        NodeGpus::Given(inv, gpus) => {
            if let Some(why) = onto_mig(inv, gpus) {
                return RestoreCheck::refused(why);
            }
            Profile::from_inventory(inv, gpus, Workload::default()).devices
        }
        NodeGpus::Profile(d) => d.clone(),
    };
    let profile = |devices: Devices| Profile {
        devices,
        workload: Workload::default(),
    };
    RestoreCheck::of(check(&profile(checkpoint.clone()), &profile(devices)))
}

/// The refusal a MIG-mode GPU among `gpus` (a container's, on this node) makes at a restore.
pub fn onto_mig(inv: &gpu::NodeInventory, gpus: &[gpu::GpuUuid]) -> Option<String> {
    let g = inv
        .gpus
        .iter()
        .find(|g| g.mig_enabled == Some(true) && gpus.contains(&g.uuid))?;
    Some(format!(
        "mig: checkpoint on GPUs without MIG, node GPU {} (index {}) in MIG mode (the CUDA driver cannot restore onto a MIG instance)",
        g.uuid, g.index
    ))
}

/// The driver's version and files: the same branch, or, for a checkpoint that maps the driver's
/// files, the same full version and files ([`driver_file_differences`]).
fn driver_differences(c: &Devices, n: &Devices) -> Vec<Difference> {
    let mut d = Vec::new();
    let exact = !c.driver_files.is_empty() && c.driver_version != n.driver_version;
    if exact || driver_branch(&c.driver_version) != driver_branch(&n.driver_version) {
        d.push(Difference {
            field: "driver_version".into(),
            gpu: None,
            checkpoint: c.driver_version.clone(),
            node: n.driver_version.clone(),
        });
    }
    let node_files = (!n.driver_files.is_empty()).then_some(n.driver_files.as_slice());
    d.extend(driver_file_differences(c, &n.driver_version, node_files));
    d
}

/// The driver files `checkpoint` recorded that a node with driver `node_version` does not give
/// its container alike, one `driver_file` difference each. `node_files`: the driver files the
/// restoring container gets (path in the container, size, build id), where known (the shim reads
/// them from the container's spec); otherwise the node's files are taken to be the ones its
/// driver version names (`libcuda.so.<version>`), so only the version is compared. Empty when
/// the checkpoint recorded no driver files (an older manifest, or no GPU process).
pub fn driver_file_differences(
    checkpoint: &Devices,
    node_version: &str,
    node_files: Option<&[DriverFile]>,
) -> Vec<Difference> {
    let ck_version = &checkpoint.driver_version;
    let mut out = Vec::new();
    for r in &checkpoint.driver_files {
        let node = match node_files {
            None if node_version == ck_version => continue,
            None => match name_under(&r.path, node_version) {
                Some(name) => format!("driver {} ({name})", show_version(node_version)),
                None => format!("driver {}", show_version(node_version)),
            },
            Some(files) => match files.iter().find(|f| f.path == r.path) {
                Some(f) if f.size == r.size && f.build_id == r.build_id => continue,
                Some(f) => format!("{} ({})", f.path, file_identity(f)),
                None => gets_instead(r, files, node_version),
            },
        };
        let checkpoint = if node_files.is_some() && node.starts_with(&r.path) {
            format!("{} ({})", r.path, file_identity(r))
        } else {
            format!("{} (driver {})", r.path, show_version(ck_version))
        };
        out.push(Difference {
            field: "driver_file".into(),
            gpu: None,
            checkpoint,
            node,
        });
    }
    out
}

fn show_version(v: &str) -> &str {
    if v.is_empty() {
        "(unknown)"
    } else {
        v
    }
}

/// `123 bytes, build id abcd`.
fn file_identity(f: &DriverFile) -> String {
    let id = if f.build_id.is_empty() {
        "none"
    } else {
        &f.build_id
    };
    format!("{} bytes, build id {id}", f.size)
}

/// What the restoring container gets instead of `r`: `driver 580.65.07 (libcuda.so.580.65.07)`,
/// from its driver files of the same library, or that it gets none.
fn gets_instead(r: &DriverFile, files: &[DriverFile], node_version: &str) -> String {
    let name = r.path.rsplit('/').next().unwrap_or(&r.path);
    let stem = name.split_once(".so.").map_or(name, |(s, _)| s);
    let same_lib: Vec<&DriverFile> = files
        .iter()
        .filter(|f| {
            let n = f.path.rsplit('/').next().unwrap_or(&f.path);
            n.split_once(".so.").is_some_and(|(s, _)| s == stem)
        })
        .collect();
    let Some(first) = same_lib.first() else {
        return format!(
            "no {stem}.so.* file (driver {})",
            show_version(node_version)
        );
    };
    let version = version_of(&first.path).unwrap_or(node_version);
    let names: Vec<&str> = same_lib
        .iter()
        .map(|f| f.path.rsplit('/').next().unwrap_or(&f.path))
        .collect();
    format!("driver {} ({})", show_version(version), names.join(", "))
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
    /// JSON array of the driver files those processes mapped: {path, size, build_id}.
    pub const DRIVER_FILES: &str = "gpu-ckpt.io/driver-files";
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
    if !p.devices.driver_files.is_empty() {
        a.insert(
            keys::DRIVER_FILES.into(),
            serde_json::to_string(&p.devices.driver_files).unwrap_or_default(),
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
            driver_files: a
                .get(keys::DRIVER_FILES)
                .and_then(|v| serde_json::from_str(v).ok())
                .unwrap_or_default(),
            storage: String::new(),
        },
        workload: Workload {
            engine_version: get(keys::ENGINE_VERSION),
            model_version: get(keys::MODEL_VERSION),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIB: &str = "/usr/lib/x86_64-linux-gnu";

    fn file(name: &str, size: u64, id: &str) -> DriverFile {
        DriverFile {
            path: format!("{LIB}/{name}"),
            size,
            build_id: id.into(),
        }
    }

    fn profile(version: &str, files: Vec<DriverFile>) -> Profile {
        Profile {
            devices: Devices {
                driver_version: version.into(),
                cuda_driver_version: "13.0".into(),
                gpus: vec![Gpu {
                    uuid: "GPU-1".into(),
                    model: "NVIDIA H100 80GB HBM3".into(),
                    ..Gpu::default()
                }],
                driver_files: files,
                ..Devices::default()
            },
            workload: Workload::default(),
        }
    }

    fn inventory(mig: bool) -> gpu::NodeInventory {
        gpu::NodeInventory {
            driver_version: "580.65.06".into(),
            cuda_driver_version: 13000,
            gpus: vec![gpu::GpuInfo {
                index: 0,
                uuid: gpu::GpuUuid([1; 16]),
                name: "NVIDIA H100 80GB HBM3".into(),
                architecture: None,
                compute_capability: None,
                memory_total_bytes: 0,
                memory_free_bytes: None,
                minor_number: Some(0),
                pci_bus_id: String::new(),
                persistence_mode: None,
                mig_enabled: Some(mig),
            }],
        }
    }

    #[test]
    fn the_restore_rule_asks_nothing_of_a_node_for_a_checkpoint_without_gpus() {
        let none = Devices::default();
        let with = profile("580.65.06", vec![]).devices;
        assert!(restore_check(&none, NodeGpus::NoDriver).compatible());
        assert!(restore_check(&none, NodeGpus::Profile(&with)).compatible());
        let r = restore_check(&with, NodeGpus::NoDriver);
        assert!(!r.compatible());
        assert_eq!(
            r.reasons(),
            ["gpu_count: checkpoint 1, node 0 (no NVIDIA driver on this node)"]
        );
        assert!(restore_check(&with, NodeGpus::Profile(&with)).compatible());
    }

    #[test]
    fn a_restore_onto_a_mig_mode_gpu_is_refused() {
        let uuid = gpu::GpuUuid([1; 16]);
        let ck = profile("580.65.06", vec![]).devices;
        assert_eq!(onto_mig(&inventory(false), &[uuid]), None);
        assert_eq!(onto_mig(&inventory(true), &[]), None);
        let r = restore_check(&ck, NodeGpus::Given(&inventory(true), &[uuid]));
        let why = r.refusal.clone().unwrap();
        assert!(
            why.starts_with("mig: ") && why.contains(&uuid.to_string()),
            "{why}"
        );
        assert!(!r.compatible());
        let r = restore_check(&ck, NodeGpus::Given(&inventory(false), &[uuid]));
        assert!(r.compatible(), "{:?}", r.reasons());
    }

    #[test]
    fn a_checkpoint_that_maps_driver_files_needs_the_exact_version() {
        let ck = profile("580.65.06", vec![file("libcuda.so.580.65.06", 100, "aa")]);
        assert!(check(&ck, &profile("580.65.06", vec![])).compatible);
        let v = check(&ck, &profile("580.65.07", vec![]));
        let text: Vec<String> = v.differences.iter().map(|d| d.to_string()).collect();
        assert_eq!(
            text,
            [
                r#"driver_version: checkpoint "580.65.06", node "580.65.07""#,
                r#"driver_file: checkpoint "/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06 (driver 580.65.06)", node "driver 580.65.07 (libcuda.so.580.65.07)""#
            ]
        );
        // Without recorded files (an older manifest), the branch rule.
        let old = profile("580.65.06", vec![]);
        assert!(check(&old, &profile("580.65.07", vec![])).compatible);
        assert!(!check(&old, &profile("575.57.08", vec![])).compatible);
    }

    #[test]
    fn the_containers_files_are_held_to_the_recorded_ones() {
        let (cuda, nvml) = ("libcuda.so.580.65.06", "libnvidia-ml.so.580.65.06");
        let ck = profile("580.65.06", vec![file(cuda, 100, "aa"), file(nvml, 50, "")]);
        // Each case: what the container gets, and the (checkpoint, node) of each difference.
        type Pairs = Vec<(String, String)>;
        let cases: Vec<(Vec<DriverFile>, Pairs)> = vec![
            // The same files, in another order.
            (vec![file(nvml, 50, ""), file(cuda, 100, "aa")], vec![]),
            // Another build at the same path.
            (
                vec![file(cuda, 100, "bb"), file(nvml, 50, "")],
                vec![(
                    format!("{LIB}/{cuda} (100 bytes, build id aa)"),
                    format!("{LIB}/{cuda} (100 bytes, build id bb)"),
                )],
            ),
            // Another version: each file named, with what the container gets instead.
            (
                vec![
                    file("libcuda.so.580.65.07", 100, "cc"),
                    file("libnvidia-ml.so.580.65.07", 50, ""),
                ],
                vec![
                    (
                        format!("{LIB}/{cuda} (driver 580.65.06)"),
                        "driver 580.65.07 (libcuda.so.580.65.07)".into(),
                    ),
                    (
                        format!("{LIB}/{nvml} (driver 580.65.06)"),
                        "driver 580.65.07 (libnvidia-ml.so.580.65.07)".into(),
                    ),
                ],
            ),
            // No NVML at all.
            (
                vec![file(cuda, 100, "aa")],
                vec![(
                    format!("{LIB}/{nvml} (driver 580.65.06)"),
                    "no libnvidia-ml.so.* file (driver (unknown))".into(),
                )],
            ),
        ];
        for (gets, want) in cases {
            let got: Vec<(String, String)> = driver_file_differences(&ck.devices, "", Some(&gets))
                .into_iter()
                .map(|d| {
                    assert_eq!(d.field, "driver_file");
                    (d.checkpoint, d.node)
                })
                .collect();
            assert_eq!(got, want, "{gets:?}");
        }
    }

    #[test]
    fn driver_files_travel_in_annotations() {
        let ck = profile("580.65.06", vec![file("libcuda.so.580.65.06", 100, "aa")]);
        let back = profile_from_annotations(&profile_annotations(&ck)).unwrap();
        assert_eq!(back.devices.driver_files, ck.devices.driver_files);
    }
}
