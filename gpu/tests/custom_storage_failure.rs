//! A custom-storage checkpoint whose files cannot be written: the device memory goes back to
//! the process, which is left LOCKED with every byte, as the caller's undo expects.
//!
//! Its own test binary: it lowers the file size limit of the whole process for a moment, which
//! no other test may run under.

mod common;

use gpu::cuda::CudaDriver;
use gpu::{DeviceCheckpoint, GpuError, ProcessState};
use simgpu::testing::SimConfig;

use common::{node, Workload};

fn set_file_size_limit(bytes: libc::rlim_t) {
    let lim = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: setrlimit with a live struct.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_FSIZE, &lim) }, 0);
}

#[test]
fn a_file_that_cannot_be_written_leaves_the_process_locked_with_its_memory() {
    let n = node(SimConfig {
        gpus: 2,
        cuda_version: 13050,
        uuid_seed: "custom-enospc".into(),
        ..SimConfig::default()
    });
    let cuda = CudaDriver::load_from(n.libcuda()).unwrap();
    let mut w = Workload::fill(&n, 6, &["--devices", "0,1"]);
    let pid = w.pid();
    let dir = tempfile::tempdir().unwrap();
    cuda.lock(pid, None).unwrap();

    // Files of 4 MiB at most: the reservation of the first 6 MiB file fails (EFBIG, as ENOSPC
    // would on a full filesystem), after the driver mapped the ranges.
    // SAFETY: ignoring SIGXFSZ, so that the write past the limit fails instead of killing us.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    set_file_size_limit(4 << 20);
    let r = cuda.checkpoint_to(pid, &[], dir.path(), "dev");
    set_file_size_limit(libc::RLIM_INFINITY);
    let e = r.unwrap_err();
    assert!(matches!(e, GpuError::Storage { .. }), "{e}");
    assert!(e.to_string().contains("dev-0.bin: reserve"), "{e}");
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "a partial file was left"
    );
    // Back as it was before the call: LOCKED, its memory on its GPUs, the undo's unlock works.
    assert_eq!(cuda.state(pid).unwrap(), ProcessState::LOCKED);
    cuda.unlock(pid).unwrap();
    assert_eq!(w.verify(), format!("verified {} bytes", 2 * (6 << 20)));

    // And the same process checkpoints to files once they can be written.
    cuda.lock(pid, None).unwrap();
    let files = cuda.checkpoint_to(pid, &[], dir.path(), "dev").unwrap();
    assert_eq!(files.len(), 2);
    cuda.restore_from(pid, &[], dir.path(), &files).unwrap();
    cuda.unlock(pid).unwrap();
    w.verify();
}
