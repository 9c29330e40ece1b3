//! The NCCL layer's mounts and environment in a container's spec.

use std::path::PathBuf;

/// What injecting the layer into a container made.
#[derive(Debug, Clone)]
pub struct NcclSetup {
    /// The host directory bind-mounted at `/run/gpu-ckpt-nccl`.
    pub host_dir: PathBuf,
    /// The host path of `control.sock`.
    pub socket: PathBuf,
    /// BLAKE3 (hex) of the layer library bind-mounted into the container.
    pub layer_blake3: String,
}

/// Removes the host socket directory of `setup` (at Delete).
pub fn remove_setup(setup: &NcclSetup) {
    let _ = std::fs::remove_dir_all(&setup.host_dir);
}
