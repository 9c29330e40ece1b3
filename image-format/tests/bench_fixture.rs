//! Helper for bench/throughput.sh: writes a manifest for the directory in $GPU_CKPT_BENCH_DIR.
//! Ignored in normal test runs.

use image_format::manifest::{Container, Devices, Manifest, Node, Workload};

#[test]
#[ignore]
fn write_manifest_for_bench() {
    let Some(dir) = std::env::var_os("GPU_CKPT_BENCH_DIR") else {
        panic!("set GPU_CKPT_BENCH_DIR");
    };
    let dir = std::path::PathBuf::from(dir);
    let mut m = Manifest::new(
        "2026-09-01T00:00:00Z",
        Container {
            id: "bench".into(),
            name: "bench".into(),
            ..Default::default()
        },
        Node::default(),
        Devices::default(),
        Workload::default(),
    );
    m.hash_dir(&dir).unwrap();
    m.write_to(&dir).unwrap();
}

mod common;

/// Writes the test suite's sample archive to $GPU_CKPT_SAMPLE_OUT (for manual checks with ctr).
#[test]
#[ignore]
fn write_sample_archive() {
    let Some(out) = std::env::var_os("GPU_CKPT_SAMPLE_OUT") else {
        panic!("set GPU_CKPT_SAMPLE_OUT");
    };
    let tmp = tempfile::tempdir().unwrap();
    let a = common::make_archive(tmp.path());
    std::fs::copy(a, out).unwrap();
}
