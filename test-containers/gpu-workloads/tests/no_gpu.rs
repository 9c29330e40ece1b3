//! Without an NVIDIA driver the check skips with one line and exit 0, and the workloads fail with
//! one line and a non-zero status.

use std::process::Command;

fn no_driver_env(c: &mut Command) -> &mut Command {
    c.env("LD_LIBRARY_PATH", "/nonexistent-gpu-ckpt")
        .env_remove("GPU_CKPT_SIM_SOCKET")
}

fn driver_present() -> bool {
    gpu_ckpt_gpu_workloads::driver::Driver::load().is_ok()
}

#[test]
fn gpu_check_skips_without_a_driver() {
    if driver_present() {
        eprintln!("skipped: this machine has a libcuda.so.1");
        return;
    }
    let out = no_driver_env(&mut Command::new(env!("CARGO_BIN_EXE_gpu-ckpt-gpu-check")))
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}");
    assert_eq!(s.lines().count(), 1, "{s}");
    assert!(s.starts_with("gpu-check: skipped: no NVIDIA driver"), "{s}");
}

#[test]
fn workloads_fail_in_one_line_without_a_driver() {
    if driver_present() {
        eprintln!("skipped: this machine has a libcuda.so.1");
        return;
    }
    for bin in [
        env!("CARGO_BIN_EXE_gpu-train"),
        env!("CARGO_BIN_EXE_gpu-fill"),
        env!("CARGO_BIN_EXE_nccl-train"),
    ] {
        let out = no_driver_env(&mut Command::new(bin)).output().unwrap();
        let s = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{bin}: {s}");
        assert_eq!(s.lines().count(), 1, "{bin}: {s}");
        assert!(s.contains("no NVIDIA driver"), "{bin}: {s}");
    }
}

#[test]
fn bad_flags_are_usage_errors() {
    for bin in [
        env!("CARGO_BIN_EXE_gpu-train"),
        env!("CARGO_BIN_EXE_gpu-fill"),
        env!("CARGO_BIN_EXE_nccl-train"),
    ] {
        let out = Command::new(bin).arg("--nope").output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{bin}");
    }
}
