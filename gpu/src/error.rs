//! The one error type of the device backends.

use crate::state::ProcessState;
use crate::version::CudaVersion;

/// Everything a device backend can fail with.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The driver's library could not be loaded (no NVIDIA driver on this machine, or the path
    /// given does not exist), or the driver says it is not loaded.
    #[error("no NVIDIA driver: cannot load {library}: {reason}")]
    NoDriver { library: String, reason: String },

    /// The library loaded but lacks a function (an older driver, or not the library it claims).
    #[error(
        "{library} has no symbol {symbol} (driver too old, or not an NVIDIA library): {reason}"
    )]
    MissingSymbol {
        library: String,
        symbol: String,
        reason: String,
    },

    /// A CUDA driver call returned an error, e.g.
    /// `cuCheckpointProcessLock(pid 1234): CUDA_ERROR_TIMEOUT (909)`.
    #[error("{call}{}: {name} ({code})", .pid.map(|p| format!("(pid {p})")).unwrap_or_default())]
    Driver {
        call: &'static str,
        pid: Option<i32>,
        code: u32,
        name: String,
    },

    /// The call succeeded but the process is not in the state the step leads to (a restore can
    /// report success and leave the process CHECKPOINTED).
    #[error("{step}(pid {pid}): the driver reported success but the process is {actual}, not {expected}")]
    UnexpectedState {
        step: &'static str,
        pid: i32,
        expected: ProcessState,
        actual: ProcessState,
    },

    /// A restore onto other GPUs asked of a driver that cannot remap; nothing was called.
    #[error(
        "restore(pid {pid}): the driver (CUDA {version}) has no GPU remapping (needs CUDA 13.0 / \
         driver 580+), so it cannot restore onto other GPUs: {pairs}",
        version = CudaVersion(*.driver_version)
    )]
    NoRemap {
        pid: i32,
        driver_version: i32,
        /// The non-identity pairs, `OLD=NEW,...`.
        pairs: String,
    },

    /// Not a GPU UUID in NVML's form `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    #[error("invalid GPU UUID {input:?}: {reason}")]
    InvalidUuid { input: String, reason: &'static str },

    /// An argument the driver API cannot take.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A driver call that did not return within its bound; the process that made it was killed
    /// (the driver cannot cancel a call), e.g.
    /// `cuCheckpointProcessCheckpoint(pid 9040) did not return within 12s`.
    #[error("{call}(pid {pid}) did not return within {}", seconds(*.bound))]
    Unanswered {
        call: String,
        pid: i32,
        bound: std::time::Duration,
    },

    /// The process that runs the driver's calls could not be started, or broke off.
    #[error("device worker: {0}")]
    Worker(String),

    /// An NVML call failed.
    #[error("NVML {call}: {message}")]
    Nvml { call: &'static str, message: String },
}

/// A bound as messages show it: whole seconds as "12s", else milliseconds ("2500ms").
pub fn seconds(d: std::time::Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}
