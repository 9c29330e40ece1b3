//! What the CUDA driver cannot checkpoint, refused before any device lock: a container on a
//! GPU in MIG mode (given by its CDI device node, as a MIG instance with its capability nodes, or
//! by UUID in `NVIDIA_VISIBLE_DEVICES`), a GPU
//! process that maps NVIDIA's real NCCL (`libnccl.so.2` of the pinned
//! `nvidia-nccl-cu13` wheel in the stack's venv), and an MPS client (its libcuda found a live
//! MPS control socket in `/tmp/nvidia-mps`). Each `ctr task checkpoint` fails naming what it
//! refuses, and gpu-train goes on computing (every step checked against its closed form); a
//! plain GPU container on the same node still checkpoints, and its checkpoint restored onto the
//! MIG-mode GPU is refused before CRIU.

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::{gpu::*, restore_from_dir, run_detached, wait_until, workloads, RUNTIME};
use anyhow::{ensure, Context, Result};
use test_containers::stack::{Node, GPU_WORKLOADS_IMAGE};

const TRAIN: &[&str] = &[
    "/usr/bin/gpu-train",
    "--elements",
    "4096",
    "--interval-ms",
    "50",
];

/// The pinned NCCL library in the stack's venv (test-containers/stack/install.sh).
fn nccl_lib() -> Result<PathBuf> {
    nccl_wheel_file("lib/libnccl.so.2")
}

/// gpu-train on `device` with `extra` ctr flags, up to its third step; its pid and log.
fn train(node: &Node, device: &str, extra: &[&str], id: &str) -> Result<(i32, PathBuf)> {
    let log = node.paths().dir.join(format!("{id}.log"));
    let pid = run_gpu_with(
        node,
        Runtime::GpuCkpt,
        &format!("{KIND}={device}"),
        extra,
        id,
        &log,
        TRAIN,
    )?;
    wait_steps(&log, 3).with_context(|| format!("{id} before its checkpoint"))?;
    Ok((pid, log))
}

/// `ctr task checkpoint` of `id` is refused naming each of `needles`; then the training goes on
/// from where it was, step by step.
fn refused(node: &Node, id: &str, log: &Path, needles: &[&str]) -> Result<()> {
    let out = node.ctr(&["task", "checkpoint", id])?;
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    ensure!(!out.status.success(), "{id}: the checkpoint succeeded");
    for n in needles {
        ensure!(
            err.contains(n),
            "{id}: the refusal does not name {n:?}: {err}"
        );
    }
    println!("{id}: {}", err.trim());
    let now = last_step(log).map(|s| s.0).unwrap_or_default();
    wait_steps_after(log, now, 5).with_context(|| format!("{id} after the refusal"))?;
    ensure!(
        node.task_status(id)?.contains("RUNNING"),
        "{id} is not running after the refusal"
    );
    Ok(())
}

#[test]
fn mig_nccl_and_mps_are_refused_and_the_workload_runs_on() -> Result<()> {
    let sim = sim_node(simgpu::testing::SimConfig {
        mig_gpus: vec![1],
        ..gpus_config(2, 256, "unsupported")
    })?;
    let node = gpu_node("gpu-unsupported", &sim, &[])?;
    let uuids = sim.uuids();
    let step = "checkpoint failed at step unsupported";

    // 1. GPU 1 is in MIG mode (NVML's nvmlDeviceGetMigMode), given through its CDI device node.
    let (_, log) = train(&node, "1", &[], "mig")?;
    let r = refused(
        &node,
        "mig",
        &log,
        &[step, &uuids[1], "MIG mode", "runs on untouched"],
    );
    remove(&node, "mig");
    r?;

    // 1b. A MIG instance of it, as nvidia-container-toolkit's CDI spec gives one: its parent's
    //     device node and the instance's capability nodes.
    let (_, log) = train(&node, "1:0", &[], "mig-instance")?;
    let r = refused(
        &node,
        "mig-instance",
        &log,
        &[
            step,
            "the container is given MIG device node /dev/nvidia-caps/nvidia-cap",
            "runs on untouched",
        ],
    );
    remove(&node, "mig-instance");
    r?;

    // 1c. The same GPU named by UUID in NVIDIA_VISIBLE_DEVICES (the legacy runtime's way), no
    //     CDI device and no GPU process: refused all the same.
    let visible = format!("NVIDIA_VISIBLE_DEVICES={}", uuids[1]);
    run_detached(
        &node,
        &["--env", &visible, workloads(), "visible", "sleep", "1000"],
    )?;
    let out = node.ctr(&["task", "checkpoint", "visible"])?;
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let status = node.task_status("visible");
    remove(&node, "visible");
    ensure!(
        !out.status.success(),
        "NVIDIA_VISIBLE_DEVICES: the checkpoint succeeded"
    );
    for n in [
        step,
        "through NVIDIA_VISIBLE_DEVICES",
        &uuids[1],
        "MIG mode",
    ] {
        ensure!(err.contains(n), "the refusal does not name {n:?}: {err}");
    }
    ensure!(
        status?.contains("RUNNING"),
        "the NVIDIA_VISIBLE_DEVICES container is not running after the refusal"
    );
    println!("visible: {}", err.trim());

    // 2. NVIDIA's libnccl.so.2 loaded into gpu-train (with the libstdc++ it needs), on GPU 0.
    let lib = nccl_lib()?;
    let dir = lib
        .parent()
        .context("NCCL's directory")?
        .display()
        .to_string();
    let nccl_mount = format!("type=bind,src={dir},dst=/opt/nccl,options=rbind:ro");
    let cxx = "type=bind,src=/usr/lib/x86_64-linux-gnu/libstdc++.so.6,dst=/usr/lib/x86_64-linux-gnu/libstdc++.so.6,options=rbind:ro";
    let (pid, log) = train(
        &node,
        "0",
        &[
            "--mount",
            &nccl_mount,
            "--mount",
            cxx,
            "--env",
            "LD_PRELOAD=/opt/nccl/libnccl.so.2",
        ],
        "nccl",
    )?;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    ensure!(
        maps.contains("/opt/nccl/libnccl.so.2"),
        "gpu-train does not map NCCL"
    );
    let r = refused(
        &node,
        "nccl",
        &log,
        &[
            step,
            &format!("pid {pid} (gpu-train"),
            "maps NCCL (/opt/nccl/libnccl.so.2) without gpu-ckpt's NCCL layer: set the annotation gpu-ckpt.io/nccl: managed (or the handler option Nccl = \"managed\") and start the container again",
        ],
    );
    remove(&node, "nccl");
    r?;

    // 3. An MPS control daemon's socket in the container's /tmp/nvidia-mps: its libcuda runs
    //    as an MPS client, and NVML lists it among the MPS processes.
    let mps = tempfile::Builder::new().prefix("mps-").tempdir()?;
    let _control = UnixListener::bind(mps.path().join("control"))?;
    let mps_mount = format!(
        "type=bind,src={},dst=/tmp/nvidia-mps,options=rbind:rw",
        mps.path().display()
    );
    let (pid, log) = train(&node, "0", &["--mount", &mps_mount], "mps")?;
    ensure!(
        sim.processes()?
            .iter()
            .any(|p| p.pid == pid as u32 && p.mps),
        "the driver does not see pid {pid} as an MPS client"
    );
    let r = refused(
        &node,
        "mps",
        &log,
        &[step, &format!("pid {pid} (gpu-train"), "MPS client"],
    );
    remove(&node, "mps");
    r?;

    // 4. The same workload, plain, on GPU 0: checkpointed, and training on; then checkpointed
    //    with --exit and restored onto GPU 1, in MIG mode: refused before CRIU.
    let (pid, log) = train(&node, "0", &[], "plain")?;
    let r = (|| {
        let out = node.ctr(&["task", "checkpoint", "plain"])?;
        ensure!(
            out.status.success(),
            "a plain GPU container's checkpoint failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let now = last_step(&log).map(|s| s.0).unwrap_or_default();
        wait_steps_after(&log, now, 3)?;
        // ctr names a checkpoint's image by the second: the next one must not share it.
        std::thread::sleep(Duration::from_millis(1100));
        let dir = node.paths().dir.join("plain-exit");
        node.checkpoint_task_exit("plain", &dir)?;
        wait_until(
            Duration::from_secs(10),
            "the checkpointed task to stop",
            || (!Path::new(&format!("/proc/{pid}")).exists()).then_some(()),
        )?;
        remove(&node, "plain");
        let device = format!("{KIND}=1");
        let mut create = vec!["container", "create", "--device", &device];
        create.extend(["--runtime", RUNTIME, GPU_WORKLOADS_IMAGE, "plain"]);
        create.extend_from_slice(TRAIN);
        let out = node.ctr_cdi("default", &create)?;
        ensure!(
            out.status.success(),
            "ctr container create: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let err = match restore_from_dir(&node, "plain", &dir) {
            Ok(pid) => anyhow::bail!("the restore onto GPU 1, in MIG mode, runs as pid {pid}"),
            Err(e) => format!("{e:#}"),
        };
        println!("restore onto GPU 1: {err}");
        for n in [
            "restore failed at step compat",
            "mig: ",
            &uuids[1],
            "MIG mode",
        ] {
            ensure!(
                err.contains(n),
                "the refused restore does not name {n:?}: {err}"
            );
        }
        // Nothing restored runs: no task but a stopped one, nothing on the MIG-mode GPU.
        let status = node.task_status("plain").unwrap_or_default();
        ensure!(
            !status.contains("RUNNING") && !status.contains("PAUSED"),
            "after the refused restore the task is {status}"
        );
        let on_mig = sim.node().gpus[1].uuid;
        ensure!(
            !sim.processes()?.iter().any(|p| p.gpu == on_mig),
            "a process uses the MIG-mode GPU after the refused restore"
        );
        Ok(())
    })();
    remove(&node, "plain");
    r
}
