//! The test stack's NVIDIA NCCL wheel, and running a helper process. Shared by the integration
//! tests and the crate's ABI unit test (`#[path]`).

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

/// A directory of the pinned NCCL wheel in the test stack (`$GPU_CKPT_STACK`, else the
/// repository's `.stack`) that holds `file`: `wheel_dir("include", "nccl.h")`.
pub fn wheel_dir(sub: &str, file: &str) -> PathBuf {
    let stack = std::env::var_os("GPU_CKPT_STACK").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.stack"),
        PathBuf::from,
    );
    let lib = stack.join("py/lib");
    let pythons = std::fs::read_dir(&lib).unwrap_or_else(|e| panic!("{}: {e}", lib.display()));
    pythons
        .map(|py| {
            py.expect("read the stack")
                .path()
                .join("site-packages/nvidia/nccl")
                .join(sub)
        })
        .find(|d| d.join(file).is_file())
        .unwrap_or_else(|| panic!("no nvidia/nccl/{sub}/{file} under {}", lib.display()))
}

/// Runs `cmd` to its end; its stdout, or a panic with its stderr when it failed.
pub fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}
