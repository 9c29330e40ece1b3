//! What the layer's end-to-end tests share: their own harness (each test binary is also the
//! process it starts, so `harness = false`) and the built layer.

use std::path::{Path, PathBuf};

pub mod stack;

/// Whether `cargo test`'s arguments select the test `name` (no filter, or a filter it contains);
/// `--list` prints it and selects nothing.
pub fn selected(name: &str) -> bool {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--list") {
        println!("{name}: test");
        return false;
    }
    // Harness options that take a value, so that the value is not read as a filter.
    let valued = [
        "--test-threads",
        "--skip",
        "--format",
        "--color",
        "-Z",
        "--logfile",
    ];
    let filter = args
        .iter()
        .enumerate()
        .find(|(i, a)| !a.starts_with('-') && (*i == 0 || !valued.contains(&args[i - 1].as_str())))
        .map(|(_, a)| a);
    filter.is_none_or(|f| name.contains(f.as_str()))
}

/// The built layer (next to the test executable), copied into `dir` under the name it is
/// installed and preloaded as.
pub fn layer_library(dir: &Path) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let mut d = exe.parent();
    while let Some(p) = d {
        let so = p.join("libgpu_ckpt_nccl.so");
        if so.is_file() {
            let to = dir.join("libgpu-ckpt-nccl.so");
            std::fs::copy(&so, &to).expect("copy the layer");
            return to;
        }
        d = p.parent();
    }
    panic!(
        "libgpu_ckpt_nccl.so not found above {}: build the workspace first",
        exe.display()
    );
}
