//! Test support for gpu-ckpt: OCI image builder, local test stack, kubelet-like clients.
