//! The NCCL communicator layer, `libgpu-ckpt-nccl.so`: preloaded into a GPU application
//! (`LD_PRELOAD`), it exports the NCCL API functions it wraps, forwards each to the next
//! definition (the application's NCCL), and hands the application handles of its own that stay
//! valid across a checkpoint: each points to the current real communicator. It records what
//! rebuilding every communicator needs, gates every call, and serves the shim's requests
//! (protocol v1, `gpu-ckpt-nccl-control`) on `$GPU_CKPT_NCCL_SOCKET`. Programs that `dlopen` NCCL
//! and look its functions up on their handle come under the layer through its `dlopen` and
//! `dlsym` ([`dl`]).
//!
//! Nothing runs when the library is loaded: the control thread starts with the first
//! communicator (a preloaded library's constructor runs before `main`, in every process the
//! application forks or execs).

pub mod api;
pub mod backend;
pub mod config;
pub mod control;
pub mod dl;
pub mod ffi;
pub mod gate;
pub mod layer;
pub mod next;
pub mod real;

#[cfg(test)]
mod abi_tests;
#[cfg(test)]
mod tests;
