//! Custom storage (CUDA 13.4 and later): the driver maps a locked process's device memory into
//! the caller, one range per GPU, and the caller moves it to and from its own files. These are
//! the types the checkpoint's device-memory files are described by, in the manifest and between
//! the shim and its device worker.

use serde::{Deserialize, Serialize};

use crate::GpuUuid;

/// One GPU's device memory of one process, in one file of the checkpoint's directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceMemoryFile {
    /// The GPU the range was mapped from at the checkpoint (the checkpointed GPU, before any
    /// remapping).
    pub gpu: GpuUuid,
    /// The file's name in the directory (flat: no `/`).
    pub name: String,
    /// Bytes of device memory in the file (the range's size).
    pub size: u64,
    /// BLAKE3 of the file's bytes, lowercase hex, computed while they were written.
    pub blake3: String,
}
