//! Simulated GPUs in containers through CDI, on a private containerd node: the simulated driver's
//! CDI spec (`sim.gpu-ckpt.io/gpu=<index>|all`) puts libcuda.so.1, libnvidia-ml.so.1, the daemon's
//! socket and one file per selected GPU into the container, and the CUDA workloads of the image
//! `gpu-ckpt/gpu-workloads:1` (glibc, no driver) then run on exactly the selected GPU.
//!
//! - ctr (`run --device sim.gpu-ckpt.io/gpu=N`) under the gpu-ckpt runtime and under runc-v2, so
//!   that the spec is shown to work without the project's shim too;
//! - CRI, under the gpu-ckpt handler, with the device asked for both ways kubelet can: a
//!   `cdi.k8s.io/*` annotation and the `CDI_devices` field.
//!
//! The daemon's process list (host pids, from SO_PEERCRED) shows which GPUs each container's
//! process holds a context on.

use std::time::Duration;

use crate::common::{gpu::*, *};
use anyhow::{ensure, Result};
use simgpu::testing::{SimConfig, SimNode};
use test_containers::{
    cri::{v1 as cri, ContainerSpec, Cri, PodSpec},
    stack::{Node, GPU_CKPT_HANDLER, GPU_WORKLOADS_IMAGE},
};

/// A simulated node with two GPUs and its CDI spec.
fn sim() -> Result<SimNode> {
    sim_node(SimConfig {
        gpus: 2,
        memory_mib: 512,
        ..SimConfig::default()
    })
}

/// The `device <i> uuid <uuid>` lines of gpu-fill --show-uuids, as UUIDs.
fn shown_uuids(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| {
            let l = &l[l.find("device ")?..];
            let mut w = l.split_whitespace();
            match (w.next(), w.next(), w.next(), w.next()) {
                (Some("device"), Some(_), Some("uuid"), Some(u)) => Some(u.to_string()),
                _ => None,
            }
        })
        .collect()
}

/// The ctr cases on one runtime: gpu-train on GPU 0, gpu-fill on GPU 1 and on all GPUs.
fn ctr_cases(node: &Node, sim: &SimNode, runtime: Runtime, prefix: &str) -> Result<()> {
    let uuids = sim.uuids();
    let raw: Vec<[u8; 16]> = sim.node().gpus.iter().map(|g| g.uuid).collect();
    ensure!(uuids.len() == 2, "expected two simulated GPUs: {uuids:?}");
    let dir = node.paths().dir.clone();

    // gpu-train on GPU 0: steps with checksums, and the daemon sees its process on GPU 0 only.
    let id = format!("{prefix}-train0");
    let log = dir.join(format!("{id}.log"));
    let pid = run_gpu(
        node,
        runtime,
        &format!("{KIND}=0"),
        &id,
        &log,
        &[
            "/usr/bin/gpu-train",
            "--elements",
            "4096",
            "--interval-ms",
            "50",
        ],
    )?;
    let r = (|| {
        let s = wait_steps(&log, 3)?;
        println!("{runtime:?} gpu-train on {KIND}=0: pid {pid}, steps {s:?}");
        let gpus = gpus_of(sim, pid)?;
        ensure!(
            gpus == vec![raw[0]],
            "{runtime:?}: gpu-train with {KIND}=0 uses {gpus:?}, not only GPU 0 {}",
            uuids[0]
        );
        Ok(())
    })();
    remove(node, &id);
    r?;

    // gpu-fill on GPU 1 sees exactly GPU 1's UUID, and the daemon sees it there only.
    for (device, want) in [("1", vec![uuids[1].clone()]), ("all", uuids.clone())] {
        let id = format!("{prefix}-fill-{device}");
        let log = dir.join(format!("{id}.log"));
        let pid = run_gpu(
            node,
            runtime,
            &format!("{KIND}={device}"),
            &id,
            &log,
            &["/usr/bin/gpu-fill", "--mib", "8", "--show-uuids"],
        )?;
        let r = (|| {
            let filled = wait_log_line(&log, "gpu-fill filled", |l| l.contains("filled "))?;
            let n = want.len();
            wait_log_line(&log, &format!("gpu-fill's UUID line {n}"), |l| {
                l.starts_with(&format!("device {} uuid ", n - 1))
            })?;
            let seen = shown_uuids(&std::fs::read_to_string(&log)?);
            println!("{runtime:?} gpu-fill on {KIND}={device}: {filled}; sees {seen:?}");
            ensure!(
                filled.contains(&format!("on {n} GPUs")),
                "{runtime:?} {KIND}={device}: {filled:?}"
            );
            ensure!(
                seen == want,
                "{runtime:?} {KIND}={device}: gpu-fill sees {seen:?}, want {want:?}"
            );
            let gpus = gpus_of(sim, pid)?;
            let want_raw: Vec<[u8; 16]> = match device {
                "1" => vec![raw[1]],
                _ => raw.clone(),
            };
            let mut sorted = gpus.clone();
            sorted.sort();
            let mut want_sorted = want_raw.clone();
            want_sorted.sort();
            ensure!(
                sorted == want_sorted,
                "{runtime:?} {KIND}={device}: the daemon lists pid {pid} on {gpus:?}, want {want_raw:?}"
            );
            Ok(())
        })();
        remove(node, &id);
        r?;
    }
    Ok(())
}

#[test]
fn ctr_device_under_gpu_ckpt_runtime() -> Result<()> {
    let sim = sim()?;
    let node = cdi_node("gpu-cdi-ctr", &sim)?;
    ctr_cases(&node, &sim, Runtime::GpuCkpt, "gck")?;
    ensure!(
        node.log_contains(RUNTIME),
        "containerd's log does not mention {RUNTIME}: the tasks did not run on the shim"
    );
    Ok(())
}

#[test]
fn ctr_device_under_runc_v2() -> Result<()> {
    let sim = sim()?;
    let node = cdi_node("gpu-cdi-runc", &sim)?;
    ctr_cases(&node, &sim, Runtime::RuncV2, "runc")
}

/// Without the spec, ctr refuses the device by name instead of running without a GPU.
#[test]
fn ctr_device_unknown_without_spec() -> Result<()> {
    let empty = tempfile::tempdir()?;
    let node = node_with(
        Node::builder("gpu-cdi-none")?
            .cni(false)
            .cdi(&[empty.path()]),
    )?;
    let log = node.paths().dir.join("none.log");
    let err = run_gpu(
        &node,
        Runtime::GpuCkpt,
        &format!("{KIND}=0"),
        "none",
        &log,
        &["/usr/bin/gpu-train", "--steps", "1"],
    )
    .expect_err("a CDI device without a spec must be refused");
    let msg = format!("{err:#}");
    ensure!(
        msg.contains("unresolvable CDI devices") && msg.contains(&format!("{KIND}=0")),
        "unexpected error: {msg}"
    );
    Ok(())
}

#[test]
fn cri_pod_gets_gpus_by_annotation_and_cdi_devices() -> Result<()> {
    let sim = sim()?;
    let node = cdi_node("gpu-cdi-cri", &sim)?;
    let uuids = sim.uuids();
    let raw: Vec<[u8; 16]> = sim.node().gpus.iter().map(|g| g.uuid).collect();
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        let spec = PodSpec::new("gpu-pod", node.pod_log_root()).handler(GPU_CKPT_HANDLER);
        let pod = cri.run_pod(&spec).await?;

        // GPU 0 through the annotation kubelet's device manager writes for a CDI device plugin.
        let train = ContainerSpec::new("train", GPU_WORKLOADS_IMAGE)
            .command(&["/usr/bin/gpu-train"])
            .args(&["--elements", "4096", "--interval-ms", "50"])
            .annotation("cdi.k8s.io/gpu-ckpt-sim_train", &format!("{KIND}=0"));
        let train_id = cri.run_container(&pod, &train).await?;

        // GPU 1 through ContainerConfig.CDI_devices (the DRA / device plugin field).
        let fill = ContainerSpec::new("fill", GPU_WORKLOADS_IMAGE)
            .command(&["/usr/bin/gpu-fill"])
            .args(&["--mib", "8", "--show-uuids"]);
        let mut config = fill.to_config(&pod.spec);
        config.cdi_devices = vec![cri::CdiDevice {
            name: format!("{KIND}=1"),
        }];
        let dir = pod.spec.log_directory().join("fill");
        std::fs::create_dir_all(&dir)?;
        let fill_id = cri
            .create_container_raw(&pod.id, config, pod.config.clone())
            .await?;
        cri.start_container(&fill_id).await?;

        for id in [&train_id, &fill_id] {
            cri.wait_container_state(
                id,
                cri::ContainerState::ContainerRunning,
                Duration::from_secs(20),
            )
            .await?;
        }

        let s = wait_steps(&pod.container_log("train"), 3)?;
        println!("CRI gpu-train on {KIND}=0 (annotation): steps {s:?}");
        let fill_log = pod.container_log("fill");
        wait_log_line(&fill_log, "gpu-fill's UUID", |l| l.contains(" uuid "))?;
        let seen = shown_uuids(&std::fs::read_to_string(&fill_log)?);
        println!("CRI gpu-fill on {KIND}=1 (CDI_devices): sees {seen:?}");
        ensure!(
            seen == vec![uuids[1].clone()],
            "gpu-fill with CDI_devices {KIND}=1 sees {seen:?}, want only {}",
            uuids[1]
        );

        let train_pid = cri_pid(&cri, &train_id).await?;
        let fill_pid = cri_pid(&cri, &fill_id).await?;
        let train_gpus = gpus_of(&sim, train_pid)?;
        let fill_gpus = gpus_of(&sim, fill_pid)?;
        ensure!(
            train_gpus == vec![raw[0]],
            "CRI gpu-train (pid {train_pid}) uses {train_gpus:?}, not only GPU 0"
        );
        ensure!(
            fill_gpus == vec![raw[1]],
            "CRI gpu-fill (pid {fill_pid}) uses {fill_gpus:?}, not only GPU 1"
        );

        // The containers ran on the project's shim.
        ensure!(
            !shims_of(&node).is_empty(),
            "no containerd-shim-gpu-ckpt-v1 serves the pod"
        );
        cri.remove_pod(&pod).await?;
        Ok(())
    })
}
