//! The driver's files a GPU checkpoint maps: the simulated driver names its libraries by its
//! version as NVIDIA's are (`libcuda.so.<version>`, linked as `libcuda.so.1` in the container by
//! the CDI spec's hook), the manifest records each file a GPU process maps (path, size, build
//! id), and a restore onto a node of the same branch but another full version is refused before
//! CRIU runs, naming the file, by the shim and by `gpu-ckpt compat` alike; a node of the same
//! version restores it.

use crate::common::{gpu::*, *};
use crate::gpu_shim::{
    archive_manifest, checkpoint_train, create_from_archive, gpu_ckpt_compat, pod_processes,
    refused_restore, train_spec,
};
use anyhow::{ensure, Result};
use image_format::manifest::DriverFile;
use simgpu::testing::{SimConfig, SimNode};
use test_containers::{
    cri::{Cri, PodSpec},
    stack::GPU_CKPT_HANDLER,
};

const LIB_DIR: &str = "/usr/lib/x86_64-linux-gnu";

/// The host file of `sim` that a container sees at `libcuda.so.<version>`, as the manifest
/// must record it.
fn host_libcuda(sim: &SimNode) -> Result<DriverFile> {
    let version = &sim.node().driver_version;
    let host = sim.lib_dir().join(format!("libcuda.so.{version}"));
    let mut f = std::fs::File::open(&host)?;
    Ok(DriverFile {
        path: format!("{LIB_DIR}/libcuda.so.{version}"),
        size: f.metadata()?.len(),
        build_id: image_format::driver_files::read_build_id(&mut f)?.unwrap_or_default(),
    })
}

#[test]
fn a_restore_onto_another_driver_release_is_refused_before_criu() -> Result<()> {
    let sim_a = sim_gpus(1, 256, "files-a")?;
    let old = sim_a.node().driver_version.clone();
    // The same branch, another release.
    let new = format!(
        "{}.{}",
        old.rsplit_once('.').map_or("580.95", |(b, _)| b),
        99
    );
    ensure!(new != old, "the two versions must differ: {old}");
    let sim_b = sim_node(SimConfig {
        driver_version: new.clone(),
        ..gpus_config(1, 256, "files-b")
    })?;
    let sim_c = sim_gpus(1, 256, "files-c")?;
    let a = gpu_node("gpu-files-a", &sim_a, &[])?;
    let b = gpu_node("gpu-files-b", &sim_b, &[])?;
    let c = gpu_node("gpu-files-c", &sim_c, &[])?;
    rt().block_on(async {
        let (cri_a, cri_b, cri_c) = (
            Cri::connect(a.socket()).await?,
            Cri::connect(b.socket()).await?,
            Cri::connect(c.socket()).await?,
        );
        let (archive, pod_a, id_a, before) = checkpoint_train(&a, &cri_a, "files", "0").await?;
        let source = archive.display().to_string();

        // The process maps the versioned file, as on a real node, through the hook's link.
        let pid_a = cri_pid(&cri_a, &id_a).await?;
        let maps = std::fs::read_to_string(format!("/proc/{pid_a}/maps"))?;
        let versioned = format!("{LIB_DIR}/libcuda.so.{old}");
        ensure!(
            maps.contains(&versioned) && !maps.contains("libcuda.so.1"),
            "gpu-train does not map {versioned} (and only it):\n{maps}"
        );
        // The manifest records it: path, size, build id.
        let m = archive_manifest(&archive)?;
        let want = host_libcuda(&sim_a)?;
        ensure!(
            !want.build_id.is_empty(),
            "the simulated libcuda has no build id"
        );
        ensure!(
            m.devices.driver_files.contains(&want),
            "manifest driver files {:?}, want {want:?}",
            m.devices.driver_files
        );
        ensure!(
            m.devices.driver_version == old,
            "manifest driver {:?}, want {old}",
            m.devices.driver_version
        );

        // gpu-ckpt compat: node B refused naming the file and both versions; node C fits.
        let (ok, text) = gpu_ckpt_compat(&sim_b, &[], &archive)?;
        println!("compat on B:\n{text}");
        ensure!(
            !ok,
            "compat finds node B (driver {new}) compatible:\n{text}"
        );
        for needle in [
            versioned.as_str(),
            &format!("libcuda.so.{new}"),
            "driver_file",
        ] {
            ensure!(
                text.contains(needle),
                "compat does not name {needle}:\n{text}"
            );
        }
        let (ok, text) = gpu_ckpt_compat(&sim_c, &[], &archive)?;
        ensure!(ok, "compat refuses node C (driver {old}):\n{text}");

        // The restore handler on node B: refused naming the file and both versions, nothing
        // left running, nothing attached to node B's GPUs.
        let err = refused_restore(&cri_b, &b, &source, "0", "driver_file").await?;
        for needle in [versioned.as_str(), &old, &new] {
            ensure!(
                err.contains(needle),
                "the refusal does not name {needle}: {err}"
            );
        }
        ensure!(
            sim_b.processes()?.is_empty(),
            "a process reached node B's driver: {:?}",
            sim_b.processes()?
        );

        // restore-via-create on node B: the shim's check before CRIU (step compat) refuses it.
        let pod_b = cri_b
            .run_pod(&PodSpec::new("files", b.pod_log_root()).handler(GPU_CKPT_HANDLER))
            .await?;
        let id_b = create_from_archive(&cri_b, &pod_b, &archive, "0").await?;
        let err = match cri_b.start_container(&id_b).await {
            Ok(()) => {
                anyhow::bail!("a restore onto driver {new} of a driver {old} checkpoint started")
            }
            Err(e) => format!("{e:#}"),
        };
        println!("restore-via-create on B: {err}");
        ensure!(
            err.contains("restore failed at step compat") && err.contains(&versioned),
            "the refusal is not the check before CRIU naming {versioned}: {err}"
        );
        let left = pod_processes(&pod_b.spec.uid);
        ensure!(
            left.is_empty(),
            "the refused restore left processes: {left:?}"
        );
        ensure!(
            sim_b.processes()?.is_empty(),
            "a process reached node B's driver: {:?}",
            sim_b.processes()?
        );
        cri_b.remove_pod(&pod_b).await?;

        // With gpu-ckpt.io/on-incompatible: cold-start, node B starts it fresh, at step 1.
        let pod = cri_b
            .run_pod(
                &restore_pod("files", &b, &source)
                    .annotation("gpu-ckpt.io/on-incompatible", "cold-start"),
            )
            .await?;
        cri_b.run_container(&pod, &train_spec("train", "0")).await?;
        let fresh = wait_steps(&pod.container_log("train"), 2)?;
        ensure!(
            fresh[0].0 == 1,
            "the cold start did not start at step 1: {fresh:?}"
        );
        cri_b.remove_pod(&pod).await?;

        // The original on node A trained on through all of it.
        let log_a = pod_a.container_log("train");
        let now = last_step(&log_a).map(|s| s.0).unwrap_or_default();
        wait_steps_after(&log_a, now, 2)?;

        // Node C, same driver version, other host paths: the restore runs on from the
        // checkpoint's step.
        let pod_c = cri_c.run_pod(&restore_pod("files", &c, &source)).await?;
        cri_c
            .run_container(&pod_c, &train_spec("train", "0"))
            .await?;
        let log_c = pod_c.container_log("train");
        let resumed = wait_steps(&log_c, 2)?;
        ensure!(
            resumed[0].0 > before.saturating_sub(3) && resumed[0].0 > 1,
            "the restore on node C did not continue from step {before}: {resumed:?}"
        );
        cri_c.remove_pod(&pod_c).await?;
        cri_a.remove_pod(&pod_a).await
    })
}
