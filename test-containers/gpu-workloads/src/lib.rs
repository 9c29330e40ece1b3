//! CUDA driver-API test workloads that run unchanged on a real GPU and on the simulated driver.
//!
//! - [`driver`]: minimal bindings to `libcuda.so.1`, loaded at run time.
//! - [`train`]: the state rule of `gpu-train` and its closed form.
//! - [`fill`]: the memory pattern of `gpu-fill`.
//! - [`cli`]: flag parsing shared by the binaries.
//! - [`signals`]: signal flags polled by the main loops.

pub mod cli;
pub mod driver;
pub mod fill;
pub mod signals;
pub mod train;

use std::io::Write;

/// Prints one line to stdout and flushes it (output goes to files and pipes).
pub fn emit(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// SplitMix64: the hash behind every pattern here.
pub fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A 32-bit hash of (seed, device, tag, index).
pub fn hash32(seed: u64, device: u32, tag: u32, index: u64) -> u32 {
    let h = mix64(seed ^ mix64(((device as u64) << 32) | tag as u64) ^ mix64(index ^ 0x5851_f42d));
    (h >> 16) as u32
}
