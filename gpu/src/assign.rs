//! Which GPUs a container was given, read from its OCI spec (the `config.json` after CDI
//! injection) and resolved through the node's inventory, in the order the container sees them.
//!
//! Two ways a GPU reaches a container, tried in this order:
//! 1. a CDI spec (nvidia-container-toolkit's, or any that presents GPUs the same way): a device
//!    node `/dev/nvidia<N>` per GPU, N being the GPU's minor number;
//! 2. the legacy `NVIDIA_VISIBLE_DEVICES` variable (`all`, `none`, `void`, or a comma-separated
//!    list of indices and UUIDs), which nvidia-container-runtime's hook reads.
//!
//! The shim maps checkpointed GPUs onto this list at restore, and the OCI hooks record it.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{GpuError, GpuUuid, NodeInventory};

/// The variable nvidia-container-runtime reads.
pub const VISIBLE_DEVICES_ENV: &str = "NVIDIA_VISIBLE_DEVICES";

/// How the container was given its GPUs. A record naming any other source (an older version's
/// `sim-cdi`) does not parse, and the error names the value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Source {
    DeviceNodes,
    VisibleDevices,
}

/// A container's GPUs, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assigned {
    pub source: Source,
    pub gpus: Vec<GpuUuid>,
}

/// The minor number of a GPU's device node path (`/dev/nvidia<N>`); None for any other path
/// (`/dev/nvidiactl`, `/dev/nvidia-uvm`, …).
pub fn gpu_node_minor(path: &str) -> Option<u32> {
    path.strip_prefix("/dev/nvidia")
        .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|n| n.parse().ok())
}

/// The GPUs the container whose spec is `spec` (a parsed `config.json`) was given. `None` when
/// it was given none.
pub fn from_spec(spec: &Value, inv: &NodeInventory) -> Result<Option<Assigned>, GpuError> {
    // 1. NVIDIA device nodes, by minor number.
    let mut gpus = Vec::new();
    for d in spec["linux"]["devices"].as_array().into_iter().flatten() {
        let Some(minor) = d["path"].as_str().and_then(gpu_node_minor) else {
            continue;
        };
        let gpu = inv
            .gpus
            .iter()
            .find(|g| g.minor_number.unwrap_or(g.index) == minor)
            .ok_or_else(|| {
                GpuError::InvalidArgument(format!(
                    "the container has /dev/nvidia{minor}, but no GPU on this node has minor number {minor}"
                ))
            })?;
        if !gpus.contains(&gpu.uuid) {
            gpus.push(gpu.uuid);
        }
    }
    if !gpus.is_empty() {
        return Ok(Some(Assigned {
            source: Source::DeviceNodes,
            gpus,
        }));
    }
    // 2. NVIDIA_VISIBLE_DEVICES.
    match visible_devices(spec).map(str::trim) {
        None | Some("" | "none" | "void") => Ok(None),
        Some("all") => Ok(Some(Assigned {
            source: Source::VisibleDevices,
            gpus: inv.gpus.iter().map(|g| g.uuid).collect(),
        })),
        Some(list) => {
            for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                let uuid = if let Ok(i) = item.parse::<u32>() {
                    inv.gpus
                        .iter()
                        .find(|g| g.index == i)
                        .map(|g| g.uuid)
                        .ok_or_else(|| {
                            GpuError::InvalidArgument(format!(
                                "{VISIBLE_DEVICES_ENV} names GPU {i}, but this node has {} GPUs",
                                inv.gpus.len()
                            ))
                        })?
                } else if item.starts_with("MIG-") || item.contains(':') {
                    return Err(GpuError::InvalidArgument(format!(
                        "{VISIBLE_DEVICES_ENV} names MIG device {item:?}: gpu-ckpt does not checkpoint MIG instances"
                    )));
                } else {
                    let uuid: GpuUuid = item.parse()?;
                    known(inv, &uuid, VISIBLE_DEVICES_ENV)?;
                    uuid
                };
                if !gpus.contains(&uuid) {
                    gpus.push(uuid);
                }
            }
            Ok((!gpus.is_empty()).then_some(Assigned {
                source: Source::VisibleDevices,
                gpus,
            }))
        }
    }
}

/// Where nvidia-container-toolkit's CDI spec puts a MIG instance's device nodes
/// (`nvidia-cap<N>`, one for its GPU instance and one for its compute instance).
pub const MIG_CAPS_DIR: &str = "/dev/nvidia-caps/";

/// Whether `path` is a MIG instance's device node.
pub fn is_mig_node(path: &str) -> bool {
    path.strip_prefix(MIG_CAPS_DIR)
        .is_some_and(|n| n.starts_with("nvidia-cap"))
}

/// How the container whose spec is `spec` uses MIG, when it does: a MIG device node it is given,
/// a MIG device its `NVIDIA_VISIBLE_DEVICES` names, or one of its GPUs ([`from_spec`]) in MIG
/// mode (through CDI a MIG instance brings its whole parent GPU's device node). `None` when it
/// uses none, or when its GPUs cannot be resolved (the checkpoint's record step says why).
pub fn mig_use(spec: &Value, inv: &NodeInventory) -> Option<String> {
    if let Some(path) = spec["linux"]["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| d["path"].as_str())
        .find(|p| is_mig_node(p))
    {
        return Some(format!("the container is given MIG device node {path}"));
    }
    if let Some(item) = visible_devices(spec)
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .find(|i| i.starts_with("MIG-") || i.contains(':'))
    {
        return Some(format!("{VISIBLE_DEVICES_ENV} names MIG device {item:?}"));
    }
    let Ok(Some(a)) = from_spec(spec, inv) else {
        return None;
    };
    let how = match a.source {
        Source::DeviceNodes => "its device node",
        Source::VisibleDevices => VISIBLE_DEVICES_ENV,
    };
    inv.gpus
        .iter()
        .find(|g| g.mig_enabled == Some(true) && a.gpus.contains(&g.uuid))
        .map(|g| {
            format!(
                "it is given GPU {} (index {}) through {how}, and that GPU is in MIG mode",
                g.uuid, g.index
            )
        })
}

/// The spec's `NVIDIA_VISIBLE_DEVICES` (the last one wins, as in a process environment).
fn visible_devices(spec: &Value) -> Option<&str> {
    spec["process"]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .filter_map(|e| e.strip_prefix(VISIBLE_DEVICES_ENV)?.strip_prefix('='))
        .next_back()
}

fn known(inv: &NodeInventory, uuid: &GpuUuid, from: &str) -> Result<(), GpuError> {
    if inv.gpus.iter().any(|g| g.uuid == *uuid) {
        Ok(())
    } else {
        Err(GpuError::InvalidArgument(format!(
            "the container is given GPU {uuid} ({from}), which is not on this node"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GpuInfo;
    use serde_json::json;

    #[test]
    fn only_a_gpus_own_node_has_a_minor() {
        assert_eq!(gpu_node_minor("/dev/nvidia0"), Some(0));
        assert_eq!(gpu_node_minor("/dev/nvidia17"), Some(17));
        for other in [
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/nvidia",
            "/dev/nvidia1x",
            "/dev/nvidia-caps/nvidia-cap1",
        ] {
            assert_eq!(gpu_node_minor(other), None, "{other}");
        }
    }

    fn inv() -> NodeInventory {
        let gpu = |i: u32, minor: u32| GpuInfo {
            index: i,
            uuid: GpuUuid([i as u8 + 1; 16]),
            name: "Sim".into(),
            architecture: None,
            compute_capability: None,
            memory_total_bytes: 1 << 30,
            memory_free_bytes: None,
            minor_number: Some(minor),
            pci_bus_id: String::new(),
            persistence_mode: None,
            mig_enabled: None,
        };
        NodeInventory {
            driver_version: "580.65.06".into(),
            cuda_driver_version: 13000,
            gpus: vec![gpu(0, 4), gpu(1, 5), gpu(2, 6)],
        }
    }

    #[test]
    fn device_nodes_by_minor_number() {
        let inv = inv();
        let spec = json!({"linux": {"devices": [
            {"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia6"}, {"path": "/dev/nvidia-uvm"},
            {"path": "/dev/nvidia4"},
        ]}});
        let got = from_spec(&spec, &inv).unwrap().unwrap();
        assert_eq!(got.gpus, vec![inv.gpus[2].uuid, inv.gpus[0].uuid]);
        let spec = json!({"linux": {"devices": [{"path": "/dev/nvidia9"}]}});
        let err = from_spec(&spec, &inv).unwrap_err().to_string();
        assert!(err.contains("/dev/nvidia9"), "{err}");
    }

    #[test]
    fn a_record_of_a_source_that_no_longer_exists_is_refused_naming_it() {
        // The simulator's former per-GPU files, which an older hook recorded.
        let old = r#"{"source":"sim-cdi","gpus":[],"container_paths":["/x"]}"#;
        let err = serde_json::from_str::<Assigned>(old)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("sim-cdi") && err.contains("device-nodes"),
            "{err}"
        );
    }

    #[test]
    fn mig_however_assigned() {
        let mut inv = inv();
        let nodes = json!({"linux": {"devices": [{"path": "/dev/nvidia5"}]}});
        let env = json!({"process": {"env": ["NVIDIA_VISIBLE_DEVICES=0"]}});
        assert_eq!(mig_use(&nodes, &inv), None);
        assert_eq!(mig_use(&env, &inv), None);
        inv.gpus[1].mig_enabled = Some(true);
        let why = mig_use(&nodes, &inv).unwrap();
        assert!(why.contains(&inv.gpus[1].uuid.to_string()), "{why}");
        assert!(
            why.contains("MIG mode") && why.contains("device node"),
            "{why}"
        );
        assert_eq!(mig_use(&env, &inv), None, "GPU 0 is not in MIG mode");
        let env1 =
            json!({"process": {"env": [format!("NVIDIA_VISIBLE_DEVICES={}", inv.gpus[1].uuid)]}});
        let why = mig_use(&env1, &inv).unwrap();
        assert!(why.contains("NVIDIA_VISIBLE_DEVICES"), "{why}");
        let caps = json!({"linux": {"devices": [
            {"path": "/dev/nvidia-caps/nvidia-cap21"}, {"path": "/dev/nvidia4"},
        ]}});
        let why = mig_use(&caps, &inv).unwrap();
        assert!(why.contains("/dev/nvidia-caps/nvidia-cap21"), "{why}");
        let mig = json!({"process": {"env": ["NVIDIA_VISIBLE_DEVICES=MIG-0c7e9c4b-aaaa"]}});
        assert!(mig_use(&mig, &inv).unwrap().contains("MIG-0c7e9c4b-aaaa"));
        assert!(!is_mig_node("/dev/nvidia-caps"));
        assert!(!is_mig_node("/dev/nvidiactl"));
    }

    #[test]
    fn visible_devices_forms() {
        let inv = inv();
        let env = |v: &str| json!({"process": {"env": [format!("NVIDIA_VISIBLE_DEVICES={v}")]}});
        assert_eq!(from_spec(&env("all"), &inv).unwrap().unwrap().gpus.len(), 3);
        assert!(from_spec(&env("none"), &inv).unwrap().is_none());
        assert!(from_spec(&json!({}), &inv).unwrap().is_none());
        let u1 = inv.gpus[1].uuid;
        let got = from_spec(&env(&format!("2,{u1}")), &inv).unwrap().unwrap();
        assert_eq!(got.gpus, vec![inv.gpus[2].uuid, u1]);
        let err = from_spec(&env("7"), &inv).unwrap_err().to_string();
        assert!(err.contains("GPU 7"), "{err}");
        let err = from_spec(&env("MIG-1234"), &inv).unwrap_err().to_string();
        assert!(err.contains("MIG"), "{err}");
        let other = GpuUuid([0xee; 16]);
        let err = from_spec(&env(&other.to_string()), &inv)
            .unwrap_err()
            .to_string();
        assert!(err.contains("not on this node"), "{err}");
    }
}
