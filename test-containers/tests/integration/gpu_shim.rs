//! GPU containers checkpointed and restored through the shim, on private containerd nodes, each
//! with its own simulated driver (other GPU UUIDs per node) and CDI spec: the kubelet path
//! (CRI CheckpointContainer), restores on another node through the restore RuntimeClass and
//! through restore-via-create, ctr's checkpoint commands, the compatibility check, injected
//! device faults, and several GPU processes, GPUs and containers at once.
//!
//! gpu-train's state lives only in device memory and every step is checked against a closed
//! form (a lost or misplaced byte prints MISMATCH, which fails the waits here); its checksums
//! are deterministic, so a restored step k must print the checksum the original printed for k.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::{gpu::*, *};
use anyhow::{ensure, Context, Result};
use image_format::compat::Profile;
use image_format::manifest::{DeviceProcess, Manifest, ProcessGpu};
use simgpu::testing::{SimConfig, SimNode};
use test_containers::{
    cri::{v1 as cri, ContainerSpec, Cri, Pod, PodSpec},
    stack::{processes_matching, Node, GPU_CKPT_HANDLER, GPU_WORKLOADS_IMAGE},
};

/// A CRI container spec of gpu-train on the simulated GPU `device` (`0`, `1`, `all`), asked for
/// the way kubelet's device manager asks for a CDI device: the `cdi.k8s.io/` annotation.
pub(crate) fn train_spec(name: &str, device: &str) -> ContainerSpec {
    ContainerSpec::new(name, GPU_WORKLOADS_IMAGE)
        .command(&["/usr/bin/gpu-train"])
        .args(&["--elements", "4096", "--interval-ms", "100"])
        .annotation(
            &format!("cdi.k8s.io/gpu-ckpt-sim_{name}"),
            &format!("{KIND}={device}"),
        )
}

/// The lines of CRI log `log` of `stream` (`stdout`, `stderr`; empty: both).
fn log_lines(log: &Path, stream: &str) -> Vec<String> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .filter(|l| stream.is_empty() || l.split_whitespace().nth(1) == Some(stream))
        .map(str::to_string)
        .collect()
}

/// The steps of `log`'s `stream` as a map, step → checksum.
fn step_map(log: &Path, stream: &str) -> BTreeMap<u64, String> {
    log_lines(log, stream)
        .iter()
        .flat_map(|l| steps(l))
        .collect()
}

/// The gpu-ckpt manifest inside a CRI checkpoint archive.
pub(crate) fn archive_manifest(archive: &Path) -> Result<Manifest> {
    let info = image_format::archive::read_info(archive, Default::default())?;
    info.manifest
        .with_context(|| format!("{} has no gpu-ckpt manifest", archive.display()))
}

/// containerd's restore-via-create of `archive` as container `train` of `pod`, given the
/// simulated GPU `device` through `CDI_devices`: the container is created, not started.
pub(crate) async fn create_from_archive(
    cri: &Cri,
    pod: &Pod,
    archive: &Path,
    device: &str,
) -> Result<String> {
    let mut config = train_spec("train", device).to_config(&pod.spec);
    config.image = Some(cri::ImageSpec {
        image: archive.display().to_string(),
        ..Default::default()
    });
    config.cdi_devices = vec![cri::CdiDevice {
        name: format!("{KIND}={device}"),
    }];
    std::fs::create_dir_all(pod.spec.log_directory().join("train"))?;
    cri.create_container_raw(&pod.id, config, pod.config.clone())
        .await
}

/// Runs a GPU training pod on `node` and checkpoints it through CRI (the kubelet path); returns
/// the archive, the pod, its container id, and the last step logged before the checkpoint.
pub(crate) async fn checkpoint_train(
    node: &Node,
    cri: &Cri,
    pod_name: &str,
    device: &str,
) -> Result<(PathBuf, Pod, String, u64)> {
    // Pulled through CRI, so that the image has a RepoDigest: restore-via-create pulls the base
    // image by the digest the checkpoint recorded.
    cri.pull_image(GPU_WORKLOADS_IMAGE).await?;
    let pod = cri
        .run_pod(&PodSpec::new(pod_name, node.pod_log_root()).handler(GPU_CKPT_HANDLER))
        .await?;
    let id = cri
        .run_container(&pod, &train_spec("train", device))
        .await?;
    let log = pod.container_log("train");
    wait_steps(&log, 3)?;
    let before = last_step(&log).map(|s| s.0).unwrap_or_default();
    let archive = node
        .paths()
        .dir
        .join(format!("checkpoint-{pod_name}-train.tar"));
    let _ = std::fs::remove_file(&archive);
    cri.checkpoint_container(&id, &archive, 60).await?;
    Ok((archive, pod, id, before))
}

/// The gpu-train steps of a CRI log written at or after `since` (containerd's restore-via-create
/// starts the new log with a copy of the original's).
fn steps_since(log: &Path, stream: &str, since: std::time::SystemTime) -> Vec<(u64, String)> {
    log_lines(log, stream)
        .into_iter()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .and_then(|t| humantime::parse_rfc3339(t).ok())
                .is_some_and(|t| t >= since)
        })
        .flat_map(|l| steps(&l))
        .collect()
}

/// A restored training container logging in `log` (from `since`) goes on from the checkpoint:
/// its first step is at least `before` (the step in flight at the checkpoint may come again),
/// never a start from step 1, the steps go on one by one, with the checksums the original
/// printed (`original`) for the same steps.
pub(crate) fn expect_continues(
    log: &Path,
    since: std::time::SystemTime,
    before: u64,
    original: &Path,
    what: &str,
) -> Result<()> {
    expect_stream_continues(log, "", since, before, original, what)
}

/// [`expect_continues`] for the lines of one stream of the logs (`stdout`, `stderr`).
fn expect_stream_continues(
    log: &Path,
    stream: &str,
    since: std::time::SystemTime,
    before: u64,
    original: &Path,
    what: &str,
) -> Result<()> {
    let mut seen = Vec::new();
    wait_until(
        Duration::from_secs(30),
        &format!("{what}: three steps of the restored training"),
        || {
            if let Ok(t) = std::fs::read_to_string(log) {
                if t.contains("MISMATCH") || t.contains("gpu-train: ") {
                    return Some(());
                }
            }
            seen = steps_since(log, stream, since);
            (seen.len() >= 3).then_some(())
        },
    )
    .with_context(|| {
        format!(
            "log so far:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        )
    })?;
    let text = std::fs::read_to_string(log)?;
    ensure!(
        !text.contains("MISMATCH") && !text.contains("gpu-train: "),
        "{what}: the restored training failed:\n{text}"
    );
    let first = seen[0].0;
    ensure!(
        first >= before.max(1) && first > 1,
        "{what}: the restored training starts at step {first}, but the checkpoint was taken after step {before}: it did not continue from the checkpoint"
    );
    for w in seen.windows(2) {
        ensure!(w[1].0 == w[0].0 + 1, "{what}: steps out of order: {seen:?}");
    }
    println!("{what}: continues at step {first}: {seen:?}");
    let last = seen[seen.len() - 1].0;
    wait_until(
        Duration::from_secs(30),
        &format!("{what}: the original to reach step {last}"),
        || {
            step_map(original, stream)
                .keys()
                .next_back()
                .filter(|k| **k >= last)
                .map(|_| ())
        },
    )
    .ok();
    let a = step_map(original, stream);
    let mut compared = 0;
    for (k, sum) in &seen {
        if let Some(want) = a.get(k) {
            ensure!(
                want == sum,
                "{what}: step {k}: the restored process prints checksum {sum}, the original printed {want}"
            );
            compared += 1;
        }
    }
    ensure!(
        compared > 0,
        "{what}: no step to compare with the original's checksums"
    );
    Ok(())
}

#[test]
fn cri_training_pod_restores_on_another_node_with_other_gpus() -> Result<()> {
    let (sim_a, sim_b, a, b) = two_gpu_nodes("train", 2)?;
    ensure!(
        sim_a.uuids() != sim_b.uuids(),
        "the two nodes' GPUs must differ"
    );
    rt().block_on(async {
        let cri_a = Cri::connect(a.socket()).await?;
        let cri_b = Cri::connect(b.socket()).await?;
        let (archive, pod_a, id_a, before) = checkpoint_train(&a, &cri_a, "trainer", "0").await?;
        let log_a = pod_a.container_log("train");

        // The original keeps running with correct results (a MISMATCH fails the wait).
        let after = last_step(&log_a).map(|s| s.0).unwrap_or_default();
        wait_steps_after(&log_a, after, 3)?;
        let pid_a = cri_pid(&cri_a, &id_a).await?;
        ensure!(
            gpus_of(&sim_a, pid_a)? == vec![sim_a.node().gpus[0].uuid],
            "after the checkpoint the original no longer runs on node A's GPU 0"
        );
        // As with a real driver: the process holds its GPU's device node, the one its spec gave.
        let nodes = gpu_nodes(pid_a)?;
        ensure!(
            nodes == (vec!["/dev/nvidia0".to_string()], vec!["nvidia0".to_string()]),
            "the original on node A's GPU 0 holds and sees GPU nodes {nodes:?}, want /dev/nvidia0"
        );

        // The manifest records the GPU, the driver, and the process with its device bytes.
        let m = archive_manifest(&archive)?;
        ensure!(
            m.devices.gpus.len() == 1 && m.devices.gpus[0].uuid == sim_a.uuids()[0],
            "manifest GPUs {:?}, want node A's GPU 0 {}",
            m.devices.gpus,
            sim_a.uuids()[0]
        );
        ensure!(
            m.devices.driver_version == sim_a.node().driver_version,
            "manifest driver {:?}",
            m.devices.driver_version
        );
        ensure!(
            m.devices.processes.len() == 1 && m.devices.device_bytes() > 0,
            "manifest device processes {:?}",
            m.devices.processes
        );
        ensure!(
            m.devices.node_gpus.len() == 2,
            "manifest node GPUs {:?}",
            m.devices.node_gpus
        );
        // `gpu-ckpt inspect` shows the GPU, the process and its device bytes.
        let cli = test_containers::gpuproc::binary(
            &test_containers::stack::Stack::discover()?,
            "gpu-ckpt",
        )?;
        let shown = run_ok(std::process::Command::new(&cli).arg("inspect").arg(&archive))?;
        let bytes = m.devices.device_bytes();
        ensure!(
            shown.contains(&sim_a.uuids()[0])
                && shown.contains("Process 1: ")
                && shown.contains("Device bytes (staged in host memory)"),
            "gpu-ckpt inspect does not show the GPU, the process and its {bytes} device bytes:\n{shown}"
        );

        // 1. restore-via-create on node B, onto its GPU 1 (another UUID, another index); the
        //    original still runs on A.
        let pod_b = cri_b
            .run_pod(&PodSpec::new("trainer", b.pod_log_root()).handler(GPU_CKPT_HANDLER))
            .await?;
        let id_b = create_from_archive(&cri_b, &pod_b, &archive, "1").await?;
        let since = std::time::SystemTime::now();
        cri_b.start_container(&id_b).await?;
        expect_continues(
            &pod_b.container_log("train"),
            since,
            before,
            &log_a,
            "restore-via-create",
        )?;
        // CRI's ContainerStatus reports the restored process's pid (cri_pid fails on pid 0).
        let pid_b = cri_pid(&cri_b, &id_b).await?;
        ensure!(
            gpus_of(&sim_b, pid_b)? == vec![sim_b.node().gpus[1].uuid],
            "the restored process does not run on node B's GPU 1"
        );
        // CRIU restored the checkpoint's /dev (GPU 0's node): the restore made this spec's
        // /dev/nvidia1, removed /dev/nvidia0, and the driver acquired GPU 1 through its node.
        let nodes = gpu_nodes(pid_b)?;
        ensure!(
            nodes == (vec!["/dev/nvidia1".to_string()], vec!["nvidia1".to_string()]),
            "the restored process on node B's GPU 1 holds and sees GPU nodes {nodes:?}, want /dev/nvidia1"
        );
        cri_b.remove_pod(&pod_b).await?;

        // 2. The restore RuntimeClass: an ordinary spec, the pod names the checkpoint; the
        //    original is gone by now.
        cri_a.remove_pod(&pod_a).await?;
        let pod_r = cri_b
            .run_pod(
                &restore_pod("trainer", &b, &archive.display().to_string()),
            )
            .await?;
        let since = std::time::SystemTime::now();
        let id_r = cri_b
            .run_container(&pod_r, &train_spec("train", "0"))
            .await?;
        expect_continues(
            &pod_r.container_log("train"),
            since,
            before,
            &log_a,
            "restore handler",
        )?;
        let pid_r = cri_pid(&cri_b, &id_r).await?;
        ensure!(
            gpus_of(&sim_b, pid_r)? == vec![sim_b.node().gpus[0].uuid],
            "the restored process does not run on node B's GPU 0"
        );
        cri_b.remove_pod(&pod_r).await?;
        Ok(())
    })
}

/// Waits until the training of `log` (a CRI log) has gone `n` steps past where it is now.
pub(crate) fn keeps_training(log: &Path, n: u64, what: &str) -> Result<()> {
    let now = last_step(log).map(|s| s.0).unwrap_or_default();
    wait_steps_after(log, now, n).with_context(|| format!("{what}: the training stopped"))?;
    Ok(())
}

/// The error of a CRI checkpoint that must fail, checked to name every one of `needles`, and
/// that no archive was left at `archive`.
pub(crate) async fn checkpoint_fails(
    cri: &Cri,
    id: &str,
    archive: &Path,
    needles: &[&str],
    what: &str,
) -> Result<String> {
    let _ = std::fs::remove_file(archive);
    let err = match cri.checkpoint_container(id, archive, 60).await {
        Ok(()) => anyhow::bail!("{what}: the checkpoint succeeded"),
        Err(e) => format!("{e:#}"),
    };
    for n in needles {
        ensure!(
            err.contains(n),
            "{what}: the error does not name {n:?}: {err}"
        );
    }
    ensure!(
        !archive.exists(),
        "{what}: a failed checkpoint left {}",
        archive.display()
    );
    println!("{what}: {err}");
    Ok(err)
}

/// With the device steps switched off, CRIU meets a process that still holds the GPU (its
/// connection to the driver), and the checkpoint fails naming it; the container runs on.
#[test]
fn without_the_device_steps_the_checkpoint_fails_naming_the_gpu_process() -> Result<()> {
    let sim = sim_gpus(1, 256, "no-steps")?;
    let node = gpu_node("gpu-nosteps", &sim, &[("DeviceSteps", "false")])?;
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        let pod = cri
            .run_pod(&PodSpec::new("nosteps", node.pod_log_root()).handler(GPU_CKPT_HANDLER))
            .await?;
        let id = cri.run_container(&pod, &train_spec("train", "0")).await?;
        let log = pod.container_log("train");
        wait_steps(&log, 2)?;
        let pid = cri_pid(&cri, &id).await?;
        let archive = node.paths().dir.join("nosteps.tar");
        checkpoint_fails(
            &cri,
            &id,
            &archive,
            &[
                "DeviceSteps = false",
                &format!("pid {pid} (gpu-train"),
                &sim.uuids()[0],
            ],
            "device steps off",
        )
        .await?;
        keeps_training(&log, 3, "after the failed checkpoint")?;
        cri.remove_pod(&pod).await
    })
}

/// Injected faults: a lock that times out, a device checkpoint that fails, a device restore
/// that fails. The original runs on with correct results, a failed restore leaves nothing
/// running, and each error names its step.
#[test]
fn device_faults_leave_the_original_running_and_nothing_half_restored() -> Result<()> {
    let (sim_a, sim_b, a, b) = two_gpu_nodes("fault", 1)?;
    rt().block_on(async {
        let cri_a = Cri::connect(a.socket()).await?;
        let cri_b = Cri::connect(b.socket()).await?;
        cri_a.pull_image(GPU_WORKLOADS_IMAGE).await?;
        let pod = cri_a
            .run_pod(
                &PodSpec::new("faulty", a.pod_log_root())
                    .handler(GPU_CKPT_HANDLER)
                    .annotation("gpu-ckpt.io/lock-timeout", "1s"),
            )
            .await?;
        let id = cri_a.run_container(&pod, &train_spec("train", "0")).await?;
        let log = pod.container_log("train");
        wait_steps(&log, 2)?;
        let pid = cri_pid(&cri_a, &id).await?;
        let archive = a.paths().dir.join("checkpoint-faulty-train.tar");

        // 1. The lock waits for in-flight work that never ends: it times out after the pod's
        //    1 s, and the process is left RUNNING.
        sim_a.fault(Some(pid), simgpu::proto::FaultOp::LockTimeout, true)?;
        checkpoint_fails(
            &cri_a,
            &id,
            &archive,
            &["device-lock", &format!("pid {pid}"), "CUDA_ERROR_TIMEOUT"],
            "lock timeout",
        )
        .await?;
        sim_a.fault(Some(pid), simgpu::proto::FaultOp::LockTimeout, false)?;
        keeps_training(&log, 3, "after the lock timeout")?;

        // 2. The device checkpoint fails: the locked process is unlocked again.
        sim_a.fault(Some(pid), simgpu::proto::FaultOp::CheckpointFail, true)?;
        checkpoint_fails(
            &cri_a,
            &id,
            &archive,
            &["device-checkpoint", &format!("pid {pid}")],
            "device checkpoint failure",
        )
        .await?;
        sim_a.fault(Some(pid), simgpu::proto::FaultOp::CheckpointFail, false)?;
        keeps_training(&log, 3, "after the device checkpoint failure")?;

        // 3. A good checkpoint, restored on node B whose driver fails every restore: Start
        //    fails naming the step, and nothing restored runs there.
        let before = last_step(&log).map(|s| s.0).unwrap_or_default();
        cri_a.checkpoint_container(&id, &archive, 60).await?;
        keeps_training(&log, 2, "after the checkpoint")?;
        sim_b.fault(None, simgpu::proto::FaultOp::RestoreFail, true)?;
        let pod_r = restore_pod("faulty", &b, &archive.display().to_string());
        let running = cri_b.run_pod(&pod_r).await?;
        let err = match cri_b
            .run_container(&running, &train_spec("train", "0"))
            .await
        {
            Ok(id) => anyhow::bail!("the restore on a failing driver started container {id}"),
            Err(e) => format!("{e:#}"),
        };
        ensure!(
            err.contains("device-restore"),
            "the failed restore does not name its step: {err}"
        );
        println!("device restore failure: {err}");
        let left = sim_b.processes()?;
        ensure!(
            left.is_empty(),
            "a failed restore left GPU processes on node B: {left:?}"
        );
        let stray = pod_gpu_train(&running.spec.uid);
        ensure!(
            stray.is_empty(),
            "a failed restore left gpu-train running in the pod: {stray:?}"
        );
        cri_b.remove_pod(&running).await?;

        // Without the fault the same restore works: the failure was the driver's.
        sim_b.fault(None, simgpu::proto::FaultOp::RestoreFail, false)?;
        let since = std::time::SystemTime::now();
        let ok = cri_b.run_pod(&pod_r).await?;
        cri_b.run_container(&ok, &train_spec("train", "0")).await?;
        expect_continues(
            &ok.container_log("train"),
            since,
            before,
            &log,
            "restore after the fault is gone",
        )?;
        keeps_training(&log, 2, "the original, at the end")?;
        cri_b.remove_pod(&ok).await?;
        cri_a.remove_pod(&pod).await
    })
}

/// A driver whose device restore never returns: Start fails at the restore's bound naming step
/// device-restore, the restored process is killed (which ends the driver's call), and nothing is
/// left on the GPU or in the pod. Without the fault the same checkpoint restores.
#[test]
fn a_device_restore_that_never_returns_fails_at_the_bound() -> Result<()> {
    let sim = sim_gpus(1, 256, "hang")?;
    let node = gpu_node("gpu-hang", &sim, &[("RestoreTimeout", "20s")])?;
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        let (archive, pod, id, before) = checkpoint_train(&node, &cri, "hang", "0").await?;
        let original = pod.container_log("train");
        let original_pid = cri_pid(&cri, &id).await?;
        sim.fault(None, simgpu::proto::FaultOp::RestoreHang, true)?;
        let pod_r = restore_pod("hang", &node, &archive.display().to_string());
        let running = cri.run_pod(&pod_r).await?;
        let t = std::time::Instant::now();
        let err = match cri.run_container(&running, &train_spec("train", "0")).await {
            Ok(id) => anyhow::bail!("a restore whose device step hangs started container {id}"),
            Err(e) => format!("{e:#}"),
        };
        let took = t.elapsed();
        println!("after {took:?}: {err}");
        ensure!(
            err.contains("step device-restore") && err.contains("not done within 20s"),
            "the error does not name the device step and the bound: {err}"
        );
        ensure!(
            took < Duration::from_secs(60),
            "the restore failed only after {took:?}"
        );
        wait_until(
            Duration::from_secs(15),
            "the GPU to hold only the original",
            || {
                sim.processes()
                    .ok()
                    .filter(|p| p.iter().all(|p| p.pid as i32 == original_pid))
            },
        )?;
        let stray = pod_gpu_train(&running.spec.uid);
        ensure!(
            stray.is_empty(),
            "a restore past its bound left gpu-train running in the pod: {stray:?}"
        );
        cri.remove_pod(&running).await?;

        sim.fault(None, simgpu::proto::FaultOp::RestoreHang, false)?;
        let since = std::time::SystemTime::now();
        let ok = cri.run_pod(&pod_r).await?;
        cri.run_container(&ok, &train_spec("train", "0")).await?;
        expect_continues(
            &ok.container_log("train"),
            since,
            before,
            &original,
            "restore after the fault is gone",
        )?;
        cri.remove_pod(&ok).await?;
        cri.remove_pod(&pod).await
    })
}

/// The host processes in pod `uid`'s cgroup (`kubepods/besteffort/pod<uid>`) but its
/// sandbox's pause process.
pub(crate) fn pod_processes(uid: &str) -> Vec<i32> {
    let needle = format!("pod{uid}");
    let read = |p: i32, f: &str| std::fs::read_to_string(format!("/proc/{p}/{f}"));
    processes_matching(&[""])
        .into_iter()
        .filter(|p| {
            read(*p, "cgroup").is_ok_and(|c| c.contains(&needle))
                && read(*p, "comm").is_ok_and(|c| c.trim() != "pause")
        })
        .collect()
}

/// The gpu-train processes among [`pod_processes`] of pod `uid`.
fn pod_gpu_train(uid: &str) -> Vec<i32> {
    pod_processes(uid)
        .into_iter()
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm"))
                .is_ok_and(|c| c.trim() == "gpu-train")
        })
        .collect()
}

/// gpu-train under `sh`, logging into a tmpfs at /out (CRIU carries a tmpfs's files with the
/// checkpoint, so the log goes wherever the process goes).
const CTR_TRAIN: &str =
    "exec /usr/bin/gpu-train --elements 4096 --interval-ms 100 > /out/train.log 2>&1";

/// `ctr <verb> --device <device> … <image> <id> sh -c CTR_TRAIN` on `node`, `verb` being `run -d`
/// or `container create`.
fn ctr_train(node: &Node, verb: &[&str], device: &str, id: &str) -> Result<()> {
    ctr_sh(node, verb, device, id, CTR_TRAIN)
}

/// `ctr <verb> --device <device> … <image> <id> sh -c <cmd>` on `node` with a tmpfs at /out
/// (which travels with a checkpoint), `verb` being `run -d` or `container create`.
pub(crate) fn ctr_sh(node: &Node, verb: &[&str], device: &str, id: &str, cmd: &str) -> Result<()> {
    ctr_sh_with(node, verb, device, &[], id, cmd)
}

/// [`ctr_sh`] with the ctr flags `extra` too.
pub(crate) fn ctr_sh_with(
    node: &Node,
    verb: &[&str],
    device: &str,
    extra: &[&str],
    id: &str,
    cmd: &str,
) -> Result<()> {
    // `container create` has no --fifo-dir (that is `run`'s).
    let flags: Vec<String> = if verb[0] == "run" {
        run_flags(node)
    } else {
        vec!["--runtime".into(), RUNTIME.into()]
    };
    let mut args: Vec<&str> = verb.to_vec();
    args.extend(["--device", device]);
    args.extend([
        "--mount",
        "type=tmpfs,src=tmpfs,dst=/out,options=rw:size=16m",
    ]);
    args.extend_from_slice(extra);
    args.extend(flags.iter().map(String::as_str));
    args.extend([GPU_WORKLOADS_IMAGE, id, "/bin/sh", "-c", cmd]);
    let out = node.ctr_cdi("default", &args)?;
    ensure!(
        out.status.success(),
        "ctr {} failed: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(())
}

/// The log of a ctr training container whose init is host pid `pid`.
pub(crate) fn ctr_log(pid: i32) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/root/out/train.log"))
}

/// The steps in a ctr training log go on one by one to at least `at_least`, from before
/// `before` (the log travelled with the process, so it holds the steps before the checkpoint
/// too).
fn ctr_continues(pid: i32, before: u64, what: &str) -> Result<()> {
    let log = ctr_log(pid);
    let all = wait_steps_after(&log, before, 3).with_context(|| what.to_string())?;
    println!("{what}: pid {pid} goes on after step {before}: {all:?}");
    Ok(())
}

#[test]
fn ctr_checkpoint_live_restore_and_exit_restore_on_another_node() -> Result<()> {
    let (sim_a, sim_b, a, b) = two_gpu_nodes("ctr", 2)?;

    // 1. `ctr container checkpoint --task` (the task keeps running), then `ctr container
    //    restore --live` of the checkpoint image in place of the original.
    ctr_train(&a, &["run", "-d"], &format!("{KIND}=0"), "t1")?;
    let pid = a.task_pid("t1")?;
    wait_steps(&ctr_log(pid), 3)?;
    let before = last_step(&ctr_log(pid)).map(|s| s.0).unwrap_or_default();
    a.ctr_ok(&[
        "container",
        "checkpoint",
        "--task",
        "--rw",
        "t1",
        "localhost/ckpt/gpu-t1:1",
    ])?;
    ctr_continues(
        pid,
        last_step(&ctr_log(pid)).map(|s| s.0).unwrap_or(0),
        "the original after ctr container checkpoint",
    )?;
    remove(&a, "t1");
    a.ctr_ok(&[
        "container",
        "restore",
        "--live",
        "--rw",
        "t1",
        "localhost/ckpt/gpu-t1:1",
    ])?;
    let restored = a.task_pid("t1")?;
    ctr_continues(restored, before, "ctr container restore --live")?;
    ensure!(
        gpus_of(&sim_a, restored)? == vec![sim_a.node().gpus[0].uuid],
        "the live restore does not run on GPU 0"
    );
    remove(&a, "t1");

    // 2. `ctr task checkpoint --exit --image-path` (the task stops), restored on node B onto
    //    its GPU 1 through the containerd API (CriuImagePath).
    ctr_train(&a, &["run", "-d"], &format!("{KIND}=0"), "t2")?;
    let pid = a.task_pid("t2")?;
    wait_steps(&ctr_log(pid), 3)?;
    let dir = a.paths().dir.join("t2-exit");
    a.checkpoint_task_exit("t2", &dir)?;
    wait_until(
        Duration::from_secs(10),
        "the checkpointed task to stop",
        || (!std::path::Path::new(&format!("/proc/{pid}")).exists()).then_some(()),
    )?;
    let m = Manifest::read_from(&dir)?;
    ensure!(
        m.devices.processes.len() == 1 && m.devices.gpus[0].uuid == sim_a.uuids()[0],
        "the --exit checkpoint's manifest records {:?}",
        m.devices
    );
    let at_exit = m.devices.processes[0].pid;
    ensure!(at_exit > 0, "no pid recorded for the GPU process");
    ctr_train(&b, &["container", "create"], &format!("{KIND}=1"), "t2")?;
    let restored = restore_from_dir(&b, "t2", &dir)?;
    let log = std::fs::read_to_string(ctr_log(restored)).unwrap_or_default();
    let last = steps(&log).last().map(|s| s.0).unwrap_or(0);
    ctr_continues(
        restored,
        last,
        "ctr task checkpoint --exit, restored on node B",
    )?;
    ensure!(
        gpus_of(&sim_b, restored)? == vec![sim_b.node().gpus[1].uuid],
        "the restore on node B does not run on its GPU 1"
    );
    remove(&b, "t2");
    Ok(())
}

/// `gpu-ckpt compat --libnvml <sim's NVML> <extra> <input>`: (compatible, what it printed).
pub(crate) fn gpu_ckpt_compat(
    sim: &SimNode,
    extra: &[&str],
    input: &Path,
) -> Result<(bool, String)> {
    let cli =
        test_containers::gpuproc::binary(&test_containers::stack::Stack::discover()?, "gpu-ckpt")?;
    let out = std::process::Command::new(&cli)
        .arg("compat")
        .arg("--libnvml")
        .arg(sim.libnvml())
        .args(extra)
        .arg(input)
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        matches!(out.status.code(), Some(0 | 1)),
        "gpu-ckpt compat failed: {text}"
    );
    Ok((out.status.success(), text))
}

/// `gpu-ckpt compat --libnvml` of a checkpoint taken on a node like `base` (its GPU 0, holding
/// `held` bytes) against simulated nodes that differ in one field each: the field is named.
#[test]
fn compat_names_each_field_that_differs_from_this_node() -> Result<()> {
    use ::gpu::Inventory;
    let base = sim_gpus(2, 256, "compat-base")?;
    let inv = ::gpu::NvmlInventory::open(Some(&base.libnvml()))?.node()?;
    let mut devices =
        Profile::from_inventory(&inv, &[inv.gpus[0].uuid], Default::default()).devices;
    for g in devices.gpus.iter_mut().chain(devices.node_gpus.iter_mut()) {
        g.free_bytes = None;
    }
    devices.processes = vec![DeviceProcess {
        pid: 1,
        gpus: vec![ProcessGpu {
            uuid: devices.gpus[0].uuid.clone(),
            bytes: 96 << 20,
        }],
    }];
    let dir = tempfile::tempdir()?;
    let mut m = Manifest::new(
        "2026-12-04T00:00:00Z",
        Default::default(),
        Default::default(),
        devices,
        Default::default(),
    );
    m.files.clear();
    let manifest = dir.path().join("manifest.json");
    std::fs::write(&manifest, serde_json::to_vec_pretty(&m)?)?;
    let compat = |sim: &SimNode, extra: &[&str]| gpu_ckpt_compat(sim, extra, &manifest);
    let refused = |sim: &SimNode, extra: &[&str], field: &str| -> Result<()> {
        let (ok, text) = compat(sim, extra)?;
        println!("{field}:\n{text}");
        ensure!(
            !ok,
            "a node whose {field} differs was found compatible:\n{text}"
        );
        ensure!(
            text.contains(field),
            "the verdict does not name {field}:\n{text}"
        );
        Ok(())
    };
    // Same model, driver and memory, other UUIDs: compatible, with a remap.
    let other = sim_gpus(2, 256, "compat-other")?;
    let (ok, text) = compat(&other, &[])?;
    ensure!(ok, "a node like the checkpoint's is refused:\n{text}");
    ensure!(
        text.contains(&other.uuids()[0]),
        "the verdict does not show the remap onto {}:\n{text}",
        other.uuids()[0]
    );
    // A patch release of the same driver branch is compatible; another branch is not.
    let patch = sim_node(SimConfig {
        gpus: 2,
        memory_mib: 256,
        driver_version: "580.105.08".into(),
        ..SimConfig::default()
    })?;
    ensure!(
        compat(&patch, &[])?.0,
        "a patch release of driver 580 is refused"
    );
    let driver = sim_node(SimConfig {
        gpus: 2,
        memory_mib: 256,
        driver_version: "575.57.08".into(),
        ..SimConfig::default()
    })?;
    refused(&driver, &[], "driver_version")?;
    let cuda = sim_node(SimConfig {
        gpus: 2,
        memory_mib: 256,
        cuda_version: 13010,
        ..SimConfig::default()
    })?;
    refused(&cuda, &[], "cuda_driver_version")?;
    let model = sim_node(SimConfig {
        gpus: 2,
        memory_mib: 256,
        model: "NVIDIA A100-SXM4-80GB".into(),
        ..SimConfig::default()
    })?;
    refused(&model, &[], "gpu_model")?;
    let small = sim_gpus(2, 128, "compat-small")?;
    refused(&small, &[], "gpu_memory")?;
    let both = format!("{},{}", other.uuids()[0], other.uuids()[1]);
    refused(&other, &["--gpus", &both], "gpu_count")?;
    // Free memory: another process holds 200 of the GPU's 256 MiB, the checkpoint needs 96.
    let stack = test_containers::stack::Stack::discover()?;
    let fill_out = dir.path().join("fill.log");
    let mut env = other.env();
    env.push((
        "LD_LIBRARY_PATH".into(),
        other.lib_dir().display().to_string(),
    ));
    let mut fill = test_containers::gpuproc::Workload::spawn(
        &test_containers::gpuproc::binary(&stack, "gpu-fill")?,
        &["--mib", "200", "--devices", "0"],
        &env,
        &fill_out,
    )?;
    fill.wait_line(Duration::from_secs(20), "gpu-fill filled", |l| {
        l.contains("filled").then_some(())
    })?;
    refused(&other, &[], "gpu_free_memory")?;
    drop(fill);
    Ok(())
}

/// The restore handler on `node` restoring `source` into a pod whose container asks for the
/// simulated GPU `device`: it must be refused, naming `field`. Returns the error.
pub(crate) async fn refused_restore(
    cri: &Cri,
    node: &Node,
    source: &str,
    device: &str,
    field: &str,
) -> Result<String> {
    let pod = cri.run_pod(&restore_pod("fit", node, source)).await?;
    let err = match cri.run_container(&pod, &train_spec("train", device)).await {
        Ok(id) => anyhow::bail!("a restore whose {field} differs started container {id}"),
        Err(e) => format!("{e:#}"),
    };
    println!("{field}: {err}");
    ensure!(
        err.contains(field),
        "the refusal does not name {field}: {err}"
    );
    cri.remove_pod(&pod).await?;
    Ok(err)
}

/// A restore onto GPUs that do not fit: refused naming the field, through the restore handler
/// and through restore-via-create, with nothing left running; or a cold start where the pod
/// asks for one.
#[test]
fn restore_onto_gpus_that_do_not_fit_is_refused_or_cold_starts() -> Result<()> {
    let sim_a = sim_gpus(2, 256, "fit-a")?;
    let sim_c = sim_node(SimConfig {
        driver_version: "575.57.08".into(),
        ..gpus_config(2, 256, "fit-c")
    })?;
    let a = gpu_node("gpu-fit-a", &sim_a, &[])?;
    let c = gpu_node("gpu-fit-c", &sim_c, &[])?;
    rt().block_on(async {
        let cri_a = Cri::connect(a.socket()).await?;
        let cri_c = Cri::connect(c.socket()).await?;
        let (archive, pod_a, _id, _before) = checkpoint_train(&a, &cri_a, "fit", "0").await?;
        let source = archive.display().to_string();

        // The restore handler on node A, the pod asking for both GPUs: gpu_count differs.
        let err = refused_restore(&cri_a, &a, &source, "all", "gpu_count").await?;
        ensure!(
            err.contains("on-incompatible"),
            "the refusal does not say how to cold-start instead: {err}"
        );

        // GPU 1 of node A with another process holding all but 2 MiB of it: less free memory
        // than the checkpoint's process held, gpu_free_memory differs.
        let stack = test_containers::stack::Stack::discover()?;
        let mut env = sim_a.env();
        env.push((
            "LD_LIBRARY_PATH".into(),
            sim_a.lib_dir().display().to_string(),
        ));
        let mut fill = test_containers::gpuproc::Workload::spawn(
            &test_containers::gpuproc::binary(&stack, "gpu-fill")?,
            &["--mib", "254", "--devices", "1"],
            &env,
            &a.paths().dir.join("fit-fill.log"),
        )?;
        fill.wait_line(Duration::from_secs(20), "gpu-fill filled", |l| {
            l.contains("filled").then_some(())
        })?;
        refused_restore(&cri_a, &a, &source, "1", "gpu_free_memory").await?;
        drop(fill);

        // The same with gpu-ckpt.io/on-incompatible: cold-start: it starts fresh, at step 1.
        let pod = cri_a
            .run_pod(
                &restore_pod("fit", &a, &source)
                    .annotation("gpu-ckpt.io/on-incompatible", "cold-start"),
            )
            .await?;
        cri_a
            .run_container(&pod, &train_spec("train", "all"))
            .await?;
        let fresh = wait_steps(&pod.container_log("train"), 2)?;
        ensure!(
            fresh[0].0 == 1,
            "the cold start did not start at step 1: {fresh:?}"
        );
        cri_a.remove_pod(&pod).await?;
        cri_a.remove_pod(&pod_a).await?;

        // restore-via-create on node C, whose driver is of another branch.
        let pod_c = cri_c
            .run_pod(&PodSpec::new("fit", c.pod_log_root()).handler(GPU_CKPT_HANDLER))
            .await?;
        let id_c = create_from_archive(&cri_c, &pod_c, &archive, "0").await?;
        let err = match cri_c.start_container(&id_c).await {
            Ok(()) => anyhow::bail!("a restore onto driver 575 of a driver 580 checkpoint started"),
            Err(e) => format!("{e:#}"),
        };
        println!("driver branch: {err}");
        ensure!(
            err.contains("step compat") && err.contains("driver_version"),
            "the refusal does not name driver_version: {err}"
        );
        let left: Vec<String> = pod_processes(&pod_c.spec.uid)
            .into_iter()
            .map(|p| {
                let comm = std::fs::read_to_string(format!("/proc/{p}/comm")).unwrap_or_default();
                format!("{p} ({})", comm.trim())
            })
            .collect();
        ensure!(
            left.is_empty(),
            "the refused restore left processes: {left:?}"
        );
        cri_c.remove_pod(&pod_c).await
    })
}

/// Two GPU processes in one container, one process on two GPUs, and a pod of two GPU
/// containers: each container checkpointed through CRI and restored on another node through
/// the restore handler (one checkpoint per container, `gpu-ckpt.io/restore-from.<name>`).
#[test]
fn several_gpu_processes_gpus_and_containers() -> Result<()> {
    let (_sim_a, sim_b, a, b) = two_gpu_nodes("multi", 2)?;
    // "pair": two gpu-train processes on GPU 0 (the second logs to stderr); "both": one
    // gpu-train on both GPUs.
    let pair = |device: &str| {
        train_spec("pair", device).command(&["/bin/sh"]).args(&[
            "-c",
            "/usr/bin/gpu-train --elements 2048 --interval-ms 100 --seed 2 1>&2 & \
             exec /usr/bin/gpu-train --elements 4096 --interval-ms 100",
        ])
    };
    let both = |device: &str| {
        train_spec("both", device).args(&[
            "--devices",
            "all",
            "--elements",
            "4096",
            "--interval-ms",
            "100",
        ])
    };
    rt().block_on(async {
        let cri_a = Cri::connect(a.socket()).await?;
        let cri_b = Cri::connect(b.socket()).await?;
        let pod = cri_a
            .run_pod(&PodSpec::new("multi", a.pod_log_root()).handler(GPU_CKPT_HANDLER))
            .await?;
        let pair_id = cri_a.run_container(&pod, &pair("0")).await?;
        let both_id = cri_a.run_container(&pod, &both("all")).await?;
        let (pair_log, both_log) = (pod.container_log("pair"), pod.container_log("both"));
        wait_steps(&both_log, 3)?;
        wait_until(
            Duration::from_secs(30),
            "both processes of pair to step",
            || {
                (step_map(&pair_log, "stdout").len() >= 3
                    && step_map(&pair_log, "stderr").len() >= 3)
                    .then_some(())
            },
        )?;
        let mut archives = Vec::new();
        let mut befores = Vec::new();
        for (name, id) in [("pair", &pair_id), ("both", &both_id)] {
            let archive = a.paths().dir.join(format!("checkpoint-multi-{name}.tar"));
            let _ = std::fs::remove_file(&archive);
            let log = pod.container_log(name);
            let before: Vec<u64> = ["stdout", "stderr"]
                .iter()
                .map(|s| step_map(&log, s).keys().next_back().copied().unwrap_or(0))
                .collect();
            cri_a.checkpoint_container(id, &archive, 60).await?;
            let m = archive_manifest(&archive)?;
            println!("{name}: manifest devices {:?}", m.devices.processes);
            archives.push(archive);
            befores.push(before);
        }
        let m_pair = archive_manifest(&archives[0])?;
        ensure!(
            m_pair.devices.processes.len() == 2,
            "pair: the manifest records {} GPU processes, want 2",
            m_pair.devices.processes.len()
        );
        let m_both = archive_manifest(&archives[1])?;
        ensure!(
            m_both.devices.processes.len() == 1
                && m_both.devices.processes[0].gpus.len() == 2
                && m_both.devices.gpus.len() == 2,
            "both: the manifest records {:?}",
            m_both.devices
        );

        let pod_r = cri_b
            .run_pod(
                &PodSpec::new("multi", b.pod_log_root())
                    .handler(RESTORE_HANDLER)
                    .annotation(
                        "gpu-ckpt.io/restore-from.pair",
                        &archives[0].display().to_string(),
                    )
                    .annotation(
                        "gpu-ckpt.io/restore-from.both",
                        &archives[1].display().to_string(),
                    ),
            )
            .await?;
        let since = std::time::SystemTime::now();
        let pair_r = cri_b.run_container(&pod_r, &pair("1")).await?;
        let both_r = cri_b.run_container(&pod_r, &both("all")).await?;
        let (rp, rb) = (pod_r.container_log("pair"), pod_r.container_log("both"));
        expect_stream_continues(
            &rp,
            "stdout",
            since,
            befores[0][0],
            &pair_log,
            "pair, first process",
        )?;
        expect_stream_continues(
            &rp,
            "stderr",
            since,
            befores[0][1],
            &pair_log,
            "pair, second process",
        )?;
        expect_continues(&rb, since, befores[1][0], &both_log, "both")?;
        let pid = cri_pid(&cri_b, &both_r).await?;
        let mut on = gpus_of(&sim_b, pid)?;
        on.sort();
        let mut want: Vec<[u8; 16]> = sim_b.node().gpus.iter().map(|g| g.uuid).collect();
        want.sort();
        ensure!(
            on == want,
            "both: the restored process is on {on:?}, want node B's two GPUs"
        );
        let pair_pid = cri_pid(&cri_b, &pair_r).await?;
        let on_gpu1 = sim_b
            .processes()?
            .into_iter()
            .filter(|p| p.gpu == sim_b.node().gpus[1].uuid && p.pid != pid as u32)
            .count();
        ensure!(
            on_gpu1 == 2,
            "pair (init pid {pair_pid}): {on_gpu1} processes on node B's GPU 1, want 2"
        );
        cri_b.remove_pod(&pod_r).await?;
        cri_a.remove_pod(&pod).await
    })
}
