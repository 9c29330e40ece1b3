//! Driver calls that never return (the simulator's `lock-hang`, `checkpoint-hang` and
//! `state-hang` faults): a checkpoint through ctr and through CRI fails at the call's bound
//! (small ones, from the node's handler options) with an error naming the call, its pid and the
//! bound; the shim answers another request of the same container meanwhile; the workload goes on;
//! and `ctr task kill`, CRI StopContainer and RemoveContainer then finish within seconds. A
//! SIGKILL that comes while the call hangs ends it at once, long before its bound.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::common::{gpu::*, *};
use anyhow::{ensure, Result};
use simgpu::proto::FaultOp;
use test_containers::{
    cri::{ContainerSpec, Cri, PodSpec},
    stack::{Node, GPU_CKPT_HANDLER, GPU_WORKLOADS_IMAGE},
};

/// The handler's bounds: a lock may take its timeout (2 s) plus 2 s; a checkpoint 3 s plus 1 s
/// per GiB (gpu-train holds one 2 MiB granule, so 4 s once rounded up to whole seconds); a
/// state read 2 s.
const OPTIONS: &[(&str, &str)] = &[
    ("DeviceLockTimeout", "2s"),
    ("DeviceLockMargin", "2s"),
    ("DeviceCallTimeout", "3s"),
    ("DeviceCallTimeoutPerGiB", "1s"),
    ("DeviceReadTimeout", "2s"),
];

/// Each fault, the driver call it leaves unanswered, and that call's bound under [`OPTIONS`]
/// (the state-hang fault catches the state read the lock makes to confirm LOCKED).
const CASES: &[(FaultOp, &str, &str)] = &[
    (FaultOp::LockHang, "cuCheckpointProcessLock", "4s"),
    (
        FaultOp::CheckpointHang,
        "cuCheckpointProcessCheckpoint",
        "4s",
    ),
    (FaultOp::StateHang, "cuCheckpointProcessGetState", "2s"),
];

const TRAIN: &[&str] = &[
    "/usr/bin/gpu-train",
    "--elements",
    "4096",
    "--interval-ms",
    "100",
];

/// Longest a failed checkpoint may take past its bound (the undo's calls, each bounded too, and
/// a fresh worker's start), and longest a kill or remove may take.
const SLACK: Duration = Duration::from_secs(15);

/// The checkpoint's error names the call, the pid and the bound, and came no sooner than the
/// bound.
fn check_error(err: &str, took: Duration, call: &str, pid: i32, bound: &str) -> Result<()> {
    let needle = format!("{call}(pid {pid}) did not return within {bound}");
    ensure!(
        err.contains(&needle),
        "the error does not name {needle:?}: {err}"
    );
    let secs: u64 = bound.trim_end_matches('s').parse()?;
    ensure!(
        took >= Duration::from_secs(secs) && took < Duration::from_secs(secs) + SLACK,
        "the checkpoint failed after {took:?}, bound {bound}"
    );
    Ok(())
}

/// `ctr task ps` of `peer`, another container served by the same shim, while a checkpoint
/// hangs: the shim answers at once (its runtime is not blocked by the driver call).
fn shim_answers(node: &Node, ns: &str, peer: &str) -> Result<()> {
    let t = Instant::now();
    let out = node.ctr_ns(ns, &["task", "ps", peer])?;
    let took = t.elapsed();
    ensure!(
        out.status.success(),
        "ctr task ps {peer} during the hang: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        took < Duration::from_secs(2),
        "the shim took {took:?} to answer for {peer} during the hang"
    );
    Ok(())
}

/// ctr's containers share one shim, as a pod's do: runc-v2's group annotation.
const GROUP: &str = "io.containerd.runc.v2.group=bound";

/// `ctr run -d` in the shared shim of `cmd`, with `device` when given, logging to `log`.
fn ctr_run(node: &Node, id: &str, device: Option<&str>, log: &Path, cmd: &[&str]) -> Result<i32> {
    let _ = std::fs::remove_file(log);
    let log_uri = format!("file://{}", log.display());
    let flags = run_flags(node);
    let mut args: Vec<&str> = vec!["run", "-d", "--log-uri", &log_uri, "--annotation", GROUP];
    if let Some(d) = device {
        args.extend(["--device", d]);
    }
    args.extend(flags.iter().map(String::as_str));
    args.extend([GPU_WORKLOADS_IMAGE, id]);
    args.extend_from_slice(cmd);
    let out = node.ctr_cdi("default", &args)?;
    ensure!(
        out.status.success(),
        "ctr {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    node.task_pid(id)
}

/// The workload's log goes on after the failed checkpoint.
fn goes_on(log: &Path, what: &str) -> Result<()> {
    let now = last_step(log).map(|s| s.0).unwrap_or_default();
    wait_steps_after(log, now, 2)
        .map_err(|e| e.context(format!("{what}: the training stopped")))?;
    Ok(())
}

#[test]
fn hung_driver_calls_fail_at_their_bound_and_the_container_stays_killable() -> Result<()> {
    let sim = sim_gpus(1, 256, "bound")?;
    let node = gpu_node("gpu-bound", &sim, OPTIONS)?;
    let dir = node.paths().dir.clone();

    // ctr: one task per fault, checkpointed with `ctr task checkpoint`, beside a peer task of
    // the same shim.
    let device = format!("{KIND}=0");
    ctr_run(
        &node,
        "peer",
        None,
        &dir.join("peer.log"),
        &["/bin/sh", "-c", "sleep 600"],
    )?;
    for (n, &(fault, call, bound)) in CASES.iter().enumerate() {
        let id = format!("hang{n}");
        let log = dir.join(format!("{id}.log"));
        let pid = ctr_run(&node, &id, Some(&device), &log, TRAIN)?;
        wait_steps(&log, 3)?;
        sim.fault(Some(pid), fault, true)?;
        let image = dir.join(format!("{id}-ckpt"));
        let start = Instant::now();
        let (out, took, answered_at) = std::thread::scope(|s| -> Result<_> {
            let ckpt = s.spawn(|| {
                let out = node.ctr(&[
                    "task",
                    "checkpoint",
                    "--image-path",
                    &image.display().to_string(),
                    &id,
                ]);
                (out, start.elapsed())
            });
            std::thread::sleep(Duration::from_millis(1000));
            let answered = shim_answers(&node, "default", "peer");
            let answered_at = start.elapsed();
            let (out, took) = ckpt
                .join()
                .map_err(|_| anyhow::anyhow!("the checkpoint thread panicked"))?;
            answered?;
            Ok((out, took, answered_at))
        })?;
        ensure!(
            answered_at < took,
            "the shim answered only after the checkpoint returned"
        );
        let out = out?;
        let err = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
        println!("ctr {fault:?} after {took:?}: {err}");
        ensure!(
            !out.status.success(),
            "ctr task checkpoint succeeded under {fault:?}"
        );
        check_error(&err, took, call, pid, bound)?;
        sim.fault(Some(pid), fault, false)?;
        goes_on(&log, &format!("ctr, after {fault:?}"))?;

        let t = Instant::now();
        node.ctr_ok(&["task", "kill", "-s", "SIGKILL", &id])?;
        wait_until(SLACK, "the killed task to stop", || {
            node.task_status(&id)
                .ok()
                .filter(|s| s == "STOPPED")
                .map(|_| ())
        })?;
        node.ctr_ok(&["task", "delete", &id])?;
        node.ctr_ok(&["container", "rm", &id])?;
        let killed = t.elapsed();
        println!("ctr {fault:?}: killed and removed in {killed:?}");
        ensure!(
            killed < Duration::from_secs(5),
            "kill and delete after {fault:?} took {killed:?}"
        );
    }

    // CRI: one pod, a container per fault, checkpointed with CheckpointContainer.
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        cri.pull_image(GPU_WORKLOADS_IMAGE).await?;
        let pod = cri
            .run_pod(&PodSpec::new("bound", node.pod_log_root()).handler(GPU_CKPT_HANDLER))
            .await?;
        for (n, &(fault, call, bound)) in CASES.iter().enumerate() {
            let name = format!("train{n}");
            let spec = ContainerSpec::new(&name, GPU_WORKLOADS_IMAGE)
                .command(&TRAIN[..1])
                .args(&TRAIN[1..])
                .annotation(
                    &format!("cdi.k8s.io/gpu-ckpt-sim_{name}"),
                    &format!("{KIND}=0"),
                );
            let id = cri.run_container(&pod, &spec).await?;
            let log = pod.container_log(&name);
            wait_steps(&log, 3)?;
            let pid = cri_pid(&cri, &id).await?;
            sim.fault(Some(pid), fault, true)?;
            let archive = dir.join(format!("{name}.tar"));
            let t = Instant::now();
            // The pod's sandbox is a task of the same shim.
            let ps = async {
                tokio::time::sleep(Duration::from_millis(1000)).await;
                let r = shim_answers(&node, "k8s.io", &pod.id);
                (r, t.elapsed())
            };
            let ckpt = async {
                let r = cri.checkpoint_container(&id, &archive, 60).await;
                (r, t.elapsed())
            };
            let ((result, took), (answered, answered_at)) = tokio::join!(ckpt, ps);
            answered?;
            ensure!(
                answered_at < took,
                "the shim answered only after the checkpoint returned"
            );
            let err = match result {
                Ok(()) => anyhow::bail!("CRI checkpoint succeeded under {fault:?}"),
                Err(e) => format!("{e:#}"),
            };
            println!("CRI {fault:?} after {took:?}: {err}");
            check_error(&err, took, call, pid, bound)?;
            ensure!(
                !archive.exists(),
                "a failed checkpoint left {}",
                archive.display()
            );
            sim.fault(Some(pid), fault, false)?;
            goes_on(&log, &format!("CRI, after {fault:?}"))?;

            let t = Instant::now();
            cri.stop_container(&id, 2).await?;
            cri.remove_container(&id).await?;
            let removed = t.elapsed();
            println!("CRI {fault:?}: stopped and removed in {removed:?}");
            ensure!(
                removed < Duration::from_secs(5),
                "StopContainer and RemoveContainer after {fault:?} took {removed:?}"
            );
        }
        cri.remove_pod(&pod).await
    })?;
    remove(&node, "peer");
    Ok(())
}

/// Bounds far longer than the test: what ends the hung call must be the Kill.
const LONG: &[(&str, &str)] = &[
    ("DeviceLockTimeout", "2s"),
    ("DeviceCallTimeout", "300s"),
    ("DeviceCallTimeoutPerGiB", "1s"),
];

#[test]
fn a_kill_during_a_hung_driver_call_ends_it_at_once() -> Result<()> {
    let sim = sim_gpus(1, 256, "bound-kill")?;
    let node = gpu_node("gpu-bound-kill", &sim, LONG)?;
    let dir = node.paths().dir.clone();
    let log = dir.join("victim.log");
    let pid = ctr_run(&node, "victim", Some(&format!("{KIND}=0")), &log, TRAIN)?;
    wait_steps(&log, 3)?;
    sim.fault(Some(pid), FaultOp::CheckpointHang, true)?;
    let image = dir.join("victim-ckpt").display().to_string();
    let start = Instant::now();
    let (out, took, killed) = std::thread::scope(|s| -> Result<_> {
        let ckpt = s.spawn(|| {
            let out = node.ctr(&["task", "checkpoint", "--image-path", &image, "victim"]);
            (out, start.elapsed())
        });
        // The daemon has the checkpoint call (recorded as it arrives), which now hangs.
        wait_until(SLACK, "the driver's checkpoint call", || {
            sim.last_args("cuCheckpointProcessCheckpoint")
                .ok()
                .map(|_| ())
        })?;
        let t = Instant::now();
        node.ctr_ok(&["task", "kill", "-s", "SIGKILL", "victim"])?;
        wait_until(SLACK, "the killed task to stop", || {
            node.task_status("victim")
                .ok()
                .filter(|s| s == "STOPPED")
                .map(|_| ())
        })?;
        let killed = t.elapsed();
        let (out, took) = ckpt
            .join()
            .map_err(|_| anyhow::anyhow!("the checkpoint thread panicked"))?;
        Ok((out, took, killed))
    })?;
    let out = out?;
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    println!("kill during the hung checkpoint call: stopped in {killed:?}; checkpoint failed after {took:?}: {err}");
    ensure!(
        !out.status.success(),
        "the checkpoint succeeded though its process was killed"
    );
    ensure!(
        err.contains(&format!(
            "cuCheckpointProcessCheckpoint(pid {pid}) abandoned: the container is being killed"
        )),
        "the checkpoint's error does not say its call was abandoned: {err}"
    );
    // Its bound is 300 s: the kill, not the bound, ended it.
    ensure!(killed < Duration::from_secs(10), "the kill took {killed:?}");
    ensure!(
        took < Duration::from_secs(60),
        "the checkpoint took {took:?}"
    );
    node.ctr_ok(&["task", "delete", "victim"])?;
    node.ctr_ok(&["container", "rm", "victim"])?;
    Ok(())
}
