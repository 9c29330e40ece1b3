//! The one error type of the device backends.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

use serde::{Deserialize, Deserializer, Serialize};

use crate::state::ProcessState;
use crate::version::CudaVersion;

/// A name the code gives (a call, a step, a reason). An alias, so that serde's derive does not
/// see a `&str` and borrow it from its input: [`interned`] reads it instead.
pub type Name = &'static str;

/// Everything a device backend can fail with. Serialisable, so that a process running the
/// driver's calls for another can hand its errors back as they are.
#[derive(Debug, thiserror::Error, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
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
        #[serde(deserialize_with = "interned")]
        call: Name,
        pid: Option<i32>,
        code: u32,
        name: String,
    },

    /// The call succeeded but the process is not in the state the step leads to (a restore can
    /// report success and leave the process CHECKPOINTED).
    #[error("{step}(pid {pid}): the driver reported success but the process is {actual}, not {expected}")]
    UnexpectedState {
        #[serde(deserialize_with = "interned")]
        step: Name,
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
    InvalidUuid {
        input: String,
        #[serde(deserialize_with = "interned")]
        reason: Name,
    },

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

    /// A checkpoint's device-memory file could not be created, written, read or synced, e.g.
    /// `device-memory file /ckpt/dev-9040-0.bin: reserve: No space left on device (os error 28)`.
    #[error("device-memory file {file}: {reason}")]
    Storage { file: String, reason: String },

    /// A device-memory file whose bytes are not those the checkpoint recorded.
    #[error("device-memory file {file} is corrupt: its BLAKE3 is {actual}, the checkpoint recorded {expected}")]
    Corrupt {
        file: String,
        expected: String,
        actual: String,
    },

    /// An NVML call failed.
    #[error("NVML {call}: {message}")]
    Nvml {
        #[serde(deserialize_with = "interned")]
        call: Name,
        message: String,
    },
}

/// A bound as messages show it: whole seconds as "12s", else milliseconds ("2500ms").
pub fn seconds(d: std::time::Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// A name read back into the `'static` string a variant holds: each distinct name is allocated
/// once for the life of the process (call names, steps and reasons: a handful).
fn interned<'de, D: Deserializer<'de>>(d: D) -> Result<&'static str, D::Error> {
    static NAMES: OnceLock<Mutex<HashSet<&'static str>>> = OnceLock::new();
    let s = String::deserialize(d)?;
    let mut names = NAMES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(n) = names.get(s.as_str()) {
        return Ok(n);
    }
    let n: &'static str = Box::leak(s.into_boxed_str());
    names.insert(n);
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_read_back_as_they_were_written() {
        let errors = [
            GpuError::Driver {
                call: "cuCheckpointProcessLock",
                pid: Some(9),
                code: 909,
                name: "CUDA_ERROR_TIMEOUT".into(),
            },
            GpuError::UnexpectedState {
                step: "restore",
                pid: 9,
                expected: ProcessState::LOCKED,
                actual: ProcessState::CHECKPOINTED,
            },
            GpuError::Unanswered {
                call: "cuCheckpointProcessGetState".into(),
                pid: 9,
                bound: std::time::Duration::from_millis(2500),
            },
            GpuError::Nvml {
                call: "nvmlInit",
                message: "x".into(),
            },
        ];
        for e in errors {
            let json = serde_json::to_string(&e).unwrap();
            let back: GpuError = serde_json::from_str(&json).unwrap();
            assert_eq!(back.to_string(), e.to_string());
            assert_eq!(serde_json::to_string(&back).unwrap(), json);
        }
        let a: GpuError = serde_json::from_str(r#"{"nvml":{"call":"c","message":"m"}}"#).unwrap();
        let b: GpuError = serde_json::from_str(r#"{"nvml":{"call":"c","message":"m"}}"#).unwrap();
        let (GpuError::Nvml { call: a, .. }, GpuError::Nvml { call: b, .. }) = (a, b) else {
            panic!("not nvml");
        };
        assert!(std::ptr::eq(a, b), "one allocation per name");
    }
}
