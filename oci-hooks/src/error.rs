//! The one error type of the hooks. Every message is one line that names the problem and carries
//! its cause, so `gpu-ckpt-hook` prints it as is.

use std::path::PathBuf;

use image_format::compat::Difference;

/// Everything a hook can fail with.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    /// stdin could not be read.
    #[error("reading the container state from stdin: {0}")]
    StateRead(std::io::Error),

    /// stdin is not the runtime's state JSON.
    #[error("the container state on stdin is not valid: {0}")]
    StateJson(serde_json::Error),

    /// The state names no bundle directory.
    #[error("the container state on stdin has no bundle")]
    NoBundle,

    /// A file could not be read.
    #[error("reading {}: {error}", .path.display())]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },

    /// A file is not the JSON it should be.
    #[error("{} is not valid: {error}", .path.display())]
    Json {
        path: PathBuf,
        error: serde_json::Error,
    },

    /// A file could not be written.
    #[error("writing {}: {error}", .path.display())]
    Write {
        path: PathBuf,
        error: std::io::Error,
    },

    /// The node's GPUs could not be read through NVML.
    #[error("reading the node's GPUs: {0}")]
    Inventory(gpu::GpuError),

    /// The container's spec names GPUs that cannot be resolved on this node.
    #[error("{}: {error}", .path.display())]
    Spec { path: PathBuf, error: gpu::GpuError },

    /// A restore needs GPUs, but the node has no NVIDIA driver.
    #[error("the checkpoint holds device state of {gpus} GPU(s), but {reason}")]
    NoDriver { gpus: usize, reason: String },

    /// The restored container's GPUs differ from its checkpoint's.
    #[error(
        "the restored container's GPUs do not fit its checkpoint: {}",
        join_differences(.0)
    )]
    Incompatible(Vec<Difference>),

    /// A command-line argument the hooks cannot take.
    #[error("{0}")]
    Usage(String),

    /// A base runtime spec that is not an OCI runtime spec.
    #[error("{0}")]
    BaseSpec(String),
}

/// Each difference's Display, joined by "; ".
pub fn join_differences(d: &[Difference]) -> String {
    d.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}
