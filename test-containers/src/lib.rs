//! Test support for gpu-ckpt: OCI image builder, local test stack, kubelet-like clients.
pub mod containerd;
pub mod cri;
pub mod gpuproc;
pub mod image;
pub mod otlp;
pub mod registry;
pub mod stack;
