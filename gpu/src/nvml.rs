//! The node's GPU inventory through NVML (nvml-wrapper 0.13), `libnvidia-ml.so.1` loaded at run
//! time.
//!
//! The libnvidia-ml symbols this module makes nvml-wrapper call (any `libnvidia-ml.so.1` it
//! loads must export them; nvml-wrapper resolves symbols lazily, so one that is
//! missing fails only the call that needs it, except as noted):
//!
//! - [`NvmlInventory::open`]: `nvmlInit_v2`, then `nvmlSystemGetDriverVersion` (nvml-wrapper
//!   reads it during init to pick its field-id scheme; a failure there is ignored).
//! - drop: `nvmlShutdown` (nvml-wrapper's `Drop` panics when the symbol is missing; this module
//!   then skips the shutdown instead).
//! - [`Inventory::node`]: `nvmlSystemGetDriverVersion`, `nvmlSystemGetCudaDriverVersion_v2`,
//!   `nvmlDeviceGetCount_v2`, and for each index `nvmlDeviceGetHandleByIndex_v2`,
//!   `nvmlDeviceGetUUID`, `nvmlDeviceGetName`, `nvmlDeviceGetArchitecture`,
//!   `nvmlDeviceGetCudaComputeCapability`, `nvmlDeviceGetMemoryInfo_v2` (an `nvmlMemory_v2_t`
//!   whose `version` field nvml-wrapper sets to `sizeof | 2 << 24`), `nvmlDeviceGetPciInfo_v3`,
//!   `nvmlDeviceGetPersistenceMode`, `nvmlDeviceGetMigMode` (current and pending mode, each
//!   `NVML_DEVICE_MIG_ENABLE` (1) or `NVML_DEVICE_MIG_DISABLE` (0)).
//! - [`Inventory::compute_processes`]: `nvmlDeviceGetCount_v2`, and for each index
//!   `nvmlDeviceGetHandleByIndex_v2`, `nvmlDeviceGetUUID`, `nvmlDeviceGetComputeRunningProcesses_v3`
//!   (called twice: first with a NULL buffer for the count, which must return
//!   `NVML_ERROR_INSUFFICIENT_SIZE` (7) with the count set, or `NVML_SUCCESS` for none; then with
//!   a buffer of count + 5 `nvmlProcessInfo_t` (v2 layout: `pid` u32, `usedGpuMemory` u64,
//!   `gpuInstanceId` u32, `computeInstanceId` u32; 24 bytes)).
//! - [`Inventory::mps_processes`]: the same with `nvmlDeviceGetMPSComputeRunningProcesses_v3`
//!   (its first call with a NULL buffer, then a buffer of exactly the count).
//!
//! Architecture, compute capability, persistence mode, MIG mode and the MPS list are optional: `NVML_ERROR_NOT_SUPPORTED`,
//! `NVML_ERROR_FUNCTION_NOT_FOUND` or a missing symbol give `None`.

use std::ffi::OsStr;
use std::fmt;
use std::mem::ManuallyDrop;
use std::path::Path;

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;
use nvml_wrapper::{Device, Nvml};

use crate::error::GpuError;
use crate::uuid::GpuUuid;
use crate::{ComputeProcess, GpuInfo, Inventory, NodeInventory};

/// The library loaded when no path is given.
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

/// NVML, initialised. Shut down when dropped.
pub struct NvmlInventory {
    nvml: ManuallyDrop<Nvml>,
    library: String,
}

impl fmt::Debug for NvmlInventory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NvmlInventory")
            .field("library", &self.library)
            .finish()
    }
}

impl NvmlInventory {
    /// Loads `libnvidia-ml.so.1` through the loader's search and calls `nvmlInit_v2`.
    pub fn load() -> Result<NvmlInventory, GpuError> {
        Self::open(None)
    }

    /// Loads the library at `path` and calls `nvmlInit_v2`.
    pub fn load_from(path: impl AsRef<Path>) -> Result<NvmlInventory, GpuError> {
        Self::open(Some(path.as_ref()))
    }

    /// [`load_from`](Self::load_from) when a path is given, else [`load`](Self::load).
    pub fn open(path: Option<&Path>) -> Result<NvmlInventory, GpuError> {
        let library = match path {
            Some(p) => p.display().to_string(),
            None => DEFAULT_LIBRARY.to_string(),
        };
        let _span = tracing::info_span!("nvml_init", library = %library).entered();
        let result = match path {
            Some(p) => Nvml::builder().lib_path(p.as_os_str()).init(),
            None => Nvml::builder().lib_path(OsStr::new(DEFAULT_LIBRARY)).init(),
        };
        let nvml = result.map_err(|e| match e {
            NvmlError::LibloadingError(e) => GpuError::NoDriver {
                library: library.clone(),
                reason: e.to_string(),
            },
            NvmlError::DriverNotLoaded | NvmlError::LibraryNotFound => GpuError::NoDriver {
                library: library.clone(),
                reason: e.to_string(),
            },
            NvmlError::FailedToLoadSymbol(reason) => GpuError::MissingSymbol {
                library: library.clone(),
                symbol: "nvmlInit_v2".to_string(),
                reason,
            },
            other => nvml_error("nvmlInit_v2", other),
        })?;
        tracing::debug!("nvml initialised");
        Ok(NvmlInventory {
            nvml: ManuallyDrop::new(nvml),
            library,
        })
    }

    /// The library as it was asked for.
    pub fn library(&self) -> &str {
        &self.library
    }

    fn gpu(&self, index: u32) -> Result<GpuInfo, GpuError> {
        let d = self
            .nvml
            .device_by_index(index)
            .map_err(|e| nvml_error("nvmlDeviceGetHandleByIndex_v2", e))?;
        let uuid = device_uuid(&d)?;
        let name = d.name().map_err(|e| nvml_error("nvmlDeviceGetName", e))?;
        let architecture = optional(
            "nvmlDeviceGetArchitecture",
            d.architecture().map(|a| a.to_string()),
        )?;
        let compute_capability = optional(
            "nvmlDeviceGetCudaComputeCapability",
            d.cuda_compute_capability().map(|c| (c.major, c.minor)),
        )?;
        let memory = d
            .memory_info()
            .map_err(|e| nvml_error("nvmlDeviceGetMemoryInfo_v2", e))?;
        let pci_bus_id = d
            .pci_info()
            .map_err(|e| nvml_error("nvmlDeviceGetPciInfo_v3", e))?
            .bus_id;
        let minor_number = optional("nvmlDeviceGetMinorNumber", d.minor_number())?;
        let persistence_mode = optional("nvmlDeviceGetPersistenceMode", d.is_in_persistent_mode())?;
        let mig_enabled = optional("nvmlDeviceGetMigMode", d.mig_mode().map(|m| m.current == 1))?;
        Ok(GpuInfo {
            index,
            uuid,
            name,
            architecture,
            compute_capability,
            memory_total_bytes: memory.total,
            memory_free_bytes: Some(memory.free),
            minor_number,
            pci_bus_id,
            persistence_mode,
            mig_enabled,
        })
    }

    fn device_count(&self) -> Result<u32, GpuError> {
        self.nvml
            .device_count()
            .map_err(|e| nvml_error("nvmlDeviceGetCount_v2", e))
    }
}

impl Drop for NvmlInventory {
    fn drop(&mut self) {
        // SAFETY: `self.nvml` is not used after this.
        let nvml = unsafe { ManuallyDrop::take(&mut self.nvml) };
        if nvml.lib().nvmlShutdown.is_ok() {
            drop(nvml);
        } else {
            // nvml-wrapper's Drop would panic on the missing symbol.
            std::mem::forget(nvml);
        }
    }
}

impl Inventory for NvmlInventory {
    fn node(&self) -> Result<NodeInventory, GpuError> {
        let _span = tracing::debug_span!("nvml_node").entered();
        let driver_version = self
            .nvml
            .sys_driver_version()
            .map_err(|e| nvml_error("nvmlSystemGetDriverVersion", e))?;
        let cuda_driver_version = self
            .nvml
            .sys_cuda_driver_version()
            .map_err(|e| nvml_error("nvmlSystemGetCudaDriverVersion_v2", e))?;
        let gpus = (0..self.device_count()?)
            .map(|i| self.gpu(i))
            .collect::<Result<Vec<_>, _>>()?;
        tracing::debug!(%driver_version, cuda_driver_version, gpus = gpus.len(), "inventory");
        Ok(NodeInventory {
            driver_version,
            cuda_driver_version,
            gpus,
        })
    }

    fn compute_processes(&self) -> Result<Vec<ComputeProcess>, GpuError> {
        let _span = tracing::debug_span!("nvml_compute_processes").entered();
        self.processes("nvmlDeviceGetComputeRunningProcesses_v3", |d| {
            d.running_compute_processes()
        })
    }

    fn mps_processes(&self) -> Result<Vec<ComputeProcess>, GpuError> {
        let _span = tracing::debug_span!("nvml_mps_processes").entered();
        self.processes("nvmlDeviceGetMPSComputeRunningProcesses_v3", |d| {
            d.mps_running_compute_processes()
        })
    }
}

impl NvmlInventory {
    /// The processes `list` gives on every GPU (`call` names it for errors); a GPU whose driver
    /// cannot list them is skipped with a warning.
    fn processes(
        &self,
        call: &'static str,
        list: impl Fn(&Device<'_>) -> Result<Vec<ProcessInfo>, NvmlError>,
    ) -> Result<Vec<ComputeProcess>, GpuError> {
        let mut out = Vec::new();
        for i in 0..self.device_count()? {
            let d = self
                .nvml
                .device_by_index(i)
                .map_err(|e| nvml_error("nvmlDeviceGetHandleByIndex_v2", e))?;
            let gpu = device_uuid(&d)?;
            let Some(procs) = optional(call, list(&d))? else {
                tracing::warn!(%gpu, call, "the driver cannot list this GPU's processes");
                continue;
            };
            out.extend(procs.into_iter().map(|p| ComputeProcess {
                gpu,
                pid: p.pid,
                used_bytes: match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => Some(b),
                    UsedGpuMemory::Unavailable => None,
                },
            }));
        }
        Ok(out)
    }
}

fn device_uuid(d: &Device<'_>) -> Result<GpuUuid, GpuError> {
    d.uuid()
        .map_err(|e| nvml_error("nvmlDeviceGetUUID", e))?
        .parse()
}

fn nvml_error(call: &'static str, e: NvmlError) -> GpuError {
    GpuError::Nvml {
        call,
        message: e.to_string(),
    }
}

/// Whether an NVML error means "this driver cannot tell", not a failure.
fn unsupported(e: &NvmlError) -> bool {
    matches!(
        e,
        NvmlError::NotSupported | NvmlError::FunctionNotFound | NvmlError::FailedToLoadSymbol(_)
    )
}

/// An NVML result whose "not supported" becomes `None`.
fn optional<T>(call: &'static str, r: Result<T, NvmlError>) -> Result<Option<T>, GpuError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if unsupported(&e) => {
            tracing::debug!(call, error = %e, "not supported");
            Ok(None)
        }
        Err(e) => Err(nvml_error(call, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_no_driver() {
        let e =
            NvmlInventory::load_from("/nonexistent/gpu-ckpt-test/libnvidia-ml.so.1").unwrap_err();
        assert!(matches!(e, GpuError::NoDriver { .. }), "{e}");
        assert!(e.to_string().starts_with("no NVIDIA driver"), "{e}");
    }

    #[test]
    fn missing_init_symbol_is_named() {
        let e = NvmlInventory::load_from("libc.so.6").unwrap_err();
        assert!(matches!(e, GpuError::MissingSymbol { .. }), "{e}");
        assert!(e.to_string().contains("nvmlInit_v2"), "{e}");
    }

    #[test]
    fn unsupported_becomes_none() {
        assert_eq!(
            optional::<u32>("x", Err(NvmlError::NotSupported)).unwrap(),
            None
        );
        assert_eq!(
            optional::<u32>("x", Err(NvmlError::FunctionNotFound)).unwrap(),
            None
        );
        assert_eq!(optional("x", Ok(3u32)).unwrap(), Some(3));
        let e = optional::<u32>("nvmlDeviceGetArchitecture", Err(NvmlError::GpuLost)).unwrap_err();
        assert!(e.to_string().contains("nvmlDeviceGetArchitecture"), "{e}");
    }
}
