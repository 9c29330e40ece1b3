//! The workloads on the simulated driver: they run, and a checkpoint/restore (with the two GPUs
//! swapped) in the middle of a run loses nothing. Needs the simulator's daemon and libraries
//! (`cargo build -p gpu-ckpt-simgpu -p gpu-ckpt-simcuda -p gpu-ckpt-simnvml -p
//! gpu-ckpt-simnccl`); where they are not built, each test says so and passes.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use gpu::{DeviceCheckpoint, GpuPair, GpuUuid, ProcessState};
use simgpu::testing::{SimConfig, SimNode};

/// A simulated node with two GPUs. The workspace must be built (`make build`, which the test
/// command runs first): a missing daemon fails the test, it never skips it.
fn node() -> SimNode {
    let cfg = SimConfig {
        gpus: 2,
        memory_mib: 1024,
        ..SimConfig::default()
    };
    SimNode::start(cfg).unwrap_or_else(|e| panic!("simulated node: {e:#}"))
}

fn cmd(sim: &SimNode, bin: &str) -> Command {
    let mut c = Command::new(bin);
    c.envs(sim.env())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    c
}

/// Spawns and forwards stdout lines over a channel.
fn spawn_lines(mut c: Command) -> (Child, Receiver<String>) {
    let mut child = c.spawn().expect("spawn");
    let out = child.stdout.take().expect("stdout");
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

fn wait_line(rx: &Receiver<String>, seen: &mut Vec<String>, pred: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let l = rx
            .recv_timeout(left)
            .unwrap_or_else(|e| panic!("no expected line ({e}); so far: {seen:?}"));
        seen.push(l.clone());
        assert!(!l.starts_with("MISMATCH"), "{l}");
        if pred(&l) {
            return l;
        }
    }
}

fn swap_pairs(sim: &SimNode) -> Vec<GpuPair> {
    let u: Vec<GpuUuid> = sim.uuids().iter().map(|s| s.parse().unwrap()).collect();
    vec![
        GpuPair {
            old: u[0],
            new: u[1],
        },
        GpuPair {
            old: u[1],
            new: u[0],
        },
    ]
}

/// lock, checkpoint, a pause, restore onto swapped GPUs, unlock.
fn round_trip(sim: &SimNode, pid: i32) {
    let ck = gpu::CudaDriver::load_from(sim.libcuda()).expect("load sim libcuda");
    ck.lock(pid, Some(Duration::from_secs(10))).expect("lock");
    ck.checkpoint(pid).expect("checkpoint");
    assert_eq!(ck.state(pid).unwrap(), ProcessState::CHECKPOINTED);
    std::thread::sleep(Duration::from_millis(300));
    ck.restore(pid, &swap_pairs(sim)).expect("restore");
    ck.unlock(pid).expect("unlock");
    assert_eq!(ck.state(pid).unwrap(), ProcessState::RUNNING);
}

fn step_of(l: &str) -> Option<(u64, String)> {
    let mut w = l.split_whitespace();
    match (w.next(), w.next(), w.next(), w.next()) {
        (Some("step"), Some(k), Some("checksum"), Some(c)) => {
            Some((k.parse().ok()?, c.to_string()))
        }
        _ => None,
    }
}

#[test]
fn train_continues_after_checkpoint_and_restore() {
    let sim = node();
    let train = env!("CARGO_BIN_EXE_gpu-train");
    let args = ["--devices", "all", "--elements", "4096", "--seed", "5"];

    // The reference: the same sequence without interruption.
    let out = cmd(&sim, train)
        .args(args)
        .args(["--steps", "40", "--interval-ms", "0"])
        .output()
        .expect("reference run");
    assert!(out.status.success(), "{out:?}");
    let reference: Vec<(u64, String)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(step_of)
        .collect();
    assert_eq!(reference.len(), 40);

    let mut c = cmd(&sim, train);
    c.args(args).args(["--interval-ms", "10"]);
    let (mut child, rx) = spawn_lines(c);
    let mut seen = Vec::new();
    wait_line(&rx, &mut seen, |l| l.starts_with("step 5 "));
    round_trip(&sim, child.id() as i32);
    wait_line(&rx, &mut seen, |l| l.starts_with("step 40 "));
    let _ = child.kill();
    let _ = child.wait();

    let steps: Vec<(u64, String)> = seen.iter().filter_map(|l| step_of(l)).collect();
    assert_eq!(steps, reference, "output: {seen:?}");
}

#[test]
fn fill_verifies_after_checkpoint_and_restore() {
    let sim = node();
    let mut c = cmd(&sim, env!("CARGO_BIN_EXE_gpu-fill"));
    c.args(["--mib", "8", "--devices", "all", "--seed", "3"]);
    let (mut child, rx) = spawn_lines(c);
    let mut seen = Vec::new();
    let l = wait_line(&rx, &mut seen, |l| l.starts_with("filled "));
    assert_eq!(l, "filled 16777216 bytes on 2 GPUs");
    let pid = child.id() as i32;
    round_trip(&sim, pid);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid, libc::SIGUSR1) };
    let l = wait_line(&rx, &mut seen, |l| l.starts_with("verified "));
    assert_eq!(l, "verified 16777216 bytes");
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let st = child.wait().unwrap();
    assert!(st.success(), "{st:?}");
}

#[test]
fn fill_verify_and_exit() {
    let sim = node();
    let out = cmd(&sim, env!("CARGO_BIN_EXE_gpu-fill"))
        .args(["--mib", "70", "--devices", "1", "--verify-and-exit"])
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}");
    assert_eq!(
        s,
        "filled 73400320 bytes on 1 GPUs\nverified 73400320 bytes\n"
    );
}

/// cuda_smoke, built with the C compiler alone.
fn cuda_smoke(dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("c/cuda_smoke.c");
    let bin = dir.join("cuda_smoke");
    let st = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-O2", "-Wall", "-Werror", "-o"])
        .arg(&bin)
        .arg(&src)
        .arg("-ldl")
        .status();
    match st {
        Ok(s) if s.success() => bin,
        other => panic!("building cuda_smoke.c with cc failed: {other:?}"),
    }
}

#[test]
fn cuda_smoke_runs() {
    let sim = node();
    let bin = cuda_smoke(sim.dir());
    let out = cmd(&sim, bin.to_str().unwrap()).output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}");
    assert!(s.ends_with("cuda_smoke ok\n"), "{s}");
}

#[test]
fn gpu_check_passes_on_the_simulator() {
    let sim = node();
    let smoke = cuda_smoke(sim.dir());
    let work = sim.dir().join("gpu-check");
    let out = cmd(&sim, env!("CARGO_BIN_EXE_gpu-ckpt-gpu-check"))
        .args(["--mib", "32", "--no-criu", "--deadline-s", "120"])
        .arg("--fill")
        .arg(env!("CARGO_BIN_EXE_gpu-fill"))
        .arg("--train")
        .arg(env!("CARGO_BIN_EXE_gpu-train"))
        .arg("--smoke")
        .arg(&smoke)
        .arg("--work-dir")
        .arg(&work)
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}");
    assert!(s.ends_with("gpu-check ok\n"), "{s}");
    for fig in [
        "cuinit ",
        "checkpoint ",
        "restore ",
        "ratio_restore_vs_pinned_h2d ",
    ] {
        assert!(s.lines().any(|l| l.starts_with(fig)), "no {fig:?} in {s}");
    }
    assert!(s.contains("# restore remaps "), "{s}");
}

/// cudarc's safe driver API (context, default stream, alloc, copies, memset, device facts) on
/// the simulated driver.
#[test]
fn cudarc_runs() {
    let sim = node();
    let out = cmd(&sim, env!("CARGO_BIN_EXE_cudarc-smoke"))
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{s}{e}");
    assert!(s.contains("devices 2\n"), "{s}");
    assert!(
        s.contains("device 0 NVIDIA H100 80GB HBM3 sm_90 1073741824 bytes\n"),
        "{s}"
    );
    assert!(s.ends_with("cudarc ok\n"), "{s}");
}
