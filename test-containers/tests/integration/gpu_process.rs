//! The GPU layer on plain processes (no container yet): the driver's checkpoint steps through
//! `gpu-ckpt device`, the stack's CRIU for the dump and the restore, on simulated nodes.
//!
//! Each workload checks its own device memory (gpu-train every step against a closed form,
//! gpu-fill every byte on SIGUSR1), so a lost or misplaced byte fails the test.

use std::path::Path;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use simgpu::proto::FaultOp;
use simgpu::testing::{SimConfig, SimNode};
use test_containers::gpuproc::{
    binary, criu_dump, criu_restore, device, device_ok, device_state, train_step, Workload,
};
use test_containers::stack::Stack;

const WAIT: Duration = Duration::from_secs(60);
const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn sim(gpus: u32, memory_mib: u64, seed: &str) -> Result<SimNode> {
    SimNode::start(SimConfig {
        gpus,
        memory_mib,
        uuid_seed: seed.to_string(),
        ..SimConfig::default()
    })
}

fn start(stack: &Stack, node: &SimNode, dir: &Path, bin: &str, args: &[&str]) -> Result<Workload> {
    let out = dir.join(format!("{bin}.out"));
    Workload::spawn(&binary(stack, bin)?, args, &node.env(), &out)
}

/// gpu-train, waited for until it has made `steps` steps; returns it and its last step.
fn train(
    stack: &Stack,
    node: &SimNode,
    dir: &Path,
    extra: &[&str],
    steps: u64,
) -> Result<(Workload, u64)> {
    let mut args = vec!["--interval-ms", "20", "--elements", "65536"];
    args.extend_from_slice(extra);
    let mut w = start(stack, node, dir, "gpu-train", &args)?;
    let k = w.wait_line(WAIT, "gpu-train steps", |l| {
        train_step(l).filter(|k| *k >= steps)
    })?;
    Ok((w, k))
}

/// Waits until gpu-train has gone `more` steps past `after`.
fn advances(w: &mut Workload, after: u64, more: u64) -> Result<u64> {
    w.wait_line(
        WAIT,
        &format!("gpu-train past step {}", after + more),
        |l| train_step(l).filter(|k| *k >= after + more),
    )
}

/// gpu-fill with `mib` MiB per GPU, waited for until filled.
fn fill(stack: &Stack, node: &SimNode, dir: &Path, name: &str, mib: u64) -> Result<Workload> {
    let out = dir.join(format!("{name}.out"));
    let mut w = Workload::spawn(
        &binary(stack, "gpu-fill")?,
        &["--mib", &mib.to_string()],
        &node.env(),
        &out,
    )?;
    w.wait_line(WAIT, "gpu-fill filled", |l| {
        l.starts_with("filled ").then_some(())
    })?;
    Ok(w)
}

/// SIGUSR1, then the `verified <bytes> bytes` line (each verification appends one).
fn verify(w: &mut Workload, bytes: u64) -> Result<()> {
    let before = w.output().matches("verified ").count();
    w.signal(libc::SIGUSR1)?;
    let want = format!("verified {bytes} bytes");
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let out = w.output();
        ensure!(
            !out.contains("MISMATCH"),
            "gpu-fill found wrong data:\n{out}"
        );
        if out.matches("verified ").count() > before {
            ensure!(out.lines().any(|l| l == want), "want {want:?}, got:\n{out}");
            return Ok(());
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "no verification after SIGUSR1:\n{out}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// lock and checkpoint through `gpu-ckpt device`, with the state checked after each.
fn device_checkpoint(stack: &Stack, lib: &Path, pid: i32) -> Result<()> {
    let p = pid.to_string();
    device_ok(
        stack,
        lib,
        &["--pid", &p, "--action", "lock", "--timeout", "10000"],
    )?;
    ensure!(
        device_state(stack, lib, pid)? == "locked",
        "not locked after lock"
    );
    device_ok(stack, lib, &["--pid", &p, "--action", "checkpoint"])?;
    ensure!(
        device_state(stack, lib, pid)? == "checkpointed",
        "not checkpointed after checkpoint"
    );
    Ok(())
}

/// restore (with an optional device map) and unlock, with the state checked after each.
fn device_resume(stack: &Stack, lib: &Path, pid: i32, map: Option<&str>) -> Result<()> {
    let p = pid.to_string();
    let mut args = vec!["--pid", p.as_str(), "--action", "restore"];
    if let Some(m) = map {
        args.extend_from_slice(&["--device-map", m]);
    }
    device_ok(stack, lib, &args)?;
    ensure!(
        device_state(stack, lib, pid)? == "locked",
        "not locked after restore"
    );
    device_ok(stack, lib, &["--pid", &p, "--action", "unlock"])?;
    ensure!(
        device_state(stack, lib, pid)? == "running",
        "not running after unlock"
    );
    Ok(())
}

/// Dumps `w` with CRIU, reaps the original, restores it, and checks it came back as the same
/// pid, still CHECKPOINTED as far as the driver knows.
fn criu_round_trip(stack: &Stack, lib: &Path, w: &mut Workload, dir: &Path) -> Result<()> {
    criu_dump(stack, w.pid, dir)?;
    w.reap()?;
    let pid = criu_restore(stack, dir)?;
    ensure!(pid == w.pid, "CRIU restored pid {pid}, not {}", w.pid);
    ensure!(
        device_state(stack, lib, pid)? == "checkpointed",
        "a restored process keeps its driver state"
    );
    Ok(())
}

/// Runs `gpu-ckpt device` expecting it to fail with `name` in its one-line error; returns it.
fn device_fails(stack: &Stack, lib: &Path, args: &[&str], name: &str) -> Result<String> {
    let out = device(stack, lib, args)?;
    let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
    ensure!(
        !out.status.success(),
        "gpu-ckpt device {} succeeded; want {name}",
        args.join(" ")
    );
    ensure!(
        err.contains(name),
        "gpu-ckpt device {}: want {name}, got: {err}",
        args.join(" ")
    );
    ensure!(err.lines().count() == 1, "one line, got: {err}");
    Ok(err)
}

#[test]
fn training_loop_round_trips_through_criu() -> Result<()> {
    let stack = Stack::discover()?;
    let node = sim(1, 1024, "train")?;
    let dir = tempfile::tempdir()?;
    let (mut w, k) = train(&stack, &node, dir.path(), &[], 3)?;

    // Without the device step CRIU refuses: the driver's connection is a socket it cannot dump.
    let refused = criu_dump(&stack, w.pid, &dir.path().join("no-device")).unwrap_err();
    ensure!(
        format!("{refused:#}").contains("External socket"),
        "criu dump without the device step: {refused:#}"
    );
    let k = advances(&mut w, k, 3).context("the workload runs on after the refused dump")?;

    device_checkpoint(&stack, &node.libcuda(), w.pid)?;
    ensure!(
        node.processes()?.is_empty(),
        "a checkpointed process holds no device memory"
    );
    criu_round_trip(&stack, &node.libcuda(), &mut w, &dir.path().join("img"))?;
    device_resume(&stack, &node.libcuda(), w.pid, None)?;
    advances(&mut w, k, 5).context("gpu-train continues after the restore")?;
    ensure!(
        node.processes()?.iter().any(|p| p.pid == w.pid as u32),
        "NVML lists the restored process again"
    );
    Ok(())
}

#[test]
fn one_gib_filler_round_trips_through_criu() -> Result<()> {
    let stack = Stack::discover()?;
    let node = sim(1, 2048, "fill")?;
    let total = node.node().gpus[0].memory_bytes;
    let dir = tempfile::tempdir()?;
    let mut w = fill(&stack, &node, dir.path(), "fill", 1024)?;
    ensure!(
        node.free_bytes(0)? == total - GIB,
        "the filler holds 1 GiB on the GPU"
    );

    device_checkpoint(&stack, &node.libcuda(), w.pid)?;
    ensure!(
        node.free_bytes(0)? == total,
        "the checkpoint moved the GiB off the GPU"
    );
    criu_round_trip(&stack, &node.libcuda(), &mut w, &dir.path().join("img"))?;
    device_resume(&stack, &node.libcuda(), w.pid, None)?;
    ensure!(
        node.free_bytes(0)? == total - GIB,
        "the restore put the GiB back"
    );
    verify(&mut w, GIB)
}

#[test]
fn restore_on_a_second_node_remaps_the_gpus() -> Result<()> {
    let stack = Stack::discover()?;
    let a = sim(2, 1024, "node-a")?;
    let b = sim(2, 1024, "node-b")?;
    let (ua, ub) = (a.uuids(), b.uuids());
    ensure!(
        ua[0] != ub[0] && ua[1] != ub[1],
        "the two nodes have other UUIDs"
    );
    let dir = tempfile::tempdir()?;
    // One process on two GPUs.
    let (mut w, k) = train(&stack, &a, dir.path(), &["--devices", "all"], 3)?;
    let used: Vec<_> = a
        .processes()?
        .into_iter()
        .filter(|p| p.pid == w.pid as u32)
        .collect();
    ensure!(
        used.len() == 2,
        "gpu-train uses both GPUs of node A: {used:?}"
    );

    device_checkpoint(&stack, &a.libcuda(), w.pid)?;
    criu_round_trip(&stack, &a.libcuda(), &mut w, &dir.path().join("img"))?;
    let map = format!("{}={},{}={}", ua[0], ub[1], ua[1], ub[0]);
    device_resume(&stack, &b.libcuda(), w.pid, Some(&map))?;
    advances(&mut w, k, 5).context("gpu-train continues on node B")?;

    let on_b: Vec<_> = b
        .processes()?
        .into_iter()
        .filter(|p| p.pid == w.pid as u32)
        .collect();
    ensure!(
        on_b.len() == 2,
        "the process uses both GPUs of node B: {on_b:?}"
    );
    ensure!(
        !a.processes()?.iter().any(|p| p.pid == w.pid as u32),
        "node A no longer serves the process"
    );
    Ok(())
}

#[test]
fn two_processes_on_one_gpu_round_trip() -> Result<()> {
    let stack = Stack::discover()?;
    let node = sim(1, 1024, "shared")?;
    let dir = tempfile::tempdir()?;
    let mut first = fill(&stack, &node, dir.path(), "first", 256)?;
    let mut second = fill(&stack, &node, dir.path(), "second", 256)?;
    for (w, name) in [(&mut first, "first"), (&mut second, "second")] {
        device_checkpoint(&stack, &node.libcuda(), w.pid)?;
        criu_round_trip(&stack, &node.libcuda(), w, &dir.path().join(name))?;
    }
    for w in [&first, &second] {
        device_resume(&stack, &node.libcuda(), w.pid, None)?;
    }
    verify(&mut first, 256 * MIB)?;
    verify(&mut second, 256 * MIB)
}

#[test]
fn faults_leave_the_documented_state() -> Result<()> {
    let stack = Stack::discover()?;
    let node = sim(1, 1024, "faults")?;
    let lib = node.libcuda();
    let dir = tempfile::tempdir()?;
    let (mut w, mut k) = train(&stack, &node, dir.path(), &[], 2)?;
    let p = w.pid.to_string();

    // Lock timeout: CUDA_ERROR_TIMEOUT, the process stays RUNNING and runs on.
    node.fault(Some(w.pid), FaultOp::LockTimeout, true)?;
    device_fails(
        &stack,
        &lib,
        &["--pid", &p, "--action", "lock", "--timeout", "300"],
        "CUDA_ERROR_TIMEOUT",
    )?;
    node.fault(Some(w.pid), FaultOp::LockTimeout, false)?;
    ensure!(
        device_state(&stack, &lib, w.pid)? == "running",
        "running after a lock timeout"
    );
    k = advances(&mut w, k, 2)?;

    // Checkpoint failure: the process stays LOCKED with its memory, and unlocks.
    device_ok(&stack, &lib, &["--pid", &p, "--action", "lock"])?;
    node.fault(Some(w.pid), FaultOp::CheckpointFail, true)?;
    device_fails(
        &stack,
        &lib,
        &["--pid", &p, "--action", "checkpoint"],
        "CUDA_ERROR_OPERATING_SYSTEM",
    )?;
    node.fault(Some(w.pid), FaultOp::CheckpointFail, false)?;
    ensure!(
        device_state(&stack, &lib, w.pid)? == "locked",
        "locked after a failed checkpoint"
    );
    device_ok(&stack, &lib, &["--pid", &p, "--action", "unlock"])?;
    k = advances(&mut w, k, 2)?;

    // Restore failure: the process stays CHECKPOINTED, and a second restore succeeds.
    device_checkpoint(&stack, &lib, w.pid)?;
    node.fault(Some(w.pid), FaultOp::RestoreFail, true)?;
    device_fails(
        &stack,
        &lib,
        &["--pid", &p, "--action", "restore"],
        "CUDA_ERROR_OPERATING_SYSTEM",
    )?;
    node.fault(Some(w.pid), FaultOp::RestoreFail, false)?;
    ensure!(
        device_state(&stack, &lib, w.pid)? == "checkpointed",
        "checkpointed after a failed restore"
    );
    device_resume(&stack, &lib, w.pid, None)?;
    advances(&mut w, k, 3)?;

    // Steps in the wrong state: CUDA_ERROR_ILLEGAL_STATE.
    device_fails(
        &stack,
        &lib,
        &["--pid", &p, "--action", "unlock"],
        "CUDA_ERROR_ILLEGAL_STATE",
    )?;
    Ok(())
}

#[test]
fn out_of_memory_at_restore_leaves_the_process_checkpointed() -> Result<()> {
    let stack = Stack::discover()?;
    let node = sim(1, 1024, "oom")?;
    let lib = node.libcuda();
    let dir = tempfile::tempdir()?;
    let mut w = fill(&stack, &node, dir.path(), "victim", 600)?;
    device_checkpoint(&stack, &lib, w.pid)?;
    // Another process takes the memory while the first is checkpointed.
    let hog = fill(&stack, &node, dir.path(), "hog", 600)?;
    let p = w.pid.to_string();
    device_fails(
        &stack,
        &lib,
        &["--pid", &p, "--action", "restore"],
        "CUDA_ERROR_OUT_OF_MEMORY",
    )?;
    ensure!(
        device_state(&stack, &lib, w.pid)? == "checkpointed",
        "checkpointed after an out-of-memory restore"
    );
    drop(hog);
    // The hog's memory is freed when its connection closes.
    let total = node.node().gpus[0].memory_bytes;
    let deadline = std::time::Instant::now() + WAIT;
    while node.free_bytes(0)? != total {
        ensure!(
            std::time::Instant::now() < deadline,
            "the hog's memory was not freed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    device_resume(&stack, &lib, w.pid, None)?;
    verify(&mut w, 600 * MIB)
}

#[test]
fn wrong_gpu_pairs_are_refused() -> Result<()> {
    let stack = Stack::discover()?;
    let a = sim(1, 2048, "pairs-a")?;
    let small = sim(1, 512, "pairs-small")?;
    let other = SimNode::start(SimConfig {
        model: "NVIDIA A100-SXM4-80GB".into(),
        memory_mib: 4096,
        uuid_seed: "pairs-a100".into(),
        ..SimConfig::default()
    })?;
    let dir = tempfile::tempdir()?;
    let mut w = fill(&stack, &a, dir.path(), "fill", 768)?;
    device_checkpoint(&stack, &a.libcuda(), w.pid)?;
    let p = w.pid.to_string();
    let ua = &a.uuids()[0];
    let restore = |lib: &Path, map: &str, name: &str| -> Result<()> {
        device_fails(
            &stack,
            lib,
            &["--pid", &p, "--action", "restore", "--device-map", map],
            name,
        )?;
        ensure!(
            device_state(&stack, lib, w.pid)? == "checkpointed",
            "still checkpointed after {map}"
        );
        Ok(())
    };
    // Too little memory on the target GPU.
    restore(
        &small.libcuda(),
        &format!("{ua}={}", small.uuids()[0]),
        "CUDA_ERROR_OUT_OF_MEMORY",
    )?;
    // Another model.
    restore(
        &other.libcuda(),
        &format!("{ua}={}", other.uuids()[0]),
        "CUDA_ERROR_INVALID_DEVICE",
    )?;
    // A GPU the node does not have.
    restore(
        &small.libcuda(),
        &format!("{ua}={}", other.uuids()[0]),
        "CUDA_ERROR_INVALID_DEVICE",
    )?;
    // Pairs that leave out the checkpointed GPU.
    restore(
        &a.libcuda(),
        &format!("{}={ua}", small.uuids()[0]),
        "CUDA_ERROR_INVALID_VALUE",
    )?;
    // The right GPU still takes it back, every byte intact.
    device_resume(&stack, &a.libcuda(), w.pid, None)?;
    verify(&mut w, 768 * MIB)
}
