//! GPU containers checkpointed and restored through the shim, on private containerd nodes, each
//! with its own simulated driver (other GPU UUIDs per node) and CDI spec: the kubelet path
//! (CRI CheckpointContainer), restores on another node through the restore RuntimeClass and
//! through restore-via-create, ctr's checkpoint commands, the compatibility check, injected
//! device faults, and several GPU processes, GPUs and containers at once.
//!
//! gpu-train's state lives only in device memory and every step is checked against a closed
//! form (a lost or misplaced byte prints MISMATCH, which fails the waits here); its checksums
//! are deterministic, so a restored step k must print the checksum the original printed for k.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use common::{gpu::*, *};
use image_format::manifest::Manifest;
use test_containers::{
    cri::{v1 as cri, ContainerSpec, Cri, Pod, PodSpec},
    stack::{Node, GPU_CKPT_HANDLER, GPU_WORKLOADS_IMAGE},
};

/// A CRI container spec of gpu-train on the simulated GPU `device` (`0`, `1`, `all`), asked for
/// the way kubelet's device manager asks for a CDI device: the `cdi.k8s.io/` annotation.
fn train_spec(name: &str, device: &str) -> ContainerSpec {
    ContainerSpec::new(name, GPU_WORKLOADS_IMAGE)
        .command(&["/usr/bin/gpu-train"])
        .args(&["--elements", "4096", "--interval-ms", "100"])
        .annotation(
            &format!("cdi.k8s.io/gpu-ckpt-sim_{name}"),
            &format!("{KIND}={device}"),
        )
}

/// The steps of `log` as a map, step → checksum.
fn step_map(log: &Path) -> BTreeMap<u64, String> {
    std::fs::read_to_string(log)
        .map(|t| steps(&t).into_iter().collect())
        .unwrap_or_default()
}

/// The gpu-ckpt manifest inside a CRI checkpoint archive.
fn archive_manifest(archive: &Path) -> Result<Manifest> {
    let info = image_format::archive::read_info(archive, Default::default())?;
    info.manifest
        .with_context(|| format!("{} has no gpu-ckpt manifest", archive.display()))
}

/// Runs a GPU training pod on `node` and checkpoints it through CRI (the kubelet path); returns
/// the archive, the pod, its container id, and the last step logged before the checkpoint.
async fn checkpoint_train(
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
fn steps_since(log: &Path, since: std::time::SystemTime) -> Vec<(u64, String)> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .and_then(|t| humantime::parse_rfc3339(t).ok())
                .is_some_and(|t| t >= since)
        })
        .flat_map(steps)
        .collect()
}

/// A restored training container logging in `log` (from `since`) goes on from the checkpoint:
/// its first step is at least `before` (the step in flight at the checkpoint may come again),
/// never a start from step 1, the steps go on one by one, with the checksums the original
/// printed (`original`) for the same steps.
fn expect_continues(
    log: &Path,
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
            seen = steps_since(log, since);
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
        || (last_step(original)?.0 >= last).then_some(()),
    )
    .ok();
    let a = step_map(original);
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
    let sim_a = sim_gpus(2, 256, "node-a")?;
    let sim_b = sim_gpus(2, 256, "node-b")?;
    ensure!(
        sim_a.uuids() != sim_b.uuids(),
        "the two nodes' GPUs must differ"
    );
    let a = gpu_node("gpu-a", &sim_a, &[])?;
    let b = gpu_node("gpu-b", &sim_b, &[])?;
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

        // 1. restore-via-create on node B, onto its GPU 1 (another UUID, another index); the
        //    original still runs on A.
        let pod_b = cri_b
            .run_pod(&PodSpec::new("trainer", b.pod_log_root()).handler(GPU_CKPT_HANDLER))
            .await?;
        let restored = train_spec("train", "1");
        let mut config = restored.to_config(&pod_b.spec);
        config.image = Some(cri::ImageSpec {
            image: archive.display().to_string(),
            ..Default::default()
        });
        config.cdi_devices = vec![cri::CdiDevice {
            name: format!("{KIND}=1"),
        }];
        std::fs::create_dir_all(pod_b.spec.log_directory().join("train"))?;
        let id_b = cri_b
            .create_container_raw(&pod_b.id, config, pod_b.config.clone())
            .await?;
        let since = std::time::SystemTime::now();
        cri_b.start_container(&id_b).await?;
        expect_continues(
            &pod_b.container_log("train"),
            since,
            before,
            &log_a,
            "restore-via-create",
        )?;
        let pid_b = cri_pid(&cri_b, &id_b).await?;
        ensure!(
            gpus_of(&sim_b, pid_b)? == vec![sim_b.node().gpus[1].uuid],
            "the restored process does not run on node B's GPU 1"
        );
        cri_b.remove_pod(&pod_b).await?;

        // 2. The restore RuntimeClass: an ordinary spec, the pod names the checkpoint; the
        //    original is gone by now.
        cri_a.remove_pod(&pod_a).await?;
        let pod_r = cri_b
            .run_pod(
                &PodSpec::new("trainer", b.pod_log_root())
                    .handler(RESTORE_HANDLER)
                    .annotation("gpu-ckpt.io/restore-from", &archive.display().to_string()),
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
