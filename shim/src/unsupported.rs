//! What the CUDA driver's checkpoint API cannot do, refused before any device lock, so that the
//! container runs on untouched:
//!
//! - MIG: a container given a MIG instance (its device nodes `/dev/nvidia-caps/nvidia-cap*`, a
//!   `MIG-…` in `NVIDIA_VISIBLE_DEVICES`), given a GPU that NVML reports in MIG mode however it
//!   was given it, or with a process that holds such a GPU or a MIG device node;
//! - NCCL without gpu-ckpt's NCCL layer: a process holding device state that maps
//!   `libnccl.so*` (the driver's lock can hang on its communicators' proxy threads and peer
//!   mappings), unless it also maps the layer (`libgpu-ckpt-nccl.so`, by the file name of a
//!   mapping) and the container opted in (`gpu-ckpt.io/nccl: managed`, `nccl::inject`): then
//!   the layer quiesces and releases its communicators before the device steps (`nccl`, which
//!   also refuses such a process that has no control session);
//! - MPS: a process of the container that NVML lists as an MPS client (its device state lives in
//!   the MPS server, which is not the container's).
//!
//! Called once per checkpoint or Pause, between finding the holders and locking them
//! (`device.rs`, `ContainerDevices::quiesce`). At a restore, a MIG-mode GPU among the
//! container's is a refusal of the compatibility check, before CRIU
//! (`image_format::compat::onto_mig`).

use std::sync::Arc;

use gpu::{ComputeProcess, GpuUuid, Inventory, NodeInventory};
use serde_json::{json, Value};
use tracing::info_span;

use crate::error::{Error, Result};

/// A process of the container as the device steps know it (`device::Holder`).
pub trait Process: Sized {
    fn pid(&self) -> i32;
    /// The GPUs it has a context on.
    fn gpus(&self) -> Vec<GpuUuid>;
    /// `pid 1234 (gpu-train, pid 1 in the container) holding GPU-…`, for messages.
    fn describe(&self) -> String;
    /// Process `pid` of the container on `gpus`, that holds no state the driver checkpoints.
    fn other(pid: i32, gpus: Vec<GpuUuid>) -> Self;
}

/// What of a container's spec says how it was given GPUs: its device nodes and its process's
/// environment (empty for a container whose spec was not read); and whether it got gpu-ckpt's
/// NCCL layer.
#[derive(Clone, Debug, Default)]
pub struct Given {
    spec: Arc<Value>,
    nccl_managed: bool,
}

impl Given {
    /// The device nodes and environment of `spec` (a parsed `config.json`, after CDI).
    pub fn from_spec(spec: &Value) -> Given {
        Given {
            spec: Arc::new(json!({
                "linux": {"devices": spec["linux"]["devices"].clone()},
                "process": {"env": spec["process"]["env"].clone()},
            })),
            nccl_managed: false,
        }
    }

    /// The same, for a container that got gpu-ckpt's NCCL layer (`managed`) or not.
    pub fn nccl_managed(mut self, managed: bool) -> Given {
        self.nccl_managed = managed;
        self
    }
}

/// Refuses, naming what and why, a checkpoint of the container given `given`, whose processes
/// are `pids` (host pids) and whose device-state holders are `holders`, when the driver cannot
/// checkpoint it. Nothing is locked yet: on refusal the container runs on as it was.
pub fn refuse<P: Process>(
    nvml: &dyn Inventory,
    given: &Given,
    pids: &[i32],
    holders: &[P],
) -> Result<()> {
    let _span = info_span!("device_unsupported", processes = pids.len()).entered();
    let inv = nvml
        .node()
        .map_err(|e| refusal(format!("reading the node's GPUs: {e}")))?;
    if let Some(why) = mig(&inv, given, pids, holders) {
        return Err(refusal(format!(
            "{why}: the CUDA driver cannot checkpoint MIG instances; the container runs on untouched"
        )));
    }
    for h in holders {
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", h.pid())).unwrap_or_default();
        if let Some(lib) = unmanaged_nccl(&maps, given.nccl_managed) {
            return Err(refusal(format!(
                "{} maps NCCL ({lib}) without gpu-ckpt's NCCL layer: set the annotation {}: managed (or the handler option Nccl = \"managed\") and start the container again; the container runs on untouched",
                h.describe(),
                crate::annotations::NCCL,
            )));
        }
    }
    let mps = nvml
        .mps_processes()
        .map_err(|e| refusal(format!("listing the node's MPS clients: {e}")))?;
    if let Some(c) = mps_client(&mps, pids) {
        return Err(refusal(format!(
            "{} is an MPS client: the CUDA driver cannot checkpoint a process whose GPU work runs in the MPS server; the container runs on untouched",
            P::other(c.pid as i32, vec![c.gpu]).describe()
        )));
    }
    Ok(())
}

fn refusal(message: String) -> Error {
    Error::Step {
        operation: "checkpoint",
        step: "unsupported",
        message,
    }
}

/// Why the container uses MIG, if it does (see the module's documentation).
fn mig<P: Process>(
    inv: &NodeInventory,
    given: &Given,
    pids: &[i32],
    holders: &[P],
) -> Option<String> {
    if let Some(why) = gpu::assign::mig_use(&given.spec, inv) {
        return Some(why);
    }
    let in_mig = |u: &GpuUuid| {
        inv.gpus
            .iter()
            .any(|g| g.uuid == *u && g.mig_enabled == Some(true))
    };
    for h in holders {
        if let Some(u) = h.gpus().into_iter().find(in_mig) {
            return Some(format!(
                "{} is on GPU {u}, which is in MIG mode",
                h.describe()
            ));
        }
    }
    pids.iter().find_map(|&pid| {
        let node = mig_node_held(pid)?;
        Some(format!(
            "{} holds MIG device node {node}",
            P::other(pid, Vec::new()).describe()
        ))
    })
}

/// A MIG device node among process `pid`'s open files.
fn mig_node_held(pid: i32) -> Option<String> {
    open_files(pid)
        .into_iter()
        .find(|l| gpu::assign::is_mig_node(l))
}

/// What process `pid`'s file descriptors name (the links of `/proc/PID/fd` read, never
/// followed; names that are not UTF-8 left out); empty when they cannot be read.
pub(crate) fn open_files(pid: i32) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|l| l.to_str().map(str::to_string))
        .collect()
}

/// The NCCL library a process whose `/proc/PID/maps` is `maps` uses without gpu-ckpt's NCCL
/// layer, if it does: the first `libnccl.so*` it maps, unless it also maps the layer and the
/// container got the layer (`managed`).
fn unmanaged_nccl(maps: &str, managed: bool) -> Option<String> {
    let lib = nccl_in_maps(maps)?;
    (!(managed && maps_layer(maps))).then_some(lib)
}

/// The first mapped file of a `/proc/PID/maps` text whose file name starts with `prefix`.
fn mapped_file(maps: &str, prefix: &str) -> Option<String> {
    crate::driver_files::file_mappings(maps)
        .map(|(_, path)| path)
        .find(|path| {
            path.rsplit('/')
                .next()
                .is_some_and(|f| f.starts_with(prefix))
        })
        .map(str::to_string)
}

/// The first `libnccl.so*` file a `/proc/PID/maps` text names.
pub(crate) fn nccl_in_maps(maps: &str) -> Option<String> {
    mapped_file(maps, "libnccl.so")
}

/// Whether a `/proc/PID/maps` text names gpu-ckpt's NCCL layer (`libgpu-ckpt-nccl.so`, where
/// the shim mounts it or elsewhere, by its file name).
pub(crate) fn maps_layer(maps: &str) -> bool {
    mapped_file(maps, crate::nccl::inject::LAYER_FILE_NAME).is_some()
}

/// The first MPS client among `pids`.
fn mps_client<'a>(mps: &'a [ComputeProcess], pids: &[i32]) -> Option<&'a ComputeProcess> {
    mps.iter().find(|c| pids.contains(&(c.pid as i32)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu::{GpuError, GpuInfo};

    struct Node {
        mig: bool,
        mps: Vec<ComputeProcess>,
    }

    fn node(mig: bool, mps: Vec<ComputeProcess>) -> Node {
        Node { mig, mps }
    }

    /// A process as the tests know it.
    struct Proc(i32, Vec<GpuUuid>);

    impl Process for Proc {
        fn pid(&self) -> i32 {
            self.0
        }
        fn gpus(&self) -> Vec<GpuUuid> {
            self.1.clone()
        }
        fn describe(&self) -> String {
            format!("pid {} on {:?}", self.0, self.1)
        }
        fn other(pid: i32, gpus: Vec<GpuUuid>) -> Self {
            Proc(pid, gpus)
        }
    }

    impl Inventory for Node {
        fn node(&self) -> std::result::Result<NodeInventory, GpuError> {
            Ok(NodeInventory {
                driver_version: "580.95.05".into(),
                cuda_driver_version: 13000,
                gpus: vec![GpuInfo {
                    index: 0,
                    uuid: GpuUuid([1; 16]),
                    name: "NVIDIA A100-SXM4-80GB".into(),
                    architecture: None,
                    compute_capability: None,
                    memory_total_bytes: 1 << 30,
                    memory_free_bytes: None,
                    minor_number: Some(0),
                    pci_bus_id: String::new(),
                    persistence_mode: None,
                    mig_enabled: Some(self.mig),
                }],
            })
        }
        fn compute_processes(&self) -> std::result::Result<Vec<ComputeProcess>, GpuError> {
            Ok(Vec::new())
        }
        fn mps_processes(&self) -> std::result::Result<Vec<ComputeProcess>, GpuError> {
            Ok(self.mps.clone())
        }
    }

    fn me() -> i32 {
        std::process::id() as i32
    }

    fn holder() -> Proc {
        Proc(me(), vec![GpuUuid([1; 16])])
    }

    const NONE: &[Proc] = &[];

    #[test]
    fn a_plain_gpu_process_passes() {
        let node = node(false, Vec::new());
        let given = Given::from_spec(&json!({"linux": {"devices": [{"path": "/dev/nvidia0"}]}}));
        refuse(&node, &given, &[me()], &[holder()]).unwrap();
    }

    #[test]
    fn a_mig_mode_gpu_is_refused_however_reached() {
        let node = node(true, Vec::new());
        // Given through its device node, holding nothing.
        let given = Given::from_spec(&json!({"linux": {"devices": [{"path": "/dev/nvidia0"}]}}));
        let err = refuse(&node, &given, &[me()], NONE)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("checkpoint failed at step unsupported: ")
                && err.contains("MIG mode")
                && err.contains(&GpuUuid([1; 16]).to_string())
                && err.contains("runs on untouched"),
            "{err}"
        );
        // Held by a process of a container whose spec shows no GPU (privileged).
        let err = refuse(&node, &Given::default(), &[me()], &[holder()])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("pid {}", me())) && err.contains("MIG mode"),
            "{err}"
        );
    }

    #[test]
    fn an_mps_client_is_refused_naming_its_pid() {
        let client = ComputeProcess {
            gpu: GpuUuid([1; 16]),
            pid: me() as u32,
            used_bytes: None,
        };
        let node = node(false, vec![client]);
        let err = refuse(&node, &Given::default(), &[me()], NONE)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("pid {}", me())) && err.contains("MPS client"),
            "{err}"
        );
        // Another container's client is not this container's business.
        refuse(&node, &Given::default(), &[me() + 1], NONE).unwrap();
    }

    #[test]
    fn nccl_is_found_in_maps() {
        let maps = "\
7f0000000000-7f0000001000 r--p 00000000 08:01 1234                       /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000001000-7f0000002000 r-xp 00001000 08:01 99                         /opt/venv/lib/nvidia/nccl/lib/libnccl.so.2
7f0000003000-7f0000004000 rw-p 00000000 00:00 0                          [heap]
";
        assert_eq!(
            nccl_in_maps(maps).as_deref(),
            Some("/opt/venv/lib/nvidia/nccl/lib/libnccl.so.2")
        );
        assert_eq!(
            nccl_in_maps("7f-8f r--p 0 08:01 5 /usr/lib/libnccl-net.so\n"),
            None
        );
        assert_eq!(
            nccl_in_maps("7f-8f r--p 0 08:01 5 /tmp/my dir/libnccl.so.2.27.3 (deleted)\n")
                .as_deref(),
            Some("/tmp/my dir/libnccl.so.2.27.3 (deleted)")
        );
        // This test process maps no NCCL.
        let own = std::fs::read_to_string("/proc/self/maps").unwrap();
        assert_eq!(nccl_in_maps(&own), None);
        assert_eq!(unmanaged_nccl(&own, false), None);
    }

    const NCCL_ONLY: &str = "\
7f0000001000-7f0000002000 r-xp 00001000 08:01 99                         /usr/lib/x86_64-linux-gnu/libnccl.so.2
";
    const NCCL_AND_LAYER: &str = "\
7f0000000000-7f0000001000 r-xp 00000000 08:01 77                         /usr/lib/gpu-ckpt/libgpu-ckpt-nccl.so
7f0000001000-7f0000002000 r-xp 00001000 08:01 99                         /usr/lib/x86_64-linux-gnu/libnccl.so.2
";

    #[test]
    fn nccl_is_refused_without_the_layer_in_a_container_that_opted_in() {
        let lib = Some("/usr/lib/x86_64-linux-gnu/libnccl.so.2".to_string());
        // NCCL alone: refused, whether the container opted in or not.
        assert_eq!(unmanaged_nccl(NCCL_ONLY, false), lib);
        assert_eq!(unmanaged_nccl(NCCL_ONLY, true), lib);
        // NCCL under the layer, in a container that got it: the layer's business.
        assert_eq!(unmanaged_nccl(NCCL_AND_LAYER, true), None);
        // The layer's file in a container that did not opt in: no control socket, refused.
        assert_eq!(unmanaged_nccl(NCCL_AND_LAYER, false), lib);
        // The layer mapped where the file was replaced on the host since.
        let deleted =
            NCCL_AND_LAYER.replace("libgpu-ckpt-nccl.so\n", "libgpu-ckpt-nccl.so (deleted)\n");
        assert_eq!(unmanaged_nccl(&deleted, true), None);
        // The layer without NCCL: nothing to refuse.
        let layer_only = NCCL_AND_LAYER.lines().next().unwrap();
        assert_eq!(unmanaged_nccl(layer_only, false), None);
    }

    #[test]
    fn given_says_whether_the_layer_was_injected() {
        let spec = json!({"linux": {"devices": [{"path": "/dev/nvidia0"}]}});
        assert!(!Given::from_spec(&spec).nccl_managed);
        assert!(Given::from_spec(&spec).nccl_managed(true).nccl_managed);
        assert!(!Given::default().nccl_managed);
    }
}
