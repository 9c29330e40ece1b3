//! The CUDA and NVML backends against the simulated driver (`gpu/sim`): real processes that hold
//! device memory (`gpu-fill`), driven through each node's own `libcuda.so.1` and
//! `libnvidia-ml.so.1`.
//!
//! Needs the workspace built first (`cargo build --workspace`): the daemon `gpu-ckpt-simgpu`, the
//! simulated libraries and `gpu-fill` are found next to the test executable (or through
//! `$GPU_CKPT_SIMGPU_BIN` and `$GPU_CKPT_GPU_FILL`). A missing one fails the test.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{node, signal, uuids, Workload};

use gpu::cuda::{CudaDriver, REMAP_MIN_VERSION};
use gpu::{DeviceCheckpoint, GpuError, GpuPair, GpuUuid, Inventory, NvmlInventory, ProcessState};
use simgpu::proto::FaultOp;
use simgpu::testing::{SimConfig, SimNode};

const CUDA_ERROR_NOT_INITIALIZED: u32 = 3;
const CUDA_ERROR_ILLEGAL_STATE: u32 = 401;
const CUDA_ERROR_TIMEOUT: u32 = 909;
const CUDA_ERROR_OPERATING_SYSTEM: u32 = 304;
const CUDA_ERROR_INVALID_VALUE: u32 = 1;
const CUDA_ERROR_INVALID_DEVICE: u32 = 101;

/// The last `call` the driver received had all-zero arguments.
fn assert_zero_args(n: &SimNode, call: &str) {
    assert_eq!(n.last_args(call).unwrap(), vec![0u8; 64], "{call}");
}

fn driver_code(e: &GpuError) -> u32 {
    match e {
        GpuError::Driver { code, .. } => *code,
        other => panic!("expected a driver error, got {other}"),
    }
}

#[test]
fn states_after_each_step_and_memory_kept() {
    let n = node(SimConfig::default());
    let cuda = CudaDriver::load_from(n.libcuda()).expect("load the node's libcuda");
    let nvml = NvmlInventory::load_from(n.libnvml()).expect("load the node's NVML");
    let gpu0 = uuids(&n)[0];
    let mut w = Workload::fill(&n, 8, &[]);
    let pid = w.pid();

    assert_eq!(cuda.state(pid).unwrap(), ProcessState::RUNNING);
    assert!(cuda.restore_thread_id(pid).unwrap() > 0);
    let using = |nvml: &NvmlInventory| {
        nvml.compute_processes()
            .unwrap()
            .into_iter()
            .find(|p| p.pid == pid as u32)
    };
    let p = using(&nvml).expect("NVML lists the workload");
    assert_eq!(p.gpu, gpu0);
    assert!(p.used_bytes.unwrap_or(0) >= 8 << 20, "{p:?}");

    cuda.lock(pid, Some(Duration::from_secs(10))).unwrap();
    assert_eq!(cuda.state(pid).unwrap(), ProcessState::LOCKED);
    cuda.checkpoint(pid).unwrap();
    assert_eq!(cuda.state(pid).unwrap(), ProcessState::CHECKPOINTED);
    // The device memory moved into the process: it holds nothing on the GPU any more.
    assert!(
        using(&nvml).is_none(),
        "a checkpointed process still uses the GPU"
    );
    cuda.restore(pid, &[]).unwrap();
    assert_eq!(cuda.state(pid).unwrap(), ProcessState::LOCKED);
    cuda.unlock(pid).unwrap();
    assert_eq!(cuda.state(pid).unwrap(), ProcessState::RUNNING);
    assert_eq!(using(&nvml).expect("back on the GPU").gpu, gpu0);
    assert_eq!(w.verify(), "verified 8388608 bytes");
}

#[test]
fn lock_timeout_and_wrong_states() {
    let n = node(SimConfig::default());
    let cuda = CudaDriver::load_from(n.libcuda()).unwrap();
    let mut w = Workload::fill(&n, 4, &[]);
    let pid = w.pid();

    // Wrong state: every step but lock needs another state than RUNNING.
    for (step, r) in [
        ("checkpoint", cuda.checkpoint(pid)),
        ("restore", cuda.restore(pid, &[])),
        ("unlock", cuda.unlock(pid)),
    ] {
        let e = r.expect_err(step);
        assert_eq!(driver_code(&e), CUDA_ERROR_ILLEGAL_STATE, "{step}: {e}");
        assert!(
            e.to_string().contains("CUDA_ERROR_ILLEGAL_STATE (401)"),
            "{e}"
        );
        assert!(e.to_string().contains(&format!("(pid {pid})")), "{e}");
    }
    assert_eq!(cuda.state(pid).unwrap(), ProcessState::RUNNING);

    // A lock that cannot finish in time: CUDA_ERROR_TIMEOUT, and the process runs on.
    n.fault(Some(pid), FaultOp::LockTimeout, true).unwrap();
    let start = Instant::now();
    let e = cuda
        .lock(pid, Some(Duration::from_millis(300)))
        .unwrap_err();
    assert_eq!(driver_code(&e), CUDA_ERROR_TIMEOUT, "{e}");
    assert_eq!(
        e.to_string(),
        format!("cuCheckpointProcessLock(pid {pid}): CUDA_ERROR_TIMEOUT (909)")
    );
    assert!(
        start.elapsed() >= Duration::from_millis(300),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(cuda.state(pid).unwrap(), ProcessState::RUNNING);
    n.fault(Some(pid), FaultOp::LockTimeout, false).unwrap();

    // Locked: a second lock is in the wrong state too.
    cuda.lock(pid, None).unwrap();
    let e = cuda.lock(pid, None).unwrap_err();
    assert_eq!(driver_code(&e), CUDA_ERROR_ILLEGAL_STATE, "{e}");
    let e = cuda.restore(pid, &[]).unwrap_err();
    assert_eq!(driver_code(&e), CUDA_ERROR_ILLEGAL_STATE, "{e}");

    // A failing checkpoint leaves the process LOCKED; a failing restore leaves it CHECKPOINTED.
    n.fault(Some(pid), FaultOp::CheckpointFail, true).unwrap();
    let e = cuda.checkpoint(pid).unwrap_err();
    assert_eq!(driver_code(&e), CUDA_ERROR_OPERATING_SYSTEM, "{e}");
    assert_eq!(cuda.state(pid).unwrap(), ProcessState::LOCKED);
    n.fault(Some(pid), FaultOp::CheckpointFail, false).unwrap();
    cuda.checkpoint(pid).unwrap();
    // Checkpointed: lock, checkpoint and unlock are in the wrong state, and change nothing.
    for (step, r) in [
        ("lock", cuda.lock(pid, None)),
        ("checkpoint", cuda.checkpoint(pid)),
        ("unlock", cuda.unlock(pid)),
    ] {
        let e = r.expect_err(step);
        assert_eq!(driver_code(&e), CUDA_ERROR_ILLEGAL_STATE, "{step}: {e}");
        assert_eq!(
            cuda.state(pid).unwrap(),
            ProcessState::CHECKPOINTED,
            "{step}"
        );
    }
    n.fault(Some(pid), FaultOp::RestoreFail, true).unwrap();
    let e = cuda.restore(pid, &[]).unwrap_err();
    assert_eq!(driver_code(&e), CUDA_ERROR_OPERATING_SYSTEM, "{e}");
    assert_eq!(cuda.state(pid).unwrap(), ProcessState::CHECKPOINTED);
    n.fault(Some(pid), FaultOp::RestoreFail, false).unwrap();
    cuda.restore(pid, &[]).unwrap();
    cuda.unlock(pid).unwrap();
    w.verify();

    // A process that never used CUDA has no restore thread (CRIU's plugin relies on this) and
    // no state: CUDA_ERROR_NOT_INITIALIZED for both, as driver 580.159.04 answers on an H200
    // (`make gpu-check`, docs/gpu.md).
    let mut plain = Command::new("sleep").arg("30").spawn().unwrap();
    let plain_pid = plain.id() as i32;
    let tid = cuda.restore_thread_id(plain_pid);
    let state = cuda.state(plain_pid);
    let _ = plain.kill();
    let _ = plain.wait();
    for (what, e) in [
        ("restore thread", tid.map(|_| ()).err()),
        ("state", state.map(|_| ()).err()),
    ] {
        let e = e.unwrap_or_else(|| panic!("a process without CUDA has a {what}"));
        assert_eq!(driver_code(&e), CUDA_ERROR_NOT_INITIALIZED, "{what}: {e}");
    }
}

#[test]
fn argument_bytes_the_driver_received() {
    let n = node(SimConfig {
        gpus: 2,
        ..SimConfig::default()
    });
    let cuda = CudaDriver::load_from(n.libcuda()).unwrap();
    assert!(cuda.version() >= REMAP_MIN_VERSION);
    let u = uuids(&n);
    let mut w = Workload::fill(&n, 4, &["--devices", "0"]);
    let pid = w.pid();

    cuda.lock(pid, Some(Duration::from_millis(60_000))).unwrap();
    let lock = n.last_args("cuCheckpointProcessLock").unwrap();
    assert_eq!(lock.len(), 64);
    assert_eq!(&lock[..4], &60_000u32.to_le_bytes());
    assert!(lock[4..].iter().all(|&b| b == 0), "{lock:?}");

    cuda.checkpoint(pid).unwrap();
    assert_zero_args(&n, "cuCheckpointProcessCheckpoint");

    // Move GPU 0's memory to GPU 1: one pair, pointer set, count 1, the rest zero.
    cuda.restore(
        pid,
        &[GpuPair {
            old: u[0],
            new: u[1],
        }],
    )
    .unwrap();
    let restore = n.last_args("cuCheckpointProcessRestore").unwrap();
    assert_eq!(restore.len(), 64);
    assert_ne!(&restore[..8], &[0u8; 8], "gpuPairs is NULL");
    assert_eq!(&restore[8..12], &1u32.to_le_bytes());
    assert!(restore[12..].iter().all(|&b| b == 0), "{restore:?}");

    cuda.unlock(pid).unwrap();
    assert_zero_args(&n, "cuCheckpointProcessUnlock");
    w.verify();
    let nvml = NvmlInventory::load_from(n.libnvml()).unwrap();
    let procs = nvml.compute_processes().unwrap();
    let p = procs.iter().find(|p| p.pid == pid as u32).expect("listed");
    assert_eq!(p.gpu, u[1], "the process's memory is on GPU 1 now");

    // Without pairs (and without a timeout) the structs are all zero.
    cuda.lock(pid, None).unwrap();
    assert_zero_args(&n, "cuCheckpointProcessLock");
    cuda.checkpoint(pid).unwrap();
    cuda.restore(pid, &[]).unwrap();
    assert_zero_args(&n, "cuCheckpointProcessRestore");
    cuda.unlock(pid).unwrap();
    w.verify();
}

#[test]
fn driver_without_remapping_refuses_before_any_call() {
    let n = node(SimConfig {
        gpus: 2,
        driver_version: "570.86.10".into(),
        cuda_version: 12080,
        uuid_seed: "no-remap".into(),
        ..SimConfig::default()
    });
    let cuda = CudaDriver::load_from(n.libcuda()).unwrap();
    assert_eq!(cuda.driver_version().unwrap(), 12080);
    assert!(!cuda.supports_remap());
    let u = uuids(&n);
    let mut w = Workload::fill(&n, 4, &["--devices", "0"]);
    let pid = w.pid();
    cuda.lock(pid, None).unwrap();
    cuda.checkpoint(pid).unwrap();

    let e = cuda
        .restore(
            pid,
            &[GpuPair {
                old: u[0],
                new: u[1],
            }],
        )
        .unwrap_err();
    assert!(
        matches!(
            e,
            GpuError::NoRemap {
                driver_version: 12080,
                ..
            }
        ),
        "{e}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("12.8") && msg.contains("no GPU remapping"),
        "{msg}"
    );
    // Refused before the driver saw anything.
    assert!(
        n.last_args("cuCheckpointProcessRestore").is_err(),
        "the restore reached the driver"
    );
    assert_eq!(cuda.state(pid).unwrap(), ProcessState::CHECKPOINTED);

    // Identity pairs are dropped: a plain restore, all-zero args.
    cuda.restore(
        pid,
        &[GpuPair {
            old: u[0],
            new: u[0],
        }],
    )
    .unwrap();
    assert_zero_args(&n, "cuCheckpointProcessRestore");
    cuda.unlock(pid).unwrap();
    w.verify();
}

#[test]
fn nvml_inventory_fields() {
    let n = node(SimConfig {
        gpus: 2,
        model: "NVIDIA A100-SXM4-80GB".into(),
        memory_mib: 2048,
        driver_version: "570.86.10".into(),
        cuda_version: 12080,
        uuid_seed: "inventory".into(),
        ..SimConfig::default()
    });
    let nvml = NvmlInventory::load_from(n.libnvml()).unwrap();
    let inv = nvml.node().unwrap();
    assert_eq!(inv.driver_version, "570.86.10");
    assert_eq!(inv.cuda_driver_version, 12080);
    assert_eq!(inv.gpus.len(), 2);
    let desc = n.node();
    for (i, g) in inv.gpus.iter().enumerate() {
        assert_eq!(g.index, i as u32);
        assert_eq!(g.uuid.to_string(), n.uuids()[i]);
        assert_eq!(g.name, "NVIDIA A100-SXM4-80GB");
        assert_eq!(g.architecture.as_deref(), Some("Ampere"));
        assert_eq!(g.compute_capability, Some((8, 0)));
        assert_eq!(g.memory_total_bytes, 2048 << 20);
        assert_eq!(g.pci_bus_id, desc.gpus[i].pci_bus_id);
        assert_eq!(g.persistence_mode, Some(desc.gpus[i].persistence));
    }
    assert_ne!(inv.gpus[0].uuid, inv.gpus[1].uuid);
    // JSON round trip with UUIDs as strings.
    let j = serde_json::to_value(&inv).unwrap();
    assert_eq!(j["gpus"][1]["uuid"], n.uuids()[1]);
    assert_eq!(
        serde_json::from_value::<gpu::NodeInventory>(j).unwrap(),
        inv
    );
    assert!(nvml.compute_processes().unwrap().is_empty());
}

/// MIG mode per GPU, and MPS clients (a process whose libcuda found a live MPS control socket in
/// `$CUDA_MPS_PIPE_DIRECTORY`) listed apart from the compute processes, as NVML lists them.
#[test]
fn nvml_mig_mode_and_mps_clients() {
    let n = node(SimConfig {
        gpus: 2,
        mig_gpus: vec![1],
        uuid_seed: "mig-mps".into(),
        ..SimConfig::default()
    });
    let nvml = NvmlInventory::load_from(n.libnvml()).unwrap();
    let mig: Vec<Option<bool>> = nvml
        .node()
        .unwrap()
        .gpus
        .iter()
        .map(|g| g.mig_enabled)
        .collect();
    assert_eq!(mig, [Some(false), Some(true)]);
    let pipe = tempfile::tempdir().unwrap();
    let pipe_dir = pipe.path().to_str().unwrap();
    // No MPS server yet: an ordinary compute process.
    let plain = Workload::fill_env(
        &n,
        4,
        &["--devices", "0"],
        &[("CUDA_MPS_PIPE_DIRECTORY", pipe_dir)],
    );
    let _server = std::os::unix::net::UnixListener::bind(pipe.path().join("control")).unwrap();
    let client = Workload::fill_env(
        &n,
        4,
        &["--devices", "0"],
        &[("CUDA_MPS_PIPE_DIRECTORY", pipe_dir)],
    );
    let pids = |l: Vec<gpu::ComputeProcess>| -> Vec<u32> { l.iter().map(|p| p.pid).collect() };
    assert_eq!(
        pids(nvml.compute_processes().unwrap()),
        [plain.pid() as u32]
    );
    let mps = nvml.mps_processes().unwrap();
    assert_eq!(pids(mps.clone()), [client.pid() as u32]);
    assert_eq!(mps[0].gpu, uuids(&n)[0]);
}

#[test]
fn two_nodes_side_by_side_in_one_process() {
    let a = node(SimConfig {
        uuid_seed: "node-a".into(),
        ..SimConfig::default()
    });
    let b = node(SimConfig {
        uuid_seed: "node-b".into(),
        driver_version: "575.57.08".into(),
        cuda_version: 12090,
        ..SimConfig::default()
    });
    let ca = CudaDriver::load_from(a.libcuda()).unwrap();
    let cb = CudaDriver::load_from(b.libcuda()).unwrap();
    assert_eq!(ca.version(), 13000);
    assert_eq!(cb.version(), 12090);
    // The cache hands out the same library again.
    assert_eq!(CudaDriver::load_from(a.libcuda()).unwrap().version(), 13000);
    let na = NvmlInventory::load_from(a.libnvml())
        .unwrap()
        .node()
        .unwrap();
    let nb = NvmlInventory::load_from(b.libnvml())
        .unwrap()
        .node()
        .unwrap();
    assert_eq!(na.gpus[0].uuid.to_string(), a.uuids()[0]);
    assert_eq!(nb.gpus[0].uuid.to_string(), b.uuids()[0]);
    assert_eq!(nb.driver_version, "575.57.08");

    let mut w = Workload::fill(&a, 4, &[]);
    let pid = w.pid();
    ca.lock(pid, None).unwrap();
    ca.checkpoint(pid).unwrap();
    ca.restore(pid, &[]).unwrap();
    ca.unlock(pid).unwrap();
    w.verify();
}

/// The `devices <n>` line and the `ordinal <i> uuid <uuid>` lines gpu-fill --show-ordinals
/// prints before the `verified` line of one verification.
fn ordinals_shown(w: &mut Workload) -> Vec<String> {
    signal(w.pid(), libc::SIGUSR1);
    let n: usize = w.wait_for("devices ")["devices ".len()..].parse().unwrap();
    let shown: Vec<String> = (0..n)
        .map(|i| {
            let l = w.wait_for("ordinal ");
            let want = format!("ordinal {i} uuid ");
            assert!(l.starts_with(&want), "{l}");
            l[want.len()..].to_string()
        })
        .collect();
    w.wait_for("verified ");
    shown
}

/// A process restored onto another node's GPUs keeps every device ordinal it saw, in order: the
/// GPUs it held nothing on follow the caller's pairs too, or without a pair take a GPU of the
/// new node that no other ordinal has; its memory follows the pair of the GPU it was on.
#[test]
fn restore_onto_another_node_keeps_every_ordinal() {
    let cfg = |seed: &str| SimConfig {
        gpus: 3,
        uuid_seed: seed.into(),
        ..SimConfig::default()
    };
    let (a, b) = (node(cfg("ordinals-a")), node(cfg("ordinals-b")));
    let ca = CudaDriver::load_from(a.libcuda()).unwrap();
    let cb = CudaDriver::load_from(b.libcuda()).unwrap();
    let (ua, ub) = (uuids(&a), uuids(&b));
    let (sa, sb) = (a.uuids(), b.uuids());
    let pair = |old: GpuUuid, new: GpuUuid| GpuPair { old, new };
    let on = |n: &SimNode, pid: i32| -> Vec<GpuUuid> {
        NvmlInventory::load_from(n.libnvml())
            .unwrap()
            .compute_processes()
            .unwrap()
            .into_iter()
            .filter(|p| p.pid == pid as u32)
            .map(|p| p.gpu)
            .collect()
    };
    // Memory on device 1 only, as one rank of a job that sees all three GPUs.
    let mut w = Workload::fill(&a, 4, &["--devices", "1", "--show-ordinals"]);
    let pid = w.pid();
    assert_eq!(w.wait_for("devices "), "devices 3");
    assert_eq!(ordinals_shown(&mut w), sa);

    ca.lock(pid, None).unwrap();
    ca.checkpoint(pid).unwrap();
    // Without pairs the process goes back onto the GPUs it had, which are not on node B.
    let e = cb.restore(pid, &[]).unwrap_err();
    assert_eq!(driver_code(&e), CUDA_ERROR_INVALID_DEVICE, "{e}");
    assert_eq!(cb.state(pid).unwrap(), ProcessState::CHECKPOINTED);
    // Pairs that leave out the GPU the process held memory on are refused as well.
    let e = cb.restore(pid, &[pair(ua[0], ub[2])]).unwrap_err();
    assert_eq!(driver_code(&e), CUDA_ERROR_INVALID_VALUE, "{e}");
    assert_eq!(cb.state(pid).unwrap(), ProcessState::CHECKPOINTED);

    // Every GPU paired: device 0 (no memory on it) onto B's GPU 2, device 1 onto B's GPU 0.
    let pairs = [pair(ua[0], ub[2]), pair(ua[1], ub[0]), pair(ua[2], ub[1])];
    cb.restore(pid, &pairs).unwrap();
    cb.unlock(pid).unwrap();
    assert_eq!(cb.state(pid).unwrap(), ProcessState::RUNNING);
    assert_eq!(
        ordinals_shown(&mut w),
        [sb[2].clone(), sb[0].clone(), sb[1].clone()]
    );
    assert_eq!(on(&b, pid), [ub[0]], "device 1's memory is on B's GPU 0");
    assert!(on(&a, pid).is_empty());

    // Back onto node A with only the GPU it holds memory on paired: device 1 takes A's GPU 2,
    // devices 0 and 2 the GPUs of A left, in order.
    cb.lock(pid, None).unwrap();
    cb.checkpoint(pid).unwrap();
    ca.restore(pid, &[pair(ub[0], ua[2])]).unwrap();
    ca.unlock(pid).unwrap();
    assert_eq!(
        ordinals_shown(&mut w),
        [sa[0].clone(), sa[2].clone(), sa[1].clone()]
    );
    assert_eq!(on(&a, pid), [ua[2]], "device 1's memory is on A's GPU 2");
}

/// The process's resident memory, from `/proc/PID/status`.
fn rss_bytes(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS");
    kib << 10
}

fn custom_node(gpus: u32, seed: &str) -> SimNode {
    node(SimConfig {
        gpus,
        cuda_version: 13050,
        uuid_seed: seed.into(),
        ..SimConfig::default()
    })
}

/// Custom storage: a process's device memory on two GPUs goes to one file per GPU (never
/// through the process's memory), and comes back from them onto two other GPUs of the node,
/// every byte as it was.
#[test]
fn custom_storage_to_files_and_back_onto_other_gpus() {
    let n = custom_node(4, "custom-files");
    let cuda = CudaDriver::load_from(n.libcuda()).unwrap();
    assert!(cuda.custom_storage());
    let u = uuids(&n);
    let mib = 40; // more than one 32 MiB chunk per GPU, the last one partial
    let mut w = Workload::fill(&n, mib, &["--devices", "0,1"]);
    let pid = w.pid();
    let dir = tempfile::tempdir().unwrap();
    let rss_before = rss_bytes(pid);

    cuda.lock(pid, None).unwrap();
    // The process's two GPUs only (GPUs 2 and 3 get no context).
    let files = cuda
        .checkpoint_to(pid, &[u[0], u[1]], dir.path(), "dev-7")
        .unwrap();
    assert_eq!(cuda.state(pid).unwrap(), ProcessState::CHECKPOINTED);
    // Nothing of the device memory went into the process.
    let rss_after = rss_bytes(pid);
    assert!(
        rss_after < rss_before + (8 << 20),
        "RSS grew from {rss_before} to {rss_after} bytes"
    );
    assert_eq!(files.len(), 2, "{files:?}");
    for (i, f) in files.iter().enumerate() {
        assert_eq!(f.name, format!("dev-7-{i}.bin"));
        assert_eq!(f.gpu, u[i]);
        assert_eq!(f.size, mib << 20);
        let bytes = std::fs::read(dir.path().join(&f.name)).unwrap();
        assert_eq!(bytes.len() as u64, f.size);
        assert_eq!(blake3::hash(&bytes).to_hex().to_string(), f.blake3);
        assert!(bytes.iter().any(|b| *b != 0), "{} is all zero", f.name);
        let mode = std::fs::metadata(dir.path().join(&f.name)).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
            0o600
        );
    }
    assert_ne!(files[0].blake3, files[1].blake3);
    let pairs = [
        GpuPair {
            old: u[0],
            new: u[2],
        },
        GpuPair {
            old: u[1],
            new: u[3],
        },
    ];
    cuda.restore_from(pid, &pairs, dir.path(), &files).unwrap();
    assert_eq!(cuda.state(pid).unwrap(), ProcessState::LOCKED);
    cuda.unlock(pid).unwrap();
    assert_eq!(w.verify(), format!("verified {} bytes", 2 * (mib << 20)));
    let nvml = NvmlInventory::load_from(n.libnvml()).unwrap();
    let mut on: Vec<GpuUuid> = nvml
        .compute_processes()
        .unwrap()
        .into_iter()
        .filter(|p| p.pid == pid as u32)
        .map(|p| p.gpu)
        .collect();
    on.sort_by_key(|g| g.0);
    let mut want = vec![u[2], u[3]];
    want.sort_by_key(|g| g.0);
    assert_eq!(on, want, "the process's memory is on GPUs 2 and 3 now");

    // Again, into the same directory: the names are taken, nothing is overwritten, and the
    // process stays LOCKED (refused before the driver is asked).
    cuda.lock(pid, None).unwrap();
    let e = cuda
        .checkpoint_to(pid, &[], dir.path(), "dev-7")
        .unwrap_err();
    assert!(matches!(e, GpuError::Storage { .. }), "{e}");
    assert!(e.to_string().contains("dev-7-0.bin"), "{e}");
    assert!(e.to_string().contains("already exists"), "{e}");
    assert_eq!(cuda.state(pid).unwrap(), ProcessState::LOCKED);
    let again = std::fs::read(dir.path().join("dev-7-0.bin")).unwrap();
    assert_eq!(blake3::hash(&again).to_hex().to_string(), files[0].blake3);
}

/// A changed byte in a device-memory file fails the restore naming the file; the process is
/// left RESTORING, never running on those bytes.
#[test]
fn custom_storage_refuses_a_changed_file() {
    let n = custom_node(1, "custom-corrupt");
    let cuda = CudaDriver::load_from(n.libcuda()).unwrap();
    let w = Workload::fill(&n, 4, &[]);
    let pid = w.pid();
    let dir = tempfile::tempdir().unwrap();
    cuda.lock(pid, None).unwrap();
    let files = cuda.checkpoint_to(pid, &[], dir.path(), "d").unwrap();
    let path = dir.path().join(&files[0].name);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[12345] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let e = cuda.restore_from(pid, &[], dir.path(), &files).unwrap_err();
    assert!(matches!(e, GpuError::Corrupt { .. }), "{e}");
    assert!(e.to_string().contains(&path.display().to_string()), "{e}");
    assert_eq!(cuda.state(pid).unwrap(), ProcessState::RESTORING);
}

/// Before CUDA 13.4 there is no custom storage: the call is refused before the driver sees it,
/// and the staged path works as before.
#[test]
fn no_custom_storage_before_cuda_13_4() {
    let n = node(SimConfig {
        uuid_seed: "custom-old".into(),
        ..SimConfig::default()
    });
    let cuda = CudaDriver::load_from(n.libcuda()).unwrap();
    assert_eq!(cuda.version(), 13000);
    assert!(!cuda.custom_storage());
    let mut w = Workload::fill(&n, 4, &[]);
    let pid = w.pid();
    let dir = tempfile::tempdir().unwrap();
    cuda.lock(pid, None).unwrap();
    let e = cuda.checkpoint_to(pid, &[], dir.path(), "d").unwrap_err();
    assert!(e.to_string().contains("no custom storage"), "{e}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    assert_eq!(cuda.state(pid).unwrap(), ProcessState::LOCKED);
    cuda.checkpoint(pid).unwrap();
    cuda.restore(pid, &[]).unwrap();
    cuda.unlock(pid).unwrap();
    w.verify();
}
