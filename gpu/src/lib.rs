//! Device backends for gpu-ckpt: the CUDA driver's checkpoint API ([`cuda::CudaDriver`]) and the
//! node's GPU inventory through NVML ([`nvml::NvmlInventory`]), behind [`DeviceCheckpoint`] and
//! [`Inventory`]. Both libraries are loaded at run time; nothing needs CUDA to build.

pub mod assign;
pub mod cuda;
pub mod error;
pub mod nvml;
pub mod state;
pub mod storage;
pub mod uuid;
pub mod version;

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use cuda::CudaDriver;
pub use error::GpuError;
pub use nvml::NvmlInventory;
pub use state::ProcessState;
pub use storage::DeviceMemoryFile;
pub use uuid::{GpuPair, GpuUuid};

/// The CUDA driver's checkpoint API for one process (`cuCheckpointProcess*`).
///
/// Every step reads the process state back and fails with [`GpuError::UnexpectedState`] when the
/// driver reported success but the process is not where the step should have left it.
pub trait DeviceCheckpoint: Send + Sync {
    /// RUNNING → LOCKED: block further CUDA calls and wait for submitted work. `timeout`: `None`
    /// (or zero) waits without limit; on expiry the driver returns an error and the process
    /// stays RUNNING.
    fn lock(&self, pid: i32, timeout: Option<Duration>) -> Result<(), GpuError>;
    /// LOCKED → CHECKPOINTED: device memory is copied into the process's host memory and every
    /// device reference is released.
    fn checkpoint(&self, pid: i32) -> Result<(), GpuError>;
    /// CHECKPOINTED → LOCKED, onto the GPUs that `pairs` name (empty: the same GPUs).
    fn restore(&self, pid: i32, pairs: &[GpuPair]) -> Result<(), GpuError>;
    /// LOCKED → RUNNING.
    fn unlock(&self, pid: i32) -> Result<(), GpuError>;
    /// The process's checkpoint state.
    fn state(&self, pid: i32) -> Result<ProcessState, GpuError>;
    /// The tid of the driver's restore thread in the process; fails when it has no CUDA state.
    fn restore_thread_id(&self, pid: i32) -> Result<i32, GpuError>;
    /// `cuDriverGetVersion`: 1000 × major + 10 × minor, e.g. 12080, 13000.
    fn driver_version(&self) -> Result<i32, GpuError>;
    /// The device memory process `pid` holds (or, for a restore, held at its checkpoint), for
    /// a backend that bounds its calls by it. Ignored by default.
    fn set_device_bytes(&self, pid: i32, bytes: u64) {
        let _ = (pid, bytes);
    }
    /// The process a call is being made on now, for a backend that can abandon one. `None`
    /// by default.
    fn in_flight(&self) -> Option<i32> {
        None
    }
    /// Every process a call is being made on now (a backend that serves calls on several
    /// processes at once lists each; by default, [`in_flight`](Self::in_flight)'s).
    fn calls_in_flight(&self) -> Vec<i32> {
        self.in_flight().into_iter().collect()
    }
    /// Process `pid` is being killed: a call in flight on it is abandoned, and every later
    /// call on it fails at once (a backend that cannot abandon calls ignores this).
    fn abandon(&self, pid: i32) {
        let _ = pid;
    }
    /// Whether the driver offers custom storage (CUDA 13.4 and later, with
    /// `cuCheckpointOperationComplete`). False by default.
    fn custom_storage(&self) -> bool {
        false
    }
    /// LOCKED → CHECKPOINTED by custom storage: each GPU's range of the process's device memory
    /// written to a new file `{prefix}-{n}.bin` in `dir` (n: the range's index), synced and
    /// hashed as it is written; nothing of it is staged in the process's memory. `gpus`: the
    /// GPUs the process holds memory on, the only ones the caller takes a context on (other
    /// tenants' GPUs are left alone; a range on another GPU is refused); empty: every GPU.
    fn checkpoint_to(
        &self,
        pid: i32,
        gpus: &[GpuUuid],
        dir: &Path,
        prefix: &str,
    ) -> Result<Vec<DeviceMemoryFile>, GpuError> {
        let _ = (gpus, dir, prefix);
        Err(GpuError::InvalidArgument(format!(
            "checkpoint_to(pid {pid}): this backend has no custom storage"
        )))
    }
    /// CHECKPOINTED → LOCKED by custom storage, onto the GPUs `pairs` name (empty: the same
    /// GPUs): every range filled from its file in `dir`; a file whose bytes differ from its
    /// BLAKE3 fails the call.
    fn restore_from(
        &self,
        pid: i32,
        pairs: &[GpuPair],
        dir: &Path,
        files: &[DeviceMemoryFile],
    ) -> Result<(), GpuError> {
        let _ = (pairs, dir, files);
        Err(GpuError::InvalidArgument(format!(
            "restore_from(pid {pid}): this backend has no custom storage"
        )))
    }
}

/// What the node's GPUs are, from the driver's management library.
pub trait Inventory: Send + Sync {
    /// Versions and every GPU.
    fn node(&self) -> Result<NodeInventory, GpuError>;
    /// The processes with a compute context on any GPU.
    fn compute_processes(&self) -> Result<Vec<ComputeProcess>, GpuError>;
    /// The MPS clients on any GPU: processes whose CUDA work goes through the MPS server (NVML
    /// lists the server among the compute processes, its clients here). None where the driver
    /// cannot tell.
    fn mps_processes(&self) -> Result<Vec<ComputeProcess>, GpuError> {
        Ok(Vec::new())
    }
}

/// The node's driver and GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInventory {
    /// The NVIDIA driver version, e.g. "580.65.06".
    pub driver_version: String,
    /// The CUDA driver API version, as `cuDriverGetVersion` gives it (e.g. 13000).
    pub cuda_driver_version: i32,
    /// Every GPU, in NVML's index order.
    pub gpus: Vec<GpuInfo>,
}

/// One GPU. A field the driver cannot report is `None`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// NVML index.
    pub index: u32,
    pub uuid: GpuUuid,
    /// Model name, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// e.g. "Hopper".
    pub architecture: Option<String>,
    /// (major, minor), e.g. (9, 0).
    pub compute_capability: Option<(i32, i32)>,
    pub memory_total_bytes: u64,
    /// Device memory not in use when the inventory was read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_free_bytes: Option<u64>,
    /// The N of its device node `/dev/nvidiaN`, when the driver reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor_number: Option<u32>,
    /// e.g. "00000000:3B:00.0".
    pub pci_bus_id: String,
    pub persistence_mode: Option<bool>,
    /// Whether MIG mode is on (`nvmlDeviceGetMigMode`'s current mode); `None` on a GPU that has
    /// no MIG. The CUDA driver cannot checkpoint a process on a MIG instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_enabled: Option<bool>,
}

/// A process with a compute context on a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ComputeProcess {
    pub gpu: GpuUuid,
    pub pid: u32,
    /// Device memory the process uses, when the driver reports it.
    pub used_bytes: Option<u64>,
}
