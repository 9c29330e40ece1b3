//! What the tests against the simulated driver share: a node, its GPUs' UUIDs, and `gpu-fill`
//! processes that hold device memory and verify it on demand.
#![allow(dead_code)] // each test binary uses its own part

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use gpu::GpuUuid;
use simgpu::testing::{SimConfig, SimNode};

pub fn node(cfg: SimConfig) -> SimNode {
    SimNode::start(cfg).expect("start the simulated node (build the workspace first)")
}

pub fn uuids(n: &SimNode) -> Vec<GpuUuid> {
    n.uuids()
        .iter()
        .map(|u| u.parse().expect("sim UUID"))
        .collect()
}

/// `gpu-fill`: `$GPU_CKPT_GPU_FILL`, else next to the test executable or one level up.
pub fn gpu_fill_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("GPU_CKPT_GPU_FILL") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent();
    for _ in 0..2 {
        let Some(d) = dir else { break };
        let cand = d.join("gpu-fill");
        if cand.is_file() {
            return cand;
        }
        dir = d.parent();
    }
    panic!(
        "gpu-fill not found next to {}: build the workspace first (cargo build --workspace)",
        exe.display()
    )
}

/// A workload process on a node; killed when dropped.
pub struct Workload {
    child: Child,
    lines: Receiver<String>,
    seen: Vec<String>,
}

impl Workload {
    /// `gpu-fill --mib MIB [extra]` with the node's environment; waits until it has filled.
    pub fn fill(n: &SimNode, mib: u64, extra: &[&str]) -> Workload {
        Self::fill_env(n, mib, extra, &[])
    }

    /// [`Workload::fill`] with `env` added to the node's environment.
    pub fn fill_env(n: &SimNode, mib: u64, extra: &[&str], env: &[(&str, &str)]) -> Workload {
        let mut cmd = Command::new(gpu_fill_binary());
        cmd.args(["--mib", &mib.to_string()])
            .args(extra)
            .envs(n.env())
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("spawn gpu-fill");
        let out = child.stdout.take().expect("stdout");
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut w = Workload {
            child,
            lines,
            seen: Vec::new(),
        };
        w.wait_for("filled ");
        w
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The next line starting with `prefix`; panics after 30 s or at end of output.
    pub fn wait_for(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if l.starts_with(prefix) {
                        return l;
                    }
                    assert!(!l.starts_with("MISMATCH"), "workload: {l}");
                }
                Err(RecvTimeoutError::Timeout) => {
                    panic!(
                        "no {prefix:?} from the workload in 30 s; it printed {:?}",
                        self.seen
                    )
                }
                Err(RecvTimeoutError::Disconnected) => {
                    panic!(
                        "the workload ended before {prefix:?}; it printed {:?}",
                        self.seen
                    )
                }
            }
        }
    }

    /// Asks the workload to check every byte it put on the device.
    pub fn verify(&mut self) -> String {
        signal(self.pid(), libc::SIGUSR1);
        self.wait_for("verified ")
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a child this test started.
    let rc = unsafe { libc::kill(pid, sig) };
    assert_eq!(rc, 0, "kill({pid}, {sig})");
}
