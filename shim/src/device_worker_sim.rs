//! [`WorkerDriver`] against the simulated driver (`gpu/sim`): the shim's own binary as the
//! worker, `gpu-fill` as the GPU processes. Needs the workspace built first
//! (`cargo build --workspace --all-targets`): the shim, `gpu-ckpt-simgpu` and `gpu-fill` are
//! found in the target directory above the test executable.

use std::io::{BufRead, BufReader, Lines};
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use gpu::{DeviceCheckpoint, ProcessState};
use simgpu::proto::FaultOp;
use simgpu::testing::{SimConfig, SimNode};

use super::{Bounds, WorkerDriver, WORKER_ARG};

/// A binary of the workspace: in the target directory that holds `deps/<this test>`.
fn built(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let p = dir.join(name);
    assert!(
        p.is_file(),
        "{} missing: build the workspace first (cargo build --workspace --all-targets)",
        p.display()
    );
    p
}

/// `gpu-fill` on one GPU, with its output read line by line; killed when dropped.
struct Filler {
    child: Child,
    out: Lines<BufReader<ChildStdout>>,
}

impl Filler {
    fn start(n: &SimNode, gpu: &str) -> Filler {
        let mut child = Command::new(built("gpu-fill"))
            .args(["--mib", "8", "--devices", gpu])
            .envs(n.env())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn gpu-fill");
        let out = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let mut f = Filler { child, out };
        f.line("filled ");
        f
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The next line that starts with `prefix`.
    fn line(&mut self, prefix: &str) -> String {
        for l in self.out.by_ref().map_while(Result::ok) {
            assert!(!l.starts_with("MISMATCH"), "gpu-fill: {l}");
            if l.starts_with(prefix) {
                return l;
            }
        }
        panic!("gpu-fill ended before {prefix:?}")
    }

    fn verify(&mut self) -> String {
        // SAFETY: kill(2) on a child of this test.
        assert_eq!(unsafe { libc::kill(self.pid(), libc::SIGUSR1) }, 0);
        self.line("verified ")
    }
}

impl Drop for Filler {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits for `what` (the condition of another thread's progress), up to a minute.
fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Two calls on two processes at once: the checkpoint of one held in the driver (the
/// simulator's hang injection) while the other process checkpoints to files and restores from
/// them through another worker; abandoning the held one kills only its worker.
#[test]
fn calls_on_two_processes_run_at_once() {
    let n = SimNode::start(SimConfig {
        gpus: 2,
        cuda_version: 13050,
        uuid_seed: "worker-pool".into(),
        ..SimConfig::default()
    })
    .expect("start the simulated node (build the workspace first)");
    let bounds = Bounds {
        lock_margin: Duration::from_secs(30),
        call: Duration::from_secs(120),
        per_gib: Duration::from_secs(30),
        read: Duration::from_secs(30),
    };
    let d = WorkerDriver::with_program(
        built("containerd-shim-gpu-ckpt-v1"),
        vec![WORKER_ARG.into(), n.lib_dir().display().to_string()],
        bounds,
    )
    .expect("start a device worker");
    assert!(d.custom_storage());
    let held = Filler::start(&n, "0");
    let mut free = Filler::start(&n, "1");
    let (a, b) = (held.pid(), free.pid());
    d.lock(a, None).unwrap();
    d.lock(b, None).unwrap();
    n.fault(Some(a), FaultOp::CheckpointHang, true).unwrap();
    let dir = tempfile::tempdir().unwrap();

    std::thread::scope(|s| {
        let stuck = s.spawn(|| d.checkpoint(a));
        wait_until(
            "the checkpoint of the held process is in the driver",
            || d.calls_in_flight() == [a] && n.last_args("cuCheckpointProcessCheckpoint").is_ok(),
        );
        // The other process goes through its whole checkpoint and restore meanwhile.
        let files = d.checkpoint_to(b, &[], dir.path(), "b").unwrap();
        assert_eq!(files.len(), 1);
        assert_eq!(files[0].size, 8 << 20);
        assert_eq!(d.state(b).unwrap(), ProcessState::CHECKPOINTED);
        d.restore_from(b, &[], dir.path(), &files).unwrap();
        d.unlock(b).unwrap();
        assert_eq!(
            d.calls_in_flight(),
            [a],
            "the held call is still in the driver"
        );
        assert!(!stuck.is_finished());
        // Killing the held process's call ends it, and only it.
        d.abandon(a);
        let err = stuck.join().unwrap().unwrap_err().to_string();
        assert!(err.contains("abandoned"), "{err}");
    });
    assert!(d.calls_in_flight().is_empty());
    assert_eq!(d.state(b).unwrap(), ProcessState::RUNNING);
    assert_eq!(free.verify(), "verified 8388608 bytes");
    // The held process was left LOCKED by the abandoned checkpoint (its calls now fail at once).
    n.fault(Some(a), FaultOp::CheckpointHang, false).unwrap();
    assert!(d.state(a).unwrap_err().to_string().contains("abandoned"));
}
