//! gpu-ckpt's OCI hooks (`gpu-ckpt-hook`) installed the containerd way, through the handler's
//! `base_runtime_spec` (written by `gpu-ckpt-hook base-spec`), on private containerd nodes with
//! the simulated driver: the createRuntime hook records the GPUs a CRI container got in its
//! bundle, and the prestart hook, which runc runs inside `runc restore`, refuses a restore whose
//! GPUs do not fit the checkpoint before any restored process runs.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::{gpu::*, *};
use anyhow::{ensure, Context, Result};
use simgpu::testing::{SimConfig, SimNode};
use test_containers::{
    cri::{ContainerSpec, Cri, PodSpec},
    gpuproc,
    stack::{Node, Stack, GPU_CKPT_HANDLER, GPU_WORKLOADS_IMAGE},
};

/// `gpu-ckpt-hook base-spec` for hooks that read the node's GPUs through `libnvml`, written to
/// `out`.
fn base_spec(hook: &Path, libnvml: &Path, out: &Path) -> Result<()> {
    let o = Command::new(hook)
        .args(["base-spec", "--hook-path"])
        .arg(hook)
        .arg("--libnvml")
        .arg(libnvml)
        .output()?;
    ensure!(
        o.status.success(),
        "gpu-ckpt-hook base-spec: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    std::fs::write(out, &o.stdout)?;
    Ok(())
}

fn train(device: &str) -> ContainerSpec {
    ContainerSpec::new("train", GPU_WORKLOADS_IMAGE)
        .command(&["/usr/bin/gpu-train"])
        .args(&["--elements", "4096", "--interval-ms", "100"])
        .annotation("cdi.k8s.io/hooks", &format!("{KIND}={device}"))
}

/// The bundle of CRI container `id` on `node`.
fn bundle(node: &Node, id: &str) -> PathBuf {
    node.paths()
        .state
        .join("io.containerd.runtime.v2.task/k8s.io")
        .join(id)
}

/// A pod of `node`'s restore handler that restores `source`.
fn restore_pod(node: &Node, source: &str) -> PodSpec {
    PodSpec::new("hooked", node.pod_log_root())
        .handler(RESTORE_HANDLER)
        .annotation("gpu-ckpt.io/restore-from", source)
}

#[test]
fn hooks_record_the_gpus_and_refuse_a_restore_that_does_not_fit() -> Result<()> {
    let stack = Stack::discover()?;
    let hook = gpuproc::binary(&stack, "gpu-ckpt-hook")?;
    let sim_a = sim_gpus(2, 256, "hooks-a")?;
    let sim_b = sim_gpus(2, 256, "hooks-b")?;
    // What node B's hooks read: node B's GPUs (the same UUIDs), but of another model than the
    // one the shim and the checkpoint see, so that only the prestart hook refuses there.
    let sim_x = sim_node(SimConfig {
        model: "NVIDIA A100-SXM4-80GB".into(),
        ..gpus_config(2, 256, "hooks-b")
    })?;
    ensure!(
        sim_x.uuids() == sim_b.uuids(),
        "the same seed gave other UUIDs"
    );
    let specs = tempfile::tempdir()?;
    let (spec_a, spec_b) = (specs.path().join("a.json"), specs.path().join("b.json"));
    base_spec(&hook, &sim_a.libnvml(), &spec_a)?;
    base_spec(&hook, &sim_x.libnvml(), &spec_b)?;
    // A GPU node whose runtime spec is `spec` (with the hooks).
    let hooked_node = |name: &str, spec: &Path, sim: &SimNode| {
        gpu_node_with(Node::builder(name)?.base_runtime_spec(spec), name, sim, &[])
    };
    let a = hooked_node("gpu-hooks-a", &spec_a, &sim_a)?;
    let b = hooked_node("gpu-hooks-b", &spec_b, &sim_b)?;
    rt().block_on(async {
        let cri_a = Cri::connect(a.socket()).await?;
        let cri_b = Cri::connect(b.socket()).await?;
        cri_a.pull_image(GPU_WORKLOADS_IMAGE).await?;
        let pod = cri_a
            .run_pod(&PodSpec::new("hooked", a.pod_log_root()).handler(GPU_CKPT_HANDLER))
            .await?;
        let id = cri_a.run_container(&pod, &train("1")).await?;
        let log = pod.container_log("train");
        wait_steps(&log, 3)?;

        // createRuntime: the hook ran (it is in the container's spec) and recorded GPU 1.
        let dir = bundle(&a, &id);
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("config.json"))?)?;
        let hooked = config["hooks"]["createRuntime"]
            .as_array()
            .is_some_and(|h| h.iter().any(|e| e["path"] == hook.display().to_string()));
        ensure!(
            hooked,
            "the container's spec has no createRuntime hook from the base spec: {}",
            config["hooks"]
        );
        let record = dir.join(image_format::compat::BUNDLE_GPUS_FILE);
        let assigned: ::gpu::assign::Assigned = serde_json::from_slice(
            &std::fs::read(&record).with_context(|| format!("no {}", record.display()))?,
        )?;
        ensure!(
            assigned
                .gpus
                .iter()
                .map(|g| g.to_string())
                .collect::<Vec<_>>()
                == vec![sim_a.uuids()[1].clone()],
            "the hook recorded {:?}, want node A's GPU 1 {}",
            assigned.gpus,
            sim_a.uuids()[1]
        );

        let archive = a.paths().dir.join("checkpoint-hooked-train.tar");
        let _ = std::fs::remove_file(&archive);
        cri_a.checkpoint_container(&id, &archive, 60).await?;
        let source = archive.display().to_string();

        // prestart, where the GPUs fit: the restore handler on node A restores onto GPU 0.
        let pod_ok = cri_a.run_pod(&restore_pod(&a, &source)).await?;
        cri_a.run_container(&pod_ok, &train("0")).await?;
        let before = last_step(&log).map(|s| s.0).unwrap_or(0);
        let restored = pod_ok.container_log("train");
        let first = wait_steps(&restored, 2)?;
        ensure!(
            first[0].0 > 1,
            "the restore under the hooks started over: {first:?} (the original is at {before})"
        );
        cri_a.remove_pod(&pod_ok).await?;

        // prestart, where they do not: node B's hooks see another model, and fail runc's
        // restore; nothing restored runs.
        let pod_b = cri_b.run_pod(&restore_pod(&b, &source)).await?;
        let err = match cri_b.run_container(&pod_b, &train("0")).await {
            Ok(id) => anyhow::bail!("the prestart hook let restore {id} start"),
            Err(e) => format!("{e:#}"),
        };
        println!("prestart refusal: {err}");
        ensure!(
            err.contains("do not fit its checkpoint") && err.contains("gpu_model"),
            "the refusal does not come from the prestart hook naming gpu_model: {err}"
        );
        ensure!(
            sim_b.processes()?.is_empty(),
            "the refused restore left GPU processes on node B"
        );
        cri_b.remove_pod(&pod_b).await?;
        cri_a.remove_pod(&pod).await
    })
}
