//! The gpu-ckpt shim library.
